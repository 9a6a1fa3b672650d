/* worker.c: the machinery both worker roles share: model + pool (+ engine or forward pass) from
 * the flags, the loop thread that owns them and its job queue, the transport registration, the
 * Info/Health/Cancel-free/WatchKv handlers with KV events fanned out to every watcher, metrics
 * and the admin HTTP port. The roles' own RPCs live in decode/ and prefill/. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cfg.h"
#include "common/log.h"
#include "common/time.h"
#include "engine/backends.h"
#include "kv/hash.h"
#include "kv/tier.h"
#include "proto/worker.h"
#include "worker/worker.h"
#ifdef KVF_HAVE_CUDA
#include "cuda/cuda.h"
#include "cuda/xfer_gpu.h"
#endif

#define WATCH_BATCH 256 /* block hashes per KvEvent message */

typedef struct job {
    kvf_worker_job_fn fn;
    void *arg;
    struct job *next;
    bool wait, done;
} job;

typedef struct watcher {
    kvf_rpc_call *call;
    uint64_t key;
    int64_t interval_ns, next_load_ns, last_load_ns;
    kvf_worker_load last;
    bool dead;
    struct watcher *next;
} watcher;

/* KV events waiting to go out, in order, as runs of one kind. */
typedef struct ev_buf {
    int kind; /* KVF_KV_EVENT_STORED or _REMOVED, 0: empty */
    int32_t tier; /* STORED: the tier every event of the run names (kvf_kv_tier_kind); 0 else */
    uint64_t *hashes, *parents;
    size_t n, cap;
} ev_buf;

struct kvf_worker {
    kvf_worker_cfg cfg;
    kvf_worker_role role;
    char model_id[256], worker_id[128];
    kvf_model *model;
    kvf_kv_layout layout;
    int32_t n_blocks;
    kvf_engine *engine; /* the one scheduler, for both roles */
    kvf_kv_pool *pool;  /* the engine's */
    kvf_kv_tier *tier;  /* --kv-host-memory (and --kv-disk-dir): under the pool; NULL: none */
    double promote_ewma[3]; /* seconds per block promoted, per tier; 0: none measured (loop) */
    kvf_xfer *xfer;
    char xfer_host[64]; /* the transfer plane's numeric address; "0.0.0.0": every interface */
    uint8_t *desc;
    size_t desc_len;
    kvf_rpc_server *server;
    kvf_worker_http *http;
    kvf_metrics *metrics;
    kvf_metric *m_kv_usage, *m_gie_waiting, *m_gie_running, *m_gie_kv_usage; /* autoscaling, GIE */
    kvf_metric *m_queued_prefill; /* prompt tokens of RemotePrefill calls not yet answered */
    kvf_metric *m_free, *m_used, *m_cached, *m_total, *m_running, *m_waiting, *m_steps,
        *m_watchers, *m_events, *m_prefix_hit, *m_draws;
    /* --device cuda: the device's memory and the decode step's CUDA graphs (NULL otherwise) */
    kvf_metric *m_gpu_used, *m_graph_replays, *m_graph_captures;
    /* with tiers: per tier (kvf_kv_tier_kind index; [0] only where the pool has one) */
    kvf_metric *m_tier_hits[3], *m_tier_demoted[3], *m_tier_promoted[3], *m_tier_demoted_bytes[3],
        *m_tier_promoted_bytes[3], *m_tier_promote_s[3], *m_tier_used[3], *m_tier_capacity[3],
        *m_tier_corrupt;
    int64_t gpu_stats_ns; /* when they were last read */
    kvf_worker_hooks hooks;
    /* loop */
    pthread_t thread;
    bool thread_started, started, shut;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *head, *tail;
    bool stopping, stopped;
    bool draining; /* kvf_worker_drain: Health DRAINING, /ready 503 (mu) */
    int wake_rd, wake_wr;
    atomic_bool woken;
    /* load snapshot (mu) */
    kvf_worker_load load;
    /* loop-thread only */
    watcher *watchers;
    uint64_t next_watch_key;
    uint64_t ev_seq;
    ev_buf evs;
    int64_t steps;
};

static const kvf_cfg_opt worker_opts[] = {
    {"model", NULL, "model directory (config.json, model.safetensors)",
     offsetof(kvf_worker_cfg, model), KVF_CFG_STR},
    {"model-id", NULL, "model id for block hashes (default: the model directory's name)",
     offsetof(kvf_worker_cfg, model_id), KVF_CFG_STR},
    {"worker-id", NULL, "this worker's name in Info (default: <role>-<pid>)",
     offsetof(kvf_worker_cfg, worker_id), KVF_CFG_STR},
    {"listen", "127.0.0.1:0", "gRPC Worker service HOST:PORT (port 0: any free port)",
     offsetof(kvf_worker_cfg, listen), KVF_CFG_STR},
    {"admin-listen", "127.0.0.1:0", "admin HTTP (/metrics, /health, /ready) HOST:PORT",
     offsetof(kvf_worker_cfg, admin_listen), KVF_CFG_STR},
    {"xfer-listen", NULL, "HOST the KV transfer plane listens on (ucx's tcp transport, the "
     "cuda_ipc/nccl notice channel, NCCL's bootstrap): one of this node's addresses, or 0.0.0.0 "
     "for every interface (default: the --listen host)", offsetof(kvf_worker_cfg, xfer_listen),
     KVF_CFG_STR},
    {"kv-memory", "64M", "KV pool bytes (K/M/G suffixes) when --kv-blocks is 0",
     offsetof(kvf_worker_cfg, kv_memory), KVF_CFG_SIZE},
    {"kv-blocks", "0", "KV pool blocks (overrides --kv-memory)",
     offsetof(kvf_worker_cfg, kv_blocks), KVF_CFG_INT},
    {"kv-host-memory", "0", "host-memory KV tier under the pool (K/M/G suffixes): cached blocks "
     "the pool evicts move here, and a prefix hit copies them back instead of recomputing; 0: "
     "none", offsetof(kvf_worker_cfg, kv_host_memory), KVF_CFG_SIZE},
    {"kv-disk-dir", NULL, "directory of a local-disk KV tier under the host tier (with "
     "--kv-host-memory and --kv-disk-bytes): private to this worker (this user's, not group or "
     "world writable; made 0700 if missing; locked while in use), its kvfleet-kv-tier.bin made "
     "afresh at start; checksummed, a bad block is a miss",
     offsetof(kvf_worker_cfg, kv_disk_dir), KVF_CFG_STR},
    {"kv-disk-bytes", "0", "size of the disk KV tier file (K/M/G suffixes)",
     offsetof(kvf_worker_cfg, kv_disk_bytes), KVF_CFG_SIZE},
    {"block-size", "16", "tokens per KV block (a power of two; the same across the fleet)",
     offsetof(kvf_worker_cfg, block_size), KVF_CFG_INT},
    {"kv-dtype", "f32", "KV cache dtype: f32, f16 or bf16", offsetof(kvf_worker_cfg, kv_dtype),
     KVF_CFG_STR},
    {"max-batch-tokens", "512", "token budget of one engine step",
     offsetof(kvf_worker_cfg, max_batch_tokens), KVF_CFG_INT},
    {"max-seqs", "32", "running sequences at once", offsetof(kvf_worker_cfg, max_seqs),
     KVF_CFG_INT},
    {"threads", "0", "backend CPU threads (0: one per CPU)", offsetof(kvf_worker_cfg, threads),
     KVF_CFG_INT},
    {"rpc-threads", "4", "gRPC handler threads", offsetof(kvf_worker_cfg, rpc_threads),
     KVF_CFG_INT},
    {"prefill-timeout-ms", "10000", "remote prefill deadline before the local fallback",
     offsetof(kvf_worker_cfg, prefill_timeout_ms), KVF_CFG_INT},
    {"load-interval-ms", "1000", "WatchKv load report period when the watcher sets none",
     offsetof(kvf_worker_cfg, load_interval_ms), KVF_CFG_INT},
    {"device", "cpu", "where the model runs and the KV pool lives: cpu or cuda (GPU 0)",
     offsetof(kvf_worker_cfg, device), KVF_CFG_STR},
    {"attn-decode", "auto", "with --device cuda: the kernel decode tokens' attention runs on: "
     "auto (the build's default, simt today), simt, or mma (tensor cores; f16, bf16 or fp8 KV "
     "at head_dim 64 or 128, simt elsewhere)", offsetof(kvf_worker_cfg, attn_decode), KVF_CFG_STR},
    {"weight-dtype", "f32", "matrices at load: f32, or q8 (int8 blocks of 32 with a scale each; "
     "about 3.5x less to read per token; CPU only)", offsetof(kvf_worker_cfg, weight_dtype), KVF_CFG_STR},
    {"tls-cert", NULL, "PEM certificate of this fleet member (with --tls-key and --tls-ca: "
     "mutual TLS on the gRPC worker plane; reloaded on SIGHUP)", offsetof(kvf_worker_cfg, tls.cert_file),
     KVF_CFG_STR},
    {"tls-key", NULL, "PEM private key of --tls-cert", offsetof(kvf_worker_cfg, tls.key_file),
     KVF_CFG_STR},
    {"tls-ca", NULL, "PEM CA that signed every fleet member's certificate: callers without one "
     "are refused", offsetof(kvf_worker_cfg, tls.ca_file), KVF_CFG_STR},
    {"tls-name", "kvfleet", "the name peers' certificates must carry (kvfleet gen-certs "
     "--tls-name)", offsetof(kvf_worker_cfg, tls.server_name), KVF_CFG_STR},
    {"log-level", "info", "debug, info, warn, error or off", offsetof(kvf_worker_cfg, log_level),
     KVF_CFG_STR},
    {"drain-delay-ms", "3000", "on SIGTERM Health says DRAINING and /ready 503 at once, and the "
     "worker keeps serving at least this long (routers stop sending) before it exits once idle",
     offsetof(kvf_worker_cfg, drain_delay_ms), KVF_CFG_INT64},
    {"drain-timeout-ms", "30000", "then running sequences and open calls get this long to finish "
     "before they are cancelled (a second SIGTERM or SIGINT stops at once)",
     offsetof(kvf_worker_cfg, drain_timeout_ms), KVF_CFG_INT64},
    {"log-format", "text", "stderr log lines: text, or json (one object per line: ts, level, "
     "component, request_id, msg)", offsetof(kvf_worker_cfg, log_format), KVF_CFG_STR},
    {NULL},
};

