/* fuzz_regex.c: the regex compiler and the automaton it feeds. Input: a regex, then (after the
 * first NUL byte, if any) bytes to run through a matcher. Any regex either compiles or is refused
 * with a message; when it compiles, checks: accept_bytes takes a byte exactly when next_bytes
 * lists it, a refused byte changes nothing, clone and reset agree with the original, and (for one
 * input in four) at the start and the end the mask over a small vocabulary (the default
 * tokenizer) equals brute force; when PCRE2 compiles the regex too (anchored at both ends, UTF),
 * both agree on whether the bytes are one whole match (PCRE2 reads \v as a class, so regexes
 * with it are not compared).
 * Running bounds (stack depth, live stacks) may stop a matcher; that is an answer, not a crash. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "text/grammar.h"
#include "text/tokenizer.h"

static kvf_text_tokenizer *tok;
static kvf_text_vocab *vocab;

static void load(void)
{
    kvf_err err = {0};
    char dir[] = "/tmp/kvf_fuzz_regex_XXXXXX", path[256];
    if (!mkdtemp(dir) || kvf_text_tokenizer_write_default(dir, 600, &err) != KVF_OK ||
        kvf_text_tokenizer_load(dir, &tok, &err) != KVF_OK ||
        kvf_text_vocab_create(tok, kvf_text_tokenizer_vocab_size(tok) + 3, &vocab, &err) != KVF_OK) {
        fprintf(stderr, "fuzz_regex: no vocabulary: %s\n", err.msg);
        abort();
    }
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    unlink(path);
    rmdir(dir);
}

/* The mask equals brute force (accept on a clone, id by id). */
static void check_mask(kvf_text_matcher *m, const int32_t *ends, size_t n_end)
{
    kvf_err err = {0};
    size_t words = kvf_text_vocab_mask_words(vocab);
    uint32_t *mask = malloc(words * sizeof *mask);
    if (kvf_text_matcher_mask(m, mask, &err) != KVF_OK) {
        free(mask);
        return; /* a running bound */
    }
    for (int32_t id = 0; id < kvf_text_vocab_size(vocab); id++) {
        kvf_text_matcher *c = NULL;
        if (kvf_text_matcher_clone(m, &c, &err) != KVF_OK)
            abort();
        kvf_status st = kvf_text_matcher_accept(c, id, &err);
        bool want = st == KVF_OK, got = (mask[id >> 5] >> (id & 31)) & 1;
        kvf_text_matcher_destroy(c);
        if (st != KVF_OK && st != KVF_ERR_INVALID)
            continue; /* a running bound on this token's bytes */
        if (want != got) {
            fprintf(stderr, "fuzz_regex: id %d: mask %d, accept %d\n", (int)id, got, want);
            abort();
        }
    }
    bool end_bit = (mask[ends[0] >> 5] >> (ends[0] & 31)) & 1;
    if (end_bit != kvf_text_matcher_accepting(m))
        abort();
    (void)n_end;
    free(mask);
}

/* Whole-match agreement with PCRE2 on the input bytes, when PCRE2 takes the regex too (ours is
 * a match when every byte was taken and the end is accepting). */
static void compare_pcre2(const uint8_t *re, size_t re_len, const uint8_t *in, size_t in_len,
                          bool ours)
{
    int ec;
    PCRE2_SIZE eo;
    pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    pcre2_set_compile_extra_options(cc, PCRE2_EXTRA_ALT_BSUX);
    pcre2_code *c = pcre2_compile(re, re_len, PCRE2_UTF | PCRE2_ALT_BSUX | PCRE2_DOLLAR_ENDONLY,
                                  &ec, &eo, cc);
    pcre2_compile_context_free(cc);
    if (!c)
        return;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(c, NULL);
    int rc = pcre2_match(c, in, in_len, 0, PCRE2_ANCHORED | PCRE2_ENDANCHORED, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(c);
    if (rc < PCRE2_ERROR_NOMATCH)
        return; /* invalid UTF-8 in the subject, or a match limit */
    if ((rc >= 0) != ours) {
        fprintf(stderr, "fuzz_regex: PCRE2 says %d, the matcher %d\n", rc >= 0, ours);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!vocab)
        load();
    if (size > 4096)
        return 0;
    const uint8_t *nul = memchr(data, 0, size);
    size_t re_len = nul ? (size_t)(nul - data) : size;
    const uint8_t *in = nul ? nul + 1 : NULL;
    size_t in_len = nul ? size - re_len - 1 : 0;
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    kvf_status st = kvf_text_grammar_regex((const char *)data, re_len, &g, &err);
    if (st != KVF_OK) {
        if (g || !err.msg[0] || strncmp(err.msg, "regex", 5) != 0)
            abort(); /* refusals say so, and leave nothing behind */
        return 0;
    }
    int32_t ends[1] = {kvf_text_tokenizer_vocab_size(tok) + 1};
    kvf_text_matcher *m = NULL;
    if (kvf_text_matcher_create(g, vocab, ends, 1, &m, &err) != KVF_OK)
        abort();
    /* the brute-force mask check costs a clone per id: one input in four, to keep fuzzing fast */
    bool deep = size % 4 == 0;
    if (deep)
        check_mask(m, ends, 1);
    kvf_text_matcher *twin = NULL;
    if (kvf_text_matcher_clone(m, &twin, &err) != KVF_OK)
        abort();
    bool i_all = true, bounded = false; /* every input byte was taken; a running bound hit */
    for (size_t i = 0; i < in_len; i++) {
        uint32_t set[8];
        if (kvf_text_matcher_next_bytes(m, set, &err) != KVF_OK) {
            bounded = true;
            break;
        }
        bool listed = (set[in[i] >> 5] >> (in[i] & 31)) & 1;
        bool acc_before = kvf_text_matcher_accepting(m);
        st = kvf_text_matcher_accept_bytes(m, &in[i], 1, &err);
        if (st != KVF_OK && st != KVF_ERR_INVALID) {
            bounded = true;
            break;
        }
        if (st != KVF_OK)
            i_all = false;
        if ((st == KVF_OK) != listed)
            abort();
        if (st != KVF_OK && kvf_text_matcher_accepting(m) != acc_before)
            abort(); /* a refused byte changed the state */
        if (st == KVF_OK && kvf_text_matcher_accept_bytes(twin, &in[i], 1, &err) != KVF_OK)
            abort();
    }
    if (kvf_text_matcher_accepting(m) != kvf_text_matcher_accepting(twin))
        abort();
    if (!bounded && !memmem(data, re_len, "\\v", 2))
        compare_pcre2(data, re_len, in, in_len, i_all && kvf_text_matcher_accepting(m));
    if (deep)
        check_mask(m, ends, 1);
    kvf_text_matcher_reset(twin);
    kvf_text_matcher_destroy(twin);
    kvf_text_matcher_destroy(m);
    kvf_text_grammar_destroy(g);
    return 0;
}
