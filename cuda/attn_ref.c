/* attn_ref.c: the host side of paged attention: the shape and parameter checks the launcher
 * runs, the workspace size, and a plain-C reference of the kernel's split-context algorithm
 * (attn_ref.h) that runs without a GPU. The kernels themselves are in attn.cu. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "cuda/attn.h"
#include "cuda/attn_ref.h"

#define ATTN_LOG2E 1.4426950408889634f

/* attn.cu's attn_pick instantiates these (48, 80 and 96 on a thread group padded to 64, 128
 * and 128 lanes' worth of columns); keep the three lists in step. */
static const int32_t attn_head_dims[] = {16, 32, 48, 64, 80, 96, 128, 256};
#define ATTN_HEAD_DIMS_TEXT "16, 32, 48, 64, 80, 96, 128 or 256"
#define ATTN_GRID_YZ_MAX 65535

int32_t kvf_cuda_attention_part_len(int32_t n_tokens, int32_t n_heads, int32_t max_ctx)
{
    int64_t th = (int64_t)(n_tokens > 0 ? n_tokens : 1) * (n_heads > 0 ? n_heads : 1);
    int64_t ctx = max_ctx > 0 ? max_ctx : 1, len = KVF_CUDA_ATTN_PART_MAX;
    if (ctx <= KVF_CUDA_ATTN_PART_MAX)
        return (int32_t)len; /* one partition: no workspace, no reduce */
    while (len > KVF_CUDA_ATTN_PART_MIN && th * ((ctx + len - 1) / len) < KVF_CUDA_ATTN_SPLIT_TARGET)
        len /= 2;
    return (int32_t)len;
}

int32_t kvf_cuda_attention_parts(int32_t n_tokens, int32_t n_heads, int32_t max_ctx)
{
    if (max_ctx <= 0)
        return 1;
    int64_t len = kvf_cuda_attention_part_len(n_tokens, n_heads, max_ctx);
    return (int32_t)(((int64_t)max_ctx + len - 1) / len);
}

int kvf_cuda_attention_tiled(int32_t n_tokens, int32_t n_seqs)
{
    return n_seqs > 0 && n_seqs < n_tokens;
}

int32_t kvf_cuda_attention_tile_part_len(int32_t n_tokens, int32_t n_heads, int32_t max_ctx)
{
    int64_t rows = (int64_t)(n_tokens > 0 ? n_tokens : 1) * (n_heads > 0 ? n_heads : 1);
    int64_t ctx = max_ctx > 0 ? max_ctx : 1, unit = KVF_CUDA_ATTN_PART_MAX;
    int64_t ctas = (rows + KVF_CUDA_ATTN_MMA_ROWS - 1) / KVF_CUDA_ATTN_MMA_ROWS;
    int64_t want = (KVF_CUDA_ATTN_TILE_CTA_TARGET + ctas - 1) / ctas;
    int64_t most = (ctx + unit - 1) / unit;
    if (want > most)
        want = most;
    if (want < 1)
        want = 1;
    int64_t len = (ctx + want - 1) / want;
    return (int32_t)((len + unit - 1) / unit * unit);
}

int32_t kvf_cuda_attention_split(int32_t n_tokens, int32_t n_seqs, int32_t n_heads,
                                 int32_t max_ctx, int32_t *len_out)
{
    int64_t len = kvf_cuda_attention_tiled(n_tokens, n_seqs)
                      ? kvf_cuda_attention_tile_part_len(n_tokens, n_heads, max_ctx)
                      : kvf_cuda_attention_part_len(n_tokens, n_heads, max_ctx);
    if (len_out)
        *len_out = (int32_t)len;
    return max_ctx <= 0 ? 1 : (int32_t)(((int64_t)max_ctx + len - 1) / len);
}

/* floats of partials for rows (token or sequence) x heads x parts; 0 when not split */
static size_t attn_partials(int32_t rows, int32_t n_heads, int32_t parts, int32_t head_dim)
{
    if (parts <= 1)
        return 0;
    return (size_t)rows * (size_t)n_heads * (size_t)parts * ((size_t)head_dim + 2);
}

