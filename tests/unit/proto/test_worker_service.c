/* test_worker_service.c: the Worker service end to end over the RPC layer: the method-name
 * constants match the generated service descriptor, and a stand-in worker answers all six
 * methods (Info, Generate, RemotePrefill, WatchKv, Cancel, Health) with messages the client's
 * checked decoders accept, as the roles will. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/log.h"
#include "proto/rpc.h"
#include "proto/worker.h"

static void test_method_names_match_the_proto(void **state)
{
    const ProtobufCServiceDescriptor *d = &kvfleet__v1__worker__descriptor;
    assert_string_equal(d->name, "kvfleet.v1.Worker");
    const char *ours[] = {KVF_RPC_WORKER_INFO, KVF_RPC_WORKER_GENERATE,
                          KVF_RPC_WORKER_REMOTE_PREFILL, KVF_RPC_WORKER_WATCH_KV,
                          KVF_RPC_WORKER_CANCEL, KVF_RPC_WORKER_HEALTH};
    assert_int_equal(d->n_methods, 6);
    for (unsigned i = 0; i < d->n_methods; i++) {
        char full[128];
        snprintf(full, sizeof full, "/%s/%s", d->name, d->methods[i].name);
        bool found = false;
        for (size_t k = 0; k < 6; k++)
            found |= strcmp(full, ours[k]) == 0;
        if (!found)
            fail_msg("%s has no constant in proto/worker.h", full);
    }
}

/* ---- a stand-in worker ---- */

static kvf_status reply(const void *msg, kvf_rpc_buf *out, kvf_err *err)
{
    return kvf_rpc_msg_encode(msg, out, err);
}

static kvf_status w_info(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                         kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__InfoRequest *r;
    kvf_status st = kvf_rpc_info_request_decode(req, len, &r, err);
    if (st != KVF_OK)
        return st;
    kvf_rpc_msg_free(r);
    Kvfleet__V1__KvLayout l = KVFLEET__V1__KV_LAYOUT__INIT;
    l.n_layers = 4;
    l.n_kv_heads = 2;
    l.head_dim = 32;
    l.block_size = 16;
    l.dtype = kvf_rpc_dtype_to_msg(KVF_DTYPE_BF16);
    l.block_bytes = 2LL * 4 * 2 * 16 * 32 * 2;
    Kvfleet__V1__TransportDescriptor td = KVFLEET__V1__TRANSPORT_DESCRIPTOR__INIT;
    td.backend = "local";
    Kvfleet__V1__InfoResponse in = KVFLEET__V1__INFO_RESPONSE__INIT;
    in.protocol_version = KVF_RPC_PROTOCOL_VERSION;
    in.role = KVFLEET__V1__ROLE__ROLE_PREFILL;
    in.model_id = "tiny";
    in.block_size = 16;
    in.kv_layout = &l;
    in.capacity_blocks = 128;
    in.transport = &td;
    in.worker_id = "prefill-0";
    return reply(&in, out, err);
}

static void w_generate(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    Kvfleet__V1__GenerateRequest *g;
    kvf_err e;
    kvf_status st = kvf_rpc_generate_request_decode(req, len, &g, &e);
    if (st != KVF_OK) {
        kvf_rpc_call_finish(call, st, e.msg);
        return;
    }
    int max = g->sampling && g->sampling->max_tokens ? g->sampling->max_tokens : 4;
    for (int i = 0; i < max && st == KVF_OK; i++) {
        Kvfleet__V1__GenerateResponse r = KVFLEET__V1__GENERATE_RESPONSE__INIT;
        Kvfleet__V1__Usage u = KVFLEET__V1__USAGE__INIT;
        int32_t tok = 100 + i;
        r.token_ids = &tok;
        r.n_token_ids = 1;
        if (i == max - 1) {
            r.finish_reason = KVFLEET__V1__FINISH_REASON__FINISH_LENGTH;
            u.prompt_tokens = (int32_t)g->n_token_ids;
            u.completion_tokens = max;
            u.cached_prompt_tokens = 16;
            r.usage = &u;
        }
        kvf_rpc_buf b = {0};
        if ((st = kvf_rpc_msg_encode(&r, &b, &e)) == KVF_OK)
            st = kvf_rpc_call_send(call, b.data, b.len, &e);
        kvf_rpc_buf_free(&b);
    }
    kvf_rpc_msg_free(g);
    kvf_rpc_call_finish(call, st, st == KVF_OK ? NULL : e.msg);
}

