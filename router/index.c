/* index.c: the KV index as one open-addressing table (linear probing, backward-shift deletion,
 * 16 bytes a slot: hash + worker bitset) and, per worker, an append-only list of the hashes it
 * was given, compacted when it is mostly dead, so removing a worker walks only its own blocks.
 * Tiers live in a parallel array (host and disk bitsets per slot), allocated only when a worker
 * first reports a block below its pool: the slot a prompt's overlap reads stays 16 bytes, and a
 * fleet without tiers pays nothing. */
#include "router/index.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/log.h"
#include "kv/hash.h"

/* The table's empty key is 0; a block hash of 0 is stored as this value instead. */
#define KEY_ZERO 0x8000000000000001ull
#define PREFETCH_RUN 32
#define OVERLAP_RUN 64 /* lookups of a prompt in flight at once */

typedef struct slot {
    uint64_t key;
    uint64_t bits;
} slot;

typedef struct tier_bits {
    uint64_t host, disk; /* workers holding the slot's block in that tier (a subset of bits) */
} tier_bits;

typedef struct worker {
    kvf_router_worker_state state; /* ABSENT, LIVE or RESYNC; STALE is derived from the clock */
    bool seq_known;
    bool warned;
    uint64_t next_seq;
    double last_seen, gap_at;
    uint64_t *held; /* hashes given to this worker, possibly dead or repeated */
    size_t held_len, held_cap;
    int64_t n_held; /* live (block, worker) pairs */
} worker;

struct kvf_router_index {
    kvf_router_index_cfg cfg;
    char *model;
    uint64_t root;
    slot *slots;
    uint64_t mask; /* capacity - 1 */
    int shift;     /* 64 - log2(capacity) */
    int64_t count;
    uint64_t registered;
    tier_bits *tiers;    /* [capacity] parallel to slots; NULL until a lower-tier block arrives */
    int64_t lower_pairs; /* (block, worker) pairs in the host or disk tier */
    int64_t host_pairs;  /* of which in the host tier (the rest on disk) */
    worker w[KVF_ROUTER_MAX_WORKERS];
    kvf_router_index_stats st;
};

void kvf_router_index_cfg_default(kvf_router_index_cfg *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->block_size = 16;
    cfg->stale_after_s = 10;
    cfg->decay_s = 30;
    cfg->forget_below = 0.05;
}

const char *kvf_router_worker_state_name(kvf_router_worker_state s)
{
    switch (s) {
    case KVF_ROUTER_WORKER_ABSENT: return "absent";
    case KVF_ROUTER_WORKER_LIVE: return "live";
    case KVF_ROUTER_WORKER_RESYNC: return "resync";
    case KVF_ROUTER_WORKER_STALE: return "stale";
    }
    return "?";
}

static inline uint64_t norm_key(uint64_t h) { return h ? h : KEY_ZERO; }

static inline uint64_t home_of(const kvf_router_index *idx, uint64_t key)
{
    return (key * 0x9E3779B97F4A7C15ull) >> idx->shift;
}

/* Slot holding key, or -1. */
static inline int64_t find_from(const kvf_router_index *idx, uint64_t key, uint64_t i)
{
    for (;; i = (i + 1) & idx->mask) {
        uint64_t k = idx->slots[i].key;
        if (k == key)
            return (int64_t)i;
        if (k == 0)
            return -1;
    }
}

static inline int64_t find(const kvf_router_index *idx, uint64_t key)
{
    return find_from(idx, key, home_of(idx, key));
}

/* Large tables sit on 2 MiB pages where the kernel allows (madvise mode): lookups are random
 * accesses, and without huge pages each one also walks the page table. */
static slot *slots_alloc(uint64_t cap)
{
    size_t bytes = (size_t)cap * sizeof(slot);
    const size_t huge = (size_t)2 << 20;
    if (bytes < huge)
        return calloc(cap, sizeof(slot));
    void *p = NULL;
    if (posix_memalign(&p, huge, bytes) != 0)
        return NULL;
    madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, 0, bytes);
    return p;
}

