/* test_policy.c: the routing policies: the kv cost (prefix vs load, busy limits, tie-breaks,
 * softmax), the online prefill fit, round-robin, least-loaded, sticky with bounded load and
 * session keys, the sticky fallback, approximate mode with its TTL and size bound, and picking
 * prefill and decode workers separately. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "router/policy.h"
#include "testutil.h"

#define BS 16

static uint64_t H(int chain, int i) { return (uint64_t)chain * 1000003u + (uint64_t)i * 7919u + 1; }

static kvf_router_pool *make_pool(kvf_router_policy pol, int n, bool events, void (*tweak)(kvf_router_pool_cfg *))
{
    kvf_router_pool_cfg c;
    kvf_router_pool_cfg_default(&c);
    c.index.model = "m";
    c.policy = pol;
    if (tweak)
        tweak(&c);
    kvf_router_pool *p;
    kvf_err err = {0};
    assert_int_equal(kvf_router_pool_create(&c, &p, &err), KVF_OK);
    for (int w = 0; w < n; w++)
        assert_int_equal(kvf_router_pool_worker_add(p, w, "m", BS, events, 0, &err), KVF_OK);
    return p;
}

/* Worker w reports the first n blocks of chain in tier (moved there if it held them). */
static void hold_tier(kvf_router_pool *p, int w, int chain, int n, int tier)
{
    static uint64_t seq[64];
    uint64_t h[256];
    for (int i = 0; i < n; i++)
        h[i] = H(chain, i);
    kvf_router_event ev = {.kind = KVF_ROUTER_EV_STORED, .worker = w, .seq = ++seq[w], .model = "m",
                           .block_size = BS, .hashes = h, .n = (size_t)n, .tier = tier};
    kvf_err err = {0};
    assert_int_equal(kvf_router_index_apply(kvf_router_pool_index(p), &ev, 0, &err), KVF_OK);
}

/* Worker w reports it holds the first n blocks of chain. */
static void hold(kvf_router_pool *p, int w, int chain, int n)
{
    hold_tier(p, w, chain, n, KVF_ROUTER_TIER_POOL);
}

static void load(kvf_router_pool *p, int w, int64_t queued, double decode)
{
    kvf_router_load l = {.queued_prefill_tokens = queued, .decode_load = decode};
    kvf_router_pool_load_set(p, w, &l, 0);
}

static kvf_router_decision pick(kvf_router_pool *p, int chain, int n_blocks, const char *session);

/* Every worker reports an empty queue, then a pick. */
static kvf_router_decision pick_idle(kvf_router_pool *p, int n_workers, int chain, int n_blocks,
                                     const char *session)
{
    for (int w = 0; w < n_workers; w++)
        load(p, w, 0, 0);
    return pick(p, chain, n_blocks, session);
}

static kvf_router_decision pick(kvf_router_pool *p, int chain, int n_blocks, const char *session)
{
    static uint64_t h[256];
    for (int i = 0; i < n_blocks; i++)
        h[i] = H(chain, i);
    kvf_router_request rq = {.hashes = h, .n_blocks = (size_t)n_blocks,
                             .n_tokens = (int64_t)n_blocks * BS + 5, .session_key = session};
    kvf_router_decision d;
    kvf_err err = {0};
    assert_int_equal(kvf_router_pool_pick(p, &rq, 0, &d, &err), KVF_OK);
    return d;
}

static void test_kv_prefers_longest_prefix_then_load(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 4, true, NULL);
    hold(p, 1, 7, 100);
    hold(p, 2, 7, 40);
    for (int w = 0; w < 4; w++)
        load(p, w, 0, 0);
    kvf_router_decision d = pick(p, 7, 120, NULL);
    assert_int_equal(d.worker, 1);
    assert_int_equal(d.overlap_blocks, 100);
    assert_true(d.cached_tokens == 1600.0);
    assert_int_equal(d.reason, KVF_ROUTER_BY_COST);
    /* a long queue on the holder outweighs its cache: 100 blocks saved = 1600 tokens, while
     * 200k queued tokens at weight 0.25 cost 50k tokens' time */
    load(p, 1, 200000, 0);
    load(p, 2, 0, 0);
    d = pick(p, 7, 120, NULL);
    assert_int_equal(d.worker, 2);
    kvf_router_pool_destroy(p);
}

static void limit_tweak(kvf_router_pool_cfg *c) { c->busy_queued_tokens = 10000; }

