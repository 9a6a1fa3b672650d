/* backend.cu: kvf_backend on one GPU (device 0): one stream, a cuBLAS handle bound to it,
 * weights uploaded once, device memory for buffers and the KV pool, the first error of a step
 * recorded and returned by sync, and decode steps captured and replayed as CUDA graphs. The
 * kernels are in the other .cu files (ops.h, attn.h); this file only drives them. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "common/log.h"
#include "cuda/attn.h"
#include "cuda/cuda.h"
#include "cuda/graph_cache.h"
#include "cuda/ops.h"
#include "model/backend_impl.h"
}

#define CUBLAS_WS_BYTES (32u << 20) /* cuBLAS workspace, fixed so captured GEMMs never allocate */

/* What the current step does (graph_cache.h decides). */
typedef enum cuda_step_mode { STEP_NONE = 0, STEP_EAGER, STEP_CAPTURE, STEP_REPLAY } cuda_step_mode;

typedef struct cuda_ctx {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    float k_scale, v_scale; /* fp8 KV */
    int32_t matrix_dtype;
    bool no_graphs;
    int32_t attn_decode; /* KVF_BACKEND_ATTN_DECODE_* */

    /* the first error since the last sync */
    kvf_err first;
    bool failed;

    /* scratch that grows (never during a capture; growth drops every recorded graph) */
    void *conv;            /* activations converted for a half-precision GEMM */
    size_t conv_bytes;
    void *attn_ws;         /* kvf_cuda_attention's split-context partials */
    size_t attn_ws_bytes;
    int32_t *small;        /* argmax / sample outputs, sample rows and their masks */
    size_t small_bytes;
    kvf_cuda_sample_row *h_rows; /* host: sample rows as the kernel reads them (device masks) */
    int64_t h_rows_cap;
    uint32_t *h_masks;           /* host: the rows' masks packed, copied to the device at once */
    size_t h_masks_cap;          /* words */

    /* graphs */
    kvf_cuda_graph_cache graphs;
    kvf_backend_step_key step_key; /* of the step in progress */
    cuda_step_mode mode;
    int32_t replay_idx;
    kvf_cuda_stats stats;

    /* step profile marks (prof_mark), created as marks are asked for */
    cudaEvent_t *prof_ev;
    int32_t n_prof_ev;
} cuda_ctx;

/* ---- errors: the first one wins until sync hands it out */

static void record(cuda_ctx *c, kvf_status st, const kvf_err *e)
{
    if (st == KVF_OK || c->failed)
        return;
    c->failed = true;
    c->first.status = st;
    memcpy(c->first.msg, e->msg, sizeof c->first.msg);
    kvf_log(KVF_LOG_ERROR, "%s", e->msg);
}

static void record_cuda(cuda_ctx *c, cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return;
    kvf_err err = {};
    record(c, kvf_cuda_status((int)e, what, &err), &err);
}

static void record_msg(cuda_ctx *c, kvf_status st, const char *msg)
{
    kvf_err err = {};
    record(c, kvf_err_set(&err, st, "%s", msg), &err);
}

/* ---- graphs */

static void graph_destroy(void *exec)
{
    cudaGraphExecDestroy((cudaGraphExec_t)exec);
}

static void graphs_drop_all(cuda_ctx *c)
{
    kvf_cuda_graph_clear(&c->graphs, graph_destroy);
    c->stats.graphs_cached = 0;
}

/* ---- create / destroy */

static void cuda_destroy(void *ctx)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (!c)
        return;
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    graphs_drop_all(c);
    if (c->blas)
        cublasDestroy(c->blas);
    cudaFree(c->blas_ws);
    cudaFree(c->conv);
    cudaFree(c->attn_ws);
    cudaFree(c->small);
    free(c->h_rows);
    free(c->h_masks);
    for (int32_t i = 0; i < c->n_prof_ev; i++)
        cudaEventDestroy(c->prof_ev[i]);
    free(c->prof_ev);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    (void)cudaGetLastError();
    free(c);
}

