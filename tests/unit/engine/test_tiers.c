/* test_tiers.c: the engine over a pool with KV tiers (kv/tier.h) on tiny-gqa-f32: with a pool
 * too small to keep a prompt's prefix while another prompt runs, the second request for it
 * finds the prefix in the host tier (or, under a one-block host tier, on disk), promotes it and
 * produces the fixture's greedy tokens, the same as without tiers; and a corrupted disk tier is
 * a miss that still gives the right tokens: found by the copy thread (the default), the
 * sequence's prefix is cut at the bad block. While one sequence's promotions are held on the copy
 * thread, another keeps producing tokens (the overlap). The same runs synchronous. Invariants
 * after every step (et_run's checker covers the tiers); every block back in the pool at the end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kv/tier.h"
#include "testutil.h"
#include "enginetest.h"

#define BLOCK_BYTES 8192 /* tiny-gqa-f32: 2 layers x (K, V) x 2 heads x 16 tokens x 16 x 4 B */

/* The copy thread waits here before each copy while the gate is closed (at most 10 s, so a
 * broken variant fails instead of hanging). */
static bool g_sync; /* this round's tiers promote synchronously */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static bool g_closed;

static void gate_hook(void *ctx, kvf_kv_tier_kind tier, int32_t block)
{
    (void)ctx, (void)tier, (void)block;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 10;
    pthread_mutex_lock(&g_mu);
    while (g_closed && pthread_cond_timedwait(&g_cv, &g_mu, &ts) == 0) {
    }
    pthread_mutex_unlock(&g_mu);
}

static void gate_set(bool closed)
{
    pthread_mutex_lock(&g_mu);
    g_closed = closed;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

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

/* Runs one greedy request to completion on e and checks its tokens against the fixture. */
static void run_case(kvf_engine *e, uint64_t id, const et_fixture *f, const et_case *c,
                     const char *what)
{
    int32_t out[64], n;
    kvf_engine_finish fin;
    kvf_err err = {0};
    kvf_engine_request q = et_req(id, c->prompt, c->n_prompt, f->n_new);
    if (kvf_engine_generate(e, &q, out, 64, &n, &fin, &err) != KVF_OK)
        fail_msg("%s: %s", what, err.msg);
    et_assert_tokens(what, out, n, c->greedy, f->n_new);
    if (kvf_engine_check(e, &err) != KVF_OK)
        fail_msg("%s: %s", what, err.msg);
}

/* b, then hundred (which pushes most of b's blocks out of the 9-block pool), with `forty` too
 * (which pushes out the rest) when `more`, then b again. Returns the prefix tokens the second b
 * found. */
static int64_t b_h_b(const et_fixture *f, kvf_kv_tier *tier, bool more)
{
    const et_case *b = et_find(f, "shared-prefix-b"), *h = et_find(f, "hundred");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 9;
    cfg.kv_tier = tier;
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_engine_stats st;
    run_case(e, 1, f, b, "b, cold");
    run_case(e, 2, f, h, "hundred");
    if (more)
        run_case(e, 4, f, et_find(f, "forty"), "forty");
    kvf_engine_get_stats(e, &st);
    int64_t before = st.prefix_hit_tokens;
    run_case(e, 3, f, b, "b, again");
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.free_blocks + st.cached_blocks, 9);
    kvf_engine_destroy(e);
    return st.prefix_hit_tokens - before;
}

static void test_host_tier_hit_same_tokens(void **state)
{
    et_fixture *f = *state;
    /* without tiers only b's first block is left in the pool; the second is recomputed */
    assert_int_equal(b_h_b(f, NULL, false), 16);
    assert_int_equal(b_h_b(f, NULL, true), 0);
    kvf_kv_layout l;
    kvf_err err = {0};
    assert_int_equal(kvf_model_kv_layout(f->m, 16, KVF_DTYPE_F32, &l, &err), KVF_OK);
    assert_int_equal(l.block_bytes, BLOCK_BYTES);
    kvf_kv_tier_cfg tc = {.host_bytes = 64 * BLOCK_BYTES, .synchronous = g_sync};
    kvf_kv_tier *t = NULL;
    assert_int_equal(kvf_kv_tier_create(&tc, &l, &t, &err), KVF_OK);
    /* with a host tier: b's two full prompt blocks are found, the second from the tier */
    assert_int_equal(b_h_b(f, t, false), 32);
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(t, &ts);
    assert_true(ts.tier[KVF_KV_TIER_HOST].promoted >= 1);
    assert_true(ts.tier[KVF_KV_TIER_HOST].demoted >= 2);
    /* and both from it when the pool kept neither */
    assert_int_equal(b_h_b(f, t, true), 32);
    kvf_kv_tier_get_stats(t, &ts);
    assert_true(ts.tier[KVF_KV_TIER_HOST].promoted >= 3);
    kvf_kv_tier_destroy(t);
}

