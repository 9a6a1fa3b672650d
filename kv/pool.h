/* pool.h: the paged KV cache manager: one block pool over one allocation, per-sequence block
 * tables, the prefix cache (hash -> block, refcounts, LRU of idle cached blocks, retention,
 * pinning, stored/removed events), copy-on-write and the invariant checker. Swap is kv/swap.h.
 * It moves no KV itself except through kvf_kv_mem_ops; the engine decides what to run.
 *
 * Block states (every block is in exactly one):
 *   FREE     on the free list, no hash, no holder;
 *   CACHED   refcount 0, registered under its hash, on the LRU (evictable);
 *   PINNED   refcount 0, registered, pinned: kept, not evictable, not expiring;
 *   USED     refcount > 0 (held by that many block tables), registered or not;
 *   LANDING  refcount 0, a promotion's copy still writing into it (its sequence was freed
 *            meanwhile): it becomes CACHED (or FREE, when the copy failed) when the copy ends.
 * free + cached + pinned + used + landing == total. Allocation takes FREE blocks first, then
 * evicts the least-recently-used CACHED block (publishing a REMOVED event), or, with tiers
 * (kvf_kv_pool_cfg.tier, kv/tier.h), demotes it into the host tier (a STORED event with tier
 * KVF_KV_TIER_HOST). Prefix lookups continue past the pool's hits into the tiers and promote
 * what they find there back into pool blocks: through the tiers' copy thread (kv/tier.h) when
 * it runs, the sequence then holding blocks whose bytes are still on their way (USED, not
 * registered, "promoting") until kvf_kv_pool_poll_promotions completes them; else
 * synchronously, inside the lookup.
 *
 * Not thread-safe: one pool belongs to one thread (the engine's step loop). The hot calls
 * (prepare_write, alloc_step, lookup, commit, free) do not allocate memory unless a block
 * table must grow; kvf_kv_seq_reserve grows it ahead of time. */
#ifndef KVF_KV_POOL_H
#define KVF_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kv/layout.h"
#include "kv/tier.h"

typedef struct kvf_kv_pool kvf_kv_pool;

/* ---- memory: where block bytes live ------------------------------------------------------ */

/* How the pool gets its one allocation and moves block bytes. The host default is
 * kvf_kv_mem_host; the CUDA backend hands in device memory through its own table. Every
 * function returns a status (never aborts); ctx is kvf_kv_pool_cfg.mem_ctx. */
typedef struct kvf_kv_mem_ops {
    const char *name; /* "host", "cuda" */
    /* One allocation of bytes (= n_blocks * block_bytes) for the whole pool. */
    kvf_status (*alloc)(void *ctx, int64_t bytes, void **base_out, kvf_err *err);
    void (*free)(void *ctx, void *base, int64_t bytes);
    /* Copies block src over block dst inside the pool (copy-on-write). */
    kvf_status (*copy_block)(void *ctx, void *base, int64_t block_bytes, int32_t dst,
                             int32_t src, kvf_err *err);
    /* Copies one block out to host memory (swap out) and back in (swap in). */
    kvf_status (*to_host)(void *ctx, void *host_dst, const void *base, int64_t block_bytes,
                          int32_t block, kvf_err *err);
    kvf_status (*from_host)(void *ctx, void *base, int64_t block_bytes, int32_t block,
                            const void *host_src, kvf_err *err);
    /* from_host may run on another thread (the tiers' copy thread) while the pool's thread
     * calls the others and reads the memory (other blocks): host memory yes; false keeps tier
     * promotions synchronous (CUDA: its copies sync the compute stream). */
    bool from_host_any_thread;
} kvf_kv_mem_ops;

/* Host memory: 64-byte aligned malloc and memcpy. */
extern const kvf_kv_mem_ops kvf_kv_mem_host;

/* ---- events: what the prefill and decode workers publish --------------------------------- */

typedef enum kvf_kv_event_type {
    KVF_KV_EVENT_STORED = 1,  /* hash is now held in tier `tier`: newly registered, or moved
                               * there by demotion or promotion */
    KVF_KV_EVENT_REMOVED = 2, /* hash left the cache, every tier (evicted with nowhere to go,
                               * expired, dropped or cleared) */
} kvf_kv_event_type;

