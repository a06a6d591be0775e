"""The ``ds4lab`` command: ``run`` (greedy generation), ``make-model`` (seeded test models)."""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from pathlib import Path

import numpy as np


def _run(args) -> int:
    from . import load

    model = load(args.model, backend=args.backend, numerics=args.numerics)
    ids = model.tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    t = model.transformer
    start = time.perf_counter()
    X, cache = t.forward(np.array(ids), model.new_state(len(ids) + args.tokens + 1, len(ids)))
    logits = model.backend.to_numpy(t.head(X[-1:]))[0]
    prefill_s = time.perf_counter() - start
    sys.stdout.write(args.prompt)
    generated = []
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # tokens may split a UTF-8 character
    start = time.perf_counter()
    for _ in range(args.tokens):
        token = int(np.argmax(logits))
        if token == model.tokenizer.eos_id:
            break
        generated.append(token)
        sys.stdout.write(text.decode(model.tokenizer.token_bytes(token)))
        sys.stdout.flush()
        X, cache = t.forward(np.array([token]), cache)
        logits = model.backend.to_numpy(t.head(X))[0]
    gen_s = time.perf_counter() - start
    print()
    print(f"[{model.path.name} {model.backend.name}] prompt {len(ids)} tokens, prefill {len(ids) / prefill_s:.1f} t/s, "
          f"generation {len(generated) / gen_s if generated else 0:.1f} t/s", file=sys.stderr)
    return 0


def _make_model(args) -> int:
    from .config import PRESETS
    from .testing import make_model

    path = make_model(PRESETS[args.preset], args.output, seed=args.seed)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4lab", description="DeepSeek V4 Flash architecture, step by step.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text greedily from a prompt")
    run.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    run.add_argument("-p", "--prompt", required=True)
    run.add_argument("-n", "--tokens", type=int, default=32, help="tokens to generate (default 32)")
    run.add_argument("--backend", default="mlx", choices=["mlx", "numpy"])
    run.add_argument("--numerics", default="ds4", choices=["ds4", "exact"])
    run.set_defaults(func=_run)

    mk = sub.add_parser("make-model", help="write a GGUF with seeded random weights")
    mk.add_argument("--preset", default="nano", choices=["nano"])
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("-o", "--output", required=True, type=Path)
    mk.set_defaults(func=_make_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"ds4lab: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
