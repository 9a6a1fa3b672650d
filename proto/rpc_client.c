/* rpc_client.c: the async RPC client over gRPC C core. A channel owns one completion queue and
 * the thread that polls it; unary calls complete through a callback on that thread (the blocking
 * call waits for it), streams read ahead into a small queue that kvf_rpc_stream_read drains
 * and, when asked (kvf_rpc_stream_notify), wake their reader as messages arrive.
 * Every call with gRPC operations in flight is on the channel's list, so destroying the channel
 * can cancel them and wait. */
#include "proto/rpc_internal.h"

#include <errno.h>
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

#define RPC_STREAM_READ_AHEAD 64 /* messages a stream holds before it stops asking for more */

/* A call with gRPC operations in flight, on its channel's list. */
typedef struct rpc_live {
    struct rpc_live *prev, *next;
    grpc_call *call;
} rpc_live;

/* A grpc_channel replaced after a TLS reload: calls made on it keep it alive inside gRPC; this
 * side releases it with the kvf_rpc_channel. */
typedef struct retired {
    grpc_channel *channel;
    struct retired *next;
} retired;

struct kvf_rpc_channel {
    grpc_channel *channel; /* mu: replaced when TLS files are reloaded */
    kvf_rpc_tls tls;       /* copies of the file names (tls_on) */
    bool tls_on;
    uint64_t tls_gen;      /* the generation channel was made with */
    int64_t keepalive_ms;
    retired *retired;
    grpc_completion_queue *cq;
    pthread_t poller;
    int64_t max_msg;
    char *target;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rpc_live live; /* list head */
    int n_live;
};

/* ---- shared call plumbing ---- */

static void live_add(kvf_rpc_channel *ch, rpc_live *l, grpc_call *call)
{
    l->call = call;
    pthread_mutex_lock(&ch->mu);
    l->next = ch->live.next;
    l->prev = &ch->live;
    ch->live.next->prev = l;
    ch->live.next = l;
    ch->n_live++;
    pthread_mutex_unlock(&ch->mu);
}

static void live_remove(kvf_rpc_channel *ch, rpc_live *l)
{
    pthread_mutex_lock(&ch->mu);
    l->prev->next = l->next;
    l->next->prev = l->prev;
    ch->n_live--;
    pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
}

static grpc_channel *channel_make(kvf_rpc_channel *ch, kvf_err *err);

static grpc_call *call_create(kvf_rpc_channel *ch, const char *method, int64_t timeout_ms)
{
    pthread_mutex_lock(&ch->mu);
    uint64_t g = kvf_rpc_tls_generation();
    if (ch->tls_on && g != ch->tls_gen) {
        /* TLS files reloaded: later calls go over a connection made with the new files */
        kvf_err err = {0};
        grpc_channel *nc = channel_make(ch, &err);
        retired *r = nc ? malloc(sizeof *r) : NULL;
        if (r) {
            r->channel = ch->channel;
            r->next = ch->retired;
            ch->retired = r;
            ch->channel = nc;
            kvf_log(KVF_LOG_INFO, "rpc: channel to %s: TLS files reloaded", ch->target);
        } else {
            if (nc)
                grpc_channel_destroy(nc);
            kvf_log(KVF_LOG_ERROR, "rpc: channel to %s: TLS reload failed, the previous files "
                    "stay in use: %s", ch->target, nc ? "out of memory" : err.msg);
        }
        ch->tls_gen = g; /* one try per reload */
    }
    grpc_slice m = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, ch->cq,
                                               m, NULL, kvf_rpc_deadline_from_ms(timeout_ms), NULL);
    pthread_mutex_unlock(&ch->mu);
    grpc_slice_unref(m);
    return call;
}

/* The final status of a call as a kvf_status and a message: the exact kvf_status from the
 * server's trailing metadata when present, else the mapping of the gRPC code. */
/* What every client call does first: checks the method name and the request size, copies both
 * and creates the call. The caller frees *method_out and *bb_out (and the call) on failure. */
