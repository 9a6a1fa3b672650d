/* cpu_kernels.h: the CPU backend's inner loops (matrix-vector product, q8 dot products and
 * dequantization, vector exp, the elementwise ops of a layer, attention's dot and axpy), one
 * table per instruction set, chosen at run time from CPUID; and what OpenBLAS chose on this
 * CPU. Internal to model/, its tests and `kvfleet bench engine` (the BLAS baselines). */
#ifndef KVF_MODEL_CPU_KERNELS_H
#define KVF_MODEL_CPU_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum kvf_cpu_isa {
    KVF_CPU_ISA_SCALAR = 0, /* plain C, any CPU */
    KVF_CPU_ISA_AVX2 = 1,   /* AVX2 + FMA */
    KVF_CPU_ISA_AVX512 = 2, /* AVX-512 F (its q8 kernels are AVX2's: F alone has no byte ops) */
    KVF_CPU_ISA_AVX512VNNI = 3, /* AVX-512 F, BW, VL and VNNI: AVX-512's table with q8 by vpdpbusd */
    KVF_CPU_ISA_COUNT = 4,
} kvf_cpu_isa;

/* q8 weights (--weight-dtype q8): each row of a matrix is cut into blocks of KVF_CPU_Q8_BLOCK
 * values along the input dimension (the last block zero-padded), each block stored as int8
 * q[i] in [-127, 127] with one f32 scale d, value = q[i] * d (ggml's Q8_0, with an f32 scale).
 * A row of `cols` values has kvf_cpu_q8_blocks(cols) blocks; the int8 of a matrix are
 * [rows][blocks * 32] and its scales [rows][blocks]. Activations are quantized the same way
 * for the integer dot products. */
#define KVF_CPU_Q8_BLOCK 32

static inline int64_t kvf_cpu_q8_blocks(int64_t cols)
{
    return (cols + KVF_CPU_Q8_BLOCK - 1) / KVF_CPU_Q8_BLOCK;
}

/* Quantizes x[n] into kvf_cpu_q8_blocks(n) blocks: q[blocks * 32] (the padding 0) and d[blocks],
 * d = max |x| of the block / 127 (0 for an all-zero block), q = round(x / d). Plain C, the same
 * on every CPU, so every kernel table sees the same integers. */
void kvf_cpu_q8_quantize(const float *x, int64_t n, int8_t *q, float *d);

/* One instruction set's kernels. Every pointer is set; arrays need no alignment. */
typedef struct kvf_cpu_kernels {
    const char *name; /* "scalar", "avx2", "avx512", "avx512vnni" */
    kvf_cpu_isa isa;
    /* y[r] = sum_c W[r * ld + c] * x[c] for r < rows */
    void (*sgemv)(const float *W /* [rows][ld] */, int64_t rows, int64_t cols, int64_t ld,
                  const float *x /* [cols] */, float *y /* [rows] */);
    /* y[i] = exp(x[i]); y may be x. Within 2 ulp of expf for results above FLT_MIN; exp(-inf)
     * and anything below -104 give 0, above 88.73 +inf. NaN inputs give unspecified values. */
    void (*exp)(const float *x, float *y, int64_t n);
    /* out[i] = gate[i] / (1 + exp(-gate[i])) * up[i] */
    void (*swiglu)(const float *gate, const float *up, int64_t n, float *out);
    /* x[i] += y[i] */
    void (*add)(float *x, const float *y, int64_t n);
    /* out[i] = x[i] * r * g[i], r = 1 / sqrt(mean(x^2) + eps), sum of squares in double */
    void (*rmsnorm)(const float *x, const float *g, int64_t n, float eps, float *out);
    float (*dot)(const float *a, const float *b, int64_t n);
    /* y[i] = y[i] * s + a * x[i] */
    void (*scale_axpy)(float *y, float s, float a, const float *x, int64_t n);
    /* q8 matrix x q8 vector: y[r] = sum_b wd[r * kb + b] * xd[b] * (sum_i wq[r][b * 32 + i] *
     * xq[b * 32 + i]) for r < rows, the inner sums exact in int32 */
    void (*q8_gemv)(const int8_t *wq /* [rows][kb * 32] */, const float *wd /* [rows][kb] */,
                    int64_t rows, int64_t kb, const int8_t *xq /* [kb * 32] */,
                    const float *xd /* [kb] */, float *y /* [rows] */);
    /* out[b * 32 + i] = q[b * 32 + i] * d[b] for b < n_blocks */
    void (*q8_dequant)(const int8_t *q /* [n_blocks * 32] */, const float *d /* [n_blocks] */,
                       int64_t n_blocks, float *out /* [n_blocks * 32] */);
} kvf_cpu_kernels;

/* The best instruction set this CPU runs (always SCALAR off x86-64). */
kvf_cpu_isa kvf_cpu_isa_best(void);

/* The kernels of one instruction set; NULL when this CPU (or this build) cannot run them. The
 * tables are static: nothing to free. */
const kvf_cpu_kernels *kvf_cpu_kernels_get(kvf_cpu_isa isa);

/* CPU features as text ("avx512f avx2 fma" or "none"), for the start-up log line. */
void kvf_cpu_features_str(char *buf, size_t cap);

/* OpenBLAS's core (openblas_get_corename) and, when it is slower than this CPU can run, the
 * OPENBLAS_CORETYPE that would be right ("SkylakeX", "Haswell"); better_out is "" otherwise. */
void kvf_cpu_blas_core(const char **core_out, char *better_out, size_t cap);

#endif

/* In-run baselines for `kvfleet bench engine`: OpenBLAS's own threaded sgemm (GFLOP/s of
 * [gemm_m x k] x [k x gemm_n]) and sgemv (GB/s of a gemv_rows x k matrix read), and kvfleet's
 * sgemv over the same matrix split across a pool of as many threads. */
typedef struct kvf_cpu_blas_rates {
    double sgemm_gflops, sgemv_gbps, own_sgemv_gbps;
} kvf_cpu_blas_rates;

kvf_status kvf_cpu_blas_measure(int32_t n_threads, double min_s, kvf_cpu_blas_rates *out, kvf_err *err);
