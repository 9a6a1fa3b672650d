/* host_sample_emu.c: draws made on the backend (kvf_backend_sample), on the real CUDA backend
 * run by the host emulation (cuda_rt_emu.cpp): the forward pass's draws equal the rule of
 * kvf_cuda_sample (sample_ref.h) applied to the same step's logits, greedy rows of a drawing step
 * stay the argmax, bad draws are refused before the step; and the engine draws on the backend
 * (seeded runs repeat, a fork still works, greedy requests beside sampled ones keep the
 * fixture's tokens, and the CPU engine, drawing on the host by the same rule, draws the same
 * tokens); a sequence with issue 23's processing or logprobs takes the host path (its row
 * downloaded, never the backend's draw) beside one that still draws on the backend, with the
 * CPU engine's tokens and logprobs; guided sequences draw on the backend under their mask. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "testutil.h"

#include "../engine/enginetest.h"
#include "cuda/cuda.h"
#include "engine/sample.h"
#include "emu_side.h"
#include "sample_ref.h"
#include "text/guide.h"
#include "text/tokenizer.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* one side per backend: f32 matrices, so the emulated GPU's logits are the CPU's up to rounding */
static void sample_side(side *s, const kvf_backend *be, const kvf_model *m)
{
    kvf_backend_opts bo = {.n_threads = 1, .matrix_dtype = KVF_BACKEND_MATRIX_F32};
    side_open(s, be, m, &bo, KVF_DTYPE_F32);
}

/* Three sequences, prefilled in one step: 0 greedy, 1 and 2 drawing with draw[0], draw[1]. */
static kvf_status three_seqs(side *s, const et_fixture *fx, const kvf_backend_sample_row *draw,
                             float *logits, int32_t *next, kvf_err *err)
{
    static int32_t tables[3][4] = {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}};
    kvf_model_seq seqs[3];
    for (int32_t i = 0; i < 3; i++) {
        const et_case *c = &fx->cases[i % fx->n_cases];
        seqs[i] = (kvf_model_seq){.tokens = c->prompt, .n_tokens = c->n_prompt,
                                  .block_table = tables[i], .n_blocks = 4,
                                  .sample = i == 0 ? NULL : &draw[i - 1]};
    }
    return kvf_model_forward(s->fwd, seqs, 3, s->pool, N_POOL, logits, next, err);
}

