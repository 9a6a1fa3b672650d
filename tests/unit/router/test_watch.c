/* test_watch.c: the router's reader of WatchKv messages (router/watch.h's kvf_router_feed), fed
 * decoded messages as a worker with host and disk KV tiers sends them: snapshot parts in
 * different tiers, blocks moved between tiers by STORED events, REMOVED dropping them from every
 * tier, load reports carrying promotion prices, and approximate mode ignoring every event;
 * the index's counts per tier (/metrics) follow.
 * The streams themselves (gRPC) are tests/e2e's. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "common/log.h"
#include "router/http.h"
#include "router/watch.h"
#include "testutil.h"

#define BS 16

static uint64_t H(int i) { return 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1); }

static kvf_router_pool *make_pool(int n, bool approx)
{
    kvf_router_pool_cfg c;
    kvf_router_pool_cfg_default(&c);
    c.index.model = "m";
    c.load_bound = 0;
    c.approx = approx;
    kvf_router_pool *p;
    kvf_err err = {0};
    assert_int_equal(kvf_router_pool_create(&c, &p, &err), KVF_OK);
    for (int w = 0; w < n; w++)
        assert_int_equal(kvf_router_pool_worker_add(p, w, "m", BS, !approx, 0, &err), KVF_OK);
    return p;
}

/* One KV event of worker w: blocks [first, first + n) of the chain H, in tier. */
static kvf_status feed_event(kvf_router_feed *f, kvf_router_pool *p, int w, bool approx,
                             kvf_rpc_kv_event_kind kind, uint64_t seq, int first, int n, int tier,
                             bool done)
{
    uint64_t h[64], par[64];
    for (int i = 0; i < n; i++) {
        h[i] = H(first + i);
        par[i] = first + i ? H(first + i - 1) : 0;
    }
    kvf_rpc_watch_msg m = {.event = {.seq = seq, .kind = kind, .block_hashes = h,
                                     .parent_hashes = kind == KVF_RPC_KV_REMOVED ? NULL : par,
                                     .n = (size_t)n, .block_size = BS, .model_id = "m",
                                     .snapshot_done = done, .tier = tier}};
    kvf_err err = {0};
    return kvf_router_feed_apply(f, p, w, &m, approx, 0, &err);
}

static void feed_load(kvf_router_feed *f, kvf_router_pool *p, int w, bool approx, double host_s)
{
    kvf_rpc_watch_msg m = {.is_load = true, .load = {.total_blocks = 100, .host_promote_s_per_block = host_s}};
    kvf_err err = {0};
    assert_int_equal(kvf_router_feed_apply(f, p, w, &m, approx, 0, &err), KVF_OK);
}

static int tier(kvf_router_pool *p, int w, int i)
{
    return kvf_router_index_tier(kvf_router_pool_index(p), w, H(i));
}

/* (block, worker) pairs per tier in the index's stats (what /metrics exports). */
static void expect_pairs(kvf_router_pool *p, int64_t pool, int64_t host, int64_t disk)
{
    kvf_router_index_stats st;
    kvf_router_index_stats_get(kvf_router_pool_index(p), &st);
    if (st.n_pairs - st.n_pairs_host - st.n_pairs_disk != pool || st.n_pairs_host != host || st.n_pairs_disk != disk)
        fail_msg("pairs pool %lld host %lld disk %lld, want %lld %lld %lld",
                 (long long)(st.n_pairs - st.n_pairs_host - st.n_pairs_disk), (long long)st.n_pairs_host,
                 (long long)st.n_pairs_disk, (long long)pool, (long long)host, (long long)disk);
}

static int32_t pick(kvf_router_pool *p, int first, int n)
{
    uint64_t h[64];
    for (int i = 0; i < n; i++)
        h[i] = H(first + i);
    kvf_router_request rq = {.hashes = h, .n_blocks = (size_t)n, .n_tokens = (int64_t)n * BS + 3};
    kvf_router_decision d;
    kvf_err err = {0};
    assert_int_equal(kvf_router_pool_pick(p, &rq, 0, &d, &err), KVF_OK);
    return d.worker;
}

/* A snapshot in two parts (pool, then host) is applied once, each block in its part's tier; then
 * one block goes pool -> host -> pool -> disk -> removed, and the index follows each step. */
