/* cpu_backend.c: kvf_backend on the CPU: a persistent pthread pool that splits every GEMM
 * (single-threaded OpenBLAS per slice, so OpenBLAS is set to one thread) and paged attention;
 * plain loops for the elementwise ops. Weights become f32 at load (aligned f32 is borrowed), or
 * q8 blocks (--weight-dtype q8: integer dot products for small batches, f32 tiles for sgemm). */
#include <cblas.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "model/backend_impl.h"
#include "model/config.h"
#include "model/cpu_kernels.h"
#include "model/cpu_pool.h"

/* Rows of a half-precision weight converted to f32 at a time (per thread scratch). */
#define CPU_CONV_ROWS 64

/* q8 matmuls of up to this many tokens quantize the activations and run integer dot products
 * (reading the int8 weights once, a tile of CPU_Q8_TILE_ROWS rows at a time from L1 for every
 * token); larger ones dequantize CPU_CONV_ROWS rows at a time to f32 for OpenBLAS's sgemm,
 * whose compute then outweighs the conversion. */
#define CPU_Q8_DOT_MAX_N 8
#define CPU_Q8_DOT_CAP 64 /* the most KVFLEET_CPU_Q8_DOT_MAX_N may set (scratch rows) */
#define CPU_Q8_TILE_ROWS 16

/* How long pool threads spin for the next op (and the caller for the workers) before they
 * sleep: longer than the gap between two ops of a forward pass, short enough that an idle
 * server gives its CPUs back at once. */
#define CPU_SPIN_NS 50000

typedef struct cpu_ctx cpu_ctx;
struct cpu_ctx {
    int32_t n_threads;
    bool half_weights;
    bool own_sgemv; /* batch-1 matmul by kern->sgemv rather than OpenBLAS's sgemv */
    int64_t spin_ns; /* the pool's spin before sleeping */
    float k_scale, v_scale; /* fp8 KV: stored = fp8(value / scale) */
    const kvf_cpu_kernels *kern;
    kvf_cpu_pool *pool;
    float **conv;     /* [n_threads] scratch of conv_cap floats, grown at weight_load */
    int64_t conv_cap;
    bool q8;          /* matrices quantized to q8 at load */
    int32_t q8_dot_max_n; /* CPU_Q8_DOT_MAX_N unless KVFLEET_CPU_Q8_DOT_MAX_N says otherwise */
    int8_t *xq;       /* q8: the activations of a small batch, [CPU_Q8_DOT_CAP][xq_blocks * 32] */
    float *xd;        /* and their scales [CPU_Q8_DOT_CAP][xq_blocks]; grown at weight_load */
    int64_t xq_blocks;
};

static void pool_run(cpu_ctx *c, kvf_cpu_job_fn fn, void *arg, int64_t n_items)
{
    kvf_cpu_pool_run(c->pool, fn, arg, n_items);
}

static void cpu_destroy(void *ctx)
{
    cpu_ctx *c = ctx;
    if (!c)
        return;
    kvf_cpu_pool_destroy(c->pool);
    if (c->conv)
        for (int32_t i = 0; i < c->n_threads; i++)
            free(c->conv[i]);
    free(c->conv);
    free(c->xq);
    free(c->xd);
    free(c);
}

/* Logs once per process what this CPU can do, OpenBLAS's core and the kernels chosen. */
static void cpu_log_choice(const cpu_ctx *c)
{
    static atomic_flag logged = ATOMIC_FLAG_INIT;
    if (atomic_flag_test_and_set(&logged))
        return;
    char feat[128], better[32];
    const char *core;
    kvf_cpu_features_str(feat, sizeof feat);
    kvf_cpu_blas_core(&core, better, sizeof better);
    kvf_log(KVF_LOG_INFO, "model: cpu: features %s; OpenBLAS core %s%s%s%s; kernels %s, batch-1 matmul by %s; "
            "%d threads spin %.0f us%s", feat, core, better[0] ? " (this CPU could run " : "", better,
            better[0] ? ")" : "", c->kern->name, c->own_sgemv ? "kvfleet's sgemv" : "OpenBLAS sgemv",
            c->n_threads, (double)c->spin_ns / 1e3, c->q8 ? "; q8 weights" : "");
}