const kvf_cfg_table kvf_worker_cfg_tables[] = {
    {worker_opts, 0},
    {kvf_xfer_cfg_opts, offsetof(kvf_worker_cfg, xfer)},
    {NULL, 0},
};

void kvf_worker_cfg_default(kvf_worker_cfg *cfg)
{
    static const kvf_cfg_spec spec = {.prog = "worker", .tables = kvf_worker_cfg_tables};
    memset(cfg, 0, sizeof *cfg);
    char *argv[] = {"worker", NULL};
    kvf_err err;
    /* the environment may override defaults here too, as it does for the commands */
    (void)kvf_cfg_parse(&spec, cfg, 1, argv, NULL, &err);
    cfg->prefill_timeout_ms = cfg->prefill_timeout_ms > 0 ? cfg->prefill_timeout_ms : 10000;
    cfg->late_write_grace_ms = 5000; /* a decode flag (cli/cmd_decode.c): its default */
}

void kvf_worker_sampling(const kvf_worker *w, const kvf_rpc_sampling *s, kvf_engine_sampling *out)
{
    kvf_engine_sampling_default(out);
    if (s->max_tokens > 0)
        out->max_tokens = s->max_tokens;
    out->temperature = s->temperature;
    out->top_k = s->top_k;
    out->top_p = s->top_p;
    out->seed = s->seed;
    out->n = s->n;
    for (int32_t i = 0; i < s->n_stop && out->n_stop < KVF_ENGINE_MAX_STOP; i++)
        out->stop_ids[out->n_stop++] = s->stop_ids[i];
    if (!s->ignore_eos)
        kvf_engine_sampling_model_eos(out, w->model);
    out->presence_penalty = s->presence_penalty;
    out->frequency_penalty = s->frequency_penalty;
    out->repetition_penalty = s->repetition_penalty;
    out->min_p = s->min_p;
    out->min_tokens = s->min_tokens;
    for (int32_t i = 0; i < s->n_bias && i < KVF_ENGINE_MAX_BIAS; i++)
        out->bias[out->n_bias++] = (kvf_engine_bias){.id = s->bias[i].id, .bias = s->bias[i].bias};
    out->logprobs = s->logprobs;
    out->top_logprobs = s->top_logprobs;
    out->prompt_logprobs = s->prompt_logprobs;
    /* the kinds are the same numbers (proto/worker.h, text/guide.h); the text stays borrowed */
    out->guide_kind = s->guide_kind;
    out->guide = s->guide;
    out->guide_len = s->guide_len;
}

void kvf_worker_logprob(const kvf_engine_output *o, kvf_rpc_logprob *out)
{
    *out = (kvf_rpc_logprob){.logprob = o->logprob, .n_top = o->n_top};
    for (int32_t i = 0; i < o->n_top && i < KVF_RPC_MAX_LOGPROBS; i++) {
        out->top_ids[i] = o->top[i].id;
        out->top_lps[i] = o->top[i].logprob;
    }
}

kvf_status kvf_worker_parse_hostport(const char *flag, const char *s, char *host, size_t cap,
                                     int *port_out, kvf_err *err)
{
    const char *colon = s ? strrchr(s, ':') : NULL;
    if (!colon || colon == s)
        return kvf_err_set(err, KVF_ERR_INVALID, "worker: --%s=%s is not HOST:PORT "
                           "(e.g. 127.0.0.1:0)", flag, s ? s : "(unset)");
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (*end || end == colon + 1 || port < 0 || port > 65535)
        return kvf_err_set(err, KVF_ERR_INVALID, "worker: --%s=%s: port \"%s\" is not 0..65535",
                           flag, s, colon + 1);
    size_t hl = (size_t)(colon - s);
    if (s[0] == '[' && hl >= 2 && s[hl - 1] == ']') { /* [::1]:port */
        s++;
        hl -= 2;
    }
    if (hl >= cap)
        return kvf_err_set(err, KVF_ERR_INVALID, "worker: --%s=%s: host too long", flag, s);
    memcpy(host, s, hl);
    host[hl] = '\0';
    *port_out = (int)port;
    return KVF_OK;
}

/* ---- KV events and watchers --------------------------------------------------------------- */

static kvf_status ev_push(ev_buf *b, uint64_t h, uint64_t parent)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        uint64_t *a = realloc(b->hashes, cap * sizeof *a), *p;
        if (!a)
            return KVF_ERR_NOMEM;
        b->hashes = a;
        if (!(p = realloc(b->parents, cap * sizeof *p)))
            return KVF_ERR_NOMEM;
        b->parents = p;
        b->cap = cap;
    }
    b->hashes[b->n] = h;
    b->parents[b->n] = parent;
    b->n++;
    return KVF_OK;
}

static void watcher_send(kvf_worker *w, watcher *wt, const kvf_rpc_watch_msg *m)
{
    if (wt->dead)
        return;
    kvf_err err = {0};
    if (kvf_rpc_call_send_watch(wt->call, m, &err) != KVF_OK) {
        kvf_log(KVF_LOG_INFO, "worker: watcher %llu (%s) dropped: %s", (unsigned long long)wt->key,
                kvf_rpc_call_peer(wt->call), err.msg);
        wt->dead = true;
    }
    (void)w;
}

static void send_event(kvf_worker *w, watcher *only, kvf_rpc_kv_event_kind kind, int32_t tier,
                       uint64_t seq, const uint64_t *h, const uint64_t *p, size_t n, bool done)
{
    kvf_rpc_watch_msg m = {.event = {.seq = seq, .kind = kind, .block_hashes = h,
                                     .parent_hashes = p, .n = n,
                                     .block_size = w->layout.block_size, .model_id = w->model_id,
                                     .snapshot_done = done, .tier = tier}};
    for (watcher *wt = w->watchers; wt; wt = wt->next)
        if (!only || wt == only)
            watcher_send(w, wt, &m);
}

void kvf_worker_flush_events(kvf_worker *w)
{
    ev_buf *b = &w->evs;
    if (b->n == 0)
        return;
    bool stored = b->kind == KVF_KV_EVENT_STORED;
    for (size_t off = 0; off < b->n; off += WATCH_BATCH) {
        size_t n = b->n - off < WATCH_BATCH ? b->n - off : WATCH_BATCH;
        w->ev_seq++;
        if (w->watchers)
            send_event(w, NULL, stored ? KVF_RPC_KV_STORED : KVF_RPC_KV_REMOVED,
                       stored ? b->tier : KVF_RPC_TIER_POOL, w->ev_seq, b->hashes + off,
                       stored ? b->parents + off : NULL, n, false);
        if (w->m_events)
            kvf_metric_add(w->m_events, 1);
    }
    b->n = 0;
    b->kind = 0;
    b->tier = 0;
}

/* Pool callback (loop thread, inside engine/pool calls): buffer, flushing on a change of kind
 * or (for STORED) of tier, so the order of STORED and REMOVED is kept and one message names one
 * tier (a REMOVED leaves every tier: it carries none). */
