/* cmd_sim.c: `kvfleet sim`: replays a Mooncake trace through the real router code (index and
 * policy) against simulated workers and reports prefix hit rates, load balance and TTFT. The
 * simulation itself is router/sim.c; this file parses flags and prints. */
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "router/sim.h"
#include "router/trace.h"

typedef struct sim_cli_cfg {
    const char *trace, *policy;
    int32_t workers, block_size, trace_block_tokens;
    double capacity_blocks;
    int64_t max_requests;
    double prefill_a, prefill_b, decode_per_token;
    double w_uncached, w_queue, w_decode, temperature;
    int32_t sticky_blocks, min_overlap_blocks;
    double sticky_bound;
    int64_t busy_queued_tokens;
    bool approx, json;
    double approx_ttl;
    int64_t seed;
    const char *synth, *synth_out;
    int64_t synth_requests;
    int32_t synth_prefixes, synth_prefix_blocks, synth_suffix_blocks;
    double synth_zipf_s, synth_rate;
    double load_bound, load_window, load_penalty;
    double host_capacity_blocks, disk_capacity_blocks, host_bandwidth, disk_bandwidth;
    double kv_bytes_per_token;
} sim_cli_cfg;

static const kvf_cfg_opt sim_opts[] = {
    {"trace", NULL, "Mooncake trace (JSON Lines: timestamp, input_length, output_length, hash_ids)", offsetof(sim_cli_cfg, trace), KVF_CFG_STR},
    {"workers", "8", "simulated workers (1..64)", offsetof(sim_cli_cfg, workers), KVF_CFG_INT},
    {"capacity-blocks", "1250", "KV cache per worker, in trace blocks of 512 tokens (fractions allowed)", offsetof(sim_cli_cfg, capacity_blocks), KVF_CFG_DOUBLE},
    {"host-capacity-blocks", "0", "host-memory KV tier per worker, in trace blocks (0 = none): the pool's LRU victims go there", offsetof(sim_cli_cfg, host_capacity_blocks), KVF_CFG_DOUBLE},
    {"disk-capacity-blocks", "0", "disk KV tier per worker, in trace blocks (0 = none): the host tier's LRU victims go there", offsetof(sim_cli_cfg, disk_capacity_blocks), KVF_CFG_DOUBLE},
    {"host-bandwidth", "20e9", "bytes/s of a promotion from the host tier into the pool", offsetof(sim_cli_cfg, host_bandwidth), KVF_CFG_DOUBLE},
    {"disk-bandwidth", "5e9", "bytes/s of a promotion from the disk tier into the pool", offsetof(sim_cli_cfg, disk_bandwidth), KVF_CFG_DOUBLE},
    {"kv-bytes-per-token", "131072", "KV bytes per token, all layers (131072: Llama-3-8B in f16); a block's promotion time is its bytes / bandwidth", offsetof(sim_cli_cfg, kv_bytes_per_token), KVF_CFG_DOUBLE},
    {"policy", "kv", "kv, round-robin, least-loaded, sticky, or fleet-lru (the reference: one LRU cache of workers x capacity shared by the fleet)", offsetof(sim_cli_cfg, policy), KVF_CFG_STR},
    {"approx", NULL, "workers publish no KV events: the router predicts their caches from its own decisions", offsetof(sim_cli_cfg, approx), KVF_CFG_BOOL},
    {"approx-ttl", "3600", "approximate mode: seconds a predicted block is believed (it is also bounded by the worker's capacity)", offsetof(sim_cli_cfg, approx_ttl), KVF_CFG_DOUBLE},
    {"max-requests", "0", "replay only the first N requests (0 = all)", offsetof(sim_cli_cfg, max_requests), KVF_CFG_INT64},
    {"block-size", "16", "tokens per KV block (the router's and the workers' hash unit)", offsetof(sim_cli_cfg, block_size), KVF_CFG_INT},
    {"trace-block-tokens", "512", "tokens per trace hash_id", offsetof(sim_cli_cfg, trace_block_tokens), KVF_CFG_INT},
    {"prefill-a", "0.02", "time model: fixed seconds per prefill", offsetof(sim_cli_cfg, prefill_a), KVF_CFG_DOUBLE},
    {"prefill-b", "5e-5", "time model: seconds per uncached prompt token (5e-5 = 20k tokens/s)", offsetof(sim_cli_cfg, prefill_b), KVF_CFG_DOUBLE},
    {"decode-per-token", "0.02", "time model: seconds per output token", offsetof(sim_cli_cfg, decode_per_token), KVF_CFG_DOUBLE},
    {"w-uncached", "1", "kv cost weight on the prefill time of uncached tokens", offsetof(sim_cli_cfg, w_uncached), KVF_CFG_DOUBLE},
    {"w-queue", "0.25", "kv cost weight on the worker's queued prefill time (below 1 favours cache affinity: a miss costs the fleet again later)", offsetof(sim_cli_cfg, w_queue), KVF_CFG_DOUBLE},
    {"w-decode", "0.005", "kv cost: seconds per running decode sequence", offsetof(sim_cli_cfg, w_decode), KVF_CFG_DOUBLE},
    {"temperature", "0", "kv: softmax temperature in seconds (0 = lowest cost wins)", offsetof(sim_cli_cfg, temperature), KVF_CFG_DOUBLE},
    {"sticky-blocks", "64", "sticky key: the hash of the first N blocks", offsetof(sim_cli_cfg, sticky_blocks), KVF_CFG_INT},
    {"sticky-bound", "1.1", "sticky: a worker takes a request while its load stays within this x the mean", offsetof(sim_cli_cfg, sticky_bound), KVF_CFG_DOUBLE},
    {"min-overlap-blocks", "1", "kv: below this best overlap the sticky ring decides (0 = never)", offsetof(sim_cli_cfg, min_overlap_blocks), KVF_CFG_INT},
    {"busy-queued-tokens", "0", "busy limit per worker: queued prefill tokens (0 = none)", offsetof(sim_cli_cfg, busy_queued_tokens), KVF_CFG_INT64},
    {"load-bound", "1.1", "kv: a worker whose recent computed prompt tokens exceed this x the mean is not chosen while others are not (0 = off)", offsetof(sim_cli_cfg, load_bound), KVF_CFG_DOUBLE},
    {"load-window", "1800", "kv: seconds over which recent computed tokens decay (time constant)", offsetof(sim_cli_cfg, load_window), KVF_CFG_DOUBLE},
    {"load-penalty", "0.5", "kv: a worker past the load line costs this x the prefill time of its excess tokens more", offsetof(sim_cli_cfg, load_penalty), KVF_CFG_DOUBLE},
    {"seed", "1", "random seed for tie-breaks (and the synthetic trace)", offsetof(sim_cli_cfg, seed), KVF_CFG_INT64},
    {"synth", NULL, "instead of --trace: generate a trace; \"zipf\": a Zipf choice among a few long shared prefixes, each request with its own suffix", offsetof(sim_cli_cfg, synth), KVF_CFG_STR},
    {"synth-out", NULL, "also write the generated trace to this file (Mooncake JSON Lines)", offsetof(sim_cli_cfg, synth_out), KVF_CFG_STR},
    {"synth-requests", "3000", "synthetic trace: requests", offsetof(sim_cli_cfg, synth_requests), KVF_CFG_INT64},
    {"synth-prefixes", "8", "synthetic trace: distinct shared prefixes", offsetof(sim_cli_cfg, synth_prefixes), KVF_CFG_INT},
    {"synth-zipf-s", "1.2", "synthetic trace: Zipf exponent of the prefix choice", offsetof(sim_cli_cfg, synth_zipf_s), KVF_CFG_DOUBLE},
    {"synth-prefix-blocks", "16", "synthetic trace: trace blocks per shared prefix", offsetof(sim_cli_cfg, synth_prefix_blocks), KVF_CFG_INT},
    {"synth-suffix-blocks", "2", "synthetic trace: unique trace blocks per request", offsetof(sim_cli_cfg, synth_suffix_blocks), KVF_CFG_INT},
    {"synth-rate", "20", "synthetic trace: requests per second (Poisson)", offsetof(sim_cli_cfg, synth_rate), KVF_CFG_DOUBLE},
    {"json", NULL, "print one JSON object", offsetof(sim_cli_cfg, json), KVF_CFG_BOOL},
    {NULL},
};

