/* sim.c: the trace replay, in arrival order: release finished requests (blocks unpinned, tail
 * first), report loads, let the router pick, serve leading hits from the worker's cache and its
 * tiers (promoting them), insert the rest (demoting the pool's victims down the tiers, publishing
 * every move as an event in order), and time the prefill (TTFT) and the decode. */
#include "router/sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/time.h"
#include "kv/hash.h"
#include "router/lru.h"

void kvf_router_sim_cfg_default(kvf_router_sim_cfg *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->n_workers = 8;
    cfg->capacity_blocks = 1250;
    kvf_router_pool_cfg_default(&cfg->pool);
    cfg->pool.index.model = "mooncake";
    cfg->prefill_a_s = 0.02;
    cfg->prefill_b_s = 5e-5;
    cfg->decode_s_per_token = 0.02;
    cfg->host_bytes_per_s = 20e9;
    cfg->disk_bytes_per_s = 5e9;
    cfg->kv_bytes_per_token = 131072;
}

#define EV_RUN 1024 /* blocks per published event */

typedef struct inflight {
    double finish;
    int32_t worker, cache;
    int32_t n;     /* pinned entries */
    int32_t *pins; /* [n] cache entries, in prompt order */
} inflight;

typedef struct sim {
    const kvf_router_sim_cfg *cfg;
    const kvf_router_trace *t;
    kvf_router_pool *pool;
    kvf_router_lru *cache[KVF_ROUTER_MAX_WORKERS];
    kvf_router_lru *lower[KVF_ROUTER_MAX_WORKERS][3]; /* [cache][tier]: host, disk; NULL = none */
    int n_caches;
    bool feed_index;
    uint64_t seq[KVF_ROUTER_MAX_WORKERS];
    double free_at[KVF_ROUTER_MAX_WORKERS]; /* when the worker's prefill queue drains */
    int32_t running[KVF_ROUTER_MAX_WORKERS];
    inflight *heap; /* min-heap on finish */
    size_t n_heap, cap_heap;
    /* the pool's new blocks of the request, published last: they are pinned until it ends, so
     * no other move of the request can touch them, and the tier moves gather in long runs */
    uint64_t *stored, *parents; /* [max blocks per request] */
    size_t n_stored;
    /* the event being gathered: a run of moves of one kind and tier, published in order */
    uint64_t ev_h[EV_RUN], ev_p[EV_RUN];
    size_t ev_n;
    kvf_router_event_kind ev_kind;
    int ev_tier;
    int32_t ev_w;
    kvf_router_sim_result *r;
} sim;

static void heap_push(sim *s, inflight f)
{
    size_t i = s->n_heap++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (s->heap[up].finish <= f.finish)
            break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = f;
}

static inflight heap_pop(sim *s)
{
    inflight top = s->heap[0], last = s->heap[--s->n_heap];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= s->n_heap)
            break;
        if (c + 1 < s->n_heap && s->heap[c + 1].finish < s->heap[c].finish)
            c++;
        if (last.finish <= s->heap[c].finish)
            break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (s->n_heap)
        s->heap[i] = last;
    return top;
}

/* Unpins a finished request's blocks, tail first, so its head stays most recently used. */
static void release(sim *s, inflight *f)
{
    for (int32_t i = f->n; i-- > 0;)
        kvf_router_lru_unpin(s->cache[f->cache], f->pins[i], f->finish);
    s->running[f->worker]--;
    free(f->pins);
}

/* Publishes the gathered run as one event (when the router is fed events at all). */
static kvf_status ev_flush(sim *s, double now, kvf_err *err)
{
    if (!s->ev_n)
        return KVF_OK;
    kvf_router_event ev = {
        .kind = s->ev_kind, .worker = s->ev_w, .seq = ++s->seq[s->ev_w],
        .model = s->cfg->pool.index.model, .block_size = s->t->block_size, .hashes = s->ev_h,
        .parents = s->ev_kind == KVF_ROUTER_EV_STORED ? s->ev_p : NULL, .n = s->ev_n,
        .tier = s->ev_tier,
    };
    s->ev_n = 0;
    return kvf_router_index_apply(kvf_router_pool_index(s->pool), &ev, now, err);
}

