/* xfer_nccl.c: the "nccl" backend: GPU to GPU through an NCCL communicator per sender-receiver
 * pair (rank 0 sends, rank 1 receives). The sender's kvf_xfer_connect makes the unique id,
 * starts a non-blocking init and opens the pair's notice channel, whose first message (the
 * hello) carries the id; the receiver starts its own init when the hello arrives. Both inits are
 * progressed from kvf_xfer_progress. A write gathers its runs into stream-ordered
 * device staging (or sends straight from the pool when it is one run), tells the receiver over
 * the notice channel (xfer_chan.c: id, bytes, destination runs), then ncclSend; the receiver
 * posts the matching ncclRecv (into its blocks when they are one run, else staging it scatters
 * from), and once that is done delivers RECEIVED and acknowledges. The only file that includes
 * NCCL (nccl.h pulls in cuda_runtime.h; no CUDA call is made here: the kvf_xfer_gpu table does
 * them). Deadlines abort the communicator (ncclCommAbort), so a lost or stalled peer ends in an
 * error event, never a hang; the pair is then lost (connect again). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <nccl.h>

#include "common/log.h"
#include "common/time.h"
#include "transport/xfer_impl.h"

#define DRAIN_NS (5 * 1000000000LL)  /* a recv nobody expects gets this long to finish */
#define GRACE_NS (1 * 1000000000LL)  /* a recv whose expectation ended gets this long more */

typedef enum { PAIR_INIT, PAIR_READY, PAIR_DEAD } pair_state;

/* One communicator: a connected peer (sender side) or a sender's hello (receiver side). */
typedef struct nccl_pair {
    ncclComm_t comm;      /* NULL when its init failed and after an abort */
    pair_state state;
    bool busy;            /* a call returned ncclInProgress: poll before the next one */
    bool sender;
    uint64_t token;       /* names the pair in logs (the hello carries it) */
    kvf_xfer_peer *pub;   /* sender side */
    kvf_xfer_conn *conn;  /* notice channel; NULL once closed */
    struct nccl_pair *next;
} nccl_pair;

typedef enum { OP_QUEUED, OP_POSTING, OP_POSTED } op_stage;

/* A send (sender) or a recv (receiver) on one pair. */
typedef struct nccl_op {
    uint64_t id;
    kvf_xfer_token token; /* send: carried by the notice; recv: what the notice carried */
    nccl_pair *pair;      /* NULL once the sender's peer was disconnected */
    op_stage stage;
    int64_t *runs;        /* send: [n_runs][3] src, dst, count; recv: [n_runs][2] dst, count */
    size_t n_runs;
    uint64_t bytes;
    int64_t deadline_ns;  /* send: the write's; recv: set when it must give up */
    void *staging, *mark;
    bool acked, expected;
    kvf_status status;
    struct nccl_op *next;
} nccl_op;

typedef struct nccl_xfer {
    kvf_xfer *x;
    const kvf_xfer_gpu *gpu;
    kvf_xfer_chan *chan;
    nccl_pair *pairs;
    nccl_op *sends, *recvs;
    uint64_t next_token;
} nccl_xfer;

static const char *nccl_why(ncclResult_t r)
{
    return ncclGetErrorString(r);
}

static void op_fail(nccl_op *o, kvf_status st)
{
    if (o->status == KVF_OK)
        o->status = st;
}

static void op_free(nccl_xfer *u, nccl_op *o)
{
    if (o->staging) /* stream-ordered: released once the (aborted) work before it is done */
        u->gpu->dev_free_async(u->gpu->ctx, o->staging);
    if (o->mark)
        u->gpu->mark_free(u->gpu->ctx, o->mark); /* releases once the stream passes it */
    free(o->runs);
    free(o);
}

/* Aborts a pair's communicator: its kernels stop, its ops end (sends: PEER_LOST events at the
 * next pass; recvs: dropped, their expectations time out in xfer.c). */
