/* test_http_server.c: the router's HTTP server over real sockets against fake decode workers
 * served in this process (the Worker service's Info, Health and Generate on kvf_rpc): errors,
 * plain and SSE answers, n > 1, 64 concurrent streams, retry before the first token, cancel on
 * client disconnect, 429 when saturated, a loop that wakes on stream messages rather than a clock,
 * one KV block size for the fleet, KV tiers and approximate mode over a fake WatchKv stream.
 * Real workers are tests/e2e's. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "text/tokenizer.h"
#include "proto/worker.h"
#include "router/http.h"
#include "testutil.h"

/* ---------------------------------------------------------------------------------------- */
/* A fake decode worker                                                                      */

enum { FAKE_OK, FAKE_FAIL, FAKE_SLOW, FAKE_MID /* 3 tokens, then lost */,
       FAKE_HOLD /* sends nothing until cancelled (10 s at most) */,
       FAKE_SCRIPT /* sends g_script's tokens one by one to every sequence, then stops */,
       FAKE_PAUSE /* sends nothing for 4 s (unless cancelled), then answers as FAKE_OK */ };

typedef struct fake {
    kvf_rpc_server *srv;
    int port;
    atomic_int mode;
    atomic_int n_generate, n_cancelled;
    atomic_int last_prior, last_n_tokens; /* of the last GenerateRequest */
    atomic_int block_size;                /* what Info says (0: 16) */
    atomic_int n_watch_sent;              /* WatchKv messages sent (all streams) */
    atomic_int n_health;                  /* Health calls answered */
    atomic_int slow_health;               /* the next this many Health answers come 800 ms late
                                             (-1: every one) */
    char last_id[128];
    pthread_mutex_t mu;
} fake;

/* FAKE_SCRIPT's answer: recorded model output as token ids, its last one ending it (STOP). */
static int32_t g_script[512];
static size_t g_n_script;

/* The fake's tokens: seq i of a prompt ending in t yields t+1+k+7i (mod 320). */
static int32_t fake_token(int32_t last, int32_t k, int32_t i)
{
    return (last + 1 + k + 7 * i) % 320;
}

static kvf_status fake_info(void *ctx, kvf_rpc_call *call, kvf_rpc_info *r, kvf_err *err)
{
    (void)call, (void)err;
    fake *f = ctx;
    int32_t bs = atomic_load(&f->block_size) ? atomic_load(&f->block_size) : 16;
    kvf_kv_layout l = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 16, .block_size = bs,
                       .dtype = KVF_DTYPE_F32, .block_bytes = 2 * 2 * 2 * 16 * bs * 4};
    *r = (kvf_rpc_info){.protocol_version = KVF_RPC_PROTOCOL_VERSION, .role = KVF_RPC_ROLE_DECODE,
                        .model_id = "tiny-gqa-f32", .block_size = bs, .has_kv_layout = true,
                        .kv_layout = l, .capacity_blocks = 100, .worker_id = "fake"};
    return KVF_OK;
}

static kvf_status fake_health(void *ctx, kvf_rpc_call *call, kvf_rpc_health *r, kvf_err *err)
{
    (void)call, (void)err;
    fake *f = ctx;
    int slow = atomic_load(&f->slow_health);
    if (slow != 0) {
        if (slow > 0)
            atomic_fetch_sub(&f->slow_health, 1);
        kvf_sleep_ms(800); /* past the router's 500 ms deadline */
    }
    r->status = KVF_RPC_SERVING;
    atomic_fetch_add(&f->n_health, 1);
    return KVF_OK;
}

/* The fake's log-probability of sample i's tokens (when asked): sample 2 of 3 is the likeliest. */
static float fake_logprob(int32_t i)
{
    return -0.25f * (float)((i + 1) % 3) - 0.01f;
}

static void send_tokens(kvf_rpc_call *call, int32_t idx, const int32_t *ids, size_t n,
                        kvf_rpc_finish fin, int32_t prompt, int32_t done, bool lps)
{
    kvf_rpc_logprob lp = {.logprob = fake_logprob(idx)};
    kvf_rpc_generate_resp g = {.index = idx, .n_token_ids = n, .token_ids = ids, .finish = fin,
                               .logprobs = lps && n == 1 ? &lp : NULL};
    if (fin != KVF_RPC_FINISH_NONE) {
        g.has_usage = true;
        g.usage.prompt_tokens = prompt;
        g.usage.completion_tokens = done;
    }
    kvf_rpc_buf b = {0};
    kvf_err e = {0};
    if (kvf_rpc_generate_resp_encode(&g, &b, &e) == KVF_OK)
        kvf_rpc_call_write(call, b.data, b.len, &e);
    kvf_rpc_buf_free(&b);
}

static void fake_generate(void *ctx, kvf_rpc_call *call, kvf_rpc_generate_req *g)
{
    fake *f = ctx;
    atomic_fetch_add(&f->n_generate, 1);
    pthread_mutex_lock(&f->mu);
    snprintf(f->last_id, sizeof f->last_id, "%s", g->request_id);
    pthread_mutex_unlock(&f->mu);
    int mode = atomic_load(&f->mode);
    if (mode == FAKE_FAIL) {
        free(g);
        kvf_rpc_call_finish(call, KVF_ERR_PEER_LOST, "fake: lost before the first token");
        return;
    }
    atomic_store(&f->last_prior, g->n_prior_output_tokens);
    atomic_store(&f->last_n_tokens, (int)g->n_token_ids);
    if (mode == FAKE_HOLD) {
        free(g);
        for (int i = 0; i < 2000 && !kvf_rpc_call_is_cancelled(call); i++)
            kvf_sleep_ms(5);
        bool cancelled = kvf_rpc_call_is_cancelled(call);
        if (cancelled)
            atomic_fetch_add(&f->n_cancelled, 1);
        kvf_rpc_call_finish(call, cancelled ? KVF_ERR_CANCELLED : KVF_OK, NULL);
        return;
    }
    if (mode == FAKE_PAUSE) {
        for (int i = 0; i < 800 && !kvf_rpc_call_is_cancelled(call); i++)
            kvf_sleep_ms(5);
        if (kvf_rpc_call_is_cancelled(call)) {
            free(g);
            atomic_fetch_add(&f->n_cancelled, 1);
            kvf_rpc_call_finish(call, KVF_ERR_CANCELLED, "cancelled");
            return;
        }
    }
    if (mode == FAKE_SCRIPT) {
        int32_t n = g->sampling.n, np = (int32_t)g->n_token_ids;
        free(g);
        for (size_t k = 0; k < g_n_script; k++)
            for (int32_t i = 0; i < n; i++)
                send_tokens(call, i, &g_script[k], 1, k + 1 == g_n_script ? KVF_RPC_FINISH_STOP : KVF_RPC_FINISH_NONE,
                            np, (int32_t)k + 1, false);
        kvf_rpc_call_finish(call, KVF_OK, NULL);
        return;
    }
    int32_t last = g->token_ids[g->n_token_ids - 1], max = g->sampling.max_tokens;
    int32_t n = g->sampling.n;
    int32_t np = (int32_t)g->n_token_ids;
    bool lps = g->sampling.logprobs;
    free(g);
    for (int32_t k = 0; k < max; k++) {
        for (int32_t i = 0; i < n; i++) {
            int32_t t = fake_token(last, k, i);
            send_tokens(call, i, &t, 1, k + 1 == max ? KVF_RPC_FINISH_LENGTH : KVF_RPC_FINISH_NONE,
                        np, k + 1, lps);
        }
        if (mode == FAKE_MID && k == 2) {
            kvf_rpc_call_finish(call, KVF_ERR_PEER_LOST, "fake: lost mid-stream");
            return;
        }
        if (mode == FAKE_SLOW) {
            kvf_sleep_ms(5);
            if (kvf_rpc_call_is_cancelled(call)) {
                atomic_fetch_add(&f->n_cancelled, 1);
                kvf_rpc_call_finish(call, KVF_ERR_CANCELLED, "cancelled");
                return;
            }
        }
    }
    kvf_rpc_call_finish(call, KVF_OK, NULL);
}

/* A fake whose Info says block_size (0: 16). */
/* WatchKv as a worker with a host tier streams it: a snapshot in two parts (blocks 0-1 in the
 * pool, 2-3 in host memory), block 1 demoted to host (a STORED of a held block), block 3 removed,
 * a load report with a measured host promotion time; then nothing until the router leaves (10 s
 * at most). The index should end with block 0 in the pool and blocks 1 and 2 in host memory. */
static void fake_watch(void *ctx, kvf_rpc_call *call, kvf_rpc_watch_req *req)
{
    fake *f = ctx;
    free(req);
    static const uint64_t h[4] = {0x1111, 0x2222, 0x3333, 0x4444}, par[4] = {0, 0x1111, 0x2222, 0x3333};
    int32_t bs = atomic_load(&f->block_size) ? atomic_load(&f->block_size) : 16;
    kvf_rpc_watch_msg m[5] = {
        {.event = {.seq = 1, .kind = KVF_RPC_KV_SNAPSHOT, .block_hashes = h, .parent_hashes = par, .n = 2,
                   .block_size = bs, .model_id = "tiny-gqa-f32", .tier = KVF_RPC_TIER_POOL}},
        {.event = {.seq = 1, .kind = KVF_RPC_KV_SNAPSHOT, .block_hashes = h + 2, .parent_hashes = par + 2, .n = 2,
                   .block_size = bs, .model_id = "tiny-gqa-f32", .snapshot_done = true, .tier = KVF_RPC_TIER_HOST}},
        {.event = {.seq = 2, .kind = KVF_RPC_KV_STORED, .block_hashes = h + 1, .parent_hashes = par + 1, .n = 1,
                   .block_size = bs, .model_id = "tiny-gqa-f32", .tier = KVF_RPC_TIER_HOST}},
        {.event = {.seq = 3, .kind = KVF_RPC_KV_REMOVED, .block_hashes = h + 3, .n = 1, .block_size = bs,
                   .model_id = "tiny-gqa-f32"}},
        {.is_load = true, .load = {.total_blocks = 100, .free_blocks = 96, .host_promote_s_per_block = 1e-3}},
    };
    kvf_err e = {0};
    for (int i = 0; i < 5; i++)
        if (kvf_rpc_call_send_watch(call, &m[i], &e) == KVF_OK)
            atomic_fetch_add(&f->n_watch_sent, 1);
    for (int i = 0; i < 2000 && !kvf_rpc_call_is_cancelled(call); i++)
        kvf_sleep_ms(5);
    kvf_rpc_call_finish(call, kvf_rpc_call_is_cancelled(call) ? KVF_ERR_CANCELLED : KVF_OK, NULL);
}

