/* test_attn_cases.h: random paged-attention cases shared by the host test of the split
 * algorithm (host_attn_split.c) and the GPU kernel test (test_attn.c): scattered and shared
 * blocks, lengths that are not multiples of the block size, prefill chunks mixed with decode
 * tokens; and the CPU backend's answer for them. Header-only, for tests; C and C++ (the
 * host emulation of the kernels, host_attn_emu.cpp). */
#ifndef KVF_TEST_ATTN_CASES_H
#define KVF_TEST_ATTN_CASES_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "cuda/attn.h"
#include "kv/layout.h"
#include "model/backend.h"

typedef struct attn_case_spec {
    int32_t head_dim, block_size, n_kv_heads, group, window;
    kvf_dtype dtype;
    float k_scale, v_scale; /* fp8 only; 1 otherwise */
    float scale_mul;        /* softmax scale = scale_mul / sqrt(head_dim): > 1 makes it peaky */
    int32_t n_seqs, max_len, extra_ctx;
    uint32_t seed;
    bool decode_only; /* one token per sequence (a small batch: short partitions) */
} attn_case_spec;

typedef struct attn_case {
    kvf_kv_layout layout;
    int32_t layer, n_heads, n_tokens, n_seqs, max_blocks, max_ctx, n_blocks;
    uint8_t *pool; /* [n_blocks][block_bytes] */
    size_t pool_bytes;
    float *q;                                 /* [n_tokens][n_heads][head_dim] */
    int32_t *tok_seq, *tok_pos, *block_tables; /* [n_tokens], [n_tokens], [n_seqs][max_blocks] */
    float scale;
} attn_case;

static inline uint32_t attn_rng(uint32_t *s)
{
    uint32_t x = *s;
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    return *s = x;
}

static inline float attn_rng_unit(uint32_t *s) /* uniform in [-1, 1) */
{
    return (float)(attn_rng(s) >> 8) / (float)(1u << 23) - 1.0f;
}

/* The sweep the split algorithm and the GPU kernel both run: every dtype x GQA group 1/2/8 x
 * window off/short/long, cycling head_dim (every supported one, 48/80/96 included) and block size, contexts up to 700 (three partitions)
 * and max_ctx beyond the longest sequence. Fills out with ATTN_SWEEP_N specs (seeds 1 on). */
enum { ATTN_SWEEP_N = 4 * 3 * 3 };
static inline void attn_case_sweep(attn_case_spec out[ATTN_SWEEP_N])
{
    static const kvf_dtype dts[] = {KVF_DTYPE_F32, KVF_DTYPE_F16, KVF_DTYPE_BF16,
                                    KVF_DTYPE_FP8_E4M3};
    static const int32_t groups[] = {1, 2, 8}, windows[] = {0, 37, 300};
    static const int32_t hds[] = {16, 32, 48, 64, 80, 96, 128, 256}, bss[] = {8, 16, 32, 1, 64};
    uint32_t seed = 1;
    for (size_t d = 0; d < 4; d++)
        for (size_t g = 0; g < 3; g++)
            for (size_t w = 0; w < 3; w++, seed++) {
                attn_case_spec s = {.head_dim = hds[seed % 8], .block_size = bss[(seed / 5) % 5],
                                    .n_kv_heads = groups[g] == 8 ? 1 : 2, .group = groups[g],
                                    .window = windows[w], .dtype = dts[d], .k_scale = 1.0f,
                                    .v_scale = 1.0f, .scale_mul = (seed % 3) ? 1.0f : 6.0f,
                                    .n_seqs = 5, .max_len = 300 + (int32_t)(seed * 37 % 400),
                                    .extra_ctx = (int32_t)(seed * 13 % 300), .seed = seed};
                if (dts[d] == KVF_DTYPE_FP8_E4M3)
                    s.k_scale = 0.37f, s.v_scale = 2.5f;
                out[seed - 1] = s;
            }
}

/* Bytes allocated after the pool (NaN after attn_case_poison_unseen): a kernel that reads past
 * the pool's last row reads these. */
#define ATTN_CASE_POOL_SLACK 256