static void test_saturated_worker_skipped_rest_route_by_prefix(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 4, true, limit_tweak);
    hold(p, 0, 3, 50);
    hold(p, 1, 3, 30);
    hold(p, 2, 3, 10);
    load(p, 0, 20000, 0); /* at its limit */
    for (int w = 1; w < 4; w++)
        load(p, w, 0, 0);
    kvf_router_decision d = pick(p, 3, 60, NULL);
    assert_int_equal(d.worker, 1); /* the next best prefix, not the least loaded */
    assert_false(d.all_busy);
    /* per-worker limits: worker 0 with a small queue wins by its longer prefix ... */
    kvf_router_pool_worker_limits(p, 0, 0, 0);
    load(p, 0, 600, 0);
    load(p, 1, 0, 0);
    assert_int_equal(pick(p, 3, 60, NULL).worker, 0);
    /* ... until its own limit says it is saturated */
    kvf_router_pool_worker_limits(p, 0, 500, 0);
    load(p, 0, 600, 0);
    load(p, 1, 0, 0);
    assert_int_equal(pick(p, 3, 60, NULL).worker, 1);
    /* everyone busy: still an answer, flagged */
    for (int w = 0; w < 4; w++)
        kvf_router_pool_worker_limits(p, w, 1, 0), load(p, w, 5, 0);
    d = pick(p, 3, 60, NULL);
    assert_true(d.all_busy);
    assert_int_equal(d.worker, 0);
    kvf_router_pool_destroy(p);
}

/* These cases pick one request many times with no time passing and nothing computed: the
 * bounded-load rule would rightly spread them, so it is off where the cost itself is tested. */
static void unbounded_tweak(kvf_router_pool_cfg *c) { c->load_bound = 0; }

static void test_ties_by_load_then_random(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 3, true, unbounded_tweak);
    hold(p, 0, 5, 20);
    hold(p, 1, 5, 20);
    hold(p, 2, 5, 20);
    int seen[3] = {0};
    for (int i = 0; i < 300; i++)
        seen[pick_idle(p, 3, 5, 20, NULL).worker]++;
    for (int w = 0; w < 3; w++)
        assert_true(seen[w] > 50); /* random among equals */
    /* equal cost, unequal load: worker 0 saves one more block (16 tokens) but has 64 tokens
     * queued at weight 0.25; worker 2 is idle: the tie goes to the lower load */
    hold(p, 0, 6, 21);
    hold(p, 2, 6, 20);
    for (int i = 0; i < 20; i++) {
        load(p, 0, 64, 0);
        load(p, 1, 100000, 0);
        load(p, 2, 0, 0);
        assert_int_equal(pick(p, 6, 30, NULL).worker, 2);
    }
    kvf_router_pool_destroy(p);
}

static void temp_tweak(kvf_router_pool_cfg *c) { c->temperature = 10.0; }

static void test_softmax_temperature_spreads(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 2, true, temp_tweak);
    hold(p, 0, 9, 30);
    hold(p, 1, 9, 1);
    int seen[2] = {0};
    for (int i = 0; i < 400; i++) {
        load(p, 0, 0, 0);
        load(p, 1, 0, 0);
        seen[pick(p, 9, 30, NULL).worker]++;
    }
    /* cost gap is 29 blocks x 16 tokens x 5e-5 s = 0.023 s << 10 s: nearly a coin flip */
    assert_true(seen[0] > 120 && seen[1] > 120);
    kvf_router_pool_destroy(p);
}

static void test_prefill_fit_learns_a_and_b(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 1, true, NULL);
    for (int i = 0; i < 500; i++) {
        int64_t tok = 100 + (i * 7919) % 20000;
        kvf_router_pool_prefill_report(p, tok, 0.1 + 2e-4 * (double)tok);
    }
    double a, b;
    kvf_router_pool_prefill_model(p, &a, &b);
    assert_true(a > 0.099 && a < 0.101);
    assert_true(b > 1.99e-4 && b < 2.01e-4);
    kvf_router_pool_destroy(p);
}

