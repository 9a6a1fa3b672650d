/* tokenizer_json.c: the JSON reader behind tokenizer loading (see tokenizer_json.h): strict
 * RFC 8259 (UTF-8 checked, surrogates paired, no trailing commas), one value array, strings
 * unescaped in place in a private copy of the text. */
#include "text/tokenizer_json.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/utf8.h"

#define MAX_DEPTH 256

typedef struct parser {
    kvf_text_tok_jdoc *doc;
    char *p, *end, *start;
    const char *what;
    const char *why; /* set on failure */
    char *at;        /* where it failed */
} parser;

static int64_t perr(parser *ps, char *at, const char *why)
{
    if (!ps->why) {
        ps->why = why;
        ps->at = at;
    }
    return -1;
}

static void skip_ws(parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t'))
        ps->p++;
}

static int64_t new_val(parser *ps, kvf_text_tok_jtype t)
{
    kvf_text_tok_jdoc *d = ps->doc;
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 1024;
        kvf_text_tok_jv *v = realloc(d->vals, cap * sizeof *v);
        if (!v)
            return perr(ps, ps->p, "out of memory");
        d->vals = v;
        d->cap = cap;
    }
    kvf_text_tok_jv *v = &d->vals[d->n];
    *v = (kvf_text_tok_jv){.type = (uint8_t)t};
    return (int64_t)d->n++;
}

static int hex4(const char *s, uint32_t *out)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (uint32_t)(c - 'A' + 10);
        else
            return -1;
    }
    *out = v;
    return 0;
}

/* ps->p is at the opening quote. */
static int64_t parse_string(parser *ps)
{
    char *r = ps->p + 1, *w = r, *s = r;
    for (;;) {
        if (r >= ps->end)
            return perr(ps, r, "unterminated string");
        unsigned char c = (unsigned char)*r;
        if (c == '"')
            break;
        if (c < 0x20)
            return perr(ps, r, "control character in a string");
        if (c == '\\') {
            if (r + 1 >= ps->end)
                return perr(ps, r, "unterminated string");
            char e = r[1];
            r += 2;
            switch (e) {
            case '"': *w++ = '"'; break;
            case '\\': *w++ = '\\'; break;
            case '/': *w++ = '/'; break;
            case 'b': *w++ = '\b'; break;
            case 'f': *w++ = '\f'; break;
            case 'n': *w++ = '\n'; break;
            case 'r': *w++ = '\r'; break;
            case 't': *w++ = '\t'; break;
            case 'u': {
                uint32_t cp, lo;
                if (ps->end - r < 4 || hex4(r, &cp) != 0)
                    return perr(ps, r, "bad \\u escape");
                r += 4;
                if (cp >= 0xDC00 && cp <= 0xDFFF)
                    return perr(ps, r - 6, "lone low surrogate in \\u escape");
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    if (ps->end - r < 6 || r[0] != '\\' || r[1] != 'u' || hex4(r + 2, &lo) != 0 || lo < 0xDC00 ||
                        lo > 0xDFFF)
                        return perr(ps, r - 6, "high surrogate without a low surrogate in \\u escape");
                    r += 6;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                w += kvf_text_utf8_put(cp, w);
                break;
            }
            default:
                return perr(ps, r - 2, "bad escape in a string");
            }
            continue;
        }
        if (c < 0x80) {
            *w++ = (char)c;
            r++;
            continue;
        }
        size_t k = kvf_text_utf8_len((const uint8_t *)r, (size_t)(ps->end - r));
        if (k == 0)
            return perr(ps, r, "invalid UTF-8 in a string");
        if (w != r) /* only after an escape has shrunk the string */
            for (size_t j = 0; j < k; j++)
                w[j] = r[j];
        w += k;
        r += k;
    }
    int64_t i = new_val(ps, KVF_TEXT_TOK_JSTR);
    if (i < 0)
        return -1;
    *w = 0; /* w <= r: the closing quote's place at the latest */
    kvf_text_tok_jv *v = &ps->doc->vals[i];
    v->s = s;
    v->len = (uint32_t)(w - s);
    ps->p = r + 1;
    return i;
}