static kvf_status call_prepare(kvf_rpc_channel *ch, const char *method, const void *req, size_t len,
                               int64_t timeout_ms, char **method_out, grpc_byte_buffer **bb_out,
                               grpc_call **call_out, kvf_err *err)
{
    *method_out = strdup(method);
    *bb_out = kvf_rpc_bb_from(req, len);
    if (!*method_out || !*bb_out)
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: %s: out of memory", method);
    *call_out = call_create(ch, method, timeout_ms);
    if (!*call_out)
        return kvf_err_set(err, KVF_ERR_INTERNAL, "rpc: %s: gRPC could not create the call", method);
    return KVF_OK;
}

static kvf_status request_check(const kvf_rpc_channel *ch, const char *method, size_t len, kvf_err *err)
{
    if (!method || method[0] != '/')
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: method name \"%s\" does not start with "
                           "'/'", method ? method : "(null)");
    if ((int64_t)len > ch->max_msg)
        return kvf_err_set(err, KVF_ERR_LIMIT, "rpc: %s: request of %zu bytes is over the "
                           "limit of %lld bytes", method, len, (long long)ch->max_msg);
    return KVF_OK;
}

/* The four ops that open a client call: send metadata, the one request, close; receive the
 * server's metadata. */
static void send_ops(grpc_op ops[4], grpc_byte_buffer *bb, grpc_metadata_array *initial_md)
{
    memset(ops, 0, 4 * sizeof *ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = initial_md;
}

static void status_op(grpc_op *op, grpc_metadata_array *trailing_md, grpc_status_code *code,
                      grpc_slice *details)
{
    memset(op, 0, sizeof *op);
    op->op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op->data.recv_status_on_client.trailing_metadata = trailing_md;
    op->data.recv_status_on_client.status = code;
    op->data.recv_status_on_client.status_details = details;
}

/* The kvf-status trailer the server attaches to every status it sends, or NULL: gRPC's own
 * statuses (a passed deadline, a lost connection, a cancel, a server shutting down) carry none. */
static const grpc_metadata *kvf_status_md(const grpc_metadata_array *trailing)
{
    for (size_t i = 0; i < trailing->count; i++)
        if (grpc_slice_str_cmp(trailing->metadata[i].key, RPC_KVF_STATUS_KEY) == 0)
            return &trailing->metadata[i];
    return NULL;
}

/* True when the server's side of kvfleet ended the call (OK, or its kvf-status trailer). */
static bool ended_by_server(grpc_status_code code, const grpc_metadata_array *trailing)
{
    return code == GRPC_STATUS_OK || kvf_status_md(trailing) != NULL;
}

static kvf_status status_of(const char *method, grpc_status_code code, grpc_slice details,
                            const grpc_metadata_array *trailing, kvf_err *err)
{
    if (code == GRPC_STATUS_OK)
        return KVF_OK;
    kvf_status st = kvf_status_from_grpc(code);
    const grpc_metadata *md = kvf_status_md(trailing);
    char buf[16];
    size_t n = md ? GRPC_SLICE_LENGTH(md->value) : 0;
    if (n > 0 && n < sizeof buf) {
        memcpy(buf, GRPC_SLICE_START_PTR(md->value), n);
        buf[n] = '\0';
        char *end;
        long v = strtol(buf, &end, 10);
        /* Only codes this build knows, and never OK on a failed call. */
        if (*end == '\0' && v != 0 && strcmp(kvf_status_name((kvf_status)v), "UNKNOWN") != 0)
            st = (kvf_status)v;
    }
    char *text = grpc_slice_to_c_string(details);
    kvf_err_set(err, st, "rpc: %s: %s (%s)", method, text && *text ? text : kvf_status_str(st),
                kvf_rpc_grpc_code_name(code));
    gpr_free(text);
    return st;
}

/* ---- unary calls ---- */

typedef struct rpc_unary {
    rpc_tag tag;
    rpc_live live;
    kvf_rpc_channel *ch;
    char *method;
    grpc_call *call;
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_metadata_array initial_md, trailing_md;
    grpc_status_code code;
    grpc_slice details;
    kvf_rpc_unary_done_fn done;
    void *arg;
} rpc_unary;

static void unary_free(rpc_unary *u)
{
    if (u->send_bb)
        grpc_byte_buffer_destroy(u->send_bb);
    if (u->recv_bb)
        grpc_byte_buffer_destroy(u->recv_bb);
    grpc_metadata_array_destroy(&u->initial_md);
    grpc_metadata_array_destroy(&u->trailing_md);
    grpc_slice_unref(u->details);
    if (u->call)
        grpc_call_unref(u->call);
    free(u->method);
    free(u);
}

static void on_unary_done(rpc_tag *t, bool ok)
{
    rpc_unary *u = RPC_CONTAINER_OF(t, rpc_unary, tag);
    kvf_err e;
    kvf_err_clear(&e);
    kvf_rpc_buf resp = {0};
    kvf_status st;
    if (!ok)
        st = kvf_err_set(&e, KVF_ERR_INTERNAL, "rpc: %s: the call's operations failed",
                         u->method);
    else if ((st = status_of(u->method, u->code, u->details, &u->trailing_md, &e)) != KVF_OK)
        ;
    else if (!u->recv_bb)
        st = kvf_err_set(&e, KVF_ERR_PARSE, "rpc: %s: the server sent no response message",
                         u->method);
    else if ((st = kvf_rpc_bb_read(u->recv_bb, &resp, &e)) != KVF_OK)
        kvf_err_prefix(&e, "rpc: %s", u->method);
    u->done(u->arg, st, resp.data, resp.len, st == KVF_OK ? NULL : e.msg,
            ok && ended_by_server(u->code, &u->trailing_md));
    kvf_rpc_buf_free(&resp);
    live_remove(u->ch, &u->live);
    unary_free(u);
}

kvf_status kvf_rpc_unary_async(kvf_rpc_channel *ch, const char *method, const void *req,
                               size_t len, int64_t timeout_ms, kvf_rpc_unary_done_fn done,
                               void *arg, kvf_err *err)
{
    kvf_status cst = request_check(ch, method, len, err);
    if (cst != KVF_OK)
        return cst;
    rpc_unary *u = calloc(1, sizeof *u);
    if (!u)
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: %s: out of memory", method);
    u->tag.fn = on_unary_done;
    u->ch = ch;
    u->done = done;
    u->arg = arg;
    u->details = grpc_empty_slice();
    grpc_metadata_array_init(&u->initial_md);
    grpc_metadata_array_init(&u->trailing_md);
    if ((cst = call_prepare(ch, method, req, len, timeout_ms, &u->method, &u->send_bb, &u->call, err)) != KVF_OK) {
        unary_free(u);
        return cst;
    }
    grpc_op ops[6];
    send_ops(ops, u->send_bb, &u->initial_md);
    memset(&ops[4], 0, sizeof ops[4]);
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &u->recv_bb;
    status_op(&ops[5], &u->trailing_md, &u->code, &u->details);
    live_add(ch, &u->live, u->call);
    grpc_call_error e = grpc_call_start_batch(u->call, ops, 6, &u->tag, NULL);
    if (e != GRPC_CALL_OK) {
        live_remove(ch, &u->live);
        unary_free(u);
        return kvf_err_set(err, KVF_ERR_INTERNAL, "rpc: %s: gRPC refused the call (error %d)",
                           method, (int)e);
    }
    return KVF_OK;
}

typedef struct rpc_wait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    kvf_status st;
    kvf_rpc_buf resp;
    char msg[KVF_ERR_MSG_MAX];
} rpc_wait;

