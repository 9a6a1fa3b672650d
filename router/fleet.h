/* fleet.h: the router's view of its workers: a static list of host:port or a DNS name (a
 * Kubernetes headless service) re-resolved periodically, one gRPC channel each, and a health
 * thread that asks Info once and Health every interval. Info admits a worker only when it has
 * the fleet's one KV block size. Routing decisions live in policy.h. */
#ifndef KVF_ROUTER_FLEET_H
#define KVF_ROUTER_FLEET_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "proto/rpc.h"
#include "router/index.h"

typedef enum kvf_router_role {
    KVF_ROUTER_ROLE_DECODE = 0, /* decode or colocated workers: Generate goes here */
    KVF_ROUTER_ROLE_PREFILL = 1,
} kvf_router_role;

typedef struct kvf_router_fleet_cfg {
    const char *decode;       /* "host:port,host:port" or NULL */
    const char *prefill;      /* the same for prefill workers */
    const char *decode_dns;   /* "name:port": every address of name is a decode worker */
    const char *prefill_dns;
    int64_t health_interval_ms; /* Health every this often (0: 1000) */
    int64_t resolve_interval_ms; /* DNS every this often (0: 5000) */
    int64_t rpc_timeout_ms;   /* Info/Health deadline (0: 1000) */
    int32_t block_size;       /* tokens per KV block, one for the whole fleet (0: the first
                                 worker whose Info is accepted sets it) */
    const kvf_rpc_tls *tls;   /* NULL: plaintext */
} kvf_router_fleet_cfg;

/* A copy of one worker's state (kvf_router_fleet_snapshot). The channel lives as long as the
 * fleet; streams opened on it must be destroyed before kvf_router_fleet_destroy. */
typedef struct kvf_router_worker {
    int32_t id;            /* stable slot, < KVF_ROUTER_MAX_WORKERS */
    bool healthy;          /* Info accepted and Health says SERVING */
    bool gone;             /* DNS no longer lists it */
    char address[128];     /* host:port */
    char model_id[256];
    char worker_id[128];
    int32_t block_size;
    int64_t capacity_blocks;
    int32_t max_n;         /* parallel samples per request its Info allows; 0: not said */
    kvf_rpc_channel *channel;
} kvf_router_worker;

typedef struct kvf_router_fleet kvf_router_fleet;

/* Parses the lists, creates the channels and starts the health thread (its first pass runs at
 * once). A malformed address fails with KVF_ERR_INVALID naming it. */
kvf_status kvf_router_fleet_create(const kvf_router_fleet_cfg *cfg, kvf_router_fleet **out,
                                   kvf_err *err);
/* Stops the thread and frees the channels. NULL is fine. */
void kvf_router_fleet_destroy(kvf_router_fleet *f);

/* Copies the workers of a role into out[KVF_ROUTER_MAX_WORKERS]; returns how many. Any thread. */
int32_t kvf_router_fleet_snapshot(kvf_router_fleet *f, kvf_router_role role,
                                  kvf_router_worker *out);
/* A call to the worker failed (peer lost): it counts as unhealthy until a Health check passes. */
void kvf_router_fleet_mark_failed(kvf_router_fleet *f, kvf_router_role role, int32_t id);
/* The worker's last Info or Health call got no answer at all (timed out, or the connection
 * failed) and that counted it out (a late answer does after HEALTH_SLOW_MAX checks in a row):
 * stopped, cut off or gone, as against one that answers DRAINING or NOT_SERVING. Any thread. */
bool kvf_router_fleet_silent(kvf_router_fleet *f, kvf_router_role role, int32_t id);
/* Healthy workers of a role right now. */
int32_t kvf_router_fleet_n_healthy(kvf_router_fleet *f, kvf_router_role role);
/* Tokens per KV block of every admitted worker, prefill and decode alike (DESIGN section 3):
 * the configured size, else the first accepted Info's; 0 until then. Once set it never changes,
 * and a worker whose Info says otherwise is refused (never healthy), so every healthy worker in
 * a snapshot has it. Any thread. */
int32_t kvf_router_fleet_block_size(kvf_router_fleet *f);
/* The most parallel samples (n) every healthy decode worker takes, from their Info; 0 when no
 * healthy worker said (then the router's own bound applies). Any thread. */
int32_t kvf_router_fleet_max_n(kvf_router_fleet *f);

#endif
