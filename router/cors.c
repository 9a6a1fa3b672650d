/* cors.c: the router's CORS rules: the three lists parsed once at start-up, then one check per
 * request (an allowed origin gets Access-Control-Allow-Origin; a preflight is answered here,
 * 204 or 403, before the API-key check: browsers send no Authorization on a preflight). The
 * behaviour follows Starlette's CORSMiddleware, which vLLM's flags configure; the headers go on
 * the wire in http.c. */
#include "router/cors.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_ENTRIES 64

typedef struct list {
    char *items[MAX_ENTRIES];
    size_t n;
    bool all; /* "*" */
} list;

struct kvf_router_cors {
    list origins, methods, headers;
    bool credentials;
    char methods_value[512]; /* Access-Control-Allow-Methods */
    char headers_value[1024]; /* Access-Control-Allow-Headers, unless every header is allowed */
};

/* Headers a browser may always send (Starlette's SAFELISTED_HEADERS): allowed whatever
 * --allowed-headers says. */
static const char *const safelisted[] = {"Accept", "Accept-Language", "Content-Language", "Content-Type"};
/* What "*" allows for methods (Starlette's ALL_METHODS). */
static const char *const all_methods[] = {"DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT"};

static void list_fini(list *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->items[i]);
    l->n = 0;
}

static bool list_has(const list *l, const char *s, size_t len, bool icase)
{
    for (size_t i = 0; i < l->n; i++)
        if (strlen(l->items[i]) == len &&
            (icase ? strncasecmp(l->items[i], s, len) : strncmp(l->items[i], s, len)) == 0)
            return true;
    return false;
}

/* One entry of a list: checked by its kind. Returns a reason it can never match, or NULL. */
static const char *bad_entry(const char *flag, const char *e, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)e[i] <= 0x20 || (unsigned char)e[i] >= 0x7f)
            return "it has a space or a control or non-ASCII byte";
    if (strcmp(flag, "allowed-origins") == 0) {
        if (n == 4 && memcmp(e, "null", 4) == 0)
            return NULL; /* the origin of file:// pages and sandboxed frames */
        const char *sep = memmem(e, n, "://", 3);
        if (!sep || sep == e)
            return "an origin is scheme://host[:port], e.g. https://app.example.com";
        if (memchr(sep + 3, '/', n - (size_t)(sep + 3 - e)))
            return "an origin has no path, not even a trailing '/' (browsers send none)";
        if (sep + 3 == e + n)
            return "the host is missing";
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)e[i]) && e[i] != '-' && e[i] != '_')
            return "a method or header name is letters, digits, '-' and '_'";
    return NULL;
}

/* Parses "a,b,c" or "*" into l. */
static kvf_status list_parse(const char *flag, const char *s, list *l, kvf_err *err)
{
    memset(l, 0, sizeof *l);
    for (const char *p = s; *p;) {
        while (*p == ' ' || *p == '\t')
            p++;
        size_t n = strcspn(p, ",");
        size_t m = n;
        while (m && (p[m - 1] == ' ' || p[m - 1] == '\t'))
            m--;
        if (m == 1 && *p == '*') {
            l->all = true;
        } else if (m) {
            const char *why = bad_entry(flag, p, m);
            if (why)
                return kvf_err_set(err, KVF_ERR_INVALID, "router: --%s: '%.*s' can never match: %s", flag, (int)m, p,
                                   why);
            if (l->n == MAX_ENTRIES)
                return kvf_err_set(err, KVF_ERR_INVALID, "router: --%s: more than %d entries", flag, MAX_ENTRIES);
            if (!(l->items[l->n] = strndup(p, m)))
                return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
            if (strcmp(flag, "allowed-methods") == 0)
                for (char *q = l->items[l->n]; *q; q++)
                    *q = (char)toupper((unsigned char)*q);
            l->n++;
        }
        p += n;
        if (*p == ',')
            p++;
    }
    if (!l->all && !l->n)
        return kvf_err_set(err, KVF_ERR_INVALID, "router: --%s is empty (give a list, or *)", flag);
    return KVF_OK;
}

/* Appends s to the comma-separated value v (of cap bytes) unless it is there already. */
static void value_add(char *v, size_t cap, const char *s)
{
    size_t len = strlen(v), n = strlen(s);
    for (const char *p = v; *p;) {
        size_t k = strcspn(p, ",");
        if (k == n && strncasecmp(p, s, n) == 0)
            return;
        p += k;
        p += *p == ',';
    }
    if (len + n + 2 < cap)
        snprintf(v + len, cap - len, "%s%s", len ? "," : "", s);
}

