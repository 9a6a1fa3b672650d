/* xfer.c: the backend-independent half of kvf_xfer: picking a backend, the descriptor format,
 * checking pairs and coalescing them into runs, the event queue, the receiver's
 * expectations with their deadlines, and the pinned staging mirror that lets the ucx backend
 * move a GPU pool (device -> mirror before the backend writes, mirror -> device before RECEIVED).
 * How bytes move is left to xfer_local.c, xfer_ucx.c, xfer_cudaipc.c and xfer_nccl.c.
 *
 * Descriptor, version 1 (all integers little-endian):
 *   "KVFX" | u32 version | u8 backend name length | name | u32 n_layers | u32 n_kv_heads |
 *   u32 head_dim | u32 block_size | u32 dtype | u64 block_bytes | u64 n_blocks |
 *   u32 blob length | backend blob | u64 XXH3-64 of every byte before it
 * The checksum keeps a descriptor damaged in transit from reaching UCX's own parsers. */
#include <errno.h>
#include <stdlib.h>
#include <poll.h>
#include <string.h>
#include <sys/random.h>
#include <sys/types.h>

#include "common/hash.h"
#include "common/log.h"
#include "common/time.h"
#include "transport/xfer_impl.h"

#define DESC_MAGIC "KVFX"
#define DESC_FIXED (4 + 4 + 1 + 5 * 4 + 2 * 8 + 4 + 8) /* every field but the name and blob */

static const kvf_xfer_ops *const backends[] = {
    &kvf_xfer_ucx_ops, &kvf_xfer_local_ops, &kvf_xfer_cudaipc_ops,
#ifdef KVF_HAVE_NCCL
    &kvf_xfer_nccl_ops,
#endif
};
#define N_BACKENDS (sizeof backends / sizeof backends[0])

/* ---- little-endian helpers ---- */

kvf_status kvf_xfer_put_u32(kvf_sbuf *b, uint32_t v)
{
    uint8_t p[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    return kvf_sbuf_append(b, p, 4);
}

kvf_status kvf_xfer_put_u64(kvf_sbuf *b, uint64_t v)
{
    kvf_status st = kvf_xfer_put_u32(b, (uint32_t)v);
    return st != KVF_OK ? st : kvf_xfer_put_u32(b, (uint32_t)(v >> 32));
}

uint32_t kvf_xfer_get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint64_t kvf_xfer_get_u64(const uint8_t *p)
{
    return (uint64_t)kvf_xfer_get_u32(p) | (uint64_t)kvf_xfer_get_u32(p + 4) << 32;
}

/* ---- create / destroy ---- */

/* The GPU half of a configuration: which backends need the ops table, staging only with ucx,
 * a device pool given by the caller, a usable device. */
static kvf_status gpu_cfg_check(const kvf_xfer_ops *ops, const kvf_xfer_cfg *cfg,
                                const kvf_xfer_pool *pool, kvf_err *err)
{
    const kvf_xfer_gpu *g = cfg->gpu;
    if (ops->needs_gpu && !g)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: backend '%s' moves GPU pools and needs the GPU ops table "
                           "(kvf_xfer_cfg.gpu = kvf_cuda_xfer_gpu() from cuda/xfer_gpu.h); a host "
                           "pool uses ucx or local", ops->name);
    if (cfg->gpu_staging && strcmp(ops->name, "ucx") != 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: gpu_staging is for backend ucx only (backend is '%s')", ops->name);
    if (cfg->gpu_staging && !g)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: gpu_staging needs the GPU ops table (kvf_xfer_cfg.gpu)");
    if (!g)
        return KVF_OK;
    if (!ops->needs_gpu && !cfg->gpu_staging)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: backend '%s' cannot reach a GPU pool directly (use cuda_ipc or "
                           "nccl, or ucx with gpu_staging: this UCX has no CUDA transports)",
                           ops->name);
    if (!g->available || !g->copy_async || !g->mark || !g->mark_query || !g->mark_free ||
        !g->sync || (cfg->gpu_staging && (!g->host_alloc || !g->host_free)))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: GPU ops table '%s' lacks an op backend '%s' needs (available, "
                           "copy_async, mark, mark_query, mark_free, sync%s)",
                           g->name ? g->name : "?", ops->name,
                           cfg->gpu_staging ? ", host_alloc, host_free" : "");
    char why[256] = "";
    if (!g->available(g->ctx, why, sizeof why))
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED, "xfer: backend '%s'%s needs a GPU: %s",
                           ops->name, cfg->gpu_staging ? " with gpu_staging" : "", why);
    if (!pool->base)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: a GPU pool must be given (pool.base = the start of one device "
                           "allocation); the transport allocates host pools only");
    return KVF_OK;
}

const kvf_cfg_opt kvf_xfer_cfg_opts[] = {
    {"xfer-backend", "auto", "KV transfer backend: auto (cuda_ipc for a GPU pool, ucx for a host "
     "one), ucx, cuda_ipc or nccl (GPU pools), or local (one process, tests)",
     offsetof(kvf_xfer_cfg, backend), KVF_CFG_STR},
    {"xfer-transport", "auto", "ucx: its transport layers: auto (UCX_TLS honoured), tcp (between "
     "hosts or namespaces) or sm (shared memory, one host)",
     offsetof(kvf_xfer_cfg, transport), KVF_CFG_STR},
    {"xfer-net-devices", NULL, "ucx: network devices for tcp (UCX_NET_DEVICES), e.g. eth0",
     offsetof(kvf_xfer_cfg, net_devices), KVF_CFG_STR},
    {"xfer-data-path", "auto", "ucx: data path: auto (am over tcp, put otherwise), put, am",
     offsetof(kvf_xfer_cfg, data_path), KVF_CFG_STR},
    {"xfer-gpu-staging", NULL, "ucx with a GPU pool: move KV through a pinned host mirror of the "
     "pool (the path between nodes: this UCX has no CUDA transports)",
     offsetof(kvf_xfer_cfg, gpu_staging), KVF_CFG_BOOL},
    {"xfer-notice-host", NULL, "cuda_ipc, nccl: IPv4 address the transfer notice channel listens "
     "on and peers connect to (programs may default it; nccl between nodes needs this node's "
     "address)", offsetof(kvf_xfer_cfg, notice_host), KVF_CFG_STR},
    {"transport", "xfer-backend", NULL, 0, KVF_CFG_RENAMED},
    {NULL},
};

