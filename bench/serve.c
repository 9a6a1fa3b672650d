/* serve.c: `kvfleet bench serve`: an open-loop load generator (Poisson arrivals, seeded) that starts
 * each fleet itself with `kvfleet up`, streams token-id prompts through the router's OpenAI SSE
 * API and reports TTFT / ITL percentiles, output tokens/s, errors and prefix-cache hit rate per
 * configuration, with each one's ratio to its baseline (colocated, round-robin, pool only). */
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
    double rate, duration, think_s;
    int64_t requests, seed, host_tier_bytes;
    int32_t out_min, out_max, turns, tenants, ready_timeout_s;
} serve_cfg;

#define SERVE_MAX_TENANTS 64

static const kvf_cfg_opt serve_opts[] = {
    {"model", NULL, "model directory (default: gen-model --preset tiny into a temporary directory)", offsetof(serve_cfg, model), KVF_CFG_STR},
    {"workload", "mixes", "mixes (colocated vs disaggregated, short and long prompts), multiturn (round-robin vs kv, 3 decode workers), multiturn-tier (conversations on 2 kv-routed decode workers with a small KV pool, pool only vs pool + host tier), tenants (--tenants system prefixes + short questions on 4 decode workers: kv vs kv --approx vs round-robin) or secure (a disaggregated fleet plain vs with --tls and an API key)", offsetof(serve_cfg, workload), KVF_CFG_STR},
    {"rate", "2", "mean arrivals per second (requests; conversations for multiturn and multiturn-tier)", offsetof(serve_cfg, rate), KVF_CFG_DOUBLE},
    {"duration", "20", "seconds of arrivals per configuration (when --requests is 0)", offsetof(serve_cfg, duration), KVF_CFG_DOUBLE},
    {"requests", "0", "arrivals per configuration (0: as many as --duration allows)", offsetof(serve_cfg, requests), KVF_CFG_INT64},
    {"seed", "1", "seed of arrivals and prompts (every configuration gets the same workload)", offsetof(serve_cfg, seed), KVF_CFG_INT64},
    {"out-min", "16", "fewest output tokens per request", offsetof(serve_cfg, out_min), KVF_CFG_INT},
    {"out-max", "64", "most output tokens per request", offsetof(serve_cfg, out_max), KVF_CFG_INT},
    {"turns", "4", "turns per conversation (multiturn, multiturn-tier)", offsetof(serve_cfg, turns), KVF_CFG_INT},
    {"think-s", "3", "mean seconds between an answer and the conversation's next turn (exponential; multiturn-tier, whose pool is sized from it; 0 to 600)", offsetof(serve_cfg, think_s), KVF_CFG_DOUBLE},
    {"host-tier-bytes", "0", "each worker's host KV tier (--kv-host-memory) in multiturn-tier's tier configuration (K/M/G suffixes; 0: 4x the pool's bytes)", offsetof(serve_cfg, host_tier_bytes), KVF_CFG_SIZE},
    {"tenants", "8", "tenants, each with its own system prefix, chosen uniformly per request (tenants; 1 to 64)", offsetof(serve_cfg, tenants), KVF_CFG_INT},
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
               "(baseline) vs kv over 3 decode workers. multiturn-tier: the same conversations, users\n"
               "thinking --think-s between turns, on 2 kv-routed decode workers whose --kv-blocks is\n"
               "sized from the workload to keep about a quarter of the histories waiting between turns,\n"
               "pool only (baseline) vs pool + a host tier (--kv-host-memory, 4x the pool's bytes).\n"
               "tenants: --tenants system prefixes (up to 768 tokens, within the model's positions), each\n"
               "request one tenant's prefix (uniformly chosen) + a 16-48 token question, outputs of at\n"
               "most 32 tokens, on 4 decode workers whose pools hold half of all the prefixes: --policy\n"
               "round-robin (baseline) vs kv vs kv --approx. A configuration needing a flag this build's\n"
               "workers or router lack is reported as not run. Prints a table per set of configurations\n"
               "(requests, errors, TTFT p50/p90/p99 and ITL p50/p99 ms, output tok/s, prefix hit rate)\n"
               "with ratio rows against the baseline, and ends with one line, e.g.\n"
               "serve: kv_vs_rr_hit=<x> kv_vs_rr_ttft_p50=<y>.\n",
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
    uint64_t seed;
    int32_t p_min, p_max, turns, max_pos; /* first prompt's length range; turns 1: one request */
    int32_t out_min, out_max;
    double think_s;         /* mean pause before each next turn (exponential); 0: none */
    int32_t tenants, prefix_len; /* > 0: the prompt is a tenant's prefix + p_min..p_max tokens */
    uint64_t tenant_seed;   /* the tenants' prefixes, the same in every configuration */
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
 * and 32-64 new user tokens, sent think_s (mean) after that answer. With tenants, the request's
 * prompt is a uniformly chosen tenant's prefix and then its own p_min..p_max tokens. */
static void *job_main(void *arg)
{
    serve_job *jb = arg;
    uint64_t s = jb->seed;
    int32_t cap = jb->max_pos - 1; /* a sequence may not fill the last position */
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)cap);
    if (!prompt)
        return NULL;
    int32_t n = 0;
    if (jb->tenants > 0) {
        uint64_t ts = mix64(jb->tenant_seed + (uint64_t)rng_range(&s, 0, jb->tenants - 1));
        random_ids(&ts, jb->sc->vocab, prompt, jb->prefix_len);
        n = jb->prefix_len;
    }
    int32_t own = rng_range(&s, jb->p_min, jb->p_max);
    random_ids(&s, jb->sc->vocab, prompt + n, own);
    n += own;
    for (int32_t t = 0; t < jb->turns; t++) {
        serve_result *r = &jb->res[t];
        int32_t out = rng_range(&s, jb->out_min, jb->out_max);
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
        if (n + r->n_out + user + jb->out_max > cap)
            break;
        memcpy(prompt + n, r->out_ids, sizeof(int32_t) * (size_t)r->n_out);
        n += r->n_out;
        random_ids(&s, jb->sc->vocab, prompt + n, user);
        n += user;
        if (jb->think_s > 0)
            kvf_sleep_ms((int64_t)(-log(rng_unit(&s)) * jb->think_s * 1000));
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

/* Whether `self role --help` lists --flag (what `kvfleet up` checks before forwarding a flag to
 * a role: a flag no role lists is dropped there, so a configuration that needs one is not run). */
static bool role_has_flag(const char *self, const char *role, const char *flag)
{
    char cmd[PATH_MAX + 128], line[1024], want[128];
    snprintf(cmd, sizeof cmd, "'%s' %s --help 2>/dev/null", self, role);
    snprintf(want, sizeof want, "--%s", flag);
    size_t wl = strlen(want);
    FILE *p = popen(cmd, "r");
    bool found = false;
    while (p && fgets(line, sizeof line, p))
        for (char *s = strstr(line, want); s && !found; s = strstr(s + 1, want))
            found = s[wl] == ' ' || s[wl] == '=' || s[wl] == '\t' || s[wl] == '\n' || s[wl] == ',';
    if (p)
        pclose(p);
    return found;
}

/* The value of --name in --fleet-flags ("--name=V" or "--name V") into out; false when absent. */
static bool fleet_flag(const serve_cfg *c, const char *name, char *out, size_t cap)
{
    char flags[1024], want[64];
    snprintf(flags, sizeof flags, "%s", c->fleet_flags ? c->fleet_flags : "");
    snprintf(want, sizeof want, "--%s", name);
    bool found = false;
    for (char *save = NULL, *t = strtok_r(flags, " ", &save); t; t = strtok_r(NULL, " ", &save)) {
        size_t wl = strlen(want);
        if (strncmp(t, want, wl) != 0 || (t[wl] != 0 && t[wl] != '='))
            continue;
        const char *v = t[wl] == '=' ? t + wl + 1 : strtok_r(NULL, " ", &save);
        snprintf(out, cap, "%s", v ? v : "");
        found = true; /* the last one wins, as in the workers' own parsing */
    }
    return found;
}

/* ---- statistics ------------------------------------------------------------------------------------ */

typedef struct serve_stats {
    bool ran;
    int64_t requests, errors;
    double ttft_p50, ttft_p90, ttft_p99, itl_p50, itl_p99, tok_s, hit;
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

/* What every configuration of a run shares: this program, the flags, the model and its KV block. */
typedef struct serve_env {
    const char *self, *model, *model_id, *log_dir;
    const serve_cfg *c;
    int32_t vocab, max_pos;
    int32_t block_size;  /* tokens per KV block: 16, or --block-size in --fleet-flags */
    int64_t block_bytes; /* one block, every layer's K and V, at the fleet's --kv-dtype */
} serve_env;

typedef enum serve_kind { SERVE_SHORT, SERVE_LONG, SERVE_CHAT, SERVE_TENANTS } serve_kind;

typedef struct serve_conf {
    const char *name;
    char *const *up_args;
    const char *api_key;    /* the fleet's router wants it (--api-key in up_args) */
    serve_kind kind;
    const char *ratio_name; /* its ratio row; NULL: "<name> / <the baseline's name>" */
    const char *need_role, *need_flag; /* up_args gives that role this flag: not run without it */
    double think_s;         /* SERVE_CHAT: mean pause between turns */
    int32_t prefix_len;     /* SERVE_TENANTS: tokens of each tenant's prefix */
} serve_conf;

/* The prompt lengths of a configuration's first requests: short 32-128, long 512-1024, a
 * conversation's first turn 192-256, a tenant's question (after its prefix) 16-48; where the
 * model has fewer positions, the longest that fit (max_pos - out_max, or half the positions for
 * a conversation's start) and half that. */
static void prompt_range(const serve_conf *cf, int32_t max_pos, int32_t out_max, int32_t *lo, int32_t *hi)
{
    static const int32_t range[][2] = {
        [SERVE_SHORT] = {32, 128}, [SERVE_LONG] = {512, 1024}, [SERVE_CHAT] = {192, 256}, [SERVE_TENANTS] = {16, 48},
    };
    *lo = range[cf->kind][0];
    *hi = range[cf->kind][1];
    if (cf->kind == SERVE_TENANTS)
        return; /* the prefix is sized to leave room for these (tenants_prefix_len) */
    int32_t room = cf->kind == SERVE_CHAT ? max_pos / 2 : max_pos - 1 - out_max;
    if (*hi > room) {
        *hi = room;
        if (*lo > room / 2)
            *lo = room / 2 > 1 ? room / 2 : 1;
    }
}

/* Output tokens per request: --out-min..--out-max; tenants' short answers at most 32 of them. */
static void out_range(const serve_conf *cf, const serve_cfg *c, int32_t *lo, int32_t *hi)
{
    *hi = cf->kind == SERVE_TENANTS && c->out_max > 32 ? 32 : c->out_max;
    *lo = c->out_min < *hi ? c->out_min : *hi;
}

/* Before the measured arrivals: one short request (16 tokens, 2 out) per decode worker, one
 * after the other, so that a worker's or the router's first request (a round-robin router was
 * seen holding its first requests for about a second after it was ready) is not measured;
 * *hit_out / *routed_out the prefix counters after them, to subtract. */
static void fleet_warm_up(const serve_ctx *sc, const serve_conf *cf, const serve_fleet *f,
                          double *hit_out, double *routed_out)
{
    int n = 1;
    for (int i = 0; cf->up_args[i]; i++)
        if (strncmp(cf->up_args[i], "--decode=", 9) == 0)
            n = atoi(cf->up_args[i] + 9);
    uint64_t s = mix64(0x5eed);
    for (int i = 0; i < n; i++) {
        int32_t prompt[16], out_ids[2];
        double itl[2];
        random_ids(&s, sc->vocab, prompt, 16);
        serve_result r = {.cap = 2, .itl = itl, .out_ids = out_ids};
        run_request(sc, prompt, 16, 2, &r);
        if (!r.ok)
            fprintf(stderr, "kvfleet bench serve: %s: warm-up request %d: %s\n", cf->name, i + 1, r.err);
    }
    fleet_prefix_hits(f, hit_out, routed_out);
}

/* Starts cf's fleet, sends it the workload (progress under label) and stops it; *out the
 * statistics. -1 when the fleet did not start. */
static int run_conf(const serve_env *e, const serve_conf *cf, const char *label, serve_stats *out)
{
    const serve_cfg *c = e->c;
    serve_fleet f = {0};
    if (fleet_start(e->self, c, e->model, e->log_dir, cf->name, cf->up_args, &f) != 0) {
        fprintf(stderr, "kvfleet bench serve: %s: the fleet did not start (see %s)\n", cf->name, f.log);
        fleet_stop(&f);
        return -1;
    }
    serve_ctx sc = {.host = f.host, .port = f.port, .model_id = e->model_id, .vocab = e->vocab,
                    .api_key = cf->api_key};
    double warm_hit, warm_routed;
    fleet_warm_up(&sc, cf, &f, &warm_hit, &warm_routed);
    int64_t n_jobs = c->requests > 0 ? c->requests : (int64_t)ceil(c->rate * c->duration * 1.5) + 1;
    if (n_jobs > SERVE_MAX_REQS)
        n_jobs = SERVE_MAX_REQS;
    int32_t turns = cf->kind == SERVE_CHAT ? c->turns : 1;
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
    kvf_progress_init(&pg, label, c->requests > 0 ? c->requests : (int64_t)(c->duration * 1000));
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
        *jb = (serve_job){.sc = &sc, .seed = mix64((uint64_t)c->seed * 1000003 + (uint64_t)n),
                          .turns = turns, .max_pos = e->max_pos, .think_s = cf->think_s,
                          .res = &res[n * turns]};
        prompt_range(cf, e->max_pos, c->out_max, &jb->p_min, &jb->p_max);
        out_range(cf, c, &jb->out_min, &jb->out_max);
        if (cf->kind == SERVE_TENANTS) {
            jb->tenants = c->tenants;
            jb->prefix_len = cf->prefix_len;
            jb->tenant_seed = mix64((uint64_t)c->seed * 15485863 + 7);
        }
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
    hit_tok -= warm_hit;
    routed_tok -= warm_routed;
    fleet_stop(&f);

    /* statistics over every request sent (conversation turns never sent do not count) */
    size_t n_res = (size_t)(n * turns), n_ttft = 0, n_itl = 0;
    double *ttft = calloc(n_res + 1, sizeof(double));
    size_t itl_cap = 1;
    for (size_t i = 0; i < n_res; i++)
        itl_cap += res[i].n_out > 0 ? (size_t)res[i].n_out : 0;
    double *itl = calloc(itl_cap, sizeof(double));
    int64_t out_tok = 0, prompt_tok = 0, cached_tok = 0;
    *out = (serve_stats){.ran = true};
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
    out->ttft_p90 = pct(ttft, n_ttft, 0.90) * 1e3;
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

/* ---- a set of configurations and its table ------------------------------------------------------------ */

#define SERVE_MAX_CONFS 4

static double ratio(double a, double b) { return b > 0 && !isnan(a) && !isnan(b) ? a / b : NAN; }

static void print_row(const char *name, const serve_stats *s)
{
    printf("  %-22s %8lld %6lld %10.1f %10.1f %10.1f %9.3f %9.3f %10.1f %8.3f\n", name, (long long)s->requests,
           (long long)s->errors, s->ttft_p50, s->ttft_p90, s->ttft_p99, s->itl_p50, s->itl_p99, s->tok_s, s->hit);
}

static void print_ratio(const char *name, const serve_stats *s, const serve_stats *b)
{
    printf("  %-22s %8s %6s %10.2f %10.2f %10.2f %9.2f %9.2f %10.2f %8.2f\n", name, "", "",
           ratio(s->ttft_p50, b->ttft_p50), ratio(s->ttft_p90, b->ttft_p90), ratio(s->ttft_p99, b->ttft_p99),
           ratio(s->itl_p50, b->itl_p50), ratio(s->itl_p99, b->itl_p99), ratio(s->tok_s, b->tok_s),
           ratio(s->hit, b->hit));
}

static void print_head(const char *title)
{
    printf("\n%s\n  %-22s %8s %6s %10s %10s %10s %9s %9s %10s %8s\n", title, "configuration", "requests",
           "errors", "ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p99", "out_tok/s", "hit");
}

/* Runs confs[0..n) in order, each on its own fleet (one whose need_role lacks its need_flag in
 * this build is reported as not run, with NaN statistics), prints their table under title with
 * a ratio row for each against confs[base], and sets *rc to 3 when any had errors. -1 when a
 * fleet did not start. */
static int run_set(const serve_env *e, const serve_conf *confs, int n, int base, const char *title,
                   serve_stats *st, int *rc)
{
    char skip[SERVE_MAX_CONFS][160] = {{0}};
    for (int i = 0; i < n && i < SERVE_MAX_CONFS; i++) {
        const serve_conf *cf = &confs[i];
        st[i] = (serve_stats){.ran = false, .ttft_p50 = NAN, .ttft_p90 = NAN, .ttft_p99 = NAN,
                              .itl_p50 = NAN, .itl_p99 = NAN, .tok_s = NAN, .hit = NAN};
        if (cf->need_flag && !role_has_flag(e->self, cf->need_role, cf->need_flag)) {
            snprintf(skip[i], sizeof skip[i], "not run: `kvfleet %s` has no --%s in this build",
                     cf->need_role, cf->need_flag);
            fprintf(stderr, "kvfleet bench serve: %s: %s\n", cf->name, skip[i]);
            continue;
        }
        char label[96];
        snprintf(label, sizeof label, "%s (%d/%d)", cf->name, i + 1, n);
        if (run_conf(e, cf, label, &st[i]) != 0)
            return -1;
        fprintf(stderr, "kvfleet bench serve: %s: %lld requests, %lld errors, TTFT p50 %.1f ms\n",
                label, (long long)st[i].requests, (long long)st[i].errors, st[i].ttft_p50);
    }
    print_head(title);
    for (int i = 0; i < n && i < SERVE_MAX_CONFS; i++) {
        if (st[i].ran)
            print_row(confs[i].name, &st[i]);
        else
            printf("  %-22s %s\n", confs[i].name, skip[i]);
        if (st[i].errors)
            *rc = 3;
    }
    for (int i = 0; i < n && i < SERVE_MAX_CONFS; i++) {
        if (i == base || !st[i].ran)
            continue;
        char name[64];
        snprintf(name, sizeof name, "%s / %s", confs[i].name, confs[base].name);
        print_ratio(confs[i].ratio_name ? confs[i].ratio_name : name, &st[i], &st[base]);
    }
    fflush(stdout);
    return 0;
}

/* ---- the workloads ------------------------------------------------------------------------------------ */

/* mixes: colocated (2 decode workers) vs disaggregated (1 + 1), short and then long prompts. */
static int wl_mixes(const serve_env *e, int *rc)
{
    static char *const coloc[] = {"--prefill=0", "--decode=2", NULL};
    static char *const disagg[] = {"--prefill=1", "--decode=1", "--local-prefill-max-tokens=0", NULL};
    double disagg_ttft = NAN;
    for (int mix = 0; mix < 2; mix++) {
        serve_kind k = mix ? SERVE_LONG : SERVE_SHORT;
        serve_conf cs[2] = {
            {.name = mix ? "colocated long" : "colocated short", .up_args = coloc, .kind = k},
            {.name = mix ? "disagg long" : "disagg short", .up_args = disagg, .kind = k,
             .ratio_name = "disagg / colocated"},
        };
        serve_stats st[2];
        int32_t lo, hi;
        char title[96];
        prompt_range(&cs[0], e->max_pos, e->c->out_max, &lo, &hi);
        snprintf(title, sizeof title, "%s prompts (%d-%d tokens)", mix ? "long" : "short", lo, hi);
        if (run_set(e, cs, 2, 0, title, st, rc) != 0)
            return -1;
        if (mix == 0 || isnan(disagg_ttft))
            disagg_ttft = ratio(st[1].ttft_p50, st[0].ttft_p50);
    }
    printf("\nserve: disagg_vs_coloc_ttft_p50=%.2f (short mix)\n", disagg_ttft);
    return 0;
}

/* multiturn: conversations over 3 decode workers, round-robin vs kv. */
static int wl_multiturn(const serve_env *e, int *rc)
{
    static char *const rr[] = {"--prefill=0", "--decode=3", "--policy=round-robin", NULL};
    static char *const kv[] = {"--prefill=0", "--decode=3", "--policy=kv", NULL};
    serve_conf cs[2] = {
        {.name = "round-robin", .up_args = rr, .kind = SERVE_CHAT},
        {.name = "kv", .up_args = kv, .kind = SERVE_CHAT, .ratio_name = "kv / round-robin"},
    };
    serve_stats st[2];
    int32_t lo, hi;
    char title[160];
    prompt_range(&cs[0], e->max_pos, e->c->out_max, &lo, &hi);
    snprintf(title, sizeof title, "multi-turn chat, 3 decode workers: %d turns, the first %d-%d tokens, each "
             "next one + the answer + 32-64 user tokens", e->c->turns, lo, hi);
    if (run_set(e, cs, 2, 0, title, st, rc) != 0)
        return -1;
    printf("\nserve: kv_vs_rr_hit=%.2f kv_vs_rr_ttft_p50=%.2f (hit %.3f vs %.3f)\n",
           ratio(st[1].hit, st[0].hit), ratio(st[1].ttft_p50, st[0].ttft_p50), st[1].hit, st[0].hit);
    return 0;
}

static int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* multiturn-tier: the multiturn conversations, users thinking between turns, on 2 kv-routed
 * decode workers whose pools keep about a quarter of the histories waiting between turns: pool
 * only vs the same pool + a host tier able to hold them all (4x the pool). Sizing, per worker:
 * by Little's law rate * (turns - 1) * think_s / 2 conversations wait between turns, each
 * holding its history (the first prompt + about turns/2 answers and user turns); the pool is a
 * quarter of that, but never less than 1.25x the longest sequence the workload makes (so every
 * request fits, with room for another to run) nor than one sequence of the model's full context
 * (the workers' own minimum). */
static int wl_multiturn_tier(const serve_env *e, int *rc)
{
    const serve_cfg *c = e->c;
    const int32_t workers = 2, bs = e->block_size;
    serve_conf probe = {.kind = SERVE_CHAT};
    int32_t lo, hi;
    prompt_range(&probe, e->max_pos, c->out_max, &lo, &hi);
    double mean_out = (c->out_min + c->out_max) / 2.0, per_turn = mean_out + 48; /* answer + 32-64 */
    double hist = fmin((lo + hi) / 2.0 + c->turns / 2.0 * per_turn, e->max_pos - 1);
    double waiting = c->rate * (c->turns - 1) * c->think_s / workers;
    int64_t hist_blocks = div_up((int64_t)ceil(hist), bs);
    int64_t ws = (int64_t)ceil(waiting * (double)hist_blocks);
    int64_t longest = hi + (int64_t)(c->turns - 1) * (c->out_max + 64) + c->out_max;
    if (longest > e->max_pos - 1)
        longest = e->max_pos - 1;
    int64_t floor_blocks = div_up(div_up(longest + 1, bs) * 5, 4);
    if (floor_blocks < div_up(e->max_pos, bs))
        floor_blocks = div_up(e->max_pos, bs); /* a worker refuses a pool without room for one full context */
    int64_t pool = div_up(ws, 4) > floor_blocks ? div_up(ws, 4) : floor_blocks;
    int64_t tier = c->host_tier_bytes > 0 ? c->host_tier_bytes : 4 * pool * e->block_bytes;
    if (pool > INT32_MAX / 2) {
        fprintf(stderr, "kvfleet bench serve: multiturn-tier: a pool of %lld blocks is too large: lower --rate, "
                "--turns or --think-s\n", (long long)pool);
        return -1;
    }
    printf("  pool: --kv-blocks=%lld per worker (%lld tokens, %.1f MiB): about %.1f conversations wait "
           "between turns per worker (rate %g * %d turns after the first * think %g s / %d workers), "
           "holding about %lld blocks of history each, %lld in all; the pool keeps %.0f%% of them "
           "(at least %lld blocks: the longest sequence needs %lld, the model's full context %lld)\n",
           (long long)pool, (long long)pool * bs, (double)(pool * e->block_bytes) / 1048576.0, waiting,
           c->rate, c->turns - 1, c->think_s, workers, (long long)hist_blocks, (long long)ws,
           ws > 0 ? fmin(100, 100.0 * (double)pool / (double)ws) : 100.0, (long long)floor_blocks,
           (long long)div_up(longest + 1, bs), (long long)div_up(e->max_pos, bs));
    printf("  tier: --kv-host-memory=%lld per worker (%.1f MiB, %.1fx the pool)\n", (long long)tier,
           (double)tier / 1048576.0, (double)tier / (double)(pool * e->block_bytes));
    if (2 * pool >= ws)
        printf("  note: the pool holds half the histories or more, so few are evicted between turns; "
               "raise --rate, --turns or --think-s\n");
    fflush(stdout);
    char blocks[48], host[48];
    snprintf(blocks, sizeof blocks, "--kv-blocks=%lld", (long long)pool);
    snprintf(host, sizeof host, "--kv-host-memory=%lld", (long long)tier);
    char *const pool_only[] = {"--prefill=0", "--decode=2", "--policy=kv", blocks, NULL};
    char *const tiered[] = {"--prefill=0", "--decode=2", "--policy=kv", blocks, host, NULL};
    serve_conf cs[2] = {
        {.name = "pool only", .up_args = pool_only, .kind = SERVE_CHAT, .think_s = c->think_s},
        {.name = "pool + host tier", .up_args = tiered, .kind = SERVE_CHAT, .think_s = c->think_s,
         .ratio_name = "tier / pool only", .need_role = "decode", .need_flag = "kv-host-memory"},
    };
    serve_stats st[2];
    char title[200];
    snprintf(title, sizeof title, "multi-turn chat on a small KV pool, 2 decode workers, kv policy: %d turns, "
             "the first %d-%d tokens, think %g s between turns", c->turns, lo, hi, c->think_s);
    if (run_set(e, cs, 2, 0, title, st, rc) != 0)
        return -1;
    printf("\nserve: tier_vs_pool_hit=%.2f tier_vs_pool_ttft_p50=%.2f (hit %.3f vs %.3f)%s\n",
           ratio(st[1].hit, st[0].hit), ratio(st[1].ttft_p50, st[0].ttft_p50), st[1].hit, st[0].hit,
           st[1].ran ? "" : " (the tier configuration was not run)");
    return 0;
}

/* tenants: --tenants system prefixes, each request one (uniformly chosen) tenant's prefix and a
 * short question, on 4 decode workers whose pools hold about half of all the prefixes (and
 * room for a few requests' own tokens, and at least one full context): round-robin vs kv vs kv
 * with --approx routing. The
 * prefix is the longest of 768 tokens, 3/4 of the positions and what leaves room for the
 * longest question and answer, in whole blocks. */
static int wl_tenants(const serve_env *e, int *rc)
{
    const serve_cfg *c = e->c;
    const int32_t workers = 4, bs = e->block_size;
    serve_conf probe = {.kind = SERVE_TENANTS};
    int32_t q_lo, q_hi, o_lo, o_hi;
    prompt_range(&probe, e->max_pos, c->out_max, &q_lo, &q_hi);
    out_range(&probe, c, &o_lo, &o_hi);
    int32_t prefix = 768;
    if (prefix > e->max_pos / 4 * 3)
        prefix = e->max_pos / 4 * 3;
    if (prefix > e->max_pos - 1 - q_hi - o_hi)
        prefix = e->max_pos - 1 - q_hi - o_hi;
    prefix = prefix / bs * bs;
    if (prefix < bs) {
        fprintf(stderr, "kvfleet bench serve: tenants: the model's %d positions leave no room for a prefix of "
                "one block (%d tokens) before a %d-token question and a %d-token answer\n", e->max_pos, bs,
                q_hi, o_hi);
        return -1;
    }
    int64_t prefix_blocks = prefix / bs, own_blocks = div_up(q_hi + o_hi + 1, bs) + 1;
    int64_t pool = div_up((int64_t)c->tenants * prefix_blocks, 2) + 4 * own_blocks;
    int64_t full_ctx = div_up(e->max_pos, bs); /* a worker refuses a pool without room for one */
    printf("  %d tenants, each a %d-token prefix (%lld blocks), chosen uniformly; questions %d-%d tokens, "
           "answers %d-%d\n", c->tenants, prefix, (long long)prefix_blocks, q_lo, q_hi, o_lo, o_hi);
    printf("  pool: --kv-blocks=%lld per worker (%.1f MiB) = half of the %lld prefix blocks + %lld for 4 "
           "requests' own tokens%s\n", (long long)(pool > full_ctx ? pool : full_ctx),
           (double)((pool > full_ctx ? pool : full_ctx) * e->block_bytes) / 1048576.0,
           (long long)c->tenants * prefix_blocks, (long long)(4 * own_blocks),
           pool >= full_ctx ? "" : ", raised to one sequence of the model's full context (the workers' minimum)");
    if (pool < full_ctx)
        pool = full_ctx;
    fflush(stdout);
    char blocks[48];
    snprintf(blocks, sizeof blocks, "--kv-blocks=%lld", (long long)pool);
    char *const rr[] = {"--prefill=0", "--decode=4", "--policy=round-robin", blocks, NULL};
    char *const kv[] = {"--prefill=0", "--decode=4", "--policy=kv", blocks, NULL};
    char *const approx[] = {"--prefill=0", "--decode=4", "--policy=kv", "--approx=true", blocks, NULL};
    serve_conf cs[3] = {
        {.name = "round-robin", .up_args = rr, .kind = SERVE_TENANTS, .prefix_len = prefix},
        {.name = "kv", .up_args = kv, .kind = SERVE_TENANTS, .prefix_len = prefix},
        {.name = "kv approx", .up_args = approx, .kind = SERVE_TENANTS, .prefix_len = prefix,
         .need_role = "router", .need_flag = "approx"},
    };
    serve_stats st[3];
    char title[160];
    snprintf(title, sizeof title, "%d tenants' shared prefixes (%d tokens) + questions, %d decode workers, "
             "pools for half the prefixes", c->tenants, prefix, workers);
    if (run_set(e, cs, 3, 0, title, st, rc) != 0)
        return -1;
    printf("\nserve: kv_vs_rr_ttft_p90=%.2f kv_vs_approx_ttft_p90=%.2f kv_vs_rr_tok_s=%.2f (hit kv %.3f, "
           "approx %.3f, round-robin %.3f)%s\n", ratio(st[1].ttft_p90, st[0].ttft_p90),
           ratio(st[1].ttft_p90, st[2].ttft_p90), ratio(st[1].tok_s, st[0].tok_s), st[1].hit, st[2].hit,
           st[0].hit, st[2].ran ? "" : " (kv approx was not run)");
    return 0;
}

/* secure: the same disaggregated fleet and workload (the short mix), plain and secured. */
static int wl_secure(const serve_env *e, int *rc)
{
    static char *const disagg[] = {"--prefill=1", "--decode=1", "--local-prefill-max-tokens=0", NULL};
    static char *const secure[] = {"--prefill=1", "--decode=1", "--local-prefill-max-tokens=0",
                                   "--tls", "--api-key=kvf-bench-key", NULL};
    serve_conf cs[2] = {
        {.name = "plain", .up_args = disagg, .kind = SERVE_SHORT},
        {.name = "tls + api key", .up_args = secure, .kind = SERVE_SHORT, .api_key = "kvf-bench-key",
         .ratio_name = "secure / plain"},
    };
    serve_stats st[2];
    int32_t lo, hi;
    char title[128];
    prompt_range(&cs[0], e->max_pos, e->c->out_max, &lo, &hi);
    snprintf(title, sizeof title, "disaggregated (1 prefill + 1 decode), short prompts (%d-%d tokens)", lo, hi);
    if (run_set(e, cs, 2, 0, title, st, rc) != 0)
        return -1;
    printf("\nserve: secure_vs_plain_ttft_p50=%.2f secure_vs_plain_tok_s=%.2f\n",
           ratio(st[1].ttft_p50, st[0].ttft_p50), ratio(st[1].tok_s, st[0].tok_s));
    return 0;
}

typedef struct serve_workload {
    const char *name, *unit; /* unit: what --requests counts */
    int (*run)(const serve_env *e, int *rc); /* -1: a fleet did not start */
} serve_workload;

static const serve_workload serve_workloads[] = {
    {"mixes", "requests", wl_mixes},
    {"multiturn", "conversations", wl_multiturn},
    {"multiturn-tier", "conversations", wl_multiturn_tier},
    {"tenants", "requests", wl_tenants},
    {"secure", "requests", wl_secure},
};
#define SERVE_N_WORKLOADS (sizeof serve_workloads / sizeof serve_workloads[0])

/* Bytes of one KV block (DESIGN.md section 4: 2 * layers * kv heads * block_size * head_dim *
 * dtype bytes) from the model's config.json and the fleet's --kv-dtype; 0 when unknown. */
static int64_t block_bytes_of(json_t *mj, int32_t block_size, const char *kv_dtype)
{
    int64_t layers = json_integer_value(json_object_get(mj, "num_hidden_layers"));
    int64_t heads = json_integer_value(json_object_get(mj, "num_attention_heads"));
    int64_t kv_heads = json_integer_value(json_object_get(mj, "num_key_value_heads"));
    int64_t head_dim = json_integer_value(json_object_get(mj, "head_dim"));
    int64_t dim = json_integer_value(json_object_get(mj, "hidden_size"));
    if (kv_heads <= 0)
        kv_heads = heads;
    if (head_dim <= 0 && heads > 0)
        head_dim = dim / heads;
    int64_t dt = strcmp(kv_dtype, "f16") == 0 || strcmp(kv_dtype, "bf16") == 0 ? 2
               : strncmp(kv_dtype, "fp8", 3) == 0 ? 1 : 4;
    return 2 * layers * kv_heads * block_size * head_dim * dt;
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
    const serve_workload *wl = NULL;
    char names[256] = "";
    for (size_t i = 0; i < SERVE_N_WORKLOADS; i++) {
        if (strcmp(c.workload, serve_workloads[i].name) == 0)
            wl = &serve_workloads[i];
        size_t l = strlen(names);
        snprintf(names + l, sizeof names - l, "%s%s", i == 0 ? "" : i + 1 == SERVE_N_WORKLOADS ? " or " : ", ",
                 serve_workloads[i].name);
    }
    if (!wl) {
        fprintf(stderr, "kvfleet: bench serve: --workload=%s is not known (use %s)\n", c.workload, names);
        return 2;
    }
    if (!(c.rate > 0) || (c.requests <= 0 && !(c.duration > 0)) || c.requests > SERVE_MAX_REQS ||
        c.out_min < 1 || c.out_max < c.out_min || c.turns < 1 || c.turns > 64) {
        fprintf(stderr, "kvfleet: bench serve: need --rate (%g) > 0, --duration (%g) > 0 or --requests (%lld) in "
                "1..%d, 1 <= --out-min (%d) <= --out-max (%d), --turns (%d) in 1..64\n", c.rate, c.duration,
                (long long)c.requests, SERVE_MAX_REQS, c.out_min, c.out_max, c.turns);
        return 2;
    }
    if (c.tenants < 1 || c.tenants > SERVE_MAX_TENANTS) {
        fprintf(stderr, "kvfleet: bench serve: --tenants=%d is out of range (1 to %d)\n", c.tenants,
                SERVE_MAX_TENANTS);
        return 2;
    }
    if (!(c.think_s >= 0 && c.think_s <= 600)) {
        fprintf(stderr, "kvfleet: bench serve: --think-s=%g is out of range (0 to 600)\n", c.think_s);
        return 2;
    }
    if (c.host_tier_bytes < 0) {
        fprintf(stderr, "kvfleet: bench serve: --host-tier-bytes=%lld is out of range (0: 4x the pool, or a "
                "positive size)\n", (long long)c.host_tier_bytes);
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
    /* the model's shape, and the KV block the fleet will use */
    char cfg_path[PATH_MAX + 16], bs_arg[32] = "16", dtype[32] = "f32";
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", model);
    fleet_flag(&c, "block-size", bs_arg, sizeof bs_arg);
    fleet_flag(&c, "kv-dtype", dtype, sizeof dtype);
    int32_t block_size = atoi(bs_arg);
    json_error_t je;
    json_t *mj = json_load_file(cfg_path, 0, &je);
    int32_t vocab = (int32_t)json_integer_value(json_object_get(mj, "vocab_size"));
    int32_t max_pos = (int32_t)json_integer_value(json_object_get(mj, "max_position_embeddings"));
    int64_t block_bytes = block_size > 0 ? block_bytes_of(mj, block_size, dtype) : 0;
    json_decref(mj);
    if (vocab < 16 || max_pos < c.out_max + 64) {
        fprintf(stderr, "kvfleet: bench serve: %s: vocab_size (%d) must be >= 16 and max_position_embeddings "
                "(%d) >= --out-max + 64\n", cfg_path, vocab, max_pos);
        goto out;
    }
    if (block_size < 1 || block_bytes <= 0) {
        fprintf(stderr, "kvfleet: bench serve: cannot size a KV block from %s and --block-size=%s\n", cfg_path,
                bs_arg);
        goto out;
    }
    char mtmp[PATH_MAX];
    snprintf(mtmp, sizeof mtmp, "%s", model);
    for (size_t l = strlen(mtmp); l > 1 && mtmp[l - 1] == '/'; l--)
        mtmp[l - 1] = 0;
    const char *model_id = strrchr(mtmp, '/') ? strrchr(mtmp, '/') + 1 : mtmp;

    printf("kvfleet bench serve: model %s (vocab %d, %d positions), device %s%s%s, rate %g/s, %s, seed %lld, output %d-%d tokens\n",
           model, vocab, max_pos, c.device, c.fleet_flags ? ", fleet flags " : "", c.fleet_flags ? c.fleet_flags : "", c.rate, c.requests > 0 ? "fixed count" : "fixed duration", (long long)c.seed,
           c.out_min, c.out_max);
    if (c.requests > 0)
        printf("  %lld %s per configuration\n", (long long)c.requests, wl->unit);
    else
        printf("  %g s of arrivals per configuration\n", c.duration);
    printf("  times in ms; hit = cached prompt tokens / prompt tokens; ratio rows: / the baseline above\n");
    fflush(stdout);
    serve_env env = {.self = self, .model = model, .model_id = model_id, .log_dir = log_dir, .c = &c,
                     .vocab = vocab, .max_pos = max_pos, .block_size = block_size, .block_bytes = block_bytes};
    if (wl->run(&env, &rc) != 0)
        goto out;
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
