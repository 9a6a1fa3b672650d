/* cmd_prefill.c: `kvfleet prefill`: one prefill worker (RemotePrefill for decode workers, its
 * own prefix cache, WatchKv). Prints one "ready" line with the bound ports on stdout, serves until SIGINT/SIGTERM,
 * then cancels what is in flight, frees every block and shuts its servers down. */
#include <signal.h>
#include <stddef.h>
#include <stdio.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "common/log.h"
#include "prefill/prefill.h"
#include "worker/worker.h"

static const kvf_cfg_opt prefill_opts[] = {
    KVF_WORKER_CFG_OPTS,
    {"fault-delay-ms", "0", "sleep this long before each prefill (fault tests only)",
     offsetof(kvf_worker_cfg, fault_delay_ms), KVF_CFG_INT},
    {NULL},
};

static const kvf_cfg_spec prefill_spec = {
    .prog = "kvfleet prefill",
    .summary = "A prefill worker: serves the Worker gRPC service (RemotePrefill, WatchKv, Info,\n"
               "Health) and /metrics and /health on the admin port. RemotePrefill computes a\n"
               "prompt's KV (reusing this worker's prefix cache) and writes the blocks the decode\n"
               "worker lacks straight into its pool through the transport.",
    .opts = prefill_opts,
};

int kvf_cli_prefill(int argc, char **argv)
{
    kvf_worker_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&prefill_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    int lv = kvf_log_level_parse(c.log_level ? c.log_level : "info");
    if (lv < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "prefill: --log-level=%s is not one of "
                                        "debug, info, warn, error, off", c.log_level), &err);
    kvf_log_set_level((kvf_log_level)lv);
    /* signals are taken by sigwait below: block them before any thread starts */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    kvf_worker *w = NULL;
    kvf_prefill *d = NULL;
    if ((st = kvf_worker_create(&c, KVF_WORKER_PREFILL, &w, &err)) != KVF_OK ||
        (st = kvf_prefill_create(w, c.fault_delay_ms, &d, &err)) != KVF_OK ||
        (st = kvf_worker_start(w, &err)) != KVF_OK) {
        kvf_worker_shutdown(w);
        kvf_prefill_destroy(d);
        kvf_worker_destroy(w);
        return kvf_cli_exit(st, &err);
    }
    char host[256];
    int port;
    kvf_worker_parse_hostport("listen", c.listen, host, sizeof host, &port, &err);
    char ahost[256];
    kvf_worker_parse_hostport("admin-listen", c.admin_listen, ahost, sizeof ahost, &port, &err);
    printf("kvfleet prefill: ready grpc=%s:%d admin=%s:%d\n", host, kvf_worker_grpc_port(w), ahost,
           kvf_worker_admin_port(w));
    fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    kvf_log(KVF_LOG_INFO, "prefill: signal %d: shutting down", sig);
    kvf_worker_shutdown(w);
    kvf_prefill_destroy(d);
    kvf_worker_destroy(w);
    return 0;
}
