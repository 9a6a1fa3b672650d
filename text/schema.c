/* schema.c: the JSON Schema compiler of constrained decoding (issue 24): a schema (JSON text)
 * becomes a grammar through the builder of text/grammar.h, and "any JSON object" for
 * response_format json_object. The automaton, masks and the regex compiler are grammar.c's and
 * regex.c's; this file only decides which JSON texts a schema admits.
 *
 * Choices where JSON Schema says more than a grammar can, or says nothing (the output is always
 * a subset of what the schema admits, so every document validates; what is lost is breadth):
 * - whitespace between tokens: nothing, one " ", or "\n" and up to 20 spaces or tabs; none
 *   before the value or after it.
 * - objects: properties in the schema's order; required ones always, optional ones may be left
 *   out. additionalProperties absent means false when "properties" lists any (xgrammar's strict
 *   mode, what vLLM uses and OpenAI's strict schemas require) and true when it lists none (a
 *   bare {"type": "object"} is a free-form object). Extra properties (true or a schema) come
 *   after the listed ones, any number of them, with keys of 1 to 64 unescaped characters that
 *   are none of the listed or required names (so a key never repeats, and a model cannot spend
 *   its budget on one key). At most 256 optional properties in a row (each that may come next
 *   is a live automaton stack); longer runs are refused by name at compile time.
 * - arrays: "items" absent means any values when there is no "prefixItems", and no items past
 *   them when there is (strict mode again). "items" given as an array is "prefixItems".
 * - integers: minimum / maximum / exclusive* are exact (decimal range grammars); bounds beyond
 *   +-10^17 are pulled in to +-10^17. numbers: bounds are rounded inward to integers (a
 *   fraction is allowed between them, and only zeros after the upper bound's integer), and a
 *   bounded number has no exponent; unbounded numbers have exponents of at most 2 digits (so
 *   the value is finite in every parser).
 * - strings: minLength / maxLength count characters, an escape as one; \u escapes name no
 *   surrogates (JSON's UTF-16 pairs would count twice here and once in validators). "pattern" is
 *   matched against the whole content (as vLLM and xgrammar do; a full match is also a match
 *   in JSON Schema's unanchored sense), and is rewritten so that the characters JSON must escape
 *   (" \ and controls) appear escaped in the output. pattern, format and lengths exclude each
 *   other (their intersection is not a grammar). date excludes February 29; time and date-time
 *   need a time zone (RFC 3339, as ajv-formats checks).
 * - enum / const: each value serialized compactly (jansson), filtered by "type" when given.
 * - oneOf is anyOf (overlapping branches may admit a document that matches two); allOf only of
 *   one schema; anyOf/oneOf/allOf/$ref beside constraining keywords are refused. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/grammar.h"

#define SC_PATH_MAX 512            /* JSON pointer shown in errors; longer ones are cut */
#define SC_LIT_BUDGET (1u << 20)   /* bytes of enum/const/key literals in one schema */
#define SC_OBJ_MAX_OPTIONAL_RUN 256 /* optional properties in a row (see sc_object) */
#define SC_OBJ_BLOCK 16            /* members per shared block of an object's rest */
#define SC_KEY_MAX 64              /* characters of an extra property's key */
#define SC_INT_CAP 100000000000000000LL /* 10^17: integer bounds pulled in to +-this */

typedef struct sc_ref {
    const json_t *target;
    int32_t rule;
} sc_ref;

typedef struct sc {
    kvf_text_gb *b;
    const json_t *root;
    kvf_err *err;
    kvf_status st; /* first error of ours (the builder keeps its own) */
    char path[SC_PATH_MAX];
    size_t path_len;
    sc_ref *refs;
    size_t n_refs, cap_refs;
    size_t lit_bytes;
    /* shared rules, made on first use (-1 until then) */
    int32_t r_ws, r_char, r_value, r_object, r_array, r_string, r_number, r_key_char;
    int32_t r_key_rest[SC_KEY_MAX]; /* [k]: up to k more key characters and the quote; 0: none yet */
} sc;

/* ---- errors and the JSON pointer of the schema being compiled ---- */

static kvf_text_gx *sc_fail(sc *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static kvf_text_gx *sc_fail(sc *c, const char *fmt, ...)
{
    if (c->st != KVF_OK)
        return NULL;
    char msg[KVF_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->st = kvf_err_set(c->err, KVF_ERR_INVALID, "json schema: %s at %s", msg,
                        c->path_len ? c->path : "/");
    return NULL;
}

/* Appends "/seg" (escaped as RFC 6901 says) and returns the length to restore. */
static size_t sc_push(sc *c, const char *seg)
{
    size_t old = c->path_len, n = old;
    if (n + 1 < SC_PATH_MAX)
        c->path[n++] = '/';
    for (const char *p = seg; *p && n + 2 < SC_PATH_MAX; p++) {
        if (*p == '~' || *p == '/') {
            c->path[n++] = '~';
            c->path[n++] = *p == '~' ? '0' : '1';
        } else {
            c->path[n++] = *p;
        }
    }
    if (n + 4 >= SC_PATH_MAX && n >= 3)
        memcpy(c->path + SC_PATH_MAX - 5, "...", 3), n = SC_PATH_MAX - 2;
    c->path[n] = 0;
    c->path_len = n;
    return old;
}

static size_t sc_push_idx(sc *c, size_t i)
{
    char s[24];
    snprintf(s, sizeof s, "%zu", i);
    return sc_push(c, s);
}

static void sc_pop(sc *c, size_t old)
{
    c->path_len = old;
    c->path[old] = 0;
}

/* ---- small expression helpers ---- */

static kvf_text_gx *lit(sc *c, const char *s) { return kvf_text_gx_lit(c->b, s, strlen(s)); }

static kvf_text_gx *seq2(sc *c, kvf_text_gx *a, kvf_text_gx *b)
{
    kvf_text_gx *xs[2] = {a, b};
    return kvf_text_gx_seq(c->b, xs, 2);
}

static kvf_text_gx *seq3(sc *c, kvf_text_gx *a, kvf_text_gx *b, kvf_text_gx *d)
{
    kvf_text_gx *xs[3] = {a, b, d};
    return kvf_text_gx_seq(c->b, xs, 3);
}

static kvf_text_gx *alt2(sc *c, kvf_text_gx *a, kvf_text_gx *b)
{
    kvf_text_gx *xs[2] = {a, b};
    return kvf_text_gx_alt(c->b, xs, 2);
}

static kvf_text_gx *opt(sc *c, kvf_text_gx *x) { return kvf_text_gx_rep(c->b, x, 0, 1); }

static kvf_text_gx *digit(sc *c) { return kvf_text_gx_bytes(c->b, '0', '9'); }

/* A growable list of alternatives (anyOf branches, enum values, type branches). */
typedef struct sc_alts {
    kvf_text_gx **xs;
    size_t n, cap;
} sc_alts;

static void alts_add(sc *c, sc_alts *a, kvf_text_gx *x)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 8;
        kvf_text_gx **xs = realloc(a->xs, cap * sizeof *xs);
        if (!xs) {
            if (c->st == KVF_OK)
                c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
            return;
        }
        a->xs = xs, a->cap = cap;
    }
    a->xs[a->n++] = x;
}

static kvf_text_gx *alts_done(sc *c, sc_alts *a)
{
    kvf_text_gx *x = a->n == 1 ? a->xs[0] : kvf_text_gx_alt(c->b, a->xs, a->n);
    free(a->xs);
    a->xs = NULL, a->n = a->cap = 0;
    return x;
}

/* A rule defined now with body x (a shared piece referred to from many places costs one node
 * each, whatever the builder does with shared expressions). */
static int32_t sc_rule_of(sc *c, kvf_text_gx *x)
{
    int32_t r = kvf_text_gb_rule(c->b);
    if (r < 0)
        return r;
    kvf_err e;
    if (kvf_text_gb_define(c->b, r, x, &e) != KVF_OK && c->st == KVF_OK)
        c->st = kvf_err_set(c->err, e.status, "json schema: %s", e.msg);
    return r;
}

static kvf_text_gx *sc_ref_rule(sc *c, int32_t r) { return r < 0 ? NULL : kvf_text_gx_ref(c->b, r); }

/* ---- the pieces of JSON ---- */

/* Whitespace between tokens: nothing, one space, or a newline and up to 20 spaces or tabs. */
static kvf_text_gx *ws(sc *c)
{
    if (c->r_ws < 0) {
        kvf_text_gx *indent = kvf_text_gx_rep(c->b, alt2(c, lit(c, " "), lit(c, "\t")), 0, 20);
        kvf_text_gx *xs[3] = {lit(c, ""), lit(c, " "), seq2(c, lit(c, "\n"), indent)};
        c->r_ws = sc_rule_of(c, kvf_text_gx_alt(c->b, xs, 3));
    }
    return sc_ref_rule(c, c->r_ws);
}

static kvf_text_gx *hex(sc *c)
{
    kvf_text_gx *xs[3] = {digit(c), kvf_text_gx_bytes(c->b, 'a', 'f'),
                          kvf_text_gx_bytes(c->b, 'A', 'F')};
    return kvf_text_gx_alt(c->b, xs, 3);
}

