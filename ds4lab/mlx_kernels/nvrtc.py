"""Compiled kernels for MLX's CUDA back-end: each kernel's CUDA rendering compiled by NVRTC to a cubin for
the GPU, in parallel threads, and kept on disk by a digest of its source, the architecture and NVRTC's
version, so only the first process after a change compiles.

``mx.fast.cuda_kernel`` would compile each kernel in the first launch that uses it, one after another,
with MLX's own headers, again in every fresh process (its cost on an H200: benchmarks/README.md).
The cubins here go to ``mx.fast.precompiled_cuda_kernel`` instead. MLX-CUDA needs NVRTC and the driver
itself, so both libraries are there wherever this runs."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from .build_cache import kept
from .dialects import cuda_module_source

_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}


def _loaded(name: str) -> list[str]:
    """Paths of the shared libraries called ``name`` that this process has mapped (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if f"/{name}" in line})
    except OSError:
        return []


def _cuda_homes() -> list[str]:
    return [h for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if h]


@lru_cache(maxsize=None)
def _nvrtc() -> ctypes.CDLL:
    candidates = _loaded("libnvrtc.so")  # the one MLX loaded, when it has
    if found := ctypes.util.find_library("nvrtc"):
        candidates.append(found)
    candidates += glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "*", "lib",
                                         "libnvrtc.so*"))
    for home in _cuda_homes():
        candidates += glob.glob(os.path.join(home, "lib64", "libnvrtc.so*"))
    tried = []
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise RuntimeError("NVRTC (libnvrtc.so) was not found; MLX-CUDA needs it. Tried: " + ("; ".join(tried) or "none"))


def _include_dirs() -> list[str]:
    """Where cuda_fp16.h can come from: the CUDA toolkit, where MLX's own NVRTC compiles look too."""
    dirs = dict.fromkeys(os.path.realpath(os.path.join(h, "include")) for h in _cuda_homes())
    return [d for d in dirs if os.path.isfile(os.path.join(d, "cuda_fp16.h"))]


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def device_arch(index: int = 0) -> str:
    """``sm_<major><minor>`` of CUDA device ``index``, from the driver."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    for rc in (cuda.cuInit(0), cuda.cuDeviceGet(ctypes.byref(dev), index),
               cuda.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev),
               cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev)):
        if rc:
            raise RuntimeError(f"the CUDA driver could not describe device {index} (error {rc})")
    return f"sm_{major.value}{minor.value}"


def compile_cubin(source: str, arch: str, what: str = "ds4lab kernels") -> bytes:
    """NVRTC's cubin of ``source`` for ``arch``; a failed compile raises with NVRTC's log."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()

    def check(rc, call):
        if rc:
            raise RuntimeError(f"NVRTC {call} failed for {what}: {lib.nvrtcGetErrorString(rc).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"ds4lab.cu", 0, None, None), "create")
    try:
        options = [f"--gpu-architecture={arch}", "--std=c++17", *(f"--include-path={d}" for d in _include_dirs())]
        encoded = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        if lib.nvrtcCompileProgram(prog, len(options), encoded):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {what} for {arch}:\n{log.value.decode()[-4000:]}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "GetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "GetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cubins(specs, arch: str) -> dict[str, bytes]:
    """{kernel name: cubin} for ``specs``: kept on disk (:func:`.build_cache.kept`), or compiled in parallel
    threads (ctypes lets go of the GIL while NVRTC works)."""
    version = nvrtc_version()

    def cubin(spec) -> bytes:
        source = cuda_module_source([spec])
        key = hashlib.sha1(f"{arch} {version} {source}".encode()).hexdigest()[:16]
        path = kept(f"ds4lab-cubin-{spec.name}-{key}.cubin", lambda: compile_cubin(source, arch, spec.name))
        return path.read_bytes()

    specs = list(specs)
    with ThreadPoolExecutor(max_workers=min(len(specs), os.cpu_count() or 1)) as pool:
        return dict(zip((s.name for s in specs), pool.map(cubin, specs)))
