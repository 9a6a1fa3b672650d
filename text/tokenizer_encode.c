/* tokenizer_encode.c: text -> ids. Added tokens are cut out of the raw text first; each segment
 * between them is normalized (NFC etc. through utf8proc, Prepend, Replace), pre-tokenized into
 * pieces (regex Split through PCRE2, ByteLevel, Metaspace, Digits), and each piece goes through
 * BPE with a priority queue over a linked list of symbols (O(n log n) per piece). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "text/tokenizer_internal.h"

/* Pieces of one segment: byte ranges of one of enc's two buffers. */
typedef struct pieces {
    size_t *off, *len;
    size_t n, cap;
} pieces;

typedef struct heap_ent {
    int32_t rank, pos, a, b;
} heap_ent;

/* Everything one encode call allocates, reused across segments and pieces. */
typedef struct enc {
    const kvf_text_tokenizer *tok;
    int32_t *ids;
    size_t n_ids, cap_ids;
    kvf_sbuf norm, tmp;
    kvf_sbuf bufs[2]; /* piece bytes: a content-changing step writes the other one */
    pieces pl[2];
    pcre2_match_data *md;
    /* BPE scratch, sized to the longest piece */
    int32_t *sym, *prev, *next;
    heap_ent *heap;
    size_t sym_cap, heap_cap, n_heap;
    kvf_err *err;
    bool oom;
    int re_error; /* a PCRE2 error other than "no match", 0 when none */
} enc;

static void push_id(enc *e, int32_t id)
{
    if (e->n_ids == e->cap_ids) {
        size_t cap = e->cap_ids ? e->cap_ids * 2 : 64;
        int32_t *p = realloc(e->ids, cap * sizeof *p);
        if (!p) {
            e->oom = true;
            return;
        }
        e->ids = p;
        e->cap_ids = cap;
    }
    e->ids[e->n_ids++] = id;
}

static void pieces_fini(pieces *p)
{
    free(p->off);
    free(p->len);
}

static void pieces_add(enc *e, pieces *p, size_t off, size_t len)
{
    if (len == 0)
        return;
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        size_t *o = realloc(p->off, cap * sizeof *o);
        if (o)
            p->off = o;
        size_t *l = realloc(p->len, cap * sizeof *l);
        if (l)
            p->len = l;
        if (!o || !l) {
            e->oom = true;
            return;
        }
        p->cap = cap;
    }
    p->off[p->n] = off;
    p->len[p->n++] = len;
}

/* ---- normalization ---- */

static bool all_ascii(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80)
            return false;
    return true;
}

/* Applies one normalizer to e->norm (in place through e->tmp). */
static void normalize_step(enc *e, const kvf_text_tok_norm *nm)
{
    kvf_sbuf *cur = &e->norm, *out = &e->tmp;
    const char *s = cur->data ? cur->data : "";
    size_t n = cur->len;
    kvf_sbuf_reset(out);
    switch (nm->kind) {
    case KVF_TEXT_TOK_NORM_NFC:
    case KVF_TEXT_TOK_NORM_NFD:
    case KVF_TEXT_TOK_NORM_NFKC:
    case KVF_TEXT_TOK_NORM_NFKD: {
        if (all_ascii(s, n))
            return; /* ASCII is invariant under every normal form */
        int opts = UTF8PROC_STABLE;
        if (nm->kind == KVF_TEXT_TOK_NORM_NFC || nm->kind == KVF_TEXT_TOK_NORM_NFKC)
            opts |= UTF8PROC_COMPOSE;
        else
            opts |= UTF8PROC_DECOMPOSE;
        if (nm->kind == KVF_TEXT_TOK_NORM_NFKC || nm->kind == KVF_TEXT_TOK_NORM_NFKD)
            opts |= UTF8PROC_COMPAT;
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                          (utf8proc_option_t)opts);
        if (r < 0) { /* input was validated; only memory can fail here */
            free(dst);
            e->oom = true;
            return;
        }
        kvf_sbuf_append(out, dst, (size_t)r);
        free(dst);
        break;
    }
    case KVF_TEXT_TOK_NORM_LOWERCASE:
        for (size_t i = 0; i < n;) {
            utf8proc_int32_t cp;
            utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &cp);
            if (k <= 0)
                break;
            char b[4];
            kvf_sbuf_append(out, b, kvf_text_utf8_put((uint32_t)utf8proc_tolower(cp), b));
            i += (size_t)k;
        }
        break;
    case KVF_TEXT_TOK_NORM_PREPEND:
        if (n == 0)
            return;
        kvf_sbuf_append(out, nm->a, nm->a_len);
        kvf_sbuf_append(out, s, n);
        break;
    case KVF_TEXT_TOK_NORM_REPLACE: {
        const char *hit = n >= nm->a_len ? memmem(s, n, nm->a, nm->a_len) : NULL;
        if (!hit)
            return;
        size_t i = 0;
        while (hit) {
            kvf_sbuf_append(out, s + i, (size_t)(hit - (s + i)));
            kvf_sbuf_append(out, nm->b, nm->b_len);
            i = (size_t)(hit - s) + nm->a_len;
            hit = n - i >= nm->a_len ? memmem(s + i, n - i, nm->a, nm->a_len) : NULL;
        }
        kvf_sbuf_append(out, s + i, n - i);
        break;
    }
    }
    kvf_sbuf t = *cur;
    *cur = *out;
    *out = t;
}

