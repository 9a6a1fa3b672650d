/* forward.c: the Llama-family forward pass (RMSNorm, RoPE, GQA attention over paged KV, SwiGLU
 * MLP, tied or separate LM head) written once over kvf_backend. It validates a batch, lays out
 * per-token metadata in one preallocated block (one upload a step) and calls the backend's ops
 * layer by layer, through the kvf_backend_* wrappers (backend.c has the optional ops' defaults). */
#include "model/forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"

typedef struct fwd_layer_w {
    kvf_backend_weight attn_norm, wq, wk, wv, wo, bq, bk, bv, bo;
    kvf_backend_weight ffn_norm, w_gate, w_up, w_down, b_gate, b_up, b_down;
} fwd_layer_w;

struct kvf_model_fwd {
    const kvf_model *m;
    const kvf_backend *be;
    void *ctx;
    kvf_kv_layout layout;
    kvf_model_fwd_opts opts;
    int32_t max_blocks; /* per sequence */
    double *inv_freq;   /* [head_dim/2] */
    double pos_scale;

    kvf_backend_weight embed, final_norm, lm_head_own;
    const kvf_backend_weight *lm_head; /* &embed when tied */
    fwd_layer_w *layers;

    /* backend scratch */
    float *x, *xb, *q, *k, *v, *att, *hg, *hu, *xs, *logits;
    /* A step's metadata: one backend block (meta) and its host twin (h_meta), laid out per step
     * by meta_place; the pointers below point into them. */
    uint8_t *meta, *h_meta;
    size_t meta_bytes; /* the current step's, from the start of the block */
    float *cos_sin;
    int32_t *tokens, *tok_seq, *tok_pos, *tables, *last_rows;
    int64_t *slots;
    int32_t *h_tokens, *h_tok_seq, *h_tok_pos, *h_tables, *h_last_rows;
    int64_t *h_slots;
    float *h_cos_sin;
    kvf_backend_sample_row *h_draw; /* [max_seqs]: the rows of a step that samples */

    /* profile (kvf_model_fwd_set_prof): the step's marks, each the kind of op it starts (or
     * KVF_FWD_OP_COUNT: the end), and their host times when the backend has no clock of its own
     * (kvf_backend_has_prof_clock) */
    kvf_model_fwd_prof *prof;
    int32_t n_marks, max_marks;
    int8_t *mark_op;
    int64_t *mark_ns;
    double *mark_ms;
};

static void free_w(kvf_model_fwd *f, kvf_backend_weight *w)
{
    if (w->data)
        kvf_backend_weight_unload(f->be, f->ctx, w);
}

void kvf_model_fwd_destroy(kvf_model_fwd *f)
{
    if (!f)
        return;
    free(f->mark_op);
    free(f->mark_ns);
    free(f->mark_ms);
    if (f->layers) {
        for (int32_t i = 0; i < f->m->cfg.n_layers; i++) {
            fwd_layer_w *L = &f->layers[i];
            kvf_backend_weight *ws[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq,
                                        &L->bk, &L->bv, &L->bo, &L->ffn_norm, &L->w_gate,
                                        &L->w_up, &L->w_down, &L->b_gate, &L->b_up, &L->b_down};
            for (size_t j = 0; j < sizeof ws / sizeof ws[0]; j++)
                free_w(f, ws[j]);
        }
        free(f->layers);
    }
    free_w(f, &f->embed);
    free_w(f, &f->final_norm);
    free_w(f, &f->lm_head_own);
    void *bufs[] = {f->x, f->xb, f->q, f->k, f->v, f->att, f->hg, f->hu, f->xs, f->logits,
                    f->meta};
    for (size_t j = 0; j < sizeof bufs / sizeof bufs[0]; j++)
        if (bufs[j])
            kvf_backend_free(f->be, f->ctx, bufs[j]);
    free(f->h_meta);
    free(f->h_draw);
    free(f->inv_freq);
    free(f);
}

static void run_ops(kvf_model_fwd *f, void *kv_pool, int32_t T, int32_t n_seqs,
                    kvf_backend_attn *attn);

/* Loads t (which may be NULL: an absent bias) into w. */
static kvf_status load_w(kvf_model_fwd *f, const kvf_model_tensor *t, kvf_backend_weight *w,
                         kvf_err *err)
{
    if (!t)
        return KVF_OK;
    return kvf_backend_weight_load(f->be, f->ctx, t, w, err);
}

