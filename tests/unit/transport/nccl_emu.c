/* nccl_emu.c: the host NCCL emulation described in nccl_emu.h: two-rank communicators over one
 * TCP connection each, a thread per communicator doing the init handshake and moving the bytes
 * of point-to-point operations in issue order, groups collected per calling thread, and the
 * stream hand-off (kvf_nccl_emu_streams) that orders operations with other stream work.
 * Wire frames (little-endian): u32 type | u32 rank | u64 seq | u64 bytes, then the payload of a
 * DATA frame. HELLO: rank, seq = nonce, bytes = nranks. CTS (recv ready): seq, bytes. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* accept4, pipe2 */
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <nccl.h>

#include "nccl_emu.h"

#define ID_MAGIC "KVFNEMU1"
#define FRAME 24
enum { F_HELLO = 1, F_CTS = 2, F_DATA = 3 };

struct kvf_nccl_emu_op {
    struct ncclComm *comm;
    bool send;
    uint64_t seq, bytes;
    char *buf;
    bool started, cts_sent, done, failed;
    int refs; /* the comm's queue (until done) + the stream owner (until released); comm->mu */
    struct kvf_nccl_emu_op *next;
};
typedef struct kvf_nccl_emu_op op_t;

struct ncclComm {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* the handle + one per live op */
    int rank, nranks;
    bool blocking;
    uint64_t nonce;
    struct sockaddr_in addr; /* where the id's listener is */
    int lfd;                 /* the listener, when this rank accepts; else -1 */
    int fd, wake_rd, wake_wr;
    pthread_t th;
    bool th_live;
    /* under mu */
    bool ready, aborted;
    ncclResult_t async;
    int posting; /* groups posted since the thread last looked (non-blocking: in progress) */
    char why[256];
    op_t *sends, *recvs; /* in issue order, not yet done */
    uint64_t send_seq, recv_seq;
    /* the thread's own */
    bool io_dead;
    uint8_t in_hdr[FRAME];
    size_t in_have;
    op_t *in_op;
    uint64_t in_off;
    uint64_t *cts;           /* bytes of each CTS received, FIFO */
    uint64_t *cts_seq;
    size_t cts_head, cts_len, cts_cap;
    uint8_t out_hdr[FRAME];
    size_t out_hdr_len, out_hdr_off;
    op_t *out_op;
    uint64_t out_off;
};

typedef struct listener {
    uint64_t nonce;
    int fd;
    struct listener *next;
} listener;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static listener *g_listeners;
static kvf_nccl_emu_streams g_streams;
static bool g_have_streams;
static char g_host[64] = "127.0.0.1";
static kvf_nccl_emu_stats g_stats;
static uint64_t g_nonce_ctr;
static bool g_hold_sends;

typedef struct pend {
    bool send;
    void *buf;
    uint64_t bytes;
    int peer;
    ncclComm_t comm;
    void *stream;
} pend;

static __thread int t_depth;
static __thread pend *t_items;
static __thread size_t t_n, t_cap;
static __thread ncclResult_t t_group_err;
static __thread char t_err[256];

static void stat_add(int64_t *f, int64_t d)
{
    pthread_mutex_lock(&g_mu);
    *f += d;
    pthread_mutex_unlock(&g_mu);
}

static ncclResult_t fail(ncclResult_t r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_err, sizeof t_err, fmt, ap);
    va_end(ap);
    return r;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void frame(uint8_t *h, uint32_t type, uint32_t rank, uint64_t seq, uint64_t bytes)
{
    put_le(h, type, 4);
    put_le(h + 4, rank, 4);
    put_le(h + 8, seq, 8);
    put_le(h + 16, bytes, 8);
}

/* ---- settings and stats ---- */

void kvf_nccl_emu_set_streams(const kvf_nccl_emu_streams *s)
{
    pthread_mutex_lock(&g_mu);
    g_have_streams = s != NULL;
    if (s)
        g_streams = *s;
    pthread_mutex_unlock(&g_mu);
}

void kvf_nccl_emu_hold_sends(bool hold)
{
    pthread_mutex_lock(&g_mu);
    g_hold_sends = hold;
    pthread_mutex_unlock(&g_mu);
}

