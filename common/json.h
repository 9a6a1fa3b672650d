/* json.h: JSON through jansson, with typed getters whose errors name the field and what was
 * found. Getters return KVF_ERR_NOT_FOUND (message set) when the key is absent, so optional
 * fields read `if (st == KVF_ERR_NOT_FOUND) use the default`. Values are borrowed from obj. */
#ifndef KVF_COMMON_JSON_H
#define KVF_COMMON_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"

/* Loads a whole file; *out is a new reference the caller json_decref()s. */
kvf_status kvf_json_load_file(const char *path, json_t **out, kvf_err *err);
kvf_status kvf_json_load_buf(const char *buf, size_t len, const char *what, json_t **out,
                             kvf_err *err);

/* "a string", "an integer", ... for messages. */
const char *kvf_json_kind(const json_t *v);

kvf_status kvf_json_get_int(const json_t *obj, const char *key, int64_t *out, kvf_err *err);
kvf_status kvf_json_get_num(const json_t *obj, const char *key, double *out, kvf_err *err);
kvf_status kvf_json_get_bool(const json_t *obj, const char *key, bool *out, kvf_err *err);
kvf_status kvf_json_get_str(const json_t *obj, const char *key, const char **out, kvf_err *err);
/* An array of integers that fit int32_t; *out is malloc'd (free it), *n_out its length. */
kvf_status kvf_json_get_i32_array(const json_t *obj, const char *key, int32_t **out,
                                  size_t *n_out, kvf_err *err);

#endif
