/* xfer_cudaipc.c: the "cuda_ipc" backend: GPU to GPU between processes on one node. The
 * receiver's descriptor carries the CUDA IPC handle of its pool (one device allocation) and its
 * notice channel address; the sender maps the pool once per peer and writes each run of
 * adjacent blocks with one device copy on the GPU table's stream, waits for a mark after them
 * (polled from kvf_xfer_progress), then sends a notice over the channel (xfer_chan.c); the
 * receiver turns it into RECEIVED and answers with an acknowledgement that ends the write. No
 * CUDA header here: every GPU call goes through kvf_xfer_gpu (cuda/xfer_gpu.h implements it).
 *
 * Failure: a channel that closes or fails makes the peer KVF_ERR_PEER_LOST and ends its writes
 * with that status (once their copies, which only touch mapped memory, are done); a write not
 * acknowledged by its deadline ends KVF_ERR_TIMEOUT. As with UCX puts, bytes of a write whose
 * receiver already gave up may still land in its blocks: cancel the sender before reuse. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "transport/xfer_impl.h"

typedef struct ipc_peer {
    kvf_xfer_peer *pub;
    void *remote_base; /* the peer's pool, mapped here */
    kvf_xfer_conn *conn; /* NULL once closed */
    bool lost;
} ipc_peer;

typedef struct ipc_send {
    uint64_t id;
    kvf_xfer_token token; /* carried by the notice */
    ipc_peer *peer; /* NULL once disconnected */
    int64_t deadline_ns;
    void *mark;       /* after the copies; NULL once done */
    bool notice_sent, acked;
    kvf_status status; /* first failure, or the acknowledgement's verdict */
    struct ipc_send *next;
} ipc_send;

typedef struct ipc_xfer {
    kvf_xfer *x;
    const kvf_xfer_gpu *gpu;
    kvf_xfer_chan *chan;
    uint8_t handle[KVF_XFER_IPC_HANDLE_BYTES];
    ipc_send *sends;
} ipc_xfer;

static void send_fail(ipc_send *s, kvf_status st)
{
    if (s->status == KVF_OK)
        s->status = st;
}

/* Channel messages: notices (we receive), acknowledgements (we send), closed connections. */
static void on_msg(void *arg, kvf_xfer_conn *conn, const kvf_xfer_msg *m)
{
    ipc_xfer *u = arg;
    ipc_peer *p = kvf_xfer_conn_user(conn);
    switch (m->type) {
    case KVF_XFER_MSG_NOTICE: {
        /* The sender's copies into our pool are complete: RECEIVED, and tell it whether anyone
         * was still waiting (else its blocks may have been reused: it ends CANCELLED). */
        bool delivered = kvf_xfer_notice(u->x, m->id, m->token, KVF_OK);
        kvf_xfer_msg ack = {.type = KVF_XFER_MSG_ACK, .id = m->id,
                            .status = delivered ? KVF_OK : KVF_ERR_CANCELLED};
        kvf_xfer_chan_send(conn, &ack);
        break;
    }
    case KVF_XFER_MSG_ACK:
        for (ipc_send *s = u->sends; s; s = s->next)
            if (s->id == m->id && s->peer == p && s->notice_sent && !s->acked) {
                s->acked = true;
                if (m->status != KVF_OK)
                    send_fail(s, (kvf_status)m->status);
                break;
            }
        break;
    case KVF_XFER_MSG_CLOSED:
        if (p) {
            p->conn = NULL;
            p->lost = true;
            p->pub->status = KVF_ERR_PEER_LOST;
            kvf_log(KVF_LOG_WARN, "xfer: cuda_ipc: notice channel to a peer closed: peer lost");
        }
        break;
    default:
        kvf_log(KVF_LOG_WARN, "xfer: cuda_ipc: unexpected channel message %u: ignored", m->type);
    }
}

