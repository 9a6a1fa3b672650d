/* backend.c: the kvf_backend_* wrappers, one per op of the table in backend_impl.h. They are
 * the only place that tests an optional op for NULL, so each default is written once here;
 * what the ops compute is the backends' (cpu_backend.c, cuda/backend.cu). */
#include "model/backend_impl.h"

const char *kvf_backend_name(const kvf_backend *be)
{
    return be->name;
}

kvf_status kvf_backend_create(const kvf_backend *be, const kvf_backend_opts *opts, void **ctx_out,
                              kvf_err *err)
{
    /* checked here, once for every backend, so one without q8 kernels (CUDA today) needs no
     * code to refuse it and never silently runs f32 when q8 was asked for */
    int32_t wd = opts ? opts->weight_dtype : KVF_BACKEND_WEIGHT_F32;
    if (wd < 0 || wd >= KVF_BACKEND_WEIGHT_COUNT)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: weight dtype %d is not known (use f32 or q8)", wd);
    if (wd == KVF_BACKEND_WEIGHT_Q8 && !be->q8_weights)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "model: backend %s has no q8 weights: --weight-dtype q8 runs on the CPU backend "
                           "only (use --device cpu, or --weight-dtype f32)", be->name);
    return be->create(opts, ctx_out, err);
}

void kvf_backend_destroy(const kvf_backend *be, void *ctx)
{
    if (ctx)
        be->destroy(ctx);
}

/* ---- memory and weights */

kvf_status kvf_backend_alloc(const kvf_backend *be, void *ctx, size_t bytes, void **out,
                             kvf_err *err)
{
    return be->alloc(ctx, bytes, out, err);
}

void kvf_backend_free(const kvf_backend *be, void *ctx, void *p)
{
    be->free(ctx, p);
}

void kvf_backend_upload(const kvf_backend *be, void *ctx, void *dst, const void *src_host,
                        size_t bytes)
{
    be->upload(ctx, dst, src_host, bytes);
}

void kvf_backend_download(const kvf_backend *be, void *ctx, void *dst_host, const void *src,
                          size_t bytes)
{
    be->download(ctx, dst_host, src, bytes);
}

kvf_status kvf_backend_weight_load(const kvf_backend *be, void *ctx, const kvf_model_tensor *t,
                                   kvf_backend_weight *out, kvf_err *err)
{
    return be->weight_load(ctx, t, out, err);
}

void kvf_backend_weight_unload(const kvf_backend *be, void *ctx, kvf_backend_weight *w)
{
    be->weight_unload(ctx, w);
}

/* ---- the ops of a step */

void kvf_backend_embed(const kvf_backend *be, void *ctx, const kvf_backend_weight *emb,
                       const int32_t *tokens, int64_t n, float *out)
{
    be->embed(ctx, emb, tokens, n, out);
}

void kvf_backend_matmul(const kvf_backend *be, void *ctx, const float *x, int64_t n,
                        const kvf_backend_weight *w, const kvf_backend_weight *bias, float *y)
{
    be->matmul(ctx, x, n, w, bias, y);
}

void kvf_backend_matmul_multi(const kvf_backend *be, void *ctx, const float *x, int64_t n,
                              int32_t count, const kvf_backend_weight *const *w,
                              const kvf_backend_weight *const *bias, float *const *y)
{
    if (be->matmul_multi) {
        be->matmul_multi(ctx, x, n, count, w, bias, y);
        return;
    }
    for (int32_t i = 0; i < count; i++)
        be->matmul(ctx, x, n, w[i], bias[i], y[i]);
}

void kvf_backend_rmsnorm(const kvf_backend *be, void *ctx, const float *x, int64_t n,
                         const kvf_backend_weight *w, float eps, float *out)
{
    be->rmsnorm(ctx, x, n, w, eps, out);
}

void kvf_backend_rope(const kvf_backend *be, void *ctx, float *x, int64_t n, int32_t n_heads,
                      int32_t head_dim, const float *cos_sin)
{
    be->rope(ctx, x, n, n_heads, head_dim, cos_sin);
}

