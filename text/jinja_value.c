/* jinja_value.c: the chat-template interpreter's values: reference counting, strings, lists and
 * ordered dicts, Python's truth, equality, str() and repr(), json.dumps as transformers calls
 * it, JSON input, UTF-8 code points, and the arena that owns a compiled template. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja_int.h"

/* ---- reference counting ---------------------------------------------------------------- */

jv jv_retain(jv v)
{
    int32_t *rc = NULL;
    switch (v.t) {
    case JV_STR: rc = &v.u.s->rc; break;
    case JV_LIST: rc = &v.u.l->rc; break;
    case JV_DICT:
    case JV_NS: rc = &v.u.d->rc; break;
    case JV_MACRO: rc = &v.u.m->rc; break;
    default: break;
    }
    if (rc && *rc >= 0)
        (*rc)++;
    return v;
}

static void jdict_free(jdict *d)
{
    jv_dict_clear(d);
    free(d->k);
    free(d->v);
    free(d);
}

void jv_release(jv v)
{
    switch (v.t) {
    case JV_STR:
        if (v.u.s->rc >= 0 && --v.u.s->rc == 0)
            free(v.u.s);
        break;
    case JV_LIST:
        if (v.u.l->rc >= 0 && --v.u.l->rc == 0) {
            for (size_t i = 0; i < v.u.l->n; i++)
                jv_release(v.u.l->v[i]);
            free(v.u.l->v);
            free(v.u.l);
        }
        break;
    case JV_DICT:
    case JV_NS:
        if (v.u.d->rc >= 0 && --v.u.d->rc == 0)
            jdict_free(v.u.d);
        break;
    case JV_MACRO:
        if (v.u.m->rc >= 0 && --v.u.m->rc == 0) {
            jframe_release(v.u.m->scope);
            free(v.u.m);
        }
        break;
    default: break;
    }
}

jframe *jframe_new(jframe *parent)
{
    jframe *f = calloc(1, sizeof *f);
    jv d;
    if (!f || !jv_dict_new(&d)) {
        free(f);
        return NULL;
    }
    f->rc = 1;
    f->vars = d.u.d;
    f->parent = parent;
    if (parent)
        parent->rc++;
    return f;
}

void jframe_pop(jframe *f)
{
    if (!f)
        return;
    jv_dict_clear(f->vars);
    jframe *p = f->parent;
    f->parent = NULL;
    jframe_release(p);
    jframe_release(f);
}

void jframe_release(jframe *f)
{
    while (f && --f->rc == 0) {
        jframe *p = f->parent;
        if (f->vars) {
            jv d = {.t = JV_DICT};
            d.u.d = f->vars;
            jv_release(d);
        }
        free(f);
        f = p;
    }
}

/* ---- constructors ---------------------------------------------------------------------- */

bool jv_str_cat(const char *a, size_t al, const char *b, size_t bl, jv *out)
{
    if (al > SIZE_MAX / 2 || bl > SIZE_MAX / 2)
        return false;
    jstr *s = malloc(sizeof *s + al + bl + 1);
    if (!s)
        return false;
    s->rc = 1;
    s->len = al + bl;
    if (al)
        memcpy(s->s, a, al);
    if (bl)
        memcpy(s->s + al, b, bl);
    s->s[al + bl] = 0;
    out->t = JV_STR;
    out->u.s = s;
    return true;
}

bool jv_str_new(const char *s, size_t len, jv *out) { return jv_str_cat(s, len, NULL, 0, out); }

bool jv_list_new(size_t cap, jv *out)
{
    jlist *l = calloc(1, sizeof *l);
    if (!l)
        return false;
    if (cap && !(l->v = malloc(cap * sizeof *l->v))) {
        free(l);
        return false;
    }
    l->rc = 1;
    l->cap = cap;
    out->t = JV_LIST;
    out->u.l = l;
    return true;
}

