/* regex.c: regular expressions (the common subset of Python's re and ECMAScript that grammar.h
 * describes) to grammar expressions, by recursive descent. Matching is grammar.c's business:
 * the expression is the whole output, so ^ and $ mean nothing but are accepted at the ends.
 * Everything outside the subset is refused by name with its offset, never guessed at. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/grammar.h"

/* Bounds of {m,n}: larger counts pass the grammar's node limit anyway, and refusing them here
 * gives a clearer message. */
#define RE_MAX_COUNT 100000

typedef struct re_parser {
    kvf_text_gb *b;
    const unsigned char *s;
    size_t len, pos;
    int depth;
    kvf_err *err;
    kvf_status st;
    bool plain; /* the last sequence parsed was literal characters only, as written */
} re_parser;

typedef struct cp_set {
    uint32_t (*r)[2];
    size_t n, cap;
} cp_set;

static kvf_status re_fail(re_parser *p, kvf_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static kvf_status re_fail(re_parser *p, kvf_status st, const char *fmt, ...)
{
    if (p->st != KVF_OK)
        return p->st;
    char msg[KVF_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->st = kvf_err_set(p->err, st, "regex: %s", msg);
    return p->st;
}

static bool set_add(re_parser *p, cp_set *s, uint32_t lo, uint32_t hi)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        uint32_t (*r)[2] = realloc(s->r, cap * sizeof *r);
        if (!r) {
            re_fail(p, KVF_ERR_NOMEM, "out of memory");
            return false;
        }
        s->r = r;
        s->cap = cap;
    }
    s->r[s->n][0] = lo;
    s->r[s->n][1] = hi;
    s->n++;
    return true;
}

/* One code point of the regex text; false (and an error) on invalid UTF-8. */
static bool next_cp(re_parser *p, uint32_t *cp)
{
    const unsigned char *s = p->s + p->pos;
    size_t left = p->len - p->pos;
    unsigned c = s[0];
    size_t n;
    uint32_t v, min;
    if (c < 0x80) {
        *cp = c;
        p->pos++;
        return true;
    } else if ((c & 0xE0) == 0xC0) {
        n = 2, v = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
        n = 3, v = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
        n = 4, v = c & 0x07, min = 0x10000;
    } else {
        re_fail(p, KVF_ERR_PARSE, "invalid UTF-8 at offset %zu", p->pos);
        return false;
    }
    if (left < n) {
        re_fail(p, KVF_ERR_PARSE, "invalid UTF-8 at offset %zu", p->pos);
        return false;
    }
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) {
            re_fail(p, KVF_ERR_PARSE, "invalid UTF-8 at offset %zu", p->pos);
            return false;
        }
        v = (v << 6) | (s[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        re_fail(p, KVF_ERR_PARSE, "invalid UTF-8 at offset %zu", p->pos);
        return false;
    }
    p->pos += n;
    *cp = v;
    return true;
}

static int hexval(unsigned c)
{
    if (c >= '0' && c <= '9')
        return (int)(c - '0');
    if (c >= 'a' && c <= 'f')
        return (int)(c - 'a' + 10);
    if (c >= 'A' && c <= 'F')
        return (int)(c - 'A' + 10);
    return -1;
}

/* n hex digits at the current position */
static bool hex_digits(re_parser *p, size_t n, uint32_t *out, size_t esc_at, const char *what)
{
    uint32_t v = 0;
    for (size_t i = 0; i < n; i++) {
        int h = p->pos < p->len ? hexval(p->s[p->pos]) : -1;
        if (h < 0) {
            re_fail(p, KVF_ERR_PARSE, "%s at offset %zu needs %zu hex digits", what, esc_at, n);
            return false;
        }
        v = v * 16 + (uint32_t)h;
        p->pos++;
    }
    *out = v;
    return true;
}

enum { ESC_CP, ESC_SET };

static void add_class(re_parser *p, cp_set *s, char which)
{
    switch (which) {
    case 'd':
        set_add(p, s, '0', '9');
        break;
    case 'w':
        set_add(p, s, '0', '9');
        set_add(p, s, 'A', 'Z');
        set_add(p, s, '_', '_');
        set_add(p, s, 'a', 'z');
        break;
    case 's':
        set_add(p, s, '\t', '\r'); /* \t \n \v \f \r */
        set_add(p, s, ' ', ' ');
        break;
    }
}

