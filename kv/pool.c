/* pool.c: the block pool, block tables, prefix cache and invariant checker of kv/pool.h.
 * Per-block metadata lives in host arrays beside the (possibly device) block memory; the hash
 * map is open addressing with linear probing and backward-shift deletion, so nothing here
 * allocates after create except block tables that grow. */
#include "kv/pool.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "kv/hash.h"
#include "kv/pool_internal.h"
#include "kv/swap.h"
#include "kv/tier_internal.h"

/* ---- host memory ops ----------------------------------------------------------------------- */

static kvf_status host_alloc(void *ctx, int64_t bytes, void **base_out, kvf_err *err)
{
    (void)ctx;
    int64_t rounded = (bytes + 63) / 64 * 64;
    if (bytes <= 0 || rounded < bytes || (uint64_t)rounded > (uint64_t)SIZE_MAX)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: host pool of %lld bytes cannot be allocated",
                           (long long)bytes);
    void *p = aligned_alloc(64, (size_t)rounded);
    if (!p)
        return kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of host memory for a pool of %lld bytes",
                           (long long)bytes);
    /* Touched now, at start: left to the first write of each page, decode paid a page fault and
     * a page clear inside its KV write every few tokens (a 15M model's 1-token KV write took
     * 10 us a layer), and a server its first request per page. The pool is the worker's to
     * keep, so its memory is committed up front (as llama.cpp clears its KV buffer). */
    memset(p, 0, (size_t)rounded);
    *base_out = p;
    return KVF_OK;
}

static void host_free(void *ctx, void *base, int64_t bytes)
{
    (void)ctx, (void)bytes;
    free(base);
}

static kvf_status host_copy_block(void *ctx, void *base, int64_t block_bytes, int32_t dst,
                                  int32_t src, kvf_err *err)
{
    (void)ctx, (void)err;
    char *b = base;
    memcpy(b + (int64_t)dst * block_bytes, b + (int64_t)src * block_bytes, (size_t)block_bytes);
    return KVF_OK;
}

static kvf_status host_to_host(void *ctx, void *host_dst, const void *base, int64_t block_bytes,
                               int32_t block, kvf_err *err)
{
    (void)ctx, (void)err;
    memcpy(host_dst, (const char *)base + (int64_t)block * block_bytes, (size_t)block_bytes);
    return KVF_OK;
}

static kvf_status host_from_host(void *ctx, void *base, int64_t block_bytes, int32_t block,
                                 const void *host_src, kvf_err *err)
{
    (void)ctx, (void)err;
    memcpy((char *)base + (int64_t)block * block_bytes, host_src, (size_t)block_bytes);
    return KVF_OK;
}

const kvf_kv_mem_ops kvf_kv_mem_host = {
    .name = "host",
    .alloc = host_alloc,
    .free = host_free,
    .copy_block = host_copy_block,
    .to_host = host_to_host,
    .from_host = host_from_host,
    .from_host_any_thread = true,
};

/* ---- the pool ------------------------------------------------------------------------------ */

typedef struct kv_block {
    uint64_t hash, parent; /* valid while registered */
    int64_t stamp;         /* when it last became idle (LRU order, retention) */
    int32_t ref, pin;
    int32_t prev, next; /* LRU links while CACHED, else -1 */
    int32_t free_pos;   /* index in the free stack while FREE, else -1 */
    uint8_t registered;
    uint8_t promoting;  /* a tier promotion's copy writes into it (hash/parent/tokens set, not
                         * registered until it completes) */
    int32_t promo_pos;  /* while promoting and held: its position in promo_seq's table */
    kvf_kv_seq *promo_seq; /* while promoting: the sequence holding it; NULL once it lands */
} kv_block;

struct kvf_kv_pool {
    kvf_kv_pool_cfg cfg;
    const kvf_kv_mem_ops *mem;
    void *base;
    int64_t bytes, block_bytes;
    int32_t n, bs, bs_shift; /* bs == 1 << bs_shift */
    kv_block *blk;      /* [n] */
    int32_t *tokens;    /* [n][bs] token ids of registered blocks */
    int32_t *free_stack; /* [n], top at n_free - 1 */
    int32_t n_free;
    int32_t lru_head, lru_tail, n_cached; /* head: least recently used */
    int32_t n_pinned, n_used;
    int32_t n_landing, n_promoting; /* LANDING blocks; blocks a promotion writes into */
    int32_t *map; /* [map_mask + 1] block ids or -1, keyed by blk[id].hash */
    uint64_t map_mask;
    int32_t n_map;
    int32_t *scratch; /* [n] counters, all zero between calls */
    kvf_kv_tier *tier; /* cfg.tier, attached; NULL: no tiers */
    kvf_kv_pool_stats st;
};

static int64_t pool_now(const kvf_kv_pool *p)
{
    return p->cfg.clock_ns ? p->cfg.clock_ns(p->cfg.clock_ctx) : kvf_now_ns();
}

static void emit(kvf_kv_pool *p, kvf_kv_event_type type, int32_t id)
{
    if (!p->cfg.on_event)
        return;
    const kv_block *b = &p->blk[id];
    kvf_kv_event ev = {.type = type, .hash = b->hash, .parent_hash = b->parent, .block = id};
    if (type == KVF_KV_EVENT_STORED) {
        ev.tokens = p->tokens + (int64_t)id * p->bs;
        ev.n_tokens = p->bs;
    }
    p->cfg.on_event(p->cfg.event_ctx, &ev);
}

/* Tier events go out through the pool's callback (set at attach). */
static void pool_tier_event(void *ctx, const kvf_kv_event *ev)
{
    const kvf_kv_pool *p = ctx;
    if (p->cfg.on_event)
        p->cfg.on_event(p->cfg.event_ctx, ev);
}

/* -- hash map -- */

static int32_t map_find(const kvf_kv_pool *p, uint64_t h)
{
    for (uint64_t i = h & p->map_mask;; i = (i + 1) & p->map_mask) {
        int32_t id = p->map[i];
        if (id < 0 || p->blk[id].hash == h)
            return id;
    }
}

static void map_insert(kvf_kv_pool *p, int32_t id)
{
    uint64_t i = p->blk[id].hash & p->map_mask;
    while (p->map[i] >= 0)
        i = (i + 1) & p->map_mask;
    p->map[i] = id;
    p->n_map++;
}

static void map_remove(kvf_kv_pool *p, int32_t id)
{
    uint64_t i = p->blk[id].hash & p->map_mask;
    while (p->map[i] != id)
        i = (i + 1) & p->map_mask;
    /* Backward-shift deletion: move later entries of the probe run into the hole when their
     * home slot does not lie (cyclically) between the hole and them. */
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & p->map_mask; p->map[j] >= 0; j = (j + 1) & p->map_mask) {
        uint64_t home = p->blk[p->map[j]].hash & p->map_mask;
        if (((j - home) & p->map_mask) >= ((j - hole) & p->map_mask)) {
            p->map[hole] = p->map[j];
            hole = j;
        }
    }
    p->map[hole] = -1;
    p->n_map--;
}

/* -- free stack and LRU -- */

static void free_push(kvf_kv_pool *p, int32_t id)
{
    p->blk[id].free_pos = p->n_free;
    p->free_stack[p->n_free++] = id;
}

static void free_remove(kvf_kv_pool *p, int32_t id)
{
    int32_t pos = p->blk[id].free_pos, last = p->free_stack[--p->n_free];
    p->free_stack[pos] = last;
    p->blk[last].free_pos = pos;
    p->blk[id].free_pos = -1;
}

