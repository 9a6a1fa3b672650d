/* test_tokenizer_write.c: kvf_text_tokenizer_write_default writes a tokenizer that model/'s own
 * loader reads back with exactly the requested vocabulary, the special tokens in place, text
 * round-tripping, real compression, and the same bytes for the same vocab size. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "text/tokenizer.h"
#include "testutil.h"

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    *len = fread(b, 1, (size_t)n, f);
    fclose(f);
    return b;
}

static void rm_dir(const char *dir)
{
    char p[512];
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
    unlink(p);
    rmdir(dir);
}

static void roundtrip(const kvf_text_tokenizer *t, const char *text, bool special)
{
    int32_t *ids;
    size_t n;
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_encode(t, text, strlen(text), special, &ids, &n, &err), KVF_OK);
    for (size_t i = 0; i < n; i++)
        assert_true(ids[i] >= 0 && ids[i] < kvf_text_tokenizer_vocab_size(t));
    char *back;
    assert_int_equal(kvf_text_tokenizer_decode(t, ids, n, special, &back, NULL, &err), KVF_OK);
    assert_string_equal(back, text);
    free(back);
    free(ids);
}

static void test_write_and_load(void **state)
{
    static const int32_t sizes[] = {260, 300, 1000, 4096, 32000};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        char dir[] = "/tmp/kvf_tok_XXXXXX";
        assert_non_null(mkdtemp(dir));
        kvf_err err = {0};
        assert_int_equal(kvf_text_tokenizer_write_default(dir, sizes[k], &err), KVF_OK);
        kvf_text_tokenizer *t;
        if (kvf_text_tokenizer_load(dir, &t, &err) != KVF_OK)
            fail_msg("load %d: %s", sizes[k], err.msg);
        assert_int_equal(kvf_text_tokenizer_vocab_size(t), sizes[k]);
        int32_t bos = kvf_text_tokenizer_token_to_id(t, "<|begin_of_text|>");
        int32_t eos = kvf_text_tokenizer_token_to_id(t, "<|end_of_text|>");
        int32_t ims = kvf_text_tokenizer_token_to_id(t, "<|im_start|>");
        int32_t ime = kvf_text_tokenizer_token_to_id(t, "<|im_end|>");
        assert_true(bos >= 256 && eos == bos + 1 && ims == bos + 2 && ime == bos + 3 && ime < sizes[k]);
        assert_int_equal(kvf_text_tokenizer_bos_id(t), bos);
        assert_int_equal(kvf_text_tokenizer_eos_id(t), eos);
        assert_string_equal(kvf_text_tokenizer_bos_token(t), "<|begin_of_text|>");
        assert_true(kvf_text_tokenizer_is_special(t, ime));
        assert_non_null(strstr(kvf_text_tokenizer_chat_template(t), "<|im_start|>"));

        roundtrip(t, "The bakery sold 180 loaves a day.", false);
        roundtrip(t, "  spaces,\ttabs\r\nand newlines\n\n", true);
        roundtrip(t, "caf\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80 <|im_start|>user\nhi<|im_end|>", false);

        /* with special: BOS first; chat markers are single tokens */
        int32_t *ids;
        size_t n;
        const char *chat = "<|im_start|>user\nhello<|im_end|>";
        assert_int_equal(kvf_text_tokenizer_encode(t, chat, strlen(chat), true, &ids, &n, &err), KVF_OK);
        assert_true(n >= 4);
        assert_int_equal(ids[0], bos);
        assert_int_equal(ids[1], ims);
        assert_int_equal(ids[n - 1], ime);
        free(ids);

        /* merges were learned: English compresses well below one id per byte */
        const char *en = "The boats would go out again before the morning, and the children played in the square.";
        assert_int_equal(kvf_text_tokenizer_encode(t, en, strlen(en), false, &ids, &n, &err), KVF_OK);
        if (sizes[k] >= 1000)
            assert_true(n * 3 < strlen(en));
        else if (sizes[k] == 300)
            assert_true(n < strlen(en));
        free(ids);
        kvf_text_tokenizer_destroy(t);

        /* the same size writes the same bytes */
        if (sizes[k] == 1000) {
            char dir2[] = "/tmp/kvf_tok_XXXXXX";
            assert_non_null(mkdtemp(dir2));
            assert_int_equal(kvf_text_tokenizer_write_default(dir2, sizes[k], &err), KVF_OK);
            char p1[256], p2[256];
            snprintf(p1, sizeof p1, "%s/tokenizer.json", dir);
            snprintf(p2, sizeof p2, "%s/tokenizer.json", dir2);
            size_t l1, l2;
            char *b1 = slurp(p1, &l1), *b2 = slurp(p2, &l2);
            assert_non_null(b1);
            assert_non_null(b2);
            assert_int_equal(l1, l2);
            assert_memory_equal(b1, b2, l1);
            free(b1);
            free(b2);
            rm_dir(dir2);
        }
        rm_dir(dir);
    }
}

static void test_write_rejects_bad_args(void **state)
{
    kvf_err err = {0};
    assert_int_equal(kvf_text_tokenizer_write_default("/tmp", 100, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "vocab size 100"));
    assert_int_equal(kvf_text_tokenizer_write_default("/nonexistent/dir", 1000, &err), KVF_ERR_IO);
    assert_non_null(strstr(err.msg, "/nonexistent/dir/tokenizer.json"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_and_load),
        cmocka_unit_test(test_write_rejects_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
