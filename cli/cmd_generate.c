/* cmd_generate.c: `kvfleet generate`: generation for one prompt in this process, through the
 * same engine the workers run (paged KV pool, chunked prefill, sampling): the reference the
 * end-to-end tests compare the fleet with. Streams text to a terminal; --json prints one object
 * (with each token's log-probabilities under --logprobs, the prompt's under --prompt-logprobs). */
#include <errno.h>
#include <limits.h>
#include <math.h>
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
#include "engine/engine.h"
#include "model/model.h"
#include "text/guide.h"
#include "text/tokenizer.h"
#include "engine/backends.h"

typedef struct gen_cfg {
    const char *model, *prompt_ids, *prompt, *kv_dtype, *device, *attn_decode, *logit_bias, *weight_dtype;
    const char *json_schema, *regex, *choice;
    int32_t max_tokens, block_size, threads, prefill_chunk, top_k, min_tokens, logprobs;
    int64_t kv_memory, seed;
    double temperature, top_p, kv_k_scale, kv_v_scale;
    double presence_penalty, frequency_penalty, repetition_penalty, min_p;
    bool json, ignore_eos, half_weights, no_graphs, profile, prompt_logprobs, json_object;
} gen_cfg;

static const kvf_cfg_opt gen_opts[] = {
    {"model", NULL, "model directory (config.json, model.safetensors, tokenizer.json)", offsetof(gen_cfg, model), KVF_CFG_STR},
    {"prompt-ids", NULL, "prompt as comma-separated token ids: 1,2,3", offsetof(gen_cfg, prompt_ids), KVF_CFG_STR},
    {"prompt", NULL, "prompt as text (needs the model's tokenizer.json)", offsetof(gen_cfg, prompt), KVF_CFG_STR},
    {"max-tokens", "16", "tokens to generate at most", offsetof(gen_cfg, max_tokens), KVF_CFG_INT},
    {"temperature", "0", "sampling temperature; 0 is greedy (argmax, ties to the lowest id)", offsetof(gen_cfg, temperature), KVF_CFG_DOUBLE},
    {"top-p", "1", "nucleus sampling: keep the smallest set of tokens whose probability reaches P", offsetof(gen_cfg, top_p), KVF_CFG_DOUBLE},
    {"top-k", "0", "sample among the K most likely tokens; 0: all", offsetof(gen_cfg, top_k), KVF_CFG_INT},
    {"seed", "0", "sampling seed: the same seed gives the same tokens", offsetof(gen_cfg, seed), KVF_CFG_INT64},
    {"presence-penalty", "0", "subtract P from the logit of every token already generated (-2 to 2)", offsetof(gen_cfg, presence_penalty), KVF_CFG_DOUBLE},
    {"frequency-penalty", "0", "subtract F times its count from the logit of every token already generated (-2 to 2)", offsetof(gen_cfg, frequency_penalty), KVF_CFG_DOUBLE},
    {"repetition-penalty", "1", "divide positive logits (multiply negative ones) of tokens in the prompt or the output by R (0 to 2; 1: off)", offsetof(gen_cfg, repetition_penalty), KVF_CFG_DOUBLE},
    {"min-p", "0", "drop tokens whose probability is below P times the most likely one's (0 to 1; sampling only)", offsetof(gen_cfg, min_p), KVF_CFG_DOUBLE},
    {"min-tokens", "0", "no end-of-sequence token before this many new tokens", offsetof(gen_cfg, min_tokens), KVF_CFG_INT},
    {"logit-bias", NULL, "ID:BIAS added to token ID's logit (-100 to 100); repeat the flag or give ID:BIAS,ID:BIAS", offsetof(gen_cfg, logit_bias), KVF_CFG_STR},
    {"logprobs", "-1", "print each token's log-probability and the N most likely beside it in --json (0 to 20; -1: none)", offsetof(gen_cfg, logprobs), KVF_CFG_INT},
    {"prompt-logprobs", NULL, "print every prompt token's log-probability in --json (with --logprobs N's top N); the prompt then runs one token a step", offsetof(gen_cfg, prompt_logprobs), KVF_CFG_BOOL},
    {"ignore-eos", NULL, "keep generating past an end-of-sequence token", offsetof(gen_cfg, ignore_eos), KVF_CFG_BOOL},
    {"json-schema", NULL, "constrain the output to JSON valid under this JSON Schema (JSON text, or @FILE)", offsetof(gen_cfg, json_schema), KVF_CFG_STR},
    {"json-object", NULL, "constrain the output to a JSON object", offsetof(gen_cfg, json_object), KVF_CFG_BOOL},
    {"regex", NULL, "constrain the output to a match of this regular expression", offsetof(gen_cfg, regex), KVF_CFG_STR},
    {"choice", NULL, "constrain the output to one of these strings (a JSON list: [\"yes\",\"no\"])", offsetof(gen_cfg, choice), KVF_CFG_STR},
    {"block-size", "16", "tokens per KV block (a power of two)", offsetof(gen_cfg, block_size), KVF_CFG_INT},
    {"kv-dtype", "f32", "KV cache dtype: f32, f16, bf16 or fp8-e4m3", offsetof(gen_cfg, kv_dtype), KVF_CFG_STR},
    {"kv-k-scale", "1", "fp8-e4m3 KV: K is stored as fp8(K / scale)", offsetof(gen_cfg, kv_k_scale), KVF_CFG_DOUBLE},
    {"kv-v-scale", "1", "fp8-e4m3 KV: V is stored as fp8(V / scale)", offsetof(gen_cfg, kv_v_scale), KVF_CFG_DOUBLE},
    {"device", "cpu", "where the model runs: cpu or cuda (GPU 0)", offsetof(gen_cfg, device), KVF_CFG_STR},
    {"attn-decode", "auto", "cuda: the kernel decode tokens' attention runs on: auto (the build's default, simt today), simt, or mma (tensor cores; f16, bf16 or fp8 KV at head_dim 64 or 128, simt elsewhere)",
     offsetof(gen_cfg, attn_decode), KVF_CFG_STR},
    {"no-cuda-graphs", NULL, "cuda: run every decode step kernel by kernel (no CUDA graph replay)",
     offsetof(gen_cfg, no_graphs), KVF_CFG_BOOL},
    {"profile", NULL, "print where the forward steps' time went, by kind of op (stderr; steps run op by op, no CUDA graphs)",
     offsetof(gen_cfg, profile), KVF_CFG_BOOL},
    {"kv-memory", "0", "KV pool bytes (K/M/G suffixes); 0: just enough for this request", offsetof(gen_cfg, kv_memory), KVF_CFG_SIZE},
    {"prefill-chunk", "512", "prompt tokens per forward step", offsetof(gen_cfg, prefill_chunk), KVF_CFG_INT},
    {"threads", "0", "CPU threads (0: one per CPU)", offsetof(gen_cfg, threads), KVF_CFG_INT},
    {"half-weights", NULL, "keep F16/BF16 matrices as stored (half the memory) instead of converting to f32 at load",
     offsetof(gen_cfg, half_weights), KVF_CFG_BOOL},
    {"weight-dtype", "f32", "matrices at load: f32, or q8 (int8 blocks of 32 with a scale each, from any file dtype; about 3.5x less to read per token than f32; CPU only)",
     offsetof(gen_cfg, weight_dtype), KVF_CFG_STR},
    {"json", NULL, "print {\"prompt_ids\",\"output_ids\",\"finish_reason\"} as one JSON line (and \"logprobs\", \"prompt_logprobs\" when asked)", offsetof(gen_cfg, json), KVF_CFG_BOOL},
    {NULL},
};