static void lru_push_tail(kvf_kv_pool *p, int32_t id, int64_t now)
{
    kv_block *b = &p->blk[id];
    b->stamp = now;
    b->prev = p->lru_tail;
    b->next = -1;
    if (p->lru_tail >= 0)
        p->blk[p->lru_tail].next = id;
    else
        p->lru_head = id;
    p->lru_tail = id;
    p->n_cached++;
}

static void lru_remove(kvf_kv_pool *p, int32_t id)
{
    kv_block *b = &p->blk[id];
    if (b->prev >= 0)
        p->blk[b->prev].next = b->next;
    else
        p->lru_head = b->next;
    if (b->next >= 0)
        p->blk[b->next].prev = b->prev;
    else
        p->lru_tail = b->prev;
    b->prev = b->next = -1;
    p->n_cached--;
}

static void unregister(kvf_kv_pool *p, int32_t id)
{
    emit(p, KVF_KV_EVENT_REMOVED, id);
    map_remove(p, id);
    p->blk[id].registered = 0;
    p->st.removed++;
}

/* A registered block taken off the LRU for reuse leaves the pool: with tiers it is demoted into
 * the host tier (its bytes copied out with mem->to_host; STORED, tier HOST), else, or when the
 * copy fails, dropped (REMOVED). */
static void evict_registered(kvf_kv_pool *p, int32_t id)
{
    kv_block *b = &p->blk[id];
    if (p->tier) {
        int32_t slot;
        void *dst = kvf_kv_tier_put_begin(p->tier, &slot);
        kvf_err err = {0};
        if (!dst) { /* every host slot is busy with a promotion */
            unregister(p, id);
            return;
        }
        if (p->mem->to_host(p->cfg.mem_ctx, dst, p->base, p->block_bytes, id, &err) == KVF_OK) {
            map_remove(p, id);
            b->registered = 0;
            kvf_kv_tier_put_commit(p->tier, slot, b->hash, b->parent,
                                   p->tokens + (int64_t)id * p->bs, pool_now(p));
            p->st.demoted++;
            return;
        }
        kvf_kv_tier_put_abort(p->tier, slot);
        kvf_log(KVF_LOG_WARN, "kv: demoting block %d to the host tier failed: %s (dropped)", id,
                err.msg);
    }
    unregister(p, id);
}

/* Evicts a CACHED block to FREE. */
static void drop_cached(kvf_kv_pool *p, int32_t id)
{
    lru_remove(p, id);
    unregister(p, id);
    free_push(p, id);
}

int32_t kvf_kv_pool_take_block(kvf_kv_pool *p)
{
    int32_t id;
    if (p->n_free > 0) {
        id = p->free_stack[p->n_free - 1];
        free_remove(p, id);
    } else if (p->lru_head >= 0) {
        id = p->lru_head;
        lru_remove(p, id);
        evict_registered(p, id);
        p->st.evicted++;
    } else {
        return -1;
    }
    p->blk[id].ref = 1;
    p->n_used++;
    return id;
}

/* One more reference on a block that is registered or held. */
static void acquire(kvf_kv_pool *p, int32_t id)
{
    kv_block *b = &p->blk[id];
    if (b->ref == 0) {
        if (b->pin > 0)
            p->n_pinned--;
        else
            lru_remove(p, id);
        p->n_used++;
    }
    b->ref++;
}

/* One reference fewer; the block becomes CACHED, PINNED or FREE at zero. */
static void release(kvf_kv_pool *p, int32_t id, int64_t now)
{
    kv_block *b = &p->blk[id];
    if (--b->ref > 0)
        return;
    p->n_used--;
    if (b->promoting) { /* LANDING: its copy ends in kvf_kv_pool_poll_promotions */
        b->promo_seq = NULL;
        p->n_landing++;
        return;
    }
    if (!b->registered)
        free_push(p, id);
    else if (b->pin > 0)
        p->n_pinned++, b->stamp = now;
    else
        lru_push_tail(p, id, now);
}

void kvf_kv_pool_put_block(kvf_kv_pool *p, int32_t id)
{
    release(p, id, pool_now(p));
}

static bool expired(const kvf_kv_pool *p, const kv_block *b, int64_t now)
{
    return p->cfg.retention_ns > 0 && b->ref == 0 && b->pin == 0 &&
           now - b->stamp > p->cfg.retention_ns;
}

/* The block cached under h whose parent and tokens match, or -1. Counts mismatches. */
static int32_t match_block(kvf_kv_pool *p, uint64_t h, uint64_t parent, const int32_t *toks)
{
    int32_t id = map_find(p, h);
    if (id < 0)
        return -1;
    const kv_block *b = &p->blk[id];
    if (b->parent != parent ||
        memcmp(p->tokens + (int64_t)id * p->bs, toks, (size_t)p->bs * sizeof *toks) != 0) {
        p->st.token_mismatches++;
        return -1;
    }
    return id;
}

kvf_status kvf_kv_pool_create(const kvf_kv_pool_cfg *cfg, kvf_kv_pool **out, kvf_err *err)
{
    if (!cfg || !out)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: pool_create needs a cfg and an out pointer");
    const kvf_kv_layout *l = &cfg->layout;
    kvf_kv_layout check;
    kvf_status st = kvf_kv_layout_init(l->n_layers, l->n_kv_heads, l->head_dim, l->block_size,
                                       l->dtype, &check, err);
    if (st != KVF_OK)
        return kvf_err_prefix(err, "kv: pool layout");
    if (check.block_bytes != l->block_bytes)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "kv: pool layout block_bytes %lld does not match its shape (%lld)",
                           (long long)l->block_bytes, (long long)check.block_bytes);
    if (cfg->n_blocks <= 0 || cfg->n_blocks > INT32_MAX / 2)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: pool n_blocks %d is not allowed (1 to %d)",
                           cfg->n_blocks, INT32_MAX / 2);
    if (l->block_bytes > INT64_MAX / cfg->n_blocks)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: pool of %d blocks of %lld bytes overflows",
                           cfg->n_blocks, (long long)l->block_bytes);
    if (cfg->retention_ns < 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "kv: retention %lld ns is negative (use 0 for no expiry)",
                           (long long)cfg->retention_ns);
    const kvf_kv_mem_ops *mem = cfg->mem ? cfg->mem : &kvf_kv_mem_host;
    if (!mem->alloc || !mem->free || !mem->copy_block || !mem->to_host || !mem->from_host)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "kv: memory ops '%s' lack a function (alloc, free, copy_block, "
                           "to_host and from_host are all required)",
                           mem->name ? mem->name : "?");

    kvf_kv_pool *p = calloc(1, sizeof *p);
    if (!p)
        return kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of memory for the pool");
    p->cfg = *cfg;
    p->mem = mem;
    p->n = cfg->n_blocks;
    p->bs = l->block_size;
    while ((1 << p->bs_shift) < p->bs)
        p->bs_shift++;
    p->block_bytes = l->block_bytes;
    p->bytes = l->block_bytes * p->n;
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)p->n)
        cap <<= 1;
    p->map_mask = cap - 1;
    p->blk = calloc((size_t)p->n, sizeof *p->blk);
    p->tokens = calloc((size_t)p->n * (size_t)p->bs, sizeof *p->tokens);
    p->free_stack = calloc((size_t)p->n, sizeof *p->free_stack);
    p->map = malloc(cap * sizeof *p->map);
    p->scratch = calloc((size_t)p->n, sizeof *p->scratch);
    if (!p->blk || !p->tokens || !p->free_stack || !p->map || !p->scratch) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of memory for the metadata of %d blocks",
                         p->n);
        goto fail_meta;
    }
    st = mem->alloc(cfg->mem_ctx, p->bytes, &p->base, err);
    if (st != KVF_OK)
        goto fail_meta;
    if (cfg->tier && (st = kvf_kv_tier_attach(cfg->tier, l, mem, cfg->mem_ctx, p->base,
                                              pool_tier_event, p, err)) != KVF_OK) {
        mem->free(cfg->mem_ctx, p->base, p->bytes);
        goto fail_meta;
    }
    p->tier = cfg->tier;
    memset(p->map, 0xff, cap * sizeof *p->map);
    p->lru_head = p->lru_tail = -1;
    for (int32_t i = 0; i < p->n; i++) {
        p->blk[i].prev = p->blk[i].next = -1;
        free_push(p, p->n - 1 - i); /* block 0 on top: taken first */
    }
    kvf_log(KVF_LOG_DEBUG, "kv: pool of %d blocks x %lld bytes (%s memory)", p->n,
            (long long)p->block_bytes, mem->name ? mem->name : "?");
    *out = p;
    return KVF_OK;
