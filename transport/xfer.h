/* xfer.h: moving KV blocks between processes (DESIGN.md section 7). A kvf_xfer registers one KV
 * pool, exports a descriptor other processes connect to, writes lists of (local block -> remote
 * block) pairs and tells the receiver, per transfer id, that every byte has landed. It knows
 * nothing of the pool's allocator or of the control plane that carries descriptors and ids.
 *
 * Backends: "ucx" (RMA puts over UCX: tcp or shared memory on hosts; a GPU pool through a pinned
 * host mirror with gpu_staging), "cuda_ipc" (GPU to GPU on one node: device copies into the
 * peer's pool mapped through its CUDA IPC handle), "nccl" (GPU to GPU through a communicator per
 * sender-receiver pair, set up by kvf_xfer_connect over the pair's notice channel; only in builds
 * with NCCL) and "local"
 * (memcpy between two kvf_xfer objects of one process, for tests of the layers above). The GPU
 * backends reach device memory only through the kvf_xfer_gpu table the caller hands in, so
 * transport/ never links CUDA itself (cuda/xfer_gpu.h has the real one).
 *
 * Progress model: integrated with the caller's loop. Nothing happens unless the owner calls
 * kvf_xfer_progress (or kvf_xfer_wait, which calls it); a receiver must keep calling it, since
 * UCX tcp wire-up and the completion notice need the receiver's progress. An event loop can
 * sleep on kvf_xfer_event_fd between passes. A kvf_xfer and its peers are used from one thread
 * (the local backend may deliver notices into another thread's kvf_xfer: its event queue is
 * locked). No thread is started.
 *
 * Life of a transfer:
 *   receiver: kvf_xfer_expect(rx, id, deadline)        before the sender may write
 *   sender:   kvf_xfer_write(tx, peer, id, pairs, n, deadline)
 *             UCX: one put per run of adjacent blocks, flush, then an active message carrying
 *             (id, status); the receiver answers with an acknowledgement. (Over tcp the runs
 *             go as active messages and the notice carries the byte count: xfer_ucx.c.)
 *             cuda_ipc: one device copy per run into the peer's mapped pool, then a notice over
 *             the notice channel (TCP); nccl: a notice with the runs, then ncclSend, the
 *             receiver posting the matching ncclRecv; both acknowledged like UCX (README.md).
 *   receiver: event {KVF_XFER_RECEIVED, id, KVF_OK}: every byte of transfer id has landed;
 *             or {.., KVF_ERR_TIMEOUT} at its deadline when the sender died or stalled.
 *   sender:   event {KVF_XFER_SENT, id, KVF_OK} once the receiver acknowledged the notice; or
 *             KVF_ERR_PEER_LOST / KVF_ERR_TIMEOUT / KVF_ERR_CANCELLED, never later than
 *             the deadline (plus one progress call). Only then may the source blocks be freed:
 *             UCX reads them until the event.
 * Exactly one event is delivered per accepted write and per expect; the event names the
 * transfer id, so the caller knows which blocks to return to its pool.
 *
 * GPU pools (cfg.gpu): the source blocks must be complete in device memory before the write
 * (the transport's stream does not wait for the caller's); RECEIVED means the bytes are in the
 * receiver's device memory, visible to work it enqueues afterwards. */
#ifndef KVF_TRANSPORT_XFER_H
#define KVF_TRANSPORT_XFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/cfg.h"
#include "common/status.h"
#include "kv/layout.h"

typedef struct kvf_xfer kvf_xfer;
typedef struct kvf_xfer_peer kvf_xfer_peer;

/* Raw pool memory: n_blocks blocks of layout.block_bytes each, contiguous at base. Owned by the
 * caller; it must outlive the kvf_xfer registered on it. With base NULL the transport allocates
 * the pool itself (zeroed; UCX: memory a peer on the same host can map, so shared-memory puts are
 * one memcpy with no receiver involvement) and frees it at destroy; kvf_xfer_pool_base says where. */
