/* xfer_gpu.cu: kvf_cuda_xfer_gpu(), the CUDA side of the transport's GPU ops table: IPC handles
 * of the pool allocation, cudaMemcpyAsync (cudaMemcpyDefault: unified addressing picks the
 * direction) and events on one non-blocking stream, pinned host memory, and stream-ordered
 * device memory (cudaMallocAsync) for NCCL staging. Every CUDA error becomes a status through
 * kvf_cuda_status; nothing here aborts. The transport decides when to call what. */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

extern "C" {
#include "cuda/cuda.h"
#include "cuda/xfer_gpu.h"
}

static_assert(sizeof(cudaIpcMemHandle_t) <= KVF_XFER_IPC_HANDLE_BYTES,
              "a CUDA IPC handle must fit the descriptor's handle field");

typedef struct xfer_gpu_ctx {
    pthread_mutex_t mu; /* guards the lazy stream creation */
    cudaStream_t stream;
    bool have_stream;
} xfer_gpu_ctx;

static xfer_gpu_ctx g_ctx = {PTHREAD_MUTEX_INITIALIZER, 0, false};

/* The stream, created on first use (non-blocking: it does not wait for the legacy stream). */
static kvf_status ctx_stream(xfer_gpu_ctx *c, cudaStream_t *out, kvf_err *err)
{
    kvf_status st = KVF_OK;
    pthread_mutex_lock(&c->mu);
    if (!c->have_stream) {
        cudaError_t e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
        if (e == cudaSuccess)
            c->have_stream = true;
        else
            st = kvf_cuda_status(e, "cuda xfer: creating the copy stream", err);
    }
    *out = c->stream;
    pthread_mutex_unlock(&c->mu);
    return st;
}

static bool op_available(void *ctx, char *why, size_t why_len)
{
    return kvf_cuda_available(why, why_len);
}

/* The driver's cuMemGetAddressRange (v3020: 64-bit base and size), fetched through the runtime
 * so libcuda is never linked (TOOLCHAIN.md). */
typedef int (*mem_range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);

static kvf_status op_ipc_export(void *ctx, void *base, uint8_t handle_out[KVF_XFER_IPC_HANDLE_BYTES],
                                kvf_err *err)
{
    cudaPointerAttributes attr;
    cudaError_t e = cudaPointerGetAttributes(&attr, base);
    if (e != cudaSuccess)
        return kvf_cuda_status(e, "cuda xfer: the pool pointer", err);
    if (attr.type != cudaMemoryTypeDevice)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda xfer: the pool at %p is not device memory "
                           "(cudaMalloc it)", base);
    /* The handle names the whole allocation and a peer maps it from its start: base must be
     * that start, or the peer would write at the wrong offsets. */
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 3020, cudaEnableDefault,
                                         &q) == cudaSuccess && q == cudaDriverEntryPointSuccess &&
        fn) {
        unsigned long long alloc_base = 0;
        size_t alloc_size = 0;
        if (((mem_range_fn)fn)(&alloc_base, &alloc_size, (unsigned long long)(uintptr_t)base) ==
                0 && alloc_base != (unsigned long long)(uintptr_t)base)
            return kvf_err_set(err, KVF_ERR_INVALID, "cuda xfer: the pool at %p starts %llu bytes "
                               "into its allocation (at 0x%llx); CUDA IPC needs the allocation's "
                               "start", base, (unsigned long long)(uintptr_t)base - alloc_base,
                               alloc_base);
    }
    (void)cudaGetLastError();
    cudaIpcMemHandle_t h;
    e = cudaIpcGetMemHandle(&h, base);
    if (e != cudaSuccess)
        return kvf_cuda_status(e, "cuda xfer: cudaIpcGetMemHandle of the pool", err);
    memset(handle_out, 0, KVF_XFER_IPC_HANDLE_BYTES);
    memcpy(handle_out, &h, sizeof h);
    return KVF_OK;
}

static kvf_status op_ipc_open(void *ctx, const uint8_t handle[KVF_XFER_IPC_HANDLE_BYTES],
                              void **base_out, kvf_err *err)
{
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
        return kvf_cuda_status(e, "cuda xfer: cudaIpcOpenMemHandle of the peer's pool", err);
    *base_out = p;
    return KVF_OK;
}

