/* safetensors.c: mapping safetensors files and checking their headers: 8-byte little-endian
 * header length, a JSON object of {dtype, shape, data_offsets} per tensor, then the data.
 * Every offset and size is checked against the file before a tensor view is made. */
#include "model/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/dtype.h"
#include "common/json.h"

#define ST_MAX_SHARDS 4096

typedef struct st_shard {
    void *map; /* NULL when the buffer was borrowed */
    size_t len;
} st_shard;

struct kvf_model_safetensors {
    st_shard *shards;
    int32_t n_shards, cap_shards;
    kvf_model_tensor *tensors; /* sorted by name after loading */
    size_t n, cap;
};

typedef struct st_dtype_info {
    const char *name;
    int size;
    int dtype; /* kvf_dtype or -1 */
} st_dtype_info;

static const st_dtype_info st_dtypes[] = {
    {"F32", 4, KVF_DTYPE_F32}, {"F16", 2, KVF_DTYPE_F16}, {"BF16", 2, KVF_DTYPE_BF16},
    {"F8_E4M3", 1, KVF_DTYPE_FP8_E4M3}, {"F8_E5M2", 1, -1}, {"F64", 8, -1}, {"I64", 8, -1},
    {"U64", 8, -1}, {"I32", 4, -1}, {"U32", 4, -1}, {"I16", 2, -1}, {"U16", 2, -1},
    {"I8", 1, -1}, {"U8", 1, -1}, {"BOOL", 1, -1},
};

const char *kvf_model_tensor_shape_str(const kvf_model_tensor *t, char *buf, size_t cap)
{
    size_t n = 0;
    n += (size_t)snprintf(buf, cap, "[");
    for (int32_t i = 0; i < t->n_dims && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
    return buf;
}

static kvf_status add_shard(kvf_model_safetensors *st, void *map, size_t len, kvf_err *err)
{
    if (st->n_shards == st->cap_shards) {
        int32_t cap = st->cap_shards ? st->cap_shards * 2 : 4;
        st_shard *s = realloc(st->shards, (size_t)cap * sizeof *s);
        if (!s)
            return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory for safetensors shards");
        st->shards = s;
        st->cap_shards = cap;
    }
    st->shards[st->n_shards++] = (st_shard){.map = map, .len = len};
    return KVF_OK;
}

static kvf_status parse_tensor(const char *what, const char *name, const json_t *v,
                               const uint8_t *data, uint64_t data_len, kvf_model_tensor *t,
                               kvf_err *err)
{
    if (!json_is_object(v))
        return kvf_err_set(err, KVF_ERR_PARSE, "model: %s: tensor \"%s\" is %s, expected an object",
                           what, name, kvf_json_kind(v));
    const json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape"),
                 *off = json_object_get(v, "data_offsets");
    if (!json_is_string(dt))
        return kvf_err_set(err, KVF_ERR_PARSE, "model: %s: tensor \"%s\": \"dtype\" is missing or not a string",
                           what, name);
    const st_dtype_info *info = NULL;
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (strcmp(json_string_value(dt), st_dtypes[i].name) == 0)
            info = &st_dtypes[i];
    if (!info)
        return kvf_err_set(err, KVF_ERR_PARSE, "model: %s: tensor \"%s\": unknown dtype \"%.16s\"", what,
                           name, json_string_value(dt));
    if (!json_is_array(sh) || json_array_size(sh) > KVF_MODEL_MAX_DIMS)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "model: %s: tensor \"%s\": \"shape\" must be an array of at most %d sizes",
                           what, name, KVF_MODEL_MAX_DIMS);
    memset(t, 0, sizeof *t);
    t->dtype = info->dtype;
    snprintf(t->dtype_name, sizeof t->dtype_name, "%s", info->name);
    t->n_dims = (int32_t)json_array_size(sh);
    uint64_t n_elems = 1;
    for (int32_t i = 0; i < t->n_dims; i++) {
        const json_t *d = json_array_get(sh, (size_t)i);
        if (!json_is_integer(d) || json_integer_value(d) < 0 || json_integer_value(d) > (1ll << 40))
            return kvf_err_set(err, KVF_ERR_PARSE, "model: %s: tensor \"%s\": shape[%d] is not a size",
                               what, name, i);
        t->shape[i] = json_integer_value(d);
        if (t->shape[i] && n_elems > (UINT64_MAX >> 4) / (uint64_t)t->shape[i])
            return kvf_err_set(err, KVF_ERR_PARSE, "model: %s: tensor \"%s\": shape is too large", what, name);
        n_elems *= (uint64_t)t->shape[i];
    }
    if (!json_is_array(off) || json_array_size(off) != 2 || !json_is_integer(json_array_get(off, 0)) ||
        !json_is_integer(json_array_get(off, 1)))
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "model: %s: tensor \"%s\": \"data_offsets\" must be [begin, end]", what, name);
    json_int_t b = json_integer_value(json_array_get(off, 0)), e = json_integer_value(json_array_get(off, 1));
    if (b < 0 || e < b || (uint64_t)e > data_len)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "model: %s: tensor \"%s\": data_offsets [%lld, %lld] are outside the data (%llu bytes)",
                           what, name, (long long)b, (long long)e, (unsigned long long)data_len);
    uint64_t want = n_elems * (uint64_t)info->size;
    if ((uint64_t)(e - b) != want) {
        char sbuf[128];
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "model: %s: tensor \"%s\": shape %s of %s needs %llu bytes, data_offsets give %lld",
                           what, name, kvf_model_tensor_shape_str(t, sbuf, sizeof sbuf), info->name,
                           (unsigned long long)want, (long long)(e - b));
    }
    t->n_elems = (int64_t)n_elems;
    t->n_bytes = (int64_t)want;
    t->data = data + b;
    return KVF_OK;
}

