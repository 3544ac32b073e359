/* Rotary embedding of q and k in place (rotate-half layout, as HF's apply_rotary_pos_emb), then the new tokens'
 * k and v written into their pool slots: what the torch path does with a dozen ops per layer, in one call.
 *
 * qkv: [T, (H + 2 Hkv) D] float32, q heads then k heads then v heads. table: [positions, D], cos in the first
 * D / 2 columns and sin in the last (RotaryEmbedding.table). Each output is rounded as HF's
 * x * cos + rotate_half(x) * sin: two products, then their sum (built with -ffp-contract=off).
 */
#include "native.h"

#include <string.h>

struct rope_job {
    float *qkv;
    const int64_t *positions, *out_loc;
    const float *table;
    float *k_buf, *v_buf;
    int64_t H, Hkv, D;
};

static void rotate(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + (-b) * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

static void rope_part(void *arg, int64_t t0, int64_t t1) {
    const struct rope_job *j = (const struct rope_job *)arg;
    const int64_t D = j->D, half = D / 2, width = (j->H + 2 * j->Hkv) * D, kv = j->Hkv * D;
    for (int64_t t = t0; t < t1; t++) {
        float *row = j->qkv + t * width;
        const float *cos = j->table + j->positions[t] * D, *sin = cos + half;
        for (int64_t h = 0; h < j->H + j->Hkv; h++) rotate(row + h * D, cos, sin, half);
        if (j->k_buf) {
            memcpy(j->k_buf + j->out_loc[t] * kv, row + j->H * D, (size_t)kv * sizeof(float));
            memcpy(j->v_buf + j->out_loc[t] * kv, row + j->H * D + kv, (size_t)kv * sizeof(float));
        }
    }
}

/* k_buf == NULL: rotate only. Returns 0, or -1 for an odd head size. */
int rope_store_kv(float *qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const int64_t *positions,
                  const float *table, const int64_t *out_loc, float *k_buf, float *v_buf, int threads) {
    if (D % 2 != 0) return -1;
    struct rope_job job = {qkv, positions, out_loc, table, k_buf, v_buf, H, Hkv, D};
    parallel_for(T >= 64 ? threads : 1, T, rope_part, &job);
    return 0;
}
