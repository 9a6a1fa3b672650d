/* attn_ref.h: the split-context paged-attention algorithm of attn.cu, written once more in plain
 * C on host memory, so a machine without a GPU can check it against the CPU backend. Also the
 * constants both sides share (partition length, heads per CTA, workspace layout). */
#ifndef KVF_CUDA_ATTN_REF_H
#define KVF_CUDA_ATTN_REF_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "cuda/attn.h"

/* Context positions per partition: partition p of a token covers positions
 * [p * len, (p + 1) * len) intersected with its visible range. len = part_len(n_tokens,
 * n_heads, max_ctx) is 256 (max_ctx <= 256: one partition), halved down to 64 while
 * n_tokens * n_heads * partitions stays under KVF_CUDA_ATTN_SPLIT_TARGET, so a small batch
 * still gives the GPU enough CTAs while a large one keeps the workspace traffic small. A call
 * splits (workspace + reduce kernel) when it has more than one partition. */
#define KVF_CUDA_ATTN_PART_MAX 256
#define KVF_CUDA_ATTN_PART_MIN 64
#define KVF_CUDA_ATTN_SPLIT_TARGET 2048
/* Query heads one CTA serves from one KV head's loads; a larger GQA group is cut into chunks. */
#define KVF_CUDA_ATTN_HEADS_PER_CTA 8

/* The partition length for a call (64, 128 or 256). */
int32_t kvf_cuda_attention_part_len(int32_t n_tokens, int32_t n_heads, int32_t max_ctx);
/* Partitions of a call: ceil(max_ctx / part_len(...)) (1 when max_ctx <= 0). */
int32_t kvf_cuda_attention_parts(int32_t n_tokens, int32_t n_heads, int32_t max_ctx);

/* Workspace layout when parts > 1, N = n_tokens * n_heads * parts, index
 * i = (token * n_heads + head) * parts + part:
 *   float o[N][head_dim]  (partition output, already divided by its own sum)
 *   float m[N]            (partition max of the scores, base-2 logits)
 *   float l[N]            (partition sum of 2^(score - m))
 * The reduce combines, for one (token, head), partitions lo/len .. pos/len in order:
 *   M = max m_p;  w_p = l_p * 2^(m_p - M);  out = sum(w_p * o_p) / sum(w_p). */

/* The same computation as kvf_cuda_attention with every pointer of p in host memory
 * (including the workspace, with the same size rule): same partitions, same base-2 online
 * softmax per partition, same reduce order. It is the partition kernel's order for every token;
 * a prefill chunk's tokens on the tile kernel (p->n_seqs < p->n_tokens) rescale their running
 * sums pass by pass, so they agree with it to rounding, not bit for bit. Checks p as the launcher does, except that
 * per-token positions are also checked here (a token with tok_pos outside [0, max_ctx) gets
 * zeros on the GPU and KVF_ERR_INVALID here). */
kvf_status kvf_cuda_attn_ref(const kvf_cuda_attn_params *p, kvf_err *err);

/* The parameter check shared by the launcher and the reference (everything that can be
 * checked without reading device memory). */
kvf_status kvf_cuda_attn_check(const kvf_cuda_attn_params *p, kvf_err *err);

#endif