static void pair_kill(nccl_xfer *u, nccl_pair *pr, const char *why)
{
    if (pr->state == PAIR_DEAD)
        return;
    kvf_log(KVF_LOG_WARN, "xfer: nccl: pair %llx lost: %s", (unsigned long long)pr->token, why);
    if (pr->comm)
        ncclCommAbort(pr->comm);
    pr->comm = NULL;
    pr->state = PAIR_DEAD;
    pr->busy = false;
    if (pr->pub)
        pr->pub->status = KVF_ERR_PEER_LOST;
    for (nccl_op *o = u->sends; o; o = o->next)
        if (o->pair == pr)
            op_fail(o, KVF_ERR_PEER_LOST);
    for (nccl_op *o = u->recvs; o; o = o->next)
        if (o->pair == pr)
            op_fail(o, KVF_ERR_PEER_LOST);
}

/* Non-blocking communicators: after ncclInProgress, poll until ncclSuccess before anything else
 * touches the communicator or its stream. */
static void pair_poll(nccl_xfer *u, nccl_pair *pr)
{
    if (!pr->comm || pr->state == PAIR_DEAD)
        return;
    ncclResult_t a = ncclSuccess, r = ncclCommGetAsyncError(pr->comm, &a);
    if (r != ncclSuccess)
        a = r;
    if (a == ncclInProgress)
        return;
    if (a != ncclSuccess) {
        pair_kill(u, pr, nccl_why(a));
        return;
    }
    pr->busy = false;
    if (pr->state == PAIR_INIT) {
        pr->state = PAIR_READY;
        kvf_log(KVF_LOG_DEBUG, "xfer: nccl: pair %llx ready", (unsigned long long)pr->token);
    }
}

static bool pair_usable(const nccl_pair *pr)
{
    return pr && pr->state == PAIR_READY && !pr->busy && pr->conn && kvf_xfer_conn_up(pr->conn);
}

static kvf_status comm_init(nccl_pair *pr, const ncclUniqueId *uid, int rank, kvf_err *err)
{
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&pr->comm, 2, *uid, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        pr->comm = NULL;
        return kvf_err_set(err, KVF_ERR_IO, "xfer: nccl: ncclCommInitRankConfig (rank %d of 2): "
                           "%s", rank, nccl_why(r));
    }
    pr->state = PAIR_INIT;
    return KVF_OK;
}

/* ---- the notice channel ---- */

static nccl_pair *pair_new(nccl_xfer *u, uint64_t token, bool sender)
{
    nccl_pair *pr = calloc(1, sizeof *pr);
    if (!pr)
        return NULL;
    pr->token = token;
    pr->sender = sender;
    pr->state = PAIR_INIT;
    pr->next = u->pairs;
    u->pairs = pr;
    return pr;
}

/* Receiver: a notice announces a send; check its runs and queue the matching recv. */
static void on_notice(nccl_xfer *u, nccl_pair *pr, const kvf_xfer_msg *m)
{
    int64_t bb = u->x->pool.layout.block_bytes, n_blocks = u->x->pool.n_blocks;
    size_t n = m->body_len / 16;
    uint64_t total = 0;
    bool ok = n > 0 && m->body_len == n * 16;
    int64_t *runs = ok ? malloc(n * 2 * sizeof *runs) : NULL;
    for (size_t i = 0; ok && runs && i < n; i++) {
        int64_t dst = (int64_t)kvf_xfer_get_u64(m->body + 16 * i);
        int64_t cnt = (int64_t)kvf_xfer_get_u64(m->body + 16 * i + 8);
        ok = dst >= 0 && cnt > 0 && dst < n_blocks && cnt <= n_blocks - dst;
        runs[2 * i] = dst;
        runs[2 * i + 1] = cnt;
        total += (uint64_t)(cnt * bb);
    }
    nccl_op *o = ok && runs && total == m->value ? calloc(1, sizeof *o) : NULL;
    if (!o) {
        free(runs);
        /* The sender's ncclSend would wait for a recv that never comes: end the pair now. */
        pair_kill(u, pr, "a notice with invalid runs (or out of memory)");
        return;
    }
    o->id = m->id;
    memcpy(o->token.b, m->token, sizeof o->token.b);
    o->pair = pr;
    o->runs = runs;
    o->n_runs = n;
    o->bytes = total;
    o->status = KVF_OK;
    nccl_op **tail = &u->recvs; /* posted in arrival order: NCCL matches in issue order */
    while (*tail)
        tail = &(*tail)->next;
    *tail = o;
}

/* Receiver: the first message of a sender's channel names its pair (value) and carries the
 * unique id of its communicator (body); we join as rank 1. A pair whose hello is wrong or whose
 * init fails dies at once: its channel is dropped on the next pass, so the sender loses the
 * peer instead of waiting for an init that will not come. */
