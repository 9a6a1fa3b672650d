/* host_attn_emu.cpp: runs the real partition and reduce kernels of cuda/attn.cu on the host,
 * one OS thread per CUDA thread (a barrier for __syncthreads, a per-warp exchange for
 * __shfl_xor_sync, static storage for __shared__), against the CPU backend and the host
 * reference on small random cases: the kernels' indexing, shuffles, barriers and dispatch are
 * checked without a GPU. What it cannot check: timing, races the barriers would hide, and
 * the device's own conversions and exp2f. Slow per CTA, so the cases are small. */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include <algorithm>

extern "C" {
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "common/dtype.h"
#include "cuda/attn.h"
#include "cuda/attn_ref.h"
#include "kv/layout.h"
#include "model/backend.h"
}
#include "test_attn_cases.h"

#include "cuda_emu.h"

using std::max;
using std::min;

#define KVF_ATTN_HOST_EMU 1
#include "cuda/attn.cu"

/* One launch of attn.cu's plan as a grid: CTAs one after another, fibers for threads. */
static void emu_launch(const attn_launch &x, int hd)
{
    emu::launch_fibers({x.gx, x.gy, x.gz}, {x.block, 1, 1}, 1 << 20, [&] {
        if (x.fn)
            x.fn(x.a);
        else if (x.reduce)
            attn_reduce_fn(x.a, hd)(x.a, hd);
        else
            attn_count_kernel(x.a);
    });
}

/* kvf_cuda_attention with the kernels run by emu_launch; p's pointers are host memory. */
static kvf_status emu_attention(const kvf_cuda_attn_params *p, kvf_err *err)
{
    kvf_status st = kvf_cuda_attn_check(p, err);
    if (st != KVF_OK || p->n_tokens == 0)
        return st;
    attn_launch L[5];
    const int n = attn_plan(p, L);
    if (n == 0)
        return kvf_err_set(err, KVF_ERR_INTERNAL, "no kernel");
    for (int i = 0; i < n; i++)
        emu_launch(L[i], p->layout.head_dim);
    return KVF_OK;
}

/* same tolerances as the GPU test (test_attn.c) */
static const double emu_atol[KVF_DTYPE_COUNT] = {5e-5, 5e-5, 5e-5, 1e-4};
static const double emu_rtol[KVF_DTYPE_COUNT] = {2e-4, 2e-4, 2e-4, 5e-4};

/* floats by which the emulated call's output is moved off the allocation's 16-byte alignment
 * (1: the reduce takes its one-float loads, attn_reduce_fn) */
static int emu_out_shift = 0;

/* Runs one case through the emulated kernels; compares with the CPU backend and the
 * reference. tiles: n_seqs given, so a case with prefill chunks runs its chunks on a tile kernel
 * and its split, and its decode tokens on the partition kernel by sequence (attn_plan);
 * otherwise n_seqs 0, the partition kernel for every token. bad_pos >= 0 moves that token past
 * max_ctx (it must get zeros). Rows no token may read are NaN (attn_case_poison_unseen), so a
 * read past a row or past a sequence shows. */
