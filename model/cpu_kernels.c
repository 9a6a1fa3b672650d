/* cpu_kernels.c: the CPU backend's inner loops in four forms (plain C, AVX2+FMA, AVX-512, and
 * AVX-512 with VNNI, which differs in its q8 dot products only), compiled for any x86-64 with
 * per-function target attributes and chosen at run time by CPUID (never -march=native). Off x86-64 only the plain C table exists. Threads are cpu_backend.c's. */
#include "model/cpu_kernels.h"
#include "model/cpu_pool.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ---- plain C: the reference every vector form must match */
static void sgemv_scalar(const float *W, int64_t rows, int64_t cols, int64_t ld, const float *x, float *y)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *w = W + r * ld;
        float s[4] = {0};
        int64_t c = 0;
        for (; c + 4 <= cols; c += 4)
            for (int k = 0; k < 4; k++)
                s[k] += w[c + k] * x[c + k];
        float t = (s[0] + s[2]) + (s[1] + s[3]);
        for (; c < cols; c++)
            t += w[c] * x[c];
        y[r] = t;
    }
}

static void exp_scalar(const float *x, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = expf(x[i]);
}

static void swiglu_scalar(const float *gate, const float *up, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static void add_scalar(float *x, const float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        x[i] += y[i];
}

static void rmsnorm_scalar(const float *x, const float *g, int64_t n, float eps, float *out)
{
    double ss = 0;
    for (int64_t j = 0; j < n; j++)
        ss += (double)x[j] * x[j];
    float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (int64_t j = 0; j < n; j++)
        out[j] = x[j] * r * g[j];
}

static float dot_scalar(const float *a, const float *b, int64_t n)
{
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            s[k] += a[i + k] * b[i + k];
    float t = 0.0f;
    for (; i < n; i++)
        t += a[i] * b[i];
    return t + ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

static void scale_axpy_scalar(float *y, float s, float a, const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = y[i] * s + a * x[i];
}

void kvf_cpu_q8_quantize(const float *x, int64_t n, int8_t *q, float *d)
{
    int64_t nb = kvf_cpu_q8_blocks(n);
    for (int64_t b = 0; b < nb; b++) {
        int64_t i0 = b * KVF_CPU_Q8_BLOCK, len = n - i0 < KVF_CPU_Q8_BLOCK ? n - i0 : KVF_CPU_Q8_BLOCK;
        float amax = 0.0f;
        for (int64_t i = 0; i < len; i++)
            amax = fmaxf(amax, fabsf(x[i0 + i]));
        /* amax / 127 as the scale keeps every q in [-127, 127]: maddubs's pair sums then stay
         * below 2^15 and |q| is a valid unsigned byte for the sign trick of the dot kernels */
        float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = dd;
        for (int64_t i = 0; i < KVF_CPU_Q8_BLOCK; i++) {
            float v = i < len ? x[i0 + i] * id : 0.0f;
            long r = lrintf(v);
            q[i0 + i] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
        }
    }
}

static void q8_gemv_scalar(const int8_t *wq, const float *wd, int64_t rows, int64_t kb, const int8_t *xq,
                           const float *xd, float *y)
{
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *w = wq + r * kb * KVF_CPU_Q8_BLOCK;
        float t = 0.0f;
        for (int64_t b = 0; b < kb; b++) {
            int32_t s = 0;
            for (int i = 0; i < KVF_CPU_Q8_BLOCK; i++)
                s += (int32_t)w[b * KVF_CPU_Q8_BLOCK + i] * xq[b * KVF_CPU_Q8_BLOCK + i];
            t += (float)s * (wd[r * kb + b] * xd[b]);
        }
        y[r] = t;
    }
}

static void q8_dequant_scalar(const int8_t *q, const float *d, int64_t n_blocks, float *out)
{
    for (int64_t b = 0; b < n_blocks; b++)
        for (int i = 0; i < KVF_CPU_Q8_BLOCK; i++)
            out[b * KVF_CPU_Q8_BLOCK + i] = (float)q[b * KVF_CPU_Q8_BLOCK + i] * d[b];
}

static const kvf_cpu_kernels kernels_scalar = {
    .name = "scalar", .isa = KVF_CPU_ISA_SCALAR, .sgemv = sgemv_scalar, .exp = exp_scalar,
    .swiglu = swiglu_scalar, .add = add_scalar, .rmsnorm = rmsnorm_scalar, .dot = dot_scalar,
    .scale_axpy = scale_axpy_scalar, .q8_gemv = q8_gemv_scalar, .q8_dequant = q8_dequant_scalar,
};

#if defined(__x86_64__)
/* exp(x) = 2^n * e^r, n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in two
 * so n * hi is exact), e^r by Cephes's degree-6 polynomial; 2^n applied as 2^(n/2) * 2^(n - n/2)
 * so that results near FLT_MIN and FLT_MAX round correctly (denormals and +inf included). */
#define EXP_LO -104.0f /* exp below this rounds to 0 */
#define EXP_HI 89.0f   /* exp above 88.73 is +inf */
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* ---- AVX2 + FMA */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Four rows at a time, two vectors of each per step, so eight loads are in flight. */
__attribute__((target("avx2,fma"))) static void sgemv_avx2(const float *W, int64_t rows, int64_t cols,
                                                           int64_t ld, const float *x, float *y)
{
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *w0 = W + r * ld, *w1 = w0 + ld, *w2 = w1 + ld, *w3 = w2 + ld;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) {
            __m256 xa = _mm256_loadu_ps(x + c), xb = _mm256_loadu_ps(x + c + 8);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + c), xa, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + c), xa, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + c), xa, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + c), xa, a3);
            b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + c + 8), xb, b0);
            b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + c + 8), xb, b1);
            b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + c + 8), xb, b2);
            b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + c + 8), xb, b3);
        }
        for (; c + 8 <= cols; c += 8) {
            __m256 xa = _mm256_loadu_ps(x + c);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + c), xa, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + c), xa, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + c), xa, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + c), xa, a3);
        }
        float t0 = hsum8(_mm256_add_ps(a0, b0)), t1 = hsum8(_mm256_add_ps(a1, b1));
        float t2 = hsum8(_mm256_add_ps(a2, b2)), t3 = hsum8(_mm256_add_ps(a3, b3));
        for (; c < cols; c++) {
            t0 += w0[c] * x[c];
            t1 += w1[c] * x[c];
            t2 += w2[c] * x[c];
            t3 += w3[c] * x[c];
        }
        y[r] = t0;
        y[r + 1] = t1;
        y[r + 2] = t2;
        y[r + 3] = t3;
    }
    for (; r < rows; r++) {
        const float *w = W + r * ld;
        __m256 a = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a);
        float t = hsum8(a);
        for (; c < cols; c++)
            t += w[c] * x[c];
        y[r] = t;
    }
}

