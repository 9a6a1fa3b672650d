/* xfer_ucx.c: the "ucx" backend: the pool is ucp_mem_map'ed once and its packed rkey and the
 * worker address go in the descriptor; a write is one ucp_put_nbx per run of adjacent blocks,
 * an endpoint flush, then a UCX active message (id, status) the receiver answers with an
 * acknowledgement (the notices of all writes to one peer that became ready in one progress call
 * travel in one message, and so do the acknowledgements: BATCH_MAX). Progress is the caller's
 * (kvf_xfer_progress) and looks only at writes something happened to; deadlines force-close an
 * endpoint whose operations are stuck, so a lost peer ends in an error event, never a hang.
 * The only file that includes UCX; kvf_status_from_ucs converts its codes.
 *
 * Data paths. "put" is the one above. "am" (the default over tcp) sends each run as eager
 * active messages (id, destination offset) that the receiver copies into its pool, then the
 * notice carries the byte count; the receiver completes a transfer when the notice and every
 * byte have arrived. Over tcp UCX emulates puts with active messages anyway (same copies), and
 * UCX 1.13 aborts the receiving process (ucs_fatal in ucp_put_handler) when a sender dies in
 * the middle of emulated puts; with "am" the receiver never answers mid-transfer, and data for a
 * transfer it no longer expects (timed out, cancelled) is dropped instead of written. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <net/if.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#include "common/log.h"
#include "common/time.h"
#include "transport/xfer_impl.h"

enum { AM_NOTICE = 11, AM_ACK = 12, AM_DATA = 13 };
#define HDR_BYTES 40 /* u64 id | i32 status | u32 zero | u64 value (bytes, or an offset) |
                      * 16-byte transfer token (notices and data; zero in acknowledgements) */
#define AM_CHUNK ((int64_t)1 << 20) /* "am" path: bytes per data message */
#define CLOSE_WAIT_NS 2000000000LL /* how long destroy waits for force-closed operations */
/* Notices (and acknowledgements) bound for one endpoint leave together: one active message
 * whose header is the first entry and whose payload holds up to BATCH_MAX - 1 more, 40 bytes
 * each (6,120 bytes: one shared-memory FIFO element). One message per transfer filled the
 * receiver's FIFO at a few hundred short transfers in flight, and each refill then waited for
 * the receiver to be scheduled. */
#define BATCH_MAX 153
/* Freed write records kept for reuse (send_alloc). */
#define SEND_SPARES 1024

typedef struct ucx_peer ucx_peer;
typedef struct ucx_xfer ucx_xfer;
typedef struct ucx_batch ucx_batch;

/* One write in flight. Freed only once UCX holds none of its requests (pending == 0). */
typedef struct ucx_send {
    uint64_t id;
    kvf_xfer_token token; /* carried by its notice and data messages */
    ucx_xfer *u;
    ucx_peer *peer; /* NULL once the peer was disconnected */
    int64_t deadline_ns;
    int pending;       /* UCX requests (puts, flush, notice) not completed yet */
    bool flushed;      /* every put reached the receiver's memory */
    bool notice_sent, acked, cancelled;
    bool reported;     /* its SENT event went out while UCX still held requests (a peer that
                        * died before wire-up): kept until they complete, then freed */
    kvf_status status; /* the first failure, or KVF_OK */
    uint8_t hdr[HDR_BYTES];
    uint8_t *data_hdrs; /* "am" path: [n_chunks][HDR_BYTES], live until the sends complete */
    uint64_t total_bytes;
    struct ucx_send *next, *prev; /* u->sends, doubly linked */
    struct ucx_send *hnext;       /* u->htab chain */
    struct ucx_send *rnext;       /* u->ready, while in_ready */
    bool in_ready;
} ucx_send;

/* The flush posted at connect time: it completes once wire-up has. Outlives its peer when the
 * peer is disconnected first (then p is NULL). */
typedef struct ucx_conn_op {
    ucx_peer *p;
} ucx_conn_op;

struct ucx_peer {
    ucx_xfer *u;
    ucx_conn_op *conn; /* NULL once wire-up finished */
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    uint64_t remote_base;
    bool failed; /* the error handler fired, or a deadline closed the endpoint */
    bool closed; /* ep force-closed */
    kvf_xfer_peer *pub;
    ucx_batch *notices;  /* open notice batch, or NULL */
    ucx_peer *nnext;     /* u->notice_peers, while notices != NULL */
};

/* An acknowledgement to send back through the notice's reply endpoint. */
/* Receiver: a transfer on the "am" path whose notice or bytes are still arriving. */
typedef struct ucx_recv {
    uint64_t id;
    uint8_t token[KVF_XFER_TOKEN_BYTES]; /* checked against the expectation before it was made */
    uint64_t landed, total; /* total: from the notice */
    bool noticed;
    ucp_ep_h reply_ep;
    struct ucx_recv *next;
} ucx_recv;

/* Entries going out in one active message (notices or acknowledgements): entry 0 is the AM
 * header, the rest its payload. Owned by the open list it sits on, then by UCX until its
 * request completes (u->batches_out meanwhile). */
struct ucx_batch {
    ucx_xfer *u;
    ucp_ep_h ep;
    bool notice;                 /* notices: each holds a pending request count on its write */
    int n;
    ucx_send *sends[BATCH_MAX];  /* notices: the writes announced */
    uint8_t buf[BATCH_MAX * HDR_BYTES];
    struct ucx_batch *next;
};

struct ucx_xfer {
    kvf_xfer *x;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_mem_h memh;
    void *rkey_buf;
    size_t rkey_len;
    ucp_address_t *addr;
    size_t addr_len;
    ucx_send *sends;
    /* The same writes indexed by id (chained hash, hcap a power of two): writes, acks and
     * cancels find theirs without walking every write in flight. */
    ucx_send **htab;
    size_t hcap, hcount;
    /* Progress looks only at the writes something happened to (a UCX callback, an ack, a new
     * write, a cancel): they are queued on ready. Every write is walked only when a peer
     * failed or closed (walk_all) or the earliest deadline may have passed (next_deadline_ns,
     * never later than the true one). With thousands of short writes in flight, walking them
     * all on every progress call cost more than the copies. */
    ucx_send *ready;
    bool walk_all;
    int64_t next_deadline_ns;
    ucx_batch *acks;        /* open acknowledgement batches (one per reply endpoint), sent
                             * from progress: AM handlers do not send */
    ucx_peer *notice_peers; /* peers with an open notice batch, sent at the end of progress */
    ucx_batch *batches_out; /* batches UCX still holds (freed at close if it never lets go) */
    bool no_peer_errh; /* transport "sm": UCX 1.13 has no peer-failure handling over it */
    bool am_data;      /* data path "am" (else "put") */
    int efd;           /* the worker's event fd, or -1 (no wakeup support) */
    ucx_recv *recvs;
    int64_t recv_failed_seen; /* x->stats.received_failed when recvs were last swept */
    ucx_send *spare; /* freed write records kept for reuse (linked by next), n_spare of them */
    int n_spare;
    kvf_xfer_event *sent; /* SENT events of this progress pass (sent_queue), n_sent of sent_cap */
    size_t n_sent, sent_cap;
};

