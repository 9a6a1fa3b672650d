/* test_grammar_mask.c: token masks over real vocabularies (the Qwen3 and Mistral-7B tokenizers in
 * ../shared/fixtures/tokenizers) against brute force: for several states of a JSON-like grammar
 * and of regexes, every id is allowed exactly when accept_bytes of its bytes succeeds on a clone;
 * special, empty and out-of-tokenizer ids never are; end ids exactly when the output is complete.
 * Also accept() agrees with the mask, cached masks equal fresh ones, and done allows nothing.
 * Prints mask times (uncached and cached) for the record; it asserts none of them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "common/time.h"
#include "text/grammar.h"
#include "text/tokenizer.h"
#include "testutil.h"
#include "grammar_fixtures.h"

static kvf_text_tokenizer *toks[2];
static const char *const tok_names[2] = {"qwen3", "mistral7b"};

static int setup(void **state)
{
    (void)state;
    kvf_err err = {0};
    for (int i = 0; i < 2; i++) {
        char rel[256];
        snprintf(rel, sizeof rel, "fixtures/tokenizers/%s", tok_names[i]);
        if (kvf_text_tokenizer_load(kvf_test_shared_path(rel), &toks[i], &err) != KVF_OK) {
            fprintf(stderr, "load %s: %s\n", tok_names[i], err.msg);
            return -1;
        }
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < 2; i++)
        kvf_text_tokenizer_destroy(toks[i]);
    return 0;
}

static bool bit(const uint32_t *mask, int32_t id) { return (mask[id >> 5] >> (id & 31)) & 1; }

/* Checks m's mask against brute force; returns the uncached and cached mask times. */
static void check_mask(const kvf_text_tokenizer *tok, const kvf_text_vocab *v, kvf_text_matcher *m,
                       const int32_t *end_ids, size_t n_end, const char *what, bool print)
{
    kvf_err err = {0};
    size_t words = kvf_text_vocab_mask_words(v);
    uint32_t *mask = malloc(words * sizeof *mask), *again = malloc(words * sizeof *again);
    double t0 = kvf_now_s();
    assert_int_equal(kvf_text_matcher_mask(m, mask, &err), KVF_OK);
    double t1 = kvf_now_s();
    assert_int_equal(kvf_text_matcher_mask(m, again, &err), KVF_OK);
    double t2 = kvf_now_s();
    assert_memory_equal(mask, again, words * sizeof *mask);
    int32_t n_ids = kvf_text_vocab_size(v), tn = kvf_text_tokenizer_vocab_size(tok);
    bool accepting = kvf_text_matcher_accepting(m);
    size_t allowed = 0, checked_accept = 0;
    kvf_text_matcher *c = NULL;
    assert_int_equal(kvf_text_matcher_clone(m, &c, &err), KVF_OK);
    for (int32_t id = 0; id < n_ids; id++) {
        bool is_end = false;
        for (size_t k = 0; k < n_end; k++)
            is_end |= end_ids[k] == id;
        bool want;
        if (is_end) {
            want = accepting;
        } else if (id >= tn || kvf_text_tokenizer_is_special(tok, id)) {
            want = false;
        } else {
            size_t len = 0;
            const uint8_t *p = kvf_text_tokenizer_token_bytes(tok, id, &len);
            want = len > 0 && kvf_text_matcher_accept_bytes(c, p, len, &err) == KVF_OK;
            if (want) { /* c moved on: start again from m */
                kvf_text_matcher_destroy(c);
                assert_int_equal(kvf_text_matcher_clone(m, &c, &err), KVF_OK);
            }
        }
        if (bit(mask, id) != want)
            fail_msg("%s: id %d (%s): mask says %d, brute force %d", what, (int)id,
                     id < tn ? kvf_text_tokenizer_id_to_token(tok, id) : "-", (int)bit(mask, id),
                     (int)want);
        allowed += want;
        /* accept() agrees with the mask, on a sample of ids (and no change when refused) */
        if ((id % 97 == 0 || is_end) && checked_accept < 2000) {
            kvf_text_matcher *a = NULL;
            assert_int_equal(kvf_text_matcher_clone(m, &a, &err), KVF_OK);
            kvf_status st = kvf_text_matcher_accept(a, id, &err);
            assert_int_equal(st == KVF_OK, want);
            if (is_end && want)
                assert_true(kvf_text_matcher_done(a));
            kvf_text_matcher_destroy(a);
            checked_accept++;
        }
    }
    kvf_text_matcher_destroy(c);
    if (print)
        fprintf(stderr, "mask %-40s %7zu of %d allowed: uncached %8.3f ms, cached %7.2f us\n",
                what, allowed, (int)n_ids, (t1 - t0) * 1e3, (t2 - t1) * 1e6);
    free(mask);
    free(again);
}

