/* watch.c: the front end's decode and prefill pools kept in line with the fleet, and under the
 * kv policy each pooled worker's WatchKv stream read into its pool's index: a snapshot (it may
 * span several events) gathered then applied, deltas applied, load reports into the pool, a
 * sequence gap answered by a new stream. Runs on the HTTP loop thread, woken by the streams
 * (http_int.h); the fleet's health thread and the policies' scoring live elsewhere. */
#include "router/watch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "proto/worker.h"

/* The kv policy's view of one worker: its WatchKv stream and what the stream has told. */
typedef struct kv_watch {
    kvf_rpc_stream *stream;
    kvf_router_wake wake;
    kvf_router_feed feed;
    kvf_router_worker_state last_state; /* for logging state changes (stale, resync, live) */
} kv_watch;

struct kvf_router_watch {
    kvf_router_fleet *fleet;
    kvf_router_policy policy;
    kvf_router_kv_cfg cfg; /* the pools' knobs */
    kvf_router_pool *pool[2];
    bool in_pool[2][KVF_ROUTER_MAX_WORKERS];
    kvf_router_worker workers[2][KVF_ROUTER_MAX_WORKERS]; /* by id, from the last sync */
    kv_watch kv[2][KVF_ROUTER_MAX_WORKERS];               /* kv policy: WatchKv per worker */
    kvf_metric *m_up[2];            /* healthy workers, per role */
    kvf_metric *m_idx_state[2][3];  /* kv policy: workers live / stale / resync, per role */
    kvf_metric *m_idx_blocks[2];    /* kv policy: blocks in each role's index */
    kvf_metric *m_idx_tier[2][3];   /* kv policy: (block, worker) pairs per tier, per role */
};

static const char *role_name(int role)
{
    return role ? "prefill" : "decode";
}

/* ---------------------------------------------------------------------------------------- */
/* One worker's WatchKv messages (kvf_router_feed)                                           */

void kvf_router_kv_cfg_default(kvf_router_kv_cfg *cfg)
{
    kvf_router_pool_cfg pc;
    kvf_router_pool_cfg_default(&pc);
    *cfg = (kvf_router_kv_cfg){
        .load_bound = pc.load_bound, .load_window_s = pc.load_window_s, .load_penalty = pc.load_penalty,
        .host_s_per_block = pc.host_s_per_block, .disk_s_per_block = pc.disk_s_per_block,
        .approx = false, .approx_ttl_s = 3600, .approx_max_blocks = pc.approx_max_blocks,
    };
}

kvf_status kvf_router_kv_cfg_check(const kvf_router_kv_cfg *c, kvf_err *err)
{
    if (!(c->load_bound == 0 || (c->load_bound >= 1 && isfinite(c->load_bound))))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --load-bound=%g is out of range (0 = off, or a "
                           "finite number >= 1)", c->load_bound);
    if (!(c->load_window_s > 0 && isfinite(c->load_window_s)))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --load-window=%g is out of range (seconds, "
                           "finite and > 0)", c->load_window_s);
    if (!(c->load_penalty >= 0 && isfinite(c->load_penalty)))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --load-penalty=%g is out of range (finite and "
                           ">= 0)", c->load_penalty);
    if (!(c->host_s_per_block >= 0 && isfinite(c->host_s_per_block)))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --host-promote-s-per-block=%g is out of range "
                           "(seconds, finite and >= 0)", c->host_s_per_block);
    if (!(c->disk_s_per_block >= 0 && isfinite(c->disk_s_per_block)))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --disk-promote-s-per-block=%g is out of range "
                           "(seconds, finite and >= 0)", c->disk_s_per_block);
    if (!(c->approx_ttl_s > 0 && isfinite(c->approx_ttl_s)))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --approx-ttl=%g is out of range (seconds, "
                           "finite and > 0)", c->approx_ttl_s);
    if (c->approx_max_blocks < 1 || c->approx_max_blocks > (1 << 30))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: approximate mode's %lld predicted blocks per "
                           "worker are out of range (1 to 2^30)", (long long)c->approx_max_blocks);
    return KVF_OK;
}

