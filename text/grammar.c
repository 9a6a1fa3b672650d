/* grammar.c: the grammar builder, its compilation into a pushdown automaton over bytes (one
 * Thompson NFA per rule, edges on byte ranges and rule references), the vocabulary trie, and the
 * matcher with its per-state mask cache. The regex compiler is regex.c; JSON Schema is schema.c.
 *
 * Automaton: states are BYTE (a range, then next), REF (push this state, enter a rule; on return
 * continue at next), EPS (one or two epsilon edges), FINAL (a rule's end: pop) and DEAD. Each
 * state a stack can continue from has its epsilon closure precomputed (the BYTE, REF and FINAL
 * states it reaches), so a step is: for each stack whose top BYTE state takes the byte, expand
 * the closure of its next state, pushing at REF and popping at FINAL. A stack is a chain of
 * hash-consed nodes (state, parent) in a matcher's scratch, so equal stacks are one node id and
 * a step dedups by id; between tokens a matcher keeps its state as sorted, flattened stacks,
 * which is also the key of the grammar's mask cache. */
#include "text/grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

/* ------------------------------------------------------------------------------------------ */
/* builder                                                                                     */

/* Nesting of expressions the builder accepts: the regex and schema compilers stop at
 * KVF_TEXT_GRAMMAR_MAX_DEPTH of their own nesting, which may take a few expression levels each;
 * this bounds the recursion of compiling. */
#define GB_MAX_DEPTH 1024
/* States, after expansion, over all rules together. */
#define G_MAX_STATES (4 * KVF_TEXT_GRAMMAR_MAX_NODES)
/* Total length of the precomputed epsilon closures (a grammar of many nested empty alternatives
 * could make them quadratic). */
#define G_MAX_CLOSURE (1 << 24)
/* Work items of one step: each push and pop is done at most once per node and step, so this is
 * only a backstop against a bug. */
#define G_MAX_WORK (1 << 22)
/* The mask cache's memory (keys and masks): when a new entry would pass it, the cache is emptied
 * and starts again, so a grammar's cache never holds more than this. */
#define G_CACHE_MAX_BYTES ((size_t)64 << 20)

enum { GX_LIT, GX_BYTES, GX_SEQ, GX_ALT, GX_REP, GX_REF };

struct kvf_text_gx {
    int kind;
    uint8_t lo, hi;       /* GX_BYTES */
    int32_t min, max;     /* GX_REP */
    int32_t rule;         /* GX_REF */
    size_t n;             /* GX_LIT bytes, GX_SEQ/GX_ALT kids */
    uint8_t *bytes;       /* GX_LIT */
    kvf_text_gx **kids;   /* GX_SEQ, GX_ALT; GX_REP: kids[0] */
    int64_t size;         /* nodes after expansion */
    int32_t depth;
};

typedef struct gb_chunk {
    struct gb_chunk *next;
    size_t used, cap;
    _Alignas(max_align_t) unsigned char mem[];
} gb_chunk;

struct kvf_text_gb {
    gb_chunk *chunks;
    kvf_text_gx **bodies; /* [n_rules], NULL until defined */
    char **names;         /* [n_rules], NULL unless named */
    int32_t n_rules, cap_rules;
    kvf_status fail; /* first failure of a constructor */
    char fail_msg[KVF_ERR_MSG_MAX];
};

static void gb_failf(kvf_text_gb *b, kvf_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void gb_failf(kvf_text_gb *b, kvf_status st, const char *fmt, ...)
{
    if (b->fail != KVF_OK)
        return;
    b->fail = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->fail_msg, sizeof b->fail_msg, fmt, ap);
    va_end(ap);
}

static void *gb_alloc(kvf_text_gb *b, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    gb_chunk *c = b->chunks;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        c = malloc(sizeof *c + cap);
        if (!c) {
            gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory building the grammar");
            return NULL;
        }
        c->cap = cap;
        c->used = 0;
        c->next = b->chunks;
        b->chunks = c;
    }
    void *p = c->mem + c->used;
    c->used += n;
    return p;
}

kvf_status kvf_text_gb_create(kvf_text_gb **out, kvf_err *err)
{
    kvf_text_gb *b = calloc(1, sizeof *b);
    if (!b)
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    *out = b;
    return KVF_OK;
}

void kvf_text_gb_destroy(kvf_text_gb *b)
{
    if (!b)
        return;
    for (gb_chunk *c = b->chunks, *n; c; c = n) {
        n = c->next;
        free(c);
    }
    for (int32_t i = 0; i < b->n_rules; i++)
        free(b->names ? b->names[i] : NULL);
    free(b->names);
    free(b->bodies);
    free(b);
}

int32_t kvf_text_gb_rule(kvf_text_gb *b)
{
    if (b->n_rules == b->cap_rules) {
        int32_t cap = b->cap_rules ? b->cap_rules * 2 : 16;
        if (cap > KVF_TEXT_GRAMMAR_MAX_NODES) {
            gb_failf(b, KVF_ERR_LIMIT, "grammar: more than %d rules", KVF_TEXT_GRAMMAR_MAX_NODES);
            return -1;
        }
        kvf_text_gx **bodies = realloc(b->bodies, (size_t)cap * sizeof *bodies);
        if (!bodies) {
            gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
            return -1;
        }
        b->bodies = bodies;
        char **names = realloc(b->names, (size_t)cap * sizeof *names);
        if (!names) {
            gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
            return -1;
        }
        b->names = names;
        b->cap_rules = cap;
    }
    b->bodies[b->n_rules] = NULL;
    b->names[b->n_rules] = NULL;
    return b->n_rules++;
}

kvf_status kvf_text_gb_rule_name(kvf_text_gb *b, int32_t rule, const char *name)
{
    if (rule < 0 || rule >= b->n_rules || !name)
        return KVF_ERR_INVALID;
    size_t n = strlen(name);
    if (n > 200)
        n = 200; /* it only goes into messages */
    char *s = malloc(n + 1);
    if (!s)
        return KVF_ERR_NOMEM;
    memcpy(s, name, n);
    s[n] = 0;
    free(b->names[rule]);
    b->names[rule] = s;
    return KVF_OK;
}

/* "rule 3" or "rule 3 (/properties/a)" into buf, for messages. */
static const char *rule_label(char *buf, size_t cap, char *const *names, int32_t rule)
{
    if (names && names[rule])
        snprintf(buf, cap, "rule %d (%s)", (int)rule, names[rule]);
    else
        snprintf(buf, cap, "rule %d", (int)rule);
    return buf;
}

kvf_status kvf_text_gb_define(kvf_text_gb *b, int32_t rule, kvf_text_gx *body, kvf_err *err)
{
    if (rule < 0 || rule >= b->n_rules)
        return kvf_err_set(err, KVF_ERR_INVALID, "grammar: rule %d was never created (%d rules)",
                           (int)rule, (int)b->n_rules);
    if (!body) {
        if (b->fail != KVF_OK)
            return kvf_err_set(err, b->fail, "%s", b->fail_msg);
        return kvf_err_set(err, KVF_ERR_INVALID, "grammar: rule %d defined with no body", (int)rule);
    }
    if (b->bodies[rule]) {
        char l[256];
        return kvf_err_set(err, KVF_ERR_EXISTS, "grammar: %s is defined twice",
                           rule_label(l, sizeof l, b->names, rule));
    }
    b->bodies[rule] = body;
    return KVF_OK;
}

static kvf_text_gx *gx_new(kvf_text_gb *b, int kind, int64_t size, int32_t depth)
{
    if (b->fail != KVF_OK)
        return NULL;
    if (size > KVF_TEXT_GRAMMAR_MAX_NODES) {
        gb_failf(b, KVF_ERR_LIMIT,
                 "grammar: too large: more than %d nodes once repetitions are expanded",
                 KVF_TEXT_GRAMMAR_MAX_NODES);
        return NULL;
    }
    if (depth > GB_MAX_DEPTH) {
        gb_failf(b, KVF_ERR_LIMIT, "grammar: nested deeper than %d", GB_MAX_DEPTH);
        return NULL;
    }
    kvf_text_gx *x = gb_alloc(b, sizeof *x);
    if (!x)
        return NULL;
    memset(x, 0, sizeof *x);
    x->kind = kind;
    x->size = size;
    x->depth = depth;
    return x;
}

kvf_text_gx *kvf_text_gx_lit(kvf_text_gb *b, const void *bytes, size_t n)
{
    if (n > KVF_TEXT_GRAMMAR_MAX_NODES) {
        gb_failf(b, KVF_ERR_LIMIT, "grammar: a literal of %zu bytes (at most %d)", n,
                 KVF_TEXT_GRAMMAR_MAX_NODES);
        return NULL;
    }
    kvf_text_gx *x = gx_new(b, GX_LIT, (int64_t)n + 1, 1);
    if (!x)
        return NULL;
    x->n = n;
    if (n) {
        x->bytes = gb_alloc(b, n);
        if (!x->bytes)
            return NULL;
        memcpy(x->bytes, bytes, n);
    }
    return x;
}

kvf_text_gx *kvf_text_gx_bytes(kvf_text_gb *b, uint8_t lo, uint8_t hi)
{
    if (lo > hi) { /* an empty range matches nothing */
        return kvf_text_gx_alt(b, NULL, 0);
    }
    kvf_text_gx *x = gx_new(b, GX_BYTES, 1, 1);
    if (x) {
        x->lo = lo;
        x->hi = hi;
    }
    return x;
}

static kvf_text_gx *gx_list(kvf_text_gb *b, int kind, kvf_text_gx *const *xs, size_t n)
{
    if (b->fail != KVF_OK)
        return NULL;
    int64_t size = 1;
    int32_t depth = 0;
    for (size_t i = 0; i < n; i++) {
        if (!xs[i]) {
            gb_failf(b, KVF_ERR_INVALID, "grammar: a NULL expression in a sequence or choice");
            return NULL;
        }
        size += xs[i]->size;
        if (size > KVF_TEXT_GRAMMAR_MAX_NODES)
            size = KVF_TEXT_GRAMMAR_MAX_NODES + 1; /* saturate; gx_new refuses */
        if (xs[i]->depth > depth)
            depth = xs[i]->depth;
    }
    kvf_text_gx *x = gx_new(b, kind, size, depth + 1);
    if (!x)
        return NULL;
    x->n = n;
    if (n) {
        x->kids = gb_alloc(b, n * sizeof *x->kids);
        if (!x->kids)
            return NULL;
        memcpy(x->kids, xs, n * sizeof *x->kids);
    }
    return x;
}

kvf_text_gx *kvf_text_gx_seq(kvf_text_gb *b, kvf_text_gx *const *xs, size_t n)
{
    if (n == 1)
        return xs[0];
    return gx_list(b, GX_SEQ, xs, n);
}

static kvf_text_gx *gx_lits_choice(kvf_text_gb *b, kvf_text_gx *const *xs, size_t n);

/* Literals at or past this many alternatives are merged by their prefixes (kvf_text_gx_choice):
 * an enum written as a plain choice of literals then stays a few live stacks. */
#define GB_MERGE_LITS 8

kvf_text_gx *kvf_text_gx_alt(kvf_text_gb *b, kvf_text_gx *const *xs, size_t n)
{
    if (n == 1)
        return xs[0];
    if (n >= GB_MERGE_LITS && b->fail == KVF_OK) {
        size_t i = 0;
        while (i < n && xs[i] && xs[i]->kind == GX_LIT)
            i++;
        if (i == n)
            return gx_lits_choice(b, xs, n);
    }
    return gx_list(b, GX_ALT, xs, n);
}

