/* main.c: the `kvfleet` entry point: picks a subcommand from the table and runs it. Every
 * subcommand lives in its own cmd_*.c; --help on any of them prints its flags. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/log.h"
#include "model/cpu_kernels.h"

typedef struct kvf_cli_cmd {
    const char *name;
    int (*run)(int argc, char **argv); /* NULL: planned, not in this build yet */
    const char *summary;
} kvf_cli_cmd;

static const kvf_cli_cmd commands[] = {
    {"up", kvf_cli_up, "a local fleet: router + prefill + decode processes on loopback"},
    {"router", kvf_cli_router, "the KV-aware router with the OpenAI HTTP front end"},
    {"prefill", kvf_cli_prefill, "a prefill worker"},
    {"decode", kvf_cli_decode, "a decode worker"},
    {"generate", kvf_cli_generate, "single-process generation (the end-to-end reference)"},
    {"tokenize", kvf_cli_tokenize, "encode text to token ids or decode ids to text"},
    {"chat-template", kvf_cli_chat_template, "render a model's chat template for a list of messages"},
    {"gen-certs", kvf_cli_gen_certs, "a fleet CA and member certificates for mTLS between processes"},
    {"gen-model", kvf_cli_gen_model, "write a random-weight model with a working tokenizer"},
    {"plan", kvf_cli_plan, "KV sizing: bytes per token, blocks, concurrent sequences"},
    {"sim", kvf_cli_sim, "replay a request trace through the router against simulated workers"},
    {"bench", kvf_cli_bench, "benchmarks: kv, engine, xfer, router, serve, attn"},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

int kvf_cli_exit(kvf_status st, const kvf_err *err)
{
    if (st == KVF_OK || st == KVF_HELP)
        return 0;
    if (err && err->msg[0])
        fprintf(stderr, "kvfleet: %s\n", err->msg);
    else
        fprintf(stderr, "kvfleet: %s\n", kvf_status_str(st));
    return st == KVF_ERR_INVALID ? 2 : 1;
}

static void usage(FILE *out)
{
    fprintf(out, "usage: kvfleet <command> [flags]   (kvfleet <command> --help for its flags)\n\n"
                 "kvfleet serves Llama-family models with prefill and decode disaggregated.\n\n"
                 "commands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++)
        fprintf(out, "  %-14s %s%s\n", commands[i].name, commands[i].summary,
                commands[i].run ? "" : " (not in this build yet)");
    fprintf(out, "\nEvery flag can also be set as KVFLEET_<FLAG> in the environment.\n");
}

/* OpenBLAS picks its kernels once, when it loads, and reads OPENBLAS_CORETYPE only then: when it
 * chose a core slower than this CPU runs (0.3.21 takes Zen 4 for Haswell, unknown Xeons for
 * Prescott), set the right one and start again, once (KVFLEET_BLAS_REEXEC guards the loop).
 * Done first, before any thread exists. A user's own OPENBLAS_CORETYPE is kept. */
static void blas_core_reexec(char **argv)
{
    if (getenv("OPENBLAS_CORETYPE") || getenv("KVFLEET_BLAS_REEXEC"))
        return;
    const char *core;
    char better[32];
    kvf_cpu_blas_core(&core, better, sizeof better);
    if (!better[0])
        return;
    kvf_log(KVF_LOG_INFO, "cli: OpenBLAS chose its %s kernels on a CPU that runs %s's: restarting with "
            "OPENBLAS_CORETYPE=%s", core, better, better);
    if (setenv("OPENBLAS_CORETYPE", better, 1) != 0 || setenv("KVFLEET_BLAS_REEXEC", "1", 1) != 0)
        return;
    execv("/proc/self/exe", argv);
    kvf_log(KVF_LOG_WARN, "cli: cannot restart /proc/self/exe; going on with OpenBLAS's %s kernels", core);
    unsetenv("OPENBLAS_CORETYPE");
}

int main(int argc, char **argv)
{
    blas_core_reexec(argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("kvfleet %s\n", KVF_VERSION);
        return 0;
    }
    for (size_t i = 0; i < N_COMMANDS; i++) {
        if (strcmp(argv[1], commands[i].name) != 0)
            continue;
        if (!commands[i].run) {
            fprintf(stderr, "kvfleet: '%s' is not in this build yet\n", argv[1]);
            return 2;
        }
        return commands[i].run(argc - 1, argv + 1);
    }
    fprintf(stderr, "kvfleet: unknown command '%s' (see kvfleet --help)\n", argv[1]);
    return 2;
}
