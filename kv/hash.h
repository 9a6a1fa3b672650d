/* hash.h: block hashing, one function shared by the router and the workers (DESIGN.md s.3).
 *   h[-1] = XXH3_64(model_id || cache_salt)
 *   h[i]  = XXH3_64_withSeed(tokens[i*bs .. (i+1)*bs) as little-endian u32, seed = h[i-1])
 * Only full blocks are hashed; a hash names its whole prefix. */
#ifndef KVF_KV_HASH_H
#define KVF_KV_HASH_H

#include <stddef.h>
#include <stdint.h>

/* The per-fleet root h[-1]. salt may be NULL when salt_len is 0. */
uint64_t kvf_kv_hash_root(const char *model_id, const void *salt, size_t salt_len);

/* The hash of one full block of block_size tokens chained on parent. */
uint64_t kvf_kv_hash_block(uint64_t parent, const int32_t *tokens /* [block_size] */,
                           int32_t block_size);

/* Hashes every full block of tokens chained from parent into out and returns how many:
 * n_tokens / block_size. out must hold that many. */
size_t kvf_kv_hash_blocks(uint64_t parent, const int32_t *tokens /* [n_tokens] */,
                          size_t n_tokens, int32_t block_size, uint64_t *out);

#endif