static kvf_status cuda_create(const kvf_backend_opts *opts, void **ctx_out, kvf_err *err)
{
    char why[256];
    if (!kvf_cuda_available(why, sizeof why))
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "cuda backend: %s", why);
    float ks = opts ? opts->kv_k_scale : 0.0f, vs = opts ? opts->kv_v_scale : 0.0f;
    if (!(ks >= 0.0f && ks < INFINITY) || !(vs >= 0.0f && vs < INFINITY))
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda backend: KV scales k %g, v %g are not allowed (finite, > 0; 0 means 1)",
                           (double)ks, (double)vs);
    int32_t md = opts ? opts->matrix_dtype : KVF_BACKEND_MATRIX_AUTO;
    if (md < KVF_BACKEND_MATRIX_AUTO || md > KVF_BACKEND_MATRIX_F32)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda backend: matrix dtype %d is not known (auto 0, bf16 1, f16 2, f32 3)",
                           md);
    int32_t ad = opts ? opts->attn_decode : KVF_BACKEND_ATTN_DECODE_AUTO;
    if (ad < 0 || ad >= KVF_BACKEND_ATTN_DECODE_COUNT)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda backend: decode attention kernel %d is not known (auto 0, simt 1, mma 2)",
                           ad);
    cuda_ctx *c = (cuda_ctx *)calloc(1, sizeof *c);
    if (!c)
        return kvf_err_set(err, KVF_ERR_NOMEM, "cuda backend: out of memory");
    c->k_scale = ks > 0.0f ? ks : 1.0f;
    c->v_scale = vs > 0.0f ? vs : 1.0f;
    c->matrix_dtype = md;
    c->no_graphs = opts && opts->no_graphs;
    c->attn_decode = ad;
    c->device = 0;
    kvf_status st;
    cublasStatus_t bs;
    if ((st = kvf_cuda_status(cudaSetDevice(c->device), "cuda backend: set device 0", err)) != KVF_OK ||
        (st = kvf_cuda_status(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
                              "cuda backend: create stream", err)) != KVF_OK ||
        (st = kvf_cuda_status(cudaMalloc(&c->blas_ws, CUBLAS_WS_BYTES),
                              "cuda backend: cuBLAS workspace", err)) != KVF_OK)
        goto fail;
    if ((bs = cublasCreate(&c->blas)) != CUBLAS_STATUS_SUCCESS) {
        c->blas = NULL;
        st = kvf_cuda_blas_status((int)bs, "cuda backend: create cuBLAS handle", err);
        goto fail;
    }
    if ((st = kvf_cuda_blas_status((int)cublasSetStream(c->blas, c->stream), "cuda backend: cuBLAS stream", err)) != KVF_OK ||
        (st = kvf_cuda_blas_status((int)cublasSetWorkspace(c->blas, c->blas_ws, CUBLAS_WS_BYTES),
                                   "cuda backend: cuBLAS workspace", err)) != KVF_OK ||
        (st = kvf_cuda_blas_status((int)cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH),
                                   "cuda backend: cuBLAS math mode", err)) != KVF_OK)
        goto fail;
    *ctx_out = c;
    return KVF_OK;
fail:
    cuda_destroy(c);
    return st;
}

/* ---- memory */

static kvf_status cuda_alloc(void *ctx, size_t bytes, void **out, kvf_err *err)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    void *p = NULL;
    size_t n = bytes ? bytes : 1;
    kvf_status st = kvf_cuda_status(cudaMalloc(&p, n), "cuda backend: alloc", err);
    if (st != KVF_OK)
        return kvf_err_prefix(err, "%zu bytes", bytes);
    if ((st = kvf_cuda_status(cudaMemsetAsync(p, 0, n, c->stream), "cuda backend: zero", err)) != KVF_OK ||
        (st = kvf_cuda_status(cudaStreamSynchronize(c->stream), "cuda backend: zero", err)) != KVF_OK) {
        cudaFree(p);
        return st;
    }
    *out = p;
    return KVF_OK;
}

static void cuda_free(void *ctx, void *p)
{
    if (!p)
        return;
    graphs_drop_all((cuda_ctx *)ctx); /* a recorded step may read or write p */
    record_cuda((cuda_ctx *)ctx, cudaFree(p), "cuda backend: free");
}

/* A copy on the stream, finished when it returns; a failure is recorded for sync. */
static void copy_recorded(cuda_ctx *c, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                          const char *what)
{
    if (!bytes)
        return;
    record_cuda(c, cudaMemcpyAsync(dst, src, bytes, kind, c->stream), what);
    record_cuda(c, cudaStreamSynchronize(c->stream), what);
}

static void cuda_upload(void *ctx, void *dst, const void *src_host, size_t bytes)
{
    copy_recorded((cuda_ctx *)ctx, dst, src_host, bytes, cudaMemcpyHostToDevice, "cuda backend: upload");
}

static void cuda_download(void *ctx, void *dst_host, const void *src, size_t bytes)
{
    copy_recorded((cuda_ctx *)ctx, dst_host, src, bytes, cudaMemcpyDeviceToHost, "cuda backend: download");
}

/* Grows one scratch buffer to at least `bytes`. Never while capturing: the capture then
 * fails and the step runs again unrecorded (which grows it). Growth of a buffer that recorded
 * steps use (in_graphs) drops every graph, since they hold the old pointer. */
