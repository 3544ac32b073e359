/* A decoder layer's linears at batch 1 with their neighbours folded into the same call (the CPU's counterpart of
 * the GPU's fused GEMVs, models/llama.py forward_one_token): the RMSNorm before the qkv and gate_up projections,
 * the SiLU-mul after gate_up, the residual adds after o_proj and down_proj. One call instead of three to five
 * ctypes calls and torch ops; each step rounds as its separate kernel does (rmsnorm.c, gguf_matmul). */
#include "native.h"

#include <stdlib.h>

/* silu(g) * u lane by lane, as F.silu(g) * u: g / (1 + exp(-g)), then times u (exp8: within about an ulp of
 * expf). */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* y = W . x' for one row x of K floats and a GGUF block weight W of N rows, where x' = rmsnorm(x) * norm_w when
 * norm_w is given (else x). silu_mul: W is [gate; up] and y[j] = silu(g_j) * u_j for j < N / 2. accumulate: the
 * result is added into y (y += ...) instead of stored. q8: x' is quantized to 8 bits per block of 32 and multiplied
 * in integers (gguf_matmul_q8). Returns the matmul's status. */
int gguf_gemv_fused(int type, const float *x, int64_t K, const uint8_t *w, int64_t N, float *y, int threads,
                    const float *norm_w, float eps, int silu_mul, int accumulate, int q8) {
    float *scratch = (float *)malloc((size_t)(K + N) * sizeof(float));
    if (!scratch) abort();
    float *xn = scratch, *out = scratch + K;
    if (norm_w) rmsnorm(x, NULL, norm_w, 1, K, eps, xn, 1);
    const int status = (q8 ? gguf_matmul_q8 : gguf_matmul)(type, norm_w ? xn : x, 1, K, w, N, out, threads);
    if (status == 0) {
        const int64_t n = silu_mul ? N / 2 : N;
        float tail[3][8] = {{0}}; /* the last n % 8 values, padded to a vector */
        for (int64_t j = 0; j < n; j += 8) {
            const int64_t left = n - j;
            const float *g = out + j, *u = out + n + j;
            float *dst = y + j;
            if (left < 8) {
                for (int64_t i = 0; i < left; i++) {
                    tail[0][i] = g[i];
                    if (silu_mul) tail[1][i] = u[i];
                    tail[2][i] = y[j + i];
                }
                g = tail[0], u = tail[1], dst = tail[2];
            }
            __m256 v = _mm256_loadu_ps(g);
            if (silu_mul) v = silu_mul8(v, _mm256_loadu_ps(u));
            if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(dst), v);
            _mm256_storeu_ps(dst, v);
            if (left < 8)
                for (int64_t i = 0; i < left; i++) y[j + i] = tail[2][i];
        }
    }
    free(scratch);
    return status;
}

/* One decoder layer's weights and KV buffers for decoder_one_token (gguf_quant.OneTokenLayer mirrors it). */
struct one_token_layer {
    const uint8_t *qkv, *o, *gate_up, *down;         /* GGUF block weights */
    int64_t qkv_type, o_type, gate_up_type, down_type;
    int64_t qkv_rows, gate_up_rows;                   /* (H + 2 Hkv) D and 2 x the intermediate size */
    const float *input_norm, *post_norm;              /* RMSNorm weights [hidden] */
    float *k_buf, *v_buf;                             /* [pool rows, Hkv, D] */
    int64_t window;                                   /* <= 0: none */
    float eps, scale, logit_cap, unused;
};

static int q8_type(int64_t type) { return type == 2 || type == 3 || type == 6 || type == 7 || type == 8; }

/* One token through n_layers Llama decoder layers in one call, each layer as LlamaDecoderLayer.forward_one_token
 * runs it call by call (and rounded as those calls round): the input RMSNorm in the qkv GEMV, rotary and the KV
 * store (rope_store_kv), attention over the request's slots (paged_attention: the token at `position`, stored in
 * pool row out_loc, sees the first token_len positions of `slots`), o_proj added into the residual, the post-attention
 * RMSNorm in the gate_up GEMV with the SiLU-mul, down_proj added into the residual. residual [hidden] is updated in
 * place; with final_norm, out = the model's final RMSNorm of it (as rmsnorm.c). q8: the GEMVs of Q4_0 / Q4_1 / Q5_0 /
 * Q5_1 / Q8_0 weights round their input to 8 bits (gguf_matmul_q8).
 * At batch 1 the per-layer Python work (six native calls, their tensors and arguments) was a third of a step.
 * Returns 0, or the first failing kernel's status. */
int decoder_one_token(const struct one_token_layer *layers, int64_t n_layers, int64_t hidden, int64_t H, int64_t Hkv,
                      int64_t D, float *residual, const int64_t *position, const float *rope_table,
                      const int64_t *out_loc, const int64_t *slots, const int64_t *token_len, const float *final_norm,
                      float final_eps, float *out, int q8, int threads) {
    int64_t intermediate = 0;
    for (int64_t i = 0; i < n_layers; i++)
        intermediate = layers[i].gate_up_rows / 2 > intermediate ? layers[i].gate_up_rows / 2 : intermediate;
    const int64_t qkv_width = (H + 2 * Hkv) * D;
    float *scratch = (float *)malloc((size_t)(qkv_width + H * D + intermediate) * sizeof(float));
    if (!scratch) abort();
    float *qkv = scratch, *attn = qkv + qkv_width, *mlp = attn + H * D;
    const int64_t token_req = 0;
    int status = 0;
    for (int64_t i = 0; i < n_layers && status == 0; i++) {
        const struct one_token_layer *l = &layers[i];
        status = gguf_gemv_fused((int)l->qkv_type, residual, hidden, l->qkv, l->qkv_rows, qkv, threads, l->input_norm,
                                 l->eps, 0, 0, q8 && q8_type(l->qkv_type));
        if (status == 0) status = rope_store_kv(qkv, 1, H, Hkv, D, position, rope_table, out_loc, l->k_buf, l->v_buf, 1);
        if (status == 0)
            status = paged_attention(qkv, l->k_buf, l->v_buf, slots, 0, &token_req, token_len, 1, H, Hkv, D, l->scale,
                                     l->logit_cap, l->window, attn, threads);
        if (status == 0)
            status = gguf_gemv_fused((int)l->o_type, attn, H * D, l->o, hidden, residual, threads, NULL, 0.0f, 0, 1,
                                     q8 && q8_type(l->o_type));
        if (status == 0)
            status = gguf_gemv_fused((int)l->gate_up_type, residual, hidden, l->gate_up, l->gate_up_rows, mlp, threads,
                                     l->post_norm, l->eps, 1, 0, q8 && q8_type(l->gate_up_type));
        if (status == 0)
            status = gguf_gemv_fused((int)l->down_type, mlp, l->gate_up_rows / 2, l->down, hidden, residual, threads,
                                     NULL, 0.0f, 0, 1, q8 && q8_type(l->down_type));
    }
    if (status == 0 && final_norm) rmsnorm(residual, NULL, final_norm, 1, hidden, final_eps, out, 1);
    free(scratch);
    return status;
}