bool kvf_nccl_emu_set_host(const char *ipv4)
{
    struct in_addr a;
    if (!ipv4 || strlen(ipv4) >= sizeof g_host || inet_pton(AF_INET, ipv4, &a) != 1)
        return false;
    pthread_mutex_lock(&g_mu);
    snprintf(g_host, sizeof g_host, "%s", ipv4);
    pthread_mutex_unlock(&g_mu);
    return true;
}

void kvf_nccl_emu_stats_get(kvf_nccl_emu_stats *out)
{
    pthread_mutex_lock(&g_mu);
    *out = g_stats;
    pthread_mutex_unlock(&g_mu);
}

/* ---- error strings ---- */

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

const char *ncclGetLastError(ncclComm_t comm)
{
    if (comm) {
        pthread_mutex_lock(&comm->mu);
        if (comm->why[0])
            snprintf(t_err, sizeof t_err, "%s", comm->why);
        pthread_mutex_unlock(&comm->mu);
    }
    return t_err;
}

ncclResult_t ncclGetVersion(int *version)
{
    if (!version)
        return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

/* ---- unique ids ---- */

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    if (!id)
        return fail(ncclInvalidArgument, "ncclGetUniqueId: id is NULL");
    char host[64];
    pthread_mutex_lock(&g_mu);
    snprintf(host, sizeof host, "%s", g_host);
    uint64_t nonce = ((uint64_t)getpid() << 40) ^ (uint64_t)now_ns() ^ (++g_nonce_ctr << 20);
    pthread_mutex_unlock(&g_mu);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, host, &sa.sin_addr);
    socklen_t sl = sizeof sa;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 8) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &sl) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return fail(ncclSystemError, "ncclGetUniqueId: listening on %s: %s", host, strerror(e));
    }
    listener *l = malloc(sizeof *l);
    if (!l) {
        close(fd);
        return fail(ncclSystemError, "ncclGetUniqueId: out of memory");
    }
    memset(id, 0, sizeof *id);
    memcpy(id->internal, ID_MAGIC, 8);
    memcpy(id->internal + 8, &sa.sin_addr.s_addr, 4); /* network order */
    memcpy(id->internal + 12, &sa.sin_port, 2);
    put_le((uint8_t *)id->internal + 16, nonce, 8);
    l->nonce = nonce;
    l->fd = fd;
    pthread_mutex_lock(&g_mu);
    l->next = g_listeners;
    g_listeners = l;
    g_stats.listeners++;
    pthread_mutex_unlock(&g_mu);
    return ncclSuccess;
}

/* The listener of nonce when this process made the id (removed from the list), else -1. */
static int listener_take(uint64_t nonce)
{
    int fd = -1;
    pthread_mutex_lock(&g_mu);
    for (listener **pp = &g_listeners; *pp; pp = &(*pp)->next)
        if ((*pp)->nonce == nonce) {
            listener *l = *pp;
            *pp = l->next;
            fd = l->fd;
            free(l);
            g_stats.listeners--;
            break;
        }
    pthread_mutex_unlock(&g_mu);
    return fd;
}

/* ---- communicators ---- */

static void comm_free(struct ncclComm *c)
{
    if (c->fd >= 0)
        close(c->fd);
    if (c->lfd >= 0)
        close(c->lfd);
    close(c->wake_rd);
    close(c->wake_wr);
    free(c->cts);
    free(c->cts_seq);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
    stat_add(&g_stats.comms_live, -1);
}

static void wake(struct ncclComm *c)
{
    char b = 1;
    (void)!write(c->wake_wr, &b, 1);
}

/* Drops one reference of op (comm->mu held); returns whether the comm lost its last one. */
static bool op_unref_locked(op_t *o)
{
    struct ncclComm *c = o->comm;
    if (--o->refs > 0)
        return false;
    free(o);
    stat_add(&g_stats.ops_live, -1);
    return --c->refs == 0;
}

