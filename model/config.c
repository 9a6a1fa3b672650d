/* config.c: reading config.json into kvf_model_config. Every field is range-checked here so
 * the loader and the forward pass can trust the struct; a null value counts as absent. */
#include "model/config.h"

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "common/json.h"

#define CFG_MAX_DIM (1 << 20)
#define CFG_MAX_LAYERS 4096
#define CFG_MAX_VOCAB (1 << 24)

const char *kvf_model_arch_name(kvf_model_arch a)
{
    switch (a) {
    case KVF_MODEL_ARCH_LLAMA: return "llama";
    case KVF_MODEL_ARCH_MISTRAL: return "mistral";
    case KVF_MODEL_ARCH_QWEN2: return "qwen2";
    }
    return "?";
}

/* A field that may be absent or null: returns NOT_FOUND for both (without a message). */
static const json_t *field(const json_t *obj, const char *key)
{
    const json_t *v = json_object_get(obj, key);
    return (v && !json_is_null(v)) ? v : NULL;
}

/* An integer in [lo, hi]; absent -> *out = def when optional, else an error. */
static kvf_status get_i32(const json_t *j, const char *key, bool required, int32_t def,
                          int64_t lo, int64_t hi, int32_t *out, kvf_err *err)
{
    if (!field(j, key)) {
        if (required)
            return kvf_err_set(err, KVF_ERR_INVALID, "\"%s\" is missing (an integer from %lld to %lld is required)",
                               key, (long long)lo, (long long)hi);
        *out = def;
        return KVF_OK;
    }
    int64_t v;
    kvf_status st = kvf_json_get_int(j, key, &v, err);
    if (st != KVF_OK)
        return st;
    if (v < lo || v > hi)
        return kvf_err_set(err, KVF_ERR_INVALID, "\"%s\" is %lld (allowed: %lld to %lld)", key,
                           (long long)v, (long long)lo, (long long)hi);
    *out = (int32_t)v;
    return KVF_OK;
}

static kvf_status get_num(const json_t *j, const char *key, double def, double lo, double hi,
                          double *out, kvf_err *err)
{
    if (!field(j, key)) {
        *out = def;
        return KVF_OK;
    }
    double v;
    kvf_status st = kvf_json_get_num(j, key, &v, err);
    if (st != KVF_OK)
        return st;
    if (!(v >= lo && v <= hi))
        return kvf_err_set(err, KVF_ERR_INVALID, "\"%s\" is %g (allowed: %g to %g)", key, v, lo, hi);
    *out = v;
    return KVF_OK;
}

static kvf_status get_bool(const json_t *j, const char *key, bool def, bool *out, kvf_err *err)
{
    if (!field(j, key)) {
        *out = def;
        return KVF_OK;
    }
    return kvf_json_get_bool(j, key, out, err);
}

static kvf_status parse_rope_scaling(const json_t *j, kvf_model_config *c, kvf_err *err)
{
    const json_t *rs = field(j, "rope_scaling");
    c->rope_scaling = KVF_MODEL_ROPE_NONE;
    c->rope_factor = 1.0;
    if (!rs)
        return KVF_OK;
    if (!json_is_object(rs))
        return kvf_err_set(err, KVF_ERR_INVALID, "\"rope_scaling\" is %s, expected an object or null",
                           kvf_json_kind(rs));
    const json_t *t = field(rs, "rope_type");
    if (!t)
        t = field(rs, "type");
    if (!t || !json_is_string(t))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "\"rope_scaling\" needs a string \"rope_type\" (llama3, linear or default)");
    const char *type = json_string_value(t);
    kvf_status st;
    if (strcmp(type, "default") == 0)
        return KVF_OK;
    if ((st = get_num(rs, "factor", 0, 1e-6, 1e6, &c->rope_factor, err)) != KVF_OK)
        return kvf_err_prefix(err, "rope_scaling");
    if (c->rope_factor == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rope_scaling: \"factor\" is missing (a positive number is required)");
    if (strcmp(type, "linear") == 0) {
        c->rope_scaling = KVF_MODEL_ROPE_LINEAR;
        return KVF_OK;
    }
    if (strcmp(type, "llama3") != 0)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "\"rope_scaling\" type \"%s\" is not supported (use llama3, linear or default)", type);
    c->rope_scaling = KVF_MODEL_ROPE_LLAMA3;
    if ((st = get_num(rs, "low_freq_factor", 1.0, 1e-6, 1e6, &c->rope_low_freq_factor, err)) != KVF_OK ||
        (st = get_num(rs, "high_freq_factor", 4.0, 1e-6, 1e6, &c->rope_high_freq_factor, err)) != KVF_OK ||
        (st = get_i32(rs, "original_max_position_embeddings", false, 8192, 1, INT32_MAX,
                      &c->rope_orig_max_pos, err)) != KVF_OK)
        return kvf_err_prefix(err, "rope_scaling");
    if (!(c->rope_high_freq_factor > c->rope_low_freq_factor))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "rope_scaling: \"high_freq_factor\" (%g) must exceed \"low_freq_factor\" (%g)",
                           c->rope_high_freq_factor, c->rope_low_freq_factor);
    return KVF_OK;
}

