/* xfer_ucx.c: the "ucx" backend: the pool is ucp_mem_map'ed once and its packed rkey and the
 * worker address go in the descriptor; a write is one ucp_put_nbx per run of adjacent blocks,
 * an endpoint flush, then a UCX active message (id, status) the receiver answers with an
 * acknowledgement. Progress is the caller's (kvf_xfer_progress); deadlines force-close an
 * endpoint whose operations are stuck, so a lost peer ends in an error event, never a hang.
 * The only file that includes UCX; kvf_status_from_ucs converts its codes. */
#include <stdlib.h>
#include <string.h>

#include <ucp/api/ucp.h>

#include "common/log.h"
#include "common/time.h"
#include "transport/xfer_impl.h"

enum { AM_NOTICE = 11, AM_ACK = 12 };
#define HDR_BYTES 16 /* u64 id | i32 status | u32 zero */
#define CLOSE_WAIT_NS 2000000000LL /* how long destroy waits for force-closed operations */

typedef struct ucx_peer ucx_peer;

/* One write in flight. Freed only once UCX holds none of its requests (pending == 0). */
typedef struct ucx_send {
    uint64_t id;
    ucx_peer *peer; /* NULL once the peer was disconnected */
    int64_t deadline_ns;
    int pending;       /* UCX requests (puts, flush, notice) not completed yet */
    bool flushed;      /* every put reached the receiver's memory */
    bool notice_sent, acked, cancelled;
    kvf_status status; /* the first failure, or KVF_OK */
    uint8_t hdr[HDR_BYTES];
    struct ucx_send *next;
} ucx_send;

struct ucx_peer {
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    uint64_t remote_base;
    bool failed; /* the error handler fired, or a deadline closed the endpoint */
    bool closed; /* ep force-closed */
    kvf_xfer_peer *pub;
};

/* An acknowledgement to send back through the notice's reply endpoint. */
typedef struct ucx_ack {
    ucp_ep_h ep;
    uint8_t hdr[HDR_BYTES];
    struct ucx_ack *next;
} ucx_ack;

typedef struct ucx_xfer {
    kvf_xfer *x;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_mem_h memh;
    void *rkey_buf;
    size_t rkey_len;
    ucp_address_t *addr;
    size_t addr_len;
    ucx_send *sends;
    ucx_ack *acks; /* queued by the notice handler, sent from progress */
} ucx_xfer;

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

static void hdr_write(uint8_t *h, uint64_t id, int32_t status)
{
    for (int i = 0; i < 8; i++)
        h[i] = (uint8_t)(id >> (8 * i));
    for (int i = 0; i < 4; i++)
        h[8 + i] = (uint8_t)((uint32_t)status >> (8 * i));
    memset(h + 12, 0, 4);
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

static void ack_done(void *req, ucs_status_t status, void *user_data)
{
    free(user_data);
    ucp_request_free(req);
}

/* ---- endpoints ---- */

static void peer_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    ucx_peer *p = arg;
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

static ucs_status_t notice_cb(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    ucx_xfer *u = arg;
    if (header_length != HDR_BYTES) {
        kvf_log(KVF_LOG_WARN, "xfer: ucx: notice with a %zu-byte header (%d expected): dropped",
                header_length, HDR_BYTES);
        return UCS_OK;
    }
    const uint8_t *h = header;
    uint64_t id = kvf_xfer_get_u64(h);
    int32_t st = (int32_t)kvf_xfer_get_u32(h + 8);
    kvf_xfer_notice(u->x, id, (kvf_status)st);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) && param->reply_ep) {
        ucx_ack *a = calloc(1, sizeof *a);
        if (!a) {
            kvf_log(KVF_LOG_ERROR, "xfer: ucx: out of memory acknowledging transfer %llu",
                    (unsigned long long)id);
            return UCS_OK;
        }
        a->ep = param->reply_ep;
        hdr_write(a->hdr, id, 0);
        a->next = u->acks;
        u->acks = a;
    }
    return UCS_OK;
}

