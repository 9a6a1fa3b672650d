/* http.c: the router's HTTP glue on one libevent loop: the routes (/v1/completions and
 * /v1/chat/completions handed to request.c, /tokenize and /detokenize to its prep threads as
 * tokenize.c's jobs; /health, /ready, /metrics, /v1/models answered here), CORS headers and
 * preflights (cors.c's rules), the bytes of every answer, and the loop's wake-ups: Generate and
 * WatchKv streams wake it when a message or their end arrives (an atomic flag per stream and one
 * libevent user event), and a 100 ms safety timer notices clients that left plain requests and
 * logs index health. Everything runs on the loop thread, so no lock guards the requests. One
 * request's life is request.c's, the pools and WatchKv watch.c's, membership and health
 * fleet.c's. */
#include "router/http.h"

#include <ctype.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>

#include "common/log.h"
#include "common/metrics.h"
#include "common/sbuf.h"
#include "common/time.h"
#include "text/chat_template.h"
#include "model/config.h"
#include "text/tokenizer.h"
#include "router/auth.h"
#include "router/conn.h"
#include "router/cors.h"
#include "router/http_int.h"
#include "router/openai.h"
#include "router/policy.h"
#include "router/request.h"
#include "router/tokenize.h"
#include "router/watch.h"

struct kvf_router_http {
    kvf_router_http_cfg cfg;
    kvf_router_kv_cfg kv; /* the kv policy's knobs (cfg.kv's copy) */
    char *served;
    int32_t max_len;
    kvf_model_config mcfg;
    kvf_text_tokenizer *tok;
    kvf_text_chat_template *tmpl;
    char tmpl_err[KVF_ERR_MSG_MAX];

    struct event_base *base;
    struct evhttp *http;
    kvf_router_conns *conns; /* the listener, connection counts and limits (conn.c) */
    int port;
    struct event *wake_ev;   /* a stream has something: read the ready ones (on_wake) */
    struct event *safety_ev; /* every SAFETY_MS: plain clients gone, index health (on_safety) */
    struct event *stop_ev, *drain_ev, *sig_int, *sig_term, *sig_hup;
    atomic_bool stopping, drain_asked;
    bool draining;          /* loop thread: /ready is 503 and answers close their connection */
    bool drain_closed;      /* the listener is closed (drain_delay_ms after the drain began) */
    int64_t drain_start_ns;

    kvf_router_fleet *fleet;
    kvf_router_policy policy;
    kvf_router_watch *watch;  /* the pools, fed by WatchKv (watch.c) */
    kvf_router_reqs *reqs;    /* the generation requests in flight (request.c) */
    kvf_router_auth *auth;    /* API keys; none: every client is served */
    kvf_router_cors *cors;    /* --allowed-origins; NULL: no CORS headers */
    const char *tenant;       /* loop thread: the tenant of the request being routed */
    uint64_t next_id;

    kvf_metrics *metrics;
    kvf_metric *m_requests, *m_2xx, *m_4xx, *m_5xx;
    kvf_metric *m_wake_stream, *m_wake_timer; /* loop passes by cause */
    double last_index_health;                  /* when the safety timer last ran index health */
};

/* The safety timer's period: the longest a plain request's vanished client goes unnoticed
 * while its worker sends nothing. Streams never wait for it. */
#define SAFETY_MS 100

/* ---------------------------------------------------------------------------------------- */
/* Answers                                                                                   */

static void count_status(kvf_router_http *h, int code)
{
    kvf_metric_add(code < 300 ? h->m_2xx : code < 500 ? h->m_4xx : h->m_5xx, 1);
}

static const char *reason_of(int code)
{
    switch (code) {
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    default: return code < 500 ? "Bad Request" : "Internal Server Error";
    }
}

static void send_body(kvf_router_http *h, struct evhttp_request *ev, int code, const char *ctype,
                      const char *req_id, const char *body, size_t len)
{
    struct evkeyvalq *oh = evhttp_request_get_output_headers(ev);
    evhttp_add_header(oh, "Content-Type", ctype);
    if (req_id && *req_id)
        evhttp_add_header(oh, "x-request-id", req_id);
    if (h->draining) /* the client's next request opens a connection to another router */
        evhttp_add_header(oh, "Connection", "close");
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, body, len);
    evhttp_send_reply(ev, code, reason_of(code), b);
    evbuffer_free(b);
    count_status(h, code);
}

void kvf_router_http_send_json(kvf_router_http *h, kvf_router_client *c, int code,
                               const char *req_id, const char *body, size_t len)
{
    send_body(h, c, code, "application/json", req_id, body, len);
}

void kvf_router_http_send_error(kvf_router_http *h, kvf_router_client *c, const char *req_id,
                                const kvf_router_oai_error *e, int retry_after_s)
{
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    kvf_router_oai_error_json(e, &b);
    if (retry_after_s > 0) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d", retry_after_s);
        evhttp_add_header(evhttp_request_get_output_headers(c), "Retry-After", ra);
    }
    kvf_log(e->http_status >= 500 ? KVF_LOG_WARN : KVF_LOG_INFO, "router: req %s: %d %s",
            req_id ? req_id : "-", e->http_status, e->message);
    kvf_router_http_send_json(h, c, e->http_status, req_id, b.data ? b.data : "{}", b.len);
    kvf_sbuf_fini(&b);
}

