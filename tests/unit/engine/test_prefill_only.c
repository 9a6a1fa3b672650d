/* test_prefill_only.c: prefill-only requests (what a prefill worker runs) on tiny-gqa-f32: one
 * output, the first token (greedy = the fixture's, seeded = a normal request's), then every
 * block of the prompt kept, the partial last one included, with KV that a second engine
 * continues from into the exact greedy list (what a decode worker does after the transfer);
 * full blocks registered for later prompts; concurrent requests share steps; a request that
 * needs kept blocks waits instead of failing; release and cancel give everything back. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

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

static void check(kvf_engine *e)
{
    kvf_err err = {0};
    if (kvf_engine_check(e, &err) != KVF_OK)
        fail_msg("%s", err.msg);
}

static kvf_engine_request po_req(uint64_t id, const et_case *k)
{
    kvf_engine_request r = et_req(id, k->prompt, k->n_prompt, 1);
    r.prefill_only = true;
    return r;
}

static void add(kvf_engine *e, const kvf_engine_request *r)
{
    kvf_err err = {0};
    if (kvf_engine_add(e, r, &err) != KVF_OK)
        fail_msg("add %llu: %s", (unsigned long long)r->id, err.msg);
}

/* Steps until request id reports its output; returns the token (and checks the finish). The
 * largest number of sequences one step computed goes to *max_seqs (may be NULL). */
static int32_t until_prefilled(kvf_engine *e, uint64_t id, int32_t *max_seqs)
{
    kvf_err err = {0};
    for (int i = 0; i < 1000; i++) {
        const kvf_engine_output *o;
        int32_t n;
        if (kvf_engine_step(e, &o, &n, &err) != KVF_OK)
            fail_msg("step: %s", err.msg);
        check(e);
        kvf_engine_stats es;
        kvf_engine_get_stats(e, &es);
        if (max_seqs && es.last_step_seqs > *max_seqs)
            *max_seqs = es.last_step_seqs;
        for (int32_t k = 0; k < n; k++)
            if (o[k].id == id) {
                assert_int_equal(o[k].finish, KVF_ENGINE_FINISH_PREFILLED);
                assert_int_equal(o[k].n_generated, 1);
                return o[k].token;
            }
    }
    fail_msg("request %llu never prefilled", (unsigned long long)id);
    return -1;
}

static void pool_stats(kvf_engine *e, kvf_kv_pool_stats *ps)
{
    kvf_kv_pool_get_stats(kvf_engine_pool(e), ps);
}

/* Copies blocks src[0..n) of a's pool into blocks dst[0..n) of b's (the transfer). */
static void copy_blocks(kvf_engine *a, const int32_t *src, kvf_engine *b, const int32_t *dst,
                        int32_t n)
{
    kvf_kv_pool *pa = kvf_engine_pool(a), *pb = kvf_engine_pool(b);
    int64_t bb = kvf_kv_pool_layout(pa)->block_bytes;
    for (int32_t i = 0; i < n; i++)
        memcpy((char *)kvf_kv_pool_base(pb) + (int64_t)dst[i] * bb,
               (const char *)kvf_kv_pool_base(pa) + (int64_t)src[i] * bb, (size_t)bb);
}

/* Every fixture case: the first token is the greedy one; the kept blocks hold the whole prompt
 * (the partial last block too) and nothing runs for it while kept; release gives every block
 * back, the full ones cached. */