/* One character of a JSON string's content: any but " \ and controls, or an escape. A \u
 * escape names no surrogate, so each escape is one character for every validator. */
static kvf_text_gx *str_char(sc *c)
{
    if (c->r_char < 0) {
        static const uint32_t bad[3][2] = {{0, 0x1f}, {'"', '"'}, {'\\', '\\'}};
        kvf_text_gx *h = hex(c);
        kvf_text_gx *first_ok[4] = {digit(c), kvf_text_gx_bytes(c->b, 'a', 'c'),
                                    kvf_text_gx_bytes(c->b, 'A', 'C'),
                                    alt2(c, kvf_text_gx_bytes(c->b, 'e', 'f'),
                                         kvf_text_gx_bytes(c->b, 'E', 'F'))};
        kvf_text_gx *xs4[4] = {kvf_text_gx_alt(c->b, first_ok, 4), h, h, h};
        kvf_text_gx *ys4[4] = {alt2(c, lit(c, "d"), lit(c, "D")), kvf_text_gx_bytes(c->b, '0', '7'),
                               h, h};
        kvf_text_gx *u = seq2(c, lit(c, "u"), alt2(c, kvf_text_gx_seq(c->b, xs4, 4),
                                                   kvf_text_gx_seq(c->b, ys4, 4)));
        static const char *const short_esc[] = {"\"", "\\", "/", "b", "f", "n", "r", "t"};
        sc_alts esc = {0};
        for (size_t i = 0; i < 8; i++)
            alts_add(c, &esc, lit(c, short_esc[i]));
        alts_add(c, &esc, u);
        kvf_text_gx *escape = seq2(c, lit(c, "\\"), alts_done(c, &esc));
        c->r_char = sc_rule_of(c, alt2(c, kvf_text_gx_chars(c->b, bad, 3, true), escape));
    }
    return sc_ref_rule(c, c->r_char);
}

static kvf_text_gx *any_string(sc *c)
{
    if (c->r_string < 0)
        c->r_string = sc_rule_of(
            c, seq3(c, lit(c, "\""), kvf_text_gx_rep(c->b, str_char(c), 0, -1), lit(c, "\"")));
    return sc_ref_rule(c, c->r_string);
}

static kvf_text_gx *uint_any(sc *c) /* 0 or [1-9][0-9]* */
{
    return alt2(c, lit(c, "0"),
                seq2(c, kvf_text_gx_bytes(c->b, '1', '9'), kvf_text_gx_rep(c->b, digit(c), 0, -1)));
}

static kvf_text_gx *any_number(sc *c)
{
    if (c->r_number < 0) {
        kvf_text_gx *frac = opt(c, seq2(c, lit(c, "."), kvf_text_gx_rep(c->b, digit(c), 1, -1)));
        kvf_text_gx *sign = opt(c, alt2(c, lit(c, "+"), lit(c, "-")));
        kvf_text_gx *exp = opt(c, seq3(c, alt2(c, lit(c, "e"), lit(c, "E")), sign,
                                       kvf_text_gx_rep(c->b, digit(c), 1, 2)));
        kvf_text_gx *xs[4] = {opt(c, lit(c, "-")), uint_any(c), frac, exp};
        c->r_number = sc_rule_of(c, kvf_text_gx_seq(c->b, xs, 4));
    }
    return sc_ref_rule(c, c->r_number);
}

/* "{" ws "}" or "{" ws m (ws "," ws m)* ws "}" with m = string ws ":" ws value; the same shape
 * for arrays. */
static kvf_text_gx *list_of(sc *c, const char *open, kvf_text_gx *item, const char *close)
{
    kvf_text_gx *more = kvf_text_gx_rep(c->b, seq3(c, ws(c), seq2(c, lit(c, ","), ws(c)), item),
                                        0, -1);
    /* "{" ws [item more ws] "}": one ws between tokens, also when the list is empty */
    kvf_text_gx *inner = opt(c, seq3(c, item, more, ws(c)));
    return seq3(c, lit(c, open), seq2(c, ws(c), inner), lit(c, close));
}

static void any_value_rules(sc *c)
{
    if (c->r_value >= 0)
        return;
    c->r_value = kvf_text_gb_rule(c->b);
    c->r_object = kvf_text_gb_rule(c->b);
    c->r_array = kvf_text_gb_rule(c->b);
    if (c->r_value < 0 || c->r_object < 0 || c->r_array < 0)
        return;
    kvf_text_gx *value = kvf_text_gx_ref(c->b, c->r_value);
    kvf_text_gx *member = seq3(c, any_string(c), seq3(c, ws(c), lit(c, ":"), ws(c)), value);
    kvf_err e;
    kvf_status st = kvf_text_gb_define(c->b, c->r_object, list_of(c, "{", member, "}"), &e);
    if (st == KVF_OK)
        st = kvf_text_gb_define(c->b, c->r_array, list_of(c, "[", value, "]"), &e);
    kvf_text_gx *xs[7] = {kvf_text_gx_ref(c->b, c->r_object), kvf_text_gx_ref(c->b, c->r_array),
                          any_string(c), any_number(c), lit(c, "true"), lit(c, "false"),
                          lit(c, "null")};
    if (st == KVF_OK)
        st = kvf_text_gb_define(c->b, c->r_value, kvf_text_gx_alt(c->b, xs, 7), &e);
    if (st != KVF_OK && c->st == KVF_OK)
        c->st = kvf_err_set(c->err, e.status, "json schema: %s", e.msg);
}

static kvf_text_gx *any_value(sc *c)
{
    any_value_rules(c);
    return sc_ref_rule(c, c->r_value);
}

/* ---- integers: decimal range grammars ---- */

static int64_t pow10i(int k)
{
    int64_t p = 1;
    while (k-- > 0)
        p *= 10;
    return p;
}

static int ndigits(int64_t v)
{
    int k = 1;
    while (v >= 10)
        v /= 10, k++;
    return k;
}

/* Every w-digit string (leading zeros allowed) whose value lies in [lo, hi], 0 <= lo <= hi <
 * 10^w: the first digit fixed at each end and free between, recursing only along the two ends,
 * so the expression has O(w^2) nodes. */
static kvf_text_gx *range_w(sc *c, int64_t lo, int64_t hi, int w)
{
    if (w == 0)
        return lit(c, "");
    int64_t p = pow10i(w - 1);
    int dl = (int)(lo / p), dh = (int)(hi / p);
    int64_t rl = lo % p, rh = hi % p;
    if (dl == dh)
        return seq2(c, kvf_text_gx_bytes(c->b, (uint8_t)('0' + dl), (uint8_t)('0' + dl)),
                    range_w(c, rl, rh, w - 1));
    sc_alts a = {0};
    int full_lo = dl, full_hi = dh;
    if (rl != 0) {
        alts_add(c, &a, seq2(c, kvf_text_gx_bytes(c->b, (uint8_t)('0' + dl), (uint8_t)('0' + dl)),
                             range_w(c, rl, p - 1, w - 1)));
        full_lo = dl + 1;
    }
    if (rh != p - 1) {
        alts_add(c, &a, seq2(c, kvf_text_gx_bytes(c->b, (uint8_t)('0' + dh), (uint8_t)('0' + dh)),
                             range_w(c, 0, rh, w - 1)));
        full_hi = dh - 1;
    }
    if (full_lo <= full_hi)
        alts_add(c, &a, seq2(c, kvf_text_gx_bytes(c->b, (uint8_t)('0' + full_lo),
                                                  (uint8_t)('0' + full_hi)),
                             kvf_text_gx_rep(c->b, digit(c), w - 1, w - 1)));
    return alts_done(c, &a);
}

/* Canonical decimals (no leading zeros) of [lo, hi], 0 <= lo <= hi < 10^18; hi < 0: no upper
 * bound. */
static kvf_text_gx *uint_range(sc *c, int64_t lo, int64_t hi)
{
    sc_alts a = {0};
    int kmax = hi < 0 ? ndigits(lo) : ndigits(hi);
    for (int k = ndigits(lo); k <= kmax; k++) {
        int64_t klo = k == 1 ? 0 : pow10i(k - 1), khi = pow10i(k) - 1;
        int64_t l = lo > klo ? lo : klo, h = hi >= 0 && hi < khi ? hi : khi;
        if (l <= h)
            alts_add(c, &a, range_w(c, l, h, k));
    }
    if (hi < 0) /* and every number of more digits */
        alts_add(c, &a, seq2(c, kvf_text_gx_bytes(c->b, '1', '9'),
                             kvf_text_gx_rep(c->b, digit(c), kmax, -1)));
    return alts_done(c, &a);
}

/* Bounds read from a schema: has_lo/lo, has_hi/hi, already made inclusive integers. */
typedef struct sc_bounds {
    bool has_lo, has_hi;
    int64_t lo, hi;
} sc_bounds;

