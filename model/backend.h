/* backend.h: the compute backend behind the forward pass (DESIGN.md s.2), CPU (cpu_backend.c) or
 * CUDA (cuda/backend.cu): its plain types, an opaque kvf_backend and one wrapper per op (backend.c,
 * which holds the optional ops' defaults; the op table is backend_impl.h's). Plain C. */
#ifndef KVF_MODEL_BACKEND_H
#define KVF_MODEL_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kv/layout.h"
#include "kv/pool.h"
#include "model/safetensors.h"

/* Pointers named "backend memory" below come from the backend's alloc (host memory on CPU,
 * device memory on a GPU); every float buffer the ops take is backend memory. */

/* A weight in the backend's compute form (the CPU backend: f32, row-major). */
typedef struct kvf_backend_weight {
    const void *data;   /* backend memory, [rows][cols] */
    int64_t rows, cols; /* a 1-D tensor has rows 1 */
    kvf_dtype dtype;    /* of data: f32, or f16/bf16 for matrices only (matmul, embed) */
    void *owned;        /* what weight_unload releases; NULL when data is borrowed from the file */
    /* CPU q8 (KVF_BACKEND_WEIGHT_Q8, matrices only): non-NULL means data is int8
     * [rows][blocks * 32] and these are its f32 block scales [rows][blocks] (model/cpu_kernels.h
     * says the format); dtype is then meaningless. NULL for every other weight. */
    const float *q8_scales;
} kvf_backend_weight;

/* What attention needs about one step's tokens. Arrays are backend memory. */
typedef struct kvf_backend_attn {
    int32_t n_tokens;
    int32_t n_seqs; /* sequences in the step; 0 = not known. A GPU picks kernels by it (n_tokens >
                     * n_seqs: prefill chunks, tiled); the answer never depends on it */
    int32_t n_heads, n_kv_heads, head_dim;
    const int32_t *tok_seq; /* [n_tokens]: the row of block_tables holding the token's sequence */
    const int32_t *tok_pos; /* [n_tokens]: its position; it attends to positions <= it */
    const int32_t *block_tables; /* [n_seqs][max_blocks] block ids */
    int32_t max_blocks;          /* row stride of block_tables */
    int32_t window;              /* attend to the last `window` positions only; 0 = all */
    float scale;                 /* 1/sqrt(head_dim) */
    int32_t max_ctx;             /* >= tok_pos[t] + 1 for every token: a bucket (power of two,
                                  * capped by the forward pass's max_ctx) so a GPU launches the
                                  * same grid for steps of one shape; CPU ignores it */
} kvf_backend_attn;

typedef struct kvf_backend_opts {
    int32_t n_threads; /* 0: one per online CPU */
    /* CPU: keep F16/BF16 matrices as they are in the file (half the memory, no conversion at
     * load) and convert a few rows at a time inside matmul; false converts them to f32 once. */
    bool half_weights;
    /* fp8-e4m3 KV per-tensor scales: stored = fp8(value / scale), read = fp8_to_f32(byte) *
     * scale. 0 means 1. Other KV dtypes ignore them. */
    float kv_k_scale, kv_v_scale;
    /* GPU: the dtype 2-D weights are kept in on the device. AUTO: F16/BF16 files as stored,
     * F32 files converted to bf16. CPU ignores it (see half_weights). */
    int32_t matrix_dtype; /* KVF_BACKEND_MATRIX_* */
    bool no_graphs;       /* GPU: never capture decode steps as CUDA graphs */
    int32_t attn_decode;  /* GPU: the kernel decode tokens' attention runs on,
                           * KVF_BACKEND_ATTN_DECODE_*; CPU ignores it */
    /* KVF_BACKEND_WEIGHT_*: F32 (0, the default) keeps matrices as half_weights says; Q8
     * quantizes every 2-D weight at load to int8 blocks (CPU only: kvf_backend_create refuses
     * it, naming --weight-dtype, for a backend without q8 kernels; not with half_weights). */
    int32_t weight_dtype;
} kvf_backend_opts;

/* How matrices are held (--weight-dtype). */
#define KVF_BACKEND_WEIGHT_F32 0 /* f32 (or as stored, with half_weights) */
#define KVF_BACKEND_WEIGHT_Q8 1  /* int8 blocks of 32 with an f32 scale each, from any file dtype */
#define KVF_BACKEND_WEIGHT_COUNT 2