static void on_kv_event(void *ctx, const kvf_kv_event *ev)
{
    kvf_worker *w = ctx;
    int32_t tier = ev->type == KVF_KV_EVENT_STORED ? ev->tier : KVF_RPC_TIER_POOL;
    if (w->evs.kind && (w->evs.kind != (int)ev->type || w->evs.tier != tier))
        kvf_worker_flush_events(w);
    w->evs.kind = (int)ev->type;
    w->evs.tier = tier;
    if (ev_push(&w->evs, ev->hash, ev->parent_hash) != KVF_OK)
        kvf_log(KVF_LOG_ERROR, "worker: out of memory buffering KV events; watchers will miss one");
}

typedef struct snap_ctx {
    kvf_worker *w;
    watcher *wt;
    int32_t tier; /* of the blocks in h */
    uint64_t h[WATCH_BATCH], p[WATCH_BATCH];
    size_t n;
} snap_ctx;

/* Snapshot blocks in messages of one tier each (the pool's come first, then host, then disk). */
static void snap_cb(void *ctx, const kvf_kv_event *ev)
{
    snap_ctx *s = ctx;
    if (s->n > 0 && ev->tier != s->tier) {
        send_event(s->w, s->wt, KVF_RPC_KV_SNAPSHOT, s->tier, s->w->ev_seq, s->h, s->p, s->n,
                   false);
        s->n = 0;
    }
    s->tier = ev->tier;
    s->h[s->n] = ev->hash;
    s->p[s->n] = ev->parent_hash;
    if (++s->n == WATCH_BATCH) {
        send_event(s->w, s->wt, KVF_RPC_KV_SNAPSHOT, s->tier, s->w->ev_seq, s->h,
                   s->p, s->n, false);
        s->n = 0;
    }
}

static void send_load(kvf_worker *w, watcher *wt, const kvf_worker_load *l)
{
    kvf_rpc_watch_msg m = {.is_load = true};
    m.load = (kvf_rpc_load){
        .running = l->running, .waiting = l->waiting, .active_blocks = l->used_blocks,
        .free_blocks = l->free_blocks + l->cached_blocks, .total_blocks = l->total_blocks,
        .queued_prefill_tokens = w->hooks.queued_prefill_tokens
                                     ? w->hooks.queued_prefill_tokens(w->hooks.ctx) : 0,
        .unix_ms = kvf_wall_ms(), .host_promote_s_per_block = l->host_promote_s_per_block,
        .disk_promote_s_per_block = l->disk_promote_s_per_block};
    watcher_send(w, wt, &m);
    wt->last = *l;
    wt->last_load_ns = kvf_now_ns();
    wt->next_load_ns = wt->last_load_ns + wt->interval_ns;
}

typedef struct watch_job {
    kvf_rpc_call *call;
    int64_t interval_ms;
} watch_job;

static void watch_start_job(kvf_worker *w, void *arg)
{
    watch_job *j = arg;
    watcher *wt = calloc(1, sizeof *wt);
    if (!wt) {
        kvf_rpc_call_finish(j->call, KVF_ERR_NOMEM, "worker: out of memory");
        free(j);
        return;
    }
    wt->call = j->call;
    wt->key = ++w->next_watch_key;
    wt->interval_ns = (j->interval_ms > 0 ? j->interval_ms : w->cfg.load_interval_ms) * 1000000LL;
    free(j);
    kvf_worker_flush_events(w); /* deltas so far go to the others first */
    wt->next = w->watchers;
    w->watchers = wt;
    snap_ctx *s = calloc(1, sizeof *s);
    if (s) {
        s->w = w;
        s->wt = wt;
        kvf_kv_prefix_snapshot(w->pool, snap_cb, s);
        send_event(w, wt, KVF_RPC_KV_SNAPSHOT, s->tier, w->ev_seq, s->h, s->p, s->n,
                   true);
        free(s);
    }
    kvf_worker_load l;
    kvf_worker_load_get(w, &l);
    send_load(w, wt, &l);
    kvf_log(KVF_LOG_INFO, "worker: watcher %llu from %s (load every %lld ms)",
            (unsigned long long)wt->key, kvf_rpc_call_peer(wt->call),
            (long long)(wt->interval_ns / 1000000));
}

/* Drops dead watchers (finishing their calls), sends load reports that are due. */
static void watchers_pass(kvf_worker *w)
{
    int64_t now = kvf_now_ns();
    kvf_worker_load l;
    kvf_worker_load_get(w, &l);
    int n = 0;
    for (watcher **pp = &w->watchers; *pp;) {
        watcher *wt = *pp;
        if (!wt->dead && kvf_rpc_call_is_cancelled(wt->call))
            wt->dead = true;
        if (!wt->dead) {
            bool changed = memcmp(&l, &wt->last, sizeof l) != 0;
            if (now >= wt->next_load_ns || (changed && now - wt->last_load_ns >= 50000000LL))
                send_load(w, wt, &l);
        }
        if (wt->dead) {
            *pp = wt->next;
            kvf_rpc_call_finish(wt->call, KVF_ERR_CANCELLED, "watch ended");
            free(wt);
            continue;
        }
        n++;
        pp = &wt->next;
    }
    kvf_metric_set(w->m_watchers, n);
}

static void h_watch_kv(void *ctx, kvf_rpc_call *call, kvf_rpc_watch_req *r)
{
    kvf_worker *w = ctx;
    watch_job *j = calloc(1, sizeof *j);
    if (!j) {
        free(r);
        kvf_rpc_call_finish(call, KVF_ERR_NOMEM, "worker: out of memory");
        return;
    }
    j->call = call;
    j->interval_ms = r->load_interval_ms;
    free(r);
    /* a cancelled watch is noticed by the loop's next pass (kvf_rpc_call_is_cancelled) */
    if (kvf_worker_post(w, watch_start_job, j) != KVF_OK) {
        free(j);
        kvf_rpc_call_finish(call, KVF_ERR_CANCELLED, "worker: shutting down");
    }
}

/* ---- Info, Health ------------------------------------------------------------------------ */

static kvf_status h_info(void *ctx, kvf_rpc_call *call, kvf_rpc_info *ir, kvf_err *err)
{
    kvf_worker *w = ctx;
    *ir = (kvf_rpc_info){
        .protocol_version = KVF_RPC_PROTOCOL_VERSION,
        .role = w->role == KVF_WORKER_PREFILL ? KVF_RPC_ROLE_PREFILL : KVF_RPC_ROLE_DECODE,
        .model_id = w->model_id, .block_size = w->layout.block_size, .has_kv_layout = true,
        .kv_layout = w->layout, .capacity_blocks = w->n_blocks, .max_n = KVF_ENGINE_MAX_N,
        .transport = {.backend = kvf_xfer_backend_name(w->xfer), .blob = w->desc,
                      .blob_len = w->desc_len},
        .worker_id = w->worker_id, .software_version = "0.1.0"};
    (void)call;
    (void)err;
    return KVF_OK;
}

/* The detail string lives here until the layer has encoded the answer (one handler thread per
 * call: a thread-local buffer). */
static _Thread_local char health_detail[256];

static kvf_status h_health(void *ctx, kvf_rpc_call *call, kvf_rpc_health *hr, kvf_err *err)
{
    kvf_worker *w = ctx;
    kvf_worker_load l;
    kvf_worker_load_get(w, &l);
    snprintf(health_detail, sizeof health_detail,
             "running=%d waiting=%d total_blocks=%d free_blocks=%d cached_blocks=%d used_blocks=%d",
             l.running, l.waiting, l.total_blocks, l.free_blocks, l.cached_blocks, l.used_blocks);
    pthread_mutex_lock(&w->mu);
    bool stopping = w->stopping || w->draining;
    pthread_mutex_unlock(&w->mu);
    hr->status = stopping ? KVF_RPC_DRAINING : KVF_RPC_SERVING;
    hr->detail = health_detail;
    (void)call;
    (void)err;
    return KVF_OK;
}

/* ---- admin HTTP ---------------------------------------------------------------------------- */

static int admin_get(void *ctx, const char *path, kvf_sbuf *body, const char **ctype)
{
    kvf_worker *w = ctx;
    if (strcmp(path, "/metrics") == 0) {
        *ctype = "text/plain; version=0.0.4";
        kvf_metrics_render(w->metrics, body);
        return 200;
    }
    if (strcmp(path, "/health") == 0 || strcmp(path, "/ready") == 0) {
        /* /health (liveness) fails only once the worker stops; /ready (readiness) as soon as it
         * drains, so a Service takes it out while it finishes what it has */
        kvf_worker_load l;
        kvf_worker_load_get(w, &l);
        pthread_mutex_lock(&w->mu);
        bool draining = w->draining || w->stopping;
        bool down = w->stopping || (draining && strcmp(path, "/ready") == 0);
        pthread_mutex_unlock(&w->mu);
        *ctype = "application/json";
        kvf_sbuf_printf(body,
                        "{\"status\":\"%s\",\"role\":\"%s\",\"running\":%d,\"waiting\":%d,"
                        "\"total_blocks\":%d,\"free_blocks\":%d,\"cached_blocks\":%d,"
                        "\"used_blocks\":%d}\n",
                        draining ? "draining" : "serving",
                        w->role == KVF_WORKER_PREFILL ? "prefill" : "decode", l.running,
                        l.waiting, l.total_blocks, l.free_blocks, l.cached_blocks, l.used_blocks);
        return down ? 503 : 200;
    }
    kvf_sbuf_printf(body, "no such path %s (use /metrics, /health or /ready)\n", path);
    return 404;
}

