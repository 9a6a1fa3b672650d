/* engine.h: the continuous-batching step loop of a decode (or colocated) worker: requests join
 * and leave the running batch every step, a token budget per step with chunked prefill,
 * admission only when a step's blocks can all be allocated, preemption of the newest sequence
 * (recompute or swap, chosen by cost), sampling, n > 1 through copy-on-write forks, and the
 * prefix cache, for every role: a decode (or colocated) worker's Generate, and a prefill
 * worker's prefill-only requests (kvf_engine_request.prefill_only). It owns one KV pool
 * (kv/pool.h) and one forward pass (model/forward.h); the transport, RPCs and tokenizer are the
 * workers'. Single-threaded: one thread calls everything.
 *
 * The life of a request: kvf_engine_add queues it (WAITING); a step admits it (RUNNING) once
 * its first chunk's blocks fit, reusing every full cached block of its prefix; each step runs
 * one prefill chunk or one decode token for it and, when the prompt (or a decode token) is
 * done, samples the next token and reports it in that step's outputs. Under pressure the newest
 * running sequence is preempted: recomputed later from its tokens (WAITING) or swapped to host
 * memory (SWAPPED); either way it resumes with exactly the tokens an undisturbed run gives,
 * because it keeps its tokens and its own random generator. A finished or cancelled sequence
 * frees its blocks at once (registered ones stay cached for later prompts), except a remote
 * prefill given up while its writer may still write (kvf_engine_hold: held until released) and
 * a prefill-only request, which keeps its blocks (the partial last one too) after its first
 * token until kvf_engine_release_kept: a prefill worker ships them first.
 *
 * The prefix cache serves every full cached block of a prompt except that at least one token
 * is always computed (its logits give the first new token): a prompt of exactly k full blocks
 * reuses k - 1 of them. Memory: kvf_engine_create sizes every per-step buffer and each
 * sequence's block table is reserved for max_ctx when it is added, so a step allocates nothing,
 * except that preemption by recompute re-creates the preempted sequence's table. */
#ifndef KVF_ENGINE_ENGINE_H
#define KVF_ENGINE_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kv/pool.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/model.h"

typedef struct kvf_engine kvf_engine;

#define KVF_ENGINE_MAX_N 16    /* parallel samples per request */
#define KVF_ENGINE_MAX_STOP 16 /* stop ids and eos ids per request (each) */
#define KVF_ENGINE_MAX_TEMPERATURE 1e4f /* sampling temperatures allowed: 0 (greedy) to this */
#define KVF_ENGINE_MAX_BIAS 1024    /* logit_bias entries per request */
#define KVF_ENGINE_MAX_LOGPROBS 20  /* top logprobs per token, as OpenAI allows */

typedef enum kvf_engine_preempt {
    KVF_ENGINE_PREEMPT_AUTO = 0,      /* by the cost estimate (kvf_engine_preempt_cost) */
    KVF_ENGINE_PREEMPT_RECOMPUTE = 1, /* drop the blocks, prefill again later */
    KVF_ENGINE_PREEMPT_SWAP = 2,      /* copy the blocks to host slots; recompute if none left */
} kvf_engine_preempt;

typedef struct kvf_engine_cfg {
    int32_t n_blocks;     /* KV pool blocks; 0: from kv_bytes */
    int64_t kv_bytes;     /* KV pool bytes when n_blocks is 0 */
    int32_t block_size;   /* tokens per block (power of two) */
    kvf_dtype kv_dtype;   /* f32, f16, bf16 or fp8-e4m3 */
    float kv_k_scale, kv_v_scale; /* fp8-e4m3 KV per-tensor scales (model/backend.h); 0: 1 */
    int32_t max_batch_tokens; /* token budget of one step (prefill chunks + decode tokens) */
    int32_t max_seqs;         /* running sequences at once (<= max_batch_tokens) */
    int32_t max_queued;       /* sequences held at once: running + waiting + swapped */
    int32_t max_ctx;          /* positions per sequence; 0: the model's max_position_embeddings.
                               * Every held sequence reserves max_ctx token ids (4 B each) and
                               * a block table for them: set it for long-context models. */
    int32_t swap_slots;       /* host blocks for swapped sequences; 0: no swap tier */
    bool prefix_cache;        /* reuse cached full blocks of a prompt's prefix (default on) */
    kvf_engine_preempt preempt;
    int32_t threads; /* backend threads; 0: one per online CPU */
    bool half_weights; /* keep F16/BF16 matrices as stored (half the memory, slower decode) */
    int32_t weight_dtype; /* KVF_BACKEND_WEIGHT_* (model/backend.h): f32 (0) or q8 (CPU only) */
    int32_t matrix_dtype; /* GPU: KVF_BACKEND_MATRIX_* (model/backend.h); 0: auto */
    bool no_graphs;       /* GPU: no CUDA graphs for decode steps */
    int32_t attn_decode;  /* GPU: decode attention kernel, KVF_BACKEND_ATTN_DECODE_*; 0: auto */
    const char *model_id; /* for the block hash root (DESIGN.md s.3); NULL: "" */
    /* KV events of the pool (STORED/REMOVED), for a worker that publishes them; may be NULL. */
    kvf_kv_event_fn on_event;
    void *event_ctx;
    /* Host (and disk) KV tiers under the pool (kv/tier.h), made for the layout
     * kvf_model_kv_layout gives for block_size and kv_dtype; NULL: none. Borrowed: it must
     * outlive the engine. */
    kvf_kv_tier *kv_tier;
    /* Cost model for PREEMPT_AUTO: compute rate (FLOP/s) and host copy rate (bytes/s). */
    double flops_per_s, copy_bytes_per_s;
    /* A directory with the model's tokenizer.json: its token bytes are what constrained
     * decoding masks (kvf_engine_sampling.guide_kind). NULL, or a directory without one: guides
     * are refused. */
    const char *tokenizer_dir;
} kvf_engine_cfg;

