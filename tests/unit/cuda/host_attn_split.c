/* host_attn_split.c: the kernel's split-context algorithm (cuda/attn_ref.c: same partitions,
 * per-partition max and sum, same reduce) against the CPU backend's attention on random
 * paged cases, on the host (no GPU needed); plus the shape and parameter checks. */
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
#include "cuda/attn_ref.h"
#include "test_attn_cases.h"

/* f32 math on both sides from the same decoded KV values: only summation order and exp
 * rounding differ, whatever the KV dtype. */
#define SPLIT_ATOL 2e-5
#define SPLIT_RTOL 1e-4

/* Returns the partitions the call used. Rows no token may read are NaN (a read past the
 * visible range shows). */
static int32_t run_case(const attn_case_spec *s)
{
    attn_case c;
    assert_int_equal(attn_case_build(s, &c), 0);
    attn_case_poison_unseen(&c);
    size_t n = (size_t)c.n_tokens * c.n_heads * s->head_dim;
    float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
    assert_int_equal(attn_case_cpu(&c, s, want), 0);
    size_t ws_bytes = kvf_cuda_attention_workspace_bytes(c.n_tokens, c.n_seqs, c.n_heads,
                                                         s->head_dim, c.max_ctx);
    int32_t parts = kvf_cuda_attention_split(c.n_tokens, c.n_seqs, c.n_heads, c.max_ctx, NULL);
    float *ws = ws_bytes ? malloc(ws_bytes) : NULL;
    for (size_t i = 0; i < n; i++)
        got[i] = NAN;
    kvf_cuda_attn_params p = attn_case_params(&c, s, c.q, got, c.pool, c.tok_seq, c.tok_pos,
                                              c.block_tables, ws, ws_bytes);
    kvf_err err = {0};
    kvf_status st = kvf_cuda_attn_ref(&p, &err);
    if (st != KVF_OK)
        fail_msg("ref: %s", err.msg);
    size_t wi;
    double r = attn_close(got, want, n, SPLIT_ATOL, SPLIT_RTOL, &wi);
    if (!(r <= 1.0))
        fail_msg("%s hd %d bs %d kv %d group %d window %d max_ctx %d (%d parts): element %zu "
                 "is %g, CPU backend %g (%.2fx the tolerance)",
                 kvf_dtype_name(s->dtype), s->head_dim, s->block_size, s->n_kv_heads, s->group,
                 s->window, c.max_ctx, parts, wi, (double)got[wi], (double)want[wi], r);
    free(ws);
    free(want);
    free(got);
    attn_case_free(&c);
    return parts;
}

/* Every dtype x GQA group 1/2/8 x window off/short/long, cycling head_dim (16..256, 48/80/96
 * included) and block size, with contexts up to 700 (three partitions) and max_ctx beyond the
 * longest sequence. */
static void test_split_matches_cpu(void **state)
{
    (void)state;
    attn_case_spec specs[ATTN_SWEEP_N];
    attn_case_sweep(specs);
    int n_split = 0;
    for (int i = 0; i < ATTN_SWEEP_N; i++)
        n_split += run_case(&specs[i]) > 1;
    assert_true(n_split >= 30); /* the reduce was exercised, not just single partitions */
}

/* Short contexts: one partition, no workspace, output written directly. */
static void test_single_partition(void **state)
{
    (void)state;
    for (uint32_t seed = 100; seed < 108; seed++) {
        attn_case_spec s = {.head_dim = 32, .block_size = 16, .n_kv_heads = 2, .group = 4,
                            .window = seed % 2 ? 0 : 20, .dtype = (kvf_dtype)(seed % 4),
                            .k_scale = 1.0f, .v_scale = 1.0f, .scale_mul = 1.0f, .n_seqs = 4,
                            .max_len = 200, .extra_ctx = 56, .seed = seed};
        /* one partition: no partials; with chunks (4 sequences, 10 tokens) only the
         * per-sequence token counts and ids remain (2 x 4 int32) */
        assert_int_equal(kvf_cuda_attention_workspace_bytes(10, 4, 8, 32, 256), 2 * 4 * 4);
        assert_int_equal(kvf_cuda_attention_workspace_bytes(4, 4, 8, 32, 256), 0);
        assert_int_equal(run_case(&s), 1);
    }
}

