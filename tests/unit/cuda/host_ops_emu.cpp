/* host_ops_emu.cpp: the CUDA backend's own kernels (convert, embed, gather, rmsnorm, rope,
 * swiglu/add/bias, kv_write, argmax, sample) run on the host, one OS thread per CUDA thread (a
 * barrier for __syncthreads, a per-warp exchange for __shfl_xor_sync, statics for __shared__),
 * against the CPU backend and the sampler's host rule. It checks the kernels' indexing,
 * reductions, barriers and grid strides without a GPU; not timing, not races the barriers
 * hide, not the device's own float conversions (the toolkit's host versions stand in). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include <functional>

extern "C" {
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "common/dtype.h"
#include "cuda/cuda.h"
#include "cuda/ops.h"
#include "kv/layout.h"
#include "model/backend.h"
#include "sample_ref.h"
}

#include "cuda_emu.h"

#define rsqrtf(x) (1.0f / sqrtf(x))
#define KVF_CUDA_HOST_EMU 1
#include "cuda/argmax.cu"
#include "cuda/convert.cu"
#include "cuda/eltwise.cu"
#include "cuda/embed.cu"
#include "cuda/kv_write.cu"
#include "cuda/norm.cu"
#include "cuda/rope.cu"
#include "cuda/sample.cu"

/* A grid of CTAs of nt threads running body, 256 KiB of stack per thread. */
static void emu_launch(emu::idx3 grid, unsigned nt, const std::function<void()> &body)
{
    emu::launch_fibers(grid, {nt, 1, 1}, 256 << 10, body);
}

/* ---- helpers */
static uint64_t rng_state = 99;
static float rnd()
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

struct cpu_side {
    const kvf_backend *be;
    void *ctx;
    cpu_side(float ks = 0, float vs = 0)
    {
        kvf_err err = {};
        be = kvf_model_backend_cpu();
        kvf_backend_opts o = {};
        o.n_threads = 1;
        o.kv_k_scale = ks;
        o.kv_v_scale = vs;
        assert_int_equal(kvf_backend_create(be, &o, &ctx, &err), KVF_OK);
    }
    ~cpu_side() { kvf_backend_destroy(be, ctx); }
};

static kvf_backend_weight f32_weight(float *data, int64_t rows, int64_t cols)
{
    kvf_backend_weight w = {};
    w.data = data;
    w.rows = rows;
    w.cols = cols;
    w.dtype = KVF_DTYPE_F32;
    return w;
}

/* ---- tests */

static void test_convert(void **state)
{
    const int64_t n = 1000;
    float x[n];
    for (int64_t i = 0; i < n; i++)
        x[i] = rnd() * (i % 3 == 0 ? 600.0f : i % 3 == 1 ? 1.0f : 1e-3f);
    uint16_t bf[n], hf[n];
    uint8_t f8[n];
    /* 3 CTAs of 64 threads: the grid stride covers the rest */
    emu_launch({3, 1, 1}, 64, [&] { convert_kernel(x, KVF_DTYPE_F32, bf, KVF_DTYPE_BF16, n); });
    emu_launch({3, 1, 1}, 64, [&] { convert_kernel(x, KVF_DTYPE_F32, hf, KVF_DTYPE_F16, n); });
    emu_launch({3, 1, 1}, 64, [&] { convert_kernel(x, KVF_DTYPE_F32, f8, KVF_DTYPE_FP8_E4M3, n); });
    for (int64_t i = 0; i < n; i++) {
        assert_int_equal(bf[i], kvf_f32_to_bf16(x[i]));
        assert_int_equal(hf[i], kvf_f32_to_f16(x[i]));
        if (f8[i] != kvf_f32_to_fp8e4m3(x[i]))
            fail_msg("fp8 of %g: kernel 0x%02x, common/dtype.c 0x%02x", (double)x[i], f8[i],
                     kvf_f32_to_fp8e4m3(x[i]));
    }
    float back[n];
    emu_launch({2, 1, 1}, 128, [&] { convert_kernel(bf, KVF_DTYPE_BF16, back, KVF_DTYPE_F32, n); });
    for (int64_t i = 0; i < n; i++)
        assert_true(back[i] == kvf_bf16_to_f32(bf[i]));
}

static void test_embed_gather_rows(void **state)
{
    const int64_t rows = 20, cols = 300, n = 5;
    uint16_t table[rows * cols];
    for (int64_t i = 0; i < rows * cols; i++)
        table[i] = kvf_f32_to_bf16(rnd());
    int32_t toks[n] = {19, 0, 7, 7, 3}, pick[3] = {4, 0, 2};
    float out[n * cols], g[3 * cols];
    /* gridDim.y 2 < 5 rows and 1 column chunk < 300 columns: both strides are used */
    emu_launch({1, 2, 1}, 64, [&] { embed_kernel(table, KVF_DTYPE_BF16, cols, toks, n, out); });
    emu_launch({1, 2, 1}, 32, [&] { gather_kernel(out, cols, pick, 3, g); });
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < cols; j++)
            assert_true(out[i * cols + j] == kvf_bf16_to_f32(table[toks[i] * cols + j]));
    for (int64_t i = 0; i < 3; i++)
        assert_memory_equal(g + i * cols, out + pick[i] * cols, cols * sizeof(float));
}

