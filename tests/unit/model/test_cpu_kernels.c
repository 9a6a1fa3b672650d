/* test_cpu_kernels.c: every kernel table this CPU runs (scalar, AVX2+FMA, AVX-512, AVX-512 VNNI)
 * against a float64 reference: the vector exp over its whole range and its edges, the sgemv over
 * odd sizes, strides and misaligned arrays, the elementwise ops, the q8 quantizer, dot products
 * and dequantization; what OpenBLAS chose is named. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/cpu_kernels.h"

#define GUARD 12345.0f

static uint64_t rng = 88172645463325252ull;
static float frand(void) /* in [-1, 1) */
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* exp: within 2 ulp (relative 2.4e-7) where expf's result is normal; within two of the
 * smallest denormals below; exactly 1 at 0, 0 at -inf and below -104, +inf above 88.73. */
static void check_exp(const kvf_cpu_kernels *k)
{
    enum { N = 40000 };
    float *x = malloc((N + 1) * sizeof *x), *y = malloc((N + 1) * sizeof *y);
    double worst = 0;
    for (int rep = 0; rep < 6; rep++) {
        for (int i = 0; i < N; i++)
            x[i] = -110.0f + 200.0f * (float)(rep * N + i) / (6.0f * N); /* -110 .. 90 */
        y[N] = GUARD;
        k->exp(x, y, N);
        assert_true(y[N] == GUARD);
        for (int i = 0; i < N; i++) {
            double ref = exp((double)x[i]);
            if (ref > DBL_MAX / 2 || (float)ref == INFINITY) {
                assert_true(isinf(y[i]) || (double)y[i] >= FLT_MAX * 0.9999);
                continue;
            }
            if (ref >= FLT_MIN) {
                double rel = fabs((double)y[i] - ref) / ref;
                worst = rel > worst ? rel : worst;
                if (rel > 2.4e-7)
                    fail_msg("%s exp(%.9g) = %.9g, expected %.9g (relative error %.3g)", k->name, (double)x[i],
                             (double)y[i], ref, rel);
            } else {
                assert_true(fabs((double)y[i] - ref) <= 2.9e-45);
            }
        }
    }
    float e[] = {0.0f, -0.0f, -INFINITY, -1000.0f, -104.5f, -200.0f, 89.0f, 1000.0f, INFINITY, 1.0f, -1.0f};
    float o[sizeof e / sizeof e[0]];
    k->exp(e, o, (int64_t)(sizeof e / sizeof e[0]));
    assert_true(o[0] == 1.0f && o[1] == 1.0f);
    assert_true(o[2] == 0.0f && o[3] == 0.0f && o[4] == 0.0f && o[5] == 0.0f);
    assert_true(isinf(o[6]) && isinf(o[7]) && isinf(o[8]) && o[6] > 0);
    assert_true(fabsf(o[9] - 2.7182817f) <= 3e-7f && fabsf(o[10] - 0.36787945f) <= 1e-7f);
    /* every length and offset, in place, nothing written past the end */
    for (int n = 0; n <= 40; n++)
        for (int off = 0; off < 3; off++) {
            float buf[48];
            for (int i = 0; i < 48; i++)
                buf[i] = i < off + n ? -(float)i * 0.25f : GUARD;
            k->exp(buf + off, buf + off, n);
            for (int i = off; i < off + n; i++)
                assert_true(fabsf(buf[i] - expf(-(float)i * 0.25f)) <= 3e-7f * expf(-(float)i * 0.25f));
            for (int i = off + n; i < 48; i++)
                assert_true(buf[i] == GUARD);
        }
    printf("%s: exp worst relative error %.3g (%.2f ulp)\n", k->name, worst, worst / FLT_EPSILON * 2);
    free(x);
    free(y);
}