static void test_disk_tier_hit_and_corruption(void **state)
{
    et_fixture *f = *state;
    kvf_kv_layout l;
    kvf_err err = {0};
    assert_int_equal(kvf_model_kv_layout(f->m, 16, KVF_DTYPE_F32, &l, &err), KVF_OK);
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvf-etier-XXXXXX");
    assert_non_null(mkdtemp(dir));
    kvf_kv_tier_cfg tc = {.host_bytes = BLOCK_BYTES, .disk_dir = dir, .disk_bytes = 1 << 20,
                          .synchronous = g_sync};
    kvf_kv_tier *t = NULL;
    assert_int_equal(kvf_kv_tier_create(&tc, &l, &t, &err), KVF_OK);
    assert_int_equal(b_h_b(f, t, true), 32);
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(t, &ts);
    assert_true(ts.tier[KVF_KV_TIER_DISK].promoted >= 1);
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].corrupt, 0);
    kvf_kv_tier_destroy(t);

    /* the same, with every disk write damaged behind the tier's back before b comes again:
     * each disk hit is refused, b is recomputed, the tokens stay right */
    assert_int_equal(kvf_kv_tier_create(&tc, &l, &t, &err), KVF_OK);
    const et_case *b = et_find(f, "shared-prefix-b"), *h = et_find(f, "hundred");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 9;
    cfg.kv_tier = t;
    kvf_engine *e = et_engine(f->m, &cfg);
    run_case(e, 1, f, b, "b, cold");
    run_case(e, 2, f, h, "hundred");
    run_case(e, 4, f, et_find(f, "forty"), "forty");
    int fd = open(kvf_kv_tier_disk_path(t), O_RDWR);
    assert_true(fd >= 0);
    int64_t sb = kvf_kv_tier_disk_slot_bytes(t);
    struct stat st_;
    assert_int_equal(fstat(fd, &st_), 0);
    assert_true(st_.st_size >= sb);
    for (int64_t off = sb - 100; off < st_.st_size; off += sb) {
        unsigned char c = 0;
        assert_int_equal(pread(fd, &c, 1, off), 1);
        c ^= 1;
        assert_int_equal(pwrite(fd, &c, 1, off), 1);
    }
    close(fd);
    run_case(e, 3, f, b, "b, after the disk was damaged");
    kvf_kv_tier_get_stats(t, &ts);
    assert_true(ts.tier[KVF_KV_TIER_DISK].corrupt >= 1);
    /* the copy thread found it after the lookup took the block: b's prefix was cut there */
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(kvf_engine_pool(e), &ps);
    assert_true(g_sync ? ps.promote_failed == 0 : ps.promote_failed >= 1);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.free_blocks + st.cached_blocks, 9);
    kvf_engine_destroy(e);
    kvf_kv_tier_destroy(t);
    rmdir(dir);
}

/* (e) b's prefix comes from the host tier while its copies are held on the copy thread: b is
 * admitted (promoting) and `forty`, admitted with it, produces tokens step after step before
 * any of b's copies completes; then b runs; both give the fixture's tokens. */
static void test_promotion_overlaps_compute(void **state)
{
    et_fixture *f = *state;
    kvf_kv_layout l;
    kvf_err err = {0};
    assert_int_equal(kvf_model_kv_layout(f->m, 16, KVF_DTYPE_F32, &l, &err), KVF_OK);
    kvf_kv_tier_cfg tc = {.host_bytes = 64 * BLOCK_BYTES, .copy_hook = gate_hook};
    kvf_kv_tier *t = NULL;
    assert_int_equal(kvf_kv_tier_create(&tc, &l, &t, &err), KVF_OK);
    const et_case *b = et_find(f, "shared-prefix-b"), *h = et_find(f, "hundred"),
                  *fo = et_find(f, "forty");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 9;
    cfg.kv_tier = t;
    kvf_engine *e = et_engine(f->m, &cfg);
    run_case(e, 1, f, b, "b, cold");
    run_case(e, 2, f, h, "hundred");
    run_case(e, 4, f, fo, "forty");
    gate_set(true);
    kvf_engine_request qf = et_req(5, fo->prompt, fo->n_prompt, f->n_new);
    kvf_engine_request qb = et_req(6, b->prompt, b->n_prompt, f->n_new);
    et_add(e, &qf);
    et_add(e, &qb);
    et_result r;
    memset(&r, 0, sizeof r);
    int32_t steps = 0;
    kvf_engine_stats st;
    /* forty's first tokens while b waits for its copies */
    while (r.n[5] < 3) {
        const kvf_engine_output *o;
        int32_t n;
        if (kvf_engine_step(e, &o, &n, &err) != KVF_OK)
            fail_msg("step %d: %s", steps, err.msg);
        for (int32_t i = 0; i < n; i++) {
            assert_int_not_equal(o[i].id, 6); /* b has computed nothing */
            et_collect(&r, &o[i], 1);
        }
        if (kvf_engine_check(e, &err) != KVF_OK)
            fail_msg("after step %d: %s", steps, err.msg);
        kvf_engine_get_stats(e, &st);
        assert_int_equal(st.promoting, 1);
        assert_true(++steps < 50);
    }
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(kvf_engine_pool(e), &ps);
    assert_int_equal(ps.promoting, 2); /* both of b's prefix blocks, still on their way */
    gate_set(false);
    et_run(e, &r, 1);
    et_assert_tokens("forty, beside b's promotion", r.tokens[5], r.n[5], fo->greedy, f->n_new);
    et_assert_tokens("b, after its promotion", r.tokens[6], r.n[6], b->greedy, f->n_new);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.promoting, 0);
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(t, &ts);
    assert_true(ts.tier[KVF_KV_TIER_HOST].promoted >= 2);
    kvf_kv_pool_get_stats(kvf_engine_pool(e), &ps);
    assert_int_equal(ps.free + ps.cached, 9);
    kvf_engine_destroy(e);
    kvf_kv_tier_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_tier_hit_same_tokens),
        cmocka_unit_test(test_disk_tier_hit_and_corruption),
        cmocka_unit_test(test_promotion_overlaps_compute),
    };
    const struct CMUnitTest sync_tests[] = {
        cmocka_unit_test(test_host_tier_hit_same_tokens),
        cmocka_unit_test(test_disk_tier_hit_and_corruption),
    };
    int rc = cmocka_run_group_tests_name("copy thread", tests, setup, teardown);
    g_sync = true;
    rc |= cmocka_run_group_tests_name("synchronous", sync_tests, setup, teardown);
    return rc;
}
