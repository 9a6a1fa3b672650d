/* attn_bench.cu: device buffers, random fill and CUDA-event timing behind attn_bench.h, for the
 * attention benchmark and the GPU attention test. The kernels they time live elsewhere. */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

extern "C" {
#include "cuda/attn_bench.h"
#include "cuda/cuda.h"
}

namespace {

__device__ __forceinline__ float bench_unit(uint64_t i, uint32_t seed)
{
    /* splitmix64 of (seed, index): uniform in [-1, 1) */
    uint64_t z = i * 0x9e3779b97f4a7c15ull + ((uint64_t)seed << 32 | 0x5bd1e995u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) / (float)(1u << 23) - 1.0f;
}

__global__ void bench_fill_kernel(uint8_t *dst, size_t n, int dt, uint32_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float f = bench_unit(i, seed);
        switch (dt) {
        case KVF_DTYPE_F32:
            reinterpret_cast<float *>(dst)[i] = f;
            break;
        case KVF_DTYPE_F16:
            reinterpret_cast<__half *>(dst)[i] = __float2half_rn(f);
            break;
        case KVF_DTYPE_BF16: { /* round to nearest even, as common/dtype.c does */
            uint32_t u = __float_as_uint(f);
            u += 0x7fffu + ((u >> 16) & 1u);
            reinterpret_cast<uint16_t *>(dst)[i] = (uint16_t)(u >> 16);
            break;
        }
        default:
            dst[i] = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
            break;
        }
    }
}

/* Reads n 16-byte words at src, four per thread in flight, grid-stride; the XOR of everything
 * goes to *sink only if it equals a constant (practically never), so the loads stay. The bare
 * read the attention benchmark sets beside its kernels: one launch that reads the bytes and
 * does nothing else. */
__global__ void bench_read_kernel(const uint4 *src, size_t n, uint32_t *sink)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    uint32_t acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
               d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = src[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9e3779b9u)
        *sink = acc;
}

constexpr unsigned BENCH_READ_NT = 256;

} /* namespace */

extern "C" kvf_status kvf_cuda_bench_alloc(size_t bytes, void **out, kvf_err *err)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        char what[96];
        snprintf(what, sizeof what, "cuda: allocating %zu bytes of device memory", bytes);
        (void)cudaGetLastError();
        return kvf_cuda_status((int)e, what, err);
    }
    e = cudaMemset(p, 0, bytes);
    if (e != cudaSuccess) {
        cudaFree(p);
        return kvf_cuda_status((int)e, "cuda: zeroing new device memory", err);
    }
    *out = p;
    return KVF_OK;
}

extern "C" void kvf_cuda_bench_free(void *dev)
{
    if (dev)
        cudaFree(dev);
}

extern "C" kvf_status kvf_cuda_bench_upload(void *dev, const void *host, size_t bytes, kvf_err *err)
{
    return kvf_cuda_status((int)cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice),
                           "cuda: copy to the device", err);
}

extern "C" kvf_status kvf_cuda_bench_download(void *host, const void *dev, size_t bytes,
                                              kvf_err *err)
{
    return kvf_cuda_status((int)cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost),
                           "cuda: copy from the device", err);
}

extern "C" kvf_status kvf_cuda_bench_fill_random(void *dev, size_t n, kvf_dtype dt, uint32_t seed,
                                                 kvf_err *err)
{
    if (kvf_dtype_size(dt) == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: fill: unknown dtype %d", (int)dt);
    if (n == 0)
        return KVF_OK;
    size_t blocks = (n + 255) / 256;
    if (blocks > 65536)
        blocks = 65536;
    bench_fill_kernel<<<(unsigned)blocks, 256>>>(static_cast<uint8_t *>(dev), n, (int)dt, seed);
    kvf_status st = kvf_cuda_status((int)cudaGetLastError(), "cuda: fill launch", err);
    if (st != KVF_OK)
        return st;
    return kvf_cuda_status((int)cudaDeviceSynchronize(), "cuda: fill", err);
}

extern "C" kvf_status kvf_cuda_bench_sync(kvf_err *err)
{
    return kvf_cuda_status((int)cudaDeviceSynchronize(), "cuda: synchronize", err);
}

extern "C" kvf_status kvf_cuda_bench_device(char *name, size_t name_len, size_t *free_out,
                                            size_t *total_out, kvf_err *err)
{
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    cudaDeviceProp prop;
    if (e == cudaSuccess)
        e = cudaGetDeviceProperties(&prop, dev);
    size_t fr = 0, tot = 0;
    if (e == cudaSuccess)
        e = cudaMemGetInfo(&fr, &tot);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kvf_cuda_status((int)e, "cuda: device properties", err);
    }
    if (name && name_len)
        snprintf(name, name_len, "%s (sm_%d%d, %d SMs)", prop.name, prop.major, prop.minor,
                 prop.multiProcessorCount);
    if (free_out)
        *free_out = fr;
    if (total_out)
        *total_out = tot;
    return KVF_OK;
}

