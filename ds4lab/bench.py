"""ds4-bench's frontier sweep (ds4's ds4_bench.c; README.md, "Command line") as a library: ``sweep()`` yields
one row per frontier.

One session of ``ctx_alloc`` tokens walks a fixed token sequence to frontiers ``ctx_start``, then
``+step_incr`` (or ``ceil(cur·step_mul)``) up to ``ctx_max``. First, untimed, a prefill of the sequence's first
chunk (up to ``ctx_start`` tokens) and ``warmup`` decode steps after it, then the session emptied: a GPU runtime
loads its kernels, captures its decode graphs and lays out the weights its chunk products read on the first chunk
and steps, once a process, which the first frontier's figures would otherwise include (ds4 warms its prefill
kernels up once before the first prompt; llama-bench runs a warm-up too). At each frontier:

1. ``sess.sync(prompt[:frontier])``: an incremental prefill from the previous frontier (timed, final
   logits readback included); at the first frontier ``sess.prefill(...)`` from zero (sync would restore the
   warm-up's checkpoint);
2. a checkpoint (not timed);
3. ``gen_tokens`` greedy decode steps that never choose EOS (timed), the same probe at every frontier (with
   ``sampling``, steps drawn by those parameters instead, never EOS either);
4. a restore of the checkpoint (not timed), so the next prefill continues from the frontier.

``kvcache_bytes`` is the ``DSV4`` payload size of the session at the frontier (ds4 reports its
snapshot's length, which is the same number: ``payload_nbytes`` = ``sess.kv.nbytes``).
``peak_rss_bytes`` is the process's resident-set high-water mark (``getrusage(RUSAGE_SELF).ru_maxrss``)
after the row: it never decreases, and it counts NumPy and MLX CPU buffers alike (tracemalloc would see
neither MLX's allocations nor the memory-mapped weights, and would slow the run down).
"""

from __future__ import annotations

import csv
import io
import math
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

PLOT_SUFFIXES = (".png", ".svg", ".html", ".json")  # save_plot's formats (Vega-Lite's spec: .json)
CSV_COLUMNS = ("ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes",
               "peak_rss_bytes")

# ds4-bench's defaults (ds4_bench.c): the CLI caps ctx_max (and ctx_start) at the model's trained context.
DEFAULT_CTX_START = 2048
DEFAULT_CTX_MAX = 32768
DEFAULT_STEP_INCR = 2048
DEFAULT_STEP_MUL = 1.0
DEFAULT_GEN_TOKENS = 128
# Decode steps: each kind of step graph a few steps make (a ratio-4 window ends every 4th) runs eagerly once, is
# captured the next time, then replays. A step that ends a ratio-128 window (one in 128) is not among them: a sweep
# of 128 tokens a frontier still meets its first one at the first frontier.
DEFAULT_WARMUP = 8
WARMUP_PROMPT = 16  # tokens the warm-up prefills at least (a chunk where chunks are longer; at most ctx_start)
MAX_FRONTIERS = 100_000  # a sweep's points are listed before it runs

# The opening of "I promessi sposi" (Manzoni, 1840; public domain): the built-in text when ds4's own
# benchmark prompt, the whole novel in the checkout's data/promessi_sposi.txt, is not there (ds4lab
# installed from a wheel). It is repeated as often as the sweep needs.
BUILTIN_TEXT = (
    "Quel ramo del lago di Como, che volge a mezzogiorno, tra due catene non interrotte di monti, tutto a "
    "seni e a golfi, a seconda dello sporgere e del rientrare di quelli, vien, quasi a un tratto, a "
    "ristringersi, e a prender corso e figura di fiume, tra un promontorio a destra, e un'ampia costiera "
    "dall'altra parte; e il ponte, che ivi congiunge le due rive, par che renda ancor più sensibile all'occhio "
    "questa trasformazione, e segni il punto in cui il lago cessa, e l'Adda rincomincia, per ripigliar poi nome "
    "di lago dove le rive, allontanandosi di nuovo, lascian l'acqua distendersi e rallentarsi in nuovi golfi e "
    "in nuovi seni.\n"
)


class BenchError(ValueError):
    """A sweep that cannot run as asked (bad parameters, a prompt shorter than ctx_max)."""