typedef struct kvf_xfer_pool {
    void *base; /* [n_blocks][layout.block_bytes], or NULL */
    kvf_kv_layout layout;
    int64_t n_blocks;
} kvf_xfer_pool;

/* ---- GPU memory: what the GPU backends and the staging path need, as plain C ----------------
 * Implemented for CUDA by kvf_cuda_xfer_gpu() (cuda/xfer_gpu.h); tests use a host-memory double.
 * Every op returns a status with a message; none aborts. Copies and allocations marked "async"
 * are ordered on the table's one stream; a mark says when everything enqueued before it is done.
 * Owned by the caller; it must outlive every kvf_xfer created with it. */
#define KVF_XFER_IPC_HANDLE_BYTES 64
typedef struct kvf_xfer_gpu {
    const char *name; /* "cuda", or a test double's name */
    void *ctx;        /* passed to every op */
    /* Whether a device can be used; false with why ("no CUDA device: ... (35)"). */
    bool (*available)(void *ctx, char *why, size_t why_len);
    /* CUDA IPC. base must be the start of one device allocation. ipc_open maps a handle another
     * process exported (not one of this process) until ipc_close. */
    kvf_status (*ipc_export)(void *ctx, void *base, uint8_t handle_out[KVF_XFER_IPC_HANDLE_BYTES],
                             kvf_err *err);
    kvf_status (*ipc_open)(void *ctx, const uint8_t handle[KVF_XFER_IPC_HANDLE_BYTES],
                           void **base_out, kvf_err *err);
    void (*ipc_close)(void *ctx, void *base);
    /* Enqueues a copy of bytes from src to dst: device, pinned host or IPC-mapped memory (the
     * direction follows from the addresses). */
    kvf_status (*copy_async)(void *ctx, void *dst, const void *src, size_t bytes, kvf_err *err);
    /* A mark after everything enqueued so far. mark_query: KVF_OK once it is done, KVF_ERR_BUSY
     * while not, another status when the work failed. mark_free releases it (done or not). */
    kvf_status (*mark)(void *ctx, void **mark_out, kvf_err *err);
    kvf_status (*mark_query)(void *ctx, void *mark, kvf_err *err);
    void (*mark_free)(void *ctx, void *mark);
    /* Waits for everything enqueued (only where that is known to be bounded: local copies). */
    kvf_status (*sync)(void *ctx, kvf_err *err);
    /* Pinned host memory (UCX staging). */
    kvf_status (*host_alloc)(void *ctx, size_t bytes, void **out, kvf_err *err);
    void (*host_free)(void *ctx, void *p);
    /* Stream-ordered device memory (NCCL staging): usable by work enqueued after the alloc,
     * released once work enqueued before the free is done. */
    kvf_status (*dev_alloc_async)(void *ctx, size_t bytes, void **out, kvf_err *err);
    void (*dev_free_async)(void *ctx, void *p);
    /* The stream as an opaque pointer (a cudaStream_t, for NCCL). */
    void *(*stream)(void *ctx);
} kvf_xfer_gpu;

/* Transport choice. Programs expose it as flags and environment through kvf_xfer_cfg_opts
 * below: --xfer-backend / KVFLEET_XFER_BACKEND, --xfer-transport / KVFLEET_XFER_TRANSPORT,
 * --xfer-net-devices, --xfer-data-path, --xfer-gpu-staging, --xfer-notice-host. Zeroed fields
 * take the defaults. */
