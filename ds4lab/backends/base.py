"""What the backends share: :class:`Backend`, the defaults of the backend protocol (see :mod:`ds4lab.backends`),
and :class:`BlockBackend`, the float32 backend whose kernels run GGUF weights in their block form (CuPy, and
the CPU emulator's backend). A backend is an array library with linears, compilation and uploads; which op
runs a kernel is :mod:`ds4lab.ops`'s choice, not the backend's."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..mlx_kernels import layout
from ..quants import dequantize
from .block_weights import KERNEL_TYPES, BlockEmbedding, BlockLinear, StackedBlockLinear


class Fetched:
    """An array's host copy, made when ``result()`` is first asked for (the backend evaluates it then)."""

    def __init__(self, backend, x):
        self.backend, self.x, self.value = backend, x, None

    def result(self) -> np.ndarray:
        if self.value is None:
            self.backend.eval(self.x)
            self.value, self.x = np.asarray(self.backend.to_numpy(self.x)), None
        return self.value


class InOrder:
    """A branch whose work runs in order with the rest (:meth:`Backend.branch`): ``with``, ``after`` and ``join`` do
    nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def after(self, other) -> None:
        pass

    def join(self) -> None:
        pass


IN_ORDER = InOrder()


class Backend:
    """The protocol's defaults. ``kernels`` is None here: a backend with ds4lab's kernels has them there
    (an object of :class:`ds4lab.mlx_kernels.launches.KernelLaunches`)."""

    kernels = None
    # Whether work is queued on a device while the host goes on: a step launched before the previous one's results
    # are read runs while the host works on them (Decode's greedy steps, ds4lab.session).
    asynchronous = False
    # Whether a session's default prefill chunk is ds4's later one (4096, kv/layout.LONG_CHUNK): for a backend whose
    # long chunks run eagerly, not padded to the step.
    long_prefill_chunks = False

    def fetch(self, x) -> Fetched:
        """``x`` on the host, as ``fetch(x).result()``: where launches are asynchronous its copy is queued now, so that
        work queued after this call does not delay it."""
        return Fetched(self, x)

    def branch(self):
        """Work that may run beside what is launched after it: launches made inside ``with branch:`` need only what
        was launched before the branch was made, and what is launched after ``branch.join()`` may read their
        results; ``branch.after(other)``: what is launched inside it from then on may read what ``other`` (another
        branch) was given so far. Here everything runs in order (:data:`IN_ORDER`); CuPy runs a branch on a side
        stream."""
        return IN_ORDER

    def device_key(self):
        """Which device arrays made now land on (None: the backend has one memory)."""
        return None

    def scope(self):
        """The context the model's work runs in, so that a model keeps the device it was loaded for whatever the
        process's default becomes (MLX: the stream of its device). Nothing here."""
        return nullcontext()

    def donated(self, x) -> bool:
        """Whether ``x`` is a state array only the step being traced holds (a CUDA graph's own copy, see
        :mod:`ds4lab.cuda.graphs`), which an op may then update in place. Never here: every op makes new arrays."""
        return False

    def device_bytes(self, raw):
        """GGUF bytes ``raw`` (uint8, host) as a device array, for the kernels that read weights in block form."""
        return self.xp.asarray(raw)

    def block_bytes(self, raw, qtype):
        """GGUF rows ``raw`` (uint8, host) on the device in the kernels' layout (:func:`.layout.blocks`: the
        tiles made there from the uploaded bytes, and evaluated now, not by the first step that reads them)."""
        out = layout.blocks(self.device_bytes(raw), qtype, self.xp)
        self.eval(out)
        return out

    def constant(self, a: np.ndarray):
        """A host array every step reads (a weight vector, a table) as a backend array: floats as :meth:`asarray`
        makes them, other types as they are."""
        return self.asarray(a) if a.dtype.kind == "f" else self.xp.asarray(a)

    def embedding(self, raw, qtype, ne0: int):
        """``tokens -> rows`` of the token embedding ``raw [vocab, row_bytes]``: decoded on the host, uploaded; with
        kernels a :class:`BlockEmbedding`, which also looks a compiled step's device ids up on the device."""
        def host(tokens):
            return self.asarray(dequantize(raw[tokens], qtype, ne0))

        return host if self.kernels is None else BlockEmbedding(self, raw, qtype, ne0, host)

    def block_linear(self, raw, qtype, ne0: int) -> BlockLinear | None:
        """``raw [rows, row_bytes]`` in block form on the device, multiplied by ds4lab's kernels (a backend's
        ``linear`` with kernels); None without a kernel for it."""
        if self.kernels is None or Q(qtype) not in KERNEL_TYPES:
            return None
        return BlockLinear(self.kernels, self.block_bytes(raw, qtype), qtype, ne0, raw.shape[0])

    def stacked_linear(self, raw, qtype, ne0: int) -> StackedBlockLinear | None:
        """Every matrix of ``raw [n, rows, row_bytes]`` (the experts of a routed-expert tensor, the groups of
        attn_output_a) in block form on the device, multiplied in one launch; None without a kernel for it."""
        if self.kernels is None or Q(qtype) not in KERNEL_TYPES:
            return None
        return StackedBlockLinear(self.kernels, self.block_bytes(raw, qtype), qtype, ne0, raw.shape[1])

    # Whether a chunk's RoPE rows are gathered on the device (:meth:`rope_rows`) instead of uploaded from the host.
    gathers_rope_rows = False

    def rope_rows(self, params, positions: np.ndarray, on_device):
        """``(cos, sin)`` rows of ``params``'s RoPE tables at ``positions`` (host int array; ``on_device`` the same
        uploaded), gathered on the device from a copy of the tables kept there (where :attr:`gathers_rope_rows`)."""
        raise NotImplementedError(f"the {self.name} backend uploads RoPE rows from the host")

    def upload(self, arrays: list[np.ndarray]) -> list:
        """Host arrays as backend arrays: floats as :meth:`asarray` makes them, integers as int32."""
        return [self.asarray(a) if a.dtype.kind == "f" else self.xp.array(np.asarray(a, dtype=np.int32))
                for a in arrays]


class BlockBackend(Backend):
    """A float32 backend over an array library ``xp`` whose ``kernels`` run GGUF weights in block form:
    the CuPy backend, and the CPU emulator's backend the tests run the kernels' wiring with. Without
    kernels (``kernels`` None) every weight is dequantized to float32 and every op is plain."""

    np_dtype = np.float32
    can_compile = False

    def asarray(self, a):
        return self.xp.asarray(np.asarray(a, dtype=np.float32))

    def to_numpy(self, x):
        return np.asarray(x)

    def linear(self, raw, qtype, ne0: int):
        blocks = self.block_linear(raw, qtype, ne0)
        if blocks is not None:
            return blocks
        weight_t = self.xp.asarray(dequantize(raw, qtype, ne0)).T
        return lambda x: x @ weight_t

    def index_add(self, acc, rows, values):
        acc[self.xp.asarray(rows)] += values  # rows are distinct
        return acc

    def eval(self, *xs):
        pass
