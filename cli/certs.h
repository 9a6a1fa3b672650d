/* certs.h: a fleet's CA and member certificates, made with OpenSSL's library (cli/certs.c). */
#ifndef KVF_CLI_CERTS_H
#define KVF_CLI_CERTS_H

#include <stddef.h>

#include "common/status.h"

/* In dir (created 0700 when missing): ca.pem and ca.key (made when both are absent, reused when
 * both are there), then <member>.pem and <member>.key for each member, signed by the CA, good
 * for serving and for calling peers (serverAuth, clientAuth), valid `days`, with the
 * subjectAltNames DNS:<fleet_name>, DNS:localhost, IP:127.0.0.1 and extra_san (OpenSSL's
 * syntax, "DNS:a,IP:10.0.0.3"; may be NULL). Keys are P-256, files written whole (mode 0600 for
 * keys). Errors name the file or what OpenSSL refused. */
kvf_status kvf_cli_certs_make(const char *dir, const char *fleet_name, const char *const *members,
                              size_t n_members, const char *extra_san, int days, kvf_err *err);

#endif