/* Integers in the bounds, exactly (the negative part written "-" m with m >= 1: no "-0"). */
static kvf_text_gx *int_in(sc *c, sc_bounds bd)
{
    if (!bd.has_lo && !bd.has_hi)
        return seq2(c, opt(c, lit(c, "-")), uint_any(c));
    sc_alts a = {0};
    if (!bd.has_hi || bd.hi >= 0) /* x >= 0 */
        alts_add(c, &a, uint_range(c, bd.has_lo && bd.lo > 0 ? bd.lo : 0, bd.has_hi ? bd.hi : -1));
    if (!bd.has_lo || bd.lo < 0) { /* x = -m, m >= max(1, -hi), m <= -lo */
        int64_t mlo = bd.has_hi && bd.hi < -1 ? -bd.hi : 1;
        alts_add(c, &a, seq2(c, lit(c, "-"), uint_range(c, mlo, bd.has_lo ? -bd.lo : -1)));
    }
    return alts_done(c, &a);
}

/* Non-negative magnitudes m in [lo, hi] (hi < 0: none) written with an optional fraction:
 * integer part in [lo, hi-1] with any fraction, or hi itself with only zeros after the point. */
static kvf_text_gx *mag_in(sc *c, int64_t lo, int64_t hi)
{
    kvf_text_gx *frac = opt(c, seq2(c, lit(c, "."), kvf_text_gx_rep(c->b, digit(c), 1, -1)));
    kvf_text_gx *zeros = opt(c, seq2(c, lit(c, "."), kvf_text_gx_rep(c->b, lit(c, "0"), 1, -1)));
    if (hi < 0)
        return seq2(c, uint_range(c, lo, -1), frac);
    if (hi == lo)
        return seq2(c, uint_range(c, hi, hi), zeros);
    return alt2(c, seq2(c, uint_range(c, lo, hi - 1), frac), seq2(c, uint_range(c, hi, hi), zeros));
}

static kvf_text_gx *num_in(sc *c, sc_bounds bd)
{
    if (!bd.has_lo && !bd.has_hi)
        return any_number(c);
    sc_alts a = {0};
    if (!bd.has_hi || bd.hi >= 0)
        alts_add(c, &a, mag_in(c, bd.has_lo && bd.lo > 0 ? bd.lo : 0, bd.has_hi ? bd.hi : -1));
    if (!bd.has_lo || bd.lo < 0)
        alts_add(c, &a, seq2(c, lit(c, "-"),
                             mag_in(c, bd.has_hi && bd.hi < 0 ? -bd.hi : 0,
                                    bd.has_lo ? -bd.lo : -1)));
    return alts_done(c, &a);
}

/* Reads minimum/maximum/exclusive* into inclusive integer bounds, rounded inward. */
static bool sc_read_bounds(sc *c, const json_t *s, sc_bounds *bd)
{
    memset(bd, 0, sizeof *bd);
    static const char *const keys[4] = {"minimum", "exclusiveMinimum", "maximum",
                                        "exclusiveMaximum"};
    for (int i = 0; i < 4; i++) {
        const json_t *v = json_object_get(s, keys[i]);
        if (!v)
            continue;
        bool lower = i < 2, excl = i == 1 || i == 3;
        if (json_is_boolean(v)) { /* draft 4: a flag on minimum/maximum */
            if (!excl) {
                sc_fail(c, "\"%s\" must be a number", keys[i]);
                return false;
            }
            continue;
        }
        if (!json_is_number(v)) {
            sc_fail(c, "\"%s\" must be a number, not %s", keys[i],
                    json_is_string(v) ? "a string" : "another kind of value");
            return false;
        }
        if (!excl) { /* draft 4's boolean exclusive flag applies to this bound */
            const json_t *f = json_object_get(s, lower ? "exclusiveMinimum" : "exclusiveMaximum");
            excl = json_is_true(f);
        }
        double d = json_number_value(v);
        if (!isfinite(d)) {
            sc_fail(c, "\"%s\" is not finite", keys[i]);
            return false;
        }
        /* inclusive integer bound, inward */
        double r;
        if (json_is_integer(v)) {
            json_int_t iv = json_integer_value(v);
            if (iv > SC_INT_CAP)
                r = (double)SC_INT_CAP * 10;
            else if (iv < -SC_INT_CAP)
                r = -(double)SC_INT_CAP * 10;
            else
                r = (double)(iv + (excl ? (lower ? 1 : -1) : 0));
        } else if (lower) {
            r = excl ? floor(d) + 1 : ceil(d);
        } else {
            r = excl ? ceil(d) - 1 : floor(d);
        }
        int64_t iv;
        if (r > (double)SC_INT_CAP) {
            if (lower) {
                sc_fail(c, "\"%s\" %g is beyond what a grammar here expresses (|bound| <= 1e17)",
                        keys[i], d);
                return false;
            }
            iv = SC_INT_CAP; /* inward */
        } else if (r < -(double)SC_INT_CAP) {
            if (!lower) {
                sc_fail(c, "\"%s\" %g is beyond what a grammar here expresses (|bound| <= 1e17)",
                        keys[i], d);
                return false;
            }
            iv = -SC_INT_CAP;
        } else {
            iv = (int64_t)r;
        }
        if (lower) {
            if (!bd->has_lo || iv > bd->lo)
                bd->lo = iv;
            bd->has_lo = true;
        } else {
            if (!bd->has_hi || iv < bd->hi)
                bd->hi = iv;
            bd->has_hi = true;
        }
    }
    if (bd->has_lo && bd->has_hi && bd->lo > bd->hi) {
        sc_fail(c, "no integer lies between the minimum and the maximum (a grammar here takes "
                   "number bounds as integers, rounded inward)");
        return false;
    }
    return true;
}

/* ---- strings ---- */

/* One character set of the pattern, as regex text that matches its members as they appear in
 * JSON: the safe ones in a class, each of " \ and the controls by its JSON escape. */
typedef struct sc_cset {
    uint32_t (*r)[2];
    size_t n, cap;
} sc_cset;

static bool cset_add(sc_cset *s, uint32_t lo, uint32_t hi)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 8;
        uint32_t(*r)[2] = realloc(s->r, cap * sizeof *r);
        if (!r)
            return false;
        s->r = r, s->cap = cap;
    }
    s->r[s->n][0] = lo, s->r[s->n][1] = hi;
    s->n++;
    return true;
}

static int cmp_range(const void *a, const void *b)
{
    uint32_t x = ((const uint32_t *)a)[0], y = ((const uint32_t *)b)[0];
    return x < y ? -1 : x > y;
}

static bool cset_has(const sc_cset *s, uint32_t cp)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->r[i][0] <= cp && cp <= s->r[i][1])
            return true;
    return false;
}

/* A growable text buffer for the rewritten pattern. */
typedef struct sc_buf {
    char *p;
    size_t n, cap;
    bool oom;
} sc_buf;