/* ---- the loop ------------------------------------------------------------------------------ */

/* The tiers' counters and gauges on /metrics (loop thread, every pass). */
static void publish_tiers(kvf_worker *w, const kvf_kv_pool_stats *ps)
{
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(w->tier, &ts);
    int64_t lower_hits = 0;
    for (int k = KVF_KV_TIER_HOST; k <= KVF_KV_TIER_DISK; k++) {
        const kvf_kv_tier_level_stats *t = &ts.tier[k];
        if (!w->m_tier_hits[k])
            continue;
        lower_hits += t->promoted;
        kvf_metric_set(w->m_tier_hits[k], (double)t->hits);
        kvf_metric_set(w->m_tier_demoted[k], (double)t->demoted);
        kvf_metric_set(w->m_tier_promoted[k], (double)t->promoted);
        kvf_metric_set(w->m_tier_demoted_bytes[k], (double)t->bytes_demoted);
        kvf_metric_set(w->m_tier_promoted_bytes[k], (double)t->bytes_promoted);
        kvf_metric_set(w->m_tier_used[k], (double)t->used);
        kvf_metric_set(w->m_tier_capacity[k], (double)t->capacity);
    }
    if (w->m_tier_hits[KVF_KV_TIER_POOL])
        kvf_metric_set(w->m_tier_hits[KVF_KV_TIER_POOL], (double)(ps->hit_blocks - lower_hits));
    if (w->m_tier_corrupt)
        kvf_metric_set(w->m_tier_corrupt, (double)ts.tier[KVF_KV_TIER_DISK].corrupt);
}

/* kvf_kv_tier_cfg.on_promote (loop thread, in the engine step's poll of the copy thread's
 * completions; seconds from the job's submission to the end of its copy): the latency histogram
 * and the EWMA the load reports carry (the router prices a tier hit by it). */
static void on_promote(void *ctx, kvf_kv_tier_kind tier, double seconds)
{
    kvf_worker *w = ctx;
    if (tier < KVF_KV_TIER_HOST || tier > KVF_KV_TIER_DISK)
        return;
    double *e = &w->promote_ewma[tier];
    *e = *e > 0 ? 0.9 * *e + 0.1 * seconds : (seconds > 0 ? seconds : 1e-9);
    if (w->m_tier_promote_s[tier])
        kvf_metric_observe(w->m_tier_promote_s[tier], seconds);
}

static void publish_load(kvf_worker *w)
{
    kvf_worker_load l = {0};
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(w->pool, &ps);
    kvf_engine_stats es;
    kvf_engine_get_stats(w->engine, &es);
    l.running = es.running + es.remote + es.kept;
    l.waiting = es.waiting + es.swapped;
    kvf_metric_set(w->m_prefix_hit, es.prefix_hit_tokens);
    kvf_metric_set(w->m_draws, es.backend_draws);
#ifdef KVF_HAVE_CUDA
    int64_t now = kvf_now_ns();
    if (w->m_gpu_used && now - w->gpu_stats_ns >= 500 * 1000000LL) { /* cudaMemGetInfo: not per pass */
        kvf_cuda_stats cs;
        kvf_cuda_backend_stats(kvf_engine_backend_ctx(w->engine), &cs);
        kvf_metric_set(w->m_gpu_used, cs.device_bytes);
        kvf_metric_set(w->m_graph_replays, cs.graph_replays);
        kvf_metric_set(w->m_graph_captures, cs.graphs_captured);
        w->gpu_stats_ns = now;
    }
#endif
    l.total_blocks = ps.total;
    l.free_blocks = ps.free;
    l.cached_blocks = ps.cached + ps.pinned;
    l.used_blocks = ps.used;
    l.host_promote_s_per_block = w->promote_ewma[KVF_KV_TIER_HOST];
    l.disk_promote_s_per_block = w->promote_ewma[KVF_KV_TIER_DISK];
    if (w->tier)
        publish_tiers(w, &ps);
    if (w->hooks.fill_load)
        w->hooks.fill_load(w->hooks.ctx, &l);
    pthread_mutex_lock(&w->mu);
    w->load = l;
    pthread_mutex_unlock(&w->mu);
    kvf_metric_set(w->m_free, l.free_blocks);
    kvf_metric_set(w->m_used, l.used_blocks);
    kvf_metric_set(w->m_cached, l.cached_blocks);
    kvf_metric_set(w->m_total, l.total_blocks);
    kvf_metric_set(w->m_running, l.running);
    kvf_metric_set(w->m_waiting, l.waiting);
    /* the same load under the Gateway API Inference Extension's model-server names */
    double usage = l.total_blocks > 0 ? (double)l.used_blocks / (double)l.total_blocks : 0.0;
    kvf_metric_set(w->m_kv_usage, usage);
    kvf_metric_set(w->m_gie_kv_usage, usage);
    kvf_metric_set(w->m_gie_running, l.running);
    kvf_metric_set(w->m_gie_waiting, l.waiting);
    kvf_metric_set(w->m_queued_prefill,
                   w->hooks.queued_prefill_tokens ? (double)w->hooks.queued_prefill_tokens(w->hooks.ctx) : 0.0);
}

void kvf_worker_load_get(kvf_worker *w, kvf_worker_load *out)
{
    pthread_mutex_lock(&w->mu);
    *out = w->load;
    pthread_mutex_unlock(&w->mu);
}

void kvf_worker_wake(kvf_worker *w)
{
    if (!atomic_exchange(&w->woken, true)) {
        char c = 1;
        ssize_t k = write(w->wake_wr, &c, 1);
        (void)k;
    }
}

kvf_status kvf_worker_post(kvf_worker *w, kvf_worker_job_fn fn, void *arg)
{
    job *j = calloc(1, sizeof *j);
    if (!j)
        return KVF_ERR_NOMEM;
    j->fn = fn;
    j->arg = arg;
    pthread_mutex_lock(&w->mu);
    if (w->stopped) {
        pthread_mutex_unlock(&w->mu);
        free(j);
        return KVF_ERR_STATE;
    }
    if (w->tail)
        w->tail->next = j;
    else
        w->head = j;
    w->tail = j;
    pthread_mutex_unlock(&w->mu);
    kvf_worker_wake(w);
    return KVF_OK;
}

kvf_status kvf_worker_call(kvf_worker *w, kvf_worker_job_fn fn, void *arg)
{
    job j = {.fn = fn, .arg = arg, .wait = true};
    pthread_mutex_lock(&w->mu);
    if (w->stopped) {
        pthread_mutex_unlock(&w->mu);
        return KVF_ERR_STATE;
    }
    if (w->tail)
        w->tail->next = &j;
    else
        w->head = &j;
    w->tail = &j;
    pthread_mutex_unlock(&w->mu);
    kvf_worker_wake(w);
    pthread_mutex_lock(&w->mu);
    while (!j.done)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    return KVF_OK;
}

/* Runs every queued job; returns how many ran. */
static int run_jobs(kvf_worker *w)
{
    pthread_mutex_lock(&w->mu);
    job *j = w->head;
    w->head = w->tail = NULL;
    pthread_mutex_unlock(&w->mu);
    int n = 0;
    while (j) {
        job *next = j->next;
        j->fn(w, j->arg);
        if (j->wait) {
            pthread_mutex_lock(&w->mu);
            j->done = true;
            pthread_cond_broadcast(&w->cv);
            pthread_mutex_unlock(&w->mu);
        } else {
            free(j);
        }
        j = next;
        n++;
    }
    return n;
}

static int xfer_pass(kvf_worker *w)
{
    kvf_xfer_progress(w->xfer);
    kvf_xfer_event ev;
    int n = 0;
    while (kvf_xfer_poll(w->xfer, &ev)) {
        n++;
        if (w->hooks.on_xfer_event)
            w->hooks.on_xfer_event(w->hooks.ctx, &ev);
        else
            kvf_log(KVF_LOG_DEBUG, "worker: transfer %llu event ignored", (unsigned long long)ev.id);
    }
    return n;
}