const char *kvf_xfer_backend_pick(const char *backend, bool gpu_pool, bool gpu_staging)
{
    const char *b = backend && *backend ? backend : "auto";
    if (strcmp(b, "auto") == 0)
        return gpu_pool && !gpu_staging ? "cuda_ipc" : "ucx";
    return b;
}

kvf_status kvf_xfer_create(const kvf_xfer_cfg *cfg, const kvf_xfer_pool *pool, kvf_xfer **out,
                           kvf_err *err)
{
    static const kvf_xfer_cfg defaults = {0};
    if (!cfg)
        cfg = &defaults;
    const char *name = kvf_xfer_backend_pick(cfg->backend, cfg->gpu != NULL, cfg->gpu_staging);
    const kvf_xfer_ops *ops = NULL;
    for (size_t i = 0; i < N_BACKENDS; i++)
        if (strcmp(backends[i]->name, name) == 0)
            ops = backends[i];
#ifndef KVF_HAVE_NCCL
    if (!ops && strcmp(name, "nccl") == 0)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "xfer: backend 'nccl' is not in this build (built without NCCL: it "
                           "needs CUDA and nccl.h/libnccl.so; use cuda_ipc on one node, or ucx "
                           "with gpu_staging)");
#endif
    if (!ops)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: backend '%s' is not known (use ucx, cuda_ipc, nccl or local)",
                           name);
    if (!pool || pool->n_blocks <= 0 || pool->n_blocks > INT32_MAX)
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: pool needs 1 to %d blocks (got %lld)",
                           INT32_MAX, pool ? (long long)pool->n_blocks : 0LL);
    kvf_kv_layout check;
    const kvf_kv_layout *l = &pool->layout;
    kvf_status st = kvf_kv_layout_init(l->n_layers, l->n_kv_heads, l->head_dim, l->block_size,
                                       l->dtype, &check, err);
    if (st != KVF_OK) {
        kvf_err_prefix(err, "xfer: pool");
        return st;
    }
    if (check.block_bytes != l->block_bytes)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: pool block_bytes %lld does not match its layout (%lld)",
                           (long long)l->block_bytes, (long long)check.block_bytes);
    if (pool->n_blocks > INT64_MAX / l->block_bytes)
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: pool of %lld blocks of %lld bytes overflows",
                           (long long)pool->n_blocks, (long long)l->block_bytes);

    if ((st = gpu_cfg_check(ops, cfg, pool, err)) != KVF_OK)
        return st;

    kvf_xfer *x = calloc(1, sizeof *x);
    if (!x)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: out of memory");
    x->ops = ops;
    x->pool = *pool;
    x->accept_unexpected = cfg->accept_unexpected;
    x->gpu = cfg->gpu;
    pthread_mutex_init(&x->mu, NULL);
    if (cfg->gpu_staging) {
        /* The backend registers the pinned mirror as its pool; the device pool stays ours. */
        size_t bytes = (size_t)(pool->n_blocks * l->block_bytes);
        st = cfg->gpu->host_alloc(cfg->gpu->ctx, bytes, &x->staging, err);
        if (st != KVF_OK) {
            kvf_err_prefix(err, "xfer: pinned staging mirror of %zu bytes", bytes);
            goto fail;
        }
        x->gpu_base = pool->base;
        x->pool.base = x->staging;
    }
    st = ops->open(x, cfg, err);
    if (st != KVF_OK)
        goto fail;
    *out = x;
    return KVF_OK;

fail:
    if (x->staging)
        cfg->gpu->host_free(cfg->gpu->ctx, x->staging);
    pthread_mutex_destroy(&x->mu);
    free(x);
    return st;
}

void kvf_xfer_destroy(kvf_xfer *x)
{
    if (!x)
        return;
    while (x->peers)
        kvf_xfer_disconnect(x, x->peers);
    x->ops->close(x);
    if (x->staging) {
        /* Copies into or out of the mirror must finish before it is freed. */
        kvf_err e = {0};
        if (x->gpu->sync(x->gpu->ctx, &e) != KVF_OK)
            kvf_log(KVF_LOG_WARN, "xfer: staging: waiting for copies at destroy: %s", e.msg);
        for (int side = 0; side < 2; side++) {
            kvf_xfer_stage *s = side ? x->stage_rx : x->stage_tx;
            while (s) {
                kvf_xfer_stage *next = s->next;
                x->gpu->mark_free(x->gpu->ctx, s->mark);
                free(s->runs);
                free(s);
                s = next;
            }
        }
        x->gpu->host_free(x->gpu->ctx, x->staging);
    }
    pthread_mutex_destroy(&x->mu);
    free(x->ev);
    for (size_t i = 0; i < x->n_exp; i++)
        free(x->exp[i].blocks);
    free(x->exp);
    free(x);
}

const char *kvf_xfer_backend_name(const kvf_xfer *x)
{
    return x->ops->name;
}

void *kvf_xfer_pool_base(const kvf_xfer *x)
{
    return x->staging ? x->gpu_base : x->pool.base;
}

/* ---- descriptors ---- */

