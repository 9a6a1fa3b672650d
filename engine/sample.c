/* sample.c: xoshiro256** seeded by splitmix64, vLLM's logit processing, temperature / top-k /
 * top-p sampling over one logits row with preallocated scratch (the cuts are found by selection,
 * no sort, so a draw costs a few passes over the row and one exp per id) and log-softmax with
 * the top entries of a row. */
#include "engine/sample.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

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
    size_t n = (size_t)(vocab > 0 ? vocab : 1);
    s->vocab = vocab;
    s->cand = malloc(n * sizeof *s->cand);
    s->w = malloc(n * sizeof *s->w);
    s->hist = malloc(KVF_ENGINE_SAMPLE_BUCKETS * sizeof *s->hist);
    s->count = calloc(n, sizeof *s->count);
    s->seen = calloc(n, sizeof *s->seen);
    s->touched = malloc(n * sizeof *s->touched);
    if (!s->cand || !s->w || !s->hist || !s->count || !s->seen || !s->touched) {
        kvf_engine_sampler_fini(s);
        return kvf_err_set(err, KVF_ERR_NOMEM, "engine: out of memory for a sampler of %d ids", vocab);
    }
    return KVF_OK;
}

void kvf_engine_sampler_fini(kvf_engine_sampler *s)
{
    free(s->cand);
    free(s->w);
    free(s->hist);
    free(s->count);
    free(s->seen);
    free(s->touched);
    s->cand = NULL;
    s->w = NULL;
    s->hist = NULL;
    s->count = NULL;
    s->seen = NULL;
    s->touched = NULL;
}

int32_t kvf_engine_argmax(const float *logits, int32_t vocab)
{
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best])
            best = i;
    return best;
}

/* Splits c[0..n) around the value pv: those above it first (*n_gt of them), then those equal
 * (*n_eq), then those below. */
static void split3(kvf_engine_cand *c, int32_t n, float pv, int32_t *n_gt, int32_t *n_eq)
{
    int32_t gt = 0, i = 0, lt = n;
    while (i < lt) {
        kvf_engine_cand x = c[i];
        if (x.logit > pv) {
            c[i++] = c[gt];
            c[gt++] = x;
        } else if (x.logit < pv) {
            c[i] = c[--lt];
            c[lt] = x;
        } else {
            i++;
        }
    }
    *n_gt = gt;
    *n_eq = lt - gt;
}

/* The median of three values of c[0..n), a pivot that keeps sorted runs linear. */
static float pivot_of(const kvf_engine_cand *c, int32_t n)
{
    float a = c[0].logit, b = c[n / 2].logit, d = c[n - 1].logit;
    return a < b ? (b < d ? b : a < d ? d : a) : (a < d ? a : b < d ? d : b);
}

/* Sift-down in a min-heap of values. */
static void heap_down(float *h, int32_t k, int32_t i)
{
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && h[l] < h[m])
            m = l;
        if (r < k && h[r] < h[m])
            m = r;
        if (m == i)
            return;
        float t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* The k-th largest non-NaN value of logits (1 <= k < vocab); -inf when fewer are not NaN. A
 * min-heap of the k largest for small k (one compare per id), selection otherwise. */
static float kth_largest(kvf_engine_sampler *s, const float *logits, int32_t k)
{
    int32_t v = s->vocab, n = 0;
    if ((int64_t)k * 16 <= v) {
        float *h = s->w; /* free until the weights are written */
        for (int32_t i = 0; i < v; i++) {
            float x = logits[i];
            if (x != x)
                continue;
            if (n < k) {
                h[n++] = x;
                if (n == k)
                    for (int32_t j = k / 2 - 1; j >= 0; j--)
                        heap_down(h, k, j);
            } else if (x > h[0]) {
                h[0] = x;
                heap_down(h, k, 0);
            }
        }
        return n < k ? -INFINITY : h[0];
    }
    kvf_engine_cand *c = s->cand;
    for (int32_t i = 0; i < v; i++)
        if (logits[i] == logits[i])
            c[n++] = (kvf_engine_cand){.logit = logits[i], .id = i};
    if (n < k)
        return -INFINITY;
    for (;;) {
        float pv = pivot_of(c, n);
        int32_t gt, eq;
        split3(c, n, pv, &gt, &eq);
        if (k <= gt) {
            n = gt;
        } else if (k <= gt + eq) {
            return pv;
        } else {
            c += gt + eq;
            n -= gt + eq;
            k -= gt + eq;
        }
    }
}

/* The largest value t of c[0..n) whose mass (w of every candidate >= t) reaches want, by
 * weighted selection (c is reordered); the lowest when rounding leaves want out of reach. */
