/* cmd_up.c: `kvfleet up`: a local fleet on loopback: N prefill and M decode workers and a router,
 * each a child process of this one (the same binary), started in order, waited for until ready,
 * and stopped together (SIGTERM, then SIGKILL after the drain bound) on SIGTERM or Ctrl-C, or as
 * soon as one of them dies (saying which) unless --restart on-failure starts it again. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/certs.h"
#include "cli/cli.h"
#include "common/cfg.h"
#include "common/time.h"

#define UP_MAX_CHILDREN 66
#define UP_MAX_ARGS 96

typedef struct up_cfg {
    const char *model, *host, *policy, *cache_dir, *device;
    int32_t prefill, decode, port;
    int64_t ready_timeout_s, drain_timeout_ms;
    const char *restart;
    bool tls;
} up_cfg;

static const kvf_cfg_opt up_opts[] = {
    {"model", NULL, "model directory (default: `gen-model --preset small`, on either device, written once to --cache-dir)", offsetof(up_cfg, model), KVF_CFG_STR},
    {"prefill", "1", "prefill workers (0: decode workers prefill locally)", offsetof(up_cfg, prefill), KVF_CFG_INT},
    {"decode", "1", "decode workers", offsetof(up_cfg, decode), KVF_CFG_INT},
    {"port", "8000", "the router's HTTP port (0 picks a free one)", offsetof(up_cfg, port), KVF_CFG_INT},
    {"host", "127.0.0.1", "the router's address", offsetof(up_cfg, host), KVF_CFG_STR},
    {"policy", "kv", "the router's policy: kv (prefix-aware, default), round-robin, least-loaded, sticky", offsetof(up_cfg, policy), KVF_CFG_STR},
    {"device", "cpu", "where the workers run: cpu or cuda (every worker on GPU 0; KV moves over cuda_ipc unless --xfer-backend says otherwise; pools of 2G unless --kv-memory or --kv-blocks is given)", offsetof(up_cfg, device), KVF_CFG_STR},
    {"cache-dir", NULL, "where the default model is written (default: $XDG_CACHE_HOME/kvfleet or ~/.cache/kvfleet)", offsetof(up_cfg, cache_dir), KVF_CFG_STR},
    {"tls", NULL, "mutual TLS between every process of the fleet, with a CA and certificates made for this run in a private temporary folder (removed at exit); SIGHUP to kvfleet up reaches every process", offsetof(up_cfg, tls), KVF_CFG_BOOL},
    {"ready-timeout-s", "180", "how long to wait for every process to be ready", offsetof(up_cfg, ready_timeout_s), KVF_CFG_INT64},
    {"drain-timeout-ms", "30000", "on SIGTERM or Ctrl-C: how long the processes may drain (also given to every role whose --help lists it); SIGKILL for any still running 10 s after that", offsetof(up_cfg, drain_timeout_ms), KVF_CFG_INT64},
    {"restart", "no", "no: any process dying stops the fleet; on-failure: a process that dies (signal or non-zero exit) is started again with the same arguments on the same address, after a backoff of 0.5 s doubling to 30 s (reset once it stayed up 60 s)", offsetof(up_cfg, restart), KVF_CFG_STR},
    {NULL},
};

static const kvf_cfg_spec up_spec = {
    .prog = "kvfleet up",
    .summary = "A local fleet on 127.0.0.1: a router, --prefill prefill workers and --decode decode\n"
               "workers as child processes. Prints the URL and an example request once ready; Ctrl-C\n"
               "or SIGTERM stops them all (the router first), and so does any of them dying unless\n"
               "--restart on-failure starts it again. Flags this command does not know\n"
               "(e.g. --local-prefill-max-tokens=64) go to every role whose --help lists them.",
    .opts = up_opts,
};

typedef struct child {
    char name[32];
    pid_t pid;
    int out_fd;   /* its stdout; -1 once closed */
    char line[1024];
    size_t line_len;
    char ready[256]; /* the address from its ready line (this run of it) */
    /* --restart on-failure */
    char *const *argv;  /* what it was started with (its role's, or its own with --kv-disk-dir;
                         * outlives the fleet) */
    int addr_arg;       /* index in argv of its --listen/--port flag; 0: none */
    const char *addr_flag; /* that flag's name: "port" takes the port alone, others HOST:PORT */
    char first[256];    /* (as ready) the address from its first ready line: the one the router was given */
    char addr_buf[300]; /* --FLAG=first, in place of argv[addr_arg] on a restart */
    int64_t started_ns, restart_at_ns; /* restart_at_ns: when to start it again; 0: not pending */
    int64_t backoff_ms;  /* the wait before its next restart */
    int restarts;
    bool announce;       /* a restart not yet ready: say so when it is */
} child;

