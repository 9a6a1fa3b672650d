/* test_grammar.c: text/grammar's builder and automaton without a vocabulary: literals, choices,
 * repetitions (bounded ones expanded), UTF-8 character classes, recursion (balanced parentheses,
 * a JSON-like grammar), refusal of left recursion, undefined rules and oversized grammars, the
 * running bounds (stack depth, ambiguity), clone and reset. Masks are test_grammar_mask.c's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "text/grammar.h"
#include "testutil.h"
#include "grammar_fixtures.h"

/* A matcher without a vocabulary: enough for accept_bytes. */
static kvf_text_matcher *matcher(kvf_text_grammar *g)
{
    kvf_text_matcher *m = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_text_matcher_create(g, NULL, NULL, 0, &m, &err), KVF_OK);
    return m;
}

/* Whether s (whole) is in g's language; -1 when a running bound stopped it. */
static int matches(kvf_text_grammar *g, const char *s, size_t n)
{
    kvf_text_matcher *m = matcher(g);
    kvf_err err = {0};
    kvf_status st = kvf_text_matcher_accept_bytes(m, s, n, &err);
    int r = st == KVF_OK ? kvf_text_matcher_accepting(m) : st == KVF_ERR_INVALID ? 0 : -1;
    kvf_text_matcher_destroy(m);
    return r;
}
#define MATCHES(g, s) matches((g), (s), strlen(s))

static void test_literal_alt_rep(void **state)
{
    (void)state;
    kvf_text_gb *b;
    kvf_text_grammar *g;
    kvf_err err = {0};
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    /* "ab" ("c" | "de"){2,3} [x-z]* */
    kvf_text_gx *cd[2] = {kvf_text_gx_lit(b, "c", 1), kvf_text_gx_lit(b, "de", 2)};
    kvf_text_gx *parts[3] = {kvf_text_gx_lit(b, "ab", 2),
                             kvf_text_gx_rep(b, kvf_text_gx_alt(b, cd, 2), 2, 3),
                             kvf_text_gx_rep(b, kvf_text_gx_bytes(b, 'x', 'z'), 0, -1)};
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_seq(b, parts, 3), &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    assert_int_equal(MATCHES(g, "abcc"), 1);
    assert_int_equal(MATCHES(g, "abcdec"), 1);
    assert_int_equal(MATCHES(g, "abdedexyzzy"), 1);
    assert_int_equal(MATCHES(g, "abc"), 0);      /* a prefix: not complete */
    assert_int_equal(MATCHES(g, "abcccc"), 0);   /* 4 > 3 */
    assert_int_equal(MATCHES(g, "abccw"), 0);
    assert_int_equal(MATCHES(g, ""), 0);

    /* a rejected byte leaves the matcher where it was */
    kvf_text_matcher *m = matcher(g);
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "abc", 3, &err), KVF_OK);
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "cq", 2, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "0x71"));
    assert_false(kvf_text_matcher_accepting(m));
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "c", 1, &err), KVF_OK);
    assert_true(kvf_text_matcher_accepting(m));
    assert_false(kvf_text_matcher_done(m)); /* more may follow */
    /* clone follows independently; reset goes back to the start */
    kvf_text_matcher *c;
    assert_int_equal(kvf_text_matcher_clone(m, &c, &err), KVF_OK);
    assert_int_equal(kvf_text_matcher_accept_bytes(c, "x", 1, &err), KVF_OK);
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "x", 1, &err), KVF_OK);
    assert_int_equal(kvf_text_matcher_accept_bytes(c, "c", 1, &err), KVF_ERR_INVALID);
    kvf_text_matcher_reset(m);
    assert_false(kvf_text_matcher_accepting(m));
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "abdede", 6, &err), KVF_OK);
    assert_true(kvf_text_matcher_accepting(m));
    kvf_text_matcher_destroy(c);
    kvf_text_matcher_destroy(m);
    kvf_text_grammar_destroy(g);
}