/* Ends a descriptor: the backend's blob, length first, then the XXH3 of every byte
 * before the checksum; *out gets the bytes (malloc'd). b and blob are released either way. */
static kvf_status seal(kvf_sbuf *b, kvf_sbuf *blob, const char *what, uint8_t **out,
                       size_t *len_out, kvf_err *err)
{
    kvf_xfer_put_u32(b, (uint32_t)blob->len);
    if (blob->len)
        kvf_sbuf_append(b, blob->data, blob->len);
    if (!b->oom)
        kvf_xfer_put_u64(b, kvf_hash64(b->data, b->len));
    bool oom = b->oom || blob->oom;
    kvf_sbuf_fini(blob);
    if (oom) {
        kvf_sbuf_fini(b);
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: out of memory writing a %s", what);
    }
    *len_out = b->len;
    *out = (uint8_t *)kvf_sbuf_take(b);
    return KVF_OK;
}

kvf_status kvf_xfer_desc_export(kvf_xfer *x, uint8_t **desc_out, size_t *len_out, kvf_err *err)
{
    kvf_sbuf b, blob;
    kvf_sbuf_init(&blob);
    kvf_status st = x->ops->export_blob(x, &blob, err);
    if (st != KVF_OK) {
        kvf_sbuf_fini(&blob);
        return st;
    }
    const kvf_kv_layout *l = &x->pool.layout;
    size_t nl = strlen(x->ops->name);
    uint8_t nl8 = (uint8_t)nl;
    kvf_sbuf_init(&b);
    kvf_sbuf_append(&b, DESC_MAGIC, 4);
    kvf_xfer_put_u32(&b, KVF_XFER_DESC_VERSION);
    kvf_sbuf_append(&b, &nl8, 1);
    kvf_sbuf_append(&b, x->ops->name, nl);
    kvf_xfer_put_u32(&b, (uint32_t)l->n_layers);
    kvf_xfer_put_u32(&b, (uint32_t)l->n_kv_heads);
    kvf_xfer_put_u32(&b, (uint32_t)l->head_dim);
    kvf_xfer_put_u32(&b, (uint32_t)l->block_size);
    kvf_xfer_put_u32(&b, (uint32_t)l->dtype);
    kvf_xfer_put_u64(&b, (uint64_t)l->block_bytes);
    kvf_xfer_put_u64(&b, (uint64_t)x->pool.n_blocks);
    return seal(&b, &blob, "descriptor", desc_out, len_out, err);
}

kvf_status kvf_xfer_desc_parse(const uint8_t *desc, size_t len, kvf_xfer_desc_info *out,
                               kvf_err *err)
{
    kvf_xfer_desc_info d = {0};
    if (!desc || len < DESC_FIXED)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor of %zu bytes is too short (at least %d)", len,
                           DESC_FIXED);
    if (memcmp(desc, DESC_MAGIC, 4) != 0)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor does not start with \"KVFX\" (not a kvfleet descriptor)");
    uint32_t version = kvf_xfer_get_u32(desc + 4);
    if (version != KVF_XFER_DESC_VERSION)
        return kvf_err_set(err, KVF_ERR_UNSUPPORTED,
                           "xfer: descriptor version %u is not supported (this build reads %d)",
                           version, KVF_XFER_DESC_VERSION);
    if (kvf_xfer_get_u64(desc + len - 8) != kvf_hash64(desc, len - 8))
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor of %zu bytes fails its checksum (damaged or cut short "
                           "in transit)", len);
    size_t nl = desc[8];
    if (nl == 0 || nl >= sizeof d.backend || len < DESC_FIXED + nl)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor backend name length %zu is invalid (1 to %zu, within "
                           "%zu bytes)", nl, sizeof d.backend - 1, len);
    memcpy(d.backend, desc + 9, nl);
    for (size_t i = 0; i < nl; i++)
        if ((d.backend[i] < 'a' || d.backend[i] > 'z') && d.backend[i] != '_')
            return kvf_err_set(err, KVF_ERR_PARSE,
                               "xfer: descriptor backend name has byte 0x%02x (allowed: a-z, _)",
                               (unsigned)(uint8_t)d.backend[i]);
    const uint8_t *p = desc + 9 + nl;
    uint32_t f[5];
    for (int i = 0; i < 5; i++)
        f[i] = kvf_xfer_get_u32(p + 4 * i);
    p += 20;
    uint64_t block_bytes = kvf_xfer_get_u64(p), n_blocks = kvf_xfer_get_u64(p + 8);
    uint32_t blob_len = kvf_xfer_get_u32(p + 16);
    p += 20;
    for (int i = 0; i < 5; i++)
        if (f[i] > INT32_MAX)
            return kvf_err_set(err, KVF_ERR_PARSE, "xfer: descriptor layout field %d is %u (> %d)",
                               i, f[i], INT32_MAX);
    kvf_status st = kvf_kv_layout_init((int32_t)f[0], (int32_t)f[1], (int32_t)f[2], (int32_t)f[3],
                                       (kvf_dtype)f[4], &d.layout, err);
    if (st != KVF_OK) {
        kvf_err_prefix(err, "xfer: descriptor");
        return st;
    }
    if ((uint64_t)d.layout.block_bytes != block_bytes)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor block_bytes %llu does not match its layout (%lld)",
                           (unsigned long long)block_bytes, (long long)d.layout.block_bytes);
    if (n_blocks == 0 || n_blocks > INT32_MAX)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor n_blocks %llu is out of range (1 to %d)",
                           (unsigned long long)n_blocks, INT32_MAX);
    size_t off = (size_t)(p - desc);
    if (blob_len != len - off - 8)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor says %u backend bytes but %zu follow", blob_len,
                           len - off - 8);
    d.version = (int)version;
    d.n_blocks = (int64_t)n_blocks;
    d.blob_off = off;
    d.blob_len = blob_len;
    *out = d;
    return KVF_OK;
}

