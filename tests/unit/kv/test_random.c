/* test_random.c: tens of thousands of mixed operations (new request with prefix lookup, append,
 * step, fork, free, swap out/in, pin, expire, probe) against a deliberately simple reference
 * model: each sequence's tokens and the KV value every position must hold (a hash of its
 * prefix), the set of cached hashes rebuilt from the events alone (what a router sees), and a
 * plain count of the blocks each operation needs. After every operation: the pool and swap
 * invariant checkers, every live position's KV bytes, and used blocks == distinct held ids.
 * The same runs again with host and disk tiers under the pool (kv/tier.h): the event-built set
 * then tracks each hash's tier, and promoted blocks must hold their values; once with
 * synchronous promotions and once through the tiers' copy thread, where half the lookups leave
 * their promotions in flight across later operations (writes to those sequences refused until
 * they land, frees while in flight, polls at random). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include <unistd.h>

#include "kvtest.h"
#include "kv/tier.h"

#define BS 4
#define N_BLOCKS 48
#define N_SLOTS_SWAP 20
#define N_SEQS 12
#define MAX_TOK 160
#define N_OPS 30000
#define N_HOST 16
#define N_DISK 16
#define MAX_CACHED (N_BLOCKS + N_HOST + N_DISK)

typedef struct model_seq {
    kvf_kv_seq s;
    bool live; /* initialised and not released */
    int32_t tok[MAX_TOK];
    uint64_t val[MAX_TOK]; /* the KV value of each position: a hash of the prefix up to it */
    int64_t n;
} model_seq;

typedef struct world {
    kt_env env;
    kvf_kv_swap *swap;
    model_seq m[N_SEQS];
    uint64_t cached[MAX_CACHED]; /* hashes known from STORED minus REMOVED events */
    int32_t cached_tier[MAX_CACHED]; /* the tier the last STORED of each named */
    int n_cached;
    kvf_kv_tier *tier; /* NULL: a pool without tiers */
    bool async;        /* the tiers promote through their copy thread */
    char dir[64];
    int ev_seen;
    uint64_t rng;
    uint64_t roots[2];
    int32_t templ[4][MAX_TOK];
    int64_t ok, full;
} world;

static uint32_t rnd(world *w, uint32_t n)
{
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return (uint32_t)(w->rng % n);
}

static uint64_t mix(uint64_t a, uint64_t b)
{
    uint64_t x = (a ^ (b + 0x9e3779b97f4a7c15ull)) * 0xbf58476d1ce4e5b9ull;
    return x ^ (x >> 31);
}

/* Applies the events raised since the last call to the model's cached-hash set. */
static void absorb_events(world *w)
{
    for (; w->ev_seen < w->env.n_ev; w->ev_seen++) {
        const kvf_kv_event *ev = &w->env.ev[w->ev_seen];
        int at = -1;
        for (int i = 0; i < w->n_cached; i++)
            if (w->cached[i] == ev->hash)
                at = i;
        if (ev->type == KVF_KV_EVENT_STORED && at >= 0) {
            /* stored again only as a move to another tier */
            assert_non_null(w->tier);
            assert_int_not_equal(w->cached_tier[at], ev->tier);
            w->cached_tier[at] = ev->tier;
        } else if (ev->type == KVF_KV_EVENT_STORED) {
            assert_true(w->n_cached < (w->tier ? MAX_CACHED : N_BLOCKS));
            w->cached_tier[w->n_cached] = ev->tier;
            w->cached[w->n_cached++] = ev->hash;
        } else {
            assert_int_not_equal(at, -1); /* only what was stored is removed */
            w->cached_tier[at] = w->cached_tier[w->n_cached - 1];
            w->cached[at] = w->cached[--w->n_cached];
        }
    }
    w->env.n_ev = w->ev_seen = 0;
}

