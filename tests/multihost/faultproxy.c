/* faultproxy.c: a user-space TCP proxy for the multihost fault tests (this kernel has no
 * tc netem): listens on one address, forwards every connection to another, and changes how it
 * forwards on a command read from a unix control socket. One thread, poll(), bounded buffers.
 *   faultproxy serve LISTEN_HOST:PORT TARGET_HOST:PORT CTL_PATH
 *       prints "faultproxy: listening HOST:PORT -> TARGET ctl=PATH" once it listens
 *   faultproxy ctl CTL_PATH COMMAND [ARG]   sends one command, prints the answer (exit 0 on ok)
 * Commands (one line each; they act on open and new connections):
 *   pass           forward normally (clears delay, throttle, drop and blackhole)
 *   delay MS       hold every chunk MS ms before forwarding it (both directions)
 *   throttle BPS   at most BPS bytes/s per direction per connection (0: no limit)
 *   drop           close new connections at once (RST); open ones go on
 *   reset          RST every open connection now (SO_LINGER 0, close), both sides
 *   blackhole      stop reading and forwarding in both directions: no RST, no FIN; new
 *                  connections are accepted and left silent
 *   stats          "ok conns=N accepted=N bytes=N mode=..."
 * Peer resets and errors close that connection only (the other side gets an RST too). */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>

#define FP_MAX_CONNS 256
#define FP_MAX_CTL 8
#define FP_SEG_BYTES 16384
#define FP_SEGS 16 /* per direction: at most 256 KiB held */

typedef struct fp_seg {
    int64_t t_ms; /* when it was read */
    size_t len, off;
    char buf[FP_SEG_BYTES];
} fp_seg;

/* one direction of a connection: read from src, write to dst */
typedef struct fp_dir {
    fp_seg segs[FP_SEGS];
    int head, n;        /* ring of segments */
    bool eof;           /* src said FIN */
    bool shut;          /* dst got our FIN */
    double tokens;      /* throttle bucket, bytes */
    int64_t t_tokens;   /* last refill */
} fp_dir;

typedef struct fp_conn {
    bool used;
    int cfd, ufd;        /* client, upstream */
    bool connecting;     /* upstream connect in progress */
    fp_dir c2u, u2c;
} fp_conn;

typedef struct fp_ctl {
    int fd;
    size_t len;
    char buf[256];
} fp_ctl;

static struct {
    int64_t delay_ms;
    int64_t throttle_bps;
    bool drop, blackhole;
    uint64_t accepted, bytes;
    struct sockaddr_storage target;
    socklen_t target_len;
} g;

static fp_conn conns[FP_MAX_CONNS];
static fp_ctl ctls[FP_MAX_CTL];

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* close with an RST instead of a FIN */
static void close_rst(int fd)
{
    if (fd < 0)
        return;
    struct linger l = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close(fd);
}

static void conn_close(fp_conn *c, bool rst)
{
    if (rst) {
        close_rst(c->cfd);
        close_rst(c->ufd);
    } else {
        if (c->cfd >= 0)
            close(c->cfd);
        if (c->ufd >= 0)
            close(c->ufd);
    }
    memset(c, 0, sizeof *c);
    c->cfd = c->ufd = -1;
}

static int parse_hostport(const char *s, struct sockaddr_storage *out, socklen_t *len)
{
    char host[256];
    const char *colon = strrchr(s, ':');
    if (!colon || (size_t)(colon - s) >= sizeof host)
        return -1;
    snprintf(host, sizeof host, "%.*s", (int)(colon - s), s);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(host, colon + 1, &hints, &ai) != 0 || !ai)
        return -1;
    memcpy(out, ai->ai_addr, ai->ai_addrlen);
    *len = ai->ai_addrlen;
    freeaddrinfo(ai);
    return 0;
}

static const char *mode_name(void)
{
    return g.blackhole ? "blackhole" : g.drop ? "drop" : "pass";
}

/* Returns false when accept ran out of descriptors (the listener is then left alone a while,
 * else it would stay readable and the loop would spin). */
