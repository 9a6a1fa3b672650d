/* test_toolcall.c: tool calls parsed from recorded model outputs (router/toolcall.h), Hermes
 * (Qwen) and Llama 3 JSON: single and several calls, text before them, malformed outputs kept as
 * text, and streaming: for every prefix of every output the held-back point never moves back and
 * what was streamed plus what the end adds is the whole-text content. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "router/toolcall.h"

typedef struct tc_case {
    kvf_router_toolcall_format f;
    const char *text;
    const char *content; /* NULL: JSON null */
    size_t n_calls;
    const char *names[3], *args[3];
} tc_case;

#define H KVF_ROUTER_TOOLCALL_HERMES
#define L KVF_ROUTER_TOOLCALL_LLAMA3_JSON
#define WEATHER "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}"
#define WEATHER_ARGS "{\"city\":\"Paris\",\"unit\":\"celsius\"}"

static const tc_case cases[] = {
    /* Qwen3, recorded shapes */
    {H, "<tool_call>\n" WEATHER "\n</tool_call>", NULL, 1, {"get_weather"}, {WEATHER_ARGS}},
    {H, "\n\n<tool_call>\n" WEATHER "\n</tool_call>\n", NULL, 1, {"get_weather"}, {WEATHER_ARGS}},
    {H, "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n" WEATHER "\n</tool_call>",
     "<think>\nThe user wants the weather.\n</think>\n\n", 1, {"get_weather"}, {WEATHER_ARGS}},
    {H, "I'll check both cities.\n<tool_call>\n" WEATHER "\n</tool_call>\n<tool_call>\n"
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Berlin\"}}\n</tool_call>",
     "I'll check both cities.\n", 2, {"get_weather", "get_weather"}, {WEATHER_ARGS, "{\"city\":\"Berlin\"}"}},
    {H, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call><tool_call>{\"name\": \"b-2\", "
        "\"arguments\": {\"q\": [1, 2.5, \"\\u00e9\"], \"o\": {\"n\": null}}}</tool_call>",
     NULL, 2, {"now", "b-2"}, {"{}", "{\"q\":[1,2.5,\"\xc3\xa9\"],\"o\":{\"n\":null}}"}},
    {H, "The capital of France is Paris.", "The capital of France is Paris.", 0, {0}, {0}},
    {H, "", "", 0, {0}, {0}},
    {H, "a < b and <tool is not a call", "a < b and <tool is not a call", 0, {0}, {0}},
    /* Hermes, malformed: all text */
    {H, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}\n</tool_call>",
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}\n</tool_call>", 0, {0}, {0}},
    {H, "<tool_call>\n" WEATHER, "<tool_call>\n" WEATHER, 0, {0}, {0}},
    {H, "<tool_call>\n{\"arguments\": {}}\n</tool_call>", "<tool_call>\n{\"arguments\": {}}\n</tool_call>", 0, {0}, {0}},
    {H, "<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>",
     "<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>", 0, {0}, {0}},
    {H, "<tool_call>" WEATHER "</tool_call> and then some text", "<tool_call>" WEATHER "</tool_call> and then some text", 0, {0}, {0}},
    {H, "<tool_call>" WEATHER " x</tool_call>", "<tool_call>" WEATHER " x</tool_call>", 0, {0}, {0}},
    {H, "<tool_call>" WEATHER "</tool_call><tool_call>{</tool_call>",
     "<tool_call>" WEATHER "</tool_call><tool_call>{</tool_call>", 0, {0}, {0}},
    {H, "<tool_call>[1]</tool_call>", "<tool_call>[1]</tool_call>", 0, {0}, {0}},
    /* Llama 3.1 / 3.2, recorded shapes */
    {L, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", NULL, 1,
     {"get_weather"}, {"{\"city\":\"Paris\"}"}},
    {L, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", NULL, 1, {"get_weather"}, {"{\"city\":\"Paris\"}"}},
    {L, " {\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": {\"x\": 1}}\n", NULL, 2,
     {"a", "b"}, {"{}", "{\"x\":1}"}},
    {L, "<|python_tag|>{\"name\": \"a\", \"parameters\": {}};", NULL, 1, {"a"}, {"{}"}},
    {L, "The weather in Paris is sunny.", "The weather in Paris is sunny.", 0, {0}, {0}},
    /* Llama 3, malformed: all text */
    {L, "{\"name\": \"a\"}", "{\"name\": \"a\"}", 0, {0}, {0}},
    {L, "{\"name\": \"a\", \"parameters\": {}} trailing", "{\"name\": \"a\", \"parameters\": {}} trailing", 0, {0}, {0}},
    {L, "{\"name\": \"a\", \"parameters\": {", "{\"name\": \"a\", \"parameters\": {", 0, {0}, {0}},
    {L, "<|python_tag|>print(1)", "<|python_tag|>print(1)", 0, {0}, {0}},
    {L, "{}; {\"name\": \"a\", \"parameters\": {}}", "{}; {\"name\": \"a\", \"parameters\": {}}", 0, {0}, {0}},
    /* no parser: always text */
    {KVF_ROUTER_TOOLCALL_NONE, "<tool_call>\n" WEATHER "\n</tool_call>", "<tool_call>\n" WEATHER "\n</tool_call>", 0, {0}, {0}},
};

static void check_result(const tc_case *c, const kvf_router_toolcall_result *r)
{
    if (c->content) {
        if (!r->content || r->content_len != strlen(c->content) || memcmp(r->content, c->content, r->content_len))
            fail_msg("[%s]: content [%s], want [%s]", c->text, r->content ? r->content : "(null)", c->content);
    } else if (r->content) {
        fail_msg("[%s]: content [%s], want null", c->text, r->content);
    }
    if (r->n_calls != c->n_calls)
        fail_msg("[%s]: %zu calls, want %zu", c->text, r->n_calls, c->n_calls);
    for (size_t k = 0; k < c->n_calls; k++) {
        assert_string_equal(r->calls[k].name, c->names[k]);
        assert_string_equal(r->calls[k].arguments, c->args[k]);
    }
}

static void test_whole(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_router_toolcall_result r;
        assert_int_equal(kvf_router_toolcall_parse(cases[i].f, cases[i].text, strlen(cases[i].text), &r), KVF_OK);
        check_result(&cases[i], &r);
        kvf_router_toolcall_result_fini(&r);
    }
}