static void fake_start_bs(fake *f, int mode, int32_t block_size)
{
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    atomic_store(&f->mode, mode);
    atomic_store(&f->block_size, block_size);
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .n_threads = 4};
    kvf_err e = {0};
    assert_int_equal(kvf_rpc_server_create(&o, &f->srv, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_info(f->srv, fake_info, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_health(f->srv, fake_health, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_generate(f->srv, fake_generate, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_serve_watch(f->srv, fake_watch, f, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_start(f->srv, &e), KVF_OK);
    f->port = kvf_rpc_server_port(f->srv);
}

static void fake_start(fake *f, int mode)
{
    fake_start_bs(f, mode, 0);
}

static void fake_stop(fake *f)
{
    kvf_rpc_server_destroy(f->srv);
    pthread_mutex_destroy(&f->mu);
}

/* ---------------------------------------------------------------------------------------- */
/* The router in a thread                                                                    */

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

/* ---------------------------------------------------------------------------------------- */
/* A tiny HTTP/1.1 client: one request per connection, the whole answer read to EOF.         */

typedef struct resp {
    int status;
    char headers[4096];
    char *body; /* de-chunked, NUL-terminated; free() it */
    size_t body_len;
} resp;

static int connect_to(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {20, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int send_req(int port, const char *method, const char *path, const char *body,
                    const char *extra)
{
    int fd = connect_to(port);
    if (fd < 0)
        return -1;
    char head[1024];
    size_t bl = body ? strlen(body) : 0;
    int n = snprintf(head, sizeof head,
                     "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%sContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n",
                     method, path, extra ? extra : "", bl);
    if (write(fd, head, (size_t)n) != n || (bl && write(fd, body, bl) != (ssize_t)bl)) {
        close(fd);
        return -1;
    }
    return fd;
}

static void dechunk(resp *r)
{
    char *out = malloc(r->body_len + 1), *p = r->body, *end = r->body + r->body_len;
    size_t n = 0;
    while (p < end) {
        size_t sz = strtoul(p, NULL, 16);
        char *nl = strstr(p, "\r\n");
        if (!nl || sz == 0)
            break;
        p = nl + 2;
        if (p + sz > end)
            sz = (size_t)(end - p);
        memcpy(out + n, p, sz);
        n += sz;
        p += sz + 2;
    }
    out[n] = 0;
    free(r->body);
    r->body = out;
    r->body_len = n;
}

static void read_resp(int fd, resp *r)
{
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap)
            buf = realloc(buf, cap *= 2);
        ssize_t k = read(fd, buf + len, cap - len - 1);
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    close(fd);
    buf[len] = 0;
    memset(r, 0, sizeof *r);
    sscanf(buf, "HTTP/1.1 %d", &r->status);
    char *sep = strstr(buf, "\r\n\r\n");
    size_t hl = sep ? (size_t)(sep - buf) : len;
    snprintf(r->headers, sizeof r->headers, "%.*s", (int)hl, buf);
    size_t bl = sep ? len - hl - 4 : 0;
    r->body = malloc(bl + 1);
    memcpy(r->body, sep ? sep + 4 : "", bl);
    r->body[bl] = 0;
    r->body_len = bl;
    free(buf);
    if (strcasestr(r->headers, "Transfer-Encoding: chunked"))
        dechunk(r);
}

static void http(int port, const char *method, const char *path, const char *body, const char *extra,
                 resp *r)
{
    int fd = send_req(port, method, path, body, extra);
    assert_true(fd >= 0);
    read_resp(fd, r);
}

/* The "message" of an error body. */
static const char *err_msg(const resp *r, char *buf, size_t cap)
{
    json_t *j = json_loads(r->body, 0, NULL);
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    snprintf(buf, cap, "%s", m ? m : "");
    json_decref(j);
    return buf;
}

/* ---------------------------------------------------------------------------------------- */

typedef struct fixture {
    fake f[2];
    int n_fakes;
    router r;
} fixture;

static const char *g_decode_dns; /* set by the DNS test */
static int32_t g_block_size;      /* set by the block size test */
static int32_t g_max_model_len;   /* set by the tool calls test (the tiny tokenizer is verbose) */
static const char *g_tool_parser; /* set by the tool calls test */
static const char *g_policy;      /* set by the KV tiers test (NULL: round-robin) */
static const kvf_router_kv_cfg *g_kv; /* set by the KV tiers test */

static void router_start_model(fixture *x, const char *model, const char *decode, int max_inflight)
{
    kvf_router_http_cfg c = {0};
    c.fleet.decode_dns = g_decode_dns;
    c.fleet.block_size = g_block_size;
    c.max_model_len = g_max_model_len;
    c.tool_call_parser = g_tool_parser;
    c.fleet.resolve_interval_ms = 200;
    c.host = "127.0.0.1";
    c.model = model;
    c.served_name = "tiny-gqa-f32";
    c.policy = g_policy ? g_policy : "round-robin";
    c.kv = g_kv;
    c.max_inflight = max_inflight;
    c.fleet.decode = decode;
    c.fleet.health_interval_ms = 100;
    c.fleet.rpc_timeout_ms = 500;
    kvf_err e = {0};
    kvf_status st = kvf_router_http_create(&c, &x->r.h, &e);
    if (st != KVF_OK)
        fail_msg("%s", e.msg);
    x->r.port = kvf_router_http_port(x->r.h);
    assert_int_equal(pthread_create(&x->r.th, NULL, router_main, &x->r), 0);
}

static void router_start(fixture *x, const char *decode, int max_inflight)
{
    router_start_model(x, kvf_test_shared_path("fixtures/models/tiny-gqa-f32"), decode, max_inflight);
}

static void router_stop(fixture *x)
{
    kvf_router_http_stop(x->r.h);
    pthread_join(x->r.th, NULL);
    kvf_router_http_destroy(x->r.h);
}

/* Waits until /ready says 200 (or 5 s). */
static void wait_ready(fixture *x, int want)
{
    resp r;
    for (int i = 0; i < 100; i++) {
        http(x->r.port, "GET", "/ready", NULL, NULL, &r);
        free(r.body);
        if (r.status == want)
            return;
        kvf_sleep_ms(50);
    }
    fail_msg("/ready never answered %d", want);
}

static int setup_one(void **state)
{
    fixture *x = calloc(1, sizeof *x);
    fake_start(&x->f[0], FAKE_OK);
    x->n_fakes = 1;
    char d[64];
    snprintf(d, sizeof d, "127.0.0.1:%d", x->f[0].port);
    router_start(x, d, 256);
    wait_ready(x, 200);
    *state = x;
    return 0;
}

static int setup_two(void **state)
{
    fixture *x = calloc(1, sizeof *x);
    fake_start(&x->f[0], FAKE_OK);
    fake_start(&x->f[1], FAKE_OK);
    x->n_fakes = 2;
    char d[128];
    snprintf(d, sizeof d, "127.0.0.1:%d,127.0.0.1:%d", x->f[0].port, x->f[1].port);
    router_start(x, d, 256);
    wait_ready(x, 200);
    *state = x;
    return 0;
}

static int teardown(void **state)
{
    fixture *x = *state;
    router_stop(x);
    for (int i = 0; i < x->n_fakes; i++)
        fake_stop(&x->f[i]);
    free(x);
    return 0;
}

/* No worker at all: the router still answers validation errors, and 503 for a valid request. */
static void test_errors_without_workers(void **state)
{
    (void)state;
    fixture x = {0};
    router_start(&x, "127.0.0.1:1", 256);
    resp r;
    char m[512];
    http(x.r.port, "GET", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    free(r.body);
    http(x.r.port, "GET", "/ready", NULL, NULL, &r);
    assert_int_equal(r.status, 503);
    free(r.body);
    http(x.r.port, "GET", "/v1/models", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    assert_string_equal(json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id")),
                        "tiny-gqa-f32");
    json_decref(j);
    free(r.body);
    /* models.retrieve: the served model, or OpenAI's 404 */
    http(x.r.port, "GET", "/v1/models/tiny-gqa-f32", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    j = json_loads(r.body, 0, NULL);
    assert_string_equal(json_string_value(json_object_get(j, "id")), "tiny-gqa-f32");
    assert_string_equal(json_string_value(json_object_get(j, "object")), "model");
    json_decref(j);
    free(r.body);
    http(x.r.port, "GET", "/v1/models/other%2Fmodel", NULL, NULL, &r);
    assert_int_equal(r.status, 404);
    assert_non_null(strstr(err_msg(&r, m, sizeof m), "`other/model` does not exist"));
    free(r.body);

    struct { const char *path, *body; int status; const char *msg; } cases[] = {
        {"/v1/completions", "{nope", 400, "not valid JSON"},
        {"/v1/completions", "{\"model\":\"other\",\"prompt\":[1]}", 404, "does not exist"},
        {"/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":\"hello\"}", 400, "has no tokenizer"},
        {"/v1/chat/completions", "{\"model\":\"tiny-gqa-f32\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", 400, "has no tokenizer"},
        {"/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1],\"max_tokens\":0}", 400, "'max_tokens' is 0"},
        {"/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1],\"max_tokens\":256}", 400, "maximum context length is 256"},
        {"/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1],\"top_p\":\"x\"}", 400, "'top_p' must be a number"},
        {"/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1, 320]}", 400, "ids are 0 to 319"},
        {"/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1],\"stop\":\"x\"}", 400, "need a tokenizer"},
        {"/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1]}", 503, "no decode worker"},
        {"/v1/nothing", "{}", 404, "no route"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        http(x.r.port, "POST", cases[i].path, cases[i].body, NULL, &r);
        if (r.status != cases[i].status || !strstr(err_msg(&r, m, sizeof m), cases[i].msg))
            fail_msg("%s %s: got %d '%s', want %d '%s'", cases[i].path, cases[i].body, r.status, m,
                     cases[i].status, cases[i].msg);
        if (r.status == 503)
            assert_non_null(strcasestr(r.headers, "Retry-After:"));
        free(r.body);
    }
    http(x.r.port, "GET", "/metrics", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "kvfleet_router_responses_total{code=\"4xx\"} 11"));
    free(r.body);
    router_stop(&x);
}

static void test_plain_completion(void **state)
{
    fixture *x = *state;
    resp r;
    http(x->r.port, "POST", "/v1/completions",
         "{\"model\":\"tiny-gqa-f32\",\"prompt\":[5,6,7],\"max_tokens\":24,\"temperature\":0,\"n\":2}",
         "x-request-id: my-req-1\r\n", &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strcasestr(r.headers, "x-request-id: my-req-1"));
    json_t *j = json_loads(r.body, 0, NULL);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    json_t *cs = json_object_get(j, "choices");
    assert_int_equal(json_array_size(cs), 2);
    for (size_t i = 0; i < 2; i++) {
        json_t *c = json_array_get(cs, i);
        assert_int_equal(json_integer_value(json_object_get(c, "index")), (json_int_t)i);
        json_t *ids = json_object_get(c, "token_ids");
        assert_int_equal(json_array_size(ids), 24);
        for (size_t k = 0; k < 24; k++)
            assert_int_equal(json_integer_value(json_array_get(ids, k)), fake_token(7, (int32_t)k, (int32_t)i));
        assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "length");
    }
    json_t *u = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 3);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), 48);
    assert_int_equal(json_integer_value(json_object_get(u, "total_tokens")), 51);
    json_decref(j);
    free(r.body);
    pthread_mutex_lock(&x->f[0].mu);
    assert_string_equal(x->f[0].last_id, "my-req-1"); /* the request id reached the worker */
    pthread_mutex_unlock(&x->f[0].mu);
}

/* Checks an SSE body: the ids of each choice in order, one finish per choice, usage, [DONE]. */
static void check_sse(const char *body, int32_t last, int32_t max, int32_t n, bool usage)
{
    int32_t got[4] = {0};
    int finishes = 0, usages = 0;
    const char *p = body;
    bool done = false;
    while ((p = strstr(p, "data: "))) {
        p += 6;
        if (strncmp(p, "[DONE]", 6) == 0) {
            done = true;
            break;
        }
        json_error_t je;
        json_t *j = json_loads(p, JSON_DISABLE_EOF_CHECK, &je);
        if (!j)
            fail_msg("bad SSE event: %.80s", p);
        json_t *u = json_object_get(j, "usage");
        if (u && json_is_object(u)) {
            usages++;
            assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), max * n);
        }
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(j, "choices"), i, c) {
            int32_t idx = (int32_t)json_integer_value(json_object_get(c, "index"));
            assert_true(idx >= 0 && idx < n);
            size_t k;
            json_t *id;
            json_array_foreach(json_object_get(c, "token_ids"), k, id) {
                assert_int_equal(json_integer_value(id), fake_token(last, got[idx], idx));
                got[idx]++;
            }
            if (json_is_string(json_object_get(c, "finish_reason")))
                finishes++;
        }
        json_decref(j);
    }
    assert_true(done);
    for (int32_t i = 0; i < n; i++)
        assert_int_equal(got[i], max);
    assert_int_equal(finishes, n);
    assert_int_equal(usages, usage ? 1 : 0);
}

static void test_streaming(void **state)
{
    fixture *x = *state;
    resp r;
    http(x->r.port, "POST", "/v1/completions",
         "{\"model\":\"tiny-gqa-f32\",\"prompt\":[9],\"max_tokens\":10,\"stream\":true,"
         "\"stream_options\":{\"include_usage\":true}}", NULL, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strcasestr(r.headers, "Content-Type: text/event-stream"));
    check_sse(r.body, 9, 10, 1, true);
    free(r.body);
    http(x->r.port, "POST", "/v1/completions",
         "{\"model\":\"tiny-gqa-f32\",\"prompt\":[3,4],\"max_tokens\":7,\"stream\":true,\"n\":3}", NULL, &r);
    assert_int_equal(r.status, 200);
    check_sse(r.body, 4, 7, 3, false);
    free(r.body);
}

/* A list of prompts: one Generate each, choices prompt * n + i with each prompt's own tokens,
 * usage summed; streamed, every choice's ids arrive under one id with one usage and one
 * [DONE]; a bad prompt anywhere in the list refuses the whole request by position. */
static void test_prompt_list(void **state)
{
    fixture *x = *state;
    const int32_t lasts[3] = {7, 9, 4};
    resp r;
    int g0 = atomic_load(&x->f[0].n_generate);
    http(x->r.port, "POST", "/v1/completions",
         "{\"model\":\"tiny-gqa-f32\",\"prompt\":[[5,6,7],[9],[3,4]],\"max_tokens\":4,\"n\":2}", NULL, &r);
    assert_int_equal(r.status, 200);
    assert_int_equal(atomic_load(&x->f[0].n_generate) - g0, 3);
    json_t *j = json_loads(r.body, 0, NULL);
    assert_non_null(j);
    json_t *cs = json_object_get(j, "choices");
    assert_int_equal(json_array_size(cs), 6);
    for (size_t c = 0; c < 6; c++) {
        json_t *ch = json_array_get(cs, c);
        assert_int_equal(json_integer_value(json_object_get(ch, "index")), (json_int_t)c);
        json_t *ids = json_object_get(ch, "token_ids");
        assert_int_equal(json_array_size(ids), 4);
        for (size_t k = 0; k < 4; k++)
            assert_int_equal(json_integer_value(json_array_get(ids, k)),
                             fake_token(lasts[c / 2], (int32_t)k, (int32_t)(c % 2)));
    }
    json_t *u = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 6);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), 24);
    json_decref(j);
    free(r.body);

    http(x->r.port, "POST", "/v1/completions",
         "{\"model\":\"tiny-gqa-f32\",\"prompt\":[[5,6,7],[9],[3,4]],\"max_tokens\":5,\"stream\":true,"
         "\"stream_options\":{\"include_usage\":true}}", NULL, &r);
    assert_int_equal(r.status, 200);
    int32_t got[3] = {0};
    int usages = 0, dones = 0, finishes = 0;
    char first_id[128] = "";
    for (const char *q = r.body; (q = strstr(q, "data: ")); ) {
        q += 6;
        if (strncmp(q, "[DONE]", 6) == 0) {
            dones++;
            continue;
        }
        json_t *e = json_loads(q, JSON_DISABLE_EOF_CHECK, NULL);
        assert_non_null(e);
        const char *id = json_string_value(json_object_get(e, "id"));
        if (!first_id[0])
            snprintf(first_id, sizeof first_id, "%s", id);
        assert_string_equal(id, first_id); /* one answer id for every prompt */
        if (json_is_object(json_object_get(e, "usage"))) {
            usages++;
            assert_int_equal(json_integer_value(json_object_get(json_object_get(e, "usage"), "completion_tokens")), 15);
        }
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(e, "choices"), i, c) {
            int32_t idx = (int32_t)json_integer_value(json_object_get(c, "index"));
            assert_true(idx >= 0 && idx < 3);
            size_t k;
            json_t *tid;
            json_array_foreach(json_object_get(c, "token_ids"), k, tid)
                assert_int_equal(json_integer_value(tid), fake_token(lasts[idx], got[idx]++, 0));
            finishes += json_is_string(json_object_get(c, "finish_reason"));
        }
        json_decref(e);
    }
    assert_int_equal(dones, 1);
    assert_int_equal(usages, 1);
    assert_int_equal(finishes, 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(got[i], 5);
    free(r.body);

    char m[512];
    http(x->r.port, "POST", "/v1/completions",
         "{\"model\":\"tiny-gqa-f32\",\"prompt\":[[5],[9,400],[3]],\"max_tokens\":4}", NULL, &r);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(err_msg(&r, m, sizeof m), "token id 400"));
    free(r.body);
    resp mt;
    http(x->r.port, "GET", "/metrics", NULL, NULL, &mt);
    assert_non_null(strstr(mt.body, "kvfleet_router_requests_in_flight 0"));
    free(mt.body);
}