static void on_hello(nccl_xfer *u, kvf_xfer_conn *conn, nccl_pair *pr, const kvf_xfer_msg *m)
{
    if (pr) {
        kvf_log(KVF_LOG_WARN, "xfer: nccl: a second hello (pair %llx) on the channel of pair "
                "%llx: ignored", (unsigned long long)m->value, (unsigned long long)pr->token);
        return;
    }
    if (!(pr = pair_new(u, m->value, false))) {
        kvf_log(KVF_LOG_ERROR, "xfer: nccl: hello of pair %llx: out of memory",
                (unsigned long long)m->value);
        return;
    }
    pr->conn = conn;
    kvf_xfer_conn_set_user(conn, pr);
    if (m->body_len != NCCL_UNIQUE_ID_BYTES) {
        char why[96];
        snprintf(why, sizeof why, "its hello carries %u bytes, not a unique id (%d bytes)",
                 m->body_len, NCCL_UNIQUE_ID_BYTES);
        pair_kill(u, pr, why);
        return;
    }
    ncclUniqueId uid;
    memcpy(uid.internal, m->body, NCCL_UNIQUE_ID_BYTES);
    kvf_err e = {0};
    if (comm_init(pr, &uid, 1, &e) != KVF_OK)
        pair_kill(u, pr, e.msg);
}

static void on_msg(void *arg, kvf_xfer_conn *conn, const kvf_xfer_msg *m)
{
    nccl_xfer *u = arg;
    nccl_pair *pr = kvf_xfer_conn_user(conn);
    switch (m->type) {
    case KVF_XFER_MSG_HELLO: /* receiver: a sender's pair, with its communicator's unique id */
        on_hello(u, conn, pr, m);
        break;
    case KVF_XFER_MSG_NOTICE:
        if (!pr || pr->sender || pr->state == PAIR_DEAD) {
            kvf_log(KVF_LOG_WARN, "xfer: nccl: notice for transfer %llu on a channel with no live "
                    "pair: dropped", (unsigned long long)m->id);
            break;
        }
        on_notice(u, pr, m);
        break;
    case KVF_XFER_MSG_ACK:
        for (nccl_op *o = u->sends; o; o = o->next)
            if (o->id == m->id && o->pair == pr && o->stage != OP_QUEUED && !o->acked) {
                o->acked = true;
                if (m->status != KVF_OK)
                    op_fail(o, (kvf_status)m->status);
                break;
            }
        break;
    case KVF_XFER_MSG_CLOSED:
        if (pr) {
            pr->conn = NULL; /* the channel frees it after this call */
            pair_kill(u, pr, "its notice channel closed");
        }
        break;
    default:
        kvf_log(KVF_LOG_WARN, "xfer: nccl: unexpected channel message %u: ignored", m->type);
    }
}

/* ---- open / close / descriptors ---- */

/* NCCL's bootstrap and its socket transport listen on the interface NCCL_SOCKET_IFNAME names
 * (else on one NCCL picks, never loopback): that of cfg->listen_host, set before NCCL reads it
 * (its first ncclGetUniqueId or init), unless the environment names one already. */
static kvf_status nccl_listen_interface(const kvf_xfer_cfg *cfg, kvf_err *err)
{
    if (kvf_xfer_host_is_any(cfg->listen_host))
        return KVF_OK;
    char ifname[64], want[68];
    kvf_status st = kvf_xfer_host_ifname(cfg->listen_host, ifname, sizeof ifname, err);
    if (st != KVF_OK)
        return st;
    snprintf(want, sizeof want, "=%s", ifname); /* "=": that interface exactly */
    const char *env = getenv("NCCL_SOCKET_IFNAME");
    if (!env) {
        if (setenv("NCCL_SOCKET_IFNAME", want, 0) != 0)
            return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: nccl: setting NCCL_SOCKET_IFNAME");
        kvf_log(KVF_LOG_DEBUG, "xfer: nccl: listen address %s: NCCL_SOCKET_IFNAME=%s",
                cfg->listen_host, want);
    } else if (strcmp(env, want) != 0 && strcmp(env, ifname) != 0) {
        kvf_log(KVF_LOG_WARN, "xfer: nccl: NCCL_SOCKET_IFNAME=%s (from the environment) makes "
                "NCCL listen there, not only on %s, the interface of the listen address %s", env,
                ifname, cfg->listen_host);
    }
    return KVF_OK;
}

