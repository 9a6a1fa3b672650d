/* worker.h: what the decode and prefill roles share: the model, the engine (the one scheduler of
 * both roles) with its KV pool, the one loop thread that owns them, a job queue into it, the
 * transport, the Worker gRPC service (Info, Health, Cancel, WatchKv here; Generate and
 * RemotePrefill are the roles' handlers) and the admin HTTP port (/metrics, /health).
 *
 * Threads: the loop thread owns the engine, its pool and kvf_xfer; everything that
 * touches them runs there, as a job (kvf_worker_post) or a hook. gRPC handler threads post jobs
 * and never touch the engine. Ownership: kvf_worker_create returns a worker the caller destroys
 * with kvf_worker_destroy (which shuts down servers and the loop and frees every block). */
#ifndef KVF_WORKER_WORKER_H
#define KVF_WORKER_WORKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/cfg.h"
#include "common/metrics.h"
#include "common/status.h"
#include "engine/engine.h"
#include "kv/layout.h"
#include "kv/pool.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "proto/rpc.h"
#include "proto/worker.h"
#include "transport/xfer.h"

typedef struct kvf_worker kvf_worker;

typedef enum kvf_worker_role {
    KVF_WORKER_DECODE = 0,  /* Generate (colocated when no prefill worker is named) */
    KVF_WORKER_PREFILL = 1, /* RemotePrefill: prefill-only engine requests */
} kvf_worker_role;

/* Every flag both roles share (kvf_worker_cfg_tables); each role's program adds its own. */
typedef struct kvf_worker_cfg {
    const char *model;        /* model directory */
    const char *model_id;     /* block-hash root; NULL: the directory's base name */
    const char *worker_id;    /* Info.worker_id; NULL: "<role>-<pid>" */
    const char *listen;       /* gRPC HOST:PORT (port 0: ephemeral) */
    const char *admin_listen; /* admin HTTP HOST:PORT (port 0: ephemeral) */
    const char *xfer_listen;  /* the KV transfer plane's listeners' address (UCX tcp, notice
                               * channel, NCCL bootstrap); NULL: the --listen host;
                               * 0.0.0.0 or ::: every interface */
    int64_t kv_memory;        /* KV pool bytes (when kv_blocks is 0) */
    int64_t kv_host_memory;   /* host KV tier bytes under the pool; 0: none (kv/tier.h) */
    const char *kv_disk_dir;  /* disk KV tier directory under the host tier; NULL: none */
    int64_t kv_disk_bytes;    /* disk KV tier bytes (with kv_disk_dir) */
    int32_t kv_blocks;        /* KV pool blocks; 0: from kv_memory */
    int32_t block_size;
    const char *kv_dtype;     /* f32, f16, bf16 */
    int32_t max_batch_tokens;
    int32_t max_seqs;
    int32_t threads;          /* backend threads; 0: one per CPU */
    int32_t rpc_threads;      /* gRPC handler threads */
    int32_t local_prefill_max_tokens; /* decode: prompts with at most this many uncached tokens
                                       * prefill locally; 0: remote whenever a hint is given */
    int32_t prefill_timeout_ms;       /* decode: remote prefill deadline, then local fallback */
    int32_t late_write_grace_ms;      /* decode: blocks of a given-up remote prefill stay held
                                       * until its answer or its deadline plus this (skew) */
    int32_t load_interval_ms;         /* WatchKv load report period (default for watchers) */
    const char *device;       /* cpu or cuda: where the model runs and the KV pool lives */
    const char *attn_decode;  /* cuda: auto, simt, mma (kvf_engine_attn_decode_pick) */
    const char *weight_dtype; /* f32 or q8 (CPU only; model/backend.h KVF_BACKEND_WEIGHT_*) */
    /* The KV transport (transport/xfer.h's flags: --xfer-backend, --xfer-transport, ...). Its
     * gpu table is the worker's to fill; notice_host NULL means the --xfer-listen host when it
     * is an IPv4 address other than 0.0.0.0, else 127.0.0.1; listen_host is set from
     * --xfer-listen. */
    kvf_xfer_cfg xfer;
    /* Mutual TLS on the worker plane (--tls-cert, --tls-key, --tls-ca, together or none): the
     * gRPC server admits only clients with a certificate the CA signed, and this worker's own
     * calls (decode -> prefill) present cert_file and check the peer for server_name
     * (--tls-name, the fleet's name every member certificate carries). */
    kvf_rpc_tls tls;
    const char *log_level;
    /* SIGTERM (kvf_cli_worker_main): Health says DRAINING and /ready 503 at once; the worker
     * keeps serving at least drain_delay_ms (routers see it and send nothing new), then exits
     * once idle (kvf_worker_busy), or after drain_timeout_ms more with the rest cancelled */
    int64_t drain_delay_ms, drain_timeout_ms;
    const char *log_format;   /* text or json: the stderr sink's format (common/log.h) */
    int32_t fault_delay_ms;   /* prefill: sleep this long before each prefill (fault tests) */
} kvf_worker_cfg;

