/* grammar.c: `kvfleet bench grammar`: what constrained decoding (text/grammar.h, issue 24) costs
 * on the CPU: JSON Schema compile time (a generated schema of N properties, the goal being
 * <= 50 ms for 50, and a few others), and the token mask per step over a real vocabulary (Qwen3's
 * ~151k tokens by default) along a document: uncached (a fresh grammar, each state's mask computed
 * on first visit) and cached (the same walk again), next to the cost of accepting the token.
 * Then the engine's side: constrained vs unconstrained decode throughput at batch 1 and 8 on a
 * random-weight model of a gen-model preset speaking that tokenizer (goal: >= 0.9x at batch 8). */
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/cfg.h"
#include "common/progress.h"
#include "common/sbuf.h"
#include "common/time.h"
#include "engine/engine.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/weights.h"
#include "text/grammar.h"
#include "text/guide.h"
#include "text/tokenizer.h"

#include <sys/stat.h>

typedef struct grammar_bench_cfg {
    const char *tokenizer, *preset;
    int32_t properties, decode_tokens, threads, rounds;
    double seconds;
} grammar_bench_cfg;

static const kvf_cfg_opt grammar_bench_opts[] = {
    {"tokenizer", "../shared/fixtures/tokenizers/qwen3", "tokenizer directory (or tokenizer.json) whose vocabulary the masks cover", offsetof(grammar_bench_cfg, tokenizer), KVF_CFG_STR},
    {"properties", "50", "properties of the generated schema (1 to 2000)", offsetof(grammar_bench_cfg, properties), KVF_CFG_INT},
    {"seconds", "0.5", "minimum seconds per compile measurement", offsetof(grammar_bench_cfg, seconds), KVF_CFG_DOUBLE},
    {"preset", "small", "gen-model preset of the decode comparison's random-weight model (with the tokenizer's vocabulary); none: skip it", offsetof(grammar_bench_cfg, preset), KVF_CFG_STR},
    {"decode-tokens", "64", "new tokens per sequence in the decode comparison", offsetof(grammar_bench_cfg, decode_tokens), KVF_CFG_INT},
    {"threads", "0", "CPU threads of the decode comparison (0: one per CPU)", offsetof(grammar_bench_cfg, threads), KVF_CFG_INT},
    {"rounds", "3", "alternating rounds per batch size in the decode comparison (medians)", offsetof(grammar_bench_cfg, rounds), KVF_CFG_INT},
    {NULL},
};

static const kvf_cfg_spec grammar_bench_spec = {
    .prog = "kvfleet bench grammar",
    .summary = "Constrained decoding's CPU costs: JSON Schema compile milliseconds (a generated\n"
               "schema of --properties properties, goal <= 50 ms for 50, and a few others), then\n"
               "the token mask per step over the tokenizer's vocabulary along a document of each\n"
               "schema: uncached (a fresh grammar: each automaton state computed on first visit)\n"
               "and cached (the same walk again), and accepting the token. Then decode throughput\n"
               "with and without a JSON Schema guide at batch 1 and 8 on a random-weight model\n"
               "(--preset), alternating rounds, medians. Ends with a summary line:\n"
               "compile_ms=<x> mask_uncached_us=<y> mask_cached_us=<z> decode_ratio_b1=<r>\n"
               "decode_ratio_b8=<r>.",
    .opts = grammar_bench_opts,
};

/* ---- growable text ---- */

typedef struct gb_text {
    char *p;
    size_t n, cap;
} gb_text;

static void tx_add(gb_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tx_add(gb_text *t, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(t->p ? t->p + t->n : NULL, t->p ? t->cap - t->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0)
            return;
        if (t->p && t->n + (size_t)k < t->cap) {
            t->n += (size_t)k;
            return;
        }
        size_t cap = (t->cap + (size_t)k + 64) * 2;
        char *p = realloc(t->p, cap);
        if (!p)
            abort(); /* a benchmark's own few kilobytes */
        t->p = p, t->cap = cap;
    }
}

/* A schema of n properties of the kinds API schemas have (strings with bounds, integers in
 * ranges, enums, numbers, booleans, arrays, a nested object, a format), every other one
 * required, and a document under it that a model could have written. */
