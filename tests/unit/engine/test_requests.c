/* test_requests.c: the request surface of the engine on tiny-gqa-f32: seeded sampling is
 * deterministic whatever the batch and preemption; top-k 1 and tiny top-p are greedy; n > 1
 * forks the prompt (copy-on-write) with sample 0 equal to an n = 1 run; stop ids, eos ids and
 * max_tokens finish with the right reason; cancel frees blocks at once; a remote prefill
 * (blocks handed out, KV written by another forward pass, first token given) continues into the
 * exact greedy list and publishes KV events; bad requests and configs are named. The sampler
 * is checked on its own: distribution, top-k, top-p. */
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

/* ---- the sampler alone ------------------------------------------------------------------- */

static void test_sampler_distribution(void **state)
{
    kvf_engine_sampler s;
    kvf_err err = {0};
    assert_int_equal(kvf_engine_sampler_init(&s, 4, &err), KVF_OK);
    float logits[4] = {0, logf(2), logf(4), logf(8)}; /* probabilities 1/15, 2/15, 4/15, 8/15 */
    kvf_engine_rng rng;
    kvf_engine_rng_seed(&rng, 123, 0);
    int counts[4] = {0};
    const int n = 30000;
    for (int i = 0; i < n; i++)
        counts[kvf_engine_sample(&s, logits, 1.0f, 0, 1.0f, &rng)]++;
    for (int i = 0; i < 4; i++) {
        double want = (double)(1 << i) / 15.0, got = (double)counts[i] / n;
        if (fabs(got - want) > 0.015)
            fail_msg("id %d drawn %.4f of the time, want %.4f", i, got, want);
    }
    /* top_k 2: only ids 3 and 2, in ratio 2:1 */
    memset(counts, 0, sizeof counts);
    for (int i = 0; i < n; i++)
        counts[kvf_engine_sample(&s, logits, 1.0f, 2, 1.0f, &rng)]++;
    assert_int_equal(counts[0] + counts[1], 0);
    assert_true(fabs((double)counts[3] / n - 2.0 / 3) < 0.015);
    /* top_p 0.6: 8/15 = 0.53 is not enough, so ids 3 and 2 */
    memset(counts, 0, sizeof counts);
    for (int i = 0; i < n; i++)
        counts[kvf_engine_sample(&s, logits, 1.0f, 0, 0.6f, &rng)]++;
    assert_int_equal(counts[0] + counts[1], 0);
    assert_true(counts[2] > 0 && counts[3] > 0);
    /* top_p 0.5: id 3 alone; top_k 1: id 3; temperature 0: id 3 */
    for (int i = 0; i < 100; i++) {
        assert_int_equal(kvf_engine_sample(&s, logits, 1.0f, 0, 0.5f, &rng), 3);
        assert_int_equal(kvf_engine_sample(&s, logits, 5.0f, 1, 1.0f, &rng), 3);
        assert_int_equal(kvf_engine_sample(&s, logits, 0.0f, 0, 1.0f, &rng), 3);
    }
    /* greedy ties go to the lowest id; a cut keeps every tie (top_k 1 here keeps ids 1 and 2,
     * drawn half and half), as the GPU's rule does */
    float flat[4] = {1, 3, 3, 2};
    assert_int_equal(kvf_engine_argmax(flat, 4), 1);
    int tied[4] = {0};
    for (int i = 0; i < 2000; i++)
        tied[kvf_engine_sample(&s, flat, 1.0f, 1, 1.0f, &rng)]++;
    assert_int_equal(tied[0] + tied[3], 0);
    assert_true(tied[1] > 850 && tied[2] > 850);
    /* NaN is never drawn; a row of NaN and -inf falls back to the argmax */
    float odd[4] = {NAN, 0.0f, NAN, -INFINITY};
    for (int i = 0; i < 50; i++) {
        assert_int_equal(kvf_engine_sample(&s, odd, 1.0f, 0, 0.9f, &rng), 1);
        assert_int_equal(kvf_engine_sample(&s, odd, 1.0f, 2, 1.0f, &rng), 1);
    }
    float none[4] = {NAN, -INFINITY, NAN, -INFINITY};
    int32_t t_none = kvf_engine_sample(&s, none, 1.0f, 0, 1.0f, &rng);
    assert_true(t_none >= 0 && t_none < 4);
    /* a +inf logit, or a temperature whose reciprocal overflows a float (1e-40 passes the
     * 0-to-10000 check): the weights would be NaN, so the argmax (it drew the last id before) */
    float inf_row[5] = {1, INFINITY, 2, INFINITY, -INFINITY};
    float plain[5] = {1, 5, 2, 3, 0};
    for (int i = 0; i < 50; i++) {
        assert_int_equal(kvf_engine_sample(&s, inf_row, 1.0f, 0, 1.0f, &rng), 1);
        assert_int_equal(kvf_engine_sample(&s, inf_row, 1.0f, 0, 0.5f, &rng), 1);
        assert_int_equal(kvf_engine_sample(&s, plain, 1e-40f, 0, 1.0f, &rng), 1);
        assert_int_equal(kvf_engine_sample(&s, plain, 1e-40f, 3, 0.9f, &rng), 1);
    }
    /* the same seed and stream give the same draws; another stream differs */
    kvf_engine_rng a, b, c;
    kvf_engine_rng_seed(&a, 9, 0);
    kvf_engine_rng_seed(&b, 9, 0);
    kvf_engine_rng_seed(&c, 9, 1);
    int same_c = 0;
    for (int i = 0; i < 64; i++) {
        uint64_t x = kvf_engine_rng_next(&a);
        assert_true(x == kvf_engine_rng_next(&b));
        same_c += x == kvf_engine_rng_next(&c);
    }
    assert_int_equal(same_c, 0);
    kvf_engine_sampler_fini(&s);
}

