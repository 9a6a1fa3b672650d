/* test_forward.c: the forward pass on shapes the fixtures lack (q/k/v, o and MLP biases, sliding
 * windows, Llama-3 and linear RoPE scaling, f16 weights), against a float64 reference written
 * here on models from kvf_model_weights_write_random; plus the CPU backend's ops. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include "model/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/weights.h"
#include "testutil.h"

/* ---- the float64 reference: whole-sequence recompute, contiguous KV, no paging */
static double *tensor_d(const kvf_model_tensor *t)
{
    double *a = malloc((size_t)t->n_elems * sizeof *a);
    const uint8_t *b = t->data;
    for (int64_t i = 0; i < t->n_elems; i++) {
        if (t->dtype == KVF_DTYPE_F32) {
            float f;
            memcpy(&f, b + 4 * i, 4);
            a[i] = f;
        } else {
            uint16_t h = (uint16_t)(b[2 * i] | (b[2 * i + 1] << 8));
            a[i] = t->dtype == KVF_DTYPE_BF16 ? kvf_bf16_to_f32(h) : kvf_f16_to_f32(h);
        }
    }
    return a;
}

/* y[rows] = W[rows][cols] x (+ b) */
static void ref_mv(const kvf_model_tensor *w, const kvf_model_tensor *b, const double *x, double *y)
{
    double *W = tensor_d(w), *B = b ? tensor_d(b) : NULL;
    int64_t rows = w->shape[0], cols = w->shape[1];
    for (int64_t r = 0; r < rows; r++) {
        double s = B ? B[r] : 0;
        for (int64_t c = 0; c < cols; c++)
            s += W[r * cols + c] * x[c];
        y[r] = s;
    }
    free(W);
    free(B);
}

static void ref_norm(const kvf_model_tensor *w, const double *x, int64_t d, double eps, double *out)
{
    double *g = tensor_d(w), ss = 0;
    for (int64_t i = 0; i < d; i++)
        ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss / d + eps);
    for (int64_t i = 0; i < d; i++)
        out[i] = x[i] * r * g[i];
    free(g);
}

/* RoPE frequencies written independently of config.c. */
static double ref_freq(const kvf_model_config *c, int32_t i)
{
    double f = 1.0 / pow(c->rope_theta, (2.0 * i) / c->head_dim);
    if (c->rope_scaling == KVF_MODEL_ROPE_LINEAR)
        return f / c->rope_factor;
    if (c->rope_scaling == KVF_MODEL_ROPE_LLAMA3) {
        double wavelen = 2 * M_PI / f;
        double lo = c->rope_orig_max_pos / c->rope_low_freq_factor;
        double hi = c->rope_orig_max_pos / c->rope_high_freq_factor;
        if (wavelen < hi)
            return f;
        if (wavelen > lo)
            return f / c->rope_factor;
        double sm = (c->rope_orig_max_pos / wavelen - c->rope_low_freq_factor) /
                    (c->rope_high_freq_factor - c->rope_low_freq_factor);
        return (1 - sm) * f / c->rope_factor + sm * f;
    }
    return f;
}

static void ref_rope(const kvf_model_config *c, double *v, int32_t n_heads, int32_t pos)
{
    int32_t D = c->head_dim, half = D / 2;
    for (int32_t h = 0; h < n_heads; h++)
        for (int32_t i = 0; i < half; i++) {
            double a = pos * ref_freq(c, i), x = v[h * D + i], y = v[h * D + i + half];
            v[h * D + i] = x * cos(a) - y * sin(a);
            v[h * D + i + half] = y * cos(a) + x * sin(a);
        }
}