void kvf_router_client_sse_start(kvf_router_http *h, kvf_router_client *c, const char *req_id)
{
    struct evkeyvalq *oh = evhttp_request_get_output_headers(c);
    if (h->draining)
        evhttp_add_header(oh, "Connection", "close");
    evhttp_add_header(oh, "Content-Type", "text/event-stream");
    evhttp_add_header(oh, "Cache-Control", "no-cache");
    evhttp_add_header(oh, "x-request-id", req_id);
    evhttp_send_reply_start(c, 200, "OK");
}

void kvf_router_client_sse_send(kvf_router_client *c, const char *data, size_t len)
{
    struct evbuffer *eb = evbuffer_new();
    evbuffer_add(eb, data, len);
    evhttp_send_reply_chunk(c, eb);
    evbuffer_free(eb);
}

void kvf_router_http_sse_end(kvf_router_http *h, kvf_router_client *c, int code)
{
    evhttp_send_reply_end(c);
    count_status(h, code);
}

void kvf_router_client_send_gone(kvf_router_client *c, bool streaming)
{
    if (streaming)
        evhttp_send_reply_end(c); /* frees the request when the connection is gone */
    else
        evhttp_send_reply(c, 499, "Client Closed Request", NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* Clients that leave                                                                        */

static void on_close(struct evhttp_connection *conn, void *arg)
{
    (void)conn;
    kvf_router_req_client_left(arg);
}

void kvf_router_client_on_close(kvf_router_http *h, kvf_router_client *c, kvf_router_req *r)
{
    struct evhttp_connection *conn = c ? evhttp_request_get_connection(c) : NULL;
    if (conn) {
        evhttp_connection_set_closecb(conn, r ? on_close : NULL, r);
        kvf_router_conns_busy(h->conns, c, r != NULL);
    }
}

bool kvf_router_client_left(kvf_router_client *c)
{
    struct evhttp_connection *conn = evhttp_request_get_connection(c);
    struct bufferevent *bev = conn ? evhttp_connection_get_bufferevent(conn) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    char b;
    return fd >= 0 && recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

void kvf_router_client_abandon(kvf_router_client *c)
{
    if (c && !evhttp_request_get_connection(c))
        evhttp_request_free(c);
}

/* ---------------------------------------------------------------------------------------- */
/* Wake-ups                                                                                  */

/* event_active is thread-safe once evthread_use_pthreads ran. */
void kvf_router_wake_notify(void *wake)
{
    kvf_router_wake *w = wake;
    atomic_store_explicit(&w->ready, true, memory_order_release);
    event_active(w->h->wake_ev, EV_READ, 0);
}

bool kvf_router_wake_take(kvf_router_wake *w)
{
    return atomic_exchange_explicit(&w->ready, false, memory_order_acquire);
}

/* Pumps the requests and drains the watches whose stream said it has something (all of them
 * when `all`). */
static void drain(kvf_router_http *h, bool all)
{
    kvf_router_reqs_pump(h->reqs, all);
    kvf_router_watch_drain(h->watch, all);
}

/* A stream has a message or its end, or a client left (kvf_router_wake_notify). */
static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    kvf_router_http *h = arg;
    (void)fd, (void)what;
    kvf_metric_add(h->m_wake_stream, 1);
    drain(h, false);
}

static void drain_step(kvf_router_http *h);

/* Every SAFETY_MS: plain requests peek at their client's socket (libevent does not always
 * report a vanished client while its request waits), every stream is read once more in case a
 * wake-up was lost, and under the kv policy index state changes are logged once a second. */
static void on_safety(evutil_socket_t fd, short what, void *arg)
{
    kvf_router_http *h = arg;
    (void)fd, (void)what;
    kvf_metric_add(h->m_wake_timer, 1);
    drain(h, true);
    kvf_router_conns_sweep(h->conns);
    if (h->draining)
        drain_step(h);
    double now = kvf_now_s();
    if (h->policy == KVF_ROUTER_POLICY_KV && now - h->last_index_health >= 1.0) {
        h->last_index_health = now;
        kvf_router_watch_health(h->watch);
    }
}

static void on_stop(evutil_socket_t fd, short what, void *arg)
{
    kvf_router_http *h = arg;
    (void)fd;
    (void)what;
    kvf_log(KVF_LOG_INFO, "router: stopping");
    event_base_loopbreak(h->base);
}

/* ---------------------------------------------------------------------------------------- */
/* Draining (SIGTERM, kvf_router_http_drain): /ready turns 503 at once, so the load balancer
 * stops sending; the router keeps serving for drain_delay_ms while it notices, then closes its
 * listener and its idle connections, lets the requests in flight finish for up to
 * drain_timeout_ms, and returns from run once they are answered and their bytes are out.      */

static void drain_begin(kvf_router_http *h)
{
    if (h->draining)
        return;
    h->draining = true;
    h->drain_start_ns = kvf_now_ns();
    kvf_log(KVF_LOG_INFO,
            "router: draining: /ready is 503; serving %lld ms more, then new connections are refused and the "
            "%lld requests in flight get up to %lld ms to finish",
            (long long)h->cfg.drain_delay_ms, (long long)kvf_router_reqs_open(h->reqs),
            (long long)h->cfg.drain_timeout_ms);
}

/* From the safety timer while draining. */
static void drain_step(kvf_router_http *h)
{
    int64_t ms = (kvf_now_ns() - h->drain_start_ns) / 1000000;
    if (ms < h->cfg.drain_delay_ms)
        return;
    if (!h->drain_closed) {
        h->drain_closed = true;
        kvf_router_conns_close(h->conns);
        kvf_log(KVF_LOG_INFO, "router: draining: listener closed; %lld requests in flight",
                (long long)kvf_router_reqs_open(h->reqs));
    }
    int64_t open = kvf_router_reqs_open(h->reqs), unsent = kvf_router_conns_unsent(h->conns);
    if (!open && !unsent) {
        kvf_log(KVF_LOG_INFO, "router: drained in %lld ms; stopping", (long long)ms);
        event_base_loopbreak(h->base);
    } else if (ms - h->cfg.drain_delay_ms >= h->cfg.drain_timeout_ms) {
        kvf_log(KVF_LOG_WARN, "router: drain timeout (%lld ms): stopping with %lld requests in flight cancelled",
                (long long)h->cfg.drain_timeout_ms, (long long)open);
        event_base_loopbreak(h->base);
    }
}

static void on_drain(evutil_socket_t fd, short what, void *arg)
{
    kvf_router_http *h = arg;
    (void)fd, (void)what;
    drain_begin(h);
}

/* SIGTERM drains; a second SIGTERM (or SIGINT) stops at once. */
static void on_term(evutil_socket_t fd, short what, void *arg)
{
    kvf_router_http *h = arg;
    if (h->draining)
        on_stop(fd, what, arg);
    else
        drain_begin(h);
}

/* SIGHUP: the TLS files of the fleet channels are read again before their next calls. */
static void on_hup(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    (void)arg;
    kvf_log(KVF_LOG_INFO, "router: SIGHUP: reloading the TLS certificates");
    kvf_rpc_tls_reload();
}

/* ---------------------------------------------------------------------------------------- */
/* Routes                                                                                    */

/* The request id: the client's x-request-id when it is sane, else a new one. */
static void request_id(kvf_router_http *h, struct evhttp_request *ev, char *out, size_t cap)
{
    const char *given = evhttp_find_header(evhttp_request_get_input_headers(ev), "x-request-id");
    if (given) {
        size_t n = strlen(given);
        bool ok = n > 0 && n < 65;
        for (size_t i = 0; ok && i < n; i++)
            ok = isalnum((unsigned char)given[i]) || strchr("-_.:", given[i]);
        if (ok) {
            snprintf(out, cap, "%s", given);
            return;
        }
    }
    uint64_t x = (uint64_t)kvf_now_ns() ^ (++h->next_id * 0x9E3779B97F4A7C15ull);
    x ^= x >> 31;
    snprintf(out, cap, "%016llx", (unsigned long long)x);
}

/* POST /v1/completions and /v1/chat/completions: the request's life is request.c's. */
static void generate(kvf_router_http *h, struct evhttp_request *ev, kvf_router_oai_kind kind)
{
    char id[80];
    request_id(h, ev, id, sizeof id);
    kvf_metric_add(h->m_requests, 1);
    if (evhttp_request_get_command(ev) != EVHTTP_REQ_POST) {
        kvf_router_oai_error e;
        kvf_router_oai_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                                 "%s takes POST", evhttp_request_get_uri(ev));
        kvf_router_http_send_error(h, ev, id, &e, 0);
        return;
    }
    struct evbuffer *in = evhttp_request_get_input_buffer(ev);
    size_t len = evbuffer_get_length(in);
    const char *body = len ? (const char *)evbuffer_pullup(in, -1) : "";
    kvf_router_reqs_start(h->reqs, ev, kind, id, h->tenant, body, len);
}

/* POST /tokenize and /detokenize (vLLM's, at the root only): a prep job (tokenize.c) on the prep
 * threads, so a large prompt or chat never stalls the loop. */
static void prep_job(kvf_router_http *h, struct evhttp_request *ev, const kvf_router_prep_job *job)
{
    char id[80];
    request_id(h, ev, id, sizeof id);
    if (evhttp_request_get_command(ev) != EVHTTP_REQ_POST) {
        kvf_router_oai_error e;
        kvf_router_oai_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                                 "%s takes POST", evhttp_request_get_uri(ev));
        evhttp_add_header(evhttp_request_get_output_headers(ev), "Allow", "POST");
        kvf_router_http_send_error(h, ev, id, &e, 0);
        return;
    }
    struct evbuffer *in = evhttp_request_get_input_buffer(ev);
    size_t len = evbuffer_get_length(in);
    const char *body = len ? (const char *)evbuffer_pullup(in, -1) : "";
    kvf_router_reqs_start_job(h->reqs, ev, job, id, body, len);
}

