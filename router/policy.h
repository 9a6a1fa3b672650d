/* policy.h: routing policies over one pool of workers (decode or prefill; a disaggregated request
 * picks from each): KV index, reported load and busy limits, prefill-time fit, sticky ring, and
 * predictions for workers that publish no events. Single-threaded; HTTP and RPC live elsewhere. */
#ifndef KVF_ROUTER_POLICY_H
#define KVF_ROUTER_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "router/index.h"

typedef enum kvf_router_policy {
    KVF_ROUTER_POLICY_KV = 0,       /* least predicted work: uncached prompt + queue + decode */
    KVF_ROUTER_POLICY_ROUND_ROBIN,  /* next non-busy worker in turn */
    KVF_ROUTER_POLICY_LEAST_LOADED, /* least queued prefill work + decode load */
    KVF_ROUTER_POLICY_STICKY,       /* consistent hashing with bounded load on the first blocks */
} kvf_router_policy;

/* "kv", "round-robin", "least-loaded", "sticky"; anything else is refused naming the choices. */
kvf_status kvf_router_policy_parse(const char *s, kvf_router_policy *out, kvf_err *err);
const char *kvf_router_policy_name(kvf_router_policy p);

typedef struct kvf_router_pool_cfg {
    kvf_router_policy policy;
    kvf_router_index_cfg index; /* model, block size, staleness */
    /* cost(w) = w_uncached * (a + b * uncached_tokens(w)) + w_queue * b * queued_tokens(w)
     *         + w_decode * decode_load(w)       (seconds; a, b fitted online)
     * w_queue below 1 favours cache affinity over the queue seen now: a miss costs the fleet
     * the prefill again on later turns (0.25 meets the Mooncake targets, bench/sim_mooncake.sh) */
    double w_uncached, w_queue, w_decode;
    /* Seconds to promote one block from a worker's host or disk tier into its pool: a cached
     * prefix there costs this per block instead of nothing (pool) or its prefill (miss). */
    double host_s_per_block, disk_s_per_block;
    double temperature;     /* 0: lowest cost wins; > 0: softmax over -cost / temperature (s) */
    double prefill_a_s;     /* prefill time model before any report: a + b * tokens */
    double prefill_b_s;
    double fit_forget;      /* forgetting factor per prefill report in the fit (0 < f <= 1) */
    int64_t busy_queued_tokens; /* default per-worker busy limits; 0 = none */
    double busy_decode;
    int32_t sticky_blocks;  /* the sticky key is the hash of the first this many blocks */
    double sticky_bound;    /* bounded load: a worker takes a request while its load stays
                               within sticky_bound x the mean (>= 1) */
    int32_t sticky_vnodes;  /* points per worker on the ring */
    int32_t min_overlap_blocks; /* kv: below this best overlap the index knows nothing useful
                                   and the sticky ring decides */
    double load_bound;      /* kv, bounded load on skew: a worker whose recent computed prompt
                               tokens exceed load_bound x the mean (this request counted in) is not
                               chosen while another is not, so a hot prefix whose holders are the
                               busiest is copied to one more replica (>= 1; 0 = off) */
    double load_window_s;   /* recent computed tokens decay as exp(-age / load_window_s) */
    double load_penalty;    /* a hit's cost on a worker past the line grows by this x the prefill
                               time of its excess tokens (1: an excess token costs as much as
                               computing one; 0.5 lets a cached prefix outweigh twice its size
                               of excess, so conversations move less and a hot prefix still
                               spreads) */
    bool approx;            /* every worker is approximate (publishes no events) */
    double approx_ttl_s;    /* predictions older than this are dropped */
    int64_t approx_max_blocks; /* predictions kept per worker */
    uint64_t seed;          /* random tie-breaks and softmax draws */
} kvf_router_pool_cfg;

/* Defaults: policy kv, block 16, weights 1/0.25/0.005 s, a = 0.02 s, b = 5e-5 s/token,
 * promotion 2 MiB a block over 20 GB/s (host) and 5 GB/s (disk), penalty 0.5,
 * fit_forget 0.995, no busy limits, sticky on 64 blocks with bound 1.1 and 64 vnodes,
 * min overlap 1 block, load bound 1.1 over an 1800 s window, approx TTL 300 s and 1M blocks.
 * The index model must be set. */
void kvf_router_pool_cfg_default(kvf_router_pool_cfg *cfg);

