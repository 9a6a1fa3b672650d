/* Constrained decoding in the engine (issue 24): a guide holds every sample of a batch to its
 * language at temperature 1 (a random-weight fixture model, whose free output is noise), leaves
 * unguided neighbours' tokens alone, ends a complete match without an end id, survives
 * preemption with the same tokens, replays output already streamed, checks a remote prefill's
 * first token, and refuses a bad guide or a missing tokenizer by name with nothing leaked. The
 * tokenizer is the default byte-level one written for the model's 320 ids. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "testutil.h"
#include "enginetest.h"
#include "text/guide.h"
#include "text/tokenizer.h"

static char g_dir[64];
static kvf_text_tokenizer *g_tok;
static et_fixture *g_fx;
static int32_t g_eos;

static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvf-guide-XXXXXX");
    assert_non_null(mkdtemp(g_dir));
    kvf_err err = {0};
    g_fx = et_open("tiny-gqa-f32");
    if (kvf_text_tokenizer_write_default(g_dir, g_fx->m->cfg.vocab_size, &err) != KVF_OK ||
        kvf_text_tokenizer_load(g_dir, &g_tok, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    g_eos = kvf_text_tokenizer_eos_id(g_tok);
    assert_true(g_eos >= 0);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    DIR *d = opendir(g_dir);
    struct dirent *de;
    char p[512];
    while (d && (de = readdir(d)))
        if (de->d_name[0] != '.') {
            snprintf(p, sizeof p, "%s/%s", g_dir, de->d_name);
            unlink(p);
        }
    if (d)
        closedir(d);
    rmdir(g_dir);
    kvf_text_tokenizer_destroy(g_tok);
    et_close(g_fx);
    return 0;
}

static kvf_engine *guide_engine(int32_t n_blocks)
{
    kvf_engine_cfg c;
    et_cfg(&c);
    c.tokenizer_dir = g_dir;
    if (n_blocks)
        c.n_blocks = n_blocks;
    return et_engine(g_fx->m, &c);
}

static kvf_engine_request guided(uint64_t id, int32_t kind, const char *text, float temperature,
                                 int32_t max_tokens)
{
    const et_case *k = &g_fx->cases[0];
    kvf_engine_request r = et_req(id, k->prompt, k->n_prompt, max_tokens);
    r.sampling.temperature = temperature;
    r.sampling.seed = 100 + id;
    r.sampling.guide_kind = kind;
    r.sampling.guide = text;
    r.sampling.guide_len = text ? strlen(text) : 0;
    r.sampling.eos_ids[0] = g_eos;
    r.sampling.n_eos = 1;
    return r;
}

/* The text of a sample's tokens, without a final end id. */
static char *text_of(const int32_t *ids, int32_t n)
{
    if (n > 0 && ids[n - 1] == g_eos)
        n--;
    char *t = NULL;
    size_t len;
    kvf_err err = {0};
    if (kvf_text_tokenizer_decode(g_tok, ids, (size_t)n, false, &t, &len, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    return t;
}

/* [a-c]{3,6}x, checked by hand */
static bool abc_x(const char *t)
{
    size_t n = strlen(t);
    if (n < 4 || n > 7 || t[n - 1] != 'x')
        return false;
    for (size_t i = 0; i + 1 < n; i++)
        if (t[i] < 'a' || t[i] > 'c')
            return false;
    return true;
}

static void test_regex_sampled_batch(void **state)
{
    (void)state;
    kvf_engine *e = guide_engine(0);
    static et_result r;
    memset(&r, 0, sizeof r);
    for (uint64_t id = 0; id < 20; id++) {
        kvf_engine_request q = guided(id, KVF_TEXT_GUIDE_REGEX, "[a-c]{3,6}x", 1.0f, 40);
        et_add(e, &q);
    }
    et_run(e, &r, 1);
    int distinct = 0;
    char *first = NULL;
    for (int k = 0; k < 20; k++) {
        assert_int_equal(r.finish[k], KVF_ENGINE_FINISH_STOP);
        char *t = text_of(r.tokens[k], r.n[k]);
        if (!abc_x(t))
            fail_msg("sample %d: \"%s\" is not [a-c]{3,6}x", k, t);
        if (!first)
            first = t;
        else {
            distinct += strcmp(first, t) != 0;
            free(t);
        }
    }
    free(first);
    assert_true(distinct > 0); /* temperature 1 samples, not one forced string */
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.free_blocks + st.cached_blocks, st.total_blocks);
    kvf_engine_destroy(e);
}

/* A guided batch beside plain greedy requests: the plain ones give the fixture's tokens. */
static void test_guided_beside_plain(void **state)
{
    (void)state;
    kvf_engine *e = guide_engine(0);
    static et_result r;
    memset(&r, 0, sizeof r);
    for (uint64_t id = 0; id < 8; id++) {
        if (id % 2 == 0) {
            const et_case *k = &g_fx->cases[id / 2 % g_fx->n_cases];
            kvf_engine_request q = et_req(id, k->prompt, k->n_prompt, g_fx->n_new);
            et_add(e, &q);
        } else {
            kvf_engine_request q = guided(id, KVF_TEXT_GUIDE_JSON_OBJECT, NULL, 1.0f, 30);
            et_add(e, &q);
        }
    }
    et_run(e, &r, 1);
    for (uint64_t id = 0; id < 8; id += 2) {
        const et_case *k = &g_fx->cases[id / 2 % g_fx->n_cases];
        et_assert_tokens(k->name, r.tokens[id], r.n[id], k->greedy, k->n_greedy);
    }
    for (uint64_t id = 1; id < 8; id += 2) {
        char *t = text_of(r.tokens[id], r.n[id]);
        assert_true(t[0] == '{'); /* cut by max_tokens or complete: an object's start */
        if (r.finish[id] == KVF_ENGINE_FINISH_STOP) {
            json_error_t je;
            json_t *v = json_loads(t, 0, &je);
            if (!json_is_object(v))
                fail_msg("\"%s\" is not a JSON object", t);
            json_decref(v);
        }
        free(t);
    }
    kvf_engine_destroy(e);
}

/* With no end id to take, a complete match that nothing may follow ends the sequence (STOP);
 * n samples each follow the guide. */
static void test_choice_done_and_n(void **state)
{
    (void)state;
    kvf_engine *e = guide_engine(0);
    static et_result r;
    memset(&r, 0, sizeof r);
    kvf_engine_request q = guided(0, KVF_TEXT_GUIDE_CHOICE, "[\"abc\",\"abd\",\"b\"]", 1.0f, 20);
    q.sampling.n_eos = 0;
    q.sampling.n = 4;
    et_add(e, &q);
    et_run(e, &r, 4);
    for (int k = 0; k < 4; k++) {
        assert_int_equal(r.finish[k], KVF_ENGINE_FINISH_STOP);
        char *t = text_of(r.tokens[k], r.n[k]);
        if (strcmp(t, "abc") && strcmp(t, "abd") && strcmp(t, "b"))
            fail_msg("sample %d: \"%s\" is not a choice", k, t);
        free(t);
    }
    kvf_engine_destroy(e);
}

/* A pool small enough that guided sequences are preempted (recompute) gives the same tokens as
 * a pool that holds them all. */
static void test_preempted_same_tokens(void **state)
{
    (void)state;
    static et_result big, small;
    memset(&big, 0, sizeof big);
    memset(&small, 0, sizeof small);
    const char *re = "([a-z]{1,4} ){10,20}end";
    for (int pass = 0; pass < 2; pass++) {
        kvf_engine *e = guide_engine(pass == 0 ? 0 : 12);
        for (uint64_t id = 0; id < 6; id++) {
            kvf_engine_request q = guided(id, KVF_TEXT_GUIDE_REGEX, re, 1.0f, 120);
            et_add(e, &q);
        }
        et_run(e, pass == 0 ? &big : &small, 1);
        kvf_engine_stats st;
        kvf_engine_get_stats(e, &st);
        if (pass == 1)
            assert_true(st.preempt_recompute + st.preempt_swap > 0);
        kvf_engine_destroy(e);
    }
    for (int k = 0; k < 6; k++)
        et_assert_tokens("preempted", small.tokens[k], small.n[k], big.tokens[k], big.n[k]);
}

/* Output already streamed (a resumed request) is replayed into the guide: the new tokens go on
 * from there; a prior output the guide refuses is refused at add, by name. */
static void test_prior_output(void **state)
{
    (void)state;
    kvf_engine *e = guide_engine(0);
    int32_t *ab = NULL;
    size_t n_ab = 0;
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_encode(g_tok, "abb", 3, false, &ab, &n_ab, &err), KVF_OK);
    const et_case *k = &g_fx->cases[0];
    int32_t prompt[ET_MAX_TOK];
    memcpy(prompt, k->prompt, (size_t)k->n_prompt * sizeof *prompt);
    memcpy(prompt + k->n_prompt, ab, n_ab * sizeof *prompt);
    kvf_engine_request q = guided(0, KVF_TEXT_GUIDE_REGEX, "ab+c", 1.0f, 20);
    q.prompt = prompt;
    q.n_prompt = k->n_prompt + (int32_t)n_ab;
    q.n_prior_output = (int32_t)n_ab;
    et_add(e, &q);
    static et_result r;
    memset(&r, 0, sizeof r);
    et_run(e, &r, 1);
    char *t = text_of(r.tokens[0], r.n[0]);
    /* the whole output is "abb" + this, in ab+c */
    size_t n = strlen(t);
    assert_true(n >= 1 && t[n - 1] == 'c');
    for (size_t i = 0; i + 1 < n; i++)
        assert_int_equal(t[i], 'b');
    free(t);

    q.id = 1;
    q.sampling.guide = "c+";
    q.sampling.guide_len = 2;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "does not follow the guide"));
    assert_int_equal(kvf_engine_check(e, &err), KVF_OK);
    free(ab);
    kvf_engine_destroy(e);
}