/* A client that leaves a list of prompts mid-stream cancels every member's Generate. */
static void test_prompt_list_disconnect(void **state)
{
    fixture *x = *state;
    atomic_store(&x->f[0].mode, FAKE_SLOW);
    int fd = send_req(x->r.port, "POST", "/v1/completions",
                      "{\"model\":\"tiny-gqa-f32\",\"prompt\":[[1,2],[3],[4,5]],\"max_tokens\":200,\"stream\":true}",
                      NULL);
    assert_true(fd >= 0);
    char buf[4096];
    size_t got = 0;
    while (got < 2000) {
        ssize_t k = read(fd, buf, sizeof buf);
        assert_true(k > 0);
        got += (size_t)k;
    }
    close(fd);
    int64_t end = kvf_now_ns() + 10000000000LL;
    while (atomic_load(&x->f[0].n_cancelled) < 3 && kvf_now_ns() < end)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&x->f[0].n_cancelled), 3);
    resp m;
    for (;;) { /* the members end on the loop's next passes */
        http(x->r.port, "GET", "/metrics", NULL, NULL, &m);
        bool idle = strstr(m.body, "kvfleet_router_requests_in_flight 0") != NULL;
        if (idle || kvf_now_ns() > end)
            break;
        free(m.body);
        kvf_sleep_ms(10);
    }
    assert_non_null(strstr(m.body, "kvfleet_router_requests_in_flight 0"));
    assert_non_null(strstr(m.body, "kvfleet_router_client_disconnects_total 1"));
    free(m.body);
    atomic_store(&x->f[0].mode, FAKE_OK);
}

