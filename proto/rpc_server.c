/* rpc_server.c: the async RPC server over gRPC C core. One completion queue polled by one
 * thread that never blocks; handlers run on a small pool of threads. Calls are reference
 * counted: the handler holds one reference until it finishes the call, and each gRPC operation
 * in flight holds one; the last to let go frees the call (its completion path). */
#include "proto/rpc_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/slice.h>
#include <grpc/status.h>
#include <grpc/support/alloc.h>

#include "common/log.h"
#include "common/time.h"

#define RPC_MAX_METHODS 32
#define RPC_REQUESTS_PER_METHOD 2 /* calls requested ahead of arrival, per method */

typedef struct rpc_method {
    char *name;
    bool streaming;
    kvf_rpc_unary_fn unary;
    kvf_rpc_stream_fn stream;
    void *ctx;
    void (*ctx_free)(void *ctx); /* kvf_rpc_server_add_owned: frees ctx with the server */
    void *handle; /* grpc_server_register_method */
} rpc_method;

/* One outstanding grpc_server_request_*call. */
typedef struct rpc_request {
    rpc_tag tag;
    kvf_rpc_server *srv;
    int method; /* index into srv->methods; -1: the catch-all for unknown names */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;
} rpc_request;

typedef struct rpc_out {
    grpc_byte_buffer *bb;
    struct rpc_out *next;
} rpc_out;

struct kvf_rpc_call {
    kvf_rpc_server *srv;
    const rpc_method *m; /* NULL for an unknown method */
    char *method_name;
    char *peer;
    grpc_call *call;
    gpr_timespec deadline;
    kvf_rpc_buf req;
    bool has_req;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool cancelled, finished, sent_initial_md, in_cancel_cb;
    void (*on_cancel)(void *arg);
    void *on_cancel_arg;

    /* Messages waiting to be sent, in order; one SEND_MESSAGE in flight at a time. */
    struct rpc_out *q_head, *q_tail;
    size_t q_len;
    uint64_t n_queued, n_done; /* messages ever queued / completed or dropped */
    grpc_byte_buffer *in_flight;
    bool finish_pending, finish_started;
    kvf_status finish_st;

    int close_cancelled; /* GRPC_OP_RECV_CLOSE_ON_SERVER */
    rpc_tag close_tag, write_tag, finish_tag;
    grpc_slice details;
    bool has_details;
    char kvf_code[16];
    grpc_metadata trailing;
    grpc_byte_buffer *finish_bb;

    struct kvf_rpc_call *next_job; /* the pool's queue */
};

/* The server's TLS files, read by gRPC's config fetcher at start and again at the first
 * handshake after each kvf_rpc_tls_reload. */
typedef struct srv_tls {
    pthread_mutex_t mu;
    char *cert_file, *key_file, *ca_file; /* ca_file NULL: no client certificates asked */
    uint64_t gen;                         /* the generation last loaded */
    bool loaded;
    uint64_t failed_gen; /* the generation whose reload failed (logged once) */
} srv_tls;

struct kvf_rpc_server {
    srv_tls *tls;
    grpc_server *server;
    grpc_completion_queue *cq;
    int port;
    int64_t max_msg;
    int n_threads;
    rpc_method methods[RPC_MAX_METHODS];
    int n_methods;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool started, shutting, shutdown_done, shut, pool_stop;
    int live_calls;
    int method_live[RPC_MAX_METHODS]; /* live calls per registered method */
    kvf_rpc_call *jobs_head, *jobs_tail;
    pthread_t poller;
    pthread_t *workers;
    int n_workers;
    rpc_tag shutdown_tag;
};

/* ---- calls ---- */

static void call_unref(kvf_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left > 0)
        return;
    kvf_rpc_server *s = c->srv;
    const rpc_method *m = c->m;
    grpc_call_unref(c->call);
    if (c->has_details)
        grpc_slice_unref(c->details);
    if (c->finish_bb)
        grpc_byte_buffer_destroy(c->finish_bb);
    while (c->q_head) {
        rpc_out *o = c->q_head;
        c->q_head = o->next;
        grpc_byte_buffer_destroy(o->bb);
        free(o);
    }
    kvf_rpc_buf_free(&c->req);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->method_name);
    free(c->peer);
    free(c);
    pthread_mutex_lock(&s->mu);
    s->live_calls--;
    if (m)
        s->method_live[m - s->methods]--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* RECV_CLOSE_ON_SERVER completed: the call is over for the client, cancelled or not. */