/* ---- peers ---- */

kvf_status kvf_xfer_connect(kvf_xfer *x, const uint8_t *desc, size_t len, kvf_xfer_peer **out,
                            kvf_err *err)
{
    kvf_xfer_desc_info d;
    kvf_status st = kvf_xfer_desc_parse(desc, len, &d, err);
    if (st != KVF_OK)
        return st;
    if (strcmp(d.backend, x->ops->name) != 0)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: descriptor is for backend '%s', this side uses '%s'", d.backend,
                           x->ops->name);
    st = kvf_kv_layout_check_same(&x->pool.layout, "this side", &d.layout, "the peer", err);
    if (st != KVF_OK) {
        kvf_err_prefix(err, "xfer: connect refused");
        return st;
    }
    kvf_xfer_peer *peer = calloc(1, sizeof *peer);
    if (!peer)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: out of memory");
    peer->owner = x;
    peer->layout = d.layout;
    peer->n_blocks = d.n_blocks;
    peer->status = KVF_OK;
    st = x->ops->connect(x, peer, desc + d.blob_off, d.blob_len, err);
    if (st != KVF_OK) {
        free(peer);
        return st;
    }
    peer->next = x->peers;
    x->peers = peer;
    *out = peer;
    return KVF_OK;
}

void kvf_xfer_disconnect(kvf_xfer *x, kvf_xfer_peer *peer)
{
    if (!peer)
        return;
    for (kvf_xfer_peer **pp = &x->peers; *pp; pp = &(*pp)->next)
        if (*pp == peer) {
            *pp = peer->next;
            break;
        }
    for (kvf_xfer_stage *t = x->stage_tx; t; t = t->next)
        if (t->peer == peer)
            t->peer = NULL; /* ends CANCELLED once its copies are done */
    x->ops->disconnect(x, peer);
    free(peer);
}

kvf_status kvf_xfer_peer_status(const kvf_xfer_peer *peer)
{
    return peer->status;
}

/* ---- writes ---- */

/* ---- the ucx staging path ----
 * Sender: each run is copied device -> mirror (same offsets), and only once those copies are done
 * does the backend get the write. Receiver: the backend's notice starts mirror -> device copies
 * of the announced blocks; the RECEIVED event follows once they are done. */

static kvf_status stage_tx_start(kvf_xfer *x, kvf_xfer_peer *peer, uint64_t id,
                                 const kvf_xfer_token *token, const kvf_xfer_run *runs,
                                 size_t n_runs, int64_t deadline_ns, kvf_err *err)
{
    const kvf_xfer_gpu *g = x->gpu;
    for (kvf_xfer_stage *t = x->stage_tx; t; t = t->next)
        if (t->id == id)
            return kvf_err_set(err, KVF_ERR_EXISTS, "xfer: write %llu: this id is already in "
                               "flight", (unsigned long long)id);
    kvf_xfer_stage *t = calloc(1, sizeof *t);
    kvf_xfer_run *rc = malloc(n_runs * sizeof *rc);
    if (!t || !rc) {
        free(t);
        free(rc);
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: write %llu: out of memory",
                           (unsigned long long)id);
    }
    memcpy(rc, runs, n_runs * sizeof *rc);
    t->token = *token;
    int64_t bb = x->pool.layout.block_bytes;
    char *dev = x->gpu_base, *host = x->staging;
    kvf_status st = KVF_OK;
    for (size_t i = 0; i < n_runs && st == KVF_OK; i++)
        st = g->copy_async(g->ctx, host + runs[i].src * bb, dev + runs[i].src * bb,
                           (size_t)(runs[i].count * bb), err);
    if (st == KVF_OK)
        st = g->mark(g->ctx, &t->mark, err);
    if (st != KVF_OK) {
        kvf_err e = {0};
        g->sync(g->ctx, &e); /* copies already enqueued read the pool: let them finish */
        free(rc);
        free(t);
        kvf_err_prefix(err, "xfer: write %llu: staging device -> host", (unsigned long long)id);
        return st;
    }
    t->id = id;
    t->peer = peer;
    t->runs = rc;
    t->n_runs = n_runs;
    t->deadline_ns = deadline_ns;
    t->next = x->stage_tx;
    x->stage_tx = t;
    return KVF_OK;
}

/* Hands writes whose copies finished to the backend (or ends them). Owner's thread. */
static void stage_tx_progress(kvf_xfer *x)
{
    const kvf_xfer_gpu *g = x->gpu;
    for (kvf_xfer_stage **pp = &x->stage_tx; *pp;) {
        kvf_xfer_stage *t = *pp;
        kvf_err e = {0};
        kvf_status st = g->mark_query(g->ctx, t->mark, &e);
        if (st == KVF_ERR_BUSY) {
            pp = &t->next;
            continue;
        }
        *pp = t->next;
        g->mark_free(g->ctx, t->mark);
        if (st != KVF_OK)
            kvf_log(KVF_LOG_ERROR, "xfer: write %llu: staging copy failed: %s",
                    (unsigned long long)t->id, e.msg);
        else if (t->cancelled || !t->peer)
            st = KVF_ERR_CANCELLED;
        else if (kvf_now_ns() >= t->deadline_ns)
            st = KVF_ERR_TIMEOUT;
        else if ((st = x->ops->write(x, t->peer, t->id, &t->token, t->runs, t->n_runs,
                                     t->deadline_ns, &e)) != KVF_OK)
            kvf_log(KVF_LOG_WARN, "xfer: write %llu: %s", (unsigned long long)t->id, e.msg);
        if (st != KVF_OK)
            kvf_xfer_sent(x, t->id, st);
        free(t->runs);
        free(t);
    }
}