static void gen_schema(int n, gb_text *schema, gb_text *doc)
{
    tx_add(schema, "{\"type\":\"object\",\"properties\":{");
    tx_add(doc, "{");
    for (int i = 0; i < n; i++) {
        const char *sep = i ? "," : "";
        switch (i % 8) {
        case 0:
            tx_add(schema, "%s\"name_%d\":{\"type\":\"string\",\"maxLength\":40}", sep, i);
            tx_add(doc, "%s\"name_%d\": \"Ada Lovelace\"", sep, i);
            break;
        case 1:
            tx_add(schema, "%s\"count_%d\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":100000}",
                   sep, i);
            tx_add(doc, "%s\"count_%d\": 4217", sep, i);
            break;
        case 2:
            tx_add(schema, "%s\"status_%d\":{\"enum\":[\"open\",\"closed\",\"pending\",\"failed\"]}",
                   sep, i);
            tx_add(doc, "%s\"status_%d\": \"pending\"", sep, i);
            break;
        case 3:
            tx_add(schema, "%s\"score_%d\":{\"type\":\"number\"}", sep, i);
            tx_add(doc, "%s\"score_%d\": 0.875", sep, i);
            break;
        case 4:
            tx_add(schema, "%s\"flag_%d\":{\"type\":\"boolean\"}", sep, i);
            tx_add(doc, "%s\"flag_%d\": true", sep, i);
            break;
        case 5:
            tx_add(schema, "%s\"tags_%d\":{\"type\":\"array\",\"items\":{\"type\":\"string\","
                           "\"maxLength\":16},\"maxItems\":5}", sep, i);
            tx_add(doc, "%s\"tags_%d\": [\"red\", \"blue\"]", sep, i);
            break;
        case 6:
            tx_add(schema, "%s\"where_%d\":{\"type\":\"object\",\"properties\":{\"lat\":{\"type\":"
                           "\"number\"},\"lon\":{\"type\":\"number\"}},\"required\":[\"lat\",\"lon\"]}",
                   sep, i);
            tx_add(doc, "%s\"where_%d\": {\"lat\": 52.52, \"lon\": 13.405}", sep, i);
            break;
        default:
            tx_add(schema, "%s\"when_%d\":{\"type\":[\"string\",\"null\"],\"format\":\"date\"}", sep,
                   i);
            tx_add(doc, "%s\"when_%d\": \"2026-11-29\"", sep, i);
            break;
        }
    }
    tx_add(schema, "},\"required\":[");
    for (int i = 0, k = 0; i < n; i += 2, k++) {
        static const char *const kinds[8] = {"name", "count", "status", "score",
                                             "flag", "tags",  "where",  "when"};
        tx_add(schema, "%s\"%s_%d\"", k ? "," : "", kinds[i % 8], i);
    }
    tx_add(schema, "],\"additionalProperties\":false}");
    tx_add(doc, "}");
}

typedef struct bench_schema {
    const char *name;
    char *schema; /* NULL: json_object */
    char *doc;
} bench_schema;

static const char tree_schema[] =
    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
    "\"size\":{\"type\":\"integer\",\"minimum\":0},\"children\":{\"type\":\"array\",\"items\":"
    "{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"name\"]}},\"$ref\":\"#/$defs/node\"}";
static const char tree_doc[] =
    "{\"name\": \"root\", \"size\": 3, \"children\": [{\"name\": \"src\", \"children\": "
    "[{\"name\": \"main.c\", \"size\": 1024}]}, {\"name\": \"README.md\", \"size\": 88}]}";
static const char tool_schema[] =
    "{\"type\":\"object\",\"properties\":{\"location\":{\"type\":\"string\",\"pattern\":"
    "\"^[A-Z][a-z]+(?:, [A-Z]{2})?$\"},\"unit\":{\"enum\":[\"celsius\",\"fahrenheit\"]},"
    "\"when\":{\"type\":\"string\",\"format\":\"date-time\"},\"id\":{\"type\":\"string\","
    "\"format\":\"uuid\"}},\"required\":[\"location\",\"unit\"]}";
static const char tool_doc[] =
    "{\"location\": \"Paris, FR\", \"unit\": \"celsius\", \"when\": \"2026-11-29T08:00:00Z\", "
    "\"id\": \"123e4567-e89b-12d3-a456-426614174000\"}";
