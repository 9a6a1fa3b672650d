/* conn.c: the router's client connections (conn.h): our own listener handed to evhttp, each
 * accepted connection read through a libevent filter bufferevent that counts it from accept to
 * free, keeps it on an idle list (oldest first) and frames requests on the wire to refuse heads
 * and bodies over the limits before evhttp reads them. The requests are http.c's. */
#include "router/conn.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/listener.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "common/sbuf.h"
#include "common/time.h"
#include "router/frame.h"
#include "router/openai.h"

#define CONN_RESERVE 16        /* connections over the limit, for probes, when none is idle */
#define BACKLOG 256            /* listen(2) backlog */
#define LOG_EVERY_S 10.0       /* the limits' summary line, at most this often */
#define LINGER_NS 2000000000LL /* a refused connection discards input this long, then closes */
#define PAUSE_NS 100000000LL   /* the listener rests this long when accept finds no descriptor */

typedef enum { ST_HEAD, ST_BODY, ST_CHUNKS, ST_PASS, ST_DISCARD } conn_state;
typedef enum { L_NONE, L_IDLE, L_DOOMED } conn_list;

typedef struct conn {
    kvf_router_conns *cs;
    struct bufferevent *bev, *sock; /* the filter evhttp uses; the socket under it */
    struct event *kick, *wev;       /* output added; the socket writable again: flush_out */
    bool flushing;                  /* inside flush_out: conn_out may send */
    int fd;                         /* -1 until the first byte */
    int64_t last_ns;                /* last byte in or out */
    int64_t close_at_ns;            /* ST_DISCARD: shut down then */
    int64_t body_left;              /* ST_BODY: bytes of the current body still to pass */
    kvf_router_chunks chunks;       /* ST_CHUNKS: the chunked body passing */
    conn_state st;
    conn_list list;
    bool busy;    /* a generation request in flight: never closed as idle */
    bool reserve; /* admitted over the limit: probes only */
    bool shut;    /* shut down by us; freed when evhttp reads the end */
    struct conn *prev, *next;
} conn;

struct kvf_router_conns {
    kvf_router_conns_cfg cfg;
    struct evconnlistener *lis;
    int64_t nofile;
    bool paused;
    int64_t resume_at_ns; /* a pause for want of descriptors ends then (0: when room frees) */
    bool closed;          /* kvf_router_conns_close: the listener stays off */
    int64_t n, n_shut;    /* connections open (accepted, not yet freed); those shut by us */
    conn *idle_head, *idle_tail, *doomed;
    conn **by_fd;
    size_t cap_fd;
    int spare_fd; /* closed to accept (and close) a connection at the descriptor limit */
    /* since the last summary line */
    int64_t c_evicted, c_reserve, c_paused, c_fd, c_head, c_body, c_bad, c_probe_only;
    double last_log;
    kvf_metric *m_open, *m_idle, *m_evicted, *m_fd, *m_head, *m_body, *m_bad, *m_probe_only;
};

/* ---------------------------------------------------------------------------------------- */
/* Lists                                                                                     */

static void list_del(kvf_router_conns *cs, conn *k)
{
    if (k->list == L_IDLE) {
        if (k->prev)
            k->prev->next = k->next;
        else
            cs->idle_head = k->next;
        if (k->next)
            k->next->prev = k->prev;
        else
            cs->idle_tail = k->prev;
    } else if (k->list == L_DOOMED) {
        if (k->prev)
            k->prev->next = k->next;
        else
            cs->doomed = k->next;
        if (k->next)
            k->next->prev = k->prev;
    }
    k->prev = k->next = NULL;
    k->list = L_NONE;
}

static void list_idle_append(kvf_router_conns *cs, conn *k)
{
    k->prev = cs->idle_tail;
    k->next = NULL;
    if (cs->idle_tail)
        cs->idle_tail->next = k;
    else
        cs->idle_head = k;
    cs->idle_tail = k;
    k->list = L_IDLE;
}

