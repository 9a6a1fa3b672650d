/* serve.c: `kvfleet bench serve`: an open-loop load generator (Poisson arrivals, seeded) that starts
 * each fleet itself with `kvfleet up`, streams token-id prompts through the router's OpenAI SSE
 * API and reports TTFT / ITL percentiles, output tokens/s, errors and prefix-cache hit rate per
 * configuration, with each one's ratio to its baseline (colocated, or round-robin). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "bench/bench.h"
#include "common/cfg.h"
#include "common/progress.h"
#include "common/time.h"

#define SERVE_MAX_REQS 100000

typedef struct serve_cfg {
    const char *model, *workload, *fleet_log, *device, *fleet_flags;
    double rate, duration;
    int64_t requests, seed;
    int32_t out_min, out_max, turns, ready_timeout_s;
} serve_cfg;

static const kvf_cfg_opt serve_opts[] = {
    {"model", NULL, "model directory (default: gen-model --preset tiny into a temporary directory)", offsetof(serve_cfg, model), KVF_CFG_STR},
    {"workload", "mixes", "mixes (colocated vs disaggregated, short and long prompts), multiturn (round-robin vs kv, 3 decode workers) or secure (a disaggregated fleet plain vs with --tls and an API key)", offsetof(serve_cfg, workload), KVF_CFG_STR},
    {"rate", "2", "mean arrivals per second (requests; conversations for multiturn)", offsetof(serve_cfg, rate), KVF_CFG_DOUBLE},
    {"duration", "20", "seconds of arrivals per configuration (when --requests is 0)", offsetof(serve_cfg, duration), KVF_CFG_DOUBLE},
    {"requests", "0", "arrivals per configuration (0: as many as --duration allows)", offsetof(serve_cfg, requests), KVF_CFG_INT64},
    {"seed", "1", "seed of arrivals and prompts (every configuration gets the same workload)", offsetof(serve_cfg, seed), KVF_CFG_INT64},
    {"out-min", "16", "fewest output tokens per request", offsetof(serve_cfg, out_min), KVF_CFG_INT},
    {"out-max", "64", "most output tokens per request", offsetof(serve_cfg, out_max), KVF_CFG_INT},
    {"turns", "4", "turns per conversation (multiturn)", offsetof(serve_cfg, turns), KVF_CFG_INT},
    {"ready-timeout-s", "120", "how long to wait for each fleet to be ready", offsetof(serve_cfg, ready_timeout_s), KVF_CFG_INT},
    {"device", "cpu", "where the workers run: cpu or cuda (every worker of a fleet on GPU 0; passed to kvfleet up)", offsetof(serve_cfg, device), KVF_CFG_STR},
    {"fleet-flags", NULL, "more flags for every kvfleet up, space-separated (e.g. \"--kv-memory=4G --kv-dtype=bf16\")", offsetof(serve_cfg, fleet_flags), KVF_CFG_STR},
    {"log-dir", NULL, "where each fleet's stderr is kept as <configuration>.log (default: a temporary directory, removed)", offsetof(serve_cfg, fleet_log), KVF_CFG_STR},
    {NULL},
};

static const kvf_cfg_spec serve_spec = {
    .prog = "kvfleet bench serve",
    .summary = "Starts each configuration's fleet with `kvfleet up --port 0`, sends token-id prompts as\n"
               "an open loop with Poisson arrivals (--rate, --duration or --requests, --seed), streams\n"
               "the answers and stops the fleet. mixes: colocated (--prefill 0 --decode 2, the baseline)\n"
               "vs disaggregated (--prefill 1 --decode 1 --local-prefill-max-tokens 0), for a short\n"
               "(32-128 tokens) and a long (512-1024) prompt mix. multiturn: conversations whose turns\n"
               "extend the previous prompt with the answer and new user tokens, --policy round-robin\n"
               "(baseline) vs kv over 3 decode workers. Prints a table per configuration (requests,\n"
               "errors, TTFT and ITL p50/p99 ms, output tok/s, prefix hit rate from the answers' usage\n"
               "cached_tokens) and ends with: serve: disagg_vs_coloc_ttft_p50=<x> kv_vs_rr_hit=<y>.\n",
    .opts = serve_opts,
};

/* ---- random ---------------------------------------------------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t rng_next(uint64_t *s) { return mix64((*s)++ * 0x2545F4914F6CDD1Dull); }
static double rng_unit(uint64_t *s) { return ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0; }
static int32_t rng_range(uint64_t *s, int32_t lo, int32_t hi) { return lo + (int32_t)(rng_next(s) % (uint64_t)(hi - lo + 1)); }

/* ---- one streamed request ---------------------------------------------------------------------- */

