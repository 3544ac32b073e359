/* Attention of a few query tokens per request over the paged KV pool, on the CPU (AVX2 + FMA), float32: every
 * decode step, and prefill batches of short extends (a suffix after a cached prefix).
 *
 * Query token t belongs to request token_req[t] and sees its first token_len[t] positions (causal: its own
 * position + 1), or with a window W only the last W of them. Keys and values are the pool rows the request's
 * slot list names (its row of req_to_token), read in place: no gathered copy of K and V as the torch path makes.
 * Per (token, head): scores = scale * q . k_j, optionally softcapped (cap * tanh(s / cap)), softmax,
 * out = sum_j p_j v_j. GQA: head h reads KV head h / (H / Hkv). Work is split over (token, head) pairs
 * (thread_pool.c), ordered KV head first; on AVX-512, for groups of 2 or 3 heads, over (token, KV head) pairs, the
 * group's heads computed together (attend_group: the same result, bit for bit).
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
    float total = hsum(_mm256_add_ps(acc0, acc1));
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
    const int64_t *slots, *token_req, *token_len;
    int64_t slot_stride, tokens, H, Hkv, D, max_len, window;
    float scale, logit_cap;
    float *out;
};

/* The 8 lane sums of v[0..7], as one vector. */
static inline __m256 hsum8(const __m256 v[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores[first, len) -> exp(score - max), softcapped first when asked; returns their sum (unnormalised). */
static inline float softmax_weights(const struct attention_job *j, float *scores, int64_t first, int64_t len) {
    float best = -INFINITY;
    int64_t p;
    for (p = first; p < len; p++) {
        if (j->logit_cap > 0) scores[p] = j->logit_cap * tanhf(scores[p] / j->logit_cap);
        best = scores[p] > best ? scores[p] : best;
    }
    const __m256 shift = _mm256_set1_ps(best);
    __m256 sums = _mm256_setzero_ps();
    for (p = first; p + 8 <= len; p += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), shift));
        _mm256_storeu_ps(scores + p, e);
        sums = _mm256_add_ps(sums, e);
    }
    __m256 lanes[8] = {sums, sums, sums, sums, sums, sums, sums, sums};
    float total = _mm256_cvtss_f32(hsum8(lanes));
    for (; p < len; p++) {
        scores[p] = expf(scores[p] - best);
        total += scores[p];
    }
    return total;
}

/* One (request, head): scores of 8 keys at a time (one horizontal reduction per 8 keys), the output row kept in
 * registers over all values. D % 8 == 0, D <= 256; inlined with a constant D so the loops unroll. */
static inline __attribute__((always_inline)) void attend_head(const struct attention_job *j, const float *qh,
                                                              const int64_t *pos_slots, int64_t first, int64_t len,
                                                              int64_t offset, const int64_t D, float *scores,
                                                              float *oh) {
    const int64_t row = j->Hkv * j->D;
    int64_t p = first;
    for (; p + 8 <= len; p += 8) {
        const float *kr[8];
        __m256 acc[8];
        const __m256 q0 = _mm256_loadu_ps(qh);
        for (int k = 0; k < 8; k++) {
            kr[k] = j->k_buf + pos_slots[p + k] * row + offset;
            acc[k] = _mm256_mul_ps(q0, _mm256_loadu_ps(kr[k]));
        }
        for (int64_t d = 8; d < D; d += 8) { /* each chunk of q loaded once for the 8 keys */
            const __m256 qd = _mm256_loadu_ps(qh + d);
            for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kr[k] + d), acc[k]);
        }
        _mm256_storeu_ps(scores + p, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(j->scale)));
    }
    for (; p < len; p++) scores[p] = j->scale * dot(qh, j->k_buf + pos_slots[p] * row + offset, D);
    const float total = softmax_weights(j, scores, first, len);
    __m256 o[32];
    for (int64_t i = 0; i < D / 8; i++) o[i] = _mm256_setzero_ps();
    for (p = first; p < len; p++) {
        const __m256 w = _mm256_set1_ps(scores[p]);
        const float *vr = j->v_buf + pos_slots[p] * row + offset;
        for (int64_t i = 0; i < D / 8; i++) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * i), o[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int64_t i = 0; i < D / 8; i++) _mm256_storeu_ps(oh + 8 * i, _mm256_mul_ps(o[i], inv));
}

