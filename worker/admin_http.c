/* admin_http.c: the worker's admin port: a tiny HTTP/1.1 GET server on plain sockets, one thread
 * polling every connection at once, one request per connection (Connection: close). Enough for
 * Prometheus scrapes, probes and curl; what a path returns is the caller's (worker.c serves
 * /metrics and /health). A client that connects and sends nothing (or half a request) holds only
 * its own slot until its read deadline, so a probe never waits behind it; at the connection cap
 * the connection that has been reading longest is closed to make room. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "common/sbuf.h"
#include "common/time.h"
#include "worker/worker.h"

#define HTTP_HEAD_MAX 8192

typedef enum { CONN_FREE = 0, CONN_READING, CONN_WRITING } conn_state;

typedef struct http_conn {
    int fd;
    conn_state state;
    uint64_t seq;                  /* order of arrival */
    int64_t deadline_ns;           /* read deadline, then write deadline */
    size_t n;                      /* bytes of the request head in req */
    char req[HTTP_HEAD_MAX];
    kvf_sbuf out;                  /* the whole answer; off bytes of it sent */
    size_t off;
} http_conn;

struct kvf_worker_http {
    int fd, port;
    kvf_worker_http_opts opts;
    kvf_worker_http_fn fn;
    void *ctx;
    http_conn *conns;     /* [opts.max_conns] */
    uint64_t next_seq;
    struct pollfd *pfds;  /* [1 + opts.max_conns]: the listener, then one per slot */
    pthread_t thread;
    atomic_bool stop;
};

static void conn_close(http_conn *c)
{
    close(c->fd);
    c->fd = -1;
    c->state = CONN_FREE;
    c->n = 0;
    c->off = 0;
    kvf_sbuf_reset(&c->out);
}

/* Answers the request head in c->req (complete, cut at the size limit, or ended by the client's
 * EOF): the whole answer goes into c->out, to be sent as the socket takes it. */
static void conn_answer(kvf_worker_http *h, http_conn *c, int64_t now)
{
    c->req[c->n] = '\0';
    char method[16] = {0}, path[1024] = {0};
    kvf_sbuf body;
    kvf_sbuf_init(&body);
    int code;
    const char *ctype = "text/plain; charset=utf-8";
    if (sscanf(c->req, "%15s %1023s", method, path) != 2) {
        code = 400;
        kvf_sbuf_puts(&body, "bad request\n");
    } else if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        code = 405;
        kvf_sbuf_printf(&body, "method %s not allowed (use GET)\n", method);
    } else {
        char *q = strchr(path, '?');
        if (q)
            *q = '\0';
        code = h->fn(h->ctx, path, &body, &ctype);
    }
    const char *reason = code == 200 ? "OK" : code == 400 ? "Bad Request" : code == 404 ? "Not Found"
                       : code == 405 ? "Method Not Allowed" : code == 503 ? "Service Unavailable"
                                                                          : "Error";
    kvf_sbuf_reset(&c->out);
    kvf_sbuf_printf(&c->out, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                             "Connection: close\r\n\r\n", code, reason, ctype, body.len);
    if (strcmp(method, "HEAD") != 0 && body.len)
        kvf_sbuf_append(&c->out, body.data, body.len);
    kvf_sbuf_fini(&body);
    c->state = CONN_WRITING;
    c->off = 0;
    c->deadline_ns = now + (int64_t)h->opts.write_timeout_ms * 1000000;
}

/* Reads what the socket has; answers once the head is complete. */
static void conn_read(kvf_worker_http *h, http_conn *c, int64_t now)
{
    for (;;) {
        ssize_t k = recv(c->fd, c->req + c->n, sizeof c->req - 1 - c->n, MSG_DONTWAIT);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                conn_close(c);
            return;
        }
        if (k == 0) { /* the client is done sending: answer what came, if anything did */
            if (c->n == 0)
                conn_close(c);
            else
                conn_answer(h, c, now);
            return;
        }
        c->n += (size_t)k;
        c->req[c->n] = '\0';
        if (strstr(c->req, "\r\n\r\n") || strstr(c->req, "\n\n") || c->n == sizeof c->req - 1) {
            conn_answer(h, c, now);
            return;
        }
    }
}