/* "f32", "q8" for a KVF_BACKEND_WEIGHT_* value ("?" for anything else), and back from the
 * string s (-1 for anything else, NULL included). */
static inline const char *kvf_backend_weight_dtype_name(int32_t k)
{
    static const char *const names[KVF_BACKEND_WEIGHT_COUNT] = {"f32", "q8"};
    return k >= 0 && k < KVF_BACKEND_WEIGHT_COUNT ? names[k] : "?";
}

static inline int kvf_backend_weight_dtype_parse(const char *s)
{
    for (int k = 0; s && k < KVF_BACKEND_WEIGHT_COUNT; k++)
        if (strcmp(s, kvf_backend_weight_dtype_name(k)) == 0)
            return k;
    return -1;
}

/* Which kernel serves decode tokens on a GPU (every token of a decode-only step, the tokens
 * alone in their sequence of a step with prefill chunks). */
#define KVF_BACKEND_ATTN_DECODE_AUTO 0 /* the default: the backend's choice (cuda: SIMT until
                                        * the tensor-core kernel is measured faster on a GPU;
                                        * KVF_CUDA_ATTN_AUTO_MMA in cuda/attn_ref.h) */
#define KVF_BACKEND_ATTN_DECODE_SIMT 1 /* per-element FMAs and shuffle trees: every shape */
#define KVF_BACKEND_ATTN_DECODE_MMA 2  /* mma.sync on the tensor cores where it serves (f16,
                                        * bf16 or fp8-e4m3 KV at head_dim 64 or 128), else the
                                        * SIMT kernel */
#define KVF_BACKEND_ATTN_DECODE_COUNT 3

/* "auto", "simt", "mma" for a KVF_BACKEND_ATTN_DECODE_* value ("?" for anything else), and
 * back from the len bytes at s (-1 for anything else). */
static inline const char *kvf_backend_attn_decode_name(int32_t k)
{
    static const char *const names[KVF_BACKEND_ATTN_DECODE_COUNT] = {"auto", "simt", "mma"};
    return k >= 0 && k < KVF_BACKEND_ATTN_DECODE_COUNT ? names[k] : "?";
}

static inline int kvf_backend_attn_decode_parse(const char *s, size_t len)
{
    for (int k = 0; s && k < KVF_BACKEND_ATTN_DECODE_COUNT; k++)
        if (strlen(kvf_backend_attn_decode_name(k)) == len &&
            strncmp(s, kvf_backend_attn_decode_name(k), len) == 0)
            return k;
    return -1;
}

#define KVF_BACKEND_MATRIX_AUTO 0
#define KVF_BACKEND_MATRIX_BF16 1
#define KVF_BACKEND_MATRIX_F16 2
#define KVF_BACKEND_MATRIX_F32 3

/* The shape of one forward step, for step_begin: steps with equal keys launch identical kernel
 * sequences (same grid sizes, same buffers), so a backend may record one and replay it. */
typedef struct kvf_backend_step_key {
    int32_t n_tokens, n_seqs; /* this step */
    int32_t ctx_bucket;       /* kvf_backend_attn.max_ctx of the step */
    bool decode_only;         /* every sequence brings one token */
    const void *kv_pool;      /* the pool base the step reads and writes */
} kvf_backend_step_key;

/* One sequence's draw for kvf_backend_sample: temperature > 0, top_k >= 0 (0: all), top_p
 * in (0, 1] (1: all), u in [0, 1) from the caller's generator. mask (constrained decoding):
 * NULL, or a host bitset of (vocab + 31) / 32 words, bit id % 32 of word id / 32 set for the ids
 * the draw may take; the others count as absent (as NaN logits do), so top_k 1 with u 0 is the
 * argmax among the allowed ids. The backend copies it before kvf_backend_sample returns. */
typedef struct kvf_backend_sample_row {
    float temperature;
    int32_t top_k;
    float top_p;
    float u;
    const uint32_t *mask;
} kvf_backend_sample_row;

/* A backend: a const table of ops (backend_impl.h), one per implementation, never freed. Its
 * state lives in a context (ctx below) that kvf_backend_create makes and kvf_backend_destroy
 * releases; every other call takes both. */
typedef struct kvf_backend kvf_backend;

/* "cpu", "cuda", or a test double's name. */
const char *kvf_backend_name(const kvf_backend *be);
/* Makes a context; *ctx_out is the caller's until kvf_backend_destroy, which takes NULL too. */
kvf_status kvf_backend_create(const kvf_backend *be, const kvf_backend_opts *opts, void **ctx_out,
                              kvf_err *err);