/* The flags of kvf_worker_cfg as data: this worker table, then transport's, for a role's
 * kvf_cfg_spec.tables (ends with {0}). */
extern const kvf_cfg_table kvf_worker_cfg_tables[];

/* The table defaults, for code that builds a cfg without parsing flags. */
void kvf_worker_cfg_default(kvf_worker_cfg *cfg);

struct kvf_worker_load;

/* Hooks a role installs before kvf_worker_start; each runs on the loop thread. */
typedef struct kvf_worker_hooks {
    void *ctx;
    void (*on_output)(void *ctx, const kvf_engine_output *o);    /* engine outputs */
    void (*on_xfer_event)(void *ctx, const kvf_xfer_event *ev);  /* transfer completions */
    void (*on_tick)(void *ctx);     /* every loop pass (at least every 10 ms): deadlines */
    void (*on_shutdown)(void *ctx); /* last pass: cancel what is live, finish its calls */
    int64_t (*queued_prefill_tokens)(void *ctx); /* load reports; any thread; may be NULL */
    /* Adjusts the load the loop publishes (a prefill worker's running/waiting requests);
     * loop thread; may be NULL. */
    void (*fill_load)(void *ctx, struct kvf_worker_load *l);
} kvf_worker_hooks;

/* Loads the model, sizes the pool (errors name the flag), creates the engine, the transport, the gRPC server (Info, Health, Cancel, WatchKv
 * registered) and the metrics registry. Nothing runs until kvf_worker_start. */
kvf_status kvf_worker_create(const kvf_worker_cfg *cfg, kvf_worker_role role, kvf_worker **out,
                             kvf_err *err);
/* For the role, before start: its hooks, and its handlers on the gRPC server. */
void kvf_worker_set_hooks(kvf_worker *w, const kvf_worker_hooks *hooks);
kvf_rpc_server *kvf_worker_rpc_server(kvf_worker *w);
/* Starts the loop thread, the gRPC server and the admin HTTP server. */
kvf_status kvf_worker_start(kvf_worker *w, kvf_err *err);
/* Bound ports (after start). */
int kvf_worker_grpc_port(const kvf_worker *w);
int kvf_worker_admin_port(const kvf_worker *w);
/* Stops taking calls, cancels what is in flight (every block freed), stops the loop and the
 * admin server. Idempotent; kvf_worker_destroy calls it. */
void kvf_worker_shutdown(kvf_worker *w);
/* Draining: Health reports DRAINING and the admin /ready 503 from now on, while everything keeps
 * running (new calls included). Any thread; idempotent. */
void kvf_worker_drain(kvf_worker *w);
/* Sequences running or waiting, or Generate / RemotePrefill calls still open. Any thread. */
bool kvf_worker_busy(kvf_worker *w);
void kvf_worker_destroy(kvf_worker *w);

/* Runs fn(w, arg) on the loop thread (in order of posting). ERR_STATE once the loop has
 * stopped (fn is not run: the caller cleans up). Any thread. */
typedef void (*kvf_worker_job_fn)(kvf_worker *w, void *arg);
kvf_status kvf_worker_post(kvf_worker *w, kvf_worker_job_fn fn, void *arg);
/* Posts fn and waits for it to have run. ERR_STATE when the loop has stopped. */
kvf_status kvf_worker_call(kvf_worker *w, kvf_worker_job_fn fn, void *arg);