/* The most blocks one worker's snapshot may name (pool and tiers together): 4 Mi blocks of 16
 * tokens are 64 Mi cached tokens; the parts gathered hold 17 bytes a block. */
#define FEED_SNAPSHOT_MAX (1 << 22)

/* Adds one snapshot part (its blocks all in its tier) to what is gathered. */
static kvf_status feed_gather(kvf_router_feed *f, const kvf_rpc_kv_event *e, kvf_err *err)
{
    if (e->n > FEED_SNAPSHOT_MAX || f->snap_n + e->n > FEED_SNAPSHOT_MAX) {
        /* a worker that never ends its snapshot must not grow the router without bound */
        size_t had = f->snap_n;
        f->snap_n = 0;
        return kvf_err_set(err, KVF_ERR_STATE, "router: a snapshot of more than %d blocks (%zu "
                           "gathered, %zu more) is refused; a new snapshot is asked for",
                           FEED_SNAPSHOT_MAX, had, e->n);
    }
    if (f->snap_n + e->n > f->snap_cap) {
        size_t cap = (f->snap_n + e->n) * 2 + 64;
        uint64_t *hh = realloc(f->snap_h, cap * sizeof *hh);
        if (hh)
            f->snap_h = hh;
        uint64_t *pp = hh ? realloc(f->snap_p, cap * sizeof *pp) : NULL;
        if (pp)
            f->snap_p = pp;
        uint8_t *tt = pp ? realloc(f->snap_t, cap * sizeof *tt) : NULL;
        if (!tt)
            return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory gathering a snapshot of %zu blocks",
                               f->snap_n + e->n);
        f->snap_t = tt;
        f->snap_cap = cap;
    }
    if (e->n)
        memcpy(f->snap_h + f->snap_n, e->block_hashes, e->n * sizeof *f->snap_h);
    for (size_t i = 0; i < e->n; i++) {
        f->snap_p[f->snap_n + i] = e->parent_hashes ? e->parent_hashes[i] : 0;
        f->snap_t[f->snap_n + i] = (uint8_t)e->tier; /* the index refuses a tier outside 0..2 */
    }
    f->snap_n += e->n;
    return KVF_OK;
}

