/* test_tokenizer.c: text/tokenizer against the Hugging Face fixtures in
 * ../shared/fixtures/tokenizers (qwen3: byte-level BPE; mistral7b: SentencePiece-style BPE with
 * byte fallback): every case encoded with and without special tokens and decoded three ways,
 * streaming detokenization, special-token lookups, and malformed input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/time.h"
#include "text/tokenizer.h"
#include "text/tokenizer_internal.h" /* white-box: the word-split switch */
#include "testutil.h"

static kvf_text_tokenizer *qwen, *mistral;

static int setup(void **state)
{
    kvf_err err = {0};
    double t0 = kvf_now_s();
    if (kvf_text_tokenizer_load(kvf_test_shared_path("fixtures/tokenizers/qwen3"), &qwen, &err) != KVF_OK) {
        fprintf(stderr, "load qwen3: %s\n", err.msg);
        return -1;
    }
    double t1 = kvf_now_s();
    if (kvf_text_tokenizer_load(kvf_test_shared_path("fixtures/tokenizers/mistral7b/tokenizer.json"), &mistral,
                                 &err) != KVF_OK) {
        fprintf(stderr, "load mistral7b: %s\n", err.msg);
        return -1;
    }
    fprintf(stderr, "loaded qwen3 in %.3f s, mistral7b in %.3f s\n", t1 - t0, kvf_now_s() - t1);
    return 0;
}

static int teardown(void **state)
{
    kvf_text_tokenizer_destroy(qwen);
    kvf_text_tokenizer_destroy(mistral);
    return 0;
}

static bool ids_equal(const int32_t *got, size_t n, const json_t *want)
{
    if (!json_is_array(want) || json_array_size(want) != n)
        return false;
    for (size_t i = 0; i < n; i++)
        if (json_integer_value(json_array_get(want, i)) != got[i])
            return false;
    return true;
}

static void print_ids(const char *what, const int32_t *ids, size_t n)
{
    fprintf(stderr, "  %s:", what);
    for (size_t i = 0; i < n && i < 40; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 40 ? " ...\n" : "\n");
}

static bool decoded_equal(const kvf_text_tokenizer *tok, const json_t *ids_j, bool skip, const json_t *want,
                          const char *id, const char *what)
{
    size_t n = json_array_size(ids_j);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; i < n; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(ids_j, i));
    char *text = NULL;
    size_t len = 0;
    kvf_err err = {0};
    bool ok = kvf_text_tokenizer_decode(tok, ids, n, skip, &text, &len, &err) == KVF_OK &&
              len == json_string_length(want) && memcmp(text, json_string_value(want), len) == 0;
    if (!ok)
        fprintf(stderr, "%s: %s: got \"%s\" want \"%s\" %s\n", id, what, text ? text : "(error)",
                json_string_value(want), err.msg);

    /* streaming, one id at a time: each chunk is whole UTF-8 and the chunks add up */
    kvf_text_detok *d;
    assert_int_equal(kvf_text_detok_create(tok, skip, &d, &err), KVF_OK);
    kvf_sbuf all;
    kvf_sbuf_init(&all);
    for (size_t i = 0; i < n; i++) {
        size_t before = all.len;
        assert_int_equal(kvf_text_detok_feed(d, &ids[i], 1, &all, &err), KVF_OK);
        kvf_sbuf chunk;
        kvf_sbuf_init(&chunk);
        kvf_sbuf_append(&chunk, all.data ? all.data + before : "", all.len - before);
        json_t *s = json_stringn(chunk.data ? chunk.data : "", chunk.len); /* NULL if not UTF-8 */
        if (!s) {
            fprintf(stderr, "%s: %s: streamed chunk %zu is not valid UTF-8\n", id, what, i);
            ok = false;
        }
        json_decref(s);
        kvf_sbuf_fini(&chunk);
    }
    assert_int_equal(kvf_text_detok_finish(d, &all, &err), KVF_OK);
    if (!text || all.len != len || (len && memcmp(all.data, text, len) != 0)) {
        fprintf(stderr, "%s: %s: streamed \"%s\" differs from decode\n", id, what, all.data ? all.data : "");
        ok = false;
    }
    kvf_sbuf_fini(&all);
    kvf_text_detok_destroy(d);
    free(text);
    free(ids);
    return ok;
}