static kvf_status cpu_create(const kvf_backend_opts *opts, void **ctx_out, kvf_err *err)
{
    int32_t n = opts ? opts->n_threads : 0;
    if (n < 0 || n > 1024)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: cpu backend: %d threads is not allowed (0 for one per CPU, up to 1024)", n);
    if (n == 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        n = cpus > 0 ? (int32_t)(cpus > 64 ? 64 : cpus) : 1;
    }
    float ks = opts ? opts->kv_k_scale : 0.0f, vs = opts ? opts->kv_v_scale : 0.0f;
    if (!(ks >= 0.0f) || !(vs >= 0.0f) || isinf(ks) || isinf(vs))
        return kvf_err_set(err, KVF_ERR_INVALID, "model: cpu backend: KV scales k %g, v %g are not allowed (finite, > 0; 0 means 1)",
                           (double)ks, (double)vs);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: cpu backend: out of memory");
    c->n_threads = n;
    c->half_weights = opts && opts->half_weights;
    c->q8 = opts && opts->weight_dtype == KVF_BACKEND_WEIGHT_Q8;
    /* KVFLEET_CPU_Q8_DOT_MAX_N=0..64 moves the batch size where q8 matmuls switch from integer
     * dot products to dequantized tiles and sgemm (to measure the two on a machine) */
    const char *dm = getenv("KVFLEET_CPU_Q8_DOT_MAX_N");
    long dmn = dm && *dm ? strtol(dm, NULL, 10) : CPU_Q8_DOT_MAX_N;
    c->q8_dot_max_n = dmn >= 0 && dmn <= CPU_Q8_DOT_CAP ? (int32_t)dmn : CPU_Q8_DOT_MAX_N;
    if (c->q8 && c->half_weights) {
        free(c);
        return kvf_err_set(err, KVF_ERR_INVALID, "model: cpu backend: --half-weights and --weight-dtype q8 "
                           "cannot be combined (q8 replaces the matrices; choose one)");
    }
    c->k_scale = ks > 0.0f ? ks : 1.0f;
    c->v_scale = vs > 0.0f ? vs : 1.0f;
    c->kern = kvf_cpu_kernels_get(kvf_cpu_isa_best());
    /* KVFLEET_CPU_SGEMV=blas|own overrides the choice (to compare the two) */
    const char *sg = getenv("KVFLEET_CPU_SGEMV");
    c->own_sgemv = sg && strcmp(sg, "blas") == 0 ? false
                   : sg && strcmp(sg, "own") == 0 ? true
                   : c->kern->isa != KVF_CPU_ISA_SCALAR;
    c->conv = calloc((size_t)n, sizeof *c->conv);
    if (!c->conv) {
        cpu_destroy(c);
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: cpu backend: out of memory");
    }
    /* KVFLEET_CPU_SPIN_US overrides the spin (0: sleep at once), to tune it on a machine */
    const char *sp = getenv("KVFLEET_CPU_SPIN_US");
    int64_t spin_ns = sp && *sp ? (int64_t)(strtod(sp, NULL) * 1e3) : CPU_SPIN_NS;
    if (spin_ns < 0 || spin_ns > 100000000)
        spin_ns = CPU_SPIN_NS;
    c->spin_ns = spin_ns;
    kvf_status st = kvf_cpu_pool_create(n, spin_ns, &c->pool, err);
    if (st != KVF_OK) {
        cpu_destroy(c);
        return st;
    }
    openblas_set_num_threads(1); /* the pool parallelizes; see cpu_matmul */
    cpu_log_choice(c);
    *ctx_out = c;
    return KVF_OK;
}

/* ---- memory */
static kvf_status cpu_alloc(void *ctx, size_t bytes, void **out, kvf_err *err)
{
    size_t n = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, n ? n : 64);
    if (!p)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: cpu backend: out of memory for %zu bytes", bytes);
    memset(p, 0, n ? n : 64);
    *out = p;
    return KVF_OK;
}

static void cpu_free(void *ctx, void *p)
{
    free(p);
}

static void cpu_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    if (bytes)
        memmove(dst, src, bytes);
}

