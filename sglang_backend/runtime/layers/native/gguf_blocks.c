/* CPU matmuls over GGUF block-quantized weights, dequantized on the fly (AVX2 + FMA + F16C).
 *
 * A weight of N rows x K columns is stored as llama.cpp stores it: each row is K / C blocks of C consecutive
 * columns (C = 32, or 256 for the K-quants). d, m, dmin are fp16; "nibbles" are 16 bytes whose low halves hold
 * columns 0-15 and high halves columns 16-31; qh (Q5_0, Q5_1) is a uint32 whose bit j is bit 4 of column j.
 *   Q4_0 (18 bytes): d, nibbles             w = d * (q - 8)
 *   Q4_1 (20 bytes): d, m, nibbles          w = d * q + m
 *   Q5_0 (22 bytes): d, qh, nibbles         w = d * (q - 16)
 *   Q5_1 (24 bytes): d, m, qh, nibbles      w = d * q + m
 *   Q8_0 (34 bytes): d, 32 int8             w = d * q
 *   Q4_K (144 bytes): d, dmin, 12 bytes of 6-bit scales sc[8] and mins mn[8] (k_chunk), 128 bytes qs.
 *     Sub-block s (32 columns): w = (d * sc[s]) * q - dmin * mn[s]; its q are the low (s even) or high (s odd)
 *     halves of qs[32 (s / 2) + i], i < 32.
 *   Q5_K (176 bytes): d, dmin, scales as Q4_K, 32 bytes qh (bit s of qh[i]: bit 4 of column 32 s + i), 128 qs.
 *   Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), int8 sc[16], d. Sub-block s (16
 *     columns): w = (d * sc[s]) * (q - 32). Column 128 h + 32 g + i (h < 2, g < 4, i < 32): low bits
 *     ql[64 h + 32 (g % 2) + i] >> 4 (g / 2), high bits qh[32 h + i] >> 2 g.
 *
 * Every format decodes 32 columns at a time (a "chunk": the whole block, or 1 of a K-quant's 8): one function per
 * format gathers its bits into 32 int8 quants, byte j for column j, and make_chunk turns them into four vectors of
 * floats q, with a scale d for each 16 columns and an offset m: w = d * q + m. d is formed as gguf-py forms it (an
 * fp16 times a K-quant's integer sub-block scale: exact in float32), so dequantized weights round exactly as
 * gguf-py's do, d * q and then + m (built with -ffp-contract=off so the two are not fused).
 *
 * Lane order: make_chunk takes byte k of each 32-bit lane of the quants into vector k, with shifts alone, so
 * lane l of vector k is column 4 l + k. Byte shuffles (widening 8 bytes at a time in column order) were the
 * decode's bottleneck, 10-25% slower. The GEMV and the tile path read x in the same order (stride_columns, once
 * per call); dequantized rows are put back in column order (store_in_order). Q8_0, whose quants are bytes in
 * memory already, widens them straight from there, in column order (lanes_strided).
 *
 * Activations stay float32 by default (the result equals a float32 matmul with the dequantized weight up to float
 * rounding); opt-in, they are quantized to 8 bits as llama.cpp does and multiplied in integers (gguf_matmul_q8, at
 * the end of the file: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights). One activation row factors each chunk's scale out
 * (gemv_rows); several rows decode weight rows into a buffer (gemm_rows; on AVX-512 CPUs gemm_rows_wide, the same
 * sums bit for bit in 512-bit vectors); embedding lookups and the many-row path dequantize whole rows
 * (dequantize_rows). Output rows are split over the pool's workers (thread_pool.c).
 */
#include "native.h"

#include <stdlib.h>
#include <string.h>

#ifndef Q8_GEMV_ROWS
#define Q8_GEMV_ROWS 1
#endif

enum {
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
};

/* fn(T, ...) with T the weight type as a constant: each format gets its own inlined loop. */
#define DISPATCH(type, fn, ...)                                                                                   \
    switch (type) {                                                                                               \
    case GGML_Q4_0: fn(GGML_Q4_0, __VA_ARGS__); break;                                                            \
    case GGML_Q4_1: fn(GGML_Q4_1, __VA_ARGS__); break;                                                            \
    case GGML_Q5_0: fn(GGML_Q5_0, __VA_ARGS__); break;                                                            \
    case GGML_Q5_1: fn(GGML_Q5_1, __VA_ARGS__); break;                                                            \
    case GGML_Q8_0: fn(GGML_Q8_0, __VA_ARGS__); break;                                                            \
    case GGML_Q4_K: fn(GGML_Q4_K, __VA_ARGS__); break;                                                            \
    case GGML_Q5_K: fn(GGML_Q5_K, __VA_ARGS__); break;                                                            \
    default: fn(GGML_Q6_K, __VA_ARGS__); break;                                                                   \
    }

static inline int block_bytes(int type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

static inline int block_chunks(int type) { return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ? 8 : 1; }

/* Chunks in lane order (see the top of the file), or in column order: Q8_0, whose bytes convert from memory. */
static inline int lanes_strided(int type) { return type != GGML_Q8_0; }

static inline int has_min(int type) {
    return type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q4_K || type == GGML_Q5_K;
}

static inline float half_to_float(const uint8_t *p) { return _cvtsh_ss((uint16_t)(p[0] | (p[1] << 8))); }

/* 32 columns of a row, in lane order but for Q8_0 (see the top of the file): w = d * q[k] + m, lane by lane. */
struct chunk {
    __m256 q[4];
    __m256 d; /* lanes 0-3 scale columns 0-15, lanes 4-7 columns 16-31 (they differ for Q6_K only) */
    float m;
};

/* --- 32 quants as int8 bytes (byte j: column j), and as a chunk in lane order --- */

static inline __m256i mask8(int bits) { return _mm256_set1_epi8((char)bits); }

/* (p[j] >> shift) & mask for the 32 bytes at p. */
static inline __m256i bits32(const uint8_t *p, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)p), shift), mask8(mask));
}

/* The 16 nibble bytes at qs as 32 quants: low halves are columns 0-15, high halves 16-31. */
static inline __m256i nibbles(const uint8_t *qs) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), mask8(0x0F));
}

/* Byte j = bit j of the 32 bits at qh, times 16: the fifth bit of Q5_0 / Q5_1 quants. */
static inline __m256i fifth_bits(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), /* byte j <- byte j / 8 */
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), mask8(0x10));
}

