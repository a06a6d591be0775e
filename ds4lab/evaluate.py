"""Held-out loss of a model on text, as the training script and the model card report it."""

from __future__ import annotations

import numpy as np


def next_token_loss(model, ids) -> float:
    """Mean next-token cross-entropy (nats) of ``ids[1:]`` given their prefixes, from one prefill."""
    ids = np.asarray(ids)
    if len(ids) < 2:
        raise ValueError("need at least two tokens to score a prediction")
    logits = model.logits(ids[:-1]).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    return float((lse - logits[np.arange(len(ids) - 1), ids[1:]]).mean())


def held_out_split(text: str, fraction: float = 0.9) -> tuple[str, str]:
    """The training part and the held-out tail (the last ``1 − fraction`` of the characters)."""
    cut = int(len(text) * fraction)
    return text[:cut], text[cut:]