static void run_states(int ti, kvf_text_grammar *g, const char *const *prefixes, size_t n,
                       const char *label)
{
    const kvf_text_tokenizer *tok = toks[ti];
    kvf_err err = {0};
    kvf_text_vocab *v = NULL;
    /* the model's vocabulary is larger than the tokenizer's: those ids are never allowed */
    int32_t n_ids = kvf_text_tokenizer_vocab_size(tok) + 77;
    double t0 = kvf_now_s();
    assert_int_equal(kvf_text_vocab_create(tok, n_ids, &v, &err), KVF_OK);
    double t1 = kvf_now_s();
    assert_int_equal(kvf_text_vocab_size(v), n_ids);
    size_t n_eos = 0;
    const int32_t *eos = kvf_text_tokenizer_eos_ids(tok, &n_eos);
    int32_t ends[8];
    size_t n_end = 0;
    for (size_t i = 0; i < n_eos && n_end < 7; i++)
        ends[n_end++] = eos[i];
    ends[n_end++] = n_ids - 1; /* a stop id past the tokenizer still ends the output */
    fprintf(stderr, "%s: vocab of %d ids built in %.1f ms\n", tok_names[ti], (int)n_ids,
            (t1 - t0) * 1e3);
    kvf_text_matcher *m = NULL;
    assert_int_equal(kvf_text_matcher_create(g, v, ends, n_end, &m, &err), KVF_OK);
    for (size_t i = 0; i < n; i++) {
        kvf_text_matcher_reset(m);
        if (kvf_text_matcher_accept_bytes(m, prefixes[i], strlen(prefixes[i]), &err) != KVF_OK)
            fail_msg("%s: prefix \"%s\": %s", label, prefixes[i], err.msg);
        char what[128];
        snprintf(what, sizeof what, "%s %s \"%.20s\"", tok_names[ti], label, prefixes[i]);
        check_mask(tok, v, m, ends, n_end, what, true);
    }
    /* accepting an end id ends the output: nothing is allowed after it */
    kvf_text_matcher_reset(m);
    size_t words = kvf_text_vocab_mask_words(v);
    uint32_t *mask = calloc(words, sizeof *mask);
    for (size_t i = 0; i < n; i++) {
        kvf_text_matcher_reset(m);
        kvf_text_matcher_accept_bytes(m, prefixes[i], strlen(prefixes[i]), &err);
        if (!kvf_text_matcher_accepting(m)) {
            assert_int_equal(kvf_text_matcher_accept(m, ends[0], &err), KVF_ERR_INVALID);
            continue;
        }
        assert_int_equal(kvf_text_matcher_accept(m, ends[0], &err), KVF_OK);
        assert_true(kvf_text_matcher_done(m));
        assert_int_equal(kvf_text_matcher_mask(m, mask, &err), KVF_OK);
        for (size_t w = 0; w < words; w++)
            assert_int_equal(mask[w], 0);
        assert_int_equal(kvf_text_matcher_accept(m, ends[0], &err), KVF_ERR_INVALID);
    }
    free(mask);
    kvf_text_matcher_destroy(m);
    kvf_text_vocab_destroy(v);
}

static const char *const json_prefixes[] = {
    "",                      /* start: only "{" */
    "{",                     /* structural: ws, "\"" or "}" */
    "{\"na",                 /* inside a key */
    "{\"name\": ",           /* before a value */
    "{\"name\": \"Jo",       /* inside a string value */
    "{\"name\": \"Jo\\",     /* after a backslash */
    "{\"a\": [1, 2",         /* inside a number in an array */
    "{\"a\": -0",            /* after a leading zero */
    "{\"a\": {\"b\": [[{",   /* nested */
    "{\"a\": tr",            /* inside a literal */
    "{\"a\": \"\xe2\x82",    /* inside a UTF-8 character */
    "{}",                    /* complete */
};

static void test_json_masks_qwen3(void **state)
{
    (void)state;
    kvf_text_grammar *g = json_grammar();
    run_states(0, g, json_prefixes, sizeof json_prefixes / sizeof *json_prefixes, "json");
    kvf_text_grammar_destroy(g);
}

static void test_json_masks_mistral(void **state)
{
    (void)state;
    kvf_text_grammar *g = json_grammar();
    run_states(1, g, json_prefixes, sizeof json_prefixes / sizeof *json_prefixes, "json");
    kvf_text_grammar_destroy(g);
}

