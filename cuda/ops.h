/* ops.h: the CUDA backend's kernels other than attention (attn.h), one plain parameter struct
 * and one launcher per op. Plain C: streams are void * (a cudaStream_t), every pointer in a
 * params struct is device memory unless it says host. A launcher checks what it can, launches
 * on the stream and returns a status naming the bad value or the CUDA error; it never waits
 * and never aborts. An op with nothing to do (n 0) launches nothing and returns OK. */
#ifndef KVF_CUDA_OPS_H
#define KVF_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "cuda/cuda.h"
#include "kv/layout.h"

/* out[i][j] = (float)in[i][j] for n elements of src dtype, written as dst dtype. Both of f32,
 * f16, bf16 (fp8-e4m3 too, unscaled). Rounds to nearest even. */
typedef struct kvf_cuda_convert_params {
    const void *src; /* [n] */
    kvf_dtype src_dtype;
    void *dst; /* [n] */
    kvf_dtype dst_dtype;
    int64_t n;
} kvf_cuda_convert_params;
kvf_status kvf_cuda_convert(const kvf_cuda_convert_params *p, void *stream, kvf_err *err);

/* out[i] = table[tokens[i]] as f32 (table f32, f16 or bf16). */
typedef struct kvf_cuda_embed_params {
    const void *table; /* [n_rows][cols] */
    kvf_dtype dtype;
    int64_t n_rows, cols;
    const int32_t *tokens; /* [n], each in 0..n_rows-1 (the forward pass checked) */
    int64_t n;
    float *out; /* [n][cols] */
} kvf_cuda_embed_params;
kvf_status kvf_cuda_embed(const kvf_cuda_embed_params *p, void *stream, kvf_err *err);

/* out[i] = x[rows[i]], rows of row_len floats. */
typedef struct kvf_cuda_gather_params {
    const float *x;
    int64_t row_len;
    const int32_t *rows; /* [n] */
    int64_t n;
    float *out; /* [n][row_len]; must not overlap x */
} kvf_cuda_gather_params;
kvf_status kvf_cuda_gather(const kvf_cuda_gather_params *p, void *stream, kvf_err *err);

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w over n rows of d. out may be x. */
typedef struct kvf_cuda_rmsnorm_params {
    const float *x; /* [n][d] */
    const float *w; /* [d] */
    int64_t n, d;
    float eps;
    float *out; /* [n][d] */
} kvf_cuda_rmsnorm_params;
kvf_status kvf_cuda_rmsnorm(const kvf_cuda_rmsnorm_params *p, void *stream, kvf_err *err);

/* Rotates pairs (j, j + head_dim/2) of every head by cos_sin[t][j] (model/backend.h). */
typedef struct kvf_cuda_rope_params {
    float *x; /* [n][n_heads][head_dim], in place */
    int64_t n;
    int32_t n_heads, head_dim; /* head_dim even */
    const float *cos_sin; /* [n][head_dim/2][2] */
} kvf_cuda_rope_params;
kvf_status kvf_cuda_rope(const kvf_cuda_rope_params *p, void *stream, kvf_err *err);

/* Elementwise: SWIGLU out = silu(a) * b; ADD out = a + b (out may alias a or b). */
typedef enum kvf_cuda_eltwise_op { KVF_CUDA_SWIGLU = 0, KVF_CUDA_ADD = 1 } kvf_cuda_eltwise_op;
typedef struct kvf_cuda_eltwise_params {
    kvf_cuda_eltwise_op op;
    const float *a, *b; /* [n] */
    float *out;         /* [n] */
    int64_t n;
} kvf_cuda_eltwise_params;
kvf_status kvf_cuda_eltwise(const kvf_cuda_eltwise_params *p, void *stream, kvf_err *err);

/* y[i][r] += bias[r] over n rows of `rows`. */
typedef struct kvf_cuda_bias_params {
    float *y; /* [n][rows] */
    const float *bias; /* [rows] */
    int64_t n, rows;
} kvf_cuda_bias_params;
kvf_status kvf_cuda_bias_add(const kvf_cuda_bias_params *p, void *stream, kvf_err *err);

/* Writes k and v ([n][n_kv_heads][head_dim] f32) of `layer` into the block-major pool at
 * slots[i] = block * block_size + offset, as the layout's dtype (kvf_kv_offset's formula).
 * fp8-e4m3: stored = fp8(value / scale), saturating at +-448. */
typedef struct kvf_cuda_kv_write_params {
    void *pool; /* [n_blocks][layout.block_bytes] */
    kvf_kv_layout layout;
    int32_t layer;
    const float *k, *v;
    const int64_t *slots; /* [n] */
    int64_t n;
    float k_scale, v_scale; /* fp8 only; > 0 */
} kvf_cuda_kv_write_params;
kvf_status kvf_cuda_kv_write(const kvf_cuda_kv_write_params *p, void *stream, kvf_err *err);

/* out[i] = the index of the largest value of row i of logits[n][vocab], ties to the lowest id
 * (NaN never wins; a row of NaN gives 0). */
typedef struct kvf_cuda_argmax_params {
    const float *logits;
    int64_t n, vocab;
    int32_t *out; /* [n] device */
} kvf_cuda_argmax_params;
kvf_status kvf_cuda_argmax(const kvf_cuda_argmax_params *p, void *stream, kvf_err *err);

/* One draw per row (see kvf_cuda_sample in cuda.h for the rule and kvf_cuda_sample_row). */
typedef struct kvf_cuda_sample_params {
    const float *logits; /* [n][vocab] */
    int64_t n, vocab;
    const kvf_cuda_sample_row *rows; /* [n] device */
    int32_t *out;                    /* [n] device */
} kvf_cuda_sample_params;
kvf_status kvf_cuda_sample_launch(const kvf_cuda_sample_params *p, void *stream, kvf_err *err);

#endif
