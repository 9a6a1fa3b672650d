/* cmd_gen_model.c: `kvfleet gen-model`: a random-weight Llama model directory (config.json,
 * model.safetensors, generation_config.json) plus the default byte-level BPE tokenizer, so every
 * command runs with no download. Weights from model/weights.h, tokenizer from tokenizer.h. */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "common/time.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "model/weights.h"

typedef struct genm_cfg {
    const char *out, *preset, *dtype, *arch;
    int32_t vocab_size;
    int64_t seed;
} genm_cfg;

static const kvf_cfg_opt genm_opts[] = {
    {"out", NULL, "directory to write (created if missing; files in it are replaced)", offsetof(genm_cfg, out), KVF_CFG_STR},
    {"preset", "tiny", "tiny (dim 64, 2 layers), small (~15M: dim 288, 6 layers), medium (~110M: dim 768, 12 layers), 1b (~1.0B: dim 2048, 16 layers, 32/8 heads; for GPUs, with --dtype bf16)",
     offsetof(genm_cfg, preset), KVF_CFG_STR},
    {"dtype", "f32", "weight dtype: f32, bf16 or f16", offsetof(genm_cfg, dtype), KVF_CFG_STR},
    {"arch", "llama", "model_type to write: llama, mistral or qwen2 (qwen2 adds q/k/v biases)", offsetof(genm_cfg, arch), KVF_CFG_STR},
    {"vocab-size", "0", "vocabulary size (0: 512 for tiny, 32000 for small and medium)", offsetof(genm_cfg, vocab_size), KVF_CFG_INT},
    {"seed", "1", "seed of the random weights (same seed, same bytes)", offsetof(genm_cfg, seed), KVF_CFG_INT64},
    {NULL},
};

static const kvf_cfg_spec genm_spec = {
    .prog = "kvfleet gen-model",
    .summary = "Writes a random-weight model with a working tokenizer: config.json, model.safetensors,\n"
               "tokenizer.json, tokenizer_config.json and generation_config.json.",
    .opts = genm_opts,
};

/* mkdir -p */
static kvf_status make_dirs(const char *path, kvf_err *err)
{
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1;; p++) {
        bool end = *p == '\0';
        if (*p == '/' || end) {
            char saved = *p;
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return kvf_err_set(err, KVF_ERR_IO, "gen-model: cannot create %s: %s", buf, strerror(errno));
            *p = saved;
        }
        if (end)
            break;
    }
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return kvf_err_set(err, KVF_ERR_IO, "gen-model: --out=%s is not a directory", path);
    return KVF_OK;
}

int kvf_cli_gen_model(int argc, char **argv)
{
    genm_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&genm_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (!c.out)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "gen-model: --out DIR is required"), &err);
    int dt = kvf_dtype_parse(c.dtype);
    if (dt != KVF_DTYPE_F32 && dt != KVF_DTYPE_BF16 && dt != KVF_DTYPE_F16)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "gen-model: --dtype=%s is not supported (use f32, bf16 or f16)",
                                        c.dtype), &err);
    int32_t vocab = c.vocab_size ? c.vocab_size : strcmp(c.preset, "tiny") == 0 ? 512 : 32000;
    if (vocab < KVF_TEXT_TOKENIZER_MIN_VOCAB || vocab > (1 << 20))
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "gen-model: --vocab-size=%d is not allowed (use %d to %d)",
                                        vocab, KVF_TEXT_TOKENIZER_MIN_VOCAB, 1 << 20), &err);
    kvf_model_config mc;
    if ((st = kvf_model_preset(c.preset, vocab, &mc, &err)) != KVF_OK)
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    if (strcmp(c.arch, "llama") == 0) {
        mc.arch = KVF_MODEL_ARCH_LLAMA;
    } else if (strcmp(c.arch, "mistral") == 0) {
        mc.arch = KVF_MODEL_ARCH_MISTRAL;
    } else if (strcmp(c.arch, "qwen2") == 0) {
        mc.arch = KVF_MODEL_ARCH_QWEN2;
        mc.qkv_bias = true;
    } else {
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "gen-model: --arch=%s is not known (use llama, mistral or qwen2)",
                                        c.arch), &err);
    }
    double t0 = kvf_now_s();
    if ((st = make_dirs(c.out, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);

    /* 1. the tokenizer, then its special ids for config.json */
    if ((st = kvf_text_tokenizer_write_default(c.out, vocab, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    kvf_text_tokenizer *tok;
    if ((st = kvf_text_tokenizer_load(c.out, &tok, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    mc.bos_id = kvf_text_tokenizer_bos_id(tok);
    int32_t eos = kvf_text_tokenizer_eos_id(tok);
    mc.n_eos = 0;
    if (eos >= 0)
        mc.eos_ids[mc.n_eos++] = eos;
    /* The default template is ChatML: a chat turn ends with <|im_end|>, so it stops generation
     * too (as Qwen's generation_config.json lists both). */
    int32_t im_end = kvf_text_tokenizer_token_to_id(tok, "<|im_end|>");
    if (im_end >= 0 && im_end != eos)
        mc.eos_ids[mc.n_eos++] = im_end;
    kvf_text_tokenizer_destroy(tok);

    /* 2. config.json, generation_config.json, the weights */
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", c.out);
    if ((st = kvf_model_config_write(path, &mc, (kvf_dtype)dt, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    snprintf(path, sizeof path, "%s/generation_config.json", c.out);
    json_t *g = json_object();
    if (mc.bos_id >= 0)
        json_object_set_new(g, "bos_token_id", json_integer(mc.bos_id));
    if (mc.n_eos > 0) {
        json_t *ids = json_array();
        for (int32_t i = 0; i < mc.n_eos; i++)
            json_array_append_new(ids, json_integer(mc.eos_ids[i]));
        json_object_set_new(g, "eos_token_id", ids);
    }
    json_object_set_new(g, "do_sample", json_false());
    int rc = json_dump_file(g, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(g);
    if (rc != 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_IO, "gen-model: cannot write %s", path), &err);
    snprintf(path, sizeof path, "%s/model.safetensors", c.out);
    if ((st = kvf_model_weights_write_random(path, &mc, (kvf_dtype)dt, (uint64_t)c.seed, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);

    /* 3. load it back, as every other command will */
    kvf_model *m;
    if ((st = kvf_model_load(c.out, &m, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    struct stat sb;
    stat(path, &sb);
    printf("gen-model: wrote %s: %s preset, %s, %d layers, dim %d, %d heads / %d kv heads, hidden %d, vocab %d, "
           "%.2fM parameters, %s weights (%lld bytes), bos %d, eos %d, in %.1f s\n",
           c.out, c.preset, kvf_model_arch_name(mc.arch), mc.n_layers, mc.dim, mc.n_heads, mc.n_kv_heads,
           mc.hidden_dim, mc.vocab_size, (double)kvf_model_config_n_params(&m->cfg) / 1e6, kvf_dtype_name((kvf_dtype)dt),
           (long long)sb.st_size, mc.bos_id, eos, kvf_now_s() - t0);
    kvf_model_destroy(m);
    return 0;
}
