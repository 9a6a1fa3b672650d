/* test_hold.c: the blocks of a given-up remote prefill (kvf_engine_hold) on tiny-gqa-f32: they
 * are never handed out (a "late writer" scribbling over them after every step leaves a local
 * request's greedy tokens exact, and another remote request gets other ids), never registered,
 * come back on kvf_engine_release_held and on the deadline (in a step, or through
 * kvf_engine_release_expired), make a request that needs them wait instead of failing, keep
 * prefix-cache hits cached, and leak nothing (invariants after every step, destroy while held). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kv/hash.h"
#include "testutil.h"
#include "enginetest.h"

static int setup(void **state)
{
    *state = et_open("tiny-gqa-f32");
    return 0;
}

static int teardown(void **state)
{
    et_close(*state);
    return 0;
}

/* The late writer: overwrites blocks ids[0..n) of e's pool with a pattern that wrecks any
 * attention that reads them (0x7f bytes: f32 values near 3.4e38). */
static void scribble(kvf_engine *e, const int32_t *ids, int32_t n)
{
    kvf_kv_pool *pool = kvf_engine_pool(e);
    int64_t bb = kvf_kv_pool_layout(pool)->block_bytes;
    for (int32_t i = 0; i < n; i++)
        memset((char *)kvf_kv_pool_base(pool) + (int64_t)ids[i] * bb, 0x7f, (size_t)bb);
}

static void check(kvf_engine *e)
{
    kvf_err err = {0};
    if (kvf_engine_check(e, &err) != KVF_OK)
        fail_msg("%s", err.msg);
}

/* One step; its outputs go to r (may be NULL); returns how many there were. */
static int32_t step(kvf_engine *e, et_result *r)
{
    const kvf_engine_output *o;
    int32_t n;
    kvf_err err = {0};
    if (kvf_engine_step(e, &o, &n, &err) != KVF_OK)
        fail_msg("step: %s", err.msg);
    for (int32_t i = 0; r && i < n; i++)
        et_collect(r, &o[i], 1);
    check(e);
    return n;
}

static int32_t pool_used(kvf_engine *e)
{
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(kvf_engine_pool(e), &ps);
    return ps.used;
}

static void add_remote(kvf_engine *e, uint64_t id, const et_case *k, int32_t *ids, int32_t *n_ids,
                       int64_t *cached)
{
    kvf_engine_request q = et_req(id, k->prompt, k->n_prompt, 24);
    kvf_err err = {0};
    if (kvf_engine_add_remote(e, &q, ids, 16, n_ids, cached, &err) != KVF_OK)
        fail_msg("add_remote: %s", err.msg);
}

