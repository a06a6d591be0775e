// Shared by every kernel, in the portable dialect: GLOBAL (the device address space), DEVICE_FN,
// load_half(p) and simd_sum_f(x) come from the dialect header (see ds4lab/mlx_kernels/dialects.py).
//
// Element decoders: dq_<type>(row, k, aux) is element k of a row of GGUF blocks, written as
// ds4lab/quants.py decodes it (same operations in the same order). aux is the IQ2_XXS table block:
// 256 grid entries of 8 bytes, then the 128 sign bytes (ksigns_iq2xs).

DEVICE_FN float dq_f32(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    return *(const GLOBAL float*)(row + 4u * k);
}

DEVICE_FN float dq_f16(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    return load_half(row + 2u * k);
}

DEVICE_FN float dq_q8_0(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 5) * 34u;
    int q = int(b[2u + (k & 31u)]);
    return load_half(b) * float(q - ((q & 128) << 1));
}

// Q2_K, 84-byte blocks of 256: element e = 128h + 32j + 16s + l.
DEVICE_FN float dq_q2_k(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 8) * 84u;
    uint e = k & 255u, h = e >> 7, j = (e >> 5) & 3u, s = (e >> 4) & 1u, l = e & 15u;
    uint sc = b[h * 8u + j * 2u + s];
    uint q = (uint(b[16u + h * 32u + s * 16u + l]) >> (2u * j)) & 3u;
    return load_half(b + 80) * float(sc & 15u) * float(q) - load_half(b + 82) * float(sc >> 4);
}

// Q4_K, 144-byte blocks of 256: sub-block 2c takes the low nibbles of qs[32c..], 2c+1 the high ones.
DEVICE_FN float dq_q4_k(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 8) * 144u;
    uint e = k & 255u, sb = e >> 5, c = sb >> 1, l = e & 31u;
    uint q = (uint(b[16u + 32u * c + l]) >> (4u * (sb & 1u))) & 15u;
    uint s, m;
    if (sb < 4u) {
        s = b[4u + sb] & 63u;
        m = b[8u + sb] & 63u;
    } else {
        uint j = sb - 4u;
        s = (b[12u + j] & 15u) | ((uint(b[4u + j]) >> 6) << 4);
        m = (uint(b[12u + j]) >> 4) | ((uint(b[8u + j]) >> 6) << 4);
    }
    return load_half(b) * float(s) * float(q) - load_half(b + 2) * float(m);
}

// IQ2_XXS, 66-byte blocks of 256: f16 d, then eight 8-byte sub-blocks (4 grid indices, then a
// little-endian word of four 7-bit sign indices and a 4-bit scale).
DEVICE_FN float dq_iq2_xxs(const GLOBAL uint8_t* row, uint k, const GLOBAL uint8_t* aux) {
    const GLOBAL uint8_t* b = row + (k >> 8) * 66u;
    uint e = k & 255u, g = (e >> 3) & 3u, j = e & 7u;
    const GLOBAL uint8_t* sub = b + 2u + 8u * (e >> 5);
    uint a1 = uint(sub[4]) | (uint(sub[5]) << 8) | (uint(sub[6]) << 16) | (uint(sub[7]) << 24);
    float scale = load_half(b) * (0.5f + float(a1 >> 28)) * 0.25f;
    float v = scale * float(aux[uint(sub[g]) * 8u + j]);
    uint signs = aux[2048u + ((a1 >> (7u * g)) & 127u)];
    return ((signs >> j) & 1u) ? -v : v;
}

// A float's bits as an unsigned key with the same order (−0 counted as +0), every key ≥ 1 so that 0 can
// stand below all of them.
DEVICE_FN uint order_key(float x) {
    uint b = as_bits(x == 0.0f ? 0.0f : x);
    return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}
