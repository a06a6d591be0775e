"""The float64 NumPy reference backend: every weight dequantized, every op in double precision."""

from __future__ import annotations

from contextlib import nullcontext
from functools import lru_cache

import numpy as np

from ..quants import dequantize
from .base import Backend


@lru_cache(maxsize=1)
def _blas():
    """threadpoolctl's handle on NumPy's BLAS, or None where there is none to limit (no threadpoolctl: Pyodide)."""
    try:
        from threadpoolctl import ThreadpoolController

        return ThreadpoolController()
    except Exception:  # ImportError, or a platform whose libraries it cannot list
        return None


class NumpyBackend(Backend):  # no kernels: every op is the plain one
    name = "numpy"
    xp = np
    np_dtype = np.float64
    dtype = np.float64
    # BLAS threads while the model runs. Its products are small (a decode step's vectors; a small model's chunks):
    # OpenBLAS's threads gain little on an idle machine, and where other processes share the cores (a notebook's
    # browser and server, pytest's workers) their spinning waits made the embedded model's decode 2-20x slower
    # (benchmarks/README.md, "On a CPU"). None: BLAS as the process has it.
    blas_threads: int | None = 1

    def scope(self):
        blas = _blas()
        if blas is None or self.blas_threads is None:
            return nullcontext()
        return blas.limit(limits=self.blas_threads, user_api="blas")

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
