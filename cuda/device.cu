/* device.cu: asking whether a GPU is usable, and the one place CUDA and cuBLAS error codes become
 * kvf_status values. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" {
#include "cuda/cuda.h"
}

extern "C" bool kvf_cuda_available(char *why, size_t why_len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n < 1) {
        if (why && why_len)
            snprintf(why, why_len, "no CUDA device: %s (%d)",
                     e != cudaSuccess ? cudaGetErrorString(e) : "no device found", (int)e);
        (void)cudaGetLastError();
        return false;
    }
    return true;
}

extern "C" kvf_status kvf_cuda_status(int cuda_err, const char *what, kvf_err *err)
{
    if (cuda_err == cudaSuccess)
        return KVF_OK;
    cudaError_t e = (cudaError_t)cuda_err;
    kvf_status st = e == cudaErrorMemoryAllocation ? KVF_ERR_NOMEM : KVF_ERR_INTERNAL;
    return kvf_err_set(err, st, "%s: %s (%d)", what, cudaGetErrorString(e), cuda_err);
}

extern "C" kvf_status kvf_cuda_blas_status(int blas_status, const char *what, kvf_err *err)
{
    if (blas_status == CUBLAS_STATUS_SUCCESS)
        return KVF_OK;
    cublasStatus_t s = (cublasStatus_t)blas_status;
    kvf_status st = s == CUBLAS_STATUS_ALLOC_FAILED ? KVF_ERR_NOMEM
                    : s == CUBLAS_STATUS_NOT_SUPPORTED ? KVF_ERR_UNSUPPORTED
                    : s == CUBLAS_STATUS_INVALID_VALUE ? KVF_ERR_INVALID
                                                       : KVF_ERR_INTERNAL;
    return kvf_err_set(err, st, "%s: cuBLAS %s: %s (%d)", what, cublasGetStatusName(s),
                       cublasGetStatusString(s), blas_status);
}
