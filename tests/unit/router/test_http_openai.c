/* test_http_openai.c: the router's OpenAI wire format without a server: request validation
 * (every malformed kind gets a 400 naming the field), answer and SSE chunk JSON, stop strings. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <string.h>

#include "router/openai.h"
#include "testutil.h"

/* Parses body expecting failure; checks the status, param and a piece of the message. */
static void expect_bad(kvf_router_oai_kind kind, const char *body, int http, const char *param,
                       const char *msg_part)
{
    kvf_router_oai_req r;
    kvf_router_oai_error e = {0};
    kvf_status st = kvf_router_oai_parse(kind, body, strlen(body), &r, &e);
    if (st == KVF_OK)
        fail_msg("accepted: %s", body);
    assert_int_equal(e.http_status, http);
    assert_string_equal(e.param, param);
    if (!strstr(e.message, msg_part))
        fail_msg("message '%s' lacks '%s' (body %s)", e.message, msg_part, body);
}

static void test_parse_defaults_and_ids(void **state)
{
    (void)state;
    const char *b = "{\"model\":\"m\",\"prompt\":[1,2,3],\"user\":\"u-1\",\"suffix\":null}";
    kvf_router_oai_req r;
    kvf_router_oai_error e = {0};
    assert_int_equal(kvf_router_oai_parse(KVF_ROUTER_OAI_COMPLETIONS, b, strlen(b), &r, &e), KVF_OK);
    assert_string_equal(r.model, "m");
    assert_int_equal(r.n_prompt_ids, 3);
    assert_int_equal(r.prompt_ids[2], 3);
    assert_null(r.prompt_text);
    assert_int_equal(r.max_tokens, 0);
    assert_int_equal(r.n, 1);
    assert_true(r.temperature == 1.0 && r.top_p == 1.0);
    assert_false(r.stream);
    kvf_router_oai_req_fini(&r);

    const char *b2 = "{\"model\":\"m\",\"prompt\":[\"hello\"],\"max_tokens\":24,\"temperature\":0,"
                     "\"top_p\":0.5,\"seed\":-7,\"stop\":[\"a\",\"bc\"],\"n\":3,\"stream\":true,"
                     "\"stream_options\":{\"include_usage\":true}}";
    assert_int_equal(kvf_router_oai_parse(KVF_ROUTER_OAI_COMPLETIONS, b2, strlen(b2), &r, &e), KVF_OK);
    assert_string_equal(r.prompt_text, "hello");
    assert_int_equal(r.max_tokens, 24);
    assert_true(r.temperature == 0 && r.top_p == 0.5);
    assert_true(r.has_seed);
    assert_int_equal((int64_t)r.seed, -7);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[1], "bc");
    assert_int_equal(r.n, 3);
    assert_true(r.stream && r.include_usage);
    kvf_router_oai_req_fini(&r);

    const char *b3 = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                     "\"max_completion_tokens\":5,\"stop\":\"x\"}";
    assert_int_equal(kvf_router_oai_parse(KVF_ROUTER_OAI_CHAT, b3, strlen(b3), &r, &e), KVF_OK);
    assert_int_equal(json_array_size(r.messages), 1);
    assert_int_equal(r.max_tokens, 5);
    assert_int_equal(r.n_stop, 1);
    kvf_router_oai_req_fini(&r);

    /* a list of prompts: each parse keeps the one asked for and says how many there are */
    const char *bl = "{\"model\":\"m\",\"prompt\":[\"first\",[7,8],\"third\"]}";
    assert_int_equal(kvf_router_oai_parse_at(KVF_ROUTER_OAI_COMPLETIONS, bl, strlen(bl), 1, &r, &e), KVF_OK);
    assert_int_equal(r.n_prompts, 3);
    assert_int_equal(r.n_prompt_ids, 2);
    assert_int_equal(r.prompt_ids[1], 8);
    kvf_router_oai_req_fini(&r);
    assert_int_equal(kvf_router_oai_parse_at(KVF_ROUTER_OAI_COMPLETIONS, bl, strlen(bl), 2, &r, &e), KVF_OK);
    assert_string_equal(r.prompt_text, "third");
    kvf_router_oai_req_fini(&r);
    assert_int_equal(kvf_router_oai_parse(KVF_ROUTER_OAI_COMPLETIONS, b, strlen(b), &r, &e), KVF_OK);
    assert_int_equal(r.n_prompts, 1);
    kvf_router_oai_req_fini(&r);

    /* issue 23's sampling fields, each read as given */
    const char *b4 = "{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":8,\"presence_penalty\":0.5,"
                     "\"frequency_penalty\":-1.5,\"repetition_penalty\":1.2,\"min_p\":0.1,\"min_tokens\":3,"
                     "\"logit_bias\":{\"7\":100,\"12\":-100},\"stop_token_ids\":[4,9],\"logprobs\":3,"
                     "\"echo\":true,\"best_of\":2,\"response_format\":{\"type\":\"text\"}}";
    assert_int_equal(kvf_router_oai_parse(KVF_ROUTER_OAI_COMPLETIONS, b4, strlen(b4), &r, &e), KVF_OK);
    assert_true(r.presence_penalty == 0.5 && r.frequency_penalty == -1.5);
    assert_true(r.repetition_penalty == 1.2 && r.min_p == 0.1);
    assert_int_equal(r.min_tokens, 3);
    assert_int_equal(r.n_bias, 2);
    assert_true((r.bias_ids[0] == 7 && r.bias_vals[0] == 100.0f) || (r.bias_ids[1] == 7 && r.bias_vals[1] == 100.0f));
    assert_int_equal(r.n_stop_ids, 2);
    assert_int_equal(r.stop_ids[1], 9);
    assert_true(r.logprobs && r.echo);
    assert_int_equal(r.top_logprobs, 3);
    assert_int_equal(r.best_of, 2);
    kvf_router_oai_req_fini(&r);
    assert_int_equal(kvf_router_oai_parse(KVF_ROUTER_OAI_COMPLETIONS, b, strlen(b), &r, &e), KVF_OK);
    assert_true(r.repetition_penalty == 1.0 && !r.logprobs && r.n_bias == 0); /* off by default */
    kvf_router_oai_req_fini(&r);
    const char *b5 = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                     "\"logprobs\":true,\"top_logprobs\":20}";
    assert_int_equal(kvf_router_oai_parse(KVF_ROUTER_OAI_CHAT, b5, strlen(b5), &r, &e), KVF_OK);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 20);
    kvf_router_oai_req_fini(&r);
}

