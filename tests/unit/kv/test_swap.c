/* test_swap.c: kv/swap.h (bytes survive a round trip through the host tier while the pool is
 * reused, all-or-nothing in both directions, drop and free of a swapped sequence, a failing
 * device copy changes nothing) and that the invariant checkers catch corrupted state. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvtest.h"

#define BS 16

static void test_round_trip(void **state)
{
    kt_env e;
    kt_open(&e, 6, BS, 0);
    kvf_kv_pool *p = e.pool;
    kvf_kv_swap *sw = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_swap_create(p, 4, &sw, &err), KVF_OK);
    uint64_t root = kvf_kv_hash_root("m", NULL, 0);
    kvf_kv_seq a, b, big;
    kvf_kv_seq_init(&a, p, root);
    kvf_kv_seq_init(&b, p, root);
    kvf_kv_seq_init(&big, p, root);
    kvf_kv_seq *all[] = {&a, &b, &big};
    int32_t toks[40];
    kt_tokens(toks, 40, 1);
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 40, &err), KVF_OK);
    for (int64_t i = 0; i < 40; i++)
        *kt_slot(&a, i) = 0x5000 + (uint64_t)i;
    assert_int_equal(kvf_kv_seq_commit(&a, toks, 40, &err), KVF_OK);
    assert_int_equal(kvf_kv_swap_out(sw, &a, &err), KVF_OK);
    assert_int_equal(a.state, KVF_KV_SEQ_SWAPPED);
    assert_int_equal(a.n_tokens, 40);
    assert_int_equal(kvf_kv_swap_slots_free(sw), 1);
    kt_check(p, all, 3);
    assert_int_equal(kvf_kv_swap_check(sw, (const kvf_kv_seq *const *)all, 3, &err), KVF_OK);
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.cached, 2); /* its registered blocks stay cached */
    assert_int_equal(st.free, 4);
    /* a swapped sequence needs nothing in a step, cannot be written or swapped again */
    kvf_kv_seq *just_a[] = {&a};
    int64_t five[] = {5};
    assert_int_equal(kvf_kv_pool_step_need(p, just_a, five, 1), 0);
    assert_int_equal(kvf_kv_pool_alloc_step(p, just_a, five, 1, &err), KVF_ERR_STATE);
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 1, &err), KVF_ERR_STATE);
    assert_int_equal(kvf_kv_swap_out(sw, &a, &err), KVF_ERR_STATE);
    /* the pool is reused and overwritten */
    assert_int_equal(kvf_kv_seq_prepare_write(&b, 96, &err), KVF_OK);
    for (int64_t i = 0; i < 96; i++)
        *kt_slot(&b, i) = 0xBAD;
    kt_check(p, all, 3);
    /* the tier is too small for b: refused, nothing changes */
    assert_int_equal(kvf_kv_swap_out(sw, &b, &err), KVF_ERR_FULL);
    assert_non_null(strstr(err.msg, "6 blocks but only 1"));
    assert_int_equal(b.state, KVF_KV_SEQ_ACTIVE);
    /* the pool is too full to swap a back in: refused */
    assert_int_equal(kvf_kv_swap_in(sw, &a, &err), KVF_ERR_FULL);
    assert_int_equal(a.state, KVF_KV_SEQ_SWAPPED);
    assert_int_equal(kvf_kv_swap_check(sw, (const kvf_kv_seq *const *)all, 3, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_free(&b, &err), KVF_OK);
    assert_int_equal(kvf_kv_swap_in(sw, &a, &err), KVF_OK);
    assert_int_equal(a.state, KVF_KV_SEQ_ACTIVE);
    assert_int_equal(a.n_blocks, 3);
    assert_int_equal(a.n_hashed, 0);
    for (int64_t i = 0; i < 40; i++)
        assert_true(*kt_slot(&a, i) == 0x5000 + (uint64_t)i);
    assert_int_equal(kvf_kv_swap_slots_free(sw), 4);
    kt_check(p, all, 3);
    assert_int_equal(kvf_kv_swap_check(sw, (const kvf_kv_seq *const *)all, 3, &err), KVF_OK);
    /* committing again re-links the chain without new STORED events for cached hashes */
    int n_ev = e.n_ev;
    assert_int_equal(kvf_kv_seq_commit(&a, toks, 40, &err), KVF_OK);
    assert_int_equal(a.n_hashed, 2);
    assert_true(e.n_ev >= n_ev);
    kt_check(p, all, 3);
    /* swapping in a sequence that is not swapped is refused */
    assert_int_equal(kvf_kv_swap_in(sw, &a, &err), KVF_ERR_STATE);
    /* free and fini of a swapped sequence give its slots back */
    assert_int_equal(kvf_kv_swap_out(sw, &a, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_free(&a, &err), KVF_OK);
    assert_int_equal(a.state, KVF_KV_SEQ_RELEASED);
    assert_int_equal(kvf_kv_swap_slots_free(sw), 4);
    kvf_kv_seq c;
    kvf_kv_seq_init(&c, p, root);
    assert_int_equal(kvf_kv_seq_prepare_write(&c, 17, &err), KVF_OK);
    assert_int_equal(kvf_kv_swap_out(sw, &c, &err), KVF_OK);
    assert_int_equal(kvf_kv_swap_slots_free(sw), 2);
    kvf_kv_seq_fini(&c);
    assert_int_equal(kvf_kv_swap_slots_free(sw), 4);
    kvf_kv_seq_fini(&a);
    kvf_kv_seq_fini(&b);
    kvf_kv_seq_fini(&big);
    kvf_kv_swap_destroy(sw);
    kvf_kv_pool_destroy(p);
}

/* Memory ops whose copies fail after a countdown, to show a failed device copy changes
 * nothing. */
static int copies_left;
static kvf_status flaky_to_host(void *ctx, void *dst, const void *base, int64_t bb, int32_t b,
                                kvf_err *err)
{
    if (copies_left-- <= 0)
        return kvf_err_set(err, KVF_ERR_IO, "device copy failed");
    return kvf_kv_mem_host.to_host(ctx, dst, base, bb, b, err);
}
static kvf_status flaky_from_host(void *ctx, void *base, int64_t bb, int32_t b, const void *src,
                                  kvf_err *err)
{
    if (copies_left-- <= 0)
        return kvf_err_set(err, KVF_ERR_IO, "device copy failed");
    return kvf_kv_mem_host.from_host(ctx, base, bb, b, src, err);
}
static kvf_status flaky_copy(void *ctx, void *base, int64_t bb, int32_t d, int32_t s, kvf_err *err)
{
    if (copies_left-- <= 0)
        return kvf_err_set(err, KVF_ERR_IO, "device copy failed");
    return kvf_kv_mem_host.copy_block(ctx, base, bb, d, s, err);
}

static void test_failing_copies(void **state)
{
    kt_env e;
    memset(&e, 0, sizeof e);
    kvf_kv_mem_ops flaky = kvf_kv_mem_host;
    flaky.name = "flaky";
    flaky.to_host = flaky_to_host;
    flaky.from_host = flaky_from_host;
    flaky.copy_block = flaky_copy;
    kvf_kv_pool_cfg c = kt_cfg(&e, 6, BS);
    c.mem = &flaky;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_pool_create(&c, &e.pool, &err), KVF_OK);
    kvf_kv_pool *p = e.pool;
    kvf_kv_swap *sw;
    assert_int_equal(kvf_kv_swap_create(p, 6, &sw, &err), KVF_OK);
    kvf_kv_seq a, b;
    kvf_kv_seq_init(&a, p, 1);
    kvf_kv_seq_init(&b, p, 1);
    kvf_kv_seq *all[] = {&a, &b};
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 40, &err), KVF_OK);
    int32_t before[3] = {a.blocks[0], a.blocks[1], a.blocks[2]};
    copies_left = 2; /* the third block fails */
    assert_int_equal(kvf_kv_swap_out(sw, &a, &err), KVF_ERR_IO);
    assert_non_null(strstr(err.msg, "device copy failed"));
    assert_int_equal(a.state, KVF_KV_SEQ_ACTIVE);
    assert_memory_equal(a.blocks, before, sizeof before);
    assert_int_equal(kvf_kv_swap_slots_free(sw), 6);
    kt_check(p, all, 2);
    copies_left = 100;
    assert_int_equal(kvf_kv_swap_out(sw, &a, &err), KVF_OK);
    copies_left = 1;
    assert_int_equal(kvf_kv_swap_in(sw, &a, &err), KVF_ERR_IO);
    assert_int_equal(a.state, KVF_KV_SEQ_SWAPPED);
    assert_int_equal(kvf_kv_swap_slots_free(sw), 3);
    kt_check(p, all, 2);
    assert_int_equal(kvf_kv_swap_check(sw, (const kvf_kv_seq *const *)all, 2, &err), KVF_OK);
    copies_left = 100;
    assert_int_equal(kvf_kv_swap_in(sw, &a, &err), KVF_OK);
    /* a failed copy-on-write leaves the sequence and the co-owner as they were */
    assert_int_equal(kvf_kv_seq_fork(&a, &b, &err), KVF_OK);
    copies_left = 0;
    assert_int_equal(kvf_kv_seq_prepare_write(&b, 1, &err), KVF_ERR_IO);
    assert_int_equal(b.n_tokens, 40);
    assert_int_equal(b.blocks[2], a.blocks[2]);
    kt_check(p, all, 2);
    kvf_kv_seq_fini(&a);
    kvf_kv_seq_fini(&b);
    kvf_kv_swap_destroy(sw);
    kvf_kv_pool_destroy(p);
}

