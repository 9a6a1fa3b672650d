/* host_backend_emu.c: the real CUDA backend (cuda/backend.cu, device.cu and the kernel files,
 * launches rewritten by emu_rewrite_launches.py, on cuda_rt_emu.cpp's host runtime and cuBLAS)
 * behind kvf_backend, on every fixture model: a prefill, then teacher-forced decode steps that
 * the graph policy captures and replays; logits against the CPU backend and the fixture within
 * test_models.c's tolerances (bf16 or f32 matrices, f32 or scaled fp8 KV), replayed steps equal
 * to the eager ones bit for bit, greedy tokens equal to the fixture where its margin allows.
 * Not checked: timing, races, the device's own arithmetic, real cuBLAS (cuda_rt_emu.cpp). */
#define main kvf_test_models_gpu_main /* reuse the GPU test's fixture reader and tolerances */
#include "test_models.c"
#undef main

#include <time.h>

#include "cuda_rt_emu_c.h"
#include "emu_side.h"
#include "model/backend_impl.h" /* the CUDA backend without matmul_multi */

static const char *mname(int32_t md)
{
    return md == KVF_BACKEND_MATRIX_F32 ? "f32" : md == KVF_BACKEND_MATRIX_F16 ? "f16" : "bf16";
}

/* a block table scattered over the pool: reversed, every other block */
static void scatter_table(int32_t table[16])
{
    for (int32_t b = 0; b < 16; b++)
        table[b] = N_POOL - 1 - 2 * b;
}

static void side_step(side *s, const kvf_model_seq *q, float *logits, int32_t *next, const char *what)
{
    kvf_err err = {0};
    if (kvf_model_forward(s->fwd, q, 1, s->pool, N_POOL, logits, next, &err) != KVF_OK)
        fail_msg("%s: %s forward: %s", what, kvf_backend_name(s->be), err.msg);
}