/* The stream sends text[emitted..safe) after each prefix; at the end the whole text is parsed
 * and whatever content lies beyond `emitted` follows. Every prefix is a possible split point, so
 * every way of cutting the text into deltas gives the same stream. */
static void test_streaming_every_split(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const tc_case *c = &cases[i];
        size_t len = strlen(c->text), emitted = 0;
        for (size_t p = 0; p <= len; p++) {
            size_t safe = kvf_router_toolcall_safe_len(c->f, c->text, p, 0);
            if (safe > p || safe < emitted)
                fail_msg("[%s]: prefix %zu: safe %zu after %zu", c->text, p, safe, emitted);
            /* resuming from anything it let through before gives the same */
            for (size_t from = 0; from <= emitted; from++)
                if (kvf_router_toolcall_safe_len(c->f, c->text, p, from) != safe)
                    fail_msg("[%s]: prefix %zu from %zu: %zu, want %zu", c->text, p, from,
                             kvf_router_toolcall_safe_len(c->f, c->text, p, from), safe);
            emitted = safe;
        }
        kvf_router_toolcall_result r;
        assert_int_equal(kvf_router_toolcall_parse(c->f, c->text, len, &r), KVF_OK);
        check_result(c, &r);
        if (!r.content) {
            if (emitted)
                fail_msg("[%s]: %zu bytes streamed, content is null", c->text, emitted);
        } else if (emitted > r.content_len || memcmp(c->text, r.content, emitted) != 0) {
            fail_msg("[%s]: streamed %zu bytes, not a prefix of the content [%s]", c->text, emitted, r.content);
        }
        kvf_router_toolcall_result_fini(&r);
    }
}

