"""The one model, its one live session and the thread that runs requests on it one at a time, as ds4-server's
worker does: a bounded queue in front (a full one refuses with 503), each request synced into the live session
(only what is new is evaluated), sampled one token per step, its events handed to the waiting HTTP handler.

The disk cache follows ds4-server's schedule (ds4_server.c's generate_job; docs/FORMATS.md, "KVC files and the
KV store"): the session saves "continued" and "evict" checkpoints itself (``Session(kv_store=)``); the worker adds
the "cold" one (a request that reuses nothing, its prompt in [min_tokens, cold_max_tokens]: the prefix up to the
last user turn before the first assistant one, else the prompt less the boundary trim rounded down to the
boundary alignment, is synced, stored, then extended) and the "shutdown" one (the live state, on a clean stop).
A request whose client went away, or a stop, ends after the step under way; a step is never cut."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import asdict, dataclass

from ..kv.checkpoint import model_fingerprint
from ..kv.store import routed_quant_bits, token_text
from ..session import SyncResult
from ..tokenizer import EOS, THINK, THINK_END
from .channels import Channels
from .prompt import tool_context
from .protocol import Request, RequestError
from .tools import StructureTracker, ToolBlocks

DEFAULT_QUEUE_SIZE = 16
BOUNDARY_TRIM_TOKENS = 32  # ds4-server's --kv-cache-boundary-trim-tokens


class _Stopped(Exception):
    """Raised between prefill chunks when the request was cancelled or the server stops."""


@dataclass(frozen=True)
class Outcome:
    """A finished request's numbers; ``finish`` is "stop" (EOS or a stop string), "tool_calls" (a tool block closed),
    "length" (max_tokens or the context), "cancelled" (the client left) or "shutdown"."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish: str
    stop: str | None
    source: str  # where the reused prefix came from: live, checkpoint, disk or cold
    prefill_seconds: float
    decode_seconds: float
    reasoning_tokens: int = 0  # of completion_tokens, those before </think> (the one holding it included)
    in_reasoning: bool = False  # the generation ended before </think> (thinking on): its reasoning is unfinished