static void test_tier_moves(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(2, false);
    kvf_router_feed f = {0};
    assert_int_equal(feed_event(&f, p, 0, false, KVF_RPC_KV_SNAPSHOT, 10, 0, 4, KVF_RPC_TIER_POOL, false), KVF_OK);
    assert_false(f.synced);
    assert_int_equal(tier(p, 0, 0), -1); /* gathered, not yet applied */
    assert_int_equal(feed_event(&f, p, 0, false, KVF_RPC_KV_SNAPSHOT, 10, 4, 2, KVF_RPC_TIER_HOST, true), KVF_OK);
    assert_true(f.synced);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tier(p, 0, i), KVF_ROUTER_TIER_POOL);
    assert_int_equal(tier(p, 0, 4), KVF_ROUTER_TIER_HOST);
    assert_int_equal(tier(p, 0, 5), KVF_ROUTER_TIER_HOST);
    assert_int_equal(kvf_router_index_worker_blocks(kvf_router_pool_index(p), 0), 6);
    expect_pairs(p, 4, 2, 0);

    /* block 3: stored pool (held already: stays), host, pool, disk, removed */
    static const int steps[] = {KVF_RPC_TIER_POOL, KVF_RPC_TIER_HOST, KVF_RPC_TIER_POOL, KVF_RPC_TIER_DISK};
    uint64_t seq = 10;
    for (int s = 0; s < 4; s++) {
        assert_int_equal(feed_event(&f, p, 0, false, KVF_RPC_KV_STORED, ++seq, 3, 1, steps[s], false), KVF_OK);
        assert_int_equal(tier(p, 0, 3), steps[s]);
        assert_int_equal(kvf_router_index_worker_blocks(kvf_router_pool_index(p), 0), 6); /* moved, not added */
    }
    assert_int_equal(tier(p, 0, 2), KVF_ROUTER_TIER_POOL); /* its neighbours did not move */
    expect_pairs(p, 3, 2, 1);
    assert_int_equal(feed_event(&f, p, 0, false, KVF_RPC_KV_REMOVED, ++seq, 3, 1, 0, false), KVF_OK);
    assert_int_equal(tier(p, 0, 3), -1);
    assert_int_equal(kvf_router_index_lookup(kvf_router_pool_index(p), H(3)), 0);
    /* a block removed from the host tier is gone too */
    assert_int_equal(feed_event(&f, p, 0, false, KVF_RPC_KV_REMOVED, ++seq, 5, 1, 0, false), KVF_OK);
    assert_int_equal(tier(p, 0, 5), -1);
    assert_int_equal(kvf_router_index_worker_blocks(kvf_router_pool_index(p), 0), 4);
    expect_pairs(p, 3, 1, 0);
    /* a new block stored straight into the disk tier (a worker restoring it from disk) */
    assert_int_equal(feed_event(&f, p, 0, false, KVF_RPC_KV_STORED, ++seq, 20, 2, KVF_RPC_TIER_DISK, false), KVF_OK);
    assert_int_equal(tier(p, 0, 21), KVF_ROUTER_TIER_DISK);
    /* worker 1 holds its own tiers: the same hash in its pool leaves worker 0's copy on disk */
    assert_int_equal(feed_event(&f, p, 1, false, KVF_RPC_KV_SNAPSHOT, 1, 20, 2, KVF_RPC_TIER_POOL, true), KVF_OK);
    assert_int_equal(tier(p, 1, 21), KVF_ROUTER_TIER_POOL);
    assert_int_equal(tier(p, 0, 21), KVF_ROUTER_TIER_DISK);
    expect_pairs(p, 5, 1, 2);
    /* a tier the wire does not have is refused by name, the index unchanged */
    kvf_rpc_watch_msg bad = {.event = {.seq = seq + 1, .kind = KVF_RPC_KV_STORED, .block_hashes = (uint64_t[]){H(0)},
                                       .n = 1, .block_size = BS, .model_id = "m", .tier = 3}};
    kvf_err err = {0};
    assert_int_equal(kvf_router_feed_apply(&f, p, 0, &bad, false, 0, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "tier 3"));
    assert_int_equal(tier(p, 0, 0), KVF_ROUTER_TIER_POOL);
    /* ... and in a snapshot part, the parts gathered so far are dropped and a new stream asked for */
    assert_int_equal(feed_event(&f, p, 1, false, KVF_RPC_KV_SNAPSHOT, 5, 40, 2, KVF_RPC_TIER_POOL, false), KVF_OK);
    assert_int_equal(feed_event(&f, p, 1, false, KVF_RPC_KV_SNAPSHOT, 5, 42, 2, 9, false), KVF_ERR_STATE);
    assert_int_equal(f.snap_n, 0);
    /* a sequence gap asks for a new stream */
    assert_int_equal(feed_event(&f, p, 0, false, KVF_RPC_KV_STORED, seq + 5, 30, 1, 0, false), KVF_ERR_STATE);
    /* a cleared worker is an empty snapshot */
    assert_int_equal(feed_event(&f, p, 1, false, KVF_RPC_KV_CLEARED, 2, 0, 0, 0, false), KVF_OK);
    assert_int_equal(kvf_router_index_worker_blocks(kvf_router_pool_index(p), 1), 0);
    kvf_router_feed_fini(&f);
    kvf_router_pool_destroy(p);
}