static bool conn_accept(int lfd)
{
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0)
        return !(errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM);
    g.accepted++;
    if (g.drop) {
        close_rst(fd);
        return true;
    }
    fp_conn *c = NULL;
    for (int i = 0; i < FP_MAX_CONNS; i++)
        if (!conns[i].used) {
            c = &conns[i];
            break;
        }
    if (!c || set_nonblock(fd) < 0) {
        close_rst(fd);
        return true;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    memset(c, 0, sizeof *c);
    c->used = true;
    c->cfd = fd;
    c->ufd = socket(g.target.ss_family, SOCK_STREAM, 0);
    if (c->ufd < 0 || set_nonblock(c->ufd) < 0) {
        conn_close(c, true);
        return true;
    }
    setsockopt(c->ufd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int64_t t = now_ms();
    c->c2u.t_tokens = c->u2c.t_tokens = t;
    if (connect(c->ufd, (struct sockaddr *)&g.target, g.target_len) < 0) {
        if (errno != EINPROGRESS) {
            conn_close(c, true);
            return true;
        }
        c->connecting = true;
    }
    return true;
}

/* reads what src has into free segments; returns -1 on a reset or error */
static int dir_read(fp_dir *d, int src)
{
    while (d->n < FP_SEGS && !d->eof) {
        fp_seg *s = &d->segs[(d->head + d->n) % FP_SEGS];
        ssize_t r = recv(src, s->buf, FP_SEG_BYTES, 0);
        if (r > 0) {
            s->len = (size_t)r;
            s->off = 0;
            s->t_ms = now_ms();
            d->n++;
            g.bytes += (uint64_t)r;
        } else if (r == 0) {
            d->eof = true;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            break;
        } else {
            return -1;
        }
    }
    return 0;
}

/* the earliest time (ms) the head segment may go out, given delay and throttle */
static int64_t dir_ready_at(fp_dir *d, int64_t t)
{
    if (d->n == 0)
        return INT64_MAX;
    int64_t at = d->segs[d->head].t_ms + g.delay_ms;
    if (g.throttle_bps > 0 && d->tokens < 1.0) {
        int64_t need = (int64_t)((1.0 - d->tokens) * 1000.0 / (double)g.throttle_bps) + 1;
        if (t + need > at)
            at = t + need;
    }
    return at;
}

static void dir_refill(fp_dir *d, int64_t t)
{
    if (g.throttle_bps <= 0)
        return;
    d->tokens += (double)(t - d->t_tokens) * (double)g.throttle_bps / 1000.0;
    /* a burst of at most 1/20 s of the rate (and at least one byte) */
    double cap = (double)g.throttle_bps / 20.0;
    if (cap < 1.0)
        cap = 1.0;
    if (d->tokens > cap)
        d->tokens = cap;
    d->t_tokens = t;
}

/* writes what may go out now to dst; returns -1 on a reset or error */
static int dir_write(fp_dir *d, int dst, int64_t t)
{
    dir_refill(d, t);
    while (d->n > 0) {
        fp_seg *s = &d->segs[d->head];
        if (s->t_ms + g.delay_ms > t)
            break;
        size_t len = s->len - s->off;
        if (g.throttle_bps > 0) {
            if (d->tokens < 1.0)
                break;
            if ((double)len > d->tokens)
                len = (size_t)d->tokens;
        }
        ssize_t w = send(dst, s->buf + s->off, len, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                break;
            return -1;
        }
        if (g.throttle_bps > 0)
            d->tokens -= (double)w;
        s->off += (size_t)w;
        if (s->off == s->len) {
            d->head = (d->head + 1) % FP_SEGS;
            d->n--;
        }
        if ((size_t)w < len)
            break;
    }
    if (d->eof && d->n == 0 && !d->shut) {
        shutdown(dst, SHUT_WR);
        d->shut = true;
    }
    return 0;
}

static void ctl_reply(fp_ctl *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#include <stdarg.h>
static void ctl_reply(fp_ctl *k, const char *fmt, ...)
{
    char out[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, sizeof out - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n > sizeof out - 2)
        n = (int)sizeof out - 2;
    out[n++] = '\n';
    (void)!send(k->fd, out, (size_t)n, MSG_NOSIGNAL);
}

static void ctl_exec(fp_ctl *k, char *line)
{
    char cmd[32] = "";
    long long arg = -1;
    int n = sscanf(line, "%31s %lld", cmd, &arg);
    if (n < 1) {
        ctl_reply(k, "error: empty command");
        return;
    }
    if (strcmp(cmd, "pass") == 0) {
        g.delay_ms = 0;
        g.throttle_bps = 0;
        g.drop = g.blackhole = false;
    } else if (strcmp(cmd, "delay") == 0 && n == 2 && arg >= 0 && arg <= 3600000) {
        g.delay_ms = arg; /* at most an hour: times stay far from overflow */
    } else if (strcmp(cmd, "throttle") == 0 && n == 2 && arg >= 0 && arg <= 1000000000000LL) {
        g.throttle_bps = arg;
        int64_t t = now_ms();
        for (int i = 0; i < FP_MAX_CONNS; i++) {
            conns[i].c2u.tokens = conns[i].u2c.tokens = 0;
            conns[i].c2u.t_tokens = conns[i].u2c.t_tokens = t;
        }
    } else if (strcmp(cmd, "drop") == 0) {
        g.drop = true;
    } else if (strcmp(cmd, "reset") == 0) {
        int r = 0;
        for (int i = 0; i < FP_MAX_CONNS; i++)
            if (conns[i].used) {
                conn_close(&conns[i], true);
                r++;
            }
        ctl_reply(k, "ok reset %d", r);
        return;
    } else if (strcmp(cmd, "blackhole") == 0) {
        g.blackhole = true;
    } else if (strcmp(cmd, "stats") == 0) {
        /* falls through to the answer */
    } else {
        ctl_reply(k, "error: unknown command '%s' (pass, delay MS, throttle BPS, drop, reset, "
                  "blackhole, stats)", line);
        return;
    }
    int open = 0;
    for (int i = 0; i < FP_MAX_CONNS; i++)
        open += conns[i].used;
    ctl_reply(k, "ok conns=%d accepted=%llu bytes=%llu mode=%s delay=%lld throttle=%lld", open,
              (unsigned long long)g.accepted, (unsigned long long)g.bytes, mode_name(),
              (long long)g.delay_ms, (long long)g.throttle_bps);
}

static void ctl_read(fp_ctl *k)
{
    ssize_t r = recv(k->fd, k->buf + k->len, sizeof k->buf - 1 - k->len, 0);
    if (r < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (r > 0) {
        k->len += (size_t)r;
        k->buf[k->len] = '\0';
        char *nl = strchr(k->buf, '\n');
        if (!nl && k->len < sizeof k->buf - 1)
            return;
        if (nl)
            *nl = '\0';
        ctl_exec(k, k->buf);
    }
    close(k->fd);
    k->fd = -1;
    k->len = 0;
}

static int unix_addr(const char *path, struct sockaddr_un *sa)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    if (strlen(path) >= sizeof sa->sun_path)
        return -1;
    strcpy(sa->sun_path, path);
    return 0;
}

static int cmd_ctl(int argc, char **argv)
{
    struct sockaddr_un sa;
    if (argc < 4 || unix_addr(argv[2], &sa) < 0) {
        fprintf(stderr, "usage: faultproxy ctl CTL_PATH COMMAND [ARG]\n");
        return 2;
    }
    char line[256];
    snprintf(line, sizeof line, "%s%s%s\n", argv[3], argc > 4 ? " " : "", argc > 4 ? argv[4] : "");
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        fprintf(stderr, "faultproxy ctl: %s: %s\n", argv[2], strerror(errno));
        return 1;
    }
    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    (void)!send(fd, line, strlen(line), MSG_NOSIGNAL);
    char out[512];
    size_t len = 0;
    ssize_t r;
    while (len < sizeof out - 1 && (r = recv(fd, out + len, sizeof out - 1 - len, 0)) > 0)
        len += (size_t)r;
    out[len] = '\0';
    close(fd);
    fputs(out, stdout);
    return strncmp(out, "ok", 2) == 0 ? 0 : 1;
}

static int cmd_serve(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: faultproxy serve LISTEN_HOST:PORT TARGET_HOST:PORT CTL_PATH\n");
        return 2;
    }
    struct sockaddr_storage la;
    socklen_t llen;
    if (parse_hostport(argv[2], &la, &llen) < 0 || parse_hostport(argv[3], &g.target, &g.target_len) < 0) {
        fprintf(stderr, "faultproxy: '%s' or '%s' is no HOST:PORT that resolves\n", argv[2], argv[3]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int lfd = socket(la.ss_family, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&la, llen) < 0 || listen(lfd, 128) < 0 ||
        set_nonblock(lfd) < 0) {
        fprintf(stderr, "faultproxy: listening on %s: %s\n", argv[2], strerror(errno));
        return 1;
    }
    struct sockaddr_un ua;
    int cfd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (unix_addr(argv[4], &ua) < 0 || cfd < 0) {
        fprintf(stderr, "faultproxy: control path '%s' is too long\n", argv[4]);
        return 2;
    }
    unlink(argv[4]);
    if (bind(cfd, (struct sockaddr *)&ua, sizeof ua) < 0 || listen(cfd, 8) < 0 || set_nonblock(cfd) < 0) {
        fprintf(stderr, "faultproxy: control socket %s: %s\n", argv[4], strerror(errno));
        return 1;
    }
    for (int i = 0; i < FP_MAX_CONNS; i++)
        conns[i].cfd = conns[i].ufd = -1;
    for (int i = 0; i < FP_MAX_CTL; i++)
        ctls[i].fd = -1;
    struct sockaddr_storage bound;
    socklen_t blen = sizeof bound;
    getsockname(lfd, (struct sockaddr *)&bound, &blen);
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (bound.ss_family == AF_INET) {
        inet_ntop(AF_INET, &((struct sockaddr_in *)&bound)->sin_addr, host, sizeof host);
        port = ntohs(((struct sockaddr_in *)&bound)->sin_port);
    } else {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&bound)->sin6_addr, host, sizeof host);
        port = ntohs(((struct sockaddr_in6 *)&bound)->sin6_port);
    }
    printf("faultproxy: listening %s:%d -> %s ctl=%s\n", host, port, argv[3], argv[4]);
    fflush(stdout);

    /* pollfd slots: 0 listener, 1 control listener, then 2 per connection, then control clients */
    static struct pollfd pf[2 + 2 * FP_MAX_CONNS + FP_MAX_CTL];
    int64_t listen_pause = 0; /* out of descriptors: the listener rests until then */
    for (;;) {
        int64_t t = now_ms(), wake = INT64_MAX;
        int n = 0;
        if (t < listen_pause)
            wake = listen_pause;
        pf[n++] = (struct pollfd){.fd = t < listen_pause ? -1 : lfd, .events = POLLIN};
        pf[n++] = (struct pollfd){.fd = cfd, .events = POLLIN};
        for (int i = 0; i < FP_MAX_CONNS; i++) {
            fp_conn *c = &conns[i];
            short ce = 0, ue = 0;
            if (c->used && !g.blackhole) {
                if (c->connecting) {
                    ue = POLLOUT;
                } else {
                    if (c->c2u.n < FP_SEGS && !c->c2u.eof)
                        ce |= POLLIN;
                    if (c->u2c.n < FP_SEGS && !c->u2c.eof)
                        ue |= POLLIN;
                    int64_t a = dir_ready_at(&c->c2u, t), b = dir_ready_at(&c->u2c, t);
                    if (a <= t)
                        ue |= POLLOUT;
                    else if (a < wake)
                        wake = a;
                    if (b <= t)
                        ce |= POLLOUT;
                    else if (b < wake)
                        wake = b;
                }
            }
            /* a side we neither read from (FIN seen) nor write to (FIN sent) is not polled */
            /* nor is one with nothing to do now (its buffer full, its output held by delay or
             * throttle): a hang-up there would be reported again and again and spin the loop;
             * it is seen once the buffer drains. A connecting one's client is polled for its
             * hang-up alone. */
            bool cl = c->used && !g.blackhole && !(c->c2u.eof && c->u2c.shut) && (ce || c->connecting);
            bool ul = c->used && !g.blackhole && (c->connecting || !(c->u2c.eof && c->c2u.shut)) && ue;
            pf[n++] = (struct pollfd){.fd = cl ? c->cfd : -1, .events = ce};
            pf[n++] = (struct pollfd){.fd = ul ? c->ufd : -1, .events = ue};
        }
        for (int i = 0; i < FP_MAX_CTL; i++)
            pf[n++] = (struct pollfd){.fd = ctls[i].fd, .events = POLLIN};
        int timeout = wake == INT64_MAX ? 1000 : (int)(wake - t < 0 ? 0 : wake - t);
        if (poll(pf, (nfds_t)n, timeout) < 0 && errno != EINTR) {
            perror("faultproxy: poll");
            return 1;
        }
        t = now_ms();
        if ((pf[0].revents & POLLIN) && !conn_accept(lfd))
            listen_pause = t + 100;
        if (pf[1].revents & POLLIN) {
            int k = accept(cfd, NULL, NULL);
            if (k >= 0) {
                int slot = -1;
                for (int i = 0; i < FP_MAX_CTL; i++)
                    if (ctls[i].fd < 0) {
                        slot = i;
                        break;
                    }
                if (slot < 0 || set_nonblock(k) < 0) {
                    close(k);
                } else {
                    ctls[slot].fd = k;
                    ctls[slot].len = 0;
                }
            }
        }
        for (int i = 0; i < FP_MAX_CONNS; i++) {
            fp_conn *c = &conns[i];
            short cr = pf[2 + 2 * i].revents, ur = pf[3 + 2 * i].revents;
            if (!c->used || g.blackhole)
                continue;
            if (c->connecting) {
                if (cr & (POLLERR | POLLHUP)) { /* the client left before the target answered */
                    conn_close(c, true);
                    continue;
                }
                if (!(ur & (POLLOUT | POLLERR | POLLHUP)))
                    continue;
                int e = 0;
                socklen_t el = sizeof e;
                getsockopt(c->ufd, SOL_SOCKET, SO_ERROR, &e, &el);
                if (e != 0) {
                    conn_close(c, true);
                    continue;
                }
                c->connecting = false;
                continue;
            }
            /* an error, or a hang-up on a side we no longer read from (its write side is gone
             * too): nothing more can pass, so both sides get an RST */
            bool bad = (cr & POLLERR) || (ur & POLLERR) || ((cr & POLLHUP) && c->c2u.eof) ||
                       ((ur & POLLHUP) && c->u2c.eof);
            if (!bad && (cr & (POLLIN | POLLHUP)))
                bad |= dir_read(&c->c2u, c->cfd) < 0;
            if (!bad && (ur & (POLLIN | POLLHUP)))
                bad |= dir_read(&c->u2c, c->ufd) < 0;
            if (!bad)
                bad |= dir_write(&c->c2u, c->ufd, t) < 0;
            if (!bad)
                bad |= dir_write(&c->u2c, c->cfd, t) < 0;
            if (bad)
                conn_close(c, true); /* a reset on one side resets the other */
            else if (c->c2u.shut && c->u2c.shut)
                conn_close(c, false);
        }
        for (int i = 0; i < FP_MAX_CTL; i++) {
            short r = pf[2 + 2 * FP_MAX_CONNS + i].revents;
            if (ctls[i].fd >= 0 && (r & (POLLIN | POLLHUP | POLLERR)))
                ctl_read(&ctls[i]);
        }
    }
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "serve") == 0)
        return cmd_serve(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "ctl") == 0)
        return cmd_ctl(argc, argv);
    fprintf(stderr, "usage: faultproxy serve LISTEN_HOST:PORT TARGET_HOST:PORT CTL_PATH\n"
                    "       faultproxy ctl CTL_PATH COMMAND [ARG]\n");
    return 2;
}