/* A class shorthand negated (\D \W \S) into s: the complement of the positive one. */
static void add_class_neg(re_parser *p, cp_set *s, char which)
{
    cp_set pos = {0};
    add_class(p, &pos, which);
    uint32_t next = 0;
    for (size_t i = 0; i < pos.n; i++) { /* add_class adds sorted, disjoint ranges */
        if (pos.r[i][0] > next)
            set_add(p, s, next, pos.r[i][0] - 1);
        next = pos.r[i][1] + 1;
    }
    set_add(p, s, next, 0x10FFFF);
    free(pos.r);
}

/* After a backslash (p->pos at the escaped character): a code point, or a set added to *set. */
static int parse_escape(re_parser *p, uint32_t *cp, cp_set *set, bool in_class)
{
    size_t at = p->pos - 1;
    if (p->pos >= p->len) {
        re_fail(p, KVF_ERR_PARSE, "a trailing backslash at offset %zu", at);
        return -1;
    }
    unsigned c = p->s[p->pos++];
    switch (c) {
    case 'd': case 'w': case 's':
        add_class(p, set, (char)c);
        return ESC_SET;
    case 'D': case 'W': case 'S':
        add_class_neg(p, set, (char)(c + 32));
        return ESC_SET;
    case 'n': *cp = '\n'; return ESC_CP;
    case 't': *cp = '\t'; return ESC_CP;
    case 'r': *cp = '\r'; return ESC_CP;
    case 'f': *cp = '\f'; return ESC_CP;
    case 'v': *cp = '\v'; return ESC_CP;
    case '0':
        if (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
            re_fail(p, KVF_ERR_UNSUPPORTED, "octal escape at offset %zu is not supported (use \\xHH)",
                    at);
            return -1;
        }
        *cp = 0;
        return ESC_CP;
    case 'x':
        if (!hex_digits(p, 2, cp, at, "\\x"))
            return -1;
        return ESC_CP;
    case 'u':
        if (p->pos < p->len && p->s[p->pos] == '{') {
            p->pos++;
            uint32_t v = 0;
            size_t nd = 0;
            while (p->pos < p->len && hexval(p->s[p->pos]) >= 0 && nd < 7) {
                v = v * 16 + (uint32_t)hexval(p->s[p->pos]);
                p->pos++;
                nd++;
            }
            if (nd == 0 || nd > 6 || p->pos >= p->len || p->s[p->pos] != '}') {
                re_fail(p, KVF_ERR_PARSE, "\\u{...} at offset %zu wants 1 to 6 hex digits and }", at);
                return -1;
            }
            p->pos++;
            *cp = v;
        } else if (!hex_digits(p, 4, cp, at, "\\u")) {
            return -1;
        }
        if (*cp > 0x10FFFF) {
            re_fail(p, KVF_ERR_PARSE, "\\u at offset %zu: U+%X is beyond U+10FFFF", at, (unsigned)*cp);
            return -1;
        }
        if (*cp >= 0xD800 && *cp <= 0xDFFF) {
            re_fail(p, KVF_ERR_UNSUPPORTED,
                    "\\u at offset %zu: U+%04X is a surrogate (write the character itself)", at,
                    (unsigned)*cp);
            return -1;
        }
        return ESC_CP;
    default:
        break;
    }
    if (c < 0x80 && c > 0x20 && c != 0x7F && !(c >= '0' && c <= '9') && !(c >= 'a' && c <= 'z') &&
        !(c >= 'A' && c <= 'Z')) {
        *cp = c; /* escaped punctuation */
        return ESC_CP;
    }
    if (c == 'b' || c == 'B')
        re_fail(p, KVF_ERR_UNSUPPORTED, "%s \\%c at offset %zu is not supported",
                in_class ? "the escape" : "the word boundary", c, at);
    else if (c >= '1' && c <= '9')
        re_fail(p, KVF_ERR_UNSUPPORTED, "backreference \\%c at offset %zu is not supported", c, at);
    else if (c >= 0x21 && c < 0x7F)
        re_fail(p, KVF_ERR_UNSUPPORTED, "the escape \\%c at offset %zu is not supported", c, at);
    else
        re_fail(p, KVF_ERR_UNSUPPORTED, "the escape at offset %zu is not supported", at);
    return -1;
}

