/* worker.c: typed handlers for the Worker service: each registration pairs a method with its
 * checked decoder (proto/wire.c), so a role's handler receives a kvfleet struct and never sees
 * bytes, and a request that fails its checks ends the call with the decoder's error here. */
#include <stdlib.h>

#include "common/log.h"
#include "proto/rpc_internal.h"
#include "proto/worker.h"

/* The role's handler and its context, owned by the server (kvf_rpc_server_add_owned). */
typedef struct typed {
    union {
        kvf_rpc_info_fn info;
        kvf_rpc_health_fn health;
        kvf_rpc_cancel_fn cancel;
        kvf_rpc_generate_fn generate;
        kvf_rpc_remote_prefill_fn remote_prefill;
        kvf_rpc_watch_fn watch;
    } fn;
    void *ctx;
} typed;

static kvf_status add_typed(kvf_rpc_server *s, const char *method, kvf_rpc_unary_fn u,
                            kvf_rpc_stream_fn f, typed t, kvf_err *err)
{
    typed *a = malloc(sizeof *a);
    if (!a)
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: %s: out of memory", method);
    *a = t;
    return kvf_rpc_server_add_owned(s, method, u, f, a, free, err);
}

/* A request that failed its checks: the call ends with the decoder's error. */
static void refuse_stream(kvf_rpc_call *call, const kvf_err *err)
{
    kvf_log(KVF_LOG_DEBUG, "rpc: %s from %s refused: %s", kvf_rpc_call_method(call),
            kvf_rpc_call_peer(call), err->msg);
    kvf_rpc_call_finish(call, err->status != KVF_OK ? err->status : KVF_ERR_INVALID, err->msg);
}

/* ---- unary ---------------------------------------------------------------------------------- */

static kvf_status u_info(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                         kvf_rpc_buf *resp, kvf_err *err)
{
    typed *t = ctx;
    kvf_status st = kvf_rpc_info_req_decode(req, len, err);
    if (st != KVF_OK)
        return st;
    kvf_rpc_info info = {0};
    if ((st = t->fn.info(t->ctx, call, &info, err)) != KVF_OK)
        return st;
    return kvf_rpc_info_encode(&info, resp, err);
}

static kvf_status u_health(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                           kvf_rpc_buf *resp, kvf_err *err)
{
    typed *t = ctx;
    kvf_status st = kvf_rpc_health_req_decode(req, len, err);
    if (st != KVF_OK)
        return st;
    kvf_rpc_health h = {0};
    if ((st = t->fn.health(t->ctx, call, &h, err)) != KVF_OK)
        return st;
    return kvf_rpc_health_encode(&h, resp, err);
}

static kvf_status u_cancel(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                           kvf_rpc_buf *resp, kvf_err *err)
{
    typed *t = ctx;
    kvf_rpc_cancel_req *r = NULL;
    kvf_status st = kvf_rpc_cancel_req_decode(req, len, &r, err);
    if (st != KVF_OK)
        return st;
    kvf_rpc_cancel_resp c = {0};
    st = t->fn.cancel(t->ctx, call, r, &c, err);
    free(r);
    return st != KVF_OK ? st : kvf_rpc_cancel_resp_encode(&c, resp, err);
}

kvf_status kvf_rpc_serve_info(kvf_rpc_server *s, kvf_rpc_info_fn fn, void *ctx, kvf_err *err)
{
    return add_typed(s, KVF_RPC_WORKER_INFO, u_info, NULL, (typed){.fn.info = fn, .ctx = ctx}, err);
}

kvf_status kvf_rpc_serve_health(kvf_rpc_server *s, kvf_rpc_health_fn fn, void *ctx, kvf_err *err)
{
    return add_typed(s, KVF_RPC_WORKER_HEALTH, u_health, NULL,
                     (typed){.fn.health = fn, .ctx = ctx}, err);
}

