/* xfer_impl.h: what the generic kvf_xfer layer (xfer.c) and its backends (xfer_local.c,
 * xfer_ucx.c, xfer_cudaipc.c, xfer_nccl.c) share: the backend vtable, the object layout, the
 * calls backends make back into the generic layer (events, receiver notices), and the host
 * notice channel of the GPU backends (xfer_chan.c). Private to transport/. */
#ifndef KVF_TRANSPORT_XFER_IMPL_H
#define KVF_TRANSPORT_XFER_IMPL_H

#include <pthread.h>

#include "common/sbuf.h"
#include "transport/xfer.h"

/* One put: count adjacent blocks from src to dst. */
typedef struct kvf_xfer_run {
    int64_t src, dst, count;
} kvf_xfer_run;

/* The backend vtable. Each backend is one `static const kvf_xfer_ops` in its own file. */
typedef struct kvf_xfer_ops {
    const char *name;
    kvf_status (*open)(kvf_xfer *x, const kvf_xfer_cfg *cfg, kvf_err *err); /* sets x->impl */
    void (*close)(kvf_xfer *x);
    /* Appends the backend part of the descriptor (addresses, keys). */
    kvf_status (*export_blob)(kvf_xfer *x, kvf_sbuf *out, kvf_err *err);
    /* Connects to a peer from its (already checked) descriptor; sets peer->impl. */
    kvf_status (*connect)(kvf_xfer *x, kvf_xfer_peer *peer, const uint8_t *blob, size_t blob_len,
                          kvf_err *err);
    void (*disconnect)(kvf_xfer *x, kvf_xfer_peer *peer);
    /* Starts a write of runs (validated, sorted by dst); on KVF_OK the backend later calls
     * kvf_xfer_sent exactly once for id. */
    kvf_status (*write)(kvf_xfer *x, kvf_xfer_peer *peer, uint64_t id,
                        const kvf_xfer_token *token, const kvf_xfer_run *runs, size_t n_runs,
                        int64_t deadline_ns, kvf_err *err);
    /* Sender-side cancel: KVF_ERR_NOT_FOUND when id is not in flight here. */
    kvf_status (*cancel)(kvf_xfer *x, uint64_t id);
    void (*progress)(kvf_xfer *x);
    /* Event fd, or -1 when the backend has none (the caller then spins). */
    int (*event_fd)(kvf_xfer *x);
    /* Arms event_fd; false when work is already pending (progress again instead of sleeping). */
    bool (*arm)(kvf_xfer *x);
    /* The pool is device memory reached through cfg->gpu. */
    bool needs_gpu;
} kvf_xfer_ops;

extern const kvf_xfer_ops kvf_xfer_local_ops;
extern const kvf_xfer_ops kvf_xfer_ucx_ops;
extern const kvf_xfer_ops kvf_xfer_cudaipc_ops;
#ifdef KVF_HAVE_NCCL
extern const kvf_xfer_ops kvf_xfer_nccl_ops;
#endif

typedef struct kvf_xfer_expectation {
    uint64_t id;
    kvf_xfer_token token; /* what its notice must carry */
    int64_t deadline_ns;
    int32_t *blocks; /* kvf_xfer_expect_blocks: [n_blocks] destination blocks (owned), or NULL */
    size_t n_blocks;
} kvf_xfer_expectation;

/* The ucx staging path (xfer.c): a write copying device -> pinned mirror before the backend
 * gets it (tx), or a received transfer copying pinned mirror -> device before its RECEIVED
 * event (rx). */
typedef struct kvf_xfer_stage {
    uint64_t id;
    kvf_xfer_token token;  /* tx: for the backend's notice */
    void *mark;            /* the GPU mark after its copies */
    kvf_xfer_peer *peer;   /* tx; NULL once disconnected */
    kvf_xfer_run *runs;    /* tx: [n_runs] */
    size_t n_runs;
    int64_t deadline_ns;   /* tx */
    bool cancelled;        /* tx */
    struct kvf_xfer_stage *next;
} kvf_xfer_stage;

struct kvf_xfer {
    const kvf_xfer_ops *ops;
    void *impl;
    kvf_xfer_pool pool;
    bool accept_unexpected;
    pthread_mutex_t mu; /* guards everything below (notices may come from another thread) */
    kvf_xfer_event *ev; /* ring: [ev_cap] */
    size_t ev_head, ev_len, ev_cap;
    kvf_xfer_expectation *exp; /* [exp_cap], unordered */
    size_t n_exp, exp_cap;
    kvf_xfer_stats stats;
    kvf_xfer_peer *peers; /* connected peers, linked through ->next (owner's thread only) */
    const kvf_xfer_gpu *gpu; /* cfg->gpu: the pool is device memory; NULL: host */
    /* ucx staging: pool.base is the pinned mirror the backend registers; gpu_base the device
     * pool. NULL / NULL without staging. Stage lists: owner's thread (rx under mu). */
    void *gpu_base, *staging;
    kvf_xfer_stage *stage_tx, *stage_rx;
};

struct kvf_xfer_peer {
    kvf_xfer *owner;
    void *impl;
    kvf_kv_layout layout;
    int64_t n_blocks;
    kvf_status status; /* KVF_OK or KVF_ERR_PEER_LOST */
    kvf_xfer_peer *next;
};

