/* kv.c: `kvfleet bench kv`: operations per second of the KV cache manager's hot calls (block
 * allocate/free, a decode step over many sequences, prefix insert and lookup) and block-hashing
 * throughput against a plain memory read of the same bytes in the same run. Not a test. */
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "common/cfg.h"
#include "common/progress.h"
#include "common/time.h"
#include "kv/hash.h"
#include "kv/pool.h"

typedef struct kv_bench_cfg {
    int32_t blocks, block_size, layers, kv_heads, head_dim, seqs, seq_blocks;
    int64_t hash_bytes;
    double seconds;
} kv_bench_cfg;

static const kvf_cfg_opt kv_bench_opts[] = {
    {"blocks", "4096", "blocks in the pool", offsetof(kv_bench_cfg, blocks), KVF_CFG_INT},
    {"block-size", "16", "tokens per block", offsetof(kv_bench_cfg, block_size), KVF_CFG_INT},
    {"layers", "2", "layers in the KV layout (block bytes only; the pool memory is barely touched)", offsetof(kv_bench_cfg, layers), KVF_CFG_INT},
    {"kv-heads", "2", "KV heads in the layout", offsetof(kv_bench_cfg, kv_heads), KVF_CFG_INT},
    {"head-dim", "64", "head dimension in the layout", offsetof(kv_bench_cfg, head_dim), KVF_CFG_INT},
    {"seqs", "256", "sequences in the decode-step phase", offsetof(kv_bench_cfg, seqs), KVF_CFG_INT},
    {"seq-blocks", "8", "blocks per sequence in the allocate, insert and lookup phases", offsetof(kv_bench_cfg, seq_blocks), KVF_CFG_INT},
    {"hash-bytes", "64M", "token bytes hashed per pass in the hashing phase", offsetof(kv_bench_cfg, hash_bytes), KVF_CFG_SIZE},
    {"seconds", "0.5", "minimum seconds per phase", offsetof(kv_bench_cfg, seconds), KVF_CFG_DOUBLE},
    {NULL},
};

static const kvf_cfg_spec kv_bench_spec = {
    .prog = "kvfleet bench kv",
    .summary = "Operations per second of the KV block pool and prefix cache (allocate, free, a\n"
               "decode step, insert = hash + register, lookup hit and miss), and block-hashing\n"
               "GB/s compared with a plain memory read of the same bytes in the same run.",
    .opts = kv_bench_opts,
};

typedef struct kv_row {
    const char *name, *unit;
    double count, seconds; /* count < 0: a rate measured elsewhere, in seconds' place */
} kv_row;

#define KV_PHASES 7

typedef struct kv_run {
    kv_bench_cfg c;
    kvf_kv_pool *pool;
    kvf_kv_seq *seqs;   /* [n_seqs] */
    int32_t n_seqs;     /* blocks / seq_blocks */
    int32_t *tokens;    /* [n_seqs][seq_blocks * block_size] distinct prompts */
    int64_t seq_tokens;
    kv_row rows[KV_PHASES + 1];
    int n_rows;
    kvf_progress prog;
} kv_run;

static void add_row(kv_run *r, const char *name, const char *unit, double count, double s)
{
    r->rows[r->n_rows++] = (kv_row){name, unit, count, s};
    kvf_progress_update(&r->prog, r->n_rows);
}

static void fill_tokens(int32_t *t, int64_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (int64_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        t[i] = (int32_t)(x % 128000u);
    }
}

/* Phase 1-2: fill the pool with sequences of seq_blocks blocks, then free them all. */
static kvf_status phase_alloc_free(kv_run *r, kvf_err *err)
{
    double t_alloc = 0, t_free = 0, blocks = 0;
    double t_end = kvf_now_s() + 2 * r->c.seconds;
    do {
        double t0 = kvf_now_s();
        for (int32_t i = 0; i < r->n_seqs; i++) {
            kvf_kv_seq_reset(&r->seqs[i], 1, NULL);
            kvf_status st = kvf_kv_seq_prepare_write(&r->seqs[i], r->seq_tokens, err);
            if (st != KVF_OK)
                return st;
        }
        double t1 = kvf_now_s();
        for (int32_t i = 0; i < r->n_seqs; i++) {
            kvf_status st = kvf_kv_seq_free(&r->seqs[i], err);
            if (st != KVF_OK)
                return st;
        }
        double t2 = kvf_now_s();
        t_alloc += t1 - t0;
        t_free += t2 - t1;
        blocks += (double)r->n_seqs * r->c.seq_blocks;
    } while (kvf_now_s() < t_end);
    add_row(r, "allocate", "blocks", blocks, t_alloc);
    add_row(r, "free", "blocks", blocks, t_free);
    return KVF_OK;
}