void kvf_backend_destroy(const kvf_backend *be, void *ctx);

/* Backend memory: alloc'd buffers are zeroed and the caller's until kvf_backend_free;
 * upload/download copy between host and backend and have finished when they return. */
kvf_status kvf_backend_alloc(const kvf_backend *be, void *ctx, size_t bytes, void **out,
                             kvf_err *err);
void kvf_backend_free(const kvf_backend *be, void *ctx, void *p);
void kvf_backend_upload(const kvf_backend *be, void *ctx, void *dst, const void *src_host,
                        size_t bytes);
void kvf_backend_download(const kvf_backend *be, void *ctx, void *dst_host, const void *src,
                          size_t bytes);

/* Makes a file tensor (F32/F16/BF16, 1-D or 2-D) usable by the ops below; *out is the
 * caller's until kvf_backend_weight_unload. */
kvf_status kvf_backend_weight_load(const kvf_backend *be, void *ctx, const kvf_model_tensor *t,
                                   kvf_backend_weight *out, kvf_err *err);
void kvf_backend_weight_unload(const kvf_backend *be, void *ctx, kvf_backend_weight *w);

/* ---- the ops of a step. They return nothing: a backend that can fail (a GPU) records the
 * first failure, and kvf_backend_sync returns it. */

/* out[i] = emb[tokens[i]] (rows of emb). */
void kvf_backend_embed(const kvf_backend *be, void *ctx, const kvf_backend_weight *emb,
                       const int32_t *tokens /* [n] */, int64_t n,
                       float *out /* [n][emb->cols] */);
/* y = x @ W^T (+ bias): y[n][w->rows] from x[n][w->cols]. bias may be NULL. */
void kvf_backend_matmul(const kvf_backend *be, void *ctx, const float *x, int64_t n,
                        const kvf_backend_weight *w, const kvf_backend_weight *bias, float *y);
/* y[i] = x @ w[i]^T (+ bias[i], which may be NULL) for i < count: the same as count
 * kvf_backend_matmul calls, bit for bit, with the work on x shared where the backend can (a
 * GPU converts x to the weights' dtype once instead of count times); no y[i] overlaps x. The
 * forward pass uses it for q/k/v and for gate/up. Default: count matmul calls. */
void kvf_backend_matmul_multi(const kvf_backend *be, void *ctx, const float *x, int64_t n,
                              int32_t count, const kvf_backend_weight *const *w /* [count] */,
                              const kvf_backend_weight *const *bias /* [count] */,
                              float *const *y /* [count] */);
/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, for n rows of w->cols. out may be x. */
void kvf_backend_rmsnorm(const kvf_backend *be, void *ctx, const float *x, int64_t n,
                         const kvf_backend_weight *w, float eps, float *out);
/* Rotates pairs (j, j + head_dim/2) of every head of x[n][n_heads][head_dim] by the angles
 * whose cosines and sines are cos_sin[n][head_dim/2][2] (the Hugging Face convention). */
void kvf_backend_rope(const kvf_backend *be, void *ctx, float *x, int64_t n, int32_t n_heads,
                      int32_t head_dim, const float *cos_sin);
/* out = silu(gate) * up, elementwise over n values. out may be gate. */
void kvf_backend_swiglu(const kvf_backend *be, void *ctx, const float *gate, const float *up,
                        int64_t n, float *out);
/* x += y over n values. */
void kvf_backend_add(const kvf_backend *be, void *ctx, float *x, const float *y, int64_t n);
/* out[i] = x[rows[i]], rows of row_len floats. */
void kvf_backend_gather(const kvf_backend *be, void *ctx, const float *x, int64_t row_len,
                        const int32_t *rows /* [n] */, int64_t n, float *out /* [n][row_len] */);
/* Writes k and v ([n][n_kv_heads][head_dim]) of `layer` into the pool at slots[i] =
 * block * block_size + offset, converting to the layout's dtype. */
void kvf_backend_kv_write(const kvf_backend *be, void *ctx, void *pool,
                          const kvf_kv_layout *layout, int32_t layer, const float *k,
                          const float *v, const int64_t *slots /* [n] */, int64_t n);
/* out[t] = softmax(q[t] . K / sqrt(d)) V over the paged KV of `layer`, causal and windowed
 * as a says; q and out are [n_tokens][n_heads][head_dim]. */
