/* fuzz_schema.c: the JSON Schema compiler (text/schema.c) on arbitrary schemas. The first byte
 * picks the mode: even, the rest is a schema; odd, the rest is a string pattern (wrapped as
 * {"type":"string","pattern":...}, which drives the rewrite of patterns to JSON-escaped
 * content). Properties: no crash, no unbounded time or memory; a refusal carries a message; a
 * compiled grammar runs: a walk of up to 24 tokens over the masks of a small byte-level
 * vocabulary (the default tokenizer, written to a temporary directory), choosing tokens with the
 * input's bytes, where every chosen token is accepted and the end id only where accepting. In
 * pattern mode, a byte walk (next_bytes) to a complete document must give a JSON string whose
 * content the pattern itself (kvf_text_grammar_regex) matches: the rewrite to JSON-escaped
 * content neither breaks JSON nor leaves the pattern's language. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "text/grammar.h"
#include "text/tokenizer.h"

static kvf_text_tokenizer *tok;
static kvf_text_vocab *vocab;
static uint32_t *mask;

static void load_vocab(void)
{
    kvf_err err = {0};
    char dir[] = "/tmp/kvf_fuzz_schema_XXXXXX", path[4096];
    if (!mkdtemp(dir) || kvf_text_tokenizer_write_default(dir, 600, &err) != KVF_OK ||
        kvf_text_tokenizer_load(dir, &tok, &err) != KVF_OK ||
        kvf_text_vocab_create(tok, kvf_text_tokenizer_vocab_size(tok), &vocab, &err) != KVF_OK) {
        fprintf(stderr, "fuzz_schema: no vocabulary: %s\n", err.msg);
        abort();
    }
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    unlink(path);
    rmdir(dir);
    mask = calloc(kvf_text_vocab_mask_words(vocab), sizeof *mask);
    if (!mask)
        abort();
}

static void walk(kvf_text_grammar *g, const uint8_t *data, size_t size)
{
    int32_t end = 0;
    size_t n_eos = 0;
    const int32_t *eos = kvf_text_tokenizer_eos_ids(tok, &n_eos);
    if (n_eos)
        end = eos[0];
    kvf_text_matcher *m = NULL;
    kvf_err err = {0};
    if (kvf_text_matcher_create(g, vocab, &end, 1, &m, &err) != KVF_OK)
        return; /* out of memory only */
    int32_t n_ids = kvf_text_vocab_size(vocab);
    for (size_t step = 0; step < 24; step++) {
        if (kvf_text_matcher_mask(m, mask, &err) != KVF_OK)
            break; /* a running bound: allowed */
        bool end_ok = mask[end / 32] >> (end % 32) & 1;
        if (end_ok != kvf_text_matcher_accepting(m))
            abort();
        /* the k-th allowed id, k from the input */
        size_t k = size ? data[step % size] : 0, seen = 0;
        int32_t pick = -1, first = -1;
        for (int32_t id = 0; id < n_ids && pick < 0; id++) {
            if (!(mask[id / 32] >> (id % 32) & 1))
                continue;
            if (first < 0)
                first = id;
            if (seen++ == k)
                pick = id;
        }
        if (pick < 0)
            pick = first;
        if (pick < 0)
            break;
        if (kvf_text_matcher_accept(m, pick, &err) != KVF_OK)
            abort(); /* the mask allowed it */
        if (pick == end)
            break;
    }
    kvf_text_matcher_destroy(m);
}

/* Pattern mode: walk bytes chosen by the input to a complete document (if one comes), decode it,
 * and check the content against the pattern compiled as a plain regex. */
static void check_pattern(kvf_text_grammar *g, const uint8_t *data, size_t size)
{
    kvf_text_matcher *m = NULL, *rm = NULL;
    kvf_text_grammar *rg = NULL;
    kvf_err err = {0};
    int32_t end = 0;
    char out[256];
    size_t n = 0;
    if (kvf_text_matcher_create(g, vocab, &end, 1, &m, &err) != KVF_OK)
        return;
    for (size_t step = 0; n < sizeof out; step++) {
        uint32_t set[8];
        if (kvf_text_matcher_next_bytes(m, set, &err) != KVF_OK)
            goto done;
        uint8_t pick = size ? data[(step * 7 + 3) % size] : 0;
        if (kvf_text_matcher_accepting(m) && (pick & 3) == 0)
            break;
        int seen = 0, want = pick % 64, chosen = -1, first = -1;
        for (int b = 0; b < 256 && chosen < 0; b++) {
            if (!(set[b / 32] >> (b % 32) & 1))
                continue;
            if (first < 0)
                first = b;
            if (seen++ == want)
                chosen = b;
        }
        if (chosen < 0)
            chosen = first;
        if (chosen < 0)
            break;
        uint8_t byte = (uint8_t)chosen;
        if (kvf_text_matcher_accept_bytes(m, &byte, 1, &err) != KVF_OK)
            abort(); /* next_bytes offered it */
        out[n++] = (char)byte;
    }
    if (!kvf_text_matcher_accepting(m))
        goto done;
    json_error_t je;
    json_t *v = json_loadb(out, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!json_is_string(v)) {
        fprintf(stderr, "fuzz_schema: not a JSON string: %.*s\n", (int)n, out);
        abort();
    }
    if (kvf_text_grammar_regex((const char *)data + 1, size - 1, &rg, &err) == KVF_OK &&
        kvf_text_matcher_create(rg, vocab, &end, 1, &rm, &err) == KVF_OK) {
        if (kvf_text_matcher_accept_bytes(rm, json_string_value(v), json_string_length(v),
                                          &err) != KVF_OK ||
            !kvf_text_matcher_accepting(rm)) {
            fprintf(stderr, "fuzz_schema: pattern %.*s does not match the content of %.*s\n",
                    (int)(size - 1), (const char *)data + 1, (int)n, out);
            abort();
        }
    }
    kvf_text_matcher_destroy(rm);
    kvf_text_grammar_destroy(rg);
    json_decref(v);
done:
    kvf_text_matcher_destroy(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!vocab)
        load_vocab();
    if (size < 1)
        return 0;
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    kvf_status st;
    if (data[0] % 2 == 0) {
        st = kvf_text_grammar_schema((const char *)data + 1, size - 1, &g, &err);
    } else {
        json_t *pat = json_stringn_nocheck((const char *)data + 1, size - 1);
        json_t *s = json_pack("{s:s, s:o}", "type", "string", "pattern", pat);
        char *txt = s ? json_dumps(s, JSON_COMPACT) : NULL; /* NULL: not UTF-8 */
        json_decref(s);
        if (!txt)
            return 0;
        st = kvf_text_grammar_schema(txt, strlen(txt), &g, &err);
        free(txt);
    }
    if (st != KVF_OK) {
        if (!err.msg[0])
            abort();
        return 0;
    }
    walk(g, data, size);
    if (data[0] % 2 == 1)
        check_pattern(g, data, size);
    kvf_text_grammar_destroy(g);
    return 0;
}
