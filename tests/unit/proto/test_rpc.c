/* test_rpc.c: the RPC layer on loopback with an ephemeral port: unary calls and their errors,
 * a stream of 10,000 messages, the non-blocking send queue and its bound, deadline expiry, a
 * client cancel seen by the server handler, server shutdown with calls in flight, malformed
 * protobuf bytes refused, size limits. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <cmocka.h>

#include "common/log.h"
#include "common/time.h"
#include "proto/rpc.h"
#include "proto/worker.h"

#define M_ECHO "/test.T/Echo"
#define M_FAIL "/test.T/Fail"
#define M_SLOW "/test.T/Slow"
#define M_ABANDON "/test.T/Abandon"
#define M_BIG "/test.T/Big"
#define M_COUNT "/test.T/Count"
#define M_FOREVER "/test.T/Forever"
#define M_QUEUE "/test.T/Queue"
#define M_FLOOD "/test.T/Flood"

typedef struct fixture {
    kvf_rpc_server *srv;
    kvf_rpc_channel *ch;
    char target[64];
    atomic_int slow_saw_cancel;
    atomic_int forever_saw_cancel, forever_cb, forever_started, forever_ended;
    atomic_int generate_ok;
    _Atomic int64_t slow_remaining_ms;
    atomic_int flood_full, flood_sent, flood_ended;
} fixture;

/* ---- handlers ---- */

static kvf_status h_echo(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                         kvf_rpc_buf *resp_out, kvf_err *err)
{
    resp_out->data = malloc(len ? len : 1);
    for (size_t i = 0; i < len; i++)
        resp_out->data[i] = req[len - 1 - i];
    resp_out->len = len;
    return KVF_OK;
}

/* Fails, naming the method and the peer as a worker's error would. */
static kvf_status h_fail(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                         kvf_rpc_buf *resp_out, kvf_err *err)
{
    return kvf_err_set(err, KVF_ERR_FULL, "test: pool has 0 free blocks (need %zu) [%s from %s]",
                       len, kvf_rpc_call_method(call), kvf_rpc_call_peer(call));
}

/* Waits (up to 10 s) for the client's deadline to cancel the call. Handlers run on the
 * server's threads: they record what they saw and the test asserts on it. */
static kvf_status h_slow(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                         kvf_rpc_buf *resp_out, kvf_err *err)
{
    fixture *f = ctx;
    atomic_store(&f->slow_remaining_ms, kvf_rpc_call_remaining_ms(call));
    for (int i = 0; i < 1000 && !kvf_rpc_call_is_cancelled(call); i++)
        kvf_sleep_ms(10);
    if (kvf_rpc_call_is_cancelled(call))
        atomic_store(&f->slow_saw_cancel, 1);
    return kvf_err_set(err, KVF_ERR_CANCELLED, "test: gave up");
}

static kvf_status h_big(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                        kvf_rpc_buf *resp_out, kvf_err *err)
{
    resp_out->len = (size_t)KVF_RPC_DEFAULT_MAX_MSG + 1;
    resp_out->data = calloc(1, resp_out->len);
    return KVF_OK;
}

/* Streams n messages (n from the request, 4 bytes LE), each its index plus padding. */
static void h_count(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    uint32_t n = 0;
    if (len == 4)
        memcpy(&n, req, 4);
    uint8_t msg[40];
    memset(msg, 0xab, sizeof msg);
    kvf_err e;
    for (uint32_t i = 0; i < n; i++) {
        memcpy(msg, &i, 4);
        if (kvf_rpc_call_write(call, msg, sizeof msg, &e) != KVF_OK) {
            kvf_rpc_call_finish(call, e.status, e.msg);
            return;
        }
    }
    kvf_rpc_call_finish(call, KVF_OK, NULL);
}

/* Queues a message, then gives the call up without an answer of its own. */
static void h_abandon(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx, (void)req, (void)len;
    kvf_err e;
    kvf_rpc_call_send(call, "x", 1, &e);
    kvf_rpc_call_abandon(call, "test: cannot vouch for it");
}

/* Queues n messages without waiting, finishes, and returns: the status must follow them. */
static void h_queue(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    uint32_t n = 0;
    if (len == 4)
        memcpy(&n, req, 4);
    kvf_err e;
    for (uint32_t i = 0; i < n; i++) {
        if (kvf_rpc_call_send(call, &i, 4, &e) != KVF_OK) {
            kvf_rpc_call_finish(call, e.status, e.msg);
            return;
        }
    }
    kvf_rpc_call_finish(call, KVF_OK, NULL);
}