/* best_of draws that many samples (asking the worker for their logprobs) and answers the n with
 * the highest cumulative logprob: the fake makes sample 2 the likeliest, then 0. */
static void test_best_of(void **state)
{
    fixture *x = *state;
    resp r;
    http(x->r.port, "POST", "/v1/completions",
         "{\"model\":\"tiny-gqa-f32\",\"prompt\":[8],\"max_tokens\":3,\"best_of\":3,\"n\":2}", NULL, &r);
    assert_int_equal(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    json_t *cs = json_object_get(j, "choices");
    assert_int_equal(json_array_size(cs), 2);
    const int32_t want[2] = {2, 0};
    for (size_t c = 0; c < 2; c++) {
        json_t *ch = json_array_get(cs, c);
        assert_int_equal(json_integer_value(json_object_get(ch, "index")), (json_int_t)c);
        assert_true(json_is_null(json_object_get(ch, "logprobs"))); /* not asked for */
        json_t *ids = json_object_get(ch, "token_ids");
        for (size_t k = 0; k < 3; k++)
            assert_int_equal(json_integer_value(json_array_get(ids, k)), fake_token(8, (int32_t)k, want[c]));
    }
    assert_int_equal(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 9);
    json_decref(j);
    free(r.body);
}

typedef struct conc_arg {
    int port, i;
    bool ok;
} conc_arg;

static void *conc_main(void *p)
{
    conc_arg *a = p;
    int32_t max = 1 + (a->i * 37) % 60, last = (a->i * 11) % 300;
    char body[256];
    snprintf(body, sizeof body,
             "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2,%d],\"max_tokens\":%d,\"stream\":true}", last, max);
    int fd = send_req(a->port, "POST", "/v1/completions", body, NULL);
    if (fd < 0)
        return NULL;
    resp r;
    read_resp(fd, &r);
    /* count ids and check them without cmocka (not thread-safe) */
    int32_t got = 0;
    bool ok = r.status == 200, done = false;
    for (const char *q = r.body; ok && (q = strstr(q, "data: ")); ) {
        q += 6;
        if (strncmp(q, "[DONE]", 6) == 0) {
            done = true;
            break;
        }
        json_t *j = json_loads(q, JSON_DISABLE_EOF_CHECK, NULL);
        json_t *c = json_array_get(json_object_get(j, "choices"), 0);
        size_t k;
        json_t *id;
        json_array_foreach(json_object_get(c, "token_ids"), k, id)
            ok = ok && json_integer_value(id) == fake_token(last, got++, 0);
        json_decref(j);
    }
    a->ok = ok && done && got == max;
    free(r.body);
    return NULL;
}

static void test_concurrent_64(void **state)
{
    fixture *x = *state;
    pthread_t th[64];
    conc_arg a[64];
    for (int i = 0; i < 64; i++) {
        a[i] = (conc_arg){.port = x->r.port, .i = i};
        assert_int_equal(pthread_create(&th[i], NULL, conc_main, &a[i]), 0);
    }
    int ok = 0;
    for (int i = 0; i < 64; i++) {
        pthread_join(th[i], NULL);
        ok += a[i].ok;
    }
    assert_int_equal(ok, 64);
}

/* The first worker fails every Generate before a token: the router must retry on the other. */
static void test_retry_before_first_token(void **state)
{
    fixture *x = *state;
    atomic_store(&x->f[0].mode, FAKE_FAIL);
    for (int i = 0; i < 4; i++) {
        resp r;
        http(x->r.port, "POST", "/v1/completions",
             "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2],\"max_tokens\":5}", NULL, &r);
        assert_int_equal(r.status, 200);
        json_t *j = json_loads(r.body, 0, NULL);
        assert_int_equal(json_array_size(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids")), 5);
        json_decref(j);
        free(r.body);
    }
    assert_true(atomic_load(&x->f[0].n_generate) >= 1);
    assert_int_equal(atomic_load(&x->f[1].n_generate), 4);
    resp m;
    http(x->r.port, "GET", "/metrics", NULL, NULL, &m);
    assert_null(strstr(m.body, "kvfleet_router_retries_total 0\n"));
    free(m.body);
    atomic_store(&x->f[0].mode, FAKE_OK);
}

/* The first worker dies after 3 tokens: the request goes on on the other, resubmitted as prompt
 * + the 3 tokens with the rest of the budget, and the client sees one whole answer. */
static void test_resume_mid_stream(void **state)
{
    fixture *x = *state;
    atomic_store(&x->f[0].mode, FAKE_MID);
    bool resumed = false;
    for (int i = 0; i < 4 && !resumed; i++) {
        int before = atomic_load(&x->f[0].n_generate);
        resp r;
        http(x->r.port, "POST", "/v1/completions",
             "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2,40],\"max_tokens\":10,\"stream\":true}", NULL, &r);
        assert_int_equal(r.status, 200);
        if (atomic_load(&x->f[0].n_generate) == before) {
            free(r.body);
            continue; /* round-robin sent it to the healthy one */
        }
        resumed = true;
        assert_int_equal(atomic_load(&x->f[1].last_prior), 3);
        assert_int_equal(atomic_load(&x->f[1].last_n_tokens), 6);
        int32_t want[10], got = 0;
        for (int k = 0; k < 3; k++)
            want[k] = fake_token(40, k, 0);
        for (int k = 3; k < 10; k++)
            want[k] = fake_token(want[2], k - 3, 0);
        bool done = false;
        for (const char *p = r.body; (p = strstr(p, "data: ")); ) {
            p += 6;
            if (strncmp(p, "[DONE]", 6) == 0) {
                done = true;
                break;
            }
            json_t *j = json_loads(p, JSON_DISABLE_EOF_CHECK, NULL);
            size_t k;
            json_t *id;
            json_array_foreach(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"), k, id) {
                assert_true(got < 10);
                assert_int_equal(json_integer_value(id), want[got]);
                got++;
            }
            json_decref(j);
        }
        assert_true(done);
        assert_int_equal(got, 10);
        free(r.body);
    }
    assert_true(resumed);
    atomic_store(&x->f[0].mode, FAKE_OK);
}

/* A client that goes away mid-stream: the Generate call is cancelled on the worker. */
static void test_disconnect_cancels(void **state)
{
    fixture *x = *state;
    atomic_store(&x->f[0].mode, FAKE_SLOW);
    int fd = send_req(x->r.port, "POST", "/v1/completions",
                      "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2],\"max_tokens\":200,\"stream\":true}", NULL);
    assert_true(fd >= 0);
    char buf[4096];
    size_t got = 0;
    while (got < 1500) { /* a few chunks */
        ssize_t k = read(fd, buf, sizeof buf);
        assert_true(k > 0);
        got += (size_t)k;
    }
    close(fd);
    int64_t end = kvf_now_ns() + 5000000000LL;
    while (atomic_load(&x->f[0].n_cancelled) == 0 && kvf_now_ns() < end)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&x->f[0].n_cancelled), 1);
    resp m;
    http(x->r.port, "GET", "/metrics", NULL, NULL, &m);
    assert_non_null(strstr(m.body, "kvfleet_router_client_disconnects_total 1"));
    assert_non_null(strstr(m.body, "kvfleet_router_requests_in_flight 0"));
    free(m.body);
    atomic_store(&x->f[0].mode, FAKE_OK);
}

/* The same for a non-streaming request: the client leaves before any byte of the answer. */
static void test_disconnect_plain_cancels(void **state)
{
    fixture *x = *state;
    atomic_store(&x->f[0].mode, FAKE_SLOW);
    int fd = send_req(x->r.port, "POST", "/v1/completions",
                      "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2],\"max_tokens\":200}", NULL);
    assert_true(fd >= 0);
    int64_t end = kvf_now_ns() + 5000000000LL;
    while (atomic_load(&x->f[0].n_generate) == 0 && kvf_now_ns() < end)
        kvf_sleep_ms(5);
    kvf_sleep_ms(50);
    close(fd);
    while (atomic_load(&x->f[0].n_cancelled) == 0 && kvf_now_ns() < end)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&x->f[0].n_cancelled), 1);
    atomic_store(&x->f[0].mode, FAKE_OK);
    resp r; /* the router still serves */
    http(x->r.port, "POST", "/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1],\"max_tokens\":2}", NULL, &r);
    assert_int_equal(r.status, 200);
    free(r.body);
}

