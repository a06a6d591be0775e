"""One kernel body, two languages: the dialect preludes that map the portable names onto CUDA or Metal.

A body (``sources/*.body``) is the inside of a kernel function. It uses

    GROUP_ID_X, GROUP_ID_Y     the work-group's index in the grid (CUDA blockIdx, Metal threadgroup position)
    THREAD_IN_GROUP            the thread's index in its 1-D group (threadIdx.x / thread_position_in_threadgroup.x)
    GROUP_THREADS              the group's size
    GROUP_SHARED, GROUP_BARRIER()   group-shared memory and the barrier over it
    GLOBAL                     the address space of kernel arguments (empty in CUDA, ``device`` in Metal)
    SHARED_ARG                 the address space of a group-shared array passed to a function (Metal's ``threadgroup``)
    simd_sum_f(x), simd_max_f(x), simd_shuffle_f(x, lane)   SIMD-group sums, maxima and lane reads
    load_half(p), f16_round(x), as_bits(x), from_bits(u), log1p_f(x), DEVICE_FN   from the dialect header too
    half_t, to_half(x)         the dialect's half type (a "float16" argument's elements) and x rounded to it
    half_bits_f32(h)           the half whose bits are the low 16 of h, as a float
    byte_f32_bits(w, i)        the bits of the float 2^23 + (byte i of w) (CUDA: one byte permute)
    popcount_u(x)              the number of bits set in x (CUDA: one POPC)
    dot4_i8(a, b, c)           c + the sum of the four products of a's and b's bytes as signed int8 (CUDA: one dp4a)
    div_rn(a, b)               a / b rounded to nearest (Metal's fast division would not be)
    grid_dependency_wait()     wait for the kernel before this one on its stream to end and its writes to be seen
                               (CUDA's programmatic launches, on compute capability 9 on; a no-op elsewhere): at the
                               top of every CUDA kernel, unless its body calls it after reading only what no kernel
                               writes (weights, launch constants)
    rint_bits(v)               a word whose low byte is v rounded to the nearest integer (half to even) as an
                               int8, for |v| < 128 (CUDA: one add)
    pack_bytes(a, b, c, d)     the low bytes of a, b, c, d in one word, a's lowest (CUDA: three byte permutes)
    store_f4_shared(p, a, b, c, d), load_f4_shared(p)   four floats to or from 16-byte aligned group-shared memory
    load_u16(p), load_u32(p), load_u2(p), load_f4(p), load_u4(p)   little-endian loads at 2-, 4-, 8- and 16-byte
                               aligned addresses
                               (the CPU dialect stops the process at a misaligned one, where a GPU would fault)
    MmaA, MmaB, MmaTile, mma_load_a, mma_load_b, mma_zero, mma_step, mma_store   a SIMD group's matrix
        units: C[16 x 8] += A[16 x 8] B[8 x 8] from group-shared floats at float32 accuracy;
        mma_step_tf32 the same product on operands rounded to TF32 (CUDA: a third of the tensor-core work);
        mma_load_b_rows (B stored k-major), mma_scale_rows(t, s, lane) (row m of C times s[m])
    slab_h, to_slab_h, store_h8_shared, MmaAh, MmaBh, mma_load_a_h, mma_load_b_h, mma_load_b_rows_h, mma_step_h,
        MMA_K_H, HALF_SLAB_PAD   the same on operands rounded to half, MMA_K_H along k a step (CUDA: halves in
        group-shared memory read by ldmatrix, mma.sync m16n8k16; elsewhere floats holding the halves' values);
        slab_h8_from(dst, src, n, vec) the first n of eight half_t into a slab row (vec: one 16-byte copy);
        store_h8(p, a, ..., h) eight floats rounded to half_t at 16-byte aligned global p

plus the kernel's own constants (``defines``), which become ``#define`` lines before the body. A SIMD
group is 32 threads in both languages (a CUDA warp, an Apple simdgroup). Everything else is the
common subset of CUDA C++ and the Metal Shading Language: scalar types, ``uint``, ``float(x)``
casts, ``exp``/``max``/``min``, arrays, loops.

``KernelSpec.mlx_source(dialect)`` gives the (header, source) pair for ``mx.fast.metal_kernel`` (MLX
writes the signature from the input and output names; the tests render the "cuda" dialect the same way);
``cuda_module_source(specs)`` gives one translation unit with full ``extern "C"`` signatures (CuPy, and
the cubins MLX-CUDA launches);
``cpu_module_source(specs)`` the same bodies for the CPU emulator that runs them in the CPU test suite.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SOURCES = Path(__file__).parent / "sources"
DIALECTS = ("cuda", "metal", "cpu")

_COMMON_HEADER = "#define NEG_BIG (-3.0e38f)\n"

CUDA_HEADER = _COMMON_HEADER + """#include <cuda_fp16.h>
#define GLOBAL
#define SHARED_ARG
#define DEVICE_FN __device__ inline
#define IQ2_SIGNED_GRID 1  // the decode products' IQ2_XXS tables (common.h)
typedef unsigned int uint;
// Hopper's programmatic dependent launch (ds4lab.cuda.driver.launch): a kernel may be launched before the one before
// it on the stream has ended (as its work-groups exit, without the gap of a full launch) and waits here for it to end
// and its writes to be seen, before it reads anything a kernel writes. It does not let the next launch start early
// (griddepcontrol.launch_dependents at the top, tried: a float32 step 7% slower than this, q8 1%; the next kernels'
// waiting work-groups likely held SMs that side branches needed). A launch without the attribute (MLX's) waits for
// nothing here.
DEVICE_FN void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
DEVICE_FN float load_half(const uint8_t* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }
DEVICE_FN float half_bits_f32(uint h) { return __half2float(__ushort_as_half((unsigned short)h)); }
DEVICE_FN uint load_u16(const uint8_t* p) { return *reinterpret_cast<const unsigned short*>(p); }
DEVICE_FN uint load_u32(const uint8_t* p) { return *reinterpret_cast<const uint*>(p); }
DEVICE_FN uint2 load_u2(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }
DEVICE_FN float4 load_f4(const float* p) { return *reinterpret_cast<const float4*>(p); }
DEVICE_FN float4 load_f4_shared(const float* p) { return *reinterpret_cast<const float4*>(p); }
DEVICE_FN uint4 load_u4(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
DEVICE_FN float simd_sum_f(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
DEVICE_FN float simd_max_f(float x) {
    for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
DEVICE_FN float simd_shuffle_f(float x, uint lane) { return __shfl_sync(0xffffffffu, x, int(lane)); }
DEVICE_FN float f16_round(float x) { return __half2float(__float2half_rn(x)); }
typedef __half half_t;
DEVICE_FN half_t to_half(float x) { return __float2half_rn(x); }
DEVICE_FN uint as_bits(float x) { return __float_as_uint(x); }
DEVICE_FN float from_bits(uint u) { return __uint_as_float(u); }
DEVICE_FN uint byte_f32_bits(uint w, uint i) { return __byte_perm(w, 0x4B000000u, 0x7540u + i); }  // one PRMT
DEVICE_FN uint popcount_u(uint x) { return uint(__popc(x)); }
DEVICE_FN int dot4_i8(uint a, uint b, int c) { return __dp4a(int(a), int(b), c); }
DEVICE_FN float div_rn(float a, float b) { return __fdiv_rn(a, b); }
// 1.5 * 2^23 + v holds v's nearest integer in its low mantissa bits; __fadd_rn is never fused with a product.
DEVICE_FN uint rint_bits(float v) { return __float_as_uint(__fadd_rn(v, 12582912.0f)); }
DEVICE_FN uint pack_bytes(uint a, uint b, uint c, uint d) {
    return __byte_perm(__byte_perm(a, b, 0x0040u), __byte_perm(c, d, 0x0040u), 0x5410u);
}
DEVICE_FN void store_f4_shared(float* p, float a, float b, float c, float d) { *(float4*)p = make_float4(a, b, c, d); }
DEVICE_FN float log1p_f(float x) { return log1pf(x); }
// Tensor cores (mma.sync m16n8k8, TF32 in, float32 accumulate) at float32 accuracy: each operand is split
// into a TF32 part and the TF32 rounding of what is left (3xTF32: big*big + big*small + small*big, the
// small products first). Fragment layout (PTX ISA): lane = 4 g + i holds A rows g, g + 8 at columns i,
// i + 4; B column g at rows i, i + 4; C rows g, g + 8 at columns 2i, 2i + 1.
struct MmaA { uint big[4]; uint small[4]; };
struct MmaB { uint big[2]; uint small[2]; };
struct MmaTile { float c[4]; };
DEVICE_FN uint tf32_of(float x) {
    uint r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
DEVICE_FN void tf32_split(float x, uint& big, uint& small) {
    big = tf32_of(x);
    small = tf32_of(x - __uint_as_float(big));
}
DEVICE_FN void mma_load_a(MmaA& f, const float* p, uint stride) {  // A[m][k] = p[m * stride + k]
    uint g = (threadIdx.x & 31u) >> 2, i = threadIdx.x & 3u;
    for (uint r = 0; r < 4u; r++)
        tf32_split(p[(g + 8u * (r & 1u)) * stride + i + 4u * (r >> 1)], f.big[r], f.small[r]);
}
DEVICE_FN void mma_load_b(MmaB& f, const float* p, uint stride) {  // B[k][n] = p[n * stride + k]
    uint g = (threadIdx.x & 31u) >> 2, i = threadIdx.x & 3u;
    for (uint r = 0; r < 2u; r++) tf32_split(p[g * stride + i + 4u * r], f.big[r], f.small[r]);
}
DEVICE_FN void mma_load_b_rows(MmaB& f, const float* p, uint stride) {  // B[k][n] = p[k * stride + n]
    uint g = (threadIdx.x & 31u) >> 2, i = threadIdx.x & 3u;
    for (uint r = 0; r < 2u; r++) tf32_split(p[(i + 4u * r) * stride + g], f.big[r], f.small[r]);
}
DEVICE_FN void mma_zero(MmaTile& t) { for (uint r = 0; r < 4u; r++) t.c[r] = 0.0f; }
DEVICE_FN void mma_scale_rows(MmaTile& t, const float* s, uint lane) {
    float top = s[lane >> 2], bottom = s[(lane >> 2) + 8u];
    t.c[0] *= top; t.c[1] *= top; t.c[2] *= bottom; t.c[3] *= bottom;
}
DEVICE_FN void mma_tf32(MmaTile& t, const uint* a, const uint* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(t.c[0]), "+f"(t.c[1]), "+f"(t.c[2]), "+f"(t.c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
DEVICE_FN void mma_step(MmaTile& t, const MmaA& a, const MmaB& b) {
    mma_tf32(t, a.small, b.big);
    mma_tf32(t, a.big, b.small);
    mma_tf32(t, a.big, b.big);
}
// One product of the TF32 parts (the small ones are then never computed): operands with 10 mantissa bits,
// float32 accumulation, as ds4's GPU prefill casts both operands of its products to half.
DEVICE_FN void mma_step_tf32(MmaTile& t, const MmaA& a, const MmaB& b) { mma_tf32(t, a.big, b.big); }
DEVICE_FN void mma_store(const MmaTile& t, float* p, uint stride) {  // C[m][n] -> p[m * stride + n]
    uint g = (threadIdx.x & 31u) >> 2, i = threadIdx.x & 3u;
    for (uint r = 0; r < 4u; r++) p[(g + 8u * (r >> 1)) * stride + 2u * i + (r & 1u)] = t.c[r];
}
// Half operands: slabs of halves in group-shared memory, a SIMD group's fragments read by ldmatrix (one
// instruction for a 16 x 16 A, one for a 16 x 8 B, rows 16-byte aligned), one mma.sync m16n8k16 (f16 in,
// float32 accumulate) a 16 x 8 x 16 step: half the shared-memory bytes of float slabs and twice TF32's rate.
#define MMA_K_H 16
#define HALF_SLAB_PAD 8  // a slab row is BK + 8 halves
typedef __half slab_h;
struct MmaAh { uint r[4]; };
struct MmaBh { uint r[2]; };
DEVICE_FN uint half2_bits(float a, float b) {  // a in the low half, as a half2 register holds element 0
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint*>(&h);
}
DEVICE_FN slab_h to_slab_h(float x) { return __float2half_rn(x); }
DEVICE_FN void store_h8_shared(slab_h* p, float a, float b, float c, float d, float e, float f, float g, float h) {
    *reinterpret_cast<uint4*>(p) = make_uint4(half2_bits(a, b), half2_bits(c, d), half2_bits(e, f), half2_bits(g, h));
}
// The first n of the eight halves at src into a slab row, zeros after: one 16-byte copy where all eight are there
// and src is 16-byte aligned (vec).
DEVICE_FN void slab_h8_from(slab_h* dst, const half_t* src, uint n, bool vec) {
    if (vec && n >= 8u) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        return;
    }
    for (uint i = 0; i < 8u; i++) dst[i] = i < n ? src[i] : __float2half_rn(0.0f);
}
DEVICE_FN void store_h8(half_t* p, float a, float b, float c, float d, float e, float f, float g, float h) {
    *reinterpret_cast<uint4*>(p) = make_uint4(half2_bits(a, b), half2_bits(c, d), half2_bits(e, f), half2_bits(g, h));
}
DEVICE_FN uint shared_address(const void* p) { return uint(__cvta_generic_to_shared(p)); }
DEVICE_FN void mma_load_a_h(MmaAh& f, const slab_h* p, uint stride) {  // A[m][k] = p[m * stride + k], 16 x 16
    uint lane = threadIdx.x & 31u;  // lanes 8q .. 8q + 7 give the rows of matrix q: rows 8 (q & 1) +, k 8 (q >> 1) +
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
                 : "r"(shared_address(p + (lane & 15u) * stride + 8u * (lane >> 4))) : "memory");
}
DEVICE_FN void mma_load_b_h(MmaBh& f, const slab_h* p, uint stride) {  // B[k][n] = p[n * stride + k], 16 x 8
    uint lane = threadIdx.x & 31u;  // lanes 0-7: rows n at k 0-7, lanes 8-15 at k 8-15 (the others' unused)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(f.r[0]), "=r"(f.r[1])
                 : "r"(shared_address(p + (lane & 7u) * stride + 8u * ((lane >> 3) & 1u))) : "memory");
}
DEVICE_FN void mma_load_b_rows_h(MmaBh& f, const slab_h* p, uint stride) {  // B[k][n] = p[k * stride + n], 16 x 8
    uint lane = threadIdx.x & 31u;  // lanes 0-15: rows k 0-15, transposed as they load (the others' unused)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(f.r[0]), "=r"(f.r[1])
                 : "r"(shared_address(p + (lane & 15u) * stride)) : "memory");
}
DEVICE_FN void mma_step_h(MmaTile& t, const MmaAh& a, const MmaBh& b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(t.c[0]), "+f"(t.c[1]), "+f"(t.c[2]), "+f"(t.c[3])
                 : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}
"""

# Half operands where there is no half matrix unit to use (Metal, the CPU emulator): float slabs holding the
# halves' values (rounded to nearest even, as CUDA's __float2half_rn), products in float32 (exact for halves),
# 8 k a step.
_FLOAT_HALVES = """#define MMA_K_H 8
#define HALF_SLAB_PAD 4  // a slab row is BK + 4 floats, as float slabs are
typedef float slab_h;
typedef MmaA MmaAh;
typedef MmaB MmaBh;
#define to_slab_h f16_round
#define mma_load_a_h mma_load_a
#define mma_load_b_h mma_load_b
#define mma_load_b_rows_h mma_load_b_rows
#define mma_step_h mma_step
DEVICE_FN void store_h8_shared(SHARED_ARG float* p, float a, float b, float c, float d, float e, float f, float g,
                               float h) {
    store_f4_shared(p, f16_round(a), f16_round(b), f16_round(c), f16_round(d));
    store_f4_shared(p + 4u, f16_round(e), f16_round(f), f16_round(g), f16_round(h));
}
DEVICE_FN void store_h8(GLOBAL half_t* p, float a, float b, float c, float d, float e, float f, float g, float h) {
    CHECK_ALIGNED16(p);
    p[0] = to_half(a); p[1] = to_half(b); p[2] = to_half(c); p[3] = to_half(d);
    p[4] = to_half(e); p[5] = to_half(f); p[6] = to_half(g); p[7] = to_half(h);
}
DEVICE_FN void slab_h8_from(SHARED_ARG float* dst, const GLOBAL half_t* src, uint n, bool vec) {
    if (vec && n >= 8u) CHECK_ALIGNED16(src);  // where a GPU would take one 16-byte load
    for (uint i = 0; i < 8u; i++) dst[i] = i < n ? float(src[i]) : 0.0f;
}
"""

METAL_HEADER = _COMMON_HEADER + """#define GLOBAL device
#define SHARED_ARG threadgroup
#define DEVICE_FN inline
// The decode products' IQ2_XXS tables: the plain grid (2 KB), not the signed one (32 KB: all the threadgroup memory
// a work-group may have, which on an Apple GPU would leave room for few work-groups a core)
#define IQ2_SIGNED_GRID 0
#define CHECK_ALIGNED16(p)
DEVICE_FN void grid_dependency_wait() {}
DEVICE_FN float load_half(const device uint8_t* p) { return float(*(const device half*)p); }
DEVICE_FN float half_bits_f32(uint h) { return float(as_type<half>(ushort(h))); }
DEVICE_FN uint load_u16(const device uint8_t* p) { return *(const device ushort*)p; }
DEVICE_FN uint load_u32(const device uint8_t* p) { return *(const device uint*)p; }
DEVICE_FN uint2 load_u2(const device uint8_t* p) { return *(const device uint2*)p; }
DEVICE_FN float4 load_f4(const device float* p) { return *(const device float4*)p; }
DEVICE_FN float4 load_f4_shared(const threadgroup float* p) { return *(const threadgroup float4*)p; }
DEVICE_FN uint4 load_u4(const device uint8_t* p) { return *(const device uint4*)p; }
DEVICE_FN float simd_sum_f(float x) { return simd_sum(x); }
DEVICE_FN float simd_max_f(float x) { return simd_max(x); }
DEVICE_FN float simd_shuffle_f(float x, uint lane) { return simd_shuffle(x, ushort(lane)); }
DEVICE_FN float f16_round(float x) { return float(half(x)); }
typedef half half_t;
DEVICE_FN half_t to_half(float x) { return half(x); }
DEVICE_FN uint as_bits(float x) { return as_type<uint>(x); }
DEVICE_FN float from_bits(uint u) { return as_type<float>(u); }
DEVICE_FN uint byte_f32_bits(uint w, uint i) { return 0x4B000000u | ((w >> (8u * i)) & 255u); }
DEVICE_FN uint popcount_u(uint x) { return popcount(x); }
DEVICE_FN int dot4_i8(uint a, uint b, int c) {
    char4 x = as_type<char4>(a), y = as_type<char4>(b);
    return c + int(x.x) * int(y.x) + int(x.y) * int(y.y) + int(x.z) * int(y.z) + int(x.w) * int(y.w);
}
DEVICE_FN float div_rn(float a, float b) { return metal::precise::divide(a, b); }
DEVICE_FN uint rint_bits(float v) { return uint(int(rint(v))); }
DEVICE_FN uint pack_bytes(uint a, uint b, uint c, uint d) {
    return (a & 255u) | ((b & 255u) << 8) | ((c & 255u) << 16) | (d << 24);
}
DEVICE_FN void store_f4_shared(threadgroup float* p, float a, float b, float c, float d) {
    *(threadgroup float4*)p = float4(a, b, c, d);
}
// Metal has no log1p: this is the one MLX's own kernels compute (Goldberg's, accurate to a few ulps).
DEVICE_FN float log1p_f(float x) {
    float u = 1.0f + x;
    return u == 1.0f ? x : x * (log(u) / (u - 1.0f));
}
// The SIMD group's matrix units in float32: a 16 x 8 tile is two 8 x 8 simdgroup matrices.
struct MmaA { simdgroup_float8x8 m[2]; };
struct MmaB { simdgroup_float8x8 m; };
struct MmaTile { simdgroup_float8x8 m[2]; };
DEVICE_FN void mma_load_a(thread MmaA& f, const threadgroup float* p, uint stride) {
    simdgroup_load(f.m[0], p, stride);
    simdgroup_load(f.m[1], p + 8u * stride, stride);
}
DEVICE_FN void mma_load_b(thread MmaB& f, const threadgroup float* p, uint stride) {
    simdgroup_load(f.m, p, stride, ulong2(0, 0), true);  // p holds B transposed: B[k][n] = p[n * stride + k]
}
DEVICE_FN void mma_load_b_rows(thread MmaB& f, const threadgroup float* p, uint stride) {
    simdgroup_load(f.m, p, stride);  // B[k][n] = p[k * stride + n]
}
DEVICE_FN void mma_zero(thread MmaTile& t) {
    t.m[0] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    t.m[1] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
// A lane's two elements of an 8 x 8 simdgroup matrix share a row: (lane / 4 & 4) + (lane / 2) % 4, the
// layout MLX's steel kernels rely on. Not run here (no Apple GPU): checked by rendering only.
DEVICE_FN void mma_scale_rows(thread MmaTile& t, const threadgroup float* s, uint lane) {
    uint row = ((lane >> 2) & 4u) + ((lane >> 1) & 3u);
    for (uint h = 0; h < 2u; h++) {
        t.m[h].thread_elements()[0] *= s[row + 8u * h];
        t.m[h].thread_elements()[1] *= s[row + 8u * h];
    }
}
DEVICE_FN void mma_step(thread MmaTile& t, thread const MmaA& a, thread const MmaB& b) {
    simdgroup_multiply_accumulate(t.m[0], a.m[0], b.m, t.m[0]);
    simdgroup_multiply_accumulate(t.m[1], a.m[1], b.m, t.m[1]);
}
// Apple's float simdgroup matrices have no cheaper reduced-precision form: the float32 product.
DEVICE_FN void mma_step_tf32(thread MmaTile& t, thread const MmaA& a, thread const MmaB& b) { mma_step(t, a, b); }
DEVICE_FN void mma_store(thread const MmaTile& t, threadgroup float* p, uint stride) {
    simdgroup_store(t.m[0], p, stride);
    simdgroup_store(t.m[1], p + 8u * stride, stride);
}
""" + _FLOAT_HALVES

# The CPU emulator (:mod:`.cpu`): a work-group's threads are fibers on one OS thread, sharing the
# kernel's static locals, with barriers for the group and for each 32-thread SIMD group; groups run one
# after another.
CPU_HEADER = _COMMON_HEADER + """#if defined(__APPLE__)
#define _XOPEN_SOURCE 600  // macOS declares the full ucontext_t only with it
#endif
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#define GLOBAL
#define SHARED_ARG
#define DEVICE_FN static inline
#define IQ2_SIGNED_GRID 1  // as CUDA's
typedef unsigned int uint;
DEVICE_FN void grid_dependency_wait() {}
using std::ceil; using std::exp; using std::exp2; using std::fabs; using std::floor; using std::log2;
using std::rint; using std::sqrt;
static inline float max(float a, float b) { return a > b ? a : b; }
static inline float min(float a, float b) { return a < b ? a : b; }
static inline uint max(uint a, uint b) { return a > b ? a : b; }
static inline uint min(uint a, uint b) { return a < b ? a : b; }
struct Barrier {  // waits until `count` threads have arrived (defined with the launcher)
    uint count, arrived, phase;
    void arrive_and_wait();
};
struct ThreadCtx {
    uint gx, gy, tid, threads, lanes;
    Barrier* group;
    Barrier* simd;
    float* slots;  // three floats per lane of this thread's SIMD group: simd_reduce's, two for shuffles
    uint shuffles;  // shuffles so far: which of the two buffers the next one takes
};
static thread_local ThreadCtx ctx;
struct float4 { float x, y, z, w; };
struct uint2 { uint x, y; };
struct uint4 { uint x, y, z, w; };
// A load at an address its width does not divide faults on a GPU: here it stops the process, so the CPU suite
// catches what the GPU suite would.
DEVICE_FN const void* aligned_at(const void* p, uintptr_t width) {
    if (reinterpret_cast<uintptr_t>(p) % width) {
        std::fprintf(stderr, "ds4lab CPU kernels: a %u-byte load at a misaligned address %p\\n", uint(width), p);
        std::abort();
    }
    return p;
}
#define CHECK_ALIGNED16(p) (void)aligned_at(p, 16)
DEVICE_FN float load_half(const uint8_t* p) { _Float16 h; std::memcpy(&h, aligned_at(p, 2), 2); return float(h); }
DEVICE_FN float half_bits_f32(uint h) { uint16_t b = uint16_t(h); _Float16 v; std::memcpy(&v, &b, 2); return float(v); }
DEVICE_FN uint load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, aligned_at(p, 2), 2); return v; }
DEVICE_FN uint load_u32(const uint8_t* p) { uint v; std::memcpy(&v, aligned_at(p, 4), 4); return v; }
DEVICE_FN uint2 load_u2(const uint8_t* p) { uint2 v; std::memcpy(&v, aligned_at(p, 8), 8); return v; }
DEVICE_FN float4 load_f4(const float* p) { float4 v; std::memcpy(&v, aligned_at(p, 16), 16); return v; }
DEVICE_FN float4 load_f4_shared(const float* p) { return load_f4(p); }
DEVICE_FN uint4 load_u4(const uint8_t* p) { uint4 v; std::memcpy(&v, aligned_at(p, 16), 16); return v; }
DEVICE_FN float f16_round(float x) { return float(_Float16(x)); }
typedef _Float16 half_t;
DEVICE_FN half_t to_half(float x) { return _Float16(x); }
DEVICE_FN uint as_bits(float x) { uint b; std::memcpy(&b, &x, 4); return b; }
DEVICE_FN float from_bits(uint u) { float x; std::memcpy(&x, &u, 4); return x; }
DEVICE_FN uint byte_f32_bits(uint w, uint i) { return 0x4B000000u | ((w >> (8u * i)) & 255u); }
DEVICE_FN uint popcount_u(uint x) { return uint(__builtin_popcount(x)); }
DEVICE_FN int dot4_i8(uint a, uint b, int c) {
    for (uint i = 0; i < 4u; i++) c += int(int8_t(uint8_t(a >> (8u * i)))) * int(int8_t(uint8_t(b >> (8u * i))));
    return c;
}
DEVICE_FN float div_rn(float a, float b) { return a / b; }
DEVICE_FN uint rint_bits(float v) { return uint(int(std::rint(v))); }
DEVICE_FN uint pack_bytes(uint a, uint b, uint c, uint d) {
    return (a & 255u) | ((b & 255u) << 8) | ((c & 255u) << 16) | (d << 24);
}
DEVICE_FN void store_f4_shared(float* p, float a, float b, float c, float d) { p[0] = a; p[1] = b; p[2] = c; p[3] = d; }
DEVICE_FN float log1p_f(float x) { return std::log1p(x); }
DEVICE_FN float simd_reduce(float x, bool take_max) {
    ctx.slots[ctx.tid & 31u] = x;
    ctx.simd->arrive_and_wait();
    float r = ctx.slots[0];
    for (uint i = 1; i < ctx.lanes; i++) r = take_max ? max(r, ctx.slots[i]) : r + ctx.slots[i];
    ctx.simd->arrive_and_wait();
    return r;
}
DEVICE_FN float simd_sum_f(float x) { return simd_reduce(x, false); }
DEVICE_FN float simd_shuffle_f(float x, uint lane) {
    // Two buffers taken in turn need one barrier a shuffle: a thread writes a buffer again only after
    // the next shuffle's barrier, which every thread reaches after reading this one.
    float* buf = ctx.slots + 32u * (1u + (ctx.shuffles++ & 1u));
    buf[ctx.tid & 31u] = x;
    ctx.simd->arrive_and_wait();
    return buf[lane];
}
DEVICE_FN float simd_max_f(float x) { return simd_reduce(x, true); }
// The matrix units in plain float32, each lane owning the accumulators CUDA's mma.sync gives it (rows g,
// g + 8 at columns 2i, 2i + 1 for lane 4g + i); a lane's operand fragments are copies of the rows and
// columns it multiplies, so they outlive the group-shared memory they were loaded from, as registers do.
struct MmaA { float a[2][8]; };  // the lane's rows g and g + 8
struct MmaB { float b[8][2]; };  // b[k][j]: the lane's columns 2i + j
struct MmaTile { float c[4]; };
DEVICE_FN void mma_load_a(MmaA& f, const float* p, uint stride) {
    uint g = (ctx.tid & 31u) >> 2;
    for (uint h = 0; h < 2u; h++)
        for (uint k = 0; k < 8u; k++) f.a[h][k] = p[(g + 8u * h) * stride + k];
}
DEVICE_FN void mma_load_b(MmaB& f, const float* p, uint stride) {  // B[k][n] = p[n * stride + k]
    uint i = ctx.tid & 3u;
    for (uint k = 0; k < 8u; k++)
        for (uint j = 0; j < 2u; j++) f.b[k][j] = p[(2u * i + j) * stride + k];
}
DEVICE_FN void mma_load_b_rows(MmaB& f, const float* p, uint stride) {  // B[k][n] = p[k * stride + n]
    uint i = ctx.tid & 3u;
    for (uint k = 0; k < 8u; k++)
        for (uint j = 0; j < 2u; j++) f.b[k][j] = p[k * stride + 2u * i + j];
}
DEVICE_FN void mma_zero(MmaTile& t) { for (uint r = 0; r < 4u; r++) t.c[r] = 0.0f; }
DEVICE_FN void mma_scale_rows(MmaTile& t, const float* s, uint lane) {
    for (uint r = 0; r < 4u; r++) t.c[r] *= s[(lane >> 2) + 8u * (r >> 1)];
}
DEVICE_FN float tf32_round(float x) {  // CUDA's cvt.rna.tf32.f32: 10 mantissa bits, ties away from zero
    return from_bits((as_bits(x) + 0x1000u) & 0xffffe000u);
}
DEVICE_FN void mma_product(MmaTile& t, const MmaA& a, const MmaB& b, bool tf32) {
    for (uint r = 0; r < 4u; r++) {
        for (uint k = 0; k < 8u; k++) {
            float av = a.a[r >> 1][k], bv = b.b[k][r & 1u];
            t.c[r] += tf32 ? tf32_round(av) * tf32_round(bv) : av * bv;
        }
    }
}
DEVICE_FN void mma_step(MmaTile& t, const MmaA& a, const MmaB& b) { mma_product(t, a, b, false); }
DEVICE_FN void mma_step_tf32(MmaTile& t, const MmaA& a, const MmaB& b) { mma_product(t, a, b, true); }
DEVICE_FN void mma_store(const MmaTile& t, float* p, uint stride) {
    uint g = (ctx.tid & 31u) >> 2, i = ctx.tid & 3u;
    for (uint r = 0; r < 4u; r++) p[(g + 8u * (r >> 1)) * stride + 2u * i + (r & 1u)] = t.c[r];
}
""" + _FLOAT_HALVES

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
    "cpu": {
        "GROUP_ID_X": "ctx.gx",
        "GROUP_ID_Y": "ctx.gy",
        "THREAD_IN_GROUP": "ctx.tid",
        "GROUP_THREADS": "ctx.threads",
        "GROUP_SHARED": "static",
        "GROUP_BARRIER()": "ctx.group->arrive_and_wait()",
    },
}

# Spellings that must not survive into the other language's source (checked by the tests).
CUDA_ONLY = ("__shared__", "__syncthreads", "threadIdx", "blockIdx", "blockDim", "__shfl", "__half",
             "__device__", "__global__", "reinterpret_cast")
METAL_ONLY = ("threadgroup", "thread_position_in", "simd_sum(", "simd_max(", "simd_shuffle(", "device ", "mem_flags",
              "(half(", "as_type<", "simdgroup_", "thread Mma")

_C_TYPES = {"float32": "float", "float16": "half_t", "uint8": "uint8_t", "int32": "int32_t"}


@dataclass(frozen=True)
class KernelSpec:
    """A kernel: its name, the body file, inputs and outputs as (name, dtype name), and constants.
    ``launch_bounds``: (threads a group, groups an SM) for CUDA's ``__launch_bounds__`` in the CuPy module, so that
    its registers leave room for that many groups (None: the compiler's choice)."""

    name: str
    body: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    defines: dict = field(default_factory=dict)
    launch_bounds: tuple[int, int] | None = None

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
        """``(header, source)`` for ``mx.fast.metal_kernel`` (or MLX's ``cuda_kernel``, dialect "cuda")."""
        return header(dialect), self.body_source(dialect)


def header(dialect: str) -> str:
    prelude = {"cuda": CUDA_HEADER, "metal": METAL_HEADER, "cpu": CPU_HEADER}[dialect]
    return prelude + (SOURCES / "common.h").read_text()


def places_its_wait(body: str) -> bool:
    """Whether a kernel body calls ``grid_dependency_wait()`` itself (else the CUDA module calls it at the top)."""
    return re.search(r"^\s*grid_dependency_wait\(\);", body, re.M) is not None


def cuda_module_source(specs) -> str:
    """One CUDA translation unit holding every kernel of ``specs`` with ``extern "C"`` signatures (CuPy)."""
    parts = ["typedef unsigned char uint8_t;\ntypedef int int32_t;\n", header("cuda")]
    for spec in specs:
        args = [f"const {_C_TYPES[t]}* __restrict__ {n}" for n, t in spec.inputs]
        args += [f"{_C_TYPES[t]}* __restrict__ {n}" for n, t in spec.outputs]
        body = spec.body_source("cuda")
        wait = "" if places_its_wait(body) else "grid_dependency_wait();\n"
        bounds = f"__launch_bounds__({spec.launch_bounds[0]}, {spec.launch_bounds[1]}) " if spec.launch_bounds else ""
        parts.append(f'extern "C" __global__ void {bounds}{spec.name}({", ".join(args)}) {{\n{wait}{body}}}\n')
    return "\n".join(parts)


_CPU_LAUNCH = r"""
// A group's threads are fibers that one OS thread runs in turn: a thread runs until it waits at a barrier,
// and a barrier's waiters run again once all of its threads have arrived. Odd groups take their threads
// in reverse order, so a read that lacks its barrier sees another thread's write missing in one of them.
// A kernel that never waits (no barrier, no SIMD exchange) runs its threads as plain calls.
// The fibers live as long as the OS thread: makecontext starts each on its own stack once, and from then
// on a switch is _setjmp/_longjmp between stacks that stay live (no system call, unlike swapcontext).
struct Fiber {
    jmp_buf at;
    ThreadCtx ctx;
    const Barrier* waiting;  // the barrier and the phase this fiber waits out, or null
    uint phase;
    bool done;
};
struct Fibers {
    static constexpr size_t stack_size = 256 * 1024, guard = 64 * 1024;
    std::vector<Fiber*> all;
    jmp_buf scheduler;
    Fiber* current = nullptr;  // null while a kernel runs its threads as plain calls
    void (*run)(void*) = nullptr;
    void* body = nullptr;
    Fiber* get(uint i);
};
static thread_local Fibers fibers;
static thread_local const char* kernel_name;

[[noreturn]] static void emulator_fault(const char* what) {
    fprintf(stderr, "ds4lab CPU kernel emulator, kernel %s: %s\n", kernel_name, what);
    abort();
}
static void switch_to_scheduler(Fiber* f) {
    f->ctx = ctx;
    if (!_setjmp(f->at)) _longjmp(fibers.scheduler, 1);
}
void Barrier::arrive_and_wait() {
    if (count == 1) return;
    Fiber* f = fibers.current;
    if (!f) emulator_fault("a barrier in a kernel launched without fibers (add its sync to _SYNCS)");
    uint mine = phase;
    if (++arrived == count) {
        arrived = 0;
        phase++;
        return;
    }
    f->waiting = this;
    f->phase = mine;
    switch_to_scheduler(f);  // the scheduler restores ctx before it switches back
}
static void fiber_main() {  // a fiber's whole life: one thread of one group each time it is started
    Fiber* f = fibers.current;
    if (!_setjmp(f->at)) _longjmp(fibers.scheduler, 1);  // made: back to Fibers::get
    for (;;) {
        fibers.run(fibers.body);
        f->done = true;
        switch_to_scheduler(f);
    }
}
Fiber* Fibers::get(uint i) {
    while (all.size() <= i) {
        char* p = (char*)mmap(nullptr, stack_size + guard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0);
        if (p == (char*)MAP_FAILED || mprotect(p, guard, PROT_NONE)) emulator_fault("cannot map a fiber stack");
        ucontext_t start;
        getcontext(&start);
        start.uc_stack.ss_sp = p + guard;
        start.uc_stack.ss_size = stack_size;
        start.uc_link = nullptr;
        makecontext(&start, fiber_main, 0);
        all.push_back(new Fiber{});
        current = all.back();
        if (!_setjmp(scheduler)) setcontext(&start);
        current = nullptr;
    }
    return all[i];
}

template <class Body>
static void run_groups(const char* name, uint gx, uint gy, uint threads, bool waits, Body body) {
    kernel_name = name;
    std::vector<Barrier> simd;
    for (uint g = 0; g < (threads + 31) / 32; g++) simd.push_back(Barrier{std::min(32u, threads - 32 * g), 0, 0});
    Barrier group{threads, 0, 0};
    std::vector<float> slots(3 * (threads + 32));
    auto thread_ctx = [&](uint x, uint y, uint t) {
        return ThreadCtx{x, y, t, threads, std::min(32u, threads - 32 * (t / 32)), &group, &simd[t / 32],
                         slots.data() + 96 * (t / 32), 0};
    };
    if (!waits) {
        for (uint y = 0; y < gy; y++)
            for (uint x = 0; x < gx; x++)
                for (uint t = 0; t < threads; t++) {
                    ctx = thread_ctx(x, y, t);
                    body();
                }
        return;
    }
    std::vector<Fiber*> team(threads);
    for (uint t = 0; t < threads; t++) team[t] = fibers.get(t);
    fibers.run = [](void* b) { (*(Body*)b)(); };
    fibers.body = &body;
    for (uint y = 0; y < gy; y++)
        for (uint x = 0; x < gx; x++) {
            for (uint t = 0; t < threads; t++) {  // the fiber's jump buffer stays: it holds where the fiber waits
                team[t]->ctx = thread_ctx(x, y, t);
                team[t]->waiting = nullptr;
                team[t]->done = false;
            }
            bool reverse = (x + y) & 1u;
            for (uint live = threads; live;) {
                bool ran = false;
                for (uint i = 0; i < threads; i++) {
                    Fiber* f = team[reverse ? threads - 1 - i : i];
                    if (f->done || (f->waiting && f->waiting->phase == f->phase)) continue;
                    f->waiting = nullptr;
                    fibers.current = f;
                    ctx = f->ctx;
                    if (!_setjmp(fibers.scheduler)) _longjmp(f->at, 1);
                    live -= f->done;
                    ran = true;
                }
                if (!ran) emulator_fault("the group's threads wait at different barriers");
            }
        }
    fibers.current = nullptr;
}
"""

# What makes a thread wait for others: a kernel whose body (or a define of it) names none of these runs without fibers.
_SYNCS = ("GROUP_BARRIER", "simd_sum_f", "simd_max_f", "simd_shuffle_f", "lane_line_sum", "quant_x32_q8_k")


def cpu_module_source(specs) -> str:
    """One C++20 translation unit: each kernel's body as a function of its arguments, and an
    ``extern "C" launch_<name>(gx, gy, threads, args)`` that runs the grid (the CPU emulator)."""
    parts = [header("cpu"), "#include <algorithm>\n#include <cstdio>\n#include <cstdlib>\n#include <vector>\n"
             "#include <setjmp.h>\n#include <sys/mman.h>\n", _CPU_LAUNCH]
    for spec in specs:
        params = [(n, f"const {_C_TYPES[t]}*") for n, t in spec.inputs]
        params += [(n, f"{_C_TYPES[t]}*") for n, t in spec.outputs]
        args = ", ".join(f"{c} {n}" for n, c in params)
        casts = ", ".join(f"({c}) a[{i}]" for i, (_, c) in enumerate(params))
        # the body and the helpers its defines name (QUANT_X)
        named = (SOURCES / spec.body).read_text() + " ".join(str(v) for v in spec.defines.values())
        waits = any(name in named for name in _SYNCS)
        parts.append(f"static void {spec.name}({args}) {{\n{spec.body_source('cpu')}}}\n"
                     f'extern "C" void launch_{spec.name}(uint gx, uint gy, uint threads, void** a) {{\n'
                     f'    run_groups("{spec.name}", gx, gy, threads, {str(waits).lower()},\n'
                     f"               [&]() {{ {spec.name}({casts}); }});\n}}\n")
    return "\n".join(parts)
