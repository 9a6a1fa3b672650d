/* test_backend_hooks.c: the optional parts of kvf_backend as the forward pass uses them (the
 * supports check at load, sync at the end of a step, step_begin/step_end around the ops, step
 * profile marks), and
 * the CPU backend's fp8-e4m3 KV with per-tensor scales (round trip, saturation, attention and a
 * fixture model against f32 KV). Host only: a wrapper over the CPU backend counts calls. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/backend_impl.h" /* the double fills in optional ops */
#include "model/forward.h"
#include "model/model.h"
#include "testutil.h"

/* ---- a CPU backend with hooks, counting what the forward pass calls */

static struct {
    int supports, sync, begin, end, matmul;
    int marks, next_mark, reads, bad_marks; /* prof_mark calls; the index due next; prof_read */
    int multi, multi_mats;                  /* matmul_multi calls and their matrices */
    kvf_status supports_st, sync_st;
    bool replay, rerun;
    kvf_backend_step_key last_key;
} H;

static kvf_backend hooked;

static kvf_status h_supports(void *ctx, const kvf_kv_layout *l, int32_t n_heads, kvf_err *err)
{
    H.supports++;
    if (H.supports_st != KVF_OK)
        return kvf_err_set(err, H.supports_st, "test: head_dim %d is not supported (use 64 or 128)", l->head_dim);
    return KVF_OK;
}

static kvf_status h_sync(void *ctx, kvf_err *err)
{
    H.sync++;
    if (H.sync_st != KVF_OK)
        return kvf_err_set(err, H.sync_st, "test: a launch failed");
    return KVF_OK;
}

static kvf_status h_begin(void *ctx, const kvf_backend_step_key *key, bool *replay, kvf_err *err)
{
    H.begin++;
    H.last_key = *key;
    *replay = H.replay;
    return KVF_OK;
}

static kvf_status h_end(void *ctx, bool *rerun, kvf_err *err)
{
    H.end++;
    *rerun = H.rerun;
    return KVF_OK;
}

static void h_matmul(void *ctx, const float *x, int64_t n, const kvf_backend_weight *w,
                     const kvf_backend_weight *bias, float *y)
{
    H.matmul++;
    kvf_backend_matmul(kvf_model_backend_cpu(), ctx, x, n, w, bias, y);
}

static void h_matmul_multi(void *ctx, const float *x, int64_t n, int32_t count,
                           const kvf_backend_weight *const *w, const kvf_backend_weight *const *b,
                           float *const *y)
{
    H.multi++;
    H.multi_mats += count;
    for (int32_t i = 0; i < count; i++)
        kvf_backend_matmul(kvf_model_backend_cpu(), ctx, x, n, w[i], b[i], y[i]);
}

static void h_prof_mark(void *ctx, int32_t i)
{
    H.marks++;
    if (i != H.next_mark++)
        H.bad_marks++;
}

/* mark i to i + 1 took i + 1 ms */
static kvf_status h_prof_read(void *ctx, int32_t n, double *ms, kvf_err *err)
{
    H.reads++;
    if (n != H.next_mark)
        return kvf_err_set(err, KVF_ERR_INTERNAL, "test: %d marks read, %d made", n, H.next_mark);
    for (int32_t i = 0; i + 1 < n; i++)
        ms[i] = i + 1;
    H.next_mark = 0;
    return KVF_OK;
}

static const kvf_backend *hooked_backend(void)
{
    hooked = *kvf_model_backend_cpu();
    hooked.name = "cpu-hooked";
    hooked.supports = h_supports;
    hooked.sync = h_sync;
    hooked.step_begin = h_begin;
    hooked.step_end = h_end;
    hooked.matmul = h_matmul;
    hooked.prof_mark = h_prof_mark;
    hooked.prof_read = h_prof_read;
    memset(&H, 0, sizeof H);
    return &hooked;
}

typedef struct rig {
    kvf_model *m;
    const kvf_backend *be;
    void *ctx;
    kvf_kv_layout layout;
    kvf_model_fwd *fwd;
    uint8_t *pool;
} rig;

#define RIG_POOL 32

