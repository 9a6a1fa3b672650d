/* http.c: the router's HTTP server on one libevent loop. Every evhttp call and every routing
 * decision happens on the loop thread, so no lock guards the requests. Generate and WatchKv
 * streams wake the loop when a message or their end arrives (an atomic flag per stream and one
 * libevent user event); a 100 ms safety timer notices clients that left plain requests and
 * logs index health. Membership and health checks are fleet.c's. */
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
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/metrics.h"
#include "common/sbuf.h"
#include "common/time.h"
#include "kv/hash.h"
#include "model/chat_template.h"
#include "model/config.h"
#include "model/tokenizer.h"
#include "proto/worker.h"
#include "router/http_int.h"
#include "router/openai.h"
#include "router/policy.h"
#include "router/watch.h"

typedef struct seq_state {
    kvf_model_detok *detok;
    kvf_sbuf text;
    size_t emitted;      /* text bytes already sent (streaming) */
    int32_t *ids;
    size_t n_ids, cap, ids_emitted;
    kvf_router_oai_finish finish;
    bool done, first_sent;
} seq_state;

typedef struct rq {
    struct kvf_router_http *h;
    struct evhttp_request *ev;
    char id[80];
    kvf_router_oai_req oai;
    int32_t *prompt;
    size_t n_prompt;
    uint64_t *hashes;
    size_t n_blocks;
    int32_t max_tokens;
    seq_state *seqs;
    kvf_rpc_stream *stream;
    kvf_router_wake wake;
    int32_t worker, prefill;
    int64_t prefill_tokens; /* queued on the prefill worker until the first token */
    int attempts;
    bool got_token, client_gone, started;
    int64_t created;
    double t0;
    int64_t cached_tokens;
    uint32_t overlap; /* prompt blocks the index says the decode worker holds */
    int64_t next_peek_ns;
    size_t max_stop;
    struct rq *prev, *next;
} rq;

struct kvf_router_http {
    kvf_router_http_cfg cfg;
    char *served;
    int32_t max_len;
    kvf_model_config mcfg;
    kvf_model_tokenizer *tok;
    kvf_model_chat_template *tmpl;
    char tmpl_err[KVF_ERR_MSG_MAX];
    const int32_t *eos_ids;
    size_t n_eos;

    struct event_base *base;
    struct evhttp *http;
    int port;
    struct event *wake_ev;   /* a stream has something: read the ready ones (on_wake) */
    struct event *safety_ev; /* every SAFETY_MS: plain clients gone, index health (on_safety) */
    struct event *stop_ev, *sig_int, *sig_term;
    atomic_bool stopping;

    kvf_router_fleet *fleet;
    kvf_router_policy policy;
    kvf_router_watch *watch;                  /* the pools, fed by WatchKv (watch.c) */
    int32_t inflight[KVF_ROUTER_MAX_WORKERS]; /* decode requests we hold open */
    int64_t prefill_queued[KVF_ROUTER_MAX_WORKERS];
    uint64_t next_id;
    rq *reqs;
    int64_t n_reqs;

    kvf_metrics *metrics;
    kvf_metric *m_requests, *m_2xx, *m_4xx, *m_5xx, *m_inflight, *m_retries, *m_disconnects,
        *m_gen_tokens, *m_prompt_tokens, *m_ttft, *m_e2e;
    kvf_metric *m_wake_stream, *m_wake_timer; /* loop passes by cause */
    double last_index_health;      /* when the index health last ran from the safety timer */
};

/* ---------------------------------------------------------------------------------------- */
/* Small helpers                                                                             */

static double wall_s(void)
{
    return (double)kvf_wall_ms() / 1000.0;
}

static void count_status(kvf_router_http *h, int code)
{
    kvf_metric_add(code < 300 ? h->m_2xx : code < 500 ? h->m_4xx : h->m_5xx, 1);
}

static void send_json(kvf_router_http *h, struct evhttp_request *ev, int code, const char *reason,
                      const char *req_id, const char *body, size_t len)
{
    struct evkeyvalq *oh = evhttp_request_get_output_headers(ev);
    evhttp_add_header(oh, "Content-Type", "application/json");
    if (req_id && *req_id)
        evhttp_add_header(oh, "x-request-id", req_id);
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, body, len);
    evhttp_send_reply(ev, code, reason, b);
    evbuffer_free(b);
    count_status(h, code);
}

static const char *reason_of(int code)
{
    switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    default: return code < 500 ? "Bad Request" : "Internal Server Error";
    }
}

static void send_error(kvf_router_http *h, struct evhttp_request *ev, const char *req_id,
                       const kvf_router_oai_error *e, int retry_after_s)
{
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    kvf_router_oai_error_json(e, &b);
    if (retry_after_s > 0) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d", retry_after_s);
        evhttp_add_header(evhttp_request_get_output_headers(ev), "Retry-After", ra);
    }
    kvf_log(e->http_status >= 500 ? KVF_LOG_WARN : KVF_LOG_INFO, "router: req %s: %d %s",
            req_id ? req_id : "-", e->http_status, e->message);
    send_json(h, ev, e->http_status, reason_of(e->http_status), req_id, b.data ? b.data : "{}",
              b.len);
    kvf_sbuf_fini(&b);
}

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

/* The safety timer's period: the longest a plain request's vanished client goes unnoticed
 * while its worker sends nothing. Streams never wait for it. */
#define SAFETY_MS 100

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

/* ---------------------------------------------------------------------------------------- */
/* Worker pools                                                                              */

/* Picks a decode worker (and a prefill worker when there are any) for r. Fills e with 503 (none
 * healthy) or 429 (all saturated) and returns its retry-after in *retry_out. */
