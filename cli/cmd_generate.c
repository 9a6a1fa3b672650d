/* cmd_generate.c: `kvfleet generate`: greedy generation for one sequence, straight over the
 * forward pass and a private paged KV pool: the reference end-to-end tests compare the fleet
 * with. The engine will replace the loop inside; the flags and the --json output stay. */
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "common/log.h"
#include "common/time.h"
#include "kv/layout.h"
#include "model/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/tokenizer.h"

typedef struct gen_cfg {
    const char *model, *prompt_ids, *prompt, *kv_dtype;
    int32_t max_tokens, block_size, threads, prefill_chunk;
    int64_t kv_memory;
    bool json, ignore_eos, half_weights;
} gen_cfg;

static const kvf_cfg_opt gen_opts[] = {
    {"model", NULL, "model directory (config.json, model.safetensors, tokenizer.json)", offsetof(gen_cfg, model), KVF_CFG_STR},
    {"prompt-ids", NULL, "prompt as comma-separated token ids: 1,2,3", offsetof(gen_cfg, prompt_ids), KVF_CFG_STR},
    {"prompt", NULL, "prompt as text (needs the model's tokenizer.json)", offsetof(gen_cfg, prompt), KVF_CFG_STR},
    {"max-tokens", "16", "tokens to generate at most", offsetof(gen_cfg, max_tokens), KVF_CFG_INT},
    {"ignore-eos", NULL, "keep generating past an end-of-sequence token", offsetof(gen_cfg, ignore_eos), KVF_CFG_BOOL},
    {"block-size", "16", "tokens per KV block (a power of two)", offsetof(gen_cfg, block_size), KVF_CFG_INT},
    {"kv-dtype", "f32", "KV cache dtype: f32, f16 or bf16", offsetof(gen_cfg, kv_dtype), KVF_CFG_STR},
    {"kv-memory", "0", "KV pool bytes (K/M/G suffixes); 0: just enough for this request", offsetof(gen_cfg, kv_memory), KVF_CFG_SIZE},
    {"prefill-chunk", "512", "prompt tokens per forward step", offsetof(gen_cfg, prefill_chunk), KVF_CFG_INT},
    {"threads", "0", "CPU threads (0: one per CPU)", offsetof(gen_cfg, threads), KVF_CFG_INT},
    {"half-weights", NULL, "keep F16/BF16 matrices as stored (half the memory) instead of converting to f32 at load",
     offsetof(gen_cfg, half_weights), KVF_CFG_BOOL},
    {"json", NULL, "print {\"prompt_ids\",\"output_ids\",\"finish_reason\"} as one JSON line", offsetof(gen_cfg, json), KVF_CFG_BOOL},
    {NULL},
};

static const kvf_cfg_spec gen_spec = {
    .prog = "kvfleet generate",
    .summary = "Greedy generation for one prompt in this process, on the CPU backend.\n"
               "Give the prompt as --prompt-ids 1,2,3 or as --prompt TEXT.",
    .opts = gen_opts,
};

/* Parses "1, 2,3" into a malloc'd array. */
static kvf_status parse_ids(const char *s, int32_t **out, int32_t *n_out, kvf_err *err)
{
    size_t cap = 16, n = 0;
    int32_t *a = malloc(cap * sizeof *a);
    if (!a)
        return kvf_err_set(err, KVF_ERR_NOMEM, "generate: out of memory");
    const char *p = s;
    for (;;) {
        while (*p == ' ')
            p++;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            free(a);
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "generate: --prompt-ids=%s: \"%.20s\" is not a token id (use comma-separated non-negative integers)",
                               s, p);
        }
        if (n == cap) {
            cap *= 2;
            int32_t *b = realloc(a, cap * sizeof *a);
            if (!b) {
                free(a);
                return kvf_err_set(err, KVF_ERR_NOMEM, "generate: out of memory");
            }
            a = b;
        }
        a[n++] = (int32_t)v;
        p = end;
        while (*p == ' ')
            p++;
        if (*p == '\0')
            break;
        if (*p != ',') {
            free(a);
            return kvf_err_set(err, KVF_ERR_INVALID, "generate: --prompt-ids=%s: unexpected \"%c\" (use 1,2,3)", s, *p);
        }
        p++;
    }
    *out = a;
    *n_out = (int32_t)n;
    return KVF_OK;
}

static bool is_eos(const kvf_model_config *c, const int32_t *tok_eos, size_t n_tok_eos, int32_t id)
{
    for (int32_t i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == id)
            return true;
    for (size_t i = 0; i < n_tok_eos; i++)
        if (tok_eos[i] == id)
            return true;
    return false;
}

