"""Train the embedded default model: a small DS4-architecture model on tinyshakespeare, with MLX
autodiff through ds4lab's own model code (the same Transformer the engine runs, bound to trainable
arrays instead of GGUF blocks).

    python training/train_shakespeare.py --out /tmp/run            # on the GPU: MLX with mlx[cuda]
    python training/train_shakespeare.py --steps 3 --seq 64 --out /tmp/smoke   # a CPU smoke run

The defaults are the run that produced ``ds4lab/assets/shakespeare.gguf`` (see its MODEL_CARD.md).

Fixed seeds throughout. The last 10% of the text is held out for validation. Training uses
``numerics="exact"`` (the FP8/FP4/F16 roundings have zero gradient almost everywhere); the script then
measures the validation loss of the exported model in both numerics modes, so the cost of ds4's
inference numerics is stated. Outputs in ``--out``: ``shakespeare.gguf``, ``metrics.json`` (every
figure of the model card), ``train_log.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

import ds4lab
from ds4lab.backends import get_backend
from ds4lab.config import NANO, replace
from ds4lab.evaluate import held_out_split, next_token_loss
from ds4lab.gguf_file import load_model_file
from ds4lab.model.transformer import Transformer
from ds4lab.model.weights import ArrayWeights
from ds4lab.ops import Ops
from ds4lab.quants import dequantize
from ds4lab.runtime import Runtime
from ds4lab.testing import make_model, write_model
from ds4lab.tokenizer import Tokenizer, train_bpe

# The repository's own copy (data/README.md), found from this script, so it is there however ds4lab is installed.
DATA = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare.txt"

# The nano architecture with a Shakespeare-sized vocabulary and a 64-token raw window: ratio-4 rows
# every 4 tokens with the indexer choosing 32 once more are visible (from position 131), ratio-128
# rows every 128 tokens, hash routing in layers 0-2.
CONFIG = replace(NANO, n_vocab=2048, swa=64, idx_topk=32, context_length=4096)
SEED = 1234
VAL_SLICE = 2000


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats/token) of the add-one unigram distribution of the training tokens."""
    counts = np.bincount(train, minlength=vocab) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


def file_arrays(path: Path):
    """A model file's config and file, its weights as float32 MLX arrays, and its hash tables by layer."""
    cfg, file = load_model_file(path)
    params, hashes = {}, {}
    for name, t in file.tensors.items():
        values = dequantize(t.data, t.qtype, t.shape[0])
        if name.endswith("tid2eid.weight"):
            hashes[int(name.split(".")[1])] = values
        else:
            params[name] = mx.array(values.astype(np.float32, copy=False))
    return cfg, file, params, hashes


def initial_params(tokens_text: str, workdir: Path):
    """Seeded initial weights from the project's own generator (F32 everywhere), as float arrays."""
    path = make_model(CONFIG, workdir / "init.gguf", seed=SEED, dense_type="F32", expert_types=("F32", "F32"),
                      tokenizer_text=tokens_text)
    _, _, params, hashes = file_arrays(path)
    return params, hashes


def make_loss(model: Transformer, runtime: Runtime, hashes, geometry_for):
    def loss(params, ids: np.ndarray):
        model.weights = ArrayWeights(params, hashes, mx, CONFIG.o_groups, CONFIG.o_lora)
        X, _ = runtime.forward(ids[:-1], geometry_for(len(ids) - 1))
        logits = model.head(X)
        target = mx.array(ids[1:, None].astype(np.int32))
        return (mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, target, axis=-1)[:, 0]).mean()

    return loss


