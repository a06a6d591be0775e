"""The ``ds4lab`` command: ``run`` (one-shot or interactive chat), ``bench`` (ds4-bench's frontier sweep),
``inspect`` (a GGUF or ``.kv`` file) and ``make-model`` (seeded test models).

Flags follow ds4 and ds4-bench (ds4's ds4_cli.c and ds4_bench.c; README.md, "Command line"). Exit codes:
0 on success, 2 for usage errors (unknown flags, invalid numbers, conflicting options), 1 for errors while
working (a missing or unreadable file, a file that is not a model, a prompt longer than the context), 130
when interrupted outside generation. Every error is one line on stderr; ``DS4LAB_TRACEBACK=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
import struct
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
DEFAULT_SYSTEM = "You are a helpful assistant"  # ds4_cli.c; an empty --system disables it
DEFAULT_TOKENS = 50000  # ds4's -n default, clamped to the room left in the context
DEFAULT_CTX = 32768  # ds4's --ctx default, capped at the model's trained context
THINK_MAX_MIN_CTX = 393216  # ds4 downgrades Think Max to normal thinking below this context
REPL_HELP = """Commands:
  /help          Show this help.
  /think         Use normal thinking mode.
  /think-max     Use Think Max (only when the context is at least 393216 tokens).
  /nothink       Disable thinking mode.
  /ctx N         Start a new session of N tokens (the transcript is kept and prefilled again).
  /read FILE     Read a prompt from FILE and run it as the next user message.
  /stats         Show the session: tokens, KV bytes, and what the last turn reused.
  /quit, /exit   Leave the prompt (Ctrl+D too).
  Ctrl+C         Stop the current generation and return to the prompt."""


class UsageError(Exception):
    """Invalid arguments found after parsing (exit code 2)."""


# ---------------------------------------------------------------------------------------------------------
# Argument parsing


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _ranged_float(lo: float, hi: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected a number in [{lo:g}, {hi:g}], got {text!r}")
        return value

    return parse


def _seed(text: str) -> int:
    value = _nonnegative_int(text)
    if value >= 1 << 64:
        raise argparse.ArgumentTypeError(f"expected an unsigned 64-bit integer, got {text!r}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=_path, default=None, help="GGUF model file (default: the embedded model)")
    p.add_argument("--backend", default="auto", choices=["auto", "mlx", "numpy", "cupy"],
                   help="auto (default): mlx when MLX has a GPU (Metal or CUDA), else cupy when CuPy finds a CUDA "
                        "GPU, else numpy (faster than MLX on CPUs)")
    p.add_argument("--no-kernels", action="store_true",
                   help="GPU backends: the plain-ops path instead of ds4lab's custom kernels")
    p.add_argument("--device", default=None, choices=["cpu", "gpu"], help="MLX device (mlx backend only)")
    p.add_argument("--numerics", default="ds4", choices=["ds4", "exact"],
                   help="ds4 (default): FP8/FP4/F16 simulations as ds4 computes; exact: none")
    p.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="N",
                   help="prefill chunk (default: ds4's rule, DS4_METAL_PREFILL_CHUNK or 2048)")
    p.add_argument("--prefill-matmul", default="float32", choices=["float32", "tf32"],
                   help="cupy: tf32 runs a chunk's products on TF32 operands (as ds4's GPU prefill casts them to "
                        "half), about 1.7x faster prefill on an H200; float32 (default) keeps float32 accuracy")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ds4lab", description="DeepSeek V4 Flash architecture, step by step.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{run,bench,inspect,make-model}")

    run = sub.add_parser("run", help="generate from a prompt, or chat interactively without -p",
                         description="One prompt (-p or --prompt-file), or an interactive chat that keeps one "
                                     "session across turns. Text goes to stdout; progress and timings to stderr.")
    _add_model_args(run)
    src = run.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="prompt text (a user message unless --raw)")
    src.add_argument("--prompt-file", type=_path, default=None, metavar="FILE", help="read the prompt from FILE")
    run.add_argument("-sys", "--system", default=DEFAULT_SYSTEM,
                     help=f"system prompt (default: {DEFAULT_SYSTEM!r}; an empty string disables it)")
    think = run.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const="high",
                       help="thinking mode (default, as in ds4)")
    think.add_argument("--think-max", dest="think", action="store_const", const="max",
                       help=f"Think Max when --ctx >= {THINK_MAX_MIN_CTX}, otherwise normal thinking")
    think.add_argument("--nothink", dest="think", action="store_const", const="none",
                       help="non-thinking mode: the assistant turn starts with </think>")
    run.set_defaults(think=None)  # "high" (ds4's default) unless a flag says otherwise; None tells them apart
    style = run.add_mutually_exclusive_group()
    style.add_argument("--raw", dest="raw", action="store_true", default=None,
                       help="continue the prompt as plain text (no chat template, no system prompt); the default "
                            "for models without a tokenizer.chat_template, such as the embedded one")
    style.add_argument("--chat", dest="raw", action="store_false",
                       help="render the prompt as a chat turn (the default for chat models, as in ds4)")
    run.add_argument("-c", "--ctx", type=_positive_int, default=None, metavar="N",
                     help=f"context size (default: {DEFAULT_CTX}, capped at the model's context length)")
    run.add_argument("-n", "--tokens", type=_positive_int, default=DEFAULT_TOKENS, metavar="N",
                     help=f"most tokens to generate per turn (default {DEFAULT_TOKENS}, capped by the context)")
    run.add_argument("--temp", type=_ranged_float(0, 100), default=1.0, metavar="F",
                     help="temperature (default 1; 0 = greedy)")
    run.add_argument("--top-k", type=_nonnegative_int, default=0, metavar="N", help="top-k (default 0: no cap)")
    run.add_argument("--top-p", type=_ranged_float(0, 1), default=1.0, metavar="F", help="nucleus mass (default 1)")
    run.add_argument("--min-p", type=_ranged_float(0, 1), default=0.05, metavar="F",
                     help="keep tokens at least F times as likely as the top one (default 0.05)")
    run.add_argument("--seed", type=_seed, default=None, metavar="N", help="sampling seed (default: time-based)")
    run.set_defaults(func=_run)

    bench = sub.add_parser("bench", help="ds4-bench's frontier sweep: prefill and generation speed against context",
                           description="Prefill a fixed text to each frontier, time the interval, snapshot, time a "
                                       "greedy generation probe, restore, continue. One CSV row per frontier.")
    _add_model_args(bench)
    bench.add_argument("--prompt-file", type=_path, default=None, metavar="FILE",
                       help="raw benchmark text, no chat template (default: ds4's prompt, data/promessi_sposi.txt "
                            "of the checkout ds4lab runs from, else a built-in text)")
    bench.add_argument("--ctx-start", type=_positive_int, default=None, metavar="N",
                       help="first frontier (default 2048, capped at --ctx-max)")
    bench.add_argument("--ctx-max", type=_positive_int, default=None, metavar="N",
                       help="last frontier (default 32768, capped at the model's context length)")
    bench.add_argument("--ctx-alloc", type=_positive_int, default=None, metavar="N",
                       help="session context (default ctx-max + gen-tokens + 1)")
    bench.add_argument("--step-incr", type=_positive_int, default=2048, metavar="N",
                       help="linear step when --step-mul is 1 (default 2048)")
    bench.add_argument("--step-mul", type=_ranged_float(1, 1e6), default=1.0, metavar="F",
                       help="multiplicative step (default 1)")
    bench.add_argument("-n", "--gen-tokens", "--tokens", dest="gen_tokens", type=_positive_int, default=128,
                       metavar="N", help="greedy tokens generated at each frontier (default 128)")
    bench.add_argument("--csv", type=_path, default=None, metavar="FILE", help="write the CSV there instead of stdout")
    bench.add_argument("--plot", type=_path, default=None, metavar="FILE",
                       help="draw prefill and generation t/s against context with Altair (.png, .svg, .html)")
    bench.set_defaults(func=_bench)

    insp = sub.add_parser("inspect", help="describe a GGUF model file or a .kv cache file",
                          description="GGUF: header, metadata, model config, tensor table with types and bytes. "
                                      ".kv: the KV file's summary.")
    insp.add_argument("file", type=_path)
    insp.set_defaults(func=_inspect)

    mk = sub.add_parser("make-model", help="write a GGUF with seeded random weights",
                        description="Write a small GGUF model of the Flash architecture with seeded random weights "
                                    "(ds4lab.testing.make_model): the same preset and seed give the same file. "
                                    "For tests and experiments; it generates noise.")
    mk.add_argument("--preset", default="nano", choices=["nano"])
    mk.add_argument("--seed", type=_nonnegative_int, default=0)
    mk.add_argument("-o", "--output", required=True, type=_path)
    mk.set_defaults(func=_make_model)
    return p


# ---------------------------------------------------------------------------------------------------------
# Shared helpers


def _err(message: str) -> None:
    print(f"ds4lab: {message}", file=sys.stderr, flush=True)


def _check_backend_flags(name: str, device: str | None) -> None:
    """The flag combinations that make no sense (usage errors); the choice itself is
    :func:`ds4lab.backends.resolve_backend`'s, the same rule as ``ds4lab.load(backend="auto")``."""
    if name == "numpy" and device == "gpu":
        raise UsageError("--device gpu needs the mlx backend (numpy runs on the CPU)")
    if name == "cupy" and device is not None:
        raise UsageError("--device is for the mlx backend; cupy runs on the current CUDA GPU")