static const kvf_cfg_spec sim_spec = {
    .prog = "kvfleet sim",
    .summary =
        "Replays a request trace through the real router code against simulated workers.\n"
        "Each trace block (hash_id) becomes 512 deterministic token ids derived from the id,\n"
        "hashed into chained 16-token blocks, so equal ids give equal prefixes. Each worker\n"
        "has a prefix cache of --capacity-blocks trace blocks (LRU over unreferenced blocks; a\n"
        "finished request's tail blocks are evicted before its head) and publishes stored and\n"
        "removed events to the router's index. A hit counts only for the leading contiguous\n"
        "cached blocks of a prompt.\n"
        "Time model: each worker prefills one request at a time, FIFO;\n"
        "  prefill = prefill-a + prefill-b x uncached tokens, TTFT = queue wait + prefill;\n"
        "  decode then takes decode-per-token per output token (blocks stay pinned).\n"
        "Tiers (--host-capacity-blocks, --disk-capacity-blocks): blocks the pool evicts go to the\n"
        "host tier's LRU, its victims to the disk tier's; a prompt's leading block found in a\n"
        "tier is a hit of that tier, promoted into the pool at kv-bytes-per-token x block-size /\n"
        "bandwidth seconds, added to its prefill. The router's index keeps each block's tier and\n"
        "the kv cost charges a tier hit its promotion time.\n"
        "Reports hit rates (16-token blocks, tokens, whole trace blocks; per tier with tiers), load\n"
        "balance (max/mean of computed prompt tokens per worker) and TTFT p50/p99.",
    .opts = sim_opts,
};