fail_meta:
    free(p->blk);
    free(p->tokens);
    free(p->free_stack);
    free(p->map);
    free(p->scratch);
    free(p);
    return st;
}

void kvf_kv_pool_destroy(kvf_kv_pool *p)
{
    if (!p)
        return;
    if (p->tier)
        kvf_kv_tier_detach(p->tier);
    p->mem->free(p->cfg.mem_ctx, p->base, p->bytes);
    free(p->blk);
    free(p->tokens);
    free(p->free_stack);
    free(p->map);
    free(p->scratch);
    free(p);
}

const kvf_kv_layout *kvf_kv_pool_layout(const kvf_kv_pool *p) { return &p->cfg.layout; }
void *kvf_kv_pool_base(const kvf_kv_pool *p) { return p->base; }
int64_t kvf_kv_pool_bytes(const kvf_kv_pool *p) { return p->bytes; }
int32_t kvf_kv_pool_available(const kvf_kv_pool *p) { return p->n_free + p->n_cached; }

const kvf_kv_mem_ops *kvf_kv_pool_mem(const kvf_kv_pool *p, void **ctx_out)
{
    *ctx_out = p->cfg.mem_ctx;
    return p->mem;
}

void kvf_kv_pool_get_stats(const kvf_kv_pool *p, kvf_kv_pool_stats *out)
{
    *out = p->st;
    out->total = p->n;
    out->free = p->n_free;
    out->cached = p->n_cached;
    out->pinned = p->n_pinned;
    out->used = p->n_used;
    out->landing = p->n_landing;
    out->promoting = p->n_promoting;
}

void kvf_kv_pool_expire(kvf_kv_pool *p, int32_t *n_out)
{
    int32_t n = 0;
    if (p->cfg.retention_ns > 0) {
        int64_t now = pool_now(p);
        while (p->lru_head >= 0 && expired(p, &p->blk[p->lru_head], now)) {
            drop_cached(p, p->lru_head);
            n++;
        }
    }
    p->st.expired += n;
    if (n_out)
        *n_out = n;
}

void kvf_kv_pool_clear_cache(kvf_kv_pool *p, int32_t *n_out)
{
    int32_t n = 0;
    while (p->lru_head >= 0) {
        drop_cached(p, p->lru_head);
        n++;
    }
    if (p->tier) {
        int32_t nt = 0;
        kvf_kv_tier_clear(p->tier, &nt);
        n += nt;
    }
    if (n_out)
        *n_out = n;
}

/* ---- sequences ----------------------------------------------------------------------------- */

void kvf_kv_seq_init(kvf_kv_seq *seq, kvf_kv_pool *pool, uint64_t root)
{
    memset(seq, 0, sizeof *seq);
    seq->pool = pool;
    seq->root = root;
    seq->state = KVF_KV_SEQ_ACTIVE;
}

void kvf_kv_seq_fini(kvf_kv_seq *seq)
{
    if (!seq)
        return;
    kvf_err err;
    if (seq->state == KVF_KV_SEQ_SWAPPED && seq->swap) {
        kvf_kv_swap_drop(seq->swap, seq, &err);
    } else if (seq->state == KVF_KV_SEQ_ACTIVE && seq->n_blocks > 0 && seq->pool) {
        if (kvf_kv_seq_check_held(seq, &err) == KVF_OK)
            kvf_kv_seq_release_blocks(seq);
        else
            kvf_log(KVF_LOG_ERROR, "%s (table dropped without releasing)", err.msg);
    }
    free(seq->blocks);
    free(seq->hashes);
    memset(seq, 0, sizeof *seq);
    seq->state = KVF_KV_SEQ_RELEASED;
}

kvf_status kvf_kv_seq_reset(kvf_kv_seq *seq, uint64_t root, kvf_err *err)
{
    if (!seq || !seq->pool)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: reset: sequence is not initialised");
    if (seq->state == KVF_KV_SEQ_SWAPPED || seq->n_blocks != 0)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: reset: sequence still holds %d %s (free it "
                           "first)", seq->n_blocks,
                           seq->state == KVF_KV_SEQ_SWAPPED ? "host slots" : "blocks");
    seq->root = root;
    seq->n_tokens = 0;
    seq->n_hashed = 0;
    seq->state = KVF_KV_SEQ_ACTIVE;
    seq->swap = NULL;
    return KVF_OK;
}

kvf_status kvf_kv_seq_reserve(kvf_kv_seq *seq, int32_t n_blocks, kvf_err *err)
{
    if (n_blocks <= seq->cap)
        return KVF_OK;
    int64_t cap = seq->cap < 4 ? 4 : (int64_t)seq->cap * 2;
    if (cap < n_blocks)
        cap = n_blocks;
    if (cap > INT32_MAX)
        cap = INT32_MAX;
    int32_t *b = realloc(seq->blocks, (size_t)cap * sizeof *b);
    if (!b)
        goto nomem;
    seq->blocks = b;
    uint64_t *h = realloc(seq->hashes, (size_t)cap * sizeof *h);
    if (!h)
        goto nomem;
    seq->hashes = h;
    seq->cap = (int32_t)cap;
    return KVF_OK;
nomem:
    return kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of memory growing a block table to %lld blocks",
                       (long long)cap);
}

static kvf_status seq_check_active(const kvf_kv_seq *seq, const char *what, kvf_err *err)
{
    if (!seq || !seq->pool)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: %s: sequence is not initialised", what);
    if (seq->state != KVF_KV_SEQ_ACTIVE)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: %s: sequence is %s (must be active)", what,
                           seq->state == KVF_KV_SEQ_SWAPPED ? "swapped out" : "released");
    return KVF_OK;
}

/* seq_check_active, and no promotion still copying into its blocks. */
static kvf_status seq_check_ready(const kvf_kv_seq *seq, const char *what, kvf_err *err)
{
    kvf_status st = seq_check_active(seq, what, err);
    if (st == KVF_OK && seq->n_promoting > 0)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: %s: %d blocks of the sequence are still being "
                           "promoted from a tier (poll them first)", what, seq->n_promoting);
    return st;
}

int32_t kvf_kv_seq_promotions_pending(const kvf_kv_seq *seq)
{
    return seq->state == KVF_KV_SEQ_ACTIVE ? seq->n_promoting : 0;
}

/* Blocks a write of n_new tokens takes for seq: new blocks, plus 1 when the partial last
 * block is shared and must be copied first (*cow_out). */
static int64_t seq_need(const kvf_kv_pool *p, const kvf_kv_seq *seq, int64_t n_new, int *cow_out)
{
    /* block_size is a power of two: shifts and masks instead of divisions on the step path */
    int64_t mask = p->bs - 1, end = seq->n_tokens + n_new;
    int64_t need = ((end + mask) >> p->bs_shift) - seq->n_blocks;
    *cow_out = n_new > 0 && (seq->n_tokens & mask) != 0 && seq->n_blocks > 0 &&
               p->blk[seq->blocks[seq->n_blocks - 1]].ref > 1;
    return need < 0 ? 0 : need;
}

