/* guide.c: a guide by kind to a grammar (see guide.h). */
#include "text/guide.h"

#include <jansson.h>
#include <stdlib.h>

const char *kvf_text_guide_kind_name(int32_t kind)
{
    switch (kind) {
    case KVF_TEXT_GUIDE_NONE: return "none";
    case KVF_TEXT_GUIDE_JSON_SCHEMA: return "json_schema";
    case KVF_TEXT_GUIDE_REGEX: return "regex";
    case KVF_TEXT_GUIDE_CHOICE: return "choice";
    case KVF_TEXT_GUIDE_JSON_OBJECT: return "json_object";
    default: return "?";
    }
}

/* A JSON array of 1..KVF_TEXT_GUIDE_MAX_CHOICES strings to kvf_text_grammar_choice. */
static kvf_status compile_choice(const char *text, size_t len, kvf_text_grammar **out,
                                 kvf_err *err)
{
    json_error_t je;
    json_t *a = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!a || !json_is_array(a) || json_array_size(a) == 0 ||
        json_array_size(a) > KVF_TEXT_GUIDE_MAX_CHOICES) {
        json_decref(a);
        return kvf_err_set(err, KVF_ERR_INVALID, "a choice guide is a list of 1 to %d strings",
                           KVF_TEXT_GUIDE_MAX_CHOICES);
    }
    size_t n = json_array_size(a);
    const char **s = malloc(n * sizeof *s);
    size_t *l = malloc(n * sizeof *l);
    kvf_status st = KVF_OK;
    if (!s || !l) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "out of memory for %zu choices", n);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(a, i);
        if (!json_is_string(v)) {
            st = kvf_err_set(err, KVF_ERR_INVALID, "choice %zu is not a string", i);
            goto done;
        }
        s[i] = json_string_value(v);
        l[i] = json_string_length(v);
    }
    st = kvf_text_grammar_choice(s, l, n, out, err);
done:
    free(s);
    free(l);
    json_decref(a);
    return st;
}

kvf_status kvf_text_guide_compile(int32_t kind, const char *text, size_t len,
                                  kvf_text_grammar **out, kvf_err *err)
{
    *out = NULL;
    switch (kind) {
    case KVF_TEXT_GUIDE_JSON_SCHEMA: return kvf_text_grammar_schema(text, len, out, err);
    case KVF_TEXT_GUIDE_REGEX: return kvf_text_grammar_regex(text, len, out, err);
    case KVF_TEXT_GUIDE_CHOICE: return compile_choice(text, len, out, err);
    case KVF_TEXT_GUIDE_JSON_OBJECT: return kvf_text_grammar_json_object(out, err);
    default:
        return kvf_err_set(err, KVF_ERR_INVALID, "guide of kind %d is not one of json_schema, "
                           "regex, choice or json_object", (int)kind);
    }
}