/* Valid only during the callback. tokens is set for STORED ([block_size] ids), else NULL. */
typedef struct kvf_kv_event {
    kvf_kv_event_type type;
    uint64_t hash;
    uint64_t parent_hash; /* the hash of the block before it; the root for the first block */
    int32_t block;        /* pool block id; -1 for a block held in a lower tier */
    const int32_t *tokens;
    int32_t n_tokens;
    int32_t tier;         /* kvf_kv_tier_kind: STORED: where it is held now; REMOVED: the
                           * tier it was last in */
} kvf_kv_event;

/* Called synchronously from inside the pool call that caused the event; must not call back
 * into the pool. */
typedef void (*kvf_kv_event_fn)(void *ctx, const kvf_kv_event *ev);

/* ---- the pool ---------------------------------------------------------------------------- */

typedef struct kvf_kv_pool_cfg {
    kvf_kv_layout layout; /* from kvf_kv_layout_init */
    int32_t n_blocks;     /* > 0 */
    const kvf_kv_mem_ops *mem; /* NULL: kvf_kv_mem_host */
    void *mem_ctx;
    /* Idle cached blocks older than this are dropped (kvf_kv_pool_expire, and lookups treat
     * them as misses). 0 keeps them until evicted. Pinned blocks never expire. */
    int64_t retention_ns;
    kvf_kv_event_fn on_event; /* NULL: no events */
    void *event_ctx;
    /* Monotonic clock for retention and LRU stamps; NULL: kvf_now_ns. Tests pass a fake. */
    int64_t (*clock_ns)(void *ctx);
    void *clock_ctx;
    /* Host (and disk) tiers under the pool, made by kvf_kv_tier_create for the same layout;
     * NULL: none (evicted blocks are dropped). Borrowed: it must outlive the pool, and serves
     * one pool. Tier blocks do not expire (retention_ns is the pool's). */
    kvf_kv_tier *tier;
} kvf_kv_pool_cfg;

typedef struct kvf_kv_pool_stats {
    int32_t total, free, cached, pinned, used; /* + landing: == total */
    int32_t landing;   /* freed by their sequence while a promotion still writes into them */
    int32_t promoting; /* blocks a promotion is writing into now (held or landing) */
    int64_t lookups;       /* kvf_kv_prefix_lookup calls */
    int64_t lookup_blocks; /* full blocks asked for */
    int64_t hit_blocks;    /* of those, served from the cache (pool hits and promotions) */
    int64_t token_mismatches; /* hash found but stored tokens or parent differed */
    int64_t stored, removed, evicted, expired, cow_copies;
    int64_t demoted;  /* evicted blocks moved into the host tier (not removed) */
    int64_t promoted; /* blocks lookups brought back from a tier (kvf_kv_tier_get_stats: which);
                       * with the copy thread, counted when the copy completes */
    int64_t promote_failed; /* promotions whose copy failed (a sequence's prefix was cut there) */
} kvf_kv_pool_stats;

/* Creates a pool of cfg->n_blocks blocks of cfg->layout.block_bytes in one allocation made by
 * cfg->mem. The pool owns that allocation and frees it in destroy. */
kvf_status kvf_kv_pool_create(const kvf_kv_pool_cfg *cfg, kvf_kv_pool **out, kvf_err *err);
/* Frees the pool and its memory, after the tiers' copy thread has finished the copies still
 * queued (it is joined). Sequences still pointing at it must not be used again
 * (kvf_kv_seq_fini on them stays safe only before destroy). NULL is a no-op. */
void kvf_kv_pool_destroy(kvf_kv_pool *pool);

const kvf_kv_layout *kvf_kv_pool_layout(const kvf_kv_pool *pool);
/* The allocation (what the transport registers) and its size in bytes. Borrowed. */
void *kvf_kv_pool_base(const kvf_kv_pool *pool);
int64_t kvf_kv_pool_bytes(const kvf_kv_pool *pool);
void kvf_kv_pool_get_stats(const kvf_kv_pool *pool, kvf_kv_pool_stats *out);
/* Blocks an allocation can take right now: free + cached (pinned and used cannot). */
int32_t kvf_kv_pool_available(const kvf_kv_pool *pool);

