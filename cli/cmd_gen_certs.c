/* cmd_gen_certs.c: `kvfleet gen-certs`: a fleet's CA and member certificates for mTLS on the
 * worker plane (--tls-cert, --tls-key, --tls-ca of every role), e.g. for Kubernetes Secrets. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/certs.h"
#include "cli/cli.h"
#include "common/cfg.h"

typedef struct gen_certs_cfg {
    const char *dir, *members, *name, *san;
    int32_t days;
} gen_certs_cfg;

static const kvf_cfg_opt gen_certs_opts[] = {
    {"out", NULL, "directory to write ca.pem, ca.key and <member>.pem/.key into (required; an "
     "existing ca.pem + ca.key there signs the new members)", offsetof(gen_certs_cfg, dir), KVF_CFG_STR},
    {"members", "router,prefill,decode", "comma-separated member names: one certificate each",
     offsetof(gen_certs_cfg, members), KVF_CFG_STR},
    {"tls-name", "kvfleet", "the fleet's name, carried by every member certificate and checked by "
     "every peer (the roles' --tls-name)", offsetof(gen_certs_cfg, name), KVF_CFG_STR},
    {"san", NULL, "more subjectAltNames, OpenSSL syntax: DNS:decode.kvfleet.svc,IP:10.0.0.3",
     offsetof(gen_certs_cfg, san), KVF_CFG_STR},
    {"days", "365", "validity in days", offsetof(gen_certs_cfg, days), KVF_CFG_INT},
    {NULL},
};

static const kvf_cfg_spec gen_certs_spec = {
    .prog = "kvfleet gen-certs",
    .summary = "Makes a fleet CA (or reuses the one in --out) and a certificate per member for\n"
               "mutual TLS between router, prefill and decode workers. Give every process its\n"
               "member's .pem and .key as --tls-cert and --tls-key and ca.pem as --tls-ca; keep\n"
               "ca.key offline. Certificates are reloaded by the roles on SIGHUP.",
    .opts = gen_certs_opts,
};

int kvf_cli_gen_certs(int argc, char **argv)
{
    gen_certs_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&gen_certs_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (!c.dir || !*c.dir)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "gen-certs: --out DIR is required"), &err);
    char *list = strdup(c.members ? c.members : "");
    const char *names[64];
    size_t n = 0;
    for (char *save = NULL, *t = strtok_r(list, ",", &save); t && n < 64; t = strtok_r(NULL, ",", &save))
        if (*t) {
            if (strchr(t, '/') || t[0] == '.') {
                free(list);
                return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "gen-certs: member name "
                                                "\"%s\" must not contain '/' or start with '.'", t), &err);
            }
            names[n++] = t;
        }
    st = kvf_cli_certs_make(c.dir, c.name, names, n, c.san, c.days, &err);
    if (st == KVF_OK)
        printf("kvfleet gen-certs: %s/ca.pem and %zu member certificates (name %s, %d days)\n",
               c.dir, n, c.name, c.days);
    free(list);
    return kvf_cli_exit(st, &err);
}