/* Phase 3: decode steps: c.seqs sequences each get one token per step (all-or-nothing). */
static kvf_status phase_step(kv_run *r, kvf_err *err)
{
    int32_t n = r->c.seqs;
    kvf_kv_seq **ptr = malloc((size_t)n * sizeof *ptr);
    int64_t *one = malloc((size_t)n * sizeof *one);
    kvf_status st = KVF_OK;
    if (!ptr || !one) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "bench kv: out of memory");
        goto out;
    }
    int64_t max_steps = (int64_t)(r->c.blocks / n) * r->c.block_size;
    double steps = 0, el = 0;
    double t_end = kvf_now_s() + r->c.seconds;
    do {
        for (int32_t i = 0; i < n; i++) {
            kvf_kv_seq_reset(&r->seqs[i], 1, NULL);
            ptr[i] = &r->seqs[i];
            one[i] = 1;
            /* tables sized ahead, as the engine does at admission */
            if ((st = kvf_kv_seq_reserve(ptr[i], (int32_t)(max_steps / r->c.block_size + 1), err)) != KVF_OK)
                goto out;
        }
        double t0 = kvf_now_s();
        for (int64_t s = 0; s < max_steps; s++)
            if ((st = kvf_kv_pool_alloc_step(r->pool, ptr, one, (size_t)n, err)) != KVF_OK)
                goto out;
        el += kvf_now_s() - t0;
        steps += (double)max_steps;
        for (int32_t i = 0; i < n; i++)
            kvf_kv_seq_free(&r->seqs[i], NULL);
    } while (kvf_now_s() < t_end);
    add_row(r, "decode step", "steps", steps, el);
out:
    free(ptr);
    free(one);
    return st;
}

/* Phase 4-6: insert (prepare + commit: hashing and registering) distinct prompts, then look up
 * each (hits), then look up prompts that are not cached (misses). */
static kvf_status phase_prefix(kv_run *r, kvf_err *err)
{
    double t_ins = 0, t_hit = 0, t_miss = 0, blocks = 0;
    int32_t n = r->n_seqs;
    int64_t hit;
    int32_t *other = malloc((size_t)r->seq_tokens * sizeof *other);
    if (!other)
        return kvf_err_set(err, KVF_ERR_NOMEM, "bench kv: out of memory");
    fill_tokens(other, r->seq_tokens, 999);
    double t_end = kvf_now_s() + 3 * r->c.seconds;
    uint32_t round = 0;
    kvf_status st = KVF_OK;
    do {
        /* new prompts each round so inserts register (and evict) instead of deduplicating */
        for (int32_t i = 0; i < n; i++)
            r->tokens[(int64_t)i * r->seq_tokens] = (int32_t)(round * (uint32_t)n + (uint32_t)i);
        round++;
        double t0 = kvf_now_s();
        for (int32_t i = 0; i < n; i++) {
            kvf_kv_seq *s = &r->seqs[i];
            kvf_kv_seq_reset(s, 1, NULL);
            if ((st = kvf_kv_seq_prepare_write(s, r->seq_tokens, err)) != KVF_OK ||
                (st = kvf_kv_seq_commit(s, r->tokens + (int64_t)i * r->seq_tokens, r->seq_tokens,
                                        err)) != KVF_OK ||
                (st = kvf_kv_seq_free(s, err)) != KVF_OK)
                goto out;
        }
        double t1 = kvf_now_s();
        for (int32_t i = 0; i < n; i++) {
            kvf_kv_seq *s = &r->seqs[i];
            kvf_kv_seq_reset(s, 1, NULL);
            if ((st = kvf_kv_prefix_lookup(s, r->tokens + (int64_t)i * r->seq_tokens,
                                           r->seq_tokens, &hit, err)) != KVF_OK)
                goto out;
            if (hit != r->seq_tokens) {
                st = kvf_err_set(err, KVF_ERR_INTERNAL, "bench kv: lookup hit %lld of %lld tokens",
                                 (long long)hit, (long long)r->seq_tokens);
                goto out;
            }
            kvf_kv_seq_free(s, err);
        }
        double t2 = kvf_now_s();
        for (int32_t i = 0; i < n; i++) {
            kvf_kv_seq *s = &r->seqs[i];
            kvf_kv_seq_reset(s, 1, NULL);
            other[0] = i;
            if ((st = kvf_kv_prefix_lookup(s, other, r->seq_tokens, &hit, err)) != KVF_OK)
                goto out;
            kvf_kv_seq_free(s, err);
        }
        double t3 = kvf_now_s();
        t_ins += t1 - t0;
        t_hit += t2 - t1;
        t_miss += t3 - t2;
        blocks += (double)n * r->c.seq_blocks;
    } while (kvf_now_s() < t_end);
    add_row(r, "insert", "blocks", blocks, t_ins);
    add_row(r, "lookup hit", "blocks", blocks, t_hit);
    add_row(r, "lookup miss", "lookups", (double)n * round, t_miss);
out:
    free(other);
    return st;
}