/* Ends op (comm->mu held): off its queue, done, waiters woken; returns as op_unref_locked. */
static bool op_finish_locked(struct ncclComm *c, op_t *o, bool failed)
{
    op_t **q = o->send ? &c->sends : &c->recvs;
    for (op_t **pp = q; *pp; pp = &(*pp)->next)
        if (*pp == o) {
            *pp = o->next;
            break;
        }
    o->done = true;
    o->failed = failed;
    if (!failed)
        stat_add(o->send ? &g_stats.sends_done : &g_stats.recvs_done, 1);
    pthread_cond_broadcast(&c->cv);
    return op_unref_locked(o);
}

static void set_error(struct ncclComm *c, ncclResult_t r, const char *fmt, ...)
{
    pthread_mutex_lock(&c->mu);
    if (c->async == ncclSuccess || c->async == ncclInProgress) {
        c->async = r;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->why, sizeof c->why, fmt, ap);
        va_end(ap);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static bool aborted(struct ncclComm *c)
{
    pthread_mutex_lock(&c->mu);
    bool a = c->aborted;
    pthread_mutex_unlock(&c->mu);
    return a;
}

static void drain_wake(struct ncclComm *c)
{
    char b[64];
    while (read(c->wake_rd, b, sizeof b) > 0)
        ;
}

/* Waits until fd is ready for ev or the comm is aborted: 1 ready, 0 aborted, -1 error. */
static int wait_fd(struct ncclComm *c, int fd, short ev)
{
    for (;;) {
        if (aborted(c))
            return 0;
        struct pollfd p[2] = {{.fd = fd, .events = ev}, {.fd = c->wake_rd, .events = POLLIN}};
        int r = poll(p, 2, 200);
        if (r < 0 && errno != EINTR)
            return -1;
        if (r > 0 && p[1].revents)
            drain_wake(c);
        if (r > 0 && p[0].revents)
            return (p[0].revents & (POLLERR | POLLNVAL)) && !(p[0].revents & ev) ? -1 : 1;
    }
}

/* Reads or writes all n bytes of a non-blocking fd: 1 done, 0 aborted, -1 error or EOF. */
static int io_all(struct ncclComm *c, int fd, void *buf, size_t n, bool out)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t k = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0 && !out)
            return -1;
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        int w = wait_fd(c, fd, out ? POLLOUT : POLLIN);
        if (w <= 0)
            return w;
    }
    return 1;
}

/* The init handshake: accept (we hold the id's listener) or connect, then HELLO both ways.
 * Returns 1 joined, 0 aborted, -1 failed (c->why set through set_error). */
static int comm_join(struct ncclComm *c)
{
    uint8_t h[FRAME], r[FRAME];
    frame(h, F_HELLO, (uint32_t)c->rank, c->nonce, (uint64_t)c->nranks);
    char where[64];
    inet_ntop(AF_INET, &c->addr.sin_addr, where, sizeof where);
    unsigned port = ntohs(c->addr.sin_port);
    if (c->lfd >= 0) {
        for (;;) { /* a connection with the wrong nonce or rank is closed; keep listening */
            int w = wait_fd(c, c->lfd, POLLIN);
            if (w <= 0)
                return w;
            int fd = accept4(c->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0)
                continue;
            int k = io_all(c, fd, r, FRAME, false);
            if (k == 0) {
                close(fd);
                return 0;
            }
            if (k < 0 || get_le(r, 4) != F_HELLO || get_le(r + 8, 8) != c->nonce ||
                get_le(r + 16, 8) != (uint64_t)c->nranks || get_le(r + 4, 4) == (uint64_t)c->rank ||
                get_le(r + 4, 4) >= (uint64_t)c->nranks) {
                close(fd);
                continue;
            }
            if ((k = io_all(c, fd, h, FRAME, true)) <= 0) {
                close(fd);
                if (k == 0)
                    return 0;
                set_error(c, ncclSystemError, "init: answering the peer on %s:%u failed", where,
                          port);
                return -1;
            }
            c->fd = fd;
            close(c->lfd);
            c->lfd = -1;
            return 1;
        }
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || (connect(fd, (struct sockaddr *)&c->addr, sizeof c->addr) != 0 &&
                   errno != EINPROGRESS)) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        set_error(c, ncclSystemError, "init: connecting to the unique id's %s:%u: %s", where, port,
                  strerror(e));
        return -1;
    }
    c->fd = fd;
    int w = wait_fd(c, fd, POLLOUT), e = 0;
    socklen_t el = sizeof e;
    if (w == 0)
        return 0;
    if (w < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) != 0 || e != 0) {
        set_error(c, ncclSystemError, "init: connecting to the unique id's %s:%u: %s", where, port,
                  strerror(e ? e : ECONNREFUSED));
        return -1;
    }
    int k = io_all(c, fd, h, FRAME, true);
    if (k > 0)
        k = io_all(c, fd, r, FRAME, false);
    if (k <= 0) {
        if (k < 0)
            set_error(c, ncclRemoteError, "init: the peer at %s:%u closed the connection", where,
                      port);
        return k;
    }
    if (get_le(r, 4) != F_HELLO || get_le(r + 8, 8) != c->nonce ||
        get_le(r + 4, 4) == (uint64_t)c->rank) {
        set_error(c, ncclInvalidUsage, "init: the peer at %s:%u answered for another communicator "
                  "or the same rank", where, port);
        return -1;
    }
    return 1;
}