/* kvfleet_router_loop_wakeups_total{cause="<cause>"} from /metrics. */
static double wakeups(fixture *x, const char *cause)
{
    resp m;
    http(x->r.port, "GET", "/metrics", NULL, NULL, &m);
    char key[128];
    snprintf(key, sizeof key, "kvfleet_router_loop_wakeups_total{cause=\"%s\"} ", cause);
    const char *p = strstr(m.body, key);
    double v = p ? strtod(p + strlen(key), NULL) : -1;
    free(m.body);
    assert_true(v >= 0);
    return v;
}

/* The loop wakes when a stream has something, not on a clock: an answer arrives through a
 * stream wake-up, and a Generate stream that stays silent costs no pass beyond the 100 ms
 * safety timer (a 1 ms poll would make hundreds). */
static void test_wakes_on_messages_not_timers(void **state)
{
    fixture *x = *state;
    double s0 = wakeups(x, "stream");
    resp r;
    http(x->r.port, "POST", "/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[5],\"max_tokens\":8}", NULL, &r);
    assert_int_equal(r.status, 200);
    free(r.body);
    assert_true(wakeups(x, "stream") >= s0 + 1);

    atomic_store(&x->f[0].mode, FAKE_HOLD);
    int fd = send_req(x->r.port, "POST", "/v1/completions",
                      "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2],\"max_tokens\":50,\"stream\":true}", NULL);
    assert_true(fd >= 0);
    int64_t end = kvf_now_ns() + 5000000000LL;
    while (atomic_load(&x->f[0].n_generate) < 2 && kvf_now_ns() < end)
        kvf_sleep_ms(5);
    assert_int_equal(atomic_load(&x->f[0].n_generate), 2);
    kvf_sleep_ms(50);
    int64_t t0 = kvf_now_ns();
    double a_stream = wakeups(x, "stream"), a_timer = wakeups(x, "timer");
    kvf_sleep_ms(600);
    double b_stream = wakeups(x, "stream"), b_timer = wakeups(x, "timer");
    double ms = (double)(kvf_now_ns() - t0) / 1e6;
    assert_true(b_stream - a_stream <= 1);
    assert_true(b_timer - a_timer <= ms / 100.0 + 2);
    close(fd); /* the router sees the client go and cancels the held call */
    while (atomic_load(&x->f[0].n_cancelled) == 0 && kvf_now_ns() < end + 5000000000LL)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&x->f[0].n_cancelled), 1);
    atomic_store(&x->f[0].mode, FAKE_OK);
}

/* Workers found by a DNS name (as a Kubernetes headless service gives them). */
static void test_dns_membership(void **state)
{
    (void)state;
    fixture x = {0};
    fake_start(&x.f[0], FAKE_OK);
    x.n_fakes = 1;
    char name[64];
    snprintf(name, sizeof name, "localhost:%d", x.f[0].port);
    g_decode_dns = name;
    router_start(&x, NULL, 256);
    g_decode_dns = NULL;
    wait_ready(&x, 200);
    resp r;
    http(x.r.port, "POST", "/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[4],\"max_tokens\":3}", NULL, &r);
    assert_int_equal(r.status, 200);
    free(r.body);
    assert_int_equal(atomic_load(&x.f[0].n_generate), 1);
    router_stop(&x);
    fake_stop(&x.f[0]);
}

/* max_inflight 1 and one slow request in flight: the next gets 429 with Retry-After. */
/* A router over one slow fake worker, with one streaming request running on it: returns the
 * client's socket once the first bytes of the answer came. */
static int start_slow_stream(fixture *x, int max_inflight)
{
    fake_start(&x->f[0], FAKE_SLOW);
    x->n_fakes = 1;
    char d[64];
    snprintf(d, sizeof d, "127.0.0.1:%d", x->f[0].port);
    router_start(x, d, max_inflight);
    wait_ready(x, 200);
    int fd = send_req(x->r.port, "POST", "/v1/completions",
                      "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1],\"max_tokens\":100,\"stream\":true}", NULL);
    char buf[256];
    assert_true(read(fd, buf, sizeof buf) > 0);
    return fd;
}

static void test_saturated_429(void **state)
{
    (void)state;
    fixture x = {0};
    int fd = start_slow_stream(&x, 1); /* the first one is running */
    resp r;
    char m[512];
    http(x.r.port, "POST", "/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1],\"max_tokens\":3}", NULL, &r);
    assert_int_equal(r.status, 429);
    assert_non_null(strcasestr(r.headers, "Retry-After: 1"));
    assert_non_null(strstr(err_msg(&r, m, sizeof m), "in flight"));
    free(r.body);
    close(fd);
    router_stop(&x);
    fake_stop(&x.f[0]);
}

/* A streaming client leaves and the router stops at once, so the loop may end between
 * libevent's noticing the client left (which hands the request to us) and the pass that would
 * answer it. Repeated with the stop a little later each time to sweep that window; under ASan a
 * request left to nobody is a leak. */
static void test_stop_after_client_left(void **state)
{
    (void)state;
    for (int i = 0; i < 12; i++) {
        fixture x = {0};
        close(start_slow_stream(&x, 4));
        struct timespec ts = {0, (long)(i % 4) * 250000L};
        nanosleep(&ts, NULL);
        router_stop(&x);
        fake_stop(&x.f[0]);
    }
}

/* Log lines that mention a KV block size, captured for the block size test. */
static struct {
    pthread_mutex_t mu;
    char lines[4096];
} g_bs_log = {PTHREAD_MUTEX_INITIALIZER, ""};

static void bs_log_sink(void *ctx, kvf_log_level level, const char *line)
{
    (void)ctx;
    fprintf(stderr, "%s\n", line);
    if (level < KVF_LOG_WARN || !strstr(line, "block size"))
        return;
    pthread_mutex_lock(&g_bs_log.mu);
    size_t n = strlen(g_bs_log.lines);
    snprintf(g_bs_log.lines + n, sizeof g_bs_log.lines - n, "%s\n", line);
    pthread_mutex_unlock(&g_bs_log.mu);
}

/* Waits (5 s at most) for a captured line holding every one of the strings; false if none came. */
static bool bs_log_has(const char *a, const char *b, const char *c)
{
    for (int i = 0; i < 100; i++) {
        pthread_mutex_lock(&g_bs_log.mu);
        bool found = false;
        for (const char *l = g_bs_log.lines; *l && !found; l += strcspn(l, "\n") + (l[strcspn(l, "\n")] != 0)) {
            char line[1024];
            snprintf(line, sizeof line, "%.*s", (int)strcspn(l, "\n"), l);
            found = strstr(line, a) && strstr(line, b) && strstr(line, c);
        }
        pthread_mutex_unlock(&g_bs_log.mu);
        if (found)
            return true;
        kvf_sleep_ms(50);
    }
    return false;
}

/* A Health answer that is merely late (a loaded host) does not take a healthy worker out: one
 * late answer leaves it serving, as the router never says "no decode worker" meanwhile (one, not
 * the two tolerated, so that a loaded test machine's own late answer cannot make it three); a
 * worker late every time goes out after the third and comes back when it answers in time.
 * (Before, one late answer took the only worker out and requests got 503.) */
static void test_late_health_tolerated(void **state)
{
    (void)state;
    fixture x = {0};
    fake_start(&x.f[0], FAKE_OK);
    x.n_fakes = 1;
    char d[64];
    snprintf(d, sizeof d, "127.0.0.1:%d", x.f[0].port);
    router_start(&x, d, 256);
    wait_ready(&x, 200);
    int base = atomic_load(&x.f[0].n_health);
    atomic_store(&x.f[0].slow_health, 1);
    int64_t end = kvf_now_ns() + 60000000000LL;
    resp r;
    /* the late answer, then one in time: the worker stays in the whole while */
    while (atomic_load(&x.f[0].n_health) < base + 2 && kvf_now_ns() < end) {
        http(x.r.port, "GET", "/metrics", NULL, NULL, &r);
        if (!strstr(r.body, "kvfleet_router_healthy_workers{role=\"decode\"} 1\n"))
            fail_msg("the worker went out after %d late Health answers",
                     atomic_load(&x.f[0].n_health) - base);
        free(r.body);
        kvf_sleep_ms(20);
    }
    assert_true(atomic_load(&x.f[0].n_health) >= base + 2);
    http(x.r.port, "POST", "/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2],\"max_tokens\":3}",
         NULL, &r);
    assert_int_equal(r.status, 200);
    free(r.body);
    /* late every time: out after the third */
    atomic_store(&x.f[0].slow_health, -1);
    bool out = false;
    while (!out && kvf_now_ns() < end) {
        http(x.r.port, "GET", "/metrics", NULL, NULL, &r);
        out = strstr(r.body, "kvfleet_router_healthy_workers{role=\"decode\"} 0\n") != NULL;
        free(r.body);
        kvf_sleep_ms(20);
    }
    assert_true(out);
    atomic_store(&x.f[0].slow_health, 0);
    wait_ready(&x, 200);
    router_stop(&x);
    fake_stop(&x.f[0]);
}

/* The only decode worker stops answering Health (every answer late) while a request on it is
 * quiet: the router counts it out and calls it silent, but with no other decode worker to move
 * to it leaves the request alone, which then finishes. (Before, the move failed the request
 * that was about to finish.) */