static kvf_status pick_workers(kvf_router_http *h, rq *r, kvf_router_oai_error *e, int *retry_out)
{
    kvf_router_watch *wt = h->watch;
    kvf_router_watch_sync(wt);
    double now = kvf_now_s();
    kvf_router_pool *dpool = kvf_router_watch_pool(wt, KVF_ROUTER_ROLE_DECODE);
    kvf_router_pool *ppool = kvf_router_watch_pool(wt, KVF_ROUTER_ROLE_PREFILL);
    if (!dpool || kvf_router_watch_n_in_pool(wt, KVF_ROUTER_ROLE_DECODE) == 0) {
        *retry_out = 5;
        return kvf_router_oai_error_set(e, 503, "server_error", NULL, "no_worker",
                                        "no decode worker is ready; retry later");
    }
    bool free_one = false;
    for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++) {
        if (!kvf_router_watch_in_pool(wt, KVF_ROUTER_ROLE_DECODE, i))
            continue;
        kvf_router_load l = {0, (double)h->inflight[i]}, rep;
        if (kvf_router_watch_load(wt, KVF_ROUTER_ROLE_DECODE, i, &rep)) {
            l.queued_prefill_tokens = rep.queued_prefill_tokens;
            if (rep.decode_load > l.decode_load)
                l.decode_load = rep.decode_load;
        }
        kvf_router_pool_load_set(dpool, i, &l, now);
        kvf_router_pool_worker_limits(dpool, i, 0, (double)h->cfg.max_inflight);
        free_one |= h->inflight[i] < h->cfg.max_inflight;
    }
    if (!free_one) {
        *retry_out = 1;
        return kvf_router_oai_error_set(e, 429, "rate_limit_error", NULL, "workers_saturated",
                                        "every decode worker has %d requests in flight; retry later",
                                        h->cfg.max_inflight);
    }
    kvf_router_request req = {.hashes = r->hashes, .n_blocks = r->n_blocks,
                              .n_tokens = (int64_t)r->n_prompt, .session_key = NULL};
    kvf_router_decision d;
    kvf_err err = {0};
    if (kvf_router_pool_pick(dpool, &req, now, &d, &err) != KVF_OK ||
        h->inflight[d.worker] >= h->cfg.max_inflight) {
        *retry_out = 1;
        return kvf_router_oai_error_set(e, 429, "rate_limit_error", NULL, "workers_saturated",
                                        "no decode worker can take the request: %s", err.msg[0] ? err.msg : "all saturated");
    }
    r->worker = d.worker;
    r->overlap = d.overlap_blocks;
    r->prefill = -1;
    if (ppool && kvf_router_watch_n_in_pool(wt, KVF_ROUTER_ROLE_PREFILL) > 0) {
        for (int32_t i = 0; i < KVF_ROUTER_MAX_WORKERS; i++)
            if (kvf_router_watch_in_pool(wt, KVF_ROUTER_ROLE_PREFILL, i)) {
                kvf_router_load l = {h->prefill_queued[i], 0}, rep;
                if (kvf_router_watch_load(wt, KVF_ROUTER_ROLE_PREFILL, i, &rep) &&
                    rep.queued_prefill_tokens > l.queued_prefill_tokens)
                    l.queued_prefill_tokens = rep.queued_prefill_tokens;
                kvf_router_pool_load_set(ppool, i, &l, now);
            }
        kvf_router_decision p;
        if (kvf_router_pool_pick(ppool, &req, now, &p, &err) == KVF_OK)
            r->prefill = p.worker;
    }
    return KVF_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Requests                                                                                  */

static void rq_free(rq *r)
{
    kvf_router_http *h = r->h;
    if (r->stream)
        kvf_rpc_stream_destroy(r->stream);
    if (r->worker >= 0 && r->started)
        h->inflight[r->worker]--;
    if (r->prefill >= 0 && r->prefill_tokens)
        h->prefill_queued[r->prefill] -= r->prefill_tokens;
    if (r->seqs)
        for (int32_t i = 0; i < r->oai.n; i++) {
            kvf_model_detok_destroy(r->seqs[i].detok);
            kvf_sbuf_fini(&r->seqs[i].text);
            free(r->seqs[i].ids);
        }
    free(r->seqs);
    free(r->prompt);
    free(r->hashes);
    kvf_router_oai_req_fini(&r->oai);
    if (r->prev)
        r->prev->next = r->next;
    else if (h->reqs == r)
        h->reqs = r->next;
    if (r->next)
        r->next->prev = r->prev;
    h->n_reqs--;
    kvf_metric_set(h->m_inflight, (double)h->n_reqs);
    free(r);
}

/* Forgets the close callback before the request is answered (the connection may live on). */
static void detach(rq *r)
{
    struct evhttp_connection *c = r->ev ? evhttp_request_get_connection(r->ev) : NULL;
    if (c)
        evhttp_connection_set_closecb(c, NULL, NULL);
}

static void on_close(struct evhttp_connection *c, void *arg)
{
    rq *r = arg;
    (void)c;
    if (!r || r->client_gone)
        return;
    r->client_gone = true;
    if (r->stream)
        kvf_rpc_stream_cancel(r->stream);
    kvf_router_wake_notify(&r->wake); /* pump answers it on the loop's next pass */
}

