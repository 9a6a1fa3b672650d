/* hash.c: the chained block hash. Tokens are hashed as little-endian u32; on a little-endian
 * host that is the int32_t array itself. */
#include "kv/hash.h"

#include <string.h>

#include "common/hash.h"

uint64_t kvf_kv_hash_root(const char *model_id, const void *salt, size_t salt_len)
{
    return kvf_hash64_concat(model_id, model_id ? strlen(model_id) : 0, salt, salt_len);
}

uint64_t kvf_kv_hash_block(uint64_t parent, const int32_t *tokens, int32_t block_size)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    uint32_t le[1024]; /* block_size <= KVF_KV_MAX_BLOCK_SIZE */
    for (int32_t i = 0; i < block_size; i++)
        le[i] = __builtin_bswap32((uint32_t)tokens[i]);
    return kvf_hash64_seed(le, (size_t)block_size * 4, parent);
#else
    return kvf_hash64_seed(tokens, (size_t)block_size * 4, parent);
#endif
}

size_t kvf_kv_hash_blocks(uint64_t parent, const int32_t *tokens, size_t n_tokens,
                          int32_t block_size, uint64_t *out)
{
    if (block_size <= 0)
        return 0;
    size_t n = n_tokens / (size_t)block_size;
    for (size_t i = 0; i < n; i++)
        parent = out[i] = kvf_kv_hash_block(parent, tokens + i * (size_t)block_size, block_size);
    return n;
}