static void list_doomed_add(kvf_router_conns *cs, conn *k)
{
    k->prev = NULL;
    k->next = cs->doomed;
    if (cs->doomed)
        cs->doomed->prev = k;
    cs->doomed = k;
    k->list = L_DOOMED;
}

/* Bytes moved: the connection is the newest on the idle list (unless busy or refused). */
static void touch(conn *k)
{
    kvf_router_conns *cs = k->cs;
    k->last_ns = kvf_now_ns();
    if (k->fd < 0) {
        int fd = (int)bufferevent_getfd(k->bev);
        if (fd >= 0 && (size_t)fd >= cs->cap_fd) {
            size_t cap = cs->cap_fd ? cs->cap_fd : 1024;
            while (cap <= (size_t)fd)
                cap *= 2;
            conn **m = realloc(cs->by_fd, cap * sizeof *m);
            if (m) {
                memset(m + cs->cap_fd, 0, (cap - cs->cap_fd) * sizeof *m);
                cs->by_fd = m;
                cs->cap_fd = cap;
            }
        }
        if (fd >= 0 && (size_t)fd < cs->cap_fd) {
            cs->by_fd[fd] = k;
            k->fd = fd;
        }
    }
    if (k->list == L_IDLE && cs->idle_tail != k) {
        list_del(cs, k);
        list_idle_append(cs, k);
    }
}

/* Shuts k down; evhttp reads the end and frees it (conn_freed). */
static void shut(conn *k)
{
    kvf_router_conns *cs = k->cs;
    list_del(cs, k);
    if (k->shut)
        return;
    k->shut = true;
    cs->n_shut++;
    evutil_socket_t fd = bufferevent_getfd(k->bev);
    if (fd >= 0)
        shutdown(fd, SHUT_RDWR);
}

/* ---------------------------------------------------------------------------------------- */
/* The summary line                                                                          */

static void maybe_log(kvf_router_conns *cs, bool now_or_later)
{
    if (!(cs->c_evicted | cs->c_reserve | cs->c_paused | cs->c_fd | cs->c_head | cs->c_body | cs->c_bad | cs->c_probe_only))
        return;
    double now = kvf_now_s();
    if (!now_or_later && now - cs->last_log < LOG_EVERY_S)
        return;
    if (cs->last_log > 0 && now - cs->last_log < LOG_EVERY_S)
        return;
    kvf_log(KVF_LOG_WARN,
            "router: too many connections or too large requests (last %.0f s; %lld open, --max-connections=%d, "
            "RLIMIT_NOFILE %lld): %lld idle connections closed to admit new ones, %lld admitted for probes only, "
            "%lld non-probe requests refused on those, listener paused %lld times, accept out of descriptors "
            "%lld times, %lld heads over --max-header-bytes=%lld, %lld bodies over --max-body-bytes=%lld, %lld "
            "malformed requests",
            cs->last_log > 0 ? now - cs->last_log : 0.0, (long long)cs->n, cs->cfg.max_connections,
            (long long)cs->nofile, (long long)cs->c_evicted, (long long)cs->c_reserve,
            (long long)cs->c_probe_only, (long long)cs->c_paused, (long long)cs->c_fd, (long long)cs->c_head,
            (long long)cs->cfg.max_header_bytes, (long long)cs->c_body, (long long)cs->cfg.max_body_bytes,
            (long long)cs->c_bad);
    cs->last_log = now;
    cs->c_evicted = cs->c_reserve = cs->c_paused = cs->c_fd = cs->c_head = cs->c_body = cs->c_bad = cs->c_probe_only = 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Requests on the wire: heads and bodies over the limits                                    */

/* Answers an OpenAI JSON error straight on the socket (evhttp never sees this request), then
 * discards what the client still sends for LINGER_NS (so it reads the answer, not a reset). */
static void refuse(conn *k, int code, const char *reason, const char *ecode, const char *msg)
{
    kvf_router_oai_error e;
    kvf_router_oai_error_set(&e, code, code >= 500 ? "server_error" : "invalid_request_error", NULL, ecode, "%s",
                             msg);
    kvf_sbuf body;
    kvf_sbuf_init(&body);
    kvf_router_oai_error_json(&e, &body);
    char head[256];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n\r\n",
                     code, reason, body.len);
    bufferevent_write(k->sock, head, (size_t)n);
    bufferevent_write(k->sock, body.data ? body.data : "", body.len);
    kvf_sbuf_fini(&body);
    k->st = ST_DISCARD;
    k->close_at_ns = kvf_now_ns() + LINGER_NS;
    list_del(k->cs, k);
    list_doomed_add(k->cs, k);
}