/* A plain reference for the rule in sample.h: sort the whole vocabulary, find the top-k cut
 * (the k-th largest value) and the top-p cut (walking distinct values down, the first whose
 * cumulative mass, ties included, reaches top_p of the top-k mass), then draw in id order over
 * the ids at or above the cut. */
static int cmp_ref(const void *pa, const void *pb)
{
    const kvf_engine_cand *a = pa, *b = pb;
    if (a->logit != b->logit)
        return a->logit > b->logit ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static int32_t ref_sample(const float *logits, int32_t v, float temp, int32_t top_k, float top_p,
                          kvf_engine_rng *rng)
{
    double u = kvf_engine_rng_uniform(rng);
    kvf_engine_cand *c = malloc((size_t)v * sizeof *c);
    for (int32_t i = 0; i < v; i++)
        c[i] = (kvf_engine_cand){.logit = logits[i], .id = i};
    qsort(c, (size_t)v, sizeof *c, cmp_ref);
    double mx = c[0].logit;
    float cut = top_k > 0 && top_k < v ? c[top_k - 1].logit : -INFINITY;
    double z = 0; /* in id order, as the sampler sums it */
    for (int32_t i = 0; i < v; i++)
        if (logits[i] >= cut)
            z += exp(((double)logits[i] - mx) / temp);
    if (top_p < 1) {
        double acc = 0;
        for (int32_t i = 0; i < v && c[i].logit >= cut;) {
            int32_t j = i;
            for (; j < v && c[j].logit == c[i].logit; j++)
                acc += exp(((double)c[j].logit - mx) / temp);
            if (acc >= top_p * z) {
                cut = c[i].logit;
                break;
            }
            i = j;
        }
    }
    free(c);
    double kept = 0;
    for (int32_t i = 0; i < v; i++)
        if (logits[i] >= cut)
            kept += exp(((double)logits[i] - mx) / temp);
    double target = u * kept, acc = 0;
    int32_t last = -1;
    for (int32_t i = 0; i < v; i++)
        if (logits[i] >= cut) {
            acc += exp(((double)logits[i] - mx) / temp);
            last = i;
            if (target < acc)
                return i;
        }
    return last;
}

static void test_sampler_matches_reference(void **state)
{
    enum { V = 2000 };
    kvf_engine_sampler s;
    kvf_err err = {0};
    assert_int_equal(kvf_engine_sampler_init(&s, V, &err), KVF_OK);
    float *logits = malloc(V * sizeof *logits);
    kvf_engine_rng gen;
    kvf_engine_rng_seed(&gen, 5, 0);
    const float temps[] = {0.3f, 1.0f, 2.5f};
    const int32_t ks[] = {0, 1, 7, 100, V};
    const float ps[] = {1.0f, 0.95f, 0.5f, 0.05f};
    int64_t draws = 0;
    for (int round = 0; round < 6; round++) {
        /* peaked, flat and tied rows */
        for (int32_t i = 0; i < V; i++) {
            double u = kvf_engine_rng_uniform(&gen);
            logits[i] = round % 3 == 0 ? (float)(8 * u * u * u)
                      : round % 3 == 1 ? (float)(0.01 * u)
                                       : (float)((int)(4 * u));
        }
        for (size_t a = 0; a < 3; a++)
            for (size_t b = 0; b < 5; b++)
                for (size_t c = 0; c < 4; c++)
                    for (int d = 0; d < 5; d++) {
                        kvf_engine_rng r1, r2;
                        kvf_engine_rng_seed(&r1, (uint64_t)(round * 1000 + d), 3);
                        r2 = r1;
                        int32_t got = kvf_engine_sample(&s, logits, temps[a], ks[b], ps[c], &r1);
                        int32_t want = ref_sample(logits, V, temps[a], ks[b], ps[c], &r2);
                        if (got != want)
                            fail_msg("round %d temp %g top_k %d top_p %g draw %d: %d, reference %d",
                                     round, (double)temps[a], ks[b], (double)ps[c], d, got, want);
                        draws++;
                    }
    }
    print_message("%lld draws equal to the full-sort reference\n", (long long)draws);
    free(logits);
    kvf_engine_sampler_fini(&s);
}

/* ---- seeded sampling through the engine -------------------------------------------------- */

static kvf_engine_request sampled(uint64_t id, const et_case *k, uint64_t seed)
{
    kvf_engine_request q = et_req(id, k->prompt, k->n_prompt, 24);
    q.sampling.temperature = 0.9f;
    q.sampling.top_k = 50;
    q.sampling.top_p = 0.95f;
    q.sampling.seed = seed;
    return q;
}

static void test_seeded_sampling_is_batch_independent(void **state)
{
    et_fixture *f = *state;
    const et_case *k = et_find(f, "forty");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);

    /* alone */
    kvf_engine *e = et_engine(f->m, &cfg);
    et_result *alone = calloc(1, sizeof *alone);
    kvf_engine_request q = sampled(0, k, 7);
    et_add(e, &q);
    et_run(e, alone, 1);
    assert_int_equal(alone->n[0], 24);
    kvf_engine_destroy(e);

    /* with other requests around it and a pool that forces preemption */
    cfg.n_blocks = 12;
    cfg.max_batch_tokens = 24;
    cfg.max_seqs = 8;
    e = et_engine(f->m, &cfg);
    et_result *crowd = calloc(1, sizeof *crowd);
    for (int32_t i = 0; i < f->n_cases; i++) {
        kvf_engine_request o = sampled((uint64_t)i + 1, &f->cases[i], 100 + (uint64_t)i);
        et_add(e, &o);
        if (i == 2)
            et_add(e, &q);
    }
    et_run(e, crowd, 1);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_true(st.preempt_recompute + st.preempt_swap > 0);
    kvf_engine_destroy(e);
    et_assert_tokens("seed 7 in a crowd vs alone", crowd->tokens[0], crowd->n[0], alone->tokens[0],
                     alone->n[0]);

    /* another seed gives other tokens; the sampled run is not the greedy one */
    et_cfg(&cfg);
    e = et_engine(f->m, &cfg);
    et_result *other = calloc(1, sizeof *other);
    kvf_engine_request q2 = sampled(0, k, 8);
    et_add(e, &q2);
    et_run(e, other, 1);
    kvf_engine_destroy(e);
    int same = 0, greedy_same = 0;
    for (int32_t i = 0; i < 24; i++) {
        same += other->tokens[0][i] == alone->tokens[0][i];
        greedy_same += alone->tokens[0][i] == k->greedy[i];
    }
    assert_true(same < 24);
    assert_true(greedy_same < 24);
    free(alone);
    free(crowd);
    free(other);
}