static ucs_status_t ack_cb(void *arg, const void *header, size_t header_length, void *data,
                           size_t length, const ucp_am_recv_param_t *param)
{
    ucx_xfer *u = arg;
    if (header_length != HDR_BYTES)
        return UCS_OK;
    uint64_t id = kvf_xfer_get_u64(header);
    for (ucx_send *s = u->sends; s; s = s->next)
        if (s->id == id && s->notice_sent) {
            s->acked = true;
            break;
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
    kvf_status st;
    ucp_config_t *uc;
    ucs_status_t s = ucp_config_read(NULL, NULL, &uc);
    if (s != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: reading UCX configuration: %s",
                         ucs_status_string(s));
        goto fail_u;
    }
    if (tls && (s = ucp_config_modify(uc, "TLS", tls)) == UCS_OK && cfg->net_devices)
        s = ucp_config_modify(uc, "NET_DEVICES", cfg->net_devices);
    else if (!tls && cfg->net_devices)
        s = ucp_config_modify(uc, "NET_DEVICES", cfg->net_devices);
    if (s != UCS_OK) {
        ucp_config_release(uc);
        st = kvf_err_set(err, KVF_ERR_INVALID, "xfer: ucx: transport '%s' / net devices '%s': %s",
                         tr, cfg->net_devices ? cfg->net_devices : "(all)", ucs_status_string(s));
        goto fail_u;
    }
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                           .features = UCP_FEATURE_RMA | UCP_FEATURE_AM};
    s = ucp_init(&params, uc, &u->ctx);
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
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = x->pool.base,
        .length = (size_t)(x->pool.n_blocks * x->pool.layout.block_bytes)};
    if ((s = ucp_mem_map(u->ctx, &mp, &u->memh)) != UCS_OK) {
        st = kvf_err_set(err, kvf_status_from_ucs(s), "xfer: ucx: registering the %zu-byte pool: %s",
                         mp.length, ucs_status_string(s));
        goto fail_worker;
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
    while (u->sends) {
        ucx_send *s = u->sends;
        u->sends = s->next;
        if (s->pending > 0)
            kvf_log(KVF_LOG_ERROR, "xfer: ucx: transfer %llu still has %d UCX requests at close",
                    (unsigned long long)s->id, s->pending);
        else
            free(s);
    }
    while (u->acks) {
        ucx_ack *a = u->acks;
        u->acks = a->next;
        free(a);
    }
    ucp_worker_release_address(u->worker, u->addr);
    ucp_rkey_buffer_release(u->rkey_buf);
    ucp_mem_unmap(u->ctx, u->memh);
    ucp_worker_destroy(u->worker);
    ucp_cleanup(u->ctx);
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
    p->remote_base = base;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = peer_err_cb, .arg = p}};
    ucs_status_t s = ucp_ep_create(u->worker, &ep, &p->ep);
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
    for (ucx_send *s = u->sends; s; s = s->next)
        if (s->peer == p) {
            send_fail(s, KVF_ERR_CANCELLED);
            s->peer = NULL;
        }
    peer_close(u, p, true);
    free(p);
}

/* ---- writes ---- */

static kvf_status ucx_write(kvf_xfer *x, kvf_xfer_peer *pub, uint64_t id, const kvf_xfer_run *runs,
                            size_t n_runs, int64_t deadline_ns, kvf_err *err)
{
    ucx_xfer *u = x->impl;
    ucx_peer *p = pub->impl;
    if (p->failed || p->closed)
        return kvf_err_set(err, KVF_ERR_PEER_LOST, "xfer: write %llu: peer was lost (connect again)",
                           (unsigned long long)id);
    for (ucx_send *s = u->sends; s; s = s->next)
        if (s->id == id)
            return kvf_err_set(err, KVF_ERR_EXISTS, "xfer: write %llu: this id is already in flight",
                               (unsigned long long)id);
    ucx_send *s = calloc(1, sizeof *s);
    if (!s)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: write %llu: out of memory",
                           (unsigned long long)id);
    s->id = id;
    s->peer = p;
    s->deadline_ns = deadline_ns;
    s->status = KVF_OK;

    /* One put per run; UCX completes them in any order, the flush waits for all of them. */
    int64_t bb = x->pool.layout.block_bytes;
    char *base = x->pool.base;
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
    s->next = u->sends;
    u->sends = s;
    return KVF_OK;
}