static void buf_add(sc_buf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void buf_str(sc_buf *b, const char *s) { buf_add(b, s, strlen(s)); }

/* Emits "(?:[safe members]|\\"|\\\\|\\n|...)" for the set (negated: its complement). */
static void cset_emit(sc_buf *out, sc_cset *s, bool negate)
{
    qsort(s->r, s->n, sizeof *s->r, cmp_range);
    /* the members, as sorted disjoint ranges */
    sc_cset m = {0};
    uint32_t next = 0; /* for the complement */
    for (size_t i = 0; i < s->n; i++) {
        uint32_t lo = s->r[i][0], hi = s->r[i][1];
        if (!negate) {
            if (m.n && lo <= m.r[m.n - 1][1] + 1) {
                if (hi > m.r[m.n - 1][1])
                    m.r[m.n - 1][1] = hi;
            } else if (!cset_add(&m, lo, hi)) {
                out->oom = true;
            }
        } else {
            if (lo > next && !cset_add(&m, next, lo - 1))
                out->oom = true;
            if (hi + 1 > next)
                next = hi + 1;
        }
    }
    if (negate && next <= 0x10FFFF && !cset_add(&m, next, 0x10FFFF))
        out->oom = true;
    buf_str(out, "(?:");
    bool first = true;
    /* safe members: minus 0..1f, '"', '\\' */
    sc_buf cls = {0};
    for (size_t i = 0; i < m.n; i++) {
        uint32_t lo = m.r[i][0], hi = m.r[i][1];
        static const uint32_t cuts[3][2] = {{0, 0x1f}, {'"', '"'}, {'\\', '\\'}};
        /* split [lo, hi] around the cuts */
        uint32_t a = lo;
        for (int k = 0; k < 3 && a <= hi; k++) {
            if (cuts[k][1] < a)
                continue;
            if (cuts[k][0] > hi)
                break;
            if (cuts[k][0] > a) {
                char t[48];
                snprintf(t, sizeof t, "\\u{%X}-\\u{%X}", a, cuts[k][0] - 1);
                buf_str(&cls, t);
            }
            a = cuts[k][1] + 1;
        }
        if (a <= hi) {
            char t[48];
            snprintf(t, sizeof t, "\\u{%X}-\\u{%X}", a, hi);
            buf_str(&cls, t);
        }
    }
    if (cls.n) {
        buf_str(out, "[");
        buf_add(out, cls.p, cls.n);
        buf_str(out, "]");
        first = false;
    }
    out->oom |= cls.oom;
    free(cls.p);
    /* the members JSON escapes */
    for (uint32_t cp = 0; cp < 0x60; cp++) {
        if (!(cp < 0x20 || cp == '"' || cp == '\\') || !cset_has(&m, cp))
            continue;
        char t[16];
        switch (cp) {
        case '"': snprintf(t, sizeof t, "\\\\\""); break;
        case '\\': snprintf(t, sizeof t, "\\\\\\\\"); break;
        case '\b': snprintf(t, sizeof t, "\\\\b"); break;
        case '\f': snprintf(t, sizeof t, "\\\\f"); break;
        case '\n': snprintf(t, sizeof t, "\\\\n"); break;
        case '\r': snprintf(t, sizeof t, "\\\\r"); break;
        case '\t': snprintf(t, sizeof t, "\\\\t"); break;
        default: snprintf(t, sizeof t, "\\\\u00%02x", cp); break;
        }
        if (!first)
            buf_str(out, "|");
        buf_str(out, t);
        first = false;
    }
    if (first) /* an empty set: a class nothing matches */
        buf_str(out, "[^\\u{0}-\\u{10FFFF}]");
    buf_str(out, ")");
    free(m.r);
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

/* Decodes one UTF-8 character at p (n bytes left); returns its length (1 for a bad byte). */
static size_t utf8_dec(const char *p, size_t n, uint32_t *cp)
{
    const uint8_t *u = (const uint8_t *)p;
    size_t len = u[0] < 0x80 ? 1 : u[0] >= 0xF0 ? 4 : u[0] >= 0xE0 ? 3 : u[0] >= 0xC0 ? 2 : 1;
    if (len > n)
        len = 1;
    uint32_t v = len == 1 ? u[0] : u[0] & (0x3F >> (len - 1));
    for (size_t i = 1; i < len; i++)
        v = (v << 6) | (u[i] & 0x3F);
    *cp = v;
    return len;
}

/* The set one escape names (\d \w \s and negations, or one character); *i past it. Returns false
 * for an escape that is not a character set (left to the regex compiler as written). */
static bool esc_set(const char *re, size_t len, size_t *i, bool in_class, sc_cset *s, bool *neg,
                    bool *oom)
{
    size_t j = *i + 1; /* past the backslash */
    if (j >= len)
        return false;
    char e = re[j];
    uint32_t cp;
    *neg = false;
    switch (e) {
    case 'd': case 'D':
        *oom |= !cset_add(s, '0', '9');
        *neg = e == 'D';
        *i = j + 1;
        return true;
    case 'w': case 'W':
        *oom |= !cset_add(s, '0', '9') || !cset_add(s, 'A', 'Z') || !cset_add(s, 'a', 'z') ||
                !cset_add(s, '_', '_');
        *neg = e == 'W';
        *i = j + 1;
        return true;
    case 's': case 'S':
        *oom |= !cset_add(s, '\t', '\r') || !cset_add(s, ' ', ' ');
        *neg = e == 'S';
        *i = j + 1;
        return true;
    case 'n': cp = '\n'; break;
    case 't': cp = '\t'; break;
    case 'r': cp = '\r'; break;
    case 'f': cp = '\f'; break;
    case 'v': cp = '\v'; break;
    case '0': cp = 0; break;
    case 'b':
        if (!in_class)
            return false;
        cp = '\b';
        break;
    case 'x':
        if (j + 2 >= len || hexval(re[j + 1]) < 0 || hexval(re[j + 2]) < 0)
            return false;
        cp = (uint32_t)(hexval(re[j + 1]) * 16 + hexval(re[j + 2]));
        j += 2;
        break;
    case 'u':
        if (j + 1 < len && re[j + 1] == '{') {
            size_t k = j + 2;
            cp = 0;
            while (k < len && hexval(re[k]) >= 0 && cp <= 0x10FFFF)
                cp = cp * 16 + (uint32_t)hexval(re[k++]);
            if (k >= len || re[k] != '}' || k == j + 2 || cp > 0x10FFFF)
                return false;
            j = k;
        } else {
            if (j + 4 >= len)
                return false;
            cp = 0;
            for (size_t k = 1; k <= 4; k++) {
                if (hexval(re[j + k]) < 0)
                    return false;
                cp = cp * 16 + (uint32_t)hexval(re[j + k]);
            }
            j += 4;
        }
        break;
    default:
        if ((unsigned char)e < 0x80 && !((e >= '0' && e <= '9') || (e >= 'a' && e <= 'z') ||
                                         (e >= 'A' && e <= 'Z'))) {
            cp = (uint32_t)e; /* escaped punctuation */
            break;
        }
        return false; /* \b \B \1 \k ...: the compiler names them */
    }
    *oom |= !cset_add(s, cp, cp);
    *i = j + 1;
    return true;
}

/* The pattern rewritten so that what it matches is the JSON-escaped text of the content it
 * matched: every character set ("." classes, escapes, literals) becomes a group of its safe
 * members and the escapes of the others; the rest (groups, alternation, quantifiers, anchors)
 * is copied. Returns NULL when memory runs out, or with *bad_at set to its offset when a class
 * is one this rewrite does not read (nothing unread is ever copied into a JSON string). */
static char *pattern_to_json(const char *re, size_t len, size_t *bad_at)
{
    *bad_at = SIZE_MAX;
    sc_buf out = {0};
    bool oom = false;
    size_t i = 0;
    buf_str(&out, "");
    while (i < len && !oom && !out.oom) {
        char ch = re[i];
        sc_cset s = {0};
        bool neg = false;
        if (ch == '\\') {
            if (!esc_set(re, len, &i, false, &s, &neg, &oom)) {
                size_t n = i + 1 < len ? 2 : 1;
                buf_add(&out, re + i, n);
                i += n;
                free(s.r);
                continue;
            }
            cset_emit(&out, &s, neg);
        } else if (ch == '.') {
            /* any character but line terminators: \n for Python, also \r U+2028 U+2029 for
             * ECMAScript (what JSON Schema validators use) */
            oom |= !cset_add(&s, '\n', '\n') || !cset_add(&s, '\r', '\r') ||
                   !cset_add(&s, 0x2028, 0x2029);
            cset_emit(&out, &s, true);
            i++;
        } else if (ch == '[') {
            size_t j = i + 1;
            if (j < len && re[j] == '^')
                neg = true, j++;
            bool first = true, closed = false;
            while (j < len && !oom) {
                if (re[j] == ']' && !first) {
                    closed = true;
                    j++;
                    break;
                }
                first = false;
                uint32_t lo;
                if (re[j] == '\\') {
                    sc_cset t = {0};
                    bool tneg = false;
                    size_t k = j;
                    if (!esc_set(re, len, &k, true, &t, &tneg, &oom)) {
                        free(t.r);
                        break; /* not a set: leave the class to the compiler */
                    }
                    if (tneg || t.n != 1 || t.r[0][0] != t.r[0][1]) {
                        /* a shorthand inside a class: its ranges, or their complement */
                        qsort(t.r, t.n, sizeof *t.r, cmp_range);
                        uint32_t next = 0;
                        for (size_t q = 0; q < t.n; q++) {
                            if (!tneg)
                                oom |= !cset_add(&s, t.r[q][0], t.r[q][1]);
                            else if (t.r[q][0] > next)
                                oom |= !cset_add(&s, next, t.r[q][0] - 1);
                            if (t.r[q][1] + 1 > next)
                                next = t.r[q][1] + 1;
                        }
                        if (tneg && next <= 0x10FFFF)
                            oom |= !cset_add(&s, next, 0x10FFFF);
                        free(t.r);
                        j = k;
                        continue;
                    }
                    lo = t.r[0][0];
                    free(t.r);
                    j = k;
                } else {
                    j += utf8_dec(re + j, len - j, &lo);
                }
                uint32_t hi = lo;
                if (j + 1 < len && re[j] == '-' && re[j + 1] != ']') {
                    j++;
                    if (re[j] == '\\') {
                        sc_cset t = {0};
                        bool tneg = false;
                        size_t k = j;
                        if (!esc_set(re, len, &k, true, &t, &tneg, &oom) || tneg || t.n != 1 ||
                            t.r[0][0] != t.r[0][1]) {
                            free(t.r);
                            break;
                        }
                        hi = t.r[0][0];
                        free(t.r);
                        j = k;
                    } else {
                        j += utf8_dec(re + j, len - j, &hi);
                    }
                    if (hi < lo)
                        break; /* the compiler names the bad range */
                }
                oom |= !cset_add(&s, lo, hi);
            }
            if (!closed) { /* a class not read to its end: refused, never copied */
                *bad_at = i;
                free(s.r);
                break;
            }
            cset_emit(&out, &s, neg);
            i = j;
        } else { /* syntax ( ) | * + ? { } ^ $ and safe characters are copied */
            uint32_t cp;
            size_t n = utf8_dec(re + i, len - i, &cp);
            if (cp >= 0x20 && cp != '"' && cp != '\\') {
                buf_add(&out, re + i, n);
                i += n;
                continue;
            }
            oom |= !cset_add(&s, cp, cp);
            cset_emit(&out, &s, false);
            i += n;
        }
        free(s.r);
    }
    if (oom || out.oom || *bad_at != SIZE_MAX) {
        free(out.p);
        return NULL;
    }
    return out.p;
}

static kvf_text_gx *sc_pattern(sc *c, const char *re, size_t len, const char *what)
{
    /* the pattern as written first, so errors quote its offsets */
    kvf_text_gb *scratch = NULL;
    kvf_text_gx *x = NULL;
    kvf_err e;
    if (kvf_text_gb_create(&scratch, &e) != KVF_OK) {
        c->st = kvf_err_set(c->err, e.status, "json schema: %s", e.msg);
        return NULL;
    }
    kvf_status st = kvf_text_regex_compile(scratch, re, len, &x, &e);
    kvf_text_gb_destroy(scratch);
    if (st != KVF_OK)
        return sc_fail(c, "%s: %s", what, e.msg);
    size_t bad_at;
    char *json_re = pattern_to_json(re, len, &bad_at);
    if (!json_re && bad_at != SIZE_MAX)
        return sc_fail(c, "%s: the character class at offset %zu is not supported inside a JSON "
                          "string (write it with plain characters, ranges and \\d \\w \\s)",
                       what, bad_at);
    if (!json_re) {
        c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
        return NULL;
    }
    st = kvf_text_regex_compile(c->b, json_re, strlen(json_re), &x, &e);
    free(json_re);
    if (st != KVF_OK)
        return sc_fail(c, "%s (as JSON string content): %s", what, e.msg);
    return x;
}

static const struct {
    const char *name, *re;
} sc_formats[] = {
    {"date", "\\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]"
             "\\d|30)|02-(?:0[1-9]|1\\d|2[0-8]))"},
    {"time", "(?:[01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(?:\\.\\d{1,6})?(?:Z|[+-](?:[01]\\d|2[0-3]):[0-5]"
             "\\d)"},
    {"date-time", "\\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\\d|3[01])|(?:0[469]|11)-(?:0[1-9]|"
                  "[12]\\d|30)|02-(?:0[1-9]|1\\d|2[0-8]))T(?:[01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(?:"
                  "\\.\\d{1,6})?(?:Z|[+-](?:[01]\\d|2[0-3]):[0-5]\\d)"},
    {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
    {"email", "[a-zA-Z0-9_%+-]{1,64}(?:\\.[a-zA-Z0-9_%+-]{1,64}){0,4}@(?:[a-z0-9](?:[a-z0-9-]{0,"
              "30}[a-z0-9])?\\.){1,4}[a-z]{2,12}"},
};

static bool sc_get_count(sc *c, const json_t *s, const char *key, int64_t *out)
{
    const json_t *v = json_object_get(s, key);
    if (!v)
        return false;
    if (!json_is_integer(v) && !(json_is_real(v) && json_real_value(v) == floor(json_real_value(v)))) {
        sc_fail(c, "\"%s\" must be a non-negative integer", key);
        return false;
    }
    double d = json_number_value(v);
    if (d < 0 || d > 1e9) {
        sc_fail(c, "\"%s\" (%g) must be between 0 and 1e9", key, d);
        return false;
    }
    *out = (int64_t)d;
    return true;
}

static kvf_text_gx *sc_string(sc *c, const json_t *s)
{
    const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    int64_t mn = 0, mx = -1;
    bool has_mn = sc_get_count(c, s, "minLength", &mn);
    if (c->st != KVF_OK)
        return NULL;
    bool has_mx = sc_get_count(c, s, "maxLength", &mx);
    if (c->st != KVF_OK)
        return NULL;
    if (!has_mx)
        mx = -1;
    if (has_mn && has_mx && mn > mx)
        return sc_fail(c, "minLength %lld is above maxLength %lld", (long long)mn, (long long)mx);
    if ((pat != NULL) + (fmt != NULL) + (has_mn || has_mx) > 1)
        return sc_fail(c, "pattern, format and minLength/maxLength together are not supported "
                          "(use one of them)");
    kvf_text_gx *content;
    if (pat) {
        if (!json_is_string(pat))
            return sc_fail(c, "\"pattern\" must be a string");
        content = sc_pattern(c, json_string_value(pat), json_string_length(pat), "pattern");
    } else if (fmt) {
        if (!json_is_string(fmt))
            return sc_fail(c, "\"format\" must be a string");
        const char *f = json_string_value(fmt);
        size_t k = 0, nf = sizeof sc_formats / sizeof sc_formats[0];
        while (k < nf && strcmp(f, sc_formats[k].name) != 0)
            k++;
        if (k == nf)
            return sc_fail(c, "unsupported format \"%.64s\" (date, time, date-time, uuid, email "
                              "are)", f);
        content = sc_pattern(c, sc_formats[k].re, strlen(sc_formats[k].re), "format");
    } else {
        content = kvf_text_gx_rep(c->b, str_char(c), (int32_t)mn, (int32_t)mx);
    }
    if (!content)
        return NULL;
    return seq3(c, lit(c, "\""), content, lit(c, "\""));
}

/* ---- the schema walk ---- */

static kvf_text_gx *sc_schema(sc *c, const json_t *s, int depth);

static bool sc_known_keyword(const char *k)
{
    static const char *const known[] = {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "minLength",
        "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "$ref", "$defs", "definitions", "title", "description", "default",
        "examples", "$schema", "$id", "$comment"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(k, known[i]) == 0)
            return true;
    return false;
}

static bool sc_annotation(const char *k)
{
    return strcmp(k, "title") == 0 || strcmp(k, "description") == 0 ||
           strcmp(k, "default") == 0 || strcmp(k, "examples") == 0 ||
           strcmp(k, "$schema") == 0 || strcmp(k, "$id") == 0 || strcmp(k, "$comment") == 0 ||
           strcmp(k, "$defs") == 0 || strcmp(k, "definitions") == 0;
}

/* Only annotations beside key (anyOf, $ref, ...): intersections are not grammars here. */
static bool sc_alone(sc *c, const json_t *s, const char *key)
{
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)s, k, v) {
        if (strcmp(k, key) != 0 && !sc_annotation(k)) {
            sc_fail(c, "\"%s\" beside \"%s\" is not supported (move it into the subschemas)", k,
                    key);
            return false;
        }
    }
    return true;
}

/* The value a local $ref names, or NULL (error set). */
static const json_t *sc_resolve(sc *c, const char *ref)
{
    if (ref[0] != '#')
        return sc_fail(c, "$ref \"%.128s\" is not local (only \"#...\" references are supported)",
                       ref),
               NULL;
    const json_t *v = c->root;
    const char *p = ref + 1;
    if (*p && *p != '/')
        return sc_fail(c, "$ref \"%.128s\" is not a JSON pointer", ref), NULL;
    while (*p == '/') {
        p++;
        char seg[256];
        size_t n = 0;
        while (*p && *p != '/') {
            char ch = *p++;
            if (ch == '~' && (*p == '0' || *p == '1'))
                ch = *p++ == '0' ? '~' : '/';
            else if (ch == '%' && hexval(p[0]) >= 0 && hexval(p[1]) >= 0)
                ch = (char)(hexval(p[0]) * 16 + hexval(p[1])), p += 2;
            if (n + 1 >= sizeof seg)
                return sc_fail(c, "$ref \"%.128s\" has a segment too long", ref), NULL;
            seg[n++] = ch;
        }
        seg[n] = 0;
        if (json_is_object(v)) {
            v = json_object_get(v, seg);
        } else if (json_is_array(v)) {
            char *end;
            unsigned long idx = strtoul(seg, &end, 10);
            v = *seg && !*end ? json_array_get(v, idx) : NULL;
        } else {
            v = NULL;
        }
        if (!v)
            return sc_fail(c, "$ref \"%.128s\" names nothing in this schema", ref), NULL;
    }
    return v;
}

static kvf_text_gx *sc_dollar_ref(sc *c, const json_t *s, int depth)
{
    const json_t *r = json_object_get(s, "$ref");
    if (!json_is_string(r))
        return sc_fail(c, "\"$ref\" must be a string");
    if (!sc_alone(c, s, "$ref"))
        return NULL;
    /* follow chains of bare $refs: a cycle of them consumes nothing */
    const json_t *t = s;
    for (int hops = 0; json_is_object(t) && json_object_get(t, "$ref"); hops++) {
        if (hops > KVF_TEXT_GRAMMAR_MAX_DEPTH)
            return sc_fail(c, "$ref \"%.128s\" is a cycle of references that never reaches a "
                              "schema", json_string_value(r));
        const json_t *rr = json_object_get(t, "$ref");
        if (!json_is_string(rr))
            return sc_fail(c, "\"$ref\" must be a string");
        t = sc_resolve(c, json_string_value(rr));
        if (!t)
            return NULL;
    }
    for (size_t i = 0; i < c->n_refs; i++)
        if (c->refs[i].target == t)
            return sc_ref_rule(c, c->refs[i].rule);
    if (c->n_refs == c->cap_refs) {
        size_t cap = c->cap_refs ? 2 * c->cap_refs : 16;
        sc_ref *refs = realloc(c->refs, cap * sizeof *refs);
        if (!refs) {
            c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
            return NULL;
        }
        c->refs = refs, c->cap_refs = cap;
    }
    int32_t rule = kvf_text_gb_rule(c->b);
    if (rule < 0)
        return NULL; /* the builder reports its limit */
    c->refs[c->n_refs++] = (sc_ref){t, rule};
    /* errors inside name the target's place */
    char saved[SC_PATH_MAX];
    size_t saved_len = c->path_len;
    memcpy(saved, c->path, saved_len + 1);
    snprintf(c->path, sizeof c->path, "%s", json_string_value(r) + 1);
    c->path_len = strlen(c->path);
    kvf_text_gx *body = sc_schema(c, t, depth + 1);
    memcpy(c->path, saved, saved_len + 1);
    c->path_len = saved_len;
    if (c->st != KVF_OK)
        return NULL;
    kvf_err e;
    if (body && kvf_text_gb_define(c->b, rule, body, &e) != KVF_OK)
        return sc_fail(c, "%s", e.msg);
    return kvf_text_gx_ref(c->b, rule);
}

/* enum / const: the values that fit "type", serialized compactly, as one choice (shared
 * prefixes merged, so a large enum stays a few automaton stacks). */
static kvf_text_gx *sc_enum(sc *c, const json_t *s, unsigned types)
{
    const json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    if (en && !json_is_array(en))
        return sc_fail(c, "\"enum\" must be an array");
    size_t n = cn ? 1 : json_array_size(en), k = 0;
    char **txts = calloc(n ? n : 1, sizeof *txts);
    size_t *lens = calloc(n ? n : 1, sizeof *lens);
    kvf_text_gx *x = NULL;
    if (!txts || !lens) {
        c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
        goto out;
    }
    for (size_t i = 0; i < n && c->st == KVF_OK; i++) {
        const json_t *v = cn ? cn : json_array_get(en, i);
        if (cn && en) { /* const wins; enum must hold it */
            bool found = false;
            for (size_t j = 0; j < json_array_size(en); j++)
                found |= json_equal((json_t *)v, json_array_get(en, j));
            if (!found)
                continue;
        }
        unsigned kind = json_is_object(v)    ? 1u
                        : json_is_array(v)   ? 2u
                        : json_is_string(v)  ? 4u
                        : json_is_integer(v) ? 8u | 16u
                        : json_is_real(v)    ? (json_real_value(v) == floor(json_real_value(v))
                                                    ? 8u | 16u : 16u)
                        : json_is_boolean(v) ? 32u
                                             : 64u;
        if (types && !(types & kind))
            continue;
        char *txt = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (!txt) {
            c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
            break;
        }
        txts[k] = txt;
        lens[k] = strlen(txt);
        c->lit_bytes += lens[k++];
        if (c->lit_bytes > SC_LIT_BUDGET) {
            sc_fail(c, "enum/const values exceed %u bytes in all", SC_LIT_BUDGET);
            break;
        }
    }
    if (c->st != KVF_OK)
        goto out;
    if (!k) {
        sc_fail(c, "\"%s\" admits no value of the schema's type", cn ? "const" : "enum");
        goto out;
    }
    x = kvf_text_gx_choice(c->b, (const char *const *)txts, lens, k);
out:
    for (size_t i = 0; i < k; i++)
        free(txts[i]);
    free(txts);
    free(lens);
    return x;
}

/* A JSON string literal of key (escaped by jansson). */
static kvf_text_gx *key_lit(sc *c, const char *key)
{
    json_t *k = json_string(key);
    char *txt = k ? json_dumps(k, JSON_ENCODE_ANY) : NULL;
    json_decref(k);
    if (!txt) {
        c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
        return NULL;
    }
    c->lit_bytes += strlen(txt);
    kvf_text_gx *x = c->lit_bytes > SC_LIT_BUDGET ? sc_fail(c, "property names exceed %u bytes "
                                                               "in all", SC_LIT_BUDGET)
                                                  : kvf_text_gx_lit(c->b, txt, strlen(txt));
    free(txt);
    return x;
}

/* The safe characters of an extra key: any but " \ and controls (no escapes, so an extra key
 * can be compared with the listed names as written). */
static kvf_text_gx *key_char(sc *c)
{
    static const uint32_t bad[3][2] = {{0, 0x1f}, {'"', '"'}, {'\\', '\\'}};
    if (c->r_key_char < 0)
        c->r_key_char = sc_rule_of(c, kvf_text_gx_chars(c->b, bad, 3, true));
    return sc_ref_rule(c, c->r_key_char);
}

/* Up to k key characters and the closing quote, one rule per k (trie nodes share them). */
static kvf_text_gx *key_rest(sc *c, int k)
{
    if (!c->r_key_rest[k])
        c->r_key_rest[k] = 1 + sc_rule_of(c, seq2(c, kvf_text_gx_rep(c->b, key_char(c), 0, k),
                                                  lit(c, "\"")));
    return sc_ref_rule(c, c->r_key_rest[k] - 1);
}

/* Keys (content then closing quote) of 1..SC_KEY_MAX characters that continue none of
 * names[0..n) past the nc characters (d bytes) already written: at a trie node, either end here
 * (when no name ends here), or take a character no name takes next and then anything, or take
 * one that some name takes and recurse. names are sorted. Keys are bounded so that a model (or
 * a random walk) cannot spend its budget on one. */
static kvf_text_gx *key_except(sc *c, const char **names, size_t n, size_t d, int nc)
{
    sc_alts a = {0};
    bool ends_here = false;
    size_t i = 0;
    while (i < n && names[i][d] == 0)
        ends_here = true, i++;
    if (!ends_here && d > 0)
        alts_add(c, &a, lit(c, "\""));
    if (nc >= SC_KEY_MAX)
        return a.n ? alts_done(c, &a) : kvf_text_gx_alt(c->b, NULL, 0);
    uint32_t(*taken)[2] = malloc((n + 3) * sizeof *taken);
    size_t nt = 0;
    if (!taken) {
        free(a.xs);
        c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
        return NULL;
    }
    taken[nt][0] = 0, taken[nt][1] = 0x1f, nt++;
    taken[nt][0] = '"', taken[nt][1] = '"', nt++;
    taken[nt][0] = '\\', taken[nt][1] = '\\', nt++;
    while (i < n && c->st == KVF_OK) {
        size_t len = strlen(names[i]);
        uint32_t cp;
        size_t cl = utf8_dec(names[i] + d, len - d, &cp);
        size_t j = i;
        while (j < n && strlen(names[j]) >= d + cl && memcmp(names[j] + d, names[i] + d, cl) == 0)
            j++;
        taken[nt][0] = cp, taken[nt][1] = cp, nt++;
        if (cp >= 0x20 && cp != '"' && cp != '\\')
            alts_add(c, &a, seq2(c, kvf_text_gx_lit(c->b, names[i] + d, cl),
                                 key_except(c, names + i, j - i, d + cl, nc + 1)));
        i = j;
    }
    alts_add(c, &a, seq2(c, kvf_text_gx_chars(c->b, (const uint32_t(*)[2])taken, nt, true),
                         key_rest(c, SC_KEY_MAX - nc - 1)));
    free(taken);
    return alts_done(c, &a);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* An extra property: a key that is none of the listed or required names, ":" and a value. */
static kvf_text_gx *extra_member(sc *c, const json_t *props, const json_t *req,
                                 kvf_text_gx *value)
{
    size_t n = json_object_size(props);
    const char **names = calloc(n + json_array_size(req) + 1, sizeof *names);
    if (!names) {
        c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
        return NULL;
    }
    size_t k = 0;
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)props, key, v) names[k++] = key;
    for (size_t i = 0; i < json_array_size(req); i++)
        if (!json_object_get(props, json_string_value(json_array_get(req, i))))
            names[k++] = json_string_value(json_array_get(req, i));
    n = k;
    qsort(names, n, sizeof *names, cmp_str);
    kvf_text_gx *kx = seq2(c, lit(c, "\""), key_except(c, names, n, 0, 0));
    free(names);
    return seq3(c, kx, seq3(c, ws(c), lit(c, ":"), ws(c)), value);
}