static void emu_case_as(const attn_case_spec *s, int32_t bad_pos, bool tiles, int32_t dec)
{
    attn_case c;
    assert_int_equal(attn_case_build(s, &c), 0);
    attn_case_poison_unseen(&c);
    size_t n = (size_t)c.n_tokens * c.n_heads * s->head_dim, row = (size_t)c.n_heads * s->head_dim;
    float *cpu = (float *)malloc(n * sizeof(float)), *ref = (float *)malloc(n * sizeof(float));
    float *got_mem = (float *)malloc((n + 4) * sizeof(float)), *got = got_mem + emu_out_shift;
    assert_int_equal(attn_case_cpu(&c, s, cpu), 0);
    const int32_t n_seqs = tiles ? c.n_seqs : 0;
    size_t ws_bytes = kvf_cuda_attention_workspace_bytes(c.n_tokens, n_seqs, c.n_heads,
                                                         s->head_dim, c.max_ctx);
    float *ws = ws_bytes ? (float *)malloc(ws_bytes) : nullptr;
    kvf_err err = {};
    kvf_cuda_attn_params p = attn_case_params(&c, s, c.q, ref, c.pool, c.tok_seq, c.tok_pos,
                                              c.block_tables, ws, ws_bytes);
    p.n_seqs = n_seqs; /* the reference takes the same split */
    if (kvf_cuda_attn_ref(&p, &err) != KVF_OK)
        fail_msg("ref: %s", err.msg);
    for (size_t i = 0; i < n; i++)
        got[i] = NAN;
    if (ws)
        for (size_t i = 0; i < ws_bytes / sizeof(float); i++)
            ws[i] = NAN; /* a partition the reduce reads but nobody wrote shows up */
    if (bad_pos >= 0)
        c.tok_pos[bad_pos] = c.max_ctx + 5;
    p.out = got;
    p.decode_kernel = dec;
    if (emu_attention(&p, &err) != KVF_OK)
        fail_msg("emulated launch: %s", err.msg);
    int32_t parts = kvf_cuda_attention_split(c.n_tokens, n_seqs, c.n_heads, c.max_ctx, nullptr);
    for (int32_t t = 0; t < c.n_tokens; t++) {
        size_t wi;
        if (t == bad_pos) {
            for (size_t i = 0; i < row; i++)
                if (got[t * row + i] != 0.0f)
                    fail_msg("token %d past max_ctx: element %zu is %g, not 0", t, i,
                             (double)got[t * row + i]);
            continue;
        }
        double r = attn_close(got + t * row, cpu + t * row, row, emu_atol[s->dtype],
                              emu_rtol[s->dtype], &wi);
        if (!(r <= 1.0))
            fail_msg("kernel vs CPU (%s, %s decode): %s hd %d bs %d kv %d group %d window %d "
                     "max_ctx %d (%d parts): token %d (pos %d) element %zu is %g, CPU backend %g "
                     "(%.2fx)",
                     tiles ? "tiles" : "no tiles", kvf_backend_attn_decode_name(dec),
                     kvf_dtype_name(s->dtype), s->head_dim,
                     s->block_size, s->n_kv_heads, s->group, s->window, c.max_ctx, parts, t,
                     c.tok_pos[t], wi,
                     (double)got[t * row + wi], (double)cpu[t * row + wi], r);
        r = attn_close(got + t * row, ref + t * row, row, 2e-5, 1e-4, &wi);
        if (!(r <= 1.0))
            fail_msg("kernel vs reference (%s, %s decode): token %d element %zu is %g, reference "
                     "%g (%.2fx)",
                     tiles ? "tiles" : "no tiles", kvf_backend_attn_decode_name(dec), t, wi,
                     (double)got[t * row + wi],
                     (double)ref[t * row + wi], r);
    }
    free(ws);
    free(cpu);
    free(ref);
    free(got_mem);
    attn_case_free(&c);
}

/* Both ways: with n_seqs given (a tile kernel for chunks, if any) and on the partition kernel;
 * decode tokens on the SIMT kernel, and again on the tensor cores where that kernel serves. */
static void emu_case(const attn_case_spec *s, int32_t bad_pos)
{
    kvf_kv_layout l = {};
    l.head_dim = s->head_dim, l.dtype = s->dtype;
    for (int32_t dec : {(int32_t)KVF_BACKEND_ATTN_DECODE_SIMT, (int32_t)KVF_BACKEND_ATTN_DECODE_MMA}) {
        if (dec == KVF_BACKEND_ATTN_DECODE_MMA && !kvf_cuda_attn_decode_mma_serves(&l))
            continue;
        emu_case_as(s, bad_pos, true, dec);
        emu_case_as(s, bad_pos, false, dec);
    }
}