static bool grow(cuda_ctx *c, void **buf, size_t *have, size_t bytes, const char *what,
                 bool in_graphs)
{
    if (bytes <= *have)
        return true;
    if (c->mode == STEP_CAPTURE) {
        kvf_err e = {};
        record(c, kvf_err_set(&e, KVF_ERR_STATE, "cuda backend: %s scratch must grow to %zu bytes during a graph capture", what, bytes), &e);
        return false;
    }
    if (in_graphs)
        graphs_drop_all(c);
    record_cuda(c, cudaStreamSynchronize(c->stream), "cuda backend: grow scratch");
    cudaFree(*buf);
    *buf = NULL;
    *have = 0;
    size_t n = bytes + bytes / 4; /* some headroom: fewer regrowths as batches vary */
    cudaError_t e = cudaMalloc(buf, n);
    if (e != cudaSuccess) {
        *buf = NULL;
        record_cuda(c, e, what);
        return false;
    }
    *have = n;
    return true;
}

/* ---- the KV pool in device memory (kv/pool.h mem ops, ctx = the backend ctx) */

static kvf_status mem_alloc(void *ctx, int64_t bytes, void **base_out, kvf_err *err)
{
    if (bytes <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda backend: KV pool of %lld bytes", (long long)bytes);
    kvf_status st = cuda_alloc(ctx, (size_t)bytes, base_out, err);
    if (st != KVF_OK)
        return kvf_err_prefix(err, "cuda backend: KV pool");
    return KVF_OK;
}

static void mem_free(void *ctx, void *base, int64_t bytes)
{
    graphs_drop_all((cuda_ctx *)ctx); /* they hold the pool's address */
    cuda_free(ctx, base);
}

static kvf_status mem_copy(cuda_ctx *c, void *dst, const void *src, size_t bytes,
                           cudaMemcpyKind kind, const char *what, kvf_err *err)
{
    kvf_status st = kvf_cuda_status(cudaMemcpyAsync(dst, src, bytes, kind, c->stream), what, err);
    if (st != KVF_OK)
        return st;
    return kvf_cuda_status(cudaStreamSynchronize(c->stream), what, err);
}

static kvf_status mem_copy_block(void *ctx, void *base, int64_t block_bytes, int32_t dst,
                                 int32_t src, kvf_err *err)
{
    uint8_t *b = (uint8_t *)base;
    return mem_copy((cuda_ctx *)ctx, b + (int64_t)dst * block_bytes, b + (int64_t)src * block_bytes,
                    (size_t)block_bytes, cudaMemcpyDeviceToDevice, "cuda backend: copy block", err);
}

static kvf_status mem_to_host(void *ctx, void *host_dst, const void *base, int64_t block_bytes,
                              int32_t block, kvf_err *err)
{
    return mem_copy((cuda_ctx *)ctx, host_dst, (const uint8_t *)base + (int64_t)block * block_bytes,
                    (size_t)block_bytes, cudaMemcpyDeviceToHost, "cuda backend: block to host", err);
}

static kvf_status mem_from_host(void *ctx, void *base, int64_t block_bytes, int32_t block,
                                const void *host_src, kvf_err *err)
{
    return mem_copy((cuda_ctx *)ctx, (uint8_t *)base + (int64_t)block * block_bytes, host_src,
                    (size_t)block_bytes, cudaMemcpyHostToDevice, "cuda backend: block from host", err);
}

static const kvf_kv_mem_ops cuda_kv_mem_ops = {
    .name = "cuda",
    .alloc = mem_alloc,
    .free = mem_free,
    .copy_block = mem_copy_block,
    .to_host = mem_to_host,
    .from_host = mem_from_host,
};

static const kvf_kv_mem_ops *cuda_kv_mem(void *ctx)
{
    return &cuda_kv_mem_ops;
}

/* ---- weights: uploaded once; 2-D as bf16/f16 (or f32 when asked), 1-D as f32 */

static kvf_dtype matrix_target(const cuda_ctx *c, kvf_dtype file)
{
    switch (c->matrix_dtype) {
    case KVF_BACKEND_MATRIX_BF16: return KVF_DTYPE_BF16;
    case KVF_BACKEND_MATRIX_F16: return KVF_DTYPE_F16;
    case KVF_BACKEND_MATRIX_F32: return KVF_DTYPE_F32;
    default: return file == KVF_DTYPE_F32 ? KVF_DTYPE_BF16 : file;
    }
}

static kvf_status cuda_weight_load(void *ctx, const kvf_model_tensor *t, kvf_backend_weight *out,
                                   kvf_err *err)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (t->dtype != KVF_DTYPE_F32 && t->dtype != KVF_DTYPE_F16 && t->dtype != KVF_DTYPE_BF16)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "cuda backend: tensor \"%s\" is %s (use F32, F16 or BF16)",
                           t->name, t->dtype_name);
    if (t->n_dims < 1 || t->n_dims > 2)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda backend: tensor \"%s\" has %d dimensions (1 or 2 expected)",
                           t->name, t->n_dims);
    kvf_dtype src = (kvf_dtype)t->dtype;
    kvf_dtype dst = t->n_dims == 2 ? matrix_target(c, src) : KVF_DTYPE_F32;
    kvf_backend_weight w = {};
    w.rows = t->n_dims == 2 ? t->shape[0] : 1;
    w.cols = t->n_dims == 2 ? t->shape[1] : t->shape[0];
    w.dtype = dst;
    size_t n = (size_t)t->n_elems, dst_bytes = n * kvf_dtype_size(dst);
    void *d = NULL, *tmp = NULL;
    kvf_status st = cuda_alloc(c, dst_bytes, &d, err);
    if (st != KVF_OK)
        return kvf_err_prefix(err, "cuda backend: tensor \"%s\"", t->name);
    if (src == dst) {
        st = mem_copy(c, d, t->data, dst_bytes, cudaMemcpyHostToDevice, "cuda backend: upload weight", err);
    } else {
        kvf_cuda_convert_params cp = {};
        if ((st = cuda_alloc(c, (size_t)t->n_bytes, &tmp, err)) != KVF_OK ||
            (st = mem_copy(c, tmp, t->data, (size_t)t->n_bytes, cudaMemcpyHostToDevice,
                           "cuda backend: upload weight", err)) != KVF_OK)
            goto fail;
        cp.src = tmp;
        cp.src_dtype = src;
        cp.dst = d;
        cp.dst_dtype = dst;
        cp.n = (int64_t)n;
        if ((st = kvf_cuda_convert(&cp, c->stream, err)) != KVF_OK ||
            (st = kvf_cuda_status(cudaStreamSynchronize(c->stream), "cuda backend: convert weight", err)) != KVF_OK)
            goto fail;
        cudaFree(tmp);
        tmp = NULL;
    }
    if (st != KVF_OK)
        goto fail;
    w.data = w.owned = d;
    *out = w;
    return KVF_OK;