/* The one place UCX status codes become kvfleet ones. */
static kvf_status kvf_status_from_ucs(ucs_status_t s)
{
    switch (s) {
    case UCS_OK:
        return KVF_OK;
    case UCS_ERR_NO_MEMORY:
        return KVF_ERR_NOMEM;
    case UCS_ERR_TIMED_OUT:
        return KVF_ERR_TIMEOUT;
    case UCS_ERR_CANCELED:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
        return KVF_ERR_PEER_LOST;
    case UCS_ERR_INVALID_PARAM:
        return KVF_ERR_INVALID;
    case UCS_ERR_UNSUPPORTED:
        return KVF_ERR_UNSUPPORTED;
    default:
        return KVF_ERR_IO;
    }
}

static void hdr_write(uint8_t *h, uint64_t id, int32_t status, uint64_t value,
                      const uint8_t *token)
{
    for (int i = 0; i < 8; i++)
        h[i] = (uint8_t)(id >> (8 * i));
    for (int i = 0; i < 4; i++)
        h[8 + i] = (uint8_t)((uint32_t)status >> (8 * i));
    memset(h + 12, 0, 4);
    for (int i = 0; i < 8; i++)
        h[16 + i] = (uint8_t)(value >> (8 * i));
    if (token)
        memcpy(h + 24, token, KVF_XFER_TOKEN_BYTES);
    else
        memset(h + 24, 0, KVF_XFER_TOKEN_BYTES);
}

/* ---- clocks ---- */

/* Progress spins, and the precise clock costs a slow read in VMs (about a quarter of the copy
 * time of a spinning sender of 64 KiB writes): the coarse one (behind by at most a scheduler
 * tick, same base) says whether the earliest deadline can have come, with COARSE_SLACK_NS to
 * spare; only then is the precise clock read. */
#define COARSE_SLACK_NS 50000000LL

static int64_t coarse_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- the index of writes by id ---- */

static size_t send_hash(uint64_t id, size_t cap)
{
    return (size_t)((id * 0x9e3779b97f4a7c15ULL) >> 32) & (cap - 1);
}

static void send_index_add(ucx_xfer *u, ucx_send *s)
{
    if (u->hcount >= u->hcap) {
        /* Grow to keep chains short; without memory the old table still works, just slower. */
        ucx_send **nt = calloc(u->hcap * 2, sizeof *nt);
        if (nt) {
            for (size_t b = 0; b < u->hcap; b++)
                while (u->htab[b]) {
                    ucx_send *e = u->htab[b];
                    u->htab[b] = e->hnext;
                    size_t nb = send_hash(e->id, u->hcap * 2);
                    e->hnext = nt[nb];
                    nt[nb] = e;
                }
            free(u->htab);
            u->htab = nt;
            u->hcap *= 2;
        }
    }
    size_t b = send_hash(s->id, u->hcap);
    s->hnext = u->htab[b];
    u->htab[b] = s;
    u->hcount++;
}

/* The write with this id whose SENT event has not gone out yet, or NULL. (A reported write
 * whose UCX operations are still held may share its id with a newer one.) */
static ucx_send *send_find(ucx_xfer *u, uint64_t id)
{
    for (ucx_send *s = u->htab[send_hash(id, u->hcap)]; s; s = s->hnext)
        if (s->id == id && !s->reported)
            return s;
    return NULL;
}

/* Links a new write into u->sends and the index, and queues it for progress. */
static void send_link(ucx_xfer *u, ucx_send *s)
{
    s->prev = NULL;
    s->next = u->sends;
    if (u->sends)
        u->sends->prev = s;
    u->sends = s;
    send_index_add(u, s);
    if (s->deadline_ns < u->next_deadline_ns)
        u->next_deadline_ns = s->deadline_ns;
}

/* Queues s for the next progress call (something happened to it). */
static void send_ready(ucx_send *s)
{
    if (s->in_ready)
        return;
    s->in_ready = true;
    s->rnext = s->u->ready;
    s->u->ready = s;
}

/* Unlinks s from every list and frees it. */
static void send_free(ucx_xfer *u, ucx_send *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        u->sends = s->next;
    if (s->next)
        s->next->prev = s->prev;
    for (ucx_send **pp = &u->htab[send_hash(s->id, u->hcap)]; *pp; pp = &(*pp)->hnext)
        if (*pp == s) {
            *pp = s->hnext;
            u->hcount--;
            break;
        }
    if (s->in_ready)
        for (ucx_send **pp = &u->ready; *pp; pp = &(*pp)->rnext)
            if (*pp == s) {
                *pp = s->rnext;
                break;
            }
    free(s->data_hdrs);
    if (u->n_spare < SEND_SPARES) {
        s->next = u->spare;
        u->spare = s;
        u->n_spare++;
    } else {
        free(s);
    }
}

/* A zeroed write record, from the spares when there are any (a calloc and a free per write
 * showed in profiles of short shared-memory writes). */
static ucx_send *send_alloc(ucx_xfer *u)
{
    ucx_send *s = u->spare;
    if (!s)
        return calloc(1, sizeof *s);
    u->spare = s->next;
    u->n_spare--;
    memset(s, 0, sizeof *s);
    return s;
}

/* ---- request completion ---- */

static void send_fail(ucx_send *s, kvf_status st)
{
    if (s->status == KVF_OK)
        s->status = st;
}

static void op_done(void *req, ucs_status_t status, void *user_data)
{
    ucx_send *s = user_data;
    send_ready(s);
    s->pending--;
    if (status != UCS_OK)
        send_fail(s, kvf_status_from_ucs(status));
    ucp_request_free(req);
}

static void flush_done(void *req, ucs_status_t status, void *user_data)
{
    ucx_send *s = user_data;
    if (status == UCS_OK)
        s->flushed = true;
    op_done(req, status, user_data);
}

/* Accounts for what a non-blocking call returned. */
static void send_track(ucx_send *s, ucs_status_ptr_t p)
{
    if (UCS_PTR_IS_ERR(p))
        send_fail(s, kvf_status_from_ucs(UCS_PTR_STATUS(p)));
    else if (p != NULL)
        s->pending++;
}

static void conn_done(void *req, ucs_status_t status, void *user_data)
{
    ucx_conn_op *op = user_data;
    if (op->p) {
        op->p->u->walk_all = true;
        op->p->conn = NULL;
        if (status == UCS_OK && op->p->pub->status == KVF_ERR_BUSY)
            op->p->pub->status = KVF_OK;
        else if (status != UCS_OK)
            op->p->failed = true, op->p->pub->status = KVF_ERR_PEER_LOST;
    }
    free(op);
    if (req)
        ucp_request_free(req);
}