/* one model, one configuration: emu (graphs on), emu (graphs off, when eager_too) and CPU */
static void check_model(const char *name, int32_t matrix_dtype, kvf_dtype kv, float kv_scale_k,
                        float kv_scale_v, double tol, bool eager_too)
{
    clock_t t0 = clock();
    fx *f = fx_open(name);
    const kvf_model *m = f->m;
    int32_t vocab = m->cfg.vocab_size;
    kvf_emu_rt_stats rt0, rt1;
    kvf_emu_rt_stats_get(&rt0);
    /* KV scales other than 1 change the fp8 rounding, so the fixture's tolerance (set for
     * scales 1, as test_models.c runs) is then not asked: the CPU backend, with the same
     * scales, is the reference */
    bool vs_fixture = kv_scale_k == 1.0f && kv_scale_v == 1.0f;
    kvf_backend_opts bo = {.matrix_dtype = matrix_dtype, .kv_k_scale = kv_scale_k, .kv_v_scale = kv_scale_v};
    kvf_backend_opts bo_eager = bo;
    bo_eager.no_graphs = true;
    kvf_backend_opts bo_cpu = {.kv_k_scale = bo.kv_k_scale, .kv_v_scale = bo.kv_v_scale};
    side g, e, cpu;
    side_open(&g, kvf_cuda_backend(), m, &bo, kv);
    if (eager_too)
        side_open(&e, kvf_cuda_backend(), m, &bo_eager, kv);
    side_open(&cpu, kvf_model_backend_cpu(), m, &bo_cpu, kv);
    float *lg = malloc((size_t)vocab * sizeof *lg), *le = malloc((size_t)vocab * sizeof *le),
          *lc = malloc((size_t)vocab * sizeof *lc);
    int32_t table[16];
    scatter_table(table);
    double worst_cpu = 0, worst_fx = 0, worst_cpu_fx = 0;
    int tokens_equal = 0, tokens_skipped = 0, steps = 0;
    for (int32_t ci = 0; ci < f->n_cases; ci++) {
        const fx_case *k = &f->cases[ci];
        char what[160];
        int32_t ng = -1, ne = -1, nc = -1, pos = k->n_prompt;
        kvf_model_seq q = {.tokens = k->prompt, .n_tokens = k->n_prompt, .start_pos = 0,
                           .block_table = table, .n_blocks = 16};
        for (int32_t i = 0; i < f->n_new; i++) {
            snprintf(what, sizeof what, "%s/%s %s KV %s step %d", name, k->name,
                     mname(matrix_dtype), kvf_dtype_name(kv), i);
            side_step(&g, &q, lg, &ng, what);
            if (eager_too)
                side_step(&e, &q, le, &ne, what);
            side_step(&cpu, &q, lc, &nc, what);
            steps++;
            double scale, d = rel_err(lg, lc, vocab, &scale);
            worst_cpu = fmax(worst_cpu, d);
            if (d > tol)
                fail_msg("%s: logits off the CPU backend's by %.3g of the largest (allowed %.0e)", what, d, tol);
            if (eager_too && memcmp(lg, le, (size_t)vocab * sizeof *lg) != 0) {
                double de = rel_err(lg, le, vocab, &scale);
                fail_msg("%s: graphs on and off give different logits (by %.3g of the largest)", what, de);
            }
            if (eager_too)
                assert_int_equal(ng, ne);
            /* the fixture at the first and last step: within tol plus the CPU backend's own
             * error there (about 1e-6, but fp8 KV rounds K and V for both backends alike) */
            if (i == 0 || i == f->n_new - 1) {
                const float *want = i == 0 ? k->first : k->last;
                double sc, cpu_fx = rel_err(lc, want, vocab, &sc);
                worst_cpu_fx = fmax(worst_cpu_fx, cpu_fx);
                double dfx = rel_err(lg, want, vocab, &sc);
                if (i == 0)
                    scale = sc;
                if (vs_fixture) {
                    worst_fx = fmax(worst_fx, dfx);
                    if (dfx > tol + cpu_fx)
                        fail_msg("%s: logits off the fixture by %.3g (allowed %.0e + the CPU backend's %.3g)",
                                 what, dfx, tol, cpu_fx);
                }
            }
            if (vs_fixture && k->margins[i] > 2 * tol * scale) {
                if (ng != k->greedy[i])
                    fail_msg("%s: token %d, fixture %d (margin %.3g)", what, ng, k->greedy[i], k->margins[i]);
                tokens_equal++;
            } else {
                tokens_skipped++;
            }
            /* teacher forcing: the fixture's token goes in next */
            q = (kvf_model_seq){.tokens = &k->greedy[i], .n_tokens = 1, .start_pos = pos,
                                .block_table = table, .n_blocks = 16};
            pos++;
        }
    }
    kvf_cuda_stats cs;
    kvf_cuda_backend_stats(g.ctx, &cs);
    kvf_emu_rt_stats_get(&rt1);
    if (rt1.first_problem[0])
        fail_msg("%s: the emulated runtime saw a misuse: %s", name, rt1.first_problem);
    /* per case: the first decode runs eagerly, the second is captured (and launched), the rest
     * replay; the prefill runs eagerly */
    assert_int_equal(cs.graph_failures, 0);
    assert_true(cs.graphs_captured >= 1);
    assert_true(cs.graph_replays > cs.graphs_captured);
    assert_true(rt1.launches_replayed > rt0.launches_replayed);
    assert_int_equal(rt1.captures_invalidated, rt0.captures_invalidated);
    assert_int_equal(rt1.bad_configs, rt0.bad_configs);
    if (eager_too) {
        kvf_cuda_stats es;
        kvf_cuda_backend_stats(e.ctx, &es);
        assert_int_equal(es.graph_replays, 0);
        assert_int_equal(es.graphs_captured, 0);
    }
    print_message("%-24s matrices %-4s KV %-8s scales %g/%g: %d steps; vs CPU worst %.2e, vs fixture %.2e (CPU's %.2e; allowed "
                  "%.0e); graphs %lld captured, %lld replays (%lld launches replayed), %lld eager; %d "
                  "tokens equal the fixture, %d margins too small; %.1f s\n",
                  name, mname(matrix_dtype), kvf_dtype_name(kv),
                  (double)kv_scale_k, (double)kv_scale_v, steps,
                  worst_cpu, worst_fx, worst_cpu_fx, tol, (long long)cs.graphs_captured, (long long)cs.graph_replays,
                  (long long)(rt1.launches_replayed - rt0.launches_replayed), (long long)cs.eager_steps,
                  tokens_equal, tokens_skipped, (double)(clock() - t0) / CLOCKS_PER_SEC);
    free(lg);
    free(le);
    free(lc);
    side_close(&g);
    if (eager_too)
        side_close(&e);
    side_close(&cpu);
    fx_close(f);
    kvf_emu_rt_stats_get(&rt1);
    if (rt1.live_allocs != rt0.live_allocs)
        fail_msg("%s: %lld device allocations left after destroy", name,
                 (long long)(rt1.live_allocs - rt0.live_allocs));
}