__attribute__((target("avx2,fma"))) static void exp_avx2(const float *x, float *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float t[8] = {0};
        memcpy(t, x + i, (size_t)(n - i) * sizeof(float));
        _mm256_storeu_ps(t, exp8(_mm256_loadu_ps(t)));
        memcpy(y + i, t, (size_t)(n - i) * sizeof(float));
    }
}

__attribute__((target("avx2,fma"))) static void swiglu_avx2(const float *gate, const float *up, int64_t n,
                                                            float *out)
{
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(zero, g));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    swiglu_scalar(gate + i, up + i, n - i, out + i);
}

__attribute__((target("avx2,fma"))) static void add_avx2(float *x, const float *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        x[i] += y[i];
}

__attribute__((target("avx2,fma"))) static void rmsnorm_avx2(const float *x, const float *g, int64_t n, float eps,
                                                             float *out)
{
    __m256d s0 = _mm256_setzero_pd(), s1 = s0;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        s0 = _mm256_fmadd_pd(lo, lo, s0);
        s1 = _mm256_fmadd_pd(hi, hi, s1);
    }
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(s0, s1));
    double ss = (t[0] + t[2]) + (t[1] + t[3]);
    for (int64_t k = j; k < n; k++)
        ss += (double)x[k] * x[k];
    float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    __m256 rv = _mm256_set1_ps(r);
    for (j = 0; j + 8 <= n; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), rv), _mm256_loadu_ps(g + j)));
    for (; j < n; j++)
        out[j] = x[j] * r * g[j];
}

