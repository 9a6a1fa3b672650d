/* jinja_eval.c: the chat-template interpreter's evaluator: walks the tree from jinja_parse.c
 * with Python's semantics for operators, Jinja's for undefined values and scopes, and the
 * filters, tests, methods and globals chat templates use. Every render is bounded by limits. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

#include "text/jinja.h"
#include "text/jinja_int.h"

typedef struct rstate {
    kvf_text_jinja_limits lim;
    kvf_sbuf *out;
    jframe *globals;
    int64_t steps, iters;
    int32_t depth;
    int ctl; /* 1 break, 2 continue, pending in the innermost loop */
    bool failed;
    kvf_err *err;
} rstate;

#define MAX_ARGS 16 /* arguments of one call; keeps each nesting level's stack small */
#define KW_ONLY MAX_ARGS /* arg() position for keyword-only arguments */

typedef struct args {
    jv pos[MAX_ARGS];
    const char *kwn[MAX_ARGS];
    jv kwv[MAX_ARGS];
    size_t n_pos, n_kw;
} args;

static bool eval(rstate *R, const jnode *n, jframe *f, jv *out);
static bool exec(rstate *R, const jnode *n, jframe *f);

/* ---- errors ------------------------------------------------------------------------------ */

static bool fail_st(rstate *R, kvf_status st, const jnode *n, const char *fmt, va_list ap)
{
    if (R->failed)
        return false;
    R->failed = true;
    char what[400];
    vsnprintf(what, sizeof what, fmt, ap);
    if (n)
        kvf_err_set(R->err, st, "line %d col %d: %s", n->line, n->col, what);
    else
        kvf_err_set(R->err, st, "%s", what);
    return false;
}

static bool rfail(rstate *R, const jnode *n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool rfail(rstate *R, const jnode *n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail_st(R, KVF_ERR_STATE, n, fmt, ap);
    va_end(ap);
    return false;
}

static bool rlimit(rstate *R, const jnode *n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool rlimit(rstate *R, const jnode *n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail_st(R, KVF_ERR_LIMIT, n, fmt, ap);
    va_end(ap);
    return false;
}

static bool room(rstate *R)
{
    if (!R->failed) {
        R->failed = true;
        kvf_err_set(R->err, KVF_ERR_NOMEM, "chat template: out of memory");
    }
    return false;
}

static bool undef_err(rstate *R, const jnode *n, jv v)
{
    if (v.u.name)
        return rfail(R, n, "'%s' is undefined", v.u.name);
    return rfail(R, n, "a value is undefined");
}

/* A string result of a size the limits allow. */
static bool check_size(rstate *R, const jnode *n, size_t len)
{
    if (len > R->lim.max_output)
        return rlimit(R, n, "a string would be %zu bytes, more than the %zu allowed", len,
                      R->lim.max_output);
    return true;
}

static bool sbuf_to_str(rstate *R, const jnode *n, kvf_sbuf *b, jv *out)
{
    if (b->oom) {
        kvf_sbuf_fini(b);
        return room(R);
    }
    if (!check_size(R, n, b->len)) {
        kvf_sbuf_fini(b);
        return false;
    }
    bool ok = jv_str_new(b->data ? b->data : "", b->len, out);
    kvf_sbuf_fini(b);
    return ok ? true : room(R);
}

static bool emit(rstate *R, const jnode *n, const char *s, size_t len)
{
    if (R->out->len + len > R->lim.max_output)
        return rlimit(R, n, "output would exceed %zu bytes", R->lim.max_output);
    if (kvf_sbuf_append(R->out, s, len) != KVF_OK)
        return room(R);
    return true;
}

static bool mkstr(rstate *R, const char *s, size_t len, jv *out)
{
    return jv_str_new(s, len, out) ? true : room(R);
}

static bool to_str(rstate *R, const jnode *n, jv v, jv *out)
{
    if (v.t == JV_STR) {
        *out = jv_retain(v);
        return true;
    }
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    jv_to_str(&b, v);
    return sbuf_to_str(R, n, &b, out);
}

/* ---- scopes ------------------------------------------------------------------------------ */

static jv *lookup(rstate *R, jframe *f, const char *name)
{
    for (jframe *s = f; s; s = s->parent) {
        jv *v = jv_dict_get_cstr(s->vars, name);
        if (v)
            return v;
        if (s == R->globals)
            return NULL;
    }
    return jv_dict_get_cstr(R->globals->vars, name);
}

static bool assign(rstate *R, const jnode *target, jframe *f, jv val)
{
    if (target->kind == JN_NAME) {
        if (!jv_dict_set_cstr(f->vars, target->name, val))
            return room(R);
        return true;
    }
    if (target->kind == JN_ATTR) {
        jv *ns = lookup(R, f, target->a->name);
        if (!ns || ns->t != JV_NS) {
            jv_release(val);
            return rfail(R, target, "cannot assign attribute '%s' of '%s': it is not a namespace()",
                         target->name, target->a->name);
        }
        if (!jv_dict_set_cstr(ns->u.d, target->name, val))
            return room(R);
        return true;
    }
    /* tuple unpacking */
    if (val.t != JV_LIST || val.u.l->n != target->n_kids) {
        size_t got = val.t == JV_LIST ? val.u.l->n : 0;
        jv_release(val);
        return rfail(R, target, "cannot unpack %s%s into %zu names", val.t == JV_LIST ? "" : "a non-list ",
                     val.t == JV_LIST ? (got < target->n_kids ? "too few values" : "too many values") : "value",
                     target->n_kids);
    }
    for (size_t i = 0; i < target->n_kids; i++)
        if (!assign(R, target->kids[i], f, jv_retain(val.u.l->v[i]))) {
            jv_release(val);
            return false;
        }
    jv_release(val);
    return true;
}

/* ---- strings as code points -------------------------------------------------------------- */

static bool is_ascii(const jstr *s)
{
    for (size_t i = 0; i < s->len; i++)
        if ((unsigned char)s->s[i] >= 0x80)
            return false;
    return true;
}

/* Byte offsets of each code point, plus the end: offs[0..n]. NULL offs for pure ASCII. */
static bool cp_offsets(rstate *R, const jstr *s, size_t **offs_out, size_t *n_out)
{
    *offs_out = NULL;
    if (is_ascii(s)) {
        *n_out = s->len;
        return true;
    }
    size_t n = ju_count(s->s, s->len);
    size_t *o = malloc((n + 1) * sizeof *o);
    if (!o)
        return room(R);
    size_t k = 0;
    for (size_t i = 0; i < s->len;)
        o[k++] = i, i = ju_next(s->s, s->len, i, NULL);
    o[k] = s->len;
    *offs_out = o;
    *n_out = n;
    return true;
}

static size_t off_at(const size_t *offs, size_t i) { return offs ? offs[i] : i; }

/* ---- comparisons and arithmetic ---------------------------------------------------------- */

static bool is_num(jv v) { return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL; }
static double num_f(jv v) { return v.t == JV_FLOAT ? v.u.f : v.t == JV_INT ? (double)v.u.i : (double)v.u.b; }
static int64_t num_i(jv v) { return v.t == JV_INT ? v.u.i : v.t == JV_BOOL ? (int64_t)v.u.b : 0; }

/* Python ordering: <0, 0, >0, or 2 when the types do not order. */
static int compare(jv a, jv b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT)
            return (num_i(a) > num_i(b)) - (num_i(a) < num_i(b));
        double x = num_f(a), y = num_f(b);
        if (isnan(x) || isnan(y))
            return 3; /* unordered: every comparison false */
        return (x > y) - (x < y);
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int c = memcmp(a.u.s->s, b.u.s->s, n);
        if (c)
            return c < 0 ? -1 : 1;
        return (a.u.s->len > b.u.s->len) - (a.u.s->len < b.u.s->len);
    }
    if (a.t == JV_LIST && b.t == JV_LIST) {
        size_t n = a.u.l->n < b.u.l->n ? a.u.l->n : b.u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (jv_equal(a.u.l->v[i], b.u.l->v[i]))
                continue;
            return compare(a.u.l->v[i], b.u.l->v[i]);
        }
        return (a.u.l->n > b.u.l->n) - (a.u.l->n < b.u.l->n);
    }
    return 2;
}

static const char *op_text(int op)
{
    static const char *const t[] = {"", "+", "-", "*", "/", "//", "%", "**", "~", "==", "!=", "<", "<=", ">", ">=", "in", "not in"};
    return op > 0 && op <= JOP_NOTIN ? t[op] : "?";
}

static bool contains(rstate *R, const jnode *n, jv hay, jv needle, bool *out)
{
    switch (hay.t) {
    case JV_STR:
        if (needle.t != JV_STR)
            return rfail(R, n, "'in <string>' requires a string on the left, not %s", jv_type_name(needle));
        *out = needle.u.s->len == 0 || memmem(hay.u.s->s, hay.u.s->len, needle.u.s->s, needle.u.s->len) != NULL;
        return true;
    case JV_LIST:
        *out = false;
        for (size_t i = 0; i < hay.u.l->n && !*out; i++)
            *out = jv_equal(hay.u.l->v[i], needle);
        return true;
    case JV_DICT:
    case JV_NS: *out = jv_dict_get(hay.u.d, needle) != NULL; return true;
    case JV_UNDEF: *out = false; return true; /* iterates as empty */
    default: return rfail(R, n, "argument of type '%s' is not iterable", jv_type_name(hay));
    }
}

static bool repeat(rstate *R, const jnode *n, jv seq, int64_t times, jv *out)
{
    if (times < 0)
        times = 0;
    if (seq.t == JV_STR) {
        if (times && seq.u.s->len > R->lim.max_output / (uint64_t)times)
            return check_size(R, n, R->lim.max_output + 1);
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        for (int64_t i = 0; i < times; i++)
            kvf_sbuf_append(&b, seq.u.s->s, seq.u.s->len);
        return sbuf_to_str(R, n, &b, out);
    }
    if (times && seq.u.l->n > (uint64_t)R->lim.max_iters / (uint64_t)times)
        return rlimit(R, n, "a list would have more than %lld items", (long long)R->lim.max_iters);
    if (!jv_list_new((size_t)times * seq.u.l->n, out))
        return room(R);
    for (int64_t i = 0; i < times; i++)
        for (size_t k = 0; k < seq.u.l->n; k++)
            if (!jv_list_push(*out, jv_retain(seq.u.l->v[k])))
                return room(R);
    return true;
}