kvf_text_gx *kvf_text_gx_rep(kvf_text_gb *b, kvf_text_gx *x, int32_t min, int32_t max)
{
    if (b->fail != KVF_OK)
        return NULL;
    if (!x) {
        gb_failf(b, KVF_ERR_INVALID, "grammar: a NULL expression repeated");
        return NULL;
    }
    if (min < 0 || (max >= 0 && max < min) || max < -1) {
        gb_failf(b, KVF_ERR_INVALID, "grammar: repetition {%d,%d} (want 0 <= min <= max, or max -1)",
                 (int)min, (int)max);
        return NULL;
    }
    int64_t copies = max < 0 ? (min > 1 ? min : 1) : max;
    int64_t size = 1 + x->size * (copies ? copies : 1);
    if (size > KVF_TEXT_GRAMMAR_MAX_NODES)
        size = KVF_TEXT_GRAMMAR_MAX_NODES + 1;
    kvf_text_gx *r = gx_new(b, GX_REP, size, x->depth + 1);
    if (!r)
        return NULL;
    r->min = min;
    r->max = max;
    r->n = 1;
    r->kids = gb_alloc(b, sizeof *r->kids);
    if (!r->kids)
        return NULL;
    r->kids[0] = x;
    return r;
}

kvf_text_gx *kvf_text_gx_ref(kvf_text_gb *b, int32_t rule)
{
    if (b->fail == KVF_OK && (rule < 0 || rule >= b->n_rules)) {
        gb_failf(b, KVF_ERR_INVALID, "grammar: reference to rule %d, never created", (int)rule);
        return NULL;
    }
    kvf_text_gx *x = gx_new(b, GX_REF, 1, 1);
    if (x)
        x->rule = rule;
    return x;
}

/* UTF-8 of one code point into out (1..4 bytes). */
static int utf8_put(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

static int cmp_range(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : 0;
}

typedef struct alt_list {
    kvf_text_gx **xs;
    size_t n, cap;
    bool nomem;
} alt_list;

static void alt_push(alt_list *l, kvf_text_gx *x)
{
    if (!x) {
        l->nomem = true;
        return;
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        kvf_text_gx **xs = realloc(l->xs, cap * sizeof *xs);
        if (!xs) {
            l->nomem = true;
            return;
        }
        l->xs = xs;
        l->cap = cap;
    }
    l->xs[l->n++] = x;
}

/* The code points [lo, hi] (no surrogates inside, one encoded length or not) as byte-range
 * sequences: split until every byte position of lo's and hi's encodings varies independently
 * (the construction of RE2's and Rust regex's UTF-8 sequences). */
static void utf8_ranges(kvf_text_gb *b, alt_list *l, uint32_t lo, uint32_t hi)
{
    static const uint32_t max_of_len[3] = {0x7F, 0x7FF, 0xFFFF};
    for (int i = 0; i < 3; i++) {
        if (lo <= max_of_len[i] && hi > max_of_len[i]) {
            utf8_ranges(b, l, lo, max_of_len[i]);
            utf8_ranges(b, l, max_of_len[i] + 1, hi);
            return;
        }
    }
    if (hi < 0x80) {
        alt_push(l, kvf_text_gx_bytes(b, (uint8_t)lo, (uint8_t)hi));
        return;
    }
    for (int i = 1; i < 4; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                utf8_ranges(b, l, lo, lo | m);
                utf8_ranges(b, l, (lo | m) + 1, hi);
                return;
            }
            if ((hi & m) != m) {
                utf8_ranges(b, l, lo, (hi & ~m) - 1);
                utf8_ranges(b, l, hi & ~m, hi);
                return;
            }
        }
    }
    uint8_t a[4], z[4];
    int n = utf8_put(lo, a);
    utf8_put(hi, z);
    kvf_text_gx *parts[4] = {0};
    for (int i = 0; i < n; i++)
        parts[i] = kvf_text_gx_bytes(b, a[i], z[i]);
    alt_push(l, kvf_text_gx_seq(b, parts, (size_t)n));
}

kvf_text_gx *kvf_text_gx_chars(kvf_text_gb *b, const uint32_t (*ranges)[2], size_t n, bool negate)
{
    if (b->fail != KVF_OK)
        return NULL;
    /* normalize: sorted, merged, clipped to 0..0x10FFFF; then complemented if asked */
    uint32_t (*r)[2] = malloc((n + 2) * sizeof *r);
    if (!r) {
        gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
        return NULL;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t lo = ranges[i][0], hi = ranges[i][1] > 0x10FFFF ? 0x10FFFF : ranges[i][1];
        if (lo <= hi) {
            r[k][0] = lo;
            r[k][1] = hi;
            k++;
        }
    }
    qsort(r, k, sizeof *r, cmp_range);
    size_t m = 0;
    for (size_t i = 0; i < k; i++) {
        if (m && r[i][0] <= r[m - 1][1] + 1) {
            if (r[i][1] > r[m - 1][1])
                r[m - 1][1] = r[i][1];
        } else {
            r[m][0] = r[i][0];
            r[m][1] = r[i][1];
            m++;
        }
    }
    if (negate) {
        uint32_t (*c)[2] = malloc((m + 1) * sizeof *c);
        if (!c) {
            free(r);
            gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
            return NULL;
        }
        size_t cn = 0;
        uint32_t next = 0;
        for (size_t i = 0; i < m; i++) {
            if (r[i][0] > next) {
                c[cn][0] = next;
                c[cn][1] = r[i][0] - 1;
                cn++;
            }
            next = r[i][1] + 1;
        }
        if (next <= 0x10FFFF) {
            c[cn][0] = next;
            c[cn][1] = 0x10FFFF;
            cn++;
        }
        free(r);
        r = c;
        m = cn;
    }
    alt_list l = {0};
    for (size_t i = 0; i < m; i++) {
        /* surrogates are not characters: cut them out */
        uint32_t lo = r[i][0], hi = r[i][1];
        if (lo < 0xD800 && hi >= 0xD800) {
            utf8_ranges(b, &l, lo, 0xD7FF);
            lo = 0xE000;
        }
        if (lo >= 0xD800 && lo <= 0xDFFF)
            lo = 0xE000;
        if (lo <= hi)
            utf8_ranges(b, &l, lo, hi);
    }
    free(r);
    kvf_text_gx *x = NULL;
    if (l.nomem)
        gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
    else
        x = kvf_text_gx_alt(b, l.xs, l.n);
    free(l.xs);
    return x;
}

typedef struct choice_str {
    const uint8_t *p;
    size_t len;
} choice_str;

static int cmp_choice(const void *a, const void *b)
{
    const choice_str *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, n);
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* The strings xs[0..n) (sorted, distinct), all sharing their first `at` bytes, as a trie of
 * expressions from byte `at` on: the common prefix as a literal, then a choice among what
 * follows (the empty string among it when one string ends there). depth counts the branching
 * levels, bounded so that the expression's nesting stays within the builder's. */
static kvf_text_gx *choice_trie(kvf_text_gb *b, const choice_str *xs, size_t n, size_t at, int depth)
{
    /* common prefix beyond `at` */
    size_t cp = xs[0].len;
    for (size_t i = 1; i < n && cp > at; i++) {
        size_t k = at;
        while (k < cp && k < xs[i].len && xs[i].p[k] == xs[0].p[k])
            k++;
        cp = k;
    }
    kvf_text_gx *pre = kvf_text_gx_lit(b, xs[0].p + at, cp - at);
    if (n == 1 || !pre)
        return pre;
    /* groups by the byte after the prefix; the string that ends at cp (sorted first) alone */
    kvf_text_gx **alts = malloc((n < 257 ? n : 257) * sizeof *alts);
    if (!alts) {
        gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
        return NULL;
    }
    size_t na = 0, i = 0;
    if (xs[0].len == cp) {
        alts[na++] = kvf_text_gx_lit(b, "", 0);
        i = 1;
    }
    while (i < n) {
        size_t j = i + 1;
        while (j < n && xs[j].p[cp] == xs[i].p[cp])
            j++;
        if (depth < GB_MAX_DEPTH / 4) {
            alts[na++] = choice_trie(b, xs + i, j - i, cp, depth + 1);
        } else { /* too deep a trie: the rest as plain literals */
            kvf_text_gx **lits = malloc((j - i) * sizeof *lits);
            if (!lits) {
                free(alts);
                gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
                return NULL;
            }
            for (size_t k = i; k < j; k++)
                lits[k - i] = kvf_text_gx_lit(b, xs[k].p + cp, xs[k].len - cp);
            alts[na++] = j - i == 1 ? lits[0] : gx_list(b, GX_ALT, lits, j - i);
            free(lits);
        }
        i = j;
    }
    /* gx_list, not kvf_text_gx_alt: these are merged already */
    kvf_text_gx *parts[2] = {pre, na == 1 ? alts[0] : gx_list(b, GX_ALT, alts, na)};
    free(alts);
    return kvf_text_gx_seq(b, parts, 2);
}

static kvf_text_gx *gx_lits_choice(kvf_text_gb *b, kvf_text_gx *const *xs, size_t n)
{
    const char **strs = malloc(n * sizeof *strs);
    size_t *lens = malloc(n * sizeof *lens);
    kvf_text_gx *x = NULL;
    if (!strs || !lens) {
        gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
    } else {
        for (size_t i = 0; i < n; i++) {
            strs[i] = xs[i]->n ? (const char *)xs[i]->bytes : "";
            lens[i] = xs[i]->n;
        }
        x = kvf_text_gx_choice(b, strs, lens, n);
    }
    free(strs);
    free(lens);
    return x;
}

kvf_text_gx *kvf_text_gx_choice(kvf_text_gb *b, const char *const *strs, const size_t *lens,
                                size_t n)
{
    if (b->fail != KVF_OK)
        return NULL;
    if (n == 0)
        return kvf_text_gx_alt(b, NULL, 0);
    choice_str *xs = malloc(n * sizeof *xs);
    if (!xs) {
        gb_failf(b, KVF_ERR_NOMEM, "grammar: out of memory");
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        xs[i].p = (const uint8_t *)strs[i];
        xs[i].len = lens ? lens[i] : strlen(strs[i]);
    }
    qsort(xs, n, sizeof *xs, cmp_choice);
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (!m || cmp_choice(&xs[m - 1], &xs[i]) != 0)
            xs[m++] = xs[i];
    kvf_text_gx *x = choice_trie(b, xs, m, 0, 0);
    free(xs);
    return x;
}

/* ------------------------------------------------------------------------------------------ */
/* compiled grammar                                                                            */

enum { ST_BYTE, ST_REF, ST_EPS, ST_FINAL, ST_DEAD };

typedef struct gstate {
    uint8_t kind, lo, hi;
    int32_t next;  /* BYTE, REF, EPS: the (first) successor; -1 while a hole */
    int32_t arg;   /* EPS: the second successor or -1; REF: the rule; FINAL: the rule */
} gstate;

typedef struct cache_ent {
    uint64_t hash;
    uint64_t vocab; /* the serial of the vocabulary the mask is over */
    int32_t *key; /* canonical state */
    size_t key_n;
    uint32_t *mask;
} cache_ent;

struct kvf_text_grammar {
    gstate *st;
    int32_t n_st;
    int32_t n_rules;     /* rule ids of the builder, plus the root as the last */
    int32_t *rule_start; /* [n_rules], -1 for rules the root never reaches */
    int32_t *clo_off;    /* [n_st]: closure of a state that stacks continue from, or -1 */
    int32_t *clo_len;    /* [n_st] */
    int32_t *clo;        /* the closures: BYTE, REF and FINAL states */
    int32_t *init;       /* canonical initial state */
    size_t init_n;
    /* mask cache: open addressing over ents, keyed by (vocabulary, canonical state) */
    cache_ent *ents;
    size_t ents_cap, ents_n, cache_bytes;
    uint64_t cache_hits, cache_misses;
};

