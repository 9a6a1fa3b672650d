/* cmd_plan.c: `kvfleet plan`: KV sizing for a model and a memory budget: bytes per token per
 * dtype, bytes per block, blocks in the budget, and how many sequences of a given context fit.
 * Sequences are counted in whole blocks, as the pool allocates them. */
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "common/json.h"
#include "kv/layout.h"

typedef struct plan_cfg {
    const char *config;
    int32_t layers, kv_heads, head_dim, block_size;
    int64_t memory, context;
    const char *dtype;
    bool json;
} plan_cfg;

static const kvf_cfg_opt plan_opts[] = {
    {"config", NULL, "a model's config.json (or its directory)", offsetof(plan_cfg, config), KVF_CFG_STR},
    {"layers", "0", "number of layers (instead of --config)", offsetof(plan_cfg, layers), KVF_CFG_INT},
    {"kv-heads", "0", "number of KV heads (instead of --config)", offsetof(plan_cfg, kv_heads), KVF_CFG_INT},
    {"head-dim", "0", "head dimension (instead of --config)", offsetof(plan_cfg, head_dim), KVF_CFG_INT},
    {"memory", "40G", "KV memory budget (bytes; K/M/G suffixes are binary)", offsetof(plan_cfg, memory), KVF_CFG_SIZE},
    {"context", "8192", "tokens per sequence for the concurrency column", offsetof(plan_cfg, context), KVF_CFG_INT64},
    {"block-size", "16", "tokens per KV block", offsetof(plan_cfg, block_size), KVF_CFG_INT},
    {"dtype", NULL, "only this KV dtype (f32, f16, bf16, fp8-e4m3); default all", offsetof(plan_cfg, dtype), KVF_CFG_STR},
    {"json", NULL, "print one JSON object instead of a table", offsetof(plan_cfg, json), KVF_CFG_BOOL},
    {NULL},
};

static const kvf_cfg_spec plan_spec = {
    .prog = "kvfleet plan",
    .summary = "KV cache sizing. Give a model's config.json with --config, or its shape with\n"
               "--layers, --kv-heads and --head-dim.",
    .opts = plan_opts,
};

/* Reads the KV shape from a Hugging Face config.json. */
static kvf_status read_shape(const char *path, plan_cfg *c, kvf_err *err)
{
    char buf[4096];
    size_t n = 0;
    while (path[n])
        n++;
    if (n > 0 && path[n - 1] != '/' && (n < 5 || strcmp(path + n - 5, ".json") != 0))
        snprintf(buf, sizeof buf, "%s/config.json", path);
    else
        snprintf(buf, sizeof buf, "%s", path);
    json_t *j;
    kvf_status st = kvf_json_load_file(buf, &j, err);
    if (st != KVF_OK)
        return st;
    int64_t layers, heads, kv_heads, hidden, head_dim;
    if ((st = kvf_json_get_int(j, "num_hidden_layers", &layers, err)) != KVF_OK ||
        (st = kvf_json_get_int(j, "num_attention_heads", &heads, err)) != KVF_OK)
        goto fail;
    st = kvf_json_get_int(j, "num_key_value_heads", &kv_heads, err);
    if (st == KVF_ERR_NOT_FOUND)
        kv_heads = heads, st = KVF_OK;
    if (st != KVF_OK)
        goto fail;
    st = kvf_json_get_int(j, "head_dim", &head_dim, err);
    if (st == KVF_ERR_NOT_FOUND) {
        if ((st = kvf_json_get_int(j, "hidden_size", &hidden, err)) != KVF_OK)
            goto fail;
        if (heads <= 0 || hidden % heads != 0) {
            st = kvf_err_set(err, KVF_ERR_INVALID,
                             "\"num_attention_heads\" (%lld) does not divide \"hidden_size\" (%lld)",
                             (long long)heads, (long long)hidden);
            goto fail;
        }
        head_dim = hidden / heads;
    } else if (st != KVF_OK) {
        goto fail;
    }
    if (layers <= 0 || kv_heads <= 0 || head_dim <= 0 || layers > INT32_MAX ||
        kv_heads > INT32_MAX || head_dim > INT32_MAX) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "layers (%lld), kv heads (%lld) and head_dim (%lld) must be positive",
                         (long long)layers, (long long)kv_heads, (long long)head_dim);
        goto fail;
    }
    c->layers = (int32_t)layers;
    c->kv_heads = (int32_t)kv_heads;
    c->head_dim = (int32_t)head_dim;
    json_decref(j);
    return KVF_OK;
