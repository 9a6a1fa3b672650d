/* attn.c: `kvfleet bench attn`: paged decode attention on a GPU (cuda/attn.cu) for a grid of
 * batch sizes and context lengths, as achieved KV bandwidth (K+V bytes read per second) beside
 * a device-to-device copy measured in the same run; with --chunk N, prefill chunks of N tokens
 * per sequence on the tile kernel beside the same call with every token on the partition kernel
 * (the path chunks took before tiles). Needs a CUDA build and a GPU; says so and
 * exits non-zero otherwise. Device work goes through cuda/attn_bench.h (no CUDA headers here). */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "common/cfg.h"
#include "common/dtype.h"
#include "kv/layout.h"
#include "model/backend.h" /* the decode kernel names */
#ifdef KVF_HAVE_CUDA
#include "cuda/attn.h"
#include "cuda/attn_bench.h"
#include "cuda/cuda.h"
#endif

typedef struct attn_bench_cfg {
    bool quick, l2_flush;
    int32_t heads, kv_heads, head_dim, block_size, max_iters, chunk, decode_seqs;
    const char *dtype, *batches, *contexts, *decode_kernel;
    int64_t max_kv, copy_max, flush_bytes;
    double seconds;
} attn_bench_cfg;

static const kvf_cfg_opt attn_bench_opts[] = {
    {"quick", "false", "a 3 x 3 grid (batch 1, 16, 64 x context 1k, 4k, 16k) instead of the full one", offsetof(attn_bench_cfg, quick), KVF_CFG_BOOL},
    {"batches", NULL, "batch sizes (comma-separated); default 1,2,4,...,256 (quick: 1,16,64)", offsetof(attn_bench_cfg, batches), KVF_CFG_STR},
    {"contexts", NULL, "context lengths (comma-separated); default 512,1024,...,32768 (quick: 1024,4096,16384)", offsetof(attn_bench_cfg, contexts), KVF_CFG_STR},
    {"chunk", "0", "prefill chunks: N query tokens per sequence at the end of its context, timed on the tile kernel and on the partition kernel (0: one decode token per sequence)", offsetof(attn_bench_cfg, chunk), KVF_CFG_INT},
    {"decode-seqs", "0", "with --chunk: this many more sequences, one decode token each at the same context, in the same call (a decode worker's step while it prefills a prompt itself)", offsetof(attn_bench_cfg, decode_seqs), KVF_CFG_INT},
    {"decode-kernel", "simt,mma", "decode kernels to time, each on every case (comma-separated: auto, simt, mma; mma falls back to simt where it does not serve the shape)", offsetof(attn_bench_cfg, decode_kernel), KVF_CFG_STR},
    {"heads", "32", "query heads (Llama-3-8B: 32)", offsetof(attn_bench_cfg, heads), KVF_CFG_INT},
    {"kv-heads", "8", "KV heads (Llama-3-8B: 8)", offsetof(attn_bench_cfg, kv_heads), KVF_CFG_INT},
    {"head-dim", "128", "head dimension (16, 32, 48, 64, 80, 96, 128, 256)", offsetof(attn_bench_cfg, head_dim), KVF_CFG_INT},
    {"block-size", "16", "tokens per KV block", offsetof(attn_bench_cfg, block_size), KVF_CFG_INT},
    {"dtype", "bf16", "KV dtype (f32, f16, bf16, fp8-e4m3)", offsetof(attn_bench_cfg, dtype), KVF_CFG_STR},
    {"max-kv", "24G", "skip cases whose KV (one layer) is larger than this", offsetof(attn_bench_cfg, max_kv), KVF_CFG_SIZE},
    {"copy-max", "2G", "largest device-to-device copy of the baseline (larger cases copy this much)", offsetof(attn_bench_cfg, copy_max), KVF_CFG_SIZE},
    {"l2-flush", "true", "overwrite a buffer before every timed call so it starts with a cold L2 cache", offsetof(attn_bench_cfg, l2_flush), KVF_CFG_BOOL},
    {"flush-bytes", "256M", "size of that buffer (several times the L2 cache)", offsetof(attn_bench_cfg, flush_bytes), KVF_CFG_SIZE},
    {"seconds", "0.1", "GPU time to aim for per case and per side (attention, copy)", offsetof(attn_bench_cfg, seconds), KVF_CFG_DOUBLE},
    {"max-iters", "200", "most timed calls per case and side", offsetof(attn_bench_cfg, max_iters), KVF_CFG_INT},
    {NULL},
};