/* The chunk of int8 quants q8 (byte j: column j) with scale d and offset m. Vector k takes byte k of every 32-bit
 * lane (shifted to the top, then arithmetic-shifted down: sign-extended), so lane l is column 4 l + k. */
static inline struct chunk make_chunk(__m256i q8, __m256 d, float m) {
    struct chunk ch = {.d = d, .m = m};
    for (int k = 0; k < 4; k++)
        ch.q[k] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q8, 24 - 8 * k), 24));
    return ch;
}

/* --- one decode function per format: chunk c of the block at b --- */

static inline struct chunk q4_0_chunk(const uint8_t *b) {
    return make_chunk(_mm256_sub_epi8(nibbles(b + 2), mask8(8)), _mm256_set1_ps(half_to_float(b)), 0.0f);
}

static inline struct chunk q4_1_chunk(const uint8_t *b) {
    return make_chunk(nibbles(b + 4), _mm256_set1_ps(half_to_float(b)), half_to_float(b + 2));
}

static inline struct chunk q5_0_chunk(const uint8_t *b) {
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)), mask8(16));
    return make_chunk(q, _mm256_set1_ps(half_to_float(b)), 0.0f);
}

static inline struct chunk q5_1_chunk(const uint8_t *b) {
    const __m256i q = _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4));
    return make_chunk(q, _mm256_set1_ps(half_to_float(b)), half_to_float(b + 2));
}

/* Q8_0's quants are bytes in memory already: sign-extended straight from there, in column order (lanes_strided). */
static inline struct chunk q8_0_chunk(const uint8_t *b) {
    struct chunk ch = {.d = _mm256_set1_ps(half_to_float(b)), .m = 0.0f};
    for (int k = 0; k < 4; k++)
        ch.q[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k))));
    return ch;
}

/* Q4_K / Q5_K: sub-block c's scale and min from the 12 packed bytes (6 bits each: c < 4 in the low bits of
 * bytes c and c + 4, c >= 4 split between byte c + 4 and the top bits of bytes c - 4 and c). */
static inline struct chunk k_chunk(const uint8_t *b, int c, const uint8_t *qh) {
    const uint8_t *s = b + 4, *qs = b + 4 + 12 + (qh ? 32 : 0);
    int sc, mn;
    if (c < 4) {
        sc = s[c] & 63;
        mn = s[c + 4] & 63;
    } else {
        sc = (s[c + 4] & 0x0F) | ((s[c - 4] >> 6) << 4);
        mn = (s[c + 4] >> 4) | ((s[c] >> 6) << 4);
    }
    __m256i q = bits32(qs + 32 * (c >> 1), 4 * (c & 1), 0x0F);
    if (qh) q = _mm256_or_si256(q, _mm256_slli_epi16(bits32(qh, c, 1), 4));
    return make_chunk(q, _mm256_set1_ps(half_to_float(b) * (float)sc), -(half_to_float(b + 2) * (float)mn));
}

static inline struct chunk q4_k_chunk(const uint8_t *b, int c) { return k_chunk(b, c, NULL); }

static inline struct chunk q5_k_chunk(const uint8_t *b, int c) { return k_chunk(b, c, b + 16); }

/* Q6_K: the chunk is sub-blocks 2c (columns 0-15: lanes 0-3) and 2c + 1 (lanes 4-7). */
static inline struct chunk q6_k_chunk(const uint8_t *b, int c) {
    const int h = c >> 2, g = c & 3;
    const __m256i low = bits32(b + 64 * h + 32 * (g & 1), 4 * (g >> 1), 0x0F);
    const __m256i high = _mm256_slli_epi16(bits32(b + 128 + 32 * h, 2 * g, 3), 4);
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    const __m256 scales = _mm256_setr_m128(_mm_set1_ps(d * (float)sc[2 * c]), _mm_set1_ps(d * (float)sc[2 * c + 1]));
    return make_chunk(_mm256_sub_epi8(_mm256_or_si256(low, high), mask8(32)), scales, 0.0f);
}

static inline __attribute__((always_inline)) struct chunk block_chunk(int type, const uint8_t *b, int c) {
    switch (type) {
    case GGML_Q4_0: return q4_0_chunk(b);
    case GGML_Q4_1: return q4_1_chunk(b);
    case GGML_Q5_0: return q5_0_chunk(b);
    case GGML_Q5_1: return q5_1_chunk(b);
    case GGML_Q8_0: return q8_0_chunk(b);
    case GGML_Q4_K: return q4_k_chunk(b, c);
    case GGML_Q5_K: return q5_k_chunk(b, c);
    default: return q6_k_chunk(b, c);
    }
}

/* --- lane order and column order --- */

/* rows x K floats into lane order: out[32 i + 8 k + l] = x[32 i + 4 l + k]. Each 32 floats as two 4 x 4
 * transposes (l < 4, l >= 4): element by element this was ~1 ns a float, a few ms of a 32-row decode step. */
static void stride_columns(const float *x, int64_t rows, int64_t K, float *out) {
    for (int64_t i = 0; i < rows * K / 32; i++)
        for (int half = 0; half < 2; half++) {
            const float *src = x + 32 * i + 16 * half;
            __m128 r0 = _mm_loadu_ps(src), r1 = _mm_loadu_ps(src + 4), r2 = _mm_loadu_ps(src + 8),
                   r3 = _mm_loadu_ps(src + 12);
            _MM_TRANSPOSE4_PS(r0, r1, r2, r3); /* r_k = x[32 i + 4 l + k], l = 4 half .. 4 half + 3 */
            float *dst = out + 32 * i + 4 * half;
            _mm_storeu_ps(dst, r0);
            _mm_storeu_ps(dst + 8, r1);
            _mm_storeu_ps(dst + 16, r2);
            _mm_storeu_ps(dst + 24, r3);
        }
}

/* A chunk's four lane-order vectors stored as its 32 columns in order (a 4 x 8 transpose). */
static inline void store_in_order(const __m256 w[4], float *out) {
    const __m256 t0 = _mm256_unpacklo_ps(w[0], w[1]), t1 = _mm256_unpackhi_ps(w[0], w[1]);
    const __m256 t2 = _mm256_unpacklo_ps(w[2], w[3]), t3 = _mm256_unpackhi_ps(w[2], w[3]);
    /* u0: columns 0-3 | 16-19, u1: 4-7 | 20-23, u2: 8-11 | 24-27, u3: 12-15 | 28-31 */
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(u0, u1, 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(u2, u3, 0x20));
    _mm256_storeu_ps(out + 16, _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out + 24, _mm256_permute2f128_ps(u2, u3, 0x31));
}

