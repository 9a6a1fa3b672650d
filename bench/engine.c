/* engine.c: `kvfleet bench engine`: prefill and decode tokens/s of the engine at several batch
 * sizes for the gen-model presets (random weights written to a temporary directory), with one
 * backend thread and with all of them, and the memory bandwidth a decode step achieves (weight
 * bytes read per second) next to baselines measured in the same run with the same thread count:
 * a plain memory read, the BLAS library's own sgemv (decode) and sgemm (prefill). */
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/cfg.h"
#include "common/log.h"
#include "common/progress.h"
#include "common/time.h"
#include "engine/engine.h"
#include "model/cpu_kernels.h"
#include "model/model.h"
#include "model/weights.h"
#include "engine/backends.h"

typedef struct engine_bench_cfg {
    const char *presets, *batches, *dir, *weights, *device, *weight_dtype;
    int32_t prompt, decode, decode_medium, vocab, budget, threads;
    int64_t memread_bytes, seed;
    double temperature, top_p;
} engine_bench_cfg;

static const kvf_cfg_opt engine_bench_opts[] = {
    {"presets", "small,medium", "gen-model presets to run (comma-separated)", offsetof(engine_bench_cfg, presets), KVF_CFG_STR},
    {"batches", "1,8,32", "batch sizes (sequences running together), at most 64", offsetof(engine_bench_cfg, batches), KVF_CFG_STR},
    {"prompt", "64", "prompt tokens of each sequence", offsetof(engine_bench_cfg, prompt), KVF_CFG_INT},
    {"decode", "32", "decode steps timed (small and other presets)", offsetof(engine_bench_cfg, decode), KVF_CFG_INT},
    {"decode-medium", "12", "decode steps timed for the medium preset", offsetof(engine_bench_cfg, decode_medium), KVF_CFG_INT},
    {"vocab", "32000", "vocabulary of the generated models", offsetof(engine_bench_cfg, vocab), KVF_CFG_INT},
    {"budget", "2048", "token budget of one step (max_batch_tokens)", offsetof(engine_bench_cfg, budget), KVF_CFG_INT},
    {"threads", "0", "threads of the multi-threaded runs (0: one per online CPU)", offsetof(engine_bench_cfg, threads), KVF_CFG_INT},
    {"weights", "bf16", "weight dtype written to disk (f32, f16, bf16)", offsetof(engine_bench_cfg, weights), KVF_CFG_STR},
    {"weight-dtype", "f32", "cpu: matrices at load, f32 or q8 (int8 blocks of 32 and an f32 scale: weight_GB/s then counts 36/32 bytes a parameter); f32,q8 runs both, one after the other for each thread count, and prints q8's ratios to f32", offsetof(engine_bench_cfg, weight_dtype), KVF_CFG_STR},
    {"device", "cpu", "backend: cpu, or cuda (GPU 0; one run, weights kept as bf16/f16 on the device)", offsetof(engine_bench_cfg, device), KVF_CFG_STR},
    {"dir", NULL, "where to write the models (default: a new directory under $TMPDIR or /tmp, removed after)", offsetof(engine_bench_cfg, dir), KVF_CFG_STR},
    {"temperature", "0", "sampling temperature of every sequence (0: greedy); with a temperature a GPU draws on the device, the CPU on the host", offsetof(engine_bench_cfg, temperature), KVF_CFG_DOUBLE},
    {"top-p", "1", "top_p of every sequence (with --temperature)", offsetof(engine_bench_cfg, top_p), KVF_CFG_DOUBLE},
    {"seed", "1234", "seed of the random weights (gen-model --seed N --preset P --dtype f32 writes the same matrices, e.g. to convert for another engine)", offsetof(engine_bench_cfg, seed), KVF_CFG_INT64},
    {"memread-bytes", "256M", "buffer of the plain memory read baseline", offsetof(engine_bench_cfg, memread_bytes), KVF_CFG_SIZE},
    {NULL},
};

