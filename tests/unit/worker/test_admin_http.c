/* test_admin_http.c: the worker's admin HTTP server serves connections side by side: a probe is
 * answered while idle clients (and one that sent half a request) stay connected, at the connection
 * cap the oldest reading connection makes room, a client past its read deadline is closed, and a
 * client that does not read its answer holds up nobody. Waits are on events, each bounded by
 * WAIT_MS; latencies are printed, never asserted. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/time.h"
#include "worker/worker.h"

#define WAIT_MS 60000 /* bound on every wait: far beyond any answer, short of ctest's timeout */
#define BIG_BYTES (32 << 20) /* more than loopback socket buffers hold */

static int handler(void *ctx, const char *path, kvf_sbuf *body, const char **ctype)
{
    (void)ctx;
    (void)ctype;
    if (strcmp(path, "/health") == 0) {
        kvf_sbuf_puts(body, "{\"status\":\"serving\"}\n");
        return 200;
    }
    if (strcmp(path, "/big") == 0) {
        kvf_sbuf_reserve(body, BIG_BYTES);
        for (int i = 0; i < BIG_BYTES / 64; i++)
            kvf_sbuf_puts(body, "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n");
        return 200;
    }
    kvf_sbuf_printf(body, "no such path %s\n", path);
    return 404;
}

static kvf_worker_http *start(int max_conns, int read_timeout_ms)
{
    kvf_worker_http_opts o = {.max_conns = max_conns, .read_timeout_ms = read_timeout_ms,
                              .write_timeout_ms = WAIT_MS};
    kvf_worker_http *h = NULL;
    kvf_err err = {0};
    kvf_status st = kvf_worker_http_start("127.0.0.1", 0, &o, handler, NULL, &h, &err);
    if (st != KVF_OK)
        fail_msg("kvf_worker_http_start: %s", err.msg);
    return h;
}

static int connect_to(kvf_worker_http *h)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)kvf_worker_http_port(h))};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    return fd;
}

static void send_str(int fd, const char *s)
{
    assert_int_equal(send(fd, s, strlen(s), MSG_NOSIGNAL), (ssize_t)strlen(s));
}

/* Reads until the server closes (bounded by WAIT_MS); returns the bytes, NUL-terminated. */
static char *read_to_eof(int fd, size_t *len_out)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    int64_t until = kvf_now_ns() + (int64_t)WAIT_MS * 1000000;
    for (;;) {
        int64_t left = (until - kvf_now_ns()) / 1000000;
        if (left <= 0)
            fail_msg("no end of the answer within %d ms (%zu bytes so far)", WAIT_MS, n);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)left) <= 0)
            continue;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t k = recv(fd, buf + n, cap - n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        n += (size_t)k;
    }
    buf[n] = '\0';
    if (len_out)
        *len_out = n;
    return buf;
}

/* GET path on a new connection; returns the whole answer and prints how long it took. */
static char *get(kvf_worker_http *h, const char *path)
{
    int64_t t0 = kvf_now_ns();
    int fd = connect_to(h);
    char req[256];
    snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: test\r\n\r\n", path);
    send_str(fd, req);
    char *ans = read_to_eof(fd, NULL);
    close(fd);
    printf("# GET %s answered in %.2f ms\n", path, (double)(kvf_now_ns() - t0) / 1e6);
    return ans;
}

/* Whether the server still holds fd open: nothing to read and no EOF, right now. */
static int still_open(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) == 0;
}

/* Waits (bounded) for the server to close fd: EOF (or a reset) after any bytes it sent. */
static int closed_by_server(int fd)
{
    free(read_to_eof(fd, NULL));
    return 1;
}