/* Defaults: 512 blocks of 16 f32 tokens, 512 tokens a step, 32 running, 256 held, 256 swap
 * slots, prefix cache on, auto preemption, 0 threads, cost rates 2e10 FLOP/s and 4e9 B/s. */
void kvf_engine_cfg_default(kvf_engine_cfg *cfg);

/* One logit_bias entry: bias is added to the raw logit of id. */
typedef struct kvf_engine_bias {
    int32_t id;
    float bias; /* [-100, 100] */
} kvf_engine_bias;

typedef struct kvf_engine_sampling {
    int32_t max_tokens;   /* new tokens per sample, >= 1 */
    float temperature;    /* 0: greedy (argmax, ties to the lowest id) */
    int32_t top_k;        /* 0: all */
    float top_p;          /* (0, 1]; 1: all */
    uint64_t seed;        /* per request: sample i draws from its own generator seeded here */
    int32_t n;            /* parallel samples, 1..KVF_ENGINE_MAX_N; they share the prompt's KV */
    int32_t stop_ids[KVF_ENGINE_MAX_STOP]; /* finish (reason STOP) after emitting one of these */
    int32_t n_stop;
    int32_t eos_ids[KVF_ENGINE_MAX_STOP];  /* the same, for the model's end-of-sequence ids */
    int32_t n_eos;
    /* Logit processing before the draw, as vLLM defines it (formulas at
     * kvf_engine_process_logits, engine/sample.h); every zero value is "off". A sequence with
     * any of them (or with logprobs) has its logits row brought to the host and its token
     * chosen there, on every backend; others keep the backend's own draw. */
    float presence_penalty;   /* [-2, 2] */
    float frequency_penalty;  /* [-2, 2] */
    float repetition_penalty; /* (0, 2]; 0 and 1: off */
    float min_p;              /* [0, 1]; applies when temperature > 0 (greedy ignores it) */
    int32_t min_tokens;       /* 0..max_tokens: stop and eos ids cannot be drawn before this
                               * many new tokens */
    int32_t n_bias;           /* 0..KVF_ENGINE_MAX_BIAS; ids in the vocabulary */
    kvf_engine_bias bias[KVF_ENGINE_MAX_BIAS];
    /* Log-probabilities (log-softmax of the raw logits, before any processing, as vLLM's
     * default "raw_logprobs"): of each new token, with the top_logprobs largest beside it. */
    bool logprobs;
    int32_t top_logprobs;     /* 0..KVF_ENGINE_MAX_LOGPROBS */
    /* The same for every prompt token but the first (with top_logprobs beside each): the
     * prompt is then computed without the prefix cache, one token per step. Sample 0 only;
     * refused with a remote prefill (kvf_engine_add_remote). */
    bool prompt_logprobs;
    /* Constrained decoding (text/guide.h, text/grammar.h): every token keeps the output inside
     * the guide (its mask applied to the row before any processing), an end id (stop or eos)
     * only where the output is complete, and a sequence whose output is complete with no end
     * id to take finishes STOP. guide_kind is a kvf_text_guide_kind; the text is borrowed for
     * kvf_engine_add only (the engine compiles it there, on the caller's thread: a new schema
     * holds the step loop for its compile, about 1 ms for 50 properties and 150 ms for 2000
     * (docs/BENCHMARKS.md); recent grammars are kept by their text, so a schema sent again costs
     * nothing). Needs kvf_engine_cfg.tokenizer_dir. Such a sequence draws under the guide's
     * mask: on the backend when it needs nothing else on the host (the GPU sampler reads the
     * mask), else on the host path. A resumed stream (n_prior_output) must have n 1. */
    int32_t guide_kind;
    const char *guide;
    size_t guide_len;
} kvf_engine_sampling;