/* ---- the communicator thread: moving bytes ---- */

static void cts_push(struct ncclComm *c, uint64_t seq, uint64_t bytes)
{
    if (c->cts_len == c->cts_cap) {
        size_t cap = c->cts_cap ? c->cts_cap * 2 : 16;
        uint64_t *a = malloc(cap * sizeof *a), *s = malloc(cap * sizeof *s);
        if (!a || !s) {
            free(a);
            free(s);
            set_error(c, ncclSystemError, "out of memory");
            c->io_dead = true;
            return;
        }
        for (size_t i = 0; i < c->cts_len; i++) {
            a[i] = c->cts[(c->cts_head + i) % c->cts_cap];
            s[i] = c->cts_seq[(c->cts_head + i) % c->cts_cap];
        }
        free(c->cts);
        free(c->cts_seq);
        c->cts = a;
        c->cts_seq = s;
        c->cts_head = 0;
        c->cts_cap = cap;
    }
    size_t at = (c->cts_head + c->cts_len++) % c->cts_cap;
    c->cts[at] = bytes;
    c->cts_seq[at] = seq;
}

/* Picks the next frame to write (none in progress): a CTS for the first started recv that has
 * not sent one (recvs go in issue order), else the DATA of the oldest send once its peer is
 * ready for it. */
static void next_output(struct ncclComm *c)
{
    pthread_mutex_lock(&c->mu);
    for (op_t *o = c->recvs; o; o = o->next) {
        if (o->cts_sent)
            continue;
        if (o->started) {
            o->cts_sent = true;
            frame(c->out_hdr, F_CTS, (uint32_t)c->rank, o->seq, o->bytes);
            c->out_hdr_len = FRAME;
            c->out_hdr_off = 0;
            pthread_mutex_unlock(&c->mu);
            return;
        }
        break;
    }
    pthread_mutex_lock(&g_mu);
    bool hold = g_hold_sends;
    pthread_mutex_unlock(&g_mu);
    op_t *s = c->sends;
    if (s && s->started && c->cts_len > 0 && !hold) {
        uint64_t want = c->cts[c->cts_head], seq = c->cts_seq[c->cts_head];
        c->cts_head = (c->cts_head + 1) % c->cts_cap;
        c->cts_len--;
        pthread_mutex_unlock(&c->mu);
        if (want != s->bytes || seq != s->seq) {
            set_error(c, ncclInvalidUsage, "send %llu of %llu bytes met recv %llu of %llu bytes "
                      "(sizes and order must match)", (unsigned long long)s->seq,
                      (unsigned long long)s->bytes, (unsigned long long)seq,
                      (unsigned long long)want);
            c->io_dead = true;
            return;
        }
        frame(c->out_hdr, F_DATA, (uint32_t)c->rank, s->seq, s->bytes);
        c->out_hdr_len = FRAME;
        c->out_hdr_off = 0;
        c->out_op = s;
        c->out_off = 0;
        return;
    }
    pthread_mutex_unlock(&c->mu);
}

