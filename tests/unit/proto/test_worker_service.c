/* test_worker_service.c: the Worker service end to end over the RPC layer: the method-name
 * constants match the service in proto/kvfleet.proto, and a stand-in worker serves all six
 * methods (Info, Generate, RemotePrefill, WatchKv, Cancel, Health) through the typed handlers of
 * proto/worker.h, answering with messages the client's checked decoders accept, as the roles
 * do. A request that fails its checks ends the call with the decoder's error before any handler
 * runs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
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

#ifndef KVF_PROTO_FILE
#error "KVF_PROTO_FILE (the path of proto/kvfleet.proto) is set by tests/unit/proto/CMakeLists.txt"
#endif

/* Every `rpc Name(` of `service Worker { ... }` in kvfleet.proto, as "/<package>.Worker/Name",
 * must have its constant in proto/worker.h, and the service must have six methods. */
static void test_method_names_match_the_proto(void **state)
{
    (void)state;
    FILE *f = fopen(KVF_PROTO_FILE, "r");
    if (!f)
        fail_msg("cannot open %s", KVF_PROTO_FILE);
    const char *ours[] = {KVF_RPC_WORKER_INFO, KVF_RPC_WORKER_GENERATE,
                          KVF_RPC_WORKER_REMOTE_PREFILL, KVF_RPC_WORKER_WATCH_KV,
                          KVF_RPC_WORKER_CANCEL, KVF_RPC_WORKER_HEALTH};
    bool seen[6] = {false};
    char line[512], package[128] = "";
    bool in_service = false;
    int n_methods = 0;
    while (fgets(line, sizeof line, f)) {
        char *c = strstr(line, "//");
        if (c)
            *c = '\0';
        char name[128];
        if (sscanf(line, " package %127[^; ]", package) == 1)
            continue;
        if (strstr(line, "service Worker")) {
            in_service = true;
            continue;
        }
        if (!in_service)
            continue;
        if (strchr(line, '}'))
            break;
        if (sscanf(line, " rpc %127[A-Za-z0-9_](", name) != 1)
            continue;
        char full[300];
        snprintf(full, sizeof full, "/%s.Worker/%s", package, name);
        bool found = false;
        for (size_t k = 0; k < 6; k++)
            if (strcmp(full, ours[k]) == 0)
                found = seen[k] = true;
        if (!found)
            fail_msg("%s has no constant in proto/worker.h", full);
        n_methods++;
    }
    fclose(f);
    assert_string_equal(package, "kvfleet.v1");
    assert_true(in_service);
    assert_int_equal(n_methods, 6);
    for (size_t k = 0; k < 6; k++)
        if (!seen[k])
            fail_msg("%s is not a method of kvfleet.proto's Worker service", ours[k]);
}

/* ---- a stand-in worker: typed handlers that count their runs ---- */

typedef struct fake {
    atomic_int info, generate, prefill, watch, cancel, health;
} fake;

static kvf_status w_info(void *ctx, kvf_rpc_call *call, kvf_rpc_info *resp, kvf_err *err)
{
    (void)call, (void)err;
    fake *f = ctx;
    atomic_fetch_add(&f->info, 1);
    kvf_kv_layout l = {.n_layers = 4, .n_kv_heads = 2, .head_dim = 32, .block_size = 16,
                       .dtype = KVF_DTYPE_BF16, .block_bytes = 2LL * 4 * 2 * 16 * 32 * 2};
    *resp = (kvf_rpc_info){.protocol_version = KVF_RPC_PROTOCOL_VERSION,
                           .role = KVF_RPC_ROLE_PREFILL, .model_id = "tiny", .block_size = 16,
                           .has_kv_layout = true, .kv_layout = l, .capacity_blocks = 128,
                           .transport = {.backend = "local"}, .worker_id = "prefill-0"};
    return KVF_OK;
}

static void w_generate(void *ctx, kvf_rpc_call *call, kvf_rpc_generate_req *g)
{
    fake *f = ctx;
    atomic_fetch_add(&f->generate, 1);
    kvf_err e = {0};
    kvf_status st = KVF_OK;
    int max = g->sampling.max_tokens ? g->sampling.max_tokens : 4;
    for (int i = 0; i < max && st == KVF_OK; i++) {
        int32_t tok = 100 + i;
        kvf_rpc_generate_resp r = {.token_ids = &tok, .n_token_ids = 1};
        if (i == max - 1) {
            r.finish = KVF_RPC_FINISH_LENGTH;
            r.has_usage = true;
            r.usage = (kvf_rpc_usage){.prompt_tokens = (int32_t)g->n_token_ids,
                                      .completion_tokens = max, .cached_prompt_tokens = 16};
        }
        st = kvf_rpc_call_send_generate(call, &r, &e);
    }
    free(g);
    kvf_rpc_call_finish(call, st, st == KVF_OK ? NULL : e.msg);
}

