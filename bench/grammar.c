/* grammar.c: `kvfleet bench grammar`: what constrained decoding (text/grammar.h, issue 24) costs
 * on the CPU: JSON Schema compile time (a generated schema of N properties, the goal being
 * <= 50 ms for 50, and a few others), and the token mask per step over a real vocabulary (Qwen3's
 * ~151k tokens by default) along a document: uncached (a fresh grammar, each state's mask computed
 * on first visit) and cached (the same walk again), next to the cost of accepting the token.
 * Constrained vs unconstrained decode throughput (the engine's part) is left to its own section
 * below, to be filled when the engine applies masks. */
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
#include "common/time.h"
#include "text/grammar.h"
#include "text/tokenizer.h"

typedef struct grammar_bench_cfg {
    const char *tokenizer;
    int32_t properties;
    double seconds;
} grammar_bench_cfg;

static const kvf_cfg_opt grammar_bench_opts[] = {
    {"tokenizer", "../shared/fixtures/tokenizers/qwen3", "tokenizer directory (or tokenizer.json) whose vocabulary the masks cover", offsetof(grammar_bench_cfg, tokenizer), KVF_CFG_STR},
    {"properties", "50", "properties of the generated schema (1 to 2000)", offsetof(grammar_bench_cfg, properties), KVF_CFG_INT},
    {"seconds", "0.5", "minimum seconds per compile measurement", offsetof(grammar_bench_cfg, seconds), KVF_CFG_DOUBLE},
    {NULL},
};

static const kvf_cfg_spec grammar_bench_spec = {
    .prog = "kvfleet bench grammar",
    .summary = "Constrained decoding's CPU costs: JSON Schema compile milliseconds (a generated\n"
               "schema of --properties properties, goal <= 50 ms for 50, and a few others), then\n"
               "the token mask per step over the tokenizer's vocabulary along a document of each\n"
               "schema: uncached (a fresh grammar: each automaton state computed on first visit)\n"
               "and cached (the same walk again), and accepting the token. Ends with a summary\n"
               "line: compile_ms=<x> mask_uncached_us=<y> mask_cached_us=<z>.",
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

/* ---- constrained vs unconstrained decode throughput ----
 * The engine's side (batch 1 and 8, goal >= 0.9x at batch 8) belongs here once the engine applies
 * masks: load a model, decode the same prompts with and without a grammar, print both rates and
 * their ratio. Until then the section prints that it is not measured. */
static void decode_section(void)
{
    printf("\nconstrained vs unconstrained decode: not measured yet (the engine's constrained "
           "decoding, issue 24, adds it here)\n");
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
        decode_section();
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
    kvf_text_vocab_destroy(vocab);
    kvf_text_tokenizer_destroy(tok);
    if (rc == 0) {
        decode_section();
        printf("\ncompile_ms=%.2f (%d properties%s) mask_uncached_us=%.1f mask_cached_us=%.2f "
               "(per token along its document, %s)\n",
               big_ms, c.properties, c.properties == 50 ? ", goal <= 50" : "", big_unc, big_cached,
               schemas[0].name);
    }
out:
    free(big.p);
    free(big_doc.p);
    free(ten.p);
    free(ten_doc.p);
    return rc;
}