/* A GQA group larger than one CTA's heads (16 = two chunks of 8) on the reference's side. */
static void test_large_group(void **state)
{
    (void)state;
    attn_case_spec s = {.head_dim = 64, .block_size = 16, .n_kv_heads = 1, .group = 16,
                        .window = 0, .dtype = KVF_DTYPE_BF16, .k_scale = 1.0f, .v_scale = 1.0f,
                        .scale_mul = 1.0f, .n_seqs = 3, .max_len = 600, .extra_ctx = 0,
                        .seed = 77};
    run_case(&s);
}

/* Small batches: 64- and 128-position partitions (many of them), GQA 2 and 4. */
static void test_small_batch(void **state)
{
    (void)state;
    int32_t lens[3] = {0};
    for (uint32_t seed = 500; seed < 506; seed++) {
        attn_case_spec s = {.head_dim = seed % 2 ? 128 : 32, .block_size = 16, .n_kv_heads = 2,
                            .group = seed % 3 ? 4 : 2, .window = seed == 503 ? 150 : 0,
                            .dtype = (kvf_dtype)(seed % 4), .k_scale = 1.0f, .v_scale = 1.0f,
                            .scale_mul = 2.0f, .n_seqs = 1 + (int32_t)(seed % 3),
                            .max_len = seed % 2 ? 1500 : 700, .extra_ctx = 9, .seed = seed,
                            .decode_only = true};
        int32_t len = kvf_cuda_attention_part_len(s.n_seqs, s.n_kv_heads * s.group,
                                                  s.max_len + s.extra_ctx);
        lens[len == 64 ? 0 : len == 128 ? 1 : 2]++;
        assert_true(run_case(&s) > 1);
    }
    assert_true(lens[0] > 0);
    /* 3 tokens x 8 heads at 12k: 128-position partitions */
    attn_case_spec s = {.head_dim = 64, .block_size = 32, .n_kv_heads = 2, .group = 4,
                        .dtype = KVF_DTYPE_BF16, .k_scale = 1.0f, .v_scale = 1.0f,
                        .scale_mul = 1.0f, .n_seqs = 3, .max_len = 12000, .extra_ctx = 0,
                        .seed = 510, .decode_only = true};
    assert_int_equal(kvf_cuda_attention_part_len(3, 8, 12000), 128);
    assert_int_equal(run_case(&s), 94);
}