static kvf_text_gx *chars_of(re_parser *p, cp_set *s, bool negate)
{
    if (p->st != KVF_OK)
        return NULL;
    kvf_text_gx *x = kvf_text_gx_chars(p->b, (const uint32_t (*)[2])s->r, s->n, negate);
    if (!x)
        re_fail(p, KVF_ERR_LIMIT, "the grammar could not be built (too large?)");
    return x;
}

static kvf_text_gx *lit_cp(re_parser *p, uint32_t cp)
{
    uint8_t u[4];
    int n;
    if (cp < 0x80) {
        u[0] = (uint8_t)cp;
        n = 1;
    } else if (cp < 0x800) {
        u[0] = (uint8_t)(0xC0 | (cp >> 6));
        u[1] = (uint8_t)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        u[0] = (uint8_t)(0xE0 | (cp >> 12));
        u[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (uint8_t)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        u[0] = (uint8_t)(0xF0 | (cp >> 18));
        u[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        u[3] = (uint8_t)(0x80 | (cp & 0x3F));
        n = 4;
    }
    kvf_text_gx *x = kvf_text_gx_lit(p->b, u, (size_t)n);
    if (!x)
        re_fail(p, KVF_ERR_NOMEM, "out of memory");
    return x;
}

static kvf_text_gx *parse_class(re_parser *p)
{
    size_t at = p->pos - 1; /* the [ */
    bool negate = false;
    cp_set set = {0};
    if (p->pos < p->len && p->s[p->pos] == '^') {
        negate = true;
        p->pos++;
    }
    bool first = true;
    for (;;) {
        if (p->pos >= p->len) {
            re_fail(p, KVF_ERR_PARSE, "the class [ at offset %zu is not closed", at);
            break;
        }
        unsigned c = p->s[p->pos];
        if (c == ']' && !first) {
            p->pos++;
            break;
        }
        first = false;
        if (c == '[') {
            re_fail(p, KVF_ERR_UNSUPPORTED,
                    "an unescaped [ inside the class at offset %zu (write \\[)", p->pos);
            break;
        }
        /* one item: a code point (maybe the start of a range) or a shorthand set */
        uint32_t lo;
        size_t item_at = p->pos;
        int kind;
        if (c == '\\') {
            p->pos++;
            kind = parse_escape(p, &lo, &set, true);
        } else {
            kind = next_cp(p, &lo) ? ESC_CP : -1;
        }
        if (kind < 0)
            break;
        if (kind == ESC_SET) {
            if (p->pos + 1 < p->len && p->s[p->pos] == '-' && p->s[p->pos + 1] != ']') {
                re_fail(p, KVF_ERR_PARSE, "a range from a class shorthand at offset %zu", item_at);
                break;
            }
            continue;
        }
        uint32_t hi = lo;
        if (p->pos + 1 < p->len && p->s[p->pos] == '-' && p->s[p->pos + 1] != ']') {
            p->pos++;
            size_t hi_at = p->pos;
            int k2;
            if (p->s[p->pos] == '\\') {
                p->pos++;
                cp_set dummy = {0};
                k2 = parse_escape(p, &hi, &dummy, true);
                free(dummy.r);
                if (k2 == ESC_SET) {
                    re_fail(p, KVF_ERR_PARSE, "a range to a class shorthand at offset %zu", hi_at);
                    break;
                }
            } else {
                k2 = next_cp(p, &hi) ? ESC_CP : -1;
            }
            if (k2 < 0)
                break;
            if (hi < lo) {
                re_fail(p, KVF_ERR_PARSE, "the range at offset %zu goes backwards (U+%04X-U+%04X)",
                        item_at, (unsigned)lo, (unsigned)hi);
                break;
            }
        }
        if (!set_add(p, &set, lo, hi))
            break;
    }
    kvf_text_gx *x = p->st == KVF_OK ? chars_of(p, &set, negate) : NULL;
    free(set.r);
    return x;
}

static kvf_text_gx *parse_alt(re_parser *p);

static kvf_text_gx *parse_group(re_parser *p)
{
    size_t at = p->pos - 1; /* the ( */
    if (p->depth + 1 > KVF_TEXT_GRAMMAR_MAX_DEPTH) {
        re_fail(p, KVF_ERR_LIMIT, "groups nested deeper than %d at offset %zu",
                KVF_TEXT_GRAMMAR_MAX_DEPTH, at);
        return NULL;
    }
    if (p->pos < p->len && p->s[p->pos] == '?') {
        p->pos++;
        unsigned c = p->pos < p->len ? p->s[p->pos] : 0;
        if (c == ':') {
            p->pos++;
        } else if (c == 'P' || c == '<') {
            if (c == 'P') {
                p->pos++;
                if (p->pos < p->len && p->s[p->pos] == '=') {
                    re_fail(p, KVF_ERR_UNSUPPORTED,
                            "the backreference (?P= at offset %zu is not supported", at);
                    return NULL;
                }
                if (p->pos >= p->len || p->s[p->pos] != '<') {
                    re_fail(p, KVF_ERR_UNSUPPORTED, "the group (?P at offset %zu is not supported",
                            at);
                    return NULL;
                }
            }
            p->pos++; /* the < */
            if (p->pos < p->len && (p->s[p->pos] == '=' || p->s[p->pos] == '!')) {
                re_fail(p, KVF_ERR_UNSUPPORTED, "the lookbehind (?<%c at offset %zu is not supported",
                        p->s[p->pos], at);
                return NULL;
            }
            size_t name_at = p->pos;
            while (p->pos < p->len &&
                   (p->s[p->pos] == '_' || (p->s[p->pos] >= 'a' && p->s[p->pos] <= 'z') ||
                    (p->s[p->pos] >= 'A' && p->s[p->pos] <= 'Z') ||
                    (p->pos > name_at && p->s[p->pos] >= '0' && p->s[p->pos] <= '9')))
                p->pos++;
            if (p->pos == name_at || p->pos >= p->len || p->s[p->pos] != '>') {
                re_fail(p, KVF_ERR_PARSE, "a bad group name at offset %zu", name_at);
                return NULL;
            }
            p->pos++;
        } else if (c == '=' || c == '!') {
            re_fail(p, KVF_ERR_UNSUPPORTED, "the lookahead (?%c at offset %zu is not supported", c,
                    at);
            return NULL;
        } else {
            re_fail(p, KVF_ERR_UNSUPPORTED,
                    "the group (?%c at offset %zu is not supported (inline flags, comments and "
                    "conditionals are not)",
                    c >= 0x21 && c < 0x7F ? c : '?', at);
            return NULL;
        }
    }
    p->depth++;
    kvf_text_gx *x = parse_alt(p);
    p->depth--;
    if (!x)
        return NULL;
    if (p->pos >= p->len || p->s[p->pos] != ')') {
        re_fail(p, KVF_ERR_PARSE, "the group ( at offset %zu is not closed", at);
        return NULL;
    }
    p->pos++;
    return x;
}

/* {m}, {m,}, {m,n} at p->pos (the {); false when it is not one (then { is a literal). */
static bool parse_braces(re_parser *p, int32_t *min, int32_t *max)
{
    size_t i = p->pos + 1;
    int64_t m = 0, n = -1;
    size_t nd = 0;
    if (i < p->len && p->s[i] == ',') {
        re_fail(p, KVF_ERR_UNSUPPORTED,
                "the quantifier {,n} at offset %zu means different things in Python and "
                "ECMAScript (write {0,n})",
                p->pos);
        return false;
    }
    while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') {
        if (m <= RE_MAX_COUNT)
            m = m * 10 + (p->s[i] - '0');
        i++;
        nd++;
    }
    if (nd == 0)
        return false;
    if (i < p->len && p->s[i] == '}') {
        n = m;
    } else if (i < p->len && p->s[i] == ',') {
        i++;
        size_t nd2 = 0;
        int64_t v = 0;
        while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') {
            if (v <= RE_MAX_COUNT)
                v = v * 10 + (p->s[i] - '0');
            i++;
            nd2++;
        }
        if (i >= p->len || p->s[i] != '}')
            return false;
        n = nd2 ? v : -1;
    } else {
        return false;
    }
    if (m > RE_MAX_COUNT || n > RE_MAX_COUNT) {
        re_fail(p, KVF_ERR_LIMIT, "the quantifier at offset %zu counts past %d", p->pos,
                RE_MAX_COUNT);
        return false;
    }
    if (n >= 0 && n < m) {
        re_fail(p, KVF_ERR_PARSE, "the quantifier at offset %zu has max %lld < min %lld", p->pos,
                (long long)n, (long long)m);
        return false;
    }
    p->pos = i + 1;
    *min = (int32_t)m;
    *max = (int32_t)n;
    return true;
}