static void test_parallel_samples_fork(void **state)
{
    et_fixture *f = *state;
    const et_case *k = et_find(f, "forty"); /* 40 tokens: a partial last block to copy on write */
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    et_result *r = calloc(1, sizeof *r);
    kvf_engine_request q = sampled(0, k, 7);
    q.sampling.n = 4;
    et_add(e, &q);
    et_run(e, r, 4);
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(kvf_engine_pool(e), &ps);
    assert_true(ps.cow_copies >= 3);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.prefill_tokens, k->n_prompt); /* the prompt was computed once */
    kvf_engine_destroy(e);
    int differ = 0;
    for (int32_t j = 0; j < 4; j++) {
        assert_int_equal(r->n[j], 24);
        assert_int_equal(r->finish[j], KVF_ENGINE_FINISH_LENGTH);
        differ += memcmp(r->tokens[j], r->tokens[0], 24 * sizeof(int32_t)) != 0;
    }
    assert_true(differ >= 2);

    /* sample 0 of n = 4 is the n = 1 run with the same seed */
    e = et_engine(f->m, &cfg);
    et_result *one = calloc(1, sizeof *one);
    kvf_engine_request q1 = sampled(0, k, 7);
    et_add(e, &q1);
    et_run(e, one, 1);
    kvf_engine_destroy(e);
    et_assert_tokens("sample 0 of 4 vs n = 1", r->tokens[0], r->n[0], one->tokens[0], one->n[0]);

    /* greedy n = 3: every sample is the fixture's greedy list, also under preemption */
    cfg.n_blocks = 10;
    e = et_engine(f->m, &cfg);
    memset(r, 0, sizeof *r);
    kvf_engine_request g = et_req(0, k->prompt, k->n_prompt, f->n_new);
    g.sampling.n = 3;
    et_add(e, &g);
    kvf_engine_request g2 = et_req(1, et_find(f, "hundred")->prompt, 100, f->n_new);
    g2.sampling.n = 3;
    et_add(e, &g2);
    et_run(e, r, 3);
    for (int32_t j = 0; j < 3; j++) {
        et_assert_tokens("greedy sample", r->tokens[j], r->n[j], k->greedy, k->n_greedy);
        et_assert_tokens("greedy sample (hundred)", r->tokens[3 + j], r->n[3 + j],
                         et_find(f, "hundred")->greedy, f->n_new);
    }
    kvf_engine_destroy(e);
    free(r);
    free(one);
}