static void on_close(rpc_tag *t, bool ok)
{
    kvf_rpc_call *c = RPC_CONTAINER_OF(t, kvf_rpc_call, close_tag);
    pthread_mutex_lock(&c->mu);
    void (*fn)(void *) = NULL;
    void *arg = NULL;
    if (c->close_cancelled || !ok) {
        c->cancelled = true;
        if (!c->finished && c->on_cancel) {
            fn = c->on_cancel;
            arg = c->on_cancel_arg;
            c->on_cancel = NULL;
            c->in_cancel_cb = true;
        }
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (fn) {
        fn(arg);
        pthread_mutex_lock(&c->mu);
        c->in_cancel_cb = false;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    call_unref(c);
}

/* Drops every queued message (the call is cancelled): they count as done. c->mu held. */
static void drop_queue_locked(kvf_rpc_call *c)
{
    while (c->q_head) {
        rpc_out *o = c->q_head;
        c->q_head = o->next;
        grpc_byte_buffer_destroy(o->bb);
        free(o);
        c->n_done++;
    }
    c->q_tail = NULL;
    c->q_len = 0;
}

static void start_finish_locked(kvf_rpc_call *c);

/* Starts the next queued message, or the final status once the queue is empty and the handler
 * has finished. Never blocks (the poller calls it too). c->mu held. */
static void pump_locked(kvf_rpc_call *c)
{
    if (c->in_flight)
        return;
    if (c->q_head && !c->cancelled) {
        rpc_out *o = c->q_head;
        c->q_head = o->next;
        if (!c->q_head)
            c->q_tail = NULL;
        c->q_len--;
        grpc_op ops[2];
        memset(ops, 0, sizeof ops);
        size_t n = 0;
        if (!c->sent_initial_md) {
            ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
            c->sent_initial_md = true;
        }
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = o->bb;
        c->in_flight = o->bb;
        free(o);
        c->refs++;
        if (grpc_call_start_batch(c->call, ops, n, &c->write_tag, NULL) == GRPC_CALL_OK)
            return;
        kvf_log(KVF_LOG_ERROR, "rpc: %s: gRPC refused a write", c->method_name);
        c->refs--;
        grpc_byte_buffer_destroy(c->in_flight);
        c->in_flight = NULL;
        c->n_done++;
        c->cancelled = true;
    }
    if (c->cancelled)
        drop_queue_locked(c);
    if (c->finish_pending && !c->finish_started && !c->q_head)
        start_finish_locked(c);
}

static void on_write(rpc_tag *t, bool ok)
{
    kvf_rpc_call *c = RPC_CONTAINER_OF(t, kvf_rpc_call, write_tag);
    pthread_mutex_lock(&c->mu);
    grpc_byte_buffer_destroy(c->in_flight);
    c->in_flight = NULL;
    c->n_done++;
    if (!ok)
        c->cancelled = true; /* a failed send means the stream is gone */
    pump_locked(c);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    call_unref(c);
}

static void on_finish(rpc_tag *t, bool ok)
{
    kvf_rpc_call *c = RPC_CONTAINER_OF(t, kvf_rpc_call, finish_tag);
    call_unref(c);
}

const char *kvf_rpc_call_method(const kvf_rpc_call *c) { return c->method_name; }

const char *kvf_rpc_call_peer(const kvf_rpc_call *c) { return c->peer ? c->peer : "unknown"; }

int64_t kvf_rpc_call_remaining_ms(const kvf_rpc_call *c)
{
    return kvf_rpc_deadline_remaining_ms(c->deadline);
}

bool kvf_rpc_call_is_cancelled(const kvf_rpc_call *c)
{
    kvf_rpc_call *m = (kvf_rpc_call *)c;
    pthread_mutex_lock(&m->mu);
    bool v = m->cancelled;
    pthread_mutex_unlock(&m->mu);
    return v;
}

void kvf_rpc_call_on_cancel(kvf_rpc_call *c, void (*fn)(void *arg), void *arg)
{
    pthread_mutex_lock(&c->mu);
    bool now = c->cancelled && !c->finished;
    c->on_cancel = now ? NULL : fn;
    c->on_cancel_arg = arg;
    pthread_mutex_unlock(&c->mu);
    if (now && fn)
        fn(arg);
}

/* Queues one message; *seq_out is its number for kvf_rpc_call_write to wait on. */
static kvf_status call_send(kvf_rpc_call *c, const void *msg, size_t len, uint64_t *seq_out,
                            kvf_err *err)
{
    if (!c->m || !c->m->streaming)
        return kvf_err_set(err, KVF_ERR_STATE, "rpc: %s: write on a call that is not "
                                               "server-streaming", c->method_name);
    if ((int64_t)len > c->srv->max_msg)
        return kvf_err_set(err, KVF_ERR_LIMIT, "rpc: %s: message of %zu bytes is over the "
                           "limit of %lld bytes", c->method_name, len, (long long)c->srv->max_msg);
    rpc_out *o = malloc(sizeof *o);
    grpc_byte_buffer *bb = o ? kvf_rpc_bb_from(msg, len) : NULL;
    if (!bb) {
        free(o);
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: %s: no memory for a message",
                           c->method_name);
    }
    kvf_status st = KVF_OK;
    pthread_mutex_lock(&c->mu);
    if (c->finished)
        st = kvf_err_set(err, KVF_ERR_STATE, "rpc: %s: write after finish", c->method_name);
    else if (c->cancelled)
        st = kvf_err_set(err, KVF_ERR_CANCELLED, "rpc: %s: call cancelled", c->method_name);
    else if (c->q_len >= KVF_RPC_SEND_QUEUE_MAX)
        st = kvf_err_set(err, KVF_ERR_FULL, "rpc: %s: %d messages already wait for a client that "
                         "is not reading", c->method_name, KVF_RPC_SEND_QUEUE_MAX);
    if (st != KVF_OK) {
        pthread_mutex_unlock(&c->mu);
        grpc_byte_buffer_destroy(bb);
        free(o);
        return st;
    }
    o->bb = bb;
    o->next = NULL;
    if (c->q_tail)
        c->q_tail->next = o;
    else
        c->q_head = o;
    c->q_tail = o;
    c->q_len++;
    *seq_out = ++c->n_queued;
    pump_locked(c);
    pthread_mutex_unlock(&c->mu);
    return KVF_OK;
}

kvf_status kvf_rpc_call_send(kvf_rpc_call *c, const void *msg, size_t len, kvf_err *err)
{
    uint64_t seq = 0;
    return call_send(c, msg, len, &seq, err);
}

kvf_status kvf_rpc_call_write(kvf_rpc_call *c, const void *msg, size_t len, kvf_err *err)
{
    uint64_t seq = 0;
    kvf_status st = call_send(c, msg, len, &seq, err);
    if (st != KVF_OK)
        return st;
    pthread_mutex_lock(&c->mu);
    while (c->n_done < seq)
        pthread_cond_wait(&c->cv, &c->mu);
    bool cancelled = c->cancelled;
    pthread_mutex_unlock(&c->mu);
    if (cancelled)
        return kvf_err_set(err, KVF_ERR_CANCELLED, "rpc: %s: call cancelled during a write",
                           c->method_name);
    return KVF_OK;
}

/* Sends the final status, after every queued message. c->mu held, queue empty. */
static void start_finish_locked(kvf_rpc_call *c)
{
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!c->sent_initial_md) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->sent_initial_md = true;
    }
    if (c->finish_bb) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->finish_bb;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status =
        (grpc_status_code)kvf_status_to_grpc(c->finish_st);
    ops[n].data.send_status_from_server.status_details = &c->details;
    ops[n].data.send_status_from_server.trailing_metadata_count = 1;
    ops[n++].data.send_status_from_server.trailing_metadata = &c->trailing;
    c->finish_started = true;
    c->refs++;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->finish_tag, NULL);
    if (e != GRPC_CALL_OK) {
        c->refs--;
        kvf_log(KVF_LOG_ERROR, "rpc: %s: gRPC refused the final status (error %d)",
                c->method_name, (int)e);
    }
}