__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b, int64_t n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float t = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++)
        t += a[i] * b[i];
    return t;
}

__attribute__((target("avx2,fma"))) static void scale_axpy_avx2(float *y, float s, float a, const float *x,
                                                                int64_t n)
{
    __m256 sv = _mm256_set1_ps(s), av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_mul_ps(_mm256_loadu_ps(y + i), sv)));
    for (; i < n; i++)
        y[i] = y[i] * s + a * x[i];
}

/* q8: per block |w| (unsigned) times x with w's sign (signed) by maddubs into 16 int16 pair
 * sums (below 2^15 as |q| <= 127), madd to 8 int32, then one FMA with the block's two scales.
 * Two rows at a time share the x loads; two accumulators each hide the FMA latency. */
__attribute__((target("avx2,fma"))) static inline __m256 q8_block_avx2(__m256i w, __m256i x)
{
    __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

__attribute__((target("avx2,fma"))) static void q8_gemv_avx2(const int8_t *wq, const float *wd, int64_t rows,
                                                             int64_t kb, const int8_t *xq, const float *xd,
                                                             float *y)
{
    int64_t ld = kb * KVF_CPU_Q8_BLOCK, r = 0;
    for (; r + 2 <= rows; r += 2) {
        const int8_t *w0 = wq + r * ld, *w1 = w0 + ld;
        const float *d0 = wd + r * kb, *d1 = d0 + kb;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        int64_t b = 0;
        for (; b + 2 <= kb; b += 2) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + b * 32 + 32));
            a0 = _mm256_fmadd_ps(q8_block_avx2(_mm256_loadu_si256((const __m256i *)(w0 + b * 32)), x0),
                                 _mm256_set1_ps(d0[b] * xd[b]), a0);
            a1 = _mm256_fmadd_ps(q8_block_avx2(_mm256_loadu_si256((const __m256i *)(w1 + b * 32)), x0),
                                 _mm256_set1_ps(d1[b] * xd[b]), a1);
            b0 = _mm256_fmadd_ps(q8_block_avx2(_mm256_loadu_si256((const __m256i *)(w0 + b * 32 + 32)), x1),
                                 _mm256_set1_ps(d0[b + 1] * xd[b + 1]), b0);
            b1 = _mm256_fmadd_ps(q8_block_avx2(_mm256_loadu_si256((const __m256i *)(w1 + b * 32 + 32)), x1),
                                 _mm256_set1_ps(d1[b + 1] * xd[b + 1]), b1);
        }
        if (b < kb) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
            a0 = _mm256_fmadd_ps(q8_block_avx2(_mm256_loadu_si256((const __m256i *)(w0 + b * 32)), x0),
                                 _mm256_set1_ps(d0[b] * xd[b]), a0);
            a1 = _mm256_fmadd_ps(q8_block_avx2(_mm256_loadu_si256((const __m256i *)(w1 + b * 32)), x0),
                                 _mm256_set1_ps(d1[b] * xd[b]), a1);
        }
        y[r] = hsum8(_mm256_add_ps(a0, b0));
        y[r + 1] = hsum8(_mm256_add_ps(a1, b1));
    }
    for (; r < rows; r++) {
        const int8_t *w0 = wq + r * ld;
        const float *d0 = wd + r * kb;
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t b = 0; b < kb; b++)
            a0 = _mm256_fmadd_ps(q8_block_avx2(_mm256_loadu_si256((const __m256i *)(w0 + b * 32)),
                                               _mm256_loadu_si256((const __m256i *)(xq + b * 32))),
                                 _mm256_set1_ps(d0[b] * xd[b]), a0);
        y[r] = hsum8(a0);
    }
}