typedef struct serve_result {
    bool ok;
    double ttft_s, end_s;
    int32_t n_out, cap; /* tokens received, room in itl/out_ids */
    int64_t prompt_tokens, cached_tokens, usage_out; /* from the last chunk's usage */
    char finish[16];
    double *itl; /* [n_out - 1] seconds between tokens */
    int32_t *out_ids;
    char err[160];
} serve_result;

typedef struct serve_ctx {
    const char *host, *port, *model_id;
    int32_t vocab;
    const char *api_key; /* sent as Authorization: Bearer; NULL: none */
} serve_ctx;

static int connect_to(const char *host, const char *port)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(host, port, &hints, &ai) != 0)
        return -1;
    int fd = -1;
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0)
            continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0)
            break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

static int send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* One SSE event's JSON: token ids (timed) or the usage. */
static void on_event(serve_result *r, const char *data, size_t len, double t0, double *t_last)
{
    json_error_t je;
    json_t *j = json_loadb(data, len, JSON_ALLOW_NUL, &je); /* a token may decode to a NUL */
    if (!j) {
        snprintf(r->err, sizeof r->err, "an SSE event is not JSON (%.60s): %.40s", je.text, data);
        r->ok = false;
        return;
    }
    json_t *err = json_object_get(j, "error");
    if (err) {
        json_t *m = json_object_get(err, "message");
        snprintf(r->err, sizeof r->err, "error event: %s", json_is_string(m) ? json_string_value(m) : "?");
        r->ok = false;
    }
    json_t *ch = json_object_get(j, "choices");
    json_t *c0 = json_is_array(ch) && json_array_size(ch) ? json_array_get(ch, 0) : NULL;
    json_t *ids = c0 ? json_object_get(c0, "token_ids") : NULL;
    size_t n = json_is_array(ids) ? json_array_size(ids) : 0;
    if (n > (size_t)(r->cap - r->n_out)) {
        snprintf(r->err, sizeof r->err, "more tokens than max_tokens (%d)", r->cap);
        r->ok = false;
        n = (size_t)(r->cap - r->n_out);
    }
    if (n) {
        double now = kvf_now_s();
        if (r->n_out == 0)
            r->ttft_s = now - t0;
        else
            for (size_t i = 0; i < n; i++)
                r->itl[r->n_out - 1 + (int32_t)i] = (now - *t_last) / (double)n;
        for (size_t i = 0; i < n; i++)
            r->out_ids[r->n_out++] = (int32_t)json_integer_value(json_array_get(ids, i));
        *t_last = now;
    }
    json_t *fr = c0 ? json_object_get(c0, "finish_reason") : NULL;
    if (json_is_string(fr))
        snprintf(r->finish, sizeof r->finish, "%s", json_string_value(fr));
    json_t *u = json_object_get(j, "usage");
    if (json_is_object(u)) {
        r->prompt_tokens = json_integer_value(json_object_get(u, "prompt_tokens"));
        r->usage_out = json_integer_value(json_object_get(u, "completion_tokens"));
        json_t *d = json_object_get(u, "prompt_tokens_details");
        r->cached_tokens = json_integer_value(json_object_get(d, "cached_tokens"));
    }
    json_decref(j);
}

/* POSTs /v1/completions (HTTP/1.0, so the body is not chunked) and reads the SSE stream.
 * r->out_ids / r->itl must hold max_tokens entries. */