/* a stack node in a matcher's scratch: a BYTE state on top, REF states below */
typedef struct gnode {
    int32_t pos, parent, depth;
    uint32_t fstamp, pstamp, qstamp; /* step that put it in the frontier / pushed / popped it */
} gnode;

#define ACCEPT_ID (-2) /* the empty stack: the root rule ended */

typedef struct scratch {
    gnode *nodes;
    int32_t n, cap;
    int32_t *tab; /* hash of (pos, parent) -> node id + 1; 0 empty */
    uint32_t tab_cap, tab_used;
    uint32_t step;
    int32_t *work; /* pairs (pos, parent) */
    size_t work_cap;
    int32_t *fr; /* frontiers, one after another */
    size_t fr_n, fr_cap;
    /* The mask walk's memo, a lazy DFA over frontiers valid for one walk: frontiers interned by
     * content (fz, fe), and (frontier, byte) -> next frontier. Inside a JSON string almost every
     * byte leads back to the same frontier, so most trie nodes cost one lookup. */
    int32_t *fz; /* interned frontiers' contents */
    size_t fz_n, fz_cap;
    struct fz_ent *fe;
    int32_t fe_n, fe_cap;
    int32_t *fe_tab; /* content hash -> frontier id + 1 */
    uint32_t fe_tab_cap;
    uint32_t *mo_key; /* fid * 256 + byte + 1; 0 empty */
    int32_t *mo_val;  /* next frontier id, or -1: dead */
    uint32_t mo_cap, mo_n;
} scratch;

typedef struct fz_ent {
    size_t off;
    int32_t n;
    uint32_t hash;
    uint64_t bits[4]; /* the bytes some top can take */
} fz_ent;

static void scratch_fini(scratch *s)
{
    free(s->nodes);
    free(s->tab);
    free(s->work);
    free(s->fr);
    free(s->fz);
    free(s->fe);
    free(s->fe_tab);
    free(s->mo_key);
    free(s->mo_val);
    memset(s, 0, sizeof *s);
}

static inline uint32_t hash_pair(int32_t a, int32_t b)
{
    uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    k *= 0x9E3779B97F4A7C15ull;
    return (uint32_t)(k >> 32);
}

static kvf_status tab_rebuild(scratch *s, uint32_t cap)
{
    int32_t *t = calloc(cap, sizeof *t);
    if (!t)
        return KVF_ERR_NOMEM;
    free(s->tab);
    s->tab = t;
    s->tab_cap = cap;
    s->tab_used = 0;
    for (int32_t i = 0; i < s->n; i++) {
        uint32_t h = hash_pair(s->nodes[i].pos, s->nodes[i].parent) & (cap - 1);
        while (t[h])
            h = (h + 1) & (cap - 1);
        t[h] = i + 1;
        s->tab_used++;
    }
    return KVF_OK;
}

static void scratch_reset(scratch *s)
{
    s->n = 0;
    s->fr_n = 0;
    if (s->tab && s->tab_used)
        memset(s->tab, 0, s->tab_cap * sizeof *s->tab);
    s->tab_used = 0;
}

/* The node (pos, parent), made when new. Nodes past s->n were released by the mask walk's
 * backtracking; table entries that point at them are stale and are reused or skipped. -1 when
 * memory runs out. */
static int32_t intern(scratch *s, int32_t pos, int32_t parent)
{
    if (!s->tab || (s->tab_used + 1) * 2 > s->tab_cap) {
        uint32_t cap = s->tab_cap ? s->tab_cap : 1024;
        while ((uint32_t)(s->n + 1) * 4 > cap)
            cap *= 2;
        if (tab_rebuild(s, cap) != KVF_OK)
            return -1;
    }
    uint32_t mask = s->tab_cap - 1, h = hash_pair(pos, parent) & mask, free_slot = UINT32_MAX;
    for (;;) {
        int32_t e = s->tab[h];
        if (!e)
            break;
        int32_t id = e - 1;
        if (id < s->n) {
            if (s->nodes[id].pos == pos && s->nodes[id].parent == parent)
                return id;
        } else if (free_slot == UINT32_MAX) {
            free_slot = h;
        }
        h = (h + 1) & mask;
    }
    if (s->n == s->cap) {
        int32_t cap = s->cap ? s->cap * 2 : 1024;
        gnode *nn = realloc(s->nodes, (size_t)cap * sizeof *nn);
        if (!nn)
            return -1;
        s->nodes = nn;
        s->cap = cap;
    }
    int32_t id = s->n++;
    gnode *g = &s->nodes[id];
    g->pos = pos;
    g->parent = parent;
    g->depth = parent < 0 ? 1 : s->nodes[parent].depth + 1;
    g->fstamp = g->pstamp = g->qstamp = 0;
    if (free_slot != UINT32_MAX) {
        s->tab[free_slot] = id + 1;
    } else {
        s->tab[h] = id + 1;
        s->tab_used++;
    }
    return id;
}

static kvf_status fr_reserve(scratch *s, size_t more)
{
    if (s->fr_n + more <= s->fr_cap)
        return KVF_OK;
    size_t cap = s->fr_cap ? s->fr_cap : 4096;
    while (cap < s->fr_n + more)
        cap *= 2;
    int32_t *f = realloc(s->fr, cap * sizeof *f);
    if (!f)
        return KVF_ERR_NOMEM;
    s->fr = f;
    s->fr_cap = cap;
    return KVF_OK;
}

static uint32_t next_stamp(scratch *s)
{
    if (++s->step == 0) { /* wrapped: old stamps could collide */
        for (int32_t i = 0; i < s->n; i++)
            s->nodes[i].fstamp = s->nodes[i].pstamp = s->nodes[i].qstamp = 0;
        s->step = 1;
    }
    return s->step;
}

/* Expands the closures of the (pos, parent) pairs in s->work[0..*wn) and appends the stacks they
 * reach (top node ids, or ACCEPT_ID) to the frontier at s->fr[s->fr_n...], counting them in
 * *out_n. The caller set the step stamp. */
static kvf_status expand(const kvf_text_grammar *g, scratch *s, size_t wn, uint32_t stamp,
                         int32_t *out_n, bool *accept_seen, kvf_err *err)
{
    size_t budget = G_MAX_WORK;
    while (wn) {
        wn--;
        int32_t pos = s->work[2 * wn], parent = s->work[2 * wn + 1];
        if (budget-- == 0)
            return kvf_err_set(err, KVF_ERR_LIMIT, "grammar: a step took more than %d expansions",
                               G_MAX_WORK);
        const int32_t *c = g->clo + g->clo_off[pos];
        int32_t cn = g->clo_len[pos];
        for (int32_t i = 0; i < cn; i++) {
            int32_t t = c[i];
            const gstate *st = &g->st[t];
            int32_t id;
            switch (st->kind) {
            case ST_BYTE:
                id = intern(s, t, parent);
                if (id < 0)
                    return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
                if (s->nodes[id].fstamp != stamp) {
                    s->nodes[id].fstamp = stamp;
                    if (*out_n >= KVF_TEXT_GRAMMAR_MAX_STACKS)
                        return kvf_err_set(err, KVF_ERR_LIMIT,
                                           "grammar: more than %d live automaton stacks (the "
                                           "grammar is too ambiguous)",
                                           KVF_TEXT_GRAMMAR_MAX_STACKS);
                    if (fr_reserve(s, 1) != KVF_OK)
                        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
                    s->fr[s->fr_n++] = id;
                    (*out_n)++;
                }
                break;
            case ST_REF:
                if ((parent < 0 ? 0 : s->nodes[parent].depth) + 1 >= KVF_TEXT_GRAMMAR_MAX_STACK)
                    return kvf_err_set(err, KVF_ERR_LIMIT,
                                       "grammar: more than %d rule references open at once",
                                       KVF_TEXT_GRAMMAR_MAX_STACK);
                id = intern(s, t, parent);
                if (id < 0)
                    return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
                if (s->nodes[id].pstamp != stamp) {
                    s->nodes[id].pstamp = stamp;
                    s->work[2 * wn] = g->rule_start[st->arg];
                    s->work[2 * wn + 1] = id;
                    wn++;
                    if (wn * 2 + 2 > s->work_cap) {
                        size_t cap = s->work_cap * 2;
                        int32_t *w = realloc(s->work, cap * sizeof *w);
                        if (!w)
                            return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
                        s->work = w;
                        s->work_cap = cap;
                    }
                }
                break;
            case ST_FINAL:
                if (parent < 0) {
                    if (!*accept_seen) {
                        *accept_seen = true;
                        if (fr_reserve(s, 1) != KVF_OK)
                            return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
                        s->fr[s->fr_n++] = ACCEPT_ID;
                        (*out_n)++;
                    }
                } else if (s->nodes[parent].qstamp != stamp) {
                    s->nodes[parent].qstamp = stamp;
                    s->work[2 * wn] = g->st[s->nodes[parent].pos].next;
                    s->work[2 * wn + 1] = s->nodes[parent].parent;
                    wn++;
                    if (wn * 2 + 2 > s->work_cap) {
                        size_t cap = s->work_cap * 2;
                        int32_t *w = realloc(s->work, cap * sizeof *w);
                        if (!w)
                            return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
                        s->work = w;
                        s->work_cap = cap;
                    }
                }
                break;
            default:
                break;
            }
        }
    }
    return KVF_OK;
}

static kvf_status work_reserve(scratch *s, size_t pairs)
{
    if (pairs * 2 + 2 <= s->work_cap)
        return KVF_OK;
    size_t cap = s->work_cap ? s->work_cap : 1024;
    while (cap < pairs * 2 + 2)
        cap *= 2;
    int32_t *w = realloc(s->work, cap * sizeof *w);
    if (!w)
        return KVF_ERR_NOMEM;
    s->work = w;
    s->work_cap = cap;
    return KVF_OK;
}

/* One byte: the frontier at s->fr[in_off .. in_off + in_n) advanced by b, appended to s->fr;
 * *out_n its size (0: b cannot follow). */
static kvf_status step_from(const kvf_text_grammar *g, scratch *s, const int32_t *in, int32_t in_n,
                            uint8_t b, int32_t *out_n, kvf_err *err)
{
    uint32_t stamp = next_stamp(s);
    *out_n = 0;
    bool accept_seen = false;
    if (work_reserve(s, (size_t)in_n + 16) != KVF_OK)
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    size_t wn = 0;
    for (int32_t i = 0; i < in_n; i++) {
        int32_t id = in[i];
        if (id < 0)
            continue;
        const gstate *st = &g->st[s->nodes[id].pos];
        if (b < st->lo || b > st->hi)
            continue;
        s->work[2 * wn] = st->next;
        s->work[2 * wn + 1] = s->nodes[id].parent;
        wn++;
    }
    if (!wn)
        return KVF_OK;
    return expand(g, s, wn, stamp, out_n, &accept_seen, err);
}

/* step_from with the input in s->fr itself: room for the largest output is made first, so
 * appending cannot move the input. */
static kvf_status step(const kvf_text_grammar *g, scratch *s, size_t in_off, int32_t in_n,
                       uint8_t b, int32_t *out_n, kvf_err *err)
{
    if (fr_reserve(s, KVF_TEXT_GRAMMAR_MAX_STACKS + 2) != KVF_OK)
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    return step_from(g, s, s->fr + in_off, in_n, b, out_n, err);
}

/* The start: the root rule's closure, into a reset scratch's frontier. */
static kvf_status start_frontier(const kvf_text_grammar *g, scratch *s, int32_t *out_n,
                                 kvf_err *err)
{
    scratch_reset(s);
    if (work_reserve(s, 16) != KVF_OK)
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    bool accept_seen = false;
    s->work[0] = g->rule_start[g->n_rules - 1];
    s->work[1] = -1;
    *out_n = 0;
    return expand(g, s, 1, next_stamp(s), out_n, &accept_seen, err);
}

