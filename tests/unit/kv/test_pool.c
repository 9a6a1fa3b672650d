/* test_pool.c: kv/pool.h rule by rule: creation errors, on-demand growth and the exact-fit
 * boundary, allocation past the pool, all-or-nothing steps, double free and foreign blocks,
 * prefix registration and token-verified hits, salt isolation, LRU order, retention, pinning,
 * copy-on-write, adopting blocks for a remote writer, events. Invariants after every call. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvtest.h"

#define BS 16

static uint64_t root_of(const char *salt)
{
    return kvf_kv_hash_root("test-model", salt, salt ? strlen(salt) : 0);
}

static kvf_status fail_alloc(void *ctx, int64_t bytes, void **out, kvf_err *err)
{
    return kvf_err_set(err, KVF_ERR_NOMEM, "device out of memory for %lld bytes", (long long)bytes);
}

static void test_create_errors(void **state)
{
    kt_env e;
    kvf_kv_pool *p = NULL;
    kvf_err err = {0};
    kvf_kv_pool_cfg c = kt_cfg(&e, 0, BS);
    assert_int_equal(kvf_kv_pool_create(&c, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "n_blocks 0"));
    c = kt_cfg(&e, 8, BS);
    c.layout.block_bytes += 4;
    assert_int_equal(kvf_kv_pool_create(&c, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block_bytes"));
    c = kt_cfg(&e, 8, BS);
    c.layout.block_size = 12;
    assert_int_equal(kvf_kv_pool_create(&c, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block_size 12"));
    c = kt_cfg(&e, 8, BS);
    c.retention_ns = -1;
    assert_int_equal(kvf_kv_pool_create(&c, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "retention"));
    kvf_kv_mem_ops bad = kvf_kv_mem_host;
    bad.name = "half";
    bad.copy_block = NULL;
    c = kt_cfg(&e, 8, BS);
    c.mem = &bad;
    assert_int_equal(kvf_kv_pool_create(&c, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'half'"));
    bad = kvf_kv_mem_host;
    bad.alloc = fail_alloc;
    c.mem = &bad;
    assert_int_equal(kvf_kv_pool_create(&c, &p, &err), KVF_ERR_NOMEM);
    assert_non_null(strstr(err.msg, "device out of memory"));
    assert_null(p);
}

static void test_growth_and_exact_fit(void **state)
{
    kt_env e;
    kt_open(&e, 4, BS, 0);
    kvf_kv_pool *p = e.pool;
    kvf_kv_seq s;
    kvf_kv_seq_init(&s, p, root_of(NULL));
    kvf_kv_seq *all[] = {&s};
    kvf_err err = {0};
    assert_int_equal(kvf_kv_pool_bytes(p), 4 * kvf_kv_pool_layout(p)->block_bytes);
    assert_int_equal(kvf_kv_seq_prepare_write(&s, 0, &err), KVF_OK);
    assert_int_equal(s.n_blocks, 0); /* blocks_for(0) = 0 */
    kt_check(p, all, 1);
    assert_int_equal(kvf_kv_seq_prepare_write(&s, 16, &err), KVF_OK);
    assert_int_equal(s.n_blocks, 1); /* blocks_for(16) = 1 */
    assert_int_equal(s.n_tokens, 16);
    kt_check(p, all, 1);
    assert_int_equal(kvf_kv_seq_prepare_write(&s, 1, &err), KVF_OK);
    assert_int_equal(s.n_blocks, 2); /* blocks_for(17) = 2 */
    kt_check(p, all, 1);
    for (int i = 0; i < 15; i++) /* one token at a time fills block 2 without a new block */
        assert_int_equal(kvf_kv_seq_prepare_write(&s, 1, &err), KVF_OK);
    assert_int_equal(s.n_blocks, 2);
    assert_int_equal(kvf_kv_seq_prepare_write(&s, 32, &err), KVF_OK); /* exactly the pool */
    assert_int_equal(s.n_blocks, 4);
    assert_int_equal(s.n_tokens, 64);
    kt_check(p, all, 1);
    /* one token past the pool: ERR_FULL, nothing changed */
    assert_int_equal(kvf_kv_seq_prepare_write(&s, 1, &err), KVF_ERR_FULL);
    assert_non_null(strstr(err.msg, "only 0 are available"));
    assert_int_equal(s.n_tokens, 64);
    assert_int_equal(s.n_blocks, 4);
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.used, 4);
    assert_int_equal(st.free, 0);
    kt_check(p, all, 1);
    /* block ids distinct and in range */
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < i; j++)
            assert_int_not_equal(s.blocks[i], s.blocks[j]);
    assert_int_equal(kvf_kv_seq_prepare_write(&s, -1, &err), KVF_ERR_INVALID);
    assert_int_equal(kvf_kv_seq_free(&s, &err), KVF_OK);
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.free, 4);
    kvf_kv_seq_fini(&s);
    kvf_kv_pool_destroy(p);
}