static void run_request(const serve_ctx *sc, const int32_t *prompt, int32_t n_prompt,
                        int32_t max_tokens, serve_result *r)
{
    double t0 = kvf_now_s(), t_last = t0;
    r->ok = false;
    r->n_out = 0;
    size_t cap = 256 + (size_t)n_prompt * 8;
    char *body = malloc(cap), *req = malloc(cap + 512);
    char *buf = malloc(1 << 16);
    int fd = -1;
    if (!body || !req || !buf) {
        snprintf(r->err, sizeof r->err, "out of memory");
        goto done;
    }
    size_t bl = (size_t)snprintf(body, cap, "{\"model\":\"%s\",\"max_tokens\":%d,\"stream\":true,"
                                 "\"stream_options\":{\"include_usage\":true},\"temperature\":0,"
                                 "\"ignore_eos\":true,\"prompt\":[", sc->model_id, max_tokens);
    for (int32_t i = 0; i < n_prompt; i++)
        bl += (size_t)snprintf(body + bl, cap - bl, "%s%d", i ? "," : "", prompt[i]);
    bl += (size_t)snprintf(body + bl, cap - bl, "]}");
    char auth[160] = "";
    if (sc->api_key)
        snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", sc->api_key);
    int rl = snprintf(req, cap + 512, "POST /v1/completions HTTP/1.0\r\nHost: %s:%s\r\n%s"
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                      sc->host, sc->port, auth, bl, body);
    if ((fd = connect_to(sc->host, sc->port)) < 0) {
        snprintf(r->err, sizeof r->err, "connect %s:%s: %s", sc->host, sc->port, strerror(errno));
        goto done;
    }
    if (send_all(fd, req, (size_t)rl) != 0) {
        snprintf(r->err, sizeof r->err, "send: %s", strerror(errno));
        goto done;
    }
    size_t len = 0;
    bool head_done = false, done_seen = false;
    int status = 0;
    r->ok = true;
    for (;;) {
        ssize_t got = recv(fd, buf + len, (1 << 16) - 1 - len, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        len += (size_t)got;
        buf[len] = 0;
        size_t at = 0;
        if (!head_done) {
            char *e = strstr(buf, "\r\n\r\n");
            if (!e)
                continue;
            head_done = true;
            sscanf(buf, "HTTP/%*s %d", &status);
            if (status != 200) {
                char *nl = strchr(e + 4, '\n');
                snprintf(r->err, sizeof r->err, "HTTP %d: %.*s", status, nl ? (int)(nl - e - 4) : 100, e + 4);
                r->ok = false;
                goto done;
            }
            at = (size_t)(e + 4 - buf);
        }
        /* whole lines */
        for (;;) {
            char *nl = memchr(buf + at, '\n', len - at);
            if (!nl)
                break;
            size_t ll = (size_t)(nl - (buf + at));
            const char *line = buf + at;
            if (ll && line[ll - 1] == '\r')
                ll--;
            if (ll >= 6 && strncmp(line, "data: ", 6) == 0) {
                if (ll - 6 == 6 && strncmp(line + 6, "[DONE]", 6) == 0)
                    done_seen = true;
                else
                    on_event(r, line + 6, ll - 6, t0, &t_last);
            }
            at = (size_t)(nl - buf) + 1;
        }
        memmove(buf, buf + at, len - at);
        len -= at;
        if (len >= (1 << 16) - 1) {
            snprintf(r->err, sizeof r->err, "an SSE line longer than 64 KiB");
            r->ok = false;
            goto done;
        }
    }
    if (r->ok && !done_seen) {
        snprintf(r->err, sizeof r->err, "stream ended without [DONE] after %d tokens", r->n_out);
        r->ok = false;
    } else if (r->ok && r->n_out != max_tokens) {
        snprintf(r->err, sizeof r->err, "%d token ids streamed, asked for %d (prompt %d tokens; usage says %lld, "
                 "finish_reason %s)", r->n_out, max_tokens, n_prompt, (long long)r->usage_out, r->finish);
        r->ok = false;
    }
done:
    r->end_s = kvf_now_s();
    if (fd >= 0)
        close(fd);
    free(body);
    free(req);
    free(buf);
}

/* ---- workloads -------------------------------------------------------------------------------- */

typedef struct serve_job {
    const serve_ctx *sc;
    const serve_cfg *c;
    uint64_t seed;
    int32_t p_min, p_max, turns, max_pos;
    serve_result *res; /* [turns] */
    pthread_t th;
    bool started;
} serve_job;

static void random_ids(uint64_t *s, int32_t vocab, int32_t *out, int32_t n)
{
    for (int32_t i = 0; i < n; i++)
        out[i] = rng_range(s, 3, vocab - 1); /* past the usual special ids */
}

/* One request (turns = 1) or one conversation: turn k's prompt is turn k-1's prompt, its answer
 * and 32-64 new user tokens. */
static void *job_main(void *arg)
{
    serve_job *jb = arg;
    uint64_t s = jb->seed;
    int32_t cap = jb->max_pos - 1; /* a sequence may not fill the last position */
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)cap);
    int32_t n = rng_range(&s, jb->p_min, jb->p_max);
    if (!prompt)
        return NULL;
    random_ids(&s, jb->sc->vocab, prompt, n);
    for (int32_t t = 0; t < jb->turns; t++) {
        serve_result *r = &jb->res[t];
        int32_t out = rng_range(&s, jb->c->out_min, jb->c->out_max);
        if (n + out > cap) {
            snprintf(r->err, sizeof r->err, "conversation outgrew the model's %d positions", cap);
            break;
        }
        r->itl = calloc((size_t)out, sizeof(double));
        r->out_ids = calloc((size_t)out, sizeof(int32_t));
        if (!r->itl || !r->out_ids) {
            snprintf(r->err, sizeof r->err, "out of memory");
            break;
        }
        r->cap = out;
        run_request(jb->sc, prompt, n, out, r);
        if (!r->ok || t + 1 == jb->turns)
            break;
        int32_t user = rng_range(&s, 32, 64);
        if (n + r->n_out + user + jb->c->out_max > cap)
            break;
        memcpy(prompt + n, r->out_ids, sizeof(int32_t) * (size_t)r->n_out);
        n += r->n_out;
        random_ids(&s, jb->sc->vocab, prompt + n, user);
        n += user;
    }
    free(prompt);
    return NULL;
}

/* ---- the fleet ------------------------------------------------------------------------------------ */

