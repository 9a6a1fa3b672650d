/* test_index.c: the router's KV index against a brute-force reference over random event
 * streams, sequence-gap recovery, removal of a dead worker, refusal of foreign events, and the
 * decay of a silent worker's trust. */
#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "common/log.h"
#include "router/index.h"
#include "testutil.h"

#define U 3000 /* hash universe of the random tests */
#define NW 12  /* workers in the random tests (ids spread over 0..63) */

static uint64_t rng_state = 12345;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Hash number i of the universe; number 0 is the hash value 0 (a legal XXH3 output). */
static uint64_t uh(int i) { return i == 0 ? 0 : (uint64_t)i * 0x9E3779B97F4A7C15ull ^ 0xabcdef; }

static kvf_router_index *make(int64_t expected)
{
    kvf_router_index_cfg c;
    kvf_router_index_cfg_default(&c);
    c.model = "m";
    c.expected_blocks = expected;
    kvf_router_index *idx;
    kvf_err err = {0};
    assert_int_equal(kvf_router_index_create(&c, &idx, &err), KVF_OK);
    return idx;
}

static kvf_router_event ev_of(kvf_router_event_kind k, int32_t w, uint64_t seq, const uint64_t *h,
                              size_t n)
{
    return (kvf_router_event){.kind = k, .worker = w, .seq = seq, .model = "m", .block_size = 16,
                              .hashes = h, .n = n};
}

/* Compares every hash of the universe, the counts, and overlaps of random chains. */
static void check_against(kvf_router_index *idx, uint8_t ref[64][U], uint64_t present)
{
    int64_t blocks = 0, pairs = 0;
    for (int i = 0; i < U; i++) {
        uint64_t want = 0;
        for (int w = 0; w < 64; w++)
            if (ref[w][i])
                want |= 1ull << w;
        assert_true(kvf_router_index_lookup(idx, uh(i)) == want);
        blocks += want != 0;
        pairs += __builtin_popcountll(want);
    }
    kvf_router_index_stats st;
    kvf_router_index_stats_get(idx, &st);
    assert_int_equal(st.n_blocks, blocks);
    assert_int_equal(st.n_pairs, pairs);
    for (int t = 0; t < 20; t++) {
        /* a chain made of blocks some worker holds, broken at a random point, so overlaps
         * are long and differ between workers */
        uint64_t chain[60];
        int cix[60], n = 0, w0 = (int)(rnd() % 64), start = (int)(rnd() % U);
        int len = 1 + (int)(rnd() % 60);
        for (int k = 0; k < U && n < len; k++) {
            int i = (start + k) % U;
            if (ref[w0][i] || rnd() % 50 == 0)
                cix[n++] = i;
        }
        for (int k = 0; k < n; k++)
            chain[k] = uh(cix[k]);
        uint32_t ov[KVF_ROUTER_MAX_WORKERS];
        uint64_t mask = rnd() | present;
        size_t best = kvf_router_index_overlap(idx, chain, (size_t)n, mask, ov);
        size_t want_best = 0;
        for (int w = 0; w < 64; w++) {
            uint32_t want = 0;
            if ((mask & present) >> w & 1) {
                while ((int)want < n && ref[w][cix[want]])
                    want++;
            }
            assert_int_equal(ov[w], want);
            if (want > want_best)
                want_best = want;
        }
        assert_int_equal(best, want_best);
    }
}