static void test_first_token_and_kept_blocks(void **state)
{
    et_fixture *f = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *pre = et_engine(f->m, &cfg);
    for (int32_t c = 0; c < f->n_cases; c++) {
        const et_case *k = &f->cases[c];
        uint64_t id = 100 + (uint64_t)c;
        kvf_engine_request r = po_req(id, k);
        add(pre, &r);
        int32_t tok = until_prefilled(pre, id, NULL);
        assert_int_equal(tok, k->greedy[0]);
        assert_false(kvf_engine_busy(pre)); /* kept: nothing left to compute */

        kvf_engine_req_info info;
        kvf_err err = {0};
        assert_int_equal(kvf_engine_req_info_get(pre, id, &info, &err), KVF_OK);
        assert_int_equal(info.state, KVF_ENGINE_REQ_KEPT);
        assert_int_equal(info.n_computed, k->n_prompt);
        assert_int_equal(info.n_blocks, kvf_kv_blocks_for(k->n_prompt, cfg.block_size));
        assert_true(info.admitted_ns > 0);
        kvf_engine_stats es;
        kvf_engine_get_stats(pre, &es);
        assert_int_equal(es.kept, 1);
        assert_int_equal(es.kept_blocks, info.n_blocks);
        /* another step changes nothing for it */
        const kvf_engine_output *o;
        int32_t n;
        assert_int_equal(kvf_engine_step(pre, &o, &n, &err), KVF_OK);
        assert_int_equal(n, 0);
        check(pre);

        int32_t released = 0;
        assert_int_equal(kvf_engine_release_kept(pre, id, &released, &err), KVF_OK);
        assert_int_equal(released, info.n_blocks);
        assert_int_equal(kvf_engine_release_kept(pre, id, NULL, &err), KVF_ERR_NOT_FOUND);
        check(pre);
        kvf_kv_pool_stats ps;
        pool_stats(pre, &ps);
        assert_int_equal(ps.used, 0);
        assert_true(ps.cached >= k->n_prompt / cfg.block_size);
    }
    kvf_engine_destroy(pre);
}

/* The decode side of the hand-over, with its tokens compared: a prompt prefilled on one engine
 * and continued on another gives the fixture's greedy list. */
static void test_hand_over_gives_greedy_list(void **state)
{
    et_fixture *f = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    for (int32_t c = 0; c < f->n_cases; c++) {
        const et_case *k = &f->cases[c];
        kvf_engine *pre = et_engine(f->m, &cfg), *dec = et_engine(f->m, &cfg);
        kvf_engine_request r = po_req(0, k);
        add(pre, &r);
        int32_t tok = until_prefilled(pre, 0, NULL);
        kvf_engine_req_info info;
        kvf_err err = {0};
        assert_int_equal(kvf_engine_req_info_get(pre, 0, &info, &err), KVF_OK);
        kvf_engine_request d = et_req(0, k->prompt, k->n_prompt, k->n_greedy);
        int32_t ids[64], nb = 0;
        int64_t cached = 0;
        assert_int_equal(kvf_engine_add_remote(dec, &d, ids, 64, &nb, &cached, &err), KVF_OK);
        assert_int_equal(cached, 0);
        copy_blocks(pre, info.blocks, dec, ids, nb);
        assert_int_equal(kvf_engine_remote_done(dec, 0, tok, &err), KVF_OK);
        et_result *res = calloc(1, sizeof *res);
        et_run(dec, res, 1);
        assert_int_equal(res->n[0], k->n_greedy);
        assert_memory_equal(res->tokens[0], k->greedy, (size_t)k->n_greedy * sizeof(int32_t));
        free(res);
        assert_int_equal(kvf_engine_release_kept(pre, 0, NULL, &err), KVF_OK);
        kvf_engine_destroy(pre);
        kvf_engine_destroy(dec);
    }
}

/* A seeded, sampled first token is the one a normal request with the same seed draws. */
static void test_seeded_first_token(void **state)
{
    et_fixture *f = *state;
    const et_case *k = et_find(f, "hundred");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = et_engine(f->m, &cfg);
    for (uint64_t seed = 1; seed <= 8; seed++) {
        kvf_engine_request a = et_req(2 * seed, k->prompt, k->n_prompt, 1);
        a.sampling.temperature = 1.5f;
        a.sampling.top_p = 0.95f;
        a.sampling.top_k = 40;
        a.sampling.seed = seed;
        kvf_engine_request b = a;
        b.id = 2 * seed + 1;
        b.prefill_only = true;
        add(e, &a);
        add(e, &b);
        int32_t want = -1, got = -1;
        kvf_err err = {0};
        while (want < 0 || got < 0) {
            const kvf_engine_output *o;
            int32_t n;
            assert_int_equal(kvf_engine_step(e, &o, &n, &err), KVF_OK);
            check(e);
            for (int32_t i = 0; i < n; i++) {
                if (o[i].id == a.id)
                    want = o[i].token;
                if (o[i].id == b.id) {
                    assert_int_equal(o[i].finish, KVF_ENGINE_FINISH_PREFILLED);
                    got = o[i].token;
                }
            }
        }
        assert_int_equal(got, want);
        assert_int_equal(kvf_engine_release_kept(e, b.id, NULL, &err), KVF_OK);
    }
    kvf_engine_destroy(e);
}