/* A canonical state into a reset scratch's frontier. */
static kvf_status load_state(scratch *s, const int32_t *state, size_t n, int32_t *out_n,
                             kvf_err *err)
{
    scratch_reset(s);
    *out_n = 0;
    size_t i = 0;
    while (i < n) {
        int32_t len = state[i++];
        int32_t parent = -1;
        if (len == 0)
            parent = ACCEPT_ID;
        for (int32_t k = 0; k < len; k++) {
            parent = intern(s, state[i + (size_t)k], parent);
            if (parent < 0)
                return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
        }
        i += (size_t)len;
        if (fr_reserve(s, 1) != KVF_OK)
            return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
        s->fr[s->fr_n++] = parent;
        (*out_n)++;
    }
    return KVF_OK;
}

typedef struct stack_ref {
    const int32_t *p;
    int32_t len;
} stack_ref;

static int cmp_stack(const void *a, const void *b)
{
    const stack_ref *x = a, *y = b;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    for (int32_t i = 0; i < x->len; i++)
        if (x->p[i] != y->p[i])
            return x->p[i] < y->p[i] ? -1 : 1;
    return 0;
}

/* The frontier fr[off .. off+n) as a canonical state (malloc'd into *out, *out_n ints): each
 * stack as its length then its states bottom to top, stacks sorted and without duplicates. */
static kvf_status canonical(const scratch *s, size_t off, int32_t n, int32_t **out, size_t *out_n,
                            kvf_err *err)
{
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t id = s->fr[off + (size_t)i];
        total += 1 + (id < 0 ? 0 : (size_t)s->nodes[id].depth);
    }
    int32_t *flat = malloc((total ? total : 1) * sizeof *flat);
    stack_ref *refs = malloc(((size_t)n + 1) * sizeof *refs);
    int32_t *res = malloc((total ? total : 1) * sizeof *res);
    if (!flat || !refs || !res) {
        free(flat);
        free(refs);
        free(res);
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    }
    size_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t id = s->fr[off + (size_t)i];
        int32_t len = id < 0 ? 0 : s->nodes[id].depth;
        refs[i].p = flat + at;
        refs[i].len = len;
        for (int32_t k = len - 1; k >= 0; k--) {
            flat[at + (size_t)k] = s->nodes[id].pos;
            id = s->nodes[id].parent;
        }
        at += (size_t)len;
    }
    qsort(refs, (size_t)n, sizeof *refs, cmp_stack);
    size_t rn = 0;
    for (int32_t i = 0; i < n; i++) {
        if (i && cmp_stack(&refs[i - 1], &refs[i]) == 0)
            continue;
        res[rn++] = refs[i].len;
        memcpy(res + rn, refs[i].p, (size_t)refs[i].len * sizeof *res);
        rn += (size_t)refs[i].len;
    }
    free(flat);
    free(refs);
    *out = res;
    *out_n = rn;
    return KVF_OK;
}

/* ---- compiling to states ---- */

typedef struct nfa_b {
    gstate *st;
    int32_t n, cap;
    int32_t *holes; /* a patch list: entries state*2+slot */
    kvf_status fail;
    char msg[KVF_ERR_MSG_MAX];
    const kvf_text_gb *gb;
    int32_t *ref_todo; /* rules referenced, to compile */
    int32_t todo_n, todo_cap;
    bool *queued; /* [gb->n_rules] */
} nfa_b;

/* A fragment: its start, and its dangling edges as a linked list threaded through them. */
typedef struct frag {
    int32_t start;
    int32_t head, tail; /* hole codes (state*2+slot) or -1 */
} frag;

static int32_t nfa_state(nfa_b *n, uint8_t kind, uint8_t lo, uint8_t hi, int32_t arg)
{
    if (n->fail != KVF_OK)
        return -1;
    if (n->n >= G_MAX_STATES) {
        n->fail = KVF_ERR_LIMIT;
        snprintf(n->msg, sizeof n->msg,
                 "grammar: too large: more than %d automaton states once repetitions are expanded",
                 G_MAX_STATES);
        return -1;
    }
    if (n->n == n->cap) {
        int32_t cap = n->cap ? n->cap * 2 : 256;
        gstate *st = realloc(n->st, (size_t)cap * sizeof *st);
        if (!st) {
            n->fail = KVF_ERR_NOMEM;
            snprintf(n->msg, sizeof n->msg, "grammar: out of memory");
            return -1;
        }
        n->st = st;
        n->cap = cap;
    }
    gstate *s = &n->st[n->n];
    s->kind = kind;
    s->lo = lo;
    s->hi = hi;
    s->next = -1;
    s->arg = arg;
    return n->n++;
}

/* the slot a hole code names; a hole's slot holds the next hole code while dangling */
static int32_t *hole_slot(nfa_b *n, int32_t code)
{
    gstate *s = &n->st[code >> 1];
    return (code & 1) ? &s->arg : &s->next;
}

static void patch(nfa_b *n, frag f, int32_t target)
{
    for (int32_t h = f.head; h >= 0;) {
        int32_t *slot = hole_slot(n, h);
        int32_t nx = *slot;
        *slot = target;
        h = nx;
    }
}

static frag frag_one(int32_t s, int slot)
{
    frag f = {s, s * 2 + slot, s * 2 + slot};
    return f;
}

static frag join_holes(nfa_b *n, frag a, frag b)
{
    /* a's holes then b's */
    if (a.head < 0) {
        a.head = b.head;
        a.tail = b.tail;
        return a;
    }
    if (b.head >= 0) {
        *hole_slot(n, a.tail) = b.head;
        a.tail = b.tail;
    }
    return a;
}

static frag frag_bad(void)
{
    frag f = {-1, -1, -1};
    return f;
}

static frag compile_x(nfa_b *n, const kvf_text_gx *x);

static frag compile_empty(nfa_b *n)
{
    int32_t s = nfa_state(n, ST_EPS, 0, 0, -1);
    if (s < 0)
        return frag_bad();
    n->st[s].next = -1;
    return frag_one(s, 0);
}

static frag compile_x(nfa_b *n, const kvf_text_gx *x)
{
    if (n->fail != KVF_OK)
        return frag_bad();
    switch (x->kind) {
    case GX_LIT: {
        if (x->n == 0)
            return compile_empty(n);
        frag f = frag_bad();
        int32_t prev = -1;
        for (size_t i = 0; i < x->n; i++) {
            int32_t s = nfa_state(n, ST_BYTE, x->bytes[i], x->bytes[i], 0);
            if (s < 0)
                return frag_bad();
            if (prev >= 0)
                n->st[prev].next = s;
            else
                f.start = s;
            prev = s;
        }
        n->st[prev].next = -1;
        f.head = f.tail = prev * 2;
        return f;
    }
    case GX_BYTES: {
        int32_t s = nfa_state(n, ST_BYTE, x->lo, x->hi, 0);
        if (s < 0)
            return frag_bad();
        n->st[s].next = -1;
        return frag_one(s, 0);
    }
    case GX_REF: {
        int32_t r = x->rule;
        if (!n->gb->bodies[r]) {
            char l[256];
            n->fail = KVF_ERR_INVALID;
            snprintf(n->msg, sizeof n->msg, "grammar: %s is referred to but never defined",
                     rule_label(l, sizeof l, n->gb->names, r));
            return frag_bad();
        }
        if (!n->queued[r]) {
            if (n->todo_n == n->todo_cap) {
                int32_t cap = n->todo_cap ? n->todo_cap * 2 : 16;
                int32_t *t = realloc(n->ref_todo, (size_t)cap * sizeof *t);
                if (!t) {
                    n->fail = KVF_ERR_NOMEM;
                    snprintf(n->msg, sizeof n->msg, "grammar: out of memory");
                    return frag_bad();
                }
                n->ref_todo = t;
                n->todo_cap = cap;
            }
            n->queued[r] = true;
            n->ref_todo[n->todo_n++] = r;
        }
        int32_t s = nfa_state(n, ST_REF, 0, 0, r);
        if (s < 0)
            return frag_bad();
        n->st[s].next = -1;
        return frag_one(s, 0);
    }
    case GX_SEQ: {
        if (x->n == 0)
            return compile_empty(n);
        frag f = compile_x(n, x->kids[0]);
        for (size_t i = 1; i < x->n && n->fail == KVF_OK; i++) {
            frag g = compile_x(n, x->kids[i]);
            if (n->fail != KVF_OK)
                break;
            patch(n, f, g.start);
            f.head = g.head;
            f.tail = g.tail;
        }
        return n->fail == KVF_OK ? f : frag_bad();
    }
    case GX_ALT: {
        if (x->n == 0) {
            int32_t s = nfa_state(n, ST_DEAD, 0, 0, -1);
            frag f = {s, -1, -1};
            return s < 0 ? frag_bad() : f;
        }
        /* a chain of splits: s1 -> kid0 | s2 -> kid1 | ... -> kid(n-1) */
        frag all = frag_bad();
        int32_t prev_split = -1;
        for (size_t i = 0; i < x->n; i++) {
            int32_t sp = -1;
            if (i + 1 < x->n) {
                sp = nfa_state(n, ST_EPS, 0, 0, -1);
                if (sp < 0)
                    return frag_bad();
            }
            frag k = compile_x(n, x->kids[i]);
            if (n->fail != KVF_OK)
                return frag_bad();
            int32_t entry = k.start;
            if (sp >= 0) {
                n->st[sp].next = k.start;
                entry = sp;
            }
            if (prev_split >= 0)
                n->st[prev_split].arg = entry;
            else
                all.start = entry;
            prev_split = sp;
            frag holes = {0, k.head, k.tail};
            if (i == 0) {
                all.head = k.head;
                all.tail = k.tail;
            } else {
                frag t = join_holes(n, all, holes);
                all.head = t.head;
                all.tail = t.tail;
            }
        }
        return all;
    }
    case GX_REP: {
        const kvf_text_gx *body = x->kids[0];
        frag f = frag_bad();
        bool have = false;
        int32_t copies = x->max < 0 ? (x->min > 1 ? x->min - 1 : 0) : x->min;
        for (int32_t i = 0; i < copies && n->fail == KVF_OK; i++) {
            frag g = compile_x(n, body);
            if (n->fail != KVF_OK)
                return frag_bad();
            if (have) {
                patch(n, f, g.start);
                f.head = g.head;
                f.tail = g.tail;
            } else {
                f = g;
                have = true;
            }
        }
        if (x->max < 0) {
            /* min <= 1: body*, or body+; min > 1: body^(min-1) body+ */
            frag g = compile_x(n, body);
            if (n->fail != KVF_OK)
                return frag_bad();
            int32_t loop = nfa_state(n, ST_EPS, 0, 0, -1);
            if (loop < 0)
                return frag_bad();
            patch(n, g, loop);
            n->st[loop].next = g.start;
            frag tail = {x->min == 0 ? loop : g.start, loop * 2 + 1, loop * 2 + 1};
            if (have) {
                patch(n, f, tail.start);
                f.head = tail.head;
                f.tail = tail.tail;
            } else {
                f = tail;
                have = true;
            }
        } else if (x->max > x->min) {
            /* (body (body (...)?)?)?: every skip goes straight to the end, so closures stay
             * small however many optional copies there are */
            frag opt = frag_bad();
            bool have_opt = false;
            frag chain = frag_bad();
            for (int32_t i = 0; i < x->max - x->min && n->fail == KVF_OK; i++) {
                frag g = compile_x(n, body);
                if (n->fail != KVF_OK)
                    return frag_bad();
                int32_t sp = nfa_state(n, ST_EPS, 0, 0, -1);
                if (sp < 0)
                    return frag_bad();
                n->st[sp].next = g.start;
                n->st[sp].arg = -1;
                frag skip = {sp, sp * 2 + 1, sp * 2 + 1};
                if (!have_opt) {
                    opt.start = sp;
                    opt.head = skip.head;
                    opt.tail = skip.tail;
                    have_opt = true;
                } else {
                    patch(n, chain, sp);
                    frag t = join_holes(n, opt, skip);
                    opt.head = t.head;
                    opt.tail = t.tail;
                }
                chain = g;
            }
            if (n->fail != KVF_OK)
                return frag_bad();
            /* the last copy's own end is an end too */
            frag t = join_holes(n, opt, chain);
            opt.head = t.head;
            opt.tail = t.tail;
            if (have) {
                patch(n, f, opt.start);
                f.head = opt.head;
                f.tail = opt.tail;
            } else {
                f = opt;
                have = true;
            }
        }
        if (!have)
            return compile_empty(n);
        return f;
    }
    }
    return frag_bad();
}