/* ---- finishing ----------------------------------------------------------------------------- */

static void test_stop_eos_length(void **state)
{
    et_fixture *f = *state;
    const et_case *k = et_find(f, "hundred");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    int32_t stop = k->greedy[5], first = 0;
    while (k->greedy[first] != stop)
        first++;
    int32_t out[64], n;
    kvf_engine_finish fin;
    kvf_err err = {0};

    kvf_engine_request q = et_req(1, k->prompt, k->n_prompt, 24);
    q.sampling.stop_ids[0] = 100000; /* never produced */
    q.sampling.stop_ids[1] = stop;
    q.sampling.n_stop = 2;
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    assert_int_equal(fin, KVF_ENGINE_FINISH_STOP);
    et_assert_tokens("stop id", out, n, k->greedy, first + 1);

    q = et_req(2, k->prompt, k->n_prompt, 24);
    q.sampling.eos_ids[0] = stop;
    q.sampling.n_eos = 1;
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    assert_int_equal(fin, KVF_ENGINE_FINISH_STOP);
    assert_int_equal(n, first + 1);

    /* the model's own eos ids (tiny-gqa-f32: 2) */
    q = et_req(20, k->prompt, k->n_prompt, 24);
    kvf_engine_sampling_model_eos(&q.sampling, f->m);
    assert_int_equal(q.sampling.n_eos, 1);
    assert_int_equal(q.sampling.eos_ids[0], 2);

    q = et_req(3, k->prompt, k->n_prompt, 3);
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    assert_int_equal(fin, KVF_ENGINE_FINISH_LENGTH);
    et_assert_tokens("max_tokens 3", out, n, k->greedy, 3);

    /* max_ctx: the context ends the sequence */
    kvf_engine_destroy(e);
    cfg.max_ctx = 104;
    e = et_engine(f->m, &cfg);
    q = et_req(4, k->prompt, k->n_prompt, 24);
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    assert_int_equal(fin, KVF_ENGINE_FINISH_LENGTH);
    et_assert_tokens("max_ctx 104", out, n, k->greedy, 4);
    kvf_engine_destroy(e);
}

