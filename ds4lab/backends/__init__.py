"""Backends: one small ops protocol, several array libraries.

The model is written against an array namespace ``xp`` (the common subset of numpy and mlx.core) plus
the few operations below whose spelling differs between libraries or that touch quantized weights.

    name, xp, dtype, np_dtype         the library, its float type (float64 for numpy, float32 for mlx)
    asarray(np_array)                 host → backend, cast to ``dtype``
    to_numpy(x)                       backend → host
    linear(raw, qtype, ne0)           a callable ``x -> x @ Wᵀ`` over a GGUF weight ``raw [out, row_bytes]``
    index_add(acc, rows, values)      ``acc[rows] += values`` (rows are distinct host ints)
    eval(*xs)                         force evaluation (a no-op where arrays are eager)
    can_compile, compile(fn)          whether and how a function of arrays is traced once and reused (a slice
                                      of a CuPy graph's outputs that is not a tuple is one argument: a Span)
    compiled_rows, compiles_ffn       (compiling backends) the largest chunk compiled; whether the FFN half is
    upload(host_arrays)               host arrays as backend arrays (floats as ``asarray``, integers int32),
                                      in one transfer where the backend can
    embedding(raw, qtype, ne0)        a callable ``tokens -> rows`` of the token embedding (block backends decode
                                      a chunk's rows on the device)

and, from :class:`.kernel_ops.KernelOps`, the model ops that run through ds4lab's kernels where the
backend has them (``kernels``; GPU backends) and through plain ops elsewhere:

    attend, rope, rmsnorm, hc_pre, hc_post, store_kv, hadamard_fp4, compress_chunk, indexer_scores, indexer_allowed
    swiglu, moe_route                         the experts' SwiGLU; a decode step's routing on the device
    add_ape, append_rows, ring_write,         the KV state's bookkeeping: one launch each with kernels
    compressed_visible
    stacked_linear(raw, qtype, ne0)           stacked matrices in block form, one launch (None: no kernel)
"""

from __future__ import annotations

BACKENDS = ("mlx", "numpy", "cupy")
PREFILL_MATMULS = ("float32", "tf32")


def get_backend(name: str, device: str | None = None, kernels: bool | None = None, prefill_matmul: str = "float32"):
    """``kernels`` (GPU backends): use ds4lab's kernels; None means yes on a GPU. ``prefill_matmul``: see
    :func:`ds4lab.load`."""
    if prefill_matmul not in PREFILL_MATMULS:
        raise ValueError(f"unknown prefill_matmul {prefill_matmul!r}; choose one of {', '.join(PREFILL_MATMULS)}")
    if prefill_matmul != "float32" and (name != "cupy" or kernels is False):
        raise ValueError(f"prefill_matmul={prefill_matmul!r} needs the cupy backend with its kernels "
                         f"(got backend={name!r}, kernels={kernels!r})")
    if name == "numpy":
        if kernels:
            raise ValueError("the numpy backend has no kernels; kernels=True needs mlx on a GPU or cupy")
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "mlx":
        from .mlx_backend import MLXBackend

        return MLXBackend(device, kernels)
    if name == "cupy":
        try:
            from .cupy_backend import CupyBackend
        except ImportError as e:
            raise ValueError(f"the cupy backend needs CuPy and a CUDA GPU ({e}); install ds4lab[cuda]") from e
        return CupyBackend(device, kernels is not False, prefill_matmul == "tf32")
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