static void test_alloc_step_all_or_nothing(void **state)
{
    kt_env e;
    kt_open(&e, 5, BS, 0);
    kvf_kv_pool *p = e.pool;
    kvf_kv_seq a, b, c;
    kvf_kv_seq_init(&a, p, 1);
    kvf_kv_seq_init(&b, p, 1);
    kvf_kv_seq_init(&c, p, 1);
    kvf_kv_seq *all[] = {&a, &b, &c};
    kvf_err err = {0};
    int64_t want[] = {16, 33, 20}; /* 1 + 3 + 2 = 6 > 5 */
    assert_int_equal(kvf_kv_pool_step_need(p, all, want, 3), 6);
    assert_int_equal(kvf_kv_pool_alloc_step(p, all, want, 3, &err), KVF_ERR_FULL);
    assert_non_null(strstr(err.msg, "needs 6 blocks but only 5"));
    for (int i = 0; i < 3; i++)
        assert_int_equal(all[i]->n_tokens, 0);
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.free, 5);
    kt_check(p, all, 3);
    int64_t fits[] = {16, 33, 16}; /* 1 + 3 + 1 = 5: exact fit */
    assert_int_equal(kvf_kv_pool_alloc_step(p, all, fits, 3, &err), KVF_OK);
    assert_int_equal(b.n_blocks, 3);
    kt_check(p, all, 3);
    int64_t one[] = {0, 0, 1};
    assert_int_equal(kvf_kv_pool_alloc_step(p, all, one, 3, &err), KVF_ERR_FULL);
    assert_int_equal(c.n_tokens, 16);
    int64_t fill_b[] = {0, 15, 0}; /* 33 -> 48 stays in 3 blocks */
    assert_int_equal(kvf_kv_pool_alloc_step(p, all, fill_b, 3, &err), KVF_OK);
    assert_int_equal(b.n_tokens, 48);
    kt_check(p, all, 3);
    /* a sequence of another pool is refused */
    kt_env e2;
    kt_open(&e2, 2, BS, 0);
    kvf_kv_seq x;
    kvf_kv_seq_init(&x, e2.pool, 1);
    kvf_kv_seq *mixed[] = {&a, &x};
    int64_t z[] = {0, 1};
    assert_int_equal(kvf_kv_pool_alloc_step(p, mixed, z, 2, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "another pool"));
    kvf_kv_seq_fini(&x);
    kvf_kv_pool_destroy(e2.pool);
    for (int i = 0; i < 3; i++)
        kvf_kv_seq_fini(all[i]);
    kvf_kv_pool_destroy(p);
}

static void test_double_free_and_foreign(void **state)
{
    kt_env e;
    kt_open(&e, 8, BS, 0);
    kvf_kv_pool *p = e.pool;
    kvf_kv_seq s;
    kvf_kv_seq_init(&s, p, 1);
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_prepare_write(&s, 40, &err), KVF_OK);
    /* a forged second table naming the same blocks: freeing both is a double free */
    kvf_kv_seq forged = s;
    forged.blocks = malloc(sizeof(int32_t) * (size_t)s.cap);
    forged.hashes = malloc(sizeof(uint64_t) * (size_t)s.cap);
    memcpy(forged.blocks, s.blocks, sizeof(int32_t) * (size_t)s.n_blocks);
    assert_int_equal(kvf_kv_seq_free(&s, &err), KVF_OK);
    kvf_kv_seq *none[] = {NULL};
    kt_check(p, none, 0);
    assert_int_equal(kvf_kv_seq_free(&forged, &err), KVF_ERR_STATE);
    assert_non_null(strstr(err.msg, "double free of block"));
    kt_check(p, none, 0); /* nothing changed */
    assert_int_equal(kvf_kv_seq_free(&s, &err), KVF_ERR_STATE);
    assert_non_null(strstr(err.msg, "double free of a sequence"));
    /* the same block twice in one table */
    kvf_kv_seq t;
    kvf_kv_seq_init(&t, p, 1);
    assert_int_equal(kvf_kv_seq_prepare_write(&t, 32, &err), KVF_OK);
    int32_t keep = t.blocks[1];
    t.blocks[1] = t.blocks[0];
    assert_int_equal(kvf_kv_seq_free(&t, &err), KVF_ERR_STATE);
    assert_non_null(strstr(err.msg, "position 1"));
    /* a foreign block id */
    t.blocks[1] = 99;
    assert_int_equal(kvf_kv_seq_free(&t, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "foreign block 99"));
    assert_non_null(strstr(err.msg, "0 to 7"));
    t.blocks[1] = keep;
    kvf_kv_seq *all[] = {&t};
    kt_check(p, all, 1); /* refused frees changed nothing */
    assert_int_equal(kvf_kv_seq_free(&t, &err), KVF_OK);
    kt_check(p, none, 0);
    /* a released sequence cannot be written */
    assert_int_equal(kvf_kv_seq_prepare_write(&t, 1, &err), KVF_ERR_STATE);
    /* reset makes it usable again, keeping its arrays; a holding sequence is not reset */
    int32_t cap = t.cap;
    assert_int_equal(kvf_kv_seq_reset(&t, 7, &err), KVF_OK);
    assert_int_equal(t.cap, cap);
    assert_int_equal(t.state, KVF_KV_SEQ_ACTIVE);
    assert_int_equal(kvf_kv_seq_prepare_write(&t, 20, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_reset(&t, 7, &err), KVF_ERR_STATE);
    assert_non_null(strstr(err.msg, "still holds 2 blocks"));
    assert_int_equal(kvf_kv_seq_free(&t, &err), KVF_OK);
    free(forged.blocks);
    free(forged.hashes);
    kvf_kv_seq_fini(&s);
    kvf_kv_seq_fini(&t);
    kvf_kv_pool_destroy(p);
}

