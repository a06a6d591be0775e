// Shared by every kernel, in the portable dialect: GLOBAL (the device address space), DEVICE_FN,
// load_half(p) and simd_sum_f(x) come from the dialect header (see ds4lab/mlx_kernels/dialects.py).
//
// Element decoders: dq_<type>(row, k, aux) is element k of a row of GGUF blocks (Q8_0's, IQ2_XXS's and Q2_K's in
// the tiles of ds4lab/mlx_kernels/layout.py), written as
// ds4lab/quants.py decodes it (same operations in the same order). aux is the IQ2_XXS table block:
// 256 grid entries of 8 bytes, then the 128 sign bytes (ksigns_iq2xs).

DEVICE_FN float dq_f32(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    return *(const GLOBAL float*)(row + 4u * k);
}

DEVICE_FN float dq_f16(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    return load_half(row + 2u * k);
}

// Q8_0 in the kernels' tiles of eight blocks (ds4lab/mlx_kernels/layout.py): block j of a tile has its first 16
// quants at byte 16j, its last 16 at 128 + 16j, its scale at 256 + 2j; q8_0_at(k) is k's quant byte in its tile.
DEVICE_FN uint q8_0_at(uint k) { return 128u * ((k >> 4) & 1u) + 16u * ((k >> 5) & 7u) + (k & 15u); }
DEVICE_FN uint q8_0_scale_at(uint k) { return 256u + 2u * ((k >> 5) & 7u); }

DEVICE_FN float dq_q8_0(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = row + (k >> 8) * 272u;
    int q = int(t[q8_0_at(k)]);
    return load_half(t + q8_0_scale_at(k)) * float(q - ((q & 128) << 1));
}

// RoPE's rule (docs/MODEL.md, "RoPE with YaRN") for the kernels that turn rows (rope, rmsnorm_rope,
// attend_reduce_rope): element odd (0 or 1) of tail pair p, (t0, t1), turned by the angle of row t of cos_t/sin_t
// [., n_rot/2], or by minus it when inverse.
DEVICE_FN float rope_turn(float t0, float t1, const GLOBAL float* cos_t, const GLOBAL float* sin_t, uint t, uint p,
                          uint n_rot, uint odd, bool inverse) {
    float c = cos_t[t * (n_rot / 2u) + p], s = sin_t[t * (n_rot / 2u) + p];
    if (inverse) s = -s;
    return odd == 0u ? t0 * c - t1 * s : t0 * s + t1 * c;
}

// Entry (a, b), a ≤ b, of an n×n symmetric matrix kept as its upper triangle row by row (hc_post_mix's Gram matrix).
DEVICE_FN uint upper_at(uint a, uint b, uint n) { return a * (2u * n - a + 1u) / 2u + b - a; }

// Q2_K, 84-byte blocks of 256: element e = 128h + 32j + 16s + l.
// Q2_K in the kernels' tiles of four blocks (ds4lab/mlx_kernels/layout.py): block j's 64 bytes of quants at byte 64j of
// its tile, its 16 bytes of scales and minima at 256 + 16j, its d and dmin at 320 + 4j. q2_k_tile_at(k) is k's
// tile's byte in the row, q2_k_quants_at(k), q2_k_scales_at(k) and q2_k_d_at(k) its block's in the tile.
DEVICE_FN uint q2_k_tile_at(uint k) { return (k >> 10) * 336u; }
DEVICE_FN uint q2_k_quants_at(uint k) { return 64u * ((k >> 8) & 3u); }
DEVICE_FN uint q2_k_scales_at(uint k) { return 256u + 16u * ((k >> 8) & 3u); }
DEVICE_FN uint q2_k_d_at(uint k) { return 320u + 4u * ((k >> 8) & 3u); }

DEVICE_FN float dq_q2_k(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = row + q2_k_tile_at(k);
    uint e = k & 255u, h = e >> 7, j = (e >> 5) & 3u, s = (e >> 4) & 1u, l = e & 15u;
    uint sc = t[q2_k_scales_at(k) + h * 8u + j * 2u + s];
    uint q = (uint(t[q2_k_quants_at(k) + h * 32u + s * 16u + l]) >> (2u * j)) & 3u;
    return load_half(t + q2_k_d_at(k)) * float(sc & 15u) * float(q) - load_half(t + q2_k_d_at(k) + 2u) * float(sc >> 4);
}

// Q4_K, 144-byte blocks of 256: sub-block 2c takes the low nibbles of qs[32c..], 2c+1 the high ones.
// The 6-bit scale and min of sub-block sb, packed as scale | min << 8.
DEVICE_FN uint q4_k_scale_min(const GLOBAL uint8_t* b, uint sb) {
    if (sb < 4u) return (b[4u + sb] & 63u) | ((b[8u + sb] & 63u) << 8);
    uint j = sb - 4u;
    return ((b[12u + j] & 15u) | ((uint(b[4u + j]) >> 6) << 4))
         | (((uint(b[12u + j]) >> 4) | ((uint(b[8u + j]) >> 6) << 4)) << 8);
}

DEVICE_FN float dq_q4_k(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 8) * 144u;
    uint e = k & 255u, sb = e >> 5, c = sb >> 1, l = e & 31u;
    uint q = (uint(b[16u + 32u * c + l]) >> (4u * (sb & 1u))) & 15u;
    uint sm = q4_k_scale_min(b, sb);
    return load_half(b) * float(sm & 255u) * float(q) - load_half(b + 2) * float(sm >> 8);
}