static void on_tokenize(kvf_router_http *h, struct evhttp_request *ev)
{
    prep_job(h, ev, &kvf_router_tokenize_job);
}

static void on_detokenize(kvf_router_http *h, struct evhttp_request *ev)
{
    prep_job(h, ev, &kvf_router_detokenize_job);
}

static void on_completions(kvf_router_http *h, struct evhttp_request *ev)
{
    generate(h, ev, KVF_ROUTER_OAI_COMPLETIONS);
}

static void on_chat(kvf_router_http *h, struct evhttp_request *ev)
{
    generate(h, ev, KVF_ROUTER_OAI_CHAT);
}

static void on_health(kvf_router_http *h, struct evhttp_request *ev)
{
    send_body(h, ev, 200, "text/plain", NULL, "ok\n", 3);
}

/* Ready when a decode worker answers and, under the kv policy, every worker's snapshot is in
 * the index: a restarted router does not route blind. */
static void on_ready(kvf_router_http *h, struct evhttp_request *ev)
{
    if (h->draining) {
        static const char b[] = "not ready: draining\n";
        send_body(h, ev, 503, "text/plain", NULL, b, sizeof b - 1);
        return;
    }
    int32_t n_up = kvf_router_fleet_n_healthy(h->fleet, KVF_ROUTER_ROLE_DECODE);
    int32_t unsynced = 0;
    if (h->policy == KVF_ROUTER_POLICY_KV) {
        kvf_router_watch_sync(h->watch);
        unsynced = kvf_router_watch_health(h->watch);
    }
    char b[128];
    int len = !n_up ? snprintf(b, sizeof b, "not ready: no decode worker answers\n")
              : unsynced ? snprintf(b, sizeof b, "not ready: waiting for KV snapshots from %d workers\n", unsynced)
                         : snprintf(b, sizeof b, "ready: %d decode workers\n", n_up);
    send_body(h, ev, n_up && !unsynced ? 200 : 503, "text/plain", NULL, b, (size_t)len);
}

