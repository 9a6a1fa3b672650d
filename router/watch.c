/* watch.c: the front end's decode and prefill pools kept in line with the fleet, and under the
 * kv policy each pooled worker's WatchKv stream read into its pool's index: a snapshot (it may
 * span several events) gathered then applied, deltas applied, load reports into the pool, a
 * sequence gap answered by a new stream. Runs on the HTTP loop thread, woken by the streams
 * (http_int.h); the fleet's health thread and the policies' scoring live elsewhere. */
#include "router/watch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "proto/worker.h"

/* The kv policy's view of one worker: its WatchKv stream, a snapshot being gathered (it may
 * span several events) and its last load report. */
typedef struct kv_watch {
    kvf_rpc_stream *stream;
    kvf_router_wake wake;
    uint64_t *snap_h, *snap_p;
    size_t snap_n, snap_cap;
    bool have_load;
    bool synced; /* a snapshot was applied since the stream opened: the index knows this worker */
    kvf_router_worker_state last_state; /* for logging state changes (stale, resync, live) */
    kvf_router_load load;
} kv_watch;

struct kvf_router_watch {
    kvf_router_fleet *fleet;
    kvf_router_policy policy;
    kvf_router_pool *pool[2];
    bool in_pool[2][KVF_ROUTER_MAX_WORKERS];
    kvf_router_worker workers[2][KVF_ROUTER_MAX_WORKERS]; /* by id, from the last sync */
    kv_watch kv[2][KVF_ROUTER_MAX_WORKERS];               /* kv policy: WatchKv per worker */
    kvf_metric *m_up[2];            /* healthy workers, per role */
    kvf_metric *m_idx_state[2][3];  /* kv policy: workers live / stale / resync, per role */
    kvf_metric *m_idx_blocks[2];    /* kv policy: blocks in each role's index */
};

static const char *role_name(int role)
{
    return role ? "prefill" : "decode";
}

/* ---------------------------------------------------------------------------------------- */
/* One worker's WatchKv stream                                                               */

static void kv_close(kv_watch *k)
{
    kvf_rpc_stream_destroy(k->stream);
    k->stream = NULL;
    k->snap_n = 0;
    k->have_load = false;
    k->synced = false;
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

/* Applies one KV event of a worker to its pool's index. Returns false when the stream must be
 * reopened (a sequence gap: the index waits for a new snapshot). */
static bool kv_event(kvf_router_watch *w, int role, int32_t id, const kvf_rpc_kv_event *e)
{
    kv_watch *k = &w->kv[role][id];
    kvf_router_event ev = {.worker = id, .seq = e->seq, .model = e->model_id, .block_size = e->block_size,
                           .hashes = e->block_hashes, .parents = e->parent_hashes, .n = e->n};
    switch (e->kind) {
    case KVF_RPC_KV_SNAPSHOT:
        /* gather the parts, apply once at snapshot_done */
        if (k->snap_n + e->n > k->snap_cap) {
            size_t cap = (k->snap_n + e->n) * 2 + 64;
            uint64_t *hh = realloc(k->snap_h, cap * sizeof *hh), *pp = hh ? realloc(k->snap_p, cap * sizeof *pp) : NULL;
            if (hh)
                k->snap_h = hh;
            if (!pp)
                return false;
            k->snap_p = pp;
            k->snap_cap = cap;
        }
        if (e->n)
            memcpy(k->snap_h + k->snap_n, e->block_hashes, e->n * sizeof *k->snap_h);
        for (size_t i = 0; i < e->n; i++)
            k->snap_p[k->snap_n + i] = e->parent_hashes ? e->parent_hashes[i] : 0;
        k->snap_n += e->n;
        if (!e->snapshot_done)
            return true;
        ev.kind = KVF_ROUTER_EV_SNAPSHOT;
        ev.hashes = k->snap_h;
        ev.parents = k->snap_p;
        ev.n = k->snap_n;
        k->snap_n = 0;
        break;
    case KVF_RPC_KV_STORED: ev.kind = KVF_ROUTER_EV_STORED; break;
    case KVF_RPC_KV_REMOVED: ev.kind = KVF_ROUTER_EV_REMOVED; break;
    case KVF_RPC_KV_CLEARED:
        ev.kind = KVF_ROUTER_EV_SNAPSHOT; /* an empty snapshot */
        ev.n = 0;
        break;
    default: return true;
    }
    kvf_err err = {0};
    kvf_status st = kvf_router_index_apply(kvf_router_pool_index(w->pool[role]), &ev, kvf_now_s(), &err);
    if (st != KVF_OK)
        kvf_log(KVF_LOG_DEBUG, "router: %s", err.msg);
    else if (ev.kind == KVF_ROUTER_EV_SNAPSHOT)
        k->synced = true;
    return st != KVF_ERR_STATE;
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
            if (!r->is_load) {
                keep = kv_event(w, role, id, &r->event);
            } else {
                k->load.queued_prefill_tokens = r->load.queued_prefill_tokens;
                k->load.decode_load = (double)r->load.running + (double)r->load.waiting;
                k->have_load = true;
                kvf_router_pool_load_set(w->pool[role], id, &k->load, now);
            }
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
                pc.approx = false; /* the kv policy follows the workers' WatchKv events */
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
                if (kvf_router_pool_worker_add(w->pool[role], wk->id, wk->model_id, bs, kv, now,
                                               &err) != KVF_OK) {
                    want[wk->id] = false;
                    continue;
                }
                w->in_pool[role][wk->id] = true;
                if (kv)
                    kv_open(w, role, wk->id);
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
            unsynced += !k->synced;
        }
        for (int s = 0; s < 3; s++)
            kvf_metric_set(w->m_idx_state[role][s], count[s]);
        if (w->pool[role]) {
            kvf_router_index_stats is;
            kvf_router_index_stats_get(kvf_router_pool_index(w->pool[role]), &is);
            kvf_metric_set(w->m_idx_blocks[role], (double)is.n_blocks);
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
    if (k->have_load)
        *out = k->load;
    return k->have_load;
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
                                   kvf_metrics *m, kvf_router_http *h, kvf_router_watch **out,
                                   kvf_err *err)
{
    kvf_router_watch *w = calloc(1, sizeof *w);
    if (!w)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    w->fleet = fleet;
    w->policy = policy;
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
            free(w->kv[r][i].snap_h);
            free(w->kv[r][i].snap_p);
        }
        kvf_router_pool_destroy(w->pool[r]);
    }
    free(w);
}