/* --- the loops, shared by every format --- */

/* A row's weights, w = d * q then + m (two roundings, as gguf-py's), into out: in the chunks' order (the tile
 * paths' buffers), each group of 8 floats `step` floats after the previous one (8: packed; 16: every other 8,
 * the wide tile's interleaved rows), or, in_order (step 8), in column order (dequantized rows). */
static inline __attribute__((always_inline)) void decode_row(int type, const uint8_t *row, int64_t K, float *out,
                                                             int in_order, int64_t step) {
    const int chunks = block_chunks(type);
    for (int64_t b = 0; b < K / 32 / chunks; b++) {
#pragma GCC unroll 8
        for (int c = 0; c < chunks; c++) { /* a K-quant's 8 chunks unrolled: their bit positions are constants */
            const struct chunk ch = block_chunk(type, row + b * block_bytes(type), c);
            float *o = out + (b * chunks + c) * 4 * step;
            __m256 w[4];
            for (int k = 0; k < 4; k++) {
                w[k] = _mm256_mul_ps(ch.q[k], ch.d);
                if (has_min(type)) w[k] = _mm256_add_ps(w[k], _mm256_set1_ps(ch.m));
            }
            if (in_order && lanes_strided(type)) store_in_order(w, o);
            else
                for (int k = 0; k < 4; k++) _mm256_storeu_ps(o + step * k, w[k]);
        }
    }
}

/* y[n] = x . w[n] for one activation row (xs: in the chunks' order), each chunk's d and m factored out:
 * sum_j x_j (d q_j + m) = d (sum_j x_j q_j) + m (sum_j x_j), the chunk sums of x computed once per call (xsum).
 * Fewer operations per weight than dequantizing first; same result up to float rounding. */
static inline __attribute__((always_inline)) void gemv_rows(int type, const float *xs, const float *xsum, int64_t K,
                                                            const uint8_t *w, int64_t n0, int64_t n1, float *y) {
    const int chunks = block_chunks(type);
    const int64_t row_bytes = K / 32 / chunks * block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        float mins = 0.0f;
        for (int64_t b = 0; b < K / 32 / chunks; b++) {
#pragma GCC unroll 8
            for (int c = 0; c < chunks; c++) { /* a K-quant's 8 chunks unrolled: their bit positions are constants */
                const int64_t i = b * chunks + c;
                const struct chunk ch = block_chunk(type, row + b * block_bytes(type), c);
                const float *xc = xs + i * 32;
                __m256 t0 = _mm256_mul_ps(ch.q[0], _mm256_loadu_ps(xc));
                __m256 t1 = _mm256_mul_ps(ch.q[1], _mm256_loadu_ps(xc + 8));
                t0 = _mm256_fmadd_ps(ch.q[2], _mm256_loadu_ps(xc + 16), t0);
                t1 = _mm256_fmadd_ps(ch.q[3], _mm256_loadu_ps(xc + 24), t1);
                if (i & 1) acc1 = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), ch.d, acc1); /* two chains in turn */
                else acc0 = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), ch.d, acc0);
                if (has_min(type)) mins += ch.m * xsum[i];
            }
        }
        y[n] = hsum(_mm256_add_ps(acc0, acc1)) + mins;
    }
}

/* --- Q4_0 / Q4_1 at one activation row: two blocks per step ---
 *
 * The float path's cost is turning quants into floats (the weights stream from memory faster than that), so
 * this one spends the fewest instructions on it: the 16 nibble bytes of blocks b and b + 1 share one vector v,
 * and "vector j" (j < 8) is v & (15 << 4 j) converted as is: nibble j of each 32-bit lane, times 2^4j, one AND
 * and one conversion per 8 weights (exact: 4 significant bits; the top nibble is shifted down instead, as its
 * mask would set the sign bit). x is laid out to match once per call (pair_columns), times 2^-4j, so each
 * product is the exact (q 2^4j) (x 2^-4j) = q x product of the plain path, rounded the same (a power-of-two
 * scale changes no rounding; only an x below 2^-100 would go subnormal). Per pair of blocks the scales come as
 * [d0 m0 d1 m1] from two 32-bit loads and one fp16 conversion: d (lanes 0-3 block b, 4-7 block b + 1) scales
 * the pair's q . x sum, and m . (sum x) goes into a 4-lane accumulator. As gemv_rows it computes
 * d (sum q x) + m (sum x), with Q4_0's w = d (q - 8) as m = -8 d; about 1.5x gemv_rows' speed. */

/* Whether one activation row takes pair_gemv. */
static inline int nibble_pairs(int type, int64_t M) { return M == 1 && (type == GGML_Q4_0 || type == GGML_Q4_1); }

/* x [K] for pair_gemv: pair p (blocks 2p, 2p + 1) is 64 floats, vector j = 2k + h (nibble h of byte k) holding
 * x[b][16 h + 4 l + k] * 2^-4j in lane l (block 2p) and 4 + l (block 2p + 1), then xsp [4 per pair]: the terms
 * that multiply [d0 m0 d1 m1], [0, s0, 0, s1] for Q4_1 and [-8 s0, 0, -8 s1, 0] for Q4_0 (s: a block's sum of x).
 * An odd last block pairs with itself, its second copy against x = 0. */
static void pair_columns(int type, const float *x, int64_t K, float *xp, float *xsp) {
    const int64_t nb = K / 32;
    for (int64_t p = 0; p < (nb + 1) / 2; p++)
        for (int half = 0; half < 2; half++) {
            const int64_t b = 2 * p + half;
            float s = 0.0f;
            for (int h = 0; h < 2; h++) {
                /* rows l = x[b][16 h + 4 l + (0..3)], transposed: row k = x[b][16 h + 4 (0..3) + k] */
                __m128 r[4];
                for (int l = 0; l < 4; l++)
                    r[l] = b < nb ? _mm_loadu_ps(x + 32 * b + 16 * h + 4 * l) : _mm_setzero_ps();
                _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
                for (int k = 0; k < 4; k++) {
                    const int j = 2 * k + h; /* 2^-4j (exact), but for the top nibble, shifted down instead */
                    const __m128 scale = _mm_set1_ps(j < 7 ? 1.0f / (float)(1 << 4 * j) : 1.0f);
                    _mm_storeu_ps(xp + 64 * p + 8 * j + 4 * half, _mm_mul_ps(r[k], scale));
                }
            }
            if (b < nb)
                for (int c = 0; c < 32; c++) s += x[32 * b + c];
            xsp[4 * p + 2 * half] = type == GGML_Q4_0 ? -8.0f * s : 0.0f;
            xsp[4 * p + 2 * half + 1] = type == GGML_Q4_0 ? 0.0f : s;
        }
}

