/* CPU matmuls over GGUF block-quantized weights, dequantized on the fly (AVX2 + FMA + F16C, OpenMP).
 *
 * A weight of N rows x K columns is stored as llama.cpp stores it: each row is K/32 blocks, one block holding
 * 32 consecutive columns:
 *   Q4_0: fp16 d, 16 bytes of nibbles          w = d * (q - 8)     (18 bytes)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m       (20 bytes)
 *   Q8_0: fp16 d, 32 int8                      w = d * q           (34 bytes)
 * Nibble j of the 16 bytes holds column j (low half of byte j) and column j + 16 (high half).
 *
 * Activations stay float32 (llama.cpp quantizes them to 8 bits; we do not, so the result equals a float32
 * matmul with the dequantized weight up to float rounding). Dequantized rows (embedding lookups, the buffers
 * of the many-row path) are rounded exactly as gguf-py's dequantize rounds them (d * q, then + m: built with
 * -ffp-contract=off so the two are not fused); one row factors each block's scale out instead (gemv_rows).
 *
 * Threads: output rows are split over the pool's workers (thread_pool.c).
 */
#include "native.h"

#include <immintrin.h>
#include <stdlib.h>

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };

static inline float half_to_float(const uint8_t *p) { return _cvtsh_ss((uint16_t)(p[0] | (p[1] << 8))); }

/* One block as four vectors of 8 float32 weights (columns 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void decode_block(int type, const uint8_t *b, __m256 w[4]) {
    if (type == GGML_Q8_0) {
        const __m256 d = _mm256_set1_ps(half_to_float(b));
        for (int i = 0; i < 4; i++) {
            __m128i q8 = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
        }
        return;
    }
    const int has_min = type == GGML_Q4_1;
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + (has_min ? 4 : 2)));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    __m256 q[4] = {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
    };
    if (has_min) {
        const __m256 m = _mm256_set1_ps(half_to_float(b + 2));
        for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(q[i], d), m);
    } else {
        const __m256 eight = _mm256_set1_ps(8.0f);
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(_mm256_sub_ps(q[i], eight), d);
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static int block_bytes(int type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q8_0: return 34;
    default: return 0;
    }
}

/* The block's 32 quants as float vectors, unscaled: q (Q4_1, Q8_0) or q - 8 (Q4_0). */
static inline __attribute__((always_inline)) void block_quants(int type, const uint8_t *b, __m256 q[4]) {
    if (type == GGML_Q8_0) {
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i))));
        return;
    }
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + (type == GGML_Q4_1 ? 4 : 2)));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    if (type == GGML_Q4_0)
        for (int i = 0; i < 4; i++) q[i] = _mm256_sub_ps(q[i], _mm256_set1_ps(8.0f));
}

/* y[n] = x . w[n] for one activation row, with the scale factored out of each block:
 * sum_j x_j (d q_j + m) = d (sum_j x_j q_j) + m (sum_j x_j), the block sums of x computed once per call
 * (xsum). Fewer operations per weight than dequantizing first; same result up to float rounding. */
static inline __attribute__((always_inline)) void gemv_rows(int type, const float *x, const float *xsum, int64_t K,
                                                            const uint8_t *w, int64_t n0, int64_t n1, float *y) {
    const int bb = block_bytes(type);
    const int64_t nb = K / 32, row_bytes = nb * bb;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        float mins = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            __m256 q[4];
            block_quants(type, blk, q);
            const float *xb = x + b * 32;
            __m256 t0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            __m256 t1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(xb + 8));
            t0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t0);
            t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t1);
            const __m256 d = _mm256_set1_ps(half_to_float(blk));
            if (b & 1) acc1 = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, acc1);
            else acc0 = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, acc0);
            if (type == GGML_Q4_1) mins += half_to_float(blk + 2) * xsum[b];
        }
        y[n] = hsum(_mm256_add_ps(acc0, acc1)) + mins;
    }
}

static inline __attribute__((always_inline)) void decode_row(int type, const uint8_t *row, int64_t K, float *out) {
    const int bb = block_bytes(type);
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 wv[4];
        decode_block(type, row + b * bb, wv);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * 32 + 8 * i, wv[i]);
    }
}

/* Several activation rows: three weight rows are decoded into a buffer, then 4 activation rows x 3 weight rows
 * are accumulated at once (12 independent FMA chains; each loaded vector feeds 3 or 4 FMAs). */