/* Concurrent prefill-only requests share steps; a later one with the same prompt finds its
 * full blocks in the cache (all but the block holding the last token). */
static void test_batching_and_prefix_cache(void **state)
{
    et_fixture *f = *state;
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.max_batch_tokens = 512;
    kvf_engine *e = et_engine(f->m, &cfg);
    for (int32_t c = 0; c < f->n_cases; c++) {
        kvf_engine_request r = po_req((uint64_t)c, &f->cases[c]);
        add(e, &r);
    }
    int32_t max_seqs = 0;
    for (int32_t c = 0; c < f->n_cases; c++) {
        kvf_engine_req_info info;
        kvf_err err = {0};
        assert_int_equal(kvf_engine_req_info_get(e, (uint64_t)c, &info, &err), KVF_OK);
        if (info.state != KVF_ENGINE_REQ_KEPT)
            until_prefilled(e, (uint64_t)c, &max_seqs);
    }
    if (f->n_cases >= 2)
        assert_true(max_seqs >= 2);
    kvf_err err = {0};
    for (int32_t c = 0; c < f->n_cases; c++)
        assert_int_equal(kvf_engine_release_kept(e, (uint64_t)c, NULL, &err), KVF_OK);
    const et_case *k = et_find(f, "hundred");
    kvf_engine_request r = po_req(99, k);
    add(e, &r);
    assert_int_equal(until_prefilled(e, 99, NULL), k->greedy[0]);
    kvf_engine_req_info info;
    assert_int_equal(kvf_engine_req_info_get(e, 99, &info, &err), KVF_OK);
    assert_int_equal(info.n_cached, (k->n_prompt - 1) / cfg.block_size * cfg.block_size);
    assert_int_equal(kvf_engine_release_kept(e, 99, NULL, &err), KVF_OK);
    kvf_engine_destroy(e);
}

/* A pool too small for two kept prompts: the second waits (it is not finished for want of
 * blocks) until the first is released, then prefills. Cancel of a kept request frees its
 * blocks and reports nothing more. */
static void test_waits_for_kept_blocks_and_cancel(void **state)
{
    et_fixture *f = *state;
    const et_case *k = et_find(f, "hundred");
    int64_t need = kvf_kv_blocks_for(k->n_prompt, 16);
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = (int32_t)(need + need / 2); /* one prompt fits, two do not */
    cfg.swap_slots = 0;
    kvf_engine *e = et_engine(f->m, &cfg);
    int32_t other[ET_MAX_TOK];
    for (int32_t i = 0; i < k->n_prompt; i++)
        other[i] = (k->prompt[i] + 7) % 300 + 3;
    kvf_engine_request a = po_req(1, k), b = po_req(2, k);
    b.prompt = other;
    add(e, &a);
    assert_int_equal(until_prefilled(e, 1, NULL), k->greedy[0]);
    add(e, &b);
    kvf_err err = {0};
    for (int i = 0; i < 20; i++) {
        const kvf_engine_output *o;
        int32_t n;
        assert_int_equal(kvf_engine_step(e, &o, &n, &err), KVF_OK);
        assert_int_equal(n, 0); /* b neither runs nor fails while a keeps its blocks */
        check(e);
    }
    kvf_engine_req_info info;
    assert_int_equal(kvf_engine_req_info_get(e, 2, &info, &err), KVF_OK);
    assert_int_equal(info.state, KVF_ENGINE_REQ_QUEUED);
    assert_int_equal(kvf_engine_release_kept(e, 1, NULL, &err), KVF_OK);
    until_prefilled(e, 2, NULL);
    /* cancel of a kept request: its blocks back, no output after */
    assert_int_equal(kvf_engine_cancel(e, 2, &err), KVF_OK);
    const kvf_engine_output *o;
    int32_t n;
    assert_int_equal(kvf_engine_step(e, &o, &n, &err), KVF_OK);
    assert_int_equal(n, 0);
    check(e);
    kvf_kv_pool_stats ps;
    pool_stats(e, &ps);
    assert_int_equal(ps.used, 0);
    assert_int_equal(kvf_engine_req_info_get(e, 2, &info, &err), KVF_ERR_NOT_FOUND);
    /* n > 1 is refused for a prefill-only request */
    kvf_engine_request bad = po_req(3, k);
    bad.sampling.n = 2;
    assert_int_equal(kvf_engine_add(e, &bad, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "prefill_only"));
    kvf_engine_destroy(e);
}