/* ---- pre-tokenization: in -> out ---- */

static size_t utf8_step(const char *s, size_t n)
{
    size_t k = kvf_text_utf8_len((const uint8_t *)s, n);
    return k ? k : 1;
}

/* Splits each piece of in by the regex into out (same buffer: splitting moves no bytes). */
static void pre_split(enc *e, const kvf_text_tok_pre *p, const char *buf, const pieces *in, pieces *out)
{
    for (size_t k = 0; k < in->n; k++) {
        size_t base = in->off[k], n = in->len[k], last = 0, start = 0;
        bool pending_next = false; /* MERGED_NEXT: a match waits for the next piece */
        size_t pend_off = 0;
        while (start <= n) {
            int rc = pcre2_match(p->re, (PCRE2_SPTR)(buf + base), n, start, PCRE2_NO_UTF_CHECK, e->md, NULL);
            if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) /* e.g. the JIT stack: try the interpreter */
                rc = pcre2_match(p->re, (PCRE2_SPTR)(buf + base), n, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                                 e->md, NULL);
            if (rc < 0 && rc != PCRE2_ERROR_NOMATCH)
                e->re_error = rc;
            if (rc < 0)
                break;
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
            size_t ms = ov[0], me = ov[1];
            if (me == ms) { /* empty match: skip a character */
                if (ms >= n)
                    break;
                start = ms + utf8_step(buf + base + ms, n - ms);
                continue;
            }
            /* the gap before the match */
            if (ms > last) {
                if (pending_next) {
                    pieces_add(e, out, pend_off, base + ms - pend_off);
                    pending_next = false;
                } else {
                    pieces_add(e, out, base + last, ms - last);
                }
            }
            switch (p->behavior) {
            case KVF_TEXT_TOK_SPLIT_ISOLATED:
                if (pending_next) { /* not reached: pending only in MERGED_NEXT */
                    pieces_add(e, out, pend_off, base + ms - pend_off);
                    pending_next = false;
                }
                pieces_add(e, out, base + ms, me - ms);
                break;
            case KVF_TEXT_TOK_SPLIT_REMOVED:
                break;
            case KVF_TEXT_TOK_SPLIT_MERGED_PREV:
                if (ms > last && out->n > 0)
                    out->len[out->n - 1] += me - ms;
                else
                    pieces_add(e, out, base + ms, me - ms);
                break;
            case KVF_TEXT_TOK_SPLIT_MERGED_NEXT:
                if (pending_next)
                    pieces_add(e, out, pend_off, base + ms - pend_off);
                pending_next = true;
                pend_off = base + ms;
                break;
            }
            last = start = me;
        }
        if (pending_next)
            pieces_add(e, out, pend_off, base + n - pend_off);
        else if (last < n)
            pieces_add(e, out, base + last, n - last);
    }
}