static const kvf_cfg_spec gen_spec = {
    .prog = "kvfleet generate",
    .summary = "Generation for one prompt in this process, through the engine the workers run\n"
               "(CPU backend, or the GPU with --device cuda). Give the prompt as --prompt-ids 1,2,3\n"
               "or as --prompt TEXT.\n"
               "Text streams to the terminal as it is generated; --json prints one object at the end.",
    .opts = gen_opts,
};

/* The guide of --json-schema, --json-object, --regex or --choice (one at most) into s; *text_out
 * owns what s->guide points at (a @FILE's contents). */
static kvf_status pick_guide(const gen_cfg *c, kvf_engine_sampling *s, char **text_out, kvf_err *err)
{
    *text_out = NULL;
    int n = !!c->json_schema + !!c->json_object + !!c->regex + !!c->choice;
    if (n > 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "generate: give one of --json-schema, --json-object, --regex and --choice");
    const char *t = c->json_schema ? c->json_schema : c->regex ? c->regex : c->choice;
    s->guide_kind = c->json_schema ? KVF_TEXT_GUIDE_JSON_SCHEMA : c->regex ? KVF_TEXT_GUIDE_REGEX
                    : c->choice    ? KVF_TEXT_GUIDE_CHOICE
                    : c->json_object ? KVF_TEXT_GUIDE_JSON_OBJECT : KVF_TEXT_GUIDE_NONE;
    if (c->json_schema && c->json_schema[0] == '@') {
        kvf_sbuf sb;
        kvf_sbuf_init(&sb);
        kvf_status st = kvf_sbuf_read_file(&sb, c->json_schema + 1, err);
        if (st != KVF_OK) {
            kvf_sbuf_fini(&sb);
            return kvf_err_prefix(err, "generate: --json-schema=%s", c->json_schema);
        }
        s->guide_len = sb.len;
        s->guide = *text_out = kvf_sbuf_take(&sb);
        return *text_out ? KVF_OK : kvf_err_set(err, KVF_ERR_NOMEM, "generate: out of memory");
    }
    s->guide = t;
    s->guide_len = t ? strlen(t) : 0;
    return KVF_OK;
}

