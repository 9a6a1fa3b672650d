/* layout.h: the block-major KV layout (DESIGN.md section 4). One physical block holds, for
 * block_size tokens, every layer's K and V: [layer][K|V][kv_head][token][head_dim], contiguous,
 * so moving a block is one transfer. Every byte offset into a pool is computed here and only
 * here. Plain data: passed by value to kernels and carried in the worker's Info. */
#ifndef KVF_KV_LAYOUT_H
#define KVF_KV_LAYOUT_H

#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"

typedef enum kvf_kv_part { KVF_KV_K = 0, KVF_KV_V = 1 } kvf_kv_part;

typedef struct kvf_kv_layout {
    int32_t n_layers, n_kv_heads, head_dim, block_size; /* block_size: tokens per block */
    kvf_dtype dtype;
    int64_t block_bytes; /* whole block, all layers: 2 * L * H_kv * bs * D * dtype bytes */
} kvf_kv_layout;

#define KVF_KV_MAX_BLOCK_SIZE 1024

/* Fills *out after checking every field (positive, block_size a power of two up to 1024,
 * a known dtype). */
kvf_status kvf_kv_layout_init(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                              int32_t block_size, kvf_dtype dtype, kvf_kv_layout *out,
                              kvf_err *err);

/* Refuses two layouts that cannot share blocks, naming the field and both values:
 * "kv: block_size differs: 16 here, 32 at peer". what_a/what_b name the two sides. */
kvf_status kvf_kv_layout_check_same(const kvf_kv_layout *a, const char *what_a,
                                    const kvf_kv_layout *b, const char *what_b, kvf_err *err);

/* Bytes of K and V for one token across all layers (the `plan` figure). */
static inline int64_t kvf_kv_bytes_per_token(const kvf_kv_layout *l)
{
    return 2 * (int64_t)l->n_layers * l->n_kv_heads * l->head_dim *
           (int64_t)kvf_dtype_size(l->dtype);
}

/* Bytes of one (layer, K|V) slab inside a block: [kv_head][token][head_dim]. */
static inline int64_t kvf_kv_slab_bytes(const kvf_kv_layout *l)
{
    return (int64_t)l->n_kv_heads * l->block_size * l->head_dim * (int64_t)kvf_dtype_size(l->dtype);
}

/* Byte offset, from the start of the pool, of element [block][layer][part][head][token][0]. */
static inline int64_t kvf_kv_offset(const kvf_kv_layout *l, int64_t block, int32_t layer,
                                    kvf_kv_part part, int32_t head, int32_t token)
{
    int64_t es = (int64_t)kvf_dtype_size(l->dtype);
    return block * l->block_bytes + ((int64_t)layer * 2 + part) * kvf_kv_slab_bytes(l) +
           (((int64_t)head * l->block_size + token) * l->head_dim) * es;
}

/* Blocks needed to hold n_tokens: 0 -> 0, 16 -> 1, 17 -> 2 at block_size 16. */
static inline int64_t kvf_kv_blocks_for(int64_t n_tokens, int32_t block_size)
{
    return n_tokens <= 0 ? 0 : (n_tokens + block_size - 1) / block_size;
}

#endif
