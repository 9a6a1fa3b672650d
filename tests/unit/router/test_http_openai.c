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
#include "text/chat_template.h"
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
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"guided_grammar\":\"root ::= x\"}", 400,
               "guided_grammar", "EBNF");
    /* structured output: a guide that does not compile is a 400 naming its field */
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"response_format\":{\"type\":\"xml\"}}", 400,
               "response_format.type", "not one of");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"response_format\":{\"type\":\"json_schema\"}}", 400,
               "response_format.json_schema", "required");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"response_format\":{\"type\":\"json_schema\","
               "\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"object\",\"if\":{}}}}}", 400,
               "response_format.json_schema.schema", "\"if\"");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"guided_regex\":\"(a\"}", 400, "guided_regex", "guided_regex");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"guided_json\":\"{bad\"}", 400, "guided_json", "not valid JSON");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"guided_choice\":[\"a\",2]}", 400, "guided_choice", "must be a string");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"guided_regex\":\"a\",\"guided_json\":{}}", 400,
               "guided_regex", "give one");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"structured_outputs\":{\"grammar\":\"x\"}}", 400,
               "structured_outputs.grammar", "not supported");
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"structured_outputs\":{\"json_object\":1}}", 400,
               "structured_outputs.json_object", "a boolean");
    /* a NUL inside a string never gets past the JSON reader, so a guide never holds one */
    expect_bad(C, "{\"model\":\"m\",\"prompt\":[1],\"guided_regex\":\"a\\u0000b\"}", 400, "", "not valid JSON");
    /* a guide past what the wire carries is the client's 400, never a worker's failure */
    size_t big = 300 * 1024;
    char *body = malloc(big + 256);
    int k = snprintf(body, 256, "{\"model\":\"m\",\"prompt\":[1],\"guided_json\":{\"type\":\"object\",\"description\":\"");
    memset(body + k, 'x', big);
    snprintf(body + k + big, 64, "\"}}");
    expect_bad(C, body, 400, "guided_json", "at most 262144");
    free(body);
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