static const kvf_cfg_spec attn_bench_spec = {
    .prog = "kvfleet bench attn",
    .summary = "Paged decode attention on the GPU (one query token per sequence, every sequence at\n"
               "the given context, blocks scattered over the pool) for each batch x context:\n"
               "achieved KV bandwidth = K+V bytes read / kernel time (CUDA events), beside a\n"
               "cudaMemcpy device-to-device copy of the same bytes (up to --copy-max) whose\n"
               "bandwidth counts bytes read + written. Ends with\n"
               "ratio_vs_d2d_copy_min_ctx4k_<kernel>=<min attention/copy ratio over contexts\n"
               ">= 4096> for each --decode-kernel, and ratio_vs_d2d_copy_min_ctx4k=<the best\n"
               "kernel's>. With --chunk N (prefill): N tokens per sequence, each call timed\n"
               "with prefill chunks on the tile kernel (decode tokens on each --decode-kernel)\n"
               "and with every token on the SIMT partition kernel; ends with\n"
               "speedup_tiled_vs_per_token_min=<min over cases, the best kernel's>.\n"
               "Needs a CUDA build and a GPU.",
    .opts = attn_bench_opts,
};

#define ATTN_BENCH_MAX_LIST 32
#define ATTN_BENCH_MAX_KERNELS 3

/* "1,2,4" -> values; 0 and a message on a bad list. */
static int attn_parse_list(const char *s, const char *flag, int32_t *out, kvf_err *err)
{
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > (1L << 24) || n == ATTN_BENCH_MAX_LIST ||
            (*end && *end != ',')) {
            kvf_err_set(err, KVF_ERR_INVALID,
                        "bench attn: --%s=%s is not a comma-separated list of at most %d "
                        "positive integers (e.g. 1,16,64)",
                        flag, s, ATTN_BENCH_MAX_LIST);
            return 0;
        }
        out[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (n == 0)
        kvf_err_set(err, KVF_ERR_INVALID, "bench attn: --%s is empty", flag);
    return n;
}

/* The kernels of one run: --decode-kernel parsed. */
typedef struct attn_kernels {
    int n;
    int32_t k[ATTN_BENCH_MAX_KERNELS]; /* KVF_BACKEND_ATTN_DECODE_* */
} attn_kernels;

/* "simt,mma" -> kernels (no repeats); 0 and a message on a bad list. */
static int attn_parse_kernels(const char *s, attn_kernels *out, kvf_err *err)
{
    out->n = 0;
    const char *p = s;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        int k = kvf_backend_attn_decode_parse(p, len);
        bool repeat = false;
        for (int j = 0; j < out->n; j++)
            repeat = repeat || out->k[j] == k;
        if (k < 0 || repeat || out->n == ATTN_BENCH_MAX_KERNELS) {
            kvf_err_set(err, KVF_ERR_INVALID,
                        "bench attn: --decode-kernel=%s is not a comma-separated list of "
                        "distinct kernels from auto, simt, mma (e.g. simt,mma)",
                        s);
            return 0;
        }
        out->k[out->n++] = k;
        p = end ? end + 1 : p + len;
    }
    if (out->n == 0)
        kvf_err_set(err, KVF_ERR_INVALID, "bench attn: --decode-kernel is empty");
    return out->n;
}

#ifdef KVF_HAVE_CUDA

typedef struct attn_row {
    int32_t batch, ctx;
    double kv_bytes, copy_bytes, copy_ms;
    double read_ms; /* the bare read of copy_bytes (kvf_cuda_bench_read_ms) */
    double attn_ms[ATTN_BENCH_MAX_KERNELS]; /* per --decode-kernel */
    double untiled_ms; /* --chunk: the same call with every token on the partition kernel */
    bool skipped;
} attn_row;


/* The min over cases of each kernel's value (per case: f(row, kernel index); `keep` picks the
 * cases), printed as <name>_<kernel>=, then <name>=<the largest of those> (<its kernel>); n/a
 * where no case counted. */