static void test_round_robin_and_least_loaded(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_ROUND_ROBIN, 3, true, limit_tweak);
    int order[6];
    for (int i = 0; i < 6; i++)
        order[i] = pick(p, i, 4, NULL).worker;
    for (int i = 0; i < 6; i++)
        assert_int_equal(order[i], i % 3);
    load(p, 1, 50000, 0); /* busy: skipped */
    for (int i = 0; i < 4; i++)
        assert_int_not_equal(pick(p, i, 4, NULL).worker, 1);
    kvf_router_pool_destroy(p);

    p = make_pool(KVF_ROUTER_POLICY_LEAST_LOADED, 3, true, NULL);
    load(p, 0, 5000, 0);
    load(p, 1, 100, 0);
    load(p, 2, 100, 4);
    assert_int_equal(pick(p, 1, 4, NULL).worker, 1);
    kvf_router_pool_destroy(p);
}

static void test_sticky_consistent_bounded_and_session(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_STICKY, 8, true, NULL);
    int first[20];
    for (int c = 0; c < 20; c++)
        first[c] = pick_idle(p, 8, c, 80, NULL).worker;
    int distinct = 0;
    for (int c = 0; c < 20; c++) {
        assert_int_equal(pick_idle(p, 8, c, 80, NULL).worker, first[c]); /* same prefix, same worker */
        distinct |= 1 << first[c];
    }
    assert_true(__builtin_popcount((unsigned)distinct) >= 4); /* chains spread over the ring */
    /* prompts differing only after the sticky prefix (64 blocks) stick together */
    assert_int_equal(pick_idle(p, 8, 3, 64, NULL).worker, first[3]);
    /* bounded load: the ring's choice is skipped while far above the mean */
    for (int w = 0; w < 8; w++)
        load(p, w, 0, 0);
    load(p, first[3], 1000000, 0);
    assert_int_not_equal(pick(p, 3, 80, NULL).worker, first[3]);
    /* a session key overrides the prompt */
    int s = pick_idle(p, 8, 1, 10, "user-42").worker;
    for (int c = 0; c < 10; c++)
        assert_int_equal(pick_idle(p, 8, c, 10, "user-42").worker, s);
    /* a worker that leaves is never chosen again */
    kvf_router_pool_worker_remove(p, s);
    for (int c = 0; c < 10; c++)
        assert_int_not_equal(pick_idle(p, 8, c, 10, "user-42").worker, s);
    kvf_router_pool_destroy(p);
}

static void test_kv_falls_back_to_sticky_when_index_is_empty(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 8, true, unbounded_tweak);
    kvf_router_decision d = pick_idle(p, 8, 11, 70, NULL);
    assert_int_equal(d.reason, KVF_ROUTER_BY_STICKY);
    int w = d.worker;
    for (int i = 0; i < 5; i++)
        assert_int_equal(pick_idle(p, 8, 11, 70, NULL).worker, w);
    hold(p, (w + 1) % 8, 11, 70);
    d = pick_idle(p, 8, 11, 70, NULL);
    assert_int_equal(d.reason, KVF_ROUTER_BY_COST);
    assert_int_equal(d.worker, (w + 1) % 8);
    kvf_router_pool_destroy(p);
}

static void approx_tweak(kvf_router_pool_cfg *c)
{
    c->approx_ttl_s = 50;
    c->approx_max_blocks = 100;
}

static void test_approximate_mode_ttl_and_bound(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 4, false, approx_tweak);
    static uint64_t h[80];
    for (int i = 0; i < 80; i++)
        h[i] = H(21, i);
    kvf_router_request rq = {.hashes = h, .n_blocks = 80, .n_tokens = 80 * BS};
    kvf_router_decision d1, d2;
    kvf_err err = {0};
    assert_int_equal(kvf_router_pool_pick(p, &rq, 0, &d1, &err), KVF_OK);
    assert_int_equal(d1.overlap_blocks, 0);
    /* the router remembers its own decision; another worker gets a load bump so the
     * second pick could go elsewhere if the prediction were not used */
    assert_int_equal(kvf_router_index_worker_blocks(kvf_router_pool_index(p), d1.worker), 80);
    assert_int_equal(kvf_router_pool_pick(p, &rq, 10, &d2, &err), KVF_OK);
    assert_int_equal(d2.worker, d1.worker);
    assert_int_equal(d2.overlap_blocks, 80);
    /* size bound: a second 80-block prompt on the same worker evicts the oldest predictions */
    for (int i = 0; i < 80; i++)
        h[i] = H(22, i);
    kvf_router_pool_worker_remove(p, (d1.worker + 1) % 4);
    kvf_router_pool_worker_remove(p, (d1.worker + 2) % 4);
    kvf_router_pool_worker_remove(p, (d1.worker + 3) % 4);
    assert_int_equal(kvf_router_pool_pick(p, &rq, 20, &d2, &err), KVF_OK);
    assert_int_equal(kvf_router_index_worker_blocks(kvf_router_pool_index(p), d1.worker), 100);
    /* TTL 50 s: at 60 the blocks touched at 10 and 20 are still believed */
    assert_int_equal(kvf_router_pool_pick(p, &rq, 60, &d2, &err), KVF_OK);
    assert_int_equal(d2.overlap_blocks, 80);
    /* at 200 everything (last touched at 60) is forgotten */
    for (int i = 0; i < 80; i++)
        h[i] = H(23, i);
    assert_int_equal(kvf_router_pool_pick(p, &rq, 200, &d2, &err), KVF_OK);
    assert_int_equal(d2.overlap_blocks, 0);
    /* only the 80 blocks of the last decision remain */
    assert_int_equal(kvf_router_index_worker_blocks(kvf_router_pool_index(p), d1.worker), 80);
    kvf_router_pool_destroy(p);
}

