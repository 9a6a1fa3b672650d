/* wire.c: the Worker messages between kvfleet's structs (proto/worker.h) and their bytes. The
 * only file that reads or fills protobuf-c's generated structs. protobuf-c checks the wire
 * format; the checks here are the ones a worker relies on before it indexes arrays or allocates
 * blocks with what a peer sent. Semantics (does the model exist, is the pool big enough) stay
 * with the roles. A decoded message is copied into one malloc()ed block (struct, then its
 * strings and arrays), so its owner frees it with free(). */
#include <math.h>
#include <stdalign.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "proto/kvfleet.pb-c.h"
#include "proto/worker.h"

/* ---- bytes <-> protobuf-c ------------------------------------------------------------------- */

static kvf_status pack(const ProtobufCMessage *m, kvf_rpc_buf *out, kvf_err *err)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *data = malloc(n ? n : 1);
    if (!data)
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: no memory to encode a %zu-byte %s", n,
                           m->descriptor->short_name);
    size_t w = protobuf_c_message_pack(m, data);
    if (w != n) {
        free(data);
        return kvf_err_set(err, KVF_ERR_INTERNAL, "rpc: %s packed to %zu bytes, expected %zu",
                           m->descriptor->short_name, w, n);
    }
    out->data = data;
    out->len = n;
    return KVF_OK;
}

/* protobuf-c keeps unknown fields, and takes field number 0 (which the wire format forbids)
 * when its tag is written in a long varint; such a message would not survive re-encoding. */
static bool has_field_zero(const ProtobufCMessage *m, int depth)
{
    if (depth > 32)
        return true;
    for (unsigned i = 0; i < m->n_unknown_fields; i++)
        if (m->unknown_fields[i].tag == 0)
            return true;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        const char *base = (const char *)m;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            ProtobufCMessage *const *v = *(ProtobufCMessage *const *const *)(base + f->offset);
            for (size_t k = 0; k < n; k++)
                if (v[k] && has_field_zero(v[k], depth + 1))
                    return true;
            continue;
        }
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        const ProtobufCMessage *sub = *(ProtobufCMessage *const *)(base + f->offset);
        if (sub && has_field_zero(sub, depth + 1))
            return true;
    }
    return false;
}

static kvf_status unpack(const ProtobufCMessageDescriptor *d, const uint8_t *data, size_t len,
                         void **out, kvf_err *err)
{
    ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, len, len ? data : NULL);
    if (!m)
        return kvf_err_set(err, KVF_ERR_PARSE, "rpc: %zu bytes are not a valid %s message", len,
                           d->short_name);
    if (has_field_zero(m, 0)) {
        protobuf_c_message_free_unpacked(m, NULL);
        return kvf_err_set(err, KVF_ERR_PARSE, "rpc: %zu bytes are not a valid %s message "
                           "(field number 0)", len, d->short_name);
    }
    *out = m;
    return KVF_OK;
}

static void pb_free(void *m)
{
    if (m)
        protobuf_c_message_free_unpacked(m, NULL);
}

/* ---- one-block copies ----------------------------------------------------------------------- */

#define AL(n) (((n) + alignof(max_align_t) - 1) & ~(alignof(max_align_t) - 1))

static size_t str_size(const char *s) { return AL((s ? strlen(s) : 0) + 1); }

/* A decoded message's block, carved front to back (sizes computed before with str_size/AL). */
typedef struct carve {
    uint8_t *p;
} carve;

static void *carve_take(carve *c, size_t n)
{
    void *r = c->p;
    c->p += AL(n);
    return r;
}

static const char *carve_str(carve *c, const char *s)
{
    size_t n = s ? strlen(s) : 0;
    char *d = carve_take(c, n + 1);
    if (n)
        memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

static const void *carve_copy(carve *c, const void *src, size_t n)
{
    void *d = carve_take(c, n ? n : 1);
    if (n)
        memcpy(d, src, n);
    return d;
}

/* Allocates the block for a struct of sz bytes plus extra; the struct comes first, zeroed. */
static void *block_new(size_t sz, size_t extra, carve *c, const char *what, kvf_err *err)
{
    uint8_t *b = calloc(1, AL(sz) + extra);
    if (!b) {
        kvf_err_set(err, KVF_ERR_NOMEM, "rpc: no memory for a decoded %s", what);
        return NULL;
    }
    c->p = b + AL(sz);
    return b;
}

/* ---- checks ---------------------------------------------------------------------------------- */

/* An id must be bounded and printable ASCII: it ends up in logs and metric labels. */
static kvf_status check_id(const char *msg, const char *field, const char *s, bool required,
                           kvf_err *err)
{
    size_t n = 0;
    for (; s && s[n]; n++) {
        unsigned char c = (unsigned char)s[n];
        if (c < 0x21 || c > 0x7e)
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.%s has byte 0x%02x at %zu (allowed: "
                               "printable ASCII without spaces)", msg, field, c, n);
        if (n >= KVF_RPC_MAX_ID_LEN)
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.%s is longer than %d bytes", msg,
                               field, KVF_RPC_MAX_ID_LEN);
    }
    if (required && n == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.%s is empty (required)", msg, field);
    return KVF_OK;
}

static kvf_status check_nonneg(const char *msg, const char *field, const int32_t *v, size_t n,
                               kvf_err *err)
{
    for (size_t i = 0; i < n; i++)
        if (v[i] < 0)
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.%s[%zu] is %d (must be >= 0)", msg,
                               field, i, (int)v[i]);
    return KVF_OK;
}

static kvf_status check_sampling(const char *msg, const Kvfleet__V1__SamplingParams *s,
                                 kvf_err *err)
{
    if (!s)
        return KVF_OK;
    if (s->max_tokens < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.max_tokens is %d (must be "
                           ">= 0)", msg, (int)s->max_tokens);
    if (!isfinite(s->temperature) || s->temperature < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.temperature is %g (must be "
                           ">= 0)", msg, (double)s->temperature);
    if (!isfinite(s->top_p) || s->top_p < 0 || s->top_p > 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.top_p is %g (allowed 0..1)",
                           msg, (double)s->top_p);
    if (s->top_k < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.top_k is %d (must be >= 0)",
                           msg, (int)s->top_k);
    if (s->n < 0 || s->n > KVF_RPC_MAX_N)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.n is %d (allowed 0..%d)", msg,
                           (int)s->n, KVF_RPC_MAX_N);
    if (s->n_stop_token_ids > KVF_RPC_MAX_STOP_TOKENS)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.stop_token_ids has %zu ids "
                           "(at most %d)", msg, s->n_stop_token_ids, KVF_RPC_MAX_STOP_TOKENS);
    const struct {
        const char *name;
        float v, lo, hi;
    } rng[] = {{"presence_penalty", s->presence_penalty, -2, 2},
               {"frequency_penalty", s->frequency_penalty, -2, 2},
               {"repetition_penalty", s->repetition_penalty, 0, 2},
               {"min_p", s->min_p, 0, 1}};
    for (size_t i = 0; i < sizeof rng / sizeof rng[0]; i++)
        if (!(rng[i].v >= rng[i].lo && rng[i].v <= rng[i].hi)) /* NaN fails too */
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.%s is %g (allowed %g..%g)",
                               msg, rng[i].name, (double)rng[i].v, (double)rng[i].lo,
                               (double)rng[i].hi);
    if (s->min_tokens < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.min_tokens is %d (must be "
                           ">= 0)", msg, (int)s->min_tokens);
    if (s->top_logprobs < 0 || s->top_logprobs > KVF_RPC_MAX_LOGPROBS)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.top_logprobs is %d (allowed "
                           "0..%d)", msg, (int)s->top_logprobs, KVF_RPC_MAX_LOGPROBS);
    if (s->n_logit_bias > KVF_RPC_MAX_BIAS)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.logit_bias has %zu entries "
                           "(at most %d)", msg, s->n_logit_bias, KVF_RPC_MAX_BIAS);
    for (size_t i = 0; i < s->n_logit_bias; i++) {
        const Kvfleet__V1__LogitBias *b = s->logit_bias[i];
        if (!b || b->token_id < 0 || !(b->bias >= -100 && b->bias <= 100))
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.logit_bias[%zu] is token "
                               "%d, bias %g (token >= 0, bias -100..100)", msg, i,
                               b ? (int)b->token_id : -1, b ? (double)b->bias : 0.0);
    }
    if (s->guide) {
        const Kvfleet__V1__Guide *g = s->guide;
        size_t tl = g->text ? strlen(g->text) : 0;
        int kind = (int)g->kind;
        if (kind < KVF_RPC_GUIDE_NONE || kind > KVF_RPC_GUIDE_JSON_OBJECT)
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.guide.kind is %d (allowed "
                               "0..%d)", msg, kind, KVF_RPC_GUIDE_JSON_OBJECT);
        if (tl > KVF_RPC_MAX_GUIDE_BYTES)
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.guide.text has %zu bytes "
                               "(at most %d)", msg, tl, KVF_RPC_MAX_GUIDE_BYTES);
        bool needs_text = kind == KVF_RPC_GUIDE_JSON_SCHEMA || kind == KVF_RPC_GUIDE_REGEX ||
                          kind == KVF_RPC_GUIDE_CHOICE;
        if (needs_text && tl == 0)
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.guide of kind %d has no "
                               "text", msg, kind);
    }
    return check_nonneg(msg, "sampling.stop_token_ids", s->stop_token_ids, s->n_stop_token_ids,
                        err);
}

