/* host_rt_emu.c: the emulated CUDA runtime's own contract where kvfleet_emu leans on it (label
 * unit): CUDA IPC between two real processes (fork; the child maps the parent's allocation
 * through the handle, both see each other's writes), what CUDA refuses (a handle of this very
 * process, a closed or freed one, pageable memory in a cudaMemcpyDefault copy), a handle taken
 * inside an allocation naming its start (and xfer_gpu.cu's ipc_export refusing such a pool),
 * events, pointer attributes, per-thread last errors and captures, two threads calling at once,
 * and a misuse that aborts a program that asked for it. Each child is bounded by alarm(). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "cuda/ops.h"
#include "cuda/xfer_gpu.h"
#include "cuda_rt_emu_c.h"

#define BYTES (3 * 4096 + 100) /* not a whole number of pages: the base sits inside the first */

static void fill(uint8_t *h, size_t n, uint8_t seed)
{
    for (size_t i = 0; i < n; i++)
        h[i] = (uint8_t)(seed + i * 7);
}

static int64_t count_diff(const uint8_t *h, size_t n, uint8_t seed)
{
    int64_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += h[i] != (uint8_t)(seed + i * 7);
    return bad;
}

/* fork, run fn in the child (its return value is the exit status), wait; the child's status */
static int in_child(int (*fn)(void *), void *arg)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(30);
        _exit(fn(arg));
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return status;
}

/* ---- IPC across processes */

typedef struct ipc_arg {
    cudaIpcMemHandle_t h;
} ipc_arg;

/* The child: map the parent's allocation, check its bytes, open it again (same pointer), write
 * its own pattern from pinned memory (cudaMemcpyDefault, as xfer_gpu.cu does), close twice. */
static int child_map_and_write(void *p)
{
    ipc_arg *a = p;
    kvf_emu_rt_stats st0, st;
    kvf_emu_rt_stats_get(&st0); /* (a copy of the parent's counters) */
    void *d = NULL, *d2 = NULL;
    if (cudaIpcOpenMemHandle(&d, a->h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess)
        return 10;
    if (cudaIpcOpenMemHandle(&d2, a->h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess || d2 != d)
        return 11;
    struct cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, d) != cudaSuccess || at.type != cudaMemoryTypeDevice)
        return 12;
    uint8_t *h = NULL;
    if (cudaHostAlloc((void **)&h, BYTES, cudaHostAllocPortable) != cudaSuccess)
        return 13;
    if (cudaMemcpy(h, d, BYTES, cudaMemcpyDeviceToHost) != cudaSuccess || count_diff(h, BYTES, 1))
        return 14;
    fill(h, BYTES, 2);
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
        cudaMemcpyAsync(d, h, BYTES, cudaMemcpyDefault, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess)
        return 15;
    /* a byte past the exporter's allocation is not device memory here either */
    if (cudaMemcpyAsync((uint8_t *)d + 1, h, BYTES, cudaMemcpyDefault, s) != cudaErrorInvalidValue)
        return 16;
    if (cudaIpcCloseMemHandle(d) != cudaSuccess || cudaIpcCloseMemHandle(d) != cudaSuccess ||
        cudaIpcCloseMemHandle(d) != cudaErrorInvalidValue)
        return 17;
    kvf_emu_rt_stats_get(&st);
    if (st.ipc_opened - st0.ipc_opened != 1 || st.ipc_live != 0 || st.bad_ranges - st0.bad_ranges != 1)
        return 18;
    return 0;
}

static int child_open_expect_fail(void *p)
{
    ipc_arg *a = p;
    void *d = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&d, a->h, cudaIpcMemLazyEnablePeerAccess);
    return e == cudaSuccess ? 20 : e == cudaErrorMapBufferObjectFailed || e == cudaErrorInvalidResourceHandle ? 0 : 21;
}