/* check_model on every fixture model, KV scales 1 */
static void check_models(int32_t matrix_dtype, kvf_dtype kv, double tol, bool eager_too)
{
    for (size_t i = 0; i < N_MODELS; i++)
        check_model(models[i], matrix_dtype, kv, 1.0f, 1.0f, tol, eager_too);
}

static void test_emu_bf16(void **state)
{
    check_models(KVF_BACKEND_MATRIX_BF16, KVF_DTYPE_F32, TOL_BF16, true);
}

static void test_emu_f32(void **state)
{
    check_models(KVF_BACKEND_MATRIX_F32, KVF_DTYPE_F32, TOL_F32, false);
}

static void test_emu_f16(void **state)
{
    check_models(KVF_BACKEND_MATRIX_F16, KVF_DTYPE_F32, TOL_BF16, false);
}

static void test_emu_fp8_kv(void **state)
{
    check_models(KVF_BACKEND_MATRIX_BF16, KVF_DTYPE_FP8_E4M3, TOL_FP8, false);
}

/* the KV scales reach kv_write and attention: fp8 with k 0.5, v 0.25 against the CPU backend */
static void test_emu_fp8_scales(void **state)
{
    check_model(models[0], KVF_BACKEND_MATRIX_BF16, KVF_DTYPE_FP8_E4M3, 0.5f, 0.25f, TOL_FP8, false);
}

/* The backend's error paths on tiny-gqa-f32 (f32 matrices, so the CPU backend agrees to 2e-3):
 * a capture that fails is rerun eagerly and graphs stay off; a launch that fails makes that
 * step's forward return the error (the first one, with CUDA's message) and the next step runs. */
static void test_emu_failures(void **state)
{
    fx *f = fx_open(models[0]);
    const kvf_model *m = f->m;
    const fx_case *k = &f->cases[1];
    int32_t vocab = m->cfg.vocab_size, table[16];
    scatter_table(table);
    kvf_backend_opts bo = {.matrix_dtype = KVF_BACKEND_MATRIX_F32};
    kvf_backend_opts bo_cpu = {0};
    side g, cpu;
    side_open(&g, kvf_cuda_backend(), m, &bo, KVF_DTYPE_F32);
    side_open(&cpu, kvf_model_backend_cpu(), m, &bo_cpu, KVF_DTYPE_F32);
    float *lg = malloc((size_t)vocab * sizeof *lg), *lc = malloc((size_t)vocab * sizeof *lc);
    int32_t ng, nc, pos = k->n_prompt;
    kvf_emu_rt_stats rt0, rt1;
    kvf_emu_rt_stats_get(&rt0);
    kvf_model_seq q = {.tokens = k->prompt, .n_tokens = k->n_prompt, .block_table = table, .n_blocks = 16};
    int failed_steps = 0;
    for (int32_t i = 0; i < 8; i++) {
        char what[96];
        snprintf(what, sizeof what, "failures: step %d", i);
        if (i == 2) /* the first decode step whose key repeats: it is captured */
            kvf_emu_rt_invalidate_next_capture();
        if (i == 4 || i == 6) { /* eager steps by now: one launch of them is refused */
            kvf_emu_rt_fail_launch(i == 4 ? 0 : 7);
            kvf_err err = {0};
            kvf_status st = kvf_model_forward(g.fwd, &q, 1, g.pool, N_POOL, lg, &ng, &err);
            if (st == KVF_OK)
                fail_msg("%s: a refused launch was not reported", what);
            if (!strstr(err.msg, "too many resources requested for launch"))
                fail_msg("%s: the error does not carry CUDA's message: %s", what, err.msg);
            failed_steps++;
            /* the same step again runs whole */
        }
        side_step(&g, &q, lg, &ng, what);
        side_step(&cpu, &q, lc, &nc, what);
        double scale, d = rel_err(lg, lc, vocab, &scale);
        if (d > TOL_F32)
            fail_msg("%s: logits off the CPU backend's by %.3g (allowed %.0e)", what, d, TOL_F32);
        q = (kvf_model_seq){.tokens = &k->greedy[i], .n_tokens = 1, .start_pos = pos,
                            .block_table = table, .n_blocks = 16};
        pos++;
    }
    kvf_cuda_stats cs;
    kvf_cuda_backend_stats(g.ctx, &cs);
    kvf_emu_rt_stats_get(&rt1);
    assert_int_equal(cs.graph_failures, 1);
    assert_int_equal(cs.graphs_captured, 0);
    assert_int_equal(cs.graph_replays, 0);
    assert_int_equal(rt1.captures_invalidated - rt0.captures_invalidated, 1);
    assert_int_equal(rt1.captures_begun - rt0.captures_begun, 1); /* graphs off after the failure */
    assert_true(cs.device_bytes > 0);
    print_message("failures: a failed capture reran eagerly (graphs then off), %d steps with a refused "
                  "launch returned CUDA's error and were redone; every step within %.0e of the CPU\n",
                  failed_steps, TOL_F32);
    free(lg);
    free(lc);
    side_close(&g);
    side_close(&cpu);
    fx_close(f);
}

