/* test_tokenize.c: POST /tokenize and /detokenize (router/tokenize.h) and CORS on the wire.
 * First the prep jobs called directly, as a table of bodies and the status and param they
 * must get (every unknown or mistyped field refused naming it), the answers checked against
 * the tokenizer and the chat template themselves; then a router in this process (no worker:
 * neither needs one) with an API key and CORS, as a table of requests and the status and
 * headers they must get: preflights answered before the key, 401s and JSON answers carrying
 * Access-Control-Allow-Origin for an allowed origin only; and a large prompt tokenized while
 * the loop answers /health. The model: the fixture's config.json
 * with kvf_text_tokenizer_write_default's tokenizer and ChatML template. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "router/http.h"
#include "router/tokenize.h"
#include "testutil.h"

static char g_dir[64];                  /* the model directory */
static kvf_text_tokenizer *g_tok;
static kvf_text_chat_template *g_tmpl;

/* config.json from the fixture, and the default tokenizer (320 ids, as the fixture's vocab). */
static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvf_tokenize_XXXXXX");
    assert_non_null(mkdtemp(g_dir));
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s/config.json'", kvf_test_shared_path("fixtures/models/tiny-gqa-f32/config.json"),
             g_dir);
    assert_int_equal(system(cmd), 0);
    kvf_err e = {0};
    if (kvf_text_tokenizer_write_default(g_dir, 320, &e) != KVF_OK || kvf_text_tokenizer_load(g_dir, &g_tok, &e) != KVF_OK ||
        kvf_text_chat_template_load(g_dir, NULL, false, NULL, &g_tmpl, &e) != KVF_OK)
        fail_msg("%s", e.msg);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvf_text_chat_template_destroy(g_tmpl);
    kvf_text_tokenizer_destroy(g_tok);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static kvf_router_reqs_cfg jobs_cfg(void)
{
    return (kvf_router_reqs_cfg){.served = "tm", .max_len = 256, .vocab_size = 320, .tok = g_tok, .tmpl = g_tmpl,
                                 .tmpl_err = "", .max_prompt_bytes = 256 * kvf_text_tokenizer_max_bytes_per_token(g_tok)};
}

/* Runs a job; returns the answer parsed (200) or NULL with *e filled. */
static json_t *run(const kvf_router_prep_job *job, const kvf_router_reqs_cfg *c, const char *body,
                   kvf_router_oai_error *e)
{
    kvf_sbuf out;
    kvf_sbuf_init(&out);
    memset(e, 0, sizeof *e);
    kvf_status st = job->run(c, body, strlen(body), &out, e);
    json_t *j = st == KVF_OK ? json_loadb(out.data, out.len, 0, NULL) : NULL;
    if (st == KVF_OK && !j)
        fail_msg("'%s': the answer is not JSON: %.*s", body, (int)out.len, out.data);
    if (st == KVF_OK)
        e->http_status = 200;
    kvf_sbuf_fini(&out);
    return j;
}

