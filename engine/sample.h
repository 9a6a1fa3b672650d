/* sample.h: the engine's token sampling: a per-sequence random generator (xoshiro256**, seeded
 * through splitmix64 from the request seed and the sample index), vLLM's logit processing
 * (min_tokens, logit_bias, repetition / frequency / presence penalties, min_p), one draw from a
 * logits row under temperature, top-k and top-p, and log-probabilities of a row. Reads only the
 * row it is given, so a sequence's tokens do not depend on what else is in the batch. Scratch
 * is sized once (no allocation per draw); which sequences come here is engine.c's choice. */
#ifndef KVF_ENGINE_SAMPLE_H
#define KVF_ENGINE_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/engine.h"

typedef struct kvf_engine_rng {
    uint64_t s[4];
} kvf_engine_rng;

/* Seeds r for stream `stream` (the sample index) of seed. */
void kvf_engine_rng_seed(kvf_engine_rng *r, uint64_t seed, uint64_t stream);
uint64_t kvf_engine_rng_next(kvf_engine_rng *r);
/* Uniform in [0, 1) with 53 random bits. */
double kvf_engine_rng_uniform(kvf_engine_rng *r);

typedef struct kvf_engine_cand {
    float logit, w; /* w: exp((logit - max) / temperature) */
    int32_t id;
} kvf_engine_cand;

#define KVF_ENGINE_SAMPLE_BUCKETS 4096 /* of the top-p search */

typedef struct kvf_engine_sampler {
    int32_t vocab;
    kvf_engine_cand *cand; /* [vocab] */
    float *w;              /* [vocab] */
    double *hist;          /* [KVF_ENGINE_SAMPLE_BUCKETS] */
    /* kvf_engine_process_logits' counting scratch: all zero between calls */
    int32_t *count;   /* [vocab] occurrences of an id in the output so far */
    uint8_t *seen;    /* [vocab] 1: the id is in the prompt or the output */
    int32_t *touched; /* [vocab] the ids whose count or seen was set, to reset them */
} kvf_engine_sampler;

kvf_status kvf_engine_sampler_init(kvf_engine_sampler *s, int32_t vocab, kvf_err *err);
void kvf_engine_sampler_fini(kvf_engine_sampler *s);

/* The index of the largest logit, ties to the lowest id. */
int32_t kvf_engine_argmax(const float *logits /* [vocab] */, int32_t vocab);

/* One token from logits: greedy when temperature <= 0; otherwise one uniform u from rng and the
 * rule of kvf_backend_sample (model/backend.h; written out at kvf_cuda_sample in cuda/cuda.h),
 * so the host and a GPU draw the same token from the same row and u, up to rounding: NaN is
 * never kept; the top_k cut keeps every logit >= the k-th largest (0: all; ties kept); the
 * top_p cut keeps every logit >= the largest value whose kept mass (of
 * softmax(logits / temperature) over the top-k set) reaches top_p (1: all; ties kept); then
 * the kept token, in id order, at which the running mass first exceeds u times the kept mass.
 * A row whose largest logit is +inf or -inf, or a temperature so small that 1/temperature
 * overflows a float (below about 2.9e-39), takes the argmax instead. A pure function of
 * (logits, parameters, rng state). */
int32_t kvf_engine_sample(kvf_engine_sampler *s, const float *logits /* [vocab] */,
                          float temperature, int32_t top_k, float top_p, kvf_engine_rng *rng);

/* vLLM's (V1 sampler) logit processing of one row, in place, in this order:
 *   1. min_tokens: while n_output < sp->min_tokens, logit[id] = -inf for every stop id and
 *      eos id of sp (so none of them can be drawn or picked greedily);
 *   2. logit_bias: logit[id] += bias for each sp->bias entry;
 *   3. repetition_penalty p (off at 0 and 1), for every id in the prompt or the output so far:
 *      logit = logit > 0 ? logit / p : logit * p;
 *   4. frequency_penalty f and presence_penalty r, for every id of the output so far, c its
 *      count there: logit -= f * c + r * (c > 0);
 *   5. min_p m (off at 0; only when sp->temperature > 0, as vLLM leaves greedy alone): keep the
 *      ids whose probability under softmax(logit / T) is >= m times the largest one, that is
 *      logit >= max + T * ln(m); the others get -inf (NaN is never kept).
 * Temperature itself, top_k and top_p are the draw's (kvf_engine_sample, which takes the same
 * T); a greedy sequence takes the processed row's argmax. tokens holds the prompt then the
 * output: [n_prompt + n_output]. Uses s's counting scratch (left zeroed): no allocation. */
void kvf_engine_process_logits(kvf_engine_sampler *s, float *logits /* [vocab] */,
                               const kvf_engine_sampling *sp,
                               const int32_t *tokens /* [n_prompt + n_output] */,
                               int32_t n_prompt, int32_t n_output);

/* Whether kvf_engine_process_logits would change a row of a sequence with parameters sp that
 * has n_output tokens so far (a penalty, a bias, min_p with a temperature, or min_tokens not
 * yet reached with stop or eos ids to block). */
bool kvf_engine_processes(const kvf_engine_sampling *sp, int32_t n_output);

/* Log-probabilities of a raw row: log_softmax(logits) computed in double (max-shifted sum; NaN
 * ids count as absent). Returns token's and writes the n_top largest to top_out, largest first,
 * ties to the lower id; *n_top_out gets how many (fewer when the row has fewer non-NaN ids).
 * token may be -1 (then NaN is returned). */
float kvf_engine_logprobs(const float *logits /* [vocab] */, int32_t vocab, int32_t token,
                          int32_t n_top, kvf_engine_logprob *top_out /* [n_top] */,
                          int32_t *n_top_out);

#endif