static void on_metrics(kvf_router_http *h, struct evhttp_request *ev)
{
    kvf_router_watch_sync(h->watch);
    if (h->policy == KVF_ROUTER_POLICY_KV)
        kvf_router_watch_health(h->watch);
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    kvf_metrics_render(h->metrics, &b);
    send_body(h, ev, 200, "text/plain; version=0.0.4", NULL, b.data ? b.data : "", b.len);
    kvf_sbuf_fini(&b);
}

static json_t *model_object(const kvf_router_http *h)
{
    return json_pack("{s:s,s:s,s:I,s:s,s:i}", "id", h->served, "object", "model", "created",
                     (json_int_t)(kvf_wall_ms() / 1000), "owned_by", "kvfleet", "max_model_len", h->max_len);
}

/* GET /v1/models/{id} (the SDKs' models.retrieve): the served model, else OpenAI's 404. id is
 * what follows the prefix, percent-decoded (model names may hold a '/'). */
static void on_model(kvf_router_http *h, struct evhttp_request *ev, const char *id_enc)
{
    char *id = evhttp_uridecode(id_enc, 0, NULL);
    if (!id || strcmp(id, h->served) != 0) {
        kvf_router_oai_error e;
        kvf_router_oai_error_set(&e, 404, "invalid_request_error", NULL, "model_not_found",
                                 "The model `%.200s` does not exist (this server serves `%s`)", id ? id : "",
                                 h->served);
        kvf_router_http_send_error(h, ev, NULL, &e, 0);
        free(id);
        return;
    }
    free(id);
    json_t *m = model_object(h);
    char *s = m ? json_dumps(m, JSON_COMPACT) : NULL;
    json_decref(m);
    kvf_router_http_send_json(h, ev, 200, NULL, s ? s : "{}", s ? strlen(s) : 2);
    free(s);
}

static void on_models(kvf_router_http *h, struct evhttp_request *ev)
{
    json_t *o = json_pack("{s:s,s:[o]}", "object", "list", "data", model_object(h));
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    kvf_router_http_send_json(h, ev, 200, NULL, s ? s : "{}", s ? strlen(s) : 2);
    free(s);
}

static const struct route {
    const char *path;
    void (*fn)(kvf_router_http *h, struct evhttp_request *ev);
    bool post; /* takes POST (the route checks the method itself); else GET and HEAD */
} routes[] = {
    {"/v1/completions", on_completions, true}, {"/v1/chat/completions", on_chat, true},
    {"/health", on_health, false},             {"/ready", on_ready, false},
    {"/metrics", on_metrics, false},           {"/v1/models", on_models, false},
    {"/tokenize", on_tokenize, true},          {"/detokenize", on_detokenize, true},
};

/* API keys: /health and /ready are always open (probes), /metrics is open unless it has its
 * own key; every other route needs a key when the router has any. Sets h->tenant for the route
 * that runs next; false when the request was answered (401). */