static kvf_status table_alloc(kvf_router_index *idx, uint64_t cap)
{
    slot *s = slots_alloc(cap);
    if (!s)
        return KVF_ERR_NOMEM;
    idx->slots = s;
    idx->mask = cap - 1;
    idx->shift = 64 - __builtin_ctzll(cap);
    return KVF_OK;
}

static kvf_status table_grow(kvf_router_index *idx)
{
    slot *old = idx->slots;
    tier_bits *old_tiers = idx->tiers, *tiers = NULL;
    uint64_t old_mask = idx->mask, old_cap = old_mask + 1;
    int old_shift = idx->shift;
    if (old_tiers && !(tiers = calloc(old_cap * 2, sizeof *tiers)))
        return KVF_ERR_NOMEM;
    if (table_alloc(idx, old_cap * 2) != KVF_OK) {
        free(tiers);
        idx->slots = old;
        idx->mask = old_mask;
        idx->shift = old_shift;
        return KVF_ERR_NOMEM;
    }
    for (uint64_t i = 0; i < old_cap; i++) {
        if (!old[i].key)
            continue;
        uint64_t j = home_of(idx, old[i].key);
        while (idx->slots[j].key)
            j = (j + 1) & idx->mask;
        idx->slots[j] = old[i];
        if (tiers)
            tiers[j] = old_tiers[i];
    }
    free(old);
    free(old_tiers);
    idx->tiers = tiers;
    return KVF_OK;
}

/* Puts worker w's copy of the block in slot i into tier (KVF_ROUTER_TIER_*). */
static int set_tier(kvf_router_index *idx, uint64_t i, int32_t w, int tier)
{
    uint64_t bit = 1ull << w;
    if (!idx->tiers) {
        if (tier == KVF_ROUTER_TIER_POOL)
            return 0;
        if (!(idx->tiers = calloc(idx->mask + 1, sizeof *idx->tiers)))
            return -1;
    }
    tier_bits *t = &idx->tiers[i];
    idx->lower_pairs -= (int64_t)((t->host & bit) != 0) + (int64_t)((t->disk & bit) != 0);
    idx->host_pairs -= (int64_t)((t->host & bit) != 0);
    t->host &= ~bit;
    t->disk &= ~bit;
    if (tier == KVF_ROUTER_TIER_HOST)
        t->host |= bit;
    else if (tier == KVF_ROUTER_TIER_DISK)
        t->disk |= bit;
    idx->lower_pairs += tier != KVF_ROUTER_TIER_POOL;
    idx->host_pairs += tier == KVF_ROUTER_TIER_HOST;
    return 0;
}

/* Empties slot i, shifting later members of its probe run back so lookups never need tombstones. */
static void table_delete_at(kvf_router_index *idx, uint64_t i)
{
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & idx->mask;
        if (!idx->slots[j].key)
            break;
        uint64_t h = home_of(idx, idx->slots[j].key);
        /* slot j may move to i unless its home lies cyclically in (i, j] */
        bool stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (!stays) {
            idx->slots[i] = idx->slots[j];
            if (idx->tiers)
                idx->tiers[i] = idx->tiers[j];
            i = j;
        }
    }
    idx->slots[i].key = 0;
    idx->slots[i].bits = 0;
    if (idx->tiers)
        idx->tiers[i] = (tier_bits){0, 0};
    idx->count--;
}

static kvf_status held_push(kvf_router_index *idx, worker *wk, uint64_t bit, uint64_t key);

/* Sets worker w's bit on key, its copy in tier. Returns 1 if newly set, 0 if already set (the
 * tier is updated), <0 on no memory. */