/* Every body and what it must get: 200, or the status and param of the error. */
static void test_validation(void **state)
{
    (void)state;
    kvf_router_reqs_cfg c = jobs_cfg();
    /* a prompt one byte over what the context can hold */
    assert_true(c.max_prompt_bytes > 0);
    size_t nb = (size_t)c.max_prompt_bytes + 1;
    char *body = malloc(nb + 16);
    assert_non_null(body);
    int hl = snprintf(body, nb + 16, "{\"prompt\":\"");
    memset(body + hl, 'a', nb);
    snprintf(body + hl + nb, 16, "\"}");
    const struct {
        const kvf_router_prep_job *job;
        const char *body;
        int status;
        const char *param; /* NULL: null */
        const char *code;  /* NULL: not checked */
    } cases[] = {
        {&kvf_router_tokenize_job, "{\"prompt\":\"hello world\"}", 200, NULL, NULL},
        {&kvf_router_tokenize_job, "{\"model\":\"tm\",\"prompt\":\"hello\",\"add_special_tokens\":false,\"return_token_strs\":true}", 200, NULL, NULL},
        {&kvf_router_tokenize_job, "{\"model\":null,\"prompt\":\"hello\"}", 200, NULL, NULL},
        {&kvf_router_tokenize_job, "{\"model\":\"other\",\"prompt\":\"hello\"}", 404, "model", "model_not_found"},
        {&kvf_router_tokenize_job, "{\"model\":3,\"prompt\":\"hello\"}", 400, "model", "invalid_type"},
        {&kvf_router_tokenize_job, "{}", 400, "prompt", "missing_required_parameter"},
        {&kvf_router_tokenize_job, "{\"prompt\":\"a\",\"messages\":[]}", 400, "messages", NULL},
        {&kvf_router_tokenize_job, "{\"prompt\":[1,2]}", 400, "prompt", "invalid_type"},
        {&kvf_router_tokenize_job, "{\"prompt\":\"a\",\"foo\":1}", 400, "foo", "unknown_parameter"},
        {&kvf_router_tokenize_job, "{\"prompt\":\"a\",\"add_generation_prompt\":true}", 400, "add_generation_prompt", "unknown_parameter"},
        {&kvf_router_tokenize_job, "{\"prompt\":\"a\",\"add_special_tokens\":1}", 400, "add_special_tokens", "invalid_type"},
        {&kvf_router_tokenize_job, "{\"prompt\":\"a\",\"return_token_strs\":\"yes\"}", 400, "return_token_strs", "invalid_type"},
        {&kvf_router_tokenize_job, "not json", 400, NULL, "invalid_json"},
        {&kvf_router_tokenize_job, "[1]", 400, NULL, "invalid_json"},
        {&kvf_router_tokenize_job, body, 400, "prompt", "context_length_exceeded"},
        {&kvf_router_tokenize_job, "{\"messages\":\"hi\"}", 400, "messages", "invalid_type"},
        {&kvf_router_tokenize_job, "{\"messages\":[]}", 400, "messages", NULL},
        {&kvf_router_tokenize_job, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":3}", 400, "max_tokens", "unknown_parameter"},
        {&kvf_router_tokenize_job, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"chat_template_kwargs\":[]}", 400, "chat_template_kwargs", "invalid_type"},
        {&kvf_router_tokenize_job, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":{}}", 400, "tools", "invalid_type"},
        {&kvf_router_tokenize_job, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"continue_final_message\":true}", 400, "continue_final_message", NULL},
        {&kvf_router_tokenize_job, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"add_generation_prompt\":false,\"continue_final_message\":true,\"chat_template_kwargs\":{\"x\":1},\"tools\":[]}", 200, NULL, NULL},
        {&kvf_router_detokenize_job, "{\"tokens\":[104,105]}", 200, NULL, NULL},
        {&kvf_router_detokenize_job, "{\"model\":\"tm\",\"tokens\":[]}", 200, NULL, NULL},
        {&kvf_router_detokenize_job, "{\"tokens\":[1,320]}", 400, "tokens", "invalid_value"},
        {&kvf_router_detokenize_job, "{\"tokens\":[-1]}", 400, "tokens", "invalid_value"},
        {&kvf_router_detokenize_job, "{\"tokens\":[1.5]}", 400, "tokens", "invalid_type"},
        {&kvf_router_detokenize_job, "{\"tokens\":\"hi\"}", 400, "tokens", "invalid_type"},
        {&kvf_router_detokenize_job, "{}", 400, "tokens", "missing_required_parameter"},
        {&kvf_router_detokenize_job, "{\"tokens\":[1],\"skip_special_tokens\":true}", 400, "skip_special_tokens", "unknown_parameter"},
        {&kvf_router_detokenize_job, "{\"model\":\"other\",\"tokens\":[1]}", 404, "model", "model_not_found"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_router_oai_error e;
        json_t *j = run(cases[i].job, &c, cases[i].body, &e);
        if (e.http_status != cases[i].status || (cases[i].status != 200 && strcmp(e.param, cases[i].param ? cases[i].param : "") != 0) ||
            (cases[i].code && strcmp(e.code, cases[i].code) != 0))
            fail_msg("case %zu (%.80s): got %d param '%s' code '%s' (%s); want %d param '%s' code '%s'", i,
                     cases[i].body, e.http_status, e.param, e.code, e.message, cases[i].status,
                     cases[i].param ? cases[i].param : "", cases[i].code ? cases[i].code : "");
        json_decref(j);
    }
    free(body);
    /* a template that fails (it adds a number to the text): the template's error, without the
     * server's file path */
    char bad[96], cmd[1024];
    snprintf(bad, sizeof bad, "%s/bad", g_dir);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && cp '%s/config.json' '%s/' && printf '%%s' "
             "'{\"chat_template\": \"{{ messages[0].content + 1 }}\"}' > '%s/tokenizer_config.json'",
             bad, g_dir, bad, bad);
    assert_int_equal(system(cmd), 0);
    kvf_text_chat_template *bad_tmpl = NULL;
    kvf_err le = {0};
    if (kvf_text_chat_template_load(bad, NULL, false, NULL, &bad_tmpl, &le) != KVF_OK)
        fail_msg("%s", le.msg);
    const kvf_text_chat_template *good_tmpl = c.tmpl;
    c.tmpl = bad_tmpl;
    kvf_router_oai_error e;
    assert_null(run(&kvf_router_tokenize_job, &c,
                    "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]}]}", &e));
    c.tmpl = good_tmpl;
    kvf_text_chat_template_destroy(bad_tmpl);
    assert_int_equal(e.http_status, 400);
    assert_string_equal(e.param, "messages");
    if (strncmp(e.message, "chat template: ", 15) != 0 || strstr(e.message, g_dir) || strstr(e.message, "tokenizer_config"))
        fail_msg("the template error names the server's files: %s", e.message);
    /* no tokenizer: a 400 that says so */
    c.tok = NULL;
    assert_null(run(&kvf_router_tokenize_job, &c, "{\"prompt\":\"a\"}", &e));
    assert_int_equal(e.http_status, 400);
    assert_string_equal(e.code, "no_tokenizer");
}

