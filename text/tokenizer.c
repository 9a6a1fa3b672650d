/* tokenizer.c: loads tokenizer.json (model vocabulary and merges, normalizer, pre-tokenizer,
 * post-processor, decoder, added tokens) and its companions tokenizer_config.json and
 * generation_config.json into kvf_text_tokenizer. Encoding is in tokenizer_encode.c, decoding
 * in tokenizer_decode.c, the default tokenizer writer in tokenizer_write.c. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/hash.h"
#include "text/tokenizer_json.h"
#include "common/log.h"
#include "text/tokenizer_internal.h"

const char kvf_text_tok_gpt2_regex[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---- UTF-8 and the byte map ---- */

static int byte_is_printable(int b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

uint32_t kvf_text_tok_byte_to_cp(uint8_t b)
{
    if (byte_is_printable(b))
        return b;
    /* the non-printable bytes 0-32, 127-160 and 173 take 256, 257, ... in order */
    return b <= 32 ? 256u + b : b <= 160 ? 256u + 33 + (b - 127u) : 256u + 67;
}

int kvf_text_tok_cp_to_byte(uint32_t cp)
{
    if (cp < 256)
        return byte_is_printable((int)cp) ? (int)cp : -1;
    /* code points 256.. stand for the non-printable bytes in order: 0-32, 127-160, 173 */
    uint32_t k = cp - 256;
    if (k <= 32)
        return (int)k;
    if (k <= 32 + 34)
        return (int)(127 + k - 33);
    return k == 67 ? 173 : -1;
}

/* ---- maps ---- */

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n * 2)
        c <<= 1;
    return c;
}

kvf_status kvf_text_tok_strmap_init(kvf_text_tok_strmap *m, size_t expect)
{
    m->cap = pow2_at_least(expect);
    m->n = 0;
    m->slots = malloc(m->cap * sizeof *m->slots);
    if (!m->slots)
        return KVF_ERR_NOMEM;
    memset(m->slots, 0xFF, m->cap * sizeof *m->slots);
    return KVF_OK;
}

void kvf_text_tok_strmap_fini(kvf_text_tok_strmap *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = m->n = 0;
}

static const char *vocab_key(const kvf_text_tokenizer *tok, int32_t id, size_t *len)
{
    *len = (size_t)tok->str_len[id];
    return tok->strs.data + tok->str_off[id];
}

static const char *added_key(const kvf_text_tokenizer *tok, int32_t i, size_t *len)
{
    *len = tok->added[i].len;
    return tok->added[i].content;
}

typedef const char *(*key_fn)(const kvf_text_tokenizer *, int32_t, size_t *);

/* The slot holding s, or the empty slot where it would go. */
static size_t strmap_slot(const kvf_text_tokenizer *tok, const kvf_text_tok_strmap *m, key_fn key,
                          const char *s, size_t len)
{
    size_t mask = m->cap - 1;
    size_t i = (size_t)kvf_hash64(s, len) & mask;
    for (;;) {
        int32_t v = m->slots[i];
        if (v < 0)
            return i;
        size_t klen;
        const char *k = key(tok, v, &klen);
        if (klen == len && memcmp(k, s, len) == 0)
            return i;
        i = (i + 1) & mask;
    }
}

int32_t kvf_text_tok_vocab_find(const kvf_text_tokenizer *tok, const char *s, size_t len)
{
    if (!tok->vocab.slots)
        return -1;
    return tok->vocab.slots[strmap_slot(tok, &tok->vocab, vocab_key, s, len)];
}

const kvf_text_tok_added *kvf_text_tok_added_lookup(const kvf_text_tokenizer *tok, const char *s, size_t len)
{
    if (!tok->added_map.slots)
        return NULL;
    int32_t i = tok->added_map.slots[strmap_slot(tok, &tok->added_map, added_key, s, len)];
    return i < 0 ? NULL : &tok->added[i];
}

int32_t kvf_text_tok_added_find(const kvf_text_tokenizer *tok, const char *s, size_t len)
{
    const kvf_text_tok_added *a = kvf_text_tok_added_lookup(tok, s, len);
    return a ? a->id : -1;
}

static uint64_t merge_hash(uint64_t key)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    key *= 0xc4ceb9fe1a85ec53ULL;
    key ^= key >> 33;
    return key;
}

const kvf_text_tok_merge *kvf_text_tok_merge_find(const kvf_text_tok_mergemap *m, int32_t a, int32_t b)
{
    if (!m->slots)
        return NULL;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t mask = m->cap - 1;
    for (size_t i = (size_t)merge_hash(key) & mask;; i = (i + 1) & mask) {
        if (m->slots[i].key == key)
            return &m->slots[i];
        if (m->slots[i].key == UINT64_MAX)
            return NULL;
    }
}

/* ---- loading ---- */

/* The names messages give the three files: paths when loading from disk. */
typedef struct file_names {
    const char *tok, *cfg, *gen;
} file_names;

typedef struct load_ctx {
    kvf_text_tokenizer *tok;
    const char *what; /* file name for messages */
    kvf_err *err;
    const file_names *names;
} load_ctx;