typedef struct sc_member {
    kvf_text_gx *x; /* "key" ws ":" ws value */
    bool required;
} sc_member;

static kvf_text_gx *sc_object(sc *c, const json_t *s, int depth)
{
    const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    const json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props))
        return sc_fail(c, "\"properties\" must be an object");
    if (req && !json_is_array(req))
        return sc_fail(c, "\"required\" must be an array of strings");
    for (size_t i = 0; i < json_array_size(req); i++)
        if (!json_is_string(json_array_get(req, i)))
            return sc_fail(c, "\"required\" must be an array of strings");
    /* extra properties' values: NULL when none are allowed */
    kvf_text_gx *extra_value = NULL;
    bool extra_ok;
    if (!addl)
        extra_ok = json_object_size(props) == 0;
    else if (json_is_boolean(addl))
        extra_ok = json_is_true(addl);
    else
        extra_ok = true;
    if (extra_ok) {
        if (addl && json_is_object(addl)) {
            size_t old = sc_push(c, "additionalProperties");
            extra_value = sc_schema(c, addl, depth + 1);
            sc_pop(c, old);
            if (c->st != KVF_OK)
                return NULL;
            /* one rule: referred to by the required extras and the tail */
            extra_value = sc_ref_rule(c, sc_rule_of(c, extra_value));
        } else {
            extra_value = any_value(c);
        }
    }
    /* members in the schema's order, then required names that properties does not list */
    size_t n_props = json_object_size(props), n_req = json_array_size(req);
    sc_member *ms = calloc(n_props + n_req + 1, sizeof *ms);
    if (!ms) {
        c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
        return NULL;
    }
    size_t n = 0;
    kvf_text_gx *colon = seq3(c, ws(c), lit(c, ":"), ws(c));
    const char *key;
    const json_t *ps;
    size_t old = sc_push(c, "properties");
    json_object_foreach((json_t *)props, key, ps) {
        size_t o2 = sc_push(c, key);
        kvf_text_gx *vx = sc_schema(c, ps, depth + 1);
        sc_pop(c, o2);
        if (c->st != KVF_OK)
            break;
        bool required = false;
        for (size_t i = 0; i < n_req; i++)
            required |= strcmp(json_string_value(json_array_get(req, i)), key) == 0;
        ms[n++] = (sc_member){seq3(c, key_lit(c, key), colon, vx), required};
    }
    sc_pop(c, old);
    for (size_t i = 0; i < n_req && c->st == KVF_OK; i++) {
        const char *name = json_string_value(json_array_get(req, i));
        if (json_object_get(props, name))
            continue;
        bool dup = false;
        for (size_t k = 0; k < i; k++)
            dup |= strcmp(json_string_value(json_array_get(req, k)), name) == 0;
        if (dup)
            continue;
        if (!extra_value) {
            sc_fail(c, "required property \"%.64s\" is not in \"properties\" and "
                       "additionalProperties is false", name);
            break;
        }
        ms[n++] = (sc_member){seq3(c, key_lit(c, name), colon, extra_value), true};
    }
    if (c->st != KVF_OK) {
        free(ms);
        return NULL;
    }
    /* Once something was written, the rest is flat: item i is "," and member i, optional
     * unless required, then the extra properties' tail. What is written first has no comma: it
     * is member j for some j up to the first required one (or an extra, or nothing when none is
     * required), followed by the items after j. Those suffixes share blocks of SC_OBJ_BLOCK
     * items as rules, so the size stays linear (SC_OBJ_BLOCK items per suffix) and the
     * automaton's stack grows by one per block passed, not per optional property. */
    /* Each member carries the ws after it, so an item starts with the "," byte itself: one
     * automaton stack per item that may come next, where a leading ws would make three. */
    kvf_text_gx *sep = seq2(c, lit(c, ","), ws(c));
    kvf_text_gx *tail = lit(c, ""), *extra_first = NULL;
    if (extra_value) {
        kvf_text_gx *em = sc_ref_rule(
            c, sc_rule_of(c, seq2(c, extra_member(c, props, req, extra_value), ws(c))));
        tail = sc_ref_rule(c, sc_rule_of(c, kvf_text_gx_rep(c->b, seq2(c, sep, em), 0, -1)));
        extra_first = seq2(c, em, tail);
    }
    /* Every optional member that may come next is a live automaton stack (three while the ws
     * after its comma is open), and the matcher allows KVF_TEXT_GRAMMAR_MAX_STACKS: a long run
     * of optional members is refused here, by name, rather than failing mid-generation. */
    size_t run = 0, longest = 0;
    for (size_t i = 0; i < n; i++) {
        run = ms[i].required ? 0 : run + 1;
        longest = run > longest ? run : longest;
    }
    if (longest > SC_OBJ_MAX_OPTIONAL_RUN) {
        free(ms);
        return sc_fail(c, "%zu optional properties in a row (at most %d: mark some required, or "
                          "split the object)", longest, SC_OBJ_MAX_OPTIONAL_RUN);
    }
    size_t r0 = 0; /* the first required member, n when none is */
    while (r0 < n && !ms[r0].required)
        r0++;
    int32_t *mrule = calloc(n + 1, sizeof *mrule);
    size_t n_blocks = (n + SC_OBJ_BLOCK - 1) / SC_OBJ_BLOCK;
    int32_t *blk = calloc(n_blocks + 1, sizeof *blk);
    if (!mrule || !blk) {
        free(mrule);
        free(blk);
        free(ms);
        c->st = kvf_err_set(c->err, KVF_ERR_NOMEM, "json schema: out of memory");
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        mrule[i] = sc_rule_of(c, seq2(c, ms[i].x, ws(c)));
    /* blk[b]: items of blocks b.. and the tail; defined last to first */
    for (size_t b = n_blocks + 1; b-- > 0 && c->st == KVF_OK;) {
        if (b == n_blocks) {
            blk[b] = sc_rule_of(c, tail);
            continue;
        }
        sc_alts a = {0};
        for (size_t i = b * SC_OBJ_BLOCK; i < n && i < (b + 1) * SC_OBJ_BLOCK; i++) {
            kvf_text_gx *item = seq2(c, sep, sc_ref_rule(c, mrule[i]));
            alts_add(c, &a, ms[i].required ? item : opt(c, item));
        }
        alts_add(c, &a, sc_ref_rule(c, blk[b + 1]));
        blk[b] = sc_rule_of(c, kvf_text_gx_seq(c->b, a.xs, a.n));
        free(a.xs);
    }
    sc_alts firsts = {0};
    for (size_t j = 0; j <= r0 && j < n && c->st == KVF_OK; j++) {
        /* member j first, then the items after it: the rest of its block, then the blocks */
        sc_alts a = {0};
        alts_add(c, &a, sc_ref_rule(c, mrule[j]));
        size_t b = (j + 1) / SC_OBJ_BLOCK;
        for (size_t i = j + 1; i < n && i < (b + 1) * SC_OBJ_BLOCK; i++) {
            kvf_text_gx *item = seq2(c, sep, sc_ref_rule(c, mrule[i]));
            alts_add(c, &a, ms[i].required ? item : opt(c, item));
        }
        alts_add(c, &a, sc_ref_rule(c, blk[b < n_blocks ? b + 1 : n_blocks]));
        alts_add(c, &firsts, kvf_text_gx_seq(c->b, a.xs, a.n));
        free(a.xs);
    }
    if (r0 == n && extra_first) /* nothing required: an extra may come first */
        alts_add(c, &firsts, extra_first);
    /* one ws after "{" (not one per alternative: fewer live stacks); the last member's ws
     * is the one before "}" */
    kvf_text_gx *first = NULL;
    if (c->st == KVF_OK && firsts.n)
        first = alts_done(c, &firsts);
    if (c->st == KVF_OK && r0 == n) /* nothing required: the object may stay empty */
        first = first ? opt(c, first) : lit(c, "");
    first = seq2(c, ws(c), first);
    free(firsts.xs);
    free(mrule);
    free(blk);
    free(ms);
    /* "{" ws [member ws ("," ws member ws)*] "}" */
    return seq3(c, lit(c, "{"), first, lit(c, "}"));
}