def _load(args):
    from . import load
    from .backends import resolve_backend

    _check_backend_flags(args.backend, args.device)
    _check_input(args.model, "-m")
    backend = resolve_backend(args.backend, args.device)
    return load(args.model, backend=backend, numerics=args.numerics,
                device=args.device if backend == "mlx" else None, kernels=False if args.no_kernels else None,
                prefill_matmul=args.prefill_matmul)


def _describe(model) -> str:
    from .backends import device_label

    return (f"{model.path.name} ({model.config.n_layer} layers, vocab {model.config.n_vocab}), {model.backend.name} "
            f"on {device_label(model.backend)}")


def _path(text: str) -> Path:
    """A file argument; an empty one is refused by name (``Path("")`` would silently mean the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def _check_input(path: Path | None, flag: str) -> None:
    """Refuse an input file that is missing, a folder or unreadable before any work, naming it."""
    if path is None:
        return
    if not path.exists():
        raise OSError(f"{flag} {path}: no such file")
    if path.is_dir():
        raise OSError(f"{flag} {path}: is a directory, not a file")
    if not os.access(path, os.R_OK):
        raise OSError(f"{flag} {path}: not readable (permission denied)")


def _check_output(path: Path | None, flag: str) -> None:
    """Refuse an output path before any work, naming it: a folder, a parent folder that is missing, not a folder
    or not writable, or an existing file that refuses writes (such as /proc/version). Nothing is created or
    truncated here."""
    if path is None:
        return
    if path.is_dir():
        raise OSError(f"{flag} {path}: is a directory; give a file name")
    parent = path.parent
    if not parent.exists():
        raise OSError(f"{flag} {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise OSError(f"{flag} {path}: {parent} is not a folder")
    if not path.exists():
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OSError(f"{flag} {path}: cannot create a file in {parent} (permission denied)")
        return
    if stat.S_ISFIFO(path.stat().st_mode):
        return  # a pipe: opening it to test would wait for a reader
    try:  # opened without truncating; a zero-byte write reaches the file system's write (procfs refuses it)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"")
        finally:
            os.close(fd)
    except OSError as e:
        raise OSError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def _named(path: Path, e: OSError) -> OSError:
    """``e`` as an error that names ``path`` (a write error such as EIO carries no file name)."""
    return OSError(f"{path}: {e.strerror or e}") if not e.filename else e


def _read_text(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except IsADirectoryError:
        raise OSError(f"{path}: is a directory") from None
    except OSError as e:
        raise OSError(f"{path}: {e.strerror or e}") from None


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


def _sync(sess, ids: list[int], progress: bool = True):
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
        return (f"prompt {self.prompt_tokens} tokens ({self.reused} reused, {self.source}; {self.evaluated} "
                f"evaluated), prefill {prefill:.2f} t/s, generation {gen:.2f} t/s ({len(self.tokens)} tokens, "
                f"{self.stop}), KV {self.kv_bytes} bytes")


def _generate(sess, args, thinking: bool, out=None) -> tuple[list[int], float, str]:
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


def _run_prompt(sess, ids: list[int], args, thinking: bool) -> Turn:
    result, prefill_seconds = _sync(sess, ids)
    tokens, gen_seconds, stop = _generate(sess, args, thinking)
    return Turn(len(ids), result.source, result.reused, result.evaluated, prefill_seconds, tokens, gen_seconds,
                stop, sess.kv_bytes)


# ---------------------------------------------------------------------------------------------------------
# run


def _effective_think(mode: str, ctx: int) -> str:
    return "high" if mode == "max" and ctx < THINK_MAX_MIN_CTX else mode


_RENDER = {"none": False, "high": True, "max": "max"}


class Chat:
    """The interactive transcript, as ds4's REPL keeps it: rendered turns plus the generated tokens and an
    EOS after each reply, synced into one session per turn so only the new part is evaluated."""

    def __init__(self, model, args, ctx: int):
        self.model = model
        self.tk = model.tokenizer
        self.args = args
        self.system = args.system
        self.think = args.think
        self.ctx = ctx
        self.sess = model.session(ctx=ctx, prefill_chunk=args.prefill_chunk)
        self.transcript = self._head()
        self.last: Turn | None = None
        self.turns = 0

    @property
    def mode(self) -> str:
        return _effective_think(self.think, self.ctx)

    def _head(self) -> list[int]:
        """BOS, the Think Max prefix when active, the system prompt."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return self.tk.render_chat(system, think=_RENDER[self.mode], add_generation_prompt=False)

    def _rehead(self, change) -> None:
        old = self._head()
        change()
        self.transcript = self._head() + self.transcript[len(old):]

    def set_think(self, mode: str) -> None:
        self._rehead(lambda: setattr(self, "think", mode))

    def set_ctx(self, ctx: int) -> None:
        def change():
            self.sess = self.model.session(ctx=ctx, prefill_chunk=self.args.prefill_chunk)
            self.ctx = ctx

        self._rehead(change)

    def user_turn(self, text: str) -> Turn:
        mode = _RENDER[self.mode]
        rendered = self.tk.render_chat([{"role": "user", "content": text}], think=mode)
        base = self.tk.render_chat([], think=mode, add_generation_prompt=False)
        rollback = len(self.transcript)
        ids = self.transcript + rendered[len(base):]
        if len(ids) >= self.ctx - 1:
            raise ValueError(_no_room(len(ids), self.ctx, "this turn (the transcript and the new message)", "/ctx"))
        if self.sess.tokens and self.sess.logits is not None:
            self.sess.checkpoint()  # free; lets a turn after an interrupted one restore instead of re-prefilling
        try:
            result, prefill_seconds = _sync(self.sess, ids)
        except BaseException:
            self.transcript = self.transcript[:rollback]
            raise
        tokens, gen_seconds, stop = _generate(self.sess, self.args, thinking=bool(mode))
        if stop == "interrupted" and not tokens:
            self.transcript = self.transcript[:rollback]  # as ds4: nothing of the turn is kept
        else:
            self.transcript = ids + tokens + [self.tk.eos_id]  # ds4 appends EOS to the transcript
        self.turns += 1
        self.last = Turn(len(ids), result.source, result.reused, result.evaluated, prefill_seconds, tokens,
                         gen_seconds, stop, self.sess.kv_bytes)
        return self.last

    def stats(self) -> str:
        s = self.sess
        line = (f"session: {len(s.tokens)}/{s.ctx} tokens (prefill chunk {s.prefill_chunk}), KV {s.kv_bytes} bytes; "
                f"transcript {len(self.transcript)} tokens; think {self.mode}")
        if self.last is not None:
            t = self.last
            line += (f"; turn {self.turns}: reused {t.reused} ({t.source}), evaluated {t.evaluated}, "
                     f"generated {len(t.tokens)} ({t.stop})")
        note = self._difference()
        return line + (f"\n  ({note})" if note else "")

    def _difference(self) -> str:
        """Why the session's token count and the transcript's differ, in words."""
        held, kept = list(self.sess.tokens), self.transcript
        if held == kept:
            return ""
        if kept[:len(held)] == held:
            extra = len(kept) - len(held)
            if not held and not self.turns:
                return (f"the transcript's {extra} tokens (the start of the chat: BOS and the system prompt) are "
                        "not in the KV cache yet: the first turn evaluates them with its message")
            if not held:
                return (f"the transcript's {extra} tokens are not in this session's KV cache yet (a new session "
                        "started): the next turn evaluates them with its message")
            if extra == 1 and kept[-1] == self.tk.eos_id:
                return ("the transcript is 1 token longer: it ends with the end-of-sequence token that ds4 "
                        "appends after each reply, and the KV cache holds only what the model has read so far; "
                        "the next turn reads that token first")
            return (f"the transcript's last {extra} tokens are not in the KV cache yet: the next turn evaluates "
                    "them with its message")
        common = next((i for i, (a, b) in enumerate(zip(held, kept)) if a != b), min(len(held), len(kept)))
        return (f"the KV cache holds {len(held) - common} tokens that are not in the transcript (an interrupted "
                f"turn, which the transcript drops as ds4 does); they share the first {common} tokens, and the "
                "next turn brings the KV cache back to the transcript, from a checkpoint where it can")