/* A batch UCX let go of: its notices' writes move on (failed when status says so). */
static void batch_release(ucx_batch *b, ucs_status_t status)
{
    if (b->notice)
        for (int i = 0; i < b->n; i++) {
            ucx_send *s = b->sends[i];
            s->pending--;
            if (status != UCS_OK)
                send_fail(s, kvf_status_from_ucs(status));
            send_ready(s);
        }
    free(b);
}

static void batch_done(void *req, ucs_status_t status, void *user_data)
{
    ucx_batch *b = user_data;
    for (ucx_batch **pp = &b->u->batches_out; *pp; pp = &(*pp)->next)
        if (*pp == b) {
            *pp = b->next;
            break;
        }
    batch_release(b, status);
    ucp_request_free(req);
}

/* Sends a batch as one active message; the batch is freed now or when UCX completes it. */
static void batch_send(ucx_xfer *u, ucx_batch *b)
{
    ucp_request_param_t param = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = batch_done, .user_data = b,
        .flags = UCP_AM_SEND_FLAG_EAGER | (b->notice ? UCP_AM_SEND_FLAG_REPLY : 0)};
    ucs_status_ptr_t r = ucp_am_send_nbx(b->ep, b->notice ? AM_NOTICE : AM_ACK, b->buf, HDR_BYTES,
                                         b->buf + HDR_BYTES, (size_t)(b->n - 1) * HDR_BYTES,
                                         &param);
    if (r != NULL && !UCS_PTR_IS_ERR(r)) {
        if (b->notice)
            for (int i = 0; i < b->n; i++)
                b->sends[i]->pending++;
        b->next = u->batches_out;
        u->batches_out = b;
        return;
    }
    if (UCS_PTR_IS_ERR(r) && !b->notice)
        kvf_log(KVF_LOG_DEBUG, "xfer: ucx: %d acknowledgements not sent: %s", b->n,
                ucs_status_string(UCS_PTR_STATUS(r)));
    if (b->notice) /* the writes were counted as notified: release them as completed */
        for (int i = 0; i < b->n; i++)
            b->sends[i]->pending++;
    batch_release(b, r == NULL ? UCS_OK : UCS_PTR_STATUS(r));
}

/* ---- endpoints ---- */

static void peer_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    ucx_peer *p = arg;
    p->u->walk_all = true;
    p->failed = true;
    p->pub->status = KVF_ERR_PEER_LOST;
    kvf_log(KVF_LOG_WARN, "xfer: ucx: peer lost: %s", ucs_status_string(status));
}

/* Force-closes p's endpoint: UCX completes its outstanding requests with an error. With wait,
 * progresses until the close finished (or CLOSE_WAIT_NS passed). */
static void peer_close(ucx_xfer *u, ucx_peer *p, bool wait)
{
    if (p->closed)
        return;
    p->closed = true;
    if (p->rkey)
        ucp_rkey_destroy(p->rkey);
    p->rkey = NULL;
    ucp_request_param_t param = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                 .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t req = ucp_ep_close_nbx(p->ep, &param);
    if (req == NULL || UCS_PTR_IS_ERR(req))
        return;
    int64_t until = kvf_now_ns() + CLOSE_WAIT_NS;
    while (wait && ucp_request_check_status(req) == UCS_INPROGRESS && kvf_now_ns() < until)
        ucp_worker_progress(u->worker);
    ucp_request_free(req);
}

/* ---- active messages ---- */

/* Queues the answer to a notice: KVF_OK when the transfer was delivered here, else
 * KVF_ERR_CANCELLED (this side no longer expects it: timed out or cancelled). */
static void queue_ack(ucx_xfer *u, ucp_ep_h ep, uint64_t id, kvf_status st)
{
    ucx_batch *b = u->acks;
    while (b && (b->ep != ep || b->n == BATCH_MAX))
        b = b->next;
    if (!b) {
        b = malloc(sizeof *b);
        if (!b) {
            kvf_log(KVF_LOG_ERROR, "xfer: ucx: out of memory acknowledging transfer %llu",
                    (unsigned long long)id);
            return;
        }
        *b = (ucx_batch){.u = u, .ep = ep, .next = u->acks};
        u->acks = b;
    }
    hdr_write(b->buf + (size_t)b->n++ * HDR_BYTES, id, st, 0, NULL);
}

static ucx_recv *recv_find(ucx_xfer *u, uint64_t id, const uint8_t *token, bool create)
{
    for (ucx_recv *r = u->recvs; r; r = r->next)
        if (r->id == id)
            return r;
    if (!create)
        return NULL;
    ucx_recv *r = calloc(1, sizeof *r);
    if (r) {
        r->id = id;
        memcpy(r->token, token, KVF_XFER_TOKEN_BYTES);
        r->next = u->recvs;
        u->recvs = r;
    }
    return r;
}

