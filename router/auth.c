/* auth.c: the API key table (auth.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "router/auth.h"

typedef struct key_entry {
    char key[KVF_ROUTER_AUTH_MAX_KEY + 1];
    size_t len;
    char tenant[KVF_ROUTER_AUTH_MAX_TENANT + 1];
} key_entry;

struct kvf_router_auth {
    key_entry *keys;
    size_t n, cap;
};

kvf_status kvf_router_auth_create(kvf_router_auth **out, kvf_err *err)
{
    *out = calloc(1, sizeof **out);
    return *out ? KVF_OK : kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
}

void kvf_router_auth_destroy(kvf_router_auth *a)
{
    if (!a)
        return;
    if (a->keys) /* no key stays behind in freed memory */
        memset(a->keys, 0, a->cap * sizeof *a->keys);
    free(a->keys);
    free(a);
}

size_t kvf_router_auth_count(const kvf_router_auth *a)
{
    return a ? a->n : 0;
}

static bool tenant_ok(const char *t, size_t len)
{
    if (len == 0 || len > KVF_ROUTER_AUTH_MAX_TENANT)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = t[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return false;
    }
    return true;
}

/* A key is printable ASCII without spaces (what fits in a header after "Bearer "). */
static bool key_ok(const char *k, size_t len)
{
    if (len == 0 || len > KVF_ROUTER_AUTH_MAX_KEY)
        return false;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)k[i] <= ' ' || (unsigned char)k[i] >= 0x7f)
            return false;
    return true;
}

static kvf_status add(kvf_router_auth *a, const char *key, size_t klen, const char *tenant,
                      size_t tlen, const char *where, kvf_err *err)
{
    if (!key_ok(key, klen))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: %s: an API key must be 1 to %d "
                           "printable characters without spaces", where, KVF_ROUTER_AUTH_MAX_KEY);
    if (!tenant_ok(tenant, tlen))
        return kvf_err_set(err, KVF_ERR_INVALID, "router: %s: the tenant must be 1 to %d of "
                           "A-Z a-z 0-9 . _ -", where, KVF_ROUTER_AUTH_MAX_TENANT);
    for (size_t i = 0; i < a->n; i++)
        if (a->keys[i].len == klen && memcmp(a->keys[i].key, key, klen) == 0)
            return kvf_err_set(err, KVF_ERR_INVALID, "router: %s: this API key is given twice "
                               "(tenant %s and %.*s)", where, a->keys[i].tenant, (int)tlen, tenant);
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 8;
        key_entry *nk = calloc(cap, sizeof *nk);
        if (!nk)
            return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
        if (a->keys) {
            memcpy(nk, a->keys, a->n * sizeof *nk);
            memset(a->keys, 0, a->cap * sizeof *a->keys);
            free(a->keys);
        }
        a->keys = nk;
        a->cap = cap;
    }
    key_entry *e = &a->keys[a->n++];
    memcpy(e->key, key, klen);
    e->key[klen] = 0;
    e->len = klen;
    memcpy(e->tenant, tenant, tlen);
    e->tenant[tlen] = 0;
    return KVF_OK;
}

kvf_status kvf_router_auth_add_list(kvf_router_auth *a, const char *list, kvf_err *err)
{
    size_t i = 1;
    for (const char *p = list;; i++) {
        size_t l = strcspn(p, ",");
        char where[48];
        snprintf(where, sizeof where, "--api-key item %zu", i);
        kvf_status st = add(a, p, l, "default", 7, where, err);
        if (st != KVF_OK)
            return st;
        if (!p[l])
            return KVF_OK;
        p += l + 1;
    }
}