static void test_random_streams_match_reference(void **state)
{
    (void)state;
    static uint8_t ref[64][U];
    memset(ref, 0, sizeof ref);
    kvf_router_index *idx = make(0); /* starts small: the table must grow */
    int32_t ids[NW];
    for (int k = 0; k < NW; k++)
        ids[k] = k * 5 + (k == NW - 1 ? 8 : 0); /* includes 63 */
    uint64_t seq[64] = {0}, present = 0;
    kvf_err err = {0};
    for (int k = 0; k < NW; k++) {
        assert_int_equal(kvf_router_index_worker_add(idx, ids[k], "m", 16, 0, &err), KVF_OK);
        present |= 1ull << ids[k];
    }
    uint64_t h[256];
    int ix[256];
    for (int step = 0; step < 3000; step++) {
        int32_t w = ids[rnd() % NW];
        uint64_t r = rnd() % 100;
        if (!(present >> w & 1)) {
            assert_int_equal(kvf_router_index_worker_add(idx, w, "m", 16, step, &err), KVF_OK);
            present |= 1ull << w;
            seq[w] = 0;
        }
        if (r < 55 || r >= 60) {
            /* stored (or removed when r >= 60): runs of hashes, sometimes repeated */
            bool add = r < 55 || r >= 85;
            size_t n = 1 + rnd() % 256;
            for (size_t k = 0; k < n; k++)
                h[k] = uh(ix[k] = (int)(add ? rnd() % U : rnd() % 400));
            kvf_router_event ev = ev_of(add ? KVF_ROUTER_EV_STORED : KVF_ROUTER_EV_REMOVED, w,
                                        ++seq[w], h, n);
            assert_int_equal(kvf_router_index_apply(idx, &ev, step, &err), KVF_OK);
            for (size_t k = 0; k < n; k++)
                ref[w][ix[k]] = add;
        } else if (r < 57) {
            /* a snapshot replaces everything the worker had */
            size_t n = rnd() % 200;
            for (size_t k = 0; k < n; k++)
                h[k] = uh(ix[k] = (int)(rnd() % U));
            seq[w] = 1000 + rnd() % 1000;
            kvf_router_event ev = ev_of(KVF_ROUTER_EV_SNAPSHOT, w, seq[w], h, n);
            assert_int_equal(kvf_router_index_apply(idx, &ev, step, &err), KVF_OK);
            memset(ref[w], 0, U);
            for (size_t k = 0; k < n; k++)
                ref[w][ix[k]] = 1;
        } else if (r < 59) {
            kvf_router_index_worker_remove(idx, w);
            memset(ref[w], 0, U);
            present &= ~(1ull << w);
        } else {
            /* a duplicate (old seq) changes nothing */
            h[0] = uh(ix[0] = (int)(rnd() % U));
            kvf_router_event ev = ev_of(KVF_ROUTER_EV_STORED, w, seq[w], h, 1);
            assert_int_equal(kvf_router_index_apply(idx, &ev, step, &err), KVF_OK);
            if (!seq[w])
                ref[w][ix[0]] = 1; /* no event seen yet: the first delta sets the base */
        }
        if (step % 100 == 99)
            check_against(idx, ref, present);
    }
    check_against(idx, ref, present);
    kvf_router_index_stats st;
    kvf_router_index_stats_get(idx, &st);
    assert_true(st.bytes_per_block > 16.0); /* at least a slot a block */
    assert_true(st.bytes_per_block < 400.0);
    kvf_router_index_destroy(idx);
}