static kvf_text_gx *sc_array(sc *c, const json_t *s, int depth)
{
    const json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    if (json_is_array(items)) { /* draft 4-7 tuple form */
        if (prefix)
            return sc_fail(c, "\"items\" as an array beside \"prefixItems\"");
        prefix = items;
        items = NULL;
    }
    if (prefix && !json_is_array(prefix))
        return sc_fail(c, "\"prefixItems\" must be an array");
    int64_t mn = 0, mx = -1;
    sc_get_count(c, s, "minItems", &mn);
    if (c->st != KVF_OK)
        return NULL;
    if (!sc_get_count(c, s, "maxItems", &mx))
        mx = -1;
    if (c->st != KVF_OK)
        return NULL;
    if (mx >= 0 && mn > mx)
        return sc_fail(c, "minItems %lld is above maxItems %lld", (long long)mn, (long long)mx);
    size_t k = json_array_size(prefix);
    /* the item schema past the prefix: NULL when none may follow */
    kvf_text_gx *item = NULL;
    if (items && !json_is_false(items)) {
        size_t old = sc_push(c, "items");
        item = sc_schema(c, items, depth + 1);
        sc_pop(c, old);
        if (c->st != KVF_OK)
            return NULL;
        item = sc_ref_rule(c, sc_rule_of(c, item));
    } else if (!items && !prefix) {
        item = any_value(c);
    }
    if ((int64_t)k < mn && !item)
        return sc_fail(c, "minItems %lld asks for more items than prefixItems and items allow",
                       (long long)mn);
    kvf_text_gx *sep = seq3(c, ws(c), lit(c, ","), ws(c));
    /* the tail past the prefix: count in [max(mn - k, 0), mx - k] */
    kvf_text_gx *tail = lit(c, "");
    int64_t tmin = mn > (int64_t)k ? mn - (int64_t)k : 0;
    int64_t tmax = mx < 0 ? -1 : mx > (int64_t)k ? mx - (int64_t)k : 0;
    if (mx >= 0 && mx > INT32_MAX / 2)
        tmax = -1; /* no grammar counts that far anyway */
    if (item && tmax != 0) {
        if (k > 0) {
            tail = kvf_text_gx_rep(c->b, seq2(c, sep, item), (int32_t)tmin, (int32_t)tmax);
        } else {
            kvf_text_gx *more = kvf_text_gx_rep(c->b, seq2(c, sep, item),
                                                (int32_t)(tmin > 0 ? tmin - 1 : 0),
                                                (int32_t)(tmax < 0 ? -1 : tmax - 1));
            tail = seq3(c, ws(c), item, more);
            if (tmin == 0)
                tail = opt(c, tail);
        }
    }
    /* prefix items right to left: item i may end the array when i >= mn */
    size_t kk = mx >= 0 && (int64_t)k > mx ? (size_t)mx : k;
    kvf_text_gx *rest = tail;
    for (size_t i = kk; i-- > 0 && c->st == KVF_OK;) {
        size_t old = sc_push(c, "prefixItems");
        size_t o2 = sc_push_idx(c, i);
        kvf_text_gx *x = sc_schema(c, json_array_get(prefix, i), depth + 1);
        sc_pop(c, o2);
        sc_pop(c, old);
        kvf_text_gx *step = seq3(c, i == 0 ? ws(c) : sep, x, rest);
        rest = (int64_t)i >= mn ? opt(c, step) : step;
    }
    if (c->st != KVF_OK)
        return NULL;
    return seq3(c, lit(c, "["), rest, seq2(c, ws(c), lit(c, "]")));
}