/* The blocks at b0 and b1 of one row (pair p of xp, xsp) into acc (d times q . x) and accm (the m terms). */
static inline __attribute__((always_inline)) void pair_step(int type, const uint8_t *b0, const uint8_t *b1,
                                                            const float *xp, const float *xsp, __m256 *acc,
                                                            __m128 *accm) {
    const int nib = type == GGML_Q4_1 ? 4 : 2;
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + nib))),
                                              _mm_loadu_si128((const __m128i *)(b1 + nib)), 1);
    __m256 q[8];
    for (int j = 0; j < 7; j++) q[j] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << 4 * j)));
    q[7] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
    __m256 t0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp)), t1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(xp + 8));
    for (int j = 2; j < 8; j += 2) {
        t0 = _mm256_fmadd_ps(q[j], _mm256_loadu_ps(xp + 8 * j), t0);
        t1 = _mm256_fmadd_ps(q[j + 1], _mm256_loadu_ps(xp + 8 * j + 8), t1);
    }
    uint32_t w0, w1; /* d | m << 16; Q4_0: d alone (its next bytes are quants, maybe a NaN as fp16) */
    memcpy(&w0, b0, 4);
    memcpy(&w1, b1, 4);
    if (type == GGML_Q4_0) w0 &= 0xFFFF, w1 &= 0xFFFF;
    const __m128 dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)w0), (int)w1, 1)); /* d0 m0 d1 m1 */
    const __m256 d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dm), _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
    *acc = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, *acc);
    *accm = _mm_fmadd_ps(dm, _mm_loadu_ps(xsp), *accm);
}

/* y[n] = x . w[n] for weight rows [n0, n1), one at a time: two rows at once streamed 2x slower from memory for
 * 1536-column rows (960 bytes apart: the hardware prefetcher lost track), and were only ~5% faster at 576. */
static inline __attribute__((always_inline)) void pair_gemv(int type, const float *xp, const float *xsp, int64_t K,
                                                            const uint8_t *w, int64_t n0, int64_t n1, float *y) {
    const int bb = block_bytes(type);
    const int64_t nb = K / 32, row_bytes = nb * bb;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc = _mm256_setzero_ps();
        __m128 accm = _mm_setzero_ps();
        for (int64_t p = 0; 2 * p < nb; p++) {
            const int64_t o0 = 2 * p * bb, o1 = 2 * p + 1 < nb ? o0 + bb : o0; /* an odd last block twice */
            pair_step(type, row + o0, row + o1, xp + 64 * p, xsp + 4 * p, &acc, &accm);
        }
        const __m128 m = _mm_add_ps(accm, _mm_movehl_ps(accm, accm));
        y[n] = hsum(acc) + (_mm_cvtss_f32(m) + _mm_cvtss_f32(_mm_movehdup_ps(m)));
    }
}

/* Several activation rows (xs: in the chunks' order): three weight rows are decoded into a buffer, in that order,
 * then 4 activation rows x 3 weight rows are accumulated at once (12 independent FMA chains; each loaded vector
 * feeds 3 or 4 FMAs). */
static inline __attribute__((always_inline)) void gemm_rows(int type, const float *xs, int64_t M, int64_t K,
                                                            const uint8_t *w, int64_t N, int64_t n0, int64_t n1,
                                                            float *y, float *buf) {
    const int64_t row_bytes = K / 32 / block_chunks(type) * block_bytes(type);
    for (int64_t n = n0; n < n1; n += 3) {
        for (int r = 0; r < 3; r++) /* a short last group repeats its last row: computed again, stored once */
            decode_row(type, w + (n + r < n1 ? n + r : n1 - 1) * row_bytes, K, buf + r * K, 0, 8);
        for (int64_t m = 0; m < M; m += 4) {
            const float *xr[4];
            for (int r = 0; r < 4; r++) xr[r] = xs + (m + r < M ? m + r : M - 1) * K; /* tail rows repeat */
            __m256 a[4][3];
            for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = a[r][2] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 8) { /* 12 FMAs per 7 loads */
                const __m256 w0 = _mm256_loadu_ps(buf + k), w1 = _mm256_loadu_ps(buf + K + k),
                             w2 = _mm256_loadu_ps(buf + 2 * K + k);
                for (int r = 0; r < 4; r++) {
                    const __m256 xv = _mm256_loadu_ps(xr[r] + k);
                    a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
                    a[r][2] = _mm256_fmadd_ps(xv, w2, a[r][2]);
                }
            }
            for (int r = 0; r < 4 && m + r < M; r++)
                for (int c = 0; c < 3 && n + c < n1; c++) y[(m + r) * N + n + c] = hsum(a[r][c]);
        }
    }
}

/* --- several activation rows on AVX-512 (where the CPU has it): gemm_rows' sums, half the instructions ---
 *
 * One 512-bit FMA here is two of gemm_rows' 256-bit ones side by side: lanes 0-7 accumulate weight row n, lanes
 * 8-15 row n + 1, over the same 8 columns of x (one 256-bit load broadcast to both halves), in the same order, and
 * each half is reduced by hsum as there. So every output equals gemm_rows' bit for bit (tests compare the two),
 * at twice the width: gemm_rows ran at about 50 GFLOP-pairs/s on 2 cores, near what 256-bit FMAs allow. The 32
 * registers hold WIDE_PAIRS row pairs x WIDE_ROWS activation rows (24 accumulators; 11 loads per 24 FMAs). The
 * pairs' rows are decoded into buf interleaved by 8 floats (decode_row's step 16). */

enum { WIDE_PAIRS = 3, WIDE_ROWS = 8 };

/* Q4_0, Q4_1, Q5_0, Q5_1: a block's 32 int8 quants (byte j: column j), as block_chunk passes them to make_chunk. */
static inline __m256i block_quants(int type, const uint8_t *b) {
    switch (type) {
    case GGML_Q4_0: return _mm256_sub_epi8(nibbles(b + 2), mask8(8));
    case GGML_Q4_1: return nibbles(b + 4);
    case GGML_Q5_0: return _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)), mask8(16));
    default: return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4)); /* Q5_1 */
    }
}