static kvf_status ucx_cancel(kvf_xfer *x, uint64_t id)
{
    ucx_xfer *u = x->impl;
    for (ucx_send *s = u->sends; s; s = s->next)
        if (s->id == id) {
            if (s->notice_sent && s->status == KVF_OK)
                return KVF_ERR_STATE; /* the receiver was told already: wait for the event */
            s->cancelled = true;
            send_fail(s, KVF_ERR_CANCELLED);
            return KVF_OK;
        }
    return KVF_ERR_NOT_FOUND;
}

static void send_notice(ucx_send *s)
{
    ucx_peer *p = s->peer;
    hdr_write(s->hdr, s->id, KVF_OK);
    ucp_request_param_t param = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = op_done, .user_data = s, .flags = UCP_AM_SEND_FLAG_REPLY};
    s->notice_sent = true;
    send_track(s, ucp_am_send_nbx(p->ep, AM_NOTICE, s->hdr, HDR_BYTES, NULL, 0, &param));
}

static void send_acks(ucx_xfer *u)
{
    ucx_ack *list = u->acks;
    u->acks = NULL;
    while (list) {
        ucx_ack *a = list;
        list = a->next;
        ucp_request_param_t param = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
            .cb.send = ack_done, .user_data = a};
        ucs_status_ptr_t r = ucp_am_send_nbx(a->ep, AM_ACK, a->hdr, HDR_BYTES, NULL, 0, &param);
        if (r == NULL || UCS_PTR_IS_ERR(r)) {
            if (UCS_PTR_IS_ERR(r))
                kvf_log(KVF_LOG_DEBUG, "xfer: ucx: acknowledgement not sent: %s",
                        ucs_status_string(UCS_PTR_STATUS(r)));
            free(a);
        }
    }
}

static void ucx_progress(kvf_xfer *x)
{
    ucx_xfer *u = x->impl;
    for (int i = 0; i < 64 && ucp_worker_progress(u->worker); i++)
        ;
    if (u->acks)
        send_acks(u);
    int64_t now = kvf_now_ns();
    for (ucx_send **pp = &u->sends; *pp;) {
        ucx_send *s = *pp;
        ucx_peer *p = s->peer;
        if (s->status == KVF_OK && p && (p->failed || p->closed))
            send_fail(s, KVF_ERR_PEER_LOST);
        if (s->status == KVF_OK && !s->acked && now >= s->deadline_ns) {
            send_fail(s, KVF_ERR_TIMEOUT);
            kvf_log(KVF_LOG_WARN, "xfer: write %llu: deadline passed (%d UCX operations pending)",
                    (unsigned long long)s->id, s->pending);
            if (s->pending > 0 && p) {
                /* Stuck operations would hold the source blocks forever: drop the endpoint. */
                p->failed = true;
                p->pub->status = KVF_ERR_PEER_LOST;
                peer_close(u, p, false);
            }
        }
        if (p && p->failed && !p->closed)
            peer_close(u, p, false);
        if (s->status == KVF_OK && s->flushed && !s->notice_sent)
            send_notice(s);
        if (s->pending == 0 && (s->status != KVF_OK || s->acked)) {
            *pp = s->next;
            kvf_xfer_sent(x, s->id, s->status);
            free(s);
            continue;
        }
        pp = &s->next;
    }
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
};
