/* Shared by the native kernels (compiled together into one library, see __init__.py). */
#pragma once
#include <immintrin.h>
#include <stdint.h>

/* fn(ctx, begin, end) over [0, total) in contiguous chunks, run by the caller and up to threads - 1 workers
 * (thread_pool.c); returns when every chunk is done. */
typedef void (*parallel_fn)(void *ctx, int64_t begin, int64_t end);
void parallel_for(int threads, int64_t total, parallel_fn fn, void *ctx);

/* A function compiled for AVX-512 as well (called only where wide_paths() says the CPU runs it). */
#define WIDE_TARGET __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))

/* Whether the kernels take their AVX-512 paths now (gguf_blocks.c, native_wide). */
int wide_paths(void);

/* The sum of the 8 lanes of v. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp of 8 floats (Cephes' expf: range reduction by ln 2, a degree-6 polynomial; ~1 ulp), inputs clamped to
 * [-87.3, 88.3]. glibc's scalar expf per score was a third of a decode step's attention (paged_attention.c), and
 * per SiLU-mul output about 3% of a batch-1 decoder call (one_token.c). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
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