static void *loop_main(void *arg)
{
    kvf_worker *w = arg;
    kvf_err err = {0};
    for (;;) {
        pthread_mutex_lock(&w->mu);
        bool stopping = w->stopping;
        pthread_mutex_unlock(&w->mu);
        if (stopping)
            break;
        int work = run_jobs(w);
        bool engine_work = false;
        if (kvf_engine_busy(w->engine)) {
            const kvf_engine_output *outs = NULL;
            int32_t n_out = 0;
            kvf_status st = kvf_engine_step(w->engine, &outs, &n_out, &err);
            if (st != KVF_OK)
                kvf_log(KVF_LOG_ERROR, "worker: engine step: %s", err.msg);
            w->steps++;
            kvf_metric_add(w->m_steps, 1);
            for (int32_t i = 0; i < n_out; i++)
                if (w->hooks.on_output)
                    w->hooks.on_output(w->hooks.ctx, &outs[i]);
            /* sequences waiting only for a remote prefill keep the engine "busy" without giving
             * a step anything to run: the loop may sleep then (the transfer or reply wakes it) */
            kvf_engine_stats es;
            kvf_engine_get_stats(w->engine, &es);
            engine_work = n_out > 0 || es.running + es.waiting + es.swapped > 0;
        }
        work += xfer_pass(w);
        if (w->hooks.on_tick)
            w->hooks.on_tick(w->hooks.ctx);
        kvf_worker_flush_events(w);
        publish_load(w);
        watchers_pass(w);
        if (work > 0 || engine_work)
            continue;
        /* idle: sleep on the wake pipe and the transport's fd, at most 10 ms (deadlines) */
        struct pollfd p[2] = {{.fd = w->wake_rd, .events = POLLIN}, {.fd = -1, .events = POLLIN}};
        int nfd = 1, timeout = 10;
        int xfd = kvf_xfer_event_fd(w->xfer);
        if (xfd >= 0) {
            if (kvf_xfer_arm(w->xfer)) {
                p[1].fd = xfd;
                nfd = 2;
            } else {
                timeout = 0;
            }
        }
        if (timeout > 0 && poll(p, (nfds_t)nfd, timeout) > 0 && (p[0].revents & POLLIN)) {
            char buf[64];
            while (read(w->wake_rd, buf, sizeof buf) > 0) {
            }
            atomic_store(&w->woken, false);
        }
    }
    /* last pass: the role cancels what is live; then watchers end */
    run_jobs(w);
    if (w->hooks.on_shutdown)
        w->hooks.on_shutdown(w->hooks.ctx);
    pthread_mutex_lock(&w->mu);
    w->stopped = true;
    pthread_mutex_unlock(&w->mu);
    run_jobs(w); /* jobs posted before stopped was set */
    /* report the cancellations so every sequence is gone from the pool */
    for (int i = 0; i < 4 && kvf_engine_busy(w->engine); i++) {
        const kvf_engine_output *outs = NULL;
        int32_t n_out = 0;
        kvf_engine_step(w->engine, &outs, &n_out, &err);
    }
    for (watcher *wt = w->watchers; wt; wt = wt->next)
        wt->dead = true;
    watchers_pass(w);
    publish_load(w);
    return NULL;
}

/* ---- create / start / shutdown ------------------------------------------------------------- */

static kvf_status add_metric(kvf_worker *w, int gauge, const char *name, const char *help,
                             kvf_metric **out, kvf_err *err)
{
    char labels[64];
    snprintf(labels, sizeof labels, "role=\"%s\"", w->role == KVF_WORKER_PREFILL ? "prefill" : "decode");
    return gauge ? kvf_metrics_gauge(w->metrics, name, labels, help, out, err)
                 : kvf_metrics_counter(w->metrics, name, labels, help, out, err);
}

/* One series per tier: name{role="...",tier="host"}; a histogram when bounds is set. */
static kvf_status add_tier_metric(kvf_worker *w, int gauge, int tier, const char *name,
                                  const char *help, const double *bounds, size_t n_bounds,
                                  kvf_metric **out, kvf_err *err)
{
    static const char *names[] = {"pool", "host", "disk"};
    char labels[96];
    snprintf(labels, sizeof labels, "role=\"%s\",tier=\"%s\"",
             w->role == KVF_WORKER_PREFILL ? "prefill" : "decode", names[tier]);
    if (bounds)
        return kvf_metrics_histogram(w->metrics, name, labels, help, bounds, n_bounds, out, err);
    return gauge ? kvf_metrics_gauge(w->metrics, name, labels, help, out, err)
                 : kvf_metrics_counter(w->metrics, name, labels, help, out, err);
}

/* The tier series, registered only when this worker has tiers (/metrics is as before without). */
static kvf_status add_tier_metrics(kvf_worker *w, kvf_err *err)
{
    static const double bounds[] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1};
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(w->tier, &ts);
    kvf_status st;
    if ((st = add_tier_metric(w, 0, KVF_KV_TIER_POOL, "kvfleet_kv_tier_hit_blocks_total",
                              "prompt blocks a prefix lookup found, by the tier that held them",
                              NULL, 0, &w->m_tier_hits[0], err)) != KVF_OK)
        return st;
    for (int k = KVF_KV_TIER_HOST; k <= KVF_KV_TIER_DISK; k++) {
        if (ts.tier[k].capacity == 0)
            continue;
        if ((st = add_tier_metric(w, 0, k, "kvfleet_kv_tier_hit_blocks_total", "prompt blocks a prefix lookup found, by the tier that held them", NULL, 0, &w->m_tier_hits[k], err)) ||
            (st = add_tier_metric(w, 0, k, "kvfleet_kv_tier_demoted_blocks_total", "KV blocks moved down into this tier", NULL, 0, &w->m_tier_demoted[k], err)) ||
            (st = add_tier_metric(w, 0, k, "kvfleet_kv_tier_promoted_blocks_total", "KV blocks copied back from this tier into the pool", NULL, 0, &w->m_tier_promoted[k], err)) ||
            (st = add_tier_metric(w, 0, k, "kvfleet_kv_tier_demoted_bytes_total", "KV bytes moved down into this tier", NULL, 0, &w->m_tier_demoted_bytes[k], err)) ||
            (st = add_tier_metric(w, 0, k, "kvfleet_kv_tier_promoted_bytes_total", "KV bytes copied back from this tier into the pool", NULL, 0, &w->m_tier_promoted_bytes[k], err)) ||
            (st = add_tier_metric(w, 0, k, "kvfleet_kv_tier_promote_seconds", "time to promote one block from this tier into the pool", bounds, sizeof bounds / sizeof *bounds, &w->m_tier_promote_s[k], err)) ||
            (st = add_tier_metric(w, 1, k, "kvfleet_kv_tier_used_blocks", "KV blocks held in this tier", NULL, 0, &w->m_tier_used[k], err)) ||
            (st = add_tier_metric(w, 1, k, "kvfleet_kv_tier_capacity_blocks", "KV blocks this tier can hold", NULL, 0, &w->m_tier_capacity[k], err)))
            return st;
    }
    if (ts.tier[KVF_KV_TIER_DISK].capacity > 0 &&
        (st = add_tier_metric(w, 0, KVF_KV_TIER_DISK, "kvfleet_kv_tier_corrupt_blocks_total",
                              "disk tier reads refused (length, checksum or header): misses",
                              NULL, 0, &w->m_tier_corrupt, err)) != KVF_OK)
        return st;
    return KVF_OK;
}

/* --kv-host-memory, --kv-disk-dir, --kv-disk-bytes: the tiers under the pool, or none. Errors
 * name the flag, the value and what is allowed. */
static kvf_status make_tiers(kvf_worker *w, const kvf_worker_cfg *cfg, const char *rn,
                             kvf_err *err)
{
    bool disk = cfg->kv_disk_dir && *cfg->kv_disk_dir;
    int64_t bb = w->layout.block_bytes;
    if (cfg->kv_host_memory < 0 || (cfg->kv_host_memory > 0 && cfg->kv_host_memory < bb))
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --kv-host-memory=%lld holds no KV block "
                           "(one is %lld bytes; use 0 for no host tier, or at least %lld)", rn,
                           (long long)cfg->kv_host_memory, (long long)bb, (long long)bb);
    if (cfg->kv_disk_bytes < 0 || (!disk && cfg->kv_disk_bytes > 0))
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --kv-disk-bytes=%lld is not allowed "
                           "(a size of at least one block, with --kv-disk-dir)", rn,
                           (long long)cfg->kv_disk_bytes);
    if (disk && cfg->kv_host_memory == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --kv-disk-dir=%s needs --kv-host-memory "
                           "(the disk tier sits under the host tier)", rn, cfg->kv_disk_dir);
    int64_t slot = kvf_kv_tier_slot_bytes_for(&w->layout); /* block, header, token ids */
    if (disk && cfg->kv_disk_bytes < slot)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --kv-disk-dir=%s needs --kv-disk-bytes of "
                           "at least one disk slot (%lld bytes: a KV block of %lld, its header "
                           "and token ids); --kv-disk-bytes=%lld", rn, cfg->kv_disk_dir,
                           (long long)slot, (long long)bb, (long long)cfg->kv_disk_bytes);
    if (cfg->kv_host_memory == 0)
        return KVF_OK;
    kvf_kv_tier_cfg tc = {.host_bytes = cfg->kv_host_memory, .disk_dir = disk ? cfg->kv_disk_dir : NULL,
                          .disk_bytes = disk ? cfg->kv_disk_bytes : 0, .on_promote = on_promote,
                          .promote_ctx = w};
    kvf_status st = kvf_kv_tier_create(&tc, &w->layout, &w->tier, err);
    if (st == KVF_OK)
        return KVF_OK;
    if (disk)
        return kvf_err_prefix(err, "%s: --kv-host-memory=%lld --kv-disk-dir=%s --kv-disk-bytes=%lld",
                              rn, (long long)cfg->kv_host_memory, cfg->kv_disk_dir,
                              (long long)cfg->kv_disk_bytes);
    return kvf_err_prefix(err, "%s: --kv-host-memory=%lld", rn, (long long)cfg->kv_host_memory);
}

