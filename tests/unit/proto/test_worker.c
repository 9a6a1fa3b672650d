/* test_worker.c: the Worker service's messages: every message survives encode/decode; the
 * checked decoders refuse malformed bytes and bad fields with messages naming the field and the
 * value; Info's protocol version and layout checks; the dtype mapping. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "proto/worker.h"

static Kvfleet__V1__KvLayout layout(void)
{
    Kvfleet__V1__KvLayout l = KVFLEET__V1__KV_LAYOUT__INIT;
    l.n_layers = 2;
    l.n_kv_heads = 2;
    l.head_dim = 64;
    l.block_size = 16;
    l.dtype = kvf_rpc_dtype_to_msg(KVF_DTYPE_F16);
    l.block_bytes = 2LL * 2 * 2 * 16 * 64 * 2;
    return l;
}

static void test_info_roundtrip(void **state)
{
    Kvfleet__V1__KvLayout l = layout();
    Kvfleet__V1__TransportDescriptor td = KVFLEET__V1__TRANSPORT_DESCRIPTOR__INIT;
    uint8_t blob[3] = {1, 0, 255};
    td.backend = "ucx";
    td.blob.data = blob;
    td.blob.len = 3;
    Kvfleet__V1__InfoResponse in = KVFLEET__V1__INFO_RESPONSE__INIT;
    in.protocol_version = KVF_RPC_PROTOCOL_VERSION;
    in.role = KVFLEET__V1__ROLE__ROLE_DECODE;
    in.model_id = "tiny-llama";
    in.block_size = 16;
    in.kv_layout = &l;
    in.capacity_blocks = 4096;
    in.transport = &td;
    in.worker_id = "decode-0";
    kvf_rpc_buf b = {0};
    kvf_err e;
    assert_int_equal(kvf_rpc_msg_encode(&in, &b, &e), KVF_OK);
    Kvfleet__V1__InfoResponse *out;
    assert_int_equal(kvf_rpc_info_response_decode(b.data, b.len, &out, &e), KVF_OK);
    assert_int_equal(out->role, KVFLEET__V1__ROLE__ROLE_DECODE);
    assert_string_equal(out->model_id, "tiny-llama");
    assert_int_equal(out->capacity_blocks, 4096);
    assert_int_equal(out->kv_layout->head_dim, 64);
    assert_int_equal(out->kv_layout->block_bytes, l.block_bytes);
    kvf_dtype t;
    assert_int_equal(kvf_rpc_dtype_from_msg(out->kv_layout->dtype, &t, &e), KVF_OK);
    assert_int_equal(t, KVF_DTYPE_F16);
    assert_string_equal(out->transport->backend, "ucx");
    assert_int_equal(out->transport->blob.len, 3);
    assert_memory_equal(out->transport->blob.data, blob, 3);
    kvf_rpc_msg_free(out);
    kvf_rpc_buf_free(&b);

    /* Another protocol version is refused, naming both. */
    in.protocol_version = KVF_RPC_PROTOCOL_VERSION + 1;
    assert_int_equal(kvf_rpc_msg_encode(&in, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_info_response_decode(b.data, b.len, &out, &e), KVF_ERR_UNSUPPORTED);
    assert_non_null(
        strstr(e.msg, "worker decode-0 speaks protocol version 2; this build speaks 1"));
    kvf_rpc_buf_free(&b);
    /* A layout whose block size disagrees with the worker's. */
    in.protocol_version = KVF_RPC_PROTOCOL_VERSION;
    l.block_size = 32;
    assert_int_equal(kvf_rpc_msg_encode(&in, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_info_response_decode(b.data, b.len, &out, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "kv_layout.block_size 32 differs from block_size 16"));
    kvf_rpc_buf_free(&b);
    /* An unknown dtype. */
    l.block_size = 16;
    l.dtype = KVFLEET__V1__DTYPE__DTYPE_UNSPECIFIED;
    assert_int_equal(kvf_rpc_msg_encode(&in, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_info_response_decode(b.data, b.len, &out, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "kv_layout: dtype 0 is not one of"));
    kvf_rpc_buf_free(&b);
}

static Kvfleet__V1__GenerateRequest *generate_roundtrip(const Kvfleet__V1__GenerateRequest *g,
                                                       kvf_status want, const char *msg_part)
{
    kvf_rpc_buf b = {0};
    kvf_err e;
    assert_int_equal(kvf_rpc_msg_encode(g, &b, &e), KVF_OK);
    Kvfleet__V1__GenerateRequest *out = NULL;
    kvf_status st = kvf_rpc_generate_request_decode(b.data, b.len, &out, &e);
    kvf_rpc_buf_free(&b);
    assert_int_equal(st, want);
    if (st != KVF_OK) {
        assert_null(out);
        if (!strstr(e.msg, msg_part))
            fail_msg("message \"%s\" lacks \"%s\"", e.msg, msg_part);
    }
    return out;
}

static void test_generate_checks(void **state)
{
    int32_t toks[4] = {1, 2, 3, 4};
    int32_t stops[2] = {2, 7};
    Kvfleet__V1__SamplingParams sp = KVFLEET__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = 32;
    sp.temperature = 0.7f;
    sp.top_p = 0.9f;
    sp.top_k = 40;
    sp.seed = 1234;
    sp.stop_token_ids = stops;
    sp.n_stop_token_ids = 2;
    Kvfleet__V1__PrefillHint hint = KVFLEET__V1__PREFILL_HINT__INIT;
    hint.address = "10.0.0.7:7001";
    Kvfleet__V1__GenerateRequest g = KVFLEET__V1__GENERATE_REQUEST__INIT;
    g.request_id = "req-42";
    g.token_ids = toks;
    g.n_token_ids = 4;
    g.sampling = &sp;
    g.cache_salt = "tenant-a";
    g.prefill = &hint;
    g.deadline_unix_ms = 1700000000000;

    Kvfleet__V1__GenerateRequest *out = generate_roundtrip(&g, KVF_OK, NULL);
    assert_int_equal(out->n_token_ids, 4);
    assert_int_equal(out->token_ids[3], 4);
    assert_int_equal(out->sampling->top_k, 40);
    assert_int_equal(out->sampling->seed, 1234);
    assert_int_equal(out->sampling->n_stop_token_ids, 2);
    assert_string_equal(out->prefill->address, "10.0.0.7:7001");
    assert_string_equal(out->cache_salt, "tenant-a");
    kvf_rpc_msg_free(out);

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
    sp.top_p = 1.5f;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.top_p is 1.5 (allowed 0..1)");
    sp.top_p = 0.9f;
    sp.temperature = -1;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.temperature is -1");
    sp.temperature = 0;
    stops[1] = -2;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.stop_token_ids[1] is -2");
    stops[1] = 7;
    sp.n = KVF_RPC_MAX_N + 1;
    generate_roundtrip(&g, KVF_ERR_INVALID, "sampling.n is 65");
    sp.n = 0;
    out = generate_roundtrip(&g, KVF_OK, NULL);
    kvf_rpc_msg_free(out);
}

static kvf_status prefill_decode(const Kvfleet__V1__RemotePrefillRequest *r, kvf_err *e)
{
    kvf_rpc_buf b = {0};
    assert_int_equal(kvf_rpc_msg_encode(r, &b, e), KVF_OK);
    Kvfleet__V1__RemotePrefillRequest *out = NULL;
    kvf_status st = kvf_rpc_remote_prefill_request_decode(b.data, b.len, &out, e);
    kvf_rpc_buf_free(&b);
    if (st == KVF_OK) {
        assert_int_equal(out->n_dst_block_ids, r->n_dst_block_ids);
        assert_int_equal(out->transfer_id, r->transfer_id);
        assert_int_equal(out->dst->blob.len, r->dst->blob.len);
    }
    kvf_rpc_msg_free(out);
    return st;
}

static void test_remote_prefill_checks(void **state)
{
    int32_t toks[33];
    for (int i = 0; i < 33; i++)
        toks[i] = i + 1;
    int32_t blocks[3] = {10, 11, 12};
    Kvfleet__V1__KvLayout l = layout();
    Kvfleet__V1__TransportDescriptor td = KVFLEET__V1__TRANSPORT_DESCRIPTOR__INIT;
    uint8_t blob[2] = {9, 9};
    td.backend = "local";
    td.blob.data = blob;
    td.blob.len = 2;
    Kvfleet__V1__RemotePrefillRequest r = KVFLEET__V1__REMOTE_PREFILL_REQUEST__INIT;
    r.request_id = "req-7";
    r.token_ids = toks;
    r.n_token_ids = 33; /* 3 blocks of 16 */
    r.dst_block_ids = blocks;
    r.n_dst_block_ids = 3;
    r.dst_cached_blocks = 1;
    r.dst = &td;
    r.transfer_id = 77;
    r.dst_layout = &l;
    kvf_err e;
    assert_int_equal(prefill_decode(&r, &e), KVF_OK);

    r.dst_cached_blocks = 4;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "dst_cached_blocks is 4 (allowed 0..3"));
    r.dst_cached_blocks = 0;
    r.n_dst_block_ids = 2;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "2 dst_block_ids for 33 tokens at block_size 16 (need 3)"));
    r.n_dst_block_ids = 3;
    blocks[2] = -1;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "dst_block_ids[2] is -1"));
    blocks[2] = 12;
    r.dst = NULL;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "dst (the destination's transport descriptor) is missing"));
    r.dst = &td;
    l.n_layers = 0;
    assert_int_equal(prefill_decode(&r, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "dst_layout has a non-positive shape (layers 0"));
}