/* The handler's end of the call, once: locks c->mu and returns true with it held, or false
 * (unlocked, logged) when the call was already finished. Waits out a running cancel callback. */
static bool finish_begin(kvf_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    while (c->in_cancel_cb)
        pthread_cond_wait(&c->cv, &c->mu);
    if (c->finished) {
        pthread_mutex_unlock(&c->mu);
        kvf_log(KVF_LOG_ERROR, "rpc: %s: call finished twice (handler bug)", c->method_name);
        return false;
    }
    c->finished = true;
    c->on_cancel = NULL;
    return true;
}

/* Ends the call: the status (and, for a unary call, the response) goes out after the messages
 * already queued; drops the handler's reference. Never waits for the client. */
static void call_finish(kvf_rpc_call *c, kvf_status st, const char *msg, const kvf_rpc_buf *resp)
{
    if (!finish_begin(c))
        return;
    if (resp && st == KVF_OK) {
        c->finish_bb = kvf_rpc_bb_from(resp->data, resp->len);
        if (!c->finish_bb) {
            st = KVF_ERR_NOMEM;
            msg = "rpc: no memory for the response";
        }
    }
    c->finish_st = st;
    snprintf(c->kvf_code, sizeof c->kvf_code, "%d", (int)st);
    c->trailing.key = grpc_slice_from_static_string(RPC_KVF_STATUS_KEY);
    c->trailing.value = grpc_slice_from_static_string(c->kvf_code);
    if (!msg)
        msg = st == KVF_OK ? "" : kvf_status_str(st);
    c->details = grpc_slice_from_copied_string(msg);
    c->has_details = true;
    c->finish_pending = true;
    pump_locked(c);
    pthread_mutex_unlock(&c->mu);
    call_unref(c); /* the handler's reference */
}