static bool authorized(kvf_router_http *h, struct evhttp_request *ev, const char *path)
{
    h->tenant = NULL;
    if (strcmp(path, "/health") == 0 || strcmp(path, "/ready") == 0)
        return true;
    const char *given = evhttp_find_header(evhttp_request_get_input_headers(ev), "Authorization");
    bool ok;
    if (strcmp(path, "/metrics") == 0) {
        const char *want = h->cfg.metrics_api_key;
        if (!want || !*want)
            return true;
        const char *k = given && strncasecmp(given, "Bearer ", 7) == 0 ? given + 7 : "";
        while (*k == ' ')
            k++;
        ok = kvf_router_auth_equal(want, strlen(want), k, strlen(k));
    } else {
        if (!kvf_router_auth_count(h->auth))
            return true;
        h->tenant = kvf_router_auth_check(h->auth, given);
        ok = h->tenant != NULL;
    }
    if (ok)
        return true;
    kvf_router_oai_error e;
    kvf_router_oai_error_set(&e, 401, "invalid_request_error", NULL, "invalid_api_key",
                             given ? "Incorrect API key provided."
                                   : "You didn't provide an API key. You need to provide your API key in an "
                                     "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).");
    evhttp_add_header(evhttp_request_get_output_headers(ev), "WWW-Authenticate", "Bearer");
    kvf_router_http_send_error(h, ev, NULL, &e, 0);
    return false;
}

/* CORS (cors.c): an allowed origin's answer, whatever it is (JSON, error, 401, SSE), carries
 * Access-Control-Allow-Origin; a preflight is answered here, before the API-key check (a browser
 * sends no Authorization on it). True when the request was answered. */
static bool cors(kvf_router_http *h, struct evhttp_request *ev)
{
    if (!h->cors)
        return false;
    const struct evkeyvalq *in = evhttp_request_get_input_headers(ev);
    static kvf_router_cors_answer a; /* loop thread only; 13 KiB kept off its stack */
    kvf_router_cors_verdict v =
        kvf_router_cors_check(h->cors, evhttp_find_header(in, "Origin"),
                              evhttp_request_get_command(ev) == EVHTTP_REQ_OPTIONS,
                              evhttp_find_header(in, "Access-Control-Request-Method"),
                              evhttp_find_header(in, "Access-Control-Request-Headers"), &a);
    struct evkeyvalq *oh = evhttp_request_get_output_headers(ev);
    for (size_t i = 0; i < a.n; i++)
        evhttp_add_header(oh, a.h[i].name, a.h[i].value);
    if (v == KVF_ROUTER_CORS_PREFLIGHT_OK) {
        if (h->draining)
            evhttp_add_header(oh, "Connection", "close");
        evhttp_send_reply(ev, 204, reason_of(204), NULL);
        count_status(h, 204);
        return true;
    }
    if (v == KVF_ROUTER_CORS_PREFLIGHT_BAD) {
        kvf_router_oai_error e;
        kvf_router_oai_error_set(&e, 403, "invalid_request_error", NULL, "cors_forbidden",
                                 "CORS preflight refused: %s", a.why);
        kvf_router_http_send_error(h, ev, NULL, &e, 0);
        return true;
    }
    return false;
}

static void on_request(struct evhttp_request *ev, void *arg)
{
    kvf_router_http *h = arg;
    const char *uri = evhttp_request_get_uri(ev);
    if (!uri) {
        /* libevent calls back again, without a URI, when a connection fails with a buffer
         * error: a request of ours is answered when its turn comes; others get a 400 */
        kvf_router_req *r = kvf_router_reqs_find(h->reqs, ev);
        if (r)
            kvf_router_req_client_left(r);
        else
            evhttp_send_error(ev, 400, NULL);
        return;
    }
    char path[256];
    size_t n = strcspn(uri, "?");
    snprintf(path, sizeof path, "%.*s", (int)(n < sizeof path ? n : sizeof path - 1), uri);
    if (cors(h, ev) || !authorized(h, ev, path))
        return;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (strcmp(path, routes[i].path) == 0) {
            enum evhttp_cmd_type m = evhttp_request_get_command(ev);
            if (!routes[i].post && m != EVHTTP_REQ_GET && m != EVHTTP_REQ_HEAD) {
                kvf_router_oai_error e;
                kvf_router_oai_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                                         "%s takes GET", path);
                evhttp_add_header(evhttp_request_get_output_headers(ev), "Allow", "GET, HEAD");
                kvf_router_http_send_error(h, ev, NULL, &e, 0);
                return;
            }
            routes[i].fn(h, ev);
            h->tenant = NULL;
            return;
        }
    static const char mp[] = "/v1/models/";
    if (strncmp(path, mp, sizeof mp - 1) == 0 && path[sizeof mp - 1]) {
        enum evhttp_cmd_type m = evhttp_request_get_command(ev);
        if (m == EVHTTP_REQ_GET || m == EVHTTP_REQ_HEAD) {
            on_model(h, ev, path + sizeof mp - 1);
            return;
        }
    }
    kvf_router_oai_error e;
    kvf_router_oai_error_set(&e, 404, "invalid_request_error", NULL, "not_found",
                             "no route %s (try /v1/completions, /v1/chat/completions, /v1/models, /v1/models/{id}, /tokenize, "
                             "/detokenize, /health, /ready, /metrics)",
                             path);
    kvf_router_http_send_error(h, ev, NULL, &e, 0);
}