static void test_watch_and_small_messages(void **state)
{
    uint64_t hashes[2] = {0x1111, 0x2222}, parents[2] = {0, 0x1111};
    Kvfleet__V1__KvEvent ev = KVFLEET__V1__KV_EVENT__INIT;
    ev.seq = 9;
    ev.kind = KVFLEET__V1__KV_EVENT__KIND__KIND_STORED;
    ev.block_hashes = hashes;
    ev.n_block_hashes = 2;
    ev.parent_hashes = parents;
    ev.n_parent_hashes = 2;
    ev.block_size = 16;
    ev.model_id = "tiny";
    Kvfleet__V1__WatchKvResponse w = KVFLEET__V1__WATCH_KV_RESPONSE__INIT;
    w.body_case = KVFLEET__V1__WATCH_KV_RESPONSE__BODY_EVENT;
    w.event = &ev;
    kvf_rpc_buf b = {0};
    kvf_err e;
    assert_int_equal(kvf_rpc_msg_encode(&w, &b, &e), KVF_OK);
    Kvfleet__V1__WatchKvResponse *out;
    assert_int_equal(kvf_rpc_watch_kv_response_decode(b.data, b.len, &out, &e), KVF_OK);
    assert_int_equal(out->body_case, KVFLEET__V1__WATCH_KV_RESPONSE__BODY_EVENT);
    assert_int_equal(out->event->seq, 9);
    assert_int_equal(out->event->block_hashes[1], 0x2222);
    assert_int_equal(out->event->parent_hashes[1], 0x1111);
    kvf_rpc_msg_free(out);
    kvf_rpc_buf_free(&b);
    ev.n_parent_hashes = 1;
    assert_int_equal(kvf_rpc_msg_encode(&w, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_watch_kv_response_decode(b.data, b.len, &out, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "1 parent_hashes for 2 block_hashes"));
    kvf_rpc_buf_free(&b);

    Kvfleet__V1__LoadReport lr = KVFLEET__V1__LOAD_REPORT__INIT;
    lr.running = 3;
    lr.free_blocks = 900;
    lr.prefill_ms_p90 = 12.5;
    w.body_case = KVFLEET__V1__WATCH_KV_RESPONSE__BODY_LOAD;
    w.load = &lr;
    assert_int_equal(kvf_rpc_msg_encode(&w, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_watch_kv_response_decode(b.data, b.len, &out, &e), KVF_OK);
    assert_int_equal(out->body_case, KVFLEET__V1__WATCH_KV_RESPONSE__BODY_LOAD);
    assert_int_equal(out->load->free_blocks, 900);
    assert_true(out->load->prefill_ms_p90 == 12.5);
    kvf_rpc_msg_free(out);
    kvf_rpc_buf_free(&b);

    Kvfleet__V1__CancelRequest c = KVFLEET__V1__CANCEL_REQUEST__INIT;
    Kvfleet__V1__CancelRequest *cout;
    assert_int_equal(kvf_rpc_msg_encode(&c, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_cancel_request_decode(b.data, b.len, &cout, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "CancelRequest.request_id is empty"));
    kvf_rpc_buf_free(&b);

    /* Empty bytes are a valid empty message. */
    Kvfleet__V1__HealthRequest *h;
    assert_int_equal(kvf_rpc_health_request_decode(NULL, 0, &h, &e), KVF_OK);
    kvf_rpc_msg_free(h);
}

static void test_malformed_bytes(void **state)
{
    kvf_err e;
    /* A length running past the end, a truncated varint, a bad wire type, field number 0. */
    static const uint8_t cases[][6] = {
        {0x0a, 0x7f, 'a', 'b', 0, 0}, {0x10, 0xff, 0xff, 0xff, 0, 0},
        {0x0f, 0x01, 0, 0, 0, 0},     {0x80, 0x00, 0x08, 0x01, 0, 0},
    };
    static const size_t lens[] = {4, 4, 2, 4};
    for (size_t i = 0; i < 4; i++) {
        Kvfleet__V1__GenerateRequest *g = (void *)1;
        assert_int_equal(kvf_rpc_generate_request_decode(cases[i], lens[i], &g, &e),
                         KVF_ERR_PARSE);
        assert_ptr_equal(g, (void *)1); /* untouched */
        assert_non_null(strstr(e.msg, "not a valid GenerateRequest"));
        Kvfleet__V1__InfoRequest *in;
        assert_int_equal(kvf_rpc_info_request_decode(cases[i], lens[i], &in, &e), KVF_ERR_PARSE);
        Kvfleet__V1__WatchKvRequest *wk;
        assert_int_equal(kvf_rpc_watch_kv_request_decode(cases[i], lens[i], &wk, &e),
                         KVF_ERR_PARSE);
    }
}

static void test_dtype_mapping(void **state)
{
    kvf_err e;
    for (int t = 0; t < KVF_DTYPE_COUNT; t++) {
        Kvfleet__V1__DType d = kvf_rpc_dtype_to_msg((kvf_dtype)t);
        assert_int_not_equal(d, KVFLEET__V1__DTYPE__DTYPE_UNSPECIFIED);
        kvf_dtype back;
        assert_int_equal(kvf_rpc_dtype_from_msg(d, &back, &e), KVF_OK);
        assert_int_equal(back, t);
    }
    kvf_dtype back;
    assert_int_equal(kvf_rpc_dtype_from_msg((Kvfleet__V1__DType)9, &back, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "dtype 9"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_info_roundtrip),
        cmocka_unit_test(test_generate_checks),
        cmocka_unit_test(test_remote_prefill_checks),
        cmocka_unit_test(test_watch_and_small_messages),
        cmocka_unit_test(test_malformed_bytes),
        cmocka_unit_test(test_dtype_mapping),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
