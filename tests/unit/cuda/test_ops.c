/* test_ops.c: every CUDA backend op except attention (attn tests cover it) against the CPU
 * backend on random inputs: embed, matmul (bf16 weights within 2e-2 of the largest output, f32
 * weights within 1e-4, with and without bias), rmsnorm, rope, swiglu, add, gather, kv_write for
 * f32/f16/bf16 (bit-exact) and fp8-e4m3 with scales (within one fp8 step), argmax with ties,
 * the sampler against the rule in cuda.h, and the device KV pool's mem ops. Skips (77) with no
 * GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "model/backend.h"
#include "testutil.h"
#include "sample_ref.h"
#include "gpu_skip.h"

typedef struct side {
    const kvf_backend *be;
    void *ctx;
} side;

static side CPU, GPU;

static void open_sides(const kvf_backend_opts *gpu_opts)
{
    kvf_err err = {0};
    kvf_backend_opts co = {.n_threads = 2};
    if (gpu_opts) {
        co.kv_k_scale = gpu_opts->kv_k_scale;
        co.kv_v_scale = gpu_opts->kv_v_scale;
    }
    CPU.be = kvf_model_backend_cpu();
    assert_int_equal(kvf_backend_create(CPU.be, &co, &CPU.ctx, &err), KVF_OK);
    kvf_backend_opts go = gpu_opts ? *gpu_opts : (kvf_backend_opts){0};
    GPU.be = kvf_cuda_backend();
    if (kvf_backend_create(GPU.be, &go, &GPU.ctx, &err) != KVF_OK)
        fail_msg("cuda backend: %s", err.msg);
}

static void close_sides(void)
{
    kvf_err err = {0};
    if (kvf_backend_sync(GPU.be, GPU.ctx, &err) != KVF_OK)
        fail_msg("cuda backend: %s", err.msg);
    kvf_backend_destroy(GPU.be, GPU.ctx);
    kvf_backend_destroy(CPU.be, CPU.ctx);
}

static void *put(side *s, const void *host, size_t bytes)
{
    kvf_err err = {0};
    void *d = NULL;
    assert_int_equal(kvf_backend_alloc(s->be, s->ctx, bytes, &d, &err), KVF_OK);
    if (host)
        kvf_backend_upload(s->be, s->ctx, d, host, bytes);
    return d;
}

static void get(side *s, void *host, const void *dev, size_t bytes)
{
    kvf_backend_download(s->be, s->ctx, host, dev, bytes);
    kvf_err err = {0};
    if (kvf_backend_sync(s->be, s->ctx, &err) != KVF_OK)
        fail_msg("%s: %s", kvf_backend_name(s->be), err.msg);
}

static uint64_t rng_state = 12345;
static float rnd(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

static float *rnd_array(int64_t n, float scale)
{
    float *a = malloc((size_t)n * sizeof *a);
    for (int64_t i = 0; i < n; i++)
        a[i] = rnd() * scale;
    return a;
}

static kvf_model_tensor tensor(const char *name, const void *data, kvf_dtype dt, int64_t rows,
                               int64_t cols)
{
    kvf_model_tensor t;
    memset(&t, 0, sizeof t);
    t.name = name;
    t.dtype = dt;
    snprintf(t.dtype_name, sizeof t.dtype_name, "%s", dt == KVF_DTYPE_F32 ? "F32" : dt == KVF_DTYPE_BF16 ? "BF16" : "F16");
    t.n_dims = rows > 0 ? 2 : 1;
    if (rows > 0) {
        t.shape[0] = rows;
        t.shape[1] = cols;
        t.n_elems = rows * cols;
    } else {
        t.shape[0] = cols;
        t.n_elems = cols;
    }
    t.n_bytes = t.n_elems * (int64_t)kvf_dtype_size(dt);
    t.data = data;
    return t;
}

static void load(side *s, const kvf_model_tensor *t, kvf_backend_weight *w)
{
    kvf_err err = {0};
    if (kvf_backend_weight_load(s->be, s->ctx, t, w, &err) != KVF_OK)
        fail_msg("%s: %s", kvf_backend_name(s->be), err.msg);
}

/* ---- matmul and embed */

