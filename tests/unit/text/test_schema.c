/* test_schema.c: the JSON Schema compiler (text/schema.c) through the matcher: for each schema,
 * documents it admits are accepted byte by byte and end accepting (and the first of them also
 * token by token through the Qwen3 masks), documents it does not admit are refused; every
 * keyword outside the supported list is refused by name and JSON pointer; hostile schemas (deep
 * nesting, huge enums, $ref cycles that consume nothing, huge bounds) are errors, not crashes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "text/grammar.h"
#include "text/tokenizer.h"

static kvf_text_tokenizer *tok;
static kvf_text_vocab *vocab;

static int setup(void **state)
{
    (void)state;
    kvf_err err = {0};
    if (kvf_text_tokenizer_load(kvf_test_shared_path("fixtures/tokenizers/qwen3"), &tok, &err) !=
            KVF_OK ||
        kvf_text_vocab_create(tok, kvf_text_tokenizer_vocab_size(tok), &vocab, &err) != KVF_OK) {
        fprintf(stderr, "qwen3 vocabulary: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvf_text_vocab_destroy(vocab);
    kvf_text_tokenizer_destroy(tok);
    return 0;
}

/* Whole document accepted by bytes, ending where an end id would be allowed. */
static bool admits(kvf_text_grammar *g, const char *doc)
{
    kvf_text_matcher *m = NULL;
    kvf_err err = {0};
    int32_t end = 0;
    assert_int_equal(kvf_text_matcher_create(g, vocab, &end, 1, &m, &err), KVF_OK);
    bool ok = kvf_text_matcher_accept_bytes(m, doc, strlen(doc), &err) == KVF_OK &&
              kvf_text_matcher_accepting(m);
    kvf_text_matcher_destroy(m);
    return ok;
}

/* The document's Qwen3 tokens, each allowed by the mask before it, then the end id. */
static void admits_by_tokens(kvf_text_grammar *g, const char *doc)
{
    kvf_err err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(kvf_text_tokenizer_encode(tok, doc, strlen(doc), false, &ids, &n, &err),
                     KVF_OK);
    size_t n_eos = 0;
    const int32_t *eos = kvf_text_tokenizer_eos_ids(tok, &n_eos);
    assert_true(n_eos > 0);
    kvf_text_matcher *m = NULL;
    assert_int_equal(kvf_text_matcher_create(g, vocab, eos, n_eos, &m, &err), KVF_OK);
    uint32_t *mask = calloc(kvf_text_vocab_mask_words(vocab), sizeof *mask);
    assert_non_null(mask);
    for (size_t i = 0; i <= n; i++) {
        int32_t id = i < n ? ids[i] : eos[0];
        if (kvf_text_matcher_mask(m, mask, &err) != KVF_OK)
            fail_msg("%s: mask at token %zu: %s", doc, i, err.msg);
        if (!(mask[id / 32] >> (id % 32) & 1))
            fail_msg("%s: token %zu (id %d) not in the mask", doc, i, id);
        if (kvf_text_matcher_accept(m, id, &err) != KVF_OK)
            fail_msg("%s: accept token %zu: %s", doc, i, err.msg);
    }
    assert_true(kvf_text_matcher_done(m));
    free(mask);
    free(ids);
    kvf_text_matcher_destroy(m);
}

typedef struct schema_case {
    const char *schema;
    const char *valid[10];
    const char *invalid[12];
} schema_case;

