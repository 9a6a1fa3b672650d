/* test_hash.c: kv/hash.h: the chain (one changed token breaks that block and every later hash,
 * never an earlier one), salt isolation, partial blocks ignored, hash_blocks == chained
 * hash_block. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "kv/hash.h"

#define BS 16
#define NB 8

static void fill(int32_t *t, size_t n, int32_t seed)
{
    for (size_t i = 0; i < n; i++)
        t[i] = (int32_t)((i * 2654435761u + (uint32_t)seed) % 50000);
}

static void test_one_token_breaks_every_later_hash(void **state)
{
    int32_t a[NB * BS], b[NB * BS];
    uint64_t ha[NB], hb[NB];
    fill(a, NB * BS, 1);
    uint64_t root = kvf_kv_hash_root("llama", NULL, 0);
    assert_int_equal(kvf_kv_hash_blocks(root, a, NB * BS, BS, ha), NB);
    for (int k = 0; k < NB; k++) {
        for (int pos = 0; pos < BS; pos += 5) {
            memcpy(b, a, sizeof a);
            b[k * BS + pos] ^= 1;
            assert_int_equal(kvf_kv_hash_blocks(root, b, NB * BS, BS, hb), NB);
            for (int i = 0; i < NB; i++) {
                if (i < k)
                    assert_true(ha[i] == hb[i]);
                else
                    assert_true(ha[i] != hb[i]);
            }
        }
    }
}

static void test_salt_isolation(void **state)
{
    int32_t a[NB * BS];
    uint64_t h1[NB], h2[NB], h3[NB];
    fill(a, NB * BS, 7);
    uint64_t r0 = kvf_kv_hash_root("llama", NULL, 0);
    uint64_t r1 = kvf_kv_hash_root("llama", "tenant-a", 8);
    uint64_t r2 = kvf_kv_hash_root("llama", "tenant-b", 8);
    uint64_t r3 = kvf_kv_hash_root("mistral", NULL, 0);
    assert_true(r0 != r1 && r1 != r2 && r0 != r2 && r0 != r3);
    assert_true(r1 == kvf_kv_hash_root("llama", "tenant-a", 8)); /* deterministic */
    kvf_kv_hash_blocks(r1, a, NB * BS, BS, h1);
    kvf_kv_hash_blocks(r2, a, NB * BS, BS, h2);
    kvf_kv_hash_blocks(r0, a, NB * BS, BS, h3);
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < NB; j++)
            assert_true(h1[i] != h2[j] && h1[i] != h3[j] && h2[i] != h3[j]);
}

static void test_partial_blocks_and_chain(void **state)
{
    int32_t a[3 * BS + 5];
    uint64_t h[4] = {0, 0, 0, 0xdeadbeef};
    fill(a, 3 * BS + 5, 3);
    uint64_t root = kvf_kv_hash_root("m", "s", 1);
    assert_int_equal(kvf_kv_hash_blocks(root, a, 3 * BS + 5, BS, h), 3);
    assert_true(h[3] == 0xdeadbeef); /* the partial block is not hashed */
    assert_int_equal(kvf_kv_hash_blocks(root, a, BS - 1, BS, h), 0);
    kvf_kv_hash_blocks(root, a, 3 * BS, BS, h);
    uint64_t p = root;
    for (int i = 0; i < 3; i++) {
        p = kvf_kv_hash_block(p, a + i * BS, BS);
        assert_true(h[i] == p);
    }
    /* the same tokens at another depth hash differently (the hash names the whole prefix) */
    int32_t rep[2 * BS];
    memcpy(rep, a, BS * sizeof *a);
    memcpy(rep + BS, a, BS * sizeof *a);
    kvf_kv_hash_blocks(root, rep, 2 * BS, BS, h);
    assert_true(h[0] != h[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_token_breaks_every_later_hash),
        cmocka_unit_test(test_salt_isolation),
        cmocka_unit_test(test_partial_blocks_and_chain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