void kvf_cuda_attention_ws(int32_t n_tokens, int32_t n_seqs, int32_t n_heads, int32_t head_dim,
                           int32_t max_ctx, kvf_cuda_attn_ws *out)
{
    memset(out, 0, sizeof *out);
    out->parts = kvf_cuda_attention_split(n_tokens, n_seqs, n_heads, max_ctx, &out->part_len);
    if (n_tokens <= 0 || n_heads <= 0 || head_dim <= 0)
        return;
    size_t floats = attn_partials(n_tokens, n_heads, out->parts, head_dim);
    if (kvf_cuda_attention_tiled(n_tokens, n_seqs)) {
        out->lone_part_len = kvf_cuda_attention_part_len(n_tokens, n_heads, max_ctx);
        out->lone_parts = kvf_cuda_attention_parts(n_tokens, n_heads, max_ctx);
        floats = (floats + 3) & ~(size_t)3; /* 16-byte aligned partials: the reduce's loads */
        out->lone_off = floats;
        floats += attn_partials(n_seqs, n_heads, out->lone_parts, head_dim);
        out->count_off = floats;
        floats += 2 * (size_t)n_seqs; /* int32 counts and token ids, one float's room each */
    }
    out->bytes = floats * sizeof(float);
}

size_t kvf_cuda_attention_workspace_bytes(int32_t n_tokens, int32_t n_seqs, int32_t n_heads,
                                          int32_t head_dim, int32_t max_ctx)
{
    kvf_cuda_attn_ws w;
    kvf_cuda_attention_ws(n_tokens, n_seqs, n_heads, head_dim, max_ctx, &w);
    if (n_seqs == 0 && n_tokens > 1) { /* the most any n_seqs needs: the partition kernel's, or
                                        * a step with chunks and n_tokens - 1 sequences (a mixed
                                        * step's workspace grows with n_seqs) */
        kvf_cuda_attn_ws m;
        kvf_cuda_attention_ws(n_tokens, n_tokens - 1, n_heads, head_dim, max_ctx, &m);
        if (m.bytes > w.bytes)
            return m.bytes;
    }
    return w.bytes;
}

kvf_status kvf_cuda_attention_supports(const kvf_kv_layout *l, int32_t n_heads, kvf_err *err)
{
    if (!l)
        return kvf_err_set(err, KVF_ERR_INVALID, "attn: no KV layout given");
    if (l->dtype != KVF_DTYPE_F32 && l->dtype != KVF_DTYPE_F16 && l->dtype != KVF_DTYPE_BF16 &&
        l->dtype != KVF_DTYPE_FP8_E4M3)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "attn: KV dtype %d is not supported (use f32, f16, bf16 or fp8-e4m3)",
                           (int)l->dtype);
    bool hd_ok = false;
    for (size_t i = 0; i < sizeof attn_head_dims / sizeof attn_head_dims[0]; i++)
        hd_ok |= l->head_dim == attn_head_dims[i];
    if (!hd_ok)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "attn: head_dim %d is not supported (use " ATTN_HEAD_DIMS_TEXT ")",
                           l->head_dim);
    if (l->block_size < 1 || l->block_size > KVF_KV_MAX_BLOCK_SIZE ||
        (l->block_size & (l->block_size - 1)) != 0)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "attn: block_size %d is not supported (use a power of two from 1 to %d, "
                           "e.g. 8, 16 or 32)",
                           l->block_size, KVF_KV_MAX_BLOCK_SIZE);
    if (l->n_kv_heads < 1 || l->n_layers < 1)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "attn: layout has %d KV heads and %d layers (both must be >= 1)",
                           l->n_kv_heads, l->n_layers);
    if (n_heads < 1 || n_heads % l->n_kv_heads != 0)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "attn: %d query heads is not a positive multiple of %d KV heads",
                           n_heads, l->n_kv_heads);
    int64_t group = n_heads / l->n_kv_heads;
    int64_t chunks = (group + KVF_CUDA_ATTN_HEADS_PER_CTA - 1) / KVF_CUDA_ATTN_HEADS_PER_CTA;
    if (chunks * l->n_kv_heads > ATTN_GRID_YZ_MAX)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "attn: %d query heads over %d KV heads need %lld head chunks (at most %d)",
                           n_heads, l->n_kv_heads, (long long)(chunks * l->n_kv_heads),
                           ATTN_GRID_YZ_MAX);
    int64_t want = kvf_kv_bytes_per_token(l) * l->block_size;
    if (l->block_bytes != want)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "attn: layout block_bytes %lld does not match its shape (%lld)",
                           (long long)l->block_bytes, (long long)want);
    return KVF_OK;
}

