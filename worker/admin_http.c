/* admin_http.c: the worker's admin port: a tiny HTTP/1.1 GET server on plain sockets, one thread,
 * one request per connection (Connection: close). Enough for Prometheus scrapes, probes and
 * curl; what a path returns is the caller's (worker.c serves /metrics and /health). */
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
#include "worker/worker.h"

struct kvf_worker_http {
    int fd, port;
    kvf_worker_http_fn fn;
    void *ctx;
    pthread_t thread;
    atomic_bool stop;
};

static void send_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k <= 0) {
            if (k < 0 && errno == EINTR)
                continue;
            return;
        }
        p += k;
        n -= (size_t)k;
    }
}

/* Reads the request head (up to a blank line, 8 KiB, or 2 s) and answers it. */
static void serve_one(kvf_worker_http *h, int fd)
{
    char req[8192];
    size_t n = 0;
    while (n < sizeof req - 1) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 2000) <= 0)
            break;
        ssize_t k = recv(fd, req + n, sizeof req - 1 - n, 0);
        if (k <= 0)
            break;
        n += (size_t)k;
        req[n] = '\0';
        if (strstr(req, "\r\n\r\n") || strstr(req, "\n\n"))
            break;
    }
    req[n] = '\0';
    char method[16] = {0}, path[1024] = {0};
    kvf_sbuf body, out;
    kvf_sbuf_init(&body);
    kvf_sbuf_init(&out);
    int code;
    const char *ctype = "text/plain; charset=utf-8";
    if (sscanf(req, "%15s %1023s", method, path) != 2) {
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
    const char *reason = code == 200 ? "OK" : code == 404 ? "Not Found" : code == 503 ? "Service Unavailable"
                                                                                      : "Error";
    kvf_sbuf_printf(&out, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                          "Connection: close\r\n\r\n", code, reason, ctype, body.len);
    send_all(fd, out.data, out.len);
    if (strcmp(method, "HEAD") != 0 && body.len)
        send_all(fd, body.data, body.len);
    kvf_sbuf_fini(&body);
    kvf_sbuf_fini(&out);
}

static void *http_main(void *arg)
{
    kvf_worker_http *h = arg;
    while (!atomic_load(&h->stop)) {
        struct pollfd p = {.fd = h->fd, .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        int c = accept(h->fd, NULL, NULL);
        if (c < 0)
            continue;
        serve_one(h, c);
        close(c);
    }
    return NULL;
}

kvf_status kvf_worker_http_start(const char *host, int port, kvf_worker_http_fn fn, void *ctx,
                                 kvf_worker_http **out, kvf_err *err)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *ai = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host, ps, &hints, &ai);
    if (rc != 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "worker: admin address %s:%d: %s", host, port,
                           gai_strerror(rc));
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
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
    if (!h) {
        close(fd);
        return kvf_err_set(err, KVF_ERR_NOMEM, "worker: out of memory");
    }
    h->fd = fd;
    h->port = bound;
    h->fn = fn;
    h->ctx = ctx;
    if (pthread_create(&h->thread, NULL, http_main, h) != 0) {
        close(fd);
        free(h);
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
    free(h);
}
