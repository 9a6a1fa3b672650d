/* policy.c: the four policies over one pool. The kv policy scores every non-busy worker by the
 * predicted work of serving the request there and falls back to the sticky ring when the index
 * knows nothing useful; load is measured in seconds with the online prefill-time fit. */
#include "router/policy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"
#include "common/log.h"
#include "router/lru.h"

typedef struct ring_point {
    uint64_t point;
    int32_t worker;
} ring_point;

typedef struct pool_worker {
    bool present, approx;
    kvf_router_load load;
    double pending_tokens; /* work this router sent since the last load report */
    double recent_tokens;  /* computed prompt tokens this router sent, decayed (bounded load) */
    int64_t limit_queued;
    double limit_decode;
    kvf_router_lru *pred; /* approximate mode: predicted cache contents */
} pool_worker;

struct kvf_router_pool {
    kvf_router_pool_cfg cfg;
    kvf_router_index *idx;
    pool_worker w[KVF_ROUTER_MAX_WORKERS];
    uint64_t present;
    double a, b;                /* prefill time model */
    double s0, sx, sy, sxx, sxy; /* discounted sums of the fit */
    int32_t rr_next;
    int n_approx;        /* workers in approximate mode */
    double next_expire;  /* when stale workers are next checked */
    double recent_at;    /* when recent_tokens were last decayed */
    uint64_t rng;
    ring_point *ring;
    size_t n_ring;
};

static const char *const policy_names[] = {"kv", "round-robin", "least-loaded", "sticky"};

kvf_status kvf_router_policy_parse(const char *s, kvf_router_policy *out, kvf_err *err)
{
    for (int i = 0; i < 4; i++) {
        if (s && strcmp(s, policy_names[i]) == 0) {
            *out = (kvf_router_policy)i;
            return KVF_OK;
        }
    }
    return kvf_err_set(err, KVF_ERR_INVALID,
                       "router: policy '%s' is not known (use kv, round-robin, least-loaded or sticky)",
                       s ? s : "(none)");
}

const char *kvf_router_policy_name(kvf_router_policy p)
{
    return (unsigned)p < 4 ? policy_names[p] : "?";
}

void kvf_router_pool_cfg_default(kvf_router_pool_cfg *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->policy = KVF_ROUTER_POLICY_KV;
    kvf_router_index_cfg_default(&cfg->index);
    cfg->w_uncached = 1.0;
    cfg->w_queue = 0.25;
    cfg->w_decode = 0.005;
    /* 16 tokens x 128 KiB (Llama-3-8B, f16) over 20 GB/s host and 5 GB/s disk copies */
    cfg->host_s_per_block = 16 * 131072 / 20e9;
    cfg->disk_s_per_block = 16 * 131072 / 5e9;
    cfg->prefill_a_s = 0.02;
    cfg->prefill_b_s = 5e-5;
    cfg->fit_forget = 0.995;
    cfg->sticky_blocks = 64;
    cfg->sticky_bound = 1.1;
    cfg->sticky_vnodes = 64;
    cfg->min_overlap_blocks = 1;
    cfg->load_bound = 1.1;
    cfg->load_window_s = 1800;
    cfg->load_penalty = 0.5;
    cfg->approx_ttl_s = 300;
    cfg->approx_max_blocks = 1 << 20;
    cfg->seed = 1;
}

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline uint64_t rng_next(kvf_router_pool *p)
{
    p->rng += 0x9E3779B97F4A7C15ull;
    return mix64(p->rng);
}

static inline double rng_unit(kvf_router_pool *p)
{
    return (double)(rng_next(p) >> 11) * (1.0 / 9007199254740992.0);
}