// IQ2_XXS, 66-byte blocks of 256: f16 d, then eight 8-byte sub-blocks (4 grid indices, then a little-endian word
// of four 7-bit sign indices and a 4-bit scale), in the kernels' tiles of four blocks (ds4lab/mlx_kernels/layout.py):
// block j's sub-blocks at byte 64j of its tile, its d at 256 + 2j. iq2_xxs_tile_at(k) is k's tile's byte in the
// row, iq2_xxs_sub_at(k) its sub-block's byte in the tile (8-byte aligned), iq2_xxs_scale_at(k) its block's d.
DEVICE_FN uint iq2_xxs_tile_at(uint k) { return (k >> 10) * 264u; }
DEVICE_FN uint iq2_xxs_sub_at(uint k) { return 64u * ((k >> 8) & 3u) + 8u * ((k >> 5) & 7u); }
DEVICE_FN uint iq2_xxs_scale_at(uint k) { return 256u + 2u * ((k >> 8) & 3u); }

DEVICE_FN float dq_iq2_xxs(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = row + iq2_xxs_tile_at(k);
    uint g = (k >> 3) & 3u, j = k & 7u;
    const GLOBAL uint8_t* sub = t + iq2_xxs_sub_at(k);
    uint a1 = uint(sub[4]) | (uint(sub[5]) << 8) | (uint(sub[6]) << 16) | (uint(sub[7]) << 24);
    float scale = load_half(t + iq2_xxs_scale_at(k)) * (0.5f + float(a1 >> 28)) * 0.25f;
    float v = scale * float(aux[uint(sub[g]) * 8u + j]);
    uint signs = aux[2048u + ((a1 >> (7u * g)) & 127u)];
    return ((signs >> j) & 1u) ? -v : v;
}

// Small integers as floats without an integer-to-float conversion (a quarter-rate instruction on
// NVIDIA GPUs): 2^23 + u has u in its low mantissa bits, so subtracting 2^23 leaves u, exactly.
DEVICE_FN float u8_float(uint u) { return from_bits(0x4B000000u | u) - 8388608.0f; }
DEVICE_FN float i8_float(uint u) { return from_bits(0x4B000000u | (u ^ 128u)) - 8388736.0f; }  // u: the byte of an int8

// An IQ2_XXS sub-block's scale, d·(s + ½)/4, from its tile t (at element k) and its word a1 (s: the top 4 bits), as
// dq_iq2_xxs takes it.
DEVICE_FN float iq2_xxs_scale(const GLOBAL uint8_t* t, uint k, uint a1) {
    return load_half(t + iq2_xxs_scale_at(k)) * (0.5f + u8_float(a1 >> 28)) * 0.25f;
}

// MXFP4, 17-byte blocks of 32: an exponent byte e, then 16 bytes of E2M1 codes (element j < 16 the low nibble of byte
// j, 16 + j its high one). As ggml and ds4lab/quants.py keep it: half the scale, 2^(e − 128) (e < 2 subnormal), times
// the doubled magnitude, nibble (c & 7) of 0xC8643210 (0, 1, 2, 3, 4, 6, 8, 12), negated with bit 3 of the code c
// (0 − m: code 8 is +0, as there). Blocks of 17 bytes sit at any address: their bytes are read one at a time.
DEVICE_FN float mxfp4_half_scale(uint e) { return from_bits(e < 2u ? 0x00200000u << e : (e - 1u) << 23); }

DEVICE_FN float mxfp4_value(uint c, float d) {
    float m = d * u8_float((0xC8643210u >> (4u * (c & 7u))) & 15u);
    return (c & 8u) != 0u ? 0.0f - m : m;
}

DEVICE_FN float dq_mxfp4(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 5) * 17u;
    uint e = k & 31u;
    return mxfp4_value((uint(b[1u + (e & 15u)]) >> (4u * (e >> 4))) & 15u, mxfp4_half_scale(b[0]));
}

// Eight consecutive elements at once, k a multiple of 8: dq8_<type>(row, k, aux).v[i] is
// dq_<type>(row, k + i, aux), the same values, from wider loads (a SIMD group's 32 lanes then cover 256
// elements a step). Rows of IQ2_XXS blocks start at even addresses, of Q2_K and Q4_K blocks at multiples
// of 4, of Q8_0 tiles at multiples of 16.
struct F8 { float v[8]; };

// Eight floats from p: two 16-byte loads where p is 16-byte aligned (vec), else one at a time.
DEVICE_FN F8 load_x8(const GLOBAL float* p, bool vec) {
    F8 r;
    if (vec) {
        float4 a = load_f4(p), c = load_f4(p + 4);
        r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
        r.v[4] = c.x; r.v[5] = c.y; r.v[6] = c.z; r.v[7] = c.w;
    } else {
        #pragma unroll
        for (uint i = 0; i < 8u; i++) r.v[i] = p[i];
    }
    return r;
}

