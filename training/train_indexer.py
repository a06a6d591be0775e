"""Train the embedded model's indexer (issue 30), as DeepSeek V3.2's sparse-attention recipe trains its
lightning indexer: a KL objective between the indexer's score distribution over the compressed rows and the
main attention's distribution over the same rows (its weights summed over the heads, then normalised); before
it, a short phase that concentrates that attention, without which no top-k could hold most of it.

    git show c79c475:ds4lab/assets/shakespeare.gguf > seeded.gguf   # the embedded model before this training
    python training/train_indexer.py --model seeded.gguf --out /tmp/idx    # the shipped run's defaults (a CPU)
    python training/train_indexer.py --model seeded.gguf --out /tmp/smoke --seq 256 --sharpen-steps 2 \
        --warmup-steps 3 --joint-steps 2 --no-figures

0. Sharpen: every query attends all its visible compressed rows; the model but its indexer trains on the
   next-token loss plus ``--sharpen-weight`` times the entropy of each query's attention over its compressed
   rows (summed over the heads, normalised). The model trained by train_shakespeare.py spreads that attention
   nearly evenly (its 32 heaviest rows hold about a third of it over 2000 tokens), so a top-32 could follow
   it only that far; a few steps of this concentrate it on a few rows per query.
1. Dense warm-up: every query attends all its visible compressed rows; the indexer scores them all (its top-k
   is set one row above what the state holds, so it selects nothing away). Only the indexer's weights train —
   ``indexer.attn_q_b``, ``indexer.proj`` and its own compressor (``indexer_compressor_*``), whose rows only
   the indexer reads — on KL(attention ‖ softmax(indexer scores)) over the queries that see more rows than
   the top-k.
2. Joint phase with the selection on (the file's top-k): the indexer on the same KL restricted to the rows it
   selected, the rest of the model on the next-token loss at a small learning rate (``--joint-lr 0`` keeps it
   frozen). The indexer's inputs are detached, so the KL trains the indexer only and the next-token loss
   (which reaches no indexer weight: the top-k is discrete) the rest only.

Seeded (``SEED`` of train_shakespeare.py); the same 90/10 split of tinyshakespeare. Training uses
``numerics="exact"``. Outputs in ``--out``: ``shakespeare.gguf``, ``train_log.csv``, ``metrics.json`` (with the
figures of ``python -m ds4lab.evaluate indexer`` for the model before and after, unless ``--no-figures``).

The defaults are the run logged in ``training/logs/indexer_*``, which made the embedded model
(``ds4lab/assets/shakespeare.gguf``): see its ``MODEL_CARD.md``, "The indexer".
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from train_shakespeare import DATA, SEED, file_arrays

import ds4lab
from ds4lab.arch import NEG_INF
from ds4lab.backends import get_backend
from ds4lab.config import replace
from ds4lab.evaluate import held_out_ids, held_out_split, indexed_layers, indexer_figures, top_k_recall
from ds4lab.kv.layout import Geometry, layer_comp_cap, new_state
from ds4lab.model.attention import visible_rows
from ds4lab.model.transformer import Transformer
from ds4lab.model.weights import ArrayWeights
from ds4lab.ops import Ops
from ds4lab.runtime import Runtime
from ds4lab.testing import write_model
from ds4lab.tokenizer import Tokenizer


def is_indexer(name: str) -> bool:
    """The indexer's own weights: its query and head-weight projections and its compressor."""
    return ".indexer." in name or ".indexer_compressor_" in name


class DetachedIndexerWeights(ArrayWeights):
    """:class:`ArrayWeights` whose indexer projections see their inputs detached: the KL reaches the indexer's
    weights and not the activations (and weights) that feed it."""

    def linear(self, name: str):
        if not is_indexer(name):
            return super().linear(name)
        w = self.p[name]
        return lambda x: mx.stop_gradient(x) @ w.T


def file_params(path: Path):
    """The file's config, tokenizer vocabulary, float32 weights (MLX arrays) and hash tables."""
    cfg, file, params, hashes = file_arrays(path)
    meta = file.metadata
    return cfg, params, hashes, list(meta["tokenizer.ggml.tokens"][0]), list(meta["tokenizer.ggml.merges"][0]), meta