/* ByteLevel's add_prefix_space: a space in front of every piece that lacks one (into ob). */
static void pre_bytelevel_prefix(enc *e, const char *buf, const pieces *in, pieces *out, kvf_sbuf *ob)
{
    for (size_t k = 0; k < in->n; k++) {
        size_t o = ob->len;
        if (buf[in->off[k]] != ' ')
            kvf_sbuf_putc(ob, ' ');
        kvf_sbuf_append(ob, buf + in->off[k], in->len[k]);
        pieces_add(e, out, o, ob->len - o);
    }
}

/* Metaspace: ' ' -> the replacement, a replacement in front, then a split before each one. */
static void pre_metaspace(enc *e, const kvf_text_tok_pre *p, const char *buf, const pieces *in, pieces *out,
                          kvf_sbuf *ob, bool first_segment)
{
    for (size_t k = 0; k < in->n; k++) {
        const char *s = buf + in->off[k];
        size_t n = in->len[k], o = ob->len;
        bool starts = n >= p->repl_len && memcmp(s, p->repl, p->repl_len) == 0;
        bool prepend = p->prepend == KVF_TEXT_TOK_PREPEND_ALWAYS ||
                       (p->prepend == KVF_TEXT_TOK_PREPEND_FIRST && first_segment && k == 0);
        if (prepend && !starts && s[0] != ' ')
            kvf_sbuf_append(ob, p->repl, p->repl_len);
        for (size_t i = 0; i < n; i++) {
            if (s[i] == ' ')
                kvf_sbuf_append(ob, p->repl, p->repl_len);
            else
                kvf_sbuf_putc(ob, s[i]);
        }
        if (!p->split) {
            pieces_add(e, out, o, ob->len - o);
            continue;
        }
        /* split before every replacement (MergedWithNext) */
        size_t end = ob->len, cut = o;
        for (size_t i = o + 1; i + p->repl_len <= end; i++) {
            if (memcmp(ob->data + i, p->repl, p->repl_len) == 0) {
                pieces_add(e, out, cut, i - cut);
                cut = i;
                i += p->repl_len - 1;
            }
        }
        pieces_add(e, out, cut, end - cut);
    }
}

static bool is_numeric(utf8proc_int32_t cp)
{
    if (cp < 0x80)
        return cp >= '0' && cp <= '9';
    utf8proc_category_t c = utf8proc_category(cp);
    return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

static void pre_digits(enc *e, const kvf_text_tok_pre *p, const char *buf, const pieces *in, pieces *out)
{
    for (size_t k = 0; k < in->n; k++) {
        size_t base = in->off[k], n = in->len[k], run = 0;
        int run_kind = -1; /* 1 digits, 0 other */
        for (size_t i = 0; i < n;) {
            utf8proc_int32_t cp;
            utf8proc_ssize_t cl = utf8proc_iterate((const utf8proc_uint8_t *)buf + base + i,
                                                   (utf8proc_ssize_t)(n - i), &cp);
            if (cl <= 0)
                cl = 1, cp = 0xFFFD;
            int kind = is_numeric(cp);
            if (run_kind >= 0 && (kind != run_kind || (kind && p->individual))) {
                pieces_add(e, out, base + run, i - run);
                run = i;
            }
            run_kind = kind;
            i += (size_t)cl;
        }
        pieces_add(e, out, base + run, n - run);
    }
}

/* ---- BPE ---- */

static bool heap_less(const heap_ent *x, const heap_ent *y)
{
    return x->rank != y->rank ? x->rank < y->rank : x->pos < y->pos;
}

static void heap_push(enc *e, heap_ent v)
{
    size_t i = e->n_heap++;
    e->heap[i] = v;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!heap_less(&e->heap[i], &e->heap[up]))
            break;
        heap_ent t = e->heap[i];
        e->heap[i] = e->heap[up];
        e->heap[up] = t;
        i = up;
    }
}

static heap_ent heap_pop(enc *e)
{
    heap_ent top = e->heap[0];
    e->heap[0] = e->heap[--e->n_heap];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < e->n_heap && heap_less(&e->heap[l], &e->heap[m]))
            m = l;
        if (r < e->n_heap && heap_less(&e->heap[r], &e->heap[m]))
            m = r;
        if (m == i)
            break;
        heap_ent t = e->heap[i];
        e->heap[i] = e->heap[m];
        e->heap[m] = t;
        i = m;
    }
    return top;
}