static void ids_of(const json_t *a, int32_t *ids, size_t *n)
{
    *n = json_array_size(a);
    for (size_t i = 0; i < *n; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(a, i));
}

/* The answers: the tokenizer's own ids (with and without BOS), the template's text for a chat,
 * the vocabulary forms, and detokenize(tokenize(text)) == text. */
static void test_answers(void **state)
{
    (void)state;
    kvf_router_reqs_cfg c = jobs_cfg();
    kvf_router_oai_error e;
    kvf_err err = {0};
    int32_t got[512], *want = NULL;
    size_t n_got = 0, n_want = 0;

    /* the prompt form: add_special_tokens defaults to true (BOS first) */
    static const char *const texts[] = {"hello world", "héllo wörld \xf0\x9f\x8c\x8a <|im_start|> x", " "};
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++)
        for (int special = 0; special < 2; special++) {
            json_t *req = json_pack("{s:s,s:b,s:b}", "prompt", texts[k], "add_special_tokens", special,
                                    "return_token_strs", 1);
            char *body = json_dumps(req, 0);
            json_t *j = run(&kvf_router_tokenize_job, &c, body, &e);
            if (!j)
                fail_msg("%s: %s", body, e.message);
            ids_of(json_object_get(j, "tokens"), got, &n_got);
            assert_int_equal(kvf_text_tokenizer_encode(g_tok, texts[k], strlen(texts[k]), special, &want, &n_want, &err),
                             KVF_OK);
            assert_int_equal(n_got, n_want);
            assert_memory_equal(got, want, n_want * sizeof *want);
            assert_int_equal(json_integer_value(json_object_get(j, "count")), (json_int_t)n_want);
            assert_int_equal(json_integer_value(json_object_get(j, "max_model_len")), 256);
            json_t *strs = json_object_get(j, "token_strs");
            assert_int_equal(json_array_size(strs), n_want);
            for (size_t i = 0; i < n_want; i++)
                assert_string_equal(json_string_value(json_array_get(strs, i)),
                                    kvf_text_tokenizer_id_to_token(g_tok, want[i]));
            if (special)
                assert_int_equal(got[0], kvf_text_tokenizer_bos_id(g_tok));
            free(want);
            free(body);
            json_decref(j);
            /* and back: the same text (no BOS, which would come back as its own text) */
            if (!special) {
                json_t *ta = json_array();
                for (size_t i = 0; i < n_got; i++)
                    json_array_append_new(ta, json_integer(got[i]));
                json_t *dreq = json_pack("{s:o}", "tokens", ta);
                body = json_dumps(dreq, 0);
                json_decref(dreq);
                j = run(&kvf_router_detokenize_job, &c, body, &e);
                assert_non_null(j);
                assert_string_equal(json_string_value(json_object_get(j, "prompt")), texts[k]);
                json_decref(j);
                free(body);
            }
            json_decref(req);
        }

    /* the chat form: the template with a generation prompt, no BOS added, token_strs null */
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi there\"}]}";
    json_t *j = run(&kvf_router_tokenize_job, &c, chat, &e);
    assert_non_null(j);
    assert_true(json_is_null(json_object_get(j, "token_strs")));
    ids_of(json_object_get(j, "tokens"), got, &n_got);
    json_t *msgs = json_pack("[{s:s,s:s}]", "role", "user", "content", "hi there");
    kvf_text_chat_request cr = {.messages = msgs, .add_generation_prompt = true};
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(kvf_text_chat_template_render(g_tmpl, &cr, &text, &len, NULL, &err), KVF_OK);
    assert_non_null(strstr(text, "assistant"));
    assert_int_equal(kvf_text_tokenizer_encode(g_tok, text, len, false, &want, &n_want, &err), KVF_OK);
    assert_int_equal(n_got, n_want);
    assert_memory_equal(got, want, n_want * sizeof *want);
    free(want);
    free(text);
    json_decref(msgs);
    json_decref(j);

    /* continue_final_message: the text ends with the final message, its trailing space kept,
     * and nothing after it (no end-of-turn) */
    j = run(&kvf_router_tokenize_job, &c,
            "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":\"The answer is \"}],"
            "\"add_generation_prompt\":false,\"continue_final_message\":true}",
            &e);
    if (!j)
        fail_msg("%s", e.message);
    ids_of(json_object_get(j, "tokens"), got, &n_got);
    assert_int_equal(kvf_text_tokenizer_decode(g_tok, got, n_got, false, &text, &len, &err), KVF_OK);
    assert_true(len > 14);
    if (strcmp(text + len - 14, "The answer is ") != 0)
        fail_msg("continue_final_message: '%s' does not end with the final message", text);
    free(text);
    json_decref(j);
}

