/* xfer_chan.c: the host notice channel of the GPU backends (cuda_ipc, nccl): small framed
 * messages (notice, acknowledgement, hello) over non-blocking TCP, progressed from
 * kvf_xfer_progress, with one epoll fd to sleep on. It carries no KV bytes; a connection that
 * fails or closes is how a lost peer shows. Frame: u32 type | i32 status | u64 id | u64 value |
 * u32 body length | u32 zero | 16-byte transfer token | body (host byte order is not assumed:
 * little-endian). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "transport/xfer_impl.h"

#define FRAME_HDR 48
#define READ_CHUNK 65536

struct kvf_xfer_conn {
    int fd;
    bool up, dead;
    kvf_sbuf in, out;
    size_t in_off, out_off; /* bytes already parsed / already sent */
    void *user;
    struct kvf_xfer_conn *next;
};

struct kvf_xfer_chan {
    int lfd, epfd;
    char host[64];
    uint16_t port;
    kvf_xfer_chan_fn fn;
    void *arg;
    kvf_xfer_conn *conns;
};

kvf_status kvf_xfer_chan_open(const char *host, kvf_xfer_chan_fn fn, void *arg,
                              kvf_xfer_chan **out, kvf_err *err)
{
    if (!host || !*host)
        host = "127.0.0.1";
    struct sockaddr_in sa = {.sin_family = AF_INET};
    if (strlen(host) >= 64 || inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "xfer: notice host '%s' is not an IPv4 address (e.g. 127.0.0.1 on one "
                           "node, or this node's address)", host);
    kvf_xfer_chan *c = calloc(1, sizeof *c);
    if (!c)
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: notice channel: out of memory");
    c->fn = fn;
    c->arg = arg;
    c->epfd = -1;
    snprintf(c->host, sizeof c->host, "%s", host);
    c->lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    socklen_t sl = sizeof sa;
    if (c->lfd < 0 || bind(c->lfd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
        listen(c->lfd, 64) != 0 || getsockname(c->lfd, (struct sockaddr *)&sa, &sl) != 0 ||
        (c->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0) {
        kvf_status st = kvf_err_set(err, KVF_ERR_IO, "xfer: notice channel: listening on %s: %s",
                                    host, strerror(errno));
        kvf_xfer_chan_close(c);
        return st;
    }
    c->port = ntohs(sa.sin_port);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->lfd, &ev);
    *out = c;
    return KVF_OK;
}

static void conn_free(kvf_xfer_chan *c, kvf_xfer_conn *k)
{
    epoll_ctl(c->epfd, EPOLL_CTL_DEL, k->fd, NULL);
    close(k->fd);
    kvf_sbuf_fini(&k->in);
    kvf_sbuf_fini(&k->out);
    free(k);
}

void kvf_xfer_chan_close(kvf_xfer_chan *c)
{
    if (!c)
        return;
    while (c->conns) {
        kvf_xfer_conn *k = c->conns;
        c->conns = k->next;
        conn_free(c, k);
    }
    if (c->lfd >= 0)
        close(c->lfd);
    if (c->epfd >= 0)
        close(c->epfd);
    free(c);
}

kvf_status kvf_xfer_chan_export(const kvf_xfer_chan *c, kvf_sbuf *out)
{
    uint8_t p[3] = {(uint8_t)c->port, (uint8_t)(c->port >> 8), (uint8_t)strlen(c->host)};
    kvf_sbuf_append(out, p, 3);
    return kvf_sbuf_append(out, c->host, strlen(c->host));
}

static kvf_xfer_conn *conn_add(kvf_xfer_chan *c, int fd, bool up)
{
    kvf_xfer_conn *k = calloc(1, sizeof *k);
    if (!k)
        return NULL;
    k->fd = fd;
    k->up = up;
    kvf_sbuf_init(&k->in);
    kvf_sbuf_init(&k->out);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = k};
    epoll_ctl(c->epfd, EPOLL_CTL_ADD, fd, &ev);
    k->next = c->conns;
    c->conns = k;
    return k;
}

kvf_status kvf_xfer_chan_connect(kvf_xfer_chan *c, const uint8_t *blob, size_t blob_len,
                                 size_t *used_out, kvf_xfer_conn **out, kvf_err *err)
{
    if (blob_len < 3 || blob_len < 3u + blob[2] || blob[2] == 0 || blob[2] >= 64)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor notice address of %zu bytes is invalid", blob_len);
    char host[64];
    memcpy(host, blob + 3, blob[2]);
    host[blob[2]] = '\0';
    uint16_t port = (uint16_t)(blob[0] | blob[1] << 8);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1 || port == 0)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "xfer: descriptor notice address '%s:%u' is not an IPv4 address and port",
                           host, port);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return kvf_err_set(err, KVF_ERR_IO, "xfer: notice channel: socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno != EINPROGRESS) {
        kvf_status st = kvf_err_set(err, KVF_ERR_PEER_LOST,
                                    "xfer: notice channel: connecting to %s:%u: %s", host, port,
                                    strerror(errno));
        close(fd);
        return st;
    }
    kvf_xfer_conn *k = conn_add(c, fd, false);
    if (!k) {
        close(fd);
        return kvf_err_set(err, KVF_ERR_NOMEM, "xfer: notice channel: out of memory");
    }
    *used_out = 3u + blob[2];
    *out = k;
    return KVF_OK;
}

void kvf_xfer_chan_drop(kvf_xfer_chan *c, kvf_xfer_conn *conn)
{
    for (kvf_xfer_conn **pp = &c->conns; *pp; pp = &(*pp)->next)
        if (*pp == conn) {
            *pp = conn->next;
            conn_free(c, conn);
            return;
        }
}

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