static void test_cancel_frees_blocks_at_once(void **state)
{
    et_fixture *f = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.prefix_cache = false; /* freed blocks go straight to the free list */
    kvf_engine *e = et_engine(f->m, &cfg);
    const et_case *a = et_find(f, "hundred"), *b = et_find(f, "forty");
    kvf_engine_request qa = et_req(10, a->prompt, a->n_prompt, 24);
    kvf_engine_request qb = et_req(11, b->prompt, b->n_prompt, 24);
    et_add(e, &qa);
    et_add(e, &qb);
    kvf_err err = {0};
    const kvf_engine_output *o;
    int32_t n;
    int32_t got_b[64], n_b = 0;
    for (int i = 0; i < 6; i++) {
        assert_int_equal(kvf_engine_step(e, &o, &n, &err), KVF_OK);
        for (int32_t j = 0; j < n; j++)
            if (o[j].id == 11)
                got_b[n_b++] = o[j].token;
    }
    kvf_engine_stats before, after;
    kvf_engine_get_stats(e, &before);
    assert_int_equal(kvf_engine_cancel(e, 10, &err), KVF_OK);
    kvf_engine_get_stats(e, &after);
    assert_int_equal(after.free_blocks - before.free_blocks, (a->n_prompt + 5 + 15) / 16);
    assert_int_equal(kvf_engine_check(e, &err), KVF_OK);
    assert_int_equal(kvf_engine_cancel(e, 999, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "999"));
    /* the next step reports it, and only once */
    int cancelled = 0;
    while (kvf_engine_busy(e)) {
        assert_int_equal(kvf_engine_step(e, &o, &n, &err), KVF_OK);
        for (int32_t j = 0; j < n; j++) {
            if (o[j].id == 10) {
                assert_int_equal(o[j].finish, KVF_ENGINE_FINISH_CANCELLED);
                assert_int_equal(o[j].token, -1);
                cancelled++;
            } else {
                got_b[n_b++] = o[j].token;
            }
        }
        assert_int_equal(kvf_engine_check(e, &err), KVF_OK);
    }
    assert_int_equal(cancelled, 1);
    et_assert_tokens("the other request", got_b, n_b, b->greedy, 24);
    kvf_engine_get_stats(e, &after);
    assert_int_equal(after.free_blocks, after.total_blocks);
    /* the id can be used again */
    et_add(e, &qa);
    assert_int_equal(kvf_engine_cancel(e, 10, &err), KVF_OK);
    kvf_engine_destroy(e);
}

/* ---- remote prefill ---------------------------------------------------------------------- */

typedef struct ev_count {
    int stored, removed;
} ev_count;

static void count_event(void *ctx, const kvf_kv_event *ev)
{
    ev_count *c = ctx;
    if (ev->type == KVF_KV_EVENT_STORED)
        c->stored++;
    else
        c->removed++;
}

