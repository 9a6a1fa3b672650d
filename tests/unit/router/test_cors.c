/* test_cors.c: the router's CORS rules (router/cors.h) as a table: which origins get which
 * headers, preflights allowed and refused (origin, method, header), '*' with and without
 * credentials, and flag values that can never match refused at start-up naming the flag.
 * The headers on the wire are checked in test_tokenize.c and tests/e2e/openai_sdk.sh. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "router/cors.h"

static const char *hdr(const kvf_router_cors_answer *a, const char *name)
{
    for (size_t i = 0; i < a->n; i++)
        if (strcmp(a->h[i].name, name) == 0)
            return a->h[i].value;
    return NULL;
}

static void test_checks(void **state)
{
    (void)state;
    static const struct {
        const char *origins, *methods, *headers;
        bool cred;
        const char *origin;
        bool options;
        const char *req_method, *req_headers;
        kvf_router_cors_verdict want;
        const char *allow_origin; /* Access-Control-Allow-Origin, NULL: absent */
        const char *also, *also_value; /* another header and a substring of its value */
    } cases[] = {
        /* off: nothing, even for a preflight */
        {NULL, NULL, NULL, false, "https://a.example", true, "POST", NULL, KVF_ROUTER_CORS_NONE, NULL, NULL, NULL},
        /* no Origin: not a CORS request */
        {"https://a.example", NULL, NULL, false, NULL, false, NULL, NULL, KVF_ROUTER_CORS_NONE, NULL, NULL, NULL},
        /* an allowed origin's plain request: its origin echoed, Vary */
        {"https://a.example,https://b.example:8443", NULL, NULL, false, "https://b.example:8443", false, NULL, NULL,
         KVF_ROUTER_CORS_ADD, "https://b.example:8443", "Vary", "Origin"},
        /* another origin: served, no headers */
        {"https://a.example", NULL, NULL, false, "https://evil.example", false, NULL, NULL, KVF_ROUTER_CORS_NONE, NULL,
         NULL, NULL},
        /* exact match only: no prefix, no other scheme */
        {"https://a.example", NULL, NULL, false, "https://a.example.evil", false, NULL, NULL, KVF_ROUTER_CORS_NONE,
         NULL, NULL, NULL},
        {"https://a.example", NULL, NULL, false, "http://a.example", false, NULL, NULL, KVF_ROUTER_CORS_NONE, NULL,
         NULL, NULL},
        /* '*' without credentials: "*" */
        {"*", NULL, NULL, false, "https://any.example", false, NULL, NULL, KVF_ROUTER_CORS_ADD, "*", NULL, NULL},
        /* '*' with credentials: the origin itself, and the credentials header */
        {"*", NULL, NULL, true, "https://any.example", false, NULL, NULL, KVF_ROUTER_CORS_ADD, "https://any.example",
         "Access-Control-Allow-Credentials", "true"},
        /* a preflight: the default methods and headers, Max-Age */
        {"https://a.example", NULL, NULL, false, "https://a.example", true, "POST", "authorization, content-type",
         KVF_ROUTER_CORS_PREFLIGHT_OK, "https://a.example", "Access-Control-Allow-Methods", "GET,POST,OPTIONS"},
        {"https://a.example", NULL, NULL, false, "https://a.example", true, "POST", "X-Request-Id",
         KVF_ROUTER_CORS_PREFLIGHT_OK, "https://a.example", "Access-Control-Allow-Headers", "Authorization"},
        {"https://a.example", NULL, NULL, false, "https://a.example", true, "GET", NULL, KVF_ROUTER_CORS_PREFLIGHT_OK,
         "https://a.example", "Access-Control-Max-Age", "600"},
        /* a safelisted header needs no flag */
        {"https://a.example", NULL, "Authorization", false, "https://a.example", true, "POST", "Accept-Language",
         KVF_ROUTER_CORS_PREFLIGHT_OK, "https://a.example", NULL, NULL},
        /* refused preflights: origin, method, header */
        {"https://a.example", NULL, NULL, false, "https://evil.example", true, "POST", NULL,
         KVF_ROUTER_CORS_PREFLIGHT_BAD, NULL, NULL, NULL},
        {"https://a.example", NULL, NULL, false, "https://a.example", true, "DELETE", NULL,
         KVF_ROUTER_CORS_PREFLIGHT_BAD, NULL, NULL, NULL},
        {"https://a.example", NULL, NULL, false, "https://a.example", true, "POST", "content-type, x-custom",
         KVF_ROUTER_CORS_PREFLIGHT_BAD, NULL, NULL, NULL},
        /* '*' methods and headers: any method; the requested headers echoed */
        {"https://a.example", "*", "*", false, "https://a.example", true, "DELETE", "x-custom, x-other",
         KVF_ROUTER_CORS_PREFLIGHT_OK, "https://a.example", "Access-Control-Allow-Headers", "x-custom, x-other"},
        {"https://a.example", "*", NULL, false, "https://a.example", true, "PATCH", NULL, KVF_ROUTER_CORS_PREFLIGHT_OK,
         "https://a.example", "Access-Control-Allow-Methods", "PATCH"},
        /* methods given in lower case match */
        {"https://a.example", "get,post", NULL, false, "https://a.example", true, "POST", NULL,
         KVF_ROUTER_CORS_PREFLIGHT_OK, "https://a.example", "Access-Control-Allow-Methods", "GET,POST"},
        /* an OPTIONS without Access-Control-Request-Method is not a preflight */
        {"https://a.example", NULL, NULL, false, "https://a.example", true, NULL, NULL, KVF_ROUTER_CORS_ADD,
         "https://a.example", NULL, NULL},
        /* "null" (file:// pages) only when listed */
        {"null", NULL, NULL, false, "null", false, NULL, NULL, KVF_ROUTER_CORS_ADD, "null", NULL, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_router_cors *c = NULL;
        kvf_err e = {0};
        if (kvf_router_cors_create(cases[i].origins, cases[i].methods, cases[i].headers, cases[i].cred, &c, &e) !=
            KVF_OK)
            fail_msg("case %zu: %s", i, e.msg);
        static kvf_router_cors_answer a;
        kvf_router_cors_verdict v = kvf_router_cors_check(c, cases[i].origin, cases[i].options, cases[i].req_method,
                                                          cases[i].req_headers, &a);
        if (v != cases[i].want)
            fail_msg("case %zu: verdict %d, want %d (%s)", i, (int)v, (int)cases[i].want, a.why);
        const char *ao = hdr(&a, "Access-Control-Allow-Origin");
        if (cases[i].allow_origin ? !ao || strcmp(ao, cases[i].allow_origin) != 0 : ao != NULL)
            fail_msg("case %zu: Access-Control-Allow-Origin '%s', want '%s'", i, ao ? ao : "(none)",
                     cases[i].allow_origin ? cases[i].allow_origin : "(none)");
        if (cases[i].also) {
            const char *v2 = hdr(&a, cases[i].also);
            if (!v2 || !strstr(v2, cases[i].also_value))
                fail_msg("case %zu: %s '%s', want it to hold '%s'", i, cases[i].also, v2 ? v2 : "(none)",
                         cases[i].also_value);
        }
        if (v == KVF_ROUTER_CORS_PREFLIGHT_BAD && (a.n != 0 || !a.why[0]))
            fail_msg("case %zu: a refused preflight has %zu headers and why '%s'", i, a.n, a.why);
        if (ao && !hdr(&a, "Vary"))
            fail_msg("case %zu: no Vary: Origin", i);
        if (!cases[i].cred && hdr(&a, "Access-Control-Allow-Credentials"))
            fail_msg("case %zu: credentials allowed without --allow-credentials", i);
        kvf_router_cors_destroy(c);
    }
}

