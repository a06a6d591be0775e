"""ds4lab's GPU kernels against the plain path, and whole models running them against the float64
reference.

Every test runs once per back-end: CuPy (the kernels compiled by NVRTC) and MLX's GPU back-end (the same
bodies as NVRTC cubins through ``mx.fast.precompiled_cuda_kernel``, or ``metal_kernel``), marked ``gpu``
and skipped with the reason where there is no GPU; and the CPU emulator (the same bodies compiled as C++,
a work-group's threads as fibers with real barriers), which runs wherever a C++20 compiler does, CI
included.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import ds4lab
from ds4lab import ops
from ds4lab.mlx_kernels import specs as S
from ds4lab.mlx_kernels.launches import Columns, InPlaceError, operand_round, tf32_round
from ds4lab.mlx_kernels.layout import blocks
from ds4lab.model.attention import attend
from ds4lab.quants import dequantize, quantize, quantized_activations, random_blocks
from ds4lab.testing import live_state_rows
from tests.conftest import CONFIGS, emulated_model


def _cupy_kernels():
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy finds no CUDA device"
    except Exception as e:  # ImportError, or CUDA driver errors
        return None, f"CuPy is unavailable: {e}"
    from ds4lab.cuda import CudaKernels

    return (CudaKernels(), cp.asarray, cp.asnumpy), None


def _mlx_kernels():
    try:
        import mlx.core as mx

        from ds4lab.backends.mlx_backend import float32_gemms
        from ds4lab.mlx_kernels.fast import MLXKernels, gpu_dialect
    except ImportError as e:
        return None, f"MLX is unavailable: {e}"
    if gpu_dialect() is None:
        return None, "MLX has no GPU back-end here (neither Metal nor CUDA)"
    float32_gemms()  # the launchers' dense products are GEMMs: float32 precision, as the backend keeps them
    mx.set_default_device(mx.gpu)
    return (MLXKernels(), mx.array, np.array), None


def _emulated_kernels():
    from ds4lab.mlx_kernels.cpu import CpuKernels, compiler

    if compiler() is None:
        return None, "no C++20 compiler here for the CPU kernel emulator"
    return (CpuKernels(), np.asarray, np.asarray), None


def _mlx_emulated_kernels():
    """MLX's launcher (its host side: arrays, grids counted in threads, outputs) with each kernel call
    answered by the CPU emulator instead of a GPU."""
    try:
        import mlx.core as mx

        from ds4lab.mlx_kernels.fast import MLXKernels
    except ImportError as e:
        return None, f"MLX is unavailable: {e}"
    found, why = _emulated_kernels()
    if found is None:
        return None, why
    cpu = found[0]

    class EmulatedMLXKernels(MLXKernels):
        device = mx.cpu

        def _kernel(self, spec):
            def call(inputs, grid, threadgroup, output_shapes, output_dtypes):
                assert grid[0] % threadgroup[0] == 0 and threadgroup[1:] == (1, 1)
                outs = [np.empty(shape, dtype=str(dtype).rsplit(".", 1)[-1]) for shape, dtype in
                        zip(output_shapes, output_dtypes)]
                cpu._launch(spec, (grid[0] // threadgroup[0], grid[1]), threadgroup[0],
                            (*[np.ascontiguousarray(np.array(x)) for x in inputs], *outs))
                return [mx.array(o) for o in outs]

            return call

    return (EmulatedMLXKernels(dialect="metal"), mx.array, np.array), None


GPU_BACKENDS = {"cupy": _cupy_kernels, "mlx": _mlx_kernels, "emulated": _emulated_kernels,
                "mlx-emulated": _mlx_emulated_kernels}
KERNEL_BACKENDS = [pytest.param("cupy", marks=pytest.mark.gpu), pytest.param("mlx", marks=pytest.mark.gpu), "emulated",
                   "mlx-emulated"]


@pytest.fixture(scope="module", params=KERNEL_BACKENDS)
def gpu(request):
    found, why = GPU_BACKENDS[request.param]()
    if found is None:
        pytest.skip(f"{request.param}: {why}")
    return request.param, *found


EMULATOR_WORK = 10_000_000  # the largest case left out, 80,640,000 scores of a chunk's attention, took 126 s


def small_on_the_emulator(backend: str, work: int) -> None:
    """The CPU emulator runs each thread in turn: it takes every shape but the largest (the same code paths),
    GPUs take them all."""
    if backend.endswith("emulated") and work > EMULATOR_WORK:
        pytest.skip(f"the CPU emulator runs the smaller shapes ({work:,} > {EMULATOR_WORK:,}); GPUs run this one")


def random_weight(qtype: Q, rows, ne0: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4):
        return random_blocks(qtype, rows, ne0, rng, 0.05)
    return quantize(rng.standard_normal((*rows, ne0)).astype(np.float32) * 0.05, qtype)


KERNEL_TYPES = (Q.F32, Q.F16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,ne0", [(3, 256), (37, 2048), (130, 4096)])
def test_dequant_kernel_matches_the_reference_decoder(gpu, qtype, rows, ne0):
    name, kernels, to_dev, to_host = gpu
    small_on_the_emulator(name, rows * ne0)
    raw = random_weight(qtype, (rows,), ne0, seed=rows)
    got = to_host(kernels.dequant(to_dev(blocks(raw, qtype)), qtype, ne0, rows))
    want = dequantize(raw, qtype, ne0)
    # Same operations in the same order; only a fused multiply-add may round differently (≤ 1 ulp).
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-9)
    if qtype == Q.MXFP4:  # a power of two times a small integer: no rounding at all, the same bits (+0 for code 8)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # dequant_<type>_f16 (a half-operand chunk's weights): the same values rounded to half, to nearest even
    halves = to_host(kernels.dequant(to_dev(blocks(raw, qtype)), qtype, ne0, rows, half=True))
    assert halves.dtype == np.float16
    np.testing.assert_array_equal(halves, got.astype(np.float16))


@pytest.mark.parametrize("qtype", (Q.F32, Q.F16), ids=lambda q: q.name)
@pytest.mark.parametrize("rows,ne0", [(2, 1), (3, 7), (5, 70), (2, 2051)])
def test_dequant_kernel_takes_rows_of_any_length(gpu, qtype, rows, ne0):
    """F32 and F16 rows of any length: eight elements a thread, the tail past a multiple of eight one at a time,
    rows that do not start 16 bytes apart stored without 16-byte stores; exact, and the halves rounded as NumPy
    rounds."""
    _, kernels, to_dev, to_host = gpu
    raw = random_weight(qtype, (rows,), ne0, seed=ne0)
    want = dequantize(raw, qtype, ne0)
    np.testing.assert_array_equal(to_host(kernels.dequant(to_dev(blocks(raw, qtype)), qtype, ne0, rows)), want)
    np.testing.assert_array_equal(to_host(kernels.dequant(to_dev(blocks(raw, qtype)), qtype, ne0, rows, half=True)),
                                  want.astype(np.float16))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n_pairs", [1, 3, 8, 9, 16])
def test_qmatmul_from_blocks_matches_float64(gpu, qtype, n_pairs):
    _, kernels, to_dev, to_host = gpu
    rows, ne0 = 67, 1024
    raw = random_weight(qtype, (rows,), ne0, seed=n_pairs)
    x = np.random.default_rng(1).standard_normal((n_pairs, ne0)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(raw, qtype, ne0).astype(np.float64).T
    got = to_host(kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype,ne0", [(Q.F32, 1003), (Q.F16, 517), (Q.F32, 20), (Q.F16, 6), (Q.F16, 1004),
                                       (Q.F16, 20)],
                         ids=lambda v: v.name if isinstance(v, Q) else str(v))
@pytest.mark.parametrize("n_pairs", [1, 3])
def test_qmatmul_rows_not_a_multiple_of_8(gpu, qtype, ne0, n_pairs):
    """K % 8 ≠ 0: each lane's 8-element steps, then the last elements one at a time, x read unaligned."""
    _, kernels, to_dev, to_host = gpu
    rows = 37
    raw = random_weight(qtype, (rows,), ne0, seed=ne0)
    x = np.random.default_rng(2).standard_normal((n_pairs, ne0)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(raw, qtype, ne0).astype(np.float64).T
    got = to_host(kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", sorted(S.GROUP32_X_LOADERS, key=lambda q: q.name), ids=lambda q: q.name)
@pytest.mark.parametrize("n_blocks", [2, 3])
def test_decode_groups_of_32_give_the_decoders_values(gpu, qtype, n_blocks):
    """The decode loop's groups of 32 (group32_<type>, dot32) element by element: pair p's x is the one-hot row
    e_p and each pair is a batch of its own (ids on the device), so out[p, r] is element p of row r, every other
    product an exact 0. The same values as the reference decoder (only a fused multiply-add may round
    differently, ≤ 1 ulp), in both halves of every Q2_K group (its x in two runs of 16). Three blocks of 256
    make rows 2 bytes past a word every other row: groups at every alignment the loads meet; Q8_0's 2 and 3
    blocks of 32 are part of one tile."""
    _, kernels, to_dev, to_host = gpu
    rows, ne0 = 40, n_blocks * (32 if qtype == Q.Q8_0 else 256)
    raw = random_weight(qtype, (1, rows), ne0, seed=41)
    x = np.eye(ne0, dtype=np.float32)
    w = to_dev(blocks(raw, qtype))
    got = to_host(kernels.qmatmul(to_dev(x), w, qtype, ne0, rows, to_dev(np.zeros(ne0, np.int32))))
    np.testing.assert_allclose(got.T, dequantize(raw[0], qtype, ne0), rtol=2e-7, atol=1e-9)


@pytest.mark.parametrize("qtype", (Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.Q8_0, Q.MXFP4), ids=lambda q: q.name)
def test_qmatmul_gathers_each_pairs_expert(gpu, qtype):
    _, kernels, to_dev, to_host = gpu
    n_expert, rows, ne0 = 7, 40, 512
    raw = random_weight(qtype, (n_expert, rows), ne0, seed=3)
    rng = np.random.default_rng(4)
    experts = np.r_[np.full(11, 5), rng.integers(0, n_expert, 20)]  # 11 pairs of one expert: 3 batches
    rng.shuffle(experts)
    x = rng.standard_normal((len(experts), ne0)).astype(np.float32)
    W = dequantize(raw, qtype, ne0).astype(np.float64)
    want = np.einsum("pk,prk->pr", x.astype(np.float64), W[experts])
    got = to_host(kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows, experts))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", (Q.IQ2_XXS, Q.Q2_K, Q.Q8_0, Q.F16), ids=lambda q: q.name)
def test_qmatmul_pairs_share_their_tokens_row(gpu, qtype):
    """``repeat``: a decode step's k pairs of a token read its one row of x: the same floats, bit for bit, as
    the pairs' rows repeated (host ids, and ids on the device as a decode step's routing gives them)."""
    name, kernels, to_dev, to_host = gpu
    n_expert, rows, ne0, k = 7, 40, 1024, 3
    raw = random_weight(qtype, (n_expert, rows), ne0, seed=5)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, ne0)).astype(np.float32)
    experts = np.array([4, 0, 6, 6, 2, 4])  # two tokens' three experts, one shared
    for ids in (experts, device_ids(name, to_dev, experts.astype(np.int32))):
        w = to_dev(blocks(raw, qtype))
        want = to_host(kernels.qmatmul(to_dev(np.repeat(x, k, axis=0)), w, qtype, ne0, rows, ids))
        got = to_host(kernels.qmatmul(to_dev(x), w, qtype, ne0, rows, ids, repeat=k))
        np.testing.assert_array_equal(got, want)


def device_ids(name: str, to_dev, ids: np.ndarray):
    """Expert ids as a decode step's routing leaves them on the device (the emulator marks what its kernels
    return as on the device)."""
    if name == "emulated":
        from ds4lab.mlx_kernels.cpu import DeviceArray

        return ids.view(DeviceArray)
    return to_dev(ids)


GROUP_ROWS = S.QMATMUL_SIMD_PER_GROUP * S.QMATMUL_SIMD_ROWS  # rows a qmatmul work-group computes


def recorded_launches(kernels, monkeypatch) -> list:
    """``(kernel name, groups)`` of each launch ``kernels`` makes from now on."""
    launches, run = [], kernels._run

    def recording(spec, groups, threads, inputs, outputs):
        launches.append((spec.name, tuple(groups)))
        return run(spec, groups, threads, inputs, outputs)

    monkeypatch.setattr(kernels, "_run", recording)
    return launches


# Few rows, long K: K split (S of qmatmul_splits; K = 8448 drops an empty eighth split, K = 5000 ends
# mid-block of 256 elements), the splits summed by qmatmul_reduce.
@pytest.mark.parametrize("qtype,rows,ne0,splits", [(Q.F32, 24, 16384, 16), (Q.Q8_0, 64, 4096, 4),
                                                   (Q.Q2_K, 64, 4096, 4), (Q.IQ2_XXS, 64, 4096, 4),
                                                   (Q.F16, 64, 4096, 4), (Q.Q2_K, 24, 8448, 7),
                                                   (Q.F16, 24, 5000, 4)],
                         ids=lambda v: v.name if isinstance(v, Q) else str(v))
