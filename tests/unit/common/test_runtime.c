/* test_runtime.c: status strings, error messages, log sink and levels, sbuf, JSON getters,
 * hashing and the metrics registry's Prometheus text. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "common/hash.h"
#include "common/json.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/sbuf.h"
#include "common/status.h"
#include "testutil.h"

static void test_status(void **state)
{
    assert_string_equal(kvf_status_str(KVF_ERR_TIMEOUT), "timed out");
    assert_string_equal(kvf_status_name(KVF_ERR_PEER_LOST), "ERR_PEER_LOST");
    assert_string_equal(kvf_status_str((kvf_status)12345), "unknown status");
    kvf_err err = {0};
    assert_int_equal(kvf_err_set(&err, KVF_ERR_INVALID, "block %d", 7), KVF_ERR_INVALID);
    assert_string_equal(err.msg, "block 7");
    kvf_err_prefix(&err, "kv: pool %s", "a");
    assert_string_equal(err.msg, "kv: pool a: block 7");
    assert_int_equal(err.status, KVF_ERR_INVALID);
    assert_int_equal(kvf_err_set(NULL, KVF_ERR_IO, "ignored"), KVF_ERR_IO);
    /* a long prefix truncates instead of overflowing */
    char big[2000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    kvf_err_prefix(&err, "%s", big);
    assert_true(strlen(err.msg) < KVF_ERR_MSG_MAX);
}

static void test_log(void **state)
{
    kvf_test_log cap = {0};
    kvf_log_set_sink(kvf_test_log_sink, &cap);
    kvf_log_set_level(KVF_LOG_WARN);
    kvf_log(KVF_LOG_INFO, "decode: not shown");
    assert_int_equal(cap.n_lines, 0);
    kvf_log(KVF_LOG_ERROR, "decode: req %s: two\nlines", "r1");
    assert_int_equal(cap.n_lines, 1);
    assert_non_null(strstr(cap.last, " E decode: req r1: two lines"));
    assert_null(strchr(cap.last, '\n'));
    kvf_log_set_sink(NULL, NULL);
    kvf_log_set_level(KVF_LOG_INFO);
    assert_int_equal(kvf_log_level_parse("WARN"), KVF_LOG_WARN);
    assert_int_equal(kvf_log_level_parse("loud"), -1);
}

static void test_sbuf(void **state)
{
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    for (int i = 0; i < 1000; i++)
        kvf_sbuf_printf(&b, "%d,", i);
    assert_int_equal(b.len, strlen(b.data));
    assert_memory_equal(b.data, "0,1,2,", 6);
    kvf_sbuf_reset(&b);
    assert_int_equal(b.len, 0);
    kvf_sbuf_puts(&b, "abc");
    char *s = kvf_sbuf_take(&b);
    assert_string_equal(s, "abc");
    assert_null(b.data);
    free(s);
    kvf_sbuf_fini(&b);
}

static void test_json(void **state)
{
    const char *doc = "{\"a\": 3, \"b\": 4.0, \"c\": 4.5, \"s\": \"x\", \"t\": true, "
                      "\"ids\": [1, 2, 3], \"bad\": [1, \"2\"]}";
    json_t *j;
    kvf_err err = {0};
    assert_int_equal(kvf_json_load_buf(doc, strlen(doc), "doc", &j, &err), KVF_OK);
    int64_t i;
    double d;
    const char *s;
    bool t;
    assert_int_equal(kvf_json_get_int(j, "a", &i, &err), KVF_OK);
    assert_int_equal(i, 3);
    assert_int_equal(kvf_json_get_int(j, "b", &i, &err), KVF_OK);
    assert_int_equal(i, 4);
    assert_int_equal(kvf_json_get_int(j, "c", &i, &err), KVF_ERR_INVALID);
    assert_string_equal(err.msg, "\"c\" is a number, expected an integer");
    assert_int_equal(kvf_json_get_num(j, "c", &d, &err), KVF_OK);
    assert_int_equal(kvf_json_get_str(j, "s", &s, &err), KVF_OK);
    assert_string_equal(s, "x");
    assert_int_equal(kvf_json_get_bool(j, "t", &t, &err), KVF_OK);
    assert_true(t);
    assert_int_equal(kvf_json_get_str(j, "nope", &s, &err), KVF_ERR_NOT_FOUND);
    assert_string_equal(err.msg, "\"nope\" is missing");
    int32_t *ids;
    size_t n;
    assert_int_equal(kvf_json_get_i32_array(j, "ids", &ids, &n, &err), KVF_OK);
    assert_int_equal(n, 3);
    assert_int_equal(ids[2], 3);
    free(ids);
    assert_int_equal(kvf_json_get_i32_array(j, "bad", &ids, &n, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "\"bad\"[1] is a string"));
    json_decref(j);
    assert_int_equal(kvf_json_load_buf("{\"a\":", 5, "req", &j, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "req: line 1"));
    assert_int_equal(kvf_json_load_file("/nonexistent/x.json", &j, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "/nonexistent/x.json"));
}