static void on_blocking_done(void *arg, kvf_status st, const uint8_t *resp, size_t len,
                             const char *msg, bool by_server)
{
    rpc_wait *w = arg;
    (void)by_server;
    pthread_mutex_lock(&w->mu);
    w->st = st;
    if (st == KVF_OK) {
        w->resp.data = malloc(len ? len : 1);
        if (w->resp.data) {
            if (len)
                memcpy(w->resp.data, resp, len);
            w->resp.len = len;
        } else {
            w->st = KVF_ERR_NOMEM;
            snprintf(w->msg, sizeof w->msg, "rpc: no memory for a %zu-byte response", len);
        }
    } else {
        snprintf(w->msg, sizeof w->msg, "%s", msg ? msg : kvf_status_str(st));
    }
    w->done = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

kvf_status kvf_rpc_unary(kvf_rpc_channel *ch, const char *method, const void *req, size_t len,
                         int64_t timeout_ms, kvf_rpc_buf *resp_out, kvf_err *err)
{
    rpc_wait w;
    memset(&w, 0, sizeof w);
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    kvf_status st = kvf_rpc_unary_async(ch, method, req, len, timeout_ms, on_blocking_done, &w,
                                        err);
    if (st == KVF_OK) {
        pthread_mutex_lock(&w.mu);
        while (!w.done)
            pthread_cond_wait(&w.cv, &w.mu);
        pthread_mutex_unlock(&w.mu);
        st = w.st;
        if (st == KVF_OK)
            *resp_out = w.resp;
        else
            kvf_err_set(err, st, "%s", w.msg);
    }
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    return st;
}

/* ---- server-streaming calls ---- */

struct kvf_rpc_stream {
    rpc_live live;
    kvf_rpc_channel *ch;
    char *method;
    grpc_call *call;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* the user + each batch in flight */
    int ops;  /* batches in flight */
    rpc_tag send_tag, recv_tag, status_tag;
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_metadata_array initial_md, trailing_md;
    grpc_status_code code;
    grpc_slice details;
    bool recv_pending, eom, status_done;
    kvf_status final_st;
    kvf_err final_err;
    kvf_rpc_buf q[RPC_STREAM_READ_AHEAD];
    size_t q_head, q_len;
    void (*notify)(void *arg); /* kvf_rpc_stream_notify: called under mu */
    void *notify_arg;
};

static void stream_free(kvf_rpc_stream *s)
{
    while (s->q_len) {
        kvf_rpc_buf_free(&s->q[s->q_head]);
        s->q_head = (s->q_head + 1) % RPC_STREAM_READ_AHEAD;
        s->q_len--;
    }
    if (s->send_bb)
        grpc_byte_buffer_destroy(s->send_bb);
    if (s->recv_bb)
        grpc_byte_buffer_destroy(s->recv_bb);
    grpc_metadata_array_destroy(&s->initial_md);
    grpc_metadata_array_destroy(&s->trailing_md);
    grpc_slice_unref(s->details);
    if (s->call)
        grpc_call_unref(s->call);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s->method);
    free(s);
}

