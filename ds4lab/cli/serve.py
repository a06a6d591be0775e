"""``ds4lab serve``: ds4-server's HTTP API on one model (:mod:`ds4lab.server`, the ``server`` extra). Flags as
ds4-server names them; the address, model and disk cache go to stderr once it listens."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..kv.layout import chunk_from_env
from .common import (
    DEFAULT_CTX,
    THINK_FLAGS,
    UsageError,
    check_input,
    context_size,
    describe,
    err,
    load_model,
    thinking_mode,
)


def _host(text: str) -> str:
    """An address to listen on; an empty one is refused (the server would listen on every interface, and announce
    http://:PORT)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty address; give one such as 127.0.0.1 (0.0.0.0: every interface)")
    return text


def _port(text: str) -> int:
    """A TCP port, 0 (a free one) to 65535: refused while parsing, before the model loads."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {text!r}")
    return value


def add_serve_parser(sub) -> None:
    """``ds4lab serve``: ds4-server's flags (-m, --ctx, --prefill-chunk, -n/--max-tokens, --kv-disk-*, --kv-cache-*,
    --host, --port) and the sampling and thinking defaults of ``run``."""
    from . import _add_model_args, _add_sampling_args, _nonnegative_int, _path, _positive_int  # built by now

    sv = sub.add_parser("serve", help="serve the model over HTTP: OpenAI and Anthropic APIs, as ds4-server",
                        description="ds4-server's API: /v1/models, /v1/chat/completions, /v1/completions, "
                                    "/v1/responses, /v1/messages (Anthropic), whole or streamed; a disk KV cache "
                                    "with --kv-disk-dir; one live session reused across requests, one request at "
                                    "a time.")
    _add_model_args(sv)
    sv.add_argument("-c", "--ctx", type=_positive_int, default=None, metavar="N",
                    help=f"context size (default: {DEFAULT_CTX}, capped at the model's context length)")
    sv.add_argument("-n", "--max-tokens", "--tokens", dest="max_tokens", type=_positive_int, default=393216,
                    metavar="N", help="most tokens a request may generate, and the default (393216, as ds4-server)")
    sv.add_argument("--gpu-device", type=_gpu_list, default=None, metavar="LIST",
                    help="CUDA GPUs to split the layers over evenly, e.g. 0,1 (cupy backend)")
    sv.add_argument("--host", type=_host, default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: a free one)")
    sv.add_argument("--cors", action="store_true",
                    help="add Access-Control-Allow-* headers for browser JavaScript clients (does not change --host)")
    sv.add_argument("--queue-size", type=_positive_int, default=16, metavar="N",
                    help="requests that may wait for the model; more get 503 with Retry-After (default 16)")
    sv.add_argument("--model-name", default=None, metavar="NAME",
                    help="the name /v1/models lists (default: the GGUF file's stem)")
    sv.add_argument("--kv-disk-dir", type=_path, default=None, metavar="DIR", help="disk KV cache folder (default off)")
    sv.add_argument("--kv-disk-space-mb", type=_nonnegative_int, default=4096, metavar="MB",
                    help="disk KV cache budget (default 4096; 0 = the default)")
    sv.add_argument("--kv-cache-min-tokens", type=_nonnegative_int, default=512, metavar="N",
                    help="store no checkpoint shorter than N tokens (default 512)")
    sv.add_argument("--kv-cache-cold-max-tokens", type=_nonnegative_int, default=30000, metavar="N",
                    help="cold checkpoints for prompts up to N tokens (default 30000; 0 disables them)")
    sv.add_argument("--kv-cache-continued-interval-tokens", type=_nonnegative_int, default=10000, metavar="N",
                    help="a continued checkpoint every N tokens, rounded up to the alignment (default 10000; 0 off)")
    sv.add_argument("--kv-cache-boundary-trim-tokens", type=_nonnegative_int, default=32, metavar="N",
                    help="cold checkpoints leave out the prompt's last N tokens (default 32)")
    sv.add_argument("--kv-cache-boundary-align-tokens", type=_nonnegative_int, default=None, metavar="N",
                    help="align cold and continued checkpoints to N tokens (default: the prefill chunk step; "
                         "ds4-server aligns to 2048; 0: cold ones unaligned, continued ones on the chunk step, "
                         "where prefill passes)")
    sv.add_argument("--kv-payload-version", type=int, choices=(1, 2), default=2, metavar="{1,2}",
                    help="the DSV4 payload version of the files written: 2 (ds4 since 2026-05-26, the default) or 1, "
                         "for a folder shared with an older ds4-server, which cannot load version 2 and never "
                         "replaces a file it failed to load")
    think = sv.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const="high",
                       help="chat requests think unless they say otherwise (the default for chat models)")
    think.add_argument("--think-max", dest="think", action="store_const", const="max",
                       help="Think Max by default (when --ctx >= 393216, else normal thinking)")
    think.add_argument("--nothink", dest="think", action="store_const", const="none",
                       help="chat requests do not think unless they ask (the default for models without a chat "
                            "template, such as the embedded one)")
    sv.set_defaults(think=None)  # "high" once read: None says no thinking flag was given
    _add_sampling_args(sv, temperature_max=2, scope="requests' default ")  # 2: the APIs' range (run takes 100)
    sv.set_defaults(func=serve_command)

def _gpu_list(text: str) -> list[int]:
    """``--gpu-device``'s value, checked as it is parsed (before the backend is looked at): distinct GPU numbers."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct GPU numbers such as 0,1, got {text!r}")
    return ids


