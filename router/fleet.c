/* fleet.c: worker membership and health for the router: address lists and DNS re-resolution,
 * one channel per worker, Info once and Health every interval on a thread of its own, and the
 * fleet's one KV block size, checked at Info. The state is read by copies
 * (kvf_router_fleet_snapshot) under one mutex. */
#include "router/fleet.h"

#include <netdb.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "common/log.h"
#include "proto/worker.h"

/* Late Health answers in a row a healthy worker may give before it is counted out. */
#define HEALTH_SLOW_MAX 3

typedef struct fleet_slot {
    kvf_router_worker w;
    bool used, info_ok;
    bool from_dns;
    int32_t slow_checks;        /* Health calls in a row that ran past their deadline */
    int32_t unanswered;         /* Info/Health calls in a row that got no answer at all */
    bool refused;               /* its last Info had another block size (logged once a value) */
    bool silent;                /* its last Info or Health call got no answer at all, and it
                                   is counted out for it */
    int32_t refused_block_size;
} fleet_slot;

struct kvf_router_fleet {
    kvf_router_fleet_cfg cfg;
    kvf_rpc_channel_opts chopts;
    char *dns[2];
    fleet_slot slots[2][KVF_ROUTER_MAX_WORKERS];
    int32_t block_size;         /* the fleet's; 0 until the first accepted Info */
    char block_size_from[200];  /* where it came from, for the refusal message */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    pthread_t thread;
    bool thread_started;
};

/* Adds an address to a role (caller holds mu or is the only thread); returns the slot id. */
static int32_t slot_add(kvf_router_fleet *f, int role, const char *addr, bool from_dns,
                        kvf_err *err)
{
    fleet_slot *s = f->slots[role];
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
        if (s[i].used && strcmp(s[i].w.address, addr) == 0) {
            s[i].w.gone = false;
            return i;
        }
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++) {
        if (s[i].used)
            continue;
        if (strlen(addr) >= sizeof s[i].w.address || !strchr(addr, ':')) {
            kvf_err_set(err, KVF_ERR_INVALID, "router: worker address '%s' is not host:port", addr);
            return -1;
        }
        kvf_rpc_channel *ch;
        if (kvf_rpc_channel_create(addr, &f->chopts, &ch, err) != KVF_OK)
            return -1;
        memset(&s[i], 0, sizeof s[i]);
        s[i].used = true;
        s[i].from_dns = from_dns;
        s[i].w.id = i;
        s[i].w.channel = ch;
        snprintf(s[i].w.address, sizeof s[i].w.address, "%s", addr);
        kvf_log(KVF_LOG_INFO, "router: %s worker %d at %s", role ? "prefill" : "decode", i, addr);
        return i;
    }
    kvf_err_set(err, KVF_ERR_FULL, "router: more than %d workers of one role", KVF_ROUTER_MAX_WORKERS);
    return -1;
}

static kvf_status add_list(kvf_router_fleet *f, int role, const char *list, kvf_err *err)
{
    if (!list || !*list)
        return KVF_OK;
    char *dup = strdup(list), *save = NULL;
    if (!dup)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    for (char *t = strtok_r(dup, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
        if (slot_add(f, role, t, false, err) < 0) {
            free(dup);
            return err ? err->status : KVF_ERR_INVALID;
        }
    }
    free(dup);
    return KVF_OK;
}

/* Resolves "name:port" and brings the role's DNS slots in line with the answer. */
static void resolve(kvf_router_fleet *f, int role)
{
    const char *spec = f->dns[role];
    if (!spec)
        return;
    const char *colon = strrchr(spec, ':');
    if (!colon)
        return;
    char host[256];
    snprintf(host, sizeof host, "%.*s", (int)(colon - spec), spec);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(host, colon + 1, &hints, &res);
    if (rc != 0) {
        kvf_log(KVF_LOG_WARN, "router: resolving %s: %s", spec, gai_strerror(rc));
        return;
    }
    char seen[KVF_ROUTER_MAX_WORKERS] = {0};
    pthread_mutex_lock(&f->mu);
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        char ip[INET6_ADDRSTRLEN], addr[300];
        if (a->ai_family == AF_INET)
            inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof ip);
        else if (a->ai_family == AF_INET6)
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)a->ai_addr)->sin6_addr, ip, sizeof ip);
        else
            continue;
        snprintf(addr, sizeof addr, a->ai_family == AF_INET6 ? "[%s]:%s" : "%s:%s", ip, colon + 1);
        int32_t id = slot_add(f, role, addr, true, NULL);
        if (id >= 0)
            seen[id] = 1;
    }
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++) {
        fleet_slot *s = &f->slots[role][i];
        if (s->used && s->from_dns && !seen[i] && !s->w.gone) {
            s->w.gone = true;
            s->w.healthy = false;
            kvf_log(KVF_LOG_INFO, "router: worker %s left %s", s->w.address, spec);
        }
    }
    pthread_mutex_unlock(&f->mu);
    freeaddrinfo(res);
}