/* Called with s->mu held, after a batch completed: drops its references. Returns true when the
 * stream must be freed (after unlocking). */
static bool stream_op_done_locked(kvf_rpc_stream *s, bool *off_list)
{
    s->ops--;
    *off_list = s->ops == 0;
    return --s->refs == 0;
}

/* Unlocks s->mu. The list is changed under s->mu (then the channel's lock), so a recv posted
 * by a reader cannot race with this removal. */
static void stream_op_finish(kvf_rpc_stream *s)
{
    bool off_list;
    bool free_it = stream_op_done_locked(s, &off_list);
    if (off_list)
        live_remove(s->ch, &s->live);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (free_it)
        stream_free(s);
}

/* Tells the reader that something may be readable; s->mu held. */
static void stream_notify_locked(kvf_rpc_stream *s)
{
    if (s->notify)
        s->notify(s->notify_arg);
}

/* Asks for the next message; s->mu held. */
static void stream_post_recv_locked(kvf_rpc_stream *s)
{
    if (s->recv_pending || s->eom || s->q_len >= RPC_STREAM_READ_AHEAD)
        return;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &s->recv_bb;
    bool first = s->ops == 0;
    s->ops++;
    s->refs++;
    s->recv_pending = true;
    if (first)
        live_add(s->ch, &s->live, s->call); /* cannot happen while the status is pending */
    if (grpc_call_start_batch(s->call, &op, 1, &s->recv_tag, NULL) != GRPC_CALL_OK) {
        s->ops--;
        s->refs--;
        s->recv_pending = false;
        s->eom = true;
        if (first)
            live_remove(s->ch, &s->live);
    }
}

static void on_stream_send(rpc_tag *t, bool ok)
{
    kvf_rpc_stream *s = RPC_CONTAINER_OF(t, kvf_rpc_stream, send_tag);
    pthread_mutex_lock(&s->mu);
    stream_op_finish(s);
}