typedef struct serve_fleet {
    pid_t pid;
    FILE *out; /* its stdout, open until it has stopped (it prints a last line then) */
    char host[128], port[16];
    char log[PATH_MAX];   /* its stderr, where the workers log their admin HTTP ports */
} serve_fleet;

/* Starts `self up --port 0 <args>` and reads its stdout until it prints the URL. */
static int fleet_start(const char *self, const serve_cfg *c, const char *model, const char *log_dir,
                       const char *name, char *const *extra, serve_fleet *f)
{
    snprintf(f->log, sizeof f->log, "%s/%s.log", log_dir, name);
    for (char *p = strrchr(f->log, '/'); p && *p; p++)
        if (*p == ' ')
            *p = '-';
    int pfd[2];
    if (pipe(pfd) != 0)
        return -1;
    char model_arg[PATH_MAX + 16], rt[32];
    snprintf(model_arg, sizeof model_arg, "--model=%s", model);
    snprintf(rt, sizeof rt, "--ready-timeout-s=%d", c->ready_timeout_s);
    char dev[64];
    snprintf(dev, sizeof dev, "--device=%s", c->device ? c->device : "cpu");
    char *argv[64] = {(char *)self, "up", model_arg, "--port=0", rt, dev};
    int k = 6;
    for (int i = 0; extra[i] && k < 63; i++)
        argv[k++] = extra[i];
    /* --fleet-flags, split at spaces (a copy: the child owns it until exec) */
    char flags[1024] = "";
    snprintf(flags, sizeof flags, "%s", c->fleet_flags ? c->fleet_flags : "");
    for (char *save = NULL, *t = strtok_r(flags, " ", &save); t && k < 63; t = strtok_r(NULL, " ", &save))
        argv[k++] = t;
    argv[k] = NULL;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dup2(pfd[1], 1);
        close(pfd[0]);
        close(pfd[1]);
        FILE *lf = fopen(f->log, "w");
        if (lf)
            dup2(fileno(lf), 2);
        execv(self, argv);
        _exit(127);
    }
    close(pfd[1]);
    f->pid = pid;
    FILE *in = fdopen(pfd[0], "r");
    char line[1024];
    int rc = -1;
    while (in && fgets(line, sizeof line, in)) {
        char *u = strstr(line, " at http://");
        if (!u)
            continue;
        u += strlen(" at http://");
        char *colon = strrchr(u, ':');
        if (!colon)
            break;
        snprintf(f->host, sizeof f->host, "%.*s", (int)(colon - u), u);
        snprintf(f->port, sizeof f->port, "%d", atoi(colon + 1));
        rc = 0;
        break;
    }
    f->out = in; /* the few lines it prints later fit in the pipe */
    return rc;
}

static void fleet_stop(serve_fleet *f)
{
    if (f->pid <= 0)
        goto close_out;
    kill(f->pid, SIGINT);
    for (int i = 0; i < 300; i++) {
        int status;
        if (waitpid(f->pid, &status, WNOHANG) == f->pid) {
            f->pid = 0;
            goto close_out;
        }
        kvf_sleep_ms(50);
    }
    kill(f->pid, SIGKILL);
    waitpid(f->pid, NULL, 0);
    f->pid = 0;
close_out:
    if (f->out)
        fclose(f->out);
    f->out = NULL;
}


/* GET http://host:port/path (HTTP/1.0); the body, malloc'd, or NULL. */
static char *http_get(const char *host, const char *port, const char *path)
{
    int fd = connect_to(host, port);
    if (fd < 0)
        return NULL;
    char req[512];
    int rl = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: %s:%s\r\n\r\n", path, host, port);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!buf || send_all(fd, req, (size_t)rl) != 0) {
        free(buf);
        close(fd);
        return NULL;
    }
    for (;;) {
        if (len + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb)
                break;
            buf = nb;
            cap *= 2;
        }
        ssize_t got = recv(fd, buf + len, cap - 1 - len, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        len += (size_t)got;
    }
    close(fd);
    buf[len] = 0;
    char *b = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.", 7) != 0 || atoi(buf + 9) != 200 || !b) {
        free(buf);
        return NULL;
    }
    memmove(buf, b + 4, len - (size_t)(b + 4 - buf) + 1);
    return buf;
}

/* Sum of every sample of a metric (any labels) in Prometheus text; -1 when absent. */
static double metric_sum(const char *text, const char *name)
{
    double sum = -1;
    size_t nl = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (strncmp(p, name, nl) != 0 || (p[nl] != ' ' && p[nl] != '{'))
            continue;
        const char *v = p + nl;
        if (*v == '{')
            v = strchr(v, '}') ? strchr(v, '}') + 1 : v;
        sum = (sum < 0 ? 0 : sum) + strtod(v, NULL);
    }
    return sum;
}