def _one_shot_ids(model, args, text: str, ctx: int) -> list[int]:
    tk = model.tokenizer
    if args.raw:
        return tk.encode(text)
    if text.startswith("<｜begin▁of▁sentence｜>"):  # an already rendered chat prompt, as ds4 accepts it
        return tk.encode_rendered(text)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    return tk.render_chat(messages, think=_RENDER[_effective_think(args.think, ctx)])


_THINK_FLAGS = {"none": "--nothink", "high": "--think", "max": "--think-max"}


def _no_room(n: int, ctx: int, what: str = "the prompt", fix: str = "--ctx") -> str:
    """The error for a prompt that leaves nothing to generate: as in ds4, generation stops one slot short of the
    context (n_predict is clamped to ctx - prompt - 1), so a prompt of ctx - 1 or more tokens gets no token."""
    return (f"{what} has {n} tokens and the context holds {ctx}: nothing is left to generate (ds4 keeps one slot "
            f"free and generates at most ctx - prompt - 1 = {max(0, ctx - n - 1)} tokens); use {fix} {n + 2} or "
            "more, or a shorter prompt")


def _run(args) -> int:
    if args.raw and args.prompt is None and args.prompt_file is None:
        raise UsageError("--raw needs -p or --prompt-file")
    if args.ctx is not None and args.ctx < 2:
        raise UsageError("--ctx must be at least 2")
    think_flag = args.think  # None: no thinking flag given
    args.think = args.think or "high"
    text = args.prompt if args.prompt is not None else None
    if args.prompt_file is not None:
        text = _read_text(args.prompt_file)
    if sys.stdout.encoding and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    model = _load(args)
    raw_by_default = args.raw is None
    if args.raw is None:
        args.raw = text is not None and not model.is_chat
    ctx = args.ctx or min(DEFAULT_CTX, model.config.context_length)
    if args.raw:
        think = "none (plain text)"
        if think_flag in ("high", "max"):
            why = "the model has no chat template" if raw_by_default else "--raw"
            _err(f"warning: {_THINK_FLAGS[think_flag]} has no effect: the prompt is continued as plain text ({why}); "
                 "add --chat to render it as a chat turn with thinking")
    else:
        if args.think == "max" and ctx < THINK_MAX_MIN_CTX:
            _err(f"warning: --think-max needs --ctx >= {THINK_MAX_MIN_CTX}; ctx={ctx} uses normal thinking")
        think = _effective_think(args.think, ctx)

    if text is None:
        return _repl(model, args, ctx)

    ids = _one_shot_ids(model, args, text, ctx)
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= ctx - 1:
        raise ValueError(_no_room(len(ids), ctx))
    sess = model.session(ctx=ctx, prefill_chunk=args.prefill_chunk)
    _err(f"{_describe(model)}, ctx {ctx}, prefill chunk {sess.prefill_chunk}, think {think}")
    turn = _run_prompt(sess, ids, args, thinking=not args.raw and think != "none")
    _err(turn.line())
    return 0