static const schema_case cases[] = {
    /* an object with required and optional properties, bounds, a format */
    {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":20},"
     "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
     "\"email\":{\"type\":\"string\",\"format\":\"email\"}},\"required\":[\"name\",\"age\"]}",
     {"{\"name\":\"Ann\",\"age\":30}", "{\"name\": \"Bob\", \"age\": 0, \"email\": \"b@x.io\"}",
      "{\n  \"name\":\"\\u00e9\\n\",\n\t\"age\":150\n}", "{ \"name\" : \"\" , \"age\" : 7 }"},
     {"{\"age\":30,\"name\":\"Ann\"}", "{\"name\":\"Ann\"}", "{\"name\":\"Ann\",\"age\":151}",
      "{\"name\":\"Ann\",\"age\":-1}", "{\"name\":\"Ann\",\"age\":30,\"x\":1}",
      "{\"name\":\"Ann\",  \"age\":30}", "{\"name\":\"Ann\",\"age\":030}",
      " {\"name\":\"Ann\",\"age\":3}", "{\"name\":\"Ann\",\"age\":3,\"email\":\"nope\"}",
      "{\"name\":\"012345678901234567890\",\"age\":3}"}},
    /* nested objects and a bounded array */
    {"{\"type\":\"object\",\"properties\":{\"user\":{\"type\":\"object\",\"properties\":{"
     "\"id\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},"
     "\"maxItems\":3}},\"required\":[\"id\"]}},\"required\":[\"user\"]}",
     {"{\"user\":{\"id\":-5}}", "{\"user\":{\"id\":12,\"tags\":[]}}",
      "{\"user\":{\"id\":1,\"tags\":[\"a\", \"b\",\"c\"]}}"},
     {"{\"user\":{}}", "{\"user\":{\"id\":1,\"tags\":[\"a\",\"b\",\"c\",\"d\"]}}",
      "{\"user\":{\"id\":1.5}}", "{}", "{\"user\":{\"id\":1,\"tags\":[1]}}"}},
    /* enum of any values */
    {"{\"enum\":[\"red\",\"green\",1,null,{\"a\":[1,2]},\"q\\\"uote\",2.5,true]}",
     {"\"red\"", "1", "null", "{\"a\":[1,2]}", "\"q\\\"uote\"", "2.5", "true"},
     {"\"blue\"", "2", "false", "\"Red\"", "{\"a\":[1]}", "\"q\"uote\""}},
    /* anyOf and nullable types */
    {"{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\",\"maxLength\":2},"
     "{\"type\":[\"boolean\",\"null\"]}]}",
     {"12", "\"ab\"", "null", "false"}, {"\"abc\"", "1.5", "[]", "{}"}},
    /* a pattern whose characters JSON must escape */
    {"{\"type\":\"string\",\"pattern\":\"^[a-z]+\\\"?[0-9]{2}$\"}",
     {"\"ab12\"", "\"abc\\\"12\""}, {"\"ab\"12\"", "\"AB12\"", "\"ab1\"", "\"ab123\""}},
    {"{\"type\":\"string\",\"pattern\":\"^a.b\\\\sc\\\\\\\\[^x]$\"}",
     {"\"a\\\"b c\\\\y\"", "\"a\\\\b\\nc\\\\\\t\"", "\"a\\u0001b\\tc\\\\\\\"\""},
     {"\"a\nb c\\\\y\"", "\"aab c\\\\x\"", "\"a\\\"b\nc\\\\y\""}},
    /* recursion through $ref: a tree */
    {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
     "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\"]}},"
     "\"$ref\":\"#/$defs/node\"}",
     {"{\"v\":1}", "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[{\"v\":4,\"kids\":[]}]}]}"},
     {"{\"v\":1,\"kids\":[{}]}", "{\"kids\":[]}", "{\"v\":1,\"kids\":[{\"v\":\"x\"}]}"}},
    /* integer ranges */
    {"{\"type\":\"integer\",\"minimum\":-15,\"maximum\":1234}",
     {"-15", "-1", "0", "9", "10", "99", "100", "999", "1000", "1234"},
     {"-16", "1235", "-0", "01", "10000", "1240", "2000", "-20", "1.0"}},
    {"{\"type\":\"integer\",\"exclusiveMinimum\":5}", {"6", "100000", "10"}, {"5", "0", "-3"}},
    {"{\"type\":\"integer\",\"maximum\":-10}", {"-10", "-11", "-999999"}, {"-9", "0", "5"}},
    {"{\"type\":\"number\",\"minimum\":0,\"maximum\":10}",
     {"0", "3.14", "10", "10.000", "0.5", "9.999"}, {"10.5", "-0.5", "1e2", "11", "10.01"}},
    /* prefixItems and item counts */
    {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"integer\"},{\"type\":\"string\"}],"
     "\"minItems\":1}",
     {"[1]", "[1, \"a\"]", "[ 1 ]"}, {"[]", "[1,\"a\",2]", "[\"a\"]"}},
    {"{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"minItems\":2,\"maxItems\":3}",
     {"[true,false]", "[true,false,true]"}, {"[true]", "[true,true,true,true]", "[]"}},
    /* additional properties under a schema, after the listed ones, never a listed name */
    {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
     "\"additionalProperties\":{\"type\":\"string\"}}",
     {"{\"a\":1,\"b\":\"x\"}", "{\"b\":\"x\"}", "{}", "{\"a\":1}", "{\"ab\":\"x\",\"c\":\"\"}",
      "{\"kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk\":\"x\"}"},
     {"{\"a\":1,\"a\":\"x\"}", "{\"b\":1}", "{\"b\":\"x\",\"a\":1}", "{\"kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk\":\"x\"}",
      "{\"\":\"x\"}", "{\"a\\u0062\":\"x\"}"}},
    /* what Pydantic v2 writes: $defs, a $ref with a description beside it, Optional as anyOf
     * with null and a default, a dict as additionalProperties, a tuple as prefixItems */
    {"{\"$defs\":{\"Color\":{\"enum\":[\"red\",\"blue\"],\"title\":\"Color\",\"type\":"
     "\"string\"}},\"properties\":{\"color\":{\"$ref\":\"#/$defs/Color\",\"description\":"
     "\"paint\"},\"size\":{\"anyOf\":[{\"type\":\"integer\",\"minimum\":0},{\"type\":"
     "\"null\"}],\"default\":null,\"title\":\"Size\"},\"extra\":{\"additionalProperties\":"
     "{\"type\":\"integer\"},\"title\":\"Extra\",\"type\":\"object\"},\"pair\":{"
     "\"maxItems\":2,\"minItems\":2,\"prefixItems\":[{\"type\":\"integer\"},{\"type\":"
     "\"string\"}],\"title\":\"Pair\",\"type\":\"array\"}},\"required\":[\"color\",\"pair\"],"
     "\"title\":\"Model\",\"type\":\"object\"}",
     {"{\"color\":\"red\",\"pair\":[1,\"a\"]}",
      "{\"color\": \"blue\", \"size\": null, \"extra\": {\"k\": 3}, \"pair\": [2, \"b\"]}",
      "{\"color\":\"red\",\"size\":7,\"pair\":[1,\"a\"]}"},
     {"{\"color\":\"green\",\"pair\":[1,\"a\"]}", "{\"color\":\"red\",\"pair\":[1]}",
      "{\"color\":\"red\",\"size\":-1,\"pair\":[1,\"a\"]}",
      "{\"color\":\"red\",\"extra\":{\"k\":\"v\"},\"pair\":[1,\"a\"]}"}},
    /* a negated shorthand inside a class */
    {"{\"type\":\"string\",\"pattern\":\"^[\\\\D]{2}$\"}", {"\"a\\\"\"", "\"xy\""},
     {"\"a1\"", "\"abc\""}},
    /* anything */
    {"{}", {"1", "{\"a\":[1,{\"b\":null}]}", "\"x\"", "[]", "-0.5e+10"}, {"", "{", "tru"}},
    {"{\"const\":{\"k\":[true,null]}}", {"{\"k\":[true,null]}"}, {"{\"k\":[true]}"}},
    /* lengths count characters, an escape as one */
    {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}",
     {"\"ab\"", "\"\\n\\t\"", "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"", "\"a\\u00e9\""},
     {"\"a\"", "\"abcd\"", "\"\\ud83d\\ude00\""}},
    /* formats */
    {"{\"type\":\"string\",\"format\":\"date\"}", {"\"2024-02-28\"", "\"1999-12-31\""},
     {"\"2024-02-30\"", "\"2024-13-01\"", "\"24-01-01\""}},
    {"{\"type\":\"string\",\"format\":\"date-time\"}",
     {"\"2024-02-28T12:30:00Z\"", "\"2024-04-30T23:59:59.123+05:30\""},
     {"\"2024-02-28T12:30:00\"", "\"2024-02-28 12:30:00Z\""}},
    {"{\"type\":\"string\",\"format\":\"uuid\"}", {"\"123e4567-e89b-12d3-a456-426614174000\""},
     {"\"123e4567e89b12d3a456426614174000\""}},
    /* oneOf, allOf of one, a type inferred from the keywords, definitions */
    {"{\"definitions\":{\"s\":{\"type\":\"string\",\"maxLength\":1}},\"oneOf\":[{\"allOf\":[{"
     "\"$ref\":\"#/definitions/s\"}]},{\"properties\":{\"x\":{\"type\":\"null\"}},"
     "\"required\":[\"x\"]}]}",
     {"\"a\"", "{\"x\":null}"}, {"\"ab\"", "{}", "null"}},
};