/* Any D: one key at a time, the output accumulated in memory. */
static void attend_head_any(const struct attention_job *j, const float *qh, const int64_t *pos_slots, int64_t first,
                            int64_t len, int64_t offset, float *scores, float *oh) {
    const int64_t row = j->Hkv * j->D, D = j->D;
    float best = -INFINITY;
    for (int64_t p = first; p < len; p++) {
        float s = j->scale * dot(qh, j->k_buf + pos_slots[p] * row + offset, D);
        if (j->logit_cap > 0) s = j->logit_cap * tanhf(s / j->logit_cap);
        scores[p] = s;
        best = s > best ? s : best;
    }
    float total = 0.0f;
    for (int64_t p = first; p < len; p++) {
        scores[p] = expf(scores[p] - best);
        total += scores[p];
    }
    for (int64_t d = 0; d < D; d++) oh[d] = 0.0f;
    for (int64_t p = first; p < len; p++) axpy(scores[p] / total, j->v_buf + pos_slots[p] * row + offset, oh, D);
}

/* The G query heads of one KV head for one token at once (AVX-512; G D <= 384): each key row and value row is
 * loaded once for the G heads instead of G times. Every head's arithmetic is attend_head's, lane for lane: its
 * scores in 256-bit vectors over 8 keys (G * 8 accumulators fit AVX-512's 32 registers) reduced by hsum8, the
 * same softmax, and its output summed over the keys in 512-bit vectors, each lane the same FMA chain as in
 * attend_head's 256-bit ones. So the result is attend_head's bit for bit; at 32 tokens over a 750-token prefix
 * the 256-bit loop of one head at a time was load-bound, about a third of a decode step. qg, og: the first head's
 * q and output (the group's heads are consecutive); scores: G rows of j->max_len + 8. */
static inline WIDE_TARGET __attribute__((always_inline)) void attend_group(const struct attention_job *j,
                                                                           const float *qg, const int64_t *pos_slots,
                                                                           int64_t first, int64_t len, int64_t offset,
                                                                           const int64_t D, const int G,
                                                                           float *scores, float *og) {
    const int64_t row = j->Hkv * j->D, stride = j->max_len + 8;
    int64_t p = first;
    for (; p + 8 <= len; p += 8) {
        const float *kr[8];
        __m256 acc[3][8];
        for (int k = 0; k < 8; k++) kr[k] = j->k_buf + pos_slots[p + k] * row + offset;
        for (int g = 0; g < G; g++) {
            const __m256 q0 = _mm256_loadu_ps(qg + g * D);
            for (int k = 0; k < 8; k++) acc[g][k] = _mm256_mul_ps(q0, _mm256_loadu_ps(kr[k]));
        }
        for (int64_t d = 8; d < D; d += 8) {
            __m256 qd[3];
            for (int g = 0; g < G; g++) qd[g] = _mm256_loadu_ps(qg + g * D + d);
            for (int k = 0; k < 8; k++) {
                const __m256 kv = _mm256_loadu_ps(kr[k] + d);
                for (int g = 0; g < G; g++) acc[g][k] = _mm256_fmadd_ps(qd[g], kv, acc[g][k]);
            }
        }
        for (int g = 0; g < G; g++)
            _mm256_storeu_ps(scores + g * stride + p, _mm256_mul_ps(hsum8(acc[g]), _mm256_set1_ps(j->scale)));
    }
    for (; p < len; p++)
        for (int g = 0; g < G; g++)
            scores[g * stride + p] = j->scale * dot(qg + g * D, j->k_buf + pos_slots[p] * row + offset, D);
    float total[3];
    for (int g = 0; g < G; g++) total[g] = softmax_weights(j, scores + g * stride, first, len);
    __m512 o[3][8];
    for (int g = 0; g < G; g++)
        for (int64_t i = 0; i < D / 16; i++) o[g][i] = _mm512_setzero_ps();
    for (p = first; p < len; p++) {
        const float *vr = j->v_buf + pos_slots[p] * row + offset;
        __m512 w[3];
        for (int g = 0; g < G; g++) w[g] = _mm512_set1_ps(scores[g * stride + p]);
        for (int64_t i = 0; i < D / 16; i++) {
            const __m512 v = _mm512_loadu_ps(vr + 16 * i);
            for (int g = 0; g < G; g++) o[g][i] = _mm512_fmadd_ps(w[g], v, o[g][i]);
        }
    }
    for (int g = 0; g < G; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / total[g]);
        for (int64_t i = 0; i < D / 16; i++) _mm512_storeu_ps(og + g * D + 16 * i, _mm512_mul_ps(o[g][i], inv));
    }
}

/* Whether a batch takes attend_group: a group size and head size it has a copy for, on AVX-512, and enough
 * (token, KV head) items to keep the threads busy (a batch-1 decode step splits its heads instead). */