/* Fills a sequence with n tokens of pattern seed and commits it. */
static void write_seq(kvf_kv_seq *s, const int32_t *toks, int64_t n)
{
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_prepare_write(s, n - s->n_tokens, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_commit(s, toks, n, &err), KVF_OK);
}

static void test_prefix_hits_and_events(void **state)
{
    kt_env e;
    kt_open(&e, 16, BS, 0);
    kvf_kv_pool *p = e.pool;
    int32_t toks[100];
    kt_tokens(toks, 100, 1);
    uint64_t root = root_of(NULL);
    kvf_kv_seq a, b;
    kvf_kv_seq_init(&a, p, root);
    kvf_kv_seq_init(&b, p, root);
    kvf_kv_seq *all[] = {&a, &b};
    kvf_err err = {0};
    write_seq(&a, toks, 50); /* 3 full blocks + 2 tokens */
    kt_check(p, all, 2);
    assert_int_equal(a.n_hashed, 3);
    assert_int_equal(e.n_ev, 3);
    uint64_t h[6];
    kvf_kv_hash_blocks(root, toks, 96, BS, h);
    for (int i = 0; i < 3; i++) { /* STORED with the parent hash of each block */
        assert_int_equal(e.ev[i].type, KVF_KV_EVENT_STORED);
        assert_true(e.ev[i].hash == h[i]);
        assert_true(e.ev[i].parent_hash == (i ? h[i - 1] : root));
        assert_int_equal(e.ev[i].block, a.blocks[i]);
        assert_int_equal(e.ev[i].n_tokens, BS);
        assert_int_equal(e.ev_tok0[i], toks[i * BS]);
    }
    /* committing again registers nothing new */
    assert_int_equal(kvf_kv_seq_commit(&a, toks, 50, &err), KVF_OK);
    assert_int_equal(e.n_ev, 3);
    /* while a is alive: b shares its 3 full blocks */
    assert_int_equal(kvf_kv_prefix_probe(p, root, toks, 100), 3);
    int64_t hit = -1;
    assert_int_equal(kvf_kv_prefix_lookup(&b, toks, 100, &hit, &err), KVF_OK);
    assert_int_equal(hit, 48);
    assert_int_equal(b.n_tokens, 48);
    for (int i = 0; i < 3; i++)
        assert_int_equal(b.blocks[i], a.blocks[i]);
    kt_check(p, all, 2);
    /* lookup into a non-empty sequence is refused */
    assert_int_equal(kvf_kv_prefix_lookup(&b, toks, 100, &hit, &err), KVF_ERR_STATE);
    /* after both free, the blocks stay cached and a new sequence hits them */
    assert_int_equal(kvf_kv_seq_free(&a, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_free(&b, &err), KVF_OK);
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.cached, 3);
    assert_int_equal(st.free, 13);
    assert_int_equal(st.used, 0);
    kvf_kv_seq c;
    kvf_kv_seq_init(&c, p, root);
    kvf_kv_seq *allc[] = {&c};
    assert_int_equal(kvf_kv_prefix_lookup(&c, toks, 47, &hit, &err), KVF_OK);
    assert_int_equal(hit, 32); /* only full blocks of the 47 asked for */
    kt_check(p, allc, 1);
    write_seq(&c, toks, 64); /* continues: block 3 is new, blocks 0-1 cached, block 2 new */
    assert_int_equal(c.n_hashed, 4);
    kt_check(p, allc, 1);
    /* block 2 was computed again though cached: the duplicate is not registered twice */
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.stored, 4);
    assert_int_equal(kvf_kv_seq_free(&c, &err), KVF_OK);
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.cached, 4); /* blocks 0, 1, the old 2 and 3; the duplicate went free */
    kt_check(p, allc, 0);
    assert_int_equal(kvf_kv_prefix_probe(p, root, toks, 100), 4);
    /* one changed token in block 1 leaves only block 0 */
    toks[BS + 3] ^= 1;
    assert_int_equal(kvf_kv_prefix_probe(p, root, toks, 100), 1);
    /* commit of more tokens than written is refused */
    kvf_kv_seq d;
    kvf_kv_seq_init(&d, p, root);
    assert_int_equal(kvf_kv_seq_prepare_write(&d, 10, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_commit(&d, toks, 20, &err), KVF_ERR_INVALID);
    kvf_kv_seq_fini(&a);
    kvf_kv_seq_fini(&b);
    kvf_kv_seq_fini(&c);
    kvf_kv_seq_fini(&d);
    kvf_kv_pool_destroy(p);
}

