/* test_worker.c: the Worker service's messages through proto/worker.h's typed API: every message
 * survives encode/decode; the checked decoders refuse malformed bytes, bad fields and enum
 * values outside the proto with messages naming the field and the value; Info's protocol version
 * and layout checks; the KV layout round trip with each dtype; the wire's "off" values (no
 * sampling block, top_p 0, n 0) read as the defaults. What the typed encoders cannot say (a
 * missing block, a wire value no kvfleet struct holds) is built here as raw protobuf bytes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <cmocka.h>

#include "proto/worker.h"

/* ---- raw protobuf bytes, written by hand ---------------------------------------------------- */

typedef struct pbw {
    uint8_t b[512];
    size_t n;
} pbw;

static void pb_raw(pbw *w, const void *p, size_t n)
{
    assert_true(w->n + n <= sizeof w->b);
    memcpy(w->b + w->n, p, n);
    w->n += n;
}

static void pb_varint(pbw *w, uint64_t v)
{
    uint8_t t[10];
    size_t n = 0;
    for (; v >= 0x80; v >>= 7)
        t[n++] = (uint8_t)(v | 0x80);
    t[n++] = (uint8_t)v;
    pb_raw(w, t, n);
}

static void pb_tag(pbw *w, uint32_t field, unsigned wire_type)
{
    pb_varint(w, (uint64_t)field << 3 | wire_type);
}

/* A varint field (int32 and enums are sign-extended to 64 bits, as protobuf writes them). */
static void pb_int(pbw *w, uint32_t field, int64_t v)
{
    pb_tag(w, field, 0);
    pb_varint(w, (uint64_t)v);
}

static void pb_bytes(pbw *w, uint32_t field, const void *p, size_t n)
{
    pb_tag(w, field, 2);
    pb_varint(w, n);
    pb_raw(w, p, n);
}

static void pb_str(pbw *w, uint32_t field, const char *s) { pb_bytes(w, field, s, strlen(s)); }

static void pb_msg(pbw *w, uint32_t field, const pbw *sub) { pb_bytes(w, field, sub->b, sub->n); }

static void pb_packed_i32(pbw *w, uint32_t field, const int32_t *v /* [n] */, size_t n)
{
    pbw p = {0};
    for (size_t i = 0; i < n; i++)
        pb_varint(&p, (uint64_t)(int64_t)v[i]);
    pb_msg(w, field, &p);
}

static void pb_packed_fixed64(pbw *w, uint32_t field, const uint64_t *v /* [n] */, size_t n)
{
    pbw p = {0};
    for (size_t i = 0; i < n; i++)
        for (int k = 0; k < 8; k++) {
            uint8_t byte = (uint8_t)(v[i] >> (8 * k));
            pb_raw(&p, &byte, 1);
        }
    pb_msg(w, field, &p);
}

static void assert_msg_has(const kvf_err *e, const char *part)
{
    if (!strstr(e->msg, part))
        fail_msg("message \"%s\" lacks \"%s\"", e->msg, part);
}

/* ---- fixtures ---------------------------------------------------------------------------------- */

static kvf_kv_layout layout_of(kvf_dtype t)
{
    kvf_kv_layout l = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 64, .block_size = 16,
                       .dtype = t};
    l.block_bytes = 2LL * l.n_layers * l.n_kv_heads * l.block_size * l.head_dim *
                    (int64_t)kvf_dtype_size(t);
    return l;
}

static void assert_layout_equal(const kvf_kv_layout *a, const kvf_kv_layout *b)
{
    assert_int_equal(a->n_layers, b->n_layers);
    assert_int_equal(a->n_kv_heads, b->n_kv_heads);
    assert_int_equal(a->head_dim, b->head_dim);
    assert_int_equal(a->block_size, b->block_size);
    assert_int_equal(a->dtype, b->dtype);
    assert_int_equal(a->block_bytes, b->block_bytes);
}

static void assert_sampling_equal(const kvf_rpc_sampling *a, const kvf_rpc_sampling *b)
{
    assert_int_equal(a->max_tokens, b->max_tokens);
    assert_true(a->temperature == b->temperature);
    assert_true(a->top_p == b->top_p);
    assert_int_equal(a->top_k, b->top_k);
    assert_int_equal(a->seed, b->seed);
    assert_int_equal(a->n, b->n);
    assert_int_equal(a->ignore_eos, b->ignore_eos);
    assert_int_equal(a->n_stop, b->n_stop);
    for (int32_t i = 0; i < a->n_stop; i++)
        assert_int_equal(a->stop_ids[i], b->stop_ids[i]);
    assert_true(a->presence_penalty == b->presence_penalty);
    assert_true(a->frequency_penalty == b->frequency_penalty);
    assert_true(a->repetition_penalty == b->repetition_penalty);
    assert_true(a->min_p == b->min_p);
    assert_int_equal(a->min_tokens, b->min_tokens);
    assert_int_equal(a->n_bias, b->n_bias);
    for (int32_t i = 0; i < a->n_bias; i++)
        assert_true(a->bias[i].id == b->bias[i].id && a->bias[i].bias == b->bias[i].bias);
    assert_int_equal(a->logprobs, b->logprobs);
    assert_int_equal(a->top_logprobs, b->top_logprobs);
    assert_int_equal(a->prompt_logprobs, b->prompt_logprobs);
    assert_int_equal(a->guide_kind, b->guide_kind);
    assert_int_equal(a->guide_len, b->guide_len);
    if (a->guide_len)
        assert_memory_equal(a->guide, b->guide, a->guide_len);
}

static kvf_rpc_info info_fixture(const uint8_t *blob, size_t blob_len)
{
    return (kvf_rpc_info){
        .protocol_version = KVF_RPC_PROTOCOL_VERSION, .role = KVF_RPC_ROLE_DECODE,
        .model_id = "tiny-llama", .block_size = 16, .has_kv_layout = true,
        .kv_layout = layout_of(KVF_DTYPE_F16), .capacity_blocks = 4096,
        .transport = {.backend = "ucx", .blob = blob, .blob_len = blob_len},
        .worker_id = "decode-0", .software_version = "0.9.1"};
}

/* Encodes in and runs the Info decoder: *out on KVF_OK, else the refusal (out untouched). */
static kvf_status info_decode(const kvf_rpc_info *in, kvf_rpc_info **out, kvf_err *e)
{
    kvf_rpc_buf b = {0};
    assert_int_equal(kvf_rpc_info_encode(in, &b, e), KVF_OK);
    kvf_rpc_info *o = (void *)1;
    kvf_status st = kvf_rpc_info_decode(b.data, b.len, &o, e);
    kvf_rpc_buf_free(&b);
    if (st != KVF_OK) {
        assert_ptr_equal(o, (void *)1); /* a refusal hands nothing out */
        assert_true(e->msg[0] != '\0');
        o = NULL;
    }
    *out = o;
    return st;
}