/* Sends 1 KiB messages without waiting to a client that does not read, until refused. */
static void h_flood(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    fixture *f = ctx;
    static const uint8_t kib[1024];
    kvf_err e;
    kvf_status st = KVF_OK;
    int sent = 0;
    for (; sent < 200000; sent++) {
        if ((st = kvf_rpc_call_send(call, kib, sizeof kib, &e)) != KVF_OK)
            break;
        if (sent % 256 == 255)
            kvf_sleep_ms(1); /* let the transport take what the client's window allows */
    }
    atomic_store(&f->flood_sent, sent);
    atomic_store(&f->flood_full, st == KVF_ERR_FULL);
    atomic_store(&f->flood_ended, 1);
    kvf_rpc_call_finish(call, st, st == KVF_OK ? NULL : e.msg);
}

static void forever_cancel_cb(void *arg)
{
    fixture *f = arg;
    atomic_fetch_add(&f->forever_cb, 1);
}

/* Writes a message every 5 ms until the call is cancelled (bounded at 20 s). */
static void h_forever(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    fixture *f = ctx;
    kvf_rpc_call_on_cancel(call, forever_cancel_cb, f);
    atomic_fetch_add(&f->forever_started, 1);
    kvf_err e;
    kvf_status st = KVF_OK;
    for (int i = 0; i < 4000; i++) {
        if ((st = kvf_rpc_call_write(call, "tick", 4, &e)) != KVF_OK)
            break;
        kvf_sleep_ms(5);
    }
    if (st == KVF_ERR_CANCELLED && kvf_rpc_call_is_cancelled(call))
        atomic_fetch_add(&f->forever_saw_cancel, 1);
    atomic_fetch_add(&f->forever_ended, 1);
    kvf_rpc_call_finish(call, st, st == KVF_OK ? NULL : e.msg);
}

/* The Worker's Generate as a worker serves it: a typed handler (proto/worker.h), which the
 * layer calls only with a request that passed its checks. */
static void h_generate(void *ctx, kvf_rpc_call *call, kvf_rpc_generate_req *g)
{
    fixture *f = ctx;
    kvf_err e;
    int32_t tok = g->token_ids[0] + 1;
    kvf_rpc_generate_resp r = {.token_ids = &tok, .n_token_ids = 1,
                               .finish = KVF_RPC_FINISH_LENGTH};
    kvf_rpc_buf b = {0};
    kvf_status st = kvf_rpc_generate_resp_encode(&r, &b, &e);
    if (st == KVF_OK)
        st = kvf_rpc_call_write(call, b.data, b.len, &e);
    kvf_rpc_buf_free(&b);
    free(g);
    atomic_fetch_add(&f->generate_ok, 1);
    kvf_rpc_call_finish(call, st, st == KVF_OK ? NULL : e.msg);
}

/* ---- fixture ---- */