static int cmp_tensor(const void *a, const void *b)
{
    return strcmp(((const kvf_model_tensor *)a)->name, ((const kvf_model_tensor *)b)->name);
}

/* Parses one image into st as shard number `shard`. */
static kvf_status parse_into(kvf_model_safetensors *st, const uint8_t *buf, size_t len,
                             const char *what, int32_t shard, kvf_err *err)
{
    if (len < 8)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "model: %s: file is %zu bytes, shorter than the 8-byte header length", what, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | buf[i];
    if (hlen > len - 8)
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "model: %s: header length %llu runs past the end of the file (%zu bytes): truncated?",
                           what, (unsigned long long)hlen, len);
    if (hlen > KVF_MODEL_ST_MAX_HEADER)
        return kvf_err_set(err, KVF_ERR_PARSE, "model: %s: header length %llu is above the %u-byte limit",
                           what, (unsigned long long)hlen, KVF_MODEL_ST_MAX_HEADER);
    json_error_t je;
    json_t *h = json_loadb((const char *)buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!h)
        return kvf_err_set(err, KVF_ERR_PARSE, "model: %s: header JSON: line %d column %d: %s", what,
                           je.line, je.column, je.text);
    kvf_status st_code = KVF_OK;
    if (!json_is_object(h)) {
        st_code = kvf_err_set(err, KVF_ERR_PARSE, "model: %s: header is %s, expected an object", what,
                              kvf_json_kind(h));
        goto done;
    }
    const uint8_t *data = buf + 8 + hlen;
    uint64_t data_len = len - 8 - hlen;
    const char *key;
    json_t *v;
    json_object_foreach(h, key, v) {
        if (strcmp(key, "__metadata__") == 0)
            continue;
        kvf_model_tensor t;
        if ((st_code = parse_tensor(what, key, v, data, data_len, &t, err)) != KVF_OK)
            goto done;
        if (st->n == st->cap) {
            size_t cap = st->cap ? st->cap * 2 : 64;
            kvf_model_tensor *nt = realloc(st->tensors, cap * sizeof *nt);
            if (!nt) {
                st_code = kvf_err_set(err, KVF_ERR_NOMEM, "model: %s: out of memory for tensors", what);
                goto done;
            }
            st->tensors = nt;
            st->cap = cap;
        }
        t.name = strdup(key);
        if (!t.name) {
            st_code = kvf_err_set(err, KVF_ERR_NOMEM, "model: %s: out of memory for tensor names", what);
            goto done;
        }
        t.shard = shard;
        st->tensors[st->n++] = t;
    }
done:
    json_decref(h);
    return st_code;
}

/* Sorts the tensors by name and refuses duplicates (a name in two shards). */
static kvf_status finish(kvf_model_safetensors *st, const char *what, kvf_err *err)
{
    if (st->n)
        qsort(st->tensors, st->n, sizeof *st->tensors, cmp_tensor);
    for (size_t i = 1; i < st->n; i++)
        if (strcmp(st->tensors[i - 1].name, st->tensors[i].name) == 0)
            return kvf_err_set(err, KVF_ERR_PARSE, "model: %s: tensor \"%s\" appears twice", what,
                               st->tensors[i].name);
    return KVF_OK;
}

static kvf_model_safetensors *st_new(void)
{
    return calloc(1, sizeof(kvf_model_safetensors));
}

void kvf_model_safetensors_destroy(kvf_model_safetensors *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < st->n; i++)
        free((char *)st->tensors[i].name);
    for (int32_t i = 0; i < st->n_shards; i++)
        if (st->shards[i].map)
            munmap(st->shards[i].map, st->shards[i].len);
    free(st->tensors);
    free(st->shards);
    free(st);
}

kvf_status kvf_model_safetensors_parse(const void *buf, size_t len, const char *what,
                                       kvf_model_safetensors **out, kvf_err *err)
{
    kvf_model_safetensors *st = st_new();
    if (!st)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory");
    kvf_status s;
    if ((s = add_shard(st, NULL, len, err)) != KVF_OK ||
        (s = parse_into(st, buf, len, what, 0, err)) != KVF_OK || (s = finish(st, what, err)) != KVF_OK) {
        kvf_model_safetensors_destroy(st);
        return s;
    }
    *out = st;
    return KVF_OK;
}