/* Adds the ID:BIAS pairs of one --logit-bias value (comma-separated) to s. */
static kvf_status parse_bias(const char *v, kvf_engine_sampling *s, kvf_err *err)
{
    const char *p = v;
    while (*p) {
        char *end;
        errno = 0;
        long id = strtol(p, &end, 10);
        if (end == p || *end != ':' || errno || id < 0 || id > INT32_MAX)
            return kvf_err_set(err, KVF_ERR_INVALID, "generate: --logit-bias=%s is not allowed (use ID:BIAS, e.g. 42:-100 or 42:5,7:1.5)", v);
        p = end + 1;
        double b = strtod(p, &end);
        if (end == p || (*end && *end != ',') || !(b >= -100 && b <= 100))
            return kvf_err_set(err, KVF_ERR_INVALID, "generate: --logit-bias=%s: the bias of %ld is not a number from -100 to 100", v, id);
        if (s->n_bias >= KVF_ENGINE_MAX_BIAS)
            return kvf_err_set(err, KVF_ERR_INVALID, "generate: more than %d --logit-bias entries", KVF_ENGINE_MAX_BIAS);
        s->bias[s->n_bias++] = (kvf_engine_bias){.id = (int32_t)id, .bias = (float)b};
        p = *end ? end + 1 : end;
    }
    return KVF_OK;
}

/* Every --logit-bias value of argv (the flag may repeat; the parsed config keeps the last one
 * only), or cfg_value (from the environment) when argv has none. */
static kvf_status collect_bias(int argc, char **argv, const char *cfg_value, kvf_engine_sampling *s,
                               kvf_err *err)
{
    bool any = false;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        if (strcmp(argv[i], "--") == 0)
            break;
        if (strcmp(argv[i], "--logit-bias") == 0 && i + 1 < argc)
            v = argv[++i];
        else if (strncmp(argv[i], "--logit-bias=", 13) == 0)
            v = argv[i] + 13;
        if (!v)
            continue;
        any = true;
        kvf_status st = parse_bias(v, s, err);
        if (st != KVF_OK)
            return st;
    }
    return !any && cfg_value ? parse_bias(cfg_value, s, err) : KVF_OK;
}

/* {"token": id, "logprob": x} (a NaN or -inf logprob is null: JSON has no such numbers). */
static json_t *lp_json(int32_t id, float lp)
{
    json_t *o = json_object();
    json_object_set_new(o, "token", json_integer(id));
    json_object_set_new(o, "logprob", isfinite(lp) ? json_real(lp) : json_null());
    return o;
}

/* One token's entry: its own logprob and the top list. */
static json_t *lp_entry(int32_t id, float lp, const kvf_engine_logprob *top, int32_t n_top)
{
    json_t *o = lp_json(id, lp), *t = json_array();
    for (int32_t j = 0; j < n_top; j++)
        json_array_append_new(t, lp_json(top[j].id, top[j].logprob));
    json_object_set_new(o, "top", t);
    return o;
}