static bool is_quant_at(re_parser *p)
{
    if (p->pos >= p->len)
        return false;
    unsigned c = p->s[p->pos];
    if (c == '*' || c == '+' || c == '?')
        return true;
    if (c == '{') {
        size_t i = p->pos + 1;
        return i < p->len && ((p->s[i] >= '0' && p->s[i] <= '9') || p->s[i] == ',');
    }
    return false;
}

static kvf_text_gx *parse_seq(re_parser *p)
{
    kvf_text_gx **xs = NULL;
    size_t n = 0, cap = 0;
    kvf_text_gx *res = NULL;
    bool plain = true;
    while (p->st == KVF_OK && p->pos < p->len) {
        size_t at = p->pos;
        unsigned c = p->s[p->pos];
        if (c == '|' || c == ')')
            break;
        if (c == '^' || c == '$' || c == '(' || c == '[' || c == '.' || c == '\\')
            plain = false;
        kvf_text_gx *x = NULL;
        if (c == '^') {
            p->pos++;
            if (at != 0) {
                re_fail(p, KVF_ERR_UNSUPPORTED,
                        "^ at offset %zu: only at the very start (the output is one whole match)",
                        at);
                break;
            }
            if (is_quant_at(p)) {
                re_fail(p, KVF_ERR_PARSE, "nothing to repeat at offset %zu", p->pos);
                break;
            }
            continue;
        }
        if (c == '$') {
            p->pos++;
            if (at != p->len - 1) {
                re_fail(p, KVF_ERR_UNSUPPORTED,
                        "$ at offset %zu: only at the very end (the output is one whole match)", at);
                break;
            }
            continue;
        }
        if (c == '*' || c == '+' || c == '?' || (c == '{' && is_quant_at(p))) {
            re_fail(p, KVF_ERR_PARSE, "nothing to repeat at offset %zu", at);
            break;
        }
        p->pos++;
        if (c == '(') {
            x = parse_group(p);
        } else if (c == '[') {
            x = parse_class(p);
        } else if (c == '.') {
            cp_set nl = {0};
            set_add(p, &nl, '\n', '\n');
            x = chars_of(p, &nl, true);
            free(nl.r);
        } else if (c == '\\') {
            uint32_t cp;
            cp_set set = {0};
            int k = parse_escape(p, &cp, &set, false);
            if (k == ESC_CP)
                x = lit_cp(p, cp);
            else if (k == ESC_SET)
                x = chars_of(p, &set, false);
            free(set.r);
        } else {
            p->pos--;
            uint32_t cp;
            if (next_cp(p, &cp))
                x = lit_cp(p, cp);
        }
        if (!x)
            break;
        /* quantifiers */
        if (is_quant_at(p)) {
            plain = false;
            size_t qat = p->pos;
            unsigned q = p->s[p->pos];
            int32_t min, max;
            if (q == '*') {
                min = 0, max = -1;
                p->pos++;
            } else if (q == '+') {
                min = 1, max = -1;
                p->pos++;
            } else if (q == '?') {
                min = 0, max = 1;
                p->pos++;
            } else if (!parse_braces(p, &min, &max)) {
                if (p->st == KVF_OK)
                    re_fail(p, KVF_ERR_PARSE, "a bad quantifier at offset %zu", qat);
                break;
            }
            /* lazy: the same language. Possessive is not (a*+a matches nothing) and is not
             * ECMAScript: refused. */
            if (p->pos < p->len && p->s[p->pos] == '?') {
                p->pos++;
            } else if (p->pos < p->len && p->s[p->pos] == '+') {
                re_fail(p, KVF_ERR_UNSUPPORTED,
                        "the possessive quantifier at offset %zu is not supported", qat);
                break;
            }
            if (is_quant_at(p)) {
                re_fail(p, KVF_ERR_PARSE, "multiple repeat at offset %zu (group it: (...){m})",
                        p->pos);
                break;
            }
            x = kvf_text_gx_rep(p->b, x, min, max);
            if (!x) {
                re_fail(p, KVF_ERR_LIMIT,
                        "the repetition at offset %zu makes the grammar too large (more than %d "
                        "nodes)",
                        qat, KVF_TEXT_GRAMMAR_MAX_NODES);
                break;
            }
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            kvf_text_gx **nx = realloc(xs, cap * sizeof *nx);
            if (!nx) {
                re_fail(p, KVF_ERR_NOMEM, "out of memory");
                break;
            }
            xs = nx;
        }
        xs[n++] = x;
    }
    p->plain = plain;
    if (p->st == KVF_OK) {
        res = kvf_text_gx_seq(p->b, xs, n);
        if (!res)
            re_fail(p, KVF_ERR_LIMIT, "the grammar is too large (more than %d nodes)",
                    KVF_TEXT_GRAMMAR_MAX_NODES);
    }
    free(xs);
    return res;
}

