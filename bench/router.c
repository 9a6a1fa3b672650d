/* router.c: `kvfleet bench router`: the KV index's operations per second on one core (event
 * blocks applied, blocks looked up) and the routing-decision latency of the kv policy for one
 * prompt against many workers and millions of indexed blocks, with bytes per indexed block.
 * Baseline: random 16-byte reads over a table of the same size, in the same run. */
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "common/cfg.h"
#include "common/time.h"
#include "router/policy.h"

#include <time.h>
#include <unistd.h>

/* CPU time of this thread: on a shared machine, the time the benchmark actually ran. */
static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}


typedef struct router_bench_cfg {
    int32_t workers, prompt_tokens, block_size;
    int64_t blocks, decisions;
    double replicas;
    bool prefix_closed;
} router_bench_cfg;

static const kvf_cfg_opt router_bench_opts[] = {
    {"workers", "64", "workers in the pool (1..64)", offsetof(router_bench_cfg, workers), KVF_CFG_INT},
    {"blocks", "10000000", "distinct indexed blocks", offsetof(router_bench_cfg, blocks), KVF_CFG_INT64},
    {"replicas", "1.5", "mean workers holding each block (1..4)", offsetof(router_bench_cfg, replicas), KVF_CFG_DOUBLE},
    {"prompt-tokens", "2048", "prompt length of each routing decision", offsetof(router_bench_cfg, prompt_tokens), KVF_CFG_INT},
    {"block-size", "16", "tokens per block", offsetof(router_bench_cfg, block_size), KVF_CFG_INT},
    {"prefix-closed", NULL, "the index samples prompts (exact when caches are prefix-closed, as here)", offsetof(router_bench_cfg, prefix_closed), KVF_CFG_BOOL},
    {"decisions", "200000", "routing decisions timed", offsetof(router_bench_cfg, decisions), KVF_CFG_INT64},
    {NULL},
};

static const kvf_cfg_spec router_bench_spec = {
    .prog = "kvfleet bench router",
    .summary = "Fills a router index with --blocks blocks held by --workers workers (as chains of\n"
               "prompt-length prefixes), then measures on one thread: stored/removed event blocks\n"
               "applied and blocks looked up (prefix overlap for all workers at once) per CPU-second\n"
               "and per wall-second, and the wall-clock latency of one kv-policy decision for a\n"
               "--prompt-tokens prompt, with the exact overlap (every block read) and the sampled one\n"
               "(prefix-closed caches). Baseline: random 16-byte reads over a table as large.\n"
               "Ends with: index_ops_per_s=<x> decision_p99_us=<y> bytes_per_block=<z>, where ops are\n"
               "per CPU-second and the decision p99 is the index's mode (exact unless --prefix-closed).\n",
    .opts = router_bench_opts,
};

static uint64_t mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Block b of chain c. */
static inline uint64_t chain_hash(uint64_t c, int64_t b) { return mix(c * 4096 + (uint64_t)b + 1); }

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Random 16-byte reads over n_slots slots, prefetched in runs of 16 like the index does. */
static double random_read_rate(size_t n_slots, double min_s)
{
    while (n_slots & (n_slots - 1))
        n_slots &= n_slots - 1; /* a power of two: index by mask, not division */
    uint64_t *t = calloc(n_slots, 16);
    if (!t)
        return 0;
    for (size_t i = 0; i < n_slots * 2; i += 4096 / 8)
        t[i] = i;
    volatile uint64_t sink = 0;
    uint64_t s = 1, reads = 0, acc = 0;
    double t0 = kvf_now_s(), el;
    do {
        for (int r = 0; r < 4096; r += 16) {
            size_t at[16];
            for (int k = 0; k < 16; k++) {
                at[k] = (size_t)(mix(s++) & (n_slots - 1)) * 2;
                __builtin_prefetch(&t[at[k]]);
            }
            for (int k = 0; k < 16; k++)
                acc += t[at[k]] ^ t[at[k] + 1];
        }
        reads += 4096;
        el = kvf_now_s() - t0;
    } while (el < min_s);
    sink = acc;
    (void)sink;
    free(t);
    return (double)reads / el;
}