static void test_gap_asks_for_resync_and_snapshot_recovers(void **state)
{
    (void)state;
    kvf_router_index *idx = make(100);
    kvf_err err = {0};
    uint64_t a[3] = {uh(1), uh(2), uh(3)}, b[2] = {uh(7), uh(8)};
    assert_int_equal(kvf_router_index_worker_add(idx, 3, "m", 16, 0, &err), KVF_OK);
    kvf_router_event e1 = ev_of(KVF_ROUTER_EV_STORED, 3, 1, a, 3);
    assert_int_equal(kvf_router_index_apply(idx, &e1, 0, &err), KVF_OK);
    kvf_router_event e2 = ev_of(KVF_ROUTER_EV_REMOVED, 3, 2, a + 2, 1);
    assert_int_equal(kvf_router_index_apply(idx, &e2, 0, &err), KVF_OK);
    assert_true(kvf_router_index_lookup(idx, uh(3)) == 0);
    /* seq 4 after 2: a gap */
    kvf_router_event e4 = ev_of(KVF_ROUTER_EV_STORED, 3, 4, b, 2);
    assert_int_equal(kvf_router_index_apply(idx, &e4, 1, &err), KVF_ERR_STATE);
    assert_non_null(strstr(err.msg, "resync"));
    assert_int_equal(kvf_router_index_worker_state(idx, 3, 1), KVF_ROUTER_WORKER_RESYNC);
    assert_true(kvf_router_index_lookup(idx, uh(7)) == 0);
    /* deltas stay refused until a snapshot; trust decays meanwhile */
    kvf_router_event e5 = ev_of(KVF_ROUTER_EV_STORED, 3, 5, b, 2);
    assert_int_equal(kvf_router_index_apply(idx, &e5, 2, &err), KVF_ERR_STATE);
    assert_true(kvf_router_index_trust(idx, 3, 31) < 0.5);
    kvf_router_index_stats st;
    kvf_router_index_stats_get(idx, &st);
    assert_int_equal(st.gaps, 1);
    /* the snapshot replaces the contents and sets the base */
    uint64_t snap[2] = {uh(8), uh(9)}, par[2] = {0, uh(8)};
    kvf_router_event s = ev_of(KVF_ROUTER_EV_SNAPSHOT, 3, 20, snap, 2);
    s.parents = par;
    assert_int_equal(kvf_router_index_apply(idx, &s, 3, &err), KVF_OK);
    assert_int_equal(kvf_router_index_worker_state(idx, 3, 3), KVF_ROUTER_WORKER_LIVE);
    assert_true(kvf_router_index_trust(idx, 3, 3) == 1.0);
    assert_true(kvf_router_index_lookup(idx, uh(1)) == 0);
    assert_true(kvf_router_index_lookup(idx, uh(9)) == 1ull << 3);
    kvf_router_event e21 = ev_of(KVF_ROUTER_EV_STORED, 3, 21, a, 1);
    assert_int_equal(kvf_router_index_apply(idx, &e21, 4, &err), KVF_OK);
    assert_true(kvf_router_index_lookup(idx, uh(1)) == 1ull << 3);
    /* a replayed old delta is ignored */
    kvf_router_event old = ev_of(KVF_ROUTER_EV_REMOVED, 3, 21, a, 1);
    assert_int_equal(kvf_router_index_apply(idx, &old, 4, &err), KVF_OK);
    assert_true(kvf_router_index_lookup(idx, uh(1)) == 1ull << 3);
    kvf_router_index_destroy(idx);
}

static void test_removed_worker_leaves_at_once(void **state)
{
    (void)state;
    kvf_router_index *idx = make(0);
    kvf_err err = {0};
    static uint64_t h[5000];
    for (int i = 0; i < 5000; i++)
        h[i] = uh(i + 1);
    for (int32_t w = 0; w < 3; w++) {
        assert_int_equal(kvf_router_index_worker_add(idx, w, "m", 16, 0, &err), KVF_OK);
        kvf_router_event e = ev_of(KVF_ROUTER_EV_STORED, w, 1, h, w == 1 ? 5000 : 100);
        assert_int_equal(kvf_router_index_apply(idx, &e, 0, &err), KVF_OK);
    }
    uint32_t ov[KVF_ROUTER_MAX_WORKERS];
    assert_int_equal(kvf_router_index_overlap(idx, h, 200, ~0ull, ov), 200);
    kvf_router_index_worker_remove(idx, 1);
    assert_int_equal(kvf_router_index_worker_state(idx, 1, 0), KVF_ROUTER_WORKER_ABSENT);
    assert_int_equal(kvf_router_index_overlap(idx, h, 200, ~0ull, ov), 100);
    assert_int_equal(ov[1], 0);
    assert_true(kvf_router_index_lookup(idx, h[4000]) == 0);
    assert_true(kvf_router_index_lookup(idx, h[50]) == 5);
    kvf_router_index_stats st;
    kvf_router_index_stats_get(idx, &st);
    assert_int_equal(st.n_blocks, 100);
    assert_int_equal(st.n_pairs, 200);
    /* its late events are refused */
    kvf_router_event late = ev_of(KVF_ROUTER_EV_STORED, 1, 2, h, 1);
    assert_int_equal(kvf_router_index_apply(idx, &late, 0, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "not registered"));
    kvf_router_index_destroy(idx);
}