static kvf_status ipc_open_x(kvf_xfer *x, const kvf_xfer_cfg *cfg, kvf_err *err)
{
    const kvf_xfer_gpu *g = cfg->gpu;
    if (!g->ipc_export || !g->ipc_open || !g->ipc_close)
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: cuda_ipc: GPU ops table '%s' has no IPC "
                           "ops (ipc_export, ipc_open, ipc_close)", g->name ? g->name : "?");
    ipc_xfer *u = calloc(1, sizeof *u);
    if (!u)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: cuda_ipc: out of memory");
    u->x = x;
    u->gpu = g;
    kvf_status st = g->ipc_export(g->ctx, x->pool.base, u->handle, err);
    if (st != KVF_OK) {
        kvf_err_prefix(err, "xfer: cuda_ipc: exporting the pool (base must be the start of one "
                            "device allocation)");
        free(u);
        return st;
    }
    if ((st = kvf_xfer_chan_open(cfg->notice_host, on_msg, u, &u->chan, err)) != KVF_OK) {
        free(u);
        return st;
    }
    x->impl = u;
    return KVF_OK;
}

static void ipc_close_x(kvf_xfer *x)
{
    ipc_xfer *u = x->impl;
    kvf_err e = {0};
    if (u->sends && u->gpu->sync(u->gpu->ctx, &e) != KVF_OK)
        kvf_log(KVF_LOG_WARN, "xfer: cuda_ipc: waiting for copies at close: %s", e.msg);
    while (u->sends) {
        ipc_send *s = u->sends;
        u->sends = s->next;
        if (s->mark)
            u->gpu->mark_free(u->gpu->ctx, s->mark);
        free(s);
    }
    kvf_xfer_chan_close(u->chan);
    free(u);
}

/* Blob: handle[64] | u64 pid | notice address (kvf_xfer_chan_export). */
static kvf_status ipc_export_blob(kvf_xfer *x, kvf_sbuf *out, kvf_err *err)
{
    ipc_xfer *u = x->impl;
    kvf_sbuf_append(out, u->handle, sizeof u->handle);
    kvf_xfer_put_u64(out, (uint64_t)getpid());
    kvf_xfer_chan_export(u->chan, out);
    return out->oom ? kvf_err_set(err, KVF_ERR_NOMEM, "xfer: cuda_ipc: out of memory") : KVF_OK;
}

static kvf_status ipc_connect(kvf_xfer *x, kvf_xfer_peer *pub, const uint8_t *blob,
                              size_t blob_len, kvf_err *err)
{
    ipc_xfer *u = x->impl;
    if (blob_len < KVF_XFER_IPC_HANDLE_BYTES + 8 + 3)
        return kvf_err_set(err, KVF_ERR_PARSE, "xfer: cuda_ipc: descriptor blob of %zu bytes is "
                           "too short (at least %d)", blob_len, KVF_XFER_IPC_HANDLE_BYTES + 11);
    uint64_t pid = kvf_xfer_get_u64(blob + KVF_XFER_IPC_HANDLE_BYTES);
    if (pid == (uint64_t)getpid())
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: cuda_ipc: the descriptor is from this "
                           "process (%d); CUDA IPC maps another process's memory (use local "
                           "within one process)", (int)getpid());
    ipc_peer *p = calloc(1, sizeof *p);
    if (!p)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: cuda_ipc: out of memory");
    p->pub = pub;
    const uint8_t *addr = blob + KVF_XFER_IPC_HANDLE_BYTES + 8;
    size_t addr_len = blob_len - KVF_XFER_IPC_HANDLE_BYTES - 8, used = 0;
    kvf_status st = kvf_xfer_chan_connect(u->chan, addr, addr_len, &used, &p->conn, err);
    if (st == KVF_OK && used != addr_len)
        st = kvf_err_set(err, KVF_ERR_PARSE, "xfer: cuda_ipc: descriptor blob has %zu bytes "
                         "after the notice address", addr_len - used);
    if (st != KVF_OK) {
        if (p->conn)
            kvf_xfer_chan_drop(u->chan, p->conn);
        free(p);
        return st;
    }
    kvf_xfer_conn_set_user(p->conn, p);
    if ((st = u->gpu->ipc_open(u->gpu->ctx, blob, &p->remote_base, err)) != KVF_OK) {
        kvf_err_prefix(err, "xfer: cuda_ipc: opening the peer's pool handle");
        kvf_xfer_chan_drop(u->chan, p->conn);
        free(p);
        return st;
    }
    pub->impl = p;
    pub->status = KVF_ERR_BUSY; /* until the channel is up */
    return KVF_OK;
}