/* Sends what the socket takes; closes once the answer is out. */
static void conn_write(http_conn *c)
{
    while (c->off < c->out.len) {
        ssize_t k = send(c->fd, c->out.data + c->off, c->out.len - c->off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (k <= 0)
            break;
        c->off += (size_t)k;
    }
    conn_close(c);
}

/* A free slot for a new connection; at the cap, the connection reading longest is closed. NULL
 * when every slot is writing an answer. */
static http_conn *conn_slot(kvf_worker_http *h)
{
    http_conn *oldest = NULL;
    for (int i = 0; i < h->opts.max_conns; i++) {
        http_conn *c = &h->conns[i];
        if (c->state == CONN_FREE)
            return c;
        if (c->state == CONN_READING && (!oldest || c->seq < oldest->seq))
            oldest = c;
    }
    if (oldest)
        conn_close(oldest);
    return oldest;
}

static void accept_all(kvf_worker_http *h, int64_t now)
{
    for (;;) {
        int fd = accept4(h->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            return; /* EAGAIN, or out of fds: the rest wait in the backlog */
        }
        http_conn *c = conn_slot(h);
        if (!c) {
            close(fd);
            continue;
        }
        c->fd = fd;
        c->state = CONN_READING;
        c->seq = h->next_seq++;
        c->deadline_ns = now + (int64_t)h->opts.read_timeout_ms * 1000000;
        c->n = 0;
        conn_read(h, c, now); /* the request may be there already */
        if (c->state == CONN_WRITING)
            conn_write(c);
    }
}

static void *http_main(void *arg)
{
    kvf_worker_http *h = arg;
    int cap = h->opts.max_conns;
    while (!atomic_load(&h->stop)) {
        /* 1. watch the listener and every open connection; sleep until the nearest deadline
         *    (at most 100 ms, to notice stop) */
        int64_t now = kvf_now_ns(), next = now + 100 * 1000000LL;
        h->pfds[0] = (struct pollfd){.fd = h->fd, .events = POLLIN};
        for (int i = 0; i < cap; i++) {
            http_conn *c = &h->conns[i];
            h->pfds[1 + i] = (struct pollfd){
                .fd = c->state == CONN_FREE ? -1 : c->fd,
                .events = c->state == CONN_WRITING ? POLLOUT : POLLIN};
            if (c->state != CONN_FREE && c->deadline_ns < next)
                next = c->deadline_ns;
        }
        int ms = next > now ? (int)((next - now + 999999) / 1000000) : 0;
        int r = poll(h->pfds, (nfds_t)(1 + cap), ms);
        if (r < 0 && errno != EINTR) {
            kvf_log(KVF_LOG_ERROR, "worker: admin HTTP: poll: %s", strerror(errno));
            break;
        }
        now = kvf_now_ns();
        /* 2. serve the connections that are ready, then close the ones past their deadline */
        for (int i = 0; r > 0 && i < cap; i++) {
            http_conn *c = &h->conns[i];
            short re = h->pfds[1 + i].revents;
            if (c->state == CONN_FREE || !re)
                continue;
            if (c->state == CONN_READING)
                conn_read(h, c, now);
            if (c->state == CONN_WRITING)
                conn_write(c);
        }
        for (int i = 0; i < cap; i++) {
            http_conn *c = &h->conns[i];
            if (c->state != CONN_FREE && c->deadline_ns <= now)
                conn_close(c);
        }
        /* 3. new connections, after the deadlines so that expired slots are free */
        if (r > 0 && (h->pfds[0].revents & POLLIN))
            accept_all(h, now);
    }
    return NULL;
}

static void http_free(kvf_worker_http *h)
{
    if (h->conns) {
        for (int i = 0; i < h->opts.max_conns; i++) {
            if (h->conns[i].state != CONN_FREE)
                close(h->conns[i].fd);
            kvf_sbuf_fini(&h->conns[i].out);
        }
    }
    free(h->conns);
    free(h->pfds);
    free(h);
}

kvf_status kvf_worker_http_start(const char *host, int port, const kvf_worker_http_opts *opts,
                                 kvf_worker_http_fn fn, void *ctx, kvf_worker_http **out,
                                 kvf_err *err)
{
    kvf_worker_http_opts o = opts ? *opts : (kvf_worker_http_opts){0};
    if (o.max_conns < 0 || o.read_timeout_ms < 0 || o.write_timeout_ms < 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "worker: admin HTTP: max_conns (%d) and the "
                           "timeouts (%d, %d ms) must be >= 0 (0: the default)", o.max_conns,
                           o.read_timeout_ms, o.write_timeout_ms);
    if (o.max_conns == 0)
        o.max_conns = KVF_WORKER_HTTP_MAX_CONNS;
    if (o.read_timeout_ms == 0)
        o.read_timeout_ms = KVF_WORKER_HTTP_READ_TIMEOUT_MS;
    if (o.write_timeout_ms == 0)
        o.write_timeout_ms = KVF_WORKER_HTTP_WRITE_TIMEOUT_MS;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *ai = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host, ps, &hints, &ai);
    if (rc != 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "worker: admin address %s:%d: %s", host, port,
                           gai_strerror(rc));
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd >= 0)
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        freeaddrinfo(ai);
        return kvf_err_set(err, KVF_ERR_IO, "worker: admin HTTP cannot listen on %s:%d: %s", host,
                           port, strerror(e));
    }
    freeaddrinfo(ai);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    int bound = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    kvf_worker_http *h = calloc(1, sizeof *h);
    if (h) {
        h->opts = o;
        h->conns = calloc((size_t)o.max_conns, sizeof *h->conns);
        h->pfds = calloc((size_t)o.max_conns + 1, sizeof *h->pfds);
    }
    if (!h || !h->conns || !h->pfds) {
        close(fd);
        if (h)
            http_free(h);
        return kvf_err_set(err, KVF_ERR_NOMEM, "worker: admin HTTP: out of memory for %d "
                           "connections", o.max_conns);
    }
    for (int i = 0; i < o.max_conns; i++) {
        h->conns[i].fd = -1;
        kvf_sbuf_init(&h->conns[i].out);
    }
    h->fd = fd;
    h->port = bound;
    h->fn = fn;
    h->ctx = ctx;
    if (pthread_create(&h->thread, NULL, http_main, h) != 0) {
        close(fd);
        http_free(h);
        return kvf_err_set(err, KVF_ERR_INTERNAL, "worker: cannot start the admin HTTP thread");
    }
    *out = h;
    return KVF_OK;
}

int kvf_worker_http_port(const kvf_worker_http *h)
{
    return h ? h->port : -1;
}

void kvf_worker_http_stop(kvf_worker_http *h)
{
    if (!h)
        return;
    atomic_store(&h->stop, true);
    pthread_join(h->thread, NULL);
    close(h->fd);
    http_free(h);
}