static kvf_status rig_open(rig *r, const char *model, const kvf_backend *be, kvf_dtype kv,
                           float ks, float vs, kvf_err *err)
{
    memset(r, 0, sizeof *r);
    char rel[256];
    snprintf(rel, sizeof rel, "fixtures/models/%s", model);
    if (kvf_model_load(kvf_test_shared_path(rel), &r->m, err) != KVF_OK)
        fail_msg("%s", err->msg);
    r->be = be;
    kvf_backend_opts bo = {.n_threads = 2, .kv_k_scale = ks, .kv_v_scale = vs};
    assert_int_equal(kvf_backend_create(be, &bo, &r->ctx, err), KVF_OK);
    assert_int_equal(kvf_model_kv_layout(r->m, 16, kv, &r->layout, err), KVF_OK);
    kvf_model_fwd_opts o = {.max_tokens = 64, .max_seqs = 4, .max_ctx = 256};
    r->pool = calloc(RIG_POOL, (size_t)r->layout.block_bytes);
    return kvf_model_fwd_create(r->m, be, r->ctx, &r->layout, &o, &r->fwd, err);
}

static void rig_close(rig *r)
{
    kvf_model_fwd_destroy(r->fwd);
    kvf_backend_destroy(r->be, r->ctx);
    kvf_model_destroy(r->m);
    free(r->pool);
}

/* supports refuses: the forward pass refuses at load, with the backend's message */
static void test_supports_refusal(void **state)
{
    const kvf_backend *be = hooked_backend();
    H.supports_st = KVF_ERR_UNSUPPORTED;
    rig r;
    kvf_err err = {0};
    kvf_status st = rig_open(&r, "tiny-gqa-f32", be, KVF_DTYPE_F32, 0, 0, &err);
    assert_int_equal(st, KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "head_dim 16 is not supported"));
    assert_null(r.fwd);
    assert_int_equal(H.supports, 1);
    rig_close(&r);
}

/* the hooks run once per step in order; replay skips the ops, rerun issues them again; the
 * sync's error is the step's */