static bool bpe_reserve(enc *e, size_t n)
{
    if (n <= e->sym_cap)
        return true;
    size_t cap = n < 64 ? 64 : n * 2;
    int32_t *a = realloc(e->sym, cap * sizeof *a);
    if (a)
        e->sym = a;
    int32_t *b = realloc(e->prev, cap * sizeof *b);
    if (b)
        e->prev = b;
    int32_t *c = realloc(e->next, cap * sizeof *c);
    if (c)
        e->next = c;
    heap_ent *h = realloc(e->heap, cap * 3 * sizeof *h);
    if (h)
        e->heap = h;
    if (!a || !b || !c || !h) {
        e->oom = true;
        return false;
    }
    e->sym_cap = cap;
    e->heap_cap = cap * 3;
    return true;
}

static void try_pair(enc *e, int32_t pos)
{
    int32_t nx = e->next[pos];
    if (nx < 0)
        return;
    const kvf_text_tok_merge *m = kvf_text_tok_merge_find(&e->tok->merges, e->sym[pos], e->sym[nx]);
    if (m && e->n_heap < e->heap_cap)
        heap_push(e, (heap_ent){m->rank, pos, e->sym[pos], e->sym[nx]});
}

/* Encodes one pre-tokenized piece. */
static void bpe_piece(enc *e, const char *s, size_t n)
{
    const kvf_text_tokenizer *t = e->tok;
    if (!bpe_reserve(e, n))
        return;
    if (t->ignore_merges) { /* a piece that is a whole token skips the merges */
        int32_t id;
        if (t->byte_level) {
            kvf_sbuf_reset(&e->tmp);
            for (size_t i = 0; i < n; i++) {
                char b[4];
                kvf_sbuf_append(&e->tmp, b, kvf_text_utf8_put(kvf_text_tok_byte_to_cp((uint8_t)s[i]), b));
            }
            id = kvf_text_tok_vocab_find(t, e->tmp.data ? e->tmp.data : "", e->tmp.len);
        } else {
            id = kvf_text_tok_vocab_find(t, s, n);
        }
        if (id >= 0) {
            push_id(e, id);
            return;
        }
    }
    /* initial symbols */
    int32_t ns = 0;
    bool last_unk = false;
    for (size_t i = 0; i < n;) {
        if (t->byte_level) {
            int32_t id = t->byte_id[(uint8_t)s[i++]];
            if (id >= 0) {
                e->sym[ns++] = id, last_unk = false;
            } else if (t->unk_id >= 0 && !(t->fuse_unk && last_unk)) {
                e->sym[ns++] = t->unk_id, last_unk = true;
            }
            continue;
        }
        size_t cl = utf8_step(s + i, n - i);
        int32_t id = kvf_text_tok_vocab_find(t, s + i, cl);
        if (id >= 0) {
            e->sym[ns++] = id;
            last_unk = false;
        } else {
            bool done = false;
            if (t->byte_fallback) {
                done = true;
                for (size_t k = 0; k < cl; k++)
                    done = done && t->byte_id[(uint8_t)s[i + k]] >= 0;
                for (size_t k = 0; done && k < cl; k++)
                    e->sym[ns++] = t->byte_id[(uint8_t)s[i + k]];
                if (done)
                    last_unk = false;
            }
            if (!done && t->unk_id >= 0 && !(t->fuse_unk && last_unk)) {
                e->sym[ns++] = t->unk_id;
                last_unk = true;
            }
            /* no unk token: the character is dropped, as Hugging Face does */
        }
        i += cl;
    }
    for (int32_t i = 0; i < ns; i++) {
        e->prev[i] = i - 1;
        e->next[i] = i + 1 < ns ? i + 1 : -1;
    }
    /* merges: the lowest rank first, the leftmost among equals */
    e->n_heap = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        try_pair(e, i);
    while (e->n_heap > 0) {
        heap_ent h = heap_pop(e);
        int32_t nx = e->next[h.pos];
        if (e->sym[h.pos] != h.a || nx < 0 || e->sym[nx] != h.b)
            continue; /* stale: one side was merged already */
        const kvf_text_tok_merge *m = kvf_text_tok_merge_find(&t->merges, h.a, h.b);
        e->sym[h.pos] = m->id;
        e->sym[nx] = -1;
        e->next[h.pos] = e->next[nx];
        if (e->next[nx] >= 0)
            e->prev[e->next[nx]] = h.pos;
        if (e->prev[h.pos] >= 0)
            try_pair(e, e->prev[h.pos]);
        try_pair(e, h.pos);
    }
    for (int32_t i = ns > 0 ? 0 : -1; i >= 0; i = e->next[i])
        push_id(e, e->sym[i]);
}

