/* decode.h: the decode role on top of a kvf_worker: the Generate stream (local prefill, or
 * RemotePrefill on the prefill worker the router names, with a deadline and a local fallback),
 * Cancel, and the decode metrics (remote/local prefills, fallbacks, KV bytes received, blocks
 * held for given-up remote prefills until their writer stopped: docs/NOTES.md). Colocated mode
 * is the same code with no prefill hint in the requests. */
#ifndef KVF_DECODE_DECODE_H
#define KVF_DECODE_DECODE_H

#include "common/status.h"
#include "worker/worker.h"

typedef struct kvf_decode kvf_decode;

/* Installs the worker's hooks and registers Generate and Cancel on its server; call before
 * kvf_worker_start. The worker must be a KVF_WORKER_DECODE one. Destroy after the worker has
 * shut down (kvf_worker_shutdown), before kvf_worker_destroy. */
kvf_status kvf_decode_create(kvf_worker *w, kvf_decode **out, kvf_err *err);
void kvf_decode_destroy(kvf_decode *d);

#endif