static const kvf_cfg_spec engine_bench_spec = {
    .prog = "kvfleet bench engine",
    .summary = "For each preset (random weights written once) and for 1 thread and all threads: runs\n"
               "each batch size B as B sequences of --prompt tokens and --decode new tokens through\n"
               "the engine (prefix cache off, f32 KV), timing the prefill steps and the decode steps\n"
               "apart. Decode bandwidth = weight bytes read per step (f32 compute form, or q8's 36 bytes\n"
               "a block of 32; embedding rows not counted) x steps / time, next to a plain sequential\n"
               "read of --memread-bytes. --weight-dtype f32,q8 runs both and prints q8 over f32.\n"
               "cpu_util: process CPU time / wall time while decoding (100% a thread; lower means\n"
               "the machine was busy with something else). engine%: share of the decode steps' time\n"
               "spent in the engine itself (scheduling, block allocation, sampling), not the forward pass.\n"
               "Baselines, per thread count, in the same run: a plain read of --memread-bytes split\n"
               "over the threads (vs_read), OpenBLAS's own threaded sgemv over a 48 MiB matrix\n"
               "(vs_gemv: decode weight bytes/s over its bytes/s) and sgemm of 64x2048x768\n"
               "(pf_vs_gemm: prefill FLOP/s, 2 x parameters x tokens, over its FLOP/s).\n"
               "Ends with: decode_b32_over_b1=<x> (the aim is at least 8).",
    .opts = engine_bench_opts,
};

#define MAX_BATCHES 8
#define MAX_BATCH 64

typedef struct run_result {
    double prefill_tps, decode_tps, step_ms, weight_bps;
    double prefill_flops; /* 2 x matmul parameters x prompt tokens per second */
    double decode_cpu; /* process CPU seconds per wall second while decoding */
    double overhead;   /* share of decode step time spent outside the forward pass */
} run_result;

/* CPU time of the whole process (all threads), in seconds. */
static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Parses "1,8,32" into out; returns how many, or -1. */
static int parse_list(const char *s, int32_t *out, int cap)
{
    int n = 0;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > MAX_BATCH || n == cap)
            return -1;
        out[n++] = (int32_t)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return -1;
    }
    return n;
}

/* Weight bytes a decode step reads in the backend's form (4 bytes a parameter for the CPU
 * backend's f32, 2 for the GPU's bf16/f16 matrices): every layer, the final norm and the LM
 * head; of the embedding only B rows (not counted). */
static double decode_weight_bytes(const kvf_model_config *c, double bytes_per_param)
{
    double p = (double)kvf_model_config_n_params(c);
    if (!c->tie_embeddings)
        p -= (double)c->vocab_size * c->dim; /* the separate embedding table */
    return bytes_per_param * p;
}

