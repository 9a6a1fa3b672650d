/* jinja_int.h: the inside of the chat-template interpreter (jinja.h): the value type, the
 * syntax tree the parser builds and the evaluator walks, and helpers shared by
 * jinja_value.c, jinja_parse.c and jinja_eval.c. Nothing outside text/jinja*.c includes it. */
#ifndef KVF_TEXT_JINJA_INT_H
#define KVF_TEXT_JINJA_INT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/sbuf.h"
#include "common/status.h"

/* ---- values ---------------------------------------------------------------------------- */

typedef enum jv_type {
    JV_UNDEF = 0, /* a name or attribute that does not exist; u.name says which (may be NULL) */
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,  /* lists and tuples */
    JV_DICT,  /* insertion-ordered mapping */
    JV_NS,    /* namespace(): a dict whose attributes `set` may assign */
    JV_MACRO, /* a macro or a call block's `caller` */
} jv_type;

struct jnode;
struct jframe;

/* Heap objects share this header. rc < 0 marks an immortal object (template literals), which
 * is never counted, so one compiled template renders on many threads at once. */
typedef struct jstr {
    int32_t rc;
    size_t len;
    char s[]; /* len bytes + NUL */
} jstr;

typedef struct jv {
    uint8_t t;
    union {
        bool b;
        int64_t i;
        double f;
        jstr *s;
        struct jlist *l;
        struct jdict *d;
        struct jmacro *m;
        const char *name; /* JV_UNDEF */
    } u;
} jv;

typedef struct jlist {
    int32_t rc;
    bool tuple;
    size_t n, cap;
    jv *v;
} jlist;

typedef struct jdict {
    int32_t rc;
    bool is_loop; /* a for loop's `loop` (adds loop.cycle) */
    size_t n, cap;
    jv *k, *v;
} jdict;

typedef struct jmacro {
    int32_t rc;
    const struct jnode *node;  /* JN_MACRO or JN_CALL_BLOCK */
    struct jframe *scope;      /* captured scope (retained), or NULL for the template's globals */
} jmacro;

/* A scope: variables and the scope around it. Popping a scope empties it, so a macro that
 * captured it never keeps a cycle alive; lookups then fall through to the globals. */
typedef struct jframe {
    int32_t rc;
    jdict *vars;
    struct jframe *parent; /* retained */
} jframe;

static inline jv jv_undef(const char *name) { jv v = {.t = JV_UNDEF}; v.u.name = name; return v; }
static inline jv jv_none(void) { jv v = {.t = JV_NONE}; return v; }
static inline jv jv_bool(bool b) { jv v = {.t = JV_BOOL}; v.u.b = b; return v; }
static inline jv jv_int(int64_t i) { jv v = {.t = JV_INT}; v.u.i = i; return v; }
static inline jv jv_float(double f) { jv v = {.t = JV_FLOAT}; v.u.f = f; return v; }

jv jv_retain(jv v);
void jv_release(jv v);

/* Constructors return false on out-of-memory. */
bool jv_str_new(const char *s, size_t len, jv *out);
bool jv_str_cat(const char *a, size_t al, const char *b, size_t bl, jv *out);
bool jv_list_new(size_t cap, jv *out);
bool jv_list_push(jv list, jv item); /* takes the reference to item (released on failure) */
bool jv_dict_new(jv *out);
bool jv_dict_set(jdict *d, jv key, jv val); /* takes both references (released on failure) */
bool jv_dict_set_cstr(jdict *d, const char *key, jv val);
jv *jv_dict_get(const jdict *d, jv key);      /* borrowed; NULL when absent */
jv *jv_dict_get_cstr(const jdict *d, const char *key);
void jv_dict_clear(jdict *d);

bool jv_truthy(jv v);
bool jv_equal(jv a, jv b);
/* Python's str() / repr() appended to b (OOM shows as b->oom). */
void jv_to_str(kvf_sbuf *b, jv v);
void jv_repr(kvf_sbuf *b, jv v);
void jv_float_repr(kvf_sbuf *b, double f);
const char *jv_type_name(jv v); /* Python-ish: "str", "int", "list", ... */