static void attn_print_mins(const char *name, const attn_kernels *ks, const attn_row *rows,
                            int n_cases, double (*f)(const attn_row *, int, const void *),
                            bool (*keep)(const attn_row *), const void *ctx)
{
    double best = -1;
    int best_k = -1;
    for (int j = 0; j < ks->n; j++) {
        double m = -1;
        for (int i = 0; i < n_cases; i++) {
            if (rows[i].skipped || !keep(&rows[i]))
                continue;
            double v = f(&rows[i], j, ctx);
            if (m < 0 || v < m)
                m = v;
        }
        if (m < 0) {
            printf("%s_%s=n/a (no case measured)\n", name, kvf_backend_attn_decode_name(ks->k[j]));
            continue;
        }
        printf("%s_%s=%.3f\n", name, kvf_backend_attn_decode_name(ks->k[j]), m);
        if (m > best)
            best = m, best_k = j;
    }
    if (best_k < 0) {
        printf("%s=n/a (no case measured)\n", name);
        return;
    }
    printf("%s=%.3f (%s)\n", name, best, kvf_backend_attn_decode_name(ks->k[best_k]));
}

/* The three column headers of each kernel, pre[i] + name + suf[i] right-aligned in w[i], then
 * the end of the line. */
static void attn_kernel_heads(const attn_kernels *ks, const char *const pre[3],
                              const char *const suf[3], const int w[3])
{
    for (int j = 0; j < ks->n; j++)
        for (int i = 0; i < 3; i++) {
            char h[40];
            snprintf(h, sizeof h, "%s%s%s", pre[i], kvf_backend_attn_decode_name(ks->k[j]),
                     suf[i]);
            printf(" %*s", w[i], h);
        }
    printf("\n");
}

static bool attn_keep_all(const attn_row *r)
{
    (void)r;
    return true;
}

static bool attn_keep_4k(const attn_row *r)
{
    return r->ctx >= 4096;
}

/* bytes per second: decode kernel j (K+V read), the copy (read + written), the bare read */
static double attn_bw(const attn_row *r, int j) { return r->kv_bytes / (r->attn_ms[j] * 1e-3); }
static double attn_copy_bw(const attn_row *r) { return 2 * r->copy_bytes / (r->copy_ms * 1e-3); }
static double attn_read_bw(const attn_row *r) { return r->copy_bytes / (r->read_ms * 1e-3); }

/* attention bandwidth / copy bandwidth */
static double attn_ratio(const attn_row *r, int j, const void *ctx)
{
    (void)ctx;
    return attn_bw(r, j) / attn_copy_bw(r);
}

/* the bare read's bandwidth / copy bandwidth: the most a single kernel reading the KV gets */
static double attn_read_ratio(const attn_row *r) { return attn_read_bw(r) / attn_copy_bw(r); }

/* attention bandwidth / the bare read's bandwidth */
static double attn_vs_read(const attn_row *r, int j, const void *ctx)
{
    (void)ctx;
    return attn_bw(r, j) / attn_read_bw(r);
}

static double attn_speedup(const attn_row *r, int j, const void *ctx)
{
    (void)ctx;
    return r->untiled_ms / r->attn_ms[j];
}

static int32_t attn_iters(const attn_bench_cfg *c, double est_ms)
{
    double n = c->seconds * 1e3 / (est_ms > 1e-3 ? est_ms : 1e-3);
    if (n < 3)
        n = 3;
    if (n > c->max_iters)
        n = c->max_iters;
    return (int32_t)n;
}

/* xorshift32 for the block permutation */
static uint32_t attn_rng(uint32_t *s)
{
    uint32_t x = *s;
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    return *s = x;
}