static kvf_status parse_eos(const json_t *j, kvf_model_config *c, kvf_err *err)
{
    const json_t *e = field(j, "eos_token_id");
    c->n_eos = 0;
    if (!e)
        return KVF_OK;
    if (json_is_integer(e)) {
        json_int_t v = json_integer_value(e);
        if (v < 0 || v >= c->vocab_size)
            return kvf_err_set(err, KVF_ERR_INVALID, "\"eos_token_id\" is %lld (allowed: 0 to %d)",
                               (long long)v, c->vocab_size - 1);
        c->eos_ids[c->n_eos++] = (int32_t)v;
        return KVF_OK;
    }
    if (!json_is_array(e))
        return kvf_err_set(err, KVF_ERR_INVALID, "\"eos_token_id\" is %s, expected an integer or an array",
                           kvf_json_kind(e));
    size_t i;
    json_t *x;
    json_array_foreach(e, i, x) {
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= c->vocab_size)
            return kvf_err_set(err, KVF_ERR_INVALID, "\"eos_token_id\"[%zu] is not a token id (0 to %d)",
                               i, c->vocab_size - 1);
        if (c->n_eos < KVF_MODEL_MAX_EOS)
            c->eos_ids[c->n_eos++] = (int32_t)json_integer_value(x);
    }
    return KVF_OK;
}