static int run_cmp(const void *a, const void *b)
{
    const int32_t *p = a, *q = b;
    return (*p > *q) - (*p < *q);
}

/* Receiver, x->mu held: starts mirror -> device copies of blocks[n] (sorted here, adjacent
 * blocks in one copy) for transfer id. */
static kvf_status stage_rx_start_locked(kvf_xfer *x, uint64_t id, int32_t *blocks, size_t n,
                                        kvf_err *err)
{
    const kvf_xfer_gpu *g = x->gpu;
    kvf_xfer_stage *t = calloc(1, sizeof *t);
    if (!t)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: transfer %llu: out of memory",
                           (unsigned long long)id);
    qsort(blocks, n, sizeof *blocks, run_cmp);
    int64_t bb = x->pool.layout.block_bytes;
    char *dev = x->gpu_base, *host = x->staging;
    kvf_status st = KVF_OK;
    for (size_t i = 0; i < n && st == KVF_OK;) {
        size_t j = i + 1;
        while (j < n && blocks[j] == blocks[j - 1] + 1)
            j++;
        st = g->copy_async(g->ctx, dev + blocks[i] * bb, host + blocks[i] * bb,
                           (size_t)((int64_t)(j - i) * bb), err);
        i = j;
    }
    if (st == KVF_OK)
        st = g->mark(g->ctx, &t->mark, err);
    if (st != KVF_OK) {
        kvf_err e = {0};
        g->sync(g->ctx, &e);
        free(t);
        return st;
    }
    t->id = id;
    t->next = x->stage_rx;
    x->stage_rx = t;
    return KVF_OK;
}

static bool event_push_locked(kvf_xfer *x, kvf_xfer_event ev);

/* Delivers RECEIVED for transfers whose copies into device memory finished. */
static void stage_rx_progress(kvf_xfer *x)
{
    const kvf_xfer_gpu *g = x->gpu;
    pthread_mutex_lock(&x->mu);
    for (kvf_xfer_stage **pp = &x->stage_rx; *pp;) {
        kvf_xfer_stage *t = *pp;
        kvf_err e = {0};
        kvf_status st = g->mark_query(g->ctx, t->mark, &e);
        if (st == KVF_ERR_BUSY) {
            pp = &t->next;
            continue;
        }
        *pp = t->next;
        g->mark_free(g->ctx, t->mark);
        if (st != KVF_OK) {
            kvf_log(KVF_LOG_ERROR, "xfer: transfer %llu: staging copy host -> device failed: %s",
                    (unsigned long long)t->id, e.msg);
            x->stats.received_failed++;
        } else {
            x->stats.received_ok++;
        }
        event_push_locked(x, (kvf_xfer_event){.kind = KVF_XFER_RECEIVED, .id = t->id,
                                              .status = st});
        free(t);
    }
    pthread_mutex_unlock(&x->mu);
}

/* Pairs per write handled without allocating (kvf_xfer_write). */
#define WRITE_STACK_PAIRS 64

static int pair_cmp_dst(const void *a, const void *b)
{
    const kvf_xfer_pair *p = a, *q = b;
    return (p->dst > q->dst) - (p->dst < q->dst);
}

kvf_status kvf_xfer_write(kvf_xfer *x, kvf_xfer_peer *peer, uint64_t id,
                          const kvf_xfer_pair *pairs, size_t n, int64_t deadline_ns, kvf_err *err)
{
    return kvf_xfer_write_token(x, peer, id, NULL, pairs, n, deadline_ns, err);
}

kvf_status kvf_xfer_write_token(kvf_xfer *x, kvf_xfer_peer *peer, uint64_t id,
                                const kvf_xfer_token *token_in, const kvf_xfer_pair *pairs,
                                size_t n, int64_t deadline_ns, kvf_err *err)
{
    const kvf_xfer_token zero = {{0}};
    const kvf_xfer_token *token = token_in ? token_in : &zero;
    if (!peer || peer->owner != x)
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: write %llu: peer is not one of this xfer's",
                           (unsigned long long)id);
    if (peer->status == KVF_ERR_PEER_LOST)
        return kvf_err_set(err, peer->status, "xfer: write %llu: peer was lost (connect again)",
                           (unsigned long long)id);
    if (n == 0 || !pairs)
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: write %llu has no block pairs",
                           (unsigned long long)id);
    for (size_t i = 0; i < n; i++) {
        if (pairs[i].src < 0 || pairs[i].src >= x->pool.n_blocks)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "xfer: write %llu: pair %zu: source block %d is not in this pool "
                               "(0 to %lld)", (unsigned long long)id, i, pairs[i].src,
                               (long long)x->pool.n_blocks - 1);
        if (pairs[i].dst < 0 || pairs[i].dst >= peer->n_blocks)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "xfer: write %llu: pair %zu: destination block %d is not in the "
                               "peer's pool (0 to %lld)", (unsigned long long)id, i, pairs[i].dst,
                               (long long)peer->n_blocks - 1);
    }
    /* Short lists (the common case: a prompt's blocks) stay on the stack; a list already in
     * destination order is not sorted. At 64 KiB per write the two allocations and the sort
     * were a few percent of the copy's time. */
    kvf_xfer_pair sorted_buf[WRITE_STACK_PAIRS];
    kvf_xfer_run runs_buf[WRITE_STACK_PAIRS];
    bool heap = n > WRITE_STACK_PAIRS;
    kvf_xfer_pair *sorted = heap ? malloc(n * sizeof *sorted) : sorted_buf;
    kvf_xfer_run *runs = heap ? malloc(n * sizeof *runs) : runs_buf;
    kvf_status st = KVF_OK;
    if (!sorted || !runs) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "xfer: write %llu: out of memory for %zu pairs",
                         (unsigned long long)id, n);
        goto done;
    }
    memcpy(sorted, pairs, n * sizeof *sorted);
    bool ordered = true;
    for (size_t i = 1; i < n && ordered; i++)
        ordered = sorted[i - 1].dst <= sorted[i].dst;
    if (!ordered)
        qsort(sorted, n, sizeof *sorted, pair_cmp_dst);
    size_t n_runs = 0;
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && sorted[i].dst == sorted[i - 1].dst) {
            st = kvf_err_set(err, KVF_ERR_INVALID,
                             "xfer: write %llu: destination block %d appears twice (each "
                             "destination at most once)", (unsigned long long)id, sorted[i].dst);
            goto done;
        }
        kvf_xfer_run *r = n_runs ? &runs[n_runs - 1] : NULL;
        if (r && r->src + r->count == sorted[i].src && r->dst + r->count == sorted[i].dst) {
            r->count++;
        } else {
            runs[n_runs++] = (kvf_xfer_run){.src = sorted[i].src, .dst = sorted[i].dst, .count = 1};
        }
    }
    /* Counted before the backend runs (the local backend ends the write inside ops->write) and
     * taken back if it refuses the write: one lock per write, not two. */
    int64_t bytes = (int64_t)n * x->pool.layout.block_bytes;
    pthread_mutex_lock(&x->mu);
    x->stats.in_flight++;
    x->stats.writes++;
    x->stats.puts += (int64_t)n_runs;
    x->stats.bytes += bytes;
    pthread_mutex_unlock(&x->mu);
    if (x->staging)
        st = stage_tx_start(x, peer, id, token, runs, n_runs, deadline_ns, err);
    else
        st = x->ops->write(x, peer, id, token, runs, n_runs, deadline_ns, err);
    if (st != KVF_OK) {
        pthread_mutex_lock(&x->mu);
        x->stats.in_flight--;
        x->stats.writes--;
        x->stats.puts -= (int64_t)n_runs;
        x->stats.bytes -= bytes;
        pthread_mutex_unlock(&x->mu);
    }