void kvf_backend_attention(const kvf_backend *be, void *ctx, const float *q, const void *pool,
                           const kvf_kv_layout *layout, int32_t layer, const kvf_backend_attn *a,
                           float *out);
/* out_host[i] = argmax of row i of logits[n][vocab] (ties to the lowest id). */
void kvf_backend_argmax(const kvf_backend *be, void *ctx, const float *logits, int64_t n,
                        int64_t vocab, int32_t *out_host /* [n] */);

/* ---- optional ops: a backend may leave them out, and these wrappers then give the default
 * named in each comment (the CPU backend's behaviour). */

/* Where the KV pool lives: the engine creates the backend first, then its pool through these
 * ops with mem_ctx = the backend ctx (one allocation: cudaMalloc of the whole pool on a GPU).
 * Default: NULL, host memory (kvf_kv_pool_cfg.mem NULL means kvf_kv_mem_host). */
const kvf_kv_mem_ops *kvf_backend_kv_mem(const kvf_backend *be, void *ctx);
/* Called by kvf_model_fwd_create: refuses (ERR_UNSUPPORTED, naming the value and what is
 * supported) a KV layout or head count the backend has no kernel for. Default: KVF_OK. */
kvf_status kvf_backend_supports(const kvf_backend *be, void *ctx, const kvf_kv_layout *layout,
                                int32_t n_heads, kvf_err *err);
/* Waits for queued work and returns the first error recorded since the last sync (a failed
 * launch, a cuBLAS error), clearing it; err may be NULL. kvf_model_forward calls it at the
 * end of a step. Default: KVF_OK (ops are finished when they return). */
kvf_status kvf_backend_sync(const kvf_backend *be, void *ctx, kvf_err *err);
/* Step recording (CUDA graphs). The forward pass uploads the step's metadata, then calls
 * step_begin; when *replay_out is true it issues no ops (the backend replays a recorded step
 * in step_end), otherwise it issues every op up to the LM head (which the backend may be
 * recording) and then calls step_end. When step_end sets *rerun_out, recording failed and
 * nothing ran: the forward pass issues the ops again, unrecorded. Downloads (logits, argmax)
 * come after step_end. Between the two calls there is no upload, download or host wait.
 * step_end is called whenever step_begin returned OK. Defaults: nothing is recorded
 * (*replay_out and *rerun_out false, KVF_OK). */
kvf_status kvf_backend_step_begin(const kvf_backend *be, void *ctx,
                                  const kvf_backend_step_key *key, bool *replay_out,
                                  kvf_err *err);
kvf_status kvf_backend_step_end(const kvf_backend *be, void *ctx, bool *rerun_out, kvf_err *err);
/* Whether kvf_backend_sample draws (else the engine downloads the logits and samples on the
 * host). */
bool kvf_backend_can_sample(const kvf_backend *be);
/* One token per row of logits[n][vocab] (backend memory) into out_host[n], finished on return,
 * so the logits need not leave the backend. The rule is the engine's host sampler's
 * (engine/sample.h; written out at kvf_cuda_sample in cuda/cuda.h): both draw the same token
 * from the same row and u, up to rounding. A row that fails the check in
 * kvf_backend_sample_row is refused (ERR_INVALID naming it). Default: ERR_UNSUPPORTED naming
 * the backend. */
kvf_status kvf_backend_sample(const kvf_backend *be, void *ctx, const float *logits, int64_t n,
                              int64_t vocab, const kvf_backend_sample_row *rows /* [n] */,
                              int32_t *out_host /* [n] */, kvf_err *err);
/* Step profiles (kvf_model_fwd_set_prof). With a clock of its own, prof_mark queues timestamp
 * i behind every op issued before it (a failure is recorded, as for ops) and, after sync,
 * prof_read writes the milliseconds from mark i to mark i + 1 into ms_out[i], i < n - 1. The
 * forward pass records no step (step_begin) while it profiles. Without one (the default) ops
 * are finished when they return and the forward pass reads the host clock instead:
 * prof_mark does nothing and prof_read returns ERR_UNSUPPORTED. */
bool kvf_backend_has_prof_clock(const kvf_backend *be);
void kvf_backend_prof_mark(const kvf_backend *be, void *ctx, int32_t i);
kvf_status kvf_backend_prof_read(const kvf_backend *be, void *ctx, int32_t n,
                                 double *ms_out /* [n - 1] */, kvf_err *err);

/* The CPU backend (model/cpu_backend.c). */
const kvf_backend *kvf_model_backend_cpu(void);

#endif
