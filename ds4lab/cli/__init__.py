"""The ``ds4lab`` command: ``run`` (one-shot or interactive chat), ``serve`` (ds4-server's HTTP API), ``bench``
(ds4-bench's frontier sweep), ``inspect`` (a GGUF or ``.kv`` file) and ``make-model`` (seeded test models).

Flags follow ds4 and ds4-bench (ds4's ds4_cli.c and ds4_bench.c; README.md, "Command line"). Exit codes:
0 on success, 2 for usage errors (unknown flags, invalid numbers, conflicting options), 1 for errors while
working (a missing or unreadable file, a file that is not a model, a prompt longer than the context), 130
when interrupted outside generation. Every error is one line on stderr; ``DS4LAB_TRACEBACK=1`` shows the traceback.

This module holds the argument parser and the dispatch (:func:`main`); each command lives in its own module:
``run`` (:mod:`.run`, its chat in :mod:`.chat`, the turn both share in :mod:`.generate`), ``serve``
(:mod:`.serve`), ``bench`` (:mod:`.bench`), ``inspect`` (:mod:`.inspect_file`), ``make-model``
(:mod:`.make_model`); :mod:`.common` holds what they share.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from pathlib import Path

from .. import __version__
from ..bench import (
    DEFAULT_CTX_MAX,
    DEFAULT_CTX_START,
    DEFAULT_GEN_TOKENS,
    DEFAULT_STEP_INCR,
    DEFAULT_STEP_MUL,
    DEFAULT_WARMUP,
)
from ..platform_support import require_processes
from ..tokenizer import THINK_MAX_MIN_CTX
from .bench import bench_command
from .common import (
    DEFAULT_CTX,
    DEFAULT_SYSTEM,
    DEFAULT_TOKENS,
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    EXIT_USAGE,
    UsageError,
    decoded,
    err,
    named_stdout,
)
from .inspect_file import inspect_command
from .make_model import make_model_command
from .run import run_command
from .serve import add_serve_parser

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


def _path(text: str) -> Path:
    """A file argument; an empty one is refused by name (``Path("")`` would silently mean the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def _add_sampling_args(p: argparse.ArgumentParser, temperature_max: float, scope: str = "") -> None:
    """--temp, --top-k, --top-p, --min-p and --seed (``scope``: what they set, e.g. serve's per-request defaults)."""
    p.add_argument("--temp", type=_ranged_float(0, temperature_max), default=1.0, metavar="F",
                   help=f"{scope}temperature (default 1; 0 = greedy; at most {temperature_max:g})")
    p.add_argument("--top-k", type=_nonnegative_int, default=0, metavar="N",
                   help=f"{scope}top-k (default 0: no cap; more than 1024 is 1024, as in ds4)")
    p.add_argument("--top-p", type=_ranged_float(0, 1), default=1.0, metavar="F",
                   help=f"{scope}nucleus mass top-p (default 1; 0 is taken as 1, no cut, as in ds4)")
    p.add_argument("--min-p", type=_ranged_float(0, 1), default=0.05, metavar="F",
                   help=f"{scope}min-p: keep tokens at least F times as likely as the top one (default 0.05)")
    p.add_argument("--seed", type=_seed, default=None, metavar="N", help=f"{scope}sampling seed (default: time-based)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=_path, default=None, help="GGUF model file (default: the embedded model)")
    p.add_argument("--backend", default="auto", choices=["auto", "mlx", "numpy", "cupy"],
                   help="auto (default): mlx on an Apple GPU, else cupy when CuPy finds a CUDA GPU, else mlx when "
                        "MLX has one (mlx[cuda]), else numpy (faster than MLX on CPUs)")
    p.add_argument("--no-kernels", action="store_true",
                   help="GPU backends: the plain-ops path instead of ds4lab's custom kernels")
    p.add_argument("--device", default=None, choices=["cpu", "gpu"], help="MLX device (mlx backend only)")
    p.add_argument("--numerics", default="ds4", choices=["ds4", "exact"],
                   help="ds4 (default): FP8/FP4/F16 simulations as ds4 computes; exact: none")
    p.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="N",
                   help="prefill chunk (default: ds4's rule, DS4_METAL_PREFILL_CHUNK or 2048; on cupy ds4's later "
                        "4096, 8192 for Pro)")
    p.add_argument("--prefill-matmul", default="auto", choices=["auto", "float32", "tf32", "f16"],
                   help="cupy: tf32 / f16 run a chunk's products on TF32 / half operands (as ds4's GPU prefill "
                        "casts them to half; benchmarks/README.md gives the speed of each); float32 keeps float32 "
                        "accuracy; auto (default): f16 on cupy with its kernels, else float32")
    p.add_argument("--decode-matmul", default="float32", choices=["float32", "q8"],
                   help="cupy: q8 quantizes x to int8 per block in the decode products of Q8_0, IQ2_XXS and Q2_K "
                        "weights, as ds4's CPU and CUDA decode do, and sums in integers; float32 (default) keeps it")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ds4lab", description="DeepSeek V4 Flash architecture, step by step.")
    p.add_argument("--version", action="version", version=f"ds4lab {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{run,serve,bench,inspect,make-model}")

    run = sub.add_parser("run", help="generate from a prompt, or chat interactively without -p",
                         description="One prompt (-p or --prompt-file), or an interactive chat that keeps one "
                                     "session across turns. Text goes to stdout; progress and timings to stderr.")
    _add_model_args(run)
    src = run.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", type=decoded, default=None,
                     help="prompt text: a user message for a chat model, plain text to continue for a model "
                          "without a chat template (--chat / --raw force either)")
    src.add_argument("--prompt-file", type=_path, default=None, metavar="FILE", help="read the prompt from FILE")
    run.add_argument("-sys", "--system", type=decoded, default=DEFAULT_SYSTEM,
                     help=f"system prompt (default: {DEFAULT_SYSTEM!r}; an empty string disables it)")
    think = run.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const="high",
                       help="thinking mode (the default for chat models, as in ds4; a model without a chat "
                            "template, such as the embedded one, does not think unless asked)")
    think.add_argument("--think-max", dest="think", action="store_const", const="max",
                       help=f"Think Max when --ctx >= {THINK_MAX_MIN_CTX}, otherwise normal thinking")
    think.add_argument("--nothink", dest="think", action="store_const", const="none",
                       help="non-thinking mode: the assistant turn starts with </think>")
    run.set_defaults(think=None)  # "high" (ds4's default) for a chat model unless a flag says otherwise
    style = run.add_mutually_exclusive_group()
    style.add_argument("--raw", dest="raw", action="store_true", default=None,
                       help="continue the prompt as plain text (no chat template, no system prompt); the default "
                            "for models without a tokenizer.chat_template, such as the embedded one")
    style.add_argument("--chat", dest="raw", action="store_false",
                       help="render the prompt as a chat turn (the default for chat models, as in ds4)")
    run.add_argument("-c", "--ctx", type=_positive_int, default=None, metavar="N",
                     help=f"context size (default: {DEFAULT_CTX}, capped at the model's context length; more "
                          "than that length is refused)")
    run.add_argument("-n", "--tokens", type=_positive_int, default=DEFAULT_TOKENS, metavar="N",
                     help=f"most tokens to generate per turn (default {DEFAULT_TOKENS}, capped by the context)")
    _add_sampling_args(run, temperature_max=100)
    graph = run.add_mutually_exclusive_group()
    for flag, test, what in (("--graph-test", "decode", "layer 0's stages and the logits of one decode step"),
                             ("--graph-full-test", "full", "the same decode step through every layer"),
                             ("--graph-prompt-test", "prompt", "the prompt's logits per chunk, the KV state, then a "
                                                               "decode step")):
        graph.add_argument(flag, dest="graph_test", action="store_const", const=test,
                           help=f"check the kernels against the plain ops on this device: {what} (ds4's "
                                f"--metal{flag[1:]}); prints the largest differences and PASS/FAIL. Loads the "
                                f"model twice: the plain path dequantizes weights to float32")
    run.set_defaults(func=run_command)

    add_serve_parser(sub)

    bench = sub.add_parser("bench", help="ds4-bench's frontier sweep: prefill and generation speed against context",
                           description="Prefill a fixed text to each frontier, time the interval, snapshot, time a "
                                       "greedy generation probe, restore, continue. One CSV row per frontier.")
    _add_model_args(bench)
    bench.add_argument("--prompt-file", type=_path, default=None, metavar="FILE",
                       help="raw benchmark text, no chat template (default: ds4's prompt, data/promessi_sposi.txt "
                            "of the checkout ds4lab runs from, else a built-in text)")
    bench.add_argument("--ctx-start", type=_positive_int, default=None, metavar="N",
                       help=f"first frontier (default {DEFAULT_CTX_START}, capped at --ctx-max)")
    bench.add_argument("--ctx-max", type=_positive_int, default=None, metavar="N",
                       help=f"last frontier (default {DEFAULT_CTX_MAX}, capped at the model's context length)")
    bench.add_argument("--ctx-alloc", type=_positive_int, default=None, metavar="N",
                       help="session context (default ctx-max + gen-tokens + 1)")
    bench.add_argument("--step-incr", type=_positive_int, default=DEFAULT_STEP_INCR, metavar="N",
                       help=f"linear step when --step-mul is 1 (default {DEFAULT_STEP_INCR})")
    bench.add_argument("--step-mul", type=_ranged_float(1, 1e6), default=DEFAULT_STEP_MUL, metavar="F",
                       help=f"multiplicative step (default {DEFAULT_STEP_MUL:g})")
    bench.add_argument("-n", "--gen-tokens", "--tokens", dest="gen_tokens", type=_positive_int,
                       default=DEFAULT_GEN_TOKENS, metavar="N",
                       help=f"greedy tokens generated at each frontier (default {DEFAULT_GEN_TOKENS})")
    bench.add_argument("--warmup", type=_nonnegative_int, default=DEFAULT_WARMUP, metavar="N",
                       help="untimed decode steps before the first frontier, after an untimed prefill of the "
                            "prompt's first chunk, so that its figures leave out the first chunk's and steps' "
                            "one-time work (kernel loads, graph captures); 0: neither "
                            f"(default {DEFAULT_WARMUP})")
    bench.add_argument("--csv", type=_path, default=None, metavar="FILE", help="write the CSV there instead of stdout")
    bench.add_argument("--plot", type=_path, default=None, metavar="FILE",
                       help="draw prefill and generation t/s against context with Altair (.png, .svg, .html; "
                            ".json: the Vega-Lite spec)")
    bench.set_defaults(func=bench_command)

    insp = sub.add_parser("inspect", help="describe a GGUF model file or a .kv cache file",
                          description="GGUF: header, metadata, model config, tensor table with types and bytes. "
                                      ".kv: the KV file's summary.")
    insp.add_argument("file", type=_path, metavar="FILE",
                      help="the GGUF model file (.gguf) or KV cache file (.kv) to describe")
    insp.set_defaults(func=inspect_command)

    mk = sub.add_parser("make-model", help="write a GGUF with seeded random weights",
                        description="Write a small GGUF model of the Flash architecture with seeded random weights "
                                    "(ds4lab.testing.make_model): the same preset and seed give the same file. "
                                    "For tests and experiments; it generates noise.")
    mk.add_argument("--preset", default="nano", choices=["nano"], help="the model's shape (default nano)")
    mk.add_argument("--seed", type=_nonnegative_int, default=0, metavar="N",
                    help="seed of the random weights (default 0)")
    mk.add_argument("-o", "--output", required=True, type=_path, metavar="FILE", help="the GGUF file to write")
    mk.set_defaults(func=make_model_command)
    return p



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
    """Options given before the command that ``ds4lab`` itself does not take (it takes only -h and --version):
    argparse would report the missing command instead of naming them."""
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    unknown = []
    for arg in argv:
        if arg in commands or arg == "--":
            break
        if arg.startswith("-") and arg not in ("-h", "--help", "--version"):
            unknown.append(arg)
    return unknown


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line like the command's others (Python's format adds the library's file, line and source)."""
    err(f"warning: {message}")


def main(argv: list[str] | None = None) -> int:
    require_processes("the ds4lab command")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    unknown = _unknown_leading_options(parser, argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args = parser.parse_args(argv)  # usage errors exit 2 here, with one line
    try:
        with warnings.catch_warnings(), named_stdout():
            warnings.showwarning = _show_warning
            return args.func(args)
    except UsageError as e:
        print(f"ds4lab {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `ds4lab bench | head -3`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_RUNTIME
    except Exception as e:
        if os.environ.get("DS4LAB_TRACEBACK"):
            raise
        err(f"error: {_message(e)}")
        return EXIT_RUNTIME