static void test_silent_only_worker_keeps_stream(void **state)
{
    (void)state;
    fixture x = {0};
    fake_start(&x.f[0], FAKE_PAUSE);
    x.n_fakes = 1;
    char d[64];
    snprintf(d, sizeof d, "127.0.0.1:%d", x.f[0].port);
    router_start(&x, d, 256);
    wait_ready(&x, 200);
    atomic_store(&x.f[0].slow_health, -1);
    resp r;
    http(x.r.port, "POST", "/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2],\"max_tokens\":3}",
         NULL, &r);
    if (r.status != 200)
        fail_msg("status %d: %s", r.status, r.body);
    assert_non_null(strstr(r.body, "\"completion_tokens\":3"));
    free(r.body);
    assert_int_equal(atomic_load(&x.f[0].n_generate), 1);
    assert_int_equal(atomic_load(&x.f[0].n_cancelled), 0);
    atomic_store(&x.f[0].slow_health, 0);
    router_stop(&x);
    fake_stop(&x.f[0]);
}

/* One KV block size for the whole fleet (DESIGN section 3), checked at Info: the first worker's
 * Info sets it, and a worker whose Info disagrees is refused (never healthy, never sent a
 * request) with a warning naming both sizes and its address. A configured size refuses even the
 * first worker. */
static void test_block_size_refused(void **state)
{
    (void)state;
    kvf_log_set_sink(bs_log_sink, NULL);
    fixture x = {0};
    fake_start_bs(&x.f[0], FAKE_OK, 16);
    fake_start_bs(&x.f[1], FAKE_OK, 32);
    x.n_fakes = 2;
    char d[128], addr1[64];
    snprintf(d, sizeof d, "127.0.0.1:%d,127.0.0.1:%d", x.f[0].port, x.f[1].port);
    snprintf(addr1, sizeof addr1, "127.0.0.1:%d", x.f[1].port);
    router_start(&x, d, 256);
    wait_ready(&x, 200);
    if (!bs_log_has(addr1, "block size 32", "the fleet's is 16"))
        fail_msg("no warning that %s (block size 32) was refused by a fleet of 16", addr1);
    resp r;
    http(x.r.port, "GET", "/ready", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    if (!strstr(r.body, "ready: 1 decode workers"))
        fail_msg("/ready: %s (want 1 decode worker: the one with block size 32 is refused)", r.body);
    free(r.body);
    for (int i = 0; i < 4; i++) {
        http(x.r.port, "POST", "/v1/completions", "{\"model\":\"tiny-gqa-f32\",\"prompt\":[1,2],\"max_tokens\":3}",
             NULL, &r);
        assert_int_equal(r.status, 200);
        free(r.body);
    }
    assert_int_equal(atomic_load(&x.f[0].n_generate), 4);
    assert_int_equal(atomic_load(&x.f[1].n_generate), 0);
    http(x.r.port, "GET", "/metrics", NULL, NULL, &r);
    assert_non_null(strstr(r.body, "kvfleet_router_healthy_workers{role=\"decode\"} 1\n"));
    free(r.body);
    router_stop(&x);

    /* configured 32: the worker of 16 is refused though it is the first */
    char addr0[64];
    snprintf(addr0, sizeof addr0, "127.0.0.1:%d", x.f[0].port);
    g_block_size = 32;
    router_start(&x, addr0, 256);
    g_block_size = 0;
    if (!bs_log_has(addr0, "block size 16", "the fleet's is 32 (configured)"))
        fail_msg("no warning that %s (block size 16) was refused by a configured 32", addr0);
    http(x.r.port, "GET", "/ready", NULL, NULL, &r);
    assert_int_equal(r.status, 503);
    free(r.body);
    router_stop(&x);
    kvf_log_set_sink(NULL, NULL);
    fake_stop(&x.f[0]);
    fake_stop(&x.f[1]);
}

/* Concatenates the "text" (or delta content) of every SSE event; the last finish_reason. */
static void sse_text(const char *body, kvf_sbuf *out, char *finish, size_t cap, bool *role_first)
{
    finish[0] = 0;
    bool first = true;
    for (const char *p = body; (p = strstr(p, "data: ")); ) {
        p += 6;
        if (strncmp(p, "[DONE]", 6) == 0)
            break;
        json_t *j = json_loads(p, JSON_DISABLE_EOF_CHECK | JSON_ALLOW_NUL, NULL);
        json_t *c = json_array_get(json_object_get(j, "choices"), 0);
        json_t *d = json_object_get(c, "delta");
        if (first && role_first)
            *role_first = d && json_is_string(json_object_get(d, "role"));
        first = false;
        json_t *tv = json_object_get(d ? d : c, d ? "content" : "text");
        if (json_is_string(tv))
            kvf_sbuf_append(out, json_string_value(tv), json_string_length(tv));
        if (json_is_string(json_object_get(c, "finish_reason")))
            snprintf(finish, cap, "%s", json_string_value(json_object_get(c, "finish_reason")));
        json_decref(j);
    }
}

/* A model with a tokenizer (gen-model): text prompts, detokenized answers, stop strings in
 * plain and streamed answers, chat. */
static void test_text_stop_and_chat(void **state)
{
    (void)state;
    const char *bin = getenv("KVF_BIN");
    if (!bin || !*bin) {
        fprintf(stderr, "skip: KVF_BIN is not set (run under ctest)\n");
        return;
    }
    char dir[] = "/tmp/kvf_http_test_XXXXXX", cmd[4096];
    assert_non_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny --out '%s/m' >/dev/null 2>&1", bin, dir);
    assert_int_equal(system(cmd), 0);
    char mdir[64];
    snprintf(mdir, sizeof mdir, "%s/m", dir);
    kvf_text_tokenizer *tok = NULL;
    kvf_err e = {0};
    assert_int_equal(kvf_text_tokenizer_load(mdir, &tok, &e), KVF_OK);
    int32_t *pids = NULL;
    size_t np = 0;
    assert_int_equal(kvf_text_tokenizer_encode(tok, "hello world", 11, true, &pids, &np, &e), KVF_OK);
    int32_t want_ids[20];
    for (int k = 0; k < 20; k++)
        want_ids[k] = fake_token(pids[np - 1], k, 0);
    char *want = NULL;
    size_t want_len = 0;
    assert_int_equal(kvf_text_tokenizer_decode(tok, want_ids, 20, true, &want, &want_len, &e), KVF_OK);
    assert_true(want_len >= 8);

    fixture x = {0};
    fake_start(&x.f[0], FAKE_OK);
    x.n_fakes = 1;
    char d[64];
    snprintf(d, sizeof d, "127.0.0.1:%d", x.f[0].port);
    router_start_model(&x, mdir, d, 256);
    wait_ready(&x, 200);

    /* plain: the text is the detokenized ids */
    resp r;
    http(x.r.port, "POST", "/v1/completions",
         "{\"model\":\"tiny-gqa-f32\",\"prompt\":\"hello world\",\"max_tokens\":20}", NULL, &r);
    assert_int_equal(r.status, 200);
    json_t *j = json_loads(r.body, JSON_ALLOW_NUL, NULL);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *tx = json_object_get(c, "text");
    assert_int_equal(json_string_length(tx), want_len);
    assert_memory_equal(json_string_value(tx), want, want_len);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens")), (json_int_t)np);
    json_decref(j);
    free(r.body);

    /* a stop string from the middle of the text: cut before its first occurrence */
    /* printable ASCII from the middle on, so the stop string is plain text */
    char stop[8];
    size_t k0 = want_len / 2, sl = 0;
    while (k0 < want_len && !(want[k0] > 0x20 && want[k0] < 0x7f))
        k0++;
    while (k0 + sl < want_len && sl < 3 && want[k0 + sl] > 0x20 && want[k0 + sl] < 0x7f)
        sl++;
    assert_true(sl > 0);
    snprintf(stop, sizeof stop, "%.*s", (int)sl, want + k0);
    size_t cut = 0;
    while (memcmp(want + cut, stop, sl) != 0)
        cut++;
    json_t *req = json_pack("{s:s,s:s,s:i,s:s}", "model", "tiny-gqa-f32", "prompt", "hello world",
                            "max_tokens", 20, "stop", stop);
    char *body = json_dumps(req, 0);
    http(x.r.port, "POST", "/v1/completions", body, NULL, &r);
    assert_int_equal(r.status, 200);
    j = json_loads(r.body, JSON_ALLOW_NUL, NULL);
    c = json_array_get(json_object_get(j, "choices"), 0);
    const char *got = json_string_value(json_object_get(c, "text"));
    if (json_string_length(json_object_get(c, "text")) != cut || memcmp(got, want, cut) != 0)
        fail_msg("stop '%s': got '%s', want the first %zu bytes of '%s'", stop, got, cut, want);
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
    json_decref(j);
    free(r.body);
    free(body);
    json_object_set_new(req, "stream", json_true());
    body = json_dumps(req, 0);
    http(x.r.port, "POST", "/v1/completions", body, NULL, &r);
    assert_int_equal(r.status, 200);
    kvf_sbuf t;
    kvf_sbuf_init(&t);
    char fin[32];
    sse_text(r.body, &t, fin, sizeof fin, NULL);
    if (t.len != cut || (cut && memcmp(t.data, want, cut) != 0))
        fail_msg("streamed stop '%s': got '%s', want the first %zu bytes of '%s'", stop, t.data ? t.data : "", cut, want);
    assert_string_equal(fin, "stop");
    kvf_sbuf_fini(&t);
    free(r.body);
    free(body);
    json_decref(req);

    /* chat, plain and streamed */
    const char *chat = "{\"model\":\"tiny-gqa-f32\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":5%s}";
    snprintf(cmd, sizeof cmd, chat, "");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    assert_int_equal(r.status, 200);
    j = json_loads(r.body, JSON_ALLOW_NUL, NULL);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(c, "message"), "role")), "assistant");
    assert_int_equal(json_array_size(json_object_get(c, "token_ids")), 5);
    json_decref(j);
    free(r.body);
    snprintf(cmd, sizeof cmd, chat, ",\"stream\":true");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    assert_int_equal(r.status, 200);
    kvf_sbuf_init(&t);
    bool role = false;
    sse_text(r.body, &t, fin, sizeof fin, &role);
    assert_true(role);
    assert_string_equal(fin, "length");
    kvf_sbuf_fini(&t);
    free(r.body);

    router_stop(&x);
    fake_stop(&x.f[0]);
    free(want);
    free(pids);
    kvf_text_tokenizer_destroy(tok);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* Streamed chat: choice idx's content deltas joined, its tool-call deltas, its last
 * finish_reason. */
