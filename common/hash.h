/* hash.h: kvfleet's one non-cryptographic hash, XXH3-64 (xxHash). Block hashing on top of it
 * lives in kv/hash.h; this file only wraps the library so nobody else includes xxhash.h. */
#ifndef KVF_COMMON_HASH_H
#define KVF_COMMON_HASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t kvf_hash64(const void *data, size_t len);
uint64_t kvf_hash64_seed(const void *data, size_t len, uint64_t seed);
/* XXH3-64 of the concatenation a || b, without copying. */
uint64_t kvf_hash64_concat(const void *a, size_t a_len, const void *b, size_t b_len);

#endif
