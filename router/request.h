/* request.h: the life of one generation request in the router, inside router/ only: prompt,
 * pick, Generate, streamed tokens to text and SSE, stop strings, retry before the first token,
 * the end (done, failed, client gone), usage. Loop thread only, but for the prompt: parsing,
 * the chat template and tokenizing run on prep threads of their own, so a large request never
 * stalls the loop. The HTTP glue (routing, replies, the loop) is http.c's; the pools are
 * watch.c's; membership is fleet.c's. */
#ifndef KVF_ROUTER_REQUEST_H
#define KVF_ROUTER_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/metrics.h"
#include "common/status.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "router/fleet.h"
#include "router/http_int.h"
#include "router/openai.h"
#include "router/toolcall.h"
#include "router/policy.h"
#include "router/watch.h"

/* The requests in flight, and one of them. */
typedef struct kvf_router_reqs kvf_router_reqs;
typedef struct kvf_router_req kvf_router_req;

/* What the requests borrow from the server for their whole life. */
typedef struct kvf_router_reqs_cfg {
    kvf_router_http *h;        /* answers go out through it (http_int.h); its loop reads streams */
    kvf_router_fleet *fleet;   /* the block size; a worker that fails a call is marked there */
    kvf_router_watch *watch;   /* the pools to pick from, the workers' addresses and channels */
    kvf_router_policy policy;
    kvf_metrics *metrics;      /* the request metrics are registered here */
    /* the model */
    const char *served;        /* the name clients send */
    int32_t max_len;           /* context length: prompt + completion */
    int32_t vocab_size;        /* config.json's */
    const kvf_text_tokenizer *tok;        /* NULL: token id prompts only */
    const kvf_text_chat_template *tmpl;   /* NULL: chat requests answer 400 with tmpl_err */
    const char *tmpl_err;
    kvf_router_toolcall_format tool_parser; /* how chat answers with tools are parsed for tool
                                               calls: none, hermes or llama3_json (resolved) */
    const int32_t *eos_ids;    /* [n_eos] stop tokens unless the request ignores EOS */
    size_t n_eos;
    /* limits */
    int32_t max_inflight;        /* requests per decode worker before it counts as saturated */
    int32_t max_attempts;        /* decode workers tried before the first token (>= 1) */
    int64_t request_timeout_ms;  /* whole-request deadline on the Generate call; 0: none */
    int64_t max_prompt_bytes;    /* a text prompt (after the chat template) longer than this cannot
                                  * fit the context whatever its tokens: 400 before tokenizing;
                                  * 0: no such bound */
    int32_t prep_threads;        /* threads that parse, template and tokenize (>= 1) */
} kvf_router_reqs_cfg;

/* Registers the request metrics (retries, disconnects, tokens, in flight, TTFT, request time)
 * and starts the prep threads. */
kvf_status kvf_router_reqs_create(const kvf_router_reqs_cfg *cfg, kvf_router_reqs **out,
                                  kvf_err *err);
/* Joins the prep threads (one busy tokenizing finishes that prompt first) and frees every
 * request still being prepared or in flight without answering it: the server is going away, and
 * evhttp_free answers nobody either. Before the fleet and the watch. NULL is fine. */
void kvf_router_reqs_destroy(kvf_router_reqs *rs);

/* A POSTed /v1/completions or /v1/chat/completions (body: len bytes of JSON, copied; id: the
 * request id). The body goes to a prep thread (parse, chat template, tokens); the loop picks the
 * request up again in kvf_router_reqs_pump, answers it when it is invalid or no worker can take
 * it, and otherwise opens Generate and answers later. */
/* tenant: the API key's tenant (NULL: none): part of the request's cache salt. */
void kvf_router_reqs_start(kvf_router_reqs *rs, kvf_router_client *c, kvf_router_oai_kind kind,
                           const char *id, const char *tenant, const char *body, size_t len);
/* A small request answered from the model's text pieces alone (POST /tokenize, /detokenize:
 * router/tokenize.h). It runs on a prep thread like a generation request's prompt, so a large
 * body never stalls the loop, and reads only the immutable pieces of cfg (tokenizer, template,
 * limits). run fills out with the 200 answer's JSON, or e with the error (its status). */
typedef struct kvf_router_prep_job {
    const char *name; /* for the log: "tokenize" */
    kvf_status (*run)(const kvf_router_reqs_cfg *cfg, const char *body, size_t len, kvf_sbuf *out,
                      kvf_router_oai_error *e);
} kvf_router_prep_job;
/* Queues job over the body (len bytes, copied) for client c; the loop answers it in
 * kvf_router_reqs_pump (a client that left gets nothing). Same queue bound as generation. */
void kvf_router_reqs_start_job(kvf_router_reqs *rs, kvf_router_client *c, const kvf_router_prep_job *job,
                               const char *id, const char *body, size_t len);
/* Starts the requests whose prompt a prep thread finished, then reads the Generate streams that
 * woke the loop (every one when `all`): tokens to the clients, ends answered, failed workers
 * replaced. Plain requests also look for clients that left. */
void kvf_router_reqs_pump(kvf_router_reqs *rs, bool all);
/* Requests started and not yet answered (being prepared or in flight). */
int64_t kvf_router_reqs_open(const kvf_router_reqs *rs);
/* The request in flight for client c, or NULL. */
kvf_router_req *kvf_router_reqs_find(kvf_router_reqs *rs, const kvf_router_client *c);
/* c's client went away: its Generate is cancelled now and the request is answered and freed on
 * the loop's next pass. */
void kvf_router_req_client_left(kvf_router_req *r);

#endif