static bool attn_finite_pos(float x)
{
    return isfinite(x) && x > 0.0f;
}

int kvf_cuda_attn_decode_mma_serves(const kvf_kv_layout *layout)
{
    /* attn.cu's attn_dec_ok */
    return (layout->head_dim == 64 || layout->head_dim == 128) &&
           (layout->dtype == KVF_DTYPE_F16 || layout->dtype == KVF_DTYPE_BF16 ||
            layout->dtype == KVF_DTYPE_FP8_E4M3);
}

kvf_status kvf_cuda_attn_check(const kvf_cuda_attn_params *p, kvf_err *err)
{
    if (!p)
        return kvf_err_set(err, KVF_ERR_INVALID, "attn: no parameters given");
    kvf_status st = kvf_cuda_attention_supports(&p->layout, p->n_heads, err);
    if (st != KVF_OK)
        return st;
    const kvf_kv_layout *l = &p->layout;
    if (p->layer < 0 || p->layer >= l->n_layers)
        return kvf_err_set(err, KVF_ERR_INVALID, "attn: layer %d is out of range (0..%d)",
                           p->layer, l->n_layers - 1);
    if (p->n_tokens < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "attn: n_tokens %d is negative", p->n_tokens);
    if (p->decode_kernel < 0 || p->decode_kernel >= KVF_BACKEND_ATTN_DECODE_COUNT)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "attn: decode_kernel %d is not one of 0 (auto), 1 (simt), 2 (mma)",
                           p->decode_kernel);
    if (p->n_tokens == 0)
        return KVF_OK;
    if (!p->q || !p->out || !p->pool || !p->tok_seq || !p->tok_pos || !p->block_tables)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "attn: a required pointer is NULL (q %s, out %s, pool %s, tok_seq %s, "
                           "tok_pos %s, block_tables %s)",
                           p->q ? "set" : "NULL", p->out ? "set" : "NULL",
                           p->pool ? "set" : "NULL", p->tok_seq ? "set" : "NULL",
                           p->tok_pos ? "set" : "NULL", p->block_tables ? "set" : "NULL");
    if ((uintptr_t)p->pool % 16 != 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "attn: the pool address is not 16-byte aligned (vector loads need it)");
    if (p->max_blocks < 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "attn: max_blocks %d must be >= 1",
                           p->max_blocks);
    if (p->max_ctx < 1 || (int64_t)p->max_ctx > (int64_t)p->max_blocks * l->block_size)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "attn: max_ctx %d is out of range (1..max_blocks %d * block_size %d)",
                           p->max_ctx, p->max_blocks, l->block_size);
    if (kvf_cuda_attention_parts(p->n_tokens, p->n_heads, p->max_ctx) > ATTN_GRID_YZ_MAX)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "attn: max_ctx %d needs more than %d partitions",
                           p->max_ctx, ATTN_GRID_YZ_MAX);
    if (p->window < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "attn: window %d is negative (0 = all)",
                           p->window);
    if (!attn_finite_pos(p->scale))
        return kvf_err_set(err, KVF_ERR_INVALID, "attn: scale %g must be finite and > 0",
                           (double)p->scale);
    if (l->dtype == KVF_DTYPE_FP8_E4M3 &&
        (!attn_finite_pos(p->k_scale) || !attn_finite_pos(p->v_scale)))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "attn: fp8 KV needs finite k_scale and v_scale > 0 (got %g and %g)",
                           (double)p->k_scale, (double)p->v_scale);
    if (p->n_seqs < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "attn: n_seqs %d is negative (0 = not known)",
                           p->n_seqs);
    size_t need = kvf_cuda_attention_workspace_bytes(p->n_tokens, p->n_seqs, p->n_heads,
                                                     l->head_dim, p->max_ctx);
    if (need > 0 && (!p->workspace || p->workspace_bytes < need))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "attn: workspace of %zu bytes%s is too small: %d tokens (%d sequences) "
                           "x %d heads at max_ctx %d need %zu (kvf_cuda_attention_workspace_bytes)",
                           p->workspace ? p->workspace_bytes : (size_t)0,
                           p->workspace ? "" : " (NULL)", p->n_tokens, p->n_seqs, p->n_heads,
                           p->max_ctx, need);
    return KVF_OK;
}

