/* test_peer_loss.c: peers that go away. A server in a child process (forked before gRPC starts
 * in this one) is frozen with SIGSTOP mid-stream: keepalive must fail the stream with
 * KVF_ERR_PEER_LOST within seconds rather than hang. A server that is destroyed and comes back
 * on the same port is reached again by the same channel within a few seconds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "common/log.h"
#include "common/time.h"
#include "proto/rpc.h"

static pid_t child = -1;
static int child_port;

/* Sends one message, then holds the stream open until cancelled (or 60 s). */
static void h_hold(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    kvf_err e;
    kvf_status st = kvf_rpc_call_write(call, "hi", 2, &e);
    for (int i = 0; st == KVF_OK && i < 6000 && !kvf_rpc_call_is_cancelled(call); i++)
        kvf_sleep_ms(10);
    kvf_rpc_call_finish(call, KVF_OK, NULL);
}

static kvf_status h_echo(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                         kvf_rpc_buf *resp_out, kvf_err *err)
{
    resp_out->data = malloc(len + 1);
    memcpy(resp_out->data, req, len);
    resp_out->len = len;
    return KVF_OK;
}

/* The child: a server that reports its port on fd and serves until killed. */
static void child_main(int fd)
{
    kvf_log_set_level(KVF_LOG_ERROR);
    kvf_rpc_server *srv;
    kvf_err e;
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .n_threads = 2};
    int port = -1;
    if (kvf_rpc_server_create(&o, &srv, &e) == KVF_OK &&
        kvf_rpc_server_add_stream(srv, "/t.T/Hold", h_hold, NULL, &e) == KVF_OK &&
        kvf_rpc_server_start(srv, &e) == KVF_OK)
        port = kvf_rpc_server_port(srv);
    if (write(fd, &port, sizeof port) != (ssize_t)sizeof port || port < 0)
        _exit(1);
    for (;;)
        pause();
}

static void test_frozen_server_fails_the_stream(void **state)
{
    assert_true(child_port > 0);
    kvf_err e;
    kvf_rpc_channel_opts co = {.keepalive_ms = 300};
    kvf_rpc_channel *ch;
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", child_port);
    assert_int_equal(kvf_rpc_channel_create(target, &co, &ch, &e), KVF_OK);
    kvf_rpc_stream *s;
    assert_int_equal(kvf_rpc_stream_open(ch, "/t.T/Hold", "", 0, KVF_RPC_NO_DEADLINE, &s, &e),
                     KVF_OK);
    kvf_rpc_buf m = {0};
    bool done = false;
    assert_int_equal(kvf_rpc_stream_read(s, 10000, &m, &done, &e), KVF_OK);
    assert_false(done);
    assert_memory_equal(m.data, "hi", 2);
    kvf_rpc_buf_free(&m);

    /* Freeze the server: the connection stays open but nothing answers, not even pings. */
    assert_int_equal(kill(child, SIGSTOP), 0);
    int64_t t0 = kvf_now_ns();
    kvf_status st = kvf_rpc_stream_read(s, 30000, &m, &done, &e);
    double secs = (double)(kvf_now_ns() - t0) / 1e9;
    print_message("frozen server noticed after %.2f s: %s\n", secs, e.msg);
    assert_int_equal(st, KVF_ERR_PEER_LOST);
    assert_true(done);
    assert_true(secs < 20);
    kvf_rpc_stream_destroy(s);
    kvf_rpc_channel_destroy(ch);
    kill(child, SIGKILL);
    kill(child, SIGCONT);
}

static void test_server_comes_back(void **state)
{
    kvf_log_set_level(KVF_LOG_ERROR);
    kvf_err e;
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .n_threads = 1};
    kvf_rpc_server *srv;
    assert_int_equal(kvf_rpc_server_create(&o, &srv, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(srv, "/t.T/Echo", h_echo, NULL, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_start(srv, &e), KVF_OK);
    int port = kvf_rpc_server_port(srv);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    kvf_rpc_channel *ch;
    assert_int_equal(kvf_rpc_channel_create(addr, NULL, &ch, &e), KVF_OK);
    kvf_rpc_buf r = {0};
    assert_int_equal(kvf_rpc_unary(ch, "/t.T/Echo", "a", 1, 5000, &r, &e), KVF_OK);
    kvf_rpc_buf_free(&r);

    kvf_rpc_server_destroy(srv);
    assert_int_equal(kvf_rpc_unary(ch, "/t.T/Echo", "a", 1, 5000, &r, &e), KVF_ERR_PEER_LOST);
    kvf_sleep_ms(1500); /* let the channel's reconnect backoff grow a little */

    o.address = addr;
    assert_int_equal(kvf_rpc_server_create(&o, &srv, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(srv, "/t.T/Echo", h_echo, NULL, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_start(srv, &e), KVF_OK);
    int64_t t0 = kvf_now_ns();
    kvf_status st;
    while ((st = kvf_rpc_unary(ch, "/t.T/Echo", "b", 1, 1000, &r, &e)) != KVF_OK &&
           kvf_now_ns() - t0 < 15000000000LL)
        kvf_sleep_ms(50);
    double secs = (double)(kvf_now_ns() - t0) / 1e9;
    print_message("server back: reached again after %.2f s\n", secs);
    assert_int_equal(st, KVF_OK);
    assert_true(secs < 5);
    kvf_rpc_buf_free(&r);
    kvf_rpc_channel_destroy(ch);
    kvf_rpc_server_destroy(srv);
}

int main(void)
{
    /* Fork first: gRPC starts threads, and a process must not fork after that. */
    int fds[2];
    if (pipe(fds) != 0)
        return 1;
    child = fork();
    if (child == 0) {
        close(fds[0]);
        child_main(fds[1]);
    }
    close(fds[1]);
    if (child < 0 || read(fds[0], &child_port, sizeof child_port) != (ssize_t)sizeof child_port)
        child_port = -1;
    close(fds[0]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_frozen_server_fails_the_stream),
        cmocka_unit_test(test_server_comes_back),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (child > 0) {
        kill(child, SIGKILL);
        kill(child, SIGCONT);
        waitpid(child, NULL, 0);
    }
    return rc;
}