static void test_hash(void **state)
{
    /* XXH3-64 of the empty input and of "a" (published test vectors) */
    assert_true(kvf_hash64("", 0) == 0x2D06800538D394C2ull);
    uint64_t h = kvf_hash64("hello world", 11);
    assert_true(kvf_hash64_concat("hello ", 6, "world", 5) == h);
    assert_true(kvf_hash64_concat(NULL, 0, "hello world", 11) == h);
    assert_true(kvf_hash64_seed("hello world", 11, 1) != h);
}

static void test_metrics(void **state)
{
    kvf_metrics *m;
    kvf_err err = {0};
    assert_int_equal(kvf_metrics_create(&m), KVF_OK);
    kvf_metric *c, *c2, *g, *hg, *again;
    assert_int_equal(kvf_metrics_counter(m, "kvf_requests_total", "role=\"decode\"", "Requests.", &c, &err), KVF_OK);
    assert_int_equal(kvf_metrics_gauge(m, "kvf_free_blocks", NULL, "Free KV blocks.", &g, &err), KVF_OK);
    assert_int_equal(kvf_metrics_counter(m, "kvf_requests_total", "role=\"prefill\"", "Requests.", &c2, &err), KVF_OK);
    double bounds[] = {0.1, 1, 10};
    assert_int_equal(kvf_metrics_histogram(m, "kvf_ttft_seconds", NULL, "TTFT.", bounds, 3, &hg, &err), KVF_OK);
    assert_int_equal(kvf_metrics_counter(m, "kvf_requests_total", "role=\"decode\"", "x", &again, &err), KVF_OK);
    assert_ptr_equal(again, c);
    assert_int_equal(kvf_metrics_gauge(m, "kvf_requests_total", NULL, "x", &again, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "is a counter"));
    assert_int_equal(kvf_metrics_gauge(m, "9bad name", NULL, "x", &again, &err), KVF_ERR_INVALID);
    double unsorted[] = {1, 0.5};
    assert_int_equal(kvf_metrics_histogram(m, "kvf_h2", NULL, "x", unsorted, 2, &again, &err), KVF_ERR_INVALID);

    kvf_metric_add(c, 2);
    kvf_metric_add(c, 1);
    kvf_metric_add(c2, 5);
    kvf_metric_set(g, 42);
    kvf_metric_observe(hg, 0.05);
    kvf_metric_observe(hg, 0.5);
    kvf_metric_observe(hg, 100);
    assert_true(kvf_metric_value(c) == 3);
    assert_true(kvf_metric_value(hg) == 3);

    kvf_sbuf out;
    kvf_sbuf_init(&out);
    assert_int_equal(kvf_metrics_render(m, &out), KVF_OK);
    const char *want =
        "# HELP kvf_requests_total Requests.\n"
        "# TYPE kvf_requests_total counter\n"
        "kvf_requests_total{role=\"decode\"} 3\n"
        "kvf_requests_total{role=\"prefill\"} 5\n"
        "# HELP kvf_free_blocks Free KV blocks.\n"
        "# TYPE kvf_free_blocks gauge\n"
        "kvf_free_blocks 42\n"
        "# HELP kvf_ttft_seconds TTFT.\n"
        "# TYPE kvf_ttft_seconds histogram\n"
        "kvf_ttft_seconds_bucket{le=\"0.10000000000000001\"} 1\n"
        "kvf_ttft_seconds_bucket{le=\"1\"} 2\n"
        "kvf_ttft_seconds_bucket{le=\"10\"} 2\n"
        "kvf_ttft_seconds_bucket{le=\"+Inf\"} 3\n"
        "kvf_ttft_seconds_sum 100.55\n"
        "kvf_ttft_seconds_count 3\n";
    assert_string_equal(out.data, want);
    kvf_sbuf_fini(&out);
    kvf_metrics_destroy(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status), cmocka_unit_test(test_log),
        cmocka_unit_test(test_sbuf),   cmocka_unit_test(test_json),
        cmocka_unit_test(test_hash),   cmocka_unit_test(test_metrics),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