/* "am" path: a transfer is complete once its notice and all its bytes are in. */
static void recv_try_complete(ucx_xfer *u, ucx_recv *r)
{
    if (!r->noticed || r->landed < r->total)
        return;
    bool delivered = kvf_xfer_notice(u->x, r->id, r->token, KVF_OK);
    if (r->reply_ep)
        queue_ack(u, r->reply_ep, r->id, delivered ? KVF_OK : KVF_ERR_CANCELLED);
    for (ucx_recv **pp = &u->recvs; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    free(r);
}

/* One notice entry (id, status, byte count, token) from the peer behind reply. */
static void notice_entry(ucx_xfer *u, const uint8_t *h, ucp_ep_h reply)
{
    uint64_t id = kvf_xfer_get_u64(h), total = kvf_xfer_get_u64(h + 16);
    int32_t st = (int32_t)kvf_xfer_get_u32(h + 8);
    const uint8_t *token = h + 24;
    if (total > 0 && st == KVF_OK) {
        /* "am" path: the bytes may still be on their way. */
        ucx_recv *r = kvf_xfer_expecting_token(u->x, id, token) ? recv_find(u, id, token, true)
                                                                : NULL;
        if (!r) {
            if (!kvf_xfer_expecting(u->x, id)) /* not expected: counted and dropped there */
                kvf_xfer_notice(u->x, id, token, KVF_OK);
            if (reply)
                queue_ack(u, reply, id, KVF_ERR_CANCELLED);
            return;
        }
        r->noticed = true;
        r->total = total;
        r->reply_ep = reply;
        recv_try_complete(u, r);
        return;
    }
    bool delivered = kvf_xfer_notice(u->x, id, token, (kvf_status)st);
    if (reply)
        queue_ack(u, reply, id, delivered ? KVF_OK : KVF_ERR_CANCELLED);
}

/* Entries of a batch message: the header, then the payload (eager, whole entries). Returns
 * how many payload entries can be read; a malformed payload is logged and only the header
 * counts. */
static size_t batch_payload_entries(const char *what, size_t header_length, size_t length,
                                    const ucp_am_recv_param_t *param)
{
    if (length % HDR_BYTES == 0 && !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
        return length / HDR_BYTES;
    kvf_log(KVF_LOG_WARN, "xfer: ucx: %s with a %zu-byte payload (whole %d-byte entries, "
                          "eager): payload dropped", what, length, HDR_BYTES);
    return 0;
}

static ucs_status_t notice_cb(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    ucx_xfer *u = arg;
    if (header_length != HDR_BYTES) {
        kvf_log(KVF_LOG_WARN, "xfer: ucx: notice with a %zu-byte header (%d expected): dropped",
                header_length, HDR_BYTES);
        return UCS_OK;
    }
    ucp_ep_h reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    size_t more = batch_payload_entries("notice", header_length, length, param);
    notice_entry(u, header, reply);
    for (size_t i = 0; i < more; i++)
        notice_entry(u, (const uint8_t *)data + i * HDR_BYTES, reply);
    return UCS_OK;
}

static ucs_status_t data_cb(void *arg, const void *header, size_t header_length, void *data,
                            size_t length, const ucp_am_recv_param_t *param)
{
    ucx_xfer *u = arg;
    if (header_length != HDR_BYTES || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        kvf_log(KVF_LOG_WARN, "xfer: ucx: data message with a %zu-byte header or not eager: "
                              "dropped", header_length);
        return UCS_OK;
    }
    uint64_t id = kvf_xfer_get_u64(header), off = kvf_xfer_get_u64((const uint8_t *)header + 16);
    uint64_t pool_bytes = (uint64_t)(u->x->pool.n_blocks * u->x->pool.layout.block_bytes);
    if (off > pool_bytes || length > pool_bytes - off) {
        kvf_log(KVF_LOG_WARN, "xfer: ucx: transfer %llu: %zu bytes at offset %llu fall outside "
                              "the %llu-byte pool: dropped", (unsigned long long)id, length,
                (unsigned long long)off, (unsigned long long)pool_bytes);
        return UCS_OK;
    }
    /* Only into blocks someone is waiting for (late data must not land in reused blocks), and
     * only from the sender given the transfer's token. */
    const uint8_t *token = (const uint8_t *)header + 24;
    if (!kvf_xfer_expecting_token(u->x, id, token))
        return UCS_OK;
    ucx_recv *r = recv_find(u, id, token, true);
    if (!r)
        return UCS_OK;
    memcpy((char *)u->x->pool.base + off, data, length);
    r->landed += length;
    recv_try_complete(u, r);
    return UCS_OK;
}

static ucs_status_t ack_cb(void *arg, const void *header, size_t header_length, void *data,
                           size_t length, const ucp_am_recv_param_t *param)
{
    ucx_xfer *u = arg;
    if (header_length != HDR_BYTES)
        return UCS_OK;
    size_t more = batch_payload_entries("acknowledgement", header_length, length, param);
    for (size_t i = 0; i <= more; i++) {
        const uint8_t *h = i == 0 ? header : (const uint8_t *)data + (i - 1) * HDR_BYTES;
        uint64_t id = kvf_xfer_get_u64(h);
        int32_t st = (int32_t)kvf_xfer_get_u32(h + 8);
        ucx_send *s = send_find(u, id);
        if (s && s->notice_sent) {
            s->acked = true;
            send_ready(s);
            if (st != KVF_OK) /* the receiver had stopped waiting: its blocks may be reused */
                send_fail(s, (kvf_status)st);
        }
    }
    return UCS_OK;
}

static kvf_status set_am_handler(ucx_xfer *u, unsigned id, ucp_am_recv_callback_t cb, kvf_err *err)
{
    ucp_am_handler_param_t p = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = id, .cb = cb, .arg = u};
    ucs_status_t s = ucp_worker_set_am_recv_handler(u->worker, &p);
    if (s != UCS_OK)
        return kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: setting AM handler %u: %s",
                           id, ucs_status_string(s));
    return KVF_OK;
}

/* ---- open / close ---- */

/* Appends to out (comma-separated) every network device UCX has that is not a tcp one: RDMA
 * devices, which open no socket. */
static void ucx_non_tcp_net_devices(kvf_sbuf *out)
{
    uct_component_h *comps = NULL;
    unsigned n_comps = 0;
    if (uct_query_components(&comps, &n_comps) != UCS_OK)
        return;
    for (unsigned i = 0; i < n_comps; i++) {
        uct_component_attr_t ca = {.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT};
        if (uct_component_query(comps[i], &ca) != UCS_OK || ca.md_resource_count == 0)
            continue;
        uct_md_resource_desc_t *mds = calloc(ca.md_resource_count, sizeof *mds);
        if (!mds)
            continue;
        ca.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        ca.md_resources = mds;
        unsigned n_mds = ca.md_resource_count;
        for (unsigned j = 0; uct_component_query(comps[i], &ca) == UCS_OK && j < n_mds; j++) {
            uct_md_config_t *mc = NULL;
            uct_md_h md = NULL;
            if (uct_md_config_read(comps[i], NULL, NULL, &mc) != UCS_OK)
                continue;
            ucs_status_t s = uct_md_open(comps[i], mds[j].md_name, mc, &md);
            uct_config_release(mc);
            if (s != UCS_OK)
                continue;
            uct_tl_resource_desc_t *res = NULL;
            unsigned n_res = 0;
            if (uct_md_query_tl_resources(md, &res, &n_res) == UCS_OK) {
                for (unsigned k = 0; k < n_res; k++) {
                    if (res[k].dev_type != UCT_DEVICE_TYPE_NET || strcmp(res[k].tl_name, "tcp") == 0)
                        continue;
                    /* once each: ",name," is not in ",<out>," */
                    char key[UCT_DEVICE_NAME_MAX + 2];
                    snprintf(key, sizeof key, ",%s,", res[k].dev_name);
                    kvf_sbuf have;
                    kvf_sbuf_init(&have);
                    kvf_sbuf_printf(&have, ",%.*s,", (int)out->len, out->len ? out->data : "");
                    if (!have.oom && !strstr(have.data, key))
                        kvf_sbuf_printf(out, "%s%s", out->len ? "," : "", res[k].dev_name);
                    kvf_sbuf_fini(&have);
                }
                uct_release_tl_resource_list(res);
            }
            uct_md_close(md);
        }
        free(mds);
    }
    uct_release_component_list(comps);
}

/* UCX_NET_DEVICES for a context whose tcp transport may listen only on cfg->listen_host's
 * interface (UCX's tcp transport binds the address of every net device it is given). *out is
 * NULL when nothing is to be set (no tcp, or every interface allowed), else a malloc'd list. */