/* Whether two rows decode at once in 512-bit vectors (decode_pair): the 32-column formats. */
static inline int pair_decodes(int type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q8_0;
}

/* Rows a and b into gemm_rows_wide's interleaved buffer, as decode_row(..., 16) of each would put them (the same
 * per-lane operations: make_chunk's shifts and conversion, d * q, + m; Q8_0 as q8_0_chunk), one 512-bit vector
 * for both rows' 8 columns: half the instructions of two decode_row calls, which at 16 activation rows took about
 * as long as the FMAs. */
static inline WIDE_TARGET __attribute__((always_inline)) void decode_pair(int type, const uint8_t *a,
                                                                          const uint8_t *b, int64_t K, float *out) {
    const int bb = block_bytes(type);
    for (int64_t i = 0; i < K / 32; i++) {
        const uint8_t *ba = a + i * bb, *bq = b + i * bb;
        if (type == GGML_Q8_0) { /* column order, as q8_0_chunk: 8 bytes of each row sign-extended at once */
            const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(ba)), _mm256_set1_ps(half_to_float(bq)), 1);
            for (int k = 0; k < 4; k++) {
                const __m128i q = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(ba + 2 + 8 * k)),
                                                     _mm_loadl_epi64((const __m128i *)(bq + 2 + 8 * k)));
                _mm512_storeu_ps(out + 64 * i + 16 * k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
            }
            continue;
        }
        const __m512i q8 = _mm512_inserti64x4(_mm512_castsi256_si512(block_quants(type, ba)), block_quants(type, bq), 1);
        const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(ba)), _mm256_set1_ps(half_to_float(bq)), 1);
        const __m512 m = has_min(type) ? _mm512_insertf32x8(_mm512_set1_ps(half_to_float(ba + 2)),
                                                            _mm256_set1_ps(half_to_float(bq + 2)), 1)
                                       : _mm512_setzero_ps();
        for (int k = 0; k < 4; k++) {
            __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(q8, 24 - 8 * k), 24)), d);
            if (has_min(type)) w = _mm512_add_ps(w, m);
            _mm512_storeu_ps(out + 64 * i + 16 * k, w);
        }
    }
}

static inline WIDE_TARGET __attribute__((always_inline)) void gemm_rows_wide(int type, const float *xs, int64_t M,
                                                                             int64_t K, const uint8_t *w, int64_t N,
                                                                             int64_t n0, int64_t n1, float *y,
                                                                             float *buf) {
    const int64_t row_bytes = K / 32 / block_chunks(type) * block_bytes(type);
    for (int64_t n = n0; n < n1; n += 2 * WIDE_PAIRS) {
        const uint8_t *wr[2 * WIDE_PAIRS]; /* a short last group repeats its last row: computed, not stored */
        for (int r = 0; r < 2 * WIDE_PAIRS; r++) wr[r] = w + (n + r < n1 ? n + r : n1 - 1) * row_bytes;
        for (int p = 0; p < WIDE_PAIRS; p++) {
            if (pair_decodes(type)) decode_pair(type, wr[2 * p], wr[2 * p + 1], K, buf + p * 2 * K);
            else
                for (int r = 0; r < 2; r++) decode_row(type, wr[2 * p + r], K, buf + p * 2 * K + r * 8, 0, 16);
        }
        for (int64_t m = 0; m < M; m += WIDE_ROWS) {
            const float *xr[WIDE_ROWS];
            for (int r = 0; r < WIDE_ROWS; r++) xr[r] = xs + (m + r < M ? m + r : M - 1) * K; /* tail rows repeat */
            __m512 a[WIDE_ROWS][WIDE_PAIRS];
            for (int r = 0; r < WIDE_ROWS; r++)
                for (int p = 0; p < WIDE_PAIRS; p++) a[r][p] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 8) {
                __m512 wv[WIDE_PAIRS];
                for (int p = 0; p < WIDE_PAIRS; p++) wv[p] = _mm512_loadu_ps(buf + p * 2 * K + 2 * k);
                for (int r = 0; r < WIDE_ROWS; r++) {
                    const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[r] + k));
                    for (int p = 0; p < WIDE_PAIRS; p++) a[r][p] = _mm512_fmadd_ps(xv, wv[p], a[r][p]);
                }
            }
            for (int r = 0; r < WIDE_ROWS && m + r < M; r++)
                for (int p = 0; p < WIDE_PAIRS; p++) {
                    float *yr = y + (m + r) * N + n + 2 * p;
                    if (n + 2 * p < n1) yr[0] = hsum(_mm512_castps512_ps256(a[r][p]));
                    if (n + 2 * p + 1 < n1) yr[1] = hsum(_mm512_extractf32x8_ps(a[r][p], 1));
                }
        }
    }
}

/* Whether the kernels take their AVX-512 paths (gemm_rows_wide here, attend_group in paged_attention.c): the CPU
 * (and OS) run AVX-512, unless native_wide said not. */
static int wide_allowed = 1;

int wide_paths(void) {
    return wide_allowed && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
}

/* request 0: the 256-bit paths only (tests compare the two, bit for bit), 1: the widest the CPU runs, -1: unchanged.
 * Returns 1 when the AVX-512 paths are taken now, else 0. */
int native_wide(int request) {
    if (request >= 0) wide_allowed = request;
    return wide_paths();
}

/* K is a whole number of blocks of a known type. */
static int valid(int type, int64_t K) { return block_bytes(type) != 0 && K % (32 * block_chunks(type)) == 0; }

struct matmul_job {
    int type;
    const float *xs, *xsum; /* x in the chunks' order (lanes_strided); its chunk sums (one row); for pair_gemv
                             * its xp and xsp */
    int64_t M, K, N;
    const uint8_t *w;
    float *y;
};

/* Rows [8 * g0, 8 * g1): whole 8-row groups, so two threads never share a cache line of y at M == 1. */
static void matmul_part(void *arg, int64_t g0, int64_t g1) {
    const struct matmul_job *j = (const struct matmul_job *)arg;
    const int64_t n0 = g0 * 8, n1 = g1 * 8 < j->N ? g1 * 8 : j->N;
    if (nibble_pairs(j->type, j->M)) {
        if (j->type == GGML_Q4_0) pair_gemv(GGML_Q4_0, j->xs, j->xsum, j->K, j->w, n0, n1, j->y);
        else pair_gemv(GGML_Q4_1, j->xs, j->xsum, j->K, j->w, n0, n1, j->y);
        return;
    }
    if (j->M == 1) {
        DISPATCH(j->type, gemv_rows, j->xs, j->xsum, j->K, j->w, n0, n1, j->y);
        return;
    }
    float *buf = (float *)aligned_alloc(64, (size_t)(3 * j->K) * sizeof(float));
    if (!buf) abort();
    DISPATCH(j->type, gemm_rows, j->xs, j->M, j->K, j->w, j->N, n0, n1, j->y, buf);
    free(buf);
}