static void test_salt_isolation(void **state)
{
    kt_env e;
    kt_open(&e, 8, BS, 0);
    int32_t toks[64];
    kt_tokens(toks, 64, 5);
    kvf_kv_seq a, b;
    kvf_kv_seq_init(&a, e.pool, root_of("tenant-a"));
    write_seq(&a, toks, 64);
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_free(&a, &err), KVF_OK);
    assert_int_equal(kvf_kv_prefix_probe(e.pool, root_of("tenant-a"), toks, 64), 4);
    assert_int_equal(kvf_kv_prefix_probe(e.pool, root_of("tenant-b"), toks, 64), 0);
    assert_int_equal(kvf_kv_prefix_probe(e.pool, root_of(NULL), toks, 64), 0);
    kvf_kv_seq_init(&b, e.pool, root_of("tenant-b"));
    int64_t hit = -1;
    assert_int_equal(kvf_kv_prefix_lookup(&b, toks, 64, &hit, &err), KVF_OK);
    assert_int_equal(hit, 0);
    kvf_kv_seq_fini(&a);
    kvf_kv_seq_fini(&b);
    kvf_kv_pool_destroy(e.pool);
}

static void test_forged_collision(void **state)
{
    kt_env e;
    kt_open(&e, 8, BS, 0);
    kvf_kv_pool *p = e.pool;
    uint64_t root = root_of(NULL);
    int32_t good[32], evil[32];
    kt_tokens(good, 32, 11);
    kt_tokens(evil, 32, 12);
    kvf_kv_seq a, b;
    kvf_kv_seq_init(&a, p, root);
    write_seq(&a, good, 32);
    uint64_t h[2];
    kvf_kv_hash_blocks(root, good, 32, BS, h);
    kvf_err err = {0};
    /* the real hashes with the wrong tokens: the token check refuses the hit */
    kvf_kv_seq_init(&b, p, root);
    int32_t n_hit = -1;
    assert_int_equal(kvf_kv_prefix_lookup_hashes(&b, h, evil, 2, &n_hit, &err), KVF_OK);
    assert_int_equal(n_hit, 0);
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.token_mismatches, 1);
    /* right tokens for block 0, a forged block 1 differing in its last token */
    memcpy(evil, good, sizeof good);
    evil[31]++;
    assert_int_equal(kvf_kv_prefix_lookup_hashes(&b, h, evil, 2, &n_hit, &err), KVF_OK);
    assert_int_equal(n_hit, 1);
    assert_int_equal(b.blocks[0], a.blocks[0]);
    kvf_kv_seq *all[] = {&a, &b};
    kt_check(p, all, 2);
    /* same tokens and hash but under another parent (another root): refused too */
    kvf_kv_seq c;
    kvf_kv_seq_init(&c, p, root ^ 1);
    assert_int_equal(kvf_kv_prefix_lookup_hashes(&c, h, good, 2, &n_hit, &err), KVF_OK);
    assert_int_equal(n_hit, 0);
    /* the honest lookup hits both */
    kvf_kv_seq d;
    kvf_kv_seq_init(&d, p, root);
    assert_int_equal(kvf_kv_prefix_lookup_hashes(&d, h, good, 2, &n_hit, &err), KVF_OK);
    assert_int_equal(n_hit, 2);
    kvf_kv_seq_fini(&a);
    kvf_kv_seq_fini(&b);
    kvf_kv_seq_fini(&c);
    kvf_kv_seq_fini(&d);
    kvf_kv_pool_destroy(p);
}