static void test_workspace_size(void **state)
{
    (void)state;
    assert_int_equal(kvf_cuda_attention_parts(1, 32, 1), 1);
    assert_int_equal(kvf_cuda_attention_parts(1, 32, KVF_CUDA_ATTN_PART_MAX), 1);
    assert_int_equal(kvf_cuda_attention_parts(256, 32, KVF_CUDA_ATTN_PART_MAX + 1), 2);
    /* batch 1, 32 heads: 64-position partitions at 4k, 128 at 8k, 256 from 16k */
    assert_int_equal(kvf_cuda_attention_part_len(1, 32, 4096), 64);
    assert_int_equal(kvf_cuda_attention_part_len(1, 32, 8192), 128);
    assert_int_equal(kvf_cuda_attention_part_len(1, 32, 16384), 256);
    assert_int_equal(kvf_cuda_attention_part_len(64, 32, 4096), 256);
    assert_int_equal(kvf_cuda_attention_parts(64, 32, 32768), 128);
    assert_int_equal(kvf_cuda_attention_workspace_bytes(3, 3, 4, 64, 600),
                     (size_t)3 * 4 * 10 * (64 + 2) * sizeof(float));
    assert_int_equal(kvf_cuda_attention_workspace_bytes(3, 0, 4, 64, 600),
                     (size_t)3 * 4 * 10 * (64 + 2) * sizeof(float));
    assert_int_equal(kvf_cuda_attention_workspace_bytes(0, 0, 4, 64, 600), 0);
    /* prefill chunks (n_seqs < n_tokens) take the tile kernel's split: partitions of 256 or
     * more, about KVF_CUDA_ATTN_TILE_CTA_TARGET CTAs at 64 (token, head) rows each */
    assert_true(kvf_cuda_attention_tiled(2, 1));
    assert_false(kvf_cuda_attention_tiled(2, 2));
    assert_false(kvf_cuda_attention_tiled(2, 0));
    int32_t len = 0;
    /* 2048 tokens x 32 heads = 1024 CTAs at 32k: one partition, no workspace (the partition
     * kernel's split would be 128 partitions: 2048 x 32 x 128 x 130 floats = 4.4 GB) */
    assert_int_equal(kvf_cuda_attention_split(2048, 1, 32, 32768, &len), 1);
    assert_int_equal(len, 32768);
    /* what remains: the lone tokens' partials (none here, but sized for the one sequence: 128
     * partitions of the partition kernel's split) and the counts */
    kvf_cuda_attn_ws w;
    kvf_cuda_attention_ws(2048, 1, 32, 128, 32768, &w);
    assert_int_equal(w.parts, 1);
    assert_int_equal(w.lone_parts, 128);
    assert_int_equal(w.lone_off, 0);
    assert_int_equal(w.count_off, (size_t)1 * 32 * 128 * 130);
    assert_int_equal(kvf_cuda_attention_workspace_bytes(2048, 1, 32, 128, 32768),
                     ((size_t)1 * 32 * 128 * 130 + 2) * sizeof(float));
    /* a mixed step: 64 decode sequences and one 512-token chunk at 4k: the tile partials
     * (576 tokens, 4 partitions of 1024), 64 sequences' partials (16 of 256), the counts */
    kvf_cuda_attention_ws(576, 65, 32, 128, 4096, &w);
    assert_int_equal(w.parts, 4);
    assert_int_equal(w.part_len, 1024);
    assert_int_equal(w.lone_parts, 16);
    assert_int_equal(w.lone_part_len, 256);
    assert_int_equal(w.lone_off, (size_t)576 * 32 * 4 * 130);
    assert_int_equal(w.count_off, w.lone_off + (size_t)65 * 32 * 16 * 130);
    assert_int_equal(w.bytes, (w.count_off + 2 * 65) * sizeof(float));
    /* n_seqs 0 gives the most any n_seqs needs: here a mixed step with 575 sequences */
    kvf_cuda_attn_ws most;
    kvf_cuda_attention_ws(576, 575, 32, 128, 4096, &most);
    assert_int_equal(kvf_cuda_attention_workspace_bytes(576, 0, 32, 128, 4096), most.bytes);
    assert_true(most.bytes > kvf_cuda_attention_workspace_bytes(576, 576, 32, 128, 4096));
    assert_int_equal(kvf_cuda_attention_workspace_bytes(2048, 2048, 32, 128, 32768),
                     (size_t)2048 * 32 * 128 * 130 * sizeof(float));
    /* a 16-token chunk at 32k: 8 CTAs a partition, so 128 partitions of 256 */
    assert_int_equal(kvf_cuda_attention_split(16, 1, 32, 32768, &len), 128);
    assert_int_equal(len, 256);
    /* 64 tokens there: 32 CTAs a partition, 32 partitions of 1024 */
    assert_int_equal(kvf_cuda_attention_split(64, 1, 32, 32768, &len), 32);
    assert_int_equal(len, 1024);
    /* never shorter than 256, whatever the target asks */
    assert_int_equal(kvf_cuda_attention_split(2, 1, 1, 1000, &len), 4);
    assert_int_equal(len, 256);
    assert_int_equal(kvf_cuda_attention_tile_part_len(2, 1, 100), 256);
    /* a partition length that is not a power of two: 1024 rows -> 16 CTAs, 64 partitions
     * wanted, 20 at most at 5000 (ceil(5000 / 256)): 20 of 256 */
    assert_int_equal(kvf_cuda_attention_split(16, 1, 64, 5000, &len), 20);
    assert_int_equal(len, 256);
    /* 8192 rows -> 128 CTAs, 8 wanted at 5000: 625 rounded up to 768, so 7 partitions */
    assert_int_equal(kvf_cuda_attention_split(256, 1, 32, 5000, &len), 7);
    assert_int_equal(len, 768);
}

static void expect_err(kvf_status got, kvf_status want, const kvf_err *err, const char *a,
                       const char *b)
{
    assert_int_equal(got, want);
    if (!strstr(err->msg, a) || (b && !strstr(err->msg, b)))
        fail_msg("message \"%s\" lacks \"%s\"%s%s", err->msg, a, b ? " or " : "", b ? b : "");
}