bool jv_list_push(jv list, jv item)
{
    jlist *l = list.u.l;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        jv *v = realloc(l->v, cap * sizeof *v);
        if (!v) {
            jv_release(item);
            return false;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = item;
    return true;
}

bool jv_dict_new(jv *out)
{
    jdict *d = calloc(1, sizeof *d);
    if (!d)
        return false;
    d->rc = 1;
    out->t = JV_DICT;
    out->u.d = d;
    return true;
}

jv *jv_dict_get(const jdict *d, jv key)
{
    for (size_t i = 0; i < d->n; i++)
        if (jv_equal(d->k[i], key))
            return &d->v[i];
    return NULL;
}

jv *jv_dict_get_cstr(const jdict *d, const char *key)
{
    size_t n = strlen(key);
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == JV_STR && d->k[i].u.s->len == n && memcmp(d->k[i].u.s->s, key, n) == 0)
            return &d->v[i];
    return NULL;
}

bool jv_dict_set(jdict *d, jv key, jv val)
{
    jv *old = jv_dict_get(d, key);
    if (old) {
        jv_release(key);
        jv_release(*old);
        *old = val;
        return true;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        jv *k = realloc(d->k, cap * sizeof *k);
        if (k)
            d->k = k;
        jv *v = k ? realloc(d->v, cap * sizeof *v) : NULL;
        if (!v) {
            jv_release(key);
            jv_release(val);
            return false;
        }
        d->v = v;
        d->cap = cap;
    }
    d->k[d->n] = key;
    d->v[d->n++] = val;
    return true;
}

bool jv_dict_set_cstr(jdict *d, const char *key, jv val)
{
    jv *old = jv_dict_get_cstr(d, key);
    if (old) {
        jv_release(*old);
        *old = val;
        return true;
    }
    jv k;
    if (!jv_str_new(key, strlen(key), &k)) {
        jv_release(val);
        return false;
    }
    return jv_dict_set(d, k, val);
}

void jv_dict_clear(jdict *d)
{
    /* Detach first: releasing a value may run code that looks at this dict again. */
    size_t n = d->n;
    d->n = 0;
    for (size_t i = 0; i < n; i++) {
        jv_release(d->k[i]);
        jv_release(d->v[i]);
    }
}

/* ---- truth, equality, names ------------------------------------------------------------ */

bool jv_truthy(jv v)
{
    switch (v.t) {
    case JV_UNDEF:
    case JV_NONE: return false;
    case JV_BOOL: return v.u.b;
    case JV_INT: return v.u.i != 0;
    case JV_FLOAT: return v.u.f != 0.0;
    case JV_STR: return v.u.s->len > 0;
    case JV_LIST: return v.u.l->n > 0;
    case JV_DICT: return v.u.d->n > 0;
    default: return true;
    }
}

static bool is_num(jv v) { return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL; }
static double num_f(jv v)
{
    return v.t == JV_FLOAT ? v.u.f : v.t == JV_INT ? (double)v.u.i : (double)v.u.b;
}
static int64_t num_i(jv v) { return v.t == JV_INT ? v.u.i : v.t == JV_BOOL ? (int64_t)v.u.b : 0; }

bool jv_equal(jv a, jv b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t == JV_FLOAT || b.t == JV_FLOAT)
            return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a.t != b.t)
        return false;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NONE: return true;
    case JV_STR:
        return a.u.s->len == b.u.s->len && memcmp(a.u.s->s, b.u.s->s, a.u.s->len) == 0;
    case JV_LIST:
        if (a.u.l->n != b.u.l->n)
            return false;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!jv_equal(a.u.l->v[i], b.u.l->v[i]))
                return false;
        return true;
    case JV_DICT:
        if (a.u.d->n != b.u.d->n)
            return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            jv *o = jv_dict_get(b.u.d, a.u.d->k[i]);
            if (!o || !jv_equal(a.u.d->v[i], *o))
                return false;
        }
        return true;
    case JV_NS: return a.u.d == b.u.d;
    case JV_MACRO: return a.u.m == b.u.m;
    default: return false;
    }
}

