/* Shared by the native kernels (compiled together into one library, see __init__.py). */
#pragma once
#include <stdint.h>

/* fn(ctx, begin, end) over [0, total) split into `threads` contiguous parts; the caller runs the first. */
typedef void (*parallel_fn)(void *ctx, int64_t begin, int64_t end);
void parallel_for(int threads, int64_t total, parallel_fn fn, void *ctx);