/* One block's move on worker w: stored in (or moved to) tier, or removed (tier ignored). Moves
 * keep their order: a block demoted and promoted again within one request ends in the pool. */
static kvf_status ev_add(sim *s, int32_t w, kvf_router_event_kind kind, int tier, uint64_t h,
                         uint64_t parent, double now, kvf_err *err)
{
    if (!s->feed_index)
        return KVF_OK;
    kvf_status st;
    if (s->ev_n && (s->ev_kind != kind || s->ev_tier != tier || s->ev_w != w || s->ev_n == EV_RUN))
        if ((st = ev_flush(s, now, err)) != KVF_OK)
            return st;
    s->ev_kind = kind;
    s->ev_tier = tier;
    s->ev_w = w;
    s->ev_h[s->ev_n] = h;
    s->ev_p[s->ev_n++] = parent;
    return KVF_OK;
}

/* A block the pool of cache c evicted: down to the first tier below, whose own victim goes one
 * further, until a tier has room or the last one drops its victim. */
static kvf_status demote(sim *s, int c, int32_t w, uint64_t key, double now, kvf_err *err)
{
    kvf_status st;
    for (int tier = KVF_ROUTER_TIER_HOST; tier <= KVF_ROUTER_TIER_DISK; tier++) {
        kvf_router_lru *l = s->lower[c][tier];
        if (!l)
            continue;
        int evicted;
        uint64_t old;
        /* nothing in a tier is pinned, so the insert always finds room */
        kvf_router_lru_insert(l, key, 0, now, &evicted, &old);
        if (tier == KVF_ROUTER_TIER_HOST || !s->lower[c][KVF_ROUTER_TIER_HOST])
            s->r->demoted_blocks++;
        if ((st = ev_add(s, w, KVF_ROUTER_EV_STORED, tier, key, 0, now, err)) != KVF_OK)
            return st;
        if (!evicted)
            return KVF_OK;
        key = old;
    }
    s->r->dropped_blocks++;
    return ev_add(s, w, KVF_ROUTER_EV_REMOVED, 0, key, 0, now, err);
}

/* Takes key out of the tiers below cache c's pool: the tier it was in, or 0 when in none. */
static int lower_take(sim *s, int c, uint64_t key)
{
    for (int tier = KVF_ROUTER_TIER_HOST; tier <= KVF_ROUTER_TIER_DISK; tier++) {
        kvf_router_lru *l = s->lower[c][tier];
        int32_t e = l ? kvf_router_lru_find(l, key) : -1;
        if (e >= 0) {
            kvf_router_lru_remove(l, e);
            return tier;
        }
    }
    return 0;
}