static int set_bit_from(kvf_router_index *idx, int32_t w, uint64_t key, uint64_t i, int tier)
{
    uint64_t bit = 1ull << w;
    for (;; i = (i + 1) & idx->mask) {
        slot *s = &idx->slots[i];
        if (s->key == key) {
            if (s->bits & bit)
                return set_tier(idx, i, w, tier) < 0 ? -1 : 0;
            s->bits |= bit;
            break;
        }
        if (s->key == 0) {
            if ((uint64_t)(idx->count + 1) * 4 > (idx->mask + 1) * 3) {
                if (table_grow(idx) != KVF_OK)
                    return -1;
                return set_bit_from(idx, w, key, home_of(idx, key), tier);
            }
            s->key = key;
            s->bits = bit;
            idx->count++;
            break;
        }
    }
    if (set_tier(idx, i, w, tier) < 0) {
        idx->slots[i].bits &= ~bit;
        if (!idx->slots[i].bits)
            table_delete_at(idx, i);
        return -1;
    }
    if (held_push(idx, &idx->w[w], bit, key) != KVF_OK) {
        /* roll back so the reverse list never misses a set bit */
        int64_t at = find(idx, key);
        set_tier(idx, (uint64_t)at, w, KVF_ROUTER_TIER_POOL);
        idx->slots[at].bits &= ~bit;
        if (!idx->slots[at].bits)
            table_delete_at(idx, (uint64_t)at);
        return -1;
    }
    idx->w[w].n_held++;
    return 1;
}

/* Clears worker w's bit on key; returns 1 if it was set. */
static int clear_bit_from(kvf_router_index *idx, int32_t w, uint64_t key, uint64_t home)
{
    int64_t at = find_from(idx, key, home);
    uint64_t bit = 1ull << w;
    if (at < 0 || !(idx->slots[at].bits & bit))
        return 0;
    if (idx->tiers)
        set_tier(idx, (uint64_t)at, w, KVF_ROUTER_TIER_POOL);
    idx->slots[at].bits &= ~bit;
    if (!idx->slots[at].bits)
        table_delete_at(idx, (uint64_t)at);
    idx->w[w].n_held--;
    return 1;
}

/* Keeps only the live, distinct entries of a worker's reverse list. Distinctness without a set:
 * each kept entry's bit is cleared while scanning (so a repeat no longer matches), then restored. */
static void held_compact(kvf_router_index *idx, worker *wk, uint64_t bit)
{
    size_t k = 0;
    for (size_t i = 0; i < wk->held_len; i++) {
        int64_t at = find(idx, wk->held[i]);
        if (at >= 0 && (idx->slots[at].bits & bit)) {
            idx->slots[at].bits &= ~bit;
            wk->held[k++] = wk->held[i];
        }
    }
    for (size_t i = 0; i < k; i++)
        idx->slots[find(idx, wk->held[i])].bits |= bit;
    wk->held_len = k;
}

static kvf_status held_push(kvf_router_index *idx, worker *wk, uint64_t bit, uint64_t key)
{
    if (wk->held_len == wk->held_cap) {
        if (wk->held_len >= 1024 && wk->held_len >= 2 * (size_t)wk->n_held + 2)
            held_compact(idx, wk, bit);
        if (wk->held_len == wk->held_cap || wk->held_cap - wk->held_len < wk->held_cap / 4) {
            size_t cap = wk->held_cap ? wk->held_cap * 2 : 256;
            uint64_t *h = realloc(wk->held, cap * sizeof *h);
            if (!h)
                return KVF_ERR_NOMEM;
            wk->held = h;
            wk->held_cap = cap;
        }
    }
    wk->held[wk->held_len++] = key;
    return KVF_OK;
}

kvf_status kvf_router_index_create(const kvf_router_index_cfg *cfg, kvf_router_index **out,
                                   kvf_err *err)
{
    if (!cfg || !cfg->model || !*cfg->model)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: index: a model id is required");
    if (cfg->block_size <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: index: block_size %d is not valid (use a positive power of two)",
                           cfg->block_size);
    if (cfg->expected_blocks < 0 || cfg->expected_blocks > ((int64_t)1 << 40))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: index: expected_blocks %lld is out of range (0 .. 2^40)",
                           (long long)cfg->expected_blocks);
    kvf_router_index *idx = calloc(1, sizeof *idx);
    if (!idx)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: index: out of memory");
    idx->cfg = *cfg;
    idx->model = strdup(cfg->model);
    idx->cfg.model = idx->model;
    uint64_t cap = 1024;
    while ((double)cap * 0.75 < (double)cfg->expected_blocks + 1)
        cap *= 2;
    if (!idx->model || table_alloc(idx, cap) != KVF_OK) {
        free(idx->model);
        free(idx);
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: index: out of memory for %llu slots",
                           (unsigned long long)cap);
    }
    idx->root = kvf_kv_hash_root(idx->model, NULL, 0);
    *out = idx;
    return KVF_OK;
}

