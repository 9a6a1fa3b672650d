/* test_noalloc.c: a forward step allocates nothing: malloc & co. are interposed here and counted
 * over steps mixing prefill and decode, after one warm-up step (OpenBLAS sets up its buffers on
 * first use). Skipped under AddressSanitizer, which owns malloc itself. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>

#include "model/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "testutil.h"

#if defined(__SANITIZE_ADDRESS__)
#define KVF_TEST_NOALLOC 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVF_TEST_NOALLOC 0
#endif
#endif
#ifndef KVF_TEST_NOALLOC
#define KVF_TEST_NOALLOC 1
#endif

static volatile int counting;
static volatile long n_allocs;

#if KVF_TEST_NOALLOC
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

void *malloc(size_t n)
{
    if (counting)
        __atomic_add_fetch(&n_allocs, 1, __ATOMIC_RELAXED);
    return __libc_malloc(n);
}

void *calloc(size_t a, size_t b)
{
    if (counting)
        __atomic_add_fetch(&n_allocs, 1, __ATOMIC_RELAXED);
    return __libc_calloc(a, b);
}

void *realloc(void *p, size_t n)
{
    if (counting)
        __atomic_add_fetch(&n_allocs, 1, __ATOMIC_RELAXED);
    return __libc_realloc(p, n);
}

void *aligned_alloc(size_t al, size_t n)
{
    if (counting)
        __atomic_add_fetch(&n_allocs, 1, __ATOMIC_RELAXED);
    return __libc_memalign(al, n);
}

int posix_memalign(void **out, size_t al, size_t n)
{
    if (counting)
        __atomic_add_fetch(&n_allocs, 1, __ATOMIC_RELAXED);
    void *p = __libc_memalign(al, n);
    if (!p)
        return 12; /* ENOMEM */
    *out = p;
    return 0;
}
#endif

static void test_step_allocates_nothing(void **state)
{
    if (!KVF_TEST_NOALLOC)
        skip();
    kvf_model *m;
    kvf_err err = {0};
    assert_int_equal(kvf_model_load(kvf_test_shared_path("fixtures/models/small-gqa-bf16-theta5e5"), &m, &err), KVF_OK);
    const kvf_backend *be = kvf_model_backend_cpu();
    /* mode 0: f32 weights, 1: kept bf16, 2: q8 (steps of 5 and 11 tokens: both q8 matmul paths) */
    for (int mode = 0; mode < 3; mode++) {
        bool half = mode == 1;
        n_allocs = 0;
        void *ctx;
        kvf_backend_opts bo = {.n_threads = 2, .half_weights = half,
                               .weight_dtype = mode == 2 ? KVF_BACKEND_WEIGHT_Q8 : KVF_BACKEND_WEIGHT_F32};
        assert_int_equal(kvf_backend_create(be, &bo, &ctx, &err), KVF_OK);
        kvf_kv_layout lay;
        assert_int_equal(kvf_model_kv_layout(m, 16, KVF_DTYPE_BF16, &lay, &err), KVF_OK);
        kvf_model_fwd *f;
        kvf_model_fwd_opts o = {.max_tokens = 64, .max_seqs = 4, .max_ctx = 128};
        assert_int_equal(kvf_model_fwd_create(m, be, ctx, &lay, &o, &f, &err), KVF_OK);
        void *pool;
        assert_int_equal(kvf_backend_alloc(be, ctx, (size_t)(32 * lay.block_bytes), &pool, &err), KVF_OK);
        int32_t t0[8] = {0, 1, 2, 3, 4, 5, 6, 7}, t1[8] = {8, 9, 10, 11, 12, 13, 14, 15};
        int32_t prompt[64];
        for (int i = 0; i < 64; i++)
            prompt[i] = (i * 31 + 7) % 1024;
        int32_t next[2], tok = 5;
        float *logits = malloc(2 * 1024 * sizeof *logits);
        kvf_model_seq warm = {.tokens = prompt, .n_tokens = 8, .start_pos = 0, .block_table = t0, .n_blocks = 8};
        assert_int_equal(kvf_model_forward(f, &warm, 1, pool, 32, logits, next, &err), KVF_OK);

        counting = 1;
        for (int step = 0, p1 = 0; step < 6; step++) {
            int32_t take = mode == 2 && step % 2 ? 10 : 6;
            kvf_model_seq s[2] = {
                {.tokens = &tok, .n_tokens = 1, .start_pos = 8 + step, .block_table = t0, .n_blocks = 8},
                {.tokens = prompt + p1, .n_tokens = take, .start_pos = p1, .block_table = t1, .n_blocks = 8},
            };
            assert_int_equal(kvf_model_forward(f, s, 2, pool, 32, logits, next, &err), KVF_OK);
            tok = next[0];
            p1 += take;
        }
        counting = 0;
        print_message("6 mixed steps (%s weights): %ld allocations\n", mode == 2 ? "q8" : half ? "bf16" : "f32",
                      (long)n_allocs);
        assert_int_equal(n_allocs, 0);
        free(logits);
        kvf_backend_free(be, ctx, pool);
        kvf_model_fwd_destroy(f);
        kvf_backend_destroy(be, ctx);
    }
    kvf_model_destroy(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_step_allocates_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