static kvf_status fail(load_ctx *c, kvf_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static kvf_status fail(load_ctx *c, kvf_status st, const char *fmt, ...)
{
    char msg[KVF_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvf_err_set(c->err, st, "tokenizer: %s: %s", c->what, msg);
}

static bool jint(const kvf_text_tok_jv *v) { return v && v->type == KVF_TEXT_TOK_JNUM && v->is_int; }

static const char *jstr(const kvf_text_tok_jv *o, const char *key)
{
    const kvf_text_tok_jv *v = kvf_text_tok_jget(o, key);
    return kvf_text_tok_jis(v, KVF_TEXT_TOK_JSTR) ? kvf_text_tok_jstr(v) : NULL;
}

static char *dup_bytes(const char *s, size_t n)
{
    char *p = malloc(n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

static kvf_status check_id(load_ctx *c, const char *where, int64_t id)
{
    if (id < 0 || id >= KVF_TEXT_TOK_MAX_ID)
        return fail(c, KVF_ERR_INVALID, "%s: id %lld is out of range (0..%d)", where,
                    (long long)id, KVF_TEXT_TOK_MAX_ID - 1);
    return KVF_OK;
}

/* Makes room for ids up to max_id (arrays indexed by id). */
static kvf_status grow_ids(load_ctx *c, int32_t n_ids)
{
    kvf_text_tokenizer *t = c->tok;
    if (n_ids <= t->n_ids)
        return KVF_OK;
    int64_t *off = realloc(t->str_off, (size_t)n_ids * sizeof *off);
    if (off)
        t->str_off = off;
    int32_t *len = realloc(t->str_len, (size_t)n_ids * sizeof *len);
    if (len)
        t->str_len = len;
    uint8_t *sp = realloc(t->is_special, (size_t)n_ids);
    if (sp)
        t->is_special = sp;
    if (!off || !len || !sp)
        return fail(c, KVF_ERR_NOMEM, "out of memory for %d ids", n_ids);
    for (int32_t i = t->n_ids; i < n_ids; i++) {
        t->str_off[i] = 0;
        t->str_len[i] = -1;
        t->is_special[i] = 0;
    }
    t->n_ids = n_ids;
    return KVF_OK;
}

static kvf_status load_vocab(load_ctx *c, const kvf_text_tok_jv *vocab)
{
    kvf_text_tokenizer *t = c->tok;
    if (!kvf_text_tok_jis(vocab, KVF_TEXT_TOK_JOBJ))
        return fail(c, KVF_ERR_INVALID, "\"model.vocab\" is %s, expected an object",
                    kvf_text_tok_jkind(vocab));
    size_t n = kvf_text_tok_jsize(vocab);
    int64_t max_id = -1;
    for (const kvf_text_tok_jv *k = kvf_text_tok_jfirst(vocab); k; k = kvf_text_tok_jnext(kvf_text_tok_jnext(k))) {
        const kvf_text_tok_jv *v = kvf_text_tok_jnext(k);
        if (!jint(v))
            return fail(c, KVF_ERR_INVALID, "\"model.vocab\": \"%.64s\" maps to %s, expected an integer id",
                        k->s, kvf_text_tok_jkind(v));
        kvf_status st = check_id(c, "model.vocab", v->i);
        if (st != KVF_OK)
            return st;
        if (v->i > max_id)
            max_id = v->i;
    }
    kvf_status st = grow_ids(c, (int32_t)(max_id + 1));
    if (st != KVF_OK)
        return st;
    if (kvf_text_tok_strmap_init(&t->vocab, n) != KVF_OK || kvf_sbuf_reserve(&t->strs, n * 8) != KVF_OK)
        return fail(c, KVF_ERR_NOMEM, "out of memory for %zu vocabulary entries", n);
    for (const kvf_text_tok_jv *k = kvf_text_tok_jfirst(vocab); k; k = kvf_text_tok_jnext(kvf_text_tok_jnext(k))) {
        const char *key = k->s;
        size_t klen = k->len;
        int32_t id = (int32_t)kvf_text_tok_jnext(k)->i;
        if (t->str_len[id] >= 0)
            return fail(c, KVF_ERR_INVALID, "\"model.vocab\": id %d is given to both \"%.64s\" and \"%.64s\"",
                        id, t->strs.data + t->str_off[id], key);
        size_t slot = strmap_slot(t, &t->vocab, vocab_key, key, klen);
        if (t->vocab.slots[slot] >= 0)
            return fail(c, KVF_ERR_INVALID, "\"model.vocab\": \"%.64s\" appears twice", key);
        t->str_off[id] = (int64_t)t->strs.len;
        t->str_len[id] = (int32_t)klen;
        kvf_sbuf_append(&t->strs, key, klen);
        kvf_sbuf_putc(&t->strs, 0);
        if (t->strs.oom)
            break;
        t->vocab.slots[slot] = id;
        t->vocab.n++;
    }
    if (t->strs.oom)
        return fail(c, KVF_ERR_NOMEM, "out of memory for the vocabulary strings");
    return KVF_OK;
}

static int clip(size_t len) { return len < 64 ? (int)len : 64; }

static kvf_status merges_insert(load_ctx *c, size_t rank, const char *a, size_t a_len,
                                const char *b, size_t b_len)
{
    kvf_text_tokenizer *t = c->tok;
    int32_t ia = kvf_text_tok_vocab_find(t, a, a_len), ib = kvf_text_tok_vocab_find(t, b, b_len);
    if (ia < 0 || ib < 0)
        return fail(c, KVF_ERR_INVALID, "\"model.merges\"[%zu]: \"%.*s\" is not in the vocabulary",
                    rank, clip(ia < 0 ? a_len : b_len), ia < 0 ? a : b);
    char stack[256];
    char *cat = a_len + b_len <= sizeof stack ? stack : malloc(a_len + b_len);
    if (!cat)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    memcpy(cat, a, a_len);
    memcpy(cat + a_len, b, b_len);
    int32_t id = kvf_text_tok_vocab_find(t, cat, a_len + b_len);
    if (cat != stack)
        free(cat);
    if (id < 0)
        return fail(c, KVF_ERR_INVALID, "\"model.merges\"[%zu]: \"%.*s\" + \"%.*s\" is not in the vocabulary",
                    rank, clip(a_len), a, clip(b_len), b);
    uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    size_t mask = t->merges.cap - 1;
    for (size_t i = (size_t)merge_hash(key) & mask;; i = (i + 1) & mask) {
        kvf_text_tok_merge *m = &t->merges.slots[i];
        if (m->key == key)
            return KVF_OK; /* a repeated merge keeps its first (best) rank */
        if (m->key == UINT64_MAX) {
            m->key = key;
            m->rank = (int32_t)rank;
            m->id = id;
            t->merges.n++;
            return KVF_OK;
        }
    }
}

static kvf_status load_merges(load_ctx *c, const kvf_text_tok_jv *merges)
{
    kvf_text_tokenizer *t = c->tok;
    if (!merges || kvf_text_tok_jis(merges, KVF_TEXT_TOK_JNULL))
        return KVF_OK;
    if (!kvf_text_tok_jis(merges, KVF_TEXT_TOK_JARR))
        return fail(c, KVF_ERR_INVALID, "\"model.merges\" is %s, expected an array", kvf_text_tok_jkind(merges));
    size_t n = kvf_text_tok_jsize(merges);
    if (n >= (size_t)INT32_MAX)
        return fail(c, KVF_ERR_LIMIT, "\"model.merges\" has %zu entries", n);
    t->merges.cap = pow2_at_least(n);
    t->merges.slots = malloc(t->merges.cap * sizeof *t->merges.slots);
    if (!t->merges.slots)
        return fail(c, KVF_ERR_NOMEM, "out of memory for %zu merges", n);
    for (size_t i = 0; i < t->merges.cap; i++)
        t->merges.slots[i].key = UINT64_MAX;
    const kvf_text_tok_jv *m = kvf_text_tok_jfirst(merges);
    for (size_t i = 0; i < n; i++, m = kvf_text_tok_jnext(m)) {
        kvf_status st;
        if (kvf_text_tok_jis(m, KVF_TEXT_TOK_JSTR)) { /* "a b": the older format */
            const char *s = kvf_text_tok_jstr(m);
            size_t len = (size_t)(m)->len;
            const char *sp = memchr(s, ' ', len);
            if (!sp || memchr(sp + 1, ' ', len - (size_t)(sp + 1 - s)))
                return fail(c, KVF_ERR_INVALID, "\"model.merges\"[%zu] is \"%.64s\", expected two tokens separated by one space",
                            i, s);
            st = merges_insert(c, i, s, (size_t)(sp - s), sp + 1, len - (size_t)(sp + 1 - s));
        } else if (kvf_text_tok_jis(m, KVF_TEXT_TOK_JARR) && kvf_text_tok_jsize(m) == 2 && kvf_text_tok_jis(kvf_text_tok_jat(m, 0), KVF_TEXT_TOK_JSTR) &&
                   kvf_text_tok_jis(kvf_text_tok_jat(m, 1), KVF_TEXT_TOK_JSTR)) {
            const kvf_text_tok_jv *a = kvf_text_tok_jat(m, 0), *b = kvf_text_tok_jat(m, 1);
            st = merges_insert(c, i, kvf_text_tok_jstr(a), (size_t)(a)->len, kvf_text_tok_jstr(b),
                               (size_t)(b)->len);
        } else {
            return fail(c, KVF_ERR_INVALID, "\"model.merges\"[%zu] is %s, expected \"a b\" or [\"a\", \"b\"]",
                        i, kvf_text_tok_jkind(m));
        }
        if (st != KVF_OK)
            return st;
    }
    return KVF_OK;
}

static kvf_status load_model(load_ctx *c, const kvf_text_tok_jv *model)
{
    kvf_text_tokenizer *t = c->tok;
    if (!kvf_text_tok_jis(model, KVF_TEXT_TOK_JOBJ))
        return fail(c, KVF_ERR_INVALID, "\"model\" is %s, expected an object", kvf_text_tok_jkind(model));
    const char *type = jstr(model, "type");
    if (type && strcmp(type, "BPE") != 0)
        return fail(c, KVF_ERR_UNSUPPORTED, "\"model.type\" is \"%s\" (only \"BPE\" is supported)", type);
    if (!type && !kvf_text_tok_jget(model, "merges"))
        return fail(c, KVF_ERR_UNSUPPORTED, "\"model\" has no \"type\" and no \"merges\" (only BPE is supported)");
    const char *pre = jstr(model, "continuing_subword_prefix"), *suf = jstr(model, "end_of_word_suffix");
    if ((pre && *pre) || (suf && *suf))
        return fail(c, KVF_ERR_UNSUPPORTED, "\"model.continuing_subword_prefix\"/\"end_of_word_suffix\" (\"%s\"/\"%s\") are not supported",
                    pre ? pre : "", suf ? suf : "");
    const kvf_text_tok_jv *dropout = kvf_text_tok_jget(model, "dropout");
    if (kvf_text_tok_jis(dropout, KVF_TEXT_TOK_JNUM) && (dropout)->d > 0)
        kvf_log(KVF_LOG_WARN, "model: tokenizer: %s: BPE dropout %g ignored (encoding is deterministic)",
                c->what, (dropout)->d);
    kvf_status st = load_vocab(c, kvf_text_tok_jget(model, "vocab"));
    if (st != KVF_OK)
        return st;
    if ((st = load_merges(c, kvf_text_tok_jget(model, "merges"))) != KVF_OK)
        return st;
    t->byte_fallback = kvf_text_tok_jtrue(kvf_text_tok_jget(model, "byte_fallback"));
    t->fuse_unk = kvf_text_tok_jtrue(kvf_text_tok_jget(model, "fuse_unk"));
    t->ignore_merges = kvf_text_tok_jtrue(kvf_text_tok_jget(model, "ignore_merges"));
    const char *unk = jstr(model, "unk_token");
    t->unk_id = -1;
    if (unk) {
        t->unk_id = kvf_text_tok_vocab_find(t, unk, strlen(unk));
        if (t->unk_id < 0)
            return fail(c, KVF_ERR_INVALID, "\"model.unk_token\" \"%.64s\" is not in the vocabulary", unk);
    }
    return KVF_OK;
}

static int cmp_added(const void *a, const void *b)
{
    const kvf_text_tok_added *x = a, *y = b;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static kvf_status load_added(load_ctx *c, const kvf_text_tok_jv *arr)
{
    kvf_text_tokenizer *t = c->tok;
    if (!arr || kvf_text_tok_jis(arr, KVF_TEXT_TOK_JNULL))
        return KVF_OK;
    if (!kvf_text_tok_jis(arr, KVF_TEXT_TOK_JARR))
        return fail(c, KVF_ERR_INVALID, "\"added_tokens\" is %s, expected an array", kvf_text_tok_jkind(arr));
    size_t n = kvf_text_tok_jsize(arr);
    t->added = calloc(n ? n : 1, sizeof *t->added);
    if (!t->added)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    const kvf_text_tok_jv *a = kvf_text_tok_jfirst(arr);
    int32_t max_id = -1;
    for (size_t i = 0; i < n; i++, a = kvf_text_tok_jnext(a)) {
        const kvf_text_tok_jv *id = kvf_text_tok_jget(a, "id"), *content = kvf_text_tok_jget(a, "content");
        if (!jint(id) || !kvf_text_tok_jis(content, KVF_TEXT_TOK_JSTR) || (size_t)(content)->len == 0)
            return fail(c, KVF_ERR_INVALID, "\"added_tokens\"[%zu] needs an integer \"id\" and a non-empty string \"content\"", i);
        kvf_status st = check_id(c, "added_tokens", (id)->i);
        if (st != KVF_OK)
            return st;
        kvf_text_tok_added *d = &t->added[t->n_added++];
        d->id = (int32_t)(id)->i;
        d->len = (size_t)(content)->len;
        d->content = dup_bytes(kvf_text_tok_jstr(content), d->len);
        d->special = kvf_text_tok_jtrue(kvf_text_tok_jget(a, "special"));
        d->lstrip = kvf_text_tok_jtrue(kvf_text_tok_jget(a, "lstrip"));
        d->rstrip = kvf_text_tok_jtrue(kvf_text_tok_jget(a, "rstrip"));
        if (!d->content)
            return fail(c, KVF_ERR_NOMEM, "out of memory");
        if (d->id > max_id)
            max_id = d->id;
    }
    kvf_status st = grow_ids(c, max_id + 1); /* once: thousands of reserved tokens are common */
    if (st != KVF_OK)
        return st;
    qsort(t->added, t->n_added, sizeof *t->added, cmp_added);
    if (kvf_text_tok_strmap_init(&t->added_map, t->n_added) != KVF_OK)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < t->n_added; i++) {
        kvf_text_tok_added *d = &t->added[i];
        size_t slot = strmap_slot(t, &t->added_map, added_key, d->content, d->len);
        if (t->added_map.slots[slot] >= 0) {
            kvf_text_tok_added *o = &t->added[t->added_map.slots[slot]];
            if (o->id != d->id)
                return fail(c, KVF_ERR_INVALID, "\"added_tokens\": \"%.64s\" has two ids, %d and %d",
                            d->content, o->id, d->id);
            continue;
        }
        t->added_map.slots[slot] = (int32_t)i;
        t->added_map.n++;
        t->added_first[(uint8_t)d->content[0]] = true;
        if (d->special)
            t->is_special[d->id] = 1;
        if (t->n_added_lens == 0 || t->added_lens[t->n_added_lens - 1] != d->len) { /* sorted: new length */
            size_t *l = realloc(t->added_lens, (t->n_added_lens + 1) * sizeof *l);
            if (!l)
                return fail(c, KVF_ERR_NOMEM, "out of memory");
            t->added_lens = l;
            t->added_lens[t->n_added_lens++] = d->len;
        }
    }
    return KVF_OK;
}

/* ---- normalizer ---- */

static kvf_status add_norm(load_ctx *c, kvf_text_tok_norm n)
{
    kvf_text_tokenizer *t = c->tok;
    kvf_text_tok_norm *p = realloc(t->norms, (t->n_norms + 1) * sizeof *p);
    if (!p) {
        free(n.a);
        free(n.b);
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    }
    t->norms = p;
    t->norms[t->n_norms++] = n;
    return KVF_OK;
}

static kvf_status load_normalizer(load_ctx *c, const kvf_text_tok_jv *n, int depth)
{
    if (!n || kvf_text_tok_jis(n, KVF_TEXT_TOK_JNULL))
        return KVF_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return fail(c, KVF_ERR_INVALID, "\"normalizer\" has no string \"type\"");
    if (depth > 8)
        return fail(c, KVF_ERR_LIMIT, "\"normalizer\" nests Sequences more than 8 deep");
    kvf_text_tok_norm d = {0};
    if (strcmp(type, "Sequence") == 0) {
        const kvf_text_tok_jv *list = kvf_text_tok_jget(n, "normalizers");
        if (!kvf_text_tok_jis(list, KVF_TEXT_TOK_JARR))
            return fail(c, KVF_ERR_INVALID, "\"normalizer\" Sequence needs a \"normalizers\" array");
        for (const kvf_text_tok_jv *e = kvf_text_tok_jfirst(list); e; e = kvf_text_tok_jnext(e)) {
            kvf_status st = load_normalizer(c, e, depth + 1);
            if (st != KVF_OK)
                return st;
        }
        return KVF_OK;
    }
    if (strcmp(type, "NFC") == 0)
        d.kind = KVF_TEXT_TOK_NORM_NFC;
    else if (strcmp(type, "NFD") == 0)
        d.kind = KVF_TEXT_TOK_NORM_NFD;
    else if (strcmp(type, "NFKC") == 0)
        d.kind = KVF_TEXT_TOK_NORM_NFKC;
    else if (strcmp(type, "NFKD") == 0)
        d.kind = KVF_TEXT_TOK_NORM_NFKD;
    else if (strcmp(type, "Lowercase") == 0)
        d.kind = KVF_TEXT_TOK_NORM_LOWERCASE;
    else if (strcmp(type, "Prepend") == 0) {
        const kvf_text_tok_jv *p = kvf_text_tok_jget(n, "prepend");
        if (!kvf_text_tok_jis(p, KVF_TEXT_TOK_JSTR))
            return fail(c, KVF_ERR_INVALID, "\"normalizer\" Prepend needs a string \"prepend\"");
        d.kind = KVF_TEXT_TOK_NORM_PREPEND;
        d.a_len = (size_t)(p)->len;
        d.a = dup_bytes(kvf_text_tok_jstr(p), d.a_len);
    } else if (strcmp(type, "Replace") == 0) {
        const kvf_text_tok_jv *pat = kvf_text_tok_jget(kvf_text_tok_jget(n, "pattern"), "String");
        const kvf_text_tok_jv *content = kvf_text_tok_jget(n, "content");
        if (kvf_text_tok_jget(kvf_text_tok_jget(n, "pattern"), "Regex"))
            return fail(c, KVF_ERR_UNSUPPORTED, "\"normalizer\" Replace with a Regex pattern is not supported (only String)");
        if (!kvf_text_tok_jis(pat, KVF_TEXT_TOK_JSTR) || (size_t)(pat)->len == 0 || !kvf_text_tok_jis(content, KVF_TEXT_TOK_JSTR))
            return fail(c, KVF_ERR_INVALID, "\"normalizer\" Replace needs {\"pattern\": {\"String\": non-empty}, \"content\": string}");
        d.kind = KVF_TEXT_TOK_NORM_REPLACE;
        d.a_len = (size_t)(pat)->len;
        d.a = dup_bytes(kvf_text_tok_jstr(pat), d.a_len);
        d.b_len = (size_t)(content)->len;
        d.b = dup_bytes(kvf_text_tok_jstr(content), d.b_len);
    } else {
        return fail(c, KVF_ERR_UNSUPPORTED,
                    "normalizer \"%.64s\" is not supported (NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Sequence)",
                    type);
    }
    if ((d.kind == KVF_TEXT_TOK_NORM_PREPEND || d.kind == KVF_TEXT_TOK_NORM_REPLACE) &&
        (!d.a || (d.kind == KVF_TEXT_TOK_NORM_REPLACE && !d.b))) {
        free(d.a);
        free(d.b);
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    }
    return add_norm(c, d);
}

/* ---- pre-tokenizer ---- */

static kvf_status compile_re(load_ctx *c, const char *pat, size_t len, bool literal, void **out)
{
    int code;
    PCRE2_SIZE off;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, opts, &code, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return fail(c, KVF_ERR_INVALID, "pre_tokenizer regex \"%.80s\": %s at offset %zu", pat,
                    (const char *)msg, (size_t)off);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* optional: falls back to the interpreter */
    *out = re;
    return KVF_OK;
}

static kvf_status add_pre(load_ctx *c, kvf_text_tok_pre p)
{
    kvf_text_tokenizer *t = c->tok;
    kvf_text_tok_pre *a = realloc(t->pres, (t->n_pres + 1) * sizeof *a);
    if (!a) {
        pcre2_code_free(p.re);
        free(p.repl);
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    }
    t->pres = a;
    t->pres[t->n_pres++] = p;
    return KVF_OK;
}

static kvf_status parse_prepend_scheme(load_ctx *c, const kvf_text_tok_jv *n, kvf_text_tok_prepend *out)
{
    const char *s = jstr(n, "prepend_scheme");
    if (s) {
        if (strcmp(s, "always") == 0)
            *out = KVF_TEXT_TOK_PREPEND_ALWAYS;
        else if (strcmp(s, "first") == 0)
            *out = KVF_TEXT_TOK_PREPEND_FIRST;
        else if (strcmp(s, "never") == 0)
            *out = KVF_TEXT_TOK_PREPEND_NEVER;
        else
            return fail(c, KVF_ERR_INVALID, "Metaspace \"prepend_scheme\" is \"%.32s\" (use always, first or never)", s);
        return KVF_OK;
    }
    const kvf_text_tok_jv *aps = kvf_text_tok_jget(n, "add_prefix_space"); /* the older spelling */
    *out = (!aps || kvf_text_tok_jtrue(aps)) ? KVF_TEXT_TOK_PREPEND_ALWAYS : KVF_TEXT_TOK_PREPEND_NEVER;
    return KVF_OK;
}

static kvf_status load_pre(load_ctx *c, const kvf_text_tok_jv *n, int depth)
{
    if (!n || kvf_text_tok_jis(n, KVF_TEXT_TOK_JNULL))
        return KVF_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return fail(c, KVF_ERR_INVALID, "\"pre_tokenizer\" has no string \"type\"");
    if (depth > 8)
        return fail(c, KVF_ERR_LIMIT, "\"pre_tokenizer\" nests Sequences more than 8 deep");
    kvf_text_tok_pre p = {0};
    kvf_status st;
    if (strcmp(type, "Sequence") == 0) {
        const kvf_text_tok_jv *list = kvf_text_tok_jget(n, "pretokenizers");
        if (!kvf_text_tok_jis(list, KVF_TEXT_TOK_JARR))
            return fail(c, KVF_ERR_INVALID, "\"pre_tokenizer\" Sequence needs a \"pretokenizers\" array");
        for (const kvf_text_tok_jv *e = kvf_text_tok_jfirst(list); e; e = kvf_text_tok_jnext(e))
            if ((st = load_pre(c, e, depth + 1)) != KVF_OK)
                return st;
        return KVF_OK;
    }
    if (strcmp(type, "Split") == 0) {
        const kvf_text_tok_jv *pat = kvf_text_tok_jget(n, "pattern");
        const kvf_text_tok_jv *re = kvf_text_tok_jget(pat, "Regex"), *lit = kvf_text_tok_jget(pat, "String");
        const char *beh = jstr(n, "behavior");
        if (!kvf_text_tok_jis(re, KVF_TEXT_TOK_JSTR) && !kvf_text_tok_jis(lit, KVF_TEXT_TOK_JSTR))
            return fail(c, KVF_ERR_INVALID, "\"pre_tokenizer\" Split needs \"pattern\": {\"Regex\": ...} or {\"String\": ...}");
        if (kvf_text_tok_jtrue(kvf_text_tok_jget(n, "invert")))
            return fail(c, KVF_ERR_UNSUPPORTED, "\"pre_tokenizer\" Split with \"invert\": true is not supported");
        p.kind = KVF_TEXT_TOK_PRE_SPLIT;
        if (!beh || strcmp(beh, "Isolated") == 0)
            p.behavior = KVF_TEXT_TOK_SPLIT_ISOLATED;
        else if (strcmp(beh, "Removed") == 0)
            p.behavior = KVF_TEXT_TOK_SPLIT_REMOVED;
        else if (strcmp(beh, "MergedWithPrevious") == 0)
            p.behavior = KVF_TEXT_TOK_SPLIT_MERGED_PREV;
        else if (strcmp(beh, "MergedWithNext") == 0)
            p.behavior = KVF_TEXT_TOK_SPLIT_MERGED_NEXT;
        else
            return fail(c, KVF_ERR_UNSUPPORTED,
                        "\"pre_tokenizer\" Split \"behavior\" \"%.32s\" is not supported (Isolated, Removed, MergedWithPrevious, MergedWithNext)",
                        beh);
        const kvf_text_tok_jv *s = kvf_text_tok_jis(re, KVF_TEXT_TOK_JSTR) ? re : lit;
        if ((size_t)(s)->len == 0)
            return fail(c, KVF_ERR_INVALID, "\"pre_tokenizer\" Split has an empty pattern");
        if ((st = compile_re(c, kvf_text_tok_jstr(s), (size_t)(s)->len, s == lit, &p.re)) != KVF_OK)
            return st;
    } else if (strcmp(type, "ByteLevel") == 0) {
        p.kind = KVF_TEXT_TOK_PRE_BYTELEVEL;
        p.add_prefix_space = kvf_text_tok_jtrue(kvf_text_tok_jget(n, "add_prefix_space"));
        const kvf_text_tok_jv *ur = kvf_text_tok_jget(n, "use_regex");
        if (!ur || kvf_text_tok_jtrue(ur))
            if ((st = compile_re(c, kvf_text_tok_gpt2_regex, strlen(kvf_text_tok_gpt2_regex), false, &p.re)) != KVF_OK)
                return st;
        c->tok->byte_level = true;
    } else if (strcmp(type, "Metaspace") == 0) {
        p.kind = KVF_TEXT_TOK_PRE_METASPACE;
        const char *r = jstr(n, "replacement");
        if (!r)
            r = "\xE2\x96\x81";
        p.repl_len = strlen(r);
        if (p.repl_len == 0)
            return fail(c, KVF_ERR_INVALID, "Metaspace \"replacement\" is empty");
        p.repl = dup_bytes(r, p.repl_len);
        if (!p.repl)
            return fail(c, KVF_ERR_NOMEM, "out of memory");
        if ((st = parse_prepend_scheme(c, n, &p.prepend)) != KVF_OK) {
            free(p.repl);
            return st;
        }
        const kvf_text_tok_jv *sp = kvf_text_tok_jget(n, "split");
        p.split = !sp || kvf_text_tok_jtrue(sp);
    } else if (strcmp(type, "Digits") == 0) {
        p.kind = KVF_TEXT_TOK_PRE_DIGITS;
        p.individual = kvf_text_tok_jtrue(kvf_text_tok_jget(n, "individual_digits"));
    } else {
        return fail(c, KVF_ERR_UNSUPPORTED,
                    "pre_tokenizer \"%.64s\" is not supported (Split, ByteLevel, Metaspace, Digits, Sequence)", type);
    }
    return add_pre(c, p);
}

/* ---- post-processor ---- */

static kvf_status push_id(load_ctx *c, int32_t **arr, size_t *n, int32_t id)
{
    int32_t *a = realloc(*arr, (*n + 1) * sizeof *a);
    if (!a)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    a[(*n)++] = id;
    *arr = a;
    return KVF_OK;
}

static kvf_status special_ids(load_ctx *c, const kvf_text_tok_jv *specials, const char *name, int32_t **arr,
                              size_t *n)
{
    const kvf_text_tok_jv *ids = kvf_text_tok_jget(kvf_text_tok_jget(specials, name), "ids");
    if (!kvf_text_tok_jis(ids, KVF_TEXT_TOK_JARR))
        return fail(c, KVF_ERR_INVALID, "\"post_processor\": special token \"%.64s\" has no \"ids\" list", name);
    for (const kvf_text_tok_jv *v = kvf_text_tok_jfirst(ids); v; v = kvf_text_tok_jnext(v)) {
        if (!jint(v) || (v)->i < 0 || (v)->i >= c->tok->n_ids)
            return fail(c, KVF_ERR_INVALID, "\"post_processor\": special token \"%.64s\" has an id outside the vocabulary (0..%d)",
                        name, c->tok->n_ids - 1);
        kvf_status st = push_id(c, arr, n, (int32_t)(v)->i);
        if (st != KVF_OK)
            return st;
    }
    return KVF_OK;
}

static kvf_status pair_id(load_ctx *c, const kvf_text_tok_jv *p, const char *key, int32_t **arr, size_t *n)
{
    const kvf_text_tok_jv *v = kvf_text_tok_jget(p, key);
    const kvf_text_tok_jv *id = kvf_text_tok_jat(v, 1);
    if (!jint(id) || (id)->i < 0 || (id)->i >= c->tok->n_ids)
        return fail(c, KVF_ERR_INVALID, "\"post_processor\" \"%s\" must be [token, id] with an id in the vocabulary", key);
    return push_id(c, arr, n, (int32_t)(id)->i);
}

static kvf_status load_post(load_ctx *c, const kvf_text_tok_jv *n, int depth)
{
    kvf_text_tokenizer *t = c->tok;
    if (!n || kvf_text_tok_jis(n, KVF_TEXT_TOK_JNULL))
        return KVF_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return fail(c, KVF_ERR_INVALID, "\"post_processor\" has no string \"type\"");
    if (depth > 8)
        return fail(c, KVF_ERR_LIMIT, "\"post_processor\" nests Sequences more than 8 deep");
    kvf_status st;
    if (strcmp(type, "Sequence") == 0) {
        const kvf_text_tok_jv *list = kvf_text_tok_jget(n, "processors");
        if (!kvf_text_tok_jis(list, KVF_TEXT_TOK_JARR))
            return fail(c, KVF_ERR_INVALID, "\"post_processor\" Sequence needs a \"processors\" array");
        for (const kvf_text_tok_jv *e = kvf_text_tok_jfirst(list); e; e = kvf_text_tok_jnext(e))
            if ((st = load_post(c, e, depth + 1)) != KVF_OK)
                return st;
        return KVF_OK;
    }
    if (strcmp(type, "ByteLevel") == 0)
        return KVF_OK; /* offsets only */
    if (strcmp(type, "TemplateProcessing") == 0) {
        const kvf_text_tok_jv *single = kvf_text_tok_jget(n, "single"), *specials = kvf_text_tok_jget(n, "special_tokens");
        if (!kvf_text_tok_jis(single, KVF_TEXT_TOK_JARR))
            return fail(c, KVF_ERR_INVALID, "\"post_processor\" TemplateProcessing needs a \"single\" array");
        bool seen_seq = false;
        const kvf_text_tok_jv *item = kvf_text_tok_jfirst(single);
        for (size_t i = 0; item; i++, item = kvf_text_tok_jnext(item)) {
            const kvf_text_tok_jv *sp = kvf_text_tok_jget(item, "SpecialToken");
            if (kvf_text_tok_jget(item, "Sequence")) {
                seen_seq = true;
                continue;
            }
            const char *name = jstr(sp, "id");
            if (!name)
                return fail(c, KVF_ERR_INVALID, "\"post_processor\".single[%zu] is neither a Sequence nor a SpecialToken with an \"id\"", i);
            st = seen_seq ? special_ids(c, specials, name, &t->suffix_ids, &t->n_suffix)
                          : special_ids(c, specials, name, &t->prefix_ids, &t->n_prefix);
            if (st != KVF_OK)
                return st;
        }
        return KVF_OK;
    }
    if (strcmp(type, "RobertaProcessing") == 0 || strcmp(type, "BertProcessing") == 0) {
        if ((st = pair_id(c, n, "cls", &t->prefix_ids, &t->n_prefix)) != KVF_OK)
            return st;
        return pair_id(c, n, "sep", &t->suffix_ids, &t->n_suffix);
    }
    return fail(c, KVF_ERR_UNSUPPORTED,
                "post_processor \"%.64s\" is not supported (TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence)",
                type);
}

/* ---- decoder ---- */

typedef struct dec_opts {
    bool byte_level, byte_fallback;
    char *from[4], *to[4]; /* Replace steps (borrowed from the JSON) */
    size_t from_len[4], to_len[4], n_repl;
    int32_t strip_start;
} dec_opts;

static kvf_status load_decoder(load_ctx *c, const kvf_text_tok_jv *n, dec_opts *o, int depth)
{
    if (!n || kvf_text_tok_jis(n, KVF_TEXT_TOK_JNULL))
        return KVF_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return fail(c, KVF_ERR_INVALID, "\"decoder\" has no string \"type\"");
    if (depth > 8)
        return fail(c, KVF_ERR_LIMIT, "\"decoder\" nests Sequences more than 8 deep");
    if (strcmp(type, "Sequence") == 0) {
        const kvf_text_tok_jv *list = kvf_text_tok_jget(n, "decoders");
        if (!kvf_text_tok_jis(list, KVF_TEXT_TOK_JARR))
            return fail(c, KVF_ERR_INVALID, "\"decoder\" Sequence needs a \"decoders\" array");
        for (const kvf_text_tok_jv *e = kvf_text_tok_jfirst(list); e; e = kvf_text_tok_jnext(e)) {
            kvf_status st = load_decoder(c, e, o, depth + 1);
            if (st != KVF_OK)
                return st;
        }
        return KVF_OK;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        o->byte_level = true;
    } else if (strcmp(type, "ByteFallback") == 0) {
        o->byte_fallback = true;
    } else if (strcmp(type, "Fuse") == 0) {
        /* decoding joins everything anyway */
    } else if (strcmp(type, "Strip") == 0) {
        const char *content = jstr(n, "content");
        const kvf_text_tok_jv *start = kvf_text_tok_jget(n, "start"), *stop = kvf_text_tok_jget(n, "stop");
        if (!content || strcmp(content, " ") != 0 || (jint(stop) && (stop)->i != 0))
            return fail(c, KVF_ERR_UNSUPPORTED, "\"decoder\" Strip is supported only for content \" \" with \"stop\": 0");
        if (jint(start) && (start)->i > 0)
            o->strip_start = (start)->i > 64 ? 64 : (int32_t)(start)->i;
    } else if (strcmp(type, "Replace") == 0) {
        const kvf_text_tok_jv *pat = kvf_text_tok_jget(kvf_text_tok_jget(n, "pattern"), "String");
        const kvf_text_tok_jv *content = kvf_text_tok_jget(n, "content");
        if (!kvf_text_tok_jis(pat, KVF_TEXT_TOK_JSTR) || (size_t)(pat)->len == 0 || !kvf_text_tok_jis(content, KVF_TEXT_TOK_JSTR))
            return fail(c, KVF_ERR_UNSUPPORTED, "\"decoder\" Replace needs {\"pattern\": {\"String\": non-empty}, \"content\": string}");
        if (o->n_repl == 4)
            return fail(c, KVF_ERR_LIMIT, "\"decoder\" has more than 4 Replace steps");
        o->from[o->n_repl] = (char *)kvf_text_tok_jstr(pat);
        o->from_len[o->n_repl] = (size_t)(pat)->len;
        o->to[o->n_repl] = (char *)kvf_text_tok_jstr(content);
        o->to_len[o->n_repl++] = (size_t)(content)->len;
    } else if (strcmp(type, "Metaspace") == 0) {
        const char *r = jstr(n, "replacement");
        if (!r)
            r = "\xE2\x96\x81";
        if (!*r)
            return fail(c, KVF_ERR_INVALID, "\"decoder\" Metaspace \"replacement\" is empty");
        if (o->n_repl == 4)
            return fail(c, KVF_ERR_LIMIT, "\"decoder\" has more than 4 Replace steps");
        o->from[o->n_repl] = (char *)r;
        o->from_len[o->n_repl] = strlen(r);
        o->to[o->n_repl] = " ";
        o->to_len[o->n_repl++] = 1;
        kvf_text_tok_prepend p;
        kvf_status st = parse_prepend_scheme(c, n, &p);
        if (st != KVF_OK)
            return st;
        if (p != KVF_TEXT_TOK_PREPEND_NEVER)
            o->strip_start = 1;
    } else {
        return fail(c, KVF_ERR_UNSUPPORTED,
                    "decoder \"%.64s\" is not supported (ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace, Sequence)",
                    type);
    }
    return KVF_OK;
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    return -1;
}

/* "<0xNN>" -> NN, or -1. */
static int fallback_byte(const char *s, size_t len)
{
    if (len != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int hi = hexval(s[3]), lo = hexval(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

/* Appends what a model token decodes to. */
static void decode_token(const dec_opts *o, const char *s, size_t len, kvf_sbuf *out)
{
    if (o->byte_level) {
        size_t start = out->len;
        for (size_t i = 0; i < len;) {
            size_t cl = kvf_text_utf8_len((const uint8_t *)s + i, len - i);
            int b = -1;
            if (cl > 0) {
                uint32_t cp = 0;
                const uint8_t *u = (const uint8_t *)s + i;
                if (cl == 1)
                    cp = u[0];
                else if (cl == 2)
                    cp = ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F);
                else if (cl == 3)
                    cp = ((uint32_t)(u[0] & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
                b = cp < 512 ? kvf_text_tok_cp_to_byte(cp) : -1;
            }
            if (b < 0) { /* not a byte-level token: its own UTF-8, as Hugging Face does */
                out->len = start;
                if (out->data)
                    out->data[start] = 0;
                kvf_sbuf_append(out, s, len);
                return;
            }
            kvf_sbuf_putc(out, (char)b);
            i += cl;
        }
        return;
    }
    int fb = o->byte_fallback ? fallback_byte(s, len) : -1;
    if (fb >= 0) {
        kvf_sbuf_putc(out, (char)fb);
        return;
    }
    if (o->n_repl == 0) {
        kvf_sbuf_append(out, s, len);
        return;
    }
    /* Replace steps in order; a token is short, so plain scans are fine. */
    kvf_sbuf cur, next;
    kvf_sbuf_init(&cur);
    kvf_sbuf_init(&next);
    kvf_sbuf_append(&cur, s, len);
    for (size_t r = 0; r < o->n_repl; r++) {
        kvf_sbuf_reset(&next);
        for (size_t i = 0; i < cur.len;) {
            if (i + o->from_len[r] <= cur.len && memcmp(cur.data + i, o->from[r], o->from_len[r]) == 0) {
                kvf_sbuf_append(&next, o->to[r], o->to_len[r]);
                i += o->from_len[r];
            } else {
                kvf_sbuf_putc(&next, cur.data[i++]);
            }
        }
        kvf_sbuf t = cur;
        cur = next;
        next = t;
    }
    kvf_sbuf_append(out, cur.data ? cur.data : "", cur.len);
    kvf_sbuf_fini(&cur);
    kvf_sbuf_fini(&next);
}

/* Fills dec_off/dec_len for every id, and the initial-symbol table byte_id. */
static kvf_status build_tables(load_ctx *c, const dec_opts *o)
{
    kvf_text_tokenizer *t = c->tok;
    size_t n = (size_t)t->n_ids;
    t->dec_off = malloc((n ? n : 1) * sizeof *t->dec_off);
    t->dec_len = malloc((n ? n : 1) * sizeof *t->dec_len);
    if (!t->dec_off || !t->dec_len)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    kvf_sbuf_reserve(&t->dec, t->strs.len + 16);
    for (size_t id = 0; id < n; id++) {
        t->dec_off[id] = (int64_t)t->dec.len;
        if (t->str_len[id] >= 0)
            decode_token(o, t->strs.data + t->str_off[id], (size_t)t->str_len[id], &t->dec);
        t->dec_len[id] = (int32_t)((int64_t)t->dec.len - t->dec_off[id]);
    }
    t->added_idx = malloc((n ? n : 1) * sizeof *t->added_idx);
    if (!t->added_idx)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    for (size_t id = 0; id < n; id++)
        t->added_idx[id] = -1;
    for (size_t i = 0; i < t->n_added; i++) { /* added tokens decode to their own text */
        if (t->added_idx[t->added[i].id] < 0)
            t->added_idx[t->added[i].id] = (int32_t)i;
        const kvf_text_tok_added *a = &t->added[i];
        t->dec_off[a->id] = (int64_t)t->dec.len;
        kvf_sbuf_append(&t->dec, a->content, a->len);
        t->dec_len[a->id] = (int32_t)a->len;
    }
    if (t->dec.oom)
        return fail(c, KVF_ERR_NOMEM, "out of memory for the decoding table");
    t->strip_start = o->strip_start;

    /* SentencePiece-style files have no pre-tokenizer, so a whole prompt is one BPE word. When
     * no token holds "▁" after another character, no merge can cross a word start, and BPE
     * word by word gives the same ids far faster (the heap stays in cache). */
    t->word_split = t->n_pres == 0 && !t->byte_level;
    for (size_t id = 0; t->word_split && id < n; id++) {
        const char *s = t->strs.data + t->str_off[id];
        for (int32_t i = 1; t->str_len[id] >= 0 && i + 3 <= t->str_len[id]; i++)
            if (memcmp(s + i, "\xE2\x96\x81", 3) == 0 && !(i >= 3 && memcmp(s + i - 3, "\xE2\x96\x81", 3) == 0)) {
                t->word_split = false;
                break;
            }
    }

    for (int b = 0; b < 256; b++) {
        char buf[8];
        size_t len;
        if (t->byte_level) {
            len = kvf_text_utf8_put(kvf_text_tok_byte_to_cp((uint8_t)b), buf);
        } else {
            len = (size_t)snprintf(buf, sizeof buf, "<0x%02X>", b);
        }
        t->byte_id[b] = kvf_text_tok_vocab_find(t, buf, len);
    }
    return KVF_OK;
}

/* ---- companions: tokenizer_config.json, generation_config.json ---- */

/* A token given as "text" or {"content": "text"}; NULL for null or absent. */
static const char *config_token(const kvf_text_tok_jv *cfg, const char *key)
{
    const kvf_text_tok_jv *v = kvf_text_tok_jget(cfg, key);
    if (kvf_text_tok_jis(v, KVF_TEXT_TOK_JOBJ))
        v = kvf_text_tok_jget(v, "content");
    return kvf_text_tok_jis(v, KVF_TEXT_TOK_JSTR) ? kvf_text_tok_jstr(v) : NULL;
}

static int32_t find_token(const kvf_text_tokenizer *t, const char *s)
{
    if (!s)
        return -1;
    int32_t id = kvf_text_tok_added_find(t, s, strlen(s));
    return id >= 0 ? id : kvf_text_tok_vocab_find(t, s, strlen(s));
}

static kvf_status set_str(load_ctx *c, char **dst, const char *s)
{
    free(*dst);
    *dst = NULL;
    if (!s)
        return KVF_OK;
    *dst = dup_bytes(s, strlen(s));
    return *dst ? KVF_OK : fail(c, KVF_ERR_NOMEM, "out of memory");
}

static kvf_status add_eos(load_ctx *c, int32_t id)
{
    kvf_text_tokenizer *t = c->tok;
    if (id < 0)
        return KVF_OK;
    for (size_t i = 0; i < t->n_eos_ids; i++)
        if (t->eos_ids[i] == id)
            return KVF_OK;
    return push_id(c, &t->eos_ids, &t->n_eos_ids, id);
}

static kvf_status gen_id(load_ctx *c, const kvf_text_tok_jv *v, const char *key, int32_t *out)
{
    *out = -1; /* set on every path: fail()'s status is not visible to the compiler */
    double d = kvf_text_tok_jis(v, KVF_TEXT_TOK_JNUM) ? (v)->d : -1;
    if (!(d >= 0 && d < c->tok->n_ids) || d != (double)(int32_t)d)
        return fail(c, KVF_ERR_INVALID, "\"%s\" is %s, expected an id in 0..%d", key, kvf_text_tok_jkind(v),
                    c->tok->n_ids - 1);
    *out = (int32_t)d;
    return KVF_OK;
}

static kvf_status load_companions(load_ctx *c, const kvf_text_tok_jv *cfg, const kvf_text_tok_jv *gen, bool has_post)
{
    kvf_text_tokenizer *t = c->tok;
    kvf_status st;
    if (cfg) {
        c->what = c->names->cfg;
        if (!kvf_text_tok_jis(cfg, KVF_TEXT_TOK_JOBJ))
            return fail(c, KVF_ERR_INVALID, "expected an object, found %s", kvf_text_tok_jkind(cfg));
        if ((st = set_str(c, &t->bos_token, config_token(cfg, "bos_token"))) != KVF_OK ||
            (st = set_str(c, &t->eos_token, config_token(cfg, "eos_token"))) != KVF_OK ||
            (st = set_str(c, &t->pad_token, config_token(cfg, "pad_token"))) != KVF_OK)
            return st;
        const kvf_text_tok_jv *tpl = kvf_text_tok_jget(cfg, "chat_template");
        if (kvf_text_tok_jis(tpl, KVF_TEXT_TOK_JARR)) { /* [{"name": "default", "template": ...}, ...] */
            const kvf_text_tok_jv *pick = NULL;
            for (const kvf_text_tok_jv *e = kvf_text_tok_jfirst(tpl); e; e = kvf_text_tok_jnext(e)) {
                const char *name = jstr(e, "name");
                if (!pick || (name && strcmp(name, "default") == 0))
                    pick = e;
            }
            tpl = kvf_text_tok_jget(pick, "template");
        }
        if ((st = set_str(c, &t->chat_template, kvf_text_tok_jis(tpl, KVF_TEXT_TOK_JSTR) ? kvf_text_tok_jstr(tpl) : NULL)) != KVF_OK)
            return st;
        t->bos_id = find_token(t, t->bos_token);
        t->eos_id = find_token(t, t->eos_token);
        t->pad_id = find_token(t, t->pad_token);
        if (t->bos_token && t->bos_id < 0)
            kvf_log(KVF_LOG_WARN, "model: tokenizer: %s: bos_token \"%.64s\" is not in the vocabulary", c->what,
                    t->bos_token);
        if (t->eos_token && t->eos_id < 0)
            kvf_log(KVF_LOG_WARN, "model: tokenizer: %s: eos_token \"%.64s\" is not in the vocabulary", c->what,
                    t->eos_token);
        /* Without a post-processor, add_bos_token/add_eos_token say what encode adds. */
        if (!has_post && kvf_text_tok_jtrue(kvf_text_tok_jget(cfg, "add_bos_token")) && t->bos_id >= 0)
            if ((st = push_id(c, &t->prefix_ids, &t->n_prefix, t->bos_id)) != KVF_OK)
                return st;
        if (!has_post && kvf_text_tok_jtrue(kvf_text_tok_jget(cfg, "add_eos_token")) && t->eos_id >= 0)
            if ((st = push_id(c, &t->suffix_ids, &t->n_suffix, t->eos_id)) != KVF_OK)
                return st;
    }
    if (gen) {
        c->what = c->names->gen;
        if (!kvf_text_tok_jis(gen, KVF_TEXT_TOK_JOBJ))
            return fail(c, KVF_ERR_INVALID, "expected an object, found %s", kvf_text_tok_jkind(gen));
        const kvf_text_tok_jv *v = kvf_text_tok_jget(gen, "bos_token_id");
        if (v && !kvf_text_tok_jis(v, KVF_TEXT_TOK_JNULL)) {
            if ((st = gen_id(c, v, "bos_token_id", &t->bos_id)) != KVF_OK)
                return st;
            if ((st = set_str(c, &t->bos_token, kvf_text_tokenizer_id_to_token(t, t->bos_id))) != KVF_OK)
                return st;
        }
        v = kvf_text_tok_jget(gen, "pad_token_id");
        if (v && !kvf_text_tok_jis(v, KVF_TEXT_TOK_JNULL)) {
            if ((st = gen_id(c, v, "pad_token_id", &t->pad_id)) != KVF_OK)
                return st;
            if ((st = set_str(c, &t->pad_token, kvf_text_tokenizer_id_to_token(t, t->pad_id))) != KVF_OK)
                return st;
        }
        v = kvf_text_tok_jget(gen, "eos_token_id");
        if (kvf_text_tok_jis(v, KVF_TEXT_TOK_JARR)) {
            for (const kvf_text_tok_jv *e = kvf_text_tok_jfirst(v); e; e = kvf_text_tok_jnext(e)) {
                int32_t id;
                if ((st = gen_id(c, e, "eos_token_id", &id)) != KVF_OK ||
                    (st = add_eos(c, id)) != KVF_OK)
                    return st;
            }
        } else if (v && !kvf_text_tok_jis(v, KVF_TEXT_TOK_JNULL)) {
            int32_t id;
            if ((st = gen_id(c, v, "eos_token_id", &id)) != KVF_OK || (st = add_eos(c, id)) != KVF_OK)
                return st;
        }
        if (t->n_eos_ids > 0) {
            t->eos_id = t->eos_ids[0];
            if ((st = set_str(c, &t->eos_token, kvf_text_tokenizer_id_to_token(t, t->eos_id))) != KVF_OK)
                return st;
        }
    }
    return add_eos(c, t->eos_id);
}

/* ---- entry points ---- */

static kvf_status load_json(const kvf_text_tok_jv *root, const kvf_text_tok_jv *cfg, const kvf_text_tok_jv *gen,
                            const file_names *names,
                            kvf_text_tokenizer **out, kvf_err *err)
{
    kvf_text_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
    kvf_sbuf_init(&t->strs);
    kvf_sbuf_init(&t->dec);
    t->unk_id = t->bos_id = t->eos_id = t->pad_id = -1;
    load_ctx c = {t, names->tok, err, names};
    dec_opts dec = {0};
    kvf_status st;
    if (!kvf_text_tok_jis(root, KVF_TEXT_TOK_JOBJ)) {
        st = fail(&c, KVF_ERR_INVALID, "expected an object, found %s", kvf_text_tok_jkind(root));
        goto fail_tok;
    }
    const kvf_text_tok_jv *post = kvf_text_tok_jget(root, "post_processor");
    if ((st = load_model(&c, kvf_text_tok_jget(root, "model"))) != KVF_OK ||
        (st = load_added(&c, kvf_text_tok_jget(root, "added_tokens"))) != KVF_OK ||
        (st = load_normalizer(&c, kvf_text_tok_jget(root, "normalizer"), 0)) != KVF_OK ||
        (st = load_pre(&c, kvf_text_tok_jget(root, "pre_tokenizer"), 0)) != KVF_OK ||
        (st = load_post(&c, post, 0)) != KVF_OK ||
        (st = load_decoder(&c, kvf_text_tok_jget(root, "decoder"), &dec, 0)) != KVF_OK ||
        (st = build_tables(&c, &dec)) != KVF_OK ||
        (st = load_companions(&c, cfg, gen, post && !kvf_text_tok_jis(post, KVF_TEXT_TOK_JNULL))) != KVF_OK)
        goto fail_tok;
    *out = t;
    return KVF_OK;
fail_tok:
    kvf_text_tokenizer_destroy(t);
    return st;
}

/* Parses the three texts in place (taking all three buffers, each NUL-terminated; cj and gj
 * may be NULL) and loads them. */
static kvf_status load_owned(char *tj, size_t tl, char *cj, size_t cl, char *gj, size_t gl, const file_names *names,
                             kvf_text_tokenizer **out, kvf_err *err)
{
    kvf_text_tok_jdoc root = {0}, cfg = {0}, gen = {0};
    kvf_status st = kvf_text_tok_json_parse_owned(tj, tl, names->tok, &root, err);
    tj = NULL;
    if (st == KVF_OK && cj) {
        st = kvf_text_tok_json_parse_owned(cj, cl, names->cfg, &cfg, err);
        cj = NULL;
    }
    if (st == KVF_OK && gj) {
        st = kvf_text_tok_json_parse_owned(gj, gl, names->gen, &gen, err);
        gj = NULL;
    }
    if (st == KVF_OK)
        st = load_json(kvf_text_tok_json_root(&root), kvf_text_tok_json_root(&cfg), kvf_text_tok_json_root(&gen),
                       names, out, err);
    free(cj);
    free(gj);
    kvf_text_tok_json_free(&root);
    kvf_text_tok_json_free(&cfg);
    kvf_text_tok_json_free(&gen);
    return st;
}

static char *dup_text(const char *s, size_t n)
{
    return s ? dup_bytes(s, n) : NULL;
}

kvf_status kvf_text_tokenizer_load_buf(const char *tok_json, size_t tok_len, const char *config_json,
                                        size_t config_len, const char *gen_json, size_t gen_len,
                                        kvf_text_tokenizer **out, kvf_err *err)
{
    char *tj = dup_text(tok_json ? tok_json : "", tok_len), *cj = dup_text(config_json, config_len),
         *gj = dup_text(gen_json, gen_len);
    if (!tj || (config_json && !cj) || (gen_json && !gj)) {
        free(tj);
        free(cj);
        free(gj);
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
    }
    static const file_names names = {"tokenizer.json", "tokenizer_config.json", "generation_config.json"};
    return load_owned(tj, tok_len, cj, config_len, gj, gen_len, &names, out, err);
}

/* Reads a whole file into a NUL-terminated buffer; *out is malloc'd. */
static kvf_status read_file(const char *path, char **out, size_t *len, kvf_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "tokenizer: cannot open %s", path);
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < 0 || sb.st_size >= INT32_MAX) {
        fclose(f);
        return kvf_err_set(err, KVF_ERR_IO, "tokenizer: %s is not a regular file under 2 GiB", path);
    }
    size_t n = (size_t)sb.st_size;
    char *buf = malloc(n + 1);
    if (!buf) {
        fclose(f);
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory reading %s", path);
    }
    size_t got = fread(buf, 1, n, f);
    int bad = ferror(f) || got != n;
    fclose(f);
    if (bad) {
        free(buf);
        return kvf_err_set(err, KVF_ERR_IO, "tokenizer: cannot read %s", path);
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return KVF_OK;
}

kvf_status kvf_text_tokenizer_load(const char *path, kvf_text_tokenizer **out, kvf_err *err)
{
    char dir[4096], file[4200];
    struct stat sb;
    if (!path || !*path)
        return kvf_err_set(err, KVF_ERR_INVALID, "tokenizer: no path given (a model directory or a tokenizer.json)");
    if (stat(path, &sb) != 0)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "tokenizer: %s does not exist", path);
    if (S_ISDIR(sb.st_mode)) {
        snprintf(dir, sizeof dir, "%s", path);
        snprintf(file, sizeof file, "%s/tokenizer.json", dir);
    } else {
        snprintf(file, sizeof file, "%s", path);
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash)
            *slash = 0;
        else
            snprintf(dir, sizeof dir, ".");
    }
    char *tj = NULL, *cj = NULL, *gj = NULL;
    size_t tl = 0, cl = 0, gl = 0;
    char cpath[4200], gpath[4200];
    snprintf(cpath, sizeof cpath, "%s/tokenizer_config.json", dir);
    snprintf(gpath, sizeof gpath, "%s/generation_config.json", dir);
    kvf_status st = read_file(file, &tj, &tl, err);
    if (st != KVF_OK)
        return st;
    kvf_err ignore;
    if (read_file(cpath, &cj, &cl, &ignore) != KVF_OK)
        cj = NULL;
    if (read_file(gpath, &gj, &gl, &ignore) != KVF_OK)
        gj = NULL;
    file_names names = {file, cpath, gpath};
    st = load_owned(tj, tl, cj, cl, gj, gl, &names, out, err);
    return st;
}

void kvf_text_tokenizer_destroy(kvf_text_tokenizer *t)
{
    if (!t)
        return;
    free(t->str_off);
    free(t->str_len);
    kvf_sbuf_fini(&t->strs);
    kvf_text_tok_strmap_fini(&t->vocab);
    free(t->merges.slots);
    for (size_t i = 0; i < t->n_norms; i++) {
        free(t->norms[i].a);
        free(t->norms[i].b);
    }
    free(t->norms);
    for (size_t i = 0; i < t->n_pres; i++) {
        pcre2_code_free(t->pres[i].re);
        free(t->pres[i].repl);
    }
    free(t->pres);
    for (size_t i = 0; i < t->n_added; i++)
        free(t->added[i].content);
    free(t->added);
    kvf_text_tok_strmap_fini(&t->added_map);
    free(t->added_lens);
    free(t->is_special);
    free(t->added_idx);
    free(t->prefix_ids);
    free(t->suffix_ids);
    free(t->dec_off);
    free(t->dec_len);
    kvf_sbuf_fini(&t->dec);
    free(t->bos_token);
    free(t->eos_token);
    free(t->pad_token);
    free(t->chat_template);
    free(t->eos_ids);
    free(t);
}

/* ---- accessors ---- */

int32_t kvf_text_tokenizer_token_to_id(const kvf_text_tokenizer *t, const char *s)
{
    return t ? find_token(t, s) : -1;
}

const char *kvf_text_tokenizer_id_to_token(const kvf_text_tokenizer *t, int32_t id)
{
    if (!t || id < 0 || id >= t->n_ids)
        return NULL;
    if (t->added_idx && t->added_idx[id] >= 0)
        return t->added[t->added_idx[id]].content;
    return t->str_len[id] >= 0 ? t->strs.data + t->str_off[id] : NULL;
}

int32_t kvf_text_tokenizer_vocab_size(const kvf_text_tokenizer *t) { return t ? t->n_ids : 0; }

/* Why the bound holds: the normalizers shorten text at most 4 times (a character of at most 4
 * bytes becomes at least one byte; Prepend only adds), the pre-tokenizers never shorten it
 * (ByteLevel maps each byte to a character of 1 or 2 bytes, Metaspace ' ' to a 3-byte one), and
 * every piece is then spelled by tokens whose vocabulary forms concatenate to it (byte fallback
 * spells a byte as "<0xNN>", an unknown character becomes one unknown token); added tokens match
 * their content exactly. */
int64_t kvf_text_tokenizer_max_bytes_per_token(const kvf_text_tokenizer *t)
{
    if (!t)
        return 0;
    if (!t->byte_level && !t->byte_fallback && (t->unk_id < 0 || t->fuse_unk))
        return 0; /* characters the vocabulary lacks vanish, or runs of them become one token */
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].lstrip || t->added[i].rstrip)
            return 0;
    for (size_t i = 0; i < t->n_pres; i++)
        if (t->pres[i].kind == KVF_TEXT_TOK_PRE_SPLIT && t->pres[i].behavior == KVF_TEXT_TOK_SPLIT_REMOVED)
            return 0;
    int64_t factor = 1;
    for (size_t i = 0; i < t->n_norms; i++) {
        const kvf_text_tok_norm *n = &t->norms[i];
        if (n->kind == KVF_TEXT_TOK_NORM_REPLACE && n->b_len < n->a_len)
            return 0;
        if (n->kind != KVF_TEXT_TOK_NORM_PREPEND && n->kind != KVF_TEXT_TOK_NORM_REPLACE)
            factor = 4;
    }
    int64_t longest = 4;
    for (int32_t id = 0; id < t->n_ids; id++)
        if (t->str_len[id] > longest)
            longest = t->str_len[id];
    for (size_t i = 0; i < t->n_added; i++)
        if ((int64_t)t->added[i].len > longest)
            longest = (int64_t)t->added[i].len;
    return longest * factor;
}

bool kvf_text_tokenizer_is_special(const kvf_text_tokenizer *t, int32_t id)
{
    return t && id >= 0 && id < t->n_ids && t->is_special[id];
}

const char *kvf_text_tokenizer_bos_token(const kvf_text_tokenizer *t) { return t->bos_token; }
const char *kvf_text_tokenizer_eos_token(const kvf_text_tokenizer *t) { return t->eos_token; }
const char *kvf_text_tokenizer_pad_token(const kvf_text_tokenizer *t) { return t->pad_token; }
int32_t kvf_text_tokenizer_bos_id(const kvf_text_tokenizer *t) { return t->bos_id; }
int32_t kvf_text_tokenizer_eos_id(const kvf_text_tokenizer *t) { return t->eos_id; }
int32_t kvf_text_tokenizer_pad_id(const kvf_text_tokenizer *t) { return t->pad_id; }
const char *kvf_text_tokenizer_chat_template(const kvf_text_tokenizer *t) { return t->chat_template; }

const int32_t *kvf_text_tokenizer_eos_ids(const kvf_text_tokenizer *t, size_t *n_out)
{
    *n_out = t->n_eos_ids;
    return t->eos_ids;
}
