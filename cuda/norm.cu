/* norm.cu: RMSNorm, one CTA per row: a block-wide sum of squares, then the scaled write (in
 * place allowed: each thread reads its elements before the barrier and writes them after). */
#include <cuda_runtime.h>

#include "cuda/dtype.cuh"

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

#define NORM_THREADS 256

static __global__ void rmsnorm_kernel(const float *x, const float *w, int64_t d, float eps,
                                      float *out)
{
    __shared__ float part[NORM_THREADS / 32];
    __shared__ float scale;
    const float *xi = x + (int64_t)blockIdx.x * d;
    float *oi = out + (int64_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
        ss += xi[j] * xi[j];
    for (int o = 16; o > 0; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int i = 0; i < NORM_THREADS / 32; i++)
            t += part[i];
        scale = rsqrtf(t / (float)d + eps);
    }
    __syncthreads();
    float r = scale;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
        oi[j] = xi[j] * r * w[j];
}

#ifndef KVF_CUDA_HOST_EMU /* the launchers; tests/unit/cuda/host_ops_emu.cpp runs the kernels on the host */
extern "C" kvf_status kvf_cuda_rmsnorm(const kvf_cuda_rmsnorm_params *p, void *stream,
                                       kvf_err *err)
{
    if (p->n < 0 || p->n > 0x7fffffff || p->d <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: rmsnorm: %lld rows of %lld (rows >= 0, width > 0)",
                           (long long)p->n, (long long)p->d);
    if (p->n == 0)
        return KVF_OK;
    rmsnorm_kernel<<<(unsigned)p->n, NORM_THREADS, 0, (cudaStream_t)stream>>>(p->x, p->w, p->d,
                                                                              p->eps, p->out);
    return kvf_cuda_status(cudaGetLastError(), "cuda: rmsnorm", err);
}
#endif