static kvf_status w_prefill(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                            kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__RemotePrefillRequest *r;
    kvf_status st = kvf_rpc_remote_prefill_request_decode(req, len, &r, err);
    if (st != KVF_OK)
        return st;
    Kvfleet__V1__PrefillStats ps = KVFLEET__V1__PREFILL_STATS__INIT;
    ps.prompt_tokens = (int32_t)r->n_token_ids;
    ps.blocks_sent = (int32_t)(r->n_dst_block_ids - (size_t)r->dst_cached_blocks);
    Kvfleet__V1__RemotePrefillResponse resp = KVFLEET__V1__REMOTE_PREFILL_RESPONSE__INIT;
    resp.first_token = r->token_ids[r->n_token_ids - 1] + 1;
    resp.stats = &ps;
    kvf_rpc_msg_free(r);
    return reply(&resp, out, err);
}

static void w_watch(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    Kvfleet__V1__WatchKvRequest *w;
    kvf_err e;
    kvf_status st = kvf_rpc_watch_kv_request_decode(req, len, &w, &e);
    if (st != KVF_OK) {
        kvf_rpc_call_finish(call, st, e.msg);
        return;
    }
    kvf_rpc_msg_free(w);
    uint64_t h[2] = {0xaaaa, 0xbbbb}, p[2] = {0x1234, 0xaaaa};
    Kvfleet__V1__KvEvent snap = KVFLEET__V1__KV_EVENT__INIT;
    snap.seq = 1;
    snap.kind = KVFLEET__V1__KV_EVENT__KIND__KIND_SNAPSHOT;
    snap.block_hashes = h;
    snap.n_block_hashes = 2;
    snap.parent_hashes = p;
    snap.n_parent_hashes = 2;
    snap.block_size = 16;
    snap.model_id = "tiny";
    snap.snapshot_done = true;
    Kvfleet__V1__KvEvent rem = KVFLEET__V1__KV_EVENT__INIT;
    rem.seq = 2;
    rem.kind = KVFLEET__V1__KV_EVENT__KIND__KIND_REMOVED;
    rem.block_hashes = h + 1;
    rem.n_block_hashes = 1;
    Kvfleet__V1__LoadReport lr = KVFLEET__V1__LOAD_REPORT__INIT;
    lr.running = 2;
    lr.free_blocks = 100;
    lr.total_blocks = 128;
    Kvfleet__V1__WatchKvResponse msgs[3] = {KVFLEET__V1__WATCH_KV_RESPONSE__INIT,
                                           KVFLEET__V1__WATCH_KV_RESPONSE__INIT,
                                           KVFLEET__V1__WATCH_KV_RESPONSE__INIT};
    msgs[0].body_case = KVFLEET__V1__WATCH_KV_RESPONSE__BODY_EVENT;
    msgs[0].event = &snap;
    msgs[1].body_case = KVFLEET__V1__WATCH_KV_RESPONSE__BODY_EVENT;
    msgs[1].event = &rem;
    msgs[2].body_case = KVFLEET__V1__WATCH_KV_RESPONSE__BODY_LOAD;
    msgs[2].load = &lr;
    for (int i = 0; i < 3 && st == KVF_OK; i++) {
        kvf_rpc_buf b = {0};
        if ((st = kvf_rpc_msg_encode(&msgs[i], &b, &e)) == KVF_OK)
            st = kvf_rpc_call_write(call, b.data, b.len, &e);
        kvf_rpc_buf_free(&b);
    }
    kvf_rpc_call_finish(call, st, st == KVF_OK ? NULL : e.msg);
}

static kvf_status w_cancel(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                           kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__CancelRequest *r;
    kvf_status st = kvf_rpc_cancel_request_decode(req, len, &r, err);
    if (st != KVF_OK)
        return st;
    Kvfleet__V1__CancelResponse c = KVFLEET__V1__CANCEL_RESPONSE__INIT;
    c.found = strcmp(r->request_id, "req-1") == 0;
    kvf_rpc_msg_free(r);
    return reply(&c, out, err);
}

static kvf_status w_health(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                           kvf_rpc_buf *out, kvf_err *err)
{
    Kvfleet__V1__HealthRequest *r;
    kvf_status st = kvf_rpc_health_request_decode(req, len, &r, err);
    if (st != KVF_OK)
        return st;
    kvf_rpc_msg_free(r);
    Kvfleet__V1__HealthResponse h = KVFLEET__V1__HEALTH_RESPONSE__INIT;
    h.status = KVFLEET__V1__HEALTH_RESPONSE__SERVING_STATUS__SERVING;
    return reply(&h, out, err);
}