/* ---------------------------------------------------------------------------------------- */
/* Life cycle                                                                                */

static kvf_status add_metrics(kvf_router_http *h, kvf_err *err)
{
    kvf_status st;
    if ((st = kvf_metrics_create(&h->metrics)) != KVF_OK)
        return kvf_err_set(err, st, "router: metrics: out of memory");
    static const char wakes[] = "event-loop passes over the streams: woken by a stream (a message or its end "
                                "arrived, or a client left) or by the safety timer";
    if ((st = kvf_metrics_counter(h->metrics, "kvfleet_router_requests_total", NULL, "generation requests received",
                                  &h->m_requests, err)) != KVF_OK ||
        (st = kvf_metrics_counter(h->metrics, "kvfleet_router_responses_total", "code=\"2xx\"", "answers by status class",
                                  &h->m_2xx, err)) != KVF_OK ||
        (st = kvf_metrics_counter(h->metrics, "kvfleet_router_responses_total", "code=\"4xx\"", "answers by status class",
                                  &h->m_4xx, err)) != KVF_OK ||
        (st = kvf_metrics_counter(h->metrics, "kvfleet_router_responses_total", "code=\"5xx\"", "answers by status class",
                                  &h->m_5xx, err)) != KVF_OK ||
        (st = kvf_metrics_counter(h->metrics, "kvfleet_router_loop_wakeups_total", "cause=\"stream\"", wakes,
                                  &h->m_wake_stream, err)) != KVF_OK ||
        (st = kvf_metrics_counter(h->metrics, "kvfleet_router_loop_wakeups_total", "cause=\"timer\"", wakes,
                                  &h->m_wake_timer, err)) != KVF_OK)
        return st;
    return KVF_OK;
}

/* Loads what the router needs of the model: config, and the tokenizer and chat template when
 * the directory has them. */
static kvf_status load_model(kvf_router_http *h, kvf_err *err)
{
    kvf_status st = kvf_model_config_load(h->cfg.model, &h->mcfg, err);
    if (st != KVF_OK)
        return kvf_err_prefix(err, "router: --model=%s", h->cfg.model);
    h->max_len = h->cfg.max_model_len > 0 ? h->cfg.max_model_len : h->mcfg.max_pos;
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", h->cfg.model);
    FILE *f = fopen(path, "rb");
    if (f) {
        fclose(f);
        if ((st = kvf_text_tokenizer_load(h->cfg.model, &h->tok, err)) != KVF_OK)
            return kvf_err_prefix(err, "router");
        kvf_err terr = {0};
        if (kvf_text_chat_template_load(h->cfg.model, h->cfg.chat_family, false, NULL, &h->tmpl, &terr) != KVF_OK) {
            snprintf(h->tmpl_err, sizeof h->tmpl_err, "%s", terr.msg);
            kvf_log(KVF_LOG_WARN, "router: no chat template (%s): /v1/chat/completions answers 400", terr.msg);
        }
    } else {
        snprintf(h->tmpl_err, sizeof h->tmpl_err, "the model has no tokenizer");
        kvf_log(KVF_LOG_INFO, "router: %s has no tokenizer.json: serving token ids only", h->cfg.model);
    }
    if (h->cfg.served_name && *h->cfg.served_name) {
        h->served = strdup(h->cfg.served_name);
    } else {
        size_t n = strlen(h->cfg.model);
        while (n > 1 && h->cfg.model[n - 1] == '/')
            n--;
        const char *b = h->cfg.model + n;
        while (b > h->cfg.model && b[-1] != '/')
            b--;
        h->served = strndup(b, (size_t)(h->cfg.model + n - b));
    }
    return h->served ? KVF_OK : kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
}

/* --tool-call-parser: a named format, or under "auto" the one the chat template implies. */
static kvf_status tool_parser_resolve(const kvf_router_http *h, kvf_router_toolcall_format *out, kvf_err *err)
{
    const char *name = h->cfg.tool_call_parser && *h->cfg.tool_call_parser ? h->cfg.tool_call_parser : "auto";
    kvf_status st = kvf_router_toolcall_format_parse(name, out, err);
    if (st != KVF_OK)
        return st;
    if (*out == KVF_ROUTER_TOOLCALL_AUTO)
        *out = kvf_router_toolcall_detect(h->tmpl ? kvf_text_chat_template_text(h->tmpl) : NULL);
    kvf_log(KVF_LOG_INFO, "router: tool calls in chat answers: %s%s", kvf_router_toolcall_format_name(*out),
            strcmp(name, "auto") != 0 ? "" : h->tmpl ? " (from the chat template)" : " (no chat template)");
    return KVF_OK;
}

