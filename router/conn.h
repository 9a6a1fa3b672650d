/* conn.h: the router's client connections, inside router/ only: the listening socket, a count
 * of open connections with a limit, idle connections closed, and the limits on a request's head
 * and body enforced on the wire before evhttp reads them. The requests themselves are http.c's.
 *
 * Policy (README "Client limits"):
 * - At --max-connections, a new connection closes the connection idle longest (no request in
 *   flight on it). When every connection holds a request in flight, up to CONN_RESERVE more
 *   are admitted for probes only (GET /health, /ready, /metrics; anything else gets 503), then
 *   the listener pauses until a connection closes.
 * - At the file-descriptor limit (EMFILE/ENFILE on accept) an idle connection is closed, and the
 *   pending one is accepted on a spare descriptor and closed at once: no busy loop.
 * - A request head over --max-header-bytes gets 431, a Content-Length over --max-body-bytes
 *   413, both OpenAI JSON errors sent before the body is read; the connection then discards
 *   what the client still sends and closes.
 * - These events are logged in one line at most every 10 s, with counts. */
#ifndef KVF_ROUTER_CONN_H
#define KVF_ROUTER_CONN_H

#include <stdbool.h>
#include <stdint.h>

#include "common/metrics.h"
#include "common/status.h"

struct event_base;
struct evhttp;
struct evhttp_request;

typedef struct kvf_router_conns_cfg {
    const char *host;          /* address to listen on */
    int32_t port;              /* 0: a free one */
    int32_t max_connections;   /* 0: min(4096, RLIMIT_NOFILE - a reserve) */
    int64_t idle_timeout_ms;   /* 0: 60000 */
    int64_t max_header_bytes;  /* request line + headers; 0: 16384 */
    int64_t max_body_bytes;    /* Content-Length; 0: 8 MiB */
    kvf_metrics *metrics;      /* the connection metrics are registered here */
} kvf_router_conns_cfg;

typedef struct kvf_router_conns kvf_router_conns;

/* Binds host:port and hands every admitted connection to http. *port_out: the port bound. */
kvf_status kvf_router_conns_create(struct event_base *base, struct evhttp *http,
                                   const kvf_router_conns_cfg *cfg, kvf_router_conns **out,
                                   int *port_out, kvf_err *err);
/* Loop thread, about every 100 ms: closes idle connections, resumes a paused listener, logs. */
void kvf_router_conns_sweep(kvf_router_conns *cs);
/* Loop thread: a generation request is (busy) or is no longer in flight on req's connection;
 * a busy connection is never closed for idleness. */
void kvf_router_conns_busy(kvf_router_conns *cs, struct evhttp_request *req, bool busy);
/* Loop thread, when the router drains: the listener closes for good and idle connections are
 * shut (connections with a request in flight keep going). */
void kvf_router_conns_close(kvf_router_conns *cs);
/* Loop thread: connections whose answer still has bytes not handed to the socket. */
int64_t kvf_router_conns_unsent(const kvf_router_conns *cs);
/* After evhttp_free and event_base_free (connections freed then still report here). */
void kvf_router_conns_destroy(kvf_router_conns *cs); /* NULL is fine */

#endif