static attn_case_spec emu_spec(int32_t hd, int32_t bs, int32_t kv, int32_t group, kvf_dtype dt,
                               int32_t window, int32_t n_seqs, int32_t max_len, bool decode_only,
                               uint32_t seed)
{
    attn_case_spec s = {};
    s.head_dim = hd, s.block_size = bs, s.n_kv_heads = kv, s.group = group, s.window = window;
    s.dtype = dt, s.k_scale = 1.0f, s.v_scale = 1.0f, s.scale_mul = seed % 2 ? 1.0f : 4.0f;
    s.n_seqs = n_seqs, s.max_len = max_len, s.extra_ctx = 11, s.seed = seed;
    s.decode_only = decode_only;
    if (dt == KVF_DTYPE_FP8_E4M3)
        s.k_scale = 0.37f, s.v_scale = 2.5f;
    return s;
}

/* Split contexts (64-position partitions + reduce): every head_dim, every dtype, GQA 1/2/4/6/8/16
 * (kernels with 1, 2, 4 and 8 heads per CTA; 16 in two chunks), block sizes 1 to 32, windows. */
static void test_split_kernels(void **state)
{
    (void)state;
    const attn_case_spec cases[] = {
        emu_spec(16, 8, 2, 2, KVF_DTYPE_F32, 0, 2, 300, true, 1),
        emu_spec(32, 16, 2, 1, KVF_DTYPE_F16, 100, 2, 400, true, 2),
        emu_spec(64, 1, 1, 16, KVF_DTYPE_F16, 100, 2, 400, true, 3),
        emu_spec(128, 32, 2, 4, KVF_DTYPE_FP8_E4M3, 0, 2, 700, true, 4),
        emu_spec(128, 16, 1, 6, KVF_DTYPE_BF16, 300, 2, 600, true, 5),
        emu_spec(256, 16, 2, 1, KVF_DTYPE_F32, 0, 1, 300, true, 6),
        emu_spec(32, 8, 1, 8, KVF_DTYPE_BF16, 0, 2, 500, true, 7),
        emu_spec(16, 32, 2, 4, KVF_DTYPE_FP8_E4M3, 50, 2, 333, true, 8),
    };
    for (const attn_case_spec &s : cases) {
        int32_t th = s.n_seqs * s.n_kv_heads * s.group;
        assert_true(kvf_cuda_attention_parts(s.n_seqs, th / s.n_seqs, s.max_len + s.extra_ctx) > 1);
        emu_case(&s, -1);
    }
}

/* The reduce over more partitions than its block has threads (a 17k context in 64-position
 * partitions), and with an output that is not 16-byte aligned (its one-float loads). */
static void test_reduce_many_parts(void **state)
{
    (void)state;
    const attn_case_spec many = emu_spec(16, 16, 1, 1, KVF_DTYPE_F32, 0, 1, 17000, true, 21);
    assert_true(kvf_cuda_attention_parts(1, 1, many.max_len + many.extra_ctx) > 256);
    emu_case_as(&many, -1, false, KVF_BACKEND_ATTN_DECODE_SIMT);
    const attn_case_spec s = emu_spec(64, 16, 2, 4, KVF_DTYPE_BF16, 0, 2, 600, true, 22);
    emu_out_shift = 1;
    emu_case_as(&s, -1, false, KVF_BACKEND_ATTN_DECODE_SIMT);
    emu_case_as(&s, -1, false, KVF_BACKEND_ATTN_DECODE_MMA);
    emu_out_shift = 0;
}

/* The emulation's own alignment check (cuda_emu.h): an aligned 16-byte __ldg passes unnoted, a
 * misaligned one is noted (and still reads the right bytes), and so is a cp.async with a
 * misaligned end (a launch fails its test with the note: align_fault_check). */
static void test_emu_align_check(void **state)
{
    (void)state;
    alignas(16) static uint8_t buf[64];
    for (int i = 0; i < 64; i++)
        buf[i] = (uint8_t)i;
    emu::align_fault[0] = 0;
    const uint4 a = __ldg(reinterpret_cast<const uint4 *>(buf + 16));
    assert_int_equal(emu::align_fault[0], 0);
    assert_int_equal(a.x, 0x13121110u);
    const uint4 b = __ldg(reinterpret_cast<const uint4 *>(buf + 8));
    assert_int_equal(b.x, 0x0b0a0908u);
    assert_non_null(strstr(emu::align_fault, "__ldg of 16 bytes"));
    assert_non_null(strstr(emu::align_fault, "not 16-byte aligned"));
    emu::align_fault[0] = 0;
    alignas(16) uint8_t dst[32];
    emu::cp16(dst, buf + 32);
    assert_int_equal(emu::align_fault[0], 0);
    emu::cp16(dst + 4, buf + 32);
    assert_non_null(strstr(emu::align_fault, "cp.async destination"));
    assert_int_equal(dst[4], 32);
    emu::align_fault[0] = 0;
}