static void test_done_and_choice(void **state)
{
    (void)state;
    kvf_text_grammar *g;
    kvf_err err = {0};
    const char *ch[3] = {"yes", "no", "yesno"};
    assert_int_equal(kvf_text_grammar_choice(ch, NULL, 3, &g, &err), KVF_OK);
    assert_int_equal(MATCHES(g, "yes"), 1);
    assert_int_equal(MATCHES(g, "no"), 1);
    assert_int_equal(MATCHES(g, "yesno"), 1);
    assert_int_equal(MATCHES(g, "yesn"), 0);
    assert_int_equal(MATCHES(g, "noyes"), 0);
    kvf_text_matcher *m = matcher(g);
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "yes", 3, &err), KVF_OK);
    assert_false(kvf_text_matcher_done(m)); /* "no" may follow */
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "no", 2, &err), KVF_OK);
    assert_true(kvf_text_matcher_done(m)); /* nothing may follow */
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "x", 1, &err), KVF_ERR_INVALID);
    kvf_text_matcher_destroy(m);
    kvf_text_grammar_destroy(g);
    assert_int_equal(kvf_text_grammar_choice(ch, NULL, 0, &g, &err), KVF_ERR_INVALID);
}

/* Many strings: merged prefixes keep a state small (kvf_text_gx_choice, and kvf_text_gx_alt of
 * literals); an alternation of as many sequences passes the live-stack bound and is refused,
 * not run without bound. */
static void test_many_choices(void **state)
{
    (void)state;
    enum { N = 6000 };
    char **strs = malloc(N * sizeof *strs);
    for (int i = 0; i < N; i++) {
        strs[i] = malloc(32);
        /* prefixes of each other too: "k1", "k10", "k100" */
        snprintf(strs[i], 32, "k%d", i);
    }
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_text_grammar_choice((const char *const *)strs, NULL, N, &g, &err), KVF_OK);
    for (int i = 0; i < N; i += 7)
        assert_int_equal(matches(g, strs[i], strlen(strs[i])), 1);
    assert_int_equal(MATCHES(g, "k"), 0);
    assert_int_equal(MATCHES(g, "k6000"), 0);
    assert_int_equal(MATCHES(g, "k01"), 0);
    kvf_text_matcher *m = matcher(g);
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "k59", 3, &err), KVF_OK);
    assert_true(kvf_text_matcher_accepting(m));
    assert_false(kvf_text_matcher_done(m)); /* k590..k599, k5900.. */
    assert_int_equal(kvf_text_matcher_accept_bytes(m, "99", 2, &err), KVF_OK);
    assert_true(kvf_text_matcher_done(m));
    kvf_text_matcher_destroy(m);
    kvf_text_grammar_destroy(g);

    /* a plain alternation of the literals is merged the same way */
    kvf_text_gb *b;
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    kvf_text_gx **xs = malloc(N * sizeof *xs);
    for (int i = 0; i < N; i++)
        xs[i] = kvf_text_gx_lit(b, strs[i], strlen(strs[i]));
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_alt(b, xs, N), &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    assert_int_equal(MATCHES(g, "k4321"), 1);
    assert_int_equal(MATCHES(g, "k43210"), 0);
    kvf_text_grammar_destroy(g);
    /* but as many sequences (not literals) are not: the live-stack bound refuses them, by name */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    for (int i = 0; i < N; i++) {
        kvf_text_gx *two[2] = {kvf_text_gx_lit(b, "k", 1), kvf_text_gx_lit(b, strs[i] + 1, strlen(strs[i]) - 1)};
        xs[i] = kvf_text_gx_seq(b, two, 2);
    }
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_alt(b, xs, N), &g, &err), KVF_ERR_LIMIT);
    assert_non_null(strstr(err.msg, "live automaton stacks"));
    kvf_text_gb_destroy(b);
    free(xs);
    for (int i = 0; i < N; i++)
        free(strs[i]);
    free(strs);
}