/* One timed operation: attention (p), a copy (dst, src, bytes) or with read a bare read of
 * src's bytes (dst: the read kernel's sink). */
typedef struct bench_op {
    const kvf_cuda_attn_params *p;
    void *dst;
    const void *src;
    size_t bytes;
    bool read;
} bench_op;

static kvf_status bench_op_run(const bench_op *op, cudaStream_t s, kvf_err *err)
{
    if (op->p)
        return kvf_cuda_attention(op->p, s, err);
    if (op->read) {
        const size_t n = op->bytes / 16, per_cta = (size_t)BENCH_READ_NT * 4;
        size_t blocks = (n + per_cta - 1) / per_cta;
        blocks = blocks < 1 ? 1 : blocks > 8192 ? 8192 : blocks;
        bench_read_kernel<<<(unsigned)blocks, BENCH_READ_NT, 0, s>>>(
            static_cast<const uint4 *>(op->src), n, static_cast<uint32_t *>(op->dst));
        return kvf_cuda_status((int)cudaGetLastError(), "cuda: read kernel launch", err);
    }
    return kvf_cuda_status((int)cudaMemcpyAsync(op->dst, op->src, op->bytes,
                                                cudaMemcpyDeviceToDevice, s),
                           "cuda: device-to-device copy", err);
}

static kvf_status bench_time(const bench_op *op, void *flush, size_t flush_bytes, int32_t iters,
                             double *ms_out, kvf_err *err)
{
    if (iters < 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: bench: %d iterations (>= 1)", iters);
    cudaStream_t s = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    kvf_status st = kvf_cuda_status((int)cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                    "cuda: stream", err);
    if (st != KVF_OK)
        return st;
    st = kvf_cuda_status((int)cudaEventCreate(&e0), "cuda: event", err);
    if (st == KVF_OK)
        st = kvf_cuda_status((int)cudaEventCreate(&e1), "cuda: event", err);
    double total = 0;
    if (st == KVF_OK && !flush) { /* back to back */
        st = kvf_cuda_status((int)cudaEventRecord(e0, s), "cuda: event record", err);
        for (int32_t i = 0; i < iters && st == KVF_OK; i++)
            st = bench_op_run(op, s, err);
        if (st == KVF_OK)
            st = kvf_cuda_status((int)cudaEventRecord(e1, s), "cuda: event record", err);
        if (st == KVF_OK)
            st = kvf_cuda_status((int)cudaEventSynchronize(e1), "cuda: timed calls", err);
        float ms = 0;
        if (st == KVF_OK)
            st = kvf_cuda_status((int)cudaEventElapsedTime(&ms, e0, e1), "cuda: elapsed", err);
        total = ms;
    } else {
        /* the flush runs first, so the host has queued the timed call before the GPU gets
         * to the first event: the event pair times the call alone */
        for (int32_t i = 0; i < iters && st == KVF_OK; i++) {
            st = kvf_cuda_status((int)cudaMemsetAsync(flush, i & 0xff, flush_bytes, s),
                                 "cuda: L2 flush", err);
            if (st == KVF_OK)
                st = kvf_cuda_status((int)cudaEventRecord(e0, s), "cuda: event record", err);
            if (st == KVF_OK)
                st = bench_op_run(op, s, err);
            if (st == KVF_OK)
                st = kvf_cuda_status((int)cudaEventRecord(e1, s), "cuda: event record", err);
            if (st == KVF_OK)
                st = kvf_cuda_status((int)cudaEventSynchronize(e1), "cuda: timed call", err);
            float ms = 0;
            if (st == KVF_OK)
                st = kvf_cuda_status((int)cudaEventElapsedTime(&ms, e0, e1), "cuda: elapsed", err);
            total += ms;
        }
    }
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaStreamDestroy(s);
    if (st == KVF_OK)
        *ms_out = total / iters;
    return st;
}

extern "C" kvf_status kvf_cuda_bench_attn_ms(const kvf_cuda_attn_params *p, void *flush,
                                             size_t flush_bytes, int32_t iters, double *ms_out,
                                             kvf_err *err)
{
    bench_op op = {p, NULL, NULL, 0, false};
    return bench_time(&op, flush, flush_bytes, iters, ms_out, err);
}

extern "C" kvf_status kvf_cuda_bench_copy_ms(void *dst, const void *src, size_t bytes, void *flush,
                                             size_t flush_bytes, int32_t iters, double *ms_out,
                                             kvf_err *err)
{
    bench_op op = {NULL, dst, src, bytes, false};
    return bench_time(&op, flush, flush_bytes, iters, ms_out, err);
}

extern "C" kvf_status kvf_cuda_bench_read_ms(const void *src, size_t bytes, void *sink,
                                             void *flush, size_t flush_bytes, int32_t iters,
                                             double *ms_out, kvf_err *err)
{
    if ((reinterpret_cast<uintptr_t>(src) | bytes) % 16 != 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "cuda: bench read: %zu bytes at %p: not in 16-byte words", bytes, src);
    bench_op op = {NULL, sink, src, bytes, true};
    return bench_time(&op, flush, flush_bytes, iters, ms_out, err);
}