/* One partition (max_ctx <= 256): output written directly; prefill chunks mixed with decode
 * tokens over shared and scattered blocks. */
static void test_single_partition_kernels(void **state)
{
    (void)state;
    const attn_case_spec cases[] = {
        emu_spec(32, 16, 1, 8, KVF_DTYPE_BF16, 37, 3, 90, false, 11),
        emu_spec(16, 8, 2, 2, KVF_DTYPE_FP8_E4M3, 0, 3, 120, false, 12),
        emu_spec(64, 16, 2, 4, KVF_DTYPE_F32, 0, 2, 200, false, 13),
    };
    for (const attn_case_spec &s : cases)
        emu_case(&s, -1);
}

/* head_dim 48, 80 and 96 (thread groups padded to 64, 128 and 128 columns: the pad lanes load
 * and store nothing) x every dtype: GQA 1/2/4/6/8/16 (all four heads-per-CTA kernels, 16 in two
 * chunks), block sizes 1 to 32 with lengths that are not multiples of them, scattered and shared
 * blocks, prefill chunks mixed with decode tokens in one partition, decode batches split into
 * 64-position partitions, sliding windows. */
static void test_padded_head_dims(void **state)
{
    (void)state;
    static const int32_t hds[] = {48, 80, 96}, groups[] = {1, 2, 4, 6, 8, 16};
    static const int32_t bss[] = {16, 8, 32, 1, 16};
    static const int32_t windows[] = {0, 37, 0, 100};
    uint32_t seed = 600;
    int n = 0;
    for (int32_t hd : hds)
        for (int dt = 0; dt < KVF_DTYPE_COUNT; dt++, seed++, n++) {
            const int32_t group = groups[n % 6], kv = group >= 8 ? 1 : 2;
            const bool split = n % 2 == 1; /* decode-only, contexts of 2-6 partitions */
            attn_case_spec s = emu_spec(hd, bss[n % 5], kv, group, (kvf_dtype)dt, windows[n % 4],
                                        2, split ? 250 + 9 * (n % 5) : 24 + 9 * (n % 5),
                                        split, seed);
            if (split) {
                int32_t th = s.n_seqs * s.n_kv_heads * s.group;
                assert_true(kvf_cuda_attention_parts(s.n_seqs, th / s.n_seqs,
                                                     s.max_len + s.extra_ctx) > 1);
            }
            emu_case(&s, -1);
        }
}

/* Prefill chunks on a tile kernel beside decode tokens (on the partition kernel by sequence),
 * over contexts of 2-4 partitions: every head_dim x dtype (the mma kernel at f16/bf16 x 64 and
 * 128), GQA 1/2/4/6/8/16 (f32 tiles of 16, 8, 4 and 2 tokens, mma tiles of 64 to 8; 16 in two
 * head chunks), block sizes 1 to 32, windows shorter and longer than a tile, chunks that start
 * and end off a tile's alignment. */
static void test_tiled_prefill(void **state)
{
    (void)state;
    static const int32_t hds[] = {16, 32, 48, 64, 80, 96, 128, 256}, groups[] = {1, 2, 4, 6, 8, 16};
    static const int32_t bss[] = {16, 8, 32, 1, 16}, windows[] = {0, 5, 0, 100};
    uint32_t seed = 900;
    int n = 0;
    for (int32_t hd : hds)
        for (int dt = 0; dt < KVF_DTYPE_COUNT; dt++, seed++, n++) {
            const int32_t group = groups[n % 6], kv = group >= 8 ? 1 : 2;
            attn_case_spec s = emu_spec(hd, bss[n % 5], kv, group, (kvf_dtype)dt, windows[n % 4],
                                        3, 260 + 37 * (n % 7), false, seed);
            attn_case c;
            assert_int_equal(attn_case_build(&s, &c), 0);
            const bool chunk = c.n_tokens > c.n_seqs;
            const int32_t parts = kvf_cuda_attention_split(c.n_tokens, c.n_seqs, c.n_heads,
                                                           c.max_ctx, nullptr);
            attn_case_free(&c);
            if (!chunk)
                continue; /* this seed drew no prefill chunk: the other tests cover decode */
            assert_true(parts > 1);
            emu_case(&s, -1);
        }
}

