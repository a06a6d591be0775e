"""Elementwise and normalization helpers shared by the model files (written over ``xp``)."""

from __future__ import annotations


def rmsnorm(xp, x, eps: float, weight=None):
    """x · 1/sqrt(mean(x²) + eps) over the last axis, times ``weight`` when given."""
    y = x * (1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps))
    return y if weight is None else y * weight


def sigmoid(xp, z):
    # The library's own sigmoid where it has one (MLX): its gradient stays finite where exp(−z)
    # overflows, which 1/(1 + exp(−z)) differentiated op by op does not.
    fused = getattr(xp, "sigmoid", None)
    return fused(z) if fused is not None else 1.0 / (1.0 + xp.exp(-z))


def silu(xp, z):
    return z * sigmoid(xp, z)


def softmax(xp, z, axis: int = -1):
    e = xp.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softplus(xp, x):
    """ds4's softplus: x above 20, exp(x) below −20, log1p(exp(x)) between."""
    mid = xp.log1p(xp.exp(xp.clip(x, -20.0, 20.0)))
    # Each branch is computed everywhere; bounding exp's argument keeps the unused branch (and its
    # gradient) finite.
    return xp.where(x > 20.0, x, xp.where(x < -20.0, xp.exp(xp.minimum(x, -20.0)), mid))


def topk_mask(xp, score, k: int):
    """Boolean mask of the ``k`` largest entries per row; ties go to the lower index (ds4's CPU scan).

    Everything strictly above the k-th largest value is kept, then entries equal to it are kept
    left to right until k are selected.
    """
    kth = xp.sort(score, axis=-1)[..., score.shape[-1] - k : score.shape[-1] - k + 1]
    above = score > kth
    tied = score == kth
    room = k - above.sum(axis=-1, keepdims=True)
    return above | (tied & (xp.cumsum(tied.astype(xp.int32), axis=-1) <= room))