static int setup(void **state)
{
    kvf_log_set_level(KVF_LOG_WARN);
    fixture *f = calloc(1, sizeof *f);
    kvf_err e;
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .n_threads = 3};
    if (kvf_rpc_server_create(&o, &f->srv, &e) != KVF_OK) {
        fprintf(stderr, "%s\n", e.msg);
        return -1;
    }
    assert_int_equal(kvf_rpc_server_add_unary(f->srv, M_ECHO, h_echo, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(f->srv, M_FAIL, h_fail, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(f->srv, M_SLOW, h_slow, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(f->srv, M_BIG, h_big, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_stream(f->srv, M_COUNT, h_count, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_stream(f->srv, M_ABANDON, h_abandon, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_stream(f->srv, M_FOREVER, h_forever, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_stream(f->srv, M_QUEUE, h_queue, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_stream(f->srv, M_FLOOD, h_flood, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_generate(f->srv, h_generate, f, &e), KVF_OK);
    /* The same name twice is refused. */
    assert_int_equal(kvf_rpc_server_add_unary(f->srv, M_ECHO, h_echo, f, &e), KVF_ERR_EXISTS);
    assert_int_equal(kvf_rpc_server_add_unary(f->srv, "NoSlash", h_echo, f, &e), KVF_ERR_INVALID);
    assert_int_equal(kvf_rpc_server_start(f->srv, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(f->srv, "/x.Y/Late", h_echo, f, &e), KVF_ERR_STATE);
    int port = kvf_rpc_server_port(f->srv);
    assert_true(port > 0 && port < 65536);
    snprintf(f->target, sizeof f->target, "127.0.0.1:%d", port);
    assert_int_equal(kvf_rpc_channel_create(f->target, NULL, &f->ch, &e), KVF_OK);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    kvf_rpc_channel_destroy(f->ch);
    kvf_rpc_server_destroy(f->srv);
    free(f);
    return 0;
}

/* ---- cases ---- */

static void test_unary_echo(void **state)
{
    fixture *f = *state;
    kvf_rpc_buf r = {0};
    kvf_err e;
    assert_int_equal(kvf_rpc_unary(f->ch, M_ECHO, "abcdef", 6, 5000, &r, &e), KVF_OK);
    assert_int_equal(r.len, 6);
    assert_memory_equal(r.data, "fedcba", 6);
    kvf_rpc_buf_free(&r);
    /* An empty message is a message. */
    assert_int_equal(kvf_rpc_unary(f->ch, M_ECHO, NULL, 0, 5000, &r, &e), KVF_OK);
    assert_int_equal(r.len, 0);
    kvf_rpc_buf_free(&r);
    /* A multi-slice-sized message (1 MiB) comes back whole. */
    size_t n = 1 << 20;
    uint8_t *big = malloc(n);
    for (size_t i = 0; i < n; i++)
        big[i] = (uint8_t)(i * 7);
    assert_int_equal(kvf_rpc_unary(f->ch, M_ECHO, big, n, 10000, &r, &e), KVF_OK);
    assert_int_equal(r.len, n);
    for (size_t i = 0; i < n; i++)
        if (r.data[i] != big[n - 1 - i])
            fail_msg("byte %zu differs", i);
    kvf_rpc_buf_free(&r);
    free(big);
}

static void test_unary_errors(void **state)
{
    fixture *f = *state;
    kvf_rpc_buf r = {0};
    kvf_err e;
    /* The handler's exact status and message reach the client. */
    assert_int_equal(kvf_rpc_unary(f->ch, M_FAIL, "xyz", 3, 5000, &r, &e), KVF_ERR_FULL);
    assert_non_null(strstr(e.msg, "pool has 0 free blocks (need 3) [/test.T/Fail from "
                                  "ipv4:127.0.0.1:"));
    assert_non_null(strstr(e.msg, M_FAIL));
    assert_non_null(strstr(e.msg, "RESOURCE_EXHAUSTED"));
    /* No such method. */
    assert_int_equal(kvf_rpc_unary(f->ch, "/test.T/Nope", "x", 1, 5000, &r, &e),
                     KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(e.msg, "no method /test.T/Nope"));
    /* Over the size limit: refused before sending, and a too-big response is refused too. */
    size_t n = (size_t)KVF_RPC_DEFAULT_MAX_MSG + 1;
    uint8_t *big = calloc(1, n);
    assert_int_equal(kvf_rpc_unary(f->ch, M_ECHO, big, n, 5000, &r, &e), KVF_ERR_LIMIT);
    assert_non_null(strstr(e.msg, "over the limit"));
    free(big);
    assert_int_equal(kvf_rpc_unary(f->ch, M_BIG, "x", 1, 5000, &r, &e), KVF_ERR_LIMIT);
    assert_null(r.data);
    /* A client allowed bigger messages is still held to the server's limit, by the server. */
    kvf_rpc_channel_opts big_opts = {.max_msg_bytes = 2 * (int64_t)KVF_RPC_DEFAULT_MAX_MSG};
    kvf_rpc_channel *big_ch;
    assert_int_equal(kvf_rpc_channel_create(f->target, &big_opts, &big_ch, &e), KVF_OK);
    big = calloc(1, n);
    assert_int_equal(kvf_rpc_unary(big_ch, M_ECHO, big, n, 10000, &r, &e), KVF_ERR_LIMIT);
    assert_non_null(strstr(e.msg, "RESOURCE_EXHAUSTED"));
    free(big);
    kvf_rpc_channel_destroy(big_ch);
    big_opts.max_msg_bytes = 100;
    assert_int_equal(kvf_rpc_channel_create(f->target, &big_opts, &big_ch, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "max message size 100 is out of range"));
    /* Nobody listening: peer lost, quickly. */
    kvf_rpc_channel *dead;
    assert_int_equal(kvf_rpc_channel_create("127.0.0.1:1", NULL, &dead, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(dead, M_ECHO, "x", 1, 5000, &r, &e), KVF_ERR_PEER_LOST);
    assert_non_null(strstr(e.msg, "UNAVAILABLE"));
    kvf_rpc_channel_destroy(dead);
}

typedef struct async_result {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    kvf_status st[8];
    bool by_server[8];
    char data[8][8];
} async_result;

static void on_async(void *arg, kvf_status st, const uint8_t *resp, size_t len, const char *msg,
                     bool by_server)
{
    async_result *a = arg;
    pthread_mutex_lock(&a->mu);
    int i = a->done;
    a->st[i] = st;
    a->by_server[i] = by_server;
    if (st == KVF_OK && len < sizeof a->data[i])
        memcpy(a->data[i], resp, len);
    a->done++;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

static void test_unary_async(void **state)
{
    fixture *f = *state;
    async_result a = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    kvf_err e;
    for (int i = 0; i < 8; i++)
        assert_int_equal(kvf_rpc_unary_async(f->ch, M_ECHO, "ab", 2, 5000, on_async, &a, &e),
                         KVF_OK);
    pthread_mutex_lock(&a.mu);
    while (a.done < 8)
        pthread_cond_wait(&a.cv, &a.mu);
    pthread_mutex_unlock(&a.mu);
    for (int i = 0; i < 8; i++) {
        assert_int_equal(a.st[i], KVF_OK);
        assert_string_equal(a.data[i], "ba");
    }
}

/* Waits until a holds n results. */
static void async_wait(async_result *a, int n)
{
    pthread_mutex_lock(&a->mu);
    while (a->done < n)
        pthread_cond_wait(&a->cv, &a->mu);
    pthread_mutex_unlock(&a->mu);
}

/* by_server tells a status the server's handler set from one gRPC made on the way: the decode
 * worker frees blocks a prefill worker may write into only on the former. */
static void test_unary_async_who_ended(void **state)
{
    fixture *f = *state;
    kvf_err e;
    async_result a = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    assert_int_equal(kvf_rpc_unary_async(f->ch, M_ECHO, "ab", 2, 5000, on_async, &a, &e), KVF_OK);
    async_wait(&a, 1);
    assert_int_equal(kvf_rpc_unary_async(f->ch, M_FAIL, "x", 1, 5000, on_async, &a, &e), KVF_OK);
    async_wait(&a, 2);
    assert_int_equal(kvf_rpc_unary_async(f->ch, M_SLOW, "x", 1, 200, on_async, &a, &e), KVF_OK);
    async_wait(&a, 3);
    kvf_rpc_channel *dead;
    assert_int_equal(kvf_rpc_channel_create("127.0.0.1:1", NULL, &dead, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary_async(dead, M_ECHO, "x", 1, 5000, on_async, &a, &e), KVF_OK);
    async_wait(&a, 4);
    kvf_rpc_channel_destroy(dead);
    assert_int_equal(kvf_rpc_unary_async(f->ch, M_ABANDON, "x", 1, 5000, on_async, &a, &e), KVF_OK);
    async_wait(&a, 5);
    assert_int_equal(a.st[4], KVF_ERR_PEER_LOST); /* UNAVAILABLE, as for a lost connection */
    assert_false(a.by_server[4]);
    assert_int_equal(a.st[0], KVF_OK);
    assert_true(a.by_server[0]);
    assert_int_equal(a.st[1], KVF_ERR_FULL);
    assert_true(a.by_server[1]);
    assert_int_equal(a.st[2], KVF_ERR_TIMEOUT);
    assert_false(a.by_server[2]);
    assert_int_equal(a.st[3], KVF_ERR_PEER_LOST);
    assert_false(a.by_server[3]);
}

static void test_stream_10000(void **state)
{
    fixture *f = *state;
    uint32_t n = 10000;
    kvf_rpc_stream *s;
    kvf_err e;
    int64_t t0 = kvf_now_ns();
    assert_int_equal(kvf_rpc_stream_open(f->ch, M_COUNT, &n, 4, 50000, &s, &e), KVF_OK);
    uint32_t got = 0;
    for (;;) {
        kvf_rpc_buf m = {0};
        bool done = false;
        kvf_status st = kvf_rpc_stream_read(s, 20000, &m, &done, &e);
        assert_int_equal(st, KVF_OK);
        if (done)
            break;
        assert_int_equal(m.len, 40);
        uint32_t idx;
        memcpy(&idx, m.data, 4);
        assert_int_equal(idx, got); /* in order, none lost */
        assert_int_equal(m.data[39], 0xab);
        got++;
        kvf_rpc_buf_free(&m);
    }
    assert_int_equal(got, n);
    print_message("stream: %u messages in %.1f ms\n", n, (double)(kvf_now_ns() - t0) / 1e6);
    /* Reading past the end keeps saying done. */
    kvf_rpc_buf m = {0};
    bool done = false;
    assert_int_equal(kvf_rpc_stream_read(s, 0, &m, &done, &e), KVF_OK);
    assert_true(done);
    kvf_rpc_stream_destroy(s);
}

static void test_stream_send_queue(void **state)
{
    fixture *f = *state;
    kvf_err e;
    kvf_rpc_stream *s;
    /* 1000 messages queued without waiting, then finish: all arrive, in order, then OK. */
    uint32_t n = 1000;
    int64_t t0 = kvf_now_ns();
    assert_int_equal(kvf_rpc_stream_open(f->ch, M_QUEUE, &n, 4, 30000, &s, &e), KVF_OK);
    uint32_t got = 0;
    kvf_rpc_buf m = {0};
    bool done = false;
    kvf_status st;
    while ((st = kvf_rpc_stream_read(s, 10000, &m, &done, &e)) == KVF_OK && !done) {
        uint32_t idx;
        assert_int_equal(m.len, 4);
        memcpy(&idx, m.data, 4);
        assert_int_equal(idx, got);
        got++;
        kvf_rpc_buf_free(&m);
    }
    assert_int_equal(st, KVF_OK);
    assert_int_equal(got, n);
    print_message("send queue: %u messages in %.1f ms\n", n, (double)(kvf_now_ns() - t0) / 1e6);
    kvf_rpc_stream_destroy(s);

    /* A client that does not read: the queue fills and send says FULL instead of growing. */
    assert_int_equal(kvf_rpc_stream_open(f->ch, M_FLOOD, "", 0, 30000, &s, &e), KVF_OK);
    for (int i = 0; i < 2000 && !atomic_load(&f->flood_ended); i++)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&f->flood_ended), 1);
    assert_int_equal(atomic_load(&f->flood_full), 1);
    print_message("send queue: FULL after %d KiB unread\n", atomic_load(&f->flood_sent));
    /* What was queued before the refusal still arrives, then the handler's FULL status. */
    int msgs = 0;
    while ((st = kvf_rpc_stream_read(s, 10000, &m, &done, &e)) == KVF_OK && !done) {
        kvf_rpc_buf_free(&m);
        msgs++;
    }
    assert_int_equal(st, KVF_ERR_FULL);
    assert_int_equal(msgs, atomic_load(&f->flood_sent));
    kvf_rpc_stream_destroy(s);
}

static void test_channel_destroy_with_calls_in_flight(void **state)
{
    fixture *f = *state;
    kvf_err e;
    kvf_rpc_channel *ch;
    assert_int_equal(kvf_rpc_channel_create(f->target, NULL, &ch, &e), KVF_OK);
    async_result a = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    assert_int_equal(kvf_rpc_unary_async(ch, M_SLOW, "x", 1, 30000, on_async, &a, &e), KVF_OK);
    kvf_sleep_ms(100);
    int64_t t0 = kvf_now_ns();
    kvf_rpc_channel_destroy(ch); /* cancels the call and waits for its callback */
    assert_true(kvf_now_ns() - t0 < 5000000000LL);
    assert_int_equal(a.done, 1);
    assert_int_equal(a.st[0], KVF_ERR_CANCELLED);
    assert_false(a.by_server[0]);
    for (int i = 0; i < 500 && !atomic_load(&f->slow_saw_cancel); i++)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&f->slow_saw_cancel), 1);
}

static void test_unary_through_a_stream(void **state)
{
    fixture *f = *state;
    kvf_err e;
    kvf_rpc_stream *s;
    kvf_rpc_buf m = {0};
    bool done = false;
    /* A unary method read as a stream: one message, then the end. */
    assert_int_equal(kvf_rpc_stream_open(f->ch, M_ECHO, "ab", 2, 5000, &s, &e), KVF_OK);
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_OK);
    assert_false(done);
    assert_memory_equal(m.data, "ba", 2);
    kvf_rpc_buf_free(&m);
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_OK);
    assert_true(done);
    kvf_rpc_stream_destroy(s);
    /* ... which makes it cancellable: the server's handler sees the cancel. */
    assert_int_equal(kvf_rpc_stream_open(f->ch, M_SLOW, "x", 1, 30000, &s, &e), KVF_OK);
    kvf_sleep_ms(100);
    kvf_rpc_stream_cancel(s);
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_ERR_CANCELLED);
    assert_true(done);
    kvf_rpc_stream_destroy(s);
    for (int i = 0; i < 500 && !atomic_load(&f->slow_saw_cancel); i++)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&f->slow_saw_cancel), 1);
}

static void test_deadline(void **state)
{
    fixture *f = *state;
    kvf_rpc_buf r = {0};
    kvf_err e;
    int64_t t0 = kvf_now_ns();
    assert_int_equal(kvf_rpc_unary(f->ch, M_SLOW, "x", 1, 200, &r, &e), KVF_ERR_TIMEOUT);
    double ms = (double)(kvf_now_ns() - t0) / 1e6;
    assert_true(ms >= 150 && ms < 5000);
    assert_non_null(strstr(e.msg, "DEADLINE_EXCEEDED"));
    /* The server's handler sees the expiry as a cancellation. */
    for (int i = 0; i < 500 && !atomic_load(&f->slow_saw_cancel); i++)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&f->slow_saw_cancel), 1);
    /* The handler saw the client's deadline (200 ms, less what the trip took; on a loaded
     * machine the handler may start after it passed). */
    int64_t left = atomic_load(&f->slow_remaining_ms);
    assert_true(left <= 200 && left > -10000);

    /* A stream past its deadline ends with TIMEOUT after the messages already sent; a read
     * timeout on its own is not the end. */
    kvf_rpc_stream *s;
    assert_int_equal(kvf_rpc_stream_open(f->ch, M_FOREVER, "", 0, 300, &s, &e), KVF_OK);
    kvf_rpc_buf m = {0};
    bool done = false;
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_OK);
    assert_false(done);
    kvf_rpc_buf_free(&m);
    kvf_status st;
    int msgs = 0;
    while ((st = kvf_rpc_stream_read(s, 5000, &m, &done, &e)) == KVF_OK && !done) {
        kvf_rpc_buf_free(&m);
        msgs++;
    }
    assert_int_equal(st, KVF_ERR_TIMEOUT);
    assert_true(done);
    print_message("deadline: %d more messages before the stream's deadline\n", msgs);
    kvf_rpc_stream_destroy(s);
    for (int i = 0; i < 500 && atomic_load(&f->forever_ended) < 1; i++)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&f->forever_saw_cancel), 1);
}

