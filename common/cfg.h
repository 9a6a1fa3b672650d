/* cfg.h: one table per program drives its flags, its KVFLEET_* environment variables and its
 * --help. Precedence: the table's default < environment < command line.
 *   {"block-size", "16", "tokens per KV block (8, 16, 32)",
 *    offsetof(kvf_decode_cfg, block_size), KVF_CFG_INT}
 * A library that owns a cfg struct exports its flags as a table of its own (offsets within its
 * struct, e.g. kvf_xfer_cfg_opts); a program includes it through kvf_cfg_spec.tables with the
 * struct's offset inside the program's cfg, so every flag is written once, as data.
 * The environment name is KVFLEET_ + the flag upper-cased with '-' as '_' (KVFLEET_BLOCK_SIZE).
 * String fields point into argv, the environment or the table: they live as long as the process. */
#ifndef KVF_COMMON_CFG_H
#define KVF_COMMON_CFG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"

typedef enum kvf_cfg_type {
    KVF_CFG_INT,    /* int32_t */
    KVF_CFG_INT64,  /* int64_t */
    KVF_CFG_SIZE,   /* int64_t bytes; accepts 512, 64K, 16M, 40G, 40GiB, 1.5G */
    KVF_CFG_DOUBLE, /* double */
    KVF_CFG_STR,    /* const char *, NULL when unset with no default */
    KVF_CFG_BOOL,   /* bool; --name, --no-name, --name=true|false|1|0 */
    KVF_CFG_RENAMED, /* a former name: using it (flag or environment) is an error naming the
                      * flag it became (def); not listed in --help */
} kvf_cfg_type;

typedef struct kvf_cfg_opt {
    const char *name; /* flag without the dashes; NULL ends the table */
    const char *def;  /* default as text; NULL leaves the field as the caller set it */
    const char *help;
    size_t offset; /* offsetof(the program's cfg struct, field) */
    kvf_cfg_type type;
} kvf_cfg_opt;

/* Another table of a program: opts' offsets are within a struct found at base in its cfg. */
typedef struct kvf_cfg_table {
    const kvf_cfg_opt *opts; /* ends with {NULL}; NULL ends a list of tables */
    size_t base;
} kvf_cfg_table;

typedef struct kvf_cfg_spec {
    const char *prog;       /* "kvfleet plan" */
    const char *args;       /* positional arguments for the usage line, or NULL */
    const char *summary;    /* one paragraph for --help */
    const kvf_cfg_opt *opts; /* the program's own flags; ends with {NULL} */
    const kvf_cfg_table *tables; /* more flags after them (libraries'), or NULL; ends with {0} */
} kvf_cfg_spec;

/* Fills cfg from defaults, the environment and argv[1..argc). argv[0] is the program or
 * subcommand name. Positional arguments are moved to argv[1..*n_pos_out] in order; "--" ends
 * the flags. On --help prints the help to stdout and returns KVF_HELP. An unknown flag or a bad
 * value returns KVF_ERR_INVALID with a message naming the flag, the value and what is allowed. */
kvf_status kvf_cfg_parse(const kvf_cfg_spec *spec, void *cfg, int argc, char **argv,
                         int *n_pos_out, kvf_err *err);
void kvf_cfg_help(const kvf_cfg_spec *spec, FILE *out);
/* The environment variable name of a flag, into buf. */
void kvf_cfg_env_name(const char *flag, char *buf, size_t cap);

/* Value parsers shared with code that reads the same kinds of values elsewhere. */
kvf_status kvf_cfg_parse_size(const char *s, int64_t *out);
kvf_status kvf_cfg_parse_int64(const char *s, int64_t *out);
kvf_status kvf_cfg_parse_double(const char *s, double *out);
kvf_status kvf_cfg_parse_bool(const char *s, int *out);

#endif