static void test_probe_not_behind_idle_clients(void **state)
{
    (void)state;
    kvf_worker_http *h = start(16, WAIT_MS * 2); /* idle clients outlive the test */
    int idle[6];
    for (int i = 0; i < 6; i++)
        idle[i] = connect_to(h);
    int half = connect_to(h);
    send_str(half, "GET /hea");
    char *ans = get(h, "/health");
    assert_non_null(strstr(ans, "HTTP/1.1 200 OK\r\n"));
    assert_non_null(strstr(ans, "\"status\":\"serving\""));
    free(ans);
    /* the probe was answered while every other client is still connected */
    for (int i = 0; i < 6; i++)
        assert_true(still_open(idle[i]));
    assert_true(still_open(half));
    /* and the half request is served once it is complete */
    send_str(half, "lth HTTP/1.1\r\n\r\n");
    ans = read_to_eof(half, NULL);
    assert_non_null(strstr(ans, "HTTP/1.1 200 OK\r\n"));
    free(ans);
    /* the rest of the answers: unknown path, wrong method, HEAD without a body, a request the
     * client ended with EOF instead of a blank line */
    ans = get(h, "/nope");
    assert_non_null(strstr(ans, "HTTP/1.1 404 Not Found\r\n"));
    free(ans);
    int fd = connect_to(h);
    send_str(fd, "POST /health HTTP/1.1\r\n\r\n");
    ans = read_to_eof(fd, NULL);
    assert_non_null(strstr(ans, "HTTP/1.1 405 Method Not Allowed\r\n"));
    free(ans);
    close(fd);
    fd = connect_to(h);
    send_str(fd, "HEAD /health HTTP/1.1\r\n\r\n");
    ans = read_to_eof(fd, NULL);
    assert_non_null(strstr(ans, "HTTP/1.1 200 OK\r\n"));
    assert_null(strstr(ans, "serving"));
    free(ans);
    close(fd);
    fd = connect_to(h);
    send_str(fd, "GET /health HTTP/1.0\r\n");
    shutdown(fd, SHUT_WR);
    ans = read_to_eof(fd, NULL);
    assert_non_null(strstr(ans, "HTTP/1.1 200 OK\r\n"));
    free(ans);
    close(fd);
    for (int i = 0; i < 6; i++)
        close(idle[i]);
    close(half);
    kvf_worker_http_stop(h);
}

static void test_cap_closes_oldest_reader(void **state)
{
    (void)state;
    kvf_worker_http *h = start(4, WAIT_MS * 2);
    int idle[10];
    for (int i = 0; i < 10; i++)
        idle[i] = connect_to(h);
    /* 10 idle clients and the probe through 4 slots: the probe is answered, the 7 oldest idle
     * clients were closed to make room (in order of arrival) and the 3 newest still wait */
    char *ans = get(h, "/health");
    assert_non_null(strstr(ans, "HTTP/1.1 200 OK\r\n"));
    free(ans);
    for (int i = 0; i < 7; i++)
        assert_true(closed_by_server(idle[i]));
    for (int i = 7; i < 10; i++)
        assert_true(still_open(idle[i]));
    for (int i = 0; i < 10; i++)
        close(idle[i]);
    kvf_worker_http_stop(h);
}

static void test_read_deadline_closes_idle(void **state)
{
    (void)state;
    kvf_worker_http *h = start(4, 200);
    int idle = connect_to(h), half = connect_to(h);
    send_str(half, "GET /health HTTP/1.1\r\n"); /* never the blank line */
    size_t n = 1;
    free(read_to_eof(idle, &n)); /* closed at its deadline, with nothing sent */
    assert_int_equal(n, 0);
    free(read_to_eof(half, &n));
    assert_int_equal(n, 0);
    char *ans = get(h, "/health");
    assert_non_null(strstr(ans, "HTTP/1.1 200 OK\r\n"));
    free(ans);
    close(idle);
    close(half);
    kvf_worker_http_stop(h);
}

static void test_slow_reader_holds_up_nobody(void **state)
{
    (void)state;
    kvf_worker_http *h = start(8, WAIT_MS * 2);
    int slow = connect_to(h);
    send_str(slow, "GET /big HTTP/1.1\r\n\r\n");
    char *ans = get(h, "/health"); /* while /big waits for its reader */
    assert_non_null(strstr(ans, "HTTP/1.1 200 OK\r\n"));
    free(ans);
    size_t n = 0;
    ans = read_to_eof(slow, &n); /* and the big answer still arrives whole */
    assert_non_null(strstr(ans, "HTTP/1.1 200 OK\r\n"));
    assert_true(n > BIG_BYTES);
    free(ans);
    close(slow);
    kvf_worker_http_stop(h);
}

static void test_bad_opts(void **state)
{
    (void)state;
    kvf_worker_http_opts o = {.max_conns = -1};
    kvf_worker_http *h = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_worker_http_start("127.0.0.1", 0, &o, handler, NULL, &h, &err),
                     KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "max_conns (-1)"));
    assert_null(h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_probe_not_behind_idle_clients),
        cmocka_unit_test(test_cap_closes_oldest_reader),
        cmocka_unit_test(test_read_deadline_closes_idle),
        cmocka_unit_test(test_slow_reader_holds_up_nobody),
        cmocka_unit_test(test_bad_opts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
