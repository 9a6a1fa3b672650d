/* attn.h: paged attention on the GPU over the block-major KV pool (kv/layout.h), for a step
 * that mixes prefill chunks (causal, over a cached prefix) and decode tokens. Plain C: the
 * stream is passed as void * (a cudaStream_t). The launcher checks every parameter and returns
 * a status naming an unsupported value; it never aborts. Kernels live in attn.cu. */
#ifndef KVF_CUDA_ATTN_H
#define KVF_CUDA_ATTN_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kv/layout.h"
#include "model/backend.h" /* KVF_BACKEND_ATTN_DECODE_* */

/* One attention call: every pointer is device memory. Token t belongs to the sequence whose
 * block table is row tok_seq[t] of block_tables and sits at position tok_pos[t]; it attends
 * to positions max(0, tok_pos[t] - window + 1) .. tok_pos[t] of that sequence (window 0: from
 * 0), whose K/V are already in the pool (kv_write ran before). GQA: query head h reads KV head
 * h / (n_heads / n_kv_heads). */
typedef struct kvf_cuda_attn_params {
    const float *q;               /* [n_tokens][n_heads][head_dim] */
    float *out;                   /* [n_tokens][n_heads][head_dim] */
    const void *pool;             /* the pool base: [n_blocks][layout.block_bytes] */
    kvf_kv_layout layout;         /* dtype f32, f16, bf16 or fp8-e4m3 */
    int32_t layer;
    int32_t n_tokens, n_heads;    /* n_kv_heads and head_dim come from layout */
    int32_t n_seqs;               /* sequences in the step (rows of block_tables in use); 0 =
                                   * not known. Picks the kernels and the split: with 0 < n_seqs <
                                   * n_tokens (prefill chunks) a tile kernel serves the chunks'
                                   * tokens, reading each K/V row once for a tile of 16 or 64
                                   * (token, head) rows, over few long partitions, and the
                                   * partition kernel the tokens alone in their sequence (decode
                                   * tokens); otherwise the partition kernel serves every token,
                                   * one per CTA. The answer does not depend on it beyond
                                   * rounding; the workspace size does */
    const int32_t *tok_seq;       /* [n_tokens] */
    const int32_t *tok_pos;       /* [n_tokens] */
    const int32_t *block_tables;  /* [n_seqs][max_blocks] */
    int32_t max_blocks;           /* row stride of block_tables */
    int32_t max_ctx;              /* bound on tok_pos + 1 for every token: sizes the grid, so a
                                   * step with the same (n_tokens, max_ctx) launches the same way
                                   * (CUDA graphs); positions are read from tok_pos */
    int32_t window;               /* 0 = all */
    float scale;                  /* softmax scale, 1/sqrt(head_dim) */
    float k_scale, v_scale;       /* fp8-e4m3 KV: real value = stored value * scale; ignored
                                   * (treated as 1) for other dtypes */
    float *workspace;             /* split-context partials, kvf_cuda_attention_workspace_bytes */
    size_t workspace_bytes;
    int32_t decode_kernel;        /* KVF_BACKEND_ATTN_DECODE_* (model/backend.h; 0: auto): the
                                   * kernel of decode tokens; same split and workspace */
} kvf_cuda_attn_params;

/* Whether KVF_BACKEND_ATTN_DECODE_MMA runs the tensor-core kernel for this layout (1) or falls
 * back to the SIMT one (0). */
int kvf_cuda_attn_decode_mma_serves(const kvf_kv_layout *layout);

/* Bytes of workspace kvf_cuda_attention needs for these shapes (0 when it splits nothing);
 * n_seqs as in the parameters (0 gives the most any n_seqs needs). */
size_t kvf_cuda_attention_workspace_bytes(int32_t n_tokens, int32_t n_seqs, int32_t n_heads,
                                          int32_t head_dim, int32_t max_ctx);

/* Checks a shape once (at model load): KVF_ERR_UNSUPPORTED naming head_dim, block_size or
 * dtype when no kernel exists for it, with the supported list. */
kvf_status kvf_cuda_attention_supports(const kvf_kv_layout *layout, int32_t n_heads,
                                       kvf_err *err);

/* Launches the attention for p on stream (a cudaStream_t; NULL: the default stream). Returns
 * after launch, not after completion. */
kvf_status kvf_cuda_attention(const kvf_cuda_attn_params *p, void *stream, kvf_err *err);

#endif