/* ---- element conversion */
static void load_f32(const void *src, kvf_dtype dt, int64_t n, float *out)
{
    switch (dt) {
    case KVF_DTYPE_F32:
        memcpy(out, src, (size_t)n * sizeof(float));
        return;
    case KVF_DTYPE_F16: {
        const uint8_t *b = src;
        for (int64_t i = 0; i < n; i++)
            out[i] = kvf_f16_to_f32((uint16_t)(b[2 * i] | (b[2 * i + 1] << 8)));
        return;
    }
    case KVF_DTYPE_BF16: { /* exact: bf16 is the top half of an f32 */
        if ((uintptr_t)src % 2 == 0) { /* the vectorizable form */
            const uint16_t *h = src;
            uint32_t *o = (uint32_t *)out;
            for (int64_t i = 0; i < n; i++)
                o[i] = (uint32_t)h[i] << 16;
            return;
        }
        const uint8_t *b = src;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = ((uint32_t)b[2 * i] << 16) | ((uint32_t)b[2 * i + 1] << 24);
            memcpy(&out[i], &u, sizeof u);
        }
        return;
    }
    case KVF_DTYPE_FP8_E4M3: {
        const uint8_t *b = src;
        for (int64_t i = 0; i < n; i++)
            out[i] = kvf_fp8e4m3_to_f32(b[i]);
        return;
    }
    }
}

static void store_f32(void *dst, kvf_dtype dt, const float *x, int64_t n)
{
    switch (dt) {
    case KVF_DTYPE_F32:
        memcpy(dst, x, (size_t)n * sizeof(float));
        return;
    case KVF_DTYPE_F16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = kvf_f32_to_f16(x[i]);
        return;
    }
    case KVF_DTYPE_BF16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = kvf_f32_to_bf16(x[i]);
        return;
    }
    case KVF_DTYPE_FP8_E4M3: {
        uint8_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = kvf_f32_to_fp8e4m3(x[i]);
        return;
    }
    }
}

/* ---- weights */
#define CPU_CONV_CHUNK (1 << 20) /* elements per conversion item at load */

typedef struct cpu_conv_job {
    const void *src;
    kvf_dtype dt;
    int64_t n;
    float *out;
} cpu_conv_job;

static void cpu_conv_item(void *arg, int64_t item, int32_t thread)
{
    const cpu_conv_job *j = arg;
    int64_t i0 = item * CPU_CONV_CHUNK, n = j->n - i0 < CPU_CONV_CHUNK ? j->n - i0 : CPU_CONV_CHUNK;
    load_f32((const uint8_t *)j->src + (size_t)i0 * kvf_dtype_size(j->dt), j->dt, n, j->out + i0);
}

/* Grows every thread's conversion scratch to `need` floats. */
static kvf_status conv_reserve(cpu_ctx *c, int64_t need, const char *name, kvf_err *err)
{
    if (need <= c->conv_cap)
        return KVF_OK;
    for (int32_t i = 0; i < c->n_threads; i++) {
        float *p = realloc(c->conv[i], (size_t)need * sizeof(float));
        if (!p)
            return kvf_err_set(err, KVF_ERR_NOMEM, "model: tensor \"%s\": out of memory for conversion scratch",
                               name);
        c->conv[i] = p;
    }
    c->conv_cap = need;
    return KVF_OK;
}

/* q8 at load: rows quantized in parallel, a block at a time through a 32-float buffer (the
 * source may be F32, F16 or BF16, aligned or not). */
#define CPU_Q8_LOAD_ROWS 64

typedef struct cpu_q8_job {
    const uint8_t *src;
    kvf_dtype dt;
    int64_t rows, cols, kb;
    int8_t *q;
    float *d;
} cpu_q8_job;

