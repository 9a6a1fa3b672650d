/* model.c: loading a model directory: config.json, then the safetensors, then a check of every
 * tensor the forward pass reads (name, dtype, shape). Tensors the model does not use (rotary
 * caches, extra heads) are ignored. */
#include "model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

/* Finds a tensor and checks its dtype and shape ([d0] when d1 < 0, else [d0, d1]). */
static kvf_status need(const kvf_model *m, const char *name, int64_t d0, int64_t d1,
                       const kvf_model_tensor **out, kvf_err *err)
{
    char want[64], found[160];
    if (d1 < 0)
        snprintf(want, sizeof want, "[%lld]", (long long)d0);
    else
        snprintf(want, sizeof want, "[%lld, %lld]", (long long)d0, (long long)d1);
    const kvf_model_tensor *t = kvf_model_safetensors_find(m->st, name);
    if (!t)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "model: %s: tensor \"%s\" is missing (expected shape %s)",
                           m->dir, name, want);
    if (t->dtype != KVF_DTYPE_F32 && t->dtype != KVF_DTYPE_F16 && t->dtype != KVF_DTYPE_BF16)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "model: %s: tensor \"%s\" is %s (use F32, F16 or BF16)",
                           m->dir, name, t->dtype_name);
    bool ok = d1 < 0 ? (t->n_dims == 1 && t->shape[0] == d0)
                     : (t->n_dims == 2 && t->shape[0] == d0 && t->shape[1] == d1);
    if (!ok)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: %s: tensor \"%s\": expected shape %s, found %s",
                           m->dir, name, want, kvf_model_tensor_shape_str(t, found, sizeof found));
    *out = t;
    return KVF_OK;
}

static kvf_status load_layer(kvf_model *m, int32_t i, kvf_err *err)
{
    const kvf_model_config *c = &m->cfg;
    kvf_model_layer *L = &m->layers[i];
    int64_t d = c->dim, q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t hid = c->hidden_dim;
    char n[256];
    kvf_status st;
#define NEED(suffix, d0, d1, field)                                            \
    do {                                                                       \
        snprintf(n, sizeof n, "model.layers.%d.%s", i, suffix);                \
        if ((st = need(m, n, d0, d1, &L->field, err)) != KVF_OK)               \
            return st;                                                         \
    } while (0)
    NEED("input_layernorm.weight", d, -1, attn_norm);
    NEED("self_attn.q_proj.weight", q, d, wq);
    NEED("self_attn.k_proj.weight", kv, d, wk);
    NEED("self_attn.v_proj.weight", kv, d, wv);
    NEED("self_attn.o_proj.weight", d, q, wo);
    if (c->qkv_bias) {
        NEED("self_attn.q_proj.bias", q, -1, bq);
        NEED("self_attn.k_proj.bias", kv, -1, bk);
        NEED("self_attn.v_proj.bias", kv, -1, bv);
    }
    if (c->o_bias)
        NEED("self_attn.o_proj.bias", d, -1, bo);
    NEED("post_attention_layernorm.weight", d, -1, ffn_norm);
    NEED("mlp.gate_proj.weight", hid, d, w_gate);
    NEED("mlp.up_proj.weight", hid, d, w_up);
    NEED("mlp.down_proj.weight", d, hid, w_down);
    if (c->mlp_bias) {
        NEED("mlp.gate_proj.bias", hid, -1, b_gate);
        NEED("mlp.up_proj.bias", hid, -1, b_up);
        NEED("mlp.down_proj.bias", d, -1, b_down);
    }
#undef NEED
    return KVF_OK;
}

void kvf_model_destroy(kvf_model *m)
{
    if (!m)
        return;
    kvf_model_safetensors_destroy(m->st);
    free(m->layers);
    free(m);
}

kvf_status kvf_model_load(const char *dir, kvf_model **out, kvf_err *err)
{
    kvf_model *m = calloc(1, sizeof *m);
    if (!m)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory");
    snprintf(m->dir, sizeof m->dir, "%s", dir);
    kvf_status st;
    if ((st = kvf_model_config_load(dir, &m->cfg, err)) != KVF_OK)
        goto fail;
    const kvf_model_config *c = &m->cfg;
    if ((st = kvf_model_safetensors_open_dir(dir, &m->st, err)) != KVF_OK)
        goto fail;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory for %d layers", c->n_layers);
        goto fail;
    }
    if ((st = need(m, "model.embed_tokens.weight", c->vocab_size, c->dim, &m->embed, err)) != KVF_OK ||
        (st = need(m, "model.norm.weight", c->dim, -1, &m->final_norm, err)) != KVF_OK)
        goto fail;
    if (c->tie_embeddings)
        m->lm_head = m->embed;
    else if ((st = need(m, "lm_head.weight", c->vocab_size, c->dim, &m->lm_head, err)) != KVF_OK)
        goto fail;
    for (int32_t i = 0; i < c->n_layers; i++)
        if ((st = load_layer(m, i, err)) != KVF_OK)
            goto fail;
    m->weight_dtype = (kvf_dtype)m->layers[0].wq->dtype;
    kvf_log(KVF_LOG_INFO,
            "model: %s: %s, %d layers, dim %d, %d heads / %d kv heads, head_dim %d, vocab %d, %s weights, %.1fM parameters",
            dir, kvf_model_arch_name(c->arch), c->n_layers, c->dim, c->n_heads, c->n_kv_heads,
            c->head_dim, c->vocab_size, kvf_dtype_name(m->weight_dtype),
            (double)kvf_model_config_n_params(c) / 1e6);
    *out = m;
    return KVF_OK;
fail:
    kvf_model_destroy(m);
    return st;
}

kvf_status kvf_model_kv_layout(const kvf_model *m, int32_t block_size, kvf_dtype dtype,
                               kvf_kv_layout *out, kvf_err *err)
{
    return kvf_kv_layout_init(m->cfg.n_layers, m->cfg.n_kv_heads, m->cfg.head_dim, block_size, dtype,
                              out, err);
}

const char *kvf_model_capacity_str(const kvf_kv_layout *l, int64_t n_blocks, int64_t context,
                                   char *buf, size_t cap)
{
    int64_t per_seq = kvf_kv_blocks_for(context, l->block_size);
    snprintf(buf, cap,
             "KV %s: %lld bytes/token, %lld bytes/block (%d tokens); pool %lld blocks = %lld tokens "
             "(%lld bytes), %lld sequences of %lld tokens",
             kvf_dtype_name(l->dtype), (long long)kvf_kv_bytes_per_token(l), (long long)l->block_bytes,
             l->block_size, (long long)n_blocks, (long long)n_blocks * l->block_size,
             (long long)(n_blocks * l->block_bytes), (long long)(per_seq ? n_blocks / per_seq : 0),
             (long long)context);
    return buf;
}