static kvf_status nccl_open_x(kvf_xfer *x, const kvf_xfer_cfg *cfg, kvf_err *err)
{
    const kvf_xfer_gpu *g = cfg->gpu;
    if (!g->dev_alloc_async || !g->dev_free_async || !g->stream)
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: nccl: GPU ops table '%s' lacks "
                           "dev_alloc_async, dev_free_async or stream", g->name ? g->name : "?");
    nccl_xfer *u = calloc(1, sizeof *u);
    if (!u)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: nccl: out of memory");
    u->x = x;
    u->gpu = g;
    u->next_token = ((uint64_t)getpid() << 32) ^ (uint64_t)kvf_now_ns();
    kvf_status st = nccl_listen_interface(cfg, err);
    if (st == KVF_OK)
        st = kvf_xfer_chan_open(cfg->notice_host, on_msg, u, &u->chan, err);
    if (st != KVF_OK) {
        free(u);
        return st;
    }
    x->impl = u;
    return KVF_OK;
}

static void nccl_close_x(kvf_xfer *x)
{
    nccl_xfer *u = x->impl;
    /* Aborting stops every kernel still waiting on a peer; then the stream drains. */
    for (nccl_pair *pr = u->pairs; pr; pr = pr->next)
        if (pr->comm)
            ncclCommAbort(pr->comm), pr->comm = NULL;
    kvf_err e = {0};
    if ((u->sends || u->recvs) && u->gpu->sync(u->gpu->ctx, &e) != KVF_OK)
        kvf_log(KVF_LOG_WARN, "xfer: nccl: waiting for the stream at close: %s", e.msg);
    for (int side = 0; side < 2; side++) {
        nccl_op *o = side ? u->recvs : u->sends;
        while (o) {
            nccl_op *next = o->next;
            op_free(u, o);
            o = next;
        }
    }
    while (u->pairs) {
        nccl_pair *pr = u->pairs;
        u->pairs = pr->next;
        free(pr);
    }
    kvf_xfer_chan_close(u->chan);
    free(u);
}

static kvf_status nccl_export_blob(kvf_xfer *x, kvf_sbuf *out, kvf_err *err)
{
    nccl_xfer *u = x->impl;
    kvf_xfer_chan_export(u->chan, out);
    return out->oom ? kvf_err_set(err, KVF_ERR_NOMEM, "xfer: nccl: out of memory") : KVF_OK;
}

/* Sender: a new communicator as rank 0 and a channel to the receiver, whose first message (the
 * hello) carries the unique id; messages on the channel are ordered, so notices follow it. */
static kvf_status nccl_connect(kvf_xfer *x, kvf_xfer_peer *pub, const uint8_t *blob,
                               size_t blob_len, kvf_err *err)
{
    nccl_xfer *u = x->impl;
    nccl_pair *pr = pair_new(u, u->next_token++, true);
    if (!pr)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: nccl: out of memory");
    pr->pub = pub;
    size_t used = 0;
    kvf_status st = kvf_xfer_chan_connect(u->chan, blob, blob_len, &used, &pr->conn, err);
    if (st == KVF_OK && used != blob_len)
        st = kvf_err_set(err, KVF_ERR_PARSE, "xfer: nccl: descriptor blob has %zu bytes after "
                         "the notice address", blob_len - used);
    ncclResult_t r = ncclSuccess;
    ncclUniqueId uid;
    if (st == KVF_OK && (r = ncclGetUniqueId(&uid)) != ncclSuccess)
        st = kvf_err_set(err, KVF_ERR_IO, "xfer: nccl: ncclGetUniqueId: %s", nccl_why(r));
    if (st == KVF_OK)
        st = comm_init(pr, &uid, 0, err);
    kvf_xfer_msg hello = {.type = KVF_XFER_MSG_HELLO, .value = pr->token,
                          .body = (const uint8_t *)uid.internal, .body_len = NCCL_UNIQUE_ID_BYTES};
    if (st == KVF_OK && !kvf_xfer_chan_send(pr->conn, &hello))
        st = kvf_err_set(err, KVF_ERR_NOMEM, "xfer: nccl: out of memory queueing the hello");
    if (st != KVF_OK) {
        if (pr->comm)
            ncclCommAbort(pr->comm);
        if (pr->conn)
            kvf_xfer_chan_drop(u->chan, pr->conn);
        u->pairs = pr->next; /* pair_new put it first */
        free(pr);
        return st;
    }
    kvf_xfer_conn_set_user(pr->conn, pr);
    pub->impl = pr;
    pub->status = KVF_ERR_BUSY; /* until the communicator and the channel are up */
    return KVF_OK;
}