/* Normalizes, pre-tokenizes and encodes one segment between added tokens. */
static void encode_segment(enc *e, const char *s, size_t n, bool first_segment)
{
    const kvf_text_tokenizer *t = e->tok;
    if (n == 0)
        return;
    kvf_sbuf_reset(&e->norm);
    kvf_sbuf_append(&e->norm, s, n);
    for (size_t i = 0; i < t->n_norms; i++)
        normalize_step(e, &t->norms[i]);
    if (e->norm.len == 0 || e->norm.oom || e->tmp.oom) {
        e->oom = e->oom || e->norm.oom || e->tmp.oom;
        return;
    }
    int cb = 0, cp = 0; /* current buffer, current piece list */
    kvf_sbuf_reset(&e->bufs[0]);
    kvf_sbuf_append(&e->bufs[0], e->norm.data, e->norm.len);
    e->pl[0].n = 0;
    pieces_add(e, &e->pl[0], 0, e->norm.len);
    for (size_t k = 0; k < t->n_pres && !e->oom; k++) {
        const kvf_text_tok_pre *p = &t->pres[k];
        if (p->kind == KVF_TEXT_TOK_PRE_BYTELEVEL && p->add_prefix_space) {
            kvf_sbuf_reset(&e->bufs[!cb]);
            e->pl[!cp].n = 0;
            pre_bytelevel_prefix(e, e->bufs[cb].data, &e->pl[cp], &e->pl[!cp], &e->bufs[!cb]);
            cb = !cb, cp = !cp;
        }
        const char *buf = e->bufs[cb].data;
        pieces *in = &e->pl[cp], *out = &e->pl[!cp];
        out->n = 0;
        switch (p->kind) {
        case KVF_TEXT_TOK_PRE_SPLIT:
            pre_split(e, p, buf, in, out);
            break;
        case KVF_TEXT_TOK_PRE_BYTELEVEL:
            if (!p->re)
                continue; /* nothing to split */
            pre_split(e, p, buf, in, out);
            break;
        case KVF_TEXT_TOK_PRE_METASPACE:
            kvf_sbuf_reset(&e->bufs[!cb]);
            pre_metaspace(e, p, buf, in, out, &e->bufs[!cb], first_segment);
            cb = !cb;
            break;
        case KVF_TEXT_TOK_PRE_DIGITS:
            pre_digits(e, p, buf, in, out);
            break;
        }
        cp = !cp;
        if (e->bufs[0].oom || e->bufs[1].oom)
            e->oom = true;
    }
    if (t->word_split) { /* before each "▁" that follows another character */
        const char *buf = e->bufs[cb].data;
        const pieces *in = &e->pl[cp];
        pieces *out = &e->pl[!cp];
        out->n = 0;
        for (size_t k = 0; k < in->n; k++) {
            size_t start = in->off[k], end = start + in->len[k], cut = start;
            for (size_t i = start + 1; i + 3 <= end; i++) {
                if (memcmp(buf + i, "\xE2\x96\x81", 3) != 0)
                    continue;
                if (!(i >= start + 3 && memcmp(buf + i - 3, "\xE2\x96\x81", 3) == 0)) {
                    pieces_add(e, out, cut, i - cut);
                    cut = i;
                }
                i += 2;
            }
            pieces_add(e, out, cut, end - cut);
        }
        cp = !cp;
    }
    const pieces *fin = &e->pl[cp];
    for (size_t k = 0; k < fin->n && !e->oom; k++)
        bpe_piece(e, e->bufs[cb].data + fin->off[k], fin->len[k]);
}

/* The longest added token at s, or NULL. One hash lookup per distinct added-token length, so
 * thousands of reserved tokens cost no more than a few. */