/* Logits of the last of n tokens. */
static void ref_logits(const kvf_model *m, const int32_t *tok, int32_t n, double *logits)
{
    const kvf_model_config *c = &m->cfg;
    int64_t d = c->dim, D = c->head_dim, qd = c->n_heads * D, kvd = c->n_kv_heads * D, hid = c->hidden_dim;
    double *x = calloc((size_t)(n * d), sizeof *x), *xb = malloc(sizeof(double) * (size_t)d);
    double *K = malloc(sizeof(double) * (size_t)(n * kvd)), *V = malloc(sizeof(double) * (size_t)(n * kvd));
    double *Q = malloc(sizeof(double) * (size_t)(n * qd)), *att = malloc(sizeof(double) * (size_t)qd);
    double *o = malloc(sizeof(double) * (size_t)d), *g = malloc(sizeof(double) * (size_t)hid),
           *u = malloc(sizeof(double) * (size_t)hid);
    double *E = tensor_d(m->embed);
    for (int32_t t = 0; t < n; t++)
        memcpy(x + t * d, E + (int64_t)tok[t] * d, sizeof(double) * (size_t)d);
    free(E);
    for (int32_t l = 0; l < c->n_layers; l++) {
        const kvf_model_layer *L = &m->layers[l];
        int32_t win = kvf_model_config_window(c, l);
        for (int32_t t = 0; t < n; t++) {
            ref_norm(L->attn_norm, x + t * d, d, c->norm_eps, xb);
            ref_mv(L->wq, L->bq, xb, Q + t * qd);
            ref_mv(L->wk, L->bk, xb, K + t * kvd);
            ref_mv(L->wv, L->bv, xb, V + t * kvd);
            ref_rope(c, Q + t * qd, c->n_heads, t);
            ref_rope(c, K + t * kvd, c->n_kv_heads, t);
        }
        for (int32_t t = 0; t < n; t++) {
            for (int32_t h = 0; h < c->n_heads; h++) {
                int32_t kh = h / (c->n_heads / c->n_kv_heads);
                int32_t lo = win > 0 && t - win + 1 > 0 ? t - win + 1 : 0;
                double mx = -1e300, sum = 0, s[256];
                for (int32_t p = lo; p <= t; p++) {
                    double dot = 0;
                    for (int64_t i = 0; i < D; i++)
                        dot += Q[t * qd + h * D + i] * K[p * kvd + kh * D + i];
                    s[p] = dot / sqrt((double)D);
                    mx = fmax(mx, s[p]);
                }
                for (int64_t i = 0; i < D; i++)
                    att[h * D + i] = 0;
                for (int32_t p = lo; p <= t; p++) {
                    double w = exp(s[p] - mx);
                    sum += w;
                    for (int64_t i = 0; i < D; i++)
                        att[h * D + i] += w * V[p * kvd + kh * D + i];
                }
                for (int64_t i = 0; i < D; i++)
                    att[h * D + i] /= sum;
            }
            ref_mv(L->wo, L->bo, att, o);
            for (int64_t i = 0; i < d; i++)
                x[t * d + i] += o[i];
            ref_norm(L->ffn_norm, x + t * d, d, c->norm_eps, xb);
            ref_mv(L->w_gate, L->b_gate, xb, g);
            ref_mv(L->w_up, L->b_up, xb, u);
            for (int64_t i = 0; i < hid; i++)
                g[i] = g[i] / (1 + exp(-g[i])) * u[i];
            ref_mv(L->w_down, L->b_down, g, o);
            for (int64_t i = 0; i < d; i++)
                x[t * d + i] += o[i];
        }
    }
    ref_norm(m->final_norm, x + (int64_t)(n - 1) * d, d, c->norm_eps, xb);
    ref_mv(m->lm_head, NULL, xb, logits);
    free(x), free(xb), free(K), free(V), free(Q), free(att), free(o), free(g), free(u);
}

/* ---- helpers */
static char tmpdir[256];

static void make_dir(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvf_test_forward_XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
}

static void remove_dir(void)
{
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", tmpdir);
    unlink(p);
    snprintf(p, sizeof p, "%s/model.safetensors", tmpdir);
    unlink(p);
    rmdir(tmpdir);
}