typedef struct kvf_xfer_cfg {
    const char *backend;     /* "auto" (default: kvf_xfer_backend_pick), "ucx", "cuda_ipc",
                              * "nccl" or "local" */
    const char *transport;   /* ucx: "auto" (default: UCX decides, UCX_TLS is honoured), "tcp"
                              * (needed between network namespaces), "sm" (shared memory, one host) */
    const char *net_devices; /* ucx: UCX_NET_DEVICES value, e.g. "lo" or "eth0"; NULL: all */
    const char *data_path;   /* ucx: "auto" (default: "am" over tcp, "put" otherwise), "put"
                              * (RMA puts + flush), "am" (eager active messages the receiver
                              * copies; see xfer_ucx.c for why tcp uses it) */
    bool accept_unexpected;  /* receiver: deliver notices for ids nobody expected as events
                              * (benchmarks); by default they are logged and dropped */
    /* The pool is device memory reached through these ops (NULL: host memory). Required by
     * cuda_ipc and nccl; with ucx it needs gpu_staging. pool.base must then be given: the start
     * of one device allocation. */
    const kvf_xfer_gpu *gpu;
    /* ucx with a GPU pool: bytes go device -> pinned host mirror -> UCX -> pinned mirror ->
     * device. The mirror is pinned host memory of the pool's size. Receivers must announce the
     * destination blocks (kvf_xfer_expect_blocks) so they can be copied in before RECEIVED. */
    bool gpu_staging;
    /* cuda_ipc, nccl: the address this side's notice channel (TCP) listens on and that peers
     * connect to; NULL: "127.0.0.1" (one node). Set the node's address for nccl across nodes. */
    const char *notice_host;
    /* The address the transfer plane binds (set by programs, e.g. from a --xfer-listen flag; no
     * flag of its own here). ucx: its tcp transport listens only on the network interface holding
     * this address (UCX binds an interface's address, so this restricts UCX_NET_DEVICES to that
     * interface plus the non-tcp devices, RDMA, which open no socket); net_devices may not name
     * another interface. nccl: NCCL's bootstrap and socket transport use that interface
     * (NCCL_SOCKET_IFNAME, unless the environment sets it). A numeric IPv4 or IPv6 address; NULL,
     * "", "0.0.0.0" or "::": every interface. The notice channel binds notice_host. */
    const char *listen_host;
} kvf_xfer_cfg;

/* The flags of a kvf_xfer_cfg, as a cfg table (offsets within kvf_xfer_cfg): a program includes
 * it in its kvf_cfg_spec.tables at the offset of its kvf_xfer_cfg member. */
extern const kvf_cfg_opt kvf_xfer_cfg_opts[];

/* The backend a cfg's backend name selects, "auto" (or none) resolved: cuda_ipc for a GPU pool
 * without gpu_staging, ucx otherwise. */
const char *kvf_xfer_backend_pick(const char *backend, bool gpu_pool, bool gpu_staging);

typedef struct kvf_xfer_pair {
    int32_t src; /* block in the sender's pool */
    int32_t dst; /* block in the receiver's pool */
} kvf_xfer_pair;

typedef enum kvf_xfer_event_kind {
    KVF_XFER_SENT = 1,     /* sender side: a write finished (status says how) */
    KVF_XFER_RECEIVED = 2, /* receiver side: an expected transfer landed, or timed out */
} kvf_xfer_event_kind;

typedef struct kvf_xfer_event {
    kvf_xfer_event_kind kind;
    uint64_t id;
    kvf_status status;
} kvf_xfer_event;

typedef struct kvf_xfer_stats {
    int64_t writes;         /* writes accepted */
    int64_t puts;           /* puts issued: one per run of adjacent blocks */
    int64_t bytes;          /* bytes put */
    int64_t sent_ok, sent_failed;
    int64_t received_ok, received_failed;
    int64_t late_notices;   /* notices for ids not expected (dropped unless accept_unexpected) */
    int64_t forged_notices; /* notices (and ucx data messages) for an expected id with the
                             * wrong token: dropped, the expectation stays */
    int64_t in_flight;      /* writes without their SENT event yet */
    int64_t expected;       /* expects without their RECEIVED event yet */
} kvf_xfer_stats;

/* Creates a kvf_xfer on pool (registering its memory with the backend). *out is owned by the
 * caller; kvf_xfer_destroy releases it. */
kvf_status kvf_xfer_create(const kvf_xfer_cfg *cfg, const kvf_xfer_pool *pool, kvf_xfer **out,
                           kvf_err *err);