/* matmul_part for several rows on AVX-512 (gemm_rows_wide), whole 8-row groups as there. */
static WIDE_TARGET void matmul_part_wide(void *arg, int64_t g0, int64_t g1) {
    const struct matmul_job *j = (const struct matmul_job *)arg;
    const int64_t n0 = g0 * 8, n1 = g1 * 8 < j->N ? g1 * 8 : j->N;
    float *buf = (float *)aligned_alloc(64, (size_t)(2 * WIDE_PAIRS * j->K) * sizeof(float));
    if (!buf) abort();
    DISPATCH(j->type, gemm_rows_wide, j->xs, j->M, j->K, j->w, j->N, n0, n1, j->y, buf);
    free(buf);
}

/* y[M, N] = x[M, K] @ w^T. Returns 0, or -1 for an unknown type or a K that is not a whole number of blocks. */
int gguf_matmul(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                int threads) {
    if (!valid(type, K)) return -1;
    if (nibble_pairs(type, M)) {
        const int64_t pairs = (K / 32 + 1) / 2;
        float *xp = (float *)malloc((size_t)(68 * pairs) * sizeof(float));
        if (!xp) abort();
        pair_columns(type, x, K, xp, xp + 64 * pairs);
        struct matmul_job job = {type, xp, xp + 64 * pairs, M, K, N, w, y};
        parallel_for(threads, (N + 7) / 8, matmul_part, &job);
        free(xp);
        return 0;
    }
    /* one allocation: x's chunk sums (used at M == 1) and, for chunks in lane order, x in that order */
    const int64_t sums = K / 32, strided = lanes_strided(type) ? M * K : 0;
    float *scratch = (float *)malloc((size_t)(sums + strided) * sizeof(float));
    if (!scratch && sums + strided) abort();
    for (int64_t i = 0; i < sums; i++) {
        float total = 0.0f;
        for (int c = 0; c < 32; c++) total += x[i * 32 + c];
        scratch[i] = total;
    }
    if (strided) stride_columns(x, M, K, scratch + sums);
    struct matmul_job job = {type, strided ? scratch + sums : x, scratch, M, K, N, w, y};
    parallel_for(threads, (N + 7) / 8, M > 1 && wide_paths() ? matmul_part_wide : matmul_part, &job);
    free(scratch);
    return 0;
}

struct dequantize_job {
    int type;
    const uint8_t *w;
    int64_t K;
    const int64_t *ids;
    float *out;
};

static inline __attribute__((always_inline)) void dequantize_rows(int type, const struct dequantize_job *j,
                                                                  int64_t i0, int64_t i1) {
    const int64_t row_bytes = j->K / 32 / block_chunks(type) * block_bytes(type);
    for (int64_t i = i0; i < i1; i++)
        decode_row(type, j->w + (j->ids ? j->ids[i] : i) * row_bytes, j->K, j->out + i * j->K, 1, 8);
}

static void dequantize_part(void *arg, int64_t i0, int64_t i1) {
    const struct dequantize_job *j = (const struct dequantize_job *)arg;
    DISPATCH(j->type, dequantize_rows, j, i0, i1);
}

/* out[i] = dequantized row ids[i] of w (an embedding lookup); ids == NULL: rows 0..n-1 (the whole weight). */
int gguf_dequantize_rows(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out,
                         int threads) {
    if (!valid(type, K)) return -1;
    struct dequantize_job job = {type, w, K, ids, out};
    parallel_for(threads, n, dequantize_part, &job);
    return 0;
}

/* --- 8-bit activations (opt-in: --cpu-activation-quant q8), as llama.cpp multiplies its Q8_0 / Q8_1 blocks ---
 *
 * Each 32-value block of an activation row becomes int8 quants q with one float32 scale d = amax / 127,
 * q = x * (1 / d) rounded to nearest, ties to even (all 0 where d is 0), and its sum s = d * sum(q). A weight block
 * of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 is w = dw * u + cw over its quants u (bytes in column order: Q4 / Q5 unsigned,
 * cw = -8 dw for Q4_0, -16 dw for Q5_0, the block's m for Q4_1 / Q5_1; Q8_0 signed, cw = 0), so
 *     sum_j w_j (d q_j) = (dw d) sum_j u_j q_j + cw s.
 * The integer sum is exact: maddubs multiplies unsigned by signed bytes into pairs of int16 (Q8_0 takes |w| and q with
 * w's sign, as llama.cpp; a pair is at most 2 * 128 * 127 < 2^15: no saturation), madd by ones widens them into 8 int32 lanes. Only
 * the float scaling rounds, so the result is the float64 product of the rounded activations and the dequantized
 * weights up to float32 rounding, no longer the float32-activation result. */

static inline int q8_supported(int type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q8_0;
}

/* M rows of quantized activations: quants q[M * K], per block d and s [M * K / 32]. */
struct q8_rows_act {
    int8_t *q;
    float *d, *s;
};

static void quantize_q8_block(const float *x, int8_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float dx = _mm_cvtss_f32(m) / 127.0f, inv = dx != 0.0f ? 1.0f / dx : 0.0f;
    __m256i i[4];
    for (int k = 0; k < 4; k++)
        i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* packs work within 128-bit halves: the bytes come out as 4-column groups 0, 8, 16, 24, 4, 12, 20, 28 */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    *d = dx;
    *s = dx * (float)_mm_cvtsi128_si32(h);
}

/* A weight block's 32 quants u as bytes in column order, its dw and cw (see above). */
static inline __m256i q8_weight(int type, const uint8_t *b, float *dw, float *cw) {
    *dw = half_to_float(b);
    switch (type) {
    case GGML_Q4_0: *cw = -8.0f * *dw; return nibbles(b + 2);
    case GGML_Q4_1: *cw = half_to_float(b + 2); return nibbles(b + 4);
    case GGML_Q5_0: *cw = -16.0f * *dw; return _mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2));
    case GGML_Q5_1: *cw = half_to_float(b + 2); return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4));
    default: *cw = 0.0f; return _mm256_loadu_si256((const __m256i *)(b + 2)); /* Q8_0 */
    }
}

