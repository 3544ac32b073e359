/* A decoder layer's linears at batch 1 with their neighbours folded into the same call (the CPU's counterpart of
 * the GPU's fused GEMVs, models/llama.py forward_one_token): the RMSNorm before the qkv and gate_up projections,
 * the SiLU-mul after gate_up, the residual adds after o_proj and down_proj. One call instead of three to five
 * ctypes calls and torch ops; each step rounds as its separate kernel does (rmsnorm.c, gguf_matmul). */
#include "native.h"

#include <math.h>
#include <stdlib.h>

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
        for (int64_t j = 0; j < n; j++) {
            float v = out[j];
            if (silu_mul) v = v / (1.0f + expf(-v)) * out[n + j]; /* as F.silu(g) * u */
            y[j] = accumulate ? y[j] + v : v;
        }
    }
    free(scratch);
    return status;
}