static void nccl_disconnect(kvf_xfer *x, kvf_xfer_peer *pub)
{
    nccl_xfer *u = x->impl;
    nccl_pair *pr = pub->impl;
    pr->pub = NULL;
    for (nccl_op *o = u->sends; o; o = o->next)
        if (o->pair == pr) {
            op_fail(o, KVF_ERR_CANCELLED);
            o->pair = NULL;
        }
    if (pr->comm)
        ncclCommAbort(pr->comm);
    pr->comm = NULL;
    if (pr->conn)
        kvf_xfer_chan_drop(u->chan, pr->conn);
    for (nccl_pair **pp = &u->pairs; *pp; pp = &(*pp)->next)
        if (*pp == pr) {
            *pp = pr->next;
            break;
        }
    free(pr);
}

/* ---- writes ---- */

static kvf_status nccl_write(kvf_xfer *x, kvf_xfer_peer *pub, uint64_t id,
                             const kvf_xfer_token *token, const kvf_xfer_run *runs, size_t n_runs,
                             int64_t deadline_ns, kvf_err *err)
{
    nccl_xfer *u = x->impl;
    nccl_pair *pr = pub->impl;
    if (pr->state == PAIR_DEAD)
        return kvf_err_set(err, KVF_ERR_PEER_LOST, "xfer: write %llu: peer was lost (connect "
                           "again)", (unsigned long long)id);
    for (nccl_op *o = u->sends; o; o = o->next)
        if (o->id == id)
            return kvf_err_set(err, KVF_ERR_EXISTS, "xfer: write %llu: this id is already in "
                               "flight", (unsigned long long)id);
    nccl_op *o = calloc(1, sizeof *o);
    int64_t *r = malloc(n_runs * 3 * sizeof *r);
    if (!o || !r) {
        free(o);
        free(r);
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: write %llu: out of memory",
                           (unsigned long long)id);
    }
    for (size_t i = 0; i < n_runs; i++) {
        r[3 * i] = runs[i].src;
        r[3 * i + 1] = runs[i].dst;
        r[3 * i + 2] = runs[i].count;
        o->bytes += (uint64_t)(runs[i].count * x->pool.layout.block_bytes);
    }
    o->id = id;
    o->token = *token;
    o->pair = pr;
    o->runs = r;
    o->n_runs = n_runs;
    o->deadline_ns = deadline_ns;
    o->status = KVF_OK;
    nccl_op **tail = &u->sends; /* posted in write order */
    while (*tail)
        tail = &(*tail)->next;
    *tail = o;
    return KVF_OK;
}

static kvf_status nccl_cancel(kvf_xfer *x, uint64_t id)
{
    nccl_xfer *u = x->impl;
    for (nccl_op *o = u->sends; o; o = o->next)
        if (o->id == id) {
            if (o->stage != OP_QUEUED && o->status == KVF_OK)
                return KVF_ERR_STATE; /* the receiver was told and posted its recv */
            op_fail(o, KVF_ERR_CANCELLED);
            return KVF_OK;
        }
    return KVF_ERR_NOT_FOUND;
}

/* One grouped ncclSend (sender, to rank 1) or ncclRecv (receiver, from rank 0) of o's bytes at
 * buf on the GPU stream. A non-blocking communicator may leave the group in progress (the pair
 * is busy until it completes); an error kills the pair. */
static void group_post(nccl_xfer *u, nccl_op *o, void *buf, bool recv)
{
    const kvf_xfer_gpu *g = u->gpu;
    nccl_pair *pr = o->pair;
    cudaStream_t stream = (cudaStream_t)g->stream(g->ctx);
    ncclGroupStart();
    ncclResult_t r = recv ? ncclRecv(buf, (size_t)o->bytes, ncclUint8, 0, pr->comm, stream)
                          : ncclSend(buf, (size_t)o->bytes, ncclUint8, 1, pr->comm, stream);
    ncclResult_t r2 = ncclGroupEnd();
    if (r == ncclSuccess)
        r = r2;
    o->stage = OP_POSTING;
    if (r == ncclInProgress)
        pr->busy = true;
    else if (r != ncclSuccess)
        pair_kill(u, pr, nccl_why(r));
}

