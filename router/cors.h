/* cors.h: the router's CORS rules (--allowed-origins, --allowed-methods, --allowed-headers,
 * --allow-credentials, as vLLM's flags and Starlette's CORSMiddleware behind them): which
 * origins get Access-Control-* headers and what a preflight is answered. Pure functions over
 * strings; http.c reads the request's headers and writes the answer. */
#ifndef KVF_ROUTER_CORS_H
#define KVF_ROUTER_CORS_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

typedef struct kvf_router_cors kvf_router_cors;

#define KVF_ROUTER_CORS_DEFAULT_METHODS "GET,POST,OPTIONS"
#define KVF_ROUTER_CORS_DEFAULT_HEADERS "Authorization,Content-Type,X-Request-Id"
#define KVF_ROUTER_CORS_MAX_AGE "600" /* seconds a browser may cache a preflight (Starlette's) */

/* origins: comma-separated origins ("https://app.example.com", scheme://host[:port], compared
 * exactly) or "*"; NULL or "" turns CORS off (*out = NULL: no header is ever added).
 * methods, headers: comma-separated, or "*"; NULL: the defaults above. An entry that can never
 * match (a trailing '/', a path, spaces) is refused with a message naming the flag and the
 * entry. The caller owns *out (kvf_router_cors_destroy). */
kvf_status kvf_router_cors_create(const char *origins, const char *methods, const char *headers,
                                  bool credentials, kvf_router_cors **out, kvf_err *err);
void kvf_router_cors_destroy(kvf_router_cors *c); /* NULL is fine */

/* What to do with one request. */
typedef enum kvf_router_cors_verdict {
    KVF_ROUTER_CORS_NONE,          /* no CORS headers: off, no Origin, or an origin not allowed
                                    * on a request that is not a preflight (served as usual) */
    KVF_ROUTER_CORS_ADD,           /* serve as usual, with the headers below */
    KVF_ROUTER_CORS_PREFLIGHT_OK,  /* answer 204 now with the headers below, before any auth */
    KVF_ROUTER_CORS_PREFLIGHT_BAD, /* answer 403 now with `why` (origin, method or header) */
} kvf_router_cors_verdict;

#define KVF_ROUTER_CORS_MAX_HEADERS 6
#define KVF_ROUTER_CORS_VALUE_MAX 2048

typedef struct kvf_router_cors_answer {
    size_t n;
    struct {
        const char *name;
        char value[KVF_ROUTER_CORS_VALUE_MAX];
    } h[KVF_ROUTER_CORS_MAX_HEADERS];
    char why[1280]; /* PREFLIGHT_BAD: what was refused, for the client's 403 */
} kvf_router_cors_answer;

/* origin: the Origin header (NULL: none). A preflight is an OPTIONS request with
 * Access-Control-Request-Method (req_method; NULL on any other request); req_headers is its
 * Access-Control-Request-Headers (NULL: none). Fills *a for ADD and PREFLIGHT_*. c may be NULL
 * (off). */
kvf_router_cors_verdict kvf_router_cors_check(const kvf_router_cors *c, const char *origin,
                                              bool is_options, const char *req_method,
                                              const char *req_headers, kvf_router_cors_answer *a);

#endif