static void check_matmul(int32_t matrix_dtype, int64_t n, bool with_bias, double tol)
{
    kvf_backend_opts go = {.matrix_dtype = matrix_dtype};
    open_sides(&go);
    int64_t rows = 96, cols = 80;
    float *W = rnd_array(rows * cols, 0.5f), *B = rnd_array(rows, 0.1f), *x = rnd_array(n * cols, 1.0f);
    kvf_model_tensor tw = tensor("w", W, KVF_DTYPE_F32, rows, cols), tb = tensor("b", B, KVF_DTYPE_F32, 0, rows);
    float *y[2];
    side *sides[2] = {&CPU, &GPU};
    for (int k = 0; k < 2; k++) {
        side *s = sides[k];
        kvf_backend_weight w, b;
        load(s, &tw, &w);
        load(s, &tb, &b);
        float *dx = put(s, x, (size_t)(n * cols) * 4), *dy = put(s, NULL, (size_t)(n * rows) * 4);
        kvf_backend_matmul(s->be, s->ctx, dx, n, &w, with_bias ? &b : NULL, dy);
        y[k] = malloc((size_t)(n * rows) * 4);
        get(s, y[k], dy, (size_t)(n * rows) * 4);
        kvf_backend_free(s->be, s->ctx, dx);
        kvf_backend_free(s->be, s->ctx, dy);
        kvf_backend_weight_unload(s->be, s->ctx, &w);
        kvf_backend_weight_unload(s->be, s->ctx, &b);
    }
    double e = kvf_test_rel_err(y[1], y[0], n * rows);
    print_message("matmul n %lld, matrices %s%s: error %.2e of the largest (allowed %.0e)\n",
                  (long long)n, matrix_dtype == KVF_BACKEND_MATRIX_F32 ? "f32" : "bf16",
                  with_bias ? ", bias" : "", e, tol);
    assert_true(e <= tol);
    free(W); free(B); free(x); free(y[0]); free(y[1]);
    close_sides();
}

static void test_matmul(void **state)
{
    check_matmul(KVF_BACKEND_MATRIX_AUTO, 1, false, 2e-2);  /* f32 file -> bf16 on the GPU */
    check_matmul(KVF_BACKEND_MATRIX_AUTO, 37, true, 2e-2);
    check_matmul(KVF_BACKEND_MATRIX_F16, 5, true, 5e-3);
    check_matmul(KVF_BACKEND_MATRIX_F32, 37, true, 1e-4);
}

static void test_embed_gather(void **state)
{
    open_sides(NULL);
    int64_t rows = 50, cols = 72, n = 9;
    uint16_t *E = malloc((size_t)(rows * cols) * 2);
    for (int64_t i = 0; i < rows * cols; i++)
        E[i] = kvf_f32_to_bf16(rnd());
    kvf_model_tensor te = tensor("emb", E, KVF_DTYPE_BF16, rows, cols);
    int32_t toks[9] = {0, 49, 3, 3, 17, 48, 1, 0, 25}, gr[4] = {8, 0, 4, 4};
    float out[2][9 * 72], g[2][4 * 72];
    side *sides[2] = {&CPU, &GPU};
    for (int k = 0; k < 2; k++) {
        side *s = sides[k];
        kvf_backend_weight w;
        load(s, &te, &w);
        int32_t *dt = put(s, toks, sizeof toks), *dr = put(s, gr, sizeof gr);
        float *dout = put(s, NULL, sizeof out[0]), *dg = put(s, NULL, sizeof g[0]);
        kvf_backend_embed(s->be, s->ctx, &w, dt, n, dout);
        kvf_backend_gather(s->be, s->ctx, dout, cols, dr, 4, dg);
        get(s, out[k], dout, sizeof out[0]);
        get(s, g[k], dg, sizeof g[0]);
        kvf_backend_free(s->be, s->ctx, dt);
        kvf_backend_free(s->be, s->ctx, dr);
        kvf_backend_free(s->be, s->ctx, dout);
        kvf_backend_free(s->be, s->ctx, dg);
        kvf_backend_weight_unload(s->be, s->ctx, &w);
    }
    assert_memory_equal(out[0], out[1], sizeof out[0]); /* bf16 -> f32 is exact */
    assert_memory_equal(g[0], g[1], sizeof g[0]);
    free(E);
    close_sides();
}

/* ---- elementwise ops */