static void check_sgemv(const kvf_cpu_kernels *k)
{
    static const int64_t rows_l[] = {1, 2, 3, 4, 5, 7, 8, 17, 33};
    static const int64_t cols_l[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 771};
    float *W = malloc((size_t)33 * 800 * sizeof *W + 64), *x = malloc(800 * sizeof *x + 64), y[40];
    for (size_t ri = 0; ri < sizeof rows_l / sizeof rows_l[0]; ri++)
        for (size_t ci = 0; ci < sizeof cols_l / sizeof cols_l[0]; ci++)
            for (int off = 0; off < 3; off++) {
                int64_t rows = rows_l[ri], cols = cols_l[ci], ld = cols + (off == 2 ? 5 : 0);
                float *w = W + off, *xv = x + (off ^ 1); /* misaligned, and a row stride > cols */
                for (int64_t i = 0; i < rows * ld; i++)
                    w[i] = frand();
                for (int64_t i = 0; i < cols; i++)
                    xv[i] = frand();
                for (int i = 0; i < 40; i++)
                    y[i] = GUARD;
                k->sgemv(w, rows, cols, ld, xv, y + 1);
                assert_true(y[0] == GUARD && y[rows + 1] == GUARD);
                for (int64_t r = 0; r < rows; r++) {
                    double ref = 0, mag = 0;
                    for (int64_t c = 0; c < cols; c++) {
                        ref += (double)w[r * ld + c] * xv[c];
                        mag += fabs((double)w[r * ld + c] * xv[c]);
                    }
                    if (fabs(y[r + 1] - ref) > 4e-7 * mag * (1 + log2((double)cols)) + 1e-30)
                        fail_msg("%s sgemv %ldx%ld ld %ld row %ld: %.9g, expected %.9g", k->name, (long)rows,
                                 (long)cols, (long)ld, (long)r, (double)y[r + 1], ref);
                }
            }
    free(W);
    free(x);
}

static void check_elementwise(const kvf_cpu_kernels *k)
{
    enum { N = 803 };
    float g[N + 1], u[N + 1], out[N + 2], a[N + 1], b[N + 1];
    for (int n = 1; n <= N; n += (n < 40 ? 1 : 97)) {
        for (int i = 0; i < n + 1; i++) {
            g[i] = 12.0f * frand();
            u[i] = frand();
            a[i] = frand();
            b[i] = frand();
        }
        /* swiglu against its definition in double */
        out[n] = GUARD;
        k->swiglu(g, u, n, out);
        assert_true(out[n] == GUARD);
        for (int i = 0; i < n; i++) {
            double ref = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
            assert_true(fabs(out[i] - ref) <= 1e-6 * fabs(ref) + 1e-7);
        }
        /* rmsnorm */
        double ss = 0;
        for (int i = 0; i < n; i++)
            ss += (double)a[i] * a[i];
        double r = 1.0 / sqrt(ss / n + 1e-5);
        k->rmsnorm(a, u, n, 1e-5f, out);
        assert_true(out[n] == GUARD);
        for (int i = 0; i < n; i++)
            assert_true(fabs(out[i] - a[i] * r * u[i]) <= 1e-6 * fabs(a[i] * r) + 1e-7);
        /* dot */
        double d = 0, mag = 0;
        for (int i = 0; i < n; i++) {
            d += (double)a[i] * b[i];
            mag += fabs((double)a[i] * b[i]);
        }
        assert_true(fabs(k->dot(a, b, n) - d) <= 1e-6 * mag + 1e-7);
        /* scale_axpy, then add */
        float y[N + 1];
        memcpy(y, a, sizeof y);
        k->scale_axpy(y, 0.5f, 2.0f, b, n);
        assert_true(y[n] == a[n]);
        for (int i = 0; i < n; i++)
            assert_true(fabsf(y[i] - (a[i] * 0.5f + 2.0f * b[i])) <= 1e-6f);
        k->add(y, b, n);
        assert_true(y[n] == a[n]);
        for (int i = 0; i < n; i++)
            assert_true(fabsf(y[i] - (a[i] * 0.5f + 3.0f * b[i])) <= 2e-6f);
    }
}

/* q8: the quantizer's bounds (every |x - q d| <= d/2, q in [-127, 127], padding 0), then each
 * table's q8_gemv against the same sum in double over the same integers (the integer part is
 * exact in every form; only the order of the per-block float products differs), over odd block
 * counts and row counts, misaligned arrays, nothing written outside y; q8_dequant exactly. */
