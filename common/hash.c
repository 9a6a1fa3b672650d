/* hash.c: XXH3-64, inlined from the library header for speed. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/hash.h"

uint64_t kvf_hash64(const void *data, size_t len) { return XXH3_64bits(data, len); }

uint64_t kvf_hash64_seed(const void *data, size_t len, uint64_t seed)
{
    return XXH3_64bits_withSeed(data, len, seed);
}

uint64_t kvf_hash64_concat(const void *a, size_t a_len, const void *b, size_t b_len)
{
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    if (a_len)
        XXH3_64bits_update(&st, a, a_len);
    if (b_len)
        XXH3_64bits_update(&st, b, b_len);
    return XXH3_64bits_digest(&st);
}
