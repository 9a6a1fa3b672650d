/* host_rt_ext.c: another engine's operations on the emulated streams (kvf_emu_rt_ext_enqueue,
 * what kvfleet_emu's NCCL sends and recvs go through), with a fake operation a helper thread
 * finishes (label unit): started at once; later copies, cudaFreeAsync and synchronization wait for
 * it with the runtime's lock released (the helper calls the runtime before finishing); an event
 * recorded after it is not ready until it ends, one recorded before it is; a wait that never ends
 * is a misuse with an error, not a hang; each operation released once. Bounded by alarm(). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "cuda_rt_emu_c.h"

typedef struct fake_op {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int starts, releases;
    bool done;
    /* what the helper does before it finishes the op: copy pattern into dev (a recv landing) */
    void *dev;
    cudaStream_t other; /* the helper's own stream */
    uint8_t pattern[256];
} fake_op;

static void fake_init(fake_op *o, void *dev)
{
    memset(o, 0, sizeof *o);
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
    o->dev = dev;
    for (int i = 0; i < 256; i++)
        o->pattern[i] = (uint8_t)(i * 13 + 5);
}

static void fake_finish(fake_op *o)
{
    pthread_mutex_lock(&o->mu);
    o->done = true;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

static void op_start(void *op)
{
    fake_op *o = op;
    pthread_mutex_lock(&o->mu);
    o->starts++;
    pthread_mutex_unlock(&o->mu);
}

static bool op_done(void *op)
{
    fake_op *o = op;
    pthread_mutex_lock(&o->mu);
    bool d = o->done;
    pthread_mutex_unlock(&o->mu);
    return d;
}

static bool op_wait(void *op, int64_t timeout_ns)
{
    fake_op *o = op;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t t = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + timeout_ns;
    ts.tv_sec = t / 1000000000LL;
    ts.tv_nsec = t % 1000000000LL;
    pthread_mutex_lock(&o->mu);
    while (!o->done && pthread_cond_timedwait(&o->cv, &o->mu, &ts) == 0)
        ;
    bool d = o->done;
    pthread_mutex_unlock(&o->mu);
    return d;
}

static void op_release(void *op)
{
    fake_op *o = op;
    pthread_mutex_lock(&o->mu);
    o->releases++;
    pthread_mutex_unlock(&o->mu);
}

static const kvf_emu_rt_ext_ops fake_ops = {
    .start = op_start, .done = op_done, .wait = op_wait, .release = op_release,
};

static int get_int(fake_op *o, const int *field)
{
    pthread_mutex_lock(&o->mu);
    int v = *field;
    pthread_mutex_unlock(&o->mu);
    return v;
}

/* The helper: lands the pattern through the runtime (which needs its lock: a waiter holding it
 * would deadlock here), then finishes the op. */
static void *lander(void *arg)
{
    fake_op *o = arg;
    usleep(50 * 1000); /* let the main thread reach its wait first (not needed for correctness) */
    cudaMemcpyAsync(o->dev, o->pattern, sizeof o->pattern, cudaMemcpyHostToDevice, o->other);
    fake_finish(o);
    return NULL;
}

static int64_t misuses(void)
{
    kvf_emu_rt_stats st;
    kvf_emu_rt_stats_get(&st);
    return st.misuses;
}

static void test_unregistered_refused(void **state)
{
    (void)state;
    alarm(60);
    fake_op o;
    fake_init(&o, NULL);
    int64_t m = misuses();
    assert_int_equal(kvf_emu_rt_ext_enqueue(NULL, &o), 0);
    assert_int_equal(misuses(), m + 1);
    assert_int_equal(o.starts, 0);
}

static void test_later_work_waits(void **state)
{
    (void)state;
    alarm(60);
    setenv("KVF_EMU_EXT_WAIT_S", "20", 1);
    kvf_emu_rt_set_ext_ops(&fake_ops);
    cudaStream_t s, other;
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
    void *dev = NULL;
    assert_int_equal(cudaMalloc(&dev, 256), cudaSuccess);
    assert_int_equal(cudaMemsetAsync(dev, 0, 256, s), cudaSuccess);
    int64_t m0 = misuses();
    cudaEvent_t before, after;
    assert_int_equal(cudaEventCreateWithFlags(&before, cudaEventDisableTiming), cudaSuccess);
    assert_int_equal(cudaEventCreateWithFlags(&after, cudaEventDisableTiming), cudaSuccess);
    assert_int_equal(cudaEventRecord(before, s), cudaSuccess);

    fake_op o;
    fake_init(&o, dev);
    o.other = other;
    assert_int_equal(kvf_emu_rt_ext_enqueue(s, &o), 1);
    assert_int_equal(get_int(&o, &o.starts), 1); /* started at once */
    assert_int_equal(cudaEventRecord(after, s), cudaSuccess);
    /* the event before it does not wait for it (its one first NotReady aside) */
    cudaError_t q = cudaEventQuery(before);
    if (q == cudaErrorNotReady)
        q = cudaEventQuery(before);
    assert_int_equal(q, cudaSuccess);
    /* the event after it: not ready however often asked while it is going */
    for (int i = 0; i < 5; i++)
        assert_int_equal(cudaEventQuery(after), cudaErrorNotReady);

    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, lander, &o), 0);
    /* a copy after it on the stream reads what it landed: it waited (lock released: the lander
     * used the runtime meanwhile) */
    uint8_t host[256];
    memset(host, 0, sizeof host);
    assert_int_equal(cudaMemcpyAsync(host, dev, sizeof host, cudaMemcpyDeviceToHost, s), cudaSuccess);
    assert_memory_equal(host, o.pattern, sizeof host);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
    assert_int_equal(get_int(&o, &o.releases), 1); /* seen done: let go, once */
    q = cudaEventQuery(after);
    if (q == cudaErrorNotReady)
        q = cudaEventQuery(after);
    assert_int_equal(q, cudaSuccess);

    /* cudaFreeAsync waits too (a recv may still be writing the staging it frees) */
    fake_op o2;
    fake_init(&o2, dev);
    o2.other = other;
    memset(o2.pattern, 0x5a, sizeof o2.pattern);
    void *staging = NULL;
    assert_int_equal(cudaMallocAsync(&staging, 256, s), cudaSuccess);
    assert_int_equal(kvf_emu_rt_ext_enqueue(s, &o2), 1);
    assert_int_equal(pthread_create(&th, NULL, lander, &o2), 0);
    assert_int_equal(cudaFreeAsync(staging, s), cudaSuccess);
    assert_true(op_done(&o2));
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
    assert_int_equal(get_int(&o2, &o2.releases), 1);
    assert_int_equal(get_int(&o, &o.releases), 1);

    assert_int_equal(cudaEventDestroy(before), cudaSuccess);
    assert_int_equal(cudaEventDestroy(after), cudaSuccess);
    assert_int_equal(cudaFree(dev), cudaSuccess);
    assert_int_equal(cudaStreamDestroy(other), cudaSuccess);
    assert_int_equal(cudaStreamDestroy(s), cudaSuccess);
    assert_int_equal(misuses(), m0);
}