kvf_status kvf_router_cors_create(const char *origins, const char *methods, const char *headers,
                                  bool credentials, kvf_router_cors **out, kvf_err *err)
{
    *out = NULL;
    if (!origins || !*origins)
        return KVF_OK;
    kvf_router_cors *c = calloc(1, sizeof *c);
    if (!c)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    c->credentials = credentials;
    kvf_status st;
    if ((st = list_parse("allowed-origins", origins, &c->origins, err)) != KVF_OK ||
        (st = list_parse("allowed-methods", methods ? methods : KVF_ROUTER_CORS_DEFAULT_METHODS, &c->methods, err)) !=
            KVF_OK ||
        (st = list_parse("allowed-headers", headers ? headers : KVF_ROUTER_CORS_DEFAULT_HEADERS, &c->headers, err)) !=
            KVF_OK) {
        kvf_router_cors_destroy(c);
        return st;
    }
    for (size_t i = 0; i < (c->methods.all ? sizeof all_methods / sizeof *all_methods : c->methods.n); i++)
        value_add(c->methods_value, sizeof c->methods_value, c->methods.all ? all_methods[i] : c->methods.items[i]);
    for (size_t i = 0; i < c->headers.n; i++)
        value_add(c->headers_value, sizeof c->headers_value, c->headers.items[i]);
    for (size_t i = 0; i < sizeof safelisted / sizeof *safelisted; i++)
        value_add(c->headers_value, sizeof c->headers_value, safelisted[i]);
    *out = c;
    return KVF_OK;
}

void kvf_router_cors_destroy(kvf_router_cors *c)
{
    if (!c)
        return;
    list_fini(&c->origins);
    list_fini(&c->methods);
    list_fini(&c->headers);
    free(c);
}

static void put(kvf_router_cors_answer *a, const char *name, const char *value)
{
    if (a->n == KVF_ROUTER_CORS_MAX_HEADERS)
        return;
    a->h[a->n].name = name;
    snprintf(a->h[a->n].value, sizeof a->h[a->n].value, "%s", value);
    a->n++;
}

/* Whether every header named in the comma-separated list is allowed; else *bad (its length in
 * *bad_len) names the first that is not. */
static bool headers_allowed(const kvf_router_cors *c, const char *req, const char **bad, size_t *bad_len)
{
    for (const char *p = req; *p;) {
        while (*p == ' ' || *p == '\t')
            p++;
        size_t n = strcspn(p, ",");
        size_t m = n;
        while (m && (p[m - 1] == ' ' || p[m - 1] == '\t'))
            m--;
        bool ok = !m || c->headers.all || list_has(&c->headers, p, m, true);
        for (size_t i = 0; !ok && i < sizeof safelisted / sizeof *safelisted; i++)
            ok = strlen(safelisted[i]) == m && strncasecmp(safelisted[i], p, m) == 0;
        if (!ok) {
            *bad = p;
            *bad_len = m;
            return false;
        }
        p += n;
        p += *p == ',';
    }
    return true;
}

kvf_router_cors_verdict kvf_router_cors_check(const kvf_router_cors *c, const char *origin,
                                              bool is_options, const char *req_method,
                                              const char *req_headers, kvf_router_cors_answer *a)
{
    a->n = 0;
    a->why[0] = 0;
    if (!c || !origin)
        return KVF_ROUTER_CORS_NONE;
    bool preflight = is_options && req_method;
    bool allowed = c->origins.all || list_has(&c->origins, origin, strlen(origin), false);
    if (!allowed) {
        if (!preflight)
            return KVF_ROUTER_CORS_NONE;
        snprintf(a->why, sizeof a->why, "origin '%.100s' is not allowed (--allowed-origins)", origin);
        return KVF_ROUTER_CORS_PREFLIGHT_BAD;
    }
    /* '*' only without credentials: a browser refuses '*' on a credentialed request */
    put(a, "Access-Control-Allow-Origin", c->origins.all && !c->credentials ? "*" : origin);
    if (c->credentials)
        put(a, "Access-Control-Allow-Credentials", "true");
    put(a, "Vary", "Origin");
    if (!preflight)
        return KVF_ROUTER_CORS_ADD;
    if (!c->methods.all && !list_has(&c->methods, req_method, strlen(req_method), false)) {
        snprintf(a->why, sizeof a->why, "method '%.40s' is not allowed (--allowed-methods: %s)", req_method,
                 c->methods_value);
        a->n = 0;
        return KVF_ROUTER_CORS_PREFLIGHT_BAD;
    }
    const char *bad = NULL;
    size_t bad_len = 0;
    if (req_headers && !headers_allowed(c, req_headers, &bad, &bad_len)) {
        snprintf(a->why, sizeof a->why, "header '%.*s' is not allowed (--allowed-headers: %s)",
                 (int)(bad_len < 60 ? bad_len : 60), bad, c->headers_value);
        a->n = 0;
        return KVF_ROUTER_CORS_PREFLIGHT_BAD;
    }
    put(a, "Access-Control-Allow-Methods", c->methods_value);
    /* '*': the headers the browser asked for, as Starlette answers */
    if (c->headers.all && req_headers && strlen(req_headers) >= KVF_ROUTER_CORS_VALUE_MAX) {
        snprintf(a->why, sizeof a->why, "Access-Control-Request-Headers is %zu bytes (at most %d)", strlen(req_headers),
                 KVF_ROUTER_CORS_VALUE_MAX - 1);
        a->n = 0;
        return KVF_ROUTER_CORS_PREFLIGHT_BAD;
    }
    put(a, "Access-Control-Allow-Headers", c->headers.all && req_headers ? req_headers : c->headers_value);
    put(a, "Access-Control-Max-Age", KVF_ROUTER_CORS_MAX_AGE);
    return KVF_ROUTER_CORS_PREFLIGHT_OK;
}
