/* sample.c: xoshiro256** seeded by splitmix64, and temperature / top-k / top-p sampling over
 * one logits row with a preallocated candidate array. */
#include "engine/sample.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void kvf_engine_rng_seed(kvf_engine_rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ (stream * 0xD1B54A32D192ED03ull);
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
    if (!(r->s[0] | r->s[1] | r->s[2] | r->s[3]))
        r->s[0] = 1; /* the all-zero state is a fixed point */
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t kvf_engine_rng_next(kvf_engine_rng *r)
{
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double kvf_engine_rng_uniform(kvf_engine_rng *r)
{
    return (double)(kvf_engine_rng_next(r) >> 11) * 0x1.0p-53;
}

kvf_status kvf_engine_sampler_init(kvf_engine_sampler *s, int32_t vocab, kvf_err *err)
{
    s->vocab = vocab;
    s->cand = malloc((size_t)(vocab > 0 ? vocab : 1) * sizeof *s->cand);
    if (!s->cand)
        return kvf_err_set(err, KVF_ERR_NOMEM, "engine: out of memory for a sampler of %d ids", vocab);
    return KVF_OK;
}

void kvf_engine_sampler_fini(kvf_engine_sampler *s)
{
    free(s->cand);
    s->cand = NULL;
}

int32_t kvf_engine_argmax(const float *logits, int32_t vocab)
{
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best])
            best = i;
    return best;
}

/* Larger logit first; equal logits by lower id. */
static inline int cand_before(const kvf_engine_cand *a, const kvf_engine_cand *b)
{
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int cand_cmp(const void *pa, const void *pb)
{
    const kvf_engine_cand *a = pa, *b = pb;
    return cand_before(a, b) ? -1 : cand_before(b, a) ? 1 : 0;
}

/* Sift-down in a heap of k candidates whose root is the one that comes LAST in order. */
static void heap_down(kvf_engine_cand *h, int32_t k, int32_t i)
{
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && cand_before(&h[m], &h[l]))
            m = l;
        if (r < k && cand_before(&h[m], &h[r]))
            m = r;
        if (m == i)
            return;
        kvf_engine_cand t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* Puts the top k candidates of logits into s->cand[0..k), sorted; returns k. */
static int32_t top_candidates(kvf_engine_sampler *s, const float *logits, int32_t k)
{
    int32_t v = s->vocab;
    kvf_engine_cand *c = s->cand;
    if (k <= 0 || k >= v) {
        for (int32_t i = 0; i < v; i++)
            c[i] = (kvf_engine_cand){logits[i], i};
        qsort(c, (size_t)v, sizeof *c, cand_cmp);
        return v;
    }
    for (int32_t i = 0; i < k; i++)
        c[i] = (kvf_engine_cand){logits[i], i};
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        heap_down(c, k, i);
    for (int32_t i = k; i < v; i++) {
        kvf_engine_cand x = {logits[i], i};
        if (cand_before(&x, &c[0])) {
            c[0] = x;
            heap_down(c, k, 0);
        }
    }
    qsort(c, (size_t)k, sizeof *c, cand_cmp);
    return k;
}

/* Candidates for top-p over the whole vocabulary without sorting all of it: a token whose
 * probability is below (1 - top_p) / vocab cannot be in the top-p set, because all such tokens
 * together hold less than 1 - top_p of the mass. Puts the others in s->cand, sorted, with
 * their unnormalised probabilities, and returns how many; *total_out gets the whole mass. */
static int32_t top_p_candidates(kvf_engine_sampler *s, const float *logits, double inv_t,
                                float top_p, double *total_out)
{
    int32_t v = s->vocab, k = 0;
    float mx = logits[kvf_engine_argmax(logits, v)];
    double total = 0;
    for (int32_t i = 0; i < v; i++)
        total += exp(((double)logits[i] - mx) * inv_t);
    double thr = (1.0 - (double)top_p) / v * total;
    for (int32_t i = 0; i < v; i++)
        if (exp(((double)logits[i] - mx) * inv_t) >= thr)
            s->cand[k++] = (kvf_engine_cand){logits[i], i};
    qsort(s->cand, (size_t)k, sizeof *s->cand, cand_cmp);
    *total_out = total;
    return k;
}

int32_t kvf_engine_sample(kvf_engine_sampler *s, const float *logits, float temperature,
                          int32_t top_k, float top_p, kvf_engine_rng *rng)
{
    int32_t v = s->vocab;
    if (!(temperature > 0))
        return kvf_engine_argmax(logits, v);
    double inv_t = 1.0 / temperature;
    bool all = top_k <= 0 || top_k >= v;
    if (all && !(top_p < 1.0f)) {
        /* The whole vocabulary: no ordering needed, draw in id order. */
        float mx = logits[kvf_engine_argmax(logits, v)];
        double sum = 0;
        for (int32_t i = 0; i < v; i++)
            sum += exp(((double)logits[i] - mx) * inv_t);
        double u = kvf_engine_rng_uniform(rng) * sum, acc = 0;
        int32_t last = 0;
        for (int32_t i = 0; i < v; i++) {
            double p = exp(((double)logits[i] - mx) * inv_t);
            if (p <= 0)
                continue;
            last = i;
            acc += p;
            if (u < acc)
                return i;
        }
        return last;
    }
    double total = 0;
    int32_t k = all ? top_p_candidates(s, logits, inv_t, top_p, &total)
                    : top_candidates(s, logits, top_k);
    kvf_engine_cand *c = s->cand;
    /* the largest logit of the vocabulary is c[0] either way */
    double mx = c[0].logit, sum = 0;
    for (int32_t i = 0; i < k; i++) {
        double p = exp(((double)c[i].logit - mx) * inv_t);
        c[i].logit = (float)p; /* reuse the slot for the unnormalised probability */
        sum += p;
    }
    if (!all)
        total = sum; /* top-p applies to the top-k distribution */
    if (top_p < 1.0f) {
        double want = (double)top_p * total, acc = 0;
        int32_t keep = 0;
        while (keep < k) {
            acc += c[keep++].logit;
            if (acc >= want)
                break;
        }
        k = keep;
        sum = acc;
    }
    double u = kvf_engine_rng_uniform(rng) * sum, acc = 0;
    for (int32_t i = 0; i < k; i++) {
        acc += c[i].logit;
        if (u < acc)
            return c[i].id;
    }
    return c[k - 1].id;
}