static kvf_status load_weights(kvf_model_fwd *f, kvf_err *err)
{
    const kvf_model *m = f->m;
    kvf_status st;
    if ((st = load_w(f, m->embed, &f->embed, err)) != KVF_OK ||
        (st = load_w(f, m->final_norm, &f->final_norm, err)) != KVF_OK)
        return st;
    if (m->lm_head == m->embed) {
        f->lm_head = &f->embed;
    } else {
        if ((st = load_w(f, m->lm_head, &f->lm_head_own, err)) != KVF_OK)
            return st;
        f->lm_head = &f->lm_head_own;
    }
    f->layers = calloc((size_t)m->cfg.n_layers, sizeof *f->layers);
    if (!f->layers)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory for layer weights");
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        const kvf_model_layer *s = &m->layers[i];
        fwd_layer_w *L = &f->layers[i];
        const kvf_model_tensor *ts[] = {s->attn_norm, s->wq, s->wk, s->wv, s->wo, s->bq, s->bk,
                                        s->bv, s->bo, s->ffn_norm, s->w_gate, s->w_up, s->w_down,
                                        s->b_gate, s->b_up, s->b_down};
        kvf_backend_weight *ws[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq, &L->bk,
                                    &L->bv, &L->bo, &L->ffn_norm, &L->w_gate, &L->w_up, &L->w_down,
                                    &L->b_gate, &L->b_up, &L->b_down};
        for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++)
            if ((st = load_w(f, ts[j], ws[j], err)) != KVF_OK)
                return st;
    }
    return KVF_OK;
}

static kvf_status scratch(kvf_model_fwd *f, void *p, size_t bytes, kvf_err *err)
{
    return kvf_backend_alloc(f->be, f->ctx, bytes ? bytes : 1, (void **)p, err);
}

static kvf_status host(void *p, size_t bytes, kvf_err *err)
{
    void *q = calloc(1, bytes ? bytes : 1);
    if (!q)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory for %zu bytes of step metadata", bytes);
    *(void **)p = q;
    return KVF_OK;
}

/* Lays out a step of T tokens and S sequences in the metadata block: each array at a 256-byte
 * boundary, in an order fixed by (T, S) alone, so steps with equal graph keys (backend.h) see
 * equal addresses. Points the metadata pointers into meta and h_meta (when allocated) and
 * returns the bytes used. */
static size_t meta_place(kvf_model_fwd *f, int32_t T, int32_t S)
{
    size_t half = (size_t)f->m->cfg.head_dim / 2, off = 0;
    struct { void *dev, *host; size_t bytes; } a[] = {
        {&f->cos_sin, &f->h_cos_sin, (size_t)T * half * 2 * sizeof(float)},
        {&f->slots, &f->h_slots, (size_t)T * sizeof(int64_t)},
        {&f->tokens, &f->h_tokens, (size_t)T * sizeof(int32_t)},
        {&f->tok_seq, &f->h_tok_seq, (size_t)T * sizeof(int32_t)},
        {&f->tok_pos, &f->h_tok_pos, (size_t)T * sizeof(int32_t)},
        {&f->tables, &f->h_tables, (size_t)S * f->max_blocks * sizeof(int32_t)},
        {&f->last_rows, &f->h_last_rows, (size_t)S * sizeof(int32_t)},
    };
    for (size_t i = 0; i < sizeof a / sizeof a[0]; i++) {
        off = (off + 255) & ~(size_t)255;
        *(void **)a[i].dev = f->meta ? f->meta + off : NULL;
        *(void **)a[i].host = f->h_meta ? f->h_meta + off : NULL;
        off += a[i].bytes;
    }
    return off;
}