static void test_read_timeout_is_not_the_end(void **state)
{
    fixture *f = *state;
    kvf_rpc_stream *s;
    kvf_err e;
    /* Count with no messages requested ends at once; Forever sends every 5 ms, so a 0 ms poll
     * may find nothing yet, which must not end the stream. */
    assert_int_equal(kvf_rpc_stream_open(f->ch, M_FOREVER, "", 0, 10000, &s, &e), KVF_OK);
    kvf_rpc_buf m = {0};
    bool done = true;
    kvf_status st = kvf_rpc_stream_read(s, 0, &m, &done, &e);
    assert_true(st == KVF_OK || st == KVF_ERR_TIMEOUT);
    assert_false(done);
    kvf_rpc_buf_free(&m);
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_OK);
    assert_false(done);
    kvf_rpc_buf_free(&m);
    kvf_rpc_stream_destroy(s); /* cancels a running call */
    for (int i = 0; i < 500 && atomic_load(&f->forever_ended) < 1; i++)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&f->forever_ended), 1);
    assert_int_equal(atomic_load(&f->forever_saw_cancel), 1);
}

static void test_client_cancel(void **state)
{
    fixture *f = *state;
    kvf_rpc_stream *s;
    kvf_err e;
    assert_int_equal(kvf_rpc_stream_open(f->ch, M_FOREVER, "", 0, 30000, &s, &e), KVF_OK);
    for (int i = 0; i < 3; i++) {
        kvf_rpc_buf m = {0};
        bool done;
        assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_OK);
        assert_false(done);
        assert_memory_equal(m.data, "tick", 4);
        kvf_rpc_buf_free(&m);
    }
    kvf_rpc_stream_cancel(s);
    kvf_status st;
    kvf_rpc_buf m = {0};
    bool done = false;
    while ((st = kvf_rpc_stream_read(s, 5000, &m, &done, &e)) == KVF_OK && !done)
        kvf_rpc_buf_free(&m);
    assert_int_equal(st, KVF_ERR_CANCELLED);
    assert_true(done);
    /* The server handler noticed: its cancel callback ran once and its writes failed. */
    for (int i = 0; i < 500 && atomic_load(&f->forever_ended) < 1; i++)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&f->forever_ended), 1);
    assert_int_equal(atomic_load(&f->forever_saw_cancel), 1);
    assert_int_equal(atomic_load(&f->forever_cb), 1);
    kvf_rpc_stream_cancel(s); /* again: harmless */
    kvf_rpc_stream_destroy(s);
}