/* Drops idle cached blocks past the retention (REMOVED events); *n_out (may be NULL) gets
 * how many. A no-op when retention_ns is 0. */
void kvf_kv_pool_expire(kvf_kv_pool *pool, int32_t *n_out);
/* Drops every idle cached block (not pinned, not used), and every tier block, as for a model
 * reload (blocks a promotion is copying up go too: REMOVED now, never registered). */
void kvf_kv_pool_clear_cache(kvf_kv_pool *pool, int32_t *n_out);

/* ---- sequences and their block tables ---------------------------------------------------- */

typedef enum kvf_kv_seq_state {
    KVF_KV_SEQ_ACTIVE = 0,   /* holds pool blocks in blocks[0..n_blocks) */
    KVF_KV_SEQ_SWAPPED = 1,  /* blocks[] hold host slots of a kvf_kv_swap (kv/swap.h) */
    KVF_KV_SEQ_RELEASED = 2, /* kvf_kv_seq_free ran; init again to reuse */
} kvf_kv_seq_state;

struct kvf_kv_swap;

/* One sequence's block table. Caller-allocated (kvf_kv_seq_init / kvf_kv_seq_fini); the arrays
 * are owned by the sequence and grow on demand. Read the fields, never write them: token
 * position p lives in block blocks[p / block_size], slot p % block_size. */
typedef struct kvf_kv_seq {
    kvf_kv_pool *pool;
    int32_t *blocks;  /* [cap] block ids, [0, n_blocks) valid */
    uint64_t *hashes; /* [cap] chain hash of each full block, [0, n_hashed) valid */
    int32_t n_blocks, cap;
    int32_t n_hashed; /* leading full blocks whose hash is known (registered or a cache hit) */
    int64_t n_tokens; /* token slots written or reserved: n_blocks == blocks_for(n_tokens) */
    uint64_t root;    /* h[-1]: kvf_kv_hash_root(model_id, cache_salt) */
    kvf_kv_seq_state state;
    struct kvf_kv_swap *swap; /* while SWAPPED */
    int32_t n_promoting; /* blocks of the table a promotion is still copying into */
} kvf_kv_seq;

/* Makes seq an empty ACTIVE table of pool whose block hashes chain from root. Allocates
 * nothing until blocks arrive. */
void kvf_kv_seq_init(kvf_kv_seq *seq, kvf_kv_pool *pool, uint64_t root);
/* Releases whatever seq still holds (blocks, host slots) and frees its arrays. */
void kvf_kv_seq_fini(kvf_kv_seq *seq);
/* Makes a RELEASED (or empty ACTIVE) seq an empty ACTIVE table again with a new root, keeping
 * its arrays: the engine reuses sequence slots without allocating. ERR_STATE when it still
 * holds blocks or host slots. */
kvf_status kvf_kv_seq_reset(kvf_kv_seq *seq, uint64_t root, kvf_err *err);
/* Grows the table to hold n_blocks without further allocation. ERR_NOMEM leaves it as it was. */
kvf_status kvf_kv_seq_reserve(kvf_kv_seq *seq, int32_t n_blocks, kvf_err *err);

/* Makes slots [n_tokens, n_tokens + n_new) writable and adds n_new to n_tokens: allocates the
 * blocks they need and, when the last block is partial and shared (after a fork), copies it
 * first (copy-on-write through mem->copy_block) so the co-owner is untouched. All or nothing:
 * ERR_FULL (with how many blocks were needed and available) changes nothing. */
kvf_status kvf_kv_seq_prepare_write(kvf_kv_seq *seq, int64_t n_new, kvf_err *err);

/* prepare_write for several sequences at once (one engine step; each sequence listed at most
 * once), all or nothing: either every
 * seqs[i] gets n_new[i] more slots or nothing changes and ERR_FULL says how short the pool is.
 * Copy-on-write copies are counted exactly (siblings that all write share one fewer copy). */