/* Whether sequence q may be written (no promotion still copying into it). */
static bool ready(const model_seq *q)
{
    return kvf_kv_seq_promotions_pending(&q->s) == 0;
}

/* Completes every promotion in flight. */
static void land_all(world *w)
{
    kvf_kv_pool_stats st;
    for (int i = 0; i < 100000; i++) {
        kvf_kv_pool_get_stats(w->env.pool, &st);
        if (st.promoting == 0)
            return;
        kvf_kv_pool_wait_promotions(w->env.pool, 1000000000);
    }
    fail_msg("promotions never completed");
}

static bool in_cache_model(const world *w, uint64_t h)
{
    for (int i = 0; i < w->n_cached; i++)
        if (w->cached[i] == h)
            return true;
    return false;
}

/* Sets tokens [from, to) of sequence i and their expected values. */
static void model_extend(world *w, model_seq *q, int64_t to, const int32_t *src)
{
    for (int64_t p = q->n; p < to; p++) {
        q->tok[p] = src ? src[p] : (int32_t)rnd(w, 3);
        q->val[p] = mix(p ? q->val[p - 1] : q->s.root, (uint64_t)q->tok[p]);
    }
}

/* Writes the KV values of [from, to) into the pool and registers full blocks. */
static void write_and_commit(model_seq *q, int64_t from, int64_t to)
{
    for (int64_t p = from; p < to; p++)
        *kt_slot(&q->s, p) = q->val[p];
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_commit(&q->s, q->tok, to, &err), KVF_OK);
    q->n = to;
}

/* How many live tables hold block id (its refcount, counted the plain way). */
static int holders(const world *w, int32_t id)
{
    int n = 0;
    for (int i = 0; i < N_SEQS; i++) {
        const kvf_kv_seq *s = &w->m[i].s;
        if (!w->m[i].live || s->state != KVF_KV_SEQ_ACTIVE)
            continue;
        for (int32_t j = 0; j < s->n_blocks; j++)
            n += s->blocks[j] == id;
    }
    return n;
}

/* Blocks appending k tokens to each of the chosen sequences takes, counted the plain way. */
static int64_t model_need(const world *w, const int *idx, const int64_t *k, int n)
{
    int64_t need = 0;
    for (int a = 0; a < n; a++) {
        const kvf_kv_seq *s = &w->m[idx[a]].s;
        need += kvf_kv_blocks_for(s->n_tokens + k[a], BS) - s->n_blocks;
    }
    for (int a = 0; a < n; a++) {
        const kvf_kv_seq *s = &w->m[idx[a]].s;
        if (k[a] == 0 || s->n_tokens % BS == 0)
            continue;
        int32_t last = s->blocks[s->n_blocks - 1];
        int writers = 0, first = -1;
        for (int b = 0; b < n; b++) {
            const kvf_kv_seq *t = &w->m[idx[b]].s;
            if (k[b] > 0 && t->n_tokens % BS != 0 && t->blocks[t->n_blocks - 1] == last) {
                writers++;
                if (first < 0)
                    first = b;
            }
        }
        if (first != a)
            continue; /* count each shared block once */
        int h = holders(w, last);
        if (h > 1)
            need += writers == h ? writers - 1 : writers;
    }
    return need;
}

typedef struct snap_ctx {
    world *w;
    int n;
} snap_ctx;

static void snap_check(void *ctx, const kvf_kv_event *ev)
{
    snap_ctx *c = ctx;
    bool found = false;
    for (int i = 0; i < c->w->n_cached; i++)
        if (c->w->cached[i] == ev->hash) {
            found = true;
            assert_int_equal(c->w->cached_tier[i], ev->tier); /* where the events said */
        }
    assert_true(found);
    assert_true(ev->type == KVF_KV_EVENT_STORED && ev->tokens && ev->n_tokens == BS);
    c->n++;
}