static float mass_threshold(kvf_engine_cand *c, int32_t n, double want)
{
    double above = 0; /* mass of the candidates known to be above the range */
    float lowest = c[0].logit;
    for (int32_t i = 1; i < n; i++)
        lowest = c[i].logit < lowest ? c[i].logit : lowest;
    while (n > 0) {
        float pv = pivot_of(c, n);
        int32_t gt, eq;
        split3(c, n, pv, &gt, &eq);
        double m_gt = 0, m_eq = 0;
        for (int32_t i = 0; i < gt; i++)
            m_gt += c[i].w;
        for (int32_t i = gt; i < gt + eq; i++)
            m_eq += c[i].w;
        if (above + m_gt >= want) {
            n = gt;
        } else if (above + m_gt + m_eq >= want) {
            return pv;
        } else {
            above += m_gt + m_eq;
            c += gt + eq;
            n -= gt + eq;
        }
    }
    return lowest;
}

/* Bucket of a logit for the top-p search: 0 holds the largest. Monotone (a larger logit never
 * lands in a later bucket; equal logits share one), so whole buckets are above or below a cut. */
static inline int32_t bucket_of(float l, float mx, float scale)
{
    float d = (mx - l) * scale;
    return d < (float)(KVF_ENGINE_SAMPLE_BUCKETS - 1) ? (int32_t)d : KVF_ENGINE_SAMPLE_BUCKETS - 1;
}

/* The top-p cut among the ids >= cut whose weights are in s->w (mass z): the bucket where the
 * mass from the top first reaches want, then the exact value by selection inside it. */
static float top_p_cut(kvf_engine_sampler *s, const float *logits, float cut, float mx, double want)
{
    int32_t v = s->vocab;
    float lo = mx;
    for (int32_t i = 0; i < v; i++)
        if (logits[i] >= cut && logits[i] > -INFINITY && logits[i] < lo)
            lo = logits[i];
    float scale = mx > lo ? (float)(KVF_ENGINE_SAMPLE_BUCKETS - 1) / (mx - lo) : 0.0f;
    double *h = s->hist;
    memset(h, 0, KVF_ENGINE_SAMPLE_BUCKETS * sizeof *h);
    for (int32_t i = 0; i < v; i++)
        if (logits[i] >= cut)
            h[bucket_of(logits[i], mx, scale)] += s->w[i];
    double above = 0;
    int32_t b = 0, last = 0;
    for (; b < KVF_ENGINE_SAMPLE_BUCKETS; b++) {
        if (h[b] > 0 || b == 0)
            last = b;
        if (above + h[b] >= want)
            break;
        above += h[b];
    }
    if (b == KVF_ENGINE_SAMPLE_BUCKETS) { /* rounding: the lowest non-empty bucket */
        b = last;
        above -= h[b];
    }
    int32_t n = 0;
    for (int32_t i = 0; i < v; i++)
        if (logits[i] >= cut && bucket_of(logits[i], mx, scale) == b)
            s->cand[n++] = (kvf_engine_cand){.logit = logits[i], .w = s->w[i], .id = i};
    return n > 0 ? mass_threshold(s->cand, n, want - above) : cut;
}

int32_t kvf_engine_sample(kvf_engine_sampler *s, const float *logits, float temperature,
                          int32_t top_k, float top_p, kvf_engine_rng *rng)
{
    int32_t v = s->vocab;
    if (!(temperature > 0))
        return kvf_engine_argmax(logits, v);
    double u = kvf_engine_rng_uniform(rng);
    float inv_t = 1.0f / temperature, mx = -INFINITY;
    for (int32_t i = 0; i < v; i++)
        if (logits[i] == logits[i]) /* NaN is never kept */
            mx = logits[i] > mx ? logits[i] : mx;
    /* nothing has weight (-inf), a +inf logit, or 1/temperature past a float: the weights
     * would be NaN (0 * inf), so the rule takes the argmax (u was drawn all the same) */
    if (mx == -INFINITY || mx == INFINITY || inv_t == INFINITY)
        return kvf_engine_argmax(logits, v);
    /* the top-k cut: the k-th largest value, ties with it kept */
    float cut = top_k > 0 && top_k < v ? kth_largest(s, logits, top_k) : -INFINITY;
    /* the weights above it, and the top-p cut above that */
    double z = 0;
    for (int32_t i = 0; i < v; i++) {
        float w = logits[i] >= cut ? expf((logits[i] - mx) * inv_t) : 0.0f;
        s->w[i] = w;
        z += w;
    }
    double kept = z;
    if (top_p < 1.0f) {
        cut = top_p_cut(s, logits, cut, mx, (double)top_p * z);
        kept = 0;
        for (int32_t i = 0; i < v; i++)
            if (logits[i] >= cut)
                kept += s->w[i];
    }
    /* the draw, in id order over the kept tokens */
    double target = u * kept, acc = 0;
    int32_t last = -1;
    for (int32_t i = 0; i < v; i++)
        if (logits[i] >= cut) {
            acc += s->w[i];
            last = i;
            if (target < acc)
                return i;
        }
    return last >= 0 ? last : kvf_engine_argmax(logits, v); /* rounding */
}


/* ---- logit processing and log-probabilities ---------------------------------------------- */

static bool rep_on(const kvf_engine_sampling *sp)
{
    return sp->repetition_penalty > 0 && sp->repetition_penalty != 1.0f;
}

