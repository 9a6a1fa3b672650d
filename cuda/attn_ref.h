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
/* The tile kernels: (token, query head) rows per CTA of the f32 one and of the tensor-core
 * (mma) one, and about how many CTAs of KVF_CUDA_ATTN_MMA_ROWS rows their split aims for
 * (several per SM of a large GPU; the f32 kernel makes four times as many). */
#define KVF_CUDA_ATTN_TILE_ROWS 16
#define KVF_CUDA_ATTN_MMA_ROWS 64
#define KVF_CUDA_ATTN_TILE_CTA_TARGET 1024
/* What decode_kernel AUTO runs: 0 the SIMT partition kernel, 1 the tensor-core one where it
 * serves. 0 until a GPU measures the tensor-core kernel faster (docs/BENCHMARKS.md). */
#define KVF_CUDA_ATTN_AUTO_MMA 0

/* The partition kernel's partition length for a call (64, 128 or 256). */
int32_t kvf_cuda_attention_part_len(int32_t n_tokens, int32_t n_heads, int32_t max_ctx);
/* The partition kernel's partitions: ceil(max_ctx / part_len(...)) (1 when max_ctx <= 0). */
int32_t kvf_cuda_attention_parts(int32_t n_tokens, int32_t n_heads, int32_t max_ctx);

/* Whether a call runs a tile kernel (for its prefill chunks' tokens; below) beside the
 * partition kernel: it has prefill chunks, 0 < n_seqs < n_tokens. */
int kvf_cuda_attention_tiled(int32_t n_tokens, int32_t n_seqs);
/* The tile kernels' partition length: a multiple of 256 (they loop over a partition in passes,
 * so length costs no shared memory), long enough that a call makes about
 * KVF_CUDA_ATTN_TILE_CTA_TARGET CTAs counting one per 64 (token, head) rows per partition, and
 * never shorter than 256: a 2048-token step at 32k is one partition (no workspace, no reduce),
 * a 16-token chunk there is 128 partitions of 256. */
int32_t kvf_cuda_attention_tile_part_len(int32_t n_tokens, int32_t n_heads, int32_t max_ctx);
/* The split a call uses, whichever kernel runs it: its partitions, and the length in *len_out. */
int32_t kvf_cuda_attention_split(int32_t n_tokens, int32_t n_seqs, int32_t n_heads,
                                 int32_t max_ctx, int32_t *len_out);

/* Workspace layout when the split (kvf_cuda_attention_split) has parts > 1,
 * N = n_tokens * n_heads * parts, index
 * i = (token * n_heads + head) * parts + part:
 *   float o[N][head_dim]  (partition output, already divided by its own sum)
 *   float m[N]            (partition max of the scores, base-2 logits)
 *   float l[N]            (partition sum of 2^(score - m))
 * The reduce combines, for one (token, head), partitions lo/len .. pos/len in order:
 *   M = max m_p;  w_p = l_p * 2^(m_p - M);  out = sum(w_p * o_p) / sum(w_p). */

/* A step with prefill chunks (kvf_cuda_attention_tiled) serves the tokens that are alone in
 * their sequence (decode tokens) on the partition kernel, with the partition split of n_tokens
 * (kvf_cuda_attention_part_len) and one workspace row per sequence instead of per token, and
 * every other token on a tile kernel with the split above. Its workspace, in floats from the
 * start: the tile kernel's partials (the layout above, when its parts > 1), at lone_off the
 * lone tokens' partials (the same layout with sequence in place of token, when lone_parts > 1),
 * and at count_off two int32 arrays of n_seqs: tokens per sequence and one token of each (a
 * counting kernel fills them first). For other steps only the first part exists. */
typedef struct kvf_cuda_attn_ws {
    int32_t parts, part_len;           /* the call's split (kvf_cuda_attention_split) */
    int32_t lone_parts, lone_part_len; /* the lone tokens' split (a step with prefill chunks) */
    size_t lone_off, count_off;        /* in floats; 0 when absent */
    size_t bytes;                      /* the whole workspace (0: none) */
} kvf_cuda_attn_ws;
void kvf_cuda_attention_ws(int32_t n_tokens, int32_t n_seqs, int32_t n_heads, int32_t head_dim,
                           int32_t max_ctx, kvf_cuda_attn_ws *out);

/* The same computation as kvf_cuda_attention with every pointer of p in host memory
 * (including the workspace, with the same size rule): every token on the call's split
 * (kvf_cuda_attention_split), base-2 softmax per partition, the same reduce formula (the
 * reduce kernel sums the partitions in another order: by rows of threads, then across them).
 * Within a partition it is the partition kernel's order. A call with prefill chunks differs on the GPU:
 * the tile kernels rescale their running sums pass by pass, and the decode tokens take the
 * partition kernel's split; there the two agree to rounding, not bit for bit. Checks p as the launcher does, except that
 * per-token positions are also checked here (a token with tok_pos outside [0, max_ctx) gets
 * zeros on the GPU and KVF_ERR_INVALID here). */
kvf_status kvf_cuda_attn_ref(const kvf_cuda_attn_params *p, kvf_err *err);

/* The parameter check shared by the launcher and the reference (everything that can be
 * checked without reading device memory). */
kvf_status kvf_cuda_attn_check(const kvf_cuda_attn_params *p, kvf_err *err);

#endif