/* Admits a worker's block size (positive: the Info decoder checks it) into the fleet; the
 * caller holds mu. The first accepted Info sets the fleet's when it is not configured; a worker
 * with another one would hash prompts into other blocks than the index and its peers, so it is
 * refused, logged once per value it reports. */
static bool block_size_admit(kvf_router_fleet *f, int role, fleet_slot *s, const char *addr,
                             int32_t bs)
{
    if (f->block_size == 0 || bs == f->block_size) {
        if (f->block_size == 0) {
            f->block_size = bs;
            snprintf(f->block_size_from, sizeof f->block_size_from, "set by %s worker %s's Info",
                     role ? "prefill" : "decode", addr);
        }
        s->refused = false;
        return true;
    }
    if (!s->refused || s->refused_block_size != bs)
        kvf_log(KVF_LOG_WARN, "router: %s worker %s: KV block size %d, but the fleet's is %d (%s); "
                "refused until it matches", role ? "prefill" : "decode", addr, bs, f->block_size,
                f->block_size_from);
    s->refused = true;
    s->refused_block_size = bs;
    return false;
}

/* One Info (until accepted) and one Health call to a worker; updates its slot. */
static void check_one(kvf_router_fleet *f, int role, int32_t i)
{
    pthread_mutex_lock(&f->mu);
    fleet_slot *s = &f->slots[role][i];
    bool used = s->used && !s->w.gone, info_ok = s->info_ok;
    kvf_rpc_channel *ch = s->w.channel;
    char addr[128];
    snprintf(addr, sizeof addr, "%s", s->w.address);
    pthread_mutex_unlock(&f->mu);
    if (!used)
        return;
    int64_t to = f->cfg.rpc_timeout_ms > 0 ? f->cfg.rpc_timeout_ms : 1000;
    kvf_err err = {0};
    kvf_rpc_buf resp = {0};
    kvf_rpc_info *info = NULL;
    bool healthy = false, answered = false;
    if (!info_ok) {
        kvf_rpc_buf rq = {0};
        if (kvf_rpc_info_req_encode(&rq, &err) != KVF_OK)
            goto done;
        kvf_status st = kvf_rpc_unary(ch, KVF_RPC_WORKER_INFO, rq.data, rq.len, to, &resp, &err);
        kvf_rpc_buf_free(&rq);
        answered = st == KVF_OK;
        if (st != KVF_OK || kvf_rpc_info_decode(resp.data, resp.len, &info, &err) != KVF_OK) {
            kvf_log(KVF_LOG_DEBUG, "router: Info from %s: %s", addr, err.msg);
            goto done;
        }
        kvf_rpc_buf_free(&resp);
        bool role_ok = info->role == KVF_RPC_ROLE_COLOCATED ||
                       info->role == (role == KVF_ROUTER_ROLE_DECODE ? KVF_RPC_ROLE_DECODE
                                                                      : KVF_RPC_ROLE_PREFILL);
        if (!role_ok) {
            kvf_log(KVF_LOG_WARN, "router: worker %s has role %d; listed as a %s worker", addr,
                    (int)info->role, role ? "prefill" : "decode");
            goto done;
        }
        pthread_mutex_lock(&f->mu);
        bool bs_ok = block_size_admit(f, role, s, addr, info->block_size);
        pthread_mutex_unlock(&f->mu);
        if (!bs_ok)
            goto done; /* not healthy: counted down, never in a pool */
    }
    {
        kvf_rpc_buf rq = {0};
        kvf_rpc_health *h = NULL;
        if (kvf_rpc_health_req_encode(&rq, &err) != KVF_OK)
            goto done;
        kvf_status st = kvf_rpc_unary(ch, KVF_RPC_WORKER_HEALTH, rq.data, rq.len, to, &resp, &err);
        kvf_rpc_buf_free(&rq);
        answered = st == KVF_OK; /* SERVING or not (DRAINING), it answers */
        if (st == KVF_OK && kvf_rpc_health_decode(resp.data, resp.len, &h, &err) == KVF_OK)
            healthy = h->status == KVF_RPC_SERVING;
        free(h);
        /* A healthy worker whose answer is merely late (a loaded host, a long step) stays in
         * for up to HEALTH_SLOW_MAX checks in a row; a refused connection, an error or "not
         * serving" takes it out at once, and so does any failed Generate (kvf_router_fleet
         * marks a worker that fails a call). */
        pthread_mutex_lock(&f->mu);
        if (st == KVF_ERR_TIMEOUT && s->w.healthy && ++s->slow_checks < HEALTH_SLOW_MAX) {
            healthy = true;
            kvf_log(KVF_LOG_DEBUG, "router: Health of %s ran past %lld ms (%d in a row)", addr,
                    (long long)to, (int)s->slow_checks);
        } else if (st != KVF_ERR_TIMEOUT) {
            s->slow_checks = 0;
        }
        pthread_mutex_unlock(&f->mu);
    }
done:
    kvf_rpc_buf_free(&resp);
    pthread_mutex_lock(&f->mu);
    if (info) {
        s->info_ok = true;
        snprintf(s->w.model_id, sizeof s->w.model_id, "%s", info->model_id);
        snprintf(s->w.worker_id, sizeof s->w.worker_id, "%s", info->worker_id);
        s->w.block_size = info->block_size;
        s->w.capacity_blocks = info->capacity_blocks;
        s->w.max_n = info->max_n;
    }
    healthy = healthy && s->info_ok;
    /* silent: HEALTH_SLOW_MAX calls in a row got no answer (late or lost), whether it was
     * healthy, draining or out after a failed call; any answer (DRAINING too) resets it */
    s->unanswered = answered ? 0 : s->unanswered + 1;
    s->silent = s->unanswered >= HEALTH_SLOW_MAX && !healthy;
    if (healthy != s->w.healthy)
        kvf_log(healthy ? KVF_LOG_INFO : KVF_LOG_WARN, "router: %s worker %s is %s", role ? "prefill" : "decode",
                addr, healthy ? "healthy" : "not healthy");
    s->w.healthy = healthy && !s->w.gone;
    if (!healthy)
        s->info_ok = false; /* a restarted worker may come back with another model */
    pthread_mutex_unlock(&f->mu);
    free(info);
}

