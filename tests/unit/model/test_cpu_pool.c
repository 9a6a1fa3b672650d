/* test_cpu_pool.c: the CPU backend's thread pool under many tiny runs with 1 to 4 threads, with
 * spinning off (every wait sleeps), short and long: every item runs exactly once per run, on a
 * valid thread index, and idle gaps (workers asleep) lose no wake-up. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdatomic.h>
#include <time.h>

#include "model/cpu_pool.h"

#define MAX_ITEMS 67

typedef struct counts {
    atomic_int hit[MAX_ITEMS];
    atomic_int bad_thread;
    int32_t n_threads;
} counts;

static void count_item(void *arg, int64_t item, int32_t thread)
{
    counts *c = arg;
    atomic_fetch_add_explicit(&c->hit[item], 1, memory_order_relaxed);
    if (thread < 0 || thread >= c->n_threads)
        atomic_fetch_add(&c->bad_thread, 1);
}

static void run_many(int32_t threads, int64_t spin_ns, int runs)
{
    kvf_cpu_pool *p = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_cpu_pool_create(threads, spin_ns, &p, &err), KVF_OK);
    counts c = {.n_threads = threads};
    for (int r = 0; r < runs; r++) {
        int64_t n = (r * 7919) % (MAX_ITEMS + 1); /* 0..67 items, small ones often */
        for (int i = 0; i < MAX_ITEMS; i++)
            atomic_store(&c.hit[i], 0);
        kvf_cpu_pool_run(p, count_item, &c, n);
        for (int64_t i = 0; i < MAX_ITEMS; i++)
            if (atomic_load(&c.hit[i]) != (i < n ? 1 : 0))
                fail_msg("threads %d spin %ld run %d: item %ld of %ld ran %d times", threads, (long)spin_ns, r,
                         (long)i, (long)n, atomic_load(&c.hit[i]));
        if (r % 250 == 249) { /* an idle gap longer than the spin: the workers go to sleep */
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
    }
    assert_int_equal(atomic_load(&c.bad_thread), 0);
    kvf_cpu_pool_destroy(p);
}

static void test_many_tiny_runs(void **state)
{
    (void)state;
    for (int32_t t = 1; t <= 4; t++) {
        run_many(t, 0, 1500);      /* always sleeps */
        run_many(t, 100000, 3000); /* the backend's setting */
        run_many(t, 5000000, 200); /* spins through every gap */
    }
}

static void test_create_refuses(void **state)
{
    (void)state;
    kvf_cpu_pool *p = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_cpu_pool_create(0, 0, &p, &err), KVF_ERR_INVALID);
    assert_null(p);
    kvf_cpu_pool_destroy(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_tiny_runs),
        cmocka_unit_test(test_create_refuses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
