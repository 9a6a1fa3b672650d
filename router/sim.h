/* sim.h: replays a trace through the real router (policy + index) against simulated workers: prefix
 * caches with the workers' eviction rule that publish KV events, optional host and disk tiers under
 * each pool, and a prefill/decode time model; `fleet-lru` is the reference: one cache (and tiers)
 * of n_workers x capacity shared by the whole fleet. */
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
    /* Tiers under each worker's pool, in trace blocks (0 = none): the pool's LRU victims are
     * demoted to the host tier's LRU, its victims to the disk tier's, and the disk's are dropped.
     * A prompt's leading block found in a tier is promoted back (a hit of that tier) and costs
     * its copy, kv_bytes_per_token x block_size / bandwidth, added to the prefill time. */
    double host_capacity_blocks, disk_capacity_blocks;
    double host_bytes_per_s, disk_bytes_per_s;
    double kv_bytes_per_token;
    /* Optional: called every 1000 requests and at the end (a full trace with tiers runs for
     * seconds to minutes; the command shows progress on a terminal). */
    void (*progress)(void *arg, size_t done, size_t total);
    void *progress_arg;
} kvf_router_sim_cfg;

/* Defaults: 8 workers, 1250 trace blocks each, policy kv, a = 0.02 s, b = 5e-5 s/token
 * (20k tokens/s per worker), 0.02 s per output token, no tiers; host 20 GB/s, disk 5 GB/s,
 * 128 KiB of KV per token (Llama-3-8B in f16). pool.index.model is "mooncake". */
void kvf_router_sim_cfg_default(kvf_router_sim_cfg *cfg);

typedef struct kvf_router_sim_result {
    int64_t n_requests;
    int64_t blocks, blocks_hit;             /* hashed (block_size) blocks; leading hits only */
    int64_t blocks_hit_tier[3];             /* of blocks_hit, found in the pool, host, disk */
    double hit_rate_tier[3];                /* blocks_hit_tier / blocks */
    int64_t demoted_blocks, promoted_blocks; /* pool -> a lower tier; a lower tier -> pool */
    int64_t tokens, tokens_hit;             /* prompt tokens; tokens served from cache */
    int64_t trace_blocks, trace_blocks_hit; /* trace blocks whose every full block hit */
    double hit_rate_blocks, hit_rate_tokens, hit_rate_trace_blocks;
    double load_max_over_mean;              /* of computed (uncached) prompt tokens per worker */
    double ttft_p50_s, ttft_p99_s, ttft_mean_s;
    int64_t computed_tokens[KVF_ROUTER_MAX_WORKERS];
    int64_t evicted_blocks, uncacheable_blocks; /* the latter: cache full of pinned blocks */
    int64_t dropped_blocks;                 /* left the worker entirely (pool or last tier) */
    double fitted_a_s, fitted_b_s;          /* the router's prefill fit at the end */
    kvf_router_index_stats index;           /* the router's index at the end */
    double wall_s;
} kvf_router_sim_result;

kvf_status kvf_router_sim_run(const kvf_router_trace *trace, const kvf_router_sim_cfg *cfg,
                              kvf_router_sim_result *out, kvf_err *err);

/* A skewed trace, for bounded-load tests: each request is one of n_prefixes long shared prefixes,
 * chosen with Zipf probability P(k) ~ 1 / (k + 1)^zipf_s, followed by suffix_blocks trace blocks
 * of its own; Poisson arrivals at rate_per_s. Deterministic for a seed. */
typedef struct kvf_router_synth_cfg {
    int64_t n_requests;    /* 1 .. 10^7 */
    int32_t n_prefixes;    /* 1 .. 10^6 */
    double zipf_s;         /* >= 0 (0: uniform) */
    int32_t prefix_blocks; /* trace blocks per shared prefix, >= 1 */
    int32_t suffix_blocks; /* unique trace blocks per request, >= 1 (the last one is partial) */
    double rate_per_s;     /* > 0 */
    int32_t output_tokens; /* per request, >= 0 */
    int32_t trace_block_tokens;
    uint64_t seed;
} kvf_router_synth_cfg;

/* Defaults: 3000 requests, 8 prefixes, s = 1.2, 16 + 2 blocks of 512 tokens, 20 req/s, 100
 * output tokens, seed 1. */
void kvf_router_synth_cfg_default(kvf_router_synth_cfg *cfg);
/* Writes the trace as Mooncake JSON Lines into a malloc'd buffer (*text_out, the caller frees;
 * *len_out bytes, NUL-terminated), ready for kvf_router_trace_parse or a file. */
kvf_status kvf_router_synth_zipf(const kvf_router_synth_cfg *cfg, char **text_out, size_t *len_out,
                                 kvf_err *err);

#endif