done:
    if (heap) {
        free(sorted);
        free(runs);
    }
    return st;
}

/* ---- events and expectations ---- */

/* Queues an event; the caller holds x->mu. Returns false only when out of memory. */
static bool event_push_locked(kvf_xfer *x, kvf_xfer_event ev)
{
    if (x->ev_len == x->ev_cap) {
        size_t cap = x->ev_cap ? x->ev_cap * 2 : 64;
        kvf_xfer_event *nv = malloc(cap * sizeof *nv);
        if (!nv) {
            kvf_log(KVF_LOG_ERROR, "xfer: out of memory queueing the event of transfer %llu",
                    (unsigned long long)ev.id);
            return false;
        }
        for (size_t i = 0; i < x->ev_len; i++)
            nv[i] = x->ev[(x->ev_head + i) % x->ev_cap];
        free(x->ev);
        x->ev = nv;
        x->ev_cap = cap;
        x->ev_head = 0;
    }
    x->ev[(x->ev_head + x->ev_len) % x->ev_cap] = ev;
    x->ev_len++;
    return true;
}

void kvf_xfer_sent(kvf_xfer *x, uint64_t id, kvf_status st)
{
    kvf_xfer_event ev = {.kind = KVF_XFER_SENT, .id = id, .status = st};
    kvf_xfer_sent_many(x, &ev, 1);
}

void kvf_xfer_sent_many(kvf_xfer *x, const kvf_xfer_event *evs, size_t n)
{
    pthread_mutex_lock(&x->mu);
    for (size_t i = 0; i < n; i++) {
        x->stats.in_flight--;
        if (evs[i].status == KVF_OK)
            x->stats.sent_ok++;
        else
            x->stats.sent_failed++;
        event_push_locked(x, (kvf_xfer_event){.kind = KVF_XFER_SENT, .id = evs[i].id,
                                              .status = evs[i].status});
    }
    pthread_mutex_unlock(&x->mu);
}

/* Removes expectation i; the caller holds x->mu. */
static void exp_remove_locked(kvf_xfer *x, size_t i)
{
    free(x->exp[i].blocks);
    x->exp[i] = x->exp[--x->n_exp];
    x->stats.expected--;
}

static ssize_t exp_find_locked(const kvf_xfer *x, uint64_t id)
{
    for (size_t i = 0; i < x->n_exp; i++)
        if (x->exp[i].id == id)
            return (ssize_t)i;
    return -1;
}

bool kvf_xfer_expecting(kvf_xfer *x, uint64_t id)
{
    pthread_mutex_lock(&x->mu);
    bool yes = x->accept_unexpected || exp_find_locked(x, id) >= 0;
    pthread_mutex_unlock(&x->mu);
    return yes;
}

/* Whether token (NULL: zero) equals want, in time that does not depend on where they differ. */
static bool token_equal(const kvf_xfer_token *want, const uint8_t *token)
{
    uint8_t diff = 0;
    for (size_t i = 0; i < KVF_XFER_TOKEN_BYTES; i++)
        diff |= (uint8_t)(want->b[i] ^ (token ? token[i] : 0));
    return diff == 0;
}

/* A message for expected id whose token is wrong; the caller holds x->mu. */
static void forged_locked(kvf_xfer *x, uint64_t id)
{
    x->stats.forged_notices++;
    /* one line per 2^k forgeries: a flood cannot fill the log */
    int64_t n = x->stats.forged_notices;
    if ((n & (n - 1)) == 0)
        kvf_log(KVF_LOG_WARN, "xfer: transfer %llu: a message with the wrong token (forged or "
                "stale; %lld so far): dropped", (unsigned long long)id, (long long)n);
}