/* Opens Generate on r->worker. */
static kvf_status open_stream(kvf_router_http *h, rq *r, kvf_err *err)
{
    Kvfleet__V1__GenerateRequest g = KVFLEET__V1__GENERATE_REQUEST__INIT;
    Kvfleet__V1__SamplingParams sp = KVFLEET__V1__SAMPLING_PARAMS__INIT;
    Kvfleet__V1__PrefillHint ph = KVFLEET__V1__PREFILL_HINT__INIT;
    g.request_id = r->id;
    g.n_token_ids = r->n_prompt;
    g.token_ids = r->prompt;
    sp.max_tokens = r->max_tokens;
    /* A resubmission after tokens were streamed (one sequence): prompt + those tokens, and the
     * rest of the budget, so the client's stream goes on where it stopped. */
    int32_t *joined = NULL;
    size_t prior = r->seqs && r->oai.n == 1 ? r->seqs[0].n_ids : 0;
    if (prior) {
        joined = malloc((r->n_prompt + prior) * sizeof *joined);
        if (!joined)
            return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
        memcpy(joined, r->prompt, r->n_prompt * sizeof *joined);
        memcpy(joined + r->n_prompt, r->seqs[0].ids, prior * sizeof *joined);
        g.token_ids = joined;
        g.n_token_ids = r->n_prompt + prior;
        g.n_prior_output_tokens = (int32_t)prior;
        sp.max_tokens = r->max_tokens - (int32_t)prior;
    }
    sp.temperature = (float)r->oai.temperature;
    sp.top_p = (float)r->oai.top_p;
    sp.top_k = r->oai.top_k;
    sp.seed = r->oai.has_seed ? r->oai.seed : (uint64_t)kvf_now_ns() ^ h->next_id++;
    sp.n = r->oai.n;
    sp.ignore_eos = r->oai.ignore_eos;
    if (!r->oai.ignore_eos && h->n_eos) {
        sp.n_stop_token_ids = h->n_eos;
        sp.stop_token_ids = (int32_t *)h->eos_ids;
    }
    g.sampling = &sp;
    g.cache_salt = r->oai.cache_salt ? r->oai.cache_salt : "";
    if (r->prefill >= 0) {
        ph.address = (char *)kvf_router_watch_worker(h->watch, KVF_ROUTER_ROLE_PREFILL, r->prefill)->address;
        g.prefill = &ph;
    }
    if (h->cfg.request_timeout_ms > 0)
        g.deadline_unix_ms = kvf_wall_ms() + h->cfg.request_timeout_ms;
    kvf_rpc_buf b = {0};
    kvf_status st = kvf_rpc_msg_encode(&g, &b, err);
    free(joined);
    if (st != KVF_OK)
        return st;
    int64_t to = h->cfg.request_timeout_ms > 0 ? h->cfg.request_timeout_ms : KVF_RPC_NO_DEADLINE;
    st = kvf_rpc_stream_open(kvf_router_watch_worker(h->watch, KVF_ROUTER_ROLE_DECODE, r->worker)->channel, KVF_RPC_WORKER_GENERATE, b.data,
                             b.len, to, &r->stream, err);
    kvf_rpc_buf_free(&b);
    if (st != KVF_OK)
        return st;
    kvf_rpc_stream_notify(r->stream, kvf_router_wake_notify, &r->wake);
    r->attempts++;
    r->started = true;
    h->inflight[r->worker]++;
    if (r->prefill >= 0 && !r->prefill_tokens) {
        r->prefill_tokens = (int64_t)r->n_prompt;
        h->prefill_queued[r->prefill] += r->prefill_tokens;
    }
    kvf_log(KVF_LOG_INFO, "router: req %s: %zu prompt tokens -> decode %s (%u blocks cached there)%s%s (attempt %d)",
            r->id, r->n_prompt, kvf_router_watch_worker(h->watch, KVF_ROUTER_ROLE_DECODE, r->worker)->address, r->overlap,
            r->prefill >= 0 ? ", prefill " : "", r->prefill >= 0 ? kvf_router_watch_worker(h->watch, KVF_ROUTER_ROLE_PREFILL, r->prefill)->address : "",
            r->attempts);
    return KVF_OK;
}

/* The end of the text that is safe to send: not inside a possible stop string's start and not
 * inside a UTF-8 character. */
static size_t safe_end(const rq *r, const seq_state *s)
{
    size_t end = s->text.len;
    if (s->done)
        return end;
    if (r->max_stop > 1)
        end = end > r->max_stop - 1 ? end - (r->max_stop - 1) : 0;
    while (end > s->emitted && end < s->text.len && ((unsigned char)s->text.data[end] & 0xC0) == 0x80)
        end--;
    return end < s->emitted ? s->emitted : end;
}

static void send_chunk(kvf_router_http *h, rq *r, const kvf_router_oai_choice *c, size_t n,
                       const kvf_router_oai_usage *u)
{
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    char id[96];
    snprintf(id, sizeof id, "%s-%s", r->oai.kind == KVF_ROUTER_OAI_CHAT ? "chatcmpl" : "cmpl", r->id);
    kvf_router_oai_chunk_sse(r->oai.kind, id, h->served, r->created, c, n, u,
                             r->oai.include_usage, &b);
    struct evbuffer *eb = evbuffer_new();
    evbuffer_add(eb, b.data, b.len);
    evhttp_send_reply_chunk(r->ev, eb);
    evbuffer_free(eb);
    kvf_sbuf_fini(&b);
}

static void emit_seq(kvf_router_http *h, rq *r, int32_t idx)
{
    seq_state *s = &r->seqs[idx];
    size_t end = safe_end(r, s);
    if (end == s->emitted && s->ids_emitted == s->n_ids && !s->done)
        return;
    kvf_router_oai_choice c = {
        .index = idx,
        .text = s->text.data ? s->text.data + s->emitted : "",
        .text_len = end - s->emitted,
        .token_ids = s->ids ? s->ids + s->ids_emitted : NULL,
        .n_ids = s->n_ids - s->ids_emitted,
        .finish = s->done ? s->finish : KVF_ROUTER_OAI_FINISH_NONE,
        .first_chunk = !s->first_sent,
    };
    send_chunk(h, r, &c, 1, NULL);
    s->first_sent = true;
    s->emitted = end;
    s->ids_emitted = s->n_ids;
}

static void seq_finish(kvf_router_http *h, rq *r, int32_t idx, kvf_router_oai_finish f)
{
    seq_state *s = &r->seqs[idx];
    if (s->done)
        return;
    size_t prev = s->text.len;
    if (s->detok) {
        kvf_err err = {0};
        kvf_model_detok_finish(s->detok, &s->text, &err);
    }
    if (r->oai.n_stop && s->text.len > prev) {
        size_t from = prev > r->max_stop ? prev - r->max_stop : 0;
        int64_t pos = kvf_router_oai_find_stop(s->text.data, s->text.len, from, r->oai.stop, r->oai.n_stop);
        if (pos >= 0) {
            s->text.len = (size_t)pos;
            s->text.data[pos] = 0;
            f = KVF_ROUTER_OAI_FINISH_STOP;
        }
    }
    s->finish = f;
    s->done = true;
    if (r->oai.stream && !r->client_gone)
        emit_seq(h, r, idx);
}

static bool all_done(const rq *r)
{
    for (int32_t i = 0; i < r->oai.n; i++)
        if (!r->seqs[i].done)
            return false;
    return true;
}