/* Runs every case of fixtures/tokenizers/<name>/cases.json; returns the number of failures. */
static int run_cases(const kvf_text_tokenizer *tok, const char *name)
{
    char rel[256];
    snprintf(rel, sizeof rel, "fixtures/tokenizers/%s/cases.json", name);
    json_error_t je;
    json_t *root = json_load_file(kvf_test_shared_path(rel), JSON_ALLOW_NUL, &je);
    assert_non_null(root);
    json_t *cases = json_object_get(root, "cases");
    assert_true(json_array_size(cases) >= 64);
    int failures = 0;
    double t_enc = 0;
    size_t bytes = 0;
    for (size_t k = 0; k < json_array_size(cases); k++) {
        json_t *c = json_array_get(cases, k);
        const char *id = json_string_value(json_object_get(c, "id"));
        json_t *text = json_object_get(c, "text");
        for (int special = 0; special <= 1; special++) {
            int32_t *ids = NULL;
            size_t n = 0;
            kvf_err err = {0};
            double t0 = kvf_now_s();
            kvf_status st = kvf_text_tokenizer_encode(tok, json_string_value(text), json_string_length(text),
                                                       special, &ids, &n, &err);
            t_enc += kvf_now_s() - t0;
            bytes += json_string_length(text);
            json_t *want = json_object_get(c, special ? "ids_with_special" : "ids");
            if (st != KVF_OK || !ids_equal(ids, n, want)) {
                failures++;
                fprintf(stderr, "%s (%s) encode%s: %s\n", id, json_string_value(json_object_get(c, "name")),
                        special ? " with special" : "", st == KVF_OK ? "ids differ" : err.msg);
                if (st == KVF_OK)
                    print_ids("got ", ids, n);
            }
            free(ids);
        }
        failures += !decoded_equal(tok, json_object_get(c, "ids"), false, json_object_get(c, "decoded"), id,
                                   "decode");
        failures += !decoded_equal(tok, json_object_get(c, "ids_with_special"), false,
                                   json_object_get(c, "decoded_with_special"), id, "decode with special");
        failures += !decoded_equal(tok, json_object_get(c, "ids_with_special"), true,
                                   json_object_get(c, "decoded_skip_special"), id, "decode skipping special");
    }
    fprintf(stderr, "%s: %zu cases, %d failures; encode %.1f MB/s\n", name, json_array_size(cases), failures,
            (double)bytes / 1e6 / (t_enc > 0 ? t_enc : 1e-9));
    json_decref(root);
    return failures;
}

static void test_qwen3_cases(void **state) { assert_int_equal(run_cases(qwen, "qwen3"), 0); }
static void test_mistral7b_cases(void **state) { assert_int_equal(run_cases(mistral, "mistral7b"), 0); }

/* The rendered chat prompts of qwen3/chat_cases.json encode to their ids. */
static void test_qwen3_chat_prompts(void **state)
{
    json_error_t je;
    json_t *root = json_load_file(kvf_test_shared_path("fixtures/tokenizers/qwen3/chat_cases.json"), 0, &je);
    assert_non_null(root);
    json_t *cases = json_object_get(root, "cases");
    assert_true(json_array_size(cases) >= 6);
    int failures = 0;
    for (size_t k = 0; k < json_array_size(cases); k++) {
        json_t *c = json_array_get(cases, k);
        json_t *text = json_object_get(c, "rendered");
        int32_t *ids;
        size_t n;
        kvf_err err = {0};
        assert_int_equal(kvf_text_tokenizer_encode(qwen, json_string_value(text), json_string_length(text), false,
                                                    &ids, &n, &err), KVF_OK);
        if (!ids_equal(ids, n, json_object_get(c, "ids"))) {
            fprintf(stderr, "%s: chat prompt ids differ\n", json_string_value(json_object_get(c, "id")));
            print_ids("got ", ids, n);
            failures++;
        }
        free(ids);
    }
    json_decref(root);
    assert_int_equal(failures, 0);
}