static void verify(world *w)
{
    kvf_kv_pool *p = w->env.pool;
    absorb_events(w);
    kvf_kv_seq *all[N_SEQS];
    int n = 0;
    for (int i = 0; i < N_SEQS; i++)
        if (w->m[i].live)
            all[n++] = &w->m[i].s;
    kt_check(p, all, (size_t)n);
    kvf_err err = {0};
    assert_int_equal(kvf_kv_swap_check(w->swap, (const kvf_kv_seq *const *)all, (size_t)n, &err),
                     KVF_OK);
    /* every live position holds its value; used == distinct held blocks */
    uint8_t held[N_BLOCKS] = {0};
    int distinct = 0;
    for (int i = 0; i < N_SEQS; i++) {
        model_seq *q = &w->m[i];
        if (!q->live || q->s.state != KVF_KV_SEQ_ACTIVE)
            continue;
        assert_int_equal(q->s.n_tokens, q->n);
        for (int64_t pos = 0; pos < q->n && ready(q); pos++) /* (bytes still on their way) */
            assert_true(*kt_slot(&q->s, pos) == q->val[pos]);
        for (int32_t j = 0; j < q->s.n_blocks; j++)
            if (!held[q->s.blocks[j]]++)
                distinct++;
    }
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.used, distinct);
    assert_true(w->n_cached <= (w->tier ? MAX_CACHED : N_BLOCKS));
    /* a snapshot lists exactly the set the events built */
    snap_ctx sc = {w, 0};
    assert_int_equal(kvf_kv_prefix_snapshot(p, snap_check, &sc), w->n_cached);
    assert_int_equal(sc.n, w->n_cached);
}

static int pick(world *w, bool want_live, kvf_kv_seq_state state)
{
    int start = (int)rnd(w, N_SEQS);
    for (int d = 0; d < N_SEQS; d++) {
        int i = (start + d) % N_SEQS;
        model_seq *q = &w->m[i];
        if (q->live == want_live && (!want_live || q->s.state == state))
            return i;
    }
    return -1;
}

static void op_new(world *w)
{
    int i = pick(w, false, KVF_KV_SEQ_ACTIVE);
    if (i < 0)
        return;
    model_seq *q = &w->m[i];
    kvf_kv_seq_init(&q->s, w->env.pool, w->roots[rnd(w, 2)]);
    q->live = true;
    q->n = 0;
    /* a template prefix and a random tail make prefix hits common */
    int32_t src[MAX_TOK];
    int64_t len = 1 + rnd(w, 60), shared = rnd(w, (uint32_t)len + 1);
    memcpy(src, w->templ[rnd(w, 4)], sizeof src);
    for (int64_t t = shared; t < len; t++)
        src[t] = (int32_t)rnd(w, 3);
    model_extend(w, q, len, src);
    land_all(w); /* in-flight hashes are nowhere a probe can see */
    kvf_kv_pool_expire(w->env.pool, NULL); /* so the event set and probe agree on expiry */
    absorb_events(w);
    /* the event-built set predicts the probe exactly */
    uint64_t h[MAX_TOK / BS];
    size_t nb = kvf_kv_hash_blocks(q->s.root, q->tok, (size_t)(len - 1), BS, h);
    int32_t expect = 0;
    while ((size_t)expect < nb && in_cache_model(w, h[expect]))
        expect++;
    assert_int_equal(kvf_kv_prefix_probe(w->env.pool, q->s.root, q->tok, len - 1), expect);
    int64_t hit = -1;
    kvf_err err = {0};
    int32_t avail0 = kvf_kv_pool_available(w->env.pool);
    assert_int_equal(kvf_kv_prefix_lookup(&q->s, q->tok, len - 1, &hit, &err), KVF_OK);
    /* with tiers, each block brought up takes a pool block: all of them when that many are
     * available (a pool hit takes at most one too), else a prefix of them. (Through the copy
     * thread too: every tier slot of the chain is pinned before the pool blocks are taken, so
     * their demotions cannot push a later block of the chain out of a tier.) */
    if (!w->tier || avail0 >= expect)
        assert_int_equal(hit, (int64_t)expect * BS);
    else
        assert_true(hit <= (int64_t)expect * BS);
    q->n = hit; /* the hit positions already hold the right values: verify checks them */
    if (!ready(q)) {
        assert_int_equal(kvf_kv_seq_prepare_write(&q->s, 1, &err), KVF_ERR_STATE);
        if (rnd(w, 2))
            return; /* left in flight: later operations meet it */
        while (!ready(q))
            kvf_kv_pool_wait_promotions(w->env.pool, 1000000000);
        assert_int_equal(q->s.n_tokens, hit); /* nothing fails here */
    }
    int32_t avail = kvf_kv_pool_available(w->env.pool);
    int64_t need = kvf_kv_blocks_for(len, BS) - q->s.n_blocks;
    kvf_status st = kvf_kv_seq_prepare_write(&q->s, len - hit, &err);
    if (need > avail) {
        assert_int_equal(st, KVF_ERR_FULL);
        w->full++;
        assert_int_equal(kvf_kv_seq_free(&q->s, &err), KVF_OK);
        kvf_kv_seq_fini(&q->s);
        q->live = false;
        return;
    }
    assert_int_equal(st, KVF_OK);
    w->ok++;
    write_and_commit(q, hit, len);
}