/* The answer's logprobs objects, as OpenAI shapes them for each endpoint. */
static void test_logprobs_json(void **state)
{
    (void)state;
    kvf_router_oai_lp p = {.bytes = (const uint8_t *)"\xE4\xBD", .len = 2, .logprob = -0.25f, .n_top = 2};
    p.top_bytes[0] = (const uint8_t *)" a";
    p.top_len[0] = 2;
    p.top_lp[0] = -0.1f;
    p.top_bytes[1] = (const uint8_t *)"b";
    p.top_len[1] = 1;
    p.top_lp[1] = -INFINITY;
    json_t *lp = NULL;
    assert_int_equal(kvf_router_oai_lp_append(KVF_ROUTER_OAI_CHAT, &lp, &p, 0), KVF_OK);
    char *s = json_dumps(lp, JSON_COMPACT | JSON_SORT_KEYS);
    assert_string_equal(s, "{\"content\":[{\"bytes\":[228,189],\"logprob\":-0.25,\"token\":\"\xEF\xBF\xBD\xEF\xBF\xBD\","
                           "\"top_logprobs\":[{\"bytes\":[32,97],\"logprob\":-0.10000000149011612,\"token\":\" a\"},"
                           "{\"bytes\":[98],\"logprob\":-9999.0,\"token\":\"b\"}]}]}");
    free(s);
    json_decref(lp);
    lp = NULL;
    kvf_router_oai_lp first = {.bytes = (const uint8_t *)"Hi", .len = 2, .logprob = NAN};
    assert_int_equal(kvf_router_oai_lp_append(KVF_ROUTER_OAI_COMPLETIONS, &lp, &first, 0), KVF_OK);
    assert_int_equal(kvf_router_oai_lp_append(KVF_ROUTER_OAI_COMPLETIONS, &lp, &p, 2), KVF_OK);
    s = json_dumps(lp, JSON_COMPACT | JSON_SORT_KEYS);
    assert_string_equal(s, "{\"text_offset\":[0,2],\"token_logprobs\":[null,-0.25],\"tokens\":[\"Hi\",\"\xEF\xBF\xBD\xEF\xBF\xBD\"],"
                           "\"top_logprobs\":[null,{\" a\":-0.10000000149011612,\"b\":-9999.0}]}");
    free(s);
    json_decref(lp);
}