const char *jv_type_name(jv v)
{
    switch (v.t) {
    case JV_UNDEF: return "undefined";
    case JV_NONE: return "NoneType";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return "str";
    case JV_LIST: return v.u.l->tuple ? "tuple" : "list";
    case JV_DICT: return "dict";
    case JV_NS: return "Namespace";
    case JV_MACRO: return "Macro";
    }
    return "?";
}

/* ---- str(), repr() --------------------------------------------------------------------- */

void jv_float_repr(kvf_sbuf *b, double f)
{
    if (isnan(f)) {
        kvf_sbuf_puts(b, "nan");
        return;
    }
    if (isinf(f)) {
        kvf_sbuf_puts(b, f < 0 ? "-inf" : "inf");
        return;
    }
    /* Python's repr: the shortest digits that read back the same value, positional when the
     * decimal exponent is in [-4, 16), scientific otherwise. */
    char tmp[64];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f)
            break;
    }
    if (prec > 17)
        prec = 17;
    char digits[32];
    size_t nd = 0;
    const char *p = tmp;
    bool neg = false;
    if (*p == '-') {
        neg = true;
        p++;
    }
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9')
            digits[nd++] = *p;
    int exp = *p == 'e' ? atoi(p + 1) : 0;
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    if (neg)
        kvf_sbuf_putc(b, '-');
    if (exp >= -4 && exp < 16) {
        if (exp < 0) {
            kvf_sbuf_puts(b, "0.");
            for (int i = 0; i < -exp - 1; i++)
                kvf_sbuf_putc(b, '0');
            kvf_sbuf_append(b, digits, nd);
        } else {
            size_t intd = (size_t)exp + 1;
            for (size_t i = 0; i < intd; i++)
                kvf_sbuf_putc(b, i < nd ? digits[i] : '0');
            kvf_sbuf_putc(b, '.');
            if (nd > intd)
                kvf_sbuf_append(b, digits + intd, nd - intd);
            else
                kvf_sbuf_putc(b, '0');
        }
    } else {
        kvf_sbuf_putc(b, digits[0]);
        if (nd > 1) {
            kvf_sbuf_putc(b, '.');
            kvf_sbuf_append(b, digits + 1, nd - 1);
        }
        kvf_sbuf_printf(b, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
}

static void str_repr(kvf_sbuf *b, const char *s, size_t n)
{
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    kvf_sbuf_putc(b, q);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == (unsigned char)q || c == '\\') {
            kvf_sbuf_putc(b, '\\');
            kvf_sbuf_putc(b, (char)c);
        } else if (c == '\n') {
            kvf_sbuf_puts(b, "\\n");
        } else if (c == '\r') {
            kvf_sbuf_puts(b, "\\r");
        } else if (c == '\t') {
            kvf_sbuf_puts(b, "\\t");
        } else if (c < 0x20 || c == 0x7f) {
            kvf_sbuf_printf(b, "\\x%02x", c);
        } else {
            kvf_sbuf_putc(b, (char)c);
        }
    }
    kvf_sbuf_putc(b, q);
}

void jv_repr(kvf_sbuf *b, jv v)
{
    switch (v.t) {
    case JV_STR: str_repr(b, v.u.s->s, v.u.s->len); return;
    case JV_LIST:
        kvf_sbuf_putc(b, v.u.l->tuple ? '(' : '[');
        for (size_t i = 0; i < v.u.l->n && !b->oom; i++) {
            if (i)
                kvf_sbuf_puts(b, ", ");
            jv_repr(b, v.u.l->v[i]);
        }
        if (v.u.l->tuple && v.u.l->n == 1)
            kvf_sbuf_putc(b, ',');
        kvf_sbuf_putc(b, v.u.l->tuple ? ')' : ']');
        return;
    case JV_DICT:
        kvf_sbuf_putc(b, '{');
        for (size_t i = 0; i < v.u.d->n && !b->oom; i++) {
            if (i)
                kvf_sbuf_puts(b, ", ");
            jv_repr(b, v.u.d->k[i]);
            kvf_sbuf_puts(b, ": ");
            jv_repr(b, v.u.d->v[i]);
        }
        kvf_sbuf_putc(b, '}');
        return;
    default: jv_to_str(b, v); return;
    }
}

