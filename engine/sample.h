/* sample.h: the engine's token sampling: a per-sequence random generator (xoshiro256**, seeded
 * through splitmix64 from the request seed and the sample index) and one draw from a logits row
 * under temperature, top-k and top-p. Reads only the row it is given, so a sequence's tokens do
 * not depend on what else is in the batch. Scratch is sized once (no allocation per draw). */
#ifndef KVF_ENGINE_SAMPLE_H
#define KVF_ENGINE_SAMPLE_H

#include <stdint.h>

#include "common/status.h"

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

#endif