bool kvf_xfer_chan_send(kvf_xfer_conn *conn, const kvf_xfer_msg *m)
{
    if (conn->dead || m->body_len > KVF_XFER_MSG_MAX_BODY)
        return false;
    uint8_t h[FRAME_HDR] = {0};
    put_le(h, m->type, 4);
    put_le(h + 4, (uint32_t)m->status, 4);
    put_le(h + 8, m->id, 8);
    put_le(h + 16, m->value, 8);
    put_le(h + 24, m->body_len, 4);
    memcpy(h + 32, m->token, KVF_XFER_TOKEN_BYTES);
    kvf_sbuf_append(&conn->out, h, FRAME_HDR);
    if (m->body_len)
        kvf_sbuf_append(&conn->out, m->body, m->body_len);
    if (conn->out.oom) {
        kvf_log(KVF_LOG_ERROR, "xfer: notice channel: out of memory queueing a message");
        conn->dead = true;
        return false;
    }
    return true;
}

bool kvf_xfer_conn_up(const kvf_xfer_conn *conn)
{
    return conn->up && !conn->dead;
}

void *kvf_xfer_conn_user(const kvf_xfer_conn *conn)
{
    return conn->user;
}

void kvf_xfer_conn_set_user(kvf_xfer_conn *conn, void *user)
{
    conn->user = user;
}

/* A connecting socket: up once writable with no error. */
static void conn_check_connect(kvf_xfer_conn *k)
{
    struct pollfd p = {.fd = k->fd, .events = POLLOUT};
    if (poll(&p, 1, 0) <= 0)
        return;
    int e = 0;
    socklen_t l = sizeof e;
    if (getsockopt(k->fd, SOL_SOCKET, SO_ERROR, &e, &l) != 0 || e != 0) {
        kvf_log(KVF_LOG_WARN, "xfer: notice channel: connect failed: %s", strerror(e ? e : errno));
        k->dead = true;
        return;
    }
    k->up = true;
}

static void conn_read(kvf_xfer_chan *c, kvf_xfer_conn *k)
{
    for (;;) {
        if (kvf_sbuf_reserve(&k->in, READ_CHUNK) != KVF_OK) {
            k->dead = true;
            return;
        }
        ssize_t n = recv(k->fd, k->in.data + k->in.len, READ_CHUNK, 0);
        if (n > 0) {
            k->in.len += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (n < 0 && errno == EINTR)
            continue;
        k->dead = true; /* EOF or a reset: the other side is gone */
        break;
    }
    /* Hand out every complete frame. */
    const uint8_t *d = (const uint8_t *)k->in.data;
    while (k->in.len - k->in_off >= FRAME_HDR) {
        const uint8_t *h = d + k->in_off;
        uint32_t body = kvf_xfer_get_u32(h + 24);
        if (body > KVF_XFER_MSG_MAX_BODY) {
            kvf_log(KVF_LOG_WARN, "xfer: notice channel: frame of %u bytes (at most %u): closing",
                    body, KVF_XFER_MSG_MAX_BODY);
            k->dead = true;
            break;
        }
        if (k->in.len - k->in_off < FRAME_HDR + (size_t)body)
            break;
        kvf_xfer_msg m = {.type = kvf_xfer_get_u32(h), .status = (int32_t)kvf_xfer_get_u32(h + 4),
                          .id = kvf_xfer_get_u64(h + 8), .value = kvf_xfer_get_u64(h + 16),
                          .body = body ? h + FRAME_HDR : NULL, .body_len = body};
        memcpy(m.token, h + 32, KVF_XFER_TOKEN_BYTES);
        k->in_off += FRAME_HDR + body;
        if (m.type != KVF_XFER_MSG_CLOSED)
            c->fn(c->arg, k, &m);
        d = (const uint8_t *)k->in.data;
    }
    if (k->in_off == k->in.len) {
        k->in.len = 0;
        k->in_off = 0;
    } else if (k->in_off > (1u << 20)) {
        memmove(k->in.data, k->in.data + k->in_off, k->in.len - k->in_off);
        k->in.len -= k->in_off;
        k->in_off = 0;
    }
}

static void conn_write(kvf_xfer_conn *k)
{
    while (k->out_off < k->out.len) {
        ssize_t n = send(k->fd, k->out.data + k->out_off, k->out.len - k->out_off, MSG_NOSIGNAL);
        if (n > 0) {
            k->out_off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        k->dead = true;
        return;
    }
    k->out.len = 0;
    k->out_off = 0;
}

void kvf_xfer_chan_progress(kvf_xfer_chan *c)
{
    for (;;) {
        int fd = accept4(c->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            break;
        if (!conn_add(c, fd, true))
            close(fd);
    }
    for (kvf_xfer_conn *k = c->conns; k; k = k->next) {
        if (!k->up && !k->dead)
            conn_check_connect(k);
        if (k->up && !k->dead)
            conn_read(c, k);
        if (k->up && !k->dead)
            conn_write(k);
    }
    /* Dead connections are reported once, then freed. */
    for (kvf_xfer_conn **pp = &c->conns; *pp;) {
        kvf_xfer_conn *k = *pp;
        if (!k->dead) {
            pp = &k->next;
            continue;
        }
        kvf_xfer_msg m = {.type = KVF_XFER_MSG_CLOSED};
        c->fn(c->arg, k, &m);
        *pp = k->next;
        conn_free(c, k);
    }
}

int kvf_xfer_chan_fd(const kvf_xfer_chan *c)
{
    return c->epfd;
}

bool kvf_xfer_chan_busy(const kvf_xfer_chan *c)
{
    for (const kvf_xfer_conn *k = c->conns; k; k = k->next)
        if (!k->up || k->dead || k->out_off < k->out.len)
            return true;
    return false;
}
