/* test_backend_defaults.c: the defaults the kvf_backend_* wrappers (model/backend.c) give a
 * backend whose optional ops are all NULL: host KV memory, everything supported, nothing to wait
 * for or record, draws refused naming the backend, matmul_multi as matmul calls, the host clock.
 * Host only: a bare copy of the CPU backend that counts its matmul calls. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "model/backend_impl.h" /* the double clears every optional op */
#include "model/forward.h"
#include "model/model.h"
#include "testutil.h"

static int n_matmul;
static kvf_backend bare;

static void bare_matmul(void *ctx, const float *x, int64_t n, const kvf_backend_weight *w,
                        const kvf_backend_weight *bias, float *y)
{
    n_matmul++;
    kvf_backend_matmul(kvf_model_backend_cpu(), ctx, x, n, w, bias, y);
}

/* The CPU backend's required ops, every optional one NULL (whatever the CPU backend may gain). */
static const kvf_backend *bare_backend(void)
{
    bare = (kvf_backend){0};
    const kvf_backend *cpu = kvf_model_backend_cpu();
    bare.name = "cpu-bare";
    bare.create = cpu->create;
    bare.destroy = cpu->destroy;
    bare.alloc = cpu->alloc;
    bare.free = cpu->free;
    bare.upload = cpu->upload;
    bare.download = cpu->download;
    bare.weight_load = cpu->weight_load;
    bare.weight_unload = cpu->weight_unload;
    bare.embed = cpu->embed;
    bare.matmul = bare_matmul;
    bare.rmsnorm = cpu->rmsnorm;
    bare.rope = cpu->rope;
    bare.swiglu = cpu->swiglu;
    bare.add = cpu->add;
    bare.gather = cpu->gather;
    bare.kv_write = cpu->kv_write;
    bare.attention = cpu->attention;
    bare.argmax = cpu->argmax;
    n_matmul = 0;
    return &bare;
}

typedef struct rig {
    kvf_model *m;
    const kvf_backend *be;
    void *ctx;
    kvf_kv_layout layout;
    kvf_model_fwd *fwd;
    uint8_t *pool;
} rig;

#define RIG_POOL 16

static void rig_open(rig *r, kvf_model *m, const kvf_backend *be)
{
    kvf_err err = {0};
    memset(r, 0, sizeof *r);
    r->m = m;
    r->be = be;
    kvf_backend_opts bo = {.n_threads = 2};
    assert_int_equal(kvf_backend_create(be, &bo, &r->ctx, &err), KVF_OK);
    assert_int_equal(kvf_model_kv_layout(m, 16, KVF_DTYPE_F32, &r->layout, &err), KVF_OK);
    kvf_model_fwd_opts o = {.max_tokens = 32, .max_seqs = 2, .max_ctx = 128};
    if (kvf_model_fwd_create(m, be, r->ctx, &r->layout, &o, &r->fwd, &err) != KVF_OK)
        fail_msg("%s: %s", kvf_backend_name(be), err.msg);
    r->pool = calloc(RIG_POOL, (size_t)r->layout.block_bytes);
    assert_non_null(r->pool);
}

static void rig_close(rig *r)
{
    kvf_model_fwd_destroy(r->fwd);
    kvf_backend_destroy(r->be, r->ctx);
    free(r->pool);
}