static void test_cases(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const schema_case *c = &cases[i];
        kvf_text_grammar *g = NULL;
        kvf_err err = {0};
        if (kvf_text_grammar_schema(c->schema, strlen(c->schema), &g, &err) != KVF_OK)
            fail_msg("schema %zu %s: %s", i, c->schema, err.msg);
        for (size_t k = 0; k < 10 && c->valid[k]; k++)
            if (!admits(g, c->valid[k]))
                fail_msg("schema %zu %s refuses %s", i, c->schema, c->valid[k]);
        for (size_t k = 0; k < 12 && c->invalid[k]; k++)
            if (admits(g, c->invalid[k]))
                fail_msg("schema %zu %s admits %s", i, c->schema, c->invalid[k]);
        admits_by_tokens(g, c->valid[0]);
        kvf_text_grammar_destroy(g);
    }
}

static void test_json_object(void **state)
{
    (void)state;
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    assert_int_equal(kvf_text_grammar_json_object(&g, &err), KVF_OK);
    assert_true(admits(g, "{}"));
    assert_true(admits(g, "{\"a\": [1, {\"b\": null}], \"c\": \"\\u0041\"}"));
    assert_false(admits(g, "[]"));
    assert_false(admits(g, "\"x\""));
    assert_false(admits(g, "{\"a\":}"));
    admits_by_tokens(g, "{\"tool\": \"search\", \"args\": {\"q\": \"kv cache\", \"k\": 3}}");
    kvf_text_grammar_destroy(g);
}