/* Type bits: object 1, array 2, string 4, integer 8, number 16, boolean 32, null 64. */
static unsigned sc_type_bit(const char *t)
{
    static const char *const names[] = {"object", "array", "string", "integer", "number",
                                        "boolean", "null"};
    for (unsigned i = 0; i < 7; i++)
        if (strcmp(t, names[i]) == 0)
            return 1u << i;
    return 0;
}

static kvf_text_gx *sc_schema(sc *c, const json_t *s, int depth)
{
    if (c->st != KVF_OK)
        return NULL;
    if (depth > KVF_TEXT_GRAMMAR_MAX_DEPTH)
        return sc_fail(c, "schema nested deeper than %d", KVF_TEXT_GRAMMAR_MAX_DEPTH);
    if (json_is_true(s))
        return any_value(c);
    if (json_is_false(s))
        return kvf_text_gx_alt(c->b, NULL, 0); /* admits nothing */
    if (!json_is_object(s))
        return sc_fail(c, "a schema must be an object or a boolean, not %s",
                       json_is_array(s) ? "an array" : "a scalar");
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)s, k, v) {
        if (!sc_known_keyword(k))
            return sc_fail(c, "unsupported JSON Schema keyword \"%.64s\"", k);
    }
    if (json_object_get(s, "$ref"))
        return sc_dollar_ref(c, s, depth);
    static const char *const comb[3] = {"anyOf", "oneOf", "allOf"};
    for (int i = 0; i < 3; i++) {
        const json_t *subs = json_object_get(s, comb[i]);
        if (!subs)
            continue;
        if (!json_is_array(subs) || json_array_size(subs) == 0)
            return sc_fail(c, "\"%s\" must be a non-empty array of schemas", comb[i]);
        if (!sc_alone(c, s, comb[i]))
            return NULL;
        if (i == 2 && json_array_size(subs) != 1)
            return sc_fail(c, "\"allOf\" of %zu schemas is not supported (only of one)",
                           json_array_size(subs));
        sc_alts a = {0};
        size_t old = sc_push(c, comb[i]);
        for (size_t j = 0; j < json_array_size(subs) && c->st == KVF_OK; j++) {
            size_t o2 = sc_push_idx(c, j);
            alts_add(c, &a, sc_schema(c, json_array_get(subs, j), depth + 1));
            sc_pop(c, o2);
        }
        sc_pop(c, old);
        if (c->st != KVF_OK) {
            free(a.xs);
            return NULL;
        }
        return alts_done(c, &a);
    }
    /* the types admitted: "type", or what the keywords imply, or all */
    unsigned types = 0;
    const json_t *t = json_object_get(s, "type");
    if (json_is_string(t)) {
        types = sc_type_bit(json_string_value(t));
        if (!types)
            return sc_fail(c, "unknown type \"%.32s\"", json_string_value(t));
    } else if (json_is_array(t)) {
        for (size_t i = 0; i < json_array_size(t); i++) {
            const json_t *ti = json_array_get(t, i);
            unsigned bit = json_is_string(ti) ? sc_type_bit(json_string_value(ti)) : 0;
            if (!bit)
                return sc_fail(c, "\"type\" lists something that is not a type name");
            types |= bit;
        }
        if (!types)
            return sc_fail(c, "\"type\" is an empty list");
    } else if (t) {
        return sc_fail(c, "\"type\" must be a type name or a list of them");
    }
    if (json_object_get(s, "enum") || json_object_get(s, "const"))
        return sc_enum(c, s, types);
    if (!types) {
        if (json_object_get(s, "properties") || json_object_get(s, "required") ||
            json_object_get(s, "additionalProperties"))
            types |= 1;
        if (json_object_get(s, "items") || json_object_get(s, "prefixItems") ||
            json_object_get(s, "minItems") || json_object_get(s, "maxItems"))
            types |= 2;
        if (json_object_get(s, "minLength") || json_object_get(s, "maxLength") ||
            json_object_get(s, "pattern") || json_object_get(s, "format"))
            types |= 4;
        if (json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
            json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum"))
            types |= 16;
        if (!types)
            return any_value(c);
    }
    if (types & 16)
        types &= ~8u; /* number covers integer */
    sc_alts a = {0};
    if (types & 1)
        alts_add(c, &a, sc_object(c, s, depth));
    if ((types & 2) && c->st == KVF_OK)
        alts_add(c, &a, sc_array(c, s, depth));
    if ((types & 4) && c->st == KVF_OK)
        alts_add(c, &a, sc_string(c, s));
    if ((types & (8 | 16)) && c->st == KVF_OK) {
        sc_bounds bd;
        if (sc_read_bounds(c, s, &bd))
            alts_add(c, &a, types & 16 ? num_in(c, bd) : int_in(c, bd));
    }
    if (types & 32)
        alts_add(c, &a, alt2(c, lit(c, "true"), lit(c, "false")));
    if (types & 64)
        alts_add(c, &a, lit(c, "null"));
    if (c->st != KVF_OK) {
        free(a.xs);
        return NULL;
    }
    return alts_done(c, &a);
}