// The first n of the eight floats at p (all eight from load_x8 where n >= 8), zeros after: a row's last elements,
// or none of a row that is not there (n = 0).
DEVICE_FN F8 load_x8_upto(const GLOBAL float* p, uint n, bool vec) {
    if (n >= 8u) return load_x8(p, vec);
    F8 r;
    for (uint i = 0; i < 8u; i++) r.v[i] = i < n ? p[i] : 0.0f;
    return r;
}

DEVICE_FN F8 dq8_f32(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    F8 r;
    #pragma unroll
    for (uint i = 0; i < 8u; i++) r.v[i] = dq_f32(row, k + i, aux);
    return r;
}

DEVICE_FN F8 dq8_f16(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    F8 r;
    #pragma unroll
    for (uint i = 0; i < 8u; i++) r.v[i] = load_half(row + 2u * (k + i));
    return r;
}

DEVICE_FN F8 dq8_q8_0(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = row + (k >> 8) * 272u;
    const GLOBAL uint8_t* qs = t + q8_0_at(k);  // 8-byte aligned: k is a multiple of 8
    float d = load_half(t + q8_0_scale_at(k));
    uint four[2] = {load_u32(qs), load_u32(qs + 4u)};
    F8 r;
    #pragma unroll
    for (uint i = 0; i < 8u; i++) r.v[i] = d * i8_float((four[i >> 2] >> (8u * (i & 3u))) & 255u);
    return r;
}

// Q2_K's and Q4_K's eight values d·q − m, q in the low bits (mask) of the bytes of lo, then of hi.
DEVICE_FN F8 dq8_k_quant(uint lo, uint hi, uint mask, float d, float m) {
    F8 r;
    #pragma unroll
    for (uint i = 0; i < 4u; i++) {
        r.v[i] = d * u8_float((lo >> (8u * i)) & mask) - m;
        r.v[i + 4u] = d * u8_float((hi >> (8u * i)) & mask) - m;
    }
    return r;
}

DEVICE_FN F8 dq8_q2_k(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = row + q2_k_tile_at(k);
    uint e = k & 255u, h = e >> 7, j = (e >> 5) & 3u, s = (e >> 4) & 1u, l = e & 15u;
    uint sc = t[q2_k_scales_at(k) + h * 8u + j * 2u + s];
    uint dm = q2_k_d_at(k);
    float d = load_half(t + dm) * u8_float(sc & 15u), m = load_half(t + dm + 2u) * u8_float(sc >> 4);
    const GLOBAL uint8_t* qs = t + q2_k_quants_at(k) + h * 32u + s * 16u + l;
    return dq8_k_quant(load_u32(qs) >> (2u * j), load_u32(qs + 4u) >> (2u * j), 3u, d, m);
}

DEVICE_FN F8 dq8_q4_k(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 8) * 144u;
    uint e = k & 255u, sb = e >> 5, c = sb >> 1, l = e & 31u;
    uint sm = q4_k_scale_min(b, sb);
    float d = load_half(b) * u8_float(sm & 255u), m = load_half(b + 2) * u8_float(sm >> 8);
    const GLOBAL uint8_t* qs = b + 16u + 32u * c + l;
    return dq8_k_quant(load_u32(qs) >> (4u * (sb & 1u)), load_u32(qs + 4u) >> (4u * (sb & 1u)), 15u, d, m);
}

// What an IQ2_XXS group of eight elements (k a multiple of 8) shares: its grid entry, its sign byte, its
// sub-block's scale.
struct IQ2Group { uint entry; uint signs; float scale; };

DEVICE_FN IQ2Group iq2_xxs_group(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = row + iq2_xxs_tile_at(k);
    uint g = (k >> 3) & 3u;
    const GLOBAL uint8_t* sub = t + iq2_xxs_sub_at(k);
    uint a1 = load_u32(sub + 4u);
    IQ2Group r;
    r.entry = uint(sub[g]);
    r.signs = aux[2048u + ((a1 >> (7u * g)) & 127u)];
    r.scale = iq2_xxs_scale(t, k, a1);
    return r;
}

// Element i of a group: scale times grid byte q, the sign bit set straight in the float's bits (no select).
DEVICE_FN float iq2_xxs_value(IQ2Group grp, uint q, uint i) {
    return from_bits(as_bits(grp.scale * u8_float(q)) ^ (((grp.signs >> i) & 1u) << 31));
}

DEVICE_FN F8 dq8_iq2_xxs(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    IQ2Group grp = iq2_xxs_group(row, k, aux);
    const GLOBAL uint8_t* grid = aux + grp.entry * 8u;
    uint lo = load_u32(grid), hi = load_u32(grid + 4u);
    F8 r;
    #pragma unroll
    for (uint i = 0; i < 4u; i++) {
        r.v[i] = iq2_xxs_value(grp, (lo >> (8u * i)) & 255u, i);
        r.v[i + 4u] = iq2_xxs_value(grp, (hi >> (8u * i)) & 255u, i + 4u);
    }
    return r;
}

DEVICE_FN F8 dq8_mxfp4(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 5) * 17u;
    uint e = k & 31u, shift = 4u * (e >> 4);
    const GLOBAL uint8_t* qs = b + 1u + (e & 15u);
    float d = mxfp4_half_scale(b[0]);
    F8 r;
    #pragma unroll
    for (uint i = 0; i < 8u; i++) r.v[i] = mxfp4_value((uint(qs[i]) >> shift) & 15u, d);
    return r;
}

