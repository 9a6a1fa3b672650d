/* cpu_pool.c: the CPU backend's thread pool. A run publishes (fn, arg, n_items) and bumps the
 * generation counter; workers spin on the counter for spin_ns (a pause per poll), then sleep on a
 * condition variable, so a forward pass's ~90 runs per token cost no context switch while an idle
 * pool costs no CPU. The caller waits for the workers the same way. */
#include "model/cpu_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

typedef struct pool_worker {
    pthread_t th;
    kvf_cpu_pool *p;
    int32_t idx; /* 1..n_threads-1; the calling thread is 0 */
} pool_worker;

struct kvf_cpu_pool {
    int32_t n_workers;
    int64_t spin_ns;
    pool_worker *workers; /* [n_workers] */
    /* the job: written by the caller only while no worker is in a run (all have counted into
     * n_done), read by workers only after they load the generation that published it */
    kvf_cpu_job_fn fn;
    void *arg;
    int64_t n_items;
    atomic_llong next;        /* next item to hand out */
    atomic_ullong generation; /* bumped once per run (and at stop) */
    atomic_int n_done;        /* workers finished with the current run */
    atomic_bool stop;
    /* sleeping: a worker counts itself in n_sleeping before it re-checks the generation under mu,
     * the caller reads n_sleeping after bumping it (both seq_cst), so one of them sees the other */
    atomic_int n_sleeping;
    atomic_bool caller_sleeping;
    pthread_mutex_t mu;
    pthread_cond_t cv_start, cv_done;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Spins until done(p, v) or spin_ns have passed (the clock is read every 64 polls); returns
 * whether done. After the first 256 polls (a few microseconds) each poll also yields: on a
 * machine with more runnable threads than CPUs the thread we wait for may be queued behind us on
 * our own CPU, and a pure spin would hold it off for a whole time slice per op. */
static bool spin_until(const kvf_cpu_pool *p, bool (*done)(const kvf_cpu_pool *, uint64_t), uint64_t v)
{
    if (p->spin_ns <= 0)
        return done(p, v);
    int64_t t0 = 0;
    for (uint32_t i = 0;; i++) {
        if (done(p, v))
            return true;
        if ((i & 63) == 63) {
            int64_t t = now_ns();
            if (!t0)
                t0 = t;
            else if (t - t0 > p->spin_ns)
                return false;
        }
        if (i >= 256)
            sched_yield();
        else
            cpu_relax();
    }
}

static bool gen_moved(const kvf_cpu_pool *p, uint64_t seen)
{
    return atomic_load_explicit(&p->generation, memory_order_acquire) != seen;
}

static bool all_done(const kvf_cpu_pool *p, uint64_t unused)
{
    (void)unused;
    return atomic_load_explicit(&p->n_done, memory_order_acquire) == p->n_workers;
}

static void pool_drain(kvf_cpu_pool *p, int32_t thread)
{
    kvf_cpu_job_fn fn = p->fn;
    void *arg = p->arg;
    int64_t n = p->n_items;
    for (;;) {
        long long i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (i >= n)
            break;
        fn(arg, i, thread);
    }
}

static void *pool_worker_main(void *arg)
{
    pool_worker *w = arg;
    kvf_cpu_pool *p = w->p;
    uint64_t seen = 0;
    for (;;) {
        if (!spin_until(p, gen_moved, seen)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->n_sleeping, 1);
            while (atomic_load(&p->generation) == seen)
                pthread_cond_wait(&p->cv_start, &p->mu);
            atomic_fetch_sub(&p->n_sleeping, 1);
            pthread_mutex_unlock(&p->mu);
        }
        seen = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (atomic_load(&p->stop))
            break;
        pool_drain(p, w->idx);
        /* the last one wakes a caller that went to sleep; nothing of the job is read after this */
        if (atomic_fetch_add(&p->n_done, 1) + 1 == p->n_workers && atomic_load(&p->caller_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

/* Publishes a new generation and wakes the workers that sleep. */
static void pool_kick(kvf_cpu_pool *p)
{
    atomic_fetch_add(&p->generation, 1);
    if (atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_start);
        pthread_mutex_unlock(&p->mu);
    }
}

void kvf_cpu_pool_run(kvf_cpu_pool *p, kvf_cpu_job_fn fn, void *arg, int64_t n_items)
{
    if (p->n_workers == 0 || n_items < 2) {
        for (int64_t i = 0; i < n_items; i++)
            fn(arg, i, 0);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    p->n_items = n_items;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->n_done, 0, memory_order_relaxed);
    pool_kick(p); /* seq_cst: orders the job's fields before the new generation */
    pool_drain(p, 0);
    if (!spin_until(p, all_done, 0)) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_sleeping, true);
        while (atomic_load(&p->n_done) != p->n_workers)
            pthread_cond_wait(&p->cv_done, &p->mu);
        atomic_store(&p->caller_sleeping, false);
        pthread_mutex_unlock(&p->mu);
    }
}

void kvf_cpu_pool_destroy(kvf_cpu_pool *p)
{
    if (!p)
        return;
    atomic_store(&p->stop, true);
    pool_kick(p);
    for (int32_t i = 0; i < p->n_workers; i++)
        pthread_join(p->workers[i].th, NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_start);
    pthread_cond_destroy(&p->cv_done);
    free(p->workers);
    free(p);
}

kvf_status kvf_cpu_pool_create(int32_t n_threads, int64_t spin_ns, kvf_cpu_pool **out, kvf_err *err)
{
    if (n_threads < 1 || n_threads > 1024)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: cpu pool: %d threads is not allowed (1 to 1024)", n_threads);
    kvf_cpu_pool *p = calloc(1, sizeof *p);
    if (!p)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: cpu pool: out of memory");
    p->spin_ns = spin_ns;
    atomic_init(&p->next, 0);
    atomic_init(&p->generation, 0);
    atomic_init(&p->n_done, 0);
    atomic_init(&p->stop, false);
    atomic_init(&p->n_sleeping, 0);
    atomic_init(&p->caller_sleeping, false);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_start, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers) {
            kvf_cpu_pool_destroy(p);
            return kvf_err_set(err, KVF_ERR_NOMEM, "model: cpu pool: out of memory");
        }
        for (int32_t i = 0; i < n_threads - 1; i++) {
            p->workers[i].p = p;
            p->workers[i].idx = i + 1;
            if (pthread_create(&p->workers[i].th, NULL, pool_worker_main, &p->workers[i]) != 0) {
                kvf_cpu_pool_destroy(p);
                return kvf_err_set(err, KVF_ERR_INTERNAL, "model: cpu pool: cannot start thread %d of %d", i + 1,
                                   n_threads);
            }
            p->n_workers++;
        }
    }
    *out = p;
    return KVF_OK;
}