def attention_comp_mass(d: dict):
    """The attention weight each compressed row receives, summed over the heads ``[C, rows]``, from the values
    the model emits at ``attn.scores`` (softmax over the visible keys and the sink)."""
    s = mx.einsum("thd,nd->thn", d["q"], d["keys"]) * d["scale"]
    s = mx.where(d["visible"][:, None, :], s, NEG_INF)
    m = mx.maximum(s.max(axis=-1), d["sinks"][None, :])
    e = mx.exp(s - m[:, :, None])
    w = e / (mx.exp(d["sinks"][None, :] - m) + e.sum(axis=-1))[:, :, None]
    return w[:, :, d["n_raw"]:].sum(axis=1)


def normalised(mass, allowed):
    """``mass`` over the ``allowed`` rows as a distribution per query (zeros where a query has none: a 0/0 there
    would make NaN gradients)."""
    mass = mx.where(allowed, mass, 0.0)
    total = mass.sum(axis=-1, keepdims=True)
    return mass / mx.where(total > 0, total, 1.0)


def p_log_p(p):
    """p · log p, 0 where p is 0, with a finite gradient there."""
    return mx.where(p > 0, p * mx.log(mx.where(p > 0, p, 1.0)), 0.0)


def attention_entropy(mass, allowed, queries):
    """Mean over ``queries`` of the entropy (nats) of the attention mass over the ``allowed`` compressed rows."""
    h = -p_log_p(normalised(mass, allowed)).sum(axis=-1)
    return (h * queries).sum() / mx.maximum(queries.sum(), 1)


def indexer_kl(mass, scores, allowed, queries):
    """Mean over ``queries`` (bool ``[C]``) of KL(p ‖ softmax(scores)) over the ``allowed`` rows, p the attention
    mass normalised over them (a target: no gradient)."""
    p = mx.stop_gradient(normalised(mass, allowed))
    logq = mx.where(allowed, scores, NEG_INF)
    logq = logq - mx.logsumexp(logq, axis=-1, keepdims=True)
    kl = mx.where(allowed, p_log_p(p) - p * logq, 0.0).sum(axis=-1)
    return (kl * queries).sum() / mx.maximum(queries.sum(), 1)


@dataclass
class Pass:
    """What one window's forward pass gives the objectives, per indexed layer where a dict."""
    kl: dict      # KL(attention ‖ indexer) over the rows the attention saw
    entropy: dict  # entropy of the attention mass over those rows
    parts: dict   # (attention mass [C, rows], indexer scores [C, rows])
    lm: mx.array  # next-token loss (zero in the dense phase, which does not need it)
    n_vis: np.ndarray  # visible compressed rows per query

    @property
    def mean_kl(self):
        return sum(self.kl.values()) / len(self.kl)

    @property
    def mean_entropy(self):
        return sum(self.entropy.values()) / len(self.entropy)


