/* kvtest.h: what the kv tests share: a small pool with a fake clock and an event log, token
 * patterns, per-slot data stamps, and checking the invariants after every operation.
 * Header-only; include after cmocka's headers. */
#ifndef KVF_TEST_KVTEST_H
#define KVF_TEST_KVTEST_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kv/hash.h"
#include "kv/pool.h"
#include "kv/swap.h"

#define KT_MAX_EVENTS 4096

typedef struct kt_env {
    kvf_kv_pool *pool;
    int64_t now;
    int n_ev;
    kvf_kv_event ev[KT_MAX_EVENTS]; /* tokens pointers cleared: valid only in the callback */
    int32_t ev_tok0[KT_MAX_EVENTS];  /* first token of each STORED block */
} kt_env;

static inline int64_t kt_clock(void *ctx) { return ((kt_env *)ctx)->now; }

static inline void kt_on_event(void *ctx, const kvf_kv_event *ev)
{
    kt_env *e = ctx;
    if (e->n_ev >= KT_MAX_EVENTS)
        return;
    e->ev[e->n_ev] = *ev;
    e->ev[e->n_ev].tokens = NULL;
    e->ev_tok0[e->n_ev] = ev->tokens ? ev->tokens[0] : -1;
    e->n_ev++;
}

/* One layer, one KV head, head_dim 2 of f32: 8 bytes per (token, K|V). */
static inline kvf_kv_pool_cfg kt_cfg(kt_env *e, int32_t n_blocks, int32_t bs)
{
    kvf_kv_pool_cfg c = {0};
    kvf_err err;
    if (kvf_kv_layout_init(1, 1, 2, bs, KVF_DTYPE_F32, &c.layout, &err) != KVF_OK)
        fprintf(stderr, "%s\n", err.msg);
    c.n_blocks = n_blocks;
    c.on_event = kt_on_event;
    c.event_ctx = e;
    c.clock_ns = kt_clock;
    c.clock_ctx = e;
    return c;
}

static inline void kt_open(kt_env *e, int32_t n_blocks, int32_t bs, int64_t retention)
{
    memset(e, 0, sizeof *e);
    e->now = 1000;
    kvf_kv_pool_cfg c = kt_cfg(e, n_blocks, bs);
    c.retention_ns = retention;
    kvf_err err = {0};
    kvf_status st = kvf_kv_pool_create(&c, &e->pool, &err);
    if (st != KVF_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, KVF_OK);
}

/* Asserts the pool invariants over the given sequences, printing the checker's message. */
static inline void kt_check(kvf_kv_pool *p, kvf_kv_seq *const *seqs, size_t n)
{
    kvf_err err = {0};
    kvf_status st = kvf_kv_check_invariants(p, (const kvf_kv_seq *const *)seqs, n, &err);
    if (st != KVF_OK)
        fprintf(stderr, "invariant: %s\n", err.msg);
    assert_int_equal(st, KVF_OK);
}

/* Token i of pattern `seed`. */
static inline void kt_tokens(int32_t *t, int64_t n, int32_t seed)
{
    for (int64_t i = 0; i < n; i++)
        t[i] = (int32_t)(((uint32_t)i * 2654435761u + (uint32_t)seed * 40503u) % 32000u);
}

/* The 8 bytes of K at token position pos of seq (layer 0, head 0). */
static inline uint64_t *kt_slot(const kvf_kv_seq *s, int64_t pos)
{
    const kvf_kv_layout *l = kvf_kv_pool_layout(s->pool);
    char *base = kvf_kv_pool_base(s->pool);
    return (uint64_t *)(base + kvf_kv_offset(l, s->blocks[pos / l->block_size], 0, KVF_KV_K, 0,
                                             (int32_t)(pos % l->block_size)));
}

#endif