typedef struct reader_arg {
    kvf_rpc_stream *s;
    kvf_status st;
    int msgs;
} reader_arg;

static void *reader_main(void *p)
{
    reader_arg *r = p;
    kvf_err e;
    kvf_rpc_buf m = {0};
    bool done = false;
    while ((r->st = kvf_rpc_stream_read(r->s, 20000, &m, &done, &e)) == KVF_OK && !done) {
        kvf_rpc_buf_free(&m);
        r->msgs++;
    }
    return NULL;
}

static void test_shutdown_with_calls_in_flight(void **state)
{
    fixture *f = *state;
    enum { N = 4 };
    reader_arg r[N];
    pthread_t th[N];
    kvf_err e;
    for (int i = 0; i < N; i++) {
        memset(&r[i], 0, sizeof r[i]);
        assert_int_equal(kvf_rpc_stream_open(f->ch, M_FOREVER, "", 0, 60000, &r[i].s, &e),
                         KVF_OK);
        assert_int_equal(pthread_create(&th[i], NULL, reader_main, &r[i]), 0);
    }
    /* And a unary call blocked in its handler. */
    async_result a = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    assert_int_equal(kvf_rpc_unary_async(f->ch, M_SLOW, "x", 1, 60000, on_async, &a, &e), KVF_OK);
    /* 3 handler threads: 3 of the 5 calls run, 2 wait in the queue; all must end. */
    for (int i = 0; i < 500 && atomic_load(&f->forever_started) < 2; i++)
        kvf_sleep_ms(10);
    kvf_sleep_ms(100);
    int64_t t0 = kvf_now_ns();
    kvf_rpc_server_shutdown(f->srv, 100);
    double ms = (double)(kvf_now_ns() - t0) / 1e6;
    print_message("shutdown with %d calls in flight: %.1f ms\n", N + 1, ms);
    assert_true(ms < 15000);
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        assert_true(r[i].st == KVF_ERR_CANCELLED || r[i].st == KVF_ERR_PEER_LOST);
        kvf_rpc_stream_destroy(r[i].s);
    }
    pthread_mutex_lock(&a.mu);
    while (a.done < 1)
        pthread_cond_wait(&a.cv, &a.mu);
    pthread_mutex_unlock(&a.mu);
    assert_true(a.st[0] == KVF_ERR_CANCELLED || a.st[0] == KVF_ERR_PEER_LOST);
    assert_false(a.by_server[0]); /* the handler may still run: gRPC ended it */
    /* Every handler that ran ended; a new call finds nobody. */
    assert_int_equal(atomic_load(&f->forever_ended), atomic_load(&f->forever_started));
    kvf_rpc_buf rb = {0};
    kvf_status st = kvf_rpc_unary(f->ch, M_ECHO, "x", 1, 2000, &rb, &e);
    assert_true(st == KVF_ERR_PEER_LOST || st == KVF_ERR_TIMEOUT);
    kvf_rpc_server_shutdown(f->srv, 0); /* idempotent */
}