/* Values that can never match are refused at start-up, naming the flag and the entry. */
static void test_bad_flags(void **state)
{
    (void)state;
    static const struct {
        const char *origins, *methods, *headers, *msg;
    } cases[] = {
        {"https://a.example/", NULL, NULL, "--allowed-origins: 'https://a.example/'"},
        {"https://a.example/app", NULL, NULL, "no path"},
        {"a.example", NULL, NULL, "scheme://host"},
        {"https://", NULL, NULL, "host is missing"},
        {",,", NULL, NULL, "--allowed-origins is empty"},
        {"*", "GET,PO ST", NULL, "--allowed-methods: 'PO ST'"},
        {"*", NULL, "Content-Type,X:Y", "--allowed-headers: 'X:Y'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_router_cors *c = (kvf_router_cors *)1;
        kvf_err e = {0};
        if (kvf_router_cors_create(cases[i].origins, cases[i].methods, cases[i].headers, false, &c, &e) !=
                KVF_ERR_INVALID ||
            !strstr(e.msg, cases[i].msg))
            fail_msg("case %zu: '%s', want an error holding '%s'", i, e.msg, cases[i].msg);
        assert_null(c);
    }
    /* spaces around entries are fine */
    kvf_router_cors *c = NULL;
    kvf_err e = {0};
    assert_int_equal(kvf_router_cors_create(" https://a.example , https://b.example ", NULL, NULL, false, &c, &e),
                     KVF_OK);
    static kvf_router_cors_answer a;
    assert_int_equal(kvf_router_cors_check(c, "https://b.example", false, NULL, NULL, &a), KVF_ROUTER_CORS_ADD);
    kvf_router_cors_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_checks),
        cmocka_unit_test(test_bad_flags),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
