/* xfer_local.c: the "local" backend: memcpy between two kvf_xfer objects of one process, so the
 * layers above (prefill/decode wiring, block lifetimes) can be tested without UCX. A write
 * completes inside kvf_xfer_write: the bytes are copied, the receiver gets its notice and the
 * sender its SENT event at once. Descriptors name the process and a registry entry, so a
 * descriptor from another process or of a destroyed object is refused, never dereferenced. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "transport/xfer_impl.h"

/* The registry of live local objects: the one piece of global state here, because a
 * descriptor must be checkable without trusting the pointer inside it. */
typedef struct local_xfer {
    kvf_xfer *x;
    void *owned; /* the pool, when we allocated it */
    uint64_t token; /* unique per object: a recycled address never matches an old descriptor */
    struct local_xfer *next;
} local_xfer;

static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static local_xfer *registry;
static uint64_t next_token = 1;

typedef struct local_peer {
    uint64_t token;
} local_peer;

/* Finds a live object by token; the caller holds registry_mu. */
static local_xfer *registry_find(uint64_t token)
{
    for (local_xfer *l = registry; l; l = l->next)
        if (l->token == token)
            return l;
    return NULL;
}

static kvf_status local_open(kvf_xfer *x, const kvf_xfer_cfg *cfg, kvf_err *err)
{
    local_xfer *l = calloc(1, sizeof *l);
    if (!l)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: local: out of memory");
    l->x = x;
    if (!x->pool.base) {
        size_t bytes = (size_t)(x->pool.n_blocks * x->pool.layout.block_bytes);
        l->owned = calloc(1, bytes);
        if (!l->owned) {
            free(l);
            return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: local: out of memory for a %zu-byte pool",
                               bytes);
        }
        x->pool.base = l->owned;
    }
    pthread_mutex_lock(&registry_mu);
    l->token = next_token++;
    l->next = registry;
    registry = l;
    pthread_mutex_unlock(&registry_mu);
    x->impl = l;
    return KVF_OK;
}

static void local_close(kvf_xfer *x)
{
    local_xfer *l = x->impl;
    pthread_mutex_lock(&registry_mu);
    for (local_xfer **pp = &registry; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    pthread_mutex_unlock(&registry_mu);
    free(l->owned);
    free(l);
}

static kvf_status local_export(kvf_xfer *x, kvf_sbuf *out, kvf_err *err)
{
    local_xfer *l = x->impl;
    kvf_xfer_put_u64(out, (uint64_t)getpid());
    kvf_xfer_put_u64(out, l->token);
    return out->oom ? kvf_err_set(err, KVF_ERR_NOMEM, "xfer: local: out of memory") : KVF_OK;
}

static kvf_status local_connect(kvf_xfer *x, kvf_xfer_peer *peer, const uint8_t *blob,
                                size_t blob_len, kvf_err *err)
{
    if (blob_len != 16)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: local: descriptor blob has %zu bytes (16 expected)", blob_len);
    uint64_t pid = kvf_xfer_get_u64(blob), token = kvf_xfer_get_u64(blob + 8);
    if (pid != (uint64_t)getpid())
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: local: descriptor is from process %llu, this is %d (the local "
                           "backend works within one process; use ucx)",
                           (unsigned long long)pid, (int)getpid());
    pthread_mutex_lock(&registry_mu);
    bool live = registry_find(token) != NULL;
    pthread_mutex_unlock(&registry_mu);
    if (!live)
        return kvf_err_set(err, KVF_ERR_PEER_LOST,
                           "xfer: local: descriptor names object %llu, which no longer exists",
                           (unsigned long long)token);
    local_peer *lp = calloc(1, sizeof *lp);
    if (!lp)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: local: out of memory");
    lp->token = token;
    peer->impl = lp;
    return KVF_OK;
}

static void local_disconnect(kvf_xfer *x, kvf_xfer_peer *peer)
{
    free(peer->impl);
}

static kvf_status local_write(kvf_xfer *x, kvf_xfer_peer *peer, uint64_t id,
                              const kvf_xfer_token *token, const kvf_xfer_run *runs,
                              size_t n_runs, int64_t deadline_ns, kvf_err *err)
{
    local_peer *lp = peer->impl;
    if (kvf_now_ns() > deadline_ns)
        return kvf_err_set(err, KVF_ERR_TIMEOUT, "xfer: write %llu: deadline already passed",
                           (unsigned long long)id);
    /* The registry lock keeps the destination alive while we copy into it. */
    pthread_mutex_lock(&registry_mu);
    local_xfer *dst = registry_find(lp->token);
    if (!dst) {
        pthread_mutex_unlock(&registry_mu);
        peer->status = KVF_ERR_PEER_LOST;
        return kvf_err_set(err, KVF_ERR_PEER_LOST, "xfer: write %llu: the local peer was destroyed",
                           (unsigned long long)id);
    }
    int64_t bb = x->pool.layout.block_bytes;
    char *src_base = x->pool.base, *dst_base = dst->x->pool.base;
    for (size_t i = 0; i < n_runs; i++)
        memmove(dst_base + runs[i].dst * bb, src_base + runs[i].src * bb,
                (size_t)(runs[i].count * bb));
    kvf_xfer_notice(dst->x, id, token->b, KVF_OK);
    pthread_mutex_unlock(&registry_mu);
    kvf_xfer_sent(x, id, KVF_OK);
    return KVF_OK;
}

static kvf_status local_cancel(kvf_xfer *x, uint64_t id)
{
    return KVF_ERR_NOT_FOUND; /* writes finish inside kvf_xfer_write: nothing is ever in flight */
}

static void local_progress(kvf_xfer *x)
{
}

static int local_event_fd(kvf_xfer *x)
{
    return -1;
}

static bool local_arm(kvf_xfer *x)
{
    return false;
}

const kvf_xfer_ops kvf_xfer_local_ops = {
    .name = "local",
    .open = local_open,
    .close = local_close,
    .export_blob = local_export,
    .connect = local_connect,
    .disconnect = local_disconnect,
    .write = local_write,
    .cancel = local_cancel,
    .progress = local_progress,
    .event_fd = local_event_fd,
    .arm = local_arm,
};