static void test_step_hooks(void **state)
{
    const kvf_backend *be = hooked_backend();
    rig r;
    kvf_err err = {0};
    assert_int_equal(rig_open(&r, "tiny-gqa-f32", be, KVF_DTYPE_F32, 0, 0, &err), KVF_OK);
    assert_int_equal(H.supports, 1);
    int32_t table[4] = {3, 1, 2, 0}, toks[5] = {5, 9, 11, 200, 7}, next = -1;
    kvf_model_seq s = {.tokens = toks, .n_tokens = 5, .start_pos = 0, .block_table = table, .n_blocks = 4};
    assert_int_equal(kvf_model_forward(r.fwd, &s, 1, r.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_int_equal(H.begin, 1);
    assert_int_equal(H.end, 1);
    assert_int_equal(H.sync, 1);
    assert_false(H.last_key.decode_only);
    assert_int_equal(H.last_key.n_tokens, 5);
    assert_int_equal(H.last_key.n_seqs, 1);
    assert_int_equal(H.last_key.ctx_bucket, 64);
    assert_ptr_equal(H.last_key.kv_pool, r.pool);
    int per_step = H.matmul; /* 7 per layer + the LM head */
    assert_int_equal(per_step, 7 * r.m->cfg.n_layers + 1);

    /* a decode step at position 70: bucket 128 */
    kvf_model_seq d = {.tokens = &toks[4], .n_tokens = 1, .start_pos = 70, .block_table = table, .n_blocks = 5};
    int32_t table5[5] = {3, 1, 2, 0, 4};
    d.block_table = table5;
    assert_int_equal(kvf_model_forward(r.fwd, &d, 1, r.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_true(H.last_key.decode_only);
    assert_int_equal(H.last_key.ctx_bucket, 128);
    assert_int_equal(H.matmul, 2 * per_step);

    H.replay = true; /* the backend replays: no op is issued */
    assert_int_equal(kvf_model_forward(r.fwd, &d, 1, r.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_int_equal(H.matmul, 2 * per_step);
    H.replay = false;
    H.rerun = true; /* recording failed: the ops run twice (recorded try, then for real) */
    assert_int_equal(kvf_model_forward(r.fwd, &d, 1, r.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_int_equal(H.matmul, 4 * per_step);
    H.rerun = false;
    assert_int_equal(H.begin, 4);
    assert_int_equal(H.end, 4);

    H.sync_st = KVF_ERR_INTERNAL; /* the step's error comes from sync */
    kvf_status st = kvf_model_forward(r.fwd, &d, 1, r.pool, RIG_POOL, NULL, &next, &err);
    assert_int_equal(st, KVF_ERR_INTERNAL);
    assert_non_null(strstr(err.msg, "a launch failed"));
    rig_close(&r);
}

/* A profile: marks in order, 12 per layer and 5 per step; each op kind's calls; the backend's
 * times go to the kinds that start each interval; no step is recorded while it runs; the
 * answer is the same. Without prof_mark (the plain CPU backend) the host clock times it. */
static void test_profile(void **state)
{
    const kvf_backend *be = hooked_backend();
    rig r;
    kvf_err err = {0};
    assert_int_equal(rig_open(&r, "tiny-gqa-f32", be, KVF_DTYPE_F32, 0, 0, &err), KVF_OK);
    const int32_t L = r.m->cfg.n_layers, V = r.m->cfg.vocab_size;
    int32_t table[5] = {3, 1, 2, 0, 4}, toks[5] = {5, 9, 11, 200, 7}, next = -1;
    kvf_model_seq s = {.tokens = toks, .n_tokens = 5, .start_pos = 0, .block_table = table, .n_blocks = 4};
    kvf_model_seq d = {.tokens = &toks[4], .n_tokens = 1, .start_pos = 5, .block_table = table, .n_blocks = 1};
    float *plain = malloc((size_t)V * sizeof *plain), *prof_l = malloc((size_t)V * sizeof *prof_l);
    assert_int_equal(kvf_model_forward(r.fwd, &s, 1, r.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(r.fwd, &d, 1, r.pool, RIG_POOL, plain, &next, &err), KVF_OK);
    assert_int_equal(H.marks, 0);
    assert_int_equal(H.begin, 2);

    kvf_model_fwd_prof p = {0};
    assert_int_equal(kvf_model_fwd_set_prof(r.fwd, &p, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(r.fwd, &s, 1, r.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(r.fwd, &d, 1, r.pool, RIG_POOL, prof_l, &next, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(r.fwd, &d, 1, r.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_memory_equal(plain, prof_l, (size_t)V * sizeof *plain);
    assert_int_equal(H.begin, 2); /* nothing recorded while profiling */
    assert_int_equal(H.end, 2);
    const int n = 12 * L + 5;
    assert_int_equal(H.marks, 3 * n);
    assert_int_equal(H.bad_marks, 0);
    assert_int_equal(H.reads, 3);
    assert_int_equal(p.steps[1], 1); /* the 5-token prefill */
    assert_int_equal(p.steps[0], 2);
    for (int k = 0; k < 2; k++) {
        const int64_t st = p.steps[k];
        assert_int_equal(p.op_calls[k][KVF_FWD_OP_UPLOAD], st);
        assert_int_equal(p.op_calls[k][KVF_FWD_OP_EMBED], st);
        assert_int_equal(p.op_calls[k][KVF_FWD_OP_NORM], 2 * L * st);
        assert_int_equal(p.op_calls[k][KVF_FWD_OP_ADD], 2 * L * st);
        for (int op = KVF_FWD_OP_QKV; op <= KVF_FWD_OP_DOWN; op++)
            if (op != KVF_FWD_OP_ADD)
                assert_int_equal(p.op_calls[k][op], L * st);
        assert_int_equal(p.op_calls[k][KVF_FWD_OP_LM_HEAD], st);
        assert_int_equal(p.op_calls[k][KVF_FWD_OP_OUTPUT], st);
        /* intervals 1 .. n-1 ms per step; upload is the first (1 ms), output the last */
        assert_true(fabs(kvf_model_fwd_prof_ms(&p, k) - st * (n - 1) * n / 2.0) < 1e-9);
        assert_true(fabs(p.op_ms[k][KVF_FWD_OP_UPLOAD] - st * 1.0) < 1e-9);
        assert_true(fabs(p.op_ms[k][KVF_FWD_OP_OUTPUT] - st * (n - 1.0)) < 1e-9);
        assert_true(fabs(p.op_ms[k][KVF_FWD_OP_EMBED] - st * 2.0) < 1e-9);
        assert_true(p.wall_ms[k] > 0);
    }
    assert_int_equal(kvf_model_fwd_set_prof(r.fwd, NULL, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(r.fwd, &d, 1, r.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_int_equal(H.marks, 3 * n);
    assert_int_equal(H.begin, 3);
    rig_close(&r);

    /* the host clock: every op kind timed, the ops within the call */
    rig c;
    assert_int_equal(rig_open(&c, "tiny-gqa-f32", kvf_model_backend_cpu(), KVF_DTYPE_F32, 0, 0, &err), KVF_OK);
    kvf_model_fwd_prof q = {0};
    assert_int_equal(kvf_model_fwd_set_prof(c.fwd, &q, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(c.fwd, &s, 1, c.pool, RIG_POOL, NULL, &next, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(c.fwd, &d, 1, c.pool, RIG_POOL, prof_l, &next, &err), KVF_OK);
    assert_memory_equal(plain, prof_l, (size_t)V * sizeof *plain);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(q.steps[k], 1);
        for (int op = 0; op < KVF_FWD_OP_COUNT; op++) {
            assert_true(q.op_ms[k][op] >= 0);
            assert_true(q.op_calls[k][op] > 0);
        }
        const double ms = kvf_model_fwd_prof_ms(&q, k); /* within the call's own time */
        assert_true(ms > 0 && ms <= q.wall_ms[k] + 1e-6);
    }
    assert_string_equal(kvf_fwd_op_name(KVF_FWD_OP_GATE_UP), "gate_up_proj");
    assert_string_equal(kvf_fwd_op_name(KVF_FWD_OP_COUNT), "?");
    rig_close(&c);
    free(plain);
    free(prof_l);
}

/* With matmul_multi the forward pass hands it q/k/v and gate/up (2 calls, 5 matrices a layer)
 * and the rest to matmul; the logits are the same as without it. */
static void test_matmul_multi(void **state)
{
    const kvf_backend *be = hooked_backend();
    rig r;
    kvf_err err = {0};
    assert_int_equal(rig_open(&r, "tiny-gqa-f32", be, KVF_DTYPE_F32, 0, 0, &err), KVF_OK);
    const int32_t L = r.m->cfg.n_layers, V = r.m->cfg.vocab_size;
    int32_t table[4] = {3, 1, 2, 0}, toks[5] = {5, 9, 11, 200, 7}, next = -1;
    kvf_model_seq s = {.tokens = toks, .n_tokens = 5, .start_pos = 0, .block_table = table, .n_blocks = 4};
    float *with = malloc((size_t)V * sizeof *with), *without = malloc((size_t)V * sizeof *without);
    hooked.matmul_multi = h_matmul_multi;
    assert_int_equal(kvf_model_forward(r.fwd, &s, 1, r.pool, RIG_POOL, with, &next, &err), KVF_OK);
    assert_int_equal(H.multi, 2 * L);
    assert_int_equal(H.multi_mats, 5 * L);
    assert_int_equal(H.matmul, 2 * L + 1); /* o_proj, down_proj, the LM head */
    hooked.matmul_multi = NULL;
    assert_int_equal(kvf_model_forward(r.fwd, &s, 1, r.pool, RIG_POOL, without, &next, &err), KVF_OK);
    assert_int_equal(H.multi, 2 * L);
    assert_int_equal(H.matmul, 2 * L + 1 + 7 * L + 1);
    assert_memory_equal(with, without, (size_t)V * sizeof *with);
    free(with);
    free(without);
    rig_close(&r);
}

/* ---- fp8 KV with scales on the CPU backend */

static float rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

static void test_fp8_scale_round_trip(void **state)
{
    const kvf_backend *be = kvf_model_backend_cpu();
    kvf_err err = {0};
    kvf_kv_layout l;
    assert_int_equal(kvf_kv_layout_init(2, 2, 16, 16, KVF_DTYPE_FP8_E4M3, &l, &err), KVF_OK);
    uint8_t *pool = calloc(4, (size_t)l.block_bytes);
    int64_t slots[3] = {5, 16 + 15, 48};
    float k[3 * 32], v[3 * 32];
    uint64_t seed = 7;
    for (int i = 0; i < 96; i++) {
        k[i] = rnd(&seed) * 20.0f;  /* up to 20: 400 after / 0.05, inside e4m3's 448 */
        v[i] = rnd(&seed) * 1500.0f; /* beyond 448 without a scale */
    }
    float ks[2] = {0.05f, 1.0f}, vs[2] = {4.0f, 0.0f};
    for (int run = 0; run < 2; run++) {
        void *ctx;
        kvf_backend_opts bo = {.n_threads = 1, .kv_k_scale = ks[run], .kv_v_scale = vs[run]};
        assert_int_equal(kvf_backend_create(be, &bo, &ctx, &err), KVF_OK);
        kvf_backend_kv_write(be, ctx, pool, &l, 1, k, v, slots, 3);
        float kscale = ks[run], vscale = vs[run] > 0 ? vs[run] : 1.0f;
        int saturated = 0;
        for (int t = 0; t < 3; t++)
            for (int h = 0; h < 2; h++)
                for (int d = 0; d < 16; d++) {
                    int64_t b = slots[t] / 16, off = slots[t] % 16;
                    const uint8_t *kb = pool + kvf_kv_offset(&l, b, 1, KVF_KV_K, h, (int32_t)off);
                    const uint8_t *vb = pool + kvf_kv_offset(&l, b, 1, KVF_KV_V, h, (int32_t)off);
                    float kw = k[t * 32 + h * 16 + d], vw = v[t * 32 + h * 16 + d];
                    float kg = kvf_fp8e4m3_to_f32(kb[d]) * kscale, vg = kvf_fp8e4m3_to_f32(vb[d]) * vscale;
                    /* e4m3: 3 mantissa bits, so within 1/16 relative (plus the subnormal step) */
                    if (fabsf(kw) <= 448.0f * kscale)
                        assert_true(fabsf(kg - kw) <= fabsf(kw) / 16.0f + 0.002f * kscale);
                    if (fabsf(vw) <= 448.0f * vscale) {
                        assert_true(fabsf(vg - vw) <= fabsf(vw) / 16.0f + 0.002f * vscale);
                    } else {
                        assert_true(fabsf(vg) == 448.0f * vscale); /* saturates, keeps the sign */
                        assert_true((vg > 0) == (vw > 0));
                        saturated++;
                    }
                }
        if (run == 0)
            assert_int_equal(saturated, 0); /* scale 4 holds values up to 1792 */
        else
            assert_true(saturated > 0);
        kvf_backend_destroy(be, ctx);
    }
    /* a negative or infinite scale is refused at create, naming it */
    void *ctx = NULL;
    kvf_backend_opts bad = {.n_threads = 1, .kv_k_scale = -1.0f};
    assert_int_equal(kvf_backend_create(be, &bad, &ctx, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "KV scales k -1"));
    free(pool);
}

/* attention over fp8 KV with scales equals attention over f32 KV within fp8's error */
static void test_fp8_attention(void **state)
{
    const kvf_backend *be = kvf_model_backend_cpu();
    kvf_err err = {0};
    kvf_kv_layout l8, l32;
    assert_int_equal(kvf_kv_layout_init(1, 2, 32, 16, KVF_DTYPE_FP8_E4M3, &l8, &err), KVF_OK);
    assert_int_equal(kvf_kv_layout_init(1, 2, 32, 16, KVF_DTYPE_F32, &l32, &err), KVF_OK);
    enum { T = 40, H = 4, KVH = 2, D = 32 };
    uint8_t *p8 = calloc(4, (size_t)l8.block_bytes), *p32 = calloc(4, (size_t)l32.block_bytes);
    float *k = malloc(sizeof(float) * T * KVH * D), *v = malloc(sizeof(float) * T * KVH * D);
    float *q = malloc(sizeof(float) * T * H * D), *o8 = malloc(sizeof(float) * T * H * D),
          *o32 = malloc(sizeof(float) * T * H * D);
    uint64_t seed = 11;
    for (int i = 0; i < T * KVH * D; i++) {
        k[i] = rnd(&seed) * 30.0f;
        v[i] = rnd(&seed) * 900.0f;
    }
    for (int i = 0; i < T * H * D; i++)
        q[i] = rnd(&seed) * 0.05f;
    int64_t slots[T];
    int32_t tok_seq[T], tok_pos[T], table[3] = {2, 0, 3};
    for (int t = 0; t < T; t++) {
        slots[t] = (int64_t)table[t / 16] * 16 + t % 16;
        tok_seq[t] = 0;
        tok_pos[t] = t;
    }
    void *c8, *c32;
    kvf_backend_opts b8 = {.n_threads = 2, .kv_k_scale = 0.1f, .kv_v_scale = 4.0f};
    kvf_backend_opts b32 = {.n_threads = 2};
    assert_int_equal(kvf_backend_create(be, &b8, &c8, &err), KVF_OK);
    assert_int_equal(kvf_backend_create(be, &b32, &c32, &err), KVF_OK);
    kvf_backend_kv_write(be, c8, p8, &l8, 0, k, v, slots, T);
    kvf_backend_kv_write(be, c32, p32, &l32, 0, k, v, slots, T);
    kvf_backend_attn a = {.n_tokens = T, .n_heads = H, .n_kv_heads = KVH, .head_dim = D,
                          .tok_seq = tok_seq, .tok_pos = tok_pos, .block_tables = table,
                          .max_blocks = 3, .scale = 1.0f / sqrtf((float)D), .max_ctx = 64};
    kvf_backend_attention(be, c8, q, p8, &l8, 0, &a, o8);
    kvf_backend_attention(be, c32, q, p32, &l32, 0, &a, o32);
    double mx = 0, d = 0;
    for (int i = 0; i < T * H * D; i++) {
        mx = fmax(mx, fabs(o32[i]));
        d = fmax(d, fabs((double)o8[i] - o32[i]));
    }
    print_message("fp8 (scales 0.1, 4) vs f32 attention: max error %.3g of %.3g\n", d, mx);
    assert_true(mx > 10.0);     /* the values really are beyond fp8's unscaled range */
    assert_true(d <= 0.08 * mx); /* 1/16 relative per element, averaged by the softmax */
    kvf_backend_destroy(be, c8);
    kvf_backend_destroy(be, c32);
    free(p8); free(p32); free(k); free(v); free(q); free(o8); free(o32);
}

/* a fixture model with fp8 KV: logits near the f32-KV logits, and the forward pass accepts it */
static void test_fp8_forward(void **state)
{
    const kvf_backend *be = kvf_model_backend_cpu();
    rig r8, r32;
    kvf_err err = {0};
    assert_int_equal(rig_open(&r8, "tiny-gqa-f32", be, KVF_DTYPE_FP8_E4M3, 0.5f, 0.5f, &err), KVF_OK);
    assert_int_equal(rig_open(&r32, "tiny-gqa-f32", be, KVF_DTYPE_F32, 0, 0, &err), KVF_OK);
    int32_t vocab = r8.m->cfg.vocab_size;
    float *l8 = malloc(sizeof(float) * (size_t)vocab), *l32 = malloc(sizeof(float) * (size_t)vocab);
    int32_t table[4] = {7, 2, 9, 1}, toks[20], n8, n32;
    for (int i = 0; i < 20; i++)
        toks[i] = (i * 37 + 5) % vocab;
    kvf_model_seq s = {.tokens = toks, .n_tokens = 20, .start_pos = 0, .block_table = table, .n_blocks = 4};
    assert_int_equal(kvf_model_forward(r8.fwd, &s, 1, r8.pool, RIG_POOL, l8, &n8, &err), KVF_OK);
    assert_int_equal(kvf_model_forward(r32.fwd, &s, 1, r32.pool, RIG_POOL, l32, &n32, &err), KVF_OK);
    double mx = 0, d = 0;
    for (int32_t i = 0; i < vocab; i++) {
        mx = fmax(mx, fabs(l32[i]));
        d = fmax(d, fabs((double)l8[i] - l32[i]));
    }
    print_message("tiny-gqa-f32, fp8 KV (scales 0.5): logit error %.3g of %.3g\n", d, mx);
    assert_true(d <= 0.05 * mx);
    free(l8);
    free(l32);
    rig_close(&r8);
    rig_close(&r32);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_supports_refusal),
        cmocka_unit_test(test_step_hooks),
        cmocka_unit_test(test_profile),
        cmocka_unit_test(test_matmul_multi),
        cmocka_unit_test(test_fp8_scale_round_trip),
        cmocka_unit_test(test_fp8_attention),
        cmocka_unit_test(test_fp8_forward),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
