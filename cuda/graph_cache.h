/* graph_cache.h: when the CUDA backend records a decode step as a CUDA graph, replays one, or
 * runs the step kernel by kernel, and which recorded graph to drop when the cache is full. Plain
 * C with the graphs as opaque pointers (cudaGraphExec_t), so the policy is tested on the host;
 * backend.cu owns creating and destroying the graphs. */
#ifndef KVF_CUDA_GRAPH_CACHE_H
#define KVF_CUDA_GRAPH_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "cuda/cuda.h"
#include "model/backend.h"

typedef enum kvf_cuda_step_plan {
    KVF_CUDA_STEP_EAGER = 0,   /* issue the ops, record nothing */
    KVF_CUDA_STEP_CAPTURE = 1, /* issue the ops under stream capture, then store the graph */
    KVF_CUDA_STEP_REPLAY = 2,  /* launch the stored graph of this key; issue nothing */
} kvf_cuda_step_plan;

/* Caller-allocated, zeroed = empty. */
typedef struct kvf_cuda_graph_cache {
    kvf_backend_step_key keys[KVF_CUDA_MAX_GRAPHS];
    void *exec[KVF_CUDA_MAX_GRAPHS]; /* NULL: empty slot */
    uint64_t last_used[KVF_CUDA_MAX_GRAPHS];
    uint64_t tick;
    kvf_backend_step_key prev; /* the previous step's key */
    bool prev_valid;
    int32_t n; /* slots in use */
} kvf_cuda_graph_cache;

/* The plan for a step with this key. Only decode-only steps are recorded, and only when
 * `enabled`. A stored graph of an equal key is replayed (*slot_out gets its slot, touched as
 * most recently used); otherwise a key equal to the previous step's is captured (its buffers
 * have grown already, so nothing allocates during the capture); anything else runs eagerly.
 * Remembers key as the previous step's. */
kvf_cuda_step_plan kvf_cuda_graph_plan(kvf_cuda_graph_cache *g, const kvf_backend_step_key *key,
                                       bool enabled, int32_t *slot_out);

/* Stores exec for key in a free slot, or in the least recently used one; returns the graph it
 * replaced (the caller destroys it) or NULL. *slot_out gets the slot. */
void *kvf_cuda_graph_store(kvf_cuda_graph_cache *g, const kvf_backend_step_key *key, void *exec,
                           int32_t *slot_out);

/* Empties the cache (and forgets the previous key), calling drop on every stored graph. */
void kvf_cuda_graph_clear(kvf_cuda_graph_cache *g, void (*drop)(void *exec));

bool kvf_cuda_step_key_equal(const kvf_backend_step_key *a, const kvf_backend_step_key *b);

#endif