kvf_status kvf_model_fwd_create(const kvf_model *m, const kvf_backend *be, void *be_ctx,
                                const kvf_kv_layout *layout, const kvf_model_fwd_opts *opts,
                                kvf_model_fwd **out, kvf_err *err)
{
    const kvf_model_config *c = &m->cfg;
    kvf_model_fwd_opts o = *opts;
    if (o.max_ctx == 0)
        o.max_ctx = c->max_pos;
    if (o.max_tokens <= 0 || o.max_seqs <= 0 || o.max_ctx <= 0 || o.max_seqs > o.max_tokens)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "model: forward limits max_tokens %d, max_seqs %d, max_ctx %d must be positive with max_seqs <= max_tokens",
                           o.max_tokens, o.max_seqs, o.max_ctx);
    if (layout->n_layers != c->n_layers || layout->n_kv_heads != c->n_kv_heads ||
        layout->head_dim != c->head_dim)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "model: KV layout (%d layers, %d kv heads, head_dim %d) does not match the model (%d, %d, %d)",
                           layout->n_layers, layout->n_kv_heads, layout->head_dim, c->n_layers,
                           c->n_kv_heads, c->head_dim);
    if (layout->dtype != KVF_DTYPE_F32 && layout->dtype != KVF_DTYPE_F16 &&
        layout->dtype != KVF_DTYPE_BF16 && layout->dtype != KVF_DTYPE_FP8_E4M3)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "model: KV dtype %s is not supported by the forward pass (use f32, f16, bf16 or fp8-e4m3)",
                           kvf_dtype_name(layout->dtype));
    kvf_status sst = kvf_backend_supports(be, be_ctx, layout, c->n_heads, err);
    if (sst != KVF_OK)
        return sst;
    kvf_model_fwd *f = calloc(1, sizeof *f);
    if (!f)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory");
    f->m = m;
    f->be = be;
    f->ctx = be_ctx;
    f->layout = *layout;
    f->opts = o;
    f->max_blocks = (int32_t)kvf_kv_blocks_for(o.max_ctx, layout->block_size);
    kvf_status st;
    if ((st = host(&f->inv_freq, sizeof(double) * (size_t)(c->head_dim / 2), err)) != KVF_OK)
        goto fail;
    kvf_model_config_rope_freqs(c, f->inv_freq, &f->pos_scale);
    if ((st = load_weights(f, err)) != KVF_OK)
        goto fail;

    size_t T = (size_t)o.max_tokens, S = (size_t)o.max_seqs, F = sizeof(float);
    size_t dim = (size_t)c->dim, qd = (size_t)c->n_heads * c->head_dim,
           kvd = (size_t)c->n_kv_heads * c->head_dim, hid = (size_t)c->hidden_dim;
    if ((st = scratch(f, &f->x, T * dim * F, err)) != KVF_OK ||
        (st = scratch(f, &f->xb, T * dim * F, err)) != KVF_OK ||
        (st = scratch(f, &f->q, T * qd * F, err)) != KVF_OK ||
        (st = scratch(f, &f->k, T * kvd * F, err)) != KVF_OK ||
        (st = scratch(f, &f->v, T * kvd * F, err)) != KVF_OK ||
        (st = scratch(f, &f->att, T * qd * F, err)) != KVF_OK ||
        (st = scratch(f, &f->hg, T * hid * F, err)) != KVF_OK ||
        (st = scratch(f, &f->hu, T * hid * F, err)) != KVF_OK ||
        (st = scratch(f, &f->xs, S * dim * F, err)) != KVF_OK ||
        (st = scratch(f, &f->logits, S * (size_t)c->vocab_size * F, err)) != KVF_OK ||
        (st = scratch(f, &f->meta, meta_place(f, o.max_tokens, o.max_seqs), err)) != KVF_OK ||
        (st = host(&f->h_meta, meta_place(f, o.max_tokens, o.max_seqs), err)) != KVF_OK ||
        (st = host(&f->h_draw, S * sizeof *f->h_draw, err)) != KVF_OK)
        goto fail;
    *out = f;
    return KVF_OK;
fail:
    kvf_model_fwd_destroy(f);
    return st;
}

const kvf_model_fwd_opts *kvf_model_fwd_limits(const kvf_model_fwd *f)
{
    return &f->opts;
}

bool kvf_model_fwd_samples(const kvf_model_fwd *f)
{
    return kvf_backend_can_sample(f->be);
}

/* Checks a sequence's draw (kvf_backend_sample_row) before the step runs. */
static kvf_status check_draw(const kvf_model_fwd *f, int32_t s, const kvf_backend_sample_row *d,
                             kvf_err *err)
{
    if (!kvf_backend_can_sample(f->be))
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "model: forward: sequence %d asks for a draw "
                           "on the backend and backend %s cannot sample", s,
                           kvf_backend_name(f->be));
    if (!(d->temperature > 0.0f) || d->top_k < 0 || !(d->top_p > 0.0f && d->top_p <= 1.0f) ||
        !(d->u >= 0.0f && d->u < 1.0f))
        return kvf_err_set(err, KVF_ERR_INVALID, "model: forward: sequence %d: draw with "
                           "temperature %g (> 0), top_k %d (>= 0), top_p %g (0 < p <= 1), u %g "
                           "(0 <= u < 1)", s, (double)d->temperature, d->top_k, (double)d->top_p,
                           (double)d->u);
    return KVF_OK;
}