static const char object_doc[] =
    "{\"answer\": \"The KV cache holds keys and values.\", \"confidence\": 0.93, "
    "\"sources\": [\"DESIGN.md\", {\"page\": 4}]}";

static kvf_status compile(const bench_schema *s, kvf_text_grammar **g, kvf_err *err)
{
    return s->schema ? kvf_text_grammar_schema(s->schema, strlen(s->schema), g, err)
                     : kvf_text_grammar_json_object(g, err);
}

/* Median-free mean milliseconds per compile over at least `seconds` (and 3 runs). */
static double compile_ms(const bench_schema *s, double seconds, kvf_err *err)
{
    int64_t n = 0, t0 = kvf_now_ns(), t;
    do {
        kvf_text_grammar *g = NULL;
        if (compile(s, &g, err) != KVF_OK)
            return -1;
        kvf_text_grammar_destroy(g);
        n++;
        t = kvf_now_ns();
    } while ((double)(t - t0) < seconds * 1e9 || n < 3);
    return (double)(t - t0) / 1e6 / (double)n;
}

typedef struct walk_stats {
    double mask_us, mask_max_us, accept_us;
    size_t tokens;
} walk_stats;

/* Mask then accept each token of ids, then the end id; per-token means. */
static kvf_status walk_doc(kvf_text_matcher *m, const int32_t *ids, size_t n, int32_t end,
                           uint32_t *mask, walk_stats *ws, kvf_err *err)
{
    memset(ws, 0, sizeof *ws);
    for (size_t i = 0; i <= n; i++) {
        int32_t id = i < n ? ids[i] : end;
        int64_t t0 = kvf_now_ns();
        kvf_status st = kvf_text_matcher_mask(m, mask, err);
        int64_t t1 = kvf_now_ns();
        if (st != KVF_OK)
            return st;
        if (!(mask[id / 32] >> (id % 32) & 1))
            return kvf_err_set(err, KVF_ERR_INVALID, "token %zu (id %d) is not in the mask", i, id);
        st = kvf_text_matcher_accept(m, id, err);
        int64_t t2 = kvf_now_ns();
        if (st != KVF_OK)
            return st;
        double us = (double)(t1 - t0) / 1e3;
        ws->mask_us += us;
        if (us > ws->mask_max_us)
            ws->mask_max_us = us;
        ws->accept_us += (double)(t2 - t1) / 1e3;
    }
    ws->tokens = n + 1;
    ws->mask_us /= (double)ws->tokens;
    ws->accept_us /= (double)ws->tokens;
    return KVF_OK;
}

/* ---- the engine: constrained vs unconstrained decode ---- */

/* The guide of the decode comparison: an object holding a list of strings, which a random model
 * keeps writing for many tokens (most steps inside a string: the cached state of real use). */
static const char decode_schema[] =
    "{\"type\":\"object\",\"properties\":{\"notes\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}},"
    "\"required\":[\"notes\"],\"additionalProperties\":false}";

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* B sequences of a 3-token prompt, sampled (temperature 1), up to D new tokens each, guided or
 * not, run to the end: new tokens per second over the whole run. */
static kvf_status decode_run(kvf_engine *e, int32_t B, int32_t D, bool guided, uint64_t *next_id,
                             double *tok_s, kvf_err *err)
{
    static const int32_t prompt[3] = {5, 17, 33};
    for (int32_t b = 0; b < B; b++) {
        kvf_engine_request q = {.id = (*next_id)++, .prompt = prompt, .n_prompt = 3};
        kvf_engine_sampling_default(&q.sampling);
        q.sampling.max_tokens = D;
        q.sampling.temperature = 1.0f;
        q.sampling.seed = q.id;
        if (guided) {
            q.sampling.guide_kind = KVF_TEXT_GUIDE_JSON_SCHEMA;
            q.sampling.guide = decode_schema;
            q.sampling.guide_len = sizeof decode_schema - 1;
        }
        kvf_status st = kvf_engine_add(e, &q, err);
        if (st != KVF_OK)
            return st;
    }
    int64_t tokens = 0;
    double t0 = kvf_now_s();
    while (kvf_engine_busy(e)) {
        const kvf_engine_output *o;
        int32_t n;
        kvf_status st = kvf_engine_step(e, &o, &n, err);
        if (st != KVF_OK)
            return st;
        for (int32_t i = 0; i < n; i++)
            tokens += o[i].token >= 0;
    }
    *tok_s = (double)tokens / (kvf_now_s() - t0);
    return KVF_OK;
}