_Static_assert(sizeof ((child *)0)->first == sizeof ((child *)0)->ready, "first is copied from ready");

static volatile sig_atomic_t g_stop, g_hup, g_signals;

static void on_signal(int sig)
{
    if (sig == SIGHUP) {
        g_hup = 1;
    } else {
        g_stop = 1;
        g_signals++;
    }
}

/* --tls: a CA and the three roles' certificates in a new private folder; *tls_args the flags
 * for each role (router, prefill, decode). */
typedef struct up_tls {
    char dir[64];
    char args[3][3][PATH_MAX + 16]; /* [role][cert, key, ca] */
} up_tls;

static int tls_make(up_tls *t)
{
    snprintf(t->dir, sizeof t->dir, "/tmp/kvfleet-up-tls-XXXXXX");
    if (!mkdtemp(t->dir)) {
        fprintf(stderr, "kvfleet up: --tls: cannot make a temporary folder: %s\n", strerror(errno));
        t->dir[0] = 0;
        return -1;
    }
    static const char *const members[3] = {"router", "prefill", "decode"};
    kvf_err err = {0};
    if (kvf_cli_certs_make(t->dir, "kvfleet", members, 3, NULL, 2, &err) != KVF_OK) {
        fprintf(stderr, "kvfleet up: --tls: %s\n", err.msg);
        return -1;
    }
    for (int r = 0; r < 3; r++) {
        snprintf(t->args[r][0], sizeof t->args[r][0], "--tls-cert=%s/%s.pem", t->dir, members[r]);
        snprintf(t->args[r][1], sizeof t->args[r][1], "--tls-key=%s/%s.key", t->dir, members[r]);
        snprintf(t->args[r][2], sizeof t->args[r][2], "--tls-ca=%s/ca.pem", t->dir);
    }
    return 0;
}

static void tls_remove(const up_tls *t)
{
    if (!t->dir[0])
        return;
    static const char *const files[] = {"ca.pem", "ca.key", "router.pem", "router.key",
                                        "prefill.pem", "prefill.key", "decode.pem", "decode.key"};
    char path[PATH_MAX];
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", t->dir, files[i]);
        unlink(path);
    }
    rmdir(t->dir);
}

/* Starts `self args...` with stdout on a pipe; the child dies with us. */
static int spawn(const char *self, char **args, child *c)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(p[0]);
        close(p[1]);
        return -1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        dup2(p[1], STDOUT_FILENO);
        execv(self, args);
        _exit(127);
    }
    close(p[1]);
    c->pid = pid;
    c->out_fd = p[0];
    c->line_len = 0;
    c->ready[0] = 0;
    c->started_ns = kvf_now_ns();
    return 0;
}

/* Reads what a child printed; a line "... ready grpc=ADDR ..." or "... ready http=ADDR" sets
 * c->ready. Other lines are echoed with the child's name. Returns false at EOF. */
static bool drain(child *c)
{
    char buf[512];
    ssize_t n = read(c->out_fd, buf, sizeof buf);
    if (n <= 0)
        return n < 0 && errno == EAGAIN;
    for (ssize_t i = 0; i < n; i++) {
        if (buf[i] != '\n' && c->line_len + 1 < sizeof c->line) {
            c->line[c->line_len++] = buf[i];
            continue;
        }
        c->line[c->line_len] = 0;
        c->line_len = 0;
        const char *r = strstr(c->line, "ready ");
        const char *a = r ? strstr(r, "grpc=") : NULL;
        if (!a && r)
            a = strstr(r, "http=");
        if (a && !c->ready[0]) {
            a += 5;
            size_t k = strcspn(a, " \t");
            snprintf(c->ready, sizeof c->ready, "%.*s", (int)k, a);
        } else {
            printf("[%s] %s\n", c->name, c->line);
            fflush(stdout);
        }
    }
    return true;
}

