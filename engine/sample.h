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
    float logit;
    int32_t id;
} kvf_engine_cand;

typedef struct kvf_engine_sampler {
    int32_t vocab;
    kvf_engine_cand *cand; /* [vocab] */
} kvf_engine_sampler;

kvf_status kvf_engine_sampler_init(kvf_engine_sampler *s, int32_t vocab, kvf_err *err);
void kvf_engine_sampler_fini(kvf_engine_sampler *s);

/* The index of the largest logit, ties to the lowest id. */
int32_t kvf_engine_argmax(const float *logits /* [vocab] */, int32_t vocab);

/* One token from logits: greedy when temperature <= 0; otherwise softmax(logits / temperature)
 * restricted to the top_k largest (0: all), then to the smallest set of largest whose mass
 * reaches top_p (1: all), drawn with one uniform from rng. Candidates are ordered by logit,
 * ties to the lower id, so a draw is a pure function of (logits, parameters, rng state). */
int32_t kvf_engine_sample(kvf_engine_sampler *s, const float *logits /* [vocab] */,
                          float temperature, int32_t top_k, float top_p, kvf_engine_rng *rng);

#endif