static void check_q8(const kvf_cpu_kernels *k)
{
    static const int64_t rows_l[] = {1, 2, 3, 4, 5, 16, 17};
    static const int64_t cols_l[] = {1, 31, 32, 33, 64, 95, 96, 480, 511, 512, 544, 800};
    enum { MAXC = 800, MAXKB = (MAXC + 31) / 32, MAXR = 17 };
    float *w = malloc((size_t)MAXR * MAXC * sizeof *w), x[MAXC], y[MAXR + 2];
    int8_t *wq_buf = malloc((size_t)MAXR * MAXKB * 32 + 3), xq_buf[MAXKB * 32 + 3];
    float wd_buf[MAXR * MAXKB + 3], xd_buf[MAXKB + 3], deq[MAXKB * 32 + 1];
    double worst = 0;
    for (size_t ri = 0; ri < sizeof rows_l / sizeof rows_l[0]; ri++)
        for (size_t ci = 0; ci < sizeof cols_l / sizeof cols_l[0]; ci++)
            for (int off = 0; off < 3; off++) {
                int64_t rows = rows_l[ri], cols = cols_l[ci], kb = kvf_cpu_q8_blocks(cols), ld = kb * 32;
                int8_t *wq = wq_buf + off, *xq = xq_buf + (off ^ 1);
                float *wd = wd_buf + off, *xd = xd_buf + (off ^ 1);
                for (int64_t i = 0; i < rows * cols; i++)
                    w[i] = frand() * (i % 37 == 0 ? 8.0f : 1.0f); /* outliers stretch a block's scale */
                for (int64_t i = 0; i < cols; i++)
                    x[i] = (i / 32) % 5 == 4 ? 0.0f : frand(); /* some all-zero blocks: scale 0 */
                for (int64_t r = 0; r < rows; r++)
                    kvf_cpu_q8_quantize(w + r * cols, cols, wq + r * ld, wd + r * kb);
                kvf_cpu_q8_quantize(x, cols, xq, xd);
                for (int64_t i = 0; i < ld; i++) {
                    assert_true(xq[i] >= -127 && xq[i] <= 127);
                    if (i >= cols)
                        assert_int_equal(xq[i], 0);
                    else
                        assert_true(fabsf(x[i] - xq[i] * xd[i / 32]) <= xd[i / 32] * 0.5f * 1.0001f);
                }
                for (int i = 0; i < MAXR + 2; i++)
                    y[i] = GUARD;
                k->q8_gemv(wq, wd, rows, kb, xq, xd, y + 1);
                assert_true(y[0] == GUARD && y[rows + 1] == GUARD);
                for (int64_t r = 0; r < rows; r++) {
                    double ref = 0, mag = 0;
                    for (int64_t b = 0; b < kb; b++) {
                        int64_t s = 0, sa = 0; /* vector forms sum lanes of partial sums */
                        for (int i = 0; i < 32; i++) {
                            s += (int64_t)wq[r * ld + b * 32 + i] * xq[b * 32 + i];
                            sa += llabs((int64_t)wq[r * ld + b * 32 + i] * xq[b * 32 + i]);
                        }
                        double sc = (double)wd[r * kb + b] * xd[b];
                        ref += (double)s * sc;
                        mag += (double)sa * sc;
                    }
                    double e = fabs(y[r + 1] - ref);
                    worst = e / (mag + 1e-30) > worst ? e / (mag + 1e-30) : worst;
                    if (e > 4e-7 * mag * (2 + log2((double)kb)) + 1e-30)
                        fail_msg("%s q8_gemv %ldx%ld row %ld: %.9g, expected %.9g", k->name, (long)rows,
                                 (long)cols, (long)r, (double)y[r + 1], ref);
                }
                deq[kb * 32] = GUARD;
                k->q8_dequant(wq, wd, kb, deq);
                assert_true(deq[kb * 32] == GUARD);
                for (int64_t i = 0; i < ld; i++)
                    assert_true(deq[i] == (float)wq[i] * wd[i / 32]);
            }
    printf("%s: q8_gemv worst error %.3g of the sum of |terms|\n", k->name, worst);
    free(w);
    free(wq_buf);
}

static void test_kernels(void **state)
{
    (void)state;
    int ran = 0;
    for (int isa = 0; isa < KVF_CPU_ISA_COUNT; isa++) {
        const kvf_cpu_kernels *k = kvf_cpu_kernels_get((kvf_cpu_isa)isa);
        if (!k) {
            printf("isa %d: not on this CPU, skipped\n", isa);
            continue;
        }
        assert_int_equal(k->isa, isa);
        check_exp(k);
        check_sgemv(k);
        check_elementwise(k);
        check_q8(k);
        ran++;
    }
    assert_true(ran >= 1);
    assert_non_null(kvf_cpu_kernels_get(kvf_cpu_isa_best()));
    assert_null(kvf_cpu_kernels_get(KVF_CPU_ISA_COUNT));
}

static void test_blas_core(void **state)
{
    (void)state;
    const char *core = NULL;
    char better[32], feat[128];
    kvf_cpu_blas_core(&core, better, sizeof better);
    kvf_cpu_features_str(feat, sizeof feat);
    assert_non_null(core);
    assert_true(core[0] != '\0' && feat[0] != '\0');
    /* a suggestion only where this CPU has AVX2 at least */
    if (better[0])
        assert_true(kvf_cpu_isa_best() >= KVF_CPU_ISA_AVX2);
    printf("cpu %s; OpenBLAS core %s; better %s\n", feat, core, better[0] ? better : "(none)");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kernels),
        cmocka_unit_test(test_blas_core),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