static void expect_error(const char *schema, const char *want)
{
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    kvf_status st = kvf_text_grammar_schema(schema, strlen(schema), &g, &err);
    if (st == KVF_OK) {
        kvf_text_grammar_destroy(g);
        fail_msg("%.200s compiled; want an error with \"%s\"", schema, want);
    }
    if (!strstr(err.msg, want))
        fail_msg("%.200s: \"%s\" lacks \"%s\"", schema, err.msg, want);
}

static void test_unsupported_keywords(void **state)
{
    (void)state;
    static const char *const kws[] = {
        "if", "then", "else", "not", "uniqueItems", "contains", "patternProperties",
        "propertyNames", "minProperties", "maxProperties", "multipleOf", "dependentRequired",
        "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
        "$anchor", "$dynamicRef", "nullable", "minContains", "maxContains", "contentEncoding"};
    for (size_t i = 0; i < sizeof kws / sizeof kws[0]; i++) {
        char schema[256], want[160];
        snprintf(schema, sizeof schema,
                 "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"%s\":1}}}",
                 kws[i]);
        snprintf(want, sizeof want, "unsupported JSON Schema keyword \"%s\" at /properties/a",
                 kws[i]);
        expect_error(schema, want);
    }
    expect_error("{\"items\":[{\"oneOf\":[{\"not\":{}}]}]}",
                 "unsupported JSON Schema keyword \"not\" at /prefixItems/0/oneOf/0");
    expect_error("{\"properties\":{\"a/b~\":{\"if\":{}}}}",
                 "unsupported JSON Schema keyword \"if\" at /properties/a~1b~0");
    expect_error("{\"type\":\"string\",\"format\":\"ipv4\"}", "unsupported format \"ipv4\"");
    expect_error("{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", "pattern");
    expect_error("{\"type\":\"string\",\"pattern\":\"a\",\"maxLength\":3}", "together");
}

