/* test_safetensors.c: safetensors parsing (good headers, every kind of bad one, truncation at
 * every header byte), sharded model.safetensors.index.json, and model loading errors that
 * name the tensor, the expected shape and the shape found. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/model.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "testutil.h"

/* An image: 8-byte length, header text, data_len bytes of 0..255. malloc'd. */
static uint8_t *image(const char *header, size_t data_len, size_t *len_out)
{
    size_t h = strlen(header), n = 8 + h + data_len;
    uint8_t *b = malloc(n);
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    for (size_t i = 0; i < data_len; i++)
        b[8 + h + i] = (uint8_t)i;
    *len_out = n;
    return b;
}

static kvf_status parse_str(const char *header, size_t data_len, kvf_err *err)
{
    size_t n;
    uint8_t *b = image(header, data_len, &n);
    kvf_model_safetensors *st = NULL;
    kvf_status s = kvf_model_safetensors_parse(b, n, "t.safetensors", &st, err);
    kvf_model_safetensors_destroy(st);
    free(b);
    return s;
}

static void test_parse_good(void **state)
{
    size_t n;
    uint8_t *b = image("{\"__metadata__\":{\"format\":\"pt\"},"
                       "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[16,28]},"
                       "\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                       "\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[28,36]}}  ",
                       36, &n);
    kvf_model_safetensors *st;
    kvf_err err = {0};
    assert_int_equal(kvf_model_safetensors_parse(b, n, "t", &st, &err), KVF_OK);
    assert_int_equal(kvf_model_safetensors_count(st), 3);
    assert_string_equal(kvf_model_safetensors_get(st, 0)->name, "a"); /* sorted */
    const kvf_model_tensor *t = kvf_model_safetensors_find(st, "b");
    assert_non_null(t);
    assert_int_equal(t->dtype, KVF_DTYPE_BF16);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    assert_int_equal(t->n_bytes, 12);
    size_t hlen = n - 8 - 36;
    assert_ptr_equal(t->data, b + 8 + hlen + 16);
    char buf[64];
    assert_string_equal(kvf_model_tensor_shape_str(t, buf, sizeof buf), "[2, 3]");
    t = kvf_model_safetensors_find(st, "s");
    assert_int_equal(t->dtype, -1);
    assert_string_equal(t->dtype_name, "I64");
    assert_int_equal(t->n_elems, 1);
    assert_null(kvf_model_safetensors_find(st, "zz"));
    kvf_model_safetensors_destroy(st);
    free(b);
}

static void test_parse_bad(void **state)
{
    kvf_err err = {0};
    static const struct {
        const char *header;
        size_t data;
        const char *needle;
    } bad[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,12]}}", 16, "needs 16 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, "outside the data"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,4]}}", 16, "outside the data"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[-4,12]}}", 16, "outside the data"},
        {"{\"a\":{\"dtype\":\"Q4\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16, "unknown dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-4],\"data_offsets\":[0,16]}}", 16, "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}}", 16, "\"shape\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0]}}", 16, "data_offsets"},
        {"{\"a\":{\"shape\":[4],\"data_offsets\":[0,16]}}", 16, "dtype"},
        {"{\"a\":[1,2]}", 16, "expected an object"},
        {"[1,2]", 0, "expected an object"},
        {"{\"a\":", 0, "header JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "duplicate"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776,1099511627776],"
         "\"data_offsets\":[0,4]}}", 8, "too large"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvf_status s = parse_str(bad[i].header, bad[i].data, &err);
        if (s == KVF_OK)
            fail_msg("case %zu parsed: %s", i, bad[i].header);
        if (!strstr(err.msg, bad[i].needle))
            fail_msg("case %zu: \"%s\" not in: %s", i, bad[i].needle, err.msg);
        assert_non_null(strstr(err.msg, "t.safetensors"));
    }
    /* lengths: shorter than 8 bytes, a header length past the end */
    uint8_t small[5] = {1, 0, 0, 0, 0};
    kvf_model_safetensors *st = NULL;
    assert_int_equal(kvf_model_safetensors_parse(small, 5, "t", &st, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "shorter than"));
    uint8_t huge[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '{', '}'};
    assert_int_equal(kvf_model_safetensors_parse(huge, 16, "t", &st, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "runs past the end"));
    assert_null(st);
}