static bool binop(rstate *R, const jnode *n, int op, jv a, jv b, jv *out)
{
    if (op == JOP_CONCAT) {
        kvf_sbuf s;
        kvf_sbuf_init(&s);
        jv_to_str(&s, a);
        jv_to_str(&s, b);
        return sbuf_to_str(R, n, &s, out);
    }
    if (op == JOP_EQ || op == JOP_NE) {
        bool eq = jv_equal(a, b);
        *out = jv_bool(op == JOP_EQ ? eq : !eq);
        return true;
    }
    if (op == JOP_IN || op == JOP_NOTIN) {
        bool in = false;
        if (!contains(R, n, b, a, &in))
            return false;
        *out = jv_bool(op == JOP_IN ? in : !in);
        return true;
    }
    if (a.t == JV_UNDEF)
        return undef_err(R, n, a);
    if (b.t == JV_UNDEF)
        return undef_err(R, n, b);
    if (op >= JOP_LT && op <= JOP_GE) {
        int c = compare(a, b);
        if (c == 2)
            return rfail(R, n, "'%s' not supported between instances of '%s' and '%s'", op_text(op),
                         jv_type_name(a), jv_type_name(b));
        bool r = c == 3 ? false : op == JOP_LT ? c < 0 : op == JOP_LE ? c <= 0 : op == JOP_GT ? c > 0 : c >= 0;
        *out = jv_bool(r);
        return true;
    }
    if (is_num(a) && is_num(b)) {
        bool ints = a.t != JV_FLOAT && b.t != JV_FLOAT;
        int64_t x = num_i(a), y = num_i(b), r;
        double fx = num_f(a), fy = num_f(b);
        switch (op) {
        case JOP_ADD:
            if (ints) {
                if (__builtin_add_overflow(x, y, &r))
                    return rfail(R, n, "integer overflow in '+'");
                *out = jv_int(r);
            } else {
                *out = jv_float(fx + fy);
            }
            return true;
        case JOP_SUB:
            if (ints) {
                if (__builtin_sub_overflow(x, y, &r))
                    return rfail(R, n, "integer overflow in '-'");
                *out = jv_int(r);
            } else {
                *out = jv_float(fx - fy);
            }
            return true;
        case JOP_MUL:
            if (ints) {
                if (__builtin_mul_overflow(x, y, &r))
                    return rfail(R, n, "integer overflow in '*'");
                *out = jv_int(r);
            } else {
                *out = jv_float(fx * fy);
            }
            return true;
        case JOP_DIV:
            if (fy == 0)
                return rfail(R, n, "division by zero");
            *out = jv_float(fx / fy);
            return true;
        case JOP_FLOORDIV:
        case JOP_MOD:
            if (ints) {
                if (y == 0)
                    return rfail(R, n, "integer division or modulo by zero");
                if (x == INT64_MIN && y == -1)
                    return rfail(R, n, "integer overflow in '%s'", op_text(op));
                int64_t q = x / y, m = x % y;
                if (m != 0 && ((m < 0) != (y < 0))) {
                    q--;
                    m += y;
                }
                *out = jv_int(op == JOP_MOD ? m : q);
            } else {
                if (fy == 0)
                    return rfail(R, n, "float division by zero");
                double m = fmod(fx, fy);
                if (m != 0 && ((m < 0) != (fy < 0)))
                    m += fy;
                double div = (fx - m) / fy, fl = floor(div); /* as CPython's float floordiv */
                if (div - fl > 0.5)
                    fl += 1.0;
                *out = jv_float(op == JOP_MOD ? m : fl);
            }
            return true;
        case JOP_POW:
            if (ints && y >= 0) {
                int64_t acc = 1, base = x;
                for (int64_t e = y; e > 0; e >>= 1) {
                    if ((e & 1) && __builtin_mul_overflow(acc, base, &acc))
                        return rfail(R, n, "integer overflow in '**'");
                    if (e > 1 && __builtin_mul_overflow(base, base, &base))
                        return rfail(R, n, "integer overflow in '**'");
                }
                *out = jv_int(acc);
            } else {
                if (fx == 0 && fy < 0)
                    return rfail(R, n, "0.0 cannot be raised to a negative power");
                *out = jv_float(pow(fx, fy));
            }
            return true;
        default: break;
        }
    }
    if (op == JOP_ADD && a.t == JV_STR && b.t == JV_STR) {
        if (!check_size(R, n, a.u.s->len + b.u.s->len))
            return false;
        return jv_str_cat(a.u.s->s, a.u.s->len, b.u.s->s, b.u.s->len, out) ? true : room(R);
    }
    if (op == JOP_ADD && a.t == JV_LIST && b.t == JV_LIST) {
        if (a.u.l->n + b.u.l->n > (uint64_t)R->lim.max_iters)
            return rlimit(R, n, "a list would have more than %lld items", (long long)R->lim.max_iters);
        if (!jv_list_new(a.u.l->n + b.u.l->n, out))
            return room(R);
        for (size_t i = 0; i < a.u.l->n; i++)
            jv_list_push(*out, jv_retain(a.u.l->v[i]));
        for (size_t i = 0; i < b.u.l->n; i++)
            jv_list_push(*out, jv_retain(b.u.l->v[i]));
        return true;
    }
    if (op == JOP_MUL && (a.t == JV_STR || a.t == JV_LIST) && (b.t == JV_INT || b.t == JV_BOOL))
        return repeat(R, n, a, num_i(b), out);
    if (op == JOP_MUL && (b.t == JV_STR || b.t == JV_LIST) && (a.t == JV_INT || a.t == JV_BOOL))
        return repeat(R, n, b, num_i(a), out);
    return rfail(R, n, "unsupported operand type(s) for %s: '%s' and '%s'", op_text(op),
                 jv_type_name(a), jv_type_name(b));
}

/* ---- item access and slicing ------------------------------------------------------------- */

static bool getitem(rstate *R, const jnode *n, jv obj, jv key, const char *name, jv *out)
{
    switch (obj.t) {
    case JV_DICT:
    case JV_NS: {
        jv *v = jv_dict_get(obj.u.d, key);
        *out = v ? jv_retain(*v) : jv_undef(name);
        return true;
    }
    case JV_LIST:
        if (key.t == JV_INT || key.t == JV_BOOL) {
            int64_t i = num_i(key), len = (int64_t)obj.u.l->n;
            if (i < 0)
                i += len;
            *out = i >= 0 && i < len ? jv_retain(obj.u.l->v[i]) : jv_undef(name);
            return true;
        }
        break;
    case JV_STR:
        if (key.t == JV_INT || key.t == JV_BOOL) {
            size_t *offs, cnt;
            if (!cp_offsets(R, obj.u.s, &offs, &cnt))
                return false;
            int64_t i = num_i(key);
            if (i < 0)
                i += (int64_t)cnt;
            bool ok = true;
            if (i >= 0 && i < (int64_t)cnt)
                ok = mkstr(R, obj.u.s->s + off_at(offs, (size_t)i),
                           off_at(offs, (size_t)i + 1) - off_at(offs, (size_t)i), out);
            else
                *out = jv_undef(name);
            free(offs);
            return ok;
        }
        break;
    case JV_UNDEF: return undef_err(R, n, obj);
    default: break;
    }
    *out = jv_undef(name);
    return true;
}

static bool slice_index(rstate *R, const jnode *n, jv v, int64_t *out, bool *given)
{
    *given = false;
    if (v.t == JV_NONE || v.t == JV_UNDEF)
        return true;
    if (v.t != JV_INT && v.t != JV_BOOL)
        return rfail(R, n, "slice indices must be integers or None, not %s", jv_type_name(v));
    *out = num_i(v);
    *given = true;
    return true;
}

static bool do_slice(rstate *R, const jnode *n, jv obj, jv vs, jv ve, jv vstep, jv *out)
{
    int64_t start = 0, stop = 0, step = 1;
    bool gs, ge, gp;
    if (!slice_index(R, n, vs, &start, &gs) || !slice_index(R, n, ve, &stop, &ge) ||
        !slice_index(R, n, vstep, &step, &gp))
        return false;
    if (!gp)
        step = 1;
    if (step == 0)
        return rfail(R, n, "slice step cannot be zero");
    if (obj.t == JV_UNDEF)
        return undef_err(R, n, obj);
    if (obj.t != JV_LIST && obj.t != JV_STR)
        return rfail(R, n, "'%s' object is not subscriptable", jv_type_name(obj));
    size_t *offs = NULL, len;
    if (obj.t == JV_STR) {
        if (!cp_offsets(R, obj.u.s, &offs, &len))
            return false;
    } else {
        len = obj.u.l->n;
    }
    int64_t L = (int64_t)len;
    /* Python's slice.indices() */
    if (!gs)
        start = step < 0 ? L - 1 : 0;
    else if (start < 0)
        start = start + L < 0 ? (step < 0 ? -1 : 0) : start + L;
    else if (start >= L)
        start = step < 0 ? L - 1 : L;
    if (!ge)
        stop = step < 0 ? -1 : L;
    else if (stop < 0)
        stop = stop + L < 0 ? (step < 0 ? -1 : 0) : stop + L;
    else if (stop >= L)
        stop = step < 0 ? L - 1 : L;
    bool ok = true;
    if (obj.t == JV_STR) {
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            kvf_sbuf_append(&b, obj.u.s->s + off_at(offs, (size_t)i),
                            off_at(offs, (size_t)i + 1) - off_at(offs, (size_t)i));
        free(offs);
        return sbuf_to_str(R, n, &b, out);
    }
    if (!jv_list_new(0, out))
        return room(R);
    out->u.l->tuple = obj.u.l->tuple;
    for (int64_t i = start; ok && (step > 0 ? i < stop : i > stop); i += step)
        ok = jv_list_push(*out, jv_retain(obj.u.l->v[i]));
    return ok ? true : room(R);
}

/* obj.name: a dict key, else undefined; the attribute of an undefined value is an error. */
static bool getattr_v(rstate *R, const jnode *n, jv obj, const char *name, jv *out)
{
    if (obj.t == JV_UNDEF)
        return undef_err(R, n, obj);
    if (obj.t == JV_DICT || obj.t == JV_NS) {
        jv *v = jv_dict_get_cstr(obj.u.d, name);
        *out = v ? jv_retain(*v) : jv_undef(name);
        return true;
    }
    *out = jv_undef(name);
    return true;
}

/* "a.b.0" style attribute paths (map, selectattr, sort, join). */
static bool attr_path(rstate *R, const jnode *n, jv obj, jv path, jv *out)
{
    if (path.t == JV_INT)
        return getitem(R, n, obj, path, NULL, out);
    if (path.t != JV_STR)
        return rfail(R, n, "attribute must be a string, not %s", jv_type_name(path));
    jv cur = jv_retain(obj);
    const char *s = path.u.s->s, *end = s + path.u.s->len;
    while (s <= end) {
        const char *dot = memchr(s, '.', (size_t)(end - s));
        if (!dot)
            dot = end;
        jv key, next;
        bool digits = dot > s;
        for (const char *p = s; p < dot; p++)
            digits = digits && *p >= '0' && *p <= '9';
        if (digits && dot - s < 18) {
            key = jv_int(strtoll(s, NULL, 10));
        } else if (!mkstr(R, s, (size_t)(dot - s), &key)) {
            jv_release(cur);
            return false;
        }
        /* an undefined step stays undefined; getitem returns a new reference */
        bool ok = cur.t == JV_UNDEF ? (next = cur, true) : getitem(R, n, cur, key, NULL, &next);
        jv_release(key);
        jv_release(cur);
        if (!ok)
            return false;
        cur = next;
        s = dot + 1;
    }
    *out = cur;
    return true;
}

/* ---- iteration ----------------------------------------------------------------------------- */

/* The items a for loop (or list()) sees, as a new list. */
static bool iter_list(rstate *R, const jnode *n, jv v, jv *out)
{
    switch (v.t) {
    case JV_LIST: *out = jv_retain(v); return true;
    case JV_UNDEF:
        return jv_list_new(0, out) ? true : room(R);
    case JV_DICT:
    case JV_NS:
        if (!jv_list_new(v.u.d->n, out))
            return room(R);
        for (size_t i = 0; i < v.u.d->n; i++)
            jv_list_push(*out, jv_retain(v.u.d->k[i]));
        return true;
    case JV_STR: {
        size_t *offs, cnt;
        if (!cp_offsets(R, v.u.s, &offs, &cnt))
            return false;
        if (!jv_list_new(cnt, out)) {
            free(offs);
            return room(R);
        }
        bool ok = true;
        for (size_t i = 0; i < cnt && ok; i++) {
            jv c;
            ok = mkstr(R, v.u.s->s + off_at(offs, i), off_at(offs, i + 1) - off_at(offs, i), &c) &&
                 jv_list_push(*out, c);
        }
        free(offs);
        if (!ok) {
            jv_release(*out);
            return room(R);
        }
        return true;
    }
    default: return rfail(R, n, "'%s' object is not iterable", jv_type_name(v));
    }
}

/* ---- strings ------------------------------------------------------------------------------- */

static bool in_chars(uint32_t cp, const jstr *chars)
{
    if (!chars)
        return ju_is_space(cp);
    for (size_t i = 0; i < chars->len;) {
        uint32_t c;
        i = ju_next(chars->s, chars->len, i, &c);
        if (c == cp)
            return true;
    }
    return false;
}

