/* watch.h: the HTTP front end's worker pools, inside router/ only: keeps the policy's decode and
 * prefill pools in line with the fleet's healthy workers and, under the kv policy, feeds each
 * pool's index from its workers' WatchKv streams (snapshots, KV events, load reports), with the
 * index's health in /metrics and the log. Loop thread only. Membership and health checks are
 * fleet.c's; picking workers for a request is request.c's. */
#ifndef KVF_ROUTER_WATCH_H
#define KVF_ROUTER_WATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "common/metrics.h"
#include "common/status.h"
#include "proto/worker.h"
#include "router/fleet.h"
#include "router/http_int.h"
#include "router/policy.h"

typedef struct kvf_router_watch kvf_router_watch;

/* One worker's WatchKv messages into its pool, the watch's reader (open for tests): snapshot
 * parts gathered, each part's blocks in its tier, and applied once; deltas with their tier (a
 * STORED of a block already held moves it there, a REMOVED drops it from every tier); load
 * reports with the worker's measured promotion prices. The caller allocates; zeroed is empty. */
typedef struct kvf_router_feed {
    uint64_t *snap_h, *snap_p; /* [snap_cap] a snapshot being gathered: hashes, parents */
    uint8_t *snap_t;           /* [snap_cap] and each block's tier */
    size_t snap_n, snap_cap;
    bool synced;               /* a snapshot was applied since the stream opened */
    bool have_load;
    kvf_router_load load;      /* the last load report */
} kvf_router_feed;

/* Applies one decoded WatchKv message of worker `id` to pool p. With approx the pool predicts
 * caches from the router's decisions: KV events are dropped unread, load reports still count.
 * KVF_ERR_STATE: a sequence gap, a snapshot part in no known tier, or a snapshot past 4 Mi
 * blocks (reopen the stream: the index waits for a snapshot);
 * KVF_ERR_NOMEM; another status: the event was refused (err says why), the stream goes on. */
kvf_status kvf_router_feed_apply(kvf_router_feed *f, kvf_router_pool *p, int32_t id,
                                 const kvf_rpc_watch_msg *m, bool approx, double now, kvf_err *err);
/* The stream closed: gathered parts, the load report and `synced` are forgotten. */
void kvf_router_feed_reset(kvf_router_feed *f);
void kvf_router_feed_fini(kvf_router_feed *f); /* frees the buffers */

/* Registers its metrics in m (healthy workers per role; index workers by state and index blocks,
 * kept under the kv policy). kv (the pools' knobs) is copied. Borrows fleet, m and h (whose
 * loop its streams wake) for its life. Pools are created at the first sync that finds a healthy
 * worker of their role. */
kvf_status kvf_router_watch_create(kvf_router_fleet *fleet, kvf_router_policy policy,
                                   const kvf_router_kv_cfg *kv, kvf_metrics *m, kvf_router_http *h,
                                   kvf_router_watch **out, kvf_err *err);
/* Closes the WatchKv streams (before the fleet, which owns their channels, is destroyed) and
 * frees the pools. NULL is fine. */
void kvf_router_watch_destroy(kvf_router_watch *w);

/* Brings the pools in line with the fleet: healthy workers join (their WatchKv opens under the
 * kv policy, or reopens if it ended), the others leave (their WatchKv closes). */
void kvf_router_watch_sync(kvf_router_watch *w);
/* Reads the WatchKv streams that woke the loop (every one when `all`): events into the index,
 * load reports into the pool; a sequence gap reopens the stream for a fresh snapshot. */
void kvf_router_watch_drain(kvf_router_watch *w, bool all);
/* kv policy: counts every pooled worker's index state into /metrics, logs each change of state
 * (a worker whose events and load reports stop goes stale: its entries decay), and returns how
 * many pooled workers have no snapshot applied yet. */
int32_t kvf_router_watch_health(kvf_router_watch *w);

/* A role's pool: NULL until one of its workers was healthy. */
kvf_router_pool *kvf_router_watch_pool(kvf_router_watch *w, kvf_router_role role);
bool kvf_router_watch_in_pool(const kvf_router_watch *w, kvf_router_role role, int32_t id);
int32_t kvf_router_watch_n_in_pool(const kvf_router_watch *w, kvf_router_role role);
/* A worker as of the last sync (address, model, channel); the watch owns the copy. */
const kvf_router_worker *kvf_router_watch_worker(const kvf_router_watch *w, kvf_router_role role,
                                                 int32_t id);
/* The worker's last WatchKv load report into *out; false when none came since its stream
 * opened (*out untouched). */
bool kvf_router_watch_load(const kvf_router_watch *w, kvf_router_role role, int32_t id,
                           kvf_router_load *out);
/* A worker that failed a call leaves its pool now (out of the index and the ring); the next sync
 * takes it back if the fleet still finds it healthy. Its WatchKv stays as it is. */
void kvf_router_watch_drop(kvf_router_watch *w, kvf_router_role role, int32_t id);

#endif