/* The model and the `plan` figures for the pool this command uses, on stderr. */
static void print_capacity(const char *dir, const kvf_model *m, const kvf_kv_layout *l, int64_t n_blocks,
                           int32_t context)
{
    char cap[512];
    fprintf(stderr,
            "kvfleet: model %s: %s, %d layers, dim %d, %d/%d heads, vocab %d, %s weights, %.1fM parameters\n"
            "kvfleet: %s\n",
            dir, kvf_model_arch_name(m->cfg.arch), m->cfg.n_layers, m->cfg.dim, m->cfg.n_heads,
            m->cfg.n_kv_heads, m->cfg.vocab_size, kvf_dtype_name(m->weight_dtype),
            (double)kvf_model_config_n_params(&m->cfg) / 1e6,
            kvf_model_capacity_str(l, n_blocks, context, cap, sizeof cap));
}

int kvf_cli_generate(int argc, char **argv)
{
    gen_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&gen_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (!c.model)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "generate: --model DIR is required"), &err);
    if (!c.prompt_ids == !c.prompt)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "generate: give exactly one of --prompt-ids and --prompt"), &err);
    if (c.max_tokens < 1 || c.prefill_chunk < 1 || c.threads < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID,
                                        "generate: --max-tokens (%d) and --prefill-chunk (%d) must be positive, --threads (%d) not negative",
                                        c.max_tokens, c.prefill_chunk, c.threads), &err);
    int kv_dt = kvf_dtype_parse(c.kv_dtype);
    if (kv_dt != KVF_DTYPE_F32 && kv_dt != KVF_DTYPE_F16 && kv_dt != KVF_DTYPE_BF16)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "generate: --kv-dtype=%s is not supported (use f32, f16 or bf16)",
                                        c.kv_dtype), &err);

    kvf_model *m = NULL;
    kvf_model_tokenizer *tok = NULL;
    const kvf_backend *be = kvf_model_backend_cpu();
    void *ctx = NULL;
    kvf_model_fwd *fwd = NULL;
    void *pool = NULL;
    int32_t *prompt = NULL, *out = NULL, n_prompt = 0;
    int rc = 1;

    if ((st = kvf_model_load(c.model, &m, &err)) != KVF_OK)
        goto fail;
    /* the tokenizer: needed for --prompt, used for showing text when present */
    char tpath[4096];
    struct stat sb;
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", c.model);
    if (c.prompt || stat(tpath, &sb) == 0) {
        kvf_err terr = {0};
        st = kvf_model_tokenizer_load(c.model, &tok, &terr);
        if (st != KVF_OK && c.prompt) {
            err = terr;
            goto fail;
        }
        if (st != KVF_OK)
            kvf_log(KVF_LOG_WARN, "generate: tokenizer not used: %s", terr.msg);
    }
    if (c.prompt) {
        size_t n;
        if ((st = kvf_model_tokenizer_encode(tok, c.prompt, strlen(c.prompt), true, &prompt, &n, &err)) != KVF_OK)
            goto fail;
        n_prompt = (int32_t)n;
        if (n_prompt == 0) {
            st = kvf_err_set(&err, KVF_ERR_INVALID, "generate: --prompt encodes to no tokens");
            goto fail;
        }
    } else if ((st = parse_ids(c.prompt_ids, &prompt, &n_prompt, &err)) != KVF_OK) {
        goto fail;
    }
    for (int32_t i = 0; i < n_prompt; i++)
        if (prompt[i] >= m->cfg.vocab_size) {
            st = kvf_err_set(&err, KVF_ERR_INVALID, "generate: prompt token %d at index %d is outside the vocabulary (0 to %d)",
                             prompt[i], i, m->cfg.vocab_size - 1);
            goto fail;
        }
    int64_t context = (int64_t)n_prompt + c.max_tokens;
    if (context > m->cfg.max_pos) {
        st = kvf_err_set(&err, KVF_ERR_INVALID,
                         "generate: %d prompt tokens + --max-tokens %d = %lld exceeds the model's max_position_embeddings (%d)",
                         n_prompt, c.max_tokens, (long long)context, m->cfg.max_pos);
        goto fail;
    }

    /* the KV pool: a private block pool; the block table is simply 0, 1, 2, ... */
    kvf_kv_layout lay;
    if ((st = kvf_model_kv_layout(m, c.block_size, (kvf_dtype)kv_dt, &lay, &err)) != KVF_OK)
        goto fail;
    int64_t need = kvf_kv_blocks_for(context, c.block_size);
    int64_t n_blocks = c.kv_memory > 0 ? c.kv_memory / lay.block_bytes : need;
    print_capacity(c.model, m, &lay, n_blocks, (int32_t)context);
    if (n_blocks < need) {
        st = kvf_err_set(&err, KVF_ERR_FULL,
                         "generate: --kv-memory=%lld holds %lld blocks; this request needs %lld (%lld bytes)",
                         (long long)c.kv_memory, (long long)n_blocks, (long long)need, (long long)(need * lay.block_bytes));
        goto fail;
    }
    if ((st = be->create(&(kvf_backend_opts){.n_threads = c.threads, .half_weights = c.half_weights}, &ctx, &err)) != KVF_OK)
        goto fail;
    int32_t chunk = c.prefill_chunk < n_prompt ? c.prefill_chunk : n_prompt;
    kvf_model_fwd_opts fo = {.max_tokens = chunk, .max_seqs = 1, .max_ctx = (int32_t)context};
    if ((st = kvf_model_fwd_create(m, be, ctx, &lay, &fo, &fwd, &err)) != KVF_OK)
        goto fail;
    if ((st = be->alloc(ctx, (size_t)(n_blocks * lay.block_bytes), &pool, &err)) != KVF_OK)
        goto fail;
    int32_t *table = calloc((size_t)need, sizeof *table);
    out = calloc((size_t)c.max_tokens, sizeof *out);
    if (!table || !out) {
        free(table);
        st = kvf_err_set(&err, KVF_ERR_NOMEM, "generate: out of memory");
        goto fail;
    }
    for (int64_t i = 0; i < need; i++)
        table[i] = (int32_t)i;

    size_t n_tok_eos = 0;
    const int32_t *tok_eos = tok ? kvf_model_tokenizer_eos_ids(tok, &n_tok_eos) : NULL;
    double t0 = kvf_now_s(), t_first = 0;
    int32_t pos = 0, next = -1, n_out = 0;
    const char *finish = "length";
    /* prefill in chunks; the last chunk's argmax is the first new token */
    while (pos < n_prompt) {
        int32_t take = n_prompt - pos < chunk ? n_prompt - pos : chunk;
        kvf_model_seq s = {.tokens = prompt + pos, .n_tokens = take, .start_pos = pos,
                           .block_table = table, .n_blocks = (int32_t)need};
        if ((st = kvf_model_forward(fwd, &s, 1, pool, n_blocks, NULL, &next, &err)) != KVF_OK)
            break;
        pos += take;
    }
    t_first = kvf_now_s();
    /* decode one token at a time */
    while (st == KVF_OK) {
        out[n_out++] = next;
        if (!c.ignore_eos && is_eos(&m->cfg, tok_eos, n_tok_eos, next)) {
            finish = "stop";
            break;
        }
        if (n_out == c.max_tokens)
            break;
        kvf_model_seq s = {.tokens = &next, .n_tokens = 1, .start_pos = pos, .block_table = table,
                           .n_blocks = (int32_t)need};
        int32_t cur = next;
        s.tokens = &cur;
        if ((st = kvf_model_forward(fwd, &s, 1, pool, n_blocks, NULL, &next, &err)) != KVF_OK)
            break;
        pos++;
    }
    double t_end = kvf_now_s();
    free(table);
    if (st != KVF_OK)
        goto fail;
    fprintf(stderr, "kvfleet: prefill %d tokens in %.1f ms (%.1f tokens/s); decode %d tokens in %.1f ms (%.1f tokens/s)\n",
            n_prompt, (t_first - t0) * 1e3, n_prompt / (t_first - t0 > 0 ? t_first - t0 : 1e-9), n_out - 1,
            (t_end - t_first) * 1e3, (n_out - 1) / (t_end - t_first > 0 ? t_end - t_first : 1e-9));

    char *text = NULL;
    if (tok && kvf_model_tokenizer_decode(tok, out, (size_t)n_out, true, &text, NULL, &err) != KVF_OK) {
        kvf_log(KVF_LOG_WARN, "generate: cannot show the output as text: %s", err.msg);
        text = NULL;
    }
    if (c.json) {
        json_t *j = json_object(), *pa = json_array(), *oa = json_array();
        for (int32_t i = 0; i < n_prompt; i++)
            json_array_append_new(pa, json_integer(prompt[i]));
        for (int32_t i = 0; i < n_out; i++)
            json_array_append_new(oa, json_integer(out[i]));
        json_object_set_new(j, "prompt_ids", pa);
        json_object_set_new(j, "output_ids", oa);
        json_object_set_new(j, "finish_reason", json_string(finish));
        if (text)
            json_object_set_new(j, "text", json_string(text));
        char *s = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(j);
    } else if (text) {
        printf("%s\n", text);
    } else {
        for (int32_t i = 0; i < n_out; i++)
            printf("%s%d", i ? "," : "", out[i]);
        printf("\n");
    }
    free(text);
    rc = 0;
    goto done;
fail:
    rc = kvf_cli_exit(st, &err);
done:
    if (pool)
        be->free(ctx, pool);
    kvf_model_fwd_destroy(fwd);
    if (ctx)
        be->destroy(ctx);
    kvf_model_tokenizer_destroy(tok);
    kvf_model_destroy(m);
    free(prompt);
    free(out);
    return rc;
}