/* Prefix-hit tokens summed over the decode workers (their admin ports are in the fleet's log)
 * and prompt tokens routed (the router's /metrics). 0 when unknown. */
static void fleet_prefix_hits(const serve_fleet *f, double *hit_out, double *prompt_out)
{
    *hit_out = *prompt_out = 0;
    kvf_sleep_ms(300); /* the workers' gauges follow their loop's passes */
    char *m = http_get(f->host, f->port, "/metrics");
    if (m) {
        double v = metric_sum(m, "kvfleet_router_prompt_tokens_total");
        *prompt_out = v > 0 ? v : 0;
        free(m);
    }
    FILE *lf = fopen(f->log, "r");
    char line[1024];
    while (lf && fgets(line, sizeof line, lf)) {
        const char *d = strstr(line, " I decode: decode-");
        const char *a = d ? strstr(d, "admin HTTP on port ") : NULL;
        if (!a)
            continue;
        char port[16];
        snprintf(port, sizeof port, "%d", atoi(a + strlen("admin HTTP on port ")));
        if ((m = http_get("127.0.0.1", port, "/metrics"))) {
            double v = metric_sum(m, "kvfleet_engine_prefix_hit_tokens_total");
            *hit_out += v > 0 ? v : 0;
            free(m);
        }
    }
    if (lf)
        fclose(lf);
}

/* ---- statistics ------------------------------------------------------------------------------------ */

typedef struct serve_stats {
    int64_t requests, errors;
    double ttft_p50, ttft_p99, itl_p50, itl_p99, tok_s, hit;
} serve_stats;

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double p)
{
    if (!n)
        return NAN;
    size_t i = (size_t)ceil(p * (double)n) - 1;
    return v[i < n ? i : n - 1];
}

/* ---- one configuration ---------------------------------------------------------------------------- */

typedef struct serve_conf {
    const char *name;
    char *const *up_args;
    const char *api_key; /* the fleet's router wants it (--api-key in up_args) */
    bool long_mix, multiturn;
} serve_conf;

/* The prompt lengths of a configuration's first requests: short 32-128, long 512-1024, a
 * conversation's first turn 192-256; where the model has fewer positions, the longest that fit
 * (max_pos - out_max, or half the positions for a conversation's start) and half that. */
static void prompt_range(const serve_conf *cf, int32_t max_pos, int32_t out_max, int32_t *lo, int32_t *hi)
{
    *lo = cf->multiturn ? 192 : cf->long_mix ? 512 : 32;
    *hi = cf->multiturn ? 256 : cf->long_mix ? 1024 : 128;
    int32_t room = cf->multiturn ? max_pos / 2 : max_pos - 1 - out_max;
    if (*hi > room) {
        *hi = room;
        if (*lo > room / 2)
            *lo = room / 2 > 1 ? room / 2 : 1;
    }
}