/* The guide text's share of a decoded message's block. */
static size_t guide_size(const Kvfleet__V1__SamplingParams *m)
{
    return m && m->guide ? str_size(m->guide->text) : 0;
}

/* ---- the shared pieces: dtype, layout, sampling, transport (each converted here only) -------- */

static Kvfleet__V1__DType dtype_to_msg(kvf_dtype t)
{
    switch (t) {
    case KVF_DTYPE_F32: return KVFLEET__V1__DTYPE__DTYPE_F32;
    case KVF_DTYPE_F16: return KVFLEET__V1__DTYPE__DTYPE_F16;
    case KVF_DTYPE_BF16: return KVFLEET__V1__DTYPE__DTYPE_BF16;
    case KVF_DTYPE_FP8_E4M3: return KVFLEET__V1__DTYPE__DTYPE_FP8_E4M3;
    }
    return KVFLEET__V1__DTYPE__DTYPE_UNSPECIFIED;
}

static kvf_status dtype_from_msg(Kvfleet__V1__DType d, kvf_dtype *out, kvf_err *err)
{
    switch (d) {
    case KVFLEET__V1__DTYPE__DTYPE_F32: *out = KVF_DTYPE_F32; return KVF_OK;
    case KVFLEET__V1__DTYPE__DTYPE_F16: *out = KVF_DTYPE_F16; return KVF_OK;
    case KVFLEET__V1__DTYPE__DTYPE_BF16: *out = KVF_DTYPE_BF16; return KVF_OK;
    case KVFLEET__V1__DTYPE__DTYPE_FP8_E4M3: *out = KVF_DTYPE_FP8_E4M3; return KVF_OK;
    default: break;
    }
    return kvf_err_set(err, KVF_ERR_INVALID, "dtype %d is not one of f32 (1), f16 (2), bf16 (3), "
                       "fp8-e4m3 (4)", (int)d);
}

static void layout_to_msg(const kvf_kv_layout *l, Kvfleet__V1__KvLayout *m)
{
    kvfleet__v1__kv_layout__init(m);
    m->n_layers = l->n_layers;
    m->n_kv_heads = l->n_kv_heads;
    m->head_dim = l->head_dim;
    m->block_size = l->block_size;
    m->dtype = dtype_to_msg(l->dtype);
    m->block_bytes = l->block_bytes;
}

/* Checks a layout a peer sent (every shape positive, a known dtype) and converts it. */
static kvf_status layout_from_msg(const char *msg, const char *field,
                                  const Kvfleet__V1__KvLayout *l, kvf_kv_layout *out,
                                  kvf_err *err)
{
    if (l->n_layers <= 0 || l->n_kv_heads <= 0 || l->head_dim <= 0 || l->block_size <= 0 ||
        l->block_bytes <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.%s has a non-positive shape (layers "
                           "%d, kv heads %d, head_dim %d, block_size %d, block_bytes %lld)", msg,
                           field, (int)l->n_layers, (int)l->n_kv_heads, (int)l->head_dim,
                           (int)l->block_size, (long long)l->block_bytes);
    kvf_dtype t = KVF_DTYPE_F32;
    if (dtype_from_msg(l->dtype, &t, err) != KVF_OK)
        return kvf_err_prefix(err, "rpc: %s.%s", msg, field);
    *out = (kvf_kv_layout){.n_layers = l->n_layers, .n_kv_heads = l->n_kv_heads,
                           .head_dim = l->head_dim, .block_size = l->block_size, .dtype = t,
                           .block_bytes = l->block_bytes};
    return KVF_OK;
}

void kvf_rpc_sampling_default(kvf_rpc_sampling *s)
{
    memset(s, 0, sizeof *s);
    s->top_p = 1.0f;
    s->n = 1;
    s->repetition_penalty = 1.0f;
}

/* The logit_bias entries of a SamplingParams being encoded (freed after packing). */
typedef struct bias_msgs {
    Kvfleet__V1__LogitBias *b;
    Kvfleet__V1__LogitBias **p;
    Kvfleet__V1__Guide *g; /* and the guide, with its NUL-terminated text */
    char *text;
} bias_msgs;

static void bias_msgs_free(bias_msgs *bm)
{
    free(bm->b);
    free(bm->p);
    free(bm->g);
    free(bm->text);
}

/* Refuses what the struct cannot hold (n_stop or n_bias beyond its array) before anything
 * reads it. bm holds the bias entries until bias_msgs_free (after packing). */
static kvf_status sampling_to_msg(const char *msg, const kvf_rpc_sampling *s,
                                  Kvfleet__V1__SamplingParams *m, bias_msgs *bm, kvf_err *err)
{
    *bm = (bias_msgs){0};
    if (s->guide_kind < KVF_RPC_GUIDE_NONE || s->guide_kind > KVF_RPC_GUIDE_JSON_OBJECT ||
        s->guide_len > KVF_RPC_MAX_GUIDE_BYTES || (s->guide_len && !s->guide) ||
        (s->guide_len && memchr(s->guide, '\0', s->guide_len)))
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.guide: kind %d with %zu "
                           "bytes of text (kinds 0..%d, at most %d bytes, no NUL)", msg,
                           (int)s->guide_kind, s->guide_len, KVF_RPC_GUIDE_JSON_OBJECT,
                           KVF_RPC_MAX_GUIDE_BYTES);
    if (s->n_stop < 0 || s->n_stop > KVF_RPC_MAX_STOP_TOKENS)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.n_stop is %d (allowed 0..%d)",
                           msg, (int)s->n_stop, KVF_RPC_MAX_STOP_TOKENS);
    if (s->n_bias < 0 || s->n_bias > KVF_RPC_MAX_BIAS)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.sampling.n_bias is %d (allowed 0..%d)",
                           msg, (int)s->n_bias, KVF_RPC_MAX_BIAS);
    kvfleet__v1__sampling_params__init(m);
    if (s->n_bias > 0) {
        bm->b = malloc((size_t)s->n_bias * sizeof *bm->b);
        bm->p = malloc((size_t)s->n_bias * sizeof *bm->p);
        if (!bm->b || !bm->p) {
            bias_msgs_free(bm);
            return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: no memory for %d logit_bias entries",
                               (int)s->n_bias);
        }
        for (int32_t i = 0; i < s->n_bias; i++) {
            kvfleet__v1__logit_bias__init(&bm->b[i]);
            bm->b[i].token_id = s->bias[i].id;
            bm->b[i].bias = s->bias[i].bias;
            bm->p[i] = &bm->b[i];
        }
        m->n_logit_bias = (size_t)s->n_bias;
        m->logit_bias = bm->p;
    }
    m->presence_penalty = s->presence_penalty;
    m->frequency_penalty = s->frequency_penalty;
    m->repetition_penalty = s->repetition_penalty == 1.0f ? 0.0f : s->repetition_penalty;
    m->min_p = s->min_p;
    m->min_tokens = s->min_tokens;
    m->logprobs = s->logprobs;
    m->top_logprobs = s->top_logprobs;
    m->prompt_logprobs = s->prompt_logprobs;
    m->max_tokens = s->max_tokens;
    m->temperature = s->temperature;
    m->top_p = s->top_p;
    m->top_k = s->top_k;
    m->seed = s->seed;
    m->n = s->n;
    m->ignore_eos = s->ignore_eos;
    m->n_stop_token_ids = (size_t)s->n_stop;
    m->stop_token_ids = (int32_t *)s->stop_ids;
    if (s->guide_kind != KVF_RPC_GUIDE_NONE) {
        /* the text must be NUL-terminated for protobuf-c: bm owns that copy too */
        bm->g = malloc(sizeof *bm->g);
        bm->text = malloc(s->guide_len + 1);
        if (!bm->g || !bm->text) {
            bias_msgs_free(bm);
            return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: no memory for a %zu-byte guide",
                               s->guide_len);
        }
        if (s->guide_len)
            memcpy(bm->text, s->guide, s->guide_len);
        bm->text[s->guide_len] = '\0';
        kvfleet__v1__guide__init(bm->g);
        bm->g->kind = (Kvfleet__V1__Guide__Kind)s->guide_kind;
        bm->g->text = bm->text;
        m->guide = bm->g;
    }
    return KVF_OK;
}