/* The attention context bound of a step whose furthest position is max_pos: the next power of
 * two (at least 64), capped by the forward pass's max_ctx, so steps of a growing decode keep
 * one shape (one recorded graph) for many tokens. */
static int32_t ctx_bucket(const kvf_model_fwd *f, int32_t max_pos)
{
    int64_t b = 64;
    while (b < (int64_t)max_pos + 1)
        b *= 2;
    return b > f->opts.max_ctx ? f->opts.max_ctx : (int32_t)b;
}

/* Checks the batch and fills the host metadata; returns the number of tokens. */
static kvf_status prepare(kvf_model_fwd *f, const kvf_model_seq *seqs, int32_t n_seqs,
                          int64_t n_pool_blocks, int32_t *n_tokens_out, kvf_err *err)
{
    const kvf_model_config *c = &f->m->cfg;
    if (!seqs || n_seqs <= 0 || n_seqs > f->opts.max_seqs)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: forward: %d sequences in a step (allowed: 1 to %d)",
                           n_seqs, f->opts.max_seqs);
    int32_t T = 0, half = c->head_dim / 2, bs = f->layout.block_size;
    for (int32_t s = 0; s < n_seqs; s++) {
        const kvf_model_seq *q = &seqs[s];
        if (!q->tokens || q->n_tokens <= 0 || q->n_tokens > f->opts.max_tokens - T)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "model: forward: sequence %d brings %d tokens; the step holds %d tokens in all (%d used before it)",
                               s, q->n_tokens, f->opts.max_tokens, T);
        kvf_status st;
        if (q->sample && (st = check_draw(f, s, q->sample, err)) != KVF_OK)
            return st;
        T += q->n_tokens;
    }
    f->meta_bytes = meta_place(f, T, n_seqs);
    T = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const kvf_model_seq *q = &seqs[s];
        if (q->start_pos < 0 || q->start_pos > f->opts.max_ctx - q->n_tokens)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "model: forward: sequence %d: positions %d..%d are outside 0..%d (max_ctx)",
                               s, q->start_pos, q->start_pos + q->n_tokens - 1, f->opts.max_ctx - 1);
        int32_t need = (int32_t)kvf_kv_blocks_for((int64_t)q->start_pos + q->n_tokens, bs);
        if (!q->block_table || q->n_blocks < need)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "model: forward: sequence %d: block table has %d blocks, positions up to %d need %d",
                               s, q->block_table ? q->n_blocks : 0, q->start_pos + q->n_tokens - 1, need);
        int32_t *row = f->h_tables + (int64_t)s * f->max_blocks;
        for (int32_t b = 0; b < need; b++) {
            if (q->block_table[b] < 0 || q->block_table[b] >= n_pool_blocks)
                return kvf_err_set(err, KVF_ERR_INVALID,
                                   "model: forward: sequence %d: block_table[%d] = %d is outside the pool (0 to %lld)",
                                   s, b, q->block_table[b], (long long)n_pool_blocks - 1);
            row[b] = q->block_table[b];
        }
        for (int32_t i = 0; i < q->n_tokens; i++, T++) {
            int32_t tok = q->tokens[i], pos = q->start_pos + i;
            if (tok < 0 || tok >= c->vocab_size)
                return kvf_err_set(err, KVF_ERR_INVALID,
                                   "model: forward: sequence %d: token %d at index %d is outside the vocabulary (0 to %d)",
                                   s, tok, i, c->vocab_size - 1);
            f->h_tokens[T] = tok;
            f->h_tok_seq[T] = s;
            f->h_tok_pos[T] = pos;
            f->h_slots[T] = (int64_t)row[pos / bs] * bs + pos % bs;
            double p = (double)pos * f->pos_scale;
            float *cs = f->h_cos_sin + (int64_t)T * half * 2;
            for (int32_t j = 0; j < half; j++) {
                double a = p * f->inv_freq[j];
                cs[2 * j] = (float)cos(a);
                cs[2 * j + 1] = (float)sin(a);
            }
        }
        f->h_last_rows[s] = T - 1;
    }
    *n_tokens_out = T;
    return KVF_OK;
}