/* Alternatives that are all plain literals (a|bc|bd...) become one merged choice: as separate
 * branches each keeps a stack alive, and a long list would pass the live-stack bound. */
#define RE_MERGE_MIN 8

static kvf_text_gx *parse_alt(re_parser *p)
{
    kvf_text_gx **xs = NULL;
    size_t n = 0, cap = 0;
    kvf_text_gx *res = NULL;
    size_t *spans = NULL; /* start, end of each alternative in the regex text */
    bool all_plain = true;
    for (;;) {
        size_t start = p->pos;
        kvf_text_gx *x = parse_seq(p);
        if (!x)
            break;
        all_plain &= p->plain;
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            kvf_text_gx **nx = realloc(xs, cap * sizeof *nx);
            size_t *ns = realloc(spans, cap * 2 * sizeof *ns);
            if (nx)
                xs = nx;
            if (ns)
                spans = ns;
            if (!nx || !ns) {
                re_fail(p, KVF_ERR_NOMEM, "out of memory");
                break;
            }
        }
        spans[2 * n] = start;
        spans[2 * n + 1] = p->pos;
        xs[n++] = x;
        if (p->pos < p->len && p->s[p->pos] == '|') {
            p->pos++;
            continue;
        }
        break;
    }
    if (p->st == KVF_OK && all_plain && n >= RE_MERGE_MIN) {
        const char **strs = malloc(n * sizeof *strs);
        size_t *lens = malloc(n * sizeof *lens);
        if (strs && lens) {
            for (size_t i = 0; i < n; i++) {
                strs[i] = (const char *)p->s + spans[2 * i];
                lens[i] = spans[2 * i + 1] - spans[2 * i];
            }
            res = kvf_text_gx_choice(p->b, strs, lens, n);
        }
        free(strs);
        free(lens);
        if (!res)
            re_fail(p, KVF_ERR_LIMIT, "the grammar is too large (more than %d nodes)",
                    KVF_TEXT_GRAMMAR_MAX_NODES);
    } else if (p->st == KVF_OK) {
        res = kvf_text_gx_alt(p->b, xs, n);
        if (!res)
            re_fail(p, KVF_ERR_LIMIT, "the grammar is too large (more than %d nodes)",
                    KVF_TEXT_GRAMMAR_MAX_NODES);
    }
    p->plain = false;
    free(xs);
    free(spans);
    return res;
}