/* Waits until every child has printed its ready line, one dies, or the deadline passes. */
static int wait_ready(child *cs, int n, int64_t timeout_s)
{
    int64_t end = kvf_now_ns() + timeout_s * 1000000000LL;
    for (;;) {
        int pending = 0;
        struct pollfd pf[UP_MAX_CHILDREN];
        for (int i = 0; i < n; i++) {
            pf[i] = (struct pollfd){.fd = cs[i].out_fd, .events = POLLIN};
            pending += !cs[i].ready[0];
        }
        if (!pending)
            return -1;
        if (g_stop || kvf_now_ns() > end)
            return -2;
        poll(pf, (nfds_t)n, 100);
        for (int i = 0; i < n; i++) {
            if (pf[i].revents && !drain(&cs[i]) && !cs[i].ready[0])
                return i; /* closed its stdout before being ready: it died */
            int status;
            if (waitpid(cs[i].pid, &status, WNOHANG) == cs[i].pid) {
                cs[i].pid = 0;
                return i;
            }
        }
    }
}

/* GET /ready on host:port answers 200 (one short connection). */
static bool router_ready(const char *addr)
{
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (!colon)
        return false;
    snprintf(host, sizeof host, "%.*s", (int)(colon - addr), addr);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(host, colon + 1, &hints, &res) != 0)
        return false;
    int fd = socket(res->ai_family, SOCK_STREAM, 0);
    bool ok = false;
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
        const char req[] = "GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        char buf[64] = {0};
        if (write(fd, req, sizeof req - 1) == (ssize_t)(sizeof req - 1) && read(fd, buf, sizeof buf - 1) > 12)
            ok = strncmp(buf + 9, "200", 3) == 0;
    }
    if (fd >= 0)
        close(fd);
    freeaddrinfo(res);
    return ok;
}

/* True when `self role --help` mentions --flag. */
static bool role_has_flag(const char *self, const char *role, const char *flag)
{
    char cmd[PATH_MAX + 128];
    snprintf(cmd, sizeof cmd, "'%s' %s --help 2>/dev/null", self, role);
    FILE *p = popen(cmd, "r");
    if (!p)
        return false;
    char line[1024], want[160];
    snprintf(want, sizeof want, "--%s", flag);
    size_t wl = strlen(want);
    bool found = false;
    while (fgets(line, sizeof line, p))
        for (char *s = strstr(line, want); s && !found; s = strstr(s + 1, want))
            found = s[wl] == ' ' || s[wl] == '=' || s[wl] == '\t' || s[wl] == '\n' || s[wl] == ',';
    pclose(p);
    return found;
}

/* Waits up to timeout_ms for output from the children and reads it (drain); a child whose
 * stdout closed (it is exiting) has its descriptor closed. */
static void pump_output(child *cs, int n, int timeout_ms)
{
    struct pollfd pf[UP_MAX_CHILDREN];
    for (int i = 0; i < n; i++)
        pf[i] = (struct pollfd){.fd = cs[i].out_fd, .events = POLLIN};
    poll(pf, (nfds_t)n, timeout_ms);
    for (int i = 0; i < n; i++)
        if (pf[i].revents && !drain(&cs[i])) {
            close(cs[i].out_fd);
            cs[i].out_fd = -1;
        }
}

/* SIGTERM to the router (the last child, when started) and then to every worker; waits up to
 * drain_ms + 10 s for them to exit, echoing what they print meanwhile (a full pipe would stall
 * a draining child), then SIGKILLs the rest. A second SIGTERM or Ctrl-C kills at once. */
