/* sim.h: replays a trace through the real router (policy + index) against simulated workers: prefix
 * caches with the workers' eviction rule that publish KV events, and a prefill/decode time model;
 * `fleet-lru` is the reference: one cache of n_workers x capacity shared by the whole fleet. */
#ifndef KVF_ROUTER_SIM_H
#define KVF_ROUTER_SIM_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "router/index.h"
#include "router/policy.h"
#include "router/trace.h"

typedef struct kvf_router_sim_cfg {
    int32_t n_workers;         /* 1 .. KVF_ROUTER_MAX_WORKERS */
    double capacity_blocks;    /* cache per worker, in trace blocks (512 tokens) */
    bool fleet_lru;            /* the reference: one shared cache; timing by least-loaded */
    kvf_router_pool_cfg pool;  /* the router under test (policy, weights, approx mode) */
    /* Time model of the simulated workers (each serves its prefills one at a time, FIFO):
     *   prefill = prefill_a_s + prefill_b_s * uncached tokens; TTFT = queue wait + prefill;
     *   then decode takes decode_s_per_token per output token, blocks pinned until it ends. */
    double prefill_a_s, prefill_b_s, decode_s_per_token;
} kvf_router_sim_cfg;

/* Defaults: 8 workers, 1250 trace blocks each, policy kv, a = 0.02 s, b = 5e-5 s/token
 * (20k tokens/s per worker), 0.02 s per output token. pool.index.model is "mooncake". */
void kvf_router_sim_cfg_default(kvf_router_sim_cfg *cfg);

typedef struct kvf_router_sim_result {
    int64_t n_requests;
    int64_t blocks, blocks_hit;             /* hashed (block_size) blocks; leading hits only */
    int64_t tokens, tokens_hit;             /* prompt tokens; tokens served from cache */
    int64_t trace_blocks, trace_blocks_hit; /* trace blocks whose every full block hit */
    double hit_rate_blocks, hit_rate_tokens, hit_rate_trace_blocks;
    double load_max_over_mean;              /* of computed (uncached) prompt tokens per worker */
    double ttft_p50_s, ttft_p99_s, ttft_mean_s;
    int64_t computed_tokens[KVF_ROUTER_MAX_WORKERS];
    int64_t evicted_blocks, uncacheable_blocks; /* the latter: cache full of pinned blocks */
    double fitted_a_s, fitted_b_s;          /* the router's prefill fit at the end */
    kvf_router_index_stats index;           /* the router's index at the end */
    double wall_s;
} kvf_router_sim_result;

kvf_status kvf_router_sim_run(const kvf_router_trace *trace, const kvf_router_sim_cfg *cfg,
                              kvf_router_sim_result *out, kvf_err *err);

#endif