kvf_status kvf_text_regex_compile(kvf_text_gb *b, const char *re, size_t len, kvf_text_gx **out,
                                  kvf_err *err)
{
    re_parser p = {.b = b, .s = (const unsigned char *)re, .len = len, .err = err};
    kvf_text_gx *x = parse_alt(&p);
    if (p.st == KVF_OK && p.pos < p.len)
        re_fail(&p, KVF_ERR_PARSE, "an unbalanced ) at offset %zu", p.pos);
    if (p.st != KVF_OK)
        return p.st;
    if (!x)
        return re_fail(&p, KVF_ERR_INTERNAL, "no expression");
    *out = x;
    return KVF_OK;
}

kvf_status kvf_text_grammar_regex(const char *re, size_t len, kvf_text_grammar **out, kvf_err *err)
{
    kvf_text_gb *b = NULL;
    kvf_status st = kvf_text_gb_create(&b, err);
    if (st != KVF_OK)
        return st;
    kvf_text_gx *x = NULL;
    st = kvf_text_regex_compile(b, re, len, &x, err);
    if (st == KVF_OK) {
        st = kvf_text_gb_finish(b, x, out, err);
        if (st != KVF_OK)
            kvf_err_prefix(err, "regex");
    }
    kvf_text_gb_destroy(b);
    return st;
}