/* RemotePrefill is unary on the wire; the typed handler owns the call like a stream's and
 * sends its one response. */
static void w_prefill(void *ctx, kvf_rpc_call *call, kvf_rpc_remote_prefill_req *r)
{
    fake *f = ctx;
    atomic_fetch_add(&f->prefill, 1);
    kvf_rpc_remote_prefill_resp resp = {
        .first_token = r->token_ids[r->n_token_ids - 1] + 1, .has_stats = true,
        .stats = {.prompt_tokens = (int32_t)r->n_token_ids,
                  .blocks_sent = (int32_t)(r->n_dst_block_ids - (size_t)r->dst_cached_blocks)}};
    free(r);
    kvf_err e = {0};
    kvf_status st = kvf_rpc_call_send_remote_prefill(call, &resp, &e);
    kvf_rpc_call_finish(call, st, st == KVF_OK ? NULL : e.msg);
}

static void w_watch(void *ctx, kvf_rpc_call *call, kvf_rpc_watch_req *w)
{
    fake *f = ctx;
    atomic_fetch_add(&f->watch, 1);
    bool ours = strcmp(w->router_id, "router-a") == 0 && w->load_interval_ms == 250;
    free(w);
    if (!ours) {
        kvf_rpc_call_finish(call, KVF_ERR_INVALID, "unexpected WatchKvRequest");
        return;
    }
    uint64_t h[2] = {0xaaaa, 0xbbbb}, p[2] = {0x1234, 0xaaaa};
    kvf_rpc_watch_msg msgs[3] = {
        {.event = {.seq = 1, .kind = KVF_RPC_KV_SNAPSHOT, .block_hashes = h, .parent_hashes = p,
                   .n = 2, .block_size = 16, .model_id = "tiny", .snapshot_done = true}},
        {.event = {.seq = 2, .kind = KVF_RPC_KV_REMOVED, .block_hashes = h + 1, .n = 1}},
        {.is_load = true, .load = {.running = 2, .free_blocks = 100, .total_blocks = 128}},
    };
    kvf_err e = {0};
    kvf_status st = KVF_OK;
    for (int i = 0; i < 3 && st == KVF_OK; i++)
        st = kvf_rpc_call_send_watch(call, &msgs[i], &e);
    kvf_rpc_call_finish(call, st, st == KVF_OK ? NULL : e.msg);
}

static kvf_status w_cancel(void *ctx, kvf_rpc_call *call, const kvf_rpc_cancel_req *r,
                           kvf_rpc_cancel_resp *resp, kvf_err *err)
{
    (void)call, (void)err;
    fake *f = ctx;
    atomic_fetch_add(&f->cancel, 1);
    resp->found = strcmp(r->request_id, "req-1") == 0;
    return KVF_OK;
}

static kvf_status w_health(void *ctx, kvf_rpc_call *call, kvf_rpc_health *resp, kvf_err *err)
{
    (void)call, (void)err;
    fake *f = ctx;
    atomic_fetch_add(&f->health, 1);
    resp->status = KVF_RPC_SERVING;
    resp->detail = "running=0";
    return KVF_OK;
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

/* Opens a stream with req and expects it to end, with no message, with want and msg_part. */
static void stream_refused(kvf_rpc_channel *ch, const char *method, const kvf_rpc_buf *req,
                           kvf_status want, const char *msg_part)
{
    kvf_err e;
    kvf_rpc_stream *s;
    assert_int_equal(kvf_rpc_stream_open(ch, method, req->data, req->len, 5000, &s, &e), KVF_OK);
    kvf_rpc_buf m = {0};
    bool done = false;
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), want);
    assert_true(done);
    assert_null(m.data);
    if (!strstr(e.msg, msg_part))
        fail_msg("message \"%s\" lacks \"%s\"", e.msg, msg_part);
    kvf_rpc_stream_destroy(s);
}

