/* json.c: jansson loading and typed getters. */
#include "common/json.h"

#include <stdlib.h>

kvf_status kvf_json_load_file(const char *path, json_t **out, kvf_err *err)
{
    json_error_t je;
    json_t *j = json_load_file(path, JSON_DECODE_ANY, &je);
    if (!j)
        return kvf_err_set(err, KVF_ERR_PARSE, "%s: line %d column %d: %s", path, je.line,
                           je.column, je.text);
    *out = j;
    return KVF_OK;
}

kvf_status kvf_json_load_buf(const char *buf, size_t len, const char *what, json_t **out,
                             kvf_err *err)
{
    json_error_t je;
    json_t *j = json_loadb(buf, len, JSON_DECODE_ANY, &je);
    if (!j)
        return kvf_err_set(err, KVF_ERR_PARSE, "%s: line %d column %d: %s", what, je.line,
                           je.column, je.text);
    *out = j;
    return KVF_OK;
}

const char *kvf_json_kind(const json_t *v)
{
    switch (v ? json_typeof(v) : JSON_NULL) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

static kvf_status get(const json_t *obj, const char *key, json_t **v, kvf_err *err)
{
    if (!json_is_object(obj))
        return kvf_err_set(err, KVF_ERR_INVALID, "expected an object holding \"%s\", found %s",
                           key, kvf_json_kind(obj));
    *v = json_object_get(obj, key);
    if (!*v)
        return kvf_err_set(err, KVF_ERR_NOT_FOUND, "\"%s\" is missing", key);
    return KVF_OK;
}

static kvf_status wrong(const char *key, const json_t *v, const char *want, kvf_err *err)
{
    return kvf_err_set(err, KVF_ERR_INVALID, "\"%s\" is %s, expected %s", key, kvf_json_kind(v),
                       want);
}

kvf_status kvf_json_get_int(const json_t *obj, const char *key, int64_t *out, kvf_err *err)
{
    json_t *v = NULL;
    kvf_status st = get(obj, key, &v, err);
    if (st != KVF_OK)
        return st;
    if (json_is_integer(v)) {
        *out = json_integer_value(v);
        return KVF_OK;
    }
    if (json_is_real(v)) { /* 4.0 is an integer; 4.5 is not */
        double d = json_real_value(v);
        /* range first: casting 1e84 to int64_t is undefined (found by tests/fuzz/fuzz_trace) */
        if (d >= -9223372036854775808.0 && d < 9223372036854775808.0 && d == (double)(int64_t)d) {
            *out = (int64_t)d;
            return KVF_OK;
        }
    }
    return wrong(key, v, "an integer", err);
}

kvf_status kvf_json_get_num(const json_t *obj, const char *key, double *out, kvf_err *err)
{
    json_t *v = NULL;
    kvf_status st = get(obj, key, &v, err);
    if (st != KVF_OK)
        return st;
    if (!json_is_number(v))
        return wrong(key, v, "a number", err);
    *out = json_number_value(v);
    return KVF_OK;
}

kvf_status kvf_json_get_bool(const json_t *obj, const char *key, bool *out, kvf_err *err)
{
    json_t *v = NULL;
    kvf_status st = get(obj, key, &v, err);
    if (st != KVF_OK)
        return st;
    if (!json_is_boolean(v))
        return wrong(key, v, "a boolean", err);
    *out = json_is_true(v);
    return KVF_OK;
}

kvf_status kvf_json_get_str(const json_t *obj, const char *key, const char **out, kvf_err *err)
{
    json_t *v = NULL;
    kvf_status st = get(obj, key, &v, err);
    if (st != KVF_OK)
        return st;
    if (!json_is_string(v))
        return wrong(key, v, "a string", err);
    *out = json_string_value(v);
    return KVF_OK;
}

kvf_status kvf_json_get_i32_array(const json_t *obj, const char *key, int32_t **out,
                                  size_t *n_out, kvf_err *err)
{
    json_t *v = NULL;
    kvf_status st = get(obj, key, &v, err);
    if (st != KVF_OK)
        return st;
    if (!json_is_array(v))
        return wrong(key, v, "an array of integers", err);
    size_t n = json_array_size(v);
    int32_t *a = malloc((n ? n : 1) * sizeof *a);
    if (!a)
        return kvf_err_set(err, KVF_ERR_NOMEM, "\"%s\": out of memory for %zu integers", key, n);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_integer(e) || json_integer_value(e) < INT32_MIN ||
            json_integer_value(e) > INT32_MAX) {
            free(a);
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "\"%s\"[%zu] is %s, expected a 32-bit integer", key, i,
                               kvf_json_kind(e));
        }
        a[i] = (int32_t)json_integer_value(e);
    }
    *out = a;
    *n_out = n;
    return KVF_OK;
}