@dataclass(frozen=True)
class FrontierRow:
    ctx_tokens: int  # the frontier
    prefill_tokens: int  # frontier - previous frontier (the first row counts from 0)
    prefill_seconds: float
    gen_tokens: int
    gen_seconds: float
    kvcache_bytes: int  # DSV4 payload bytes at the frontier
    peak_rss_bytes: int  # process RSS high-water mark so far
    probe: tuple[int, ...]  # the tokens the generation probe chose (greedy unless the sweep samples)

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_seconds if self.gen_seconds > 0 else 0.0

    def csv_fields(self) -> list[str]:
        """ds4-bench's formatting (``%d,%d,%.2f,%d,%.2f,%llu``) plus the peak memory column."""
        return [str(self.ctx_tokens), str(self.prefill_tokens), f"{self.prefill_tps:.2f}", str(self.gen_tokens),
                f"{self.gen_tps:.2f}", str(self.kvcache_bytes), str(self.peak_rss_bytes)]


# How the errors name the sweep's parameters: Python's keyword arguments (``ctx_start=4096``) by default, the
# command line's flags (``--ctx-start 4096``) with ``flags=True``, as ``ds4lab bench`` shows them.
FLAGS = {"ctx_start": "--ctx-start", "ctx_max": "--ctx-max", "ctx_alloc": "--ctx-alloc", "step_incr": "--step-incr",
         "step_mul": "--step-mul", "gen_tokens": "--gen-tokens"}


def _namer(flags: bool):
    """``show(name, value)``: ``name=value``, or ``--flag value`` with ``flags``; ``show(name)``: the name alone."""
    def show(name: str, value=None) -> str:
        label = FLAGS[name] if flags else name
        return label if value is None else (f"{label} {value}" if flags else f"{label}={value}")

    return show


def frontiers(ctx_start: int, ctx_max: int, step_incr: int = DEFAULT_STEP_INCR,
              step_mul: float = DEFAULT_STEP_MUL, *, flags: bool = False) -> list[int]:
    """The frontiers ds4-bench visits: ``+step_incr`` when ``step_mul == 1``, else ``ceil(cur·step_mul)``
    (at least ``cur + 1``), clamped to ``ctx_max``, which is always the last. ``flags``: errors name the
    command line's flags instead of the arguments."""
    check_sweep(ctx_start, ctx_max, step_incr, step_mul, gen_tokens=1, flags=flags)
    show = _namer(flags)
    out = [ctx_start]
    while out[-1] < ctx_max:
        if len(out) == MAX_FRONTIERS:
            raise BenchError(f"{show('ctx_start', ctx_start)} to {show('ctx_max', ctx_max)} "
                             f"({show('step_incr', step_incr)}, {show('step_mul', step_mul)}) makes more than "
                             f"{MAX_FRONTIERS:,} frontiers")
        cur = out[-1]
        nxt = cur + step_incr if step_mul == 1.0 else max(math.ceil(cur * step_mul), cur + 1)
        out.append(min(nxt, ctx_max))
    return out


def check_sweep(ctx_start: int, ctx_max: int, step_incr: int, step_mul: float, gen_tokens: int,
                ctx_alloc: int | None = None, *, flags: bool = False) -> int:
    """ds4-bench's argument rules; returns the context to allocate (default ctx_max + gen_tokens + 1). The errors
    name the arguments (``ctx_start=4096 must be <= ctx_max=256``), or with ``flags`` the command line's flags
    (``--ctx-start 4096 must be <= --ctx-max 256``)."""
    show = _namer(flags)
    counts = [("ctx_start", ctx_start), ("ctx_max", ctx_max), ("step_incr", step_incr), ("gen_tokens", gen_tokens)]
    for name, value in counts + ([("ctx_alloc", ctx_alloc)] if ctx_alloc is not None else []):
        if int(value) != value or value <= 0:
            raise BenchError(f"{show(name)} must be a positive integer, got {value}")
    if ctx_start > ctx_max:
        raise BenchError(f"{show('ctx_start', ctx_start)} must be <= {show('ctx_max', ctx_max)}")
    if not math.isfinite(step_mul) or step_mul < 1.0:
        raise BenchError(f"{show('step_mul')} must be >= 1, got {step_mul}")
    if ctx_alloc is None:
        ctx_alloc = ctx_max + gen_tokens + 1
    if ctx_alloc <= ctx_max + gen_tokens:
        raise BenchError(f"{show('ctx_alloc', ctx_alloc)} must be greater than {show('ctx_max')} + "
                         f"{show('gen_tokens')} = {ctx_max} + {gen_tokens} = {ctx_max + gen_tokens} (the sweep's "
                         "last frontier and its generation probe)")
    return int(ctx_alloc)