/* --chunk: the prefill table (tiled vs every token on the partition kernel). */
static void attn_prefill_table(const attn_bench_cfg *c, const kvf_kv_layout *l,
                               const attn_kernels *ks, const attn_row *rows, int n_cases)
{
    printf("shape: %d query heads, %d KV heads x %d, %s KV, block %d; a prefill chunk of %d "
           "tokens per sequence at the end of its context, plus %d decode sequences; L2 %s "
           "before every call\n",
           c->heads, l->n_kv_heads, l->head_dim, kvf_dtype_name(l->dtype), l->block_size,
           c->chunk, c->decode_seqs, c->l2_flush ? "flushed" : "not flushed");
    printf("tiled_<kernel>_us: chunks on the tile kernel, decode tokens on that decode kernel; "
           "per_token_us: every token on the SIMT partition kernel (each reads its own K/V); "
           "speedup = per_token / tiled; TFLOP/s counts 4 * head_dim flops per visible (query "
           "head, position) pair of the tiled call\n\n");
    printf("%7s %7s %7s %12s", "batch", "ctx", "tokens", "per_token_us");
    attn_kernel_heads(ks, (const char *[3]){"tiled_", "speedup_", "TFLOP/s_"},
                      (const char *[3]){"_us", "", ""}, (const int[3]){14, 12, 12});
    for (int k = 0; k < n_cases; k++) {
        const attn_row *r = &rows[k];
        printf("%7d %7d %7d", r->batch, r->ctx, r->batch * c->chunk + c->decode_seqs);
        if (r->skipped) {
            printf(" %12s\n", "skipped");
            continue;
        }
        /* visible pairs: each of the chunk's tokens sees ctx - chunk + 1 .. ctx positions, a
         * decode token ctx */
        double pairs = (double)r->batch * c->heads *
                           ((double)c->chunk * (r->ctx - c->chunk) + c->chunk * (c->chunk + 1) / 2.0) +
                       (double)c->decode_seqs * c->heads * r->ctx;
        printf(" %12.1f", r->untiled_ms * 1e3);
        for (int j = 0; j < ks->n; j++)
            printf(" %14.1f %12.2f %12.2f", r->attn_ms[j] * 1e3, r->untiled_ms / r->attn_ms[j],
                   4.0 * l->head_dim * pairs / (r->attn_ms[j] * 1e-3) / 1e12);
        printf("\n");
    }
    printf("\n");
    attn_print_mins("speedup_tiled_vs_per_token_min", ks, rows, n_cases, attn_speedup,
                    attn_keep_all, NULL);
}