void jv_to_str(kvf_sbuf *b, jv v)
{
    switch (v.t) {
    case JV_UNDEF: return;
    case JV_NONE: kvf_sbuf_puts(b, "None"); return;
    case JV_BOOL: kvf_sbuf_puts(b, v.u.b ? "True" : "False"); return;
    case JV_INT: kvf_sbuf_printf(b, "%lld", (long long)v.u.i); return;
    case JV_FLOAT: jv_float_repr(b, v.u.f); return;
    case JV_STR: kvf_sbuf_append(b, v.u.s->s, v.u.s->len); return;
    case JV_NS: kvf_sbuf_puts(b, "<Namespace>"); return;
    case JV_MACRO: kvf_sbuf_puts(b, "<Macro>"); return;
    default: jv_repr(b, v); return;
    }
}

/* ---- JSON ------------------------------------------------------------------------------- */

static void json_str(kvf_sbuf *b, const char *s, size_t n, bool ensure_ascii)
{
    kvf_sbuf_putc(b, '"');
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char ubuf[16];
        if (c >= 0x80 && ensure_ascii) { /* \uXXXX, with surrogate pairs above U+FFFF */
            uint32_t cp;
            size_t next = ju_next(s, n, i, &cp);
            if (next - i == 1)
                continue; /* not UTF-8: left as it is */
            kvf_sbuf_append(b, s + run, i - run);
            if (cp >= 0x10000)
                kvf_sbuf_printf(b, "\\u%04x\\u%04x", 0xd800 + ((cp - 0x10000) >> 10), 0xdc00 + ((cp - 0x10000) & 0x3ff));
            else
                kvf_sbuf_printf(b, "\\u%04x", cp);
            run = next;
            i = next - 1;
            continue;
        }
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(ubuf, sizeof ubuf, "\\u%04x", c);
                esc = ubuf;
            }
        }
        if (esc) {
            kvf_sbuf_append(b, s + run, i - run);
            kvf_sbuf_puts(b, esc);
            run = i + 1;
        }
    }
    kvf_sbuf_append(b, s + run, n - run);
    kvf_sbuf_putc(b, '"');
}

typedef struct json_opts {
    int indent;
    const char *indent_str;
    const char *item_sep, *key_sep;
    bool sort_keys, ensure_ascii;
    char *why;
    size_t why_cap;
} json_opts;

static void json_newline(kvf_sbuf *b, const json_opts *o, int level)
{
    kvf_sbuf_putc(b, '\n');
    for (int l = 0; l < level; l++) {
        if (o->indent_str)
            kvf_sbuf_puts(b, o->indent_str);
        else
            for (int i = 0; i < o->indent; i++)
                kvf_sbuf_putc(b, ' ');
    }
}

static int key_cmp(const void *pa, const void *pb)
{
    const jv *a = *(const jv *const *)pa, *b = *(const jv *const *)pb;
    if (a->t == JV_STR && b->t == JV_STR) {
        size_t n = a->u.s->len < b->u.s->len ? a->u.s->len : b->u.s->len;
        int c = memcmp(a->u.s->s, b->u.s->s, n);
        return c ? c : (a->u.s->len > b->u.s->len) - (a->u.s->len < b->u.s->len);
    }
    return (int)a->t - (int)b->t;
}

