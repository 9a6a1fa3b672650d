/* worker_main.h: the shared main of the two worker roles (`kvfleet decode`, `kvfleet prefill`). */
#ifndef KVF_CLI_WORKER_MAIN_H
#define KVF_CLI_WORKER_MAIN_H

#include "cli/cli.h"
#include "common/cfg.h"
#include "worker/worker.h"

/* How a role adds its service to a created worker, and removes it after shutdown. */
typedef struct kvf_cli_worker_role_ops {
    kvf_status (*check)(const kvf_worker_cfg *c, kvf_err *err); /* role flags; may be NULL */
    kvf_status (*create)(kvf_worker *w, const kvf_worker_cfg *c, void **svc_out, kvf_err *err);
    void (*destroy)(void *svc);
} kvf_cli_worker_role_ops;

/* Parses spec's flags into a kvf_worker_cfg, runs the worker with the role's service until
 * SIGINT/SIGTERM, and returns the exit code. */
int kvf_cli_worker_main(const kvf_cfg_spec *spec, const char *role_name, kvf_worker_role role,
                        const kvf_cli_worker_role_ops *ops, int argc, char **argv);

#endif
