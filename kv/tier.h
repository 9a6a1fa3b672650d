/* tier.h: the worker's KV tiers under the block pool: a host-memory tier, and under it an
 * optional local-disk tier (one file of fixed, checksummed slots). The pool (kv/pool.h) drives
 * them: a CACHED block it evicts is demoted into the host tier instead of dropped, the host
 * tier's LRU victim goes to disk (or is dropped), and a prefix lookup that runs out of pool hits
 * continues into the tiers, promoting each further block it finds back into a pool block.
 *
 * A hash lives in one place at a time: the pool, the host tier or the disk tier (demotion moves
 * it down, promotion moves it up and frees the tier slot). Each tier is an LRU of its own. A
 * disk slot carries its hash, parent hash, token ids and an XXH3 checksum over header and bytes;
 * a read whose length, checksum or stored hash/tokens disagree is a miss and the slot is dropped.
 *
 * Promotions run on a copy thread the tier set owns (started when a pool attaches, joined when
 * it detaches): a prefix lookup that hits a tier takes the pool block, pins the tier slot (off
 * the LRU and the index: nothing evicts, drops or finds it) and queues a job (source: a host
 * slot, or a disk slot to pread and verify; destination: the pool block). The thread only moves
 * bytes (memcpy, or pread + checksum, then the pool's from_host) and reports each job done or
 * failed; everything that changes pool or tier state (registering the hash, events, freeing the
 * slot, stats, on_promote) runs on the pool's thread when it polls (kvf_kv_pool_poll_promotions).
 * The queue is bounded (max_copies): a lookup that finds it full stops there (a miss).
 * Demotion (to_host, pwrite) stays synchronous, inside the pool call that evicts.
 *
 * The copy thread is used only when the pool's memory ops say from_host may run on another
 * thread (kvf_kv_mem_ops.from_host_any_thread: host memory does). The CUDA backend's do not: its
 * from_host is a cudaMemcpyAsync + cudaStreamSynchronize on the compute stream, which the engine
 * thread is using (and may be capturing into a CUDA graph), so a CUDA pool keeps synchronous
 * promotions, as does cfg.synchronous. What a GPU needs for the copy thread: tier memory pinned
 * (cudaHostAlloc, through a mem op that allocates it, so the host tier and the disk staging
 * buffer are DMA-able), a copy stream of its own, cudaMemcpyAsync on it per job with an event
 * recorded after it, and completion when that event has completed (cudaEventQuery from the poll,
 * or cudaEventSynchronize on the thread), never a sync of the compute stream.
 *
 * Apart from that thread, not thread-safe; one tier set belongs to one pool
 * (kvf_kv_pool_cfg.tier), which it must outlive. The caller creates and destroys it. */
#ifndef KVF_KV_TIER_H
#define KVF_KV_TIER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "kv/layout.h"

typedef struct kvf_kv_tier kvf_kv_tier;

/* Where a block is held; kvf_kv_event.tier. The same numbers as the wire's KVF_RPC_TIER_*. */
typedef enum kvf_kv_tier_kind {
    KVF_KV_TIER_POOL = 0,
    KVF_KV_TIER_HOST = 1,
    KVF_KV_TIER_DISK = 2,
} kvf_kv_tier_kind;

typedef struct kvf_kv_tier_cfg {
    int64_t host_bytes;   /* host tier bytes, rounded down to whole blocks (>= 1 block) */
    const char *disk_dir; /* NULL or "": no disk tier. Created (0700) if missing; refused when
                           * not a directory of this euid writable by it alone, or locked by
                           * another live tier. A previous kvfleet-kv-tier.bin in it is removed
                           * at create (nothing else is) */
    int64_t disk_bytes;   /* disk tier bytes, rounded down to whole slots (>= 1 with a dir) */
    /* Called after each block promoted from tier (HOST or DISK) with the seconds it took: with
     * the copy thread, from the job's submission (in the lookup, once its pool block was taken)
     * to the end of its copy into the pool (queueing included); synchronous, the copy in, checks
     * and copy into the pool. Neither counts the eviction or demotion of another block made to
     * free the pool block. Runs on
     * the pool's thread (in the poll, or the lookup); may be NULL. Must not call back into the
     * pool. */
    void (*on_promote)(void *ctx, kvf_kv_tier_kind tier, double seconds);
    void *promote_ctx;
    /* true: promote synchronously inside the lookup, no copy thread (tests compare the two). */
    bool synchronous;
    int32_t max_copies; /* promotion jobs in flight at once; 0: 256 */
    /* Tests: called on the copy thread before each copy (to slow it down or hold it); may be
     * NULL. Must not call into the pool or the tiers. */
    void (*copy_hook)(void *ctx, kvf_kv_tier_kind tier, int32_t block);
    void *hook_ctx;
} kvf_kv_tier_cfg;

/* Per tier (index KVF_KV_TIER_HOST or KVF_KV_TIER_DISK; index 0 unused). */
typedef struct kvf_kv_tier_level_stats {
    int64_t capacity, used;    /* slots */
    int64_t hits;              /* blocks a lookup found here (token-verified) */
    int64_t demoted, promoted; /* blocks moved in from above / up into the pool */
    int64_t bytes_demoted, bytes_promoted;
    int64_t dropped;           /* blocks dropped from here (LRU victims with nowhere to go,
                                * failed copies, clears) */
    int64_t corrupt;           /* disk: reads refused (length, checksum, header mismatch) */
    int64_t mismatches;        /* hash found but tokens or parent differed (a miss) */
    int64_t in_flight;         /* slots a promotion is copying up now (counted in used) */
} kvf_kv_tier_level_stats;

typedef struct kvf_kv_tier_stats {
    kvf_kv_tier_level_stats tier[3];
} kvf_kv_tier_stats;

/* Creates the tiers for blocks of layout. host_bytes below one block, or above the machine's
 * physical memory, is ERR_INVALID; a disk dir without disk_bytes for one slot (or disk_bytes
 * without a dir), or disk_bytes above the free space of the dir's filesystem, is ERR_INVALID; a
 * dir that cannot be made or written is ERR_IO naming it. The host memory is allocated first
 * (ERR_NOMEM naming its size when it cannot be); slot metadata is touched only as slots are first
 * used. The caller owns *out. */
kvf_status kvf_kv_tier_create(const kvf_kv_tier_cfg *cfg, const kvf_kv_layout *layout,
                              kvf_kv_tier **out, kvf_err *err);
/* Frees the tiers and removes the disk file. NULL is a no-op. */
void kvf_kv_tier_destroy(kvf_kv_tier *t);

void kvf_kv_tier_get_stats(const kvf_kv_tier *t, kvf_kv_tier_stats *out);
/* The disk file's path ("" without a disk tier). Borrowed. */
const char *kvf_kv_tier_disk_path(const kvf_kv_tier *t);
/* Bytes of one disk slot (header, token ids, block bytes); 0 without a disk tier. */
int64_t kvf_kv_tier_disk_slot_bytes(const kvf_kv_tier *t);
/* Bytes of one disk slot for blocks of layout: the least disk_bytes a disk tier takes. */
int64_t kvf_kv_tier_slot_bytes_for(const kvf_kv_layout *layout);

#endif