/* Phase 7: block hashing over hash_bytes of tokens, and the memory read of the same buffer. */
static kvf_status phase_hash(kv_run *r, double *hash_bps, double *read_bps, kvf_err *err)
{
    int64_t n_tok = r->c.hash_bytes / 4 / r->c.block_size * r->c.block_size;
    int32_t *t = malloc((size_t)n_tok * sizeof *t);
    uint64_t *h = malloc((size_t)(n_tok / r->c.block_size) * sizeof *h);
    if (!t || !h) {
        free(t);
        free(h);
        return kvf_err_set(err, KVF_ERR_NOMEM, "bench kv: out of memory for %lld hash bytes",
                           (long long)r->c.hash_bytes);
    }
    fill_tokens(t, n_tok, 7);
    double bytes = 0, t0 = kvf_now_s(), el;
    volatile uint64_t sink = 0; /* keeps the hash loop from being optimised out */
    do {
        kvf_kv_hash_blocks(1, t, (size_t)n_tok, r->c.block_size, h);
        sink ^= h[0];
        bytes += (double)n_tok * 4;
        el = kvf_now_s() - t0;
    } while (el < r->c.seconds);
    *hash_bps = bytes / el;
    add_row(r, "hash blocks", "bytes", bytes, el);
    *read_bps = kvf_bench_memread_bps(t, (size_t)n_tok * 4, r->c.seconds);
    add_row(r, "memory read", "bytes", -1, *read_bps);
    (void)sink;
    free(t);
    free(h);
    return KVF_OK;
}

static void fmt_rate(double v, const char *unit, char *buf, size_t cap)
{
    if (strcmp(unit, "bytes") == 0)
        snprintf(buf, cap, "%.2f GB/s", v / 1e9);
    else if (v >= 1e6)
        snprintf(buf, cap, "%.2f M %s/s", v / 1e6, unit);
    else
        snprintf(buf, cap, "%.1f k %s/s", v / 1e3, unit);
}

