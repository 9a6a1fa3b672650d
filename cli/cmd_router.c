/* cmd_router.c: `kvfleet router`: the OpenAI HTTP front end over a fleet of decode (and
 * prefill) workers given as address lists or DNS names. Prints one "ready" line on stdout when
 * it listens; the serving itself is router/http.h's. */
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/resource.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "common/log.h"
#include "router/http.h"

typedef struct router_cfg {
    kvf_router_http_cfg h;
    kvf_router_kv_cfg kv; /* the kv policy's knobs, h.kv */
    kvf_rpc_tls tls;
    const char *log_level;
    const char *log_format;
} router_cfg;

static const kvf_cfg_opt router_opts[] = {
    {"model", NULL, "model directory (config.json; tokenizer.json when it has one)", offsetof(router_cfg, h.model), KVF_CFG_STR},
    {"served-model-name", NULL, "model name clients send (default: the directory's name)", offsetof(router_cfg, h.served_name), KVF_CFG_STR},
    {"host", "127.0.0.1", "address to listen on", offsetof(router_cfg, h.host), KVF_CFG_STR},
    {"port", "8000", "HTTP port (0 picks a free one)", offsetof(router_cfg, h.port), KVF_CFG_INT},
    {"decode", NULL, "decode (or colocated) workers: host:port,host:port", offsetof(router_cfg, h.fleet.decode), KVF_CFG_STR},
    {"prefill", NULL, "prefill workers: host:port,host:port", offsetof(router_cfg, h.fleet.prefill), KVF_CFG_STR},
    {"decode-dns", NULL, "name:port re-resolved periodically; every address is a decode worker", offsetof(router_cfg, h.fleet.decode_dns), KVF_CFG_STR},
    {"prefill-dns", NULL, "name:port re-resolved periodically; every address is a prefill worker", offsetof(router_cfg, h.fleet.prefill_dns), KVF_CFG_STR},
    {"policy", "kv", "routing policy: kv (prefix-aware, default), round-robin, least-loaded, sticky", offsetof(router_cfg, h.policy), KVF_CFG_STR},
    {"load-bound", "1.1", "kv: bounded load: a worker whose recent computed prompt tokens exceed this x the mean pays for its excess, so a hot prefix spreads to another replica (0 = off, else >= 1)", offsetof(router_cfg, kv.load_bound), KVF_CFG_DOUBLE},
    {"load-window", "1800", "kv: seconds over which a worker's recent computed tokens decay (time constant, > 0)", offsetof(router_cfg, kv.load_window_s), KVF_CFG_DOUBLE},
    {"load-penalty", "0.5", "kv: a worker past the load line costs this x the prefill time of its excess tokens more (>= 0)", offsetof(router_cfg, kv.load_penalty), KVF_CFG_DOUBLE},
    {"host-promote-s-per-block", "0.0001048576", "kv: seconds to copy one block from a worker's host-memory tier into its pool (2 MiB at 20 GB/s), used until the worker reports its own measured time", offsetof(router_cfg, kv.host_s_per_block), KVF_CFG_DOUBLE},
    {"disk-promote-s-per-block", "0.0004194304", "kv: the same from a worker's disk tier (2 MiB at 5 GB/s), until the worker reports its own", offsetof(router_cfg, kv.disk_s_per_block), KVF_CFG_DOUBLE},
    {"approx", "false", "kv: ignore the workers' KV events and predict their caches from this router's own decisions (each worker's at most its KV capacity); load reports still count", offsetof(router_cfg, kv.approx), KVF_CFG_BOOL},
    {"approx-ttl", "3600", "kv with --approx: seconds a predicted block is believed (> 0)", offsetof(router_cfg, kv.approx_ttl_s), KVF_CFG_DOUBLE},
    {"max-model-len", "0", "context length (0: the model's max_position_embeddings)", offsetof(router_cfg, h.max_model_len), KVF_CFG_INT},
    {"tool-call-parser", "auto", "tool calls in chat answers to requests with tools: auto (from the chat template: "
     "<tool_call> hermes, <|python_tag|> or ipython llama3_json, else none), hermes, llama3_json, none", offsetof(router_cfg, h.tool_call_parser), KVF_CFG_STR},
    {"chat-template", NULL, "built-in chat template when the model has none (llama2, llama3, chatml, mistral)", offsetof(router_cfg, h.chat_family), KVF_CFG_STR},
    {"max-inflight", "256", "requests per decode worker before it counts as saturated (then 429)", offsetof(router_cfg, h.max_inflight), KVF_CFG_INT},
    {"max-attempts", "3", "decode workers tried per request (a failure before the first token, or mid-stream with n = 1, moves it)", offsetof(router_cfg, h.max_attempts), KVF_CFG_INT},
    {"request-timeout-ms", "600000", "deadline of one generation (0: none)", offsetof(router_cfg, h.request_timeout_ms), KVF_CFG_INT64},
    {"max-connections", "0", "open client connections; at the limit a new one closes the longest idle one, or only probes get in "
     "(0: min(4096, RLIMIT_NOFILE less a reserve))", offsetof(router_cfg, h.max_connections), KVF_CFG_INT},
    {"idle-timeout-ms", "60000", "a client connection with no request in flight and no bytes for this long is closed", offsetof(router_cfg, h.idle_timeout_ms), KVF_CFG_INT64},
    {"max-header-bytes", "16384", "request line + headers; larger heads get 431", offsetof(router_cfg, h.max_header_bytes), KVF_CFG_INT64},
    {"max-body-bytes", "8388608", "request body (Content-Length); larger ones get 413 before the body is read", offsetof(router_cfg, h.max_body_bytes), KVF_CFG_INT64},
    {"prep-threads", "2", "threads that parse requests, apply the chat template and tokenize, off the event loop", offsetof(router_cfg, h.prep_threads), KVF_CFG_INT},
    {"drain-delay-ms", "5000", "on SIGTERM /ready turns 503 at once and the router keeps serving this long (for load balancers to notice) before it closes its listener", offsetof(router_cfg, h.drain_delay_ms), KVF_CFG_INT64},
    {"drain-timeout-ms", "30000", "then requests in flight get this long to finish before they are cancelled (a second SIGTERM or SIGINT stops at once)", offsetof(router_cfg, h.drain_timeout_ms), KVF_CFG_INT64},
    {"health-interval-ms", "1000", "Health check period per worker", offsetof(router_cfg, h.fleet.health_interval_ms), KVF_CFG_INT64},
    {"resolve-interval-ms", "5000", "DNS re-resolution period", offsetof(router_cfg, h.fleet.resolve_interval_ms), KVF_CFG_INT64},
    {"tls-cert", NULL, "PEM certificate the router presents to the workers (with --tls-key and --tls-ca: mutual TLS; reloaded on SIGHUP)", offsetof(router_cfg, tls.cert_file), KVF_CFG_STR},
    {"tls-key", NULL, "PEM private key of --tls-cert", offsetof(router_cfg, tls.key_file), KVF_CFG_STR},
    {"tls-ca", NULL, "PEM CA that signed the workers' certificates (checked on every connection)", offsetof(router_cfg, tls.ca_file), KVF_CFG_STR},
    {"tls-name", "kvfleet", "the name the workers' certificates must carry (kvfleet gen-certs --tls-name)", offsetof(router_cfg, tls.server_name), KVF_CFG_STR},
    {"api-key", NULL, "API keys clients must send as Authorization: Bearer KEY, comma-separated (tenant \"default\"; prefer KVFLEET_API_KEY or --api-key-file: a command line is visible to every local user)", offsetof(router_cfg, h.api_keys), KVF_CFG_STR},
    {"api-key-file", NULL, "file of API keys, one \"KEY TENANT\" per line (# comments); each tenant's cached prompts are its own", offsetof(router_cfg, h.api_key_file), KVF_CFG_STR},
    {"metrics-api-key", NULL, "/metrics needs this bearer key (default: open; /health and /ready are always open)", offsetof(router_cfg, h.metrics_api_key), KVF_CFG_STR},
    {"allowed-origins", NULL, "CORS: origins browsers may call from, comma-separated (https://app.example.com), or *; unset: no CORS headers at all", offsetof(router_cfg, h.allowed_origins), KVF_CFG_STR},
    {"allowed-methods", "GET,POST,OPTIONS", "CORS: methods a preflight allows, comma-separated, or *", offsetof(router_cfg, h.allowed_methods), KVF_CFG_STR},
    {"allowed-headers", "Authorization,Content-Type,X-Request-Id", "CORS: request headers a preflight allows, comma-separated, or * (Accept, Accept-Language, Content-Language, Content-Type always)", offsetof(router_cfg, h.allowed_headers), KVF_CFG_STR},
    {"allow-credentials", "false", "CORS: Access-Control-Allow-Credentials: true (the origin is then echoed, never *)", offsetof(router_cfg, h.allow_credentials), KVF_CFG_BOOL},
    {"log-level", "info", "debug, info, warn, error, off", offsetof(router_cfg, log_level), KVF_CFG_STR},
    {"log-format", "text", "stderr log lines: text, or json (one object per line: ts, level, component, request_id, msg)", offsetof(router_cfg, log_format), KVF_CFG_STR},
    {NULL},
};