typedef struct kvf_router_load {
    int64_t queued_prefill_tokens; /* prompt tokens waiting for or in prefill */
    double decode_load;            /* running decode sequences */
    /* The worker's own measured seconds to promote one block from its host / disk tier into its
     * pool (WatchKv load reports); 0 (not measured, no such tier; also a negative or non-finite
     * value): the pool's host_s_per_block / disk_s_per_block price its tier hits. */
    double host_s_per_block, disk_s_per_block;
} kvf_router_load;

typedef struct kvf_router_request {
    const uint64_t *hashes; /* [n_blocks] the prompt's chained block hashes */
    size_t n_blocks;
    int64_t n_tokens;        /* prompt tokens (>= n_blocks * block_size) */
    const char *session_key; /* optional: the sticky key instead of the first blocks */
} kvf_router_request;

typedef enum kvf_router_reason {
    KVF_ROUTER_BY_COST,
    KVF_ROUTER_BY_STICKY,
    KVF_ROUTER_BY_ROUND_ROBIN,
    KVF_ROUTER_BY_LEAST_LOADED,
} kvf_router_reason;

typedef struct kvf_router_decision {
    int32_t worker;
    uint32_t overlap_blocks; /* leading prompt blocks the index says it holds */
    double cached_tokens;    /* overlap in tokens, weighted by trust in the worker's events */
    double cost_s;           /* predicted work there (kv policy), else its load in seconds */
    kvf_router_reason reason;
    bool all_busy;           /* every worker was at its busy limit; the least costly was taken */
} kvf_router_decision;

typedef struct kvf_router_pool kvf_router_pool;

kvf_status kvf_router_pool_create(const kvf_router_pool_cfg *cfg, kvf_router_pool **out,
                                  kvf_err *err);
void kvf_router_pool_destroy(kvf_router_pool *p);

/* Adds a worker (id < KVF_ROUTER_MAX_WORKERS). publishes_events = false puts it in approximate
 * mode. A different model or block size is refused with a log line (KVF_ERR_INVALID). */
kvf_status kvf_router_pool_worker_add(kvf_router_pool *p, int32_t worker, const char *model,
                                      int32_t block_size, bool publishes_events, double now,
                                      kvf_err *err);
/* Approximate mode: bounds a worker's predicted blocks by its KV capacity (Info's
 * capacity_blocks) when that is below approx_max_blocks; blocks <= 0 keeps approx_max_blocks.
 * When the bound changes the predictions made so far are forgotten. Nothing for a worker that
 * publishes events. KVF_ERR_INVALID for a worker not in the pool, KVF_ERR_NOMEM. */
kvf_status kvf_router_pool_worker_capacity(kvf_router_pool *p, int32_t worker, int64_t blocks,
                                           kvf_err *err);
/* A worker that left or failed: out of the index and the ring at once. */
void kvf_router_pool_worker_remove(kvf_router_pool *p, int32_t worker);
/* Per-worker busy limits (0 = none); a worker at a limit is skipped while others are not. */
void kvf_router_pool_worker_limits(kvf_router_pool *p, int32_t worker, int64_t queued_tokens,
                                   double decode_load);
/* A load report (also proof of life for staleness). Clears the work this router added since.
 * Its promotion prices replace the worker's previous ones (0: back to the pool's defaults). */
void kvf_router_pool_load_set(kvf_router_pool *p, int32_t worker, const kvf_router_load *load,
                              double now);
/* A finished prefill of `tokens` uncached tokens that took `seconds`: refits a and b. */
void kvf_router_pool_prefill_report(kvf_router_pool *p, int64_t tokens, double seconds);
void kvf_router_pool_prefill_model(const kvf_router_pool *p, double *a_out, double *b_out);
/* The pool's index, for applying the workers' KV events. */
kvf_router_index *kvf_router_pool_index(kvf_router_pool *p);

/* Chooses a worker for req by the pool's policy. KVF_ERR_NOT_FOUND when the pool is empty. */
kvf_status kvf_router_pool_pick(kvf_router_pool *p, const kvf_router_request *req, double now,
                                kvf_router_decision *out, kvf_err *err);
/* Disaggregated serving: a prefill worker and a decode worker, each by its own pool. */
kvf_status kvf_router_pick_disagg(kvf_router_pool *prefill, kvf_router_pool *decode,
                                  const kvf_router_request *req, double now,
                                  kvf_router_decision *prefill_out,
                                  kvf_router_decision *decode_out, kvf_err *err);

#endif
