/* test_attn.c: the paged-attention kernels (cuda/attn.cu) on a GPU against the CPU backend and
 * against the host reference of the same algorithm (cuda/attn_ref.c), on random paged cases
 * (test_attn_cases.h); plus the launcher's refusals. Skips (77) without a usable GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/attn.h"
#include "cuda/attn_bench.h"
#include "cuda/attn_ref.h"
#include "cuda/cuda.h"
#include "test_attn_cases.h"
#include "gpu_skip.h"

/* GPU vs CPU backend. Both decode the stored KV exactly to f32 and compute in f32; what
 * differs is summation order (warp trees vs sequential), fused multiply-adds and exp2f vs
 * expf. fp8 has one more rounding: the CPU side gets q * k_scale, the GPU side scales q by
 * scale * k_scale * log2(e) in one product. */
static const double attn_atol[KVF_DTYPE_COUNT] = {5e-5, 5e-5, 5e-5, 1e-4}; /* f32 f16 bf16 fp8 */
static const double attn_rtol[KVF_DTYPE_COUNT] = {2e-4, 2e-4, 2e-4, 5e-4};
/* GPU vs host reference (same partitions and reduce formula; only summation orders differ). */
#define REF_ATOL 2e-5
#define REF_RTOL 1e-4

static void *dev_copy(const void *host, size_t bytes)
{
    void *d = NULL;
    kvf_err err;
    if (kvf_cuda_bench_alloc(bytes, &d, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    if (host && kvf_cuda_bench_upload(d, host, bytes, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    return d;
}

/* Runs one case on the GPU twice (prefill chunks on the tile kernel, then every token on the
 * partition kernel: n_seqs 0); compares each with the CPU backend and the host reference. Rows
 * no token may read are NaN (attn_case_poison_unseen): a read past a row or a sequence shows. */
static void run_case(const attn_case_spec *s)
{
    attn_case c;
    assert_int_equal(attn_case_build(s, &c), 0);
    attn_case_poison_unseen(&c);
    size_t n = (size_t)c.n_tokens * c.n_heads * s->head_dim;
    float *cpu = malloc(n * sizeof(float)), *ref = malloc(n * sizeof(float));
    float *gpu = malloc(n * sizeof(float));
    assert_int_equal(attn_case_cpu(&c, s, cpu), 0);
    /* n_seqs 0: the most any n_seqs needs (both ways below) */
    size_t ws_bytes = kvf_cuda_attention_workspace_bytes(c.n_tokens, 0, c.n_heads, s->head_dim,
                                                         c.max_ctx);
    float *ws = ws_bytes ? malloc(ws_bytes) : NULL;
    kvf_err err = {0};
    kvf_cuda_attn_params hp = attn_case_params(&c, s, c.q, ref, c.pool, c.tok_seq, c.tok_pos,
                                               c.block_tables, ws, ws_bytes);
    if (kvf_cuda_attn_ref(&hp, &err) != KVF_OK)
        fail_msg("ref: %s", err.msg);

    size_t nt = (size_t)c.n_tokens * sizeof(int32_t);
    void *d_pool = dev_copy(c.pool, c.pool_bytes), *d_q = dev_copy(c.q, n * sizeof(float));
    void *d_out = dev_copy(NULL, n * sizeof(float));
    void *d_seq = dev_copy(c.tok_seq, nt), *d_pos = dev_copy(c.tok_pos, nt);
    void *d_bt = dev_copy(c.block_tables, (size_t)c.n_seqs * c.max_blocks * sizeof(int32_t));
    void *d_ws = ws_bytes ? dev_copy(NULL, ws_bytes) : NULL;
    for (int way = 0; way < 4; way++) {
        /* prefill chunks on a tile kernel or every token on the partition kernel; decode
         * tokens on the SIMT kernel, then on the tensor cores where that kernel serves */
        const int tiles = way % 2 == 0;
        const int32_t dec = way < 2 ? KVF_BACKEND_ATTN_DECODE_SIMT : KVF_BACKEND_ATTN_DECODE_MMA;
        if (dec == KVF_BACKEND_ATTN_DECODE_MMA && !kvf_cuda_attn_decode_mma_serves(&c.layout))
            continue;
        /* poison the output: every element must be written */
        for (size_t i = 0; i < n; i++)
            gpu[i] = NAN;
        if (kvf_cuda_bench_upload(d_out, gpu, n * sizeof(float), &err) != KVF_OK)
            fail_msg("%s", err.msg);
        kvf_cuda_attn_params dp = attn_case_params(&c, s, d_q, d_out, d_pool, d_seq, d_pos, d_bt,
                                                   d_ws, ws_bytes);
        if (!tiles)
            dp.n_seqs = 0;
        dp.decode_kernel = dec;
        if (kvf_cuda_attention(&dp, NULL, &err) != KVF_OK)
            fail_msg("launch: %s", err.msg);
        if (kvf_cuda_bench_sync(&err) != KVF_OK)
            fail_msg("kernel: %s", err.msg);
        if (kvf_cuda_bench_download(gpu, d_out, n * sizeof(float), &err) != KVF_OK)
            fail_msg("%s", err.msg);

        size_t wi;
        double r = attn_close(gpu, cpu, n, attn_atol[s->dtype], attn_rtol[s->dtype], &wi);
        if (!(r <= 1.0))
            fail_msg("GPU vs CPU (%s, %s decode): %s hd %d bs %d kv %d group %d window %d "
                     "max_ctx %d (%d parts): element %zu (token %zu) is %g, CPU backend %g (%.2fx "
                     "the tolerance)",
                     tiles ? "tiles" : "no tiles", kvf_backend_attn_decode_name(dec),
                     kvf_dtype_name(s->dtype), s->head_dim,
                     s->block_size, s->n_kv_heads, s->group, s->window, c.max_ctx,
                     kvf_cuda_attention_split(c.n_tokens, dp.n_seqs, c.n_heads, c.max_ctx,
                                              NULL),
                     wi,
                     wi / ((size_t)c.n_heads * s->head_dim), (double)gpu[wi], (double)cpu[wi], r);
        r = attn_close(gpu, ref, n, REF_ATOL, REF_RTOL, &wi);
        if (!(r <= 1.0))
            fail_msg("GPU vs reference (%s, %s decode): %s hd %d group %d: element %zu is %g, "
                     "reference %g (%.2fx)",
                     tiles ? "tiles" : "no tiles", kvf_backend_attn_decode_name(dec),
                     kvf_dtype_name(s->dtype), s->head_dim, s->group,
                     wi, (double)gpu[wi], (double)ref[wi], r);
    }

    kvf_cuda_bench_free(d_pool);
    kvf_cuda_bench_free(d_q);
    kvf_cuda_bench_free(d_out);
    kvf_cuda_bench_free(d_seq);
    kvf_cuda_bench_free(d_pos);
    kvf_cuda_bench_free(d_bt);
    kvf_cuda_bench_free(d_ws);
    free(ws);
    free(cpu);
    free(ref);
    free(gpu);
    attn_case_free(&c);
}

/* Every dtype x GQA 1/2/8 x window off/short/long, every head_dim and block size in turn,
 * contexts up to 700 (three partitions) with max_ctx beyond the longest sequence. */
static void test_matches_cpu(void **state)
{
    (void)state;
    attn_case_spec specs[ATTN_SWEEP_N];
    attn_case_sweep(specs);
    for (int i = 0; i < ATTN_SWEEP_N; i++)
        run_case(&specs[i]);
}

/* Every head_dim (48, 80 and 96 on padded thread groups) x dtype with the fixture models'
 * block size and GQA 2 and 4 (the kernels with 2 and 4 heads per CTA), one partition and
 * several; rows no token may read are NaN, so a padded lane reading past its row shows. */
static void test_every_kernel_shape(void **state)
{
    (void)state;
    static const int32_t hds[] = {16, 32, 48, 64, 80, 96, 128, 256};
    uint32_t seed = 200;
    for (size_t h = 0; h < sizeof hds / sizeof hds[0]; h++)
        for (int dt = 0; dt < KVF_DTYPE_COUNT; dt++, seed++) {
            attn_case_spec s = {.head_dim = hds[h], .block_size = 16, .n_kv_heads = 2,
                                .group = seed % 2 ? 2 : 4, .window = 0, .dtype = (kvf_dtype)dt,
                                .k_scale = 1.0f, .v_scale = 1.0f, .scale_mul = 1.0f,
                                .n_seqs = 3, .max_len = seed % 3 ? 200 : 600, .extra_ctx = 3,
                                .seed = seed};
            run_case(&s);
        }
}

/* Group 16 (two chunks of 8 heads; at head_dim 64 and 80) and 6 (8-head kernel with 6 real heads); small decode
 * batches (short partitions); a long context in the benchmark's shape (bf16, head_dim 128,
 * GQA 4, about 20 partitions). */
static void test_groups_and_long_context(void **state)
{
    (void)state;
    attn_case_spec s = {.head_dim = 64, .block_size = 16, .n_kv_heads = 1, .group = 16,
                        .dtype = KVF_DTYPE_BF16, .k_scale = 1.0f, .v_scale = 1.0f,
                        .scale_mul = 1.0f, .n_seqs = 3, .max_len = 600, .seed = 300};
    run_case(&s);
    s.group = 6, s.n_kv_heads = 2, s.seed = 301, s.window = 100;
    run_case(&s);
    s.head_dim = 80, s.group = 16, s.n_kv_heads = 1, s.seed = 303, s.dtype = KVF_DTYPE_F16;
    run_case(&s); /* padded thread groups, two chunks of 8 heads */
    /* small batches: 64- and 128-position partitions */
    for (uint32_t seed = 500; seed < 506; seed++) {
        attn_case_spec b = {.head_dim = seed % 2 ? 128 : 32, .block_size = 16, .n_kv_heads = 2,
                            .group = seed % 3 ? 4 : 2, .window = seed == 503 ? 150 : 0,
                            .dtype = (kvf_dtype)(seed % 4), .k_scale = 1.0f, .v_scale = 1.0f,
                            .scale_mul = 2.0f, .n_seqs = 1 + (int32_t)(seed % 3),
                            .max_len = seed % 2 ? 1500 : 700, .extra_ctx = 9, .seed = seed,
                            .decode_only = true};
        run_case(&b);
    }
    attn_case_spec m = {.head_dim = 64, .block_size = 32, .n_kv_heads = 2, .group = 4,
                        .dtype = KVF_DTYPE_BF16, .k_scale = 1.0f, .v_scale = 1.0f,
                        .scale_mul = 1.0f, .n_seqs = 3, .max_len = 12000, .extra_ctx = 0,
                        .seed = 510, .decode_only = true}; /* 128-position partitions */
    run_case(&m);
    attn_case_spec l = {.head_dim = 128, .block_size = 16, .n_kv_heads = 2, .group = 4,
                        .dtype = KVF_DTYPE_BF16, .k_scale = 1.0f, .v_scale = 1.0f,
                        .scale_mul = 1.0f, .n_seqs = 3, .max_len = 5000, .extra_ctx = 100,
                        .seed = 302};
    run_case(&l);
}

/* The launcher refuses before launching: unsupported shapes name the value and the list. */
static void test_refusals(void **state)
{
    (void)state;
    kvf_kv_layout l;
    kvf_err err;
    assert_int_equal(kvf_kv_layout_init(1, 2, 64, 16, KVF_DTYPE_BF16, &l, &err), KVF_OK);
    void *pool = dev_copy(NULL, (size_t)l.block_bytes);
    void *q = dev_copy(NULL, 8 * 64 * sizeof(float)), *out = dev_copy(NULL, 8 * 64 * sizeof(float));
    void *i32 = dev_copy(NULL, 16);
    kvf_cuda_attn_params p = {.q = q, .out = out, .pool = pool, .layout = l, .layer = 0,
                              .n_tokens = 1, .n_heads = 8, .tok_seq = i32, .tok_pos = i32,
                              .block_tables = i32, .max_blocks = 1, .max_ctx = 16,
                              .scale = 0.125f, .k_scale = 1, .v_scale = 1};
    assert_int_equal(kvf_cuda_attention(&p, NULL, &err), KVF_OK);
    assert_int_equal(kvf_cuda_bench_sync(&err), KVF_OK);

    kvf_cuda_attn_params b = p;
    b.layout.head_dim = 72;
    b.layout.block_bytes = kvf_kv_bytes_per_token(&b.layout) * b.layout.block_size;
    assert_int_equal(kvf_cuda_attention(&b, NULL, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "head_dim 72"));
    assert_non_null(strstr(err.msg, "16, 32, 48, 64, 80, 96, 128 or 256"));
    b = p;
    b.layout.block_size = 24;
    b.layout.block_bytes = kvf_kv_bytes_per_token(&b.layout) * b.layout.block_size;
    assert_int_equal(kvf_cuda_attention(&b, NULL, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "block_size 24"));
    b = p;
    b.n_heads = 7;
    assert_int_equal(kvf_cuda_attention(&b, NULL, &err), KVF_ERR_UNSUPPORTED);
    b = p;
    b.max_ctx = 300; /* two partitions: needs a workspace */
    b.max_blocks = 19;
    assert_int_equal(kvf_cuda_attention(&b, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "workspace"));
    b = p;
    b.layout.dtype = KVF_DTYPE_FP8_E4M3;
    b.layout.block_bytes = kvf_kv_bytes_per_token(&b.layout) * b.layout.block_size;
    b.v_scale = NAN;
    assert_int_equal(kvf_cuda_attention(&b, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "v_scale"));
    kvf_cuda_bench_free(pool);
    kvf_cuda_bench_free(q);
    kvf_cuda_bench_free(out);
    kvf_cuda_bench_free(i32);
}

/* A token whose position breaks the contract (>= max_ctx) gets zeros, not a wild read; the
 * other tokens of the call are unaffected. */
static void test_bad_position_zeros(void **state)
{
    (void)state;
    attn_case_spec s = {.head_dim = 32, .block_size = 16, .n_kv_heads = 2, .group = 2,
                        .dtype = KVF_DTYPE_F32, .k_scale = 1.0f, .v_scale = 1.0f,
                        .scale_mul = 1.0f, .n_seqs = 2, .max_len = 400, .seed = 400};
    attn_case c;
    assert_int_equal(attn_case_build(&s, &c), 0);
    size_t n = (size_t)c.n_tokens * c.n_heads * s.head_dim, row = (size_t)c.n_heads * s.head_dim;
    float *cpu = malloc(n * sizeof(float)), *gpu = malloc(n * sizeof(float));
    assert_int_equal(attn_case_cpu(&c, &s, cpu), 0);
    int32_t *pos = malloc((size_t)c.n_tokens * sizeof(int32_t));
    memcpy(pos, c.tok_pos, (size_t)c.n_tokens * sizeof(int32_t));
    pos[0] = c.max_ctx + 1000;
    size_t ws_bytes = kvf_cuda_attention_workspace_bytes(c.n_tokens, 0, c.n_heads, s.head_dim,
                                                         c.max_ctx);
    size_t nt = (size_t)c.n_tokens * sizeof(int32_t);
    void *d_pool = dev_copy(c.pool, c.pool_bytes), *d_q = dev_copy(c.q, n * sizeof(float));
    void *d_out = dev_copy(NULL, n * sizeof(float)), *d_seq = dev_copy(c.tok_seq, nt);
    void *d_pos = dev_copy(pos, nt);
    void *d_bt = dev_copy(c.block_tables, (size_t)c.n_seqs * c.max_blocks * sizeof(int32_t));
    void *d_ws = ws_bytes ? dev_copy(NULL, ws_bytes) : NULL;
    kvf_err err;
    kvf_cuda_attn_params dp = attn_case_params(&c, &s, d_q, d_out, d_pool, d_seq, d_pos, d_bt,
                                               d_ws, ws_bytes);
    assert_int_equal(kvf_cuda_attention(&dp, NULL, &err), KVF_OK);
    assert_int_equal(kvf_cuda_bench_sync(&err), KVF_OK);
    assert_int_equal(kvf_cuda_bench_download(gpu, d_out, n * sizeof(float), &err), KVF_OK);
    for (size_t i = 0; i < row; i++)
        assert_true(gpu[i] == 0.0f);
    assert_true(attn_close(gpu + row, cpu + row, n - row, attn_atol[0], attn_rtol[0], NULL) <= 1.0);
    kvf_cuda_bench_free(d_pool);
    kvf_cuda_bench_free(d_q);
    kvf_cuda_bench_free(d_out);
    kvf_cuda_bench_free(d_seq);
    kvf_cuda_bench_free(d_pos);
    kvf_cuda_bench_free(d_bt);
    kvf_cuda_bench_free(d_ws);
    free(pos);
    free(cpu);
    free(gpu);
    attn_case_free(&c);
}

int main(void)
{
    if (kvf_test_gpu_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_every_kernel_shape),
        cmocka_unit_test(test_matches_cpu),
        cmocka_unit_test(test_groups_and_long_context),
        cmocka_unit_test(test_bad_position_zeros),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