__attribute__((target("avx2,fma"))) static void q8_dequant_avx2(const int8_t *q, const float *d, int64_t n_blocks,
                                                                float *out)
{
    for (int64_t b = 0; b < n_blocks; b++) {
        __m256 s = _mm256_set1_ps(d[b]);
        for (int k = 0; k < 4; k++) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(q + b * 32 + k * 8));
            _mm256_storeu_ps(out + b * 32 + k * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s));
        }
    }
}

static const kvf_cpu_kernels kernels_avx2 = {
    .name = "avx2", .isa = KVF_CPU_ISA_AVX2, .sgemv = sgemv_avx2, .exp = exp_avx2,
    .swiglu = swiglu_avx2, .add = add_avx2, .rmsnorm = rmsnorm_avx2, .dot = dot_avx2,
    .scale_axpy = scale_axpy_avx2, .q8_gemv = q8_gemv_avx2, .q8_dequant = q8_dequant_avx2,
};

/* ---- AVX-512 F: the same with 16 lanes and masked tails */
__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i ni = _mm512_cvtps_epi32(n);
    __m512i n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
    __m512i bias = _mm512_set1_epi32(127);
    __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
    __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
    return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
}

static inline __mmask16 tail_mask(int64_t left)
{
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

__attribute__((target("avx512f"))) static void sgemv_avx512(const float *W, int64_t rows, int64_t cols,
                                                            int64_t ld, const float *x, float *y)
{
    int64_t r = 0;
    int64_t cv = cols / 16 * 16;
    __mmask16 tm = tail_mask(cols - cv);
    for (; r + 4 <= rows; r += 4) {
        const float *w0 = W + r * ld, *w1 = w0 + ld, *w2 = w1 + ld, *w3 = w2 + ld;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = 0; c < cv; c += 16) {
            __m512 xv = _mm512_loadu_ps(x + c);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + c), xv, a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + c), xv, a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + c), xv, a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + c), xv, a3);
        }
        if (cv < cols) {
            __m512 xv = _mm512_maskz_loadu_ps(tm, x + cv);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, w0 + cv), xv, a0);
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, w1 + cv), xv, a1);
            a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, w2 + cv), xv, a2);
            a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, w3 + cv), xv, a3);
        }
        y[r] = _mm512_reduce_add_ps(a0);
        y[r + 1] = _mm512_reduce_add_ps(a1);
        y[r + 2] = _mm512_reduce_add_ps(a2);
        y[r + 3] = _mm512_reduce_add_ps(a3);
    }
    for (; r < rows; r++) {
        const float *w = W + r * ld;
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < cv; c += 16)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(w + c), _mm512_loadu_ps(x + c), a);
        if (cv < cols)
            a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, w + cv), _mm512_maskz_loadu_ps(tm, x + cv), a);
        y[r] = _mm512_reduce_add_ps(a);
    }
}

__attribute__((target("avx512f"))) static void exp_avx512(const float *x, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(y + i, m, exp16(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

__attribute__((target("avx512f"))) static void swiglu_avx512(const float *gate, const float *up, int64_t n,
                                                             float *out)
{
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, g))));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
    }
}

__attribute__((target("avx512f"))) static void add_avx512(float *x, const float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
    }
}

__attribute__((target("avx512f"))) static void rmsnorm_avx512(const float *x, const float *g, int64_t n,
                                                              float eps, float *out)
{
    __m512d s0 = _mm512_setzero_pd(), s1 = s0;
    for (int64_t j = 0; j < n; j += 16) {
        __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - j), x + j);
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        s0 = _mm512_fmadd_pd(lo, lo, s0);
        s1 = _mm512_fmadd_pd(hi, hi, s1);
    }
    double ss = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    __m512 rv = _mm512_set1_ps(r);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = tail_mask(n - j);
        __m512 o = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), rv), _mm512_maskz_loadu_ps(m, g + j));
        _mm512_mask_storeu_ps(out + j, m, o);
    }
}

__attribute__((target("avx512f"))) static float dot_avx512(const float *a, const float *b, int64_t n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

__attribute__((target("avx512f"))) static void scale_axpy_avx512(float *y, float s, float a, const float *x,
                                                                 int64_t n)
{
    __m512 sv = _mm512_set1_ps(s), av = _mm512_set1_ps(a);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 o = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + i), sv));
        _mm512_mask_storeu_ps(y + i, m, o);
    }
}

