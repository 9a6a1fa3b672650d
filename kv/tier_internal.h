/* tier_internal.h: what kv/pool.c calls in kv/tier.c: demotion, lookup, promotion, clearing,
 * snapshot and checking. Not for use outside kv/. Every call runs inside a pool call. */
#ifndef KVF_KV_TIER_INTERNAL_H
#define KVF_KV_TIER_INTERNAL_H

#include "kv/pool.h"
#include "kv/tier.h"

/* A block found in a tier. */
typedef struct kvf_kv_tier_ref {
    kvf_kv_tier_kind tier; /* HOST or DISK */
    int32_t slot;
} kvf_kv_tier_ref;

/* Binds t to one pool: its layout must match the tiers' (block bytes, block size); events go
 * to fn (may be NULL). Starts the copy thread unless cfg.synchronous or !mem->from_host_any_thread
 * (it copies into base through mem). ERR_STATE when t already serves a pool. */
kvf_status kvf_kv_tier_attach(kvf_kv_tier *t, const kvf_kv_layout *layout,
                              const kvf_kv_mem_ops *mem, void *mem_ctx, void *base,
                              kvf_kv_event_fn fn, void *ctx, kvf_err *err);
/* Joins the copy thread after it finished every queued copy; jobs not reaped free their slots
 * silently. */
void kvf_kv_tier_detach(kvf_kv_tier *t);

/* ---- promotions through the copy thread (when kvf_kv_tier_async) ---- */

bool kvf_kv_tier_async(const kvf_kv_tier *t);
/* Jobs begun and not yet reaped. */
int32_t kvf_kv_tier_jobs(const kvf_kv_tier *t);
/* Takes a job for the slot r (from kvf_kv_tier_find) and pins it: off the LRU and the index, so
 * no lookup finds it, no eviction or clear drops it; snapshots still list it under its tier.
 * -1 when max_copies jobs are in flight. Then submit (once the pool block is taken) or abort. */
int32_t kvf_kv_tier_job_begin(kvf_kv_tier *t, kvf_kv_tier_ref r);
/* Queues the job: the copy thread copies the slot into pool block `block`. */
void kvf_kv_tier_job_submit(kvf_kv_tier *t, int32_t job, int32_t block);
/* Gives a begun (not submitted) job's slot back to its LRU and index. */
void kvf_kv_tier_job_abort(kvf_kv_tier *t, int32_t job);

typedef struct kvf_kv_tier_done {
    int32_t block; /* the pool block the job wrote */
    bool ok;       /* the bytes are in the block (else a disk read was refused or the copy failed:
                    * the hash was dropped with a REMOVED event unless stale) */
    bool stale;    /* the hash was registered elsewhere meanwhile (forget / put_commit): do not
                    * register this block */
} kvf_kv_tier_done;
/* Takes one finished job, if any: frees its slot (stats, on_promote, or the drop's event) and
 * says which block and how it went. Never blocks. */
bool kvf_kv_tier_reap(kvf_kv_tier *t, kvf_kv_tier_done *out);
/* Blocks until a finished job is waiting to be reaped, or timeout_ns passed (at once when no
 * job is in flight). */
void kvf_kv_tier_wait(kvf_kv_tier *t, int64_t timeout_ns);

/* Demotion in two steps: begin makes room in the host tier (its LRU victim moves to disk or is
 * dropped) and returns the slot's buffer [block_bytes] to copy the block into, or NULL when every
 * host slot is busy with a promotion (drop the block instead); commit registers it there
 * (STORED, tier HOST); abort gives the slot back. */
void *kvf_kv_tier_put_begin(kvf_kv_tier *t, int32_t *slot_out);
void kvf_kv_tier_put_commit(kvf_kv_tier *t, int32_t slot, uint64_t hash, uint64_t parent,
                            const int32_t *tokens /* [block_size] */, int64_t now);
void kvf_kv_tier_put_abort(kvf_kv_tier *t, int32_t slot);

/* The tier slot holding hash with this parent and these tokens (a collision is a miss and is
 * counted); false when none. Counts a hit when count is true (lookups, not probes). */
bool kvf_kv_tier_find(kvf_kv_tier *t, uint64_t hash, uint64_t parent,
                      const int32_t *tokens /* [block_size] */, bool count, kvf_kv_tier_ref *out);
/* Copies the block's bytes out of its slot and frees the slot (no event: the caller moves the
 * hash up). Returns a buffer [block_bytes] valid until the next tier call, or NULL when a disk
 * read is refused (the slot is dropped with a REMOVED event). *t0_out: when it began (ns). */
const void *kvf_kv_tier_take(kvf_kv_tier *t, kvf_kv_tier_ref r, int64_t *t0_out);
/* A block taken from r.tier has landed in the pool after starting at t0 (stats, on_promote). */
void kvf_kv_tier_promoted(kvf_kv_tier *t, kvf_kv_tier_kind tier, int64_t t0);
/* The pool registered hash itself: any tier copy goes, silently (the pool's STORED moves it);
 * a promotion in flight for it is marked stale. */
void kvf_kv_tier_forget(kvf_kv_tier *t, uint64_t hash);
/* Drops every tier block (REMOVED events); a promotion copying one up is marked stale (its
 * block is not registered when it lands); *n_out gets how many. */
void kvf_kv_tier_clear(kvf_kv_tier *t, int32_t *n_out);
/* Calls fn with a STORED event (tier set, block -1) for every tier block; returns how many. */
int32_t kvf_kv_tier_snapshot(const kvf_kv_tier *t, kvf_kv_event_fn fn, void *ctx);
/* Slot counts, LRU order and links, index consistency, no hash in both tiers, and none that
 * pool_has (the pool's own registered hashes). First broken rule: ERR_INTERNAL. */
kvf_status kvf_kv_tier_check(const kvf_kv_tier *t, bool (*pool_has)(const void *ctx, uint64_t h),
                             const void *pool_ctx, kvf_err *err);

#endif