void kvf_rpc_call_finish(kvf_rpc_call *c, kvf_status st, const char *msg)
{
    call_finish(c, st, msg, NULL);
}

void kvf_rpc_call_abandon(kvf_rpc_call *c, const char *msg)
{
    if (!finish_begin(c))
        return;
    c->cancelled = true;
    drop_queue_locked(c);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    /* gRPC's own cancellation: the client gets UNAVAILABLE with no kvf-status trailer */
    grpc_call_cancel_with_status(c->call, GRPC_STATUS_UNAVAILABLE, msg ? msg : "abandoned", NULL);
    call_unref(c); /* the handler's reference */
}

/* ---- the handler pool ---- */

static void run_call(kvf_rpc_call *c)
{
    const rpc_method *m = c->m;
    if (!c->has_req) {
        call_finish(c, KVF_ERR_INVALID, "rpc: the call carried no request message", NULL);
        return;
    }
    if (m->streaming) {
        m->stream(m->ctx, c, c->req.data, c->req.len);
        return;
    }
    kvf_rpc_buf resp = {0};
    kvf_err e;
    kvf_err_clear(&e);
    kvf_status st = m->unary(m->ctx, c, c->req.data, c->req.len, &resp, &e);
    if (st == KVF_OK && (int64_t)resp.len > c->srv->max_msg) {
        st = kvf_err_set(&e, KVF_ERR_LIMIT, "rpc: %s: response of %zu bytes is over the limit "
                         "of %lld bytes", c->method_name, resp.len, (long long)c->srv->max_msg);
    }
    if (st != KVF_OK) {
        if (!e.msg[0])
            snprintf(e.msg, sizeof e.msg, "%s: %s", c->method_name, kvf_status_str(st));
        kvf_log(KVF_LOG_DEBUG, "rpc: %s: %s: %s", c->method_name, kvf_status_name(st), e.msg);
    }
    call_finish(c, st, st == KVF_OK ? NULL : e.msg, st == KVF_OK ? &resp : NULL);
    kvf_rpc_buf_free(&resp);
}

static void *worker_main(void *arg)
{
    kvf_rpc_server *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->jobs_head && !s->pool_stop)
            pthread_cond_wait(&s->cv, &s->mu);
        kvf_rpc_call *c = s->jobs_head;
        if (!c)
            break; /* stopping and nothing queued */
        s->jobs_head = c->next_job;
        if (!s->jobs_head)
            s->jobs_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        run_call(c);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- accepting calls ---- */

static void on_request(rpc_tag *t, bool ok);

static void request_post(kvf_rpc_server *s, int method)
{
    rpc_request *r = calloc(1, sizeof *r);
    if (!r) {
        kvf_log(KVF_LOG_ERROR, "rpc: out of memory requesting a call");
        return;
    }
    r->tag.fn = on_request;
    r->srv = s;
    r->method = method;
    grpc_metadata_array_init(&r->md);
    grpc_call_error e;
    if (method >= 0) {
        e = grpc_server_request_registered_call(s->server, s->methods[method].handle, &r->call,
                                                &r->deadline, &r->md, &r->payload, s->cq, s->cq,
                                                &r->tag);
    } else {
        grpc_call_details_init(&r->details);
        e = grpc_server_request_call(s->server, &r->call, &r->details, &r->md, s->cq, s->cq,
                                     &r->tag);
    }
    if (e != GRPC_CALL_OK) {
        if (method < 0)
            grpc_call_details_destroy(&r->details);
        grpc_metadata_array_destroy(&r->md);
        free(r);
    }
}

