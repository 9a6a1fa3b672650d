/* test_log.c: the logger's JSON format: stderr captured into a file, every line parsed with
 * jansson, fields checked (escapes, invalid UTF-8, request ids, folder prefixes, truncation). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include <jansson.h>

#include "common/log.h"
#include "testutil.h"

#define MAX_LINES 16

typedef struct captured {
    char *text;               /* everything written to stderr */
    json_t *lines[MAX_LINES]; /* each line parsed; NULL where it was not JSON */
    int n;
} captured;

/* Sends stderr to a temporary file; returns the saved descriptor for capture_end. */
static int capture_begin(FILE **tmp_out)
{
    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    assert_true(saved >= 0);
    assert_true(dup2(fileno(tmp), STDERR_FILENO) >= 0);
    *tmp_out = tmp;
    return saved;
}

/* Restores stderr, then reads and parses what the file got, one JSON object per line. */
static void capture_end(FILE *tmp, int saved, captured *c)
{
    fflush(stderr);
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);
    assert_int_equal(fseek(tmp, 0, SEEK_END), 0);
    long size = ftell(tmp);
    assert_true(size >= 0);
    rewind(tmp);
    c->text = calloc(1, (size_t)size + 1);
    assert_non_null(c->text);
    assert_int_equal(fread(c->text, 1, (size_t)size, tmp), (size_t)size);
    fclose(tmp);
    c->n = 0;
    for (char *p = c->text, *nl; *p; p = nl + 1) {
        nl = strchr(p, '\n');
        assert_non_null(nl); /* every line ends with its newline */
        assert_true(c->n < MAX_LINES);
        json_error_t je;
        c->lines[c->n] = json_loadb(p, (size_t)(nl - p), 0, &je);
        if (!c->lines[c->n])
            fail_msg("line %d is not JSON (%s): %.*s", c->n + 1, je.text, (int)(nl - p), p);
        c->n++;
    }
}

static void captured_free(captured *c)
{
    for (int i = 0; i < c->n; i++)
        json_decref(c->lines[i]);
    free(c->text);
}

static const char *str_field(json_t *o, const char *key)
{
    return json_string_value(json_object_get(o, key));
}

static void test_format_parse(void **state)
{
    assert_int_equal(kvf_log_format_parse("text"), KVF_LOG_FORMAT_TEXT);
    assert_int_equal(kvf_log_format_parse("json"), KVF_LOG_FORMAT_JSON);
    assert_int_equal(kvf_log_format_parse("yaml"), -1);
    assert_int_equal(kvf_log_format_parse("JSONL"), -1);
    assert_int_equal(kvf_log_format_parse(NULL), -1);
}