static void cpu_q8_item(void *arg, int64_t item, int32_t thread)
{
    (void)thread;
    const cpu_q8_job *j = arg;
    size_t es = kvf_dtype_size(j->dt);
    int64_t r1 = (item + 1) * CPU_Q8_LOAD_ROWS < j->rows ? (item + 1) * CPU_Q8_LOAD_ROWS : j->rows;
    for (int64_t r = item * CPU_Q8_LOAD_ROWS; r < r1; r++)
        for (int64_t b = 0; b < j->kb; b++) {
            float buf[KVF_CPU_Q8_BLOCK];
            int64_t c0 = b * KVF_CPU_Q8_BLOCK;
            int64_t len = j->cols - c0 < KVF_CPU_Q8_BLOCK ? j->cols - c0 : KVF_CPU_Q8_BLOCK;
            load_f32(j->src + (size_t)(r * j->cols + c0) * es, j->dt, len, buf);
            kvf_cpu_q8_quantize(buf, len, j->q + (r * j->kb + b) * KVF_CPU_Q8_BLOCK, j->d + r * j->kb + b);
        }
}

/* Quantizes the matrix t into one allocation (int8 then scales) and sizes the scratch its
 * matmuls need: activations of a small batch, and f32 tiles for large ones. */
static kvf_status q8_load(cpu_ctx *c, const kvf_model_tensor *t, kvf_backend_weight *w, kvf_err *err)
{
    int64_t kb = kvf_cpu_q8_blocks(w->cols), ld = kb * KVF_CPU_Q8_BLOCK;
    kvf_status st = conv_reserve(c, CPU_CONV_ROWS * ld, t->name, err);
    if (st != KVF_OK)
        return st;
    if (kb > c->xq_blocks) {
        int8_t *q = realloc(c->xq, (size_t)(CPU_Q8_DOT_CAP * ld));
        if (q)
            c->xq = q;
        float *d = realloc(c->xd, (size_t)(CPU_Q8_DOT_CAP * kb) * sizeof(float));
        if (d)
            c->xd = d;
        if (!q || !d)
            return kvf_err_set(err, KVF_ERR_NOMEM, "model: tensor \"%s\": out of memory for q8 scratch", t->name);
        c->xq_blocks = kb;
    }
    size_t qbytes = ((size_t)(w->rows * ld) + 63) / 64 * 64;
    size_t bytes = qbytes + (size_t)(w->rows * kb) * sizeof(float);
    uint8_t *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: tensor \"%s\": out of memory for %zu bytes of q8",
                           t->name, bytes);
    cpu_q8_job job = {.src = t->data, .dt = (kvf_dtype)t->dtype, .rows = w->rows, .cols = w->cols, .kb = kb,
                      .q = (int8_t *)p, .d = (float *)(p + qbytes)};
    pool_run(c, cpu_q8_item, &job, (w->rows + CPU_Q8_LOAD_ROWS - 1) / CPU_Q8_LOAD_ROWS);
    w->data = w->owned = p;
    w->q8_scales = job.d;
    return KVF_OK;
}

static kvf_status cpu_weight_load(void *ctx, const kvf_model_tensor *t, kvf_backend_weight *out,
                                  kvf_err *err)
{
    if (t->dtype != KVF_DTYPE_F32 && t->dtype != KVF_DTYPE_F16 && t->dtype != KVF_DTYPE_BF16)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "model: tensor \"%s\" is %s (use F32, F16 or BF16)",
                           t->name, t->dtype_name);
    if (t->n_dims < 1 || t->n_dims > 2)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: tensor \"%s\" has %d dimensions (1 or 2 expected)",
                           t->name, t->n_dims);
    kvf_backend_weight w = {.rows = t->n_dims == 2 ? t->shape[0] : 1,
                            .cols = t->n_dims == 2 ? t->shape[1] : t->shape[0],
                            .dtype = KVF_DTYPE_F32};
    cpu_ctx *c = ctx;
    if (c->q8 && t->n_dims == 2) {
        kvf_status st = q8_load(c, t, &w, err);
        if (st != KVF_OK)
            return st;
    } else if (t->dtype == KVF_DTYPE_F32 && ((uintptr_t)t->data % sizeof(float)) == 0) {
        w.data = t->data;
    } else if (c->half_weights && t->n_dims == 2 && t->dtype != KVF_DTYPE_F32) {
        /* kept as F16/BF16 in the mapping; matmul converts CPU_CONV_ROWS rows at a time */
        kvf_status st = conv_reserve(c, CPU_CONV_ROWS * w.cols, t->name, err);
        if (st != KVF_OK)
            return st;
        w.data = t->data;
        w.dtype = (kvf_dtype)t->dtype;
    } else {
        /* not zeroed first: every element is written by the conversion */
        size_t bytes = ((size_t)t->n_elems * sizeof(float) + 63) / 64 * 64;
        void *p = aligned_alloc(64, bytes ? bytes : 64);
        if (!p)
            return kvf_err_set(err, KVF_ERR_NOMEM, "model: tensor \"%s\": out of memory for %zu bytes of f32",
                               t->name, bytes);
        cpu_conv_job job = {.src = t->data, .dt = (kvf_dtype)t->dtype, .n = t->n_elems, .out = p};
        pool_run(c, cpu_conv_item, &job, (t->n_elems + CPU_CONV_CHUNK - 1) / CPU_CONV_CHUNK);
        w.data = w.owned = p;
    }
    *out = w;
    return KVF_OK;
}