def _repl(model, args, ctx: int) -> int:
    chat = Chat(model, args, ctx)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    _err(f"{_describe(model)}, ctx {ctx}, prefill chunk {chat.sess.prefill_chunk}, think {chat.mode}")
    print(REPL_HELP, flush=True)
    while True:
        try:
            line = input("ds4lab> ")
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        cmd = line.strip()
        if not cmd:
            continue
        word, _, rest = cmd.partition(" ")
        rest = rest.strip()
        try:
            if cmd in ("/quit", "/exit"):
                return 0
            elif cmd == "/help":
                print(REPL_HELP)
            elif cmd == "/think":
                chat.set_think("high")
                print("Thinking mode: high.")
            elif cmd == "/think-max":
                chat.set_think("max")
                if chat.mode == "max":
                    print("Thinking mode: max.")
                else:
                    print(f"Thinking mode: high (Think Max needs ctx >= {THINK_MAX_MIN_CTX}).")
            elif cmd == "/nothink":
                chat.set_think("none")
                print("Thinking mode: none.")
            elif cmd == "/stats":
                print(chat.stats())
            elif word == "/ctx":
                try:
                    n = int(rest)
                except ValueError:
                    n = 0
                if n < 2:
                    _err(f"/ctx needs an integer of at least 2, got {rest!r}")
                else:
                    chat.set_ctx(n)
                    print(f"New session: ctx {n}, prefill chunk {chat.sess.prefill_chunk}.")
            elif word == "/read":
                if not rest:
                    _err("/read needs a file path")
                else:
                    _turn(chat, _read_text(Path(rest)))
            elif cmd.startswith("/"):
                _err(f"unknown command: {word} (type /help for commands)")
            else:
                _turn(chat, cmd)
        except KeyboardInterrupt:
            print()
            _err("interrupted")
        except (ValueError, OSError, RuntimeError) as e:
            _err(f"error: {e}")
        sys.stdout.flush()