kvf_status kvf_router_auth_add_text(kvf_router_auth *a, const char *source, const char *text,
                                    size_t len, kvf_err *err)
{
    size_t line = 0;
    for (size_t pos = 0; pos < len;) {
        const char *s = text + pos;
        const char *nl = memchr(s, '\n', len - pos);
        size_t l = nl ? (size_t)(nl - s) : len - pos;
        pos += l + (nl ? 1 : 0);
        line++;
        if (l && s[l - 1] == '\r')
            l--;
        size_t b = 0;
        while (b < l && (s[b] == ' ' || s[b] == '\t'))
            b++;
        if (b == l || s[b] == '#')
            continue;
        char where[600];
        snprintf(where, sizeof where, "%.500s line %zu", source, line);
        size_t k0 = b, k1 = k0;
        while (k1 < l && s[k1] != ' ' && s[k1] != '\t')
            k1++;
        size_t t0 = k1;
        while (t0 < l && (s[t0] == ' ' || s[t0] == '\t'))
            t0++;
        size_t t1 = t0;
        while (t1 < l && s[t1] != ' ' && s[t1] != '\t')
            t1++;
        size_t rest = t1;
        while (rest < l && (s[rest] == ' ' || s[rest] == '\t'))
            rest++;
        if (t0 == t1 || rest != l)
            return kvf_err_set(err, KVF_ERR_PARSE, "router: %s: want \"KEY TENANT\" (two fields "
                               "separated by spaces)", where);
        kvf_status st = add(a, s + k0, k1 - k0, s + t0, t1 - t0, where, err);
        if (st != KVF_OK)
            return st;
    }
    return KVF_OK;
}

kvf_status kvf_router_auth_add_file(kvf_router_auth *a, const char *path, kvf_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvf_err_set(err, KVF_ERR_IO, "router: --api-key-file %s: %s", path,
                           strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    kvf_status st = KVF_OK;
    for (;;) {
        if (len == cap) {
            if (cap >= (64u << 20)) {
                st = kvf_err_set(err, KVF_ERR_INVALID, "router: --api-key-file %s: larger than "
                                 "64 MiB", path);
                break;
            }
            cap = cap ? cap * 2 : 4096;
            char *nb = realloc(buf, cap);
            if (!nb) {
                st = kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
                break;
            }
            buf = nb;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0)
            break;
    }
    if (st == KVF_OK && ferror(f))
        st = kvf_err_set(err, KVF_ERR_IO, "router: --api-key-file %s: read error", path);
    fclose(f);
    char src[520];
    snprintf(src, sizeof src, "--api-key-file %.500s", path);
    if (st == KVF_OK)
        st = kvf_router_auth_add_text(a, src, buf ? buf : "", len, err);
    if (buf) {
        memset(buf, 0, cap);
        free(buf);
    }
    return st;
}

bool kvf_router_auth_equal(const char *want, size_t want_len, const char *given, size_t given_len)
{
    size_t n = want_len > given_len ? want_len : given_len;
    volatile unsigned char diff = (unsigned char)(want_len != given_len);
    for (size_t i = 0; i < n; i++) {
        unsigned char w = i < want_len ? (unsigned char)want[i] : 0;
        unsigned char g = i < given_len ? (unsigned char)given[i] : 0;
        diff |= (unsigned char)(w ^ g);
    }
    return diff == 0;
}

const char *kvf_router_auth_check(const kvf_router_auth *a, const char *authorization)
{
    if (!a || !authorization)
        return NULL;
    /* "Bearer" is case-insensitive (RFC 6750 uses the auth-scheme rules), one or more spaces */
    if (strncasecmp(authorization, "Bearer", 6) != 0 ||
        (authorization[6] != ' ' && authorization[6] != '\t'))
        return NULL;
    const char *k = authorization + 6;
    while (*k == ' ' || *k == '\t')
        k++;
    size_t len = strlen(k);
    while (len && (k[len - 1] == ' ' || k[len - 1] == '\t'))
        len--;
    if (len == 0 || len > KVF_ROUTER_AUTH_MAX_KEY)
        return NULL;
    const char *tenant = NULL;
    for (size_t i = 0; i < a->n; i++) /* every key, no early exit */
        if (kvf_router_auth_equal(a->keys[i].key, a->keys[i].len, k, len))
            tenant = a->keys[i].tenant;
    return tenant;
}