/* A second forward-pass instance on the same backend context and pool (its weights and scratch
 * new allocations, the first one's freed): its decode steps have the keys of steps the first one
 * recorded, and must not replay graphs that read the first one's freed buffers. */
static void test_emu_fwd_recreated(void **state)
{
    fx *f = fx_open(models[0]);
    const kvf_model *m = f->m;
    const fx_case *k = &f->cases[1];
    int32_t vocab = m->cfg.vocab_size, table[16];
    scatter_table(table);
    kvf_backend_opts bo = {.matrix_dtype = KVF_BACKEND_MATRIX_F32};
    kvf_backend_opts bo_cpu = {0};
    side g, cpu;
    side_open(&g, kvf_cuda_backend(), m, &bo, KVF_DTYPE_F32);
    side_open(&cpu, kvf_model_backend_cpu(), m, &bo_cpu, KVF_DTYPE_F32);
    enum { STEPS = 5 };
    float *lg = malloc((size_t)vocab * sizeof *lg), *lc = malloc((size_t)STEPS * vocab * sizeof *lc);
    kvf_model_fwd_opts o = {.max_tokens = 128, .max_seqs = 4, .max_ctx = 256};
    kvf_err err = {0};
    kvf_cuda_stats cs;
    for (int round = 0; round < 2; round++) {
        if (round == 1) { /* a new forward pass on the same context and pool */
            kvf_model_fwd_destroy(g.fwd);
            g.fwd = NULL;
            if (kvf_model_fwd_create(m, g.be, g.ctx, &g.lay, &o, &g.fwd, &err) != KVF_OK)
                fail_msg("fwd_create again: %s", err.msg);
        }
        int32_t ng, nc, pos = k->n_prompt;
        kvf_model_seq q = {.tokens = k->prompt, .n_tokens = k->n_prompt, .block_table = table, .n_blocks = 16};
        for (int32_t i = 0; i < STEPS; i++) {
            char what[96];
            float *want = lc + (size_t)i * vocab;
            snprintf(what, sizeof what, "forward pass %d, step %d", round + 1, i);
            side_step(&g, &q, lg, &ng, what);
            if (round == 0)
                side_step(&cpu, &q, want, &nc, what);
            double scale, d = rel_err(lg, want, vocab, &scale);
            if (d > TOL_F32)
                fail_msg("%s: logits off the CPU backend's by %.3g (allowed %.0e)", what, d, TOL_F32);
            q = (kvf_model_seq){.tokens = &k->greedy[i], .n_tokens = 1, .start_pos = pos,
                                .block_table = table, .n_blocks = 16};
            pos++;
        }
        kvf_cuda_backend_stats(g.ctx, &cs);
        if (round == 0)
            assert_true(cs.graph_replays > cs.graphs_captured); /* graphs were stored */
    }
    print_message("a second forward pass on the same context: %lld graphs captured, %lld replays; "
                  "every step within %.0e of the CPU\n", (long long)cs.graphs_captured,
                  (long long)cs.graph_replays, TOL_F32);
    free(lg);
    free(lc);
    side_close(&g);
    side_close(&cpu);
    fx_close(f);
}

