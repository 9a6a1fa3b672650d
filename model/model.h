/* model.h: a loaded Hugging Face model directory: its config and a view of every weight the
 * forward pass needs, each checked for presence, dtype (F32/F16/BF16) and shape at load time.
 * Weights stay in the memory-mapped files; the backend makes its own form (forward.h). */
#ifndef KVF_MODEL_MODEL_H
#define KVF_MODEL_MODEL_H

#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kv/layout.h"
#include "model/config.h"
#include "model/safetensors.h"

/* One decoder layer's tensors; biases are NULL when the config has none. */
typedef struct kvf_model_layer {
    const kvf_model_tensor *attn_norm;            /* [dim] */
    const kvf_model_tensor *wq, *wk, *wv, *wo;    /* [H*D][dim], [Hkv*D][dim] x2, [dim][H*D] */
    const kvf_model_tensor *bq, *bk, *bv, *bo;    /* [H*D], [Hkv*D] x2, [dim] */
    const kvf_model_tensor *ffn_norm;             /* [dim] */
    const kvf_model_tensor *w_gate, *w_up, *w_down; /* [hidden][dim] x2, [dim][hidden] */
    const kvf_model_tensor *b_gate, *b_up, *b_down;
} kvf_model_layer;

typedef struct kvf_model {
    kvf_model_config cfg;
    char dir[1024];
    kvf_model_safetensors *st;
    const kvf_model_tensor *embed;      /* [vocab][dim] */
    const kvf_model_tensor *final_norm; /* [dim] */
    const kvf_model_tensor *lm_head;    /* [vocab][dim]; == embed when tied */
    kvf_model_layer *layers;            /* [n_layers] */
    kvf_dtype weight_dtype;             /* of the projection weights (the first layer's wq) */
} kvf_model;

/* Loads dir (config.json + model.safetensors or a sharded index). Errors name the tensor, the
 * shape expected and the shape found. The caller owns *out (kvf_model_destroy). */
kvf_status kvf_model_load(const char *dir, kvf_model **out, kvf_err *err);
void kvf_model_destroy(kvf_model *m);

/* The KV layout of this model for a block size and KV dtype. */
kvf_status kvf_model_kv_layout(const kvf_model *m, int32_t block_size, kvf_dtype dtype,
                               kvf_kv_layout *out, kvf_err *err);

/* The `kvfleet plan` figures of a pool of n_blocks for this model, as one line into buf:
 * "KV f32: 512 bytes/token, 8192 bytes/block (16 tokens); pool 128 blocks = 2048 tokens
 * (1048576 bytes), 16 sequences of 128 tokens". Returns buf. */
const char *kvf_model_capacity_str(const kvf_kv_layout *l, int64_t n_blocks, int64_t context,
                                   char *buf, size_t cap);

#endif