/* Applies one GenerateResponse. */
static void handle_msg(kvf_router_http *h, rq *r, const Kvfleet__V1__GenerateResponse *m)
{
    if (m->usage && m->usage->cached_prompt_tokens > r->cached_tokens)
        r->cached_tokens = m->usage->cached_prompt_tokens;
    if (m->index < 0 || m->index >= r->oai.n) {
        kvf_log(KVF_LOG_WARN, "router: req %s: decode sent sequence index %d of %d", r->id, m->index, r->oai.n);
        return;
    }
    seq_state *s = &r->seqs[m->index];
    if (m->n_token_ids && !r->got_token) {
        r->got_token = true;
        kvf_metric_observe(h->m_ttft, kvf_now_s() - r->t0);
        if (r->prefill >= 0 && r->prefill_tokens) {
            h->prefill_queued[r->prefill] -= r->prefill_tokens;
            r->prefill_tokens = 0;
        }
    }
    if (s->done)
        return;
    if (s->n_ids + m->n_token_ids > s->cap) {
        size_t cap = (s->n_ids + m->n_token_ids) * 2 + 16;
        int32_t *ids = realloc(s->ids, cap * sizeof *ids);
        if (!ids)
            return;
        s->ids = ids;
        s->cap = cap;
    }
    if (m->n_token_ids)
        memcpy(s->ids + s->n_ids, m->token_ids, m->n_token_ids * sizeof *m->token_ids);
    s->n_ids += m->n_token_ids;
    kvf_metric_add(h->m_gen_tokens, (double)m->n_token_ids);
    size_t prev = s->text.len;
    if (s->detok && m->n_token_ids) {
        kvf_err err = {0};
        if (kvf_model_detok_feed(s->detok, m->token_ids, m->n_token_ids, &s->text, &err) != KVF_OK)
            kvf_log(KVF_LOG_WARN, "router: req %s: %s", r->id, err.msg);
    }
    if (r->oai.n_stop && s->text.len > prev) {
        size_t from = prev > r->max_stop ? prev - r->max_stop : 0;
        int64_t pos = kvf_router_oai_find_stop(s->text.data, s->text.len, from, r->oai.stop, r->oai.n_stop);
        if (pos >= 0) {
            s->text.len = (size_t)pos;
            s->text.data[pos] = 0;
            s->finish = KVF_ROUTER_OAI_FINISH_STOP;
            s->done = true;
        }
    }
    if (!s->done && m->finish_reason != KVFLEET__V1__FINISH_REASON__FINISH_NONE) {
        kvf_router_oai_finish f = m->finish_reason == KVFLEET__V1__FINISH_REASON__FINISH_STOP ? KVF_ROUTER_OAI_FINISH_STOP
                                  : m->finish_reason == KVFLEET__V1__FINISH_REASON__FINISH_LENGTH ? KVF_ROUTER_OAI_FINISH_LENGTH
                                                                                                 : KVF_ROUTER_OAI_FINISH_ABORT;
        seq_finish(h, r, m->index, f);
        return;
    }
    if (r->oai.stream && !r->client_gone)
        emit_seq(h, r, m->index);
}

static kvf_router_oai_usage usage_of(const rq *r)
{
    kvf_router_oai_usage u = {.prompt_tokens = (int64_t)r->n_prompt, .cached_tokens = r->cached_tokens};
    for (int32_t i = 0; i < r->oai.n; i++)
        u.completion_tokens += (int64_t)r->seqs[i].n_ids;
    return u;
}

/* Sends the end of a successful request and frees it. */
static void finish_ok(kvf_router_http *h, rq *r)
{
    detach(r);
    kvf_router_oai_usage u = usage_of(r);
    if (r->oai.stream) {
        if (r->oai.include_usage)
            send_chunk(h, r, NULL, 0, &u);
        struct evbuffer *eb = evbuffer_new();
        evbuffer_add_printf(eb, "data: [DONE]\n\n");
        evhttp_send_reply_chunk(r->ev, eb);
        evbuffer_free(eb);
        evhttp_send_reply_end(r->ev);
        count_status(h, 200);
    } else {
        kvf_router_oai_choice *cs = calloc((size_t)r->oai.n, sizeof *cs);
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        for (int32_t i = 0; cs && i < r->oai.n; i++) {
            seq_state *s = &r->seqs[i];
            cs[i] = (kvf_router_oai_choice){.index = i, .text = s->text.data, .text_len = s->text.len,
                                            .token_ids = s->ids, .n_ids = s->n_ids, .finish = s->finish};
        }
        char id[96];
        snprintf(id, sizeof id, "%s-%s", r->oai.kind == KVF_ROUTER_OAI_CHAT ? "chatcmpl" : "cmpl", r->id);
        kvf_router_oai_answer_json(r->oai.kind, id, h->served, r->created, cs, cs ? (size_t)r->oai.n : 0, &u, &b);
        send_json(h, r->ev, 200, "OK", r->id, b.data ? b.data : "{}", b.len);
        kvf_sbuf_fini(&b);
        free(cs);
    }
    kvf_metric_observe(h->m_e2e, kvf_now_s() - r->t0);
    kvf_log(KVF_LOG_INFO, "router: req %s: done, %lld prompt + %lld completion tokens in %.1f ms",
            r->id, (long long)u.prompt_tokens, (long long)u.completion_tokens, (kvf_now_s() - r->t0) * 1e3);
    r->ev = NULL;
    rq_free(r);
}

static void finish_err(kvf_router_http *h, rq *r, const kvf_router_oai_error *e, int retry_after)
{
    detach(r);
    if (r->oai.stream) {
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        kvf_sbuf_puts(&b, "data: ");
        kvf_router_oai_error_json(e, &b);
        kvf_sbuf_puts(&b, "\n\ndata: [DONE]\n\n");
        struct evbuffer *eb = evbuffer_new();
        evbuffer_add(eb, b.data, b.len);
        evhttp_send_reply_chunk(r->ev, eb);
        evbuffer_free(eb);
        evhttp_send_reply_end(r->ev);
        kvf_sbuf_fini(&b);
        kvf_log(KVF_LOG_WARN, "router: req %s: failed mid-stream: %s", r->id, e->message);
        count_status(h, e->http_status);
    } else {
        send_error(h, r->ev, r->id, e, retry_after);
    }
    r->ev = NULL;
    rq_free(r);
}

static void finish_gone(kvf_router_http *h, rq *r)
{
    detach(r);
    kvf_log(KVF_LOG_INFO, "router: req %s: client went away; Generate cancelled", r->id);
    kvf_metric_add(h->m_disconnects, 1);
    if (r->stream)
        kvf_rpc_stream_cancel(r->stream);
    if (r->oai.stream)
        evhttp_send_reply_end(r->ev); /* frees the request when the connection is gone */
    else
        evhttp_send_reply(r->ev, 499, "Client Closed Request", NULL);
    r->ev = NULL;
    rq_free(r);
}

static bool retryable(kvf_status st)
{
    return st == KVF_ERR_PEER_LOST || st == KVF_ERR_BUSY || st == KVF_ERR_FULL ||
           st == KVF_ERR_CANCELLED || st == KVF_ERR_INTERNAL;
}