/* Python's str.strip / lstrip / rstrip (chars NULL: whitespace). */
static bool str_strip(rstate *R, const jstr *s, const jstr *chars, bool left, bool right, jv *out)
{
    size_t a = 0, b = s->len;
    if (left)
        while (a < b) {
            uint32_t cp;
            size_t nx = ju_next(s->s, s->len, a, &cp);
            if (!in_chars(cp, chars))
                break;
            a = nx;
        }
    if (right)
        while (b > a) {
            size_t p = b - 1;
            while (p > a && ((unsigned char)s->s[p] & 0xc0) == 0x80 && b - p < 4)
                p--;
            uint32_t cp;
            size_t nx = ju_next(s->s, s->len, p, &cp);
            if (nx != b) { /* invalid sequence: one byte */
                p = b - 1;
                cp = (unsigned char)s->s[p];
            }
            if (!in_chars(cp, chars))
                break;
            b = p;
        }
    return mkstr(R, s->s + a, b - a, out);
}

static bool str_push(rstate *R, jv list, const char *s, size_t n)
{
    jv v;
    if (!mkstr(R, s, n, &v))
        return false;
    return jv_list_push(list, v) ? true : room(R);
}

/* Python's str.split(sep=None, maxsplit=-1) */
static bool str_split(rstate *R, const jnode *n, const jstr *s, const jstr *sep, int64_t maxsplit, jv *out)
{
    if (!jv_list_new(0, out))
        return room(R);
    if (sep && sep->len == 0) {
        jv_release(*out);
        return rfail(R, n, "split(): empty separator");
    }
    int64_t splits = 0;
    if (sep) {
        size_t i = 0;
        for (;;) {
            const char *hit = maxsplit >= 0 && splits >= maxsplit ? NULL
                            : memmem(s->s + i, s->len - i, sep->s, sep->len);
            if (!hit) {
                if (!str_push(R, *out, s->s + i, s->len - i))
                    return false;
                return true;
            }
            if (!str_push(R, *out, s->s + i, (size_t)(hit - (s->s + i))))
                return false;
            i = (size_t)(hit - s->s) + sep->len;
            splits++;
        }
    }
    size_t i = 0;
    for (;;) {
        while (i < s->len) { /* skip whitespace */
            uint32_t cp;
            size_t nx = ju_next(s->s, s->len, i, &cp);
            if (!ju_is_space(cp))
                break;
            i = nx;
        }
        if (i >= s->len)
            return true;
        if (maxsplit >= 0 && splits >= maxsplit) {
            size_t e = s->len;
            return str_push(R, *out, s->s + i, e - i);
        }
        size_t j = i;
        while (j < s->len) {
            uint32_t cp;
            size_t nx = ju_next(s->s, s->len, j, &cp);
            if (ju_is_space(cp))
                break;
            j = nx;
        }
        if (!str_push(R, *out, s->s + i, j - i))
            return false;
        splits++;
        i = j;
    }
}

/* Python's str.replace(old, new, count=-1) */
static bool str_replace(rstate *R, const jnode *n, const jstr *s, const jstr *old, const jstr *new_,
                        int64_t count, jv *out)
{
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    int64_t done = 0;
    if (old->len == 0) { /* inserts between every code point */
        size_t i = 0;
        for (;;) {
            if (count < 0 || done < count) {
                kvf_sbuf_append(&b, new_->s, new_->len);
                done++;
            }
            if (i >= s->len)
                break;
            size_t nx = ju_next(s->s, s->len, i, NULL);
            kvf_sbuf_append(&b, s->s + i, nx - i);
            i = nx;
            if (b.len > R->lim.max_output)
                break;
        }
        return sbuf_to_str(R, n, &b, out);
    }
    size_t i = 0;
    while (i <= s->len && b.len <= R->lim.max_output) {
        const char *hit = count >= 0 && done >= count ? NULL : memmem(s->s + i, s->len - i, old->s, old->len);
        if (!hit) {
            kvf_sbuf_append(&b, s->s + i, s->len - i);
            break;
        }
        kvf_sbuf_append(&b, s->s + i, (size_t)(hit - (s->s + i)));
        kvf_sbuf_append(&b, new_->s, new_->len);
        i = (size_t)(hit - s->s) + old->len;
        done++;
    }
    return sbuf_to_str(R, n, &b, out);
}

static bool is_cased_cat(int cat)
{
    return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

static void put_cp(kvf_sbuf *b, uint32_t cp)
{
    utf8proc_uint8_t tmp[4];
    utf8proc_ssize_t k = utf8proc_encode_char((utf8proc_int32_t)cp, tmp);
    kvf_sbuf_append(b, tmp, (size_t)(k > 0 ? k : 0));
}

/* mode: 'u' upper, 'l' lower, 't' Python's str.title(), 'T' Jinja's title filter, 'c' capitalize() */
static bool str_case(rstate *R, const jnode *n, const jstr *s, char mode, jv *out)
{
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    bool prev_cased = false, first = true;
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        size_t nx = ju_next(s->s, s->len, i, &cp);
        bool valid = cp <= 0x10ffff && (nx - i > 1 || cp < 0x80);
        if (!valid) {
            kvf_sbuf_append(&b, s->s + i, nx - i);
            i = nx;
            prev_cased = false;
            first = false;
            continue;
        }
        utf8proc_int32_t c = (utf8proc_int32_t)cp, r = c;
        switch (mode) {
        case 'u': r = utf8proc_toupper(c); break;
        case 'l': r = utf8proc_tolower(c); break;
        case 'c': r = first ? utf8proc_totitle(c) : utf8proc_tolower(c); break;
        case 't':
            r = prev_cased ? utf8proc_tolower(c) : utf8proc_totitle(c);
            prev_cased = is_cased_cat(utf8proc_category(c));
            break;
        case 'T': { /* Jinja's title filter: chunks split at runs of [-\s({[<], first char upper */
            bool delim = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || ju_is_space(cp);
            r = delim ? c : prev_cased ? utf8proc_tolower(c) : utf8proc_toupper(c);
            prev_cased = !delim; /* inside a chunk after its first character */
            break;
        }
        }
        if (mode == 'c' && first)
            r = utf8proc_toupper(c) == c ? utf8proc_totitle(c) : utf8proc_toupper(c);
        if (c == 0xdf && (mode == 'u' || ((mode == 't' || mode == 'c' || mode == 'T') && r != utf8proc_tolower(c))))
            kvf_sbuf_puts(&b, mode == 'u' ? "SS" : "Ss"); /* Python's special casing of sharp s */
        else
            put_cp(&b, (uint32_t)r);
        first = false;
        i = nx;
    }
    return sbuf_to_str(R, n, &b, out);
}

static bool str_affix(const jstr *s, jv affix, bool end, bool *out, bool *type_ok)
{
    *type_ok = true;
    if (affix.t == JV_LIST) {
        *out = false;
        for (size_t i = 0; i < affix.u.l->n && !*out; i++) {
            bool ok;
            if (!str_affix(s, affix.u.l->v[i], end, out, &ok) || !ok) {
                *type_ok = false;
                return false;
            }
        }
        return true;
    }
    if (affix.t != JV_STR) {
        *type_ok = false;
        return false;
    }
    size_t k = affix.u.s->len;
    *out = k <= s->len && memcmp(s->s + (end ? s->len - k : 0), affix.u.s->s, k) == 0;
    return true;
}

/* Python's str.splitlines() (keepends=False): \n, \r, \r\n, \v, \f, \x1c-\x1e, \x85, U+2028/9 */
static bool str_splitlines(rstate *R, const jstr *s, jv *out)
{
    if (!jv_list_new(0, out))
        return room(R);
    size_t start = 0, i = 0;
    while (i < s->len) {
        uint32_t cp;
        size_t nx = ju_next(s->s, s->len, i, &cp);
        bool brk = cp == '\n' || cp == '\r' || cp == 0x0b || cp == 0x0c || (cp >= 0x1c && cp <= 0x1e) ||
                   cp == 0x85 || cp == 0x2028 || cp == 0x2029;
        if (brk) {
            if (!str_push(R, *out, s->s + start, i - start))
                return false;
            if (cp == '\r' && nx < s->len && s->s[nx] == '\n')
                nx++;
            start = nx;
        }
        i = nx;
    }
    if (start < s->len && !str_push(R, *out, s->s + start, s->len - start))
        return false;
    return true;
}

/* ---- argument helpers ---------------------------------------------------------------------- */

static void args_free(args *a)
{
    for (size_t i = 0; i < a->n_pos; i++)
        jv_release(a->pos[i]);
    for (size_t i = 0; i < a->n_kw; i++)
        jv_release(a->kwv[i]);
    a->n_pos = a->n_kw = 0;
}

static bool eval_args(rstate *R, const jnode *n, jframe *f, args *a)
{
    a->n_pos = a->n_kw = 0;
    if (n->n_kids > MAX_ARGS)
        return rfail(R, n, "too many arguments (%zu; at most %d)", n->n_kids, MAX_ARGS);
    for (size_t i = 0; i < n->n_kids; i++) {
        jv v;
        if (!eval(R, n->kids[i], f, &v)) {
            args_free(a);
            return false;
        }
        if (n->kw && n->kw[i]) {
            a->kwn[a->n_kw] = n->kw[i];
            a->kwv[a->n_kw++] = v;
        } else {
            a->pos[a->n_pos++] = v;
        }
    }
    return true;
}

/* The argument at position i or named name; NULL when not given. */
static jv *arg(args *a, size_t i, const char *name)
{
    if (i < MAX_ARGS && i < a->n_pos)
        return &a->pos[i];
    for (size_t k = 0; name && k < a->n_kw; k++)
        if (strcmp(a->kwn[k], name) == 0)
            return &a->kwv[k];
    return NULL;
}

static bool arg_str(rstate *R, const jnode *n, args *a, size_t i, const char *name, const char *what,
                    const jstr **out)
{
    jv *v = arg(a, i, name);
    *out = NULL; /* set on every path: rfail's false is not visible to the compiler */
    if (!v || v->t == JV_NONE)
        return true;
    if (v->t != JV_STR)
        return rfail(R, n, "%s: argument '%s' must be a string, not %s", what, name, jv_type_name(*v));
    *out = v->u.s;
    return true;
}

static bool arg_int(rstate *R, const jnode *n, args *a, size_t i, const char *name, const char *what,
                    int64_t def, int64_t *out)
{
    jv *v = arg(a, i, name);
    *out = def;
    if (!v || v->t == JV_NONE)
        return true;
    if (v->t != JV_INT && v->t != JV_BOOL)
        return rfail(R, n, "%s: argument '%s' must be an integer, not %s", what, name, jv_type_name(*v));
    *out = num_i(*v);
    return true;
}

/* ---- names: resolved once, at parse time ------------------------------------------------ */

typedef struct jname {
    const char *name;
    int id;
} jname;

static const jname filter_names[] = {
    {"abs", JF_ABS},
    {"capitalize", JF_CAPITALIZE},
    {"count", JF_LENGTH},
    {"d", JF_DEFAULT},
    {"default", JF_DEFAULT},
    {"dictsort", JF_DICTSORT},
    {"e", JF_ESCAPE},
    {"escape", JF_ESCAPE},
    {"first", JF_FIRST},
    {"float", JF_FLOAT},
    {"forceescape", JF_ESCAPE},
    {"indent", JF_INDENT},
    {"int", JF_INT},
    {"items", JF_ITEMS},
    {"join", JF_JOIN},
    {"last", JF_LAST},
    {"length", JF_LENGTH},
    {"list", JF_LIST},
    {"lower", JF_LOWER},
    {"map", JF_MAP},
    {"max", JF_MAX},
    {"min", JF_MIN},
    {"reject", JF_REJECT},
    {"rejectattr", JF_REJECTATTR},
    {"replace", JF_REPLACE},
    {"reverse", JF_REVERSE},
    {"round", JF_ROUND},
    {"safe", JF_SAFE},
    {"select", JF_SELECT},
    {"selectattr", JF_SELECTATTR},
    {"sort", JF_SORT},
    {"string", JF_STRING},
    {"sum", JF_SUM},
    {"title", JF_TITLE},
    {"tojson", JF_TOJSON},
    {"trim", JF_TRIM},
    {"unique", JF_UNIQUE},
    {"upper", JF_UPPER},
    {"wordcount", JF_WORDCOUNT},
};

