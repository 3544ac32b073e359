/* RMSNorm over float32 rows, optionally after the residual add, as HF's LlamaRMSNorm rounds it:
 * r = 1 / sqrt(mean(x^2) + eps); out = w * (x * r). With a residual: residual += x first (in place) and the
 * sum is normalised. One row at a time is cheap (576 floats): rows are split over the pool only in bulk. */
#include "native.h"

#include <immintrin.h>
#include <math.h>

struct rmsnorm_job {
    const float *x, *w;
    float *residual, *out;
    int64_t dim;
    float eps;
};

static void rmsnorm_part(void *arg, int64_t r0, int64_t r1) {
    const struct rmsnorm_job *j = (const struct rmsnorm_job *)arg;
    const int64_t dim = j->dim;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = j->x + r * dim;
        float *src = (float *)x;
        if (j->residual) {
            src = j->residual + r * dim;
            for (int64_t i = 0; i < dim; i++) src[i] = src[i] + x[i];
        }
        double total = 0.0; /* fp64 sum: at least as exact as torch's fp32 pairwise mean */
        for (int64_t i = 0; i < dim; i++) total += (double)src[i] * src[i];
        const float mean = (float)(total / dim);
        const float r_inv = 1.0f / sqrtf(mean + j->eps);
        float *out = j->out + r * dim;
        for (int64_t i = 0; i < dim; i++) out[i] = j->w[i] * (src[i] * r_inv);
    }
}

void rmsnorm(const float *x, float *residual, const float *w, int64_t rows, int64_t dim, float eps, float *out,
             int threads) {
    struct rmsnorm_job job = {x, w, residual, out, dim, eps};
    parallel_for(rows >= 64 ? threads : 1, rows, rmsnorm_part, &job);
}
