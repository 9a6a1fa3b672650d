/* forward.h: the transformer forward pass over a kvf_backend and a paged KV pool: one step
 * mixes prefill chunks and decode tokens, each sequence with its block table. Block allocation,
 * prefix caching and scheduling are the caller's (kv/, engine/). */
#ifndef KVF_MODEL_FORWARD_H
#define KVF_MODEL_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "kv/layout.h"
#include "model/backend.h"
#include "model/model.h"

/* One sequence of a step. */
typedef struct kvf_model_seq {
    const int32_t *tokens;      /* [n_tokens] new tokens (a prefill chunk, or 1 to decode) */
    int32_t n_tokens;           /* >= 1 */
    int32_t start_pos;          /* position of tokens[0]; KV of positions [0, start_pos) is
                                 * already in the blocks */
    const int32_t *block_table; /* [n_blocks] block ids covering start_pos + n_tokens positions */
    int32_t n_blocks;
    /* NULL: next_out gets the greedy id. Else next_out gets a draw made on the backend
     * (kvf_backend_sample; kvf_model_fwd_samples says whether it can). */
    const kvf_backend_sample_row *sample;
} kvf_model_seq;

/* Limits fixed at creation; scratch is sized for them, so a step never allocates. */
typedef struct kvf_model_fwd_opts {
    int32_t max_tokens; /* tokens per step, all sequences together */
    int32_t max_seqs;   /* sequences per step */
    int32_t max_ctx;    /* positions per sequence; 0: max_position_embeddings */
} kvf_model_fwd_opts;

/* A forward-pass instance: the backend's copy of the weights plus step scratch. It is used by
 * one thread at a time (a step uses the backend's own threads); the caller owns it. */
typedef struct kvf_model_fwd kvf_model_fwd;

/* Prepares the weights on the backend (be_ctx from kvf_backend_create) and sizes the scratch.
 * The layout must match the model (layers, kv heads, head_dim); its dtype may be f32, f16, bf16
 * or fp8-e4m3 (scales from the backend's opts). The backend may refuse the layout
 * (kvf_backend_supports: ERR_UNSUPPORTED naming the value). m and be_ctx must outlive *out. */
kvf_status kvf_model_fwd_create(const kvf_model *m, const kvf_backend *be, void *be_ctx,
                                const kvf_kv_layout *layout, const kvf_model_fwd_opts *opts,
                                kvf_model_fwd **out, kvf_err *err);
void kvf_model_fwd_destroy(kvf_model_fwd *f);

/* Runs one step. kv_pool is the pool's base (backend memory, n_pool_blocks * block_bytes).
 * Outputs are for each sequence's last new token: logits_out (host, [n_seqs][vocab]) and
 * next_out (host, [n_seqs]: greedy ids, ties to the lowest id, or the draws of the sequences
 * with `sample`); either may be NULL. Refuses, before touching the pool, a batch beyond the
 * limits, a token outside the vocabulary, a block table too short for the positions, a block
 * id outside the pool, or a `sample` the backend cannot draw (no op, or a value out of range).
 * Returns after the backend's queued work is done (kvf_backend_sync), with the first error the
 * backend recorded during the step. */
kvf_status kvf_model_forward(kvf_model_fwd *f, const kvf_model_seq *seqs /* [n_seqs] */,
                             int32_t n_seqs, void *kv_pool, int64_t n_pool_blocks,
                             float *logits_out, int32_t *next_out, kvf_err *err);

/* Where steps' time goes, by kind of op. An op's time runs from its start to the next op's
 * start, on the backend's own clock (a GPU's queue timestamps: the gaps between kernels count to
 * the op before them); QKV is the three projections, ROPE both rotations, LM_HEAD the last
 * tokens' gather, final norm and projection, OUTPUT the logits' download or the token choice
 * (argmax or draw) with its wait. Decode-only steps ([0]) and steps with prefill chunks ([1])
 * apart. */
typedef enum kvf_fwd_op {
    KVF_FWD_OP_UPLOAD, /* the step's metadata */
    KVF_FWD_OP_EMBED,
    KVF_FWD_OP_NORM, /* both RMSNorms of a layer */
    KVF_FWD_OP_QKV,
    KVF_FWD_OP_ROPE,
    KVF_FWD_OP_KV_WRITE,
    KVF_FWD_OP_ATTENTION,
    KVF_FWD_OP_O_PROJ,
    KVF_FWD_OP_ADD, /* both residual adds of a layer */
    KVF_FWD_OP_GATE_UP,
    KVF_FWD_OP_SWIGLU,
    KVF_FWD_OP_DOWN,
    KVF_FWD_OP_LM_HEAD,
    KVF_FWD_OP_OUTPUT,
    KVF_FWD_OP_COUNT
} kvf_fwd_op;
const char *kvf_fwd_op_name(int op);

typedef struct kvf_model_fwd_prof {
    int64_t steps[2];
    double wall_ms[2]; /* kvf_model_forward's time on the host clock, call to return */
    double op_ms[2][KVF_FWD_OP_COUNT];
    int64_t op_calls[2][KVF_FWD_OP_COUNT];
} kvf_model_fwd_prof;

/* Adds every later step's times to *p (not zeroed here); NULL stops. While on, steps are not
 * recorded as CUDA graphs (each runs op by op, so these are not graph replay's times) and each
 * step has 12 more marks per layer in its queue. Refuses (ERR_NOMEM) only when the marks'
 * table cannot be allocated. */
kvf_status kvf_model_fwd_set_prof(kvf_model_fwd *f, kvf_model_fwd_prof *p, kvf_err *err);
/* The ops' milliseconds summed over kind of op, for steps of kind k (0 or 1). */
double kvf_model_fwd_prof_ms(const kvf_model_fwd_prof *p, int k);

const kvf_model_fwd_opts *kvf_model_fwd_limits(const kvf_model_fwd *f);
/* Whether kvf_model_seq.sample can be used: the backend draws tokens itself. */
bool kvf_model_fwd_samples(const kvf_model_fwd *f);

#endif