fail:
    if (tmp)
        cudaFree(tmp);
    cudaFree(d);
    return kvf_err_prefix(err, "cuda backend: tensor \"%s\"", t->name);
}

static void cuda_weight_unload(void *ctx, kvf_backend_weight *w)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (w->owned) {
        graphs_drop_all(c); /* recorded steps read the weight */
        record_cuda(c, cudaFree(w->owned), "cuda backend: free weight");
    }
    memset(w, 0, sizeof *w);
}

/* ---- ops: each fills its params, launches and records a failure */

#define LAUNCH(c, call)                                                                        \
    do {                                                                                       \
        kvf_err e_ = {};                                                                       \
        record((c), (call), &e_);                                                              \
    } while (0)

static void cuda_embed(void *ctx, const kvf_backend_weight *emb, const int32_t *tokens, int64_t n,
                       float *out)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    kvf_cuda_embed_params p = {};
    p.table = emb->data;
    p.dtype = emb->dtype;
    p.n_rows = emb->rows;
    p.cols = emb->cols;
    p.tokens = tokens;
    p.n = n;
    p.out = out;
    LAUNCH(c, kvf_cuda_embed(&p, c->stream, &e_));
}

static cudaDataType_t blas_type(kvf_dtype d)
{
    return d == KVF_DTYPE_BF16 ? CUDA_R_16BF : d == KVF_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* x[n][cols] as the GEMM's input for weights of dtype dt: x itself for f32 weights, else x
 * converted into c->conv; NULL after recording a failure. */
static const void *matmul_input(cuda_ctx *c, const float *x, int64_t n, int64_t cols, kvf_dtype dt)
{
    if (dt == KVF_DTYPE_F32)
        return x;
    size_t need = (size_t)n * (size_t)cols * kvf_dtype_size(dt);
    if (!grow(c, &c->conv, &c->conv_bytes, need, "cuda backend: matmul conversion", true))
        return NULL;
    kvf_cuda_convert_params cp = {};
    cp.src = x;
    cp.src_dtype = KVF_DTYPE_F32;
    cp.dst = c->conv;
    cp.dst_dtype = dt;
    cp.n = n * cols;
    kvf_err e = {};
    kvf_status st = kvf_cuda_convert(&cp, c->stream, &e);
    if (st != KVF_OK) {
        record(c, st, &e);
        return NULL;
    }
    return c->conv;
}

/* y[n][rows] = b[n][cols] @ W^T (+ bias), b already in W's dtype (matmul_input). Row-major
 * W[rows][cols] is column-major W^T, so cuBLAS computes Y^T (rows x n) = op_T(W as cols x rows)
 * * B^T (cols x n), f32 accumulate. */
static void matmul_gemm(cuda_ctx *c, const void *b, int64_t n, const kvf_backend_weight *w,
                        const kvf_backend_weight *bias, float *y)
{
    const float alpha = 1.0f, beta = 0.0f;
    cudaDataType_t t = blas_type(w->dtype);
    cublasStatus_t s = cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, (int)n,
                                    (int)w->cols, &alpha, w->data, t, (int)w->cols, b, t,
                                    (int)w->cols, &beta, y, CUDA_R_32F, (int)w->rows,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        kvf_err e = {};
        record(c, kvf_cuda_blas_status((int)s, "cuda backend: matmul", &e), &e);
        return;
    }
    if (bias) {
        kvf_cuda_bias_params bp = {};
        bp.y = y;
        bp.bias = (const float *)bias->data;
        bp.n = n;
        bp.rows = w->rows;
        LAUNCH(c, kvf_cuda_bias_add(&bp, c->stream, &e_));
    }
}