kvf_status kvf_router_feed_apply(kvf_router_feed *f, kvf_router_pool *p, int32_t id,
                                 const kvf_rpc_watch_msg *m, bool approx, double now, kvf_err *err)
{
    if (m->is_load) {
        f->load = (kvf_router_load){
            .queued_prefill_tokens = m->load.queued_prefill_tokens,
            .decode_load = (double)m->load.running + (double)m->load.waiting,
            .host_s_per_block = m->load.host_promote_s_per_block,
            .disk_s_per_block = m->load.disk_promote_s_per_block,
        };
        f->have_load = true;
        kvf_router_pool_load_set(p, id, &f->load, now);
        return KVF_OK;
    }
    if (approx)
        return KVF_OK; /* the pool predicts this worker's cache from the router's own decisions */
    const kvf_rpc_kv_event *e = &m->event;
    if (e->tier < 0 || e->tier > KVF_RPC_TIER_DISK) { /* proto/ refuses these; never half a snapshot */
        bool snap = e->kind == KVF_RPC_KV_SNAPSHOT;
        f->snap_n = snap ? 0 : f->snap_n;
        return kvf_err_set(err, snap ? KVF_ERR_STATE : KVF_ERR_INVALID, "router: worker %d: KV event names "
                           "tier %d (use 0 pool, 1 host, 2 disk)%s", (int)id, (int)e->tier,
                           snap ? "; a new snapshot is asked for" : "");
    }
    kvf_router_event ev = {.worker = id, .seq = e->seq, .model = e->model_id, .block_size = e->block_size,
                           .hashes = e->block_hashes, .parents = e->parent_hashes, .n = e->n,
                           .tier = e->tier};
    kvf_status st;
    switch (e->kind) {
    case KVF_RPC_KV_SNAPSHOT:
        /* gather the parts (each in its own tier), apply once at snapshot_done */
        if ((st = feed_gather(f, e, err)) != KVF_OK)
            return st;
        if (!e->snapshot_done)
            return KVF_OK;
        ev.kind = KVF_ROUTER_EV_SNAPSHOT;
        ev.hashes = f->snap_h;
        ev.parents = f->snap_p;
        ev.tiers = f->snap_t;
        ev.tier = KVF_ROUTER_TIER_POOL;
        ev.n = f->snap_n;
        f->snap_n = 0;
        break;
    case KVF_RPC_KV_STORED: ev.kind = KVF_ROUTER_EV_STORED; break;   /* new, or moved to e->tier */
    case KVF_RPC_KV_REMOVED: ev.kind = KVF_ROUTER_EV_REMOVED; break; /* gone from every tier */
    case KVF_RPC_KV_CLEARED:
        ev.kind = KVF_ROUTER_EV_SNAPSHOT; /* an empty snapshot */
        ev.n = 0;
        ev.tier = KVF_ROUTER_TIER_POOL;
        break;
    default: return KVF_OK;
    }
    st = kvf_router_index_apply(kvf_router_pool_index(p), &ev, now, err);
    if (st == KVF_OK && ev.kind == KVF_ROUTER_EV_SNAPSHOT)
        f->synced = true;
    return st;
}

void kvf_router_feed_reset(kvf_router_feed *f)
{
    f->snap_n = 0;
    f->have_load = false;
    f->synced = false;
}

void kvf_router_feed_fini(kvf_router_feed *f)
{
    free(f->snap_h);
    free(f->snap_p);
    free(f->snap_t);
    *f = (kvf_router_feed){0};
}

/* ---------------------------------------------------------------------------------------- */
/* One worker's WatchKv stream                                                               */

static void kv_close(kv_watch *k)
{
    kvf_rpc_stream_destroy(k->stream);
    k->stream = NULL;
    kvf_router_feed_reset(&k->feed);
}

/* Opens WatchKv on a worker (the worker answers with a snapshot, then deltas and load). */
static void kv_open(kvf_router_watch *w, int role, int32_t id)
{
    kv_watch *k = &w->kv[role][id];
    kv_close(k);
    char rid[64];
    snprintf(rid, sizeof rid, "router-%d", (int)getpid());
    kvf_rpc_watch_req q = {.router_id = rid, .load_interval_ms = 500};
    kvf_rpc_buf b = {0};
    kvf_err err = {0};
    if (kvf_rpc_watch_req_encode(&q, &b, &err) != KVF_OK ||
        kvf_rpc_stream_open(w->workers[role][id].channel, KVF_RPC_WORKER_WATCH_KV, b.data, b.len,
                            KVF_RPC_NO_DEADLINE, &k->stream, &err) != KVF_OK)
        kvf_log(KVF_LOG_WARN, "router: WatchKv on %s: %s", w->workers[role][id].address, err.msg);
    else
        kvf_rpc_stream_notify(k->stream, kvf_router_wake_notify, &k->wake);
    kvf_rpc_buf_free(&b);
}

/* Reads what one WatchKv stream has: events into the index, load reports into the pool. At most
 * 256 messages a pass, then the stream is marked ready again so HTTP gets a turn. */