/* A sweep: the k-th device copy fails, for every k of a scenario of forks, copy-on-write and
 * swaps. Whatever fails, the invariants hold after each call and every block and host slot
 * returns when the sequences end. */
static void test_failing_copy_sweep(void **state)
{
    for (int k = 0; k < 40; k++) {
        kt_env e;
        memset(&e, 0, sizeof e);
        kvf_kv_mem_ops flaky = kvf_kv_mem_host;
        flaky.to_host = flaky_to_host;
        flaky.from_host = flaky_from_host;
        flaky.copy_block = flaky_copy;
        kvf_kv_pool_cfg c = kt_cfg(&e, 12, BS);
        c.mem = &flaky;
        kvf_err err = {0};
        assert_int_equal(kvf_kv_pool_create(&c, &e.pool, &err), KVF_OK);
        kvf_kv_pool *p = e.pool;
        kvf_kv_swap *sw;
        assert_int_equal(kvf_kv_swap_create(p, 8, &sw, &err), KVF_OK);
        kvf_kv_seq s[4];
        kvf_kv_seq *all[] = {&s[0], &s[1], &s[2], &s[3]};
        for (int i = 0; i < 4; i++)
            kvf_kv_seq_init(&s[i], p, 1);
        copies_left = k;
        int failures = 0;
        assert_int_equal(kvf_kv_seq_prepare_write(&s[0], 37, &err), KVF_OK);
        for (int round = 0; round < 6; round++) {
            kvf_status st;
            for (int i = 1; i < 4; i++)
                if (s[i].state == KVF_KV_SEQ_ACTIVE && s[i].n_blocks == 0 &&
                    s[0].state == KVF_KV_SEQ_ACTIVE)
                    assert_int_equal(kvf_kv_seq_fork(&s[0], &s[i], &err), KVF_OK);
            kt_check(p, all, 4);
            for (int i = 0; i < 4; i++) {
                if (s[i].state == KVF_KV_SEQ_ACTIVE) {
                    st = kvf_kv_seq_prepare_write(&s[i], 3, &err);
                    failures += st == KVF_ERR_IO;
                    assert_true(st == KVF_OK || st == KVF_ERR_IO || st == KVF_ERR_FULL);
                }
                kt_check(p, all, 4);
            }
            int v = round % 4;
            st = s[v].state == KVF_KV_SEQ_ACTIVE ? kvf_kv_swap_out(sw, &s[v], &err)
                                                 : kvf_kv_swap_in(sw, &s[v], &err);
            failures += st == KVF_ERR_IO;
            assert_true(st == KVF_OK || st == KVF_ERR_IO || st == KVF_ERR_FULL);
            kt_check(p, all, 4);
            assert_int_equal(kvf_kv_swap_check(sw, (const kvf_kv_seq *const *)all, 4, &err),
                             KVF_OK);
        }
        if (k < 10)
            assert_true(failures > 0); /* the early failures really happened */
        for (int i = 0; i < 4; i++)
            kvf_kv_seq_fini(&s[i]);
        kvf_kv_pool_stats st;
        kvf_kv_pool_get_stats(p, &st);
        assert_int_equal(st.used, 0);
        assert_int_equal(st.free + st.cached, 12);
        assert_int_equal(kvf_kv_swap_slots_free(sw), 8);
        kvf_kv_swap_destroy(sw);
        kvf_kv_pool_destroy(p);
    }
}

