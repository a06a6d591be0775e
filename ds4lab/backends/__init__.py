"""Backends: several array libraries behind one small protocol.

The model is written against an array namespace ``xp`` (the common subset of numpy and mlx.core) plus
the few members below whose spelling differs between libraries or that touch quantized weights. Which
model op runs a kernel and which its reference formula is not a backend's business: :class:`ds4lab.ops.Ops`
decides that, from ``kernels``.

    name, xp, dtype, np_dtype         the library, its float type (float64 for numpy, float32 for mlx)
    asarray(np_array)                 host → backend, cast to ``dtype``
    to_numpy(x)                       backend → host
    linear(raw, qtype, ne0)           a callable ``x -> x @ Wᵀ`` over a GGUF weight ``raw [out, row_bytes]``
    block_linear(raw, qtype, ne0)     the same in block form through the kernels (None: no kernel for it)
    stacked_linear(raw, qtype, ne0)   stacked matrices in block form, one launch (None: no kernel for them)
    embedding(raw, qtype, ne0)        a callable ``tokens -> rows`` of the token embedding (backends with kernels
                                      decode a chunk's rows, and a compiled step's, on the device)
    index_add(acc, rows, values)      ``acc[rows] += values`` (rows are distinct host ints)
    eval(*xs)                         force evaluation (a no-op where arrays are eager)
    can_compile, compile(fn, carry,   whether and how a function of arrays is traced once and reused (a slice
      family)                         of a CuPy graph's outputs that is not a tuple is one argument: a Span);
                                      ``carry=(i, j)``: outputs j… are the next values of inputs i… (the state);
                                      ``family``: a mapping the calls sharing their inputs' buffers hold (CuPy)
    donated(x)                        whether ``x`` is a carried input of a step being traced, one that only the
                                      step holds, so that ops may write it in place (CuPy's graphs)
    asynchronous, fetch(x)            whether launches run beside the host (CuPy); ``fetch(x).result()`` is x on
                                      the host, its copy queued at the call where launches are asynchronous
    compiled_rows, compiles_ffn       (compiling backends) the largest chunk compiled; whether the FFN half is
                                      compiled too where its experts are routed on the device (a chunk of up
                                      to the model's DEVICE_ROUTING_ROWS rows: a decode step)
    upload(host_arrays)               host arrays as backend arrays (floats as ``asarray``, integers int32),
                                      in one transfer where the backend can
    device_key()                      which device arrays made now land on (None: one memory), for weight caches
    device_bytes(raw)                 GGUF bytes as a device array, for the kernels that read blocks
    block_bytes(raw, qtype)           the same in the kernels' layout (tiles: mlx_kernels.layout)
    kernels                           ds4lab's kernels on the current device (a
                                      :class:`ds4lab.mlx_kernels.launches.KernelLaunches`), or None

:mod:`.base` holds the defaults (:class:`.base.Backend`) and the block-form float32 backend CuPy and the
CPU emulator share (:class:`.base.BlockBackend`); :mod:`.block_weights` the weights kept on the device in
GGUF block form, some types' as tiles (``BlockLinear``, ``StackedBlockLinear``, ``BlockEmbedding``). No backend
imports the model.
"""

from __future__ import annotations

import re

BACKENDS = ("mlx", "numpy", "cupy")
PREFILL_MATMULS = ("auto", "float32", "tf32", "f16")
DECODE_MATMULS = ("float32", "q8")


def resolve_backend(name: str = "auto", device: str | None = None) -> str:
    """The backend that ``name`` means here: ``"auto"`` (the default of :func:`ds4lab.load` and of the
    ``--backend`` flag) becomes "mlx" on an Apple GPU (Metal), else "cupy" when CuPy finds a CUDA GPU, else "mlx"
    when MLX has one (its CUDA build), else "numpy". On NVIDIA GPUs CuPy's path comes first: its decode step ran
    about 2.6x faster than MLX-CUDA's on the same slice, without MLX's first-step trace
    (benchmarks/README.md, "mlx_decode_host.py"). MLX's Linux CPU build multiplies matrices with a reference
    BLAS, slower than NumPy's, so CPUs get NumPy. ``device`` steers it:
    "cpu" gives "numpy", "gpu" gives "mlx" (and needs MLX's GPU), "cuda:N" gives "cupy". Other names are
    returned as they are (checked: one of :data:`BACKENDS`), except that "mlx" with ``device="gpu"`` needs
    MLX's GPU."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose auto or one of {', '.join(BACKENDS)}")
    if device is not None and device not in ("cpu", "gpu") and not re.fullmatch(r"(cuda:)?\d+|cuda", str(device)):
        raise ValueError(f"unknown device {device!r}; choose cpu, gpu or cuda:N")
    if name == "numpy" and device not in (None, "cpu"):
        raise ValueError(f"device {device!r}: the numpy backend runs on the CPU")
    if name in ("numpy", "cupy") or (name == "mlx" and device != "gpu"):
        return name
    if name == "auto" and device == "cpu":
        return "numpy"
    if name == "auto" and isinstance(device, str) and device.startswith("cuda"):
        return "cupy"
    has_gpu = mlx_has_gpu()
    if device == "gpu" and not has_gpu:
        raise RuntimeError("device 'gpu': MLX has no GPU here (it needs Metal, or CUDA with mlx[cuda])")
    if device == "gpu" or (has_gpu and mlx_has_metal()):
        return "mlx"
    if cupy_has_gpu():
        return "cupy"
    return "mlx" if has_gpu else "numpy"


def mlx_has_gpu() -> bool:
    """Whether MLX is installed and has a GPU (Metal, or CUDA with mlx[cuda])."""
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()))
    except Exception:  # no MLX, one without these queries, or a CUDA query that fails: no GPU for auto
        return False


def mlx_has_metal() -> bool:
    """Whether MLX is installed and has an Apple GPU."""
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:  # no MLX, or one without the query
        return False


def cupy_has_gpu() -> bool:
    """Whether CuPy is installed and finds a CUDA GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, or no CUDA driver/device
        return False