__attribute__((target("avx512f"))) static void q8_dequant_avx512(const int8_t *q, const float *d, int64_t n_blocks,
                                                                 float *out)
{
    for (int64_t b = 0; b < n_blocks; b++) {
        __m512 s = _mm512_set1_ps(d[b]);
        for (int k = 0; k < 2; k++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(q + b * 32 + k * 16));
            _mm512_storeu_ps(out + b * 32 + k * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), s));
        }
    }
}

static const kvf_cpu_kernels kernels_avx512 = {
    .name = "avx512", .isa = KVF_CPU_ISA_AVX512, .sgemv = sgemv_avx512, .exp = exp_avx512,
    .swiglu = swiglu_avx512, .add = add_avx512, .rmsnorm = rmsnorm_avx512, .dot = dot_avx512,
    .scale_axpy = scale_axpy_avx512, .q8_gemv = q8_gemv_avx2, .q8_dequant = q8_dequant_avx512,
};

/* q8 by vpdpbusd, two blocks per 512-bit vector: |w| (unsigned) times x with w's sign, four
 * bytes into each int32 lane, so lanes 0-7 hold block b's partial sums and 8-15 block b+1's.
 * The per-block scale products of 16 blocks are one vector; a permute spreads blocks b and b+1
 * over the two halves. Tails: masked loads (zero bytes add nothing, zero scales neither). */
#define Q8_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
__attribute__((target(Q8_VNNI_TARGET))) static inline __m512 q8_pair_vnni(__m512i w, __m512i x, __m512 s,
                                                                           __m512i idx, __m512 acc)
{
    __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), xs);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_permutexvar_ps(idx, s), acc);
}

__attribute__((target(Q8_VNNI_TARGET))) static void q8_gemv_vnni(const int8_t *wq, const float *wd, int64_t rows,
                                                                 int64_t kb, const int8_t *xq, const float *xd,
                                                                 float *y)
{
    const __m512i idx0 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i two = _mm512_set1_epi32(2);
    int64_t ld = kb * KVF_CPU_Q8_BLOCK;
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *w = wq + r * ld;
        const float *d = wd + r * kb;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int64_t b = 0; b < kb; b += 16) {
            int64_t nb = kb - b < 16 ? kb - b : 16;
            __mmask16 sm = tail_mask(nb);
            __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(sm, d + b), _mm512_maskz_loadu_ps(sm, xd + b));
            __m512i idx = idx0;
            int64_t k = 0;
            for (; k + 4 <= nb; k += 4) { /* two pairs: four blocks */
                const int8_t *wp = w + (b + k) * 32, *xp = xq + (b + k) * 32;
                a0 = q8_pair_vnni(_mm512_loadu_si512(wp), _mm512_loadu_si512(xp), s, idx, a0);
                idx = _mm512_add_epi32(idx, two);
                a1 = q8_pair_vnni(_mm512_loadu_si512(wp + 64), _mm512_loadu_si512(xp + 64), s, idx, a1);
                idx = _mm512_add_epi32(idx, two);
            }
            for (; k < nb; k += 2) { /* one pair, or a lone last block in the low half */
                __mmask64 m = nb - k >= 2 ? ~(__mmask64)0 : (__mmask64)0xffffffffu;
                const int8_t *wp = w + (b + k) * 32, *xp = xq + (b + k) * 32;
                a0 = q8_pair_vnni(_mm512_maskz_loadu_epi8(m, wp), _mm512_maskz_loadu_epi8(m, xp), s, idx, a0);
                idx = _mm512_add_epi32(idx, two);
            }
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

static const kvf_cpu_kernels kernels_avx512vnni = {
    .name = "avx512vnni", .isa = KVF_CPU_ISA_AVX512VNNI, .sgemv = sgemv_avx512, .exp = exp_avx512,
    .swiglu = swiglu_avx512, .add = add_avx512, .rmsnorm = rmsnorm_avx512, .dot = dot_avx512,
    .scale_axpy = scale_axpy_avx512, .q8_gemv = q8_gemv_vnni, .q8_dequant = q8_dequant_avx512,
};
#endif /* __x86_64__ */