static void cpu_weight_unload(void *ctx, kvf_backend_weight *w)
{
    free(w->owned);
    memset(w, 0, sizeof *w);
}

/* ---- ops */
static void cpu_embed(void *ctx, const kvf_backend_weight *emb, const int32_t *tokens, int64_t n,
                      float *out)
{
    if (emb->q8_scales) { /* a tied LM head made the table q8: dequantize the rows asked for */
        int64_t kb = kvf_cpu_q8_blocks(emb->cols);
        const int8_t *q = emb->data;
        for (int64_t i = 0; i < n; i++) {
            const int8_t *qr = q + (int64_t)tokens[i] * kb * KVF_CPU_Q8_BLOCK;
            const float *dr = emb->q8_scales + (int64_t)tokens[i] * kb;
            for (int64_t j = 0; j < emb->cols; j++)
                out[i * emb->cols + j] = (float)qr[j] * dr[j / KVF_CPU_Q8_BLOCK];
        }
        return;
    }
    size_t es = kvf_dtype_size(emb->dtype);
    for (int64_t i = 0; i < n; i++)
        load_f32((const uint8_t *)emb->data + (size_t)tokens[i] * (size_t)emb->cols * es, emb->dtype, emb->cols,
                 out + i * emb->cols);
}

/* One matmul job: each item computes a slice of the output columns (rows of W) with a
 * single-threaded OpenBLAS call, so the pool, not OpenBLAS, owns the threads (OpenBLAS's own
 * threaded GEMM allocates on every call). */
typedef struct cpu_mm_job {
    cpu_ctx *c;
    const float *x;
    int64_t n;
    const kvf_backend_weight *w, *bias;
    float *y;
    int64_t rows_per_item;
} cpu_mm_job;

/* y[:, r0:r1] = x @ W[r0:r1]^T for f32 rows W (row stride ld >= cols). */
static void mm_rows(const cpu_ctx *c, const float *x, int64_t n, const float *W, int64_t ld, int64_t r0,
                    int64_t r1, int64_t cols, float *y, int64_t rows)
{
    if (n == 1 && c->own_sgemv)
        c->kern->sgemv(W, r1 - r0, cols, ld, x, y + r0);
    else if (n == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, (blasint)(r1 - r0), (blasint)cols, 1.0f, W,
                    (blasint)ld, x, 1, 0.0f, y + r0, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)(r1 - r0),
                    (blasint)cols, 1.0f, x, (blasint)cols, W, (blasint)ld, 0.0f, y + r0,
                    (blasint)rows);
}

/* y[:, r0:r1] for q8 W: integer dots against the activations cpu_matmul quantized into c->xq
 * (n <= c->q8_dot_max_n), a tile of rows for every token while it is in L1; else f32 tiles of
 * CPU_CONV_ROWS rows in this thread's scratch, for sgemm. */