/* Writes what it can; returns false on a dead connection. */
static bool do_output(struct ncclComm *c)
{
    for (;;) {
        if (c->out_hdr_off == c->out_hdr_len && !c->out_op) {
            c->out_hdr_len = c->out_hdr_off = 0;
            next_output(c);
            if (!c->out_hdr_len)
                return !c->io_dead;
        }
        const void *p;
        size_t n;
        if (c->out_hdr_off < c->out_hdr_len) {
            p = c->out_hdr + c->out_hdr_off;
            n = c->out_hdr_len - c->out_hdr_off;
        } else {
            p = c->out_op->buf + c->out_off;
            n = (size_t)(c->out_op->bytes - c->out_off);
        }
        ssize_t k = n ? send(c->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : 0;
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return true;
        if (k < 0)
            return false;
        if (c->out_hdr_off < c->out_hdr_len) {
            c->out_hdr_off += (size_t)k;
        } else {
            c->out_off += (uint64_t)k;
        }
        if (c->out_op && c->out_hdr_off == c->out_hdr_len && c->out_off == c->out_op->bytes) {
            op_t *o = c->out_op;
            c->out_op = NULL;
            stat_add(&g_stats.bytes_sent, (int64_t)o->bytes);
            pthread_mutex_lock(&c->mu);
            op_finish_locked(c, o, false); /* the queue's ref: the comm keeps its handle ref */
            pthread_mutex_unlock(&c->mu);
        }
    }
}

/* Reads what is there: frames, and DATA payloads straight into the recv's buffer. */
static bool do_input(struct ncclComm *c)
{
    for (;;) {
        void *p;
        size_t n;
        if (c->in_op) {
            p = c->in_op->buf + c->in_off;
            n = (size_t)(c->in_op->bytes - c->in_off);
        } else {
            p = c->in_hdr + c->in_have;
            n = FRAME - c->in_have;
        }
        ssize_t k = n ? recv(c->fd, p, n, MSG_DONTWAIT) : 0;
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return true;
        if (k <= 0 && n)
            return false; /* EOF or reset */
        if (c->in_op) {
            c->in_off += (uint64_t)k;
        } else {
            c->in_have += (size_t)k;
            if (c->in_have < FRAME)
                continue;
            c->in_have = 0;
            uint32_t type = (uint32_t)get_le(c->in_hdr, 4);
            uint64_t seq = get_le(c->in_hdr + 8, 8), bytes = get_le(c->in_hdr + 16, 8);
            if (type == F_CTS) {
                cts_push(c, seq, bytes);
                if (c->io_dead)
                    return true;
                continue;
            }
            pthread_mutex_lock(&c->mu);
            op_t *o = c->recvs;
            bool ok = type == F_DATA && o && o->cts_sent && o->seq == seq && o->bytes == bytes;
            pthread_mutex_unlock(&c->mu);
            if (!ok) {
                set_error(c, ncclInvalidUsage, "a frame (type %u, op %llu, %llu bytes) that no "
                          "ready recv matches", type, (unsigned long long)seq,
                          (unsigned long long)bytes);
                c->io_dead = true;
                return true;
            }
            c->in_op = o;
            c->in_off = 0;
        }
        if (c->in_op && c->in_off == c->in_op->bytes) {
            op_t *o = c->in_op;
            c->in_op = NULL;
            stat_add(&g_stats.bytes_received, (int64_t)o->bytes);
            pthread_mutex_lock(&c->mu);
            op_finish_locked(c, o, false);
            pthread_mutex_unlock(&c->mu);
        }
    }
}

static void *comm_thread(void *arg)
{
    struct ncclComm *c = arg;
    int j = comm_join(c);
    pthread_mutex_lock(&c->mu);
    if (j > 0) {
        c->ready = true;
        if (c->async == ncclInProgress)
            c->async = ncclSuccess;
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (j > 0)
        stat_add(&g_stats.inits_ok, 1);
    else
        c->io_dead = true;
    if (j < 0) /* a specific error was usually set already; this one only fills a gap */
        set_error(c, ncclSystemError, "rank %d: init failed", c->rank);
    for (;;) {
        pthread_mutex_lock(&c->mu);
        if (c->aborted) {
            pthread_mutex_unlock(&c->mu);
            break;
        }
        if (c->posting) { /* a non-blocking group's operations are in our queues now */
            c->posting = 0;
            if (c->async == ncclInProgress)
                c->async = ncclSuccess;
        }
        pthread_mutex_unlock(&c->mu);
        bool want_out = false;
        if (!c->io_dead) {
            /* Input first: a CTS that arrives makes a send's DATA ready to go out. */
            if (!do_input(c) || !do_output(c)) {
                set_error(c, ncclRemoteError, "rank %d: the peer closed the connection (its "
                          "process exited?) or the network failed", c->rank);
                c->io_dead = true; /* operations now wait for the abort, as kernels would */
            }
            want_out = !c->io_dead && (c->out_hdr_off < c->out_hdr_len || c->out_op);
        }
        struct pollfd p[2] = {{.fd = c->io_dead ? -1 : c->fd,
                               .events = (short)(POLLIN | (want_out ? POLLOUT : 0))},
                              {.fd = c->wake_rd, .events = POLLIN}};
        if (poll(p, 2, 1000) > 0 && p[1].revents)
            drain_wake(c);
    }
    return NULL;
}

static int type_size(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config)
{
    if (!comm)
        return fail(ncclInvalidArgument, "ncclCommInitRankConfig: comm is NULL");
    *comm = NULL;
    if (nranks != 2 || rank < 0 || rank >= nranks)
        return fail(ncclInvalidArgument, "ncclCommInitRankConfig: rank %d of %d (the emulation "
                    "has communicators of 2 ranks only)", rank, nranks);
    if (memcmp(id.internal, ID_MAGIC, 8) != 0)
        return fail(ncclInvalidArgument, "ncclCommInitRankConfig: not a unique id of the NCCL "
                    "emulation");
    if (config && config->magic != 0xcafebeef)
        return fail(ncclInvalidArgument, "ncclCommInitRankConfig: config not initialized with "
                    "NCCL_CONFIG_INITIALIZER");
    struct ncclComm *c = calloc(1, sizeof *c);
    int wp[2];
    if (!c || pipe2(wp, O_NONBLOCK | O_CLOEXEC) != 0) {
        free(c);
        return fail(ncclSystemError, "ncclCommInitRankConfig: out of memory or descriptors");
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    c->refs = 1;
    c->rank = rank;
    c->nranks = nranks;
    c->blocking = !config || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
    c->addr.sin_family = AF_INET;
    memcpy(&c->addr.sin_addr.s_addr, id.internal + 8, 4);
    memcpy(&c->addr.sin_port, id.internal + 12, 2);
    c->nonce = get_le((const uint8_t *)id.internal + 16, 8);
    c->lfd = listener_take(c->nonce);
    c->fd = -1;
    c->wake_rd = wp[0];
    c->wake_wr = wp[1];
    c->async = ncclInProgress;
    stat_add(&g_stats.comms_live, 1);
    if (pthread_create(&c->th, NULL, comm_thread, c) != 0) {
        comm_free(c);
        return fail(ncclSystemError, "ncclCommInitRankConfig: cannot start a thread");
    }
    c->th_live = true;
    *comm = c;
    if (!c->blocking)
        return ncclInProgress;
    pthread_mutex_lock(&c->mu);
    while (c->async == ncclInProgress)
        pthread_cond_wait(&c->cv, &c->mu);
    ncclResult_t r = c->async;
    if (r != ncclSuccess)
        snprintf(t_err, sizeof t_err, "%s", c->why);
    pthread_mutex_unlock(&c->mu);
    return r;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    return ncclCommInitRankConfig(comm, nranks, id, rank, NULL);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async)
{
    if (!comm || !async)
        return fail(ncclInvalidArgument, "ncclCommGetAsyncError: comm or asyncError is NULL");
    pthread_mutex_lock(&comm->mu);
    *async = comm->async;
    pthread_mutex_unlock(&comm->mu);
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
    if (!comm || !count)
        return fail(ncclInvalidArgument, "ncclCommCount: comm or count is NULL");
    *count = comm->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
    if (!comm || !rank)
        return fail(ncclInvalidArgument, "ncclCommUserRank: comm or rank is NULL");
    *rank = comm->rank;
    return ncclSuccess;
}

/* Stops the thread (it never blocks for long), ends every operation (done, failed: their
 * streams move on) and drops the handle; the memory goes with the last operation. */
ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (!comm)
        return ncclSuccess; /* as NCCL: aborting NULL is a no-op */
    pthread_mutex_lock(&comm->mu);
    comm->aborted = true;
    pthread_mutex_unlock(&comm->mu);
    wake(comm);
    if (comm->th_live)
        pthread_join(comm->th, NULL);
    stat_add(&g_stats.aborts, 1);
    pthread_mutex_lock(&comm->mu);
    if (comm->async == ncclInProgress || comm->async == ncclSuccess) {
        comm->async = ncclInvalidUsage;
        snprintf(comm->why, sizeof comm->why, "the communicator was aborted");
    }
    while (comm->sends) /* the handle's ref keeps the comm through these */
        op_finish_locked(comm, comm->sends, true);
    while (comm->recvs)
        op_finish_locked(comm, comm->recvs, true);
    bool last = --comm->refs == 0;
    pthread_mutex_unlock(&comm->mu);
    if (last)
        comm_free(comm);
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    return ncclCommAbort(comm);
}

ncclResult_t ncclCommFinalize(ncclComm_t comm)
{
    return comm ? ncclSuccess : fail(ncclInvalidArgument, "ncclCommFinalize: comm is NULL");
}

/* ---- operations and groups ---- */

void kvf_nccl_emu_op_start(kvf_nccl_emu_op *o)
{
    struct ncclComm *c = o->comm;
    pthread_mutex_lock(&c->mu);
    bool go = !o->started && !o->done && !c->aborted;
    o->started = true;
    pthread_mutex_unlock(&c->mu);
    if (go)
        wake(c);
}

bool kvf_nccl_emu_op_done(kvf_nccl_emu_op *o)
{
    pthread_mutex_lock(&o->comm->mu);
    bool d = o->done;
    pthread_mutex_unlock(&o->comm->mu);
    return d;
}

bool kvf_nccl_emu_op_wait(kvf_nccl_emu_op *o, int64_t timeout_ns)
{
    struct ncclComm *c = o->comm;
    int64_t until = now_ns() + timeout_ns;
    struct timespec ts = {.tv_sec = until / 1000000000LL, .tv_nsec = until % 1000000000LL};
    pthread_mutex_lock(&c->mu);
    while (!o->done && pthread_cond_timedwait(&c->cv, &c->mu, &ts) != ETIMEDOUT)
        ;
    bool d = o->done;
    pthread_mutex_unlock(&c->mu);
    return d;
}

void kvf_nccl_emu_op_release(kvf_nccl_emu_op *o)
{
    struct ncclComm *c = o->comm;
    pthread_mutex_lock(&c->mu);
    bool last = op_unref_locked(o);
    pthread_mutex_unlock(&c->mu);
    if (last)
        comm_free(c);
}

ncclResult_t ncclGroupStart(void)
{
    if (t_depth++ == 0) {
        t_n = 0;
        t_group_err = ncclSuccess;
    }
    return ncclSuccess;
}

static ncclResult_t group_add(bool send, void *buf, size_t count, ncclDataType_t type, int peer,
                              ncclComm_t comm, cudaStream_t stream)
{
    const char *what = send ? "ncclSend" : "ncclRecv";
    int ts = type_size(type);
    ncclResult_t r = ncclSuccess;
    if (!comm)
        r = fail(ncclInvalidArgument, "%s: comm is NULL", what);
    else if (ts == 0)
        r = fail(ncclInvalidArgument, "%s: data type %d is not known", what, (int)type);
    else if (peer < 0 || peer >= comm->nranks || peer == comm->rank)
        r = fail(ncclInvalidArgument, "%s: peer %d (this is rank %d of %d)", what, peer,
                 comm->rank, comm->nranks);
    else if (!buf && count)
        r = fail(ncclInvalidArgument, "%s: buffer is NULL", what);
    if (r == ncclSuccess && t_n == t_cap) {
        size_t cap = t_cap ? t_cap * 2 : 8;
        pend *a = realloc(t_items, cap * sizeof *a);
        if (!a)
            r = fail(ncclSystemError, "%s: out of memory", what);
        else
            t_items = a, t_cap = cap;
    }
    if (r != ncclSuccess) {
        if (t_group_err == ncclSuccess)
            t_group_err = r;
        return r;
    }
    t_items[t_n++] = (pend){.send = send, .buf = buf, .bytes = (uint64_t)count * (uint64_t)ts,
                            .peer = peer, .comm = comm, .stream = (void *)stream};
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
    if (t_depth == 0)
        return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--t_depth > 0)
        return ncclSuccess;
    if (t_group_err != ncclSuccess) { /* an invalid call: nothing of the group is posted */
        t_n = 0;
        return t_group_err;
    }
    /* Every communicator must be usable: initialized, not failed, not aborted. */
    for (size_t i = 0; i < t_n; i++) {
        struct ncclComm *c = t_items[i].comm;
        pthread_mutex_lock(&c->mu);
        ncclResult_t a = ncclSuccess;
        if (c->aborted)
            a = fail(ncclInvalidUsage, "ncclGroupEnd: rank %d: the communicator was aborted",
                     c->rank);
        else if (c->async != ncclSuccess && c->async != ncclInProgress)
            a = fail(c->async, "ncclGroupEnd: rank %d: %s", c->rank, c->why);
        else if (!c->ready)
            a = fail(ncclInvalidUsage, "ncclGroupEnd: rank %d: the communicator is still "
                     "initializing (poll ncclCommGetAsyncError until ncclSuccess)", c->rank);
        pthread_mutex_unlock(&c->mu);
        if (a != ncclSuccess && a != ncclInProgress) {
            t_n = 0;
            return a;
        }
    }
    kvf_nccl_emu_streams s = {0};
    pthread_mutex_lock(&g_mu);
    bool hooks = g_have_streams;
    if (hooks)
        s = g_streams;
    pthread_mutex_unlock(&g_mu);
    bool in_progress = false;
    ncclResult_t res = ncclSuccess;
    for (size_t i = 0; i < t_n; i++) {
        pend *p = &t_items[i];
        struct ncclComm *c = p->comm;
        op_t *o = calloc(1, sizeof *o);
        if (!o) {
            res = fail(ncclSystemError, "ncclGroupEnd: out of memory");
            break;
        }
        o->comm = c;
        o->send = p->send;
        o->buf = p->buf;
        o->bytes = p->bytes;
        o->refs = 2;
        stat_add(&g_stats.ops_live, 1);
        stat_add(&g_stats.ops_posted, 1);
        pthread_mutex_lock(&c->mu);
        c->refs++;
        o->seq = p->send ? c->send_seq++ : c->recv_seq++;
        op_t **q = p->send ? &c->sends : &c->recvs;
        while (*q)
            q = &(*q)->next;
        *q = o;
        if (!c->blocking) {
            c->posting++;
            if (c->async == ncclSuccess)
                c->async = ncclInProgress;
            in_progress = true;
        }
        pthread_mutex_unlock(&c->mu);
        if (!hooks) {
            kvf_nccl_emu_op_start(o);
            kvf_nccl_emu_op_release(o);
        } else if (!s.enqueue(s.ctx, p->stream, o)) {
            set_error(c, ncclUnhandledCudaError, "the stream owner could not enqueue an operation");
            pthread_mutex_lock(&c->mu);
            /* the stream's ref goes first (the finish drops ours; the comm keeps its handle
             * ref), so o is touched only while a ref remains */
            o->refs--;
            op_finish_locked(c, o, true);
            pthread_mutex_unlock(&c->mu);
        }
        wake(c);
    }
    t_n = 0;
    if (res != ncclSuccess)
        return res;
    return in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream)
{
    ncclGroupStart();
    ncclResult_t r = group_add(true, (void *)buf, count, type, peer, comm, stream);
    ncclResult_t e = ncclGroupEnd();
    return r != ncclSuccess ? r : e;
}

ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream)
{
    ncclGroupStart();
    ncclResult_t r = group_add(false, buf, count, type, peer, comm, stream);
    ncclResult_t e = ncclGroupEnd();
    return r != ncclSuccess ? r : e;
}
