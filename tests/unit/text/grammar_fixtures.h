/* grammar_fixtures.h: grammars the grammar tests share, built by hand with the builder API the
 * schema compiler uses. Include after cmocka's headers. */
#ifndef KVF_TEST_GRAMMAR_FIXTURES_H
#define KVF_TEST_GRAMMAR_FIXTURES_H

#include "text/grammar.h"

/* A JSON-like grammar by hand (objects, arrays, strings with escapes, numbers, literals, bounded
 * whitespace), as the schema compiler will make. */
static inline kvf_text_grammar *json_grammar(void)
{
    kvf_text_gb *b;
    kvf_text_grammar *g;
    kvf_err err = {0};
    assert_int_equal(kvf_text_gb_create(&b, &err), KVF_OK);
    int32_t value = kvf_text_gb_rule(b), str = kvf_text_gb_rule(b);
    kvf_text_gx *ws_c[2] = {kvf_text_gx_lit(b, " ", 1), kvf_text_gx_lit(b, "\n", 1)};
    kvf_text_gx *ws = kvf_text_gx_rep(b, kvf_text_gx_alt(b, ws_c, 2), 0, 2);
    /* string */
    const uint32_t plain[3][2] = {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}};
    kvf_text_gx *hex = kvf_text_gx_chars(b, (const uint32_t[][2]){{'0', '9'}, {'a', 'f'}, {'A', 'F'}}, 3, false);
    kvf_text_gx *u4[2] = {kvf_text_gx_lit(b, "u", 1), kvf_text_gx_rep(b, hex, 4, 4)};
    kvf_text_gx *esc_c[2] = {kvf_text_gx_chars(b, (const uint32_t[][2]){{'"', '"'}, {'\\', '\\'}, {'/', '/'}, {'b', 'b'}, {'f', 'f'}, {'n', 'n'}, {'r', 'r'}, {'t', 't'}}, 8, false),
                             kvf_text_gx_seq(b, u4, 2)};
    kvf_text_gx *esc[2] = {kvf_text_gx_lit(b, "\\", 1), kvf_text_gx_alt(b, esc_c, 2)};
    kvf_text_gx *ch[2] = {kvf_text_gx_chars(b, plain, 3, true), kvf_text_gx_seq(b, esc, 2)};
    kvf_text_gx *s[3] = {kvf_text_gx_lit(b, "\"", 1), kvf_text_gx_rep(b, kvf_text_gx_alt(b, ch, 2), 0, -1),
                         kvf_text_gx_lit(b, "\"", 1)};
    kvf_text_gb_define(b, str, kvf_text_gx_seq(b, s, 3), &err);
    /* number: -?(0|[1-9][0-9]*)(\.[0-9]+)? */
    kvf_text_gx *digits = kvf_text_gx_rep(b, kvf_text_gx_bytes(b, '0', '9'), 1, -1);
    kvf_text_gx *nz[2] = {kvf_text_gx_bytes(b, '1', '9'), kvf_text_gx_rep(b, kvf_text_gx_bytes(b, '0', '9'), 0, -1)};
    kvf_text_gx *intp[2] = {kvf_text_gx_lit(b, "0", 1), kvf_text_gx_seq(b, nz, 2)};
    kvf_text_gx *frac[2] = {kvf_text_gx_lit(b, ".", 1), digits};
    kvf_text_gx *num[3] = {kvf_text_gx_rep(b, kvf_text_gx_lit(b, "-", 1), 0, 1), kvf_text_gx_alt(b, intp, 2),
                           kvf_text_gx_rep(b, kvf_text_gx_seq(b, frac, 2), 0, 1)};
    /* object: { ws (str ws : ws value ws (, ws str ws : ws value ws)*)? } */
    kvf_text_gx *member[7] = {kvf_text_gx_ref(b, str), ws, kvf_text_gx_lit(b, ":", 1), ws,
                              kvf_text_gx_ref(b, value), ws};
    kvf_text_gx *mem = kvf_text_gx_seq(b, member, 6);
    kvf_text_gx *more_m[3] = {kvf_text_gx_lit(b, ",", 1), ws, mem};
    kvf_text_gx *members[2] = {mem, kvf_text_gx_rep(b, kvf_text_gx_seq(b, more_m, 3), 0, -1)};
    kvf_text_gx *obj[4] = {kvf_text_gx_lit(b, "{", 1), ws,
                           kvf_text_gx_rep(b, kvf_text_gx_seq(b, members, 2), 0, 1), kvf_text_gx_lit(b, "}", 1)};
    kvf_text_gx *elem[2] = {kvf_text_gx_ref(b, value), ws};
    kvf_text_gx *el = kvf_text_gx_seq(b, elem, 2);
    kvf_text_gx *more_e[3] = {kvf_text_gx_lit(b, ",", 1), ws, el};
    kvf_text_gx *elems[2] = {el, kvf_text_gx_rep(b, kvf_text_gx_seq(b, more_e, 3), 0, -1)};
    kvf_text_gx *arr[4] = {kvf_text_gx_lit(b, "[", 1), ws,
                           kvf_text_gx_rep(b, kvf_text_gx_seq(b, elems, 2), 0, 1), kvf_text_gx_lit(b, "]", 1)};
    kvf_text_gx *vals[7] = {kvf_text_gx_seq(b, obj, 4), kvf_text_gx_seq(b, arr, 4), kvf_text_gx_ref(b, str),
                            kvf_text_gx_seq(b, num, 3), kvf_text_gx_lit(b, "true", 4),
                            kvf_text_gx_lit(b, "false", 5), kvf_text_gx_lit(b, "null", 4)};
    assert_int_equal(kvf_text_gb_define(b, value, kvf_text_gx_alt(b, vals, 7), &err), KVF_OK);
    kvf_status st = kvf_text_gb_finish(b, kvf_text_gx_seq(b, obj, 4), &g, &err);
    if (st != KVF_OK)
        fail_msg("json grammar: %s", err.msg);
    kvf_text_gb_destroy(b);
    return g;
}

#endif