/* json.dumps(v, ensure_ascii=ensure_ascii, indent=indent (<0: None, or indent_str when not NULL),
 * separators=(item_sep, key_sep) (NULL: Python's defaults), sort_keys). Returns false and fills
 * why when v holds something JSON cannot hold. */
bool jv_to_json(kvf_sbuf *b, jv v, int indent, const char *indent_str, const char *item_sep,
                const char *key_sep, bool sort_keys, bool ensure_ascii, char *why, size_t why_cap);
/* A JSON value as a jinja value; false on OOM or when nested deeper than max_depth. */
bool jv_from_json(const json_t *j, int max_depth, jv *out);

/* UTF-8 helpers with Python's view of a string as code points. Invalid bytes count as one code
 * point each. */
size_t ju_next(const char *s, size_t len, size_t i, uint32_t *cp_out); /* returns the next i */
size_t ju_count(const char *s, size_t len);
bool ju_is_space(uint32_t cp); /* str.isspace() */

/* ---- syntax tree ----------------------------------------------------------------------- */

typedef enum jn_kind {
    /* statements */
    JN_BODY,       /* kids: statements */
    JN_TEXT,       /* lit: the text */
    JN_OUTPUT,     /* a: expression */
    JN_IF,         /* a: condition, b: body, c: else (JN_BODY or JN_IF for elif) or NULL */
    JN_FOR,        /* a: target, b: iterable, c: body, d: else body, e: filter condition */
    JN_SET,        /* a: target (NAME, TUPLE of NAMEs, ATTR), b: value */
    JN_SET_BLOCK,  /* a: target, b: body */
    JN_MACRO,      /* name, kids: params (JN_NAME with a = default), b: body */
    JN_CALL_BLOCK, /* a: the call (JN_CALL), kids: caller params, b: body */
    JN_FILTER_BLOCK, /* a: the filter chain applied to a JN_NAME placeholder, b: body */
    JN_BREAK,
    JN_CONTINUE,
    /* expressions */
    JN_LIT,    /* lit */
    JN_NAME,   /* name */
    JN_LIST,   /* kids */
    JN_TUPLE,  /* kids */
    JN_DICT,   /* kids: key, value, key, value, ... */
    JN_ATTR,   /* a.name */
    JN_ITEM,   /* a[b] */
    JN_SLICE,  /* a[b:c:d], each of b, c, d may be NULL */
    JN_CALL,   /* a(kids), kw[i] names keyword arguments (NULL: positional) */
    JN_FILTER, /* a | name(kids) */
    JN_TEST,   /* a is [not] name(kids); op = 1 when negated */
    JN_NOT,
    JN_NEG,
    JN_POS,
    JN_BIN,    /* a op b */
    JN_AND,
    JN_OR,
    JN_COND,   /* b if a else c (c may be NULL) */
} jn_kind;

typedef enum jn_op {
    JOP_ADD = 1, JOP_SUB, JOP_MUL, JOP_DIV, JOP_FLOORDIV, JOP_MOD, JOP_POW, JOP_CONCAT,
    JOP_EQ, JOP_NE, JOP_LT, JOP_LE, JOP_GT, JOP_GE, JOP_IN, JOP_NOTIN,
} jn_op;

/* Names resolved once, at parse time (jnode.fn), so rendering dispatches on an id instead of
 * comparing strings: filters (`x | trim`), tests (`x is defined`), methods (`s.strip()`, by id;
 * whether it applies is decided by the object's type when it runs) and global functions
 * (`range(3)`). The tables, with their aliases, are in jinja_eval.c. */