def cuda_device_label(index: int, name: str | bytes | None) -> str:
    """How a run names CUDA GPU ``index``: ``cuda:0 (NVIDIA H200)`` (``name`` as the CUDA runtime reports it,
    bytes or text; just ``cuda:0`` without one)."""
    if isinstance(name, bytes):
        name = name.split(b"\0", 1)[0].decode("utf-8", errors="replace")
    name = (name or "").strip()
    return f"cuda:{index} ({name})" if name else f"cuda:{index}"


def device_label(backend) -> str:
    """Where ``backend`` computes, for a run's header: its ``device_label`` when it has one (CuPy:
    ``cuda:0 (NVIDIA H200)``), "gpu" for MLX's GPU device, else "cpu"."""
    label = getattr(backend, "device_label", None)
    if label:
        return str(label)
    where = str(getattr(backend, "device", "cpu")).lower()
    if "gpu" in where:
        return "gpu"
    return where if where.startswith("cuda") else "cpu"


def backend_label(backend) -> str:
    """``backend`` for a run's header: its name, where it computes, and "F16 prefill" (CuPy's default) or "TF32
    prefill" where a chunk's products run on reduced operands (see :func:`ds4lab.load`)."""
    operands = getattr(backend, "chunk_operands", "float32")
    reduced = f", {operands.upper()} prefill" if operands != "float32" else ""
    if getattr(backend, "decode_matmul", "float32") != "float32":
        reduced += f", {backend.decode_matmul.upper()} decode"
    return f"{backend.name} on {device_label(backend)}{reduced}"


def get_backend(name: str = "auto", device: str | None = None, kernels: bool | None = None,
                prefill_matmul: str = "auto", decode_matmul: str = "float32"):
    """The backend ``name`` (see :func:`resolve_backend` for "auto"). ``kernels`` (GPU backends): use
    ds4lab's kernels; None means yes on a GPU. ``prefill_matmul``, ``decode_matmul``: see :func:`ds4lab.load`."""
    asked = name
    name = resolve_backend(name, device)
    if prefill_matmul not in PREFILL_MATMULS:
        raise ValueError(f"unknown prefill_matmul {prefill_matmul!r}; choose one of {', '.join(PREFILL_MATMULS)}")
    if prefill_matmul == "auto":  # half operands where the kernels have them: logits within 2e-3 of float64 (tests)
        prefill_matmul = "f16" if name == "cupy" and kernels is not False else "float32"
    if prefill_matmul != "float32" and (name != "cupy" or kernels is False):
        chose = f" (auto chose {name})" if asked != name else ""
        raise ValueError(f"prefill_matmul={prefill_matmul!r} needs the cupy backend with its kernels "
                         f"(got backend={name!r}{chose}, kernels={kernels!r})")
    if decode_matmul not in DECODE_MATMULS:
        raise ValueError(f"unknown decode_matmul {decode_matmul!r}; choose one of {', '.join(DECODE_MATMULS)}")
    if decode_matmul != "float32" and (name != "cupy" or kernels is False):
        chose = f" (auto chose {name})" if asked != name else ""
        raise ValueError(f"decode_matmul={decode_matmul!r} needs the cupy backend with its kernels "
                         f"(got backend={name!r}{chose}, kernels={kernels!r})")
    if name == "numpy":
        if kernels:
            raise ValueError("the numpy backend has no kernels; kernels=True needs mlx on a GPU or cupy")
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "mlx":
        try:
            from .mlx_backend import MLXBackend
        except ImportError as e:  # no MLX wheel here (Windows, Pyodide) or an install without it
            raise ValueError(f"the mlx backend needs MLX ({e}); pip install mlx, or use backend='numpy' "
                             "(what backend='auto' picks without a GPU)") from e
        return MLXBackend(device, kernels)
    if name == "cupy":
        try:
            from .cupy_backend import CupyBackend
        except ImportError as e:
            raise ValueError(f"the cupy backend needs CuPy and a CUDA GPU ({e}); install ds4lab[cuda]") from e
        return CupyBackend(device, kernels is not False, prefill_matmul, decode_matmul)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