static kvf_model *load_model(void)
{
    kvf_model *m = NULL;
    kvf_err err = {0};
    if (kvf_model_load(kvf_test_shared_path("fixtures/models/tiny-gqa-f32"), &m, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    return m;
}

/* Each optional wrapper on its own: what the default is, and that it asks nothing of the
 * backend it does not have. */
static void test_wrapper_defaults(void **state)
{
    const kvf_backend *be = bare_backend();
    kvf_err err = {0};
    void *ctx = NULL;
    /* q8 weights: refused by name where the backend has no q8 kernels (q8_weights left out, as
     * CUDA does), and by the CPU backend together with half weights; unknown values refused */
    kvf_backend_opts q8 = {.n_threads = 1, .weight_dtype = KVF_BACKEND_WEIGHT_Q8};
    assert_int_equal(kvf_backend_create(be, &q8, &ctx, &err), KVF_ERR_UNSUPPORTED);
    assert_null(ctx);
    assert_non_null(strstr(err.msg, "--weight-dtype q8"));
    assert_non_null(strstr(err.msg, "cpu-bare"));
    q8.half_weights = true;
    assert_int_equal(kvf_backend_create(kvf_model_backend_cpu(), &q8, &ctx, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "--half-weights"));
    q8 = (kvf_backend_opts){.n_threads = 1, .weight_dtype = KVF_BACKEND_WEIGHT_COUNT};
    assert_int_equal(kvf_backend_create(kvf_model_backend_cpu(), &q8, &ctx, &err), KVF_ERR_INVALID);
    assert_int_equal(kvf_backend_weight_dtype_parse("q8"), KVF_BACKEND_WEIGHT_Q8);
    assert_int_equal(kvf_backend_weight_dtype_parse("f32"), KVF_BACKEND_WEIGHT_F32);
    assert_int_equal(kvf_backend_weight_dtype_parse("q4"), -1);
    assert_int_equal(kvf_backend_weight_dtype_parse(NULL), -1);

    assert_int_equal(kvf_backend_create(be, &(kvf_backend_opts){.n_threads = 1}, &ctx, &err), KVF_OK);
    assert_string_equal(kvf_backend_name(be), "cpu-bare");

    assert_null(kvf_backend_kv_mem(be, ctx)); /* host memory (kvf_kv_pool_cfg.mem NULL) */
    kvf_kv_layout l;
    assert_int_equal(kvf_kv_layout_init(2, 2, 15, 16, KVF_DTYPE_F16, &l, &err), KVF_OK);
    assert_int_equal(kvf_backend_supports(be, ctx, &l, 3, &err), KVF_OK);
    assert_int_equal(kvf_backend_sync(be, ctx, &err), KVF_OK);
    assert_int_equal(kvf_backend_sync(be, ctx, NULL), KVF_OK);

    bool replay = true, rerun = true; /* the defaults write false, not leave them */
    kvf_backend_step_key key = {.n_tokens = 1, .n_seqs = 1, .ctx_bucket = 64, .decode_only = true};
    assert_int_equal(kvf_backend_step_begin(be, ctx, &key, &replay, &err), KVF_OK);
    assert_false(replay);
    assert_int_equal(kvf_backend_step_end(be, ctx, &rerun, &err), KVF_OK);
    assert_false(rerun);

    assert_false(kvf_backend_can_sample(be));
    float logits[4] = {0.5f, 2.0f, -1.0f, 2.0f};
    kvf_backend_sample_row row = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .u = 0.5f};
    int32_t tok = -7;
    err = (kvf_err){0};
    assert_int_equal(kvf_backend_sample(be, ctx, logits, 1, 4, &row, &tok, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "cpu-bare"));
    assert_int_equal(tok, -7); /* untouched */

    assert_false(kvf_backend_has_prof_clock(be));
    kvf_backend_prof_mark(be, ctx, 0); /* nothing to do */
    double ms[2] = {-1, -1};
    err = (kvf_err){0};
    assert_int_equal(kvf_backend_prof_read(be, ctx, 3, ms, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "cpu-bare"));
    assert_true(ms[0] == -1 && ms[1] == -1);

    /* matmul_multi: one matmul call per matrix, each output as its own matmul's bit for bit */
    enum { N = 3, C = 5 };
    float wd[3][2 * C], bd[2] = {0.25f, -0.5f}, x[N * C], y[3][N * 2], want[N * 2];
    for (int i = 0; i < 3 * 2 * C; i++)
        wd[i / (2 * C)][i % (2 * C)] = (float)((i * 7) % 11) / 8.0f - 0.6f;
    for (int i = 0; i < N * C; i++)
        x[i] = (float)((i * 5) % 13) / 4.0f - 1.5f;
    kvf_backend_weight w[3], b = {.data = bd, .rows = 1, .cols = 2, .dtype = KVF_DTYPE_F32};
    for (int i = 0; i < 3; i++)
        w[i] = (kvf_backend_weight){.data = wd[i], .rows = 2, .cols = C, .dtype = KVF_DTYPE_F32};
    n_matmul = 0;
    kvf_backend_matmul_multi(be, ctx, x, N, 3,
                             (const kvf_backend_weight *const[]){&w[0], &w[1], &w[2]},
                             (const kvf_backend_weight *const[]){NULL, &b, NULL},
                             (float *const[]){y[0], y[1], y[2]});
    assert_int_equal(n_matmul, 3);
    for (int i = 0; i < 3; i++) {
        kvf_backend_matmul(kvf_model_backend_cpu(), ctx, x, N, &w[i], i == 1 ? &b : NULL, want);
        assert_memory_equal(y[i], want, sizeof want);
    }

    kvf_backend_destroy(be, ctx);
    kvf_backend_destroy(be, NULL); /* nothing to destroy */
}

/* The forward pass over the bare backend: the CPU backend's logits and tokens bit for bit, q/k/v
 * and gate/up as matmul calls (7 a layer and the LM head), a draw on the backend refused naming
 * it, and a profile on the host clock. */
static void test_forward_on_defaults(void **state)
{
    kvf_model *m = load_model();
    const int32_t L = m->cfg.n_layers, V = m->cfg.vocab_size;
    rig b, c;
    rig_open(&b, m, bare_backend());
    rig_open(&c, m, kvf_model_backend_cpu());
    assert_false(kvf_model_fwd_samples(b.fwd));

    float *lb = malloc((size_t)V * sizeof *lb), *lc = malloc((size_t)V * sizeof *lc);
    int32_t table[3] = {5, 0, 9}, toks[6] = {5, 9, 11, 200, 7, 3}, nb = -1, nc = -2;
    kvf_err err = {0};
    kvf_model_seq s = {.tokens = toks, .n_tokens = 5, .start_pos = 0, .block_table = table, .n_blocks = 1};
    kvf_model_seq d = {.tokens = &toks[5], .n_tokens = 1, .start_pos = 5, .block_table = table, .n_blocks = 1};
    const kvf_model_seq *steps[2] = {&s, &d};
    for (int i = 0; i < 2; i++) {
        n_matmul = 0;
        assert_int_equal(kvf_model_forward(b.fwd, steps[i], 1, b.pool, RIG_POOL, lb, &nb, &err), KVF_OK);
        assert_int_equal(n_matmul, 7 * L + 1);
        assert_int_equal(kvf_model_forward(c.fwd, steps[i], 1, c.pool, RIG_POOL, lc, &nc, &err), KVF_OK);
        assert_memory_equal(lb, lc, (size_t)V * sizeof *lb);
        assert_int_equal(nb, nc);
    }

    /* a draw on the backend: refused before the step, naming the sequence and the backend */
    kvf_backend_sample_row row = {.temperature = 0.8f, .top_k = 0, .top_p = 1.0f, .u = 0.3f};
    kvf_model_seq q = d;
    q.sample = &row;
    q.start_pos = 6;
    err = (kvf_err){0};
    n_matmul = 0;
    assert_int_equal(kvf_model_forward(b.fwd, &q, 1, b.pool, RIG_POOL, NULL, &nb, &err),
                     KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "sequence 0"));
    assert_non_null(strstr(err.msg, "cpu-bare"));
    assert_int_equal(n_matmul, 0);

    /* a profile on the host clock: every op kind has calls, the answer is unchanged */
    kvf_model_fwd_prof p = {0};
    assert_int_equal(kvf_model_fwd_set_prof(b.fwd, &p, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(b.fwd, &d, 1, b.pool, RIG_POOL, lb, &nb, &err), KVF_OK);
    assert_memory_equal(lb, lc, (size_t)V * sizeof *lb);
    assert_int_equal(p.steps[0], 1);
    for (int op = 0; op < KVF_FWD_OP_COUNT; op++)
        assert_true(p.op_calls[0][op] > 0 && p.op_ms[0][op] >= 0);

    free(lb);
    free(lc);
    rig_close(&b);
    rig_close(&c);
    kvf_model_destroy(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrapper_defaults),
        cmocka_unit_test(test_forward_on_defaults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
