/* fuzz_proto.c: random bytes into every checked decoder of the Worker service's messages
 * (proto/worker.h). A decoder must refuse or accept without crashing or leaking; a refusal hands
 * nothing out and always says why. Whatever it accepts must encode again with the matching typed
 * encoder, decode again, and re-encode to the same bytes (so the decoders' normalisations, such
 * as top_p 0 read as 1, settle after one pass). Info and Health requests carry no field: their
 * decoders return only a status, and are checked on their own. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/worker.h"

/* A refusal: nothing handed out, a status that says what kind, a message that says why. */
static void check_refusal(kvf_status st, const void *out, const kvf_err *err)
{
    if (out || err->status != st || !err->msg[0])
        abort();
    if (st != KVF_ERR_PARSE && st != KVF_ERR_INVALID && st != KVF_ERR_UNSUPPORTED &&
        st != KVF_ERR_NOMEM)
        abort();
}

/* ---- each message's typed pair, behind one signature ---------------------------------------- */

typedef kvf_status (*decode_fn)(const uint8_t *data, size_t len, void **out, kvf_err *err);
typedef kvf_status (*encode_fn)(const void *msg, kvf_rpc_buf *out, kvf_err *err);

static kvf_status info_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_info *m = NULL;
    kvf_status st = kvf_rpc_info_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status info_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_info_encode(m, b, e);
}

static kvf_status generate_req_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_generate_req *m = NULL;
    kvf_status st = kvf_rpc_generate_req_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status generate_req_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_generate_req_encode(m, b, e);
}

static kvf_status generate_resp_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_generate_resp *m = NULL;
    kvf_status st = kvf_rpc_generate_resp_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status generate_resp_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_generate_resp_encode(m, b, e);
}

static kvf_status remote_prefill_req_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_remote_prefill_req *m = NULL;
    kvf_status st = kvf_rpc_remote_prefill_req_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status remote_prefill_req_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_remote_prefill_req_encode(m, b, e);
}

static kvf_status remote_prefill_resp_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_remote_prefill_resp *m = NULL;
    kvf_status st = kvf_rpc_remote_prefill_resp_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status remote_prefill_resp_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_remote_prefill_resp_encode(m, b, e);
}

static kvf_status watch_req_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_watch_req *m = NULL;
    kvf_status st = kvf_rpc_watch_req_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status watch_req_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_watch_req_encode(m, b, e);
}

static kvf_status watch_msg_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_watch_msg *m = NULL;
    kvf_status st = kvf_rpc_watch_msg_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status watch_msg_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_watch_msg_encode(m, b, e);
}

static kvf_status cancel_req_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_cancel_req *m = NULL;
    kvf_status st = kvf_rpc_cancel_req_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status cancel_req_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_cancel_req_encode(m, b, e);
}

static kvf_status cancel_resp_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_cancel_resp *m = NULL;
    kvf_status st = kvf_rpc_cancel_resp_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status cancel_resp_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_cancel_resp_encode(m, b, e);
}

static kvf_status health_dec(const uint8_t *d, size_t n, void **out, kvf_err *e)
{
    kvf_rpc_health *m = NULL;
    kvf_status st = kvf_rpc_health_decode(d, n, &m, e);
    *out = m;
    return st;
}
static kvf_status health_enc(const void *m, kvf_rpc_buf *b, kvf_err *e)
{
    return kvf_rpc_health_encode(m, b, e);
}

static const struct codec {
    decode_fn decode;
    encode_fn encode;
} codecs[] = {
    {info_dec, info_enc},
    {generate_req_dec, generate_req_enc},
    {generate_resp_dec, generate_resp_enc},
    {remote_prefill_req_dec, remote_prefill_req_enc},
    {remote_prefill_resp_dec, remote_prefill_resp_enc},
    {watch_req_dec, watch_req_enc},
    {watch_msg_dec, watch_msg_enc},
    {cancel_req_dec, cancel_req_enc},
    {cancel_resp_dec, cancel_resp_enc},
    {health_dec, health_enc},
};

/* decode -> encode -> decode -> encode: the second decode accepts, and both encodings match. */
static void check_codec(const struct codec *c, const uint8_t *data, size_t size)
{
    void *msg = NULL;
    kvf_err err = {0};
    kvf_status st = c->decode(data, size, &msg, &err);
    if (st != KVF_OK) {
        check_refusal(st, msg, &err);
        return;
    }
    if (!msg)
        abort();
    kvf_rpc_buf b = {0}, b2 = {0};
    if (c->encode(msg, &b, &err) != KVF_OK)
        abort();
    void *again = NULL;
    if (c->decode(b.data, b.len, &again, &err) != KVF_OK || !again)
        abort();
    if (c->encode(again, &b2, &err) != KVF_OK || b2.len != b.len ||
        (b.len && memcmp(b.data, b2.data, b.len) != 0))
        abort();
    kvf_rpc_buf_free(&b);
    kvf_rpc_buf_free(&b2);
    free(again);
    free(msg);
}

/* Info and Health requests: a status only; what their encoders write must be accepted. */
static void check_empty_request(kvf_status (*decode)(const uint8_t *, size_t, kvf_err *),
                                kvf_status (*encode)(kvf_rpc_buf *, kvf_err *),
                                const uint8_t *data, size_t size)
{
    kvf_err err = {0};
    kvf_status st = decode(data, size, &err);
    if (st != KVF_OK) {
        check_refusal(st, NULL, &err);
        return;
    }
    kvf_rpc_buf b = {0};
    if (encode(&b, &err) != KVF_OK || decode(b.data, b.len, &err) != KVF_OK)
        abort();
    kvf_rpc_buf_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (size_t i = 0; i < sizeof codecs / sizeof codecs[0]; i++)
        check_codec(&codecs[i], data, size);
    check_empty_request(kvf_rpc_info_req_decode, kvf_rpc_info_req_encode, data, size);
    check_empty_request(kvf_rpc_health_req_decode, kvf_rpc_health_req_encode, data, size);
    return 0;
}