def _turn(chat: Chat, text: str) -> None:
    turn = chat.user_turn(text)
    _err(turn.line())


# ---------------------------------------------------------------------------------------------------------
# bench


def _bench(args) -> int:
    from . import bench

    if args.plot is not None and args.plot.suffix.lower() not in (".png", ".svg", ".html", ".json"):
        raise UsageError(f"--plot needs a .png, .svg or .html file name, got {args.plot.name!r}")
    # Every file before any work: the outputs can be written, the inputs read.
    _check_output(args.csv, "--csv")
    _check_output(args.plot, "--plot")
    _check_input(args.model, "-m")
    if args.prompt_file is not None:
        _check_input(args.prompt_file, "--prompt-file")
        if not _read_text(args.prompt_file).strip():
            raise ValueError(f"--prompt-file {args.prompt_file}: the file is empty")
    if args.plot is not None:
        bench._import_altair()  # fail before the sweep, not after it
        if args.plot.suffix.lower() in (".png", ".svg"):
            try:
                import vl_convert  # noqa: F401
            except ImportError:
                raise bench.BenchError(f"--plot {args.plot.suffix} needs vl-convert-python: "
                                       "pip install vl-convert-python (or use a .html file name)") from None
    model = _load(args)
    cap = model.config.context_length or bench.DEFAULT_CTX_MAX
    if model.config.context_length and args.ctx_max and args.ctx_max > cap:
        raise UsageError(f"--ctx-max {args.ctx_max} is more than the model's context ({cap} tokens, "
                         f"deepseek4.context_length)")
    ctx_max = args.ctx_max or min(bench.DEFAULT_CTX_MAX, cap)
    ctx_start = args.ctx_start or min(bench.DEFAULT_CTX_START, ctx_max)
    try:
        ctx_alloc = bench.check_sweep(ctx_start, ctx_max, args.step_incr, args.step_mul, args.gen_tokens,
                                      args.ctx_alloc)
        points = bench.frontiers(ctx_start, ctx_max, args.step_incr, args.step_mul)
    except bench.BenchError as e:
        raise UsageError(str(e)) from None
    tokens, source = bench.prompt_tokens(model, args.prompt_file, min_tokens=ctx_max)
    if len(tokens) < ctx_max:  # before the CSV header, not after it
        raise ValueError(f"{source}: the prompt has {len(tokens)} tokens, need at least ctx_max = {ctx_max}")
    sess = model.session(ctx=ctx_alloc, prefill_chunk=args.prefill_chunk, max_checkpoints=2)
    _err(f"bench: {_describe(model)}, ctx {ctx_alloc}, prefill chunk {sess.prefill_chunk}, "
         f"prompt {source} ({len(tokens)} tokens), {len(points)} frontiers {points[0]}..{points[-1]}, "
         f"{args.gen_tokens} generated tokens each")
    rows = bench.sweep(model, tokens, ctx_start, ctx_max, args.step_incr, args.step_mul, args.gen_tokens,
                       session=sess)
    began = time.perf_counter()
    if args.csv is None:
        done = bench.write_csv(rows, sys.stdout)
    else:
        try:
            out = open(args.csv, "w", encoding="utf-8")
        except OSError as e:
            raise _named(args.csv, e) from None
        with out:
            done = bench.write_csv(_echo_rows(rows), _NamedWrites(out, args.csv))
    _err(f"bench: {len(done)} frontiers in {time.perf_counter() - began:.1f} s"
         + (f", CSV in {args.csv}" if args.csv else ""))
    if args.plot is not None:
        try:
            bench.save_plot(done, args.plot, title=f"{model.path.name} ({model.backend.name}), prefill chunk "
                                                   f"{sess.prefill_chunk}, {args.gen_tokens} generated tokens")
        except OSError as e:
            raise _named(args.plot, e) from None
        _err(f"bench: plot in {args.plot}")
    return 0