static void test_lru_order(void **state)
{
    kt_env e;
    kt_open(&e, 6, BS, 0);
    kvf_kv_pool *p = e.pool;
    uint64_t root = root_of(NULL);
    int32_t t[3][48];
    kvf_err err = {0};
    /* three one-block prompts released at times 10, 20, 30, then a 3-block one at 40 */
    kvf_kv_seq s[4];
    for (int i = 0; i < 3; i++) {
        kt_tokens(t[i], 48, 100 + i);
        kvf_kv_seq_init(&s[i], p, root);
        write_seq(&s[i], t[i], 16);
    }
    kvf_kv_seq_init(&s[3], p, root);
    int32_t long_toks[48];
    kt_tokens(long_toks, 48, 200);
    write_seq(&s[3], long_toks, 48);
    int32_t ids[4];
    for (int i = 0; i < 3; i++) {
        e.now = 10 * (i + 1);
        ids[i] = s[i].blocks[0];
        assert_int_equal(kvf_kv_seq_free(&s[i], &err), KVF_OK);
    }
    /* re-touching prompt 0 at 35 makes it the most recent of the three */
    e.now = 35;
    kvf_kv_seq r;
    kvf_kv_seq_init(&r, p, root);
    int64_t hit;
    assert_int_equal(kvf_kv_prefix_lookup(&r, t[0], 16, &hit, &err), KVF_OK);
    assert_int_equal(hit, 16);
    assert_int_equal(kvf_kv_seq_free(&r, &err), KVF_OK);
    e.now = 40;
    int32_t long_ids[3] = {s[3].blocks[0], s[3].blocks[1], s[3].blocks[2]};
    assert_int_equal(kvf_kv_seq_free(&s[3], &err), KVF_OK);
    kvf_kv_seq *none[] = {NULL};
    kt_check(p, none, 0);
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.cached, 6);
    assert_int_equal(st.free, 0);
    /* expected eviction order: prompt 1, prompt 2, prompt 0, then the long one last block first */
    int32_t order[6] = {ids[1], ids[2], ids[0], long_ids[2], long_ids[1], long_ids[0]};
    kvf_kv_seq w;
    kvf_kv_seq_init(&w, p, root);
    kvf_kv_seq *allw[] = {&w};
    for (int i = 0; i < 6; i++) {
        int n_ev = e.n_ev;
        assert_int_equal(kvf_kv_seq_prepare_write(&w, 16, &err), KVF_OK);
        assert_int_equal(w.blocks[i], order[i]);
        assert_int_equal(e.n_ev, n_ev + 1);
        assert_int_equal(e.ev[n_ev].type, KVF_KV_EVENT_REMOVED);
        assert_int_equal(e.ev[n_ev].block, order[i]);
        kt_check(p, allw, 1);
    }
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.evicted, 6);
    assert_int_equal(st.cached, 0);
    assert_int_equal(kvf_kv_prefix_probe(p, root, t[0], 16), 0);
    for (int i = 0; i < 4; i++)
        kvf_kv_seq_fini(&s[i]);
    kvf_kv_seq_fini(&r);
    kvf_kv_seq_fini(&w);
    kvf_kv_pool_destroy(p);
}

static void test_retention(void **state)
{
    kt_env e;
    kt_open(&e, 8, BS, 100);
    kvf_kv_pool *p = e.pool;
    uint64_t root = root_of(NULL);
    int32_t a[32], b[32];
    kt_tokens(a, 32, 1);
    kt_tokens(b, 32, 2);
    kvf_kv_seq s, u;
    kvf_err err = {0};
    kvf_kv_seq_init(&s, p, root);
    write_seq(&s, a, 32);
    e.now = 1000;
    assert_int_equal(kvf_kv_seq_free(&s, &err), KVF_OK);
    kvf_kv_seq_init(&u, p, root);
    write_seq(&u, b, 32);
    e.now = 1050;
    assert_int_equal(kvf_kv_seq_free(&u, &err), KVF_OK);
    e.now = 1100;
    int32_t n = -1;
    kvf_kv_pool_expire(p, &n);
    assert_int_equal(n, 0); /* exactly at the retention: kept */
    assert_int_equal(kvf_kv_prefix_probe(p, root, a, 32), 2);
    e.now = 1101;
    assert_int_equal(kvf_kv_prefix_probe(p, root, a, 32), 0); /* expired: a miss */
    assert_int_equal(kvf_kv_prefix_probe(p, root, b, 32), 2);
    int n_ev = e.n_ev;
    kvf_kv_pool_expire(p, &n);
    assert_int_equal(n, 2);
    assert_int_equal(e.n_ev, n_ev + 2);
    assert_int_equal(e.ev[n_ev].type, KVF_KV_EVENT_REMOVED);
    kvf_kv_seq *none[] = {NULL};
    kt_check(p, none, 0);
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.cached, 2);
    assert_int_equal(st.free, 6);
    assert_int_equal(st.expired, 2);
    /* a lookup meeting an expired block drops it and misses */
    e.now = 1200;
    assert_int_equal(kvf_kv_seq_reset(&s, root, &err), KVF_OK); /* reuses the released slot */
    int64_t hit = -1;
    assert_int_equal(kvf_kv_prefix_lookup(&s, b, 32, &hit, &err), KVF_OK);
    assert_int_equal(hit, 0);
    kvf_kv_seq *alls[] = {&s};
    kt_check(p, alls, 1);
    kvf_kv_seq_fini(&s);
    kvf_kv_seq_fini(&u);
    kvf_kv_pool_destroy(p);
}