/* An operation that never ends: the stream's later work gives up after KVF_EMU_EXT_WAIT_S with
 * an error and a misuse (kvfleet_emu aborts there), instead of hanging; once it ends, all is well. */
static void test_never_ending_is_a_misuse(void **state)
{
    (void)state;
    alarm(60);
    setenv("KVF_EMU_EXT_WAIT_S", "1", 1);
    kvf_emu_rt_set_ext_ops(&fake_ops);
    cudaStream_t s;
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    fake_op o;
    fake_init(&o, NULL);
    assert_int_equal(kvf_emu_rt_ext_enqueue(s, &o), 1);
    int64_t m = misuses();
    assert_int_equal(cudaStreamSynchronize(s), cudaErrorLaunchTimeout);
    assert_int_equal(misuses(), m + 1);
    assert_int_equal(get_int(&o, &o.releases), 0);
    (void)cudaGetLastError();
    fake_finish(&o);
    assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
    assert_int_equal(get_int(&o, &o.releases), 1);
    assert_int_equal(cudaStreamDestroy(s), cudaSuccess);
    setenv("KVF_EMU_EXT_WAIT_S", "20", 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unregistered_refused),
        cmocka_unit_test(test_later_work_waits),
        cmocka_unit_test(test_never_ending_is_a_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
