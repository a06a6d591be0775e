"""Held-out loss of a model on text, as the training scripts and the model card report it, and how well the
indexer's top-k choice follows the attention it stands in for.

    python -m ds4lab.evaluate indexer                     # the embedded model, the first 2000 held-out predictions
    python -m ds4lab.evaluate indexer --model run/shakespeare.gguf --json figures.json

Recall of a query (a position that sees more compressed rows than the indexer keeps): in a prefill where every
query attends all its visible compressed rows, the attention mass each row receives, summed over the heads
(the distribution the indexer is trained to follow, DeepSeek V3.2's sparse-attention recipe), and the share of
that mass on the ``k`` rows the indexer scores highest. A random choice of ``k`` of ``n`` rows captures
``k / n`` of it on average; the ``k`` heaviest rows themselves (the oracle) bound what any indexer can reach.
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import numpy as np

from .config import check_count, replace
from .kv.layout import layer_comp_cap
from .model.attention import visible_rows
from .model.functional import topk_mask
from .model.transformer import Transformer
from .runtime import Runtime
from .session import check_token_ids

HELD_OUT_PREDICTIONS = 2000  # the model card's held-out slice: its first 2000 predictions
# A top-k no layer's compressed rows reach: every visible row is attended and the indexer does not run.
FULL_ATTENTION = 1 << 30


def next_token_loss(model, ids) -> float:
    """Mean next-token cross-entropy (nats) of ``ids[1:]`` given their prefixes, from one prefill (``ids``: token ids,
    or a text, encoded)."""
    if isinstance(ids, str):
        ids = model.tokenizer.encode(ids)
    check_token_ids(ids, model.config.n_vocab, then="nothing was scored")  # a negative id indexed from the end
    ids = np.asarray(ids)
    if ids.ndim != 1 or len(ids) < 2:
        raise ValueError(f"need a list of at least two tokens to score a prediction, got shape {ids.shape}")
    logits = model.logits(ids[:-1]).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    return float((lse - logits[np.arange(len(ids) - 1), ids[1:]]).mean())


def held_out_split(text: str, fraction: float = 0.9) -> tuple[str, str]:
    """The training part and the held-out tail (the last ``1 − fraction`` of the characters)."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction is the training part's share, between 0 and 1, got {fraction}")
    cut = int(len(text) * fraction)
    return text[:cut], text[cut:]


def with_top_k(model, top_k: int):
    """A copy of ``model`` (same weights, backend and numerics) whose indexer keeps ``top_k`` compressed rows per
    query; ``FULL_ATTENTION`` lets every query attend all its visible rows."""
    check_count(top_k, "top_k", of="rows")
    out = copy.copy(model)
    out.config = replace(model.config, idx_topk=top_k)
    out.transformer = Transformer(out.config, model.transformer.weights, model.transformer.ops, model.numerics)
    out.runtime = Runtime(out.transformer, model.backend)
    return out


def indexed_layers(config) -> list[int]:
    """The layers with an indexer (the ratio-4 layers)."""
    return [il for il in range(config.n_layer) if config.has_indexer(il)]


def dense_indexer_pass(model, ids) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """One prefill of ``ids`` in which every query attends all its visible compressed rows while the indexer
    scores them (its top-k is one row more than the state holds, so nothing is left out): per indexed layer
    ``(mass [T, rows], scores [T, rows])`` — the attention weight each compressed row receives, summed over the
    heads, and the indexer's score of it — and ``n_visible [T]``, the rows each query sees."""
    ids = model.token_ids(ids)
    T, layers = len(ids), indexed_layers(model.config)
    if not layers:
        raise ValueError(f"{model.path.name} has no indexer (compress_ratios {model.config.compress_ratios})")
    scoring = with_top_k(model, layer_comp_cap(model.config, layers[0], T + 1) - 1)
    sess = scoring.session(ctx=T + 1, prefill_chunk=T)
    with sess.capture(["attn.scores", "indexer.scores"], layers=layers) as cap:
        sess.prefill(ids).run(progress=False)
    out = {}
    for il in layers:
        amap = cap.attention(il)
        mass = amap.group("comp").sum(axis=1)
        out[il] = (mass, cap[f"blk.{il}.indexer.scores"][:, : amap.n_comp])
    return out, visible_rows(np.arange(T), model.config.ratio(layers[0]))


def _visible(n_visible: np.ndarray, rows: int) -> np.ndarray:
    """``[T, rows]``: whether each query sees each row (its first ``n_visible`` rows)."""
    return np.arange(rows)[None, :] < np.asarray(n_visible)[:, None]


def top_k_rows(scores: np.ndarray, n_visible: np.ndarray, k: int) -> np.ndarray:
    """The rows the indexer keeps, a mask like ``scores [T, rows]``: each query's ``k`` visible rows of highest
    score (all of them where it sees ``k`` or fewer), ties to the lower row, as the indexer breaks them."""
    visible = _visible(n_visible, scores.shape[1])
    return topk_mask(np, np.where(visible, scores, -np.inf), k) & visible


def top_k_recall(mass: np.ndarray, scores: np.ndarray, n_visible: np.ndarray, k: int) -> np.ndarray:
    """For each query that sees more than ``k`` rows: the share of its mass over its visible rows that falls on
    the ``k`` visible rows of highest score (ties to the lower row, as the indexer breaks them)."""
    check_count(k, "k", of="rows")
    keep = n_visible > k
    m = np.where(_visible(n_visible, mass.shape[1]), mass, 0.0)
    return (m * top_k_rows(scores, n_visible, k)).sum(axis=-1)[keep] / m.sum(axis=-1)[keep]