static void test_pinning(void **state)
{
    kt_env e;
    kt_open(&e, 4, BS, 100);
    kvf_kv_pool *p = e.pool;
    uint64_t root = root_of(NULL);
    int32_t sys[32];
    kt_tokens(sys, 32, 9);
    kvf_kv_seq s;
    kvf_err err = {0};
    kvf_kv_seq_init(&s, p, root);
    write_seq(&s, sys, 32);
    int32_t n = -1;
    assert_int_equal(kvf_kv_prefix_pin(p, root, sys, 32, &n, &err), KVF_OK);
    assert_int_equal(n, 2);
    kvf_kv_seq *alls[] = {&s};
    kt_check(p, alls, 1);
    assert_int_equal(kvf_kv_seq_free(&s, &err), KVF_OK);
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.pinned, 2);
    assert_int_equal(st.cached, 0);
    assert_int_equal(kvf_kv_pool_available(p), 2);
    kvf_kv_seq *none[] = {NULL};
    kt_check(p, none, 0);
    /* neither retention, clearing nor pressure removes them */
    e.now += 1000;
    kvf_kv_pool_expire(p, &n);
    assert_int_equal(n, 0);
    kvf_kv_pool_clear_cache(p, &n);
    assert_int_equal(n, 0);
    kvf_kv_seq w;
    kvf_kv_seq_init(&w, p, root);
    assert_int_equal(kvf_kv_seq_prepare_write(&w, 33, &err), KVF_ERR_FULL);
    assert_int_equal(kvf_kv_seq_prepare_write(&w, 32, &err), KVF_OK);
    assert_int_equal(kvf_kv_prefix_probe(p, root, sys, 32), 2);
    /* a pinned prefix is still shared by lookups */
    kvf_kv_seq r;
    kvf_kv_seq_init(&r, p, root);
    int64_t hit;
    assert_int_equal(kvf_kv_prefix_lookup(&r, sys, 32, &hit, &err), KVF_OK);
    assert_int_equal(hit, 32);
    kvf_kv_seq *all2[] = {&w, &r};
    kt_check(p, all2, 2);
    /* unpinned, they become ordinary cached blocks once idle */
    assert_int_equal(kvf_kv_prefix_unpin(p, root, sys, 32, &n, &err), KVF_OK);
    assert_int_equal(n, 2);
    assert_int_equal(kvf_kv_seq_free(&r, &err), KVF_OK);
    kvf_kv_seq *allw[] = {&w};
    kt_check(p, allw, 1);
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.pinned, 0);
    assert_int_equal(st.cached, 2);
    assert_int_equal(kvf_kv_prefix_unpin(p, root, sys, 32, &n, &err), KVF_OK);
    assert_int_equal(n, 0); /* nothing left pinned */
    kvf_kv_pool_clear_cache(p, &n);
    assert_int_equal(n, 2);
    kt_check(p, allw, 1);
    kvf_kv_seq_fini(&s);
    kvf_kv_seq_fini(&r);
    kvf_kv_seq_fini(&w);
    kvf_kv_pool_destroy(p);
}