static void op_append(world *w, bool as_step)
{
    int idx[N_SEQS], n = 0;
    int64_t k[N_SEQS];
    if (as_step) {
        for (int i = 0; i < N_SEQS; i++)
            if (w->m[i].live && w->m[i].s.state == KVF_KV_SEQ_ACTIVE && ready(&w->m[i]) &&
                rnd(w, 2))
                idx[n++] = i;
    } else {
        int i = pick(w, true, KVF_KV_SEQ_ACTIVE);
        if (i >= 0 && ready(&w->m[i]))
            idx[n++] = i;
    }
    for (int a = 0; a < n; a++) {
        int64_t room = MAX_TOK - w->m[idx[a]].n;
        k[a] = room <= 0 ? 0 : rnd(w, (uint32_t)(room < 6 ? room + 1 : 6));
    }
    if (n == 0)
        return;
    int64_t need = model_need(w, idx, k, n);
    int32_t avail = kvf_kv_pool_available(w->env.pool);
    kvf_kv_seq *seqs[N_SEQS];
    for (int a = 0; a < n; a++)
        seqs[a] = &w->m[idx[a]].s;
    assert_int_equal(kvf_kv_pool_step_need(w->env.pool, seqs, k, (size_t)n), need);
    kvf_err err = {0};
    kvf_status st = as_step ? kvf_kv_pool_alloc_step(w->env.pool, seqs, k, (size_t)n, &err)
                            : kvf_kv_seq_prepare_write(seqs[0], k[0], &err);
    if (need > avail) {
        assert_int_equal(st, KVF_ERR_FULL);
        w->full++;
        return;
    }
    if (st != KVF_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, KVF_OK);
    w->ok++;
    for (int a = 0; a < n; a++) {
        model_seq *q = &w->m[idx[a]];
        int64_t from = q->n;
        model_extend(w, q, from + k[a], NULL);
        write_and_commit(q, from, from + k[a]);
    }
}

static void op_fork(world *w)
{
    int i = pick(w, true, KVF_KV_SEQ_ACTIVE), j = pick(w, false, KVF_KV_SEQ_ACTIVE);
    if (i < 0 || j < 0 || !ready(&w->m[i]))
        return;
    model_seq *a = &w->m[i], *b = &w->m[j];
    kvf_kv_seq_init(&b->s, w->env.pool, a->s.root);
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_fork(&a->s, &b->s, &err), KVF_OK);
    b->live = true;
    b->n = a->n;
    memcpy(b->tok, a->tok, sizeof a->tok);
    memcpy(b->val, a->val, sizeof a->val);
}