@pytest.mark.parametrize("n_pairs", [1, 5, 9])  # 5, 9: more than one batch of pairs
def test_qmatmul_splits_long_rows(gpu, monkeypatch, qtype, rows, ne0, splits, n_pairs):
    _, kernels, to_dev, to_host = gpu
    raw = random_weight(qtype, (rows,), ne0, seed=ne0)
    x = np.random.default_rng(n_pairs).standard_normal((n_pairs, ne0)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(raw, qtype, ne0).astype(np.float64).T
    launches = recorded_launches(kernels, monkeypatch)
    got = to_host(kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows))
    batches = -(-n_pairs // S.MAX_PAIRS)
    assert launches == [(f"qmatmul_{qtype.name.lower()}", (-(-rows // GROUP_ROWS), batches * splits)),
                        ("qmatmul_reduce", (-(-n_pairs * rows // 256), 1))]
    assert got.shape == want.shape
    # float32 sums of products within 1e-5 of the result's scale (about 1e-7 seen on the CPU)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_one_splits_product_is_its_only_split_without_a_launch(gpu):
    """add_splits of a product in one K split gives that split as it is, with no launch: on MLX a reshape, not an
    index (``parts[0]`` is a gather kernel there and a squeeze: about 22 launches a step of the Flash slice)."""
    name, kernels, to_dev, to_host = gpu
    parts = np.random.default_rng(4).standard_normal((1, 3, 40)).astype(np.float32)
    got = kernels.add_splits(to_dev(parts))
    assert np.array_equal(to_host(got), parts[0])
    if name.startswith("mlx"):
        import os
        import re
        import tempfile

        import mlx.core as mx

        with tempfile.TemporaryDirectory() as d:
            mx.export_to_dot(os.path.join(d, "g.dot"), kernels.add_splits(to_dev(parts) * 2.0))
            made = re.findall(r'label ="([^"]+)", shape=rectangle', open(os.path.join(d, "g.dot")).read())
        assert "Gather" not in made and made.count("Reshape") == 1, made


@pytest.mark.parametrize("n_pairs", [1, 3])
def test_ops_add_a_products_splits_as_the_reduce_does(gpu, n_pairs):
    """swiglu, hc_post and moe_route given qmatmul's K splits (reduce=False, as ops.split_sums passes them in a
    decode step) give the same bits as on the reduced products: the splits added in qmatmul_reduce's order. gate
    split in 4, up in 8 (their own counts), y and the router's logits in 4. hc_post given a token's routed-expert
    rows and the shared expert's output gives the bits of pair_sum, the addition, then hc_post."""
    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(n_pairs)
    F, E, n = 64, 96, 4
    x = to_dev(rng.standard_normal((n_pairs, 4096)).astype(np.float32))
    x8 = to_dev(rng.standard_normal((n_pairs, 8192)).astype(np.float32))
    w_gate, w_up = (to_dev(blocks(random_weight(Q.Q8_0, (F,), K, seed=K), Q.Q8_0)) for K in (4096, 8192))
    w_y = to_dev(blocks(random_weight(Q.Q8_0, (E,), 4096, seed=5), Q.Q8_0))
    gate_parts = kernels.qmatmul(x, w_gate, Q.Q8_0, 4096, F, reduce=False)
    up_parts = kernels.qmatmul(x8, w_up, Q.Q8_0, 8192, F, reduce=False)
    y_parts = kernels.qmatmul(x, w_y, Q.Q8_0, 4096, E, reduce=False)
    assert (gate_parts.shape[0], up_parts.shape[0], y_parts.shape[0]) == (4, 8, 4)
    gate, up, y = (kernels.qmatmul(a, w, Q.Q8_0, K, N) for a, w, K, N in
                   ((x, w_gate, 4096, F), (x8, w_up, 8192, F), (x, w_y, 4096, E)))
    weights = to_dev(rng.uniform(0.1, 2, n_pairs).astype(np.float32))
    np.testing.assert_array_equal(to_host(kernels.swiglu(gate_parts, up_parts, 10.0, weights)),
                                  to_host(kernels.swiglu(gate, up, 10.0, weights)))
    X = to_dev(rng.standard_normal((n_pairs, n, E)).astype(np.float32))
    post = to_dev(rng.uniform(0, 2, (n_pairs, n)).astype(np.float32))
    comb = to_dev(rng.uniform(0, 1, (n_pairs, n, n)).astype(np.float32))
    np.testing.assert_array_equal(to_host(kernels.hc_post(y_parts, X, post, comb)),
                                  to_host(kernels.hc_post(y, X, post, comb)))
    rows = to_dev(rng.standard_normal((n_pairs * 6, E)).astype(np.float32))
    shared = to_dev(rng.standard_normal((n_pairs, E)).astype(np.float32))
    np.testing.assert_array_equal(to_host(kernels.hc_post(rows, X, post, comb, 6, shared)),
                                  to_host(kernels.hc_post(kernels.pair_sum(rows, 6) + shared, X, post, comb)))
    w_r = to_dev(blocks(random_weight(Q.Q8_0, (64,), 4096, seed=6), Q.Q8_0))
    logit_parts = kernels.qmatmul(x, w_r, Q.Q8_0, 4096, 64, reduce=False)
    assert logit_parts.shape[0] == 4
    bias = to_dev(rng.uniform(0, 0.5, 64).astype(np.float32))
    got, want = (kernels.moe_route(a, bias, 6, 1.5) for a in (logit_parts, kernels.add_splits(logit_parts)))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_host(g), to_host(w))


def test_qmatmul_splits_gathered_pairs(gpu, monkeypatch):
    """Six pairs of four experts (host ids: four batches; device ids, where the launcher has them: six),
    K split in four either way."""
    _, kernels, to_dev, to_host = gpu
    n_expert, rows, ne0, qtype = 5, 32, 4096, Q.Q8_0
    raw = random_weight(qtype, (n_expert, rows), ne0, seed=9)
    rng = np.random.default_rng(10)
    experts = np.array([3, 0, 3, 4, 1, 0])
    x = rng.standard_normal((len(experts), ne0)).astype(np.float32)
    W = dequantize(raw, qtype, ne0).astype(np.float64)
    want = np.einsum("pk,prk->pr", x.astype(np.float64), W[experts])
    launches = recorded_launches(kernels, monkeypatch)
    for ids in (experts, to_dev(experts)):
        got = to_host(kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows, ids))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    device_batches = 4 if isinstance(to_dev(experts), np.ndarray) else 6
    assert launches == [("qmatmul_q8_0", (32 // GROUP_ROWS, 4 * 4)), ("qmatmul_reduce", (1, 1)),
                        ("qmatmul_q8_0", (32 // GROUP_ROWS, device_batches * 4)), ("qmatmul_reduce", (1, 1))]


@pytest.mark.parametrize("qtype", sorted(S.GROUP32_X_LOADERS, key=lambda q: q.name), ids=lambda q: q.name)
def test_decode_loop_over_several_steps(gpu, monkeypatch, qtype):
    """A decode step's loop (one pair a batch) over a whole row of 2,816 elements, unsplit: two full steps of
    1,024 and a third that only some lanes take (each a lane's group of 32 a step); 9 rows,
    the last SIMD group's past N reading row N - 1. Within 1e-5 of float64's scale."""
    _, kernels, to_dev, to_host = gpu
    monkeypatch.setattr(S, "QMATMUL_SIMD_GROUPS", 1)  # no split of K
    rows, ne0 = 9, 2816
    raw = random_weight(qtype, (2, rows), ne0, seed=43)
    x = np.random.default_rng(44).standard_normal((3, ne0)).astype(np.float32)
    ids = np.array([1, 0, 1], np.int32)
    w = to_dev(blocks(raw, qtype))
    got = to_host(kernels.qmatmul(to_dev(x), w, qtype, ne0, rows, device_ids(gpu[0], to_dev, ids)))
    want = np.einsum("pk,prk->pr", x.astype(np.float64), dequantize(raw, qtype, ne0).astype(np.float64)[ids])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


Q8_CASES = [(Q.Q8_0, 40, 1024, 1, None), (Q.Q8_0, 24, 4096, 3, None), (Q.IQ2_XXS, 40, 2048, 1, None),
            (Q.IQ2_XXS, 40, 1024, 6, "host"), (Q.Q2_K, 24, 4096, 2, None), (Q.Q2_K, 40, 1024, 6, "device"),
            (Q.Q8_0, 24, 2048, 6, "device"), (Q.Q8_0, 24, 800, 2, None)]  # 800: K not a multiple of 256


@pytest.mark.parametrize("qtype,rows,ne0,n_pairs,experts", Q8_CASES,
                         ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_qmatmul_on_quantized_x_matches_float64(gpu, monkeypatch, qtype, rows, ne0, n_pairs, experts):
    """decode_matmul="q8": x quantized per block as ds4's decode does (quants.quantized_activations, in NumPy) then
    products in integers: within 2e-6 of the scale of float64's product of the quantized x, and farther than that
    from the product of x itself (the kernel did quantize). Dense pairs (K split), host ids, device ids sharing a
    token's row (repeat)."""
    name, kernels, to_dev, to_host = gpu
    monkeypatch.setattr(kernels, "decode_matmul", "q8")
    n_expert, repeat = 4, 3 if experts == "device" else 1
    raw = random_weight(qtype, (n_expert, rows), ne0, seed=ne0 + n_pairs)
    rng = np.random.default_rng(n_pairs)
    n_rows = n_pairs // repeat
    x = (rng.standard_normal((n_rows, ne0)) * rng.uniform(0.1, 10, (n_rows, 1))).astype(np.float32)
    W = dequantize(raw, qtype, ne0).astype(np.float64)
    ids = rng.integers(0, n_expert, n_pairs) if experts else np.zeros(n_pairs, np.int64)
    xs = np.repeat(x, repeat, axis=0)
    want = np.einsum("pk,prk->pr", quantized_activations(xs, qtype), W[ids])
    plain = np.einsum("pk,prk->pr", xs.astype(np.float64), W[ids])
    launches = recorded_launches(kernels, monkeypatch)
    if experts is None:
        got = kernels.qmatmul(to_dev(x), to_dev(blocks(raw[0], qtype)), qtype, ne0, rows)
    elif experts == "host":
        got = kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows, ids)
    else:
        got = kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows,
                              device_ids(name, to_dev, ids.astype(np.int32)), repeat=repeat)
    got = to_host(got)
    assert launches[0][0] == f"qmatmul_xq8_{qtype.name.lower()}"
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
    assert np.abs(got - plain).max() > 1e-4 * scale


@pytest.mark.parametrize("n_split,P,D,lo,N", [(4, 1, 1024, 0, 1536), (4, 1, 512, 1024, 1536), (1, 2, 128, 64, 256),
                                             (3, 3, 192, 0, 320)])
def test_rmsnorm_of_a_products_splits_equals_reduce_then_rmsnorm(gpu, n_split, P, D, lo, N):
    """rmsnorm_parts and rmsnorm_rope_parts on Columns of a product's K splits: the floats of qmatmul_reduce, then the
    columns, then rmsnorm / rmsnorm_rope (the same sums in the same order; on a GPU within a float's last bits, a
    compiler may fuse one kernel's square into its sum and not the other's)."""
    name, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(D + P)
    parts = to_dev((3 * rng.standard_normal((n_split, P, N))).astype(np.float32))
    w = to_dev(rng.uniform(0.5, 1.5, D).astype(np.float32))
    angle = rng.uniform(-40, 40, (P, 32))
    cos, sin = to_dev(np.cos(angle).astype(np.float32)), to_dev(np.sin(angle).astype(np.float32))
    cols = Columns(parts, lo, lo + D)
    x = kernels.add_splits(parts)[:, lo:lo + D]
    tol = 0 if name == "emulated" else 1e-6
    for got, want in [(kernels.rmsnorm(cols, 1e-6, w), kernels.rmsnorm(x, 1e-6, w)),
                      *zip(kernels.rmsnorm_rope(cols, 1e-6, w, cos, sin), kernels.rmsnorm_rope(x, 1e-6, w, cos, sin))]:
        got, want = to_host(got), to_host(want)
        assert got.shape == (P, D)
        np.testing.assert_allclose(got, want, rtol=tol, atol=0)
    sums = to_host(parts).sum(axis=0, dtype=np.float64)[:, lo:lo + D]
    np.testing.assert_allclose(to_host(x), sums, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", sorted(S.QUANT_X, key=lambda q: q.name), ids=lambda q: q.name)
def test_quantized_decode_loop_over_several_steps(gpu, monkeypatch, qtype):
    """decode_matmul="q8" over a whole row, unsplit: a first window of x's quantized blocks (a work-group's
    threads' worth), then 2,816 elements, two full steps of 1,024 and a third that only some lanes take (the
    threads past the end quantize zeros no lane reads); 9 rows of two experts, the SIMD group's rows past N reading
    row N - 1, the work-group's other SIMD groups holding no rows (they quantize and meet the barriers all the same).
    Within 2e-6 of the scale of float64's product of the quantized x."""
    name, kernels, to_dev, to_host = gpu
    monkeypatch.setattr(kernels, "decode_matmul", "q8")
    monkeypatch.setattr(S, "QMATMUL_SIMD_GROUPS", 1)  # no split of K
    rows, ne0 = 9, 32 * 32 * S.QMATMUL_SIMD_PER_GROUP + 2816
    raw = random_weight(qtype, (2, rows), ne0, seed=45)
    x = np.random.default_rng(46).standard_normal((3, ne0)).astype(np.float32)
    ids = np.array([1, 0, 1], np.int32)
    w = to_dev(blocks(raw, qtype))
    got = to_host(kernels.qmatmul(to_dev(x), w, qtype, ne0, rows, device_ids(name, to_dev, ids)))
    W = dequantize(raw, qtype, ne0).astype(np.float64)[ids]
    want = np.einsum("pk,prk->pr", quantized_activations(x, qtype), W)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q2_K), ids=lambda q: q.name)
def test_quantized_x_rounds_half_to_even(gpu, monkeypatch, qtype):
    """Worked by hand: a block whose largest |x| is 127 keeps the scale 1 (Q8_0: d = 127 / 127; Q8_K: m = -127,
    scale = -127 / m), so x's halves are rounded as they are, to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0,
    -3.5 -> -4, 126.5 -> 126; the product with every row of a random W against those values' in float64."""
    _, kernels, to_dev, to_host = gpu
    monkeypatch.setattr(kernels, "decode_matmul", "q8")
    size = 32 if qtype == Q.Q8_0 else 256
    x = np.zeros((1, size), np.float32)
    x[0, :7] = [-127.0, 0.5, 1.5, 2.5, -0.5, -3.5, 126.5]
    rounded = np.zeros(size)
    rounded[:7] = [-127, 0, 2, 2, 0, -4, 126]
    rows = 16
    raw = random_weight(qtype, (rows,), size, seed=7)
    W = dequantize(raw, qtype, size).astype(np.float64)
    got = to_host(kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, size, rows))
    np.testing.assert_array_equal(quantized_activations(x, qtype), rounded[None])
    np.testing.assert_allclose(got, rounded[None] @ W.T, rtol=0, atol=1e-6 * np.abs(rounded @ W.T).max())


def test_qmatmul_with_enough_rows_does_not_split(gpu, monkeypatch):
    """Rows enough to fill QMATMUL_SIMD_GROUPS on their own: one pass writes out, as before the splits."""
    _, kernels, to_dev, to_host = gpu
    rows, ne0, qtype = S.QMATMUL_SIMD_GROUPS * S.QMATMUL_SIMD_ROWS, 2048, Q.Q4_K
    raw = to_dev(blocks(random_weight(qtype, (rows,), ne0, seed=11), qtype))
    x = to_dev(np.random.default_rng(12).standard_normal((2, ne0)).astype(np.float32))
    launches = recorded_launches(kernels, monkeypatch)
    got = to_host(kernels.qmatmul(x, raw, qtype, ne0, rows))
    assert launches == [("qmatmul_q4_k", (rows // GROUP_ROWS, 1))]
    np.testing.assert_array_equal(got, to_host(kernels.qmatmul(x, raw, qtype, ne0, rows)))
    want = to_host(x).astype(np.float64) @ dequantize(to_host(raw), qtype, ne0).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_pair_batches_cut_each_experts_run_of_slots():
    from ds4lab.mlx_kernels.specs import pair_batches

    order, batches = pair_batches(np.array([3, 1, 3, 3, 1, 0, 3]), 7, 2)
    assert order.tolist() == [5, 1, 4, 0, 2, 3, 6]  # by expert, pairs of one expert in their order
    assert batches.tolist() == [[0, 0, 1], [1, 1, 2], [3, 3, 2], [3, 5, 2]]
    order, batches = pair_batches(None, 5, 2)  # one matrix
    assert order.tolist() == [0, 1, 2, 3, 4] and batches.tolist() == [[0, 0, 2], [0, 2, 2], [0, 4, 1]]
    order, batches = pair_batches(np.array([2, 2, 2]), 3, 8)
    assert order.tolist() == [0, 1, 2] and batches.tolist() == [[2, 0, 3]]
    order, batches = pair_batches(None, 0, 8)
    assert order.shape == (0,) and batches.shape == (0, 3)


QGEMM_K = {Q.F32: 100, Q.F16: 70, Q.Q8_0: 96, Q.Q2_K: 512, Q.Q4_K: 256, Q.IQ2_XXS: 256,  # F32/F16: K % BK ≠ 0
           Q.MXFP4: 96}


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_qgemm_gathers_each_pairs_expert(gpu, qtype):
    """Expert 2 has more rows than one tile (QGEMM_BM = 64), expert 4 one row, expert 3 none; N = 70 is
    not a multiple of QGEMM_BN. Float32 sums in another order than float64's: within 1e-5 of the scale."""
    _, kernels, to_dev, to_host = gpu
    n_expert, rows, ne0 = 5, 70, QGEMM_K[qtype]
    raw = random_weight(qtype, (n_expert, rows), ne0, seed=5)
    rng = np.random.default_rng(6)
    experts = np.r_[np.full(70, 2), 4, rng.choice([0, 1], 12)]
    rng.shuffle(experts)
    x = rng.standard_normal((len(experts), ne0)).astype(np.float32)
    W = dequantize(raw, qtype, ne0).astype(np.float64)
    want = np.einsum("pk,prk->pr", x.astype(np.float64), W[experts])
    got = to_host(kernels.qgemm(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows, experts))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.IQ2_XXS), ids=lambda q: q.name)
def test_qgemm_reads_each_tokens_row_for_its_pairs(gpu, qtype):
    """``repeat = k``: pair p multiplies row p // k of x (a token's k experts share its row, which is never
    repeated in memory): the same floats as the product of x's rows repeated, bit for bit."""
    _, kernels, to_dev, to_host = gpu
    n_expert, rows, ne0, T, k = 5, 70, QGEMM_K[qtype], 23, 6
    raw = to_dev(blocks(random_weight(qtype, (n_expert, rows), ne0, seed=31), qtype))
    rng = np.random.default_rng(32)
    experts = rng.integers(0, n_expert, T * k)
    x = rng.standard_normal((T, ne0)).astype(np.float32)
    got = to_host(kernels.qgemm(to_dev(x), raw, qtype, ne0, rows, experts, k))
    want = to_host(kernels.qgemm(to_dev(np.repeat(x, k, axis=0)), raw, qtype, ne0, rows, experts))
    assert got.shape == (T * k, rows)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", (Q.F16, Q.Q8_0, Q.IQ2_XXS), ids=lambda q: q.name)
def test_qgemm_with_one_matrix_matches_float64(gpu, qtype):
    _, kernels, to_dev, to_host = gpu
    rows, ne0, P = 67, QGEMM_K[qtype], 130
    raw = random_weight(qtype, (rows,), ne0, seed=7)
    x = np.random.default_rng(8).standard_normal((P, ne0)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(raw, qtype, ne0).astype(np.float64).T
    got = to_host(kernels.qgemm(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("operands", S.OPERANDS)
@pytest.mark.parametrize("qtype", (Q.F16, Q.Q8_0), ids=lambda q: q.name)
def test_grouped_product_matches_float64(gpu, monkeypatch, qtype, operands):
    """A chunk's attn_output_a: row t of group g times matrix g, in group order. x is a slice of a wider array
    (its rows spaced wider than G·K, as CuPy's strided batched GEMM reads them in place). Float32: within 1e-5
    of the scale of float64's sum; TF32 or half operands (10 mantissa bits): within 2e-3."""
    backend, kernels, to_dev, to_host = gpu
    if operands != "float32" and backend.startswith("mlx"):
        pytest.skip("prefill_matmul='tf32' / 'f16' is the CuPy backend's (ds4lab.load refuses it on MLX)")
    monkeypatch.setattr(kernels, "chunk_operands", operands)
    G, rows, ne0, T = 3, 40, QGEMM_K[qtype], 70
    raw = random_weight(qtype, (G, rows), ne0, seed=21)
    x = np.random.default_rng(22).standard_normal((T, G + 1, ne0)).astype(np.float32)
    W = dequantize(raw, qtype, ne0).astype(np.float64).reshape(G, rows, ne0)
    want = np.einsum("tgk,grk->tgr", x[:, :G].astype(np.float64), W).reshape(T, G * rows)
    got = to_host(kernels.grouped_product(to_dev(x)[:, :G], to_dev(blocks(raw, qtype)), qtype, ne0, rows))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=(1e-5 if operands == "float32" else 2e-3) * np.abs(want).max())


@pytest.mark.parametrize("T, k, D", ((1, 6, 4096), (37, 6, 131), (5, 1, 70), (300, 6, 33)))
def test_pair_sum_adds_each_tokens_rows_in_order(gpu, T, k, D):
    """The routed experts' sum per token: NumPy's float32 sum over the pair axis (it adds the rows in order,
    as the kernel does), bit for bit."""
    _, kernels, to_dev, to_host = gpu
    y = (np.random.default_rng(T + D).standard_normal((T * k, D)) * 10.0 ** np.arange(-3, 3)[np.arange(T * k) % 6,
                                                                                            None]).astype(np.float32)
    got = to_host(kernels.pair_sum(to_dev(y), k))
    np.testing.assert_array_equal(got, y.reshape(T, k, D).sum(axis=1))


@pytest.mark.parametrize("shape", ((1,), (7,), (8,), (3, 1000), (2, 5, 203)))
def test_round_half_rounds_as_numpy_does(gpu, shape):
    """round_half (a half-operand product's x): NumPy's float32 -> float16 conversion (to nearest even; overflow
    to infinity, subnormals, signed zeros, NaN), bit for bit, for sizes with and without a tail past the last
    eight; a large ``n`` also checks the grid's size."""
    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-9, 6, shape)).astype(np.float32)
    special = np.array([65504.0, 65520.0, 1e6, -1e6, 6e-8, 2.0 ** -25, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                        -0.0, np.nan], dtype=np.float32)  # 65520 and 2^-25: ties, the first to infinity
    x.reshape(-1)[:len(special)] = special[:x.size]
    got = to_host(kernels.round_half(to_dev(x)))
    assert got.dtype == np.float16 and got.shape == shape
    with np.errstate(over="ignore"):  # the values past half's range, on purpose
        want = x.astype(np.float16)
    nan = np.isnan(want)  # a NaN's bits are the device's own (CUDA's is 0x7fff)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_tf32_round_keeps_ten_mantissa_bits_with_ties_away_from_zero():
    ulp = 2.0 ** -10  # TF32's spacing in [1, 2)
    x = np.array([1.0, 1 + ulp / 2, 1 + ulp / 2 - 2.0 ** -23, 1 + ulp / 4, -(1 + ulp / 2), 0.75 + ulp / 4, 1e-30, 0.0],
                 dtype=np.float32)  # 0.75 + ulp / 4: a tie at [0.5, 1)'s spacing of ulp / 2
    want = np.array([1.0, 1 + ulp, 1.0, 1.0, -(1 + ulp), 0.75 + ulp / 2, np.float32(1e-30), 0.0], dtype=np.float32)
    got = tf32_round(np, x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[:6], want[:6])
    assert abs(got[6] - want[6]) <= 2.0 ** -11 * 1e-30 and got[7] == 0.0


@pytest.mark.parametrize("operands", ("tf32", "f16"))
@pytest.mark.parametrize("qtype", (Q.F16, Q.Q8_0, Q.IQ2_XXS, Q.Q2_K), ids=lambda q: q.name)
def test_qgemm_reduced_operands_round_both(gpu, monkeypatch, qtype, operands):
    """``qgemm_<type>_tf32`` and ``_f16``: the products of x and W rounded to TF32 (cvt.rna: ties away from zero)
    or to half (to nearest even) summed in float32, within 1e-5 of the scale of float64's sum of the same
    rounded operands; the unrounded product lies farther away than that, so the rounding is seen."""
    _, kernels, to_dev, to_host = gpu
    monkeypatch.setattr(kernels, "chunk_operands", operands)
    n_expert, rows, ne0 = 3, 70, QGEMM_K[qtype]
    raw = random_weight(qtype, (n_expert, rows), ne0, seed=11)
    rng = np.random.default_rng(12)
    experts = rng.integers(0, n_expert, 90)
    x = rng.standard_normal((len(experts), ne0)).astype(np.float32)
    W = dequantize(raw, qtype, ne0)
    want = np.einsum("pk,prk->pr", operand_round(np, x, operands).astype(np.float64),
                     operand_round(np, W, operands).astype(np.float64)[experts])
    exact = np.einsum("pk,prk->pr", x.astype(np.float64), W.astype(np.float64)[experts])
    got = to_host(kernels.qgemm(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows, experts))
    tol = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert np.abs(exact - want).max() > 3 * tol


@pytest.mark.parametrize("operands", ("tf32", "f16"))
def test_dense_product_reduced_operands(gpu, monkeypatch, operands):
    """A chunk's dense product (cuBLAS on CuPy) with ``chunk_operands``: float32 within 1e-5 of the scale; TF32
    or half operands within their bound (each operand off by at most 2^-10 of itself even if cuBLAS truncates,
    so each term by 2^-9) and farther from float64 than float32 gets, so the reduced operands are in use."""
    backend, kernels, to_dev, to_host = gpu
    if backend.startswith("mlx"):
        pytest.skip("prefill_matmul='tf32' / 'f16' is the cupy backend's (MLX multiplies chunks in float32)")
    rng = np.random.default_rng(13)
    x = rng.standard_normal((300, 1000)).astype(np.float32)
    w = rng.standard_normal((200, 1000)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(exact).max()
    bound = 2.0 ** -9 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T) + 1e-5 * scale
    f32 = to_host(kernels.dense_product(to_dev(x), to_dev(w)))
    np.testing.assert_allclose(f32, exact, rtol=0, atol=1e-5 * scale)
    monkeypatch.setattr(kernels, "chunk_operands", operands)
    got = to_host(kernels.dense_product(to_dev(x), to_dev(w)))
    assert (np.abs(got - exact) <= bound).all()
    assert np.abs(got - exact).max() > 5e-5 * scale
    again = to_host(kernels.dense_product(to_dev(x), to_dev(w)))  # the same product: the switch is stable
    np.testing.assert_array_equal(again, got)


def test_dense_product_of_few_rows_stays_float32_with_half_operands(gpu, monkeypatch):
    """With "f16", a product of at most FLOAT32_PRODUCT_ROWS output rows (the HC mixers') keeps float32 operands:
    within 1e-5 of float64's scale, where halves would be farther off; one more row takes halves."""
    backend, kernels, to_dev, to_host = gpu
    if backend.startswith("mlx"):
        pytest.skip("prefill_matmul='f16' is the cupy backend's (MLX multiplies chunks in float32)")
    monkeypatch.setattr(kernels, "chunk_operands", "f16")
    rng = np.random.default_rng(14)
    x = rng.standard_normal((100, 1000)).astype(np.float32)
    for n, near in ((S.FLOAT32_PRODUCT_ROWS, True), (S.FLOAT32_PRODUCT_ROWS + 1, False)):
        w = rng.standard_normal((n, 1000)).astype(np.float32)
        exact = x.astype(np.float64) @ w.astype(np.float64).T
        off = np.abs(to_host(kernels.dense_product(to_dev(x), to_dev(w))) - exact).max() / np.abs(exact).max()
        assert (off <= 1e-5) == near, (n, off)


# attend_partial's blocks of ATTN_HEADS (8) heads: H = 20 and 9 end in a part block, D = 72 and 50 are no multiple
# of 32; its splits: N = 1 and 37 one split, 300 at T = 16 nine splits of at most 34 keys, about 60% of them
# visible (tiles partly filled); (1, 64, 512, 1200) Flash's decode step at 4K context (8 blocks × 32 splits).
@pytest.mark.parametrize("T,H,D,N", [(1, 4, 128, 1), (1, 64, 512, 4100), (1, 64, 512, 1200), (3, 2, 96, 37),
                                     (2, 8, 64, 700), (16, 4, 128, 300), (2, 20, 72, 100), (3, 9, 50, 130)])
def test_split_key_attention_matches_float64(gpu, T, H, D, N):
    name, kernels, to_dev, to_host = gpu
    small_on_the_emulator(name, T * H * N)
    check_split_key_attention(kernels, to_dev, to_host, T, H, D, N)


def test_split_key_attention_with_more_keys_a_split_than_a_group_has_threads(gpu, monkeypatch):
    """One split (a grid aiming at one work-group) of 300 keys: three windows of ATTN_GROUP flags, the third
    partial; 2 blocks of heads for each of the 2 queries."""
    _, kernels, to_dev, to_host = gpu
    monkeypatch.setattr(S, "ATTN_GROUPS", 1)
    launches = recorded_launches(kernels, monkeypatch)
    check_split_key_attention(kernels, to_dev, to_host, 2, 12, 64, 300)
    # once with the keys in one array, then split at 1, 100 and 299 (check_split_key_attention): the same grids
    assert launches == [("attend_partial", (2 * 2, 1)), ("attend_reduce", (2 * 12, 1))] * 4


# Flash's decode head (512 dims, the last 64 turned), 72 dims (8 turned; lanes past D idle in the shuffle's SIMD
# group), every dim turned (D = n_rot = 64), and half of 256; each also with the keys in two arrays
@pytest.mark.parametrize("T,H,D,N,n_rot", [(1, 64, 512, 1200, 64), (3, 5, 72, 40, 8), (2, 3, 64, 37, 64),
                                           (2, 4, 256, 300, 128)])
@pytest.mark.parametrize("inverse", [True, False])
def test_split_key_attention_turned_by_rope_in_its_merge(gpu, T, H, D, N, n_rot, inverse):
    """attend(..., rope=(cos, sin, inverse)) (attend_reduce_rope) gives attend then rope, bit for bit."""
    name, kernels, to_dev, to_host = gpu
    small_on_the_emulator(name, T * H * N)
    rng = np.random.default_rng(T * N + n_rot)
    q, keys = rng.standard_normal((T, H, D)).astype(np.float32), rng.standard_normal((N, D)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    visible = rng.random((T, N)) < 0.6
    angles = rng.uniform(0, 2 * np.pi, (T, n_rot // 2))
    cos, sin = (to_dev(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
    args = [to_dev(a) for a in (q, keys, visible, sinks)]
    want = to_host(kernels.rope(kernels.attend(*args, D ** -0.5), cos, sin, inverse))
    got = to_host(kernels.attend(*args, D ** -0.5, rope=(cos, sin, inverse)))
    assert np.array_equal(got, want)
    n1 = N // 3  # the keys in two arrays, as a decode step's raw window and compressed rows
    tail = (to_dev(keys[n1:]), to_dev(visible[:, n1:]))
    split = kernels.attend(args[0], to_dev(keys[:n1]), to_dev(visible[:, :n1]), args[3], D ** -0.5, tail,
                           rope=(cos, sin, inverse))
    assert np.array_equal(to_host(split), want)


def check_split_key_attention(kernels, to_dev, to_host, T, H, D, N):
    rng = np.random.default_rng(T * N)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    keys = rng.standard_normal((N, D)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    visible = rng.random((T, N)) < 0.6
    visible[0] = False  # a query that sees nothing but the sink
    if T > 1:  # a run of visible keys, then none (the raw window, then compressed rows not yet written)
        visible[1, : min(N, 300)] = True
        visible[1, 300:] = False
    scale = D ** -0.5
    f64 = [a.astype(np.float64) for a in (q, keys, sinks)]
    want = attend(np, f64[0], f64[1], visible, f64[2], scale)
    got = to_host(kernels.attend(to_dev(q), to_dev(keys), to_dev(visible), to_dev(sinks), scale))
    assert np.abs(got[0]).max() == 0.0  # the sink carries no value
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    # The keys in two arrays (a decode step's raw window, then its compressed rows): the same sums, bit for bit.
    for n1 in {1, N // 3, N - 1} - {0, N}:
        tail = (to_dev(keys[n1:]), to_dev(visible[:, n1:]))
        split = to_host(kernels.attend(to_dev(q), to_dev(keys[:n1]), to_dev(visible[:, :n1]), to_dev(sinks), scale,
                                       tail))
        assert np.array_equal(split, got), n1


def chunk_mask(kind: str, T: int, N: int, rng) -> np.ndarray:
    """Visibility for the chunk kernel: a causal band (raw keys of a prefill), a band then compressed rows
    visible by position (the model's layout), or random; every kind has a query that sees nothing."""
    t, n = np.arange(T)[:, None], np.arange(N)[None, :]
    if kind == "band":
        visible = (n <= t + N - T) & (n > t + N - T - 16)
    elif kind == "band+rows":
        n_raw = N // 3
        visible = np.where(n < n_raw, (n <= t + 3) & (n > t - 5), n - n_raw < (t + 1) * 2)
    else:
        visible = rng.random((T, N)) < 0.3
    visible[T // 2] = False  # only the sink
    return visible


@pytest.mark.parametrize("T,H,D,N,kind", [(5, 3, 64, 37, "random"), (5, 3, 64, 37, "band"),
                                          (7, 17, 32, 45, "band+rows"), (3, 2, 96, 130, "random"),
                                          (4, 5, 50, 270, "random"),
                                          (2, 4, 512, 300, "band+rows"), (40, 64, 512, 1200, "band+rows"),
                                          (300, 64, 512, 4200, "random")])
def test_attend_chunk_matches_float64(gpu, T, H, D, N, kind):
    name, kernels, to_dev, to_host = gpu
    small_on_the_emulator(name, T * H * N)
    rng = np.random.default_rng(T * N)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    keys = rng.standard_normal((N, D)).astype(np.float32)
    sinks = (2 * rng.standard_normal(H)).astype(np.float32)
    visible = chunk_mask(kind, T, N, rng)
    scale = D ** -0.5
    f64 = [a.astype(np.float64) for a in (q, keys, sinks)]
    want = attend(np, f64[0], f64[1], visible, f64[2], scale)
    got = to_host(kernels.attend_chunk(to_dev(q), to_dev(keys), to_dev(visible), to_dev(sinks), scale))
    assert got.shape == want.shape
    assert np.abs(got[T // 2]).max() == 0.0  # the sink carries no value
    # float32 dots of D terms and sums of up to N weights on the matrix units, whose 3xTF32 operands carry 22
    # of float32's 24 significant bits, against float64: ≤ 2e-5 of each row's largest value (the H200 showed
    # 1.7e-5 at N = 4200, where the weighted sums of ~1300 random rows cancel to a tenth of their terms)
    err = np.abs(got - want).max(axis=-1) / np.maximum(np.abs(want).max(axis=-1), 1e-30)
    assert err.max() <= 2e-5, err.max()


@pytest.mark.parametrize("operands", ["tf32", "f16"])
@pytest.mark.parametrize("T,H,D,N,kind", [(7, 17, 32, 45, "band+rows"), (5, 3, 50, 37, "random"),
                                          (40, 64, 512, 1200, "band+rows")])
def test_attend_chunk_reduced_stays_near_float64(gpu, monkeypatch, T, H, D, N, kind, operands):
    """attend_chunk_tf32 / _f16 (chunk_operands "tf32" / "f16"): scores and weighted sums on operands rounded to
    TF32 (q and keys) or half (q, keys and p; 16 keys a tile, so tiles of 1-16 keys and several tiles occur),
    within 3e-3 of each row's largest value of float64's, and farther than the float32 kernel's 1e-5: the
    rounding is seen."""
    name, kernels, to_dev, to_host = gpu
    small_on_the_emulator(name, T * H * N)
    monkeypatch.setattr(kernels, "chunk_operands", operands)
    rng = np.random.default_rng(T * N)
    q, keys = rng.standard_normal((T, H, D)).astype(np.float32), rng.standard_normal((N, D)).astype(np.float32)
    sinks = (2 * rng.standard_normal(H)).astype(np.float32)
    visible = chunk_mask(kind, T, N, rng)
    want = attend(np, q.astype(np.float64), keys.astype(np.float64), visible, sinks.astype(np.float64),
                             D ** -0.5)
    got = to_host(kernels.attend_chunk(to_dev(q), to_dev(keys), to_dev(visible), to_dev(sinks), D ** -0.5))
    err = np.abs(got - want).max(axis=-1) / np.maximum(np.abs(want).max(axis=-1), 1e-30)
    assert 1e-5 < err.max() <= 3e-3, err.max()


@pytest.mark.gpu
def test_mlx_ops_the_engine_uses_agree_with_numpy_at_long_axes():
    """A trap seen on MLX-CUDA: take_along_axis returned wrong rows once the axis reached 8192."""
    found, why = _mlx_kernels()
    if found is None:
        pytest.skip(f"mlx: {why}")
    import mlx.core as mx

    rng = np.random.default_rng(0)
    for n in (8191, 8192, 8193, 40000):
        a = rng.standard_normal((3, n)).astype(np.float32)
        idx = rng.integers(0, n, (3, 6)).astype(np.int32)
        rows = rng.integers(0, n, 17)
        x = mx.array(a)
        assert np.array_equal(np.array(mx.take_along_axis(x, mx.array(idx), axis=-1)), np.take_along_axis(a, idx, -1))
        assert np.array_equal(np.array(x[:, mx.array(rows)]), a[:, rows])
        assert np.array_equal(np.array(mx.sort(x, axis=-1)), np.sort(a, axis=-1))
        np.testing.assert_allclose(np.array(mx.cumsum(x, axis=-1)), np.cumsum(a, axis=-1, dtype=np.float64),
                                   rtol=0, atol=1e-3)
        assert np.array_equal(np.array(mx.where(x > 0, x, -x)), np.abs(a))


@pytest.mark.gpu
def test_mlx_float32_matmul_keeps_float32_precision():
    """ds4lab sets MLX_ENABLE_TF32=0 (unless the user chose): MLX's CUDA back-end otherwise runs float32
    GEMMs at TF32 precision (3.4e-4 relative error measured on the H200)."""
    found, why = _mlx_kernels()
    if found is None:
        pytest.skip(f"mlx: {why}")
    import mlx.core as mx

    from ds4lab.backends.mlx_backend import MLXBackend

    MLXBackend("gpu", kernels=False)  # making the backend sets the default before the first GEMM

    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 4096)).astype(np.float32)
    b = rng.standard_normal((4096, 1024)).astype(np.float32)
    ref = a.astype(np.float64) @ b
    got = np.array(mx.matmul(mx.array(a), mx.array(b)))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


# -- whole models ---------------------------------------------------------------------------------------
def _gpu_model_or_skip(path, backend, numerics, kernels, prefill_matmul="float32", decode_matmul="float32"):
    found, why = GPU_BACKENDS[backend]()
    if found is None:
        pytest.skip(f"{backend}: {why}")
    if backend.endswith("emulated"):
        return emulated_model(path, numerics, kernels, prefill_matmul, mlx_kernels=found[0] if backend == "mlx-emulated"
                              else None, decode_matmul=decode_matmul)
    return ds4lab.load(path, backend=backend, numerics=numerics, device=None if backend == "cupy" else "gpu",
                       kernels=kernels, prefill_matmul=prefill_matmul, decode_matmul=decode_matmul)


def whole_steps(model, monkeypatch) -> None:
    """Decode steps as the GPU backends run them, each one call of every layer (``Runtime.whole_step``: the halves
    chained, each starting the next one's mixer), where the backend compiles nothing (the CPU emulator's): the call
    run as it is."""
    rt, backend = model.runtime, model.backend
    if rt.whole(1):
        return
    for name, value in (("compiled_rows", 16), ("compiles_ffn", True)):
        if not hasattr(backend, name):
            monkeypatch.setattr(backend, name, value, raising=False)
    monkeypatch.setattr(backend, "compile",
                        lambda fn, carry=None, family=None: lambda *a, live=None, written=None: fn(*a), raising=False)
    rt.compile = True
    assert rt.whole(1)


def rel_err(a, b):
    return np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)


MODEL_BACKENDS = [pytest.param("cupy", marks=pytest.mark.gpu), pytest.param("mlx", marks=pytest.mark.gpu),
                  "emulated", "mlx-emulated"]


@pytest.mark.parametrize("backend", MODEL_BACKENDS)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "plain"])
@pytest.mark.parametrize("name", ["nano", "q4k", "mixed"])
def test_gpu_prefill_and_decode_agree_with_float64(model_paths, backend, kernels, name, monkeypatch):
    """Exact numerics; a 96-token prefill in chunks of 32 (dense products: dequantize + GEMM; routed
    experts: qgemm; chunk attention through attend_chunk), then 12 decode steps (products from the blocks,
    gathered experts, the split-key attention kernel). The CPU emulator runs 72 tokens in chunks of 24 and 3
    decode steps (the indexer selects from token 67): the same paths (whole decode steps there too), fewer
    launches."""
    monkeypatch.setattr(ops, "ATTN_CHUNK_KERNEL", True)  # the default, pinned: this test covers attend_chunk
    emulated = backend.endswith("emulated")
    n_prefill, n_decode, chunk = (72, 3, 24) if emulated else (96, 12, 32)
    ref = ds4lab.load(model_paths[name], backend="numpy", numerics="exact")
    gpu = _gpu_model_or_skip(model_paths[name], backend, "exact", kernels)
    if kernels:  # a chunk's routed experts: every (token, expert) pair in one qgemm per projection
        qgemm_calls = []
        qgemm = gpu.backend.kernels.qgemm

        def counted(x, raw, qtype, ne0, n_rows, experts=None, repeat=1):
            qgemm_calls.append((x.shape[0] * repeat, n_rows))  # pairs: a token's row serves its k experts
            return qgemm(x, raw, qtype, ne0, n_rows, experts, repeat)

        monkeypatch.setattr(gpu.backend.kernels, "qgemm", counted)
        whole_steps(gpu, monkeypatch)  # the decode steps as GPUs run them: each half starting the next one's mixer
    ids = np.random.default_rng(5).integers(0, ref.config.n_vocab - 7, n_prefill + n_decode)
    logits = {}
    for m in (ref, gpu):
        sess = m.session(ctx=256, prefill_chunk=chunk)
        sess.prefill(ids[:n_prefill]).run(progress=False)
        steps = [sess.logits]
        for end in range(n_prefill + 1, len(ids) + 1):
            assert sess.sync(ids[:end]).source == "live"  # one decode-sized step per token
            steps.append(sess.logits)
        logits[m.backend.name] = np.stack(steps)
    err = rel_err(logits[gpu.backend.name], logits["numpy"])
    assert err.max() < 1e-3, err
    if kernels:
        assert (chunk * ref.config.n_expert_used, ref.config.ff_exp) in qgemm_calls  # the gate or up projection
    assert np.array_equal(logits[gpu.backend.name].argmax(-1), logits["numpy"].argmax(-1))


def prefill_then_decode(models) -> list:
    """Each model's logits after a 72-token prefill in chunks of 24 and after each of 3 decode steps then (the same
    random tokens for all)."""
    ids = np.random.default_rng(9).integers(0, models[0].config.n_vocab - 7, 75)
    logits = []
    for model in models:
        sess = model.session(ctx=256, prefill_chunk=24)
        sess.prefill(ids[:72]).run(progress=False)
        steps = [sess.logits]
        for end in range(73, 76):
            sess.sync(ids[:end])
            steps.append(sess.logits)
        logits.append(np.stack(steps))
    return logits


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.gpu) for b in ("cupy", "mlx")]
                         + ["emulated", "mlx-emulated"])
def test_decode_steps_add_the_products_splits_where_they_read_them(tmp_path, monkeypatch, backend):
    """A model whose router, routed gate and up (K = n_embd = 512), attn_output_b (K = 2 x 256) and HC mixers split
    K (QMATMUL_MIN_SPLIT 256): its logits after a prefill and 3 decode steps are bit for bit those of the same model
    with every product's parts added before they are read (Ops.split_sums giving the product), and each decode step
    launches six qmatmul_reduce a layer fewer (the router's parts, which hc_pre_then starts on the FFN's input, the
    routed gate and up, attn_output_b, and q_a's and kv_a's columns of their stacked product, which rmsnorm_parts and
    rmsnorm_rope_parts read as they are: Ops.split_sums gives Columns, each added apart here). The HC mixers come as
    parts over E (no product launch to reduce): in whole steps (whole_steps) each started by the hc_post before it
    (hc_post_mix) but the first layer's (hc_mix_parts); layer by layer each made by its hc_pre (hc_mix_parts), with
    the same bits. No pair_sum runs: hc_post adds a token's routed-expert rows."""
    from ds4lab.config import NANO, replace
    from ds4lab.testing import make_model

    monkeypatch.setattr(S, "QMATMUL_MIN_SPLIT", 256)
    cfg = replace(NANO, n_layer=2, n_hash_layer=1, n_embd=512, o_lora=256)
    L = cfg.n_layer
    path = make_model(cfg, tmp_path / "wide.gguf", seed=5)
    ids = np.random.default_rng(9).integers(0, cfg.n_vocab - 7, 75)
    logits, reduces, launched, hc = [], [], [], []
    split_sums = ops.Ops.split_sums

    def reduced_first(self, proj, *args):  # the parts (a product's splits, or started by a kernel) added first
        out = split_sums(self, proj, *args)
        if isinstance(out, list):  # a stacked product's tensors: Columns of its splits for a decode step's rows
            return [self.kernels.add_splits(c.parts)[:, c.lo:c.hi] if isinstance(c, Columns) else c for c in out]
        return self.kernels.add_splits(out) if self.kernels is not None and out.ndim == 3 else out

    for variant in ("split", "reduced", "layer by layer"):
        if variant == "reduced":
            monkeypatch.setattr(ops.Ops, "split_sums", reduced_first)
        # a model each: its own runtime, so no step replays the CUDA graph the other variant captured
        model = _gpu_model_or_skip(path, backend, "ds4", True)
        if variant == "layer by layer":
            model.runtime.whole_step = False
        else:
            whole_steps(model, monkeypatch)
        launches = recorded_launches(model.backend.kernels, monkeypatch)
        sess = model.session(ctx=256, prefill_chunk=24)
        sess.prefill(ids[:72]).run(progress=False)  # chunks of 24: qgemm and the GEMMs, no splits
        steps, n_reduce, n_launched, n_hc = [sess.logits], 0, 0, Counter()
        for end in range(73, 76):
            launches.clear()
            sess.sync(ids[:end])
            steps.append(sess.logits)
            # a step replaying a CUDA graph (CuPy) or a compiled call (MLX) launches nothing of its own; one run
            # eagerly, captured or traced does
            n_reduce += sum(name == "qmatmul_reduce" for name, _ in launches)
            n_launched += bool(launches)
            n_hc.update(name for name, _ in launches if name.startswith(("hc_post", "hc_mix")) or name == "hc_pre_then")
            assert "pair_sum" not in {name for name, _ in launches}
        logits.append(np.stack(steps))
        reduces.append(n_reduce)
        launched.append(n_launched)
        hc.append(n_hc)
    np.testing.assert_array_equal(logits[0], logits[1])
    np.testing.assert_array_equal(logits[2], logits[0])
    # the counts below are per step that launched (eagerly or captured); layer by layer on CuPy one step more launches
    # something, though not the halves' hc kernels (their counts below are per `steps`): 2, 2, 3 of 3 on the H200
    steps = launched[0]
    assert steps > 0 and launched[1] == steps and launched[2] >= steps
    assert reduces[1] - reduces[0] == steps * L * 6
    # the last layer's FFN starts no mixer (the head's is plain ops)
    assert hc[0] == hc[1] == {"hc_post_mix": steps * (2 * L - 1), "hc_post": steps, "hc_mix_parts": steps,
                              "hc_pre_then": steps * L}
    assert hc[2] == {"hc_post": steps * 2 * L, "hc_mix_parts": steps * 2 * L, "hc_pre_then": steps * L}


# every tiny configuration on the GPU; the CPU emulator (slow) runs nano
REDUCED_CASES = [pytest.param("cupy", name, marks=pytest.mark.gpu) for name in CONFIGS] + [("emulated", "nano")]


@pytest.mark.parametrize("prefill_matmul", ("tf32", "f16"))
@pytest.mark.parametrize("backend,name", REDUCED_CASES)
def test_reduced_prefill_stays_near_float64(model_paths, backend, name, prefill_matmul):
    """prefill_matmul="tf32" and "f16": a 72-token prefill in chunks of 24 (its linears and routed experts on
    TF32 or half operands) then 3 decode steps (float32). Logits stay within 2e-3 of float64's scale with the
    same argmax, and farther than the float32 kernels' 1e-5, so the chunks' products did change precision."""
    m = _gpu_model_or_skip(model_paths[name], backend, "exact", True, prefill_matmul=prefill_matmul)
    logits = prefill_then_decode((ds4lab.load(model_paths[name], backend="numpy", numerics="exact"), m))
    err = rel_err(logits[1], logits[0])
    assert err.max() < 2e-3 and err[0] > 1e-5, err
    assert np.array_equal(logits[1].argmax(-1), logits[0].argmax(-1))


Q8_MODEL_CASES = [*(pytest.param("cupy", name, marks=pytest.mark.gpu) for name in ("nano", "narrow")),
                  ("emulated", "nano")]


@pytest.mark.parametrize("backend,name", Q8_MODEL_CASES)
def test_quantized_decode_stays_near_float64(model_paths, backend, name):
    """decode_matmul="q8" (ds4's decode arithmetic: x quantized to int8 per block in the Q8_0, IQ2_XXS and Q2_K
    products): a 72-token prefill in chunks of 24 (float32 chunk products; its last token's head product is
    decode-sized) then 3 decode steps. Logits within 3e-2 of float64's scale with the same argmax (on these tiny
    random models; "mixed" and "q4k" are left out: one flips a routing choice within 3 steps, the other has no
    such weights), and the decode steps farther than 1e-4, so their products did quantize (narrow's head is F16:
    its prefill logits stay float32's)."""
    m = _gpu_model_or_skip(model_paths[name], backend, "exact", True, decode_matmul="q8")
    logits = prefill_then_decode((ds4lab.load(model_paths[name], backend="numpy", numerics="exact"), m))
    err = rel_err(logits[1], logits[0])
    assert err.max() < 3e-2 and err[1:].min() > 1e-4, err
    assert np.array_equal(logits[1].argmax(-1), logits[0].argmax(-1))


def test_decode_matmul_is_checked():
    with pytest.raises(ValueError, match="unknown decode_matmul 'q4'"):
        ds4lab.load(backend="numpy", decode_matmul="q4")
    with pytest.raises(ValueError, match="decode_matmul='q8' needs the cupy backend with its kernels"):
        ds4lab.load(backend="numpy", decode_matmul="q8")


@pytest.mark.gpu
def test_prefill_matmul_auto_is_f16_on_cupy_with_kernels(model_paths):
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    assert ds4lab.load(model_paths["nano"], backend="cupy").backend.chunk_operands == "f16"
    float32 = ds4lab.load(model_paths["nano"], backend="cupy", prefill_matmul="float32")
    assert float32.backend.chunk_operands == "float32"
    assert ds4lab.load(model_paths["nano"], backend="cupy", kernels=False).backend.chunk_operands == "float32"


def test_prefill_matmul_is_checked():
    assert ds4lab.load(backend="numpy", prefill_matmul="auto").backend.name == "numpy"  # auto: float32 off cupy
    with pytest.raises(ValueError, match="unknown prefill_matmul 'bf16'"):
        ds4lab.load(backend="numpy", prefill_matmul="bf16")
    with pytest.raises(ValueError, match="needs the cupy backend with its kernels"):
        ds4lab.load(backend="numpy", prefill_matmul="tf32")
    with pytest.raises(ValueError, match="backend='cupy', kernels=False"):
        ds4lab.load(backend="cupy", kernels=False, prefill_matmul="tf32")


def test_configs_cover_the_kernel_types():
    used = {kw["dense_type"] for _, kw in CONFIGS.values()}
    for _, kw in CONFIGS.values():
        pairs = kw["expert_types"]
        used |= set(pairs) if isinstance(pairs[0], str) else {t for pair in pairs for t in pair}
    assert {Q(t).name for t in KERNEL_TYPES} <= used


# -- the fused elementwise kernels ------------------------------------------------------------------------
# x_in spread over 16 groups (4096), 4 with a short last span (1000), one group (64 tokens: 300)
@pytest.mark.parametrize("T,n,E", [(1, 4, 4096), (5, 4, 256), (3, 2, 96), (2, 3, 130), (2, 4, 1000), (64, 4, 300)])
def test_hc_pre_kernel_matches_float64(gpu, T, n, E):
    from ds4lab.model.hc import hc_mix

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(T * n)
    mix = rng.standard_normal((T, 2 * n + n * n)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    base = (0.5 * rng.standard_normal(2 * n + n * n)).astype(np.float32)
    X = (3.0 * rng.standard_normal((T, n, E))).astype(np.float32)  # an RMS far from 1, so a missed division shows
    # mix is the linear's output on the flat state itself: the kernel divides it by that state's RMS
    X64 = X.astype(np.float64)
    rms = np.sqrt((X64.reshape(T, n * E) ** 2).mean(axis=1, keepdims=True) + 1e-6)
    want = hc_mix(np, mix / rms, scale.astype(np.float64), base.astype(np.float64), X64, iters=20, eps=1e-6)
    got = kernels.hc_pre(*(to_dev(a) for a in (mix, scale, base, X)), 20, 1e-6, 1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_host(g), w, rtol=0, atol=2e-6 * max(1.0, np.abs(w).max()))


@pytest.mark.parametrize("T,n,E", [(1, 4, 4096), (5, 4, 256), (2, 3, 130), (64, 4, 300)])
def test_hc_pre_kernel_adds_splits_and_normalises_as_rmsnorm(gpu, T, n, E):
    """The linear's output as three K splits gives the same bits as their sum made first (qmatmul_reduce's order);
    with a norm, x_in comes out as rmsnorm(x_in)·w: the same bits as hc_pre then the rmsnorm kernel where hc_pre
    alone sums X's squares on as many threads (64 tokens, or the emulator: ROW_GROUP), else within float32
    rounding of X's RMS (a few tokens: hc_pre alone on ROW_GROUP threads, with the norm on wide groups); post and
    comb likewise."""
    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(T + E)
    parts = rng.standard_normal((3, T, 2 * n + n * n)).astype(np.float32)
    mix = (parts[0] + parts[1]) + parts[2]
    scale = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    base = (0.5 * rng.standard_normal(2 * n + n * n)).astype(np.float32)
    X = (3.0 * rng.standard_normal((T, n, E))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, E).astype(np.float32)
    args = [to_dev(a) for a in (scale, base, X)]
    plain = [to_host(a) for a in kernels.hc_pre(to_dev(mix), *args, 20, 1e-6, 1e-6)]
    split = [to_host(a) for a in kernels.hc_pre(to_dev(parts), *args, 20, 1e-6, 1e-6)]
    assert all(np.array_equal(a, b) for a, b in zip(split, plain))
    normed = [to_host(a) for a in kernels.hc_pre(to_dev(parts), *args, 20, 1e-6, 1e-6, (to_dev(w), 1e-5))]
    want = [to_host(kernels.rmsnorm(to_dev(plain[0]), 1e-5, to_dev(w))), plain[1], plain[2]]
    if T >= S.RMSNORM_WIDE_ROWS or kernels.wide_group == S.ROW_GROUP:
        assert all(np.array_equal(a, b) for a, b in zip(normed, want))
    for a, b in zip(normed, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # its two parts launched apart (the mixer's matrix beside the sublayer: Ops.hc_pre) give the whole launch's bits
    for norm, whole in ((None, split), ((to_dev(w), 1e-5), normed)):
        _, post, comb = (to_host(a) for a in kernels.hc_pre(to_dev(parts), *args, 20, 1e-6, 1e-6, norm, part="mixer"))
        x_in = to_host(kernels.hc_pre(to_dev(parts), *args, 20, 1e-6, 1e-6, norm, part="input")[0])
        assert [np.array_equal(a, b) for a, b in zip((x_in, post, comb), whole)] == [True] * 3


@pytest.mark.parametrize("T,n,E", [(1, 4, 4096), (5, 4, 256), (3, 2, 96), (2, 3, 130), (2, 5, 64), (3, 1, 40)])
def test_hc_post_kernel_matches_float64(gpu, T, n, E):
    from ds4lab.model.hc import hc_post

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(T + n)
    y = rng.standard_normal((T, E)).astype(np.float32)
    X = rng.standard_normal((T, n, E)).astype(np.float32)
    post = rng.uniform(0, 2, (T, n)).astype(np.float32)
    comb = rng.uniform(0, 1, (T, n, n)).astype(np.float32)
    want = hc_post(np, *(a.astype(np.float64) for a in (y, X, post, comb)))
    got = to_host(kernels.hc_post(*(to_dev(a) for a in (y, X, post, comb))))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("T,n,E,pairs", [(1, 4, 4096, 6), (3, 4, 300, 1), (2, 3, 130, 2), (16, 5, 64, 1),
                                         (1, 1, 4088, 1)])
def test_hc_post_mix_starts_the_next_mixer(gpu, T, n, E, pairs):
    """hc_post_mix writes hc_post's streams to the bit, and in parts over E the next mixer's product of them (an F16
    [2n + n², n·E] matrix) and their Gram matrix, each within float32 summation of float64's (2e-6 of the sum of the
    terms' magnitudes: an element left out is about 1 / (n·E) of it, 6e-5 here at least), hc_mix_parts the same parts
    of the streams as they are, to the bit; hc_pre given those parts finishes
    the mixer as from the product summed in float64, and with the sublayer's norm gives rmsnorm(x_in)·w (its sum of
    squares from the Gram matrix) within float32 rounding of float64's; hc_pre_then starts an F16 linear's product
    of that x_in, in parts, within float32 summation of its float64 product."""
    from ds4lab.model.functional import rmsnorm
    from ds4lab.model.hc import hc_mix

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(T * E + pairs)
    M = 2 * n + n * n
    y = rng.standard_normal((T * pairs, E)).astype(np.float32)
    X = (3.0 * rng.standard_normal((T, n, E))).astype(np.float32)
    post = rng.uniform(0, 2, (T, n)).astype(np.float32)
    comb = rng.uniform(0, 1, (T, n, n)).astype(np.float32)
    extra = rng.standard_normal((T, E)).astype(np.float32)
    fn = (0.05 * rng.standard_normal((M, n * E))).astype(np.float16)
    args = [to_dev(a) for a in (y, X, post, comb)]
    plain = to_host(kernels.hc_post(*args, pairs, to_dev(extra)))
    X_new, mix, gram = kernels.hc_post_mix(*args, pairs, to_dev(extra), to_dev(fn.view(np.uint8)))
    assert np.array_equal(to_host(X_new), plain)
    G = -(-E // S.ROW_GROUP)
    mix, gram = to_host(mix), to_host(gram)
    assert mix.shape == (G, T, M) and gram.shape == (G, T, n * (n + 1) // 2)
    # the parts of streams no hc_post started: the same bits
    again = kernels.hc_mix_parts(X_new, to_dev(fn.view(np.uint8)))
    assert [np.array_equal(to_host(a), b) for a, b in zip(again, (mix, gram))] == [True, True]
    flat = plain.astype(np.float64).reshape(T, n * E)
    w = fn.astype(np.float64)
    bound = 2e-6 * (np.abs(flat) @ np.abs(w).T)
    np.testing.assert_array_less(np.abs(mix.astype(np.float64).sum(axis=0) - flat @ w.T), bound)
    streams = flat.reshape(T, n, E)
    upper = np.triu_indices(n)
    want_gram = np.einsum("tod,tpd->top", streams, streams)[:, upper[0], upper[1]]
    bound = 2e-6 * np.einsum("tod,tpd->top", np.abs(streams), np.abs(streams))[:, upper[0], upper[1]]
    np.testing.assert_array_less(np.abs(gram.astype(np.float64).sum(axis=0) - want_gram), bound)
    scale = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    base = (0.5 * rng.standard_normal(M)).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, E).astype(np.float32)
    rms = np.sqrt((flat ** 2).mean(axis=1, keepdims=True) + 1e-6)
    want = hc_mix(np, flat @ w.T / rms, scale.astype(np.float64), base.astype(np.float64), streams, iters=20, eps=1e-6)
    mixed = [to_dev(a) for a in (mix, scale, base)]
    got = kernels.hc_pre(*mixed, X_new, 20, 1e-6, 1e-6, gram=to_dev(gram))
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_host(g), w, rtol=0, atol=2e-6 * max(1.0, np.abs(w).max()))
    normed = kernels.hc_pre(*mixed, X_new, 20, 1e-6, 1e-6, (to_dev(norm_w), 1e-5), gram=to_dev(gram))
    want_in = rmsnorm(np, want[0], 1e-5, norm_w.astype(np.float64))
    np.testing.assert_allclose(to_host(normed[0]), want_in, rtol=0, atol=2e-6 * np.abs(want_in).max())
    # its two parts launched apart give the whole launch's bits, as without the Gram matrix
    parts = [kernels.hc_pre(*mixed, X_new, 20, 1e-6, 1e-6, (to_dev(norm_w), 1e-5), part=p, gram=to_dev(gram))
             for p in ("mixer", "input")]
    apart = (parts[1][0], parts[0][1], parts[0][2])
    assert [np.array_equal(to_host(a), to_host(b)) for a, b in zip(apart, normed)] == [True] * 3
    # hc_pre_then: x_in's groups start the sublayer's first F16 linear (the router) on it, in parts over E's spans;
    # 300 rows: each span's HC_THEN_SPLIT groups take theirs, HC_THEN_ROWS a SIMD group, and the first groups a
    # second round
    router = (0.1 * rng.standard_normal((300, E))).astype(np.float16)
    then = [kernels.hc_pre(*mixed, X_new, 20, 1e-6, 1e-6, (to_dev(norm_w), 1e-5), part=p, gram=to_dev(gram),
                           then=to_dev(router.view(np.uint8))) for p in ("input", None)]
    *same, started = then[0]
    assert np.array_equal(to_host(same[0]), to_host(normed[0]))
    assert np.array_equal(to_host(then[1][0]), to_host(normed[0])) and np.array_equal(to_host(then[1][3]),
                                                                                       to_host(started))
    started, x_in = to_host(started).astype(np.float64), to_host(normed[0]).astype(np.float64)
    r64 = router.astype(np.float64)
    assert started.shape == (G, T, 300)
    np.testing.assert_array_less(np.abs(started.sum(axis=0) - x_in @ r64.T), 2e-6 * (np.abs(x_in) @ np.abs(r64).T))


def test_a_started_product_is_taken_only_for_the_input_that_started_it(monkeypatch):
    """Ops.hc_post given the next mixer starts it (hc_post_mix), and the hc_pre of the streams it wrote, with that
    mixer, launches no product of its own; streams equal in value but another array (a hook's replacement, a tier's
    copy), or another mixer, get their own (hc_mix_parts). Likewise the router started by hc_pre (hc_pre_then) is
    taken by split_sums of that router and that x_in only, and once."""
    from ds4lab.backends.emulated_backend import EmulatedBackend

    backend = EmulatedBackend()
    o = ops.Ops(backend)
    rng = np.random.default_rng(3)
    T, n, E, M = 1, 4, 256, 24

    def f16_linear(rows, ne0):
        return backend.linear((0.05 * rng.standard_normal((rows, ne0))).astype(np.float16).view(np.uint8), Q.F16, ne0)

    fn, other_fn, router = f16_linear(M, n * E), f16_linear(M, n * E), f16_linear(8, E)
    y, X = rng.standard_normal((T, E)).astype(np.float32), rng.standard_normal((T, n, E)).astype(np.float32)
    post, comb = rng.uniform(0, 2, (T, n)).astype(np.float32), rng.uniform(0, 1, (T, n, n)).astype(np.float32)
    scale, base = np.ones(3, np.float32), np.zeros(M, np.float32)
    norm = rng.uniform(0.5, 1.5, E).astype(np.float32)
    launches = recorded_launches(backend.kernels, monkeypatch)

    def products(run):
        launches.clear()
        out = run()
        return out, sum(name.startswith(("qmatmul", "hc_mix_parts")) for name, _ in launches)

    def pre(streams, mixer, then=None):
        return o.hc_pre(streams, mixer, scale, base, 20, 1e-6, 1e-6, norm, then=then)

    X_new = o.hc_post(y, X, post, comb, then=fn)
    (x_in, *_), made = products(lambda: pre(X_new, fn, router))
    assert made == 0 and "hc_pre_then" in {name for name, _ in launches}
    assert products(lambda: o.split_sums(router, x_in.copy()))[1] == 1  # another array: its own product
    parts, made = products(lambda: o.split_sums(router, x_in))
    assert made == 0 and parts.shape == (1, T, 8)
    assert products(lambda: o.split_sums(router, x_in))[1] == 1  # taken once
    X_new = o.hc_post(y, X, post, comb, then=fn)
    assert products(lambda: pre(X_new.copy(), fn))[1] == 1
    X_new = o.hc_post(y, X, post, comb, then=fn)
    assert products(lambda: pre(X_new, other_fn))[1] == 1


@pytest.mark.parametrize("shape", [(1, 4096), (7, 1024), (3, 5, 96), (2, 16384)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rmsnorm_kernel_matches_float64(gpu, shape, weighted):
    from ds4lab.model.functional import rmsnorm

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(len(shape))
    x = (3 * rng.standard_normal(shape)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32) if weighted else None
    want = rmsnorm(np, x.astype(np.float64), 1e-6, None if w is None else w.astype(np.float64))
    got = to_host(kernels.rmsnorm(to_dev(x), 1e-6, None if w is None else to_dev(w)))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("shape,n_rot", [((3, 512), 64), ((40, 128), 64), ((2, 3, 192), 0), ((70, 512), 64),
                                         ((1, 1088), 64)])  # 1 SIMD group a row; more blocks than groups
def test_store_kv_kernel_equals_the_plain_fp8_f16_path(gpu, shape, n_rot):
    from ds4lab.model import numerics as nx

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(shape[0])
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 50, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1)[:5] = [0.0, 1e-9, -1e-5, 448.0, -0.0]  # zero, tiny (FP8 subnormals), exact codes
    want = nx.f16_round(np, nx.fp8_kv_sim(np, x, n_rot))  # the float32 plain path
    got = to_host(kernels.store_kv(to_dev(x), n_rot))
    assert np.array_equal(got, want), np.abs(got - want).max()  # power-of-two scalings: no rounding freedom


@pytest.mark.parametrize("rows,n", [(1, 128), (64, 128), (9, 32), (3, 512)])
def test_hadamard_fp4_kernel_equals_the_plain_path(gpu, rows, n):
    from ds4lab.model import numerics as nx

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.01, 20, (rows, 1))).astype(np.float32)
    want = nx.hadamard_fp4_sim(np, x)  # the float32 plain path: the same butterfly, the same sums
    got = to_host(kernels.hadamard_fp4(to_dev(x)))
    assert np.array_equal(got, want), np.abs(got - want).max()


@pytest.mark.parametrize("shape,n_rot", [((1, 64, 128), 64), ((3, 64, 128), 64), ((2, 5, 32), 16), ((70, 4, 128), 64)])
def test_hadamard_fp4_rope_kernel_equals_rope_then_hadamard_fp4(gpu, shape, n_rot):
    """The indexer's queries: RoPE then the Hadamard + FP4 step in one launch, several rows (heads) a position: the
    bits of the two kernels it replaces on the emulator; on a GPU RoPE's a·c − b·s may be one FMA in one kernel and
    not the other, and an FP4 rounding then move by one code: at most 1 in 1,000 elements, by at most a step."""
    name, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(shape[0])
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 20, shape[:-1] + (1,))).astype(np.float32)
    angle = rng.uniform(-40, 40, (shape[0], n_rot // 2))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    got = to_host(kernels.hadamard_fp4(to_dev(x), rope=(to_dev(cos), to_dev(sin))))
    want = to_host(kernels.hadamard_fp4(kernels.rope(to_dev(x), to_dev(cos), to_dev(sin))))
    if name == "emulated":
        np.testing.assert_array_equal(got, want)
    else:
        apart = got != want
        step = 2.0 * np.abs(want).max(axis=-1, keepdims=True) / 3.0  # an FP4 code's step is at most scale·2 <= max/3·2
        assert apart.mean() <= 1e-3 and (np.abs(got - want) <= step)[apart].all()


def test_hadamard_fp4_kernel_rounds_stored_rows_to_f16(gpu):
    # Rows small enough that their FP4 codes times the scale fall among f16's subnormals, and one large enough
    # to overflow f16: the f16 rounding of a stored indexer row changes them, and must match the plain path's.
    from ds4lab.model import numerics as nx

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 128)) * np.array([[3e-7], [2e-6], [1.0], [2e5]])).astype(np.float32)
    fp4 = nx.hadamard_fp4_sim(np, x)
    with np.errstate(over="ignore"):
        want = nx.f16_round(np, fp4)
    assert not np.array_equal(want, fp4)  # the rounding is seen
    got = to_host(kernels.hadamard_fp4(to_dev(x), f16=True))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ratio,C,W,pos0", [(4, 1, 16, 0), (4, 7, 32, 5), (4, 64, 256, 130), (128, 1, 8, 3),
                                            (128, 40, 16, 250), (128, 300, 64, 4097)])
def test_compress_pool_kernel_matches_float64(gpu, ratio, C, W, pos0):
    from ds4lab.model.compressor import NEG_INF, coff, pool_windows

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(C + pos0)
    rows = coff(ratio) * ratio
    state_kv = rng.standard_normal((rows, W)).astype(np.float32)
    state_sc = rng.standard_normal((rows, W)).astype(np.float32)
    state_sc[rows // 2:] = NEG_INF  # slots not written yet
    kv, sc = (rng.standard_normal((C, W)).astype(np.float32) for _ in range(2))
    want = pool_windows(np, *(a.astype(np.float64) for a in (state_kv, state_sc, kv, sc)), pos0, ratio)
    for p0 in (pos0, to_dev(np.int32(pos0))):  # a host int, or a device scalar as compiled steps pass it
        got = to_host(kernels.compress_pool(*(to_dev(a) for a in (state_kv, state_sc, kv, sc)), p0, ratio))
        assert got.shape == want.shape
        # float32 sums over up to 128 weighted candidates: worst case about 128 ulps of the largest term
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))


# The KV state's bookkeeping: pure data movement, so every kernel must equal the plain path exactly. Each
# case runs with pos0 and n_valid as host ints (eager steps) and as device int32 scalars (compiled steps).
def state_scalars(to_dev, *values):
    yield values
    yield tuple(to_dev(np.int32(v)) for v in values)


def writes_in_place(gpu) -> bool:
    """Whether ``gpu``'s launcher writes outputs into arrays it is given (NumPy's interface: CuPy, the emulator; MLX's
    kernels make new outputs)."""
    return not gpu[0].startswith("mlx")


def one_launch(gpu, monkeypatch, name: str, fn, *args):
    """``fn(*args)`` on ``gpu``'s kernels, checked to be one launch of kernel ``name``."""
    _, kernels, _, to_host = gpu
    launches = recorded_launches(kernels, monkeypatch)
    out = getattr(kernels, fn)(*args)
    assert [n for n, _ in launches] == [name]
    return [to_host(o) for o in out] if isinstance(out, tuple) else to_host(out)


# (ratio, chunk rows, width, pos0, n_valid): from position 0, inside a window, ending a window, starting
# one, crossing windows, padded chunks, 2048-row chunks (narrow).
STATE_CASES = [(4, 1, 16, 0, 1), (4, 1, 16, 3, 1), (4, 1, 16, 4, 1), (4, 1, 16, 6, 1), (4, 3, 8, 5, 3),
               (4, 3, 8, 8, 2), (4, 8, 16, 6, 5), (4, 8, 16, 8, 8), (4, 2048, 4, 100, 2048), (4, 2048, 4, 4, 1999),
               (128, 1, 8, 0, 1), (128, 1, 8, 127, 1), (128, 1, 8, 200, 1), (128, 3, 8, 126, 3), (128, 8, 8, 256, 7),
               (128, 2048, 2, 300, 2048), (128, 2048, 2, 0, 1000), (128, 2048, 2, 128, 2048),
               (4, 4096, 4, 4096, 4096), (128, 4096, 2, 8192, 4000)]  # CuPy's default chunk of 4096


@pytest.mark.parametrize("ratio,C,W,pos0,n_valid", STATE_CASES)
def test_compress_state_kernel_equals_the_plain_next_state(gpu, monkeypatch, ratio, C, W, pos0, n_valid):
    from ds4lab.model.compressor import NEG_INF, coff, next_state

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(C + pos0)
    rows, width = coff(ratio) * ratio, coff(ratio) * W
    state_kv = rng.standard_normal((rows, width)).astype(np.float32)
    state_sc = rng.standard_normal((rows, width)).astype(np.float32)
    state_sc[pos0 % ratio + (coff(ratio) - 1) * ratio:] = NEG_INF  # slots not written yet
    kv, sc = (rng.standard_normal((C, width)).astype(np.float32) for _ in range(2))
    want = next_state(np, state_kv, state_sc, kv, sc, pos0, n_valid, ratio)
    start = pos0 % ratio + (coff(ratio) - 1) * ratio
    left_kv = state_kv.copy()
    left_kv[start:] = 0.0  # the state as the chunk before leaves it: its slots from the chunk's first on cleared
    want_left = next_state(np, left_kv, state_sc, kv, sc, pos0, n_valid, ratio)
    ends_none = (pos0 + n_valid) // ratio == pos0 // ratio
    for p0, n in state_scalars(to_dev, pos0, n_valid):
        got = one_launch(gpu, monkeypatch, "compress_state", "compress_state",
                         *(to_dev(a) for a in (state_kv, state_sc, kv, sc)), p0, n, ratio)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        if writes_in_place(gpu) and ends_none:  # the state given is the output, written in the chunk's slots only
            given = to_dev(left_kv), to_dev(state_sc)
            got = one_launch(gpu, monkeypatch, "compress_state_in_place", "compress_state", *given, to_dev(kv),
                             to_dev(sc), p0, n, ratio, True)
            assert all(np.array_equal(g, w) and np.array_equal(to_host(a), w) for g, a, w in zip(got, given, want_left))
    if writes_in_place(gpu) and not ends_none:  # a chunk that ends a window moves the whole state: refused in place
        with pytest.raises(InPlaceError, match="end a window"):
            kernels.compress_state(*(to_dev(a) for a in (left_kv, state_sc, kv, sc)), pos0, n_valid, ratio, True)


@pytest.mark.parametrize("ratio,C,W,pos0", [(4, 1, 16, 0), (4, 1, 16, 7), (4, 3, 8, 2), (4, 8, 16, 6),
                                            (4, 2048, 4, 3), (128, 1, 8, 127), (128, 3, 8, 126),
                                            (128, 2048, 2, 300)])
def test_add_ape_kernel_equals_the_plain_scores(gpu, monkeypatch, ratio, C, W, pos0):
    from ds4lab.model.compressor import add_ape

    _, _, to_dev, _ = gpu
    rng = np.random.default_rng(C + pos0)
    gate = rng.standard_normal((C, W)).astype(np.float32)
    ape = rng.standard_normal((ratio, W)).astype(np.float32)
    want = add_ape(np, gate, ape, pos0)
    for (p0,) in state_scalars(to_dev, pos0):
        got = one_launch(gpu, monkeypatch, "add_ape", "add_ape", to_dev(gate), to_dev(ape), p0)
        assert np.array_equal(got, want)


def test_host_positions_are_kept_only_while_recent(gpu):
    """Eager steps pass positions as host ints: each becomes a device scalar, kept for the step's other
    launches, but not one per position of a long decode."""
    from ds4lab.mlx_kernels.launches import INTS_KEPT
    from ds4lab.model.compressor import add_ape

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(0)
    gate, ape = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    consts = len(kernels._consts)
    for pos0 in range(3 * INTS_KEPT):
        assert np.array_equal(to_host(kernels.add_ape(to_dev(gate), to_dev(ape), pos0)), add_ape(np, gate, ape, pos0))
    assert len(kernels._ints) <= INTS_KEPT and len(kernels._consts) <= consts + 1  # + the dims


@pytest.mark.parametrize("ratio,C,W,pos0,n_valid", STATE_CASES + [(4, 1, 16, 127, 1), (128, 1, 8, 4095, 1)])
def test_append_rows_kernel_equals_the_plain_append(gpu, monkeypatch, ratio, C, W, pos0, n_valid):
    """The pooled rows of a chunk's windows (see pool_shape) into a layer's rows, as new rows and in place; the last
    two cases complete the last window of the context."""
    from ds4lab.model.compressor import append_rows

    _, _, to_dev, to_host = gpu
    rng = np.random.default_rng(C + pos0)
    N = max(pos0 + C, 128) // ratio + 2  # the rows of a context holding the chunk
    rows = rng.standard_normal((N, W)).astype(np.float32)
    pooled = rng.standard_normal((S.pool_shape(ratio, C, W)[0], W)).astype(np.float32)
    want = append_rows(np, rows, pooled, pos0, n_valid, ratio)
    assert np.array_equal(want, rows) == ((pos0 + n_valid) // ratio == pos0 // ratio)  # rows were appended
    for p0, n in state_scalars(to_dev, pos0, n_valid):
        got = one_launch(gpu, monkeypatch, "append_rows", "append_rows", to_dev(rows), to_dev(pooled), p0, n, ratio)
        assert np.array_equal(got, want)
        if writes_in_place(gpu):  # the rows given are the output: the same rows, no others written
            given = to_dev(rows)
            got = one_launch(gpu, monkeypatch, "append_rows_in_place", "append_rows", given, to_dev(pooled), p0, n,
                             ratio, True)
            assert np.array_equal(got, want) and np.array_equal(to_host(given), want)


# (chunk rows, compressed rows, ratio, pos0, n_valid): a decode step before and once rows are visible, the row a
# window completes, padded chunks (their padded queries see what the last real one sees), 2048-row chunks.
@pytest.mark.parametrize("C,N,ratio,pos0,n_valid", [
    (1, 8, 4, 0, 1), (1, 8, 4, 3, 1), (1, 8, 4, 13, 1), (1, 4, 128, 127, 1), (1, 4, 128, 300, 1), (8, 16, 4, 5, 3),
    (8, 16, 4, 0, 8), (3, 2, 128, 126, 2), (2048, 520, 4, 0, 2048), (2048, 40, 128, 3000, 1700)])
def test_compressed_visible_kernel_equals_the_plain_mask(gpu, monkeypatch, C, N, ratio, pos0, n_valid):
    from ds4lab.model.attention import compressed_visible

    _, _, to_dev, _ = gpu
    want = compressed_visible(np, pos0, n_valid, C, N, ratio)
    assert want[1].any() == (pos0 + n_valid >= ratio)  # rows are visible once the first window is complete
    for p0, n in state_scalars(to_dev, pos0, n_valid):
        got = one_launch(gpu, monkeypatch, "compressed_visible", "compressed_visible", p0, n, C, N, ratio)
        assert got[0].dtype == np.int32 and got[1].dtype == np.bool_
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


# (ring slots, width, chunk rows, pos0, n_valid, window): the first token, inside the ring, wrapping around it
# (pos0 + n > raw_cap), padded, starting at a multiple of raw_cap, a chunk filling all but the window, a chunk longer
# than the ring (its later rows take the slots), 2048-row chunks (narrow) with and without padding.
@pytest.mark.parametrize("cap,D,C,pos0,n_valid,window", [
    (16, 8, 1, 0, 1, 8), (16, 8, 1, 5, 1, 8), (16, 8, 1, 31, 1, 16), (16, 8, 3, 14, 3, 8), (16, 8, 8, 12, 5, 8),
    (16, 8, 8, 32, 8, 8), (16, 8, 8, 3, 8, 8), (24, 8, 16, 50, 16, 8), (16, 8, 24, 5, 20, 8),
    (256, 16, 1, 1000, 1, 128), (2304, 4, 2048, 300, 2048, 128), (2304, 4, 2048, 2000, 1500, 128),
    (2304, 4, 2048, 0, 2048, 128)])
def test_ring_write_kernel_equals_the_plain_ring(gpu, monkeypatch, cap, D, C, pos0, n_valid, window):
    from ds4lab.model.attention import ring_write

    _, _, to_dev, to_host = gpu
    rng = np.random.default_rng(C + pos0)
    raw = rng.standard_normal((cap, D)).astype(np.float32)
    kv = rng.standard_normal((C, D)).astype(np.float32)
    want = ring_write(np, raw, kv, pos0, n_valid, window)
    for p0, n in state_scalars(to_dev, pos0, n_valid):
        got = one_launch(gpu, monkeypatch, "ring_write", "ring_write", to_dev(raw), to_dev(kv), p0, n, window)
        assert got[1].dtype == np.int32 and got[2].dtype == np.bool_
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        if writes_in_place(gpu):  # the ring given is the output, written in the chunk's slots only
            given = to_dev(raw)
            got = one_launch(gpu, monkeypatch, "ring_write_in_place", "ring_write", given, to_dev(kv), p0, n, window,
                             True)
            assert all(np.array_equal(g, w) for g, w in zip(got, want)) and np.array_equal(to_host(given), want[0])


@pytest.mark.parametrize("T,H,Dq,N", [(1, 4, 128, 1), (1, 64, 128, 1030), (3, 2, 32, 17), (16, 4, 128, 70),
                                     (2, 3, 40, 9), (1, 5, 20, 33), (2, 40, 24, 50)])
def test_indexer_scores_kernel_matches_float64(gpu, T, H, Dq, N):
    from ds4lab.model.attention import indexer_scores

    name, kernels, to_dev, to_host = gpu
    small_on_the_emulator(name, T * N * H * Dq)
    rng = np.random.default_rng(N)
    q = rng.standard_normal((T, H, Dq)).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    k = rng.standard_normal((N, Dq)).astype(np.float32)
    want = indexer_scores(np, q.astype(np.float64), w.astype(np.float64), k.astype(np.float64))
    got = to_host(kernels.indexer_scores(to_dev(q), to_dev(w), to_dev(k)))
    # float32 sums of H·Dq products: about sqrt(H·Dq) ulps of their size
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# H = 64 (Flash): one query a tile; 4, 8: several; T·H not a multiple of 64: a part-filled last tile; N: one
# column tile, several, and a part-filled one (QGEMM_BN = 128); Dq = 40: not a multiple of the 32-wide slab.
@pytest.mark.parametrize("T,H,Dq,N", [(3, 64, 128, 300), (20, 4, 128, 70), (9, 8, 40, 129), (40, 2, 64, 5)])
@pytest.mark.parametrize("operands", S.OPERANDS)
def test_indexer_chunk_kernel_matches_float64(gpu, monkeypatch, T, H, Dq, N, operands):
    """float32: within 1e-5 of the scale of float64's; tf32 and f16 (its dots on TF32 or half operands): within
    1e-5 of the same sums of rounded q and rows."""
    from ds4lab.model.attention import indexer_scores

    name, kernels, to_dev, to_host = gpu
    small_on_the_emulator(name, T * H * N)
    monkeypatch.setattr(kernels, "chunk_operands", operands)
    rng = np.random.default_rng(T + N)
    q = rng.standard_normal((T, H, Dq)).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    k = rng.standard_normal((N, Dq)).astype(np.float32)
    qr, kr = operand_round(np, q, operands), operand_round(np, k, operands)
    want = indexer_scores(np, qr.astype(np.float64), w.astype(np.float64), kr.astype(np.float64))
    got = to_host(kernels.indexer_chunk(to_dev(q), to_dev(w), to_dev(k)))
    assert got.shape == (T, N)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("Dq", [S.INDEXER_MAX_DQ + 8, 30])
def test_indexer_scores_kernel_refuses_a_head_dim_past_its_staging(gpu, Dq):
    _, kernels, to_dev, _ = gpu
    with pytest.raises(ValueError, match=f"head dim {Dq} exceeds .* or is not a multiple of 4"):
        kernels.indexer_scores(to_dev(np.zeros((1, 2, Dq), np.float32)), to_dev(np.zeros((1, 2), np.float32)),
                               to_dev(np.zeros((3, Dq), np.float32)))


def test_indexer_chunk_refuses_heads_that_split_a_tile(gpu):
    _, kernels, to_dev, _ = gpu
    with pytest.raises(ValueError, match="3 heads do not divide"):
        kernels.indexer_chunk(to_dev(np.zeros((2, 3, 8), np.float32)), to_dev(np.zeros((2, 3), np.float32)),
                              to_dev(np.zeros((4, 8), np.float32)))


# 2500 rows: past those a 256-thread group holds in registers; 9000: past a 1,024-thread group's (a decode step's).
@pytest.mark.parametrize("T,N,k,seed", [(1, 40, 16, 0), (3, 300, 32, 1), (2, 1030, 512, 2), (16, 70, 8, 3),
                                        (40, 600, 64, 4), (2, 2500, 512, 5), (1, 9000, 512, 6)])
@pytest.mark.parametrize("scores", ["ties", "distinct", "adjacent"])
def test_indexer_allowed_kernel_equals_the_plain_selection(gpu, T, N, k, seed, scores):
    from ds4lab.model.attention import indexer_allowed

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(seed)
    # ties: scores on a coarse grid, so that rows tied with the k-th (and +0/−0) are common and fill the room left
    # to right; distinct: the usual case (the kernel stops once a candidate key falls between the k-th and the
    # next); adjacent: the next score one float below the k-th, so that only the last pass's candidate does.
    score = rng.standard_normal((T, N)).astype(np.float32)
    if scores == "ties":
        score = np.round(score * 4) / 4
        score[:, ::7] = -0.0
    n_vis = rng.integers(1, N + 1, T)
    n_vis[0] = N
    if T > 1:
        n_vis[1] = min(k, N)  # exactly k visible: no selection
    visible = np.arange(N)[None, :] < n_vis[:, None]
    if scores == "adjacent":
        for t in np.flatnonzero(n_vis > k):
            order = np.argsort(-score[t, :n_vis[t]], kind="stable")
            score[t, order[k]] = np.nextafter(score[t, order[k - 1]], np.float32(-np.inf))
    want = indexer_allowed(np, score, visible, n_vis, k)
    got = to_host(kernels.indexer_allowed(to_dev(score), to_dev(visible), to_dev(n_vis.astype(np.int32)), k))
    assert got.dtype == np.bool_ and np.array_equal(got, want)
    assert (got.sum(axis=1) == np.minimum(n_vis, np.where(n_vis > k, k, n_vis))).all()


@pytest.mark.parametrize("shape,n_rot", [((3, 128), 64), ((2, 4, 128), 64), ((5, 2, 96), 32), ((1, 64, 512), 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_equals_the_plain_rotation(gpu, shape, n_rot, inverse):
    from ds4lab.model.rope import rope

    name, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(shape[0])
    x = rng.standard_normal(shape).astype(np.float32)
    angle = rng.uniform(-40, 40, (shape[0], n_rot // 2))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    want = rope(np, x, cos, sin, inverse)  # the float32 plain path: the same products and sums
    got = to_host(kernels.rope(to_dev(x), to_dev(cos), to_dev(sin), inverse))
    # a GPU may fuse a·c − b·s into one FMA: one rounding fewer
    np.testing.assert_allclose(got, want, rtol=0, atol=0 if name == "emulated" else 1e-6 * np.abs(want).max())


# q's heads (unweighted, several rows a position), a KV row and compressed rows (weighted), a row with no RoPE dims,
# decode-sized and chunk-sized row counts (the wide and the narrow groups)
@pytest.mark.parametrize("shape,n_rot,weighted", [((1, 64, 512), 64, False), ((5, 4, 96), 32, False),
                                                  ((1, 512), 64, True), ((70, 512), 64, True), ((3, 40), 0, True)])
def test_rmsnorm_rope_kernel_equals_rmsnorm_then_rope(gpu, monkeypatch, shape, n_rot, weighted):
    from ds4lab.model.functional import rmsnorm

    name, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(shape[-1])
    x = (3 * rng.standard_normal(shape)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32) if weighted else None
    angle = rng.uniform(-40, 40, (shape[0], n_rot // 2))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    wd = None if w is None else to_dev(w)
    normed, turned = one_launch(gpu, monkeypatch, "rmsnorm_rope", "rmsnorm_rope", to_dev(x), 1e-6, wd, to_dev(cos),
                                to_dev(sin))
    # the two kernels it replaces give the same floats: the same sums and products in the same order (a GPU
    # compiler may fuse RoPE's a·c − b·s into an FMA in one kernel and not the other: one rounding)
    apart = to_host(kernels.rmsnorm(to_dev(x), 1e-6, wd))
    np.testing.assert_array_equal(normed, apart)
    then_rope = to_host(kernels.rope(to_dev(apart), to_dev(cos), to_dev(sin)))
    tol = 0 if name == "emulated" else 1e-6 * np.abs(then_rope).max()
    np.testing.assert_allclose(turned, then_rope, rtol=0, atol=tol)
    want = rmsnorm(np, x.astype(np.float64), 1e-6, None if w is None else w.astype(np.float64))
    np.testing.assert_allclose(normed, want, rtol=2e-6, atol=1e-7)
    assert n_rot == 0 or not np.array_equal(turned, normed)  # the tail was turned


# -- the FFN half's kernels: SwiGLU, routing, and the device-ids plan its projections share ------------------
@pytest.mark.parametrize("P,F", [(6, 2048), (16, 2048), (1, 1), (3, 7), (5, 1031)])
@pytest.mark.parametrize("weighted", [True, False])
def test_swiglu_kernel_matches_the_plain_path(gpu, P, F, weighted):
    from ds4lab.model.moe import swiglu

    _, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(P * F)
    gate = (8 * rng.standard_normal((P, F))).astype(np.float32)  # beyond the clamp of 10 on both sides
    up = (8 * rng.standard_normal((P, F))).astype(np.float32)
    edge = [10.0, 1e4, -1e4, -100.0, 0.0, -0.0, -10.0]  # at and past the clamp; exp(−z) overflowing
    gate.reshape(-1)[:len(edge)] = edge[:gate.size]
    up.reshape(-1)[:len(edge)] = edge[::-1][:up.size]
    w = rng.uniform(0.01, 2.0, P).astype(np.float32) if weighted else None
    got = to_host(kernels.swiglu(to_dev(gate), to_dev(up), 10.0, None if w is None else to_dev(w)))
    with np.errstate(over="ignore"):
        plain = swiglu(np, gate, up, 10.0)  # the float32 plain path, then the route weight, as the model runs it
        exact = swiglu(np, gate.astype(np.float64), up.astype(np.float64), 10.0)
    if w is not None:
        plain, exact = plain * w[:, None], exact * w[:, None]
    assert got.shape == (P, F) and got.dtype == np.float32
    # The same float32 operations in the same order; only exp may differ (NumPy's and the C library's by up
    # to 2 ulps, which the reciprocal can double): within 1e-6 relative, about 8 ulps. Below 1e-30 only
    # where float32's exp(−z) overflows and float64's does not.
    np.testing.assert_allclose(got, plain, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-30)


def routed(kernels, to_dev, to_host, logits, bias, k, table=None, tokens=None):
    out = kernels.moe_route(to_dev(logits), None if bias is None else to_dev(bias), k, 1.5,
                            None if table is None else to_dev(table), None if tokens is None else to_dev(tokens))
    return tuple(to_host(a) for a in out)


def check_probs(probs, logits):
    from ds4lab.model.moe import router_probs

    # exp and log1p as NumPy's float32 and the C library compute them: 2 ulps seen, 1e-6 relative allowed
    np.testing.assert_allclose(probs, router_probs(np, logits), rtol=1e-6, atol=0)
    np.testing.assert_allclose(probs, router_probs(np, logits.astype(np.float64)), rtol=1e-6, atol=0)


def check_weights(name, weights, probs, selected, k):
    from ds4lab.model.moe import route_weights

    # Given the kernel's probabilities, the same float32 operations: NumPy adds fewer than eight in order, as
    # the kernel does, so the emulator is exact there; elsewhere within 1e-6 relative (a GPU's sum or division).
    want = route_weights(np, probs, selected.astype(np.int64), 1.5)
    np.testing.assert_allclose(weights, want, rtol=0 if name == "emulated" and k < 8 else 1e-6, atol=0)


@pytest.mark.parametrize("T,n,k", [(1, 256, 6), (16, 256, 6), (3, 8, 2), (2, 4, 3), (5, 37, 5), (2, 300, 8),
                                   (1, 1024, 32)])
@pytest.mark.parametrize("biased", [True, False])
def test_moe_route_kernel_equals_the_plain_routing(gpu, T, n, k, biased):
    from ds4lab.model.moe import router_probs, select_topk

    name, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(T * n + k)
    logits = (3 * rng.standard_normal((T, n))).astype(np.float32)
    logits[0, :6] = [25.0, 20.0, -20.0, -25.0, 20.5, -19.5][:n]  # softplus's three branches and their edges
    if T > 1:
        logits[1] = -40.0 - rng.uniform(0, 5, n)  # every probability tiny: the weights' floor of 2^-14
    bias = (0.5 * rng.standard_normal(n)).astype(np.float32) if biased else None
    probs, selected, weights = routed(kernels, to_dev, to_host, logits, bias, k)
    check_probs(probs, logits)
    assert selected.dtype == np.int32 and selected.shape == (T, k)
    with_bias = (lambda p: p) if bias is None else (lambda p: p + bias)
    assert np.array_equal(selected, select_topk(with_bias(probs), k))  # the kernel's scores, select_topk's order
    assert np.array_equal(selected, select_topk(with_bias(router_probs(np, logits)), k))  # the plain path's
    check_weights(name, weights, probs, selected, k)
    if T > 1:
        assert k * probs[1].max() < 2.0 ** -14  # row 1's weights came through the floor


@pytest.mark.parametrize("n,k", [(256, 6), (7, 3), (64, 6), (8, 2)])
@pytest.mark.parametrize("biased", [True, False])
def test_moe_route_kernel_breaks_ties_toward_the_lower_id(gpu, n, k, biased):
    """Logits and biases from a few values, so most scores tie: the selection and its order equal the stable
    sort's, ties going to the lower expert id."""
    from ds4lab.model.moe import router_probs, select_topk

    name, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(n + k)
    logits = rng.choice(np.array([-30.0, -1.0, 0.0, 0.5, 2.0, 25.0], dtype=np.float32), size=(6, n))
    logits[0] = 0.5  # every expert ties
    logits[1] = np.where(np.arange(n) < n // 2, 2.0, 25.0)  # the high half ties: its first k
    bias = rng.choice(np.array([0.0, 0.25], dtype=np.float32), size=n) if biased else np.zeros(n, np.float32)
    probs, selected, weights = routed(kernels, to_dev, to_host, logits, bias if biased else None, k)
    check_probs(probs, logits)
    assert np.array_equal(selected, select_topk(router_probs(np, logits) + bias, k))
    high = bias == bias.max()  # row 0: the experts with the higher bias, then the others, each in id order
    assert selected[0].tolist() == np.r_[np.flatnonzero(high), np.flatnonzero(~high)][:k].tolist()
    if not biased:
        assert selected[1].tolist() == list(range(n // 2, n // 2 + k))
    check_weights(name, weights, probs, selected, k)


def _next_token(kernels, to_dev, to_host, logits, exclude, draw=None) -> int:
    from ds4lab.sampling import draw_params, exclude_mask

    mask = to_dev(exclude_mask(exclude, logits.size)) if len(exclude) else None
    params = None if draw is None else to_dev(draw_params(*draw))
    got = to_host(kernels.next_token(to_dev(logits[None]), mask, params))
    assert got.dtype == np.int32 and got.shape == (1,)
    return int(got[0])


def test_next_token_kernel_is_the_hosts_greedy_token_and_draw(gpu):
    """next_token, greedy: the host's argmax of the logits with the excluded ids at -inf (NaN never, ties to the
    first, +inf taken, every logit at -inf or at most -1e30: token 0), over rows shorter than a SIMD group, of a few
    ids a thread and of Flash's 129,280. Drawn (ds4's default rule, the uniform the host's generator gives next): the
    host's token for 24 rows of random logits at two temperatures and min_p 0 and 0.05, and its greedy fallback where
    nothing is drawn (no finite logit; every weight dropped, min_p above 1). A float32 exp and the group's sums in
    their order may round a draw at a boundary the other way (the host then evaluates its own): none does here."""
    from ds4lab.sampling import Rng, argmax, sample

    name, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(11)
    wide = (rng.standard_normal(5000) * 3).astype(np.float32)
    tied = np.round(wide).astype(np.float32)  # many ties
    rows = [np.array([1.0, np.nan, 3.0, 3.0, -2.0], np.float32), np.full(4, -np.inf, np.float32),
            np.array([-1e31, -2e30, np.nan, -1e30], np.float32), np.array([1.0, np.inf, 2.0, np.inf], np.float32),
            wide, tied, (rng.standard_normal(129_280) * 3).astype(np.float32)]
    for logits in rows:
        top = int(np.nanargmax(np.where(np.isposinf(logits), np.float32(3e38), logits)))
        for exclude in (np.zeros(0, np.int64), np.array([2, 3]), np.array([top]), np.arange(logits.size)):
            host = logits.copy()
            host[exclude] = -np.inf
            assert _next_token(kernels, to_dev, to_host, logits, exclude) == argmax(host), (logits[:8], exclude)
    for seed in range(24):
        logits = rows[4 + seed % 3] if seed < 6 else (rng.standard_normal(rng.integers(1, 20_000)) * 3).astype(
            np.float32)
        t, min_p = (1.0, 0.7)[seed % 2], (0.0, 0.05)[seed // 2 % 2]
        exclude = np.array([int(np.argmax(logits))]) if seed % 3 == 0 else np.zeros(0, np.int64)
        host = logits.copy()
        host[exclude] = -np.inf
        u = np.float32(Rng(seed).uniform())
        want = sample(host, temperature=t, top_k=0, top_p=1.0, min_p=min_p, rng=Rng(seed))
        assert _next_token(kernels, to_dev, to_host, logits, exclude, (u, t, min_p)) == want, seed
    # u = 0: the walk reaches 0 at the first kept id, here past 3,000 ids of which none is kept (whole runs or slices
    # with a sum of 0) and a finite one dropped by min_p
    late = wide.copy()
    late[:3000] = -np.inf
    late[3000] = wide.max() - 20  # its weight e^-20 under min_p
    weights = np.exp((late.astype(np.float64) - late.max())).astype(np.float32)
    first_kept = int(np.flatnonzero(np.isfinite(late) & (weights >= np.float32(0.05)))[0])
    assert first_kept > 3000
    none = np.zeros(0, np.int64)
    assert _next_token(kernels, to_dev, to_host, late, none, (np.float32(0.0), 1.0, 0.05)) == first_kept
    # u = 0 and min_p 0: the first id, though its weight (and its slice's sum) underflows to 0 under a top of 200
    under = np.zeros(5000, np.float32)
    under[-1] = 200
    assert _next_token(kernels, to_dev, to_host, under, none, (np.float32(0.0), 1.0, 0.0)) == 0
    for logits, min_p in ((rows[1], 0.05), (rows[3], 0.05), (rows[2], 0.05), (wide, 1.5)):
        u = np.float32(Rng(7).uniform())
        want = sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=min_p, rng=Rng(7))
        assert _next_token(kernels, to_dev, to_host, logits, np.zeros(0, np.int64), (u, 1.0, min_p)) == want


@pytest.mark.parametrize("T,n,k,V", [(1, 256, 6, 1000), (5, 4, 3, 50), (16, 8, 2, 300)])
def test_moe_route_kernel_takes_a_hash_layers_experts_from_its_table(gpu, T, n, k, V):
    name, kernels, to_dev, to_host = gpu
    rng = np.random.default_rng(V)
    logits = (3 * rng.standard_normal((T, n))).astype(np.float32)
    bias = (5 * rng.standard_normal(n)).astype(np.float32)  # ignored: the table decides
    table = rng.integers(0, n, (V, k)).astype(np.int32)  # a row may name an expert twice
    tokens = rng.integers(0, V, T).astype(np.int32)
    tokens[-1] = V - 1
    probs, selected, weights = routed(kernels, to_dev, to_host, logits, bias, k, table, tokens)
    check_probs(probs, logits)
    assert selected.dtype == np.int32 and np.array_equal(selected, table[tokens])
    check_weights(name, weights, probs, selected, k)


def test_qmatmul_reads_device_ids_as_its_batches(gpu, monkeypatch):
    """A decode step's gate, up and down projections take one array of expert ids on the device: each launch
    reads the ids themselves as its batches (a pair each), nothing is made from them on the device."""
    name, kernels, to_dev, to_host = gpu
    if name != "emulated" and isinstance(to_dev(np.zeros(1)), np.ndarray):
        pytest.skip(f"{name}: its arrays are host arrays, so ids take the host plan")
    n_expert, rows, ne0, qtype = 5, 32, 256, Q.Q8_0
    rng = np.random.default_rng(13)
    batches = []
    run = kernels._run

    def recording(spec, groups, threads, inputs, outputs):
        if spec.name.startswith("qmatmul_q"):
            batches.append(inputs[4])
        return run(spec, groups, threads, inputs, outputs)

    monkeypatch.setattr(kernels, "_run", recording)
    first, second = np.array([3, 0, 3, 4, 1, 0]), np.array([2, 2, 1, 4, 0, 3])
    for experts in (first, second):
        ids = device_ids(name, to_dev, experts.astype(np.int32))
        for proj in range(3):
            raw = random_weight(qtype, (n_expert, rows), ne0, seed=proj)
            x = rng.standard_normal((len(experts), ne0)).astype(np.float32)
            W = dequantize(raw, qtype, ne0).astype(np.float64)
            want = np.einsum("pk,prk->pr", x.astype(np.float64), W[experts])
            got = to_host(kernels.qmatmul(to_dev(x), to_dev(blocks(raw, qtype)), qtype, ne0, rows, ids))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert len(batches) == 6
    for got, experts in zip(batches, [first] * 3 + [second] * 3):
        np.testing.assert_array_equal(to_host(got), experts)


@pytest.mark.parametrize("hashed", [False, True], ids=["top-k", "hash"])
def test_ops_routing_and_swiglu_kernels_equal_their_plain_ops(hashed):
    """Ops.moe_route and .swiglu through the emulator's kernels and through the plain ops (the decode
    routing the model ran before: select_topk_on_device, or a gather from the hash table by host ids)."""
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from ds4lab.mlx_kernels.cpu import compiler

    if compiler() is None:
        pytest.skip("no C++20 compiler here for the CPU kernel emulator")
    rng = np.random.default_rng(int(hashed))
    T, n, k, V = 3, 256, 6, 100
    logits = (3 * rng.standard_normal((T, n))).astype(np.float32)
    logits[2] = rng.choice(np.array([0.0, 1.0], dtype=np.float32), n)  # ties
    bias = (0.5 * rng.standard_normal(n)).astype(np.float32)
    table = rng.integers(0, n, (V, k)).astype(np.int32) if hashed else None
    tokens = rng.integers(0, V, T)  # host ids (int64), as an eager step passes them
    fused, plain = (o.moe_route(logits, bias, k, 1.5, table, tokens) for o in (ops.Ops(EmulatedBackend(True)),
                                                                                ops.Ops(EmulatedBackend(False))))
    np.testing.assert_allclose(fused[0], plain[0], rtol=1e-6, atol=0)
    assert np.array_equal(fused[1], plain[1])
    np.testing.assert_allclose(fused[2], plain[2], rtol=1e-6, atol=0)
    gate, up = (rng.standard_normal((T * k, 64)).astype(np.float32) * 8 for _ in range(2))
    fused, plain = (o.swiglu(gate, up, 7.0, fused[2].reshape(-1)) for o in (ops.Ops(EmulatedBackend(True)),
                                                                            ops.Ops(EmulatedBackend(False))))
    np.testing.assert_allclose(fused, plain, rtol=1e-6, atol=0)


def test_ops_moe_route_past_the_kernels_limits_adds_the_splits_first():
    """More experts a token than moe_route's kernel selects: Ops.moe_route given the router's K splits (as
    split_sums gives them) adds them (add_splits) and routes through the plain ops, as for the summed logits."""
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from ds4lab.mlx_kernels.cpu import compiler

    if compiler() is None:
        pytest.skip("no C++20 compiler here for the CPU kernel emulator")
    rng = np.random.default_rng(3)
    T, n, k = 2, 64, S.ROUTE_MAX_K + 1
    parts = (3 * rng.standard_normal((3, T, n))).astype(np.float32)
    got = ops.Ops(EmulatedBackend(True)).moe_route(parts, None, k, 1.5)
    want = ops.Ops(EmulatedBackend(False)).moe_route((parts[0] + parts[1]) + parts[2], None, k, 1.5)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_grouped_output_gathered_equals_the_group_by_group_projection():
    from ds4lab.model.attention import grouped_output, grouped_output_gathered

    rng = np.random.default_rng(0)
    T, H, D, G, o_lora, E = 3, 8, 16, 4, 5, 7
    heads = rng.standard_normal((T, H, D))
    W = rng.standard_normal((G, o_lora, (H // G) * D))
    out_b = rng.standard_normal((E, G * o_lora))
    want = grouped_output(np, heads, [lambda x, g=g: x @ W[g].T for g in range(G)], lambda x: x @ out_b.T)
    got = grouped_output_gathered(np, heads, lambda x, groups: np.einsum("pk,prk->pr", x, W[groups]), G,
                                  lambda x: x @ out_b.T)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("whole_step", [True, False], ids=["whole step", "per layer"])
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.gpu) for b in ("cupy", "mlx")] + ["emulated"])
def test_compiled_decode_equals_eager(model_paths, backend, whole_step):
    """Decode steps as compiled backends run them give the eager logits and KV state bit for bit. CuPy: one CUDA
    graph for every layer of the step (whole_step), or one per half and layer (as tiers run), each run eagerly on
    the first decode-sized step, captured on the second, replayed after. MLX: the same functions through
    mx.compile, traced once; its whole step also compiles the head, whose stream collapse is plain MLX ops
    (hc_head's ``pre * scale + base`` and weighted sum) that mx.compile fuses, contracting a multiply and an add
    into one FMA: on the H200 compiled hc_head moved nano's embedding by up to 4.8e-7 (its rmsnorm not at all),
    so there the logits are held to 8 float32 epsilons of the largest logit and the state stays bit for bit. The
    emulator: the same functions with positions and token ids passed as device arrays, as a graph sees them."""
    from ds4lab.runtime.tables import ending

    gpu = _gpu_model_or_skip(model_paths["nano"], backend, "ds4", True)
    rt, b = gpu.runtime, gpu.backend
    if backend == "emulated":
        b.compiled_rows, b.compiles_ffn = 16, True
        b.compile = lambda fn, carry=None, family=None: lambda *a, live=None, written=None: fn(*a)
    # from position 68 the indexer drops rows; positions 75, 79 and 83 end a ratio-4 window: on a GPU the
    # steps that do are a compiled call of their own, run eagerly, captured, then replayed after the others'
    n_prefill, n_decode = 72, 4 if backend == "emulated" else 12
    ids = np.random.default_rng(11).integers(0, gpu.config.n_vocab, n_prefill + n_decode)
    logits, states, held = {}, {}, None
    rt.whole_step = whole_step
    for compiled in (False, True):
        rt.compile = compiled
        rt.compiled.clear()
        sess = gpu.session(ctx=128, prefill_chunk=n_prefill)
        sess.prefill(ids[:n_prefill]).run(progress=False)
        steps = [sess.logits]
        for end in range(n_prefill + 1, len(ids) + 1):
            sess.sync(ids[:end])
            steps.append(sess.logits)
            if compiled and end == n_prefill + 2:  # a state a checkpoint could hold, made by a replay
                held_state = sess._state
                held = live_state_rows(held_state, gpu.config, b.to_numpy)
        logits[compiled] = np.stack(steps)
        states[compiled] = live_state_rows(sess._state, gpu.config, b.to_numpy)
    assert all(np.array_equal(x, y) for x, y in zip(states[True], states[False], strict=True))  # ids given: no feedback
    if backend == "mlx" and whole_step:
        atol = 8 * np.finfo(np.float32).eps * float(np.abs(logits[False]).max())
        np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=atol)
    else:
        assert np.array_equal(logits[True], logits[False])
    later = live_state_rows(held_state, gpu.config, b.to_numpy)
    assert all(np.array_equal(x, y) for x, y in zip(held, later))  # later replays left it alone
    # keys: ("step", rows, real rows, head, ends, device), or (layer, ends, rows, device) and ("ffn", layer, rows,
    # device): a call per set of the windows a step ends (runtime.tables.ending), run as often as such steps come
    cfg = gpu.config
    ends = [ending([cfg.ratio(il) for il in range(cfg.n_layer) if cfg.ratio(il)], p, 1)
            for p in range(n_prefill, n_prefill + n_decode)]
    if whole_step:
        runs = {("step", 1, 1, True, e): ends.count(e) for e in ends}
    else:
        runs = {**{(il, e, 1): sum((cfg.ratio(il) in x) == e for x in ends)
                   for il in range(cfg.n_layer) for e in {cfg.ratio(il) in x for x in ends}},
                **{("ffn", il, 1): len(ends) for il in range(cfg.n_layer)}}
    decode = {key[:-1]: g for key, g in rt.compiled.items() if (key[1] if key[0] == "step" else key[-2]) == 1}
    assert set(decode) == set(runs) and len(set(ends)) == 2
    if backend == "cupy":  # eager, then captured, then replayed
        assert all(g.captures == (runs[key] > 1) and not g.failures for key, g in decode.items()), \
            [g.failures for g in decode.values()]


def test_packing_layout_and_views():
    """Arrays packed at aligned offsets come back unchanged; the layout depends on byte sizes only, so a
    run of arrays has the same relative offsets wherever it starts."""
    from ds4lab.backends.packing import ALIGN, offsets, views

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 5)).astype(np.float32), np.int32(7) * np.ones((), np.int32),
              rng.integers(0, 100, 300).astype(np.int32), np.zeros((0,), np.float32), np.ones((2, 2), bool)]
    offs, size = offsets(a.nbytes for a in arrays)
    assert offs == [0, ALIGN, 2 * ALIGN, 2 * ALIGN + 1280, 2 * ALIGN + 1280] and size == 3 * ALIGN + 1280
    buf = np.zeros(size, np.uint8)
    for dst, src in zip(views(buf, arrays, offs), arrays):
        dst[...] = src
    for got, want in zip(views(buf, arrays, offs), arrays):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert np.array_equal(buf[offs[2]:offs[2] + 1200].view(np.int32), arrays[2])  # in the buffer, at its offset
    tail, _ = offsets(a.nbytes for a in arrays[2:])
    assert [o - offs[2] for o in offs[2:]] == tail


def test_packing_stale_rows_are_the_live_rows_an_older_copy_lacks():
    """stale_rows against sets of rows (Hypothesis): exactly the live rows (ranges apart) that were not live then or
    that a step since wrote, each once; None (every row) where live, then or a step's writes are None."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ds4lab.backends.packing import stale_rows

    span = st.tuples(st.integers(0, 40), st.integers(0, 12)).map(lambda p: (p[0], p[0] + p[1]))
    ranges = st.lists(span, max_size=3).map(tuple)
    # live rows as the callers give them: ranges apart, in any order
    apart = st.lists(st.integers(0, 50), unique=True, max_size=6).map(
        lambda e: tuple((a, b) for a, b in zip(sorted(e)[::2], sorted(e)[1::2]))).flatmap(st.permutations).map(tuple)

    def rows(rs):
        return {r for a, b in rs for r in range(a, b)}

    @settings(max_examples=400, deadline=None)
    @given(apart, ranges, st.lists(ranges, max_size=3))
    def check(live, then, written):
        got = stale_rows(live, then, written)
        want = rows(live) - (rows(then) - rows(r for w in written for r in w))
        assert rows(got) == want and sum(b - a for a, b in got) == len(want), (got, want)

    check()
    assert stale_rows(((0, 4),), ((0, 3),), [((2, 3),)]) == ((2, 4),)  # row 2 rewritten, row 3 new
    assert stale_rows(None, ((0, 3),), []) is None
    assert stale_rows(((0, 4),), None, []) == ((0, 4),) == stale_rows(((0, 4),), ((0, 4),), [None])
    assert stale_rows(((0, 4),), ((0, 4),), []) == ()


def test_packing_pieces_cover_each_span_in_order():
    """Spans cut into pieces: each span's bytes exactly once, in order, in pieces of the size (its last one the rest),
    its addresses moving together; past ``most`` pieces the size doubles until they fit (a span one piece at least)."""
    from ds4lab.backends.packing import pieces

    rng = np.random.default_rng(1)
    spans = [(16 * int(rng.integers(0, 1 << 30)), 16 * int(rng.integers(0, 1 << 30)), int(n))
             for n in (1, 16, 65536, 65537, 200000, 5, 131072 * 3 + 48)]
    # 17 pieces of 64 KB, 11 of 128 KB, 8 of 256 KB, 7 (one a span) of 512 KB
    for most, want_size in ((10 ** 6, 65536), (17, 65536), (16, 131072), (11, 131072), (8, 262144), (7, 524288),
                            (3, 524288)):
        table, size = pieces(spans, 65536, most)
        assert size == want_size and table.dtype == np.uint64 and table.shape[1] <= max(most, len(spans))
        m = 0
        for src, dst, n in spans:
            k = max(1, -(-n // size))
            got = table[:, m:m + k].astype(np.int64)
            assert (got[0] - src == got[1] - dst).all(), (most, n)
            assert list(got[0] - src) == [size * i for i in range(k)], (most, n)
            assert list(got[2]) == [size] * (k - 1) + [n - size * (k - 1)], (most, n)
            m += k
        assert m == table.shape[1]
    assert pieces([], 65536, 8)[0].shape == (3, 0)


@pytest.mark.gpu
def test_cupy_chains_of_programmatic_launches_read_what_the_kernel_before_wrote():
    """On compute capability 9 on, ds4lab's kernels are programmatic launches (ds4lab.cuda.driver.launch): each may be
    launched before the one before it has flushed its writes and waits for them (grid_dependency_wait). A chain of
    dependent launches with no synchronisation gives the bits of the same chain synchronised after every launch."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.cuda import driver

    kernels, to_dev, to_host = found
    if int(cp.cuda.Device().compute_capability) >= 90:  # the launches this test is about
        assert driver._programmatic(kernels._functions["rmsnorm"].kernel.ptr)
    rng = np.random.default_rng(8)
    x0 = to_dev(rng.standard_normal((4096, 1024)).astype(np.float32))
    w = to_dev((1.0 + 0.25 * rng.standard_normal(1024)).astype(np.float32))

    def chain(sync: bool):
        y = x0
        for i in range(60):
            y = kernels.rmsnorm(y * (1.0 + i / 64), 1e-6, w) if i % 3 == 0 else kernels.rmsnorm(y, 1e-6, w)
            if sync:
                cp.cuda.get_current_stream().synchronize()
        return to_host(y)

    assert np.array_equal(chain(False), chain(True))


@pytest.mark.gpu
def test_cupy_upload_reuses_its_buffers():
    """CuPy's upload brings every array's values; the same layout again gives back the arrays of the upload before
    the last (two buffers taken in turn, no array made per step) with the new values, leaving the last upload's
    values alone; past UPLOAD_LAYOUTS other layouts, the least recently used one is made afresh, and arrays still
    held from it keep their values."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.backends import cupy_backend

    b = cupy_backend.CupyBackend()
    rng = np.random.default_rng(4)

    def host(n):
        return [np.int32(n), rng.standard_normal((n, 3)), rng.integers(0, 9, n)]  # float64 and int64 on purpose

    def check(got, want):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            w = np.asarray(w)
            assert g.dtype == (np.float32 if w.dtype.kind == "f" else np.int32) and g.shape == w.shape
            assert np.array_equal(cp.asnumpy(g), w.astype(g.dtype))

    first = host(5)
    got = b.upload(first)
    check(got, first)
    second = host(5)
    got1 = b.upload(second)
    assert not any(x is y for x, y in zip(got, got1))
    check(got, first)
    check(got1, second)
    again = host(5)
    got2 = b.upload(again)
    assert all(x is y for x, y in zip(got, got2))
    check(got2, again)
    check(got1, second)
    for n in range(6, 6 + cupy_backend.UPLOAD_LAYOUTS):  # 16 other layouts: the one of 5 rows is forgotten
        other = host(n)
        check(b.upload(other), other)
    fresh = host(5)
    got3 = b.upload(fresh)
    assert not any(x is y for pair in (got1, got2) for x, y in zip(pair, got3))
    check(got3, fresh)
    check(got2, again)  # the forgotten buffers' arrays are unchanged
    check(got1, second)


@pytest.mark.gpu
def test_cupy_upload_waits_for_its_buffers_readers():
    """A kernel still reading an upload's arrays (held back about 0.1 s) when the next upload but one of the layout
    comes, which takes the same buffer: it reads the values it was given, and the later upload's arrays hold theirs."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.backends import cupy_backend

    late_copy = cp.RawKernel(r"""
    extern "C" __global__ void late_copy(const float* src, float* dst, int n, long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) dst[i] = src[i];
    }""", "late_copy")
    b = cupy_backend.CupyBackend()
    values = [np.full(1000, v, np.float32) for v in (1, 2, 3)]
    first = b.upload([values[0]])[0]
    out = cp.zeros(1000, cp.float32)
    late_copy((4,), (256,), (first, out, np.int32(1000), np.int64(200_000_000)))
    b.upload([values[1]])
    third = b.upload([values[2]])[0]
    assert third.data.ptr == first.data.ptr  # the same buffer, taken again
    assert np.array_equal(cp.asnumpy(out), values[0]) and np.array_equal(cp.asnumpy(third), values[2])


@pytest.mark.gpu
def test_cupy_device_bytes_uploads_every_byte_in_pieces(monkeypatch, tmp_path):
    """Weights go up in pieces through pinned buffers, several threads at once: every byte arrives, at every
    size around a piece's (one piece or less, a piece and a byte, a ragged last piece), in the tensor's shape;
    memory-mapped like a model file's tensors."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.backends import cupy_backend
    from ds4lab.backends.cupy_backend import CupyBackend

    monkeypatch.setattr(cupy_backend, "PIECE_BYTES", 1000)
    monkeypatch.setattr(cupy_backend, "SMALL_BYTES", 1000)
    backend = CupyBackend()
    rng = np.random.default_rng(3)
    for shape in [(1,), (999,), (1000,), (1001,), (3, 7001), (64, 1000), (5, 3, 2001), (4, 1001)]:
        raw = rng.integers(0, 256, shape, dtype=np.uint8)
        got = backend.device_bytes(raw)
        assert isinstance(got, cp.ndarray) and got.shape == shape and got.dtype == cp.uint8
        assert np.array_equal(cp.asnumpy(got), raw), shape
    path = tmp_path / "weights.bin"
    raw = rng.integers(0, 256, (37, 997), dtype=np.uint8)
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    assert np.array_equal(cp.asnumpy(backend.device_bytes(mapped[5:30])), raw[5:30])


@pytest.mark.gpu
def test_cupy_graph_step_copies_runs_and_keeps_outputs():
    """A CUDA graph replay gives the eager results whether its arguments sit in one buffer at the graph's
    layout (one span copied: a replay's own outputs, passed as arrays or as one Span of them, a packed
    upload), at other offsets, or apart; and outputs a caller holds are never overwritten by later
    replays."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.backends.cupy_backend import CupyBackend
    from ds4lab.cuda.graphs import GraphStep

    def fn(a, b, n):
        return a * 2.0 + b[:1], b + 1.0, n + 1

    step = GraphStep(fn)
    rng = np.random.default_rng(1)
    a = cp.asarray(rng.standard_normal((4, 3)).astype(np.float32))
    b = cp.asarray(rng.standard_normal((5, 3)).astype(np.float32))
    n = cp.asarray(np.int32(2))
    held, want, span = [], [], None
    for i in range(6):
        if i == 4:  # the same values, packed in one upload (a run at the graph's layout)
            host = [cp.asnumpy(x) for x in (a, b, n)]
            a, b, n = CupyBackend().upload(host)
            assert [(x.shape, x.dtype, np.array_equal(cp.asnumpy(x), h)) for x, h in zip((a, b, n), host)] == \
                [(h.shape, h.dtype, True) for h in host]
        if i == 5:  # in one buffer, at other offsets than the layout's
            big = cp.zeros(4096, dtype=cp.uint8)
            a2, b2 = big[16:64].view(cp.float32).reshape(4, 3), big[528:588].view(cp.float32).reshape(5, 3)
            a2[...], b2[...] = a, b
            a, b = a2, b2
        ref = fn(*(cp.asnumpy(x) for x in (a, b, n)))  # float32 NumPy: the same roundings
        out = step(span, n) if i == 3 else step(a, b, n)  # 3: a and b as one Span of the last outputs
        assert [np.array_equal(cp.asnumpy(o), r) for o, r in zip(out, ref)] == [True] * 3, i
        held.append(out)
        want.append(ref)
        a, b = out[0][:, :], out[1]  # the next call's arguments come out of this replay
        n = out[2]
        span = out[:2]
        assert len(span) == 2 and span[-1] is out[1] and [x.shape for x in span] == [(4, 3), (5, 3)]
    assert step.captures == 1 and not step.failures
    for out, ref in zip(held, want):
        assert [np.array_equal(cp.asnumpy(o), r) for o, r in zip(out, ref)] == [True] * 3


def _fail_after_launch(step, *args):
    """Call ``step`` (a GraphStep with one captured graph) so that its replay raises after the graph's launch, as a
    replay that fails once its state has moved on."""
    captured = next(iter(step._graphs.values()))
    graph = captured.graph

    class Failing:
        def launch(self, stream):
            graph.launch(stream)
            raise RuntimeError("after the launch")

    captured.graph = Failing()
    try:
        with pytest.raises(RuntimeError, match="after the launch"):
            step(*args)
    finally:
        captured.graph = graph


def _copied_in(step, *args):
    """``step(*args)`` and the (start, end) byte ranges of its input buffer that the call copied in."""
    from ds4lab.cuda import graphs

    copies, real_copy = [], graphs._Captured._copy
    graphs._Captured._copy = lambda self, run, stream: copies.append(run[3:5]) or real_copy(self, run, stream)
    try:
        return step(*args), copies
    finally:
        graphs._Captured._copy = real_copy


@pytest.mark.gpu
def test_cupy_graph_carries_its_state_in_place():
    """A graph with ``carry``: its own copy of the state is written in place (the ring and the rows, by the in-place
    kernels, where ``donated`` says so) or replaced (a new array, copied back into its place); each replay equals the
    plain formulas, a replay given the last replay's carried outputs copies nothing in, one given an older state (a
    restore) starts from it, and no replay overwrites outputs a caller holds."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.cuda import graphs
    from ds4lab.model.attention import ring_write
    from ds4lab.model.compressor import append_rows

    kernels = found[0]
    in_place = []

    def fn(pos0, n_valid, kv, raw, rows, count):
        in_place.append((graphs.donated(raw), graphs.donated(rows), graphs.donated(count)))
        raw, slot_pos, _ = kernels.ring_write(raw, kv, pos0, n_valid, 4, in_place=graphs.donated(raw))
        rows = kernels.append_rows(rows, kv, pos0, n_valid, 1, in_place=graphs.donated(rows))
        return slot_pos, raw, rows, count + 1.0

    def plain(pos0, kv, raw, rows, count):
        raw, slot_pos, _ = ring_write(np, raw, kv, pos0, 1, 4)
        return slot_pos.astype(np.int32), raw, append_rows(np, rows, kv, pos0, 1, 1), count + 1.0

    step = graphs.GraphStep(fn, carry=(3, 1))
    rng = np.random.default_rng(3)
    state = [np.zeros((4, 8), np.float32), np.zeros((12, 8), np.float32), np.zeros((2,), np.float32)]
    dev, held = [cp.asarray(a) for a in state], []
    history = [list(state)]
    for t in range(10):
        kv = rng.standard_normal((1, 8)).astype(np.float32)
        restore = t == 7  # back to the state after step 3
        if restore:
            state, dev = list(history[4]), held[3][1:]
        want = plain(t, kv, *state)
        state_args = dev if isinstance(dev, (list, tuple)) else [dev]  # a Span is one argument (not unpacked)
        dropped = t == 5  # a replay that fails after its launch moved the state on: the next one copies it in
        if dropped:
            _fail_after_launch(step, cp.asarray(np.int32(t)), cp.asarray(np.int32(1)), cp.asarray(-kv), *state_args)
        out, copies = _copied_in(step, cp.asarray(np.int32(t)), cp.asarray(np.int32(1)), cp.asarray(kv), *state_args)
        assert [np.array_equal(cp.asnumpy(o), w) for o, w in zip(out, want)] == [True] * 4, t
        captured = next(iter(step._graphs.values()), None)
        if t >= 2 and not (restore or dropped):  # given the last replay's Span: the tables copied in, not the state
            assert copies and max(end for _, end in copies) <= captured.in_offs[3], (t, copies)
        elif t >= 2:
            assert max(end for _, end in copies) > captured.in_offs[3], (t, copies)
        held.append(out)
        state, dev = list(want[1:]), out[1:]
        history.append(list(state))
    assert step.captures == 1 and not step.failures
    assert in_place[0] == (False, False, False) and in_place[1] == (True, True, True)  # eager, then the capture
    for t, out in enumerate(held):  # every replay's outputs are still what it returned
        assert [np.array_equal(cp.asnumpy(o), w) for o, w in zip(out[1:], history[t + 1])] == [True] * 3, t


@pytest.mark.gpu
def test_cupy_graph_copies_only_the_live_rows_it_is_given():
    """A replay given ``live`` row ranges copies those rows of each carried array into its outputs (one range, two, a
    whole array for None, none for an empty tuple: after a non-carried output, as a whole step's logits come) and
    leaves the other rows as the outputs' memory held them; the next replay, given those outputs, still finds the
    whole state in its buffer (carried in place). Ranges that do not fit the carried arrays are refused before the
    replay."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.cuda import graphs

    def fn(x, ring, rows, small):
        return x * np.float32(3), ring + x[:, None], rows * np.float32(2), small + np.float32(1)

    step = graphs.GraphStep(fn, carry=(1, 1))
    ring, rows, small = (np.arange(16 * 4, dtype=np.float32).reshape(16, 4), np.ones((10, 4), np.float32),
                         np.zeros(3, np.float32))
    state, want = [cp.asarray(a) for a in (ring, rows, small)], [ring, rows, small]
    lives = [None, None, [((14, 16), (0, 3)), ((0, 4),), None], [(), ((0, 10),), None], [((5, 6),), (), None]]
    for t, live in enumerate(lives):  # eager, the capture, then replays given their live rows
        x = np.full(16, t, np.float32)
        want = [want[0] + x[:, None], want[1] * np.float32(2), want[2] + np.float32(1)]
        args = [state] if isinstance(state, graphs.Span) else state  # a Span is one argument (not unpacked)
        out = step(cp.asarray(x), *args, live=live)
        assert np.array_equal(cp.asnumpy(out[0]), x * np.float32(3))
        got = [cp.asnumpy(o) for o in out[1:]]
        for g, w, ranges in zip(got, want, live or [None] * 3):
            kept = np.ones(len(w), bool) if ranges is None else np.zeros(len(w), bool)
            for a, b in ranges or ():
                kept[a:b] = True
            assert np.array_equal(g[kept], w[kept]), (t, ranges)
        state = out[1:] if isinstance(out, graphs.Outputs) else list(out[1:])
    assert step.captures == 1 and not step.failures
    with pytest.raises(graphs.CarryError, match="row ranges"):
        step(cp.asarray(x), state, live=[None, None])


@pytest.mark.gpu
def test_cupy_graph_recycles_an_output_buffer_once_nothing_holds_it(monkeypatch):
    """A replay given ``live`` and ``written`` row ranges takes back the output buffer of an earlier replay whose
    outputs nothing holds any more (no Outputs, no view of them) and copies into it only the live rows that buffer
    lacks (packing.stale_rows: not live then, or written since), here a ring slot and a row a step; a buffer that a
    view still holds is never written, and a state copied in from elsewhere (a restore) gets every live row copied.
    Every replay's live rows are the plain formulas', over a ring of 4 slots that wraps, a window of 3 (each step
    writes the slot of a position the buffer of two steps back held live). After the restore to position 8 the
    steps go on from position 9, as a session's do: the rows not live at 8 were never copied into its buffer, so
    they hold whatever that memory held (a step 12 after 8 would read them as live)."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.cuda import graphs

    def fn(pos, kv, raw, rows, pend):
        new_raw = cp.where((cp.arange(4, dtype=cp.int32) == pos % 4)[:, None], kv, raw)
        new_rows = cp.where((cp.arange(64, dtype=cp.int32) == pos)[:, None], kv * np.float32(2), rows)
        if graphs.donated(raw):  # the graph's own copy: written in place, as the KV ring and rows are
            raw[...], rows[...] = new_raw, new_rows
            new_raw, new_rows = raw, rows
        return kv * np.float32(3), new_raw, new_rows, pend + kv

    def ring(start, count):  # the slots of positions [start, start + count)
        a = start % 4
        return ((a, a + count),) if a + count <= 4 else ((a, 4), (0, a + count - 4))

    copied, real = [], graphs._LiveCopy.launch
    monkeypatch.setattr(graphs._LiveCopy, "launch",
                        lambda self, out, rows, stream: copied.append(rows) or real(self, out, rows, stream))
    step = graphs.GraphStep(fn, carry=(2, 1))
    rng = np.random.default_rng(4)
    want = [np.zeros((4, 8), np.float32), np.zeros((64, 8), np.float32), np.zeros((1, 8), np.float32)]
    state, history, back, kept = [cp.asarray(a) for a in want], {}, None, None
    positions = [t if t < 12 else t - 3 for t in range(20)]  # step 12 restores position 8 and goes on from 9
    for t, pos in enumerate(positions):
        if t == 12:  # back to the state after position 8 (a replay's outputs still held)
            state, want = back[1:], history[8]
        kv = rng.standard_normal((1, 8)).astype(np.float32)
        raw, rows, pend = (np.array(a) for a in want)
        raw[pos % 4], rows[pos] = kv[0], 2 * kv[0]
        want = history[pos] = [raw, rows, pend + kv]
        live = [ring(max(0, pos - 2), min(pos + 1, 3)), ((0, pos + 1),), None]  # a window of 3 positions
        written = [ring(pos, 1), ((pos, pos + 1),), None]
        out = step(cp.asarray(np.int32([pos])), cp.asarray(kv),
                   *([state] if isinstance(state, graphs.Span) else state), live=live, written=written)
        assert np.array_equal(cp.asnumpy(out[0]), 3 * kv)
        for got, w, r in zip(out[1:], want, live):
            got = cp.asnumpy(got)
            for a, b in ((0, len(w)),) if r is None else r:
                assert np.array_equal(got[a:b], w[a:b]), (t, a, b)
        if t == 5:  # a view of one array of step 5's outputs, the only thing left holding their buffer
            kept = out[2]
            kept_host = cp.asnumpy(kept)
        if t == 8:
            back = out
        state = out[1:] if isinstance(out, graphs.Outputs) else list(out[1:])
        del out
    assert step.captures == 1 and not step.failures
    assert np.array_equal(cp.asnumpy(kept), kept_host)  # never written while the view held it
    # rows' copy a replay (t >= 1): the whole count at the capture, at the restore (t = 12, position 9) and where no
    # buffer was free; otherwise the one row written since the buffer's step (or the two rows of two steps)
    rows_copied = [c[1] for c in copied]
    assert len(rows_copied) == 19
    assert rows_copied[0] == ((0, 2),) and rows_copied[12 - 1] == ((0, 10),)
    partial = [t for t, c in enumerate(rows_copied, 1) if c != ((0, positions[t] + 1),)]
    assert len(partial) >= 8 and all(sum(b - a for a, b in rows_copied[t - 1]) <= 2 for t in partial), rows_copied
    with pytest.raises(graphs.CarryError, match="written"):
        step(cp.asarray(np.int32([20])), cp.asarray(kv), state, live=None, written=[None])


@pytest.mark.gpu
@pytest.mark.parametrize("most", [8192, 4])
def test_cupy_graph_copies_large_live_spans_in_pieces(most, monkeypatch):
    """Live spans larger than a piece (64 KB) are copied whole through their pieces, the last one shorter; with at
    most 4 pieces the pieces grow to 256 KB and still cover the spans."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.cuda import graphs

    monkeypatch.setattr(graphs, "COPY_MAX_PIECES", most)
    step = graphs.GraphStep(lambda x, ring: (x * np.float32(2), ring + x[:1]), carry=(1, 1))
    want = np.arange(40000 * 4, dtype=np.float32).reshape(40000, 4)  # 640 KB, 16-byte rows
    state = [cp.asarray(want)]
    live = [((30000, 40000), (0, 25000))]  # 160,000 and 400,000 bytes
    for t in range(4):  # eager, the capture, two replays
        x = np.full(4, t + 1, np.float32)
        want = want + x[0]
        out = step(cp.asarray(x), *([state] if isinstance(state, graphs.Span) else state), live=live)
        got = cp.asnumpy(out[1])
        assert np.array_equal(got[30000:], want[30000:]) and np.array_equal(got[:25000], want[:25000]), t
        state = out[1:] if isinstance(out, graphs.Outputs) else list(out[1:])
    assert step.captures == 1 and not step.failures


@pytest.mark.gpu
def test_cupy_graphs_of_a_family_share_their_carried_state():
    """Two graphs with ``carry`` in one family (a decode step's variants), each writing the state in place: one input
    buffer between them, so a call of either given the other's last carried outputs copies only its other inputs in,
    while one given an older state (a restore), the outputs of an eager call, or any state after a bare replay
    (replay_seconds) or a failed one copies the state in; every result is the plain formulas', and the family keeps
    a buffer only while a graph uses it."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import gc
    import weakref

    import cupy as cp

    from ds4lab.cuda import graphs

    in_place = []

    def fn(x, acc, n, k):
        new = acc * 0.5 + x * float(k)
        in_place.append(graphs.donated(acc))
        if graphs.donated(acc):  # in the graph's buffer: written in place, as the KV ring is
            acc[...] = new
            new = acc
        return new, n + 1

    def plain(k, x, acc, n):
        return acc * np.float32(0.5) + x * np.float32(k), n + np.int32(1)

    family = weakref.WeakValueDictionary()
    steps = {k: graphs.GraphStep(lambda x, acc, n, k=k: fn(x, acc, n, k), (1, 0), family) for k in (1, 3)}
    rng = np.random.default_rng(2)
    acc, n = np.zeros((64, 8), np.float32), np.int32(0)
    state, history, held = [cp.asarray(acc), cp.asarray(n)], [], []
    order = [1, 1, 3, 1, 3, 3, 1, 3, 1, 1, 3, 3]  # each graph eager, then captured, then replayed at switches
    for t, k in enumerate(order):
        if t == 9:  # back to the state after step 4
            state, (acc, n) = held[4], history[4]
        if t == 7:  # bare replays of the other graph move the buffer's state on
            steps[1].replay_seconds(2)
        x = rng.standard_normal((1, 8)).astype(np.float32)
        args = state if isinstance(state, list) else [state]
        if t == 10:  # the other graph's replay fails after its launch, given the same state
            _fail_after_launch(steps[1], cp.asarray(-x), *args)
        want = plain(k, x, acc, n)
        captures = steps[k].captures
        out, copies = _copied_in(steps[k], cp.asarray(x), *args)
        assert [np.array_equal(cp.asnumpy(o), w) for o, w in zip(out, want)] == [True] * 2, t
        state_at = next(iter(family.values())).offs[1] if len(family) else None  # where the state starts
        if not isinstance(out, graphs.Outputs):  # eager: no buffer copied into
            assert not copies, (t, copies)
        elif isinstance(args[0], graphs.Span) and t not in (7, 9, 10) and steps[k].captures == captures:
            assert copies and max(end for _, end in copies) <= state_at, (t, copies)  # the state in place: x alone
        else:  # a capture, a restore, a bare or failed replay before, or the state an eager call returned
            assert max(end for _, end in copies) > state_at, (t, copies)
        state = out[:] if isinstance(out, graphs.Outputs) else list(out)
        held.append(state)
        acc, n = want
        history.append(want)
    assert [s.captures for s in steps.values()] == [1, 1] and len(family) == 1
    assert {id(g.ins) for s in steps.values() for g in s._graphs.values()} == {id(next(iter(family.values())))}
    assert in_place == [False, True, False, True]  # each graph's eager call, then its capture
    for t, (out, want) in enumerate(zip(held, history)):  # every replay's outputs are still what it returned
        assert [np.array_equal(cp.asnumpy(o), w) for o, w in zip(out, want)] == [True] * 2, t
    steps.clear()
    gc.collect()
    assert len(family) == 0  # the buffer went with the graphs


@pytest.mark.gpu
def test_cupy_fetch_and_the_device_argmax():
    """CuPy's fetch: results read in any order after more fetches of the same shape than it keeps buffers for (an
    unread result is read before its buffer is reused); the greedy token chosen on the device is the host's argmax
    (NaN never, ties to the first, excluded ids never, every logit at -inf or below -1e30: token 0), and ds4's default
    rule's draw is the host's, neither waiting for the device."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp
    import cupyx

    from ds4lab.backends.cupy_backend import FETCH_BUFFERS, CupyBackend
    from ds4lab.sampling import Rng, argmax, argmax_on_device, sample, sample_on_device

    backend = CupyBackend()
    rows = [np.random.default_rng(i).standard_normal((1, 300)).astype(np.float32) for i in range(2 * FETCH_BUFFERS + 1)]
    fetched = [backend.fetch(cp.asarray(r)) for r in rows]
    assert all(np.array_equal(f.result(), r) for f, r in zip(fetched[::-1], rows[::-1]))
    cases = [np.array([[1.0, np.nan, 3.0, 3.0, -2.0]], np.float32), np.full((1, 4), -np.inf, np.float32),
             np.array([[-1e31, -2e30, np.nan, -1e30]], np.float32), rows[0]]
    for logits in cases:
        for exclude in (np.zeros(0, np.int64), np.array([2, 3])):
            host = logits.copy()
            host[0, exclude] = -np.inf
            with cupyx.allow_synchronize(False):
                got = argmax_on_device(cp, cp.asarray(logits), cp.asarray(exclude.astype(np.int32)))
            assert got.dtype == cp.int32 and int(got[0]) == argmax(host[0]), (logits, exclude)
    rng = np.random.default_rng(4)
    for seed in range(1, 41):  # the parallel sums may round a draw at a boundary the other way: about 1e-5 a row
        logits = (rng.standard_normal((1, 129_280)) * 3).astype(np.float32)
        u = np.float32(Rng(seed).uniform())
        with cupyx.allow_synchronize(False):
            got = sample_on_device(cp, cp.asarray(logits), u, 1.0, 0.05, cp.asarray(np.array([7], np.int32)))
        host = logits[0].copy()
        host[7] = -np.inf
        assert int(got[0]) == sample(host, temperature=1.0, top_k=0, top_p=1.0, min_p=0.05, rng=Rng(seed)), seed


@pytest.mark.gpu
def test_cupy_branch_runs_after_its_fork_and_before_the_join():
    """A branch's launches see what the current stream wrote before the fork (a long chain of launches writes
    x last), and what follows the join sees the branch's results; eagerly and in a CUDA graph's replays."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import cupy as cp

    from ds4lab.cuda.branches import Branch
    from ds4lab.cuda.graphs import GraphStep

    def fn(x, v):
        x = x.copy()
        for _ in range(50):  # keeps the current stream busy when the branch is made
            x = x * 1.0 + 0.0
        x[...] = v
        side = Branch()
        with side:
            y = x * 2.0
            for _ in range(50):
                y = y + 1.0
        z = x * 3.0
        side.join()
        return (y + z,)

    step = GraphStep(fn)
    x = cp.zeros((1 << 20,), dtype=cp.float32)
    for i in range(4):  # eager, capture, two replays
        v = cp.asarray(np.float32(i + 1))
        out = step(x, v)[0]
        assert float(cp.abs(out - (5.0 * (i + 1) + 50.0)).max()) == 0.0, i
    assert step.captures == 1 and not step.failures


@pytest.mark.gpu
def test_cupy_branch_kernels_keep_the_side_streams_priority_in_a_graph():
    """A kernel launched in a branch carries the device's highest stream priority into a captured graph (the node
    attribute that a graph instantiated with USE_NODE_PRIORITY runs it at), the main stream's kernels the default
    0; the graph instantiated so (driver.GraphExec) replays to the right values."""
    found, why = _cupy_kernels()
    if found is None:
        pytest.skip(why)
    import ctypes

    import cupy as cp

    from ds4lab.cuda import driver
    from ds4lab.cuda.branches import Branch

    lib, ref = driver.libcuda(), ctypes.byref
    least, greatest = ctypes.c_int(), ctypes.c_int()
    driver.check(lib.cuCtxGetStreamPriorityRange(ref(least), ref(greatest)), "cuCtxGetStreamPriorityRange")
    assert greatest.value < least.value == 0  # a device whose streams have no priorities could not show anything
    x = cp.arange(4096, dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        y = x * 2.0
        side = Branch()
        with side:
            z = x + 1.0
        side.join()
        w = y + z
        graph = cp.cuda.runtime.streamEndCapture(stream.ptr)
    count = ctypes.c_size_t(0)
    driver.check(lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    driver.check(lib.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ref(count)), "cuGraphGetNodes")
    priorities = []
    for node in nodes:
        kind = ctypes.c_int()
        driver.check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ref(kind)), "cuGraphNodeGetType")
        if kind.value == 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            value = (ctypes.c_int * 16)()  # CUlaunchAttributeValue: a 64-byte union, the priority its first int
            driver.check(lib.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), 8, value),  # ..._PRIORITY
                         "cuGraphKernelNodeGetAttribute")
            priorities.append(value[0])
    assert sorted(priorities) == [greatest.value, 0, 0]
    exe = driver.GraphExec(graph)
    w[...] = 0
    exe.launch(stream)
    stream.synchronize()
    assert float(cp.abs(w - (3.0 * x + 1.0)).max()) == 0.0


@pytest.mark.parametrize("backend", [pytest.param("cupy", marks=pytest.mark.gpu),
                                     pytest.param("mlx", marks=pytest.mark.gpu), "emulated"])
def test_every_short_chunk_length_runs(model_paths, backend):
    """A first chunk of every length 1…40, then a second chunk of the same length: up to DEVICE_ROUTING_ROWS
    tokens route on the device, and once tokens × experts passes KERNEL_MAX_ROWS their pairs must not go to a
    launch planned from host ids (CuPy raised on ``np.asarray`` of the device ids; the emulator marks its
    device arrays so it raises too). Each chunk's next-token logits against float64's one-shot logits. The
    emulator (3.4 s a chunk) runs the lengths around the edges for nano's 2 experts a token: 8 tokens make 16
    pairs, 16 tokens are the most that route on the device."""
    ref = ds4lab.load(model_paths["nano"], backend="numpy", numerics="exact")
    gpu = _gpu_model_or_skip(model_paths["nano"], backend, "exact", True)
    ids = np.random.default_rng(11).integers(0, ref.config.n_vocab - 7, 80)
    want = ref.logits(ids)
    for n in (1, 8, 9, 16, 17) if backend == "emulated" else range(1, 41):
        sess = gpu.session(ctx=128, prefill_chunk=64)
        sess.prefill(ids[:n]).run(progress=False)
        got = [sess.logits]
        sess.sync(ids[:2 * n])  # a chat turn's n more tokens: a chunk that extends the live state
        got.append(sess.logits)
        err = rel_err(np.stack(got), want[[n - 1, 2 * n - 1]])
        assert err.max() < 1e-3, (n, err)


def test_a_graph_capture_holds_the_plans_it_reads():
    """A captured CUDA graph reads its launch plans at every replay; the launchers' caches evict them (64 small
    plans, the last large one), and a plan freed under a graph made the H200 fault ("illegal address") once
    chunks of many lengths had run in one process. ``holding`` collects what a capture reads, evictions
    included."""
    from ds4lab.mlx_kernels import launches

    found, why = _emulated_kernels()
    if found is None:
        pytest.skip(why)
    kernels = found[0]
    with launches.holding() as held:
        small = kernels._plan(np.array([3, 1, 3]), 3, 8)
        large = kernels._plan(np.arange(100) % 5, 100, 8)
    for e in range(launches.PLANS_KEPT + 1):  # evict both from the caches
        kernels._plan(np.array([e]), 1, 8)
    kernels._plan(np.arange(100) % 7, 100, 8)
    assert all(v is not small for v in kernels._gathered.values())
    assert all(v is not large for v in kernels._chunk_plan.values())
    assert any(h is small for h in held) and any(h is large for h in held)
    with launches.holding() as outer:
        kernels._host_int(123456)
        with launches.holding() as inner:
            kernels._host_int(7)
    assert len(inner) == 1 and len(outer) == 1 and launches._held is None