static json_t *sse_tool_calls(const char *body, int idx, kvf_sbuf *content, char *finish, size_t cap)
{
    json_t *calls = json_array();
    finish[0] = 0;
    for (const char *p = body; (p = strstr(p, "data: ")); ) {
        p += 6;
        if (strncmp(p, "[DONE]", 6) == 0)
            break;
        json_t *j = json_loads(p, JSON_DISABLE_EOF_CHECK, NULL);
        json_t *c = json_array_get(json_object_get(j, "choices"), 0), *d = json_object_get(c, "delta");
        json_t *tv = json_object_get(d, "content");
        if (json_integer_value(json_object_get(c, "index")) != idx) {
            json_decref(j);
            continue;
        }
        if (json_is_string(tv))
            kvf_sbuf_append(content, json_string_value(tv), json_string_length(tv));
        size_t k;
        json_t *tc;
        json_array_foreach(json_object_get(d, "tool_calls"), k, tc)
            json_array_append(calls, tc);
        if (json_is_string(json_object_get(c, "finish_reason")))
            snprintf(finish, cap, "%s", json_string_value(json_object_get(c, "finish_reason")));
        json_decref(j);
    }
    return calls;
}

/* Issue 23's tools end to end over HTTP: a model whose chat template is Qwen3's (so the hermes
 * parser is picked), requests refused with a 400 naming the field, a conversation with tools,
 * an assistant tool call (content null, arguments a JSON string) and a tool message rendered to
 * the prompt the worker gets, and a recorded hermes answer turned into tool_calls, plain and
 * streamed, n = 2; with tool_choice "none" the same answer stays text. */
static void test_tool_calls(void **state)
{
    (void)state;
    const char *bin = getenv("KVF_BIN");
    if (!bin || !*bin) {
        fprintf(stderr, "skip: KVF_BIN is not set (run under ctest)\n");
        return;
    }
    char dir[] = "/tmp/kvf_http_tools_XXXXXX", cmd[4096], mdir[64], path[128];
    assert_non_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny --out '%s/m' >/dev/null 2>&1", bin, dir);
    assert_int_equal(system(cmd), 0);
    snprintf(mdir, sizeof mdir, "%s/m", dir);
    /* Qwen3's own template as the model's chat_template.jinja */
    char qpath[4200];
    snprintf(qpath, sizeof qpath, "%s/tokenizer_config.json", kvf_test_shared_path("fixtures/tokenizers/qwen3"));
    json_t *qcfg = json_load_file(qpath, 0, NULL);
    assert_non_null(qcfg);
    snprintf(path, sizeof path, "%s/chat_template.jinja", mdir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(json_string_value(json_object_get(qcfg, "chat_template")), f);
    fclose(f);
    kvf_text_tokenizer *tok = NULL;
    kvf_err e = {0};
    assert_int_equal(kvf_text_tokenizer_load(mdir, &tok, &e), KVF_OK);
    /* the recorded answer, as the tiny model's tokens, then its EOS */
    const char *answer = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
                         "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    int32_t *ids = NULL;
    size_t n_ids = 0;
    assert_int_equal(kvf_text_tokenizer_encode(tok, answer, strlen(answer), false, &ids, &n_ids, &e), KVF_OK);
    assert_true(n_ids + 1 < sizeof g_script / sizeof g_script[0]);
    memcpy(g_script, ids, n_ids * sizeof *ids);
    g_script[n_ids] = kvf_text_tokenizer_eos_id(tok);
    g_n_script = n_ids + 1;
    free(ids);

    fixture x = {0};
    fake_start(&x.f[0], FAKE_SCRIPT);
    x.n_fakes = 1;
    char d[64];
    snprintf(d, sizeof d, "127.0.0.1:%d", x.f[0].port);
    g_max_model_len = 4096;
    router_start_model(&x, mdir, d, 256);
    g_max_model_len = 0;
    wait_ready(&x, 200);

    /* refused, naming the field */
    static const struct {
        const char *extra, *param, *msg;
    } bad[] = {
        {"\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"http://x/a.png\"}}]}]",
         "messages.[0].content.[0].type", "not supported"},
        {"\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":1}]}]", "messages.[0].content.[0].text", "a string"},
        {"\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
         "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}", "tool_choice", "not in 'tools'"},
        {"\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\",\"function\":{}}]",
         "tools.[0].function.name", "required"},
        {"\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
         "\"function\":{\"name\":\"f\",\"arguments\":\"{\"}}]}]", "messages.[0].tool_calls.[0].function.arguments", "not valid JSON"},
    };
    resp r;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(cmd, sizeof cmd, "{\"model\":\"tiny-gqa-f32\",%s}", bad[i].extra);
        http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
        json_t *j = json_loads(r.body, 0, NULL);
        json_t *err = json_object_get(j, "error");
        if (r.status != 400 || !json_is_string(json_object_get(err, "param")) ||
            strcmp(json_string_value(json_object_get(err, "param")), bad[i].param) != 0 ||
            !strstr(json_string_value(json_object_get(err, "message")), bad[i].msg))
            fail_msg("%s: got %d %s", bad[i].extra, r.status, r.body);
        json_decref(j);
        free(r.body);
    }

    /* a whole tool conversation: the prompt is the template's rendering of it */
    const char *conv =
        "{\"model\":\"tiny-gqa-f32\",\"messages\":["
        "{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"What's the weather\"},{\"type\":\"text\",\"text\":\"in Paris?\"}]},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_0\",\"type\":\"function\","
        "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"call_0\",\"content\":\"{\\\"temp_c\\\": 18}\"}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather now.\","
        "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}}]%s}";
    const char *want_prompt =
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with "
        "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather now.\", \"parameters\": "
        "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"get_time\"}}\n</tools>\n\nFor each function call, return a json "
        "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWhat's the weather\n"
        "in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
        "\"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n";
    int32_t *pids = NULL;
    size_t np = 0;
    assert_int_equal(kvf_text_tokenizer_encode(tok, want_prompt, strlen(want_prompt), false, &pids, &np, &e), KVF_OK);
    free(pids);

    snprintf(cmd, sizeof cmd, conv, ",\"n\":2");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    if (r.status != 200)
        fail_msg("tool conversation: %d %s", r.status, r.body);
    assert_int_equal(atomic_load(&x.f[0].last_n_tokens), (int)np);
    json_t *j = json_loads(r.body, 0, NULL);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens")), (json_int_t)np);
    char first_id[64] = "";
    for (size_t i = 0; i < 2; i++) {
        json_t *c = json_array_get(json_object_get(j, "choices"), i), *m = json_object_get(c, "message");
        assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "tool_calls");
        assert_string_equal(json_string_value(json_object_get(m, "content")), "Let me check.\n");
        json_t *tcs = json_object_get(m, "tool_calls");
        assert_int_equal(json_array_size(tcs), 2);
        json_t *t0 = json_array_get(tcs, 0), *t1 = json_array_get(tcs, 1);
        assert_string_equal(json_string_value(json_object_get(json_object_get(t0, "function"), "name")), "get_weather");
        assert_string_equal(json_string_value(json_object_get(json_object_get(t0, "function"), "arguments")), "{\"city\":\"Paris\"}");
        assert_string_equal(json_string_value(json_object_get(json_object_get(t1, "function"), "name")), "get_time");
        assert_string_equal(json_string_value(json_object_get(json_object_get(t1, "function"), "arguments")), "{}");
        assert_string_equal(json_string_value(json_object_get(t0, "type")), "function");
        const char *id = json_string_value(json_object_get(t0, "id"));
        assert_true(id && strncmp(id, "call_", 5) == 0 && strlen(id) == 29);
        if (i == 0)
            snprintf(first_id, sizeof first_id, "%s", id);
        else
            assert_string_not_equal(first_id, id);
    }
    json_decref(j);
    free(r.body);

    /* streamed: the text before the calls as content, then the calls as deltas */
    snprintf(cmd, sizeof cmd, conv, ",\"stream\":true,\"n\":2");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    assert_int_equal(r.status, 200);
    for (int idx = 0; idx < 2; idx++) {
        kvf_sbuf t;
        kvf_sbuf_init(&t);
        char fin[32];
        json_t *calls = sse_tool_calls(r.body, idx, &t, fin, sizeof fin);
        assert_string_equal(fin, "tool_calls");
        if (t.len != strlen("Let me check.\n") || memcmp(t.data, "Let me check.\n", t.len) != 0)
            fail_msg("choice %d: streamed content [%.*s]", idx, (int)t.len, t.data ? t.data : "");
        assert_int_equal(json_array_size(calls), 2);
        assert_int_equal(json_integer_value(json_object_get(json_array_get(calls, 1), "index")), 1);
        assert_string_equal(json_string_value(json_object_get(json_object_get(json_array_get(calls, 0), "function"), "arguments")),
                            "{\"city\":\"Paris\"}");
        assert_string_equal(json_string_value(json_object_get(json_object_get(json_array_get(calls, 1), "function"), "name")),
                            "get_time");
        json_decref(calls);
        kvf_sbuf_fini(&t);
    }
    free(r.body);

    /* parallel_tool_calls false: the first call only */
    snprintf(cmd, sizeof cmd, conv, ",\"parallel_tool_calls\":false");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    assert_int_equal(r.status, 200);
    j = json_loads(r.body, 0, NULL);
    json_t *m = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    assert_int_equal(json_array_size(json_object_get(m, "tool_calls")), 1);
    json_decref(j);
    free(r.body);

    /* tool_choice "none": tools still rendered, the answer stays text (no EOS text in it) */
    snprintf(cmd, sizeof cmd, conv, ",\"tool_choice\":\"none\",\"skip_special_tokens\":false");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    assert_int_equal(r.status, 200);
    assert_int_equal(atomic_load(&x.f[0].last_n_tokens), (int)np);
    j = json_loads(r.body, 0, NULL);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    m = json_object_get(c, "message");
    assert_string_equal(json_string_value(json_object_get(m, "content")), answer);
    assert_null(json_object_get(m, "tool_calls"));
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
    json_decref(j);
    free(r.body);
    router_stop(&x);

    /* --tool-call-parser none: "auto" cannot be honoured (400 naming tool_choice), "none" can */
    g_max_model_len = 4096;
    g_tool_parser = "none";
    router_start_model(&x, mdir, d, 256);
    g_max_model_len = 0;
    g_tool_parser = NULL;
    wait_ready(&x, 200);
    snprintf(cmd, sizeof cmd, conv, "");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "\"param\":\"tool_choice\""));
    assert_non_null(strstr(r.body, "--tool-call-parser"));
    free(r.body);
    snprintf(cmd, sizeof cmd, conv, ",\"tool_choice\":\"none\"");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    assert_int_equal(r.status, 200);
    free(r.body);
    router_stop(&x);

    /* a chat template that never renders tools: a request with tools is refused */
    f = fopen(path, "wb");
    assert_non_null(f);
    fputs("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", f);
    fclose(f);
    router_start_model(&x, mdir, d, 256);
    wait_ready(&x, 200);
    snprintf(cmd, sizeof cmd, conv, ",\"tool_choice\":\"none\"");
    http(x.r.port, "POST", "/v1/chat/completions", cmd, NULL, &r);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "\"param\":\"tools\""));
    free(r.body);
    router_stop(&x);

    fake_stop(&x.f[0]);
    json_decref(qcfg);
    kvf_text_tokenizer_destroy(tok);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* Bytes sent as they are; the answer read to the end. */