// Decode products: qmatmul's loop for one row of x. The block's scales multiply a sum of small integers times x
// (not each weight), and bytes become floats by a byte permute and one add (byte_f32_bits): the integer pipe,
// busy with decoding, is what bounded these products on the H200.

// Byte i of w as a small integer: float(byte) − bias, bias 2^23 for unsigned bytes, 2^23 + 128 for bytes biased
// by 128 (u8_float's trick, the byte placed by one permute).
DEVICE_FN float byte_value(uint w, uint i, float bias) { return from_bits(byte_f32_bits(w, i)) - bias; }

// acc + Σ_{i<4} byte_value(w, i, bias)·x_i.
DEVICE_FN float fma4_bytes(uint w, float x0, float x1, float x2, float x3, float acc, float bias) {
    acc += byte_value(w, 0u, bias) * x0;
    acc += byte_value(w, 1u, bias) * x1;
    acc += byte_value(w, 2u, bias) * x2;
    return acc + byte_value(w, 3u, bias) * x3;
}

// dot8_<type>(row, k, x, xsum, tables, aux): Σ_i w[k + i]·x.v[i] over eight elements of a row (k a multiple of 8)
// that starts 16-byte aligned (K a multiple of 8: qmatmul leaves other rows to its general loop); xsum = Σ x.v[i].
// F32 and F16 rows are read 16 bytes a load (eight loads of 2 bytes each, and their addresses, took F16's loop
// 5.5 instructions an element). For the types without a group32 below.
DEVICE_FN float dot8_sum(F8 w, F8 x) {
    float r = w.v[0] * x.v[0];
    #pragma unroll
    for (uint i = 1u; i < 8u; i++) r += w.v[i] * x.v[i];
    return r;
}

DEVICE_FN float dot8_f32(const GLOBAL uint8_t* row, uint k, F8 x, float xsum, const SHARED_ARG uint* tables,
                         const GLOBAL uint8_t* aux) {
    return dot8_sum(load_x8((const GLOBAL float*)row + k, true), x);
}

// Eight halves at 16-byte aligned p, in one load, as words (never through float registers).
DEVICE_FN F8 load_h8(const GLOBAL uint8_t* p) {
    uint4 four = load_u4(p);
    uint words[4] = {four.x, four.y, four.z, four.w};
    F8 w;
    #pragma unroll
    for (uint i = 0; i < 4u; i++) {
        w.v[2u * i] = half_bits_f32(words[i] & 0xFFFFu);
        w.v[2u * i + 1u] = half_bits_f32(words[i] >> 16);
    }
    return w;
}

DEVICE_FN float dot8_f16(const GLOBAL uint8_t* row, uint k, F8 x, float xsum, const SHARED_ARG uint* tables,
                         const GLOBAL uint8_t* aux) {
    return dot8_sum(load_h8(row + 2u * k), x);
}

// Q4_K: d·sc·q − dmin·m per element, so the sum is d·sc·Σ q·x − dmin·m·Σ x.
DEVICE_FN float dot8_q4_k(const GLOBAL uint8_t* row, uint k, F8 x, float xsum, const SHARED_ARG uint* tables,
                          const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 8) * 144u;
    uint e = k & 255u, sb = e >> 5, c = sb >> 1, l = e & 31u;
    uint sm = q4_k_scale_min(b, sb);
    const GLOBAL uint8_t* qs = b + 16u + 32u * c + l;
    uint lo = (load_u32(qs) >> (4u * (sb & 1u))) & 0x0F0F0F0Fu, hi = (load_u32(qs + 4u) >> (4u * (sb & 1u))) & 0x0F0F0F0Fu;
    float qx = fma4_bytes(hi, x.v[4], x.v[5], x.v[6], x.v[7],
                          fma4_bytes(lo, x.v[0], x.v[1], x.v[2], x.v[3], 0.0f, 8388608.0f), 8388608.0f);
    return load_half(b) * u8_float(sm & 255u) * qx - load_half(b + 2) * u8_float(sm >> 8) * xsum;
}

// MXFP4: its eight values decoded (byte loads; no wide load reads a block of 17 bytes).
DEVICE_FN float dot8_mxfp4(const GLOBAL uint8_t* row, uint k, F8 x, float xsum, const SHARED_ARG uint* tables,
                           const GLOBAL uint8_t* aux) {
    return dot8_sum(dq8_mxfp4(row, k, aux), x);
}

// A lane's 32 elements of x for dot32, and the sums of its two halves (the types with a minimum use them).
struct LaneX { float v[32]; float sum[2]; };

// Two runs of 16 floats, from a and from b (16-byte aligned).
DEVICE_FN LaneX load_x32_runs(const GLOBAL float* a, const GLOBAL float* b) {
    LaneX r;
    #pragma unroll
    for (uint i = 0; i < 32u; i += 4u) {
        float4 f = load_f4(i < 16u ? a + i : b + (i - 16u));
        r.v[i] = f.x; r.v[i + 1u] = f.y; r.v[i + 2u] = f.z; r.v[i + 3u] = f.w;
    }
    #pragma unroll
    for (uint t = 0; t < 2u; t++) {
        float sum = 0.0f;
        #pragma unroll
        for (uint i = 0; i < 16u; i++) sum += r.v[16u * t + i];
        r.sum[t] = sum;
    }
    return r;
}

