/* kv_write.cu: new K and V rows into the block-major paged pool (kv/layout.h), one thread per
 * element of one (token, kv head) row, converted to the pool's dtype; fp8-e4m3 divides by the
 * per-tensor scale first. Offsets follow kvf_kv_offset exactly. */
#include <cuda_runtime.h>

#include "cuda/dtype.cuh"

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

/* The pieces of kvf_kv_offset, computed once on the host. */
typedef struct kvw_geo {
    int64_t block_bytes, slab_bytes, es;
    int32_t n_kv_heads, head_dim, block_size, layer;
    kvf_dtype dtype;
} kvw_geo;

static __global__ void kv_write_kernel(uint8_t *pool, kvw_geo g, const float *k, const float *v,
                                       const int64_t *slots, int64_t n, float ks, float vs)
{
    int64_t row = (int64_t)g.n_kv_heads * g.head_dim, total = n * row;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / row;
        int32_t h = (int32_t)((i % row) / g.head_dim), d = (int32_t)(i % g.head_dim);
        int64_t slot = slots[t], block = slot / g.block_size;
        int32_t off = (int32_t)(slot % g.block_size);
        /* kvf_kv_offset(l, block, layer, part, h, off) + d elements */
        int64_t within = ((int64_t)h * g.block_size + off) * g.head_dim + d;
        int64_t kbase = block * g.block_bytes + ((int64_t)g.layer * 2 + 0) * g.slab_bytes;
        int64_t vbase = block * g.block_bytes + ((int64_t)g.layer * 2 + 1) * g.slab_bytes;
        float kx = k[i], vx = v[i];
        if (g.dtype == KVF_DTYPE_FP8_E4M3) { /* a true division, as the CPU backend does */
            kx = kx / ks;
            vx = vx / vs;
        }
        kvf_dev_store(pool + kbase, g.dtype, within, kx);
        kvf_dev_store(pool + vbase, g.dtype, within, vx);
    }
}

#ifndef KVF_CUDA_HOST_EMU /* the launchers; tests/unit/cuda/host_ops_emu.cpp runs the kernels on the host */
extern "C" kvf_status kvf_cuda_kv_write(const kvf_cuda_kv_write_params *p, void *stream,
                                        kvf_err *err)
{
    const kvf_kv_layout *l = &p->layout;
    if ((unsigned)l->dtype >= KVF_DTYPE_COUNT)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "cuda: kv_write: KV dtype %d (use f32, f16, bf16 or fp8-e4m3)",
                           (int)l->dtype);
    if (p->layer < 0 || p->layer >= l->n_layers || p->n < 0 || l->n_kv_heads <= 0 ||
        l->head_dim <= 0 || l->block_size <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: kv_write: layer %d of %d, %lld tokens, %d kv heads, head_dim %d, block_size %d",
                           p->layer, l->n_layers, (long long)p->n, l->n_kv_heads, l->head_dim, l->block_size);
    if (l->dtype == KVF_DTYPE_FP8_E4M3 && !(p->k_scale > 0.0f && p->v_scale > 0.0f))
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: kv_write: fp8 scales k %g, v %g must be > 0",
                           (double)p->k_scale, (double)p->v_scale);
    if (p->n == 0)
        return KVF_OK;
    kvw_geo g = {.block_bytes = l->block_bytes, .slab_bytes = kvf_kv_slab_bytes(l),
                 .es = (int64_t)kvf_dtype_size(l->dtype), .n_kv_heads = l->n_kv_heads,
                 .head_dim = l->head_dim, .block_size = l->block_size, .layer = p->layer,
                 .dtype = l->dtype};
    float ks = l->dtype == KVF_DTYPE_FP8_E4M3 ? p->k_scale : 1.0f;
    float vs = l->dtype == KVF_DTYPE_FP8_E4M3 ? p->v_scale : 1.0f;
    int64_t total = p->n * l->n_kv_heads * l->head_dim;
    kv_write_kernel<<<kvf_dev_blocks(total, 256), 256, 0, (cudaStream_t)stream>>>(
        (uint8_t *)p->pool, g, p->k, p->v, p->slots, p->n, ks, vs);
    return kvf_cuda_status(cudaGetLastError(), "cuda: kv_write", err);
}
#endif
