/* test_stress.c: random interleavings of add, cancel and step on tiny-gqa-f32 with a pool of a
 * few blocks and a small swap tier (auto preemption, then each forced mode): the pool and swap
 * invariants hold after every step, each sample reports exactly one finish, greedy requests
 * that were not cancelled give exactly their solo tokens, and at the end every block and slot
 * is back. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "testutil.h"
#include "enginetest.h"

#define N_REQ 24
#define N_PER 2 /* result slots per request: sample index < 2 */

static uint64_t lcg(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

typedef struct req_plan {
    int32_t prompt[ET_MAX_TOK], n_prompt, max_tokens, n;
    bool sampled, cancelled;
    int32_t solo[ET_MAX_TOK], n_solo;
} req_plan;

static void stress(const kvf_model *m, kvf_engine_preempt mode, uint64_t seed)
{
    req_plan *plan = calloc(N_REQ, sizeof *plan);
    uint64_t s = seed;
    for (int32_t i = 0; i < N_REQ; i++) {
        req_plan *p = &plan[i];
        p->n_prompt = 1 + (int32_t)(lcg(&s) % 70);
        for (int32_t j = 0; j < p->n_prompt; j++)
            p->prompt[j] = (int32_t)(lcg(&s) % 320);
        if (i % 3 == 0 && p->n_prompt > 20) /* shared prefixes */
            memcpy(p->prompt, plan[0].prompt, 16 * sizeof(int32_t));
        p->max_tokens = 1 + (int32_t)(lcg(&s) % 20);
        p->n = lcg(&s) % 4 == 0 ? 2 : 1;
        p->sampled = lcg(&s) % 3 == 0;
    }
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.prefix_cache = false;
    /* solo tokens of the greedy n = 1 requests */
    kvf_engine *solo = et_engine(m, &cfg);
    kvf_err err = {0};
    for (int32_t i = 0; i < N_REQ; i++) {
        req_plan *p = &plan[i];
        if (p->sampled || p->n != 1)
            continue;
        kvf_engine_request q = et_req((uint64_t)i, p->prompt, p->n_prompt, p->max_tokens);
        kvf_engine_finish fin;
        assert_int_equal(kvf_engine_generate(solo, &q, p->solo, ET_MAX_TOK, &p->n_solo, &fin, &err), KVF_OK);
    }
    kvf_engine_destroy(solo);

    et_cfg(&cfg);
    cfg.n_blocks = 14;
    cfg.swap_slots = 8;
    cfg.max_batch_tokens = 40;
    cfg.max_seqs = 6;
    cfg.preempt = mode;
    kvf_engine *e = et_engine(m, &cfg);
    et_result *r = calloc(1, sizeof *r);
    int32_t added = 0, steps = 0;
    while (added < N_REQ || kvf_engine_busy(e)) {
        uint64_t dice = lcg(&s) % 10;
        if (added < N_REQ && dice < 3) {
            req_plan *p = &plan[added];
            kvf_engine_request q = et_req((uint64_t)added, p->prompt, p->n_prompt, p->max_tokens);
            q.sampling.n = p->n;
            if (p->sampled) {
                q.sampling.temperature = 0.8f;
                q.sampling.top_k = 20;
                q.sampling.seed = (uint64_t)added;
            }
            if (kvf_engine_add(e, &q, &err) != KVF_OK)
                fail_msg("add %d: %s", added, err.msg);
            added++;
        } else if (added > 0 && dice == 3) {
            int32_t victim = (int32_t)(lcg(&s) % (uint64_t)added);
            kvf_status st = kvf_engine_cancel(e, (uint64_t)victim, &err);
            assert_true(st == KVF_OK || st == KVF_ERR_NOT_FOUND);
            if (st == KVF_OK)
                plan[victim].cancelled = true;
            if (kvf_engine_check(e, &err) != KVF_OK)
                fail_msg("after cancel: %s", err.msg);
        } else {
            const kvf_engine_output *o;
            int32_t n;
            if (kvf_engine_step(e, &o, &n, &err) != KVF_OK)
                fail_msg("step %d: %s", steps, err.msg);
            for (int32_t i = 0; i < n; i++)
                et_collect(r, &o[i], N_PER);
            if (kvf_engine_check(e, &err) != KVF_OK)
                fail_msg("after step %d: %s", steps, err.msg);
            steps++;
            assert_true(steps < 20000);
        }
    }
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    print_message("mode %d: %d steps, %lld recomputes, %lld swaps\n", (int)mode, steps,
                  (long long)st.preempt_recompute, (long long)st.preempt_swap);
    assert_true(st.preempt_recompute + st.preempt_swap > 0);
    assert_int_equal(st.free_blocks + st.cached_blocks, st.total_blocks);
    assert_int_equal(st.swap_slots_free, cfg.swap_slots);
    assert_int_equal(st.running + st.waiting + st.swapped + st.remote, 0);
    for (int32_t i = 0; i < N_REQ; i++) {
        req_plan *p = &plan[i];
        for (int32_t j = 0; j < p->n; j++) {
            int32_t k = i * N_PER + j;
            if (r->finish[k] == KVF_ENGINE_FINISH_NONE)
                fail_msg("request %d sample %d never finished", i, j);
            if (!p->cancelled)
                assert_int_equal(r->finish[k], KVF_ENGINE_FINISH_LENGTH);
        }
        if (!p->cancelled && !p->sampled && p->n == 1) {
            char what[64];
            snprintf(what, sizeof what, "request %d (prompt %d)", i, p->n_prompt);
            et_assert_tokens(what, r->tokens[i * N_PER], r->n[i * N_PER], p->solo, p->n_solo);
        }
        if (!p->cancelled && !p->sampled && p->n == 2)
            et_assert_tokens("greedy n=2", r->tokens[i * N_PER + 1], r->n[i * N_PER + 1],
                             r->tokens[i * N_PER], r->n[i * N_PER]);
    }
    free(r);
    free(plan);
    kvf_engine_destroy(e);
}

static void test_stress_auto(void **state)
{
    et_fixture *f = *state;
    for (uint64_t seed = 1; seed <= 3; seed++)
        stress(f->m, KVF_ENGINE_PREEMPT_AUTO, seed);
}

static void test_stress_recompute(void **state)
{
    et_fixture *f = *state;
    stress(f->m, KVF_ENGINE_PREEMPT_RECOMPUTE, 11);
}

static void test_stress_swap(void **state)
{
    et_fixture *f = *state;
    stress(f->m, KVF_ENGINE_PREEMPT_SWAP, 12);
}

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stress_auto),
        cmocka_unit_test(test_stress_recompute),
        cmocka_unit_test(test_stress_swap),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