typedef struct thread_arg {
    const char *text;
    size_t len;
    int32_t *want;
    size_t n_want;
    int mismatches;
} thread_arg;

static void *encode_many(void *p)
{
    thread_arg *a = p;
    for (int r = 0; r < 50; r++) {
        int32_t *ids;
        size_t n;
        kvf_err err = {0};
        if (kvf_text_tokenizer_encode(qwen, a->text, a->len, false, &ids, &n, &err) != KVF_OK ||
            n != a->n_want || memcmp(ids, a->want, n * sizeof *ids) != 0)
            a->mismatches++;
        else
            free(ids);
    }
    return NULL;
}

/* A loaded tokenizer is shared by threads (the router's workers): same answers, no races. */
static void test_concurrent_encode(void **state)
{
    static const char text[] = "Concurrent requests: caf\xC3\xA9, \xE4\xBD\xA0\xE5\xA5\xBD, 12345 <|im_start|>user\n";
    thread_arg args[4];
    pthread_t th[4];
    kvf_err err = {0};
    for (int i = 0; i < 4; i++) {
        args[i] = (thread_arg){.text = text, .len = sizeof text - 1};
        assert_int_equal(kvf_text_tokenizer_encode(qwen, text, sizeof text - 1, false, &args[i].want,
                                                    &args[i].n_want, &err), KVF_OK);
    }
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&th[i], NULL, encode_many, &args[i]), 0);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].mismatches, 0);
        free(args[i].want);
    }
}

static void test_special_tokens(void **state)
{
    /* qwen3: no BOS, EOS <|im_end|>, pad <|endoftext|> */
    assert_null(kvf_text_tokenizer_bos_token(qwen));
    assert_int_equal(kvf_text_tokenizer_bos_id(qwen), -1);
    assert_string_equal(kvf_text_tokenizer_eos_token(qwen), "<|im_end|>");
    assert_int_equal(kvf_text_tokenizer_eos_id(qwen), 151645);
    assert_string_equal(kvf_text_tokenizer_pad_token(qwen), "<|endoftext|>");
    assert_int_equal(kvf_text_tokenizer_pad_id(qwen), 151643);
    assert_int_equal(kvf_text_tokenizer_token_to_id(qwen, "<|im_start|>"), 151644);
    assert_int_equal(kvf_text_tokenizer_token_to_id(qwen, "<think>"), 151667);
    assert_int_equal(kvf_text_tokenizer_token_to_id(qwen, "no such token"), -1);
    assert_string_equal(kvf_text_tokenizer_id_to_token(qwen, 151644), "<|im_start|>");
    assert_true(kvf_text_tokenizer_is_special(qwen, 151644));
    assert_false(kvf_text_tokenizer_is_special(qwen, 151667)); /* <think> is added, not special */
    assert_int_equal(kvf_text_tokenizer_vocab_size(qwen), 151669);
    assert_non_null(kvf_text_tokenizer_chat_template(qwen));
    size_t n;
    const int32_t *eos = kvf_text_tokenizer_eos_ids(qwen, &n);
    assert_int_equal(n, 1);
    assert_int_equal(eos[0], 151645);
    assert_null(kvf_text_tokenizer_id_to_token(qwen, 151669));
    assert_null(kvf_text_tokenizer_id_to_token(qwen, -1));

    /* mistral7b: BOS <s> = 1, EOS </s> = 2, no chat template */
    assert_string_equal(kvf_text_tokenizer_bos_token(mistral), "<s>");
    assert_int_equal(kvf_text_tokenizer_bos_id(mistral), 1);
    assert_string_equal(kvf_text_tokenizer_eos_token(mistral), "</s>");
    assert_int_equal(kvf_text_tokenizer_eos_id(mistral), 2);
    assert_int_equal(kvf_text_tokenizer_token_to_id(mistral, "\xE2\x96\x81Hello"), 22557);
    assert_int_equal(kvf_text_tokenizer_token_to_id(mistral, "<0x0A>"), 13);
    assert_int_equal(kvf_text_tokenizer_vocab_size(mistral), 32000);
    assert_null(kvf_text_tokenizer_chat_template(mistral));
}