/* A moved stream is the same stream (issue 21): a seeded sampled request with penalties,
 * prefilled on one engine and continued on another, and one resumed at any point from its output
 * so far (n_prior_output: another decode worker taking over mid-stream), give the tokens of one
 * local run: the sampler's draws and the penalties' counts go on where they were. */
static void test_seeded_moves(void **state)
{
    et_fixture *f = *state;
    const et_case *k = et_find(f, "hundred");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    enum { N = 24 };
    kvf_engine_request base = et_req(0, k->prompt, k->n_prompt, N);
    base.sampling.temperature = 1.2f;
    base.sampling.top_k = 50;
    base.sampling.seed = 77;
    base.sampling.frequency_penalty = 0.8f;
    base.sampling.presence_penalty = 0.3f;
    kvf_engine *e = et_engine(f->m, &cfg);
    et_result *want = calloc(1, sizeof *want), *got = calloc(1, sizeof *got);
    add(e, &base);
    et_run(e, want, 1);
    kvf_engine_destroy(e);
    assert_int_equal(want->n[0], N);

    /* prefilled elsewhere */
    kvf_engine *pre = et_engine(f->m, &cfg), *dec = et_engine(f->m, &cfg);
    kvf_engine_request r = base;
    r.prefill_only = true;
    r.sampling.max_tokens = 1;
    add(pre, &r);
    int32_t tok = until_prefilled(pre, 0, NULL);
    assert_int_equal(tok, want->tokens[0][0]);
    kvf_engine_req_info info;
    kvf_err err = {0};
    assert_int_equal(kvf_engine_req_info_get(pre, 0, &info, &err), KVF_OK);
    int32_t ids[64], nb = 0;
    assert_int_equal(kvf_engine_add_remote(dec, &base, ids, 64, &nb, NULL, &err), KVF_OK);
    copy_blocks(pre, info.blocks, dec, ids, nb);
    assert_int_equal(kvf_engine_remote_done(dec, 0, tok, &err), KVF_OK);
    et_run(dec, got, 1);
    et_assert_tokens("prefilled elsewhere", got->tokens[0], got->n[0], want->tokens[0], N);
    kvf_engine_destroy(pre);
    kvf_engine_destroy(dec);

    /* resumed with its output so far */
    int32_t prompt[ET_MAX_TOK];
    memcpy(prompt, k->prompt, (size_t)k->n_prompt * sizeof *prompt);
    for (int32_t j = 1; j < N; j += 8) {
        memcpy(prompt + k->n_prompt, want->tokens[0], (size_t)j * sizeof *prompt);
        kvf_engine_request q = base;
        q.prompt = prompt;
        q.n_prompt = k->n_prompt + j;
        q.n_prior_output = j;
        q.sampling.max_tokens = N - j;
        memset(got, 0, sizeof *got);
        e = et_engine(f->m, &cfg);
        add(e, &q);
        et_run(e, got, 1);
        kvf_engine_destroy(e);
        char what[64];
        snprintf(what, sizeof what, "resumed after %d tokens", j);
        et_assert_tokens(what, got->tokens[0], got->n[0], want->tokens[0] + j, N - j);
    }
    free(want);
    free(got);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_token_and_kept_blocks),
        cmocka_unit_test(test_hand_over_gives_greedy_list),
        cmocka_unit_test(test_seeded_first_token),
        cmocka_unit_test(test_seeded_moves),
        cmocka_unit_test(test_batching_and_prefix_cache),
        cmocka_unit_test(test_waits_for_kept_blocks_and_cancel),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