/* Does the write once its blocks are known to be available and the table big enough. Fails
 * only when mem->copy_block does, leaving seq as it was. */
static kvf_status seq_write(kvf_kv_pool *p, kvf_kv_seq *seq, int64_t n_new, kvf_err *err)
{
    int cow;
    int64_t need = seq_need(p, seq, n_new, &cow);
    if (cow) {
        int32_t last = seq->blocks[seq->n_blocks - 1];
        int32_t nb = kvf_kv_pool_take_block(p);
        kvf_status st = p->mem->copy_block(p->cfg.mem_ctx, p->base, p->block_bytes, nb, last, err);
        if (st != KVF_OK) {
            release(p, nb, pool_now(p));
            return kvf_err_prefix(err, "kv: copy-on-write of block %d into %d", last, nb);
        }
        p->blk[last].ref--; /* was > 1: still held by the co-owner */
        seq->blocks[seq->n_blocks - 1] = nb;
        p->st.cow_copies++;
    }
    for (int64_t i = 0; i < need; i++)
        seq->blocks[seq->n_blocks++] = kvf_kv_pool_take_block(p);
    seq->n_tokens += n_new;
    return KVF_OK;
}

static kvf_status check_n_new(const kvf_kv_seq *seq, int64_t n_new, kvf_err *err)
{
    int64_t max_tokens = (int64_t)INT32_MAX / 2 * seq->pool->bs;
    if (n_new < 0 || n_new > max_tokens - seq->n_tokens)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "kv: cannot add %lld tokens to a sequence of %lld (0 to %lld allowed)",
                           (long long)n_new, (long long)seq->n_tokens,
                           (long long)(max_tokens - seq->n_tokens));
    return KVF_OK;
}

kvf_status kvf_kv_seq_prepare_write(kvf_kv_seq *seq, int64_t n_new, kvf_err *err)
{
    kvf_status st = seq_check_ready(seq, "prepare_write", err);
    if (st != KVF_OK || (st = check_n_new(seq, n_new, err)) != KVF_OK)
        return st;
    kvf_kv_pool *p = seq->pool;
    int cow;
    int64_t need = seq_need(p, seq, n_new, &cow);
    if (need + cow > kvf_kv_pool_available(p))
        return kvf_err_set(err, KVF_ERR_FULL,
                           "kv: %lld more tokens need %lld blocks%s but only %d are available",
                           (long long)n_new, (long long)(need + cow),
                           cow ? " (one for copy-on-write)" : "", kvf_kv_pool_available(p));
    if ((st = kvf_kv_seq_reserve(seq, (int32_t)(seq->n_blocks + need), err)) != KVF_OK)
        return st;
    return seq_write(p, seq, n_new, err);
}

/* Exact blocks for a step: new blocks of every seq plus copy-on-write copies, where k writers
 * into one shared block of refcount r copy k times, or k - 1 times when they are all of its
 * holders (the last one writes in place). Uses and clears p->scratch. */
static int64_t step_need(kvf_kv_pool *p, kvf_kv_seq *const *seqs, const int64_t *n_new, size_t n)
{
    int64_t need = 0;
    for (size_t i = 0; i < n; i++) {
        int cow;
        if (seqs[i]->pool != p || seqs[i]->state != KVF_KV_SEQ_ACTIVE)
            continue; /* holds no blocks here (alloc_step refuses it before this) */
        need += seq_need(p, seqs[i], n_new[i], &cow);
        if (cow)
            p->scratch[seqs[i]->blocks[seqs[i]->n_blocks - 1]]++;
    }
    for (size_t i = 0; i < n; i++) {
        int cow;
        if (seqs[i]->pool != p || seqs[i]->state != KVF_KV_SEQ_ACTIVE)
            continue;
        seq_need(p, seqs[i], n_new[i], &cow);
        if (!cow)
            continue;
        int32_t b = seqs[i]->blocks[seqs[i]->n_blocks - 1];
        int32_t k = p->scratch[b];
        if (k == 0)
            continue; /* counted already */
        need += k == p->blk[b].ref ? k - 1 : k;
        p->scratch[b] = 0;
    }
    return need;
}

int64_t kvf_kv_pool_step_need(const kvf_kv_pool *pool, kvf_kv_seq *const *seqs,
                              const int64_t *n_new, size_t n)
{
    return step_need((kvf_kv_pool *)pool, seqs, n_new, n);
}

kvf_status kvf_kv_pool_alloc_step(kvf_kv_pool *p, kvf_kv_seq *const *seqs, const int64_t *n_new,
                                  size_t n, kvf_err *err)
{
    for (size_t i = 0; i < n; i++) {
        kvf_status st = seq_check_ready(seqs[i], "alloc_step", err);
        if (st == KVF_OK && seqs[i]->pool != p)
            st = kvf_err_set(err, KVF_ERR_INVALID, "kv: alloc_step: sequence %zu belongs to "
                             "another pool", i);
        if (st == KVF_OK)
            st = check_n_new(seqs[i], n_new[i], err);
        if (st != KVF_OK)
            return kvf_err_prefix(err, "sequence %zu of %zu", i, n);
    }
    int64_t need = step_need(p, seqs, n_new, n);
    if (need > kvf_kv_pool_available(p))
        return kvf_err_set(err, KVF_ERR_FULL,
                           "kv: step of %zu sequences needs %lld blocks but only %d are available",
                           n, (long long)need, kvf_kv_pool_available(p));
    for (size_t i = 0; i < n; i++) {
        int cow;
        int64_t k = seq_need(p, seqs[i], n_new[i], &cow);
        kvf_status st = kvf_kv_seq_reserve(seqs[i], (int32_t)(seqs[i]->n_blocks + k), err);
        if (st != KVF_OK)
            return st;
    }
    for (size_t i = 0; i < n; i++) {
        kvf_status st = seq_write(p, seqs[i], n_new[i], err);
        if (st != KVF_OK)
            return st; /* only a failing device copy gets here */
    }
    return KVF_OK;
}

kvf_status kvf_kv_seq_fork(kvf_kv_seq *parent, kvf_kv_seq *child, kvf_err *err)
{
    kvf_status st = seq_check_ready(parent, "fork (parent)", err);
    if (st != KVF_OK || (st = seq_check_active(child, "fork (child)", err)) != KVF_OK)
        return st;
    if (parent == child || child->pool != parent->pool)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: fork: child must be another sequence of "
                           "the parent's pool");
    if (child->n_blocks != 0 || child->n_tokens != 0)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: fork: child already holds %d blocks (must be "
                           "empty)", child->n_blocks);
    if ((st = kvf_kv_seq_reserve(child, parent->n_blocks, err)) != KVF_OK)
        return st;
    kvf_kv_pool *p = parent->pool;
    for (int32_t i = 0; i < parent->n_blocks; i++) {
        acquire(p, parent->blocks[i]);
        child->blocks[i] = parent->blocks[i];
    }
    if (parent->n_hashed > 0)
        memcpy(child->hashes, parent->hashes, (size_t)parent->n_hashed * sizeof *child->hashes);
    child->n_blocks = parent->n_blocks;
    child->n_hashed = parent->n_hashed;
    child->n_tokens = parent->n_tokens;
    child->root = parent->root;
    return KVF_OK;
}