static void ipc_disconnect(kvf_xfer *x, kvf_xfer_peer *pub)
{
    ipc_xfer *u = x->impl;
    ipc_peer *p = pub->impl;
    bool copying = false;
    for (ipc_send *s = u->sends; s; s = s->next)
        if (s->peer == p) {
            send_fail(s, KVF_ERR_CANCELLED);
            s->peer = NULL;
            copying |= s->mark != NULL;
        }
    /* Copies into the mapping must be done before it goes (local copies: bounded). */
    kvf_err e = {0};
    if (copying && u->gpu->sync(u->gpu->ctx, &e) != KVF_OK)
        kvf_log(KVF_LOG_WARN, "xfer: cuda_ipc: waiting for copies at disconnect: %s", e.msg);
    u->gpu->ipc_close(u->gpu->ctx, p->remote_base);
    if (p->conn)
        kvf_xfer_chan_drop(u->chan, p->conn);
    free(p);
}

static kvf_status ipc_write(kvf_xfer *x, kvf_xfer_peer *pub, uint64_t id,
                            const kvf_xfer_token *token, const kvf_xfer_run *runs, size_t n_runs,
                            int64_t deadline_ns, kvf_err *err)
{
    ipc_xfer *u = x->impl;
    ipc_peer *p = pub->impl;
    const kvf_xfer_gpu *g = u->gpu;
    if (p->lost)
        return kvf_err_set(err, KVF_ERR_PEER_LOST, "xfer: write %llu: peer was lost (connect "
                           "again)", (unsigned long long)id);
    for (ipc_send *s = u->sends; s; s = s->next)
        if (s->id == id)
            return kvf_err_set(err, KVF_ERR_EXISTS, "xfer: write %llu: this id is already in "
                               "flight", (unsigned long long)id);
    ipc_send *s = calloc(1, sizeof *s);
    if (!s)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: write %llu: out of memory",
                           (unsigned long long)id);
    int64_t bb = x->pool.layout.block_bytes;
    char *src = x->pool.base, *dst = p->remote_base;
    kvf_status st = KVF_OK;
    /* One device copy per run, in order on one stream; the mark says when all are done. */
    for (size_t i = 0; i < n_runs && st == KVF_OK; i++)
        st = g->copy_async(g->ctx, dst + runs[i].dst * bb, src + runs[i].src * bb,
                           (size_t)(runs[i].count * bb), err);
    if (st == KVF_OK)
        st = g->mark(g->ctx, &s->mark, err);
    if (st != KVF_OK) {
        kvf_err e = {0};
        g->sync(g->ctx, &e); /* what was enqueued reads our blocks: let it finish */
        free(s);
        kvf_err_prefix(err, "xfer: write %llu: cuda_ipc copy", (unsigned long long)id);
        return st;
    }
    s->id = id;
    s->token = *token;
    s->peer = p;
    s->deadline_ns = deadline_ns;
    s->status = KVF_OK;
    s->next = u->sends;
    u->sends = s;
    return KVF_OK;
}

