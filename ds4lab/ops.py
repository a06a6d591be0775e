"""The model's ops: for each, the one place that decides between ds4lab's kernel and the reference formula.

:class:`Ops` is made over a backend, ``Ops(backend)``, by the model's owner (``ds4lab.load`` does) and given to the
Transformer (``transformer.ops``). Each
method runs the backend's kernel for its op where the backend has kernels (``backend.kernels``: the GPU
backends and the CPU emulator's) and the kernel's limits allow, and otherwise the reference formula of
:mod:`ds4lab.model`, the plain array ops the kernels are tested against. The reference formulas that take
an ops object (:func:`ds4lab.model.hc.hc_pre`, :func:`ds4lab.model.moe.routed_experts` and
``routed_experts_gathered``) are given this one, so the ops they call are chosen here too.

The layers, bottom up: the kernels (:mod:`ds4lab.mlx_kernels`, :mod:`ds4lab.cuda`) and the backends (an array
library, linears, compilation, uploads: :mod:`ds4lab.backends`) import no model; the reference formulas
(``ds4lab/model/``) import neither this module nor the kernels; this module imports both sides; the
transformer calls the ops here.

Attention: a few queries (up to ATTN_KERNEL_MAX_QUERIES) go through the split-key kernels (attend_partial,
then attend_reduce: blocks of heads sharing each key read; attend_reduce_rope also turns the output back by RoPE,
``attend_rope``); a chunk through attend_chunk, which never makes
the scores (an online softmax over tiles of each query's visible keys), or, with ATTN_CHUNK_KERNEL off,
through the reference formula (GEMMs around a [T, H, N] score tensor).

How to add a kernel
-------------------
A kernel carries its op's name at every layer (here ``foo``; an op that needs several kernels names them
``foo_<part>``, as ``attend`` does with ``attend_partial``, ``attend_reduce`` and ``attend_chunk``):

1. **Body**: ``ds4lab/mlx_kernels/sources/foo.body``, written in the portable names of
   :mod:`ds4lab.mlx_kernels.dialects` (one body renders as CUDA, Metal and the CPU emulator's C++).
2. **Spec**: ``FOO = KernelSpec("foo", "foo.body", inputs, outputs, defines)`` in
   ``ds4lab/mlx_kernels/specs.py``, its limits (``FOO_MAX_...``) beside it, and ``FOO`` in ``all_specs()``
   (which the CuPy, MLX and emulator builds compile; their caches are keyed by the rendered source, so
   nothing else is needed for them).
3. **Launcher**: ``KernelLaunches.foo(...)`` in ``ds4lab/mlx_kernels/launches.py``: the grid, the constants
   and the outputs, written once for CuPy (:mod:`ds4lab.cuda.kernels`), MLX (:mod:`ds4lab.mlx_kernels.fast`)
   and the emulator (:mod:`ds4lab.mlx_kernels.cpu`).
4. **Op**: ``Ops.foo`` here, the kernel where ``self.kernels`` is not None and its limits allow, else the
   reference formula of ``ds4lab/model/`` (write it there first); the transformer calls ``self.ops.foo``.
5. **Test**: in ``tests/test_gpu_kernels.py``, the launcher against the reference formula (in float64, or
   bit for bit where the kernel's operations are the formula's), over the ``gpu`` fixture: it runs on CuPy
   and MLX GPUs where there are some and on the CPU emulator everywhere; ``tests/test_kernel_sources.py``
   renders every spec in every dialect.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as Q

from .backends.base import IN_ORDER
from .mlx_kernels.specs import HC_MAX, HC_MIX_MAX_ROWS, QGEMM_BM, ROUTE_MAX_EXPERTS, ROUTE_MAX_K, indexer_scores_fits
from .model import attention, compressor, functional, hc, moe, numerics, rope


class _Holding:
    """A branch and what it reads that its caller would otherwise free before the join (ds4lab.cuda.branches: memory
    freed on the main stream is reused there at once)."""

    def __init__(self, branch, *held):
        self.branch, self.held = branch, held

    def join(self) -> None:
        self.branch.join()
        self.held = ()


class _Started(NamedTuple):
    """A product started by the kernel that made its input ``x``: ``proj``'s product of ``x`` in parts [G, T, N] (the
    next mixer's, by hc_post_mix, with ``gram``, X's Gram matrix in parts [G, T, n(n+1)/2]; the router's, by
    hc_pre_then), for the op that takes that product of that x next (:meth:`Ops.hc_pre`, :meth:`Ops.split_sums`)."""

    x: object
    proj: object
    parts: object
    gram: object = None


ATTN_KERNEL_MAX_QUERIES = 16  # decode-sized query blocks use the split-key kernel; chunks see ATTN_CHUNK_KERNEL
# True: chunks attend through attend_chunk, which makes no [T, H, N] score tensor and does work only for
# the keys each query sees (a 128-key window, the indexer's top-k rows); False: through the reference
# formula's float32 GEMMs over every key. On the Flash slice attend_chunk makes prefill faster and its memory
# pool smaller (benchmarks/gpu_slice.py, and --no-attn-chunk for the GEMMs; figures in benchmarks/README.md);
# the GEMMs win only where most keys are visible (attend_chunk_bench.py).
ATTN_CHUNK_KERNEL = True


class Ops:
    """The model's ops over ``backend``: its kernels where it has them (``kernels``, read from the backend at
    each call: it may change with the current device), the reference formulas over ``xp`` elsewhere. The
    array members the reference formulas use (``dtype``, ``asarray``, ``index_add``) are the backend's."""

    def __init__(self, backend):
        self.backend = backend
        self.xp = backend.xp
        self.dtype = backend.dtype
        self._started: _Started | None = None  # the last kernel's start of the next product, until it is taken

    @property
    def kernels(self):
        """The backend's kernels on the current device, or None (no kernels: every op is its reference)."""
        return self.backend.kernels

    def branch(self, rows: int, quiet: bool):
        """Work of a block of ``rows`` rows that may run beside what follows it until ``join()`` (see
        :meth:`ds4lab.backends.base.Backend.branch`): the backend's branch for a decode step's few rows with kernels
        and no observer (``quiet``: nothing is emitted, so nothing reads a value while it is made), else in order."""
        if quiet and self.kernels is not None and rows <= ATTN_KERNEL_MAX_QUERIES:
            return self.backend.branch()
        return IN_ORDER

    # -- the backend's array members, for the reference formulas ---------------------------------------
    def asarray(self, a):
        return self.backend.asarray(a)

    def index_add(self, acc, rows, values):
        return self.backend.index_add(acc, rows, values)

    # -- attention ------------------------------------------------------------------------------------
    def attend(self, q, keys, visible, sinks, scale: float, tail=None):
        """Attention with sinks (:func:`ds4lab.model.attention.attend`): the split-key kernels for a few queries
        (they spread the keys over many groups, each a block of heads sharing its key reads); for a chunk, the
        chunk kernel (a group per query and block of heads) if ATTN_CHUNK_KERNEL, else the reference. ``tail``:
        ``(keys2, visible2)``, keys after ``keys`` (the compressed rows after the raw window): the split-key
        kernels read them where they lie, a decode step's copy of the cache saved; the others take the two joined."""
        kernels = self.kernels
        if kernels is not None and q.shape[0] <= ATTN_KERNEL_MAX_QUERIES:
            return kernels.attend(q, keys, visible, sinks, scale, tail)
        keys, visible = attention.join_tail(self.xp, keys, visible, tail)
        if kernels is not None and ATTN_CHUNK_KERNEL:
            return kernels.attend_chunk(q, keys, visible, sinks, scale)
        return attention.attend(self.xp, q, keys, visible, sinks, scale)

    def attend_rope(self, q, keys, visible, sinks, scale: float, tail, cos, sin):
        """:meth:`attend`'s output turned back by RoPE (:meth:`rope` with ``inverse``): for a few queries the
        split-key merge turns it as it writes it, one launch fewer on a decode step's critical path."""
        kernels = self.kernels
        if kernels is not None and q.shape[0] <= ATTN_KERNEL_MAX_QUERIES:
            return kernels.attend(q, keys, visible, sinks, scale, tail, rope=(cos, sin, True))
        return self.rope(self.attend(q, keys, visible, sinks, scale, tail), cos, sin, inverse=True)

    def ring_write(self, raw, kv, pos0, n_valid, window: int):
        """``(raw, slot_pos, visible)``: the raw ring after a chunk (:func:`ds4lab.model.attention.ring_write`)."""
        kernels = self.kernels
        if kernels is None:
            return attention.ring_write(self.xp, raw, kv, pos0, n_valid, window)
        return kernels.ring_write(raw, kv, pos0, n_valid, window, in_place=self.backend.donated(raw))

    def compressed_visible(self, pos0, n_valid, C: int, n_rows: int, ratio: int):
        """``(n_vis, visible)`` of :func:`ds4lab.model.attention.compressed_visible`: one launch with kernels."""
        kernels = self.kernels
        if kernels is None:
            return attention.compressed_visible(self.xp, pos0, n_valid, C, n_rows, ratio)
        return kernels.compressed_visible(pos0, n_valid, C, n_rows, ratio)

    def indexer_scores(self, q, w, k):
        """The indexer's scores (:func:`ds4lab.model.attention.indexer_scores`): the kernel for a few queries;
        for a chunk the matrix-unit kernel (indexer_chunk) where the heads divide its tiles, else the reference
        (a GEMM and a [T, H, N] tensor)."""
        kernels = self.kernels
        if kernels is not None and q.shape[0] <= ATTN_KERNEL_MAX_QUERIES and indexer_scores_fits(q.shape[2]):
            return kernels.indexer_scores(q, w, k)
        if kernels is not None and QGEMM_BM % q.shape[1] == 0:
            return kernels.indexer_chunk(q, w, k)
        return attention.indexer_scores(self.xp, q, w, k)

    def indexer_allowed(self, score, visible, n_visible, top_k: int):
        """Rows each query may attend (:func:`ds4lab.model.attention.indexer_allowed`): one kernel work-group
        per query with kernels."""
        kernels = self.kernels
        if kernels is None:
            return attention.indexer_allowed(self.xp, score, visible, n_visible, top_k)
        return kernels.indexer_allowed(score, visible, n_visible, top_k)

    # -- the KV rows and the compressor -----------------------------------------------------------------
    def store_kv(self, x, n_rot: int):
        """FP8 on the non-RoPE dims, then F16 rounding, as every cached attention row is stored
        (docs/MODEL.md, "Numerics"; :mod:`ds4lab.model.numerics`)."""
        kernels = self.kernels
        if kernels is not None and (x.shape[-1] - n_rot) % numerics.FP8_BLOCK == 0:
            return kernels.store_kv(x, n_rot)
        return numerics.f16_round(self.xp, numerics.fp8_kv_sim(self.xp, x, n_rot))

    def hadamard_fp4(self, x, f16: bool = False, rope=None):
        """The indexer's Hadamard + FP4 step (docs/MODEL.md, "Numerics"); with ``f16`` also the F16 rounding
        of a stored row. ``rope``: ``(cos, sin)``, ``x`` turned by :meth:`rope` first (the indexer's queries: one
        launch with kernels)."""
        n = x.shape[-1]
        kernels = self.kernels
        if kernels is not None and n % 32 == 0 and n <= 1024 and n & (n - 1) == 0:
            return kernels.hadamard_fp4(x, f16, rope)
        if rope is not None:
            x = self.rope(x, *rope)
        y = numerics.hadamard_fp4_sim(self.xp, x)
        return numerics.f16_round(self.xp, y) if f16 else y

    def compress_chunk(self, state_kv, state_sc, kv, sc, pos0, n_valid, ratio: int):
        """``(pooled, new_kv, new_sc)`` of :func:`ds4lab.model.compressor.compress_chunk`: with kernels, one
        pools (compress_pool), another makes the new state (compress_state)."""
        kernels = self.kernels
        if kernels is None:
            return compressor.compress_chunk(self.xp, state_kv, state_sc, kv, sc, pos0, n_valid, ratio)
        pooled = kernels.compress_pool(state_kv, state_sc, kv, sc, pos0, ratio)
        return (pooled, *kernels.compress_state(state_kv, state_sc, kv, sc, pos0, n_valid, ratio))

    def compress_state(self, state_kv, state_sc, kv, sc, pos0, n_valid, ratio: int):
        """``(new_kv, new_sc)``, the pending state alone (:func:`ds4lab.model.compressor.next_state`) of a chunk
        that ends no window: all it needs of its compressor. Written in place where the state is a CUDA graph's own
        copy (only the chunk's slots change)."""
        kernels = self.kernels
        if kernels is None:
            return compressor.next_state(self.xp, state_kv, state_sc, kv, sc, pos0, n_valid, ratio)
        in_place = self.backend.donated(state_kv) and self.backend.donated(state_sc)
        return kernels.compress_state(state_kv, state_sc, kv, sc, pos0, n_valid, ratio, in_place=in_place)

    def add_ape(self, gate, ape, pos0):
        """The compressor's scores (:func:`ds4lab.model.compressor.add_ape`)."""
        kernels = self.kernels
        if kernels is None:
            return compressor.add_ape(self.xp, gate, ape, pos0)
        return kernels.add_ape(gate, ape, pos0)

    def append_rows(self, rows, pooled, pos0, n_valid, ratio: int):
        """The compressed rows after a chunk (:func:`ds4lab.model.compressor.append_rows`)."""
        kernels = self.kernels
        if kernels is None:
            return compressor.append_rows(self.xp, rows, pooled, pos0, n_valid, ratio)
        return kernels.append_rows(rows, pooled, pos0, n_valid, ratio, in_place=self.backend.donated(rows))

    # -- norms, RoPE, hyper-connections ---------------------------------------------------------------
    def rmsnorm(self, x, eps: float, weight=None):
        """:func:`ds4lab.model.functional.rmsnorm` over the last axis (also of :meth:`split_sums`' of a stacked
        product: its K splits, which the kernel adds as it reads them)."""
        kernels = self.kernels
        if kernels is not None:
            return kernels.rmsnorm(x, eps, weight)
        return functional.rmsnorm(self.xp, x, eps, weight)

    def rope(self, x, cos, sin, inverse: bool = False):
        """RoPE on the tail dims (:func:`ds4lab.model.rope.rope`)."""
        kernels = self.kernels
        if kernels is not None:
            return kernels.rope(x, cos, sin, inverse)
        return rope.rope(self.xp, x, cos, sin, inverse)

    def rmsnorm_rope(self, x, eps: float, weight, cos, sin):
        """``(rmsnorm(x), its rows with RoPE on the tail)``: one launch with kernels (rmsnorm then rope take two)."""
        kernels = self.kernels
        if kernels is not None:
            return kernels.rmsnorm_rope(x, eps, weight, cos, sin)
        y = functional.rmsnorm(self.xp, x, eps, weight)
        return y, rope.rope(self.xp, y, cos, sin)

    def hc_pre(self, X, fn, scale, base, iters: int, eps: float, norm_eps: float, norm_weight=None,
               quiet: bool = False, then=None):
        """(x_in, post, comb, mixer) of the mixer before a sublayer (:func:`ds4lab.model.hc.hc_pre`); with
        ``norm_weight``, the sublayer's input ``rmsnorm(x_in, norm_eps, norm_weight)`` in x_in's place. The kernel
        takes ``fn`` of the flat state rather than of its RMS normalisation and divides by the RMS itself (``fn`` is
        linear), so no normalised copy is made; it adds fn's K splits itself where fn gives them (``split_sums``) and
        normalises x_in in the same launch: qmatmul_reduce's and rmsnorm's launches saved a sublayer.
        ``mixer.join()`` comes before post or comb are read. For a decode step's few rows (``quiet``: nothing
        emitted meanwhile) post and comb are made on a branch (:meth:`branch`), so the sublayer, which reads x_in
        alone, starts before the Sinkhorn normalisation ends; elsewhere ``mixer`` is IN_ORDER.

        A decode step's mixer of F16 weights (up to HC_MIX_MAX_ROWS rows) comes as parts over E of its product and of
        the streams' Gram matrix, made by the hc_post that wrote X where the halves are chained (:meth:`hc_post`'s
        ``then``) or here (hc_mix_parts): the same bits either way. The Gram matrix gives x_in's norm before x_in is
        made, and ``then``, the sublayer's first F16 linear (the router), is started on x_in by its kernel
        (hc_pre_then: parts over E, which :meth:`split_sums` of that linear and x_in returns)."""
        T, n, E = X.shape
        kernels = self.kernels
        started, self._started = self._started, None
        if kernels is not None and n <= HC_MAX:
            fn_f16 = self._mixer_bytes(fn, T, n, E)
            if started is not None and started.x is X and started.proj is fn:  # by the hc_post that made X
                mix, gram = started.parts, started.gram
            elif fn_f16 is not None:  # the same parts made here: the same bits as the hc_post that starts them
                mix, gram = kernels.hc_mix_parts(X, fn_f16)
            else:
                mix, gram = self.split_sums(fn, X.reshape(T, n * E)), None
            args = (mix, scale, base, X, iters, eps, norm_eps, None if norm_weight is None else (norm_weight, norm_eps))
            then_f16 = self._f16_bytes(then, T, E) if gram is not None and norm_weight is not None else None
            mixer = self.branch(T, quiet)
            if mixer is IN_ORDER:
                x_in, post, comb, *made = kernels.hc_pre(*args, gram=gram, then=then_f16)
            else:
                with mixer:
                    _, post, comb = kernels.hc_pre(*args, part="mixer", gram=gram)
                out = kernels.hc_pre(*args, part="input", gram=gram, then=then_f16)
                x_in, made = out[0], out[3:]
                mixer = _Holding(mixer, mix, gram)
            if made:
                self._started = _Started(x_in, then, made[0])
            return x_in, post, comb, mixer
        x_in, post, comb = hc.hc_pre(self, X, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps)
        return (x_in if norm_weight is None else self.rmsnorm(x_in, norm_eps, norm_weight)), post, comb, IN_ORDER

    def split_sums(self, proj, *args):
        """``proj(*args)``, as its K splits' sums ``[S, ...]`` where the kernels leave them for the op that reads the
        product to add (a decode step's qmatmul: hc_pre, hc_post, moe_route and swiglu add a product's splits as they
        read them, in qmatmul_reduce's order, so no launch adds them first); without kernels, the product itself."""
        started = self._started
        if started is not None and started.proj is proj and len(args) == 1 and started.x is args[0]:
            self._started = None
            return started.parts  # started by the kernel that made x (hc_pre_then)
        if self.kernels is not None and hasattr(proj, "split_sums"):
            return proj.split_sums(*args)
        return proj(*args)

    def hc_post(self, y, X, post, comb, pairs: int = 1, extra=None, then=None):
        """The streams after a sublayer (:func:`ds4lab.model.hc.hc_post`) of output ``y`` (or :meth:`split_sums`' of
        it); with ``pairs`` above 1, ``y`` is each token's ``pairs`` rows (routed experts', :meth:`pair_sum`'s
        input) and the output their sum; ``extra`` (the shared expert's) is added to it. The kernel adds them all as
        it reads them, in pair_sum's order then the addition's. ``then``: the next sublayer's mixer linear (its
        ``hc.fn``) where that sublayer runs next on the X returned (chained halves), which for a decode step's few
        rows the kernel starts on the streams it writes (hc_post_mix: the parts :meth:`hc_pre` would otherwise make
        in a launch of its own, hc_mix_parts, on every sublayer's critical path)."""
        kernels = self.kernels
        self._started = None
        if kernels is not None:
            fn = self._mixer_bytes(then, *X.shape)
            if fn is None:
                return kernels.hc_post(y, X, post, comb, pairs, extra)
            X_new, mix, gram = kernels.hc_post_mix(y, X, post, comb, pairs, extra, fn)
            self._started = _Started(X_new, then, mix, gram)
            return X_new
        if pairs > 1:
            y = self.pair_sum(y, pairs)
        return hc.hc_post(self.xp, y if extra is None else y + extra, X, post, comb)

    @classmethod
    def _mixer_bytes(cls, fn, T: int, n: int, E: int):
        """The F16 bytes of an HC mixer's linear ``fn`` over streams ``[T, n, E]`` where the kernels make its product
        as hc_post_mix's parts (hc_mix_parts where no hc_post started it), else None."""
        raw = cls._f16_bytes(fn, T, n * E) if n <= HC_MAX else None
        return raw if raw is not None and raw.shape[0] == 2 * n + n * n else None

    @staticmethod
    def _f16_bytes(proj, T: int, K: int):
        """The F16 bytes ``[N, K·2]`` of linear ``proj`` where a kernel can start its product of a decode step's few
        rows ``[T, K]`` (hc_post_mix, hc_pre_then), else None."""
        if proj is None or T > HC_MIX_MAX_ROWS or getattr(proj, "qtype", None) != Q.F16 or proj.ne0 != K:
            return None
        return proj.raw

    # -- mixture of experts ---------------------------------------------------------------------------
    def moe_route(self, logits, bias, k: int, scale: float, table=None, tokens=None):
        """A few tokens' routing without leaving the device (docs/MODEL.md, "Mixture of experts"):
        ``(probs, selected, weights)`` from the router's ``logits [T, n_expert]`` (or :meth:`split_sums`' of them).
        Experts are the top k of probs + ``bias`` (None: no bias) in :func:`ds4lab.model.moe.select_topk`'s order
        or, given the hash ``table`` (a device array), its rows of ``tokens`` (host or device ids)."""
        xp, kernels = self.xp, self.kernels
        if table is not None and isinstance(tokens, np.ndarray):  # host ids: an eager step
            tokens = xp.array(tokens.astype(np.int32))
        if kernels is not None and logits.shape[-1] <= ROUTE_MAX_EXPERTS and k <= ROUTE_MAX_K:
            return kernels.moe_route(logits, bias, k, scale, table, tokens)
        if logits.ndim == 3 and kernels is not None:  # split_sums' parts, which only the kernel adds as it reads
            logits = kernels.add_splits(logits)
        probs = moe.router_probs(xp, logits)
        if table is not None:
            selected = table[tokens]
        else:
            selected = moe.select_topk_on_device(xp, probs if bias is None else probs + bias, k)
        return probs, selected, moe.route_weights(xp, probs, selected, scale)

    def swiglu(self, gate, up, clamp: float, weights=None):
        """:func:`ds4lab.model.moe.swiglu` of ``[P, F]`` rows (or :meth:`split_sums`' of them), times ``weights
        [P]`` (a pair's route weight) per row when given."""
        kernels = self.kernels
        if kernels is not None:
            return kernels.swiglu(gate, up, clamp, weights)
        mid = moe.swiglu(self.xp, gate, up, clamp)
        return mid if weights is None else mid * weights[:, None]

    def pair_sum(self, y, k: int):
        """``y [T·k, D]`` (a token's k routed-expert outputs in consecutive rows) summed per token: ``[T, D]``."""
        kernels = self.kernels
        if kernels is not None:
            return kernels.pair_sum(y, k)
        return y.reshape(-1, k, y.shape[-1]).sum(axis=1)