/* Splitting one character over several tokens: nothing comes out until it is whole. */
static void test_stream_holds_partial_utf8(void **state)
{
    /* U+1F600 (F0 9F 98 80) as byte tokens: Mistral's byte fallback <0xF0> = 3 + 0xF0 */
    int32_t ids[4] = {3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80};
    kvf_text_detok *d;
    kvf_err err = {0};
    assert_int_equal(kvf_text_detok_create(mistral, false, &d, &err), KVF_OK);
    kvf_sbuf out;
    kvf_sbuf_init(&out);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvf_text_detok_feed(d, &ids[i], 1, &out, &err), KVF_OK);
        assert_int_equal(out.len, 0);
    }
    assert_int_equal(kvf_text_detok_feed(d, &ids[3], 1, &out, &err), KVF_OK);
    assert_int_equal(out.len, 4);
    assert_memory_equal(out.data, "\xF0\x9F\x98\x80", 4);

    /* an id outside the vocabulary is refused and changes nothing */
    int32_t bad[2] = {3 + 0xE4, 99999};
    assert_int_equal(kvf_text_detok_feed(d, bad, 2, &out, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "99999"));
    assert_int_equal(out.len, 4);

    /* a lone lead byte at the end becomes U+FFFD at finish */
    assert_int_equal(kvf_text_detok_feed(d, bad, 1, &out, &err), KVF_OK);
    assert_int_equal(out.len, 4);
    assert_int_equal(kvf_text_detok_finish(d, &out, &err), KVF_OK);
    assert_int_equal(out.len, 7);
    assert_memory_equal(out.data + 4, "\xEF\xBF\xBD", 3);
    kvf_sbuf_fini(&out);
    kvf_text_detok_destroy(d);
}

static void test_invalid_bytes_become_fffd(void **state)
{
    /* qwen3 byte-level: 0xFF alone, then 'a'; and an interrupted 3-byte sequence */
    int32_t ff = kvf_text_tokenizer_token_to_id(qwen, "\xC3\xBF"); /* ÿ stands for byte 0xFF */
    int32_t a = kvf_text_tokenizer_token_to_id(qwen, "a");
    int32_t e4 = kvf_text_tokenizer_token_to_id(qwen, "\xC3\xA4"); /* ä stands for byte 0xE4 */
    assert_true(ff >= 0 && a >= 0 && e4 >= 0);
    int32_t ids[4] = {ff, a, e4, a};
    char *text;
    size_t len;
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_decode(qwen, ids, 4, false, &text, &len, &err), KVF_OK);
    assert_string_equal(text, "\xEF\xBF\xBD" "a" "\xEF\xBF\xBD" "a");
    free(text);
}

static void test_encode_rejects_bad_utf8(void **state)
{
    int32_t *ids;
    size_t n;
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_encode(qwen, "ok\xC3(", 4, false, &ids, &n, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "byte 2"));
    /* NUL bytes are ordinary text */
    assert_int_equal(kvf_text_tokenizer_encode(qwen, "a\0b", 3, false, &ids, &n, &err), KVF_OK);
    assert_int_equal(n, 3);
    char *text;
    size_t len;
    assert_int_equal(kvf_text_tokenizer_decode(qwen, ids, n, false, &text, &len, &err), KVF_OK);
    assert_int_equal(len, 3);
    assert_memory_equal(text, "a\0b", 3);
    free(text);
    free(ids);
}

/* A long run with no pre-tokenizer split goes through BPE as one word (Mistral). */
static void test_long_word_is_fast(void **state)
{
    size_t n = 200000;
    char *s = malloc(n);
    for (size_t i = 0; i < n; i++)
        s[i] = "abcdefgh"[i % 7];
    int32_t *ids;
    size_t n_ids;
    kvf_err err = {0};
    double t0 = kvf_now_s();
    assert_int_equal(kvf_text_tokenizer_encode(mistral, s, n, false, &ids, &n_ids, &err), KVF_OK);
    double dt = kvf_now_s() - t0;
    fprintf(stderr, "mistral7b: one 200 KB word in %.3f s, %zu ids\n", dt, n_ids);
    char *text;
    size_t len;
    assert_int_equal(kvf_text_tokenizer_decode(mistral, ids, n_ids, false, &text, &len, &err), KVF_OK);
    assert_int_equal(len, n);
    assert_memory_equal(text, s, n);
    free(text);
    free(ids);
    free(s);
}