static kvf_status ucx_listen_devices(const kvf_xfer_cfg *cfg, const char *tls, char **out,
                                     kvf_err *err)
{
    *out = NULL;
    bool tcp_possible = !tls || strcmp(tls, "tcp") == 0;
    if (!tcp_possible || kvf_xfer_host_is_any(cfg->listen_host)) {
        if (cfg->net_devices && !(*out = strdup(cfg->net_devices)))
            return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: ucx: out of memory");
        return KVF_OK;
    }
    char ifname[IF_NAMESIZE + 1];
    kvf_status st = kvf_xfer_host_ifname(cfg->listen_host, ifname, sizeof ifname, err);
    if (st != KVF_OK)
        return st;
    kvf_sbuf l;
    kvf_sbuf_init(&l);
    if (cfg->net_devices && *cfg->net_devices) {
        /* the operator's list, as long as no interface in it is another one */
        char *copy = strdup(cfg->net_devices), *save = NULL;
        for (char *d = copy ? strtok_r(copy, ",", &save) : NULL; d; d = strtok_r(NULL, ",", &save)) {
            if (strcmp(d, "all") == 0 || (strcmp(d, ifname) != 0 && if_nametoindex(d) != 0)) {
                st = kvf_err_set(err, KVF_ERR_INVALID, "xfer: ucx: net devices '%s' would let "
                                 "UCX's tcp transport listen on '%s', which does not hold the "
                                 "listen address %s (%s does: name it, plus RDMA devices if any)",
                                 cfg->net_devices, d, cfg->listen_host, ifname);
                break;
            }
        }
        free(copy);
        if (st != KVF_OK) {
            kvf_sbuf_fini(&l);
            return st;
        }
        kvf_sbuf_puts(&l, cfg->net_devices);
    } else {
        kvf_sbuf_puts(&l, ifname);
        ucx_non_tcp_net_devices(&l);
    }
    if (l.oom) {
        kvf_sbuf_fini(&l);
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: ucx: out of memory");
    }
    *out = kvf_sbuf_take(&l);
    return KVF_OK;
}

static kvf_status ucx_open(kvf_xfer *x, const kvf_xfer_cfg *cfg, kvf_err *err)
{
    const char *tr = cfg->transport && *cfg->transport ? cfg->transport : "auto";
    const char *tls = NULL;
    if (strcmp(tr, "tcp") == 0)
        tls = "tcp";
    else if (strcmp(tr, "sm") == 0)
        tls = "sm";
    else if (strcmp(tr, "auto") != 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: ucx: transport '%s' is not supported (use auto, tcp or sm)", tr);

    ucx_xfer *u = calloc(1, sizeof *u);
    if (!u)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: ucx: out of memory");
    u->x = x;
    u->hcap = 64;
    u->htab = calloc(u->hcap, sizeof *u->htab);
    if (!u->htab) {
        free(u);
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: ucx: out of memory");
    }
    u->no_peer_errh = strcmp(tr, "sm") == 0;
    const char *dp = cfg->data_path && *cfg->data_path ? cfg->data_path : "auto";
    if (strcmp(dp, "am") == 0 || (strcmp(dp, "auto") == 0 && strcmp(tr, "tcp") == 0))
        u->am_data = true;
    else if (strcmp(dp, "put") != 0 && strcmp(dp, "auto") != 0) {
        free(u->htab);
        free(u);
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: ucx: data path '%s' is not supported (use auto, put or am)", dp);
    }
    kvf_status st;
    ucp_config_t *uc;
    ucs_status_t s = ucp_config_read(NULL, NULL, &uc);
    if (s != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: reading UCX configuration: %s",
                         ucs_status_string(s));
        goto fail_u;
    }
    /* the devices: those that let the tcp transport listen on cfg->listen_host only */
    char *devs = NULL;
    if ((st = ucx_listen_devices(cfg, tls, &devs, err)) != KVF_OK) {
        ucp_config_release(uc);
        goto fail_u;
    }
    if (tls && (s = ucp_config_modify(uc, "TLS", tls)) == UCS_OK && devs)
        s = ucp_config_modify(uc, "NET_DEVICES", devs);
    else if (!tls && devs)
        s = ucp_config_modify(uc, "NET_DEVICES", devs);
    if (s != UCS_OK) {
        ucp_config_release(uc);
        st = kvf_err_set(err, KVF_ERR_INVALID, "xfer: ucx: transport '%s' / net devices '%s': %s",
                         tr, devs ? devs : "(all)", ucs_status_string(s));
        free(devs);
        goto fail_u;
    }
    if (devs && !kvf_xfer_host_is_any(cfg->listen_host))
        kvf_log(KVF_LOG_DEBUG, "xfer: ucx: listen address %s: net devices %s", cfg->listen_host,
                devs);
    free(devs);
    /* Wakeup lets waiters sleep on an fd; without it they spin (still correct). */
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                           .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
    s = ucp_init(&params, uc, &u->ctx);
    if (s != UCS_OK) {
        params.features &= ~(uint64_t)UCP_FEATURE_WAKEUP;
        s = ucp_init(&params, uc, &u->ctx);
    }
    ucp_config_release(uc);
    if (s != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: ucp_init (transport %s): %s", tr,
                         ucs_status_string(s));
        goto fail_u;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((s = ucp_worker_create(u->ctx, &wp, &u->worker)) != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: creating a worker: %s",
                         ucs_status_string(s));
        goto fail_ctx;
    }
    if (!(params.features & UCP_FEATURE_WAKEUP) || ucp_worker_get_efd(u->worker, &u->efd) != UCS_OK)
        u->efd = -1;
    /* No base: UCX allocates the pool, in memory its shared-memory transports can map. */
    bool alloc = x->pool.base == NULL;
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        .address = x->pool.base,
        .length = (size_t)(x->pool.n_blocks * x->pool.layout.block_bytes),
        .flags = alloc ? UCP_MEM_MAP_ALLOCATE : 0};
    if ((s = ucp_mem_map(u->ctx, &mp, &u->memh)) != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: %s the %zu-byte pool: %s",
                         alloc ? "allocating" : "registering", mp.length, ucs_status_string(s));
        goto fail_worker;
    }
    if (alloc) {
        ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
        if ((s = ucp_mem_query(u->memh, &ma)) != UCS_OK) {
            st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: querying the pool: %s",
                             ucs_status_string(s));
            goto fail_mem;
        }
        x->pool.base = ma.address;
        memset(x->pool.base, 0, mp.length);
    }
    if ((s = ucp_rkey_pack(u->ctx, u->memh, &u->rkey_buf, &u->rkey_len)) != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: packing the pool's rkey: %s",
                         ucs_status_string(s));
        goto fail_mem;
    }
    if ((s = ucp_worker_get_address(u->worker, &u->addr, &u->addr_len)) != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: worker address: %s",
                         ucs_status_string(s));
        goto fail_rkey;
    }
    if ((st = set_am_handler(u, AM_NOTICE, notice_cb, err)) != KVF_OK ||
        (st = set_am_handler(u, AM_DATA, data_cb, err)) != KVF_OK ||
        (st = set_am_handler(u, AM_ACK, ack_cb, err)) != KVF_OK)
        goto fail_addr;
    x->impl = u;
    kvf_log(KVF_LOG_DEBUG, "xfer: ucx: pool of %lld blocks registered, transport %s",
            (long long)x->pool.n_blocks, tr);
    return KVF_OK;