/* --profile's table on stderr: per kind of step, each kind of op's share of the step. */
static void print_profile(const kvf_model_fwd_prof *p, const char *device)
{
    static const char *const kinds[2][2] = {{"decode step", "decode steps"},
                                            {"step with prefill chunks", "steps with prefill chunks"}};
    for (int k = 0; k < 2; k++) {
        if (p->steps[k] == 0)
            continue;
        const double n = (double)p->steps[k], step_ms = kvf_model_fwd_prof_ms(p, k);
        const bool gpu = strcmp(device, "cpu") != 0;
        fprintf(stderr,
                "kvfleet: profile of %lld %s on %s, op by op%s: %.3f ms a step in its ops (%s), "
                "%.3f ms from call to return (host clock)\n",
                (long long)p->steps[k], kinds[k][p->steps[k] != 1], device,
                gpu ? " (no CUDA graph replay while profiling)" : "", step_ms / n,
                gpu ? "the GPU's queue clock" : "host clock", p->wall_ms[k] / n);
        fprintf(stderr, "  %-14s %10s %10s %8s %10s\n", "op", "calls/step", "ms/step", "share",
                "us/call");
        for (int op = 0; op < KVF_FWD_OP_COUNT; op++) {
            if (p->op_calls[k][op] == 0)
                continue;
            fprintf(stderr, "  %-14s %10.1f %10.4f %7.1f%% %10.2f\n", kvf_fwd_op_name(op),
                    (double)p->op_calls[k][op] / n, p->op_ms[k][op] / n,
                    step_ms > 0 ? 100.0 * p->op_ms[k][op] / step_ms : 0.0,
                    1e3 * p->op_ms[k][op] / (double)p->op_calls[k][op]);
        }
    }
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
    if (kv_dt < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "generate: --kv-dtype=%s is not supported (use f32, f16, bf16 or fp8-e4m3)",
                                        c.kv_dtype), &err);
    if (!(c.kv_k_scale > 0 && c.kv_k_scale < 1e30) || !(c.kv_v_scale > 0 && c.kv_v_scale < 1e30))
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "generate: --kv-k-scale (%g) and --kv-v-scale (%g) must be positive and finite",
                                        c.kv_k_scale, c.kv_v_scale), &err);
    int weight_dtype = kvf_backend_weight_dtype_parse(c.weight_dtype);
    if (weight_dtype < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "generate: --weight-dtype=%s is not supported (use f32 or q8)",
                                        c.weight_dtype ? c.weight_dtype : ""), &err);
    int32_t attn_decode;
    if ((st = kvf_engine_attn_decode_pick(c.attn_decode, "generate", &attn_decode, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);
    const kvf_backend *be = NULL;
    if ((st = kvf_engine_backend_by_name(c.device, "generate", &be, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);

    if (c.temperature < 0 || c.top_p <= 0 || c.top_p > 1 || c.top_k < 0)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID,
                                        "generate: --temperature (%g) must be >= 0, --top-p (%g) in (0, 1], --top-k (%d) >= 0",
                                        c.temperature, c.top_p, c.top_k), &err);
    if (c.logprobs < -1 || c.logprobs > KVF_ENGINE_MAX_LOGPROBS)
        return kvf_cli_exit(kvf_err_set(&err, KVF_ERR_INVALID, "generate: --logprobs=%d is not allowed (0 to %d; -1: none)",
                                        c.logprobs, KVF_ENGINE_MAX_LOGPROBS), &err);
    /* (the other sampling values are checked by the engine, which names them) */

    kvf_model *m = NULL;
    kvf_text_tokenizer *tok = NULL;
    kvf_text_detok *detok = NULL;
    kvf_engine *eng = NULL;
    int32_t *prompt = NULL, *out = NULL, n_prompt = 0;
    json_t *lps = NULL, *plps = NULL; /* --json's "logprobs" and "prompt_logprobs" */
    char *guide_text = NULL;          /* --json-schema @FILE's contents */
    int rc = 1;

    if ((st = kvf_model_load(c.model, &m, &err)) != KVF_OK)
        goto fail;
    /* the tokenizer: needed for --prompt, used for showing text when present */
    char tpath[4096];
    struct stat sb;
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", c.model);
    if (c.prompt || stat(tpath, &sb) == 0) {
        kvf_err terr = {0};
        st = kvf_text_tokenizer_load(c.model, &tok, &terr);
        if (st != KVF_OK && c.prompt) {
            err = terr;
            goto fail;
        }
        if (st != KVF_OK)
            kvf_log(KVF_LOG_WARN, "generate: tokenizer not used: %s", terr.msg);
    }
    if (c.prompt) {
        size_t n;
        if ((st = kvf_text_tokenizer_encode(tok, c.prompt, strlen(c.prompt), true, &prompt, &n, &err)) != KVF_OK)
            goto fail;
        n_prompt = (int32_t)n;
        if (n_prompt == 0) {
            st = kvf_err_set(&err, KVF_ERR_INVALID, "generate: --prompt encodes to no tokens");
            goto fail;
        }
    } else {
        size_t n;
        if ((st = kvf_cli_parse_ids("generate: --prompt-ids", c.prompt_ids, &prompt, &n, &err)) != KVF_OK)
            goto fail;
        n_prompt = (int32_t)n;
        if (n_prompt == 0) {
            st = kvf_err_set(&err, KVF_ERR_INVALID, "generate: --prompt-ids gives no token ids (use e.g. 1,2,3)");
            goto fail;
        }
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

    /* the KV pool: just enough for this request unless --kv-memory says more */
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
    kvf_engine_cfg ec;
    kvf_engine_cfg_default(&ec);
    ec.n_blocks = (int32_t)(n_blocks < INT32_MAX ? n_blocks : INT32_MAX);
    ec.block_size = c.block_size;
    ec.kv_dtype = (kvf_dtype)kv_dt;
    ec.max_batch_tokens = c.prefill_chunk;
    ec.max_seqs = 1;
    ec.max_queued = 1;
    ec.max_ctx = (int32_t)context;
    ec.swap_slots = 0;
    ec.threads = c.threads;
    ec.half_weights = c.half_weights;
    ec.weight_dtype = weight_dtype;
    ec.kv_k_scale = (float)c.kv_k_scale;
    ec.kv_v_scale = (float)c.kv_v_scale;
    ec.no_graphs = c.no_graphs;
    ec.attn_decode = attn_decode;
    ec.model_id = c.model;
    if (c.json_schema || c.json_object || c.regex || c.choice)
        ec.tokenizer_dir = c.model; /* the guide masks its tokens */
    if ((st = kvf_engine_create(m, be, &ec, &eng, &err)) != KVF_OK)
        goto fail;
    kvf_model_fwd_prof prof = {0};
    if (c.profile && (st = kvf_engine_set_prof(eng, &prof, &err)) != KVF_OK)
        goto fail;
    kvf_engine_request req = {.id = 1, .prompt = prompt, .n_prompt = n_prompt};
    kvf_engine_sampling_default(&req.sampling);
    req.sampling.max_tokens = c.max_tokens;
    req.sampling.temperature = (float)c.temperature;
    req.sampling.top_p = (float)c.top_p;
    req.sampling.top_k = c.top_k;
    req.sampling.seed = (uint64_t)c.seed;
    req.sampling.presence_penalty = (float)c.presence_penalty;
    req.sampling.frequency_penalty = (float)c.frequency_penalty;
    req.sampling.repetition_penalty = (float)c.repetition_penalty;
    req.sampling.min_p = (float)c.min_p;
    req.sampling.min_tokens = c.min_tokens;
    req.sampling.logprobs = c.logprobs >= 0;
    req.sampling.top_logprobs = c.logprobs > 0 ? c.logprobs : 0;
    req.sampling.prompt_logprobs = c.prompt_logprobs;
    if ((st = collect_bias(argc, argv, c.logit_bias, &req.sampling, &err)) != KVF_OK ||
        (st = pick_guide(&c, &req.sampling, &guide_text, &err)) != KVF_OK)
        goto fail;
    if (req.sampling.logprobs)
        lps = json_array();
    if (c.prompt_logprobs) {
        plps = json_array();
        json_array_append_new(plps, json_null()); /* the first prompt token has none */
    }
    if (!c.ignore_eos) {
        kvf_engine_sampling_model_eos(&req.sampling, m);
        size_t n_tok_eos = 0;
        const int32_t *tok_eos = tok ? kvf_text_tokenizer_eos_ids(tok, &n_tok_eos) : NULL;
        for (size_t i = 0; i < n_tok_eos && req.sampling.n_eos < KVF_ENGINE_MAX_STOP; i++) {
            bool known = false;
            for (int32_t k = 0; k < req.sampling.n_eos; k++)
                known |= req.sampling.eos_ids[k] == tok_eos[i];
            if (!known)
                req.sampling.eos_ids[req.sampling.n_eos++] = tok_eos[i];
        }
    }
    if ((st = kvf_engine_add(eng, &req, &err)) != KVF_OK)
        goto fail;
    out = calloc((size_t)c.max_tokens, sizeof *out);
    if (!out) {
        st = kvf_err_set(&err, KVF_ERR_NOMEM, "generate: out of memory");
        goto fail;
    }
    /* Text streams to the terminal as tokens arrive (never half a character). */
    bool stream_text = !c.json && tok;
    if (stream_text && (st = kvf_text_detok_create(tok, true, &detok, &err)) != KVF_OK)
        goto fail;
    kvf_sbuf piece;
    kvf_sbuf_init(&piece);
    double t0 = kvf_now_s(), t_first = 0;
    int32_t n_out = 0;
    const char *finish = "length";
    bool done = false;
    while (!done && st == KVF_OK) {
        const kvf_engine_output *o;
        int32_t n_o;
        if ((st = kvf_engine_step(eng, &o, &n_o, &err)) != KVF_OK)
            break;
        for (int32_t i = 0; i < n_o; i++) {
            if (plps && o[i].prompt_lps) {
                int32_t w = 1 + req.sampling.top_logprobs;
                for (int32_t r = 0; r < o[i].n_prompt_lps; r++) {
                    const kvf_engine_logprob *row = o[i].prompt_lps + (size_t)r * (size_t)w;
                    int32_t n_top = 0;
                    while (n_top < w - 1 && row[1 + n_top].id >= 0)
                        n_top++;
                    json_array_append_new(plps, lp_entry(row[0].id, row[0].logprob, row + 1, n_top));
                }
            }
            if (o[i].token >= 0 && n_out < c.max_tokens) {
                if (n_out == 0)
                    t_first = kvf_now_s();
                if (lps)
                    json_array_append_new(lps, lp_entry(o[i].token, o[i].logprob, o[i].top, o[i].n_top));
                out[n_out++] = o[i].token;
                if (detok) {
                    kvf_sbuf_reset(&piece);
                    if (kvf_text_detok_feed(detok, &o[i].token, 1, &piece, &err) == KVF_OK && piece.len) {
                        fwrite(piece.data, 1, piece.len, stdout);
                        fflush(stdout);
                    }
                }
            }
            if (o[i].finish != KVF_ENGINE_FINISH_NONE) {
                finish = kvf_engine_finish_name(o[i].finish);
                done = true;
                if (o[i].finish == KVF_ENGINE_FINISH_ERROR)
                    st = kvf_err_set(&err, KVF_ERR_INTERNAL, "generate: the engine failed this request (see the log)");
            }
        }
        if (!done && !kvf_engine_busy(eng))
            done = true;
    }
    if (detok && st == KVF_OK) {
        kvf_sbuf_reset(&piece);
        if (kvf_text_detok_finish(detok, &piece, &err) == KVF_OK && piece.len)
            fwrite(piece.data, 1, piece.len, stdout);
        printf("\n");
    }
    kvf_sbuf_fini(&piece);
    double t_end = kvf_now_s();
    if (st != KVF_OK)
        goto fail;
    if (t_first == 0)
        t_first = t_end;
    fprintf(stderr, "kvfleet: prefill %d tokens in %.1f ms (%.1f tokens/s); decode %d tokens in %.1f ms (%.1f tokens/s); finish %s\n",
            n_prompt, (t_first - t0) * 1e3, n_prompt / (t_first - t0 > 0 ? t_first - t0 : 1e-9), n_out > 0 ? n_out - 1 : 0,
            (t_end - t_first) * 1e3, (n_out > 1 ? n_out - 1 : 0) / (t_end - t_first > 0 ? t_end - t_first : 1e-9), finish);

    if (c.profile)
        print_profile(&prof, c.device);

    char *text = NULL;
    if (c.json && tok && kvf_text_tokenizer_decode(tok, out, (size_t)n_out, true, &text, NULL, &err) != KVF_OK) {
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
        if (lps) {
            json_object_set_new(j, "logprobs", lps);
            lps = NULL;
        }
        if (plps) {
            json_object_set_new(j, "prompt_logprobs", plps);
            plps = NULL;
        }
        if (text)
            json_object_set_new(j, "text", json_string(text));
        char *s = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(j);
    } else if (detok) {
        /* already streamed */
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
    json_decref(lps);
    json_decref(plps);
    kvf_text_detok_destroy(detok);
    kvf_engine_destroy(eng);
    kvf_text_tokenizer_destroy(tok);
    kvf_model_destroy(m);
    free(prompt);
    free(out);
    free(guide_text);
    return rc;
}
