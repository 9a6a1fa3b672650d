/* cmd_prefill.c: `kvfleet prefill`: one prefill worker (RemotePrefill for decode workers, its
 * own prefix cache, WatchKv); cli/worker_main.c runs it: the "ready" line, signals, shutdown. */
#include <stddef.h>

#include "cli/worker_main.h"
#include "common/cfg.h"
#include "prefill/prefill.h"
#include "worker/worker.h"

static const kvf_cfg_opt prefill_opts[] = {
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
    .tables = kvf_worker_cfg_tables,
};

static kvf_status prefill_create(kvf_worker *w, const kvf_worker_cfg *c, void **svc_out, kvf_err *err)
{
    return kvf_prefill_create(w, c->fault_delay_ms, (kvf_prefill **)svc_out, err);
}

static void prefill_destroy(void *svc) { kvf_prefill_destroy(svc); }

int kvf_cli_prefill(int argc, char **argv)
{
    static const kvf_cli_worker_role_ops ops = {.create = prefill_create, .destroy = prefill_destroy};
    return kvf_cli_worker_main(&prefill_spec, "prefill", KVF_WORKER_PREFILL, &ops, argc, argv);
}