static double percentile(double *v, size_t n, double q)
{
    if (!n)
        return 0;
    size_t k = (size_t)ceil(q * (double)n);
    return v[k ? k - 1 : 0];
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

kvf_status kvf_router_sim_run(const kvf_router_trace *t, const kvf_router_sim_cfg *cfg,
                              kvf_router_sim_result *out, kvf_err *err)
{
    if (cfg->n_workers < 1 || cfg->n_workers > KVF_ROUTER_MAX_WORKERS)
        return kvf_err_set(err, KVF_ERR_INVALID, "sim: --workers=%d is out of range (1..%d)",
                           cfg->n_workers, KVF_ROUTER_MAX_WORKERS);
    double per_cache = cfg->capacity_blocks * t->trace_block_tokens / t->block_size *
                       (cfg->fleet_lru ? cfg->n_workers : 1);
    if (!(cfg->capacity_blocks > 0) || per_cache < 1 || per_cache > (double)(1 << 30))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "sim: --capacity-blocks=%g gives %.0f cache blocks of %d tokens "
                           "(allowed 1 .. 2^30)", cfg->capacity_blocks, per_cache, t->block_size);
    if (cfg->prefill_a_s < 0 || !(cfg->prefill_b_s > 0) || cfg->decode_s_per_token < 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "sim: time model a=%g s, b=%g s/token, decode %g s/token: need a >= 0, "
                           "b > 0, decode >= 0", cfg->prefill_a_s, cfg->prefill_b_s,
                           cfg->decode_s_per_token);
    double tier_cap[3] = {0, cfg->host_capacity_blocks, cfg->disk_capacity_blocks};
    for (int k = 1; k < 3; k++) {
        tier_cap[k] *= (double)t->trace_block_tokens / t->block_size * (cfg->fleet_lru ? cfg->n_workers : 1);
        if (!(tier_cap[k] >= 0) || tier_cap[k] > (double)(1 << 30) || (tier_cap[k] > 0 && tier_cap[k] < 1))
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "sim: --%s-capacity-blocks=%g gives %.0f blocks of %d tokens (allowed 0, or 1 .. 2^30)",
                               k == 1 ? "host" : "disk", k == 1 ? cfg->host_capacity_blocks : cfg->disk_capacity_blocks,
                               tier_cap[k], t->block_size);
    }
    if (!(cfg->host_bytes_per_s > 0) || !(cfg->disk_bytes_per_s > 0) || !(cfg->kv_bytes_per_token > 0))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "sim: --host-bandwidth=%g, --disk-bandwidth=%g (bytes/s) and "
                           "--kv-bytes-per-token=%g must be positive",
                           cfg->host_bytes_per_s, cfg->disk_bytes_per_s, cfg->kv_bytes_per_token);
    if (cfg->pool.index.block_size != t->block_size)
        return kvf_err_set(err, KVF_ERR_INVALID, "sim: router block size %d differs from the trace's %d",
                           cfg->pool.index.block_size, t->block_size);
    double t0 = kvf_now_s();
    /* the whole state lives on the heap: the event run buffers are large */
    sim *sp = calloc(1, sizeof *sp);
    if (!sp)
        return kvf_err_set(err, KVF_ERR_NOMEM, "sim: out of memory");
    sp->cfg = cfg;
    sp->t = t;
    kvf_router_sim_result r = {0};
    sp->r = &r;
    kvf_status st = KVF_OK;
    double *ttft = NULL;
    int32_t max_blocks = 0;
    for (size_t i = 0; i < t->n_reqs; i++)
        max_blocks = t->reqs[i].n_blocks > max_blocks ? t->reqs[i].n_blocks : max_blocks;
    sp->stored = malloc(((size_t)max_blocks + 1) * sizeof(uint64_t));
    sp->parents = malloc(((size_t)max_blocks + 1) * sizeof(uint64_t));
    sp->cap_heap = t->n_reqs + 1;
    sp->heap = malloc(sp->cap_heap * sizeof *sp->heap);
    ttft = malloc((t->n_reqs + 1) * sizeof *ttft);
    if (!sp->stored || !sp->parents || !sp->heap || !ttft) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "sim: out of memory");
        goto done;
    }

    /* The router under test; fleet-lru only borrows its least-loaded choice for timing. */
    kvf_router_pool_cfg pc = cfg->pool;
    if (cfg->fleet_lru)
        pc.policy = KVF_ROUTER_POLICY_LEAST_LOADED;
    /* the router prices a tier hit by the same copy time the workers pay */
    double block_bytes = cfg->kv_bytes_per_token * t->block_size;
    double s_per_block[3] = {0, block_bytes / cfg->host_bytes_per_s, block_bytes / cfg->disk_bytes_per_s};
    pc.host_s_per_block = s_per_block[1];
    pc.disk_s_per_block = s_per_block[2];
    /* the simulated caches free a request's blocks tail first, so they are prefix-closed */
    pc.index.prefix_closed = true;
    pc.index.expected_blocks = (int64_t)(per_cache * (cfg->fleet_lru ? 1 : cfg->n_workers));
    if ((st = kvf_router_pool_create(&pc, &sp->pool, err)) != KVF_OK)
        goto done;
    sp->feed_index = !cfg->fleet_lru && pc.policy == KVF_ROUTER_POLICY_KV && !pc.approx;
    for (int32_t w = 0; w < cfg->n_workers; w++) {
        st = kvf_router_pool_worker_add(sp->pool, w, pc.index.model, t->block_size, !pc.approx, 0, err);
        if (st != KVF_OK)
            goto done;
    }
    sp->n_caches = cfg->fleet_lru ? 1 : cfg->n_workers;
    for (int c = 0; c < sp->n_caches; c++) {
        if ((st = kvf_router_lru_create((int64_t)llround(per_cache), &sp->cache[c], err)) != KVF_OK)
            goto done;
        for (int k = 1; k < 3; k++)
            if (tier_cap[k] > 0 &&
                (st = kvf_router_lru_create((int64_t)llround(tier_cap[k]), &sp->lower[c][k], err)) != KVF_OK)
                goto done;
    }
    uint64_t root = kvf_kv_hash_root(pc.index.model, NULL, 0);

    for (size_t i = 0; i < t->n_reqs; i++) {
        const kvf_router_trace_req *q = &t->reqs[i];
        const uint64_t *h = t->hashes + q->first;
        double now = q->t_s;
        /* 1. requests that finished by now give their blocks back */
        while (sp->n_heap && sp->heap[0].finish <= now) {
            inflight f = heap_pop(sp);
            release(sp, &f);
        }
        /* 2. load reports */
        for (int32_t w = 0; w < cfg->n_workers; w++) {
            double backlog = sp->free_at[w] > now ? sp->free_at[w] - now : 0;
            kvf_router_load l = {.queued_prefill_tokens = (int64_t)(backlog / cfg->prefill_b_s),
                                 .decode_load = sp->running[w]};
            kvf_router_pool_load_set(sp->pool, w, &l, now);
        }
        /* 3. the router decides */
        kvf_router_request rq = {.hashes = h, .n_blocks = (size_t)q->n_blocks, .n_tokens = q->n_tokens};
        kvf_router_decision d;
        if ((st = kvf_router_pool_pick(sp->pool, &rq, now, &d, err)) != KVF_OK)
            goto done;
        int32_t w = d.worker, c = cfg->fleet_lru ? 0 : w;
        kvf_router_lru *cache = sp->cache[c];
        /* 4. the worker's cache: leading hits, then pin or insert every block */
        inflight f = {.worker = w, .cache = c};
        f.pins = malloc(((size_t)q->n_blocks + 1) * sizeof *f.pins);
        if (!f.pins) {
            st = kvf_err_set(err, KVF_ERR_NOMEM, "sim: out of memory");
            goto done;
        }
        /* a leading block counts as a hit of the tier it is found in; a lower tier's block is
         * promoted into the pool, the first block found nowhere ends the hits */
        int32_t hit = 0, hit_tier[3] = {0, 0, 0};
        sp->n_stored = 0;
        bool leading = true;
        for (int32_t b = 0; b < q->n_blocks; b++) {
            int32_t e = kvf_router_lru_find(cache, h[b]);
            if (e >= 0) {
                kvf_router_lru_pin(cache, e);
                if (leading)
                    hit++, hit_tier[0]++;
                f.pins[f.n++] = e;
                continue;
            }
            int from = lower_take(sp, c, h[b]);
            if (from && leading)
                hit++, hit_tier[from]++;
            else
                leading = false;
            int evicted;
            uint64_t old;
            e = kvf_router_lru_insert(cache, h[b], 1, now, &evicted, &old);
            if (evicted) {
                r.evicted_blocks++;
                if ((st = demote(sp, c, w, old, now, err)) != KVF_OK)
                    break;
            }
            if (e < 0) {
                r.uncacheable_blocks++;
                if (from && (st = ev_add(sp, w, KVF_ROUTER_EV_REMOVED, 0, h[b], 0, now, err)) != KVF_OK)
                    break;
                continue;
            }
            r.promoted_blocks += from != 0;
            sp->parents[sp->n_stored] = b ? h[b - 1] : root;
            sp->stored[sp->n_stored++] = h[b];
            f.pins[f.n++] = e;
        }
        if (st == KVF_OK)
            st = ev_flush(sp, now, err);
        if (st == KVF_OK && sp->feed_index && sp->n_stored) {
            kvf_router_event ev = {
                .kind = KVF_ROUTER_EV_STORED, .worker = w, .seq = ++sp->seq[w],
                .model = cfg->pool.index.model, .block_size = t->block_size, .hashes = sp->stored,
                .parents = sp->parents, .n = sp->n_stored, .tier = KVF_ROUTER_TIER_POOL,
            };
            st = kvf_router_index_apply(kvf_router_pool_index(sp->pool), &ev, now, err);
        }
        if (st != KVF_OK) {
            free(f.pins);
            goto done;
        }
        /* 5. time model: the promotion copies come before the prefill (not overlapped) */
        int64_t cached_tok = (int64_t)hit * t->block_size;
        int64_t uncached = q->n_tokens - cached_tok;
        double promote_s = hit_tier[1] * s_per_block[1] + hit_tier[2] * s_per_block[2];
        double pt = cfg->prefill_a_s + cfg->prefill_b_s * (double)uncached + promote_s;
        double start = sp->free_at[w] > now ? sp->free_at[w] : now;
        sp->free_at[w] = start + pt;
        ttft[i] = sp->free_at[w] - now;
        f.finish = sp->free_at[w] + cfg->decode_s_per_token * q->n_out;
        sp->running[w]++;
        heap_push(sp, f);
        kvf_router_pool_prefill_report(sp->pool, uncached, pt - promote_s);
        /* 6. counts */
        r.blocks += q->n_blocks;
        r.blocks_hit += hit;
        for (int k = 0; k < 3; k++)
            r.blocks_hit_tier[k] += hit_tier[k];
        r.tokens += q->n_tokens;
        r.tokens_hit += cached_tok;
        r.computed_tokens[w] += uncached;
        int64_t full_tok = (int64_t)q->n_blocks * t->block_size;
        for (int32_t k = 0; k < q->n_trace_blocks; k++) {
            int64_t lo = (int64_t)k * t->trace_block_tokens;
            int64_t hi = lo + t->trace_block_tokens < full_tok ? lo + t->trace_block_tokens : full_tok;
            if (lo < full_tok && hi <= cached_tok)
                r.trace_blocks_hit++;
        }
        r.trace_blocks += q->n_trace_blocks;
        r.n_requests++;
        if (cfg->progress && ((i + 1) % 1000 == 0 || i + 1 == t->n_reqs))
            cfg->progress(cfg->progress_arg, i + 1, t->n_reqs);
    }

    /* summary */
    r.hit_rate_blocks = r.blocks ? (double)r.blocks_hit / (double)r.blocks : 0;
    for (int k = 0; k < 3; k++)
        r.hit_rate_tier[k] = r.blocks ? (double)r.blocks_hit_tier[k] / (double)r.blocks : 0;
    r.hit_rate_tokens = r.tokens ? (double)r.tokens_hit / (double)r.tokens : 0;
    r.hit_rate_trace_blocks = r.trace_blocks ? (double)r.trace_blocks_hit / (double)r.trace_blocks : 0;
    int64_t sum = 0, mx = 0;
    for (int32_t w = 0; w < cfg->n_workers; w++) {
        sum += r.computed_tokens[w];
        mx = r.computed_tokens[w] > mx ? r.computed_tokens[w] : mx;
    }
    r.load_max_over_mean = sum ? (double)mx * cfg->n_workers / (double)sum : 1.0;
    double tsum = 0;
    for (size_t i = 0; i < t->n_reqs; i++)
        tsum += ttft[i];
    r.ttft_mean_s = t->n_reqs ? tsum / (double)t->n_reqs : 0;
    qsort(ttft, t->n_reqs, sizeof *ttft, cmp_double);
    r.ttft_p50_s = percentile(ttft, t->n_reqs, 0.50);
    r.ttft_p99_s = percentile(ttft, t->n_reqs, 0.99);
    kvf_router_pool_prefill_model(sp->pool, &r.fitted_a_s, &r.fitted_b_s);
    kvf_router_index_stats_get(kvf_router_pool_index(sp->pool), &r.index);
    r.wall_s = kvf_now_s() - t0;
    *out = r;