static void test_remote_prefill(void **state)
{
    et_fixture *f = *state;
    const et_case *k = et_find(f, "forty");
    ev_count ev = {0};
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.on_event = count_event;
    cfg.event_ctx = &ev;
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_engine_request q = et_req(5, k->prompt, k->n_prompt, f->n_new);
    int32_t ids[16], n_ids;
    int64_t cached;
    kvf_err err = {0};
    assert_int_equal(kvf_engine_add_remote(e, &q, ids, 16, &n_ids, &cached, &err), KVF_OK);
    assert_int_equal(n_ids, 3);
    assert_int_equal(cached, 0);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.remote, 1);
    /* the "prefill worker": a forward pass of its own writing into the engine's blocks */
    kvf_kv_pool *pool = kvf_engine_pool(e);
    const kvf_backend *be = kvf_model_backend_cpu();
    void *ctx;
    assert_int_equal(kvf_backend_create(be, &(kvf_backend_opts){.n_threads = 1}, &ctx, &err), KVF_OK);
    kvf_model_fwd *fwd;
    kvf_model_fwd_opts fo = {.max_tokens = 64, .max_seqs = 1, .max_ctx = 256};
    assert_int_equal(kvf_model_fwd_create(f->m, be, ctx, kvf_kv_pool_layout(pool), &fo, &fwd, &err), KVF_OK);
    kvf_model_seq s = {.tokens = k->prompt, .n_tokens = k->n_prompt, .start_pos = 0,
                       .block_table = ids, .n_blocks = n_ids};
    int32_t first;
    assert_int_equal(kvf_model_forward(fwd, &s, 1, kvf_kv_pool_base(pool), st.total_blocks, NULL,
                                       &first, &err), KVF_OK);
    kvf_model_fwd_destroy(fwd);
    kvf_backend_destroy(be, ctx);
    assert_int_equal(first, k->greedy[0]);
    /* running nothing meanwhile is fine */
    const kvf_engine_output *o;
    int32_t n;
    assert_int_equal(kvf_engine_step(e, &o, &n, &err), KVF_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kvf_engine_remote_done(e, 5, first, &err), KVF_OK);
    assert_int_equal(ev.stored, 2); /* two full prompt blocks registered */
    assert_int_equal(kvf_engine_remote_done(e, 5, first, &err), KVF_ERR_NOT_FOUND);
    et_result *r = calloc(1, sizeof *r);
    et_run(e, r, 1);
    et_assert_tokens("remote prefill then decode", r->tokens[5], r->n[5], k->greedy, f->n_new);
    free(r);
    /* run the same prompt remotely again: its full blocks are cached now */
    q.id = 6;
    assert_int_equal(kvf_engine_add_remote(e, &q, ids, 16, &n_ids, &cached, &err), KVF_OK);
    assert_int_equal(cached, 32);
    assert_int_equal(kvf_engine_cancel(e, 6, &err), KVF_OK);
    assert_int_equal(kvf_engine_step(e, &o, &n, &err), KVF_OK);
    assert_int_equal(kvf_engine_check(e, &err), KVF_OK);
    /* too small an id buffer is named */
    q.id = 7;
    assert_int_equal(kvf_engine_add_remote(e, &q, ids, 2, &n_ids, &cached, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "3 blocks"));
    kvf_engine_destroy(e);
}

static void collect_id5(void *ctx, const kvf_engine_output *o)
{
    et_result *r = ctx;
    assert_int_equal(o->id, 5);
    if (o->token >= 0)
        r->tokens[0][r->n[0]++] = o->token;
    r->finish[0] = o->finish;
}