static inline void attn_case_free(attn_case *c)
{
    free(c->pool);
    free(c->q);
    free(c->tok_seq);
    free(c->tok_pos);
    free(c->block_tables);
    memset(c, 0, sizeof *c);
}

/* Builds a case; 0 on success. Sequence 0 is max_len long (so long contexts split), sequence
 * 1 shares half of sequence 0's full blocks, block ids are a random permutation of the pool,
 * every sequence contributes either one decode token or a prefill chunk over a cached prefix. */
static inline int attn_case_build(const attn_case_spec *s, attn_case *c)
{
    memset(c, 0, sizeof *c);
    uint32_t rng = s->seed * 2654435761u + 12345u;
    kvf_err err;
    if (kvf_kv_layout_init(2, s->n_kv_heads, s->head_dim, s->block_size, s->dtype, &c->layout,
                           &err) != KVF_OK) {
        fprintf(stderr, "layout: %s\n", err.msg);
        return -1;
    }
    int32_t bs = s->block_size;
    c->layer = 1;
    c->n_heads = s->n_kv_heads * s->group;
    c->n_seqs = s->n_seqs;
    c->scale = s->scale_mul / sqrtf((float)s->head_dim);
    int32_t *len = (int32_t *)calloc((size_t)s->n_seqs, sizeof *len);
    int32_t longest = 0;
    for (int32_t i = 0; i < s->n_seqs; i++) {
        len[i] = i == 0 ? s->max_len : 1 + (int32_t)(attn_rng(&rng) % (uint32_t)s->max_len);
        if (len[i] > longest)
            longest = len[i];
    }
    c->max_ctx = longest + s->extra_ctx;
    c->max_blocks = (int32_t)kvf_kv_blocks_for(c->max_ctx, bs);
    int32_t shared = s->n_seqs > 1 ? (len[0] < len[1] ? len[0] : len[1]) / bs / 2 : 0;
    int64_t need = 0;
    for (int32_t i = 0; i < s->n_seqs; i++)
        need += kvf_kv_blocks_for(len[i], bs) - (i == 1 ? shared : 0);
    c->n_blocks = (int32_t)need + 3;
    /* a random permutation of the pool's block ids, handed out in order */
    int32_t *perm = (int32_t *)malloc((size_t)c->n_blocks * sizeof *perm);
    for (int32_t i = 0; i < c->n_blocks; i++)
        perm[i] = i;
    for (int32_t i = c->n_blocks - 1; i > 0; i--) {
        int32_t j = (int32_t)(attn_rng(&rng) % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    c->block_tables = (int32_t *)calloc((size_t)s->n_seqs * c->max_blocks, sizeof(int32_t));
    int32_t next = 0;
    for (int32_t i = 0; i < s->n_seqs; i++) {
        int32_t *row = c->block_tables + (size_t)i * c->max_blocks;
        for (int32_t b = 0; b < c->max_blocks; b++)
            row[b] = -1; /* never read: positions stop at len */
        for (int32_t b = 0; b < kvf_kv_blocks_for(len[i], bs); b++)
            row[b] = (i == 1 && b < shared) ? c->block_tables[b] : perm[next++];
    }
    free(perm);
    /* tokens: a decode token or a prefill chunk ending at the sequence's length */
    c->tok_seq = (int32_t *)malloc((size_t)(s->n_seqs * 64) * sizeof(int32_t));
    c->tok_pos = (int32_t *)malloc((size_t)(s->n_seqs * 64) * sizeof(int32_t));
    for (int32_t i = 0; i < s->n_seqs; i++) {
        int32_t chunk = 1;
        if (attn_rng(&rng) % 2 && !s->decode_only) {
            int32_t cap = len[i] < 48 ? len[i] : 48;
            chunk = 1 + (int32_t)(attn_rng(&rng) % (uint32_t)cap);
        }
        for (int32_t p = len[i] - chunk; p < len[i]; p++) {
            c->tok_seq[c->n_tokens] = i;
            c->tok_pos[c->n_tokens] = p;
            c->n_tokens++;
        }
    }
    free(len);
    /* the pool: every element random in [-1, 1), stored in the layout's dtype */
    c->pool_bytes = (size_t)c->n_blocks * (size_t)c->layout.block_bytes;
    c->pool = (uint8_t *)aligned_alloc(64, (c->pool_bytes + ATTN_CASE_POOL_SLACK + 63) / 64 * 64);
    memset(c->pool + c->pool_bytes, 0, ATTN_CASE_POOL_SLACK);
    size_t es = kvf_dtype_size(s->dtype), n_el = c->pool_bytes / es;
    for (size_t i = 0; i < n_el; i++) {
        float f = attn_rng_unit(&rng);
        uint8_t *b = c->pool + i * es;
        uint16_t h;
        switch (s->dtype) {
        case KVF_DTYPE_F32:
            memcpy(b, &f, 4);
            break;
        case KVF_DTYPE_F16:
        case KVF_DTYPE_BF16:
            h = s->dtype == KVF_DTYPE_F16 ? kvf_f32_to_f16(f) : kvf_f32_to_bf16(f);
            b[0] = (uint8_t)(h & 0xff), b[1] = (uint8_t)(h >> 8);
            break;
        default:
            b[0] = kvf_f32_to_fp8e4m3(f);
            break;
        }
    }
    size_t nq = (size_t)c->n_tokens * c->n_heads * s->head_dim;
    c->q = (float *)malloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++)
        c->q[i] = attn_rng_unit(&rng);
    return 0;
}

/* Writes NaN (in the layout's dtype) over every KV row no token of the case may read: the
 * positions past each sequence's length in its last block, every block no table names, and
 * the slack after the pool. A kernel that reads past a row (a padded thread group's idle
 * lanes) or past the visible range then produces NaN instead of a plausible number. Call after
 * attn_case_build; the CPU backend and the reference never read these rows. */
static inline void attn_case_poison_unseen(attn_case *c)
{
    const kvf_kv_layout *l = &c->layout;
    size_t es = kvf_dtype_size(l->dtype);
    uint8_t nan_bytes[4];
    uint32_t f32_nan = 0x7fc00000u;
    switch (l->dtype) {
    case KVF_DTYPE_F32:
        memcpy(nan_bytes, &f32_nan, 4);
        break;
    case KVF_DTYPE_F16:
        nan_bytes[0] = 0x00, nan_bytes[1] = 0x7e;
        break;
    case KVF_DTYPE_BF16:
        nan_bytes[0] = 0xc0, nan_bytes[1] = 0x7f;
        break;
    default:
        nan_bytes[0] = 0x7f; /* e4m3: S.1111.111 is NaN */
        break;
    }
    /* whole blocks first: every block no table names */
    bool *used = (bool *)calloc((size_t)c->n_blocks, sizeof(bool));
    for (int64_t i = 0; i < (int64_t)c->n_seqs * c->max_blocks; i++)
        if (c->block_tables[i] >= 0)
            used[c->block_tables[i]] = true;
    for (int32_t b = 0; b < c->n_blocks; b++)
        if (!used[b])
            for (int64_t i = 0; i < l->block_bytes; i += (int64_t)es)
                memcpy(c->pool + b * l->block_bytes + i, nan_bytes, es);
    free(used);
    /* each sequence's last block past its length (the length: its last token's position + 1;
     * a partial last block is never shared) */
    for (int32_t s = 0; s < c->n_seqs; s++) {
        int32_t len = 0;
        for (int32_t t = 0; t < c->n_tokens; t++)
            if (c->tok_seq[t] == s && c->tok_pos[t] + 1 > len)
                len = c->tok_pos[t] + 1;
        if (len == 0 || len % l->block_size == 0)
            continue;
        int32_t blk = c->block_tables[(int64_t)s * c->max_blocks + (len - 1) / l->block_size];
        for (int32_t layer = 0; layer < l->n_layers; layer++)
            for (int part = 0; part < 2; part++)
                for (int32_t h = 0; h < l->n_kv_heads; h++)
                    for (int32_t off = len % l->block_size; off < l->block_size; off++) {
                        uint8_t *row = c->pool + kvf_kv_offset(l, blk, layer, (kvf_kv_part)part,
                                                               h, off);
                        for (int32_t e = 0; e < l->head_dim; e++)
                            memcpy(row + (size_t)e * es, nan_bytes, es);
                    }
    }
    for (size_t i = 0; i + es <= ATTN_CASE_POOL_SLACK; i += es)
        memcpy(c->pool + c->pool_bytes + i, nan_bytes, es);
}

/* The CPU backend's attention for the case, into out[n_tokens][n_heads][head_dim]. The CPU
 * backend reads fp8 without scales, so k_scale goes into q (q.(k*ks) = (q*ks).k) and v_scale
 * onto the output (sum w*(v*vs) = vs * sum w*v). Returns 0 on success. */
static inline int attn_case_cpu(const attn_case *c, const attn_case_spec *s, float *out)
{
    const kvf_backend *be = kvf_model_backend_cpu();
    kvf_backend_opts opts = {.n_threads = 2};
    void *ctx = NULL;
    kvf_err err;
    if (kvf_backend_create(be, &opts, &ctx, &err) != KVF_OK) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        return -1;
    }
    bool fp8 = s->dtype == KVF_DTYPE_FP8_E4M3;
    size_t nq = (size_t)c->n_tokens * c->n_heads * s->head_dim;
    float *q = (float *)malloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++)
        q[i] = fp8 ? c->q[i] * s->k_scale : c->q[i];
    kvf_backend_attn a = {.n_tokens = c->n_tokens, .n_heads = c->n_heads,
                          .n_kv_heads = s->n_kv_heads, .head_dim = s->head_dim,
                          .tok_seq = c->tok_seq, .tok_pos = c->tok_pos,
                          .block_tables = c->block_tables, .max_blocks = c->max_blocks,
                          .window = s->window, .scale = c->scale};
    kvf_backend_attention(be, ctx, q, c->pool, &c->layout, c->layer, &a, out);
    if (fp8)
        for (size_t i = 0; i < nq; i++)
            out[i] *= s->v_scale;
    free(q);
    kvf_backend_destroy(be, ctx);
    return 0;
}