static void kv_drain(kvf_router_watch *w, int role, int32_t id, double now)
{
    kv_watch *k = &w->kv[role][id];
    for (int n = 0; k->stream; n++) {
        if (n == 256) {
            kvf_router_wake_notify(&k->wake);
            return;
        }
        kvf_rpc_buf m = {0};
        bool done = false;
        kvf_err err = {0};
        kvf_status st = kvf_rpc_stream_read(k->stream, 0, &m, &done, &err);
        if (done) {
            kvf_log(KVF_LOG_INFO, "router: WatchKv on %s ended: %s", w->workers[role][id].address,
                    st == KVF_OK ? "ok" : err.msg);
            kv_close(k); /* reopened at the next sync while the worker is healthy */
            return;
        }
        if (st != KVF_OK)
            return;
        kvf_rpc_watch_msg *r = NULL;
        bool keep = true;
        if (kvf_rpc_watch_msg_decode(m.data, m.len, &r, &err) == KVF_OK && w->pool[role]) {
            st = kvf_router_feed_apply(&k->feed, w->pool[role], id, r, w->cfg.approx, now, &err);
            if (st != KVF_OK)
                kvf_log(KVF_LOG_DEBUG, "router: WatchKv on %s: %s", w->workers[role][id].address, err.msg);
            keep = st != KVF_ERR_STATE && st != KVF_ERR_NOMEM;
        }
        free(r);
        kvf_rpc_buf_free(&m);
        if (!keep) {
            kv_open(w, role, id); /* a gap: a new watch starts with a snapshot */
            return;
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The pools                                                                                 */

void kvf_router_watch_sync(kvf_router_watch *w)
{
    double now = kvf_now_s();
    int32_t bs = kvf_router_fleet_block_size(w->fleet); /* set: a worker is healthy */
    bool kv = w->policy == KVF_ROUTER_POLICY_KV;
    for (int role = 0; role < 2; role++) {
        kvf_router_worker ws[KVF_ROUTER_MAX_WORKERS];
        int32_t n = kvf_router_fleet_snapshot(w->fleet, (kvf_router_role)role, ws);
        bool want[KVF_ROUTER_MAX_WORKERS] = {0};
        int32_t up = 0;
        for (int32_t i = 0; i < n; i++) {
            kvf_router_worker *wk = &ws[i];
            w->workers[role][wk->id] = *wk;
            want[wk->id] = wk->healthy && !wk->gone;
            if (!want[wk->id])
                continue;
            if (!w->pool[role]) {
                kvf_router_pool_cfg pc;
                kvf_router_pool_cfg_default(&pc);
                pc.policy = w->policy;
                pc.index.model = wk->model_id;
                pc.index.block_size = bs;
                pc.load_bound = w->cfg.load_bound;
                pc.load_window_s = w->cfg.load_window_s;
                pc.load_penalty = w->cfg.load_penalty;
                pc.host_s_per_block = w->cfg.host_s_per_block;
                pc.disk_s_per_block = w->cfg.disk_s_per_block;
                /* the kv policy follows the workers' WatchKv events, unless approx */
                pc.approx = w->cfg.approx && kv;
                pc.approx_ttl_s = w->cfg.approx_ttl_s;
                pc.approx_max_blocks = w->cfg.approx_max_blocks;
                kvf_err err = {0};
                if (kvf_router_pool_create(&pc, &w->pool[role], &err) != KVF_OK) {
                    kvf_log(KVF_LOG_ERROR, "router: %s", err.msg);
                    continue;
                }
            }
            if (w->in_pool[role][wk->id] && kv && !w->kv[role][wk->id].stream)
                kv_open(w, role, wk->id); /* its stream ended: a new one, with a snapshot */
            if (!w->in_pool[role][wk->id]) {
                kvf_err err = {0};
                if (kvf_router_pool_worker_add(w->pool[role], wk->id, wk->model_id, bs,
                                               kv && !w->cfg.approx, now, &err) != KVF_OK) {
                    want[wk->id] = false;
                    continue;
                }
                w->in_pool[role][wk->id] = true;
                /* approx: no more predictions than the worker's KV pool holds */
                if (kv && w->cfg.approx &&
                    kvf_router_pool_worker_capacity(w->pool[role], wk->id, wk->capacity_blocks, &err) != KVF_OK)
                    kvf_log(KVF_LOG_WARN, "router: %s", err.msg);
                if (kv)
                    kv_open(w, role, wk->id); /* load reports; KV events too unless approx */
            }
            up++;
        }
        for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
            if (w->in_pool[role][i] && !want[i]) {
                kvf_router_pool_worker_remove(w->pool[role], i);
                w->in_pool[role][i] = false;
                kv_close(&w->kv[role][i]);
            }
        kvf_metric_set(w->m_up[role], up);
    }
}

void kvf_router_watch_drain(kvf_router_watch *w, bool all)
{
    double now = kvf_now_s();
    for (int role = 0; role < 2; role++)
        for (int32_t id = 0; id < KVF_ROUTER_MAX_WORKERS; id++) {
            kv_watch *k = &w->kv[role][id];
            bool ready = kvf_router_wake_take(&k->wake);
            if (k->stream && (ready || all))
                kv_drain(w, role, id, now);
        }
}

int32_t kvf_router_watch_health(kvf_router_watch *w)
{
    int32_t unsynced = 0;
    double now = kvf_now_s();
    for (int role = 0; role < 2; role++) {
        int32_t count[3] = {0};
        for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS && w->pool[role]; i++) {
            if (!w->in_pool[role][i])
                continue;
            kv_watch *k = &w->kv[role][i];
            kvf_router_worker_state stt = kvf_router_index_worker_state(kvf_router_pool_index(w->pool[role]), i, now);
            if (stt != k->last_state && stt != KVF_ROUTER_WORKER_ABSENT)
                kvf_log(stt == KVF_ROUTER_WORKER_LIVE ? KVF_LOG_INFO : KVF_LOG_WARN,
                        "router: %s worker %s: KV index %s%s", role_name(role), w->workers[role][i].address,
                        kvf_router_worker_state_name(stt),
                        stt == KVF_ROUTER_WORKER_STALE ? " (no KV event or load report lately; its entries decay)"
                        : stt == KVF_ROUTER_WORKER_RESYNC ? " (sequence gap; waiting for a fresh snapshot)" : "");
            k->last_state = stt;
            count[stt == KVF_ROUTER_WORKER_STALE ? 1 : stt == KVF_ROUTER_WORKER_RESYNC ? 2 : 0] +=
                stt != KVF_ROUTER_WORKER_ABSENT;
            unsynced += !w->cfg.approx && !k->feed.synced; /* approx: no snapshot is awaited */
        }
        for (int s = 0; s < 3; s++)
            kvf_metric_set(w->m_idx_state[role][s], count[s]);
        if (w->pool[role]) {
            kvf_router_index_stats is;
            kvf_router_index_stats_get(kvf_router_pool_index(w->pool[role]), &is);
            kvf_metric_set(w->m_idx_blocks[role], (double)is.n_blocks);
            kvf_metric_set(w->m_idx_tier[role][0], (double)(is.n_pairs - is.n_pairs_host - is.n_pairs_disk));
            kvf_metric_set(w->m_idx_tier[role][1], (double)is.n_pairs_host);
            kvf_metric_set(w->m_idx_tier[role][2], (double)is.n_pairs_disk);
        }
    }
    return unsynced;
}

/* ---------------------------------------------------------------------------------------- */
/* What picking reads                                                                        */

kvf_router_pool *kvf_router_watch_pool(kvf_router_watch *w, kvf_router_role role)
{
    return w->pool[role];
}

bool kvf_router_watch_in_pool(const kvf_router_watch *w, kvf_router_role role, int32_t id)
{
    return id >= 0 && id < KVF_ROUTER_MAX_WORKERS && w->in_pool[role][id];
}

int32_t kvf_router_watch_n_in_pool(const kvf_router_watch *w, kvf_router_role role)
{
    int32_t n = 0;
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
        n += w->in_pool[role][i];
    return n;
}

const kvf_router_worker *kvf_router_watch_worker(const kvf_router_watch *w, kvf_router_role role,
                                                 int32_t id)
{
    return &w->workers[role][id];
}

bool kvf_router_watch_load(const kvf_router_watch *w, kvf_router_role role, int32_t id,
                           kvf_router_load *out)
{
    const kv_watch *k = &w->kv[role][id];
    if (k->feed.have_load)
        *out = k->feed.load;
    return k->feed.have_load;
}

void kvf_router_watch_drop(kvf_router_watch *w, kvf_router_role role, int32_t id)
{
    if (w->pool[role] && w->in_pool[role][id]) {
        kvf_router_pool_worker_remove(w->pool[role], id);
        w->in_pool[role][id] = false;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Life cycle                                                                                */

kvf_status kvf_router_watch_create(kvf_router_fleet *fleet, kvf_router_policy policy,
                                   const kvf_router_kv_cfg *kv, kvf_metrics *m, kvf_router_http *h,
                                   kvf_router_watch **out, kvf_err *err)
{
    kvf_router_watch *w = calloc(1, sizeof *w);
    if (!w)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    w->fleet = fleet;
    w->policy = policy;
    if (kv)
        w->cfg = *kv;
    else
        kvf_router_kv_cfg_default(&w->cfg);
    for (int r = 0; r < 2; r++)
        for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
            w->kv[r][i].wake.h = h;
    static const char *const states[3] = {"live", "stale", "resync"};
    kvf_status st;
    for (int r = 0; r < 2; r++) {
        char labels[64];
        snprintf(labels, sizeof labels, "role=\"%s\"", role_name(r));
        if ((st = kvf_metrics_gauge(m, "kvfleet_router_healthy_workers", labels, "workers passing health checks",
                                    &w->m_up[r], err)) != KVF_OK)
            goto fail;
    }
    for (int r = 0; r < 2; r++) {
        char labels[64];
        for (int s = 0; s < 3; s++) {
            snprintf(labels, sizeof labels, "role=\"%s\",state=\"%s\"", role_name(r), states[s]);
            if ((st = kvf_metrics_gauge(m, "kvfleet_router_index_workers", labels,
                                        "kv policy: workers by the state of their KV events (stale: events and load "
                                        "reports stopped, entries decaying; resync: waiting for a snapshot)",
                                        &w->m_idx_state[r][s], err)) != KVF_OK)
                goto fail;
        }
        snprintf(labels, sizeof labels, "role=\"%s\"", role_name(r));
        if ((st = kvf_metrics_gauge(m, "kvfleet_router_index_blocks", labels, "kv policy: blocks in the index",
                                    &w->m_idx_blocks[r], err)) != KVF_OK)
            goto fail;
        static const char *const tiers[3] = {"pool", "host", "disk"};
        for (int t = 0; t < 3; t++) {
            snprintf(labels, sizeof labels, "role=\"%s\",tier=\"%s\"", role_name(r), tiers[t]);
            if ((st = kvf_metrics_gauge(m, "kvfleet_router_index_worker_blocks", labels,
                                        "kv policy: blocks the index says workers hold, once per worker "
                                        "holding each, by the tier they are in (pool, host memory, disk)",
                                        &w->m_idx_tier[r][t], err)) != KVF_OK)
                goto fail;
        }
    }
    *out = w;
    return KVF_OK;
fail:
    kvf_router_watch_destroy(w);
    return st;
}

void kvf_router_watch_destroy(kvf_router_watch *w)
{
    if (!w)
        return;
    for (int r = 0; r < 2; r++) {
        for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++) {
            kv_close(&w->kv[r][i]);
            kvf_router_feed_fini(&w->kv[r][i].feed);
        }
        kvf_router_pool_destroy(w->pool[r]);
    }
    free(w);
}