static int64_t parse_number(parser *ps)
{
    char *q = ps->p, *s = q;
    bool integral = true;
    if (q < ps->end && *q == '-')
        q++;
    if (q >= ps->end || *q < '0' || *q > '9')
        return perr(ps, s, "invalid number");
    if (*q == '0')
        q++;
    else
        while (q < ps->end && *q >= '0' && *q <= '9')
            q++;
    if (q < ps->end && *q == '.') {
        integral = false;
        q++;
        if (q >= ps->end || *q < '0' || *q > '9')
            return perr(ps, s, "invalid number");
        while (q < ps->end && *q >= '0' && *q <= '9')
            q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        integral = false;
        q++;
        if (q < ps->end && (*q == '+' || *q == '-'))
            q++;
        if (q >= ps->end || *q < '0' || *q > '9')
            return perr(ps, s, "invalid number");
        while (q < ps->end && *q >= '0' && *q <= '9')
            q++;
    }
    int64_t i = new_val(ps, KVF_TEXT_TOK_JNUM);
    if (i < 0)
        return -1;
    kvf_text_tok_jv *v = &ps->doc->vals[i];
    char save = *q; /* the text copy has a NUL after the end, so q is writable */
    *q = 0;
    v->d = strtod(s, NULL);
    if (integral) {
        errno = 0;
        long long x = strtoll(s, NULL, 10);
        if (errno == 0) {
            v->is_int = 1;
            v->i = x;
        }
    }
    *q = save;
    ps->p = q;
    return i;
}

static int64_t parse_value(parser *ps, int depth);

/* Parses the members of an array or object whose opening bracket ps->p is at. */
static int64_t parse_container(parser *ps, int depth, bool obj)
{
    if (depth >= MAX_DEPTH)
        return perr(ps, ps->p, "nesting deeper than 256 levels");
    int64_t self = new_val(ps, obj ? KVF_TEXT_TOK_JOBJ : KVF_TEXT_TOK_JARR);
    if (self < 0)
        return -1;
    char close = obj ? '}' : ']';
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        return self;
    }
    int64_t prev = -1;
    uint32_t count = 0;
    for (;;) {
        int64_t first_of_item = -1;
        if (obj) {
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != '"')
                return perr(ps, ps->p, "expected a string key");
            int64_t k = parse_string(ps);
            if (k < 0)
                return -1;
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':')
                return perr(ps, ps->p, "expected ':' after a key");
            ps->p++;
            first_of_item = k;
        }
        int64_t v = parse_value(ps, depth + 1);
        if (v < 0)
            return -1;
        kvf_text_tok_jv *vals = ps->doc->vals;
        if (obj) {
            vals[first_of_item].next = (int32_t)(v - first_of_item);
        } else {
            first_of_item = v;
        }
        if (prev < 0)
            vals[self].first = (int32_t)(first_of_item - self);
        else
            vals[prev].next = (int32_t)(first_of_item - prev);
        prev = v;
        if (++count == UINT32_MAX)
            return perr(ps, ps->p, "too many members");
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            break;
        }
        return perr(ps, ps->p, obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
    ps->doc->vals[self].len = count;
    return self;
}

static int64_t parse_value(parser *ps, int depth)
{
    skip_ws(ps);
    if (ps->p >= ps->end)
        return perr(ps, ps->p, "unexpected end of input");
    switch (*ps->p) {
    case '{':
        return parse_container(ps, depth, true);
    case '[':
        return parse_container(ps, depth, false);
    case '"':
        return parse_string(ps);
    case 't':
    case 'f':
    case 'n': {
        static const char *const words[3] = {"true", "false", "null"};
        static const kvf_text_tok_jtype types[3] = {KVF_TEXT_TOK_JTRUE, KVF_TEXT_TOK_JFALSE, KVF_TEXT_TOK_JNULL};
        for (int k = 0; k < 3; k++) {
            size_t l = strlen(words[k]);
            if ((size_t)(ps->end - ps->p) >= l && memcmp(ps->p, words[k], l) == 0) {
                ps->p += l;
                return new_val(ps, types[k]);
            }
        }
        return perr(ps, ps->p, "invalid literal");
    }
    default:
        return parse_number(ps);
    }
}

kvf_status kvf_text_tok_json_parse(const char *text, size_t len, const char *what, kvf_text_tok_jdoc *doc, kvf_err *err)
{
    memset(doc, 0, sizeof *doc);
    char *buf = malloc(len + 1);
    if (!buf)
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: %s: out of memory", what);
    memcpy(buf, text, len);
    buf[len] = 0;
    return kvf_text_tok_json_parse_owned(buf, len, what, doc, err);
}

