/* dtype.h: the element types kvfleet stores (weights and KV) and scalar conversions to and from
 * f32. Conversions round to nearest even; f32 -> fp8-e4m3 saturates to +-448 (no infinities in
 * e4m3), NaN stays NaN. Bulk and vector paths belong to the backends. */
#ifndef KVF_COMMON_DTYPE_H
#define KVF_COMMON_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum kvf_dtype {
    KVF_DTYPE_F32 = 0,
    KVF_DTYPE_F16 = 1,
    KVF_DTYPE_BF16 = 2,
    KVF_DTYPE_FP8_E4M3 = 3,
} kvf_dtype;
#define KVF_DTYPE_COUNT 4

size_t kvf_dtype_size(kvf_dtype t);    /* bytes per element; 0 for an unknown value */
const char *kvf_dtype_name(kvf_dtype t); /* "f32", "f16", "bf16", "fp8-e4m3" */
/* Parses the names above and common aliases (float32, fp16, float16, bfloat16, fp8, e4m3);
 * returns -1 for anything else. */
int kvf_dtype_parse(const char *s);

float kvf_f16_to_f32(uint16_t h);
uint16_t kvf_f32_to_f16(float f);
float kvf_bf16_to_f32(uint16_t h);
uint16_t kvf_f32_to_bf16(float f);
float kvf_fp8e4m3_to_f32(uint8_t b);
uint8_t kvf_f32_to_fp8e4m3(float f);

#endif