static int run_conf(const char *self, const serve_cfg *c, const char *model, const char *model_id,
                    const char *log_dir, int32_t vocab, int32_t max_pos, const serve_conf *cf,
                    serve_stats *out)
{
    serve_fleet f = {0};
    if (fleet_start(self, c, model, log_dir, cf->name, cf->up_args, &f) != 0) {
        fprintf(stderr, "kvfleet bench serve: %s: the fleet did not start (see %s)\n", cf->name, f.log);
        fleet_stop(&f);
        return -1;
    }
    serve_ctx sc = {.host = f.host, .port = f.port, .model_id = model_id, .vocab = vocab,
                    .api_key = cf->api_key};
    int64_t n_jobs = c->requests > 0 ? c->requests : (int64_t)ceil(c->rate * c->duration * 1.5) + 1;
    if (n_jobs > SERVE_MAX_REQS)
        n_jobs = SERVE_MAX_REQS;
    int32_t turns = cf->multiturn ? c->turns : 1;
    serve_job *jobs = calloc((size_t)n_jobs, sizeof *jobs);
    serve_result *res = calloc((size_t)(n_jobs * turns), sizeof *res);
    if (!jobs || !res) {
        free(jobs);
        free(res);
        fleet_stop(&f);
        return -1;
    }
    /* arrivals */
    uint64_t arr = mix64((uint64_t)c->seed * 7919 + 1);
    kvf_progress pg;
    kvf_progress_init(&pg, cf->name, c->requests > 0 ? c->requests : (int64_t)(c->duration * 1000));
    double t0 = kvf_now_s(), at = 0;
    int64_t n = 0;
    for (; n < n_jobs; n++) {
        at += -log(rng_unit(&arr)) / c->rate;
        if (c->requests <= 0 && at > c->duration)
            break;
        for (double now; (now = kvf_now_s() - t0) < at;) {
            kvf_progress_update(&pg, c->requests > 0 ? n : (int64_t)(now * 1000));
            kvf_sleep_ms((int64_t)fmin(100, (at - now) * 1000) + 1);
        }
        serve_job *jb = &jobs[n];
        *jb = (serve_job){.sc = &sc, .c = c, .seed = mix64((uint64_t)c->seed * 1000003 + (uint64_t)n),
                          .turns = turns, .max_pos = max_pos, .res = &res[n * turns]};
        prompt_range(cf, max_pos, c->out_max, &jb->p_min, &jb->p_max);
        jb->started = pthread_create(&jb->th, NULL, job_main, jb) == 0;
        if (!jb->started)
            snprintf(jb->res[0].err, sizeof jb->res[0].err, "pthread_create failed");
    }
    for (int64_t i = 0; i < n; i++) {
        if (jobs[i].started)
            pthread_join(jobs[i].th, NULL);
        kvf_progress_update(&pg, c->requests > 0 ? c->requests : (int64_t)(c->duration * 1000));
    }
    double t_end = t0;
    kvf_progress_finish(&pg);
    double hit_tok, routed_tok;
    fleet_prefix_hits(&f, &hit_tok, &routed_tok);
    fleet_stop(&f);

    /* statistics over every request sent (conversation turns never sent do not count) */
    size_t n_res = (size_t)(n * turns), n_ttft = 0, n_itl = 0;
    double *ttft = calloc(n_res + 1, sizeof(double));
    size_t itl_cap = 1;
    for (size_t i = 0; i < n_res; i++)
        itl_cap += res[i].n_out > 0 ? (size_t)res[i].n_out : 0;
    double *itl = calloc(itl_cap, sizeof(double));
    int64_t out_tok = 0, prompt_tok = 0, cached_tok = 0;
    *out = (serve_stats){0};
    const char *first_err = NULL;
    for (size_t i = 0; i < n_res; i++) {
        serve_result *r = &res[i];
        bool sent = r->itl != NULL || r->err[0];
        if (!sent)
            continue;
        out->requests++;
        if (!r->ok) {
            out->errors++;
            if (!first_err)
                first_err = r->err;
        } else {
            ttft[n_ttft++] = r->ttft_s;
            for (int32_t k = 0; k + 1 < r->n_out; k++)
                itl[n_itl++] = r->itl[k];
            prompt_tok += r->prompt_tokens;
            cached_tok += r->cached_tokens;
        }
        out_tok += r->n_out;
        if (r->end_s > t_end)
            t_end = r->end_s;
    }
    qsort(ttft, n_ttft, sizeof(double), cmp_d);
    qsort(itl, n_itl, sizeof(double), cmp_d);
    out->ttft_p50 = pct(ttft, n_ttft, 0.50) * 1e3;
    out->ttft_p99 = pct(ttft, n_ttft, 0.99) * 1e3;
    out->itl_p50 = pct(itl, n_itl, 0.50) * 1e3;
    out->itl_p99 = pct(itl, n_itl, 0.99) * 1e3;
    out->tok_s = t_end > t0 ? (double)out_tok / (t_end - t0) : 0;
    /* the decode workers' own count (local prefills too); the answers' usage only covers
     * remote prefills */
    out->hit = routed_tok > 0 ? hit_tok / routed_tok : prompt_tok ? (double)cached_tok / (double)prompt_tok : 0;
    if (first_err)
        fprintf(stderr, "kvfleet bench serve: %s: %lld errors, the first: %s\n", cf->name,
                (long long)out->errors, first_err);
    for (size_t i = 0; i < n_res; i++) {
        free(res[i].itl);
        free(res[i].out_ids);
    }
    free(ttft);
    free(itl);
    free(res);
    free(jobs);
    return 0;
}

static double ratio(double a, double b) { return b > 0 && !isnan(a) && !isnan(b) ? a / b : NAN; }

static void print_row(const char *name, const serve_stats *s)
{
    printf("  %-22s %8lld %6lld %10.1f %10.1f %9.3f %9.3f %10.1f %8.3f\n", name, (long long)s->requests,
           (long long)s->errors, s->ttft_p50, s->ttft_p99, s->itl_p50, s->itl_p99, s->tok_s, s->hit);
}

static void print_ratio(const char *name, const serve_stats *s, const serve_stats *b)
{
    printf("  %-22s %8s %6s %10.2f %10.2f %9.2f %9.2f %10.2f %8.2f\n", name, "", "",
           ratio(s->ttft_p50, b->ttft_p50), ratio(s->ttft_p99, b->ttft_p99),
           ratio(s->itl_p50, b->itl_p50), ratio(s->itl_p99, b->itl_p99), ratio(s->tok_s, b->tok_s),
           ratio(s->hit, b->hit));
}

static void print_head(const char *title)
{
    printf("\n%s\n  %-22s %8s %6s %10s %10s %9s %9s %10s %8s\n", title, "configuration", "requests",
           "errors", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "out_tok/s", "hit");
}