/* sum_j u_j q_j over a block, as 8 float lanes of exact int32 partial sums. */
static inline __m256 q8_block_dot(int type, __m256i u, const int8_t *q) {
    const __m256i qx = _mm256_loadu_si256((const __m256i *)q);
    const __m256i pairs = type == GGML_Q8_0 ? _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(qx, u))
                                            : _mm256_maddubs_epi16(u, qx);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* sum_b c[b] s[b] over n floats, 8 lanes at a time. */
static inline float dot_floats(const float *c, const float *s, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= n; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(c + b), _mm256_loadu_ps(s + b), acc);
    float total = hsum(acc);
    for (; b < n; b++) total += c[b] * s[b];
    return total;
}

/* out[w][i] = weight row wr[w] . activation row i (its blocks from ar[i] on), for RW weight rows x RA activation
 * rows: RW * RA independent FMA chains, each decoded weight block used RA times and each activation block RW
 * times. A chain sums (p * d) * dw over the blocks (p: the integer sums); the cw * s terms are summed after the
 * loop from the weight rows' cw, kept in cwb [RW * nb]. */
static inline __attribute__((always_inline)) void q8_tile(int type, int RW, int RA, const struct q8_rows_act *a,
                                                          int64_t nb, const uint8_t *const *wr, const int64_t *ar,
                                                          float *cwb, float out[4][4]) {
    __m256 acc[4][4];
    for (int w = 0; w < RW; w++)
        for (int i = 0; i < RA; i++) acc[w][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int w = 0; w < RW; w++) {
            float dw, cw;
            const __m256i u = q8_weight(type, wr[w] + b * block_bytes(type), &dw, &cw);
            cwb[w * nb + b] = cw;
            const __m256 dwv = _mm256_set1_ps(dw);
            for (int i = 0; i < RA; i++) {
                const __m256 p = q8_block_dot(type, u, a->q + 32 * (ar[i] + b));
                acc[w][i] = _mm256_fmadd_ps(_mm256_mul_ps(p, _mm256_broadcast_ss(a->d + ar[i] + b)), dwv, acc[w][i]);
            }
        }
    }
    for (int w = 0; w < RW; w++)
        for (int i = 0; i < RA; i++)
            out[w][i] = hsum(acc[w][i]) + (type == GGML_Q8_0 ? 0.0f : dot_floats(cwb + w * nb, a->s + ar[i], nb));
}

/* y[m, n] for weight rows [n0, n1) in tiles of RW weight rows x RA activation rows (a short last tile repeats its
 * last row: computed again, stored once). */
static inline __attribute__((always_inline)) void q8_rows(int type, int RW, int RA, const struct q8_rows_act *a,
                                                          int64_t M, int64_t K, const uint8_t *w, int64_t N,
                                                          int64_t n0, int64_t n1, float *y, float *cwb) {
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(type);
    for (int64_t n = n0; n < n1; n += RW) {
        const uint8_t *wr[4];
        for (int r = 0; r < RW; r++) wr[r] = w + (n + r < n1 ? n + r : n1 - 1) * row_bytes;
        for (int64_t m = 0; m < M; m += RA) {
            int64_t ar[4];
            for (int i = 0; i < RA; i++) ar[i] = (m + i < M ? m + i : M - 1) * nb;
            float out[4][4];
            q8_tile(type, RW, RA, a, nb, wr, ar, cwb, out);
            for (int r = 0; r < RW && n + r < n1; r++)
                for (int i = 0; i < RA && m + i < M; i++) y[(m + i) * N + n + r] = out[r][i];
        }
    }
}

/* --- one activation row (the GEMV of a decode step at batch 1) ---
 *
 * Groups of 8 blocks: each block's integer dot (8 int32 lanes) is reduced horizontally into one lane of a vector of
 * the 8 blocks' sums (integers: exact), converted to float once, multiplied by the 8 blocks' dx * dw and accumulated;
 * the 8 weight scales (and Q4_1 / Q5_1 mins) come in one gather, the activation scales and sums are contiguous. Per
 * block that leaves the quants' decode and two integer multiply-adds; llama.cpp's per-block scalar scale handling
 * (and ours before) was about half of the instructions. RW weight rows share each activation block's load. */

/* The 32 quants u of a weight block as bytes in column order (see q8_weight). */
static inline __m256i q8_quants(int type, const uint8_t *b) {
    switch (type) {
    case GGML_Q4_0: return nibbles(b + 2);
    case GGML_Q4_1: return nibbles(b + 4);
    case GGML_Q5_0: return _mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2));
    case GGML_Q5_1: return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4));
    default: return _mm256_loadu_si256((const __m256i *)(b + 2)); /* Q8_0 */
    }
}

/* sum_j u_j q_j over a block as 8 int32 lanes (exact, see above). */
static inline __m256i q8_int_dot(int type, __m256i u, __m256i qx) {
    const __m256i pairs = type == GGML_Q8_0 ? _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(qx, u))
                                            : _mm256_maddubs_epi16(u, qx);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* Blocks i < valid of the 4 from b (weight) and q (activation quants): lanes 0-3 hold their dots' halves over lanes
 * 0-3 of q8_int_dot, lanes 4-7 over lanes 4-7 (hsum4x2 adds the two). Blocks from valid on count 0. */
static inline __attribute__((always_inline)) __m256i q8_dot4(int type, const uint8_t *b, const int8_t *q, int valid) {
    const int bb = block_bytes(type);
    __m256i p[4];
    for (int i = 0; i < 4; i++)
        p[i] = i < valid ? q8_int_dot(type, q8_quants(type, b + i * bb), _mm256_loadu_si256((const __m256i *)(q + 32 * i)))
                         : _mm256_setzero_si256();
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

/* Lane i of the result: block i's whole dot, from q8_dot4 of blocks 0-3 (t0) and 4-7 (t1). */
static inline __m256i hsum4x2(__m256i t0, __m256i t1) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20), _mm256_permute2x128_si256(t0, t1, 0x31));
}

/* dw and cw (see q8_weight) of the 8 blocks from b on (the lanes of `mask`; the others 0): each block's first 4
 * bytes, d | m << 16 for Q4_1 / Q5_1, in one gather; the fp16 halves split with a byte shuffle. */