static void request_free(rpc_request *r)
{
    if (r->method < 0)
        grpc_call_details_destroy(&r->details);
    grpc_metadata_array_destroy(&r->md);
    if (r->payload)
        grpc_byte_buffer_destroy(r->payload);
    free(r);
}

static void on_request(rpc_tag *t, bool ok)
{
    rpc_request *r = RPC_CONTAINER_OF(t, rpc_request, tag);
    kvf_rpc_server *s = r->srv;
    if (!ok) { /* the server is shutting down */
        request_free(r);
        return;
    }
    pthread_mutex_lock(&s->mu);
    bool repost = !s->shutting;
    s->live_calls++;
    if (r->method >= 0)
        s->method_live[r->method]++;
    pthread_mutex_unlock(&s->mu);
    if (repost)
        request_post(s, r->method);

    kvf_rpc_call *c = calloc(1, sizeof *c);
    kvf_err e;
    kvf_err_clear(&e);
    if (c && r->method >= 0) {
        c->method_name = strdup(s->methods[r->method].name);
    } else if (c) {
        char *name = grpc_slice_to_c_string(r->details.method); /* gpr_malloc()ed */
        c->method_name = name ? strdup(name) : NULL;
        gpr_free(name);
    }
    if (!c || !c->method_name) {
        kvf_log(KVF_LOG_ERROR, "rpc: out of memory accepting a call");
        free(c);
        grpc_call_cancel_with_status(r->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory",
                                     NULL);
        grpc_call_unref(r->call);
        pthread_mutex_lock(&s->mu);
        s->live_calls--;
        if (r->method >= 0)
            s->method_live[r->method]--;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        request_free(r);
        return;
    }
    c->srv = s;
    c->m = r->method >= 0 ? &s->methods[r->method] : NULL;
    c->call = r->call;
    char *peer = grpc_call_get_peer(c->call);
    c->peer = peer ? strdup(peer) : NULL;
    gpr_free(peer);
    c->deadline = r->method >= 0 ? r->deadline : r->details.deadline;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->refs = 2; /* the handler + RECV_CLOSE_ON_SERVER */
    c->close_tag.fn = on_close;
    c->write_tag.fn = on_write;
    c->finish_tag.fn = on_finish;
    if (r->payload) {
        if (kvf_rpc_bb_read(r->payload, &c->req, &e) == KVF_OK)
            c->has_req = true;
    }
    request_free(r);

    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    if (grpc_call_start_batch(c->call, &op, 1, &c->close_tag, NULL) != GRPC_CALL_OK) {
        c->refs--;
        c->cancelled = true;
    }

    if (!c->m) {
        char msg[300];
        snprintf(msg, sizeof msg, "rpc: no method %s on this server", c->method_name);
        call_finish(c, KVF_ERR_UNSUPPORTED, msg, NULL);
        return;
    }
    pthread_mutex_lock(&s->mu);
    c->next_job = NULL;
    if (s->jobs_tail)
        s->jobs_tail->next_job = c;
    else
        s->jobs_head = c;
    s->jobs_tail = c;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void on_shutdown(rpc_tag *t, bool ok)
{
    kvf_rpc_server *s = RPC_CONTAINER_OF(t, kvf_rpc_server, shutdown_tag);
    pthread_mutex_lock(&s->mu);
    s->shutdown_done = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void *poller_main(void *arg)
{
    kvf_rpc_server *s = arg;
    kvf_rpc_cq_poll(s->cq);
    return NULL;
}

/* ---- the server ---- */

/* Reads the three files into a new certificate config (gRPC copies the strings). */
static grpc_ssl_server_certificate_config *tls_config(const srv_tls *t, kvf_err *err)
{
    char *cert = NULL, *key = NULL, *ca = NULL;
    grpc_ssl_server_certificate_config *c = NULL;
    if (kvf_rpc_pem_read(t->cert_file, "--tls-cert", &cert, err) == KVF_OK &&
        kvf_rpc_pem_read(t->key_file, "--tls-key", &key, err) == KVF_OK &&
        (!t->ca_file || kvf_rpc_pem_read(t->ca_file, "--tls-ca", &ca, err) == KVF_OK)) {
        grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
        c = grpc_ssl_server_certificate_config_create(ca, &pair, 1);
        if (!c)
            kvf_err_set(err, KVF_ERR_INVALID, "rpc: gRPC refused the TLS files %s, %s",
                        t->cert_file, t->key_file);
    }
    free(cert);
    free(key);
    free(ca);
    return c;
}

/* gRPC's config fetcher: runs at start and before handshakes, on gRPC's threads. */
static grpc_ssl_certificate_config_reload_status tls_fetch(void *arg,
                                                           grpc_ssl_server_certificate_config **out)
{
    srv_tls *t = arg;
    uint64_t g = kvf_rpc_tls_generation();
    pthread_mutex_lock(&t->mu);
    grpc_ssl_certificate_config_reload_status r = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
    if (!t->loaded || (g != t->gen && g != t->failed_gen)) {
        kvf_err err = {0};
        grpc_ssl_server_certificate_config *c = tls_config(t, &err);
        if (c) {
            *out = c;
            if (t->loaded)
                kvf_log(KVF_LOG_INFO, "rpc: server TLS certificate reloaded from %s", t->cert_file);
            t->gen = g;
            t->loaded = true;
            r = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
        } else {
            kvf_log(KVF_LOG_ERROR, "rpc: server TLS reload failed, the previous files stay in use: %s",
                    err.msg);
            t->failed_gen = g;
            r = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return r;
}

static void tls_free(srv_tls *t)
{
    if (!t)
        return;
    pthread_mutex_destroy(&t->mu);
    free(t->cert_file);
    free(t->key_file);
    free(t->ca_file);
    free(t);
}

kvf_status kvf_rpc_server_create(const kvf_rpc_server_opts *opts, kvf_rpc_server **out,
                                 kvf_err *err)
{
    if (!opts || !opts->address || !*opts->address)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: server: no listen address (want "
                                                 "host:port, e.g. 0.0.0.0:50051)");
    int n_threads = opts->n_threads ? opts->n_threads : 2;
    if (n_threads < 1 || n_threads > 256)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: server: %d handler threads (allowed "
                                                 "1..256)", opts->n_threads);
    int64_t max_msg;
    kvf_status st = kvf_rpc_max_msg_check(opts->max_msg_bytes, "server", &max_msg, err);
    if (st != KVF_OK)
        return st;
    const kvf_rpc_tls *tls = opts->tls;
    bool use_tls = tls && tls->cert_file && *tls->cert_file;
    if (tls && !use_tls && tls->key_file && *tls->key_file)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: server: --tls-key given without "
                                                 "--tls-cert");
    if (use_tls && (!tls->key_file || !*tls->key_file))
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: server: --tls-cert given without "
                                                 "--tls-key");
    srv_tls *t = NULL;
    if (use_tls) {
        t = calloc(1, sizeof *t);
        if (!t)
            return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: server: out of memory");
        pthread_mutex_init(&t->mu, NULL);
        t->cert_file = strdup(tls->cert_file);
        t->key_file = strdup(tls->key_file);
        t->ca_file = tls->ca_file && *tls->ca_file ? strdup(tls->ca_file) : NULL;
        t->failed_gen = UINT64_MAX;
        grpc_ssl_server_certificate_config *c =
            t->cert_file && t->key_file ? tls_config(t, err) : NULL; /* the files, checked now */
        if (!c) {
            if (!t->cert_file || !t->key_file)
                kvf_err_set(err, KVF_ERR_NOMEM, "rpc: server: out of memory");
            tls_free(t);
            return err->status != KVF_OK ? err->status : KVF_ERR_INVALID;
        }
        grpc_ssl_server_certificate_config_destroy(c);
    }

    kvf_rpc_server *s = calloc(1, sizeof *s);
    if (!s) {
        tls_free(t);
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: server: out of memory");
    }
    s->tls = t;
    kvf_rpc_grpc_init();
    s->max_msg = max_msg;
    s->n_threads = n_threads;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->shutdown_tag.fn = on_shutdown;
    rpc_args a;
    kvf_rpc_args_init(&a, max_msg, true, kvf_rpc_keepalive_ms(opts->keepalive_ms), NULL);
    s->server = grpc_server_create(&a.args, NULL);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(s->server, s->cq, NULL);

    grpc_server_credentials *creds;
    if (use_tls) {
        /* with a CA, a client without a certificate it signed never gets past the handshake */
        if (t->ca_file) {
            grpc_ssl_server_credentials_options *o =
                grpc_ssl_server_credentials_create_options_using_config_fetcher(
                    GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, tls_fetch, t);
            creds = o ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
        } else {
            /* gRPC 1.51's fetcher needs root certificates (it aborts without), so a server
             * that asks for no client certificate keeps the files it started with */
            grpc_ssl_server_certificate_config *c = tls_config(t, err);
            creds = NULL;
            if (c) {
                grpc_ssl_server_credentials_options *o =
                    grpc_ssl_server_credentials_create_options_using_config(
                        GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE, c);
                creds = o ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
            }
        }
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    s->port = creds ? grpc_server_add_http2_port(s->server, opts->address, creds) : 0;
    if (creds)
        grpc_server_credentials_release(creds);
    if (s->port <= 0) {
        st = kvf_err_set(err, use_tls ? KVF_ERR_INVALID : KVF_ERR_IO,
                         "rpc: server: cannot listen on %s%s (want host:port with a free port; "
                         "port 0 picks one)", opts->address,
                         use_tls ? " with TLS (check --tls-cert and --tls-key)" : "");
        kvf_rpc_server_destroy(s);
        return st;
    }
    kvf_log(KVF_LOG_DEBUG, "rpc: server bound to %s (port %d%s)", opts->address, s->port,
            !use_tls ? "" : t->ca_file ? ", mutual TLS" : ", TLS");
    *out = s;
    return KVF_OK;
}

int kvf_rpc_server_port(const kvf_rpc_server *s) { return s->port; }

static kvf_status add_method(kvf_rpc_server *s, const char *method, bool streaming,
                             kvf_rpc_unary_fn u, kvf_rpc_stream_fn f, void *ctx,
                             void (*ctx_free)(void *), kvf_err *err)
{
    if (!method || method[0] != '/' || !strchr(method + 1, '/'))
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: method name \"%s\" is not of the form "
                           "/package.Service/Method", method ? method : "(null)");
    if ((streaming && !f) || (!streaming && !u))
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s: no handler function", method);
    if (s->started)
        return kvf_err_set(err, KVF_ERR_STATE, "rpc: %s: methods must be added before the "
                                               "server starts", method);
    for (int i = 0; i < s->n_methods; i++)
        if (strcmp(s->methods[i].name, method) == 0)
            return kvf_err_set(err, KVF_ERR_EXISTS, "rpc: method %s is already registered",
                               method);
    if (s->n_methods == RPC_MAX_METHODS)
        return kvf_err_set(err, KVF_ERR_LIMIT, "rpc: %s: more than %d methods on one server",
                           method, RPC_MAX_METHODS);
    rpc_method *m = &s->methods[s->n_methods];
    m->name = strdup(method);
    if (!m->name)
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: out of memory");
    m->handle = grpc_server_register_method(s->server, m->name, NULL,
                                            GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!m->handle) {
        free(m->name);
        m->name = NULL;
        return kvf_err_set(err, KVF_ERR_INTERNAL, "rpc: gRPC refused to register %s", method);
    }
    m->streaming = streaming;
    m->unary = u;
    m->stream = f;
    m->ctx = ctx;
    m->ctx_free = ctx_free;
    s->n_methods++;
    return KVF_OK;
}

kvf_status kvf_rpc_server_add_unary(kvf_rpc_server *s, const char *method, kvf_rpc_unary_fn fn,
                                    void *ctx, kvf_err *err)
{
    return add_method(s, method, false, fn, NULL, ctx, NULL, err);
}

kvf_status kvf_rpc_server_add_stream(kvf_rpc_server *s, const char *method,
                                     kvf_rpc_stream_fn fn, void *ctx, kvf_err *err)
{
    return add_method(s, method, true, NULL, fn, ctx, NULL, err);
}

kvf_status kvf_rpc_server_add_owned(kvf_rpc_server *s, const char *method, kvf_rpc_unary_fn u,
                                    kvf_rpc_stream_fn f, void *ctx, void (*ctx_free)(void *),
                                    kvf_err *err)
{
    kvf_status st = add_method(s, method, f != NULL, u, f, ctx, ctx_free, err);
    if (st != KVF_OK)
        ctx_free(ctx);
    return st;
}

kvf_status kvf_rpc_server_start(kvf_rpc_server *s, kvf_err *err)
{
    if (s->started || s->shut)
        return kvf_err_set(err, KVF_ERR_STATE, "rpc: server on port %d already started",
                           s->port);
    s->workers = calloc((size_t)s->n_threads, sizeof *s->workers);
    if (!s->workers)
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: server: out of memory");
    grpc_server_start(s->server);
    s->started = true;
    if (pthread_create(&s->poller, NULL, poller_main, s) != 0) {
        /* Without a poller nothing completes: stop here, polling inline until shut down. */
        s->shutting = true;
        grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
        grpc_server_cancel_all_calls(s->server);
        while (!s->shutdown_done) {
            grpc_event ev =
                grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
            if (ev.type != GRPC_OP_COMPLETE)
                break;
            ((rpc_tag *)ev.tag)->fn(ev.tag, ev.success != 0);
        }
        s->started = false; /* destroy drains the queue inline */
        s->shut = true;
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: server: cannot start the polling thread");
    }
    for (int i = 0; i < s->n_threads; i++) {
        if (pthread_create(&s->workers[i], NULL, worker_main, s) != 0)
            break;
        s->n_workers++;
    }
    for (int m = 0; m < s->n_methods; m++)
        for (int k = 0; k < RPC_REQUESTS_PER_METHOD; k++)
            request_post(s, m);
    request_post(s, -1);
    if (s->n_workers == 0) {
        kvf_rpc_server_shutdown(s, 0);
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: server: cannot start handler threads");
    }
    kvf_log(KVF_LOG_INFO, "rpc: serving %d methods on port %d (%d handler threads)",
            s->n_methods, s->port, s->n_workers);
    return KVF_OK;
}

int kvf_rpc_server_live(kvf_rpc_server *s, const char *method)
{
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n_methods; i++)
        if (strcmp(s->methods[i].name, method) == 0)
            n = s->method_live[i];
    pthread_mutex_unlock(&s->mu);
    return n;
}

void kvf_rpc_server_shutdown(kvf_rpc_server *s, int64_t grace_ms)
{
    pthread_mutex_lock(&s->mu);
    if (!s->started || s->shutting) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->shutting = true;
    pthread_mutex_unlock(&s->mu);

    /* 1. Stop taking calls; let those in flight run for the grace period. */
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
    int64_t until = kvf_now_ns() + (grace_ms > 0 ? grace_ms : 0) * 1000000;
    pthread_mutex_lock(&s->mu);
    while (!s->shutdown_done && s->live_calls > 0 && kvf_now_ns() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10 * 1000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
    /* 2. Cancel the rest: handlers see is_cancelled and failing writes, and finish. */
    grpc_server_cancel_all_calls(s->server);
    pthread_mutex_lock(&s->mu);
    while (!s->shutdown_done || s->live_calls > 0)
        pthread_cond_wait(&s->cv, &s->mu);
    /* 3. Stop the pool (the queue is empty: every call has finished). */
    s->pool_stop = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->n_workers; i++)
        pthread_join(s->workers[i], NULL);
    s->n_workers = 0;
    s->shut = true;
    kvf_log(KVF_LOG_DEBUG, "rpc: server on port %d shut down", s->port);
}

void kvf_rpc_server_destroy(kvf_rpc_server *s)
{
    if (!s)
        return;
    bool had_poller = s->started;
    kvf_rpc_server_shutdown(s, 0);
    if (!had_poller && !s->shutdown_done) {
        /* Never started, but a port may be bound: gRPC wants a shutdown before destroy. */
        grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
        for (;;) {
            grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                       NULL);
            if (ev.type != GRPC_OP_COMPLETE || ev.tag == &s->shutdown_tag)
                break;
            ((rpc_tag *)ev.tag)->fn(ev.tag, ev.success != 0);
        }
    }
    grpc_server_destroy(s->server);
    grpc_completion_queue_shutdown(s->cq);
    if (had_poller)
        pthread_join(s->poller, NULL);
    else
        kvf_rpc_cq_poll(s->cq); /* drain: nothing was ever requested */
    grpc_completion_queue_destroy(s->cq);
    for (int i = 0; i < s->n_methods; i++) {
        free(s->methods[i].name);
        if (s->methods[i].ctx_free)
            s->methods[i].ctx_free(s->methods[i].ctx);
    }
    tls_free(s->tls); /* after the server: its fetcher is gone with it */
    free(s->workers);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    grpc_shutdown();
}
