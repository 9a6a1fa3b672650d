/* dtype.cuh: device-side element loads and stores for the dtypes kvfleet keeps on the GPU, with
 * the same rounding as common/dtype.c (nearest even; fp8-e4m3 saturates to +-448, NaN stays
 * NaN). Included by the op .cu files only; host code uses common/dtype.h. */
#ifndef KVF_CUDA_DTYPE_CUH
#define KVF_CUDA_DTYPE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

extern "C" {
#include "common/dtype.h"
}

/* Element i of p, of dtype dt, as f32. */
static __device__ __forceinline__ float kvf_dev_load(const void *p, kvf_dtype dt, int64_t i)
{
    switch (dt) {
    case KVF_DTYPE_F16:
        return __half2float(((const __half *)p)[i]);
    case KVF_DTYPE_BF16:
        return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case KVF_DTYPE_FP8_E4M3: {
        __half_raw h = __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)p)[i], __NV_E4M3);
        return __half2float(__half(h));
    }
    default:
        return ((const float *)p)[i];
    }
}

/* Stores x as element i of p, of dtype dt. */
static __device__ __forceinline__ void kvf_dev_store(void *p, kvf_dtype dt, int64_t i, float x)
{
    switch (dt) {
    case KVF_DTYPE_F16:
        ((__half *)p)[i] = __float2half_rn(x);
        return;
    case KVF_DTYPE_BF16:
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(x);
        return;
    case KVF_DTYPE_FP8_E4M3:
        ((__nv_fp8_storage_t *)p)[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
        return;
    default:
        ((float *)p)[i] = x;
        return;
    }
}

/* Blocks for n threads of `threads` each, capped (kernels loop with a grid stride). */
static inline unsigned kvf_dev_blocks(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b > 65535 * 16 ? 65535 * 16 : b);
}

#endif