static void op_ipc_close(void *ctx, void *base)
{
    if (base && cudaIpcCloseMemHandle(base) != cudaSuccess)
        (void)cudaGetLastError();
}

static kvf_status op_copy_async(void *ctx, void *dst, const void *src, size_t bytes, kvf_err *err)
{
    cudaStream_t s;
    kvf_status st = ctx_stream((xfer_gpu_ctx *)ctx, &s, err);
    if (st != KVF_OK)
        return st;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s);
    return kvf_cuda_status(e, "cuda xfer: cudaMemcpyAsync", err);
}

static kvf_status op_mark(void *ctx, void **mark_out, kvf_err *err)
{
    cudaStream_t s;
    kvf_status st = ctx_stream((xfer_gpu_ctx *)ctx, &s, err);
    if (st != KVF_OK)
        return st;
    cudaEvent_t ev;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess)
        return kvf_cuda_status(e, "cuda xfer: cudaEventCreate", err);
    e = cudaEventRecord(ev, s);
    if (e != cudaSuccess) {
        cudaEventDestroy(ev);
        return kvf_cuda_status(e, "cuda xfer: cudaEventRecord", err);
    }
    *mark_out = (void *)ev;
    return KVF_OK;
}

static kvf_status op_mark_query(void *ctx, void *mark, kvf_err *err)
{
    cudaError_t e = cudaEventQuery((cudaEvent_t)mark);
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError(); /* not an error: clear it */
        return KVF_ERR_BUSY;
    }
    return kvf_cuda_status(e, "cuda xfer: the copies before this mark", err);
}

static void op_mark_free(void *ctx, void *mark)
{
    if (mark)
        cudaEventDestroy((cudaEvent_t)mark);
}

static kvf_status op_sync(void *ctx, kvf_err *err)
{
    cudaStream_t s;
    kvf_status st = ctx_stream((xfer_gpu_ctx *)ctx, &s, err);
    if (st != KVF_OK)
        return st;
    return kvf_cuda_status(cudaStreamSynchronize(s), "cuda xfer: cudaStreamSynchronize", err);
}

static kvf_status op_host_alloc(void *ctx, size_t bytes, void **out, kvf_err *err)
{
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess)
        return kvf_cuda_status(e, "cuda xfer: cudaHostAlloc (pinned staging)", err);
    *out = p;
    return KVF_OK;
}

static void op_host_free(void *ctx, void *p)
{
    if (p)
        cudaFreeHost(p);
}

static kvf_status op_dev_alloc_async(void *ctx, size_t bytes, void **out, kvf_err *err)
{
    cudaStream_t s;
    kvf_status st = ctx_stream((xfer_gpu_ctx *)ctx, &s, err);
    if (st != KVF_OK)
        return st;
    void *p = NULL;
    cudaError_t e = cudaMallocAsync(&p, bytes, s);
    if (e != cudaSuccess)
        return kvf_cuda_status(e, "cuda xfer: cudaMallocAsync (staging)", err);
    *out = p;
    return KVF_OK;
}

static void op_dev_free_async(void *ctx, void *p)
{
    cudaStream_t s;
    if (p && ctx_stream((xfer_gpu_ctx *)ctx, &s, NULL) == KVF_OK)
        cudaFreeAsync(p, s);
}

static void *op_stream(void *ctx)
{
    cudaStream_t s = 0;
    ctx_stream((xfer_gpu_ctx *)ctx, &s, NULL);
    return (void *)s;
}

static const kvf_xfer_gpu g_table = {
    "cuda",
    &g_ctx,
    op_available,
    op_ipc_export,
    op_ipc_open,
    op_ipc_close,
    op_copy_async,
    op_mark,
    op_mark_query,
    op_mark_free,
    op_sync,
    op_host_alloc,
    op_host_free,
    op_dev_alloc_async,
    op_dev_free_async,
    op_stream,
};

extern "C" const kvf_xfer_gpu *kvf_cuda_xfer_gpu(void)
{
    return &g_table;
}
