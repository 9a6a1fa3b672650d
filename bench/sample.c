/* sample.c: `kvfleet bench sample`: the engine's host sampler (engine/sample.h) per draw, for
 * vocabularies and temperature / top-k / top-p settings, next to two baselines timed on the same
 * rows in the same run: the argmax (one pass, the least any draw costs) and a full sort of the
 * row (what a sort-based top-p sampler does). Rows are Gaussian logits, like a model's. */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "common/cfg.h"
#include "common/progress.h"
#include "common/time.h"
#include "engine/sample.h"

typedef struct sample_bench_cfg {
    const char *vocabs;
    int32_t rows;
    double seconds, temperature;
} sample_bench_cfg;

static const kvf_cfg_opt sample_bench_opts[] = {
    {"vocabs", "32000,128256", "vocabulary sizes (comma-separated, 2 to 1048576)", offsetof(sample_bench_cfg, vocabs), KVF_CFG_STR},
    {"rows", "16", "distinct logits rows drawn from in turn", offsetof(sample_bench_cfg, rows), KVF_CFG_INT},
    {"seconds", "0.3", "minimum seconds per measurement", offsetof(sample_bench_cfg, seconds), KVF_CFG_DOUBLE},
    {"temperature", "0.8", "temperature of every draw", offsetof(sample_bench_cfg, temperature), KVF_CFG_DOUBLE},
    {NULL},
};

static const kvf_cfg_spec sample_bench_spec = {
    .prog = "kvfleet bench sample",
    .summary = "Microseconds per draw of the engine's host sampler (engine/sample.h: cuts by\n"
               "selection, draw in id order) for each vocabulary and setting, next to the argmax of\n"
               "the same row and a full sort of it (qsort of (logit, id), what a sort-based top-p\n"
               "sampler does), both timed in the same run. Ends with sort_over_top_p=<x>: the sort\n"
               "over the top-p draw at the largest vocabulary (how much faster the draw is).",
    .opts = sample_bench_opts,
};

#define MAX_VOCABS 8

typedef struct sample_setting {
    const char *name;
    int32_t top_k;
    float top_p;
} sample_setting;

static const sample_setting settings[] = {
    {"temperature only", 0, 1.0f},
    {"top_k 50", 50, 1.0f},
    {"top_p 0.95", 0, 0.95f},
    {"top_k 50 + top_p 0.9", 50, 0.9f},
};
#define N_SETTINGS (int)(sizeof settings / sizeof settings[0])

static int cmp_cand(const void *pa, const void *pb)
{
    const kvf_engine_cand *a = pa, *b = pb;
    if (a->logit != b->logit)
        return a->logit > b->logit ? -1 : 1;
    return a->id - b->id;
}

/* What one measurement does to row r: 0..N_SETTINGS-1 a draw, then argmax, then sort. */
typedef struct sample_job {
    kvf_engine_sampler *s;
    float **rows;
    kvf_engine_cand *tmp;
    int32_t n_rows, vocab;
    float temperature;
    kvf_engine_rng rng;
    int64_t sink;
} sample_job;

static void run_one(sample_job *j, int what, int32_t r)
{
    const float *row = j->rows[r];
    if (what < N_SETTINGS) {
        j->sink += kvf_engine_sample(j->s, row, j->temperature, settings[what].top_k,
                                     settings[what].top_p, &j->rng);
    } else if (what == N_SETTINGS) {
        j->sink += kvf_engine_argmax(row, j->vocab);
    } else {
        for (int32_t i = 0; i < j->vocab; i++)
            j->tmp[i] = (kvf_engine_cand){.logit = row[i], .id = i};
        qsort(j->tmp, (size_t)j->vocab, sizeof *j->tmp, cmp_cand);
        j->sink += j->tmp[0].id;
    }
}

/* Microseconds per call of `what`, over at least `seconds`. */
static double time_us(sample_job *j, int what, double seconds)
{
    int64_t n = 0, t0 = kvf_now_ns(), t;
    do {
        for (int32_t r = 0; r < j->n_rows; r++)
            run_one(j, what, r);
        n += j->n_rows;
        t = kvf_now_ns();
    } while ((double)(t - t0) < seconds * 1e9);
    return (double)(t - t0) / 1e3 / (double)n;
}

static int parse_vocabs(const char *s, int32_t *out)
{
    int n = 0;
    while (s && *s && n < MAX_VOCABS) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 2 || v > (1 << 20) || (*end && *end != ','))
            return -1;
        out[n++] = (int32_t)v;
        s = *end ? end + 1 : end;
    }
    return s && *s ? -1 : n;
}