/* Sender: gather (or not), notice, ncclSend. */
static void send_post(nccl_xfer *u, nccl_op *o)
{
    const kvf_xfer_gpu *g = u->gpu;
    nccl_pair *pr = o->pair;
    int64_t bb = u->x->pool.layout.block_bytes;
    char *base = u->x->pool.base, *buf;
    kvf_err e = {0};
    kvf_status st = KVF_OK;
    if (o->n_runs == 1) {
        buf = base + o->runs[0] * bb; /* one run: straight from the pool */
    } else {
        st = g->dev_alloc_async(g->ctx, (size_t)o->bytes, &o->staging, &e);
        buf = o->staging;
        uint64_t off = 0;
        for (size_t i = 0; i < o->n_runs && st == KVF_OK; i++) { /* runs are in dst order */
            size_t n = (size_t)(o->runs[3 * i + 2] * bb);
            st = g->copy_async(g->ctx, buf + off, base + o->runs[3 * i] * bb, n, &e);
            off += n;
        }
    }
    uint8_t *body = st == KVF_OK ? malloc(o->n_runs * 16) : NULL;
    if (st != KVF_OK || !body) {
        kvf_log(KVF_LOG_ERROR, "xfer: write %llu: nccl staging: %s", (unsigned long long)o->id,
                body ? e.msg : "out of memory");
        if (o->staging)
            g->dev_free_async(g->ctx, o->staging);
        o->staging = NULL;
        free(body);
        op_fail(o, st != KVF_OK ? st : KVF_ERR_NOMEM);
        g->mark(g->ctx, &o->mark, &e); /* the gather copies read our blocks: wait for them */
        o->stage = OP_POSTED;
        return;
    }
    for (size_t i = 0; i < o->n_runs; i++)
        for (int k = 0; k < 8; k++) {
            body[16 * i + k] = (uint8_t)((uint64_t)o->runs[3 * i + 1] >> (8 * k));
            body[16 * i + 8 + k] = (uint8_t)((uint64_t)o->runs[3 * i + 2] >> (8 * k));
        }
    kvf_xfer_msg m = {.type = KVF_XFER_MSG_NOTICE, .id = o->id, .value = o->bytes, .body = body,
                      .body_len = (uint32_t)(o->n_runs * 16)};
    memcpy(m.token, o->token.b, sizeof m.token);
    bool told = o->n_runs * 16 <= KVF_XFER_MSG_MAX_BODY && kvf_xfer_chan_send(pr->conn, &m);
    free(body);
    if (!told) {
        op_fail(o, KVF_ERR_PEER_LOST);
        if (o->staging)
            g->dev_free_async(g->ctx, o->staging);
        o->staging = NULL;
        g->mark(g->ctx, &o->mark, &e);
        o->stage = OP_POSTED;
        return;
    }
    group_post(u, o, buf, false);
}

/* Receiver: ncclRecv into the blocks (one run) or staging. */
static void recv_post(nccl_xfer *u, nccl_op *o)
{
    const kvf_xfer_gpu *g = u->gpu;
    nccl_pair *pr = o->pair;
    int64_t bb = u->x->pool.layout.block_bytes;
    kvf_err e = {0};
    o->expected = kvf_xfer_expecting_token(u->x, o->id, o->token.b); /* a forged notice's
                                                                      * bytes go to staging */
    o->deadline_ns = o->expected ? 0 : kvf_now_ns() + DRAIN_NS;
    char *buf;
    if (o->expected && o->n_runs == 1) {
        buf = (char *)u->x->pool.base + o->runs[0] * bb;
    } else {
        /* Not expected (timed out, cancelled): the bytes must still be taken, or the sender's
         * kernel waits until its deadline aborts the pair; they go to staging and are dropped. */
        if (g->dev_alloc_async(g->ctx, (size_t)o->bytes, &o->staging, &e) != KVF_OK) {
            pair_kill(u, pr, e.msg);
            return;
        }
        buf = o->staging;
    }
    group_post(u, o, buf, true);
}