kvf_status kvf_router_pool_create(const kvf_router_pool_cfg *cfg, kvf_router_pool **out,
                                  kvf_err *err)
{
    if ((unsigned)cfg->policy > KVF_ROUTER_POLICY_STICKY)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: policy %d is not known", (int)cfg->policy);
    if (!(cfg->host_s_per_block >= 0) || !(cfg->disk_s_per_block >= 0))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: tier promotion times (host %g s, disk %g s a block) must not be negative",
                           cfg->host_s_per_block, cfg->disk_s_per_block);
    if (cfg->w_uncached < 0 || cfg->w_queue < 0 || cfg->w_decode < 0 || cfg->temperature < 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: cost weights (%g, %g, %g) and temperature (%g) must not be negative",
                           cfg->w_uncached, cfg->w_queue, cfg->w_decode, cfg->temperature);
    if (!(cfg->prefill_b_s > 0) || cfg->prefill_a_s < 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: prefill model a=%g s, b=%g s/token: need a >= 0 and b > 0",
                           cfg->prefill_a_s, cfg->prefill_b_s);
    if (!(cfg->fit_forget > 0 && cfg->fit_forget <= 1))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: fit forgetting factor %g is not in (0, 1]",
                           cfg->fit_forget);
    if (cfg->sticky_blocks < 1 || cfg->sticky_vnodes < 1 || cfg->sticky_vnodes > 1024 ||
        cfg->sticky_bound < 1)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: sticky blocks %d (>= 1), vnodes %d (1..1024) and bound %g (>= 1) "
                           "out of range", cfg->sticky_blocks, cfg->sticky_vnodes, cfg->sticky_bound);
    if ((cfg->load_bound != 0 && !(cfg->load_bound >= 1)) || !(cfg->load_window_s > 0) ||
        !(cfg->load_penalty >= 0))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: load bound %g (0 = off, or >= 1), window %g s (> 0) and penalty "
                           "%g (>= 0) out of range", cfg->load_bound, cfg->load_window_s,
                           cfg->load_penalty);
    if (cfg->approx_max_blocks < 1 || cfg->approx_ttl_s <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: approximate mode needs max blocks >= 1 (got %lld) and TTL > 0 (got %g)",
                           (long long)cfg->approx_max_blocks, cfg->approx_ttl_s);
    kvf_router_pool *p = calloc(1, sizeof *p);
    if (!p)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    p->cfg = *cfg;
    kvf_status st = kvf_router_index_create(&cfg->index, &p->idx, err);
    if (st != KVF_OK) {
        free(p);
        return st;
    }
    p->cfg.index.model = NULL; /* the index keeps its own copy */
    p->a = cfg->prefill_a_s;
    p->b = cfg->prefill_b_s;
    p->rng = cfg->seed;
    *out = p;
    return KVF_OK;
}

