/* prefill.h: the prefill role on top of a kvf_worker: RemotePrefill computes a prompt's KV in
 * this worker's own pool (reusing its own prefix cache), writes the blocks the decode worker
 * lacks into the decode worker's blocks through the transport, and answers with the first
 * token. Concurrent calls are batched on the worker's loop thread: admitted in arrival order
 * (up to --max-seqs at once, waiting while the pool is short of blocks), computed together in
 * shared forward steps of up to --max-batch-tokens, each answered when its own write is
 * acknowledged. */
#ifndef KVF_PREFILL_PREFILL_H
#define KVF_PREFILL_PREFILL_H

#include "common/status.h"
#include "worker/worker.h"

typedef struct kvf_prefill kvf_prefill;

/* Installs hooks and registers RemotePrefill; call before kvf_worker_start on a
 * KVF_WORKER_PREFILL worker. fault_delay_ms > 0 sleeps that long (on the loop thread) as each
 * call is admitted (for fault tests that must kill a prefill worker mid-request, or hold calls
 * in its queue). Destroy after the worker shut down. */
kvf_status kvf_prefill_create(kvf_worker *w, int32_t fault_delay_ms, kvf_prefill **out,
                              kvf_err *err);
void kvf_prefill_destroy(kvf_prefill *p);

#endif