class Objective:
    """The model over trainable arrays, run for one window in a phase: ``__call__(indexer, main, ids, phase)``
    returns ``(loss, Pass)``. Phases: "sharpen" (every row attended; next-token loss plus ``sharpen_weight``
    times the attention's entropy over the compressed rows), "dense" (every row attended; the indexer's KL),
    "joint" (the file's top-k; KL over the selected rows plus the next-token loss)."""

    def __init__(self, cfg, hashes, backend, sharpen_weight: float = 0.0):
        self.cfg, self.hashes, self.backend = cfg, hashes, backend
        self.sharpen_weight = sharpen_weight
        self.layers = indexed_layers(cfg)
        self.model = Transformer(cfg, ArrayWeights({}, hashes, mx, cfg.o_groups, cfg.o_lora), Ops(backend),
                                 numerics="exact")
        self.runtime = Runtime(self.model, backend, compile=False)

    def config_for(self, phase: str, n: int):
        """Every row attended: a top-k one row below the state's capacity (the indexer scores every row, keeps
        them all)."""
        if phase in ("dense", "sharpen"):
            return replace(self.cfg, idx_topk=layer_comp_cap(self.cfg, self.layers[0], n + 1) - 1)
        return self.cfg

    def __call__(self, indexer, main, ids: np.ndarray, phase: str):
        n = len(ids) - 1
        cfg = self.config_for(phase, n)
        self.model.cfg = cfg
        self.model.weights = DetachedIndexerWeights({**main, **indexer}, self.hashes, mx, cfg.o_groups, cfg.o_lora)
        got = {}
        wanted = {f"blk.{il}.{p}" for il in self.layers for p in ("attn.scores", "indexer.scores")}

        def observe(name, value):
            if name in wanted:
                got[name] = value

        state = new_state(cfg, self.backend, Geometry.for_context(cfg, n + 1, n))
        X, _ = self.runtime.forward(ids[:-1], state, observer=observe)
        n_vis = visible_rows(np.arange(n), cfg.ratio(self.layers[0]))
        queries = mx.array(n_vis > self.cfg.idx_topk)
        got_pass = Pass({}, {}, {}, mx.array(0.0), n_vis)
        for il in self.layers:
            d = got[f"blk.{il}.attn.scores"]
            mass, scores = attention_comp_mass(d), got[f"blk.{il}.indexer.scores"]
            allowed = d["visible"][:, d["n_raw"]:]
            got_pass.kl[il] = indexer_kl(mass, scores, allowed, queries)
            got_pass.entropy[il] = attention_entropy(mass, allowed, queries)
            got_pass.parts[il] = (mass, scores)
        if phase != "dense":
            logits = self.model.head(X)
            target = mx.array(ids[1:, None].astype(np.int32))
            got_pass.lm = (mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, target, axis=-1)[:, 0]).mean()
        if phase == "sharpen":
            return got_pass.lm + self.sharpen_weight * got_pass.mean_entropy, got_pass
        return (got_pass.mean_kl if phase == "dense" else got_pass.mean_kl + got_pass.lm), got_pass


def finite_step(row: dict, keys) -> bool:
    """Whether a step's figures are finite: a non-finite step is dropped rather than written into the weights."""
    return all(math.isfinite(row[k]) for k in keys)