static void on_stream_recv(rpc_tag *t, bool ok)
{
    kvf_rpc_stream *s = RPC_CONTAINER_OF(t, kvf_rpc_stream, recv_tag);
    pthread_mutex_lock(&s->mu);
    s->recv_pending = false;
    if (!ok || !s->recv_bb) {
        s->eom = true;
    } else {
        kvf_rpc_buf b = {0};
        kvf_err e;
        kvf_status st = kvf_rpc_bb_read(s->recv_bb, &b, &e);
        grpc_byte_buffer_destroy(s->recv_bb);
        s->recv_bb = NULL;
        if (st == KVF_OK) {
            s->q[(s->q_head + s->q_len) % RPC_STREAM_READ_AHEAD] = b;
            s->q_len++;
            stream_post_recv_locked(s);
        } else {
            kvf_log(KVF_LOG_WARN, "rpc: %s: %s; cancelling the stream", s->method, e.msg);
            grpc_call_cancel(s->call, NULL);
            s->eom = true;
        }
    }
    stream_notify_locked(s);
    stream_op_finish(s);
}

static void on_stream_status(rpc_tag *t, bool ok)
{
    kvf_rpc_stream *s = RPC_CONTAINER_OF(t, kvf_rpc_stream, status_tag);
    pthread_mutex_lock(&s->mu);
    kvf_err_clear(&s->final_err);
    if (ok)
        s->final_st = status_of(s->method, s->code, s->details, &s->trailing_md, &s->final_err);
    else
        s->final_st = kvf_err_set(&s->final_err, KVF_ERR_INTERNAL,
                                  "rpc: %s: the status operation failed", s->method);
    s->status_done = true;
    stream_post_recv_locked(s); /* collect what is left, up to the end marker */
    stream_notify_locked(s);
    stream_op_finish(s);
}

kvf_status kvf_rpc_stream_open(kvf_rpc_channel *ch, const char *method, const void *req,
                               size_t len, int64_t timeout_ms, kvf_rpc_stream **out,
                               kvf_err *err)
{
    kvf_status cst = request_check(ch, method, len, err);
    if (cst != KVF_OK)
        return cst;
    kvf_rpc_stream *s = calloc(1, sizeof *s);
    if (!s)
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: %s: out of memory", method);
    s->ch = ch;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->send_tag.fn = on_stream_send;
    s->recv_tag.fn = on_stream_recv;
    s->status_tag.fn = on_stream_status;
    s->details = grpc_empty_slice();
    grpc_metadata_array_init(&s->initial_md);
    grpc_metadata_array_init(&s->trailing_md);
    if ((cst = call_prepare(ch, method, req, len, timeout_ms, &s->method, &s->send_bb, &s->call, err)) != KVF_OK) {
        stream_free(s);
        return cst;
    }
    grpc_op ops[4];
    send_ops(ops, s->send_bb, &s->initial_md);
    grpc_op st_op;
    status_op(&st_op, &s->trailing_md, &s->code, &s->details);

    s->refs = 1 + 2; /* the user, send, status (recv adds its own) */
    s->ops = 2;
    pthread_mutex_lock(&s->mu);
    live_add(ch, &s->live, s->call);
    grpc_call_error e1 = grpc_call_start_batch(s->call, ops, 4, &s->send_tag, NULL);
    grpc_call_error e2 = e1 == GRPC_CALL_OK
                             ? grpc_call_start_batch(s->call, &st_op, 1, &s->status_tag, NULL)
                             : e1;
    if (e1 != GRPC_CALL_OK || e2 != GRPC_CALL_OK) {
        if (e1 == GRPC_CALL_OK) {
            /* The send batch is in flight: cancel and let its completion drop its reference. */
            grpc_call_cancel(s->call, NULL);
            s->ops--;
            s->refs--;
            s->status_done = true;
            s->eom = true;
            s->final_st = KVF_ERR_INTERNAL;
            pthread_mutex_unlock(&s->mu);
            kvf_rpc_stream_destroy(s);
        } else {
            live_remove(ch, &s->live);
            pthread_mutex_unlock(&s->mu);
            stream_free(s);
        }
        return kvf_err_set(err, KVF_ERR_INTERNAL, "rpc: %s: gRPC refused the call (error %d)",
                           method, (int)(e1 != GRPC_CALL_OK ? e1 : e2));
    }
    stream_post_recv_locked(s);
    pthread_mutex_unlock(&s->mu);
    *out = s;
    return KVF_OK;
}