static void test_prefill_and_decode_chosen_separately(void **state)
{
    (void)state;
    kvf_router_pool *pre = make_pool(KVF_ROUTER_POLICY_KV, 3, true, NULL);
    kvf_router_pool *dec = make_pool(KVF_ROUTER_POLICY_KV, 3, true, NULL);
    hold(pre, 2, 4, 50);
    hold(dec, 0, 4, 50);
    static uint64_t h[50];
    for (int i = 0; i < 50; i++)
        h[i] = H(4, i);
    kvf_router_request rq = {.hashes = h, .n_blocks = 50, .n_tokens = 800};
    kvf_router_decision pd, dd;
    kvf_err err = {0};
    assert_int_equal(kvf_router_pick_disagg(pre, dec, &rq, 0, &pd, &dd, &err), KVF_OK);
    assert_int_equal(pd.worker, 2);
    assert_int_equal(dd.worker, 0);
    kvf_router_pool_destroy(pre);
    kvf_router_pool_destroy(dec);
}

static void test_bad_config_and_parse(void **state)
{
    (void)state;
    kvf_router_policy pol;
    kvf_err err = {0};
    assert_int_equal(kvf_router_policy_parse("least-loaded", &pol, &err), KVF_OK);
    assert_int_equal(pol, KVF_ROUTER_POLICY_LEAST_LOADED);
    assert_int_equal(kvf_router_policy_parse("random", &pol, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'random'"));
    assert_non_null(strstr(err.msg, "round-robin"));
    kvf_router_pool_cfg c;
    kvf_router_pool_cfg_default(&c);
    c.index.model = "m";
    c.prefill_b_s = 0;
    kvf_router_pool *p;
    assert_int_equal(kvf_router_pool_create(&c, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "b=0"));
    p = make_pool(KVF_ROUTER_POLICY_KV, 0, true, NULL);
    static uint64_t h[1] = {1};
    kvf_router_request rq = {.hashes = h, .n_blocks = 1, .n_tokens = 16};
    kvf_router_decision d;
    assert_int_equal(kvf_router_pool_pick(p, &rq, 0, &d, &err), KVF_ERR_NOT_FOUND);
    assert_int_equal(kvf_router_pool_worker_add(p, 0, "m", 32, true, 0, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block size"));
    kvf_router_pool_destroy(p);
}

/* A hot prefix held by one worker: without the bound every request goes there (its hits are
 * cheapest); with it, the holder's computed tokens pass the line, the prefix is copied to other
 * workers (they hold it from then on), and no worker computes far more than the mean. */
static void test_bounded_load_spreads_a_hot_prefix(void **state)
{
    (void)state;
    for (int bounded = 0; bounded < 2; bounded++) {
        kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 4, true, bounded ? NULL : unbounded_tweak);
        hold(p, 0, 1, 40);
        bool holds[4] = {true, false, false, false};
        double computed[4] = {0};
        for (int i = 0; i < 400; i++) {
            /* the hot prefix (40 blocks) and 10 more blocks each time */
            kvf_router_decision d = pick_idle(p, 4, 1, 50, NULL);
            computed[d.worker] += (double)(50 * BS + 5) - d.cached_tokens;
            if (!holds[d.worker]) {
                hold(p, d.worker, 1, 40);
                holds[d.worker] = true;
            }
        }
        double sum = 0, mx = 0;
        for (int w = 0; w < 4; w++)
            sum += computed[w], mx = computed[w] > mx ? computed[w] : mx;
        if (bounded) {
            int n_holders = holds[0] + holds[1] + holds[2] + holds[3];
            assert_true(n_holders >= 3);
            assert_true(mx * 4 / sum <= 1.25);
        } else {
            assert_true(computed[0] == sum);
        }
        kvf_router_pool_destroy(p);
    }
}

static void slow_disk_tweak(kvf_router_pool_cfg *c) { c->disk_s_per_block = 1e-3; }

/* A cached prefix in a lower tier costs its promotion: a pool hit beats a host hit, a host hit
 * beats a disk hit, a disk hit beats a miss while its copy is cheaper than the prefill, and
 * loses to it when the disk is slower than computing. */
static void test_tier_hit_priced_by_promotion(void **state)
{
    (void)state;
    for (int slow = 0; slow < 2; slow++) {
        kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 3, true,
                                       slow ? slow_disk_tweak : unbounded_tweak);
        kvf_router_index *idx = kvf_router_pool_index(p);
        hold(p, 0, 2, 30);
        hold(p, 1, 2, 30);
        hold_tier(p, 1, 2, 30, KVF_ROUTER_TIER_HOST);
        assert_int_equal(kvf_router_index_tier(idx, 1, H(2, 7)), KVF_ROUTER_TIER_HOST);
        assert_int_equal(kvf_router_index_tier(idx, 0, H(2, 7)), KVF_ROUTER_TIER_POOL);
        assert_int_equal(kvf_router_index_tier(idx, 2, H(2, 7)), -1);
        assert_true(kvf_router_index_has_tiers(idx));
        if (!slow)
            assert_int_equal(pick_idle(p, 3, 2, 30, NULL).worker, 0);
        hold_tier(p, 1, 3, 30, KVF_ROUTER_TIER_HOST);
        hold_tier(p, 2, 3, 30, KVF_ROUTER_TIER_DISK);
        if (!slow)
            assert_int_equal(pick_idle(p, 3, 3, 30, NULL).worker, 1);
        /* worker 2: 20 blocks on disk, then 10 in its pool would break the order; keep it
         * plain: a disk-only holder against misses */
        hold_tier(p, 2, 4, 30, KVF_ROUTER_TIER_DISK);
        uint32_t ov[KVF_ROUTER_MAX_WORKERS], host[KVF_ROUTER_MAX_WORKERS], disk[KVF_ROUTER_MAX_WORKERS];
        uint64_t h[30];
        for (int i = 0; i < 30; i++)
            h[i] = H(4, i);
        kvf_router_index_overlap(idx, h, 30, 7, ov);
        kvf_router_index_overlap_tiers(idx, h, 7, ov, host, disk);
        assert_int_equal(ov[2], 30);
        assert_int_equal(disk[2], 30);
        assert_int_equal(host[2], 0);
        int w = pick_idle(p, 3, 4, 30, NULL).worker;
        if (slow)
            assert_int_not_equal(w, 2);
        else
            assert_int_equal(w, 2);
        /* a mixed prompt: pool head, host middle, disk tail */
        hold(p, 0, 5, 30);
        hold_tier(p, 0, 5, 20, KVF_ROUTER_TIER_HOST);
        hold_tier(p, 0, 5, 10, KVF_ROUTER_TIER_POOL);
        uint64_t tail[10];
        for (int i = 0; i < 10; i++)
            tail[i] = H(5, 20 + i);
        kvf_router_event ev = {.kind = KVF_ROUTER_EV_STORED, .worker = 0, .seq = 5000000,
                               .model = "m", .block_size = BS, .hashes = tail, .n = 10,
                               .tier = KVF_ROUTER_TIER_DISK};
        kvf_err err = {0};
        kvf_router_index_worker_clear(idx, 1); /* not part of this check */
        assert_int_not_equal(kvf_router_index_apply(idx, &ev, 0, &err), KVF_OK); /* a gap */
        kvf_router_index_worker_clear(idx, 0);
        ev.kind = KVF_ROUTER_EV_SNAPSHOT;
        uint64_t all[30];
        uint8_t tiers[30];
        for (int i = 0; i < 30; i++)
            all[i] = H(5, i), tiers[i] = i < 10 ? 0 : i < 20 ? 1 : 2;
        ev.hashes = all;
        ev.n = 30;
        ev.tiers = tiers;
        assert_int_equal(kvf_router_index_apply(idx, &ev, 0, &err), KVF_OK);
        kvf_router_index_overlap(idx, all, 30, 1, ov);
        kvf_router_index_overlap_tiers(idx, all, 1, ov, host, disk);
        assert_int_equal(ov[0], 30);
        assert_int_equal(host[0], 10);
        assert_int_equal(disk[0], 10);
        /* a bad tier is refused by name */
        tiers[3] = 7;
        assert_int_equal(kvf_router_index_apply(idx, &ev, 0, &err), KVF_ERR_INVALID);
        assert_non_null(strstr(err.msg, "tier 7"));
        kvf_router_pool_destroy(p);
    }
}

/* Every worker reports an idle load with its host promotion price (0: the pool's), then a pick. */
static int32_t pick_priced(kvf_router_pool *p, const double *host_s, int n_workers, int chain, int n_blocks)
{
    for (int w = 0; w < n_workers; w++) {
        kvf_router_load l = {.host_s_per_block = host_s[w]};
        kvf_router_pool_load_set(p, w, &l, 0);
    }
    return pick(p, chain, n_blocks, NULL).worker;
}

/* A worker's own measured promotion time prices its tier hits (issue 22): a host hit reported
 * slow (10 ms a block) loses to a miss and to a host hit reported fast, and wins once its own
 * report is fast; a report of 0 (or a bad number) goes back to the pool's default. */
static void test_tier_hit_priced_per_worker(void **state)
{
    (void)state;
    kvf_router_pool *p = make_pool(KVF_ROUTER_POLICY_KV, 3, true, unbounded_tweak);
    hold_tier(p, 1, 6, 30, KVF_ROUTER_TIER_HOST);
    /* worker 1 alone holds it: at the default price (3 ms for 30 blocks) its hit beats a miss
     * (about 24 ms of prefill) */
    assert_int_equal(pick_priced(p, (double[]){0, 0, 0}, 3, 6, 30), 1);
    /* reported 10 ms a block: 300 ms of copies, more than recomputing elsewhere */
    int32_t w = pick_priced(p, (double[]){0, 1e-2, 0}, 3, 6, 30);
    assert_int_not_equal(w, 1);
    /* a NaN or negative report is no price: the default again */
    assert_int_equal(pick_priced(p, (double[]){0, NAN, 0}, 3, 6, 30), 1);
    assert_int_equal(pick_priced(p, (double[]){0, -1, 0}, 3, 6, 30), 1);
    /* worker 2 also holds it in host memory: the cheaper reported promotion wins */
    hold_tier(p, 2, 6, 30, KVF_ROUTER_TIER_HOST);
    assert_int_equal(pick_priced(p, (double[]){0, 1e-2, 1e-5}, 3, 6, 30), 2);
    assert_int_equal(pick_priced(p, (double[]){0, 1e-6, 1e-5}, 3, 6, 30), 1);
    /* and against the pool's default: slower than it loses, faster wins */
    assert_int_equal(pick_priced(p, (double[]){0, 1e-3, 0}, 3, 6, 30), 2);
    assert_int_equal(pick_priced(p, (double[]){0, 1e-6, 0}, 3, 6, 30), 1);
    /* a pool hit beats even a fast host hit */
    hold_tier(p, 0, 6, 30, KVF_ROUTER_TIER_POOL);
    assert_int_equal(pick_priced(p, (double[]){0, 1e-9, 1e-9}, 3, 6, 30), 0);
    kvf_router_pool_destroy(p);
}

int main(void)
{
    kvf_log_set_level(KVF_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_prefers_longest_prefix_then_load),
        cmocka_unit_test(test_saturated_worker_skipped_rest_route_by_prefix),
        cmocka_unit_test(test_ties_by_load_then_random),
        cmocka_unit_test(test_softmax_temperature_spreads),
        cmocka_unit_test(test_prefill_fit_learns_a_and_b),
        cmocka_unit_test(test_round_robin_and_least_loaded),
        cmocka_unit_test(test_sticky_consistent_bounded_and_session),
        cmocka_unit_test(test_kv_falls_back_to_sticky_when_index_is_empty),
        cmocka_unit_test(test_approximate_mode_ttl_and_bound),
        cmocka_unit_test(test_prefill_and_decode_chosen_separately),
        cmocka_unit_test(test_bad_config_and_parse),
        cmocka_unit_test(test_bounded_load_spreads_a_hot_prefix),
        cmocka_unit_test(test_tier_hit_priced_by_promotion),
        cmocka_unit_test(test_tier_hit_priced_per_worker),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