kvf_status kvf_kv_seq_commit(kvf_kv_seq *seq, const int32_t *tokens, int64_t n_tokens,
                             kvf_err *err)
{
    kvf_status st = seq_check_active(seq, "commit", err);
    if (st != KVF_OK)
        return st;
    if (n_tokens < 0 || n_tokens > seq->n_tokens || (n_tokens > 0 && !tokens))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "kv: commit of %lld tokens into a sequence of %lld slots (0 to %lld "
                           "allowed, with tokens)",
                           (long long)n_tokens, (long long)seq->n_tokens, (long long)seq->n_tokens);
    kvf_kv_pool *p = seq->pool;
    int64_t full = n_tokens / p->bs;
    for (int64_t i = seq->n_hashed; i < full; i++) {
        uint64_t parent = i ? seq->hashes[i - 1] : seq->root;
        const int32_t *toks = tokens + i * p->bs;
        uint64_t h = kvf_kv_hash_block(parent, toks, p->bs);
        int32_t id = seq->blocks[i];
        kv_block *b = &p->blk[id];
        if (b->registered) {
            if (b->hash != h)
                return kvf_err_set(err, KVF_ERR_STATE,
                                   "kv: commit: block %d (position %lld) is registered as %016llx "
                                   "but the tokens given hash to %016llx",
                                   id, (long long)i, (unsigned long long)b->hash,
                                   (unsigned long long)h);
        } else if (map_find(p, h) < 0) {
            if (p->tier)
                kvf_kv_tier_forget(p->tier, h); /* the pool's STORED moves it up */
            b->hash = h;
            b->parent = parent;
            b->registered = 1;
            memcpy(p->tokens + (int64_t)id * p->bs, toks, (size_t)p->bs * sizeof *toks);
            map_insert(p, id);
            p->st.stored++;
            emit(p, KVF_KV_EVENT_STORED, id);
        }
        seq->hashes[i] = h;
        seq->n_hashed = (int32_t)i + 1;
    }
    return KVF_OK;
}

kvf_status kvf_kv_seq_check_held(const kvf_kv_seq *seq, kvf_err *err)
{
    kvf_kv_pool *p = seq->pool;
    kvf_status st = KVF_OK;
    int32_t i = 0;
    for (; i < seq->n_blocks; i++) {
        int32_t id = seq->blocks[i];
        if (id < 0 || id >= p->n) {
            st = kvf_err_set(err, KVF_ERR_INVALID,
                             "kv: foreign block %d at position %d of the table (this pool has "
                             "blocks 0 to %d)", id, i, p->n - 1);
            break;
        }
        if (++p->scratch[id] > p->blk[id].ref) {
            st = kvf_err_set(err, KVF_ERR_STATE,
                             "kv: double free of block %d at position %d of the table (refcount "
                             "%d)", id, i, p->blk[id].ref);
            i++;
            break;
        }
    }
    for (int32_t j = 0; j < i; j++)
        if (seq->blocks[j] >= 0 && seq->blocks[j] < p->n)
            p->scratch[seq->blocks[j]] = 0;
    return st;
}

void kvf_kv_seq_release_blocks(kvf_kv_seq *seq)
{
    kvf_kv_pool *p = seq->pool;
    int64_t now = pool_now(p);
    for (int32_t i = seq->n_blocks - 1; i >= 0; i--)
        release(p, seq->blocks[i], now); /* a block still being promoted becomes LANDING */
    seq->n_blocks = 0;
    seq->n_promoting = 0;
}

kvf_status kvf_kv_seq_free(kvf_kv_seq *seq, kvf_err *err)
{
    if (!seq || !seq->pool)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: free: sequence is not initialised");
    if (seq->state == KVF_KV_SEQ_RELEASED)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: double free of a sequence (already released)");
    if (seq->state == KVF_KV_SEQ_SWAPPED)
        return kvf_kv_swap_drop(seq->swap, seq, err);
    kvf_status st = kvf_kv_seq_check_held(seq, err);
    if (st != KVF_OK)
        return st;
    kvf_kv_seq_release_blocks(seq);
    seq->n_tokens = 0;
    seq->n_hashed = 0;
    seq->state = KVF_KV_SEQ_RELEASED;
    return KVF_OK;
}

kvf_status kvf_kv_seq_adopt(kvf_kv_seq *seq, const int32_t *ids, int32_t n_ids, int64_t n_tokens,
                            kvf_err *err)
{
    kvf_status st = seq_check_ready(seq, "adopt", err);
    if (st != KVF_OK)
        return st;
    kvf_kv_pool *p = seq->pool;
    if (seq->n_tokens % p->bs != 0)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: adopt: the sequence's last block is partial "
                           "(%lld tokens, block size %d)", (long long)seq->n_tokens, p->bs);
    if (n_ids <= 0 || !ids || n_tokens <= 0 || kvf_kv_blocks_for(n_tokens, p->bs) != n_ids ||
        check_n_new(seq, n_tokens, err) != KVF_OK)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: adopt: %d blocks cannot hold exactly %lld "
                           "tokens at block size %d", n_ids, (long long)n_tokens, p->bs);
    int32_t i = 0;
    for (; i < n_ids; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= p->n) {
            st = kvf_err_set(err, KVF_ERR_INVALID, "kv: adopt: foreign block %d (this pool has "
                             "blocks 0 to %d)", id, p->n - 1);
            break;
        }
        const kv_block *b = &p->blk[id];
        if (b->ref > 0 || b->pin > 0 || b->promoting || p->scratch[id]) {
            st = kvf_err_set(err, KVF_ERR_STATE, "kv: adopt: block %d is %s (must be free or "
                             "cached)", id, p->scratch[id] ? "listed twice" : b->ref > 0 ? "in use"
                             : b->promoting ? "landing (a promotion still writes into it)"
                             : "pinned");
            break;
        }
        p->scratch[id] = 1;
    }
    for (int32_t j = 0; j < i; j++)
        p->scratch[ids[j]] = 0;
    if (st != KVF_OK)
        return st;
    if ((st = kvf_kv_seq_reserve(seq, seq->n_blocks + n_ids, err)) != KVF_OK)
        return st;
    for (i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        if (p->blk[id].registered) {
            lru_remove(p, id);
            evict_registered(p, id);
            p->st.evicted++;
        } else {
            free_remove(p, id);
        }
        p->blk[id].ref = 1;
        p->n_used++;
        seq->blocks[seq->n_blocks++] = id;
    }
    seq->n_tokens += n_tokens;
    return KVF_OK;
}

/* ---- prefix cache -------------------------------------------------------------------------- */

/* match_block plus retention: an expired idle block is dropped and is a miss. */
static int32_t match_live(kvf_kv_pool *p, uint64_t h, uint64_t parent, const int32_t *toks,
                          int64_t now)
{
    int32_t id = match_block(p, h, parent, toks);
    if (id >= 0 && expired(p, &p->blk[id], now)) {
        drop_cached(p, id);
        p->st.expired++;
        return -1;
    }
    return id;
}

static kvf_status lookup_begin(kvf_kv_seq *seq, int64_t n_blocks, kvf_err *err)
{
    kvf_status st = seq_check_active(seq, "prefix lookup", err);
    if (st != KVF_OK)
        return st;
    if (seq->n_blocks != 0 || seq->n_tokens != 0)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: prefix lookup into a sequence that already "
                           "holds %d blocks (must be empty)", seq->n_blocks);
    if (n_blocks < 0 || n_blocks > INT32_MAX / 2)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: prefix lookup of %lld blocks (0 to %d "
                           "allowed)", (long long)n_blocks, INT32_MAX / 2);
    return kvf_kv_seq_reserve(seq, (int32_t)n_blocks, err);
}

/* Brings the tier block (h, parent, toks) into a new pool block, registered (STORED, tier POOL)
 * with refcount 1; -1 when no tier holds it, no pool block is available, the disk read is
 * refused or the copy in fails (then the hash is gone: REMOVED). */