/* Several weights on one x: x converted to their dtype once per run of weights that share a
 * dtype and width (in a model: all of them), then a GEMM each. */
static void cuda_matmul_multi(void *ctx, const float *x, int64_t n, int32_t count,
                              const kvf_backend_weight *const *w,
                              const kvf_backend_weight *const *bias, float *const *y)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (n <= 0)
        return;
    const void *b = NULL;
    for (int32_t i = 0; i < count; i++) {
        if (n > 0x7fffffff || w[i]->rows > 0x7fffffff || w[i]->cols > 0x7fffffff) {
            record_msg(c, KVF_ERR_INVALID, "cuda backend: matmul: a dimension exceeds 2^31-1");
            return;
        }
        if (i == 0 || w[i]->dtype != w[i - 1]->dtype || w[i]->cols != w[i - 1]->cols)
            b = matmul_input(c, x, n, w[i]->cols, w[i]->dtype);
        if (!b)
            return;
        matmul_gemm(c, b, n, w[i], bias[i], y[i]);
    }
}

/* y[n][rows] = x[n][cols] @ W^T: x converted to W's dtype when W is half precision. */
static void cuda_matmul(void *ctx, const float *x, int64_t n, const kvf_backend_weight *w,
                        const kvf_backend_weight *bias, float *y)
{
    cuda_matmul_multi(ctx, x, n, 1, &w, &bias, &y);
}

static void cuda_rmsnorm(void *ctx, const float *x, int64_t n, const kvf_backend_weight *w,
                         float eps, float *out)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    kvf_cuda_rmsnorm_params p = {};
    p.x = x;
    p.w = (const float *)w->data;
    p.n = n;
    p.d = w->cols;
    p.eps = eps;
    p.out = out;
    LAUNCH(c, kvf_cuda_rmsnorm(&p, c->stream, &e_));
}

static void cuda_rope(void *ctx, float *x, int64_t n, int32_t n_heads, int32_t head_dim,
                      const float *cos_sin)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    kvf_cuda_rope_params p = {};
    p.x = x;
    p.n = n;
    p.n_heads = n_heads;
    p.head_dim = head_dim;
    p.cos_sin = cos_sin;
    LAUNCH(c, kvf_cuda_rope(&p, c->stream, &e_));
}

static void eltwise(cuda_ctx *c, kvf_cuda_eltwise_op op, const float *a, const float *b,
                    int64_t n, float *out)
{
    kvf_cuda_eltwise_params p = {};
    p.op = op;
    p.a = a;
    p.b = b;
    p.out = out;
    p.n = n;
    LAUNCH(c, kvf_cuda_eltwise(&p, c->stream, &e_));
}

static void cuda_swiglu(void *ctx, const float *gate, const float *up, int64_t n, float *out)
{
    eltwise((cuda_ctx *)ctx, KVF_CUDA_SWIGLU, gate, up, n, out);
}

static void cuda_add(void *ctx, float *x, const float *y, int64_t n)
{
    eltwise((cuda_ctx *)ctx, KVF_CUDA_ADD, x, y, n, x);
}

static void cuda_gather(void *ctx, const float *x, int64_t row_len, const int32_t *rows, int64_t n,
                        float *out)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    kvf_cuda_gather_params p = {};
    p.x = x;
    p.row_len = row_len;
    p.rows = rows;
    p.n = n;
    p.out = out;
    LAUNCH(c, kvf_cuda_gather(&p, c->stream, &e_));
}

static void cuda_kv_write(void *ctx, void *pool, const kvf_kv_layout *layout, int32_t layer,
                          const float *k, const float *v, const int64_t *slots, int64_t n)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    kvf_cuda_kv_write_params p = {};
    p.pool = pool;
    p.layout = *layout;
    p.layer = layer;
    p.k = k;
    p.v = v;
    p.slots = slots;
    p.n = n;
    p.k_scale = c->k_scale;
    p.v_scale = c->v_scale;
    LAUNCH(c, kvf_cuda_kv_write(&p, c->stream, &e_));
}