/* Greedy, n 1, max_tokens 16, top_p 1, no stop or eos ids. */
void kvf_engine_sampling_default(kvf_engine_sampling *s);
/* Sets s's eos ids to the model's (config.json eos_token_id; none when it has none). */
void kvf_engine_sampling_model_eos(kvf_engine_sampling *s, const kvf_model *m);

typedef struct kvf_engine_request {
    uint64_t id;           /* unique among the engine's live requests */
    const int32_t *prompt; /* [n_prompt], copied by kvf_engine_add */
    int32_t n_prompt;      /* >= 1 */
    const char *cache_salt; /* NULL: none; requests with different salts never share KV */
    kvf_engine_sampling sampling;
    /* Compute the prompt and sample its first token (one output, FINISH_PREFILLED), then keep
     * every block of the prompt, the partial last one included, until kvf_engine_release_kept
     * (a prefill worker ships them to a decode worker first). n must be 1; max_tokens, stop and
     * eos ids are not used. Such requests batch with every other request of the engine. */
    bool prefill_only;
    /* The last n_prior_output tokens of prompt are output already (a stream resumed on another
     * worker): a guide is advanced over them before the first new token. */
    int32_t n_prior_output;
} kvf_engine_request;

typedef enum kvf_engine_finish {
    KVF_ENGINE_FINISH_NONE = 0,   /* still running */
    KVF_ENGINE_FINISH_STOP = 1,   /* emitted a stop or eos id */
    KVF_ENGINE_FINISH_LENGTH = 2, /* max_tokens, max_ctx, or the sequence outgrew the pool */
    KVF_ENGINE_FINISH_CANCELLED = 3,
    KVF_ENGINE_FINISH_ERROR = 4,  /* the step failed for it (logged) */
    KVF_ENGINE_FINISH_PREFILLED = 5, /* a prefill-only request's first token: its blocks are
                                      * kept (KEPT) until kvf_engine_release_kept */
} kvf_engine_finish;

const char *kvf_engine_finish_name(kvf_engine_finish f); /* "stop", "length", ... */

/* A token and its log-probability. */
typedef struct kvf_engine_logprob {
    int32_t id;
    float logprob;
} kvf_engine_logprob;

/* One sequence's news in one step: a new token, a finish, or both. */
typedef struct kvf_engine_output {
    uint64_t id;      /* the request */
    int32_t index;    /* its sample, 0..n-1 */
    int32_t token;    /* the new token, -1 when there is none (cancelled, error) */
    int32_t n_generated; /* tokens of this sample so far, this one included */
    kvf_engine_finish finish;
    int64_t n_cached;    /* prompt tokens the prefix cache served at its last admission */
    /* sampling.logprobs: token's log-probability and the n_top largest, largest first (ties
     * to the lower id); logprob is NaN and n_top 0 otherwise, when token is -1, and on outputs
     * made outside a step (a remote prefill's first token). */
    float logprob;
    int32_t n_top;
    kvf_engine_logprob top[KVF_ENGINE_MAX_LOGPROBS];
    /* sampling.prompt_logprobs, on the first output of sample 0 only (else NULL): rows for the
     * prompt tokens 1..n_prompt-1, each 1 + top_logprobs entries (the prompt token's own, then
     * the top; a top entry of id -1 pads a row with fewer ids than asked); engine-owned,
     * valid until the next step. With a one-token prompt: NULL, 0 rows. */
    const kvf_engine_logprob *prompt_lps;
    int32_t n_prompt_lps; /* rows: n_prompt - 1 */
} kvf_engine_output;

typedef struct kvf_engine_stats {
    int32_t running, waiting, swapped, remote; /* sequences in each state (running counts
                                                * promoting ones) */
    int32_t promoting; /* admitted, waiting for their prefix's copies from the KV tiers */
    int32_t held, held_blocks; /* given-up remote prefills holding blocks (kvf_engine_hold) */
    int32_t kept, kept_blocks; /* prefilled prefill-only requests keeping their blocks */
    int32_t free_blocks, cached_blocks, total_blocks;
    int32_t swap_slots_free;
    int64_t steps, prefill_tokens, decode_tokens; /* tokens computed by the forward pass */
    int32_t last_step_seqs; /* sequences the last step computed (0 when it ran none) */
    int64_t prefix_hit_tokens;                    /* prompt tokens served from the cache */
    int64_t preempt_recompute, preempt_swap;
    int64_t finished;
    int64_t backend_draws; /* tokens drawn by the backend (kvf_backend_sample), not the host */
    int64_t step_ns, forward_ns; /* time inside kvf_engine_step, and in its forward passes */
} kvf_engine_stats;