/* ---- the reference */

/* Row of head_dim elements of the layout's dtype at src, as floats. */
static void attn_row_f32(const uint8_t *src, kvf_dtype dt, int32_t n, float *out)
{
    for (int32_t i = 0; i < n; i++) {
        switch (dt) {
        case KVF_DTYPE_F32:
            memcpy(&out[i], src + 4 * (size_t)i, 4);
            break;
        case KVF_DTYPE_F16:
            out[i] = kvf_f16_to_f32((uint16_t)(src[2 * i] | (src[2 * i + 1] << 8)));
            break;
        case KVF_DTYPE_BF16:
            out[i] = kvf_bf16_to_f32((uint16_t)(src[2 * i] | (src[2 * i + 1] << 8)));
            break;
        default:
            out[i] = kvf_fp8e4m3_to_f32(src[i]);
            break;
        }
    }
}

/* The multipliers the launcher hands the kernel (one float each, computed the same way). */
static float attn_q_mul(const kvf_cuda_attn_params *p)
{
    float ks = p->layout.dtype == KVF_DTYPE_FP8_E4M3 ? p->k_scale : 1.0f;
    return p->scale * ks * ATTN_LOG2E;
}

static float attn_v_mul(const kvf_cuda_attn_params *p)
{
    return p->layout.dtype == KVF_DTYPE_FP8_E4M3 ? p->v_scale : 1.0f;
}

/* One partition [p0, p1) of (token t, head h): writes o[head_dim], *m, *l. qs is the scaled
 * query; s and row are scratch of at least the partition length and head_dim floats. */
static void attn_ref_part(const kvf_cuda_attn_params *p, const int32_t *bt, int32_t kvh,
                          const float *qs, int32_t p0, int32_t p1, float *s, float *row,
                          float *o, float *m_out, float *l_out)
{
    const kvf_kv_layout *l = &p->layout;
    const uint8_t *pool = p->pool;
    int32_t hd = l->head_dim, bs = l->block_size;
    float m = -INFINITY;
    for (int32_t i = p0; i < p1; i++) {
        int64_t off = kvf_kv_offset(l, bt[i / bs], p->layer, KVF_KV_K, kvh, i % bs);
        attn_row_f32(pool + off, l->dtype, hd, row);
        float d = 0.0f;
        for (int32_t e = 0; e < hd; e++)
            d += qs[e] * row[e];
        s[i - p0] = d;
        if (d > m)
            m = d;
    }
    float sum = 0.0f;
    for (int32_t d = 0; d < hd; d++)
        o[d] = 0.0f;
    for (int32_t i = p0; i < p1; i++) {
        float w = exp2f(s[i - p0] - m);
        sum += w;
        int64_t off = kvf_kv_offset(l, bt[i / bs], p->layer, KVF_KV_V, kvh, i % bs);
        attn_row_f32(pool + off, l->dtype, hd, row);
        for (int32_t e = 0; e < hd; e++)
            o[e] += w * row[e];
    }
    float f = attn_v_mul(p) / sum;
    for (int32_t e = 0; e < hd; e++)
        o[e] *= f;
    *m_out = m;
    *l_out = sum;
}