class Job:
    """One queued request and the events its handler waits on: ("start", prompt_tokens, cached_tokens),
    ("text", channel, text), in a streamed reply ("call", index, key, name) and ("args", index, text) (a tool call
    as the model writes it: its start, its arguments' JSON in pieces), ("calls", [ToolCall]) (the reply's tool calls,
    before its "done"), ("done", Outcome), ("error", RequestError)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody waits for it
            pass


class Worker:
    """``Worker(model, ctx=, prefill_chunk=, store=, placement=)``: ``submit(job)`` queues, ``start()`` runs the thread,
    ``close()`` finishes the step under way, refuses what is queued and saves the "shutdown" checkpoint."""

    def __init__(self, model, ctx: int, prefill_chunk: int | None = None, store=None,
                 queue_size: int = DEFAULT_QUEUE_SIZE, boundary_trim: int = BOUNDARY_TRIM_TOKENS,
                 boundary_align: int | None = None, placement=None):
        self.model = model
        self.store = store
        self.session = model.session(ctx=ctx, prefill_chunk=prefill_chunk, kv_store=store, placement=placement)
        self.boundary_trim = boundary_trim
        # ds4 aligns cold checkpoints to 2048 (its prefill chunk at 8d57664): here the session's chunk step unless given
        self.boundary_align = self.session.geometry.step if boundary_align is None else boundary_align
        self.queue_size = queue_size
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._loop, name="ds4lab-serve", daemon=True)
        self.stopping = threading.Event()
        self.running: Job | None = None
        self.counts = dict.fromkeys(("requests", "refused", "cancelled", "errors", "prompt_tokens", "cached_tokens",
                                     "completion_tokens"), 0)
        # ds4-server's "thinking-visible" key: after a thinking reply, the text the next turn's prompt will start
        # with (its reasoning left out) and the live length it stands for (_visible_continuation)
        self.visible: tuple[str, int] | None = None
        self.tool_blocks = ToolBlocks()  # the blocks the model wrote, by their calls' keys (read by the parser)

    # -- the queue ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise RequestError("the server is shutting down", status=503, type="server_error", code="shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.counts["refused"] += 1
            raise RequestError(f"the server is busy: {self.queue_size} requests are waiting for the model "
                               "(--queue-size); retry later", status=503, type="server_error",
                               code="server_busy") from None

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float | None = None) -> None:
        """Stop: the request under way ends after its current step, queued ones are refused; then the live
        state is stored as "shutdown" (ds4-server's clean exit; the store skips it below min_tokens)."""
        self.stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.store is not None and self.session.tokens and self.session.logits is not None:
            self.store.save(self.session.snapshot(), self.model, reason="shutdown")

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self.stopping.is_set():
                    return
                continue
            if self.stopping.is_set():
                job.emit("error", RequestError("the server is shutting down", status=503, type="server_error",
                                               code="shutting_down"))
                continue
            if job.cancelled.is_set():  # the client left while it waited
                self.counts["cancelled"] += 1
                continue
            self.running = job
            try:
                self._run(job)
            except Exception as e:  # a failure of the engine, not of the input (that was checked before)
                self.counts["errors"] += 1
                job.emit("error", RequestError(f"generation failed: {type(e).__name__}: {e}", status=500,
                                               type="server_error", code="internal_error"))
            finally:
                self.running = None

    # -- one request --------------------------------------------------------------------------------------
    def _run(self, job: Job) -> None:
        req, sess = job.request, self.session
        self.counts["requests"] += 1
        began = time.perf_counter()
        live = sess.tokens
        visible = None if live and req.prompt[:len(live)] == live else self._visible_continuation(req)
        ids = visible or self._continuation(req.prompt)
        if visible is None:
            self.visible = None  # a turn that did not continue from it: the key is stale (ds4-server's rule)
        try:
            result = self._sync(ids, job)
        except _Stopped:
            self.counts["cancelled"] += 1
            job.emit("done", Outcome(len(ids), 0, 0, "cancelled" if job.cancelled.is_set() else "shutdown", None,
                                     "cold", time.perf_counter() - began, 0.0))
            return
        last = sess.checkpoints[-1] if sess.checkpoints else None
        if last is None or len(last) != len(sess.tokens) or last.logits is not sess.logits:  # a prefill's last
            sess.checkpoint()  # chunk kept it already; a repeat of this prompt restores exactly this state
        prefill_seconds = time.perf_counter() - began
        job.emit("start", len(ids), result.reused)
        sampling = req.sampling.for_thinking() if req.thinking else req.sampling  # ds4-server's rule
        decode = sess.decoder(**sampling.params(), top=1)
        # a text completion is sent as one text, reasoning and </think> included, its stops looked for in all of
        # it (ds4-server parses only a chat reply)
        channels = Channels(req.thinking and req.api != "completion", req.stop, tools=bool(req.tools),
                            live=req.stream, first_only=not req.parallel)
        # a tool block's tags and punctuation sampled greedily, its payload as asked (ds4-server's rule)
        structure = StructureTracker() if req.tools else None
        room = sess.ctx - len(sess.tokens) - 1  # ds4 keeps one slot free
        generated, reasoning, finish, answer = 0, 0, "length", ""
        began = time.perf_counter()
        n = max(0, min(req.max_tokens, room))
        for i in range(n):
            if job.cancelled.is_set() or self.stopping.is_set():
                finish = "cancelled" if job.cancelled.is_set() else "shutdown"
                break
            step = decode.step(more=i + 1 < n, greedy=structure is not None and structure.structure)
            if decode.stop_reason == "eos":
                finish = "stop"
                break
            generated += 1
            reasoning += channels.channel == "reasoning"
            if structure is not None:
                structure.feed(step.text)
            answer += self._emit(job, channels.feed(step.text))
            if channels.ended:
                finish = "tool_calls" if channels.calls else "stop"
                break
        answer += self._emit(job, channels.flush())
        if channels.calls and finish in ("stop", "length"):  # a first call finished, the rest not: the reply's
            finish = "tool_calls"
        if channels.calls:
            if channels.block:  # (none kept where a streamed reply ended with its first call)
                self.tool_blocks.remember(channels.calls, channels.block)
            job.emit("calls", channels.calls if req.parallel else channels.calls[:1])
        self._remember_visible(req, finish, answer, channels.channel == "reasoning")
        if finish == "cancelled":
            self.counts["cancelled"] += 1
        c = self.counts
        c["prompt_tokens"] += len(ids)
        c["cached_tokens"] += result.reused
        c["completion_tokens"] += generated
        if channels.error and finish not in ("cancelled", "shutdown"):  # a streamed call the model never finished
            c["errors"] += 1
            job.emit("error", RequestError(channels.error, status=500, type="server_error", code="invalid_tool_call"))
            return
        job.emit("done", Outcome(len(ids), result.reused, generated, finish, channels.stop, result.source,
                                 prefill_seconds, time.perf_counter() - began, reasoning,
                                 channels.channel == "reasoning"))

    @staticmethod
    def _emit(job: Job, items: list) -> str:
        """Hands the channels' items to the job (a streamed call's pieces only where all calls are sent, or it is
        the first); returns the answer's text among them."""
        answer = ""
        for kind, value in items:
            if kind in ("reasoning", "text"):
                job.emit("text", kind, value)
                answer += value if kind == "text" else ""
            elif job.request.parallel or value[0] == 0:
                job.emit(kind, *value)
        return answer

    def _remember_visible(self, req: Request, finish: str, answer: str, in_reasoning: bool) -> None:
        """After a chat reply (not a text completion) that thought and closed its thinking, ds4-server keeps the text
        the next turn's prompt starts with, which leaves the reasoning out (the prompt without its closing "<think>",
        then "</think>", the answer and EOS), as a key to the live tokens, which hold the reasoning
        (build_toolless_thinking_visible_text); not where tools are in the conversation (its prompt keeps every
        reasoning) or a reply ended unfinished."""
        if (req.thinking and req.api != "completion" and req.text.endswith(THINK)
                and not tool_context(req.messages, req.tools) and finish == "stop" and not in_reasoning):
            self.visible = (req.text[: -len(THINK)] + THINK_END + answer + EOS, len(self.session.tokens))
        else:
            self.visible = None

    def _visible_continuation(self, req: Request) -> list[int] | None:
        """ds4-server's "thinking-visible" reuse (thinking_live_visible_prefix_prompt): a chat prompt (not the Responses
        API's nor a text completion's) whose text extends the text kept after the last thinking reply continues from the
        live tokens, reasoning and all, then the rest of its text tokenized as rendered chat text; else None."""
        if self.visible is None or req.api in ("responses", "completion"):
            return None
        text, live_len = self.visible
        live = self.session.tokens
        if live_len != len(live) or not (len(text) < len(req.text) and req.text.startswith(text)):
            return None
        return self._live_then(req.text[len(text):])

    def _live_then(self, text: str) -> list[int] | None:
        """The live tokens, then ``text`` tokenized as rendered chat text (ds4_kvstore.c's
        build_prompt_from_exact_prefix_and_text_suffix); None where that leaves nothing to generate."""
        out = list(self.session.tokens) + self.model.tokenizer.encode_rendered(text)
        return out if len(out) < self.session.ctx - 1 else None

    def _continuation(self, ids: list[int]) -> list[int]:
        """ds4-server's "memory-text" reuse: when the live tokens are not a prefix of ``ids`` but their text is a
        prefix of the prompt's text (a reply the client sends back re-tokenized differently), the prompt becomes
        the live tokens, then the rest of the prompt's text tokenized as rendered chat text (special tokens where
        their text is: ds4_kvstore.c's build_prompt_from_exact_prefix_and_text_suffix); otherwise ``ids``."""
        live = self.session.tokens
        if not live or ids[:len(live)] == live:
            return ids
        tk = self.model.tokenizer
        held, text = token_text(tk, live), token_text(tk, ids)
        if not text.startswith(held):
            return ids
        try:
            rest = text[len(held):].decode("utf-8")
        except UnicodeDecodeError:  # the live text ends inside a character
            return ids
        return self._live_then(rest) or ids

    def _sync(self, ids: list[int], job: Job) -> SyncResult:
        sess, store = self.session, self.store

        def check(_chunk) -> None:
            if job.cancelled.is_set() or self.stopping.is_set():
                raise _Stopped

        cold = self._cold_length(ids) if store is not None else 0
        if 0 < cold < len(ids):  # ds4: sync to the stable prefix, store it, then the rest
            sess.sync(ids[:cold], on_chunk=check)
            store.save(sess.snapshot(), self.model, reason="cold")
            sess.sync(ids, on_chunk=check)
            return SyncResult("cold", 0, len(ids))
        result = sess.sync(ids, on_chunk=check)
        if cold:
            store.save(sess.snapshot(), self.model, reason="cold")
        return result

    def _cold_length(self, ids: list[int]) -> int:
        """The prefix ds4-server stores as "cold" for this prompt, or 0 when none is (it reuses something, or its
        length is outside [min_tokens, cold_max_tokens]); ds4_kvstore.c's chat_anchor_pos and store_len."""
        store, n = self.store, len(ids)
        if not (0 < store.cold_max_tokens and store.min_tokens <= n <= store.cold_max_tokens) or self._reuses(ids):
            return 0
        tk = self.model.tokenizer
        anchor = -1
        for i, token in enumerate(ids):
            if token == tk.assistant_id:
                break
            if token == tk.user_id:
                anchor = i
        if anchor >= store.min_tokens:
            return anchor
        if n > store.min_tokens + self.boundary_trim:
            stable = n - self.boundary_trim
            if self.boundary_align > 0:
                stable -= stable % self.boundary_align
            if stable >= store.min_tokens:
                return stable
        return n

    def _reuses(self, ids: list[int]) -> bool:
        """Whether ``sync(ids)`` would reuse a prefix: the live tokens, a kept checkpoint or a stored file."""
        sess = self.session
        if sess.tokens and ids[:len(sess.tokens)] == sess.tokens:
            return True
        if any(0 < len(cp) <= len(ids) and cp.logits is not None and list(cp.tokens) == ids[:len(cp)]
               for cp in sess.checkpoints):
            return True
        found = self.store.candidates(token_text(self.model.tokenizer, ids), sess.ctx,
                                      routed_quant_bits(self.model), model_fingerprint(self.model))
        return any(e.tokens <= len(ids) for e in found)

    # -- what a notebook or a load test reads -------------------------------------------------------------
    def stats(self) -> dict:
        c = dict(self.counts)
        c["cache_hit_rate"] = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
        c.update(queued=self.queued, queue_size=self.queue_size, running=self.running is not None,
                 session_tokens=len(self.session.tokens), ctx=self.session.ctx,
                 prefill_chunk=self.session.prefill_chunk)
        if self.store is not None:
            store = asdict(self.store.stats())
            store.pop("effective_hits")
            c["store"] = dict(store, dir=str(self.store.dir))
        return c