int kvf_bench_kv_main(int argc, char **argv)
{
    kv_run r;
    memset(&r, 0, sizeof r);
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&kv_bench_spec, &r.c, argc, argv, NULL, &err);
    if (st == KVF_HELP)
        return 0;
    if (st != KVF_OK) {
        fprintf(stderr, "kvfleet: %s\n", err.msg);
        return 2;
    }
    kv_bench_cfg *c = &r.c;
    if (c->seq_blocks <= 0 || c->blocks < c->seq_blocks || c->seqs <= 0 ||
        c->seqs > c->blocks || c->seconds <= 0 ||
        c->hash_bytes < 4 * (int64_t)c->block_size) {
        fprintf(stderr, "kvfleet: bench kv: need --seq-blocks (%d) from 1 to --blocks (%d), "
                "--seqs (%d) from 1 to --blocks, --seconds (%g) > 0 and --hash-bytes (%lld) of a block or more\n",
                c->seq_blocks, c->blocks, c->seqs, c->seconds, (long long)c->hash_bytes);
        return 2;
    }
    kvf_kv_pool_cfg pc = {.n_blocks = c->blocks};
    st = kvf_kv_layout_init(c->layers, c->kv_heads, c->head_dim, c->block_size, KVF_DTYPE_F16,
                            &pc.layout, &err);
    if (st == KVF_OK)
        st = kvf_kv_pool_create(&pc, &r.pool, &err);
    if (st != KVF_OK) {
        fprintf(stderr, "kvfleet: bench kv: %s\n", err.msg);
        return 2;
    }
    r.n_seqs = c->blocks / c->seq_blocks;
    int32_t n_alloc = r.n_seqs > c->seqs ? r.n_seqs : c->seqs;
    r.seq_tokens = (int64_t)c->seq_blocks * c->block_size;
    r.seqs = calloc((size_t)n_alloc, sizeof *r.seqs);
    r.tokens = malloc((size_t)(r.n_seqs * r.seq_tokens) * sizeof *r.tokens);
    int rc = 1;
    if (!r.seqs || !r.tokens) {
        fprintf(stderr, "kvfleet: bench kv: out of memory\n");
        goto out;
    }
    fill_tokens(r.tokens, r.n_seqs * r.seq_tokens, 1);
    /* sequence slots made once; phases reuse them with kvf_kv_seq_reset, as the engine does */
    for (int32_t i = 0; i < n_alloc; i++)
        kvf_kv_seq_init(&r.seqs[i], r.pool, 1);
    printf("kv bench: pool %d blocks x %lld bytes (%d layers, %d KV heads, head_dim %d, f16), "
           "block size %d; %d sequences of %d blocks; >= %.2f s per phase\n",
           c->blocks, (long long)pc.layout.block_bytes, c->layers, c->kv_heads, c->head_dim,
           c->block_size, r.n_seqs, c->seq_blocks, c->seconds);
    kvf_progress_init(&r.prog, "bench kv", KV_PHASES + 1);
    double hash_bps = 0, read_bps = 0;
    if ((st = phase_alloc_free(&r, &err)) != KVF_OK || (st = phase_step(&r, &err)) != KVF_OK ||
        (st = phase_prefix(&r, &err)) != KVF_OK ||
        (st = phase_hash(&r, &hash_bps, &read_bps, &err)) != KVF_OK) {
        kvf_progress_finish(&r.prog);
        fprintf(stderr, "kvfleet: bench kv: %s\n", err.msg);
        goto out;
    }
    kvf_progress_finish(&r.prog);
    printf("\n%-13s %16s %10s %22s %14s\n", "operation", "count", "seconds", "rate", "ns/op");
    for (int i = 0; i < r.n_rows; i++) {
        kv_row *w = &r.rows[i];
        char rate[64], count[32] = "-", secs[32] = "-", per[32] = "-";
        fmt_rate(w->count < 0 ? w->seconds : w->count / w->seconds, w->unit, rate, sizeof rate);
        if (w->count >= 0) {
            snprintf(count, sizeof count, "%.0f", w->count);
            snprintf(secs, sizeof secs, "%.3f", w->seconds);
        }
        if (w->count > 0 && strcmp(w->unit, "bytes") != 0)
            snprintf(per, sizeof per, "%.1f", 1e9 * w->seconds / w->count);
        printf("%-13s %16s %10s %22s %14s\n", w->name, count, secs, rate, per);
    }
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(r.pool, &ps);
    printf("\nhash / memory read of the same %lld bytes: %.2f / %.2f GB/s = %.3f\n",
           (long long)(c->hash_bytes / 4 / c->block_size * c->block_size * 4), hash_bps / 1e9,
           read_bps / 1e9, read_bps > 0 ? hash_bps / read_bps : 0);
    printf("summary: allocate %.2f M blocks/s, free %.2f M blocks/s, decode step (%d seqs) %.1f k "
           "steps/s, insert %.2f M blocks/s, lookup hit %.2f M blocks/s, hash %.2f GB/s = %.2fx "
           "memory read; %lld evictions\n",
           r.rows[0].count / r.rows[0].seconds / 1e6, r.rows[1].count / r.rows[1].seconds / 1e6,
           c->seqs, r.rows[2].count / r.rows[2].seconds / 1e3,
           r.rows[3].count / r.rows[3].seconds / 1e6, r.rows[4].count / r.rows[4].seconds / 1e6,
           hash_bps / 1e9, read_bps > 0 ? hash_bps / read_bps : 0, (long long)ps.evicted);
    rc = 0;
out:
    for (int32_t i = 0; r.seqs && i < n_alloc; i++)
        kvf_kv_seq_fini(&r.seqs[i]);
    free(r.seqs);
    free(r.tokens);
    kvf_kv_pool_destroy(r.pool);
    return rc;
}