static void test_regex_masks(void **state)
{
    (void)state;
    static const struct {
        const char *re;
        const char *prefixes[4];
    } cases[] = {
        {"[0-9]{3}-[a-z]+( [A-Z][a-z]*)?", {"", "12", "123-", "123-ab"}},
        {"(yes|no|maybe)", {"", "ma", "no"}},
        {"\\w+@\\w+\\.com", {"", "ab", "ab@c", "ab@c.com"}},
        {"[^\"\\\\]{0,12}", {"", "abc", "héllo"}},
        {"(\\d+\\.)*\\d+", {"", "1.2", "1."}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kvf_text_grammar *g = NULL;
        kvf_err err = {0};
        if (kvf_text_grammar_regex(cases[i].re, strlen(cases[i].re), &g, &err) != KVF_OK)
            fail_msg("%s: %s", cases[i].re, err.msg);
        size_t n = 0;
        while (n < 4 && cases[i].prefixes[n])
            n++;
        run_states(0, g, cases[i].prefixes, n, cases[i].re);
        kvf_text_grammar_destroy(g);
    }
}

/* A state reached again by another path hits the cache (same canonical state); a grammar used
 * with two vocabularies keeps their masks apart. */
static void test_cache_and_two_vocabs(void **state)
{
    (void)state;
    kvf_err err = {0};
    kvf_text_grammar *g = json_grammar();
    kvf_text_vocab *v0 = NULL, *v1 = NULL;
    assert_int_equal(kvf_text_vocab_create(toks[0], kvf_text_tokenizer_vocab_size(toks[0]), &v0, &err),
                     KVF_OK);
    assert_int_equal(kvf_text_vocab_create(toks[1], kvf_text_tokenizer_vocab_size(toks[1]), &v1, &err),
                     KVF_OK);
    kvf_text_matcher *a = NULL, *b = NULL;
    assert_int_equal(kvf_text_matcher_create(g, v0, NULL, 0, &a, &err), KVF_OK);
    assert_int_equal(kvf_text_matcher_create(g, v1, NULL, 0, &b, &err), KVF_OK);
    size_t w0 = kvf_text_vocab_mask_words(v0), w1 = kvf_text_vocab_mask_words(v1);
    uint32_t *m0 = malloc(w0 * 4), *m1 = malloc(w1 * 4), *m0b = malloc(w0 * 4);
    for (int round = 0; round < 2; round++) {
        kvf_text_matcher_reset(a);
        kvf_text_matcher_reset(b);
        const char *p = round ? "{\"x\": [1, {\"y\": 2}], \"z\": \"a" : "{\"z\": \"a";
        assert_int_equal(kvf_text_matcher_accept_bytes(a, p, strlen(p), &err), KVF_OK);
        assert_int_equal(kvf_text_matcher_accept_bytes(b, p, strlen(p), &err), KVF_OK);
        assert_int_equal(kvf_text_matcher_mask(a, round ? m0b : m0, &err), KVF_OK);
        assert_int_equal(kvf_text_matcher_mask(b, m1, &err), KVF_OK);
        check_mask(toks[1], v1, b, NULL, 0, "mistral after qwen3", false);
    }
    /* a string in the first member and in a later one: different positions, the same mask */
    assert_memory_equal(m0, m0b, w0 * 4);
    /* more of the same string: the same canonical state, so a cache hit and no new walk */
    kvf_text_grammar_stats gs, gs2;
    kvf_text_grammar_stats_get(g, &gs);
    kvf_text_matcher_reset(a);
    const char *more = "{\"z\": \"abc de";
    assert_int_equal(kvf_text_matcher_accept_bytes(a, more, strlen(more), &err), KVF_OK);
    assert_int_equal(kvf_text_matcher_mask(a, m0b, &err), KVF_OK);
    assert_memory_equal(m0, m0b, w0 * 4);
    kvf_text_grammar_stats_get(g, &gs2);
    assert_int_equal(gs2.cache_misses, gs.cache_misses);
    assert_int_equal(gs2.cache_hits, gs.cache_hits + 1);
    gs = gs2;
    fprintf(stderr, "json grammar: %d states; cache %zu entries, %zu bytes, %llu hits, %llu misses\n",
            (int)gs.n_states, gs.cache_entries, gs.cache_bytes, (unsigned long long)gs.cache_hits,
            (unsigned long long)gs.cache_misses);
    assert_true(gs.cache_entries >= 1 && gs.cache_hits >= 1);
    free(m0);
    free(m1);
    free(m0b);
    kvf_text_matcher_destroy(a);
    kvf_text_matcher_destroy(b);
    kvf_text_vocab_destroy(v0);
    kvf_text_vocab_destroy(v1);
    kvf_text_grammar_destroy(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_masks_qwen3),
        cmocka_unit_test(test_json_masks_mistral),
        cmocka_unit_test(test_regex_masks),
        cmocka_unit_test(test_cache_and_two_vocabs),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