kvf_status kvf_kv_pool_alloc_step(kvf_kv_pool *pool, kvf_kv_seq *const *seqs /* [n] */,
                                  const int64_t *n_new /* [n] */, size_t n, kvf_err *err);

/* Blocks an all-or-nothing step would take, without taking them (for admission control).
 * Sequences that are not ACTIVE in this pool count 0. */
int64_t kvf_kv_pool_step_need(const kvf_kv_pool *pool, kvf_kv_seq *const *seqs /* [n] */,
                              const int64_t *n_new /* [n] */, size_t n);

/* Shares every block of parent with child (refcount + 1 each): parallel sampling. child must
 * be initialised and empty; it gets parent's root, tokens and hashes. Allocates only child's
 * table. */
kvf_status kvf_kv_seq_fork(kvf_kv_seq *parent, kvf_kv_seq *child, kvf_err *err);

/* Registers the full blocks of seq that are not yet registered, hashing tokens (the sequence's
 * whole token list, [n_tokens] with n_tokens <= seq->n_tokens) from block n_hashed on. Each
 * new hash publishes a STORED event carrying its parent hash. A hash already cached under
 * another block leaves this block unregistered (it is freed, not cached, when released). */
kvf_status kvf_kv_seq_commit(kvf_kv_seq *seq, const int32_t *tokens /* [n_tokens] */,
                             int64_t n_tokens, kvf_err *err);

/* Releases every block of seq (refcount - 1; a registered block reaching 0 becomes CACHED,
 * later blocks of the sequence first in eviction order; others go FREE) and marks it
 * RELEASED. Every block id is checked before anything changes: an id outside the pool
 * ("foreign block") or a refcount that would go below zero ("double free") is ERR_INVALID /
 * ERR_STATE and changes nothing. Freeing a RELEASED sequence is ERR_STATE (double free). */
kvf_status kvf_kv_seq_free(kvf_kv_seq *seq, kvf_err *err);

/* For a peer that writes blocks remotely (a prefill worker filling a decode worker's pool):
 * takes the given specific blocks, which must be FREE or CACHED (a cached one is evicted
 * first), appends them to seq with refcount 1 and adds n_tokens to seq->n_tokens. seq's last
 * block must be full (or seq empty) and blocks_for(n_tokens) == n_ids. All or nothing. After
 * the data lands, kvf_kv_seq_commit registers them. */
kvf_status kvf_kv_seq_adopt(kvf_kv_seq *seq, const int32_t *ids /* [n_ids] */, int32_t n_ids,
                            int64_t n_tokens, kvf_err *err);

/* ---- prefix cache ------------------------------------------------------------------------ */

/* For an empty ACTIVE seq: finds the leading full blocks of tokens that are cached, each
 * confirmed by comparing its stored token ids and parent hash (a hash collision is a miss),
 * takes a reference on each, appends them to seq and sets n_tokens = n_hashed = hits *
 * block_size. *n_hit_tokens_out gets the tokens covered. To keep at least one token to
 * compute, pass n_tokens - 1. Expired blocks are misses (and are dropped).
 * With tiers, a block missing from the pool is looked for in the tiers (token-verified the
 * same way) and promoted: a pool block is taken (evicting/demoting as allocation does), the
 * bytes copied in with mem->from_host, the hash registered (STORED, tier POOL) and referenced
 * as a pool hit; through the copy thread, the copy and registration come later (below). The
 * walk stops at the first miss, when no pool block is available, when the copy queue is full,
 * or (synchronous) when a disk read is refused. */
kvf_status kvf_kv_prefix_lookup(kvf_kv_seq *seq, const int32_t *tokens /* [n_tokens] */,
                                int64_t n_tokens, int64_t *n_hit_tokens_out, kvf_err *err);

