/* test_layout.c: kv/layout.h: every (block, layer, K|V, head, token) offset distinct, inside its
 * block and contiguous in the documented order; blocks_for at the exact-fit boundary; layout
 * validation and the check_same messages. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kv/layout.h"

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Walks [block][layer][K|V][head][token] in nesting order: each element row starts exactly
 * where the previous ended, so the offsets are distinct, tile each block and stay inside it. */
static void check_offsets(int32_t L, int32_t H, int32_t D, int32_t bs, kvf_dtype dt)
{
    kvf_kv_layout l;
    assert_int_equal(kvf_kv_layout_init(L, H, D, bs, dt, &l, NULL), KVF_OK);
    int64_t es = (int64_t)kvf_dtype_size(dt), row = D * es;
    assert_int_equal(l.block_bytes, 2 * (int64_t)L * H * bs * D * es);
    assert_int_equal(kvf_kv_bytes_per_token(&l) * bs, l.block_bytes);
    assert_int_equal(kvf_kv_slab_bytes(&l) * 2 * L, l.block_bytes);
    const int64_t n_blocks = 3;
    int64_t n = n_blocks * 2 * L * H * bs, k = 0, expect = 0;
    int64_t *offs = malloc((size_t)n * sizeof *offs);
    assert_non_null(offs);
    for (int64_t b = 0; b < n_blocks; b++)
        for (int32_t layer = 0; layer < L; layer++)
            for (int part = 0; part < 2; part++)
                for (int32_t h = 0; h < H; h++)
                    for (int32_t t = 0; t < bs; t++) {
                        int64_t o = kvf_kv_offset(&l, b, layer, (kvf_kv_part)part, h, t);
                        assert_int_equal(o, expect); /* contiguous, in layout order */
                        assert_true(o >= b * l.block_bytes);
                        assert_true(o + row <= (b + 1) * l.block_bytes); /* inside the block */
                        offs[k++] = o;
                        expect += row;
                    }
    assert_int_equal(expect, n_blocks * l.block_bytes);
    qsort(offs, (size_t)n, sizeof *offs, cmp_i64);
    for (int64_t i = 1; i < n; i++)
        assert_true(offs[i] - offs[i - 1] >= row); /* distinct, rows do not overlap */
    free(offs);
}

static void test_offsets(void **state)
{
    check_offsets(2, 3, 4, 4, KVF_DTYPE_F16);
    check_offsets(1, 1, 8, 16, KVF_DTYPE_F32);
    check_offsets(3, 2, 5, 8, KVF_DTYPE_FP8_E4M3);
    check_offsets(2, 1, 2, 1, KVF_DTYPE_BF16);
    /* A named element: block 1, layer 1, V, head 2, token 3 of a (2, 3, 4, 4, f16) layout. */
    kvf_kv_layout l;
    assert_int_equal(kvf_kv_layout_init(2, 3, 4, 4, KVF_DTYPE_F16, &l, NULL), KVF_OK);
    assert_int_equal(kvf_kv_offset(&l, 1, 1, KVF_KV_V, 2, 3),
                     l.block_bytes + 3 * kvf_kv_slab_bytes(&l) + (2 * 4 + 3) * 4 * 2);
}

static void test_blocks_for(void **state)
{
    assert_int_equal(kvf_kv_blocks_for(16, 16), 1);
    assert_int_equal(kvf_kv_blocks_for(17, 16), 2);
    assert_int_equal(kvf_kv_blocks_for(0, 16), 0);
    assert_int_equal(kvf_kv_blocks_for(1, 16), 1);
    assert_int_equal(kvf_kv_blocks_for(32, 16), 2);
    assert_int_equal(kvf_kv_blocks_for(-5, 16), 0);
    assert_int_equal(kvf_kv_blocks_for(1, 1), 1);
}

static void test_init_rejects(void **state)
{
    kvf_kv_layout l;
    memset(&l, 0x5a, sizeof l);
    kvf_kv_layout before = l;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_layout_init(2, 2, 4, 24, KVF_DTYPE_F16, &l, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "24"));
    assert_memory_equal(&l, &before, sizeof l); /* out untouched on failure */
    assert_int_equal(kvf_kv_layout_init(2, 2, 4, 2048, KVF_DTYPE_F16, &l, &err), KVF_ERR_INVALID);
    assert_int_equal(kvf_kv_layout_init(0, 2, 4, 16, KVF_DTYPE_F16, &l, &err), KVF_ERR_INVALID);
    assert_int_equal(kvf_kv_layout_init(2, -1, 4, 16, KVF_DTYPE_F16, &l, &err), KVF_ERR_INVALID);
    assert_int_equal(kvf_kv_layout_init(2, 2, 4, 16, (kvf_dtype)9, &l, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "9"));
}

static void test_check_same(void **state)
{
    kvf_kv_layout a, b;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_layout_init(4, 2, 8, 16, KVF_DTYPE_F16, &a, NULL), KVF_OK);
    b = a;
    assert_int_equal(kvf_kv_layout_check_same(&a, "here", &b, "peer", &err), KVF_OK);
    assert_int_equal(kvf_kv_layout_init(4, 2, 8, 32, KVF_DTYPE_F16, &b, NULL), KVF_OK);
    assert_int_equal(kvf_kv_layout_check_same(&a, "here", &b, "peer", &err), KVF_ERR_INVALID);
    assert_string_equal(err.msg, "kv: layout block_size differs: 16 at here, 32 at peer");
    assert_int_equal(kvf_kv_layout_init(4, 4, 8, 16, KVF_DTYPE_F16, &b, NULL), KVF_OK);
    assert_int_equal(kvf_kv_layout_check_same(&a, "decode", &b, "prefill", &err), KVF_ERR_INVALID);
    assert_string_equal(err.msg, "kv: layout n_kv_heads differs: 2 at decode, 4 at prefill");
    assert_int_equal(kvf_kv_layout_init(3, 2, 8, 16, KVF_DTYPE_F16, &b, NULL), KVF_OK);
    assert_int_equal(kvf_kv_layout_check_same(&a, "a", &b, "b", &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "n_layers differs: 4 at a, 3 at b"));
    assert_int_equal(kvf_kv_layout_init(4, 2, 16, 16, KVF_DTYPE_F16, &b, NULL), KVF_OK);
    assert_int_equal(kvf_kv_layout_check_same(&a, "a", &b, "b", &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "head_dim differs: 8 at a, 16 at b"));
    assert_int_equal(kvf_kv_layout_init(4, 2, 8, 16, KVF_DTYPE_BF16, &b, NULL), KVF_OK);
    assert_int_equal(kvf_kv_layout_check_same(&a, "here", &b, "peer", &err), KVF_ERR_INVALID);
    assert_string_equal(err.msg, "kv: layout dtype differs: f16 at here, bf16 at peer");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_offsets),
        cmocka_unit_test(test_blocks_for),
        cmocka_unit_test(test_init_rejects),
        cmocka_unit_test(test_check_same),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
