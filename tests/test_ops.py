"""The ops protocol's shape: ``ds4lab.ops.Ops`` decides kernel or reference for every op, and an op's kernels,
launcher and body carry its name (that backends and kernels import no model, and the model no ops, kernels or
backends, is import-linter's contracts: tests/test_layering.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4lab.backends.numpy_backend import NumpyBackend
from ds4lab.mlx_kernels import specs as S
from ds4lab.mlx_kernels.dialects import SOURCES
from ds4lab.mlx_kernels.launches import KernelLaunches
from ds4lab.ops import Ops

PACKAGE = Path(__file__).resolve().parents[1] / "ds4lab"
OPS = ("attend", "hc_pre", "hc_post", "rope", "rmsnorm", "rmsnorm_rope", "store_kv", "compress_chunk", "compress_state",
       "add_ape",
       "append_rows", "compressed_visible", "ring_write", "indexer_scores", "indexer_allowed", "swiglu", "pair_sum",
       "moe_route", "hadamard_fp4")



def test_every_op_is_a_method_of_ops():
    assert all(callable(getattr(Ops, name, None)) for name in OPS)


def test_an_ops_kernels_launcher_and_body_carry_its_name():
    """The spec of each kernel an op runs is the op's name or starts with it (``attend``: ``attend_partial``,
    ``attend_reduce``, ``attend_chunk``), its launcher is the op's name, and its body is named for the kernel
    (a variant shares its kernel's body: ``attend_chunk_tf32``, ``rmsnorm_rope``)."""
    specs = {s.name: s for s in S.all_specs()}
    for op in OPS:
        if op == "compress_chunk":  # two kernels of their own names: compress_pool and compress_state
            assert {"compress_pool", "compress_state"} <= set(specs) and not hasattr(KernelLaunches, op)
            continue
        assert callable(getattr(KernelLaunches, op, None)), op
        mine = [n for n in specs if n == op or n.startswith(op + "_")]
        assert mine, op
        for n in mine:
            body = specs[n].body.removesuffix(".body")
            assert (SOURCES / specs[n].body).is_file() and n.startswith(body), (n, specs[n].body)


def test_ops_reads_the_backends_kernels_at_each_call():
    """A backend's kernels may change with the current device (an MLX cpu tier has none, CuPy has a set
    per GPU): the op asks each time."""

    class Launches:
        def rmsnorm(self, x, eps, weight=None):
            return "kernel"

    b = NumpyBackend()
    ops = Ops(b)
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(ops.rmsnorm(x, 1e-6), x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6))
    b.kernels = Launches()
    assert ops.kernels is b.kernels and ops.rmsnorm(x, 1e-6) == "kernel"
    b.kernels = None
    assert ops.kernels is None and not isinstance(ops.rmsnorm(x, 1e-6), str)


def test_ops_over_numpy_is_the_reference():
    from ds4lab.model import attention, numerics, rope

    ops = Ops(NumpyBackend())
    assert ops.xp is np and ops.dtype == np.float64 and ops.kernels is None
    rng = np.random.default_rng(0)
    q, keys, sinks = rng.standard_normal((3, 2, 8)), rng.standard_normal((5, 8)), rng.standard_normal(2)
    visible = rng.random((3, 5)) < 0.5
    np.testing.assert_array_equal(ops.attend(q, keys, visible, sinks, 0.3),
                                  attention.attend(np, q, keys, visible, sinks, 0.3))
    np.testing.assert_array_equal(ops.attend(q, keys[:2], visible[:, :2], sinks, 0.3, (keys[2:], visible[:, 2:])),
                                  attention.attend(np, q, keys, visible, sinks, 0.3))
    cos, sin = np.cos(rng.uniform(0, 6, (3, 2))), np.sin(rng.uniform(0, 6, (3, 2)))
    np.testing.assert_array_equal(ops.attend_rope(q, keys, visible, sinks, 0.3, None, cos, sin),
                                  rope.rope(np, attention.attend(np, q, keys, visible, sinks, 0.3), cos, sin, True))
    x = rng.standard_normal((4, 128))
    np.testing.assert_array_equal(ops.store_kv(x, 64), numerics.f16_round(np, numerics.fp8_kv_sim(np, x, 64)))


_TF32_SCRIPT = """
import os
import ds4lab.mlx_kernels.fast
assert "MLX_ENABLE_TF32" not in os.environ, "importing the kernel module set MLX_ENABLE_TF32"
from ds4lab.backends.mlx_backend import MLXBackend
MLXBackend("cpu", kernels=False)
print(os.environ["MLX_ENABLE_TF32"])
"""


@pytest.mark.parametrize("user", [None, "1"])
def test_the_mlx_backend_sets_float32_gemms_and_the_kernel_module_sets_nothing(user):
    pytest.importorskip("mlx.core")
    import os

    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    script = _TF32_SCRIPT
    if user is not None:  # the user's choice wins; importing the kernels leaves it as it is
        env["MLX_ENABLE_TF32"] = user
        script = script.replace('"MLX_ENABLE_TF32" not in os.environ', 'os.environ["MLX_ENABLE_TF32"] == "1"')
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd=PACKAGE.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == ("0" if user is None else user)
