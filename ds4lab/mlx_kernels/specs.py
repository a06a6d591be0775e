"""The kernels and the host-side plans their launches need, shared by the MLX and CuPy launchers.

``dequant_<type>``   GGUF rows → float32 rows (for chunk products through the library's GEMM)
``dequant_<type>_f16``  the same rounded to half, in float16 rows (the weights of half-operand chunk products)
``qmatmul_<type>``   x @ Wᵀ straight from the blocks, for a few tokens or (token, expert) pairs
``qmatmul_xq8_<type>``  the same with x quantized to int8 per block as ds4's decode does (``decode_matmul="q8"``)
``qmatmul_reduce``   the sum of qmatmul's K splits
``qgemm_<type>``     the same for a chunk: tiled, every (token, expert) pair of a projection in one launch
``qgemm_<type>_tf32``  the same on operands rounded to TF32 (``prefill_matmul="tf32"``)
``qgemm_<type>_f16``   the same on operands rounded to half (``prefill_matmul="f16"``)
``attend_partial``   split-key attention with an online softmax per split, a block of heads sharing each key
``attend_reduce``    merge the splits with the sink logit
``attend_chunk``     attention with sinks for a chunk of queries (prefill) in one pass, no score matrix
``attend_chunk_tf32``  the same on operands rounded to TF32 (``prefill_matmul="tf32"``)
``attend_chunk_f16``   the same on operands rounded to half (``prefill_matmul="f16"``)
``hc_pre``           the hyper-connection mixer after its linear (on the flat state: it divides by the RMS): pre, post,
                     Sinkhorn combine, x_in
``hc_pre_then``      the same, and the sublayer's first F16 product (the router) started on x_in, in parts
``hc_post``          the streams after a sublayer: post gates times its output plus the combined streams
``hc_post_mix``      the same, and the next sublayer's mixer product and the streams' Gram matrix, in parts
``hc_mix_parts``     those parts of streams as they are (the same bits as hc_post_mix's)
``rmsnorm``          one row per work-group
``rmsnorm_rope``     the same, and the rows with RoPE on their tail too (one launch for rmsnorm then rope)
``rmsnorm_parts``, ``rmsnorm_rope_parts``  the same of a product's K splits, added as they are read (no reduce)
``store_kv``         FP8 (non-RoPE dims) + F16 rounding of attention rows as they are written
``hadamard_fp4``     Walsh–Hadamard + FP4 rounding of the indexer's q and rows
``hadamard_fp4_rope``  the same after RoPE on each row's tail (the indexer's queries: one launch for rope then it)
``compress_pool``    the compressor's softmax pooling of every window of a chunk's timeline
``compress_state``   the compressor's pending state after a chunk
``add_ape``          the compressor's scores: the gate's output plus each position's APE row
``append_rows``      the compressed rows after a chunk: the windows it completed appended
``append_rows_in_place``  the same, written into the rows given (a CUDA graph's own state)
``compressed_visible``  how many compressed rows each query of a chunk sees, and the mask of them
``ring_write``       the raw ring after a chunk, each slot's position, and which slots each query sees
``ring_write_in_place``  the same, the chunk's rows written into the ring given
``indexer_scores``   the indexer's relu-weighted scores of every compressed row for a few queries
``indexer_chunk``    the same for a chunk: qgemm's tiles on the matrix units, each reduced over the heads
``indexer_allowed``  the rows each query may attend: its top-k visible rows, ties to the lower row
``rope``             RoPE on the tail dims of rows (and its inverse)
``swiglu``           the experts' clamped SwiGLU, times each pair's route weight when given
``pair_sum``         the routed experts' outputs summed per token, in pair order
``moe_route``        a few tokens' routing: sqrt-softplus probabilities, top-k (or hash) experts, their weights
``next_token_parts``  the token a decode step launched ahead takes (the greedy one, or ds4's default rule's draw),
                     in three kernels: each slice of the logits' keys,
``next_token_sums``  each slice's sum of the draw's weights,
``next_token_pick``  the slices merged, and the slice where the draw lands walked
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..arch import NEG_INF, coff, n_blocks
from ..quants import ACTIVATION_BLOCK
from .dialects import KernelSpec

DECODERS = {Q.F32: "dq_f32", Q.F16: "dq_f16", Q.Q8_0: "dq_q8_0", Q.Q2_K: "dq_q2_k", Q.Q4_K: "dq_q4_k",
            Q.IQ2_XXS: "dq_iq2_xxs", Q.MXFP4: "dq_mxfp4"}  # element k of a row; "dq8_..." decodes eight from k
MAX_PAIRS = 4  # pairs a qmatmul batch shares one decode of the weight row with
QMATMUL_SIMD_PER_GROUP = 4  # SIMD groups per work-group
QMATMUL_SIMD_ROWS = 8  # rows per SIMD group: they share each load of x
QMATMUL_UNROLL = 1  # steps of 256 elements (8 a lane) a lane loads before it adds them up (not the group32 loop)
# A batch of one pair (a decode step) takes its own loop. Compiled alone (a kernel for batches of one pair,
# 48 registers against 128, four times the occupancy) it ran slower on the H200: IQ2_XXS gate/up 36.8 → 42.8 µs,
# attn_output_b 18.3 → 24.0 µs; the 128-register kernel keeps more of a lane's loads in flight.
QMATMUL_SINGLE_PAIR = 1
# qmatmul splits K when rows x batches leave the GPU idle: into a power of two of splits, until there are
# QMATMUL_SIMD_GROUPS SIMD groups or a split would hold fewer than QMATMUL_MIN_SPLIT elements. Splits start
# at multiples of QMATMUL_SPLIT_ALIGN, so no GGUF block (32 or 256 elements) straddles two. With the 32-element
# decode loop, 1024 ran the routed IQ2_XXS gate/up 8% faster than 2048 on the H200 (28.7 → 26.4 µs: the
# 8x1s:1024 variant of qmatmul_bench.py, benchmarks/README.md) and attn_output_a 4%, the rest within 1%.
QMATMUL_SIMD_GROUPS = 1024
# Q8_0's products (read in tiles, layout.py) split K until this many times QMATMUL_SIMD_GROUPS: on the H200
# (qmatmul_bench.py, 2026-12-05) twice as many ran attn_output_b 15.0 -> 13.8 us (q8) and 16.8 -> 14.9 (float32),
# attn_output_a 10.6 -> 9.7 (q8; float32 12.1 -> 12.5), the rest within 0.2 us; the low-bit experts' products ran
# slower so (IQ2_XXS gate/up 18.7 -> 20.4 us, Q2_K down 13.8 -> 15.4) and keep QMATMUL_SIMD_GROUPS.
QMATMUL_Q8_0_GROUPS = 2
QMATMUL_SPLIT_ALIGN = 256
QMATMUL_MIN_SPLIT = 4 * QMATMUL_SPLIT_ALIGN
# qgemm's tiles: BM slots x BN rows of W per work-group, BK along K per shared-memory step, on a grid of
# WARPS_M x WARPS_N SIMD groups, each a (BM / WARPS_M) x (BN / WARPS_N) part of the tile on its matrix units.
# Of the shapes timed on the H200 (qgemm_bench --tiles), 64x128x32 on 2x2 SIMD groups ran the routed
# experts 16-17% faster than 64x64x32 and the dense Q8_0 chunk 19%; 128x64 ran them 1.6x slower.
QGEMM_BM, QGEMM_BN, QGEMM_BK, QGEMM_WARPS_M, QGEMM_WARPS_N = 64, 128, 32, 2, 2
# Q2_K's chunk products (the routed down projection) take 2 x QGEMM_WARPS_N_WIDE SIMD groups: half the jobs a
# thread, 64 registers, twice the SIMD groups an SM; on the H200 1.14x faster than 2 x 2, where IQ2_XXS (too few
# jobs for 8 SIMD groups), the dense Q8_0 product and indexer_chunk (F32) ran the same or slower.
QGEMM_WIDE_TYPES = frozenset({Q.Q2_K})
QGEMM_WARPS_N_WIDE = 4
QGEMM_SHARED_BYTES = 32768  # Metal's limit for a work-group
# A chunk's dense product of at most this many output rows (the HC mixers' 24) keeps float32 operands where the
# others take halves: it is bound by reading x, and rounding x to half would read it once more (on the H200 the
# mixer's 2048 x 16384 input: 133 µs with halves, 88 µs in float32).
FLOAT32_PRODUCT_ROWS = 32
ATTN_MAX_D = 512
ATTN_GROUP = 128  # threads per decode-attention work-group: 4 SIMD groups
# attend_partial's blocks: ATTN_ROWS heads per SIMD group, so ATTN_HEADS per work-group share each key it
# stages, ATTN_TILE keys at a time (16 KB of group-shared memory; ATTN_MAX_D a multiple of ATTN_GROUP). Its
# key splits: enough for about ATTN_GROUPS work-groups (two for each of the H200's 132 SMs), each of at least
# ATTN_MIN_SPLIT keys. The part_* rows it writes grow with the splits (about ATTN_GROUPS × ATTN_HEADS rows of
# D floats, 4 MB at D = 512), and attend_reduce reads them all.
ATTN_ROWS = 2
ATTN_HEADS = ATTN_ROWS * ATTN_GROUP // 32
ATTN_TILE = 8
ATTN_GROUPS = 256
ATTN_MIN_SPLIT = 32
# attend_chunk on the matrix units: a work-group of 8 SIMD groups per query and 16 heads (one 16-row tile),
# each SIMD group owning ATTN_MAX_D / 8 dims; keys 8 at a time as floats (one 8-column tile, 16 KB staged),
# 16 at a time as halves (attend_chunk_f16: one m16n8k16 step of p times the keys, the same 16 KB).
ATTN_CHUNK_GROUP = 256
ATTN_CHUNK_HEADS = 16
ATTN_CHUNK_KEYS = 8
ATTN_CHUNK_KEYS_F16 = 16
DEQUANT_GROUP = 256
HC_MAX = 5  # hyper-connection streams the mixer kernel handles: its n x n matrix on one SIMD group
HC_MIX_MAX = 2 * HC_MAX + HC_MAX * HC_MAX  # the mixer's rows (2n + n²) hc_post_mix makes
# the work-groups of a span of E sharing those rows in hc_post_mix (each holding HC_MIX_ROWS of them in registers),
# and in hc_pre_then the router's rows: a decode step's 16 spans read an F16 product's weights on 128 SMs, not 16
HC_MIX_SPLIT = HC_THEN_SPLIT = 8
HC_MIX_ROWS = -(-HC_MIX_MAX // HC_MIX_SPLIT)
HC_GRAM_MAX = HC_MAX * (HC_MAX + 1) // 2  # the entries of the streams' Gram matrix it makes too
# Up to this many tokens, a kernel starts the next F16 product on what it writes: hc_post the next sublayer's mixer
# (hc_post_mix), hc_pre the router (hc_pre_then). A chunk's products are GEMMs; in those kernels every token's groups
# would read the whole weight again.
HC_MIX_MAX_ROWS = 16
ROW_GROUP = 256  # threads per rmsnorm work-group
# Under this many rows, rmsnorm gives each row the launcher's wide_group of threads, and hc_pre spreads each
# token's x_in over E / ROW_GROUP work-groups: rows too few to fill the GPU with a group each.
RMSNORM_WIDE_ROWS = 64
STORE_KV_SIMD_GROUPS = 8  # under RMSNORM_WIDE_ROWS rows, store_kv gives each 64-block its SIMD group (up to 8)
ROUTE_MAX_EXPERTS = 1024  # experts moe_route ranks in group-shared memory (Flash: 256)
ROUTE_MAX_K = 32  # experts per token it selects (Flash: 6)
# next_token's slices: at most 128, of 1,024 ids at least (Flash's 129,280 logits: 127 of 1,018), a work-group of 256
# threads a slice; the pick's group of 1,024 walks one slice
NEXT_TOKEN_SLICES, NEXT_TOKEN_SLICE, NEXT_TOKEN_THREADS, NEXT_TOKEN_GROUP = 128, 1024, 256, 1024
NEXT_TOKEN_MAX_VOCAB = 1 << 24  # ids it compares as floats, exact below 2^24


def dequant_spec(qtype: Q, half: bool = False) -> KernelSpec:
    """``dequant_<type>``, or ``dequant_<type>_f16``: the values rounded to half in a float16 out."""
    name = f"dequant_{Q(qtype).name.lower()}" + ("_f16" if half else "")
    return KernelSpec(name, "dequant.body",
                      (("w", "uint8"), ("aux", "uint8"), ("dims", "int32")),
                      (("out", "float16" if half else "float32"),),
                      {"DEQUANT": DECODERS[Q(qtype)], "DEQUANT8": typed("dq8", qtype),
                       "OUT_VALUE": "to_half" if half else "", "STORE8": "store8_out_h" if half else "store8_out_f"})


def typed(prefix: str, qtype: Q) -> str:
    """common.h's function ``<prefix>_<type>`` for ``qtype``: ``typed("dq8", Q.Q8_0)`` is ``dq8_q8_0``, the
    eight-value decoder; also dot8_, group32_."""
    return DECODERS[Q(qtype)].replace("dq_", prefix + "_")


def qmatmul_spec(qtype: Q) -> KernelSpec:
    qtype = Q(qtype)
    return KernelSpec(f"qmatmul_{qtype.name.lower()}", "qmatmul.body",
                      (("x", "float32"), ("w", "uint8"), ("aux", "uint8"), ("order", "int32"), ("batches", "int32"),
                       ("dims", "int32")),
                      (("out", "float32"),),
                      {"DEQUANT": DECODERS[qtype], "DEQUANT8": typed("dq8", qtype),
                       **_decode_loop(qtype),
                       "MAX_PAIRS": MAX_PAIRS, "SIMD_ROWS": QMATMUL_SIMD_ROWS, "UNROLL": QMATMUL_UNROLL,
                       "SINGLE_PAIR": QMATMUL_SINGLE_PAIR})


# The types read in groups of 32 elements (common.h's group32_<type>) by the decode loop, a lane's elements a
# step (x by the loader named here); the rest take 8 (dot8_<type>). Of the prefill's weight slabs, IQ2_XXS's
# (qgemm's DQ32).
GROUP32_X_LOADERS = {Q.Q8_0: "load_x32", Q.IQ2_XXS: "load_x32", Q.Q2_K: "load_x32_q2_k"}
IQ2_TABLE_WORDS = 512  # IQ2_XXS's grid in qgemm's group-shared memory (the decode loops': common.h's)


def _decode_loop(qtype: Q) -> dict:
    grouped = qtype in GROUP32_X_LOADERS
    group32 = "group32_iq2_xxs_decode" if qtype == Q.IQ2_XXS else typed("group32", qtype)  # (the dialect's tables)
    return {"DOT32": int(grouped), "GROUP32": group32 if grouped else "0",
            "GROUP32_HALVES": int(qtype == Q.Q2_K), "LOAD_X32": GROUP32_X_LOADERS.get(qtype, "load_x32"),
            "DOT8": typed("dot8", qtype), "XSUM": int(qtype == Q.Q4_K),
            "IQ2_TABLES": int(qtype == Q.IQ2_XXS)}


# decode_matmul="q8": the types whose decode products take x quantized, and how (ds4.c quantizes x to Q8_0's blocks
# of 32 for Q8_0 weights and to Q8_K's of 256 for the routed experts' IQ2_XXS and Q2_K).
QUANT_X = {q: "quant_x32_q8_0" if size == 32 else "quant_x32_q8_k" for q, size in ACTIVATION_BLOCK.items()}
# Rows a SIMD group of qmatmul_xq8 takes (each step's quantized x shared by them). On the H200 (qmatmul_bench.py,
# one call, 2026-12-03) 16 ran faster than 8: routed gate/up 22.1 -> 19.2 us, attn_q_b 18.0 -> 14.4, attn_output_b
# 19.6 -> 16.7, attn_output_a 14.7 -> 12.9, but routed down (Q2_K) 13.0 -> 14.3; the whole model's decode 1.055x
# float32's with 16 (benchmarks/README.md). The float loop at 16 rows ran slower than at 8.
QMATMUL_XQ8_SIMD_ROWS = 16


def qmatmul_xq8_spec(qtype: Q) -> KernelSpec:
    """``qmatmul_xq8_<type>``: qmatmul for batches of one pair with x quantized per block (QUANT_X) and integer sums."""
    qtype = Q(qtype)
    if qtype not in QUANT_X:
        raise ValueError(f"decode products on quantized x exist for {', '.join(q.name for q in QUANT_X)}, "
                         f"not {qtype.name}")
    return KernelSpec(f"qmatmul_xq8_{qtype.name.lower()}", "qmatmul_xq8.body",
                      (("x", "float32"), ("w", "uint8"), ("aux", "uint8"), ("order", "int32"), ("batches", "int32"),
                       ("dims", "int32")),
                      (("out", "float32"),),
                      {**_decode_loop(qtype), "QUANT_X": QUANT_X[qtype], "SIMD_ROWS": QMATMUL_XQ8_SIMD_ROWS,
                       "XQ_SLOTS": 32 * QMATMUL_SIMD_PER_GROUP})


QMATMUL_REDUCE = KernelSpec("qmatmul_reduce", "qmatmul_reduce.body", (("part", "float32"), ("dims", "int32")),
                            (("out", "float32"),))


def qmatmul_splits(K: int, N: int, n_batches: int, rows: int | None = None, qtype: Q | None = None) -> tuple[int, int]:
    """``(S, chunk)``: qmatmul's K splits (see QMATMUL_SIMD_GROUPS, and QMATMUL_Q8_0_GROUPS for ``qtype`` Q8_0) and
    the elements of each but the last. Rounding the chunk up to the alignment can leave the last splits of a power
    of two empty: those are dropped, so S is a power of two when K is a multiple of S · QMATMUL_SPLIT_ALIGN.
    ``rows``: a SIMD group's (QMATMUL_SIMD_ROWS, or QMATMUL_XQ8_SIMD_ROWS for qmatmul_xq8)."""
    rows = rows or QMATMUL_SIMD_ROWS
    groups = QMATMUL_SIMD_GROUPS * (QMATMUL_Q8_0_GROUPS if qtype == Q.Q8_0 else 1)
    S = 1
    while -(-N // rows) * n_batches * S < groups and 2 * S * QMATMUL_MIN_SPLIT <= K:
        S *= 2
    chunk = -(-K // (S * QMATMUL_SPLIT_ALIGN)) * QMATMUL_SPLIT_ALIGN
    return -(-K // chunk), chunk


def _qgemm_inputs(operands: str) -> tuple:
    """qgemm's arguments; with half operands x comes as halves (rounded once by the launcher, not by each of the
    work-groups that read it)."""
    x = "float16" if operands == "f16" else "float32"
    return (("x", x), ("w", "uint8"), ("aux", "uint8"), ("order", "int32"), ("tiles", "int32"), ("dims", "int32"))


OPERANDS = ("float32", "tf32", "f16")  # what a chunk's products multiply (prefill_matmul)
_FLOAT_SLABS = {"SLAB_T": "float", "SLAB_VALUE": "", "SLAB_STORE8": "store8_f", "MMA_A": "MmaA", "MMA_B": "MmaB",
                "MMA_LOAD_A": "mma_load_a", "MMA_LOAD_B": "mma_load_b", "MMA_K": 8}
_HALF_SLABS = {"SLAB_T": "slab_h", "SLAB_VALUE": "to_slab_h", "SLAB_STORE8": "store8_h", "MMA_A": "MmaAh",
               "MMA_B": "MmaBh", "MMA_LOAD_A": "mma_load_a_h", "MMA_LOAD_B": "mma_load_b_h", "MMA_K": "MMA_K_H"}


def _precision(name: str, operands: str) -> tuple[str, dict]:
    """A matrix-unit kernel's name and MMA_STEP define: ``name`` with mma_step (3xTF32, float32 accuracy),
    ``name_tf32`` with mma_step_tf32 (operands rounded to TF32), or ``name_f16`` with mma_step_h (operands
    rounded to half, held as halves in group-shared memory where the dialect has half matrix units)."""
    if operands not in OPERANDS:
        raise ValueError(f"unknown operands {operands!r}; choose one of {', '.join(OPERANDS)}")
    step = {"float32": "mma_step", "tf32": "mma_step_tf32", "f16": "mma_step_h"}[operands]
    return (name if operands == "float32" else f"{name}_{operands}"), {"MMA_STEP": step}


def qgemm_spec(qtype: Q, operands: str = "float32") -> KernelSpec:
    """``qgemm_<type>``, or ``qgemm_<type>_tf32`` / ``_f16``: its products on operands rounded to TF32 / half."""
    name, step = _precision(f"qgemm_{Q(qtype).name.lower()}", operands)
    return KernelSpec(name, "qgemm.body", _qgemm_inputs(operands), (("out", "float32"),),
                      {**_qgemm_defines(qtype, operands == "f16"), **step, "INDEXER_SCORES": 0})


def indexer_chunk_spec(operands: str = "float32") -> KernelSpec:
    """``indexer_chunk`` (``_tf32``, ``_f16``): qgemm of the queries' head rows ``x [T·H, Dq]`` by the F32 indexer
    rows, whose tile is reduced to the scores Σ_h hw[t, h] · relu(dot) in place of being stored."""
    name, step = _precision("indexer_chunk", operands)
    return KernelSpec(name, "qgemm.body", (*_qgemm_inputs(operands), ("hw", "float32")), (("out", "float32"),),
                      {**_qgemm_defines(Q.F32, operands == "f16"), **step, "INDEXER_SCORES": 1})


def qgemm_warps(qtype: Q) -> tuple[int, int]:
    """The WARPS_M x WARPS_N SIMD groups of a qgemm work-group for ``qtype``'s weights."""
    return QGEMM_WARPS_M, QGEMM_WARPS_N_WIDE if Q(qtype) in QGEMM_WIDE_TYPES else QGEMM_WARPS_N


def qgemm_threads(qtype: Q) -> int:
    """Threads of a qgemm work-group for ``qtype``'s weights (indexer_chunk: F32's)."""
    warps_m, warps_n = qgemm_warps(qtype)
    return 32 * warps_m * warps_n


def _x_loaders(bm: int, bk: int, threads: int, half: bool) -> dict:
    """Who loads x's slab: X_LOADS jobs a thread, job r of thread tid at slot X_SLOT(r): a float a job (k the
    thread's tid % BK), or with halves eight k a job (tid % (BK / 8) the eighth), one 16-byte load each."""
    if half:
        return {"X_HALF": 1, "X_LOADS": bm * bk // 8 // threads,
                "X_SLOT(r)": f"((tid + (r) * {threads}u) / {bk // 8}u)"}
    return {"X_HALF": 0, "X_LOADS": bm * bk // threads, "X_SLOT(r)": f"(tid / {bk}u + {threads // bk}u * (r))"}


def _qgemm_defines(qtype: Q, half: bool = False) -> dict:
    bm, bn, bk, threads = QGEMM_BM, QGEMM_BN, QGEMM_BK, qgemm_threads(qtype)
    warps_m, warps_n = qgemm_warps(qtype)
    wm, wn = bm // warps_m, bn // warps_n
    if wm % 16 or wn % 8 or bk % 16 or threads % bk or bm % (threads // bk) or (bm * bk // 8) % threads:
        raise ValueError(f"qgemm tiles {bm}x{bn}x{bk} on {warps_m}x{warps_n} SIMD groups: each group's "
                         "part must be whole 16x8 tiles, BK a multiple of 16, and the loaders' rows must divide BM")
    # Slab rows of BK + 4 floats, or for half operands BK + HALF_SLAB_PAD of the dialect's slab_h: on CUDA 8
    # halves (16-byte aligned rows for ldmatrix, 80 bytes apart at BK = 32: the eight rows a matrix read takes
    # fall in distinct banks), elsewhere 4 floats holding the halves' values: the float slabs' room or less.
    lds = bk + 4
    slab_floats = (bm + bn) * lds
    ldc = bn + 4 if 4 * bm * (bn + 4) <= QGEMM_SHARED_BYTES else bn  # the padding only where it fits
    smem_floats = max(slab_floats, bm * ldc)  # the slabs of x and W, then the output tile over them
    if 4 * smem_floats > QGEMM_SHARED_BYTES:
        raise ValueError(f"qgemm tiles {bm}x{bn}x{bk} need more than {QGEMM_SHARED_BYTES} bytes of shared memory")
    # IQ2_XXS's weight slab: a loader a row's group of 32 (group32_iq2_xxs), its tables past the slabs, in the output
    # tile's room (used only after the last step); BK must divide its K (a multiple of 256). A job of one row a
    # thread puts a SIMD group's loads in 32 rows: on the H200 that ran IQ2_XXS's chunk products 1.22x faster,
    # and Q2_K's (its 32 consecutive elements: 32 bytes read) 2.5% and the dense Q8_0 product 24% slower than 8
    # elements a job (benchmarks/README.md, qgemm_bench.py), so those keep 8.
    tables_at = slab_floats
    dq32 = Q(qtype) == Q.IQ2_XXS and bk % 32 == 0 and 256 % bk == 0
    if dq32 and tables_at + IQ2_TABLE_WORDS > smem_floats:
        raise ValueError(f"qgemm tiles {bm}x{bn}x{bk} leave no room for IQ2_XXS's tables in shared memory")
    return {"DQ32": int(dq32), "GROUP32": typed("group32", qtype) if dq32 else "0", "TABLES_AT": tables_at,
            "IQ2_TABLE_WORDS": IQ2_TABLE_WORDS,
            "DEQUANT": DECODERS[Q(qtype)], "DEQUANT8": typed("dq8", qtype), "BM": bm, "BN": bn, "BK": bk,
            "LDC": ldc, "SMEM_FLOATS": smem_floats, "WARPS_N": warps_n, "WM": wm, "WN": wn, "MI": wm // 16,
            "NJ": wn // 8, **_x_loaders(bm, bk, threads, half),
            **({"LDS": f"({bk} + HALF_SLAB_PAD)", "WS": f"({bm} * LDS)", **_HALF_SLABS} if half
               else {"LDS": lds, "WS": bm * lds, **_FLOAT_SLABS})}


ATTEND_PARTIAL = KernelSpec("attend_partial", "attend_partial.body",
                            (("q", "float32"), ("keys", "float32"), ("vis", "uint8"), ("keys2", "float32"),
                             ("vis2", "uint8"), ("dims", "int32"), ("fparams", "float32")),
                            (("part_m", "float32"), ("part_l", "float32"), ("part_acc", "float32")),
                            {"MAX_D": ATTN_MAX_D, "THREADS": ATTN_GROUP, "SIMD_GROUPS": ATTN_GROUP // 32,
                             "ROWS": ATTN_ROWS, "TILE": ATTN_TILE})
ATTEND_REDUCE = KernelSpec("attend_reduce", "attend_reduce.body",
                           (("part_m", "float32"), ("part_l", "float32"), ("part_acc", "float32"),
                            ("sinks", "float32"), ("dims", "int32")),
                           (("out", "float32"),), {"ROPE": 0})
ATTEND_REDUCE_ROPE = KernelSpec("attend_reduce_rope", "attend_reduce.body",
                                (("part_m", "float32"), ("part_l", "float32"), ("part_acc", "float32"),
                                 ("sinks", "float32"), ("dims", "int32"), ("cos_t", "float32"), ("sin_t", "float32"),
                                 ("rope_dims", "int32")),
                                (("out", "float32"),), {"ROPE": 1})


def attend_chunk_spec(operands: str = "float32") -> KernelSpec:
    """``attend_chunk``, or ``attend_chunk_tf32`` / ``_f16``: its two products on operands rounded to TF32, or
    to half (q, the keys and p as halves in group-shared memory, 16 keys a tile)."""
    name, step = _precision("attend_chunk", operands)
    half = operands == "f16"
    slabs = _HALF_SLABS if half else _FLOAT_SLABS
    simd_groups, heads, d = ATTN_CHUNK_GROUP // 32, ATTN_CHUNK_HEADS, ATTN_MAX_D
    kt = ATTN_CHUNK_KEYS_F16 if half else ATTN_CHUNK_KEYS
    # Rows padded so that a fragment's eight row reads fall in distinct banks: 4 floats, or the dialect's
    # HALF_SLAB_PAD for halves (16-byte aligned rows for ldmatrix). The key rows, q's half-rows before and out's
    # half-rows after share the first room; the partial scores, p and the rows' factors follow.
    room = "ROOM(ROOM(KT * LDK * sizeof(SLAB_T), HEADS * LDQ * sizeof(SLAB_T)), HEADS * LDO * 4u)"
    return KernelSpec(name, "attend_chunk.body",
                      (("q", "float32"), ("keys", "float32"), ("vis", "uint8"), ("sinks", "float32"),
                       ("dims", "int32"), ("fparams", "float32")),
                      (("out", "float32"),),
                      {"MAX_D": d, "THREADS": ATTN_CHUNK_GROUP, "SIMD_GROUPS": simd_groups, "HEADS": heads,
                       "KT": kt, "DW": d // simd_groups, "HALF_D": d // 2, **slabs,
                       "MMA_LOAD_B_ROWS": "mma_load_b_rows_h" if half else "mma_load_b_rows",
                       "SLAB_PAD": "HALF_SLAB_PAD" if half else 4,
                       "LDQ": "(HALF_D + SLAB_PAD)", "LDK": "(MAX_D + SLAB_PAD)", "LDP": "(KT + SLAB_PAD)",
                       "LDO": "(HALF_D + 4u)", "ROOM(a, b)": "((a) > (b) ? (a) : (b))",
                       "PART_AT": f"({room} / 4u)", "P_AT": "(PART_AT + SIMD_GROUPS * HEADS * KT)",
                       "SCALE_AT": "(P_AT + HEADS * LDP * sizeof(SLAB_T) / 4u)", **step})


_HC_PRE_IN = (("mix", "float32"), ("scale", "float32"), ("base", "float32"), ("X", "float32"), ("w", "float32"),
              ("gram", "float32"), ("dims", "int32"), ("fparams", "float32"))
_HC_PRE_OUT = (("x_in", "float32"), ("post", "float32"), ("comb", "float32"))
# hc_pre_then's span of x_in: a SIMD group's 32 lanes of 8 elements (the launcher's spans no longer); its rows a SIMD
# group sums at once (their loads in flight together)
HC_THEN_SPAN = 32 * 8
_HC_PRE_DEFINES = {"HC_MAX": HC_MAX, "HC_GRAM_MAX": HC_GRAM_MAX, "HC_THEN_SPAN": HC_THEN_SPAN, "HC_THEN_ROWS": 4}
HC_PRE = KernelSpec("hc_pre", "hc_pre.body", _HC_PRE_IN, _HC_PRE_OUT,
                    {**_HC_PRE_DEFINES, "HC_THEN": 0, "HC_THEN_SPLIT": 1})
HC_PRE_THEN = KernelSpec("hc_pre_then", "hc_pre.body", (*_HC_PRE_IN, ("then_w", "uint8")),
                         (*_HC_PRE_OUT, ("then_out", "float32")),
                         {**_HC_PRE_DEFINES, "HC_THEN": 1, "HC_THEN_SPLIT": HC_THEN_SPLIT})
_HC_POST_IN = (("y", "float32"), ("X", "float32"), ("post", "float32"), ("comb", "float32"), ("extra", "float32"),
               ("dims", "int32"))
_HC_POST_DEFINES = {"HC_MAX": HC_MAX, "HC_MIX_SPLIT": HC_MIX_SPLIT, "HC_MIX_ROWS": HC_MIX_ROWS,
                    "HC_GRAM_MAX": HC_GRAM_MAX}
HC_POST = KernelSpec("hc_post", "hc_post.body", _HC_POST_IN, (("out", "float32"),), {**_HC_POST_DEFINES, "HC_MIX": 0})
_HC_PARTS_OUT = (("mix_out", "float32"), ("gram_out", "float32"))
HC_POST_MIX = KernelSpec("hc_post_mix", "hc_post.body", (*_HC_POST_IN, ("fn", "uint8")),
                         (("out", "float32"), *_HC_PARTS_OUT), {**_HC_POST_DEFINES, "HC_MIX": 1})
HC_MIX_PARTS = KernelSpec("hc_mix_parts", "hc_post.body", (("X", "float32"), ("dims", "int32"), ("fn", "uint8")),
                          _HC_PARTS_OUT, {**_HC_POST_DEFINES, "HC_MIX": 2})
_RMSNORM_IN = (("x", "float32"), ("w", "float32"), ("dims", "int32"), ("fparams", "float32"))
_RMSNORM_ROPE_IN = (("x", "float32"), ("w", "float32"), ("cos_t", "float32"), ("sin_t", "float32"), ("dims", "int32"),
                    ("fparams", "float32"))
RMSNORM = KernelSpec("rmsnorm", "rmsnorm.body", _RMSNORM_IN, (("y", "float32"),), {"ROPE": 0, "X_PARTS": 0})
RMSNORM_ROPE = KernelSpec("rmsnorm_rope", "rmsnorm.body", _RMSNORM_ROPE_IN, (("y", "float32"), ("rot", "float32")),
                          {"ROPE": 1, "X_PARTS": 0})
RMSNORM_PARTS = KernelSpec("rmsnorm_parts", "rmsnorm.body", _RMSNORM_IN, (("y", "float32"),), {"ROPE": 0, "X_PARTS": 1})
RMSNORM_ROPE_PARTS = KernelSpec("rmsnorm_rope_parts", "rmsnorm.body", _RMSNORM_ROPE_IN,
                                (("y", "float32"), ("rot", "float32")), {"ROPE": 1, "X_PARTS": 1})
STORE_KV = KernelSpec("store_kv", "store_kv.body", (("x", "float32"), ("dims", "int32")), (("y", "float32"),))
HADAMARD_FP4 = KernelSpec("hadamard_fp4", "hadamard_fp4.body",
                          (("x", "float32"), ("dims", "int32"), ("fparams", "float32")), (("y", "float32"),),
                          {"ROPE": 0})
HADAMARD_FP4_ROPE = KernelSpec("hadamard_fp4_rope", "hadamard_fp4.body",
                               (("x", "float32"), ("cos_t", "float32"), ("sin_t", "float32"), ("dims", "int32"),
                                ("fparams", "float32")),
                               (("y", "float32"),), {"ROPE": 1})

COMPRESS_POOL_SLICES = 8  # compress_pool's SIMD groups per output row and 32 channels, splitting the candidates
COMPRESS_POOL = KernelSpec("compress_pool", "compress_pool.body",
                           (("state_kv", "float32"), ("state_sc", "float32"), ("kv", "float32"), ("sc", "float32"),
                            ("pos0", "int32"), ("dims", "int32")),
                           (("out", "float32"),), {"SLICES": COMPRESS_POOL_SLICES})
COMPRESS_STATE = KernelSpec("compress_state", "compress_state.body",
                            (("state_kv", "float32"), ("state_sc", "float32"), ("kv", "float32"), ("sc", "float32"),
                             ("pos0", "int32"), ("n_valid", "int32"), ("dims", "int32")),
                            (("new_kv", "float32"), ("new_sc", "float32")),
                            # float32 NEG_INF, as the plain path stores it
                            {"NEG_INF": str(np.float32(NEG_INF)) + "f", "IN_PLACE": 0})
ADD_APE = KernelSpec("add_ape", "add_ape.body",
                     (("gate", "float32"), ("ape", "float32"), ("pos0", "int32"), ("dims", "int32")),
                     (("out", "float32"),))
PAIR_SUM = KernelSpec("pair_sum", "pair_sum.body", (("y", "float32"), ("dims", "int32")), (("out", "float32"),))
ROUND_HALF = KernelSpec("round_half", "round_half.body", (("x", "float32"), ("dims", "int32")), (("out", "float16"),))
APPEND_ROWS = KernelSpec("append_rows", "append_rows.body",
                         (("rows", "float32"), ("pooled", "float32"), ("pos0", "int32"), ("n_valid", "int32"),
                          ("dims", "int32")),
                         (("out", "float32"),), {"IN_PLACE": 0})
# The _in_place forms write a state array the caller owns (a CUDA graph's own copy: ds4lab.cuda.graphs) where the
# chunk changes it, passed as their output (the NumPy-interface launchers only: MLX's outputs are new arrays).
APPEND_ROWS_IN_PLACE = KernelSpec("append_rows_in_place", "append_rows.body",
                                  (("pooled", "float32"), ("pos0", "int32"), ("n_valid", "int32"), ("dims", "int32")),
                                  (("out", "float32"),), {"IN_PLACE": 1})
COMPRESS_STATE_IN_PLACE = KernelSpec("compress_state_in_place", "compress_state.body",
                                     (("kv", "float32"), ("sc", "float32"), ("pos0", "int32"), ("n_valid", "int32"),
                                      ("dims", "int32")),
                                     (("new_kv", "float32"), ("new_sc", "float32")),
                                     {"NEG_INF": str(np.float32(NEG_INF)) + "f", "IN_PLACE": 1})
COMPRESSED_VISIBLE = KernelSpec("compressed_visible", "compressed_visible.body",
                                (("pos0", "int32"), ("n_valid", "int32"), ("dims", "int32")),
                                (("n_vis", "int32"), ("visible", "uint8")))
RING_WRITE = KernelSpec("ring_write", "ring_write.body",
                        (("raw", "float32"), ("kv", "float32"), ("pos0", "int32"), ("n_valid", "int32"),
                         ("dims", "int32")),
                        (("out", "float32"), ("slot_pos", "int32"), ("visible", "uint8")), {"IN_PLACE": 0})
RING_WRITE_IN_PLACE = KernelSpec("ring_write_in_place", "ring_write.body",
                                 (("kv", "float32"), ("pos0", "int32"), ("n_valid", "int32"), ("dims", "int32")),
                                 (("out", "float32"), ("slot_pos", "int32"), ("visible", "uint8")), {"IN_PLACE": 1})

# indexer_scores: a work-group per query and INDEXER_ROWS compressed rows, q's head dim at most
# INDEXER_MAX_DQ (Flash: 128; the q rows staged take MAX_DQ × 33 floats of group-shared memory, the group's rows
# ROWS × MAX_DQ: 25 KB in all, under Metal's 32 KB). On CUDA its registers are capped for INDEXER_GROUPS_PER_SM
# groups an SM (64 a thread, no spills; left alone NVRTC took 78, three groups an SM, and a 32K context's 512
# groups took two rounds of the H100's 132 SMs).
INDEXER_GROUP = 256
INDEXER_ROWS = 16
INDEXER_MAX_DQ = 128
INDEXER_GROUPS_PER_SM = 4


def indexer_scores_fits(Dq: int) -> bool:
    """Whether indexer_scores takes heads of ``Dq`` dims: at most INDEXER_MAX_DQ, four at a time."""
    return Dq <= INDEXER_MAX_DQ and Dq % 4 == 0


INDEXER_SCORES = KernelSpec("indexer_scores", "indexer_scores.body",
                            (("q", "float32"), ("w", "float32"), ("k", "float32"), ("dims", "int32")),
                            (("out", "float32"),),
                            {"MAX_DQ": INDEXER_MAX_DQ, "ROWS": INDEXER_ROWS, "THREADS": INDEXER_GROUP,
                             "SIMD_GROUPS": INDEXER_GROUP // 32, "SG_ROWS": INDEXER_ROWS // (INDEXER_GROUP // 32)},
                            launch_bounds=(INDEXER_GROUP, INDEXER_GROUPS_PER_SM))

# Rows a thread of indexer_allowed keeps in registers: with a decode step's wide groups (1,024 threads), every row
# of a 32K context at ratio 4; a few queries' groups take no fewer threads than INDEXER_ALLOWED_MIN_GROUP.
INDEXER_ALLOWED_CACHED = 8
INDEXER_ALLOWED_MIN_GROUP = ROW_GROUP


def indexer_allowed_threads(T: int, N: int, wide_group: int) -> int:
    """indexer_allowed's group size for ``T`` queries over ``N`` rows: ROW_GROUP for a chunk; for a few queries (a
    decode step) the fewest threads that hold every row in registers, from INDEXER_ALLOWED_MIN_GROUP up to the
    launcher's ``wide_group`` (a 32K context's). Each of its passes (16 at most) costs every SIMD group its
    reductions, so threads past that cost time (decode_attention_bench.py: 1,024 rows took 21.3 µs on 1,024
    threads, 13.3 on 256)."""
    if T >= RMSNORM_WIDE_ROWS:
        return ROW_GROUP
    return min(wide_group, max(INDEXER_ALLOWED_MIN_GROUP, 32 * -(-N // (32 * INDEXER_ALLOWED_CACHED))))
INDEXER_ALLOWED = KernelSpec("indexer_allowed", "indexer_allowed.body",
                             (("score", "float32"), ("vis", "uint8"), ("n_vis", "int32"), ("dims", "int32")),
                             (("allowed", "uint8"),), {"CACHED": INDEXER_ALLOWED_CACHED})

ROPE = KernelSpec("rope", "rope.body",
                  (("x", "float32"), ("cos_t", "float32"), ("sin_t", "float32"), ("dims", "int32")),
                  (("y", "float32"),))

SWIGLU = KernelSpec("swiglu", "swiglu.body",
                    (("gate", "float32"), ("up", "float32"), ("w", "float32"), ("dims", "int32"),
                     ("fparams", "float32")),
                    (("out", "float32"),))
MOE_ROUTE = KernelSpec("moe_route", "moe_route.body",
                       (("logits", "float32"), ("bias", "float32"), ("table", "int32"), ("tokens", "int32"),
                        ("dims", "int32"), ("fparams", "float32")),
                       (("probs", "float32"), ("selected", "int32"), ("weights", "float32")),
                       {"MAX_EXPERTS": ROUTE_MAX_EXPERTS, "MAX_K": ROUTE_MAX_K})
_NEXT_TOKEN_DEFINES = {"NONE": f"{NEXT_TOKEN_MAX_VOCAB}u", "LOGIT_FLOOR": str(np.float32(NEG_INF)) + "f",
                       "EXCLUDED(i)": "(has_mask && ((uint(mask[(i) >> 5]) >> ((i) & 31u)) & 1u) != 0u)",
                       "FINITE(x)": "((as_bits(x) & 0x7f800000u) != 0x7f800000u)",  # by its bits: fast math too
                       # key (m, n) takes (x, y) where x is larger, or equal with a larger negated id (a lower id)
                       "TAKE_FIRST_MAX(m, n, x, y)":
                           "if ((x) > (m) || ((x) == (m) && (y) > (n))) { m = (x); n = (y); }",
                       # a draw's weight w of id i (logit x) from the kernel's top, t and min_rel: exp((x - top) / t),
                       # -1 where the rule does not keep the id (excluded, not finite, or a weight under min_rel)
                       "DRAW_WEIGHT(w, i, x)": "float w = EXCLUDED(i) || !FINITE(x) ? -1.0f : exp(((x) - top) / t); "
                                               "w = w < min_rel ? -1.0f : w"}
NEXT_TOKEN_PARTS = KernelSpec("next_token_parts", "next_token_parts.body",
                              (("logits", "float32"), ("mask", "int32"), ("dims", "int32")),
                              (("parts", "float32"),), _NEXT_TOKEN_DEFINES)
NEXT_TOKEN_SUMS = KernelSpec("next_token_sums", "next_token_sums.body",
                             (("logits", "float32"), ("parts", "float32"), ("mask", "int32"), ("dims", "int32"),
                              ("fparams", "float32")),
                             (("sums", "float32"),), _NEXT_TOKEN_DEFINES)
NEXT_TOKEN_PICK = KernelSpec("next_token_pick", "next_token_pick.body",
                             (("logits", "float32"), ("parts", "float32"), ("sums", "float32"), ("mask", "int32"),
                              ("dims", "int32"), ("fparams", "float32")),
                             (("token", "int32"),), _NEXT_TOKEN_DEFINES)


def all_specs() -> list[KernelSpec]:
    return [*(dequant_spec(q, half) for half in (False, True) for q in DECODERS), *(qmatmul_spec(q) for q in DECODERS),
            *(qmatmul_xq8_spec(q) for q in QUANT_X), QMATMUL_REDUCE,
            *(qgemm_spec(q, operands) for operands in OPERANDS for q in DECODERS),
            *(indexer_chunk_spec(operands) for operands in OPERANDS),
            ATTEND_PARTIAL, ATTEND_REDUCE, ATTEND_REDUCE_ROPE, *(attend_chunk_spec(operands) for operands in OPERANDS),
            HC_PRE, HC_PRE_THEN, HC_POST, HC_POST_MIX, HC_MIX_PARTS, RMSNORM, RMSNORM_ROPE, RMSNORM_PARTS,
            RMSNORM_ROPE_PARTS, STORE_KV, HADAMARD_FP4,
            HADAMARD_FP4_ROPE,
            COMPRESS_POOL, COMPRESS_STATE, ADD_APE, APPEND_ROWS, APPEND_ROWS_IN_PLACE, COMPRESS_STATE_IN_PLACE,
            COMPRESSED_VISIBLE, RING_WRITE, RING_WRITE_IN_PLACE, INDEXER_SCORES, INDEXER_ALLOWED, ROPE, SWIGLU,
            PAIR_SUM, MOE_ROUTE, NEXT_TOKEN_PARTS, NEXT_TOKEN_SUMS, NEXT_TOKEN_PICK, ROUND_HALF]


def pair_batches(experts: np.ndarray | None, n_pairs: int, size: int = MAX_PAIRS) -> tuple[np.ndarray, np.ndarray]:
    """``(order, batches)``: pairs grouped by expert (a stable sort), each expert's run of slots cut into
    batches ``(expert, first slot, count)`` of at most ``size`` (MAX_PAIRS for qmatmul, QGEMM_BM for qgemm's
    tiles); slot i holds pair ``order[i]``. ``experts`` None means one matrix for every pair (a dense linear)."""
    if experts is None:
        order = np.arange(n_pairs, dtype=np.int32)
        sorted_e = np.zeros(n_pairs, dtype=np.int64)
    else:
        order = np.argsort(experts, kind="stable").astype(np.int32)
        sorted_e = np.asarray(experts)[order]
    starts = np.flatnonzero(np.r_[True, sorted_e[1:] != sorted_e[:-1]])
    runs = np.r_[starts[1:], n_pairs] - starts
    cuts = -(-runs // size)  # batches per run
    run = np.repeat(np.arange(len(starts)), cuts)
    first = starts[run] + size * (np.arange(len(run)) - np.repeat(np.cumsum(cuts) - cuts, cuts))
    count = np.minimum(size, starts[run] + runs[run] - first)
    return order, np.stack([sorted_e[starts[run]], first, count], axis=1).astype(np.int32).reshape(-1, 3)


def pool_shape(ratio: int, C: int, W: int) -> tuple[int, int]:
    """Rows and width of the pooled windows of a C-row chunk (see ``compressor.pool_windows``)."""
    c = coff(ratio)
    return n_blocks(ratio, C) - (c - 1), W // c


def check_hc_streams(kernel: str, n: int) -> None:
    """The hyper-connection kernels hold a token's n streams (and hc_pre its n x n matrix) in fixed room."""
    if not 1 <= n <= HC_MAX:
        raise ValueError(f"{kernel} kernel: {n} hyper-connection streams (it takes 1 to {HC_MAX})")


def _check_head_dim(D: int) -> None:
    if D > ATTN_MAX_D:
        raise ValueError(f"attention kernel: head_dim {D} exceeds {ATTN_MAX_D}")


def attend_partial_dims(T: int, H: int, D: int, N: int, N1: int | None = None) -> np.ndarray:
    """attend_partial's dims ``[T, H, D, N, splits, keys_per_split, N1]`` (``N1``: the keys in its first array, all
    ``N`` when None): split s holds the keys n ≡ s (mod splits), at most keys_per_split of them; splits enough
    for about ATTN_GROUPS work-groups of ATTN_MIN_SPLIT keys or more (one split when N is smaller)."""
    _check_head_dim(D)
    splits = max(1, min(-(-ATTN_GROUPS // (T * attend_partial_head_blocks(H))), N // ATTN_MIN_SPLIT))
    return np.array([T, H, D, N, splits, -(-N // splits), N if N1 is None else N1], dtype=np.int32)


def attend_partial_head_blocks(H: int) -> int:
    """attend_partial's blocks of ATTN_HEADS heads: its grid is (T × blocks, splits)."""
    return -(-H // ATTN_HEADS)


def attend_chunk_groups(T: int, H: int, D: int) -> tuple[int, int]:
    """The chunk kernel's grid: one work-group per query and block of heads."""
    _check_head_dim(D)
    return T, -(-H // ATTN_CHUNK_HEADS)