kvf_status kvf_router_http_create(const kvf_router_http_cfg *cfg, kvf_router_http **out,
                                  kvf_err *err)
{
    if (!cfg->model || !*cfg->model)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --model is required (a model directory with config.json)");
    if (cfg->port < 0 || cfg->port > 65535)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --port=%d is not a port (0 to 65535)", cfg->port);
    kvf_router_http *h = calloc(1, sizeof *h);
    if (!h)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    h->cfg = *cfg;
    if (h->cfg.max_inflight <= 0)
        h->cfg.max_inflight = 256;
    if (h->cfg.max_attempts <= 0)
        h->cfg.max_attempts = 3;
    kvf_status st;
    if ((st = kvf_router_auth_create(&h->auth, err)) != KVF_OK ||
        (cfg->api_keys && *cfg->api_keys && (st = kvf_router_auth_add_list(h->auth, cfg->api_keys, err)) != KVF_OK) ||
        (cfg->api_key_file && *cfg->api_key_file &&
         (st = kvf_router_auth_add_file(h->auth, cfg->api_key_file, err)) != KVF_OK))
        goto fail;
    if (kvf_router_auth_count(h->auth))
        kvf_log(KVF_LOG_INFO, "router: %zu API keys: requests need Authorization: Bearer",
                kvf_router_auth_count(h->auth));
    if ((st = kvf_router_cors_create(cfg->allowed_origins, cfg->allowed_methods, cfg->allowed_headers,
                                     cfg->allow_credentials, &h->cors, err)) != KVF_OK)
        goto fail;
    if (h->cors)
        kvf_log(KVF_LOG_INFO, "router: CORS for origins %s (methods %s, headers %s%s)", cfg->allowed_origins,
                cfg->allowed_methods ? cfg->allowed_methods : KVF_ROUTER_CORS_DEFAULT_METHODS,
                cfg->allowed_headers ? cfg->allowed_headers : KVF_ROUTER_CORS_DEFAULT_HEADERS,
                cfg->allow_credentials ? ", credentials" : "");
    if (cfg->kv)
        h->kv = *cfg->kv;
    else
        kvf_router_kv_cfg_default(&h->kv);
    h->cfg.kv = NULL; /* h->kv is the copy */
    if ((st = kvf_router_policy_parse(cfg->policy ? cfg->policy : "round-robin", &h->policy, err)) != KVF_OK ||
        (st = kvf_router_kv_cfg_check(&h->kv, err)) != KVF_OK)
        goto fail;
    if (h->kv.approx && h->policy != KVF_ROUTER_POLICY_KV) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "router: --approx goes with --policy=kv (not %s): only the kv "
                         "policy reads the predicted caches", kvf_router_policy_name(h->policy));
        goto fail;
    }
    if (h->policy != KVF_ROUTER_POLICY_KV)
        kvf_log(KVF_LOG_INFO, "router: policy %s", kvf_router_policy_name(h->policy));
    else if (h->kv.approx)
        kvf_log(KVF_LOG_INFO, "router: policy kv, approximate: workers' caches predicted from this router's "
                "decisions (TTL %g s, at most each worker's KV capacity), their KV events ignored; load bound "
                "%g over %g s, penalty %g", h->kv.approx_ttl_s, h->kv.load_bound, h->kv.load_window_s,
                h->kv.load_penalty);
    else
        kvf_log(KVF_LOG_INFO, "router: policy kv, from the workers' KV events; load bound %g over %g s, "
                "penalty %g; tier hits %g s (host), %g s (disk) a block until a worker reports its own",
                h->kv.load_bound, h->kv.load_window_s, h->kv.load_penalty, h->kv.host_s_per_block,
                h->kv.disk_s_per_block);
    if ((st = add_metrics(h, err)) != KVF_OK || (st = load_model(h, err)) != KVF_OK)
        goto fail;
    evthread_use_pthreads();
    h->base = event_base_new();
    h->http = h->base ? evhttp_new(h->base) : NULL;
    if (!h->http) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "router: cannot create the event loop");
        goto fail;
    }
    /* every method reaches on_request, so even OPTIONS or PATCH get a JSON answer (libevent's
     * own 501 is an HTML page) */
    evhttp_set_allowed_methods(h->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS |
                                            EVHTTP_REQ_TRACE | EVHTTP_REQ_CONNECT | EVHTTP_REQ_PATCH);
    evhttp_set_gencb(h->http, on_request, h);
    kvf_router_conns_cfg cc = {
        .host = cfg->host ? cfg->host : "127.0.0.1", .port = cfg->port, .max_connections = cfg->max_connections,
        .idle_timeout_ms = cfg->idle_timeout_ms, .max_header_bytes = cfg->max_header_bytes,
        .max_body_bytes = cfg->max_body_bytes, .metrics = h->metrics,
    };
    if ((st = kvf_router_conns_create(h->base, h->http, &cc, &h->conns, &h->port, err)) != KVF_OK)
        goto fail;
    h->wake_ev = event_new(h->base, -1, 0, on_wake, h);
    h->safety_ev = event_new(h->base, -1, EV_PERSIST, on_safety, h);
    h->stop_ev = event_new(h->base, -1, 0, on_stop, h);
    h->drain_ev = event_new(h->base, -1, 0, on_drain, h);
    struct timeval stv = {0, SAFETY_MS * 1000};
    if (!h->wake_ev || !h->safety_ev || !h->stop_ev || !h->drain_ev || event_add(h->safety_ev, &stv) != 0) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "router: cannot create the loop's events");
        goto fail;
    }
    if (cfg->handle_signals) {
        h->sig_int = evsignal_new(h->base, SIGINT, on_stop, h);
        h->sig_term = evsignal_new(h->base, SIGTERM, on_term, h);
        evsignal_add(h->sig_int, NULL);
        evsignal_add(h->sig_term, NULL);
        h->sig_hup = evsignal_new(h->base, SIGHUP, on_hup, h);
        evsignal_add(h->sig_hup, NULL);
    }
    if ((st = kvf_router_fleet_create(&cfg->fleet, &h->fleet, err)) != KVF_OK ||
        (st = kvf_router_watch_create(h->fleet, h->policy, &h->kv, h->metrics, h, &h->watch, err)) != KVF_OK)
        goto fail;
    /* The requests borrow the model's pieces, the limits and the pools. */
    kvf_router_reqs_cfg rc = {
        .h = h, .fleet = h->fleet, .watch = h->watch, .policy = h->policy, .metrics = h->metrics,
        .served = h->served, .max_len = h->max_len, .vocab_size = h->mcfg.vocab_size,
        .tok = h->tok, .tmpl = h->tmpl, .tmpl_err = h->tmpl_err,
        .max_inflight = h->cfg.max_inflight, .max_attempts = h->cfg.max_attempts,
        .request_timeout_ms = h->cfg.request_timeout_ms,
        .prep_threads = h->cfg.prep_threads > 0 ? h->cfg.prep_threads : 2,
    };
    if ((st = tool_parser_resolve(h, &rc.tool_parser, err)) != KVF_OK)
        goto fail;
    if (h->tok) {
        rc.eos_ids = kvf_text_tokenizer_eos_ids(h->tok, &rc.n_eos);
        /* A text prompt of more bytes than the context's tokens can hold is refused untokenized. */
        int64_t per_token = kvf_text_tokenizer_max_bytes_per_token(h->tok);
        rc.max_prompt_bytes = per_token * h->max_len;
        if (per_token)
            kvf_log(KVF_LOG_INFO, "router: prompts over %lld bytes (%d tokens of at most %lld bytes) are refused before tokenizing",
                    (long long)rc.max_prompt_bytes, h->max_len, (long long)per_token);
        else
            kvf_log(KVF_LOG_INFO, "router: this tokenizer can make text vanish: no byte bound on prompts before tokenizing");
    }
    if ((st = kvf_router_reqs_create(&rc, &h->reqs, err)) != KVF_OK)
        goto fail;
    *out = h;
    return KVF_OK;
