/* test_batch.c: continuous batching against solo runs on tiny-gqa-f32: 32 sequences of mixed
 * prompt and output lengths batched under a small token budget give each exactly its solo
 * tokens; a pool small enough to force preemption gives the same, by recompute, by swap and
 * by the cost-chosen mode, and with bf16 KV, with the pool and swap invariants checked after
 * every step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "testutil.h"
#include "enginetest.h"

#define N_SEQ 32

typedef struct batch {
    et_fixture *f;
    int32_t prompt[N_SEQ][ET_MAX_TOK];
    int32_t n_prompt[N_SEQ], max_tokens[N_SEQ];
    et_result *solo;
} batch;

static uint64_t lcg(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

static int setup(void **state)
{
    batch *b = calloc(1, sizeof *b);
    b->f = et_open("tiny-gqa-f32");
    uint64_t s = 42;
    int32_t vocab = b->f->m->cfg.vocab_size;
    for (int32_t i = 0; i < N_SEQ; i++) {
        b->n_prompt[i] = 1 + (int32_t)(lcg(&s) % 120);
        b->max_tokens[i] = 4 + (int32_t)(lcg(&s) % 24);
        b->prompt[i][0] = 1;
        for (int32_t j = 1; j < b->n_prompt[i]; j++)
            b->prompt[i][j] = 3 + (int32_t)(lcg(&s) % (uint64_t)(vocab - 3));
    }
    /* every 4th prompt shares the first 40 tokens of prompt 0, so prefix hits happen */
    for (int32_t i = 4; i < N_SEQ; i += 4)
        if (b->n_prompt[i] > 40 && b->n_prompt[0] > 40)
            memcpy(b->prompt[i], b->prompt[0], 40 * sizeof(int32_t));
    /* solo: each sequence alone in a fresh engine with the prefix cache off */
    b->solo = calloc(1, sizeof *b->solo);
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.prefix_cache = false;
    for (int32_t i = 0; i < N_SEQ; i++) {
        kvf_engine *e = et_engine(b->f->m, &cfg);
        kvf_engine_request q = et_req((uint64_t)i, b->prompt[i], b->n_prompt[i], b->max_tokens[i]);
        et_add(e, &q);
        et_run(e, b->solo, 1);
        assert_int_equal(b->solo->n[i], b->max_tokens[i]);
        kvf_engine_destroy(e);
    }
    *state = b;
    return 0;
}

static int teardown(void **state)
{
    batch *b = *state;
    et_close(b->f);
    free(b->solo);
    free(b);
    return 0;
}

/* Runs all N_SEQ at once under cfg and compares with the solo tokens; *st_out gets the stats. */
static void run_batch(batch *b, const kvf_engine_cfg *cfg, const char *what, kvf_engine_stats *st_out)
{
    kvf_engine *e = et_engine(b->f->m, cfg);
    et_result *r = calloc(1, sizeof *r);
    for (int32_t i = 0; i < N_SEQ; i++) {
        kvf_engine_request q = et_req((uint64_t)i, b->prompt[i], b->n_prompt[i], b->max_tokens[i]);
        et_add(e, &q);
    }
    et_run(e, r, 1);
    for (int32_t i = 0; i < N_SEQ; i++) {
        char msg[128];
        snprintf(msg, sizeof msg, "%s: sequence %d (prompt %d)", what, i, b->n_prompt[i]);
        et_assert_tokens(msg, r->tokens[i], r->n[i], b->solo->tokens[i], b->solo->n[i]);
        assert_int_equal(r->finish[i], KVF_ENGINE_FINISH_LENGTH);
    }
    kvf_engine_get_stats(e, st_out);
    assert_int_equal(st_out->free_blocks + st_out->cached_blocks, st_out->total_blocks);
    assert_int_equal(st_out->swap_slots_free, cfg->swap_slots);
    print_message("%s: %lld steps, %lld recomputes, %lld swaps, %lld prefix-hit tokens\n", what,
                  (long long)st_out->steps, (long long)st_out->preempt_recompute,
                  (long long)st_out->preempt_swap, (long long)st_out->prefix_hit_tokens);
    free(r);
    kvf_engine_destroy(e);
}