static void cuda_attention(void *ctx, const float *q, const void *pool, const kvf_kv_layout *layout,
                           int32_t layer, const kvf_backend_attn *a, float *out)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (a->n_tokens <= 0)
        return;
    if (a->max_ctx <= 0) {
        record_msg(c, KVF_ERR_INVALID, "cuda backend: attention needs max_ctx (a bound on every tok_pos + 1), got 0");
        return;
    }
    size_t ws = kvf_cuda_attention_workspace_bytes(a->n_tokens, a->n_seqs, a->n_heads, a->head_dim,
                                                   a->max_ctx);
    if (ws && !grow(c, &c->attn_ws, &c->attn_ws_bytes, ws, "cuda backend: attention workspace", true))
        return;
    kvf_cuda_attn_params p = {};
    p.q = q;
    p.out = out;
    p.pool = pool;
    p.layout = *layout;
    p.layer = layer;
    p.n_tokens = a->n_tokens;
    p.n_heads = a->n_heads;
    p.n_seqs = a->n_seqs;
    p.tok_seq = a->tok_seq;
    p.tok_pos = a->tok_pos;
    p.block_tables = a->block_tables;
    p.max_blocks = a->max_blocks;
    p.decode_kernel = c->attn_decode;
    p.max_ctx = a->max_ctx;
    p.window = a->window;
    p.scale = a->scale;
    p.k_scale = layout->dtype == KVF_DTYPE_FP8_E4M3 ? c->k_scale : 1.0f;
    p.v_scale = layout->dtype == KVF_DTYPE_FP8_E4M3 ? c->v_scale : 1.0f;
    p.workspace = (float *)c->attn_ws;
    p.workspace_bytes = c->attn_ws_bytes;
    LAUNCH(c, kvf_cuda_attention(&p, c->stream, &e_));
}

static void cuda_argmax(void *ctx, const float *logits, int64_t n, int64_t vocab, int32_t *out_host)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (n <= 0)
        return;
    if (!grow(c, (void **)&c->small, &c->small_bytes, (size_t)n * sizeof(int32_t), "cuda backend: argmax", false))
        return;
    kvf_cuda_argmax_params p = {};
    p.logits = logits;
    p.n = n;
    p.vocab = vocab;
    p.out = c->small;
    kvf_err e = {};
    kvf_status st = kvf_cuda_argmax(&p, c->stream, &e);
    if (st != KVF_OK) {
        record(c, st, &e);
        memset(out_host, 0, (size_t)n * sizeof *out_host);
        return;
    }
    cuda_download(c, out_host, c->small, (size_t)n * sizeof(int32_t));
}

/* ---- sync, support checks, step recording */

static kvf_status cuda_sync(void *ctx, kvf_err *err)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    record_cuda(c, cudaStreamSynchronize(c->stream), "cuda backend: step");
    if (!c->failed)
        return KVF_OK;
    c->failed = false;
    kvf_status st = c->first.status;
    if (err)
        *err = c->first;
    memset(&c->first, 0, sizeof c->first);
    return st;
}

/* RoPE needs an even head_dim; RMSNorm and kv_write take any. Attention's lists (head_dim 16,
 * 32, 48, 64, 80, 96, 128, 256; block sizes; dtypes) are kvf_cuda_attention_supports'. */
static kvf_status cuda_supports(void *ctx, const kvf_kv_layout *layout, int32_t n_heads, kvf_err *err)
{
    if (layout->head_dim % 2)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "cuda backend: head_dim %d is odd (RoPE needs an even head_dim)",
                           layout->head_dim);
    return kvf_cuda_attention_supports(layout, n_heads, err);
}

static kvf_status cuda_step_begin(void *ctx, const kvf_backend_step_key *key, bool *replay_out,
                                  kvf_err *err)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    int32_t slot = -1;
    kvf_cuda_step_plan plan = kvf_cuda_graph_plan(&c->graphs, key, !c->no_graphs && !c->failed, &slot);
    c->step_key = *key;
    c->replay_idx = slot;
    *replay_out = plan == KVF_CUDA_STEP_REPLAY;
    c->mode = plan == KVF_CUDA_STEP_REPLAY ? STEP_REPLAY : STEP_EAGER;
    if (plan != KVF_CUDA_STEP_CAPTURE)
        return KVF_OK;
    cudaError_t e = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        c->stats.graph_failures++;
        kvf_log(KVF_LOG_WARN, "cuda backend: graph capture not started: %s", cudaGetErrorString(e));
        return KVF_OK;
    }
    c->mode = STEP_CAPTURE;
    return KVF_OK;
}