void kvf_router_pool_destroy(kvf_router_pool *p)
{
    if (!p)
        return;
    for (int i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
        kvf_router_lru_destroy(p->w[i].pred);
    kvf_router_index_destroy(p->idx);
    free(p->ring);
    free(p);
}

static int ring_cmp(const void *a, const void *b)
{
    const ring_point *x = a, *y = b;
    return x->point < y->point ? -1 : x->point > y->point;
}

static kvf_status ring_rebuild(kvf_router_pool *p)
{
    size_t n = (size_t)__builtin_popcountll(p->present) * (size_t)p->cfg.sticky_vnodes;
    ring_point *r = n ? malloc(n * sizeof *r) : NULL;
    if (n && !r)
        return KVF_ERR_NOMEM;
    size_t k = 0;
    for (uint64_t m = p->present; m; m &= m - 1) {
        int32_t w = __builtin_ctzll(m);
        for (int32_t v = 0; v < p->cfg.sticky_vnodes; v++)
            r[k++] = (ring_point){mix64(((uint64_t)w << 32 | (uint64_t)v) + 0x51ed27u), w};
    }
    if (n) /* no workers: no ring (qsort's array may not be NULL) */
        qsort(r, n, sizeof *r, ring_cmp);
    free(p->ring);
    p->ring = r;
    p->n_ring = n;
    return KVF_OK;
}

kvf_status kvf_router_pool_worker_add(kvf_router_pool *p, int32_t worker, const char *model,
                                      int32_t block_size, bool publishes_events, double now,
                                      kvf_err *err)
{
    kvf_status st = kvf_router_index_worker_add(p->idx, worker, model, block_size, now, err);
    if (st != KVF_OK)
        return st;
    pool_worker *pw = &p->w[worker];
    bool approx = p->cfg.approx || !publishes_events;
    if (!pw->present) {
        memset(pw, 0, sizeof *pw);
        pw->limit_queued = p->cfg.busy_queued_tokens;
        pw->limit_decode = p->cfg.busy_decode;
    }
    if (approx && !pw->pred &&
        (st = kvf_router_lru_create(p->cfg.approx_max_blocks, &pw->pred, err)) != KVF_OK) {
        kvf_router_index_worker_remove(p->idx, worker);
        return st;
    }
    p->n_approx += (int)approx - (int)pw->approx;
    pw->approx = approx;
    pw->present = true;
    p->present |= 1ull << worker;
    if (ring_rebuild(p) != KVF_OK) {
        kvf_router_pool_worker_remove(p, worker);
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory for the sticky ring");
    }
    return KVF_OK;
}

kvf_status kvf_router_pool_worker_capacity(kvf_router_pool *p, int32_t worker, int64_t blocks,
                                           kvf_err *err)
{
    if (worker < 0 || worker >= KVF_ROUTER_MAX_WORKERS || !p->w[worker].present)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: worker %d is not in the pool", (int)worker);
    pool_worker *pw = &p->w[worker];
    if (!pw->approx || !pw->pred)
        return KVF_OK;
    int64_t cap = blocks > 0 && blocks < p->cfg.approx_max_blocks ? blocks : p->cfg.approx_max_blocks;
    if (cap == kvf_router_lru_capacity(pw->pred))
        return KVF_OK;
    kvf_router_lru *pred;
    kvf_status st = kvf_router_lru_create(cap, &pred, err);
    if (st != KVF_OK)
        return st;
    uint64_t key;
    while (kvf_router_lru_pop(pw->pred, INFINITY, &key))
        kvf_router_index_block_remove(p->idx, worker, key);
    kvf_router_lru_destroy(pw->pred);
    pw->pred = pred;
    return KVF_OK;
}

void kvf_router_pool_worker_remove(kvf_router_pool *p, int32_t worker)
{
    if (worker < 0 || worker >= KVF_ROUTER_MAX_WORKERS || !p->w[worker].present)
        return;
    kvf_router_index_worker_remove(p->idx, worker);
    p->n_approx -= p->w[worker].approx;
    kvf_router_lru_destroy(p->w[worker].pred);
    memset(&p->w[worker], 0, sizeof p->w[worker]);
    p->present &= ~(1ull << worker);
    if (ring_rebuild(p) != KVF_OK) {
        /* keep the old ring; pick skips workers that are not present */
        kvf_log(KVF_LOG_WARN, "router: out of memory rebuilding the sticky ring");
    }
}

void kvf_router_pool_worker_limits(kvf_router_pool *p, int32_t worker, int64_t queued_tokens,
                                   double decode_load)
{
    if (worker < 0 || worker >= KVF_ROUTER_MAX_WORKERS || !p->w[worker].present)
        return;
    p->w[worker].limit_queued = queued_tokens;
    p->w[worker].limit_decode = decode_load;
}

void kvf_router_pool_load_set(kvf_router_pool *p, int32_t worker, const kvf_router_load *load,
                              double now)
{
    if (worker < 0 || worker >= KVF_ROUTER_MAX_WORKERS || !p->w[worker].present)
        return;
    p->w[worker].load = *load;
    /* a price that is not a positive number falls back to the pool's default */
    double *price[2] = {&p->w[worker].load.host_s_per_block, &p->w[worker].load.disk_s_per_block};
    for (int i = 0; i < 2; i++)
        if (!(*price[i] > 0) || !isfinite(*price[i]))
            *price[i] = 0;
    p->w[worker].pending_tokens = 0;
    kvf_router_index_heartbeat(p->idx, worker, now);
}

void kvf_router_pool_prefill_report(kvf_router_pool *p, int64_t tokens, double seconds)
{
    if (tokens < 0 || !(seconds >= 0) || !isfinite(seconds))
        return;
    double f = p->cfg.fit_forget, x = (double)tokens, y = seconds;
    p->s0 = f * p->s0 + 1;
    p->sx = f * p->sx + x;
    p->sy = f * p->sy + y;
    p->sxx = f * p->sxx + x * x;
    p->sxy = f * p->sxy + x * y;
    double den = p->s0 * p->sxx - p->sx * p->sx;
    if (p->s0 < 2 || den <= 1e-9 * p->s0 * p->sxx)
        return; /* not enough spread in the sizes yet */
    double b = (p->s0 * p->sxy - p->sx * p->sy) / den;
    if (!(b > 0))
        return;
    double a = (p->sy - b * p->sx) / p->s0;
    p->b = b;
    p->a = a > 0 ? a : 0;
}

void kvf_router_pool_prefill_model(const kvf_router_pool *p, double *a_out, double *b_out)
{
    *a_out = p->a;
    *b_out = p->b;
}

kvf_router_index *kvf_router_pool_index(kvf_router_pool *p) { return p->idx; }

/* A worker's load in seconds: queued prefill work (reported + sent since) and decode load. */
static inline double load_s(const kvf_router_pool *p, int32_t w)
{
    const pool_worker *pw = &p->w[w];
    return p->b * ((double)pw->load.queued_prefill_tokens + pw->pending_tokens) +
           p->cfg.w_decode * pw->load.decode_load;
}

static inline bool is_busy(const kvf_router_pool *p, int32_t w)
{
    const pool_worker *pw = &p->w[w];
    return (pw->limit_queued > 0 &&
            (double)pw->load.queued_prefill_tokens + pw->pending_tokens >= (double)pw->limit_queued) ||
           (pw->limit_decode > 0 && pw->load.decode_load >= pw->limit_decode);
}

/* Ages every worker's recent computed tokens to now (O(workers)). */
static void recent_decay(kvf_router_pool *p, double now)
{
    if (!(now > p->recent_at))
        return;
    double f = exp(-(now - p->recent_at) / p->cfg.load_window_s);
    for (uint64_t m = p->present; m; m &= m - 1)
        p->w[__builtin_ctzll(m)].recent_tokens *= f;
    p->recent_at = now;
}

/* The bounded-load line: load_bound x the mean recent computed tokens of the candidates, with
 * this request's tokens counted in (as consistent hashing with bounded loads counts the new
 * ball), so the least loaded candidate is always within it, plus one request of slack (as the
 * ball count's ceiling gives there): while the window holds few requests, one long prompt is
 * most of the mean, and without the slack conversations would be moved off their caches for
 * noise. Against a window of thousands of requests it is negligible. INFINITY when off. */
static double load_line(const kvf_router_pool *p, uint64_t cand, double n_tok)
{
    if (!(p->cfg.load_bound >= 1))
        return INFINITY;
    double total = 0;
    int n = 0;
    for (uint64_t m = cand; m; m &= m - 1, n++)
        total += p->w[__builtin_ctzll(m)].recent_tokens;
    return p->cfg.load_bound * (total + n_tok) / (n ? n : 1) + n_tok;
}

/* Cold requests (no useful overlap anywhere) skip the workers above the line outright: they
 * miss wherever they go, so keeping them off the busiest costs no hit. */
static uint64_t bounded_candidates(const kvf_router_pool *p, uint64_t cand, double bound)
{
    uint64_t keep = 0;
    for (uint64_t m = cand; m; m &= m - 1)
        if (p->w[__builtin_ctzll(m)].recent_tokens <= bound)
            keep |= m & -m;
    return keep ? keep : cand;
}

static int32_t pick_least_loaded(kvf_router_pool *p, uint64_t cand)
{
    int32_t best = -1;
    double best_load = 0;
    int ties = 0;
    for (uint64_t m = cand; m; m &= m - 1) {
        int32_t w = __builtin_ctzll(m);
        double l = load_s(p, w);
        if (best < 0 || l < best_load - 1e-12) {
            best = w, best_load = l, ties = 1;
        } else if (fabs(l - best_load) <= 1e-12 && rng_next(p) % (uint64_t)++ties == 0) {
            best = w;
        }
    }
    return best;
}

static int32_t pick_round_robin(kvf_router_pool *p, uint64_t cand)
{
    for (int i = 0; i < KVF_ROUTER_MAX_WORKERS; i++) {
        int32_t w = (p->rr_next + i) % KVF_ROUTER_MAX_WORKERS;
        if (cand >> w & 1) {
            p->rr_next = (w + 1) % KVF_ROUTER_MAX_WORKERS;
            return w;
        }
    }
    return -1;
}

/* Consistent hashing with bounded load: walk the ring from the request's key and take the first
 * candidate whose load is within sticky_bound x the mean load with this request counted in. */
static int32_t pick_sticky(kvf_router_pool *p, const kvf_router_request *req, uint64_t cand)
{
    if (!p->n_ring)
        return pick_least_loaded(p, cand);
    uint64_t key;
    if (req->session_key && *req->session_key) {
        key = kvf_hash64(req->session_key, strlen(req->session_key));
    } else if (req->n_blocks) {
        size_t k = req->n_blocks < (size_t)p->cfg.sticky_blocks ? req->n_blocks
                                                                 : (size_t)p->cfg.sticky_blocks;
        key = req->hashes[k - 1];
    } else {
        key = mix64((uint64_t)req->n_tokens);
    }
    key = mix64(key);
    double total = 0, work = p->a + p->b * (double)req->n_tokens;
    int n = 0;
    for (uint64_t m = cand; m; m &= m - 1, n++)
        total += load_s(p, __builtin_ctzll(m));
    double bound = p->cfg.sticky_bound * (total + work) / (n ? n : 1);
    size_t lo = 0, hi = p->n_ring;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (p->ring[mid].point < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    uint64_t seen = 0;
    for (size_t i = 0; i < p->n_ring && seen != cand; i++) {
        int32_t w = p->ring[(lo + i) % p->n_ring].worker;
        if (!(cand >> w & 1) || (seen >> w & 1))
            continue;
        seen |= 1ull << w;
        if (load_s(p, w) <= bound + 1e-12)
            return w;
    }
    return pick_least_loaded(p, cand);
}

/* Records the router's own decision as predicted cache contents of an approximate worker:
 * tail blocks first so that the head is the most recently used. */
static void approx_record(kvf_router_pool *p, int32_t w, const kvf_router_request *req, double now)
{
    pool_worker *pw = &p->w[w];
    for (size_t i = req->n_blocks; i-- > 0;) {
        int32_t e = kvf_router_lru_find(pw->pred, req->hashes[i]);
        if (e >= 0) {
            kvf_router_lru_touch(pw->pred, e, now);
            continue;
        }
        int evicted;
        uint64_t old;
        if (kvf_router_lru_insert(pw->pred, req->hashes[i], 0, now, &evicted, &old) < 0)
            break;
        if (evicted)
            kvf_router_index_block_remove(p->idx, w, old);
        if (kvf_router_index_block_add(p->idx, w, req->hashes[i]) != KVF_OK)
            break;
    }
}

static void approx_expire(kvf_router_pool *p, double now)
{
    if (!p->n_approx)
        return;
    for (uint64_t m = p->present; m; m &= m - 1) {
        int32_t w = __builtin_ctzll(m);
        pool_worker *pw = &p->w[w];
        if (!pw->approx)
            continue;
        uint64_t key;
        while (kvf_router_lru_pop(pw->pred, now - p->cfg.approx_ttl_s, &key))
            kvf_router_index_block_remove(p->idx, w, key);
        kvf_router_index_heartbeat(p->idx, w, now); /* its predictions age by TTL, not silence */
    }
}

kvf_status kvf_router_pool_pick(kvf_router_pool *p, const kvf_router_request *req, double now,
                                kvf_router_decision *out, kvf_err *err)
{
    if (!p->present)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "router: no workers in the pool");
    if (!req || (req->n_blocks && !req->hashes) || req->n_tokens < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: request without prompt hashes");
    kvf_router_decision d = {.worker = -1};
    uint64_t cand = 0;
    for (uint64_t m = p->present; m; m &= m - 1)
        if (!is_busy(p, __builtin_ctzll(m)))
            cand |= m & -m;
    if (!cand) {
        cand = p->present;
        d.all_busy = true;
    }
    approx_expire(p, now);
    recent_decay(p, now);
    int32_t bs = p->cfg.index.block_size;
    double n_tok = (double)req->n_tokens;
    switch (p->cfg.policy) {
    case KVF_ROUTER_POLICY_ROUND_ROBIN:
        d.worker = pick_round_robin(p, cand);
        d.reason = KVF_ROUTER_BY_ROUND_ROBIN;
        break;
    case KVF_ROUTER_POLICY_LEAST_LOADED:
        d.worker = pick_least_loaded(p, cand);
        d.reason = KVF_ROUTER_BY_LEAST_LOADED;
        break;
    case KVF_ROUTER_POLICY_STICKY:
        d.worker = pick_sticky(p, req, cand);
        d.reason = KVF_ROUTER_BY_STICKY;
        break;
    case KVF_ROUTER_POLICY_KV: {
        if (now >= p->next_expire) { /* stale workers are checked at most every 100 ms */
            kvf_router_index_expire(p->idx, now);
            p->next_expire = now + 0.1;
        }
        double line = load_line(p, cand, n_tok);
        uint32_t ov[KVF_ROUTER_MAX_WORKERS];
        size_t best_ov = kvf_router_index_overlap(p->idx, req->hashes, req->n_blocks, cand, ov);
        if (best_ov < (size_t)p->cfg.min_overlap_blocks) {
            d.worker = pick_sticky(p, req, bounded_candidates(p, cand, line));
            d.reason = KVF_ROUTER_BY_STICKY;
            break;
        }
        /* blocks of each overlap below the pool: a hit there costs its copy back */
        uint32_t ov_host[KVF_ROUTER_MAX_WORKERS], ov_disk[KVF_ROUTER_MAX_WORKERS];
        kvf_router_index_overlap_tiers(p->idx, req->hashes, cand, ov, ov_host, ov_disk);
        double cost[KVF_ROUTER_MAX_WORKERS], best = INFINITY, best_load = 0;
        int ties = 0;
        for (uint64_t m = cand; m; m &= m - 1) {
            int32_t w = __builtin_ctzll(m);
            double cached = (double)ov[w] * bs;
            cached = (cached < n_tok ? cached : n_tok) * kvf_router_index_trust(p->idx, w, now);
            const pool_worker *pw = &p->w[w];
            /* the worker's measured promotion times when it reports them, else the pool's */
            double host_s = pw->load.host_s_per_block > 0 ? pw->load.host_s_per_block : p->cfg.host_s_per_block;
            double disk_s = pw->load.disk_s_per_block > 0 ? pw->load.disk_s_per_block : p->cfg.disk_s_per_block;
            double promote = host_s * ov_host[w] + disk_s * ov_disk[w];
            double c = p->cfg.w_uncached * (p->a + p->b * (n_tok - cached) + promote) +
                       p->cfg.w_queue * p->b *
                           ((double)pw->load.queued_prefill_tokens + pw->pending_tokens) +
                       p->cfg.w_decode * pw->load.decode_load;
            /* Bounded load for hits: every recent computed token above the line is charged as
             * load_penalty (0.5) of a token to compute, so a worker past it keeps only the
             * requests whose cached prefix saves more than that, and gives up the cheapest
             * ones to move first. A hot prefix on a holder far past the line goes to the
             * cheapest other worker, which computes it once and holds it from then on (one
             * more replica); a conversation stays with its history unless its holder is over
             * by twice that history. The excess stays within a few prompts of the line, small
             * against a window's tokens, so the share of computed tokens stays bounded. */
            if (pw->recent_tokens > line)
                c += p->cfg.load_penalty * p->b * (pw->recent_tokens - line);
            cost[w] = c;
            double l = load_s(p, w);
            /* lowest cost; ties by lower load, then at random */
            double eps = 1e-9 * (fabs(best) + 1e-9);
            if (d.worker < 0 || c < best - eps || (c <= best + eps && l < best_load - 1e-12)) {
                best = c, best_load = l, d.worker = w, ties = 1;
            } else if (c <= best + eps && l <= best_load + 1e-12 &&
                       rng_next(p) % (uint64_t)++ties == 0) {
                best = c < best ? c : best;
                d.worker = w;
            }
        }
        if (p->cfg.temperature > 0) {
            double sum = 0, wt[KVF_ROUTER_MAX_WORKERS];
            for (uint64_t m = cand; m; m &= m - 1) {
                int32_t w = __builtin_ctzll(m);
                sum += wt[w] = exp(-(cost[w] - best) / p->cfg.temperature);
            }
            double r = rng_unit(p) * sum;
            for (uint64_t m = cand; m; m &= m - 1) {
                int32_t w = __builtin_ctzll(m);
                d.worker = w;
                if ((r -= wt[w]) <= 0)
                    break;
            }
        }
        d.reason = KVF_ROUTER_BY_COST;
        d.cost_s = cost[d.worker];
        d.overlap_blocks = ov[d.worker];
        break;
    }
    }
    if (d.worker < 0)
        return kvf_err_set(err, KVF_ERR_INTERNAL, "router: no candidate worker");
    if (d.reason != KVF_ROUTER_BY_COST) {
        /* report the overlap for every policy, so callers can compare them */
        if (!d.overlap_blocks && req->n_blocks) {
            uint32_t ov[KVF_ROUTER_MAX_WORKERS];
            kvf_router_index_overlap(p->idx, req->hashes, req->n_blocks, 1ull << d.worker, ov);
            d.overlap_blocks = ov[d.worker];
        }
        d.cost_s = load_s(p, d.worker);
    }
    double cached = (double)d.overlap_blocks * bs;
    d.cached_tokens = (cached < n_tok ? cached : n_tok) *
                      kvf_router_index_trust(p->idx, d.worker, now);
    p->w[d.worker].pending_tokens += n_tok - d.cached_tokens;
    p->w[d.worker].recent_tokens += n_tok - d.cached_tokens;
    if (p->w[d.worker].approx)
        approx_record(p, d.worker, req, now);
    *out = d;
    return KVF_OK;
}

kvf_status kvf_router_pick_disagg(kvf_router_pool *prefill, kvf_router_pool *decode,
                                  const kvf_router_request *req, double now,
                                  kvf_router_decision *prefill_out,
                                  kvf_router_decision *decode_out, kvf_err *err)
{
    kvf_router_decision pd, dd;
    kvf_status st = kvf_router_pool_pick(decode, req, now, &dd, err);
    if (st != KVF_OK)
        return kvf_err_prefix(err, "decode pool");
    if ((st = kvf_router_pool_pick(prefill, req, now, &pd, err)) != KVF_OK)
        return kvf_err_prefix(err, "prefill pool");
    *prefill_out = pd;
    *decode_out = dd;
    return KVF_OK;
}
