/* jinja_parse.c: the chat-template interpreter's lexer and parser: template text to tokens
 * (with Jinja's whitespace control: `-`, `+`, trim_blocks, lstrip_blocks) and tokens to the
 * tree in jinja_int.h. Errors name the line and column and what was unexpected. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja.h"
#include "text/jinja_int.h"

/* ---- tokens ----------------------------------------------------------------------------- */

typedef enum tok_type {
    T_EOF,
    T_TEXT,
    T_VAR_BEGIN,
    T_VAR_END,
    T_BLOCK_BEGIN,
    T_BLOCK_END,
    T_NAME,
    T_STRING,
    T_INT,
    T_FLOAT,
    T_OP,
} tok_type;

typedef struct tok {
    uint8_t type;
    int32_t line, col;
    const char *s; /* T_NAME, T_OP: the text (arena, NUL-terminated) */
    jv lit;        /* T_TEXT, T_STRING, T_INT, T_FLOAT */
} tok;

typedef struct lexer {
    const char *src;
    size_t len, pos;
    unsigned flags;
    jarena *arena;
    tok *toks;
    size_t n, cap;
    /* line/column of an offset, computed forward from the last one asked */
    size_t lc_off;
    int32_t lc_line, lc_col;
    kvf_err *err;
} lexer;

static void linecol(lexer *L, size_t off, int32_t *line, int32_t *col)
{
    if (off < L->lc_off) {
        L->lc_off = 0;
        L->lc_line = 1;
        L->lc_col = 1;
    }
    for (; L->lc_off < off && L->lc_off < L->len; L->lc_off++) {
        unsigned char c = (unsigned char)L->src[L->lc_off];
        if (c == '\n') {
            L->lc_line++;
            L->lc_col = 1;
        } else if ((c & 0xc0) != 0x80) {
            L->lc_col++;
        }
    }
    *line = L->lc_line;
    *col = L->lc_col;
}

static kvf_status lex_fail(lexer *L, size_t off, const char *fmt, const char *arg)
{
    int32_t line, col;
    linecol(L, off, &line, &col);
    char what[256];
    snprintf(what, sizeof what, fmt, arg);
    return kvf_err_set(L->err, KVF_ERR_PARSE, "line %d col %d: %s", line, col, what);
}

static tok *push_tok(lexer *L, tok_type type, size_t off)
{
    if (L->n == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        tok *t = realloc(L->toks, cap * sizeof *t);
        if (!t)
            return NULL;
        L->toks = t;
        L->cap = cap;
    }
    tok *t = &L->toks[L->n++];
    memset(t, 0, sizeof *t);
    t->type = (uint8_t)type;
    linecol(L, off, &t->line, &t->col);
    return t;
}