void kvf_router_index_destroy(kvf_router_index *idx)
{
    if (!idx)
        return;
    for (int w = 0; w < KVF_ROUTER_MAX_WORKERS; w++)
        free(idx->w[w].held);
    free(idx->slots);
    free(idx->tiers);
    free(idx->model);
    free(idx);
}

static bool worker_ok(const kvf_router_index *idx, int32_t w)
{
    return w >= 0 && w < KVF_ROUTER_MAX_WORKERS && (idx->registered >> w & 1);
}

/* Refuses a model or block size other than the index's, with one log line per worker. */
static kvf_status check_identity(kvf_router_index *idx, int32_t w, const char *model,
                                 int32_t block_size, const char *what, kvf_err *err)
{
    const char *why = NULL;
    if (block_size != idx->cfg.block_size)
        why = "block size";
    else if (!model || strcmp(model, idx->model) != 0)
        why = "model";
    if (!why)
        return KVF_OK;
    idx->st.refused++;
    kvf_err local;
    kvf_err *e = err ? err : &local;
    kvf_status st = kvf_err_set(e, KVF_ERR_INVALID,
                                "router: worker %d: %s refused: %s differs (got block size %d, "
                                "model '%s'; this router uses block size %d, model '%s')",
                                w, what, why, block_size, model ? model : "(none)",
                                idx->cfg.block_size, idx->model);
    bool in_range = w >= 0 && w < KVF_ROUTER_MAX_WORKERS;
    if (!in_range || !idx->w[w].warned)
        kvf_log(KVF_LOG_WARN, "%s", e->msg);
    if (in_range)
        idx->w[w].warned = true;
    return st;
}

kvf_status kvf_router_index_worker_add(kvf_router_index *idx, int32_t w, const char *model,
                                       int32_t block_size, double now, kvf_err *err)
{
    if (w < 0 || w >= KVF_ROUTER_MAX_WORKERS)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: worker id %d is out of range (0..%d)",
                           w, KVF_ROUTER_MAX_WORKERS - 1);
    kvf_status st = check_identity(idx, w, model, block_size, "registration", err);
    if (st != KVF_OK)
        return st;
    worker *wk = &idx->w[w];
    if (!worker_ok(idx, w)) {
        memset(wk, 0, sizeof *wk);
        wk->state = KVF_ROUTER_WORKER_LIVE;
    }
    wk->last_seen = now;
    idx->registered |= 1ull << w;
    return KVF_OK;
}

void kvf_router_index_worker_clear(kvf_router_index *idx, int32_t w)
{
    if (!worker_ok(idx, w))
        return;
    worker *wk = &idx->w[w];
    for (size_t i = 0; i < wk->held_len; i++)
        clear_bit_from(idx, w, wk->held[i], home_of(idx, wk->held[i]));
    wk->held_len = 0;
    wk->n_held = 0;
    wk->seq_known = false;
    wk->state = KVF_ROUTER_WORKER_RESYNC;
}

void kvf_router_index_worker_remove(kvf_router_index *idx, int32_t w)
{
    if (!worker_ok(idx, w))
        return;
    kvf_router_index_worker_clear(idx, w);
    free(idx->w[w].held);
    memset(&idx->w[w], 0, sizeof idx->w[w]);
    idx->registered &= ~(1ull << w);
}

kvf_router_worker_state kvf_router_index_worker_state(const kvf_router_index *idx, int32_t w,
                                                      double now)
{
    if (!worker_ok(idx, w))
        return KVF_ROUTER_WORKER_ABSENT;
    const worker *wk = &idx->w[w];
    if (wk->state == KVF_ROUTER_WORKER_LIVE && idx->cfg.stale_after_s > 0 &&
        now - wk->last_seen > idx->cfg.stale_after_s)
        return KVF_ROUTER_WORKER_STALE;
    return wk->state;
}

void kvf_router_index_heartbeat(kvf_router_index *idx, int32_t w, double now)
{
    if (worker_ok(idx, w) && now > idx->w[w].last_seen)
        idx->w[w].last_seen = now;
}

