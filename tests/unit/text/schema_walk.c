/* schema_walk.c: random documents under JSON schemas, for text_schema_ajv (schema_validate.mjs
 * checks each with ajv, a validator that is not ours). For each .json file of DIR it compiles the
 * schema, then walks the Qwen3 token masks: a uniformly random allowed token each step, an end
 * id with probability 1/4 where the output is complete (always where nothing else is allowed),
 * at most --max-tokens tokens. It prints one JSON line per document:
 *   {"schema": "name.json", "doc": "<the text>", "complete": true}
 * (complete false: the cap was reached or no token was allowed; the validator counts it as a
 * failure) and exits 1 when a schema does not compile or a mask fails.
 * usage: schema_walk TOKENIZER_DIR SCHEMA_DIR [N_DOCS [SEED [MAX_TOKENS]]] */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/grammar.h"
#include "text/tokenizer.h"

static uint64_t rng_state;

static uint64_t rng_next(void) /* xorshift64* */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf)
        buf[n] = 0, *len = (size_t)n;
    return buf;
}

/* One document: returns 0, or -1 when a mask or accept fails (message printed). */
static int walk(kvf_text_matcher *m, const kvf_text_tokenizer *tok, const int32_t *end_ids,
                size_t n_end, uint32_t *mask, size_t words, int32_t *allowed, int max_tokens,
                char **doc, size_t *doc_len, size_t *doc_cap, bool *complete)
{
    kvf_err err = {0};
    *doc_len = 0;
    *complete = false;
    kvf_text_matcher_reset(m);
    for (int step = 0; step < max_tokens; step++) {
        if (kvf_text_matcher_mask(m, mask, &err) != KVF_OK) {
            fprintf(stderr, "schema_walk: mask: %s\n", err.msg);
            return -1;
        }
        size_t n = 0;
        bool end_ok = false;
        for (size_t w = 0; w < words; w++) {
            for (uint32_t bits = mask[w]; bits; bits &= bits - 1) {
                int32_t id = (int32_t)(w * 32 + (size_t)__builtin_ctz(bits));
                bool is_end = false;
                for (size_t e = 0; e < n_end; e++)
                    is_end |= end_ids[e] == id;
                if (is_end)
                    end_ok = true;
                else
                    allowed[n++] = id;
            }
        }
        if (end_ok && (n == 0 || rng_next() % 4 == 0)) {
            if (kvf_text_matcher_accept(m, end_ids[0], &err) != KVF_OK) {
                fprintf(stderr, "schema_walk: accept end id: %s\n", err.msg);
                return -1;
            }
            *complete = kvf_text_matcher_done(m);
            return 0;
        }
        if (n == 0)
            return 0; /* a dead end: incomplete, reported by the validator */
        int32_t id = allowed[rng_next() % n];
        if (kvf_text_matcher_accept(m, id, &err) != KVF_OK) {
            fprintf(stderr, "schema_walk: accept %d: %s\n", id, err.msg);
            return -1;
        }
        size_t len = 0;
        const uint8_t *bytes = kvf_text_tokenizer_token_bytes(tok, id, &len);
        if (*doc_len + len + 1 > *doc_cap) {
            *doc_cap = (*doc_len + len + 1) * 2;
            *doc = realloc(*doc, *doc_cap);
            if (!*doc)
                return -1;
        }
        memcpy(*doc + *doc_len, bytes, len);
        *doc_len += len;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: schema_walk TOKENIZER_DIR SCHEMA_DIR [N_DOCS [SEED [MAX_TOKENS]]]\n");
        return 2;
    }
    int n_docs = argc > 3 ? atoi(argv[3]) : 100;
    rng_state = argc > 4 ? strtoull(argv[4], NULL, 10) | 1 : 0x9E3779B97F4A7C15ULL;
    int max_tokens = argc > 5 ? atoi(argv[5]) : 3000;
    kvf_err err = {0};
    kvf_text_tokenizer *tok = NULL;
    kvf_text_vocab *v = NULL;
    if (kvf_text_tokenizer_load(argv[1], &tok, &err) != KVF_OK ||
        kvf_text_vocab_create(tok, kvf_text_tokenizer_vocab_size(tok), &v, &err) != KVF_OK) {
        fprintf(stderr, "schema_walk: %s: %s\n", argv[1], err.msg);
        return 1;
    }
    size_t n_end = 0;
    const int32_t *end_ids = kvf_text_tokenizer_eos_ids(tok, &n_end);
    if (!n_end) {
        fprintf(stderr, "schema_walk: %s has no EOS id\n", argv[1]);
        return 1;
    }
    DIR *d = opendir(argv[2]);
    if (!d) {
        fprintf(stderr, "schema_walk: cannot open %s\n", argv[2]);
        return 1;
    }
    char *names[256];
    size_t n_names = 0;
    for (struct dirent *e; (e = readdir(d)) && n_names < 256;) {
        size_t l = strlen(e->d_name);
        if (l > 5 && strcmp(e->d_name + l - 5, ".json") == 0)
            names[n_names++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, n_names, sizeof *names, cmp_name);
    size_t words = kvf_text_vocab_mask_words(v);
    uint32_t *mask = calloc(words, sizeof *mask);
    int32_t *allowed = calloc(words * 32, sizeof *allowed);
    char *doc = NULL;
    size_t doc_len = 0, doc_cap = 0;
    int rc = 0;
    for (size_t i = 0; i < n_names && rc == 0; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", argv[2], names[i]);
        size_t len = 0;
        char *text = read_file(path, &len);
        kvf_text_grammar *g = NULL;
        kvf_text_matcher *m = NULL;
        if (!text || kvf_text_grammar_schema(text, len, &g, &err) != KVF_OK ||
            kvf_text_matcher_create(g, v, end_ids, n_end, &m, &err) != KVF_OK) {
            fprintf(stderr, "schema_walk: %s: %s\n", names[i], text ? err.msg : "unreadable");
            rc = 1;
        }
        for (int k = 0; k < n_docs && rc == 0; k++) {
            bool complete = false;
            if (walk(m, tok, end_ids, n_end, mask, words, allowed, max_tokens, &doc, &doc_len,
                     &doc_cap, &complete) != 0) {
                rc = 1;
                break;
            }
            json_t *line = json_pack("{s:s, s:s%, s:b}", "schema", names[i], "doc",
                                     doc ? doc : "", doc_len, "complete", complete);
            char *out = line ? json_dumps(line, JSON_COMPACT) : NULL;
            if (!out) { /* not UTF-8: the grammar let a broken character through */
                printf("{\"schema\":\"%s\",\"doc\":null,\"complete\":false}\n", names[i]);
            } else {
                printf("%s\n", out);
            }
            free(out);
            json_decref(line);
        }
        fflush(stdout);
        kvf_text_matcher_destroy(m);
        kvf_text_grammar_destroy(g);
        free(text);
    }
    for (size_t i = 0; i < n_names; i++)
        free(names[i]);
    free(doc);
    free(mask);
    free(allowed);
    kvf_text_vocab_destroy(v);
    kvf_text_tokenizer_destroy(tok);
    return rc;
}