static void test_rmsnorm_rope_eltwise(void **state)
{
    cpu_side cpu;
    const int64_t n = 4, d = 700; /* wider than the CTA: each thread takes several columns */
    static float x[n * d], w[d], want[n * d], got[n * d];
    for (int64_t i = 0; i < n * d; i++)
        x[i] = rnd() * 3.0f;
    for (int64_t i = 0; i < d; i++)
        w[i] = rnd();
    kvf_backend_weight wt = f32_weight(w, 1, d);
    kvf_backend_rmsnorm(cpu.be, cpu.ctx, x, n, &wt, 1e-5f, want);
    emu_launch({(unsigned)n, 1, 1}, NORM_THREADS, [&] { rmsnorm_kernel(x, w, d, 1e-5f, got); });
    double e = kvf_test_rel_err(got, want, n * d);
    print_message("rmsnorm: error %.2e of the largest\n", e);
    assert_true(e <= 1e-5);

    const int32_t H = 3, D = 16, half = D / 2, T = 5;
    static float q[T * H * D], q2[T * H * D], cs[T * half * 2];
    for (int64_t i = 0; i < T * H * D; i++)
        q[i] = q2[i] = rnd();
    for (int64_t i = 0; i < T * half * 2; i++)
        cs[i] = rnd();
    kvf_backend_rope(cpu.be, cpu.ctx, q, T, H, D, cs);
    emu_launch({2, 1, 1}, 32, [&] { rope_kernel(q2, T, H, D, cs); });
    assert_true(kvf_test_rel_err(q2, q, T * H * D) <= 1e-6);
    /* the head_dims the attention runs on padded thread groups: RoPE assumes no power of two */
    for (int32_t hd : {48, 80, 96}) {
        static float r1[T * H * 96], r2[T * H * 96], rcs[T * 48 * 2];
        for (int64_t i = 0; i < T * H * hd; i++)
            r1[i] = r2[i] = rnd();
        for (int64_t i = 0; i < T * hd; i++)
            rcs[i] = rnd();
        kvf_backend_rope(cpu.be, cpu.ctx, r1, T, H, hd, rcs);
        emu_launch({2, 1, 1}, 32, [&] { rope_kernel(r2, T, H, hd, rcs); });
        assert_true(kvf_test_rel_err(r2, r1, T * H * hd) <= 1e-6);
    }

    static float a[1000], b[1000], sw[1000], ad[1000], bias[40];
    for (int i = 0; i < 1000; i++) {
        a[i] = rnd() * 4;
        b[i] = rnd();
    }
    for (int i = 0; i < 40; i++)
        bias[i] = rnd();
    kvf_backend_swiglu(cpu.be, cpu.ctx, a, b, 1000, sw);
    memcpy(ad, a, sizeof ad);
    kvf_backend_add(cpu.be, cpu.ctx, ad, b, 1000);
    static float g1[1000], g2[1000], g3[1000];
    emu_launch({3, 1, 1}, 64, [&] { eltwise_kernel(KVF_CUDA_SWIGLU, a, b, g1, 1000); });
    emu_launch({3, 1, 1}, 64, [&] { eltwise_kernel(KVF_CUDA_ADD, a, b, g2, 1000); });
    assert_true(kvf_test_rel_err(g1, sw, 1000) <= 1e-6);
    assert_true(kvf_test_rel_err(g2, ad, 1000) <= 1e-7);
    memcpy(g3, b, sizeof g3); /* 25 rows of 40 */
    emu_launch({2, 1, 1}, 64, [&] { bias_kernel(g3, bias, 25, 40); });
    for (int i = 0; i < 1000; i++)
        assert_true(g3[i] == b[i] + bias[i % 40]);
}

static void check_kv_write(kvf_dtype dt, float ks, float vs)
{
    cpu_side cpu(ks, vs);
    kvf_err err = {};
    kvf_kv_layout l;
    assert_int_equal(kvf_kv_layout_init(2, 2, 16, 8, dt, &l, &err), KVF_OK);
    const int64_t n = 11, row = 2 * 16, n_blocks = 5;
    static float k[n * row], v[n * row];
    for (int64_t i = 0; i < n * row; i++) {
        k[i] = rnd() * 50.0f;
        v[i] = rnd() * 1500.0f;
    }
    int64_t slots[n];
    for (int64_t i = 0; i < n; i++)
        slots[i] = (i < 6 ? 3 : 1) * 8 + (i * 5) % 8;
    size_t bytes = (size_t)(n_blocks * l.block_bytes);
    uint8_t *want = (uint8_t *)calloc(1, bytes), *got = (uint8_t *)calloc(1, bytes);
    kvf_backend_kv_write(cpu.be, cpu.ctx, want, &l, 1, k, v, slots, n);
    kvw_geo g = {};
    g.block_bytes = l.block_bytes;
    g.slab_bytes = kvf_kv_slab_bytes(&l);
    g.es = (int64_t)kvf_dtype_size(dt);
    g.n_kv_heads = l.n_kv_heads;
    g.head_dim = l.head_dim;
    g.block_size = l.block_size;
    g.layer = 1;
    g.dtype = dt;
    float kk = ks > 0 ? ks : 1, vv = vs > 0 ? vs : 1;
    emu_launch({2, 1, 1}, 64, [&] { kv_write_kernel(got, g, k, v, slots, n, kk, vv); });
    for (size_t i = 0; i < bytes; i++)
        if (got[i] != want[i])
            fail_msg("kv_write %s: byte %zu: kernel 0x%02x, CPU backend 0x%02x", kvf_dtype_name(dt), i,
                     got[i], want[i]);
    free(want);
    free(got);
}