static kvf_status parse_obj(const json_t *j, kvf_model_config *c, kvf_err *err)
{
    kvf_status st;
    memset(c, 0, sizeof *c);
    if (!json_is_object(j))
        return kvf_err_set(err, KVF_ERR_INVALID, "expected a JSON object, found %s", kvf_json_kind(j));

    const json_t *mt = field(j, "model_type");
    if (!mt || !json_is_string(mt))
        return kvf_err_set(err, KVF_ERR_INVALID, "\"model_type\" is missing or not a string (use llama, mistral or qwen2)");
    const char *type = json_string_value(mt);
    if (strcmp(type, "llama") == 0)
        c->arch = KVF_MODEL_ARCH_LLAMA;
    else if (strcmp(type, "mistral") == 0)
        c->arch = KVF_MODEL_ARCH_MISTRAL;
    else if (strcmp(type, "qwen2") == 0)
        c->arch = KVF_MODEL_ARCH_QWEN2;
    else
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "\"model_type\" \"%s\" is not supported (use llama, mistral or qwen2)", type);

    if ((st = get_i32(j, "hidden_size", true, 0, 1, CFG_MAX_DIM, &c->dim, err)) != KVF_OK ||
        (st = get_i32(j, "intermediate_size", true, 0, 1, CFG_MAX_DIM * 8, &c->hidden_dim, err)) != KVF_OK ||
        (st = get_i32(j, "num_hidden_layers", true, 0, 1, CFG_MAX_LAYERS, &c->n_layers, err)) != KVF_OK ||
        (st = get_i32(j, "num_attention_heads", true, 0, 1, 4096, &c->n_heads, err)) != KVF_OK ||
        (st = get_i32(j, "num_key_value_heads", false, c->n_heads, 1, 4096, &c->n_kv_heads, err)) != KVF_OK ||
        (st = get_i32(j, "vocab_size", true, 0, 1, CFG_MAX_VOCAB, &c->vocab_size, err)) != KVF_OK ||
        (st = get_i32(j, "max_position_embeddings", false, 2048, 1, INT32_MAX, &c->max_pos, err)) != KVF_OK)
        return st;
    if (c->n_heads % c->n_kv_heads != 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "\"num_key_value_heads\" (%d) does not divide \"num_attention_heads\" (%d)",
                           c->n_kv_heads, c->n_heads);
    if (field(j, "head_dim")) {
        if ((st = get_i32(j, "head_dim", true, 0, 2, KVF_MODEL_MAX_HEAD_DIM, &c->head_dim, err)) != KVF_OK)
            return st;
    } else {
        if (c->dim % c->n_heads != 0)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "\"num_attention_heads\" (%d) does not divide \"hidden_size\" (%d) and there is no \"head_dim\"",
                               c->n_heads, c->dim);
        c->head_dim = c->dim / c->n_heads;
        if (c->head_dim > KVF_MODEL_MAX_HEAD_DIM)
            return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "head_dim %d (hidden_size / num_attention_heads) is above %d",
                               c->head_dim, KVF_MODEL_MAX_HEAD_DIM);
    }
    if (c->head_dim % 2 != 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "head_dim %d is odd (RoPE needs an even head_dim)", c->head_dim);
    if ((int64_t)c->n_heads * c->head_dim > CFG_MAX_DIM * 8)
        return kvf_err_set(err, KVF_ERR_INVALID, "num_attention_heads * head_dim (%d * %d) is too large",
                           c->n_heads, c->head_dim);

    double eps;
    if ((st = get_num(j, "rms_norm_eps", 1e-6, 0, 1, &eps, err)) != KVF_OK ||
        (st = get_num(j, "rope_theta", 10000.0, 1.0, 1e12, &c->rope_theta, err)) != KVF_OK)
        return st;
    c->norm_eps = (float)eps;
    if ((st = parse_rope_scaling(j, c, err)) != KVF_OK)
        return st;

    const json_t *act = field(j, "hidden_act");
    if (act && (!json_is_string(act) || (strcmp(json_string_value(act), "silu") != 0 &&
                                         strcmp(json_string_value(act), "swish") != 0)))
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "\"hidden_act\" \"%s\" is not supported (use silu)",
                           json_is_string(act) ? json_string_value(act) : kvf_json_kind(act));

    bool attn_bias = false, use_sw = false;
    if ((st = get_bool(j, "tie_word_embeddings", false, &c->tie_embeddings, err)) != KVF_OK)
        return st;
    switch (c->arch) {
    case KVF_MODEL_ARCH_LLAMA:
        if ((st = get_bool(j, "attention_bias", false, &attn_bias, err)) != KVF_OK ||
            (st = get_bool(j, "mlp_bias", false, &c->mlp_bias, err)) != KVF_OK)
            return st;
        c->qkv_bias = c->o_bias = attn_bias;
        break;
    case KVF_MODEL_ARCH_MISTRAL:
        if ((st = get_i32(j, "sliding_window", false, 0, 1, INT32_MAX, &c->sliding_window, err)) != KVF_OK)
            return st;
        break;
    case KVF_MODEL_ARCH_QWEN2:
        c->qkv_bias = true;
        if ((st = get_bool(j, "use_sliding_window", false, &use_sw, err)) != KVF_OK)
            return st;
        if (use_sw) {
            if ((st = get_i32(j, "sliding_window", true, 0, 1, INT32_MAX, &c->sliding_window, err)) != KVF_OK ||
                (st = get_i32(j, "max_window_layers", false, 28, 0, INT32_MAX, &c->window_first_layer, err)) != KVF_OK)
                return st;
        }
        break;
    }
    if ((st = get_i32(j, "bos_token_id", false, -1, 0, c->vocab_size - 1, &c->bos_id, err)) != KVF_OK ||
        (st = parse_eos(j, c, err)) != KVF_OK)
        return st;

    c->torch_dtype = -1;
    const json_t *td = field(j, "torch_dtype");
    if (td && json_is_string(td)) {
        int d = kvf_dtype_parse(json_string_value(td));
        c->torch_dtype = (d == KVF_DTYPE_F32 || d == KVF_DTYPE_F16 || d == KVF_DTYPE_BF16) ? d : -1;
    }
    return KVF_OK;
}