class _NamedWrites:
    """A text file whose write and flush errors name it (EIO from a write carries no file name)."""

    def __init__(self, out, path: Path):
        self.out, self.path = out, path

    def write(self, text: str) -> int:
        try:
            return self.out.write(text)
        except OSError as e:
            raise _named(self.path, e) from None

    def flush(self) -> None:
        try:
            self.out.flush()
        except OSError as e:
            raise _named(self.path, e) from None


def _echo_rows(rows):
    for row in rows:
        _err(f"bench: ctx {row.ctx_tokens}: prefill {row.prefill_tps:.2f} t/s, generation {row.gen_tps:.2f} t/s, "
             f"KV {row.kvcache_bytes} bytes")
        yield row


# ---------------------------------------------------------------------------------------------------------
# inspect


def _inspect(args) -> int:
    path: Path = args.file
    if not path.exists():
        raise OSError(f"{path}: no such file")
    if not path.is_file():
        raise OSError(f"{path}: not a regular file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"GGUF" or path.suffix.lower() == ".gguf":
        return _inspect_gguf(path)
    if magic[:3] == b"KVC":
        return _inspect_kv(path)
    raise ValueError(f"{path}: neither a GGUF model nor a KVC cache file: it starts with {magic!r}, expected "
                     "b'GGUF' (a model) or b'KVC' (a .kv file)")


def _inspect_kv(path: Path) -> int:
    """Print a ``.kv`` file's summary and its checksum verdict (ok / mismatch / none). A mismatch, or a file whose
    structure does not parse, exits non-zero after printing what can be read (the header, the checksum)."""
    try:
        from .kv.kvfile import KVFile, KVFileError
    except ImportError:
        raise RuntimeError(f"{path}: not a GGUF file, and this version of ds4lab cannot read .kv files "
                           "(ds4lab.kv.kvfile is missing)") from None
    try:
        kf = KVFile.open(path)
    except KVFileError:
        _inspect_kv_damaged(path)
        raise  # one error line, exit 1
    print(kf.summary())
    state, verdict = kf.checksum_status()
    print(f"checksum: {verdict}")
    if state == "mismatch":
        _err(f"error: {path}: checksum mismatch: the file is damaged (ds4lab's store would remove it)")
        return EXIT_RUNTIME
    return 0


def _inspect_kv_damaged(path: Path) -> None:
    """What a ``.kv`` file that does not parse still shows: its size, fixed header and checksum verdict."""
    import mmap

    from .kv.kvfile import KVFileError, KVHeader, checksum_status, open_regular

    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, KVFileError, ValueError):
        return
    print(f"{path}: {size:,} bytes (damaged: see the error below)")
    try:
        header = KVHeader.unpack(data, path)
    except KVFileError:
        pass
    else:
        print("KVC header: " + ", ".join(f"{k} {v}" for k, v in header.as_dict().items()))
    print(f"checksum: {checksum_status(data, path)[1]}")