/* Progress on stderr, one line rewritten in place (only when stderr is a terminal). */
static void sim_progress(void *arg, size_t done, size_t total)
{
    (void)arg;
    fprintf(stderr, "\rsim: %zu / %zu requests%s", done, total, done == total ? "\n" : "");
}

int kvf_cli_sim(int argc, char **argv)
{
    /* Everything this command prints (the --help text is over 4 KiB) goes out in one write at
     * exit: a reader that stops at the first match (`| grep -q`) then cannot kill it with
     * SIGPIPE halfway through the text. */
    static char out_buf[1 << 16];
    setvbuf(stdout, out_buf, _IOFBF, sizeof out_buf);
    sim_cli_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&sim_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (!c.trace && !c.synth) {
        kvf_err_set(&err, KVF_ERR_INVALID,
                    "sim: --trace FILE is required (a Mooncake JSON Lines trace), or --synth zipf");
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (c.trace && c.synth) {
        kvf_err_set(&err, KVF_ERR_INVALID, "sim: --trace and --synth exclude each other (give one)");
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (c.synth && strcmp(c.synth, "zipf") != 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "sim: --synth=%s is not known (use zipf)", c.synth);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    kvf_router_sim_cfg sc;
    kvf_router_sim_cfg_default(&sc);
    if (strcmp(c.policy, "fleet-lru") == 0) {
        sc.fleet_lru = true;
    } else if (kvf_router_policy_parse(c.policy, &sc.pool.policy, &err) != KVF_OK) {
        kvf_err_set(&err, KVF_ERR_INVALID,
                    "sim: --policy=%s is not known (use kv, round-robin, least-loaded, sticky or fleet-lru)",
                    c.policy);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (c.max_requests < 0 || c.seed < 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "sim: --max-requests (%lld) and --seed (%lld) must not be negative",
                    (long long)c.max_requests, (long long)c.seed);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    sc.n_workers = c.workers;
    sc.capacity_blocks = c.capacity_blocks;
    sc.prefill_a_s = c.prefill_a;
    sc.prefill_b_s = c.prefill_b;
    sc.decode_s_per_token = c.decode_per_token;
    sc.host_capacity_blocks = c.host_capacity_blocks;
    sc.disk_capacity_blocks = c.disk_capacity_blocks;
    sc.host_bytes_per_s = c.host_bandwidth;
    sc.disk_bytes_per_s = c.disk_bandwidth;
    sc.kv_bytes_per_token = c.kv_bytes_per_token;
    sc.pool.index.block_size = c.block_size;
    sc.pool.w_uncached = c.w_uncached;
    sc.pool.w_queue = c.w_queue;
    sc.pool.w_decode = c.w_decode;
    sc.pool.temperature = c.temperature;
    sc.pool.prefill_a_s = c.prefill_a; /* the router starts from the same guess, then fits */
    sc.pool.prefill_b_s = c.prefill_b;
    sc.pool.sticky_blocks = c.sticky_blocks;
    sc.pool.sticky_bound = c.sticky_bound;
    sc.pool.min_overlap_blocks = c.min_overlap_blocks;
    sc.pool.busy_queued_tokens = c.busy_queued_tokens;
    sc.pool.approx = c.approx;
    sc.pool.approx_ttl_s = c.approx_ttl;
    /* the router knows each worker's capacity (its Info): predictions never exceed it */
    double cap_blocks = c.capacity_blocks * c.trace_block_tokens / (c.block_size > 0 ? c.block_size : 1);
    sc.pool.approx_max_blocks = cap_blocks >= 1 && cap_blocks < 1e9 ? (int64_t)cap_blocks : 1;
    sc.pool.seed = (uint64_t)c.seed;
    sc.pool.load_bound = c.load_bound;
    sc.pool.load_window_s = c.load_window;
    sc.pool.load_penalty = c.load_penalty;

    kvf_router_trace tr;
    if (c.synth) {
        kvf_router_synth_cfg syn;
        kvf_router_synth_cfg_default(&syn);
        syn.n_requests = c.synth_requests;
        syn.n_prefixes = c.synth_prefixes;
        syn.zipf_s = c.synth_zipf_s;
        syn.prefix_blocks = c.synth_prefix_blocks;
        syn.suffix_blocks = c.synth_suffix_blocks;
        syn.rate_per_s = c.synth_rate;
        syn.trace_block_tokens = c.trace_block_tokens;
        syn.seed = (uint64_t)c.seed;
        char *text;
        size_t len;
        if ((st = kvf_router_synth_zipf(&syn, &text, &len, &err)) != KVF_OK)
            return kvf_cli_exit(st, &err);
        if (c.synth_out) {
            FILE *f = fopen(c.synth_out, "w");
            bool ok = f && fwrite(text, 1, len, f) == len;
            if (f && fclose(f) != 0)
                ok = false;
            if (!ok) {
                free(text);
                kvf_err_set(&err, KVF_ERR_IO, "sim: --synth-out=%s: cannot write", c.synth_out);
                return kvf_cli_exit(KVF_ERR_IO, &err);
            }
        }
        c.trace = "synth:zipf";
        st = kvf_router_trace_parse(c.trace, text, len, sc.pool.index.model, c.block_size,
                                    c.trace_block_tokens, (size_t)c.max_requests, &tr, &err);
        free(text);
    } else {
        st = kvf_router_trace_load(c.trace, sc.pool.index.model, c.block_size, c.trace_block_tokens,
                                   (size_t)c.max_requests, &tr, &err);
    }
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (isatty(STDERR_FILENO))
        sc.progress = sim_progress;
    kvf_router_sim_result r;
    st = kvf_router_sim_run(&tr, &sc, &r, &err);
    kvf_router_trace_fini(&tr);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);

    if (c.json) {
        json_t *o = json_object();
        json_t *load = json_array();
        for (int32_t w = 0; w < sc.n_workers; w++)
            json_array_append_new(load, json_integer(r.computed_tokens[w]));
        json_object_set_new(o, "trace", json_string(c.trace));
        json_object_set_new(o, "policy", json_string(c.policy));
        json_object_set_new(o, "approx", json_boolean(c.approx));
        json_object_set_new(o, "workers", json_integer(sc.n_workers));
        json_object_set_new(o, "capacity_blocks", json_real(sc.capacity_blocks));
        json_object_set_new(o, "requests", json_integer(r.n_requests));
        json_object_set_new(o, "hit_rate_blocks", json_real(r.hit_rate_blocks));
        json_object_set_new(o, "hit_rate_tokens", json_real(r.hit_rate_tokens));
        json_object_set_new(o, "hit_rate_trace_blocks", json_real(r.hit_rate_trace_blocks));
        json_object_set_new(o, "host_capacity_blocks", json_real(sc.host_capacity_blocks));
        json_object_set_new(o, "disk_capacity_blocks", json_real(sc.disk_capacity_blocks));
        json_object_set_new(o, "hit_rate_pool", json_real(r.hit_rate_tier[0]));
        json_object_set_new(o, "hit_rate_host", json_real(r.hit_rate_tier[1]));
        json_object_set_new(o, "hit_rate_disk", json_real(r.hit_rate_tier[2]));
        json_object_set_new(o, "demoted_blocks", json_integer(r.demoted_blocks));
        json_object_set_new(o, "promoted_blocks", json_integer(r.promoted_blocks));
        json_object_set_new(o, "dropped_blocks", json_integer(r.dropped_blocks));
        json_object_set_new(o, "load_max_over_mean", json_real(r.load_max_over_mean));
        json_object_set_new(o, "ttft_p50_s", json_real(r.ttft_p50_s));
        json_object_set_new(o, "ttft_p99_s", json_real(r.ttft_p99_s));
        json_object_set_new(o, "ttft_mean_s", json_real(r.ttft_mean_s));
        json_object_set_new(o, "blocks", json_integer(r.blocks));
        json_object_set_new(o, "blocks_hit", json_integer(r.blocks_hit));
        json_object_set_new(o, "tokens", json_integer(r.tokens));
        json_object_set_new(o, "tokens_hit", json_integer(r.tokens_hit));
        json_object_set_new(o, "computed_tokens_per_worker", load);
        json_object_set_new(o, "evicted_blocks", json_integer(r.evicted_blocks));
        json_object_set_new(o, "uncacheable_blocks", json_integer(r.uncacheable_blocks));
        json_object_set_new(o, "fitted_prefill_a_s", json_real(r.fitted_a_s));
        json_object_set_new(o, "fitted_prefill_b_s", json_real(r.fitted_b_s));
        json_object_set_new(o, "index_blocks", json_integer(r.index.n_blocks));
        json_object_set_new(o, "index_bytes_per_block", json_real(r.index.bytes_per_block));
        json_object_set_new(o, "wall_s", json_real(r.wall_s));
        char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(6));
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(o);
        return 0;
    }
    printf("trace %s: %lld requests, %d workers x %g trace blocks, policy %s%s\n", c.trace,
           (long long)r.n_requests, sc.n_workers, sc.capacity_blocks, c.policy,
           c.approx ? " (approximate)" : "");
    printf("hit rate: blocks %.4f  tokens %.4f  trace blocks %.4f\n", r.hit_rate_blocks,
           r.hit_rate_tokens, r.hit_rate_trace_blocks);
    if (sc.host_capacity_blocks > 0 || sc.disk_capacity_blocks > 0)
        printf("tiers (host %g, disk %g trace blocks): block hits pool %.4f  host %.4f  disk %.4f; "
               "%lld demoted, %lld promoted\n", sc.host_capacity_blocks, sc.disk_capacity_blocks,
               r.hit_rate_tier[0], r.hit_rate_tier[1], r.hit_rate_tier[2],
               (long long)r.demoted_blocks, (long long)r.promoted_blocks);
    printf("load max/mean (computed prompt tokens): %.3f\n", r.load_max_over_mean);
    printf("TTFT: p50 %.3f s  p99 %.3f s  mean %.3f s\n", r.ttft_p50_s, r.ttft_p99_s, r.ttft_mean_s);
    printf("router: prefill fit a=%.4f s b=%.3g s/token; index %lld blocks, %.1f bytes/block\n",
           r.fitted_a_s, r.fitted_b_s, (long long)r.index.n_blocks, r.index.bytes_per_block);
    printf("simulated in %.2f s\n", r.wall_s);
    return 0;
}