static void sc_init(sc *c, kvf_err *err)
{
    memset(c, 0, sizeof *c);
    c->err = err;
    c->r_ws = c->r_char = c->r_value = c->r_object = c->r_array = c->r_string = c->r_number =
        c->r_key_char = -1;
}

kvf_status kvf_text_grammar_schema(const char *schema, size_t len, kvf_text_grammar **out,
                                   kvf_err *err)
{
    if (!schema || !out)
        return kvf_err_set(err, KVF_ERR_INVALID, "json schema: no schema given");
    json_error_t je;
    json_t *root = json_loadb(schema, len, JSON_DECODE_ANY, &je);
    if (!root)
        return kvf_err_set(err, KVF_ERR_INVALID, "json schema: not JSON: %s (line %d, column %d)",
                           je.text, je.line, je.column);
    sc c;
    sc_init(&c, err);
    c.root = root;
    kvf_status st = kvf_text_gb_create(&c.b, err);
    if (st != KVF_OK) {
        json_decref(root);
        return st;
    }
    kvf_text_gx *x = sc_schema(&c, root, 0);
    kvf_text_grammar *g = NULL;
    st = c.st;
    if (st == KVF_OK) /* builder failures (limits, memory) come out here, named by it */
        st = kvf_text_gb_finish(c.b, x, &g, err);
    kvf_text_gb_destroy(c.b);
    free(c.refs);
    json_decref(root);
    if (st != KVF_OK)
        return st;
    *out = g;
    return KVF_OK;
}

kvf_status kvf_text_grammar_json_object(kvf_text_grammar **out, kvf_err *err)
{
    if (!out)
        return kvf_err_set(err, KVF_ERR_INVALID, "json object grammar: no output");
    sc c;
    sc_init(&c, err);
    kvf_status st = kvf_text_gb_create(&c.b, err);
    if (st != KVF_OK)
        return st;
    any_value_rules(&c);
    kvf_text_gx *x = sc_ref_rule(&c, c.r_object);
    kvf_text_grammar *g = NULL;
    st = c.st;
    if (st == KVF_OK)
        st = kvf_text_gb_finish(c.b, x, &g, err);
    kvf_text_gb_destroy(c.b);
    if (st != KVF_OK)
        return st;
    *out = g;
    return KVF_OK;
}
