/* argmax.cu: the greedy token of each logits row, one CTA per row: every thread keeps the first
 * largest value of its strided slice, then the CTA combines them, ties to the lowest id, the
 * same answer as the CPU backend (NaN never wins; a row with no number gives 0). */
#include <cuda_runtime.h>

#include "cuda/dtype.cuh"

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

#define ARGMAX_THREADS 256

/* Does (v, i) beat (bv, bi)? An invalid entry (i < 0) never wins. */
static __device__ __forceinline__ bool beats(float v, int64_t i, float bv, int64_t bi)
{
    if (i < 0)
        return false;
    if (bi < 0)
        return true;
    return v > bv || (v == bv && i < bi);
}

static __global__ void argmax_kernel(const float *logits, int64_t vocab, int32_t *out)
{
    __shared__ float sv[ARGMAX_THREADS];
    __shared__ int64_t si[ARGMAX_THREADS];
    const float *r = logits + (int64_t)blockIdx.x * vocab;
    float bv = 0.0f;
    int64_t bi = -1;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
        float v = r[j];
        if (v == v && (bi < 0 || v > bv)) { /* indices rise: strict > keeps the first */
            bv = v;
            bi = j;
        }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = ARGMAX_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s && beats(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x],
                                          si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + s];
            si[threadIdx.x] = si[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[blockIdx.x] = si[0] < 0 ? 0 : (int32_t)si[0];
}

#ifndef KVF_CUDA_HOST_EMU /* the launchers; tests/unit/cuda/host_ops_emu.cpp runs the kernels on the host */
extern "C" kvf_status kvf_cuda_argmax(const kvf_cuda_argmax_params *p, void *stream, kvf_err *err)
{
    if (p->n < 0 || p->n > 0x7fffffff || p->vocab <= 0 || p->vocab > 0x7fffffff)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: argmax: %lld rows of %lld (rows >= 0, vocab 1 to 2^31-1)",
                           (long long)p->n, (long long)p->vocab);
    if (p->n == 0)
        return KVF_OK;
    argmax_kernel<<<(unsigned)p->n, ARGMAX_THREADS, 0, (cudaStream_t)stream>>>(p->logits, p->vocab,
                                                                              p->out);
    return kvf_cuda_status(cudaGetLastError(), "cuda: argmax", err);
}
#endif