/* 413: a body over --max-body-bytes (len: its Content-Length; -1: chunked, seen going over). */
static void refuse_body(conn *k, int64_t len)
{
    kvf_router_conns *cs = k->cs;
    char msg[256];
    cs->c_body++;
    kvf_metric_add(cs->m_body, 1);
    if (len >= 0)
        snprintf(msg, sizeof msg, "the request body is %lld bytes; this server takes at most %lld (--max-body-bytes)",
                 (long long)len, (long long)cs->cfg.max_body_bytes);
    else
        snprintf(msg, sizeof msg, "the chunked request body is over %lld bytes, the most this server takes "
                 "(--max-body-bytes)", (long long)cs->cfg.max_body_bytes);
    refuse(k, 413, "Payload Too Large", "request_too_large", msg);
}

/* 400: not HTTP/1.x framing we read the same way evhttp would. */
static void refuse_bad(conn *k, const char *why)
{
    k->cs->c_bad++;
    kvf_metric_add(k->cs->m_bad, 1);
    refuse(k, 400, "Bad Request", "invalid_request", why);
}

/* A complete head is at the start of src (f): refuse it or pass it on to evhttp. */
static void on_head(conn *k, struct evbuffer *src, struct evbuffer *dst, const kvf_router_frame *f)
{
    kvf_router_conns *cs = k->cs;
    char msg[256];
    switch (f->kind) {
    case KVF_FRAME_HEAD_LARGE:
        cs->c_head++;
        kvf_metric_add(cs->m_head, 1);
        snprintf(msg, sizeof msg, "the request line and headers exceed %lld bytes (--max-header-bytes)",
                 (long long)cs->cfg.max_header_bytes);
        refuse(k, 431, "Request Header Fields Too Large", "request_header_fields_too_large", msg);
        return;
    case KVF_FRAME_BAD:
        refuse_bad(k, f->why);
        return;
    case KVF_FRAME_BODY_LARGE:
        refuse_body(k, f->body_len);
        return;
    default:
        break;
    }
    if (k->reserve && !f->probe) {
        cs->c_probe_only++;
        kvf_metric_add(cs->m_probe_only, 1);
        snprintf(msg, sizeof msg,
                 "the router is at --max-connections=%d with a request in flight on every connection; retry later",
                 cs->cfg.max_connections);
        refuse(k, 503, "Service Unavailable", "too_many_connections", msg);
        return;
    }
    evbuffer_remove_buffer(src, dst, f->head_len);
    if (f->chunked) {
        k->st = ST_CHUNKS;
        memset(&k->chunks, 0, sizeof k->chunks);
    } else if (f->body_len > 0) {
        k->st = ST_BODY;
        k->body_left = f->body_len;
    }
}