double kvf_router_index_trust(const kvf_router_index *idx, int32_t w, double now)
{
    double decay = idx->cfg.decay_s > 0 ? idx->cfg.decay_s : 1e-9;
    switch (kvf_router_index_worker_state(idx, w, now)) {
    case KVF_ROUTER_WORKER_LIVE: return 1.0;
    case KVF_ROUTER_WORKER_STALE:
        return exp(-(now - idx->w[w].last_seen - idx->cfg.stale_after_s) / decay);
    case KVF_ROUTER_WORKER_RESYNC:
        return now <= idx->w[w].gap_at ? 1.0 : exp(-(now - idx->w[w].gap_at) / decay);
    case KVF_ROUTER_WORKER_ABSENT: break;
    }
    return 0.0;
}

uint64_t kvf_router_index_workers(const kvf_router_index *idx) { return idx->registered; }

int kvf_router_index_expire(kvf_router_index *idx, double now)
{
    int n = 0;
    for (int32_t w = 0; w < KVF_ROUTER_MAX_WORKERS; w++) {
        if (!worker_ok(idx, w) || idx->w[w].n_held == 0)
            continue;
        double t = kvf_router_index_trust(idx, w, now);
        if (t < idx->cfg.forget_below) {
            kvf_log(KVF_LOG_INFO, "router: worker %d: silent for %.1f s (trust %.3f): forgetting "
                    "its %lld blocks", w, now - idx->w[w].last_seen, t,
                    (long long)idx->w[w].n_held);
            kvf_router_index_worker_clear(idx, w);
            n++;
        }
    }
    return n;
}

/* Applies hashes[0..n) to worker w, prefetching each run's home slots first. */
static kvf_status apply_blocks(kvf_router_index *idx, int32_t w, const uint64_t *hashes, size_t n,
                               bool add, int tier, const uint8_t *tiers)
{
    uint64_t keys[PREFETCH_RUN], homes[PREFETCH_RUN];
    for (size_t i = 0; i < n; i += PREFETCH_RUN) {
        size_t m = n - i < PREFETCH_RUN ? n - i : PREFETCH_RUN;
        for (size_t k = 0; k < m; k++) {
            keys[k] = norm_key(hashes[i + k]);
            homes[k] = home_of(idx, keys[k]);
            __builtin_prefetch(&idx->slots[homes[k]], 1);
        }
        uint64_t mask_at_start = idx->mask;
        for (size_t k = 0; k < m; k++) {
            uint64_t h = idx->mask == mask_at_start ? homes[k] : home_of(idx, keys[k]);
            if (add) {
                if (set_bit_from(idx, w, keys[k], h, tiers ? tiers[i + k] : tier) < 0)
                    return KVF_ERR_NOMEM;
            } else {
                clear_bit_from(idx, w, keys[k], h);
            }
        }
    }
    idx->st.ops += (int64_t)n;
    return KVF_OK;
}

