/* xfer_impl.h: what the generic kvf_xfer layer (xfer.c) and its backends (xfer_local.c,
 * xfer_ucx.c) share: the backend vtable, the object layout, and the calls backends make back
 * into the generic layer (events, receiver notices). Private to transport/. */
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
    kvf_status (*write)(kvf_xfer *x, kvf_xfer_peer *peer, uint64_t id, const kvf_xfer_run *runs,
                        size_t n_runs, int64_t deadline_ns, kvf_err *err);
    /* Sender-side cancel: KVF_ERR_NOT_FOUND when id is not in flight here. */
    kvf_status (*cancel)(kvf_xfer *x, uint64_t id);
    void (*progress)(kvf_xfer *x);
    /* Event fd, or -1 when the backend has none (the caller then spins). */
    int (*event_fd)(kvf_xfer *x);
    /* Arms event_fd; false when work is already pending (progress again instead of sleeping). */
    bool (*arm)(kvf_xfer *x);
} kvf_xfer_ops;

extern const kvf_xfer_ops kvf_xfer_local_ops;
extern const kvf_xfer_ops kvf_xfer_ucx_ops;

typedef struct kvf_xfer_expectation {
    uint64_t id;
    int64_t deadline_ns;
} kvf_xfer_expectation;

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
/* Receiver: the sender's notice for id arrived with st. Returns whether it became an event:
 * false when id was not expected (and accept_unexpected is off), so the notice was dropped. */
bool kvf_xfer_notice(kvf_xfer *x, uint64_t id, kvf_status st);

/* Receiver: whether a transfer id is expected (or accept_unexpected is set). */
bool kvf_xfer_expecting(kvf_xfer *x, uint64_t id);

/* Little-endian encoding helpers for descriptors. */
kvf_status kvf_xfer_put_u32(kvf_sbuf *b, uint32_t v);
kvf_status kvf_xfer_put_u64(kvf_sbuf *b, uint64_t v);
uint32_t kvf_xfer_get_u32(const uint8_t *p);
uint64_t kvf_xfer_get_u64(const uint8_t *p);

#endif