/* ---- profile */

const char *kvf_fwd_op_name(int op)
{
    static const char *const names[KVF_FWD_OP_COUNT] = {
        "upload", "embed", "rmsnorm", "qkv_proj", "rope", "kv_write", "attention",
        "o_proj", "add", "gate_up_proj", "swiglu", "down_proj", "lm_head", "output"};
    return op >= 0 && op < KVF_FWD_OP_COUNT ? names[op] : "?";
}

kvf_status kvf_model_fwd_set_prof(kvf_model_fwd *f, kvf_model_fwd_prof *p, kvf_err *err)
{
    if (p && !f->mark_op) {
        /* per layer 12 marks; upload, embed, lm_head, output and the end */
        int32_t n = f->m->cfg.n_layers * 12 + 5;
        f->mark_op = malloc((size_t)n * sizeof *f->mark_op);
        f->mark_ns = malloc((size_t)n * sizeof *f->mark_ns);
        f->mark_ms = malloc((size_t)n * sizeof *f->mark_ms);
        if (!f->mark_op || !f->mark_ns || !f->mark_ms) {
            free(f->mark_op), free(f->mark_ns), free(f->mark_ms);
            f->mark_op = NULL, f->mark_ns = NULL, f->mark_ms = NULL;
            return kvf_err_set(err, KVF_ERR_NOMEM, "model: profile: out of memory for %d marks", n);
        }
        f->max_marks = n;
    }
    f->prof = p;
    return KVF_OK;
}

/* Marks the start of an op of kind op (KVF_FWD_OP_COUNT: the step's end). */
static void fwd_mark(kvf_model_fwd *f, int op)
{
    if (!f->prof || f->n_marks >= f->max_marks)
        return;
    f->mark_op[f->n_marks] = (int8_t)op;
    if (kvf_backend_has_prof_clock(f->be))
        kvf_backend_prof_mark(f->be, f->ctx, f->n_marks);
    else
        f->mark_ns[f->n_marks] = kvf_now_ns();
    f->n_marks++;
}

/* After the step's sync: its marks' intervals into the profile (chunked: a step with prefill
 * chunks). A backend that cannot read its marks leaves the step out, with a warning. */
static void fwd_prof_add(kvf_model_fwd *f, bool chunked, int64_t wall_ns)
{
    kvf_model_fwd_prof *p = f->prof;
    const int32_t n = f->n_marks;
    f->n_marks = 0;
    if (n < 2)
        return;
    if (kvf_backend_has_prof_clock(f->be)) {
        kvf_err e = {0};
        if (kvf_backend_prof_read(f->be, f->ctx, n, f->mark_ms, &e) != KVF_OK) {
            kvf_log(KVF_LOG_WARN, "model: profile: step left out: %s", e.msg);
            return;
        }
    } else {
        for (int32_t i = 0; i + 1 < n; i++)
            f->mark_ms[i] = (double)(f->mark_ns[i + 1] - f->mark_ns[i]) / 1e6;
    }
    const int k = chunked ? 1 : 0;
    p->steps[k]++;
    p->wall_ms[k] += (double)wall_ns / 1e6;
    for (int32_t i = 0; i + 1 < n; i++) { /* mark n - 1, the end, starts no op */
        p->op_ms[k][f->mark_op[i]] += f->mark_ms[i];
        p->op_calls[k][f->mark_op[i]]++;
    }
}

double kvf_model_fwd_prof_ms(const kvf_model_fwd_prof *p, int k)
{
    double ms = 0;
    for (int op = 0; op < KVF_FWD_OP_COUNT; op++)
        ms += p->op_ms[k][op];
    return ms;
}

