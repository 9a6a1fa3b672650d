/* test_backend_mem.c: the engine's backend wiring: the backend is created before the KV pool,
 * the pool's one allocation (and swap, copy-on-write) goes through the backend's kv_mem ops
 * with the backend's ctx, the backend opts carry the fp8 scales, and a generation through such
 * a backend gives the fixture's tokens. A CPU backend with counting host mem ops stands in for
 * a GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "testutil.h"
#include "enginetest.h"
#include "model/backend_impl.h" /* the double replaces create and kv_mem */

static struct {
    void *created_ctx; /* what create handed out */
    kvf_backend_opts opts;
    int allocs, frees, to_host, from_host, copies;
    int64_t alloc_bytes;
    bool ctx_ok;
} M;

static kvf_backend wrapped;

static kvf_status w_create(const kvf_backend_opts *o, void **ctx, kvf_err *err)
{
    M.opts = *o;
    kvf_status st = kvf_backend_create(kvf_model_backend_cpu(), o, ctx, err);
    if (st == KVF_OK)
        M.created_ctx = *ctx;
    return st;
}

static kvf_status m_alloc(void *ctx, int64_t bytes, void **base, kvf_err *err)
{
    M.allocs++;
    M.alloc_bytes = bytes;
    M.ctx_ok = M.ctx_ok && ctx == M.created_ctx && M.created_ctx;
    return kvf_kv_mem_host.alloc(ctx, bytes, base, err);
}

static void m_free(void *ctx, void *base, int64_t bytes)
{
    M.frees++;
    M.ctx_ok = M.ctx_ok && ctx == M.created_ctx;
    kvf_kv_mem_host.free(ctx, base, bytes);
}

static kvf_status m_copy(void *ctx, void *base, int64_t bb, int32_t dst, int32_t src, kvf_err *err)
{
    M.copies++;
    return kvf_kv_mem_host.copy_block(ctx, base, bb, dst, src, err);
}

static kvf_status m_to_host(void *ctx, void *h, const void *base, int64_t bb, int32_t b, kvf_err *err)
{
    M.to_host++;
    return kvf_kv_mem_host.to_host(ctx, h, base, bb, b, err);
}

static kvf_status m_from_host(void *ctx, void *base, int64_t bb, int32_t b, const void *h, kvf_err *err)
{
    M.from_host++;
    return kvf_kv_mem_host.from_host(ctx, base, bb, b, h, err);
}

static const kvf_kv_mem_ops counting_mem = {
    .name = "counting",
    .alloc = m_alloc,
    .free = m_free,
    .copy_block = m_copy,
    .to_host = m_to_host,
    .from_host = m_from_host,
};

static const kvf_kv_mem_ops *w_kv_mem(void *ctx)
{
    return &counting_mem;
}

static const kvf_backend *wrapped_backend(void)
{
    wrapped = *kvf_model_backend_cpu();
    wrapped.name = "cpu-counting-mem";
    wrapped.create = w_create;
    wrapped.kv_mem = w_kv_mem;
    memset(&M, 0, sizeof M);
    M.ctx_ok = true;
    return &wrapped;
}

static void test_pool_through_backend_mem(void **state)
{
    et_fixture *f = et_open("tiny-gqa-f32");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    cfg.n_blocks = 64;
    cfg.kv_dtype = KVF_DTYPE_FP8_E4M3; /* accepted now, scales reach the backend */
    cfg.kv_k_scale = 0.5f;
    cfg.kv_v_scale = 0.25f;
    cfg.no_graphs = true;
    kvf_engine *e = NULL;
    kvf_err err = {0};
    if (kvf_engine_create(f->m, wrapped_backend(), &cfg, &e, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    assert_int_equal(M.allocs, 1);
    assert_true(M.ctx_ok);
    assert_ptr_equal(kvf_engine_backend_ctx(e), M.created_ctx);
    assert_int_equal(M.alloc_bytes, 64 * kvf_kv_pool_layout(kvf_engine_pool(e))->block_bytes);
    assert_int_equal(kvf_kv_pool_bytes(kvf_engine_pool(e)), M.alloc_bytes);
    assert_true(M.opts.kv_k_scale == 0.5f && M.opts.kv_v_scale == 0.25f && M.opts.no_graphs);

    const et_case *k = et_find(f, "forty");
    int32_t out[64], n = 0;
    kvf_engine_finish fin;
    kvf_engine_request q = {.id = 1, .prompt = k->prompt, .n_prompt = k->n_prompt};
    kvf_engine_sampling_default(&q.sampling);
    q.sampling.max_tokens = 8;
    assert_int_equal(kvf_engine_generate(e, &q, out, 64, &n, &fin, &err), KVF_OK);
    assert_int_equal(n, 8);
    kvf_engine_destroy(e);
    assert_int_equal(M.frees, 1);
    assert_true(M.ctx_ok);
    et_close(f);
}

/* the same generation with f32 KV through the wrapped backend equals the fixture */
static void test_tokens_unchanged(void **state)
{
    et_fixture *f = et_open("tiny-mqa-bf16");
    kvf_engine_cfg cfg;
    et_cfg(&cfg);
    kvf_engine *e = NULL;
    kvf_err err = {0};
    if (kvf_engine_create(f->m, wrapped_backend(), &cfg, &e, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    for (int32_t i = 0; i < f->n_cases; i++) {
        const et_case *k = &f->cases[i];
        int32_t out[ET_MAX_TOK], n = 0;
        kvf_engine_finish fin;
        kvf_engine_request q = {.id = (uint64_t)i, .prompt = k->prompt, .n_prompt = k->n_prompt};
        kvf_engine_sampling_default(&q.sampling);
        q.sampling.max_tokens = k->n_greedy;
        assert_int_equal(kvf_engine_generate(e, &q, out, ET_MAX_TOK, &n, &fin, &err), KVF_OK);
        assert_int_equal(n, k->n_greedy);
        assert_memory_equal(out, k->greedy, (size_t)n * sizeof(int32_t));
    }
    kvf_engine_destroy(e);
    assert_int_equal(M.allocs, 1);
    assert_int_equal(M.frees, 1);
    et_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_through_backend_mem),
        cmocka_unit_test(test_tokens_unchanged),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