static bool json_val(kvf_sbuf *b, jv v, const json_opts *o, int level)
{
    bool pretty = o->indent >= 0 || o->indent_str;
    if (level > 512) {
        snprintf(o->why, o->why_cap, "nested deeper than 512");
        return false;
    }
    switch (v.t) {
    case JV_NONE: kvf_sbuf_puts(b, "null"); return true;
    case JV_BOOL: kvf_sbuf_puts(b, v.u.b ? "true" : "false"); return true;
    case JV_INT: kvf_sbuf_printf(b, "%lld", (long long)v.u.i); return true;
    case JV_FLOAT:
        if (isnan(v.u.f))
            kvf_sbuf_puts(b, "NaN");
        else if (isinf(v.u.f))
            kvf_sbuf_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else
            jv_float_repr(b, v.u.f);
        return true;
    case JV_STR: json_str(b, v.u.s->s, v.u.s->len, o->ensure_ascii); return true;
    case JV_LIST:
        if (v.u.l->n == 0) {
            kvf_sbuf_puts(b, "[]");
            return true;
        }
        kvf_sbuf_putc(b, '[');
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i)
                kvf_sbuf_puts(b, o->item_sep);
            if (pretty)
                json_newline(b, o, level + 1);
            if (!json_val(b, v.u.l->v[i], o, level + 1))
                return false;
            if (b->oom)
                return true;
        }
        if (pretty)
            json_newline(b, o, level);
        kvf_sbuf_putc(b, ']');
        return true;
    case JV_DICT:
    case JV_NS: {
        jdict *d = v.u.d;
        if (d->n == 0) {
            kvf_sbuf_puts(b, "{}");
            return true;
        }
        const jv **keys = malloc(d->n * sizeof *keys);
        if (!keys) {
            b->oom = true;
            return true;
        }
        for (size_t i = 0; i < d->n; i++)
            keys[i] = &d->k[i];
        if (o->sort_keys)
            qsort(keys, d->n, sizeof *keys, key_cmp);
        kvf_sbuf_putc(b, '{');
        bool ok = true;
        for (size_t i = 0; i < d->n && ok && !b->oom; i++) {
            const jv *k = keys[i];
            jv val = d->v[k - d->k];
            if (i)
                kvf_sbuf_puts(b, o->item_sep);
            if (pretty)
                json_newline(b, o, level + 1);
            if (k->t == JV_STR) {
                json_str(b, k->u.s->s, k->u.s->len, o->ensure_ascii);
            } else if (k->t == JV_INT || k->t == JV_FLOAT || k->t == JV_BOOL || k->t == JV_NONE) {
                kvf_sbuf kb;
                kvf_sbuf_init(&kb);
                if (k->t == JV_BOOL || k->t == JV_NONE)
                    json_val(&kb, *k, o, level + 1);
                else
                    jv_to_str(&kb, *k);
                json_str(b, kb.data ? kb.data : "", kb.len, o->ensure_ascii);
                kvf_sbuf_fini(&kb);
            } else {
                snprintf(o->why, o->why_cap, "keys must be str, int, float, bool or None, not %s",
                         jv_type_name(*k));
                ok = false;
                break;
            }
            kvf_sbuf_puts(b, o->key_sep);
            ok = json_val(b, val, o, level + 1);
        }
        free(keys);
        if (!ok)
            return false;
        if (pretty)
            json_newline(b, o, level);
        kvf_sbuf_putc(b, '}');
        return true;
    }
    default:
        snprintf(o->why, o->why_cap, "Object of type %s is not JSON serializable", jv_type_name(v));
        return false;
    }
}

bool jv_to_json(kvf_sbuf *b, jv v, int indent, const char *indent_str, const char *item_sep,
                const char *key_sep, bool sort_keys, bool ensure_ascii, char *why, size_t why_cap)
{
    bool pretty = indent >= 0 || indent_str;
    json_opts o = {
        .indent = indent,
        .indent_str = indent_str,
        .item_sep = item_sep ? item_sep : pretty ? "," : ", ",
        .key_sep = key_sep ? key_sep : ": ",
        .sort_keys = sort_keys,
        .ensure_ascii = ensure_ascii,
        .why = why,
        .why_cap = why_cap,
    };
    return json_val(b, v, &o, 0);
}