/* The transport --xfer-backend names (auto: cuda_ipc for a device pool, ucx for a host one),
 * checked against --device from the flags alone, so a mismatch is refused before any model or
 * GPU is touched. */
static kvf_status pick_transport(const kvf_worker_cfg *cfg, const char *rn, const char **out,
                                 kvf_err *err)
{
    const char *flag = "xfer-backend";
    bool gpu_pool = cfg->device && strcmp(cfg->device, "cuda") == 0;
    bool staging = cfg->xfer.gpu_staging;
    const char *b = kvf_xfer_backend_pick(cfg->xfer.backend, gpu_pool, staging);
    if (strcmp(b, "ucx") != 0 && strcmp(b, "local") != 0 && strcmp(b, "cuda_ipc") != 0 &&
        strcmp(b, "nccl") != 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --%s=%s is not supported (use auto, ucx, "
                           "cuda_ipc, nccl or local)", rn, flag, b);
    bool gpu_to_gpu = strcmp(b, "cuda_ipc") == 0 || strcmp(b, "nccl") == 0;
    if (gpu_pool) {
        if (strcmp(b, "local") == 0)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --device cuda keeps the KV pool in GPU "
                               "memory and --%s=local copies host memory (use cuda_ipc on one "
                               "node, nccl between GPUs, or ucx with --xfer-gpu-staging)", rn, flag);
        if (strcmp(b, "ucx") == 0 && !staging)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --device cuda keeps the KV pool in GPU "
                               "memory and --%s=ucx moves host memory only (this UCX has no CUDA "
                               "transports): use --%s=cuda_ipc on one node, --%s=nccl "
                               "(NCCL, GPU to GPU), or add --xfer-gpu-staging (ucx through a pinned host "
                               "mirror)", rn, flag, flag, flag);
        if (gpu_to_gpu && staging)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --xfer-gpu-staging is for --%s=ucx "
                               "(%s moves GPU to GPU)", rn, flag, b);
    } else {
        /* nccl: NCCL sends from and receives into device memory only, and the pair's
         * communicator needs a GPU on both sides. */
        if (gpu_to_gpu)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --%s=%s moves GPU pools: it needs "
                               "--device cuda (%s; use ucx or local with --device %s)", rn, flag,
                               b, strcmp(b, "nccl") == 0 ? "NCCL sends and receives device "
                               "memory only" : "CUDA IPC maps device memory",
                               cfg->device ? cfg->device : "cpu");
        if (staging)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --xfer-gpu-staging needs --device cuda "
                               "(a host pool goes over ucx directly)", rn);
    }
    if (cfg->xfer.notice_host) {
        struct in_addr a;
        if (!gpu_to_gpu)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --xfer-notice-host is for cuda_ipc and "
                               "nccl (the transport is %s)", rn, b);
        if (inet_pton(AF_INET, cfg->xfer.notice_host, &a) != 1 || a.s_addr == htonl(INADDR_ANY))
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --xfer-notice-host=%s is not an IPv4 "
                               "address peers can connect to (e.g. this node's 10.0.0.7)", rn,
                               cfg->xfer.notice_host);
    }
    *out = b;
    return KVF_OK;
}

/* The transfer plane's address: --xfer-listen, else --xfer-notice-host (the one listener it
 * used to name), else the --listen host, as a numeric address (a name is resolved here, once);
 * "0.0.0.0" for every interface. */