/* The tensor-core decode kernel's own edges: f16, bf16 and fp8 (k/v scales 0.37, 2.5), GQA 1,
 * 2, 3, 4, 8 and 16 (heads 8..15 of its
 * tiles zero, a group of 16 in two chunks), block sizes 1 to 32, contexts shorter than one
 * group of 16 positions (warps without a group), lengths off every multiple, windows shorter
 * than a group, split and unsplit, beside prefill chunks. emu_case runs each on both decode
 * kernels. */
static void test_mma_decode(void **state)
{
    (void)state;
    const attn_case_spec cases[] = {
        emu_spec(128, 16, 2, 4, KVF_DTYPE_BF16, 0, 3, 700, true, 31),
        emu_spec(64, 8, 2, 1, KVF_DTYPE_F16, 0, 3, 300, true, 32),
        emu_spec(128, 1, 1, 8, KVF_DTYPE_F16, 45, 2, 500, true, 33),
        emu_spec(64, 32, 2, 2, KVF_DTYPE_BF16, 0, 4, 40, true, 34),
        emu_spec(128, 16, 1, 16, KVF_DTYPE_BF16, 0, 2, 270, true, 35),
        emu_spec(64, 16, 1, 3, KVF_DTYPE_BF16, 7, 3, 100, false, 36),
        emu_spec(128, 8, 2, 4, KVF_DTYPE_F16, 0, 3, 333, false, 37),
        emu_spec(128, 16, 2, 4, KVF_DTYPE_FP8_E4M3, 0, 3, 420, true, 38),
        emu_spec(64, 16, 1, 8, KVF_DTYPE_FP8_E4M3, 21, 3, 300, true, 39),
        emu_spec(64, 32, 2, 2, KVF_DTYPE_FP8_E4M3, 0, 3, 150, false, 40),
    };
    for (const attn_case_spec &s : cases)
        emu_case(&s, -1);
}

/* A token past max_ctx gets zeros on both paths; the others are unaffected. */
static void test_bad_position(void **state)
{
    (void)state;
    attn_case_spec a = emu_spec(32, 16, 2, 2, KVF_DTYPE_F32, 0, 2, 400, true, 21);
    emu_case(&a, 0);
    attn_case_spec b = emu_spec(32, 16, 2, 2, KVF_DTYPE_F32, 0, 2, 100, true, 22);
    emu_case(&b, 1);
    /* inside a prefill chunk (a tile's row), one partition and split */
    for (int32_t max_len : {120, 400}) {
        attn_case_spec m = emu_spec(64, 16, 1, 4, KVF_DTYPE_BF16, 0, 3, max_len, false, 23);
        attn_case c;
        assert_int_equal(attn_case_build(&m, &c), 0);
        int32_t bad = -1;
        for (int32_t t = 0; t + 2 < c.n_tokens && bad < 0; t++)
            if (c.tok_seq[t] == c.tok_seq[t + 2])
                bad = t + 1; /* a chunk's token with a neighbour on each side */
        attn_case_free(&c);
        assert_true(bad >= 0);
        emu_case(&m, bad);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_emu_align_check),
        cmocka_unit_test(test_single_partition_kernels),
        cmocka_unit_test(test_split_kernels),
        cmocka_unit_test(test_reduce_many_parts),
        cmocka_unit_test(test_padded_head_dims),
        cmocka_unit_test(test_tiled_prefill),
        cmocka_unit_test(test_mma_decode),
        cmocka_unit_test(test_bad_position),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