/* A checked sampling block (check_sampling ran), or the defaults when there is none: top_p 0
 * and n 0 are the wire's "off". */
static void sampling_from_msg(const Kvfleet__V1__SamplingParams *m, carve *c,
                              kvf_rpc_sampling *s)
{
    kvf_rpc_sampling_default(s);
    if (!m)
        return;
    if (m->guide && m->guide->kind != KVFLEET__V1__GUIDE__KIND__NONE) {
        s->guide_kind = (int32_t)m->guide->kind;
        s->guide = carve_str(c, m->guide->text ? m->guide->text : "");
        s->guide_len = strlen(s->guide);
    }
    s->max_tokens = m->max_tokens;
    s->temperature = m->temperature;
    s->top_p = m->top_p > 0 && m->top_p < 1 ? m->top_p : 1.0f;
    s->top_k = m->top_k;
    s->seed = m->seed;
    s->n = m->n > 0 ? m->n : 1;
    s->ignore_eos = m->ignore_eos;
    s->n_stop = (int32_t)m->n_stop_token_ids;
    if (m->n_stop_token_ids)
        memcpy(s->stop_ids, m->stop_token_ids, m->n_stop_token_ids * sizeof *s->stop_ids);
    s->presence_penalty = m->presence_penalty;
    s->frequency_penalty = m->frequency_penalty;
    s->repetition_penalty = m->repetition_penalty > 0 ? m->repetition_penalty : 1.0f;
    s->min_p = m->min_p;
    s->min_tokens = m->min_tokens;
    s->n_bias = (int32_t)m->n_logit_bias;
    for (size_t i = 0; i < m->n_logit_bias; i++)
        s->bias[i] = (kvf_rpc_bias){.id = m->logit_bias[i]->token_id,
                                    .bias = m->logit_bias[i]->bias};
    s->logprobs = m->logprobs;
    s->top_logprobs = m->top_logprobs;
    s->prompt_logprobs = m->prompt_logprobs;
}

/* ---- log-probabilities ----------------------------------------------------------------------- */

/* A TokenLogprob being encoded points into its kvf_rpc_logprob (ids) and a float copy. */
static void logprob_to_msg(const kvf_rpc_logprob *l, Kvfleet__V1__TokenLogprob *m)
{
    kvfleet__v1__token_logprob__init(m);
    m->logprob = l->logprob;
    int32_t n = l->n_top < 0 ? 0 : l->n_top > KVF_RPC_MAX_LOGPROBS ? KVF_RPC_MAX_LOGPROBS : l->n_top;
    m->n_top_ids = m->n_top_logprobs = (size_t)n;
    m->top_ids = (int32_t *)l->top_ids;
    m->top_logprobs = (float *)l->top_lps;
}

/* A log-probability is <= 0 or -inf; a row's tops are as many as their ids, ids >= 0. */
static kvf_status logprob_from_msg(const char *msg, size_t i, const Kvfleet__V1__TokenLogprob *m,
                                   kvf_rpc_logprob *out, kvf_err *err)
{
    if (!m)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s[%zu] is missing", msg, i);
    if (m->n_top_ids != m->n_top_logprobs || m->n_top_ids > KVF_RPC_MAX_LOGPROBS)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s[%zu] has %zu top ids and %zu top "
                           "logprobs (equal, at most %d)", msg, i, m->n_top_ids,
                           m->n_top_logprobs, KVF_RPC_MAX_LOGPROBS);
    if (!(m->logprob <= 0))
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s[%zu].logprob is %g (must be <= 0)",
                           msg, i, (double)m->logprob);
    *out = (kvf_rpc_logprob){.logprob = m->logprob, .n_top = (int32_t)m->n_top_ids};
    for (size_t k = 0; k < m->n_top_ids; k++) {
        if (m->top_ids[k] < 0 || !(m->top_logprobs[k] <= 0))
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s[%zu].top[%zu] is token %d, "
                               "logprob %g (token >= 0, logprob <= 0)", msg, i, k,
                               (int)m->top_ids[k], (double)m->top_logprobs[k]);
        out->top_ids[k] = m->top_ids[k];
        out->top_lps[k] = m->top_logprobs[k];
    }
    return KVF_OK;
}

/* Encodes n rows into msgs (malloc'ed, freed by the caller after packing): *out points at them. */
static kvf_status logprobs_to_msgs(const kvf_rpc_logprob *l, size_t n,
                                   Kvfleet__V1__TokenLogprob **msgs,
                                   Kvfleet__V1__TokenLogprob ***ptrs, kvf_err *err)
{
    *msgs = NULL;
    *ptrs = NULL;
    if (!n)
        return KVF_OK;
    *msgs = malloc(n * sizeof **msgs);
    *ptrs = malloc(n * sizeof **ptrs);
    if (!*msgs || !*ptrs) {
        free(*msgs);
        free(*ptrs);
        *msgs = NULL;
        *ptrs = NULL;
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: no memory for %zu logprob rows", n);
    }
    for (size_t i = 0; i < n; i++) {
        logprob_to_msg(&l[i], &(*msgs)[i]);
        (*ptrs)[i] = &(*msgs)[i];
    }
    return KVF_OK;
}