static void raw(int port, const char *bytes, resp *r)
{
    int fd = connect_to(port);
    assert_true(fd >= 0);
    size_t n = strlen(bytes);
    assert_int_equal(write(fd, bytes, n), (ssize_t)n);
    shutdown(fd, SHUT_WR);
    read_resp(fd, r);
}

/* Requests refused for their framing get OpenAI JSON from the router's connection filter, not
 * evhttp's HTML: a chunked body over --max-body-bytes (evhttp answered HTML 413 after reading
 * up to the limit), a malformed header line, Content-Length together with Transfer-Encoding
 * (read one way by a proxy and another by us: request smuggling). A valid chunked body still
 * reaches the handler whole. */
static void test_wire_framing_json(void **state)
{
    (void)state;
    fixture x = {0};
    router_start(&x, "127.0.0.1:1", 256);
    resp r;
    char m[512];
    static const struct {
        const char *req;
        int status;
        const char *msg;
    } cases[] = {
        {"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1000000\r\n", 413,
         "chunked request body is over"},
        {"GET /v1/models HTTP/1.1\r\nHost: a\r\nNo colon here\r\n\r\n", 400, "NAME: VALUE"},
        {"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
         "0\r\n\r\n",
         400, "both Content-Length and Transfer-Encoding"},
        {"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n0\r\n\r\n",
         400, "chunked body is malformed"},
        {"POST /v1/completions HTTP/1.1\r\nHost: a\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
         "11\r\n{\"model\":\"other\",\r\n"
         "d\r\n\"prompt\":[1]}\r\n0\r\n\r\n",
         404, "does not exist"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        raw(x.r.port, cases[i].req, &r);
        if (r.status != cases[i].status || !strstr(err_msg(&r, m, sizeof m), cases[i].msg) ||
            !strcasestr(r.headers, "Content-Type: application/json"))
            fail_msg("case %zu: got %d '%s' (%s), want %d '%s'", i, r.status, m, r.headers, cases[i].status,
                     cases[i].msg);
        free(r.body);
    }
    http(x.r.port, "GET", "/metrics", NULL, NULL, &r);
    assert_non_null(strstr(r.body, "kvfleet_router_requests_refused_total{reason=\"malformed\"} 3"));
    assert_non_null(strstr(r.body, "kvfleet_router_requests_refused_total{reason=\"body_bytes\"} 1"));
    free(r.body);
    router_stop(&x);
}

/* /metrics has this line (polled for up to 5 s). */
static void wait_metric(fixture *x, const char *line)
{
    resp r;
    for (int i = 0; i < 100; i++) {
        http(x->r.port, "GET", "/metrics", NULL, NULL, &r);
        bool found = strstr(r.body, line) != NULL;
        if (found || i == 99) {
            if (!found)
                fail_msg("/metrics never had %s:\n%s", line, r.body);
            free(r.body);
            return;
        }
        free(r.body);
        kvf_sleep_ms(50);
    }
}

/* Issue 22 over a real WatchKv stream: under the kv policy the worker's snapshot parts, tier
 * moves and removals reach the index with their tiers (/metrics per tier); under --approx the
 * same stream's events are ignored (the index holds only the router's predictions, in the pool
 * tier) and /ready waits for no snapshot. */
static void test_kv_tiers_over_watch(void **state)
{
    (void)state;
    fixture x = {0};
    fake_start(&x.f[0], FAKE_OK);
    x.n_fakes = 1;
    char d[64];
    snprintf(d, sizeof d, "127.0.0.1:%d", x.f[0].port);
    g_policy = "kv";
    router_start(&x, d, 256);
    wait_ready(&x, 200); /* under kv: after the snapshot */
    wait_metric(&x, "kvfleet_router_index_worker_blocks{role=\"decode\",tier=\"host\"} 2\n");
    wait_metric(&x, "kvfleet_router_index_worker_blocks{role=\"decode\",tier=\"pool\"} 1\n");
    wait_metric(&x, "kvfleet_router_index_worker_blocks{role=\"decode\",tier=\"disk\"} 0\n");
    wait_metric(&x, "kvfleet_router_index_blocks{role=\"decode\"} 3\n");
    router_stop(&x);

    kvf_router_kv_cfg kv;
    kvf_router_kv_cfg_default(&kv);
    kv.approx = true;
    g_kv = &kv;
    int sent = atomic_load(&x.f[0].n_watch_sent);
    router_start(&x, d, 256);
    wait_ready(&x, 200);
    for (int i = 0; i < 200 && atomic_load(&x.f[0].n_watch_sent) < sent + 5; i++)
        kvf_sleep_ms(10);
    assert_int_equal(atomic_load(&x.f[0].n_watch_sent), sent + 5); /* the stream was read ... */
    kvf_sleep_ms(300);
    wait_metric(&x, "kvfleet_router_index_blocks{role=\"decode\"} 0\n"); /* ... and its events ignored */
    wait_metric(&x, "kvfleet_router_index_worker_blocks{role=\"decode\",tier=\"host\"} 0\n");
    /* a 40-token prompt: its 2 full blocks are predicted on the worker, in its pool */
    resp r;
    char body[512];
    int n = snprintf(body, sizeof body, "{\"model\":\"tiny-gqa-f32\",\"max_tokens\":2,\"prompt\":[");
    for (int i = 0; i < 40; i++)
        n += snprintf(body + n, sizeof body - (size_t)n, "%s%d", i ? "," : "", i + 1);
    snprintf(body + n, sizeof body - (size_t)n, "]}");
    http(x.r.port, "POST", "/v1/completions", body, NULL, &r);
    assert_int_equal(r.status, 200);
    free(r.body);
    wait_metric(&x, "kvfleet_router_index_worker_blocks{role=\"decode\",tier=\"pool\"} 2\n");
    wait_metric(&x, "kvfleet_router_index_worker_blocks{role=\"decode\",tier=\"host\"} 0\n");
    router_stop(&x);
    g_kv = NULL;
    g_policy = NULL;
    fake_stop(&x.f[0]);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN); /* as kvfleet router does: clients here close mid-answer */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors_without_workers),
        cmocka_unit_test_setup_teardown(test_plain_completion, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_streaming, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_prompt_list, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_prompt_list_disconnect, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_best_of, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_64, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_retry_before_first_token, setup_two, teardown),
        cmocka_unit_test_setup_teardown(test_resume_mid_stream, setup_two, teardown),
        cmocka_unit_test_setup_teardown(test_disconnect_cancels, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_disconnect_plain_cancels, setup_one, teardown),
        cmocka_unit_test_setup_teardown(test_wakes_on_messages_not_timers, setup_one, teardown),
        cmocka_unit_test(test_saturated_429),
        cmocka_unit_test(test_stop_after_client_left),
        cmocka_unit_test(test_dns_membership),
        cmocka_unit_test(test_block_size_refused),
        cmocka_unit_test(test_text_stop_and_chat),
        cmocka_unit_test(test_tool_calls),
        cmocka_unit_test(test_wire_framing_json),
        cmocka_unit_test(test_kv_tiers_over_watch),
        cmocka_unit_test(test_late_health_tolerated),
        cmocka_unit_test(test_silent_only_worker_keeps_stream),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