kvf_status kvf_router_index_apply(kvf_router_index *idx, const kvf_router_event *ev, double now,
                                  kvf_err *err)
{
    if (!ev || (ev->n && !ev->hashes))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: event without hashes");
    int32_t w = ev->worker;
    if (!worker_ok(idx, w))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: event from worker %d, which is not registered", w);
    static const char *const kinds[] = {"snapshot", "stored event", "removed event"};
    const char *kind = (unsigned)ev->kind < 3 ? kinds[ev->kind] : "event";
    kvf_status st = check_identity(idx, w, ev->model, ev->block_size, kind, err);
    if (st != KVF_OK)
        return st;
    if ((unsigned)ev->tier > KVF_ROUTER_TIER_DISK)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: worker %d: %s names tier %d (use 0 pool, "
                           "1 host, 2 disk)", w, kind, (int)ev->tier);
    for (size_t i = 0; ev->tiers && i < ev->n; i++)
        if (ev->tiers[i] > KVF_ROUTER_TIER_DISK)
            return kvf_err_set(err, KVF_ERR_INVALID, "router: worker %d: %s block %zu names tier "
                               "%d (use 0 pool, 1 host, 2 disk)", w, kind, i, (int)ev->tiers[i]);
    worker *wk = &idx->w[w];
    idx->st.events++;
    if (ev->kind == KVF_ROUTER_EV_SNAPSHOT) {
        kvf_router_index_worker_clear(idx, w);
        if ((st = apply_blocks(idx, w, ev->hashes, ev->n, true, ev->tier, ev->tiers)) != KVF_OK)
            return kvf_err_set(err, st, "router: worker %d: snapshot of %zu blocks: out of memory",
                               w, ev->n);
        for (size_t i = 0; ev->parents && i < ev->n; i++) {
            uint64_t p = ev->parents[i];
            if (p != idx->root && p != 0 && !(kvf_router_index_lookup(idx, p) >> w & 1))
                idx->st.orphans++;
        }
        wk->state = KVF_ROUTER_WORKER_LIVE;
        wk->seq_known = true;
        wk->next_seq = ev->seq + 1;
        wk->last_seen = now;
        return KVF_OK;
    }
    if (ev->kind != KVF_ROUTER_EV_STORED && ev->kind != KVF_ROUTER_EV_REMOVED)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: worker %d: unknown event kind %d", w,
                           (int)ev->kind);
    if (wk->state == KVF_ROUTER_WORKER_RESYNC)
        return kvf_err_set(err, KVF_ERR_STATE,
                           "router: worker %d: %s seq %llu refused: waiting for a snapshot", w,
                           kind, (unsigned long long)ev->seq);
    if (wk->seq_known && ev->seq < wk->next_seq) {
        wk->last_seen = now > wk->last_seen ? now : wk->last_seen;
        return KVF_OK; /* a duplicate, already applied */
    }
    if (wk->seq_known && ev->seq > wk->next_seq) {
        idx->st.gaps++;
        wk->state = KVF_ROUTER_WORKER_RESYNC;
        wk->gap_at = now;
        kvf_log(KVF_LOG_WARN, "router: worker %d: event seq %llu after %llu: %llu missing, "
                "asking for a snapshot", w, (unsigned long long)ev->seq,
                (unsigned long long)(wk->next_seq - 1),
                (unsigned long long)(ev->seq - wk->next_seq));
        return kvf_err_set(err, KVF_ERR_STATE,
                           "router: worker %d: sequence gap (got %llu, expected %llu): resync needed",
                           w, (unsigned long long)ev->seq, (unsigned long long)wk->next_seq);
    }
    st = apply_blocks(idx, w, ev->hashes, ev->n, ev->kind == KVF_ROUTER_EV_STORED, ev->tier,
                      ev->tiers);
    if (st != KVF_OK) {
        wk->state = KVF_ROUTER_WORKER_RESYNC;
        wk->gap_at = now;
        return kvf_err_set(err, st, "router: worker %d: %s of %zu blocks: out of memory", w, kind,
                           ev->n);
    }
    wk->seq_known = true;
    wk->next_seq = ev->seq + 1;
    wk->last_seen = now;
    return KVF_OK;
}

kvf_status kvf_router_index_block_add(kvf_router_index *idx, int32_t w, uint64_t hash)
{
    if (!worker_ok(idx, w))
        return KVF_ERR_INVALID;
    uint64_t key = norm_key(hash);
    idx->st.ops++;
    return set_bit_from(idx, w, key, home_of(idx, key), KVF_ROUTER_TIER_POOL) < 0 ? KVF_ERR_NOMEM
                                                                                  : KVF_OK;
}

void kvf_router_index_block_remove(kvf_router_index *idx, int32_t w, uint64_t hash)
{
    if (!worker_ok(idx, w))
        return;
    uint64_t key = norm_key(hash);
    idx->st.ops++;
    clear_bit_from(idx, w, key, home_of(idx, key));
}

uint64_t kvf_router_index_lookup(kvf_router_index *idx, uint64_t hash)
{
    int64_t at = find(idx, norm_key(hash));
    return at < 0 ? 0 : idx->slots[at].bits;
}