static kvf_status xfer_listen_host(const kvf_worker_cfg *cfg, const char *listen_host,
                                   const char *rn, char *out, size_t cap, kvf_err *err)
{
    const char *flag = cfg->xfer_listen ? "xfer-listen"
                     : cfg->xfer.notice_host ? "xfer-notice-host" : "listen";
    char h[256];
    snprintf(h, sizeof h, "%s", cfg->xfer_listen ? cfg->xfer_listen
                                : cfg->xfer.notice_host ? cfg->xfer.notice_host : listen_host);
    size_t hl = strlen(h);
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') { /* [::1] */
        memmove(h, h + 1, hl - 2);
        h[hl - 2] = '\0';
    }
    if (!*h || strcmp(h, "0.0.0.0") == 0 || strcmp(h, "::") == 0 || strcmp(h, "*") == 0) {
        snprintf(out, cap, "0.0.0.0");
        return KVF_OK;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int rc = getaddrinfo(h, NULL, &hints, &ai);
    if (rc != 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --%s host '%s' (the KV transfer plane's "
                           "address) does not resolve: %s", rn, flag, h, gai_strerror(rc));
    void *a = ai->ai_family == AF_INET6 ? (void *)&((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr
                                        : (void *)&((struct sockaddr_in *)ai->ai_addr)->sin_addr;
    if (!inet_ntop(ai->ai_family, a, out, (socklen_t)cap)) {
        freeaddrinfo(ai);
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --%s host '%s': no address", rn, flag, h);
    }
    freeaddrinfo(ai);
    return KVF_OK;
}

/* The notice channel's address: --xfer-notice-host, else the --xfer-listen address when it is an
 * IPv4 address other than 0.0.0.0, else 127.0.0.1 (peers on this node only). An explicit
 * --xfer-notice-host must be the --xfer-listen address unless that is every interface. */
static kvf_status notice_host(const kvf_worker_cfg *cfg, const char *xfer_host, const char *rn,
                              const char *backend, const char **out, kvf_err *err)
{
    struct in_addr a;
    bool any = strcmp(xfer_host, "0.0.0.0") == 0;
    if (cfg->xfer.notice_host) {
        if (!any && strcmp(cfg->xfer.notice_host, xfer_host) != 0)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --xfer-notice-host=%s is not the "
                               "transfer plane's address --xfer-listen=%s: the notice channel "
                               "listens only there (set them equal, or --xfer-listen=0.0.0.0)", rn,
                               cfg->xfer.notice_host, xfer_host);
        *out = cfg->xfer.notice_host;
        return KVF_OK;
    }
    if (!any && inet_pton(AF_INET, xfer_host, &a) == 1) {
        *out = xfer_host;
        return KVF_OK;
    }
    if (strcmp(backend, "nccl") == 0)
        kvf_log(KVF_LOG_WARN, "%s: nccl: the notice channel listens on 127.0.0.1 (the transfer "
                "plane's address %s is no IPv4 address peers can reach), so only peers on this "
                "node can pair with it: set --xfer-notice-host (and --xfer-listen) to this node's "
                "address", rn, xfer_host);
    *out = "127.0.0.1";
    return KVF_OK;
}

/* The backend --device names (the engine's table) and, for a GPU, the transport's GPU ops. */
static kvf_status device_pick(const char *device, const char *who, const kvf_backend **be_out,
                              const kvf_xfer_gpu **gpu_out, kvf_err *err)
{
    kvf_status st = kvf_engine_backend_by_name(device, who, be_out, err);
    *gpu_out = NULL;
#ifdef KVF_HAVE_CUDA
    if (st == KVF_OK && *be_out == kvf_cuda_backend())
        *gpu_out = kvf_cuda_xfer_gpu();
#endif
    return st;
}

kvf_status kvf_worker_create(const kvf_worker_cfg *cfg, kvf_worker_role role, kvf_worker **out,
                             kvf_err *err)
{
    const char *rn = role == KVF_WORKER_PREFILL ? "prefill" : "decode";
    if (!cfg->model)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --model DIR is required", rn);
    if (cfg->threads < 0 || cfg->max_batch_tokens < 1 || cfg->max_seqs < 1 || cfg->kv_blocks < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --threads (%d) must be >= 0, --max-batch-tokens "
                           "(%d) and --max-seqs (%d) >= 1, --kv-blocks (%d) >= 0", rn, cfg->threads,
                           cfg->max_batch_tokens, cfg->max_seqs, cfg->kv_blocks);
    int dt = kvf_dtype_parse(cfg->kv_dtype ? cfg->kv_dtype : "");
    if (dt != KVF_DTYPE_F32 && dt != KVF_DTYPE_F16 && dt != KVF_DTYPE_BF16)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --kv-dtype=%s is not supported (use f32, f16 "
                           "or bf16)", rn, cfg->kv_dtype ? cfg->kv_dtype : "");
    int32_t attn_decode;
    kvf_status ast = kvf_engine_attn_decode_pick(cfg->attn_decode, rn, &attn_decode, err);
    if (ast != KVF_OK)
        return ast;
    int weight_dtype = kvf_backend_weight_dtype_parse(cfg->weight_dtype ? cfg->weight_dtype : "f32");
    if (weight_dtype < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --weight-dtype=%s is not supported (use f32 or q8)",
                           rn, cfg->weight_dtype);
    char host[256];
    int port;
    kvf_status st;
    /* device and transport: their flags agree before any GPU is looked for */
    const char *xfer_backend = NULL;
    if ((st = pick_transport(cfg, rn, &xfer_backend, err)) != KVF_OK)
        return st;
    const kvf_backend *be = NULL;
    const kvf_xfer_gpu *gpu = NULL;
    if ((st = device_pick(cfg->device, rn, &be, &gpu, err)) != KVF_OK)
        return st;
    if ((st = kvf_rpc_tls_check_member(&cfg->tls, rn, err)) != KVF_OK)
        return st;
    if ((st = kvf_worker_parse_hostport("listen", cfg->listen, host, sizeof host, &port, err)) != KVF_OK)
        return st;
    if (!kvf_rpc_tls_on(&cfg->tls) && strcmp(host, "localhost") != 0 && strncmp(host, "127.", 4) != 0 &&
        strcmp(host, "::1") != 0 && strcmp(host, "[::1]") != 0)
        kvf_log(KVF_LOG_WARN, "%s: gRPC on %s without --tls-cert/--tls-key/--tls-ca: anyone who reaches "
                "it can read the pool's descriptor, start transfers and cancel requests (docs/SECURITY.md)",
                rn, cfg->listen);
    if ((st = kvf_worker_parse_hostport("admin-listen", cfg->admin_listen, host, sizeof host, &port, err)) != KVF_OK)
        return st;

    kvf_worker *w = calloc(1, sizeof *w);
    if (!w)
        return kvf_err_set(err, KVF_ERR_NOMEM, "%s: out of memory", rn);
    w->cfg = *cfg;
    w->role = role;
    w->wake_rd = w->wake_wr = -1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    if (cfg->model_id && *cfg->model_id) {
        snprintf(w->model_id, sizeof w->model_id, "%s", cfg->model_id);
    } else {
        char tmp[1024];
        snprintf(tmp, sizeof tmp, "%s", cfg->model);
        size_t l = strlen(tmp);
        while (l > 1 && tmp[l - 1] == '/')
            tmp[--l] = '\0';
        snprintf(w->model_id, sizeof w->model_id, "%s", basename(tmp));
    }
    if (cfg->worker_id && *cfg->worker_id)
        snprintf(w->worker_id, sizeof w->worker_id, "%s", cfg->worker_id);
    else
        snprintf(w->worker_id, sizeof w->worker_id, "%s-%d", rn, (int)getpid());

    /* model and layout */
    if ((st = kvf_model_load(cfg->model, &w->model, err)) != KVF_OK)
        goto fail;
    if ((st = kvf_model_kv_layout(w->model, cfg->block_size, (kvf_dtype)dt, &w->layout, err)) != KVF_OK) {
        kvf_err_prefix(err, "%s: --block-size=%d", rn, cfg->block_size);
        goto fail;
    }
    int64_t nb = cfg->kv_blocks > 0 ? cfg->kv_blocks : cfg->kv_memory / w->layout.block_bytes;
    int64_t need = kvf_kv_blocks_for(w->model->cfg.max_pos, w->layout.block_size);
    if (nb < need || nb > INT32_MAX) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "%s: the KV pool (--kv-memory=%lld, --kv-blocks=%d) "
                         "holds %lld blocks of %lld bytes; one sequence of the model's full context "
                         "(%d tokens) needs %lld (use more memory)", rn, (long long)cfg->kv_memory,
                         cfg->kv_blocks, (long long)nb, (long long)w->layout.block_bytes,
                         w->model->cfg.max_pos, (long long)need);
        goto fail;
    }
    w->n_blocks = (int32_t)nb;
    char capb[512];
    kvf_log(KVF_LOG_INFO, "%s: model %s (id %s): %s", rn, cfg->model, w->model_id,
            kvf_model_capacity_str(&w->layout, nb, w->model->cfg.max_pos, capb, sizeof capb));

    /* the engine, for both roles (prefill's RemotePrefill calls are its prefill-only
     * requests): it makes the backend, then its pool through the backend's kv_mem ops, one
     * device allocation with --device cuda, which the transport registers and CUDA IPC exports
     * whole */
    kvf_engine_cfg ec;
    kvf_engine_cfg_default(&ec);
    ec.n_blocks = w->n_blocks;
    ec.block_size = cfg->block_size;
    ec.kv_dtype = (kvf_dtype)dt;
    ec.max_batch_tokens = cfg->max_batch_tokens;
    ec.max_seqs = cfg->max_seqs < cfg->max_batch_tokens ? cfg->max_seqs : cfg->max_batch_tokens;
    ec.threads = cfg->threads;
    ec.attn_decode = attn_decode;
    ec.weight_dtype = weight_dtype;
    ec.model_id = w->model_id;
    ec.tokenizer_dir = cfg->model; /* constrained decoding masks its tokens */
    ec.on_event = on_kv_event;
    ec.event_ctx = w;
    if ((st = make_tiers(w, cfg, rn, err)) != KVF_OK)
        goto fail;
    ec.kv_tier = w->tier;
    if ((st = kvf_engine_create(w->model, be, &ec, &w->engine, err)) != KVF_OK)
        goto fail;
    w->pool = kvf_engine_pool(w->engine);

    /* transport: the pool's memory, registered once (a device pool through the GPU ops) */
    char listen_host[256];
    int listen_port;
    if ((st = kvf_worker_parse_hostport("listen", cfg->listen, listen_host, sizeof listen_host,
                                        &listen_port, err)) != KVF_OK)
        goto fail;
    kvf_xfer_cfg xc = cfg->xfer;
    xc.backend = xfer_backend;
    xc.gpu = gpu;
    if ((st = xfer_listen_host(cfg, listen_host, rn, w->xfer_host, sizeof w->xfer_host, err)) != KVF_OK ||
        (st = notice_host(cfg, w->xfer_host, rn, xfer_backend, &xc.notice_host, err)) != KVF_OK)
        goto fail;
    xc.listen_host = w->xfer_host;
    kvf_xfer_pool xp = {.base = kvf_kv_pool_base(w->pool), .layout = w->layout, .n_blocks = w->n_blocks};
    if ((st = kvf_xfer_create(&xc, &xp, &w->xfer, err)) != KVF_OK) {
        kvf_err_prefix(err, "%s: --xfer-backend=%s%s --xfer-listen=%s", rn, xc.backend,
                       xc.gpu_staging ? " --xfer-gpu-staging" : "", w->xfer_host);
        goto fail;
    }
    bool noticed = strcmp(xc.backend, "cuda_ipc") == 0 || strcmp(xc.backend, "nccl") == 0;
    kvf_log(KVF_LOG_INFO, "%s: KV pool in %s memory, transport %s%s, listening on %s%s%s", rn,
            gpu ? "GPU" : "host", xc.backend, xc.gpu_staging ? " through a pinned host mirror" : "",
            w->xfer_host, noticed ? ", notices on " : "", noticed ? xc.notice_host : "");
    if ((st = kvf_xfer_desc_export(w->xfer, &w->desc, &w->desc_len, err)) != KVF_OK)
        goto fail;

    /* metrics */
    if ((st = kvf_metrics_create(&w->metrics)) != KVF_OK) {
        kvf_err_set(err, st, "%s: cannot create the metrics registry", rn);
        goto fail;
    }
    if ((st = add_metric(w, 1, "kvfleet_kv_free_blocks", "KV blocks on the free list", &w->m_free, err)) ||
        (st = add_metric(w, 1, "kvfleet_kv_used_blocks", "KV blocks held by sequences", &w->m_used, err)) ||
        (st = add_metric(w, 1, "kvfleet_kv_cached_blocks", "idle KV blocks kept by the prefix cache", &w->m_cached, err)) ||
        (st = add_metric(w, 1, "kvfleet_kv_total_blocks", "KV blocks in the pool", &w->m_total, err)) ||
        (st = add_metric(w, 1, "kvfleet_running_sequences", "sequences running (or prefilled remotely)", &w->m_running, err)) ||
        (st = add_metric(w, 1, "kvfleet_waiting_sequences", "sequences waiting or swapped", &w->m_waiting, err)) ||
        (st = add_metric(w, 0, "kvfleet_engine_steps_total", "engine steps", &w->m_steps, err)) ||
        (st = add_metric(w, 1, "kvfleet_kv_watchers", "open WatchKv streams", &w->m_watchers, err)) ||
        (st = add_metric(w, 0, "kvfleet_kv_events_total", "KV event messages published", &w->m_events, err)) ||
        (st = add_metric(w, 0, "kvfleet_engine_prefix_hit_tokens_total", "prompt tokens served from the prefix cache", &w->m_prefix_hit, err)) ||
        (st = add_metric(w, 0, "kvfleet_engine_backend_draws_total", "sampled tokens drawn on the backend (the GPU), not the host", &w->m_draws, err)) ||
        /* what an HPA/KEDA scales on, and the same under the Inference Extension's names */
        (st = add_metric(w, 1, "kvfleet_prefill_queued_tokens", "prompt tokens of RemotePrefill calls not yet answered (prefill; 0 on decode)", &w->m_queued_prefill, err)) ||
        (st = add_metric(w, 1, "kvfleet_kv_usage_ratio", "KV blocks held by sequences / KV blocks in the pool (0..1)", &w->m_kv_usage, err)) ||
        (st = add_metric(w, 1, "vllm:num_requests_waiting", "requests queued (Inference Extension TotalQueuedRequests)", &w->m_gie_waiting, err)) ||
        (st = add_metric(w, 1, "vllm:num_requests_running", "requests running (Inference Extension TotalRunningRequests)", &w->m_gie_running, err)) ||
        (st = add_metric(w, 1, "vllm:gpu_cache_usage_perc", "KV cache utilisation 0..1 (Inference Extension KVCacheUtilization)", &w->m_gie_kv_usage, err)))
        goto fail;
    if (w->tier && (st = add_tier_metrics(w, err)) != KVF_OK)
        goto fail;
    if (gpu && ((st = add_metric(w, 1, "kvfleet_gpu_memory_used_bytes", "GPU memory in use, all processes (cudaMemGetInfo)", &w->m_gpu_used, err)) ||
                (st = add_metric(w, 0, "kvfleet_cuda_graph_replays_total", "decode steps replayed from a CUDA graph", &w->m_graph_replays, err)) ||
                (st = add_metric(w, 0, "kvfleet_cuda_graphs_captured_total", "CUDA graphs captured for decode steps", &w->m_graph_captures, err))))
        goto fail;

    /* gRPC server with the shared handlers; the role adds its own */
    kvf_rpc_server_opts so = {.address = cfg->listen, .n_threads = cfg->rpc_threads > 0 ? cfg->rpc_threads : 4,
                              .tls = kvf_rpc_tls_on(&w->cfg.tls) ? &w->cfg.tls : NULL};
    if ((st = kvf_rpc_server_create(&so, &w->server, err)) != KVF_OK)
        goto fail;
    if ((st = kvf_rpc_serve_info(w->server, h_info, w, err)) != KVF_OK ||
        (st = kvf_rpc_serve_health(w->server, h_health, w, err)) != KVF_OK ||
        (st = kvf_rpc_serve_watch(w->server, h_watch_kv, w, err)) != KVF_OK)
        goto fail;

    int pfd[2];
    if (pipe2(pfd, O_NONBLOCK | O_CLOEXEC) != 0) {
        st = kvf_err_set(err, KVF_ERR_IO, "%s: pipe: %s", rn, strerror(errno));
        goto fail;
    }
    w->wake_rd = pfd[0];
    w->wake_wr = pfd[1];
    publish_load(w);
    *out = w;
    return KVF_OK;
fail:
    kvf_worker_destroy(w);
    return st;
}