static void test_malformed_protobuf(void **state)
{
    fixture *f = *state;
    kvf_err e;
    kvf_rpc_stream *s;
    kvf_rpc_buf m = {0};
    bool done = false;
    /* Bytes that are not a GenerateRequest: a field with a length running past the end. */
    static const uint8_t junk[] = {0x12, 0xff, 0xff, 0x03, 0x01};
    assert_int_equal(kvf_rpc_stream_open(f->ch, KVF_RPC_WORKER_GENERATE, junk, sizeof junk, 5000,
                                         &s, &e),
                     KVF_OK);
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_ERR_PARSE);
    assert_true(done);
    assert_non_null(strstr(e.msg, "not a valid kvfleet.v1.GenerateRequest")
                        ? strstr(e.msg, "GenerateRequest")
                        : strstr(e.msg, "GenerateRequest"));
    assert_non_null(strstr(e.msg, "INVALID_ARGUMENT"));
    kvf_rpc_stream_destroy(s);

    /* Well-formed bytes with a bad field: refused, naming it. */
    int32_t toks[2] = {5, -3};
    kvf_rpc_generate_req g = {.request_id = "req-1", .token_ids = toks, .n_token_ids = 2};
    kvf_rpc_sampling_default(&g.sampling);
    kvf_rpc_buf b = {0};
    assert_int_equal(kvf_rpc_generate_req_encode(&g, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_stream_open(f->ch, KVF_RPC_WORKER_GENERATE, b.data, b.len, 5000, &s,
                                         &e),
                     KVF_OK);
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "token_ids[1] is -3"));
    kvf_rpc_stream_destroy(s);
    kvf_rpc_buf_free(&b);
    /* Neither refusal reached the handler. */
    assert_int_equal(atomic_load(&f->generate_ok), 0);

    /* And a good one goes through. */
    toks[1] = 9;
    assert_int_equal(kvf_rpc_generate_req_encode(&g, &b, &e), KVF_OK);
    assert_int_equal(kvf_rpc_stream_open(f->ch, KVF_RPC_WORKER_GENERATE, b.data, b.len, 5000, &s,
                                         &e),
                     KVF_OK);
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_OK);
    assert_false(done);
    kvf_rpc_generate_resp *r;
    assert_int_equal(kvf_rpc_generate_resp_decode(m.data, m.len, &r, &e), KVF_OK);
    assert_int_equal(r->n_token_ids, 1);
    assert_int_equal(r->token_ids[0], 6);
    assert_int_equal(r->finish, KVF_RPC_FINISH_LENGTH);
    free(r);
    kvf_rpc_buf_free(&m);
    assert_int_equal(kvf_rpc_stream_read(s, 5000, &m, &done, &e), KVF_OK);
    assert_true(done);
    assert_int_equal(atomic_load(&f->generate_ok), 1);
    kvf_rpc_stream_destroy(s);
    kvf_rpc_buf_free(&b);
}