kvf_status kvf_model_config_parse(const char *json, size_t len, const char *what,
                                  kvf_model_config *out, kvf_err *err)
{
    kvf_err local = {0};
    json_t *j;
    kvf_status st = kvf_json_load_buf(json, len, what, &j, &local);
    if (st != KVF_OK) {
        kvf_err_set(err, st, "model: %s", local.msg);
        return st;
    }
    kvf_model_config c;
    st = parse_obj(j, &c, &local);
    json_decref(j);
    if (st != KVF_OK) {
        kvf_err_set(err, st, "model: %s: %s", what, local.msg);
        return st;
    }
    *out = c;
    return KVF_OK;
}

kvf_status kvf_model_config_load(const char *path, kvf_model_config *out, kvf_err *err)
{
    char buf[4096];
    size_t n = strlen(path);
    if (n < 5 || strcmp(path + n - 5, ".json") != 0)
        snprintf(buf, sizeof buf, "%s/config.json", path);
    else
        snprintf(buf, sizeof buf, "%s", path);
    FILE *f = fopen(buf, "rb");
    if (!f)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "model: cannot open %s (a model directory needs config.json)", buf);
    char *text = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 > cap) {
            cap = cap ? cap * 2 : 16384;
            if (cap > (64u << 20)) {
                free(text);
                fclose(f);
                return kvf_err_set(err, KVF_ERR_LIMIT, "model: %s is larger than 64 MiB", buf);
            }
            char *t = realloc(text, cap);
            if (!t) {
                free(text);
                fclose(f);
                return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory reading %s", buf);
            }
            text = t;
        }
        size_t r = fread(text + len, 1, cap - len, f);
        len += r;
        if (r == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(text);
        return kvf_err_set(err, KVF_ERR_IO, "model: error reading %s", buf);
    }
    kvf_status st = kvf_model_config_parse(text, len, buf, out, err);
    free(text);
    return st;
}

int32_t kvf_model_config_window(const kvf_model_config *c, int32_t layer)
{
    return (c->sliding_window > 0 && layer >= c->window_first_layer) ? c->sliding_window : 0;
}

void kvf_model_config_rope_freqs(const kvf_model_config *c, double *inv_freq, double *pos_scale_out)
{
    int32_t half = c->head_dim / 2;
    *pos_scale_out = c->rope_scaling == KVF_MODEL_ROPE_LINEAR ? 1.0 / c->rope_factor : 1.0;
    for (int32_t i = 0; i < half; i++) {
        double f = pow(c->rope_theta, -(2.0 * i) / c->head_dim);
        if (c->rope_scaling == KVF_MODEL_ROPE_LLAMA3) {
            double old = c->rope_orig_max_pos;
            double low_wl = old / c->rope_low_freq_factor, high_wl = old / c->rope_high_freq_factor;
            double wl = 2.0 * M_PI / f;
            if (wl > low_wl) {
                f = f / c->rope_factor;
            } else if (wl >= high_wl) {
                double smooth = (old / wl - c->rope_low_freq_factor) /
                                (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1.0 - smooth) * f / c->rope_factor + smooth * f;
            }
        }
        inv_freq[i] = f;
    }
}

int64_t kvf_model_config_n_params(const kvf_model_config *c)
{
    int64_t d = c->dim, q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * c->hidden_dim;
    if (c->qkv_bias)
        layer += q + 2 * kv;
    if (c->o_bias)
        layer += d;
    if (c->mlp_bias)
        layer += 2 * c->hidden_dim + d;
    int64_t n = (int64_t)c->vocab_size * d + layer * c->n_layers + d;
    if (!c->tie_embeddings)
        n += (int64_t)c->vocab_size * d;
    return n;
}