static void op_free(world *w)
{
    int i = pick(w, true, rnd(w, 4) ? KVF_KV_SEQ_ACTIVE : KVF_KV_SEQ_SWAPPED);
    if (i < 0)
        return;
    model_seq *q = &w->m[i];
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_free(&q->s, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_free(&q->s, &err), KVF_ERR_STATE); /* double free refused */
    kvf_kv_seq_fini(&q->s);
    q->live = false;
}

static void op_swap(world *w)
{
    kvf_err err = {0};
    if (rnd(w, 2)) {
        int i = pick(w, true, KVF_KV_SEQ_ACTIVE);
        if (i < 0)
            return;
        kvf_kv_seq *s = &w->m[i].s;
        if (!ready(&w->m[i])) {
            assert_int_equal(kvf_kv_swap_out(w->swap, s, &err), KVF_ERR_STATE);
            return;
        }
        bool fits = s->n_blocks <= kvf_kv_swap_slots_free(w->swap);
        assert_int_equal(kvf_kv_swap_out(w->swap, s, &err), fits ? KVF_OK : KVF_ERR_FULL);
    } else {
        int i = pick(w, true, KVF_KV_SEQ_SWAPPED);
        if (i < 0)
            return;
        model_seq *q = &w->m[i];
        bool fits = q->s.n_blocks <= kvf_kv_pool_available(w->env.pool);
        assert_int_equal(kvf_kv_swap_in(w->swap, &q->s, &err), fits ? KVF_OK : KVF_ERR_FULL);
        if (fits) /* register its full blocks again */
            assert_int_equal(kvf_kv_seq_commit(&q->s, q->tok, q->n, &err), KVF_OK);
    }
}

static void op_pin(world *w)
{
    kvf_err err = {0};
    int32_t n = 0;
    uint64_t root = w->roots[0];
    int32_t *t = w->templ[rnd(w, 4)];
    if (rnd(w, 2))
        assert_int_equal(kvf_kv_prefix_pin(w->env.pool, root, t, 8, &n, &err), KVF_OK);
    else
        assert_int_equal(kvf_kv_prefix_unpin(w->env.pool, root, t, 8, &n, &err), KVF_OK);
    assert_true(n >= 0 && n <= 2);
}