static enum bufferevent_filter_result conn_in(struct evbuffer *src, struct evbuffer *dst, ev_ssize_t lim,
                                              enum bufferevent_flush_mode mode, void *ctx)
{
    conn *k = ctx;
    kvf_router_conns *cs = k->cs;
    (void)lim, (void)mode;
    touch(k);
    for (;;) {
        size_t avail = evbuffer_get_length(src);
        if (!avail)
            return BEV_OK;
        switch (k->st) {
        case ST_PASS:
            evbuffer_add_buffer(dst, src);
            return BEV_OK;
        case ST_DISCARD:
            evbuffer_drain(src, avail);
            return BEV_OK;
        case ST_BODY: {
            size_t n = avail < (size_t)k->body_left ? avail : (size_t)k->body_left;
            evbuffer_remove_buffer(src, dst, n);
            k->body_left -= (int64_t)n;
            if (!k->body_left)
                k->st = ST_HEAD;
            continue;
        }
        case ST_HEAD: {
            size_t look = avail < (size_t)cs->cfg.max_header_bytes + 3 ? avail : (size_t)cs->cfg.max_header_bytes + 3;
            const char *p = (const char *)evbuffer_pullup(src, (ev_ssize_t)look);
            if (!p) { /* out of memory: evhttp reads the rest unframed */
                k->st = ST_PASS;
                continue;
            }
            kvf_router_frame f;
            kvf_router_frame_head(p, look, cs->cfg.max_header_bytes, cs->cfg.max_body_bytes, &f);
            if (f.kind == KVF_FRAME_MORE)
                return BEV_NEED_MORE;
            on_head(k, src, dst, &f);
            continue;
        }
        case ST_CHUNKS: {
            struct evbuffer_iovec v;
            if (evbuffer_peek(src, -1, NULL, &v, 1) < 1)
                return BEV_OK;
            size_t used = 0;
            kvf_router_chunks_result r = kvf_router_chunks_feed(&k->chunks, v.iov_base, v.iov_len, cs->cfg.max_body_bytes,
                                                                cs->cfg.max_header_bytes, &used);
            evbuffer_remove_buffer(src, dst, used);
            if (r == KVF_CHUNKS_DONE)
                k->st = ST_HEAD;
            else if (r == KVF_CHUNKS_LARGE)
                refuse_body(k, -1);
            else if (r == KVF_CHUNKS_BAD)
                refuse_bad(k, "the chunked body is malformed");
            continue;
        }
        }
    }
}

static void flush_out(evutil_socket_t fd, short what, void *arg);

static enum bufferevent_filter_result conn_out(struct evbuffer *src, struct evbuffer *dst, ev_ssize_t lim,
                                               enum bufferevent_flush_mode mode, void *ctx)
{
    conn *k = ctx;
    (void)dst, (void)lim, (void)mode;
    if (!evbuffer_get_length(src))
        return BEV_OK;
    if (!k->flushing) {
        event_active(k->kick, EV_TIMEOUT, 1);
        return BEV_NEED_MORE;
    }
    touch(k);
    evutil_socket_t fd = bufferevent_getfd(k->sock);
    while (fd >= 0 && evbuffer_get_length(src)) {
        /* send(MSG_NOSIGNAL), not evbuffer_write (writev): a client gone mid-answer must be an
         * EPIPE here, not a SIGPIPE that kills the process hosting the router */
        size_t chunk = evbuffer_get_contiguous_space(src);
        const unsigned char *p = evbuffer_pullup(src, (ev_ssize_t)chunk);
        ssize_t n = p ? send(fd, p, chunk, MSG_NOSIGNAL) : -1;
        if (n > 0) {
            evbuffer_drain(src, (size_t)n);
            continue;
        }
        int e = EVUTIL_SOCKET_ERROR();
        if (n < 0 && e == EINTR)
            continue;
        if (n < 0 && (e == EAGAIN || e == EWOULDBLOCK)) {
            if (!k->wev)
                k->wev = event_new(bufferevent_get_base(k->sock), fd, EV_WRITE, flush_out, k);
            if (k->wev)
                event_add(k->wev, NULL);
            return BEV_NEED_MORE;
        }
        /* The client is gone: what it would have read is dropped, and evhttp learns of the end
         * from the socket's read side (evhttp keeps reading while it writes). */
        evbuffer_drain(src, evbuffer_get_length(src));
        return BEV_ERROR;
    }
    return fd >= 0 ? BEV_OK : BEV_NEED_MORE;
}