static void test_chars_utf8(void **state)
{
    (void)state;
    kvf_text_gb *b;
    kvf_text_grammar *g;
    kvf_err err = {0};
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    /* any character but a-z and U+00E9, repeated */
    const uint32_t r[2][2] = {{'a', 'z'}, {0xE9, 0xE9}};
    kvf_text_gx *x = kvf_text_gx_rep(b, kvf_text_gx_chars(b, r, 2, true), 0, -1);
    assert_int_equal(kvf_text_gb_finish(b, x, &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    assert_int_equal(MATCHES(g, "ABC 09 \xc3\xa8 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf"), 1);
    assert_int_equal(MATCHES(g, "A\xc3\xa9"), 0);     /* é */
    assert_int_equal(MATCHES(g, "q"), 0);
    assert_int_equal(MATCHES(g, "\xed\xa0\x80"), 0);  /* a surrogate */
    assert_int_equal(MATCHES(g, "\xc0\x80"), 0);      /* overlong */
    assert_int_equal(MATCHES(g, "\xf4\x90\x80\x80"), 0); /* past U+10FFFF */
    assert_int_equal(MATCHES(g, "\xe2\x82"), 0);      /* incomplete */
    kvf_text_grammar_destroy(g);

    /* every code point of a few ranges, each alone: accepted iff in the ranges */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    const uint32_t r2[3][2] = {{0x7E, 0x801}, {0xFFF0, 0x10010}, {0xD7F0, 0xE010}};
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_chars(b, r2, 3, false), &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    const uint32_t probes[] = {0x7D, 0x7E, 0x7F, 0x80, 0x7FF, 0x800, 0x801, 0x802, 0xFFEF, 0xFFF0,
                               0xFFFF, 0x10000, 0x10010, 0x10011, 0xD7EF, 0xD7F0, 0xD7FF, 0xE000,
                               0xE010, 0xE011};
    for (size_t i = 0; i < sizeof probes / sizeof *probes; i++) {
        uint32_t cp = probes[i];
        unsigned char u[4];
        size_t n;
        if (cp < 0x80) {
            u[0] = (unsigned char)cp;
            n = 1;
        } else if (cp < 0x800) {
            u[0] = (unsigned char)(0xC0 | (cp >> 6));
            u[1] = (unsigned char)(0x80 | (cp & 0x3F));
            n = 2;
        } else if (cp < 0x10000) {
            u[0] = (unsigned char)(0xE0 | (cp >> 12));
            u[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
            u[2] = (unsigned char)(0x80 | (cp & 0x3F));
            n = 3;
        } else {
            u[0] = (unsigned char)(0xF0 | (cp >> 18));
            u[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
            u[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
            u[3] = (unsigned char)(0x80 | (cp & 0x3F));
            n = 4;
        }
        bool want = false;
        for (int k = 0; k < 3; k++)
            want |= cp >= r2[k][0] && cp <= r2[k][1];
        if (cp >= 0xD800 && cp <= 0xDFFF)
            want = false;
        if (matches(g, (const char *)u, n) != (int)want)
            fail_msg("U+%04X: want %d", (unsigned)cp, (int)want);
    }
    kvf_text_grammar_destroy(g);
}

/* P = ("(" P ")")* : balanced parentheses, by recursion */
static kvf_text_grammar *parens(void)
{
    kvf_text_gb *b;
    kvf_text_grammar *g;
    kvf_err err = {0};
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    int32_t p = kvf_text_gb_rule(b);
    kvf_text_gx *in[3] = {kvf_text_gx_lit(b, "(", 1), kvf_text_gx_ref(b, p), kvf_text_gx_lit(b, ")", 1)};
    assert_int_equal(kvf_text_gb_define(b, p, kvf_text_gx_rep(b, kvf_text_gx_seq(b, in, 3), 0, -1), &err),
                     KVF_OK);
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_ref(b, p), &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    return g;
}

static void test_recursion_parens(void **state)
{
    (void)state;
    kvf_text_grammar *g = parens();
    assert_int_equal(MATCHES(g, ""), 1);
    assert_int_equal(MATCHES(g, "()"), 1);
    assert_int_equal(MATCHES(g, "(()())()"), 1);
    assert_int_equal(MATCHES(g, "((((((((((()))))))))))"), 1);
    assert_int_equal(MATCHES(g, "(()"), 0);
    assert_int_equal(MATCHES(g, "())"), 0);
    assert_int_equal(MATCHES(g, ")("), 0);
    /* nesting past KVF_TEXT_GRAMMAR_MAX_STACK is an error, not unbounded memory */
    char deep[2 * KVF_TEXT_GRAMMAR_MAX_STACK + 8];
    size_t d = KVF_TEXT_GRAMMAR_MAX_STACK + 2;
    memset(deep, '(', d);
    kvf_text_matcher *m = matcher(g);
    kvf_err err = {0};
    assert_int_equal(kvf_text_matcher_accept_bytes(m, deep, d, &err), KVF_ERR_LIMIT);
    assert_non_null(strstr(err.msg, "rule references"));
    /* no change after the failure: still at the start */
    assert_true(kvf_text_matcher_accepting(m));
    /* a long flat sequence is fine */
    size_t n = 20000;
    char *flat = malloc(n);
    for (size_t i = 0; i < n; i += 2) {
        flat[i] = '(';
        flat[i + 1] = ')';
    }
    assert_int_equal(kvf_text_matcher_accept_bytes(m, flat, n, &err), KVF_OK);
    assert_true(kvf_text_matcher_accepting(m));
    free(flat);
    kvf_text_matcher_destroy(m);
    kvf_text_grammar_destroy(g);
}

static void test_left_recursion_refused(void **state)
{
    (void)state;
    kvf_text_gb *b;
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    /* E = E "+" "1" | "1" */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    int32_t e = kvf_text_gb_rule(b);
    assert_int_equal(kvf_text_gb_rule_name(b, e, "expr"), KVF_OK);
    kvf_text_gx *sum[2] = {kvf_text_gx_ref(b, e), kvf_text_gx_lit(b, "+1", 2)};
    kvf_text_gx *alts[2] = {kvf_text_gx_seq(b, sum, 2), kvf_text_gx_lit(b, "1", 1)};
    assert_int_equal(kvf_text_gb_define(b, e, kvf_text_gx_alt(b, alts, 2), &err), KVF_OK);
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_ref(b, e), &g, &err), KVF_ERR_INVALID);
    assert_null(g);
    assert_non_null(strstr(err.msg, "left-recursive"));
    assert_non_null(strstr(err.msg, "expr"));
    kvf_text_gb_destroy(b);

    /* through a nullable rule: A = N B, B = "x"? A, N = "n"? */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    int32_t a = kvf_text_gb_rule(b), bb = kvf_text_gb_rule(b), nn = kvf_text_gb_rule(b);
    kvf_text_gx *as[2] = {kvf_text_gx_ref(b, nn), kvf_text_gx_ref(b, bb)};
    kvf_text_gx *bs[2] = {kvf_text_gx_rep(b, kvf_text_gx_lit(b, "x", 1), 0, 1), kvf_text_gx_ref(b, a)};
    assert_int_equal(kvf_text_gb_define(b, a, kvf_text_gx_seq(b, as, 2), &err), KVF_OK);
    assert_int_equal(kvf_text_gb_define(b, bb, kvf_text_gx_seq(b, bs, 2), &err), KVF_OK);
    assert_int_equal(kvf_text_gb_define(b, nn, kvf_text_gx_rep(b, kvf_text_gx_lit(b, "n", 1), 0, 1), &err),
                     KVF_OK);
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_ref(b, a), &g, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "left-recursive"));
    kvf_text_gb_destroy(b);

    /* right recursion is fine: L = "x" L | "" */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    int32_t l = kvf_text_gb_rule(b);
    kvf_text_gx *ls[2] = {kvf_text_gx_lit(b, "x", 1), kvf_text_gx_ref(b, l)};
    kvf_text_gx *la[2] = {kvf_text_gx_seq(b, ls, 2), kvf_text_gx_lit(b, "", 0)};
    assert_int_equal(kvf_text_gb_define(b, l, kvf_text_gx_alt(b, la, 2), &err), KVF_OK);
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_ref(b, l), &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    assert_int_equal(MATCHES(g, "xxxx"), 1);
    assert_int_equal(MATCHES(g, ""), 1);
    /* more x than the stack may hold: a bound, reported */
    char xs[KVF_TEXT_GRAMMAR_MAX_STACK + 4];
    memset(xs, 'x', sizeof xs);
    assert_int_equal(matches(g, xs, sizeof xs), -1);
    kvf_text_grammar_destroy(g);
}

static void test_undefined_and_misuse(void **state)
{
    (void)state;
    kvf_text_gb *b;
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    int32_t r = kvf_text_gb_rule(b);
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_ref(b, r), &g, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "never defined"));
    assert_int_equal(kvf_text_gb_define(b, r, kvf_text_gx_lit(b, "a", 1), &err), KVF_OK);
    assert_int_equal(kvf_text_gb_define(b, r, kvf_text_gx_lit(b, "b", 1), &err), KVF_ERR_EXISTS);
    assert_int_equal(kvf_text_gb_define(b, 7, kvf_text_gx_lit(b, "b", 1), &err), KVF_ERR_INVALID);
    /* a reference to a rule never created poisons the builder; finish reports it */
    assert_null(kvf_text_gx_ref(b, 99));
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_lit(b, "a", 1), &g, &err), KVF_ERR_INVALID);
    assert_null(g);
    kvf_text_gb_destroy(b);
    kvf_text_gb_destroy(NULL);
    kvf_text_grammar_destroy(NULL);

    /* a grammar no output can match is refused (the engine could allow no token at all) */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_alt(b, NULL, 0), &g, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "no output can match"));
    kvf_text_gb_destroy(b);
    /* as is a rule that never ends: R = "a" R */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    r = kvf_text_gb_rule(b);
    kvf_text_gx *ar[2] = {kvf_text_gx_lit(b, "a", 1), kvf_text_gx_ref(b, r)};
    assert_int_equal(kvf_text_gb_define(b, r, kvf_text_gx_seq(b, ar, 2), &err), KVF_OK);
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_ref(b, r), &g, &err), KVF_ERR_INVALID);
    kvf_text_gb_destroy(b);
    /* dead branches are pruned: "a" followed by nothing never lets "a" through, so no byte
     * leads into a dead end */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    kvf_text_gx *dead[2] = {kvf_text_gx_lit(b, "a", 1), kvf_text_gx_alt(b, NULL, 0)};
    kvf_text_gx *alts[2] = {kvf_text_gx_seq(b, dead, 2), kvf_text_gx_lit(b, "ab", 2)};
    kvf_text_gx *rest[2] = {kvf_text_gx_lit(b, "x", 1), kvf_text_gx_alt(b, alts, 2)};
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_seq(b, rest, 2), &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    kvf_text_matcher *dm = matcher(g);
    assert_int_equal(kvf_text_matcher_accept_bytes(dm, "xa", 2, &err), KVF_OK);
    uint32_t set[8];
    assert_int_equal(kvf_text_matcher_next_bytes(dm, set, &err), KVF_OK);
    for (int i = 0; i < 8; i++)
        assert_int_equal(set[i], i == 'b' / 32 ? 1u << ('b' % 32) : 0u);
    kvf_text_matcher_destroy(dm);
    assert_int_equal(MATCHES(g, "xab"), 1);
    kvf_text_grammar_destroy(g);
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_seq(b, NULL, 0), &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    assert_int_equal(MATCHES(g, ""), 1);
    kvf_text_matcher *m = matcher(g);
    assert_true(kvf_text_matcher_done(m));
    kvf_text_matcher_destroy(m);
    kvf_text_grammar_destroy(g);
}