// x[k .. k + 32) (Q8_0 blocks, IQ2_XXS sub-blocks).
DEVICE_FN LaneX load_x32(const GLOBAL float* x, uint k) { return load_x32_runs(x + k, x + k + 16u); }

// Q2_K: a group's elements are two runs of 16 (see group32_q2_k).
DEVICE_FN LaneX load_x32_q2_k(const GLOBAL float* x, uint k) {
    uint c = (k >> 5) & 7u;
    const GLOBAL float* p = x + (k & ~255u) + 128u * (c >> 2) + 64u * ((c >> 1) & 1u) + 16u * (c & 1u);
    return load_x32_runs(p, p + 32u);
}

// A group of 32 elements of a row as small integers and scales: element i (in the order of load_x32's or
// load_x32_q2_k's x) is d[i / 16]·(float(byte i % 4 of q[i / 4]) − bias) − m[i / 16], the same value as
// dq_<type> gives, with bias 2^23 (unsigned bytes) or 2^23 + 128 (bytes biased by 128). group32_<type>(w, off,
// k, tables, aux) reads the group at k (a multiple of 32) of the row at byte off of w (w 16-byte aligned; off a
// multiple of 16 for Q8_0's and Q2_K's tiles, of 8 for IQ2_XXS's); tables:
// IQ2_XXS's, see iq2_xxs_table_word. The decode products take them (dot32), IQ2_XXS's prefill weight slabs
// eight at a time (group32_eight). Q2_K's also sets sc and mins, its halves' 4-bit scales and minima, and dd and
// dmin, its block's (d[h] = dd·sc[h], m[h] = dmin·mins[h]): dot32_q8 applies them to integer sums.
struct Group32 { uint q[8]; float d[2]; float m[2]; float bias; uint sc[2]; uint mins[2]; float dd, dmin; };