static void test_checker_catches_corruption(void **state)
{
    kt_env e;
    kt_open(&e, 6, BS, 0);
    kvf_kv_pool *p = e.pool;
    kvf_kv_seq a, b;
    kvf_err err = {0};
    kvf_kv_seq_init(&a, p, 1);
    kvf_kv_seq_init(&b, p, 1);
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 32, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_prepare_write(&b, 16, &err), KVF_OK);
    const kvf_kv_seq *both[] = {&a, &b}, *only_a[] = {&a};
    assert_int_equal(kvf_kv_check_invariants(p, both, 2, &err), KVF_OK);
    /* a live sequence left out: its block has a refcount nobody accounts for */
    assert_int_equal(kvf_kv_check_invariants(p, only_a, 1, &err), KVF_ERR_INTERNAL);
    assert_non_null(strstr(err.msg, "refcount 1 but 0 block tables"));
    /* a table naming another block */
    int32_t keep = a.blocks[1];
    a.blocks[1] = b.blocks[0];
    assert_int_equal(kvf_kv_check_invariants(p, both, 2, &err), KVF_ERR_INTERNAL);
    a.blocks[1] = 5; /* a free block */
    assert_int_equal(kvf_kv_check_invariants(p, both, 2, &err), KVF_ERR_INTERNAL);
    a.blocks[1] = 77;
    assert_int_equal(kvf_kv_check_invariants(p, both, 2, &err), KVF_ERR_INTERNAL);
    assert_non_null(strstr(err.msg, "foreign block 77"));
    a.blocks[1] = keep;
    /* token count and table size disagreeing */
    a.n_tokens = 33;
    assert_int_equal(kvf_kv_check_invariants(p, both, 2, &err), KVF_ERR_INTERNAL);
    a.n_tokens = 32;
    assert_int_equal(kvf_kv_check_invariants(p, both, 2, &err), KVF_OK);
    /* the swap checker: a slot claimed by two sequences */
    kvf_kv_swap *sw;
    assert_int_equal(kvf_kv_swap_create(p, 4, &sw, &err), KVF_OK);
    assert_int_equal(kvf_kv_swap_out(sw, &a, &err), KVF_OK);
    const kvf_kv_seq *sa[] = {&a};
    assert_int_equal(kvf_kv_swap_check(sw, sa, 1, &err), KVF_OK);
    const kvf_kv_seq *none[] = {NULL};
    assert_int_equal(kvf_kv_swap_check(sw, none, 0, &err), KVF_ERR_INTERNAL);
    kvf_kv_seq twin = a;
    const kvf_kv_seq *twice[] = {&a, &twin};
    assert_int_equal(kvf_kv_swap_check(sw, twice, 2, &err), KVF_ERR_INTERNAL);
    assert_non_null(strstr(err.msg, "held twice"));
    assert_int_equal(kvf_kv_swap_check(sw, sa, 1, &err), KVF_OK); /* scratch left clean */
    kvf_kv_seq_fini(&a);
    kvf_kv_seq_fini(&b);
    kvf_kv_swap_destroy(sw);
    kvf_kv_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_failing_copies),
        cmocka_unit_test(test_failing_copy_sweep),
        cmocka_unit_test(test_checker_catches_corruption),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