fail:
    json_decref(j);
    return kvf_err_prefix(err, "%s", buf);
}

int kvf_cli_plan(int argc, char **argv)
{
    plan_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&plan_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (c.config && (st = read_shape(c.config, &c, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (!c.config && (c.layers <= 0 || c.kv_heads <= 0 || c.head_dim <= 0)) {
        kvf_err_set(&err, KVF_ERR_INVALID,
                    "plan: give --config, or all of --layers, --kv-heads and --head-dim as "
                    "positive integers (got %d, %d, %d)", c.layers, c.kv_heads, c.head_dim);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (c.memory <= 0 || c.context <= 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "plan: --memory (%lld) and --context (%lld) must be positive",
                    (long long)c.memory, (long long)c.context);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    int only = -1;
    if (c.dtype && (only = kvf_dtype_parse(c.dtype)) < 0) {
        kvf_err_set(&err, KVF_ERR_INVALID, "plan: --dtype=%s is not a KV dtype (use f32, f16, bf16 or fp8-e4m3)", c.dtype);
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }

    json_t *out = c.json ? json_object() : NULL;
    json_t *rows = c.json ? json_array() : NULL;
    if (!c.json) {
        printf("model: %d layers, %d KV heads, head_dim %d; block size %d; budget %lld bytes (%.2f GiB); context %lld\n\n",
               c.layers, c.kv_heads, c.head_dim, c.block_size, (long long)c.memory,
               (double)c.memory / (1024.0 * 1024 * 1024), (long long)c.context);
        printf("%-9s %15s %15s %12s %18s %12s\n", "dtype", "bytes/token", "bytes/block", "blocks",
               "tokens", "seqs@context");
    }
    for (int d = 0; d < KVF_DTYPE_COUNT; d++) {
        if (only >= 0 && d != only)
            continue;
        kvf_kv_layout l;
        st = kvf_kv_layout_init(c.layers, c.kv_heads, c.head_dim, c.block_size, (kvf_dtype)d, &l, &err);
        if (st != KVF_OK) {
            json_decref(out);
            json_decref(rows);
            return kvf_cli_exit(st, &err);
        }
        int64_t blocks = c.memory / l.block_bytes;
        int64_t per_seq = kvf_kv_blocks_for(c.context, c.block_size);
        int64_t seqs = blocks / per_seq;
        if (c.json) {
            json_array_append_new(rows, json_pack("{s:s,s:I,s:I,s:I,s:I,s:I}", "dtype", kvf_dtype_name(l.dtype),
                                                  "bytes_per_token", (json_int_t)kvf_kv_bytes_per_token(&l),
                                                  "bytes_per_block", (json_int_t)l.block_bytes,
                                                  "blocks", (json_int_t)blocks,
                                                  "tokens", (json_int_t)(blocks * c.block_size),
                                                  "max_seqs", (json_int_t)seqs));
        } else {
            printf("%-9s %15lld %15lld %12lld %18lld %12lld\n", kvf_dtype_name(l.dtype),
                   (long long)kvf_kv_bytes_per_token(&l), (long long)l.block_bytes, (long long)blocks,
                   (long long)(blocks * c.block_size), (long long)seqs);
        }
    }
    if (c.json) {
        json_object_set_new(out, "layers", json_integer(c.layers));
        json_object_set_new(out, "kv_heads", json_integer(c.kv_heads));
        json_object_set_new(out, "head_dim", json_integer(c.head_dim));
        json_object_set_new(out, "block_size", json_integer(c.block_size));
        json_object_set_new(out, "memory_bytes", json_integer(c.memory));
        json_object_set_new(out, "context", json_integer(c.context));
        json_object_set_new(out, "dtypes", rows);
        char *s = json_dumps(out, JSON_COMPACT);
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(out);
    }
    return 0;
}