static kvf_status ipc_cancel(kvf_xfer *x, uint64_t id)
{
    ipc_xfer *u = x->impl;
    for (ipc_send *s = u->sends; s; s = s->next)
        if (s->id == id) {
            if (s->notice_sent && s->status == KVF_OK)
                return KVF_ERR_STATE; /* the receiver was told already: wait for the event */
            send_fail(s, KVF_ERR_CANCELLED);
            return KVF_OK;
        }
    return KVF_ERR_NOT_FOUND;
}

static void ipc_progress(kvf_xfer *x)
{
    ipc_xfer *u = x->impl;
    kvf_xfer_chan_progress(u->chan);
    for (kvf_xfer_peer *pub = x->peers; pub; pub = pub->next) {
        ipc_peer *p = pub->impl;
        if (pub->status == KVF_ERR_BUSY && p->conn && kvf_xfer_conn_up(p->conn))
            pub->status = KVF_OK;
    }
    int64_t now = u->sends ? kvf_now_ns() : 0;
    for (ipc_send **pp = &u->sends; *pp;) {
        ipc_send *s = *pp;
        if (s->mark) {
            kvf_err e = {0};
            kvf_status st = u->gpu->mark_query(u->gpu->ctx, s->mark, &e);
            if (st == KVF_ERR_BUSY) { /* the copies still read our blocks: nothing can end */
                pp = &s->next;
                continue;
            }
            u->gpu->mark_free(u->gpu->ctx, s->mark);
            s->mark = NULL;
            if (st != KVF_OK) {
                kvf_log(KVF_LOG_ERROR, "xfer: write %llu: cuda_ipc copy failed: %s",
                        (unsigned long long)s->id, e.msg);
                send_fail(s, st);
            }
        }
        ipc_peer *p = s->peer;
        if (s->status == KVF_OK && (!p || p->lost))
            send_fail(s, p ? KVF_ERR_PEER_LOST : KVF_ERR_CANCELLED);
        if (s->status == KVF_OK && !s->notice_sent && p->conn && kvf_xfer_conn_up(p->conn)) {
            kvf_xfer_msg m = {.type = KVF_XFER_MSG_NOTICE, .id = s->id};
            memcpy(m.token, s->token.b, sizeof m.token);
            if (kvf_xfer_chan_send(p->conn, &m))
                s->notice_sent = true;
            else
                send_fail(s, KVF_ERR_PEER_LOST);
        }
        if (s->status == KVF_OK && !s->acked && now >= s->deadline_ns) {
            kvf_log(KVF_LOG_WARN, "xfer: write %llu: no acknowledgement by its deadline",
                    (unsigned long long)s->id);
            send_fail(s, KVF_ERR_TIMEOUT);
        }
        if (s->status != KVF_OK || s->acked) {
            *pp = s->next;
            kvf_xfer_sent(x, s->id, s->status);
            free(s);
            continue;
        }
        pp = &s->next;
    }
    /* Notices queued above go out now rather than on the next pass. */
    if (kvf_xfer_chan_busy(u->chan))
        kvf_xfer_chan_progress(u->chan);
}

static int ipc_event_fd(kvf_xfer *x)
{
    return kvf_xfer_chan_fd(((ipc_xfer *)x->impl)->chan);
}

static bool ipc_arm(kvf_xfer *x)
{
    ipc_xfer *u = x->impl;
    for (ipc_send *s = u->sends; s; s = s->next)
        if (s->mark)
            return false; /* copies are polled */
    return !kvf_xfer_chan_busy(u->chan);
}

const kvf_xfer_ops kvf_xfer_cudaipc_ops = {
    .name = "cuda_ipc",
    .open = ipc_open_x,
    .close = ipc_close_x,
    .export_blob = ipc_export_blob,
    .connect = ipc_connect,
    .disconnect = ipc_disconnect,
    .write = ipc_write,
    .cancel = ipc_cancel,
    .progress = ipc_progress,
    .event_fd = ipc_event_fd,
    .arm = ipc_arm,
    .needs_gpu = true,
};
