/* prefill.h: the prefill role on top of a kvf_worker: RemotePrefill computes a prompt's KV in
 * this worker's own pool (reusing its own prefix cache) as a prefill-only request of the
 * worker's engine, writes the blocks the decode worker lacks into the decode worker's blocks
 * through the transport, and answers with the first token. Concurrent calls share the engine's
 * steps (its batching: up to --max-seqs prompts and --max-batch-tokens tokens a step, admitted
 * in arrival order while the pool has blocks), each answered when its own write is
 * acknowledged. */
#ifndef KVF_PREFILL_PREFILL_H
#define KVF_PREFILL_PREFILL_H

#include "common/status.h"
#include "worker/worker.h"

typedef struct kvf_prefill kvf_prefill;

/* Installs hooks and registers RemotePrefill; call before kvf_worker_start on a
 * KVF_WORKER_PREFILL worker. fault_delay_ms > 0 sleeps that long (on the loop thread) as each
 * call is handed to the engine (for fault tests that must kill a prefill worker mid-request, or hold calls
 * in its queue). Destroy after the worker shut down. */
kvf_status kvf_prefill_create(kvf_worker *w, int32_t fault_delay_ms, kvf_prefill **out,
                              kvf_err *err);
void kvf_prefill_destroy(kvf_prefill *p);

#endif
