/* tokenizer.c: loads tokenizer.json (model vocabulary and merges, normalizer, pre-tokenizer,
 * post-processor, decoder, added tokens) and its companions tokenizer_config.json and
 * generation_config.json into kvf_model_tokenizer. Encoding is in tokenizer_encode.c, decoding
 * in tokenizer_decode.c, the default tokenizer writer in tokenizer_write.c. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/hash.h"
#include "common/json.h"
#include "common/log.h"
#include "model/tokenizer_internal.h"

const char kvf_tok_gpt2_regex[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---- UTF-8 and the byte map ---- */

static int byte_is_printable(int b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

uint32_t kvf_tok_byte_to_cp(uint8_t b)
{
    if (byte_is_printable(b))
        return b;
    uint32_t n = 0; /* count the non-printable bytes before b */
    for (int i = 0; i < b; i++)
        n += !byte_is_printable(i);
    return 256 + n;
}

int kvf_tok_cp_to_byte(uint32_t cp)
{
    if (cp < 256)
        return byte_is_printable((int)cp) ? (int)cp : -1;
    uint32_t n = 0;
    for (int b = 0; b < 256; b++) {
        if (byte_is_printable(b))
            continue;
        if (256 + n == cp)
            return b;
        n++;
    }
    return -1;
}

size_t kvf_tok_utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t kvf_tok_utf8_len(const uint8_t *s, size_t n)
{
    if (n == 0)
        return 0;
    uint8_t c = s[0];
    if (c < 0x80)
        return 1;
    size_t len;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0)
            lo = 0xA0;
        if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0)
            lo = 0x90;
        if (c == 0xF4)
            hi = 0x8F;
    } else
        return 0;
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
    return len;
}

/* ---- maps ---- */

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n * 2)
        c <<= 1;
    return c;
}

kvf_status kvf_tok_strmap_init(kvf_tok_strmap *m, size_t expect)
{
    m->cap = pow2_at_least(expect);
    m->n = 0;
    m->slots = malloc(m->cap * sizeof *m->slots);
    if (!m->slots)
        return KVF_ERR_NOMEM;
    memset(m->slots, 0xFF, m->cap * sizeof *m->slots);
    return KVF_OK;
}

void kvf_tok_strmap_fini(kvf_tok_strmap *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = m->n = 0;
}

static const char *vocab_key(const kvf_model_tokenizer *tok, int32_t id, size_t *len)
{
    *len = (size_t)tok->str_len[id];
    return tok->strs.data + tok->str_off[id];
}

static const char *added_key(const kvf_model_tokenizer *tok, int32_t i, size_t *len)
{
    *len = tok->added[i].len;
    return tok->added[i].content;
}

typedef const char *(*key_fn)(const kvf_model_tokenizer *, int32_t, size_t *);

