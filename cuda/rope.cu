/* rope.cu: rotary position embedding in place, one thread per rotated pair (j, j + half) of
 * one head of one token, angles from the forward pass's cos_sin table. */
#include <cuda_runtime.h>

#include "cuda/dtype.cuh"

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

static __global__ void rope_kernel(float *x, int64_t n, int32_t n_heads, int32_t head_dim,
                                   const float *cos_sin)
{
    int32_t half = head_dim / 2;
    int64_t total = n * n_heads * half;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int32_t j = (int32_t)(i % half);
        int64_t th = i / half; /* token * n_heads + head */
        int64_t t = th / n_heads;
        float c = cos_sin[(t * half + j) * 2], s = cos_sin[(t * half + j) * 2 + 1];
        float *v = x + th * head_dim;
        float a = v[j], b = v[j + half];
        v[j] = a * c - b * s;
        v[j + half] = b * c + a * s;
    }
}

#ifndef KVF_CUDA_HOST_EMU /* the launchers; tests/unit/cuda/host_ops_emu.cpp runs the kernels on the host */
extern "C" kvf_status kvf_cuda_rope(const kvf_cuda_rope_params *p, void *stream, kvf_err *err)
{
    if (p->n < 0 || p->n_heads <= 0 || p->head_dim <= 0 || p->head_dim % 2)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: rope: n %lld, %d heads, head_dim %d (heads > 0, head_dim even)",
                           (long long)p->n, p->n_heads, p->head_dim);
    int64_t total = p->n * p->n_heads * (p->head_dim / 2);
    if (total == 0)
        return KVF_OK;
    rope_kernel<<<kvf_dev_blocks(total, 256), 256, 0, (cudaStream_t)stream>>>(
        p->x, p->n, p->n_heads, p->head_dim, p->cos_sin);
    return kvf_cuda_status(cudaGetLastError(), "cuda: rope", err);
}
#endif