/* Looks up hashes[0..m) (m <= OVERLAP_RUN) with every load in flight at once. */
static void lookup_run(const kvf_router_index *idx, const uint64_t *hashes, size_t m,
                       uint64_t *bits_out)
{
    uint64_t keys[OVERLAP_RUN], homes[OVERLAP_RUN];
    for (size_t k = 0; k < m; k++) {
        keys[k] = norm_key(hashes[k]);
        homes[k] = home_of(idx, keys[k]);
        __builtin_prefetch(&idx->slots[homes[k]]);
    }
    for (size_t k = 0; k < m; k++) {
        int64_t at = find_from(idx, keys[k], homes[k]);
        bits_out[k] = at < 0 ? 0 : idx->slots[at].bits;
    }
}

#define GRID 16

/* Overlap for prefix-closed caches: sample GRID evenly spaced blocks, then read only the
 * stretches between samples where some holder drops out. */
static size_t overlap_sampled(kvf_router_index *idx, const uint64_t *hashes, size_t n,
                              uint64_t alive, uint32_t *out)
{
    size_t step = (n + GRID - 1) / GRID, n_samples = (n + step - 1) / step;
    uint64_t sample_h[GRID] = {0}, sample_bits[GRID] = {0}, seg_bits[OVERLAP_RUN];
    for (size_t k = 0; k < n_samples; k++) {
        size_t pos = (k + 1) * step - 1;
        sample_h[k] = hashes[pos < n ? pos : n - 1];
    }
    lookup_run(idx, sample_h, n_samples, sample_bits);
    size_t looked = n_samples, prev_pos = 0; /* blocks [0, prev_pos) are held by all of alive */
    for (size_t k = 0; k < n_samples && alive; k++) {
        size_t pos = (k + 1) * step - 1;
        pos = pos < n ? pos : n - 1;
        uint64_t held = sample_bits[k] & alive, dropped = alive & ~held;
        if (dropped) {
            /* each dropped worker's first missing block is in [prev_pos, pos] */
            size_t m = pos - prev_pos;
            for (size_t off = 0; off < m && dropped; off += OVERLAP_RUN) {
                size_t r = m - off < OVERLAP_RUN ? m - off : OVERLAP_RUN;
                lookup_run(idx, hashes + prev_pos + off, r, seg_bits);
                looked += r;
                for (size_t j = 0; j < r && dropped; j++) {
                    for (uint64_t lost = dropped & ~seg_bits[j]; lost; lost &= lost - 1)
                        out[__builtin_ctzll(lost)] = (uint32_t)(prev_pos + off + j);
                    dropped &= seg_bits[j];
                }
            }
            for (; dropped; dropped &= dropped - 1)
                out[__builtin_ctzll(dropped)] = (uint32_t)pos;
        }
        alive = held;
        prev_pos = pos + 1;
    }
    for (uint64_t a = alive; a; a &= a - 1)
        out[__builtin_ctzll(a)] = (uint32_t)n;
    return looked;
}

size_t kvf_router_index_overlap(kvf_router_index *idx, const uint64_t *hashes, size_t n,
                                uint64_t mask, uint32_t *overlap_out)
{
    memset(overlap_out, 0, KVF_ROUTER_MAX_WORKERS * sizeof *overlap_out);
    uint64_t alive = mask & idx->registered;
    if (idx->cfg.prefix_closed && n >= 2 * GRID) {
        idx->st.ops += (int64_t)overlap_sampled(idx, hashes, n, alive, overlap_out);
        size_t best = 0;
        for (uint64_t m2 = alive; m2; m2 &= m2 - 1)
            if (overlap_out[__builtin_ctzll(m2)] > best)
                best = overlap_out[__builtin_ctzll(m2)];
        return best;
    }
    uint64_t keys[OVERLAP_RUN], homes[OVERLAP_RUN];
    size_t i = 0, looked = 0;
    while (i < n && alive) {
        size_t m = n - i < OVERLAP_RUN ? n - i : OVERLAP_RUN;
        for (size_t k = 0; k < m; k++) {
            keys[k] = norm_key(hashes[i + k]);
            homes[k] = home_of(idx, keys[k]);
            __builtin_prefetch(&idx->slots[homes[k]]);
        }
        size_t k = 0;
        for (; k < m && alive; k++) {
            int64_t at = find_from(idx, keys[k], homes[k]);
            uint64_t bits = at < 0 ? 0 : idx->slots[at].bits;
            for (uint64_t lost = alive & ~bits; lost; lost &= lost - 1)
                overlap_out[__builtin_ctzll(lost)] = (uint32_t)(i + k);
            alive &= bits;
        }
        looked += k;
        i += k;
    }
    for (uint64_t a = alive; a; a &= a - 1)
        overlap_out[__builtin_ctzll(a)] = (uint32_t)n;
    idx->st.ops += (int64_t)looked;
    size_t best = 0;
    for (uint64_t m2 = mask & idx->registered; m2; m2 &= m2 - 1)
        if (overlap_out[__builtin_ctzll(m2)] > best)
            best = overlap_out[__builtin_ctzll(m2)];
    return best;
}

