"""The float64 NumPy reference backend: every weight dequantized, every op in double precision."""

from __future__ import annotations

import numpy as np

from ..quants import dequantize
from .base import Backend


class NumpyBackend(Backend):  # no kernels: every op is the plain one
    name = "numpy"
    xp = np
    np_dtype = np.float64
    dtype = np.float64

    def asarray(self, a):
        return np.asarray(a, dtype=self.dtype)

    def to_numpy(self, x):
        return np.asarray(x)

    def linear(self, raw, qtype, ne0: int):
        weight_t = dequantize(raw, qtype, ne0).astype(self.dtype).T
        return lambda x: x @ weight_t

    def index_add(self, acc, rows, values):
        acc[rows] += values
        return acc

    can_compile = False

    def eval(self, *xs):
        pass
