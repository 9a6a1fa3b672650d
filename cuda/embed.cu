/* embed.cu: row lookups: token embeddings (f32/f16/bf16 table to f32 rows) and the gather of
 * each sequence's last row before the LM head. */
#include <cuda_runtime.h>

#include "cuda/dtype.cuh"

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

/* Grid: (column chunks, rows); each thread copies columns with a stride of blockDim. */
static __global__ void embed_kernel(const void *table, kvf_dtype dt, int64_t cols,
                                    const int32_t *tokens, int64_t n, float *out)
{
    for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
        int64_t src = (int64_t)tokens[i] * cols;
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < cols;
             j += (int64_t)gridDim.x * blockDim.x)
            out[i * cols + j] = kvf_dev_load(table, dt, src + j);
    }
}

static __global__ void gather_kernel(const float *x, int64_t row_len, const int32_t *rows,
                                     int64_t n, float *out)
{
    for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
        const float *src = x + (int64_t)rows[i] * row_len;
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < row_len;
             j += (int64_t)gridDim.x * blockDim.x)
            out[i * row_len + j] = src[j];
    }
}

#ifndef KVF_CUDA_HOST_EMU /* the launchers; tests/unit/cuda/host_ops_emu.cpp runs the kernels on the host */
/* x: column chunks of 256 (at most 64), y: rows (at most 65535, the rest by a grid stride). */
static dim3 row_grid(int64_t cols, int64_t n)
{
    int64_t bx = (cols + 255) / 256;
    return dim3((unsigned)(bx > 64 ? 64 : bx), (unsigned)(n > 65535 ? 65535 : n));
}

extern "C" kvf_status kvf_cuda_embed(const kvf_cuda_embed_params *p, void *stream, kvf_err *err)
{
    if (p->dtype != KVF_DTYPE_F32 && p->dtype != KVF_DTYPE_F16 && p->dtype != KVF_DTYPE_BF16)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "cuda: embed: table dtype %s (use f32, f16 or bf16)",
                           kvf_dtype_name(p->dtype));
    if (p->n < 0 || p->cols <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: embed: %lld rows of %lld columns (rows >= 0, columns > 0)",
                           (long long)p->n, (long long)p->cols);
    if (p->n == 0)
        return KVF_OK;
    embed_kernel<<<row_grid(p->cols, p->n), 256, 0, (cudaStream_t)stream>>>(
        p->table, p->dtype, p->cols, p->tokens, p->n, p->out);
    return kvf_cuda_status(cudaGetLastError(), "cuda: embed", err);
}

extern "C" kvf_status kvf_cuda_gather(const kvf_cuda_gather_params *p, void *stream, kvf_err *err)
{
    if (p->n < 0 || p->row_len <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: gather: %lld rows of %lld floats (rows >= 0, length > 0)",
                           (long long)p->n, (long long)p->row_len);
    if (p->n == 0)
        return KVF_OK;
    gather_kernel<<<row_grid(p->row_len, p->n), 256, 0, (cudaStream_t)stream>>>(
        p->x, p->row_len, p->rows, p->n, p->out);
    return kvf_cuda_status(cudaGetLastError(), "cuda: gather", err);
}
#endif
