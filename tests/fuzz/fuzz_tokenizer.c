/* fuzz_tokenizer.c: tokenizer input. The first byte picks a tokenizer (qwen3 or mistral7b from
 * ../shared when present, else the default one written to a temporary directory) and options;
 * the rest is text to encode, or ids to decode. Checks: invalid UTF-8 is refused and valid text
 * is not; decoding gives valid UTF-8; streaming one id at a time gives the same text. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "text/tokenizer.h"

static kvf_text_tokenizer *toks[3];
static int n_toks;

static void load_all(void)
{
    const char *shared = getenv("KVF_SHARED");
    char path[4096];
    kvf_err err = {0};
    static const char *const names[2] = {"qwen3", "mistral7b"};
    for (int i = 0; i < 2 && shared && *shared; i++) {
        snprintf(path, sizeof path, "%s/fixtures/tokenizers/%s", shared, names[i]);
        if (kvf_text_tokenizer_load(path, &toks[n_toks], &err) == KVF_OK)
            n_toks++;
    }
    char dir[] = "/tmp/kvf_fuzz_tok_XXXXXX";
    if (mkdtemp(dir) && kvf_text_tokenizer_write_default(dir, 600, &err) == KVF_OK &&
        kvf_text_tokenizer_load(dir, &toks[n_toks], &err) == KVF_OK)
        n_toks++;
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    unlink(path);
    rmdir(dir);
    fprintf(stderr, "fuzz_tokenizer: %d tokenizers loaded\n", n_toks);
    if (n_toks == 0) {
        fprintf(stderr, "fuzz_tokenizer: no tokenizer could be loaded: %s\n", err.msg);
        abort();
    }
}

static int valid_utf8(const char *s, size_t n)
{
    json_t *j = json_stringn(s, n); /* NULL when not valid UTF-8 */
    json_decref(j);
    return j != NULL || n == 0;
}

static void check_decode(const kvf_text_tokenizer *t, const int32_t *ids, size_t n, int skip)
{
    char *text = NULL;
    size_t len = 0;
    kvf_err err = {0};
    if (kvf_text_tokenizer_decode(t, ids, n, skip, &text, &len, &err) != KVF_OK)
        return; /* ids out of range: refused, fine */
    if (!valid_utf8(text, len) || text[len] != 0)
        abort();
    kvf_text_detok *d;
    if (kvf_text_detok_create(t, skip, &d, &err) != KVF_OK)
        abort();
    kvf_sbuf out;
    kvf_sbuf_init(&out);
    for (size_t i = 0; i < n; i++) {
        size_t before = out.len;
        if (kvf_text_detok_feed(d, &ids[i], 1, &out, &err) != KVF_OK)
            abort();
        if (!valid_utf8(out.data ? out.data + before : "", out.len - before))
            abort(); /* a chunk ended in half a character */
    }
    kvf_text_detok_finish(d, &out, &err);
    if (out.len != len || (len && memcmp(out.data, text, len) != 0))
        abort();
    kvf_sbuf_fini(&out);
    kvf_text_detok_destroy(d);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!n_toks)
        load_all();
    if (size < 1)
        return 0;
    const kvf_text_tokenizer *t = toks[data[0] % n_toks];
    int special = (data[0] >> 2) & 1, skip = (data[0] >> 3) & 1, mode = (data[0] >> 4) & 1;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    kvf_err err = {0};
    if (mode == 0) { /* text -> ids -> text */
        int32_t *ids = NULL;
        size_t n = 0;
        kvf_status st = kvf_text_tokenizer_encode(t, text, len, special, &ids, &n, &err);
        if ((st == KVF_OK) != valid_utf8(text, len))
            abort(); /* valid text must encode; invalid must be refused */
        if (st != KVF_OK)
            return 0;
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= kvf_text_tokenizer_vocab_size(t))
                abort();
        check_decode(t, ids, n, skip);
        free(ids);
    } else { /* arbitrary ids, two bytes each */
        size_t n = len / 2;
        int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
        int32_t vs = kvf_text_tokenizer_vocab_size(t);
        for (size_t i = 0; i < n; i++) {
            int32_t v = (int32_t)((uint8_t)text[2 * i] | ((uint8_t)text[2 * i + 1] << 8));
            ids[i] = (data[0] & 0x20) ? v * 3 % (vs + 2) : v % (vs + 2); /* a few out of range */
        }
        check_decode(t, ids, n, skip);
        free(ids);
    }
    return 0;
}