int kvf_bench_sample_main(int argc, char **argv)
{
    sample_bench_cfg c = {0};
    kvf_err err = {0};
    int n_pos = 0;
    kvf_status st = kvf_cfg_parse(&sample_bench_spec, &c, argc, argv, &n_pos, &err);
    if (st == KVF_HELP)
        return 0;
    if (st != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    int32_t vocabs[MAX_VOCABS];
    int n_v = parse_vocabs(c.vocabs, vocabs);
    if (n_v <= 0 || c.rows < 1 || c.rows > 1024 || !(c.seconds > 0) || !(c.temperature > 0)) {
        fprintf(stderr, "kvfleet: bench sample: --vocabs=%s --rows=%d --seconds=%g --temperature=%g: "
                "vocabularies 2 to 1048576 (up to %d), rows 1 to 1024, seconds and temperature "
                "above 0\n", c.vocabs, c.rows, c.seconds, c.temperature, MAX_VOCABS);
        return 2;
    }
    printf("kvfleet bench sample: engine host sampler, %d Gaussian rows (sd 2), temperature %g, "
           "one thread\n\n", c.rows, c.temperature);
    printf("%-8s %-22s %12s %12s %12s\n", "vocab", "setting", "us/draw", "x argmax", "sort/draw");
    kvf_progress prog;
    kvf_progress_init(&prog, "bench sample", (int64_t)n_v * (N_SETTINGS + 2));
    int64_t done = 0;
    double ratio = 0;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int vi = 0; vi < n_v; vi++) {
        int32_t V = vocabs[vi];
        kvf_engine_sampler s;
        if (kvf_engine_sampler_init(&s, V, &err) != KVF_OK) {
            kvf_progress_finish(&prog);
            fprintf(stderr, "kvfleet: bench sample: %s\n", err.msg);
            return 1;
        }
        sample_job j = {.s = &s, .n_rows = c.rows, .vocab = V, .temperature = (float)c.temperature};
        j.rows = calloc((size_t)c.rows, sizeof *j.rows);
        j.tmp = malloc((size_t)V * sizeof *j.tmp);
        bool ok = j.rows && j.tmp;
        for (int32_t r = 0; ok && r < c.rows; r++) {
            if (!(j.rows[r] = malloc((size_t)V * sizeof(float)))) {
                ok = false;
                break;
            }
            for (int32_t i = 0; i < V; i += 2) { /* Box-Muller pairs */
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                double a = ((x >> 11) + 1) * 0x1.0p-53;
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                double b = (x >> 11) * 0x1.0p-53, m = 2 * sqrt(-2 * log(a));
                j.rows[r][i] = (float)(m * cos(6.283185307179586 * b));
                if (i + 1 < V)
                    j.rows[r][i + 1] = (float)(m * sin(6.283185307179586 * b));
            }
        }
        if (!ok) {
            kvf_progress_finish(&prog);
            fprintf(stderr, "kvfleet: bench sample: out of memory for %d rows of %d\n", c.rows, V);
            return 1;
        }
        kvf_engine_rng_seed(&j.rng, 1, 0);
        double us[N_SETTINGS + 2];
        for (int w = 0; w < N_SETTINGS + 2; w++) {
            us[w] = time_us(&j, w, c.seconds);
            kvf_progress_update(&prog, ++done);
        }
        kvf_progress_finish(&prog);
        double sort_us = us[N_SETTINGS + 1], argmax_us = us[N_SETTINGS];
        for (int w = 0; w < N_SETTINGS; w++)
            printf("%-8d %-22s %12.1f %12.1f %12.2f\n", V, settings[w].name, us[w], us[w] / argmax_us,
                   sort_us / us[w]);
        printf("%-8d %-22s %12.1f %12.1f %12.2f\n", V, "(argmax baseline)", argmax_us, 1.0, sort_us / argmax_us);
        printf("%-8d %-22s %12.1f %12.1f %12.2f\n", V, "(full sort baseline)", sort_us, sort_us / argmax_us, 1.0);
        ratio = sort_us / us[2]; /* top_p 0.95 */
        for (int32_t r = 0; r < c.rows; r++)
            free(j.rows[r]);
        free(j.rows);
        free(j.tmp);
        kvf_engine_sampler_fini(&s);
        if (j.sink == 42) /* keeps the calls */
            printf(" ");
    }
    printf("\nsort_over_top_p=%.2f (a full sort of the row over one top_p 0.95 draw, vocabulary %d; "
           "above 1: the draw is that much faster than sorting)\n", ratio, vocabs[n_v - 1]);
    return 0;
}