static kvf_status cuda_step_end(void *ctx, bool *rerun_out, kvf_err *err)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    cuda_step_mode mode = c->mode;
    c->mode = STEP_NONE;
    *rerun_out = false;
    if (mode == STEP_EAGER) {
        c->stats.eager_steps++;
        return KVF_OK;
    }
    if (mode == STEP_REPLAY) {
        c->stats.graph_replays++;
        return kvf_cuda_status(cudaGraphLaunch((cudaGraphExec_t)c->graphs.exec[c->replay_idx], c->stream),
                               "cuda backend: graph replay", err);
    }
    if (mode != STEP_CAPTURE)
        return KVF_OK;
    /* capture: end it, and on any failure give up graphs for this context and rerun eagerly */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    bool ok = e == cudaSuccess && graph && !c->failed;
    if (ok) {
        e = cudaGraphInstantiate(&exec, graph, 0);
        ok = e == cudaSuccess;
    }
    if (graph)
        cudaGraphDestroy(graph);
    if (!ok) {
        c->stats.graph_failures++;
        kvf_log(KVF_LOG_WARN, "cuda backend: decode step not recorded (%s%s%s); graphs off for this context",
                e != cudaSuccess ? cudaGetErrorString(e) : "", e != cudaSuccess && c->failed ? "; " : "",
                c->failed ? c->first.msg : "");
        (void)cudaGetLastError();
        c->failed = false; /* the capture's error is not the step's: the rerun decides */
        memset(&c->first, 0, sizeof c->first);
        c->no_graphs = true;
        c->stats.eager_steps++;
        *rerun_out = true;
        return KVF_OK;
    }
    c->stats.graphs_captured++;
    int32_t slot = -1;
    void *old = kvf_cuda_graph_store(&c->graphs, &c->step_key, exec, &slot);
    if (old) {
        cudaGraphExecDestroy((cudaGraphExec_t)old);
        c->stats.graph_evictions++;
    }
    c->stats.graphs_cached = c->graphs.n;
    c->stats.graph_replays++;
    return kvf_cuda_status(cudaGraphLaunch(exec, c->stream), "cuda backend: graph launch", err);
}

/* ---- extras reachable from C */

extern "C" void kvf_cuda_backend_stats(void *be_ctx, kvf_cuda_stats *out)
{
    cuda_ctx *c = (cuda_ctx *)be_ctx;
    *out = c->stats;
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
        out->device_bytes = (int64_t)(total_b - free_b);
    (void)cudaGetLastError();
}

extern "C" kvf_status kvf_cuda_sample(void *be_ctx, const float *logits, int64_t n, int64_t vocab,
                                      const kvf_cuda_sample_row *rows_host, int32_t *out_host,
                                      kvf_err *err)
{
    cuda_ctx *c = (cuda_ctx *)be_ctx;
    if (n <= 0 || n > (1 << 20))
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: sample: %lld rows (1 to %d)", (long long)n, 1 << 20);
    for (int64_t i = 0; i < n; i++) {
        const kvf_cuda_sample_row *r = &rows_host[i];
        if (!(r->temperature > 0.0f) || !(r->top_p > 0.0f && r->top_p <= 1.0f) ||
            !(r->u >= 0.0f && r->u < 1.0f) || r->top_k < 0)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "cuda: sample: row %lld: temperature %g (> 0), top_k %d (>= 0), top_p %g (0 < p <= 1), u %g (0 <= u < 1)",
                               (long long)i, (double)r->temperature, r->top_k, (double)r->top_p, (double)r->u);
    }
    /* rows with a mask (constrained decoding): each mask is copied beside the rows and the
     * rows the kernel reads point at the copies */
    int64_t words = (vocab + 31) / 32, n_masked = 0;
    for (int64_t i = 0; i < n; i++)
        n_masked += rows_host[i].mask != NULL;
    size_t out_b = ((size_t)n * sizeof(int32_t) + 15) / 16 * 16;
    size_t rows_b = ((size_t)n * sizeof(kvf_cuda_sample_row) + 15) / 16 * 16;
    size_t need = out_b + rows_b + (size_t)n_masked * (size_t)words * sizeof(uint32_t);
    if (!grow(c, (void **)&c->small, &c->small_bytes, need, "cuda: sample", false))
        return cuda_sync(c, err);
    kvf_cuda_sample_row *d_rows = (kvf_cuda_sample_row *)((uint8_t *)c->small + out_b);
    uint32_t *d_masks = (uint32_t *)((uint8_t *)c->small + out_b + rows_b);
    const kvf_cuda_sample_row *send = rows_host;
    kvf_status st;
    if (n_masked > 0) {
        size_t mask_words = (size_t)n_masked * (size_t)words;
        if (c->h_rows_cap < n) {
            kvf_cuda_sample_row *h = (kvf_cuda_sample_row *)realloc(c->h_rows, (size_t)n * sizeof *h);
            if (!h)
                return kvf_err_set(err, KVF_ERR_NOMEM, "cuda: sample: no host memory for %lld rows", (long long)n);
            c->h_rows = h;
            c->h_rows_cap = n;
        }
        if (c->h_masks_cap < mask_words) {
            uint32_t *h = (uint32_t *)realloc(c->h_masks, mask_words * sizeof *h);
            if (!h)
                return kvf_err_set(err, KVF_ERR_NOMEM, "cuda: sample: no host memory for %lld masks", (long long)n_masked);
            c->h_masks = h;
            c->h_masks_cap = mask_words;
        }
        for (int64_t i = 0, k = 0; i < n; i++) {
            c->h_rows[i] = rows_host[i];
            if (!rows_host[i].mask)
                continue;
            memcpy(c->h_masks + (size_t)k * (size_t)words, rows_host[i].mask, (size_t)words * sizeof(uint32_t));
            c->h_rows[i].mask = d_masks + k++ * words;
        }
        if ((st = mem_copy(c, d_masks, c->h_masks, mask_words * sizeof(uint32_t), cudaMemcpyHostToDevice,
                           "cuda: sample masks", err)) != KVF_OK)
            return st;
        send = c->h_rows;
    }
    st = mem_copy(c, d_rows, send, (size_t)n * sizeof *rows_host, cudaMemcpyHostToDevice,
                  "cuda: sample rows", err);
    if (st != KVF_OK)
        return st;
    kvf_cuda_sample_params p = {};
    p.logits = logits;
    p.n = n;
    p.vocab = vocab;
    p.rows = d_rows;
    p.out = c->small;
    if ((st = kvf_cuda_sample_launch(&p, c->stream, err)) != KVF_OK)
        return st;
    return mem_copy(c, out_host, c->small, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost,
                    "cuda: sample", err);
}

