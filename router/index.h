/* index.h: the router's KV index: block hash -> bitset of workers holding it, fed by workers' KV
 * events (snapshot, then stored/removed deltas with sequence numbers), with per-worker reverse
 * lists so a worker leaves at once. Single-threaded; event transport and policy live elsewhere. */
#ifndef KVF_ROUTER_INDEX_H
#define KVF_ROUTER_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define KVF_ROUTER_MAX_WORKERS 64 /* workers per index (one bit each) */

typedef struct kvf_router_index kvf_router_index;

typedef struct kvf_router_index_cfg {
    const char *model;       /* model id every event must carry (copied) */
    int32_t block_size;      /* tokens per block every event must carry */
    int64_t expected_blocks; /* initial table size hint (grows on demand); 0 = small */
    double stale_after_s;    /* a worker silent this long is stale (<= 0: never) */
    double decay_s;          /* stale trust decays as exp(-(silence - stale_after) / decay_s) */
    double forget_below;     /* a stale worker whose trust drops below this loses its blocks */
    bool prefix_closed;      /* workers' caches are prefix-closed (a block is cached only with its
                                parent: tail-first eviction), so the holders of a prompt's blocks
                                only shrink along it and overlap samples the prompt instead of
                                reading every block; false reads every block (exact for any cache) */
} kvf_router_index_cfg;

/* Defaults: block 16, stale after 10 s, decay 30 s, forget below 0.05. model must be set. */
void kvf_router_index_cfg_default(kvf_router_index_cfg *cfg);

typedef enum kvf_router_worker_state {
    KVF_ROUTER_WORKER_ABSENT = 0, /* never added, or removed */
    KVF_ROUTER_WORKER_LIVE,       /* events in sequence */
    KVF_ROUTER_WORKER_RESYNC,     /* a sequence gap was seen: deltas refused until a snapshot */
    KVF_ROUTER_WORKER_STALE,      /* no event or heartbeat for stale_after_s: trust decays */
} kvf_router_worker_state;

const char *kvf_router_worker_state_name(kvf_router_worker_state s);

/* Where a worker keeps a cached block: its KV pool, or a tier below it that a hit must first
 * copy back (promote) into the pool. */
typedef enum kvf_router_tier {
    KVF_ROUTER_TIER_POOL = 0,
    KVF_ROUTER_TIER_HOST = 1, /* host memory */
    KVF_ROUTER_TIER_DISK = 2, /* local disk */
} kvf_router_tier;

typedef enum kvf_router_event_kind {
    KVF_ROUTER_EV_SNAPSHOT, /* replaces everything known about the worker; seq sets the base */
    KVF_ROUTER_EV_STORED,   /* blocks newly cached, or moved to another tier (demoted/promoted) */
    KVF_ROUTER_EV_REMOVED,  /* blocks evicted */
} kvf_router_event_kind;

typedef struct kvf_router_event {
    kvf_router_event_kind kind;
    int32_t worker;          /* 0 .. KVF_ROUTER_MAX_WORKERS-1 */
    uint64_t seq;            /* per worker: each delta is the previous seq + 1 */
    const char *model;       /* must equal the index's model id */
    int32_t block_size;      /* must equal the index's block size */
    const uint64_t *hashes;  /* [n] chained block hashes (kv/hash.h) */
    const uint64_t *parents; /* [n] each block's parent hash, or NULL (removed events) */
    size_t n;
    int32_t tier;            /* stored and snapshot: the tier of every block (0 = pool) ... */
    const uint8_t *tiers;    /* ... unless this gives each block's tier: [n] or NULL */
} kvf_router_event;

typedef struct kvf_router_index_stats {
    int64_t n_blocks;       /* distinct indexed hashes */
    int64_t n_pairs;        /* (block, worker) pairs */
    int64_t n_pairs_host, n_pairs_disk; /* of which in workers' host / disk tiers (the rest in pools) */
    int64_t bytes;          /* table + reverse lists + per-worker state, as allocated */
    double bytes_per_block; /* bytes / n_blocks (0 when empty) */
    int64_t events, gaps, refused, orphans; /* orphans: snapshot blocks whose parent is absent */
    int64_t ops;            /* blocks applied + blocks looked up */
} kvf_router_index_stats;

kvf_status kvf_router_index_create(const kvf_router_index_cfg *cfg, kvf_router_index **out,
                                   kvf_err *err);
void kvf_router_index_destroy(kvf_router_index *idx);

/* Registers a worker that serves model with block_size; a mismatch is refused (logged,
 * KVF_ERR_INVALID). Re-adding a live worker keeps its blocks. now: the caller's clock (s). */