static void test_format_names_and_detect(void **state)
{
    (void)state;
    kvf_router_toolcall_format f;
    kvf_err err = {0};
    assert_int_equal(kvf_router_toolcall_format_parse("hermes", &f, &err), KVF_OK);
    assert_int_equal(f, KVF_ROUTER_TOOLCALL_HERMES);
    assert_int_equal(kvf_router_toolcall_format_parse("llama3_json", &f, &err), KVF_OK);
    assert_int_equal(f, KVF_ROUTER_TOOLCALL_LLAMA3_JSON);
    assert_int_equal(kvf_router_toolcall_format_parse("auto", &f, &err), KVF_OK);
    assert_int_equal(f, KVF_ROUTER_TOOLCALL_AUTO);
    assert_int_equal(kvf_router_toolcall_format_parse("mistral", &f, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "mistral"));
    assert_non_null(strstr(err.msg, "llama3_json"));
    assert_string_equal(kvf_router_toolcall_format_name(KVF_ROUTER_TOOLCALL_NONE), "none");
    assert_int_equal(kvf_router_toolcall_detect("{{ '<tool_call>' }}"), KVF_ROUTER_TOOLCALL_HERMES);
    assert_int_equal(kvf_router_toolcall_detect("{{- '<|python_tag|>' }}"), KVF_ROUTER_TOOLCALL_LLAMA3_JSON);
    assert_int_equal(kvf_router_toolcall_detect("{% if message.role == 'ipython' %}"), KVF_ROUTER_TOOLCALL_LLAMA3_JSON);
    assert_int_equal(kvf_router_toolcall_detect("{{ messages }}"), KVF_ROUTER_TOOLCALL_NONE);
    assert_int_equal(kvf_router_toolcall_detect(NULL), KVF_ROUTER_TOOLCALL_NONE);
}

static void test_ids(void **state)
{
    (void)state;
    char a[32], b[32], c[32], d[32];
    kvf_router_toolcall_id("req-1", 0, 0, a);
    kvf_router_toolcall_id("req-1", 0, 0, b);
    kvf_router_toolcall_id("req-1", 0, 1, c);
    kvf_router_toolcall_id("req-1", 1, 0, d);
    assert_string_equal(a, b);
    assert_string_not_equal(a, c);
    assert_string_not_equal(a, d);
    assert_int_equal(strlen(a), 29);
    assert_memory_equal(a, "call_", 5);
    for (int i = 5; i < 29; i++)
        assert_true((a[i] >= 'a' && a[i] <= 'z') || (a[i] >= 'A' && a[i] <= 'Z') || (a[i] >= '0' && a[i] <= '9'));
}

/* tool_choice forced a call through a guide: a named function's whole answer is its arguments,
 * "required" answers a list of {"name", "parameters"}; an answer cut short is content, and
 * streaming holds everything until the end. */
static void test_forced(void **state)
{
    (void)state;
    kvf_router_toolcall_result r;
    const char *args = "{\"a\": 1, \"b\": [2]}";
    assert_int_equal(kvf_router_toolcall_parse_forced("add", args, strlen(args), &r), KVF_OK);
    assert_int_equal(r.n_calls, 1);
    assert_null(r.content);
    assert_string_equal(r.calls[0].name, "add");
    assert_string_equal(r.calls[0].arguments, "{\"a\":1,\"b\":[2]}");
    kvf_router_toolcall_result_fini(&r);
    const char *list = "[{\"name\":\"f\",\"parameters\":{\"x\":\"y\"}},{\"name\":\"g\",\"parameters\":{}}]";
    assert_int_equal(kvf_router_toolcall_parse_forced(NULL, list, strlen(list), &r), KVF_OK);
    assert_int_equal(r.n_calls, 2);
    assert_string_equal(r.calls[0].name, "f");
    assert_string_equal(r.calls[0].arguments, "{\"x\":\"y\"}");
    assert_string_equal(r.calls[1].name, "g");
    kvf_router_toolcall_result_fini(&r);
    const char *cut = "[{\"name\":\"f\",\"param";
    assert_int_equal(kvf_router_toolcall_parse_forced(NULL, cut, strlen(cut), &r), KVF_OK);
    assert_int_equal(r.n_calls, 0);
    assert_string_equal(r.content, cut);
    kvf_router_toolcall_result_fini(&r);
    assert_int_equal(kvf_router_toolcall_parse_forced("add", "[1]", 3, &r), KVF_OK); /* not an object */
    assert_int_equal(r.n_calls, 0);
    assert_string_equal(r.content, "[1]");
    kvf_router_toolcall_result_fini(&r);
    assert_int_equal(kvf_router_toolcall_parse_forced(NULL, "[]", 2, &r), KVF_OK); /* no call */
    assert_int_equal(r.n_calls, 0);
    kvf_router_toolcall_result_fini(&r);
    assert_int_equal(kvf_router_toolcall_safe_len(KVF_ROUTER_TOOLCALL_FORCED, list, strlen(list), 0), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whole),
        cmocka_unit_test(test_streaming_every_split),
        cmocka_unit_test(test_format_names_and_detect),
        cmocka_unit_test(test_ids),
        cmocka_unit_test(test_forced),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