static void test_norm_rope_swiglu_add(void **state)
{
    open_sides(NULL);
    int64_t n = 13, d = 96;
    int32_t H = 6, D = 16, half = 8;
    float *x = rnd_array(n * d, 3.0f), *g = rnd_array(d, 1.0f), *up = rnd_array(n * d, 2.0f);
    float *cs = malloc((size_t)(n * half * 2) * 4);
    for (int64_t t = 0; t < n; t++)
        for (int32_t j = 0; j < half; j++) {
            double a = (double)(t + 3) * pow(10000.0, -2.0 * j / D);
            cs[(t * half + j) * 2] = (float)cos(a);
            cs[(t * half + j) * 2 + 1] = (float)sin(a);
        }
    kvf_model_tensor tg = tensor("g", g, KVF_DTYPE_F32, 0, d);
    float *res[2][4];
    side *sides[2] = {&CPU, &GPU};
    size_t bytes = (size_t)(n * d) * 4;
    for (int k = 0; k < 2; k++) {
        side *s = sides[k];
        kvf_backend_weight w;
        load(s, &tg, &w);
        float *dx = put(s, x, bytes), *du = put(s, up, bytes), *dcs = put(s, cs, (size_t)(n * half * 2) * 4),
              *dn = put(s, NULL, bytes);
        for (int i = 0; i < 4; i++)
            res[k][i] = malloc(bytes);
        kvf_backend_rmsnorm(s->be, s->ctx, dx, n, &w, 1e-5f, dn);
        get(s, res[k][0], dn, bytes);
        kvf_backend_rmsnorm(s->be, s->ctx, dn, n, &w, 1e-5f, dn); /* in place */
        kvf_backend_rope(s->be, s->ctx, dn, n, H, D, dcs);        /* 6 heads of 16 = 96 */
        get(s, res[k][1], dn, bytes);
        kvf_backend_swiglu(s->be, s->ctx, dn, du, n * d, dn);
        get(s, res[k][2], dn, bytes);
        kvf_backend_add(s->be, s->ctx, dn, dx, n * d);
        get(s, res[k][3], dn, bytes);
        kvf_backend_free(s->be, s->ctx, dx); kvf_backend_free(s->be, s->ctx, du); kvf_backend_free(s->be, s->ctx, dcs); kvf_backend_free(s->be, s->ctx, dn);
        kvf_backend_weight_unload(s->be, s->ctx, &w);
    }
    const char *names[4] = {"rmsnorm", "rmsnorm+rope", "swiglu", "add"};
    for (int i = 0; i < 4; i++) {
        double e = kvf_test_rel_err(res[1][i], res[0][i], n * d);
        print_message("%s: error %.2e of the largest (allowed 1e-5)\n", names[i], e);
        assert_true(e <= 1e-5);
        free(res[0][i]);
        free(res[1][i]);
    }
    free(x); free(g); free(up); free(cs);
    close_sides();
}

/* ---- kv_write */

static void check_kv_write(kvf_dtype dt, float ks, float vs)
{
    kvf_backend_opts go = {.kv_k_scale = ks, .kv_v_scale = vs};
    open_sides(&go);
    kvf_err err = {0};
    kvf_kv_layout l;
    assert_int_equal(kvf_kv_layout_init(3, 2, 32, 16, dt, &l, &err), KVF_OK);
    int64_t n = 21, n_blocks = 6, row = 2 * 32;
    float *k = rnd_array(n * row, 40.0f), *v = rnd_array(n * row, 1200.0f);
    int64_t slots[21];
    for (int64_t i = 0; i < n; i++) /* scattered: blocks 4, 1, 5 with gaps */
        slots[i] = (int64_t)(i < 10 ? 4 : i < 16 ? 1 : 5) * 16 + (i * 7) % 16;
    size_t pool_bytes = (size_t)(n_blocks * l.block_bytes);
    uint8_t *p[2];
    side *sides[2] = {&CPU, &GPU};
    for (int s_ = 0; s_ < 2; s_++) {
        side *s = sides[s_];
        void *dk = put(s, k, (size_t)(n * row) * 4), *dv = put(s, v, (size_t)(n * row) * 4),
             *ds = put(s, slots, sizeof slots), *dp = put(s, NULL, pool_bytes);
        kvf_backend_kv_write(s->be, s->ctx, dp, &l, 2, dk, dv, ds, n);
        p[s_] = malloc(pool_bytes);
        get(s, p[s_], dp, pool_bytes);
        kvf_backend_free(s->be, s->ctx, dk); kvf_backend_free(s->be, s->ctx, dv); kvf_backend_free(s->be, s->ctx, ds); kvf_backend_free(s->be, s->ctx, dp);
    }
    if (dt != KVF_DTYPE_FP8_E4M3) {
        assert_memory_equal(p[0], p[1], pool_bytes); /* same rounding: bit-exact */
    } else {
        size_t same = 0, total = 0;
        float kscale = ks > 0 ? ks : 1, vscale = vs > 0 ? vs : 1;
        for (size_t i = 0; i < pool_bytes; i++) {
            /* K slabs and V slabs alternate per layer: find which scale this byte uses */
            int64_t within = (int64_t)(i % (size_t)l.block_bytes);
            int part = (int)((within / kvf_kv_slab_bytes(&l)) % 2);
            float sc = part ? vscale : kscale;
            float a = kvf_fp8e4m3_to_f32(p[0][i]) * sc, b = kvf_fp8e4m3_to_f32(p[1][i]) * sc;
            same += p[0][i] == p[1][i];
            total++;
            if (fabsf(a - b) > fabsf(a) / 8.0f + 0.002f * sc)
                fail_msg("fp8 byte %zu: cpu %g, gpu %g (more than one fp8 step apart)", i, (double)a, (double)b);
        }
        print_message("fp8 kv_write (scales %g, %g): %zu of %zu bytes identical\n", (double)ks, (double)vs, same, total);
        assert_true(same >= total - total / 100);
    }
    free(k); free(v); free(p[0]); free(p[1]);
    close_sides();
}