bool kvf_xfer_expecting_token(kvf_xfer *x, uint64_t id, const uint8_t *token)
{
    pthread_mutex_lock(&x->mu);
    ssize_t i = exp_find_locked(x, id);
    bool yes = i >= 0 ? token_equal(&x->exp[i].token, token) : x->accept_unexpected;
    if (i >= 0 && !yes)
        forged_locked(x, id);
    pthread_mutex_unlock(&x->mu);
    return yes;
}

bool kvf_xfer_notice(kvf_xfer *x, uint64_t id, const uint8_t *token, kvf_status st)
{
    pthread_mutex_lock(&x->mu);
    ssize_t i = exp_find_locked(x, id);
    if (i >= 0 && !token_equal(&x->exp[i].token, token)) {
        forged_locked(x, id);
        pthread_mutex_unlock(&x->mu);
        return false;
    }
    bool expected = i >= 0;
    if (expected && x->staging && st == KVF_OK) {
        /* The bytes are in the mirror: copy them into device memory, RECEIVED comes after. */
        kvf_err e = {0};
        kvf_status cst = stage_rx_start_locked(x, id, x->exp[i].blocks, x->exp[i].n_blocks, &e);
        exp_remove_locked(x, (size_t)i);
        if (cst == KVF_OK) {
            pthread_mutex_unlock(&x->mu);
            return true;
        }
        kvf_log(KVF_LOG_ERROR, "xfer: transfer %llu: staging host -> device: %s",
                (unsigned long long)id, e.msg);
        st = cst;
    } else if (expected)
        exp_remove_locked(x, (size_t)i);
    else
        x->stats.late_notices++;
    if (expected || x->accept_unexpected) {
        if (st == KVF_OK)
            x->stats.received_ok++;
        else
            x->stats.received_failed++;
        event_push_locked(x, (kvf_xfer_event){.kind = KVF_XFER_RECEIVED, .id = id, .status = st});
    }
    pthread_mutex_unlock(&x->mu);
    if (!expected && !x->accept_unexpected)
        kvf_log(KVF_LOG_WARN,
                "xfer: notice for transfer %llu that is not expected here (timed out, cancelled "
                "or never announced): dropped", (unsigned long long)id);
    return expected || x->accept_unexpected;
}

kvf_status kvf_xfer_expect(kvf_xfer *x, uint64_t id, int64_t deadline_ns, kvf_err *err)
{
    if (x->staging)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: expect %llu: the GPU staging path must know the destination "
                           "blocks: use kvf_xfer_expect_blocks", (unsigned long long)id);
    return kvf_xfer_expect_blocks(x, id, NULL, 0, deadline_ns, err);
}

kvf_status kvf_xfer_expect_blocks(kvf_xfer *x, uint64_t id, const int32_t *dst_blocks, size_t n,
                                  int64_t deadline_ns, kvf_err *err)
{
    return kvf_xfer_expect_token(x, id, NULL, dst_blocks, n, deadline_ns, err);
}

kvf_status kvf_xfer_token_new(kvf_xfer_token *out, kvf_err *err)
{
    size_t got = 0;
    while (got < sizeof out->b) {
        ssize_t r = getrandom(out->b + got, sizeof out->b - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return kvf_err_set(err, KVF_ERR_IO, "xfer: getrandom: %s", strerror(errno));
        got += (size_t)r;
    }
    return KVF_OK;
}

kvf_status kvf_xfer_expect_token(kvf_xfer *x, uint64_t id, const kvf_xfer_token *token,
                                 const int32_t *dst_blocks, size_t n, int64_t deadline_ns,
                                 kvf_err *err)
{
    kvf_status st = KVF_OK;
    int32_t *blocks = NULL;
    if (x->staging && (n == 0 || !dst_blocks))
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: expect %llu: no destination blocks (the "
                           "GPU staging path copies them into device memory)",
                           (unsigned long long)id);
    if (n > 0 && dst_blocks) {
        blocks = malloc(n * sizeof *blocks);
        if (!blocks)
            return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: expect %llu: out of memory",
                               (unsigned long long)id);
        memcpy(blocks, dst_blocks, n * sizeof *blocks);
        qsort(blocks, n, sizeof *blocks, run_cmp);
        for (size_t i = 0; i < n; i++) {
            if (blocks[i] < 0 || blocks[i] >= x->pool.n_blocks) {
                st = kvf_err_set(err, KVF_ERR_INVALID, "xfer: expect %llu: block %d is not in "
                                 "this pool (0 to %lld)", (unsigned long long)id, blocks[i],
                                 (long long)x->pool.n_blocks - 1);
                free(blocks);
                return st;
            }
            if (i > 0 && blocks[i] == blocks[i - 1]) {
                st = kvf_err_set(err, KVF_ERR_INVALID, "xfer: expect %llu: block %d appears "
                                 "twice", (unsigned long long)id, blocks[i]);
                free(blocks);
                return st;
            }
        }
    }
    pthread_mutex_lock(&x->mu);
    if (exp_find_locked(x, id) >= 0) {
        st = kvf_err_set(err, KVF_ERR_EXISTS, "xfer: transfer %llu is already expected",
                         (unsigned long long)id);
        goto unlock;
    }
    for (kvf_xfer_stage *t = x->stage_rx; t; t = t->next)
        if (t->id == id) {
            st = kvf_err_set(err, KVF_ERR_EXISTS, "xfer: transfer %llu is still being copied "
                             "into device memory", (unsigned long long)id);
            goto unlock;
        }
    if (x->n_exp == x->exp_cap) {
        size_t cap = x->exp_cap ? x->exp_cap * 2 : 16;
        kvf_xfer_expectation *ne = realloc(x->exp, cap * sizeof *ne);
        if (!ne) {
            st = kvf_err_set(err, KVF_ERR_NOMEM, "xfer: out of memory expecting transfer %llu",
                             (unsigned long long)id);
            goto unlock;
        }
        x->exp = ne;
        x->exp_cap = cap;
    }
    x->exp[x->n_exp++] = (kvf_xfer_expectation){.id = id, .deadline_ns = deadline_ns,
                                                .token = token ? *token : (kvf_xfer_token){{0}},
                                                .blocks = blocks, .n_blocks = blocks ? n : 0};
    blocks = NULL;
    x->stats.expected++;
unlock:
    pthread_mutex_unlock(&x->mu);
    free(blocks);
    return st;
}