kvf_status kvf_rpc_stream_read(kvf_rpc_stream *s, int64_t timeout_ms, kvf_rpc_buf *msg_out,
                               bool *done_out, kvf_err *err)
{
    int64_t until = timeout_ms == KVF_RPC_NO_DEADLINE ? INT64_MAX
                                                      : kvf_now_ns() + timeout_ms * 1000000;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        if (s->q_len) {
            *msg_out = s->q[s->q_head];
            s->q[s->q_head] = (kvf_rpc_buf){0};
            s->q_head = (s->q_head + 1) % RPC_STREAM_READ_AHEAD;
            s->q_len--;
            stream_post_recv_locked(s);
            pthread_mutex_unlock(&s->mu);
            *done_out = false;
            return KVF_OK;
        }
        if (s->eom && s->status_done && !s->recv_pending) {
            kvf_status st = s->final_st;
            if (st != KVF_OK && err)
                *err = s->final_err;
            pthread_mutex_unlock(&s->mu);
            *done_out = true;
            return st;
        }
        stream_post_recv_locked(s);
        int64_t now = kvf_now_ns();
        if (now >= until) {
            pthread_mutex_unlock(&s->mu);
            *done_out = false;
            return kvf_err_set(err, KVF_ERR_TIMEOUT, "rpc: %s: no message within %lld ms",
                               s->method, (long long)timeout_ms);
        }
        if (until == INT64_MAX) {
            pthread_cond_wait(&s->cv, &s->mu);
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            int64_t left = until - now;
            int64_t ns = ts.tv_nsec + left % 1000000000;
            ts.tv_sec += (time_t)(left / 1000000000 + ns / 1000000000);
            ts.tv_nsec = (long)(ns % 1000000000);
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
    }
}

void kvf_rpc_stream_notify(kvf_rpc_stream *s, void (*fn)(void *arg), void *arg)
{
    pthread_mutex_lock(&s->mu);
    s->notify = fn;
    s->notify_arg = arg;
    if (fn && (s->q_len || (s->eom && s->status_done && !s->recv_pending)))
        fn(arg);
    pthread_mutex_unlock(&s->mu);
}

void kvf_rpc_stream_cancel(kvf_rpc_stream *s)
{
    /* The grpc_call lives as long as the stream, so this is safe at any time. */
    grpc_call_cancel(s->call, NULL);
}

void kvf_rpc_stream_destroy(kvf_rpc_stream *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    if (!s->status_done)
        grpc_call_cancel(s->call, NULL);
    s->notify = NULL; /* the reader is gone: completions still in flight wake nobody */
    bool free_it = --s->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (free_it)
        stream_free(s);
}

/* ---- channels ---- */

static void *channel_poller(void *arg)
{
    kvf_rpc_channel *ch = arg;
    kvf_rpc_cq_poll(ch->cq);
    return NULL;
}

/* A grpc_channel to ch->target with ch's TLS files read now (or plaintext). */
static grpc_channel *channel_make(kvf_rpc_channel *ch, kvf_err *err)
{
    char *ca = NULL, *cert = NULL, *key = NULL;
    grpc_channel_credentials *creds = NULL;
    const kvf_rpc_tls *t = &ch->tls;
    bool own = t->cert_file && *t->cert_file;
    if (!ch->tls_on) {
        creds = grpc_insecure_credentials_create();
    } else if (kvf_rpc_pem_read(t->ca_file, "--tls-ca", &ca, err) == KVF_OK &&
               (!own || (kvf_rpc_pem_read(t->cert_file, "--tls-cert", &cert, err) == KVF_OK &&
                         kvf_rpc_pem_read(t->key_file, "--tls-key", &key, err) == KVF_OK))) {
        grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
        creds = grpc_ssl_credentials_create(ca, own ? &pair : NULL, NULL, NULL);
    }
    free(ca);
    free(cert);
    free(key);
    if (!creds) {
        if (err->status == KVF_OK)
            kvf_err_set(err, KVF_ERR_INTERNAL, "rpc: channel to %s: no credentials", ch->target);
        return NULL;
    }
    rpc_args a;
    kvf_rpc_args_init(&a, ch->max_msg, false, ch->keepalive_ms,
                      ch->tls_on ? t->server_name : NULL);
    grpc_channel *c = grpc_channel_create(ch->target, creds, &a.args);
    grpc_channel_credentials_release(creds);
    if (!c)
        kvf_err_set(err, KVF_ERR_INTERNAL, "rpc: channel to %s: cannot create it", ch->target);
    return c;
}