def val_row(objective, indexer, main, windows) -> dict:
    """Validation per layer from a pass with every row attended: KL, recall, oracle recall and the attention's
    entropy over the compressed rows; the next-token loss with every row attended and with the selection on."""
    k = objective.cfg.idx_topk
    per_layer = {f"val_{what}_{il}": [] for what in ("kl", "recall", "oracle", "entropy") for il in objective.layers}
    full, selected = [], []
    for w in windows:
        every_row = objective(indexer, main, w, "sharpen")[1]  # the pass of the sharpen phase: all rows attended
        for il in objective.layers:
            mass, scores = (np.array(a) for a in every_row.parts[il])
            per_layer[f"val_kl_{il}"].append(every_row.kl[il].item())
            per_layer[f"val_entropy_{il}"].append(every_row.entropy[il].item())
            per_layer[f"val_recall_{il}"].append(top_k_recall(mass, scores, every_row.n_vis, k).mean())
            # the k heaviest rows: what any indexer can reach
            per_layer[f"val_oracle_{il}"].append(top_k_recall(mass, mass, every_row.n_vis, k).mean())
        full.append(every_row.lm.item())
        selected.append(objective(indexer, main, w, "joint")[1].lm.item())
    row = {key: float(np.mean(v)) for key, v in per_layer.items()}
    row["val_loss"] = float(np.mean(selected))
    row["val_loss_full"] = float(np.mean(full))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True,
                    help="the model whose indexer trains: one with its seeded indexer (train_shakespeare.py's)")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--sharpen-steps", type=int, default=30,
                    help="steps of the model but its indexer on the next-token loss plus the attention's entropy")
    ap.add_argument("--sharpen-weight", type=float, default=0.3, help="the entropy's weight in those steps")
    ap.add_argument("--sharpen-lr", type=float, default=3e-4)
    ap.add_argument("--warmup-steps", type=int, default=200, help="dense warm-up steps (indexer only)")
    ap.add_argument("--warmup-lr", type=float, default=1e-3)
    ap.add_argument("--joint-steps", type=int, default=30, help="steps with the selection on")
    ap.add_argument("--joint-lr", type=float, default=0.0, help="the rest of the model's learning rate (0: frozen)")
    ap.add_argument("--joint-indexer-lr", type=float, default=2e-4)
    ap.add_argument("--eval-every", type=int, default=30)
    ap.add_argument("--eval-windows", type=int, default=1)
    ap.add_argument("--no-figures", action="store_true", help="skip the held-out figures of the models (slow on CPU)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)

    cfg, params, hashes, tokens, merges, meta = file_params(args.model)
    if "indexer trained" in meta["general.name"][0]:  # e.g. the embedded model, which ships the trained indexer
        raise SystemExit(f"{args.model}: its indexer is trained already ({meta['general.name'][0]!r}); pass the "
                         "model before it, as train_shakespeare.py writes it (the embedded one before its indexer "
                         "was trained: git show c79c475:ds4lab/assets/shakespeare.gguf > seeded.gguf)")
    tok = Tokenizer(tokens, merges)
    train_text, val_text = held_out_split(args.data.read_text(encoding="utf-8"))
    train_ids = np.array(tok.encode(train_text), dtype=np.int64)
    val_ids = np.array(tok.encode(val_text), dtype=np.int64)
    indexer = {k: v for k, v in params.items() if is_indexer(k)}
    main_params = {k: v for k, v in params.items() if not is_indexer(k)}
    n_indexer = sum(v.size for v in indexer.values())
    print(f"train {len(train_ids)} tokens, val {len(val_ids)}; indexer {n_indexer} weights in "
          f"{len(indexer)} tensors, layers {indexed_layers(cfg)}", flush=True)

    backend = get_backend("mlx", kernels=False)  # autodiff through the plain ops
    objective = Objective(cfg, hashes, backend, args.sharpen_weight)
    # The validation windows lie past the held-out slice the figures score (its first 2000 predictions).
    val_starts = np.linspace(len(val_ids) // 2, len(val_ids) - args.seq - 2, args.eval_windows).astype(int)
    val_windows = [val_ids[s:s + args.seq + 1] for s in val_starts]

    def window():
        s = int(rng.integers(0, len(train_ids) - args.seq - 2))
        return train_ids[s:s + args.seq + 1]

    log = []

    def record(row, evaluate):
        row["seconds"] = time.time() - began
        if evaluate:
            row.update(val_row(objective, indexer, main_params, val_windows))
        log.append(row)
        if evaluate or row["step"] % 10 == 0:
            print(json.dumps(row), flush=True)

    record({"phase": "start", "step": 0}, True)
    # 0. sharpen: every row attended, the model but its indexer on the next-token loss plus the entropy of its
    # attention over the compressed rows, so that a few rows carry most of it
    skipped = 0
    sched = optim.cosine_decay(args.sharpen_lr, max(1, args.sharpen_steps), args.sharpen_lr * 0.1)
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.1)

    def sharpen(mp, w):  # the loss, with its next-token part and the mean entropy
        loss, got = objective(indexer, mp, w, "sharpen")
        return loss, (got.lm, got.mean_entropy)

    grad_sharpen = mx.value_and_grad(sharpen)
    for step in range(1, args.sharpen_steps + 1):
        (value, (lm, entropy)), g = grad_sharpen(main_params, window())
        g, norm = optim.clip_grad_norm(g, 1.0)
        # "lr": the rate this step's update applies (MLX reads its schedule before it counts the step)
        row = {"phase": "sharpen", "step": step, "train_loss": lm.item(), "entropy": entropy.item(),
               "grad_norm_main": float(norm), "lr": float(sched(step - 1))}
        if finite_step(row, ("train_loss", "entropy", "grad_norm_main")):
            opt.update(main_params, g)
            mx.eval(main_params, opt.state)
        else:
            skipped += 1
            row["skipped"] = skipped
        record(row, step % args.eval_every == 0 or step == args.sharpen_steps)
    first = args.sharpen_steps  # the steps before the indexer's

    # 1. dense warm-up: the indexer alone
    sched = optim.cosine_decay(args.warmup_lr, max(1, args.warmup_steps), args.warmup_lr * 0.1)
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    grad_dense = mx.value_and_grad(lambda ix, w: objective(ix, main_params, w, "dense")[0])
    for step in range(1, args.warmup_steps + 1):
        value, g = grad_dense(indexer, window())
        g, norm = optim.clip_grad_norm(g, 1.0)
        opt.update(indexer, g)
        mx.eval(indexer, opt.state)
        record({"phase": "dense", "step": first + step, "kl": value.item(), "grad_norm": float(norm),
                "lr": float(sched(step - 1))}, step % args.eval_every == 0 or step == args.warmup_steps)

    # 2. joint: the selection on, the indexer on KL over what it selected, the rest on the next-token loss
    opt_ix = optim.AdamW(learning_rate=args.joint_indexer_lr, weight_decay=0.0)
    opt_main = optim.AdamW(learning_rate=args.joint_lr, weight_decay=0.1)
    def joint(ix, mp, w):  # the loss, and the next-token part of it
        loss, got = objective(ix, mp, w, "joint")
        return loss, got.lm

    grad_joint = mx.value_and_grad(joint, argnums=(0, 1))
    for step in range(1, args.joint_steps + 1):
        (value, lm), (g_ix, g_main) = grad_joint(indexer, main_params, window())
        g_ix, n_ix = optim.clip_grad_norm(g_ix, 1.0)
        g_main, n_main = optim.clip_grad_norm(g_main, 1.0)
        row = {"phase": "joint", "step": first + args.warmup_steps + step, "kl": (value - lm).item(),
               "train_loss": lm.item(), "grad_norm": float(n_ix), "grad_norm_main": float(n_main),
               "lr": args.joint_indexer_lr}
        if finite_step(row, ("kl", "train_loss", "grad_norm", "grad_norm_main")):
            opt_ix.update(indexer, g_ix)
            if args.joint_lr > 0:
                opt_main.update(main_params, g_main)
            mx.eval(indexer, main_params, opt_ix.state, opt_main.state)
        else:
            skipped += 1
            row["skipped"] = skipped
        record(row, step % args.eval_every == 0 or step == args.joint_steps)
    train_seconds = time.time() - began

    weights = {k: np.array(v) for k, v in {**main_params, **indexer}.items()}
    for il, table in hashes.items():
        weights[f"blk.{il}.ffn_gate_tid2eid.weight"] = table
    sharpened = (f"attention sharpened ({args.sharpen_steps} steps, entropy weight {args.sharpen_weight:g}), "
                 if args.sharpen_steps else "")
    name = (f"{meta['general.name'][0]}, {sharpened}indexer trained ({args.warmup_steps} dense + "
            f"{args.joint_steps} joint steps)")
    gguf = write_model(cfg, args.out / "shakespeare.gguf", weights, name, tokens, merges)

    metrics = {
        "seed": SEED, "seq": args.seq, "sharpen_steps": args.sharpen_steps, "sharpen_weight": args.sharpen_weight,
        "sharpen_lr": args.sharpen_lr, "sharpen_schedule": "cosine decay to 10%",
        "warmup_steps": args.warmup_steps, "warmup_lr": args.warmup_lr,
        "warmup_schedule": "cosine decay to 10%", "joint_steps": args.joint_steps, "joint_lr": args.joint_lr,
        "joint_indexer_lr": args.joint_indexer_lr, "optimizer": "AdamW (indexer: no weight decay; rest: 0.1), "
        "grad clip 1.0 per group", "indexer_weights": int(n_indexer), "skipped_steps": skipped,
        "eval_every": args.eval_every, "eval_windows": args.eval_windows, "train_seconds": train_seconds,
        "device": str(mx.default_device()), "file_bytes": gguf.stat().st_size,
        "first_eval": log[0], "last_eval": log[-1],
    }
    if not args.no_figures:  # the held-out figures, on the float64 reference backend in ds4's numerics
        for label, path in (("before", args.model), ("after", gguf)):
            model = ds4lab.load(path, backend="numpy")
            metrics[f"figures_{label}"] = indexer_figures(model, held_out_ids(model))
            print(label, json.dumps(metrics[f"figures_{label}"]), flush=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    fields = sorted({k for row in log for k in row}, key=lambda k: (k not in ("phase", "step"), k))
    with (args.out / "train_log.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(log)
    print(json.dumps({k: metrics[k] for k in ("train_seconds", "last_eval")}))


if __name__ == "__main__":
    main()