static kvf_model *write_and_load(const kvf_model_config *c, kvf_dtype wdt)
{
    kvf_err err = {0};
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", tmpdir);
    assert_int_equal(kvf_model_config_write(p, c, wdt, &err), KVF_OK);
    snprintf(p, sizeof p, "%s/model.safetensors", tmpdir);
    assert_int_equal(kvf_model_weights_write_random(p, c, wdt, 7, &err), KVF_OK);
    kvf_model *m;
    if (kvf_model_load(tmpdir, &m, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    /* the features under test survived config.json, so the reference really uses them */
    const kvf_model_config *g = &m->cfg;
    assert_int_equal(g->arch, c->arch);
    assert_int_equal(g->sliding_window, c->sliding_window);
    assert_int_equal(g->window_first_layer, c->window_first_layer);
    assert_int_equal(g->rope_scaling, c->rope_scaling);
    assert_true(g->rope_factor == c->rope_factor && g->rope_theta == c->rope_theta);
    assert_int_equal(g->rope_orig_max_pos, c->rope_orig_max_pos);
    assert_int_equal(g->qkv_bias, c->qkv_bias);
    assert_int_equal(g->o_bias, c->o_bias);
    assert_int_equal(g->mlp_bias, c->mlp_bias);
    assert_int_equal(g->tie_embeddings, c->tie_embeddings);
    assert_int_equal(m->weight_dtype, wdt);
    return m;
}

static kvf_model_config base_config(kvf_model_arch arch)
{
    kvf_model_config c;
    kvf_err err = {0};
    assert_int_equal(kvf_model_preset("tiny", 96, &c, &err), KVF_OK);
    c.arch = arch;
    c.max_pos = 128;
    c.bos_id = 1;
    c.n_eos = 1;
    c.eos_ids[0] = 2;
    return c;
}

/* Generates n_gen tokens greedily from a prompt through the paged forward pass (prefill in
 * chunks of 5, block size 4 so windows and blocks interact) and checks every step's logits
 * against the reference. */
static void check_against_reference_opts(const kvf_model_config *c, kvf_dtype wdt, bool half_weights,
                                        const char *what)
{
    make_dir();
    kvf_model *m = write_and_load(c, wdt);
    kvf_err err = {0};
    const kvf_backend *be = kvf_model_backend_cpu();
    void *ctx;
    assert_int_equal(kvf_backend_create(be, &(kvf_backend_opts){.n_threads = 2, .half_weights = half_weights}, &ctx, &err), KVF_OK);
    kvf_kv_layout lay;
    assert_int_equal(kvf_model_kv_layout(m, 4, KVF_DTYPE_F32, &lay, &err), KVF_OK);
    kvf_model_fwd *f;
    kvf_model_fwd_opts o = {.max_tokens = 16, .max_seqs = 2, .max_ctx = 64};
    assert_int_equal(kvf_model_fwd_create(m, be, ctx, &lay, &o, &f, &err), KVF_OK);
    const int32_t n_pool = 32;
    uint8_t *pool = calloc(n_pool, (size_t)lay.block_bytes);
    int32_t table[16];
    for (int32_t i = 0; i < 16; i++)
        table[i] = (i * 7 + 3) % n_pool; /* scattered */
    int32_t seq[40] = {1, 17, 42, 5, 88, 23, 60, 9, 31, 77, 12, 54};
    int32_t n = 12, pos = 0, next = -1, vocab = c->vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)vocab);
    double *want = malloc(sizeof(double) * (size_t)vocab), worst = 0;
    for (int32_t step = 0; step < 8; step++) {
        while (pos < n) {
            int32_t take = n - pos < 5 ? n - pos : 5;
            kvf_model_seq s = {.tokens = seq + pos, .n_tokens = take, .start_pos = pos,
                               .block_table = table, .n_blocks = 16};
            if (kvf_model_forward(f, &s, 1, pool, n_pool, logits, &next, &err) != KVF_OK)
                fail_msg("%s: %s", what, err.msg);
            pos += take;
        }
        ref_logits(m, seq, n, want);
        double mx = 0, d = 0;
        int32_t best = 0;
        for (int32_t i = 0; i < vocab; i++) {
            mx = fmax(mx, fabs(want[i]));
            d = fmax(d, fabs(logits[i] - want[i]));
            if (want[i] > want[best])
                best = i;
        }
        worst = fmax(worst, d / mx);
        if (d > 1e-4 * mx)
            fail_msg("%s: step %d: logits off by %g (largest %g)", what, step, d, mx);
        assert_int_equal(next, best);
        seq[n++] = next;
    }
    print_message("%s: 8 steps match the float64 reference (worst %.2e)\n", what, worst);
    free(logits);
    free(want);
    free(pool);
    kvf_model_fwd_destroy(f);
    kvf_backend_destroy(be, ctx);
    kvf_model_destroy(m);
    remove_dir();
}

static void check_against_reference(const kvf_model_config *c, kvf_dtype wdt, const char *what)
{
    check_against_reference_opts(c, wdt, false, what);
}

static void test_llama_plain_f16_weights(void **state)
{
    kvf_model_config c = base_config(KVF_MODEL_ARCH_LLAMA);
    check_against_reference(&c, KVF_DTYPE_F16, "llama, f16 weights");
    c.qkv_bias = c.o_bias = c.mlp_bias = true;
    check_against_reference_opts(&c, KVF_DTYPE_F16, true, "llama, biases, f16 weights kept f16");
    check_against_reference_opts(&c, KVF_DTYPE_BF16, true, "llama, biases, bf16 weights kept bf16");
}