/* A random-weight model of the preset with the tokenizer's vocabulary, written to dir with the
 * tokenizer files beside it. */
static kvf_status decode_model(const grammar_bench_cfg *c, const char *dir, int32_t vocab,
                               kvf_err *err)
{
    kvf_model_config mc;
    kvf_status st = kvf_model_preset(c->preset, vocab, &mc, err);
    if (st != KVF_OK)
        return st;
    char path[1200], src[1200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if ((st = kvf_model_config_write(path, &mc, KVF_DTYPE_F32, err)) != KVF_OK)
        return st;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if ((st = kvf_model_weights_write_random(path, &mc, KVF_DTYPE_F32, 1234, err)) != KVF_OK)
        return st;
    struct stat sb;
    bool is_dir = stat(c->tokenizer, &sb) == 0 && S_ISDIR(sb.st_mode);
    const char *names[2] = {"tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < (is_dir ? 2 : 1); i++) {
        if (is_dir)
            snprintf(src, sizeof src, "%s/%s", c->tokenizer, names[i]);
        else
            snprintf(src, sizeof src, "%s", c->tokenizer);
        kvf_sbuf text;
        kvf_sbuf_init(&text);
        if ((st = kvf_sbuf_read_file(&text, src, err)) != KVF_OK) {
            kvf_sbuf_fini(&text);
            if (i == 0)
                return kvf_err_prefix(err, "bench grammar: the tokenizer");
            continue; /* tokenizer_config.json is optional */
        }
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        FILE *out = fopen(path, "wb");
        bool ok = out && fwrite(text.data, 1, text.len, out) == text.len;
        if (out && fclose(out) != 0)
            ok = false;
        kvf_sbuf_fini(&text);
        if (!ok)
            return kvf_err_set(err, KVF_ERR_IO, "bench grammar: cannot write %s", path);
    }
    return KVF_OK;
}

/* Decode throughput with and without the guide, batch 1 and 8, alternating rounds; the medians'
 * ratios into ratio_out[2] (0 when not measured). */
static void decode_section(const grammar_bench_cfg *c, int32_t vocab, double *ratio_out)
{
    ratio_out[0] = ratio_out[1] = 0;
    if (strcmp(c->preset, "none") == 0) {
        printf("\nconstrained vs unconstrained decode: skipped (--preset none)\n");
        return;
    }
    char dir[] = "/tmp/kvf-bench-grammar-XXXXXX";
    kvf_err err = {0};
    kvf_model *m = NULL;
    kvf_engine *e = NULL;
    if (!mkdtemp(dir)) {
        printf("\nconstrained vs unconstrained decode: skipped: no temporary directory\n");
        return;
    }
    printf("\nconstrained vs unconstrained decode: preset %s, %d new tokens a sequence, "
           "temperature 1, guide %s\n", c->preset, c->decode_tokens, decode_schema);
    kvf_status st = decode_model(c, dir, vocab, &err);
    kvf_engine_cfg ec;
    kvf_engine_cfg_default(&ec);
    ec.n_blocks = 8 * ((3 + c->decode_tokens) / 16 + 2);
    ec.max_seqs = 8;
    ec.max_queued = 16;
    ec.max_batch_tokens = 64;
    ec.threads = c->threads;
    ec.tokenizer_dir = dir;
    if (st == KVF_OK)
        st = kvf_model_load(dir, &m, &err);
    if (st == KVF_OK)
        st = kvf_engine_create(m, kvf_model_backend_cpu(), &ec, &e, &err);
    uint64_t next_id = 1;
    double warm;
    if (st == KVF_OK) /* compiles the guide and visits its states once, as a server would have */
        st = decode_run(e, 8, c->decode_tokens, true, &next_id, &warm, &err);
    const int32_t batches[2] = {1, 8};
    int rounds = c->rounds > 0 && c->rounds <= 15 ? c->rounds : 3;
    kvf_progress prog;
    kvf_progress_init(&prog, "bench grammar: decode", 2 * 2 * rounds);
    int64_t done = 0;
    if (st == KVF_OK)
        printf("\n%-6s %16s %16s %8s\n", "batch", "plain tok/s", "guided tok/s", "ratio");
    for (int bi = 0; bi < 2 && st == KVF_OK; bi++) {
        double plain[15], guided[15];
        for (int r = 0; r < rounds && st == KVF_OK; r++) {
            st = decode_run(e, batches[bi], c->decode_tokens, false, &next_id, &plain[r], &err);
            kvf_progress_update(&prog, ++done);
            if (st == KVF_OK)
                st = decode_run(e, batches[bi], c->decode_tokens, true, &next_id, &guided[r], &err);
            kvf_progress_update(&prog, ++done);
        }
        if (st != KVF_OK)
            break;
        qsort(plain, (size_t)rounds, sizeof *plain, cmp_double);
        qsort(guided, (size_t)rounds, sizeof *guided, cmp_double);
        double p = plain[rounds / 2], g = guided[rounds / 2];
        ratio_out[bi] = p > 0 ? g / p : 0;
        kvf_progress_finish(&prog);
        printf("%-6d %16.1f %16.1f %7.2fx%s\n", batches[bi], p, g, ratio_out[bi],
               batches[bi] == 8 ? (ratio_out[bi] >= 0.9 ? "  (goal >= 0.9: met)" : "  (goal >= 0.9: MISSED)") : "");
    }
    kvf_progress_finish(&prog);
    if (st != KVF_OK)
        printf("constrained vs unconstrained decode: failed: %s\n", err.msg);
    kvf_engine_destroy(e);
    kvf_model_destroy(m);
    const char *names[4] = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"};
    char path[1200];
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
}

int kvf_bench_grammar_main(int argc, char **argv)
{
    grammar_bench_cfg c = {0};
    kvf_err err = {0};
    int n_pos = 0;
    kvf_status st = kvf_cfg_parse(&grammar_bench_spec, &c, argc, argv, &n_pos, &err);
    if (st == KVF_HELP)
        return 0;
    if (st != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    if (c.properties < 1 || c.properties > 2000 || !(c.seconds > 0)) {
        fprintf(stderr, "kvfleet: bench grammar: --properties=%d --seconds=%g: properties 1 to "
                "2000, seconds above 0\n", c.properties, c.seconds);
        return 2;
    }
    gb_text big = {0}, big_doc = {0}, ten = {0}, ten_doc = {0};
    gen_schema(c.properties, &big, &big_doc);
    gen_schema(10, &ten, &ten_doc);
    char big_name[48];
    snprintf(big_name, sizeof big_name, "%d properties", c.properties);
    bench_schema schemas[] = {
        {big_name, big.p, big_doc.p},
        {"10 properties", ten.p, ten_doc.p},
        {"tree ($ref)", (char *)tree_schema, (char *)tree_doc},
        {"tool (pattern, formats)", (char *)tool_schema, (char *)tool_doc},
        {"json_object", NULL, (char *)object_doc},
    };
    size_t n_schemas = sizeof schemas / sizeof schemas[0];
    int rc = 0;

    /* 1. compile times (no vocabulary needed) */
    printf("kvfleet bench grammar: constrained decoding on the CPU, one thread\n\n");
    printf("%-26s %10s %12s\n", "schema", "bytes", "compile ms");
    kvf_progress prog;
    kvf_progress_init(&prog, "bench grammar: compile", (int64_t)n_schemas);
    double big_ms = 0;
    for (size_t i = 0; i < n_schemas; i++) {
        double ms = compile_ms(&schemas[i], c.seconds, &err);
        kvf_progress_update(&prog, (int64_t)i + 1);
        if (ms < 0) {
            kvf_progress_finish(&prog);
            fprintf(stderr, "kvfleet: bench grammar: %s: %s\n", schemas[i].name, err.msg);
            rc = 1;
            goto out;
        }
        if (i == 0)
            big_ms = ms;
        printf("%-26s %10zu %12.2f%s\n", schemas[i].name,
               schemas[i].schema ? strlen(schemas[i].schema) : 0, ms,
               i == 0 && c.properties == 50 ? (ms <= 50 ? "  (goal <= 50: met)"
                                                        : "  (goal <= 50: MISSED)")
                                            : "");
    }
    kvf_progress_finish(&prog);

    /* 2. masks along each document over the vocabulary */
    kvf_text_tokenizer *tok = NULL;
    kvf_text_vocab *vocab = NULL;
    double t0 = kvf_now_s();
    if (kvf_text_tokenizer_load(c.tokenizer, &tok, &err) != KVF_OK) {
        printf("\nmasks: skipped: --tokenizer=%s: %s\n", c.tokenizer, err.msg);
        printf("\ncompile_ms=%.2f (%d properties) mask_uncached_us=n/a mask_cached_us=n/a\n",
               big_ms, c.properties);
        goto out;
    }
    double t1 = kvf_now_s();
    if (kvf_text_vocab_create(tok, kvf_text_tokenizer_vocab_size(tok), &vocab, &err) != KVF_OK) {
        fprintf(stderr, "kvfleet: bench grammar: vocabulary: %s\n", err.msg);
        kvf_text_tokenizer_destroy(tok);
        rc = 1;
        goto out;
    }
    double t2 = kvf_now_s();
    size_t n_eos = 0;
    const int32_t *eos = kvf_text_tokenizer_eos_ids(tok, &n_eos);
    int32_t end = n_eos ? eos[0] : 0;
    printf("\nvocabulary: %s, %d ids (tokenizer load %.0f ms, vocabulary trie %.0f ms)\n\n",
           c.tokenizer, kvf_text_vocab_size(vocab), (t1 - t0) * 1e3, (t2 - t1) * 1e3);
    printf("%-26s %7s %14s %14s %12s %12s %10s\n", "schema", "tokens", "uncached us/tok",
           "uncached max", "cached us/tok", "accept us/tok", "speedup");
    uint32_t *mask = calloc(kvf_text_vocab_mask_words(vocab), sizeof *mask);
    kvf_progress_init(&prog, "bench grammar: masks", (int64_t)n_schemas);
    double big_unc = 0, big_cached = 0;
    for (size_t i = 0; i < n_schemas && mask; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        kvf_text_grammar *g = NULL;
        kvf_text_matcher *m = NULL;
        walk_stats unc, cached;
        st = kvf_text_tokenizer_encode(tok, schemas[i].doc, strlen(schemas[i].doc), false, &ids,
                                       &n, &err);
        if (st == KVF_OK)
            st = compile(&schemas[i], &g, &err);
        if (st == KVF_OK)
            st = kvf_text_matcher_create(g, vocab, &end, 1, &m, &err);
        if (st == KVF_OK) /* a fresh grammar: every state's first visit computes its mask */
            st = walk_doc(m, ids, n, end, mask, &unc, &err);
        if (st == KVF_OK) {
            kvf_text_matcher_reset(m);
            st = walk_doc(m, ids, n, end, mask, &cached, &err);
        }
        kvf_text_matcher_destroy(m);
        kvf_text_grammar_destroy(g);
        free(ids);
        kvf_progress_update(&prog, (int64_t)i + 1);
        if (st != KVF_OK) {
            kvf_progress_finish(&prog);
            fprintf(stderr, "kvfleet: bench grammar: %s: %s\n", schemas[i].name, err.msg);
            rc = 1;
            break;
        }
        if (i == 0)
            big_unc = unc.mask_us, big_cached = cached.mask_us;
        printf("%-26s %7zu %14.1f %14.1f %12.2f %12.2f %9.0fx\n", schemas[i].name, unc.tokens,
               unc.mask_us, unc.mask_max_us, cached.mask_us, cached.accept_us,
               cached.mask_us > 0 ? unc.mask_us / cached.mask_us : 0);
    }
    kvf_progress_finish(&prog);
    free(mask);
    int32_t n_vocab = kvf_text_vocab_size(vocab);
    kvf_text_vocab_destroy(vocab);
    kvf_text_tokenizer_destroy(tok);
    if (rc == 0) {
        double ratio[2];
        decode_section(&c, n_vocab, ratio);
        printf("\ncompile_ms=%.2f (%d properties%s) mask_uncached_us=%.1f mask_cached_us=%.2f "
               "(per token along its document, %s) decode_ratio_b1=%.2f decode_ratio_b8=%.2f%s\n",
               big_ms, c.properties, c.properties == 50 ? ", goal <= 50" : "", big_unc, big_cached,
               schemas[0].name, ratio[0], ratio[1], ratio[1] > 0 ? " (goal >= 0.9)" : "");
    }
out:
    free(big.p);
    free(big_doc.p);
    free(ten.p);
    free(ten_doc.p);
    return rc;
}
