/* cpu_pool.h: the CPU backend's persistent thread pool: run(fn, n_items) hands items out through
 * an atomic counter, the calling thread works too (as thread 0). Workers spin briefly between
 * runs and then sleep; no allocation per run. Internal to model/ and its tests. */
#ifndef KVF_MODEL_CPU_POOL_H
#define KVF_MODEL_CPU_POOL_H

#include <stdint.h>

#include "common/status.h"

typedef void (*kvf_cpu_job_fn)(void *arg, int64_t item, int32_t thread /* 0..n_threads-1 */);

typedef struct kvf_cpu_pool kvf_cpu_pool;

/* n_threads >= 1 (the caller counts as one); spin_ns: how long a worker waiting for work, and
 * the caller waiting for the workers, spin before they sleep (0: sleep at once). The caller owns
 * the pool: kvf_cpu_pool_destroy. */
kvf_status kvf_cpu_pool_create(int32_t n_threads, int64_t spin_ns, kvf_cpu_pool **out, kvf_err *err);
void kvf_cpu_pool_destroy(kvf_cpu_pool *p);

/* Calls fn(arg, i, thread) once for every i in [0, n_items), returns when all are done. One
 * caller at a time (the backend is driven by one thread). */
void kvf_cpu_pool_run(kvf_cpu_pool *p, kvf_cpu_job_fn fn, void *arg, int64_t n_items);

#endif
