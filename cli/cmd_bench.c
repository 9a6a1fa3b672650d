/* cmd_bench.c: `kvfleet bench <what>` runs one of the benchmarks in bench/. */
#include <stdio.h>
#include <string.h>

#include "bench/bench.h"
#include "cli/cli.h"

typedef struct kvf_cli_bench_entry {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} kvf_cli_bench_entry;

static const kvf_cli_bench_entry benches[] = {
    {"kv", kvf_bench_kv_main, "KV cache: allocate/free/lookup/insert ops/s, hashing GB/s"},
    {"engine", kvf_bench_engine_main, "prefill and decode tokens/s, decode memory bandwidth"},
    {"xfer", kvf_bench_xfer_main, "KV block transfer GB/s over UCX vs ucx_perftest"},
    {"router", kvf_bench_router_main, "index ops/s and routing-decision latency"},
    {"serve", kvf_bench_serve_main, "TTFT / ITL / throughput of fleets it starts (colocated vs disaggregated, kv vs round-robin)"},
    {"attn", kvf_bench_attn_main, "paged decode attention KV bandwidth on a GPU vs a device-to-device copy"},
    {"sample", kvf_bench_sample_main, "host sampler microseconds per draw vs argmax and a full sort of the row"},
    {"grammar", kvf_bench_grammar_main, "constrained decoding: JSON Schema compile ms, token mask us (uncached, cached) over a vocabulary"},
};

int kvf_cli_bench(int argc, char **argv)
{
    size_t n = sizeof benches / sizeof benches[0];
    if (argc < 2 || strcmp(argv[1], "--help") == 0) {
        FILE *out = argc < 2 ? stderr : stdout;
        fprintf(out, "usage: kvfleet bench <what> [flags]\n\nbenchmarks:\n");
        for (size_t i = 0; i < n; i++)
            fprintf(out, "  %-8s %s%s\n", benches[i].name, benches[i].summary,
                    benches[i].run ? "" : " (not in this build yet)");
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (strcmp(argv[1], benches[i].name) != 0)
            continue;
        if (!benches[i].run) {
            fprintf(stderr, "kvfleet bench: '%s' is not in this build yet\n", argv[1]);
            return 2;
        }
        return benches[i].run(argc - 1, argv + 1);
    }
    fprintf(stderr, "kvfleet bench: unknown benchmark '%s'\n", argv[1]);
    return 2;
}
