/* Shared by the native kernels (compiled together into one library, see __init__.py). */
#pragma once
#include <immintrin.h>
#include <stdint.h>

/* fn(ctx, begin, end) over [0, total) split into `threads` contiguous parts; the caller runs the first. */
typedef void (*parallel_fn)(void *ctx, int64_t begin, int64_t end);
void parallel_for(int threads, int64_t total, parallel_fn fn, void *ctx);

/* The sum of the 8 lanes of v. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Entry points one kernel file calls in another (one_token.c). */
void rmsnorm(const float *x, float *residual, const float *w, int64_t rows, int64_t dim, float eps, float *out,
             int threads);
int gguf_matmul(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int threads);
int gguf_matmul_q8(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                   int threads);
int gguf_gemv_fused(int type, const float *x, int64_t K, const uint8_t *w, int64_t N, float *y, int threads,
                    const float *norm_w, float eps, int silu_mul, int accumulate, int q8);
int rope_store_kv(float *qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const int64_t *positions,
                  const float *table, const int64_t *out_loc, float *k_buf, float *v_buf, int threads);
int paged_attention(const float *q, const float *k_buf, const float *v_buf, const int64_t *slots, int64_t slot_stride,
                    const int64_t *token_req, const int64_t *token_len, int64_t tokens, int64_t H, int64_t Hkv,
                    int64_t D, float scale, float logit_cap, int64_t window, float *out, int threads);