static void test_remote_prefill_tokens(void **state)
{
    et_fixture *f = *state;
    const et_case *k = et_find(f, "hundred");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_engine_request q = et_req(5, k->prompt, k->n_prompt, f->n_new);
    int32_t ids[16], n_ids;
    int64_t cached;
    kvf_err err = {0};
    assert_int_equal(kvf_engine_add_remote(e, &q, ids, 16, &n_ids, &cached, &err), KVF_OK);
    kvf_kv_pool *pool = kvf_engine_pool(e);
    const kvf_backend *be = kvf_model_backend_cpu();
    void *ctx;
    assert_int_equal(kvf_backend_create(be, &(kvf_backend_opts){.n_threads = 1}, &ctx, &err), KVF_OK);
    kvf_model_fwd *fwd;
    kvf_model_fwd_opts fo = {.max_tokens = 128, .max_seqs = 1, .max_ctx = 256};
    assert_int_equal(kvf_model_fwd_create(f->m, be, ctx, kvf_kv_pool_layout(pool), &fo, &fwd, &err), KVF_OK);
    kvf_model_seq s = {.tokens = k->prompt, .n_tokens = k->n_prompt, .start_pos = 0,
                       .block_table = ids, .n_blocks = n_ids};
    int32_t first;
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(kvf_model_forward(fwd, &s, 1, kvf_kv_pool_base(pool), st.total_blocks, NULL,
                                       &first, &err), KVF_OK);
    kvf_model_fwd_destroy(fwd);
    kvf_backend_destroy(be, ctx);
    assert_int_equal(kvf_engine_remote_done(e, 5, first, &err), KVF_OK);
    et_result *r = calloc(1, sizeof *r);
    assert_int_equal(kvf_engine_run(e, collect_id5, r, &err), KVF_OK);
    et_assert_tokens("remote prefill then local decode", r->tokens[0], r->n[0], k->greedy, f->n_new);
    assert_int_equal(r->finish[0], KVF_ENGINE_FINISH_LENGTH);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.prefill_tokens, 0); /* the engine computed no prompt token itself */
    free(r);
    kvf_engine_destroy(e);
}

/* ---- cache salts, eviction events, sizing by bytes ----------------------------------------- */

static void test_salt_isolation_and_eviction(void **state)
{
    et_fixture *f = *state;
    const et_case *b = et_find(f, "shared-prefix-b"), *h = et_find(f, "hundred");
    ev_count ev = {0};
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.on_event = count_event;
    cfg.event_ctx = &ev;
    kvf_engine *e = et_engine(f->m, &cfg);
    int32_t out[64], n;
    kvf_engine_finish fin;
    kvf_err err = {0};
    kvf_engine_stats st;
    kvf_engine_request q = et_req(1, b->prompt, b->n_prompt, f->n_new);
    q.cache_salt = "tenant-x";
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    et_assert_tokens("salted", out, n, b->greedy, f->n_new);
    /* 44 prompt + 23 computed output tokens: 4 full blocks registered */
    assert_int_equal(ev.stored, (b->n_prompt + f->n_new - 1) / 16);
    q.cache_salt = "tenant-y";
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.prefix_hit_tokens, 0); /* another salt never shares */
    q.cache_salt = "tenant-x";
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.prefix_hit_tokens, 32);
    et_assert_tokens("salted, warm", out, n, b->greedy, f->n_new);
    kvf_engine_destroy(e);

    /* a small pool: cached blocks are evicted for new prompts, with REMOVED events */
    memset(&ev, 0, sizeof ev);
    et_cfg(&cfg);
    cfg.n_blocks = 9;
    cfg.on_event = count_event;
    cfg.event_ctx = &ev;
    e = et_engine(f->m, &cfg);
    q = et_req(1, b->prompt, b->n_prompt, f->n_new);
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    q = et_req(2, h->prompt, h->n_prompt, f->n_new);
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    et_assert_tokens("after eviction", out, n, h->greedy, f->n_new);
    assert_true(ev.removed > 0);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.free_blocks + st.cached_blocks, 9);
    assert_int_equal(kvf_engine_check(e, &err), KVF_OK);
    kvf_engine_destroy(e);

    /* sized by bytes: tiny-gqa-f32 blocks are 2 layers x 2 (K, V) x 2 heads x 16 x 16 x 4 B */
    et_cfg(&cfg);
    cfg.n_blocks = 0;
    cfg.kv_bytes = 10 * 8192 + 100;
    e = et_engine(f->m, &cfg);
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.total_blocks, 10);
    kvf_engine_destroy(e);
}