/* Closes every peer (transfers in flight are dropped without events) and deregisters the pool. */
void kvf_xfer_destroy(kvf_xfer *x);
const char *kvf_xfer_backend_name(const kvf_xfer *x);
/* The pool's memory (the caller's, or the one the transport allocated; device memory with a GPU
 * pool, never the staging mirror). */
void *kvf_xfer_pool_base(const kvf_xfer *x);

/* The descriptor other processes connect with: a versioned byte string (layout, block count,
 * backend, addresses and remote keys) the control plane carries opaquely. *desc_out is malloc'd;
 * the caller frees it. */
kvf_status kvf_xfer_desc_export(kvf_xfer *x, uint8_t **desc_out, size_t *len_out, kvf_err *err);

#define KVF_XFER_DESC_VERSION 1
/* What a descriptor says, without connecting (for Info, logs and checks). */
typedef struct kvf_xfer_desc_info {
    int version;
    char backend[16];
    kvf_kv_layout layout;
    int64_t n_blocks;
    size_t blob_off, blob_len; /* backend part, inside the descriptor */
} kvf_xfer_desc_info;
/* Parses and checks a descriptor; names the field that is wrong. */
kvf_status kvf_xfer_desc_parse(const uint8_t *desc, size_t len, kvf_xfer_desc_info *out,
                               kvf_err *err);

/* Connects to the pool a descriptor describes. A descriptor of another backend, or a layout
 * that differs from ours (block size, dtype, layers, kv heads, head_dim), is refused here with
 * a message naming both values. *out belongs to x; kvf_xfer_disconnect or kvf_xfer_destroy
 * releases it. Backends whose receiver takes part in setting up the pair do it over their own
 * channel, with no call on the receiver's side (nccl: the sender's first notice-channel message
 * carries the communicator's unique id, and the receiver joins when it arrives, from its
 * kvf_xfer_progress); the peer reads KVF_ERR_BUSY until both sides finished, and writes queue. */
kvf_status kvf_xfer_connect(kvf_xfer *x, const uint8_t *desc, size_t len, kvf_xfer_peer **out,
                            kvf_err *err);

/* Closes a peer. Writes in flight to it end with KVF_ERR_CANCELLED events. */
void kvf_xfer_disconnect(kvf_xfer *x, kvf_xfer_peer *peer);
/* KVF_OK while the peer is usable; KVF_ERR_BUSY while wire-up is still in progress (UCX: it
 * needs both sides to progress; writes are accepted meanwhile and queue behind it);
 * KVF_ERR_PEER_LOST once it failed (connect again). Callers that want wire-up done before the
 * first transfer progress until this is KVF_OK. */
kvf_status kvf_xfer_peer_status(const kvf_xfer_peer *peer);

/* Starts writing pairs (n of them) to peer as transfer id. Every src must be a block of our
 * pool, every dst a block of the peer's, and no dst may appear twice. Pairs need not be sorted:
 * they are sorted by dst and adjacent runs are coalesced into one put each. deadline_ns is an
 * absolute kvf_now_ns() time. On KVF_OK exactly one SENT event for id follows; on any error
 * nothing was started and no event follows. id must not be in flight already (KVF_ERR_EXISTS). */
kvf_status kvf_xfer_write(kvf_xfer *x, kvf_xfer_peer *peer, uint64_t id,
                          const kvf_xfer_pair *pairs /* [n] */, size_t n, int64_t deadline_ns,
                          kvf_err *err);

/* Receiver: announces transfer id. Exactly one RECEIVED event for id follows: KVF_OK when the
 * sender's notice arrives, KVF_ERR_TIMEOUT at deadline_ns (kvf_now_ns() time) otherwise. */
kvf_status kvf_xfer_expect(kvf_xfer *x, uint64_t id, int64_t deadline_ns, kvf_err *err);
/* kvf_xfer_expect naming the destination blocks (n of them, each in this pool, none twice). The
 * ucx staging path needs them (they are copied from the pinned mirror into device memory before
 * the RECEIVED event) and refuses kvf_xfer_expect; other backends ignore them. */