static const jname test_names[] = {
    {"boolean", JT_BOOLEAN},
    {"callable", JT_CALLABLE},
    {"defined", JT_DEFINED},
    {"divisibleby", JT_DIVISIBLEBY},
    {"eq", JT_EQ},
    {"equalto", JT_EQ},
    {"even", JT_EVEN},
    {"false", JT_FALSE},
    {"float", JT_FLOAT},
    {"ge", JT_GE},
    {"greaterthan", JT_GT},
    {"gt", JT_GT},
    {"in", JT_IN},
    {"integer", JT_INTEGER},
    {"iterable", JT_ITERABLE},
    {"le", JT_LE},
    {"lessthan", JT_LT},
    {"lower", JT_LOWER},
    {"lt", JT_LT},
    {"mapping", JT_MAPPING},
    {"ne", JT_NE},
    {"none", JT_NONE},
    {"number", JT_NUMBER},
    {"odd", JT_ODD},
    {"sameas", JT_SAMEAS},
    {"sequence", JT_SEQUENCE},
    {"string", JT_STRING},
    {"true", JT_TRUE},
    {"undefined", JT_UNDEFINED},
    {"upper", JT_UPPER},
};

static const jname method_names[] = {
    {"capitalize", JM_CAPITALIZE},
    {"count", JM_COUNT},
    {"cycle", JM_CYCLE},
    {"endswith", JM_ENDSWITH},
    {"find", JM_FIND},
    {"get", JM_GET},
    {"isalpha", JM_ISALPHA},
    {"isdigit", JM_ISDIGIT},
    {"islower", JM_ISLOWER},
    {"isspace", JM_ISSPACE},
    {"isupper", JM_ISUPPER},
    {"items", JM_ITEMS},
    {"join", JM_JOIN},
    {"keys", JM_KEYS},
    {"lower", JM_LOWER},
    {"lstrip", JM_LSTRIP},
    {"replace", JM_REPLACE},
    {"rsplit", JM_RSPLIT},
    {"rstrip", JM_RSTRIP},
    {"split", JM_SPLIT},
    {"splitlines", JM_SPLITLINES},
    {"startswith", JM_STARTSWITH},
    {"strip", JM_STRIP},
    {"title", JM_TITLE},
    {"upper", JM_UPPER},
    {"values", JM_VALUES},
};

static const jname global_names[] = {
    {"dict", JG_DICT},
    {"namespace", JG_NAMESPACE},
    {"raise_exception", JG_RAISE_EXCEPTION},
    {"range", JG_RANGE},
    {"strftime_now", JG_STRFTIME_NOW},
};

/* The tables are sorted by name: a binary search, run by the parser once per node. */
static int name_find(const jname *t, size_t n, const char *name)
{
    size_t lo = 0, hi = n;
    while (name && lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(name, t[mid].name);
        if (c == 0)
            return t[mid].id;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return -1;
}

#define NAME_FIND(t, name) name_find(t, sizeof t / sizeof t[0], name)

int kvf_text_jinja_filter_id(const char *name) { return NAME_FIND(filter_names, name); }
int kvf_text_jinja_test_id(const char *name) { return NAME_FIND(test_names, name); }
int kvf_text_jinja_method_id(const char *name) { return NAME_FIND(method_names, name); }
int kvf_text_jinja_global_id(const char *name) { return NAME_FIND(global_names, name); }

/* ---- tests --------------------------------------------------------------------------------- */

static bool str_all_case(const jstr *s, bool upper)
{
    bool cased = false;
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        i = ju_next(s->s, s->len, i, &cp);
        if (cp > 0x10ffff)
            continue;
        int cat = utf8proc_category((utf8proc_int32_t)cp);
        if (cat == (upper ? UTF8PROC_CATEGORY_LL : UTF8PROC_CATEGORY_LU) || cat == UTF8PROC_CATEGORY_LT)
            return false;
        if (is_cased_cat(cat))
            cased = true;
    }
    return cased;
}

static bool run_test(rstate *R, const jnode *n, int id, const char *name, jv v, args *a, bool *out)
{
    jv *x = arg(a, 0, NULL);
    if (id == JT_DEFINED) *out = v.t != JV_UNDEF;
    else if (id == JT_UNDEFINED) *out = v.t == JV_UNDEF;
    else if (id == JT_NONE) *out = v.t == JV_NONE;
    else if (id == JT_STRING) *out = v.t == JV_STR;
    else if (id == JT_MAPPING) *out = v.t == JV_DICT;
    else if (id == JT_ITERABLE) *out = v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF;
    else if (id == JT_SEQUENCE) *out = v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF;
    else if (id == JT_NUMBER) *out = is_num(v);
    else if (id == JT_INTEGER) *out = v.t == JV_INT;
    else if (id == JT_FLOAT) *out = v.t == JV_FLOAT;
    else if (id == JT_BOOLEAN) *out = v.t == JV_BOOL;
    else if (id == JT_TRUE) *out = v.t == JV_BOOL && v.u.b;
    else if (id == JT_FALSE) *out = v.t == JV_BOOL && !v.u.b;
    else if (id == JT_CALLABLE) *out = v.t == JV_MACRO;
    else if (id == JT_LOWER || id == JT_UPPER) { /* str(value).islower() */
        jv sv;
        if (!to_str(R, n, v, &sv))
            return false;
        *out = str_all_case(sv.u.s, id == JT_UPPER);
        jv_release(sv);
    }
    else if (id == JT_ODD || id == JT_EVEN) { /* value % 2 == 1 (or 0) */
        jv r;
        if (!binop(R, n, JOP_MOD, v, jv_int(2), &r))
            return false;
        *out = jv_equal(r, jv_int(id == JT_ODD ? 1 : 0));
        jv_release(r);
    } else if (id == JT_DIVISIBLEBY) {
        if ((v.t != JV_INT && v.t != JV_BOOL) || !x || (x->t != JV_INT && x->t != JV_BOOL) || num_i(*x) == 0)
            return rfail(R, n, "test 'divisibleby' needs integers and a non-zero divisor");
        *out = num_i(*x) == -1 || num_i(v) % num_i(*x) == 0;
    } else if (id == JT_SAMEAS) {
        if (!x)
            return rfail(R, n, "test 'sameas' needs an argument");
        *out = v.t == x->t && (v.t == JV_NONE || v.t == JV_UNDEF || (v.t == JV_BOOL && v.u.b == x->u.b) ||
                               (v.t == JV_INT && v.u.i == x->u.i) ||
                               (v.t >= JV_STR && v.u.s == x->u.s));
    } else if (id == JT_EQ || id == JT_NE ||
               id == JT_LT || id == JT_LE ||
               id == JT_GT || id == JT_GE ||
               id == JT_IN) {
        if (!x)
            return rfail(R, n, "test '%s' needs an argument", name);
        int op = id == JT_NE ? JOP_NE : id == JT_LT ? JOP_LT
               : id == JT_LE ? JOP_LE : id == JT_GT ? JOP_GT
               : id == JT_GE ? JOP_GE : id == JT_IN ? JOP_IN : JOP_EQ;
        jv r;
        if (!binop(R, n, op, v, *x, &r))
            return false;
        *out = r.u.b;
    } else {
        return rfail(R, n, "unknown test '%s'", name);
    }
    return true;
}

/* ---- filters ------------------------------------------------------------------------------- */

static bool apply_filter(rstate *R, const jnode *n, int id, const char *name, jv v, args *a, jv *out);

static bool html_escape(rstate *R, const jnode *n, jv v, jv *out)
{
    jv s;
    if (!to_str(R, n, v, &s))
        return false;
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    for (size_t i = 0; i < s.u.s->len; i++) {
        char c = s.u.s->s[i];
        switch (c) {
        case '&': kvf_sbuf_puts(&b, "&amp;"); break;
        case '<': kvf_sbuf_puts(&b, "&lt;"); break;
        case '>': kvf_sbuf_puts(&b, "&gt;"); break;
        case '"': kvf_sbuf_puts(&b, "&#34;"); break;
        case '\'': kvf_sbuf_puts(&b, "&#39;"); break;
        default: kvf_sbuf_putc(&b, c);
        }
    }
    jv_release(s);
    return sbuf_to_str(R, n, &b, out);
}

static bool f_tojson(rstate *R, const jnode *n, jv v, args *a, jv *out)
{
    jv *ind = arg(a, KW_ONLY, "indent"), *sep = arg(a, KW_ONLY, "separators"), *sk = arg(a, KW_ONLY, "sort_keys"),
       *ea = arg(a, KW_ONLY, "ensure_ascii");
    if (!ind && a->n_pos > 0)
        ind = &a->pos[0];
    int indent = -1;
    const char *indent_str = NULL;
    if (ind && (ind->t == JV_INT || ind->t == JV_BOOL)) {
        int64_t k = num_i(*ind);
        indent = k < 0 ? 0 : k > 64 ? 64 : (int)k;
    } else if (ind && ind->t == JV_STR) {
        indent_str = ind->u.s->s;
    } else if (ind && ind->t != JV_NONE) {
        return rfail(R, n, "tojson: indent must be an integer, a string or None, not %s", jv_type_name(*ind));
    }
    const char *item_sep = NULL, *key_sep = NULL;
    if (sep && sep->t == JV_LIST) {
        if (sep->u.l->n != 2 || sep->u.l->v[0].t != JV_STR || sep->u.l->v[1].t != JV_STR)
            return rfail(R, n, "tojson: separators must be a pair of strings");
        item_sep = sep->u.l->v[0].u.s->s;
        key_sep = sep->u.l->v[1].u.s->s;
    } else if (sep && sep->t != JV_NONE) {
        return rfail(R, n, "tojson: separators must be a pair of strings, not %s", jv_type_name(*sep));
    }
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    char why[200] = "";
    if (!jv_to_json(&b, v, indent, indent_str, item_sep, key_sep, sk && jv_truthy(*sk), ea && jv_truthy(*ea),
                    why, sizeof why)) {
        kvf_sbuf_fini(&b);
        if (v.t == JV_UNDEF)
            return undef_err(R, n, v);
        return rfail(R, n, "tojson: %s", why);
    }
    return sbuf_to_str(R, n, &b, out);
}

static bool f_indent(rstate *R, const jnode *n, jv v, args *a, jv *out)
{
    jv s;
    if (v.t == JV_UNDEF)
        return undef_err(R, n, v);
    if (v.t != JV_STR)
        return rfail(R, n, "indent: expected a string, not %s", jv_type_name(v));
    s = jv_retain(v);
    jv *w = arg(a, 0, "width");
    kvf_sbuf ind;
    kvf_sbuf_init(&ind);
    if (w && w->t == JV_STR) {
        kvf_sbuf_append(&ind, w->u.s->s, w->u.s->len);
    } else {
        int64_t width = 4;
        if (w && (w->t == JV_INT || w->t == JV_BOOL))
            width = num_i(*w);
        for (int64_t i = 0; i < width && i < 1024; i++)
            kvf_sbuf_putc(&ind, ' ');
    }
    jv *first = arg(a, 1, "first"), *blank = arg(a, 2, "blank");
    bool f_first = first && jv_truthy(*first), f_blank = blank && jv_truthy(*blank);
    /* as Jinja: s += "\n", then indent the lines after the first */
    jv s2, lines;
    bool ok = jv_str_cat(s.u.s->s, s.u.s->len, "\n", 1, &s2);
    jv_release(s);
    if (!ok) {
        kvf_sbuf_fini(&ind);
        return room(R);
    }
    if (!str_splitlines(R, s2.u.s, &lines)) {
        jv_release(s2);
        kvf_sbuf_fini(&ind);
        return false;
    }
    jv_release(s2);
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    if (f_first && lines.u.l->n)
        kvf_sbuf_append(&b, ind.data ? ind.data : "", ind.len);
    for (size_t i = 0; i < lines.u.l->n && b.len <= R->lim.max_output; i++) {
        jstr *line = lines.u.l->v[i].u.s;
        if (i) {
            kvf_sbuf_putc(&b, '\n');
            if (f_blank || line->len)
                kvf_sbuf_append(&b, ind.data ? ind.data : "", ind.len);
        }
        kvf_sbuf_append(&b, line->s, line->len);
    }
    jv_release(lines);
    kvf_sbuf_fini(&ind);
    return sbuf_to_str(R, n, &b, out);
}