static void test_parse_errors(void **state)
{
    (void)state;
    const kvf_router_oai_kind C = KVF_ROUTER_OAI_COMPLETIONS, H = KVF_ROUTER_OAI_CHAT;
    expect_bad(C, "{not json", 400, "", "not valid JSON");
    expect_bad(C, "", 400, "", "not valid JSON");
    expect_bad(C, "[1,2]", 400, "", "must be a JSON object");
    expect_bad(C, "{\"prompt\":[1]}", 400, "model", "'model' is required");
    expect_bad(C, "{\"model\":7,\"prompt\":[1]}", 400, "model", "must be a string");
    expect_bad(C, "{\"model\":\"m\"}", 400, "prompt", "'prompt' is required");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":{}}", 400, "prompt", "a string or an array");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[]}", 400, "prompt", "empty");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1,-2]}", 400, "prompt", "'prompt'[1]");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1,\"a\"]}", 400, "prompt", "'prompt'[1] is a string");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[\"a\",5]}", 400, "prompt", "'prompt'[1] is an integer");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[\"a\",[]]}", 400, "prompt", "'prompt'[1] is empty");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[[1],[2,-1]]}", 400, "prompt", "'prompt'[1][1]");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[[[1]]]}", 400, "prompt", "'prompt'[0][0]");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"max_tokens\":0}", 400, "max_tokens", "is 0");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"max_tokens\":-3}", 400, "max_tokens", "is -3");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"max_tokens\":\"5\"}", 400, "max_tokens", "an integer");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"max_tokens\":1.5}", 400, "max_tokens", "an integer");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"temperature\":\"hot\"}", 400, "temperature", "a number");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"temperature\":3}", 400, "temperature", "0 to 2");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"top_p\":0}", 400, "top_p", "above 0");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"top_p\":1.5}", 400, "top_p", "0 to 1");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"n\":0}", 400, "n", "1 to 64");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"n\":65}", 400, "n", "1 to 64");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"seed\":\"x\"}", 400, "seed", "an integer");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stream\":1}", 400, "stream", "a boolean");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stop\":5}", 400, "stop", "a string or an array");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", 400, "stop", "at most 4");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stop\":[\"a\",3]}", 400, "stop", "'stop'[1]");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stop\":\"\"}", 400, "stop", "empty");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stream_options\":[]}", 400, "stream_options", "an object");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stream_options\":{\"include_usage\":\"y\"}}", 400,
               "stream_options.include_usage", "a boolean");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"model\":\"n\"}", 400, "", "duplicate");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stream_options\":{\"include_usage\":true}}", 400,
               "stream_options", "only allowed when 'stream' is true");
    /* nothing is silently ignored: an unknown field, and the ones not built yet, are refused */
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"unknown_field\":{\"x\":1}}", 400, "unknown_field", "not supported");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"suffix\":\"end\"}", 400, "suffix", "not supported");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"response_format\":{\"type\":\"json_object\"}}", 400,
               "response_format", "structured output");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"top_logprobs\":2}", 400, "top_logprobs", "not supported");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"echo\":true}", 400,
               "echo", "not supported");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"best_of\":2}", 400,
               "best_of", "not supported");
    /* the new fields' ranges and types */
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"logprobs\":21}", 400, "logprobs", "0 to 20");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"logprobs\":true}", 400, "logprobs", "an integer");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 400,
               "top_logprobs", "needs 'logprobs'");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
               "\"top_logprobs\":21}", 400, "top_logprobs", "0 to 20");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"presence_penalty\":2.5}", 400, "presence_penalty", "-2 to 2");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"frequency_penalty\":\"x\"}", 400, "frequency_penalty", "a number");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"repetition_penalty\":0}", 400, "repetition_penalty", "above 0");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"min_p\":1.5}", 400, "min_p", "0 to 1");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"max_tokens\":4,\"min_tokens\":5}", 400, "min_tokens", "0 to 4");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"logit_bias\":[1]}", 400, "logit_bias", "an object");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"logit_bias\":{\"x\":1}}", 400, "logit_bias", "not a token id");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"logit_bias\":{\"-1\":1}}", 400, "logit_bias", "not a token id");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"logit_bias\":{\"3\":101}}", 400, "logit_bias", "-100 to 100");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"stop_token_ids\":[1,-1]}", 400, "stop_token_ids", "[1]");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"n\":3,\"best_of\":2}", 400, "best_of", "at least n");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"best_of\":2,\"stream\":true}", 400, "best_of", "stream");
    expect_bad(H, "{\"model\":\"m\"}", 400, "messages", "'messages' is required");
    expect_bad(H, "{\"model\":\"m\",\"messages\":\"hi\"}", 400, "messages", "an array");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[]}", 400, "messages", "empty");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[3]}", 400, "messages.[0]", "an object");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"content\":\"x\"}]}", 400, "messages.[0].role", "required");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400,
               "messages.[0].content", "a string or an array");
}