kvf_cpu_isa kvf_cpu_isa_best(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return KVF_CPU_ISA_AVX512VNNI;
    if (__builtin_cpu_supports("avx512f"))
        return KVF_CPU_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return KVF_CPU_ISA_AVX2;
#endif
    return KVF_CPU_ISA_SCALAR;
}

const kvf_cpu_kernels *kvf_cpu_kernels_get(kvf_cpu_isa isa)
{
    if (isa < KVF_CPU_ISA_SCALAR || isa > kvf_cpu_isa_best())
        return NULL;
    switch (isa) {
#if defined(__x86_64__)
    case KVF_CPU_ISA_AVX512VNNI:
        return &kernels_avx512vnni;
    case KVF_CPU_ISA_AVX512:
        return &kernels_avx512;
    case KVF_CPU_ISA_AVX2:
        return &kernels_avx2;
#endif
    case KVF_CPU_ISA_SCALAR:
        return &kernels_scalar;
    default:
        return NULL;
    }
}

void kvf_cpu_features_str(char *buf, size_t cap)
{
    buf[0] = '\0';
#if defined(__x86_64__)
    static const char *const names[] = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx2", "fma", "avx"};
    size_t len = 0;
    __builtin_cpu_init();
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        bool has = false;
        /* __builtin_cpu_supports needs a literal */
        switch (i) {
        case 0: has = __builtin_cpu_supports("avx512f"); break;
        case 1: has = __builtin_cpu_supports("avx512bw"); break;
        case 2: has = __builtin_cpu_supports("avx512vl"); break;
        case 3: has = __builtin_cpu_supports("avx512dq"); break;
        case 4: has = __builtin_cpu_supports("avx512vnni"); break;
        case 5: has = __builtin_cpu_supports("avx2"); break;
        case 6: has = __builtin_cpu_supports("fma"); break;
        case 7: has = __builtin_cpu_supports("avx"); break;
        }
        if (has && len + strlen(names[i]) + 2 < cap)
            len += (size_t)snprintf(buf + len, cap - len, "%s%s", len ? " " : "", names[i]);
    }
#endif
    if (!buf[0])
        snprintf(buf, cap, "none");
}

/* OpenBLAS x86-64 cores by the vector width their kernels use: 3 AVX-512, 2 AVX2, 1 AVX, 0 SSE
 * (Prescott, Nehalem, Barcelona, ... and any name not listed). */
static int blas_core_rank(const char *core)
{
    static const char *const avx512[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
    static const char *const avx2[] = {"Haswell", "Zen"};
    static const char *const avx[] = {"Sandybridge", "Bulldozer", "Piledriver", "Steamroller", "Excavator"};
    for (size_t i = 0; i < sizeof avx512 / sizeof avx512[0]; i++)
        if (strcasecmp(core, avx512[i]) == 0)
            return 3;
    for (size_t i = 0; i < sizeof avx2 / sizeof avx2[0]; i++)
        if (strcasecmp(core, avx2[i]) == 0)
            return 2;
    for (size_t i = 0; i < sizeof avx / sizeof avx[0]; i++)
        if (strcasecmp(core, avx[i]) == 0)
            return 1;
    return 0;
}

void kvf_cpu_blas_core(const char **core_out, char *better_out, size_t cap)
{
    const char *core = openblas_get_corename();
    *core_out = core ? core : "unknown";
    better_out[0] = '\0';
#if defined(__x86_64__)
    __builtin_cpu_init();
    const char *want = NULL;
    int want_rank = 0;
    /* OpenBLAS's own test for SkylakeX kernels: AVX-512 F, BW, VL and DQ */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
        want = "SkylakeX";
        want_rank = 3;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        want = "Haswell";
        want_rank = 2;
    }
    if (want && blas_core_rank(*core_out) < want_rank)
        snprintf(better_out, cap, "%s", want);
#endif
}