static const kvf_text_tok_added *match_added(const kvf_text_tokenizer *t, const char *s, size_t n)
{
    for (size_t i = 0; i < t->n_added_lens; i++) {
        size_t l = t->added_lens[i];
        if (l > n)
            continue;
        const kvf_text_tok_added *a = kvf_text_tok_added_lookup(t, s, l);
        if (a)
            return a;
    }
    return NULL;
}

/* Unicode White_Space (what lstrip/rstrip swallow). */
static bool is_space_cp(uint32_t c)
{
    return (c >= 9 && c <= 13) || c == ' ' || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
           c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

static uint32_t cp_at(const char *s, size_t n, size_t *len_out)
{
    utf8proc_int32_t cp = 0;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &cp);
    *len_out = k > 0 ? (size_t)k : 1;
    return k > 0 ? (uint32_t)cp : 0xFFFD;
}

kvf_status kvf_text_tokenizer_encode(const kvf_text_tokenizer *tok, const char *text, size_t len,
                                      bool add_special, int32_t **ids_out, size_t *n_out, kvf_err *err)
{
    if (!tok || (!text && len > 0))
        return kvf_err_set(err, KVF_ERR_INVALID, "tokenizer: encode needs a tokenizer and text");
    for (size_t i = 0; i < len;) {
        size_t cl = kvf_text_utf8_len((const uint8_t *)text + i, len - i);
        if (cl == 0)
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "tokenizer: text is not valid UTF-8 at byte %zu (0x%02x)", i, (unsigned char)text[i]);
        i += cl;
    }
    enc e = {.tok = tok, .err = err};
    kvf_sbuf_init(&e.norm);
    kvf_sbuf_init(&e.tmp);
    kvf_sbuf_init(&e.bufs[0]);
    kvf_sbuf_init(&e.bufs[1]);
    e.md = pcre2_match_data_create(4, NULL);
    if (!e.md)
        e.oom = true;
    push_id(&e, 0); /* makes ids non-NULL even when empty */
    e.n_ids = 0;
    if (add_special)
        for (size_t i = 0; i < tok->n_prefix; i++)
            push_id(&e, tok->prefix_ids[i]);
    size_t seg = 0;
    for (size_t i = 0; i < len && !e.oom && !e.re_error;) {
        const kvf_text_tok_added *a = tok->added_first[(uint8_t)text[i]] ? match_added(tok, text + i, len - i) : NULL;
        if (!a) {
            i++;
            continue;
        }
        size_t seg_end = i, k;
        if (a->lstrip) /* step back over whitespace, one character at a time */
            while (seg_end > seg) {
                size_t b = seg_end - 1;
                while (b > seg && ((uint8_t)text[b] & 0xC0) == 0x80)
                    b--;
                if (!is_space_cp(cp_at(text + b, seg_end - b, &k)))
                    break;
                seg_end = b;
            }
        encode_segment(&e, text + seg, seg_end - seg, seg == 0);
        push_id(&e, a->id);
        i += a->len;
        if (a->rstrip)
            while (i < len && is_space_cp(cp_at(text + i, len - i, &k)))
                i += k;
        seg = i;
    }
    if (!e.oom && !e.re_error)
        encode_segment(&e, text + seg, len - seg, seg == 0);
    if (add_special)
        for (size_t i = 0; i < tok->n_suffix; i++)
            push_id(&e, tok->suffix_ids[i]);
    kvf_sbuf_fini(&e.norm);
    kvf_sbuf_fini(&e.tmp);
    kvf_sbuf_fini(&e.bufs[0]);
    kvf_sbuf_fini(&e.bufs[1]);
    pieces_fini(&e.pl[0]);
    pieces_fini(&e.pl[1]);
    pcre2_match_data_free(e.md);
    free(e.sym);
    free(e.prev);
    free(e.next);
    free(e.heap);
    if (e.oom) {
        free(e.ids);
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory encoding %zu bytes", len);
    }
    if (e.re_error) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(e.re_error, msg, sizeof msg);
        free(e.ids);
        return kvf_err_set(err, KVF_ERR_LIMIT, "tokenizer: the pre-tokenizer regex failed on %zu bytes of text: %s",
                           len, (const char *)msg);
    }
    *ids_out = e.ids;
    *n_out = e.n_ids;
    return KVF_OK;
}