static void test_all_six_methods(void **state)
{
    (void)state;
    kvf_log_set_level(KVF_LOG_WARN);
    fake f = {0};
    kvf_err e;
    kvf_rpc_server *srv;
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .n_threads = 2};
    assert_int_equal(kvf_rpc_server_create(&o, &srv, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_info(srv, w_info, &f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_generate(srv, w_generate, &f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_remote_prefill(srv, w_prefill, &f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_watch(srv, w_watch, &f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_cancel(srv, w_cancel, &f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_health(srv, w_health, &f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_start(srv, &e), KVF_OK);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", kvf_rpc_server_port(srv));
    kvf_rpc_channel *ch;
    assert_int_equal(kvf_rpc_channel_create(target, NULL, &ch, &e), KVF_OK);
    kvf_rpc_buf req = {0}, resp = {0};

    /* Info */
    assert_int_equal(kvf_rpc_info_req_encode(&req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_INFO, req.data, req.len, 5000, &resp, &e),
                     KVF_OK);
    kvf_rpc_info *info;
    assert_int_equal(kvf_rpc_info_decode(resp.data, resp.len, &info, &e), KVF_OK);
    assert_int_equal(info->role, KVF_RPC_ROLE_PREFILL);
    assert_true(info->has_kv_layout);
    assert_int_equal(info->kv_layout.n_layers, 4);
    assert_int_equal(info->kv_layout.dtype, KVF_DTYPE_BF16);
    assert_string_equal(info->transport.backend, "local");
    assert_string_equal(info->worker_id, "prefill-0");
    free(info);
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);

    /* Generate: 5 tokens, the last with usage */
    int32_t prompt[20];
    for (int i = 0; i < 20; i++)
        prompt[i] = i;
    kvf_rpc_generate_req g = {.request_id = "req-1", .token_ids = prompt, .n_token_ids = 20};
    kvf_rpc_sampling_default(&g.sampling);
    g.sampling.max_tokens = 5;
    assert_int_equal(kvf_rpc_generate_req_encode(&g, &req, &e), KVF_OK);
    kvf_rpc_stream *s;
    assert_int_equal(kvf_rpc_stream_open(ch, KVF_RPC_WORKER_GENERATE, req.data, req.len, 5000, &s,
                                         &e), KVF_OK);
    kvf_rpc_buf msgs[8];
    size_t n = read_all(s, msgs, 8);
    assert_int_equal(n, 5);
    for (size_t i = 0; i < n; i++) {
        kvf_rpc_generate_resp *r;
        assert_int_equal(kvf_rpc_generate_resp_decode(msgs[i].data, msgs[i].len, &r, &e), KVF_OK);
        assert_int_equal(r->n_token_ids, 1);
        assert_int_equal(r->token_ids[0], 100 + (int)i);
        if (i == n - 1) {
            assert_int_equal(r->finish, KVF_RPC_FINISH_LENGTH);
            assert_true(r->has_usage);
            assert_int_equal(r->usage.prompt_tokens, 20);
            assert_int_equal(r->usage.cached_prompt_tokens, 16);
        } else {
            assert_int_equal(r->finish, KVF_RPC_FINISH_NONE);
            assert_false(r->has_usage);
        }
        free(r);
        kvf_rpc_buf_free(&msgs[i]);
    }
    kvf_rpc_stream_destroy(s);
    kvf_rpc_buf_free(&req);
    /* A malformed request to a typed streaming method ends the call with the decoder's error,
     * and the handler never runs. */
    g.request_id = "";
    assert_int_equal(kvf_rpc_generate_req_encode(&g, &req, &e), KVF_OK);
    stream_refused(ch, KVF_RPC_WORKER_GENERATE, &req, KVF_ERR_INVALID,
                   "rpc: GenerateRequest.request_id is empty (required)");
    kvf_rpc_buf_free(&req);
    static const uint8_t junk[] = {0x12, 0xff, 0xff, 0x03, 0x01}; /* length past the end */
    kvf_rpc_buf jb = {.data = (uint8_t *)junk, .len = sizeof junk};
    stream_refused(ch, KVF_RPC_WORKER_GENERATE, &jb, KVF_ERR_PARSE,
                   "5 bytes are not a valid GenerateRequest message");
    assert_int_equal(atomic_load(&f.generate), 1);

    /* RemotePrefill, called unary as decode workers do */
    int32_t blocks[2] = {3, 4};
    kvf_rpc_remote_prefill_req rp = {.request_id = "req-1", .token_ids = prompt,
                                     .n_token_ids = 20, .dst_block_ids = blocks,
                                     .n_dst_block_ids = 2, .dst_cached_blocks = 1,
                                     .dst = {.backend = "local"}, .transfer_id = 5};
    kvf_rpc_sampling_default(&rp.sampling);
    assert_int_equal(kvf_rpc_remote_prefill_req_encode(&rp, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_REMOTE_PREFILL, req.data, req.len, 5000,
                                   &resp, &e), KVF_OK);
    kvf_rpc_remote_prefill_resp *pr;
    assert_int_equal(kvf_rpc_remote_prefill_resp_decode(resp.data, resp.len, &pr, &e), KVF_OK);
    assert_int_equal(pr->first_token, 20);
    assert_true(pr->has_stats);
    assert_int_equal(pr->stats.prompt_tokens, 20);
    assert_int_equal(pr->stats.blocks_sent, 1);
    free(pr);
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);
    /* ... and a bad one is refused before the worker's handler, naming the field. */
    rp.dst_cached_blocks = 3;
    assert_int_equal(kvf_rpc_remote_prefill_req_encode(&rp, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_REMOTE_PREFILL, req.data, req.len, 5000,
                                   &resp, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "dst_cached_blocks is 3"));
    assert_int_equal(atomic_load(&f.prefill), 1);
    kvf_rpc_buf_free(&req);

    /* WatchKv: snapshot, removal, load */
    kvf_rpc_watch_req wr = {.router_id = "router-a", .load_interval_ms = 250};
    assert_int_equal(kvf_rpc_watch_req_encode(&wr, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_stream_open(ch, KVF_RPC_WORKER_WATCH_KV, req.data, req.len, 5000, &s,
                                         &e), KVF_OK);
    n = read_all(s, msgs, 8);
    assert_int_equal(n, 3);
    kvf_rpc_watch_msg *w[3];
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(kvf_rpc_watch_msg_decode(msgs[i].data, msgs[i].len, &w[i], &e), KVF_OK);
        kvf_rpc_buf_free(&msgs[i]);
    }
    assert_false(w[0]->is_load);
    assert_int_equal(w[0]->event.kind, KVF_RPC_KV_SNAPSHOT);
    assert_true(w[0]->event.snapshot_done);
    assert_int_equal(w[0]->event.parent_hashes[1], 0xaaaa);
    assert_int_equal(w[1]->event.seq, 2);
    assert_int_equal(w[1]->event.block_hashes[0], 0xbbbb);
    assert_null(w[1]->event.parent_hashes);
    assert_true(w[2]->is_load);
    assert_int_equal(w[2]->load.free_blocks, 100);
    for (size_t i = 0; i < 3; i++)
        free(w[i]);
    kvf_rpc_stream_destroy(s);
    kvf_rpc_buf_free(&req);
    /* A router id with a space is refused before the handler. */
    wr.router_id = "router a";
    assert_int_equal(kvf_rpc_watch_req_encode(&wr, &req, &e), KVF_OK);
    stream_refused(ch, KVF_RPC_WORKER_WATCH_KV, &req, KVF_ERR_INVALID,
                   "WatchKvRequest.router_id has byte 0x20 at 6");
    kvf_rpc_buf_free(&req);
    assert_int_equal(atomic_load(&f.watch), 1);

    /* Cancel and Health */
    kvf_rpc_cancel_req cr = {.request_id = "req-1"};
    assert_int_equal(kvf_rpc_cancel_req_encode(&cr, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_CANCEL, req.data, req.len, 5000, &resp, &e),
                     KVF_OK);
    kvf_rpc_cancel_resp *cresp;
    assert_int_equal(kvf_rpc_cancel_resp_decode(resp.data, resp.len, &cresp, &e), KVF_OK);
    assert_true(cresp->found);
    free(cresp);
    kvf_rpc_buf_free(&req);
    kvf_rpc_buf_free(&resp);
    /* A typed unary method refuses a bad request the same way. */
    cr.request_id = "";
    assert_int_equal(kvf_rpc_cancel_req_encode(&cr, &req, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_CANCEL, req.data, req.len, 5000, &resp, &e),
                     KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "CancelRequest.request_id is empty (required)"));
    kvf_rpc_buf_free(&req);
    assert_int_equal(atomic_load(&f.cancel), 1);
    assert_int_equal(kvf_rpc_unary(ch, KVF_RPC_WORKER_HEALTH, NULL, 0, 5000, &resp, &e), KVF_OK);
    kvf_rpc_health *h;
    assert_int_equal(kvf_rpc_health_decode(resp.data, resp.len, &h, &e), KVF_OK);
    assert_int_equal(h->status, KVF_RPC_SERVING);
    assert_string_equal(h->detail, "running=0");
    free(h);
    kvf_rpc_buf_free(&resp);

    kvf_rpc_channel_destroy(ch);
    kvf_rpc_server_destroy(srv);
    assert_int_equal(atomic_load(&f.info), 1);
    assert_int_equal(atomic_load(&f.health), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_method_names_match_the_proto),
        cmocka_unit_test(test_all_six_methods),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