static void stop_all(child *cs, int n, int64_t drain_ms)
{
    for (int i = n - 1; i >= 0; i--)
        if (cs[i].pid > 0)
            kill(cs[i].pid, SIGTERM);
    int signals = g_signals;
    int64_t end = kvf_now_ns() + (drain_ms + 10000) * 1000000LL;
    for (;;) {
        int alive = 0;
        for (int i = 0; i < n; i++) {
            if (cs[i].pid <= 0)
                continue;
            int status;
            if (waitpid(cs[i].pid, &status, WNOHANG) == cs[i].pid)
                cs[i].pid = 0;
            else
                alive++;
        }
        if (!alive)
            return;
        if (kvf_now_ns() > end || g_signals > signals) {
            for (int i = 0; i < n; i++)
                if (cs[i].pid > 0) {
                    if (g_signals > signals)
                        fprintf(stderr, "kvfleet up: stopping again: killing %s (pid %d)\n", cs[i].name, (int)cs[i].pid);
                    else
                        fprintf(stderr, "kvfleet up: %s (pid %d) still running %lld ms after SIGTERM; killing it\n",
                                cs[i].name, (int)cs[i].pid, (long long)drain_ms + 10000);
                    kill(cs[i].pid, SIGKILL);
                    waitpid(cs[i].pid, NULL, 0);
                    cs[i].pid = 0;
                }
            return;
        }
        pump_output(cs, n, 20);
    }
}

/* Adds to args[*k...] every forwarded flag (with its value) that `self role --help` lists, and
 * --drain-timeout-ms=drain_arg's value when it lists that. A local fleet has no load balancer
 * to wait for: --drain-delay-ms=0 unless the command line gives one. */
static void add_role_flags(const char *self, const char *role, char **fwd, int n_fwd, char *drain_arg,
                           char **args, int *k)
{
    if (role_has_flag(self, role, "drain-timeout-ms") && *k < UP_MAX_ARGS - 2)
        args[(*k)++] = drain_arg;
    bool delay_given = false;
    for (int i = 0; i < n_fwd; i++)
        delay_given |= strncmp(fwd[i], "--drain-delay-ms", 16) == 0;
    if (!delay_given && role_has_flag(self, role, "drain-delay-ms") && *k < UP_MAX_ARGS - 2)
        args[(*k)++] = "--drain-delay-ms=0";
    for (int i = 0; i < n_fwd && *k < UP_MAX_ARGS - 2; i++) {
        if (strncmp(fwd[i], "--", 2) != 0)
            continue;
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)strcspn(fwd[i] + 2, "="), fwd[i] + 2);
        if (!role_has_flag(self, role, name))
            continue;
        args[(*k)++] = fwd[i];
        if (!strchr(fwd[i], '=') && i + 1 < n_fwd && strncmp(fwd[i + 1], "-", 1) != 0)
            args[(*k)++] = fwd[i + 1]; /* "--flag value": the value goes with it */
    }
}

/* A worker's own argv: its role's, with the disk KV tier's directory (--kv-disk-dir, as a flag
 * or KVFLEET_KV_DISK_DIR) made DIR/<name>, since a disk tier is private to one worker and every
 * worker of the fleet gets the same flags. DIR is made (0700) when missing. Returns wargs itself
 * when there is no disk tier; else out, which holds the new strings in buf. */
static char **child_argv(char **wargs, const char *name, char **out /* [UP_MAX_ARGS] */,
                         char *buf, size_t cap)
{
    static const char flag[] = "--kv-disk-dir";
    const size_t fl = sizeof flag - 1;
    const char *dir = getenv("KVFLEET_KV_DISK_DIR");
    int at = -1, n = 0;
    for (int i = 0; wargs[i]; i++)
        if (strncmp(wargs[i], flag, fl) == 0 && (wargs[i][fl] == '=' || wargs[i][fl] == 0)) {
            at = i;
            dir = wargs[i][fl] == '=' ? wargs[i] + fl + 1 : wargs[i + 1];
        }
    if (!dir || !*dir)
        return wargs;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        fprintf(stderr, "kvfleet up: --kv-disk-dir=%s cannot be made: %s (the workers will say "
                "more)\n", dir, strerror(errno));
    snprintf(buf, cap, "%s=%s/%s", flag, dir, name);
    for (int i = 0; wargs[i] && n < UP_MAX_ARGS - 2; i++) {
        if (i == at) {
            if (wargs[i][fl] == 0 && wargs[i + 1])
                i++; /* "--kv-disk-dir DIR": its value goes too */
            continue;
        }
        out[n++] = wargs[i];
    }
    out[n++] = buf;
    out[n] = NULL;
    return out;
}