static bool f_join(rstate *R, const jnode *n, jv v, args *a, jv *out)
{
    const jstr *sep;
    if (!arg_str(R, n, a, 0, "d", "join", &sep))
        return false;
    jv *attr = arg(a, 1, "attribute");
    jv items;
    if (!iter_list(R, n, v, &items))
        return false;
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    bool ok = true;
    for (size_t i = 0; i < items.u.l->n && ok && b.len <= R->lim.max_output; i++) {
        if (i && sep)
            kvf_sbuf_append(&b, sep->s, sep->len);
        jv it = items.u.l->v[i];
        if (attr) {
            jv x;
            if (!(ok = attr_path(R, n, it, *attr, &x)))
                break;
            jv_to_str(&b, x);
            jv_release(x);
        } else {
            jv_to_str(&b, it);
        }
    }
    jv_release(items);
    if (!ok) {
        kvf_sbuf_fini(&b);
        return false;
    }
    return sbuf_to_str(R, n, &b, out);
}

/* select/reject/selectattr/rejectattr: items passing (or failing) a test. */
static bool f_select(rstate *R, const jnode *n, jv v, args *a, bool by_attr, bool keep, jv *out)
{
    size_t base = by_attr ? 1 : 0;
    if (by_attr && a->n_pos < 1)
        return rfail(R, n, "selectattr/rejectattr need an attribute name");
    jv *tname = arg(a, base, NULL);
    if (tname && tname->t != JV_STR)
        return rfail(R, n, "select: the test name must be a string");
    args targs = {0};
    for (size_t i = base + 1; i < a->n_pos; i++)
        targs.pos[targs.n_pos++] = a->pos[i];
    if (!jv_truthy(v)) /* as Jinja: a falsy value is an empty sequence here */
        return jv_list_new(0, out) ? true : room(R);
    jv items;
    if (!iter_list(R, n, v, &items))
        return false;
    if (!jv_list_new(0, out)) {
        jv_release(items);
        return room(R);
    }
    bool ok = true;
    int tid = tname ? kvf_text_jinja_test_id(tname->u.s->s) : -1; /* once, not per item */
    for (size_t i = 0; i < items.u.l->n && ok; i++) {
        jv it = items.u.l->v[i], x = it;
        if (by_attr && !(ok = attr_path(R, n, it, a->pos[0], &x)))
            break;
        bool pass;
        if (tname)
            ok = run_test(R, n, tid, tname->u.s->s, x, &targs, &pass);
        else
            pass = jv_truthy(x);
        if (by_attr)
            jv_release(x);
        if (ok && pass == keep)
            ok = jv_list_push(*out, jv_retain(it)) ? true : room(R);
    }
    jv_release(items);
    if (!ok)
        jv_release(*out);
    return ok;
}

static bool f_map(rstate *R, const jnode *n, jv v, args *a, jv *out)
{
    jv *attr = arg(a, KW_ONLY, "attribute"), *def = arg(a, KW_ONLY, "default");
    if (!attr && (a->n_pos < 1 || a->pos[0].t != JV_STR))
        return rfail(R, n, "map needs a filter name or attribute=");
    args fargs = {0};
    for (size_t i = 1; !attr && i < a->n_pos; i++)
        fargs.pos[fargs.n_pos++] = a->pos[i];
    if (!jv_truthy(v))
        return jv_list_new(0, out) ? true : room(R);
    jv items;
    if (!iter_list(R, n, v, &items))
        return false;
    if (!jv_list_new(items.u.l->n, out)) {
        jv_release(items);
        return room(R);
    }
    bool ok = true;
    int fid = attr ? -1 : kvf_text_jinja_filter_id(a->pos[0].u.s->s); /* once, not per item */
    for (size_t i = 0; i < items.u.l->n && ok; i++) {
        jv x;
        if (attr) {
            ok = attr_path(R, n, items.u.l->v[i], *attr, &x);
            if (ok && x.t == JV_UNDEF && def)
                x = jv_retain(*def);
        } else {
            ok = apply_filter(R, n, fid, a->pos[0].u.s->s, items.u.l->v[i], &fargs, &x);
        }
        if (ok)
            ok = jv_list_push(*out, x) ? true : room(R);
    }
    jv_release(items);
    if (!ok)
        jv_release(*out);
    return ok;
}

typedef struct sort_ctx {
    rstate *R;
    bool reverse, bad;
} sort_ctx;

static int sort_cmp(const void *pa, const void *pb, void *ctx)
{
    sort_ctx *c = ctx;
    const jv *a = pa, *b = pb;
    int r = compare(a[1], b[1]);
    if (r == 2 || r == 3) {
        c->bad = r == 2;
        r = 0;
    }
    if (r == 0)
        r = (a[2].u.i > b[2].u.i) - (a[2].u.i < b[2].u.i); /* stable */
    else if (c->reverse)
        r = -r;
    return r;
}

static bool f_sort(rstate *R, const jnode *n, jv v, args *a, jv *out)
{
    jv *rev = arg(a, 0, "reverse"), *cs = arg(a, 1, "case_sensitive"), *attr = arg(a, 2, "attribute");
    jv items;
    if (!iter_list(R, n, v, &items))
        return false;
    size_t cnt = items.u.l->n;
    jv *trip = calloc(cnt ? cnt * 3 : 1, sizeof *trip); /* item, key, index */
    if (!trip) {
        jv_release(items);
        return room(R);
    }
    bool ok = true;
    size_t done = 0;
    for (; done < cnt && ok; done++) {
        jv it = items.u.l->v[done], key = jv_retain(it);
        if (attr) {
            jv_release(key);
            ok = attr_path(R, n, it, *attr, &key);
            if (!ok)
                break;
        }
        if (ok && key.t == JV_STR && !(cs && jv_truthy(*cs))) {
            jv low;
            ok = str_case(R, n, key.u.s, 'l', &low);
            jv_release(key);
            key = ok ? low : jv_none();
        }
        trip[done * 3] = it;
        trip[done * 3 + 1] = key;
        trip[done * 3 + 2] = jv_int((int64_t)done);
    }
    sort_ctx c = {.R = R, .reverse = rev && jv_truthy(*rev)};
    if (ok)
        qsort_r(trip, cnt, 3 * sizeof *trip, sort_cmp, &c);
    if (ok && c.bad)
        ok = rfail(R, n, "sort: the items cannot be ordered");
    if (ok && !jv_list_new(cnt, out))
        ok = room(R);
    for (size_t i = 0; i < cnt; i++) {
        if (ok && i < done)
            jv_list_push(*out, jv_retain(trip[i * 3]));
        if (i < done)
            jv_release(trip[i * 3 + 1]);
    }
    free(trip);
    jv_release(items);
    return ok;
}