static void test_limits(void **state)
{
    (void)state;
    kvf_text_gb *b;
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    /* a{1000}{1000}: a million nodes once expanded */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    kvf_text_gx *a = kvf_text_gx_lit(b, "a", 1);
    kvf_text_gx *x = kvf_text_gx_rep(b, kvf_text_gx_rep(b, a, 1000, 1000), 1000, 1000);
    assert_null(x);
    assert_int_equal(kvf_text_gb_finish(b, x, &g, &err), KVF_ERR_LIMIT);
    assert_non_null(strstr(err.msg, "too large"));
    kvf_text_gb_destroy(b);

    /* a{0,100000}: large but allowed; closures stay small (skips go straight to the end) */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    x = kvf_text_gx_rep(b, kvf_text_gx_lit(b, "a", 1), 0, 100000);
    assert_int_equal(kvf_text_gb_finish(b, x, &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    char *as = malloc(100001);
    memset(as, 'a', 100001);
    assert_int_equal(matches(g, as, 100000), 1);
    assert_int_equal(matches(g, as, 100001), 0);
    free(as);
    kvf_text_grammar_destroy(g);

    /* nesting deeper than the builder takes */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    x = kvf_text_gx_lit(b, "a", 1);
    for (int i = 0; i < 5000 && x; i++) {
        kvf_text_gx *two[2] = {x, kvf_text_gx_lit(b, "b", 1)};
        x = kvf_text_gx_seq(b, two, 2);
    }
    assert_null(x);
    assert_int_equal(kvf_text_gb_finish(b, x, &g, &err), KVF_ERR_LIMIT);
    assert_non_null(strstr(err.msg, "nested"));
    kvf_text_gb_destroy(b);

    /* (a|a)* and ((a|a)(a|a)|aa)*: ambiguous, but a state stays one stack */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    kvf_text_gx *aa[2] = {kvf_text_gx_lit(b, "a", 1), kvf_text_gx_lit(b, "a", 1)};
    kvf_text_gx *alt = kvf_text_gx_alt(b, aa, 2);
    kvf_text_gx *pair[2] = {alt, alt};
    kvf_text_gx *outer[3] = {kvf_text_gx_rep(b, alt, 0, -1), kvf_text_gx_seq(b, pair, 2),
                             kvf_text_gx_lit(b, "aa", 2)};
    x = kvf_text_gx_rep(b, kvf_text_gx_alt(b, outer, 3), 0, -1);
    assert_int_equal(kvf_text_gb_finish(b, x, &g, &err), KVF_OK);
    kvf_text_gb_destroy(b);
    kvf_text_matcher *m = matcher(g);
    char *many = malloc(50000);
    memset(many, 'a', 50000);
    assert_int_equal(kvf_text_matcher_accept_bytes(m, many, 50000, &err), KVF_OK);
    assert_true(kvf_text_matcher_accepting(m));
    free(many);
    kvf_text_matcher_destroy(m);
    kvf_text_grammar_destroy(g);

    /* the same ambiguity through rules: R = ("a" | "a") , root = (R | R)* */
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    int32_t r = kvf_text_gb_rule(b);
    kvf_text_gx *ra[2] = {kvf_text_gx_lit(b, "a", 1), kvf_text_gx_lit(b, "a", 1)};
    kvf_text_gb_define(b, r, kvf_text_gx_alt(b, ra, 2), &err);
    kvf_text_gx *rr[2] = {kvf_text_gx_ref(b, r), kvf_text_gx_ref(b, r)};
    assert_int_equal(kvf_text_gb_finish(b, kvf_text_gx_rep(b, kvf_text_gx_alt(b, rr, 2), 0, -1), &g, &err),
                     KVF_OK);
    kvf_text_gb_destroy(b);
    assert_int_equal(matches(g, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 40), 1);
    kvf_text_grammar_destroy(g);
}

static void test_json_like(void **state)
{
    (void)state;
    kvf_text_grammar *g = json_grammar();
    assert_int_equal(MATCHES(g, "{}"), 1);
    assert_int_equal(MATCHES(g, "{\"a\": 1, \"b\": [true, null, {\"c\": \"x\\\"y\\u00e9\"}], \"d\": -0.5}"), 1);
    assert_int_equal(MATCHES(g, "{ \"k\" :\n[ ] }"), 1);
    assert_int_equal(MATCHES(g, "{\"a\": 01}"), 0);
    assert_int_equal(MATCHES(g, "{\"a\": \"\x01\"}"), 0);
    assert_int_equal(MATCHES(g, "{\"a\":    1}"), 0); /* whitespace is bounded */
    assert_int_equal(MATCHES(g, "{\"a\": [1,]}"), 0);
    assert_int_equal(MATCHES(g, "[1]"), 0);
    assert_int_equal(MATCHES(g, "{\"a\": \"\xc3\xa9\xe2\x82\xac\"}"), 1);
    kvf_text_grammar_destroy(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_literal_alt_rep),
        cmocka_unit_test(test_done_and_choice),
        cmocka_unit_test(test_many_choices),
        cmocka_unit_test(test_chars_utf8),
        cmocka_unit_test(test_recursion_parens),
        cmocka_unit_test(test_left_recursion_refused),
        cmocka_unit_test(test_undefined_and_misuse),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_json_like),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
