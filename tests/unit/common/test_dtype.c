/* test_dtype.c: scalar conversions round to nearest even, saturate fp8, keep NaN, round-trip. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <cmocka.h>

#include "common/dtype.h"

static void test_sizes_names(void **state)
{
    assert_int_equal(kvf_dtype_size(KVF_DTYPE_F32), 4);
    assert_int_equal(kvf_dtype_size(KVF_DTYPE_BF16), 2);
    assert_int_equal(kvf_dtype_size(KVF_DTYPE_FP8_E4M3), 1);
    assert_int_equal(kvf_dtype_size((kvf_dtype)9), 0);
    assert_int_equal(kvf_dtype_parse("bfloat16"), KVF_DTYPE_BF16);
    assert_int_equal(kvf_dtype_parse("FP8"), KVF_DTYPE_FP8_E4M3);
    assert_int_equal(kvf_dtype_parse("int4"), -1);
    assert_string_equal(kvf_dtype_name(KVF_DTYPE_FP8_E4M3), "fp8-e4m3");
}

static void test_f16(void **state)
{
    /* every finite f16 value round-trips through f32 */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00)
            continue;
        assert_int_equal(kvf_f32_to_f16(kvf_f16_to_f32((uint16_t)h)), h);
    }
    assert_true(kvf_f16_to_f32(0x3c00) == 1.0f);
    assert_true(kvf_f16_to_f32(0x0001) == ldexpf(1, -24));
    assert_int_equal(kvf_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(kvf_f32_to_f16(65520.0f), 0x7c00); /* rounds to infinity */
    assert_int_equal(kvf_f32_to_f16(1.0f + ldexpf(1, -11)), 0x3c00); /* tie to even */
    assert_int_equal(kvf_f32_to_f16(1.0f + 3 * ldexpf(1, -11)), 0x3c02);
    assert_true(isnan(kvf_f16_to_f32(kvf_f32_to_f16(NAN))));
    assert_int_equal(kvf_f32_to_f16(-0.0f), 0x8000);
}

static void test_bf16(void **state)
{
    assert_int_equal(kvf_f32_to_bf16(1.0f), 0x3f80);
    assert_true(kvf_bf16_to_f32(0x3f80) == 1.0f);
    /* 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0) */
    assert_int_equal(kvf_f32_to_bf16(1.0f + ldexpf(1, -8)), 0x3f80);
    assert_int_equal(kvf_f32_to_bf16(1.0f + 3 * ldexpf(1, -8)), 0x3f82);
    assert_true(isnan(kvf_bf16_to_f32(kvf_f32_to_bf16(NAN))));
    for (uint32_t h = 0; h < 0x10000; h += 7)
        if ((h & 0x7f80) != 0x7f80)
            assert_int_equal(kvf_f32_to_bf16(kvf_bf16_to_f32((uint16_t)h)), h);
}

static void test_fp8(void **state)
{
    assert_true(kvf_fp8e4m3_to_f32(0x7e) == 448.0f);
    assert_true(kvf_fp8e4m3_to_f32(0x38) == 1.0f);
    assert_true(kvf_fp8e4m3_to_f32(0x01) == ldexpf(1, -9));
    assert_true(isnan(kvf_fp8e4m3_to_f32(0x7f)));
    assert_int_equal(kvf_f32_to_fp8e4m3(1000.0f), 0x7e);   /* saturates */
    assert_int_equal(kvf_f32_to_fp8e4m3(-1000.0f), 0xfe);
    assert_int_equal(kvf_f32_to_fp8e4m3(NAN) & 0x7f, 0x7f);
    assert_int_equal(kvf_f32_to_fp8e4m3(1.0625f), 0x38); /* halfway 1 and 1.125: even */
    assert_int_equal(kvf_f32_to_fp8e4m3(1.1875f), 0x3a); /* halfway 1.125 and 1.25: even */
    /* every non-NaN code round-trips, and conversion picks the nearest representable value */
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7f) == 0x7f)
            continue;
        float v = kvf_fp8e4m3_to_f32((uint8_t)b);
        uint8_t back = kvf_f32_to_fp8e4m3(v);
        assert_true(back == b || (v == 0 && (back & 0x7f) == 0));
    }
    for (float x = -500; x < 500; x += 0.37f) {
        float got = kvf_fp8e4m3_to_f32(kvf_f32_to_fp8e4m3(x));
        float best = INFINITY;
        for (int b = 0; b < 256; b++)
            if ((b & 0x7f) != 0x7f && fabsf(kvf_fp8e4m3_to_f32((uint8_t)b) - x) < best)
                best = fabsf(kvf_fp8e4m3_to_f32((uint8_t)b) - x);
        assert_true(fabsf(got - x) <= best + 1e-6f);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sizes_names),
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_fp8),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