/* A remote prefill's first token must follow the guide. */
static void test_remote_first_token(void **state)
{
    (void)state;
    kvf_engine *e = guide_engine(0);
    kvf_err err = {0};
    int32_t blocks[64], nb = 0, x = kvf_text_tokenizer_token_to_id(g_tok, "x"),
            a = kvf_text_tokenizer_token_to_id(g_tok, "a");
    assert_true(x >= 0 && a >= 0);
    kvf_engine_request q = guided(0, KVF_TEXT_GUIDE_REGEX, "a+", 0.0f, 8);
    assert_int_equal(kvf_engine_add_remote(e, &q, blocks, 64, &nb, NULL, &err), KVF_OK);
    assert_int_equal(kvf_engine_remote_done(e, 0, x, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "first token"));
    assert_int_equal(kvf_engine_remote_done(e, 0, a, &err), KVF_OK);
    static et_result r;
    memset(&r, 0, sizeof r);
    et_run(e, &r, 1);
    char *t = text_of(r.tokens[0], r.n[0]);
    for (const char *p = t; *p; p++)
        assert_int_equal(*p, 'a');
    free(t);
    kvf_engine_destroy(e);
}

/* Refusals: a bad regex (named), an unknown kind, and a guide on an engine without a tokenizer;
 * nothing is left behind and the next request runs. */