/* ---------------------------------------------------------------------------------------- */
/* The router in this process                                                                */

typedef struct router {
    kvf_router_http *h;
    pthread_t th;
    int port;
} router;

static void *router_main(void *arg)
{
    router *r = arg;
    kvf_err e = {0};
    kvf_router_http_run(r->h, &e);
    return NULL;
}

static void router_start_len(router *r, const char *origins, bool credentials, const char *api_key, int32_t max_len)
{
    kvf_router_http_cfg c = {0};
    c.max_model_len = max_len;
    c.host = "127.0.0.1";
    c.model = g_dir;
    c.served_name = "tm";
    c.policy = "round-robin";
    c.fleet.decode = "127.0.0.1:1"; /* none: tokenize needs no worker */
    c.fleet.health_interval_ms = 100;
    c.fleet.rpc_timeout_ms = 200;
    c.api_keys = api_key;
    c.allowed_origins = origins;
    c.allow_credentials = credentials;
    c.prep_threads = 1;
    kvf_err e = {0};
    if (kvf_router_http_create(&c, &r->h, &e) != KVF_OK)
        fail_msg("%s", e.msg);
    r->port = kvf_router_http_port(r->h);
    assert_int_equal(pthread_create(&r->th, NULL, router_main, r), 0);
}

static void router_start(router *r, const char *origins, bool credentials, const char *api_key)
{
    router_start_len(r, origins, credentials, api_key, 0);
}

static void router_stop(router *r)
{
    kvf_router_http_stop(r->h);
    pthread_join(r->th, NULL);
    kvf_router_http_destroy(r->h);
}

typedef struct resp {
    int status;
    char head[4096];
    char body[8192];
} resp;

/* One request on its own connection (Connection: close), the answer read to EOF. */
static void http(int port, const char *method, const char *path, const char *headers, const char *body, resp *r)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {20, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char req[8192];
    size_t bl = body ? strlen(body) : 0;
    int n = snprintf(req, sizeof req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s%s\r\n%s", method,
                     path, headers ? headers : "",
                     body ? "Content-Type: application/json\r\n" : "", body ? body : "");
    if (body) { /* Content-Length before the blank line */
        char *blank = strstr(req, "\r\n\r\n");
        char tail[8192];
        snprintf(tail, sizeof tail, "%s", blank + 2);
        n = (int)(blank + 2 - req) + snprintf(blank + 2, sizeof req - (size_t)(blank + 2 - req),
                                              "Content-Length: %zu\r\n%s", bl, tail);
    }
    assert_int_equal(write(fd, req, (size_t)n), n);
    static char buf[16384];
    size_t len = 0;
    ssize_t k;
    while (len < sizeof buf - 1 && (k = read(fd, buf + len, sizeof buf - 1 - len)) > 0)
        len += (size_t)k;
    close(fd);
    buf[len] = 0;
    memset(r, 0, sizeof *r);
    sscanf(buf, "HTTP/1.1 %d", &r->status);
    char *sep = strstr(buf, "\r\n\r\n");
    snprintf(r->head, sizeof r->head, "%.*s", sep ? (int)(sep - buf) : (int)len, buf);
    snprintf(r->body, sizeof r->body, "%s", sep ? sep + 4 : "");
}