static void test_foreign_block_size_or_model_refused_with_log(void **state)
{
    (void)state;
    kvf_test_log cap = {0};
    kvf_log_set_sink(kvf_test_log_sink, &cap);
    kvf_router_index *idx = make(0);
    kvf_err err = {0};
    assert_int_equal(kvf_router_index_worker_add(idx, 0, "m", 16, 0, &err), KVF_OK);
    assert_int_equal(kvf_router_index_worker_add(idx, 1, "m", 16, 0, &err), KVF_OK);
    uint64_t h[2] = {uh(1), uh(2)};
    kvf_router_event e = ev_of(KVF_ROUTER_EV_STORED, 0, 1, h, 2);
    e.block_size = 32;
    assert_int_equal(kvf_router_index_apply(idx, &e, 0, &err), KVF_ERR_INVALID);
    assert_int_equal(cap.n_lines, 1);
    assert_non_null(strstr(cap.last, "worker 0"));
    assert_non_null(strstr(cap.last, "block size differs"));
    assert_non_null(strstr(cap.last, "block size 32"));
    assert_non_null(strstr(cap.last, "block size 16"));
    e = ev_of(KVF_ROUTER_EV_SNAPSHOT, 1, 1, h, 2);
    e.model = "other-model";
    assert_int_equal(kvf_router_index_apply(idx, &e, 0, &err), KVF_ERR_INVALID);
    assert_int_equal(cap.n_lines, 2);
    assert_non_null(strstr(cap.last, "model differs"));
    assert_non_null(strstr(cap.last, "'other-model'"));
    assert_true(kvf_router_index_lookup(idx, uh(1)) == 0);
    /* registration of a worker with another block size is refused the same way */
    assert_int_equal(kvf_router_index_worker_add(idx, 2, "m", 8, 0, &err), KVF_ERR_INVALID);
    assert_int_equal(kvf_router_index_worker_state(idx, 2, 0), KVF_ROUTER_WORKER_ABSENT);
    assert_non_null(strstr(cap.last, "worker 2"));
    kvf_router_index_stats st;
    kvf_router_index_stats_get(idx, &st);
    assert_int_equal(st.refused, 3);
    /* the right ones still work */
    e = ev_of(KVF_ROUTER_EV_STORED, 0, 1, h, 2);
    assert_int_equal(kvf_router_index_apply(idx, &e, 0, &err), KVF_OK);
    assert_true(kvf_router_index_lookup(idx, uh(2)) == 1);
    kvf_log_set_sink(NULL, NULL);
    kvf_router_index_destroy(idx);
}

static void test_silent_worker_decays_then_is_forgotten(void **state)
{
    (void)state;
    kvf_router_index *idx = make(0);
    kvf_err err = {0};
    uint64_t h[4] = {uh(1), uh(2), uh(3), uh(4)};
    for (int32_t w = 0; w < 2; w++) {
        assert_int_equal(kvf_router_index_worker_add(idx, w, "m", 16, 0, &err), KVF_OK);
        kvf_router_event e = ev_of(KVF_ROUTER_EV_STORED, w, 1, h, 4);
        assert_int_equal(kvf_router_index_apply(idx, &e, 0, &err), KVF_OK);
    }
    /* worker 1 keeps sending heartbeats; worker 0 goes silent (stale after 10 s, decay 30 s) */
    for (double t = 1; t <= 200; t += 1)
        kvf_router_index_heartbeat(idx, 1, t);
    assert_true(kvf_router_index_trust(idx, 0, 5) == 1.0);
    assert_int_equal(kvf_router_index_worker_state(idx, 0, 11), KVF_ROUTER_WORKER_STALE);
    double t20 = kvf_router_index_trust(idx, 0, 20), t40 = kvf_router_index_trust(idx, 0, 40);
    assert_true(t20 < 1.0 && t40 < t20 && t40 > 0);
    assert_int_equal(kvf_router_index_expire(idx, 40), 0);
    assert_int_equal(kvf_router_index_expire(idx, 200), 1); /* trust exp(-190/30) < 0.05 */
    assert_true(kvf_router_index_lookup(idx, uh(2)) == 2);
    assert_true(kvf_router_index_trust(idx, 1, 200) == 1.0);
    kvf_router_index_destroy(idx);
}


/* Block i of chain c; chains 4k..4k+3 share their first 20 blocks (a prompt tree). */
static uint64_t ch(int c, int i) { return uh(1 + (i < 20 ? c / 4 : c) * 211 + i) ^ (i < 20 ? 0 : 0x77); }