/* Backend -> generic layer. Both take x->mu themselves. */
/* Sender: write id ended with st (counts stats, queues the SENT event). */
void kvf_xfer_sent(kvf_xfer *x, uint64_t id, kvf_status st);
/* kvf_xfer_sent for n writes under one lock (evs[i].id and .status; .kind is ignored). */
void kvf_xfer_sent_many(kvf_xfer *x, const kvf_xfer_event *evs, size_t n);
/* Receiver: the sender's notice for id arrived with st and token (NULL: the zero token).
 * Returns whether it became an event: false when id was not expected (and accept_unexpected
 * is off), or when the token is not the expectation's (forged: counted, logged, and the
 * expectation stays for the real sender). */
bool kvf_xfer_notice(kvf_xfer *x, uint64_t id, const uint8_t *token, kvf_status st);

/* Receiver: whether a transfer id is expected (or accept_unexpected is set). */
bool kvf_xfer_expecting(kvf_xfer *x, uint64_t id);
/* The same, and token (KVF_XFER_TOKEN_BYTES, NULL: zero) is the expectation's: what a
 * backend checks before letting a message write into the pool. A wrong token counts as a
 * forged notice. */
bool kvf_xfer_expecting_token(kvf_xfer *x, uint64_t id, const uint8_t *token);

/* ---- where the transfer plane listens (xfer.c) ----
 * Whether host names every address (NULL, "", "0.0.0.0", "::"). */
bool kvf_xfer_host_is_any(const char *host);
/* The name of the network interface that holds the numeric address host; the error names the
 * address and says that no interface has it. */
kvf_status kvf_xfer_host_ifname(const char *host, char *ifname, size_t cap, kvf_err *err);

/* ---- the host notice channel of the GPU backends (xfer_chan.c) ----
 * Framed messages over TCP between two kvf_xfer objects: each side listens on one address (in
 * its descriptor) and senders connect to it. Non-blocking, progressed from kvf_xfer_progress;
 * one epoll fd covers the listener and every connection. A connection that fails or closes is
 * reported once (KVF_XFER_MSG_CLOSED) and then freed by the channel. */
typedef struct kvf_xfer_chan kvf_xfer_chan;
typedef struct kvf_xfer_conn kvf_xfer_conn;

enum {
    KVF_XFER_MSG_CLOSED = 0, /* not sent: the connection failed or the other side closed it */
    KVF_XFER_MSG_HELLO = 1,  /* sender -> receiver, first (nccl): value = pair token, body =
                              * the communicator's unique id (the receiver joins as rank 1) */
    KVF_XFER_MSG_NOTICE = 2, /* sender -> receiver: id landed (cuda_ipc) / is coming (nccl:
                              * value = bytes, body = runs as (i64 dst, i64 count) pairs) */
    KVF_XFER_MSG_ACK = 3,    /* receiver -> sender: id, status (KVF_OK or KVF_ERR_CANCELLED) */
};

#define KVF_XFER_MSG_MAX_BODY ((uint32_t)64 << 20)

typedef struct kvf_xfer_msg {
    uint32_t type;
    int32_t status;
    uint64_t id, value;
    uint8_t token[KVF_XFER_TOKEN_BYTES]; /* NOTICE: the transfer's token (zero otherwise) */
    const uint8_t *body; /* valid during the callback only */
    uint32_t body_len;
} kvf_xfer_msg;

typedef void (*kvf_xfer_chan_fn)(void *arg, kvf_xfer_conn *conn, const kvf_xfer_msg *m);

/* Listens on host (NULL: 127.0.0.1), an ephemeral port. */
kvf_status kvf_xfer_chan_open(const char *host, kvf_xfer_chan_fn fn, void *arg,
                              kvf_xfer_chan **out, kvf_err *err);
/* Closes every connection (no CLOSED callbacks) and the listener. */
void kvf_xfer_chan_close(kvf_xfer_chan *c);
/* Appends the listening address (u16 port | u8 host length | host) to a descriptor blob. */
kvf_status kvf_xfer_chan_export(const kvf_xfer_chan *c, kvf_sbuf *out);
/* Starts connecting to the address kvf_xfer_chan_export wrote at blob (*used_out: its bytes). */
kvf_status kvf_xfer_chan_connect(kvf_xfer_chan *c, const uint8_t *blob, size_t blob_len,
                                 size_t *used_out, kvf_xfer_conn **out, kvf_err *err);
/* Closes one connection now (no CLOSED callback). */
void kvf_xfer_chan_drop(kvf_xfer_chan *c, kvf_xfer_conn *conn);
/* Queues a message (copied); false when the connection is dead or out of memory. */
bool kvf_xfer_chan_send(kvf_xfer_conn *conn, const kvf_xfer_msg *m);
/* Whether the connection is established (queued messages go out once it is). */
bool kvf_xfer_conn_up(const kvf_xfer_conn *conn);
void *kvf_xfer_conn_user(const kvf_xfer_conn *conn);
void kvf_xfer_conn_set_user(kvf_xfer_conn *conn, void *user);
/* Accepts, reads (calling fn per message), writes what is queued. */
void kvf_xfer_chan_progress(kvf_xfer_chan *c);
int kvf_xfer_chan_fd(const kvf_xfer_chan *c);
/* Whether output is still queued (then do not sleep on the fd). */
bool kvf_xfer_chan_busy(const kvf_xfer_chan *c);

/* Little-endian encoding helpers for descriptors. */
kvf_status kvf_xfer_put_u32(kvf_sbuf *b, uint32_t v);
kvf_status kvf_xfer_put_u64(kvf_sbuf *b, uint64_t v);
uint32_t kvf_xfer_get_u32(const uint8_t *p);
uint64_t kvf_xfer_get_u64(const uint8_t *p);

#endif