fail_addr:
    ucp_worker_release_address(u->worker, u->addr);
fail_rkey:
    ucp_rkey_buffer_release(u->rkey_buf);
fail_mem:
    ucp_mem_unmap(u->ctx, u->memh);
fail_worker:
    ucp_worker_destroy(u->worker);
fail_ctx:
    ucp_cleanup(u->ctx);
fail_u:
    free(u->htab);
    free(u);
    return st;
}

static void ucx_close(kvf_xfer *x)
{
    ucx_xfer *u = x->impl;
    /* Peers are gone (the generic layer disconnected them): their sends were force-closed.
     * Wait for UCX to hand back every request before freeing what they point to. */
    int64_t until = kvf_now_ns() + CLOSE_WAIT_NS;
    for (;;) {
        bool busy = false;
        for (ucx_send *s = u->sends; s; s = s->next)
            busy |= s->pending > 0;
        if (!busy || kvf_now_ns() >= until)
            break;
        ucp_worker_progress(u->worker);
    }
    while (u->recvs) {
        ucx_recv *r = u->recvs;
        u->recvs = r->next;
        free(r);
    }
    while (u->acks) {
        ucx_batch *b = u->acks;
        u->acks = b->next;
        free(b);
    }
    ucp_worker_release_address(u->worker, u->addr);
    ucp_rkey_buffer_release(u->rkey_buf);
    ucp_mem_unmap(u->ctx, u->memh);
    ucp_worker_destroy(u->worker);
    /* No callback can come after the worker is gone: free what UCX never handed back (operations
     * queued behind a peer that died, which a force-close does not always release). */
    while (u->batches_out) {
        ucx_batch *b = u->batches_out;
        u->batches_out = b->next;
        free(b);
    }
    while (u->sends) {
        ucx_send *s = u->sends;
        if (s->pending > 0)
            kvf_log(KVF_LOG_WARN, "xfer: ucx: transfer %llu: %d UCX operations never completed; "
                    "dropped with the worker", (unsigned long long)s->id, s->pending);
        send_free(u, s);
    }
    free(u->sent);
    while (u->spare) {
        ucx_send *s = u->spare;
        u->spare = s->next;
        free(s);
    }
    ucp_cleanup(u->ctx);
    free(u->htab);
    free(u);
}

/* ---- descriptors and peers ---- */

static kvf_status ucx_export(kvf_xfer *x, kvf_sbuf *out, kvf_err *err)
{
    ucx_xfer *u = x->impl;
    kvf_xfer_put_u64(out, (uint64_t)(uintptr_t)x->pool.base);
    kvf_xfer_put_u32(out, (uint32_t)u->rkey_len);
    kvf_sbuf_append(out, u->rkey_buf, u->rkey_len);
    kvf_xfer_put_u32(out, (uint32_t)u->addr_len);
    kvf_sbuf_append(out, u->addr, u->addr_len);
    return out->oom ? kvf_err_set(err, KVF_ERR_NOMEM, "xfer: ucx: out of memory") : KVF_OK;
}

static kvf_status ucx_connect(kvf_xfer *x, kvf_xfer_peer *pub, const uint8_t *blob,
                              size_t blob_len, kvf_err *err)
{
    ucx_xfer *u = x->impl;
    if (blob_len < 12)
        return kvf_err_set(err, KVF_ERR_PARSE, "xfer: ucx: descriptor blob of %zu bytes is too "
                                               "short (at least 12)", blob_len);
    uint64_t base = kvf_xfer_get_u64(blob);
    size_t rkey_len = kvf_xfer_get_u32(blob + 8);
    if (rkey_len == 0 || rkey_len > blob_len - 12 - 4)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: ucx: descriptor rkey length %zu does not fit its %zu bytes",
                           rkey_len, blob_len);
    size_t addr_len = kvf_xfer_get_u32(blob + 12 + rkey_len);
    if (addr_len == 0 || addr_len != blob_len - 16 - rkey_len)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: ucx: descriptor worker address length %zu does not match the "
                           "%zu bytes left", addr_len, blob_len - 16 - rkey_len);
    /* UCX reads both buffers as structures: give them aligned copies. */
    void *rkey_buf = malloc(rkey_len), *addr = malloc(addr_len);
    ucx_peer *p = calloc(1, sizeof *p);
    kvf_status st;
    if (!rkey_buf || !addr || !p) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "xfer: ucx: out of memory");
        goto fail;
    }
    memcpy(rkey_buf, blob + 12, rkey_len);
    memcpy(addr, blob + 16 + rkey_len, addr_len);
    p->pub = pub;
    p->u = u;
    p->remote_base = base;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = peer_err_cb, .arg = p}};
    if (u->no_peer_errh)
        ep.field_mask &= ~(uint64_t)(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLER);
    ucs_status_t s = ucp_ep_create(u->worker, &ep, &p->ep);
    if (s == UCS_ERR_UNREACHABLE && !u->no_peer_errh) {
        /* UCX 1.13's shared-memory transports have no peer-failure handling: connect without
         * it. A dead peer then shows as a put error (cma) or as the deadline passing. */
        ep.field_mask &= ~(uint64_t)(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLER);
        s = ucp_ep_create(u->worker, &ep, &p->ep);
        if (s == UCS_OK)
            kvf_log(KVF_LOG_DEBUG, "xfer: ucx: peer endpoint without peer-failure handling");
    }
    if (s != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s),
                         "xfer: ucx: connecting to the peer's worker address: %s",
                         ucs_status_string(s));
        goto fail;
    }
    if ((s = ucp_ep_rkey_unpack(p->ep, rkey_buf, &p->rkey)) != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: unpacking the peer's rkey: %s",
                         ucs_status_string(s));
        peer_close(u, p, true);
        goto fail;
    }
    free(rkey_buf);
    free(addr);
    pub->impl = p;
    /* Start wire-up now: the peer reads KVF_ERR_BUSY until this flush completes. */
    pub->status = KVF_ERR_BUSY;
    p->conn = malloc(sizeof *p->conn);
    if (p->conn) {
        p->conn->p = p;
        ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                  UCP_OP_ATTR_FIELD_USER_DATA,
                                  .cb.send = conn_done, .user_data = p->conn};
        ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep, &fp);
        if (r == NULL || UCS_PTR_IS_ERR(r))
            conn_done(NULL, UCS_PTR_STATUS(r), p->conn);
    } else {
        pub->status = KVF_OK; /* no memory to watch wire-up: writes still queue behind it */
    }
    return KVF_OK;

