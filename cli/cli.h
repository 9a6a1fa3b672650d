/* cli.h: the `kvfleet` subcommands. Each takes argv with argv[0] = the subcommand name and
 * returns the process exit code (0 ok, 1 failure, 2 usage error). Only cli/ prints for users. */
#ifndef KVF_CLI_H
#define KVF_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

int kvf_cli_plan(int argc, char **argv);
int kvf_cli_bench(int argc, char **argv);
int kvf_cli_generate(int argc, char **argv);  /* cli/cmd_generate.c */
int kvf_cli_gen_model(int argc, char **argv); /* cli/cmd_gen_model.c */
int kvf_cli_tokenize(int argc, char **argv); /* cli/cmd_tokenize.c */
int kvf_cli_chat_template(int argc, char **argv); /* cli/cmd_chat_template.c */
int kvf_cli_sim(int argc, char **argv); /* cli/cmd_sim.c */
int kvf_cli_decode(int argc, char **argv);  /* cli/cmd_decode.c */
int kvf_cli_prefill(int argc, char **argv); /* cli/cmd_prefill.c */
int kvf_cli_router(int argc, char **argv); /* cli/cmd_router.c */
int kvf_cli_up(int argc, char **argv); /* cli/cmd_up.c */
int kvf_cli_gen_certs(int argc, char **argv); /* cli/cmd_gen_certs.c */

/* Parses token ids given as "1,2,3", "1 2 3" or "[1, 2, 3]" into a malloc'd array (free it);
 * what names the flag in messages ("tokenize: --ids"). */
kvf_status kvf_cli_parse_ids(const char *what, const char *s, int32_t **out, size_t *n_out, kvf_err *err);

/* Exit code for a status from kvf_cfg_parse or a command: 0 for OK and HELP, 2 for invalid
 * arguments, 1 otherwise; prints err's message (prefixed "kvfleet: ") when there is one. */
int kvf_cli_exit(kvf_status st, const kvf_err *err);

#endif