static char *arena_cstr(jarena *a, const char *s, size_t n)
{
    char *p = jarena_alloc(a, n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
static bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static void put_utf8(char *out, size_t *n, uint32_t cp)
{
    if (cp < 0x80) {
        out[(*n)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*n)++] = (char)(0xc0 | (cp >> 6));
        out[(*n)++] = (char)(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
        out[(*n)++] = (char)(0xe0 | (cp >> 12));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[(*n)++] = (char)(0x80 | (cp & 0x3f));
    } else {
        out[(*n)++] = (char)(0xf0 | (cp >> 18));
        out[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3f));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[(*n)++] = (char)(0x80 | (cp & 0x3f));
    }
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* A quoted string at L->pos, with Python's escapes. */
static kvf_status lex_string(lexer *L)
{
    size_t start = L->pos;
    char q = L->src[L->pos++];
    char *buf = malloc(L->len - start + 1);
    if (!buf)
        return kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
    size_t n = 0;
    for (;;) {
        if (L->pos >= L->len) {
            free(buf);
            return lex_fail(L, start, "unterminated string starting here%s", "");
        }
        char c = L->src[L->pos++];
        if (c == q)
            break;
        if (c != '\\' || L->pos >= L->len) {
            buf[n++] = c;
            continue;
        }
        char e = L->src[L->pos++];
        int digits = 0;
        switch (e) {
        case 'n': buf[n++] = '\n'; break;
        case 't': buf[n++] = '\t'; break;
        case 'r': buf[n++] = '\r'; break;
        case 'a': buf[n++] = '\a'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'v': buf[n++] = '\v'; break;
        case '0': buf[n++] = '\0'; break;
        case '\\': buf[n++] = '\\'; break;
        case '\'': buf[n++] = '\''; break;
        case '"': buf[n++] = '"'; break;
        case '\n': break;
        case 'x': digits = 2; break;
        case 'u': digits = 4; break;
        case 'U': digits = 8; break;
        default:
            buf[n++] = '\\';
            buf[n++] = e;
        }
        if (digits) {
            uint32_t cp = 0;
            int k;
            for (k = 0; k < digits && L->pos < L->len && hexval(L->src[L->pos]) >= 0; k++)
                cp = cp * 16 + (uint32_t)hexval(L->src[L->pos++]);
            if (k < digits || cp > 0x10ffff) {
                free(buf);
                return lex_fail(L, L->pos, "bad \\%s escape in a string", e == 'x' ? "x" : e == 'u' ? "u" : "U");
            }
            put_utf8(buf, &n, cp);
        }
    }
    tok *t = push_tok(L, T_STRING, start);
    bool ok = t && jarena_str(L->arena, buf, n, &t->lit);
    free(buf);
    return ok ? KVF_OK : kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
}

static kvf_status lex_number(lexer *L)
{
    size_t start = L->pos, p = L->pos;
    bool is_float = false;
    while (p < L->len && (is_digit(L->src[p]) || (L->src[p] == '_' && p + 1 < L->len && is_digit(L->src[p + 1]))))
        p++;
    if (p + 1 < L->len && L->src[p] == '.' && is_digit(L->src[p + 1])) {
        is_float = true;
        p++;
        while (p < L->len && is_digit(L->src[p]))
            p++;
    }
    if (p < L->len && (L->src[p] == 'e' || L->src[p] == 'E')) {
        size_t q = p + 1;
        if (q < L->len && (L->src[q] == '+' || L->src[q] == '-'))
            q++;
        if (q < L->len && is_digit(L->src[q])) {
            is_float = true;
            p = q;
            while (p < L->len && is_digit(L->src[p]))
                p++;
        }
    }
    char buf[128];
    size_t n = 0;
    for (size_t i = start; i < p && n + 1 < sizeof buf; i++)
        if (L->src[i] != '_')
            buf[n++] = L->src[i];
    buf[n] = 0;
    L->pos = p;
    tok *t = push_tok(L, is_float ? T_FLOAT : T_INT, start);
    if (!t)
        return kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
    errno = 0;
    if (is_float) {
        t->lit = jv_float(strtod(buf, NULL));
    } else {
        long long v = strtoll(buf, NULL, 10);
        if (errno == ERANGE || p - start > 100)
            return lex_fail(L, start, "integer %s is too large (64-bit integers only)", buf);
        t->lit = jv_int(v);
    }
    return KVF_OK;
}

static const char *const ops2[] = {"//", "**", "==", "!=", "<=", ">=", NULL};
static const char ops1[] = "+-*/%~|.,:()[]{}<>=";

/* The tokens inside a {{ }} or {% %} tag, up to and including its end. *rmod_out is the
 * character before the end ('-', '+' or 0). */
static kvf_status lex_tag(lexer *L, bool is_block, char *rmod_out, size_t *name_tok_out)
{
    int balance = 0;
    *name_tok_out = L->n;
    for (;;) {
        while (L->pos < L->len && is_ws(L->src[L->pos]))
            L->pos++;
        if (L->pos >= L->len)
            return lex_fail(L, L->pos, "unexpected end of template, expected '%s'", is_block ? "%}" : "}}");
        const char *s = L->src + L->pos;
        size_t left = L->len - L->pos;
        char end0 = is_block ? '%' : '}';
        if (balance == 0) {
            char mod = 0;
            size_t skip = 0;
            if ((s[0] == '-' || s[0] == '+') && left >= 3 && s[1] == end0 && s[2] == '}')
                mod = s[0], skip = 3;
            else if (left >= 2 && s[0] == end0 && s[1] == '}')
                skip = 2;
            if (skip && !(mod == '+' && !is_block)) {
                if (!push_tok(L, is_block ? T_BLOCK_END : T_VAR_END, L->pos))
                    return kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
                L->pos += skip;
                *rmod_out = mod;
                return KVF_OK;
            }
        }
        kvf_status st;
        if (s[0] == '"' || s[0] == '\'') {
            if ((st = lex_string(L)) != KVF_OK)
                return st;
            continue;
        }
        if (is_digit(s[0])) {
            if ((st = lex_number(L)) != KVF_OK)
                return st;
            continue;
        }
        if (is_alpha(s[0])) {
            size_t n = 1;
            while (n < left && (is_alpha(s[n]) || is_digit(s[n])))
                n++;
            tok *t = push_tok(L, T_NAME, L->pos);
            if (!t || !(t->s = arena_cstr(L->arena, s, n)))
                return kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
            L->pos += n;
            continue;
        }
        size_t n = 0;
        for (int i = 0; ops2[i]; i++)
            if (left >= 2 && s[0] == ops2[i][0] && s[1] == ops2[i][1])
                n = 2;
        if (!n && strchr(ops1, s[0]) && s[0])
            n = 1;
        if (!n) {
            char c[8];
            if ((unsigned char)s[0] < 0x20 || (unsigned char)s[0] >= 0x7f)
                snprintf(c, sizeof c, "\\x%02x", (unsigned char)s[0]);
            else
                snprintf(c, sizeof c, "%c", s[0]);
            return lex_fail(L, L->pos, "unexpected character '%s'", c);
        }
        if (s[0] == '(' || s[0] == '[' || s[0] == '{')
            balance++;
        else if ((s[0] == ')' || s[0] == ']' || s[0] == '}') && balance > 0)
            balance--;
        tok *t = push_tok(L, T_OP, L->pos);
        if (!t || !(t->s = arena_cstr(L->arena, s, n)))
            return kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
        L->pos += n;
    }
}

static kvf_status emit_text(lexer *L, size_t off, const char *s, size_t n)
{
    if (n == 0)
        return KVF_OK;
    tok *t = push_tok(L, T_TEXT, off);
    if (!t || !jarena_str(L->arena, s, n, &t->lit))
        return kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
    return KVF_OK;
}

/* Finds the {% endraw %} that closes a raw block; returns its start and sets *after past it. */
static bool find_endraw(lexer *L, size_t from, size_t *start_out, size_t *after_out, char *lmod,
                        char *rmod)
{
    for (size_t p = from; p + 1 < L->len; p++) {
        if (L->src[p] != '{' || L->src[p + 1] != '%')
            continue;
        size_t q = p + 2;
        char lm = 0;
        if (q < L->len && (L->src[q] == '-' || L->src[q] == '+'))
            lm = L->src[q++];
        while (q < L->len && is_ws(L->src[q]))
            q++;
        if (q + 6 > L->len || memcmp(L->src + q, "endraw", 6) != 0)
            continue;
        q += 6;
        while (q < L->len && is_ws(L->src[q]))
            q++;
        char rm = 0;
        if (q < L->len && (L->src[q] == '-' || L->src[q] == '+'))
            rm = L->src[q++];
        if (q + 1 < L->len && L->src[q] == '%' && L->src[q + 1] == '}') {
            *start_out = p;
            *after_out = q + 2;
            *lmod = lm;
            *rmod = rm;
            return true;
        }
    }
    return false;
}

static kvf_status lex_all(lexer *L)
{
    bool strip_next = false, trim_next = false;
    bool trim = (L->flags & KVF_TEXT_JINJA_TRIM_BLOCKS) != 0;
    bool lstrip = (L->flags & KVF_TEXT_JINJA_LSTRIP_BLOCKS) != 0;
    kvf_status st;
    while (L->pos <= L->len) {
        /* the text up to the next tag */
        size_t tag = L->pos;
        while (tag + 1 < L->len &&
               !(L->src[tag] == '{' && (L->src[tag + 1] == '{' || L->src[tag + 1] == '%' || L->src[tag + 1] == '#')))
            tag++;
        bool found = tag + 1 < L->len;
        if (!found)
            tag = L->len;
        size_t ts = L->pos, te = tag;
        if (strip_next) {
            while (ts < te && is_ws(L->src[ts]))
                ts++;
        } else if (trim_next) {
            if (ts < te && L->src[ts] == '\n')
                ts++;
            else if (ts + 1 < te && L->src[ts] == '\r' && L->src[ts + 1] == '\n')
                ts += 2;
        }
        char kind = found ? L->src[tag + 1] : 0;
        char lmod = found && tag + 2 < L->len ? L->src[tag + 2] : 0;
        if ((lmod != '-' && lmod != '+') || (lmod == '+' && kind == '{'))
            lmod = 0;
        if (lmod == '-') {
            while (te > ts && is_ws(L->src[te - 1]))
                te--;
        } else if (lmod == 0 && lstrip && (kind == '%' || kind == '#')) {
            size_t l = te;
            while (l > ts && (L->src[l - 1] == ' ' || L->src[l - 1] == '\t' || L->src[l - 1] == '\v' ||
                              L->src[l - 1] == '\f' || L->src[l - 1] == '\r'))
                l--;
            /* only when the tag starts its line (after what the previous tag consumed) */
            bool line_starting = ts == 0 || (ts > L->pos && L->src[ts - 1] == '\n');
            if ((l > ts && L->src[l - 1] == '\n') || (l == ts && line_starting))
                te = l;
        }
        if ((st = emit_text(L, ts, L->src + ts, te - ts)) != KVF_OK)
            return st;
        if (!found)
            break;

        size_t body = tag + 2 + (lmod ? 1 : 0);
        char rmod = 0;
        if (kind == '#') {
            size_t p = body;
            while (p + 1 < L->len && !(L->src[p] == '#' && L->src[p + 1] == '}'))
                p++;
            if (p + 1 >= L->len)
                return lex_fail(L, tag, "unterminated comment starting here%s", "");
            if (p > body && (L->src[p - 1] == '-' || L->src[p - 1] == '+'))
                rmod = L->src[p - 1];
            L->pos = p + 2;
        } else {
            if (!push_tok(L, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN, tag))
                return kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
            L->pos = body;
            size_t first;
            if ((st = lex_tag(L, kind == '%', &rmod, &first)) != KVF_OK)
                return st;
            /* {% raw %}: everything up to {% endraw %} is text */
            if (kind == '%' && L->n == first + 2 && L->toks[first].type == T_NAME &&
                strcmp(L->toks[first].s, "raw") == 0) {
                L->n -= 3; /* drop BEGIN raw END */
                size_t rs, after;
                char elmod, ermod;
                if (!find_endraw(L, L->pos, &rs, &after, &elmod, &ermod))
                    return lex_fail(L, tag, "'raw' block is never closed with 'endraw'%s", "");
                size_t a = L->pos, b = rs; /* (trim_blocks does not apply after raw) */
                if (rmod == '-')
                    while (a < b && is_ws(L->src[a]))
                        a++;
                if (elmod == '-')
                    while (b > a && is_ws(L->src[b - 1]))
                        b--;
                if ((st = emit_text(L, a, L->src + a, b - a)) != KVF_OK)
                    return st;
                L->pos = after;
                rmod = ermod;
            }
        }
        strip_next = rmod == '-';
        trim_next = rmod == 0 && trim && kind != '{';
    }
    tok *t = push_tok(L, T_EOF, L->len);
    return t ? KVF_OK : kvf_err_set(L->err, KVF_ERR_NOMEM, "out of memory");
}

/* ---- parser ----------------------------------------------------------------------------- */

typedef struct parser {
    tok *t;
    size_t n, i;
    jarena *arena;
    kvf_err *err;
    int depth;
    bool failed;
} parser;

typedef struct nvec {
    jnode **v;
    const char **kw;
    size_t n, cap;
    bool has_kw;
} nvec;

static tok *cur(parser *P) { return &P->t[P->i]; }
static tok *peek(parser *P, size_t k) { return &P->t[P->i + k < P->n ? P->i + k : P->n - 1]; }
static void adv(parser *P)
{
    if (P->i + 1 < P->n)
        P->i++;
}

static const char *tok_desc(tok *t, char *buf, size_t cap)
{
    switch (t->type) {
    case T_EOF: return "end of template";
    case T_TEXT: return "template text";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "'}}'";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "'%}'";
    case T_NAME:
    case T_OP: snprintf(buf, cap, "'%s'", t->s); return buf;
    case T_STRING: snprintf(buf, cap, "string '%.40s'", t->lit.u.s->s); return buf;
    case T_INT:
    case T_FLOAT: return "number";
    }
    return "?";
}

static jnode *fail_at(parser *P, tok *t, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static jnode *fail_at(parser *P, tok *t, const char *fmt, ...)
{
    if (P->failed)
        return NULL;
    P->failed = true;
    char what[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    kvf_err_set(P->err, KVF_ERR_PARSE, "line %d col %d: %s", t->line, t->col, what);
    return NULL;
}

static jnode *unexpected(parser *P, const char *expected)
{
    char buf[80];
    tok *t = cur(P);
    return fail_at(P, t, "unexpected %s (expected %s)", tok_desc(t, buf, sizeof buf), expected);
}

static jnode *oom(parser *P)
{
    if (!P->failed) {
        P->failed = true;
        kvf_err_set(P->err, KVF_ERR_NOMEM, "out of memory");
    }
    return NULL;
}

static jnode *mk(parser *P, jn_kind kind, tok *at)
{
    jnode *n = jarena_alloc(P->arena, sizeof *n);
    if (!n)
        return oom(P);
    n->kind = (uint8_t)kind;
    n->fn = -1;
    n->line = at->line;
    n->col = at->col;
    return n;
}

static bool vpush(parser *P, nvec *v, jnode *n, const char *kw)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 8;
        jnode **nv = realloc(v->v, cap * sizeof *nv);
        if (nv)
            v->v = nv;
        const char **nk = nv ? realloc(v->kw, cap * sizeof *nk) : NULL;
        if (!nk) {
            oom(P);
            return false;
        }
        v->kw = nk;
        v->cap = cap;
    }
    v->v[v->n] = n;
    v->kw[v->n++] = kw;
    if (kw)
        v->has_kw = true;
    return true;
}

/* Moves v's items into n->kids (and n->kw) in the arena; frees v. */
static jnode *vfinish(parser *P, jnode *n, nvec *v)
{
    if (n && !P->failed && v->n) {
        n->kids = jarena_alloc(P->arena, v->n * sizeof *n->kids);
        if (!n->kids) {
            n = oom(P);
        } else {
            memcpy(n->kids, v->v, v->n * sizeof *n->kids);
            n->n_kids = v->n;
            if (v->has_kw) {
                n->kw = jarena_alloc(P->arena, v->n * sizeof *n->kw);
                if (!n->kw)
                    n = oom(P);
                else
                    memcpy(n->kw, v->kw, v->n * sizeof *n->kw);
            }
        }
    }
    free(v->v);
    free(v->kw);
    memset(v, 0, sizeof *v);
    return P->failed ? NULL : n;
}

static bool is_op(tok *t, const char *op) { return t->type == T_OP && strcmp(t->s, op) == 0; }
static bool is_name(tok *t, const char *name) { return t->type == T_NAME && strcmp(t->s, name) == 0; }

static bool expect_op(parser *P, const char *op)
{
    if (!is_op(cur(P), op)) {
        char want[16];
        snprintf(want, sizeof want, "'%s'", op);
        unexpected(P, want);
        return false;
    }
    adv(P);
    return true;
}

static bool enter(parser *P)
{
    if (++P->depth > JINJA_MAX_NEST) {
        fail_at(P, cur(P), "nested too deeply (more than %d levels)", JINJA_MAX_NEST);
        return false;
    }
    return true;
}

static jnode *parse_expr(parser *P, bool with_cond);
static jnode *parse_or(parser *P);
static jnode *parse_unary(parser *P, bool with_filter);
static jnode *parse_primary(parser *P);

/* Call arguments after '(' up to ')': positional and name=value. */
static bool parse_args(parser *P, nvec *args)
{
    if (!expect_op(P, "("))
        return false;
    while (!is_op(cur(P), ")")) {
        if (args->n && !expect_op(P, ","))
            return false;
        if (is_op(cur(P), ")"))
            break; /* trailing comma */
        const char *kw = NULL;
        if (cur(P)->type == T_NAME && is_op(peek(P, 1), "=")) {
            kw = cur(P)->s;
            adv(P);
            adv(P);
        } else if (args->has_kw) {
            unexpected(P, "a keyword argument (positional arguments come first)");
            return false;
        }
        jnode *a = parse_expr(P, true);
        if (!a || !vpush(P, args, a, kw))
            return false;
    }
    adv(P);
    return true;
}

static jnode *parse_call(parser *P, jnode *callee)
{
    tok *at = cur(P);
    jnode *n = mk(P, JN_CALL, at);
    nvec args = {0};
    if (!n || !parse_args(P, &args))
        return vfinish(P, NULL, &args);
    n->a = callee;
    /* the name resolves once, here: a method of whatever the attribute's object turns out to
     * be, or a global function unless a variable of that name shadows it when it runs */
    if (callee->kind == JN_ATTR)
        n->fn = (int16_t)kvf_text_jinja_method_id(callee->name);
    else if (callee->kind == JN_NAME)
        n->fn = (int16_t)kvf_text_jinja_global_id(callee->name);
    return vfinish(P, n, &args);
}

static jnode *parse_subscript(parser *P, jnode *obj)
{
    tok *at = cur(P);
    if (is_op(at, ".")) {
        adv(P);
        tok *t = cur(P);
        if (t->type == T_NAME) {
            jnode *n = mk(P, JN_ATTR, at);
            if (!n)
                return NULL;
            n->a = obj;
            n->name = t->s;
            adv(P);
            return n;
        }
        if (t->type == T_INT) { /* x.0 is x[0] */
            jnode *n = mk(P, JN_ITEM, at), *k = mk(P, JN_LIT, t);
            if (!n || !k)
                return NULL;
            k->lit = t->lit;
            n->a = obj;
            n->b = k;
            adv(P);
            return n;
        }
        return unexpected(P, "an attribute name after '.'");
    }
    adv(P); /* '[' */
    jnode *parts[3] = {NULL, NULL, NULL};
    int n_colons = 0;
    for (;;) {
        if (is_op(cur(P), "]"))
            break;
        if (is_op(cur(P), ":")) {
            if (++n_colons > 2)
                return unexpected(P, "']'");
            adv(P);
            continue;
        }
        if (parts[n_colons])
            return unexpected(P, "':' or ']'");
        if (!(parts[n_colons] = parse_expr(P, true)))
            return NULL;
    }
    adv(P);
    if (n_colons == 0) {
        if (!parts[0])
            return fail_at(P, at, "empty subscript '[]'");
        jnode *n = mk(P, JN_ITEM, at);
        if (n) {
            n->a = obj;
            n->b = parts[0];
        }
        return n;
    }
    jnode *n = mk(P, JN_SLICE, at);
    if (n) {
        n->a = obj;
        n->b = parts[0];
        n->c = parts[1];
        n->d = parts[2];
    }
    return n;
}

static jnode *parse_postfix(parser *P, jnode *n)
{
    while (n) {
        tok *t = cur(P);
        if (is_op(t, ".") || is_op(t, "["))
            n = parse_subscript(P, n);
        else if (is_op(t, "("))
            n = parse_call(P, n);
        else
            break;
    }
    return n;
}

/* name(.name)* after '|' or 'is' */
static const char *parse_dotted_name(parser *P)
{
    if (cur(P)->type != T_NAME) {
        unexpected(P, "a name");
        return NULL;
    }
    const char *name = cur(P)->s;
    adv(P);
    while (is_op(cur(P), ".") && peek(P, 1)->type == T_NAME) {
        size_t a = strlen(name), b = strlen(peek(P, 1)->s);
        char *s = jarena_alloc(P->arena, a + b + 2);
        if (!s) {
            oom(P);
            return NULL;
        }
        memcpy(s, name, a);
        s[a] = '.';
        memcpy(s + a + 1, peek(P, 1)->s, b + 1);
        name = s;
        adv(P);
        adv(P);
    }
    return name;
}

static bool test_takes_arg(const char *name)
{
    static const char *const with_arg[] = {"divisibleby", "sameas", "eq", "equalto", "ne", "lt",
                                           "lessthan", "le", "gt", "greaterthan", "ge", "in", NULL};
    for (int i = 0; with_arg[i]; i++)
        if (strcmp(name, with_arg[i]) == 0)
            return true;
    return false;
}

static jnode *parse_filter_expr(parser *P, jnode *n)
{
    while (n) {
        tok *t = cur(P);
        if (is_op(t, "|")) {
            adv(P);
            jnode *f = mk(P, JN_FILTER, t);
            if (!f || !(f->name = parse_dotted_name(P)))
                return NULL;
            f->fn = (int16_t)kvf_text_jinja_filter_id(f->name);
            f->a = n;
            nvec args = {0};
            if (is_op(cur(P), "(") && !parse_args(P, &args))
                return vfinish(P, NULL, &args);
            n = vfinish(P, f, &args);
        } else if (is_name(t, "is")) {
            adv(P);
            jnode *f = mk(P, JN_TEST, t);
            if (!f)
                return NULL;
            if (is_name(cur(P), "not")) {
                f->op = 1;
                adv(P);
            }
            if (!(f->name = parse_dotted_name(P)))
                return NULL;
            f->fn = (int16_t)kvf_text_jinja_test_id(f->name);
            f->a = n;
            nvec args = {0};
            if (is_op(cur(P), "(")) {
                if (!parse_args(P, &args))
                    return vfinish(P, NULL, &args);
            } else if (test_takes_arg(f->name)) {
                tok *a = cur(P);
                if (a->type == T_NAME || a->type == T_STRING || a->type == T_INT ||
                    a->type == T_FLOAT || is_op(a, "(") || is_op(a, "[") || is_op(a, "{") ||
                    is_op(a, "-")) {
                    jnode *arg = parse_unary(P, false);
                    if (!arg || !vpush(P, &args, arg, NULL))
                        return vfinish(P, NULL, &args);
                }
            }
            n = vfinish(P, f, &args);
        } else if (is_op(t, "(")) {
            n = parse_call(P, n);
        } else {
            break;
        }
    }
    return n;
}

static jnode *parse_unary(parser *P, bool with_filter)
{
    if (!enter(P))
        return NULL;
    tok *t = cur(P);
    jnode *n;
    if (is_op(t, "-") || is_op(t, "+")) {
        adv(P);
        n = mk(P, is_op(t, "-") ? JN_NEG : JN_POS, t);
        if (n && !(n->a = parse_unary(P, false)))
            n = NULL;
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter)
        n = parse_filter_expr(P, n);
    P->depth--;
    return n;
}

static jnode *bin(parser *P, tok *at, jn_op op, jnode *a, jnode *b)
{
    if (!a || !b)
        return NULL;
    jnode *n = mk(P, JN_BIN, at);
    if (n) {
        n->op = (uint8_t)op;
        n->a = a;
        n->b = b;
    }
    return n;
}

static jnode *parse_pow(parser *P)
{
    jnode *n = parse_unary(P, true);
    while (n && is_op(cur(P), "**")) {
        tok *t = cur(P);
        adv(P);
        n = bin(P, t, JOP_POW, n, parse_unary(P, true));
    }
    return n;
}

static jnode *parse_math2(parser *P)
{
    jnode *n = parse_pow(P);
    for (;;) {
        tok *t = cur(P);
        jn_op op = is_op(t, "*") ? JOP_MUL : is_op(t, "/") ? JOP_DIV : is_op(t, "//") ? JOP_FLOORDIV
                 : is_op(t, "%") ? JOP_MOD : 0;
        if (!n || !op)
            return n;
        adv(P);
        n = bin(P, t, op, n, parse_pow(P));
    }
}

static jnode *parse_concat(parser *P)
{
    jnode *n = parse_math2(P);
    while (n && is_op(cur(P), "~")) {
        tok *t = cur(P);
        adv(P);
        n = bin(P, t, JOP_CONCAT, n, parse_math2(P));
    }
    return n;
}

static jnode *parse_math1(parser *P)
{
    jnode *n = parse_concat(P);
    for (;;) {
        tok *t = cur(P);
        jn_op op = is_op(t, "+") ? JOP_ADD : is_op(t, "-") ? JOP_SUB : 0;
        if (!n || !op)
            return n;
        adv(P);
        n = bin(P, t, op, n, parse_concat(P));
    }
}

/* Comparisons chain as in Python: a < b < c is (a < b) and (b < c). */
static jnode *parse_compare(parser *P)
{
    jnode *left = parse_math1(P), *result = NULL;
    for (;;) {
        tok *t = cur(P);
        jn_op op = is_op(t, "==") ? JOP_EQ : is_op(t, "!=") ? JOP_NE : is_op(t, "<") ? JOP_LT
                 : is_op(t, "<=") ? JOP_LE : is_op(t, ">") ? JOP_GT : is_op(t, ">=") ? JOP_GE
                 : is_name(t, "in") ? JOP_IN : 0;
        if (!op && is_name(t, "not") && is_name(peek(P, 1), "in")) {
            op = JOP_NOTIN;
            adv(P);
        }
        if (!left || !op)
            break;
        adv(P);
        jnode *right = parse_math1(P);
        jnode *cmp = bin(P, t, op, left, right);
        if (!cmp)
            return NULL;
        if (result) {
            jnode *a = mk(P, JN_AND, t);
            if (!a)
                return NULL;
            a->a = result;
            a->b = cmp;
            result = a;
        } else {
            result = cmp;
        }
        left = right;
    }
    return result ? result : left;
}

static jnode *parse_not(parser *P)
{
    tok *t = cur(P);
    if (is_name(t, "not")) {
        if (!enter(P))
            return NULL;
        adv(P);
        jnode *n = mk(P, JN_NOT, t);
        if (n && !(n->a = parse_not(P)))
            n = NULL;
        P->depth--;
        return n;
    }
    return parse_compare(P);
}

static jnode *parse_and(parser *P)
{
    jnode *n = parse_not(P);
    while (n && is_name(cur(P), "and")) {
        tok *t = cur(P);
        adv(P);
        jnode *a = mk(P, JN_AND, t);
        if (!a || !(a->b = parse_not(P)))
            return NULL;
        a->a = n;
        n = a;
    }
    return n;
}

static jnode *parse_or(parser *P)
{
    jnode *n = parse_and(P);
    while (n && is_name(cur(P), "or")) {
        tok *t = cur(P);
        adv(P);
        jnode *a = mk(P, JN_OR, t);
        if (!a || !(a->b = parse_and(P)))
            return NULL;
        a->a = n;
        n = a;
    }
    return n;
}

static jnode *parse_expr(parser *P, bool with_cond)
{
    if (!enter(P))
        return NULL;
    jnode *n = parse_or(P);
    while (with_cond && n && is_name(cur(P), "if")) {
        tok *t = cur(P);
        adv(P);
        jnode *c = mk(P, JN_COND, t);
        if (!c || !(c->a = parse_or(P))) {
            n = NULL;
            break;
        }
        c->b = n;
        if (is_name(cur(P), "else")) {
            adv(P);
            if (!(c->c = parse_expr(P, true))) {
                n = NULL;
                break;
            }
        }
        n = c;
    }
    P->depth--;
    return n;
}

/* expr, expr, ... as a tuple when there is a comma (or explicit parentheses make it one). */
static jnode *parse_tuple(parser *P, bool with_cond, bool parens)
{
    tok *at = cur(P);
    nvec items = {0};
    bool comma = false;
    for (;;) {
        if (items.n && !is_op(cur(P), ","))
            break;
        if (items.n) {
            adv(P);
            comma = true;
        }
        tok *t = cur(P);
        if (t->type == T_VAR_END || t->type == T_BLOCK_END || is_op(t, ")") || is_op(t, "=") ||
            (items.n && (is_name(t, "if") || is_name(t, "recursive"))))
            break;
        jnode *e = parse_expr(P, with_cond);
        if (!e || !vpush(P, &items, e, NULL))
            return vfinish(P, NULL, &items);
    }
    if (!items.n && !parens) {
        vfinish(P, NULL, &items);
        return unexpected(P, "an expression");
    }
    if (items.n == 1 && !comma) {
        jnode *only = items.v[0];
        vfinish(P, NULL, &items);
        return only;
    }
    return vfinish(P, mk(P, JN_TUPLE, at), &items);
}

static jnode *parse_primary(parser *P)
{
    tok *t = cur(P);
    char buf[80];
    switch (t->type) {
    case T_NAME: {
        jnode *n = mk(P, JN_LIT, t);
        if (!n)
            return NULL;
        if (strcmp(t->s, "true") == 0 || strcmp(t->s, "True") == 0)
            n->lit = jv_bool(true);
        else if (strcmp(t->s, "false") == 0 || strcmp(t->s, "False") == 0)
            n->lit = jv_bool(false);
        else if (strcmp(t->s, "none") == 0 || strcmp(t->s, "None") == 0)
            n->lit = jv_none();
        else {
            n->kind = JN_NAME;
            n->name = t->s;
        }
        adv(P);
        return n;
    }
    case T_STRING: {
        jnode *n = mk(P, JN_LIT, t);
        if (!n)
            return NULL;
        n->lit = t->lit;
        adv(P);
        if (cur(P)->type == T_STRING) { /* adjacent strings concatenate */
            kvf_sbuf b;
            kvf_sbuf_init(&b);
            kvf_sbuf_append(&b, t->lit.u.s->s, t->lit.u.s->len);
            while (cur(P)->type == T_STRING) {
                kvf_sbuf_append(&b, cur(P)->lit.u.s->s, cur(P)->lit.u.s->len);
                adv(P);
            }
            bool ok = !b.oom && jarena_str(P->arena, b.data, b.len, &n->lit);
            kvf_sbuf_fini(&b);
            if (!ok)
                return oom(P);
        }
        return n;
    }
    case T_INT:
    case T_FLOAT: {
        jnode *n = mk(P, JN_LIT, t);
        if (n)
            n->lit = t->lit;
        adv(P);
        return n;
    }
    case T_OP:
        if (is_op(t, "(")) {
            adv(P);
            jnode *n = parse_tuple(P, true, true);
            if (n && !expect_op(P, ")"))
                return NULL;
            return n;
        }
        if (is_op(t, "[") || is_op(t, "{")) {
            bool dict = is_op(t, "{");
            const char *close = dict ? "}" : "]";
            adv(P);
            jnode *n = mk(P, dict ? JN_DICT : JN_LIST, t);
            nvec items = {0};
            while (n && !is_op(cur(P), close)) {
                if (items.n && !expect_op(P, ","))
                    return vfinish(P, NULL, &items);
                if (is_op(cur(P), close))
                    break;
                jnode *e = parse_expr(P, true);
                if (!e || !vpush(P, &items, e, NULL))
                    return vfinish(P, NULL, &items);
                if (dict) {
                    if (!expect_op(P, ":") || !(e = parse_expr(P, true)) || !vpush(P, &items, e, NULL))
                        return vfinish(P, NULL, &items);
                }
            }
            adv(P);
            return vfinish(P, n, &items);
        }
        break;
    default: break;
    }
    return fail_at(P, t, "unexpected %s (expected an expression)", tok_desc(t, buf, sizeof buf));
}

/* ---- statements ------------------------------------------------------------------------- */

static jnode *parse_body(parser *P, const char *const *ends);

static bool expect_block_end(parser *P)
{
    if (cur(P)->type != T_BLOCK_END) {
        unexpected(P, "'%}'");
        return false;
    }
    adv(P);
    return true;
}

/* After a body: the current token is BLOCK_BEGIN followed by one of the end names. Consumes
 * "{% endX %}" when name matches, else leaves the tag for the caller. */
static bool at_tag(parser *P, const char *name)
{
    return cur(P)->type == T_BLOCK_BEGIN && is_name(peek(P, 1), name);
}

static bool close_tag(parser *P, const char *name)
{
    if (!at_tag(P, name)) {
        fail_at(P, cur(P), "expected '{%% %s %%}'", name);
        return false;
    }
    adv(P);
    adv(P);
    return expect_block_end(P);
}

static jnode *parse_target(parser *P, bool allow_attr)
{
    tok *at = cur(P);
    nvec names = {0};
    bool comma = false;
    for (;;) {
        tok *t = cur(P);
        if (t->type != T_NAME) {
            vfinish(P, NULL, &names);
            return unexpected(P, "a variable name");
        }
        jnode *n = mk(P, JN_NAME, t);
        if (!n)
            return vfinish(P, NULL, &names);
        n->name = t->s;
        adv(P);
        if (allow_attr && !names.n && is_op(cur(P), ".")) {
            adv(P);
            if (cur(P)->type != T_NAME) {
                vfinish(P, NULL, &names);
                return unexpected(P, "an attribute name");
            }
            jnode *a = mk(P, JN_ATTR, t);
            if (!a)
                return vfinish(P, NULL, &names);
            a->a = n;
            a->name = cur(P)->s;
            adv(P);
            vfinish(P, NULL, &names);
            return a;
        }
        if (!vpush(P, &names, n, NULL))
            return vfinish(P, NULL, &names);
        if (!is_op(cur(P), ","))
            break;
        comma = true;
        adv(P);
    }
    if (names.n == 1 && !comma) {
        jnode *only = names.v[0];
        vfinish(P, NULL, &names);
        return only;
    }
    return vfinish(P, mk(P, JN_TUPLE, at), &names);
}

static jnode *parse_if(parser *P, tok *at)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    jnode *n = mk(P, JN_IF, at);
    if (!n || !(n->a = parse_tuple(P, false, false)) || !expect_block_end(P) ||
        !(n->b = parse_body(P, ends)))
        return NULL;
    if (at_tag(P, "elif")) {
        adv(P);
        tok *t = cur(P);
        adv(P);
        n->c = parse_if(P, t);
        return n->c ? n : NULL;
    }
    if (at_tag(P, "else")) {
        adv(P);
        adv(P);
        static const char *const ends2[] = {"endif", NULL};
        if (!expect_block_end(P) || !(n->c = parse_body(P, ends2)))
            return NULL;
    }
    return close_tag(P, "endif") ? n : NULL;
}

static jnode *parse_for(parser *P, tok *at)
{
    static const char *const ends[] = {"else", "endfor", NULL};
    jnode *n = mk(P, JN_FOR, at);
    if (!n || !(n->a = parse_target(P, false)))
        return NULL;
    if (!is_name(cur(P), "in"))
        return unexpected(P, "'in'");
    adv(P);
    if (!(n->b = parse_tuple(P, false, false)))
        return NULL;
    if (is_name(cur(P), "if")) {
        adv(P);
        if (!(n->e = parse_expr(P, true)))
            return NULL;
    }
    if (is_name(cur(P), "recursive"))
        return fail_at(P, cur(P), "recursive loops are not supported");
    if (!expect_block_end(P) || !(n->c = parse_body(P, ends)))
        return NULL;
    if (at_tag(P, "else")) {
        adv(P);
        adv(P);
        static const char *const ends2[] = {"endfor", NULL};
        if (!expect_block_end(P) || !(n->d = parse_body(P, ends2)))
            return NULL;
    }
    return close_tag(P, "endfor") ? n : NULL;
}

static jnode *parse_set(parser *P, tok *at)
{
    jnode *target = parse_target(P, true);
    if (!target)
        return NULL;
    if (is_op(cur(P), "=")) {
        adv(P);
        jnode *n = mk(P, JN_SET, at);
        if (!n || !(n->b = parse_tuple(P, true, false)) || !expect_block_end(P))
            return NULL;
        n->a = target;
        return n;
    }
    if (target->kind != JN_NAME)
        return unexpected(P, "'='");
    static const char *const ends[] = {"endset", NULL};
    jnode *n = mk(P, JN_SET_BLOCK, at);
    if (!n || !expect_block_end(P) || !(n->b = parse_body(P, ends)) || !close_tag(P, "endset"))
        return NULL;
    n->a = target;
    return n;
}

/* (a, b=default, ...) of a macro or a call block's caller */
static bool parse_params(parser *P, nvec *params)
{
    if (!expect_op(P, "("))
        return false;
    while (!is_op(cur(P), ")")) {
        if (params->n && !expect_op(P, ","))
            return false;
        tok *t = cur(P);
        if (t->type != T_NAME) {
            unexpected(P, "a parameter name");
            return false;
        }
        jnode *p = mk(P, JN_NAME, t);
        if (!p)
            return false;
        p->name = t->s;
        adv(P);
        if (is_op(cur(P), "=")) {
            adv(P);
            if (!(p->a = parse_expr(P, true)))
                return false;
        }
        if (!vpush(P, params, p, NULL))
            return false;
    }
    adv(P);
    return true;
}

static jnode *parse_macro(parser *P, tok *at)
{
    static const char *const ends[] = {"endmacro", NULL};
    jnode *n = mk(P, JN_MACRO, at);
    if (!n)
        return NULL;
    if (cur(P)->type != T_NAME)
        return unexpected(P, "a macro name");
    n->name = cur(P)->s;
    adv(P);
    nvec params = {0};
    if (!parse_params(P, &params) || !vfinish(P, n, &params))
        return vfinish(P, NULL, &params);
    if (!expect_block_end(P) || !(n->b = parse_body(P, ends)) || !close_tag(P, "endmacro"))
        return NULL;
    return n;
}

static jnode *parse_call_block(parser *P, tok *at)
{
    static const char *const ends[] = {"endcall", NULL};
    jnode *n = mk(P, JN_CALL_BLOCK, at);
    if (!n)
        return NULL;
    nvec params = {0};
    if (is_op(cur(P), "(") && (!parse_params(P, &params) || !vfinish(P, n, &params)))
        return vfinish(P, NULL, &params);
    vfinish(P, n, &params);
    tok *ct = cur(P);
    jnode *call = parse_expr(P, true);
    if (!call)
        return NULL;
    if (call->kind != JN_CALL)
        return fail_at(P, ct, "'call' needs a macro call, e.g. {%% call m(x) %%}");
    n->a = call;
    if (!expect_block_end(P) || !(n->b = parse_body(P, ends)) || !close_tag(P, "endcall"))
        return NULL;
    return n;
}

static jnode *parse_filter_block(parser *P, tok *at)
{
    static const char *const ends[] = {"endfilter", NULL};
    jnode *n = mk(P, JN_FILTER_BLOCK, at), *ph = mk(P, JN_NAME, at);
    if (!n || !ph)
        return NULL;
    ph->name = " filter body"; /* a name no template can write */
    /* the filter chain as if written `body | f1 | f2(x)` */
    jnode *chain = ph;
    do {
        if (chain != ph || is_op(cur(P), "|")) {
            if (!is_op(cur(P), "|"))
                break;
            adv(P);
        }
        tok *t = cur(P);
        jnode *f = mk(P, JN_FILTER, t);
        if (!f || !(f->name = parse_dotted_name(P)))
            return NULL;
        f->fn = (int16_t)kvf_text_jinja_filter_id(f->name);
        f->a = chain;
        nvec args = {0};
        if (is_op(cur(P), "(") && !parse_args(P, &args))
            return vfinish(P, NULL, &args);
        if (!(chain = vfinish(P, f, &args)))
            return NULL;
    } while (is_op(cur(P), "|"));
    n->a = chain;
    if (!expect_block_end(P) || !(n->b = parse_body(P, ends)) || !close_tag(P, "endfilter"))
        return NULL;
    return n;
}

static jnode *parse_stmt(parser *P)
{
    adv(P); /* '{%' */
    tok *t = cur(P);
    char buf[80];
    if (t->type != T_NAME)
        return fail_at(P, t, "unexpected %s (expected a tag name such as 'if', 'for' or 'set')",
                       tok_desc(t, buf, sizeof buf));
    adv(P);
    const char *k = t->s;
    if (strcmp(k, "if") == 0)
        return parse_if(P, t);
    if (strcmp(k, "for") == 0)
        return parse_for(P, t);
    if (strcmp(k, "set") == 0)
        return parse_set(P, t);
    if (strcmp(k, "macro") == 0)
        return parse_macro(P, t);
    if (strcmp(k, "call") == 0)
        return parse_call_block(P, t);
    if (strcmp(k, "filter") == 0)
        return parse_filter_block(P, t);
    if (strcmp(k, "break") == 0 || strcmp(k, "continue") == 0) {
        jnode *n = mk(P, k[0] == 'b' ? JN_BREAK : JN_CONTINUE, t);
        return n && expect_block_end(P) ? n : NULL;
    }
    if (strcmp(k, "generation") == 0) { /* transformers' assistant-mask marker: a plain body */
        static const char *const ends[] = {"endgeneration", NULL};
        jnode *n;
        if (!expect_block_end(P) || !(n = parse_body(P, ends)) || !close_tag(P, "endgeneration"))
            return NULL;
        return n;
    }
    return fail_at(P, t, "unknown tag '%s'", k);
}

/* Statements until EOF (ends == NULL) or a tag named in ends (left unconsumed). */
static jnode *parse_body(parser *P, const char *const *ends)
{
    if (!enter(P))
        return NULL;
    jnode *body = mk(P, JN_BODY, cur(P));
    nvec kids = {0};
    while (body && !P->failed) {
        tok *t = cur(P);
        jnode *n = NULL;
        if (t->type == T_EOF) {
            if (ends) {
                char want[160] = "";
                for (int i = 0; ends[i]; i++)
                    snprintf(want + strlen(want), sizeof want - strlen(want), "%s'%s'",
                             i ? (ends[i + 1] ? ", " : " or ") : "", ends[i]);
                fail_at(P, t, "unexpected end of template (expected %s)", want);
            }
            break;
        }
        if (t->type == T_TEXT) {
            n = mk(P, JN_TEXT, t);
            if (n)
                n->lit = t->lit;
            adv(P);
        } else if (t->type == T_VAR_BEGIN) {
            adv(P);
            n = mk(P, JN_OUTPUT, t);
            if (n && (n->a = parse_tuple(P, true, false)) && cur(P)->type != T_VAR_END)
                unexpected(P, "'}}'");
            adv(P);
        } else if (t->type == T_BLOCK_BEGIN) {
            tok *name = peek(P, 1);
            bool is_end = false;
            for (int i = 0; ends && ends[i]; i++)
                if (is_name(name, ends[i]))
                    is_end = true;
            if (is_end)
                break;
            if (name->type == T_NAME && (strncmp(name->s, "end", 3) == 0 || strcmp(name->s, "else") == 0 ||
                                         strcmp(name->s, "elif") == 0)) {
                fail_at(P, name, "unexpected '%s'%s", name->s,
                        ends ? "" : " (no block is open)");
                break;
            }
            n = parse_stmt(P);
        } else {
            char buf[80];
            fail_at(P, t, "unexpected %s", tok_desc(t, buf, sizeof buf));
        }
        if (!n || !vpush(P, &kids, n, NULL))
            break;
    }
    P->depth--;
    if (P->failed)
        return vfinish(P, NULL, &kids);
    return vfinish(P, body, &kids);
}

/* ---- entry points ----------------------------------------------------------------------- */

kvf_status kvf_text_jinja_compile(const char *src, size_t len, unsigned flags,
                                   kvf_text_jinja **out, kvf_err *err)
{
    if (!src && len)
        return kvf_err_set(err, KVF_ERR_INVALID, "jinja: template is NULL");
    kvf_text_jinja *t = calloc(1, sizeof *t);
    char *norm = malloc(len + 1);
    if (!t || !norm) {
        free(t);
        free(norm);
        return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
    }
    /* as Jinja: every \r\n and \r becomes \n, and one trailing newline is dropped
     * (keep_trailing_newline is off) */
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n && norm[n - 1] == '\n')
        n--;
    norm[n] = 0;
    lexer L = {.src = norm, .len = n, .flags = flags, .arena = &t->arena,
               .lc_line = 1, .lc_col = 1, .err = err};
    kvf_status st = lex_all(&L);
    if (st == KVF_OK) {
        parser P = {.t = L.toks, .n = L.n, .arena = &t->arena, .err = err};
        t->root = parse_body(&P, NULL);
        if (!t->root)
            st = err ? err->status : KVF_ERR_PARSE;
        if (st == KVF_OK && P.failed)
            st = KVF_ERR_PARSE;
    }
    free(L.toks);
    free(norm);
    if (st != KVF_OK) {
        kvf_text_jinja_destroy(t);
        return st;
    }
    *out = t;
    return KVF_OK;
}

void kvf_text_jinja_destroy(kvf_text_jinja *t)
{
    if (!t)
        return;
    jarena_free(&t->arena);
    free(t);
}