done:
    while (sp->n_heap) {
        inflight f = heap_pop(sp);
        free(f.pins);
    }
    for (int c = 0; c < sp->n_caches; c++) {
        kvf_router_lru_destroy(sp->cache[c]);
        for (int k = 1; k < 3; k++)
            kvf_router_lru_destroy(sp->lower[c][k]);
    }
    kvf_router_pool_destroy(sp->pool);
    free(sp->heap);
    free(sp->stored);
    free(sp->parents);
    free(ttft);
    free(sp);
    return st;
}

void kvf_router_synth_cfg_default(kvf_router_synth_cfg *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->n_requests = 3000;
    cfg->n_prefixes = 8;
    cfg->zipf_s = 1.2;
    cfg->prefix_blocks = 16;
    cfg->suffix_blocks = 2;
    cfg->rate_per_s = 20;
    cfg->output_tokens = 100;
    cfg->trace_block_tokens = 512;
    cfg->seed = 1;
}

static inline uint64_t synth_next(uint64_t *s)
{
    uint64_t x = (*s += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline double synth_unit(uint64_t *s)
{
    return ((double)(synth_next(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

kvf_status kvf_router_synth_zipf(const kvf_router_synth_cfg *c, char **text_out, size_t *len_out,
                                 kvf_err *err)
{
    if (c->n_requests < 1 || c->n_requests > 10000000 || c->n_prefixes < 1 ||
        c->n_prefixes > 1000000 || !(c->zipf_s >= 0) || c->prefix_blocks < 1 ||
        c->suffix_blocks < 1 || c->prefix_blocks + c->suffix_blocks > 4096 ||
        !(c->rate_per_s > 0) || c->output_tokens < 0 || c->trace_block_tokens < 2)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "sim: synthetic trace: requests %lld (1..1e7), prefixes %d (1..1e6), "
                           "zipf s %g (>= 0), prefix %d + suffix %d blocks (each >= 1, sum <= 4096), "
                           "rate %g (> 0), output %d (>= 0), block tokens %d (>= 2): out of range",
                           (long long)c->n_requests, c->n_prefixes, c->zipf_s, c->prefix_blocks,
                           c->suffix_blocks, c->rate_per_s, c->output_tokens, c->trace_block_tokens);
    /* cumulative Zipf weights, so a draw is one binary search */
    double *cdf = malloc((size_t)c->n_prefixes * sizeof *cdf);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!cdf || !buf) {
        free(cdf);
        free(buf);
        return kvf_err_set(err, KVF_ERR_NOMEM, "sim: out of memory for the synthetic trace");
    }
    double sum = 0;
    for (int32_t k = 0; k < c->n_prefixes; k++)
        cdf[k] = sum += pow((double)k + 1, -c->zipf_s);
    uint64_t rng = c->seed;
    int32_t nb = c->prefix_blocks + c->suffix_blocks;
    /* the last block is partial, as in real traces (the trace reader wants ceil(len / 512) ids) */
    int64_t in_len = (int64_t)nb * c->trace_block_tokens - c->trace_block_tokens / 2;
    int64_t next_id = (int64_t)c->n_prefixes * c->prefix_blocks;
    double t = 0;
    for (int64_t i = 0; i < c->n_requests; i++) {
        t += -log(synth_unit(&rng)) / c->rate_per_s;
        double u = synth_unit(&rng) * sum;
        int32_t lo = 0, hi = c->n_prefixes - 1;
        while (lo < hi) {
            int32_t mid = (lo + hi) / 2;
            if (cdf[mid] < u)
                lo = mid + 1;
            else
                hi = mid;
        }
        /* one line: at most ~90 bytes of fields and 21 bytes per id */
        size_t need = len + 128 + (size_t)nb * 22;
        if (need > cap) {
            while (cap < need)
                cap *= 2;
            char *nbuf = realloc(buf, cap);
            if (!nbuf) {
                free(cdf);
                free(buf);
                return kvf_err_set(err, KVF_ERR_NOMEM, "sim: out of memory for the synthetic trace");
            }
            buf = nbuf;
        }
        len += (size_t)snprintf(buf + len, cap - len,
                                "{\"timestamp\": %lld, \"input_length\": %lld, \"output_length\": %d, "
                                "\"hash_ids\": [", (long long)(t * 1000.0), (long long)in_len,
                                c->output_tokens);
        for (int32_t b = 0; b < nb; b++) {
            int64_t id = b < c->prefix_blocks ? (int64_t)lo * c->prefix_blocks + b : next_id++;
            len += (size_t)snprintf(buf + len, cap - len, "%s%lld", b ? ", " : "", (long long)id);
        }
        len += (size_t)snprintf(buf + len, cap - len, "]}\n");
    }
    free(cdf);
    *text_out = buf;
    *len_out = len;
    return KVF_OK;
}
