/* worker.h: what the decode and prefill roles share: the model, KV pool (with the engine on
 * decode, a bare forward pass on prefill), the one loop thread that owns them, a job queue into
 * it, the transport, the Worker gRPC service (Info, Health, Cancel, WatchKv here; Generate and
 * RemotePrefill are the roles' handlers) and the admin HTTP port (/metrics, /health).
 *
 * Threads: the loop thread owns the engine, pool, forward pass and kvf_xfer; everything that
 * touches them runs there, as a job (kvf_worker_post) or a hook. gRPC handler threads post jobs
 * and never touch the engine. Ownership: kvf_worker_create returns a worker the caller destroys
 * with kvf_worker_destroy (which shuts down servers and the loop and frees every block). */
#ifndef KVF_WORKER_WORKER_H
#define KVF_WORKER_WORKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/metrics.h"
#include "common/status.h"
#include "engine/engine.h"
#include "kv/layout.h"
#include "kv/pool.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "proto/rpc.h"
#include "transport/xfer.h"

typedef struct kvf_worker kvf_worker;

typedef enum kvf_worker_role {
    KVF_WORKER_DECODE = 0,  /* engine + Generate (colocated when no prefill worker is named) */
    KVF_WORKER_PREFILL = 1, /* pool + forward pass + RemotePrefill */
} kvf_worker_role;

/* Every flag of both roles (cli/cmd_decode.c, cli/cmd_prefill.c share KVF_WORKER_CFG_OPTS). */
typedef struct kvf_worker_cfg {
    const char *model;        /* model directory */
    const char *model_id;     /* block-hash root; NULL: the directory's base name */
    const char *worker_id;    /* Info.worker_id; NULL: "<role>-<pid>" */
    const char *listen;       /* gRPC HOST:PORT (port 0: ephemeral) */
    const char *admin_listen; /* admin HTTP HOST:PORT (port 0: ephemeral) */
    int64_t kv_memory;        /* KV pool bytes (when kv_blocks is 0) */
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
    const char *transport;    /* auto, ucx, cuda_ipc or local (the older name of xfer_backend) */
    const char *xfer_backend; /* NULL: transport; else the same values (it wins) */
    bool xfer_gpu_staging;    /* ucx with a device pool: through a pinned host mirror */
    const char *xfer_tls;     /* ucx: auto, tcp, sm */
    const char *attn_decode;  /* cuda: auto, simt, mma (kvf_worker_attn_decode_pick) */
    const char *xfer_notice_host; /* cuda_ipc, nccl: IPv4 of the notice channel; NULL: the
                                   * --listen host when it is one, else 127.0.0.1 */
    const char *log_level;
    int32_t fault_delay_ms;   /* prefill: sleep this long before each prefill (fault tests) */
} kvf_worker_cfg;