void kvf_worker_set_hooks(kvf_worker *w, const kvf_worker_hooks *hooks)
{
    w->hooks = *hooks;
}

kvf_rpc_server *kvf_worker_rpc_server(kvf_worker *w)
{
    return w->server;
}

kvf_status kvf_worker_start(kvf_worker *w, kvf_err *err)
{
    const char *rn = w->role == KVF_WORKER_PREFILL ? "prefill" : "decode";
    if (pthread_create(&w->thread, NULL, loop_main, w) != 0)
        return kvf_err_set(err, KVF_ERR_INTERNAL, "%s: cannot start the loop thread", rn);
    w->thread_started = true;
    kvf_status st = kvf_rpc_server_start(w->server, err);
    if (st != KVF_OK)
        return st;
    char host[256];
    int port;
    kvf_worker_parse_hostport("admin-listen", w->cfg.admin_listen, host, sizeof host, &port, err);
    if ((st = kvf_worker_http_start(host, port, NULL, admin_get, w, &w->http, err)) != KVF_OK)
        return st;
    w->started = true;
    kvf_log(KVF_LOG_INFO, "%s: %s serving gRPC on port %d, admin HTTP on port %d", rn,
            w->worker_id, kvf_rpc_server_port(w->server), kvf_worker_http_port(w->http));
    return KVF_OK;
}

int kvf_worker_grpc_port(const kvf_worker *w)
{
    return w->server ? kvf_rpc_server_port(w->server) : -1;
}

int kvf_worker_admin_port(const kvf_worker *w)
{
    return kvf_worker_http_port(w->http);
}

void kvf_worker_shutdown(kvf_worker *w)
{
    if (!w || w->shut)
        return;
    w->shut = true;
    pthread_mutex_lock(&w->mu);
    w->stopping = true; /* Health says DRAINING from now on */
    pthread_mutex_unlock(&w->mu);
    if (w->thread_started) {
        kvf_worker_wake(w);
        /* the loop's last pass cancels every live request and finishes its call; calls that
         * arrive later find the loop stopped and finish themselves */
        pthread_join(w->thread, NULL);
        w->thread_started = false;
    } else {
        pthread_mutex_lock(&w->mu);
        w->stopped = true;
        pthread_mutex_unlock(&w->mu);
    }
    if (w->server)
        kvf_rpc_server_shutdown(w->server, 0);
    kvf_worker_http_stop(w->http);
    w->http = NULL;
}

void kvf_worker_drain(kvf_worker *w)
{
    pthread_mutex_lock(&w->mu);
    bool was = w->draining;
    w->draining = true;
    pthread_mutex_unlock(&w->mu);
    if (!was)
        kvf_log(KVF_LOG_INFO, "worker: draining: Health says DRAINING, /ready is 503");
}

bool kvf_worker_busy(kvf_worker *w)
{
    kvf_worker_load l;
    kvf_worker_load_get(w, &l);
    if (l.running || l.waiting)
        return true;
    return w->server && (kvf_rpc_server_live(w->server, KVF_RPC_WORKER_GENERATE) > 0 ||
                         kvf_rpc_server_live(w->server, KVF_RPC_WORKER_REMOTE_PREFILL) > 0);
}

void kvf_worker_destroy(kvf_worker *w)
{
    if (!w)
        return;
    kvf_worker_shutdown(w);
    kvf_rpc_server_destroy(w->server);
    /* jobs nobody ran (posted as the loop stopped) */
    for (job *j = w->head; j;) {
        job *n = j->next;
        if (!j->wait)
            free(j);
        j = n;
    }
    kvf_xfer_destroy(w->xfer);
    free(w->desc);
    kvf_engine_destroy(w->engine);
    kvf_kv_tier_destroy(w->tier); /* after the pool it served */
    kvf_model_destroy(w->model);
    kvf_metrics_destroy(w->metrics);
    free(w->evs.hashes);
    free(w->evs.parents);
    if (w->wake_rd >= 0)
        close(w->wake_rd);
    if (w->wake_wr >= 0)
        close(w->wake_wr);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

const kvf_worker_cfg *kvf_worker_config(const kvf_worker *w) { return &w->cfg; }
kvf_worker_role kvf_worker_role_of(const kvf_worker *w) { return w->role; }
const kvf_model *kvf_worker_model(const kvf_worker *w) { return w->model; }
const char *kvf_worker_model_id(const kvf_worker *w) { return w->model_id; }
const kvf_kv_layout *kvf_worker_layout(const kvf_worker *w) { return &w->layout; }
kvf_engine *kvf_worker_engine(kvf_worker *w) { return w->engine; }
kvf_kv_pool *kvf_worker_pool(kvf_worker *w) { return w->pool; }
kvf_xfer *kvf_worker_xfer(kvf_worker *w) { return w->xfer; }
kvf_metrics *kvf_worker_metrics(kvf_worker *w) { return w->metrics; }

const uint8_t *kvf_worker_xfer_desc(const kvf_worker *w, size_t *len_out)
{
    *len_out = w->desc_len;
    return w->desc;
}
