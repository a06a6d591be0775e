"""The kernels run on a CPU: the bodies rendered in the "cpu" dialect, compiled with a C++20 compiler
into a shared library and launched through ctypes over NumPy arrays. A work-group's threads are fibers
with real barriers between them (see ``dialects._CPU_LAUNCH``), so the bodies' logic (indexing, SIMD
reductions, barriers, the numerics) is tested on every CPU run of the suite; speed is not the point."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import weakref
from functools import lru_cache
from pathlib import Path

import numpy as np

from . import specs as S
from .build_cache import kept
from .dialects import cpu_module_source
from .launches import ArrayLaunches

# Fortified longjmp refuses to jump between stacks, which is how the emulator's fibers switch; qgemm keeps
# IQ2_XXS's tables as words in its float array, as the GPU dialects allow.
FLAGS = ("-std=c++20", "-O2", "-shared", "-fPIC", "-U_FORTIFY_SOURCE", "-fno-strict-aliasing")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def compile_module(specs) -> ctypes.CDLL:
    """The emulator's library for ``specs``, compiled once per source, compiler and flags (:func:`kept`)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the CPU kernel emulator needs a C++20 compiler (g++ or clang++; or set CXX)")
    source = cpu_module_source(specs)
    digest = hashlib.sha1(" ".join([cxx, *FLAGS, source]).encode()).hexdigest()[:16]

    def build() -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "kernels.cpp", Path(tmp) / "kernels.so"
            src.write_text(source)
            run = subprocess.run([cxx, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"compiling the CPU kernels failed:\n{run.stderr[-4000:]}")
            return out.read_bytes()

    return ctypes.CDLL(str(kept(f"ds4lab-cpu-kernels-{digest}.so", build)))


def launch(lib: ctypes.CDLL, spec, grid, threads: int, args) -> None:
    """Run ``spec``'s kernel over ``grid`` work-groups of ``threads`` threads; ``args`` are its inputs
    then its outputs, C-contiguous NumPy arrays."""
    if not all(a.flags.c_contiguous for a in args):  # the launchers pass contiguous arrays only
        raise ValueError(f"{spec.name}: every argument must be a C-contiguous array")
    if spec.launch_bounds and threads > spec.launch_bounds[0]:  # CUDA would refuse the launch
        raise ValueError(f"{spec.name}: {threads} threads a group, past its launch bounds' {spec.launch_bounds[0]}")
    for (name, dtype), a in zip((*spec.inputs, *spec.outputs), args):  # a GPU would read the bytes as they are
        if a.dtype != np.dtype(dtype):
            raise TypeError(f"{spec.name}: argument {name} is {a.dtype}, the kernel reads {dtype}")
    pointers = (ctypes.c_void_p * len(args))(*[a.ctypes.data for a in args])
    getattr(lib, f"launch_{spec.name}")(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(threads),
                                        pointers)


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    return compile_module(S.all_specs())


class DeviceArray(np.ndarray):
    """A kernel's output: NumPy, but marked as "on the device", so that code which may only take host arrays
    (a launch plan, ``np.asarray`` on CuPy) fails on the emulator as it fails on a GPU."""


class CheckedBranch:
    """The emulator's branch (``ops.branch``): its launches run in order, and each launch is checked against the rules
    a side stream's work must keep on a GPU (:mod:`ds4lab.cuda.branches`): inside the branch, no input made on
    another stream after the fork unless made in a branch it was ordered ``after()`` since; elsewhere, no input the
    branch made unless its ``join()`` came first. A branch made inside another is forked from that one's stream and
    joins into it, so what it makes reaches the main stream once both have joined, in that order. An input is traced
    to the kernel output whose memory it views (NumPy's views and contiguous copies share it); arrays made by
    array-library operations are not traced. The check is conservative (an ``after()`` covers the other branch's own
    launches, not those of branches joined into it) and leaves out CuPy's pool (an array freed while another stream
    may still read it: :mod:`ds4lab.cuda.branches`)."""

    def __init__(self, kernels: "CpuKernels"):
        self.kernels, self.fork = kernels, kernels.clock
        self.parent = kernels.entered[-1] if kernels.entered else None  # the branch it was forked from, or None
        self.joined_at = None  # when it last joined (kernels.clock)
        self.waits: list[tuple[CheckedBranch, int]] = []  # (other, clock): after(other) at that time

    def __enter__(self):
        self.kernels.entered.append(self)
        return self

    def __exit__(self, *exc):
        self.kernels.entered.pop()
        return False

    @property
    def joined(self) -> bool:
        return self.joined_at is not None

    def after(self, other: "CheckedBranch") -> None:
        self.kernels.clock += 1
        self.waits.append((other, self.kernels.clock))

    def join(self) -> None:
        self.kernels.clock += 1
        self.joined_at = self.kernels.clock


BEFORE_JOIN = " reads an output of a branch (ops.branch) before its join"
AFTER_FORK = ", inside a branch, reads an array made after the branch's fork"


def _unordered(branch: CheckedBranch | None, made: int, here: CheckedBranch | None) -> str | None:
    """Why a launch in ``here`` (None: the main stream) may not read what ``branch`` (None: the main stream) made at
    ``made`` (:data:`BEFORE_JOIN` or :data:`AFTER_FORK`), or None. It may once that work is on a stream ``here``
    descends from (``branch`` joined its parent after it, the parent its own after that, and so on) before the fork
    on ``here``'s way from that stream."""
    if here is not None and any(other is branch and made < t for other, t in here.waits):
        return None  # here.after(branch) came after it was made
    path, b = [], here  # here, then the branches it was forked from, outwards
    while b is not None:
        path.append(b)
        b = b.parent
    after = made
    while branch is not None and branch not in path:
        if branch.joined_at is None or branch.joined_at <= after:
            return BEFORE_JOIN
        branch, after = branch.parent, branch.joined_at
    if branch is here:
        return None
    child = path[-1] if branch is None else path[path.index(branch) - 1]  # forked from the stream reached
    if after <= child.fork:
        return None
    return AFTER_FORK if after == made else BEFORE_JOIN  # no join on the way: made there after the fork


def _owner(a):
    """The array that owns ``a``'s memory (NumPy points every view at it)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


class CpuKernels(ArrayLaunches):
    """The kernels' launches with NumPy arrays, executed by the CPU emulator."""

    xp = np
    wide_group = S.ROW_GROUP  # wider groups cost the emulator time and test nothing new

    def __init__(self):
        self.lib = _library()
        self.clock = 0  # launches and branches' joins so far: the time of each (CheckedBranch)
        self.entered: list[CheckedBranch] = []  # the branches whose ``with`` the launches are inside
        self._made: dict[int, tuple] = {}  # id of an output's memory owner -> (weakref to it, launch number, branch)
        super().__init__()

    def _launch(self, spec, grid, threads, args):
        launch(self.lib, spec, grid, threads, args)

    def _run(self, spec, groups, threads, inputs, outputs):
        here = self.entered[-1] if self.entered else None
        for a in inputs:
            owner = _owner(a)
            made = self._made.get(id(owner))
            if made is None or made[0]() is not owner:
                continue
            why = _unordered(made[2], made[1], here)
            if why is not None:
                raise RuntimeError(spec.name + why)
        self.clock += 1
        outs = super()._run(spec, groups, threads, inputs, outputs)
        for out in outs:
            owner = _owner(out)
            try:
                ref = weakref.ref(owner, lambda _, key=id(owner): self._made.pop(key, None))
            except TypeError:  # memory owned by an object that takes no weak reference: not traced
                continue
            self._made[id(owner)] = (ref, self.clock, here)
        return [out.view(DeviceArray) for out in outs]