static void transport_to_msg(const kvf_rpc_transport *t, Kvfleet__V1__TransportDescriptor *m)
{
    kvfleet__v1__transport_descriptor__init(m);
    m->backend = (char *)(t->backend ? t->backend : "");
    m->blob.data = (uint8_t *)t->blob;
    m->blob.len = t->blob ? t->blob_len : 0;
}

static size_t transport_size(const Kvfleet__V1__TransportDescriptor *m)
{
    return m ? str_size(m->backend) + AL(m->blob.len ? m->blob.len : 1) : str_size("") + AL(1);
}

static void transport_from_msg(const Kvfleet__V1__TransportDescriptor *m, carve *c,
                               kvf_rpc_transport *t)
{
    t->backend = carve_str(c, m ? m->backend : "");
    t->blob_len = m ? m->blob.len : 0;
    t->blob = carve_copy(c, m ? m->blob.data : NULL, t->blob_len);
}

/* ---- Info ------------------------------------------------------------------------------------ */

kvf_status kvf_rpc_info_req_encode(kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__InfoRequest m = KVFLEET__V1__INFO_REQUEST__INIT;
    return pack(&m.base, out, err);
}

kvf_status kvf_rpc_info_req_decode(const uint8_t *data, size_t len, kvf_err *err)
{
    void *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__info_request__descriptor, data, len, &m, err);
    pb_free(m);
    return st;
}

kvf_status kvf_rpc_info_encode(const kvf_rpc_info *i, kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__KvLayout kl;
    Kvfleet__V1__TransportDescriptor td;
    Kvfleet__V1__InfoResponse m = KVFLEET__V1__INFO_RESPONSE__INIT;
    m.protocol_version = i->protocol_version;
    m.role = (Kvfleet__V1__Role)i->role;
    m.model_id = (char *)(i->model_id ? i->model_id : "");
    m.block_size = i->block_size;
    if (i->has_kv_layout) {
        layout_to_msg(&i->kv_layout, &kl);
        m.kv_layout = &kl;
    }
    m.capacity_blocks = i->capacity_blocks;
    m.max_n = i->max_n;
    transport_to_msg(&i->transport, &td);
    m.transport = &td;
    m.worker_id = (char *)(i->worker_id ? i->worker_id : "");
    m.software_version = (char *)(i->software_version ? i->software_version : "");
    return pack(&m.base, out, err);
}

static kvf_status check_info(const Kvfleet__V1__InfoResponse *m, kvf_kv_layout *layout,
                             kvf_err *err)
{
    if (m->protocol_version != KVF_RPC_PROTOCOL_VERSION)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "rpc: worker %s speaks protocol version %u; "
                           "this build speaks %u", m->worker_id, (unsigned)m->protocol_version,
                           (unsigned)KVF_RPC_PROTOCOL_VERSION);
    if (m->block_size <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: worker %s: InfoResponse.block_size is %d "
                           "(must be > 0)", m->worker_id, (int)m->block_size);
    kvf_status st = check_id("InfoResponse", "worker_id", m->worker_id, false, err);
    if (st != KVF_OK)
        return st;
    if (m->capacity_blocks < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: worker %s: InfoResponse.capacity_blocks "
                           "is %lld (must be >= 0)", m->worker_id, (long long)m->capacity_blocks);
    if (m->kv_layout && m->kv_layout->block_size != m->block_size)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: worker %s: kv_layout.block_size %d "
                           "differs from block_size %d", m->worker_id,
                           (int)m->kv_layout->block_size, (int)m->block_size);
    if (m->role < KVFLEET__V1__ROLE__ROLE_UNSPECIFIED || m->role > KVFLEET__V1__ROLE__ROLE_COLOCATED)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: worker %s: InfoResponse.role is %d "
                           "(allowed 0..3)", m->worker_id, (int)m->role);
    return m->kv_layout ? layout_from_msg("InfoResponse", "kv_layout", m->kv_layout, layout, err)
                        : KVF_OK;
}

kvf_status kvf_rpc_info_decode(const uint8_t *data, size_t len, kvf_rpc_info **out,
                               kvf_err *err)
{
    Kvfleet__V1__InfoResponse *m = NULL;
    kvf_kv_layout layout = {0};
    kvf_status st = unpack(&kvfleet__v1__info_response__descriptor, data, len, (void **)&m, err);
    if (st != KVF_OK)
        return st;
    if ((st = check_info(m, &layout, err)) != KVF_OK)
        goto done;
    carve c;
    kvf_rpc_info *i = block_new(sizeof *i, str_size(m->model_id) + str_size(m->worker_id) +
                                               str_size(m->software_version) +
                                               transport_size(m->transport),
                                &c, "InfoResponse", err);
    if (!i) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    i->protocol_version = m->protocol_version;
    i->role = (kvf_rpc_role)m->role;
    i->model_id = carve_str(&c, m->model_id);
    i->block_size = m->block_size;
    i->has_kv_layout = m->kv_layout != NULL;
    i->kv_layout = layout;
    i->capacity_blocks = m->capacity_blocks;
    i->max_n = m->max_n > 0 ? m->max_n : 0;
    transport_from_msg(m->transport, &c, &i->transport);
    i->worker_id = carve_str(&c, m->worker_id);
    i->software_version = carve_str(&c, m->software_version);
    *out = i;
done:
    pb_free(m);
    return st;
}

/* ---- Generate -------------------------------------------------------------------------------- */

kvf_status kvf_rpc_generate_req_encode(const kvf_rpc_generate_req *r, kvf_rpc_buf *out,
                                       kvf_err *err)
{
    Kvfleet__V1__SamplingParams sp;
    Kvfleet__V1__PrefillHint ph = KVFLEET__V1__PREFILL_HINT__INIT;
    Kvfleet__V1__GenerateRequest m = KVFLEET__V1__GENERATE_REQUEST__INIT;
    m.request_id = (char *)(r->request_id ? r->request_id : "");
    m.n_token_ids = r->n_token_ids;
    m.token_ids = (int32_t *)r->token_ids;
    bias_msgs bm;
    kvf_status st = sampling_to_msg("GenerateRequest", &r->sampling, &sp, &bm, err);
    if (st != KVF_OK)
        return st;
    m.sampling = &sp;
    m.cache_salt = (char *)(r->cache_salt ? r->cache_salt : "");
    if (r->prefill_addr && r->prefill_addr[0]) {
        ph.address = (char *)r->prefill_addr;
        m.prefill = &ph;
    }
    m.deadline_unix_ms = r->deadline_unix_ms;
    m.n_prior_output_tokens = r->n_prior_output_tokens;
    st = pack(&m.base, out, err);
    bias_msgs_free(&bm);
    return st;
}

static kvf_status check_generate(const Kvfleet__V1__GenerateRequest *m, kvf_err *err)
{
    const char *w = "GenerateRequest";
    kvf_status st;
    if ((st = check_id(w, "request_id", m->request_id, true, err)) != KVF_OK ||
        (st = check_id(w, "cache_salt", m->cache_salt, false, err)) != KVF_OK)
        return st;
    if (m->n_token_ids == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: GenerateRequest %s: token_ids is empty",
                           m->request_id);
    if (m->n_token_ids > INT32_MAX)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: GenerateRequest %s: %zu token_ids (at "
                           "most %d)", m->request_id, m->n_token_ids, INT32_MAX);
    if ((st = check_nonneg(w, "token_ids", m->token_ids, m->n_token_ids, err)) != KVF_OK)
        return st;
    if (m->n_prior_output_tokens < 0 || (size_t)m->n_prior_output_tokens >= m->n_token_ids)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: GenerateRequest %s: n_prior_output_tokens "
                           "is %d (allowed 0..%zu: fewer than token_ids)", m->request_id,
                           (int)m->n_prior_output_tokens, m->n_token_ids - 1);
    if (m->prefill && m->prefill->address && m->prefill->address[0] &&
        (st = check_id(w, "prefill.address", m->prefill->address, false, err)) != KVF_OK)
        return st;
    return check_sampling(w, m->sampling, err);
}