def _show_value(value, type_name: str) -> str:
    if type_name.startswith("ARRAY"):
        items = list(value)
        shown = ", ".join(_short(v) for v in items[:6])
        return f"[{shown}]" if len(items) <= 6 else f"{len(items)} items: [{shown}, ...]"
    return _short(value)


def _short(value, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _inspect_gguf(path: Path) -> int:
    from .config import ModelConfig
    from .gguf_file import GGUFModelFile

    f = GGUFModelFile.open(path)  # refuses a damaged file with a one-line ModelFileError
    with path.open("rb") as fh:
        _, version = struct.unpack("<4sI", fh.read(8))
    total = sum(t.nbytes for t in f.tensors.values())
    print(f"{path}: GGUF v{version}, {f.file_size:,} bytes, {len(f.metadata)} metadata keys, "
          f"{len(f.tensors)} tensors ({total:,} bytes of tensor data), alignment {f.alignment}")

    print("\nmetadata")
    width = max((len(k) for k in f.metadata), default=0)
    for key, (value, type_name) in f.metadata.items():
        print(f"  {key:<{width}}  {type_name:<14} {_show_value(value, type_name)}")

    print("\nconfig")
    problem = None
    try:
        cfg = ModelConfig.from_metadata(f.metadata, str(path))
        cfg.validate_tensors({n: (t.shape, t.qtype) for n, t in f.tensors.items()}, str(path))
    except ValueError as e:
        problem = str(e)
        print(f"  not a valid ds4 model: {problem}")
    else:
        for field in fields(cfg):
            print(f"  {field.name:<26} {getattr(cfg, field.name)}")
        ratios = [cfg.ratio(il) for il in range(cfg.n_layer)]
        print(f"  {'(layer ratios)':<26} {ratios}")

    print("\ntensors")
    name_w = max((len(n) for n in f.tensors), default=4)
    print(f"  {'name':<{name_w}}  {'type':<8} {'shape (ne0 first)':<22} {'bytes':>14}")
    by_type: dict[str, list[int]] = {}
    for name, t in f.tensors.items():
        shape = " x ".join(str(d) for d in t.shape)
        print(f"  {name:<{name_w}}  {t.qtype.name:<8} {shape:<22} {t.nbytes:>14,}")
        acc = by_type.setdefault(t.qtype.name, [0, 0])
        acc[0] += 1
        acc[1] += t.nbytes
    print("\nby type")
    for type_name, (count, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        print(f"  {type_name:<8} {count:5d} tensors {nbytes:>16,} bytes")
    print(f"  {'total':<8} {len(f.tensors):5d} tensors {total:>16,} bytes")
    if problem is not None:
        _err(f"error: {problem}")
        return EXIT_RUNTIME
    return 0


# ---------------------------------------------------------------------------------------------------------
# make-model


def _make_model(args) -> int:
    from .config import PRESETS
    from .testing import make_model

    _check_output(args.output, "-o")
    try:
        path = make_model(PRESETS[args.preset], args.output, seed=args.seed)
    except OSError as e:  # the writer's error names its hidden temporary file: name the requested one
        raise OSError(f"-o {args.output}: {e.strerror or e}") from None
    print(path)
    return 0


# ---------------------------------------------------------------------------------------------------------


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    text = str(e).strip().splitlines()
    text = text[0] if text else ""
    if isinstance(e, (ValueError, OSError, RuntimeError)):
        return text or type(e).__name__
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _unknown_leading_options(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Options given before the command that ``ds4lab`` itself does not take (it takes only -h): argparse would
    report the missing command instead of naming them."""
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    unknown = []
    for arg in argv:
        if arg in commands or arg == "--":
            break
        if arg.startswith("-") and arg not in ("-h", "--help"):
            unknown.append(arg)
    return unknown


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    unknown = _unknown_leading_options(parser, argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args = parser.parse_args(argv)  # usage errors exit 2 here, with one line
    try:
        return args.func(args)
    except UsageError as e:
        print(f"ds4lab {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `ds4lab bench | head -3`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_RUNTIME
    except Exception as e:
        if os.environ.get("DS4LAB_TRACEBACK"):
            raise
        _err(f"error: {_message(e)}")
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