kvf_status kvf_router_index_worker_add(kvf_router_index *idx, int32_t worker, const char *model,
                                       int32_t block_size, double now, kvf_err *err);
/* A worker that left or died: its blocks leave the index at once (O(its blocks)). */
void kvf_router_index_worker_remove(kvf_router_index *idx, int32_t worker);
/* Drops a worker's blocks but keeps it registered (LIVE again only after a snapshot). */
void kvf_router_index_worker_clear(kvf_router_index *idx, int32_t worker);
kvf_router_worker_state kvf_router_index_worker_state(const kvf_router_index *idx, int32_t worker,
                                                      double now);
/* A load report or health answer: proof of life that keeps a worker from going stale. */
void kvf_router_index_heartbeat(kvf_router_index *idx, int32_t worker, double now);
/* How far the worker's blocks are believed, in [0, 1]: 1 while live, decaying while stale or
 * waiting for a resync, 0 when absent. */
double kvf_router_index_trust(const kvf_router_index *idx, int32_t worker, double now);
/* Bitset of registered workers. */
uint64_t kvf_router_index_workers(const kvf_router_index *idx);
/* Forgets the blocks of workers whose trust fell below forget_below; returns how many. */
int kvf_router_index_expire(kvf_router_index *idx, double now);

/* Applies one event. Refusals (the worker's state is unchanged unless said):
 *   KVF_ERR_INVALID  wrong model or block size (logged once per worker), unknown worker, bad args;
 *   KVF_ERR_STATE    a sequence gap: the worker enters RESYNC and deltas are refused until a
 *                    snapshot arrives (the caller asks the worker for one);
 * A delta whose seq is not newer than the last one applied is a duplicate and is ignored. */
kvf_status kvf_router_index_apply(kvf_router_index *idx, const kvf_router_event *ev, double now,
                                  kvf_err *err);

/* Direct edits without sequence numbers (approximate mode: the router's own predictions). */
kvf_status kvf_router_index_block_add(kvf_router_index *idx, int32_t worker, uint64_t hash);
void kvf_router_index_block_remove(kvf_router_index *idx, int32_t worker, uint64_t hash);

/* The tier of worker w's copy of one block (KVF_ROUTER_TIER_*), or -1 when it holds none. */
int kvf_router_index_tier(kvf_router_index *idx, int32_t worker, uint64_t hash);
/* Whether any worker holds a block below its pool (else every held block is in a pool). */
bool kvf_router_index_has_tiers(const kvf_router_index *idx);
/* For each worker in mask, how many of its overlap[w] leading blocks of hashes sit in the host
 * and in the disk tier, into host_out/disk_out[KVF_ROUTER_MAX_WORKERS]; the rest are in its pool.
 * Tiers are taken to deepen along a prompt (pool, then host, then disk: a worker demotes a
 * prompt's tail before its head and promotes a whole hit), so two bisections per worker find
 * the boundaries in about 2 log2(overlap) lookups; a prompt that breaks that order is priced
 * approximately. Nothing is read while no block is below a pool. */
void kvf_router_index_overlap_tiers(kvf_router_index *idx, const uint64_t *hashes /* [n] */,
                                    uint64_t mask, const uint32_t *overlap /* [MAX_WORKERS] */,
                                    uint32_t *host_out, uint32_t *disk_out);

/* The workers holding one block (0 when none). */
uint64_t kvf_router_index_lookup(kvf_router_index *idx, uint64_t hash);
/* For each worker in mask, the number of leading blocks of hashes[0..n) it holds, into
 * overlap_out[KVF_ROUTER_MAX_WORKERS] (workers outside mask get 0). Returns the largest.
 * With prefix_closed: 16 evenly spaced blocks are read at once, then only the stretches where
 * the holders change (exact when caches are prefix-closed; about 16 + 8 lookups a boundary
 * instead of n for a 128-block prompt). */
size_t kvf_router_index_overlap(kvf_router_index *idx, const uint64_t *hashes /* [n] */, size_t n,
                                uint64_t mask, uint32_t *overlap_out);

/* Switches the overlap method (see kvf_router_index_cfg.prefix_closed) on a live index. */
void kvf_router_index_set_prefix_closed(kvf_router_index *idx, bool on);

void kvf_router_index_stats_get(const kvf_router_index *idx, kvf_router_index_stats *out);
/* Blocks the worker holds in the index. */
int64_t kvf_router_index_worker_blocks(const kvf_router_index *idx, int32_t worker);

#endif