/* After the group call completed: scatter (receiver), free staging, mark. */
static void op_finish_post(nccl_xfer *u, nccl_op *o, bool recv)
{
    const kvf_xfer_gpu *g = u->gpu;
    int64_t bb = u->x->pool.layout.block_bytes;
    kvf_err e = {0};
    kvf_status st = KVF_OK;
    if (recv && o->staging && o->expected) {
        uint64_t off = 0;
        for (size_t i = 0; i < o->n_runs && st == KVF_OK; i++) {
            size_t n = (size_t)(o->runs[2 * i + 1] * bb);
            st = g->copy_async(g->ctx, (char *)u->x->pool.base + o->runs[2 * i] * bb,
                               (char *)o->staging + off, n, &e);
            off += n;
        }
    }
    if (o->staging)
        g->dev_free_async(g->ctx, o->staging);
    o->staging = NULL;
    if (st == KVF_OK)
        st = g->mark(g->ctx, &o->mark, &e);
    if (st != KVF_OK) {
        kvf_log(KVF_LOG_ERROR, "xfer: transfer %llu: nccl: %s", (unsigned long long)o->id, e.msg);
        op_fail(o, st);
    }
    o->stage = OP_POSTED;
}

/* KVF_OK done, KVF_ERR_BUSY not yet, else failed. */
static kvf_status op_mark_state(nccl_xfer *u, nccl_op *o)
{
    if (!o->mark)
        return o->stage == OP_POSTED ? KVF_OK : KVF_ERR_BUSY;
    kvf_err e = {0};
    kvf_status st = u->gpu->mark_query(u->gpu->ctx, o->mark, &e);
    if (st != KVF_OK && st != KVF_ERR_BUSY)
        kvf_log(KVF_LOG_ERROR, "xfer: transfer %llu: nccl stream: %s", (unsigned long long)o->id,
                e.msg);
    return st;
}

static void sends_progress(nccl_xfer *u, int64_t now)
{
    for (nccl_op **pp = &u->sends; *pp;) {
        nccl_op *o = *pp;
        nccl_pair *pr = o->pair;
        if (o->status == KVF_OK && o->stage == OP_QUEUED && now >= o->deadline_ns)
            op_fail(o, KVF_ERR_TIMEOUT); /* never posted: nothing to abort */
        if (o->status == KVF_OK && o->stage == OP_QUEUED && pair_usable(pr))
            send_post(u, o);
        /* Even a write that already failed (its acknowledgement said CANCELLED) finishes its
         * post: the mark tells when the kernel stopped reading our blocks. */
        if (o->stage == OP_POSTING && pr && !pr->busy && pr->state == PAIR_READY)
            op_finish_post(u, o, false);
        kvf_status ms = o->stage == OP_POSTED ? op_mark_state(u, o) : KVF_ERR_BUSY;
        if (ms != KVF_OK && ms != KVF_ERR_BUSY)
            op_fail(o, ms);
        if (o->status == KVF_OK && !(o->acked && ms == KVF_OK) && now >= o->deadline_ns) {
            /* Posted and stuck: only an abort frees the kernel reading our blocks. */
            op_fail(o, KVF_ERR_TIMEOUT);
            if (pr)
                pair_kill(u, pr, "a write passed its deadline");
            o->status = KVF_ERR_TIMEOUT;
        }
        /* Ends when acknowledged and done, or failed (after an abort, or before posting). A
         * failure after a clean post waits for the mark: the kernel still reads our blocks. */
        bool aborted = !pr || pr->state == PAIR_DEAD;
        bool ends = o->status == KVF_OK ? o->acked && ms == KVF_OK
                                        : o->stage == OP_QUEUED || aborted || ms != KVF_ERR_BUSY;
        if (!ends) {
            pp = &o->next;
            continue;
        }
        *pp = o->next;
        kvf_xfer_sent(u->x, o->id, o->status);
        op_free(u, o);
    }
}

