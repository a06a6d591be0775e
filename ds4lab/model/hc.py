"""Hyper-connections: the n_hc-stream residual state (docs/MODEL.md, "Hyper-connections and Sinkhorn";
docs/MODEL.md, "The head").

State ``X [T, n_hc, E]``. Before each sublayer a mixer reads the RMS-normalized flat state and yields
pre weights (collapse the streams into the sublayer input), post gates (spread the output back) and a
Sinkhorn-normalized n_hc×n_hc combine matrix (mix the streams).
"""

from __future__ import annotations

from .functional import sigmoid, softmax


def sinkhorn(xp, logits, iters: int, eps: float):
    """Row softmax + eps, one column normalization, then ``iters − 1`` (row, column) normalizations."""
    m = softmax(xp, logits, axis=-1) + eps
    m = m / (m.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(axis=-1, keepdims=True) + eps)
        m = m / (m.sum(axis=-2, keepdims=True) + eps)
    return m


def hc_pre(ops, X, fn, scale, base, *, iters: int, eps: float, norm_eps: float):
    """Returns ``(x_in [T,E], post [T,n], comb [T,n,n])``; ``comb[t, s, o]`` maps input stream s to output o.

    ``ops`` is a :class:`ds4lab.ops.Ops` (its ``xp`` and ``rmsnorm``), whose ``hc_pre`` runs this where it has
    no kernel for it."""
    T, n, E = X.shape
    return hc_mix(ops.xp, fn(ops.rmsnorm(X.reshape(T, n * E), norm_eps)), scale, base, X, iters=iters, eps=eps)


def hc_mix(xp, mix, scale, base, X, *, iters: int, eps: float):
    """The mixer after its linear: ``mix [T, 2n + n²]`` → pre weights, post gates, Sinkhorn combine."""
    T, n = X.shape[:2]
    pre = sigmoid(xp, mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2.0 * sigmoid(xp, mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = sinkhorn(xp, (mix[:, 2 * n :] * scale[2] + base[2 * n :]).reshape(T, n, n), iters, eps)
    x_in = (pre[:, :, None] * X).sum(axis=1)
    return x_in, post, comb


def hc_post(xp, y, X, post, comb):
    """X_new[o] = post[o]·y + Σ_s comb[s, o]·X[s]  (the output stream indexes columns;
    docs/MODEL.md, "Hyper-connections and Sinkhorn")."""
    return post[:, :, None] * y[:, None, :] + xp.einsum("tso,tsd->tod", comb, X)


def hc_head(ops, X, fn, scale, base, *, eps: float, norm_eps: float):
    """The output head's stream collapse: sigmoid weights + eps, no post, no Sinkhorn (docs/MODEL.md, "The head").
    ``ops`` as :func:`hc_pre`'s (its norm one launch with kernels, where the plain ops take several)."""
    T, n, E = X.shape
    pre = fn(ops.rmsnorm(X.reshape(T, n * E), norm_eps))
    w = sigmoid(ops.xp, pre * scale[0] + base) + eps
    return (w[:, :, None] * X).sum(axis=1)
