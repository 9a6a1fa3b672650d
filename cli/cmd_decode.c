/* cmd_decode.c: `kvfleet decode`: one decode worker (colocated when requests name no prefill
 * worker). Prints one "ready" line with the bound ports on stdout, serves until SIGINT/SIGTERM,
 * then cancels what is in flight, frees every block and shuts its servers down. */
#include <signal.h>
#include <stddef.h>
#include <stdio.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "common/log.h"
#include "decode/decode.h"
#include "worker/worker.h"

static const kvf_cfg_opt decode_opts[] = {
    KVF_WORKER_CFG_OPTS,
    {"local-prefill-max-tokens", "32",
     "prompts with at most this many uncached tokens are prefilled here; 0: every prompt goes to "
     "the prefill worker the router names, when it is reachable",
     offsetof(kvf_worker_cfg, local_prefill_max_tokens), KVF_CFG_INT},
    {NULL},
};

static const kvf_cfg_spec decode_spec = {
    .prog = "kvfleet decode",
    .summary = "A decode worker: serves the Worker gRPC service (Generate, Cancel, WatchKv, Info,\n"
               "Health) and /metrics and /health on the admin port. Prompts are prefilled here or\n"
               "by the prefill worker named in each request (RemotePrefill), with a local fallback.",
    .opts = decode_opts,
};

int kvf_cli_decode(int argc, char **argv)
{
    kvf_worker_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&decode_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    int lv = kvf_log_level_parse(c.log_level ? c.log_level : "info");
    if (lv < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "decode: --log-level=%s is not one of "
                                        "debug, info, warn, error, off", c.log_level), &err);
    kvf_log_set_level((kvf_log_level)lv);
    if (c.local_prefill_max_tokens < 0 || c.prefill_timeout_ms < 1)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "decode: --local-prefill-max-tokens (%d) "
                                        "must be >= 0 and --prefill-timeout-ms (%d) >= 1",
                                        c.local_prefill_max_tokens, c.prefill_timeout_ms), &err);
    /* signals are taken by sigwait below: block them before any thread starts */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    kvf_worker *w = NULL;
    kvf_decode *d = NULL;
    if ((st = kvf_worker_create(&c, KVF_WORKER_DECODE, &w, &err)) != KVF_OK ||
        (st = kvf_decode_create(w, &d, &err)) != KVF_OK ||
        (st = kvf_worker_start(w, &err)) != KVF_OK) {
        kvf_worker_shutdown(w);
        kvf_decode_destroy(d);
        kvf_worker_destroy(w);
        return kvf_cli_exit(st, &err);
    }
    char host[256];
    int port;
    kvf_worker_parse_hostport("listen", c.listen, host, sizeof host, &port, &err);
    char ahost[256];
    kvf_worker_parse_hostport("admin-listen", c.admin_listen, ahost, sizeof ahost, &port, &err);
    printf("kvfleet decode: ready grpc=%s:%d admin=%s:%d\n", host, kvf_worker_grpc_port(w), ahost,
           kvf_worker_admin_port(w));
    fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    kvf_log(KVF_LOG_INFO, "decode: signal %d: shutting down", sig);
    kvf_worker_shutdown(w);
    kvf_worker_load l;
    kvf_worker_load_get(w, &l);
    kvf_log(KVF_LOG_INFO, "decode: stopped; %d of %d blocks held by sequences", l.used_blocks,
            l.total_blocks);
    kvf_decode_destroy(d);
    kvf_worker_destroy(w);
    return 0;
}
