/* config.h: a Hugging Face config.json for the Llama family (model_type llama, mistral, qwen2)
 * read into one plain struct, with errors that name the field, its value and what is allowed.
 * Weights and tokenizer files are read elsewhere (model.h, tokenizer.h). */
#ifndef KVF_MODEL_CONFIG_H
#define KVF_MODEL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"

typedef enum kvf_model_arch {
    KVF_MODEL_ARCH_LLAMA = 0,
    KVF_MODEL_ARCH_MISTRAL = 1,
    KVF_MODEL_ARCH_QWEN2 = 2,
} kvf_model_arch;

typedef enum kvf_model_rope_scaling {
    KVF_MODEL_ROPE_NONE = 0,   /* plain RoPE with rope_theta */
    KVF_MODEL_ROPE_LINEAR = 1, /* positions divided by factor */
    KVF_MODEL_ROPE_LLAMA3 = 2, /* Llama-3.1 frequency-dependent scaling */
} kvf_model_rope_scaling;

#define KVF_MODEL_MAX_HEAD_DIM 512
#define KVF_MODEL_MAX_EOS 8

typedef struct kvf_model_config {
    kvf_model_arch arch;
    int32_t vocab_size;
    int32_t dim;        /* hidden_size */
    int32_t hidden_dim; /* intermediate_size (MLP) */
    int32_t n_layers, n_heads, n_kv_heads, head_dim;
    int32_t max_pos; /* max_position_embeddings */
    float norm_eps;  /* rms_norm_eps */
    double rope_theta;
    kvf_model_rope_scaling rope_scaling;
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int32_t rope_orig_max_pos; /* llama3: original_max_position_embeddings */
    /* Sliding-window attention: a token attends to the last sliding_window positions (itself
     * included) in layers >= window_first_layer; 0 means full attention everywhere. */
    int32_t sliding_window, window_first_layer;
    bool qkv_bias;   /* q/k/v projections have a bias (Qwen2, Llama attention_bias) */
    bool o_bias;     /* o_proj has a bias (Llama attention_bias) */
    bool mlp_bias;   /* gate/up/down have biases (Llama mlp_bias) */
    bool tie_embeddings; /* lm_head is embed_tokens */
    int32_t bos_id;      /* -1 when absent */
    int32_t eos_ids[KVF_MODEL_MAX_EOS];
    int32_t n_eos;
    int torch_dtype; /* a kvf_dtype, or -1 when absent or not f32/f16/bf16 */
} kvf_model_config;

/* Parses config.json text. what names the source in messages ("tiny/config.json"). */
kvf_status kvf_model_config_parse(const char *json, size_t len, const char *what,
                                  kvf_model_config *out, kvf_err *err);
/* Reads path (a config.json, or a directory holding one). */
kvf_status kvf_model_config_load(const char *path, kvf_model_config *out, kvf_err *err);

/* The attention window of a layer: 0 for full attention. */
int32_t kvf_model_config_window(const kvf_model_config *c, int32_t layer);
/* "llama", "mistral", "qwen2". */
const char *kvf_model_arch_name(kvf_model_arch a);
/* The RoPE inverse frequencies (head_dim / 2 of them) after rope_scaling; positions are
 * additionally divided by *pos_scale_out (1 except for linear scaling). */
void kvf_model_config_rope_freqs(const kvf_model_config *c, double *inv_freq /* [head_dim/2] */,
                                 double *pos_scale_out);
/* Parameter count implied by the config (embedding, layers, final norm, separate lm_head). */
int64_t kvf_model_config_n_params(const kvf_model_config *c);

#endif
