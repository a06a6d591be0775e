"""One kernel body, two languages: the dialect preludes that map the portable names onto CUDA or Metal.

A body (``sources/*.body``) is the inside of a kernel function. It uses

    GROUP_ID_X, GROUP_ID_Y     the work-group's index in the grid (CUDA blockIdx, Metal threadgroup position)
    THREAD_IN_GROUP            the thread's index in its 1-D group (threadIdx.x / thread_position_in_threadgroup.x)
    GROUP_THREADS              the group's size
    GROUP_SHARED, GROUP_BARRIER()   group-shared memory and the barrier over it
    GLOBAL                     the address space of kernel arguments (empty in CUDA, ``device`` in Metal)
    simd_sum_f(x), simd_max_f(x), load_half(p), f16_round(x), DEVICE_FN    from the dialect header

plus the kernel's own constants (``defines``), which become ``#define`` lines before the body. A SIMD
group is 32 threads in both languages (a CUDA warp, an Apple simdgroup). Everything else is the
common subset of CUDA C++ and the Metal Shading Language: scalar types, ``uint``, ``float(x)``
casts, ``exp``/``max``/``min``, arrays, loops.

``KernelSpec.mlx_source(dialect)`` gives the (header, source) pair for ``mx.fast.cuda_kernel`` or
``mx.fast.metal_kernel`` (MLX writes the signature from the input and output names);
``cuda_module_source(specs)`` gives one translation unit with full ``extern "C"`` signatures for CuPy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SOURCES = Path(__file__).parent / "sources"
DIALECTS = ("cuda", "metal")

_COMMON_HEADER = "#define NEG_BIG (-3.0e38f)\n"

CUDA_HEADER = _COMMON_HEADER + """#include <cuda_fp16.h>
#define GLOBAL
#define DEVICE_FN __device__ inline
typedef unsigned int uint;
DEVICE_FN float load_half(const uint8_t* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }
DEVICE_FN float simd_sum_f(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
DEVICE_FN float simd_max_f(float x) {
    for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
DEVICE_FN float f16_round(float x) { return __half2float(__float2half_rn(x)); }
"""

METAL_HEADER = _COMMON_HEADER + """#define GLOBAL device
#define DEVICE_FN inline
DEVICE_FN float load_half(const device uint8_t* p) { return float(*(const device half*)p); }
DEVICE_FN float simd_sum_f(float x) { return simd_sum(x); }
DEVICE_FN float simd_max_f(float x) { return simd_max(x); }
DEVICE_FN float f16_round(float x) { return float(half(x)); }
"""

# Metal's ids are kernel attributes; MLX adds the ones a source mentions to the signature it writes.
_IDS = {
    "cuda": {
        "GROUP_ID_X": "blockIdx.x",
        "GROUP_ID_Y": "blockIdx.y",
        "THREAD_IN_GROUP": "threadIdx.x",
        "GROUP_THREADS": "blockDim.x",
        "GROUP_SHARED": "__shared__",
        "GROUP_BARRIER()": "__syncthreads()",
    },
    "metal": {
        "GROUP_ID_X": "threadgroup_position_in_grid.x",
        "GROUP_ID_Y": "threadgroup_position_in_grid.y",
        "THREAD_IN_GROUP": "thread_position_in_threadgroup.x",
        "GROUP_THREADS": "threads_per_threadgroup.x",
        "GROUP_SHARED": "threadgroup",
        "GROUP_BARRIER()": "threadgroup_barrier(mem_flags::mem_threadgroup)",
    },
}

# Spellings that must not survive into the other language's source (checked by the tests).
CUDA_ONLY = ("__shared__", "__syncthreads", "threadIdx", "blockIdx", "blockDim", "__shfl", "__half",
             "__device__", "__global__", "reinterpret_cast")
METAL_ONLY = ("threadgroup", "thread_position_in", "simd_sum(", "simd_max(", "device ", "mem_flags", "(half(")

_C_TYPES = {"float32": "float", "uint8": "uint8_t", "int32": "int32_t"}


@dataclass(frozen=True)
class KernelSpec:
    """A kernel: its name, the body file, inputs and outputs as (name, dtype name), and constants."""

    name: str
    body: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    defines: dict = field(default_factory=dict)

    @property
    def input_names(self) -> list[str]:
        return [n for n, _ in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [n for n, _ in self.outputs]

    def body_source(self, dialect: str) -> str:
        """The body with the dialect's ids and the kernel's constants as ``#define`` lines."""
        if dialect not in DIALECTS:
            raise ValueError(f"unknown kernel dialect {dialect!r}; choose one of {', '.join(DIALECTS)}")
        defines = {**_IDS[dialect], **self.defines}
        head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
        tail = "".join(f"#undef {re.sub(r'[(].*', '', k)}\n" for k in defines)
        return head + (SOURCES / self.body).read_text() + tail

    def mlx_source(self, dialect: str) -> tuple[str, str]:
        """``(header, source)`` for ``mx.fast.cuda_kernel`` (dialect "cuda") or ``metal_kernel``."""
        return header(dialect), self.body_source(dialect)


def header(dialect: str) -> str:
    prelude = CUDA_HEADER if dialect == "cuda" else METAL_HEADER
    return prelude + (SOURCES / "common.h").read_text()


def cuda_module_source(specs) -> str:
    """One CUDA translation unit holding every kernel of ``specs`` with ``extern "C"`` signatures (CuPy)."""
    parts = ["typedef unsigned char uint8_t;\ntypedef int int32_t;\n", header("cuda")]
    for spec in specs:
        args = [f"const {_C_TYPES[t]}* __restrict__ {n}" for n, t in spec.inputs]
        args += [f"{_C_TYPES[t]}* __restrict__ {n}" for n, t in spec.outputs]
        parts.append(f'extern "C" __global__ void {spec.name}({", ".join(args)}) {{\n{spec.body_source("cuda")}}}\n')
    return "\n".join(parts)