kvf_status kvf_rpc_generate_req_decode(const uint8_t *data, size_t len,
                                       kvf_rpc_generate_req **out, kvf_err *err)
{
    Kvfleet__V1__GenerateRequest *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__generate_request__descriptor, data, len, (void **)&m, err);
    if (st != KVF_OK)
        return st;
    if ((st = check_generate(m, err)) != KVF_OK)
        goto done;
    const char *addr = m->prefill && m->prefill->address ? m->prefill->address : "";
    carve c;
    kvf_rpc_generate_req *r =
        block_new(sizeof *r, str_size(m->request_id) + str_size(m->cache_salt) + str_size(addr) +
                                 AL(m->n_token_ids * sizeof *m->token_ids) +
                                 guide_size(m->sampling),
                  &c, "GenerateRequest", err);
    if (!r) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    r->request_id = carve_str(&c, m->request_id);
    r->n_token_ids = m->n_token_ids;
    r->token_ids = carve_copy(&c, m->token_ids, m->n_token_ids * sizeof *m->token_ids);
    sampling_from_msg(m->sampling, &c, &r->sampling);
    r->cache_salt = carve_str(&c, m->cache_salt);
    r->prefill_addr = carve_str(&c, addr);
    r->deadline_unix_ms = m->deadline_unix_ms;
    r->n_prior_output_tokens = m->n_prior_output_tokens;
    *out = r;
done:
    pb_free(m);
    return st;
}

kvf_status kvf_rpc_generate_resp_encode(const kvf_rpc_generate_resp *r, kvf_rpc_buf *out,
                                        kvf_err *err)
{
    Kvfleet__V1__Usage u = KVFLEET__V1__USAGE__INIT;
    Kvfleet__V1__GenerateResponse m = KVFLEET__V1__GENERATE_RESPONSE__INIT;
    m.n_token_ids = r->n_token_ids;
    m.token_ids = (int32_t *)r->token_ids;
    m.finish_reason = (Kvfleet__V1__FinishReason)r->finish;
    if (r->has_usage) {
        u.prompt_tokens = r->usage.prompt_tokens;
        u.completion_tokens = r->usage.completion_tokens;
        u.cached_prompt_tokens = r->usage.cached_prompt_tokens;
        u.remote_prefill_tokens = r->usage.remote_prefill_tokens;
        m.usage = &u;
    }
    m.index = r->index;
    Kvfleet__V1__TokenLogprob *lm = NULL, **lp = NULL, *pm = NULL, **pp = NULL;
    kvf_status st = KVF_OK;
    if (r->logprobs) {
        if ((st = logprobs_to_msgs(r->logprobs, r->n_token_ids, &lm, &lp, err)) != KVF_OK)
            return st;
        m.n_logprobs = r->n_token_ids;
        m.logprobs = lp;
    }
    if (r->prompt_lps && r->n_prompt_lps) {
        if ((st = logprobs_to_msgs(r->prompt_lps, r->n_prompt_lps, &pm, &pp, err)) != KVF_OK)
            goto done;
        m.n_prompt_logprobs = r->n_prompt_lps;
        m.prompt_logprobs = pp;
        m.prompt_logprobs_start = r->prompt_lps_start;
    }
    st = pack(&m.base, out, err);
done:
    free(lm);
    free(lp);
    free(pm);
    free(pp);
    return st;
}

kvf_status kvf_rpc_generate_resp_decode(const uint8_t *data, size_t len,
                                        kvf_rpc_generate_resp **out, kvf_err *err)
{
    Kvfleet__V1__GenerateResponse *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__generate_response__descriptor, data, len, (void **)&m,
                           err);
    if (st != KVF_OK)
        return st;
    if ((st = check_nonneg("GenerateResponse", "token_ids", m->token_ids, m->n_token_ids, err)) !=
        KVF_OK)
        goto done;
    if (m->finish_reason < KVFLEET__V1__FINISH_REASON__FINISH_NONE ||
        m->finish_reason > KVFLEET__V1__FINISH_REASON__FINISH_ERROR) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "rpc: GenerateResponse.finish_reason is %d "
                         "(allowed 0..4)", (int)m->finish_reason);
        goto done;
    }
    if (m->n_logprobs && m->n_logprobs != m->n_token_ids) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "rpc: GenerateResponse has %zu logprobs for %zu "
                         "token_ids (equal, or none)", m->n_logprobs, m->n_token_ids);
        goto done;
    }
    if (m->n_prompt_logprobs > KVF_RPC_MAX_PROMPT_LPS ||
        (m->n_prompt_logprobs && m->prompt_logprobs_start < 1)) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "rpc: GenerateResponse has %zu prompt_logprobs "
                         "from %d (at most %d, from 1)", m->n_prompt_logprobs,
                         (int)m->prompt_logprobs_start, KVF_RPC_MAX_PROMPT_LPS);
        goto done;
    }
    carve c;
    kvf_rpc_generate_resp *r =
        block_new(sizeof *r, AL(m->n_token_ids * sizeof *m->token_ids) +
                                 AL(m->n_logprobs * sizeof(kvf_rpc_logprob)) +
                                 AL(m->n_prompt_logprobs * sizeof(kvf_rpc_logprob)),
                  &c, "GenerateResponse", err);
    if (!r) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    r->n_token_ids = m->n_token_ids;
    r->token_ids = carve_copy(&c, m->token_ids, m->n_token_ids * sizeof *m->token_ids);
    if (m->n_logprobs) {
        kvf_rpc_logprob *l = carve_take(&c, m->n_logprobs * sizeof *l);
        for (size_t i = 0; i < m->n_logprobs && st == KVF_OK; i++)
            st = logprob_from_msg("GenerateResponse.logprobs", i, m->logprobs[i], &l[i], err);
        r->logprobs = l;
    }
    if (m->n_prompt_logprobs) {
        kvf_rpc_logprob *l = carve_take(&c, m->n_prompt_logprobs * sizeof *l);
        for (size_t i = 0; i < m->n_prompt_logprobs && st == KVF_OK; i++)
            st = logprob_from_msg("GenerateResponse.prompt_logprobs", i, m->prompt_logprobs[i],
                                  &l[i], err);
        r->prompt_lps = l;
        r->n_prompt_lps = m->n_prompt_logprobs;
        r->prompt_lps_start = m->prompt_logprobs_start;
    }
    if (st != KVF_OK) {
        free(r);
        goto done;
    }
    r->finish = (kvf_rpc_finish)m->finish_reason;
    r->has_usage = m->usage != NULL;
    if (m->usage)
        r->usage = (kvf_rpc_usage){.prompt_tokens = m->usage->prompt_tokens,
                                   .completion_tokens = m->usage->completion_tokens,
                                   .cached_prompt_tokens = m->usage->cached_prompt_tokens,
                                   .remote_prefill_tokens = m->usage->remote_prefill_tokens};
    r->index = m->index;
    *out = r;
done:
    pb_free(m);
    return st;
}

/* ---- RemotePrefill --------------------------------------------------------------------------- */