/* The socket takes more, or evhttp added output: send what the filter holds (conn_out). */
static void flush_out(evutil_socket_t fd, short what, void *arg)
{
    conn *k = arg;
    (void)fd, (void)what;
    struct bufferevent *f = k->bev;
    if (!evbuffer_get_length(bufferevent_get_output(f)))
        return;
    /* evhttp's write callback may free the connection from inside the flush (k with it): the
     * reference keeps both until we are done */
    bufferevent_incref(f);
    k->flushing = true;
    bufferevent_flush(f, EV_WRITE, BEV_FLUSH);
    k->flushing = false;
    bufferevent_decref(f);
}

/* ---------------------------------------------------------------------------------------- */
/* Admission, and the end of a connection                                                    */

static void pause_listener(kvf_router_conns *cs, int64_t for_ns)
{
    if (!cs->paused) {
        evconnlistener_disable(cs->lis);
        cs->paused = true;
        cs->c_paused++;
    }
    cs->resume_at_ns = for_ns ? kvf_now_ns() + for_ns : 0;
}

/* The bufferevent under a connection is freed (evhttp freed the connection). */
static void conn_freed(void *ctx)
{
    conn *k = ctx;
    kvf_router_conns *cs = k->cs;
    list_del(cs, k);
    if (k->fd >= 0 && (size_t)k->fd < cs->cap_fd && cs->by_fd[k->fd] == k)
        cs->by_fd[k->fd] = NULL;
    if (k->shut)
        cs->n_shut--;
    cs->n--;
    kvf_metric_set(cs->m_open, (double)cs->n);
    if (k->kick)
        event_free(k->kick);
    if (k->wev)
        event_free(k->wev);
    free(k);
}

static void on_output_added(struct evbuffer *b, const struct evbuffer_cb_info *info, void *ctx)
{
    conn *k = ctx;
    (void)b;
    if (info->n_added)
        event_active(k->kick, EV_TIMEOUT, 1);
}

/* evhttp asks for the bufferevent of a connection just accepted: admit it. */
static struct bufferevent *conn_new(struct event_base *base, void *arg)
{
    kvf_router_conns *cs = arg;
    conn *k = calloc(1, sizeof *k);
    if (k)
        k->kick = event_new(base, -1, 0, flush_out, k);
    struct bufferevent *sock = k && k->kick ? bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE) : NULL;
    struct bufferevent *f =
        sock ? bufferevent_filter_new(sock, conn_in, conn_out, BEV_OPT_CLOSE_ON_FREE, conn_freed, k) : NULL;
    if (!f) {
        if (sock)
            bufferevent_free(sock);
        if (k && k->kick)
            event_free(k->kick);
        free(k);
        return NULL; /* evhttp makes its own: the connection goes uncounted (out of memory) */
    }
    /* Every addition to the output is sent from the loop by flush_out (see conn_out); libevent
     * itself runs the filter on an addition only while writing is enabled, and evhttp adds the
     * head of an answer before it enables writing. */
    evbuffer_add_cb(bufferevent_get_output(f), on_output_added, k);
    k->cs = cs;
    k->bev = f;
    k->sock = sock;
    k->fd = -1;
    k->last_ns = kvf_now_ns();
    int64_t live = cs->n - cs->n_shut;
    if (live >= cs->cfg.max_connections) {
        if (cs->idle_head) {
            shut(cs->idle_head); /* the connection idle longest makes room */
            cs->c_evicted++;
            kvf_metric_add(cs->m_evicted, 1);
        } else {
            k->reserve = true;
            cs->c_reserve++;
            if (live + 1 >= cs->cfg.max_connections + CONN_RESERVE)
                pause_listener(cs, 0); /* resumed by the sweep once connections close */
        }
        maybe_log(cs, true);
    }
    cs->n++;
    kvf_metric_set(cs->m_open, (double)cs->n);
    list_idle_append(cs, k);
    return f;
}