fail:
    kvf_router_http_destroy(h);
    return st;
}

int kvf_router_http_port(const kvf_router_http *h)
{
    return h->port;
}

kvf_status kvf_router_http_run(kvf_router_http *h, kvf_err *err)
{
    kvf_log(KVF_LOG_INFO, "router: serving %s (context %d, %s) on http://%s:%d", h->served, h->max_len,
            h->tok ? "tokenizer" : "token ids only", h->cfg.host ? h->cfg.host : "127.0.0.1", h->port);
    if (atomic_load(&h->stopping))
        return KVF_OK;
    if (event_base_dispatch(h->base) < 0)
        return kvf_err_set(err, KVF_ERR_INTERNAL, "router: the event loop failed");
    return KVF_OK;
}

void kvf_router_http_stop(kvf_router_http *h)
{
    if (atomic_exchange(&h->stopping, true))
        return;
    event_active(h->stop_ev, EV_READ, 0);
}

void kvf_router_http_drain(kvf_router_http *h)
{
    if (atomic_exchange(&h->drain_asked, true))
        return;
    event_active(h->drain_ev, EV_READ, 0);
}

void kvf_router_http_destroy(kvf_router_http *h)
{
    if (!h)
        return;
    kvf_router_reqs_destroy(h->reqs);   /* before evhttp_free (kvf_router_client_abandon) */
    kvf_router_watch_destroy(h->watch); /* its streams go before the fleet's channels */
    if (h->http)
        evhttp_free(h->http);
    if (h->wake_ev)
        event_free(h->wake_ev);
    if (h->safety_ev)
        event_free(h->safety_ev);
    if (h->stop_ev)
        event_free(h->stop_ev);
    if (h->drain_ev)
        event_free(h->drain_ev);
    if (h->sig_int)
        event_free(h->sig_int);
    if (h->sig_term)
        event_free(h->sig_term);
    if (h->sig_hup)
        event_free(h->sig_hup);
    if (h->base)
        event_base_free(h->base);
    kvf_router_conns_destroy(h->conns); /* after the connections it counts are freed */
    kvf_router_fleet_destroy(h->fleet);
    kvf_text_chat_template_destroy(h->tmpl);
    kvf_text_tokenizer_destroy(h->tok);
    kvf_metrics_destroy(h->metrics);
    free(h->served);
    kvf_router_auth_destroy(h->auth);
    kvf_router_cors_destroy(h->cors);
    free(h);
}