typedef struct bad_case {
    const char *json, *want;
} bad_case;

static void test_malformed_files(void **state)
{
    static const bad_case cases[] = {
        {"", "line 1"},
        {"[]", "expected an object"},
        {"{}", "\"model\" is null"},
        {"{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", "only \"BPE\""},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"x\"}, \"merges\": []}}", "expected an integer id"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -4}, \"merges\": []}}", "id -4 is out of range"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}, \"merges\": []}}", "id 0 is given to both"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a b\"]}}", "\"b\" is not in the vocabulary"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a a\"]}}", "\"a\" + \"a\" is not in"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [[\"a\"]]}}", "expected \"a b\""},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
         "\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}}}", "pre_tokenizer regex"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
         "\"normalizer\": {\"type\": \"Precompiled\"}}", "normalizer \"Precompiled\" is not supported"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
         "\"added_tokens\": [{\"id\": 5}]}", "\"added_tokens\"[0] needs"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
         "\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<s>\"}}], "
         "\"special_tokens\": {}}}", "special token \"<s>\" has no \"ids\""},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
         "\"decoder\": {\"type\": \"WordPiece\"}}", "decoder \"WordPiece\" is not supported"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"unk_token\": \"<unk>\", \"merges\": []}}",
         "\"<unk>\" is not in the vocabulary"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_text_tokenizer *t = NULL;
        kvf_err err = {0};
        kvf_status st = kvf_text_tokenizer_load_buf(cases[i].json, strlen(cases[i].json), NULL, 0, NULL, 0, &t, &err);
        if (st == KVF_OK || !strstr(err.msg, cases[i].want))
            fprintf(stderr, "case %zu: status %s, message \"%s\", want \"%s\"\n", i, kvf_status_name(st), err.msg,
                    cases[i].want);
        assert_int_not_equal(st, KVF_OK);
        assert_null(t);
        assert_non_null(strstr(err.msg, cases[i].want));
    }
    /* a bad companion is named too */
    const char *tj = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}";
    const char *gen = "{\"eos_token_id\": [0, 7]}";
    kvf_text_tokenizer *t = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_load_buf(tj, strlen(tj), NULL, 0, gen, strlen(gen), &t, &err),
                     KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "generation_config.json"));
    assert_non_null(strstr(err.msg, "eos_token_id"));
    /* a missing file names the path */
    assert_int_equal(kvf_text_tokenizer_load("/nonexistent/dir", &t, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "/nonexistent/dir"));
}

/* A small hand-written tokenizer: Metaspace pre-tokenizer, unk fusing, a post-processor
 * template, generation_config's EOS list. */
