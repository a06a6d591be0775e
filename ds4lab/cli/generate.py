"""One prompt's turn, shared by ``ds4lab run -p`` and the chat: sync the session with prefill progress on stderr,
stream the sampled text to stdout (:class:`TextPrinter` drops the think tags), and the numbers of the turn
(:class:`Turn`, the line printed after it)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from ..text_table import plural


class _Progress:
    """Prefill progress on stderr: one updating line on a terminal, one line per chunk otherwise."""

    def __init__(self, total: int, stream=None):
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def update(self, done: int) -> None:
        if self.total <= 0:
            return
        pct = 100.0 * done / self.total
        line = f"prefill: {done}/{self.total} tokens ({pct:.1f}%)"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K" + ("\n" if done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def sync(sess, ids: list[int], progress: bool = True):
    """``sess.sync(ids)`` with prefill progress on stderr, counted from the first evaluated token.
    Returns (SyncResult, seconds)."""
    first: dict[str, int] = {}

    def show(chunk) -> None:
        start = first.setdefault("start", chunk.start)
        _Progress(len(ids) - start).update(chunk.end - start)

    began = time.perf_counter()
    result = sess.sync(ids, on_chunk=show if progress else None)
    return result, time.perf_counter() - began


class TextPrinter:
    """Streams generated text; in thinking mode drops the ``<think>``/``</think>`` tags, shows the
    reasoning grey on a terminal and ends it with a newline, as ds4's token printer does."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, out, thinking: bool, color: bool | None = None):
        self.out = out
        self.format = thinking
        self.in_think = thinking
        self.color = out.isatty() if color is None else color
        self.grey = False
        self.pending = ""
        self.last_newline = True

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self.in_think and self.color and not self.grey:
            self.out.write("\x1b[90m")
            self.grey = True
        self.out.write(text)
        self.last_newline = text.endswith("\n")

    def _reset(self) -> None:
        if self.grey:
            self.out.write("\x1b[0m")
            self.grey = False

    def write(self, text: str) -> None:
        if not self.format:
            self._emit(text)
        else:
            buf, self.pending = self.pending + text, ""
            i = 0
            while i < len(buf):
                rest = buf[i:]
                if rest.startswith(self.OPEN):
                    self.in_think = True
                    i += len(self.OPEN)
                elif rest.startswith(self.CLOSE):
                    self.in_think = False
                    self._reset()
                    if not self.last_newline:
                        self._emit("\n")
                    i += len(self.CLOSE)
                elif rest[0] == "<" and (self.OPEN.startswith(rest) or self.CLOSE.startswith(rest)):
                    self.pending = rest  # a tag may be split across tokens
                    break
                else:
                    j = buf.find("<", i + 1)
                    j = len(buf) if j < 0 else j
                    self._emit(buf[i:j])
                    i = j
        self.out.flush()

    def finish(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, ""
            self._emit(pending)
        self._reset()
        if not self.last_newline:
            self.out.write("\n")
            self.last_newline = True
        self.out.flush()


@dataclass
class Turn:
    """One prompt's numbers: the sync and the generation."""

    prompt_tokens: int
    source: str
    reused: int
    evaluated: int
    prefill_seconds: float
    tokens: list
    gen_seconds: float
    stop: str
    kv_bytes: int

    def line(self) -> str:
        prefill = self.evaluated / self.prefill_seconds if self.prefill_seconds > 0 and self.evaluated else 0.0
        gen = len(self.tokens) / self.gen_seconds if self.gen_seconds > 0 and self.tokens else 0.0
        # one format whatever the counts ("1 tokens" too): scripts and tests parse this line
        return (f"prompt {self.prompt_tokens} tokens ({self.reused} reused, {self.source}; {self.evaluated} "
                f"evaluated), prefill {prefill:.2f} t/s, generation {gen:.2f} t/s ({len(self.tokens)} tokens, "
                f"{self.stop}), KV {self.kv_bytes} bytes")


def generate(sess, args, thinking: bool, out=None) -> tuple[list[int], float, str]:
    """Sample up to ``args.tokens`` tokens (fewer if the context fills up) and stream their text.
    Ctrl+C stops generation; the session keeps every token evaluated so far."""
    out = out or sys.stdout
    room = sess.ctx - len(sess.tokens) - 1  # ds4 keeps one slot free
    n = max(0, min(args.tokens, room))
    decode = sess.decoder(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, top=1)
    printer = TextPrinter(out, thinking)
    tokens: list[int] = []
    began = time.perf_counter()
    try:
        for step in decode.stream(n):
            tokens.append(step.token)
            printer.write(step.text)
        stop = decode.stop_reason or "length"
        if stop == "length" and n < args.tokens:
            stop = "ctx"
    except KeyboardInterrupt:
        stop = "interrupted"
    seconds = time.perf_counter() - began
    printer.finish()
    return tokens, seconds, stop


def run_prompt(sess, ids: list[int], args, thinking: bool) -> Turn:
    result, prefill_seconds = sync(sess, ids)
    tokens, gen_seconds, stop = generate(sess, args, thinking)
    return Turn(len(ids), result.source, result.reused, result.evaluated, prefill_seconds, tokens, gen_seconds,
                stop, sess.kv_bytes)


def no_room(n: int, ctx: int, what: str = "the prompt", fix: str = "--ctx", most: int | None = None) -> str:
    """The error for a prompt that leaves nothing to generate: as in ds4, generation stops one slot short of the
    context (n_predict is clamped to ctx - prompt - 1), so a prompt of ctx - 1 or more tokens gets no token.
    ``most``: the model's context length, past which no ``fix`` can go (the message then asks for fewer tokens)."""
    problem = (f"{what} has {plural(n, 'token')} and the context holds {ctx}: nothing is left to generate (ds4 "
               f"keeps one slot free and generates at most ctx - prompt - 1 tokens: {ctx} - {n} - 1 = {ctx - n - 1}, "
               "none)")
    if most and n + 2 > most:  # no context the model takes has room: the prompt must shrink
        raise_ctx = f"use {fix} {most} and " if ctx < most else ""
        return (f"{problem}; the model's context is at most {most} tokens: {raise_ctx}shorten {what} to at most "
                f"{most - 2} tokens")
    return f"{problem}; use {fix} {n + 2} or more, or a shorter prompt"