/* A child died while the fleet served (--restart on-failure): schedules its restart after its
 * backoff (0.5 s, doubling to 30 s; back to 0.5 s once it had stayed up 60 s), saying so. */
static void restart_schedule(child *c, const char *how, int64_t now)
{
    if (c->backoff_ms <= 0 || now - c->started_ns >= 60 * 1000000000LL)
        c->backoff_ms = 500;
    c->restart_at_ns = now + c->backoff_ms * 1000000LL;
    fprintf(stderr, "kvfleet up: %s %s; restarting it in %.1f s on %s (restart %d)\n", c->name, how,
            (double)c->backoff_ms / 1000.0, c->first, c->restarts + 1);
    c->backoff_ms = c->backoff_ms * 2 > 30000 ? 30000 : c->backoff_ms * 2;
    c->pid = 0;
    c->announce = false;
}

/* Starts a child again with its arguments and its first address. False when fork or pipe
 * failed (then it is scheduled again). */
static bool restart_now(const char *self, child *c)
{
    char *args[UP_MAX_ARGS];
    int k = 0;
    for (; c->argv[k] && k < UP_MAX_ARGS - 1; k++)
        args[k] = c->argv[k];
    args[k] = NULL;
    if (c->addr_arg > 0) {
        const char *colon = strrchr(c->first, ':');
        const char *v = strcmp(c->addr_flag, "port") == 0 && colon ? colon + 1 : c->first;
        snprintf(c->addr_buf, sizeof c->addr_buf, "--%s=%s", c->addr_flag, v);
        args[c->addr_arg] = c->addr_buf;
    }
    c->restart_at_ns = 0;
    c->restarts++;
    if (spawn(self, args, c) != 0) {
        char how[160];
        snprintf(how, sizeof how, "could not be started again (%s)", strerror(errno));
        c->started_ns = kvf_now_ns();
        restart_schedule(c, how, c->started_ns);
        return false;
    }
    c->announce = true;
    return true;
}

/* The default model: gen-model --preset small on both devices (its head_dim 48 runs on the GPU
 * attention's padded thread groups; until then --device cuda defaulted to medium), written once
 * under the cache directory. */
static int default_model(const char *self, const up_cfg *c, char *dir, size_t cap)
{
    const char *preset = "small";
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char base[PATH_MAX];
    if (c->cache_dir)
        snprintf(base, sizeof base, "%s", c->cache_dir);
    else if (xdg && *xdg)
        snprintf(base, sizeof base, "%s/kvfleet", xdg);
    else
        snprintf(base, sizeof base, "%s/.cache/kvfleet", home && *home ? home : "/tmp");
    if ((size_t)snprintf(dir, cap, "%.3900s/models/%s", base, preset) >= cap)
        return -1;
    char probe[PATH_MAX + 32];
    snprintf(probe, sizeof probe, "%s/model.safetensors", dir);
    struct stat st;
    if (stat(probe, &st) == 0)
        return 0;
    printf("kvfleet up: writing the default model to %s (once)\n", dir);
    fflush(stdout);
    char cmd[PATH_MAX * 8];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && '%s' gen-model --preset %s --out '%s.tmp' >/dev/null && rm -rf '%s' && mv '%s.tmp' '%s'",
             base, self, preset, dir, dir, dir, dir);
    return system(cmd) == 0 ? 0 : -1;
}

