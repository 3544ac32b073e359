/* One decode step of attention over the paged KV pool, on the CPU (AVX2 + FMA), float32.
 *
 * Work is split over (request, head) pairs (thread_pool.c). Each request has one query token; its keys and values are the pool rows its slot list names (the request's
 * row of req_to_token), read in place: no gathered copy of K and V as the torch path makes. Per (request, head):
 * scores = scale * q . k_j over the visible positions (all of 0 .. seq_len - 1, or with a window W the last W),
 * optionally softcapped (cap * tanh(s / cap)), softmax, out = sum_j p_j v_j. GQA: head h reads KV head
 * h / (H / Hkv).
 */
#include "native.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    __m256 v = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

static inline void axpy(float alpha, const float *x, float *y, int64_t n) { /* y += alpha * x */
    const __m256 a = _mm256_set1_ps(alpha);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += alpha * x[i];
}

struct attention_job {
    const float *q, *k_buf, *v_buf;
    const int64_t *slots, *seq_lens;
    int64_t slot_stride, H, Hkv, D, max_len, window;
    float scale, logit_cap;
    float *out;
};

static void attention_part(void *arg, int64_t i0, int64_t i1) {
    const struct attention_job *j = (const struct attention_job *)arg;
    const int64_t group = j->H / j->Hkv, row = j->Hkv * j->D, D = j->D;
    float *scores = (float *)malloc((size_t)j->max_len * sizeof(float));
    if (!scores) abort();
    for (int64_t i = i0; i < i1; i++) {
        const int64_t b = i / j->H, h = i % j->H, kvh = h / group, len = j->seq_lens[b];
        const int64_t first = j->window > 0 && len > j->window ? len - j->window : 0;
        const float *qh = j->q + i * D;
        const int64_t *pos_slots = j->slots + b * j->slot_stride;
        float best = -INFINITY;
        for (int64_t p = first; p < len; p++) {
            float s = j->scale * dot(qh, j->k_buf + pos_slots[p] * row + kvh * D, D);
            if (j->logit_cap > 0) s = j->logit_cap * tanhf(s / j->logit_cap);
            scores[p] = s;
            best = s > best ? s : best;
        }
        float total = 0.0f;
        for (int64_t p = first; p < len; p++) {
            scores[p] = expf(scores[p] - best);
            total += scores[p];
        }
        float *oh = j->out + i * D;
        for (int64_t d = 0; d < D; d++) oh[d] = 0.0f;
        for (int64_t p = first; p < len; p++) axpy(scores[p] / total, j->v_buf + pos_slots[p] * row + kvh * D, oh, D);
    }
    free(scores);
}

/* q, out: [bs, H, D]. k_buf, v_buf: [pool rows, Hkv, D]. slots: [bs, slot_stride] pool rows of each request's
 * positions. window <= 0: no window; logit_cap <= 0: no cap. Returns 0, or -1 if H is not a multiple of Hkv. */
int paged_decode_attention(const float *q, const float *k_buf, const float *v_buf, const int64_t *slots,
                           int64_t slot_stride, const int64_t *seq_lens, int64_t bs, int64_t H, int64_t Hkv,
                           int64_t D, float scale, float logit_cap, int64_t window, float *out, int threads) {
    if (Hkv <= 0 || H % Hkv != 0) return -1;
    int64_t max_len = 1;
    for (int64_t b = 0; b < bs; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    struct attention_job job = {q, k_buf, v_buf, slots, seq_lens, slot_stride, H, Hkv, D, max_len, window,
                                scale, logit_cap, out};
    parallel_for(threads, bs * H, attention_part, &job);
    return 0;
}