kvf_status kvf_model_forward(kvf_model_fwd *f, const kvf_model_seq *seqs, int32_t n_seqs,
                             void *kv_pool, int64_t n_pool_blocks, float *logits_out,
                             int32_t *next_out, kvf_err *err)
{
    const kvf_model_config *c = &f->m->cfg;
    const kvf_backend *be = f->be;
    void *ctx = f->ctx;
    if (!kv_pool || n_pool_blocks <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "model: forward: no KV pool (%lld blocks)", (long long)n_pool_blocks);
    int32_t T = 0;
    kvf_status st = prepare(f, seqs, n_seqs, n_pool_blocks, &T, err);
    if (st != KVF_OK)
        return st;

    /* 1. metadata to the backend: one copy (on a GPU each upload is a host wait) */
    const int64_t t_step = f->prof ? kvf_now_ns() : 0;
    f->n_marks = 0;
    fwd_mark(f, KVF_FWD_OP_UPLOAD);
    kvf_backend_upload(be, ctx, f->meta, f->h_meta, f->meta_bytes);

    int32_t max_pos = 0;
    bool decode_only = true;
    for (int32_t i = 0; i < T; i++)
        if (f->h_tok_pos[i] > max_pos)
            max_pos = f->h_tok_pos[i];
    for (int32_t s = 0; s < n_seqs; s++)
        decode_only = decode_only && seqs[s].n_tokens == 1;
    kvf_backend_attn attn = {.n_tokens = T, .n_seqs = n_seqs, .n_heads = c->n_heads,
                             .n_kv_heads = c->n_kv_heads,
                             .head_dim = c->head_dim, .tok_seq = f->tok_seq, .tok_pos = f->tok_pos,
                             .block_tables = f->tables, .max_blocks = f->max_blocks,
                             .scale = (float)(1.0 / sqrt((double)c->head_dim)),
                             .max_ctx = ctx_bucket(f, max_pos)};

    /* the ops from here to the LM head may be recorded and replayed by the backend (graphs);
     * never while profiling (the marks would belong to the recording) */
    bool replay = false;
    if (!f->prof) {
        kvf_backend_step_key key = {.n_tokens = T, .n_seqs = n_seqs, .ctx_bucket = attn.max_ctx,
                                    .decode_only = decode_only, .kv_pool = kv_pool};
        if ((st = kvf_backend_step_begin(be, ctx, &key, &replay, err)) != KVF_OK)
            return st;
    }
    if (!replay)
        run_ops(f, kv_pool, T, n_seqs, &attn);
    if (!f->prof) {
        bool rerun = false;
        if ((st = kvf_backend_step_end(be, ctx, &rerun, err)) != KVF_OK) {
            (void)kvf_backend_sync(be, ctx, NULL); /* drain; the step_end error is the one reported */
            return st;
        }
        if (rerun) /* recording failed and nothing ran */
            run_ops(f, kv_pool, T, n_seqs, &attn);
    }

    /* 6. outputs leave the backend: a step where some sequence draws asks the backend for
     * every next token (a greedy row as a draw among the ties at the largest logit: top_k 1,
     * u 0, the lowest such id, which is the argmax) */
    fwd_mark(f, KVF_FWD_OP_OUTPUT);
    if (logits_out)
        kvf_backend_download(be, ctx, logits_out, f->logits,
                             (size_t)n_seqs * c->vocab_size * sizeof(float));
    bool draws = false;
    for (int32_t s = 0; s < n_seqs; s++)
        draws = draws || seqs[s].sample;
    if (next_out && draws) {
        for (int32_t s = 0; s < n_seqs; s++)
            f->h_draw[s] = seqs[s].sample ? *seqs[s].sample
                                          : (kvf_backend_sample_row){.temperature = 1.0f,
                                                                     .top_k = 1, .top_p = 1.0f};
        if ((st = kvf_backend_sample(be, ctx, f->logits, n_seqs, c->vocab_size, f->h_draw,
                                     next_out, err)) != KVF_OK) {
            (void)kvf_backend_sync(be, ctx, NULL); /* drain; the sample error is the one reported */
            return st;
        }
    } else if (next_out) {
        kvf_backend_argmax(be, ctx, f->logits, n_seqs, c->vocab_size, next_out);
    }
    fwd_mark(f, KVF_FWD_OP_COUNT);
    st = kvf_backend_sync(be, ctx, err);
    if (f->prof && st == KVF_OK)
        fwd_prof_add(f, !decode_only, kvf_now_ns() - t_step);
    f->n_marks = 0;
    return st;
}

/* Issues a step's ops: embeddings, every layer, the final norm and LM head of each sequence's
 * last token into f->logits. No upload, download or host wait (a backend may record them). */