/* ---- Info ---------------------------------------------------------------------------------- */

static void test_info_roundtrip(void **state)
{
    (void)state;
    uint8_t blob[3] = {1, 0, 255};
    kvf_rpc_info in = info_fixture(blob, 3);
    kvf_rpc_info *out;
    kvf_err e;
    assert_int_equal(info_decode(&in, &out, &e), KVF_OK);
    assert_int_equal(out->protocol_version, KVF_RPC_PROTOCOL_VERSION);
    assert_int_equal(out->role, KVF_RPC_ROLE_DECODE);
    assert_string_equal(out->model_id, "tiny-llama");
    assert_int_equal(out->block_size, 16);
    assert_int_equal(out->capacity_blocks, 4096);
    assert_true(out->has_kv_layout);
    assert_int_equal(out->kv_layout.head_dim, 64);
    assert_int_equal(out->kv_layout.block_bytes, in.kv_layout.block_bytes);
    assert_int_equal(out->kv_layout.dtype, KVF_DTYPE_F16);
    assert_string_equal(out->transport.backend, "ucx");
    assert_int_equal(out->transport.blob_len, 3);
    assert_memory_equal(out->transport.blob, blob, 3);
    assert_string_equal(out->worker_id, "decode-0");
    assert_string_equal(out->software_version, "0.9.1");
    free(out);

    /* Without a layout: has_kv_layout stays false. */
    in.has_kv_layout = false;
    assert_int_equal(info_decode(&in, &out, &e), KVF_OK);
    assert_false(out->has_kv_layout);
    assert_int_equal(out->block_size, 16);
    free(out);
    in.has_kv_layout = true;

    /* Another protocol version is refused, naming both. */
    in.protocol_version = KVF_RPC_PROTOCOL_VERSION + 1;
    assert_int_equal(info_decode(&in, &out, &e), KVF_ERR_UNSUPPORTED);
    assert_msg_has(&e, "worker decode-0 speaks protocol version 2; this build speaks 1");
    in.protocol_version = KVF_RPC_PROTOCOL_VERSION;
    /* A layout whose block size disagrees with the worker's. */
    in.kv_layout.block_size = 32;
    assert_int_equal(info_decode(&in, &out, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "kv_layout.block_size 32 differs from block_size 16");
    in.kv_layout.block_size = 16;
    /* A block size that is not positive. */
    in.block_size = 0;
    in.has_kv_layout = false;
    assert_int_equal(info_decode(&in, &out, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "InfoResponse.block_size is 0 (must be > 0)");
    in.block_size = 16;
    in.has_kv_layout = true;
    /* An unknown dtype: a kvf_dtype outside the enum goes out as the proto's "unspecified" (0)
     * and the decoder refuses it, naming the field. */
    in.kv_layout.dtype = (kvf_dtype)99;
    assert_int_equal(info_decode(&in, &out, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "InfoResponse.kv_layout: dtype 0 is not one of");
}

/* ---- Generate ------------------------------------------------------------------------------ */

/* Encodes g, runs the checked decoder and expects want (and msg_part in the refusal). */
static kvf_rpc_generate_req *generate_roundtrip(const kvf_rpc_generate_req *g, kvf_status want,
                                                const char *msg_part)
{
    kvf_rpc_buf b = {0};
    kvf_err e;
    assert_int_equal(kvf_rpc_generate_req_encode(g, &b, &e), KVF_OK);
    kvf_rpc_generate_req *out = (void *)1;
    kvf_status st = kvf_rpc_generate_req_decode(b.data, b.len, &out, &e);
    kvf_rpc_buf_free(&b);
    assert_int_equal(st, want);
    if (st != KVF_OK) {
        assert_ptr_equal(out, (void *)1); /* untouched */
        assert_msg_has(&e, msg_part);
        return NULL;
    }
    return out;
}

static void test_generate_checks(void **state)
{
    (void)state;
    int32_t toks[4] = {1, 2, 3, 4};
    kvf_rpc_generate_req g = {.request_id = "req-42", .token_ids = toks, .n_token_ids = 4,
                              .cache_salt = "tenant-a", .prefill_addr = "10.0.0.7:7001",
                              .deadline_unix_ms = 1700000000000, .n_prior_output_tokens = 1};
    kvf_rpc_sampling *sp = &g.sampling;
    kvf_rpc_sampling_default(sp);
    sp->max_tokens = 32;
    sp->temperature = 0.7f;
    sp->top_p = 0.9f;
    sp->top_k = 40;
    sp->seed = 1234;
    sp->n = 3;
    sp->ignore_eos = true;
    sp->n_stop = 2;
    sp->stop_ids[0] = 2;
    sp->stop_ids[1] = 7;

    kvf_rpc_generate_req *out = generate_roundtrip(&g, KVF_OK, NULL);
    assert_string_equal(out->request_id, "req-42");
    assert_int_equal(out->n_token_ids, 4);
    assert_memory_equal(out->token_ids, toks, sizeof toks);
    assert_sampling_equal(&out->sampling, sp);
    assert_int_equal(out->sampling.top_k, 40);
    assert_int_equal(out->sampling.seed, 1234);
    assert_int_equal(out->sampling.n_stop, 2);
    assert_string_equal(out->prefill_addr, "10.0.0.7:7001");
    assert_string_equal(out->cache_salt, "tenant-a");
    assert_int_equal(out->deadline_unix_ms, 1700000000000);
    assert_int_equal(out->n_prior_output_tokens, 1);
    free(out);
    /* No prefill worker and no salt read back as "". */
    g.prefill_addr = NULL;
    g.cache_salt = NULL;
    out = generate_roundtrip(&g, KVF_OK, NULL);
    assert_string_equal(out->prefill_addr, "");
    assert_string_equal(out->cache_salt, "");
    free(out);
    g.prefill_addr = "10.0.0.7:7001";
    g.cache_salt = "tenant-a";
    g.n_prior_output_tokens = 0;

    g.request_id = "";
    generate_roundtrip(&g, KVF_ERR_INVALID, "GenerateRequest.request_id is empty");
    g.request_id = "bad id";
    generate_roundtrip(&g, KVF_ERR_INVALID, "request_id has byte 0x20 at 3");
    g.request_id = "req-42";
    g.n_token_ids = 0;
    generate_roundtrip(&g, KVF_ERR_INVALID, "req-42: token_ids is empty");
    g.n_token_ids = 4;
    g.n_prior_output_tokens = 4;
    generate_roundtrip(&g, KVF_ERR_INVALID, "n_prior_output_tokens is 4 (allowed 0..3");
    g.n_prior_output_tokens = 0;
    sp->top_p = 1.5f;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.top_p is 1.5 (allowed 0..1)");
    sp->top_p = 0.9f;
    sp->temperature = -1;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.temperature is -1");
    sp->temperature = 0;
    sp->stop_ids[1] = -2;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.stop_token_ids[1] is -2");
    sp->stop_ids[1] = 7;
    sp->n = KVF_RPC_MAX_N + 1;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.n is 65");
    sp->n = 0;
    out = generate_roundtrip(&g, KVF_OK, NULL);
    assert_int_equal(out->sampling.n, 1);
    free(out);
}

/* Issue 23's sampling fields and the log-probabilities travel whole, and what is out of range
 * (a penalty, a bias, a logprob above 0, tops that do not pair up) is refused by name. */
static void test_logprob_fields(void **state)
{
    (void)state;
    int32_t toks[2] = {5, 6};
    kvf_rpc_generate_req g = {.request_id = "req-lp", .token_ids = toks, .n_token_ids = 2};
    kvf_rpc_sampling *sp = &g.sampling;
    kvf_rpc_sampling_default(sp);
    sp->repetition_penalty = 1.0f;
    kvf_rpc_generate_req *out = generate_roundtrip(&g, KVF_OK, NULL);
    assert_true(out->sampling.repetition_penalty == 1.0f); /* off travels as 0, reads as 1 */
    free(out);
    sp->presence_penalty = 0.5f;
    sp->frequency_penalty = -1.25f;
    sp->repetition_penalty = 1.5f;
    sp->min_p = 0.05f;
    sp->min_tokens = 4;
    sp->n_bias = 2;
    sp->bias[0] = (kvf_rpc_bias){.id = 3, .bias = 100};
    sp->bias[1] = (kvf_rpc_bias){.id = 9, .bias = -7.5f};
    sp->logprobs = true;
    sp->top_logprobs = 20;
    sp->prompt_logprobs = true;
    out = generate_roundtrip(&g, KVF_OK, NULL);
    assert_sampling_equal(&out->sampling, sp);
    free(out);
    sp->presence_penalty = 2.5f;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.presence_penalty is 2.5");
    sp->presence_penalty = NAN;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.presence_penalty is nan");
    sp->presence_penalty = 0;
    sp->bias[1].bias = 101;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.logit_bias[1]");
    sp->bias[1] = (kvf_rpc_bias){.id = -1, .bias = 1};
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.logit_bias[1]");
    sp->bias[1] = (kvf_rpc_bias){.id = 9, .bias = 1};
    sp->top_logprobs = 21;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.top_logprobs is 21");
    sp->top_logprobs = 2;
    sp->min_tokens = -1;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.min_tokens is -1");

    /* GenerateResponse: a row per token, prompt rows after the first prompt token */
    kvf_rpc_logprob lp[2] = {{.logprob = -0.5f, .n_top = 2, .top_ids = {4, 5}, .top_lps = {-0.1f, -0.5f}},
                             {.logprob = -INFINITY, .n_top = 0}};
    kvf_rpc_generate_resp gr = {.token_ids = toks, .n_token_ids = 2, .logprobs = lp,
                                .prompt_lps = lp, .n_prompt_lps = 2, .prompt_lps_start = 1};
    kvf_rpc_buf b = {0};
    kvf_err e = {0};
    kvf_rpc_generate_resp *grout = NULL;
    assert_int_equal(kvf_rpc_generate_resp_encode(&gr, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_generate_resp_decode(b.data, b.len, &grout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_non_null(grout->logprobs);
    assert_true(grout->logprobs[0].logprob == -0.5f && grout->logprobs[1].logprob == -INFINITY);
    assert_int_equal(grout->logprobs[0].n_top, 2);
    assert_int_equal(grout->logprobs[0].top_ids[1], 5);
    assert_true(grout->logprobs[0].top_lps[0] == -0.1f);
    assert_int_equal(grout->n_prompt_lps, 2);
    assert_int_equal(grout->prompt_lps_start, 1);
    free(grout);
    lp[1].logprob = 0.25f; /* a probability above 1 */
    assert_int_equal(kvf_rpc_generate_resp_encode(&gr, &b, &e), KVF_OK);
    grout = (void *)1;
    assert_int_equal(kvf_rpc_generate_resp_decode(b.data, b.len, &grout, &e), KVF_ERR_INVALID);
    assert_ptr_equal(grout, (void *)1);
    assert_non_null(strstr(e.msg, "logprobs[1].logprob is 0.25"));
    kvf_rpc_buf_free(&b);
    lp[1].logprob = -1;
    gr.prompt_lps_start = 0;
    assert_int_equal(kvf_rpc_generate_resp_encode(&gr, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_generate_resp_decode(b.data, b.len, &grout, &e), KVF_ERR_INVALID);
    kvf_rpc_buf_free(&b);

    /* RemotePrefillResponse: the first token's */
    kvf_rpc_remote_prefill_resp rr = {.first_token = 7, .has_first_logprob = true, .first_logprob = lp[0]};
    kvf_rpc_remote_prefill_resp *rrout = NULL;
    assert_int_equal(kvf_rpc_remote_prefill_resp_encode(&rr, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_remote_prefill_resp_decode(b.data, b.len, &rrout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_true(rrout->has_first_logprob && rrout->first_logprob.logprob == -0.5f);
    assert_int_equal(rrout->first_logprob.top_ids[0], 4);
    free(rrout);
}

/* ---- RemotePrefill --------------------------------------------------------------------------- */

/* Encodes r and runs the checked decoder; on KVF_OK compares what came back. */
static kvf_status prefill_decode(const kvf_rpc_remote_prefill_req *r, kvf_err *e)
{
    kvf_rpc_buf b = {0};
    assert_int_equal(kvf_rpc_remote_prefill_req_encode(r, &b, e), KVF_OK);
    kvf_rpc_remote_prefill_req *out = (void *)1;
    kvf_status st = kvf_rpc_remote_prefill_req_decode(b.data, b.len, &out, e);
    kvf_rpc_buf_free(&b);
    if (st != KVF_OK) {
        assert_ptr_equal(out, (void *)1);
        assert_true(e->msg[0] != '\0');
        return st;
    }
    assert_string_equal(out->request_id, r->request_id);
    assert_int_equal(out->n_token_ids, r->n_token_ids);
    assert_memory_equal(out->token_ids, r->token_ids, r->n_token_ids * sizeof *r->token_ids);
    assert_int_equal(out->n_dst_block_ids, r->n_dst_block_ids);
    if (r->n_dst_block_ids)
        assert_memory_equal(out->dst_block_ids, r->dst_block_ids,
                            r->n_dst_block_ids * sizeof *r->dst_block_ids);
    assert_int_equal(out->dst_cached_blocks, r->dst_cached_blocks);
    assert_string_equal(out->dst.backend, r->dst.backend);
    assert_int_equal(out->dst.blob_len, r->dst.blob_len);
    if (r->dst.blob_len)
        assert_memory_equal(out->dst.blob, r->dst.blob, r->dst.blob_len);
    assert_int_equal(out->transfer_id, r->transfer_id);
    assert_string_equal(out->cache_salt, r->cache_salt ? r->cache_salt : "");
    assert_int_equal(out->deadline_unix_ms, r->deadline_unix_ms);
    assert_int_equal(out->has_dst_layout, r->has_dst_layout);
    if (r->has_dst_layout)
        assert_layout_equal(&out->dst_layout, &r->dst_layout);
    assert_sampling_equal(&out->sampling, &r->sampling);
    free(out);
    return st;
}

static void test_remote_prefill_checks(void **state)
{
    (void)state;
    int32_t toks[33];
    for (int i = 0; i < 33; i++)
        toks[i] = i + 1;
    int32_t blocks[3] = {10, 11, 12};
    uint8_t blob[2] = {9, 9};
    kvf_rpc_remote_prefill_req r = {
        .request_id = "req-7", .token_ids = toks, .n_token_ids = 33, /* 3 blocks of 16 */
        .dst_block_ids = blocks, .n_dst_block_ids = 3, .dst_cached_blocks = 1,
        .dst = {.backend = "local", .blob = blob, .blob_len = 2}, .transfer_id = 77,
        .cache_salt = "tenant-b", .deadline_unix_ms = 1700000000123, .has_dst_layout = true,
        .dst_layout = layout_of(KVF_DTYPE_F16)};
    kvf_rpc_sampling_default(&r.sampling);
    kvf_err e;
    assert_int_equal(prefill_decode(&r, &e), KVF_OK);

    r.dst_cached_blocks = 4;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "dst_cached_blocks is 4 (allowed 0..3");
    r.dst_cached_blocks = 0;
    r.n_dst_block_ids = 2;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "2 dst_block_ids for 33 tokens at block_size 16 (need 3)");
    r.n_dst_block_ids = 3;
    blocks[2] = -1;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "dst_block_ids[2] is -1");
    blocks[2] = 12;
    /* No destination: the typed struct's empty backend ... */
    r.dst = (kvf_rpc_transport){0};
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "dst (the destination's transport descriptor) is missing");
    r.dst = (kvf_rpc_transport){.backend = "local", .blob = blob, .blob_len = 2};
    /* ... and a message with no dst field at all. */
    pbw w = {0};
    pb_str(&w, 1, "req-7");
    pb_packed_i32(&w, 2, toks, 1);
    kvf_rpc_remote_prefill_req *out = (void *)1;
    assert_int_equal(kvf_rpc_remote_prefill_req_decode(w.b, w.n, &out, &e), KVF_ERR_INVALID);
    assert_ptr_equal(out, (void *)1);
    assert_msg_has(&e, "req-7: dst (the destination's transport descriptor) is missing");
    r.dst_layout.n_layers = 0;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "dst_layout has a non-positive shape (layers 0");
    r.dst_layout.n_layers = 2;
    /* Without a layout, the block count is the prefill worker's to check. */
    r.has_dst_layout = false;
    r.n_dst_block_ids = 1;
    assert_int_equal(prefill_decode(&r, &e), KVF_OK);
}

/* ---- the KV layout with each dtype (the dtype mapping lives in proto/wire.c) --------------- */

static void test_layout_each_dtype(void **state)
{
    (void)state;
    kvf_err e;
    int32_t toks[20], blocks[2] = {0, 1};
    for (int i = 0; i < 20; i++)
        toks[i] = i;
    for (int t = 0; t < KVF_DTYPE_COUNT; t++) {
        kvf_kv_layout l = layout_of((kvf_dtype)t);
        /* through Info ... */
        kvf_rpc_info in = info_fixture(NULL, 0);
        in.kv_layout = l;
        kvf_rpc_info *info;
        assert_int_equal(info_decode(&in, &info, &e), KVF_OK);
        assert_true(info->has_kv_layout);
        assert_layout_equal(&info->kv_layout, &l);
        free(info);
        /* ... and through RemotePrefill */
        kvf_rpc_remote_prefill_req r = {.request_id = "req-l", .token_ids = toks,
                                        .n_token_ids = 20, .dst_block_ids = blocks,
                                        .n_dst_block_ids = 2, .dst = {.backend = "local"},
                                        .has_dst_layout = true, .dst_layout = l};
        kvf_rpc_sampling_default(&r.sampling);
        assert_int_equal(prefill_decode(&r, &e), KVF_OK);
    }

    /* A kvf_dtype outside the enum goes out as "unspecified" and is refused, naming the field. */
    kvf_rpc_remote_prefill_req r = {.request_id = "req-l", .token_ids = toks, .n_token_ids = 20,
                                    .dst_block_ids = blocks, .n_dst_block_ids = 2,
                                    .dst = {.backend = "local"}, .has_dst_layout = true,
                                    .dst_layout = layout_of(KVF_DTYPE_F32)};
    kvf_rpc_sampling_default(&r.sampling);
    r.dst_layout.dtype = (kvf_dtype)99;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "RemotePrefillRequest.dst_layout: dtype 0 is not one of f32 (1), f16 (2), "
                       "bf16 (3), fp8-e4m3 (4)");

    /* A wire value past the proto's DType (only raw bytes can carry one). */
    pbw kl = {0}, w = {0};
    pb_int(&kl, 1, 2);  /* n_layers */
    pb_int(&kl, 2, 2);  /* n_kv_heads */
    pb_int(&kl, 3, 64); /* head_dim */
    pb_int(&kl, 4, 16); /* block_size */
    pb_int(&kl, 5, 9);  /* dtype */
    pb_int(&kl, 6, 16384);
    pb_int(&w, 1, KVF_RPC_PROTOCOL_VERSION);
    pb_int(&w, 4, 16);
    pb_msg(&w, 5, &kl);
    kvf_rpc_info *info = (void *)1;
    assert_int_equal(kvf_rpc_info_decode(w.b, w.n, &info, &e), KVF_ERR_INVALID);
    assert_ptr_equal(info, (void *)1);
    assert_msg_has(&e, "InfoResponse.kv_layout: dtype 9 is not one of");
}

/* ---- the wire's "off" values --------------------------------------------------------------- */

static void test_sampling_off_values(void **state)
{
    (void)state;
    kvf_err e;
    kvf_rpc_buf b = {0};
    kvf_rpc_sampling def;
    kvf_rpc_sampling_default(&def);
    assert_true(def.top_p == 1.0f);
    assert_int_equal(def.n, 1);
    int32_t toks[3] = {5, 6, 7}, blocks[1] = {4};

    /* top_p 0 and n 0 read as 1 and 1, in both requests that carry sampling. */
    kvf_rpc_generate_req g = {.request_id = "req-s", .token_ids = toks, .n_token_ids = 3};
    kvf_rpc_sampling_default(&g.sampling);
    g.sampling.top_p = 0;
    g.sampling.n = 0;
    g.sampling.temperature = 0.5f;
    kvf_rpc_generate_req *gout = generate_roundtrip(&g, KVF_OK, NULL);
    assert_true(gout->sampling.top_p == 1.0f);
    assert_int_equal(gout->sampling.n, 1);
    assert_true(gout->sampling.temperature == 0.5f);
    free(gout);
    kvf_rpc_remote_prefill_req r = {.request_id = "req-s", .token_ids = toks, .n_token_ids = 3,
                                    .dst_block_ids = blocks, .n_dst_block_ids = 1,
                                    .dst = {.backend = "local"}};
    kvf_rpc_sampling_default(&r.sampling);
    r.sampling.top_p = 0;
    r.sampling.n = 0;
    r.sampling.top_k = 8;
    assert_int_equal(kvf_rpc_remote_prefill_req_encode(&r, &b, &e), KVF_OK);
    kvf_rpc_remote_prefill_req *rout = NULL;
    assert_int_equal(kvf_rpc_remote_prefill_req_decode(b.data, b.len, &rout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_true(rout->sampling.top_p == 1.0f);
    assert_int_equal(rout->sampling.n, 1);
    assert_int_equal(rout->sampling.top_k, 8);
    free(rout);

    /* No sampling block at all (the typed encoders always write one): the defaults. */
    pbw w = {0};
    pb_str(&w, 1, "req-s");
    pb_packed_i32(&w, 2, toks, 3);
    gout = NULL;
    assert_int_equal(kvf_rpc_generate_req_decode(w.b, w.n, &gout, &e), KVF_OK);
    assert_int_equal(gout->n_token_ids, 3);
    assert_sampling_equal(&gout->sampling, &def);
    free(gout);
    pbw dst = {0};
    w = (pbw){0};
    pb_str(&dst, 1, "local");
    pb_str(&w, 1, "req-s");
    pb_packed_i32(&w, 2, toks, 3);
    pb_packed_i32(&w, 3, blocks, 1);
    pb_msg(&w, 5, &dst);
    rout = NULL;
    assert_int_equal(kvf_rpc_remote_prefill_req_decode(w.b, w.n, &rout, &e), KVF_OK);
    assert_string_equal(rout->dst.backend, "local");
    assert_false(rout->has_dst_layout);
    assert_sampling_equal(&rout->sampling, &def);
    free(rout);
}

/* ---- WatchKv, Cancel, Health and the responses ------------------------------------------------ */

static kvf_rpc_watch_msg *watch_roundtrip(const kvf_rpc_watch_msg *w)
{
    kvf_rpc_buf b = {0};
    kvf_err e;
    assert_int_equal(kvf_rpc_watch_msg_encode(w, &b, &e), KVF_OK);
    kvf_rpc_watch_msg *out = NULL;
    assert_int_equal(kvf_rpc_watch_msg_decode(b.data, b.len, &out, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    return out;
}

static void test_watch_and_small_messages(void **state)
{
    (void)state;
    uint64_t hashes[2] = {0x1111, 0x2222}, parents[2] = {0, 0x1111};
    kvf_rpc_watch_msg w = {.event = {.seq = 9, .kind = KVF_RPC_KV_STORED, .block_hashes = hashes,
                                     .parent_hashes = parents, .n = 2, .block_size = 16,
                                     .model_id = "tiny", .snapshot_done = false}};
    kvf_rpc_watch_msg *out = watch_roundtrip(&w);
    assert_false(out->is_load);
    assert_int_equal(out->event.seq, 9);
    assert_int_equal(out->event.kind, KVF_RPC_KV_STORED);
    assert_int_equal(out->event.n, 2);
    assert_int_equal(out->event.block_hashes[1], 0x2222);
    assert_non_null(out->event.parent_hashes);
    assert_int_equal(out->event.parent_hashes[1], 0x1111);
    assert_int_equal(out->event.block_size, 16);
    assert_string_equal(out->event.model_id, "tiny");
    free(out);
    /* A removal carries no parents; a snapshot's last event says so. */
    w.event.kind = KVF_RPC_KV_REMOVED;
    w.event.parent_hashes = NULL;
    w.event.snapshot_done = true;
    out = watch_roundtrip(&w);
    assert_int_equal(out->event.kind, KVF_RPC_KV_REMOVED);
    assert_int_equal(out->event.n, 2);
    assert_null(out->event.parent_hashes);
    assert_true(out->event.snapshot_done);
    assert_int_equal(out->event.tier, KVF_RPC_TIER_POOL);
    free(out);
    /* A block moved to the host tier (demoted) keeps its tier across the wire; a tier past
     * disk is refused by name. */
    w.event.kind = KVF_RPC_KV_STORED;
    w.event.parent_hashes = parents;
    w.event.snapshot_done = false;
    w.event.tier = KVF_RPC_TIER_HOST;
    out = watch_roundtrip(&w);
    assert_int_equal(out->event.tier, KVF_RPC_TIER_HOST);
    free(out);
    {
        kvf_err te;
        kvf_rpc_buf tb = {0};
        w.event.tier = 3;
        assert_int_equal(kvf_rpc_watch_msg_encode(&w, &tb, &te), KVF_OK);
        kvf_rpc_watch_msg *tout = (void *)1;
        assert_int_equal(kvf_rpc_watch_msg_decode(tb.data, tb.len, &tout, &te), KVF_ERR_INVALID);
        assert_ptr_equal(tout, (void *)1);
        assert_msg_has(&te, "tier is 3 (allowed 0..2)");
        kvf_rpc_buf_free(&tb);
        w.event.tier = 0;
    }

    /* Parents that do not match the blocks (one count in the typed struct: raw bytes). */
    kvf_err e;
    pbw ev = {0}, msg = {0};
    pb_int(&ev, 1, 9);
    pb_int(&ev, 2, 2); /* STORED */
    pb_packed_fixed64(&ev, 3, hashes, 2);
    pb_packed_fixed64(&ev, 4, parents, 1);
    pb_msg(&msg, 1, &ev);
    kvf_rpc_watch_msg *wout = (void *)1;
    assert_int_equal(kvf_rpc_watch_msg_decode(msg.b, msg.n, &wout, &e), KVF_ERR_INVALID);
    assert_ptr_equal(wout, (void *)1);
    assert_msg_has(&e, "1 parent_hashes for 2 block_hashes");
    /* Neither an event nor a load report. */
    assert_int_equal(kvf_rpc_watch_msg_decode(NULL, 0, &wout, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "WatchKvResponse carries neither an event nor a load report");

    kvf_rpc_watch_msg lw = {.is_load = true,
                            .load = {.running = 3, .waiting = 1, .active_blocks = 28,
                                     .free_blocks = 900, .total_blocks = 928,
                                     .queued_prefill_tokens = 77, .prefill_ms_mean = 8.25,
                                     .prefill_ms_p90 = 12.5, .prefill_tokens_per_s = 5000,
                                     .unix_ms = 1700000000999}};
    out = watch_roundtrip(&lw);
    assert_true(out->is_load);
    assert_int_equal(out->load.running, 3);
    assert_int_equal(out->load.waiting, 1);
    assert_int_equal(out->load.active_blocks, 28);
    assert_int_equal(out->load.free_blocks, 900);
    assert_int_equal(out->load.total_blocks, 928);
    assert_int_equal(out->load.queued_prefill_tokens, 77);
    assert_true(out->load.prefill_ms_mean == 8.25);
    assert_true(out->load.prefill_ms_p90 == 12.5);
    assert_true(out->load.prefill_tokens_per_s == 5000);
    assert_int_equal(out->load.unix_ms, 1700000000999);
    assert_true(out->load.host_promote_s_per_block == 0);
    free(out);
    /* Measured promotion times travel; a negative or NaN one is refused (the router divides by
     * and compares with them). */
    lw.load.host_promote_s_per_block = 2.5e-5;
    lw.load.disk_promote_s_per_block = 4e-4;
    out = watch_roundtrip(&lw);
    assert_true(out->load.host_promote_s_per_block == 2.5e-5);
    assert_true(out->load.disk_promote_s_per_block == 4e-4);
    free(out);
    /* a negative queue or a NaN prefill time is refused too (the router's cost adds them) */
    lw.load.disk_promote_s_per_block = 0;
    for (int bad = 0; bad < 2; bad++) {
        kvf_rpc_buf lb = {0};
        kvf_rpc_watch_msg bl = lw;
        if (bad)
            bl.load.prefill_ms_p90 = NAN;
        else
            bl.load.queued_prefill_tokens = -5;
        assert_int_equal(kvf_rpc_watch_msg_encode(&bl, &lb, &e), KVF_OK);
        kvf_rpc_watch_msg *lout = (void *)1;
        assert_int_equal(kvf_rpc_watch_msg_decode(lb.data, lb.len, &lout, &e), KVF_ERR_INVALID);
        assert_ptr_equal(lout, (void *)1);
        assert_msg_has(&e, bad ? "prefill_ms_p90 nan" : "queued_prefill_tokens -5");
        kvf_rpc_buf_free(&lb);
    }
    for (int bad = 0; bad < 2; bad++) {
        kvf_rpc_buf lb = {0};
        lw.load.disk_promote_s_per_block = bad ? NAN : -1;
        assert_int_equal(kvf_rpc_watch_msg_encode(&lw, &lb, &e), KVF_OK);
        kvf_rpc_watch_msg *lout = (void *)1;
        assert_int_equal(kvf_rpc_watch_msg_decode(lb.data, lb.len, &lout, &e), KVF_ERR_INVALID);
        assert_ptr_equal(lout, (void *)1);
        assert_msg_has(&e, "disk_promote_s_per_block");
        kvf_rpc_buf_free(&lb);
    }

    /* WatchKvRequest */
    kvf_rpc_buf b = {0};
    kvf_rpc_watch_req wr = {.router_id = "router-a", .load_interval_ms = 250};
    assert_int_equal(kvf_rpc_watch_req_encode(&wr, &b, &e), KVF_OK);
    kvf_rpc_watch_req *wrout = NULL;
    assert_int_equal(kvf_rpc_watch_req_decode(b.data, b.len, &wrout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_string_equal(wrout->router_id, "router-a");
    assert_int_equal(wrout->load_interval_ms, 250);
    free(wrout);
    wr.router_id = "router a";
    assert_int_equal(kvf_rpc_watch_req_encode(&wr, &b, &e), KVF_OK);
    wrout = (void *)1;
    assert_int_equal(kvf_rpc_watch_req_decode(b.data, b.len, &wrout, &e), KVF_ERR_INVALID);
    kvf_rpc_buf_free(&b);
    assert_ptr_equal(wrout, (void *)1);
    assert_msg_has(&e, "WatchKvRequest.router_id has byte 0x20 at 6");

    /* Cancel: a request id is required. */
    kvf_rpc_cancel_req c = {0};
    kvf_rpc_cancel_req *cout = (void *)1;
    assert_int_equal(kvf_rpc_cancel_req_encode(&c, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_cancel_req_decode(b.data, b.len, &cout, &e), KVF_ERR_INVALID);
    kvf_rpc_buf_free(&b);
    assert_ptr_equal(cout, (void *)1);
    assert_msg_has(&e, "CancelRequest.request_id is empty");
    c.request_id = "req-1";
    assert_int_equal(kvf_rpc_cancel_req_encode(&c, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_cancel_req_decode(b.data, b.len, &cout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_string_equal(cout->request_id, "req-1");
    free(cout);
    for (int found = 0; found < 2; found++) {
        kvf_rpc_cancel_resp cr = {.found = found};
        kvf_rpc_cancel_resp *crout = NULL;
        assert_int_equal(kvf_rpc_cancel_resp_encode(&cr, &b, &e), KVF_OK);
        assert_int_equal(kvf_rpc_cancel_resp_decode(b.data, b.len, &crout, &e), KVF_OK);
        kvf_rpc_buf_free(&b);
        assert_int_equal(crout->found, found);
        free(crout);
    }

    /* Info and Health requests: empty bytes are a valid empty message, and what the encoders
     * write decodes. */
    assert_int_equal(kvf_rpc_health_req_decode(NULL, 0, &e), KVF_OK);
    assert_int_equal(kvf_rpc_info_req_decode(NULL, 0, &e), KVF_OK);
    assert_int_equal(kvf_rpc_health_req_encode(&b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_health_req_decode(b.data, b.len, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_int_equal(kvf_rpc_info_req_encode(&b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_info_req_decode(b.data, b.len, &e), KVF_OK);
    kvf_rpc_buf_free(&b);

    /* HealthResponse */
    kvf_rpc_health h = {.status = KVF_RPC_DRAINING, .detail = "draining: 3 running"};
    kvf_rpc_health *hout = NULL;
    assert_int_equal(kvf_rpc_health_encode(&h, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_health_decode(b.data, b.len, &hout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_int_equal(hout->status, KVF_RPC_DRAINING);
    assert_string_equal(hout->detail, "draining: 3 running");
    free(hout);

    /* GenerateResponse, with and without usage */
    int32_t gt[2] = {100, 101};
    kvf_rpc_generate_resp gr = {.token_ids = gt, .n_token_ids = 2, .finish = KVF_RPC_FINISH_STOP,
                                .has_usage = true,
                                .usage = {.prompt_tokens = 20, .completion_tokens = 7,
                                          .cached_prompt_tokens = 16,
                                          .remote_prefill_tokens = 4},
                                .index = 2};
    kvf_rpc_generate_resp *grout = NULL;
    assert_int_equal(kvf_rpc_generate_resp_encode(&gr, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_generate_resp_decode(b.data, b.len, &grout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_int_equal(grout->n_token_ids, 2);
    assert_memory_equal(grout->token_ids, gt, sizeof gt);
    assert_int_equal(grout->finish, KVF_RPC_FINISH_STOP);
    assert_true(grout->has_usage);
    assert_int_equal(grout->usage.prompt_tokens, 20);
    assert_int_equal(grout->usage.completion_tokens, 7);
    assert_int_equal(grout->usage.cached_prompt_tokens, 16);
    assert_int_equal(grout->usage.remote_prefill_tokens, 4);
    assert_int_equal(grout->index, 2);
    free(grout);
    gr.has_usage = false;
    gr.finish = KVF_RPC_FINISH_NONE;
    gt[1] = -5;
    assert_int_equal(kvf_rpc_generate_resp_encode(&gr, &b, &e), KVF_OK);
    grout = (void *)1;
    assert_int_equal(kvf_rpc_generate_resp_decode(b.data, b.len, &grout, &e), KVF_ERR_INVALID);
    kvf_rpc_buf_free(&b);
    assert_ptr_equal(grout, (void *)1);
    assert_msg_has(&e, "GenerateResponse.token_ids[1] is -5");
    gt[1] = 101;
    assert_int_equal(kvf_rpc_generate_resp_encode(&gr, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_generate_resp_decode(b.data, b.len, &grout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_false(grout->has_usage);
    assert_int_equal(grout->finish, KVF_RPC_FINISH_NONE);
    free(grout);

    /* RemotePrefillResponse, with and without stats */
    kvf_rpc_remote_prefill_resp pr = {
        .first_token = 42, .has_stats = true,
        .stats = {.prompt_tokens = 33, .cached_tokens = 16, .computed_tokens = 17,
                  .blocks_sent = 2, .bytes_sent = 65536, .queue_ms = 0.5, .prefill_ms = 3.25,
                  .transfer_ms = 1.125}};
    kvf_rpc_remote_prefill_resp *prout = NULL;
    assert_int_equal(kvf_rpc_remote_prefill_resp_encode(&pr, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_remote_prefill_resp_decode(b.data, b.len, &prout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_int_equal(prout->first_token, 42);
    assert_true(prout->has_stats);
    assert_int_equal(prout->stats.prompt_tokens, 33);
    assert_int_equal(prout->stats.cached_tokens, 16);
    assert_int_equal(prout->stats.computed_tokens, 17);
    assert_int_equal(prout->stats.blocks_sent, 2);
    assert_int_equal(prout->stats.bytes_sent, 65536);
    assert_true(prout->stats.queue_ms == 0.5);
    assert_true(prout->stats.prefill_ms == 3.25);
    assert_true(prout->stats.transfer_ms == 1.125);
    free(prout);
    pr.has_stats = false;
    assert_int_equal(kvf_rpc_remote_prefill_resp_encode(&pr, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_remote_prefill_resp_decode(b.data, b.len, &prout, &e), KVF_OK);
    kvf_rpc_buf_free(&b);
    assert_int_equal(prout->first_token, 42);
    assert_false(prout->has_stats);
    free(prout);
}

/* ---- enum values outside the proto ------------------------------------------------------------ */

static void test_enum_out_of_range(void **state)
{
    (void)state;
    kvf_err e;
    kvf_rpc_buf b = {0};

    kvf_rpc_info in = info_fixture(NULL, 0);
    in.role = (kvf_rpc_role)7;
    kvf_rpc_info *iout;
    assert_int_equal(info_decode(&in, &iout, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "InfoResponse.role is 7 (allowed 0..3)");

    kvf_rpc_generate_resp gr = {.finish = (kvf_rpc_finish)9};
    kvf_rpc_generate_resp *grout = (void *)1;
    assert_int_equal(kvf_rpc_generate_resp_encode(&gr, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_generate_resp_decode(b.data, b.len, &grout, &e), KVF_ERR_INVALID);
    kvf_rpc_buf_free(&b);
    assert_ptr_equal(grout, (void *)1);
    assert_msg_has(&e, "GenerateResponse.finish_reason is 9 (allowed 0..4)");

    kvf_rpc_health h = {.status = (kvf_rpc_serving)5, .detail = "?"};
    kvf_rpc_health *hout = (void *)1;
    assert_int_equal(kvf_rpc_health_encode(&h, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_health_decode(b.data, b.len, &hout, &e), KVF_ERR_INVALID);
    kvf_rpc_buf_free(&b);
    assert_ptr_equal(hout, (void *)1);
    assert_msg_has(&e, "HealthResponse.status is 5 (allowed 0..3)");

    kvf_rpc_watch_msg w = {.event = {.seq = 3, .kind = (kvf_rpc_kv_event_kind)5}};
    kvf_rpc_watch_msg *wout = (void *)1;
    assert_int_equal(kvf_rpc_watch_msg_encode(&w, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_watch_msg_decode(b.data, b.len, &wout, &e), KVF_ERR_INVALID);
    kvf_rpc_buf_free(&b);
    assert_ptr_equal(wout, (void *)1);
    assert_msg_has(&e, "KvEvent 3: kind is 5 (allowed 0..4)");
}

/* ---- bytes that are not the message -------------------------------------------------------------- */

static void test_malformed_bytes(void **state)
{
    (void)state;
    kvf_err e;
    /* A length running past the end, a truncated varint, a bad wire type, field number 0. */
    static const uint8_t cases[][6] = {
        {0x0a, 0x7f, 'a', 'b', 0, 0}, {0x10, 0xff, 0xff, 0xff, 0, 0},
        {0x0f, 0x01, 0, 0, 0, 0},     {0x80, 0x00, 0x08, 0x01, 0, 0},
    };
    static const size_t lens[] = {4, 4, 2, 4};
    for (size_t i = 0; i < 4; i++) {
        kvf_rpc_generate_req *g = (void *)1;
        assert_int_equal(kvf_rpc_generate_req_decode(cases[i], lens[i], &g, &e), KVF_ERR_PARSE);
        assert_ptr_equal(g, (void *)1); /* untouched */
        assert_msg_has(&e, "not a valid GenerateRequest");
        assert_int_equal(kvf_rpc_info_req_decode(cases[i], lens[i], &e), KVF_ERR_PARSE);
        assert_msg_has(&e, "not a valid InfoRequest");
        kvf_rpc_watch_req *wk = (void *)1;
        assert_int_equal(kvf_rpc_watch_req_decode(cases[i], lens[i], &wk, &e), KVF_ERR_PARSE);
        assert_ptr_equal(wk, (void *)1);
        kvf_rpc_info *info = (void *)1;
        assert_int_equal(kvf_rpc_info_decode(cases[i], lens[i], &info, &e), KVF_ERR_PARSE);
        assert_ptr_equal(info, (void *)1);
        assert_msg_has(&e, "not a valid InfoResponse");
    }
}

/* A guide (issue 24) travels whole in Generate and RemotePrefill, its text in the decoded
 * message's own block (not NUL-terminated on the way in); a kind past the enum, text past the
 * bound, a kind that needs text without it, and a NUL in the text are refused by name. */
static void test_guide_field(void **state)
{
    (void)state;
    int32_t toks[3] = {1, 2, 3};
    kvf_rpc_generate_req g = {.request_id = "req-g", .token_ids = toks, .n_token_ids = 3};
    kvf_rpc_sampling *sp = &g.sampling;
    kvf_rpc_sampling_default(sp);
    const char schema[] = "{\"type\":\"object\"}TRAILING";
    sp->guide_kind = KVF_RPC_GUIDE_JSON_SCHEMA;
    sp->guide = schema;
    sp->guide_len = strlen("{\"type\":\"object\"}");
    kvf_rpc_generate_req *out = generate_roundtrip(&g, KVF_OK, NULL);
    assert_int_equal(out->sampling.guide_kind, KVF_RPC_GUIDE_JSON_SCHEMA);
    assert_int_equal(out->sampling.guide_len, sp->guide_len);
    assert_memory_equal(out->sampling.guide, "{\"type\":\"object\"}", sp->guide_len);
    assert_int_equal(out->sampling.guide[out->sampling.guide_len], '\0');
    free(out);
    sp->guide_kind = KVF_RPC_GUIDE_JSON_OBJECT; /* no text */
    sp->guide = NULL;
    sp->guide_len = 0;
    out = generate_roundtrip(&g, KVF_OK, NULL);
    assert_int_equal(out->sampling.guide_kind, KVF_RPC_GUIDE_JSON_OBJECT);
    assert_int_equal(out->sampling.guide_len, 0);
    free(out);

    uint8_t blob[1] = {1};
    int32_t blocks[1] = {4};
    kvf_rpc_remote_prefill_req r = {
        .request_id = "req-g", .token_ids = toks, .n_token_ids = 3, .dst_block_ids = blocks,
        .n_dst_block_ids = 1, .dst = {.backend = "local", .blob = blob, .blob_len = 1}};
    kvf_rpc_sampling_default(&r.sampling);
    r.sampling.guide_kind = KVF_RPC_GUIDE_REGEX;
    r.sampling.guide = "[a-z]+";
    r.sampling.guide_len = 6;
    kvf_err e;
    assert_int_equal(prefill_decode(&r, &e), KVF_OK); /* compares the sampling, guide too */

    /* the encoder refuses what it cannot send */
    kvf_rpc_buf b = {0};
    sp->guide_kind = 9;
    assert_int_equal(kvf_rpc_generate_req_encode(&g, &b, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "sampling.guide: kind 9");
    sp->guide_kind = KVF_RPC_GUIDE_REGEX;
    sp->guide = "a\0b";
    sp->guide_len = 3;
    assert_int_equal(kvf_rpc_generate_req_encode(&g, &b, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "no NUL");

    /* the decoder refuses what a peer may send: written by hand */
    pbw guide = {0}, samp = {0}, m = {0};
    pb_int(&guide, 1, 9);
    pb_msg(&samp, 18, &guide);
    pb_str(&m, 1, "req-g");
    pb_int(&m, 2, 1);
    pb_msg(&m, 3, &samp);
    kvf_rpc_generate_req *got = (void *)1;
    assert_int_equal(kvf_rpc_generate_req_decode(m.b, m.n, &got, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "sampling.guide.kind is 9");
    guide = samp = m = (pbw){0};
    pb_int(&guide, 1, KVF_RPC_GUIDE_REGEX); /* a regex without its text */
    pb_msg(&samp, 18, &guide);
    pb_str(&m, 1, "req-g");
    pb_int(&m, 2, 1);
    pb_msg(&m, 3, &samp);
    assert_int_equal(kvf_rpc_generate_req_decode(m.b, m.n, &got, &e), KVF_ERR_INVALID);
    assert_msg_has(&e, "has no text");
    assert_ptr_equal(got, (void *)1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_info_roundtrip),
        cmocka_unit_test(test_generate_checks),
        cmocka_unit_test(test_logprob_fields),
        cmocka_unit_test(test_remote_prefill_checks),
        cmocka_unit_test(test_layout_each_dtype),
        cmocka_unit_test(test_sampling_off_values),
        cmocka_unit_test(test_watch_and_small_messages),
        cmocka_unit_test(test_enum_out_of_range),
        cmocka_unit_test(test_malformed_bytes),
        cmocka_unit_test(test_guide_field),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
