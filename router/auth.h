/* auth.h: the router's API keys: which bearer token belongs to which tenant. Keys come from
 * --api-key (a comma list, tenant "default") and --api-key-file (lines "KEY TENANT"); a request
 * carries one as `Authorization: Bearer KEY`. Lookups compare against every key, in time that
 * depends only on the keys' lengths, never on where a wrong key differs, and keys are never
 * logged. */
#ifndef KVF_ROUTER_AUTH_H
#define KVF_ROUTER_AUTH_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

#define KVF_ROUTER_AUTH_MAX_KEY 256    /* bytes of one key */
#define KVF_ROUTER_AUTH_MAX_TENANT 64  /* bytes of a tenant name: [A-Za-z0-9._-] */

typedef struct kvf_router_auth kvf_router_auth;

kvf_status kvf_router_auth_create(kvf_router_auth **out, kvf_err *err);
void kvf_router_auth_destroy(kvf_router_auth *a);
/* Adds "KEY[,KEY...]" for tenant "default". Empty items are refused. */
kvf_status kvf_router_auth_add_list(kvf_router_auth *a, const char *list, kvf_err *err);
/* Adds the lines of text (a file's contents, len bytes): "KEY TENANT", blank lines and lines
 * starting with '#' skipped. Errors name `source` and the line, never the key. */
kvf_status kvf_router_auth_add_text(kvf_router_auth *a, const char *source, const char *text,
                                    size_t len, kvf_err *err);
/* kvf_router_auth_add_text on the contents of a file. */
kvf_status kvf_router_auth_add_file(kvf_router_auth *a, const char *path, kvf_err *err);
/* How many keys; 0 means the router asks for none. */
size_t kvf_router_auth_count(const kvf_router_auth *a);
/* The tenant of an Authorization header's value ("Bearer KEY"), or NULL when it is missing,
 * malformed or names no key. Any thread (the table does not change after start). */
const char *kvf_router_auth_check(const kvf_router_auth *a, const char *authorization);
/* Whether `given` equals `want`, comparing every byte of the longer: time depends on lengths
 * only. */
bool kvf_router_auth_equal(const char *want, size_t want_len, const char *given, size_t given_len);

#endif