/* ---- the BLAS baselines of bench engine */
#define BL_K 768       /* inner dimension (the 110M model's width) */
#define BL_GEMM_M 64   /* tokens of a prefill chunk */
#define BL_GEMM_N 2048 /* the MLP's width */
#define BL_GEMV_ROWS 16384 /* 48 MiB of f32: far out of cache, as a decode step's weights */

typedef struct bl_gemv_job {
    const kvf_cpu_kernels *kern;
    const float *W, *x;
    float *y;
    int64_t per;
} bl_gemv_job;

static void bl_gemv_item(void *arg, int64_t item, int32_t thread)
{
    (void)thread;
    const bl_gemv_job *j = arg;
    int64_t r0 = item * j->per, r1 = r0 + j->per < BL_GEMV_ROWS ? r0 + j->per : BL_GEMV_ROWS;
    j->kern->sgemv(j->W + r0 * BL_K, r1 - r0, BL_K, BL_K, j->x, j->y + r0);
}

static double bl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

kvf_status kvf_cpu_blas_measure(int32_t n_threads, double min_s, kvf_cpu_blas_rates *out, kvf_err *err)
{
    size_t wn = (size_t)BL_GEMV_ROWS * BL_K;
    float *W = malloc(wn * sizeof *W), *x = malloc((size_t)BL_GEMM_M * BL_K * sizeof *x);
    float *y = malloc((size_t)BL_GEMM_M * BL_GEMM_N * sizeof *y + (size_t)BL_GEMV_ROWS * sizeof *y);
    kvf_cpu_pool *pool = NULL;
    kvf_status st = KVF_OK;
    if (!W || !x || !y) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "model: blas baseline: out of memory");
        goto free_bufs;
    }
    if ((st = kvf_cpu_pool_create(n_threads, 100000, &pool, err)) != KVF_OK)
        goto free_bufs;
    for (size_t i = 0; i < wn; i++)
        W[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    for (size_t i = 0; i < (size_t)BL_GEMM_M * BL_K; i++)
        x[i] = (float)(i % 7) * 0.1f;
    openblas_set_num_threads(n_threads);
    /* sgemm: y[M][N] = x[M][K] W[N][K]^T, as the backend's prefill matmul */
    int64_t reps = 0;
    double t0 = bl_now(), el;
    do {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, BL_GEMM_M, BL_GEMM_N, BL_K, 1.0f, x, BL_K, W,
                    BL_K, 0.0f, y, BL_GEMM_N);
        reps++;
    } while ((el = bl_now() - t0) < min_s);
    out->sgemm_gflops = 2.0 * BL_GEMM_M * BL_GEMM_N * BL_K * (double)reps / el / 1e9;
    /* sgemv over the whole out-of-cache matrix */
    reps = 0;
    t0 = bl_now();
    do {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, BL_GEMV_ROWS, BL_K, 1.0f, W, BL_K, x, 1, 0.0f, y, 1);
        reps++;
    } while ((el = bl_now() - t0) < min_s);
    out->sgemv_gbps = (double)wn * sizeof(float) * (double)reps / el / 1e9;
    openblas_set_num_threads(1);
    /* kvfleet's sgemv, split over the pool in 16-row groups as cpu_matmul does */
    const kvf_cpu_kernels *kern = kvf_cpu_kernels_get(kvf_cpu_isa_best());
    int64_t per = (BL_GEMV_ROWS + n_threads - 1) / n_threads;
    per = (per + 15) / 16 * 16;
    bl_gemv_job job = {.kern = kern, .W = W, .x = x, .y = y, .per = per};
    reps = 0;
    t0 = bl_now();
    do {
        kvf_cpu_pool_run(pool, bl_gemv_item, &job, (BL_GEMV_ROWS + per - 1) / per);
        reps++;
    } while ((el = bl_now() - t0) < min_s);
    out->own_sgemv_gbps = (double)wn * sizeof(float) * (double)reps / el / 1e9;
free_bufs:
    kvf_cpu_pool_destroy(pool);
    free(W);
    free(x);
    free(y);
    return st;
}