bool jv_from_json(const json_t *j, int max_depth, jv *out)
{
    if (max_depth < 0)
        return false;
    switch (json_typeof(j)) {
    case JSON_NULL: *out = jv_none(); return true;
    case JSON_TRUE: *out = jv_bool(true); return true;
    case JSON_FALSE: *out = jv_bool(false); return true;
    case JSON_INTEGER: *out = jv_int(json_integer_value(j)); return true;
    case JSON_REAL: *out = jv_float(json_real_value(j)); return true;
    case JSON_STRING: return jv_str_new(json_string_value(j), json_string_length(j), out);
    case JSON_ARRAY: {
        jv l;
        if (!jv_list_new(json_array_size(j), &l))
            return false;
        for (size_t i = 0; i < json_array_size(j); i++) {
            jv item;
            if (!jv_from_json(json_array_get(j, i), max_depth - 1, &item) || !jv_list_push(l, item)) {
                jv_release(l);
                return false;
            }
        }
        *out = l;
        return true;
    }
    case JSON_OBJECT: {
        jv d;
        if (!jv_dict_new(&d))
            return false;
        const char *key;
        size_t klen;
        json_t *val;
        void *tmp;
        json_object_keylen_foreach_safe((json_t *)j, tmp, key, klen, val) {
            jv k, v;
            if (!jv_str_new(key, klen, &k)) {
                jv_release(d);
                return false;
            }
            if (!jv_from_json(val, max_depth - 1, &v)) {
                jv_release(k);
                jv_release(d);
                return false;
            }
            if (!jv_dict_set(d.u.d, k, v)) {
                jv_release(d);
                return false;
            }
        }
        *out = d;
        return true;
    }
    }
    return false;
}

/* ---- UTF-8 ------------------------------------------------------------------------------ */

size_t ju_next(const char *str, size_t len, size_t i, uint32_t *cp_out)
{
    const unsigned char *s = (const unsigned char *)str;
    unsigned char c = s[i];
    uint32_t cp = c;
    size_t n = 1;
    if (c >= 0xc2 && c <= 0xdf)
        n = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef)
        n = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4)
        n = 4, cp = c & 0x07;
    if (n > 1) {
        if (i + n > len) {
            n = 1, cp = c;
        } else {
            for (size_t k = 1; k < n; k++) {
                if ((s[i + k] & 0xc0) != 0x80) {
                    n = 1, cp = c;
                    break;
                }
                cp = (cp << 6) | (s[i + k] & 0x3f);
            }
        }
    }
    if (cp_out)
        *cp_out = cp;
    return i + n;
}

size_t ju_count(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len; n++) {
        if ((unsigned char)s[i] < 0x80)
            i++;
        else
            i = ju_next(s, len, i, NULL);
    }
    return n;
}

bool ju_is_space(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 ||
           cp == 0xa0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

/* ---- arena ------------------------------------------------------------------------------ */

void *jarena_alloc(jarena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 16384 ? n : 16384;
        jarena_block *blk = malloc(sizeof *blk + cap);
        if (!blk)
            return NULL;
        blk->next = a->head;
        blk->used = 0;
        blk->cap = cap;
        a->head = blk;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    memset(p, 0, n);
    return p;
}

bool jarena_str(jarena *a, const char *s, size_t len, jv *out)
{
    if (a->n_strs == a->cap_strs) {
        size_t cap = a->cap_strs ? a->cap_strs * 2 : 32;
        jstr **v = realloc(a->strs, cap * sizeof *v);
        if (!v)
            return false;
        a->strs = v;
        a->cap_strs = cap;
    }
    if (!jv_str_new(s, len, out))
        return false;
    out->u.s->rc = -1;
    a->strs[a->n_strs++] = out->u.s;
    return true;
}

void jarena_free(jarena *a)
{
    for (jarena_block *b = a->head, *n; b; b = n) {
        n = b->next;
        free(b);
    }
    for (size_t i = 0; i < a->n_strs; i++)
        free(a->strs[i]);
    free(a->strs);
    memset(a, 0, sizeof *a);
}