static int attn_bench_run(const attn_bench_cfg *c, const kvf_kv_layout *l,
                          const attn_kernels *ks, const int32_t *batches, int nb,
                          const int32_t *ctxs, int nc)
{
    kvf_err err = {0};
    kvf_status st = KVF_OK;
    int rc = 1;
    const double tok_bytes = (double)kvf_kv_bytes_per_token(l); /* one layer: K + V */
    const int32_t tps = c->chunk > 0 ? c->chunk : 1; /* query tokens per sequence */
    const int32_t extra = c->decode_seqs; /* decode sequences beside chunks (only with --chunk) */
    char dev_name[256];
    size_t dev_free = 0, dev_total = 0;
    if (kvf_cuda_bench_device(dev_name, sizeof dev_name, &dev_free, &dev_total, &err) != KVF_OK) {
        fprintf(stderr, "kvfleet bench attn: %s\n", err.msg);
        return 1;
    }

    /* sizes: the largest case within --max-kv sets the pool, tables and workspace */
    int32_t max_batch = 0, max_ctx = 0;
    int64_t pool_blocks = 0;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < nc; j++) {
            if ((double)(batches[i] + extra) * ctxs[j] * tok_bytes > (double)c->max_kv)
                continue;
            int64_t blocks =
                (int64_t)(batches[i] + extra) * kvf_kv_blocks_for(ctxs[j], l->block_size);
            if (blocks > pool_blocks)
                pool_blocks = blocks;
            if (batches[i] + extra > max_batch)
                max_batch = batches[i] + extra; /* sequences */
            if (ctxs[j] > max_ctx)
                max_ctx = ctxs[j];
        }
    if (pool_blocks == 0) {
        fprintf(stderr, "kvfleet bench attn: every case is larger than --max-kv=%lld bytes\n",
                (long long)c->max_kv);
        return 2;
    }
    size_t pool_bytes = (size_t)pool_blocks * (size_t)l->block_bytes;
    size_t copy_bytes = pool_bytes < (size_t)c->copy_max ? pool_bytes : (size_t)c->copy_max;
    int64_t max_blocks = kvf_kv_blocks_for(max_ctx, l->block_size);
    size_t ws_bytes = 0; /* the largest any case needs (short partitions for small batches) */
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < nc; j++) {
            /* n_seqs 0: the partition kernel's split (what --chunk's baseline needs) */
            size_t w = kvf_cuda_attention_workspace_bytes(batches[i] * tps + extra, 0, c->heads,
                                                          l->head_dim, ctxs[j]);
            if ((double)(batches[i] + extra) * ctxs[j] * tok_bytes <= (double)c->max_kv &&
                w > ws_bytes)
                ws_bytes = w;
        }
    const int64_t max_tokens = (int64_t)(max_batch - extra) * tps + extra;
    size_t qo_bytes = (size_t)max_tokens * c->heads * l->head_dim * sizeof(float);
    size_t flush_bytes = c->l2_flush ? (size_t)c->flush_bytes : 0;
    size_t need = pool_bytes + 2 * copy_bytes + ws_bytes + 2 * qo_bytes + flush_bytes +
                  (size_t)max_batch * (size_t)(max_blocks + 2) * sizeof(int32_t);
    if (need + ((size_t)512 << 20) > dev_free) {
        fprintf(stderr,
                "kvfleet bench attn: needs %.1f GiB of device memory, %.1f GiB free: lower "
                "--max-kv or --copy-max\n",
                need / 1073741824.0, dev_free / 1073741824.0);
        return 1;
    }

    void *pool = NULL, *src = NULL, *dst = NULL, *ws = NULL, *q = NULL, *out = NULL;
    void *flush = NULL, *d_seq = NULL, *d_pos = NULL, *d_bt = NULL;
    int32_t *h_bt = NULL, *h_seq = NULL, *h_pos = NULL, *perm = NULL;
    attn_row *rows = calloc((size_t)nb * nc, sizeof *rows);
    fprintf(stderr, "bench attn: allocating %.1f GiB on %s and filling the pool\n",
            need / 1073741824.0, dev_name);
    if ((st = kvf_cuda_bench_alloc(pool_bytes, &pool, &err)) != KVF_OK ||
        (st = kvf_cuda_bench_alloc(copy_bytes, &src, &err)) != KVF_OK ||
        (st = kvf_cuda_bench_alloc(copy_bytes, &dst, &err)) != KVF_OK ||
        (st = kvf_cuda_bench_alloc(ws_bytes, &ws, &err)) != KVF_OK ||
        (st = kvf_cuda_bench_alloc(qo_bytes, &q, &err)) != KVF_OK ||
        (st = kvf_cuda_bench_alloc(qo_bytes, &out, &err)) != KVF_OK ||
        (flush_bytes && (st = kvf_cuda_bench_alloc(flush_bytes, &flush, &err)) != KVF_OK) ||
        (st = kvf_cuda_bench_alloc((size_t)max_tokens * sizeof(int32_t), &d_seq, &err)) != KVF_OK ||
        (st = kvf_cuda_bench_alloc((size_t)max_tokens * sizeof(int32_t), &d_pos, &err)) != KVF_OK ||
        (st = kvf_cuda_bench_alloc((size_t)max_batch * max_blocks * sizeof(int32_t), &d_bt,
                                   &err)) != KVF_OK)
        goto fail_alloc;
    if ((st = kvf_cuda_bench_fill_random(pool, pool_bytes / kvf_dtype_size(l->dtype), l->dtype, 1,
                                         &err)) != KVF_OK ||
        (st = kvf_cuda_bench_fill_random(src, copy_bytes / 4, KVF_DTYPE_F32, 2, &err)) != KVF_OK ||
        (st = kvf_cuda_bench_fill_random(q, qo_bytes / 4, KVF_DTYPE_F32, 3, &err)) != KVF_OK)
        goto fail_alloc;

    /* blocks scattered over the whole pool, as a long-running server's would be */
    perm = malloc((size_t)pool_blocks * sizeof *perm);
    h_bt = malloc((size_t)max_batch * max_blocks * sizeof *h_bt);
    h_seq = malloc((size_t)max_tokens * sizeof *h_seq);
    h_pos = malloc((size_t)max_tokens * sizeof *h_pos);
    uint32_t rng = 12345;
    for (int64_t i = 0; i < pool_blocks; i++)
        perm[i] = (int32_t)i;
    for (int64_t i = pool_blocks - 1; i > 0; i--) {
        uint64_t hi = attn_rng(&rng), lo = attn_rng(&rng);
        int64_t j = (int64_t)((hi << 16 ^ lo) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }

    int n_cases = nb * nc, k = 0;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < nc; j++, k++) {
            attn_row *r = &rows[k];
            r->batch = batches[i];
            r->ctx = ctxs[j];
            r->kv_bytes = (double)(r->batch + extra) * r->ctx * tok_bytes;
            if (r->ctx < tps) {
                r->skipped = true;
                fprintf(stderr, "bench attn: [%d/%d] batch %d ctx %d: skipped (shorter than --chunk)\n",
                        k + 1, n_cases, r->batch, r->ctx);
                continue;
            }
            if (r->kv_bytes > (double)c->max_kv) {
                r->skipped = true;
                fprintf(stderr, "bench attn: [%d/%d] batch %d ctx %d: skipped (KV %.1f GiB > --max-kv)\n",
                        k + 1, n_cases, r->batch, r->ctx, r->kv_bytes / 1073741824.0);
                continue;
            }
            int32_t nbk = (int32_t)kvf_kv_blocks_for(r->ctx, l->block_size);
            const int32_t n_seq = r->batch + extra, n_tok = r->batch * tps + extra;
            for (int32_t s = 0; s < n_seq; s++) {
                /* the last tps positions of the context; a decode sequence: the last one */
                const int32_t first = s < r->batch ? s * tps : r->batch * tps + (s - r->batch);
                const int32_t n = s < r->batch ? tps : 1;
                for (int32_t i = 0; i < n; i++) {
                    h_seq[first + i] = s;
                    h_pos[first + i] = r->ctx - n + i;
                }
                for (int32_t b = 0; b < nbk; b++)
                    h_bt[(int64_t)s * nbk + b] = perm[(int64_t)s * nbk + b];
            }
            if ((st = kvf_cuda_bench_upload(d_seq, h_seq, (size_t)n_tok * 4, &err)) != KVF_OK ||
                (st = kvf_cuda_bench_upload(d_pos, h_pos, (size_t)n_tok * 4, &err)) != KVF_OK ||
                (st = kvf_cuda_bench_upload(d_bt, h_bt, (size_t)n_seq * nbk * 4, &err)) != KVF_OK)
                goto fail_alloc;
            kvf_cuda_attn_params p = {
                .q = q, .out = out, .pool = pool, .layout = *l, .layer = 0,
                .n_tokens = n_tok, .n_heads = c->heads, .n_seqs = n_seq,
                .tok_seq = d_seq, .tok_pos = d_pos,
                .block_tables = d_bt, .max_blocks = nbk, .max_ctx = r->ctx, .window = 0,
                .scale = 1.0f / sqrtf((float)l->head_dim), .k_scale = 1.0f, .v_scale = 1.0f,
                .workspace = ws, .workspace_bytes = ws_bytes};
            double est = 0;
            r->copy_bytes = r->kv_bytes < (double)copy_bytes ? r->kv_bytes : (double)copy_bytes;
            size_t cb = (size_t)r->copy_bytes / 256 * 256;
            for (int j = 0; j < ks->n; j++) {
                p.decode_kernel = ks->k[j];
                if ((st = kvf_cuda_bench_attn_ms(&p, NULL, 0, 2, &est, &err)) != KVF_OK ||
                    (st = kvf_cuda_bench_attn_ms(&p, flush, flush_bytes, attn_iters(c, est),
                                                 &r->attn_ms[j], &err)) != KVF_OK)
                    goto fail_alloc;
            }
            if ((st = kvf_cuda_bench_copy_ms(dst, src, cb, NULL, 0, 2, &est, &err)) != KVF_OK ||
                (st = kvf_cuda_bench_copy_ms(dst, src, cb, flush, flush_bytes, attn_iters(c, est),
                                             &r->copy_ms, &err)) != KVF_OK ||
                (c->chunk == 0 &&
                 ((st = kvf_cuda_bench_read_ms(src, cb, dst, NULL, 0, 2, &est, &err)) != KVF_OK ||
                  (st = kvf_cuda_bench_read_ms(src, cb, dst, flush, flush_bytes,
                                               attn_iters(c, est), &r->read_ms, &err)) != KVF_OK)) ||
                (st = kvf_cuda_bench_sync(&err)) != KVF_OK)
                goto fail_alloc;
            if (c->chunk > 0) { /* the baseline: the same call, no tiles */
                kvf_cuda_attn_params u = p;
                u.n_seqs = 0;
                u.decode_kernel = KVF_BACKEND_ATTN_DECODE_SIMT;
                if ((st = kvf_cuda_bench_attn_ms(&u, NULL, 0, 2, &est, &err)) != KVF_OK ||
                    (st = kvf_cuda_bench_attn_ms(&u, flush, flush_bytes, attn_iters(c, est),
                                                 &r->untiled_ms, &err)) != KVF_OK ||
                    (st = kvf_cuda_bench_sync(&err)) != KVF_OK)
                    goto fail_alloc;
                fprintf(stderr, "bench attn: [%d/%d] batch %d ctx %d chunk %d: tiled %.1f us (%s "
                                "decode), per token %.1f us\n",
                        k + 1, n_cases, r->batch, r->ctx, tps, r->attn_ms[0] * 1e3,
                        kvf_backend_attn_decode_name(ks->k[0]), r->untiled_ms * 1e3);
            }
            r->copy_bytes = (double)cb;
            if (c->chunk == 0) { /* --chunk printed its own line above */
                fprintf(stderr, "bench attn: [%d/%d] batch %d ctx %d:", k + 1, n_cases, r->batch,
                        r->ctx);
                for (int j = 0; j < ks->n; j++)
                    fprintf(stderr, " %s %.1f us %.0f GB/s,", kvf_backend_attn_decode_name(ks->k[j]),
                            r->attn_ms[j] * 1e3, attn_bw(r, j) / 1e9);
                fprintf(stderr, " copy %.0f GB/s, read %.0f GB/s\n", attn_copy_bw(r) / 1e9,
                        attn_read_bw(r) / 1e9);
            }
        }

    printf("device: %s\n", dev_name);
    if (c->chunk > 0) {
        attn_prefill_table(c, l, ks, rows, n_cases);
        rc = 0;
        goto done;
    }
    /* the table */
    printf("shape: %d query heads, %d KV heads x %d, %s KV, block %d; one decode token per "
           "sequence; L2 %s before every call\n",
           c->heads, l->n_kv_heads, l->head_dim, kvf_dtype_name(l->dtype), l->block_size,
           c->l2_flush ? "flushed" : "not flushed");
    printf("<kernel>_GB/s = K+V bytes read / time of that decode kernel; copy_GB/s = (read + "
           "written) / time of a device-to-device copy of min(KV bytes, --copy-max); ratio = "
           "attention / copy; read_GB/s = bytes / time of one kernel that only reads those "
           "bytes, read_ratio = read / copy (the most any single kernel reading the KV "
           "reaches)\n\n");
    printf("%7s %7s %10s %10s %10s %10s", "batch", "ctx", "kv_MiB", "copy_GB/s", "read_GB/s",
           "read_ratio");
    attn_kernel_heads(ks, (const char *[3]){"", "", "ratio_"},
                      (const char *[3]){"_us", "_GB/s", ""}, (const int[3]){10, 10, 10});
    for (k = 0; k < n_cases; k++) {
        attn_row *r = &rows[k];
        printf("%7d %7d %10.1f", r->batch, r->ctx, r->kv_bytes / 1048576.0);
        if (r->skipped) {
            printf(" %10s\n", "skipped");
            continue;
        }
        printf(" %10.0f %10.0f %10.3f", attn_copy_bw(r) / 1e9, attn_read_bw(r) / 1e9,
               attn_read_ratio(r));
        for (int j = 0; j < ks->n; j++)
            printf(" %10.1f %10.0f %10.3f", r->attn_ms[j] * 1e3, attn_bw(r, j) / 1e9,
                   attn_ratio(r, j, NULL));
        printf("\n");
    }
    printf("\n");
    attn_print_mins("ratio_vs_d2d_copy_min", ks, rows, n_cases, attn_ratio, attn_keep_all, NULL);
    attn_print_mins("ratio_vs_d2d_copy_min_ctx4k", ks, rows, n_cases, attn_ratio, attn_keep_4k,
                    NULL);
    /* the ceiling: the bare read's own ratio, its smallest at 4k and up, and how close each
     * kernel comes to it */
    double read_min = -1;
    for (k = 0; k < n_cases; k++)
        if (!rows[k].skipped && attn_keep_4k(&rows[k]) &&
            (read_min < 0 || attn_read_ratio(&rows[k]) < read_min))
            read_min = attn_read_ratio(&rows[k]);
    if (read_min < 0)
        printf("read_vs_d2d_copy_min_ctx4k=n/a (no case measured)\n");
    else
        printf("read_vs_d2d_copy_min_ctx4k=%.3f\n", read_min);
    attn_print_mins("ratio_vs_read_min_ctx4k", ks, rows, n_cases, attn_vs_read, attn_keep_4k,
                    NULL);
    rc = 0;
    goto done;