static void *health_main(void *arg)
{
    kvf_router_fleet *f = arg;
    int64_t hi = f->cfg.health_interval_ms > 0 ? f->cfg.health_interval_ms : 1000;
    int64_t ri = f->cfg.resolve_interval_ms > 0 ? f->cfg.resolve_interval_ms : 5000;
    int64_t since_resolve = ri;
    for (;;) {
        if (since_resolve >= ri) {
            resolve(f, 0);
            resolve(f, 1);
            since_resolve = 0;
        }
        for (int role = 0; role < 2; role++)
            for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
                check_one(f, role, i);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += hi / 1000;
        ts.tv_nsec += (hi % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L)
            ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_mutex_lock(&f->mu);
        while (!f->stop && pthread_cond_timedwait(&f->cv, &f->mu, &ts) == 0)
            ;
        bool stop = f->stop;
        pthread_mutex_unlock(&f->mu);
        if (stop)
            return NULL;
        since_resolve += hi;
    }
}

kvf_status kvf_router_fleet_create(const kvf_router_fleet_cfg *cfg, kvf_router_fleet **out,
                                   kvf_err *err)
{
    kvf_router_fleet *f = calloc(1, sizeof *f);
    if (!f)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    f->cfg = *cfg;
    f->chopts.tls = cfg->tls;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    kvf_status st;
    if (cfg->block_size < 0) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "router: block size %d is not a number of tokens (> 0; 0: "
                         "the first worker's Info sets it)", (int)cfg->block_size);
        goto fail;
    }
    f->block_size = cfg->block_size;
    snprintf(f->block_size_from, sizeof f->block_size_from, "configured");
    if ((st = add_list(f, KVF_ROUTER_ROLE_DECODE, cfg->decode, err)) != KVF_OK ||
        (st = add_list(f, KVF_ROUTER_ROLE_PREFILL, cfg->prefill, err)) != KVF_OK)
        goto fail;
    const char *dns[2] = {cfg->decode_dns, cfg->prefill_dns};
    for (int r = 0; r < 2; r++) {
        if (!dns[r] || !*dns[r])
            continue;
        if (!strrchr(dns[r], ':')) {
            st = kvf_err_set(err, KVF_ERR_INVALID, "router: --%s-dns=%s is not name:port",
                             r ? "prefill" : "decode", dns[r]);
            goto fail;
        }
        f->dns[r] = strdup(dns[r]);
    }
    if (pthread_create(&f->thread, NULL, health_main, f) != 0) {
        st = kvf_err_set(err, KVF_ERR_INTERNAL, "router: cannot start the health thread");
        goto fail;
    }
    f->thread_started = true;
    *out = f;
    return KVF_OK;