/* ---- analysis: closures, nullable rules, left recursion ---- */

typedef struct walk {
    int32_t *stack;
    uint32_t *seen; /* [n_st] stamps */
    uint32_t stamp;
} walk;

/* The BYTE, REF and FINAL states reachable from s over epsilon edges, appended to *out. */
/* live[s]: from state s its rule can still end (reach its FINAL) over bytes, epsilons and
 * references to rules that can end. Closures leave the other states out, so no byte a mask or
 * next_bytes allows leads into a dead end (an empty choice or class). Returns NULL when out of
 * memory; *root_ok: the root can end at all. */
static uint8_t *live_states(const kvf_text_grammar *g, const int32_t *rule_final, bool *root_ok)
{
    int32_t n = g->n_st, nr = g->n_rules;
    uint8_t *live = calloc((size_t)n, 1);
    bool *productive = calloc((size_t)nr, sizeof *productive);
    int32_t *rev_off = calloc((size_t)n + 2, sizeof *rev_off), *rev = NULL, *queue = NULL;
    if (!live || !productive || !rev_off)
        goto nomem;
    /* reverse edges, once; a REF edge counts only while its rule is productive, which the
     * fixpoint below decides: rules become productive as their starts become live */
    for (int32_t t = 0; t < n; t++) {
        const gstate *x = &g->st[t];
        if (x->kind == ST_BYTE || x->kind == ST_REF || x->kind == ST_EPS)
            rev_off[x->next + 1]++;
        if (x->kind == ST_EPS && x->arg >= 0)
            rev_off[x->arg + 1]++;
    }
    for (int32_t t = 0; t < n; t++)
        rev_off[t + 1] += rev_off[t];
    rev = malloc(((size_t)rev_off[n] + 1) * sizeof *rev);
    queue = malloc(((size_t)n + 1) * sizeof *queue);
    if (!rev || !queue)
        goto nomem;
    {
        int32_t *fill = malloc(((size_t)n + 1) * sizeof *fill);
        if (!fill)
            goto nomem;
        memcpy(fill, rev_off, (size_t)n * sizeof *fill);
        for (int32_t t = 0; t < n; t++) {
            const gstate *x = &g->st[t];
            if (x->kind == ST_BYTE || x->kind == ST_REF || x->kind == ST_EPS)
                rev[fill[x->next]++] = t;
            if (x->kind == ST_EPS && x->arg >= 0)
                rev[fill[x->arg]++] = t;
        }
        free(fill);
    }
    /* backwards from every FINAL; a REF state is live when its successor is and its rule is
     * productive; a rule turns productive when its start turns live, which may make REF states
     * waiting on it live: rescan them then (a few rounds at most in practice) */
    size_t qn = 0;
    for (int32_t r = 0; r < nr; r++)
        if (rule_final[r] >= 0) {
            live[rule_final[r]] = 1;
            queue[qn++] = rule_final[r];
        }
    for (;;) {
        while (qn) {
            int32_t t = queue[--qn];
            for (int32_t i = rev_off[t]; i < rev_off[t + 1]; i++) {
                int32_t u = rev[i];
                if (live[u] || (g->st[u].kind == ST_REF && !productive[g->st[u].arg]))
                    continue;
                live[u] = 1;
                queue[qn++] = u;
            }
        }
        bool changed = false;
        for (int32_t r = 0; r < nr; r++)
            if (!productive[r] && g->rule_start[r] >= 0 && live[g->rule_start[r]])
                productive[r] = changed = true;
        if (!changed)
            break;
        for (int32_t u = 0; u < n; u++) /* REF states whose rule just turned productive */
            if (!live[u] && g->st[u].kind == ST_REF && productive[g->st[u].arg] &&
                live[g->st[u].next]) {
                live[u] = 1;
                queue[qn++] = u;
            }
    }
    *root_ok = productive[nr - 1];
    free(productive);
    free(rev_off);
    free(rev);
    free(queue);
    return live;
nomem:
    free(live);
    free(productive);
    free(rev_off);
    free(rev);
    free(queue);
    return NULL;
}

static kvf_status closure_of(const gstate *st, const uint8_t *live, walk *w, int32_t s,
                             int32_t **out, size_t *n, size_t *cap)
{
    w->stamp++;
    size_t sp = 0;
    w->stack[sp++] = s;
    w->seen[s] = w->stamp;
    while (sp) {
        int32_t t = w->stack[--sp];
        const gstate *x = &st[t];
        if (x->kind == ST_EPS) {
            int32_t nx[2] = {x->next, x->arg};
            for (int k = 0; k < 2; k++) {
                if (nx[k] >= 0 && w->seen[nx[k]] != w->stamp) {
                    w->seen[nx[k]] = w->stamp;
                    w->stack[sp++] = nx[k];
                }
            }
        } else if (x->kind != ST_DEAD && live[t]) {
            if (*n == *cap) {
                if (*cap >= G_MAX_CLOSURE)
                    return KVF_ERR_LIMIT;
                size_t c = *cap ? *cap * 2 : 1024;
                int32_t *o = realloc(*out, c * sizeof *o);
                if (!o)
                    return KVF_ERR_NOMEM;
                *out = o;
                *cap = c;
            }
            (*out)[(*n)++] = t;
        }
    }
    return KVF_OK;
}

kvf_status kvf_text_gb_finish(kvf_text_gb *b, kvf_text_gx *root, kvf_text_grammar **out,
                              kvf_err *err)
{
    if (b->fail != KVF_OK)
        return kvf_err_set(err, b->fail, "%s", b->fail_msg);
    if (!root)
        return kvf_err_set(err, KVF_ERR_INVALID, "grammar: no root expression");
    kvf_status st = KVF_OK;
    kvf_text_grammar *g = calloc(1, sizeof *g);
    nfa_b n = {0};
    walk w = {0};
    int32_t *rule_final = NULL;
    bool *nullable = NULL;
    int32_t *color = NULL, *path = NULL, *clo = NULL;
    uint8_t *live = NULL;
    size_t clo_n = 0, clo_cap = 0;
    if (!g)
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    int32_t nr = b->n_rules + 1, root_rule = b->n_rules;
    n.gb = b;
    n.queued = calloc((size_t)nr, sizeof *n.queued);
    g->rule_start = malloc((size_t)nr * sizeof *g->rule_start);
    rule_final = malloc((size_t)nr * sizeof *rule_final);
    if (!n.queued || !g->rule_start || !rule_final) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
        goto fail;
    }
    g->n_rules = nr;
    for (int32_t r = 0; r < nr; r++)
        g->rule_start[r] = rule_final[r] = -1;

    /* 1. each rule the root reaches, to a Thompson NFA ending in its FINAL state */
    for (int32_t k = -1; k < n.todo_n; k++) {
        int32_t r = k < 0 ? root_rule : n.ref_todo[k];
        const kvf_text_gx *body = k < 0 ? root : b->bodies[r];
        frag f = compile_x(&n, body);
        int32_t fin = nfa_state(&n, ST_FINAL, 0, 0, r);
        if (n.fail != KVF_OK) {
            st = kvf_err_set(err, n.fail, "%s", n.msg);
            goto fail;
        }
        patch(&n, f, fin);
        g->rule_start[r] = f.start;
        rule_final[r] = fin;
    }
    g->st = n.st;
    g->n_st = n.n;
    n.st = NULL;

    w.stack = malloc((size_t)g->n_st * sizeof *w.stack);
    w.seen = calloc((size_t)g->n_st, sizeof *w.seen);
    if (!w.stack || !w.seen) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
        goto fail;
    }

    /* 2. nullable rules (a fixpoint), then the graph "R may enter S before consuming a byte":
     * a cycle in it is left recursion, which would make a step's expansion unbounded */
    nullable = calloc((size_t)nr, sizeof *nullable);
    color = calloc((size_t)nr, sizeof *color);
    path = malloc((size_t)nr * sizeof *path);
    if (!nullable || !color || !path) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
        goto fail;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int32_t r = 0; r < nr; r++) {
            if (g->rule_start[r] < 0 || nullable[r])
                continue;
            /* DFS over epsilon edges and REF edges of nullable rules */
            w.stamp++;
            size_t sp = 0;
            w.stack[sp++] = g->rule_start[r];
            w.seen[g->rule_start[r]] = w.stamp;
            while (sp && !nullable[r]) {
                const gstate *x = &g->st[w.stack[--sp]];
                int32_t nx[2] = {-1, -1};
                if (x->kind == ST_EPS) {
                    nx[0] = x->next;
                    nx[1] = x->arg;
                } else if (x->kind == ST_REF && nullable[x->arg]) {
                    nx[0] = x->next;
                } else if (x->kind == ST_FINAL) {
                    nullable[r] = true;
                    changed = true;
                }
                for (int k = 0; k < 2; k++)
                    if (nx[k] >= 0 && w.seen[nx[k]] != w.stamp) {
                        w.seen[nx[k]] = w.stamp;
                        w.stack[sp++] = nx[k];
                    }
            }
        }
    }
    /* iterative DFS over rules; color 1 on the path, 2 done; a rule's successors (the rules it
     * may enter before consuming a byte) are found by a walk when the DFS first needs them */
    int32_t **succ = calloc((size_t)nr, sizeof *succ);
    int32_t *succ_n = calloc((size_t)nr, sizeof *succ_n), *succ_i = calloc((size_t)nr, sizeof *succ_i);
    bool oom = !succ || !succ_n || !succ_i;
    int32_t cyc_from = -1, depth = 0;
    for (int32_t r0 = 0; r0 < nr && !oom && cyc_from < 0; r0++) {
        if (g->rule_start[r0] < 0 || color[r0])
            continue;
        depth = 0;
        path[depth++] = r0;
        color[r0] = 1;
        while (depth && cyc_from < 0 && !oom) {
            int32_t r = path[depth - 1];
            if (!succ[r]) {
                /* compute successors */
                size_t cap = 8, cnt = 0;
                int32_t *list = malloc(cap * sizeof *list);
                if (!list) {
                    oom = true;
                    break;
                }
                w.stamp++;
                size_t sp = 0;
                w.stack[sp++] = g->rule_start[r];
                w.seen[g->rule_start[r]] = w.stamp;
                while (sp) {
                    const gstate *x = &g->st[w.stack[--sp]];
                    int32_t nx[2] = {-1, -1};
                    if (x->kind == ST_EPS) {
                        nx[0] = x->next;
                        nx[1] = x->arg;
                    } else if (x->kind == ST_REF) {
                        if (cnt == cap) {
                            cap *= 2;
                            int32_t *l2 = realloc(list, cap * sizeof *l2);
                            if (!l2) {
                                oom = true;
                                break;
                            }
                            list = l2;
                        }
                        list[cnt++] = x->arg;
                        if (nullable[x->arg])
                            nx[0] = x->next;
                    }
                    for (int k = 0; k < 2; k++)
                        if (nx[k] >= 0 && w.seen[nx[k]] != w.stamp) {
                            w.seen[nx[k]] = w.stamp;
                            w.stack[sp++] = nx[k];
                        }
                }
                succ[r] = list;
                succ_n[r] = (int32_t)cnt;
                if (oom)
                    break;
            }
            if (succ_i[r] < succ_n[r]) {
                int32_t s = succ[r][succ_i[r]++];
                if (color[s] == 1) {
                    cyc_from = s;
                } else if (color[s] == 0) {
                    color[s] = 1;
                    path[depth++] = s;
                }
            } else {
                color[r] = 2;
                depth--;
            }
        }
    }
    for (int32_t r = 0; succ && r < nr; r++)
        free(succ[r]);
    free(succ);
    free(succ_n);
    free(succ_i);
    if (oom) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
        goto fail;
    }
    {
        if (cyc_from >= 0) {
            char msg[KVF_ERR_MSG_MAX], l[256];
            size_t at = 0;
            int32_t i = 0;
            while (path[i] != cyc_from)
                i++;
            at += (size_t)snprintf(msg, sizeof msg, "grammar: %s is left-recursive: ",
                                   cyc_from == root_rule ? "the root"
                                                         : rule_label(l, sizeof l, b->names, cyc_from));
            for (int32_t k = i; k < depth && at < sizeof msg; k++)
                at += (size_t)snprintf(msg + at, sizeof msg - at, "%s -> ",
                                       path[k] == root_rule ? "root"
                                                            : rule_label(l, sizeof l, b->names, path[k]));
            if (at < sizeof msg)
                snprintf(msg + at, sizeof msg - at, "%s without consuming a byte",
                         rule_label(l, sizeof l, b->names, cyc_from));
            st = kvf_err_set(err, KVF_ERR_INVALID, "%s", msg);
            goto fail;
        }
    }

    /* 3. the states from which the output can still end; a root that cannot end is refused */
    {
        bool root_ok = false;
        live = live_states(g, rule_final, &root_ok);
        if (!live) {
            st = kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
            goto fail;
        }
        if (!root_ok) {
            st = kvf_err_set(err, KVF_ERR_INVALID,
                             "grammar: no output can match it (an empty choice or class, or "
                             "rules that never end)");
            goto fail;
        }
    }

    /* 4. closures of the states stacks continue from: rule starts, BYTE and REF successors */
    g->clo_off = malloc((size_t)g->n_st * sizeof *g->clo_off);
    g->clo_len = calloc((size_t)g->n_st, sizeof *g->clo_len);
    if (!g->clo_off || !g->clo_len) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
        goto fail;
    }
    for (int32_t s = 0; s < g->n_st; s++)
        g->clo_off[s] = -1;
    for (int32_t s = -nr; s < g->n_st; s++) {
        int32_t t;
        if (s < 0)
            t = g->rule_start[s + nr];
        else if (g->st[s].kind == ST_BYTE || g->st[s].kind == ST_REF)
            t = g->st[s].next;
        else
            continue;
        if (t < 0 || g->clo_off[t] >= 0)
            continue;
        size_t at = clo_n;
        kvf_status cs = closure_of(g->st, live, &w, t, &clo, &clo_n, &clo_cap);
        if (cs == KVF_ERR_LIMIT) {
            st = kvf_err_set(err, KVF_ERR_LIMIT,
                             "grammar: too ambiguous: its epsilon closures pass %d states",
                             G_MAX_CLOSURE);
            goto fail;
        }
        if (cs != KVF_OK) {
            st = kvf_err_set(err, cs, "grammar: out of memory");
            goto fail;
        }
        g->clo_off[t] = (int32_t)at;
        g->clo_len[t] = (int32_t)(clo_n - at);
    }
    g->clo = clo;
    clo = NULL;
    if (!g->clo) {
        g->clo = malloc(sizeof *g->clo);
        if (!g->clo) {
            st = kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
            goto fail;
        }
    }

    /* 5. the initial state */
    {
        scratch s = {0};
        int32_t fn = 0;
        st = start_frontier(g, &s, &fn, err);
        if (st == KVF_OK)
            st = canonical(&s, 0, fn, &g->init, &g->init_n, err);
        scratch_fini(&s);
        if (st != KVF_OK)
            goto fail;
    }

    free(n.queued);
    free(n.ref_todo);
    free(w.stack);
    free(w.seen);
    free(rule_final);
    free(nullable);
    free(color);
    free(path);
    free(live);
    *out = g;
    return KVF_OK;
