/* tokenizer_decode.c: ids -> text, whole or streamed. Every id's bytes are precomputed at load
 * (byte-level unmapping, "<0xNN>" byte fallback, "▁" -> " "); here they are joined, the
 * decoder's leading-space strip is applied once, and the bytes are repaired into UTF-8 (an
 * invalid sequence becomes U+FFFD; an incomplete one is held back until it completes). */
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer_internal.h"

struct kvf_text_detok {
    const kvf_text_tokenizer *tok;
    bool skip_special;
    uint8_t pend[4];  /* an incomplete UTF-8 character */
    int n_pend, need; /* bytes held, bytes the character needs */
    int32_t strip_left; /* leading spaces still to strip */
};

static const char fffd[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

static void detok_reset(kvf_text_detok *d)
{
    d->n_pend = d->need = 0;
    d->strip_left = d->tok->strip_start;
}

/* Whether b may follow pend[0..n) in a well-formed UTF-8 character. */
static bool continues(const kvf_text_detok *d, uint8_t b)
{
    if (b < 0x80 || b > 0xBF)
        return false;
    if (d->n_pend != 1)
        return true;
    switch (d->pend[0]) {
    case 0xE0: return b >= 0xA0;
    case 0xED: return b <= 0x9F;
    case 0xF0: return b >= 0x90;
    case 0xF4: return b <= 0x8F;
    default: return true;
    }
}

static void put_byte(kvf_text_detok *d, uint8_t b, kvf_sbuf *out)
{
    if (d->n_pend > 0) {
        if (continues(d, b)) {
            d->pend[d->n_pend++] = b;
            if (d->n_pend == d->need) {
                kvf_sbuf_append(out, d->pend, (size_t)d->n_pend);
                d->n_pend = 0;
            }
            return;
        }
        kvf_sbuf_append(out, fffd, 3); /* the maximal invalid subpart is one U+FFFD */
        d->n_pend = 0;
    }
    if (b < 0x80) {
        kvf_sbuf_putc(out, (char)b);
    } else if (b >= 0xC2 && b <= 0xF4) {
        d->pend[0] = b;
        d->n_pend = 1;
        d->need = b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    } else {
        kvf_sbuf_append(out, fffd, 3);
    }
}

static void feed_one(kvf_text_detok *d, int32_t id, kvf_sbuf *out)
{
    const kvf_text_tokenizer *t = d->tok;
    if (d->skip_special && t->is_special[id])
        return;
    const uint8_t *s = (const uint8_t *)t->dec.data + t->dec_off[id];
    int32_t n = t->dec_len[id], i = 0;
    for (; i < n && d->strip_left > 0; i++) {
        if (s[i] != ' ') {
            d->strip_left = 0;
            break;
        }
        d->strip_left--;
    }
    if (i < n)
        d->strip_left = 0;
    /* fast path: whole ASCII runs when nothing is pending */
    for (; i < n; i++) {
        if (d->n_pend == 0 && s[i] < 0x80) {
            int32_t j = i;
            while (j < n && s[j] < 0x80)
                j++;
            kvf_sbuf_append(out, s + i, (size_t)(j - i));
            i = j - 1;
            continue;
        }
        put_byte(d, s[i], out);
    }
}

static kvf_status check_ids(const kvf_text_tokenizer *t, const int32_t *ids, size_t n, kvf_err *err)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->n_ids)
            return kvf_err_set(err, KVF_ERR_INVALID, "tokenizer: id %d (at %zu) is not in the vocabulary (0..%d)",
                               ids[i], i, t->n_ids - 1);
    return KVF_OK;
}

kvf_status kvf_text_detok_create(const kvf_text_tokenizer *tok, bool skip_special, kvf_text_detok **out,
                                  kvf_err *err)
{
    if (!tok)
        return kvf_err_set(err, KVF_ERR_INVALID, "tokenizer: detokenizer needs a tokenizer");
    kvf_text_detok *d = calloc(1, sizeof *d);
    if (!d)
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
    d->tok = tok;
    d->skip_special = skip_special;
    detok_reset(d);
    *out = d;
    return KVF_OK;
}

void kvf_text_detok_destroy(kvf_text_detok *d)
{
    free(d);
}

kvf_status kvf_text_detok_feed(kvf_text_detok *d, const int32_t *ids, size_t n, kvf_sbuf *out, kvf_err *err)
{
    kvf_status st = check_ids(d->tok, ids, n, err);
    if (st != KVF_OK)
        return st;
    for (size_t i = 0; i < n; i++)
        feed_one(d, ids[i], out);
    return out->oom ? kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory decoding") : KVF_OK;
}

kvf_status kvf_text_detok_finish(kvf_text_detok *d, kvf_sbuf *out, kvf_err *err)
{
    if (d->n_pend > 0)
        kvf_sbuf_append(out, fffd, 3);
    detok_reset(d);
    return out->oom ? kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory decoding") : KVF_OK;
}

kvf_status kvf_text_tokenizer_decode(const kvf_text_tokenizer *tok, const int32_t *ids, size_t n,
                                      bool skip_special, char **text_out, size_t *len_out, kvf_err *err)
{
    if (!tok || (!ids && n > 0))
        return kvf_err_set(err, KVF_ERR_INVALID, "tokenizer: decode needs a tokenizer and ids");
    kvf_text_detok d = {.tok = tok, .skip_special = skip_special};
    detok_reset(&d);
    kvf_sbuf out;
    kvf_sbuf_init(&out);
    kvf_status st = kvf_text_detok_feed(&d, ids, n, &out, err);
    if (st == KVF_OK)
        st = kvf_text_detok_finish(&d, &out, err);
    if (st == KVF_OK)
        st = kvf_sbuf_reserve(&out, 1) == KVF_OK ? KVF_OK
                                                  : kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
    if (st != KVF_OK) {
        kvf_sbuf_fini(&out);
        return st;
    }
    out.data[out.len] = 0;
    if (len_out)
        *len_out = out.len;
    *text_out = kvf_sbuf_take(&out);
    return KVF_OK;
}

const uint8_t *kvf_text_tokenizer_token_bytes(const kvf_text_tokenizer *tok, int32_t id,
                                              size_t *len_out)
{
    if (!tok || id < 0 || id >= tok->n_ids) {
        *len_out = 0;
        return NULL;
    }
    *len_out = (size_t)tok->dec_len[id];
    return (const uint8_t *)tok->dec.data + tok->dec_off[id];
}