kvf_status kvf_xfer_expect_blocks(kvf_xfer *x, uint64_t id, const int32_t *dst_blocks /* [n] */,
                                  size_t n, int64_t deadline_ns, kvf_err *err);

/* A transfer's capability: the receiver makes a random one per transfer
 * (kvf_xfer_token_new), hands it to the sender over the authenticated control plane with the
 * id, and accepts the sender's completion notice (and, on the ucx "am" path, its data
 * messages) only when it carries the same token, so nobody who can merely reach the notice
 * channel or the UCX listener completes or fills a transfer. The plain kvf_xfer_expect* and
 * kvf_xfer_write use the all-zero token (tests, one-process use). Compared in constant time. */
#define KVF_XFER_TOKEN_BYTES 16
typedef struct kvf_xfer_token {
    uint8_t b[KVF_XFER_TOKEN_BYTES];
} kvf_xfer_token;
/* 128 random bits from the kernel (getrandom). */
kvf_status kvf_xfer_token_new(kvf_xfer_token *out, kvf_err *err);
/* kvf_xfer_expect_blocks whose notice must carry token (NULL: the zero token); dst_blocks may
 * be NULL (n 0) where the backend does not need them. */
kvf_status kvf_xfer_expect_token(kvf_xfer *x, uint64_t id, const kvf_xfer_token *token,
                                 const int32_t *dst_blocks, size_t n, int64_t deadline_ns,
                                 kvf_err *err);
/* kvf_xfer_write whose notice carries token (NULL: the zero token). */
kvf_status kvf_xfer_write_token(kvf_xfer *x, kvf_xfer_peer *peer, uint64_t id,
                                const kvf_xfer_token *token, const kvf_xfer_pair *pairs,
                                size_t n, int64_t deadline_ns, kvf_err *err);

/* Cancels transfer id on either side (a sender whose notice reaches a receiver that already
 * timed out or cancelled gets KVF_ERR_CANCELLED too). Sender: the write ends with a
 * KVF_ERR_CANCELLED event once
 * the backend has let go of the source blocks; once the notice went out it is too late
 * (KVF_ERR_STATE: wait for the event); receiver:
 * the expectation ends with a KVF_ERR_CANCELLED event at once. KVF_ERR_NOT_FOUND when id is
 * neither in flight nor expected. A sender's notice that arrives after a receiver's cancel or
 * timeout is dropped; its bytes may still land in the destination blocks, so the control plane
 * should cancel the sender too before those blocks are reused. */
kvf_status kvf_xfer_cancel(kvf_xfer *x, uint64_t id, kvf_err *err);

/* One non-blocking pass: drives the backend, fires deadlines, queues events. */
void kvf_xfer_progress(kvf_xfer *x);
/* Pops one event: returns true and fills *ev_out, or false when none is queued. */
bool kvf_xfer_poll(kvf_xfer *x, kvf_xfer_event *ev_out);
/* Up to max queued events into evs, oldest first, under one lock; returns how many. */
size_t kvf_xfer_poll_many(kvf_xfer *x, kvf_xfer_event *evs, size_t max);
/* For event loops (epoll, libevent): a file descriptor that becomes readable when the transport
 * has work, or -1 (local backend: nothing to wait for). Protocol: progress and poll until idle,
 * then kvf_xfer_arm; if it returns true, sleep on the fd (and no longer than the nearest
 * deadline the caller cares about: deadlines fire only inside kvf_xfer_progress); if false,
 * progress again. The fd belongs to x. */
int kvf_xfer_event_fd(kvf_xfer *x);
bool kvf_xfer_arm(kvf_xfer *x);
/* Progresses until an event is queued (returns it) or deadline_ns passes (KVF_ERR_TIMEOUT).
 * Sleeps on the event fd between bursts of progress (waking at least every few ms for
 * deadlines), so a waiting process leaves the CPU to others. */
kvf_status kvf_xfer_wait(kvf_xfer *x, kvf_xfer_event *ev_out, int64_t deadline_ns, kvf_err *err);

void kvf_xfer_stats_get(const kvf_xfer *x, kvf_xfer_stats *out);

#endif