fail_alloc:
    fprintf(stderr, "kvfleet bench attn: %s\n", err.msg);
    rc = 1;
done:
    kvf_cuda_bench_free(pool);
    kvf_cuda_bench_free(src);
    kvf_cuda_bench_free(dst);
    kvf_cuda_bench_free(ws);
    kvf_cuda_bench_free(q);
    kvf_cuda_bench_free(out);
    kvf_cuda_bench_free(flush);
    kvf_cuda_bench_free(d_seq);
    kvf_cuda_bench_free(d_pos);
    kvf_cuda_bench_free(d_bt);
    free(perm);
    free(h_bt);
    free(h_seq);
    free(h_pos);
    free(rows);
    return rc;
}
#endif /* KVF_HAVE_CUDA */

int kvf_bench_attn_main(int argc, char **argv)
{
    attn_bench_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&attn_bench_spec, &c, argc, argv, NULL, &err);
    if (st == KVF_HELP)
        return 0;
    if (st != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    int32_t batches[ATTN_BENCH_MAX_LIST], ctxs[ATTN_BENCH_MAX_LIST];
    if (c.chunk < 0 || c.chunk > 8192) {
        fprintf(stderr, "kvfleet: bench attn: --chunk=%d is out of range (0..8192; 0 = decode)\n",
                c.chunk);
        return 2;
    }
    if (c.decode_seqs < 0 || c.decode_seqs > 4096 || (c.decode_seqs > 0 && c.chunk == 0)) {
        fprintf(stderr, "kvfleet: bench attn: --decode-seqs=%d must be 0..4096 and goes with "
                        "--chunk (without it every sequence is a decode one already)\n",
                c.decode_seqs);
        return 2;
    }
    const char *bdef = c.chunk ? (c.quick ? "1,4" : "1,2,4,8")
                               : c.quick ? "1,16,64" : "1,2,4,8,16,32,64,128,256";
    const char *cdef = c.quick ? "1024,4096,16384" : "512,1024,2048,4096,8192,16384,32768";
    int nb = attn_parse_list(c.batches ? c.batches : bdef, "batches", batches, &err);
    int nc = nb ? attn_parse_list(c.contexts ? c.contexts : cdef, "contexts", ctxs, &err) : 0;
    if (!nb || !nc) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    attn_kernels ks;
    if (!attn_parse_kernels(c.decode_kernel, &ks, &err)) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    int dt = kvf_dtype_parse(c.dtype);
    if (dt < 0) {
        fprintf(stderr, "kvfleet: bench attn: --dtype=%s is not a KV dtype (use f32, f16, bf16 or fp8-e4m3)\n",
                c.dtype);
        return 2;
    }
    kvf_kv_layout l;
    if (kvf_kv_layout_init(1, c.kv_heads, c.head_dim, c.block_size, (kvf_dtype)dt, &l, &err) !=
        KVF_OK) {
        fprintf(stderr, "kvfleet: bench attn: %s\n", err.msg);
        return 2;
    }
#ifndef KVF_HAVE_CUDA
    fprintf(stderr, "kvfleet bench attn: this build has no CUDA (nvcc was not found when it was "
                    "configured); build with -DKVF_CUDA=ON where the CUDA toolkit is installed "
                    "and run on a machine with a GPU\n");
    return 1;
#else
    if (kvf_cuda_attention_supports(&l, c.heads, &err) != KVF_OK) {
        fprintf(stderr, "kvfleet: bench attn: %s\n", err.msg);
        return 2;
    }
    char why[256];
    if (!kvf_cuda_available(why, sizeof why)) {
        fprintf(stderr, "kvfleet bench attn: needs a GPU and none is usable here (%s); nothing "
                        "was measured\n",
                why);
        return 1;
    }
    return attn_bench_run(&c, &l, &ks, batches, nb, ctxs, nc);
#endif
}