def indexer_recall(model, ids) -> dict[int, dict]:
    """Per indexed layer: mean top-k recall of the indexer, of a random choice (``k / n`` on average) and of
    the oracle (the ``k`` heaviest rows), over the queries of ``ids`` that see more than ``k`` rows."""
    k = model.config.idx_topk
    layers, n_visible = dense_indexer_pass(model, ids)
    many = n_visible > k
    if not many.any():
        first = model.config.ratio(next(iter(layers))) * (k + 1) - 1
        raise ValueError(f"{len(n_visible)} tokens: no query sees more than the top-{k} compressed rows; the "
                         f"recall needs more tokens (the first such query is at position {first})")
    return {il: {"indexer": float(top_k_recall(mass, scores, n_visible, k).mean()),
                 "random": float((k / n_visible[many]).mean()),
                 "oracle": float(top_k_recall(mass, mass, n_visible, k).mean()),
                 "queries": int(many.sum()), "top_k": k, **attention_shape(mass[many], n_visible[many])}
            for il, (mass, scores) in layers.items()}


def attention_shape(mass: np.ndarray, n_visible: np.ndarray) -> dict:
    """How concentrated the attention over the compressed rows is: the mean entropy (nats) of each query's mass
    over its visible rows, against that of an even spread over them (the mean of log n), and how many rows back
    from the newest visible one the heaviest sits (10th, 50th and 90th percentiles over the queries). Every query
    sees at least one row, holding some of its mass."""
    n_visible = np.asarray(n_visible)
    m = np.where(_visible(n_visible, mass.shape[1]), mass, 0.0)
    total = m.sum(axis=-1, keepdims=True)
    empty = np.nonzero(~(total[:, 0] > 0))[0]
    if len(empty):  # a spread over nothing: 0/0, a NaN entropy and a warning
        q = int(empty[0])
        raise ValueError(f"query {q} sees {int(n_visible[q])} rows holding mass {float(total[q, 0])}: every query "
                         "needs a visible row with mass")
    p = m / total
    entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
    back = n_visible - 1 - p.argmax(axis=-1)
    return {"entropy": float(entropy.mean()), "even_entropy": float(np.log(n_visible).mean()),
            "heaviest_back": [float(v) for v in np.percentile(back, [10, 50, 90])]}


def indexer_figures(model, ids) -> dict:
    """The model card's indexer figures on ``ids``: recall per indexed layer, and the held-out perplexity with
    the indexer's selection and with full attention over every compressed row."""
    loss = {"selected": next_token_loss(model, ids), "full": next_token_loss(with_top_k(model, FULL_ATTENTION), ids)}
    return {"recall": indexer_recall(model, np.asarray(ids)[:-1]), "loss": loss,
            "ppl": {name: math.exp(v) for name, v in loss.items()}, "predictions": len(ids) - 1,
            "numerics": model.numerics}


def held_out_ids(model, predictions: int = HELD_OUT_PREDICTIONS) -> np.ndarray:
    """The first ``predictions + 1`` tokens of the held-out tinyshakespeare text (the repository's ``data/``)."""
    check_count(predictions, "predictions")
    from .testing import data_file

    _, held_out = held_out_split(data_file("tinyshakespeare.txt").read_text(encoding="utf-8"))
    return np.asarray(model.tokenizer.encode(held_out)[: predictions + 1])


def format_figures(fig: dict) -> str:
    """The figures of :func:`indexer_figures` as a table and a line."""
    k = next(iter(fig["recall"].values()))["top_k"]
    lines = [f"{'layer':>5}  {'indexer':>8}  {'random':>8}  {'oracle':>8}  queries (recall of the top {k})"]
    for il, r in fig["recall"].items():
        lines.append(f"{il:>5}  {r['indexer']:>8.3f}  {r['random']:>8.3f}  {r['oracle']:>8.3f}  {r['queries']}")
    for il, r in fig["recall"].items():
        lo, mid, hi = r["heaviest_back"]
        lines.append(f"layer {il}: attention entropy {r['entropy']:.2f} nats (an even spread: "
                     f"{r['even_entropy']:.2f}); its heaviest row {mid:.0f} rows back (10%: {lo:.0f}, 90%: {hi:.0f})")
    lines.append(f"held-out perplexity ({fig['predictions']} predictions, numerics {fig['numerics']}): "
                 f"{fig['ppl']['selected']:.2f} with the indexer's selection, {fig['ppl']['full']:.2f} with full "
                 f"attention over every compressed row")
    return "\n".join(lines)


def main(argv=None) -> None:
    import ds4lab

    ap = argparse.ArgumentParser(prog="python -m ds4lab.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["indexer"], help="which figures")
    ap.add_argument("--model", help="a GGUF (default: the embedded model)")
    ap.add_argument("--predictions", type=int, default=HELD_OUT_PREDICTIONS)
    ap.add_argument("--numerics", default="ds4", choices=["ds4", "exact"])
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    model = ds4lab.load(args.model, backend="numpy", numerics=args.numerics)
    try:
        fig = indexer_figures(model, held_out_ids(model, args.predictions))
    except ValueError as e:
        raise SystemExit(f"python -m ds4lab.evaluate: {e}") from None
    print(format_figures(fig))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2)


if __name__ == "__main__":
    main()