kvf_status kvf_text_tok_json_parse_owned(char *buf, size_t len, const char *what, kvf_text_tok_jdoc *doc, kvf_err *err)
{
    memset(doc, 0, sizeof *doc);
    doc->buf = buf;
    if (len >= (size_t)INT32_MAX) {
        kvf_text_tok_json_free(doc);
        return kvf_err_set(err, KVF_ERR_LIMIT, "tokenizer: %s: %zu bytes is too large", what, len);
    }
    /* about one value per 14 bytes in tokenizer files: start near that */
    doc->cap = len / 14 + 64;
    doc->vals = malloc(doc->cap * sizeof *doc->vals);
    if (!doc->vals)
        doc->cap = 0;
    const char *text = buf;
    parser ps = {.doc = doc, .p = doc->buf, .end = doc->buf + len, .start = doc->buf, .what = what};
    int64_t root = parse_value(&ps, 0);
    if (root >= 0) {
        skip_ws(&ps);
        if (ps.p < ps.end)
            perr(&ps, ps.p, "unexpected text after the value");
    }
    if (ps.why) {
        /* line and column of the failure (escapes before it may have shrunk strings: close enough) */
        size_t off = (size_t)(ps.at - doc->buf), line = 1, col = 1;
        for (size_t i = 0; i < off && i < len; i++) {
            if (text[i] == '\n')
                line++, col = 1;
            else
                col++;
        }
        kvf_status st = strcmp(ps.why, "out of memory") == 0 ? KVF_ERR_NOMEM : KVF_ERR_PARSE;
        kvf_text_tok_json_free(doc);
        return kvf_err_set(err, st, "tokenizer: %s: line %zu column %zu: %s", what, line, col, ps.why);
    }
    return KVF_OK;
}

void kvf_text_tok_json_free(kvf_text_tok_jdoc *doc)
{
    free(doc->buf);
    free(doc->vals);
    memset(doc, 0, sizeof *doc);
}

const kvf_text_tok_jv *kvf_text_tok_json_root(const kvf_text_tok_jdoc *doc)
{
    return doc->n ? &doc->vals[0] : NULL;
}

const kvf_text_tok_jv *kvf_text_tok_jfirst(const kvf_text_tok_jv *c)
{
    return c && (c->type == KVF_TEXT_TOK_JARR || c->type == KVF_TEXT_TOK_JOBJ) && c->first ? c + c->first : NULL;
}

const kvf_text_tok_jv *kvf_text_tok_jnext(const kvf_text_tok_jv *v)
{
    return v && v->next ? v + v->next : NULL;
}

const kvf_text_tok_jv *kvf_text_tok_jget(const kvf_text_tok_jv *obj, const char *key)
{
    if (!obj || obj->type != KVF_TEXT_TOK_JOBJ)
        return NULL;
    size_t kl = strlen(key);
    const kvf_text_tok_jv *found = NULL;
    for (const kvf_text_tok_jv *k = kvf_text_tok_jfirst(obj); k; k = kvf_text_tok_jnext(kvf_text_tok_jnext(k)))
        if (k->len == kl && memcmp(k->s, key, kl) == 0)
            found = kvf_text_tok_jnext(k); /* the last duplicate wins, as in most readers */
    return found;
}

const kvf_text_tok_jv *kvf_text_tok_jat(const kvf_text_tok_jv *arr, size_t i)
{
    if (!arr || arr->type != KVF_TEXT_TOK_JARR)
        return NULL;
    const kvf_text_tok_jv *v = kvf_text_tok_jfirst(arr);
    while (v && i-- > 0)
        v = kvf_text_tok_jnext(v);
    return v;
}

size_t kvf_text_tok_jsize(const kvf_text_tok_jv *v)
{
    return v && (v->type == KVF_TEXT_TOK_JARR || v->type == KVF_TEXT_TOK_JOBJ) ? v->len : 0;
}

const char *kvf_text_tok_jstr(const kvf_text_tok_jv *v)
{
    return v && v->type == KVF_TEXT_TOK_JSTR ? v->s : NULL;
}

bool kvf_text_tok_jis(const kvf_text_tok_jv *v, kvf_text_tok_jtype t)
{
    return v && v->type == t;
}

bool kvf_text_tok_jtrue(const kvf_text_tok_jv *v)
{
    return v && v->type == KVF_TEXT_TOK_JTRUE;
}

const char *kvf_text_tok_jkind(const kvf_text_tok_jv *v)
{
    switch (v ? v->type : KVF_TEXT_TOK_JNULL) {
    case KVF_TEXT_TOK_JOBJ: return "an object";
    case KVF_TEXT_TOK_JARR: return "an array";
    case KVF_TEXT_TOK_JSTR: return "a string";
    case KVF_TEXT_TOK_JNUM: return v->is_int ? "an integer" : "a number";
    case KVF_TEXT_TOK_JTRUE:
    case KVF_TEXT_TOK_JFALSE: return "a boolean";
    default: return "null";
    }
}