fail:
    free(rkey_buf);
    free(addr);
    free(p);
    return st;
}

static void ucx_disconnect(kvf_xfer *x, kvf_xfer_peer *pub)
{
    ucx_xfer *u = x->impl;
    ucx_peer *p = pub->impl;
    if (p->conn)
        p->conn->p = NULL;
    for (ucx_send *s = u->sends; s; s = s->next)
        if (s->peer == p) {
            send_fail(s, KVF_ERR_CANCELLED);
            s->peer = NULL;
        }
    u->walk_all = true;
    if (p->notices) {
        /* Never sent: its writes were cancelled above and hold no request for it. */
        for (ucx_peer **pp = &u->notice_peers; *pp; pp = &(*pp)->nnext)
            if (*pp == p) {
                *pp = p->nnext;
                break;
            }
        free(p->notices);
    }
    peer_close(u, p, true);
    free(p);
}

/* ---- writes ---- */

static kvf_status ucx_write(kvf_xfer *x, kvf_xfer_peer *pub, uint64_t id,
                            const kvf_xfer_token *token, const kvf_xfer_run *runs, size_t n_runs,
                            int64_t deadline_ns, kvf_err *err)
{
    ucx_xfer *u = x->impl;
    ucx_peer *p = pub->impl;
    if (p->failed || p->closed)
        return kvf_err_set(err, KVF_ERR_PEER_LOST, "xfer: write %llu: peer was lost (connect again)",
                           (unsigned long long)id);
    if (send_find(u, id))
        return kvf_err_set(err, KVF_ERR_EXISTS, "xfer: write %llu: this id is already in flight",
                           (unsigned long long)id);
    ucx_send *s = send_alloc(u);
    if (!s)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: write %llu: out of memory",
                           (unsigned long long)id);
    s->id = id;
    s->token = *token;
    s->u = u;
    s->peer = p;
    s->deadline_ns = deadline_ns;
    s->status = KVF_OK;

    int64_t bb = x->pool.layout.block_bytes;
    char *base = x->pool.base;
    if (u->am_data) {
        /* Data messages then the notice, all posted now: the receiver counts the bytes. */
        size_t n_chunks = 0;
        for (size_t i = 0; i < n_runs; i++)
            n_chunks += (size_t)((runs[i].count * bb + AM_CHUNK - 1) / AM_CHUNK);
        s->data_hdrs = malloc(n_chunks * HDR_BYTES);
        if (!s->data_hdrs) {
            free(s);
            return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: write %llu: out of memory",
                               (unsigned long long)id);
        }
        ucp_request_param_t dp = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMH,
            .cb.send = op_done, .user_data = s, .flags = UCP_AM_SEND_FLAG_EAGER,
            .memh = u->memh};
        size_t c = 0;
        for (size_t i = 0; i < n_runs && s->status == KVF_OK; i++) {
            int64_t len = runs[i].count * bb;
            for (int64_t off = 0; off < len && s->status == KVF_OK; off += AM_CHUNK, c++) {
                int64_t n = len - off < AM_CHUNK ? len - off : AM_CHUNK;
                uint8_t *h = s->data_hdrs + c * HDR_BYTES;
                hdr_write(h, id, 0, (uint64_t)(runs[i].dst * bb + off), token->b);
                send_track(s, ucp_am_send_nbx(p->ep, AM_DATA, h, HDR_BYTES,
                                              base + runs[i].src * bb + off, (size_t)n, &dp));
            }
            s->total_bytes += (uint64_t)len;
        }
        s->flushed = true; /* no flush: the notice goes now and carries the byte count */
        send_link(u, s);
        send_ready(s);
        return KVF_OK;
    }
    /* One put per run; UCX completes them in any order, the flush waits for all of them. */
    ucp_request_param_t param = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_MEMH,
        .cb.send = op_done, .user_data = s, .memh = u->memh};
    for (size_t i = 0; i < n_runs && s->status == KVF_OK; i++)
        send_track(s, ucp_put_nbx(p->ep, base + runs[i].src * bb, (size_t)(runs[i].count * bb),
                                  p->remote_base + (uint64_t)(runs[i].dst * bb), p->rkey, &param));
    if (s->status == KVF_OK) {
        ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                  UCP_OP_ATTR_FIELD_USER_DATA,
                                  .cb.send = flush_done, .user_data = s};
        ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep, &fp);
        send_track(s, r);
        if (r == NULL)
            s->flushed = true;
    }
    /* From here the write belongs to progress: a failure above becomes its SENT event. */
    send_link(u, s);
    send_ready(s);
    return KVF_OK;
}

static kvf_status ucx_cancel(kvf_xfer *x, uint64_t id)
{
    ucx_xfer *u = x->impl;
    ucx_send *s = send_find(u, id);
    if (!s)
        return KVF_ERR_NOT_FOUND;
    if (s->notice_sent && s->status == KVF_OK)
        return KVF_ERR_STATE; /* the receiver was told already: wait for the event */
    s->cancelled = true;
    send_fail(s, KVF_ERR_CANCELLED);
    send_ready(s);
    return KVF_OK;
}

/* Queues s's notice on its peer's open batch (sent at the end of this progress call, or now
 * when full); without memory for a batch it goes alone. */
static void send_notice(ucx_send *s);
static void queue_notice(ucx_xfer *u, ucx_send *s)
{
    ucx_peer *p = s->peer;
    if (!p->notices) {
        p->notices = malloc(sizeof *p->notices);
        if (!p->notices) {
            send_notice(s);
            return;
        }
        *p->notices = (ucx_batch){.u = u, .ep = p->ep, .notice = true};
        p->nnext = u->notice_peers;
        u->notice_peers = p;
    }
    ucx_batch *b = p->notices;
    hdr_write(b->buf + (size_t)b->n * HDR_BYTES, s->id, KVF_OK, s->total_bytes, s->token.b);
    b->sends[b->n++] = s;
    s->notice_sent = true;
    if (b->n == BATCH_MAX) {
        for (ucx_peer **pp = &u->notice_peers; *pp; pp = &(*pp)->nnext)
            if (*pp == p) {
                *pp = p->nnext;
                break;
            }
        p->notices = NULL;
        batch_send(u, b);
    }
}

/* Sends every open notice batch. */
static void send_notices(ucx_xfer *u)
{
    while (u->notice_peers) {
        ucx_peer *p = u->notice_peers;
        u->notice_peers = p->nnext;
        ucx_batch *b = p->notices;
        p->notices = NULL;
        batch_send(u, b);
    }
}