/* Content parts, tool messages, assistant tool_calls, tools and tool_choice (issue 23). */
static void test_chat_tools_parse(void **state)
{
    (void)state;
    const kvf_router_oai_kind H = KVF_ROUTER_OAI_CHAT;
#define MSG "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":%s}]%s}"
    char b[2048];
    snprintf(b, sizeof b, MSG, "[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"image_url\",\"image_url\":{\"url\":\"x\"}}]", "");
    expect_bad(H, b, 400, "messages.[0].content.[1].type", "'image_url' is not supported");
    snprintf(b, sizeof b, MSG, "[{\"type\":\"input_audio\",\"input_audio\":{}}]", "");
    expect_bad(H, b, 400, "messages.[0].content.[0].type", "'input_audio'");
    snprintf(b, sizeof b, MSG, "[{\"type\":\"text\"}]", "");
    expect_bad(H, b, 400, "messages.[0].content.[0].text", "required");
    snprintf(b, sizeof b, MSG, "[{\"type\":\"text\",\"text\":5}]", "");
    expect_bad(H, b, 400, "messages.[0].content.[0].text", "a string");
    snprintf(b, sizeof b, MSG, "[{\"text\":\"a\"}]", "");
    expect_bad(H, b, 400, "messages.[0].content.[0].type", "required");
    snprintf(b, sizeof b, MSG, "[\"a\"]", "");
    expect_bad(H, b, 400, "messages.[0].content.[0]", "a content part object");
    /* tools and tool_choice */
    const char *fn = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\"}}}]";
    char extra[1024];
    snprintf(extra, sizeof extra, ",\"tools\":%s,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"other\"}}", fn);
    snprintf(b, sizeof b, MSG, "\"hi\"", extra);
    expect_bad(H, b, 400, "tool_choice", "not in 'tools'");
    snprintf(extra, sizeof extra, ",\"tools\":%s,\"tool_choice\":\"required\",\"response_format\":{\"type\":\"json_object\"}", fn);
    snprintf(b, sizeof b, MSG, "\"hi\"", extra);
    expect_bad(H, b, 400, "tool_choice", "give one");
    snprintf(extra, sizeof extra, ",\"tools\":[%.*s,%.*s]", (int)strlen(fn) - 2, fn + 1, (int)strlen(fn) - 2, fn + 1);
    snprintf(b, sizeof b, MSG, "\"hi\"", extra);
    expect_bad(H, b, 400, "tools.[1].function.name", "two tools are named 'get_weather'");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tool_choice\":\"auto\"");
    expect_bad(H, b, 400, "tool_choice", "needs 'tools'");
    snprintf(extra, sizeof extra, ",\"tools\":%s,\"tool_choice\":\"sometimes\"", fn);
    snprintf(b, sizeof b, MSG, "\"hi\"", extra);
    expect_bad(H, b, 400, "tool_choice", "must be");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tools\":{}");
    expect_bad(H, b, 400, "tools", "an array");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tools\":[{\"type\":\"retrieval\"}]");
    expect_bad(H, b, 400, "tools.[0].type", "'retrieval' is not supported");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tools\":[{\"type\":\"function\"}]");
    expect_bad(H, b, 400, "tools.[0].function", "required");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tools\":[{\"type\":\"function\",\"function\":{\"description\":\"d\"}}]");
    expect_bad(H, b, 400, "tools.[0].function.name", "required");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]");
    expect_bad(H, b, 400, "tools.[0].function.name", "a-z, A-Z, 0-9");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":[]}}]");
    expect_bad(H, b, 400, "tools.[0].function.parameters", "an object");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"strict\":1}}]");
    expect_bad(H, b, 400, "tools.[0].function.strict", "a boolean");
    snprintf(extra, sizeof extra, ",\"tools\":%s,\"parallel_tool_calls\":\"no\"", fn);
    snprintf(b, sizeof b, MSG, "\"hi\"", extra);
    expect_bad(H, b, 400, "parallel_tool_calls", "a boolean");
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"functions\":[]");
    expect_bad(H, b, 400, "functions", "use 'tools'");
    /* tool messages and assistant tool calls */
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"tool\",\"content\":\"r\"}]}", 400,
               "messages.[0].tool_call_id", "required");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\","
                  "\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{nope\"}}]}]}",
               400, "messages.[0].tool_calls.[0].function.arguments", "not valid JSON");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"type\":\"function\","
                  "\"function\":{\"name\":\"f\",\"arguments\":{}}}]}]}",
               400, "messages.[0].tool_calls.[0].function.arguments", "a string of JSON");
    expect_bad(H, "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"type\":\"code\","
                  "\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}]}",
               400, "messages.[0].tool_calls.[0].type", "\"function\"");

    /* accepted: text parts joined, null content "", arguments decoded, tools kept */
    snprintf(extra, sizeof extra, ",\"tools\":%s,\"parallel_tool_calls\":false", fn);
    snprintf(b, sizeof b, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
             "{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\","
             "\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"sunny\"}]%s}", extra);
    kvf_router_oai_req r;
    kvf_router_oai_error e = {0};
    if (kvf_router_oai_parse(H, b, strlen(b), &r, &e) != KVF_OK)
        fail_msg("%s: %s", e.param, e.message);
    assert_string_equal(json_string_value(json_object_get(json_array_get(r.messages, 0), "content")), "a\nb");
    json_t *a = json_array_get(r.messages, 1);
    assert_string_equal(json_string_value(json_object_get(a, "content")), "");
    json_t *args = json_object_get(json_object_get(json_array_get(json_object_get(a, "tool_calls"), 0), "function"), "arguments");
    assert_true(json_is_object(args));
    assert_string_equal(json_string_value(json_object_get(args, "city")), "Paris");
    assert_int_equal(json_array_size(r.tools), 1);
    assert_false(r.tool_choice_none);
    assert_false(r.parallel_tool_calls);
    kvf_router_oai_req_fini(&r);
    snprintf(extra, sizeof extra, ",\"tools\":%s,\"tool_choice\":\"none\"", fn);
    snprintf(b, sizeof b, MSG, "\"hi\"", extra);
    assert_int_equal(kvf_router_oai_parse(H, b, strlen(b), &r, &e), KVF_OK);
    assert_true(r.tool_choice_none && r.parallel_tool_calls);
    kvf_router_oai_req_fini(&r);
    snprintf(b, sizeof b, MSG, "\"hi\"", ",\"tool_choice\":\"none\"");
    assert_int_equal(kvf_router_oai_parse(H, b, strlen(b), &r, &e), KVF_OK);
    assert_null(r.tools);
    kvf_router_oai_req_fini(&r);
#undef MSG
}

/* An OpenAI-shaped tool conversation (content null, arguments as a JSON string, tool_call_id)
 * renders through Qwen3's own template exactly as the reference rendering of the same
 * conversation in HF's shape (qwen3 chat case 06). */