fail:
    free(n.st);
    free(n.queued);
    free(n.ref_todo);
    free(w.stack);
    free(w.seen);
    free(rule_final);
    free(nullable);
    free(color);
    free(path);
    free(clo);
    free(live);
    kvf_text_grammar_destroy(g);
    return st;
}

static void cache_clear(kvf_text_grammar *g)
{
    for (size_t i = 0; i < g->ents_cap; i++) {
        free(g->ents[i].key);
        free(g->ents[i].mask);
    }
    free(g->ents);
    g->ents = NULL;
    g->ents_cap = g->ents_n = g->cache_bytes = 0;
}

void kvf_text_grammar_destroy(kvf_text_grammar *g)
{
    if (!g)
        return;
    cache_clear(g);
    free(g->st);
    free(g->rule_start);
    free(g->clo_off);
    free(g->clo_len);
    free(g->clo);
    free(g->init);
    free(g);
}

void kvf_text_grammar_stats_get(const kvf_text_grammar *g, kvf_text_grammar_stats *out)
{
    out->n_states = g->n_st;
    out->cache_entries = g->ents_n;
    out->cache_bytes = g->cache_bytes;
    out->cache_hits = g->cache_hits;
    out->cache_misses = g->cache_misses;
}

kvf_status kvf_text_grammar_choice(const char *const *choices, const size_t *lens, size_t n,
                                   kvf_text_grammar **out, kvf_err *err)
{
    if (n == 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "guided_choice: no choices (give at least one)");
    kvf_text_gb *b = NULL;
    kvf_status st = kvf_text_gb_create(&b, err);
    if (st != KVF_OK)
        return st;
    kvf_text_gx *root = kvf_text_gx_choice(b, choices, lens, n);
    st = kvf_text_gb_finish(b, root, out, err);
    kvf_text_gb_destroy(b);
    if (st != KVF_OK)
        kvf_err_prefix(err, "guided_choice");
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* vocabulary                                                                                  */

/* Trie nodes in depth-first order: node i's subtree is [i + 1, end[i]), so its children are
 * i + 1, end[i + 1], end[end[i + 1]], ... Node 0 is the root (no byte). */
struct kvf_text_vocab {
    int32_t n_ids;
    int32_t n_nodes;
    uint8_t *byte;    /* [n_nodes] */
    int32_t *end;     /* [n_nodes] */
    int32_t *ids_off; /* [n_nodes + 1]: ids ending at node i are ids[ids_off[i] .. ids_off[i+1]) */
    int32_t *ids;
    int32_t max_len;
    /* token bytes for accept(id), copied so the vocabulary does not borrow the tokenizer */
    int64_t *tok_off; /* [n_ids + 1]; a token not allowed has tok_off[i] == tok_off[i+1] */
    uint8_t *tok_bytes;
    uint64_t serial; /* names this vocabulary in grammars' mask caches */
};

typedef struct tok_ent {
    const uint8_t *p;
    size_t len;
    int32_t id;
} tok_ent;

static int cmp_tok(const void *a, const void *b)
{
    const tok_ent *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, n);
    if (c)
        return c;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

kvf_status kvf_text_vocab_create(const kvf_text_tokenizer *tok, int32_t n_ids,
                                 kvf_text_vocab **out, kvf_err *err)
{
    if (n_ids <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "vocab: %d ids (want at least one)", (int)n_ids);
    /* A serial rather than the address: a grammar may outlive a vocabulary and meet a new one
     * allocated at the same place. */
    static _Atomic uint64_t serials;
    kvf_text_vocab *v = calloc(1, sizeof *v);
    tok_ent *ents = NULL;
    if (!v)
        return kvf_err_set(err, KVF_ERR_NOMEM, "vocab: out of memory");
    v->n_ids = n_ids;
    v->serial = ++serials;
    int32_t tn = kvf_text_tokenizer_vocab_size(tok);
    ents = malloc((size_t)n_ids * sizeof *ents);
    v->tok_off = calloc((size_t)n_ids + 1, sizeof *v->tok_off);
    if (!ents || !v->tok_off)
        goto nomem;
    size_t ne = 0, total = 0;
    for (int32_t id = 0; id < n_ids; id++) {
        size_t len = 0;
        const uint8_t *p = id < tn ? kvf_text_tokenizer_token_bytes(tok, id, &len) : NULL;
        if (!p || !len || kvf_text_tokenizer_is_special(tok, id))
            continue;
        ents[ne].p = p;
        ents[ne].len = len;
        ents[ne].id = id;
        ne++;
        total += len;
    }
    v->tok_bytes = malloc(total ? total : 1);
    if (!v->tok_bytes)
        goto nomem;
    {
        size_t at = 0, e = 0;
        for (int32_t id = 0; id < n_ids; id++) {
            v->tok_off[id] = (int64_t)at;
            if (e < ne && ents[e].id == id) {
                memcpy(v->tok_bytes + at, ents[e].p, ents[e].len);
                at += ents[e].len;
                e++;
            }
        }
        v->tok_off[n_ids] = (int64_t)at;
    }
    qsort(ents, ne, sizeof *ents, cmp_tok);
    /* nodes: at most one per byte, plus the root */
    size_t cap = total + 1;
    v->byte = malloc(cap);
    v->end = malloc(cap * sizeof *v->end);
    v->ids_off = malloc((cap + 1) * sizeof *v->ids_off);
    v->ids = malloc((ne ? ne : 1) * sizeof *v->ids);
    int32_t *path = malloc((total + 2) * sizeof *path); /* open nodes by depth */
    if (!v->byte || !v->end || !v->ids_off || !v->ids || !path) {
        free(path);
        goto nomem;
    }
    int32_t nn = 1, nid = 0;
    size_t open = 1; /* path[0] = root */
    path[0] = 0;
    v->byte[0] = 0;
    v->ids_off[0] = 0;
    const uint8_t *prev = NULL;
    size_t prev_len = 0;
    for (size_t i = 0; i < ne; i++) {
        const tok_ent *t = &ents[i];
        size_t common = 0;
        while (prev && common < prev_len && common < t->len && prev[common] == t->p[common])
            common++;
        /* close nodes deeper than the common prefix */
        while (open > common + 1) {
            open--;
            v->end[path[open]] = nn;
        }
        for (size_t k = common; k < t->len; k++) {
            int32_t id = nn++;
            v->byte[id] = t->p[k];
            v->ids_off[id] = nid;
            path[open++] = id;
        }
        v->ids[nid++] = t->id;
        if ((int32_t)t->len > v->max_len)
            v->max_len = (int32_t)t->len;
        prev = t->p;
        prev_len = t->len;
    }
    while (open > 0) {
        open--;
        v->end[path[open]] = nn;
    }
    v->ids_off[nn] = nid;
    /* ids_off[i + 1] - ids_off[i] counts node i's ids: in sorted order a token's string ends
     * at the node created last (or, for equal strings, at the same one), so ids are appended in
     * node order */
    v->n_nodes = nn;
    /* shared prefixes leave the arrays, sized for one node per byte, partly unused */
    uint8_t *byte = realloc(v->byte, (size_t)nn);
    int32_t *end = realloc(v->end, (size_t)nn * sizeof *end);
    int32_t *ids_off = realloc(v->ids_off, ((size_t)nn + 1) * sizeof *ids_off);
    if (byte)
        v->byte = byte;
    if (end)
        v->end = end;
    if (ids_off)
        v->ids_off = ids_off;
    free(path);
    free(ents);
    *out = v;
    return KVF_OK;
nomem:
    free(ents);
    kvf_text_vocab_destroy(v);
    return kvf_err_set(err, KVF_ERR_NOMEM, "vocab: out of memory");
}

void kvf_text_vocab_destroy(kvf_text_vocab *v)
{
    if (!v)
        return;
    free(v->byte);
    free(v->end);
    free(v->ids_off);
    free(v->ids);
    free(v->tok_off);
    free(v->tok_bytes);
    free(v);
}

int32_t kvf_text_vocab_size(const kvf_text_vocab *v) { return v->n_ids; }

size_t kvf_text_vocab_mask_words(const kvf_text_vocab *v) { return ((size_t)v->n_ids + 31) / 32; }

/* ------------------------------------------------------------------------------------------ */
/* matcher                                                                                     */

struct kvf_text_matcher {
    kvf_text_grammar *g;
    const kvf_text_vocab *v;
    int32_t *end_ids;
    size_t n_end;
    int32_t *state; /* canonical */
    size_t state_n;
    bool accepting; /* the state holds the empty stack */
    int32_t n_stacks;
    bool ended; /* an end id was accepted */
    scratch sc;
    /* the mask walk's per-depth bookkeeping, sized to the vocabulary's longest token */
    struct walk_frame *frames;
};

typedef struct walk_frame {
    size_t fr_off; /* the frontier in s->fr, when fid < 0 */
    int32_t fr_n;
    int32_t fid; /* the interned frontier, or -1 */
    int32_t node;  /* the trie node whose children are being visited */
    int32_t child; /* the next child to visit */
    int32_t mark;  /* scratch nodes to release to when leaving */
    uint64_t bits[4];
} walk_frame;

static void set_state(kvf_text_matcher *m, int32_t *state, size_t n)
{
    free(m->state);
    m->state = state;
    m->state_n = n;
    m->n_stacks = 0;
    m->accepting = false;
    for (size_t i = 0; i < n; i += 1 + (size_t)state[i]) {
        m->n_stacks++;
        if (state[i] == 0)
            m->accepting = true;
    }
}

static kvf_status copy_init(kvf_text_matcher *m, kvf_err *err)
{
    int32_t *s = malloc((m->g->init_n ? m->g->init_n : 1) * sizeof *s);
    if (!s)
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    memcpy(s, m->g->init, m->g->init_n * sizeof *s);
    set_state(m, s, m->g->init_n);
    m->ended = false;
    return KVF_OK;
}

kvf_status kvf_text_matcher_create(kvf_text_grammar *g, const kvf_text_vocab *v,
                                   const int32_t *end_ids, size_t n_end,
                                   kvf_text_matcher **out, kvf_err *err)
{
    kvf_text_matcher *m = calloc(1, sizeof *m);
    if (!m)
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    m->g = g;
    m->v = v;
    m->n_end = n_end;
    m->end_ids = malloc((n_end ? n_end : 1) * sizeof *m->end_ids);
    m->frames = v ? malloc(((size_t)v->max_len + 2) * sizeof *m->frames) : NULL;
    if (!m->end_ids || (v && !m->frames)) {
        kvf_text_matcher_destroy(m);
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    }
    if (n_end)
        memcpy(m->end_ids, end_ids, n_end * sizeof *end_ids);
    kvf_status st = copy_init(m, err);
    if (st != KVF_OK) {
        kvf_text_matcher_destroy(m);
        return st;
    }
    *out = m;
    return KVF_OK;
}

void kvf_text_matcher_destroy(kvf_text_matcher *m)
{
    if (!m)
        return;
    scratch_fini(&m->sc);
    free(m->state);
    free(m->end_ids);
    free(m->frames);
    free(m);
}

kvf_status kvf_text_matcher_clone(const kvf_text_matcher *m, kvf_text_matcher **out, kvf_err *err)
{
    kvf_text_matcher *c;
    kvf_status st = kvf_text_matcher_create(m->g, m->v, m->end_ids, m->n_end, &c, err);
    if (st != KVF_OK)
        return st;
    int32_t *s = malloc((m->state_n ? m->state_n : 1) * sizeof *s);
    if (!s) {
        kvf_text_matcher_destroy(c);
        return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
    }
    memcpy(s, m->state, m->state_n * sizeof *s);
    set_state(c, s, m->state_n);
    c->ended = m->ended;
    *out = c;
    return KVF_OK;
}

void kvf_text_matcher_reset(kvf_text_matcher *m)
{
    /* Reset cannot report, so it reuses the state's buffer when that is large enough (states
     * only grow from the initial one in practice) and falls back to a new one. */
    int32_t *s = m->state;
    if (!s || m->state_n < m->g->init_n) {
        s = malloc((m->g->init_n ? m->g->init_n : 1) * sizeof *s);
        if (!s) {
            m->ended = true; /* out of memory: allow nothing rather than a wrong state */
            return;
        }
    } else {
        m->state = NULL;
    }
    memcpy(s, m->g->init, m->g->init_n * sizeof *s);
    set_state(m, s, m->g->init_n);
    m->ended = false;
}

bool kvf_text_matcher_accepting(const kvf_text_matcher *m) { return !m->ended && m->accepting; }

bool kvf_text_matcher_done(const kvf_text_matcher *m)
{
    return m->ended || (m->accepting && m->n_stacks == 1);
}

kvf_status kvf_text_matcher_accept_bytes(kvf_text_matcher *m, const void *bytes, size_t n,
                                         kvf_err *err)
{
    if (m->ended)
        return kvf_err_set(err, KVF_ERR_INVALID, "grammar: the output already ended");
    if (n == 0)
        return KVF_OK;
    scratch *s = &m->sc;
    int32_t fn;
    kvf_status st = load_state(s, m->state, m->state_n, &fn, err);
    if (st != KVF_OK)
        return st;
    size_t off = 0;
    const uint8_t *p = bytes;
    for (size_t i = 0; i < n; i++) {
        size_t noff = s->fr_n;
        int32_t nn;
        st = step(m->g, s, off, fn, p[i], &nn, err);
        if (st != KVF_OK)
            return st;
        if (nn == 0)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "grammar: byte 0x%02x at %zu cannot follow the output so far", p[i],
                               i);
        /* keep the frontier buffer from growing with the input: move the new frontier down */
        memmove(s->fr, s->fr + noff, (size_t)nn * sizeof *s->fr);
        s->fr_n = (size_t)nn;
        off = 0;
        fn = nn;
    }
    int32_t *state;
    size_t state_n;
    st = canonical(s, off, fn, &state, &state_n, err);
    if (st != KVF_OK)
        return st;
    set_state(m, state, state_n);
    return KVF_OK;
}