static void run_ops(kvf_model_fwd *f, void *kv_pool, int32_t T, int32_t n_seqs,
                    kvf_backend_attn *attn_in)
{
    const kvf_model_config *c = &f->m->cfg;
    const kvf_backend *be = f->be;
    void *ctx = f->ctx;
    kvf_backend_attn attn = *attn_in;
    int64_t dim = c->dim, hid = c->hidden_dim;

    /* 2. token embeddings */
    fwd_mark(f, KVF_FWD_OP_EMBED);
    kvf_backend_embed(be, ctx, &f->embed, f->tokens, T, f->x);

    for (int32_t l = 0; l < c->n_layers; l++) {
        const fwd_layer_w *L = &f->layers[l];
        /* 3. attention: norm, q/k/v, RoPE, K/V into the blocks, attention over them, o_proj */
        fwd_mark(f, KVF_FWD_OP_NORM);
        kvf_backend_rmsnorm(be, ctx, f->x, T, &L->attn_norm, c->norm_eps, f->xb);
        fwd_mark(f, KVF_FWD_OP_QKV);
        kvf_backend_matmul_multi(be, ctx, f->xb, T, 3,
                                 (const kvf_backend_weight *const[]){&L->wq, &L->wk, &L->wv},
                                 (const kvf_backend_weight *const[]){L->bq.data ? &L->bq : NULL,
                                                                     L->bk.data ? &L->bk : NULL,
                                                                     L->bv.data ? &L->bv : NULL},
                                 (float *const[]){f->q, f->k, f->v});
        fwd_mark(f, KVF_FWD_OP_ROPE);
        kvf_backend_rope(be, ctx, f->q, T, c->n_heads, c->head_dim, f->cos_sin);
        kvf_backend_rope(be, ctx, f->k, T, c->n_kv_heads, c->head_dim, f->cos_sin);
        fwd_mark(f, KVF_FWD_OP_KV_WRITE);
        kvf_backend_kv_write(be, ctx, kv_pool, &f->layout, l, f->k, f->v, f->slots, T);
        attn.window = kvf_model_config_window(c, l);
        fwd_mark(f, KVF_FWD_OP_ATTENTION);
        kvf_backend_attention(be, ctx, f->q, kv_pool, &f->layout, l, &attn, f->att);
        fwd_mark(f, KVF_FWD_OP_O_PROJ);
        kvf_backend_matmul(be, ctx, f->att, T, &L->wo, L->bo.data ? &L->bo : NULL, f->xb);
        fwd_mark(f, KVF_FWD_OP_ADD);
        kvf_backend_add(be, ctx, f->x, f->xb, T * dim);
        /* 4. MLP: norm, silu(gate) * up, down */
        fwd_mark(f, KVF_FWD_OP_NORM);
        kvf_backend_rmsnorm(be, ctx, f->x, T, &L->ffn_norm, c->norm_eps, f->xb);
        fwd_mark(f, KVF_FWD_OP_GATE_UP);
        kvf_backend_matmul_multi(be, ctx, f->xb, T, 2,
                                 (const kvf_backend_weight *const[]){&L->w_gate, &L->w_up},
                                 (const kvf_backend_weight *const[]){L->b_gate.data ? &L->b_gate : NULL,
                                                                     L->b_up.data ? &L->b_up : NULL},
                                 (float *const[]){f->hg, f->hu});
        fwd_mark(f, KVF_FWD_OP_SWIGLU);
        kvf_backend_swiglu(be, ctx, f->hg, f->hu, T * hid, f->hg);
        fwd_mark(f, KVF_FWD_OP_DOWN);
        kvf_backend_matmul(be, ctx, f->hg, T, &L->w_down, L->b_down.data ? &L->b_down : NULL, f->xb);
        fwd_mark(f, KVF_FWD_OP_ADD);
        kvf_backend_add(be, ctx, f->x, f->xb, T * dim);
    }

    /* 5. each sequence's last token: final norm, LM head, argmax */
    fwd_mark(f, KVF_FWD_OP_LM_HEAD);
    kvf_backend_gather(be, ctx, f->x, dim, f->last_rows, n_seqs, f->xs);
    kvf_backend_rmsnorm(be, ctx, f->xs, n_seqs, &f->final_norm, c->norm_eps, f->xs);
    kvf_backend_matmul(be, ctx, f->xs, n_seqs, f->lm_head, NULL, f->logits);
}