static void test_kv_write(void **state)
{
    check_kv_write(KVF_DTYPE_F32, 0, 0);
    check_kv_write(KVF_DTYPE_F16, 0, 0);
    check_kv_write(KVF_DTYPE_BF16, 0, 0);
    check_kv_write(KVF_DTYPE_FP8_E4M3, 0.1f, 4.0f); /* values beyond 448 fit through the scales */
    check_kv_write(KVF_DTYPE_FP8_E4M3, 0, 0);       /* unscaled: saturation on both sides */
}

/* ---- argmax and sampling */

static void test_argmax_ties(void **state)
{
    open_sides(NULL);
    int64_t n = 6, vocab = 1000;
    float *x = rnd_array(n * vocab, 5.0f);
    x[0 * vocab + 700] = x[0 * vocab + 300] = 9.0f;  /* tie: 300 wins */
    x[1 * vocab + 999] = x[1 * vocab + 0] = 9.5f;    /* tie at both ends: 0 */
    for (int64_t j = 0; j < vocab; j++)              /* a constant row: 0 */
        x[2 * vocab + j] = 1.0f;
    x[3 * vocab + 513] = 7.0f;
    x[3 * vocab + 257] = 7.0f;
    x[3 * vocab + 1] = NAN; /* NaN never wins */
    x[4 * vocab + 5] = INFINITY;
    int32_t got[2][6];
    side *sides[2] = {&CPU, &GPU};
    for (int k = 0; k < 2; k++) {
        side *s = sides[k];
        float *dx = put(s, x, (size_t)(n * vocab) * 4);
        kvf_backend_argmax(s->be, s->ctx, dx, n, vocab, got[k]);
        get(s, x + 0, dx, 0);
        kvf_backend_free(s->be, s->ctx, dx);
    }
    assert_int_equal(got[1][0], 300);
    assert_int_equal(got[1][1], 0);
    assert_int_equal(got[1][2], 0);
    assert_int_equal(got[1][3], 257);
    assert_int_equal(got[1][4], 5);
    for (int i = 0; i < 6; i++)
        if (i != 3) /* the CPU backend's row with a NaN: same answer unless NaN is at 0 */
            assert_int_equal(got[0][i], got[1][i]);
    assert_int_equal(got[0][3], 257);
    free(x);
    close_sides();
}