kvf_status kvf_rpc_remote_prefill_req_encode(const kvf_rpc_remote_prefill_req *r,
                                             kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__TransportDescriptor td;
    Kvfleet__V1__KvLayout kl;
    Kvfleet__V1__SamplingParams sp;
    Kvfleet__V1__RemotePrefillRequest m = KVFLEET__V1__REMOTE_PREFILL_REQUEST__INIT;
    m.request_id = (char *)(r->request_id ? r->request_id : "");
    m.n_token_ids = r->n_token_ids;
    m.token_ids = (int32_t *)r->token_ids;
    m.n_dst_block_ids = r->n_dst_block_ids;
    m.dst_block_ids = (int32_t *)r->dst_block_ids;
    m.dst_cached_blocks = r->dst_cached_blocks;
    transport_to_msg(&r->dst, &td);
    m.dst = &td;
    m.transfer_id = r->transfer_id;
    static const uint8_t zero[KVF_RPC_TRANSFER_TOKEN_BYTES];
    if (memcmp(r->transfer_token, zero, sizeof zero) != 0) {
        m.transfer_token.data = (uint8_t *)r->transfer_token;
        m.transfer_token.len = KVF_RPC_TRANSFER_TOKEN_BYTES;
    }
    m.cache_salt = (char *)(r->cache_salt ? r->cache_salt : "");
    bias_msgs bm;
    kvf_status st = sampling_to_msg("RemotePrefillRequest", &r->sampling, &sp, &bm, err);
    if (st != KVF_OK)
        return st;
    m.sampling = &sp;
    m.deadline_unix_ms = r->deadline_unix_ms;
    if (r->has_dst_layout) {
        layout_to_msg(&r->dst_layout, &kl);
        m.dst_layout = &kl;
    }
    st = pack(&m.base, out, err);
    bias_msgs_free(&bm);
    return st;
}

static kvf_status check_remote_prefill(const Kvfleet__V1__RemotePrefillRequest *m,
                                       kvf_kv_layout *layout, kvf_err *err)
{
    const char *w = "RemotePrefillRequest";
    kvf_status st;
    if ((st = check_id(w, "request_id", m->request_id, true, err)) != KVF_OK ||
        (st = check_id(w, "cache_salt", m->cache_salt, false, err)) != KVF_OK)
        return st;
    if (m->transfer_token.len != 0 && m->transfer_token.len != KVF_RPC_TRANSFER_TOKEN_BYTES)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s.transfer_token: %zu bytes (0 or %d)", w,
                           m->transfer_token.len, KVF_RPC_TRANSFER_TOKEN_BYTES);
    if (m->n_token_ids == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: RemotePrefillRequest %s: token_ids is "
                           "empty", m->request_id);
    if (m->n_token_ids > INT32_MAX)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: RemotePrefillRequest %s: %zu token_ids "
                           "(at most %d)", m->request_id, m->n_token_ids, INT32_MAX);
    if ((st = check_nonneg(w, "token_ids", m->token_ids, m->n_token_ids, err)) != KVF_OK ||
        (st = check_nonneg(w, "dst_block_ids", m->dst_block_ids, m->n_dst_block_ids, err)) !=
            KVF_OK)
        return st;
    if (m->dst_cached_blocks < 0 || (size_t)m->dst_cached_blocks > m->n_dst_block_ids)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: RemotePrefillRequest %s: "
                           "dst_cached_blocks is %d (allowed 0..%zu, the number of "
                           "dst_block_ids)", m->request_id, (int)m->dst_cached_blocks,
                           m->n_dst_block_ids);
    if (!m->dst || !m->dst->backend || !m->dst->backend[0])
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: RemotePrefillRequest %s: dst (the "
                           "destination's transport descriptor) is missing", m->request_id);
    if ((st = check_id(w, "dst.backend", m->dst->backend, true, err)) != KVF_OK)
        return st;
    if (m->dst_layout) {
        if ((st = layout_from_msg(w, "dst_layout", m->dst_layout, layout, err)) != KVF_OK)
            return st;
        size_t bs = (size_t)m->dst_layout->block_size;
        size_t need = (m->n_token_ids + bs - 1) / bs;
        if (m->n_dst_block_ids < need)
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: RemotePrefillRequest %s: %zu "
                               "dst_block_ids for %zu tokens at block_size %zu (need %zu)",
                               m->request_id, m->n_dst_block_ids, m->n_token_ids, bs, need);
    }
    return check_sampling(w, m->sampling, err);
}

kvf_status kvf_rpc_remote_prefill_req_decode(const uint8_t *data, size_t len,
                                             kvf_rpc_remote_prefill_req **out, kvf_err *err)
{
    Kvfleet__V1__RemotePrefillRequest *m = NULL;
    kvf_kv_layout layout = {0};
    kvf_status st = unpack(&kvfleet__v1__remote_prefill_request__descriptor, data, len,
                           (void **)&m, err);
    if (st != KVF_OK)
        return st;
    if ((st = check_remote_prefill(m, &layout, err)) != KVF_OK)
        goto done;
    carve c;
    kvf_rpc_remote_prefill_req *r =
        block_new(sizeof *r, str_size(m->request_id) + str_size(m->cache_salt) +
                                 AL(m->n_token_ids * sizeof *m->token_ids) +
                                 AL((m->n_dst_block_ids ? m->n_dst_block_ids : 1) *
                                    sizeof *m->dst_block_ids) +
                                 transport_size(m->dst) + guide_size(m->sampling),
                  &c, "RemotePrefillRequest", err);
    if (!r) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    r->request_id = carve_str(&c, m->request_id);
    r->n_token_ids = m->n_token_ids;
    r->token_ids = carve_copy(&c, m->token_ids, m->n_token_ids * sizeof *m->token_ids);
    r->n_dst_block_ids = m->n_dst_block_ids;
    r->dst_block_ids = carve_copy(&c, m->dst_block_ids,
                                  m->n_dst_block_ids * sizeof *m->dst_block_ids);
    r->dst_cached_blocks = m->dst_cached_blocks;
    transport_from_msg(m->dst, &c, &r->dst);
    r->transfer_id = m->transfer_id;
    if (m->transfer_token.len == KVF_RPC_TRANSFER_TOKEN_BYTES)
        memcpy(r->transfer_token, m->transfer_token.data, KVF_RPC_TRANSFER_TOKEN_BYTES);
    r->cache_salt = carve_str(&c, m->cache_salt);
    sampling_from_msg(m->sampling, &c, &r->sampling);
    r->deadline_unix_ms = m->deadline_unix_ms;
    r->has_dst_layout = m->dst_layout != NULL;
    r->dst_layout = layout;
    *out = r;
done:
    pb_free(m);
    return st;
}

kvf_status kvf_rpc_remote_prefill_resp_encode(const kvf_rpc_remote_prefill_resp *r,
                                              kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__PrefillStats ps = KVFLEET__V1__PREFILL_STATS__INIT;
    Kvfleet__V1__RemotePrefillResponse m = KVFLEET__V1__REMOTE_PREFILL_RESPONSE__INIT;
    Kvfleet__V1__TokenLogprob fl;
    m.first_token = r->first_token;
    if (r->has_first_logprob) {
        logprob_to_msg(&r->first_logprob, &fl);
        m.first_logprob = &fl;
    }
    if (r->has_stats) {
        const kvf_rpc_prefill_stats *s = &r->stats;
        ps.prompt_tokens = s->prompt_tokens;
        ps.cached_tokens = s->cached_tokens;
        ps.computed_tokens = s->computed_tokens;
        ps.blocks_sent = s->blocks_sent;
        ps.bytes_sent = s->bytes_sent;
        ps.queue_ms = s->queue_ms;
        ps.prefill_ms = s->prefill_ms;
        ps.transfer_ms = s->transfer_ms;
        m.stats = &ps;
    }
    return pack(&m.base, out, err);
}