def evaluate(loss_fn, params, windows) -> float:
    return float(np.mean([loss_fn(params, w).item() for w in windows]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=DATA, help="training text (default: data/tinyshakespeare.txt)")
    ap.add_argument("--steps", type=int, default=220)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--accum", type=int, default=2, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-windows", type=int, default=4)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)

    text = args.data.read_text(encoding="utf-8")
    train_text, val_text = held_out_split(text)
    tokens, merges = train_bpe(train_text, CONFIG.n_vocab)
    tok = Tokenizer(tokens, merges)
    train_ids = np.array(tok.encode(train_text), dtype=np.int64)
    val_ids = np.array(tok.encode(val_text), dtype=np.int64)
    baseline = unigram_loss(train_ids, val_ids, CONFIG.n_vocab)
    print(f"train {len(train_ids)} tokens, val {len(val_ids)} tokens; unigram val loss {baseline:.4f}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        params, hashes = initial_params(train_text, Path(tmp))
    backend = get_backend("mlx", kernels=False)  # training differentiates the plain ops (kernels have no VJP)
    model = Transformer(CONFIG, ArrayWeights(params, hashes, mx, CONFIG.o_groups, CONFIG.o_lora), Ops(backend),
                        numerics="exact")
    runtime = Runtime(model, backend, compile=False)  # eager: autodiff through the plain ops
    from ds4lab.kv.layout import Geometry, new_state

    def fresh_state(n):
        return new_state(CONFIG, backend, Geometry.for_context(CONFIG, n + 1, n))

    loss_fn = make_loss(model, runtime, hashes, fresh_state)
    grad_fn = mx.value_and_grad(loss_fn)
    n_params = sum(v.size for _, v in tree_flatten(params))
    schedule = optim.join_schedules([optim.linear_schedule(1e-5, args.lr, args.warmup),
                                     optim.cosine_decay(args.lr, max(1, args.steps - args.warmup), args.lr * 0.05)],
                                    [args.warmup])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.1)
    val_starts = np.linspace(0, len(val_ids) - args.seq - 2, args.eval_windows).astype(int)
    val_windows = [val_ids[s:s + args.seq + 1] for s in val_starts]

    log = []
    skipped = 0
    best = (float("inf"), None, 0)
    step = 0
    for step in range(1, args.steps + 1):
        total, grads = 0.0, None
        for _ in range(args.accum):
            s = int(rng.integers(0, len(train_ids) - args.seq - 2))
            value, g = grad_fn(params, train_ids[s:s + args.seq + 1])
            grads = g if grads is None else tree_map(mx.add, grads, g)
            total += value.item()
        grads = tree_map(lambda x: x / args.accum, grads)
        grads, norm = optim.clip_grad_norm(grads, 1.0)
        row = {"step": step, "train_loss": total / args.accum, "grad_norm": float(norm), "lr": float(schedule(step)),
               "seconds": time.time() - began}
        if not (math.isfinite(row["train_loss"]) and math.isfinite(row["grad_norm"])):
            skipped += 1  # a non-finite step is dropped rather than written into the weights
            row["skipped"] = skipped
        else:
            opt.update(params, grads)
            mx.eval(params, opt.state)
        if step % args.eval_every == 0 or step == args.steps:
            row["val_loss"] = evaluate(loss_fn, params, val_windows)
            if row["val_loss"] < best[0]:
                best = (row["val_loss"], {k: np.array(v) for k, v in tree_flatten(params)}, step)
        log.append(row)
        if step % 10 == 0 or "val_loss" in row:
            print(json.dumps(row), flush=True)
    train_seconds = time.time() - began

    weights = dict(best[1])
    for il, table in hashes.items():
        weights[f"blk.{il}.ffn_gate_tid2eid.weight"] = table
    gguf = write_model(CONFIG, args.out / "shakespeare.gguf", weights,
                       f"ds4lab shakespeare {CONFIG.n_layer}-layer (seed {SEED}, step {best[2]})", tokens, merges)

    # The exported file as the engine loads it (Q8_0 weights), on the float64 reference backend, in both
    # numerics modes: the figure the test suite checks (tests/test_default_model.py).
    exported = {numerics: next_token_loss(m, m.tokenizer.encode(val_text)[: VAL_SLICE + 1])
                for numerics in ("exact", "ds4") for m in [ds4lab.load(gguf, backend="numpy", numerics=numerics)]}
    metrics = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in CONFIG.__dict__.items()},
        "params": int(n_params), "seed": SEED, "steps_run": step, "best_step": best[2], "seq": args.seq,
        "accum": args.accum, "tokens_per_step": args.seq * args.accum, "lr": args.lr, "warmup": args.warmup,
        "schedule": "linear warmup then cosine decay to 5%", "optimizer": "AdamW(weight_decay=0.1), grad clip 1.0",
        "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)),
        "unigram_val_loss": baseline, "unigram_val_ppl": math.exp(baseline),
        "best_val_loss": best[0], "best_val_ppl": math.exp(best[0]),
        "final_train_loss": log[-1]["train_loss"], "train_seconds": train_seconds, "skipped_steps": skipped,
        "val_slice_2000_loss": exported, "val_slice_2000_ppl": {k: math.exp(v) for k, v in exported.items()},
        "device": str(mx.default_device()), "file_bytes": gguf.stat().st_size,
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    with (args.out / "train_log.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "train_loss", "val_loss", "grad_norm", "lr", "seconds", "skipped"])
        w.writeheader()
        w.writerows(log)
    summary_keys = ("best_val_loss", "unigram_val_loss", "val_slice_2000_ppl", "train_seconds")
    print(json.dumps({k: metrics[k] for k in summary_keys}))


if __name__ == "__main__":
    main()