/* Load reports carry the worker's own promotion price into the kv cost: a host-tier hit on a
 * worker that measured slow copies loses to recomputing elsewhere, and wins when they are fast. */
static void test_load_report_prices_tier_hits(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(2, false);
    kvf_router_feed f[2] = {{0}};
    assert_int_equal(feed_event(&f[0], p, 0, false, KVF_RPC_KV_SNAPSHOT, 1, 0, 30, KVF_RPC_TIER_HOST, true), KVF_OK);
    assert_int_equal(feed_event(&f[1], p, 1, false, KVF_RPC_KV_SNAPSHOT, 1, 0, 0, 0, true), KVF_OK);
    feed_load(&f[0], p, 0, false, 1e-2); /* 10 ms a block: 300 ms for the prefix */
    feed_load(&f[1], p, 1, false, 0);
    assert_true(f[0].have_load);
    assert_true(f[0].load.host_s_per_block == 1e-2);
    assert_int_equal(pick(p, 0, 30), 1);
    feed_load(&f[0], p, 0, false, 1e-6);
    feed_load(&f[1], p, 1, false, 0);
    assert_int_equal(pick(p, 0, 30), 0);
    kvf_router_feed_fini(&f[0]);
    kvf_router_feed_fini(&f[1]);
    kvf_router_pool_destroy(p);
}

/* Approximate mode: events are dropped unread (the index holds only the router's predictions),
 * load reports still count, and a worker's predictions are bounded by its capacity. */
static void test_approx_ignores_events(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(2, true);
    kvf_router_index *idx = kvf_router_pool_index(p);
    kvf_router_feed f[2] = {{0}};
    /* worker 1 says it holds blocks 0..29: ignored */
    assert_int_equal(feed_event(&f[1], p, 1, true, KVF_RPC_KV_SNAPSHOT, 1, 0, 30, 0, true), KVF_OK);
    assert_int_equal(feed_event(&f[1], p, 1, true, KVF_RPC_KV_STORED, 2, 0, 30, 0, false), KVF_OK);
    assert_int_equal(kvf_router_index_worker_blocks(idx, 1), 0);
    assert_false(f[1].synced);
    /* a gap is no gap: nothing is read */
    assert_int_equal(feed_event(&f[1], p, 1, true, KVF_RPC_KV_STORED, 99, 0, 30, 0, false), KVF_OK);
    feed_load(&f[0], p, 0, true, 0);
    feed_load(&f[1], p, 1, true, 0);
    assert_true(f[1].have_load);
    /* the first request goes where the sticky ring says; the router then predicts it there, and
     * the same prompt follows its prediction whatever worker 1's events said */
    int32_t first = pick(p, 0, 30);
    assert_int_equal(kvf_router_index_worker_blocks(idx, first), 30);
    assert_int_equal(kvf_router_index_worker_blocks(idx, 1 - first), 0);
    assert_int_equal(feed_event(&f[1 - first], p, 1 - first, true, KVF_RPC_KV_STORED, 3, 0, 30, 0, false), KVF_OK);
    assert_int_equal(kvf_router_index_worker_blocks(idx, 1 - first), 0);
    feed_load(&f[0], p, 0, true, 0);
    feed_load(&f[1], p, 1, true, 0);
    assert_int_equal(pick(p, 0, 30), first);
    /* workers of 8 blocks' capacity are predicted to hold at most 8 */
    kvf_err err = {0};
    assert_int_equal(kvf_router_pool_worker_capacity(p, 0, 8, &err), KVF_OK);
    assert_int_equal(kvf_router_pool_worker_capacity(p, 1, 8, &err), KVF_OK);
    assert_int_equal(kvf_router_index_worker_blocks(idx, first), 0); /* forgotten at the change */
    pick(p, 0, 30);
    assert_int_equal(kvf_router_index_worker_blocks(idx, 0) + kvf_router_index_worker_blocks(idx, 1), 8);
    assert_int_equal(kvf_router_pool_worker_capacity(p, 7, 8, &err), KVF_ERR_INVALID);
    kvf_router_feed_fini(&f[0]);
    kvf_router_feed_fini(&f[1]);
    kvf_router_pool_destroy(p);
}

