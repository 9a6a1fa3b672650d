/* http_int.h: what the router's HTTP layer (http.c) lends the files that serve it, inside
 * router/ only: the one loop's wake-up for the streams read on it, and the answer to one client.
 * libevent stays in http.c; the streams and what is answered are watch.c's and request.c's. */
#ifndef KVF_ROUTER_HTTP_INT_H
#define KVF_ROUTER_HTTP_INT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "router/http.h"
#include "router/openai.h"

/* One stream's wake-up: set on a completion-queue thread when the stream has something to read,
 * taken on the loop thread, which then reads the stream until it says "nothing now". */
typedef struct kvf_router_wake {
    kvf_router_http *h; /* whose loop to wake */
    atomic_bool ready;
} kvf_router_wake;

/* Marks the stream of `wake` (a kvf_router_wake) ready and wakes the loop. Any thread (it is
 * the callback given to kvf_rpc_stream_notify, called with the stream's lock held); it touches
 * nothing else of the router. The loop thread calls it too: a client left, a drain stopped. */
void kvf_router_wake_notify(void *wake);
/* Loop thread: whether the stream was marked ready since the last take; clears the mark. */
bool kvf_router_wake_take(kvf_router_wake *w);

/* One client's HTTP request: libevent's, opaque outside http.c. It lives until it is answered
 * (or, at shutdown, kvf_router_client_abandon). Loop thread only, as everything below. */
typedef struct evhttp_request kvf_router_client;
typedef struct kvf_router_req kvf_router_req; /* request.h */

/* Whole answers, counted in kvfleet_router_responses_total: a JSON body (with x-request-id
 * when req_id is given), or an OpenAI error (logged; Retry-After when retry_after_s > 0). */
void kvf_router_http_send_json(kvf_router_http *h, kvf_router_client *c, int code,
                               const char *req_id, const char *body, size_t len);
void kvf_router_http_send_error(kvf_router_http *h, kvf_router_client *c, const char *req_id,
                                const kvf_router_oai_error *e, int retry_after_s);
/* A streamed answer: 200 text/event-stream headers, then each kvf_router_client_sse_send is
 * one HTTP chunk, then the end, counted as `code` (200, or the error its last event carried). */
void kvf_router_client_sse_start(kvf_router_http *h, kvf_router_client *c, const char *req_id);
void kvf_router_client_sse_send(kvf_router_client *c, const char *data, size_t len);
void kvf_router_http_sse_end(kvf_router_http *h, kvf_router_client *c, int code);
/* The end for a client that left (not counted): a streamed answer's end, else 499. */
void kvf_router_client_send_gone(kvf_router_client *c, bool streaming);

/* Until c is answered, its connection's close calls kvf_router_req_client_left(r), and the
 * connection is never closed as idle; NULL forgets it (the connection may live on after the
 * answer). */
void kvf_router_client_on_close(kvf_router_http *h, kvf_router_client *c, kvf_router_req *r);
/* Whether c's client has left: peeks at the socket (0 bytes readable). libevent does not
 * always watch a connection for EOF while its request waits for an answer. */
bool kvf_router_client_left(kvf_router_client *c);
/* At shutdown, for a request never answered: frees c when no connection holds it any more
 * (libevent handed it over when its client left); evhttp_free frees the others. */
void kvf_router_client_abandon(kvf_router_client *c);

#endif