static int32_t promote(kvf_kv_pool *p, uint64_t h, uint64_t parent, const int32_t *toks)
{
    kvf_kv_tier_ref r;
    if (kvf_kv_pool_available(p) == 0 || !kvf_kv_tier_find(p->tier, h, parent, toks, true, &r))
        return -1;
    int64_t t0;
    const void *src = kvf_kv_tier_take(p->tier, r, &t0); /* frees the tier slot */
    if (!src)
        return -1;
    /* may demote another block into that slot: not part of this promotion's time (on_promote
     * tells the router what a tier hit costs), so the clock skips it */
    int64_t tb = kvf_now_ns();
    int32_t id = kvf_kv_pool_take_block(p);
    t0 += kvf_now_ns() - tb;
    kv_block *b = &p->blk[id];
    kvf_err err = {0};
    if (p->mem->from_host(p->cfg.mem_ctx, p->base, p->block_bytes, id, src, &err) != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "kv: promoting block %016llx into block %d failed: %s (dropped)",
                (unsigned long long)h, id, err.msg);
        release(p, id, pool_now(p));
        if (p->cfg.on_event) {
            kvf_kv_event ev = {.type = KVF_KV_EVENT_REMOVED, .hash = h, .parent_hash = parent,
                               .block = -1, .tier = (int32_t)r.tier};
            p->cfg.on_event(p->cfg.event_ctx, &ev);
        }
        p->st.removed++;
        return -1;
    }
    b->hash = h;
    b->parent = parent;
    b->registered = 1;
    memcpy(p->tokens + (int64_t)id * p->bs, toks, (size_t)p->bs * sizeof *toks);
    map_insert(p, id);
    p->st.promoted++;
    emit(p, KVF_KV_EVENT_STORED, id);
    kvf_kv_tier_promoted(p->tier, r.tier, t0);
    return id;
}

/* Promotions through the copy thread go in two passes over the chain, so that the demotions
 * the new pool blocks cause cannot push a later block of the same chain out of a tier: the
 * walk (lookup_one) pins each tier hit's slot with a job (the sequence's table holds the job as
 * -(job + 2) meanwhile) while at most as many as the pool can give are planned; then
 * promote_planned takes a pool block for each, in chain order, and queues its copy. */
static int32_t plan_promotion(kvf_kv_pool *p, uint64_t h, uint64_t parent, const int32_t *toks,
                              int32_t *planned)
{
    kvf_kv_tier_ref r;
    if (*planned >= kvf_kv_pool_available(p) ||
        !kvf_kv_tier_find(p->tier, h, parent, toks, true, &r))
        return -1;
    int32_t job = kvf_kv_tier_job_begin(p->tier, r); /* pins the slot */
    if (job < 0)
        return -1; /* the copy queue is full */
    (*planned)++;
    return -(job + 2);
}

/* The block at chain position (h, parent, toks) with a reference taken for seq: a live pool
 * hit, or a tier hit promoted synchronously; with the copy thread, a planned promotion
 * (-(job + 2), see above); -1 on a miss. */
static int32_t lookup_one(kvf_kv_pool *p, uint64_t h, uint64_t parent, const int32_t *toks,
                          int64_t now, int32_t *planned)
{
    int32_t id = match_live(p, h, parent, toks, now);
    if (id >= 0) {
        acquire(p, id);
        return id;
    }
    if (!p->tier)
        return -1;
    return kvf_kv_tier_async(p->tier) ? plan_promotion(p, h, parent, toks, planned)
                                       : promote(p, h, parent, toks);
}

/* The second pass: each planned promotion of seq's new table (tokens: the lookup's, block i at
 * tokens + i * bs) takes a pool block (evicting/demoting as allocation does; the planned
 * count fits what was available) and queues its copy; the block is USED by seq, not
 * registered, promoting. Should a block be missing after all, the table ends before it. */
static void promote_planned(kvf_kv_pool *p, kvf_kv_seq *seq, const int32_t *tokens)
{
    int64_t now = pool_now(p);
    for (int32_t i = 0; i < seq->n_blocks; i++) {
        if (seq->blocks[i] >= 0)
            continue;
        int32_t job = -seq->blocks[i] - 2;
        int32_t id = kvf_kv_pool_take_block(p);
        if (id < 0) { /* not expected: give back this job and everything after it */
            for (int32_t k = seq->n_blocks - 1; k >= i; k--) {
                if (seq->blocks[k] < 0)
                    kvf_kv_tier_job_abort(p->tier, -seq->blocks[k] - 2);
                else
                    release(p, seq->blocks[k], now);
            }
            seq->n_blocks = i;
            return;
        }
        kv_block *b = &p->blk[id];
        b->hash = seq->hashes[i];
        b->parent = i ? seq->hashes[i - 1] : seq->root;
        memcpy(p->tokens + (int64_t)id * p->bs, tokens + (int64_t)i * p->bs,
               (size_t)p->bs * sizeof *tokens);
        b->promoting = 1;
        b->promo_seq = seq;
        b->promo_pos = i;
        p->n_promoting++;
        seq->n_promoting++;
        seq->blocks[i] = id;
        kvf_kv_tier_job_submit(p->tier, job, id);
    }
}

/* Appends a block already referenced for seq. */
static void lookup_take(kvf_kv_pool *p, kvf_kv_seq *seq, int32_t id, uint64_t h)
{
    (void)p;
    seq->blocks[seq->n_blocks] = id;
    seq->hashes[seq->n_blocks] = h;
    seq->n_blocks++;
}

/* Cuts seq's table at position pos (a failed promotion there): releases blocks [pos, n_blocks)
 * last first (one still being promoted becomes LANDING) and sets n_blocks, n_hashed and
 * n_tokens back to pos. */
static void seq_cut(kvf_kv_pool *p, kvf_kv_seq *seq, int32_t pos, int64_t now)
{
    int32_t n0 = seq->n_blocks;
    for (int32_t i = seq->n_blocks - 1; i >= pos; i--) {
        int32_t id = seq->blocks[i];
        if (p->blk[id].promoting && p->blk[id].promo_seq == seq)
            seq->n_promoting--;
        release(p, id, now);
    }
    seq->n_blocks = pos;
    if (seq->n_hashed > pos)
        seq->n_hashed = pos;
    seq->n_tokens = (int64_t)pos * p->bs;
    p->st.hit_blocks -= n0 - pos;
}

/* One finished copy into block id (the tier slot is freed already). */
static void promotion_end(kvf_kv_pool *p, const kvf_kv_tier_done *d, int64_t now)
{
    int32_t id = d->block;
    kv_block *b = &p->blk[id];
    kvf_kv_seq *seq = b->promo_seq;
    int32_t pos = b->promo_pos;
    b->promoting = 0;
    b->promo_seq = NULL;
    p->n_promoting--;
    if (d->ok && !d->stale && map_find(p, b->hash) < 0) {
        b->registered = 1;
        map_insert(p, id);
        p->st.promoted++;
        emit(p, KVF_KV_EVENT_STORED, id);
    }
    if (!d->ok)
        p->st.promote_failed++;
    if (b->ref == 0) { /* LANDING: its sequence is gone */
        p->n_landing--;
        if (b->registered)
            lru_push_tail(p, id, now);
        else
            free_push(p, id);
        return;
    }
    seq->n_promoting--;
    if (!d->ok) /* wrong or missing bytes: the prefix ends before this block */
        seq_cut(p, seq, pos, now);
}

int32_t kvf_kv_pool_poll_promotions(kvf_kv_pool *p)
{
    if (!p->tier || p->n_promoting == 0)
        return 0;
    int32_t n = 0;
    int64_t now = pool_now(p);
    kvf_kv_tier_done d;
    while (kvf_kv_tier_reap(p->tier, &d)) {
        promotion_end(p, &d, now);
        n++;
    }
    return n;
}