void kvf_backend_swiglu(const kvf_backend *be, void *ctx, const float *gate, const float *up,
                        int64_t n, float *out)
{
    be->swiglu(ctx, gate, up, n, out);
}

void kvf_backend_add(const kvf_backend *be, void *ctx, float *x, const float *y, int64_t n)
{
    be->add(ctx, x, y, n);
}

void kvf_backend_gather(const kvf_backend *be, void *ctx, const float *x, int64_t row_len,
                        const int32_t *rows, int64_t n, float *out)
{
    be->gather(ctx, x, row_len, rows, n, out);
}

void kvf_backend_kv_write(const kvf_backend *be, void *ctx, void *pool,
                          const kvf_kv_layout *layout, int32_t layer, const float *k,
                          const float *v, const int64_t *slots, int64_t n)
{
    be->kv_write(ctx, pool, layout, layer, k, v, slots, n);
}

void kvf_backend_attention(const kvf_backend *be, void *ctx, const float *q, const void *pool,
                           const kvf_kv_layout *layout, int32_t layer, const kvf_backend_attn *a,
                           float *out)
{
    be->attention(ctx, q, pool, layout, layer, a, out);
}

void kvf_backend_argmax(const kvf_backend *be, void *ctx, const float *logits, int64_t n,
                        int64_t vocab, int32_t *out_host)
{
    be->argmax(ctx, logits, n, vocab, out_host);
}

/* ---- optional ops and their defaults */

const kvf_kv_mem_ops *kvf_backend_kv_mem(const kvf_backend *be, void *ctx)
{
    return be->kv_mem ? be->kv_mem(ctx) : NULL;
}

kvf_status kvf_backend_supports(const kvf_backend *be, void *ctx, const kvf_kv_layout *layout,
                                int32_t n_heads, kvf_err *err)
{
    return be->supports ? be->supports(ctx, layout, n_heads, err) : KVF_OK;
}

kvf_status kvf_backend_sync(const kvf_backend *be, void *ctx, kvf_err *err)
{
    return be->sync ? be->sync(ctx, err) : KVF_OK;
}

kvf_status kvf_backend_step_begin(const kvf_backend *be, void *ctx,
                                  const kvf_backend_step_key *key, bool *replay_out,
                                  kvf_err *err)
{
    if (be->step_begin)
        return be->step_begin(ctx, key, replay_out, err);
    *replay_out = false;
    return KVF_OK;
}

kvf_status kvf_backend_step_end(const kvf_backend *be, void *ctx, bool *rerun_out, kvf_err *err)
{
    if (be->step_end)
        return be->step_end(ctx, rerun_out, err);
    *rerun_out = false;
    return KVF_OK;
}

bool kvf_backend_can_sample(const kvf_backend *be)
{
    return be->sample != NULL;
}

kvf_status kvf_backend_sample(const kvf_backend *be, void *ctx, const float *logits, int64_t n,
                              int64_t vocab, const kvf_backend_sample_row *rows,
                              int32_t *out_host, kvf_err *err)
{
    if (!be->sample)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "model: backend %s cannot sample (draw on "
                           "the host from downloaded logits)", be->name);
    return be->sample(ctx, logits, n, vocab, rows, out_host, err);
}

bool kvf_backend_has_prof_clock(const kvf_backend *be)
{
    return be->prof_mark && be->prof_read;
}

void kvf_backend_prof_mark(const kvf_backend *be, void *ctx, int32_t i)
{
    if (kvf_backend_has_prof_clock(be))
        be->prof_mark(ctx, i);
}

kvf_status kvf_backend_prof_read(const kvf_backend *be, void *ctx, int32_t n, double *ms_out,
                                 kvf_err *err)
{
    if (!kvf_backend_has_prof_clock(be))
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "model: backend %s has no profile clock "
                           "(time its ops on the host clock)", be->name);
    return be->prof_read(ctx, n, ms_out, err);
}