/* Reads every message of a stream into bufs; returns the count. */
static size_t read_all(kvf_rpc_stream *s, kvf_rpc_buf *bufs, size_t cap)
{
    size_t n = 0;
    kvf_err e;
    bool done = false;
    kvf_rpc_buf m = {0};
    kvf_status st;
    while ((st = kvf_rpc_stream_read(s, 10000, &m, &done, &e)) == KVF_OK && !done) {
        assert_true(n < cap);
        bufs[n++] = m;
    }
    assert_int_equal(st, KVF_OK);
    return n;
}

static void test_all_six_methods(void **state)
{
    kvf_log_set_level(KVF_LOG_WARN);
    kvf_err e;
    kvf_rpc_server *srv;
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .n_threads = 2};
    assert_int_equal(kvf_rpc_server_create(&o, &srv, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(srv, KVF_RPC_WORKER_INFO, w_info, NULL, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_stream(srv, KVF_RPC_WORKER_GENERATE, w_generate, NULL,
                                               &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(srv, KVF_RPC_WORKER_REMOTE_PREFILL, w_prefill, NULL,
                                              &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_stream(srv, KVF_RPC_WORKER_WATCH_KV, w_watch, NULL, &e),
                     KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(srv, KVF_RPC_WORKER_CANCEL, w_cancel, NULL, &e),
                     KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(srv, KVF_RPC_WORKER_HEALTH, w_health, NULL, &e),
                     KVF_OK);
    assert_int_equal(kvf_rpc_server_start(srv, &e), KVF_OK);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", kvf_rpc_server_port(srv));
    kvf_rpc_channel *ch;
    assert_int_equal(kvf_rpc_channel_create(target, NULL, &ch, &e), KVF_OK);
    kvf_rpc_buf req = {0}, resp = {0};

    /* Info */
    Kvfleet__V1__InfoRequest ir = KVFLEET__V1__INFO_REQUEST__INIT;
    assert_int_equal(kvf_rpc_msg_encode(&ir, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_INFO, req.data, req.len, 5000, &resp, &e),
                     KVF_OK);
    Kvfleet__V1__InfoResponse *info;
    assert_int_equal(kvf_rpc_info_response_decode(resp.data, resp.len, &info, &e), KVF_OK);
    assert_int_equal(info->role, KVFLEET__V1__ROLE__ROLE_PREFILL);
    assert_int_equal(info->kv_layout->n_layers, 4);
    assert_string_equal(info->transport->backend, "local");
    kvf_rpc_msg_free(info);
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);

    /* Generate: 5 tokens, the last with usage */
    int32_t prompt[20];
    for (int i = 0; i < 20; i++)
        prompt[i] = i;
    Kvfleet__V1__SamplingParams sp = KVFLEET__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = 5;
    Kvfleet__V1__GenerateRequest g = KVFLEET__V1__GENERATE_REQUEST__INIT;
    g.request_id = "req-1";
    g.token_ids = prompt;
    g.n_token_ids = 20;
    g.sampling = &sp;
    assert_int_equal(kvf_rpc_msg_encode(&g, &req, &e), KVF_OK);
    kvf_rpc_stream *s;
    assert_int_equal(kvf_rpc_stream_open(ch, KVF_RPC_WORKER_GENERATE, req.data, req.len, 5000, &s,
                                         &e), KVF_OK);
    kvf_rpc_buf msgs[8];
    size_t n = read_all(s, msgs, 8);
    assert_int_equal(n, 5);
    for (size_t i = 0; i < n; i++) {
        Kvfleet__V1__GenerateResponse *r;
        assert_int_equal(kvf_rpc_generate_response_decode(msgs[i].data, msgs[i].len, &r, &e),
                         KVF_OK);
        assert_int_equal(r->token_ids[0], 100 + (int)i);
        if (i == n - 1) {
            assert_int_equal(r->finish_reason, KVFLEET__V1__FINISH_REASON__FINISH_LENGTH);
            assert_int_equal(r->usage->prompt_tokens, 20);
            assert_int_equal(r->usage->cached_prompt_tokens, 16);
        } else {
            assert_int_equal(r->finish_reason, KVFLEET__V1__FINISH_REASON__FINISH_NONE);
        }
        kvf_rpc_msg_free(r);
        kvf_rpc_buf_free(&msgs[i]);
    }
    kvf_rpc_stream_destroy(s);
    kvf_rpc_buf_free(&req);

    /* RemotePrefill */
    int32_t blocks[2] = {3, 4};
    Kvfleet__V1__TransportDescriptor td = KVFLEET__V1__TRANSPORT_DESCRIPTOR__INIT;
    td.backend = "local";
    Kvfleet__V1__RemotePrefillRequest rp = KVFLEET__V1__REMOTE_PREFILL_REQUEST__INIT;
    rp.request_id = "req-1";
    rp.token_ids = prompt;
    rp.n_token_ids = 20;
    rp.dst_block_ids = blocks;
    rp.n_dst_block_ids = 2;
    rp.dst_cached_blocks = 1;
    rp.dst = &td;
    rp.transfer_id = 5;
    assert_int_equal(kvf_rpc_msg_encode(&rp, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_REMOTE_PREFILL, req.data, req.len, 5000,
                                   &resp, &e), KVF_OK);
    Kvfleet__V1__RemotePrefillResponse *pr;
    assert_int_equal(kvf_rpc_remote_prefill_response_decode(resp.data, resp.len, &pr, &e), KVF_OK);
    assert_int_equal(pr->first_token, 20);
    assert_int_equal(pr->stats->blocks_sent, 1);
    kvf_rpc_msg_free(pr);
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);
    /* ... and a bad one is refused by the worker, naming the field. */
    rp.dst_cached_blocks = 3;
    assert_int_equal(kvf_rpc_msg_encode(&rp, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_REMOTE_PREFILL, req.data, req.len, 5000,
                                   &resp, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "dst_cached_blocks is 3"));
    kvf_rpc_buf_free(&req);

    /* WatchKv: snapshot, removal, load */
    Kvfleet__V1__WatchKvRequest wr = KVFLEET__V1__WATCH_KV_REQUEST__INIT;
    wr.router_id = "router-a";
    assert_int_equal(kvf_rpc_msg_encode(&wr, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_stream_open(ch, KVF_RPC_WORKER_WATCH_KV, req.data, req.len, 5000, &s,
                                         &e), KVF_OK);
    n = read_all(s, msgs, 8);
    assert_int_equal(n, 3);
    Kvfleet__V1__WatchKvResponse *w[3];
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(kvf_rpc_watch_kv_response_decode(msgs[i].data, msgs[i].len, &w[i], &e),
                         KVF_OK);
        kvf_rpc_buf_free(&msgs[i]);
    }
    assert_int_equal(w[0]->event->kind, KVFLEET__V1__KV_EVENT__KIND__KIND_SNAPSHOT);
    assert_true(w[0]->event->snapshot_done);
    assert_int_equal(w[0]->event->parent_hashes[1], 0xaaaa);
    assert_int_equal(w[1]->event->seq, 2);
    assert_int_equal(w[1]->event->block_hashes[0], 0xbbbb);
    assert_int_equal(w[2]->body_case, KVFLEET__V1__WATCH_KV_RESPONSE__BODY_LOAD);
    assert_int_equal(w[2]->load->free_blocks, 100);
    for (size_t i = 0; i < 3; i++)
        kvf_rpc_msg_free(w[i]);
    kvf_rpc_stream_destroy(s);
    kvf_rpc_buf_free(&req);

    /* Cancel and Health */
    Kvfleet__V1__CancelRequest cr = KVFLEET__V1__CANCEL_REQUEST__INIT;
    cr.request_id = "req-1";
    assert_int_equal(kvf_rpc_msg_encode(&cr, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_CANCEL, req.data, req.len, 5000, &resp, &e),
                     KVF_OK);
    Kvfleet__V1__CancelResponse *cresp;
    assert_int_equal(kvf_rpc_cancel_response_decode(resp.data, resp.len, &cresp, &e), KVF_OK);
    assert_true(cresp->found);
    kvf_rpc_msg_free(cresp);
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_HEALTH, NULL, 0, 5000, &resp, &e), KVF_OK);
    Kvfleet__V1__HealthResponse *h;
    assert_int_equal(kvf_rpc_health_response_decode(resp.data, resp.len, &h, &e), KVF_OK);
    assert_int_equal(h->status, KVFLEET__V1__HEALTH_RESPONSE__SERVING_STATUS__SERVING);
    kvf_rpc_msg_free(h);
    kvf_rpc_buf_free(&resp);

    kvf_rpc_channel_destroy(ch);
    kvf_rpc_server_destroy(srv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_method_names_match_the_proto),
        cmocka_unit_test(test_all_six_methods),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