static void test_qwen2_qkv_bias_tied(void **state)
{
    kvf_model_config c = base_config(KVF_MODEL_ARCH_QWEN2);
    c.qkv_bias = true;
    c.tie_embeddings = true;
    check_against_reference(&c, KVF_DTYPE_F32, "qwen2, q/k/v bias, tied");
}

static void test_llama_all_biases(void **state)
{
    kvf_model_config c = base_config(KVF_MODEL_ARCH_LLAMA);
    c.qkv_bias = c.o_bias = c.mlp_bias = true;
    check_against_reference(&c, KVF_DTYPE_BF16, "llama, attention_bias + mlp_bias, bf16");
}

static void test_mistral_sliding_window(void **state)
{
    kvf_model_config c = base_config(KVF_MODEL_ARCH_MISTRAL);
    c.sliding_window = 5;
    check_against_reference(&c, KVF_DTYPE_F32, "mistral, sliding window 5");
}

static void test_qwen2_window_from_layer(void **state)
{
    kvf_model_config c = base_config(KVF_MODEL_ARCH_QWEN2);
    c.qkv_bias = true;
    c.sliding_window = 3;
    c.window_first_layer = 1;
    check_against_reference(&c, KVF_DTYPE_F32, "qwen2, window 3 from layer 1");
}

static void test_llama3_rope_scaling(void **state)
{
    kvf_model_config c = base_config(KVF_MODEL_ARCH_LLAMA);
    c.rope_theta = 500000.0;
    c.rope_scaling = KVF_MODEL_ROPE_LLAMA3;
    c.rope_factor = 8.0;
    c.rope_low_freq_factor = 1.0;
    c.rope_high_freq_factor = 4.0;
    c.rope_orig_max_pos = 64; /* small, so all three frequency bands occur at head_dim 16 */
    check_against_reference(&c, KVF_DTYPE_F32, "llama3 rope scaling");
    c.rope_scaling = KVF_MODEL_ROPE_LINEAR;
    c.rope_factor = 4.0;
    c.rope_orig_max_pos = 0; /* linear scaling has no original length */
    check_against_reference(&c, KVF_DTYPE_F32, "linear rope scaling");
}

/* The config.c frequencies against the independent formula, on Llama-3.1-8B's settings. */
static void test_rope_freqs_llama3(void **state)
{
    kvf_model_config c = {.head_dim = 128, .rope_theta = 500000.0, .rope_scaling = KVF_MODEL_ROPE_LLAMA3,
                          .rope_factor = 8.0, .rope_low_freq_factor = 1.0, .rope_high_freq_factor = 4.0,
                          .rope_orig_max_pos = 8192};
    double f[64], ps;
    kvf_model_config_rope_freqs(&c, f, &ps);
    assert_true(ps == 1.0);
    assert_true(f[0] == 1.0);                                            /* high band unchanged */
    assert_true(fabs(f[63] - pow(500000.0, -126.0 / 128) / 8) < 1e-18); /* low band / factor */
    int n_smooth = 0;
    for (int i = 0; i < 64; i++) {
        assert_true(fabs(f[i] - ref_freq(&c, i)) <= 1e-12 * ref_freq(&c, i));
        double plain = pow(500000.0, -2.0 * i / 128);
        if (f[i] < plain && f[i] > plain / 8)
            n_smooth++;
    }
    assert_true(n_smooth > 0);
}