int kvf_bench_router_main(int argc, char **argv)
{
    router_bench_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&router_bench_spec, &c, argc, argv, NULL, &err);
    if (st == KVF_HELP)
        return 0;
    if (st != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    if (c.workers < 1 || c.workers > KVF_ROUTER_MAX_WORKERS || c.blocks < 1000 ||
        c.replicas < 1 || c.replicas > 4 || c.prompt_tokens < c.block_size || c.decisions < 100) {
        fprintf(stderr, "kvfleet bench router: --workers (%d) must be 1..64, --blocks (%lld) >= 1000, "
                "--replicas (%g) 1..4, --prompt-tokens (%d) >= --block-size, --decisions (%lld) >= 100\n",
                c.workers, (long long)c.blocks, c.replicas, c.prompt_tokens, (long long)c.decisions);
        return 2;
    }
    int64_t per_prompt = c.prompt_tokens / c.block_size;
    int64_t n_chains = (c.blocks + per_prompt - 1) / per_prompt;

    kvf_router_pool_cfg pc;
    kvf_router_pool_cfg_default(&pc);
    pc.index.model = "bench";
    pc.index.block_size = c.block_size;
    pc.index.expected_blocks = c.blocks;
    pc.index.stale_after_s = 0;
    pc.index.prefix_closed = c.prefix_closed;
    kvf_router_pool *pool;
    if ((st = kvf_router_pool_create(&pc, &pool, &err)) != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 1;
    }
    for (int32_t w = 0; w < c.workers; w++)
        kvf_router_pool_worker_add(pool, w, "bench", c.block_size, true, 0, &err);
    kvf_router_index *idx = kvf_router_pool_index(pool);
    uint64_t seq[KVF_ROUTER_MAX_WORKERS] = {0};
    uint64_t *batch = malloc((size_t)per_prompt * sizeof *batch);
    if (!batch)
        return 1;

    /* 1. fill: each chain (one prompt's blocks) is stored by `replicas` workers on average */
    printf("router index: %d workers, %lld blocks as %lld chains of %lld, %.2f replicas, overlap %s\n",
           c.workers, (long long)c.blocks, (long long)n_chains, (long long)per_prompt, c.replicas,
           c.prefix_closed ? "sampled (prefix-closed)" : "exact (every block read)");
    int64_t applied = 0;
    double t0 = kvf_now_s(), c0 = cpu_s();
    for (int64_t ch = 0; ch < n_chains; ch++) {
        int64_t n = ch == n_chains - 1 ? c.blocks - ch * per_prompt : per_prompt;
        for (int64_t b = 0; b < n; b++)
            batch[b] = chain_hash((uint64_t)ch, b);
        uint64_t r = mix((uint64_t)ch ^ 0x5555);
        int reps = 1 + (int)((double)(r >> 40) / (double)(1ull << 24) < c.replicas - 1.0) +
                   (c.replicas > 2 && (r & 3) == 0);
        for (int k = 0; k < reps; k++) {
            int32_t w = (int32_t)((r >> (8 * k)) % (uint64_t)c.workers);
            kvf_router_event ev = {.kind = KVF_ROUTER_EV_STORED, .worker = w, .seq = ++seq[w],
                                   .model = "bench", .block_size = c.block_size,
                                   .hashes = batch, .n = (size_t)n};
            if (kvf_router_index_apply(idx, &ev, 0, &err) != KVF_OK) {
                fprintf(stderr, "kvfleet: %s\n", err.msg);
                return 1;
            }
            applied += n;
        }
    }
    double fill_s = kvf_now_s() - t0, fill_cpu = cpu_s() - c0;
    kvf_router_index_stats ist;
    kvf_router_index_stats_get(idx, &ist);

    /* 2. churn at steady size: one worker evicts a chain and stores a new one */
    int64_t churn = 0, next_chain = n_chains;
    t0 = kvf_now_s(), c0 = cpu_s();
    for (int64_t i = 0; i < 20000; i++) {
        int64_t victim = (int64_t)(mix((uint64_t)i + 77) % (uint64_t)n_chains);
        uint64_t bits = kvf_router_index_lookup(idx, chain_hash((uint64_t)victim, 0));
        if (!bits)
            continue;
        int32_t w = __builtin_ctzll(bits);
        for (int64_t b = 0; b < per_prompt; b++)
            batch[b] = chain_hash((uint64_t)victim, b);
        kvf_router_event ev = {.kind = KVF_ROUTER_EV_REMOVED, .worker = w, .seq = ++seq[w],
                               .model = "bench", .block_size = c.block_size, .hashes = batch,
                               .n = (size_t)per_prompt};
        kvf_router_index_apply(idx, &ev, 0, &err);
        for (int64_t b = 0; b < per_prompt; b++)
            batch[b] = chain_hash((uint64_t)next_chain, b);
        next_chain++;
        ev.kind = KVF_ROUTER_EV_STORED;
        ev.seq = ++seq[w];
        kvf_router_index_apply(idx, &ev, 0, &err);
        churn += 2 * per_prompt;
    }
    double churn_s = kvf_now_s() - t0, churn_cpu = cpu_s() - c0;

    /* 3. lookups: prefix overlap of a whole prompt for every worker at once */
    /* prompts are hashed before the clock starts: 256 of them, taken in turn */
    enum { N_PROMPTS = 256 };
    uint64_t *prompts = malloc((size_t)N_PROMPTS * (size_t)per_prompt * sizeof *prompts);
    if (!prompts)
        return 1;
    for (int i = 0, tries = 0; i < N_PROMPTS; i++) {
        uint64_t ch;
        do /* a prompt whose whole chain is indexed: every lookup goes all the way */
            ch = mix((uint64_t)tries++ + 999) % (uint64_t)n_chains;
        while (!kvf_router_index_lookup(idx, chain_hash(ch, 0)) && tries < 1000000);
        for (int64_t b = 0; b < per_prompt; b++)
            prompts[(size_t)i * (size_t)per_prompt + (size_t)b] = chain_hash(ch, b);
    }
    uint32_t ov[KVF_ROUTER_MAX_WORKERS];
    int64_t looked = 0;
    uint64_t sink = 0;
    t0 = kvf_now_s(), c0 = cpu_s();
    for (int64_t i = 0; i < 200000; i++) {
        const uint64_t *pr = prompts + (size_t)(i % N_PROMPTS) * (size_t)per_prompt;
        sink += kvf_router_index_overlap(idx, pr, (size_t)per_prompt, ~0ull, ov);
    }
    double look_s = kvf_now_s() - t0, look_cpu = cpu_s() - c0;
    kvf_router_index_stats ist2;
    kvf_router_index_stats_get(idx, &ist2);
    looked = ist2.ops - ist.ops - churn;

    /* 4. decisions: kv policy over all workers, a prompt whose prefix is indexed; first with the
     * index reading every prompt block (exact for any cache), then sampling (prefix-closed) */
    int64_t *lat = malloc((size_t)c.decisions * sizeof *lat);
    uint64_t *prompt = malloc((size_t)per_prompt * sizeof *prompt);
    if (!lat || !prompt)
        return 1;
    double p50 = 0, p99 = 0, p999 = 0, s50 = 0, s99 = 0, s999 = 0;
    for (int mode = 0; mode < 2; mode++) {
        kvf_router_index_set_prefix_closed(idx, mode == 1 || c.prefix_closed);
        for (int64_t i = 0, tries = 0; i < c.decisions; i++) {
            uint64_t ch;
            do
                ch = mix((uint64_t)tries++ * 31 + 5) % (uint64_t)n_chains;
            while (!kvf_router_index_lookup(idx, chain_hash(ch, 0)) && tries < 100 * c.decisions);
            for (int64_t b = 0; b < per_prompt; b++)
                prompt[b] = chain_hash(ch, b);
            if (i % 64 == 0) {
                for (int32_t w = 0; w < c.workers; w++) {
                    kvf_router_load l = {.queued_prefill_tokens = (int64_t)(mix((uint64_t)(i + w)) % 20000),
                                         .decode_load = (double)(mix((uint64_t)(i * w)) % 32)};
                    kvf_router_pool_load_set(pool, w, &l, 0);
                }
            }
            kvf_router_request rq = {.hashes = prompt, .n_blocks = (size_t)per_prompt,
                                     .n_tokens = c.prompt_tokens};
            kvf_router_decision d;
            int64_t s0 = kvf_now_ns();
            kvf_router_pool_pick(pool, &rq, 0, &d, &err);
            lat[i] = kvf_now_ns() - s0;
            sink += (uint64_t)d.worker;
        }
        qsort(lat, (size_t)c.decisions, sizeof *lat, cmp_i64);
        int64_t n = c.decisions;
        double *o50 = mode ? &s50 : &p50, *o99 = mode ? &s99 : &p99, *o999 = mode ? &s999 : &p999;
        *o50 = (double)lat[n / 2] / 1000.0;
        *o99 = (double)lat[n * 99 / 100] / 1000.0;
        *o999 = (double)lat[n * 999 / 1000] / 1000.0;
    }
    kvf_router_index_set_prefix_closed(idx, c.prefix_closed);
    /* the clock's own cost, which the latencies include */
    int64_t k0 = kvf_now_ns();
    for (int i = 0; i < 1000; i++)
        (void)kvf_now_ns();
    double clock_us = (double)(kvf_now_ns() - k0) / 1000.0 / 1000.0;

    /* baseline: random reads over a table as large as the index's */
    double bc0 = cpu_s();
    double base_wall = random_read_rate((size_t)(ist.bytes / 32 > 1024 ? ist.bytes / 32 : 1024), 1.0);
    double base_cpu_share = (cpu_s() - bc0) / 1.0;
    double base = base_wall / (base_cpu_share > 0.05 ? base_cpu_share : 1.0);

    /* rates per CPU second of this thread (wall-clock rates beside them) */
    double ops = (double)(applied + churn + looked);
    double ops_cpu = ops / (fill_cpu + churn_cpu + look_cpu);
    double ops_wall = ops / (fill_s + churn_s + look_s);
    printf("%-36s %12s %12s %12s\n", "measure", "per cpu-s", "per wall-s", "vs baseline");
    printf("%-36s %12.3e %12.3e %12.2f\n", "event blocks applied (fill)", applied / fill_cpu,
           applied / fill_s, applied / fill_cpu / base);
    printf("%-36s %12.3e %12.3e %12.2f\n", "event blocks applied (churn)", churn / churn_cpu,
           churn / churn_s, churn / churn_cpu / base);
    printf("%-36s %12.3e %12.3e %12.2f\n", "blocks looked up (prefix overlap)", looked / look_cpu,
           looked / look_s, looked / look_cpu / base);
    printf("%-36s %12.3e %12.3e %12.2f\n", "index ops (all of the above)", ops_cpu, ops_wall,
           ops_cpu / base);
    printf("%-36s %12.3e %12.3e %12s\n", "baseline: random 16 B reads", base, base_wall, "1.00");
    printf("%-36s %12s %12s\n", "decision latency (us, wall)", c.prefix_closed ? "sampled" : "exact",
           "sampled");
    printf("%-36s %12.2f %12.2f\n", "  p50", p50, s50);
    printf("%-36s %12.2f %12.2f\n", "  p99", p99, s99);
    printf("%-36s %12.2f %12.2f\n", "  p99.9", p999, s999);
    printf("%-36s %12.3f\n", "clock read (us, inside latencies)", clock_us);
    printf("%-36s %12lld\n", "indexed blocks", (long long)ist.n_blocks);
    printf("%-36s %12lld\n", "(block, worker) pairs", (long long)ist.n_pairs);
    printf("%-36s %12.1f\n", "index bytes / block", ist.bytes_per_block);
    printf("(this thread ran %.0f%% of wall time; checksum %llu)\n",
           100.0 * (fill_cpu + churn_cpu + look_cpu) / (fill_s + churn_s + look_s),
           (unsigned long long)(sink & 0xff));
    double la[3] = {0};
    if (getloadavg(la, 3) > 0)
        printf("(machine load average %.1f over %ld cores while measuring)\n", la[0],
               sysconf(_SC_NPROCESSORS_ONLN));
    printf("index_ops_per_s=%.3e decision_p99_us=%.2f bytes_per_block=%.1f\n", ops_cpu, p99,
           ist.bytes_per_block);
    free(prompts);
    free(lat);
    free(prompt);
    free(batch);
    kvf_router_pool_destroy(pool);
    return 0;
}
