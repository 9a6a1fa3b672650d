/* test_sampling.c: issue 23's sampling in the engine, on hand-made rows and on tiny-gqa-f32:
 * kvf_engine_process_logits against hand-computed values (frequency by count x value, presence
 * once, repetition on positive and negative logits, bias, min_tokens, min_p); log-probabilities
 * against a double log-softmax of the same step's logits (a reference forward pass of the
 * prefix); a +100 bias forcing a token; penalised greedy runs against the formulas applied in
 * the test; min_tokens holding eos back; prompt log-probabilities cold and with the prefix cache
 * warm, and through preemption by recompute; requests without these fields keep the fixture's
 * greedy tokens beside ones with them; bad values named. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>

#include "engine/sample.h"
#include "model/forward.h"
#include "testutil.h"
#include "enginetest.h"

static int setup(void **state)
{
    *state = et_open("tiny-gqa-f32");
    return 0;
}

static int teardown(void **state)
{
    et_close(*state);
    return 0;
}

/* ---- a reference forward pass: the raw logits after a prefix, computed in one chunk -------- */

typedef struct ref_fwd {
    void *ctx;
    kvf_model_fwd *f;
    uint8_t *pool;
    int32_t table[16], vocab;
} ref_fwd;

static void ref_open(ref_fwd *r, const kvf_model *m)
{
    kvf_err err = {0};
    const kvf_backend *be = kvf_model_backend_cpu();
    assert_int_equal(kvf_backend_create(be, &(kvf_backend_opts){.n_threads = 2}, &r->ctx, &err), KVF_OK);
    kvf_kv_layout lay;
    assert_int_equal(kvf_model_kv_layout(m, 16, KVF_DTYPE_F32, &lay, &err), KVF_OK);
    kvf_model_fwd_opts o = {.max_tokens = 256, .max_seqs = 1, .max_ctx = 256};
    if (kvf_model_fwd_create(m, be, r->ctx, &lay, &o, &r->f, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    r->pool = calloc(16, (size_t)lay.block_bytes);
    for (int32_t i = 0; i < 16; i++)
        r->table[i] = i;
    r->vocab = m->cfg.vocab_size;
}

static void ref_close(ref_fwd *r)
{
    kvf_model_fwd_destroy(r->f);
    free(r->pool);
    kvf_backend_destroy(kvf_model_backend_cpu(), r->ctx);
}

/* The logits after tokens[0..n) (n >= 1). */
static void ref_row(ref_fwd *r, const int32_t *tokens, int32_t n, float *logits)
{
    kvf_err err = {0};
    int32_t next;
    kvf_model_seq s = {.tokens = tokens, .n_tokens = n, .start_pos = 0, .block_table = r->table,
                       .n_blocks = 16};
    if (kvf_model_forward(r->f, &s, 1, r->pool, 16, logits, &next, &err) != KVF_OK)
        fail_msg("%s", err.msg);
}

/* log_softmax in double. */
static void ref_log_softmax(const float *l, int32_t v, double *out)
{
    double mx = -INFINITY, z = 0;
    for (int32_t i = 0; i < v; i++)
        mx = fmax(mx, (double)l[i]);
    for (int32_t i = 0; i < v; i++)
        z += exp((double)l[i] - mx);
    for (int32_t i = 0; i < v; i++)
        out[i] = (double)l[i] - mx - log(z);
}

/* top is sorted (largest first, ties to the lower id), within 1e-4 of want's values, and no id
 * outside it is larger than its last. */
static void check_top(const char *what, const kvf_engine_logprob *top, int32_t n_top,
                      int32_t want_n, const double *want, int32_t v)
{
    if (n_top != want_n)
        fail_msg("%s: %d top entries, want %d", what, n_top, want_n);
    for (int32_t j = 0; j < n_top; j++) {
        assert_true(top[j].id >= 0 && top[j].id < v);
        if (fabs(top[j].logprob - want[top[j].id]) > 1e-4)
            fail_msg("%s: top %d (id %d) is %.7f, want %.7f", what, j, top[j].id,
                     (double)top[j].logprob, want[top[j].id]);
        if (j > 0)
            assert_true(top[j - 1].logprob > top[j].logprob ||
                        (top[j - 1].logprob == top[j].logprob && top[j - 1].id < top[j].id));
    }
    if (n_top > 0) {
        int32_t larger = 0;
        for (int32_t i = 0; i < v; i++)
            larger += want[i] > want[top[n_top - 1].id] + 1e-6;
        if (larger > n_top - 1)
            fail_msg("%s: %d ids are above the last top entry", what, larger);
    }
}

/* ---- kvf_engine_process_logits by hand --------------------------------------------------- */

static void test_process_by_hand(void **state)
{
    (void)state;
    kvf_engine_sampler s;
    kvf_err err = {0};
    assert_int_equal(kvf_engine_sampler_init(&s, 8, &err), KVF_OK);
    /* prompt 1 2, output 3 3 3 4 */
    const int32_t tok[] = {1, 2, 3, 3, 3, 4};
    const float base[8] = {0.5f, 3.0f, -1.0f, 2.0f, 2.0f, 1.0f, -0.5f, 0.25f};
    float l[8];
    kvf_engine_sampling sp;

    /* frequency f and presence r: logit -= f * count + r, output ids only */
    kvf_engine_sampling_default(&sp);
    sp.frequency_penalty = 0.5f;
    sp.presence_penalty = 0.25f;
    assert_true(kvf_engine_processes(&sp, 4));
    memcpy(l, base, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 4);
    assert_true(l[3] == 2.0f - 0.5f * 3 - 0.25f); /* exactly count x value, presence once */
    assert_true(l[4] == 2.0f - 0.5f * 1 - 0.25f);
    assert_true(l[1] == 3.0f && l[2] == -1.0f); /* prompt ids are not penalised by these */
    assert_true(l[0] == 0.5f && l[5] == 1.0f && l[6] == -0.5f && l[7] == 0.25f);
    /* the same call again: the counting scratch was left clean */
    memcpy(l, base, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 4);
    assert_true(l[3] == 0.25f && l[4] == 1.25f);
    /* frequency alone: the change is exactly count x value */
    sp.presence_penalty = 0;
    sp.frequency_penalty = -1.5f;
    memcpy(l, base, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 4);
    assert_true(l[3] - base[3] == 4.5f && l[4] - base[4] == 1.5f);

    /* repetition p over the prompt and the output: positive / p, negative * p */
    kvf_engine_sampling_default(&sp);
    sp.repetition_penalty = 2.0f;
    memcpy(l, base, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 4);
    assert_true(l[1] == 1.5f);  /* prompt, positive */
    assert_true(l[2] == -2.0f); /* prompt, negative */
    assert_true(l[3] == 1.0f && l[4] == 1.0f); /* output: once, whatever the count */
    assert_true(l[0] == 0.5f && l[5] == 1.0f && l[6] == -0.5f); /* unseen ids */
    /* repetition then frequency: (2 / 2) - 0.5 * 3 */
    sp.frequency_penalty = 0.5f;
    memcpy(l, base, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 4);
    assert_true(l[3] == -0.5f);
    /* 1 is off */
    kvf_engine_sampling_default(&sp);
    sp.repetition_penalty = 1.0f;
    assert_false(kvf_engine_processes(&sp, 4));

    /* logit_bias adds, after min_tokens' -inf */
    kvf_engine_sampling_default(&sp);
    sp.n_bias = 2;
    sp.bias[0] = (kvf_engine_bias){.id = 6, .bias = 10.0f};
    sp.bias[1] = (kvf_engine_bias){.id = 7, .bias = 5.0f};
    sp.min_tokens = 5;
    sp.n_stop = 1;
    sp.stop_ids[0] = 7;
    sp.n_eos = 1;
    sp.eos_ids[0] = 0;
    memcpy(l, base, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 4); /* 4 < 5 new tokens */
    assert_true(l[6] == 9.5f);
    assert_true(l[7] == -INFINITY && l[0] == -INFINITY);
    memcpy(l, base, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 5); /* reached: only the bias */
    assert_true(l[7] == 5.25f && l[0] == 0.5f);
    sp.n_bias = 0;
    assert_true(kvf_engine_processes(&sp, 4));
    assert_false(kvf_engine_processes(&sp, 5));

    /* min_p: keep logit >= max + T ln(min_p) */
    kvf_engine_sampling_default(&sp);
    const float mrow[8] = {0.0f, -1.0f, -1.2f, -1.21f, -2.0f, -2.4f, -2.45f, NAN};
    sp.min_p = 0.3f; /* ln 0.3 = -1.204 */
    assert_false(kvf_engine_processes(&sp, 0)); /* greedy: min_p is not applied */
    memcpy(l, mrow, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 0);
    assert_true(l[3] == -1.21f && l[4] == -2.0f);
    sp.temperature = 1.0f;
    assert_true(kvf_engine_processes(&sp, 0));
    memcpy(l, mrow, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 0);
    assert_true(l[0] == 0.0f && l[1] == -1.0f && l[2] == -1.2f);
    assert_true(l[3] == -INFINITY && l[4] == -INFINITY && l[7] == -INFINITY);
    sp.temperature = 2.0f; /* max + 2 ln 0.3 = -2.408 */
    memcpy(l, mrow, sizeof l);
    kvf_engine_process_logits(&s, l, &sp, tok, 2, 0);
    assert_true(l[4] == -2.0f && l[5] == -2.4f && l[6] == -INFINITY);
    kvf_engine_sampler_fini(&s);
}

static void test_logprobs_by_hand(void **state)
{
    (void)state;
    const float row[6] = {1.0f, 3.0f, 2.0f, 3.0f, NAN, -INFINITY};
    kvf_engine_logprob top[KVF_ENGINE_MAX_LOGPROBS];
    int32_t n = -1;
    double z = exp(1.0) + 2 * exp(3.0) + exp(2.0), lse = log(z);
    float lp = kvf_engine_logprobs(row, 6, 2, 3, top, &n);
    assert_true(fabs(lp - (2.0 - lse)) < 1e-6);
    assert_int_equal(n, 3);
    assert_int_equal(top[0].id, 1); /* a tie: the lower id first */
    assert_int_equal(top[1].id, 3);
    assert_int_equal(top[2].id, 2);
    assert_true(fabs(top[0].logprob - (3.0 - lse)) < 1e-6);
    /* more asked than the row has (NaN is absent; -inf is there, at -inf) */
    lp = kvf_engine_logprobs(row, 6, 5, 20, top, &n);
    assert_int_equal(n, 5);
    assert_true(lp == -INFINITY && top[4].id == 5);
    assert_true(isnan(kvf_engine_logprobs(row, 6, -1, 0, top, &n)));
    assert_int_equal(n, 0);
}

/* ---- through the engine ------------------------------------------------------------------ */

/* Outputs of request id 0 (n 1), with their log-probabilities. */
typedef struct lp_run {
    int32_t tok[ET_MAX_TOK], n;
    float lp[ET_MAX_TOK];
    int32_t n_top[ET_MAX_TOK];
    kvf_engine_logprob top[ET_MAX_TOK][KVF_ENGINE_MAX_LOGPROBS];
    kvf_engine_logprob *plp; /* a copy of the prompt rows */
    int32_t n_plp, plp_outputs;
    kvf_engine_finish finish;
    int64_t n_cached;
} lp_run;

static void lp_collect(lp_run *r, const kvf_engine_output *o)
{
    if (o->token >= 0) {
        r->tok[r->n] = o->token;
        r->lp[r->n] = o->logprob;
        r->n_top[r->n] = o->n_top;
        memcpy(r->top[r->n], o->top, sizeof o->top);
        r->n++;
    } else {
        assert_true(isnan(o->logprob) && o->n_top == 0);
    }
    if (o->finish)
        r->finish = o->finish;
    r->n_cached = o->n_cached;
}

/* Runs e until idle; outputs of request `id` go to r, the others to other (may be NULL). */
static void lp_run_engine(kvf_engine *e, uint64_t id, lp_run *r, int32_t w, et_result *other)
{
    kvf_err err = {0};
    int32_t steps = 0;
    while (kvf_engine_busy(e)) {
        const kvf_engine_output *o;
        int32_t n;
        if (kvf_engine_step(e, &o, &n, &err) != KVF_OK)
            fail_msg("step: %s", err.msg);
        for (int32_t i = 0; i < n; i++) {
            if (o[i].id == id) {
                if (o[i].prompt_lps) { /* copy the rows now: valid until the next step */
                    r->plp_outputs++;
                    assert_int_equal(o[i].index, 0); /* sample 0's first token */
                    assert_int_equal(o[i].n_generated, 1);
                    r->n_plp = o[i].n_prompt_lps;
                    r->plp = malloc((size_t)r->n_plp * (size_t)w * sizeof *r->plp + 1);
                    memcpy(r->plp, o[i].prompt_lps, (size_t)r->n_plp * (size_t)w * sizeof *r->plp);
                    kvf_engine_output c = o[i];
                    c.prompt_lps = NULL;
                    lp_collect(r, &c);
                } else {
                    lp_collect(r, &o[i]);
                }
            } else if (other) {
                assert_null(o[i].prompt_lps);
                if (o[i].token >= 0)
                    assert_true(isnan(o[i].logprob) && o[i].n_top == 0);
                et_collect(other, &o[i], 1);
            }
        }
        if (kvf_engine_check(e, &err) != KVF_OK)
            fail_msg("after step %d: %s", steps, err.msg);
        assert_true(++steps < 100000);
    }
}

/* Every token's log-probability and top list equal a double log-softmax of the raw logits of
 * the same step (a reference forward pass of prompt + the tokens before it). */
static void check_token_lps(const char *what, ref_fwd *ref, const et_case *c, const lp_run *r,
                            int32_t want_top, bool greedy)
{
    int32_t v = ref->vocab, seq[ET_MAX_TOK];
    float *row = malloc((size_t)v * sizeof *row);
    double *want = malloc((size_t)v * sizeof *want);
    memcpy(seq, c->prompt, (size_t)c->n_prompt * sizeof *seq);
    for (int32_t i = 0; i < r->n; i++) {
        ref_row(ref, seq, c->n_prompt + i, row);
        ref_log_softmax(row, v, want);
        char msg[96];
        snprintf(msg, sizeof msg, "%s: token %d", what, i);
        if (fabs(r->lp[i] - want[r->tok[i]]) > 1e-4)
            fail_msg("%s: logprob %.7f, want %.7f", msg, (double)r->lp[i], want[r->tok[i]]);
        check_top(msg, r->top[i], r->n_top[i], want_top, want, v);
        if (greedy && want_top > 0) /* the greedy token has the top logprob */
            assert_int_equal(r->top[i][0].id, r->tok[i]);
        seq[c->n_prompt + i] = r->tok[i];
    }
    free(row);
    free(want);
}

static void test_logprobs_match_log_softmax(void **state)
{
    et_fixture *f = *state;
    ref_fwd ref;
    ref_open(&ref, f->m);
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    const et_case *c = et_find(f, "seventeen"), *c2 = et_find(f, "five");
    /* greedy with the top 5, beside a request without logprobs (which keeps its greedy list) */
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_engine_request q = et_req(0, c->prompt, c->n_prompt, 10);
    q.sampling.logprobs = true;
    q.sampling.top_logprobs = 5;
    kvf_engine_request plain = et_req(1, c2->prompt, c2->n_prompt, f->n_new);
    et_add(e, &q);
    et_add(e, &plain);
    lp_run *r = calloc(1, sizeof *r);
    et_result *other = calloc(1, sizeof *other);
    lp_run_engine(e, 0, r, 1, other);
    et_assert_tokens("logprobs do not change greedy tokens", r->tok, r->n, c->greedy, 10);
    et_assert_tokens("a request without logprobs beside", other->tokens[1], other->n[1],
                     c2->greedy, f->n_new);
    check_token_lps("greedy, top 5", &ref, c, r, 5, true);
    assert_null(r->plp);
    kvf_engine_destroy(e);

    /* sampled (temperature 1.3, seeded), top 20: the raw logits' log-softmax, whatever drew */
    e = et_engine(f->m, &cfg);
    q.sampling.temperature = 1.3f;
    q.sampling.seed = 11;
    q.sampling.top_logprobs = 20;
    et_add(e, &q);
    memset(r, 0, sizeof *r);
    lp_run_engine(e, 0, r, 1, NULL);
    assert_int_equal(r->n, 10);
    check_token_lps("sampled, top 20", &ref, c, r, 20, false);
    kvf_engine_destroy(e);

    /* logprobs with no top list; then none at all (NaN, no entries) */
    e = et_engine(f->m, &cfg);
    q.sampling.temperature = 0;
    q.sampling.top_logprobs = 0;
    et_add(e, &q);
    memset(r, 0, sizeof *r);
    lp_run_engine(e, 0, r, 1, NULL);
    check_token_lps("greedy, no top", &ref, c, r, 0, true);
    q.id = 3;
    q.sampling.logprobs = false;
    et_add(e, &q);
    memset(r, 0, sizeof *r);
    lp_run_engine(e, 3, r, 1, NULL);
    et_assert_tokens("without logprobs", r->tok, r->n, c->greedy, 10);
    for (int32_t i = 0; i < r->n; i++)
        assert_true(isnan(r->lp[i]) && r->n_top[i] == 0);
    kvf_engine_destroy(e);
    free(r);
    free(other);
    ref_close(&ref);
}

/* A +100 bias forces its token, greedy and sampled, n 1 and n 2 (each sibling its own row). */
static void test_bias_forces_token(void **state)
{
    et_fixture *f = *state;
    const et_case *c = et_find(f, "five");
    int32_t forced = (c->greedy[0] + 37) % f->m->cfg.vocab_size;
    for (int32_t i = 0; i < f->n_new; i++)
        assert_int_not_equal(c->greedy[i], forced); /* the test means something */
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_engine_request g = et_req(0, c->prompt, c->n_prompt, 8);
    g.sampling.n_bias = 1;
    g.sampling.bias[0] = (kvf_engine_bias){.id = forced, .bias = 100.0f};
    kvf_engine_request t = g;
    t.id = 1;
    t.sampling.temperature = 1.0f;
    t.sampling.seed = 3;
    t.sampling.n = 2;
    kvf_engine_request plain = et_req(2, c->prompt, c->n_prompt, 8);
    et_add(e, &g);
    et_add(e, &t);
    et_add(e, &plain);
    et_result *r = calloc(1, sizeof *r);
    et_run(e, r, 2);
    for (int32_t k = 0; k < 4; k++) {
        if (k == 1)
            continue; /* (id 0 has one sample) */
        assert_int_equal(r->n[k], 8);
        for (int32_t i = 0; i < 8; i++)
            if (r->tokens[k][i] != forced)
                fail_msg("seq %d token %d is %d, want the biased %d", k, i, r->tokens[k][i], forced);
    }
    et_assert_tokens("no bias beside", r->tokens[4], r->n[4], c->greedy, 8);
    free(r);
    kvf_engine_destroy(e);
    /* the log-probabilities are the raw row's (vLLM's raw_logprobs): the forced token is not
     * the top one there, and its logprob is not the ~0 of the biased row */
    e = et_engine(f->m, &cfg);
    g.sampling.logprobs = true;
    g.sampling.top_logprobs = 1;
    et_add(e, &g);
    lp_run *lr = calloc(1, sizeof *lr);
    lp_run_engine(e, 0, lr, 1, NULL);
    assert_int_equal(lr->n, 8);
    assert_int_equal(lr->tok[0], forced);
    assert_int_equal(lr->top[0][0].id, c->greedy[0]);
    assert_true(lr->lp[0] < lr->top[0][0].logprob && lr->lp[0] < -0.5f);
    free(lr);
    kvf_engine_destroy(e);
}

/* Penalised greedy runs equal the argmax of the reference logits with the formulas applied
 * here, in double, step by step. */
static void test_penalties_against_formulas(void **state)
{
    et_fixture *f = *state;
    ref_fwd ref;
    ref_open(&ref, f->m);
    int32_t v = ref.vocab;
    float *row = malloc((size_t)v * sizeof *row);
    int32_t *count = calloc((size_t)v, sizeof *count);
    bool *in_prompt = calloc((size_t)v, sizeof *in_prompt);
    const struct {
        float pres, freq, rep;
    } sets[] = {{0, 1.5f, 0}, {1.0f, 0, 0}, {0, 0, 1.8f}, {0.5f, 0.7f, 1.3f}, {-1.0f, -0.5f, 0.6f}};
    /* its greedy list repeats a cycle of four from the fifth token on */
    const et_case *c = et_find(f, "single-token");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    for (size_t k = 0; k < sizeof sets / sizeof sets[0]; k++) {
        kvf_engine *e = et_engine(f->m, &cfg);
        kvf_engine_request q = et_req(0, c->prompt, c->n_prompt, 16);
        q.sampling.presence_penalty = sets[k].pres;
        q.sampling.frequency_penalty = sets[k].freq;
        q.sampling.repetition_penalty = sets[k].rep;
        et_add(e, &q);
        et_result *r = calloc(1, sizeof *r);
        et_run(e, r, 1);
        assert_int_equal(r->n[0], 16);
        int32_t seq[ET_MAX_TOK], differs = 0;
        memcpy(seq, c->prompt, (size_t)c->n_prompt * sizeof *seq);
        memset(count, 0, (size_t)v * sizeof *count);
        memset(in_prompt, 0, (size_t)v * sizeof *in_prompt);
        for (int32_t i = 0; i < c->n_prompt; i++)
            in_prompt[c->prompt[i]] = true;
        for (int32_t i = 0; i < 16; i++) {
            ref_row(&ref, seq, c->n_prompt + i, row);
            double best = -INFINITY, second = -INFINITY;
            int32_t arg = -1;
            for (int32_t t = 0; t < v; t++) {
                double l = row[t];
                if (sets[k].rep > 0 && (in_prompt[t] || count[t] > 0))
                    l = l > 0 ? l / sets[k].rep : l * sets[k].rep;
                l -= (double)sets[k].freq * count[t] + (count[t] > 0 ? sets[k].pres : 0.0);
                if (l > best) {
                    second = best;
                    best = l;
                    arg = t;
                } else if (l > second) {
                    second = l;
                }
            }
            int32_t got = r->tokens[0][i];
            if (best - second > 1e-3 && got != arg)
                fail_msg("set %zu token %d: %d, the formulas give %d", k, i, got, arg);
            if (best - second <= 1e-3)
                arg = got; /* a near tie: follow the engine */
            differs += got != c->greedy[i];
            seq[c->n_prompt + i] = got;
            count[got]++;
        }
        print_message("penalties %zu: %d of 16 tokens differ from plain greedy\n", k, differs);
        if (k < 3)
            assert_true(differs > 0); /* each penalty alone changes this run */
        free(r);
        kvf_engine_destroy(e);
    }
    free(row);
    free(count);
    free(in_prompt);
    ref_close(&ref);
}

/* min_tokens: an eos id the greedy run emits first is held back until min_tokens, and the
 * token in its place is the second best of that step's raw row. */
static void test_min_tokens_blocks_eos(void **state)
{
    et_fixture *f = *state;
    ref_fwd ref;
    ref_open(&ref, f->m);
    const et_case *c = et_find(f, "five");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_engine_request q = et_req(0, c->prompt, c->n_prompt, 10);
    q.sampling.n_eos = 1;
    q.sampling.eos_ids[0] = c->greedy[0];
    et_add(e, &q);
    et_result *r = calloc(1, sizeof *r);
    et_run(e, r, 1);
    assert_int_equal(r->n[0], 1); /* without min_tokens: stops at once */
    assert_int_equal(r->finish[0], KVF_ENGINE_FINISH_STOP);
    q.id = 1;
    q.sampling.min_tokens = 4;
    et_add(e, &q);
    et_run(e, r, 1);
    assert_true(r->n[1] >= 4);
    for (int32_t i = 0; i < 4; i++)
        assert_int_not_equal(r->tokens[1][i], c->greedy[0]);
    /* the first token: the best of the raw row once the eos id is out */
    float *row = malloc((size_t)ref.vocab * sizeof *row);
    ref_row(&ref, c->prompt, c->n_prompt, row);
    row[c->greedy[0]] = -INFINITY;
    assert_int_equal(r->tokens[1][0], kvf_engine_argmax(row, ref.vocab));
    /* after min_tokens the eos id may stop it again: a finish is STOP (on the eos id) or
     * LENGTH */
    if (r->finish[1] == KVF_ENGINE_FINISH_STOP)
        assert_int_equal(r->tokens[1][r->n[1] - 1], c->greedy[0]);
    free(row);
    free(r);
    kvf_engine_destroy(e);
    ref_close(&ref);
}

/* min_p 1 keeps only the largest: a sampled run is the greedy list. */
static void test_min_p_one_is_greedy(void **state)
{
    et_fixture *f = *state;
    const et_case *c = et_find(f, "seventeen");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_engine_request q = et_req(0, c->prompt, c->n_prompt, f->n_new);
    q.sampling.temperature = 5.0f;
    q.sampling.seed = 9;
    q.sampling.min_p = 1.0f;
    et_add(e, &q);
    kvf_engine_request hot = q; /* the same without min_p: not greedy at temperature 5 */
    hot.id = 1;
    hot.sampling.min_p = 0;
    et_add(e, &hot);
    et_result *r = calloc(1, sizeof *r);
    et_run(e, r, 1);
    et_assert_tokens("min_p 1", r->tokens[0], r->n[0], c->greedy, f->n_new);
    int32_t same = 0;
    for (int32_t i = 0; i < r->n[1]; i++)
        same += r->tokens[1][i] == c->greedy[i];
    assert_true(same < f->n_new);
    free(r);
    kvf_engine_destroy(e);
}

/* Prompt rows against the reference: row i is prompt token i + 1 under the logits after
 * prompt[0..i]. */
static void check_prompt_lps(const char *what, ref_fwd *ref, const et_case *c, const lp_run *r,
                             int32_t top)
{
    int32_t v = ref->vocab, w = 1 + top;
    assert_int_equal(r->plp_outputs, 1);
    assert_int_equal(r->n_plp, c->n_prompt - 1);
    float *row = malloc((size_t)v * sizeof *row);
    double *want = malloc((size_t)v * sizeof *want);
    for (int32_t i = 0; i < r->n_plp; i++) {
        const kvf_engine_logprob *p = r->plp + (size_t)i * (size_t)w;
        ref_row(ref, c->prompt, i + 1, row);
        ref_log_softmax(row, v, want);
        char msg[96];
        snprintf(msg, sizeof msg, "%s: prompt token %d", what, i + 1);
        assert_int_equal(p[0].id, c->prompt[i + 1]);
        if (fabs(p[0].logprob - want[p[0].id]) > 1e-4)
            fail_msg("%s: %.7f, want %.7f", msg, (double)p[0].logprob, want[p[0].id]);
        check_top(msg, p + 1, top, top, want, v);
    }
    free(row);
    free(want);
}

static void test_prompt_logprobs(void **state)
{
    et_fixture *f = *state;
    ref_fwd ref;
    ref_open(&ref, f->m);
    const et_case *c = et_find(f, "forty");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_engine_request q = et_req(0, c->prompt, c->n_prompt, 6);
    q.sampling.prompt_logprobs = true;
    q.sampling.top_logprobs = 3;
    et_add(e, &q);
    lp_run *r = calloc(1, sizeof *r);
    lp_run_engine(e, 0, r, 4, NULL);
    et_assert_tokens("prompt logprobs: tokens", r->tok, r->n, c->greedy, 6);
    check_prompt_lps("cold", &ref, c, r, 3);
    assert_int_equal(r->n_cached, 0);
    for (int32_t i = 0; i < r->n; i++) /* logprobs was not asked */
        assert_true(isnan(r->lp[i]));
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_true(st.steps >= c->n_prompt + 5); /* one prompt token a step */

    /* the prefix cache is warm now: a plain request uses it, one with prompt_logprobs gives
     * the same rows (it computes the whole prompt again) */
    kvf_engine_request plain = et_req(1, c->prompt, c->n_prompt, 6);
    et_add(e, &plain);
    lp_run *p = calloc(1, sizeof *p);
    lp_run_engine(e, 1, p, 1, NULL);
    assert_true(p->n_cached > 0);
    assert_int_equal(p->plp_outputs, 0);
    q.id = 2;
    lp_run *w = calloc(1, sizeof *w);
    et_add(e, &q);
    lp_run_engine(e, 2, w, 4, NULL);
    assert_int_equal(w->n_cached, 0);
    check_prompt_lps("warm", &ref, c, w, 3);
    for (int32_t i = 0; i < r->n_plp * 4; i++) {
        assert_int_equal(w->plp[i].id, r->plp[i].id);
        assert_true(fabsf(w->plp[i].logprob - r->plp[i].logprob) < 1e-5f);
    }
    kvf_engine_destroy(e);

    /* n 2: only sample 0 carries them; a one-token prompt has no rows */
    e = et_engine(f->m, &cfg);
    q.id = 0;
    q.sampling.n = 2;
    q.sampling.top_logprobs = 0;
    q.sampling.logprobs = true;
    et_add(e, &q);
    free(r->plp);
    memset(r, 0, sizeof *r);
    lp_run_engine(e, 0, r, 1, NULL); /* lp_collect asserts index 0 */
    assert_int_equal(r->plp_outputs, 1);
    assert_int_equal(r->n, 12);
    const et_case *one = et_find(f, "single-token");
    kvf_engine_request q1 = et_req(5, one->prompt, one->n_prompt, 3);
    q1.sampling.prompt_logprobs = true;
    et_add(e, &q1);
    free(r->plp);
    memset(r, 0, sizeof *r);
    lp_run_engine(e, 5, r, 1, NULL);
    assert_int_equal(r->plp_outputs, 0);
    et_assert_tokens("one-token prompt", r->tok, r->n, one->greedy, 3);
    kvf_engine_destroy(e);
    free(r->plp);
    free(p->plp);
    free(w->plp);
    free(r);
    free(p);
    free(w);
    ref_close(&ref);
}

/* Preemption by recompute while prompts are collected one token a step: the rows are written
 * once and equal an undisturbed run's; the tokens too. */
static void test_prompt_logprobs_recompute(void **state)
{
    et_fixture *f = *state;
    ref_fwd ref;
    ref_open(&ref, f->m);
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 9; /* 8 for the long one at its end, so the other is preempted */
    cfg.swap_slots = 0;
    cfg.preempt = KVF_ENGINE_PREEMPT_RECOMPUTE;
    cfg.prefix_cache = false;
    kvf_engine *e = et_engine(f->m, &cfg);
    const et_case *c = et_find(f, "forty"), *b = et_find(f, "hundred");
    kvf_engine_request big = et_req(1, b->prompt, b->n_prompt, f->n_new);
    kvf_engine_request q = et_req(0, c->prompt, c->n_prompt, f->n_new);
    q.sampling.prompt_logprobs = true;
    q.sampling.logprobs = true;
    q.sampling.top_logprobs = 2;
    et_add(e, &big);
    et_add(e, &q);
    lp_run *r = calloc(1, sizeof *r);
    et_result *other = calloc(1, sizeof *other);
    lp_run_engine(e, 0, r, 3, other);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    print_message("recompute: %lld preemptions\n", (long long)st.preempt_recompute);
    assert_true(st.preempt_recompute > 0);
    et_assert_tokens("prompt logprobs, preempted", r->tok, r->n, c->greedy, f->n_new);
    et_assert_tokens("the other, preempted", other->tokens[1], other->n[1], b->greedy, f->n_new);
    check_prompt_lps("preempted", &ref, c, r, 2);
    check_token_lps("preempted", &ref, c, r, 2, true);
    free(r->plp);
    free(r);
    free(other);
    kvf_engine_destroy(e);
    ref_close(&ref);
}

/* Bad values are refused with their name. */
static void test_bad_sampling_named(void **state)
{
    et_fixture *f = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    const et_case *c = &f->cases[0];
    const char *want[] = {"presence_penalty 2.5", "frequency_penalty -3", "repetition_penalty -1",
                          "repetition_penalty 2.5", "min_p 1.5", "min_tokens 20",
                          "logit_bias id 320", "logit_bias 101", "top_logprobs 21",
                          "3000 logit_bias entries", "presence_penalty nan"};
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        kvf_engine_request q = et_req(7, c->prompt, c->n_prompt, 16);
        kvf_engine_sampling *s = &q.sampling;
        switch (k) {
        case 0: s->presence_penalty = 2.5f; break;
        case 1: s->frequency_penalty = -3.0f; break;
        case 2: s->repetition_penalty = -1.0f; break;
        case 3: s->repetition_penalty = 2.5f; break;
        case 4: s->min_p = 1.5f; break;
        case 5: s->min_tokens = 20; break;
        case 6: s->n_bias = 1; s->bias[0] = (kvf_engine_bias){.id = 320, .bias = 1}; break;
        case 7: s->n_bias = 1; s->bias[0] = (kvf_engine_bias){.id = 3, .bias = 101}; break;
        case 8: s->top_logprobs = 21; break;
        case 9: s->n_bias = 3000; break;
        case 10: s->presence_penalty = NAN; break;
        }
        kvf_err err = {0};
        assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
        if (!strstr(err.msg, want[k]))
            fail_msg("case %zu: \"%s\" does not name \"%s\"", k, err.msg, want[k]);
    }
    /* prompt_logprobs with a remote prefill is refused */
    kvf_engine_request q = et_req(8, c->prompt, c->n_prompt, 4);
    q.sampling.prompt_logprobs = true;
    int32_t ids[16], nb;
    int64_t cached;
    kvf_err err = {0};
    assert_int_equal(kvf_engine_add_remote(e, &q, ids, 16, &nb, &cached, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "prompt_logprobs"));
    kvf_engine_destroy(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_process_by_hand),
        cmocka_unit_test(test_logprobs_by_hand),
        cmocka_unit_test(test_logprobs_match_log_softmax),
        cmocka_unit_test(test_bias_forces_token),
        cmocka_unit_test(test_penalties_against_formulas),
        cmocka_unit_test(test_min_tokens_blocks_eos),
        cmocka_unit_test(test_min_p_one_is_greedy),
        cmocka_unit_test(test_prompt_logprobs),
        cmocka_unit_test(test_prompt_logprobs_recompute),
        cmocka_unit_test(test_bad_sampling_named),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