/* Loop-thread accessors (borrowed). */
const kvf_worker_cfg *kvf_worker_config(const kvf_worker *w);
kvf_worker_role kvf_worker_role_of(const kvf_worker *w);
const kvf_model *kvf_worker_model(const kvf_worker *w);
const char *kvf_worker_model_id(const kvf_worker *w);
const kvf_kv_layout *kvf_worker_layout(const kvf_worker *w);
kvf_engine *kvf_worker_engine(kvf_worker *w);
kvf_kv_pool *kvf_worker_pool(kvf_worker *w);
kvf_xfer *kvf_worker_xfer(kvf_worker *w);
/* This worker's transport descriptor (for RemotePrefillRequest.dst). Borrowed. */
const uint8_t *kvf_worker_xfer_desc(const kvf_worker *w, size_t *len_out);
kvf_metrics *kvf_worker_metrics(kvf_worker *w);
/* Asks the loop to run another pass soon (after work arrived outside a job). Any thread. */
void kvf_worker_wake(kvf_worker *w);
/* Publishes pending KV events to watchers now (loop thread; the loop also does it each pass). */
void kvf_worker_flush_events(kvf_worker *w);

/* A pool snapshot others may read from any thread (updated by the loop every pass). */
typedef struct kvf_worker_load {
    int32_t running, waiting;
    int32_t total_blocks, free_blocks, cached_blocks, used_blocks; /* used: held by sequences */
    /* EWMA of measured seconds per block promoted from the host / disk tier; 0: none yet */
    double host_promote_s_per_block, disk_promote_s_per_block;
} kvf_worker_load;
void kvf_worker_load_get(kvf_worker *w, kvf_worker_load *out);

/* The engine's sampling for what a request carried (both roles: decode's Generate, prefill's
 * first token): max_tokens 0 becomes the engine's default, the model's EOS ids stop it unless
 * ignore_eos, stop ids beyond KVF_ENGINE_MAX_STOP are dropped. n is copied as it is (the engine
 * refuses more than it allows). */
void kvf_worker_sampling(const kvf_worker *w, const kvf_rpc_sampling *s, kvf_engine_sampling *out);
/* An engine output's log-probabilities (sampling.logprobs) as the wire carries them. */
void kvf_worker_logprob(const kvf_engine_output *o, kvf_rpc_logprob *out);

/* Reads a HOST:PORT; errors name the flag. */
kvf_status kvf_worker_parse_hostport(const char *flag, const char *s, char *host, size_t cap,
                                     int *port_out, kvf_err *err);

/* ---- admin HTTP (worker/admin_http.c) ----------------------------------------------------- */
typedef struct kvf_worker_http kvf_worker_http;
/* A GET handler: fills body and content type; returns the HTTP status (200, 404). Runs on the
 * server's own thread. */
typedef int (*kvf_worker_http_fn)(void *ctx, const char *path, kvf_sbuf *body,
                                  const char **content_type_out);
/* Limits of the admin server; zeroed fields take the defaults below. One thread polls every
 * connection, so a client that sends nothing delays nobody: it holds one of max_conns slots until
 * read_timeout_ms after it connected (a request head must be complete by then), and at the cap
 * the connection that has been reading longest is closed for the newcomer. An answer the client
 * does not take within write_timeout_ms is dropped. */
#define KVF_WORKER_HTTP_MAX_CONNS 64
#define KVF_WORKER_HTTP_READ_TIMEOUT_MS 10000
#define KVF_WORKER_HTTP_WRITE_TIMEOUT_MS 10000
typedef struct kvf_worker_http_opts {
    int max_conns;        /* connections open at once */
    int read_timeout_ms;  /* from accept to a complete request head */
    int write_timeout_ms; /* from the answer being ready to its last byte taken */
} kvf_worker_http_opts;
/* Listens on host:port (port 0: ephemeral) and serves fn on its own thread; opts NULL: the
 * defaults. */
kvf_status kvf_worker_http_start(const char *host, int port, const kvf_worker_http_opts *opts,
                                 kvf_worker_http_fn fn, void *ctx, kvf_worker_http **out,
                                 kvf_err *err);
int kvf_worker_http_port(const kvf_worker_http *h);
void kvf_worker_http_stop(kvf_worker_http *h); /* joins the thread and frees; NULL is fine */

#endif