static inline void q8_scales8(int type, const uint8_t *b, __m256i offsets, __m256i mask, int full, __m256 *dw,
                              __m256 *cw) {
    const __m256i words = full ? _mm256_i32gather_epi32((const int *)b, offsets, 1)
                               : _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)b, offsets, mask, 1);
    const __m256i split = _mm256_shuffle_epi8(words, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                                      0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i halves = _mm256_permute4x64_epi64(split, 0xD8); /* d of blocks 0-7, then the high halves */
    *dw = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    switch (type) {
    case GGML_Q4_0: *cw = _mm256_mul_ps(_mm256_set1_ps(-8.0f), *dw); break;
    case GGML_Q5_0: *cw = _mm256_mul_ps(_mm256_set1_ps(-16.0f), *dw); break;
    case GGML_Q4_1: case GGML_Q5_1: *cw = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)); break;
    default: *cw = _mm256_setzero_ps(); /* Q8_0 */
    }
}

#ifndef Q8_PREFETCH_BYTES
#define Q8_PREFETCH_BYTES 2048 /* ahead of each weight row's reads */
#endif

/* Blocks b0 .. b0 + valid - 1 (valid <= 8; a constant 8 but for a row's last group) of RW weight rows, into acc[r]. */
static inline __attribute__((always_inline)) void q8_gemv_group(int type, int RW, const struct q8_rows_act *a,
                                                                const uint8_t *const *wr, int64_t b0, int valid,
                                                                __m256i offsets, __m256 *acc) {
    const int bb = block_bytes(type), full = valid == 8;
    for (int r = 0; r < RW; r++)
        for (int off = 0; off < 8 * bb; off += 64) _mm_prefetch((const char *)(wr[r] + b0 * bb + Q8_PREFETCH_BYTES + off), _MM_HINT_T0);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 dx = full ? _mm256_loadu_ps(a->d + b0) : _mm256_maskload_ps(a->d + b0, mask);
    const __m256 s = type == GGML_Q8_0 ? _mm256_setzero_ps()
                     : full ? _mm256_loadu_ps(a->s + b0) : _mm256_maskload_ps(a->s + b0, mask);
    for (int r = 0; r < RW; r++) {
        __m256 dw, cw;
        q8_scales8(type, wr[r] + b0 * bb, offsets, mask, full, &dw, &cw);
        const uint8_t *wb = wr[r] + b0 * bb;
        const int8_t *q = a->q + 32 * b0;
        const __m256i dots = hsum4x2(q8_dot4(type, wb, q, valid), q8_dot4(type, wb + 4 * bb, q + 128, valid - 4));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(dx, dw), acc[r]);
        if (type != GGML_Q8_0) acc[r] = _mm256_fmadd_ps(cw, s, acc[r]);
    }
}

/* y[n] = w[n] . x for weight rows [n0, n1), RW at a time (a short last group repeats its last row). */
static inline __attribute__((always_inline)) void q8_gemv(int type, int RW, const struct q8_rows_act *a, int64_t K,
                                                          const uint8_t *w, int64_t n0, int64_t n1, float *y) {
    const int bb = block_bytes(type);
    const int64_t nb = K / 32, row_bytes = nb * bb;
    const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bb));
    for (int64_t n = n0; n < n1; n += RW) {
        const uint8_t *wr[4];
        __m256 acc[4];
        for (int r = 0; r < RW; r++) {
            wr[r] = w + (n + r < n1 ? n + r : n1 - 1) * row_bytes;
            acc[r] = _mm256_setzero_ps();
        }
        int64_t b0 = 0;
        for (; b0 + 8 <= nb; b0 += 8) q8_gemv_group(type, RW, a, wr, b0, 8, offsets, acc);
        if (b0 < nb) q8_gemv_group(type, RW, a, wr, b0, (int)(nb - b0), offsets, acc);
        for (int r = 0; r < RW && n + r < n1; r++) y[n + r] = hsum(acc[r]);
    }
}

/* One activation row: q8_gemv, 2 weight rows at a time; several: tiles of 2 weight rows x 4 activation rows. */
static inline __attribute__((always_inline)) void q8_part_rows(int type, const struct q8_rows_act *a, int64_t M,
                                                               int64_t K, const uint8_t *w, int64_t N, int64_t n0,
                                                               int64_t n1, float *y, float *cwb) {
    if (M == 1) q8_gemv(type, Q8_GEMV_ROWS, a, K, w, n0, n1, y);
    else q8_rows(type, 2, 4, a, M, K, w, N, n0, n1, y, cwb);
}

struct q8_job {
    int type;
    struct q8_rows_act a;
    int64_t M, K, N;
    const uint8_t *w;
    float *y;
};

static void q8_part(void *arg, int64_t g0, int64_t g1) { /* whole 8-row groups, as matmul_part */
    const struct q8_job *j = (const struct q8_job *)arg;
    const int64_t n0 = g0 * 8, n1 = g1 * 8 < j->N ? g1 * 8 : j->N;
    float *cwb = (float *)malloc((size_t)(4 * j->K / 32) * sizeof(float));
    if (!cwb) abort();
    DISPATCH(j->type, q8_part_rows, &j->a, j->M, j->K, j->w, j->N, n0, n1, j->y, cwb);
    free(cwb);
}

/* gguf_matmul with x's rows quantized to 8 bits first (once per call, shared by all N weight rows). Returns 0, or
 * -1 for a type without an integer kernel (K-quants) or a K that is not a whole number of blocks. */
int gguf_matmul_q8(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                   int threads) {
    if (!valid(type, K) || !q8_supported(type)) return -1;
    const int64_t blocks = M * K / 32;
    uint8_t *scratch = (uint8_t *)malloc((size_t)(M * K + 2 * blocks * (int64_t)sizeof(float)) + 1);
    if (!scratch) abort();
    struct q8_job job = {type, {(int8_t *)scratch, (float *)(scratch + M * K), (float *)(scratch + M * K) + blocks},
                         M, K, N, w, y};
    for (int64_t i = 0; i < blocks; i++) quantize_q8_block(x + 32 * i, job.a.q + 32 * i, job.a.d + i, job.a.s + i);
    parallel_for(threads, (N + 7) / 8, q8_part, &job);
    free(scratch);
    return 0;
}

/* The quantized activations themselves (tests compare them with their reference): q[M * K], d and s [M * K / 32]. */
int gguf_quantize_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
    if (K % 32) return -1;
    for (int64_t i = 0; i < M * K / 32; i++) quantize_q8_block(x + 32 * i, q + 32 * i, d + i, s + i);
    return 0;
}