static void test_sample(void **state)
{
    open_sides(NULL);
    enum { N = 64, V = 300 };
    float *x = rnd_array((int64_t)N * V, 4.0f);
    kvf_cuda_sample_row rows[N];
    memset(rows, 0, sizeof rows); /* no masks */
    for (int i = 0; i < N; i++) {
        rows[i].temperature = i % 4 == 0 ? 0.3f : 1.0f + 0.1f * (float)(i % 5);
        rows[i].top_k = i % 3 == 0 ? 0 : (i % 3 == 1 ? 5 : 40);
        rows[i].top_p = i % 2 ? 1.0f : 0.6f + 0.05f * (float)(i % 7);
        rows[i].u = (rnd() + 1.0f) * 0.5f * 0.999f;
    }
    rows[1].top_k = 1; /* top-1 is the argmax whatever u says */
    float *d = put(&GPU, x, sizeof(float) * N * V);
    int32_t got[N], amax[1];
    kvf_err err = {0};
    if (kvf_cuda_sample(GPU.ctx, d, N, V, rows, got, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    kvf_backend_argmax(GPU.be, GPU.ctx, d + V, 1, V, amax);
    assert_int_equal(got[1], amax[0]);
    int same = 0;
    bool kept[V];
    for (int i = 0; i < N; i++) {
        int32_t want = kvf_test_sample_ref(x + (int64_t)i * V, V, &rows[i], kept);
        assert_true(got[i] >= 0 && got[i] < V);
        if (!kept[got[i]])
            fail_msg("row %d: token %d is outside the kept set (top_k %d, top_p %g)", i, got[i],
                     rows[i].top_k, (double)rows[i].top_p);
        same += got[i] == want;
    }
    print_message("sample: %d of %d rows equal to the host rule (the rest differ by rounding at a boundary)\n", same, N);
    assert_true(same >= N - 2);
    /* a bad row is refused, naming it */
    rows[3].top_p = 0.0f;
    assert_int_equal(kvf_cuda_sample(GPU.ctx, d, N, V, rows, got, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "row 3"));
    kvf_backend_free(GPU.be, GPU.ctx, d);
    free(x);
    close_sides();
}

/* ---- the device KV pool's mem ops, and refusals */

static void test_kv_mem_and_supports(void **state)
{
    open_sides(NULL);
    kvf_err err = {0};
    const kvf_kv_mem_ops *mem = kvf_backend_kv_mem(GPU.be, GPU.ctx);
    assert_non_null(mem);
    assert_string_equal(mem->name, "cuda");
    int64_t bb = 4096;
    void *base = NULL;
    assert_int_equal(mem->alloc(GPU.ctx, 4 * bb, &base, &err), KVF_OK);
    uint8_t *h = malloc((size_t)bb), *back = malloc((size_t)bb);
    for (int64_t i = 0; i < bb; i++)
        h[i] = (uint8_t)(i * 13 + 1);
    assert_int_equal(mem->from_host(GPU.ctx, base, bb, 2, h, &err), KVF_OK);
    assert_int_equal(mem->copy_block(GPU.ctx, base, bb, 0, 2, &err), KVF_OK);
    assert_int_equal(mem->to_host(GPU.ctx, back, base, bb, 0, &err), KVF_OK);
    assert_memory_equal(h, back, (size_t)bb);
    assert_int_equal(mem->to_host(GPU.ctx, back, base, bb, 1, &err), KVF_OK); /* zeroed at alloc */
    for (int64_t i = 0; i < bb; i++)
        assert_int_equal(back[i], 0);
    mem->free(GPU.ctx, base, 4 * bb);
    free(h);
    free(back);

    kvf_kv_layout l;
    assert_int_equal(kvf_kv_layout_init(2, 2, 15, 16, KVF_DTYPE_F16, &l, &err), KVF_OK);
    kvf_status st = kvf_backend_supports(GPU.be, GPU.ctx, &l, 4, &err);
    assert_int_equal(st, KVF_ERR_UNSUPPORTED);
    print_message("head_dim 15: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "15"));
    /* a failed op is reported by the next sync, once */
    kvf_backend_weight w = {.data = NULL, .rows = 1, .cols = 8, .dtype = KVF_DTYPE_FP8_E4M3};
    kvf_backend_embed(GPU.be, GPU.ctx, &w, NULL, 1, NULL);
    assert_int_not_equal(kvf_backend_sync(GPU.be, GPU.ctx, &err), KVF_OK);
    assert_non_null(strstr(err.msg, "embed"));
    assert_int_equal(kvf_backend_sync(GPU.be, GPU.ctx, &err), KVF_OK);
    close_sides();
}

int main(void)
{
    if (kvf_test_gpu_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_embed_gather),
        cmocka_unit_test(test_norm_rope_swiglu_add),
        cmocka_unit_test(test_kv_write),
        cmocka_unit_test(test_argmax_ties),
        cmocka_unit_test(test_sample),
        cmocka_unit_test(test_kv_mem_and_supports),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
