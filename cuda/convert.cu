/* convert.cu: elementwise dtype conversion on the device (weights at load, f32 activations to
 * the weights' half type before a cuBLAS GEMM). */
#include <cuda_runtime.h>

#include "cuda/dtype.cuh"

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

static __global__ void convert_kernel(const void *src, kvf_dtype sdt, void *dst, kvf_dtype ddt,
                                      int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        kvf_dev_store(dst, ddt, i, kvf_dev_load(src, sdt, i));
}

#ifndef KVF_CUDA_HOST_EMU /* the launchers; tests/unit/cuda/host_ops_emu.cpp runs the kernels on the host */
extern "C" kvf_status kvf_cuda_convert(const kvf_cuda_convert_params *p, void *stream,
                                       kvf_err *err)
{
    if (p->n < 0 || (unsigned)p->src_dtype >= KVF_DTYPE_COUNT ||
        (unsigned)p->dst_dtype >= KVF_DTYPE_COUNT)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: convert: n %lld, dtypes %d -> %d (n >= 0, known dtypes)",
                           (long long)p->n, (int)p->src_dtype, (int)p->dst_dtype);
    if (p->n == 0)
        return KVF_OK;
    convert_kernel<<<kvf_dev_blocks(p->n, 256), 256, 0, (cudaStream_t)stream>>>(
        p->src, p->src_dtype, p->dst, p->dst_dtype, p->n);
    return kvf_cuda_status(cudaGetLastError(), "cuda: convert", err);
}
#endif