static void run(uint64_t seed, bool tiers, bool async)
{
    world *w = calloc(1, sizeof *w);
    assert_non_null(w);
    w->rng = seed | 1;
    kvf_err err = {0};
    if (tiers) {
        memset(&w->env, 0, sizeof w->env);
        w->env.now = 1000;
        kvf_kv_pool_cfg c = kt_cfg(&w->env, N_BLOCKS, BS);
        c.retention_ns = 400;
        snprintf(w->dir, sizeof w->dir, "/tmp/kvf-rand-XXXXXX");
        assert_non_null(mkdtemp(w->dir));
        kvf_kv_tier_cfg tc = {.host_bytes = N_HOST * c.layout.block_bytes, .disk_dir = w->dir,
                              .disk_bytes = N_DISK * (48 + BS * 4 + c.layout.block_bytes),
                              .synchronous = !async};
        w->async = async;
        assert_int_equal(kvf_kv_tier_create(&tc, &c.layout, &w->tier, &err), KVF_OK);
        c.tier = w->tier;
        assert_int_equal(kvf_kv_pool_create(&c, &w->env.pool, &err), KVF_OK);
    } else {
        kt_open(&w->env, N_BLOCKS, BS, 400);
    }
    assert_int_equal(kvf_kv_swap_create(w->env.pool, N_SLOTS_SWAP, &w->swap, &err), KVF_OK);
    w->roots[0] = kvf_kv_hash_root("rand", NULL, 0);
    w->roots[1] = kvf_kv_hash_root("rand", "salt", 4);
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < MAX_TOK; i++)
            w->templ[t][i] = (int32_t)rnd(w, 3);
    for (int op = 0; op < N_OPS; op++) {
        w->env.now += rnd(w, 3);
        if (w->async && rnd(w, 2))
            kvf_kv_pool_poll_promotions(w->env.pool);
        uint32_t r = rnd(w, 100);
        if (r < 20)
            op_new(w);
        else if (r < 45)
            op_append(w, false);
        else if (r < 60)
            op_append(w, true);
        else if (r < 68)
            op_fork(w);
        else if (r < 84)
            op_free(w);
        else if (r < 94)
            op_swap(w);
        else if (r < 97)
            op_pin(w);
        else {
            w->env.now += 300; /* idle long enough for some blocks to pass the retention */
            kvf_kv_pool_expire(w->env.pool, NULL);
        }
        verify(w);
    }
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(w->env.pool, &st);
    land_all(w);
    fprintf(stderr, "seed %llu%s: %lld ok, %lld full; hits %lld of %lld blocks, %lld stored, "
            "%lld evicted, %lld expired, %lld copy-on-write, %lld demoted, %lld promoted\n",
            (unsigned long long)seed, tiers ? (async ? " (tiers, copy thread)" : " (tiers)") : "",
            (long long)w->ok,
            (long long)w->full, (long long)st.hit_blocks, (long long)st.lookup_blocks,
            (long long)st.stored, (long long)st.evicted, (long long)st.expired,
            (long long)st.cow_copies, (long long)st.demoted, (long long)st.promoted);
    /* the run must have exercised the interesting paths */
    assert_true(st.hit_blocks > 100 && st.evicted > 100 && st.cow_copies > 10 && w->full > 10 &&
                st.expired > 10);
    if (tiers) {
        kvf_kv_tier_stats ts;
        kvf_kv_tier_get_stats(w->tier, &ts);
        fprintf(stderr, "  host: %lld promoted, %lld dropped; disk: %lld demoted, %lld promoted, "
                "%lld dropped\n", (long long)ts.tier[KVF_KV_TIER_HOST].promoted,
                (long long)ts.tier[KVF_KV_TIER_HOST].dropped,
                (long long)ts.tier[KVF_KV_TIER_DISK].demoted,
                (long long)ts.tier[KVF_KV_TIER_DISK].promoted,
                (long long)ts.tier[KVF_KV_TIER_DISK].dropped);
        assert_true(ts.tier[KVF_KV_TIER_HOST].promoted > 50 &&
                    ts.tier[KVF_KV_TIER_DISK].promoted > 10 &&
                    ts.tier[KVF_KV_TIER_DISK].dropped > 10);
    }
    for (int i = 0; i < N_SEQS; i++)
        if (w->m[i].live)
            kvf_kv_seq_fini(&w->m[i].s);
    land_all(w);
    kvf_kv_seq *none[] = {NULL};
    kt_check(w->env.pool, none, 0);
    kvf_kv_pool_get_stats(w->env.pool, &st);
    assert_int_equal(st.used, 0);
    assert_int_equal(kvf_kv_swap_slots_free(w->swap), N_SLOTS_SWAP);
    kvf_kv_swap_destroy(w->swap);
    kvf_kv_pool_destroy(w->env.pool);
    kvf_kv_tier_destroy(w->tier);
    if (w->dir[0])
        rmdir(w->dir);
    free(w);
}

static void test_random_ops(void **state)
{
    const char *s = getenv("KVF_SEED");
    if (s && *s) {
        run(strtoull(s, NULL, 10), false, false);
        run(strtoull(s, NULL, 10), true, false);
        run(strtoull(s, NULL, 10), true, true);
        return;
    }
    run(1, false, false);
    run(20261125, false, false);
    run(1, true, false);
    run(20261125, true, false);
    run(1, true, true);
    run(20261125, true, true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_ops),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