typedef enum {
    JF_UNKNOWN = -1, /* not in the table: rendering fails where it runs */
    JF_ABS,
    JF_CAPITALIZE,
    JF_DEFAULT,
    JF_DICTSORT,
    JF_ESCAPE,
    JF_FIRST,
    JF_FLOAT,
    JF_INDENT,
    JF_INT,
    JF_ITEMS,
    JF_JOIN,
    JF_LAST,
    JF_LENGTH,
    JF_LIST,
    JF_LOWER,
    JF_MAP,
    JF_MAX,
    JF_MIN,
    JF_REJECT,
    JF_REJECTATTR,
    JF_REPLACE,
    JF_REVERSE,
    JF_ROUND,
    JF_SAFE,
    JF_SELECT,
    JF_SELECTATTR,
    JF_SORT,
    JF_STRING,
    JF_SUM,
    JF_TITLE,
    JF_TOJSON,
    JF_TRIM,
    JF_UNIQUE,
    JF_UPPER,
    JF_WORDCOUNT,
} jf_id; /* filters */
typedef enum {
    JT_UNKNOWN = -1, /* not in the table: rendering fails where it runs */
    JT_BOOLEAN,
    JT_CALLABLE,
    JT_DEFINED,
    JT_DIVISIBLEBY,
    JT_EQ,
    JT_EVEN,
    JT_FALSE,
    JT_FLOAT,
    JT_GE,
    JT_GT,
    JT_IN,
    JT_INTEGER,
    JT_ITERABLE,
    JT_LE,
    JT_LOWER,
    JT_LT,
    JT_MAPPING,
    JT_NE,
    JT_NONE,
    JT_NUMBER,
    JT_ODD,
    JT_SAMEAS,
    JT_SEQUENCE,
    JT_STRING,
    JT_TRUE,
    JT_UNDEFINED,
    JT_UPPER,
} jt_id; /* tests */
typedef enum {
    JM_UNKNOWN = -1, /* not in the table: rendering fails where it runs */
    JM_CAPITALIZE,
    JM_COUNT,
    JM_CYCLE,
    JM_ENDSWITH,
    JM_FIND,
    JM_GET,
    JM_ISALPHA,
    JM_ISDIGIT,
    JM_ISLOWER,
    JM_ISSPACE,
    JM_ISUPPER,
    JM_ITEMS,
    JM_JOIN,
    JM_KEYS,
    JM_LOWER,
    JM_LSTRIP,
    JM_REPLACE,
    JM_RSPLIT,
    JM_RSTRIP,
    JM_SPLIT,
    JM_SPLITLINES,
    JM_STARTSWITH,
    JM_STRIP,
    JM_TITLE,
    JM_UPPER,
    JM_VALUES,
} jm_id; /* methods of str and dict */
typedef enum {
    JG_UNKNOWN = -1, /* not in the table: rendering fails where it runs */
    JG_DICT,
    JG_NAMESPACE,
    JG_RAISE_EXCEPTION,
    JG_RANGE,
    JG_STRFTIME_NOW,
} jg_id; /* global functions */

int kvf_text_jinja_filter_id(const char *name); /* JF_UNKNOWN when not a filter */
int kvf_text_jinja_test_id(const char *name);
int kvf_text_jinja_method_id(const char *name);
int kvf_text_jinja_global_id(const char *name);

typedef struct jnode {
    uint8_t kind, op;
    int16_t fn; /* JN_FILTER, JN_TEST: the jf_id or jt_id of name; JN_CALL: the jm_id of an
                 * attribute callee's name or the jg_id of a plain name's (else -1) */
    int32_t line, col;
    struct jnode *a, *b, *c, *d, *e;
    struct jnode **kids;
    const char **kw; /* parallel to kids for calls, filters and tests; NULL when none */
    size_t n_kids;
    const char *name; /* NUL-terminated, owned by the template's arena */
    jv lit;           /* immortal */
} jnode;

/* The arena that owns a compiled template's nodes and strings. */
typedef struct jarena_block {
    struct jarena_block *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} jarena_block;

typedef struct jarena {
    jarena_block *head;
    jstr **strs; /* immortal strings, freed with the arena */
    size_t n_strs, cap_strs;
} jarena;

void *jarena_alloc(jarena *a, size_t n);
void jarena_free(jarena *a);
/* An immortal string value owned by the arena. */
bool jarena_str(jarena *a, const char *s, size_t len, jv *out);

#define JINJA_MAX_NEST 96 /* parser nesting of blocks and expressions */

/* A compiled template: its tree and the arena that owns it. Read-only while rendering. */
struct kvf_text_jinja {
    jarena arena;
    jnode *root; /* JN_BODY */
};

/* Scopes: new (retains parent; NULL on OOM) and release. jframe_pop empties the frame's
 * variables and drops its parent before releasing it. */
jframe *jframe_new(jframe *parent);
void jframe_release(jframe *f);
void jframe_pop(jframe *f);

#endif