static void test_forward_draws_follow_the_rule(void **state)
{
    (void)state;
    et_fixture *fx = et_open("tiny-gqa-f32");
    int32_t V = fx->m->cfg.vocab_size;
    side s;
    sample_side(&s, kvf_cuda_backend(), fx->m);
    assert_true(kvf_model_fwd_samples(s.fwd));
    float *logits = malloc((size_t)3 * V * sizeof *logits);
    bool *kept = malloc((size_t)V);
    kvf_err err = {0};
    /* temperature, top_k and top_p across their ranges; u from a fixed generator */
    const kvf_backend_sample_row shapes[] = {
        {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f},  {.temperature = 0.7f, .top_k = 5, .top_p = 1.0f},
        {.temperature = 1.3f, .top_k = 0, .top_p = 0.9f},  {.temperature = 0.5f, .top_k = 3, .top_p = 0.6f},
        {.temperature = 2.0f, .top_k = 1, .top_p = 1.0f},  {.temperature = 1.0f, .top_k = V + 7, .top_p = 0.3f},
    };
    int n_shapes = (int)(sizeof shapes / sizeof shapes[0]), differ = 0;
    uint64_t x = 12345;
    for (int round = 0; round < 8; round++) {
        kvf_backend_sample_row draw[2];
        for (int j = 0; j < 2; j++) {
            draw[j] = shapes[(round * 2 + j) % n_shapes];
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            draw[j].u = (float)((x >> 40) / (double)(1 << 24));
        }
        int32_t next[3] = {-1, -1, -1};
        if (three_seqs(&s, fx, draw, logits, next, &err) != KVF_OK)
            fail_msg("round %d: %s", round, err.msg);
        assert_int_equal(next[0], kvf_engine_argmax(logits, V)); /* the greedy row */
        for (int j = 0; j < 2; j++) {
            const float *row = logits + (size_t)(j + 1) * V;
            int32_t want = kvf_test_sample_ref(row, V, &draw[j], kept);
            if (next[j + 1] != want)
                fail_msg("round %d, row %d (t %g, k %d, p %g, u %g): drew %d, the rule says %d",
                         round, j + 1, (double)draw[j].temperature, draw[j].top_k,
                         (double)draw[j].top_p, (double)draw[j].u, next[j + 1], want);
            differ += want != kvf_engine_argmax(row, V);
        }
    }
    assert_true(differ > 0); /* some draws were not the argmax: sampling really happened */

    /* constrained decoding: a mask keeps a fifth of the ids; a sampled row draws among them by
     * the rule, and a greedy row (top_k 1, u 0) takes the largest allowed logit */
    size_t words = ((size_t)V + 31) / 32;
    uint32_t *mask = calloc(words, sizeof *mask);
    for (int32_t id = 0; id < V; id++)
        if ((uint32_t)id * 2654435761u >> 7 & 1 && id % 5 == 0)
            mask[id >> 5] |= 1u << (id & 31);
    int masked_off = 0;
    for (int round = 0; round < 8; round++) {
        kvf_backend_sample_row draw[2];
        draw[0] = shapes[round % n_shapes];
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        draw[0].u = (float)((x >> 40) / (double)(1 << 24));
        draw[0].mask = mask;
        draw[1] = (kvf_backend_sample_row){.temperature = 1.0f, .top_k = 1, .top_p = 1.0f, .mask = mask};
        int32_t next[3] = {-1, -1, -1};
        if (three_seqs(&s, fx, draw, logits, next, &err) != KVF_OK)
            fail_msg("masked round %d: %s", round, err.msg);
        for (int j = 0; j < 2; j++) {
            const float *row = logits + (size_t)(j + 1) * V;
            int32_t want = kvf_test_sample_ref(row, V, &draw[j], kept);
            if (next[j + 1] != want)
                fail_msg("masked round %d, row %d: drew %d, the rule says %d", round, j + 1, next[j + 1], want);
            assert_true(mask[want >> 5] >> (want & 31) & 1u);
            masked_off += kvf_engine_argmax(row, V) != want; /* the mask changed the answer */
        }
        int32_t best = -1; /* the greedy row: the largest allowed logit, the lowest such id */
        const float *row = logits + (size_t)2 * V;
        for (int32_t id = 0; id < V; id++)
            if (mask[id >> 5] >> (id & 31) & 1u && (best < 0 || row[id] > row[best]))
                best = id;
        assert_int_equal(next[2], best);
    }
    assert_true(masked_off > 0);
    free(mask);

    /* a bad draw is refused before the step, naming the sequence */
    kvf_backend_sample_row bad[2] = {{.temperature = 1.0f, .top_p = 1.0f, .u = 0.5f},
                                     {.temperature = 1.0f, .top_p = 0.0f, .u = 0.5f}};
    int32_t next[3];
    assert_int_equal(three_seqs(&s, fx, bad, NULL, next, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "sequence 2"));
    bad[1] = (kvf_backend_sample_row){.temperature = 1.0f, .top_p = 1.0f, .u = 1.0f};
    assert_int_equal(three_seqs(&s, fx, bad, NULL, next, &err), KVF_ERR_INVALID);
    side_close(&s);

    /* the CPU backend has no sample op: a draw is refused, naming the backend */
    sample_side(&s, kvf_model_backend_cpu(), fx->m);
    assert_false(kvf_model_fwd_samples(s.fwd));
    bad[1] = bad[0];
    assert_int_equal(three_seqs(&s, fx, bad, NULL, next, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "cannot sample"));
    side_close(&s);
    free(kept);
    free(logits);
    et_close(fx);
}