/* Creates an engine over a loaded model (which must outlive it) and a backend (its context is
 * created here with cfg->threads and the other backend fields, before the KV pool, which is
 * allocated through the backend's kv_mem ops: device memory on a GPU). Sizes every per-step
 * buffer now. Errors name the field. */
kvf_status kvf_engine_create(const kvf_model *model, const kvf_backend *be,
                             const kvf_engine_cfg *cfg, kvf_engine **out, kvf_err *err);
/* Frees everything, live sequences included. NULL is a no-op. */
void kvf_engine_destroy(kvf_engine *e);

/* Queues a request. Checks the prompt (ids in the vocabulary, length below max_ctx and within
 * the pool), the sampling parameters and the id (ERR_EXISTS when live); ERR_FULL when
 * max_queued sequences are held already. */
kvf_status kvf_engine_add(kvf_engine *e, const kvf_engine_request *req, kvf_err *err);

/* Runs one step. *out_out points at this step's outputs (engine-owned, valid until the next
 * call); *n_out gets how many. A step with nothing to run returns OK with no outputs. A failing
 * forward pass finishes the step's sequences with FINISH_ERROR (reported next step) and
 * returns its status. */
kvf_status kvf_engine_step(kvf_engine *e, const kvf_engine_output **out_out, int32_t *n_out,
                           kvf_err *err);

/* True while any sequence is waiting, running, swapped or has output left to report. */
bool kvf_engine_busy(const kvf_engine *e);

/* Cancels every sample of request id: frees its blocks (or host slots) now; the next step
 * reports FINISH_CANCELLED for each sample not yet finished. ERR_NOT_FOUND for an unknown id
 * (or one that is held: see kvf_engine_hold). The freed blocks may be handed to the next
 * sequence at once: for a remote prefill whose writer may still write, use kvf_engine_hold. */
kvf_status kvf_engine_cancel(kvf_engine *e, uint64_t id, kvf_err *err);

void kvf_engine_get_stats(const kvf_engine *e, kvf_engine_stats *out);

/* Checks the pool's invariants against every live sequence, and the swap tier's (tests call
 * it after every step). ERR_INTERNAL naming the broken rule. */
kvf_status kvf_engine_check(const kvf_engine *e, kvf_err *err);

/* The pool (for a worker that registers its memory with a transport). Borrowed. */
kvf_kv_pool *kvf_engine_pool(kvf_engine *e);
/* The backend context the engine created (for backend-specific calls such as
 * kvf_cuda_backend_stats). Borrowed. */
void *kvf_engine_backend_ctx(kvf_engine *e);
/* Adds the time of every later forward step, by kind of op, to *p; NULL stops
 * (kvf_model_fwd_set_prof: while on, steps are not recorded as CUDA graphs). */
kvf_status kvf_engine_set_prof(kvf_engine *e, kvf_model_fwd_prof *p, kvf_err *err);

/* The cost estimate behind PREEMPT_AUTO, in seconds: recomputing n_tokens tokens vs copying
 * n_blocks blocks out and back. Swap wins when its cost is lower. */
void kvf_engine_preempt_cost(const kvf_engine *e, int64_t n_tokens, int32_t n_blocks,
                             double *recompute_s_out, double *swap_s_out);

/* ---- remote prefill (a decode worker whose prompts a prefill worker computes) ------------ */

/* Queues a request (n must be 1) whose prompt KV another process writes: looks up the prefix
 * cache, allocates blocks for the rest of the prompt now (ERR_FULL when they do not fit) and
 * hands out the ids of all the prompt's blocks in order (block_ids_out [cap]; *n_blocks_out
 * of them) and how many leading prompt tokens are already cached here (*n_cached_out; the
 * writer may skip those). The sequence holds its blocks and does not run until
 * kvf_engine_remote_done. */
kvf_status kvf_engine_add_remote(kvf_engine *e, const kvf_engine_request *req,
                                 int32_t *block_ids_out /* [cap] */, int32_t cap,
                                 int32_t *n_blocks_out, int64_t *n_cached_out, kvf_err *err);