static void test_json_lines(void **state)
{
    char big[3000];
    memset(big, '"', sizeof big - 1); /* escapes to twice the buffer the message is cut to */
    big[sizeof big - 1] = '\0';

    kvf_log_set_level(KVF_LOG_DEBUG);
    kvf_log_set_format(KVF_LOG_FORMAT_JSON);
    FILE *tmp;
    int saved = capture_begin(&tmp);
    kvf_log(KVF_LOG_INFO, "decode: req %s: said \"hi\"\nback\\slash\ttab\x01\x1f\x7f end", "r-1:a");
    kvf_log(KVF_LOG_WARN, "router: listening on %s", "127.0.0.1:0");
    kvf_log(KVF_LOG_ERROR, "no folder prefix: req r9: here");
    kvf_log(KVF_LOG_DEBUG, "prefill: bad \xff\xc3( \xed\xa0\x80 ok \xc3\xa9 \xe2\x82\xac");
    kvf_log(KVF_LOG_INFO, "prefill: request r2 is not the convention; req  r3 neither");
    kvf_log(KVF_LOG_INFO, "router: req abc123");
    kvf_log(KVF_LOG_INFO, "router: %s", big);
    kvf_log(KVF_LOG_DEBUG, "Router: capitalised prefixes are not folders");
    captured c;
    capture_end(tmp, saved, &c);
    kvf_log_set_format(KVF_LOG_FORMAT_TEXT);
    kvf_log_set_level(KVF_LOG_INFO);

    assert_int_equal(c.n, 8);
    for (int i = 0; i < c.n; i++) {
        const char *ts = str_field(c.lines[i], "ts");
        assert_non_null(ts); /* 2026-11-29T01:16:50.535Z */
        assert_int_equal(strlen(ts), 24);
        assert_true(ts[10] == 'T' && ts[19] == '.' && ts[23] == 'Z');
        assert_non_null(str_field(c.lines[i], "msg"));
    }
    /* quotes, newline, backslash, tab, control bytes: the message comes back byte for byte */
    assert_string_equal(str_field(c.lines[0], "level"), "info");
    assert_string_equal(str_field(c.lines[0], "component"), "decode");
    assert_string_equal(str_field(c.lines[0], "request_id"), "r-1:a");
    assert_string_equal(str_field(c.lines[0], "msg"),
                        "decode: req r-1:a: said \"hi\"\nback\\slash\ttab\x01\x1f\x7f end");
    assert_non_null(strstr(c.text, "\\u0001\\u001f\\u007f"));
    /* no request id where there is none */
    assert_string_equal(str_field(c.lines[1], "level"), "warn");
    assert_string_equal(str_field(c.lines[1], "component"), "router");
    assert_null(json_object_get(c.lines[1], "request_id"));
    assert_string_equal(str_field(c.lines[2], "level"), "error");
    assert_null(json_object_get(c.lines[2], "component"));
    assert_null(json_object_get(c.lines[2], "request_id"));
    /* invalid UTF-8 (a stray byte, a cut sequence, a surrogate) becomes U+FFFD; valid stays */
    assert_string_equal(str_field(c.lines[3], "level"), "debug");
    assert_string_equal(str_field(c.lines[3], "component"), "prefill");
    assert_string_equal(str_field(c.lines[3], "msg"),
                        "prefill: bad \xef\xbf\xbd\xef\xbf\xbd( \xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"
                        " ok \xc3\xa9 \xe2\x82\xac");
    assert_null(json_object_get(c.lines[4], "request_id"));
    assert_string_equal(str_field(c.lines[5], "request_id"), "abc123");
    /* a message cut to the text buffer still makes one whole JSON line */
    const char *m = str_field(c.lines[6], "msg");
    assert_true(strlen(m) > 1000 && strncmp(m, "router: \"\"", 10) == 0);
    assert_null(json_object_get(c.lines[7], "component"));
    captured_free(&c);
}

/* A custom sink gets the text line in either format; the format returns to text. */
static void test_sink_keeps_text(void **state)
{
    kvf_test_log cap = {0};
    kvf_log_set_format(KVF_LOG_FORMAT_JSON);
    kvf_log_set_sink(kvf_test_log_sink, &cap);
    kvf_log(KVF_LOG_WARN, "decode: req %s: two\nlines", "r1");
    kvf_log_set_sink(NULL, NULL);
    kvf_log_set_format(KVF_LOG_FORMAT_TEXT);
    assert_int_equal(cap.n_lines, 1);
    assert_non_null(strstr(cap.last, " W decode: req r1: two lines"));
    assert_int_not_equal(cap.last[0], '{');

    FILE *tmp;
    int saved = capture_begin(&tmp);
    kvf_log(KVF_LOG_WARN, "decode: plain again");
    fflush(stderr);
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);
    char buf[256] = {0};
    rewind(tmp);
    size_t n = fread(buf, 1, sizeof buf - 1, tmp);
    fclose(tmp);
    assert_true(n > 0);
    assert_non_null(strstr(buf, "Z W decode: plain again\n"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_format_parse),
        cmocka_unit_test(test_json_lines),
        cmocka_unit_test(test_sink_keeps_text),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