static void mm_rows_q8(const cpu_ctx *c, const float *x, int64_t n, const kvf_backend_weight *w, int64_t r0,
                       int64_t r1, float *y, float *conv)
{
    int64_t kb = kvf_cpu_q8_blocks(w->cols), ld = kb * KVF_CPU_Q8_BLOCK, rows = w->rows;
    const int8_t *q = w->data;
    if (n <= c->q8_dot_max_n) {
        for (int64_t r = r0; r < r1; r += CPU_Q8_TILE_ROWS) {
            int64_t re = r + CPU_Q8_TILE_ROWS < r1 ? r + CPU_Q8_TILE_ROWS : r1;
            for (int64_t i = 0; i < n; i++)
                c->kern->q8_gemv(q + r * ld, w->q8_scales + r * kb, re - r, kb, c->xq + i * ld, c->xd + i * kb,
                                 y + i * rows + r);
        }
        return;
    }
    for (int64_t r = r0; r < r1; r += CPU_CONV_ROWS) {
        int64_t re = r + CPU_CONV_ROWS < r1 ? r + CPU_CONV_ROWS : r1;
        c->kern->q8_dequant(q + r * ld, w->q8_scales + r * kb, (re - r) * kb, conv);
        mm_rows(c, x, n, conv, ld, r, re, w->cols, y, rows);
    }
}

static void cpu_mm_item(void *arg, int64_t item, int32_t thread)
{
    const cpu_mm_job *j = arg;
    int64_t r0 = item * j->rows_per_item, r1 = r0 + j->rows_per_item;
    if (r1 > j->w->rows)
        r1 = j->w->rows;
    if (r0 >= r1)
        return;
    int64_t cols = j->w->cols, rows = j->w->rows;
    if (j->w->q8_scales) {
        mm_rows_q8(j->c, j->x, j->n, j->w, r0, r1, j->y, j->c->conv[thread]);
    } else if (j->w->dtype == KVF_DTYPE_F32) {
        mm_rows(j->c, j->x, j->n, (const float *)j->w->data + r0 * cols, cols, r0, r1, cols, j->y, rows);
    } else {
        float *conv = j->c->conv[thread];
        size_t es = kvf_dtype_size(j->w->dtype);
        for (int64_t r = r0; r < r1; r += CPU_CONV_ROWS) {
            int64_t re = r + CPU_CONV_ROWS < r1 ? r + CPU_CONV_ROWS : r1;
            load_f32((const uint8_t *)j->w->data + (size_t)(r * cols) * es, j->w->dtype, (re - r) * cols, conv);
            mm_rows(j->c, j->x, j->n, conv, cols, r, re, cols, j->y, rows);
        }
    }
    if (j->bias) {
        const float *b = j->bias->data;
        for (int64_t i = 0; i < j->n; i++)
            for (int64_t r = r0; r < r1; r++)
                j->y[i * rows + r] += b[r];
    }
}

static void cpu_matmul(void *ctx, const float *x, int64_t n, const kvf_backend_weight *w,
                       const kvf_backend_weight *bias, float *y)
{
    cpu_ctx *c = ctx;
    /* slices of whole 16-row groups; small products stay on one thread */
    int64_t items = (int64_t)c->n_threads;
    if (n * w->rows * w->cols < (1 << 16))
        items = 1;
    int64_t per = (w->rows + items - 1) / items;
    per = (per + 15) / 16 * 16;
    if (w->q8_scales && n <= c->q8_dot_max_n) { /* once here, not once per slice */
        int64_t kb = kvf_cpu_q8_blocks(w->cols);
        for (int64_t i = 0; i < n; i++)
            kvf_cpu_q8_quantize(x + i * w->cols, w->cols, c->xq + i * kb * KVF_CPU_Q8_BLOCK, c->xd + i * kb);
    }
    cpu_mm_job job = {.c = c, .x = x, .n = n, .w = w, .bias = bias, .y = y, .rows_per_item = per};
    pool_run(c, cpu_mm_item, &job, (w->rows + per - 1) / per);
}

static void cpu_rmsnorm(void *ctx, const float *x, int64_t n, const kvf_backend_weight *w, float eps,
                        float *out)
{
    const cpu_ctx *c = ctx;
    int64_t d = w->cols;
    for (int64_t i = 0; i < n; i++)
        c->kern->rmsnorm(x + i * d, w->data, d, eps, out + i * d);
}