fail:
    kvf_router_fleet_destroy(f);
    return st;
}

void kvf_router_fleet_destroy(kvf_router_fleet *f)
{
    if (!f)
        return;
    if (f->thread_started) {
        pthread_mutex_lock(&f->mu);
        f->stop = true;
        pthread_cond_broadcast(&f->cv);
        pthread_mutex_unlock(&f->mu);
        pthread_join(f->thread, NULL);
    }
    for (int r = 0; r < 2; r++) {
        for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
            if (f->slots[r][i].used)
                kvf_rpc_channel_destroy(f->slots[r][i].w.channel);
        free(f->dns[r]);
    }
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    free(f);
}

int32_t kvf_router_fleet_snapshot(kvf_router_fleet *f, kvf_router_role role,
                                  kvf_router_worker *out)
{
    int32_t n = 0;
    pthread_mutex_lock(&f->mu);
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
        if (f->slots[role][i].used)
            out[n++] = f->slots[role][i].w;
    pthread_mutex_unlock(&f->mu);
    return n;
}

void kvf_router_fleet_mark_failed(kvf_router_fleet *f, kvf_router_role role, int32_t id)
{
    if (id < 0 || id >= KVF_ROUTER_MAX_WORKERS)
        return;
    pthread_mutex_lock(&f->mu);
    fleet_slot *s = &f->slots[role][id];
    if (s->w.healthy)
        kvf_log(KVF_LOG_WARN, "router: %s worker %s failed a call; out until its health check passes",
                role ? "prefill" : "decode", s->w.address);
    s->w.healthy = false;
    s->info_ok = false;
    pthread_mutex_unlock(&f->mu);
}

bool kvf_router_fleet_silent(kvf_router_fleet *f, kvf_router_role role, int32_t id)
{
    if (id < 0 || id >= KVF_ROUTER_MAX_WORKERS)
        return false;
    pthread_mutex_lock(&f->mu);
    bool silent = f->slots[role][id].used && f->slots[role][id].silent;
    pthread_mutex_unlock(&f->mu);
    return silent;
}

int32_t kvf_router_fleet_n_healthy(kvf_router_fleet *f, kvf_router_role role)
{
    int32_t n = 0;
    pthread_mutex_lock(&f->mu);
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
        n += f->slots[role][i].used && f->slots[role][i].w.healthy;
    pthread_mutex_unlock(&f->mu);
    return n;
}

int32_t kvf_router_fleet_block_size(kvf_router_fleet *f)
{
    pthread_mutex_lock(&f->mu);
    int32_t bs = f->block_size;
    pthread_mutex_unlock(&f->mu);
    return bs;
}

int32_t kvf_router_fleet_max_n(kvf_router_fleet *f)
{
    int32_t m = 0;
    pthread_mutex_lock(&f->mu);
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++) {
        const fleet_slot *s = &f->slots[KVF_ROUTER_ROLE_DECODE][i];
        if (s->used && s->w.healthy && s->w.max_n > 0 && (m == 0 || s->w.max_n < m))
            m = s->w.max_n;
    }
    pthread_mutex_unlock(&f->mu);
    return m;
}
