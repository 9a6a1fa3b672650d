/* backend_impl.h: the compute backend's op table, for those who implement one (cpu_backend.c,
 * cuda/backend.cu, test doubles that wrap a backend) and for the wrappers in backend.c, which
 * hold the defaults of the optional ops. Everyone else calls the kvf_backend_* wrappers. */
#ifndef KVF_MODEL_BACKEND_IMPL_H
#define KVF_MODEL_BACKEND_IMPL_H

#include "model/backend.h"

/* The op table. Each backend is one `static const kvf_backend` built with designated
 * initializers. The wrappers of the same name (backend.h) say what each op does; the comments
 * here say what an implementation must keep to. */
struct kvf_backend {
    const char *name;
    /* weight_load can make q8 weights (kvf_backend_opts.weight_dtype Q8) and embed/matmul take
     * them; false (a backend that leaves it out) makes kvf_backend_create refuse Q8. */
    bool q8_weights;
    kvf_status (*create)(const kvf_backend_opts *opts, void **ctx_out, kvf_err *err);
    void (*destroy)(void *ctx);

    /* Memory: alloc'd buffers are zeroed; upload/download copy between host and backend. */
    kvf_status (*alloc)(void *ctx, size_t bytes, void **out, kvf_err *err);
    void (*free)(void *ctx, void *p);
    void (*upload)(void *ctx, void *dst, const void *src_host, size_t bytes);
    void (*download)(void *ctx, void *dst_host, const void *src, size_t bytes);

    /* Makes a file tensor (F32/F16/BF16, 1-D or 2-D) usable by the ops below; weight_unload
     * releases what weight_load made (w->owned). */
    kvf_status (*weight_load)(void *ctx, const kvf_model_tensor *t, kvf_backend_weight *out,
                              kvf_err *err);
    void (*weight_unload)(void *ctx, kvf_backend_weight *w);

    /* The ops of a step (backend.h: kvf_backend_embed .. kvf_backend_argmax). They return
     * nothing: a backend that can fail records the first failure for sync. */
    void (*embed)(void *ctx, const kvf_backend_weight *emb, const int32_t *tokens /* [n] */,
                  int64_t n, float *out /* [n][emb->cols] */);
    void (*matmul)(void *ctx, const float *x, int64_t n, const kvf_backend_weight *w,
                   const kvf_backend_weight *bias, float *y);
    void (*rmsnorm)(void *ctx, const float *x, int64_t n, const kvf_backend_weight *w, float eps,
                    float *out);
    void (*rope)(void *ctx, float *x, int64_t n, int32_t n_heads, int32_t head_dim,
                 const float *cos_sin);
    void (*swiglu)(void *ctx, const float *gate, const float *up, int64_t n, float *out);
    void (*add)(void *ctx, float *x, const float *y, int64_t n);
    void (*gather)(void *ctx, const float *x, int64_t row_len, const int32_t *rows, int64_t n,
                   float *out);
    void (*kv_write)(void *ctx, void *pool, const kvf_kv_layout *layout, int32_t layer,
                     const float *k, const float *v, const int64_t *slots /* [n] */, int64_t n);
    void (*attention)(void *ctx, const float *q, const void *pool, const kvf_kv_layout *layout,
                      int32_t layer, const kvf_backend_attn *a, float *out);
    void (*argmax)(void *ctx, const float *logits, int64_t n, int64_t vocab, int32_t *out_host);

    /* ---- optional: NULL takes the default its wrapper in backend.c holds (host memory,
     * everything supported, nothing to wait for, nothing recorded, no draws, matmul by matmul,
     * the host clock). The CPU backend leaves them all NULL; the CUDA backend fills them all. */
    const kvf_kv_mem_ops *(*kv_mem)(void *ctx);
    kvf_status (*supports)(void *ctx, const kvf_kv_layout *layout, int32_t n_heads, kvf_err *err);
    kvf_status (*sync)(void *ctx, kvf_err *err);
    kvf_status (*step_begin)(void *ctx, const kvf_backend_step_key *key, bool *replay_out,
                             kvf_err *err);
    kvf_status (*step_end)(void *ctx, bool *rerun_out, kvf_err *err);
    kvf_status (*sample)(void *ctx, const float *logits, int64_t n, int64_t vocab,
                         const kvf_backend_sample_row *rows /* [n] */, int32_t *out_host,
                         kvf_err *err);
    /* Must equal count matmul calls bit for bit. */
    void (*matmul_multi)(void *ctx, const float *x, int64_t n, int32_t count,
                         const kvf_backend_weight *const *w, const kvf_backend_weight *const *bias,
                         float *const *y);
    /* prof_mark/prof_read come as a pair: a backend with only one of them is timed on the
     * host clock (kvf_backend_has_prof_clock is false). */
    void (*prof_mark)(void *ctx, int32_t i);
    kvf_status (*prof_read)(void *ctx, int32_t n, double *ms_out, kvf_err *err);
};

#endif
