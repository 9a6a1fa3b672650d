/* weights.c: gen-model presets, config.json writing and random-weight safetensors writing.
 * Every tensor draws from its own PRNG stream (seed hashed with its name), so the bytes depend
 * only on the config, the dtype and the seed. */
#include "model/weights.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"

kvf_status kvf_model_preset(const char *name, int32_t vocab_size, kvf_model_config *out,
                            kvf_err *err)
{
    if (vocab_size <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: vocab_size %d must be positive", vocab_size);
    kvf_model_config c = {.arch = KVF_MODEL_ARCH_LLAMA, .vocab_size = vocab_size, .norm_eps = 1e-5f,
                          .rope_theta = 10000.0, .rope_factor = 1.0, .bos_id = -1,
                          .torch_dtype = -1};
    if (strcmp(name, "tiny") == 0) {
        c.dim = 64, c.hidden_dim = 176, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.max_pos = 512;
    } else if (strcmp(name, "small") == 0) {
        c.dim = 288, c.hidden_dim = 768, c.n_layers = 6, c.n_heads = 6, c.n_kv_heads = 6, c.max_pos = 1024;
        c.tie_embeddings = true;
    } else if (strcmp(name, "medium") == 0) {
        c.dim = 768, c.hidden_dim = 2048, c.n_layers = 12, c.n_heads = 12, c.n_kv_heads = 12, c.max_pos = 2048;
        c.tie_embeddings = true;
    } else if (strcmp(name, "1b") == 0) { /* Llama-3.2-1B-like shapes, for GPU figures */
        c.dim = 2048, c.hidden_dim = 8192, c.n_layers = 16, c.n_heads = 32, c.n_kv_heads = 8, c.max_pos = 4096;
        c.tie_embeddings = true;
    } else {
        return kvf_err_set(err, KVF_ERR_INVALID, "model: preset \"%s\" is not known (use tiny, small, medium or 1b)", name);
    }
    c.head_dim = c.dim / c.n_heads;
    *out = c;
    return KVF_OK;
}

static const char *arch_class(kvf_model_arch a)
{
    switch (a) {
    case KVF_MODEL_ARCH_LLAMA: return "LlamaForCausalLM";
    case KVF_MODEL_ARCH_MISTRAL: return "MistralForCausalLM";
    case KVF_MODEL_ARCH_QWEN2: return "Qwen2ForCausalLM";
    }
    return "?";
}

static const char *torch_dtype(kvf_dtype d)
{
    return d == KVF_DTYPE_BF16 ? "bfloat16" : d == KVF_DTYPE_F16 ? "float16" : "float32";
}

kvf_status kvf_model_config_write(const char *path, const kvf_model_config *c, kvf_dtype dtype,
                                  kvf_err *err)
{
    json_t *j = json_object();
    json_object_set_new(j, "architectures", json_pack("[s]", arch_class(c->arch)));
    json_object_set_new(j, "model_type", json_string(kvf_model_arch_name(c->arch)));
    json_object_set_new(j, "hidden_size", json_integer(c->dim));
    json_object_set_new(j, "intermediate_size", json_integer(c->hidden_dim));
    json_object_set_new(j, "num_hidden_layers", json_integer(c->n_layers));
    json_object_set_new(j, "num_attention_heads", json_integer(c->n_heads));
    json_object_set_new(j, "num_key_value_heads", json_integer(c->n_kv_heads));
    json_object_set_new(j, "head_dim", json_integer(c->head_dim));
    json_object_set_new(j, "vocab_size", json_integer(c->vocab_size));
    json_object_set_new(j, "max_position_embeddings", json_integer(c->max_pos));
    char eps[32];
    snprintf(eps, sizeof eps, "%g", (double)c->norm_eps); /* 1e-05, not 9.99999974738e-06 */
    json_object_set_new(j, "rms_norm_eps", json_real(strtod(eps, NULL)));
    json_object_set_new(j, "rope_theta", json_real(c->rope_theta));
    if (c->rope_scaling == KVF_MODEL_ROPE_LLAMA3)
        json_object_set_new(j, "rope_scaling",
                            json_pack("{s:s,s:f,s:f,s:f,s:i}", "rope_type", "llama3", "factor", c->rope_factor,
                                      "low_freq_factor", c->rope_low_freq_factor, "high_freq_factor",
                                      c->rope_high_freq_factor, "original_max_position_embeddings",
                                      c->rope_orig_max_pos));
    else if (c->rope_scaling == KVF_MODEL_ROPE_LINEAR)
        json_object_set_new(j, "rope_scaling", json_pack("{s:s,s:f}", "rope_type", "linear", "factor", c->rope_factor));
    else
        json_object_set_new(j, "rope_scaling", json_null());
    json_object_set_new(j, "tie_word_embeddings", json_boolean(c->tie_embeddings));
    json_object_set_new(j, "hidden_act", json_string("silu"));
    if (c->arch == KVF_MODEL_ARCH_LLAMA) {
        json_object_set_new(j, "attention_bias", json_boolean(c->qkv_bias));
        json_object_set_new(j, "mlp_bias", json_boolean(c->mlp_bias));
    } else if (c->arch == KVF_MODEL_ARCH_MISTRAL) {
        json_object_set_new(j, "sliding_window", c->sliding_window ? json_integer(c->sliding_window) : json_null());
    } else {
        json_object_set_new(j, "use_sliding_window", json_boolean(c->sliding_window > 0));
        json_object_set_new(j, "sliding_window", json_integer(c->sliding_window ? c->sliding_window : 4096));
        json_object_set_new(j, "max_window_layers", json_integer(c->window_first_layer));
    }
    if (c->bos_id >= 0)
        json_object_set_new(j, "bos_token_id", json_integer(c->bos_id));
    if (c->n_eos == 1) {
        json_object_set_new(j, "eos_token_id", json_integer(c->eos_ids[0]));
    } else if (c->n_eos > 1) {
        json_t *a = json_array();
        for (int32_t i = 0; i < c->n_eos; i++)
            json_array_append_new(a, json_integer(c->eos_ids[i]));
        json_object_set_new(j, "eos_token_id", a);
    }
    json_object_set_new(j, "torch_dtype", json_string(torch_dtype(dtype)));
    int rc = json_dump_file(j, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    if (rc != 0)
        return kvf_err_set(err, KVF_ERR_IO, "model: cannot write %s: %s", path, strerror(errno));
    return KVF_OK;
}

/* ---- random tensors */
typedef enum wkind { W_PROJ, W_EMBED, W_NORM, W_BIAS } wkind;

typedef struct wspec {
    char name[96];
    int64_t rows, cols; /* rows 0: a 1-D tensor of cols */
    wkind kind;
} wspec;

static int cmp_spec(const void *a, const void *b)
{
    return strcmp(((const wspec *)a)->name, ((const wspec *)b)->name);
}

/* Lists every tensor c implies into *out (malloc'd). */
static kvf_status list_tensors(const kvf_model_config *c, wspec **out, size_t *n_out, kvf_err *err)
{
    size_t cap = 4 + (size_t)c->n_layers * 16, n = 0;
    wspec *w = calloc(cap, sizeof *w);
    if (!w)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory");
    int64_t d = c->dim, q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim,
            h = c->hidden_dim;
#define ADD(kind_, rows_, cols_, ...)                                        \
    do {                                                                    \
        snprintf(w[n].name, sizeof w[n].name, __VA_ARGS__);                 \
        w[n].rows = (rows_), w[n].cols = (cols_), w[n].kind = (kind_);      \
        n++;                                                                \
    } while (0)
    ADD(W_EMBED, c->vocab_size, d, "model.embed_tokens.weight");
    ADD(W_NORM, 0, d, "model.norm.weight");
    if (!c->tie_embeddings)
        ADD(W_PROJ, c->vocab_size, d, "lm_head.weight");
    for (int32_t i = 0; i < c->n_layers; i++) {
        ADD(W_NORM, 0, d, "model.layers.%d.input_layernorm.weight", i);
        ADD(W_PROJ, q, d, "model.layers.%d.self_attn.q_proj.weight", i);
        ADD(W_PROJ, kv, d, "model.layers.%d.self_attn.k_proj.weight", i);
        ADD(W_PROJ, kv, d, "model.layers.%d.self_attn.v_proj.weight", i);
        ADD(W_PROJ, d, q, "model.layers.%d.self_attn.o_proj.weight", i);
        if (c->qkv_bias) {
            ADD(W_BIAS, 0, q, "model.layers.%d.self_attn.q_proj.bias", i);
            ADD(W_BIAS, 0, kv, "model.layers.%d.self_attn.k_proj.bias", i);
            ADD(W_BIAS, 0, kv, "model.layers.%d.self_attn.v_proj.bias", i);
        }
        if (c->o_bias)
            ADD(W_BIAS, 0, d, "model.layers.%d.self_attn.o_proj.bias", i);
        ADD(W_NORM, 0, d, "model.layers.%d.post_attention_layernorm.weight", i);
        ADD(W_PROJ, h, d, "model.layers.%d.mlp.gate_proj.weight", i);
        ADD(W_PROJ, h, d, "model.layers.%d.mlp.up_proj.weight", i);
        ADD(W_PROJ, d, h, "model.layers.%d.mlp.down_proj.weight", i);
        if (c->mlp_bias) {
            ADD(W_BIAS, 0, h, "model.layers.%d.mlp.gate_proj.bias", i);
            ADD(W_BIAS, 0, h, "model.layers.%d.mlp.up_proj.bias", i);
            ADD(W_BIAS, 0, d, "model.layers.%d.mlp.down_proj.bias", i);
        }
    }
#undef ADD
    qsort(w, n, sizeof *w, cmp_spec);
    *out = w;
    *n_out = n;
    return KVF_OK;
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float unif(uint64_t *s)
{
    return (float)((double)(splitmix(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static kvf_status write_row(FILE *f, const float *x, int64_t n, kvf_dtype dt, void *buf,
                            const char *path, kvf_err *err)
{
    size_t es = kvf_dtype_size(dt);
    uint8_t *b = buf;
    for (int64_t i = 0; i < n; i++) {
        if (dt == KVF_DTYPE_F32) {
            memcpy(b + 4 * i, &x[i], 4);
        } else {
            uint16_t h = dt == KVF_DTYPE_BF16 ? kvf_f32_to_bf16(x[i]) : kvf_f32_to_f16(x[i]);
            b[2 * i] = (uint8_t)(h & 0xff);
            b[2 * i + 1] = (uint8_t)(h >> 8);
        }
    }
    if (fwrite(buf, es, (size_t)n, f) != (size_t)n)
        return kvf_err_set(err, KVF_ERR_IO, "model: writing %s: %s", path, strerror(errno));
    return KVF_OK;
}

kvf_status kvf_model_weights_write_random(const char *path, const kvf_model_config *c,
                                          kvf_dtype dtype, uint64_t seed, kvf_err *err)
{
    if (dtype != KVF_DTYPE_F32 && dtype != KVF_DTYPE_F16 && dtype != KVF_DTYPE_BF16)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: weight dtype %s is not supported (use f32, f16 or bf16)",
                           kvf_dtype_name(dtype));
    wspec *w = NULL;
    size_t n = 0;
    kvf_status st = list_tensors(c, &w, &n, err);
    if (st != KVF_OK)
        return st;
    size_t es = kvf_dtype_size(dtype);
    const char *dname = dtype == KVF_DTYPE_F32 ? "F32" : dtype == KVF_DTYPE_F16 ? "F16" : "BF16";

    /* header */
    json_t *h = json_object();
    json_object_set_new(h, "__metadata__", json_pack("{s:s,s:s}", "format", "pt", "generator", "kvfleet gen-model"));
    int64_t off = 0, max_cols = 1;
    for (size_t i = 0; i < n; i++) {
        int64_t elems = (w[i].rows ? w[i].rows : 1) * w[i].cols;
        json_t *shape = w[i].rows ? json_pack("[I,I]", (json_int_t)w[i].rows, (json_int_t)w[i].cols)
                                  : json_pack("[I]", (json_int_t)w[i].cols);
        json_object_set_new(h, w[i].name,
                            json_pack("{s:s,s:o,s:[I,I]}", "dtype", dname, "shape", shape, "data_offsets",
                                      (json_int_t)off, (json_int_t)(off + elems * (int64_t)es)));
        off += elems * (int64_t)es;
        if (w[i].cols > max_cols)
            max_cols = w[i].cols;
    }
    char *text = json_dumps(h, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(h);
    float *row = malloc((size_t)max_cols * sizeof *row);
    void *buf = malloc((size_t)max_cols * 4);
    FILE *f = NULL;
    if (!text || !row || !buf) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory");
        goto done;
    }
    f = fopen(path, "wb");
    if (!f) {
        st = kvf_err_set(err, KVF_ERR_IO, "model: cannot create %s: %s", path, strerror(errno));
        goto done;
    }
    size_t hlen = strlen(text), padded = (hlen + 7) / 8 * 8;
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    if (fwrite(len8, 1, 8, f) != 8 || fwrite(text, 1, hlen, f) != hlen ||
        fwrite("        ", 1, padded - hlen, f) != padded - hlen) {
        st = kvf_err_set(err, KVF_ERR_IO, "model: writing %s: %s", path, strerror(errno));
        goto done;
    }

    /* data, tensor by tensor, row by row */
    for (size_t i = 0; i < n && st == KVF_OK; i++) {
        uint64_t s = kvf_hash64_seed(w[i].name, strlen(w[i].name), seed);
        int64_t rows = w[i].rows ? w[i].rows : 1, cols = w[i].cols;
        float scale = w[i].kind == W_PROJ || w[i].kind == W_EMBED ? (float)(1.0 / sqrt((double)cols))
                      : w[i].kind == W_NORM                      ? 0.1f
                                                                 : 0.05f;
        for (int64_t r = 0; r < rows && st == KVF_OK; r++) {
            for (int64_t j = 0; j < cols; j++)
                row[j] = (w[i].kind == W_NORM ? 1.0f : 0.0f) + scale * unif(&s);
            st = write_row(f, row, cols, dtype, buf, path, err);
        }
    }
    if (st == KVF_OK && fflush(f) != 0)
        st = kvf_err_set(err, KVF_ERR_IO, "model: writing %s: %s", path, strerror(errno));
done:
    if (f && fclose(f) != 0 && st == KVF_OK)
        st = kvf_err_set(err, KVF_ERR_IO, "model: closing %s: %s", path, strerror(errno));
    free(text);
    free(row);
    free(buf);
    free(w);
    return st;
}