static uint8_t *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*n);
    assert_int_equal(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

/* Every truncation of a real file inside its header, and a sweep through its data, fails
 * cleanly; the whole file parses. */
static void test_truncation_sweep(void **state)
{
    size_t n;
    uint8_t *full = read_all(kvf_test_shared_path("fixtures/models/tiny-gqa-f32/model.safetensors"), &n);
    kvf_model_safetensors *st;
    kvf_err err = {0};
    assert_int_equal(kvf_model_safetensors_parse(full, n, "full", &st, &err), KVF_OK);
    kvf_model_safetensors_destroy(st);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | full[i];
    int n_cut = 0;
    for (size_t cut = 0; cut < n; cut += (cut < 8 + hlen + 64 ? 1 : 997)) {
        uint8_t *b = malloc(cut ? cut : 1); /* exact size, so an overread is visible to ASan */
        memcpy(b, full, cut);
        st = NULL;
        kvf_status s = kvf_model_safetensors_parse(b, cut, "cut", &st, &err);
        if (s == KVF_OK)
            fail_msg("a file cut to %zu of %zu bytes parsed", cut, n);
        assert_null(st);
        free(b);
        n_cut++;
    }
    print_message("%d truncations refused\n", n_cut);
    free(full);
}

/* ---- model directories in a temporary folder */
static char dir[256];

static void rm_dir(void)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static void copy_file(const char *from, const char *to)
{
    size_t n;
    uint8_t *b = read_all(from, &n);
    FILE *f = fopen(to, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    fclose(f);
    free(b);
}

/* Writes the tensors of st whose index % n_shards == k into path. */
static void write_shard(const kvf_model_safetensors *st, int k, int n_shards, const char *path)
{
    json_t *h = json_object();
    size_t off = 0;
    for (size_t i = 0; i < kvf_model_safetensors_count(st); i++) {
        if ((int)(i % (size_t)n_shards) != k)
            continue;
        const kvf_model_tensor *t = kvf_model_safetensors_get(st, i);
        json_t *shape = json_array();
        for (int d = 0; d < t->n_dims; d++)
            json_array_append_new(shape, json_integer(t->shape[d]));
        json_object_set_new(h, t->name, json_pack("{s:s,s:o,s:[I,I]}", "dtype", t->dtype_name, "shape", shape,
                                                  "data_offsets", (json_int_t)off, (json_int_t)(off + (size_t)t->n_bytes)));
        off += (size_t)t->n_bytes;
    }
    char *text = json_dumps(h, JSON_COMPACT);
    json_decref(h);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t hl = strlen(text);
    uint8_t l8[8];
    for (int i = 0; i < 8; i++)
        l8[i] = (uint8_t)(hl >> (8 * i));
    fwrite(l8, 1, 8, f);
    fwrite(text, 1, hl, f);
    for (size_t i = 0; i < kvf_model_safetensors_count(st); i++)
        if ((int)(i % (size_t)n_shards) == k) {
            const kvf_model_tensor *t = kvf_model_safetensors_get(st, i);
            fwrite(t->data, 1, (size_t)t->n_bytes, f);
        }
    fclose(f);
    free(text);
}

static void write_index(const kvf_model_safetensors *st, int n_shards, int lie)
{
    json_t *wm = json_object();
    for (size_t i = 0; i < kvf_model_safetensors_count(st); i++) {
        char name[64];
        int k = (int)(i % (size_t)n_shards);
        if (lie && i == 3)
            k = (k + 1) % n_shards;
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", k + 1, n_shards);
        json_object_set_new(wm, kvf_model_safetensors_get(st, i)->name, json_string(name));
    }
    json_t *j = json_pack("{s:{s:i},s:o}", "metadata", "total_size", 0, "weight_map", wm);
    char p[512];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    assert_int_equal(json_dump_file(j, p, 0), 0);
    json_decref(j);
}

static void test_sharded(void **state)
{
    snprintf(dir, sizeof dir, "/tmp/kvf_test_st_XXXXXX");
    assert_non_null(mkdtemp(dir));
    const char *src = "fixtures/models/small-gqa-bf16-theta5e5";
    char p[512], q[512];
    snprintf(q, sizeof q, "%s/config.json", dir);
    snprintf(p, sizeof p, "%s/config.json", src);
    copy_file(kvf_test_shared_path(p), q);
    snprintf(p, sizeof p, "%s/model.safetensors", src);
    kvf_model_safetensors *one;
    kvf_err err = {0};
    assert_int_equal(kvf_model_safetensors_open(kvf_test_shared_path(p), &one, &err), KVF_OK);
    for (int k = 0; k < 3; k++) {
        snprintf(q, sizeof q, "%s/model-%05d-of-%05d.safetensors", dir, k + 1, 3);
        write_shard(one, k, 3, q);
    }
    write_index(one, 3, 0);

    kvf_model *m;
    if (kvf_model_load(dir, &m, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    assert_int_equal(kvf_model_safetensors_n_shards(m->st), 3);
    assert_int_equal(kvf_model_safetensors_count(m->st), kvf_model_safetensors_count(one));
    for (size_t i = 0; i < kvf_model_safetensors_count(one); i++) {
        const kvf_model_tensor *a = kvf_model_safetensors_get(one, i);
        const kvf_model_tensor *b = kvf_model_safetensors_find(m->st, a->name);
        assert_non_null(b);
        assert_int_equal(b->shard, (int)(i % 3));
        assert_int_equal(a->n_bytes, b->n_bytes);
        assert_memory_equal(a->data, b->data, (size_t)a->n_bytes);
    }
    kvf_model_destroy(m);

    /* an index that puts a tensor in the wrong shard */
    write_index(one, 3, 1);
    assert_int_not_equal(kvf_model_load(dir, &m, &err), KVF_OK);
    assert_non_null(strstr(err.msg, "does not hold it"));
    /* an index naming a shard that is not there */
    write_index(one, 3, 0);
    snprintf(q, sizeof q, "%s/model-00002-of-00003.safetensors", dir);
    unlink(q);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "model-00002-of-00003.safetensors"));
    /* a truncated shard */
    write_shard(one, 1, 3, q);
    assert_int_equal(truncate(q, 1000), 0);
    assert_int_not_equal(kvf_model_load(dir, &m, &err), KVF_OK);
    assert_non_null(strstr(err.msg, "model-00002-of-00003.safetensors"));
    /* an index with no weight_map */
    snprintf(q, sizeof q, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(q, "w");
    fputs("{\"metadata\":{}}", f);
    fclose(f);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "weight_map"));
    kvf_model_safetensors_destroy(one);
    rm_dir();
}

/* A config that disagrees with the weights: the error names the tensor and both shapes. */
static void test_model_shape_errors(void **state)
{
    snprintf(dir, sizeof dir, "/tmp/kvf_test_st_XXXXXX");
    assert_non_null(mkdtemp(dir));
    kvf_model_config c;
    kvf_err err = {0};
    assert_int_equal(kvf_model_preset("tiny", 300, &c, &err), KVF_OK);
    char cfg[512], w[512];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    snprintf(w, sizeof w, "%s/model.safetensors", dir);
    assert_int_equal(kvf_model_weights_write_random(w, &c, KVF_DTYPE_BF16, 1, &err), KVF_OK);
    kvf_model *m = NULL;

    kvf_model_config bad = c;
    bad.hidden_dim = 180;
    assert_int_equal(kvf_model_config_write(cfg, &bad, KVF_DTYPE_BF16, &err), KVF_OK);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "\"model.layers.0.mlp.gate_proj.weight\": expected shape [180, 64], found [176, 64]"));

    bad = c;
    bad.tie_embeddings = true; /* fine: lm_head is then ignored */
    assert_int_equal(kvf_model_config_write(cfg, &bad, KVF_DTYPE_BF16, &err), KVF_OK);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_OK);
    assert_ptr_equal(m->lm_head, m->embed);
    kvf_model_destroy(m);

    bad = c;
    bad.qkv_bias = true;
    assert_int_equal(kvf_model_config_write(cfg, &bad, KVF_DTYPE_BF16, &err), KVF_OK);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "\"model.layers.0.self_attn.q_proj.bias\" is missing (expected shape [64])"));

    bad = c;
    bad.n_layers = 3;
    assert_int_equal(kvf_model_config_write(cfg, &bad, KVF_DTYPE_BF16, &err), KVF_OK);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "model.layers.2."));

    bad = c;
    bad.vocab_size = 320;
    assert_int_equal(kvf_model_config_write(cfg, &bad, KVF_DTYPE_BF16, &err), KVF_OK);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "\"model.embed_tokens.weight\": expected shape [320, 64], found [300, 64]"));

    /* tied weights on disk, a config asking for a separate head */
    kvf_model_config tied = c;
    tied.tie_embeddings = true;
    assert_int_equal(kvf_model_weights_write_random(w, &tied, KVF_DTYPE_F32, 1, &err), KVF_OK);
    assert_int_equal(kvf_model_config_write(cfg, &c, KVF_DTYPE_F32, &err), KVF_OK);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "\"lm_head.weight\" is missing (expected shape [300, 64])"));

    /* no weights at all */
    unlink(w);
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "model.safetensors"));
    rm_dir();
    /* no directory */
    assert_int_equal(kvf_model_load("/nonexistent/model", &m, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "config.json"));
}