/* The slot holding s, or the empty slot where it would go. */
static size_t strmap_slot(const kvf_model_tokenizer *tok, const kvf_tok_strmap *m, key_fn key,
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

int32_t kvf_tok_vocab_find(const kvf_model_tokenizer *tok, const char *s, size_t len)
{
    if (!tok->vocab.slots)
        return -1;
    return tok->vocab.slots[strmap_slot(tok, &tok->vocab, vocab_key, s, len)];
}

int32_t kvf_tok_added_find(const kvf_model_tokenizer *tok, const char *s, size_t len)
{
    if (!tok->added_map.slots)
        return -1;
    int32_t i = tok->added_map.slots[strmap_slot(tok, &tok->added_map, added_key, s, len)];
    return i < 0 ? -1 : tok->added[i].id;
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

const kvf_tok_merge *kvf_tok_merge_find(const kvf_tok_mergemap *m, int32_t a, int32_t b)
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

typedef struct load_ctx {
    kvf_model_tokenizer *tok;
    const char *what; /* file name for messages */
    kvf_err *err;
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

static const char *jstr(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
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

static kvf_status check_id(load_ctx *c, const char *where, json_int_t id)
{
    if (id < 0 || id >= KVF_TOK_MAX_ID)
        return fail(c, KVF_ERR_INVALID, "%s: id %lld is out of range (0..%d)", where,
                    (long long)id, KVF_TOK_MAX_ID - 1);
    return KVF_OK;
}

/* Makes room for ids up to max_id (arrays indexed by id). */
static kvf_status grow_ids(load_ctx *c, int32_t n_ids)
{
    kvf_model_tokenizer *t = c->tok;
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

static kvf_status load_vocab(load_ctx *c, const json_t *vocab)
{
    kvf_model_tokenizer *t = c->tok;
    if (!json_is_object(vocab))
        return fail(c, KVF_ERR_INVALID, "\"model.vocab\" is %s, expected an object",
                    kvf_json_kind(vocab));
    size_t n = json_object_size(vocab);
    json_int_t max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        if (!json_is_integer(v))
            return fail(c, KVF_ERR_INVALID, "\"model.vocab\": \"%.64s\" maps to %s, expected an integer id",
                        key, kvf_json_kind(v));
        json_int_t id = json_integer_value(v);
        kvf_status st = check_id(c, "model.vocab", id);
        if (st != KVF_OK)
            return st;
        if (id > max_id)
            max_id = id;
    }
    kvf_status st = grow_ids(c, (int32_t)(max_id + 1));
    if (st != KVF_OK)
        return st;
    if (kvf_tok_strmap_init(&t->vocab, n) != KVF_OK || kvf_sbuf_reserve(&t->strs, n * 8) != KVF_OK)
        return fail(c, KVF_ERR_NOMEM, "out of memory for %zu vocabulary entries", n);
    void *it;
    for (it = json_object_iter((json_t *)vocab); it; it = json_object_iter_next((json_t *)vocab, it)) {
        key = json_object_iter_key(it);
        size_t klen = json_object_iter_key_len(it);
        int32_t id = (int32_t)json_integer_value(json_object_iter_value(it));
        if (t->str_len[id] >= 0)
            return fail(c, KVF_ERR_INVALID, "\"model.vocab\": id %d is given to both \"%.64s\" and \"%.64s\"",
                        id, t->strs.data + t->str_off[id], key);
        t->str_off[id] = (int64_t)t->strs.len;
        t->str_len[id] = (int32_t)klen;
        kvf_sbuf_append(&t->strs, key, klen);
        kvf_sbuf_putc(&t->strs, 0);
        size_t slot = strmap_slot(t, &t->vocab, vocab_key, key, klen);
        t->vocab.slots[slot] = id; /* keys of an object are unique */
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
    kvf_model_tokenizer *t = c->tok;
    int32_t ia = kvf_tok_vocab_find(t, a, a_len), ib = kvf_tok_vocab_find(t, b, b_len);
    if (ia < 0 || ib < 0)
        return fail(c, KVF_ERR_INVALID, "\"model.merges\"[%zu]: \"%.*s\" is not in the vocabulary",
                    rank, clip(ia < 0 ? a_len : b_len), ia < 0 ? a : b);
    char stack[256];
    char *cat = a_len + b_len <= sizeof stack ? stack : malloc(a_len + b_len);
    if (!cat)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    memcpy(cat, a, a_len);
    memcpy(cat + a_len, b, b_len);
    int32_t id = kvf_tok_vocab_find(t, cat, a_len + b_len);
    if (cat != stack)
        free(cat);
    if (id < 0)
        return fail(c, KVF_ERR_INVALID, "\"model.merges\"[%zu]: \"%.*s\" + \"%.*s\" is not in the vocabulary",
                    rank, clip(a_len), a, clip(b_len), b);
    uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    size_t mask = t->merges.cap - 1;
    for (size_t i = (size_t)merge_hash(key) & mask;; i = (i + 1) & mask) {
        kvf_tok_merge *m = &t->merges.slots[i];
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

static kvf_status load_merges(load_ctx *c, const json_t *merges)
{
    kvf_model_tokenizer *t = c->tok;
    if (!merges || json_is_null(merges))
        return KVF_OK;
    if (!json_is_array(merges))
        return fail(c, KVF_ERR_INVALID, "\"model.merges\" is %s, expected an array", kvf_json_kind(merges));
    size_t n = json_array_size(merges);
    if (n >= (size_t)INT32_MAX)
        return fail(c, KVF_ERR_LIMIT, "\"model.merges\" has %zu entries", n);
    t->merges.cap = pow2_at_least(n);
    t->merges.slots = malloc(t->merges.cap * sizeof *t->merges.slots);
    if (!t->merges.slots)
        return fail(c, KVF_ERR_NOMEM, "out of memory for %zu merges", n);
    for (size_t i = 0; i < t->merges.cap; i++)
        t->merges.slots[i].key = UINT64_MAX;
    for (size_t i = 0; i < n; i++) {
        const json_t *m = json_array_get(merges, i);
        kvf_status st;
        if (json_is_string(m)) { /* "a b": the older format */
            const char *s = json_string_value(m);
            size_t len = json_string_length(m);
            const char *sp = memchr(s, ' ', len);
            if (!sp || memchr(sp + 1, ' ', len - (size_t)(sp + 1 - s)))
                return fail(c, KVF_ERR_INVALID, "\"model.merges\"[%zu] is \"%.64s\", expected two tokens separated by one space",
                            i, s);
            st = merges_insert(c, i, s, (size_t)(sp - s), sp + 1, len - (size_t)(sp + 1 - s));
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            const json_t *a = json_array_get(m, 0), *b = json_array_get(m, 1);
            st = merges_insert(c, i, json_string_value(a), json_string_length(a), json_string_value(b),
                               json_string_length(b));
        } else {
            return fail(c, KVF_ERR_INVALID, "\"model.merges\"[%zu] is %s, expected \"a b\" or [\"a\", \"b\"]",
                        i, kvf_json_kind(m));
        }
        if (st != KVF_OK)
            return st;
    }
    return KVF_OK;
}

static kvf_status load_model(load_ctx *c, const json_t *model)
{
    kvf_model_tokenizer *t = c->tok;
    if (!json_is_object(model))
        return fail(c, KVF_ERR_INVALID, "\"model\" is %s, expected an object", kvf_json_kind(model));
    const char *type = jstr(model, "type");
    if (type && strcmp(type, "BPE") != 0)
        return fail(c, KVF_ERR_UNSUPPORTED, "\"model.type\" is \"%s\" (only \"BPE\" is supported)", type);
    if (!type && !json_object_get(model, "merges"))
        return fail(c, KVF_ERR_UNSUPPORTED, "\"model\" has no \"type\" and no \"merges\" (only BPE is supported)");
    const char *pre = jstr(model, "continuing_subword_prefix"), *suf = jstr(model, "end_of_word_suffix");
    if ((pre && *pre) || (suf && *suf))
        return fail(c, KVF_ERR_UNSUPPORTED, "\"model.continuing_subword_prefix\"/\"end_of_word_suffix\" (\"%s\"/\"%s\") are not supported",
                    pre ? pre : "", suf ? suf : "");
    json_t *dropout = json_object_get(model, "dropout");
    if (json_is_number(dropout) && json_number_value(dropout) > 0)
        kvf_log(KVF_LOG_WARN, "model: tokenizer: %s: BPE dropout %g ignored (encoding is deterministic)",
                c->what, json_number_value(dropout));
    kvf_status st = load_vocab(c, json_object_get(model, "vocab"));
    if (st != KVF_OK)
        return st;
    if ((st = load_merges(c, json_object_get(model, "merges"))) != KVF_OK)
        return st;
    t->byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    t->fuse_unk = json_is_true(json_object_get(model, "fuse_unk"));
    t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    const char *unk = jstr(model, "unk_token");
    t->unk_id = -1;
    if (unk) {
        t->unk_id = kvf_tok_vocab_find(t, unk, strlen(unk));
        if (t->unk_id < 0)
            return fail(c, KVF_ERR_INVALID, "\"model.unk_token\" \"%.64s\" is not in the vocabulary", unk);
    }
    return KVF_OK;
}

static int cmp_added(const void *a, const void *b)
{
    const kvf_tok_added *x = a, *y = b;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static kvf_status load_added(load_ctx *c, const json_t *arr)
{
    kvf_model_tokenizer *t = c->tok;
    if (!arr || json_is_null(arr))
        return KVF_OK;
    if (!json_is_array(arr))
        return fail(c, KVF_ERR_INVALID, "\"added_tokens\" is %s, expected an array", kvf_json_kind(arr));
    size_t n = json_array_size(arr);
    t->added = calloc(n ? n : 1, sizeof *t->added);
    if (!t->added)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const json_t *a = json_array_get(arr, i);
        const json_t *id = json_object_get(a, "id"), *content = json_object_get(a, "content");
        if (!json_is_integer(id) || !json_is_string(content) || json_string_length(content) == 0)
            return fail(c, KVF_ERR_INVALID, "\"added_tokens\"[%zu] needs an integer \"id\" and a non-empty string \"content\"", i);
        kvf_status st = check_id(c, "added_tokens", json_integer_value(id));
        if (st != KVF_OK)
            return st;
        kvf_tok_added *d = &t->added[t->n_added++];
        d->id = (int32_t)json_integer_value(id);
        d->len = json_string_length(content);
        d->content = dup_bytes(json_string_value(content), d->len);
        d->special = json_is_true(json_object_get(a, "special"));
        if (!d->content)
            return fail(c, KVF_ERR_NOMEM, "out of memory");
        if ((st = grow_ids(c, d->id + 1)) != KVF_OK)
            return st;
    }
    qsort(t->added, t->n_added, sizeof *t->added, cmp_added);
    if (kvf_tok_strmap_init(&t->added_map, t->n_added) != KVF_OK)
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < t->n_added; i++) {
        kvf_tok_added *d = &t->added[i];
        size_t slot = strmap_slot(t, &t->added_map, added_key, d->content, d->len);
        if (t->added_map.slots[slot] >= 0) {
            kvf_tok_added *o = &t->added[t->added_map.slots[slot]];
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

static kvf_status add_norm(load_ctx *c, kvf_tok_norm n)
{
    kvf_model_tokenizer *t = c->tok;
    kvf_tok_norm *p = realloc(t->norms, (t->n_norms + 1) * sizeof *p);
    if (!p) {
        free(n.a);
        free(n.b);
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    }
    t->norms = p;
    t->norms[t->n_norms++] = n;
    return KVF_OK;
}

static kvf_status load_normalizer(load_ctx *c, const json_t *n, int depth)
{
    if (!n || json_is_null(n))
        return KVF_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return fail(c, KVF_ERR_INVALID, "\"normalizer\" has no string \"type\"");
    if (depth > 8)
        return fail(c, KVF_ERR_LIMIT, "\"normalizer\" nests Sequences more than 8 deep");
    kvf_tok_norm d = {0};
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list))
            return fail(c, KVF_ERR_INVALID, "\"normalizer\" Sequence needs a \"normalizers\" array");
        for (size_t i = 0; i < json_array_size(list); i++) {
            kvf_status st = load_normalizer(c, json_array_get(list, i), depth + 1);
            if (st != KVF_OK)
                return st;
        }
        return KVF_OK;
    }
    if (strcmp(type, "NFC") == 0)
        d.kind = KVF_TOK_NORM_NFC;
    else if (strcmp(type, "NFD") == 0)
        d.kind = KVF_TOK_NORM_NFD;
    else if (strcmp(type, "NFKC") == 0)
        d.kind = KVF_TOK_NORM_NFKC;
    else if (strcmp(type, "NFKD") == 0)
        d.kind = KVF_TOK_NORM_NFKD;
    else if (strcmp(type, "Lowercase") == 0)
        d.kind = KVF_TOK_NORM_LOWERCASE;
    else if (strcmp(type, "Prepend") == 0) {
        const json_t *p = json_object_get(n, "prepend");
        if (!json_is_string(p))
            return fail(c, KVF_ERR_INVALID, "\"normalizer\" Prepend needs a string \"prepend\"");
        d.kind = KVF_TOK_NORM_PREPEND;
        d.a_len = json_string_length(p);
        d.a = dup_bytes(json_string_value(p), d.a_len);
    } else if (strcmp(type, "Replace") == 0) {
        const json_t *pat = json_object_get(json_object_get(n, "pattern"), "String");
        const json_t *content = json_object_get(n, "content");
        if (json_object_get(json_object_get(n, "pattern"), "Regex"))
            return fail(c, KVF_ERR_UNSUPPORTED, "\"normalizer\" Replace with a Regex pattern is not supported (only String)");
        if (!json_is_string(pat) || json_string_length(pat) == 0 || !json_is_string(content))
            return fail(c, KVF_ERR_INVALID, "\"normalizer\" Replace needs {\"pattern\": {\"String\": non-empty}, \"content\": string}");
        d.kind = KVF_TOK_NORM_REPLACE;
        d.a_len = json_string_length(pat);
        d.a = dup_bytes(json_string_value(pat), d.a_len);
        d.b_len = json_string_length(content);
        d.b = dup_bytes(json_string_value(content), d.b_len);
    } else {
        return fail(c, KVF_ERR_UNSUPPORTED,
                    "normalizer \"%.64s\" is not supported (NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Sequence)",
                    type);
    }
    if ((d.kind == KVF_TOK_NORM_PREPEND || d.kind == KVF_TOK_NORM_REPLACE) &&
        (!d.a || (d.kind == KVF_TOK_NORM_REPLACE && !d.b))) {
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

static kvf_status add_pre(load_ctx *c, kvf_tok_pre p)
{
    kvf_model_tokenizer *t = c->tok;
    kvf_tok_pre *a = realloc(t->pres, (t->n_pres + 1) * sizeof *a);
    if (!a) {
        pcre2_code_free(p.re);
        free(p.repl);
        return fail(c, KVF_ERR_NOMEM, "out of memory");
    }
    t->pres = a;
    t->pres[t->n_pres++] = p;
    return KVF_OK;
}

static kvf_status parse_prepend_scheme(load_ctx *c, const json_t *n, kvf_tok_prepend *out)
{
    const char *s = jstr(n, "prepend_scheme");
    if (s) {
        if (strcmp(s, "always") == 0)
            *out = KVF_TOK_PREPEND_ALWAYS;
        else if (strcmp(s, "first") == 0)
            *out = KVF_TOK_PREPEND_FIRST;
        else if (strcmp(s, "never") == 0)
            *out = KVF_TOK_PREPEND_NEVER;
        else
            return fail(c, KVF_ERR_INVALID, "Metaspace \"prepend_scheme\" is \"%.32s\" (use always, first or never)", s);
        return KVF_OK;
    }
    const json_t *aps = json_object_get(n, "add_prefix_space"); /* the older spelling */
    *out = (!aps || json_is_true(aps)) ? KVF_TOK_PREPEND_ALWAYS : KVF_TOK_PREPEND_NEVER;
    return KVF_OK;
}

static kvf_status load_pre(load_ctx *c, const json_t *n, int depth)
{
    if (!n || json_is_null(n))
        return KVF_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return fail(c, KVF_ERR_INVALID, "\"pre_tokenizer\" has no string \"type\"");
    if (depth > 8)
        return fail(c, KVF_ERR_LIMIT, "\"pre_tokenizer\" nests Sequences more than 8 deep");
    kvf_tok_pre p = {0};
    kvf_status st;
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(n, "pretokenizers");
        if (!json_is_array(list))
            return fail(c, KVF_ERR_INVALID, "\"pre_tokenizer\" Sequence needs a \"pretokenizers\" array");
        for (size_t i = 0; i < json_array_size(list); i++)
            if ((st = load_pre(c, json_array_get(list, i), depth + 1)) != KVF_OK)
                return st;
        return KVF_OK;
    }
    if (strcmp(type, "Split") == 0) {
        const json_t *pat = json_object_get(n, "pattern");
        const json_t *re = json_object_get(pat, "Regex"), *lit = json_object_get(pat, "String");
        const char *beh = jstr(n, "behavior");
        if (!json_is_string(re) && !json_is_string(lit))
            return fail(c, KVF_ERR_INVALID, "\"pre_tokenizer\" Split needs \"pattern\": {\"Regex\": ...} or {\"String\": ...}");
        if (json_is_true(json_object_get(n, "invert")))
            return fail(c, KVF_ERR_UNSUPPORTED, "\"pre_tokenizer\" Split with \"invert\": true is not supported");
        p.kind = KVF_TOK_PRE_SPLIT;
        if (!beh || strcmp(beh, "Isolated") == 0)
            p.behavior = KVF_TOK_SPLIT_ISOLATED;
        else if (strcmp(beh, "Removed") == 0)
            p.behavior = KVF_TOK_SPLIT_REMOVED;
        else if (strcmp(beh, "MergedWithPrevious") == 0)
            p.behavior = KVF_TOK_SPLIT_MERGED_PREV;
        else if (strcmp(beh, "MergedWithNext") == 0)
            p.behavior = KVF_TOK_SPLIT_MERGED_NEXT;
        else
            return fail(c, KVF_ERR_UNSUPPORTED,
                        "\"pre_tokenizer\" Split \"behavior\" \"%.32s\" is not supported (Isolated, Removed, MergedWithPrevious, MergedWithNext)",
                        beh);
        const json_t *s = json_is_string(re) ? re : lit;
        if (json_string_length(s) == 0)
            return fail(c, KVF_ERR_INVALID, "\"pre_tokenizer\" Split has an empty pattern");
        if ((st = compile_re(c, json_string_value(s), json_string_length(s), s == lit, &p.re)) != KVF_OK)
            return st;
    } else if (strcmp(type, "ByteLevel") == 0) {
        p.kind = KVF_TOK_PRE_BYTELEVEL;
        p.add_prefix_space = json_is_true(json_object_get(n, "add_prefix_space"));
        const json_t *ur = json_object_get(n, "use_regex");
        if (!ur || json_is_true(ur))
            if ((st = compile_re(c, kvf_tok_gpt2_regex, strlen(kvf_tok_gpt2_regex), false, &p.re)) != KVF_OK)
                return st;
        c->tok->byte_level = true;
    } else if (strcmp(type, "Metaspace") == 0) {
        p.kind = KVF_TOK_PRE_METASPACE;
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
        const json_t *sp = json_object_get(n, "split");
        p.split = !sp || json_is_true(sp);
    } else if (strcmp(type, "Digits") == 0) {
        p.kind = KVF_TOK_PRE_DIGITS;
        p.individual = json_is_true(json_object_get(n, "individual_digits"));
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

static kvf_status special_ids(load_ctx *c, const json_t *specials, const char *name, int32_t **arr,
                              size_t *n)
{
    const json_t *ids = json_object_get(json_object_get(specials, name), "ids");
    if (!json_is_array(ids))
        return fail(c, KVF_ERR_INVALID, "\"post_processor\": special token \"%.64s\" has no \"ids\" list", name);
    for (size_t i = 0; i < json_array_size(ids); i++) {
        const json_t *v = json_array_get(ids, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= c->tok->n_ids)
            return fail(c, KVF_ERR_INVALID, "\"post_processor\": special token \"%.64s\" has an id outside the vocabulary (0..%d)",
                        name, c->tok->n_ids - 1);
        kvf_status st = push_id(c, arr, n, (int32_t)json_integer_value(v));
        if (st != KVF_OK)
            return st;
    }
    return KVF_OK;
}

static kvf_status pair_id(load_ctx *c, const json_t *p, const char *key, int32_t **arr, size_t *n)
{
    const json_t *v = json_object_get(p, key);
    const json_t *id = json_array_get(v, 1);
    if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= c->tok->n_ids)
        return fail(c, KVF_ERR_INVALID, "\"post_processor\" \"%s\" must be [token, id] with an id in the vocabulary", key);
    return push_id(c, arr, n, (int32_t)json_integer_value(id));
}

static kvf_status load_post(load_ctx *c, const json_t *n, int depth)
{
    kvf_model_tokenizer *t = c->tok;
    if (!n || json_is_null(n))
        return KVF_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return fail(c, KVF_ERR_INVALID, "\"post_processor\" has no string \"type\"");
    if (depth > 8)
        return fail(c, KVF_ERR_LIMIT, "\"post_processor\" nests Sequences more than 8 deep");
    kvf_status st;
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(n, "processors");
        if (!json_is_array(list))
            return fail(c, KVF_ERR_INVALID, "\"post_processor\" Sequence needs a \"processors\" array");
        for (size_t i = 0; i < json_array_size(list); i++)
            if ((st = load_post(c, json_array_get(list, i), depth + 1)) != KVF_OK)
                return st;
        return KVF_OK;
    }
    if (strcmp(type, "ByteLevel") == 0)
        return KVF_OK; /* offsets only */
    if (strcmp(type, "TemplateProcessing") == 0) {
        const json_t *single = json_object_get(n, "single"), *specials = json_object_get(n, "special_tokens");
        if (!json_is_array(single))
            return fail(c, KVF_ERR_INVALID, "\"post_processor\" TemplateProcessing needs a \"single\" array");
        bool seen_seq = false;
        for (size_t i = 0; i < json_array_size(single); i++) {
            const json_t *item = json_array_get(single, i);
            const json_t *sp = json_object_get(item, "SpecialToken");
            if (json_object_get(item, "Sequence")) {
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

static kvf_status load_decoder(load_ctx *c, const json_t *n, dec_opts *o, int depth)
{
    if (!n || json_is_null(n))
        return KVF_OK;
    const char *type = jstr(n, "type");
    if (!type)
        return fail(c, KVF_ERR_INVALID, "\"decoder\" has no string \"type\"");
    if (depth > 8)
        return fail(c, KVF_ERR_LIMIT, "\"decoder\" nests Sequences more than 8 deep");
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(n, "decoders");
        if (!json_is_array(list))
            return fail(c, KVF_ERR_INVALID, "\"decoder\" Sequence needs a \"decoders\" array");
        for (size_t i = 0; i < json_array_size(list); i++) {
            kvf_status st = load_decoder(c, json_array_get(list, i), o, depth + 1);
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
        const json_t *start = json_object_get(n, "start"), *stop = json_object_get(n, "stop");
        if (!content || strcmp(content, " ") != 0 || (json_is_integer(stop) && json_integer_value(stop) != 0))
            return fail(c, KVF_ERR_UNSUPPORTED, "\"decoder\" Strip is supported only for content \" \" with \"stop\": 0");
        if (json_is_integer(start) && json_integer_value(start) > 0)
            o->strip_start = json_integer_value(start) > 64 ? 64 : (int32_t)json_integer_value(start);
    } else if (strcmp(type, "Replace") == 0) {
        const json_t *pat = json_object_get(json_object_get(n, "pattern"), "String");
        const json_t *content = json_object_get(n, "content");
        if (!json_is_string(pat) || json_string_length(pat) == 0 || !json_is_string(content))
            return fail(c, KVF_ERR_UNSUPPORTED, "\"decoder\" Replace needs {\"pattern\": {\"String\": non-empty}, \"content\": string}");
        if (o->n_repl == 4)
            return fail(c, KVF_ERR_LIMIT, "\"decoder\" has more than 4 Replace steps");
        o->from[o->n_repl] = (char *)json_string_value(pat);
        o->from_len[o->n_repl] = json_string_length(pat);
        o->to[o->n_repl] = (char *)json_string_value(content);
        o->to_len[o->n_repl++] = json_string_length(content);
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
        kvf_tok_prepend p;
        kvf_status st = parse_prepend_scheme(c, n, &p);
        if (st != KVF_OK)
            return st;
        if (p != KVF_TOK_PREPEND_NEVER)
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
            size_t cl = kvf_tok_utf8_len((const uint8_t *)s + i, len - i);
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
                b = cp < 512 ? kvf_tok_cp_to_byte(cp) : -1;
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
    kvf_model_tokenizer *t = c->tok;
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
        const kvf_tok_added *a = &t->added[i];
        t->dec_off[a->id] = (int64_t)t->dec.len;
        kvf_sbuf_append(&t->dec, a->content, a->len);
        t->dec_len[a->id] = (int32_t)a->len;
    }
    if (t->dec.oom)
        return fail(c, KVF_ERR_NOMEM, "out of memory for the decoding table");
    t->strip_start = o->strip_start;

    for (int b = 0; b < 256; b++) {
        char buf[8];
        size_t len;
        if (t->byte_level) {
            len = kvf_tok_utf8_put(kvf_tok_byte_to_cp((uint8_t)b), buf);
        } else {
            len = (size_t)snprintf(buf, sizeof buf, "<0x%02X>", b);
        }
        t->byte_id[b] = kvf_tok_vocab_find(t, buf, len);
    }
    return KVF_OK;
}

/* ---- companions: tokenizer_config.json, generation_config.json ---- */

/* A token given as "text" or {"content": "text"}; NULL for null or absent. */
static const char *config_token(const json_t *cfg, const char *key)
{
    const json_t *v = json_object_get(cfg, key);
    if (json_is_object(v))
        v = json_object_get(v, "content");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static int32_t find_token(const kvf_model_tokenizer *t, const char *s)
{
    if (!s)
        return -1;
    int32_t id = kvf_tok_added_find(t, s, strlen(s));
    return id >= 0 ? id : kvf_tok_vocab_find(t, s, strlen(s));
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
    kvf_model_tokenizer *t = c->tok;
    if (id < 0)
        return KVF_OK;
    for (size_t i = 0; i < t->n_eos_ids; i++)
        if (t->eos_ids[i] == id)
            return KVF_OK;
    return push_id(c, &t->eos_ids, &t->n_eos_ids, id);
}

static kvf_status gen_id(load_ctx *c, const json_t *v, const char *key, int32_t *out)
{
    double d = json_is_number(v) ? json_number_value(v) : -1;
    if (!(d >= 0 && d < c->tok->n_ids) || d != (double)(int32_t)d)
        return fail(c, KVF_ERR_INVALID, "\"%s\" is %s, expected an id in 0..%d", key, kvf_json_kind(v),
                    c->tok->n_ids - 1);
    *out = (int32_t)d;
    return KVF_OK;
}

static kvf_status load_companions(load_ctx *c, const json_t *cfg, const json_t *gen, bool has_post)
{
    kvf_model_tokenizer *t = c->tok;
    kvf_status st;
    if (cfg) {
        c->what = "tokenizer_config.json";
        if (!json_is_object(cfg))
            return fail(c, KVF_ERR_INVALID, "expected an object, found %s", kvf_json_kind(cfg));
        if ((st = set_str(c, &t->bos_token, config_token(cfg, "bos_token"))) != KVF_OK ||
            (st = set_str(c, &t->eos_token, config_token(cfg, "eos_token"))) != KVF_OK ||
            (st = set_str(c, &t->pad_token, config_token(cfg, "pad_token"))) != KVF_OK)
            return st;
        const json_t *tpl = json_object_get(cfg, "chat_template");
        if (json_is_array(tpl)) { /* [{"name": "default", "template": ...}, ...] */
            const json_t *pick = NULL;
            for (size_t i = 0; i < json_array_size(tpl); i++) {
                const json_t *e = json_array_get(tpl, i);
                const char *name = jstr(e, "name");
                if (!pick || (name && strcmp(name, "default") == 0))
                    pick = e;
            }
            tpl = json_object_get(pick, "template");
        }
        if ((st = set_str(c, &t->chat_template, json_is_string(tpl) ? json_string_value(tpl) : NULL)) != KVF_OK)
            return st;
        t->bos_id = find_token(t, t->bos_token);
        t->eos_id = find_token(t, t->eos_token);
        t->pad_id = find_token(t, t->pad_token);
        if (t->bos_token && t->bos_id < 0)
            kvf_log(KVF_LOG_WARN, "model: tokenizer: tokenizer_config.json: bos_token \"%.64s\" is not in the vocabulary", t->bos_token);
        if (t->eos_token && t->eos_id < 0)
            kvf_log(KVF_LOG_WARN, "model: tokenizer: tokenizer_config.json: eos_token \"%.64s\" is not in the vocabulary", t->eos_token);
        /* Without a post-processor, add_bos_token/add_eos_token say what encode adds. */
        if (!has_post && json_is_true(json_object_get(cfg, "add_bos_token")) && t->bos_id >= 0)
            if ((st = push_id(c, &t->prefix_ids, &t->n_prefix, t->bos_id)) != KVF_OK)
                return st;
        if (!has_post && json_is_true(json_object_get(cfg, "add_eos_token")) && t->eos_id >= 0)
            if ((st = push_id(c, &t->suffix_ids, &t->n_suffix, t->eos_id)) != KVF_OK)
                return st;
    }
    if (gen) {
        c->what = "generation_config.json";
        if (!json_is_object(gen))
            return fail(c, KVF_ERR_INVALID, "expected an object, found %s", kvf_json_kind(gen));
        const json_t *v = json_object_get(gen, "bos_token_id");
        if (v && !json_is_null(v)) {
            if ((st = gen_id(c, v, "bos_token_id", &t->bos_id)) != KVF_OK)
                return st;
            if ((st = set_str(c, &t->bos_token, kvf_model_tokenizer_id_to_token(t, t->bos_id))) != KVF_OK)
                return st;
        }
        v = json_object_get(gen, "pad_token_id");
        if (v && !json_is_null(v)) {
            if ((st = gen_id(c, v, "pad_token_id", &t->pad_id)) != KVF_OK)
                return st;
            if ((st = set_str(c, &t->pad_token, kvf_model_tokenizer_id_to_token(t, t->pad_id))) != KVF_OK)
                return st;
        }
        v = json_object_get(gen, "eos_token_id");
        if (json_is_array(v)) {
            for (size_t i = 0; i < json_array_size(v); i++) {
                int32_t id;
                if ((st = gen_id(c, json_array_get(v, i), "eos_token_id", &id)) != KVF_OK ||
                    (st = add_eos(c, id)) != KVF_OK)
                    return st;
            }
        } else if (v && !json_is_null(v)) {
            int32_t id;
            if ((st = gen_id(c, v, "eos_token_id", &id)) != KVF_OK || (st = add_eos(c, id)) != KVF_OK)
                return st;
        }
        if (t->n_eos_ids > 0) {
            t->eos_id = t->eos_ids[0];
            if ((st = set_str(c, &t->eos_token, kvf_model_tokenizer_id_to_token(t, t->eos_id))) != KVF_OK)
                return st;
        }
    }
    return add_eos(c, t->eos_id);
}

/* ---- entry points ---- */

static kvf_status load_json(const json_t *root, const json_t *cfg, const json_t *gen, const char *what,
                            kvf_model_tokenizer **out, kvf_err *err)
{
    kvf_model_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
    kvf_sbuf_init(&t->strs);
    kvf_sbuf_init(&t->dec);
    t->unk_id = t->bos_id = t->eos_id = t->pad_id = -1;
    load_ctx c = {t, what, err};
    dec_opts dec = {0};
    kvf_status st;
    if (!json_is_object(root)) {
        st = fail(&c, KVF_ERR_INVALID, "expected an object, found %s", kvf_json_kind(root));
        goto fail_tok;
    }
    const json_t *post = json_object_get(root, "post_processor");
    if ((st = load_model(&c, json_object_get(root, "model"))) != KVF_OK ||
        (st = load_added(&c, json_object_get(root, "added_tokens"))) != KVF_OK ||
        (st = load_normalizer(&c, json_object_get(root, "normalizer"), 0)) != KVF_OK ||
        (st = load_pre(&c, json_object_get(root, "pre_tokenizer"), 0)) != KVF_OK ||
        (st = load_post(&c, post, 0)) != KVF_OK ||
        (st = load_decoder(&c, json_object_get(root, "decoder"), &dec, 0)) != KVF_OK ||
        (st = build_tables(&c, &dec)) != KVF_OK ||
        (st = load_companions(&c, cfg, gen, post && !json_is_null(post))) != KVF_OK)
        goto fail_tok;
    *out = t;
    return KVF_OK;
fail_tok:
    kvf_model_tokenizer_destroy(t);
    return st;
}

static kvf_status parse(const char *buf, size_t len, size_t flags, const char *what, json_t **out,
                        kvf_err *err)
{
    json_error_t je;
    *out = json_loadb(buf, len, flags | JSON_ALLOW_NUL, &je);
    if (!*out)
        return kvf_err_set(err, KVF_ERR_PARSE, "tokenizer: %s: line %d column %d: %s", what, je.line,
                           je.column, je.text);
    return KVF_OK;
}

kvf_status kvf_model_tokenizer_load_buf(const char *tok_json, size_t tok_len, const char *config_json,
                                        size_t config_len, const char *gen_json, size_t gen_len,
                                        kvf_model_tokenizer **out, kvf_err *err)
{
    json_t *root = NULL, *cfg = NULL, *gen = NULL;
    kvf_status st;
    /* the companions carry numbers such as 1e30 written as integers: read them as reals */
    if ((st = parse(tok_json, tok_len, 0, "tokenizer.json", &root, err)) != KVF_OK ||
        (config_json && (st = parse(config_json, config_len, JSON_DECODE_INT_AS_REAL,
                                    "tokenizer_config.json", &cfg, err)) != KVF_OK) ||
        (gen_json && (st = parse(gen_json, gen_len, JSON_DECODE_INT_AS_REAL, "generation_config.json",
                                 &gen, err)) != KVF_OK))
        goto done;
    st = load_json(root, cfg, gen, "tokenizer.json", out, err);
done:
    json_decref(root);
    json_decref(cfg);
    json_decref(gen);
    return st;
}

/* Reads a whole file; *out is malloc'd. A missing optional file gives NOT_FOUND. */
static kvf_status read_file(const char *path, char **out, size_t *len, kvf_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "tokenizer: cannot open %s", path);
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0)
        kvf_sbuf_append(&b, chunk, n);
    int bad = ferror(f);
    fclose(f);
    if (bad || b.oom) {
        kvf_sbuf_fini(&b);
        return kvf_err_set(err, bad ? KVF_ERR_IO : KVF_ERR_NOMEM, "tokenizer: cannot read %s", path);
    }
    *len = b.len;
    *out = kvf_sbuf_take(&b);
    if (!*out)
        *out = calloc(1, 1);
    return *out ? KVF_OK : kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
}

kvf_status kvf_model_tokenizer_load(const char *path, kvf_model_tokenizer **out, kvf_err *err)
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
    st = kvf_model_tokenizer_load_buf(tj, tl, cj, cl, gj, gl, out, err);
    if (st != KVF_OK) {
        /* name the file: the messages say "tokenizer.json: ..." */
        const char *m = err ? err->msg : "";
        const char *which = strstr(m, "tokenizer_config.json") ? cpath
                            : strstr(m, "generation_config.json") ? gpath
                                                                  : file;
        if (err)
            kvf_err_prefix(err, "%s", which);
    }
    free(tj);
    free(cj);
    free(gj);
    return st;
}

void kvf_model_tokenizer_destroy(kvf_model_tokenizer *t)
{
    if (!t)
        return;
    free(t->str_off);
    free(t->str_len);
    kvf_sbuf_fini(&t->strs);
    kvf_tok_strmap_fini(&t->vocab);
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
    kvf_tok_strmap_fini(&t->added_map);
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

int32_t kvf_model_tokenizer_token_to_id(const kvf_model_tokenizer *t, const char *s)
{
    return t ? find_token(t, s) : -1;
}

const char *kvf_model_tokenizer_id_to_token(const kvf_model_tokenizer *t, int32_t id)
{
    if (!t || id < 0 || id >= t->n_ids)
        return NULL;
    if (t->added_idx && t->added_idx[id] >= 0)
        return t->added[t->added_idx[id]].content;
    return t->str_len[id] >= 0 ? t->strs.data + t->str_off[id] : NULL;
}

int32_t kvf_model_tokenizer_vocab_size(const kvf_model_tokenizer *t) { return t ? t->n_ids : 0; }

bool kvf_model_tokenizer_is_special(const kvf_model_tokenizer *t, int32_t id)
{
    return t && id >= 0 && id < t->n_ids && t->is_special[id];
}

const char *kvf_model_tokenizer_bos_token(const kvf_model_tokenizer *t) { return t->bos_token; }
const char *kvf_model_tokenizer_eos_token(const kvf_model_tokenizer *t) { return t->eos_token; }
const char *kvf_model_tokenizer_pad_token(const kvf_model_tokenizer *t) { return t->pad_token; }
int32_t kvf_model_tokenizer_bos_id(const kvf_model_tokenizer *t) { return t->bos_id; }
int32_t kvf_model_tokenizer_eos_id(const kvf_model_tokenizer *t) { return t->eos_id; }
int32_t kvf_model_tokenizer_pad_id(const kvf_model_tokenizer *t) { return t->pad_id; }
const char *kvf_model_tokenizer_chat_template(const kvf_model_tokenizer *t) { return t->chat_template; }

const int32_t *kvf_model_tokenizer_eos_ids(const kvf_model_tokenizer *t, size_t *n_out)
{
    *n_out = t->n_eos_ids;
    return t->eos_ids;
}