/* The forward pass refuses a layout that does not fit the model; fp8 KV is accepted. */
static void test_layout_mismatch(void **state)
{
    make_dir();
    kvf_model_config c = base_config(KVF_MODEL_ARCH_LLAMA);
    kvf_model *m = write_and_load(&c, KVF_DTYPE_F32);
    kvf_err err = {0};
    const kvf_backend *be = kvf_model_backend_cpu();
    void *ctx;
    assert_int_equal(kvf_backend_create(be, &(kvf_backend_opts){.n_threads = 1}, &ctx, &err), KVF_OK);
    kvf_kv_layout lay;
    kvf_model_fwd *f = NULL;
    kvf_model_fwd_opts o = {.max_tokens = 8, .max_seqs = 2};
    assert_int_equal(kvf_kv_layout_init(3, 2, 16, 16, KVF_DTYPE_F32, &lay, &err), KVF_OK);
    assert_int_equal(kvf_model_fwd_create(m, be, ctx, &lay, &o, &f, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "does not match"));
    assert_int_equal(kvf_model_kv_layout(m, 16, KVF_DTYPE_FP8_E4M3, &lay, &err), KVF_OK);
    assert_int_equal(kvf_model_fwd_create(m, be, ctx, &lay, &o, &f, &err), KVF_OK);
    kvf_model_fwd_destroy(f);
    f = NULL;
    assert_int_equal(kvf_model_kv_layout(m, 16, KVF_DTYPE_F32, &lay, &err), KVF_OK);
    o.max_seqs = 9;
    assert_int_equal(kvf_model_fwd_create(m, be, ctx, &lay, &o, &f, &err), KVF_ERR_INVALID);
    assert_null(f);
    kvf_backend_destroy(be, ctx);
    kvf_model_destroy(m);
    remove_dir();
}

/* Backend ops on small inputs with known answers. */
static void test_cpu_ops(void **state)
{
    const kvf_backend *be = kvf_model_backend_cpu();
    void *ctx;
    kvf_err err = {0};
    assert_int_equal(kvf_backend_create(be, &(kvf_backend_opts){.n_threads = 2}, &ctx, &err), KVF_OK);
    float W[6] = {1, 2, 3, 4, 5, 6}, bias[2] = {10, 20}, x[6] = {1, 0, -1, 2, 1, 0}, y[4];
    kvf_backend_weight w = {.data = W, .rows = 2, .cols = 3, .dtype = KVF_DTYPE_F32};
    kvf_backend_weight b = {.data = bias, .rows = 1, .cols = 2, .dtype = KVF_DTYPE_F32};
    kvf_backend_matmul(be, ctx, x, 2, &w, &b, y); /* rows: [1,0,-1], [2,1,0] */
    assert_true(y[0] == 10 - 2 && y[1] == 20 - 2 && y[2] == 10 + 4 && y[3] == 20 + 13);
    kvf_backend_matmul(be, ctx, x, 1, &w, NULL, y);
    assert_true(y[0] == -2 && y[1] == -2);
    float lg[6] = {1, 3, 3, -1, -2, -0.5f};
    int32_t am[2];
    kvf_backend_argmax(be, ctx, lg, 2, 3, am);
    assert_int_equal(am[0], 1); /* ties to the lowest id */
    assert_int_equal(am[1], 2);
    float g[2] = {0, 2}, u[2] = {5, 3}, o[2];
    kvf_backend_swiglu(be, ctx, g, u, 2, o);
    assert_true(o[0] == 0 && fabsf(o[1] - 2.0f / (1 + expf(-2)) * 3) < 1e-6f);
    /* a weight from a bf16 tensor becomes f32 */
    uint8_t raw[4] = {0x80, 0x3f, 0x00, 0xc0}; /* 1.0, -2.0 */
    kvf_model_tensor t = {.name = "t", .dtype = KVF_DTYPE_BF16, .dtype_name = "BF16", .n_dims = 1,
                          .shape = {2}, .n_elems = 2, .n_bytes = 4, .data = raw};
    kvf_backend_weight wb;
    assert_int_equal(kvf_backend_weight_load(be, ctx, &t, &wb, &err), KVF_OK);
    assert_true(((const float *)wb.data)[0] == 1.0f && ((const float *)wb.data)[1] == -2.0f);
    kvf_backend_weight_unload(be, ctx, &wb);
    t.dtype = -1;
    snprintf(t.dtype_name, sizeof t.dtype_name, "I64");
    assert_int_equal(kvf_backend_weight_load(be, ctx, &t, &wb, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "I64"));
    kvf_backend_destroy(be, ctx);
    assert_int_equal(kvf_backend_create(be, &(kvf_backend_opts){.n_threads = -3}, &ctx, &err), KVF_ERR_INVALID);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_plain_f16_weights),
        cmocka_unit_test(test_qwen2_qkv_bias_tied),
        cmocka_unit_test(test_llama_all_biases),
        cmocka_unit_test(test_mistral_sliding_window),
        cmocka_unit_test(test_qwen2_window_from_layer),
        cmocka_unit_test(test_llama3_rope_scaling),
        cmocka_unit_test(test_rope_freqs_llama3),
        cmocka_unit_test(test_layout_mismatch),
        cmocka_unit_test(test_cpu_ops),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
