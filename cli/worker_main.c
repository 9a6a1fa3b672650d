/* worker_main.c: what `kvfleet decode` and `kvfleet prefill` share as programs: flags, log
 * level, signals, the "ready" line with the bound ports, and the orderly shutdown. Each role
 * passes the two calls that add its service to the worker. */
#include <signal.h>
#include <stdio.h>

#include "cli/worker_main.h"
#include "common/log.h"
#include "common/time.h"

/* SIGTERM: Health says DRAINING at once; the worker keeps serving for --drain-delay-ms (the
 * routers' health checks see it and send nothing new), then returns once it is idle, after
 * --drain-timeout-ms more, or at a second SIGTERM or a SIGINT. */
static void drain(kvf_worker *w, const kvf_worker_cfg *c, const sigset_t *set, const char *role_name)
{
    kvf_worker_drain(w);
    kvf_log(KVF_LOG_INFO, "%s: SIGTERM: draining (serving %lld ms more, then up to %lld ms for the work in hand)",
            role_name, (long long)c->drain_delay_ms, (long long)c->drain_timeout_ms);
    int64_t t0 = kvf_now_ns();
    for (;;) {
        int64_t ms = (kvf_now_ns() - t0) / 1000000;
        bool busy = kvf_worker_busy(w);
        if (ms >= c->drain_delay_ms && !busy) {
            kvf_log(KVF_LOG_INFO, "%s: drained in %lld ms", role_name, (long long)ms);
            return;
        }
        if (ms >= c->drain_delay_ms + c->drain_timeout_ms) {
            kvf_log(KVF_LOG_WARN, "%s: drain timeout: cancelling what is still running", role_name);
            return;
        }
        struct timespec ts = {0, 50 * 1000000};
        int sig = sigtimedwait(set, NULL, &ts);
        if (sig == SIGHUP) {
            kvf_rpc_tls_reload();
        } else if (sig == SIGTERM || sig == SIGINT) {
            kvf_log(KVF_LOG_INFO, "%s: signal %d while draining: stopping now", role_name, sig);
            return;
        }
    }
}

int kvf_cli_worker_main(const kvf_cfg_spec *spec, const char *role_name, kvf_worker_role role,
                        const kvf_cli_worker_role_ops *ops, int argc, char **argv)
{
    kvf_worker_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    int lv = kvf_log_level_parse(c.log_level ? c.log_level : "info");
    if (lv < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "%s: --log-level=%s is not one of "
                                        "debug, info, warn, error, off", role_name, c.log_level), &err);
    kvf_log_set_level((kvf_log_level)lv);
    if (c.drain_delay_ms < 0 || c.drain_timeout_ms < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "%s: --drain-delay-ms and --drain-timeout-ms must be "
                                        ">= 0", role_name), &err);
    int fmt = kvf_log_format_parse(c.log_format ? c.log_format : "text");
    if (fmt < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "%s: --log-format=%s is not one of "
                                        "text, json", role_name, c.log_format), &err);
    kvf_log_set_format((kvf_log_format)fmt);
    if (ops->check && (st = ops->check(&c, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    /* signals are taken by sigwait below: block them before any thread starts */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    kvf_worker *w = NULL;
    void *svc = NULL;
    if ((st = kvf_worker_create(&c, role, &w, &err)) != KVF_OK ||
        (st = ops->create(w, &c, &svc, &err)) != KVF_OK || (st = kvf_worker_start(w, &err)) != KVF_OK) {
        kvf_worker_shutdown(w);
        if (svc)
            ops->destroy(svc);
        kvf_worker_destroy(w);
        return kvf_cli_exit(st, &err);
    }
    char host[256], ahost[256];
    int port;
    kvf_worker_parse_hostport("listen", c.listen, host, sizeof host, &port, &err);
    kvf_worker_parse_hostport("admin-listen", c.admin_listen, ahost, sizeof ahost, &port, &err);
    printf("kvfleet %s: ready grpc=%s:%d admin=%s:%d\n", role_name, host, kvf_worker_grpc_port(w), ahost,
           kvf_worker_admin_port(w));
    fflush(stdout);
    int sig = 0;
    while (sigwait(&set, &sig) == 0 && sig == SIGHUP) {
        kvf_log(KVF_LOG_INFO, "%s: SIGHUP: reloading the TLS certificates", role_name);
        kvf_rpc_tls_reload(); /* the server's next handshake and the channels' next calls */
    }
    if (sig == SIGTERM)
        drain(w, &c, &set, role_name);
    kvf_log(KVF_LOG_INFO, "%s: signal %d: shutting down", role_name, sig);
    kvf_worker_shutdown(w);
    kvf_worker_load l;
    kvf_worker_load_get(w, &l);
    kvf_log(KVF_LOG_INFO, "%s: stopped; %d of %d blocks held by sequences", role_name, l.used_blocks,
            l.total_blocks);
    ops->destroy(svc);
    kvf_worker_destroy(w);
    return 0;
}