/* libevent calls the listener's error callback with evhttp's argument (its accept callback's),
 * so the connection sets are found by their evhttp here: the one table of this file, tiny,
 * written at create and destroy only. */
#define MAX_SERVERS 16
static pthread_mutex_t servers_lock = PTHREAD_MUTEX_INITIALIZER;
static struct server {
    const struct evhttp *http;
    kvf_router_conns *cs;
} servers[MAX_SERVERS];

static bool servers_add(const struct evhttp *http, kvf_router_conns *cs)
{
    bool ok = false;
    pthread_mutex_lock(&servers_lock);
    for (int i = 0; i < MAX_SERVERS && !ok; i++)
        if (!servers[i].http) {
            servers[i] = (struct server){http, cs};
            ok = true;
        }
    pthread_mutex_unlock(&servers_lock);
    return ok;
}

static kvf_router_conns *servers_find(const struct evhttp *http, kvf_router_conns *drop)
{
    kvf_router_conns *cs = NULL;
    pthread_mutex_lock(&servers_lock);
    for (int i = 0; i < MAX_SERVERS; i++)
        if ((http && servers[i].http == http) || (drop && servers[i].cs == drop)) {
            cs = servers[i].cs;
            if (drop)
                servers[i] = (struct server){NULL, NULL};
        }
    pthread_mutex_unlock(&servers_lock);
    return cs;
}

/* accept(2) failed. At the descriptor limit, up to 64 idle connections are closed (their
 * descriptors are free once evhttp reads their end, and the next accept succeeds); with none
 * idle, the pending connection is accepted on the spare descriptor and closed at once, and when
 * even that fails the listener rests until the sweep. Each failure does work: no busy loop. */
static void on_accept_error(struct evconnlistener *lis, void *arg)
{
    int e = EVUTIL_SOCKET_ERROR();
    kvf_router_conns *cs = servers_find(arg, NULL);
    if (!cs) {
        evconnlistener_disable(lis);
        return;
    }
    if (e == EMFILE || e == ENFILE) {
        cs->c_fd++;
        int n = 0;
        for (; cs->idle_head && n < 64; n++) { /* their descriptors free as evhttp reads their end */
            shut(cs->idle_head);
            cs->c_evicted++;
            kvf_metric_add(cs->m_evicted, 1);
        }
        int fd = -1;
        if (!n && cs->spare_fd >= 0) {
            close(cs->spare_fd);
            cs->spare_fd = -1;
            fd = accept(evconnlistener_get_fd(lis), NULL, NULL);
            if (fd >= 0) {
                close(fd);
                kvf_metric_add(cs->m_fd, 1);
            }
            cs->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        }
        if (!n && (fd < 0 || cs->spare_fd < 0))
            pause_listener(cs, PAUSE_NS);
    } else {
        kvf_log(KVF_LOG_WARN, "router: accept: %s", strerror(e));
        pause_listener(cs, PAUSE_NS);
    }
    maybe_log(cs, true);
}

void kvf_router_conns_busy(kvf_router_conns *cs, struct evhttp_request *req, bool busy)
{
    struct evhttp_connection *ec = req ? evhttp_request_get_connection(req) : NULL;
    struct bufferevent *bev = ec ? evhttp_connection_get_bufferevent(ec) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (!cs || fd < 0 || (size_t)fd >= cs->cap_fd || !cs->by_fd[fd] || cs->by_fd[fd]->bev != bev)
        return;
    conn *k = cs->by_fd[fd];
    if (k->busy == busy || k->shut || k->st == ST_DISCARD)
        return;
    k->busy = busy;
    if (busy) {
        list_del(cs, k);
    } else {
        list_idle_append(cs, k);
        touch(k);
    }
}