static const kvf_cfg_spec router_spec = {
    .prog = "kvfleet router",
    .summary = "The OpenAI-compatible HTTP front end: POST /v1/completions, /v1/chat/completions,\n"
               "/tokenize, /detokenize, GET /v1/models, /health, /ready, /metrics. Tokenizes, picks a decode worker (and a\n"
               "prefill worker) per request and streams tokens back. Prints\n"
               "`kvfleet router: ready http=HOST:PORT` on stdout once listening.",
    .opts = router_opts,
};

int kvf_cli_router(int argc, char **argv)
{
    router_cfg c = {0};
    kvf_router_kv_cfg_default(&c.kv); /* what no flag sets (approx_max_blocks) */
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&router_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    c.h.kv = &c.kv;
    if ((st = kvf_router_kv_cfg_check(&c.kv, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    int lvl = kvf_log_level_parse(c.log_level);
    if (lvl < 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "router: --log-level=%s (use debug, info, warn, error, off)", c.log_level);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    kvf_log_set_level((kvf_log_level)lvl);
    int fmt = kvf_log_format_parse(c.log_format);
    if (fmt < 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "router: --log-format=%s (use text or json)", c.log_format);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    kvf_log_set_format((kvf_log_format)fmt);
    if (!c.h.fleet.decode && !c.h.fleet.decode_dns) {
        kvf_err_set(&err, KVF_ERR_INVALID, "router: give the decode workers with --decode=host:port,... or --decode-dns=name:port");
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (c.h.drain_delay_ms < 0 || c.h.drain_timeout_ms < 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "router: --drain-delay-ms and --drain-timeout-ms must be >= 0");
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if ((st = kvf_rpc_tls_check_member(&c.tls, "router", &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    c.h.fleet.tls = kvf_rpc_tls_on(&c.tls) ? &c.tls : NULL;
    c.h.handle_signals = true;
    signal(SIGPIPE, SIG_IGN); /* a client gone mid-answer is an EPIPE on its socket, not our end */
    /* Client connections need descriptors: the soft limit goes up to the hard one (the default
     * --max-connections is derived from it). */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    kvf_router_http *h = NULL;
    if ((st = kvf_router_http_create(&c.h, &h, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    printf("kvfleet router: ready http=%s:%d\n", c.h.host, kvf_router_http_port(h));
    fflush(stdout);
    st = kvf_router_http_run(h, &err);
    kvf_router_http_destroy(h);
    return kvf_cli_exit(st, &err);
}