static void test_small_metaspace(void **state)
{
    const char *tj =
        "{\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"fuse_unk\": true,"
        " \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2, \"\xE2\x96\x81\": 3, \"a\": 4, \"b\": 5, \"ab\": 6,"
        "            \"\xE2\x96\x81" "ab\": 7},"
        " \"merges\": [\"a b\", \"\xE2\x96\x81 ab\"]},"
        " \"added_tokens\": [{\"id\": 1, \"content\": \"<s>\", \"special\": true},"
        "                   {\"id\": 2, \"content\": \"</s>\", \"special\": true}],"
        " \"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\xE2\x96\x81\", \"prepend_scheme\": \"first\"},"
        " \"post_processor\": {\"type\": \"TemplateProcessing\","
        "   \"single\": [{\"SpecialToken\": {\"id\": \"<s>\"}}, {\"Sequence\": {\"id\": \"A\"}}, {\"SpecialToken\": {\"id\": \"</s>\"}}],"
        "   \"special_tokens\": {\"<s>\": {\"ids\": [1]}, \"</s>\": {\"ids\": [2]}}},"
        " \"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"\xE2\x96\x81\", \"prepend_scheme\": \"first\"}}";
    const char *gen = "{\"bos_token_id\": 1, \"eos_token_id\": [2, 0]}";
    kvf_text_tokenizer *t;
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_load_buf(tj, strlen(tj), NULL, 0, gen, strlen(gen), &t, &err), KVF_OK);
    int32_t *ids;
    size_t n;
    assert_int_equal(kvf_text_tokenizer_encode(t, "ab abxy", 7, true, &ids, &n, &err), KVF_OK);
    int32_t want[] = {1, 7, 7, 0, 2}; /* <s> ▁ab ▁ab <unk>(xy fused) </s> */
    assert_int_equal(n, 5);
    assert_memory_equal(ids, want, sizeof want);
    char *text;
    assert_int_equal(kvf_text_tokenizer_decode(t, ids + 1, 2, true, &text, NULL, &err), KVF_OK);
    assert_string_equal(text, "ab ab");
    free(text);
    free(ids);
    size_t n_eos;
    const int32_t *eos = kvf_text_tokenizer_eos_ids(t, &n_eos);
    assert_int_equal(n_eos, 2);
    assert_int_equal(eos[0], 2);
    assert_int_equal(eos[1], 0);
    assert_string_equal(kvf_text_tokenizer_bos_token(t), "<s>");
    kvf_text_tokenizer_destroy(t);
}

/* Added tokens with rstrip/lstrip swallow the whitespace beside them. */
static void test_added_strip(void **state)
{
    const char *tj = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \" \": 1, \"b\": 2}, \"merges\": []},"
                     " \"added_tokens\": [{\"id\": 3, \"content\": \"<|end|>\", \"rstrip\": true, \"special\": true},"
                     "                    {\"id\": 4, \"content\": \"<m>\", \"lstrip\": true}]}";
    kvf_text_tokenizer *t;
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_load_buf(tj, strlen(tj), NULL, 0, NULL, 0, &t, &err), KVF_OK);
    static const struct {
        const char *text;
        int32_t want[4];
        size_t n;
    } cases[] = {
        {"a <|end|>  b", {0, 1, 3, 2}, 4},
        {"a  <m>b", {0, 4, 2}, 3},
        {"a\xE3\x80\x80\t<m> b", {0, 4, 1, 2}, 4}, /* U+3000 and a tab before, a space after */
        {"<|end|>\n", {3}, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int32_t *ids;
        size_t n;
        assert_int_equal(kvf_text_tokenizer_encode(t, cases[k].text, strlen(cases[k].text), false, &ids, &n, &err),
                         KVF_OK);
        assert_int_equal(n, cases[k].n);
        assert_memory_equal(ids, cases[k].want, n * sizeof *ids);
        free(ids);
    }
    kvf_text_tokenizer_destroy(t);
}

/* Llama 3 style: a Split regex then ByteLevel, and ignore_merges takes whole words from the
 * vocabulary even when the merges would not build them. */
