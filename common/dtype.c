/* dtype.c: element sizes, names and scalar conversions. */
#include "common/dtype.h"

#include <math.h>
#include <string.h>
#include <strings.h>

static const char *const dtype_names[KVF_DTYPE_COUNT] = {"f32", "f16", "bf16", "fp8-e4m3"};
static const size_t dtype_sizes[KVF_DTYPE_COUNT] = {4, 2, 2, 1};

size_t kvf_dtype_size(kvf_dtype t)
{
    return (unsigned)t < KVF_DTYPE_COUNT ? dtype_sizes[t] : 0;
}

const char *kvf_dtype_name(kvf_dtype t)
{
    return (unsigned)t < KVF_DTYPE_COUNT ? dtype_names[t] : "unknown";
}

int kvf_dtype_parse(const char *s)
{
    static const struct { const char *name; kvf_dtype t; } aliases[] = {
        {"f32", KVF_DTYPE_F32},      {"float32", KVF_DTYPE_F32}, {"fp32", KVF_DTYPE_F32},
        {"f16", KVF_DTYPE_F16},      {"float16", KVF_DTYPE_F16}, {"fp16", KVF_DTYPE_F16},
        {"half", KVF_DTYPE_F16},     {"bf16", KVF_DTYPE_BF16},   {"bfloat16", KVF_DTYPE_BF16},
        {"fp8-e4m3", KVF_DTYPE_FP8_E4M3}, {"fp8", KVF_DTYPE_FP8_E4M3},
        {"e4m3", KVF_DTYPE_FP8_E4M3}, {"fp8_e4m3", KVF_DTYPE_FP8_E4M3},
    };
    for (size_t i = 0; s && i < sizeof aliases / sizeof aliases[0]; i++)
        if (strcasecmp(s, aliases[i].name) == 0)
            return (int)aliases[i].t;
    return -1;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float kvf_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        float v = ldexpf((float)m, -24);
        return sign ? -v : v;
    }
    if (e == 31)
        return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t kvf_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) /* inf or NaN */
        return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
    if (x >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return sign | 0x7c00;
    if (x < 0x38800000u) /* below 2^-14: subnormal, exact scaling then RNE */
        return sign | (uint16_t)nearbyintf(bits_f32(x) * 16777216.0f);
    uint32_t r = x + 0x0fffu + ((x >> 13) & 1u);
    r -= 112u << 23;
    return sign | (uint16_t)(r >> 13);
}

float kvf_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t kvf_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and NaN */
        return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

float kvf_fp8e4m3_to_f32(uint8_t b)
{
    uint32_t e = (b >> 3) & 0xf, m = b & 7;
    float v;
    if (e == 15 && m == 7)
        v = NAN;
    else if (e == 0)
        v = ldexpf((float)m, -9);
    else
        v = ldexpf(1.0f + (float)m / 8.0f, (int)e - 7);
    return (b & 0x80) ? -v : v;
}

uint8_t kvf_f32_to_fp8e4m3(float f)
{
    uint8_t sign = signbit(f) ? 0x80 : 0;
    if (isnan(f))
        return sign | 0x7f;
    float a = fabsf(f);
    if (a >= 448.0f)
        return sign | 0x7e;
    if (a < 0.015625f) /* below 2^-6: subnormal steps of 2^-9 */
        return sign | (uint8_t)nearbyintf(a * 512.0f); /* 8 encodes 2^-6 exactly */
    int k;
    frexpf(a, &k); /* a = f * 2^k, f in [0.5, 1) */
    int e = k - 1;
    int mant = (int)nearbyintf((ldexpf(a, -e) - 1.0f) * 8.0f);
    if (mant == 8) {
        mant = 0;
        e++;
    }
    int biased = e + 7;
    if (biased > 15 || (biased == 15 && mant == 7))
        return sign | 0x7e;
    return sign | (uint8_t)((biased << 3) | mant);
}