/* The decode worker failed before the first token, or mid-stream with one sequence: go on with
 * another one. Returns false when the request was answered (and freed) instead. */
static bool retry(kvf_router_http *h, rq *r, kvf_status why, const char *msg)
{
    kvf_log(KVF_LOG_WARN, "router: req %s: decode %s failed after %zu tokens (%s: %s)", r->id,
            kvf_router_watch_worker(h->watch, KVF_ROUTER_ROLE_DECODE, r->worker)->address, r->seqs[0].n_ids, kvf_status_name(why), msg);
    kvf_rpc_stream_destroy(r->stream);
    r->stream = NULL;
    h->inflight[r->worker]--;
    r->started = false;
    if (why == KVF_ERR_PEER_LOST) {
        kvf_router_fleet_mark_failed(h->fleet, KVF_ROUTER_ROLE_DECODE, r->worker);
    }
    kvf_router_watch_drop(h->watch, KVF_ROUTER_ROLE_DECODE, r->worker);
    kvf_router_oai_error e;
    int ra = 0;
    if (r->attempts >= h->cfg.max_attempts) {
        kvf_router_oai_error_set(&e, 503, "server_error", NULL, "worker_failed",
                                 "decode workers failed %d times; last: %s",
                                 r->attempts, msg);
        finish_err(h, r, &e, 1);
        return false;
    }
    if (r->prefill >= 0 && r->prefill_tokens) {
        h->prefill_queued[r->prefill] -= r->prefill_tokens;
        r->prefill_tokens = 0;
    }
    /* The pool may re-add the failed worker when the fleet still thinks it healthy: skip it. */
    int32_t failed = r->worker;
    for (int tries = 0; tries < 4; tries++) {
        if (pick_workers(h, r, &e, &ra) != KVF_OK) {
            finish_err(h, r, &e, ra);
            return false;
        }
        if (r->worker != failed || kvf_router_watch_n_in_pool(h->watch, KVF_ROUTER_ROLE_DECODE) <= 1)
            break;
    }
    kvf_metric_add(h->m_retries, 1);
    kvf_err err = {0};
    if (open_stream(h, r, &err) != KVF_OK) {
        kvf_router_oai_error_set(&e, 503, "server_error", NULL, "worker_failed", "%s", err.msg);
        finish_err(h, r, &e, 1);
        return false;
    }
    return true;
}

/* libevent does not always watch a connection for EOF while its request waits for an answer:
 * every 20 ms a waiting plain request peeks at its socket (0 bytes readable = the client left). */
static void peek_gone(rq *r)
{
    int64_t now = kvf_now_ns();
    if (r->client_gone || r->oai.stream || now < r->next_peek_ns)
        return;
    r->next_peek_ns = now + 20000000;
    struct evhttp_connection *c = evhttp_request_get_connection(r->ev);
    struct bufferevent *bev = c ? evhttp_connection_get_bufferevent(c) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    char b;
    if (fd >= 0 && recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0)
        on_close(c, r);
}

/* Reads what the request's stream has; returns after the request is answered or idle. */
static void pump(kvf_router_http *h, rq *r)
{
    peek_gone(r);
    for (;;) {
        if (r->client_gone) {
            finish_gone(h, r);
            return;
        }
        kvf_rpc_buf m = {0};
        bool done = false;
        kvf_err err = {0};
        kvf_status st = kvf_rpc_stream_read(r->stream, 0, &m, &done, &err);
        if (!done && st == KVF_ERR_TIMEOUT)
            return;
        if (!done && st == KVF_OK) {
            Kvfleet__V1__GenerateResponse *g = NULL;
            if (kvf_rpc_generate_response_decode(m.data, m.len, &g, &err) != KVF_OK) {
                kvf_log(KVF_LOG_WARN, "router: req %s: bad Generate message: %s", r->id, err.msg);
            } else {
                handle_msg(h, r, g);
            }
            kvf_rpc_msg_free(g);
            kvf_rpc_buf_free(&m);
            if (all_done(r)) {
                kvf_rpc_stream_cancel(r->stream); /* stop strings may end it before the worker */
                finish_ok(h, r);
                return;
            }
            continue;
        }
        /* The call is over. */
        if (st == KVF_OK) {
            for (int32_t i = 0; i < r->oai.n; i++)
                seq_finish(h, r, i, KVF_ROUTER_OAI_FINISH_LENGTH);
            finish_ok(h, r);
            return;
        }
        bool resumable = !r->got_token || (r->oai.n == 1 && !r->seqs[0].done);
        if (resumable && retryable(st)) {
            if (!retry(h, r, st, err.msg))
                return;
            continue;
        }
        kvf_router_oai_error e;
        int code = st == KVF_ERR_INVALID || st == KVF_ERR_LIMIT ? 400 : st == KVF_ERR_TIMEOUT ? 504 : 502;
        kvf_router_oai_error_set(&e, code, code == 400 ? "invalid_request_error" : "server_error", NULL,
                                 NULL, "decode worker %s: %s", kvf_router_watch_worker(h->watch, KVF_ROUTER_ROLE_DECODE, r->worker)->address,
                                 err.msg[0] ? err.msg : kvf_status_str(st));
        finish_err(h, r, &e, 0);
        return;
    }
}

/* Pumps the requests and drains the watches whose stream said it has something (all of them
 * when `all`). Loop thread. */
static void drain(kvf_router_http *h, bool all)
{
    for (rq *r = h->reqs, *next; r; r = next) {
        next = r->next; /* pump frees r at most, never another request */
        bool ready = kvf_router_wake_take(&r->wake);
        if (ready || all)
            pump(h, r);
    }
    kvf_router_watch_drain(h->watch, all);
}

/* A stream has a message or its end, or a client left (on_stream_ready, wake_again). */
static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    kvf_router_http *h = arg;
    (void)fd, (void)what;
    kvf_metric_add(h->m_wake_stream, 1);
    drain(h, false);
}

/* Every SAFETY_MS: plain requests peek at their client's socket (libevent does not always
 * report a vanished client while its request waits), every stream is read once more in case a
 * wake-up was lost, and under the kv policy index state changes are logged once a second. */
