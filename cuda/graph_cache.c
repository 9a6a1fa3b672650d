/* graph_cache.c: the CUDA-graph policy of the backend (graph_cache.h): plan a step, store a
 * recorded graph with least-recently-used eviction, clear. No CUDA calls here. */
#include "cuda/graph_cache.h"

#include <string.h>

bool kvf_cuda_step_key_equal(const kvf_backend_step_key *a, const kvf_backend_step_key *b)
{
    return a->n_tokens == b->n_tokens && a->n_seqs == b->n_seqs &&
           a->ctx_bucket == b->ctx_bucket && a->decode_only == b->decode_only &&
           a->kv_pool == b->kv_pool;
}

kvf_cuda_step_plan kvf_cuda_graph_plan(kvf_cuda_graph_cache *g, const kvf_backend_step_key *key,
                                       bool enabled, int32_t *slot_out)
{
    bool same = g->prev_valid && kvf_cuda_step_key_equal(key, &g->prev);
    g->prev = *key;
    g->prev_valid = true;
    *slot_out = -1;
    if (!enabled || !key->decode_only)
        return KVF_CUDA_STEP_EAGER;
    for (int32_t i = 0; i < KVF_CUDA_MAX_GRAPHS; i++)
        if (g->exec[i] && kvf_cuda_step_key_equal(&g->keys[i], key)) {
            g->last_used[i] = ++g->tick;
            *slot_out = i;
            return KVF_CUDA_STEP_REPLAY;
        }
    return same ? KVF_CUDA_STEP_CAPTURE : KVF_CUDA_STEP_EAGER;
}

void *kvf_cuda_graph_store(kvf_cuda_graph_cache *g, const kvf_backend_step_key *key, void *exec,
                           int32_t *slot_out)
{
    int32_t slot = -1;
    void *old = NULL;
    for (int32_t i = 0; i < KVF_CUDA_MAX_GRAPHS && slot < 0; i++)
        if (!g->exec[i])
            slot = i;
    if (slot < 0) {
        slot = 0;
        for (int32_t i = 1; i < KVF_CUDA_MAX_GRAPHS; i++)
            if (g->last_used[i] < g->last_used[slot])
                slot = i;
        old = g->exec[slot];
    } else {
        g->n++;
    }
    g->keys[slot] = *key;
    g->exec[slot] = exec;
    g->last_used[slot] = ++g->tick;
    *slot_out = slot;
    return old;
}

void kvf_cuda_graph_clear(kvf_cuda_graph_cache *g, void (*drop)(void *exec))
{
    for (int32_t i = 0; i < KVF_CUDA_MAX_GRAPHS; i++)
        if (g->exec[i]) {
            if (drop)
                drop(g->exec[i]);
            g->exec[i] = NULL;
        }
    g->n = 0;
    g->prev_valid = false;
}