kvf_status kvf_rpc_remote_prefill_resp_decode(const uint8_t *data, size_t len,
                                              kvf_rpc_remote_prefill_resp **out, kvf_err *err)
{
    Kvfleet__V1__RemotePrefillResponse *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__remote_prefill_response__descriptor, data, len,
                           (void **)&m, err);
    if (st != KVF_OK)
        return st;
    carve c;
    kvf_rpc_remote_prefill_resp *r = block_new(sizeof *r, 0, &c, "RemotePrefillResponse", err);
    if (!r) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    r->first_token = m->first_token;
    if (m->first_logprob) {
        r->has_first_logprob = true;
        if ((st = logprob_from_msg("RemotePrefillResponse.first_logprob", 0, m->first_logprob,
                                   &r->first_logprob, err)) != KVF_OK) {
            free(r);
            goto done;
        }
    }
    r->has_stats = m->stats != NULL;
    if (m->stats) {
        const Kvfleet__V1__PrefillStats *s = m->stats;
        r->stats = (kvf_rpc_prefill_stats){
            .prompt_tokens = s->prompt_tokens, .cached_tokens = s->cached_tokens,
            .computed_tokens = s->computed_tokens, .blocks_sent = s->blocks_sent,
            .bytes_sent = s->bytes_sent, .queue_ms = s->queue_ms, .prefill_ms = s->prefill_ms,
            .transfer_ms = s->transfer_ms};
    }
    *out = r;
done:
    pb_free(m);
    return st;
}

/* ---- WatchKv --------------------------------------------------------------------------------- */

kvf_status kvf_rpc_watch_req_encode(const kvf_rpc_watch_req *r, kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__WatchKvRequest m = KVFLEET__V1__WATCH_KV_REQUEST__INIT;
    m.router_id = (char *)(r->router_id ? r->router_id : "");
    m.load_interval_ms = r->load_interval_ms;
    return pack(&m.base, out, err);
}

kvf_status kvf_rpc_watch_req_decode(const uint8_t *data, size_t len, kvf_rpc_watch_req **out,
                                    kvf_err *err)
{
    Kvfleet__V1__WatchKvRequest *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__watch_kv_request__descriptor, data, len, (void **)&m, err);
    if (st != KVF_OK)
        return st;
    if ((st = check_id("WatchKvRequest", "router_id", m->router_id, false, err)) != KVF_OK)
        goto done;
    carve c;
    kvf_rpc_watch_req *r = block_new(sizeof *r, str_size(m->router_id), &c, "WatchKvRequest", err);
    if (!r) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    r->router_id = carve_str(&c, m->router_id);
    r->load_interval_ms = m->load_interval_ms;
    *out = r;
done:
    pb_free(m);
    return st;
}

kvf_status kvf_rpc_watch_msg_encode(const kvf_rpc_watch_msg *w, kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__KvEvent ev = KVFLEET__V1__KV_EVENT__INIT;
    Kvfleet__V1__LoadReport lr = KVFLEET__V1__LOAD_REPORT__INIT;
    Kvfleet__V1__WatchKvResponse m = KVFLEET__V1__WATCH_KV_RESPONSE__INIT;
    if (w->is_load) {
        const kvf_rpc_load *l = &w->load;
        lr.running = l->running;
        lr.waiting = l->waiting;
        lr.active_blocks = l->active_blocks;
        lr.free_blocks = l->free_blocks;
        lr.total_blocks = l->total_blocks;
        lr.queued_prefill_tokens = l->queued_prefill_tokens;
        lr.prefill_ms_mean = l->prefill_ms_mean;
        lr.prefill_ms_p90 = l->prefill_ms_p90;
        lr.prefill_tokens_per_s = l->prefill_tokens_per_s;
        lr.unix_ms = l->unix_ms;
        lr.host_promote_s_per_block = l->host_promote_s_per_block;
        lr.disk_promote_s_per_block = l->disk_promote_s_per_block;
        m.body_case = KVFLEET__V1__WATCH_KV_RESPONSE__BODY_LOAD;
        m.load = &lr;
    } else {
        const kvf_rpc_kv_event *e = &w->event;
        ev.seq = e->seq;
        ev.kind = (Kvfleet__V1__KvEvent__Kind)e->kind;
        ev.n_block_hashes = e->n;
        ev.block_hashes = (uint64_t *)e->block_hashes;
        ev.n_parent_hashes = e->parent_hashes ? e->n : 0;
        ev.parent_hashes = (uint64_t *)e->parent_hashes;
        ev.block_size = e->block_size;
        ev.model_id = (char *)(e->model_id ? e->model_id : "");
        ev.snapshot_done = e->snapshot_done;
        ev.tier = e->tier;
        m.body_case = KVFLEET__V1__WATCH_KV_RESPONSE__BODY_EVENT;
        m.event = &ev;
    }
    return pack(&m.base, out, err);
}

static kvf_status check_event(const Kvfleet__V1__KvEvent *e, kvf_err *err)
{
    if (e->n_parent_hashes != 0 && e->n_parent_hashes != e->n_block_hashes)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: KvEvent %llu: %zu parent_hashes for %zu "
                           "block_hashes (want equal, or none)", (unsigned long long)e->seq,
                           e->n_parent_hashes, e->n_block_hashes);
    if (e->block_size < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: KvEvent %llu: block_size is %d",
                           (unsigned long long)e->seq, (int)e->block_size);
    if (e->kind < KVFLEET__V1__KV_EVENT__KIND__KIND_UNSPECIFIED ||
        e->kind > KVFLEET__V1__KV_EVENT__KIND__KIND_CLEARED)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: KvEvent %llu: kind is %d (allowed 0..4)",
                           (unsigned long long)e->seq, (int)e->kind);
    if (e->tier < KVF_RPC_TIER_POOL || e->tier > KVF_RPC_TIER_DISK)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: KvEvent %llu: tier is %d (allowed 0..2)",
                           (unsigned long long)e->seq, (int)e->tier);
    return KVF_OK;
}

static kvf_status check_load(const Kvfleet__V1__LoadReport *l, kvf_err *err)
{
    /* a router adds these into its costs: a negative or absurd count would attract or repel
     * traffic (2^40 tokens or blocks is far past any worker) */
    const int64_t big = (int64_t)1 << 40;
    if (l->running < 0 || l->waiting < 0 || l->active_blocks < 0 || l->active_blocks > big ||
        l->free_blocks < 0 || l->free_blocks > big || l->total_blocks < 0 || l->total_blocks > big ||
        l->queued_prefill_tokens < 0 || l->queued_prefill_tokens > big)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: LoadReport: running %d, waiting %d, "
                           "active_blocks %lld, free_blocks %lld, total_blocks %lld or "
                           "queued_prefill_tokens %lld out of range (0 to 2^40)", (int)l->running,
                           (int)l->waiting, (long long)l->active_blocks, (long long)l->free_blocks,
                           (long long)l->total_blocks, (long long)l->queued_prefill_tokens);
    if (!(l->prefill_ms_mean >= 0 && l->prefill_ms_mean < 1e12) ||
        !(l->prefill_ms_p90 >= 0 && l->prefill_ms_p90 < 1e12) ||
        !(l->prefill_tokens_per_s >= 0 && l->prefill_tokens_per_s < 1e12))
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: LoadReport: prefill_ms_mean %g, "
                           "prefill_ms_p90 %g or prefill_tokens_per_s %g out of range [0, 1e12)",
                           l->prefill_ms_mean, l->prefill_ms_p90, l->prefill_tokens_per_s);
    /* a router divides and compares with these: NaN, infinite or negative is refused */
    if (!(l->host_promote_s_per_block >= 0 && l->host_promote_s_per_block < 1e6) ||
        !(l->disk_promote_s_per_block >= 0 && l->disk_promote_s_per_block < 1e6))
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: LoadReport: host_promote_s_per_block %g "
                           "or disk_promote_s_per_block %g out of range [0, 1e6)",
                           l->host_promote_s_per_block, l->disk_promote_s_per_block);
    return KVF_OK;
}

