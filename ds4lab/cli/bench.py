"""``ds4lab bench``: ds4-bench's frontier sweep (:mod:`ds4lab.bench`) from the command line: every file and the
sweep's numbers checked before any work, one CSV row per frontier to stdout or ``--csv``, an optional plot."""

from __future__ import annotations

import sys
import time

from .common import (
    NamedWrites,
    UsageError,
    check_distinct,
    check_input,
    check_output,
    describe,
    err,
    load_model,
    named_error,
    read_text,
)


def bench_command(args) -> int:
    from .. import bench
    from ..engine import default_model_path

    if args.plot is not None and args.plot.suffix.lower() not in bench.PLOT_SUFFIXES:
        raise UsageError(f"--plot needs a {', '.join(bench.PLOT_SUFFIXES)} file name, got {args.plot.name!r}")
    # Every file before any work: the outputs can be written, the inputs read, and neither output is an input.
    check_output(args.csv, "--csv")
    check_output(args.plot, "--plot")
    check_input(args.model, "-m")
    if args.prompt_file is not None:
        check_input(args.prompt_file, "--prompt-file")
    check_distinct([(args.csv, "--csv"), (args.plot, "--plot")],
                   [(args.model or default_model_path(), "-m"),
                    (args.prompt_file or bench.default_prompt_path(), "--prompt-file")])
    if args.prompt_file is not None and not read_text(args.prompt_file).strip():
        raise ValueError(f"--prompt-file {args.prompt_file}: the file is empty")
    if args.plot is not None:
        bench._import_altair()  # fail before the sweep, not after it
        if args.plot.suffix.lower() in (".png", ".svg") and not bench._has_vl_convert():
            raise bench.BenchError(f"--plot {args.plot.suffix} needs vl-convert-python: "
                                   "pip install vl-convert-python (or use a .html file name)")
        if bench.html_needs_network(args.plot):
            err(f"warning: --plot {args.plot.name} will load Vega from a CDN when opened (no vl-convert-python to "
                "put it in the page): pip install vl-convert-python for a page that opens offline")
    model = load_model(args)
    cap = model.config.context_length or bench.DEFAULT_CTX_MAX
    if model.config.context_length and args.ctx_max and args.ctx_max > cap:
        raise UsageError(f"--ctx-max {args.ctx_max} is more than the model's context ({cap} tokens, "
                         f"deepseek4.context_length)")
    if model.config.context_length and args.gen_tokens > cap:  # its allocation passes the context by gen_tokens
        raise UsageError(f"-n/--gen-tokens {args.gen_tokens} is more than the model's context ({cap} tokens, "
                         f"deepseek4.context_length)")
    ctx_max = args.ctx_max or min(bench.DEFAULT_CTX_MAX, cap)
    ctx_start = args.ctx_start or min(bench.DEFAULT_CTX_START, ctx_max)
    if args.ctx_max is None and ctx_start > ctx_max:
        raise UsageError(f"--ctx-start {ctx_start} must be <= --ctx-max, which is {ctx_max} here by default "
                         f"({bench.DEFAULT_CTX_MAX} capped at the model's context)")
    try:
        ctx_alloc = bench.check_sweep(ctx_start, ctx_max, args.step_incr, args.step_mul, args.gen_tokens,
                                      args.ctx_alloc, flags=True)
        points = bench.frontiers(ctx_start, ctx_max, args.step_incr, args.step_mul, flags=True)
    except bench.BenchError as e:
        raise UsageError(str(e)) from None
    most = max(cap, ctx_max + args.gen_tokens + 1)  # the default allocation may pass the context by gen_tokens + 1
    if model.config.context_length and ctx_alloc > most:
        raise UsageError(f"--ctx-alloc {ctx_alloc} is more than {most}: the model's context ({cap} tokens, "
                         f"deepseek4.context_length) or --ctx-max + --gen-tokens + 1, whichever is larger")
    tokens, source = bench.prompt_tokens(model, args.prompt_file, min_tokens=ctx_max)
    if len(tokens) < ctx_max:  # before the CSV header, not after it
        raise ValueError(f"{source}: the prompt has {len(tokens)} tokens, need at least --ctx-max ({ctx_max})")
    sess = model.session(ctx=ctx_alloc, prefill_chunk=args.prefill_chunk, max_checkpoints=2)
    err(f"bench: {describe(model)}, ctx {ctx_alloc}, prefill chunk {sess.prefill_chunk}, "
        f"prompt {source} ({len(tokens)} tokens), {len(points)} frontiers {points[0]}..{points[-1]}, "
        f"{args.gen_tokens} generated tokens each, "
        + (f"an untimed warm-up chunk and {args.warmup} steps first" if args.warmup else "no warm-up"))
    rows = bench.sweep(model, tokens, ctx_start, ctx_max, args.step_incr, args.step_mul, args.gen_tokens,
                       session=sess, warmup=args.warmup)
    began = time.perf_counter()
    if args.csv is None:
        done = bench.write_csv(rows, sys.stdout)
    else:
        try:
            out = open(args.csv, "w", encoding="utf-8")
        except OSError as e:
            raise named_error(args.csv, e) from None
        with out:
            done = bench.write_csv(_echo_rows(rows), NamedWrites(out, args.csv))
    err(f"bench: {len(done)} frontiers in {time.perf_counter() - began:.1f} s"
        + (f", CSV in {args.csv}" if args.csv else ""))
    if args.plot is not None:
        try:
            bench.save_plot(done, args.plot, title=f"{model.path.name} ({model.backend.name}), prefill chunk "
                                                   f"{sess.prefill_chunk}, {args.gen_tokens} generated tokens")
        except OSError as e:
            raise named_error(args.plot, e) from None
        err(f"bench: plot in {args.plot}")
    return 0


def _echo_rows(rows):
    for row in rows:
        err(f"bench: ctx {row.ctx_tokens}: prefill {row.prefill_tps:.2f} t/s, generation {row.gen_tps:.2f} t/s, "
            f"KV {row.kvcache_bytes} bytes")
        yield row