/* Parameters for the case with the given (host or device) pointers; n_seqs is given, so a case
 * with prefill chunks runs them on a tile kernel (its decode tokens on the partition kernel). */
static inline kvf_cuda_attn_params attn_case_params(const attn_case *c, const attn_case_spec *s,
                                                    const float *q, float *out, const void *pool,
                                                    const int32_t *tok_seq,
                                                    const int32_t *tok_pos,
                                                    const int32_t *block_tables, float *ws,
                                                    size_t ws_bytes)
{
    kvf_cuda_attn_params p = {
        .q = q, .out = out, .pool = pool, .layout = c->layout, .layer = c->layer,
        .n_tokens = c->n_tokens, .n_heads = c->n_heads, .n_seqs = c->n_seqs,
        .tok_seq = tok_seq, .tok_pos = tok_pos,
        .block_tables = block_tables, .max_blocks = c->max_blocks, .max_ctx = c->max_ctx,
        .window = s->window, .scale = c->scale,
        .k_scale = s->dtype == KVF_DTYPE_FP8_E4M3 ? s->k_scale : 1.0f,
        .v_scale = s->dtype == KVF_DTYPE_FP8_E4M3 ? s->v_scale : 1.0f,
        .workspace = ws, .workspace_bytes = ws_bytes};
    return p;
}

/* Largest |a - b| beyond atol + rtol * |b|, as a ratio (<= 1 passes); where the worst is. */
static inline double attn_close(const float *a, const float *b, size_t n, double atol,
                                double rtol, size_t *worst_out)
{
    double worst = 0;
    size_t wi = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]), lim = atol + rtol * fabs((double)b[i]);
        double r = isfinite(d) ? d / lim : INFINITY;
        if (r > worst || !isfinite(r)) {
            worst = r;
            wi = i;
        }
    }
    if (worst_out)
        *worst_out = wi;
    return worst;
}

#endif