static void cpu_rope(void *ctx, float *x, int64_t n, int32_t n_heads, int32_t head_dim,
                     const float *cos_sin)
{
    int32_t half = head_dim / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *cs = cos_sin + t * half * 2;
        for (int32_t h = 0; h < n_heads; h++) {
            float *v = x + (t * n_heads + h) * head_dim;
            for (int32_t j = 0; j < half; j++) {
                float c = cs[2 * j], s = cs[2 * j + 1];
                float a = v[j], b = v[j + half];
                v[j] = a * c - b * s;
                v[j + half] = b * c + a * s;
            }
        }
    }
}

static void cpu_swiglu(void *ctx, const float *gate, const float *up, int64_t n, float *out)
{
    const cpu_ctx *c = ctx;
    c->kern->swiglu(gate, up, n, out);
}

static void cpu_add(void *ctx, float *x, const float *y, int64_t n)
{
    const cpu_ctx *c = ctx;
    c->kern->add(x, y, n);
}

static void cpu_gather(void *ctx, const float *x, int64_t row_len, const int32_t *rows, int64_t n,
                       float *out)
{
    for (int64_t i = 0; i < n; i++)
        memmove(out + i * row_len, x + (int64_t)rows[i] * row_len, (size_t)row_len * sizeof(float));
}

/* fp8 KV with a scale: stored = fp8(x / scale). */
static void store_fp8_scaled(uint8_t *d, const float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++)
        d[i] = kvf_f32_to_fp8e4m3(x[i] / scale);
}

static void cpu_kv_write(void *ctx, void *pool, const kvf_kv_layout *l, int32_t layer,
                         const float *k, const float *v, const int64_t *slots, int64_t n)
{
    const cpu_ctx *c = ctx;
    uint8_t *base = pool;
    int64_t hd = l->head_dim, stride = (int64_t)l->n_kv_heads * hd;
    bool fp8 = l->dtype == KVF_DTYPE_FP8_E4M3;
    for (int64_t i = 0; i < n; i++) {
        int64_t block = slots[i] / l->block_size;
        int32_t off = (int32_t)(slots[i] % l->block_size);
        for (int32_t h = 0; h < l->n_kv_heads; h++) {
            uint8_t *kd = base + kvf_kv_offset(l, block, layer, KVF_KV_K, h, off);
            uint8_t *vd = base + kvf_kv_offset(l, block, layer, KVF_KV_V, h, off);
            if (fp8) {
                store_fp8_scaled(kd, k + i * stride + h * hd, hd, c->k_scale);
                store_fp8_scaled(vd, v + i * stride + h * hd, hd, c->v_scale);
            } else {
                store_f32(kd, l->dtype, k + i * stride + h * hd, hd);
                store_f32(vd, l->dtype, v + i * stride + h * hd, hd);
            }
        }
    }
}

/* One attention job: the arguments of a call, shared by the pool's items. */
typedef struct cpu_attn_job {
    const float *q;
    const uint8_t *pool;
    const kvf_kv_layout *l;
    int32_t layer;
    const kvf_backend_attn *a;
    float *out;
    float k_scale, v_scale; /* 1 unless the KV is fp8 */
    const kvf_cpu_kernels *kern;
} cpu_attn_job;