/* Runs baseline a and then b, prints their table under title with the ratio row, and sets
 * *rc to 3 when either had errors. -1 when a fleet did not start. */
static int run_pair(const char *self, const serve_cfg *c, const char *model, const char *model_id,
                    const char *log_dir, int32_t vocab, int32_t max_pos, const serve_conf *a,
                    const serve_conf *b, const char *title, const char *ratio_name,
                    serve_stats *sa, serve_stats *sb, int *rc)
{
    if (run_conf(self, c, model, model_id, log_dir, vocab, max_pos, a, sa) != 0 ||
        run_conf(self, c, model, model_id, log_dir, vocab, max_pos, b, sb) != 0)
        return -1;
    print_head(title);
    print_row(a->name, sa);
    print_row(b->name, sb);
    print_ratio(ratio_name, sb, sa);
    if (sa->errors || sb->errors)
        *rc = 3;
    fflush(stdout);
    return 0;
}

int kvf_bench_serve_main(int argc, char **argv)
{
    serve_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&serve_spec, &c, argc, argv, NULL, &err);
    if (st == KVF_HELP)
        return 0;
    if (st != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    bool multiturn = strcmp(c.workload, "multiturn") == 0;
    bool secured = strcmp(c.workload, "secure") == 0;
    if (!multiturn && !secured && strcmp(c.workload, "mixes") != 0) {
        fprintf(stderr, "kvfleet: bench serve: --workload=%s is not known (use mixes, multiturn or secure)\n", c.workload);
        return 2;
    }
    if (!(c.rate > 0) || (c.requests <= 0 && !(c.duration > 0)) || c.requests > SERVE_MAX_REQS ||
        c.out_min < 1 || c.out_max < c.out_min || c.turns < 1 || c.turns > 64) {
        fprintf(stderr, "kvfleet: bench serve: need --rate (%g) > 0, --duration (%g) > 0 or --requests (%lld) in "
                "1..%d, 1 <= --out-min (%d) <= --out-max (%d), --turns (%d) in 1..64\n", c.rate, c.duration,
                (long long)c.requests, SERVE_MAX_REQS, c.out_min, c.out_max, c.turns);
        return 2;
    }
    if (strcmp(c.device, "cpu") != 0 && strcmp(c.device, "cuda") != 0) {
        fprintf(stderr, "kvfleet: bench serve: --device=%s is not known (use cpu or cuda)\n", c.device);
        return 2;
    }
    if (c.fleet_flags && strlen(c.fleet_flags) >= 1024) {
        fprintf(stderr, "kvfleet: bench serve: --fleet-flags is %zu bytes (at most 1023)\n", strlen(c.fleet_flags));
        return 2;
    }
    char self[PATH_MAX];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0) {
        fprintf(stderr, "kvfleet: bench serve: cannot find this program (/proc/self/exe)\n");
        return 1;
    }
    self[sl] = 0;
    signal(SIGPIPE, SIG_IGN);

    /* the model: given, or a tiny one written now */
    char tmpdir[] = "/tmp/kvf-serve-XXXXXX", model[PATH_MAX];
    bool own_model = !c.model;
    if (!mkdtemp(tmpdir)) {
        fprintf(stderr, "kvfleet: bench serve: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    const char *log_dir = c.fleet_log ? c.fleet_log : tmpdir;
    int rc = 1;
    if (c.fleet_log && mkdir(c.fleet_log, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "kvfleet: bench serve: --log-dir=%s: %s\n", c.fleet_log, strerror(errno));
        goto out;
    }
    if (own_model) {
        snprintf(model, sizeof model, "%s/tiny", tmpdir);
        char cmd[PATH_MAX * 3];
        snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny --out '%s' >/dev/null", self, model);
        if (system(cmd) != 0) {
            fprintf(stderr, "kvfleet: bench serve: gen-model failed\n");
            goto out;
        }
    } else {
        snprintf(model, sizeof model, "%s", c.model);
    }
    char cfg_path[PATH_MAX + 16];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", model);
    json_error_t je;
    json_t *mj = json_load_file(cfg_path, 0, &je);
    int32_t vocab = (int32_t)json_integer_value(json_object_get(mj, "vocab_size"));
    int32_t max_pos = (int32_t)json_integer_value(json_object_get(mj, "max_position_embeddings"));
    json_decref(mj);
    if (vocab < 16 || max_pos < c.out_max + 64) {
        fprintf(stderr, "kvfleet: bench serve: %s: vocab_size (%d) must be >= 16 and max_position_embeddings "
                "(%d) >= --out-max + 64\n", cfg_path, vocab, max_pos);
        goto out;
    }
    char mtmp[PATH_MAX];
    snprintf(mtmp, sizeof mtmp, "%s", model);
    for (size_t l = strlen(mtmp); l > 1 && mtmp[l - 1] == '/'; l--)
        mtmp[l - 1] = 0;
    const char *model_id = strrchr(mtmp, '/') ? strrchr(mtmp, '/') + 1 : mtmp;

    static char *const coloc[] = {"--prefill=0", "--decode=2", NULL};
    static char *const disagg[] = {"--prefill=1", "--decode=1", "--local-prefill-max-tokens=0", NULL};
    static char *const rr[] = {"--prefill=0", "--decode=3", "--policy=round-robin", NULL};
    static char *const kv[] = {"--prefill=0", "--decode=3", "--policy=kv", NULL};
    static char *const secure[] = {"--prefill=1", "--decode=1", "--local-prefill-max-tokens=0",
                                   "--tls", "--api-key=kvf-bench-key", NULL};
    printf("kvfleet bench serve: model %s (vocab %d, %d positions), device %s%s%s, rate %g/s, %s, seed %lld, output %d-%d tokens\n",
           model, vocab, max_pos, c.device, c.fleet_flags ? ", fleet flags " : "", c.fleet_flags ? c.fleet_flags : "", c.rate, c.requests > 0 ? "fixed count" : "fixed duration", (long long)c.seed,
           c.out_min, c.out_max);
    if (c.requests > 0)
        printf("  %lld %s per configuration\n", (long long)c.requests, multiturn ? "conversations" : "requests");
    else
        printf("  %g s of arrivals per configuration\n", c.duration);
    printf("  times in ms; hit = cached prompt tokens / prompt tokens; ratio rows: / the baseline above\n");
    fflush(stdout);
    double disagg_ttft = NAN, kv_hit = NAN;
    serve_stats sa, sb;
    if (secured) {
        /* the same disaggregated fleet and workload (the short mix), plain and secured */
        serve_conf a = {.name = "plain", .up_args = disagg};
        serve_conf b = {.name = "tls + api key", .up_args = secure, .api_key = "kvf-bench-key"};
        int32_t lo, hi;
        char title[128];
        prompt_range(&a, max_pos, c.out_max, &lo, &hi);
        snprintf(title, sizeof title, "disaggregated (1 prefill + 1 decode), short prompts (%d-%d "
                 "tokens)", lo, hi);
        if (run_pair(self, &c, model, model_id, log_dir, vocab, max_pos, &a, &b, title,
                     "secure / plain", &sa, &sb, &rc) != 0)
            goto out;
        printf("\nserve: secure_vs_plain_ttft_p50=%.2f secure_vs_plain_tok_s=%.2f\n",
               ratio(sb.ttft_p50, sa.ttft_p50), ratio(sb.tok_s, sa.tok_s));
    } else if (!multiturn) {
        for (int mix = 0; mix < 2; mix++) {
            serve_conf a = {.name = mix ? "colocated long" : "colocated short", .up_args = coloc, .long_mix = mix};
            serve_conf b = {.name = mix ? "disagg long" : "disagg short", .up_args = disagg, .long_mix = mix};
            int32_t lo, hi;
            char title[96];
            prompt_range(&a, max_pos, c.out_max, &lo, &hi);
            snprintf(title, sizeof title, "%s prompts (%d-%d tokens)", mix ? "long" : "short", lo, hi);
            if (run_pair(self, &c, model, model_id, log_dir, vocab, max_pos, &a, &b, title,
                         "disagg / colocated", &sa, &sb, &rc) != 0)
                goto out;
            if (mix == 0 || isnan(disagg_ttft))
                disagg_ttft = ratio(sb.ttft_p50, sa.ttft_p50);
        }
        printf("\nserve: disagg_vs_coloc_ttft_p50=%.2f (short mix)\n", disagg_ttft);
    } else {
        serve_conf a = {.name = "round-robin", .up_args = rr, .multiturn = true};
        serve_conf b = {.name = "kv", .up_args = kv, .multiturn = true};
        int32_t lo, hi;
        char title[160];
        prompt_range(&a, max_pos, c.out_max, &lo, &hi);
        snprintf(title, sizeof title, "multi-turn chat, 3 decode workers: %d turns, the first %d-%d tokens, each "
                 "next one + the answer + 32-64 user tokens", c.turns, lo, hi);
        if (run_pair(self, &c, model, model_id, log_dir, vocab, max_pos, &a, &b, title,
                     "kv / round-robin", &sa, &sb, &rc) != 0)
            goto out;
        kv_hit = ratio(sb.hit, sa.hit);
        printf("\nserve: kv_vs_rr_hit=%.2f kv_vs_rr_ttft_p50=%.2f (hit %.3f vs %.3f)\n", kv_hit,
               ratio(sb.ttft_p50, sa.ttft_p50), sb.hit, sa.hit);
    }
    if (rc == 1)
        rc = 0;
out:
    {
        char cmd[PATH_MAX + 32];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0)
            fprintf(stderr, "kvfleet: bench serve: could not remove %s\n", tmpdir);
    }
    return rc;
}