static void test_held_blocks_not_handed_out(void **state)
{
    et_fixture *f = *state;
    const et_case *a = et_find(f, "hundred"), *b = et_find(f, "forty"), *c = et_find(f, "seventeen");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 16;
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_err err = {0};
    int32_t ids_a[16], n_a, nb = 0;
    int64_t cached;
    add_remote(e, 1, a, ids_a, &n_a, &cached);
    assert_int_equal(n_a, 7);
    assert_int_equal(cached, 0);

    /* decode gives up on A while its writer may still write */
    assert_int_equal(kvf_engine_hold(e, 1, INT64_MAX, &nb, &err), KVF_OK);
    assert_int_equal(nb, 7);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.held, 1);
    assert_int_equal(st.held_blocks, 7);
    assert_int_equal(st.remote, 0);
    assert_int_equal(pool_used(e), 7);
    check(e);
    /* a held request is not cancelled, finished remotely or held twice */
    assert_int_equal(kvf_engine_cancel(e, 1, &err), KVF_ERR_NOT_FOUND);
    assert_int_equal(kvf_engine_remote_done(e, 1, a->greedy[0], &err), KVF_ERR_NOT_FOUND);
    assert_int_equal(kvf_engine_hold(e, 1, INT64_MAX, NULL, &err), KVF_ERR_NOT_FOUND);
    /* its cancellation is reported once, then the engine is idle though blocks are held */
    assert_true(kvf_engine_busy(e));
    et_result *r = calloc(1, sizeof *r);
    assert_int_equal(step(e, r), 1);
    assert_int_equal(r->finish[1], KVF_ENGINE_FINISH_CANCELLED);
    assert_int_equal(r->n[1], 0);
    assert_false(kvf_engine_busy(e));
    assert_int_equal(pool_used(e), 7);

    /* B runs locally while the late writer keeps writing A's blocks: B's tokens stay exact */
    kvf_engine_request qb = et_req(2, b->prompt, b->n_prompt, f->n_new);
    et_add(e, &qb);
    int32_t steps = 0;
    while (kvf_engine_busy(e)) {
        step(e, r);
        scribble(e, ids_a, n_a);
        assert_true(++steps < 1000);
    }
    et_assert_tokens("B beside held blocks", r->tokens[2], r->n[2], b->greedy, f->n_new);
    /* another remote request gets none of the held ids */
    int32_t ids_c[16], n_c;
    add_remote(e, 3, c, ids_c, &n_c, &cached);
    for (int32_t i = 0; i < n_c; i++)
        for (int32_t j = 0; j < n_a; j++)
            assert_int_not_equal(ids_c[i], ids_a[j]);
    assert_int_equal(kvf_engine_cancel(e, 3, &err), KVF_OK);
    step(e, NULL);
    /* nothing of A was registered */
    uint64_t root = kvf_kv_hash_root("", NULL, 0);
    assert_int_equal(kvf_kv_prefix_probe(kvf_engine_pool(e), root, a->prompt, a->n_prompt), 0);

    /* the writer answered: every held block comes back, once */
    assert_int_equal(kvf_engine_release_held(e, 1, &nb, &err), KVF_OK);
    assert_int_equal(nb, 7);
    assert_int_equal(kvf_engine_release_held(e, 1, &nb, &err), KVF_ERR_NOT_FOUND);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.held, 0);
    assert_int_equal(st.held_blocks, 0);
    assert_int_equal(pool_used(e), 0);
    assert_int_equal(st.free_blocks + st.cached_blocks, st.total_blocks);
    assert_int_equal(kvf_kv_prefix_probe(kvf_engine_pool(e), root, a->prompt, a->n_prompt), 0);
    check(e);
    assert_false(kvf_engine_busy(e));
    free(r);
    kvf_engine_destroy(e);
}

static void test_hold_deadline(void **state)
{
    et_fixture *f = *state;
    const et_case *a = et_find(f, "forty");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_err err = {0};
    int32_t ids[16], n;
    int64_t cached;
    kvf_engine_stats st;
    /* an explicit clock: released at until_ns, not before */
    add_remote(e, 1, a, ids, &n, &cached);
    assert_int_equal(kvf_engine_hold(e, 1, 1000, NULL, &err), KVF_OK);
    assert_int_equal(kvf_engine_release_expired(e, 999), 0);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.held, 1);
    assert_int_equal(kvf_engine_release_expired(e, 1000), 1);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.held, 0);
    assert_int_equal(pool_used(e), 0);
    assert_int_equal(kvf_engine_release_held(e, 1, NULL, &err), KVF_ERR_NOT_FOUND);
    et_result *r = calloc(1, sizeof *r);
    step(e, r); /* the cancellation is still reported */
    assert_int_equal(r->finish[1], KVF_ENGINE_FINISH_CANCELLED);
    /* a deadline already past: the next step releases it */
    add_remote(e, 4, a, ids, &n, &cached);
    assert_int_equal(kvf_engine_hold(e, 4, 0, NULL, &err), KVF_OK);
    assert_int_equal(pool_used(e), n);
    step(e, r);
    assert_int_equal(r->finish[4], KVF_ENGINE_FINISH_CANCELLED);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.held, 0);
    assert_int_equal(pool_used(e), 0);
    /* INT64_MAX releases everything (shutdown) */
    add_remote(e, 5, a, ids, &n, &cached);
    assert_int_equal(kvf_engine_hold(e, 5, INT64_MAX - 1, NULL, &err), KVF_OK);
    assert_int_equal(kvf_engine_release_expired(e, INT64_MAX), 1);
    assert_int_equal(pool_used(e), 0);
    step(e, NULL);
    /* holding what is not a waiting remote request is refused */
    assert_int_equal(kvf_engine_hold(e, 77, INT64_MAX, NULL, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "77"));
    kvf_engine_request q = et_req(6, a->prompt, a->n_prompt, 4);
    et_add(e, &q);
    assert_int_equal(kvf_engine_hold(e, 6, INT64_MAX, NULL, &err), KVF_ERR_NOT_FOUND);
    et_run(e, r, 1);
    /* destroyed while a hold is live: freed with the engine (the sanitizer build sees leaks) */
    add_remote(e, 7, a, ids, &n, &cached);
    assert_int_equal(kvf_engine_hold(e, 7, INT64_MAX, NULL, &err), KVF_OK);
    check(e);
    free(r);
    kvf_engine_destroy(e);
}