/* The router's kv flags: defaults as documented, and each bad value refused naming its flag. */
/* A worker whose snapshot never ends (parts without snapshot_done) cannot grow the router
 * without bound: past 4 Mi gathered blocks the parts are dropped and a new snapshot is asked
 * for (STATE); a proper snapshot afterwards is applied as usual. */
static void test_snapshot_bounded(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(1, false);
    kvf_router_feed f = {0};
    size_t part = (size_t)1 << 20;
    uint64_t *h = malloc(part * sizeof *h), *par = calloc(part, sizeof *par);
    assert_non_null(h);
    assert_non_null(par);
    for (size_t i = 0; i < part; i++)
        h[i] = 0x1234567ull + i;
    kvf_err err = {0};
    kvf_status st = KVF_OK;
    int parts = 0;
    for (; parts < 6 && st == KVF_OK; parts++) {
        kvf_rpc_watch_msg m = {.event = {.seq = (uint64_t)parts, .kind = KVF_RPC_KV_SNAPSHOT, .block_hashes = h,
                                         .parent_hashes = par, .n = part, .block_size = BS, .model_id = "m"}};
        st = kvf_router_feed_apply(&f, p, 0, &m, false, 0, &err);
    }
    assert_int_equal(st, KVF_ERR_STATE);
    assert_int_equal(parts, 5); /* 4 parts fill the bound, the fifth passes it */
    assert_non_null(strstr(err.msg, "a new snapshot is asked for"));
    free(h);
    free(par);
    kvf_router_feed_fini(&f);
    kvf_router_pool_destroy(p);
}

static void test_kv_cfg_check(void **state)
{
    (void)state;
    kvf_router_kv_cfg c;
    kvf_router_kv_cfg_default(&c);
    kvf_err err = {0};
    assert_int_equal(kvf_router_kv_cfg_check(&c, &err), KVF_OK);
    assert_true(c.load_bound == 1.1 && c.load_window_s == 1800 && c.load_penalty == 0.5);
    assert_true(c.approx_ttl_s == 3600 && !c.approx);
    assert_true(c.host_s_per_block == 0.0001048576 && c.disk_s_per_block == 0.0004194304);
    struct { double *field, value; const char *msg; } bad[] = {
        {&c.load_bound, 0.5, "--load-bound=0.5"},        {&c.load_bound, -1, "--load-bound=-1"},
        {&c.load_window_s, 0, "--load-window=0"},        {&c.load_penalty, -0.1, "--load-penalty=-0.1"},
        {&c.host_s_per_block, -1, "--host-promote-s-per-block=-1"},
        {&c.disk_s_per_block, NAN, "--disk-promote-s-per-block=nan"},
        {&c.approx_ttl_s, 0, "--approx-ttl=0"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvf_router_kv_cfg_default(&c);
        *bad[i].field = bad[i].value;
        assert_int_equal(kvf_router_kv_cfg_check(&c, &err), KVF_ERR_INVALID);
        if (!strstr(err.msg, bad[i].msg))
            fail_msg("want '%s' in: %s", bad[i].msg, err.msg);
    }
    kvf_router_kv_cfg_default(&c);
    c.load_bound = 0; /* off */
    assert_int_equal(kvf_router_kv_cfg_check(&c, &err), KVF_OK);
}

int main(void)
{
    kvf_log_set_level(KVF_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tier_moves),
        cmocka_unit_test(test_load_report_prices_tier_hits),
        cmocka_unit_test(test_approx_ignores_events),
        cmocka_unit_test(test_kv_cfg_check),
        cmocka_unit_test(test_snapshot_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