void kvf_router_conns_sweep(kvf_router_conns *cs)
{
    int64_t now = kvf_now_ns();
    int64_t idle_ns = cs->cfg.idle_timeout_ms * 1000000;
    while (cs->idle_head && now - cs->idle_head->last_ns >= idle_ns) {
        shut(cs->idle_head);
        kvf_metric_add(cs->m_idle, 1);
    }
    for (conn *k = cs->doomed, *next; k; k = next) {
        next = k->next;
        if (now >= k->close_at_ns)
            shut(k);
    }
    if (cs->paused && !cs->closed && (cs->resume_at_ns ? now >= cs->resume_at_ns
                                        : cs->n - cs->n_shut < cs->cfg.max_connections + CONN_RESERVE)) {
        evconnlistener_enable(cs->lis);
        cs->paused = false;
    }
    maybe_log(cs, false);
}

void kvf_router_conns_close(kvf_router_conns *cs)
{
    if (cs->closed)
        return;
    cs->closed = true;
    evconnlistener_disable(cs->lis);
    while (cs->idle_head)
        shut(cs->idle_head);
}

int64_t kvf_router_conns_unsent(const kvf_router_conns *cs)
{
    int64_t n = 0;
    for (size_t fd = 0; fd < cs->cap_fd; fd++) {
        const conn *k = cs->by_fd[fd];
        if (k && !k->shut && k->st != ST_DISCARD &&
            (evbuffer_get_length(bufferevent_get_output(k->bev)) || evbuffer_get_length(bufferevent_get_output(k->sock))))
            n++;
    }
    return n;
}

/* ---------------------------------------------------------------------------------------- */
/* Life cycle                                                                                */

static kvf_status add_metrics(kvf_router_conns *cs, kvf_err *err)
{
    kvf_metrics *m = cs->cfg.metrics;
    static const char closed[] = "client connections the router closed";
    static const char refused[] = "requests refused on the wire before evhttp read them";
    kvf_status st;
    if ((st = kvf_metrics_gauge(m, "kvfleet_router_connections", NULL, "client connections open", &cs->m_open,
                                err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_connections_closed_total", "reason=\"idle\"", closed,
                                  &cs->m_idle, err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_connections_closed_total", "reason=\"limit\"", closed,
                                  &cs->m_evicted, err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_connections_refused_total", "reason=\"fd_limit\"",
                                  "connections accepted and closed at once for want of file descriptors", &cs->m_fd,
                                  err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_requests_refused_total", "reason=\"header_bytes\"", refused,
                                  &cs->m_head, err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_requests_refused_total", "reason=\"body_bytes\"", refused,
                                  &cs->m_body, err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_requests_refused_total", "reason=\"probes_only\"", refused,
                                  &cs->m_probe_only, err)) != KVF_OK ||
        (st = kvf_metrics_counter(m, "kvfleet_router_requests_refused_total", "reason=\"malformed\"", refused,
                                  &cs->m_bad, err)) != KVF_OK)
        return st;
    return KVF_OK;
}