kvf_status kvf_cuda_attn_ref(const kvf_cuda_attn_params *p, kvf_err *err)
{
    kvf_status st = kvf_cuda_attn_check(p, err);
    if (st != KVF_OK || p->n_tokens == 0)
        return st;
    const kvf_kv_layout *l = &p->layout;
    int32_t hd = l->head_dim, group = p->n_heads / l->n_kv_heads;
    int32_t plen = 0;
    int32_t parts = kvf_cuda_attention_split(p->n_tokens, p->n_seqs, p->n_heads, p->max_ctx, &plen);
    for (int32_t t = 0; t < p->n_tokens; t++)
        if (p->tok_pos[t] < 0 || p->tok_pos[t] >= p->max_ctx || p->tok_seq[t] < 0)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "attn: token %d has position %d (0..max_ctx %d - 1) and sequence %d",
                               t, p->tok_pos[t], p->max_ctx, p->tok_seq[t]);

    float *scratch = malloc(((size_t)plen + 3 * (size_t)hd) * sizeof(float));
    if (!scratch)
        return kvf_err_set(err, KVF_ERR_NOMEM, "attn: no memory for the reference's scratch");
    float *s = scratch, *row = s + plen, *qs = row + hd, *o1 = qs + hd;
    size_t n_all = (size_t)p->n_tokens * p->n_heads * parts;
    float *ws_o = p->workspace, *ws_m = ws_o + n_all * hd, *ws_l = ws_m + n_all;
    float qmul = attn_q_mul(p);

    for (int32_t t = 0; t < p->n_tokens; t++) {
        int32_t pos = p->tok_pos[t];
        int32_t lo = (p->window > 0 && pos - p->window + 1 > 0) ? pos - p->window + 1 : 0;
        const int32_t *bt = p->block_tables + (int64_t)p->tok_seq[t] * p->max_blocks;
        for (int32_t h = 0; h < p->n_heads; h++) {
            const float *q = p->q + ((int64_t)t * p->n_heads + h) * hd;
            float *out = p->out + ((int64_t)t * p->n_heads + h) * hd;
            for (int32_t e = 0; e < hd; e++)
                qs[e] = q[e] * qmul;
            int32_t pa = lo / plen, pb = pos / plen;
            /* the partition (or tile) kernel: every non-empty partition of this token */
            for (int32_t pp = pa; pp <= pb; pp++) {
                int32_t p0 = pp * plen, p1 = p0 + plen;
                if (p0 < lo)
                    p0 = lo;
                if (p1 > pos + 1)
                    p1 = pos + 1;
                size_t i = ((size_t)t * p->n_heads + h) * parts + pp;
                if (parts == 1) {
                    float m, sum;
                    attn_ref_part(p, bt, h / group, qs, p0, p1, s, row, out, &m, &sum);
                } else {
                    attn_ref_part(p, bt, h / group, qs, p0, p1, s, row, ws_o + i * hd, &ws_m[i],
                                  &ws_l[i]);
                }
            }
            if (parts == 1)
                continue;
            /* the reduce kernel */
            size_t base = ((size_t)t * p->n_heads + h) * parts;
            float mx = -INFINITY;
            for (int32_t pp = pa; pp <= pb; pp++)
                mx = fmaxf(mx, ws_m[base + pp]);
            float wsum = 0.0f;
            for (int32_t e = 0; e < hd; e++)
                o1[e] = 0.0f;
            for (int32_t pp = pa; pp <= pb; pp++) {
                float w = ws_l[base + pp] * exp2f(ws_m[base + pp] - mx);
                wsum += w;
                for (int32_t e = 0; e < hd; e++)
                    o1[e] += w * ws_o[(base + pp) * hd + e];
            }
            for (int32_t e = 0; e < hd; e++)
                out[e] = o1[e] / wsum;
        }
    }
    free(scratch);
    return KVF_OK;
}