static void test_ipc_two_processes(void **state)
{
    uint8_t *d = NULL, h[BYTES];
    assert_int_equal(cudaMalloc((void **)&d, BYTES), cudaSuccess);
    fill(h, BYTES, 1);
    assert_int_equal(cudaMemcpy(d, h, BYTES, cudaMemcpyHostToDevice), cudaSuccess);
    ipc_arg a;
    assert_int_equal(cudaIpcGetMemHandle(&a.h, d), cudaSuccess);
    /* the export kept the bytes (the pages moved onto a memfd at the same addresses) */
    assert_int_equal(cudaMemcpy(h, d, BYTES, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_int_equal(count_diff(h, BYTES, 1), 0);
    int st = in_child(child_map_and_write, &a);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    /* the child's writes landed in our allocation */
    assert_int_equal(cudaMemcpy(h, d, BYTES, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_int_equal(count_diff(h, BYTES, 2), 0);
    /* freed: the handle no longer opens */
    assert_int_equal(cudaFree(d), cudaSuccess);
    st = in_child(child_open_expect_fail, &a);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

/* ---- what CUDA refuses within one process */

static void test_ipc_own_handle_refused(void **state)
{
    void *d = NULL, *p = NULL;
    assert_int_equal(cudaMalloc(&d, BYTES), cudaSuccess);
    cudaIpcMemHandle_t h;
    assert_int_equal(cudaIpcGetMemHandle(&h, d), cudaSuccess);
    assert_int_equal(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), cudaErrorDeviceUninitialized);
    assert_null(p);
    (void)cudaGetLastError();
    /* the transport's table says so as a status */
    const kvf_xfer_gpu *g = kvf_cuda_xfer_gpu();
    uint8_t hb[KVF_XFER_IPC_HANDLE_BYTES];
    kvf_err err = {0};
    assert_int_equal(g->ipc_export(g->ctx, d, hb, &err), KVF_OK);
    assert_int_not_equal(g->ipc_open(g->ctx, hb, &p, &err), KVF_OK);
    print_message("own handle: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "invalid device context"));
    assert_int_equal(cudaFree(d), cudaSuccess);
}

static void test_ipc_handle_names_the_allocation(void **state)
{
    uint8_t *d = NULL;
    assert_int_equal(cudaMalloc((void **)&d, BYTES), cudaSuccess);
    cudaIpcMemHandle_t h0, h1;
    assert_int_equal(cudaIpcGetMemHandle(&h0, d), cudaSuccess);
    assert_int_equal(cudaIpcGetMemHandle(&h1, d + 512), cudaSuccess);
    assert_memory_equal(&h0, &h1, sizeof h0);
    /* xfer_gpu.cu finds the allocation's start through the driver's cuMemGetAddressRange and
     * refuses a pool that does not begin there */
    const kvf_xfer_gpu *g = kvf_cuda_xfer_gpu();
    uint8_t hb[KVF_XFER_IPC_HANDLE_BYTES];
    kvf_err err = {0};
    assert_int_equal(g->ipc_export(g->ctx, d + 512, hb, &err), KVF_ERR_INVALID);
    print_message("interior pool: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "starts 512 bytes into its allocation"));
    /* not device memory at all */
    uint8_t host[64];
    assert_int_equal(g->ipc_export(g->ctx, host, hb, &err), KVF_ERR_INVALID);
    assert_int_not_equal(cudaIpcGetMemHandle(&h0, host), cudaSuccess);
    (void)cudaGetLastError();
    assert_int_equal(cudaFree(d), cudaSuccess);
}

static void test_memcpy_default_and_attributes(void **state)
{
    kvf_emu_rt_stats a, b;
    kvf_emu_rt_stats_get(&a);
    void *d = NULL, *pin = NULL;
    uint8_t pageable[256];
    assert_int_equal(cudaMalloc(&d, 256), cudaSuccess);
    assert_int_equal(cudaHostAlloc(&pin, 256, cudaHostAllocPortable), cudaSuccess);
    struct cudaPointerAttributes at;
    assert_int_equal(cudaPointerGetAttributes(&at, d), cudaSuccess);
    assert_int_equal(at.type, cudaMemoryTypeDevice);
    assert_int_equal(cudaPointerGetAttributes(&at, pin), cudaSuccess);
    assert_int_equal(at.type, cudaMemoryTypeHost);
    assert_int_equal(cudaPointerGetAttributes(&at, pageable), cudaSuccess);
    assert_int_equal(at.type, cudaMemoryTypeUnregistered);
    cudaStream_t s;
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    memset(pin, 0x5a, 256);
    assert_int_equal(cudaMemcpyAsync(d, pin, 256, cudaMemcpyDefault, s), cudaSuccess);
    memset(pin, 0, 256);
    assert_int_equal(cudaMemcpyAsync(pin, d, 256, cudaMemcpyDefault, s), cudaSuccess);
    assert_int_equal(((uint8_t *)pin)[255], 0x5a);
    /* pageable memory is not what the GPU table copies: counted as a misuse */
    assert_int_equal(cudaMemcpyAsync(d, pageable, 256, cudaMemcpyDefault, s), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    kvf_emu_rt_stats_get(&b);
    assert_int_equal(b.bad_ranges - a.bad_ranges, 1);
    assert_int_equal(b.misuses - a.misuses, 1);
    assert_int_equal(cudaStreamDestroy(s), cudaSuccess);
    assert_int_equal(cudaFreeHost(pin), cudaSuccess);
    assert_int_equal(cudaFree(d), cudaSuccess);
}

/* A recorded event answers "not ready" once (a caller's polling path runs), then done; the
 * answer is not an error. Stream-ordered allocations come and go. */
static void test_events_and_async_alloc(void **state)
{
    cudaStream_t s;
    cudaEvent_t ev;
    void *d = NULL;
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaMallocAsync(&d, 1000, s), cudaSuccess);
    assert_int_equal(cudaMemsetAsync(d, 0, 1000, s), cudaSuccess);
    assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
    assert_int_equal(cudaEventRecord(ev, s), cudaSuccess);
    assert_int_equal(cudaEventQuery(ev), cudaErrorNotReady);
    assert_int_equal(cudaGetLastError(), cudaSuccess);
    assert_int_equal(cudaEventQuery(ev), cudaSuccess);
    assert_int_equal(cudaFreeAsync(d, s), cudaSuccess);
    assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
    assert_int_equal(cudaEventDestroy(ev), cudaSuccess);
    assert_int_equal(cudaEventQuery(ev), cudaErrorInvalidResourceHandle);
    (void)cudaGetLastError();
    assert_int_equal(cudaStreamDestroy(s), cudaSuccess);
}

/* ---- threads */

typedef struct thr_arg {
    int iters;
    int bad;
    cudaError_t seen_err;
} thr_arg;

/* Allocations, copies, frees and a kernel (rmsnorm: shuffles, barriers and __shared__ statics,
 * on fibers) in a loop on the thread's own stream: two of these at once must neither corrupt
 * the runtime nor mix up their kernels (without the runtime's lock they share one fiber
 * scheduler and the kernel's statics). */
#define ROWS 4
#define D 256
static void *churn(void *p)
{
    thr_arg *a = p;
    float x[ROWS * D], w[D], want[ROWS * D], got[ROWS * D];
    uint8_t h[512];
    for (int j = 0; j < ROWS * D; j++)
        x[j] = (float)((j * 37 + a->iters) % 101) / 50.0f - 1.0f;
    for (int j = 0; j < D; j++)
        w[j] = 0.5f + (float)(j % 13) / 13.0f;
    for (int r = 0; r < ROWS; r++) {
        double ss = 0;
        for (int j = 0; j < D; j++)
            ss += (double)x[r * D + j] * x[r * D + j];
        double scale = 1.0 / sqrt(ss / D + 1e-5);
        for (int j = 0; j < D; j++)
            want[r * D + j] = (float)(x[r * D + j] * scale * w[j]);
    }
    cudaStream_t s;
    float *dx = NULL, *dw = NULL, *dout = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
        cudaMalloc((void **)&dx, sizeof x) != cudaSuccess || cudaMalloc((void **)&dw, sizeof w) != cudaSuccess ||
        cudaMalloc((void **)&dout, sizeof x) != cudaSuccess ||
        cudaMemcpyAsync(dx, x, sizeof x, cudaMemcpyHostToDevice, s) != cudaSuccess ||
        cudaMemcpyAsync(dw, w, sizeof w, cudaMemcpyHostToDevice, s) != cudaSuccess) {
        a->bad++;
        return NULL;
    }
    for (int i = 0; i < a->iters; i++) {
        void *d = NULL;
        if (cudaMalloc(&d, 512 + (size_t)i % 7) != cudaSuccess) {
            a->bad++;
            continue;
        }
        memset(h, i & 0xff, sizeof h);
        if (cudaMemcpyAsync(d, h, sizeof h, cudaMemcpyHostToDevice, s) != cudaSuccess ||
            cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, s) != cudaSuccess || h[511] != (i & 0xff))
            a->bad++;
        if (cudaFree(d) != cudaSuccess)
            a->bad++;
        kvf_err err = {0};
        kvf_cuda_rmsnorm_params rp = {.x = dx, .w = dw, .n = ROWS, .d = D, .eps = 1e-5f, .out = dout};
        if (kvf_cuda_rmsnorm(&rp, s, &err) != KVF_OK ||
            cudaMemcpyAsync(got, dout, sizeof got, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
            cudaStreamSynchronize(s) != cudaSuccess) {
            a->bad++;
            continue;
        }
        for (int j = 0; j < ROWS * D; j++)
            if (!(fabsf(got[j] - want[j]) <= 1e-5f * (1.0f + fabsf(want[j])))) {
                a->bad++;
                break;
            }
    }
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dout);
    cudaStreamDestroy(s);
    return NULL;
}

static void *other_thread_calls(void *p)
{
    thr_arg *a = p;
    a->seen_err = cudaGetLastError(); /* the main thread's error is not ours */
    void *d = NULL;
    if (cudaMalloc(&d, 256) != cudaSuccess || cudaFree(d) != cudaSuccess)
        a->bad++;
    return NULL;
}

static void test_threads(void **state)
{
    kvf_emu_rt_stats a, b;
    kvf_emu_rt_stats_get(&a);
    thr_arg t1 = {.iters = 400}, t2 = {.iters = 401};
    pthread_t th1, th2;
    assert_int_equal(pthread_create(&th1, NULL, churn, &t1), 0);
    assert_int_equal(pthread_create(&th2, NULL, churn, &t2), 0);
    pthread_join(th1, NULL);
    pthread_join(th2, NULL);
    assert_int_equal(t1.bad + t2.bad, 0);
    kvf_emu_rt_stats_get(&b);
    assert_int_equal(b.live_allocs, a.live_allocs);
    assert_int_equal(b.misuses, a.misuses);

    /* last error and capture are per thread: another thread's allocation neither sees our error
     * nor invalidates our capture (cudaStreamCaptureModeThreadLocal) */
    assert_int_equal(cudaSetDevice(3), cudaErrorInvalidDevice);
    cudaStream_t s;
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    void *d = NULL;
    assert_int_equal(cudaMalloc(&d, 256), cudaSuccess);
    assert_int_equal(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    assert_int_equal(cudaMemsetAsync(d, 1, 256, s), cudaSuccess);
    thr_arg o = {0};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, other_thread_calls, &o), 0);
    pthread_join(th, NULL);
    assert_int_equal(o.bad, 0);
    assert_int_equal(o.seen_err, cudaSuccess);
    cudaGraph_t g = NULL;
    assert_int_equal(cudaStreamEndCapture(s, &g), cudaSuccess);
    assert_non_null(g);
    assert_int_equal(cudaGraphDestroy(g), cudaSuccess);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidDevice);
    /* our own allocation inside our capture still invalidates it */
    assert_int_equal(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    void *d2 = NULL;
    assert_int_equal(cudaMalloc(&d2, 256), cudaErrorStreamCaptureUnsupported);
    assert_int_equal(cudaStreamEndCapture(s, &g), cudaErrorStreamCaptureInvalidated);
    (void)cudaGetLastError();
    assert_int_equal(cudaFree(d), cudaSuccess);
    assert_int_equal(cudaStreamDestroy(s), cudaSuccess);
}

/* ---- misuse in a program that is not a test: printed, then abort */

static int child_misuse(void *p)
{
    kvf_emu_rt_misuse_fatal(1);
    int x;
    cudaFree(&x); /* not an allocation of ours */
    return 0;      /* not reached when misuse is fatal */
}

static void test_misuse_fatal_aborts(void **state)
{
    int st = in_child(child_misuse, NULL);
    assert_true(WIFSIGNALED(st));
    assert_int_equal(WTERMSIG(st), SIGABRT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ipc_two_processes),
        cmocka_unit_test(test_ipc_own_handle_refused),
        cmocka_unit_test(test_ipc_handle_names_the_allocation),
        cmocka_unit_test(test_memcpy_default_and_attributes),
        cmocka_unit_test(test_events_and_async_alloc),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_misuse_fatal_aborts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