static void test_hold_waiter_and_prefix_hits(void **state)
{
    et_fixture *f = *state;
    const et_case *a = et_find(f, "hundred"), *b = et_find(f, "forty");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 8;
    cfg.swap_slots = 0;
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_err err = {0};
    int32_t ids[16], n;
    int64_t cached;
    /* A holds 7 of 8 blocks; B (3 blocks to start) must wait for them, not fail */
    add_remote(e, 1, a, ids, &n, &cached);
    assert_int_equal(kvf_engine_hold(e, 1, INT64_MAX, NULL, &err), KVF_OK);
    kvf_engine_request qb = et_req(2, b->prompt, b->n_prompt, f->n_new);
    et_add(e, &qb);
    et_result *r = calloc(1, sizeof *r);
    for (int i = 0; i < 5; i++)
        step(e, r);
    assert_int_equal(r->finish[2], KVF_ENGINE_FINISH_NONE);
    assert_int_equal(r->n[2], 0);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.waiting, 1);
    assert_true(kvf_engine_busy(e));
    assert_int_equal(kvf_engine_release_held(e, 1, NULL, &err), KVF_OK);
    et_run(e, r, 1);
    et_assert_tokens("B after the held blocks came back", r->tokens[2], r->n[2], b->greedy, f->n_new);
    kvf_engine_destroy(e);

    /* a held request's prefix-cache hits are shared, registered blocks: they stay cached */
    et_cfg(&cfg);
    e = et_engine(f->m, &cfg);
    memset(r, 0, sizeof *r);
    kvf_engine_request qa = et_req(3, a->prompt, a->n_prompt, 1);
    et_add(e, &qa);
    et_run(e, r, 1);
    add_remote(e, 4, a, ids, &n, &cached);
    assert_int_equal(n, 7);
    assert_int_equal(cached, 96);
    assert_int_equal(kvf_engine_hold(e, 4, INT64_MAX, NULL, &err), KVF_OK);
    check(e);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.held_blocks, 7);
    assert_int_equal(kvf_engine_release_held(e, 4, NULL, &err), KVF_OK);
    step(e, NULL);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(pool_used(e), 0);
    assert_int_equal(st.cached_blocks, 6);
    uint64_t root = kvf_kv_hash_root("", NULL, 0);
    assert_int_equal(kvf_kv_prefix_probe(kvf_engine_pool(e), root, a->prompt, a->n_prompt), 6);
    free(r);
    kvf_engine_destroy(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_held_blocks_not_handed_out),
        cmocka_unit_test(test_hold_deadline),
        cmocka_unit_test(test_hold_waiter_and_prefix_hits),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