kvf_status kvf_rpc_serve_cancel(kvf_rpc_server *s, kvf_rpc_cancel_fn fn, void *ctx, kvf_err *err)
{
    return add_typed(s, KVF_RPC_WORKER_CANCEL, u_cancel, NULL,
                     (typed){.fn.cancel = fn, .ctx = ctx}, err);
}

/* ---- streaming -------------------------------------------------------------------------------- */

static void s_generate(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    typed *t = ctx;
    kvf_rpc_generate_req *r = NULL;
    kvf_err err = {0};
    if (kvf_rpc_generate_req_decode(req, len, &r, &err) != KVF_OK)
        refuse_stream(call, &err);
    else
        t->fn.generate(t->ctx, call, r);
}

static void s_remote_prefill(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    typed *t = ctx;
    kvf_rpc_remote_prefill_req *r = NULL;
    kvf_err err = {0};
    if (kvf_rpc_remote_prefill_req_decode(req, len, &r, &err) != KVF_OK)
        refuse_stream(call, &err);
    else
        t->fn.remote_prefill(t->ctx, call, r);
}

static void s_watch(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    typed *t = ctx;
    kvf_rpc_watch_req *r = NULL;
    kvf_err err = {0};
    if (kvf_rpc_watch_req_decode(req, len, &r, &err) != KVF_OK)
        refuse_stream(call, &err);
    else
        t->fn.watch(t->ctx, call, r);
}

kvf_status kvf_rpc_serve_generate(kvf_rpc_server *s, kvf_rpc_generate_fn fn, void *ctx,
                                  kvf_err *err)
{
    return add_typed(s, KVF_RPC_WORKER_GENERATE, NULL, s_generate,
                     (typed){.fn.generate = fn, .ctx = ctx}, err);
}

kvf_status kvf_rpc_serve_remote_prefill(kvf_rpc_server *s, kvf_rpc_remote_prefill_fn fn,
                                        void *ctx, kvf_err *err)
{
    return add_typed(s, KVF_RPC_WORKER_REMOTE_PREFILL, NULL, s_remote_prefill,
                     (typed){.fn.remote_prefill = fn, .ctx = ctx}, err);
}

kvf_status kvf_rpc_serve_watch(kvf_rpc_server *s, kvf_rpc_watch_fn fn, void *ctx, kvf_err *err)
{
    return add_typed(s, KVF_RPC_WORKER_WATCH_KV, NULL, s_watch,
                     (typed){.fn.watch = fn, .ctx = ctx}, err);
}

/* ---- sending on a stream ------------------------------------------------------------------------ */

kvf_status kvf_rpc_call_send_generate(kvf_rpc_call *c, const kvf_rpc_generate_resp *m,
                                      kvf_err *err)
{
    kvf_rpc_buf b = {0};
    kvf_status st = kvf_rpc_generate_resp_encode(m, &b, err);
    if (st == KVF_OK)
        st = kvf_rpc_call_send(c, b.data, b.len, err);
    kvf_rpc_buf_free(&b);
    return st;
}

kvf_status kvf_rpc_call_send_remote_prefill(kvf_rpc_call *c,
                                            const kvf_rpc_remote_prefill_resp *m, kvf_err *err)
{
    kvf_rpc_buf b = {0};
    kvf_status st = kvf_rpc_remote_prefill_resp_encode(m, &b, err);
    if (st == KVF_OK)
        st = kvf_rpc_call_send(c, b.data, b.len, err);
    kvf_rpc_buf_free(&b);
    return st;
}

kvf_status kvf_rpc_call_send_watch(kvf_rpc_call *c, const kvf_rpc_watch_msg *m, kvf_err *err)
{
    kvf_rpc_buf b = {0};
    kvf_status st = kvf_rpc_watch_msg_encode(m, &b, err);
    if (st == KVF_OK)
        st = kvf_rpc_call_send(c, b.data, b.len, err);
    kvf_rpc_buf_free(&b);
    return st;
}