/* An enum of 5000 strings: one choice, so masks stay within the automaton's stack bound. */
static void test_large_enum(void **state)
{
    (void)state;
    size_t n_vals = 5000;
    char *s = malloc(n_vals * 16 + 32);
    assert_non_null(s);
    size_t n = (size_t)sprintf(s, "{\"enum\":[");
    for (size_t i = 0; i < n_vals; i++)
        n += (size_t)sprintf(s + n, "%s\"item-%zu\"", i ? "," : "", i);
    n += (size_t)sprintf(s + n, "]}");
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    if (kvf_text_grammar_schema(s, n, &g, &err) != KVF_OK)
        fail_msg("enum of %zu: %s", n_vals, err.msg);
    assert_true(admits(g, "\"item-4999\""));
    assert_true(admits(g, "\"item-0\""));
    assert_false(admits(g, "\"item-5000\""));
    assert_false(admits(g, "\"item-\""));
    admits_by_tokens(g, "\"item-1234\"");
    kvf_text_grammar_destroy(g);
    free(s);
}

static void test_hostile(void **state)
{
    (void)state;
    /* nesting past KVF_TEXT_GRAMMAR_MAX_DEPTH */
    size_t depth = 1000;
    char *deep = malloc(depth * 12 + 16);
    assert_non_null(deep);
    size_t n = 0;
    for (size_t i = 0; i < depth; i++)
        n += (size_t)sprintf(deep + n, "{\"items\":");
    n += (size_t)sprintf(deep + n, "{}");
    for (size_t i = 0; i < depth; i++)
        deep[n++] = '}';
    deep[n] = 0;
    expect_error(deep, "deeper than");
    free(deep);
    /* a huge enum */
    size_t n_vals = 300000;
    char *big = malloc(n_vals * 8 + 32);
    assert_non_null(big);
    n = (size_t)sprintf(big, "{\"enum\":[");
    for (size_t i = 0; i < n_vals; i++)
        n += (size_t)sprintf(big + n, "%s%zu", i ? "," : "", i);
    n += (size_t)sprintf(big + n, "]}");
    {
        kvf_text_grammar *g = NULL;
        kvf_err err = {0};
        assert_int_not_equal(kvf_text_grammar_schema(big, n, &g, &err), KVF_OK);
        assert_true(err.msg[0] != 0);
    }
    free(big);
    /* references that consume nothing */
    expect_error("{\"$ref\":\"#\"}", "$ref");
    expect_error("{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/b\"},\"b\":{\"$ref\":\"#/$defs/a\"}},"
                 "\"$ref\":\"#/$defs/a\"}", "$ref");
    {
        const char *s = "{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"null\"}]}";
        kvf_text_grammar *g = NULL;
        kvf_err err = {0};
        assert_int_not_equal(kvf_text_grammar_schema(s, strlen(s), &g, &err), KVF_OK);
    }
    expect_error("{\"$ref\":\"#/$defs/missing\"}", "names nothing");
    expect_error("{\"$ref\":\"http://example.com/s.json\"}", "not local");
    expect_error("{\"type\":\"string\",\"minLength\":5,\"maxLength\":2}", "minLength");
    expect_error("{\"type\":\"integer\",\"minimum\":5,\"maximum\":2}", "no integer");
    expect_error("{\"type\":\"integer\",\"minimum\":1e300}", "beyond");
    expect_error("{\"type\":\"string\",\"maxLength\":-1}", "maxLength");
    expect_error("{\"type\":\"objekt\"}", "unknown type");
    expect_error("{\"anyOf\":[]}", "anyOf");
    expect_error("{\"allOf\":[{},{}]}", "allOf");
    expect_error("{\"anyOf\":[{}],\"properties\":{}}", "beside");
    expect_error("{\"type\":\"object\",\"required\":[\"x\"],\"properties\":{\"a\":{}}}",
                 "required property \"x\"");
    expect_error("{\"type\":", "not JSON");
    expect_error("[1]", "must be an object or a boolean");
    /* a huge repetition: an error from the builder's size bound, not gigabytes */
    {
        const char *s = "{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{"
                        "\"a\":{\"type\":\"string\",\"maxLength\":100000}}},\"maxItems\":100000}";
        kvf_text_grammar *g = NULL;
        kvf_err err = {0};
        if (kvf_text_grammar_schema(s, strlen(s), &g, &err) == KVF_OK)
            kvf_text_grammar_destroy(g); /* a builder that counts natively may take it */
    }
    /* many references to one definition, twice per level: linear, and quick */
    {
        char s[8192];
        n = (size_t)sprintf(s, "{\"$defs\":{");
        for (int i = 0; i < 40; i++)
            n += (size_t)sprintf(s + n,
                                 "\"d%d\":{\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":"
                                 "\"#/$defs/d%d\"},\"y\":{\"$ref\":\"#/$defs/d%d\"}}},",
                                 i, i + 1, i + 1);
        n += (size_t)sprintf(s + n, "\"d40\":{\"type\":\"integer\"}},\"$ref\":\"#/$defs/d0\"}");
        kvf_text_grammar *g = NULL;
        kvf_err err = {0};
        if (kvf_text_grammar_schema(s, n, &g, &err) != KVF_OK)
            fail_msg("shared definitions: %s", err.msg);
        kvf_text_grammar_destroy(g);
    }
    /* optional properties: 250 in a row run through the masks; 300 are refused by name */
    {
        static char s[32768];
        for (int k = 0; k < 2; k++) {
            int n_props = k ? 300 : 250;
            n = (size_t)sprintf(s, "{\"type\":\"object\",\"properties\":{");
            for (int i = 0; i < n_props; i++)
                n += (size_t)sprintf(s + n, "%s\"p%d\":{\"type\":\"integer\"}", i ? "," : "", i);
            n += (size_t)sprintf(s + n, "}}");
            kvf_text_grammar *g = NULL;
            kvf_err err = {0};
            kvf_status st = kvf_text_grammar_schema(s, n, &g, &err);
            if (k) {
                assert_int_not_equal(st, KVF_OK);
                assert_non_null(strstr(err.msg, "300 optional properties in a row"));
                continue;
            }
            if (st != KVF_OK)
                fail_msg("250 optional properties: %s", err.msg);
            admits_by_tokens(g, "{\"p0\": 1, \"p5\": 22, \"p249\": 3}");
            admits_by_tokens(g, "{}");
            kvf_text_grammar_destroy(g);
        }
    }
    /* bad arguments */
    {
        kvf_text_grammar *g = NULL;
        kvf_err err = {0};
        assert_int_not_equal(kvf_text_grammar_schema(NULL, 0, &g, &err), KVF_OK);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cases),
        cmocka_unit_test(test_json_object),
        cmocka_unit_test(test_unsupported_keywords),
        cmocka_unit_test(test_large_enum),
        cmocka_unit_test(test_hostile),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