kvf_status kvf_xfer_cancel(kvf_xfer *x, uint64_t id, kvf_err *err)
{
    pthread_mutex_lock(&x->mu);
    ssize_t i = exp_find_locked(x, id);
    if (i >= 0) {
        exp_remove_locked(x, (size_t)i);
        x->stats.received_failed++;
        event_push_locked(x, (kvf_xfer_event){.kind = KVF_XFER_RECEIVED, .id = id,
                                              .status = KVF_ERR_CANCELLED});
        pthread_mutex_unlock(&x->mu);
        return KVF_OK;
    }
    bool landing = false;
    for (kvf_xfer_stage *t = x->stage_rx; t; t = t->next)
        landing |= t->id == id;
    pthread_mutex_unlock(&x->mu);
    if (landing)
        return kvf_err_set(err, KVF_ERR_STATE, "xfer: cancel: transfer %llu has landed and is "
                           "being copied into device memory (wait for its event)",
                           (unsigned long long)id);
    for (kvf_xfer_stage *t = x->stage_tx; t; t = t->next)
        if (t->id == id) {
            t->cancelled = true; /* ends CANCELLED once its copies are done */
            return KVF_OK;
        }
    kvf_status st = x->ops->cancel(x, id);
    if (st == KVF_ERR_NOT_FOUND)
        return kvf_err_set(err, st, "xfer: cancel: transfer %llu is neither in flight nor expected",
                           (unsigned long long)id);
    if (st == KVF_ERR_STATE)
        return kvf_err_set(err, st,
                           "xfer: cancel: transfer %llu already notified its receiver (wait for "
                           "its event)", (unsigned long long)id);
    return st;
}

void kvf_xfer_progress(kvf_xfer *x)
{
    if (x->stage_tx)
        stage_tx_progress(x);
    x->ops->progress(x);
    if (x->stage_rx)
        stage_rx_progress(x);
    pthread_mutex_lock(&x->mu);
    /* The clock is read only when a deadline can fire (it is slow in VMs and this spins). */
    int64_t now = x->n_exp ? kvf_now_ns() : 0;
    for (size_t i = 0; i < x->n_exp;) {
        if (x->exp[i].deadline_ns > now) {
            i++;
            continue;
        }
        uint64_t id = x->exp[i].id;
        exp_remove_locked(x, i);
        x->stats.received_failed++;
        event_push_locked(x, (kvf_xfer_event){.kind = KVF_XFER_RECEIVED, .id = id,
                                              .status = KVF_ERR_TIMEOUT});
        kvf_log(KVF_LOG_WARN, "xfer: transfer %llu: no completion notice by its deadline",
                (unsigned long long)id);
    }
    pthread_mutex_unlock(&x->mu);
}

bool kvf_xfer_poll(kvf_xfer *x, kvf_xfer_event *ev_out)
{
    return kvf_xfer_poll_many(x, ev_out, 1) == 1;
}

size_t kvf_xfer_poll_many(kvf_xfer *x, kvf_xfer_event *evs, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&x->mu);
    for (; n < max && x->ev_len; n++) {
        evs[n] = x->ev[x->ev_head];
        x->ev_head = (x->ev_head + 1) % x->ev_cap;
        x->ev_len--;
    }
    pthread_mutex_unlock(&x->mu);
    return n;
}

int kvf_xfer_event_fd(kvf_xfer *x)
{
    return x->ops->event_fd(x);
}

bool kvf_xfer_arm(kvf_xfer *x)
{
    if (x->stage_tx || x->stage_rx)
        return false; /* GPU copies are polled, not waited on */
    return x->ops->arm(x);
}

#define WAIT_SPINS 256     /* progress passes before sleeping on the event fd */
#define WAIT_SLEEP_MS 2    /* longest sleep: deadlines fire only inside progress */

kvf_status kvf_xfer_wait(kvf_xfer *x, kvf_xfer_event *ev_out, int64_t deadline_ns, kvf_err *err)
{
    int fd = kvf_xfer_event_fd(x);
    for (;;) {
        for (int i = 0; i < WAIT_SPINS; i++) {
            if (kvf_xfer_poll(x, ev_out))
                return KVF_OK;
            kvf_xfer_progress(x);
            if (kvf_xfer_poll(x, ev_out))
                return KVF_OK;
        }
        int64_t left_ms = (deadline_ns - kvf_now_ns()) / 1000000;
        if (deadline_ns <= kvf_now_ns())
            return kvf_err_set(err, KVF_ERR_TIMEOUT, "xfer: no transfer event before the deadline");
        if (fd >= 0 && kvf_xfer_arm(x)) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            poll(&p, 1, (int)(left_ms < WAIT_SLEEP_MS ? left_ms : WAIT_SLEEP_MS));
        }
    }
}

void kvf_xfer_stats_get(const kvf_xfer *x, kvf_xfer_stats *out)
{
    pthread_mutex_lock((pthread_mutex_t *)&x->mu);
    *out = x->stats;
    pthread_mutex_unlock((pthread_mutex_t *)&x->mu);
}