static void test_ignore_merges(void **state)
{
    for (int ignore = 0; ignore <= 1; ignore++) {
        char tj[1024];
        snprintf(tj, sizeof tj,
                 "{\"model\": {\"type\": \"BPE\", \"ignore_merges\": %s,"
                 " \"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2, \"ab\": 3, \"abc\": 4, \"\u0120\": 5, \"\u0120abc\": 6},"
                 " \"merges\": [[\"a\", \"b\"]]},"
                 " \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": ["
                 "   {\"type\": \"Split\", \"pattern\": {\"Regex\": \" ?\\\\p{L}+\"}, \"behavior\": \"Isolated\"},"
                 "   {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]},"
                 " \"decoder\": {\"type\": \"ByteLevel\"}}",
                 ignore ? "true" : "false");
        kvf_text_tokenizer *t;
        kvf_err err = {0};
        if (kvf_text_tokenizer_load_buf(tj, strlen(tj), NULL, 0, NULL, 0, &t, &err) != KVF_OK)
            fail_msg("%s", err.msg);
        int32_t *ids;
        size_t n;
        assert_int_equal(kvf_text_tokenizer_encode(t, "abc abc", 7, false, &ids, &n, &err), KVF_OK);
        if (ignore) {
            int32_t want[2] = {4, 6};
            assert_int_equal(n, 2);
            assert_memory_equal(ids, want, sizeof want);
        } else {
            int32_t want[5] = {3, 2, 5, 3, 2};
            assert_int_equal(n, 5);
            assert_memory_equal(ids, want, sizeof want);
        }
        char *text;
        assert_int_equal(kvf_text_tokenizer_decode(t, ids, n, false, &text, NULL, &err), KVF_OK);
        assert_string_equal(text, "abc abc");
        free(text);
        free(ids);
        kvf_text_tokenizer_destroy(t);
    }
}

/* Mistral's BPE runs word by word (before each "▁") as a speed-up; a copy of the file with one
 * unreachable token holding "q▁q" turns that off, and both must give the same ids. */
static void test_word_split_is_exact(void **state)
{
    FILE *f = fopen(kvf_test_shared_path("fixtures/tokenizers/mistral7b/tokenizer.json"), "rb");
    assert_non_null(f);
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0)
        kvf_sbuf_append(&b, chunk, n);
    fclose(f);
    char *vocab = strstr(b.data, "\"vocab\": {");
    assert_non_null(vocab);
    size_t at = (size_t)(vocab - b.data) + strlen("\"vocab\": {");
    kvf_sbuf m;
    kvf_sbuf_init(&m);
    kvf_sbuf_append(&m, b.data, at);
    kvf_sbuf_puts(&m, "\"q\u2581q\": 32000, ");
    kvf_sbuf_append(&m, b.data + at, b.len - at);
    kvf_text_tokenizer *slow;
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_load_buf(m.data, m.len, NULL, 0, NULL, 0, &slow, &err), KVF_OK);
    assert_int_equal(kvf_text_tokenizer_vocab_size(slow), 32001);
    assert_true(mistral->word_split);
    assert_false(slow->word_split);
    assert_false(qwen->word_split); /* has a pre-tokenizer */

    /* words, space runs, newlines, punctuation, byte fallback, added tokens */
    kvf_sbuf text;
    kvf_sbuf_init(&text);
    static const char *const parts[] = {"Hello", " ", "  ", "   ", "world", "\n", "\t", "don't", ",", "!!", "</s>",
                                        "caf\xC3\xA9", "\xF0\x9F\x98\x80", "\xE2\x96\x81", "12", "<s>", "\xEF\xBC\xA1"};
    uint32_t x = 12345;
    for (int i = 0; i < 3000; i++) {
        x = x * 1103515245u + 12345u;
        kvf_sbuf_puts(&text, parts[(x >> 16) % (sizeof parts / sizeof parts[0])]);
    }
    for (int special = 0; special <= 1; special++) {
        int32_t *a, *c;
        size_t na, nc;
        assert_int_equal(kvf_text_tokenizer_encode(mistral, text.data, text.len, special, &a, &na, &err), KVF_OK);
        assert_int_equal(kvf_text_tokenizer_encode(slow, text.data, text.len, special, &c, &nc, &err), KVF_OK);
        assert_int_equal(na, nc);
        assert_memory_equal(a, c, na * sizeof *a);
        free(a);
        free(c);
    }
    kvf_sbuf_fini(&text);
    kvf_sbuf_fini(&m);
    kvf_sbuf_fini(&b);
    kvf_text_tokenizer_destroy(slow);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen3_cases),
        cmocka_unit_test(test_mistral7b_cases),
        cmocka_unit_test(test_qwen3_chat_prompts),
        cmocka_unit_test(test_concurrent_encode),
        cmocka_unit_test(test_special_tokens),
        cmocka_unit_test(test_stream_holds_partial_utf8),
        cmocka_unit_test(test_invalid_bytes_become_fffd),
        cmocka_unit_test(test_encode_rejects_bad_utf8),
        cmocka_unit_test(test_long_word_is_fast),
        cmocka_unit_test(test_malformed_files),
        cmocka_unit_test(test_small_metaspace),
        cmocka_unit_test(test_added_strip),
        cmocka_unit_test(test_ignore_merges),
        cmocka_unit_test(test_word_split_is_exact),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