/* ---- step profiles: an event per mark, recorded on the stream */

static void cuda_prof_mark(void *ctx, int32_t i)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (i < 0 || c->mode == STEP_CAPTURE) {
        record_msg(c, KVF_ERR_INVALID, "cuda backend: profile mark outside an unrecorded step");
        return;
    }
    if (i >= c->n_prof_ev) {
        int32_t n = i + 1 > 2 * c->n_prof_ev ? i + 1 : 2 * c->n_prof_ev;
        cudaEvent_t *ev = (cudaEvent_t *)realloc(c->prof_ev, (size_t)n * sizeof *ev);
        if (!ev) {
            record_msg(c, KVF_ERR_NOMEM, "cuda backend: out of memory for profile marks");
            return;
        }
        c->prof_ev = ev;
        for (; c->n_prof_ev < n; c->n_prof_ev++) {
            cudaError_t e = cudaEventCreate(&c->prof_ev[c->n_prof_ev]);
            if (e != cudaSuccess) {
                record_cuda(c, e, "cuda backend: profile mark event");
                return;
            }
        }
    }
    record_cuda(c, cudaEventRecord(c->prof_ev[i], c->stream), "cuda backend: profile mark");
}

static kvf_status cuda_prof_read(void *ctx, int32_t n, double *ms_out, kvf_err *err)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (n > c->n_prof_ev)
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda backend: %d profile marks asked, %d made", n,
                           c->n_prof_ev);
    for (int32_t i = 0; i + 1 < n; i++) {
        float ms = 0;
        cudaError_t e = cudaEventElapsedTime(&ms, c->prof_ev[i], c->prof_ev[i + 1]);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return kvf_cuda_status((int)e, "cuda backend: profile mark times", err);
        }
        ms_out[i] = ms;
    }
    return KVF_OK;
}

static const kvf_backend kvf_cuda_backend_ops = {
    .name = "cuda",
    .create = cuda_create,
    .destroy = cuda_destroy,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .weight_load = cuda_weight_load,
    .weight_unload = cuda_weight_unload,
    .embed = cuda_embed,
    .matmul = cuda_matmul,
    .rmsnorm = cuda_rmsnorm,
    .rope = cuda_rope,
    .swiglu = cuda_swiglu,
    .add = cuda_add,
    .gather = cuda_gather,
    .kv_write = cuda_kv_write,
    .attention = cuda_attention,
    .argmax = cuda_argmax,
    .kv_mem = cuda_kv_mem,
    .supports = cuda_supports,
    .sync = cuda_sync,
    .step_begin = cuda_step_begin,
    .step_end = cuda_step_end,
    .sample = kvf_cuda_sample,
    .matmul_multi = cuda_matmul_multi,
    .prof_mark = cuda_prof_mark,
    .prof_read = cuda_prof_read,
};

extern "C" const kvf_backend *kvf_cuda_backend(void)
{
    return &kvf_cuda_backend_ops;
}
