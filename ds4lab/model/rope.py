"""RoPE with YaRN on the tail dims of each head (docs/MODEL.md, "RoPE with YaRN").

The angles are computed on the host with ds4's CPU recipe, in float32: θ starts at the position and is
multiplied by ``powf(base, -2/n_rot)`` once per pair; compressed layers blend the interpolated and
extrapolated angle by the YaRN ramp. Both backends receive the same cos/sin tables, so the float32
angle error that ds4 has at long context is reproduced rather than being a source of disagreement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig

f32 = np.float32
ROWS_MIN = 4096  # positions a cached table covers at first; it doubles when a later position needs it
_ROWS: dict = {}  # RopeParams -> (cos, sin) for positions 0 … len − 1


@dataclass(frozen=True)
class RopeParams:
    n_rot: int
    freq_base: float
    freq_scale: float  # 1 for dense layers, 1/factor for compressed layers
    ext_factor: float  # 1 enables the YaRN ramp
    orig_ctx: int
    beta_fast: float
    beta_slow: float

    @classmethod
    def for_layer(cls, cfg: ModelConfig, il: int) -> "RopeParams":
        """Dense layers (ratio 0): base 10000, no YaRN. Compressed layers: base 160000 with YaRN."""
        compressed = cfg.ratio(il) != 0
        yarn = compressed and cfg.rope_scale_factor > 1.0
        return cls(
            n_rot=cfg.n_rot,
            freq_base=cfg.compress_rope_freq_base if compressed else cfg.rope_freq_base,
            freq_scale=1.0 / cfg.rope_scale_factor if yarn else 1.0,
            ext_factor=1.0 if yarn else 0.0,
            orig_ctx=cfg.rope_orig_ctx if compressed else 0,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
        )

    def corr_dims(self) -> tuple[np.float32, np.float32]:
        """ggml's YaRN correction range, computed in float32 as ds4 does."""
        def corr(beta):
            return f32(self.n_rot) * np.log(f32(self.orig_ctx) / (f32(beta) * f32(2.0) * f32(np.pi))) / (
                f32(2.0) * np.log(f32(self.freq_base)))

        lo = np.maximum(f32(0), np.floor(corr(self.beta_fast)))
        hi = np.minimum(f32(self.n_rot - 1), np.ceil(corr(self.beta_slow)))
        return f32(lo), f32(hi)

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of :meth:`tables` for ``positions``, gathered from a table kept per parameters (each
        row depends on its position only, so the values are the same; a step makes no angles)."""
        positions = np.asarray(positions)
        cos, sin = self.kept(int(positions.max()) + 1)
        return cos.take(positions, axis=0), sin.take(positions, axis=0)  # take: a decode step's host time

    def kept(self, need: int) -> tuple[np.ndarray, np.ndarray]:
        """The kept tables of positions 0 … at least ``need`` − 1 (made, or doubled, where they are shorter)."""
        cos, sin = _ROWS.get(self, ((), ()))
        if len(cos) < need:
            cos, sin = _ROWS[self] = self.tables(np.arange(max(ROWS_MIN, 1 << (need - 1).bit_length())))
        return cos, sin

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin tables ``[len(positions), n_rot/2]`` (float32), magnitude included."""
        n_pairs = self.n_rot // 2
        theta_scale = f32(np.float64(self.freq_base) ** (-2.0 / self.n_rot))
        theta_extrap = np.empty((len(positions), n_pairs), dtype=f32)
        theta = np.asarray(positions, dtype=np.int64).astype(f32)
        for k in range(n_pairs):  # iterative float32 products, as the C loop does
            theta_extrap[:, k] = theta
            theta = theta * theta_scale
        theta_interp = f32(self.freq_scale) * theta_extrap
        mscale = f32(1.0)
        if self.ext_factor != 0.0:
            lo, hi = self.corr_dims()
            k = np.arange(n_pairs, dtype=f32)
            y = (k - lo) / np.maximum(f32(0.001), hi - lo)
            ramp_mix = (f32(1) - np.minimum(f32(1), np.maximum(f32(0), y))) * f32(self.ext_factor)
            angle = theta_interp * (f32(1) - ramp_mix) + theta_extrap * ramp_mix
            # ds4 passes attn_factor = 1/(1 + 0.1 ln(1/freq_scale)) so that YaRN's magnitude cancels.
            yarn_m = f32(1) + f32(0.1) * np.log(f32(1) / f32(self.freq_scale))
            mscale = (f32(1) / yarn_m) * yarn_m
        else:
            angle = theta_interp
        return np.cos(angle) * mscale, np.sin(angle) * mscale


def rope(xp, x, cos, sin, inverse: bool = False):
    """Rotate interleaved pairs of the last ``2·cos.shape[-1]`` dims of ``x [T, ..., D]``.

    ``cos``/``sin`` are ``[T, n_rot/2]`` backend arrays; heads between T and D broadcast.
    """
    n_rot = 2 * cos.shape[-1]
    d = x.shape[-1]
    extra = x.ndim - 2
    c = cos.reshape(cos.shape[0], *([1] * extra), cos.shape[1])
    s = sin.reshape(sin.shape[0], *([1] * extra), sin.shape[1])
    if inverse:
        s = -s
    tail = x[..., d - n_rot:].reshape(*x.shape[:-1], n_rot // 2, 2)
    t0, t1 = tail[..., 0], tail[..., 1]
    rotated = xp.stack([t0 * c - t1 * s, t0 * s + t1 * c], axis=-1).reshape(*x.shape[:-1], n_rot)
    return xp.concatenate([x[..., : d - n_rot], rotated], axis=-1)