static bool apply_filter(rstate *R, const jnode *n, int id, const char *name, jv v, args *a, jv *out)
{
    if (id == JF_SAFE || (id == JF_STRING && v.t == JV_STR)) {
        *out = jv_retain(v);
        return true;
    }
    if (id == JF_STRING)
        return to_str(R, n, v, out);
    if (id == JF_DEFAULT) {
        jv *def = arg(a, 0, "default_value"), *boolean = arg(a, 1, "boolean");
        bool use_def = v.t == JV_UNDEF || (boolean && jv_truthy(*boolean) && !jv_truthy(v));
        if (!use_def)
            *out = jv_retain(v);
        else if (def)
            *out = jv_retain(*def);
        else
            return mkstr(R, "", 0, out);
        return true;
    }
    if (id == JF_LENGTH) {
        switch (v.t) {
        case JV_STR: *out = jv_int((int64_t)ju_count(v.u.s->s, v.u.s->len)); return true;
        case JV_LIST: *out = jv_int((int64_t)v.u.l->n); return true;
        case JV_DICT:
        case JV_NS: *out = jv_int((int64_t)v.u.d->n); return true;
        case JV_UNDEF: *out = jv_int(0); return true;
        default: return rfail(R, n, "object of type '%s' has no len()", jv_type_name(v));
        }
    }
    if (id == JF_TOJSON)
        return f_tojson(R, n, v, a, out);
    if (id == JF_TRIM) {
        const jstr *chars;
        jv s;
        if (!arg_str(R, n, a, 0, "chars", "trim", &chars) || !to_str(R, n, v, &s))
            return false;
        bool ok = str_strip(R, s.u.s, chars, true, true, out);
        jv_release(s);
        return ok;
    }
    if (id == JF_LOWER || id == JF_UPPER || id == JF_CAPITALIZE ||
        id == JF_TITLE) {
        jv s;
        if (!to_str(R, n, v, &s))
            return false;
        /* the title filter is Jinja's own, not str.title() */
        bool ok = str_case(R, n, s.u.s, id == JF_LOWER ? 'l' : id == JF_UPPER ? 'u' : id == JF_CAPITALIZE ? 'c' : 'T', out);
        jv_release(s);
        return ok;
    }
    if (id == JF_JOIN)
        return f_join(R, n, v, a, out);
    if (id == JF_FIRST || id == JF_LAST) {
        jv items;
        if (!iter_list(R, n, v, &items))
            return false;
        size_t cnt = items.u.l->n;
        *out = cnt ? jv_retain(items.u.l->v[id == JF_FIRST ? 0 : cnt - 1]) : jv_undef(NULL);
        jv_release(items);
        return true;
    }
    if (id == JF_LIST)
        return iter_list(R, n, v, out);
    if (id == JF_ITEMS) {
        if (v.t == JV_UNDEF)
            return jv_list_new(0, out) ? true : room(R);
        if (v.t != JV_DICT && v.t != JV_NS)
            return rfail(R, n, "items: expected a mapping, not %s", jv_type_name(v));
        if (!jv_list_new(v.u.d->n, out))
            return room(R);
        for (size_t i = 0; i < v.u.d->n; i++) {
            jv pair;
            if (!jv_list_new(2, &pair))
                return room(R);
            pair.u.l->tuple = true;
            jv_list_push(pair, jv_retain(v.u.d->k[i]));
            jv_list_push(pair, jv_retain(v.u.d->v[i]));
            if (!jv_list_push(*out, pair))
                return room(R);
        }
        return true;
    }
    if (id == JF_REPLACE) {
        const jstr *old, *new_;
        int64_t count;
        jv s;
        if (!arg_str(R, n, a, 0, "old", "replace", &old) || !arg_str(R, n, a, 1, "new", "replace", &new_) ||
            !arg_int(R, n, a, 2, "count", "replace", -1, &count))
            return false;
        if (!old || !new_)
            return rfail(R, n, "replace needs two string arguments");
        if (!to_str(R, n, v, &s))
            return false;
        bool ok = str_replace(R, n, s.u.s, old, new_, count, out);
        jv_release(s);
        return ok;
    }
    if (id == JF_INDENT)
        return f_indent(R, n, v, a, out);
    if (id == JF_ESCAPE)
        return html_escape(R, n, v, out);
    if (id == JF_ABS) {
        if (v.t == JV_INT && v.u.i != INT64_MIN)
            *out = jv_int(v.u.i < 0 ? -v.u.i : v.u.i);
        else if (v.t == JV_FLOAT)
            *out = jv_float(fabs(v.u.f));
        else if (v.t == JV_BOOL)
            *out = jv_int(v.u.b);
        else
            return rfail(R, n, "bad operand type for abs(): '%s'", jv_type_name(v));
        return true;
    }
    if (id == JF_INT || id == JF_FLOAT) {
        jv *def = arg(a, 0, "default");
        if (v.t == JV_UNDEF)
            return undef_err(R, n, v);
        bool is_int = id == JF_INT;
        if (v.t == JV_INT || v.t == JV_BOOL) {
            *out = is_int ? jv_int(num_i(v)) : jv_float((double)num_i(v));
        } else if (v.t == JV_FLOAT && isfinite(v.u.f) && fabs(v.u.f) < 9.2e18) {
            *out = is_int ? jv_int((int64_t)v.u.f) : v;
        } else if (v.t == JV_STR) {
            char *end;
            double d = strtod(v.u.s->s, &end);
            bool ok = end != v.u.s->s && *end == 0 && isfinite(d) && fabs(d) < 9.2e18;
            if (ok)
                *out = is_int ? jv_int((int64_t)d) : jv_float(d);
            else
                *out = def ? jv_retain(*def) : is_int ? jv_int(0) : jv_float(0);
        } else {
            *out = def ? jv_retain(*def) : is_int ? jv_int(0) : jv_float(0);
        }
        return true;
    }
    if (id == JF_ROUND) {
        int64_t prec;
        if (!arg_int(R, n, a, 0, "precision", "round", 0, &prec))
            return false;
        if (!is_num(v))
            return rfail(R, n, "round: expected a number, not %s", jv_type_name(v));
        double p = pow(10, (double)(prec > 15 ? 15 : prec < -15 ? -15 : prec));
        *out = jv_float(round(num_f(v) * p) / p);
        return true;
    }
    if (id == JF_REVERSE) {
        if (v.t == JV_STR) {
            jv none = jv_none(), step = jv_int(-1);
            return do_slice(R, n, v, none, none, step, out);
        }
        jv items;
        if (!iter_list(R, n, v, &items))
            return false;
        bool ok = jv_list_new(items.u.l->n, out);
        for (size_t i = items.u.l->n; ok && i > 0; i--)
            jv_list_push(*out, jv_retain(items.u.l->v[i - 1]));
        jv_release(items);
        return ok ? true : room(R);
    }
    if (id == JF_UNIQUE) {
        jv items;
        if (!iter_list(R, n, v, &items))
            return false;
        bool ok = jv_list_new(0, out);
        for (size_t i = 0; ok && i < items.u.l->n; i++) {
            bool seen = false;
            for (size_t k = 0; k < out->u.l->n && !seen; k++)
                seen = jv_equal(out->u.l->v[k], items.u.l->v[i]);
            if (!seen)
                ok = jv_list_push(*out, jv_retain(items.u.l->v[i]));
        }
        jv_release(items);
        return ok ? true : room(R);
    }
    if (id == JF_SORT)
        return f_sort(R, n, v, a, out);
    if (id == JF_MAP)
        return f_map(R, n, v, a, out);
    if (id == JF_SELECT || id == JF_REJECT)
        return f_select(R, n, v, a, false, id == JF_SELECT, out);
    if (id == JF_SELECTATTR || id == JF_REJECTATTR)
        return f_select(R, n, v, a, true, id == JF_SELECTATTR, out);
    if (id == JF_SUM || id == JF_MAX || id == JF_MIN) {
        jv items;
        if (!iter_list(R, n, v, &items))
            return false;
        bool ok = true;
        jv acc = id == JF_SUM ? jv_int(0) : jv_undef(NULL);
        for (size_t i = 0; ok && i < items.u.l->n; i++) {
            jv it = items.u.l->v[i], r;
            if (id == JF_SUM) {
                ok = binop(R, n, JOP_ADD, acc, it, &r);
                jv_release(acc);
                acc = ok ? r : jv_undef(NULL);
            } else if (acc.t == JV_UNDEF) {
                acc = jv_retain(it);
            } else {
                int c = compare(it, acc);
                if (c == 2)
                    ok = rfail(R, n, "%s: the items cannot be ordered", name);
                else if ((id == JF_MAX && c == 1) || (id == JF_MIN && c == -1)) {
                    jv_release(acc);
                    acc = jv_retain(it);
                }
            }
        }
        jv_release(items);
        if (!ok) {
            jv_release(acc);
            return false;
        }
        *out = acc;
        return true;
    }
    if (id == JF_DICTSORT) {
        if (v.t != JV_DICT)
            return rfail(R, n, "dictsort: expected a mapping, not %s", jv_type_name(v));
        args none = {0};
        jv pairs;
        if (!apply_filter(R, n, JF_ITEMS, "items", v, &none, &pairs))
            return false;
        jv zero = jv_int(0);
        args sa = {.n_kw = 1};
        sa.kwn[0] = "attribute";
        sa.kwv[0] = zero;
        bool ok = f_sort(R, n, pairs, &sa, out);
        jv_release(pairs);
        return ok;
    }
    if (id == JF_WORDCOUNT) { /* runs of \w: letters, digits, underscore */
        jv s;
        if (!to_str(R, n, v, &s))
            return false;
        int64_t words = 0;
        bool in_word = false;
        for (size_t i = 0; i < s.u.s->len;) {
            uint32_t cp;
            i = ju_next(s.u.s->s, s.u.s->len, i, &cp);
            int cat = cp <= 0x10ffff ? utf8proc_category((utf8proc_int32_t)cp) : 0;
            bool w = cp == '_' || (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
                     (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
            if (w && !in_word)
                words++;
            in_word = w;
        }
        jv_release(s);
        *out = jv_int(words);
        return true;
    }
    return rfail(R, n, "unknown filter '%s'", name);
}

/* ---- methods (Python's str and dict methods that templates call) ---------------------------- */

/* Returns 1 when handled, 0 when obj has no such method, -1 on error. */
static int call_method(rstate *R, const jnode *n, jv obj, int id, const char *m, args *a, jv *out)
{
    if (obj.t == JV_STR) {
        const jstr *s = obj.u.s;
        if (id == JM_STARTSWITH || id == JM_ENDSWITH) {
            jv *x = arg(a, 0, NULL);
            bool r, type_ok;
            if (!x)
                return rfail(R, n, "%s() needs an argument", m) ? 1 : -1;
            str_affix(s, *x, id == JM_ENDSWITH, &r, &type_ok);
            if (!type_ok)
                return rfail(R, n, "%s first arg must be str or a tuple of str, not %s", m, jv_type_name(*x)) ? 1 : -1;
            *out = jv_bool(r);
            return 1;
        }
        if (id == JM_STRIP || id == JM_LSTRIP || id == JM_RSTRIP) {
            const jstr *chars;
            if (!arg_str(R, n, a, 0, "chars", m, &chars))
                return -1;
            return str_strip(R, s, chars, id != JM_RSTRIP, id != JM_LSTRIP, out) ? 1 : -1;
        }
        if (id == JM_SPLIT || id == JM_RSPLIT) {
            const jstr *sep;
            int64_t maxsplit;
            if (!arg_str(R, n, a, 0, "sep", m, &sep) || !arg_int(R, n, a, 1, "maxsplit", m, -1, &maxsplit))
                return -1;
            if (id == JM_RSPLIT && maxsplit >= 0) {
                /* rsplit with a limit: split all, then join the leading pieces back */
                jv all;
                if (!str_split(R, n, s, sep, -1, &all))
                    return -1;
                size_t cnt = all.u.l->n;
                if ((int64_t)cnt - 1 <= maxsplit || !sep) {
                    *out = all;
                    return 1;
                }
                size_t keep = cnt - (size_t)maxsplit;
                kvf_sbuf b;
                kvf_sbuf_init(&b);
                for (size_t i = 0; i < keep; i++) {
                    if (i)
                        kvf_sbuf_append(&b, sep->s, sep->len);
                    kvf_sbuf_append(&b, all.u.l->v[i].u.s->s, all.u.l->v[i].u.s->len);
                }
                jv head;
                bool ok = sbuf_to_str(R, n, &b, &head) && jv_list_new(cnt - keep + 1, out);
                if (ok) {
                    jv_list_push(*out, head);
                    for (size_t i = keep; i < cnt; i++)
                        jv_list_push(*out, jv_retain(all.u.l->v[i]));
                }
                jv_release(all);
                return ok ? 1 : -1;
            }
            return str_split(R, n, s, sep, maxsplit, out) ? 1 : -1;
        }
        if (id == JM_SPLITLINES)
            return str_splitlines(R, s, out) ? 1 : -1;
        if (id == JM_TITLE || id == JM_UPPER || id == JM_LOWER || id == JM_CAPITALIZE)
            return str_case(R, n, s, id == JM_TITLE ? 't' : id == JM_UPPER ? 'u' : id == JM_LOWER ? 'l' : 'c', out) ? 1 : -1;
        if (id == JM_REPLACE) {
            const jstr *old, *new_;
            int64_t count;
            if (!arg_str(R, n, a, 0, "old", m, &old) || !arg_str(R, n, a, 1, "new", m, &new_) ||
                !arg_int(R, n, a, 2, "count", m, -1, &count))
                return -1;
            if (!old || !new_)
                return rfail(R, n, "replace() needs two string arguments") ? 1 : -1;
            return str_replace(R, n, s, old, new_, count, out) ? 1 : -1;
        }
        if (id == JM_JOIN) {
            args ja = {.n_pos = 1};
            ja.pos[0] = obj;
            jv *items = arg(a, 0, NULL);
            if (!items)
                return rfail(R, n, "join() needs an argument") ? 1 : -1;
            return f_join(R, n, *items, &ja, out) ? 1 : -1;
        }
        if (id == JM_FIND || id == JM_COUNT) {
            const jstr *sub;
            if (!arg_str(R, n, a, 0, "sub", m, &sub))
                return -1;
            if (!sub)
                return rfail(R, n, "%s() needs a string argument", m) ? 1 : -1;
            if (id == JM_FIND) {
                const char *hit = sub->len ? memmem(s->s, s->len, sub->s, sub->len) : s->s;
                *out = jv_int(hit ? (int64_t)ju_count(s->s, (size_t)(hit - s->s)) : -1);
            } else {
                int64_t c = 0;
                if (!sub->len)
                    c = (int64_t)ju_count(s->s, s->len) + 1;
                else
                    for (const char *p = s->s; (p = memmem(p, s->len - (size_t)(p - s->s), sub->s, sub->len)); p += sub->len)
                        c++;
                *out = jv_int(c);
            }
            return 1;
        }
        if (id == JM_ISSPACE || id == JM_ISDIGIT || id == JM_ISALPHA || id == JM_ISUPPER ||
            id == JM_ISLOWER) {
            if (id == JM_ISUPPER || id == JM_ISLOWER) {
                *out = jv_bool(str_all_case(s, id == JM_ISUPPER));
                return 1;
            }
            bool r = s->len > 0;
            for (size_t i = 0; i < s->len && r;) {
                uint32_t cp;
                i = ju_next(s->s, s->len, i, &cp);
                int cat = cp <= 0x10ffff ? utf8proc_category((utf8proc_int32_t)cp) : 0;
                if (id == JM_ISSPACE)
                    r = ju_is_space(cp);
                else if (id == JM_ISDIGIT)
                    r = cat == UTF8PROC_CATEGORY_ND;
                else
                    r = cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
            }
            *out = jv_bool(r);
            return 1;
        }
        return 0;
    }
    if (obj.t == JV_DICT) {
        if (id == JM_ITEMS)
            return apply_filter(R, n, JF_ITEMS, "items", obj, a, out) ? 1 : -1;
        if (id == JM_KEYS || id == JM_VALUES) {
            if (!jv_list_new(obj.u.d->n, out))
                return room(R) ? 1 : -1;
            for (size_t i = 0; i < obj.u.d->n; i++)
                jv_list_push(*out, jv_retain(id == JM_KEYS ? obj.u.d->k[i] : obj.u.d->v[i]));
            return 1;
        }
        if (id == JM_GET) {
            jv *k = arg(a, 0, NULL), *def = arg(a, 1, NULL);
            if (!k)
                return rfail(R, n, "get() needs a key") ? 1 : -1;
            jv *v = jv_dict_get(obj.u.d, *k);
            *out = v ? jv_retain(*v) : def ? jv_retain(*def) : jv_none();
            return 1;
        }
        if (id == JM_CYCLE && obj.u.d->is_loop) {
            if (a->n_pos == 0)
                return rfail(R, n, "loop.cycle() needs at least one argument") ? 1 : -1;
            jv *i0 = jv_dict_get_cstr(obj.u.d, "index0");
            int64_t i = i0 && i0->t == JV_INT ? i0->u.i : 0;
            *out = jv_retain(a->pos[(size_t)i % a->n_pos]);
            return 1;
        }
    }
    return 0;
}

/* ---- globals and macros ------------------------------------------------------------------- */

static bool call_macro(rstate *R, const jnode *n, jmacro *m, args *a, jmacro *caller, jv *out)
{
    const jnode *def = m->node;
    if (a->n_pos > def->n_kids)
        return rfail(R, n, "macro '%s' takes at most %zu argument(s), %zu given",
                     def->kind == JN_MACRO ? def->name : "caller", def->n_kids, a->n_pos);
    jframe *f = jframe_new(m->scope ? m->scope : R->globals);
    if (!f)
        return room(R);
    bool ok = true;
    for (size_t i = 0; i < def->n_kids && ok; i++) {
        const jnode *p = def->kids[i];
        jv *given = arg(a, i, p->name), v;
        if (given)
            v = jv_retain(*given);
        else if (p->a)
            ok = eval(R, p->a, f, &v);
        else
            v = jv_undef(p->name);
        if (ok)
            ok = jv_dict_set_cstr(f->vars, p->name, v) ? true : room(R);
    }
    for (size_t k = 0; k < a->n_kw && ok; k++) {
        bool known = false;
        for (size_t i = 0; i < def->n_kids; i++)
            known = known || strcmp(def->kids[i]->name, a->kwn[k]) == 0;
        if (!known)
            ok = rfail(R, n, "macro '%s' has no parameter '%s'",
                       def->kind == JN_MACRO ? def->name : "caller", a->kwn[k]);
    }
    if (ok && caller) {
        caller->rc++;
        jv c = {.t = JV_MACRO};
        c.u.m = caller;
        ok = jv_dict_set_cstr(f->vars, "caller", c) ? true : room(R);
    }
    kvf_sbuf buf, *saved = R->out;
    kvf_sbuf_init(&buf);
    int saved_ctl = R->ctl;
    if (ok) {
        R->out = &buf;
        ok = exec(R, def->b, f);
        R->out = saved;
        R->ctl = saved_ctl;
    }
    jframe_pop(f);
    if (!ok) {
        kvf_sbuf_fini(&buf);
        return false;
    }
    return sbuf_to_str(R, n, &buf, out);
}

static bool global_call(rstate *R, const jnode *n, int id, const char *name, args *a, jv *out)
{
    if (id == JG_RAISE_EXCEPTION) {
        jv *msg = arg(a, 0, "message");
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        if (msg)
            jv_to_str(&b, *msg);
        if (!R->failed) {
            R->failed = true;
            kvf_err_set(R->err, KVF_ERR_INVALID, "%s", b.data ? b.data : "");
        }
        kvf_sbuf_fini(&b);
        return false;
    }
    if (id == JG_NAMESPACE || id == JG_DICT) {
        jv d;
        if (!jv_dict_new(&d))
            return room(R);
        if (a->n_pos == 1 && (a->pos[0].t == JV_DICT || a->pos[0].t == JV_NS)) {
            for (size_t i = 0; i < a->pos[0].u.d->n; i++)
                jv_dict_set(d.u.d, jv_retain(a->pos[0].u.d->k[i]), jv_retain(a->pos[0].u.d->v[i]));
        } else if (a->n_pos) {
            jv_release(d);
            return rfail(R, n, "%s() takes keyword arguments (or one mapping)", name);
        }
        for (size_t i = 0; i < a->n_kw; i++)
            if (!jv_dict_set_cstr(d.u.d, a->kwn[i], jv_retain(a->kwv[i]))) {
                jv_release(d);
                return room(R);
            }
        if (id == JG_NAMESPACE)
            d.t = JV_NS;
        *out = d;
        return true;
    }
    if (id == JG_RANGE) {
        int64_t v[3] = {0, 0, 1};
        if (a->n_pos < 1 || a->n_pos > 3)
            return rfail(R, n, "range() takes 1 to 3 integer arguments, %zu given", a->n_pos);
        for (size_t i = 0; i < a->n_pos; i++) {
            if (a->pos[i].t != JV_INT && a->pos[i].t != JV_BOOL)
                return rfail(R, n, "range() arguments must be integers, not %s", jv_type_name(a->pos[i]));
            v[i] = num_i(a->pos[i]);
        }
        int64_t start = a->n_pos == 1 ? 0 : v[0], stop = a->n_pos == 1 ? v[0] : v[1], step = a->n_pos == 3 ? v[2] : 1;
        if (step == 0)
            return rfail(R, n, "range() arg 3 must not be zero");
        double cnt = step > 0 ? ceil(((double)stop - (double)start) / (double)step)
                              : ceil(((double)start - (double)stop) / (double)-step);
        if (cnt < 0)
            cnt = 0;
        if (cnt > 100000) /* as Jinja's sandbox, which transformers uses */
            return rlimit(R, n, "range() of %.0f items is more than the 100000 the sandbox allows", cnt);
        if (cnt > (double)R->lim.max_iters)
            return rlimit(R, n, "range() of %.0f items is more than the %lld allowed", cnt,
                          (long long)R->lim.max_iters);
        if (!jv_list_new((size_t)cnt, out))
            return room(R);
        for (int64_t i = 0, x = start; i < (int64_t)cnt; i++, x += step)
            jv_list_push(*out, jv_int(x));
        return true;
    }
    if (id == JG_STRFTIME_NOW) {
        const jstr *fmt;
        if (!arg_str(R, n, a, 0, "format", name, &fmt))
            return false;
        if (!fmt)
            return rfail(R, n, "strftime_now() needs a format string");
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        char buf[256];
        size_t k = fmt->len < 128 ? strftime(buf, sizeof buf, fmt->s, &tm) : 0;
        return mkstr(R, buf, k, out);
    }
    return rfail(R, n, "'%s' is undefined", name);
}

static __attribute__((noinline)) bool eval_call(rstate *R, const jnode *n, jframe *f, jmacro *caller, jv *out)
{
    const jnode *callee = n->a;
    args a;
    jv fn = jv_none();
    bool ok;
    if (callee->kind == JN_ATTR) {
        jv obj;
        if (!eval(R, callee->a, f, &obj))
            return false;
        if (!eval_args(R, n, f, &a)) {
            jv_release(obj);
            return false;
        }
        int r = obj.t == JV_UNDEF ? 0 : call_method(R, n, obj, n->fn, callee->name, &a, out);
        if (r != 0) {
            jv_release(obj);
            args_free(&a);
            return r > 0;
        }
        ok = getattr_v(R, callee, obj, callee->name, &fn);
        if (ok && fn.t == JV_UNDEF) {
            ok = rfail(R, callee, "'%s' object has no attribute '%s'", jv_type_name(obj), callee->name);
            fn = jv_none();
        }
        jv_release(obj);
    } else if (callee->kind == JN_NAME) {
        if (!eval_args(R, n, f, &a))
            return false;
        jv *v = lookup(R, f, callee->name);
        if (!v) {
            ok = global_call(R, n, n->fn, callee->name, &a, out);
            args_free(&a);
            return ok;
        }
        fn = jv_retain(*v);
        ok = true;
    } else {
        if (!eval(R, callee, f, &fn))
            return false;
        if (!eval_args(R, n, f, &a)) {
            jv_release(fn);
            return false;
        }
        ok = true;
    }
    if (ok) {
        if (fn.t == JV_MACRO)
            ok = call_macro(R, n, fn.u.m, &a, caller, out);
        else if (fn.t == JV_UNDEF)
            ok = undef_err(R, n, fn);
        else
            ok = rfail(R, n, "'%s' object is not callable", jv_type_name(fn));
    }
    jv_release(fn);
    args_free(&a);
    return ok;
}

/* ---- expressions ---------------------------------------------------------------------------- */

static bool step(rstate *R, const jnode *n)
{
    if (++R->steps > R->lim.max_steps)
        return rlimit(R, n, "evaluation took more than %lld steps", (long long)R->lim.max_steps);
    if (R->depth >= R->lim.max_depth)
        return rlimit(R, n, "evaluation nested deeper than %d (recursive macro?)", R->lim.max_depth);
    return true;
}

/* Out of line, so the argument block sits on the stack only while a filter or test runs. */
static __attribute__((noinline)) bool eval_filter_or_test(rstate *R, const jnode *n, jframe *f, jv *out)
{
    args ar;
    jv a;
    bool ok, r;
    if (!eval(R, n->a, f, &a))
        return false;
    /* A global function's bare name is defined, as in Jinja: Llama 3.2's template renders
     * today's date only when `strftime_now is defined`. */
    if (n->kind == JN_TEST && (n->fn == JT_DEFINED || n->fn == JT_UNDEFINED) && a.t == JV_UNDEF &&
        n->a->kind == JN_NAME && kvf_text_jinja_global_id(n->a->name) != JG_UNKNOWN)
        a = jv_bool(true);
    if (!eval_args(R, n, f, &ar)) {
        jv_release(a);
        return false;
    }
    if (n->kind == JN_FILTER) {
        ok = apply_filter(R, n, n->fn, n->name, a, &ar, out);
    } else {
        ok = run_test(R, n, n->fn, n->name, a, &ar, &r);
        if (ok)
            *out = jv_bool(n->op ? !r : r);
    }
    jv_release(a);
    args_free(&ar);
    return ok;
}

static bool eval_inner(rstate *R, const jnode *n, jframe *f, jv *out)
{
    jv a, b;
    bool ok;
    switch ((jn_kind)n->kind) {
    case JN_LIT: *out = n->lit; return true; /* immortal */
    case JN_NAME: {
        jv *v = lookup(R, f, n->name);
        *out = v ? jv_retain(*v) : jv_undef(n->name);
        return true;
    }
    case JN_LIST:
    case JN_TUPLE:
        if (!jv_list_new(n->n_kids, out))
            return room(R);
        out->u.l->tuple = n->kind == JN_TUPLE;
        for (size_t i = 0; i < n->n_kids; i++) {
            if (!eval(R, n->kids[i], f, &a)) {
                jv_release(*out);
                return false;
            }
            jv_list_push(*out, a);
        }
        return true;
    case JN_DICT:
        if (!jv_dict_new(out))
            return room(R);
        for (size_t i = 0; i + 1 < n->n_kids; i += 2) {
            if (!eval(R, n->kids[i], f, &a)) {
                jv_release(*out);
                return false;
            }
            if (!eval(R, n->kids[i + 1], f, &b)) {
                jv_release(a);
                jv_release(*out);
                return false;
            }
            if (a.t == JV_LIST || a.t == JV_DICT || a.t == JV_NS || a.t == JV_UNDEF) {
                rfail(R, n->kids[i], "unhashable dict key of type '%s'", jv_type_name(a));
                jv_release(a);
                jv_release(b);
                jv_release(*out);
                return false;
            }
            if (!jv_dict_set(out->u.d, a, b)) {
                jv_release(*out);
                return room(R);
            }
        }
        return true;
    case JN_ATTR:
        if (!eval(R, n->a, f, &a))
            return false;
        ok = getattr_v(R, n, a, n->name, out);
        jv_release(a);
        return ok;
    case JN_ITEM:
        if (!eval(R, n->a, f, &a))
            return false;
        if (!eval(R, n->b, f, &b)) {
            jv_release(a);
            return false;
        }
        ok = getitem(R, n, a, b, b.t == JV_STR ? b.u.s->s : NULL, out);
        /* an undefined result may name b's string: keep it alive via the literal or fall back */
        if (ok && out->t == JV_UNDEF && !(n->b->kind == JN_LIT))
            out->u.name = NULL;
        jv_release(a);
        jv_release(b);
        return ok;
    case JN_SLICE: {
        jv parts[3] = {jv_none(), jv_none(), jv_none()};
        const jnode *pn[3] = {n->b, n->c, n->d};
        if (!eval(R, n->a, f, &a))
            return false;
        ok = true;
        for (int i = 0; i < 3 && ok; i++)
            if (pn[i])
                ok = eval(R, pn[i], f, &parts[i]);
        if (ok)
            ok = do_slice(R, n, a, parts[0], parts[1], parts[2], out);
        for (int i = 0; i < 3; i++)
            jv_release(parts[i]);
        jv_release(a);
        return ok;
    }
    case JN_CALL: return eval_call(R, n, f, NULL, out);
    case JN_FILTER:
    case JN_TEST: return eval_filter_or_test(R, n, f, out);
    case JN_NOT:
        if (!eval(R, n->a, f, &a))
            return false;
        *out = jv_bool(!jv_truthy(a));
        jv_release(a);
        return true;
    case JN_NEG:
    case JN_POS:
        if (!eval(R, n->a, f, &a))
            return false;
        if (a.t == JV_UNDEF) {
            return undef_err(R, n, a);
        } else if (!is_num(a)) {
            ok = rfail(R, n, "bad operand type for unary %s: '%s'", n->kind == JN_NEG ? "-" : "+", jv_type_name(a));
            jv_release(a);
            return ok;
        }
        if (n->kind == JN_POS)
            *out = a.t == JV_BOOL ? jv_int(a.u.b) : a;
        else if (a.t == JV_FLOAT)
            *out = jv_float(-a.u.f);
        else if (num_i(a) == INT64_MIN)
            return rfail(R, n, "integer overflow in unary '-'");
        else
            *out = jv_int(-num_i(a));
        return true;
    case JN_BIN:
        if (!eval(R, n->a, f, &a))
            return false;
        if (!eval(R, n->b, f, &b)) {
            jv_release(a);
            return false;
        }
        ok = binop(R, n, n->op, a, b, out);
        jv_release(a);
        jv_release(b);
        return ok;
    case JN_AND:
    case JN_OR:
        if (!eval(R, n->a, f, &a))
            return false;
        if (jv_truthy(a) == (n->kind == JN_OR)) {
            *out = a;
            return true;
        }
        jv_release(a);
        return eval(R, n->b, f, out);
    case JN_COND:
        if (!eval(R, n->a, f, &a))
            return false;
        ok = jv_truthy(a);
        jv_release(a);
        if (ok)
            return eval(R, n->b, f, out);
        if (n->c)
            return eval(R, n->c, f, out);
        *out = jv_undef(NULL);
        return true;
    default: return rfail(R, n, "internal error: node %d is not an expression", n->kind);
    }
}

static bool eval(rstate *R, const jnode *n, jframe *f, jv *out)
{
    if (!step(R, n))
        return false;
    R->depth++;
    bool ok = eval_inner(R, n, f, out);
    R->depth--;
    return ok;
}

/* ---- statements ----------------------------------------------------------------------------- */

static bool exec_for(rstate *R, const jnode *n, jframe *f)
{
    jv src, items;
    if (!eval(R, n->b, f, &src))
        return false;
    bool ok = iter_list(R, n->b, src, &items);
    jv_release(src);
    if (!ok)
        return false;
    if (n->e) { /* for x in xs if cond: filter first, so loop.length counts what runs */
        jv kept;
        if (!jv_list_new(0, &kept)) {
            jv_release(items);
            return room(R);
        }
        for (size_t i = 0; i < items.u.l->n && ok; i++) {
            jframe *tf = jframe_new(f);
            jv c;
            ok = tf && assign(R, n->a, tf, jv_retain(items.u.l->v[i])) && eval(R, n->e, tf, &c);
            if (!tf)
                ok = room(R);
            if (ok) {
                if (jv_truthy(c))
                    jv_list_push(kept, jv_retain(items.u.l->v[i]));
                jv_release(c);
            }
            jframe_pop(tf);
        }
        jv_release(items);
        items = kept;
        if (!ok) {
            jv_release(items);
            return false;
        }
    }
    size_t cnt = items.u.l->n;
    jv loop;
    if (!jv_dict_new(&loop)) {
        jv_release(items);
        return room(R);
    }
    loop.u.d->is_loop = true;
    static const char *const keys[] = {"index", "index0", "revindex", "revindex0", "first", "last",
                                       "length", "depth", "depth0", "previtem", "nextitem"};
    jdict *L = loop.u.d;
    for (size_t k = 0; k < sizeof keys / sizeof keys[0] && ok; k++)
        ok = jv_dict_set_cstr(L, keys[k], jv_none()) ? true : room(R);
    for (size_t i = 0; i < cnt && ok; i++) {
        if (++R->iters > R->lim.max_iters) {
            ok = rlimit(R, n, "more than %lld loop iterations", (long long)R->lim.max_iters);
            break;
        }
        jv vals[] = {jv_int((int64_t)i + 1), jv_int((int64_t)i), jv_int((int64_t)(cnt - i)),
                     jv_int((int64_t)(cnt - i - 1)), jv_bool(i == 0), jv_bool(i + 1 == cnt),
                     jv_int((int64_t)cnt), jv_int(1), jv_int(0),
                     i ? jv_retain(items.u.l->v[i - 1]) : jv_undef("previtem"),
                     i + 1 < cnt ? jv_retain(items.u.l->v[i + 1]) : jv_undef("nextitem")};
        for (size_t k = 0; k < sizeof vals / sizeof vals[0]; k++) {
            jv_release(L->v[k]);
            L->v[k] = vals[k];
        }
        jframe *it = jframe_new(f);
        if (!it) {
            ok = room(R);
            break;
        }
        ok = jv_dict_set_cstr(it->vars, "loop", jv_retain(loop)) ? true : room(R);
        if (ok)
            ok = assign(R, n->a, it, jv_retain(items.u.l->v[i]));
        if (ok)
            ok = exec(R, n->c, it);
        jframe_pop(it);
        int ctl = R->ctl;
        R->ctl = 0;
        if (ctl == 1)
            break;
    }
    jv_dict_clear(loop.u.d); /* previtem/nextitem may hold the loop's own items */
    jv_release(loop);
    jv_release(items);
    if (ok && cnt == 0 && n->d)
        ok = exec(R, n->d, f);
    return ok;
}

static bool exec_inner(rstate *R, const jnode *n, jframe *f)
{
    jv v;
    switch ((jn_kind)n->kind) {
    case JN_BODY:
        for (size_t i = 0; i < n->n_kids && !R->ctl; i++)
            if (!exec(R, n->kids[i], f))
                return false;
        return true;
    case JN_TEXT: return emit(R, n, n->lit.u.s->s, n->lit.u.s->len);
    case JN_OUTPUT: {
        if (!eval(R, n->a, f, &v))
            return false;
        bool ok;
        if (v.t == JV_STR) {
            ok = emit(R, n, v.u.s->s, v.u.s->len);
        } else {
            kvf_sbuf b;
            kvf_sbuf_init(&b);
            jv_to_str(&b, v);
            ok = b.oom ? room(R) : emit(R, n, b.data ? b.data : "", b.len);
            kvf_sbuf_fini(&b);
        }
        jv_release(v);
        return ok;
    }
    case JN_IF:
        if (!eval(R, n->a, f, &v))
            return false;
        bool t = jv_truthy(v);
        jv_release(v);
        if (t)
            return exec(R, n->b, f);
        return n->c ? exec(R, n->c, f) : true;
    case JN_FOR: return exec_for(R, n, f);
    case JN_SET:
        if (!eval(R, n->b, f, &v))
            return false;
        return assign(R, n->a, f, v);
    case JN_SET_BLOCK:
    case JN_FILTER_BLOCK: {
        kvf_sbuf buf, *saved = R->out;
        kvf_sbuf_init(&buf);
        R->out = &buf;
        bool ok = exec(R, n->b, f);
        R->out = saved;
        if (!ok || !sbuf_to_str(R, n, &buf, &v)) {
            kvf_sbuf_fini(&buf);
            return false;
        }
        if (n->kind == JN_SET_BLOCK)
            return assign(R, n->a, f, v);
        /* filter block: bind the body to the placeholder name and evaluate the chain */
        jframe *tf = jframe_new(f);
        jv r;
        ok = tf && jv_dict_set_cstr(tf->vars, " filter body", v);
        if (!tf)
            jv_release(v);
        if (!ok)
            ok = room(R);
        else
            ok = eval(R, n->a, tf, &r);
        jframe_pop(tf);
        if (!ok)
            return false;
        jv s;
        ok = to_str(R, n, r, &s);
        jv_release(r);
        if (ok) {
            ok = emit(R, n, s.u.s->s, s.u.s->len);
            jv_release(s);
        }
        return ok;
    }
    case JN_MACRO: {
        jmacro *m = calloc(1, sizeof *m);
        if (!m)
            return room(R);
        m->rc = 1;
        m->node = n;
        if (f != R->globals) {
            m->scope = f;
            f->rc++;
        }
        jv mv = {.t = JV_MACRO};
        mv.u.m = m;
        return jv_dict_set_cstr(f->vars, n->name, mv) ? true : room(R);
    }
    case JN_CALL_BLOCK: {
        jmacro *c = calloc(1, sizeof *c);
        if (!c)
            return room(R);
        c->rc = 1;
        c->node = n;
        c->scope = f;
        f->rc++;
        bool ok = eval_call(R, n->a, f, c, &v);
        jv cv = {.t = JV_MACRO};
        cv.u.m = c;
        jv_release(cv);
        if (!ok)
            return false;
        ok = v.t == JV_STR ? emit(R, n, v.u.s->s, v.u.s->len) : true;
        jv_release(v);
        return ok;
    }
    case JN_BREAK: R->ctl = 1; return true;
    case JN_CONTINUE: R->ctl = 2; return true;
    default: return rfail(R, n, "internal error: node %d is not a statement", n->kind);
    }
}

static bool exec(rstate *R, const jnode *n, jframe *f)
{
    if (!step(R, n))
        return false;
    R->depth++;
    bool ok = exec_inner(R, n, f);
    R->depth--;
    return ok;
}

/* ---- entry point ---------------------------------------------------------------------------- */

kvf_status kvf_text_jinja_render(const kvf_text_jinja *t, const json_t *vars,
                                  const kvf_text_jinja_limits *limits, char **out,
                                  size_t *len_out, kvf_err *err)
{
    rstate R = {.err = err};
    if (limits)
        R.lim = *limits;
    if (!R.lim.max_output)
        R.lim.max_output = 8u << 20;
    if (!R.lim.max_iters)
        R.lim.max_iters = 1000000;
    if (!R.lim.max_steps)
        R.lim.max_steps = 20000000;
    if (!R.lim.max_depth)
        R.lim.max_depth = 256;
    if (vars && !json_is_object(vars))
        return kvf_err_set(err, KVF_ERR_INVALID, "jinja: variables must be a JSON object, not %s",
                           json_is_array(vars) ? "an array" : "a scalar");
    R.globals = jframe_new(NULL);
    if (!R.globals)
        return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
    const char *key;
    json_t *val;
    if (vars) {
        json_object_foreach((json_t *)vars, key, val) {
            jv v;
            if (!jv_from_json(val, 1000, &v) || !jv_dict_set_cstr(R.globals->vars, key, v)) {
                jframe_pop(R.globals);
                return kvf_err_set(err, KVF_ERR_NOMEM, "jinja: variable '%s' could not be converted (out of memory or nested deeper than 1000)", key);
            }
        }
    }
    kvf_sbuf buf;
    kvf_sbuf_init(&buf);
    R.out = &buf;
    bool ok = exec(&R, t->root, R.globals);
    jframe_pop(R.globals);
    if (!ok) {
        kvf_sbuf_fini(&buf);
        return err ? err->status : KVF_ERR_STATE;
    }
    if (buf.oom) {
        kvf_sbuf_fini(&buf);
        return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
    }
    if (len_out)
        *len_out = buf.len;
    char *s = kvf_sbuf_take(&buf);
    if (!s)
        s = calloc(1, 1);
    if (!s)
        return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
    *out = s;
    return KVF_OK;
}