def default_prompt_path() -> Path | None:
    """ds4's benchmark prompt, ``data/promessi_sposi.txt`` of the checkout ds4lab runs from (an editable
    install), or None where there is none (a wheel: the sweep then repeats :data:`BUILTIN_TEXT`)."""
    from .testing import data_file

    try:
        return data_file("promessi_sposi.txt")
    except FileNotFoundError:
        return None


def prompt_tokens(model, path: str | Path | None = None, min_tokens: int = 0) -> tuple[list[int], str]:
    """The sweep's token sequence and where it came from: ``path`` (raw text, no chat template), else
    ds4's benchmark prompt, else :data:`BUILTIN_TEXT` repeated to at least ``min_tokens`` tokens."""
    if path is None:
        path = default_prompt_path()
    if path is not None:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        return model.tokenizer.encode(text), str(path)
    unit = model.tokenizer.encode(BUILTIN_TEXT)
    return unit * max(1, -(-min_tokens // len(unit))), "the built-in text (repeated)"


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes (0 where ``resource`` is unavailable)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS reports bytes, Linux KiB


def sweep(model, tokens: list[int], ctx_start: int = DEFAULT_CTX_START, ctx_max: int = DEFAULT_CTX_MAX,
          step_incr: int = DEFAULT_STEP_INCR, step_mul: float = DEFAULT_STEP_MUL,
          gen_tokens: int = DEFAULT_GEN_TOKENS, prefill_chunk: int | None = None,
          ctx_alloc: int | None = None, session=None, sampling: dict | None = None,
          warmup: int = DEFAULT_WARMUP) -> Iterator[FrontierRow]:
    """Walk ``tokens`` to each frontier and yield a :class:`FrontierRow` as soon as it is measured.

    ``session`` (optional) is used instead of a new ``model.session(ctx_alloc, prefill_chunk)``; it must
    be empty and hold more than ``ctx_max + gen_tokens`` tokens. ``sampling``: the decode's parameters
    (``Session.decoder``'s: temperature, top_k, top_p, min_p, seed) in place of ds4-bench's greedy argmax; seed 0
    unless given. ``warmup``: untimed decode steps before the first frontier, after an untimed prefill of the first
    chunk (the module's docstring; 0: neither).
    """
    if warmup < 0:
        raise BenchError(f"warmup must be 0 or more decode steps, got {warmup}")
    ctx_alloc = check_sweep(ctx_start, ctx_max, step_incr, step_mul, gen_tokens, ctx_alloc)
    # whole numbers check_sweep took as floats (64.0) count and slice as ints from here on
    ctx_start, ctx_max, step_incr, gen_tokens = int(ctx_start), int(ctx_max), int(step_incr), int(gen_tokens)
    if len(tokens) < ctx_max:
        raise BenchError(f"the prompt has {len(tokens)} tokens, need at least ctx_max = {ctx_max}")
    if session is None:
        session = model.session(ctx=ctx_alloc, prefill_chunk=prefill_chunk, max_checkpoints=2)
    elif session.tokens:
        raise BenchError("the session must be empty")
    elif session.ctx <= ctx_max + gen_tokens:
        raise BenchError(f"the session's context ({session.ctx}) must be greater than ctx_max + gen_tokens")
    sess = session
    eos = model.tokenizer.eos_id
    params = {"temperature": 0.0, "seed": 0, **(sampling or {})}  # ds4_session_argmax_excluding(EOS) by default
    if warmup:
        # a whole chunk, as the first frontier's prefill runs it (a shorter prompt leaves the chunk products out)
        sess.sync(tokens[:min(max(WARMUP_PROMPT, sess.prefill_chunk), ctx_start)])
        steps = min(warmup, sess.ctx - len(sess.tokens) - 1)
        decode = sess.decoder(top=1, exclude=[eos], **params)
        for i in range(steps):
            decode.step(more=i + 1 < steps)
        sess.reset()
    previous = 0
    for frontier in frontiers(ctx_start, ctx_max, step_incr, step_mul):
        began = time.perf_counter()
        if previous == 0:  # from zero, as ds4-bench: sync would restore the warm-up's checkpoint (or a caller's)
            sess.prefill(tokens[:frontier]).run(progress=False)
        else:
            sess.sync(tokens[:frontier])
        prefill_seconds = time.perf_counter() - began

        snapshot = sess.checkpoint()
        kvcache_bytes = sess.kv_bytes
        decode = sess.decoder(top=1, exclude=[eos], **params)
        probe = []
        began = time.perf_counter()
        for i in range(gen_tokens):
            if len(sess.tokens) + 1 >= sess.ctx:
                raise BenchError(f"generation would exceed the allocated context at frontier {frontier}")
            probe.append(decode.step(more=i + 1 < gen_tokens).token)  # no step launched ahead of the last
        gen_seconds = time.perf_counter() - began
        sess.restore(snapshot)

        yield FrontierRow(frontier, frontier - previous, prefill_seconds, gen_tokens, gen_seconds, kvcache_bytes,
                          peak_rss_bytes(), tuple(probe))
        previous = frontier


# -- output ---------------------------------------------------------------------------------------------

def write_csv(rows: Iterable[FrontierRow], out: TextIO, header: bool = True) -> list[FrontierRow]:
    """Write rows as CSV (flushed per row, so a long sweep shows progress); returns them."""
    writer = csv.writer(out, lineterminator="\n")
    if header:
        writer.writerow(CSV_COLUMNS)
        out.flush()
    done = []
    for row in rows:
        writer.writerow(row.csv_fields())
        out.flush()
        done.append(row)
    return done


def to_csv(rows: Iterable[FrontierRow]) -> str:
    buf = io.StringIO()
    write_csv(rows, buf)
    return buf.getvalue()


def read_csv(path_or_text: str | Path) -> list[dict]:
    """Rows of a bench CSV (ds4-bench's or ours) as dicts of numbers."""
    text = path_or_text if isinstance(path_or_text, str) and "\n" in path_or_text else Path(path_or_text).read_text()
    out = []
    for rec in csv.DictReader(io.StringIO(text)):
        out.append({k: (float(v) if "." in v else int(v)) for k, v in rec.items()})
    return out


def _import_altair():
    try:
        import altair
    except ImportError:
        raise BenchError("plotting needs Altair: pip install -e '.[bench]' (Altair, and vl-convert-python for PNG, "
                         "SVG and an HTML page that opens offline)") from None
    return altair


def _has_vl_convert() -> bool:
    try:
        import vl_convert  # noqa: F401
    except ImportError:
        return False
    return True


def chart(rows: Iterable[FrontierRow | dict], title: str | None = None):
    """An Altair chart: prefill and generation tokens/s against the context frontier, one panel each."""
    alt = _import_altair()
    records = []
    for row in rows:
        r = row if isinstance(row, dict) else {"ctx_tokens": row.ctx_tokens, "prefill_tps": row.prefill_tps,
                                               "gen_tps": row.gen_tps}
        records.append({"ctx_tokens": r["ctx_tokens"], "phase": "prefill", "tokens_per_s": r["prefill_tps"]})
        records.append({"ctx_tokens": r["ctx_tokens"], "phase": "generation", "tokens_per_s": r["gen_tps"]})
    base = alt.Chart(alt.Data(values=records)).mark_line(point=True).encode(
        x=alt.X("ctx_tokens:Q", title="context (tokens)"),
        y=alt.Y("tokens_per_s:Q", title="tokens/s", scale=alt.Scale(zero=True)),
        color=alt.Color("phase:N", legend=None),
        tooltip=["ctx_tokens:Q", "phase:N", alt.Tooltip("tokens_per_s:Q", format=".2f")],
    ).properties(width=480, height=180)
    out = base.facet(row=alt.Row("phase:N", title=None, sort=["prefill", "generation"])).resolve_scale(y="independent")
    return out.properties(title=title) if title else out


def save_plot(rows: Iterable[FrontierRow | dict], path: str | Path, title: str | None = None) -> Path:
    """Save :func:`chart` as ``.html`` or ``.json`` (Altair alone) or ``.png`` / ``.svg`` (needs vl-convert-python),
    by the suffix in any case. The HTML page carries Vega's scripts where vl-convert-python is there to give them
    (it opens offline); without it, it loads them from a CDN when opened (:func:`html_needs_network`)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in PLOT_SUFFIXES:
        raise BenchError(f"--plot needs a {', '.join(PLOT_SUFFIXES)} file name, got {path.name!r}")
    c = chart(rows, title)
    if suffix in (".png", ".svg") and not _has_vl_convert():
        raise BenchError(f"saving {suffix} needs vl-convert-python: pip install vl-convert-python "
                         "(or use a .html file name)")
    inline = {"inline": True} if suffix == ".html" and _has_vl_convert() else {}
    c.save(str(path), format=suffix[1:], **inline)  # Altair reads the suffix as it is: .PNG would be no format
    return path


def html_needs_network(path: str | Path) -> bool:
    """Whether :func:`save_plot` makes ``path`` a page that loads Vega from a CDN (no vl-convert-python here)."""
    return Path(path).suffix.lower() == ".html" and not _has_vl_convert()
