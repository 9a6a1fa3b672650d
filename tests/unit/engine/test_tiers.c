/* test_tiers.c: the engine over a pool with KV tiers (kv/tier.h) on tiny-gqa-f32: with a pool
 * too small to keep a prompt's prefix while another prompt runs, the second request for it
 * finds the prefix in the host tier (or, under a one-block host tier, on disk), promotes it and
 * produces the fixture's greedy tokens, the same as without tiers; and a corrupted disk tier is
 * a miss that still gives the right tokens. Invariants after every step (et_run's checker covers
 * the tiers); every block back in the pool at the end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kv/tier.h"
#include "testutil.h"
#include "enginetest.h"

#define BLOCK_BYTES 8192 /* tiny-gqa-f32: 2 layers x (K, V) x 2 heads x 16 tokens x 16 x 4 B */

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
    kvf_kv_tier_cfg tc = {.host_bytes = 64 * BLOCK_BYTES};
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
    kvf_kv_tier_cfg tc = {.host_bytes = BLOCK_BYTES, .disk_dir = dir, .disk_bytes = 1 << 20};
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
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.free_blocks + st.cached_blocks, 9);
    kvf_engine_destroy(e);
    kvf_kv_tier_destroy(t);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_tier_hit_same_tokens),
        cmocka_unit_test(test_disk_tier_hit_and_corruption),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