/* The prompt's KV has landed: registers its full blocks in the prefix cache (STORED events),
 * takes first_token (sampled by the prefill worker) as the first output token (reported by the
 * next step) and joins the running batch. */
kvf_status kvf_engine_remote_done(kvf_engine *e, uint64_t id, int32_t first_token, kvf_err *err);

/* Gives up on remote request id (waiting for kvf_engine_remote_done) whose writer may still
 * be putting bytes into its blocks (a one-sided write cannot be recalled): the next step
 * reports FINISH_CANCELLED as kvf_engine_cancel does, but the blocks stay referenced (HELD):
 * never handed to another sequence and never registered in the prefix cache, until
 * kvf_engine_release_held(id) or until_ns (a kvf_now_ns() time; every step and
 * kvf_engine_release_expired check it). Held blocks count as used in the stats (held,
 * held_blocks) and in kvf_engine_check; kvf_engine_destroy frees them. A held request keeps its
 * slot (max_queued) and its id, and makes the engine busy only until its output is reported.
 * *n_blocks_out (may be NULL) gets how many blocks are held. ERR_NOT_FOUND when id is not a
 * remote request still waiting for its KV. */
kvf_status kvf_engine_hold(kvf_engine *e, uint64_t id, int64_t until_ns, int32_t *n_blocks_out,
                           kvf_err *err);
/* The writer of held request id has stopped: its blocks go back to the pool now (the ones the
 * writer filled FREE, prefix-cache hits CACHED). *n_blocks_out (may be NULL) gets how many.
 * ERR_NOT_FOUND when id is not held (never held, released already, or expired). */
kvf_status kvf_engine_release_held(kvf_engine *e, uint64_t id, int32_t *n_blocks_out,
                                   kvf_err *err);
/* Releases every hold whose until_ns is <= now_ns (INT64_MAX: all, as at shutdown); returns
 * how many. */
int32_t kvf_engine_release_expired(kvf_engine *e, int64_t now_ns);

/* ---- prefill-only requests and per-request state ----------------------------------------- */

typedef enum kvf_engine_req_state {
    KVF_ENGINE_REQ_QUEUED = 0,  /* waiting for admission (or swapped out, or a fork) */
    KVF_ENGINE_REQ_RUNNING = 1, /* admitted: its chunks or tokens run in the steps */
    KVF_ENGINE_REQ_REMOTE = 2,  /* waiting for a remote prefill (kvf_engine_add_remote) */
    KVF_ENGINE_REQ_KEPT = 3,    /* prefill-only, prefilled: blocks kept until released */
    KVF_ENGINE_REQ_HELD = 4,    /* a given-up remote prefill holding its blocks */
    KVF_ENGINE_REQ_FINISHED = 5,
} kvf_engine_req_state;

/* What the engine knows of request id (its sample 0). */
typedef struct kvf_engine_req_info {
    kvf_engine_req_state state;
    int64_t n_computed; /* positions whose KV is in its blocks */
    int64_t n_cached;   /* prompt tokens the prefix cache served at its last admission */
    int64_t admitted_ns; /* kvf_now_ns() of its first admission; 0 before */
    const int32_t *blocks; /* [n_blocks] its block table, borrowed until the next engine call */
    int32_t n_blocks;
} kvf_engine_req_info;

/* ERR_NOT_FOUND when id is not live. */
kvf_status kvf_engine_req_info_get(const kvf_engine *e, uint64_t id, kvf_engine_req_info *out,
                                   kvf_err *err);

/* A prefill-only request that was prefilled (KEPT) gives its blocks back: full ones stay cached
 * for later prompts, the partial last one goes to the free list. *n_blocks_out (may be NULL)
 * gets how many. ERR_NOT_FOUND when id is not kept. */
kvf_status kvf_engine_release_kept(kvf_engine *e, uint64_t id, int32_t *n_blocks_out,
                                   kvf_err *err);

/* ---- run to completion ------------------------------------------------------------------ */

typedef void (*kvf_engine_output_fn)(void *ctx, const kvf_engine_output *o);

/* Steps until nothing is left, passing every output to fn (may be NULL). For single-process
 * generation and tests. */
kvf_status kvf_engine_run(kvf_engine *e, kvf_engine_output_fn fn, void *ctx, kvf_err *err);

/* Adds one request (n must be 1), runs to completion and copies its tokens to out (up to cap;
 * *n_out gets how many were generated) and its finish reason. Other queued requests run too. */
kvf_status kvf_engine_generate(kvf_engine *e, const kvf_engine_request *req,
                               int32_t *out /* [cap] */, int32_t cap, int32_t *n_out,
                               kvf_engine_finish *finish_out, kvf_err *err);

#endif