int32_t kvf_kv_pool_wait_promotions(kvf_kv_pool *p, int64_t timeout_ns)
{
    if (!p->tier || p->n_promoting == 0)
        return 0;
    kvf_kv_tier_wait(p->tier, timeout_ns);
    return kvf_kv_pool_poll_promotions(p);
}

kvf_status kvf_kv_prefix_lookup(kvf_kv_seq *seq, const int32_t *tokens, int64_t n_tokens,
                                int64_t *n_hit_tokens_out, kvf_err *err)
{
    if (n_tokens < 0 || (n_tokens > 0 && !tokens))
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: prefix lookup of %lld tokens", (long long)n_tokens);
    int64_t n_full = seq && seq->pool ? n_tokens / seq->pool->bs : 0;
    kvf_status st = lookup_begin(seq, n_full, err);
    if (st != KVF_OK)
        return st;
    kvf_kv_pool *p = seq->pool;
    int64_t now = pool_now(p);
    uint64_t parent = seq->root;
    int32_t planned = 0;
    for (int64_t i = 0; i < n_full; i++) {
        const int32_t *toks = tokens + i * p->bs;
        uint64_t h = kvf_kv_hash_block(parent, toks, p->bs);
        int32_t id = lookup_one(p, h, parent, toks, now, &planned);
        if (id == -1)
            break;
        lookup_take(p, seq, id, h);
        parent = h;
    }
    if (planned > 0)
        promote_planned(p, seq, tokens);
    seq->n_hashed = seq->n_blocks;
    seq->n_tokens = (int64_t)seq->n_blocks * p->bs;
    p->st.lookups++;
    p->st.lookup_blocks += n_full;
    p->st.hit_blocks += seq->n_blocks;
    if (n_hit_tokens_out)
        *n_hit_tokens_out = seq->n_tokens;
    return KVF_OK;
}

kvf_status kvf_kv_prefix_lookup_hashes(kvf_kv_seq *seq, const uint64_t *hashes,
                                       const int32_t *tokens, int32_t n_blocks,
                                       int32_t *n_hit_blocks_out, kvf_err *err)
{
    if (n_blocks < 0 || (n_blocks > 0 && (!tokens || !hashes)))
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: prefix lookup of %d blocks needs hashes "
                           "and tokens", n_blocks);
    kvf_status st = lookup_begin(seq, n_blocks, err);
    if (st != KVF_OK)
        return st;
    kvf_kv_pool *p = seq->pool;
    int64_t now = pool_now(p);
    int32_t planned = 0;
    for (int32_t i = 0; i < n_blocks; i++) {
        uint64_t parent = i ? hashes[i - 1] : seq->root;
        int32_t id = lookup_one(p, hashes[i], parent, tokens + (int64_t)i * p->bs, now,
                                &planned);
        if (id == -1)
            break;
        lookup_take(p, seq, id, hashes[i]);
    }
    if (planned > 0)
        promote_planned(p, seq, tokens);
    seq->n_hashed = seq->n_blocks;
    seq->n_tokens = (int64_t)seq->n_blocks * p->bs;
    p->st.lookups++;
    p->st.lookup_blocks += n_blocks;
    p->st.hit_blocks += seq->n_blocks;
    if (n_hit_blocks_out)
        *n_hit_blocks_out = seq->n_blocks;
    return KVF_OK;
}

int32_t kvf_kv_prefix_probe(const kvf_kv_pool *pool, uint64_t root, const int32_t *tokens,
                            int64_t n_tokens)
{
    kvf_kv_pool *p = (kvf_kv_pool *)pool; /* only the mismatch counter changes */
    int64_t now = pool_now(p), n_full = tokens && n_tokens > 0 ? n_tokens / p->bs : 0;
    uint64_t parent = root;
    int32_t n = 0;
    for (int64_t i = 0; i < n_full; i++) {
        const int32_t *toks = tokens + i * p->bs;
        uint64_t h = kvf_kv_hash_block(parent, toks, p->bs);
        int32_t id = match_block(p, h, parent, toks);
        kvf_kv_tier_ref r;
        if (id >= 0 ? expired(p, &p->blk[id], now)
                    : !p->tier || !kvf_kv_tier_find(p->tier, h, parent, toks, false, &r))
            break;
        n++;
        parent = h;
    }
    return n;
}

/* Walks the leading cached blocks of tokens, calling fn on each until it returns false. */
static int32_t walk_prefix(kvf_kv_pool *p, uint64_t root, const int32_t *tokens, int64_t n_tokens,
                           bool (*fn)(kvf_kv_pool *, int32_t, int64_t))
{
    int64_t now = pool_now(p), n_full = tokens && n_tokens > 0 ? n_tokens / p->bs : 0;
    uint64_t parent = root;
    int32_t n = 0;
    for (int64_t i = 0; i < n_full; i++) {
        const int32_t *toks = tokens + i * p->bs;
        uint64_t h = kvf_kv_hash_block(parent, toks, p->bs);
        int32_t id = match_live(p, h, parent, toks, now);
        if (id < 0 || !fn(p, id, now))
            break;
        n++;
        parent = h;
    }
    return n;
}

static bool pin_one(kvf_kv_pool *p, int32_t id, int64_t now)
{
    kv_block *b = &p->blk[id];
    if (b->pin == INT32_MAX)
        return false;
    if (b->pin++ == 0 && b->ref == 0) {
        lru_remove(p, id);
        p->n_pinned++;
    }
    return true;
}

static bool unpin_one(kvf_kv_pool *p, int32_t id, int64_t now)
{
    kv_block *b = &p->blk[id];
    if (b->pin == 0)
        return false;
    if (--b->pin == 0 && b->ref == 0) {
        p->n_pinned--;
        lru_push_tail(p, id, now);
    }
    return true;
}

kvf_status kvf_kv_prefix_pin(kvf_kv_pool *p, uint64_t root, const int32_t *tokens,
                             int64_t n_tokens, int32_t *n_pinned_out, kvf_err *err)
{
    if (n_tokens < 0 || (n_tokens > 0 && !tokens))
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: pin of %lld tokens", (long long)n_tokens);
    int32_t n = walk_prefix(p, root, tokens, n_tokens, pin_one);
    if (n_pinned_out)
        *n_pinned_out = n;
    return KVF_OK;
}

kvf_status kvf_kv_prefix_unpin(kvf_kv_pool *p, uint64_t root, const int32_t *tokens,
                               int64_t n_tokens, int32_t *n_unpinned_out, kvf_err *err)
{
    if (n_tokens < 0 || (n_tokens > 0 && !tokens))
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: unpin of %lld tokens", (long long)n_tokens);
    int32_t n = walk_prefix(p, root, tokens, n_tokens, unpin_one);
    if (n_unpinned_out)
        *n_unpinned_out = n;
    return KVF_OK;
}

int32_t kvf_kv_prefix_snapshot(const kvf_kv_pool *p, kvf_kv_event_fn fn, void *ctx)
{
    int32_t n = 0;
    for (int32_t id = 0; id < p->n; id++) {
        const kv_block *b = &p->blk[id];
        if (!b->registered)
            continue;
        kvf_kv_event ev = {.type = KVF_KV_EVENT_STORED, .hash = b->hash, .parent_hash = b->parent,
                           .block = id, .tokens = p->tokens + (int64_t)id * p->bs,
                           .n_tokens = p->bs};
        if (fn)
            fn(ctx, &ev);
        n++;
    }
    if (p->tier)
        n += kvf_kv_tier_snapshot(p->tier, fn, ctx);
    return n;
}

/* ---- invariant checker --------------------------------------------------------------------- */

static bool pool_has(const void *ctx, uint64_t h)
{
    return map_find(ctx, h) >= 0;
}

