"""Kernel launches written once: the host side shared by the CuPy launcher (:mod:`ds4lab.cuda.kernels`), MLX's
(:mod:`.fast`) and the CPU emulator (:mod:`.cpu`). A subclass says how to make arrays and how to run
one kernel; every method here plans a grid and the kernel's outputs. Weights arrive in the kernels' layout
(:func:`.layout.blocks`: GGUF's blocks, some types' regrouped into tiles)."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..arch import ROUTER_SUM_FLOOR, coff
from ..quants import iq2xxs_tables
from . import layout
from . import specs as S

PLANS_KEPT = 64  # gathered plans of up to PLAN_KEPT_PAIRS pairs kept, the most recently used
PLAN_KEPT_PAIRS = 64  # a decode step's sizes; a chunk's plans (thousands of pairs) never repeat
INTS_KEPT = 8  # host ints passed as kernel arguments (an eager step's position and length) kept, the most recent


_held: list | None = None  # while a CUDA graph is captured: the kept arrays its launches read (see holding)


@contextmanager
def holding():
    """Collect every kept launch array (plans, host ints) that launches read meanwhile. A captured CUDA graph
    reads them at each replay, long after the caches may have evicted them (a plan freed under a graph made the
    next replay fault), so the graph holds what this collects."""
    global _held
    outer, _held = _held, []
    try:
        yield _held
    finally:
        _held = outer


def _kept(cache: OrderedDict, key, make, limit: int):
    """``cache[key]``, made by ``make()`` when missing; only the ``limit`` most recently used entries stay
    (and whatever a graph being captured reads: :func:`holding`)."""
    if key in cache:
        cache.move_to_end(key)
    else:
        cache[key] = make()
        if len(cache) > limit:
            cache.popitem(last=False)
    if _held is not None:
        _held.append(cache[key])
    return cache[key]


def tf32_round(xp, x):
    """float32 ``x`` rounded to TF32 (10 mantissa bits, ties away from zero), as CUDA's ``cvt.rna.tf32``
    rounds the operands of a tensor-core product (NumPy or CuPy arrays)."""
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    return ((bits + xp.uint32(0x1000)) & xp.uint32(0xFFFFE000)).view(xp.float32)


def operand_round(xp, x, operands: str):
    """float32 ``x`` as a chunk product takes it: unchanged ("float32"), rounded to TF32, or to half ("f16",
    to nearest even, as CUDA's __float2half_rn)."""
    if operands == "tf32":
        return tf32_round(xp, x)
    if operands == "f16":
        return x.astype(xp.float16).astype(xp.float32)
    return x


class InPlaceError(ValueError):
    """An array given to an in-place kernel that it cannot write (a caller's mistake: raised, also in a capture)."""


def _check_in_place(name: str, x) -> None:
    """An in-place kernel writes ``x`` as contiguous float32 rows: anything else would be written wrong."""
    if str(x.dtype) != "float32" or not x.flags.c_contiguous:
        raise InPlaceError(f"{name} in place: the array must be contiguous float32, not {x.dtype} with strides "
                           f"{x.strides}")


def _splits(a) -> int:
    """The K splits of a product given as qmatmul's parts ``[S, rows, n]``; 1 for the product itself ``[rows, n]``."""
    return a.shape[0] if a.ndim == 3 else 1


class Columns(NamedTuple):
    """Columns ``lo:hi`` of the product whose K splits are ``parts [S, P, N]`` (qmatmul's with reduce False): one
    tensor's share of a stacked product (q_a's and kv_a's) for the kernels that add the splits as they read them
    (:meth:`KernelLaunches.rmsnorm`, :meth:`~KernelLaunches.rmsnorm_rope`), so no launch adds them first."""

    parts: object
    lo: int
    hi: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts.shape[1], self.hi - self.lo


class KernelLaunches:
    """Each method launches one kernel of :mod:`.specs`; launch constants (dims, dense qmatmul/qgemm plans)
    are made once and kept. ``xp`` is the subclass's array library.

    ``chunk_operands`` (``prefill_matmul``): "float32", or "tf32" / "f16": a chunk's products (:meth:`qgemm`,
    :meth:`dense_product`, :meth:`indexer_chunk`, :meth:`attend_chunk`) take their operands rounded to TF32 / half
    and accumulate in float32; decode-sized products stay float32.

    ``decode_matmul``: "float32", or "q8": the decode products (:meth:`qmatmul`) of Q8_0, IQ2_XXS and Q2_K weights
    quantize x to int8 per block as ds4's CPU and CUDA do (:data:`.specs.QUANT_X`) and sum in integers."""

    xp = None
    chunk_operands = "float32"
    decode_matmul = "float32"
    wide_group = 4 * S.ROW_GROUP  # threads of a row-wise kernel's group when rows are few (rmsnorm)

    def __init__(self):
        self.aux = self._array(iq2xxs_tables())
        self._consts: dict[tuple, object] = {}
        self._gathered: OrderedDict[tuple, tuple] = OrderedDict()  # kept gathered plans, least recent first
        self._chunk_plan: OrderedDict[tuple, tuple] = OrderedDict()  # the last large one: a layer's 3 projections
        self._ints: OrderedDict[int, object] = OrderedDict()  # kept host ints, least recent first

    # -- what a subclass provides ---------------------------------------------------------------------
    def _run(self, spec, groups: tuple[int, int], threads: int, inputs: list, outputs: list) -> list:
        """Run ``spec`` on ``groups`` work-groups of ``threads``; ``outputs`` are (shape, dtype name), or an array
        the kernel writes in place (the NumPy-interface launchers only)."""
        raise NotImplementedError

    def _array(self, a: np.ndarray):
        """A host array on the device."""
        raise NotImplementedError

    def _f32(self, x):
        """``x`` as contiguous float32."""
        raise NotImplementedError

    def _f16(self, x):
        """``x`` as contiguous float16 (rounded to nearest even)."""
        raise NotImplementedError

    def _product_operands(self, n_rows: int) -> str:
        """What a chunk's dense product of ``n_rows`` output rows multiplies: ``chunk_operands``, but float32 for
        few rows with half operands (:data:`.specs.FLOAT32_PRODUCT_ROWS`)."""
        if self.chunk_operands == "f16" and n_rows <= S.FLOAT32_PRODUCT_ROWS:
            return "float32"
        return self.chunk_operands

    def _chunk_x(self, x):
        """A chunk product's x as its kernel reads it: halves with half operands (rounded here, once, not by each
        work-group that reads it), else float32."""
        return self._f16(x) if self.chunk_operands == "f16" else self._f32(x)

    def _u8(self, x):
        """A mask (bool or integer) as uint8."""
        raise NotImplementedError

    def _i32(self, x):
        """Integers (a device array or a Python int) as an int32 array."""
        raise NotImplementedError

    def _bool(self, x):
        """A uint8 result as a boolean array."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------------
    def _const(self, *values, dtype=np.int32):
        key = (np.dtype(dtype).str, values)
        if key not in self._consts:
            self._consts[key] = self._array(np.array(values, dtype=dtype))
        return self._consts[key]

    def _host_int(self, value: int):
        """A host int as an int32 device array of one element. Kept like a constant, but only the INTS_KEPT
        most recent: the layers of an eager step share its position, and every position kept would grow
        without bound."""
        return _kept(self._ints, value, lambda: self._array(np.array([value], dtype=np.int32)), INTS_KEPT)

    @staticmethod
    def on_host(ids) -> bool:
        """Whether expert ids are a host array (NumPy's own type; the emulator marks its device arrays)."""
        return type(ids) is np.ndarray

    def _plan(self, experts: np.ndarray | None, n_pairs: int, size: int):
        """Device ``(order, batches, n_batches)`` of :func:`.specs.pair_batches`, planned on the host from host
        ids. Kept: the dense plan of each size, and the PLANS_KEPT most recent small gathered ones (a decode
        step's output groups repeat every step, and a CUDA graph capture may not copy from the host), and the
        last large one (a chunk's gate, up and down projections share their experts)."""
        if experts is not None and not self.on_host(experts):
            raise TypeError(f"a launch plan needs host expert ids, got a {type(experts).__name__}; ids on the "
                            f"device go through qmatmul, which reads them as its batches")
        if experts is None:
            key = ("plan", n_pairs, size)
            if key not in self._consts:
                self._consts[key] = self._device_plan(None, n_pairs, size)
            return self._consts[key]
        key = (n_pairs, size, np.asarray(experts, dtype=np.int64).tobytes())
        kept, limit = (self._chunk_plan, 1) if n_pairs > PLAN_KEPT_PAIRS else (self._gathered, PLANS_KEPT)
        return _kept(kept, key, lambda: self._device_plan(experts, n_pairs, size), limit)

    def _device_plan(self, experts, n_pairs: int, size: int):
        order, batches = S.pair_batches(experts, n_pairs, size)
        return self._array(order), self._array(batches), len(batches)

    def dequant(self, w, qtype, ne0: int, rows: int, half: bool = False):
        """Rows of blocks ``w [rows, row_bytes]`` (the kernels' layout, :mod:`.layout`) → float32 ``[rows, ne0]``
        (``half``: float16, rounded to nearest even)."""
        dims = self._const(rows, ne0, layout.row_bytes(qtype, ne0))
        return self._run(S.dequant_spec(qtype, half), (-(-ne0 // (8 * S.DEQUANT_GROUP)), rows), S.DEQUANT_GROUP,
                         [w, self.aux, dims], [((rows, ne0), "float16" if half else "float32")])[0]

    def chunk_weight(self, w, qtype, ne0: int, rows: int):
        """A matrix for a chunk's product through the library's GEMM (:meth:`dense_product`), dequantized: as
        halves where the chunk's products take half operands, so no float32 copy is made to be rounded."""
        return self.dequant(w, qtype, ne0, rows, half=self._product_operands(rows) == "f16")

    def qmatmul(self, x, w, qtype, ne0: int, n_rows: int, experts: np.ndarray | None = None, repeat: int = 1,
                reduce: bool = True):
        """``out[p] = x[p // repeat] @ W_{experts[p]}ᵀ`` from the blocks (``experts`` None: one dense matrix;
        ``repeat``: a token's pairs share its row of x). Few rows and a long K: K split over more SIMD groups
        (:func:`.specs.qmatmul_splits`), then summed; with ``reduce`` False, the splits' sums ``[S, P, n_rows]``
        for a kernel that adds them as it reads them (hc_pre, hc_post, swiglu, moe_route: Ops.split_sums).
        ``decode_matmul`` "q8": x quantized (see the class), each pair a batch of its own."""
        P = x.shape[0] * repeat
        ids = experts is not None and not self.on_host(experts)
        q8 = self.decode_matmul == "q8" and Q(qtype) in S.QUANT_X
        if ids:  # ids on the device: each pair its own batch, its expert read from the ids themselves
            order, batches, n_batches = self._const(*range(P)), self._i32(experts), P
        else:
            order, batches, n_batches = self._plan(experts, P, 1 if q8 else S.MAX_PAIRS)
        rows = S.QMATMUL_XQ8_SIMD_ROWS if q8 else S.QMATMUL_SIMD_ROWS  # a SIMD group's
        splits, chunk = S.qmatmul_splits(ne0, n_rows, n_batches, rows, qtype)
        dims = self._const(ne0, n_rows, layout.row_bytes(qtype, ne0), n_batches, P, splits, chunk, repeat, int(ids))
        group_rows = S.QMATMUL_SIMD_PER_GROUP * rows
        spec = S.qmatmul_xq8_spec(qtype) if q8 else S.qmatmul_spec(qtype)
        parts = self._run(spec, (-(-n_rows // group_rows), n_batches * splits),
                          32 * S.QMATMUL_SIMD_PER_GROUP, [self._f32(x), w, self.aux, order, batches, dims],
                          [((splits, P, n_rows), "float32")])[0]
        return parts if not reduce else self.add_splits(parts)

    def add_splits(self, parts):
        """A product from its K splits ``parts [S, P, n]`` (qmatmul's with reduce False): their sum in split order,
        ``[P, n]`` (qmatmul_reduce; an op that cannot take the splits as they are gets the product so)."""
        splits, P, n = parts.shape
        if splits == 1:  # a reshape, not parts[0]: MLX indexes by an integer with a gather launch
            return parts.reshape(P, n)
        return self._run(S.QMATMUL_REDUCE, (-(-P * n // S.ROW_GROUP), 1), S.ROW_GROUP,
                         [self._f32(parts), self._const(P * n, splits)], [((P, n), "float32")])[0]

    def dense_product(self, x, w):
        """``x [P, K] @ w [N, K]ᵀ`` for a chunk through the array library's GEMM (``w`` dequantized or F32)."""
        operands = self._product_operands(w.shape[0])
        x, w = (operand_round(self.xp, a, operands) for a in (x, w))
        return x @ w.T

    def grouped_product(self, x, raw, qtype, ne0: int, n_rows: int):
        """``x [T, G, ne0]``, row t of group g times matrix g of ``raw [G, n_rows, row_bytes]``: ``[T, G·n_rows]``
        in group order (a chunk's attn_output_a). The matrices are dequantized in one launch, then multiplied
        in one batched product."""
        G = x.shape[1]
        w = self.chunk_weight(raw.reshape(G * n_rows, -1), qtype, ne0, G * n_rows)
        return self.batched_dense_product(x, w.reshape(G, n_rows, ne0))

    def batched_dense_product(self, x, w):
        """``out[t, g] = x[t, g] @ w[g]ᵀ`` for ``x [T, G, K]`` and ``w [G, N, K]``, as ``[T, G·N]``."""
        x, w = (operand_round(self.xp, a, self.chunk_operands) for a in (x, w))
        return self.xp.matmul(x.transpose(1, 0, 2), w.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(x.shape[0], -1)

    def qgemm(self, x, raw, qtype, ne0: int, n_rows: int, experts: np.ndarray | None = None, repeat: int = 1):
        """The same product for many rows, tiled: ``x [P / repeat, ne0]`` (pair p reads row p // repeat: a
        token's pairs share its row), ``raw [n_expert, n_rows, row_bytes]`` (or ``[n_rows, row_bytes]`` with
        ``experts`` None: one matrix), ``experts`` a host array of P expert ids (its tiles are planned from them);
        every row in one launch, straight from the blocks. Returns ``out [P, n_rows]``."""
        P = x.shape[0] * repeat
        order, tiles, n_tiles = self._plan(experts, P, S.QGEMM_BM)
        return self._run(S.qgemm_spec(qtype, self.chunk_operands), (-(-n_rows // S.QGEMM_BN), n_tiles),
                         S.qgemm_threads(qtype),
                         [self._chunk_x(x), raw, self.aux, order, tiles,
                          self._const(ne0, n_rows, layout.row_bytes(qtype, ne0), 0, repeat)],
                         [((P, n_rows), "float32")])[0]

    def attend(self, q, keys, visible, sinks, scale: float, tail=None, rope=None):
        """Softmax attention with sinks over visible keys (docs/MODEL.md, "Attention") for a few queries, in two
        passes: each key split's online softmax for a block of heads sharing each key read (attend_partial), then
        the merge of the splits (attend_reduce). ``tail``: ``(keys2 [N2, D], visible2 [T, N2])``, keys that follow
        ``keys``, read where they lie (a decode step's compressed rows after its raw window). ``rope``: ``(cos,
        sin, inverse)``, the output turned by :meth:`rope` in the merge's launch (attend_reduce_rope)."""
        T, H, D = q.shape
        if tail is not None and tail[0].shape[0] == 0:
            tail = None
        keys2, visible2 = (keys, visible) if tail is None else tail  # with no tail, keys2 is never read
        N1 = keys.shape[0]
        dims_host = S.attend_partial_dims(T, H, D, N1 + (0 if tail is None else keys2.shape[0]), N1)
        dims, splits = self._const(*dims_host.tolist()), int(dims_host[4])
        parts = self._run(S.ATTEND_PARTIAL, (T * S.attend_partial_head_blocks(H), splits), S.ATTN_GROUP,
                          [self._f32(q), self._f32(keys), self._u8(visible), self._f32(keys2), self._u8(visible2),
                           dims, self._const(scale, dtype=np.float32)],
                          [((T * H, splits), "float32"), ((T * H, splits), "float32"),
                           ((T * H, splits, D), "float32")])
        grid, args = (T * H, -(-D // S.ATTN_GROUP)), [*parts, self._f32(sinks), dims]
        if rope is None:
            return self._run(S.ATTEND_REDUCE, grid, S.ATTN_GROUP, args, [((T, H, D), "float32")])[0]
        cos, sin, inverse = rope
        return self._run(S.ATTEND_REDUCE_ROPE, grid, S.ATTN_GROUP,
                         [*args, self._f32(cos), self._f32(sin), self._const(2 * cos.shape[-1], int(inverse))],
                         [((T, H, D), "float32")])[0]

    def attend_chunk(self, q, keys, visible, sinks, scale: float):
        """The same attention for a chunk of queries (prefill) in one pass on the matrix units: an online
        softmax over tiles of each query's visible keys, for a block of 16 heads; no [T, H, N] scores are made."""
        T, H, D = q.shape
        return self._run(S.attend_chunk_spec(self.chunk_operands), S.attend_chunk_groups(T, H, D), S.ATTN_CHUNK_GROUP,
                         [self._f32(q), self._f32(keys), self._u8(visible), self._f32(sinks),
                          self._const(T, H, D, keys.shape[0]), self._const(scale, dtype=np.float32)],
                         [((T, H, D), "float32")])[0]

    def hc_pre(self, mix, scale, base, X, iters: int, eps: float, norm_eps: float, norm=None, part=None, gram=None,
               then=None):
        """(x_in [T, E], post [T, n], comb [T, n, n]) from the mixer's linear applied to the flat state ``X [T, n·E]``
        itself, not to its RMS normalisation: the kernel divides by the RMS
        (docs/MODEL.md, "Hyper-connections and Sinkhorn"). ``mix``: the linear's output ``[T, M]``, or its K splits
        ``[S, T, M]`` (qmatmul's parts, added here). ``norm``: ``(weight, eps)`` of the sublayer's rmsnorm, which
        then comes out in x_in's place, as :meth:`rmsnorm` gives it (the same group size: the same sums).
        ``part``: "mixer" launches only the work of post and comb, "input" only that of x_in (the same bits as the
        whole launch; the other outputs come back unwritten). ``gram``: X's Gram matrix per token as parts ``[Q, T,
        n(n+1)/2]`` (:meth:`hc_post_mix`'s), added in order: its trace is X's sum of squares (else summed from X),
        and it gives x_in's before x_in is made, so with a norm x_in is spread over groups as without one.
        ``then`` (with ``gram`` and ``norm``, not with part "mixer"): the sublayer's first linear, F16 bytes ``[N,
        E·2]``, started on x_in by its groups (hc_pre_then): its product comes back as a fourth output, parts ``[G,
        T, N]`` over E's spans for the op that reads it to add as a product's K splits."""
        T, n, E = X.shape
        S.check_hc_streams("hc_pre", n)
        parts, X = mix.reshape((-1, T, mix.shape[-1])), self._f32(X)
        w, w_eps = (X, 0.0) if norm is None else norm
        if norm is None or gram is not None:  # groups a token's x_in is spread over
            G, threads = -(-E // S.ROW_GROUP) if T < S.RMSNORM_WIDE_ROWS else 1, S.ROW_GROUP
        else:  # one, which sums x_in's squares as rmsnorm does
            G, threads = 1, self._norm_threads(T)
        if part not in (None, "mixer", "input"):
            raise ValueError(f"hc_pre: part {part!r} is not 'mixer' or 'input'")
        groups, y0 = {None: (1 + G, 0), "mixer": (1, 0), "input": (G, 1)}[part]
        inputs = [self._f32(parts), self._f32(scale), self._f32(base), X, self._f32(w),
                  X if gram is None else self._f32(gram),
                  self._const(T, n, E, iters, G, parts.shape[0], int(norm is not None), y0,
                              0 if gram is None else gram.shape[0], 0 if then is None else then.shape[0]),
                  self._const(eps, norm_eps, w_eps, dtype=np.float32)]
        outputs = [((T, E), "float32"), ((T, n), "float32"), ((T, n, n), "float32")]
        if then is None:
            return tuple(self._run(S.HC_PRE, (T, groups), threads, inputs, outputs))
        if gram is None or norm is None or part == "mixer" or then.shape[1] != 2 * E or -(-E // G) > S.HC_THEN_SPAN:
            raise ValueError(f"hc_pre: a product started on x_in needs the Gram matrix, the norm, x_in's part, spans "
                             f"of E = {E} over its {G} groups of at most {S.HC_THEN_SPAN} (fewer than "
                             f"{S.RMSNORM_WIDE_ROWS} rows), and an F16 linear over E (got [{then.shape[0]}, "
                             f"{then.shape[1]} bytes])")
        # x_in's G groups HC_THEN_SPLIT times over, each starting its share of the linear's rows
        groups = groups + (S.HC_THEN_SPLIT - 1) * G
        return tuple(self._run(S.HC_PRE_THEN, (T, groups), threads, [*inputs, then],
                               [*outputs, ((G, T, then.shape[0]), "float32")]))

    def hc_post(self, y, X, post, comb, pairs: int = 1, extra=None):
        """The streams after a sublayer: ``post·y`` plus the combine matrix applied to ``X [T, n, E]``. ``y [T, E]``,
        its K splits ``[S, T, E]`` (qmatmul's parts), or with ``pairs`` above 1 each token's ``pairs`` rows ``[T ·
        pairs, E]``: added here in order, then ``extra [T, E]`` when given."""
        T, n, E = X.shape
        return self._run(S.HC_POST, (-(-T * E // S.ROW_GROUP), 1), S.ROW_GROUP,
                         self._hc_post_inputs("hc_post", y, X, post, comb, pairs, extra), [((T, n, E), "float32")])[0]

    def hc_post_mix(self, y, X, post, comb, pairs: int = 1, extra=None, fn=None):
        """:meth:`hc_post`'s ``X_new``, and the next sublayer's mixer started on it: ``fn`` is that mixer's linear,
        F16 bytes ``[M, n·E·2]``. Returns ``(X_new, mix, gram)``: ``mix [G, T, M]`` the product ``X_new @ fnᵀ`` in
        parts over E's G spans of ROW_GROUP (for :meth:`hc_pre` to add as a product's K splits), ``gram [G, T,
        n(n+1)/2]`` the streams' Gram matrix ``Σ_d X_new[o, d]·X_new[o', d]`` (o ≤ o', row by row) in the same parts
        (hc_pre's ``gram``)."""
        T, n, E = X.shape
        self._check_mixer("hc_post_mix", fn, n, E)
        inputs = self._hc_post_inputs("hc_post_mix", y, X, post, comb, pairs, extra, fn.shape[0])
        grid, parts = self._mix_parts(T, n, E)
        return tuple(self._run(S.HC_POST_MIX, grid, S.ROW_GROUP, [*inputs, fn], [((T, n, E), "float32"), *parts]))

    def hc_mix_parts(self, X, fn):
        """``(mix, gram)`` of :meth:`hc_post_mix` for streams ``X [T, n, E]`` as they are (none started them): the
        same terms added in the same order, so the bits hc_post_mix gives with the X it writes."""
        T, n, E = X.shape
        S.check_hc_streams("hc_mix_parts", n)
        self._check_mixer("hc_mix_parts", fn, n, E)
        X = self._f32(X)
        grid, parts = self._mix_parts(T, n, E)
        return tuple(self._run(S.HC_MIX_PARTS, grid, S.ROW_GROUP,
                               [X, self._const(T, n, E, 0, 0, 0, 0, fn.shape[0]), fn], parts))

    @staticmethod
    def _check_mixer(kernel: str, fn, n: int, E: int) -> None:
        M = fn.shape[0]
        if M != 2 * n + n * n or fn.shape[1] != 2 * n * E:
            raise ValueError(f"{kernel}: the mixer's weight [{M}, {fn.shape[1]} bytes] is not F16 [2n + n² = "
                             f"{2 * n + n * n}, n·E = {n} x {E}]")

    @staticmethod
    def _mix_parts(T: int, n: int, E: int) -> tuple:
        """hc_post_mix's and hc_mix_parts' grid (HC_MIX_SPLIT work-groups for each of E's G spans, a token's each) and
        the shapes of their parts (mixer product and Gram matrix, a part a span)."""
        G = -(-E // S.ROW_GROUP)
        return (G * S.HC_MIX_SPLIT, T), [((G, T, 2 * n + n * n), "float32"), ((G, T, n * (n + 1) // 2), "float32")]

    def _hc_post_inputs(self, kernel: str, y, X, post, comb, pairs: int, extra, *more_dims) -> list:
        T, n, E = X.shape
        S.check_hc_streams(kernel, n)
        if pairs > 1 and y.ndim != 2:
            raise ValueError(f"{kernel}: a token's {pairs} rows come as [T · pairs, E], not {tuple(y.shape)}")
        # y's rows: R of them summed, row r of token t at r·r_stride + t·t_stride
        R, r_stride, t_stride = (pairs, E, pairs * E) if pairs > 1 else (_splits(y), T * E, E)
        y = self._f32(y)
        return [y, self._f32(X), self._f32(post), self._f32(comb), y if extra is None else self._f32(extra),
                self._const(T, n, E, R, r_stride, t_stride, int(extra is not None), *more_dims)]

    def _norm_rows(self, x, weight, spec, parts_spec):
        """``(spec, or parts_spec for Columns, x's array, its weight (x's when there is none: the kernel then reads
        none), R, D, dims after [R, D, has_w, M, n_rot], group size)`` of rmsnorm's rows of ``x`` (an array ``[...,
        D]`` or :class:`Columns`: rows of a product's splits, read as they are)."""
        if isinstance(x, Columns):
            parts = self._f32(x.parts)
            xS, R, N = parts.shape
            spec, x2, more = parts_spec, parts, (xS, R * N, N, x.lo)
        else:
            x2, more = self._f32(x).reshape(-1, x.shape[-1]), ()
            R = x2.shape[0]
        w = self._f32(weight) if weight is not None else x2
        return spec, x2, w, R, x.shape[-1], more, self._norm_threads(R)

    def _norm_threads(self, rows: int) -> int:
        """rmsnorm's group size for ``rows`` rows (hc_pre's norm takes the same, so its sums are rmsnorm's)."""
        return S.ROW_GROUP if rows >= S.RMSNORM_WIDE_ROWS else self.wide_group

    def rmsnorm(self, x, eps: float, weight=None):
        """rmsnorm of ``x``'s rows (an array, or :class:`Columns` of a product's splits: rmsnorm_parts)."""
        spec, x2, w, R, D, more, threads = self._norm_rows(x, weight, S.RMSNORM, S.RMSNORM_PARTS)
        dims = self._const(R, D, int(weight is not None), *((1, 0) + more if more else ()))
        return self._run(spec, (R, 1), threads, [x2, w, dims, self._const(eps, dtype=np.float32)],
                         [((R, D), "float32")])[0].reshape(x.shape)

    def rmsnorm_rope(self, x, eps: float, weight, cos, sin):
        """``(rmsnorm(x), rope(rmsnorm(x)))`` for ``x [T, ..., D]`` (or :class:`Columns`) in one launch
        (:meth:`rmsnorm`, :meth:`rope`)."""
        spec, x2, w, R, D, more, threads = self._norm_rows(x, weight, S.RMSNORM_ROPE, S.RMSNORM_ROPE_PARTS)
        dims = self._const(R, D, int(weight is not None), R // x.shape[0], 2 * cos.shape[-1], *more)
        y, rot = self._run(spec, (R, 1), threads,
                           [x2, w, self._f32(cos), self._f32(sin), dims, self._const(eps, dtype=np.float32)],
                           [((R, D), "float32"), ((R, D), "float32")])
        return y.reshape(x.shape), rot.reshape(x.shape)

    def store_kv(self, x, n_rot: int):
        """Rows ``x [..., D]`` as ds4 stores them: FP8 on the non-RoPE dims, then F16 rounding (``fp8_kv_sim`` and
        ``f16_round`` of model/numerics.py)."""
        D = x.shape[-1]
        x2 = self._f32(x).reshape(-1, D)
        R = x2.shape[0]
        simd_groups = min(S.STORE_KV_SIMD_GROUPS, max(1, (D - n_rot) // 64)) if R < S.RMSNORM_WIDE_ROWS else 1
        return self._run(S.STORE_KV, (R, 1), 32 * simd_groups, [x2, self._const(R, D, n_rot)],
                         [((R, D), "float32")])[0].reshape(x.shape)

    def hadamard_fp4(self, x, f16: bool = False, rope=None):
        """The indexer's Hadamard + FP4 step on rows of ``x [T, ..., n]``; with ``f16`` the result is rounded to f16
        too, as stored rows are. ``rope``: ``(cos, sin)``, the rows turned by :meth:`rope` first, in the same launch
        (hadamard_fp4_rope: the indexer's queries)."""
        n = x.shape[-1]
        x2 = self._f32(x).reshape(-1, n)
        R = x2.shape[0]
        if rope is None:
            spec, inputs = S.HADAMARD_FP4, [x2, self._const(R, n, int(f16))]
        else:
            cos, sin = rope
            spec, inputs = S.HADAMARD_FP4_ROPE, [x2, self._f32(cos), self._f32(sin),
                                                 self._const(R, n, int(f16), R // x.shape[0], 2 * cos.shape[-1])]
        return self._run(spec, (R, 1), n, [*inputs, self._const(1.0 / n ** 0.5, dtype=np.float32)],
                         [((R, n), "float32")])[0].reshape(x.shape)

    def compress_pool(self, state_kv, state_sc, kv, sc, pos0, ratio: int):
        """The compressor's pooled rows for a chunk at positions ``pos0 …`` (see ``compressor.pool_windows``)."""
        C, W = kv.shape
        n_out, width = S.pool_shape(ratio, C, W)
        return self._run(S.COMPRESS_POOL, (-(-width // 32), n_out), 32 * S.COMPRESS_POOL_SLICES,
                         [self._f32(state_kv), self._f32(state_sc), self._f32(kv), self._f32(sc), self._i32(pos0),
                          self._const(C, W, ratio, coff(ratio), n_out)],
                         [((n_out, width), "float32")])[0]

    def compress_state(self, state_kv, state_sc, kv, sc, pos0, n_valid, ratio: int, in_place: bool = False):
        """``(new_kv, new_sc)``: the compressor's pending state after ``kv, sc [C, W]`` at ``pos0`` with
        ``n_valid`` real rows (host ints, or device scalars in a compiled step). With ``in_place``, for a chunk that
        ends no window, its rows are written into ``state_kv`` and ``state_sc`` (contiguous float32), which are
        returned."""
        C, W = kv.shape
        rows = coff(ratio) * ratio
        tail = [self._i32(pos0), self._i32(n_valid), self._const(C, W, ratio, coff(ratio))]
        if in_place:
            _check_in_place("compress_state", state_kv)
            _check_in_place("compress_state", state_sc)
            if isinstance(pos0, (int, np.integer)) and isinstance(n_valid, (int, np.integer)) \
                    and (pos0 + n_valid) // ratio != pos0 // ratio:
                raise InPlaceError(f"compress_state in place: positions {pos0}…{pos0 + n_valid - 1} end a window of "
                                   f"{ratio}; only a chunk that ends none leaves the rest of the state as it is")
            return tuple(self._run(S.COMPRESS_STATE_IN_PLACE, (max(1, -(-C * W // S.ROW_GROUP)), 1), S.ROW_GROUP,
                                   [self._f32(kv), self._f32(sc), *tail], [state_kv, state_sc]))
        return tuple(self._run(S.COMPRESS_STATE, (-(-rows * W // S.ROW_GROUP), 1), S.ROW_GROUP,
                               [self._f32(state_kv), self._f32(state_sc), self._f32(kv), self._f32(sc), *tail],
                               [((rows, W), "float32"), ((rows, W), "float32")]))

    def add_ape(self, gate, ape, pos0):
        """``gate [C, W]`` plus the row of ``ape [R, W]`` of each position ``pos0 + t`` mod R."""
        C, W = gate.shape
        return self._run(S.ADD_APE, (-(-C * W // S.ROW_GROUP), 1), S.ROW_GROUP,
                         [self._f32(gate), self._f32(ape), self._i32(pos0), self._const(C, W, ape.shape[0])],
                         [((C, W), "float32")])[0]

    def pair_sum(self, y, k: int):
        """``y [T·k, D]`` summed over each token's k rows in order: ``[T, D]``."""
        P, D = y.shape
        T = P // k
        return self._run(S.PAIR_SUM, (-(-T * D // S.ROW_GROUP), 1), S.ROW_GROUP, [self._f32(y), self._const(T, k, D)],
                         [((T, D), "float32")])[0]

    def round_half(self, x):
        """Contiguous float32 ``x`` (16-byte aligned) rounded to float16, to nearest even."""
        n = x.size
        return self._run(S.ROUND_HALF, (max(1, -(-n // (8 * S.ROW_GROUP))), 1), S.ROW_GROUP,
                         [x, self._const(n)], [(x.shape, "float16")])[0]

    def append_rows(self, rows, pooled, pos0, n_valid, ratio: int, in_place: bool = False):
        """The compressed rows ``[N, D]`` with the windows a chunk completed taken from ``pooled``. With ``in_place``
        they are written into ``rows`` (contiguous float32), which is returned."""
        N, D = rows.shape
        tail = [self._i32(pos0), self._i32(n_valid), self._const(N, D, pooled.shape[0], ratio)]
        if in_place:
            _check_in_place("append_rows", rows)
            return self._run(S.APPEND_ROWS_IN_PLACE, (max(1, -(-pooled.size // S.ROW_GROUP)), 1), S.ROW_GROUP,
                             [self._f32(pooled), *tail], [rows])[0]
        return self._run(S.APPEND_ROWS, (-(-N * D // S.ROW_GROUP), 1), S.ROW_GROUP,
                         [self._f32(rows), self._f32(pooled), *tail], [((N, D), "float32")])[0]

    def compressed_visible(self, pos0, n_valid, C: int, n_rows: int, ratio: int):
        """``(n_vis [C], visible [C, n_rows])``: how many compressed rows each query of a chunk sees, and which
        (``compressed_visible`` of model/attention.py)."""
        n_vis, visible = self._run(S.COMPRESSED_VISIBLE, (-(-max(C * n_rows, C) // S.ROW_GROUP), 1), S.ROW_GROUP,
                                   [self._i32(pos0), self._i32(n_valid), self._const(C, n_rows, ratio)],
                                   [((C,), "int32"), ((C, n_rows), "uint8")])
        return n_vis, self._bool(visible)

    def ring_write(self, raw, kv, pos0, n_valid, window: int, in_place: bool = False):
        """``(raw, slot_pos, visible)``: the raw ring after a chunk (``ring_write`` of model/attention.py). With
        ``in_place`` the chunk's rows are written into ``raw`` (contiguous float32), which is returned."""
        cap, D = raw.shape
        C = kv.shape[0]
        tail = [self._i32(pos0), self._i32(n_valid), self._const(cap, D, C, window)]
        masks = [((cap,), "int32"), ((C, cap), "uint8")]
        if in_place:
            _check_in_place("ring_write", raw)
            out, slot_pos, visible = self._run(S.RING_WRITE_IN_PLACE, (-(-max(C * D, cap, C * cap) // S.ROW_GROUP), 1),
                                               S.ROW_GROUP, [self._f32(kv), *tail], [raw, *masks])
        else:
            out, slot_pos, visible = self._run(S.RING_WRITE, (-(-max(cap * D, C * cap) // S.ROW_GROUP), 1),
                                               S.ROW_GROUP, [self._f32(raw), self._f32(kv), *tail],
                                               [((cap, D), "float32"), *masks])
        return out, slot_pos, self._bool(visible)

    def indexer_scores(self, q, w, k):
        """``score [T, N]`` of every compressed indexer row ``k [N, Dq]`` for queries ``q [T, H, Dq]``."""
        T, H, Dq = q.shape
        N = k.shape[0]
        if not S.indexer_scores_fits(Dq):
            raise ValueError(f"indexer_scores kernel: head dim {Dq} exceeds {S.INDEXER_MAX_DQ} or is not a "
                             "multiple of 4")
        return self._run(S.INDEXER_SCORES, (-(-N // S.INDEXER_ROWS), T), S.INDEXER_GROUP,
                         [self._f32(q), self._f32(w), self._f32(k), self._const(T, H, Dq, N)],
                         [((T, N), "float32")])[0]

    def indexer_chunk(self, q, w, k):
        """The same scores for a chunk on the matrix units (qgemm's tiles, reduced over the heads in place):
        the H heads of a query must divide a tile's S.QGEMM_BM rows."""
        T, H, Dq = q.shape
        N = k.shape[0]
        if S.QGEMM_BM % H:
            raise ValueError(f"indexer_chunk kernel: {H} heads do not divide a tile's {S.QGEMM_BM} rows")
        order, tiles, n_tiles = self._plan(None, T * H, S.QGEMM_BM)
        return self._run(S.indexer_chunk_spec(self.chunk_operands), (-(-N // S.QGEMM_BN), n_tiles),
                         S.qgemm_threads(Q.F32),
                         [self._chunk_x(q).reshape(T * H, Dq), self._f32(k).reshape(-1).view(self.xp.uint8), self.aux,
                          order, tiles, self._const(Dq, N, 4 * Dq, H, 1), self._f32(w)],
                         [((T, N), "float32")])[0]

    def indexer_allowed(self, score, visible, n_visible, top_k: int):
        """Boolean ``[T, N]``: each query's top-k visible rows when more than k are visible, else all visible."""
        T, N = score.shape
        threads = S.indexer_allowed_threads(T, N, self.wide_group)
        allowed = self._run(S.INDEXER_ALLOWED, (T, 1), threads,
                            [self._f32(score), self._u8(visible), self._i32(n_visible), self._const(T, N, top_k)],
                            [((T, N), "uint8")])[0]
        return self._bool(allowed)

    def rope(self, x, cos, sin, inverse: bool = False):
        """RoPE on the last ``2·cos.shape[-1]`` dims of ``x [T, ..., D]``."""
        T, D = x.shape[0], x.shape[-1]
        x3 = self._f32(x).reshape(T, -1, D)
        return self._run(S.ROPE, (-(-x3.size // S.ROW_GROUP), 1), S.ROW_GROUP,
                         [x3, self._f32(cos), self._f32(sin),
                          self._const(T, x3.shape[1], D, 2 * cos.shape[-1], int(inverse))],
                         [(x3.shape, "float32")])[0].reshape(x.shape)

    def swiglu(self, gate, up, clamp: float, weights=None):
        """silu(min(gate, clamp)) · clip(up, −clamp, clamp) of ``gate, up [P, F]`` (or their K splits ``[S, P, F]``,
        qmatmul's parts, added here), times ``weights [P]`` (one per row) when given."""
        P, F = gate.shape[-2:]
        g = self._f32(gate)
        return self._run(S.SWIGLU, (-(-P * F // S.ROW_GROUP), 1), S.ROW_GROUP,
                         [g, self._f32(up), g if weights is None else self._f32(weights),
                          self._const(P, F, int(weights is not None), _splits(gate), _splits(up)),
                          self._const(clamp, dtype=np.float32)],
                         [((P, F), "float32")])[0]

    def moe_route(self, logits, bias, k: int, scale: float, table=None, tokens=None):
        """``(probs [T, n], selected [T, k] int32, weights [T, k])`` from the router's ``logits [T, n]`` (or their
        K splits ``[S, T, n]``, qmatmul's parts, added here): the top k of probs (+ ``bias [n]``), or with ``table
        [V, k]`` its rows of the device ids ``tokens [T]``."""
        T, n = logits.shape[-2:]
        if n > S.ROUTE_MAX_EXPERTS or k > S.ROUTE_MAX_K:
            raise ValueError(f"moe_route kernel: {n} experts (at most {S.ROUTE_MAX_EXPERTS}), {k} a token "
                             f"(at most {S.ROUTE_MAX_K})")
        x, hashed = self._f32(logits), table is not None
        return tuple(self._run(S.MOE_ROUTE, (T, 1), min(S.ROW_GROUP, 32 * -(-n // 32)),
                               [x, x if bias is None else self._f32(bias),
                                self._i32(table) if hashed else self._const(0),
                                self._i32(tokens) if hashed else self._const(0),
                                self._const(T, n, k, int(bias is not None), int(hashed), _splits(logits)),
                                self._const(scale, ROUTER_SUM_FLOOR, dtype=np.float32)],
                               [((T, n), "float32"), ((T, k), "int32"), ((T, k), "float32")]))

    def next_token(self, logits, mask=None, params=None):
        """The token of a decode step launched ahead, as int32 ``[1]`` on the device, from ``logits [1, V]``: the
        greedy one (``params`` None), or ds4's default rule's draw with ``params`` float32 ``[temperature, min_rel,
        u]`` on the device (:func:`ds4lab.sampling.draw_params`); ``mask``: the excluded ids' bits
        (:func:`ds4lab.sampling.exclude_mask`), None for none."""
        V = logits.shape[-1]
        if not 0 < V < S.NEXT_TOKEN_MAX_VOCAB or logits.size != V:
            raise ValueError(f"next_token kernel: logits of shape {tuple(logits.shape)} (one row of 1 to "
                             f"{S.NEXT_TOKEN_MAX_VOCAB - 1} logits)")
        x, G = self._f32(logits), min(S.NEXT_TOKEN_SLICES, -(-V // S.NEXT_TOKEN_SLICE))
        slice_, draw = -(-V // G), params is not None
        dims = self._const(V, int(mask is not None), slice_, G, int(draw))
        mask = self._const(0) if mask is None else mask
        fparams = params if draw else self._const(0.0, dtype=np.float32)
        lanes = 32 * -(-slice_ // 32)  # a slice's ids in whole SIMD groups
        threads = min(S.NEXT_TOKEN_THREADS, lanes)
        parts = self._run(S.NEXT_TOKEN_PARTS, (G, 1), threads, [x, mask, dims], [((G * 5,), "float32")])[0]
        sums = (self._run(S.NEXT_TOKEN_SUMS, (G, 1), threads, [x, parts, mask, dims, fparams],
                          [((G * 2,), "float32")])[0] if draw else parts)  # unread without a draw
        return self._run(S.NEXT_TOKEN_PICK, (1, 1), min(S.NEXT_TOKEN_GROUP, lanes),
                         [x, parts, sums, mask, dims, fparams], [((1,), "int32")])[0]


class ArrayLaunches(KernelLaunches):
    """The array handling of libraries with NumPy's interface (NumPy, CuPy): outputs are allocated here
    and written by the kernel."""

    def _launch(self, spec, groups, threads, args) -> None:
        raise NotImplementedError

    def _run(self, spec, groups, threads, inputs, outputs):
        outs = [self.xp.empty(*o) if isinstance(o, tuple) else o for o in outputs]
        self._launch(spec, groups, threads, (*inputs, *outs))
        return outs

    def _array(self, a):
        return self.xp.asarray(a)

    def _f32(self, x):
        return self.xp.ascontiguousarray(x, dtype=self.xp.float32)

    def _f16(self, x):
        xp = self.xp
        if x.dtype == xp.float32 and x.flags.c_contiguous and x.size:  # rounded by round_half, 8 a thread
            return self.round_half(self._f32(x))
        return xp.ascontiguousarray(x, dtype=xp.float16)

    def _u8(self, x):
        xp = self.xp
        if x.dtype == xp.bool_:
            return xp.ascontiguousarray(x).view(xp.uint8)
        return xp.ascontiguousarray(x, dtype=xp.uint8)

    def _i32(self, x):
        if isinstance(x, (int, np.integer)):
            return self._host_int(int(x))
        return self.xp.ascontiguousarray(x, dtype=self.xp.int32)

    def _bool(self, x):
        return x.view(self.xp.bool_)