static void test_refusals(void **state)
{
    (void)state;
    kvf_engine *e = guide_engine(0);
    kvf_err err = {0};
    kvf_engine_request q = guided(0, KVF_TEXT_GUIDE_REGEX, "a(", 1.0f, 8);
    q.sampling.n = 3;
    kvf_status bad = kvf_engine_add(e, &q, &err);
    assert_true(bad == KVF_ERR_INVALID || bad == KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "req 0"));
    q.sampling.guide_kind = 42;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "guide kind 42"));
    assert_int_equal(kvf_engine_check(e, &err), KVF_OK);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_int_equal(st.running + st.waiting, 0);
    q = guided(1, KVF_TEXT_GUIDE_REGEX, "b{2}", 1.0f, 8);
    et_add(e, &q);
    static et_result r;
    memset(&r, 0, sizeof r);
    et_run(e, &r, 1);
    assert_int_equal(r.finish[1], KVF_ENGINE_FINISH_STOP);
    kvf_engine_destroy(e);

    kvf_engine_cfg c;
    et_cfg(&c); /* no tokenizer_dir */
    e = et_engine(g_fx->m, &c);
    q = guided(0, KVF_TEXT_GUIDE_JSON_OBJECT, NULL, 1.0f, 8);
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "tokenizer.json"));
    kvf_engine_destroy(e);

    /* a tokenizer.json this build cannot read: the engine serves, guides are refused */
    char bad_dir[] = "/tmp/kvf-guide-bad-XXXXXX", path[128];
    assert_non_null(mkdtemp(bad_dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", bad_dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"model\": {\"type\": \"WordLevel\"}}", f);
    fclose(f);
    c.tokenizer_dir = bad_dir;
    e = et_engine(g_fx->m, &c);
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_UNSUPPORTED);
    const et_case *k = &g_fx->cases[0];
    kvf_engine_request plain = et_req(1, k->prompt, k->n_prompt, g_fx->n_new);
    et_add(e, &plain);
    memset(&r, 0, sizeof r);
    et_run(e, &r, 1);
    et_assert_tokens("beside a bad tokenizer", r.tokens[1], r.n[1], k->greedy, k->n_greedy);
    kvf_engine_destroy(e);
    unlink(path);
    rmdir(bad_dir);

    /* a resumed stream is one sample */
    e = guide_engine(0);
    q = guided(2, KVF_TEXT_GUIDE_REGEX, "a+", 1.0f, 8);
    q.sampling.n = 2;
    q.n_prior_output = 1;
    assert_int_equal(kvf_engine_add(e, &q, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "n_prior_output 1 with n 2"));
    kvf_engine_destroy(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_regex_sampled_batch),
        cmocka_unit_test(test_guided_beside_plain),
        cmocka_unit_test(test_choice_done_and_n),
        cmocka_unit_test(test_preempted_same_tokens),
        cmocka_unit_test(test_prior_output),
        cmocka_unit_test(test_remote_first_token),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
