/* layout.c: validating and comparing KV layouts. */
#include "kv/layout.h"

kvf_status kvf_kv_layout_init(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                              int32_t block_size, kvf_dtype dtype, kvf_kv_layout *out,
                              kvf_err *err)
{
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "kv: layout needs positive layers, kv heads and head_dim (got %d, %d, %d)",
                           n_layers, n_kv_heads, head_dim);
    if (block_size <= 0 || block_size > KVF_KV_MAX_BLOCK_SIZE || (block_size & (block_size - 1)))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "kv: block_size %d is not supported (use a power of two from 1 to %d)",
                           block_size, KVF_KV_MAX_BLOCK_SIZE);
    if (kvf_dtype_size(dtype) == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: unknown KV dtype %d", (int)dtype);
    kvf_kv_layout l = {.n_layers = n_layers, .n_kv_heads = n_kv_heads, .head_dim = head_dim,
                       .block_size = block_size, .dtype = dtype};
    l.block_bytes = kvf_kv_bytes_per_token(&l) * block_size;
    *out = l;
    return KVF_OK;
}

kvf_status kvf_kv_layout_check_same(const kvf_kv_layout *a, const char *what_a,
                                    const kvf_kv_layout *b, const char *what_b, kvf_err *err)
{
#define KVF_LAYOUT_FIELD_(f)                                                                  \
    if (a->f != b->f)                                                                         \
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: layout " #f " differs: %d at %s, %d at %s", \
                           (int)a->f, what_a, (int)b->f, what_b);
    KVF_LAYOUT_FIELD_(block_size)
    KVF_LAYOUT_FIELD_(n_layers)
    KVF_LAYOUT_FIELD_(n_kv_heads)
    KVF_LAYOUT_FIELD_(head_dim)
#undef KVF_LAYOUT_FIELD_
    if (a->dtype != b->dtype)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: layout dtype differs: %s at %s, %s at %s",
                           kvf_dtype_name(a->dtype), what_a, kvf_dtype_name(b->dtype), what_b);
    return KVF_OK;
}