/* ---- promotions through the tiers' copy thread ----
 * A lookup that promotes through the copy thread appends the blocks (with the sequence's
 * reference) and counts them in n_tokens/n_hashed at once, but registers each hash only when its
 * copy completes, so no other lookup can hit half-copied KV (it misses there for now). Until
 * kvf_kv_seq_promotions_pending(seq) is 0 the sequence must not be computed: prepare_write,
 * alloc_step, fork, adopt and swap out refuse it (ERR_STATE); free and fini are fine (a block
 * still being written is LANDING until its copy ends, never FREE before). A copy that fails (a
 * disk read refused, a failed copy) cuts the sequence's prefix at that block: n_blocks, n_hashed
 * and n_tokens go back to there and the blocks after it are released. */

/* Completes every finished promotion: registers the hash (STORED, tier POOL; unless the pool
 * computed it meanwhile), frees the tier slot, lands LANDING blocks, cuts sequences at failed
 * copies. Never blocks. Returns how many completed. A no-op without the copy thread. */
int32_t kvf_kv_pool_poll_promotions(kvf_kv_pool *pool);
/* Blocks (on a condition variable, not spinning) until a promotion has finished or timeout_ns
 * passed, then polls; returns how many completed. At once when none is in flight. */
int32_t kvf_kv_pool_wait_promotions(kvf_kv_pool *pool, int64_t timeout_ns);
/* Blocks of seq a promotion is still copying into: seq may be computed when this is 0. */
int32_t kvf_kv_seq_promotions_pending(const kvf_kv_seq *seq);

/* The same with the block hashes given by the caller (e.g. computed by the router):
 * hashes[i] must be the chain hash of block i of tokens; tokens holds n_blocks full blocks. */
kvf_status kvf_kv_prefix_lookup_hashes(kvf_kv_seq *seq, const uint64_t *hashes /* [n_blocks] */,
                                       const int32_t *tokens /* [n_blocks * block_size] */,
                                       int32_t n_blocks, int32_t *n_hit_blocks_out,
                                       kvf_err *err);

/* How many leading full blocks of tokens are cached now in the pool or a tier (token-verified),
 * taking nothing (a tier block still needs a pool block to be promoted into). */
int32_t kvf_kv_prefix_probe(const kvf_kv_pool *pool, uint64_t root,
                            const int32_t *tokens /* [n_tokens] */, int64_t n_tokens);

/* Pins the leading cached blocks of tokens (a system prompt) so they are never evicted or
 * expired; *n_pinned_out gets how many blocks. Pins nest; unpin undoes one pin of each. */
kvf_status kvf_kv_prefix_pin(kvf_kv_pool *pool, uint64_t root, const int32_t *tokens,
                             int64_t n_tokens, int32_t *n_pinned_out, kvf_err *err);
kvf_status kvf_kv_prefix_unpin(kvf_kv_pool *pool, uint64_t root, const int32_t *tokens,
                               int64_t n_tokens, int32_t *n_unpinned_out, kvf_err *err);

/* Calls fn with a STORED event for every block registered now (cached, pinned or in use), for
 * the snapshot a KV-event stream starts with (WatchKv); the deltas then come through
 * cfg.on_event. Order: by block id, not by chain; then the host tier's blocks and the disk
 * tier's (tier set, block -1), oldest first. Returns how many. fn must not call back into the
 * pool. */
int32_t kvf_kv_prefix_snapshot(const kvf_kv_pool *pool, kvf_kv_event_fn fn, void *ctx);

/* ---- checking ---------------------------------------------------------------------------- */

/* Checks every rule above against the complete list of live sequences of pool (ACTIVE ones
 * count; SWAPPED and RELEASED ones hold no pool blocks): each block in exactly one state,
 * refcount == number of tables holding it, free list / LRU / hash map consistent with the
 * states, LRU ordered by time, counts adding up; with tiers, the tiers' own rules too (slot
 * counts, LRU order, index, no hash in two tiers or in the pool and a tier). The first broken
 * rule is ERR_INTERNAL with a message naming the block and the values. Allocates nothing. */
kvf_status kvf_kv_check_invariants(const kvf_kv_pool *pool,
                                   const kvf_kv_seq *const *seqs /* [n_seqs] */, size_t n_seqs,
                                   kvf_err *err);

#endif