static void test_sampled_overlap_matches_on_prefix_closed_caches(void **state)
{
    (void)state;
    enum { NC = 40, LEN = 200, W = 6 };
    kvf_router_index_cfg c;
    kvf_router_index_cfg_default(&c);
    c.model = "m";
    kvf_router_index *lin, *smp;
    kvf_err err = {0};
    assert_int_equal(kvf_router_index_create(&c, &lin, &err), KVF_OK);
    c.prefix_closed = true;
    assert_int_equal(kvf_router_index_create(&c, &smp, &err), KVF_OK);
    static int len[W][NC]; /* worker w holds chain c's first len blocks */
    memset(len, 0, sizeof len);
    uint64_t seq[W] = {0};
    for (int w = 0; w < W; w++) {
        assert_int_equal(kvf_router_index_worker_add(lin, w, "m", 16, 0, &err), KVF_OK);
        assert_int_equal(kvf_router_index_worker_add(smp, w, "m", 16, 0, &err), KVF_OK);
    }
    uint64_t h[LEN];
    for (int step = 0; step < 2000; step++) {
        int w = (int)(rnd() % W), cc = (int)(rnd() % NC), to = (int)(rnd() % (LEN + 1));
        int from = len[w][cc];
        kvf_router_event ev = {.worker = w, .seq = ++seq[w], .model = "m", .block_size = 16, .hashes = h};
        if (to > from) { /* extend: store blocks from..to */
            for (int i = from; i < to; i++)
                h[i - from] = ch(cc, i);
            ev.kind = KVF_ROUTER_EV_STORED;
            ev.n = (size_t)(to - from);
        } else { /* shrink from the tail, unless a sibling chain still needs the shared head */
            int keep = to;
            for (int s2 = cc / 4 * 4; s2 < cc / 4 * 4 + 4; s2++)
                if (s2 != cc && len[w][s2] > keep && keep < 20)
                    keep = len[w][s2] < 20 ? len[w][s2] : 20;
            to = keep > to ? keep : to;
            for (int i = to; i < from; i++)
                h[i - to] = ch(cc, i);
            ev.kind = KVF_ROUTER_EV_REMOVED;
            ev.n = (size_t)(from > to ? from - to : 0);
            /* removing a shared head block also cuts the siblings' view of it */
        }
        assert_int_equal(kvf_router_index_apply(lin, &ev, 0, &err), KVF_OK);
        assert_int_equal(kvf_router_index_apply(smp, &ev, 0, &err), KVF_OK);
        len[w][cc] = to > from || ev.kind == KVF_ROUTER_EV_STORED ? (to > from ? to : from) : to;
        for (int q = 0; q < 3; q++) {
            int qc = (int)(rnd() % NC), n = 1 + (int)(rnd() % LEN);
            for (int i = 0; i < n; i++)
                h[i] = ch(qc, i);
            uint32_t a[KVF_ROUTER_MAX_WORKERS], b[KVF_ROUTER_MAX_WORKERS];
            size_t ba = kvf_router_index_overlap(lin, h, (size_t)n, ~0ull, a);
            size_t bb = kvf_router_index_overlap(smp, h, (size_t)n, ~0ull, b);
            assert_int_equal(ba, bb);
            for (int x = 0; x < W; x++)
                assert_int_equal(a[x], b[x]);
        }
    }
    kvf_router_index_stats sa, sb;
    kvf_router_index_stats_get(lin, &sa);
    kvf_router_index_stats_get(smp, &sb);
    assert_true(sb.ops < sa.ops); /* fewer blocks read for the same answers */
    kvf_router_index_destroy(lin);
    kvf_router_index_destroy(smp);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_streams_match_reference),
        cmocka_unit_test(test_gap_asks_for_resync_and_snapshot_recovers),
        cmocka_unit_test(test_removed_worker_leaves_at_once),
        cmocka_unit_test(test_foreign_block_size_or_model_refused_with_log),
        cmocka_unit_test(test_silent_worker_decays_then_is_forgotten),
        cmocka_unit_test(test_sampled_overlap_matches_on_prefix_closed_caches),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