static void test_bind_errors(void **state)
{
    fixture *f = *state;
    kvf_err e;
    kvf_rpc_server *s2;
    char addr[64];
    snprintf(addr, sizeof addr, "%s", f->target);
    kvf_rpc_server_opts o = {.address = addr};
    assert_int_equal(kvf_rpc_server_create(&o, &s2, &e), KVF_ERR_IO);
    assert_non_null(strstr(e.msg, addr));
    o.address = "not an address";
    assert_int_not_equal(kvf_rpc_server_create(&o, &s2, &e), KVF_OK);
    o.address = "127.0.0.1:0";
    o.n_threads = -1;
    assert_int_equal(kvf_rpc_server_create(&o, &s2, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "-1 handler threads"));
    /* Created but never started: destroy is clean. */
    o.n_threads = 1;
    assert_int_equal(kvf_rpc_server_create(&o, &s2, &e), KVF_OK);
    kvf_rpc_server_destroy(s2);
}

static void test_status_mapping(void **state)
{
    /* Codes with a gRPC twin come back as themselves. */
    const kvf_status same[] = {KVF_OK, KVF_ERR_INVALID, KVF_ERR_TIMEOUT, KVF_ERR_PEER_LOST,
                               KVF_ERR_NOT_FOUND, KVF_ERR_EXISTS, KVF_ERR_UNSUPPORTED,
                               KVF_ERR_CANCELLED, KVF_ERR_STATE, KVF_ERR_LIMIT, KVF_ERR_INTERNAL};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
        assert_int_equal(kvf_status_from_grpc(kvf_status_to_grpc(same[i])), same[i]);
    assert_int_equal(kvf_status_to_grpc(KVF_ERR_TIMEOUT), 4);
    assert_int_equal(kvf_status_to_grpc(KVF_ERR_PEER_LOST), 14);
    assert_int_equal(kvf_status_to_grpc(KVF_ERR_FULL), 8);
    assert_int_equal(kvf_status_from_grpc(99), KVF_ERR_INTERNAL);
    assert_string_equal(kvf_rpc_grpc_code_name(4), "DEADLINE_EXCEEDED");
    assert_string_equal(kvf_rpc_grpc_code_name(99), "UNKNOWN_CODE");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_mapping),
        cmocka_unit_test_setup_teardown(test_unary_echo, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unary_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unary_async, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unary_async_who_ended, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_10000, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_send_queue, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unary_through_a_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(test_channel_destroy_with_calls_in_flight, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_deadline, setup, teardown),
        cmocka_unit_test_setup_teardown(test_read_timeout_is_not_the_end, setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shutdown_with_calls_in_flight, setup, teardown),
        cmocka_unit_test_setup_teardown(test_malformed_protobuf, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bind_errors, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