/* ---- bad input ----------------------------------------------------------------------------- */

static void test_bad_requests_and_configs(void **state)
{
    et_fixture *f = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    kvf_err err = {0};
    int32_t prompt[4] = {1, 2, 320, 4};
    kvf_engine_request q = et_req(1, prompt, 4, 8);
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "320"));
    assert_non_null(strstr(err.msg, "0 to 319"));
    prompt[2] = 3;
    q.sampling.top_p = 1.5f;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "top_p 1.5"));
    q.sampling.top_p = 1;
    q.sampling.n = 0;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "n 0"));
    q.sampling.n = 1;
    q.sampling.max_tokens = 0;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "max_tokens 0"));
    q.sampling.max_tokens = 8;
    q.sampling.temperature = -1;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    q.sampling.temperature = 0;
    q.n_prompt = 0;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    q.n_prompt = 4;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_OK);
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_EXISTS);
    assert_non_null(strstr(err.msg, "req 1"));
    kvf_engine_destroy(e);

    /* a prompt longer than the pool */
    cfg.n_blocks = 2;
    e = et_engine(f->m, &cfg);
    const et_case *k = et_find(f, "forty");
    q = et_req(2, k->prompt, k->n_prompt, 8);
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_LIMIT);
    assert_non_null(strstr(err.msg, "pool has 2"));
    /* a sequence that outgrows the pool while decoding ends with LENGTH */
    q = et_req(3, k->prompt, 20, 24);
    int32_t out[32], n;
    kvf_engine_finish fin;
    assert_int_equal(kvf_engine_generate(e, &q, out, 32, &n, &fin, &err), KVF_OK);
    assert_int_equal(fin, KVF_ENGINE_FINISH_LENGTH);
    assert_int_equal(n, 32 - 20 + 1);
    kvf_engine_destroy(e);

    kvf_engine *bad = NULL;
    et_cfg(&cfg);
    cfg.max_seqs = 100;
    cfg.max_batch_tokens = 64;
    assert_int_equal(kvf_engine_create(f->m, kvf_model_backend_cpu(), &cfg, &bad, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "max_seqs 100"));
    et_cfg(&cfg);
    cfg.block_size = 24;
    assert_int_equal(kvf_engine_create(f->m, kvf_model_backend_cpu(), &cfg, &bad, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block_size 24"));
    et_cfg(&cfg);
    cfg.max_ctx = 100000;
    assert_int_equal(kvf_engine_create(f->m, kvf_model_backend_cpu(), &cfg, &bad, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "256"));
    et_cfg(&cfg);
    cfg.preempt = KVF_ENGINE_PREEMPT_SWAP;
    cfg.swap_slots = 0;
    assert_int_equal(kvf_engine_create(f->m, kvf_model_backend_cpu(), &cfg, &bad, &err), KVF_ERR_INVALID);
    assert_null(bad);
    et_cfg(&cfg);
    cfg.n_blocks = 0;
    cfg.kv_bytes = 1000;
    assert_int_equal(kvf_engine_create(f->m, kvf_model_backend_cpu(), &cfg, &bad, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "kv_bytes 1000"));
    kvf_engine_destroy(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sampler_distribution),
        cmocka_unit_test(test_sampler_matches_reference),
        cmocka_unit_test(test_seeded_sampling_is_batch_independent),
        cmocka_unit_test(test_parallel_samples_fork),
        cmocka_unit_test(test_stop_eos_length),
        cmocka_unit_test(test_cancel_frees_blocks_at_once),
        cmocka_unit_test(test_remote_prefill),
        cmocka_unit_test(test_remote_prefill_tokens),
        cmocka_unit_test(test_salt_isolation_and_eviction),
        cmocka_unit_test(test_bad_requests_and_configs),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