bool kvf_engine_processes(const kvf_engine_sampling *sp, int32_t n_output)
{
    return sp->presence_penalty != 0 || sp->frequency_penalty != 0 || rep_on(sp) ||
           sp->n_bias > 0 || (sp->min_p > 0 && sp->temperature > 0) ||
           (n_output < sp->min_tokens && sp->n_stop + sp->n_eos > 0);
}

void kvf_engine_process_logits(kvf_engine_sampler *s, float *logits, const kvf_engine_sampling *sp,
                               const int32_t *tokens, int32_t n_prompt, int32_t n_output)
{
    int32_t v = s->vocab;
    /* 1. min_tokens: no stop or eos id before n_output reaches it */
    if (n_output < sp->min_tokens) {
        for (int32_t i = 0; i < sp->n_stop; i++)
            if (sp->stop_ids[i] >= 0 && sp->stop_ids[i] < v)
                logits[sp->stop_ids[i]] = -INFINITY;
        for (int32_t i = 0; i < sp->n_eos; i++)
            if (sp->eos_ids[i] >= 0 && sp->eos_ids[i] < v)
                logits[sp->eos_ids[i]] = -INFINITY;
    }
    /* 2. logit_bias: logit += bias */
    for (int32_t i = 0; i < sp->n_bias; i++)
        if (sp->bias[i].id >= 0 && sp->bias[i].id < v)
            logits[sp->bias[i].id] += sp->bias[i].bias;
    /* 3 and 4. the penalties, over the ids seen (each listed once in touched) */
    bool rep = rep_on(sp), fp = sp->frequency_penalty != 0 || sp->presence_penalty != 0;
    if (rep || fp) {
        int32_t n_t = 0;
        for (int32_t j = n_prompt; j < n_prompt + n_output; j++) {
            int32_t id = tokens[j];
            if (id < 0 || id >= v)
                continue;
            if (!s->seen[id]) {
                s->seen[id] = 1;
                s->touched[n_t++] = id;
            }
            s->count[id]++;
        }
        if (rep)
            for (int32_t j = 0; j < n_prompt; j++) {
                int32_t id = tokens[j];
                if (id >= 0 && id < v && !s->seen[id]) {
                    s->seen[id] = 1;
                    s->touched[n_t++] = id;
                }
            }
        float p = sp->repetition_penalty, f = sp->frequency_penalty, r = sp->presence_penalty;
        for (int32_t k = 0; k < n_t; k++) {
            int32_t id = s->touched[k], c = s->count[id];
            float l = logits[id];
            if (rep) /* every touched id is in the prompt or the output */
                l = l > 0 ? l / p : l * p;
            if (fp && c > 0)
                l -= f * (float)c + r;
            logits[id] = l;
            s->count[id] = 0;
            s->seen[id] = 0;
        }
    }
    /* 5. min_p: logit >= max + T * ln(min_p), computed in double */
    if (sp->min_p > 0 && sp->temperature > 0) {
        float mx = -INFINITY;
        for (int32_t i = 0; i < v; i++)
            if (logits[i] == logits[i])
                mx = logits[i] > mx ? logits[i] : mx;
        if (mx > -INFINITY && mx < INFINITY) {
            double thr = (double)mx + (double)sp->temperature * log((double)sp->min_p);
            for (int32_t i = 0; i < v; i++)
                if (!((double)logits[i] >= thr))
                    logits[i] = -INFINITY;
        }
    }
}

float kvf_engine_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t n_top,
                          kvf_engine_logprob *top_out, int32_t *n_top_out)
{
    /* log-sum-exp, shifted by the largest, summed in double */
    float mx = -INFINITY;
    for (int32_t i = 0; i < vocab; i++)
        if (logits[i] == logits[i])
            mx = logits[i] > mx ? logits[i] : mx;
    double lse = (double)mx;
    if (mx > -INFINITY && mx < INFINITY) {
        double z = 0;
        for (int32_t i = 0; i < vocab; i++)
            if (logits[i] == logits[i])
                z += exp((double)logits[i] - (double)mx);
        lse += log(z);
    }
    /* the n_top largest by one pass of insertion (n_top <= KVF_ENGINE_MAX_LOGPROBS): scanning
     * ids upward and inserting after equal values keeps ties in id order */
    int32_t k = 0;
    if (n_top > 0)
        for (int32_t i = 0; i < vocab; i++) {
            float x = logits[i];
            if (x != x || (k == n_top && !(x > top_out[k - 1].logprob)))
                continue;
            int32_t pos = k < n_top ? k : n_top - 1;
            while (pos > 0 && top_out[pos - 1].logprob < x) {
                top_out[pos] = top_out[pos - 1];
                pos--;
            }
            top_out[pos] = (kvf_engine_logprob){.id = i, .logprob = x};
            if (k < n_top)
                k++;
        }
    for (int32_t j = 0; j < k; j++)
        top_out[j].logprob = (float)((double)top_out[j].logprob - lse);
    if (n_top_out)
        *n_top_out = k;
    if (token < 0 || token >= vocab)
        return NAN;
    return (float)((double)logits[token] - lse);
}