static void test_kv_write_all_dtypes(void **state)
{
    check_kv_write(KVF_DTYPE_F32, 0, 0);
    check_kv_write(KVF_DTYPE_F16, 0, 0);
    check_kv_write(KVF_DTYPE_BF16, 0, 0);
    check_kv_write(KVF_DTYPE_FP8_E4M3, 0.2f, 4.0f);
    check_kv_write(KVF_DTYPE_FP8_E4M3, 0, 0);
}

static void test_argmax(void **state)
{
    const int64_t n = 4, vocab = 700;
    static float x[n * vocab];
    for (int64_t i = 0; i < n * vocab; i++)
        x[i] = rnd();
    x[0 * vocab + 600] = x[0 * vocab + 33] = 5.0f; /* tie: 33 */
    x[1 * vocab + 0] = x[1 * vocab + 699] = 5.0f;  /* tie at the ends: 0 */
    for (int64_t j = 0; j < vocab; j++)
        x[2 * vocab + j] = NAN; /* nothing but NaN: 0 */
    x[3 * vocab + 300] = 4.0f;
    x[3 * vocab + 256] = NAN;
    int32_t out[n];
    emu_launch({(unsigned)n, 1, 1}, ARGMAX_THREADS, [&] { argmax_kernel(x, vocab, out); });
    assert_int_equal(out[0], 33);
    assert_int_equal(out[1], 0);
    assert_int_equal(out[2], 0);
    assert_int_equal(out[3], 300);
}

static void test_sample_rule(void **state)
{
    const int N = 8, V = 300;
    static float x[N * V];
    for (int i = 0; i < N * V; i++)
        x[i] = rnd() * 4.0f;
    /* row 6: two +inf logits (the lowest id wins); row 7: a temperature whose reciprocal
     * overflows: both the argmax, whatever u says (their weights would be NaN) */
    x[6 * V + 250] = INFINITY, x[6 * V + 17] = INFINITY, x[6 * V + 3] = -INFINITY;
    kvf_cuda_sample_row rows[N];
    memset(rows, 0, sizeof rows); /* no masks */
    const int32_t ks[N] = {0, 1, 5, 40, 0, 299, 0, 0};
    const float ps[N] = {1.0f, 1.0f, 0.7f, 0.9f, 0.5f, 1.0f, 1.0f, 0.8f};
    for (int i = 0; i < N; i++) {
        rows[i].temperature = i == 7 ? 1e-40f : i % 2 ? 0.7f : 1.3f;
        rows[i].top_k = ks[i];
        rows[i].top_p = ps[i];
        rows[i].u = (rnd() + 1.0f) * 0.5f * 0.999f;
    }
    int32_t out[N];
    emu_launch({(unsigned)N, 1, 1}, SAMPLE_THREADS, [&] { sample_kernel(x, V, rows, out); });
    bool kept[V];
    for (int i = 0; i < N; i++) {
        int32_t want = kvf_test_sample_ref(x + i * V, V, &rows[i], kept);
        print_message("sample row %d (top_k %d, top_p %.2f, u %.3f): kernel %d, rule %d\n", i,
                      rows[i].top_k, (double)rows[i].top_p, (double)rows[i].u, out[i], want);
        assert_true(out[i] >= 0 && out[i] < V);
        assert_true(kept[out[i]]);
        assert_int_equal(out[i], want);
    }
    /* top-1 is the argmax whatever u says */
    int32_t am[1];
    emu_launch({1, 1, 1}, ARGMAX_THREADS, [&] { argmax_kernel(x + V, V, am); });
    assert_int_equal(out[1], am[0]);
    assert_int_equal(out[6], 17);
    emu_launch({1, 1, 1}, ARGMAX_THREADS, [&] { argmax_kernel(x + 7 * V, V, am); });
    assert_int_equal(out[7], am[0]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_convert),
        cmocka_unit_test(test_embed_gather_rows),
        cmocka_unit_test(test_rmsnorm_rope_eltwise),
        cmocka_unit_test(test_kv_write_all_dtypes),
        cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_sample_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