static void on_safety(evutil_socket_t fd, short what, void *arg)
{
    kvf_router_http *h = arg;
    (void)fd, (void)what;
    kvf_metric_add(h->m_wake_timer, 1);
    drain(h, true);
    double now = kvf_now_s();
    if (h->policy == KVF_ROUTER_POLICY_KV && now - h->last_index_health >= 1.0) {
        h->last_index_health = now;
        kvf_router_watch_health(h->watch);
    }
}

/* Tokenizes the prompt of a parsed request into r->prompt. */
static kvf_status build_prompt(kvf_router_http *h, rq *r, kvf_router_oai_error *e)
{
    kvf_err err = {0};
    if (r->oai.prompt_ids) {
        int32_t vocab = h->tok ? kvf_model_tokenizer_vocab_size(h->tok) : h->mcfg.vocab_size;
        if (vocab < h->mcfg.vocab_size)
            vocab = h->mcfg.vocab_size;
        for (size_t i = 0; i < r->oai.n_prompt_ids; i++)
            if (r->oai.prompt_ids[i] >= vocab)
                return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                                "'prompt'[%zu] is token id %d; this model's ids are 0 to %d",
                                                i, r->oai.prompt_ids[i], vocab - 1);
        r->prompt = r->oai.prompt_ids;
        r->n_prompt = r->oai.n_prompt_ids;
        r->oai.prompt_ids = NULL;
        return KVF_OK;
    }
    if (!h->tok)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error",
                                        r->oai.kind == KVF_ROUTER_OAI_CHAT ? "messages" : "prompt", "no_tokenizer",
                                        "model '%s' has no tokenizer: send 'prompt' to /v1/completions as an array of token ids",
                                        h->served);
    char *text = NULL;
    size_t len = 0;
    bool add_special = true;
    if (r->oai.kind == KVF_ROUTER_OAI_CHAT) {
        if (!h->tmpl)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", "no_chat_template",
                                            "model '%s' has no chat template: %s", h->served, h->tmpl_err);
        kvf_model_chat_request cr = {.messages = r->oai.messages, .add_generation_prompt = true,
                                     .extra = r->oai.chat_extra};
        bool raised = false;
        if (kvf_model_chat_template_render(h->tmpl, &cr, &text, &len, &raised, &err) != KVF_OK)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", NULL, "%s", err.msg);
        add_special = false; /* the template writes BOS itself */
    }
    const char *src = text ? text : r->oai.prompt_text;
    kvf_status st = kvf_model_tokenizer_encode(h->tok, src, text ? len : strlen(src), add_special,
                                               &r->prompt, &r->n_prompt, &err);
    free(text);
    if (st != KVF_OK)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error",
                                        r->oai.kind == KVF_ROUTER_OAI_CHAT ? "messages" : "prompt", NULL, "%s", err.msg);
    return KVF_OK;
}

static void handle_generate(kvf_router_http *h, struct evhttp_request *ev, kvf_router_oai_kind kind)
{
    char id[80];
    request_id(h, ev, id, sizeof id);
    kvf_metric_add(h->m_requests, 1);
    kvf_router_oai_error e;
    int retry_after = 0;
    if (evhttp_request_get_command(ev) != EVHTTP_REQ_POST) {
        kvf_router_oai_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                                 "%s takes POST", evhttp_request_get_uri(ev));
        send_error(h, ev, id, &e, 0);
        return;
    }
    rq *r = calloc(1, sizeof *r);
    if (!r) {
        kvf_router_oai_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        send_error(h, ev, id, &e, 0);
        return;
    }
    r->h = h;
    r->wake.h = h;
    r->worker = r->prefill = -1;
    r->t0 = kvf_now_s();
    r->created = (int64_t)wall_s();
    snprintf(r->id, sizeof r->id, "%s", id);
    struct evbuffer *in = evhttp_request_get_input_buffer(ev);
    size_t len = evbuffer_get_length(in);
    const char *body = len ? (const char *)evbuffer_pullup(in, -1) : "";
    if (kvf_router_oai_parse(kind, body, len, &r->oai, &e) != KVF_OK)
        goto fail;
    if (strcmp(r->oai.model, h->served) != 0) {
        kvf_router_oai_error_set(&e, 404, "invalid_request_error", "model", "model_not_found",
                                 "The model '%s' does not exist; this server serves '%s'", r->oai.model,
                                 h->served);
        goto fail;
    }
    if (r->oai.n_stop && !h->tok) {
        kvf_router_oai_error_set(&e, 400, "invalid_request_error", "stop", "no_tokenizer",
                                 "'stop' strings need a tokenizer and model '%s' has none", h->served);
        goto fail;
    }
    if (build_prompt(h, r, &e) != KVF_OK)
        goto fail;
    if (r->n_prompt == 0) {
        kvf_router_oai_error_set(&e, 400, "invalid_request_error", "prompt", "invalid_value",
                                 "the prompt is empty after tokenization");
        goto fail;
    }
    int64_t room = (int64_t)h->max_len - (int64_t)r->n_prompt;
    r->max_tokens = r->oai.max_tokens ? r->oai.max_tokens
                    : kind == KVF_ROUTER_OAI_COMPLETIONS ? 16 : (int32_t)(room > 0 ? room : 1);
    if ((int64_t)r->n_prompt + r->max_tokens > h->max_len) {
        kvf_router_oai_error_set(&e, 400, "invalid_request_error",
                                 kind == KVF_ROUTER_OAI_CHAT ? "messages" : "prompt", "context_length_exceeded",
                                 "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                                 "(%zu in the prompt, %d in the completion). Please reduce the prompt or max_tokens.",
                                 h->max_len, (long long)r->n_prompt + r->max_tokens, r->n_prompt, r->max_tokens);
        goto fail;
    }
    for (size_t i = 0; i < r->oai.n_stop; i++)
        if (strlen(r->oai.stop[i]) > r->max_stop)
            r->max_stop = strlen(r->oai.stop[i]);
    kvf_metric_add(h->m_prompt_tokens, (double)r->n_prompt);

    /* Block hashes for the kv policy (cheap: one pass over the prompt). */
    kvf_router_watch_sync(h->watch);
    int32_t bs = kvf_router_fleet_block_size(h->fleet);
    if (kvf_router_watch_pool(h->watch, KVF_ROUTER_ROLE_DECODE) && h->policy != KVF_ROUTER_POLICY_ROUND_ROBIN && bs > 0 &&
        (r->hashes = malloc((r->n_prompt / (size_t)bs + 1) * sizeof *r->hashes))) {
        const char *salt = r->oai.cache_salt ? r->oai.cache_salt : "";
        uint64_t root = kvf_kv_hash_root(kvf_router_watch_worker(h->watch, KVF_ROUTER_ROLE_DECODE, 0)->model_id, salt, strlen(salt));
        r->n_blocks = kvf_kv_hash_blocks(root, r->prompt, r->n_prompt, bs, r->hashes);
    }
    if (pick_workers(h, r, &e, &retry_after) != KVF_OK)
        goto fail;

    r->seqs = calloc((size_t)r->oai.n, sizeof *r->seqs);
    if (!r->seqs) {
        kvf_router_oai_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    kvf_err err = {0};
    for (int32_t i = 0; i < r->oai.n; i++) {
        kvf_sbuf_init(&r->seqs[i].text);
        if (h->tok && kvf_model_detok_create(h->tok, r->oai.skip_special_tokens, &r->seqs[i].detok, &err) != KVF_OK) {
            kvf_router_oai_error_set(&e, 500, "server_error", NULL, NULL, "%s", err.msg);
            goto fail;
        }
    }
    /* Open Generate, trying other decode workers when one cannot even start the call. */
    for (;;) {
        if (open_stream(h, r, &err) == KVF_OK)
            break;
        kvf_router_fleet_mark_failed(h->fleet, KVF_ROUTER_ROLE_DECODE, r->worker);
        if (++r->attempts >= h->cfg.max_attempts || pick_workers(h, r, &e, &retry_after) != KVF_OK) {
            if (r->attempts >= h->cfg.max_attempts)
                kvf_router_oai_error_set(&e, 503, "server_error", NULL, "worker_failed", "%s", err.msg);
            retry_after = 1;
            goto fail;
        }
    }
    r->ev = ev;
    r->next = h->reqs;
    if (h->reqs)
        h->reqs->prev = r;
    h->reqs = r;
    h->n_reqs++;
    kvf_metric_set(h->m_inflight, (double)h->n_reqs);
    struct evhttp_connection *c = evhttp_request_get_connection(ev);
    if (c)
        evhttp_connection_set_closecb(c, on_close, r);
    if (r->oai.stream) {
        struct evkeyvalq *oh = evhttp_request_get_output_headers(ev);
        evhttp_add_header(oh, "Content-Type", "text/event-stream");
        evhttp_add_header(oh, "Cache-Control", "no-cache");
        evhttp_add_header(oh, "x-request-id", r->id);
        evhttp_send_reply_start(ev, 200, "OK");
    }
    return;
fail:
    send_error(h, ev, r->id, &e, retry_after);
    r->ev = NULL;
    r->worker = -1;
    r->h->n_reqs++; /* rq_free counts it down */
    rq_free(r);
}

