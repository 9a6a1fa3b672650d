/* cmd_decode.c: `kvfleet decode`: one decode worker (colocated when requests name no prefill
 * worker); cli/worker_main.c runs it: the "ready" line, signals, shutdown freeing every block. */
#include <stddef.h>

#include "cli/worker_main.h"
#include "common/cfg.h"
#include "decode/decode.h"
#include "worker/worker.h"

static const kvf_cfg_opt decode_opts[] = {
    {"local-prefill-max-tokens", "32",
     "prompts with at most this many uncached tokens are prefilled here; 0: every prompt goes to "
     "the prefill worker the router names, when it is reachable",
     offsetof(kvf_worker_cfg, local_prefill_max_tokens), KVF_CFG_INT},
    {"late-write-grace-ms", "5000",
     "blocks of a remote prefill given up (client cancel, timeout, failed call) stay held, never "
     "reused, until the prefill worker answers or the transfer's deadline plus this many ms "
     "(clock skew, one progress pass) has passed",
     offsetof(kvf_worker_cfg, late_write_grace_ms), KVF_CFG_INT},
    {NULL},
};

static const kvf_cfg_spec decode_spec = {
    .prog = "kvfleet decode",
    .summary = "A decode worker: serves the Worker gRPC service (Generate, Cancel, WatchKv, Info,\n"
               "Health) and /metrics and /health on the admin port. Prompts are prefilled here or\n"
               "by the prefill worker named in each request (RemotePrefill), with a local fallback.\n"
               "Blocks a prefill worker may still write when a request is cancelled or falls back\n"
               "are held until its RemotePrefill answer arrives or the transfer's deadline plus\n"
               "--late-write-grace-ms passes (gauge kvfleet_decode_held_blocks).",
    .opts = decode_opts,
    .tables = kvf_worker_cfg_tables,
};

static kvf_status decode_check(const kvf_worker_cfg *c, kvf_err *err)
{
    if (c->local_prefill_max_tokens < 0 || c->prefill_timeout_ms < 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "decode: --local-prefill-max-tokens (%d) must be >= 0 and "
                           "--prefill-timeout-ms (%d) >= 1", c->local_prefill_max_tokens, c->prefill_timeout_ms);
    if (c->late_write_grace_ms < 0 || c->late_write_grace_ms > 600000)
        return kvf_err_set(err, KVF_ERR_INVALID, "decode: --late-write-grace-ms=%d is not allowed (0 to "
                           "600000)", c->late_write_grace_ms);
    return KVF_OK;
}

static kvf_status decode_create(kvf_worker *w, const kvf_worker_cfg *c, void **svc_out, kvf_err *err)
{
    return kvf_decode_create(w, (kvf_decode **)svc_out, err);
}

static void decode_destroy(void *svc) { kvf_decode_destroy(svc); }

int kvf_cli_decode(int argc, char **argv)
{
    static const kvf_cli_worker_role_ops ops = {
        .check = decode_check, .create = decode_create, .destroy = decode_destroy};
    return kvf_cli_worker_main(&decode_spec, "decode", KVF_WORKER_DECODE, &ops, argc, argv);
}