kvf_status kvf_rpc_watch_msg_decode(const uint8_t *data, size_t len, kvf_rpc_watch_msg **out,
                                    kvf_err *err)
{
    Kvfleet__V1__WatchKvResponse *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__watch_kv_response__descriptor, data, len, (void **)&m,
                           err);
    if (st != KVF_OK)
        return st;
    const Kvfleet__V1__KvEvent *e =
        m->body_case == KVFLEET__V1__WATCH_KV_RESPONSE__BODY_EVENT ? m->event : NULL;
    const Kvfleet__V1__LoadReport *l =
        m->body_case == KVFLEET__V1__WATCH_KV_RESPONSE__BODY_LOAD ? m->load : NULL;
    if (!e && !l) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "rpc: WatchKvResponse carries neither an event "
                         "nor a load report");
        goto done;
    }
    if (e && (st = check_event(e, err)) != KVF_OK)
        goto done;
    if (l && (st = check_load(l, err)) != KVF_OK)
        goto done;
    size_t hb = e ? AL((e->n_block_hashes ? e->n_block_hashes : 1) * sizeof(uint64_t)) : 0;
    carve c;
    kvf_rpc_watch_msg *w = block_new(sizeof *w, e ? 2 * hb + str_size(e->model_id) : 0, &c,
                                     "WatchKvResponse", err);
    if (!w) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    if (l) {
        w->is_load = true;
        w->load = (kvf_rpc_load){.running = l->running, .waiting = l->waiting,
                                 .active_blocks = l->active_blocks, .free_blocks = l->free_blocks,
                                 .total_blocks = l->total_blocks,
                                 .queued_prefill_tokens = l->queued_prefill_tokens,
                                 .prefill_ms_mean = l->prefill_ms_mean,
                                 .prefill_ms_p90 = l->prefill_ms_p90,
                                 .prefill_tokens_per_s = l->prefill_tokens_per_s,
                                 .unix_ms = l->unix_ms,
                                 .host_promote_s_per_block = l->host_promote_s_per_block,
                                 .disk_promote_s_per_block = l->disk_promote_s_per_block};
    } else {
        kvf_rpc_kv_event *o = &w->event;
        o->seq = e->seq;
        o->kind = (kvf_rpc_kv_event_kind)e->kind;
        o->n = e->n_block_hashes;
        o->block_hashes = carve_copy(&c, e->block_hashes, e->n_block_hashes * sizeof(uint64_t));
        o->parent_hashes = e->n_parent_hashes
                               ? carve_copy(&c, e->parent_hashes,
                                            e->n_parent_hashes * sizeof(uint64_t))
                               : NULL;
        o->block_size = e->block_size;
        o->model_id = carve_str(&c, e->model_id);
        o->snapshot_done = e->snapshot_done;
        o->tier = e->tier;
    }
    *out = w;
done:
    pb_free(m);
    return st;
}

/* ---- Cancel, Health -------------------------------------------------------------------------- */

kvf_status kvf_rpc_cancel_req_encode(const kvf_rpc_cancel_req *r, kvf_rpc_buf *out,
                                     kvf_err *err)
{
    Kvfleet__V1__CancelRequest m = KVFLEET__V1__CANCEL_REQUEST__INIT;
    m.request_id = (char *)(r->request_id ? r->request_id : "");
    return pack(&m.base, out, err);
}

kvf_status kvf_rpc_cancel_req_decode(const uint8_t *data, size_t len, kvf_rpc_cancel_req **out,
                                     kvf_err *err)
{
    Kvfleet__V1__CancelRequest *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__cancel_request__descriptor, data, len, (void **)&m, err);
    if (st != KVF_OK)
        return st;
    if ((st = check_id("CancelRequest", "request_id", m->request_id, true, err)) != KVF_OK)
        goto done;
    carve c;
    kvf_rpc_cancel_req *r = block_new(sizeof *r, str_size(m->request_id), &c, "CancelRequest", err);
    if (!r) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    r->request_id = carve_str(&c, m->request_id);
    *out = r;
done:
    pb_free(m);
    return st;
}

kvf_status kvf_rpc_cancel_resp_encode(const kvf_rpc_cancel_resp *r, kvf_rpc_buf *out,
                                      kvf_err *err)
{
    Kvfleet__V1__CancelResponse m = KVFLEET__V1__CANCEL_RESPONSE__INIT;
    m.found = r->found;
    return pack(&m.base, out, err);
}

kvf_status kvf_rpc_cancel_resp_decode(const uint8_t *data, size_t len,
                                      kvf_rpc_cancel_resp **out, kvf_err *err)
{
    Kvfleet__V1__CancelResponse *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__cancel_response__descriptor, data, len, (void **)&m, err);
    if (st != KVF_OK)
        return st;
    carve c;
    kvf_rpc_cancel_resp *r = block_new(sizeof *r, 0, &c, "CancelResponse", err);
    if (!r) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    r->found = m->found;
    *out = r;
done:
    pb_free(m);
    return st;
}

kvf_status kvf_rpc_health_req_encode(kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__HealthRequest m = KVFLEET__V1__HEALTH_REQUEST__INIT;
    return pack(&m.base, out, err);
}

kvf_status kvf_rpc_health_req_decode(const uint8_t *data, size_t len, kvf_err *err)
{
    void *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__health_request__descriptor, data, len, &m, err);
    pb_free(m);
    return st;
}

kvf_status kvf_rpc_health_encode(const kvf_rpc_health *h, kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__HealthResponse m = KVFLEET__V1__HEALTH_RESPONSE__INIT;
    m.status = (Kvfleet__V1__HealthResponse__ServingStatus)h->status;
    m.detail = (char *)(h->detail ? h->detail : "");
    return pack(&m.base, out, err);
}

kvf_status kvf_rpc_health_decode(const uint8_t *data, size_t len, kvf_rpc_health **out,
                                 kvf_err *err)
{
    Kvfleet__V1__HealthResponse *m = NULL;
    kvf_status st = unpack(&kvfleet__v1__health_response__descriptor, data, len, (void **)&m, err);
    if (st != KVF_OK)
        return st;
    if (m->status < KVFLEET__V1__HEALTH_RESPONSE__SERVING_STATUS__SERVING_UNSPECIFIED ||
        m->status > KVFLEET__V1__HEALTH_RESPONSE__SERVING_STATUS__DRAINING) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "rpc: HealthResponse.status is %d (allowed 0..3)",
                         (int)m->status);
        goto done;
    }
    carve c;
    kvf_rpc_health *h = block_new(sizeof *h, str_size(m->detail), &c, "HealthResponse", err);
    if (!h) {
        st = KVF_ERR_NOMEM;
        goto done;
    }
    h->status = (kvf_rpc_serving)m->status;
    h->detail = carve_str(&c, m->detail);
    *out = h;
done:
    pb_free(m);
    return st;
}