#define KV_FAIL(...) (st = kvf_err_set(err, KVF_ERR_INTERNAL, __VA_ARGS__))

kvf_status kvf_kv_check_invariants(const kvf_kv_pool *p, const kvf_kv_seq *const *seqs,
                                   size_t n_seqs, kvf_err *err)
{
    kvf_status st = KVF_OK;
    /* 1. Count the tables holding each block. */
    size_t si = 0;
    for (; si < n_seqs && st == KVF_OK; si++) {
        const kvf_kv_seq *s = seqs[si];
        if (s->pool != p) {
            KV_FAIL("kv: invariant: sequence %zu belongs to another pool", si);
            break;
        }
        if (s->state != KVF_KV_SEQ_ACTIVE)
            continue;
        if (s->n_blocks < 0 || s->n_blocks > s->cap ||
            s->n_blocks != kvf_kv_blocks_for(s->n_tokens, p->bs) || s->n_hashed < 0 ||
            s->n_hashed > s->n_blocks || s->n_hashed > s->n_tokens / p->bs) {
            KV_FAIL("kv: invariant: sequence %zu: %d blocks (cap %d), %d hashed, %lld tokens do "
                    "not agree at block size %d", si, s->n_blocks, s->cap, s->n_hashed,
                    (long long)s->n_tokens, p->bs);
            break;
        }
        int32_t s_promoting = 0;
        for (int32_t i = 0; i < s->n_blocks; i++) {
            int32_t id = s->blocks[i];
            if (id < 0 || id >= p->n) {
                KV_FAIL("kv: invariant: sequence %zu position %d holds foreign block %d", si, i, id);
                break;
            }
            if (p->blk[id].promoting && p->blk[id].promo_seq == s) {
                s_promoting++;
                if (p->blk[id].promo_pos != i) {
                    KV_FAIL("kv: invariant: sequence %zu position %d: block %d is promoted for "
                            "position %d", si, i, id, p->blk[id].promo_pos);
                    break;
                }
            }
            if (i < s->n_hashed && p->blk[id].registered && p->blk[id].hash != s->hashes[i]) {
                KV_FAIL("kv: invariant: sequence %zu position %d: block %d registered as %016llx, "
                        "the sequence says %016llx", si, i, id,
                        (unsigned long long)p->blk[id].hash, (unsigned long long)s->hashes[i]);
                break;
            }
            p->scratch[id]++;
        }
        if (st == KVF_OK && s_promoting != s->n_promoting) {
            KV_FAIL("kv: invariant: sequence %zu has %d blocks being promoted but says %d", si,
                    s_promoting, s->n_promoting);
            break;
        }
    }
    /* 2. Per block: refcount == holders, state fields agree. */
    int32_t n_free = 0, n_cached = 0, n_pinned = 0, n_used = 0, n_reg = 0, n_landing = 0,
            n_promoting = 0;
    for (int32_t id = 0; id < p->n && st == KVF_OK; id++) {
        const kv_block *b = &p->blk[id];
        if (b->ref != p->scratch[id]) {
            KV_FAIL("kv: invariant: block %d has refcount %d but %d block tables hold it", id,
                    b->ref, p->scratch[id]);
            break;
        }
        if (b->pin < 0 || (b->pin > 0 && !b->registered)) {
            KV_FAIL("kv: invariant: block %d pinned %d times while %sregistered", id, b->pin,
                    b->registered ? "" : "not ");
            break;
        }
        if (b->promoting && (b->registered || b->pin > 0 || b->ref > 1 ||
                             (b->ref == 1) != (b->promo_seq != NULL))) {
            KV_FAIL("kv: invariant: block %d is being promoted with refcount %d, pin %d, "
                    "%sregistered, %s sequence", id, b->ref, b->pin, b->registered ? "" : "not ",
                    b->promo_seq ? "a" : "no");
            break;
        }
        if (!b->promoting && b->promo_seq) {
            KV_FAIL("kv: invariant: block %d is not being promoted but names a sequence", id);
            break;
        }
        n_reg += b->registered;
        n_promoting += b->promoting;
        if (b->ref > 0)
            n_used++;
        else if (b->promoting)
            n_landing++;
        else if (!b->registered)
            n_free++;
        else if (b->pin > 0)
            n_pinned++;
        else
            n_cached++;
        bool on_free = b->free_pos >= 0, want_free = b->ref == 0 && !b->registered &&
                                                   !b->promoting;
        if (on_free != want_free ||
            (on_free && (b->free_pos >= p->n_free || p->free_stack[b->free_pos] != id))) {
            KV_FAIL("kv: invariant: block %d (refcount %d, %sregistered) is %son the free list",
                    id, b->ref, b->registered ? "" : "not ", on_free ? "" : "not ");
            break;
        }
        if (b->registered && map_find(p, b->hash) != id) {
            KV_FAIL("kv: invariant: block %d registered as %016llx is not found under it", id,
                    (unsigned long long)b->hash);
            break;
        }
    }
    for (int32_t id = 0; id < p->n; id++)
        p->scratch[id] = 0;
    if (st != KVF_OK)
        return st;
    /* 3. The LRU holds exactly the CACHED blocks, oldest first. */
    int32_t walked = 0, prev = -1;
    for (int32_t id = p->lru_head; id >= 0; prev = id, id = p->blk[id].next) {
        const kv_block *b = &p->blk[id];
        if (++walked > p->n)
            return KV_FAIL("kv: invariant: the LRU list loops");
        if (b->prev != prev || b->ref != 0 || b->pin != 0 || !b->registered)
            return KV_FAIL("kv: invariant: LRU entry %d (block %d, refcount %d, pin %d, %sregistered, "
                           "prev %d expected %d) is not an idle cached block", walked - 1, id,
                           b->ref, b->pin, b->registered ? "" : "not ", b->prev, prev);
        if (prev >= 0 && p->blk[prev].stamp > b->stamp)
            return KV_FAIL("kv: invariant: LRU out of order at block %d (%lld after %lld)", id,
                           (long long)b->stamp, (long long)p->blk[prev].stamp);
    }
    if (prev != p->lru_tail)
        return KV_FAIL("kv: invariant: LRU tail is %d but the walk ends at %d", p->lru_tail, prev);
    /* 4. Counts add up. */
    int32_t map_used = 0;
    for (uint64_t i = 0; i <= p->map_mask; i++)
        map_used += p->map[i] >= 0;
    if (walked != n_cached || n_cached != p->n_cached || n_free != p->n_free ||
        n_pinned != p->n_pinned || n_used != p->n_used || n_reg != p->n_map || map_used != n_reg ||
        n_landing != p->n_landing || n_promoting != p->n_promoting ||
        n_free + n_cached + n_pinned + n_used + n_landing != p->n)
        return KV_FAIL("kv: invariant: counts disagree: free %d/%d, cached %d/%d (LRU walk %d), "
                       "pinned %d/%d, used %d/%d, landing %d/%d, promoting %d/%d (counted/kept), "
                       "registered %d, map %d/%d, total %d",
                       n_free, p->n_free, n_cached, p->n_cached, walked, n_pinned, p->n_pinned,
                       n_used, p->n_used, n_landing, p->n_landing, n_promoting, p->n_promoting,
                       n_reg, map_used, p->n_map, p->n);
    /* every block a promotion writes into has its job in the tiers, and no other job runs */
    if (p->tier && n_promoting != kvf_kv_tier_jobs(p->tier))
        return KV_FAIL("kv: invariant: %d blocks are being promoted but the tiers have %d "
                       "promotion jobs", n_promoting, kvf_kv_tier_jobs(p->tier));
    /* 5. The tiers, and no hash both in them and in the pool. */
    if (p->tier)
        return kvf_kv_tier_check(p->tier, pool_has, p, err);
    return KVF_OK;
}