static int grouped(const struct attention_job *j, int threads) {
    const int64_t G = j->H / j->Hkv;
    return (G == 2 || G == 3) && (j->D == 64 || j->D == 128) && j->tokens * j->Hkv >= 8 * threads && wide_paths();
}

/* Items ordered (KV head, token), as attention_part's. */
static WIDE_TARGET void attention_part_grouped(void *arg, int64_t i0, int64_t i1) {
    const struct attention_job *j = (const struct attention_job *)arg;
    const int64_t G = j->H / j->Hkv, D = j->D;
    float *scores = (float *)malloc((size_t)(G * (j->max_len + 8)) * sizeof(float));
    if (!scores) abort();
    for (int64_t i = i0; i < i1; i++) {
        const int64_t kvh = i / j->tokens, t = i % j->tokens, b = j->token_req[t], len = j->token_len[t];
        const int64_t first = j->window > 0 && len > j->window ? len - j->window : 0;
        const float *qg = j->q + (t * j->H + kvh * G) * D;
        const int64_t *pos_slots = j->slots + b * j->slot_stride, offset = kvh * D;
        float *og = j->out + (t * j->H + kvh * G) * D;
        if (G == 3 && D == 64) attend_group(j, qg, pos_slots, first, len, offset, 64, 3, scores, og);
        else if (G == 3) attend_group(j, qg, pos_slots, first, len, offset, 128, 3, scores, og);
        else if (D == 64) attend_group(j, qg, pos_slots, first, len, offset, 64, 2, scores, og);
        else attend_group(j, qg, pos_slots, first, len, offset, 128, 2, scores, og);
    }
    free(scores);
}

static void attention_part(void *arg, int64_t i0, int64_t i1) {
    const struct attention_job *j = (const struct attention_job *)arg;
    const int64_t group = j->H / j->Hkv, D = j->D;
    float *scores = (float *)malloc((size_t)(j->max_len + 8) * sizeof(float));
    if (!scores) abort();
    for (int64_t i = i0; i < i1; i++) {
        /* items ordered (KV head, token, head of its group): one KV head's K and V (a few hundred KB) stay in
         * cache while every token reads them; requests over a shared prefix read the very same rows */
        const int64_t kvh = i / (j->tokens * group), rest = i % (j->tokens * group);
        const int64_t t = rest / group, h = kvh * group + rest % group, b = j->token_req[t], len = j->token_len[t];
        const int64_t first = j->window > 0 && len > j->window ? len - j->window : 0;
        const float *qh = j->q + (t * j->H + h) * D;
        const int64_t *pos_slots = j->slots + b * j->slot_stride, offset = h / group * D;
        float *oh = j->out + (t * j->H + h) * D;
        switch (D) { /* the common head sizes get their own unrolled copy */
        case 64: attend_head(j, qh, pos_slots, first, len, offset, 64, scores, oh); break;
        case 128: attend_head(j, qh, pos_slots, first, len, offset, 128, scores, oh); break;
        default:
            if (D % 8 == 0 && D <= 256) attend_head(j, qh, pos_slots, first, len, offset, D, scores, oh);
            else attend_head_any(j, qh, pos_slots, first, len, offset, scores, oh);
        }
    }
    free(scores);
}

/* q, out: [tokens, H, D]. k_buf, v_buf: [pool rows, Hkv, D]. slots: [requests, slot_stride] pool rows of each
 * request's positions. token_req, token_len: [tokens]. window <= 0: no window; logit_cap <= 0: no cap.
 * Returns 0, or -1 if H is not a multiple of Hkv. */
int paged_attention(const float *q, const float *k_buf, const float *v_buf, const int64_t *slots, int64_t slot_stride,
                    const int64_t *token_req, const int64_t *token_len, int64_t tokens, int64_t H, int64_t Hkv,
                    int64_t D, float scale, float logit_cap, int64_t window, float *out, int threads) {
    if (Hkv <= 0 || H % Hkv != 0) return -1;
    int64_t max_len = 1;
    for (int64_t t = 0; t < tokens; t++) max_len = token_len[t] > max_len ? token_len[t] : max_len;
    struct attention_job job = {q, k_buf, v_buf, slots, token_req, token_len, slot_stride, tokens, H, Hkv, D,
                                max_len, window, scale, logit_cap, out};
    if (grouped(&job, threads)) parallel_for(threads, tokens * Hkv, attention_part_grouped, &job);
    else parallel_for(threads, tokens * H, attention_part, &job);
    return 0;
}
