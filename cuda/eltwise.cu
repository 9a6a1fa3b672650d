/* eltwise.cu: the elementwise ops of a layer: SwiGLU (silu(gate) * up), the residual add, and
 * the bias add after a GEMM. */
#include <cuda_runtime.h>

#include "cuda/dtype.cuh"

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

static __global__ void eltwise_kernel(kvf_cuda_eltwise_op op, const float *a, const float *b,
                                      float *out, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float x = a[i], y = b[i];
        out[i] = op == KVF_CUDA_SWIGLU ? x / (1.0f + expf(-x)) * y : x + y;
    }
}

static __global__ void bias_kernel(float *y, const float *bias, int64_t n, int64_t rows)
{
    int64_t total = n * rows;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] += bias[i % rows];
}

#ifndef KVF_CUDA_HOST_EMU /* the launchers; tests/unit/cuda/host_ops_emu.cpp runs the kernels on the host */
extern "C" kvf_status kvf_cuda_eltwise(const kvf_cuda_eltwise_params *p, void *stream,
                                       kvf_err *err)
{
    if (p->op != KVF_CUDA_SWIGLU && p->op != KVF_CUDA_ADD)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: eltwise: op %d (swiglu 0 or add 1)", (int)p->op);
    if (p->n < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: eltwise: n %lld must not be negative", (long long)p->n);
    if (p->n == 0)
        return KVF_OK;
    eltwise_kernel<<<kvf_dev_blocks(p->n, 256), 256, 0, (cudaStream_t)stream>>>(p->op, p->a, p->b,
                                                                               p->out, p->n);
    return kvf_cuda_status(cudaGetLastError(),
                           p->op == KVF_CUDA_SWIGLU ? "cuda: swiglu" : "cuda: add", err);
}

extern "C" kvf_status kvf_cuda_bias_add(const kvf_cuda_bias_params *p, void *stream, kvf_err *err)
{
    if (p->n < 0 || p->rows <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: bias add: %lld rows of %lld (rows >= 0, width > 0)",
                           (long long)p->n, (long long)p->rows);
    if (p->n == 0)
        return KVF_OK;
    bias_kernel<<<kvf_dev_blocks(p->n * p->rows, 256), 256, 0, (cudaStream_t)stream>>>(
        p->y, p->bias, p->n, p->rows);
    return kvf_cuda_status(cudaGetLastError(), "cuda: bias add", err);
}
#endif