static void send_notice(ucx_send *s)
{
    ucx_peer *p = s->peer;
    hdr_write(s->hdr, s->id, KVF_OK, s->total_bytes, s->token.b);
    ucp_request_param_t param = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = op_done, .user_data = s, .flags = UCP_AM_SEND_FLAG_REPLY};
    s->notice_sent = true;
    send_track(s, ucp_am_send_nbx(p->ep, AM_NOTICE, s->hdr, HDR_BYTES, NULL, 0, &param));
}

static void send_acks(ucx_xfer *u)
{
    while (u->acks) {
        ucx_batch *b = u->acks;
        u->acks = b->next;
        batch_send(u, b);
    }
}

/* A write's SENT event, delivered with the others of this progress pass under one lock
 * (sent_flush; a lock per event showed in profiles of short writes). Delivered at once when
 * the buffer cannot grow. */
static void sent_queue(ucx_xfer *u, uint64_t id, kvf_status st)
{
    if (u->n_sent == u->sent_cap) {
        size_t cap = u->sent_cap ? 2 * u->sent_cap : 256;
        kvf_xfer_event *b = realloc(u->sent, cap * sizeof *b);
        if (!b) {
            kvf_xfer_sent(u->x, id, st);
            return;
        }
        u->sent = b;
        u->sent_cap = cap;
    }
    u->sent[u->n_sent++] = (kvf_xfer_event){.kind = KVF_XFER_SENT, .id = id, .status = st};
}

static void sent_flush(ucx_xfer *u)
{
    if (u->n_sent) {
        kvf_xfer_sent_many(u->x, u->sent, u->n_sent);
        u->n_sent = 0;
    }
}

/* Moves one write on: failure and deadline checks, the notice once flushed, the SENT event
 * once acknowledged (or failed) with no UCX request left. Returns true when s was freed. */
static bool send_step(ucx_xfer *u, ucx_send *s, int64_t now)
{
    ucx_peer *p = s->peer;
    if (s->reported) {
        if (s->pending == 0) {
            send_free(u, s);
            return true;
        }
        return false;
    }
    if (s->status == KVF_OK && p && (p->failed || p->closed))
        send_fail(s, KVF_ERR_PEER_LOST);
    /* Past the deadline: a write still waiting, or one that failed (cancelled, peer lost)
     * but whose operations UCX still holds, ends now. */
    if (!s->acked && now >= s->deadline_ns && (s->status == KVF_OK || s->pending > 0)) {
        send_fail(s, KVF_ERR_TIMEOUT);
        kvf_log(KVF_LOG_WARN, "xfer: write %llu: deadline passed (%d UCX operations pending)",
                (unsigned long long)s->id, s->pending);
        if (s->pending > 0 && p) {
            /* Stuck operations would hold the source blocks forever: drop the endpoint. */
            p->failed = true;
            p->pub->status = KVF_ERR_PEER_LOST;
            peer_close(u, p, false);
            ucp_worker_progress(u->worker);
            u->walk_all = true; /* the other writes to this peer */
        }
        if (s->pending > 0) {
            /* Operations queued behind a wire-up that never finished are not always
             * released by the close: report now (they only read the pool, which outlives
             * us) and free the record when UCX lets go of it. */
            s->reported = true;
            sent_queue(u, s->id, s->status);
            return false;
        }
    }
    if (p && p->failed && !p->closed) {
        peer_close(u, p, false);
        u->walk_all = true;
    }
    if (s->status == KVF_OK && s->flushed && !s->notice_sent && p)
        queue_notice(u, s);
    if (s->pending == 0 && (s->status != KVF_OK || s->acked)) {
        sent_queue(u, s->id, s->status);
        send_free(u, s);
        return true;
    }
    return false;
}

static void ucx_progress(kvf_xfer *x)
{
    ucx_xfer *u = x->impl;
    for (int i = 0; i < 64 && ucp_worker_progress(u->worker); i++)
        ;
    if (u->acks)
        send_acks(u);
    /* Drop "am" records of transfers no longer expected. Only a timeout or cancel (counted in
     * received_failed) ends an expectation with a record left behind, so the sweep (a lock per
     * record) runs only when that count moved. */
    if (u->recvs) {
        pthread_mutex_lock(&x->mu);
        int64_t failed = x->stats.received_failed;
        pthread_mutex_unlock(&x->mu);
        if (failed != u->recv_failed_seen) {
            u->recv_failed_seen = failed;
            for (ucx_recv **rp = &u->recvs; *rp;) {
                ucx_recv *r = *rp;
                if (!kvf_xfer_expecting(x, r->id)) { /* timed out or cancelled meanwhile */
                    *rp = r->next;
                    free(r);
                    continue;
                }
                rp = &r->next;
            }
        }
    }
    /* now: the time, or (when no deadline can have come) an earlier one that fires none. */
    int64_t now = 0;
    if (u->sends) {
        now = coarse_now_ns();
        if (now + COARSE_SLACK_NS >= u->next_deadline_ns)
            now = kvf_now_ns();
    }
    if (u->walk_all || now >= u->next_deadline_ns) {
        /* Every write: a peer failed or closed, or a deadline may have passed. The walk
         * recomputes the earliest deadline and empties the ready queue. */
        u->walk_all = false;
        while (u->ready) {
            u->ready->in_ready = false;
            u->ready = u->ready->rnext;
        }
        int64_t next_deadline = INT64_MAX;
        for (ucx_send *s = u->sends, *next; s; s = next) {
            next = s->next;
            if (!send_step(u, s, now) && !s->reported && !s->acked && s->deadline_ns < next_deadline)
                next_deadline = s->deadline_ns;
        }
        u->next_deadline_ns = next_deadline;
    }
    /* The writes something happened to (callbacks during a step may queue more). */
    while (u->ready) {
        ucx_send *s = u->ready;
        u->ready = s->rnext;
        s->in_ready = false;
        send_step(u, s, now);
    }
    if (u->notice_peers)
        send_notices(u);
    sent_flush(u);
}

static int ucx_event_fd(kvf_xfer *x)
{
    return ((ucx_xfer *)x->impl)->efd;
}

static bool ucx_arm(kvf_xfer *x)
{
    ucx_xfer *u = x->impl;
    /* Acks queued by a notice go out from progress: never sleep on them. */
    return u->efd >= 0 && !u->acks && ucp_worker_arm(u->worker) == UCS_OK;
}

const kvf_xfer_ops kvf_xfer_ucx_ops = {
    .name = "ucx",
    .open = ucx_open,
    .close = ucx_close,
    .export_blob = ucx_export,
    .connect = ucx_connect,
    .disconnect = ucx_disconnect,
    .write = ucx_write,
    .cancel = ucx_cancel,
    .progress = ucx_progress,
    .event_fd = ucx_event_fd,
    .arm = ucx_arm,
};