// Q8_0 (its tiles: two 16-byte loads, the scale a third).
DEVICE_FN Group32 group32_q8_0(const GLOBAL uint8_t* w, uint off, uint k, const SHARED_ARG uint* tables,
                               const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = w + off + (k >> 8) * 272u;
    uint4 a = load_u4(t + q8_0_at(k)), c = load_u4(t + q8_0_at(k + 16u));
    uint qs[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
    Group32 g;
    #pragma unroll
    for (uint i = 0; i < 8u; i++) g.q[i] = qs[i] ^ 0x80808080u;
    g.d[0] = g.d[1] = load_half(t + q8_0_scale_at(k));
    g.m[0] = g.m[1] = 0.0f;
    g.bias = 8388736.0f;
    return g;
}

// Q2_K: d·sc·q − dmin·m per element, e = 128h + 32j + 16s + l in a block, q the bit pair j of its quants' byte
// 32h + 16s + l, sc its scales' byte 8h + 2j + s. Group c = (k & 255) / 32 is half h = c >> 2, bit pairs j = 2·jp and
// 2·jp + 1 (jp = (c >> 1) & 1) of the 16 bytes s = c & 1: two runs of 16 (load_x32_q2_k's x), one 16-byte read for
// 32 elements (the tiles' quants 16-byte aligned).
DEVICE_FN Group32 group32_q2_k(const GLOBAL uint8_t* w, uint off, uint k, const SHARED_ARG uint* tables,
                               const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = w + off + q2_k_tile_at(k);
    uint c = (k >> 5) & 7u, h = c >> 2, jp = (c >> 1) & 1u, s = c & 1u;
    // byte 0: j = 2jp's scale and min, byte 2: 2jp+1's
    uint scales = load_u32(t + q2_k_scales_at(k) + h * 8u + 4u * jp) >> (8u * s);
    float d = load_half(t + q2_k_d_at(k)), dmin = load_half(t + q2_k_d_at(k) + 2u);
    uint4 v = load_u4(t + q2_k_quants_at(k) + 32u * h + 16u * s);
    uint qs[4] = {v.x, v.y, v.z, v.w};
    Group32 g;
    #pragma unroll
    for (uint t = 0; t < 2u; t++) {
        uint sc = (scales >> (16u * t)) & 255u;
        #pragma unroll
        for (uint i = 0; i < 4u; i++) g.q[4u * t + i] = (qs[i] >> (4u * jp + 2u * t)) & 0x03030303u;
        g.d[t] = d * u8_float(sc & 15u);
        g.m[t] = dmin * u8_float(sc >> 4);
        g.sc[t] = sc & 15u;  // the same as integers, for the products on quantized x
        g.mins[t] = sc >> 4;
    }
    g.dd = d;
    g.dmin = dmin;
    g.bias = 8388608.0f;
    return g;
}

// IQ2_XXS's grid in qgemm's group-shared memory (IQ2_TABLE_WORDS, a kernel define; the decode products take the
// signed grid, iq2_xxs_signed_tables), built by a work-group's threads:
// words 0-255 the grid entries' first words (entry e at e), 256-511 their second words (at 256 + e). Each read's
// bank is its index mod 32 over all 32 banks: with an entry's two words side by side (2e, 2e + 1) a SIMD group's 32
// lookups fell on 16 banks, so more of them on the same bank, and a group-shared read waits for every lane's bank in
// turn.
DEVICE_FN uint iq2_xxs_table_word(uint i, const GLOBAL uint8_t* aux) {
    return load_u32(aux + 4u * (2u * (i & 255u) + (i >> 8)));
}

// A group of eight's signs from its 7-bit sign index si: ksigns_iq2xs[si], si with an eighth sign that makes their
// count even, made in registers (a table of the masks alone took half of the decode products' group-shared reads,
// which bound them; those now look up words with the signs applied, group32_iq2_xxs_signed).
DEVICE_FN uint iq2_xxs_signs(uint si) { return si | ((popcount_u(si) & 1u) << 7); }
// Four grid bytes g (8, 25 or 43) with the signs of bits 0-3 of s, biased by 128: n holds 0x01 in a negative
// element's byte, and (g ^ 0xFF) + 1 there is -g in two's complement (no carry: g ≥ 8), as the products on
// quantized x read them; the bias (^ 0x80) is for the float products' byte conversion (the signed grid stores the
// words unbiased: the compiler drops both XORs there).
DEVICE_FN uint signed_grid4(uint g, uint s) {
    uint n = ((s & 15u) * 0x00204081u) & 0x01010101u;
    return ((g ^ (n * 255u)) + n) ^ 0x80808080u;
}

DEVICE_FN Group32 group32_iq2_xxs(const GLOBAL uint8_t* w, uint off, uint k, const SHARED_ARG uint* tables,
                                  const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = w + off + iq2_xxs_tile_at(k);
    uint2 sub = load_u2(t + iq2_xxs_sub_at(k));
    uint idx = sub.x, a1 = sub.y;  // four grid indices; signs and scale
    Group32 g;
    #pragma unroll
    for (uint j = 0; j < 4u; j++) {
        uint e = (idx >> (8u * j)) & 255u, si = (a1 >> (7u * j)) & 127u;
        uint signs = iq2_xxs_signs(si);
        g.q[2u * j] = signed_grid4(tables[e], signs);
        g.q[2u * j + 1u] = signed_grid4(tables[256u + e], signs >> 4);
    }
    g.d[0] = g.d[1] = iq2_xxs_scale(t, k, a1);
    g.m[0] = g.m[1] = 0.0f;
    g.bias = 8388736.0f;
    return g;
}

// IQ2_XXS's grid with the signs applied, for the decode products (IQ2_SIGNED_WORDS, 32 KB of group-shared memory):
// word 4096h + 256n + e is word h of entry e with bits 0-3 of n negating its bytes, in two's complement. A group's
// eight lookups then take its signs as an index, where the masks made in registers cost six operations a word; e
// lowest, so lookups spread over the banks as the grid's do. Built from aux by a work-group's threads, a lane an
// entry's word for its 16 sign nibbles.
#define IQ2_SIGNED_WORDS 8192u
DEVICE_FN void iq2_xxs_signed_tables(SHARED_ARG uint* tables, const GLOBAL uint8_t* aux, uint tid, uint threads) {
    for (uint i = tid; i < 512u; i += threads) {
        uint h = i >> 8, e = i & 255u, g = load_u32(aux + 4u * (2u * e + h));
        #pragma unroll
        for (uint n = 0; n < 16u; n++) tables[4096u * h + 256u * n + e] = signed_grid4(g, n) ^ 0x80808080u;
    }
}

// group32_iq2_xxs from the signed grid (its bytes biased by 128 as group32_iq2_xxs's, which dot32 converts so;
// dot32_q8 undoes it, and the compiler drops both XORs).
DEVICE_FN Group32 group32_iq2_xxs_signed(const GLOBAL uint8_t* w, uint off, uint k, const SHARED_ARG uint* tables,
                                         const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* t = w + off + iq2_xxs_tile_at(k);
    uint2 sub = load_u2(t + iq2_xxs_sub_at(k));
    uint idx = sub.x, a1 = sub.y;
    // bit 7j: the parity of sign field j (bits 7j .. 7j + 6), all four at once where a POPC each took more
    uint t1 = a1 ^ (a1 >> 1), parity = t1 ^ (t1 >> 2) ^ (t1 >> 4) ^ (a1 >> 6);
    Group32 g;
    #pragma unroll
    for (uint j = 0; j < 4u; j++) {
        uint e = (idx >> (8u * j)) & 255u, signs = ((a1 >> (7u * j)) & 127u) | (((parity >> (7u * j)) & 1u) << 7);
        g.q[2u * j] = tables[256u * (signs & 15u) + e] ^ 0x80808080u;
        g.q[2u * j + 1u] = tables[4096u + 256u * (signs >> 4) + e] ^ 0x80808080u;
    }
    g.d[0] = g.d[1] = iq2_xxs_scale(t, k, a1);
    g.m[0] = g.m[1] = 0.0f;
    g.bias = 8388736.0f;
    return g;
}

// The decode products' IQ2_XXS tables (IQ2_SIGNED_GRID, the dialect's): IQ2_DECODE_WORDS words built by
// iq2_xxs_decode_tables, read by group32_iq2_xxs_decode.
#if IQ2_SIGNED_GRID
#define IQ2_DECODE_WORDS IQ2_SIGNED_WORDS
#define iq2_xxs_decode_tables iq2_xxs_signed_tables
#define group32_iq2_xxs_decode group32_iq2_xxs_signed
#else
#define IQ2_DECODE_WORDS 512u
DEVICE_FN void iq2_xxs_decode_tables(SHARED_ARG uint* tables, const GLOBAL uint8_t* aux, uint tid, uint threads) {
    for (uint i = tid; i < IQ2_DECODE_WORDS; i += threads) tables[i] = iq2_xxs_table_word(i, aux);
}
#define group32_iq2_xxs_decode group32_iq2_xxs
#endif

// Σ_i element i · x.v[i] over a group; halves: the group's two halves have scales and minima of their own (Q2_K),
// else d[0] scales the whole sum and m is 0 (a constant, so the compiler drops that work).
DEVICE_FN float dot32(Group32 g, LaneX x, bool halves) {
    float r = 0.0f, s = 0.0f;
    #pragma unroll
    for (uint i = 0; i < 8u; i++) {
        s = fma4_bytes(g.q[i], x.v[4u * i], x.v[4u * i + 1u], x.v[4u * i + 2u], x.v[4u * i + 3u], s, g.bias);
        if (halves && (i & 3u) == 3u) {
            r += g.d[i >> 2] * s - g.m[i >> 2] * x.sum[i >> 2];
            s = 0.0f;
        }
    }
    return halves ? r : g.d[0] * s;
}

// Decode products on x quantized to int8 per block, as ds4's CPU and CUDA decode products do (decode_matmul="q8"):
// a lane's 32 elements of x as int8 in words (in load_x32's order), their scale d (x ≈ d·q) and the sums of the
// two halves' integers (Q2_K's minima). |x·scale| never exceeds 127 by more than a rounding (the block's largest
// |x| goes to 127), so the clamp to [-128, 127] of ds4's rule never acts and is left out (a block whose largest |x|
// is below about 4e-37, where 1 / d overflows, is not an activation's).
struct LaneQ { uint q[8]; float d; int sum[2]; };

DEVICE_FN LaneQ lane_q(LaneX x, float scale, float d) {
    LaneQ r;
    #pragma unroll
    for (uint i = 0; i < 8u; i++)
        r.q[i] = pack_bytes(rint_bits(x.v[4u * i] * scale), rint_bits(x.v[4u * i + 1u] * scale),
                            rint_bits(x.v[4u * i + 2u] * scale), rint_bits(x.v[4u * i + 3u] * scale));
    r.d = d;
    #pragma unroll
    for (uint t = 0; t < 2u; t++) {
        int sum = 0;
        #pragma unroll
        for (uint i = 0; i < 4u; i++) sum = dot4_i8(r.q[4u * t + i], 0x01010101u, sum);
        r.sum[t] = sum;
    }
    return r;
}

// Q8_0's activations (ds4's quantize_q8_0_activation): a block of 32, the lane's own; d = amax / 127.
DEVICE_FN LaneQ quant_x32_q8_0(LaneX x, uint lane) {
    float amax = 0.0f;
    #pragma unroll
    for (uint i = 0; i < 32u; i++) amax = max(amax, fabs(x.v[i]));
    float d = div_rn(amax, 127.0f);
    return lane_q(x, d != 0.0f ? div_rn(1.0f, d) : 0.0f, d);
}

// Q8_K's (ds4's routed experts, IQ2_XXS and Q2_K): a block of 256, the groups of 8 lanes (every lane of the SIMD
// group calls it); m, an element of largest |x| (of x and -x, either: d·q is the same, each step odd in m), gives
// scale -127 / m and d = 1 / scale.
DEVICE_FN LaneQ quant_x32_q8_k(LaneX x, uint lane) {
    float m = x.v[0];
    #pragma unroll
    for (uint i = 1; i < 32u; i++) m = fabs(x.v[i]) > fabs(m) ? x.v[i] : m;
    #pragma unroll
    for (uint s = 1u; s < 8u; s <<= 1) {
        float o = simd_shuffle_f(m, lane ^ s);  // the other half of this lane's group of 2s lanes
        m = fabs(o) > fabs(m) || (fabs(o) == fabs(m) && (lane & s) != 0u) ? o : m;
    }
    float scale = m != 0.0f ? div_rn(-127.0f, m) : 0.0f;
    return lane_q(x, scale, m != 0.0f ? div_rn(1.0f, scale) : 0.0f);
}

// dot32's integer twin: the group's bytes (signed; Q2_K's unsigned 0-3) times the lane's int8 x, summed exactly in
// 32-bit integers per half, then scaled: d_w·d_x·Σ q_w·q_x, and for Q2_K its minima times d_x·Σ q_x.
DEVICE_FN float dot32_q8(Group32 g, LaneQ x, bool halves) {
    uint flip = g.bias == 8388608.0f ? 0u : 0x80808080u;  // bytes biased by 128 back to two's complement
    int s[2] = {0, 0};
    #pragma unroll
    for (uint i = 0; i < 8u; i++) s[i >> 2] = dot4_i8(g.q[i] ^ flip, x.q[i], s[i >> 2]);
    if (halves)  // the halves' scales and minima applied to the integer sums, then d and dmin once (exact: |sums| < 2^24)
        return x.d * (g.dd * float(int(g.sc[0]) * s[0] + int(g.sc[1]) * s[1])
                      - g.dmin * float(int(g.mins[0]) * x.sum[0] + int(g.mins[1]) * x.sum[1]));
    return g.d[0] * x.d * float(s[0] + s[1]);
}

// Elements 8c .. 8c + 7 of a group (in its order: IQ2_XXS's is the row's), as floats.
DEVICE_FN F8 group32_eight(Group32 g, uint c) {
    F8 r;
    float d = g.d[c >> 1], m = g.m[c >> 1];
    #pragma unroll
    for (uint i = 0; i < 8u; i++) r.v[i] = d * byte_value(g.q[2u * c + (i >> 2)], i & 3u, g.bias) - m;
    return r;
}

// Eight values to global memory: as floats, or rounded to halves (one 16-byte store where p is 16-byte aligned: vec).
DEVICE_FN void store8_out_f(GLOBAL float* p, F8 v, bool vec) {
    for (uint i = 0; i < 8u; i++) p[i] = v.v[i];
}
DEVICE_FN void store8_out_h(GLOBAL half_t* p, F8 v, bool vec) {
    if (vec) {
        store_h8(p, v.v[0], v.v[1], v.v[2], v.v[3], v.v[4], v.v[5], v.v[6], v.v[7]);
    } else {
        for (uint i = 0; i < 8u; i++) p[i] = to_half(v.v[i]);
    }
}

// Eight values to a matrix-unit slab in group-shared memory, p 16-byte aligned: as floats, or as halves (slab_h).
DEVICE_FN void store8_f(SHARED_ARG float* p, F8 v) {
    store_f4_shared(p, v.v[0], v.v[1], v.v[2], v.v[3]);
    store_f4_shared(p + 4u, v.v[4], v.v[5], v.v[6], v.v[7]);
}
DEVICE_FN void store8_h(SHARED_ARG slab_h* p, F8 v) {
    store_h8_shared(p, v.v[0], v.v[1], v.v[2], v.v[3], v.v[4], v.v[5], v.v[6], v.v[7]);
}

// Element i of a product split over K (qmatmul's parts [S, n]): its S partial sums added in split order, eight
// loads issued before they are added (one at a time, hc_pre waited on 16 trips to memory for each of its sums).
DEVICE_FN float split_sum(const GLOBAL float* part, uint S, uint n, uint i) {
    float v = part[i];
    for (uint s0 = 1; s0 < S; s0 += 8u) {
        float p[8];
        #pragma unroll
        for (uint j = 0; j < 8u; j++) p[j] = s0 + j < S ? part[(s0 + j) * n + i] : 0.0f;
        #pragma unroll
        for (uint j = 0; j < 8u; j++) {
            if (s0 + j < S) v += p[j];
        }
    }
    return v;
}

// Σ x[i]² over a thread's elements i ≡ tid (mod threads), i < n, added in order of i; 32 loads are issued
// before the first is used (a Flash token's HC state, 16,384 floats: one round of loads on a decode step's 1,024
// threads, two on 256; each round a trip to memory). One at a time, each waited on its load: hc_pre took 19 µs a Flash decode token on the
// H200 that way (85% of its warp cycles stalled on L1TEX), 8 µs with 8 loads a round.
DEVICE_FN float strided_sum_squares(const GLOBAL float* x, uint n, uint tid, uint threads) {
    float ss = 0.0f;
    for (uint i0 = tid; i0 < n; i0 += 32u * threads) {
        float v[32];
        #pragma unroll
        for (uint j = 0; j < 32u; j++) v[j] = i0 + j * threads < n ? x[i0 + j * threads] : 0.0f;
        #pragma unroll
        for (uint j = 0; j < 32u; j++) ss += v[j] * v[j];
    }
    return ss;
}

// Σ_{j<n} of the SIMD group's c at lanes first + j·stride (n ≤ 8), added in order of j; every lane of the
// group calls it. The shuffles are issued together rather than each after the last add (hc_pre's Sinkhorn
// normalisation, 20 rounds of a row and a column sum, was bound by that wait).
DEVICE_FN float lane_line_sum(float c, uint first, uint stride, uint n) {
    float v[8];
    #pragma unroll
    for (uint j = 0; j < 8u; j++) v[j] = simd_shuffle_f(c, (first + j * stride) & 31u);
    float sum = 0.0f;
    #pragma unroll
    for (uint j = 0; j < 8u; j++) {
        if (j < n) sum += v[j];
    }
    return sum;
}


// A float's bits as an unsigned key with the same order (−0 counted as +0), every key ≥ 1 so that 0 can
// stand below all of them.
DEVICE_FN uint order_key(float x) {
    uint b = as_bits(x == 0.0f ? 0.0f : x);
    return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

// The position slot s of a ring of cap slots holds once positions up to `last` are written: the latest
// p ≤ last with p ≡ s (mod cap), negative while none was.
DEVICE_FN int ring_slot_pos(int last, uint s, uint cap) {
    int back = (last - int(s)) % int(cap);  // truncated: negative when last < s
    return last - (back < 0 ? back + int(cap) : back);
}
// How many compressed rows of ratio R query t of a chunk sees (attention.visible_rows): its position is
// first + t, or `last` (the chunk's last real position) for a padded query past it.
DEVICE_FN int visible_compressed(int first, int last, uint t, int R) {
    int q = first + int(t) < last ? first + int(t) : last;
    return (q + 1) / R;
}
