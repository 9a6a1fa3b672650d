/* worker.c: encoding and checked decoding of the Worker service's messages. protobuf-c only
 * checks the wire format; the checks here are the ones a worker relies on before it indexes
 * arrays or allocates blocks with what a peer sent. Semantics (does the model exist, is the
 * pool big enough) stay with the roles. */
#include "proto/worker.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

void kvf_rpc_msg_free(void *msg)
{
    if (msg)
        protobuf_c_message_free_unpacked(msg, NULL);
}

kvf_status kvf_rpc_msg_encode(const void *msg, kvf_rpc_buf *out, kvf_err *err)
{
    const ProtobufCMessage *m = msg;
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
                         ProtobufCMessage **out, kvf_err *err)
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
    return check_nonneg(msg, "sampling.stop_token_ids", s->stop_token_ids, s->n_stop_token_ids,
                        err);
}

static kvf_status check_layout(const char *msg, const char *field, const Kvfleet__V1__KvLayout *l,
                               kvf_err *err)
{
    if (!l)
        return KVF_OK;
    if (l->n_layers <= 0 || l->n_kv_heads <= 0 || l->head_dim <= 0 || l->block_size <= 0 ||
        l->block_bytes <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s.%s has a non-positive shape (layers "
                           "%d, kv heads %d, head_dim %d, block_size %d, block_bytes %lld)", msg,
                           field, (int)l->n_layers, (int)l->n_kv_heads, (int)l->head_dim,
                           (int)l->block_size, (long long)l->block_bytes);
    kvf_dtype t;
    kvf_status st = kvf_rpc_dtype_from_msg(l->dtype, &t, err);
    if (st != KVF_OK)
        return kvf_err_prefix(err, "rpc: %s.%s", msg, field);
    return KVF_OK;
}

/* Unpacks, runs check on the message, and hands it out only when both pass. */
typedef kvf_status (*check_fn)(const void *msg, kvf_err *err);

static kvf_status decode(const ProtobufCMessageDescriptor *d, check_fn check, const uint8_t *data,
                         size_t len, void **out, kvf_err *err)
{
    ProtobufCMessage *m = NULL;
    kvf_status st = unpack(d, data, len, &m, err);
    if (st != KVF_OK)
        return st;
    if ((st = check(m, err)) != KVF_OK) {
        kvf_rpc_msg_free(m);
        return st;
    }
    *out = m;
    return KVF_OK;
}

static kvf_status check_none(const void *m, kvf_err *err) { return KVF_OK; }

static kvf_status check_generate(const void *msg, kvf_err *err)
{
    const Kvfleet__V1__GenerateRequest *m = msg;
    const char *w = "GenerateRequest";
    kvf_status st;
    if ((st = check_id(w, "request_id", m->request_id, true, err)) != KVF_OK ||
        (st = check_id(w, "cache_salt", m->cache_salt, false, err)) != KVF_OK)
        return st;
    if (m->n_token_ids == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: GenerateRequest %s: token_ids is empty",
                           m->request_id);
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

static kvf_status check_remote_prefill(const void *msg, kvf_err *err)
{
    const Kvfleet__V1__RemotePrefillRequest *m = msg;
    const char *w = "RemotePrefillRequest";
    kvf_status st;
    if ((st = check_id(w, "request_id", m->request_id, true, err)) != KVF_OK ||
        (st = check_id(w, "cache_salt", m->cache_salt, false, err)) != KVF_OK)
        return st;
    if (m->n_token_ids == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: RemotePrefillRequest %s: token_ids is "
                           "empty", m->request_id);
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
    if ((st = check_id(w, "dst.backend", m->dst->backend, true, err)) != KVF_OK ||
        (st = check_layout(w, "dst_layout", m->dst_layout, err)) != KVF_OK)
        return st;
    if (m->dst_layout) {
        size_t bs = (size_t)m->dst_layout->block_size;
        size_t need = (m->n_token_ids + bs - 1) / bs;
        if (m->n_dst_block_ids < need)
            return kvf_err_set(err, KVF_ERR_INVALID, "rpc: RemotePrefillRequest %s: %zu "
                               "dst_block_ids for %zu tokens at block_size %zu (need %zu)",
                               m->request_id, m->n_dst_block_ids, m->n_token_ids, bs, need);
    }
    return check_sampling(w, m->sampling, err);
}

static kvf_status check_watch(const void *msg, kvf_err *err)
{
    const Kvfleet__V1__WatchKvRequest *m = msg;
    return check_id("WatchKvRequest", "router_id", m->router_id, false, err);
}

static kvf_status check_cancel(const void *msg, kvf_err *err)
{
    const Kvfleet__V1__CancelRequest *m = msg;
    return check_id("CancelRequest", "request_id", m->request_id, true, err);
}

static kvf_status check_info_response(const void *msg, kvf_err *err)
{
    const Kvfleet__V1__InfoResponse *m = msg;
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
    return check_layout("InfoResponse", "kv_layout", m->kv_layout, err);
}

static kvf_status check_watch_response(const void *msg, kvf_err *err)
{
    const Kvfleet__V1__WatchKvResponse *m = msg;
    const Kvfleet__V1__KvEvent *e = m->body_case == KVFLEET__V1__WATCH_KV_RESPONSE__BODY_EVENT
                                        ? m->event
                                        : NULL;
    if (!e)
        return KVF_OK;
    if (e->n_parent_hashes != 0 && e->n_parent_hashes != e->n_block_hashes)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: KvEvent %llu: %zu parent_hashes for %zu "
                           "block_hashes (want equal, or none)", (unsigned long long)e->seq,
                           e->n_parent_hashes, e->n_block_hashes);
    if (e->block_size < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: KvEvent %llu: block_size is %d",
                           (unsigned long long)e->seq, (int)e->block_size);
    return KVF_OK;
}

static kvf_status check_generate_response(const void *msg, kvf_err *err)
{
    const Kvfleet__V1__GenerateResponse *m = msg;
    return check_nonneg("GenerateResponse", "token_ids", m->token_ids, m->n_token_ids, err);
}

kvf_status kvf_rpc_info_request_decode(const uint8_t *data, size_t len,
                                       Kvfleet__V1__InfoRequest **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__info_request__descriptor, check_none, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_generate_request_decode(const uint8_t *data, size_t len,
                                           Kvfleet__V1__GenerateRequest **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__generate_request__descriptor, check_generate, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_remote_prefill_request_decode(const uint8_t *data, size_t len,
                                                 Kvfleet__V1__RemotePrefillRequest **out,
                                                 kvf_err *err)
{
    void *m = NULL;
    kvf_status st = decode(&kvfleet__v1__remote_prefill_request__descriptor, check_remote_prefill,
                           data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_watch_kv_request_decode(const uint8_t *data, size_t len,
                                           Kvfleet__V1__WatchKvRequest **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__watch_kv_request__descriptor, check_watch, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_cancel_request_decode(const uint8_t *data, size_t len,
                                         Kvfleet__V1__CancelRequest **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__cancel_request__descriptor, check_cancel, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_health_request_decode(const uint8_t *data, size_t len,
                                         Kvfleet__V1__HealthRequest **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__health_request__descriptor, check_none, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_info_response_decode(const uint8_t *data, size_t len,
                                        Kvfleet__V1__InfoResponse **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__info_response__descriptor, check_info_response, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_generate_response_decode(const uint8_t *data, size_t len,
                                            Kvfleet__V1__GenerateResponse **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__generate_response__descriptor, check_generate_response, data, len, &m,
               err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_remote_prefill_response_decode(const uint8_t *data, size_t len,
                                                  Kvfleet__V1__RemotePrefillResponse **out,
                                                  kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__remote_prefill_response__descriptor, check_none, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_watch_kv_response_decode(const uint8_t *data, size_t len,
                                            Kvfleet__V1__WatchKvResponse **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__watch_kv_response__descriptor, check_watch_response, data, len, &m,
               err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_cancel_response_decode(const uint8_t *data, size_t len,
                                          Kvfleet__V1__CancelResponse **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__cancel_response__descriptor, check_none, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

kvf_status kvf_rpc_health_response_decode(const uint8_t *data, size_t len,
                                          Kvfleet__V1__HealthResponse **out, kvf_err *err)
{
    void *m = NULL;
    kvf_status st =
        decode(&kvfleet__v1__health_response__descriptor, check_none, data, len, &m, err);
    if (st == KVF_OK)
        *out = m;
    return st;
}

Kvfleet__V1__DType kvf_rpc_dtype_to_msg(kvf_dtype t)
{
    switch (t) {
    case KVF_DTYPE_F32: return KVFLEET__V1__DTYPE__DTYPE_F32;
    case KVF_DTYPE_F16: return KVFLEET__V1__DTYPE__DTYPE_F16;
    case KVF_DTYPE_BF16: return KVFLEET__V1__DTYPE__DTYPE_BF16;
    case KVF_DTYPE_FP8_E4M3: return KVFLEET__V1__DTYPE__DTYPE_FP8_E4M3;
    }
    return KVFLEET__V1__DTYPE__DTYPE_UNSPECIFIED;
}

kvf_status kvf_rpc_dtype_from_msg(Kvfleet__V1__DType d, kvf_dtype *out, kvf_err *err)
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