static kvf_status write_model(const char *dir, const char *preset, const engine_bench_cfg *bc,
                              kvf_err *err)
{
    kvf_model_config mc;
    kvf_status st = kvf_model_preset(preset, bc->vocab, &mc, err);
    if (st != KVF_OK)
        return st;
    int dt = kvf_dtype_parse(bc->weights);
    if (dt != KVF_DTYPE_F32 && dt != KVF_DTYPE_F16 && dt != KVF_DTYPE_BF16)
        return kvf_err_set(err, KVF_ERR_INVALID, "bench engine: --weights=%s is not allowed (f32, "
                           "f16 or bf16)", bc->weights);
    if (mkdir(dir, 0755) != 0)
        return kvf_err_set(err, KVF_ERR_IO, "bench engine: cannot create %s", dir);
    char path[1200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if ((st = kvf_model_config_write(path, &mc, (kvf_dtype)dt, err)) != KVF_OK)
        return st;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    return kvf_model_weights_write_random(path, &mc, (kvf_dtype)dt, (uint64_t)bc->seed, err);
}

static void remove_model(const char *dir)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

/* One batch: B sequences of P prompt tokens and D + 1 new tokens; the step that samples the
 * last first token ends the prefill phase, the following D steps are the decode phase. */
static kvf_status run_batch(const engine_bench_cfg *c, kvf_engine *e, const kvf_model *m,
                            int32_t B, int32_t P, int32_t D, uint64_t *rng, kvf_progress *pr, int64_t *done, double bytes_per_param,
                            run_result *out, kvf_err *err)
{
    static int32_t prompt[MAX_BATCH][4096];
    static uint64_t next_id;
    for (int32_t b = 0; b < B; b++) {
        for (int32_t i = 0; i < P; i++) {
            *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
            prompt[b][i] = (int32_t)((*rng >> 33) % (uint64_t)m->cfg.vocab_size);
        }
        kvf_engine_request q = {.id = next_id++, .prompt = prompt[b], .n_prompt = P};
        kvf_engine_sampling_default(&q.sampling);
        q.sampling.max_tokens = D + 1;
        q.sampling.temperature = (float)c->temperature;
        q.sampling.top_p = (float)c->top_p;
        q.sampling.seed = q.id;
        kvf_status st = kvf_engine_add(e, &q, err);
        if (st != KVF_OK)
            return st;
    }
    /* Steps until every sequence has its first token are the prefill phase; after it, only
     * steps in which all B sequences decode count (the tail where some finished does not). */
    int32_t firsts = 0, decode_steps = 0;
    int64_t decode_tokens = 0;
    double t_prefill = 0, t_decode = 0, c_decode = 0;
    int64_t step_ns = 0, fwd_ns = 0;
    while (kvf_engine_busy(e)) {
        const kvf_engine_output *o;
        int32_t n;
        bool prefill = firsts < B;
        kvf_engine_stats s0, s1;
        kvf_engine_get_stats(e, &s0);
        double t0 = kvf_now_s(), c0 = cpu_s();
        kvf_status st = kvf_engine_step(e, &o, &n, err);
        double dt = kvf_now_s() - t0, dc = cpu_s() - c0;
        if (st != KVF_OK)
            return st;
        if (prefill) {
            t_prefill += dt;
            for (int32_t i = 0; i < n; i++)
                firsts += o[i].n_generated == 1;
        } else if (n == B) {
            kvf_engine_get_stats(e, &s1);
            t_decode += dt;
            c_decode += dc;
            step_ns += s1.step_ns - s0.step_ns;
            fwd_ns += s1.forward_ns - s0.forward_ns;
            decode_steps++;
            decode_tokens += n;
        }
        kvf_progress_update(pr, ++*done);
    }
    out->prefill_tps = t_prefill > 0 ? (double)B * P / t_prefill : 0;
    out->prefill_flops = out->prefill_tps * 2.0 * decode_weight_bytes(&m->cfg, 1.0);
    out->decode_tps = t_decode > 0 ? (double)decode_tokens / t_decode : 0;
    out->step_ms = decode_steps ? 1e3 * t_decode / decode_steps : 0;
    out->decode_cpu = t_decode > 0 ? c_decode / t_decode : 0;
    out->overhead = step_ns > 0 ? (double)(step_ns - fwd_ns) / (double)step_ns : 0;
    out->weight_bps = t_decode > 0 ? decode_weight_bytes(&m->cfg, bytes_per_param) * decode_steps / t_decode : 0;
    return KVF_OK;
}

/* The plain read baseline with n threads, each reading its own slice of buf at once. */
typedef struct memread_arg {
    const uint8_t *buf;
    size_t n;
    double bps;
} memread_arg;

static void *memread_thread(void *p)
{
    memread_arg *a = p;
    a->bps = kvf_bench_memread_bps(a->buf, a->n, 1.0);
    return NULL;
}

static double memread_threads_bps(const void *buf, size_t n, int32_t threads)
{
    memread_arg args[64];
    pthread_t th[64];
    if (threads > 64)
        threads = 64;
    size_t per = n / (size_t)threads / 64 * 64;
    bool started[64] = {false};
    for (int32_t i = 0; i < threads; i++) {
        args[i] = (memread_arg){.buf = (const uint8_t *)buf + (size_t)i * per, .n = per};
        if (i > 0)
            started[i] = pthread_create(&th[i], NULL, memread_thread, &args[i]) == 0;
    }
    memread_thread(&args[0]);
    double sum = args[0].bps;
    for (int32_t i = 1; i < threads; i++)
        if (started[i]) {
            pthread_join(th[i], NULL);
            sum += args[i].bps;
        }
    return sum;
}

int kvf_bench_engine_main(int argc, char **argv)
{
    engine_bench_cfg bc = {0};
    kvf_err err = {0};
    int n_pos = 0;
    kvf_status st = kvf_cfg_parse(&engine_bench_spec, &bc, argc, argv, &n_pos, &err);
    if (st == KVF_HELP)
        return 0;
    if (st != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    int32_t batches[MAX_BATCHES];
    int n_batches = parse_list(bc.batches, batches, MAX_BATCHES);
    if (n_batches <= 0 || bc.prompt < 1 || bc.prompt > 4000 || bc.decode < 1 || bc.decode_medium < 1) {
        fprintf(stderr, "kvfleet: bench engine: --batches=%s --prompt=%d --decode=%d "
                "--decode-medium=%d: batches are 1 to %d (up to %d of them), prompt 1 to 4000, "
                "decode at least 1\n", bc.batches, bc.prompt, bc.decode, bc.decode_medium,
                MAX_BATCH, MAX_BATCHES);
        return 2;
    }
    if (!(bc.temperature >= 0) || !(bc.top_p > 0 && bc.top_p <= 1)) {
        fprintf(stderr, "kvfleet: bench engine: --temperature=%g --top-p=%g: temperature >= 0 "
                "(0: greedy), top_p greater than 0 and at most 1\n", bc.temperature, bc.top_p);
        return 2;
    }
    const kvf_backend *be = NULL;
    if ((st = kvf_engine_backend_by_name(bc.device, "bench engine", &be, &err)) != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    bool gpu = be != kvf_model_backend_cpu();
    /* --weight-dtype: one dtype, or a list run one after the other (ratios to the first) */
    int32_t wdts[KVF_BACKEND_WEIGHT_COUNT];
    int n_wdt = 0;
    {
        char wlist[64];
        snprintf(wlist, sizeof wlist, "%s", bc.weight_dtype ? bc.weight_dtype : "");
        char *wsave = NULL;
        for (char *w = strtok_r(wlist, ",", &wsave); w; w = strtok_r(NULL, ",", &wsave)) {
            int k = kvf_backend_weight_dtype_parse(w);
            if (k < 0 || n_wdt == KVF_BACKEND_WEIGHT_COUNT) {
                fprintf(stderr, "kvfleet: bench engine: --weight-dtype=%s is not supported (use f32, q8 "
                        "or f32,q8)\n", bc.weight_dtype ? bc.weight_dtype : "");
                return 2;
            }
            wdts[n_wdt++] = k;
        }
        if (n_wdt == 0) {
            fprintf(stderr, "kvfleet: bench engine: --weight-dtype is empty (use f32, q8 or f32,q8)\n");
            return 2;
        }
    }
    int32_t max_b = 1;
    for (int i = 0; i < n_batches; i++)
        max_b = batches[i] > max_b ? batches[i] : max_b;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int32_t multi = bc.threads > 0 ? bc.threads : (int32_t)(online > 0 ? online : 1);
    int32_t thread_runs[2] = {1, multi};
    int n_thread_runs = multi > 1 && !gpu ? 2 : 1; /* a GPU run does not depend on CPU threads */

    /* the plain read baseline, before anything else competes for memory */
    size_t mr_bytes = (size_t)bc.memread_bytes;
    void *mr = malloc(mr_bytes);
    if (!mr) {
        fprintf(stderr, "kvfleet: bench engine: cannot allocate %zu bytes for the read baseline\n", mr_bytes);
        return 1;
    }
    memset(mr, 1, mr_bytes);
    double read_bps[2] = {0}, memread_bps;
    kvf_cpu_blas_rates blas[2] = {0};
    for (int t = 0; t < n_thread_runs; t++) {
        read_bps[t] = memread_threads_bps(mr, mr_bytes, thread_runs[t]);
        if (!gpu && (st = kvf_cpu_blas_measure(thread_runs[t], 1.0, &blas[t], &err)) != KVF_OK) {
            fprintf(stderr, "kvfleet: bench engine: %s\n", err.msg);
            free(mr);
            return 1;
        }
    }
    memread_bps = read_bps[0];
    free(mr);

    char presets[256];
    snprintf(presets, sizeof presets, "%s", bc.presets);
    const char *tmp = bc.dir ? bc.dir : getenv("TMPDIR");
    char base[1000];
    if (!tmp || !*tmp)
        tmp = "/tmp";
    if (strlen(tmp) > 900) {
        fprintf(stderr, "kvfleet: bench engine: --dir is %zu characters (at most 900)\n", strlen(tmp));
        return 2;
    }
    snprintf(base, sizeof base, "%s/kvfleet-bench-engine-XXXXXX", tmp);
    if (!mkdtemp(base)) {
        fprintf(stderr, "kvfleet: bench engine: cannot create a directory like %s\n", base);
        return 1;
    }

    char how[64] = "greedy";
    if (bc.temperature > 0)
        snprintf(how, sizeof how, "temperature %g top_p %g", bc.temperature, bc.top_p);
    printf("kvfleet bench engine: device %s, prompt %d tokens, budget %d tokens/step, f32 KV, "
           "%s, prefix cache off, %ld online CPUs\n", kvf_backend_name(be), bc.prompt, bc.budget, how, online);
    if (gpu)
        printf("(cuda: weight_GB/s counts 2 bytes a parameter; vs_read and cpu_util still compare with the host)\n");
    if (!gpu) {
        char feat[128], better[32];
        const char *core;
        kvf_cpu_features_str(feat, sizeof feat);
        kvf_cpu_blas_core(&core, better, sizeof better);
        printf("cpu: %s; OpenBLAS core %s%s%s; kvfleet kernels %s\n", feat, core,
               better[0] ? ", slower than this CPU's " : "", better,
               kvf_cpu_kernels_get(kvf_cpu_isa_best())->name);
    }
    for (int t = 0; t < n_thread_runs; t++) {
        printf("baselines, %d thread%s: plain memory read (%zu MiB) %.2f GB/s", thread_runs[t],
               thread_runs[t] > 1 ? "s" : "", mr_bytes >> 20, read_bps[t] / 1e9);
        if (!gpu)
            printf("; OpenBLAS sgemv %.2f GB/s, sgemm %.1f GFLOP/s; kvfleet sgemv %.2f GB/s (%.2fx OpenBLAS)",
                   blas[t].sgemv_gbps, blas[t].sgemm_gflops, blas[t].own_sgemv_gbps,
                   blas[t].own_sgemv_gbps / blas[t].sgemv_gbps);
        printf("\n");
    }
    printf("\n%-7s %7s %7s %5s %14s %13s %10s %12s %9s %9s %10s %9s %9s\n", "preset", "weights", "threads", "batch",
           "prefill_tok/s", "decode_tok/s", "step_ms", "weight_GB/s", "vs_read", "vs_gemv",
           "pf_vs_gemm", "cpu_util", "engine%");
    int rc = 0;
    double ratio_32 = -1, ratio_worst = 1e30;
    char *save = NULL;
    for (char *preset = strtok_r(presets, ",", &save); preset; preset = strtok_r(NULL, ",", &save)) {
        char dir[1100];
        if (strlen(preset) > 32) {
            fprintf(stderr, "kvfleet: bench engine: preset \"%.32s...\" is not known (use small or medium)\n", preset);
            rc = 2;
            break;
        }
        snprintf(dir, sizeof dir, "%s/%s", base, preset);
        double tw = kvf_now_s();
        if ((st = write_model(dir, preset, &bc, &err)) != KVF_OK) {
            fprintf(stderr, "kvfleet: bench engine: %s\n", err.msg);
            rc = 1;
            remove_model(dir);
            break;
        }
        kvf_model *m = NULL;
        if ((st = kvf_model_load(dir, &m, &err)) != KVF_OK) {
            fprintf(stderr, "kvfleet: bench engine: %s\n", err.msg);
            rc = 1;
            remove_model(dir);
            break;
        }
        kvf_log(KVF_LOG_INFO, "bench: %s: %.1fM parameters written and loaded in %.1f s", preset,
                kvf_model_config_n_params(&m->cfg) / 1e6, kvf_now_s() - tw);
        int32_t D = strcmp(preset, "medium") == 0 ? bc.decode_medium : bc.decode;
        for (int t = 0; t < n_thread_runs && rc == 0; t++) {
            run_result res_w[KVF_BACKEND_WEIGHT_COUNT][MAX_BATCHES];
            for (int wi = 0; wi < n_wdt && rc == 0; wi++) {
                /* bytes a parameter: bf16/f16 on a GPU; q8 is 32 int8 and a 4-byte scale a block */
                double bytes_per_param = gpu ? 2.0 : wdts[wi] == KVF_BACKEND_WEIGHT_Q8 ? 36.0 / 32.0 : 4.0;
                kvf_engine_cfg ec;
                kvf_engine_cfg_default(&ec);
                ec.max_batch_tokens = bc.budget;
                ec.max_seqs = max_b < bc.budget ? max_b : bc.budget;
                ec.max_queued = max_b;
                ec.max_ctx = bc.prompt + D + 2 < m->cfg.max_pos ? bc.prompt + D + 2 : m->cfg.max_pos;
                ec.n_blocks = (int32_t)(max_b * kvf_kv_blocks_for(ec.max_ctx, ec.block_size) + 8);
                ec.swap_slots = 0;
                ec.prefix_cache = false;
                ec.threads = thread_runs[t];
                ec.weight_dtype = wdts[wi];
                kvf_engine *e = NULL;
                if ((st = kvf_engine_create(m, be, &ec, &e, &err)) != KVF_OK) {
                    fprintf(stderr, "kvfleet: bench engine: %s\n", err.msg);
                    rc = 1;
                    break;
                }
                int64_t total = 0, done = 0;
                for (int i = 0; i < n_batches; i++)
                    total += (int64_t)kvf_kv_blocks_for((int64_t)batches[i] * bc.prompt, bc.budget) + D + 1;
                total += (int64_t)kvf_kv_blocks_for(bc.prompt, bc.budget) + 2; /* the warm-up */
                char label[64];
                snprintf(label, sizeof label, "engine %s %s, %d thread%s", preset,
                         kvf_backend_weight_dtype_name(wdts[wi]), thread_runs[t], thread_runs[t] > 1 ? "s" : "");
                kvf_progress pr;
                kvf_progress_init(&pr, label, total);
                run_result *res = res_w[wi];
                uint64_t rng = 99;
                /* one untimed sequence first (as llama-bench warms up): the first pass over the
                 * weights pays their page faults and the step buffers' first touch */
                run_result warm;
                if ((st = run_batch(&bc, e, m, 1, bc.prompt, 1, &rng, &pr, &done, bytes_per_param, &warm, &err)) != KVF_OK) {
                    fprintf(stderr, "kvfleet: bench engine: %s\n", err.msg);
                    rc = 1;
                }
                for (int i = 0; i < n_batches && rc == 0; i++) {
                    if ((st = run_batch(&bc, e, m, batches[i], bc.prompt, D, &rng, &pr, &done, bytes_per_param, &res[i], &err)) != KVF_OK) {
                        fprintf(stderr, "kvfleet: bench engine: %s\n", err.msg);
                        rc = 1;
                    }
                }
                kvf_progress_finish(&pr);
                kvf_engine_destroy(e);
                if (rc)
                    break;
                double b1 = 0;
                for (int i = 0; i < n_batches; i++) {
                    double gemv = blas[t].sgemv_gbps * 1e9, gemm = blas[t].sgemm_gflops * 1e9;
                    printf("%-7s %7s %7d %5d %14.0f %13.1f %10.2f %12.2f %8.2fx %8.2fx %9.2fx %8.0f%% %8.2f%%\n",
                           preset, kvf_backend_weight_dtype_name(wdts[wi]), thread_runs[t], batches[i],
                           res[i].prefill_tps, res[i].decode_tps,
                           res[i].step_ms, res[i].weight_bps / 1e9, res[i].weight_bps / read_bps[t],
                           gemv > 0 ? res[i].weight_bps / gemv : 0, gemm > 0 ? res[i].prefill_flops / gemm : 0,
                           100 * res[i].decode_cpu, 100 * res[i].overhead);
                    if (batches[i] == 1)
                        b1 = res[i].decode_tps;
                }
                for (int i = 0; i < n_batches && b1 > 0; i++) {
                    if (batches[i] != 32)
                        continue;
                    double r = res[i].decode_tps / b1;
                    printf("%-7s %7s %7d  decode tokens/s at batch 32 / batch 1: %.1fx (aim: at least 8x)\n",
                           preset, kvf_backend_weight_dtype_name(wdts[wi]), thread_runs[t], r);
                    ratio_worst = r < ratio_worst ? r : ratio_worst;
                    ratio_32 = ratio_worst;
                }
                fflush(stdout);
            }
            /* the later dtypes against the first, measured one after the other in this run */
            for (int wi = 1; wi < n_wdt && rc == 0; wi++)
                for (int i = 0; i < n_batches; i++)
                    printf("%-7s %7s %7d %5d  %s over %s: prefill %.2fx, decode %.2fx\n", preset,
                           kvf_backend_weight_dtype_name(wdts[wi]), thread_runs[t], batches[i],
                           kvf_backend_weight_dtype_name(wdts[wi]), kvf_backend_weight_dtype_name(wdts[0]),
                           res_w[wi][i].prefill_tps / res_w[0][i].prefill_tps,
                           res_w[wi][i].decode_tps / res_w[0][i].decode_tps);
            fflush(stdout);
        }
        kvf_model_destroy(m);
        remove_model(dir);
        if (rc)
            break;
    }
    rmdir(base);
    if (rc == 0) {
        if (ratio_32 >= 0)
            printf("\ndecode_b32_over_b1=%.1f (the lowest over presets and thread counts) "
                   "memread_GBps=%.2f\n", ratio_32, memread_bps / 1e9);
        else
            printf("\nmemread_GBps=%.2f (batch 1 and 32 not both run: no ratio)\n", memread_bps / 1e9);
    }
    return rc;
}