/* A profiled forward pass on the CUDA backend: its marks are events on the stream, every kind of
 * op gets its calls and a time, no step is captured or replayed while it profiles (and the
 * steps after it stop do), and the logits equal those of a pass without it bit for bit. */
static void test_emu_profile(void **state)
{
    fx *f = fx_open(models[0]);
    const kvf_model *m = f->m;
    const fx_case *k = &f->cases[1]; /* a 5-token prompt: one step with a chunk */
    const int32_t vocab = m->cfg.vocab_size, L = m->cfg.n_layers;
    int32_t table[16];
    scatter_table(table);
    kvf_backend_opts bo = {.matrix_dtype = KVF_BACKEND_MATRIX_F32};
    side g, e;
    side_open(&g, kvf_cuda_backend(), m, &bo, KVF_DTYPE_F32);
    bo.no_graphs = true;
    side_open(&e, kvf_cuda_backend(), m, &bo, KVF_DTYPE_F32);
    kvf_emu_rt_stats rt0, rt1;
    kvf_emu_rt_stats_get(&rt0);
    kvf_model_fwd_prof p = {0};
    kvf_err err = {0};
    assert_int_equal(kvf_model_fwd_set_prof(g.fwd, &p, &err), KVF_OK);
    enum { STEPS = 6 };
    float *lg = malloc((size_t)vocab * sizeof *lg), *le = malloc((size_t)vocab * sizeof *le);
    int32_t ng, ne, pos = k->n_prompt;
    kvf_model_seq q = {.tokens = k->prompt, .n_tokens = k->n_prompt, .block_table = table, .n_blocks = 16};
    for (int32_t i = 0; i < STEPS; i++) {
        side_step(&g, &q, lg, &ng, "profiled");
        side_step(&e, &q, le, &ne, "eager");
        if (memcmp(lg, le, (size_t)vocab * sizeof *lg) != 0 || ng != ne)
            fail_msg("step %d: profiled logits differ from the unprofiled pass's", i);
        q = (kvf_model_seq){.tokens = &k->greedy[i], .n_tokens = 1, .start_pos = pos++,
                            .block_table = table, .n_blocks = 16};
    }
    kvf_cuda_stats cs;
    kvf_cuda_backend_stats(g.ctx, &cs);
    assert_int_equal(cs.graphs_captured, 0);
    assert_int_equal(cs.graph_replays, 0);
    assert_int_equal(p.steps[1], 1);
    assert_int_equal(p.steps[0], STEPS - 1);
    for (int kk = 0; kk < 2; kk++) {
        for (int op = 0; op < KVF_FWD_OP_COUNT; op++) {
            const int64_t per = op == KVF_FWD_OP_NORM || op == KVF_FWD_OP_ADD ? 2 * L
                                : op >= KVF_FWD_OP_QKV && op <= KVF_FWD_OP_DOWN ? L : 1;
            assert_int_equal(p.op_calls[kk][op], per * p.steps[kk]);
            assert_true(p.op_ms[kk][op] >= 0);
        }
        const double ms = kvf_model_fwd_prof_ms(&p, kk); /* event times within the call's */
        assert_true(ms > 0 && ms <= p.wall_ms[kk] + 1e-3);
    }
    /* off again: decode steps are recorded and replayed once more */
    assert_int_equal(kvf_model_fwd_set_prof(g.fwd, NULL, &err), KVF_OK);
    for (int32_t i = STEPS; i < STEPS + 4; i++) {
        side_step(&g, &q, lg, &ng, "after the profile");
        q = (kvf_model_seq){.tokens = &k->greedy[i % f->n_new], .n_tokens = 1, .start_pos = pos++,
                            .block_table = table, .n_blocks = 16};
    }
    kvf_cuda_backend_stats(g.ctx, &cs);
    assert_true(cs.graph_replays > 0);
    kvf_emu_rt_stats_get(&rt1);
    if (rt1.first_problem[0] || rt1.misuses != rt0.misuses)
        fail_msg("the emulated runtime saw a misuse: %s", rt1.first_problem);
    print_message("profiled: %lld decode steps at %.3f ms, attention %.1f%% of them (emulated "
                  "clock); graphs again after it: %lld replays\n", (long long)p.steps[0],
                  kvf_model_fwd_prof_ms(&p, 0) / p.steps[0],
                  100.0 * p.op_ms[0][KVF_FWD_OP_ATTENTION] / kvf_model_fwd_prof_ms(&p, 0),
                  (long long)cs.graph_replays);
    free(lg);
    free(le);
    side_close(&g);
    side_close(&e);
    fx_close(f);
}