static void test_copy_on_write(void **state)
{
    kt_env e;
    kt_open(&e, 8, BS, 0);
    kvf_kv_pool *p = e.pool;
    kvf_kv_seq a, b;
    kvf_err err = {0};
    kvf_kv_seq_init(&a, p, 1);
    kvf_kv_seq_init(&b, p, 1);
    kvf_kv_seq *all[] = {&a, &b};
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 20, &err), KVF_OK);
    for (int64_t i = 0; i < 20; i++)
        *kt_slot(&a, i) = 0xA000 + (uint64_t)i;
    assert_int_equal(kvf_kv_seq_fork(&a, &b, &err), KVF_OK);
    assert_int_equal(b.n_tokens, 20);
    assert_int_equal(b.blocks[1], a.blocks[1]);
    kt_check(p, all, 2);
    /* fork into a non-empty child is refused */
    assert_int_equal(kvf_kv_seq_fork(&a, &b, &err), KVF_ERR_STATE);
    /* b writes position 20: its partial block is copied first */
    int32_t shared = a.blocks[1];
    assert_int_equal(kvf_kv_seq_prepare_write(&b, 1, &err), KVF_OK);
    assert_int_not_equal(b.blocks[1], shared);
    assert_int_equal(a.blocks[1], shared);
    assert_int_equal(b.blocks[0], a.blocks[0]); /* the full block stays shared */
    kt_check(p, all, 2);
    for (int64_t i = 0; i < 20; i++)
        assert_true(*kt_slot(&b, i) == 0xA000 + (uint64_t)i); /* the copy carries the data */
    *kt_slot(&b, 20) = 0xB020;
    *kt_slot(&b, 19) = 0xB019; /* even overwriting b's copy leaves a alone */
    for (int64_t i = 0; i < 20; i++)
        assert_true(*kt_slot(&a, i) == 0xA000 + (uint64_t)i);
    /* a now owns its block alone: no copy */
    kvf_kv_pool_stats st;
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.cow_copies, 1);
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 1, &err), KVF_OK);
    assert_int_equal(a.blocks[1], shared);
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.cow_copies, 1);
    kt_check(p, all, 2);
    /* write of 0 tokens never copies */
    kvf_kv_seq c;
    kvf_kv_seq_init(&c, p, 1);
    kvf_kv_seq *all3[] = {&a, &b, &c};
    assert_int_equal(kvf_kv_seq_fork(&a, &c, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_prepare_write(&c, 0, &err), KVF_OK);
    assert_int_equal(c.blocks[1], a.blocks[1]);
    kt_check(p, all3, 3);
    assert_int_equal(kvf_kv_seq_free(&a, &err), KVF_OK);
    kt_check(p, all3, 3);
    assert_int_equal(kvf_kv_seq_free(&b, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_free(&c, &err), KVF_OK);
    kt_check(p, all3, 3);
    kvf_kv_pool_get_stats(p, &st);
    assert_int_equal(st.free, 8);
    for (int i = 0; i < 3; i++)
        kvf_kv_seq_fini(all3[i]);
    kvf_kv_pool_destroy(p);
}

/* Siblings that all write into their shared partial block need one copy fewer than writers. */
static void test_cow_exact_step(void **state)
{
    kt_env e;
    kt_open(&e, 4, BS, 0);
    kvf_kv_pool *p = e.pool;
    kvf_kv_seq s[3];
    kvf_err err = {0};
    for (int i = 0; i < 3; i++)
        kvf_kv_seq_init(&s[i], p, 1);
    assert_int_equal(kvf_kv_seq_prepare_write(&s[0], 20, &err), KVF_OK); /* 2 blocks */
    assert_int_equal(kvf_kv_seq_fork(&s[0], &s[1], &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_fork(&s[0], &s[2], &err), KVF_OK);
    kvf_kv_seq *all[] = {&s[0], &s[1], &s[2]};
    int64_t one[] = {1, 1, 1};
    /* 3 holders all writing: 2 copies, and exactly 2 blocks are available */
    assert_int_equal(kvf_kv_pool_step_need(p, all, one, 3), 2);
    assert_int_equal(kvf_kv_pool_alloc_step(p, all, one, 3, &err), KVF_OK);
    assert_int_equal(kvf_kv_pool_available(p), 0);
    assert_true(s[0].blocks[1] != s[1].blocks[1] && s[1].blocks[1] != s[2].blocks[1] &&
                s[0].blocks[1] != s[2].blocks[1]);
    kt_check(p, all, 3);
    for (int i = 0; i < 3; i++)
        kvf_kv_seq_fini(&s[i]);
    kvf_kv_seq *none[] = {NULL};
    kt_check(p, none, 0);
    /* 2 writers of 3 holders copy twice: with one block free the step fails whole */
    for (int i = 0; i < 3; i++)
        kvf_kv_seq_init(&s[i], p, 1);
    kvf_kv_seq filler;
    kvf_kv_seq_init(&filler, p, 1);
    assert_int_equal(kvf_kv_seq_prepare_write(&s[0], 20, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_prepare_write(&filler, 16, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_fork(&s[0], &s[1], &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_fork(&s[0], &s[2], &err), KVF_OK);
    kvf_kv_seq *two[] = {&s[0], &s[1]};
    assert_int_equal(kvf_kv_pool_step_need(p, two, one, 2), 2);
    assert_int_equal(kvf_kv_pool_alloc_step(p, two, one, 2, &err), KVF_ERR_FULL);
    assert_int_equal(s[0].n_tokens, 20);
    assert_int_equal(s[1].blocks[1], s[0].blocks[1]);
    kvf_kv_seq *all4[] = {&s[0], &s[1], &s[2], &filler};
    kt_check(p, all4, 4);
    for (int i = 0; i < 3; i++)
        kvf_kv_seq_fini(&s[i]);
    kvf_kv_seq_fini(&filler);
    kvf_kv_pool_destroy(p);
}

static void test_adopt_for_remote_writer(void **state)
{
    kt_env e;
    kt_open(&e, 8, BS, 0);
    kvf_kv_pool *p = e.pool;
    uint64_t root = root_of(NULL);
    int32_t old[16], toks[40];
    kt_tokens(old, 16, 3);
    kt_tokens(toks, 40, 4);
    kvf_err err = {0};
    kvf_kv_seq o, s, u;
    kvf_kv_seq_init(&o, p, root);
    write_seq(&o, old, 16);
    int32_t cached_id = o.blocks[0];
    assert_int_equal(kvf_kv_seq_free(&o, &err), KVF_OK); /* block cached_id is CACHED now */
    kvf_kv_seq_init(&u, p, root);
    assert_int_equal(kvf_kv_seq_prepare_write(&u, 16, &err), KVF_OK);
    int32_t used_id = u.blocks[0];
    kvf_kv_seq_init(&s, p, root);
    kvf_kv_seq *all[] = {&s, &u};
    /* refused: foreign, in use, listed twice, wrong token count; nothing changes */
    int32_t foreign[] = {5, 8};
    assert_int_equal(kvf_kv_seq_adopt(&s, foreign, 2, 32, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "foreign block 8"));
    int32_t inuse[] = {6, used_id};
    assert_int_equal(kvf_kv_seq_adopt(&s, inuse, 2, 32, &err), KVF_ERR_STATE);
    assert_non_null(strstr(err.msg, "in use"));
    int32_t twice[] = {6, 6};
    assert_int_equal(kvf_kv_seq_adopt(&s, twice, 2, 32, &err), KVF_ERR_STATE);
    assert_non_null(strstr(err.msg, "listed twice"));
    int32_t ok[] = {6, cached_id, 7};
    assert_int_equal(kvf_kv_seq_adopt(&s, ok, 3, 32, &err), KVF_ERR_INVALID);
    kt_check(p, all, 2);
    assert_int_equal(s.n_blocks, 0);
    /* accepted: the cached block is evicted with a REMOVED event */
    int n_ev = e.n_ev;
    assert_int_equal(kvf_kv_seq_adopt(&s, ok, 3, 40, &err), KVF_OK);
    assert_int_equal(s.n_tokens, 40);
    assert_int_equal(s.blocks[1], cached_id);
    assert_int_equal(e.n_ev, n_ev + 1);
    assert_int_equal(e.ev[n_ev].type, KVF_KV_EVENT_REMOVED);
    kt_check(p, all, 2);
    /* the partial last block now blocks another adopt */
    assert_int_equal(kvf_kv_seq_adopt(&s, foreign, 1, 16, &err), KVF_ERR_STATE);
    /* the data lands, then the blocks are registered */
    assert_int_equal(kvf_kv_seq_commit(&s, toks, 40, &err), KVF_OK);
    assert_int_equal(e.n_ev, n_ev + 3);
    assert_int_equal(e.ev[n_ev + 1].block, 6);
    assert_int_equal(e.ev[n_ev + 2].block, cached_id);
    assert_int_equal(kvf_kv_prefix_probe(p, root, toks, 40), 2);
    assert_int_equal(kvf_kv_prefix_probe(p, root, old, 16), 0);
    kt_check(p, all, 2);
    kvf_kv_seq_fini(&o);
    kvf_kv_seq_fini(&s);
    kvf_kv_seq_fini(&u);
    kvf_kv_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_errors),
        cmocka_unit_test(test_growth_and_exact_fit),
        cmocka_unit_test(test_alloc_step_all_or_nothing),
        cmocka_unit_test(test_double_free_and_foreign),
        cmocka_unit_test(test_prefix_hits_and_events),
        cmocka_unit_test(test_salt_isolation),
        cmocka_unit_test(test_forged_collision),
        cmocka_unit_test(test_lru_order),
        cmocka_unit_test(test_retention),
        cmocka_unit_test(test_pinning),
        cmocka_unit_test(test_copy_on_write),
        cmocka_unit_test(test_cow_exact_step),
        cmocka_unit_test(test_adopt_for_remote_writer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