static char *dup_or_null(const char *s)
{
    return s && *s ? strdup(s) : NULL;
}

static void channel_free(kvf_rpc_channel *ch)
{
    free((char *)ch->tls.cert_file);
    free((char *)ch->tls.key_file);
    free((char *)ch->tls.ca_file);
    free((char *)ch->tls.server_name);
    free(ch->target);
    free(ch);
}

kvf_status kvf_rpc_channel_create(const char *target, const kvf_rpc_channel_opts *opts,
                                  kvf_rpc_channel **out, kvf_err *err)
{
    if (!target || !*target)
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: channel: empty target (want host:port)");
    int64_t max_msg;
    kvf_status st = kvf_rpc_max_msg_check(opts ? opts->max_msg_bytes : 0, "channel", &max_msg, err);
    if (st != KVF_OK)
        return st;
    const kvf_rpc_tls *tls = opts ? opts->tls : NULL;
    bool use_tls = tls && tls->ca_file && *tls->ca_file;
    if (use_tls && (!tls->cert_file || !*tls->cert_file) != (!tls->key_file || !*tls->key_file))
        return kvf_err_set(err, KVF_ERR_INVALID, "rpc: channel to %s: a client certificate needs "
                           "both --tls-cert and --tls-key", target);
    kvf_rpc_channel *ch = calloc(1, sizeof *ch);
    if (!ch || !(ch->target = strdup(target))) {
        free(ch);
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: channel to %s: out of memory", target);
    }
    ch->max_msg = max_msg;
    ch->keepalive_ms = kvf_rpc_keepalive_ms(opts ? opts->keepalive_ms : 0);
    ch->tls_on = use_tls;
    if (use_tls)
        ch->tls = (kvf_rpc_tls){.cert_file = dup_or_null(tls->cert_file),
                                .key_file = dup_or_null(tls->key_file),
                                .ca_file = dup_or_null(tls->ca_file),
                                .server_name = dup_or_null(tls->server_name)};
    ch->tls_gen = kvf_rpc_tls_generation();
    kvf_rpc_grpc_init();
    ch->live.next = ch->live.prev = &ch->live;
    pthread_mutex_init(&ch->mu, NULL);
    pthread_cond_init(&ch->cv, NULL);
    ch->channel = channel_make(ch, err);
    ch->cq = grpc_completion_queue_create_for_next(NULL);
    if (!ch->channel || pthread_create(&ch->poller, NULL, channel_poller, ch) != 0) {
        st = ch->channel ? kvf_err_set(err, KVF_ERR_INTERNAL, "rpc: channel to %s: cannot start "
                                       "its thread", target)
                         : (err->status != KVF_OK ? err->status : KVF_ERR_INTERNAL);
        if (ch->channel)
            grpc_channel_destroy(ch->channel);
        grpc_completion_queue_shutdown(ch->cq);
        kvf_rpc_cq_poll(ch->cq);
        grpc_completion_queue_destroy(ch->cq);
        pthread_mutex_destroy(&ch->mu);
        pthread_cond_destroy(&ch->cv);
        channel_free(ch);
        grpc_shutdown();
        return st;
    }
    *out = ch;
    return KVF_OK;
}

void kvf_rpc_channel_destroy(kvf_rpc_channel *ch)
{
    if (!ch)
        return;
    pthread_mutex_lock(&ch->mu);
    for (rpc_live *l = ch->live.next; l != &ch->live; l = l->next)
        grpc_call_cancel(l->call, NULL);
    while (ch->n_live > 0)
        pthread_cond_wait(&ch->cv, &ch->mu);
    pthread_mutex_unlock(&ch->mu);
    grpc_channel_destroy(ch->channel);
    for (retired *r = ch->retired, *n; r; r = n) {
        n = r->next;
        grpc_channel_destroy(r->channel);
        free(r);
    }
    grpc_completion_queue_shutdown(ch->cq);
    pthread_join(ch->poller, NULL);
    grpc_completion_queue_destroy(ch->cq);
    pthread_mutex_destroy(&ch->mu);
    pthread_cond_destroy(&ch->cv);
    channel_free(ch);
    grpc_shutdown();
}
