/* The worker threads of the native kernels: one pool per process, whichever thread calls.
 *
 * Why not OpenMP: a decode step calls a kernel every ~50-200 us with Python work in between. GNU OpenMP keeps a
 * team per calling thread (the engine's scheduler thread and the main thread both had one), and once more
 * OpenMP threads exist than cores it throttles its idle spin, so every call paid a wake-up of the sleeping
 * worker (~100 us on a VM), 2-3x the matmul itself. These workers spin (pause, then yield the core) for up to
 * SPIN_NS after each job, and only then sleep on a condition variable, so an idle engine burns no CPU.
 *
 * A job is split into CHUNKS_PER_THREAD chunks per thread, which the caller and the workers claim one at a time, and
 * the caller waits for the chunks, not for the workers: on 2 cores shared with Python threads a worker often starts
 * late (it was yielding, or another thread had its core), and with one fixed part per thread the caller waited
 * ~8 us per call for it (a sixth of a batch-1 decode step's kernel time: ~150 calls a token); now the caller takes
 * the chunks the worker has not reached, and a late worker finds none left.
 */
#define _GNU_SOURCE
#include "native.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <immintrin.h>

#define MAX_WORKERS 255
#define SPIN_NS 2000000L  /* 2 ms: longer than the gap between two kernels of one step */
#define PAUSE_NS 20000L   /* the first 20 us with pause only, then sched_yield so others may run */
#define CHUNKS_PER_THREAD 2 /* enough to even out a late start, few enough that claiming costs little */
#define CHUNK_BITS 16       /* ticket: generation << 32 | chunks << 16 | the next chunk to claim */

static struct {
    pthread_mutex_t lock;   /* held by the caller during a job: one job at a time */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    pthread_t threads[MAX_WORKERS];
    int workers;
    atomic_long generation; /* bumped per job: wakes the workers */
    atomic_int sleepers;
    atomic_int parts;       /* the threads the current job asked for: workers index + 1 >= parts sit it out */
    /* The job's chunks: a worker that claims one (a compare-and-swap on the whole ticket, so a stale claim for a
     * finished job fails) holds the job open until it counts the chunk done, so fn, ctx and total are that job's. */
    _Alignas(64) atomic_ullong ticket;
    _Alignas(64) atomic_long done; /* chunks of the current job finished */
    parallel_fn fn;
    void *ctx;
    int64_t total;
    long born_at[MAX_WORKERS]; /* the generation before a worker's first job (it may start after the bump) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claims and runs chunks of the current job until none is left. */
static void run_chunks(void) {
    const unsigned long long mask = (1ULL << CHUNK_BITS) - 1;
    unsigned long long t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    for (;;) {
        const int64_t chunk = (int64_t)(t & mask), chunks = (int64_t)((t >> CHUNK_BITS) & mask);
        if (chunk >= chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* t now holds the current ticket */
        const int64_t begin = pool.total * chunk / chunks, end = pool.total * (chunk + 1) / chunks;
        if (begin < end) pool.fn(pool.ctx, begin, end);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    long seen = pool.born_at[index];
    for (;;) {
        const long start = now_ns();
        long spins = 0;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            if ((++spins & 63) == 0) {
                const long waited = now_ns() - start;
                if (waited > SPIN_NS) {
                    pthread_mutex_lock(&pool.sleep_lock);
                    atomic_fetch_add(&pool.sleepers, 1);
                    while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.sleep_lock);
                    atomic_fetch_sub(&pool.sleepers, 1);
                    pthread_mutex_unlock(&pool.sleep_lock);
                    break;
                }
                if (waited > PAUSE_NS) sched_yield();
            }
            _mm_pause();
        }
        seen = atomic_load(&pool.generation);
        if (index + 1 < atomic_load_explicit(&pool.parts, memory_order_relaxed)) run_chunks();
    }
    return NULL;
}

/* A forked child has none of the parent's workers (and maybe a lock held by a thread that is gone): it starts
 * an empty pool of its own. */
static void reset_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
}

static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;
static void install_fork_handler(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

void parallel_for(int threads, int64_t total, parallel_fn fn, void *ctx) {
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1 || total <= 1) {
        if (total > 0) fn(ctx, 0, total);
        return;
    }
    pthread_once(&fork_handler_once, install_fork_handler);
    pthread_mutex_lock(&pool.lock);
    while (pool.workers < threads - 1) { /* grown on demand, never shrunk */
        pool.born_at[pool.workers] = atomic_load(&pool.generation);
        if (pthread_create(&pool.threads[pool.workers], NULL, worker_main, (void *)(intptr_t)pool.workers) != 0) break;
        pool.workers++;
    }
    const int parts = pool.workers + 1 < threads ? pool.workers + 1 : threads;
    const int64_t chunks = total < (int64_t)parts * CHUNKS_PER_THREAD ? total : (int64_t)parts * CHUNKS_PER_THREAD;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.total = total;
    atomic_store_explicit(&pool.parts, parts, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    const unsigned long long generation = (unsigned long long)atomic_load(&pool.generation) + 1;
    atomic_store_explicit(&pool.ticket, generation << 32 | (unsigned long long)chunks << CHUNK_BITS,
                          memory_order_release);
    pthread_mutex_lock(&pool.sleep_lock); /* a worker between its check and its wait cannot miss the bump */
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    if (atomic_load(&pool.sleepers) > 0) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep_lock);
    run_chunks();
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < chunks) _mm_pause();
    pthread_mutex_unlock(&pool.lock);
}