/* Maps path and parses it into st as a new shard. */
static kvf_status map_into(kvf_model_safetensors *st, const char *path, kvf_err *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvf_err_set(err, errno == ENOENT ? KVF_ERR_NOT_FOUND : KVF_ERR_IO, "model: cannot open %s: %s",
                           path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return kvf_err_set(err, KVF_ERR_IO, "model: %s is not a regular file", path);
    }
    size_t len = (size_t)sb.st_size;
    if (len < 8) {
        close(fd);
        return kvf_err_set(err, KVF_ERR_PARSE,
                           "model: %s: file is %zu bytes, shorter than the 8-byte header length", path, len);
    }
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED)
        return kvf_err_set(err, KVF_ERR_IO, "model: cannot map %s (%zu bytes): %s", path, len, strerror(e));
    kvf_status s = add_shard(st, map, len, err);
    if (s != KVF_OK) {
        munmap(map, len);
        return s;
    }
    return parse_into(st, map, len, path, st->n_shards - 1, err);
}

kvf_status kvf_model_safetensors_open(const char *path, kvf_model_safetensors **out, kvf_err *err)
{
    kvf_model_safetensors *st = st_new();
    if (!st)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory");
    kvf_status s;
    if ((s = map_into(st, path, err)) != KVF_OK || (s = finish(st, path, err)) != KVF_OK) {
        kvf_model_safetensors_destroy(st);
        return s;
    }
    *out = st;
    return KVF_OK;
}

/* Opens the shards named by an index.json's weight_map and checks each mapping. */
static kvf_status open_index(kvf_model_safetensors *st, const char *dir, const char *index_path,
                             kvf_err *err)
{
    json_t *j;
    kvf_status s = kvf_json_load_file(index_path, &j, err);
    if (s != KVF_OK)
        return s;
    const json_t *wm = json_object_get(j, "weight_map");
    const char **names = NULL; /* shard file names, in order of first appearance */
    int32_t n_names = 0;
    if (!json_is_object(wm) || json_object_size(wm) == 0) {
        s = kvf_err_set(err, KVF_ERR_PARSE, "model: %s: \"weight_map\" is missing or empty", index_path);
        goto done;
    }
    names = calloc(json_object_size(wm), sizeof *names);
    if (!names) {
        s = kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory");
        goto done;
    }
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)wm, key, v) {
        if (!json_is_string(v) || strchr(json_string_value(v), '/') || json_string_length(v) == 0) {
            s = kvf_err_set(err, KVF_ERR_PARSE,
                            "model: %s: weight_map[\"%s\"] must be a file name in the model directory",
                            index_path, key);
            goto done;
        }
        int32_t k = 0;
        while (k < n_names && strcmp(names[k], json_string_value(v)) != 0)
            k++;
        if (k == n_names) {
            if (n_names == ST_MAX_SHARDS) {
                s = kvf_err_set(err, KVF_ERR_LIMIT, "model: %s names more than %d shards", index_path,
                                ST_MAX_SHARDS);
                goto done;
            }
            names[n_names++] = json_string_value(v);
        }
    }
    for (int32_t k = 0; k < n_names; k++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[k]);
        if ((s = map_into(st, path, err)) != KVF_OK)
            goto done;
    }
    if ((s = finish(st, index_path, err)) != KVF_OK)
        goto done;
    json_object_foreach((json_t *)wm, key, v) {
        const kvf_model_tensor *t = kvf_model_safetensors_find(st, key);
        int32_t k = 0;
        while (strcmp(names[k], json_string_value(v)) != 0)
            k++;
        if (!t || t->shard != k) {
            s = kvf_err_set(err, KVF_ERR_PARSE, "model: %s maps \"%s\" to %s, which does not hold it",
                            index_path, key, names[k]);
            goto done;
        }
    }
done:
    free(names);
    json_decref(j);
    return s;
}

kvf_status kvf_model_safetensors_open_dir(const char *dir, kvf_model_safetensors **out,
                                          kvf_err *err)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (stat(path, &sb) != 0)
            return kvf_err_set(err, KVF_ERR_NOT_FOUND,
                               "model: %s holds neither model.safetensors nor model.safetensors.index.json",
                               dir);
        return kvf_model_safetensors_open(path, out, err);
    }
    kvf_model_safetensors *st = st_new();
    if (!st)
        return kvf_err_set(err, KVF_ERR_NOMEM, "model: out of memory");
    kvf_status s = open_index(st, dir, path, err);
    if (s != KVF_OK) {
        kvf_model_safetensors_destroy(st);
        return s;
    }
    *out = st;
    return KVF_OK;
}

size_t kvf_model_safetensors_count(const kvf_model_safetensors *st)
{
    return st->n;
}

const kvf_model_tensor *kvf_model_safetensors_get(const kvf_model_safetensors *st, size_t i)
{
    return i < st->n ? &st->tensors[i] : NULL;
}

const kvf_model_tensor *kvf_model_safetensors_find(const kvf_model_safetensors *st, const char *name)
{
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->tensors[mid].name, name);
        if (c == 0)
            return &st->tensors[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

int32_t kvf_model_safetensors_n_shards(const kvf_model_safetensors *st)
{
    return st->n_shards;
}
