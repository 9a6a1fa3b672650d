/* test_fixtures.c: every case of every ../shared/fixtures/models model through the engine:
 * each greedy list exactly, alone and all cases batched together with a small token budget
 * (chunked prefill mixed with decodes); shared-prefix-a then -b with the prefix cache warm
 * gives the same tokens as -b cold, and the warm run really hit the cache. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "testutil.h"
#include "enginetest.h"

static const char *models[] = {"tiny-gqa-f32", "tiny-mha-tied-f32", "tiny-mqa-bf16",
                               "small-gqa-bf16-theta5e5"};
#define N_MODELS (sizeof models / sizeof models[0])

static void test_every_case_solo(void **state)
{
    for (size_t mi = 0; mi < N_MODELS; mi++) {
        et_fixture *f = et_open(models[mi]);
        kvf_engine_cfg cfg;
        et_cfg(&cfg);
        cfg.max_batch_tokens = 32; /* the long prompts prefill in chunks */
        kvf_engine *e = et_engine(f->m, &cfg);
        for (int32_t i = 0; i < f->n_cases; i++) {
            const et_case *k = &f->cases[i];
            et_result *r = calloc(1, sizeof *r);
            kvf_engine_request q = et_req(0, k->prompt, k->n_prompt, f->n_new);
            et_add(e, &q);
            et_run(e, r, 1);
            char what[128];
            snprintf(what, sizeof what, "%s/%s", models[mi], k->name);
            et_assert_tokens(what, r->tokens[0], r->n[0], k->greedy, k->n_greedy);
            assert_int_equal(r->finish[0], KVF_ENGINE_FINISH_LENGTH);
            free(r);
        }
        kvf_engine_destroy(e);
        et_close(f);
    }
}

static void test_every_case_batched(void **state)
{
    for (size_t mi = 0; mi < N_MODELS; mi++) {
        et_fixture *f = et_open(models[mi]);
        kvf_engine_cfg cfg;
        et_cfg(&cfg);
        cfg.max_batch_tokens = 48;
        kvf_engine *e = et_engine(f->m, &cfg);
        et_result *r = calloc(1, sizeof *r);
        for (int32_t i = 0; i < f->n_cases; i++) {
            kvf_engine_request q = et_req((uint64_t)i, f->cases[i].prompt, f->cases[i].n_prompt,
                                          f->n_new);
            et_add(e, &q);
        }
        int32_t steps = et_run(e, r, 1);
        for (int32_t i = 0; i < f->n_cases; i++) {
            char what[128];
            snprintf(what, sizeof what, "%s/%s batched", models[mi], f->cases[i].name);
            et_assert_tokens(what, r->tokens[i], r->n[i], f->cases[i].greedy, f->cases[i].n_greedy);
        }
        kvf_engine_stats st;
        kvf_engine_get_stats(e, &st);
        /* batched: far fewer steps than the sequences one after another */
        assert_true(steps < f->n_cases * f->n_new);
        assert_int_equal(st.decode_tokens, (int64_t)f->n_cases * (f->n_new - 1));
        assert_int_equal(st.running + st.waiting + st.swapped, 0);
        assert_int_equal(st.free_blocks + st.cached_blocks, st.total_blocks);
        free(r);
        kvf_engine_destroy(e);
        et_close(f);
    }
}

static void run_one(kvf_engine *e, const et_case *k, int32_t n_new, int32_t *out, int32_t *n_out)
{
    et_result *r = calloc(1, sizeof *r);
    kvf_engine_request q = et_req(0, k->prompt, k->n_prompt, n_new);
    et_add(e, &q);
    et_run(e, r, 1);
    memcpy(out, r->tokens[0], (size_t)r->n[0] * sizeof *out);
    *n_out = r->n[0];
    free(r);
}

static void test_shared_prefix_warm_equals_cold(void **state)
{
    for (size_t mi = 0; mi < N_MODELS; mi++) {
        et_fixture *f = et_open(models[mi]);
        const et_case *a = et_find(f, "shared-prefix-a"), *b = et_find(f, "shared-prefix-b");
        kvf_engine_cfg cfg;
        et_cfg(&cfg);
        int32_t cold[ET_MAX_TOK], warm[ET_MAX_TOK], wa[ET_MAX_TOK], n_cold, n_warm, n_a;

        kvf_engine *e = et_engine(f->m, &cfg);
        run_one(e, b, f->n_new, cold, &n_cold);
        kvf_engine_stats st;
        kvf_engine_get_stats(e, &st);
        assert_int_equal(st.prefix_hit_tokens, 0);
        kvf_engine_destroy(e);

        e = et_engine(f->m, &cfg);
        run_one(e, a, f->n_new, wa, &n_a);
        run_one(e, b, f->n_new, warm, &n_warm);
        kvf_engine_get_stats(e, &st);
        /* b reused a's two shared 16-token blocks */
        assert_int_equal(st.prefix_hit_tokens, 32);
        kvf_engine_destroy(e);

        char what[128];
        snprintf(what, sizeof what, "%s: shared-prefix-b warm vs cold", models[mi]);
        et_assert_tokens(what, warm, n_warm, cold, n_cold);
        snprintf(what, sizeof what, "%s: shared-prefix-b vs expected", models[mi]);
        et_assert_tokens(what, warm, n_warm, b->greedy, b->n_greedy);
        snprintf(what, sizeof what, "%s: shared-prefix-a vs expected", models[mi]);
        et_assert_tokens(what, wa, n_a, a->greedy, a->n_greedy);

        /* the same prompt again reuses every full block but the last token's */
        e = et_engine(f->m, &cfg);
        run_one(e, b, f->n_new, cold, &n_cold);
        run_one(e, b, f->n_new, warm, &n_warm);
        kvf_engine_get_stats(e, &st);
        assert_int_equal(st.prefix_hit_tokens, (b->n_prompt - 1) / 16 * 16);
        et_assert_tokens("same prompt twice", warm, n_warm, b->greedy, b->n_greedy);
        kvf_engine_destroy(e);
        et_close(f);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_case_solo),
        cmocka_unit_test(test_every_case_batched),
        cmocka_unit_test(test_shared_prefix_warm_equals_cold),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