void kvf_router_index_set_prefix_closed(kvf_router_index *idx, bool on)
{
    idx->cfg.prefix_closed = on;
}

void kvf_router_index_stats_get(const kvf_router_index *idx, kvf_router_index_stats *out)
{
    *out = idx->st;
    out->n_blocks = idx->count;
    out->n_pairs = 0;
    int64_t bytes = (int64_t)sizeof *idx + (int64_t)(idx->mask + 1) * (int64_t)sizeof(slot);
    if (idx->tiers)
        bytes += (int64_t)(idx->mask + 1) * (int64_t)sizeof(tier_bits);
    for (int w = 0; w < KVF_ROUTER_MAX_WORKERS; w++) {
        out->n_pairs += idx->w[w].n_held;
        bytes += (int64_t)idx->w[w].held_cap * 8;
    }
    out->n_pairs_host = idx->host_pairs;
    out->n_pairs_disk = idx->lower_pairs - idx->host_pairs;
    out->bytes = bytes;
    out->bytes_per_block = idx->count ? (double)bytes / (double)idx->count : 0.0;
}

int64_t kvf_router_index_worker_blocks(const kvf_router_index *idx, int32_t w)
{
    return worker_ok(idx, w) ? idx->w[w].n_held : 0;
}

int kvf_router_index_tier(kvf_router_index *idx, int32_t w, uint64_t hash)
{
    if (!worker_ok(idx, w))
        return -1;
    int64_t at = find(idx, norm_key(hash));
    uint64_t bit = 1ull << w;
    if (at < 0 || !(idx->slots[at].bits & bit))
        return -1;
    if (!idx->tiers)
        return KVF_ROUTER_TIER_POOL;
    const tier_bits *t = &idx->tiers[at];
    return t->host & bit ? KVF_ROUTER_TIER_HOST : t->disk & bit ? KVF_ROUTER_TIER_DISK
                                                                : KVF_ROUTER_TIER_POOL;
}

bool kvf_router_index_has_tiers(const kvf_router_index *idx) { return idx->lower_pairs > 0; }

/* First position in [lo, hi) whose block worker w holds in a tier >= min_tier (hi if none),
 * by bisection: tiers are taken to only deepen along a prompt. */
static uint32_t first_at_tier(kvf_router_index *idx, const uint64_t *hashes, int32_t w,
                              uint32_t lo, uint32_t hi, int min_tier)
{
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int t = kvf_router_index_tier(idx, w, hashes[mid]);
        idx->st.ops++;
        if (t >= min_tier || t < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

void kvf_router_index_overlap_tiers(kvf_router_index *idx, const uint64_t *hashes, uint64_t mask,
                                    const uint32_t *overlap, uint32_t *host_out,
                                    uint32_t *disk_out)
{
    memset(host_out, 0, KVF_ROUTER_MAX_WORKERS * sizeof *host_out);
    memset(disk_out, 0, KVF_ROUTER_MAX_WORKERS * sizeof *disk_out);
    if (!idx->lower_pairs)
        return;
    for (uint64_t m = mask & idx->registered; m; m &= m - 1) {
        int32_t w = __builtin_ctzll(m);
        uint32_t n = overlap[w];
        if (!n)
            continue;
        uint32_t lower = first_at_tier(idx, hashes, w, 0, n, KVF_ROUTER_TIER_HOST);
        uint32_t disk = first_at_tier(idx, hashes, w, lower, n, KVF_ROUTER_TIER_DISK);
        host_out[w] = disk - lower;
        disk_out[w] = n - disk;
    }
}