int kvf_cli_up(int argc, char **argv)
{
    /* Split argv: our flags to kvf_cfg_parse, the rest forwarded to the roles that know them. */
    char *ours[UP_MAX_ARGS], *fwd[UP_MAX_ARGS];
    int n_ours = 0, n_fwd = 0;
    ours[n_ours++] = argv[0];
    for (int i = 1; i < argc && n_ours < UP_MAX_ARGS - 1 && n_fwd < UP_MAX_ARGS - 1; i++) {
        const char *a = argv[i];
        bool known = strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0 || strncmp(a, "--", 2) != 0;
        for (const kvf_cfg_opt *o = up_opts; !known && o->name; o++) {
            size_t l = strlen(o->name);
            known = strncmp(a + 2, o->name, l) == 0 && (a[2 + l] == 0 || a[2 + l] == '=');
        }
        if (known) {
            ours[n_ours++] = argv[i];
            continue;
        }
        fwd[n_fwd++] = argv[i];
        if (!strchr(a, '=') && i + 1 < argc && strncmp(argv[i + 1], "-", 1) != 0)
            fwd[n_fwd++] = argv[++i];
    }
    up_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&up_spec, &c, n_ours, ours, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (c.decode < 1 || c.prefill < 0 || c.decode + c.prefill > UP_MAX_CHILDREN - 2) {
        kvf_err_set(&err, KVF_ERR_INVALID, "up: --decode=%d --prefill=%d: need at least 1 decode worker and at most %d workers",
                    c.decode, c.prefill, UP_MAX_CHILDREN - 2);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (strcmp(c.device, "cpu") != 0 && strcmp(c.device, "cuda") != 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "up: --device=%s is not known (use cpu or cuda)", c.device);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    bool restart = strcmp(c.restart, "on-failure") == 0;
    if (!restart && strcmp(c.restart, "no") != 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "up: --restart=%s is not known (use on-failure or no)", c.restart);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (c.drain_timeout_ms < 0 || c.drain_timeout_ms > 24 * 3600 * 1000LL) {
        kvf_err_set(&err, KVF_ERR_INVALID, "up: --drain-timeout-ms=%lld is out of range (0 to 86400000)",
                    (long long)c.drain_timeout_ms);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    static char drain_arg[48];
    snprintf(drain_arg, sizeof drain_arg, "--drain-timeout-ms=%lld", (long long)c.drain_timeout_ms);
    char self[PATH_MAX];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0) {
        fprintf(stderr, "kvfleet up: cannot find this program (/proc/self/exe)\n");
        return 1;
    }
    self[sl] = 0;
    char model[PATH_MAX];
    if (c.model)
        snprintf(model, sizeof model, "%s", c.model);
    else if (default_model(self, &c, model, sizeof model) != 0) {
        fprintf(stderr, "kvfleet up: writing the default model failed\n");
        return 1;
    }

    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    static up_tls tls;
    if (c.tls && tls_make(&tls) != 0) {
        tls_remove(&tls);
        return 1;
    }

    static child cs[UP_MAX_CHILDREN];
    int n = 0, rc = 0;
    char model_arg[PATH_MAX + 16], device_arg[64];
    snprintf(model_arg, sizeof model_arg, "--model=%s", model);
    snprintf(device_arg, sizeof device_arg, "--device=%s", c.device);
    /* Workers: prefill first, then decode; each on a free loopback port. */
    for (int role = 0; role < 2; role++) {
        const char *rname = role == 0 ? "prefill" : "decode";
        int count = role == 0 ? c.prefill : c.decode;
        if (!count)
            continue;
        static char *role_args[2][UP_MAX_ARGS]; /* kept: a restart starts a worker with them again */
        char **wargs = role_args[role];
        int k = 0, addr_arg = 0;
        const char *addr_flag = NULL;
        wargs[k++] = self;
        wargs[k++] = (char *)rname;
        wargs[k++] = model_arg;
        static const char *const listen_flags[] = {"grpc", "listen", "address", "grpc-address"};
        static char listen_arg[2][64];
        for (size_t f = 0; f < sizeof listen_flags / sizeof listen_flags[0]; f++)
            if (role_has_flag(self, rname, listen_flags[f])) {
                snprintf(listen_arg[role], sizeof listen_arg[role], "--%s=127.0.0.1:0", listen_flags[f]);
                addr_arg = k;
                addr_flag = listen_flags[f];
                wargs[k++] = listen_arg[role];
                break;
            }
        if (k == 3 && role_has_flag(self, rname, "port")) {
            addr_arg = k;
            addr_flag = "port";
            wargs[k++] = "--port=0";
        }
        wargs[k++] = device_arg; /* the workers pick the transport that fits (auto) */
        /* a GPU pool: 2 GiB unless the pool is sized by flag or environment (the workers'
         * 64 MiB default is for CPU-sized models and refuses e.g. medium's full context) */
        bool sized = getenv("KVFLEET_KV_MEMORY") || getenv("KVFLEET_KV_BLOCKS");
        for (int i = 0; i < n_fwd; i++)
            sized = sized || strncmp(fwd[i], "--kv-memory", 11) == 0 || strncmp(fwd[i], "--kv-blocks", 11) == 0;
        if (strcmp(c.device, "cuda") == 0 && !sized)
            wargs[k++] = "--kv-memory=2G";
        for (int f = 0; c.tls && f < 3; f++)
            wargs[k++] = tls.args[1 + role][f];
        add_role_flags(self, rname, fwd, n_fwd, drain_arg, wargs, &k);
        wargs[k] = NULL;
        for (int j = 0; j < count; j++) {
            snprintf(cs[n].name, sizeof cs[n].name, "%s-%d", rname, j);
            static char *own_args[UP_MAX_CHILDREN][UP_MAX_ARGS];
            static char disk_arg[UP_MAX_CHILDREN][PATH_MAX + 32];
            char **cargv = child_argv(wargs, cs[n].name, own_args[n], disk_arg[n], sizeof disk_arg[n]);
            cs[n].argv = cargv;
            cs[n].addr_arg = addr_arg;
            cs[n].addr_flag = addr_flag;
            if (spawn(self, cargv, &cs[n]) != 0) {
                fprintf(stderr, "kvfleet up: cannot start %s: %s\n", cs[n].name, strerror(errno));
                rc = 1;
                goto out;
            }
            n++;
        }
    }
    int w = wait_ready(cs, n, c.ready_timeout_s);
    if (w != -1) {
        if (w >= 0)
            fprintf(stderr, "kvfleet up: %s died before it was ready; stopping the fleet\n", cs[w].name);
        else if (!g_stop)
            fprintf(stderr, "kvfleet up: the workers were not ready within %lld s\n", (long long)c.ready_timeout_s);
        rc = g_stop ? 0 : 1;
        goto out;
    }
    for (int i = 0; i < n; i++) /* the addresses the router is given, kept across restarts */
        memcpy(cs[i].first, cs[i].ready, sizeof cs[i].first); /* same size */
    /* The router, given every worker's address (static: a restart starts it with them again). */
    {
        static char dec[4096], pre[4096], port_arg[32], host_arg[300], pol_arg[128];
        for (int i = 0; i < n; i++) {
            char *dst = strncmp(cs[i].name, "decode", 6) == 0 ? dec : pre;
            size_t l = strlen(dst);
            snprintf(dst + l, sizeof dec - l, "%s%s", l ? "," : "", cs[i].ready);
        }
        static char dec_arg[4200], pre_arg[4200];
        snprintf(dec_arg, sizeof dec_arg, "--decode=%s", dec);
        snprintf(pre_arg, sizeof pre_arg, "--prefill=%s", pre);
        snprintf(port_arg, sizeof port_arg, "--port=%d", c.port);
        snprintf(host_arg, sizeof host_arg, "--host=%s", c.host);
        snprintf(pol_arg, sizeof pol_arg, "--policy=%s", c.policy);
        static char *rargs[UP_MAX_ARGS];
        int k = 0;
        rargs[k++] = self;
        rargs[k++] = "router";
        rargs[k++] = model_arg;
        rargs[k++] = dec_arg;
        int port_at = k; /* a restart takes the port it had */
        rargs[k++] = port_arg;
        rargs[k++] = host_arg;
        rargs[k++] = pol_arg;
        if (pre[0])
            rargs[k++] = pre_arg;
        for (int f = 0; c.tls && f < 3; f++)
            rargs[k++] = tls.args[0][f];
        add_role_flags(self, "router", fwd, n_fwd, drain_arg, rargs, &k);
        rargs[k] = NULL;
        snprintf(cs[n].name, sizeof cs[n].name, "router");
        cs[n].argv = rargs;
        cs[n].addr_arg = port_at;
        cs[n].addr_flag = "port";
        if (spawn(self, rargs, &cs[n]) != 0) {
            fprintf(stderr, "kvfleet up: cannot start the router: %s\n", strerror(errno));
            rc = 1;
            goto out;
        }
        n++;
        if ((w = wait_ready(cs, n, c.ready_timeout_s)) != -1) {
            if (w >= 0)
                fprintf(stderr, "kvfleet up: %s died before it was ready; stopping the fleet\n", cs[w].name);
            rc = g_stop ? 0 : 1;
            goto out;
        }
        memcpy(cs[n - 1].first, cs[n - 1].ready, sizeof cs[n - 1].first); /* same size */
    }
    /* The router listens; wait until it reaches a decode worker (its /ready). */
    for (int64_t end = kvf_now_ns() + c.ready_timeout_s * 1000000000LL; !router_ready(cs[n - 1].ready);) {
        int status;
        if (g_stop || kvf_now_ns() > end || waitpid(cs[n - 1].pid, &status, WNOHANG) == cs[n - 1].pid) {
            fprintf(stderr, "kvfleet up: the router never became ready (no decode worker answered)\n");
            rc = g_stop ? 0 : 1;
            goto out;
        }
        kvf_sleep_ms(100);
    }
    printf("kvfleet up: serving %s with %d prefill + %d decode workers at http://%s\n"
           "  curl http://%s/v1/completions -H 'Content-Type: application/json' \\\n"
           "    -d '{\"model\": \"%s\", \"prompt\": \"Hello\", \"max_tokens\": 16}'\n"
           "Ctrl-C stops the fleet.\n",
           model, c.prefill, c.decode, cs[n - 1].ready, cs[n - 1].ready,
           strrchr(model, '/') ? strrchr(model, '/') + 1 : model);
    fflush(stdout);
    /* Serve until Ctrl-C or SIGTERM, or until a child dies (--restart on-failure: a child that
     * failed is started again after its backoff; this loop wakes at least every 200 ms). */
    while (!g_stop) {
        if (g_hup) { /* certificates renewed: every process reads its files again */
            g_hup = 0;
            for (int i = 0; i < n; i++)
                if (cs[i].pid > 0)
                    kill(cs[i].pid, SIGHUP);
        }
        pump_output(cs, n, 200);
        for (int i = 0; i < n; i++) {
            if (cs[i].announce && cs[i].ready[0]) {
                cs[i].announce = false;
                fprintf(stderr, "kvfleet up: %s (pid %d) is ready again at %s%s\n", cs[i].name, (int)cs[i].pid,
                        cs[i].ready, strcmp(cs[i].ready, cs[i].first) ? " (not its first address: the router does not know it)" : "");
            }
        }
        int64_t now = kvf_now_ns();
        for (int i = 0; i < n; i++)
            if (cs[i].restart_at_ns && now >= cs[i].restart_at_ns)
                restart_now(self, &cs[i]);
        for (int i = 0; i < n; i++) {
            int status;
            if (cs[i].pid > 0 && waitpid(cs[i].pid, &status, WNOHANG) == cs[i].pid) {
                bool failed = WIFSIGNALED(status) || WEXITSTATUS(status) != 0;
                if (restart && failed) {
                    char how[96];
                    if (WIFSIGNALED(status))
                        snprintf(how, sizeof how, "(pid %d) was killed by signal %d", (int)cs[i].pid, WTERMSIG(status));
                    else
                        snprintf(how, sizeof how, "(pid %d) exited with status %d", (int)cs[i].pid, WEXITSTATUS(status));
                    if (cs[i].out_fd >= 0) {
                        close(cs[i].out_fd);
                        cs[i].out_fd = -1;
                    }
                    restart_schedule(&cs[i], how, now);
                    continue;
                }
                if (WIFSIGNALED(status))
                    fprintf(stderr, "kvfleet up: %s (pid %d) was killed by signal %d; stopping the fleet\n", cs[i].name,
                            (int)cs[i].pid, WTERMSIG(status));
                else
                    fprintf(stderr, "kvfleet up: %s (pid %d) exited with status %d; stopping the fleet\n", cs[i].name,
                            (int)cs[i].pid, WEXITSTATUS(status));
                cs[i].pid = 0;
                rc = 1;
                g_stop = 1;
                break;
            }
        }
    }
    if (rc == 0)
        printf("kvfleet up: stopping\n");
out:
    stop_all(cs, n, c.drain_timeout_ms);
    for (int i = 0; i < n; i++)
        if (cs[i].out_fd >= 0)
            close(cs[i].out_fd);
    tls_remove(&tls);
    return rc;
}