/* Each request and what its answer must hold and not hold (headers or body, case-insensitive). */
static void test_http_cors(void **state)
{
    (void)state;
    router r = {0}, off = {0};
    router_start(&r, "https://app.example,https://other.example", true, "sk-tok-1");
    router_start(&off, NULL, false, NULL);
#define KEY "Authorization: Bearer sk-tok-1\r\n"
#define APP "Origin: https://app.example\r\n"
#define PRE "Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n"
    const struct {
        router *r;
        const char *method, *path, *headers, *body;
        int status;
        const char *has[3], *lacks;
    } cases[] = {
        /* tokenize and detokenize through the prep threads, under the key */
        {&r, "POST", "/tokenize", KEY, "{\"prompt\":\"hello\"}", 200, {"\"count\":", "\"max_model_len\":256", "x-request-id"}, NULL},
        {&r, "POST", "/detokenize", KEY, "{\"tokens\":[104,105]}", 200, {"{\"prompt\":\"hi\"}"}, NULL},
        {&r, "POST", "/detokenize", KEY, "{\"tokens\":[100000]}", 400, {"\"param\":\"tokens\""}, NULL},
        {&r, "POST", "/tokenize", KEY, "{\"model\":\"x\",\"prompt\":\"a\"}", 404, {"model_not_found"}, NULL},
        {&r, "GET", "/tokenize", KEY, NULL, 405, {"takes POST"}, NULL},
        {&r, "POST", "/tokenize", NULL, "{\"prompt\":\"hello\"}", 401, {"invalid_api_key"}, "Access-Control"},
        {&r, "POST", "/v1/tokenize", KEY, "{\"prompt\":\"hello\"}", 404, {"no route"}, NULL},
        /* a preflight from an allowed origin: 204 without the key, every header */
        {&r, "OPTIONS", "/v1/chat/completions", APP PRE, NULL, 204,
         {"Access-Control-Allow-Origin: https://app.example", "Access-Control-Allow-Credentials: true",
          "Access-Control-Max-Age: 600"}, "invalid_api_key"},
        {&r, "OPTIONS", "/tokenize", APP PRE, NULL, 204,
         {"Access-Control-Allow-Methods: GET,POST,OPTIONS", "Access-Control-Allow-Headers: Authorization", "Vary: Origin"},
         NULL},
        /* refused preflights: another origin, a method not allowed; no CORS headers */
        {&r, "OPTIONS", "/v1/completions", "Origin: https://evil.example\r\n" PRE, NULL, 403,
         {"cors_forbidden", "application/json"}, "Access-Control-Allow-Origin"},
        {&r, "OPTIONS", "/v1/completions", APP "Access-Control-Request-Method: PUT\r\n", NULL, 403,
         {"method 'PUT'"}, "Access-Control-Allow-Origin"},
        /* answers to an allowed origin: JSON, errors, 401 */
        {&r, "GET", "/v1/models", APP KEY, NULL, 200, {"Access-Control-Allow-Origin: https://app.example", "Vary: Origin"}, NULL},
        {&r, "POST", "/tokenize", APP KEY, "{\"prompt\":\"a\",\"bad\":1}", 400,
         {"Access-Control-Allow-Origin: https://app.example", "\"param\":\"bad\""}, NULL},
        {&r, "GET", "/v1/models", APP, NULL, 401, {"Access-Control-Allow-Origin: https://app.example", "invalid_api_key"}, NULL},
        {&r, "GET", "/v1/models", "Origin: https://other.example\r\n" KEY, NULL, 200,
         {"Access-Control-Allow-Origin: https://other.example"}, NULL},
        /* another origin: served, no CORS header */
        {&r, "GET", "/v1/models", "Origin: https://evil.example\r\n" KEY, NULL, 200, {"\"object\":\"list\""},
         "Access-Control"},
        /* no --allowed-origins: nothing changes, a preflight is a JSON 405 as before */
        {&off, "OPTIONS", "/v1/chat/completions", APP PRE, NULL, 405, {"method_not_allowed"}, "Access-Control"},
        {&off, "GET", "/v1/models", APP, NULL, 200, {"\"object\":\"list\""}, "Access-Control"},
        {&off, "POST", "/tokenize", APP, "{\"prompt\":\"hello\"}", 200, {"\"count\":"}, "Access-Control"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        resp a;
        http(cases[i].r->port, cases[i].method, cases[i].path, cases[i].headers, cases[i].body, &a);
        char all[sizeof a.head + sizeof a.body + 8];
        snprintf(all, sizeof all, "%s\r\n\r\n%s", a.head, a.body);
        if (a.status != cases[i].status)
            fail_msg("case %zu (%s %s): status %d, want %d:\n%s", i, cases[i].method, cases[i].path, a.status,
                     cases[i].status, all);
        for (size_t k = 0; k < 3 && cases[i].has[k]; k++)
            if (!strcasestr(all, cases[i].has[k]))
                fail_msg("case %zu (%s %s): no '%s' in:\n%s", i, cases[i].method, cases[i].path, cases[i].has[k], all);
        if (cases[i].lacks && strcasestr(all, cases[i].lacks))
            fail_msg("case %zu (%s %s): '%s' should not be in:\n%s", i, cases[i].method, cases[i].path, cases[i].lacks,
                     all);
    }
#undef KEY
#undef APP
#undef PRE
    router_stop(&r);
    router_stop(&off);
}

/* Set once the router's log says a tokenize job over a large body began. */
static atomic_bool g_big_started;

static void big_sink(void *ctx, kvf_log_level level, const char *line)
{
    (void)ctx, (void)level;
    const char *p = strstr(line, "router: tokenize: ");
    if (p && strtoull(p + 18, NULL, 10) > 1000000)
        atomic_store(&g_big_started, true);
}

/* A prompt the tokenizer takes a while over (3.5 MB of words; about 1.5 s here) does not hold up
 * the loop: /health, sent once the tokenizing began (the job's debug line), is answered while
 * the tokens are still being made. */
static void test_off_the_loop(void **state)
{
    (void)state;
    router r = {0};
    kvf_log_set_sink(big_sink, NULL);
    kvf_log_set_level(KVF_LOG_DEBUG);
    router_start_len(&r, NULL, false, NULL, 4000000); /* a context that can hold it */
    static const char *const words[] = {"sea", "wave", "ship", "the", "a", "blue", "storm", "sailor", "wind", "harbor"};
    size_t cap = 4u << 20, n = 0;
    char *body = malloc(cap);
    assert_non_null(body);
    n += (size_t)snprintf(body, cap, "{\"prompt\":\"");
    uint32_t x = 12345;
    while (n < 3500000) {
        x = x * 1103515245u + 12345u;
        n += (size_t)snprintf(body + n, cap - n, "%s ", words[(x >> 16) % 10]);
    }
    n += (size_t)snprintf(body + n, cap - n, "\"}");
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)r.port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char head[256];
    int hl = snprintf(head, sizeof head,
                      "POST /tokenize HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: %zu\r\n\r\n", n);
    assert_int_equal(write(fd, head, (size_t)hl), hl);
    for (size_t off = 0; off < n;) {
        ssize_t k = write(fd, body + off, n - off);
        assert_true(k > 0);
        off += (size_t)k;
    }
    for (int i = 0; i < 6000 && !atomic_load(&g_big_started); i++) /* the event, within 30 s */
        kvf_sleep_ms(5);
    assert_true(atomic_load(&g_big_started));
    resp h;
    http(r.port, "GET", "/health", NULL, NULL, &h);
    assert_int_equal(h.status, 200);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int answered_first = poll(&p, 1, 0);
    /* then the tokens, in full */
    struct timeval tv = {60, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    size_t len = 0;
    ssize_t k;
    while ((k = read(fd, body + len, cap - 1 - len)) > 0)
        len += (size_t)k;
    close(fd);
    body[len] = 0;
    if (!strstr(body, "HTTP/1.1 200") || !strstr(body, "\"count\":"))
        fail_msg("the large tokenize: %.300s", body);
    if (answered_first)
        fail_msg("/health was answered only after the large prompt's tokens: the tokenizer ran on the loop");
    free(body);
    router_stop(&r);
    kvf_log_set_level(KVF_LOG_INFO);
    kvf_log_set_sink(NULL, NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_validation),
        cmocka_unit_test(test_answers),
        cmocka_unit_test(test_http_cors),
        cmocka_unit_test(test_off_the_loop),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