/* A wrong dtype inside a real file: the error names the tensor and the dtype. */
static void test_model_dtype_error(void **state)
{
    snprintf(dir, sizeof dir, "/tmp/kvf_test_st_XXXXXX");
    assert_non_null(mkdtemp(dir));
    size_t n;
    uint8_t *b = read_all(kvf_test_shared_path("fixtures/models/tiny-gqa-f32/model.safetensors"), &n);
    /* rewrite "model.norm.weight" {"dtype":"F32"... as I32 (same size, so offsets still agree) */
    char *hdr = (char *)b + 8;
    char *at = strstr(hdr, "\"model.norm.weight\":{\"dtype\":\"F32\"");
    assert_non_null(at);
    memcpy(strstr(at, "F32"), "I32", 3);
    char p[512];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    FILE *f = fopen(p, "wb");
    fwrite(b, 1, n, f);
    fclose(f);
    free(b);
    snprintf(p, sizeof p, "%s/config.json", dir);
    copy_file(kvf_test_shared_path("fixtures/models/tiny-gqa-f32/config.json"), p);
    kvf_model *m;
    kvf_err err = {0};
    assert_int_equal(kvf_model_load(dir, &m, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "\"model.norm.weight\" is I32"));
    rm_dir();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_good),
        cmocka_unit_test(test_parse_bad),
        cmocka_unit_test(test_truncation_sweep),
        cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_model_shape_errors),
        cmocka_unit_test(test_model_dtype_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