static inline __attribute__((always_inline)) void gemm_rows(int type, const float *x, int64_t M, int64_t K,
                                                            const uint8_t *w, int64_t N, int64_t n0, int64_t n1,
                                                            float *y, float *buf) {
    const int64_t row_bytes = K / 32 * block_bytes(type);
    for (int64_t n = n0; n < n1; n += 3) {
        int64_t rows[3]; /* a short last group repeats its last row: computed again, stored once */
        for (int c = 0; c < 3; c++) {
            rows[c] = n + c < n1 ? n + c : n1 - 1;
            decode_row(type, w + rows[c] * row_bytes, K, buf + c * K);
        }
        for (int64_t m = 0; m < M; m += 4) {
            const float *xr[4];
            for (int r = 0; r < 4; r++) xr[r] = x + (m + r < M ? m + r : M - 1) * K; /* tail rows repeat */
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

struct matmul_job {
    int type;
    const float *x;
    int64_t M, K, N;
    const uint8_t *w;
    float *y;
};

/* Rows [8 * g0, 8 * g1): whole 8-row groups, so two threads never share a cache line of y at M == 1. */
static void matmul_part(void *arg, int64_t g0, int64_t g1) {
    const struct matmul_job *j = (const struct matmul_job *)arg;
    const int64_t n0 = g0 * 8, n1 = g1 * 8 < j->N ? g1 * 8 : j->N;
    if (j->M == 1) {
        float xsum[j->K / 32]; /* at most a few hundred floats: K is a row of activations */
        for (int64_t b = 0; b < j->K / 32; b++) {
            float total = 0.0f;
            for (int i = 0; i < 32; i++) total += j->x[b * 32 + i];
            xsum[b] = total;
        }
        switch (j->type) { /* constant type per call: each case is its own specialised loop */
        case GGML_Q4_0: gemv_rows(GGML_Q4_0, j->x, xsum, j->K, j->w, n0, n1, j->y); break;
        case GGML_Q4_1: gemv_rows(GGML_Q4_1, j->x, xsum, j->K, j->w, n0, n1, j->y); break;
        default: gemv_rows(GGML_Q8_0, j->x, xsum, j->K, j->w, n0, n1, j->y); break;
        }
        return;
    }
    float *buf = (float *)aligned_alloc(64, (size_t)(3 * j->K) * sizeof(float));
    if (!buf) abort();
    switch (j->type) {
    case GGML_Q4_0: gemm_rows(GGML_Q4_0, j->x, j->M, j->K, j->w, j->N, n0, n1, j->y, buf); break;
    case GGML_Q4_1: gemm_rows(GGML_Q4_1, j->x, j->M, j->K, j->w, j->N, n0, n1, j->y, buf); break;
    default: gemm_rows(GGML_Q8_0, j->x, j->M, j->K, j->w, j->N, n0, n1, j->y, buf); break;
    }
    free(buf);
}

/* y[M, N] = x[M, K] @ w^T. Returns 0, or -1 for an unknown type or a K that is not a multiple of 32. */
int gguf_matmul(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                int threads) {
    if (block_bytes(type) == 0 || K % 32 != 0) return -1;
    struct matmul_job job = {type, x, M, K, N, w, y};
    parallel_for(threads, (N + 7) / 8, matmul_part, &job);
    return 0;
}

struct dequantize_job {
    int type;
    const uint8_t *w;
    int64_t K;
    const int64_t *ids;
    float *out;
};

static void dequantize_part(void *arg, int64_t i0, int64_t i1) {
    const struct dequantize_job *j = (const struct dequantize_job *)arg;
    const int64_t row_bytes = j->K / 32 * block_bytes(j->type);
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t *row = j->w + (j->ids ? j->ids[i] : i) * row_bytes;
        switch (j->type) {
        case GGML_Q4_0: decode_row(GGML_Q4_0, row, j->K, j->out + i * j->K); break;
        case GGML_Q4_1: decode_row(GGML_Q4_1, row, j->K, j->out + i * j->K); break;
        default: decode_row(GGML_Q8_0, row, j->K, j->out + i * j->K); break;
        }
    }
}

/* out[i] = dequantized row ids[i] of w (an embedding lookup); ids == NULL: rows 0..n-1 (the whole weight). */
int gguf_dequantize_rows(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out,
                         int threads) {
    if (block_bytes(type) == 0 || K % 32 != 0) return -1;
    struct dequantize_job job = {type, w, K, ids, out};
    parallel_for(threads, n, dequantize_part, &job);
    return 0;
}