static bool is_end_id(const kvf_text_matcher *m, int32_t id)
{
    for (size_t i = 0; i < m->n_end; i++)
        if (m->end_ids[i] == id)
            return true;
    return false;
}

kvf_status kvf_text_matcher_accept(kvf_text_matcher *m, int32_t id, kvf_err *err)
{
    if (m->ended)
        return kvf_err_set(err, KVF_ERR_INVALID, "grammar: token %d after the output ended",
                           (int)id);
    if (is_end_id(m, id)) {
        if (!m->accepting)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "grammar: end token %d before the output is complete", (int)id);
        m->ended = true;
        return KVF_OK;
    }
    const kvf_text_vocab *v = m->v;
    if (!v || id < 0 || id >= v->n_ids || v->tok_off[id] == v->tok_off[id + 1])
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "grammar: token %d is never allowed (out of range, special or empty)",
                           (int)id);
    kvf_status st = kvf_text_matcher_accept_bytes(m, v->tok_bytes + v->tok_off[id],
                                                  (size_t)(v->tok_off[id + 1] - v->tok_off[id]), err);
    if (st == KVF_ERR_INVALID)
        return kvf_err_set(err, KVF_ERR_INVALID, "grammar: token %d cannot follow the output so far",
                           (int)id);
    return st;
}

static inline void bits_of(const kvf_text_grammar *g, const scratch *s, const int32_t *f,
                           int32_t n, uint64_t bits[4])
{
    bits[0] = bits[1] = bits[2] = bits[3] = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t id = f[i];
        if (id < 0)
            continue;
        const gstate *st = &g->st[s->nodes[id].pos];
        unsigned lo = st->lo, hi = st->hi;
        for (unsigned w = lo >> 6; w <= hi >> 6; w++) {
            unsigned a = w == lo >> 6 ? lo & 63 : 0, z = w == hi >> 6 ? hi & 63 : 63;
            uint64_t m = (z == 63 ? ~0ull : ((1ull << (z + 1)) - 1)) & ~((1ull << a) - 1);
            bits[w] |= m;
        }
    }
}

/* Limits of the memo; past them a walk goes on without it (correct, slower). */
#define MEMO_MAX_NODES (1 << 18)
#define MEMO_MAX_FRONTIERS (1 << 16)
#define MEMO_MAX_ENTRIES (1u << 20)

static void memo_reset(scratch *s)
{
    s->fz_n = 0;
    s->fe_n = 0;
    if (s->fe_tab)
        memset(s->fe_tab, 0, s->fe_tab_cap * sizeof *s->fe_tab);
    if (s->mo_key)
        memset(s->mo_key, 0, s->mo_cap * sizeof *s->mo_key);
    s->mo_n = 0;
}

static uint32_t hash_frontier(const int32_t *f, int32_t n)
{
    uint64_t h = 0x9E3779B97F4A7C15ull;
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)f[i]) * 0xff51afd7ed558ccdull;
    return (uint32_t)(h >> 32);
}

/* The id of frontier f (interned by content), -1 past the memo's limits or out of memory. */
static int32_t fz_intern(const kvf_text_grammar *g, scratch *s, const int32_t *f, int32_t n)
{
    if (s->fe_n >= MEMO_MAX_FRONTIERS)
        return -1;
    if (!s->fe_tab || (uint32_t)(s->fe_n + 1) * 2 > s->fe_tab_cap) {
        uint32_t cap = s->fe_tab_cap ? s->fe_tab_cap * 2 : 256;
        int32_t *t = calloc(cap, sizeof *t);
        if (!t)
            return -1;
        for (int32_t i = 0; i < s->fe_n; i++) {
            uint32_t h = s->fe[i].hash & (cap - 1);
            while (t[h])
                h = (h + 1) & (cap - 1);
            t[h] = i + 1;
        }
        free(s->fe_tab);
        s->fe_tab = t;
        s->fe_tab_cap = cap;
    }
    uint32_t hash = hash_frontier(f, n), mask = s->fe_tab_cap - 1, h = hash & mask;
    for (; s->fe_tab[h]; h = (h + 1) & mask) {
        const fz_ent *e = &s->fe[s->fe_tab[h] - 1];
        if (e->hash == hash && e->n == n && !memcmp(s->fz + e->off, f, (size_t)n * sizeof *f))
            return s->fe_tab[h] - 1;
    }
    if (s->fe_n == s->fe_cap) {
        int32_t cap = s->fe_cap ? s->fe_cap * 2 : 64;
        fz_ent *fe = realloc(s->fe, (size_t)cap * sizeof *fe);
        if (!fe)
            return -1;
        s->fe = fe;
        s->fe_cap = cap;
    }
    if (s->fz_n + (size_t)n > s->fz_cap) {
        size_t cap = s->fz_cap ? s->fz_cap : 1024;
        while (cap < s->fz_n + (size_t)n)
            cap *= 2;
        int32_t *fz = realloc(s->fz, cap * sizeof *fz);
        if (!fz)
            return -1;
        s->fz = fz;
        s->fz_cap = cap;
    }
    int32_t id = s->fe_n++;
    fz_ent *e = &s->fe[id];
    e->off = s->fz_n;
    e->n = n;
    e->hash = hash;
    memcpy(s->fz + s->fz_n, f, (size_t)n * sizeof *f);
    s->fz_n += (size_t)n;
    bits_of(g, s, f, n, e->bits);
    s->fe_tab[h] = id + 1;
    return id;
}