static void test_error_json(void **state)
{
    (void)state;
    kvf_router_oai_error e;
    assert_int_equal(kvf_router_oai_error_set(&e, 404, "invalid_request_error", "model", "model_not_found",
                                              "The model '%s' does not exist", "x"),
                     KVF_ERR_INVALID);
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    assert_int_equal(kvf_router_oai_error_json(&e, &b), KVF_OK);
    json_t *j = json_loads(b.data, 0, NULL);
    assert_non_null(j);
    json_t *err = json_object_get(j, "error");
    assert_string_equal(json_string_value(json_object_get(err, "message")), "The model 'x' does not exist");
    assert_string_equal(json_string_value(json_object_get(err, "type")), "invalid_request_error");
    assert_string_equal(json_string_value(json_object_get(err, "param")), "model");
    assert_string_equal(json_string_value(json_object_get(err, "code")), "model_not_found");
    json_decref(j);
    kvf_sbuf_reset(&b);
    kvf_router_oai_error_set(&e, 400, "invalid_request_error", NULL, NULL, "bad");
    kvf_router_oai_error_json(&e, &b);
    j = json_loads(b.data, 0, NULL);
    assert_true(json_is_null(json_object_get(json_object_get(j, "error"), "param")));
    assert_true(json_is_null(json_object_get(json_object_get(j, "error"), "code")));
    json_decref(j);
    kvf_sbuf_fini(&b);
}

static void test_answer_and_chunks(void **state)
{
    (void)state;
    int32_t ids[] = {5, 6, 7};
    kvf_router_oai_choice c = {.index = 0, .text = "abc", .text_len = 3, .token_ids = ids, .n_ids = 3,
                               .finish = KVF_ROUTER_OAI_FINISH_LENGTH};
    kvf_router_oai_usage u = {.prompt_tokens = 4, .completion_tokens = 3, .cached_tokens = 2};
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    assert_int_equal(kvf_router_oai_answer_json(KVF_ROUTER_OAI_CHAT, "chatcmpl-1", "m", 100, &c, 1, &u, &b), KVF_OK);
    json_t *j = json_loads(b.data, 0, NULL);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(ch, "message"), "content")), "abc");
    assert_string_equal(json_string_value(json_object_get(ch, "finish_reason")), "length");
    assert_int_equal(json_integer_value(json_array_get(json_object_get(ch, "token_ids"), 2)), 7);
    json_t *us = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(us, "total_tokens")), 7);
    json_decref(j);

    kvf_sbuf_reset(&b);
    c.finish = KVF_ROUTER_OAI_FINISH_NONE;
    c.first_chunk = true;
    assert_int_equal(kvf_router_oai_chunk_sse(KVF_ROUTER_OAI_CHAT, "id", "m", 1, &c, 1, NULL, true, &b), KVF_OK);
    assert_memory_equal(b.data, "data: {", 7);
    assert_memory_equal(b.data + b.len - 2, "\n\n", 2);
    j = json_loads(b.data + 6, JSON_DISABLE_EOF_CHECK, NULL);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion.chunk");
    ch = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(ch, "delta"), "role")), "assistant");
    assert_true(json_is_null(json_object_get(ch, "finish_reason")));
    assert_true(json_is_null(json_object_get(j, "usage")));
    json_decref(j);

    kvf_sbuf_reset(&b);
    assert_int_equal(kvf_router_oai_chunk_sse(KVF_ROUTER_OAI_COMPLETIONS, "id", "m", 1, NULL, 0, &u, true, &b), KVF_OK);
    j = json_loads(b.data + 6, JSON_DISABLE_EOF_CHECK, NULL);
    assert_int_equal(json_array_size(json_object_get(j, "choices")), 0);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 3);
    json_decref(j);
    kvf_sbuf_fini(&b);
}

static void test_find_stop(void **state)
{
    (void)state;
    char *stops[] = {"END", "\n\n"};
    const char *t = "hello\n\nworld END";
    assert_int_equal(kvf_router_oai_find_stop(t, strlen(t), 0, stops, 2), 5);
    assert_int_equal(kvf_router_oai_find_stop(t, strlen(t), 6, stops, 2), 13);
    assert_int_equal(kvf_router_oai_find_stop(t, 14, 6, stops, 2), -1); /* "EN" only */
    assert_int_equal(kvf_router_oai_find_stop("", 0, 0, stops, 2), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_defaults_and_ids),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_logprobs_json),
        cmocka_unit_test(test_error_json),
        cmocka_unit_test(test_answer_and_chunks),
        cmocka_unit_test(test_find_stop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
