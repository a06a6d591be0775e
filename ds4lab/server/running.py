"""Running the app with uvicorn: :func:`build` makes the worker and the app from a model and ds4-server's
settings, :func:`serve` runs it in the foreground (``ds4lab serve``), :class:`ServerThread` in a thread of this
process (tests, a notebook). A stop (SIGTERM, Ctrl+C, ``ServerThread.stop()``) lets the step under way finish,
ends the request it belongs to, refuses what is queued and stores the live state as "shutdown"."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading

import uvicorn

from ..kv.payload import VERSION as PAYLOAD_VERSION
from ..kv.store import DEFAULT_BUDGET_MB, KVStore
from ..sampling import DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from .app import create_app
from .protocol import Limits, Sampling
from .worker import BOUNDARY_TRIM_TOKENS, DEFAULT_QUEUE_SIZE, Worker

DEFAULT_MAX_TOKENS = 393216  # ds4-server's -n/--tokens default, the most one request may ask for


def build(model, *, ctx: int, prefill_chunk: int | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
          kv_disk_dir=None, kv_disk_space_mb: float = DEFAULT_BUDGET_MB, kv_cache_min_tokens: int = 512,
          kv_cache_cold_max_tokens: int = 30000, kv_cache_continued_interval_tokens: int = 10000,
          kv_cache_boundary_trim_tokens: int = BOUNDARY_TRIM_TOKENS, kv_cache_boundary_align_tokens: int | None = None,
          kv_payload_version: int = PAYLOAD_VERSION,
          queue_size: int = DEFAULT_QUEUE_SIZE, think: str = "high", model_name: str | None = None,
          temperature: float = DEFAULT_TEMPERATURE, top_k: int = DEFAULT_TOP_K, top_p: float = DEFAULT_TOP_P,
          min_p: float = DEFAULT_MIN_P, seed: int | None = None, placement=None, cors: bool = False):
    """The worker and the Starlette app for ``model``; the keyword arguments are ``ds4lab serve``'s flags
    (``placement``: a :class:`ds4lab.Placement` of the layers, ``--gpu-device``'s; ``cors``: ``--cors``)."""
    if ctx > model.config.context_length:
        raise ValueError(f"ctx {ctx} is larger than the model's context length {model.config.context_length}")
    store = None
    if kv_disk_dir is not None:
        store = KVStore(kv_disk_dir, kv_disk_space_mb, min_tokens=kv_cache_min_tokens,
                        cold_max_tokens=kv_cache_cold_max_tokens,
                        continued_interval=kv_cache_continued_interval_tokens,
                        align=kv_cache_boundary_align_tokens or None, payload_version=kv_payload_version)
    worker = Worker(model, ctx, prefill_chunk, store, queue_size=queue_size,
                    boundary_trim=kv_cache_boundary_trim_tokens, boundary_align=kv_cache_boundary_align_tokens,
                    placement=placement)
    name = model_name or model.path.stem
    limits = Limits((name,), ctx, max_tokens, Sampling(temperature, top_k, top_p, min_p, seed), think,
                    model.is_chat)
    return worker, create_app(worker, limits, cors)


class _Server(uvicorn.Server):
    """uvicorn's server, which also tells the worker to stop at the signal: otherwise uvicorn would wait for
    the streams under way to end on their own."""

    def __init__(self, config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame) -> None:
        self.worker.stopping.set()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT and SIGTERM stop the server, which then returns (uvicorn would raise the signal again after its
        shutdown, killing the process: ds4-server exits 0 after a clean stop)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


LISTEN_BACKLOG = 2048  # uvicorn's default


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (clients that come before the server runs wait in its queue). A failure
    (the port in use, an address not of this machine, a port out of range) is an ``OSError`` naming the address as
    ``ds4lab serve``'s flags give it, and the reason. Listening at once, not only bound: two bound sockets can
    share a port, so a second serve started meanwhile would pass this and fail once its model had loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except (OSError, OverflowError) as e:
        sock.close()
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
        error = OSError(f"cannot listen on --host {host} --port {port}: {reason}")
        error.errno = getattr(e, "errno", None)
        raise error from None
    return sock


def serve(worker: Worker, app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          announce=print, sock: socket.socket | None = None) -> None:
    """Serve ``app`` until SIGINT/SIGTERM; ``announce(url)`` once the address is bound (``sock``: bound already, by
    :func:`listen`)."""
    sock = listen(host, port) if sock is None else sock
    announce(f"http://{host}:{sock.getsockname()[1]}")
    _Server(uvicorn.Config(app, log_level=log_level), worker).run(sockets=[sock])


class ServerThread:
    """``with ServerThread(model, ctx=1024, kv_disk_dir="kv") as srv:`` serves on 127.0.0.1 (a free port unless
    ``port=``) from a thread of this process; ``srv.url``, ``srv.worker``, ``srv.stop()``. Keyword arguments
    are :func:`build`'s."""

    def __init__(self, model, host: str = "127.0.0.1", port: int = 0, **settings):
        self.worker, self.app = build(model, **settings)
        self._sock = listen(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self._server = _Server(uvicorn.Config(self.app, log_level="warning"), self.worker)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name="ds4lab-uvicorn")

    def start(self) -> "ServerThread":
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread ended before it started listening")
            threading.Event().wait(0.02)
        return self

    def stop(self, timeout: float = 60) -> None:
        self.worker.stopping.set()
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