static void test_batch_of_32_equals_solo(void **state)
{
    batch *b = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.max_batch_tokens = 64;
    kvf_engine_stats st;
    run_batch(b, &cfg, "batch of 32", &st);
    assert_int_equal(st.preempt_recompute + st.preempt_swap, 0);
    assert_true(st.prefix_hit_tokens >= 32); /* the shared 40-token prefixes */
    /* with the prefix cache off too */
    cfg.prefix_cache = false;
    run_batch(b, &cfg, "batch of 32, no prefix cache", &st);
    assert_int_equal(st.prefix_hit_tokens, 0);
}

static void test_preempt_recompute(void **state)
{
    batch *b = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 24;
    cfg.swap_slots = 0;
    cfg.preempt = KVF_ENGINE_PREEMPT_RECOMPUTE;
    kvf_engine_stats st;
    run_batch(b, &cfg, "recompute", &st);
    assert_true(st.preempt_recompute > 0);
    assert_int_equal(st.preempt_swap, 0);
    cfg.prefix_cache = false; /* the recompute really recomputes everything */
    run_batch(b, &cfg, "recompute, no prefix cache", &st);
    assert_true(st.preempt_recompute > 0);
}

static void test_preempt_swap(void **state)
{
    batch *b = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 24;
    cfg.swap_slots = 64;
    cfg.preempt = KVF_ENGINE_PREEMPT_SWAP;
    kvf_engine_stats st;
    run_batch(b, &cfg, "swap", &st);
    assert_true(st.preempt_swap > 0);
    /* a tier too small for some sequences: those fall back to recompute */
    cfg.swap_slots = 3;
    run_batch(b, &cfg, "swap, 3 slots", &st);
    assert_true(st.preempt_swap + st.preempt_recompute > 0);
}

static void test_preempt_auto_by_cost(void **state)
{
    batch *b = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 24;
    cfg.swap_slots = 64;
    cfg.preempt = KVF_ENGINE_PREEMPT_AUTO;
    kvf_engine_stats st;
    /* copying is nearly free next to computing: swap */
    cfg.copy_bytes_per_s = 1e15;
    run_batch(b, &cfg, "auto, fast copies", &st);
    assert_true(st.preempt_swap > 0);
    assert_int_equal(st.preempt_recompute, 0);
    /* copying is very slow: recompute */
    cfg.copy_bytes_per_s = 1.0;
    run_batch(b, &cfg, "auto, slow copies", &st);
    assert_true(st.preempt_recompute > 0);
    assert_int_equal(st.preempt_swap, 0);

    kvf_engine *e = et_engine(b->f->m, &cfg);
    double rc, sw;
    kvf_engine_preempt_cost(e, 100, 7, &rc, &sw);
    assert_true(rc > 0 && sw > rc);
    kvf_engine_destroy(e);
}

/* bf16 KV: rounding changes the numbers, but a sequence's KV is the same whatever runs beside
 * it, so batched and swapped runs still equal the solo bf16 runs. */
static void test_bf16_kv_batch_equals_solo(void **state)
{
    batch *b = *state;
    enum { N = 12 };
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.kv_dtype = KVF_DTYPE_BF16;
    cfg.prefix_cache = false;
    et_result *solo = calloc(1, sizeof *solo), *r = calloc(1, sizeof *r);
    kvf_engine *e = et_engine(b->f->m, &cfg);
    for (int32_t i = 0; i < N; i++) {
        kvf_engine_request q = et_req((uint64_t)i, b->prompt[i], b->n_prompt[i], b->max_tokens[i]);
        et_add(e, &q);
        et_run(e, solo, 1);
    }
    kvf_engine_destroy(e);
    et_cfg(&cfg);
    cfg.kv_dtype = KVF_DTYPE_BF16;
    cfg.n_blocks = 16;
    cfg.preempt = KVF_ENGINE_PREEMPT_SWAP;
    e = et_engine(b->f->m, &cfg);
    for (int32_t i = 0; i < N; i++) {
        kvf_engine_request q = et_req((uint64_t)i, b->prompt[i], b->n_prompt[i], b->max_tokens[i]);
        et_add(e, &q);
    }
    et_run(e, r, 1);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    assert_true(st.preempt_swap > 0);
    for (int32_t i = 0; i < N; i++)
        et_assert_tokens("bf16 KV, batched vs solo", r->tokens[i], r->n[i], solo->tokens[i], solo->n[i]);
    kvf_engine_destroy(e);
    free(solo);
    free(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_of_32_equals_solo),
        cmocka_unit_test(test_preempt_recompute),
        cmocka_unit_test(test_preempt_swap),
        cmocka_unit_test(test_preempt_auto_by_cost),
        cmocka_unit_test(test_bf16_kv_batch_equals_solo),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