/* Unsupported shapes name the value and the list; bad parameters name the field. */
static void test_checks(void **state)
{
    (void)state;
    kvf_kv_layout l;
    kvf_err err;
    assert_int_equal(kvf_kv_layout_init(2, 2, 64, 16, KVF_DTYPE_BF16, &l, &err), KVF_OK);
    assert_int_equal(kvf_cuda_attention_supports(&l, 8, &err), KVF_OK);

    kvf_kv_layout bad = l;
    /* 48, 80 and 96 run on padded thread groups; 72 (a multiple of 8 the kernels could take)
     * and 40 are not instantiated, 512 is past the largest group */
    static const int32_t ok_hds[] = {16, 32, 48, 64, 80, 96, 128, 256}, bad_hds[] = {40, 72, 512};
    for (size_t i = 0; i < sizeof ok_hds / sizeof ok_hds[0]; i++) {
        bad = l;
        bad.head_dim = ok_hds[i];
        bad.block_bytes = kvf_kv_bytes_per_token(&bad) * bad.block_size;
        if (kvf_cuda_attention_supports(&bad, 8, &err) != KVF_OK)
            fail_msg("head_dim %d refused: %s", ok_hds[i], err.msg);
    }
    for (size_t i = 0; i < sizeof bad_hds / sizeof bad_hds[0]; i++) {
        bad = l;
        bad.head_dim = bad_hds[i];
        bad.block_bytes = kvf_kv_bytes_per_token(&bad) * bad.block_size;
        char want[32];
        snprintf(want, sizeof want, "head_dim %d ", bad_hds[i]);
        expect_err(kvf_cuda_attention_supports(&bad, 8, &err), KVF_ERR_UNSUPPORTED, &err, want,
                   "16, 32, 48, 64, 80, 96, 128 or 256");
    }
    bad = l;
    bad.block_size = 24;
    expect_err(kvf_cuda_attention_supports(&bad, 8, &err), KVF_ERR_UNSUPPORTED, &err,
               "block_size 24", "power of two");
    bad = l;
    bad.dtype = (kvf_dtype)9;
    expect_err(kvf_cuda_attention_supports(&bad, 8, &err), KVF_ERR_UNSUPPORTED, &err,
               "dtype 9", "fp8-e4m3");
    expect_err(kvf_cuda_attention_supports(&l, 7, &err), KVF_ERR_UNSUPPORTED, &err,
               "7 query heads", "2 KV heads");

    /* a valid call, then one field wrong at a time */
    static float q[8 * 64], out[8 * 64];
    static _Alignas(16) uint8_t pool[4096];
    static int32_t seq[1] = {0}, pos[1] = {0}, bt[1] = {0};
    kvf_cuda_attn_params p = {.q = q, .out = out, .pool = pool, .layout = l, .layer = 1,
                              .n_tokens = 1, .n_heads = 8, .tok_seq = seq, .tok_pos = pos,
                              .block_tables = bt, .max_blocks = 1, .max_ctx = 16, .scale = 0.125f,
                              .k_scale = 1, .v_scale = 1};
    assert_int_equal(kvf_cuda_attn_check(&p, &err), KVF_OK);
    kvf_cuda_attn_params b = p;
    b.layer = 2;
    expect_err(kvf_cuda_attn_check(&b, &err), KVF_ERR_INVALID, &err, "layer 2", "0..1");
    b = p;
    b.max_ctx = 17;
    expect_err(kvf_cuda_attn_check(&b, &err), KVF_ERR_INVALID, &err, "max_ctx 17", "max_blocks 1");
    b = p;
    b.window = -1;
    expect_err(kvf_cuda_attn_check(&b, &err), KVF_ERR_INVALID, &err, "window -1", NULL);
    b = p;
    b.pool = pool + 4;
    expect_err(kvf_cuda_attn_check(&b, &err), KVF_ERR_INVALID, &err, "16-byte", NULL);
    b = p;
    b.q = NULL;
    expect_err(kvf_cuda_attn_check(&b, &err), KVF_ERR_INVALID, &err, "q NULL", NULL);
    b = p;
    b.max_blocks = 64;
    b.max_ctx = 1000; /* 4 partitions: needs a workspace */
    expect_err(kvf_cuda_attn_check(&b, &err), KVF_ERR_INVALID, &err, "workspace", "need");
    b.layout.dtype = KVF_DTYPE_FP8_E4M3;
    b.layout.block_bytes = kvf_kv_bytes_per_token(&b.layout) * b.layout.block_size;
    b.k_scale = 0;
    expect_err(kvf_cuda_attn_check(&b, &err), KVF_ERR_INVALID, &err, "k_scale", NULL);
    b = p;
    b.tok_pos = (int32_t[]){16};
    expect_err(kvf_cuda_attn_ref(&b, &err), KVF_ERR_INVALID, &err, "position 16", NULL);
    b = p;
    b.n_tokens = 0;
    b.q = NULL;
    assert_int_equal(kvf_cuda_attn_check(&b, &err), KVF_OK); /* nothing to do */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_workspace_size),
        cmocka_unit_test(test_checks),
        cmocka_unit_test(test_single_partition),
        cmocka_unit_test(test_large_group),
        cmocka_unit_test(test_small_batch),
        cmocka_unit_test(test_split_matches_cpu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