#define MEMO_ABSENT INT32_MIN

static inline int32_t memo_get(const scratch *s, int32_t fid, uint8_t b)
{
    if (!s->mo_cap)
        return MEMO_ABSENT;
    uint32_t key = (uint32_t)fid * 256u + b + 1u, mask = s->mo_cap - 1;
    for (uint32_t h = (key * 0x9E3779B1u) & mask; s->mo_key[h]; h = (h + 1) & mask)
        if (s->mo_key[h] == key)
            return s->mo_val[h];
    return MEMO_ABSENT;
}

/* false past the memo's limits or out of memory */
static bool memo_put(scratch *s, int32_t fid, uint8_t b, int32_t next)
{
    if (s->mo_n >= MEMO_MAX_ENTRIES)
        return false;
    if ((s->mo_n + 1) * 2 > s->mo_cap) {
        uint32_t cap = s->mo_cap ? s->mo_cap * 2 : 1024;
        uint32_t *k = calloc(cap, sizeof *k);
        int32_t *v = malloc(cap * sizeof *v);
        if (!k || !v) {
            free(k);
            free(v);
            return false;
        }
        for (uint32_t i = 0; i < s->mo_cap; i++) {
            if (!s->mo_key[i])
                continue;
            uint32_t h = (s->mo_key[i] * 0x9E3779B1u) & (cap - 1);
            while (k[h])
                h = (h + 1) & (cap - 1);
            k[h] = s->mo_key[i];
            v[h] = s->mo_val[i];
        }
        free(s->mo_key);
        free(s->mo_val);
        s->mo_key = k;
        s->mo_val = v;
        s->mo_cap = cap;
    }
    uint32_t key = (uint32_t)fid * 256u + b + 1u, mask = s->mo_cap - 1, h = (key * 0x9E3779B1u) & mask;
    while (s->mo_key[h])
        h = (h + 1) & mask;
    s->mo_key[h] = key;
    s->mo_val[h] = next;
    s->mo_n++;
    return true;
}

/* The mask of the current state without end ids: a depth-first walk of the trie, each frame
 * holding the frontier its path's bytes reach. While the memo is on, frontiers are interned and
 * scratch nodes are kept (memo entries refer to them); past the memo's limits the walk turns it
 * off and goes on releasing each subtree's nodes when it leaves it. */
static kvf_status mask_walk(kvf_text_matcher *m, uint32_t *mask, kvf_err *err)
{
    const kvf_text_vocab *v = m->v;
    const kvf_text_grammar *g = m->g;
    scratch *s = &m->sc;
    memset(mask, 0, kvf_text_vocab_mask_words(v) * sizeof *mask);
    int32_t fn;
    kvf_status st = load_state(s, m->state, m->state_n, &fn, err);
    if (st != KVF_OK)
        return st;
    memo_reset(s);
    bool memo = true;
    walk_frame *f = m->frames;
    int32_t d = 0;
    f[0].fr_off = 0;
    f[0].fr_n = fn;
    f[0].fid = fz_intern(g, s, s->fr, fn);
    if (f[0].fid < 0)
        memo = false;
    f[0].node = 0;
    f[0].child = 1;
    f[0].mark = s->n;
    bits_of(g, s, s->fr, fn, f[0].bits);
    for (;;) {
        walk_frame *cf = &f[d];
        int32_t c = cf->child;
        if (c >= v->end[cf->node]) {
            if (d == 0)
                break;
            d--;
            if (!memo) { /* release what the child frame made */
                s->n = f[d].mark;
                s->fr_n = f[d].fid >= 0 ? 0 : f[d].fr_off + (size_t)f[d].fr_n;
            }
            continue;
        }
        cf->child = v->end[c];
        uint8_t b = v->byte[c];
        if (!((cf->bits[b >> 6] >> (b & 63)) & 1))
            continue;
        cf->mark = s->n;
        int32_t next = memo && cf->fid >= 0 ? memo_get(s, cf->fid, b) : MEMO_ABSENT;
        size_t noff = s->fr_n;
        int32_t nn = 0;
        if (next == MEMO_ABSENT) {
            const int32_t *in;
            if (cf->fid >= 0) {
                in = s->fz + s->fe[cf->fid].off;
            } else {
                if (fr_reserve(s, KVF_TEXT_GRAMMAR_MAX_STACKS + 2) != KVF_OK)
                    return kvf_err_set(err, KVF_ERR_NOMEM, "grammar: out of memory");
                in = s->fr + cf->fr_off;
            }
            st = step_from(g, s, in, cf->fid >= 0 ? s->fe[cf->fid].n : cf->fr_n, b, &nn, err);
            if (st != KVF_OK)
                return st;
            if (memo && cf->fid >= 0) {
                next = nn ? fz_intern(g, s, s->fr + noff, nn) : -1;
                if ((nn && next < 0) || s->n > MEMO_MAX_NODES || !memo_put(s, cf->fid, b, next)) {
                    memo = false; /* from here on, frames carry their frontiers in s->fr */
                    next = MEMO_ABSENT;
                } else {
                    s->fr_n = noff;
                }
            }
        }
        bool live = next == MEMO_ABSENT ? nn > 0 : next >= 0;
        if (!live) {
            if (!memo) {
                s->n = cf->mark;
                s->fr_n = noff;
            }
            continue;
        }
        for (int32_t i = v->ids_off[c]; i < v->ids_off[c + 1]; i++) {
            int32_t id = v->ids[i];
            mask[id >> 5] |= 1u << (id & 31);
        }
        if (v->end[c] > c + 1) {
            walk_frame *nf = &f[d + 1];
            if (next != MEMO_ABSENT) {
                memcpy(nf->bits, s->fe[next].bits, sizeof nf->bits);
            } else {
                bits_of(g, s, s->fr + noff, nn, nf->bits);
            }
            if (nf->bits[0] | nf->bits[1] | nf->bits[2] | nf->bits[3]) {
                nf->fid = next != MEMO_ABSENT ? next : -1;
                nf->fr_off = noff;
                nf->fr_n = nn;
                nf->node = c;
                nf->child = c + 1;
                nf->mark = s->n;
                d++;
                continue;
            }
        }
        if (!memo) {
            s->n = cf->mark;
            s->fr_n = noff;
        }
    }
    /* a pathological walk may have grown the scratch: give it back rather than keep it per
     * matcher */
    if ((size_t)s->cap * sizeof *s->nodes + s->fz_cap * sizeof *s->fz + s->mo_cap * 8u >
        ((size_t)16 << 20))
        scratch_fini(s);
    return KVF_OK;
}

static uint64_t hash_state(const int32_t *s, size_t n, uint64_t seed)
{
    uint64_t h = 0xcbf29ce484222325ull ^ seed;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint32_t)s[i];
        h *= 0x100000001b3ull;
        h ^= h >> 29;
    }
    return h | 1; /* 0 marks an empty slot */
}

static cache_ent *cache_find(kvf_text_grammar *g, uint64_t vocab, uint64_t h, const int32_t *key,
                             size_t n)
{
    if (!g->ents_cap)
        return NULL;
    size_t mask = g->ents_cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        cache_ent *e = &g->ents[i];
        if (!e->hash)
            return NULL;
        if (e->hash == h && e->vocab == vocab && e->key_n == n &&
            !memcmp(e->key, key, n * sizeof *key))
            return e;
    }
}

/* Adds a copy of (key, mask) to the cache; a failure only means it is not cached. */
static void cache_put(kvf_text_grammar *g, uint64_t vocab, uint64_t h, const int32_t *key,
                      size_t n, const uint32_t *mask, size_t words)
{
    size_t bytes = n * sizeof *key + words * sizeof *mask + sizeof(cache_ent) * 2;
    if (g->cache_bytes + bytes > G_CACHE_MAX_BYTES)
        cache_clear(g);
    if (bytes > G_CACHE_MAX_BYTES)
        return;
    if ((g->ents_n + 1) * 2 > g->ents_cap) {
        size_t cap = g->ents_cap ? g->ents_cap * 2 : 64;
        cache_ent *ne = calloc(cap, sizeof *ne);
        if (!ne)
            return;
        for (size_t i = 0; i < g->ents_cap; i++) {
            if (!g->ents[i].hash)
                continue;
            size_t j = g->ents[i].hash & (cap - 1);
            while (ne[j].hash)
                j = (j + 1) & (cap - 1);
            ne[j] = g->ents[i];
        }
        g->cache_bytes += (cap - g->ents_cap) * sizeof *ne;
        free(g->ents);
        g->ents = ne;
        g->ents_cap = cap;
    }
    int32_t *k = malloc(n * sizeof *k + 1);
    uint32_t *mk = malloc(words * sizeof *mk);
    if (!k || !mk) {
        free(k);
        free(mk);
        return;
    }
    memcpy(k, key, n * sizeof *k);
    memcpy(mk, mask, words * sizeof *mk);
    size_t j = h & (g->ents_cap - 1);
    while (g->ents[j].hash)
        j = (j + 1) & (g->ents_cap - 1);
    g->ents[j].hash = h;
    g->ents[j].vocab = vocab;
    g->ents[j].key = k;
    g->ents[j].key_n = n;
    g->ents[j].mask = mk;
    g->ents_n++;
    g->cache_bytes += n * sizeof *k + words * sizeof *mk;
}

kvf_status kvf_text_matcher_mask(kvf_text_matcher *m, uint32_t *mask, kvf_err *err)
{
    const kvf_text_vocab *v = m->v;
    if (!v)
        return kvf_err_set(err, KVF_ERR_INVALID, "grammar: a matcher without a vocabulary has no mask");
    size_t words = kvf_text_vocab_mask_words(v);
    if (m->ended) {
        memset(mask, 0, words * sizeof *mask);
        return KVF_OK;
    }
    kvf_text_grammar *g = m->g;
    uint64_t h = hash_state(m->state, m->state_n, v->serial);
    cache_ent *e = cache_find(g, v->serial, h, m->state, m->state_n);
    if (e) {
        g->cache_hits++;
        memcpy(mask, e->mask, words * sizeof *mask);
    } else {
        g->cache_misses++;
        kvf_status st = mask_walk(m, mask, err);
        if (st != KVF_OK)
            return st;
        cache_put(g, v->serial, h, m->state, m->state_n, mask, words);
    }
    /* end ids: exactly where the output is complete */
    for (size_t i = 0; i < m->n_end; i++) {
        int32_t id = m->end_ids[i];
        if (id < 0 || id >= v->n_ids)
            continue;
        if (m->accepting)
            mask[id >> 5] |= 1u << (id & 31);
        else
            mask[id >> 5] &= ~(1u << (id & 31));
    }
    return KVF_OK;
}

kvf_status kvf_text_matcher_next_bytes(kvf_text_matcher *m, uint32_t set[8], kvf_err *err)
{
    memset(set, 0, 8 * sizeof *set);
    if (m->ended)
        return KVF_OK;
    scratch *s = &m->sc;
    int32_t fn;
    kvf_status st = load_state(s, m->state, m->state_n, &fn, err);
    if (st != KVF_OK)
        return st;
    uint64_t cand[4];
    bits_of(m->g, s, s->fr, fn, cand);
    for (unsigned b = 0; b < 256; b++) {
        if (!((cand[b >> 6] >> (b & 63)) & 1))
            continue;
        /* a BYTE state may lead only into a dead end (an empty choice): take one step to know */
        int32_t mark = s->n, nn;
        size_t noff = s->fr_n;
        st = step(m->g, s, 0, fn, (uint8_t)b, &nn, err);
        if (st != KVF_OK)
            return st;
        if (nn)
            set[b >> 5] |= 1u << (b & 31);
        s->n = mark;
        s->fr_n = noff;
    }
    return KVF_OK;
}