/* ---------------------------------------------------------------------------------------- */
/* The other endpoints                                                                       */

static void send_text(kvf_router_http *h, struct evhttp_request *ev, int code, const char *ctype,
                      const char *text, size_t len)
{
    evhttp_add_header(evhttp_request_get_output_headers(ev), "Content-Type", ctype);
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, text, len);
    evhttp_send_reply(ev, code, reason_of(code), b);
    evbuffer_free(b);
    count_status(h, code);
}

static void on_request(struct evhttp_request *ev, void *arg)
{
    kvf_router_http *h = arg;
    const char *uri = evhttp_request_get_uri(ev);
    if (!uri) {
        /* libevent calls back again, without a URI, when a connection fails with a buffer
         * error: a request of ours is answered when its turn comes; others get a 400 */
        for (rq *r = h->reqs; r; r = r->next)
            if (r->ev == ev) {
                on_close(NULL, r);
                return;
            }
        evhttp_send_error(ev, 400, NULL);
        return;
    }
    char path[256];
    size_t n = strcspn(uri, "?");
    snprintf(path, sizeof path, "%.*s", (int)(n < sizeof path ? n : sizeof path - 1), uri);
    if (strcmp(path, "/v1/completions") == 0) {
        handle_generate(h, ev, KVF_ROUTER_OAI_COMPLETIONS);
    } else if (strcmp(path, "/v1/chat/completions") == 0) {
        handle_generate(h, ev, KVF_ROUTER_OAI_CHAT);
    } else if (strcmp(path, "/health") == 0) {
        send_text(h, ev, 200, "text/plain", "ok\n", 3);
    } else if (strcmp(path, "/ready") == 0) {
        /* Ready when a decode worker answers and, under the kv policy, every worker's snapshot
         * is in the index: a restarted router does not route blind. */
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
        send_text(h, ev, n_up && !unsynced ? 200 : 503, "text/plain", b, (size_t)len);
    } else if (strcmp(path, "/metrics") == 0) {
        kvf_router_watch_sync(h->watch);
        if (h->policy == KVF_ROUTER_POLICY_KV)
            kvf_router_watch_health(h->watch);
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        kvf_metrics_render(h->metrics, &b);
        send_text(h, ev, 200, "text/plain; version=0.0.4", b.data ? b.data : "", b.len);
        kvf_sbuf_fini(&b);
    } else if (strcmp(path, "/v1/models") == 0) {
        json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:i}", "id", h->served, "object", "model", "created",
                              (json_int_t)wall_s(), "owned_by", "kvfleet", "max_model_len", h->max_len);
        json_t *o = json_pack("{s:s,s:[o]}", "object", "list", "data", m);
        char *s = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        send_json(h, ev, 200, "OK", NULL, s ? s : "{}", s ? strlen(s) : 2);
        free(s);
    } else {
        kvf_router_oai_error e;
        kvf_router_oai_error_set(&e, 404, "invalid_request_error", NULL, "not_found",
                                 "no route %s (try /v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics)",
                                 path);
        send_error(h, ev, NULL, &e, 0);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Life cycle                                                                                */

static void on_stop(evutil_socket_t fd, short what, void *arg)
{
    kvf_router_http *h = arg;
    (void)fd;
    (void)what;
    kvf_log(KVF_LOG_INFO, "router: stopping");
    event_base_loopbreak(h->base);
}

static kvf_status add_metrics(kvf_router_http *h, kvf_err *err)
{
    static const double lat[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
    kvf_status st;
    if ((st = kvf_metrics_create(&h->metrics)) != KVF_OK)
        return kvf_err_set(err, st, "router: metrics: out of memory");
#define C(var, name, labels, help)                                                                 \
    if ((st = kvf_metrics_counter(h->metrics, name, labels, help, &h->var, err)) != KVF_OK)        \
        return st;
#define G(var, name, labels, help)                                                                 \
    if ((st = kvf_metrics_gauge(h->metrics, name, labels, help, &h->var, err)) != KVF_OK)          \
        return st;
    C(m_requests, "kvfleet_router_requests_total", NULL, "generation requests received")
    C(m_2xx, "kvfleet_router_responses_total", "code=\"2xx\"", "answers by status class")
    C(m_4xx, "kvfleet_router_responses_total", "code=\"4xx\"", "answers by status class")
    C(m_5xx, "kvfleet_router_responses_total", "code=\"5xx\"", "answers by status class")
    C(m_retries, "kvfleet_router_retries_total", NULL, "requests moved to another decode worker (before the first token, or mid-stream with n = 1)")
    C(m_disconnects, "kvfleet_router_client_disconnects_total", NULL, "requests cancelled because the client went away")
    C(m_gen_tokens, "kvfleet_router_generated_tokens_total", NULL, "tokens streamed from decode workers")
    C(m_prompt_tokens, "kvfleet_router_prompt_tokens_total", NULL, "prompt tokens routed")
    G(m_inflight, "kvfleet_router_requests_in_flight", NULL, "generation requests in flight")
    C(m_wake_stream, "kvfleet_router_loop_wakeups_total", "cause=\"stream\"",
      "event-loop passes over the streams: woken by a stream (a message or its end arrived, or a client left) or by the safety timer")
    C(m_wake_timer, "kvfleet_router_loop_wakeups_total", "cause=\"timer\"",
      "event-loop passes over the streams: woken by a stream (a message or its end arrived, or a client left) or by the safety timer")
#undef C
#undef G
    if ((st = kvf_metrics_histogram(h->metrics, "kvfleet_router_ttft_seconds", NULL, "time to first token",
                                    lat, sizeof lat / sizeof lat[0], &h->m_ttft, err)) != KVF_OK ||
        (st = kvf_metrics_histogram(h->metrics, "kvfleet_router_request_seconds", NULL, "whole request time",
                                    lat, sizeof lat / sizeof lat[0], &h->m_e2e, err)) != KVF_OK)
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
        if ((st = kvf_model_tokenizer_load(h->cfg.model, &h->tok, err)) != KVF_OK)
            return kvf_err_prefix(err, "router");
        h->eos_ids = kvf_model_tokenizer_eos_ids(h->tok, &h->n_eos);
        kvf_err terr = {0};
        if (kvf_model_chat_template_load(h->cfg.model, h->cfg.chat_family, false, NULL, &h->tmpl, &terr) != KVF_OK) {
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
    if ((st = kvf_router_policy_parse(cfg->policy ? cfg->policy : "round-robin", &h->policy, err)) != KVF_OK ||
        (st = add_metrics(h, err)) != KVF_OK || (st = load_model(h, err)) != KVF_OK)
        goto fail;
    evthread_use_pthreads();
    h->base = event_base_new();
    h->http = h->base ? evhttp_new(h->base) : NULL;
    if (!h->http) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "router: cannot create the event loop");
        goto fail;
    }
    evhttp_set_allowed_methods(h->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD);
    evhttp_set_max_body_size(h->http, 64 << 20);
    evhttp_set_gencb(h->http, on_request, h);
    struct evhttp_bound_socket *sock =
        evhttp_bind_socket_with_handle(h->http, cfg->host ? cfg->host : "127.0.0.1", (ev_uint16_t)cfg->port);
    if (!sock) {
        st = kvf_err_set(err, KVF_ERR_IO, "router: cannot listen on %s:%d (in use, or not an address of this host)",
                         cfg->host ? cfg->host : "127.0.0.1", cfg->port);
        goto fail;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(evhttp_bound_socket_get_fd(sock), (struct sockaddr *)&ss, &sl);
    h->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    h->wake_ev = event_new(h->base, -1, 0, on_wake, h);
    h->safety_ev = event_new(h->base, -1, EV_PERSIST, on_safety, h);
    h->stop_ev = event_new(h->base, -1, 0, on_stop, h);
    struct timeval stv = {0, SAFETY_MS * 1000};
    if (!h->wake_ev || !h->safety_ev || !h->stop_ev || event_add(h->safety_ev, &stv) != 0) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "router: cannot create the loop's events");
        goto fail;
    }
    if (cfg->handle_signals) {
        h->sig_int = evsignal_new(h->base, SIGINT, on_stop, h);
        h->sig_term = evsignal_new(h->base, SIGTERM, on_stop, h);
        evsignal_add(h->sig_int, NULL);
        evsignal_add(h->sig_term, NULL);
    }
    if ((st = kvf_router_fleet_create(&cfg->fleet, &h->fleet, err)) != KVF_OK ||
        (st = kvf_router_watch_create(h->fleet, h->policy, h->metrics, h, &h->watch, err)) != KVF_OK)
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

void kvf_router_http_destroy(kvf_router_http *h)
{
    if (!h)
        return;
    while (h->reqs) {
        rq *r = h->reqs;
        detach(r);
        /* evhttp_free frees the requests still on a connection. One whose client left (the loop
         * stopped between on_close and the pass that would have answered it) is no longer on
         * any: libevent handed it to us, so it is ours to free. */
        if (r->ev && !evhttp_request_get_connection(r->ev))
            evhttp_request_free(r->ev);
        r->ev = NULL;
        rq_free(r);
    }
    kvf_router_watch_destroy(h->watch); /* its streams go before the fleet's channels */
    if (h->http)
        evhttp_free(h->http);
    if (h->wake_ev)
        event_free(h->wake_ev);
    if (h->safety_ev)
        event_free(h->safety_ev);
    if (h->stop_ev)
        event_free(h->stop_ev);
    if (h->sig_int)
        event_free(h->sig_int);
    if (h->sig_term)
        event_free(h->sig_term);
    if (h->base)
        event_base_free(h->base);
    kvf_router_fleet_destroy(h->fleet);
    kvf_model_chat_template_destroy(h->tmpl);
    kvf_model_tokenizer_destroy(h->tok);
    kvf_metrics_destroy(h->metrics);
    free(h->served);
    free(h);
}