#define KVF_WORKER_CFG_OPTS                                                                      \
    {"model", NULL, "model directory (config.json, model.safetensors)",                         \
     offsetof(kvf_worker_cfg, model), KVF_CFG_STR},                                              \
    {"model-id", NULL, "model id for block hashes (default: the model directory's name)",       \
     offsetof(kvf_worker_cfg, model_id), KVF_CFG_STR},                                           \
    {"worker-id", NULL, "this worker's name in Info (default: <role>-<pid>)",                   \
     offsetof(kvf_worker_cfg, worker_id), KVF_CFG_STR},                                          \
    {"listen", "127.0.0.1:0", "gRPC Worker service HOST:PORT (port 0: any free port)",           \
     offsetof(kvf_worker_cfg, listen), KVF_CFG_STR},                                             \
    {"admin-listen", "127.0.0.1:0", "admin HTTP (/metrics, /health) HOST:PORT",                 \
     offsetof(kvf_worker_cfg, admin_listen), KVF_CFG_STR},                                       \
    {"kv-memory", "64M", "KV pool bytes (K/M/G suffixes) when --kv-blocks is 0",                \
     offsetof(kvf_worker_cfg, kv_memory), KVF_CFG_SIZE},                                         \
    {"kv-blocks", "0", "KV pool blocks (overrides --kv-memory)",                                \
     offsetof(kvf_worker_cfg, kv_blocks), KVF_CFG_INT},                                          \
    {"block-size", "16", "tokens per KV block (a power of two; the same across the fleet)",     \
     offsetof(kvf_worker_cfg, block_size), KVF_CFG_INT},                                         \
    {"kv-dtype", "f32", "KV cache dtype: f32, f16 or bf16", offsetof(kvf_worker_cfg, kv_dtype), \
     KVF_CFG_STR},                                                                               \
    {"max-batch-tokens", "512", "token budget of one engine step",                               \
     offsetof(kvf_worker_cfg, max_batch_tokens), KVF_CFG_INT},                                   \
    {"max-seqs", "32", "running sequences at once", offsetof(kvf_worker_cfg, max_seqs),         \
     KVF_CFG_INT},                                                                               \
    {"threads", "0", "backend CPU threads (0: one per CPU)", offsetof(kvf_worker_cfg, threads), \
     KVF_CFG_INT},                                                                               \
    {"rpc-threads", "4", "gRPC handler threads", offsetof(kvf_worker_cfg, rpc_threads),         \
     KVF_CFG_INT},                                                                               \
    {"prefill-timeout-ms", "10000", "remote prefill deadline before the local fallback",        \
     offsetof(kvf_worker_cfg, prefill_timeout_ms), KVF_CFG_INT},                                 \
    {"load-interval-ms", "1000", "WatchKv load report period when the watcher sets none",       \
     offsetof(kvf_worker_cfg, load_interval_ms), KVF_CFG_INT},                                   \
    {"device", "cpu", "where the model runs and the KV pool lives: cpu or cuda (GPU 0)",         \
     offsetof(kvf_worker_cfg, device), KVF_CFG_STR},                                             \
    {"transport", "auto", "KV transport: auto (ucx for a host pool, cuda_ipc for --device cuda), " \
     "ucx, cuda_ipc (GPU pools on one node) or local (one process only, tests)",                 \
     offsetof(kvf_worker_cfg, transport), KVF_CFG_STR},                                          \
    {"attn-decode", "auto", "with --device cuda: the kernel decode tokens' attention runs on: " \
     "auto (the build's default, simt today), simt, or mma (tensor cores; f16, bf16 or fp8 KV " \
     "at head_dim 64 or 128, simt elsewhere)", offsetof(kvf_worker_cfg, attn_decode), KVF_CFG_STR}, \
    {"xfer-backend", NULL, "the KV transport, as --transport (this name wins when both are set)", \
     offsetof(kvf_worker_cfg, xfer_backend), KVF_CFG_STR},                                       \
    {"xfer-gpu-staging", NULL, "with --device cuda and ucx: move KV through a pinned host mirror " \
     "of the pool (the path between nodes: this UCX has no CUDA transports)",                    \
     offsetof(kvf_worker_cfg, xfer_gpu_staging), KVF_CFG_BOOL},                                  \
    {"xfer-transport", "auto", "ucx: auto (UCX_TLS honoured), tcp or sm",                       \
     offsetof(kvf_worker_cfg, xfer_tls), KVF_CFG_STR},                                           \
    {"xfer-notice-host", NULL, "cuda_ipc, nccl: IPv4 address the transfer notice channel "      \
     "listens on and peers connect to (default: the --listen host when it is an IPv4 address, "  \
     "else 127.0.0.1; nccl between nodes needs this node's address)",                            \
     offsetof(kvf_worker_cfg, xfer_notice_host), KVF_CFG_STR},                                   \
    {"log-level", "info", "debug, info, warn, error or off", offsetof(kvf_worker_cfg, log_level), \
     KVF_CFG_STR}

/* The table defaults, for code that builds a cfg without parsing flags. */
void kvf_worker_cfg_default(kvf_worker_cfg *cfg);

struct kvf_worker_load;

