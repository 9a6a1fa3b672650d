/* http.h: the router's OpenAI HTTP front end on libevent: /v1/completions and
 * /v1/chat/completions (SSE and plain), /v1/models, /tokenize, /detokenize, /health, /ready and
 * /metrics, with CORS when asked; tokenizes, picks decode and prefill workers by policy, streams
 * Generate from the decode worker, retries on another before the first token, and cancels it
 * when the client goes away. Built from http.c (the HTTP glue and the loop), request.c (one
 * request's life), tokenize.c, cors.c and watch.c (the pools and their WatchKv streams), over
 * fleet.c's membership. */
#ifndef KVF_ROUTER_HTTP_H
#define KVF_ROUTER_HTTP_H

#include <stdint.h>

#include "common/status.h"
#include "router/fleet.h"

/* The kv policy's knobs (kvfleet router's --load-bound ... --approx-ttl), copied into each pool's
 * kvf_router_pool_cfg (router/policy.h says what each does). */
typedef struct kvf_router_kv_cfg {
    double load_bound;       /* bounded load: 0 = off, or >= 1 */
    double load_window_s;    /* > 0 */
    double load_penalty;     /* >= 0 */
    double host_s_per_block, disk_s_per_block; /* >= 0: tier hit prices until a worker reports its own */
    bool approx;             /* predict caches from the router's own decisions; KV events ignored */
    double approx_ttl_s;     /* > 0 */
    int64_t approx_max_blocks; /* predictions per worker (>= 1); a worker's Info capacity bounds it further */
} kvf_router_kv_cfg;

/* kvf_router_pool_cfg_default's knobs, but an approximate TTL of 3600 s; approx off. These two
 * live in watch.c, which hands the knobs to the pools. */
void kvf_router_kv_cfg_default(kvf_router_kv_cfg *cfg);
/* Refuses a value out of range naming its flag, the value and what is allowed. */
kvf_status kvf_router_kv_cfg_check(const kvf_router_kv_cfg *cfg, kvf_err *err);

typedef struct kvf_router_http_cfg {
    const char *host;            /* "127.0.0.1" */
    int32_t port;                /* 0: pick a free one (kvf_router_http_port) */
    const char *model;           /* model directory: config.json, optional tokenizer.json */
    const char *served_name;     /* the model name clients send; NULL: the directory's name */
    int32_t max_model_len;       /* 0: config.json's max_position_embeddings */
    const char *chat_family;     /* built-in chat template when the model has none, or NULL */
    const char *tool_call_parser; /* chat answers to requests with tools: "auto" (NULL: from the
                                     chat template), "hermes", "llama3_json" or "none" */
    const char *policy;          /* "round-robin", "least-loaded", "kv", "sticky" */
    const kvf_router_kv_cfg *kv; /* the kv policy's knobs (copied); NULL: kvf_router_kv_cfg_default */
    int32_t max_inflight;        /* requests per decode worker before it counts as saturated */
    int32_t max_attempts;        /* decode workers tried before the first token (>= 1) */
    int64_t request_timeout_ms;  /* whole-request deadline on the Generate call; 0: none */
    bool handle_signals;         /* SIGTERM drains, SIGINT (or a second SIGTERM) stops run */
    /* draining (kvf_router_http_drain): /ready turns 503 at once; after drain_delay_ms the
     * listener closes; run returns once the requests in flight are answered, or after
     * drain_timeout_ms more with them cancelled */
    int64_t drain_delay_ms;      /* time for load balancers to see /ready fail; 0: none */
    int64_t drain_timeout_ms;    /* 0: none (the requests are cancelled at once) */
    /* client limits (router/conn.h; 0: the default) */
    int32_t max_connections;     /* open client connections; 0: min(4096, RLIMIT_NOFILE - a reserve) */
    int64_t idle_timeout_ms;     /* no request in flight and no bytes this long: closed; 0: 60000 */
    int64_t max_header_bytes;    /* request line + headers, else 431; 0: 16384 */
    int64_t max_body_bytes;      /* Content-Length, else 413 before the body is read; 0: 8 MiB */
    int32_t prep_threads;        /* threads that parse, template and tokenize prompts; 0: 2 */
    /* API keys (router/auth.h): with any, every route but /health, /ready (and /metrics unless
     * metrics_api_key) needs `Authorization: Bearer KEY`, and the key's tenant salts the cache */
    const char *api_keys;        /* "KEY[,KEY...]", tenant "default"; NULL: none */
    const char *api_key_file;    /* lines "KEY TENANT"; NULL: none */
    const char *metrics_api_key; /* /metrics needs this bearer key; NULL: open */
    /* CORS (router/cors.h), as vLLM's flags: nothing changes unless allowed_origins is set */
    const char *allowed_origins; /* "https://a.example,https://b.example" or "*"; NULL: no CORS */
    const char *allowed_methods; /* comma-separated or "*"; NULL: "GET,POST,OPTIONS" */
    const char *allowed_headers; /* comma-separated or "*"; NULL: "Authorization,Content-Type,X-Request-Id" */
    bool allow_credentials;      /* Access-Control-Allow-Credentials: true (and the origin, never "*") */
    kvf_router_fleet_cfg fleet;
} kvf_router_http_cfg;

typedef struct kvf_router_http kvf_router_http;

/* Loads the model's config (and tokenizer and chat template when it has them), starts the fleet
 * and binds the port. Nothing is served until kvf_router_http_run. */
kvf_status kvf_router_http_create(const kvf_router_http_cfg *cfg, kvf_router_http **out,
                                  kvf_err *err);
int kvf_router_http_port(const kvf_router_http *h);
/* Serves on the calling thread until kvf_router_http_stop. */
kvf_status kvf_router_http_run(kvf_router_http *h, kvf_err *err);
/* Starts draining (see drain_delay_ms): run returns when it is done. Any thread; idempotent. */
void kvf_router_http_drain(kvf_router_http *h);
/* Makes run return (requests in flight are cancelled). Any thread (not a signal handler: set
 * handle_signals instead); idempotent. */
void kvf_router_http_stop(kvf_router_http *h);
void kvf_router_http_destroy(kvf_router_http *h); /* NULL is fine */

#endif