/* Item = (token, head): online softmax over the token's visible positions, a block at a time. */
static void cpu_attn_item(void *arg, int64_t item, int32_t thread)
{
    const cpu_attn_job *j = arg;
    const kvf_backend_attn *a = j->a;
    const kvf_kv_layout *l = j->l;
    int32_t hd = a->head_dim, bs = l->block_size;
    int64_t t = item / a->n_heads;
    int32_t h = (int32_t)(item % a->n_heads);
    int32_t kvh = h / (a->n_heads / a->n_kv_heads);
    const float *q = j->q + (t * a->n_heads + h) * hd;
    float *o = j->out + (t * a->n_heads + h) * hd;
    const int32_t *bt = a->block_tables + (int64_t)a->tok_seq[t] * a->max_blocks;
    int32_t pos = a->tok_pos[t];
    int32_t lo = (a->window > 0 && pos - a->window + 1 > 0) ? pos - a->window + 1 : 0;
    bool f32 = l->dtype == KVF_DTYPE_F32;
    size_t es = kvf_dtype_size(l->dtype);

    float acc[KVF_MODEL_MAX_HEAD_DIM], row[KVF_MODEL_MAX_HEAD_DIM], s[KVF_KV_MAX_BLOCK_SIZE + 1];
    float m = -INFINITY, sum = 0.0f;
    for (int32_t d = 0; d < hd; d++)
        acc[d] = 0.0f;
    for (int32_t p0 = lo; p0 <= pos;) {
        int32_t blk = bt[p0 / bs], off0 = p0 % bs;
        int32_t cnt = bs - off0;
        if (cnt > pos - p0 + 1)
            cnt = pos - p0 + 1;
        const uint8_t *kb = j->pool + kvf_kv_offset(l, blk, j->layer, KVF_KV_K, kvh, off0);
        const uint8_t *vb = j->pool + kvf_kv_offset(l, blk, j->layer, KVF_KV_V, kvh, off0);
        /* scores of this block's positions */
        float bm = m;
        for (int32_t i = 0; i < cnt; i++) {
            const float *kr = (const float *)(kb + (size_t)i * hd * es);
            if (!f32) {
                load_f32(kb + (size_t)i * hd * es, l->dtype, hd, row);
                kr = row;
            }
            s[i] = j->kern->dot(q, kr, hd) * j->k_scale * a->scale;
            if (s[i] > bm)
                bm = s[i];
        }
        /* weights exp(s - max) of the block, all at once; then rescale what was accumulated to
         * the new maximum while adding the block's first row, and add the others */
        for (int32_t i = 0; i < cnt; i++)
            s[i] -= bm;
        s[cnt] = m - bm; /* the correction, exp'd with them */
        j->kern->exp(s, s, cnt + 1);
        float corr = s[cnt];
        sum *= corr;
        for (int32_t i = 0; i < cnt; i++) {
            float w = s[i];
            sum += w;
            const float *vr = (const float *)(vb + (size_t)i * hd * es);
            if (!f32) {
                load_f32(vb + (size_t)i * hd * es, l->dtype, hd, row);
                vr = row;
            }
            j->kern->scale_axpy(acc, i == 0 ? corr : 1.0f, w, vr, hd);
        }
        m = bm;
        p0 += cnt;
    }
    float inv = sum > 0 ? j->v_scale / sum : 0.0f;
    for (int32_t d = 0; d < hd; d++)
        o[d] = acc[d] * inv;
}

static void cpu_attention(void *ctx, const float *q, const void *pool, const kvf_kv_layout *l,
                          int32_t layer, const kvf_backend_attn *a, float *out)
{
    const cpu_ctx *c = ctx;
    bool fp8 = l->dtype == KVF_DTYPE_FP8_E4M3;
    cpu_attn_job job = {.q = q, .pool = pool, .l = l, .layer = layer, .a = a, .out = out,
                        .k_scale = fp8 ? c->k_scale : 1.0f, .v_scale = fp8 ? c->v_scale : 1.0f,
                        .kern = c->kern};
    pool_run(ctx, cpu_attn_item, &job, (int64_t)a->n_tokens * a->n_heads);
}

static void cpu_argmax(void *ctx, const float *logits, int64_t n, int64_t vocab, int32_t *out)
{
    for (int64_t i = 0; i < n; i++) {
        const float *r = logits + i * vocab;
        int64_t best = 0;
        for (int64_t j = 1; j < vocab; j++)
            if (r[j] > r[best])
                best = j;
        out[i] = (int32_t)best;
    }
}

/* No optional op: the defaults the wrappers in backend.c hold (host memory, nothing to wait
 * for or record, no draws, matmul by matmul, the host clock) are the CPU's behaviour. */
static const kvf_backend kvf_backend_cpu_ops = {
    .name = "cpu",
    .q8_weights = true,
    .create = cpu_create,
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .weight_load = cpu_weight_load,
    .weight_unload = cpu_weight_unload,
    .embed = cpu_embed,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .gather = cpu_gather,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .argmax = cpu_argmax,
};

const kvf_backend *kvf_model_backend_cpu(void)
{
    return &kvf_backend_cpu_ops;
}