/* matmul_multi on the CUDA backend: with bf16 matrices a step converts each layer's input to
 * q/k/v and to gate/up once (3 conversion launches fewer a layer than matmul by matmul), runs the
 * same GEMMs, and gives the same logits bit for bit. */
static void test_emu_matmul_multi(void **state)
{
    fx *f = fx_open(models[0]);
    const kvf_model *m = f->m;
    const fx_case *k = &f->cases[1];
    const int32_t vocab = m->cfg.vocab_size, L = m->cfg.n_layers;
    int32_t table[16];
    scatter_table(table);
    static kvf_backend single; /* the CUDA backend without matmul_multi */
    single = *kvf_cuda_backend();
    single.matmul_multi = NULL;
    kvf_backend_opts bo = {.matrix_dtype = KVF_BACKEND_MATRIX_BF16, .no_graphs = true};
    side g, s1;
    side_open(&g, kvf_cuda_backend(), m, &bo, KVF_DTYPE_F32);
    side_open(&s1, &single, m, &bo, KVF_DTYPE_F32);
    float *lg = malloc((size_t)vocab * sizeof *lg), *ls = malloc((size_t)vocab * sizeof *ls);
    int32_t ng, ns, pos = k->n_prompt;
    kvf_model_seq q = {.tokens = k->prompt, .n_tokens = k->n_prompt, .block_table = table, .n_blocks = 16};
    for (int32_t i = 0; i < 3; i++) {
        kvf_emu_rt_stats a0, a1, b1;
        kvf_emu_rt_stats_get(&a0);
        side_step(&g, &q, lg, &ng, "matmul_multi");
        kvf_emu_rt_stats_get(&a1);
        side_step(&s1, &q, ls, &ns, "matmul by matmul");
        kvf_emu_rt_stats_get(&b1);
        if (memcmp(lg, ls, (size_t)vocab * sizeof *lg) != 0 || ng != ns)
            fail_msg("step %d: matmul_multi's logits differ from matmul by matmul's", i);
        assert_int_equal(a1.gemms - a0.gemms, b1.gemms - a1.gemms);
        assert_int_equal((b1.launches - a1.launches) - (a1.launches - a0.launches), 3 * L);
        q = (kvf_model_seq){.tokens = &k->greedy[i], .n_tokens = 1, .start_pos = pos++,
                            .block_table = table, .n_blocks = 16};
    }
    free(lg);
    free(ls);
    side_close(&g);
    side_close(&s1);
    fx_close(f);
}

int main(void)
{
    print_message("emulated CUDA backend: every case of every fixture model, its prefill and then "
                  "teacher-forced decode steps to the fixture's n_new\n");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_emu_f32),
        cmocka_unit_test(test_emu_bf16),
        cmocka_unit_test(test_emu_f16),
        cmocka_unit_test(test_emu_fp8_kv),
        cmocka_unit_test(test_emu_fp8_scales),
        cmocka_unit_test(test_emu_failures),
        cmocka_unit_test(test_emu_fwd_recreated),
        cmocka_unit_test(test_emu_profile),
        cmocka_unit_test(test_emu_matmul_multi),
        /* test_models.c's own GPU tests, on the emulated device */
        cmocka_unit_test(test_forward_f32_weights),
        cmocka_unit_test(test_forward_bf16),
        cmocka_unit_test(test_forward_fp8_kv),
        cmocka_unit_test(test_engine_graphs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