kvf_status kvf_router_conns_create(struct event_base *base, struct evhttp *http,
                                   const kvf_router_conns_cfg *cfg, kvf_router_conns **out,
                                   int *port_out, kvf_err *err)
{
    const char *host = cfg->host ? cfg->host : "127.0.0.1";
    kvf_router_conns *cs = calloc(1, sizeof *cs);
    if (!cs)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    cs->cfg = *cfg;
    cs->spare_fd = -1;
    struct rlimit rl;
    cs->nofile = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? (int64_t)rl.rlim_cur : 1 << 20;
    /* Descriptors kept for everything else: gRPC channels, files, the accept backlog's overshoot. */
    int64_t keep = cs->nofile / 8 > 64 + BACKLOG ? cs->nofile / 8 : 64 + BACKLOG;
    int64_t fit = cs->nofile - keep - CONN_RESERVE;
    kvf_status st;
    if (cfg->max_connections < 0 || cfg->idle_timeout_ms < 0 || cfg->max_header_bytes < 0 || cfg->max_body_bytes < 0) {
        st = kvf_err_set(err, KVF_ERR_INVALID,
                         "router: --max-connections, --idle-timeout-ms, --max-header-bytes and --max-body-bytes "
                         "must be >= 0 (0: the default)");
        goto fail;
    }
    if (!cs->cfg.max_connections)
        cs->cfg.max_connections = (int32_t)(fit < 16 ? 16 : fit > 4096 ? 4096 : fit);
    else if (cs->cfg.max_connections > fit)
        kvf_log(KVF_LOG_WARN,
                "router: --max-connections=%d is more than RLIMIT_NOFILE (%lld) leaves room for (%lld): "
                "past that, accept finds no descriptor and new connections are refused",
                cs->cfg.max_connections, (long long)cs->nofile, (long long)(fit > 0 ? fit : 0));
    if (!cs->cfg.idle_timeout_ms)
        cs->cfg.idle_timeout_ms = 60000;
    if (!cs->cfg.max_header_bytes)
        cs->cfg.max_header_bytes = 16384;
    if (!cs->cfg.max_body_bytes)
        cs->cfg.max_body_bytes = 8 << 20;
    if ((st = add_metrics(cs, err)) != KVF_OK)
        goto fail;
    /* evhttp holds the same limits for what the framing passes through unchecked (chunked). */
    evhttp_set_max_headers_size(http, (ev_ssize_t)cs->cfg.max_header_bytes);
    evhttp_set_max_body_size(http, (ev_ssize_t)cs->cfg.max_body_bytes);
    evhttp_set_bevcb(http, conn_new, cs);

    char port[16];
    snprintf(port, sizeof port, "%d", cfg->port);
    struct evutil_addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                                    .ai_flags = EVUTIL_AI_PASSIVE | EVUTIL_AI_NUMERICSERV}, *ai = NULL;
    if (evutil_getaddrinfo(host, port, &hints, &ai) != 0 || !ai) {
        st = kvf_err_set(err, KVF_ERR_IO, "router: cannot listen on %s:%d (not an address of this host)", host,
                         cfg->port);
        goto fail;
    }
    cs->lis = evconnlistener_new_bind(base, NULL, NULL, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC,
                                      BACKLOG, ai->ai_addr, (int)ai->ai_addrlen);
    evutil_freeaddrinfo(ai);
    if (!cs->lis) {
        st = kvf_err_set(err, KVF_ERR_IO, "router: cannot listen on %s:%d (in use, or not an address of this host)",
                         host, cfg->port);
        goto fail;
    }
    if (!servers_add(http, cs)) {
        evconnlistener_free(cs->lis);
        st = kvf_err_set(err, KVF_ERR_LIMIT, "router: more than %d routers in one process", MAX_SERVERS);
        goto fail;
    }
    if (!evhttp_bind_listener(http, cs->lis)) {
        servers_find(NULL, cs);
        evconnlistener_free(cs->lis);
        evconnlistener_free(cs->lis);
        st = kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
        goto fail;
    }
    evconnlistener_set_error_cb(cs->lis, on_accept_error);
    cs->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(evconnlistener_get_fd(cs->lis), (struct sockaddr *)&ss, &sl);
    *port_out = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                               : ((struct sockaddr_in *)&ss)->sin_port);
    kvf_log(KVF_LOG_INFO,
            "router: client limits: %d connections (+%d for probes), idle %lld ms, head %lld bytes, body %lld bytes "
            "(RLIMIT_NOFILE %lld)",
            cs->cfg.max_connections, CONN_RESERVE, (long long)cs->cfg.idle_timeout_ms,
            (long long)cs->cfg.max_header_bytes, (long long)cs->cfg.max_body_bytes, (long long)cs->nofile);
    *out = cs;
    return KVF_OK;
fail:
    free(cs);
    return st;
}

void kvf_router_conns_destroy(kvf_router_conns *cs)
{
    if (!cs)
        return;
    servers_find(NULL, cs);
    if (cs->spare_fd >= 0)
        close(cs->spare_fd);
    free(cs->by_fd);
    free(cs);
}