def _placement(ids: list[int] | None, backend: str):
    """``--gpu-device 0,1``: the layers split evenly over those CUDA GPUs (CuPy), as ds4-server's flag places them."""
    if ids is None:
        return None
    if backend != "cupy":
        raise UsageError(f"--gpu-device places layers on CUDA GPUs: it needs the cupy backend, got {backend}")
    from .. import Placement

    return Placement.even(len(ids), devices=[f"cuda:{i}" for i in ids])


def _kv_disk_dir(path: Path | None) -> list[Path]:
    """``--kv-disk-dir`` made as the store makes it (owner-only) before the model loads, or refused naming the flag;
    the folders this made, for :func:`_unmake` if the model or a setting is then refused. They are made here one
    level at a time as the path names them, so that the list holds what was made (``new/../kv`` makes ``new``)."""
    if path is None:
        return []
    from ..kv.store import make_store_dir

    made: list[Path] = []
    try:
        for i in range(1, len(path.parts) + 1):
            level = Path(*path.parts[:i])
            if not os.path.lexists(level):  # the parents as os.makedirs makes them; the store's own folder 0o700
                level.mkdir(mode=0o700 if i == len(path.parts) else 0o777)
                made.append(level)
        make_store_dir(path)
    except OSError as e:  # no errno: the store's refusal of a file of that name; else the system's reason
        _unmake(made)
        why = f"cannot make the folder ({e.strerror})" if e.errno else "exists and is not a folder"
        raise UsageError(f"--kv-disk-dir {path}: {why}") from None
    return made


def _unmake(made: list[Path]) -> None:
    """The folders _kv_disk_dir made, removed (the last made first) where still empty: a serve whose model or
    settings are refused leaves none behind."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:  # something was put there meanwhile, or it is gone: left as it is
            return


def serve_command(args) -> int:
    try:
        from ..server import build, serve
    except ImportError as e:
        raise UsageError(f"ds4lab serve needs the server extra ({e.name} is missing): "
                         "pip install 'ds4lab[server]'") from None
    from ..server.running import listen

    think_flag, args.think = args.think, args.think or "high"
    check_input(args.model, "-m")  # before the folder is made
    made = _kv_disk_dir(args.kv_disk_dir)
    sock = None
    try:
        sock = listen(args.host, args.port)  # before the model loads: a port in use is said at once, not after it
        model = load_model(args)
        placement = _placement(args.gpu_device, model.backend.name)
        ctx = context_size(args.ctx, model)
        worker, app = build(model, ctx=ctx, prefill_chunk=args.prefill_chunk, max_tokens=args.max_tokens,
                            kv_disk_dir=args.kv_disk_dir, kv_disk_space_mb=args.kv_disk_space_mb,
                            kv_cache_min_tokens=args.kv_cache_min_tokens,
                            kv_cache_cold_max_tokens=args.kv_cache_cold_max_tokens,
                            kv_cache_continued_interval_tokens=args.kv_cache_continued_interval_tokens,
                            kv_cache_boundary_trim_tokens=args.kv_cache_boundary_trim_tokens,
                            kv_cache_boundary_align_tokens=args.kv_cache_boundary_align_tokens,
                            kv_payload_version=args.kv_payload_version,
                            queue_size=args.queue_size, think=args.think, model_name=args.model_name,
                            temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                            placement=placement, cors=args.cors)
    except BaseException:
        if sock is not None:
            sock.close()
        _unmake(made)
        raise
    if model.is_chat:
        think = thinking_mode(args.think, ctx)
    else:
        think = "none (the model has no chat template)"
        if think_flag in ("high", "max"):
            err(f"warning: {THINK_FLAGS[think_flag]} has no effect: the model has no chat template, so no request "
                "thinks")
    legacy_chunk = chunk_from_env(ctx)  # a ds4 before bb543791 refuses a file of another chunk (its prefill cap)
    if args.kv_payload_version == 1 and worker.store is None:
        err("warning: --kv-payload-version has no effect without --kv-disk-dir (no files are written)")
    elif args.kv_payload_version == 1 and worker.session.prefill_chunk != legacy_chunk:
        err(f"warning: a ds4-server before 2026-05-23 loads only files of its own prefill chunk ({legacy_chunk} at ctx "
            f"{ctx}); this session's is {worker.session.prefill_chunk}: add --prefill-chunk {legacy_chunk}")
    disk = f"KV cache {worker.store.dir}" if worker.store is not None else "no disk KV cache"
    err(f"{describe(model)}, ctx {ctx}, prefill chunk {worker.session.prefill_chunk}, think {think}, {disk}")
    serve(worker, app, args.host, args.port, sock=sock,
          announce=lambda url: err(f"serving {url}/v1 as model {app.state.server.name!r}"))
    return 0