/* An engine on the emulated GPU (f32 matrices, so its logits are the CPU's up to rounding),
 * or on the CPU. */
static kvf_engine *make_engine(const et_fixture *fx, const kvf_backend *be)
{
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 64;
    cfg.max_ctx = 256;
    cfg.threads = 1;
    cfg.matrix_dtype = KVF_BACKEND_MATRIX_F32;
    kvf_engine *e = NULL;
    kvf_err err = {0};
    if (kvf_engine_create(fx->m, be, &cfg, &e, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    return e;
}

static void test_engine_draws_on_the_backend(void **state)
{
    (void)state;
    et_fixture *fx = et_open("tiny-gqa-f32");
    const et_case *c0 = &fx->cases[0], *c1 = &fx->cases[1 % fx->n_cases];
    et_result *r[3];
    int64_t draws[3];
    for (int run = 0; run < 3; run++) { /* emulated GPU twice, then the CPU */
        kvf_engine *e = make_engine(fx, run < 2 ? kvf_cuda_backend() : kvf_model_backend_cpu());
        r[run] = calloc(1, sizeof *r[run]);
        /* id 0: greedy; id 1: sampled, seeded; id 2: two samples that fork after the prompt */
        kvf_engine_request g = et_req(0, c0->prompt, c0->n_prompt, fx->n_new);
        kvf_engine_request t = et_req(1, c1->prompt, c1->n_prompt, 12);
        t.sampling.temperature = 1.5f;
        t.sampling.top_p = 0.95f;
        t.sampling.seed = 7;
        kvf_engine_request f = t;
        f.id = 2;
        f.sampling.n = 2;
        f.sampling.top_k = 8;
        et_add(e, &g);
        et_add(e, &t);
        et_add(e, &f);
        et_run(e, r[run], 2);
        kvf_engine_stats st;
        kvf_engine_get_stats(e, &st);
        draws[run] = st.backend_draws;
        kvf_engine_destroy(e);
    }
    /* the greedy request beside drawing ones keeps the fixture's tokens (the argmax rows of a
     * drawing step) */
    et_assert_tokens("greedy beside draws", r[0]->tokens[0], r[0]->n[0], c0->greedy, fx->n_new);
    /* seeded: both runs drew the same tokens; the sampled request is not the greedy one */
    for (int k = 2; k < 6; k++)
        et_assert_tokens("seeded rerun", r[1]->tokens[k], r[1]->n[k], r[0]->tokens[k], r[0]->n[k]);
    assert_int_equal(r[0]->n[2], 12);
    assert_int_equal(r[0]->n[4], 12);
    assert_int_equal(r[0]->n[5], 12);
    /* every sampled token but the fork's three first ones (drawn on the host from the
     * downloaded row) was drawn on the backend */
    assert_int_equal(draws[0], 12 + 2 * 12 - 2);
    assert_int_equal(draws[1], draws[0]);
    /* the CPU draws on the host (no sample op) by the same rule: the same tokens */
    assert_int_equal(draws[2], 0);
    for (int k = 0; k < 6; k++)
        et_assert_tokens("CPU against the emulated GPU", r[2]->tokens[k], r[2]->n[k],
                         r[0]->tokens[k], r[0]->n[k]);
    bool all_greedy = true;
    for (int i = 0; i < 12 && i < fx->n_new; i++)
        all_greedy = all_greedy && r[0]->tokens[2][i] == c1->greedy[i];
    assert_false(all_greedy);
    for (int run = 0; run < 3; run++)
        free(r[run]);
    et_close(fx);
}

/* Issue 23's sampling on the emulated GPU: penalties, a bias, min_p and logprobs (id 1) and
 * greedy with logprobs (id 2) take the host path while a plain sampled request (id 0) still
 * draws on the backend; every token and logprob equals the CPU engine's. */
static void test_engine_processing_takes_the_host_path(void **state)
{
    (void)state;
    et_fixture *fx = et_open("tiny-gqa-f32");
    const et_case *c0 = &fx->cases[0], *c1 = &fx->cases[1 % fx->n_cases];
    enum { NT = 12 };
    int32_t tok[2][3][NT], n[2][3];
    float lp[2][3][NT];
    int64_t draws[2];
    memset(n, 0, sizeof n);
    for (int run = 0; run < 2; run++) { /* the emulated GPU, then the CPU */
        kvf_engine *e = make_engine(fx, run == 0 ? kvf_cuda_backend() : kvf_model_backend_cpu());
        kvf_engine_request p = et_req(0, c1->prompt, c1->n_prompt, NT);
        p.sampling.temperature = 1.2f;
        p.sampling.seed = 5;
        kvf_engine_request q = p;
        q.id = 1;
        q.sampling.frequency_penalty = 0.8f;
        q.sampling.presence_penalty = 0.3f;
        q.sampling.repetition_penalty = 1.3f;
        q.sampling.min_p = 0.05f;
        q.sampling.n_bias = 1;
        q.sampling.bias[0] = (kvf_engine_bias){.id = c1->greedy[0], .bias = -100.0f};
        q.sampling.logprobs = true;
        q.sampling.top_logprobs = 4;
        kvf_engine_request g = et_req(2, c0->prompt, c0->n_prompt, NT);
        g.sampling.logprobs = true;
        et_add(e, &p);
        et_add(e, &q);
        et_add(e, &g);
        kvf_err err = {0};
        while (kvf_engine_busy(e)) {
            const kvf_engine_output *o;
            int32_t no;
            if (kvf_engine_step(e, &o, &no, &err) != KVF_OK)
                fail_msg("step: %s", err.msg);
            for (int32_t i = 0; i < no; i++) {
                int32_t id = (int32_t)o[i].id;
                assert_true(id >= 0 && id < 3);
                if (o[i].token < 0)
                    continue;
                assert_true(n[run][id] < NT);
                tok[run][id][n[run][id]] = o[i].token;
                lp[run][id][n[run][id]++] = o[i].logprob;
                assert_true(id == 0 ? isnan(o[i].logprob) : o[i].logprob <= 0);
            }
        }
        kvf_engine_stats st;
        kvf_engine_get_stats(e, &st);
        draws[run] = st.backend_draws;
        kvf_engine_destroy(e);
    }
    /* only the plain sampled request drew on the backend */
    assert_int_equal(draws[0], NT);
    assert_int_equal(draws[1], 0);
    for (int id = 0; id < 3; id++) {
        et_assert_tokens("emulated GPU against the CPU", tok[0][id], n[0][id], tok[1][id], n[1][id]);
        assert_int_equal(n[0][id], NT);
        for (int i = 0; id > 0 && i < NT; i++)
            if (fabsf(lp[0][id][i] - lp[1][id][i]) > 1e-4f)
                fail_msg("req %d token %d: logprob %.7f on the GPU, %.7f on the CPU", id, i,
                         (double)lp[0][id][i], (double)lp[1][id][i]);
    }
    et_assert_tokens("greedy with logprobs", tok[0][2], NT, c0->greedy, NT);
    assert_int_not_equal(tok[0][1][0], c1->greedy[0]); /* the -100 bias */
    et_close(fx);
}

/* Constrained decoding on the emulated GPU (issue 24): guided sequences without other host needs
 * draw on the backend under their guide's mask (the bitset the sampler reads; greedy as the
 * largest allowed logit), and give the CPU engine's tokens, which apply the same mask on the
 * host. The tokenizer is the default one written for the model's ids. */
static void test_engine_guides_draw_on_the_backend(void **state)
{
    (void)state;
    et_fixture *fx = et_open("tiny-gqa-f32");
    char dir[] = "/tmp/kvf-guide-emu-XXXXXX";
    assert_non_null(mkdtemp(dir));
    kvf_err err = {0};
    if (kvf_text_tokenizer_write_default(dir, fx->m->cfg.vocab_size, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    kvf_text_tokenizer *tok = NULL;
    if (kvf_text_tokenizer_load(dir, &tok, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    int32_t eos = kvf_text_tokenizer_eos_id(tok);
    const et_case *c0 = &fx->cases[0];
    et_result *r[2];
    int64_t draws[2];
    for (int run = 0; run < 2; run++) { /* the emulated GPU, then the CPU */
        kvf_engine_cfg cfg;
        et_cfg(&cfg);
        cfg.n_blocks = 64;
        cfg.max_ctx = 256;
        cfg.threads = 1;
        cfg.matrix_dtype = KVF_BACKEND_MATRIX_F32;
        cfg.tokenizer_dir = dir;
        kvf_engine *e = NULL;
        if (kvf_engine_create(fx->m, run == 0 ? kvf_cuda_backend() : kvf_model_backend_cpu(), &cfg, &e, &err) != KVF_OK)
            fail_msg("%s", err.msg);
        r[run] = calloc(1, sizeof *r[run]);
        for (uint64_t id = 0; id < 4; id++) {
            kvf_engine_request q = et_req(id, c0->prompt, c0->n_prompt, 40);
            q.sampling.temperature = id == 0 ? 0.0f : 1.3f;
            q.sampling.seed = 30 + id;
            q.sampling.guide_kind = id == 3 ? KVF_TEXT_GUIDE_JSON_OBJECT : KVF_TEXT_GUIDE_REGEX;
            q.sampling.guide = id == 3 ? NULL : "[a-c]{3,6}x";
            q.sampling.guide_len = id == 3 ? 0 : strlen("[a-c]{3,6}x");
            q.sampling.eos_ids[0] = eos;
            q.sampling.n_eos = 1;
            et_add(e, &q);
        }
        et_run(e, r[run], 1);
        kvf_engine_stats st;
        kvf_engine_get_stats(e, &st);
        draws[run] = st.backend_draws;
        kvf_engine_destroy(e);
    }
    assert_int_equal(draws[1], 0);
    int64_t tokens = 0;
    for (int k = 0; k < 4; k++) {
        et_assert_tokens("guided: CPU against the emulated GPU", r[1]->tokens[k], r[1]->n[k],
                         r[0]->tokens[k], r[0]->n[k]);
        tokens += r[0]->n[k];
        if (k < 3) { /* the regex: a-c, then x (then nothing may follow: no end id needed) */
            char *t = NULL;
            size_t len = 0, n = (size_t)r[0]->n[k];
            assert_int_equal(r[0]->finish[k], KVF_ENGINE_FINISH_STOP);
            if (n > 0 && r[0]->tokens[k][n - 1] == eos)
                n--;
            assert_int_equal(kvf_text_tokenizer_decode(tok, r[0]->tokens[k], n, false, &t, &len, &err), KVF_OK);
            assert_true(len >= 4 && len <= 7 && t[len - 1] == 'x');
            for (size_t i = 0; i + 1 < len; i++)
                assert_true(t[i] >= 'a' && t[i] <= 'c');
            free(t);
        }
    }
    /* every token of the four was drawn on the backend */
    assert_int_equal(draws[0], tokens);
    kvf_text_tokenizer_destroy(tok);
    DIR *d = opendir(dir);
    struct dirent *de;
    char path[512];
    while (d && (de = readdir(d)))
        if (de->d_name[0] != '.') {
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            unlink(path);
        }
    if (d)
        closedir(d);
    rmdir(dir);
    for (int run = 0; run < 2; run++)
        free(r[run]);
    et_close(fx);
}

int main(void)
{
    char why[256];
    if (!kvf_cuda_available(why, sizeof why)) {
        fprintf(stderr, "host_sample_emu: the emulated device is not available: %s\n", why);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward_draws_follow_the_rule),
        cmocka_unit_test(test_engine_draws_on_the_backend),
        cmocka_unit_test(test_engine_processing_takes_the_host_path),
        cmocka_unit_test(test_engine_guides_draw_on_the_backend),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
