/* test_frame.c: the router's wire framing (router/frame.h): where heads end, what is refused
 * and why, and chunked bodies counted across any split. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "router/frame.h"

static kvf_router_frame frame(const char *s, int64_t max_head, int64_t max_body)
{
    kvf_router_frame f;
    kvf_router_frame_head(s, strlen(s), max_head, max_body, &f);
    return f;
}

static void test_heads(void **state)
{
    (void)state;
    kvf_router_frame f = frame("POST /v1/completions HTTP/1.1\r\nContent-Length:  12 \r\n\r\n{\"a\":1}", 1024, 100);
    assert_int_equal(f.kind, KVF_FRAME_OK);
    assert_int_equal(f.head_len, strlen("POST /v1/completions HTTP/1.1\r\nContent-Length:  12 \r\n\r\n"));
    assert_int_equal(f.body_len, 12);
    assert_false(f.chunked);
    assert_false(f.probe);
    assert_int_equal(frame("GET /health HTTP/1.1\r\nHost: x", 1024, 100).kind, KVF_FRAME_MORE);
    assert_true(frame("GET /health?x HTTP/1.0\n\n", 1024, 100).probe);
    assert_true(frame("HEAD /ready HTTP/1.1\r\n\r\n", 1024, 100).probe);
    assert_false(frame("GET /healthz HTTP/1.1\r\n\r\n", 1024, 100).probe);
    assert_false(frame("POST /health HTTP/1.1\r\n\r\n", 1024, 100).probe);
    f = frame("POST / HTTP/1.1\r\ntransfer-encoding: Chunked\r\n\r\n", 1024, 100);
    assert_int_equal(f.kind, KVF_FRAME_OK);
    assert_true(f.chunked);
    /* limits */
    assert_int_equal(frame("POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 1024, 100).kind, KVF_FRAME_BODY_LARGE);
    f = frame("POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n", 1024, 100);
    assert_int_equal(f.kind, KVF_FRAME_BODY_LARGE);
    assert_int_equal(f.body_len, INT64_MAX);
    assert_int_equal(frame("GET / HTTP/1.1\r\nX: 0123456789\r\n\r\n", 24, 100).kind, KVF_FRAME_HEAD_LARGE);
    assert_int_equal(frame("GET / HTTP/1.1\r\nX: 0123456789", 24, 100).kind, KVF_FRAME_HEAD_LARGE);
    /* refused, each with its reason */
    static const struct {
        const char *head, *why;
    } bad[] = {
        {"\r\nGET / HTTP/1.1\r\n\r\n", "request line is empty"},
        {"\r\nGET / HTTP/1.1", "method"},
        {"GET / HTTP/2.0\r\n\r\n", "HTTP/1.x"},
        {"GET  / HTTP/1.1\r\n\r\n", "no target"},
        {"GET / HTTP/1.1\r\nA : b\r\n\r\n", "NAME: VALUE"},
        {"GET / HTTP/1.1\r\nA: b\r\n c\r\n\r\n", "folded"},
        {"GET / HTTP/1.1\r\nA: b\x01\r\n\r\n", "control character"},
        {"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "one decimal number"},
        {"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "one decimal number"},
        {"POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n", "one decimal number"},
        {"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "other than chunked"},
        {"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", "both"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        f = frame(bad[i].head, 1024, 100);
        if (f.kind != KVF_FRAME_BAD || !strstr(f.why, bad[i].why))
            fail_msg("case %zu: kind %d why '%s', want '%s'", i, f.kind, f.why ? f.why : "", bad[i].why);
    }
    /* the same Content-Length twice is one length */
    assert_int_equal(frame("POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n", 1024, 100).kind,
                     KVF_FRAME_OK);
}

/* Feeds s in pieces of `piece` bytes. */
static kvf_router_chunks_result feed(const char *s, size_t piece, int64_t max_body, size_t *used, int64_t *total)
{
    kvf_router_chunks c;
    memset(&c, 0, sizeof c);
    size_t len = strlen(s), off = 0;
    kvf_router_chunks_result r = KVF_CHUNKS_MORE;
    while (off < len && r == KVF_CHUNKS_MORE) {
        size_t n = len - off < piece ? len - off : piece, u = 0;
        r = kvf_router_chunks_feed(&c, s + off, n, max_body, 64, &u);
        off += u;
    }
    *used = off;
    *total = c.total;
    return r;
}

static void test_chunks(void **state)
{
    (void)state;
    const char *body = "5\r\nhello\r\nA \r\n0123456789\r\n0\r\nX-Trailer: 1\r\n\r\nGET / HTTP/1.1\r\n\r\n";
    size_t end = strlen(body) - strlen("GET / HTTP/1.1\r\n\r\n");
    for (size_t piece = 1; piece <= strlen(body); piece++) {
        size_t used;
        int64_t total;
        assert_int_equal(feed(body, piece, 100, &used, &total), KVF_CHUNKS_DONE);
        assert_int_equal(used, end);
        assert_int_equal(total, 15);
    }
    size_t used;
    int64_t total;
    assert_int_equal(feed("5\r\nhello\r\n0\r\n\r\n", 3, 4, &used, &total), KVF_CHUNKS_LARGE);
    assert_int_equal(feed("FFFFFFFFFFFFFFFFFFFF\r\n", 1, 1 << 20, &used, &total), KVF_CHUNKS_LARGE);
    assert_int_equal(feed("3\r\nabc\r\n3\r\nabc\r\n0\r\n\r\n", 2, 5, &used, &total), KVF_CHUNKS_LARGE);
    assert_int_equal(feed("5;ext\r\nhello\r\n0\r\n\r\n", 4, 100, &used, &total), KVF_CHUNKS_BAD);
    assert_int_equal(feed("\r\n", 4, 100, &used, &total), KVF_CHUNKS_BAD);
    assert_int_equal(feed("5\r\nhelloX\r\n", 4, 100, &used, &total), KVF_CHUNKS_BAD);
    assert_int_equal(feed("5\r\nhel", 4, 100, &used, &total), KVF_CHUNKS_MORE);
    assert_int_equal(used, 6);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_heads),
        cmocka_unit_test(test_chunks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