static void test_chat_tools_render_qwen3(void **state)
{
    (void)state;
    char path[4200];
    const char *dir = kvf_test_shared_path("fixtures/tokenizers/qwen3");
    snprintf(path, sizeof path, "%s/chat_cases.json", dir);
    json_t *cc = json_load_file(path, 0, NULL);
    assert_non_null(cc);
    json_t *c = NULL, *x;
    size_t i;
    json_array_foreach(json_object_get(cc, "cases"), i, x)
        if (strcmp(json_string_value(json_object_get(x, "id")), "qwen3-chat-06") == 0)
            c = x;
    assert_non_null(c);
    json_t *body = json_pack("{s:s,s:O}", "model", "m", "tools", json_object_get(c, "tools"));
    json_t *msgs = json_deep_copy(json_object_get(c, "messages"));
    json_t *asst = json_array_get(msgs, 2), *tc = json_array_get(json_object_get(asst, "tool_calls"), 0);
    json_object_set_new(asst, "content", json_null());
    json_object_set_new(tc, "id", json_string("call_0"));
    json_t *fn = json_object_get(tc, "function");
    char *args = json_dumps(json_object_get(fn, "arguments"), 0);
    json_object_set_new(fn, "arguments", json_string(args));
    free(args);
    json_object_set_new(json_array_get(msgs, 3), "tool_call_id", json_string("call_0"));
    json_object_set_new(body, "messages", msgs);
    char *b = json_dumps(body, 0);
    kvf_router_oai_req r;
    kvf_router_oai_error e = {0};
    if (kvf_router_oai_parse(KVF_ROUTER_OAI_CHAT, b, strlen(b), &r, &e) != KVF_OK)
        fail_msg("%s: %s", e.param, e.message);
    kvf_text_chat_template *t;
    kvf_err err = {0};
    if (kvf_text_chat_template_load(dir, NULL, false, NULL, &t, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    kvf_text_chat_request cr = {.messages = r.messages, .tools = r.tools, .add_generation_prompt = true};
    char *out = NULL;
    if (kvf_text_chat_template_render(t, &cr, &out, NULL, NULL, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    assert_string_equal(out, json_string_value(json_object_get(c, "rendered")));
    free(out);
    kvf_text_chat_template_destroy(t);
    kvf_router_oai_req_fini(&r);
    free(b);
    json_decref(body);
    json_decref(cc);
}

/* Tool calls in answers and deltas; finish_reason "tool_calls". */
static void test_tool_call_answer_json(void **state)
{
    (void)state;
    kvf_router_toolcall calls[2] = {{"get_weather", "{\"city\":\"Paris\"}"}, {"now", "{}"}};
    char ids[2][32] = {"call_a", "call_b"};
    kvf_router_oai_choice ch = {.index = 0, .text = "", .text_len = 0, .finish = KVF_ROUTER_OAI_FINISH_TOOL_CALLS,
                                .tool_calls = calls, .tool_call_ids = (const char (*)[32])ids, .n_tool_calls = 2,
                                .content_null = true};
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    assert_int_equal(kvf_router_oai_answer_json(KVF_ROUTER_OAI_CHAT, "chatcmpl-1", "m", 1, &ch, 1, NULL, &b), KVF_OK);
    json_t *j = json_loads(b.data, 0, NULL);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0), *msg = json_object_get(c, "message");
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "tool_calls");
    assert_true(json_is_null(json_object_get(msg, "content")));
    json_t *t1 = json_array_get(json_object_get(msg, "tool_calls"), 1);
    assert_string_equal(json_string_value(json_object_get(t1, "id")), "call_b");
    assert_string_equal(json_string_value(json_object_get(t1, "type")), "function");
    assert_string_equal(json_string_value(json_object_get(json_object_get(t1, "function"), "name")), "now");
    assert_null(json_object_get(t1, "index"));
    json_decref(j);
    kvf_sbuf_fini(&b);
    kvf_sbuf_init(&b);
    assert_int_equal(kvf_router_oai_chunk_sse(KVF_ROUTER_OAI_CHAT, "chatcmpl-1", "m", 1, &ch, 1, NULL, false, &b), KVF_OK);
    j = json_loads(b.data + 6, JSON_DISABLE_EOF_CHECK, NULL);
    json_t *d = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta");
    json_t *t0 = json_array_get(json_object_get(d, "tool_calls"), 0);
    assert_int_equal(json_integer_value(json_object_get(t0, "index")), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(t0, "function"), "arguments")),
                        "{\"city\":\"Paris\"}");
    assert_null(json_object_get(d, "content"));
    json_decref(j);
    kvf_sbuf_fini(&b);
    /* the stream's first delta: role, content null, the calls */
    ch.first_chunk = true;
    kvf_sbuf_init(&b);
    assert_int_equal(kvf_router_oai_chunk_sse(KVF_ROUTER_OAI_CHAT, "chatcmpl-1", "m", 1, &ch, 1, NULL, false, &b), KVF_OK);
    j = json_loads(b.data + 6, JSON_DISABLE_EOF_CHECK, NULL);
    d = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta");
    assert_string_equal(json_string_value(json_object_get(d, "role")), "assistant");
    assert_true(json_is_null(json_object_get(d, "content")));
    assert_int_equal(json_array_size(json_object_get(d, "tool_calls")), 2);
    json_decref(j);
    kvf_sbuf_fini(&b);
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
        cmocka_unit_test(test_chat_tools_parse),
        cmocka_unit_test(test_chat_tools_render_qwen3),
        cmocka_unit_test(test_tool_call_answer_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