static void recvs_progress(nccl_xfer *u, int64_t now)
{
    for (nccl_op **pp = &u->recvs; *pp;) {
        nccl_op *o = *pp;
        nccl_pair *pr = o->pair;
        if (o->status == KVF_OK && o->stage == OP_QUEUED && pr->state == PAIR_READY && !pr->busy)
            recv_post(u, o);
        if (o->status == KVF_OK && o->stage == OP_POSTING && !pr->busy &&
            pr->state == PAIR_READY)
            op_finish_post(u, o, true);
        kvf_status ms = o->stage == OP_POSTED ? op_mark_state(u, o) : KVF_ERR_BUSY;
        if (ms != KVF_OK && ms != KVF_ERR_BUSY)
            op_fail(o, ms);
        if (o->status == KVF_OK && ms == KVF_OK) {
            /* Every byte is in our blocks: RECEIVED, and the sender's verdict. */
            bool delivered = o->expected && kvf_xfer_notice(u->x, o->id, o->token.b, KVF_OK);
            if (!o->expected)
                kvf_log(KVF_LOG_WARN, "xfer: nccl: transfer %llu was not expected here (timed "
                        "out, cancelled or never announced): bytes dropped",
                        (unsigned long long)o->id);
            kvf_xfer_msg ack = {.type = KVF_XFER_MSG_ACK, .id = o->id,
                                .status = delivered ? KVF_OK : KVF_ERR_CANCELLED};
            if (pr->conn)
                kvf_xfer_chan_send(pr->conn, &ack);
            *pp = o->next;
            op_free(u, o);
            continue;
        }
        if (o->status == KVF_OK && o->stage != OP_QUEUED) {
            /* A recv nobody waits for any more gets a grace period, then the pair goes. */
            if (o->expected && !o->deadline_ns && !kvf_xfer_expecting(u->x, o->id))
                o->deadline_ns = now + GRACE_NS;
            if (o->deadline_ns && now >= o->deadline_ns)
                pair_kill(u, pr, "a receive passed its deadline");
        }
        if (o->status != KVF_OK) { /* the pair died: the expectation times out in xfer.c */
            *pp = o->next;
            op_free(u, o);
            continue;
        }
        pp = &o->next;
    }
}

static void nccl_progress(kvf_xfer *x)
{
    nccl_xfer *u = x->impl;
    kvf_xfer_chan_progress(u->chan);
    for (nccl_pair *pr = u->pairs; pr; pr = pr->next) {
        if (pr->state == PAIR_INIT || pr->busy || pr->state == PAIR_READY)
            pair_poll(u, pr);
        if (pr->pub && pr->pub->status == KVF_ERR_BUSY && pair_usable(pr))
            pr->pub->status = KVF_OK;
    }
    int64_t now = u->sends || u->recvs ? kvf_now_ns() : 0;
    if (u->sends)
        sends_progress(u, now);
    if (u->recvs)
        recvs_progress(u, now);
    /* Receiver pairs that died are freed once nothing refers to them. */
    for (nccl_pair **pp = &u->pairs; *pp;) {
        nccl_pair *pr = *pp;
        bool used = pr->sender;
        for (nccl_op *o = u->recvs; o && !used; o = o->next)
            used = o->pair == pr;
        if (used || pr->state != PAIR_DEAD) {
            pp = &pr->next;
            continue;
        }
        *pp = pr->next;
        if (pr->conn)
            kvf_xfer_chan_drop(u->chan, pr->conn);
        free(pr);
    }
    if (kvf_xfer_chan_busy(u->chan))
        kvf_xfer_chan_progress(u->chan);
}

static int nccl_event_fd(kvf_xfer *x)
{
    return kvf_xfer_chan_fd(((nccl_xfer *)x->impl)->chan);
}

static bool nccl_arm(kvf_xfer *x)
{
    nccl_xfer *u = x->impl;
    if (u->sends || u->recvs || kvf_xfer_chan_busy(u->chan))
        return false; /* GPU work and communicator state are polled */
    for (nccl_pair *pr = u->pairs; pr; pr = pr->next)
        if (pr->state == PAIR_INIT || pr->busy)
            return false;
    return true;
}

const kvf_xfer_ops kvf_xfer_nccl_ops = {
    .name = "nccl",
    .open = nccl_open_x,
    .close = nccl_close_x,
    .export_blob = nccl_export_blob,
    .connect = nccl_connect,
    .disconnect = nccl_disconnect,
    .write = nccl_write,
    .cancel = nccl_cancel,
    .progress = nccl_progress,
    .event_fd = nccl_event_fd,
    .arm = nccl_arm,
    .needs_gpu = true,
};