/* Hooks a role installs before kvf_worker_start; each runs on the loop thread. */
typedef struct kvf_worker_hooks {
    void *ctx;
    void (*on_output)(void *ctx, const kvf_engine_output *o);    /* decode: engine outputs */
    void (*on_xfer_event)(void *ctx, const kvf_xfer_event *ev);  /* transfer completions */
    void (*on_tick)(void *ctx);     /* every loop pass (at least every 10 ms): deadlines */
    void (*on_shutdown)(void *ctx); /* last pass: cancel what is live, finish its calls */
    int64_t (*queued_prefill_tokens)(void *ctx); /* load reports; any thread; may be NULL */
    /* Adjusts the load the loop publishes (a prefill worker's running/waiting requests);
     * loop thread; may be NULL. */
    void (*fill_load)(void *ctx, struct kvf_worker_load *l);
} kvf_worker_hooks;

/* Loads the model, sizes the pool (errors name the flag), creates the engine (decode) or the
 * forward pass (prefill), the transport, the gRPC server (Info, Health, Cancel, WatchKv
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
void kvf_worker_destroy(kvf_worker *w);

/* Runs fn(w, arg) on the loop thread (in order of posting). ERR_STATE once the loop has
 * stopped (fn is not run: the caller cleans up). Any thread. */
typedef void (*kvf_worker_job_fn)(kvf_worker *w, void *arg);
kvf_status kvf_worker_post(kvf_worker *w, kvf_worker_job_fn fn, void *arg);
/* Posts fn and waits for it to have run. ERR_STATE when the loop has stopped. */
kvf_status kvf_worker_call(kvf_worker *w, kvf_worker_job_fn fn, void *arg);

/* Loop-thread accessors (borrowed). engine is NULL on prefill; fwd is NULL on decode. */
const kvf_worker_cfg *kvf_worker_config(const kvf_worker *w);
kvf_worker_role kvf_worker_role_of(const kvf_worker *w);
const kvf_model *kvf_worker_model(const kvf_worker *w);
const char *kvf_worker_model_id(const kvf_worker *w);
const kvf_kv_layout *kvf_worker_layout(const kvf_worker *w);
kvf_engine *kvf_worker_engine(kvf_worker *w);
kvf_kv_pool *kvf_worker_pool(kvf_worker *w);
kvf_model_fwd *kvf_worker_fwd(kvf_worker *w);
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
} kvf_worker_load;
void kvf_worker_load_get(kvf_worker *w, kvf_worker_load *out);

/* The backend a --device name selects (NULL or "cpu": the CPU backend; "cuda": the GPU, which
 * needs a build with CUDA and a usable device) and, when gpu_out is not NULL, the GPU ops table
 * for the transport (NULL on cpu). Errors start with who ("generate", "bench engine"). */
kvf_status kvf_worker_device_pick(const char *device, const char *who, const kvf_backend **be_out,
                                  const kvf_xfer_gpu **gpu_out, kvf_err *err);

/* The KVF_BACKEND_ATTN_DECODE_* value an --attn-decode name selects (NULL: auto). Errors start
 * with who. */
kvf_status kvf_worker_attn_decode_pick(const char *name, const char *who, int32_t *out,
                                       kvf_err *err);

/* Reads a HOST:PORT; errors name the flag. */
kvf_status kvf_worker_parse_hostport(const char *flag, const char *s, char *host, size_t cap,
                                     int *port_out, kvf_err *err);

/* ---- admin HTTP (worker/admin_http.c) ----------------------------------------------------- */
typedef struct kvf_worker_http kvf_worker_http;
/* A GET handler: fills body and content type; returns the HTTP status (200, 404). Runs on the
 * server's own thread. */
typedef int (*kvf_worker_http_fn)(void *ctx, const char *path, kvf_sbuf *body,
                                  const char **content_type_out);
kvf_status kvf_worker_http_start(const char *host, int port, kvf_worker_http_fn fn, void *ctx,
                                 kvf_worker_http **out, kvf_err *err);
int kvf_worker_http_port(const kvf_worker_http *h);
void kvf_worker_http_stop(kvf_worker_http *h); /* joins the thread and frees; NULL is fine */

#endif
