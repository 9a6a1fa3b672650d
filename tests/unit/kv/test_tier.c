/* test_tier.c: kv/tier.h under a pool: demotion on eviction and promotion on lookup give the
 * same bytes, LRU order inside the host tier, one chain found whole across pool, host and disk,
 * a hash collision in a tier is a miss, a corrupted or truncated disk file is a miss, events
 * carry their tiers in order, snapshots list tier blocks. Every case runs twice: promotions on
 * the tiers' copy thread (the default) and synchronous. Then the copy thread's own rules: a
 * promotion in flight is invisible to other lookups, a sequence freed while its copies run
 * leaves its blocks LANDING (never FREE) until they end, a disk slot found corrupt by the thread
 * cuts the sequence's prefix there. Invariants after every step, and every block back in its
 * pool at the end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "kvtest.h"
#include "kv/tier.h"

#define BS 4

static bool g_sync; /* this round's tiers promote synchronously */

/* A gate the copy thread waits at before each copy (kvf_kv_tier_cfg.copy_hook) while closed,
 * at most 10 s (a broken variant fails instead of hanging). */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool closed;
    int waiting; /* copies held at the gate now */
} gate;

static gate g_gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, 0};

static void gate_hook(void *ctx, kvf_kv_tier_kind tier, int32_t block)
{
    (void)tier, (void)block;
    gate *g = ctx;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 10;
    pthread_mutex_lock(&g->mu);
    g->waiting++;
    pthread_cond_broadcast(&g->cv);
    while (g->closed && pthread_cond_timedwait(&g->cv, &g->mu, &ts) == 0) {
    }
    g->waiting--;
    pthread_mutex_unlock(&g->mu);
}

static void gate_set(bool closed)
{
    pthread_mutex_lock(&g_gate.mu);
    g_gate.closed = closed;
    pthread_cond_broadcast(&g_gate.cv);
    pthread_mutex_unlock(&g_gate.mu);
}

typedef struct env {
    kt_env e;
    kvf_kv_tier *tier;
    char dir[64], sub[96];
    uint64_t root;
} env;

/* For one case: the pool's memory ops (NULL: host) and the tiers' on_promote (NULL: none). */
static const kvf_kv_mem_ops *g_mem;
static void (*g_on_promote)(void *ctx, kvf_kv_tier_kind tier, double seconds);
static void *g_promote_ctx;

static void env_open(env *v, int32_t n_blocks, int64_t host_blocks, int64_t disk_slots)
{
    memset(v, 0, sizeof *v);
    v->e.now = 1000;
    kvf_kv_pool_cfg c = kt_cfg(&v->e, n_blocks, BS);
    kvf_kv_tier_cfg tc = {.host_bytes = host_blocks * c.layout.block_bytes,
                          .synchronous = g_sync, .copy_hook = gate_hook, .hook_ctx = &g_gate,
                          .on_promote = g_on_promote, .promote_ctx = g_promote_ctx};
    c.mem = g_mem;
    if (disk_slots > 0) {
        snprintf(v->dir, sizeof v->dir, "/tmp/kvf-tier-XXXXXX");
        assert_non_null(mkdtemp(v->dir));
        snprintf(v->sub, sizeof v->sub, "%s/d", v->dir); /* missing: the tier makes it */
        tc.disk_dir = v->sub;
        /* one slot: header, tokens, bytes (kvf_kv_tier_disk_slot_bytes) */
        tc.disk_bytes = disk_slots * (48 + BS * 4 + c.layout.block_bytes);
    }
    kvf_err err = {0};
    kvf_status st = kvf_kv_tier_create(&tc, &c.layout, &v->tier, &err);
    if (st != KVF_OK)
        fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(st, KVF_OK);
    c.tier = v->tier;
    assert_int_equal(kvf_kv_pool_create(&c, &v->e.pool, &err), KVF_OK);
    v->root = kvf_kv_hash_root("tier-model", NULL, 0);
}

/* Completes every promotion in flight (none synchronous). */
static void land_all(env *v)
{
    for (int i = 0; i < 10000; i++) {
        kvf_kv_pool_stats ps;
        kvf_kv_pool_get_stats(v->e.pool, &ps);
        if (ps.promoting == 0)
            return;
        kvf_kv_pool_wait_promotions(v->e.pool, 1000000000);
    }
    fail_msg("promotions never completed");
}

static void env_close(env *v)
{
    land_all(v);
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(v->e.pool, &ps);
    assert_int_equal(ps.free + ps.cached, ps.total); /* every block back in its pool */
    kt_check(v->e.pool, NULL, 0);
    kvf_kv_pool_destroy(v->e.pool);
    kvf_kv_tier_destroy(v->tier);
    if (v->sub[0]) {
        rmdir(v->sub);
        rmdir(v->dir);
    }
}

/* The word w of block i of a prompt whose tokens were made with seed. */
static uint32_t word(int32_t seed, int64_t i, int64_t w)
{
    return (uint32_t)seed * 1000003u + (uint32_t)i * 1009u + (uint32_t)w;
}

/* Writes seed's stamp into every block of seq from block `from` on. */
static void stamp(kvf_kv_seq *s, int32_t seed, int32_t from)
{
    const kvf_kv_layout *l = kvf_kv_pool_layout(s->pool);
    char *base = kvf_kv_pool_base(s->pool);
    for (int32_t i = from; i < s->n_blocks; i++) {
        uint32_t *b = (uint32_t *)(base + (int64_t)s->blocks[i] * l->block_bytes);
        for (int64_t w = 0; w < l->block_bytes / 4; w++)
            b[w] = word(seed, i, w);
    }
}

/* Whether block i of seq holds seed's stamp. */
static bool stamped(const kvf_kv_seq *s, int32_t seed, int32_t i)
{
    const kvf_kv_layout *l = kvf_kv_pool_layout(s->pool);
    const uint32_t *b = (const uint32_t *)((char *)kvf_kv_pool_base(s->pool) +
                                           (int64_t)s->blocks[i] * l->block_bytes);
    for (int64_t w = 0; w < l->block_bytes / 4; w++)
        if (b[w] != word(seed, i, w))
            return false;
    return true;
}

/* Computes a prompt of n_blocks full blocks (seed's tokens and bytes), registers it and
 * releases it: its blocks end CACHED (evicting/demoting others as allocation does). */
static void put_prompt(env *v, int32_t seed, int32_t n_blocks)
{
    int32_t toks[64];
    kt_tokens(toks, (int64_t)n_blocks * BS, seed);
    kvf_kv_seq s;
    kvf_err err = {0};
    kvf_kv_seq_init(&s, v->e.pool, v->root);
    assert_int_equal(kvf_kv_seq_prepare_write(&s, (int64_t)n_blocks * BS, &err), KVF_OK);
    stamp(&s, seed, 0);
    kvf_kv_seq *all[] = {&s};
    kt_check(v->e.pool, all, 1);
    assert_int_equal(kvf_kv_seq_commit(&s, toks, (int64_t)n_blocks * BS, &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_free(&s, &err), KVF_OK);
    kt_check(v->e.pool, NULL, 0);
    v->e.now += 10;
    kvf_kv_seq_fini(&s);
}

/* Looks seed's prompt up, lets its promotions land; returns the blocks the sequence then holds
 * and checks each one's bytes. The sequence is freed again. */
static int32_t get_prompt(env *v, int32_t seed, int32_t n_blocks)
{
    int32_t toks[64];
    kt_tokens(toks, (int64_t)n_blocks * BS, seed);
    kvf_kv_seq s;
    kvf_err err = {0};
    kvf_kv_seq_init(&s, v->e.pool, v->root);
    int64_t hit = -1;
    assert_int_equal(kvf_kv_prefix_lookup(&s, toks, (int64_t)n_blocks * BS, &hit, &err), KVF_OK);
    kvf_kv_seq *all[] = {&s};
    kt_check(v->e.pool, all, 1);
    if (g_sync)
        assert_int_equal(kvf_kv_seq_promotions_pending(&s), 0);
    while (kvf_kv_seq_promotions_pending(&s) > 0) {
        kvf_kv_pool_wait_promotions(v->e.pool, 1000000000);
        kt_check(v->e.pool, all, 1);
    }
    assert_true(s.n_tokens <= hit);
    hit = s.n_tokens;
    for (int32_t i = 0; i < s.n_blocks; i++)
        assert_true(stamped(&s, seed, i));
    assert_int_equal(kvf_kv_seq_free(&s, &err), KVF_OK);
    kt_check(v->e.pool, NULL, 0);
    v->e.now += 10;
    kvf_kv_seq_fini(&s);
    return (int32_t)(hit / BS);
}

static uint64_t hash_of(env *v, int32_t seed, int32_t i)
{
    int32_t toks[64];
    kt_tokens(toks, (int64_t)(i + 1) * BS, seed);
    uint64_t h = v->root;
    for (int32_t k = 0; k <= i; k++)
        h = kvf_kv_hash_block(h, toks + k * BS, BS);
    return h;
}

/* Index of the first event from `from` on with this type, hash and tier; -1 when none. */
static int find_ev(env *v, int from, kvf_kv_event_type type, uint64_t h, int32_t tier)
{
    for (int i = from; i < v->e.n_ev; i++)
        if (v->e.ev[i].type == type && v->e.ev[i].hash == h && v->e.ev[i].tier == tier)
            return i;
    return -1;
}

static void test_create_errors(void **state)
{
    (void)state;
    kvf_kv_layout l;
    kvf_err err = {0};
    kvf_kv_tier *t = NULL;
    assert_int_equal(kvf_kv_layout_init(1, 1, 2, BS, KVF_DTYPE_F32, &l, &err), KVF_OK);
    kvf_kv_tier_cfg c = {.host_bytes = l.block_bytes - 1};
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "host tier of 63 bytes"));
    c = (kvf_kv_tier_cfg){.host_bytes = l.block_bytes, .disk_bytes = 1 << 20};
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "no directory"));
    c = (kvf_kv_tier_cfg){.host_bytes = l.block_bytes, .disk_dir = "/tmp", .disk_bytes = 10};
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "disk tier of 10 bytes"));
    c = (kvf_kv_tier_cfg){.host_bytes = l.block_bytes, .disk_dir = "/proc/nope/x",
                          .disk_bytes = 1 << 20};
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_ERR_IO);
    assert_non_null(strstr(err.msg, "/proc/nope/x"));
    assert_null(t);
    /* a pool of another block size cannot use them */
    c = (kvf_kv_tier_cfg){.host_bytes = 4 * l.block_bytes};
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_OK);
    kt_env e;
    kvf_kv_pool_cfg pc = kt_cfg(&e, 4, 8);
    pc.tier = t;
    kvf_kv_pool *p = NULL;
    assert_int_equal(kvf_kv_pool_create(&pc, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "cannot serve a pool"));
    kvf_kv_tier_destroy(t);
}

/* Host memory ops whose to_host (a demotion's copy out) takes 40 ms. */
static kvf_status slow_to_host(void *ctx, void *host_dst, const void *base, int64_t block_bytes,
                               int32_t block, kvf_err *err)
{
    struct timespec ts = {0, 40 * 1000 * 1000};
    nanosleep(&ts, NULL);
    return kvf_kv_mem_host.to_host(ctx, host_dst, base, block_bytes, block, err);
}

typedef struct promote_log {
    int n;
    double max_s;
} promote_log;

static void log_promote(void *ctx, kvf_kv_tier_kind tier, double seconds)
{
    (void)tier;
    promote_log *pl = ctx;
    pl->n++;
    if (seconds > pl->max_s)
        pl->max_s = seconds;
}

/* The promotion time on_promote reports (the router prices tier hits by it) holds no other
 * block's demotion made to free the pool block it lands in: with 40 ms demotions, each of the
 * four promotions (each evicting and demoting one block) is reported well under 40 ms. */
static void test_promote_time_excludes_demotion(void **state)
{
    (void)state;
    kvf_kv_mem_ops slow = kvf_kv_mem_host;
    slow.to_host = slow_to_host;
    promote_log pl = {0};
    g_mem = &slow;
    g_on_promote = log_promote;
    g_promote_ctx = &pl;
    env v;
    env_open(&v, 4, 8, 0);
    g_mem = NULL;
    g_on_promote = NULL;
    g_promote_ctx = NULL;
    put_prompt(&v, 1, 4);
    put_prompt(&v, 2, 4); /* prompt 1 goes down into the host tier */
    assert_int_equal(get_prompt(&v, 1, 4), 4); /* each promotion demotes a block of prompt 2 */
    assert_int_equal(pl.n, 4);
    assert_true(pl.max_s < 0.020);
    env_close(&v);
}

/* Sizes beyond the machine are refused at create, naming the flag and the value: host bytes
 * above physical memory, disk bytes above the free space of the directory's filesystem. */
static void test_create_beyond_machine(void **state)
{
    (void)state;
    kvf_kv_layout l;
    kvf_err err = {0};
    kvf_kv_tier *t = NULL;
    /* 32 KiB blocks: a machine's memory is far fewer blocks than the tier's INT32_MAX / 2 cap */
    assert_int_equal(kvf_kv_layout_init(1, 1, 1024, BS, KVF_DTYPE_F32, &l, &err), KVF_OK);
    int64_t phys = (int64_t)sysconf(_SC_PHYS_PAGES) * (int64_t)sysconf(_SC_PAGESIZE);
    kvf_kv_tier_cfg c = {.host_bytes = phys + 64 * l.block_bytes};
    char want[64];
    snprintf(want, sizeof want, "--kv-host-memory=%lld", (long long)c.host_bytes);
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_ERR_INVALID);
    assert_null(t);
    assert_non_null(strstr(err.msg, want));
    assert_non_null(strstr(err.msg, "physical memory"));

    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvf-tier-XXXXXX");
    assert_non_null(mkdtemp(dir));
    struct statvfs vs;
    assert_int_equal(statvfs(dir, &vs), 0);
    int64_t avail = (int64_t)vs.f_bavail * (int64_t)vs.f_frsize;
    int64_t slot = 48 + BS * 4 + l.block_bytes;
    c = (kvf_kv_tier_cfg){.host_bytes = l.block_bytes, .disk_dir = dir,
                          .disk_bytes = 2 * avail + 1024 * slot}; /* room for others' churn */
    if (c.disk_bytes / slot <= INT32_MAX / 2) { /* else the slot cap refuses it first */
        snprintf(want, sizeof want, "--kv-disk-bytes=%lld", (long long)c.disk_bytes);
        err = (kvf_err){0};
        assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_ERR_INVALID);
        assert_null(t);
        assert_non_null(strstr(err.msg, want));
        assert_non_null(strstr(err.msg, "free space"));
    }
    /* within both, it is made */
    c.disk_bytes = 4 * slot;
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_OK);
    kvf_kv_tier_destroy(t);
    rmdir(dir);
}

/* Eviction demotes (STORED host, no REMOVED); lookup promotes the same bytes back (STORED pool),
 * demoting what it evicts in turn; clear_cache removes from every tier. */
static void test_demote_promote_bytes_and_events(void **state)
{
    (void)state;
    env v;
    env_open(&v, 4, 8, 0);
    put_prompt(&v, 1, 4);
    assert_int_equal(v.e.n_ev, 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(v.e.ev[i].tier, KVF_KV_TIER_POOL);
    put_prompt(&v, 2, 4); /* evicts every block of prompt 1 into the host tier */
    for (int32_t i = 0; i < 4; i++) {
        int a = find_ev(&v, 4, KVF_KV_EVENT_STORED, hash_of(&v, 1, i), KVF_KV_TIER_HOST);
        assert_true(a >= 0);
        assert_int_equal(v.e.ev[a].block, -1);
        assert_int_equal(find_ev(&v, 0, KVF_KV_EVENT_REMOVED, hash_of(&v, 1, i), KVF_KV_TIER_POOL),
                         -1);
        /* moved down only after it was stored in the pool */
        assert_true(find_ev(&v, 0, KVF_KV_EVENT_STORED, hash_of(&v, 1, i), KVF_KV_TIER_POOL) < a);
    }
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].demoted, 4);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].used, 4);
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, (int32_t[16]){0}, 0), 0);
    int n0 = v.e.n_ev;
    assert_int_equal(get_prompt(&v, 1, 4), 4); /* all four promoted, bytes checked */
    for (int32_t i = 0; i < 4; i++) {
        int a = find_ev(&v, n0, KVF_KV_EVENT_STORED, hash_of(&v, 1, i), KVF_KV_TIER_POOL);
        int b = find_ev(&v, n0, KVF_KV_EVENT_STORED, hash_of(&v, 2, 3 - i), KVF_KV_TIER_HOST);
        assert_true(a >= 0 && b >= 0 && b < a); /* each promotion demoted one of prompt 2 */
    }
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].hits, 4);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].promoted, 4);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].bytes_promoted, 4 * 64);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].used, 4); /* prompt 2 now */
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(v.e.pool, &ps);
    assert_int_equal(ps.promoted, 4);
    assert_int_equal(ps.demoted, 8);
    assert_int_equal(ps.removed, 0);
    /* and back: prompt 2 from the host tier */
    assert_int_equal(get_prompt(&v, 2, 4), 4);
    /* clear: both prompts go, from every tier */
    n0 = v.e.n_ev;
    int32_t n = 0;
    kvf_kv_pool_clear_cache(v.e.pool, &n);
    assert_int_equal(n, 8);
    kt_check(v.e.pool, NULL, 0);
    assert_true(find_ev(&v, n0, KVF_KV_EVENT_REMOVED, hash_of(&v, 1, 0), KVF_KV_TIER_HOST) >= 0);
    assert_true(find_ev(&v, n0, KVF_KV_EVENT_REMOVED, hash_of(&v, 2, 0), KVF_KV_TIER_POOL) >= 0);
    assert_int_equal(get_prompt(&v, 1, 4), 0);
    env_close(&v);
}

/* The host tier drops its least recently demoted block first (REMOVED: no disk below). */
static void test_host_lru(void **state)
{
    (void)state;
    env v;
    env_open(&v, 2, 2, 0);
    for (int32_t s = 1; s <= 5; s++)
        put_prompt(&v, s, 1);
    /* pool: 4, 5; host: 2, 3 (1 was the host's oldest when 3 came down) */
    int32_t t1[BS];
    kt_tokens(t1, BS, 1);
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, t1, BS), 0);
    int r = find_ev(&v, 0, KVF_KV_EVENT_REMOVED, hash_of(&v, 1, 0), KVF_KV_TIER_HOST);
    assert_true(r >= 0);
    assert_true(r > find_ev(&v, 0, KVF_KV_EVENT_STORED, hash_of(&v, 1, 0), KVF_KV_TIER_HOST));
    assert_int_equal(find_ev(&v, 0, KVF_KV_EVENT_REMOVED, hash_of(&v, 2, 0), KVF_KV_TIER_HOST), -1);
    for (int32_t s = 2; s <= 5; s++) {
        int32_t t[BS];
        kt_tokens(t, BS, s);
        assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, t, BS), 1);
    }
    /* synchronous: promoting 2 frees its slot first, demoting 4 then takes it; 3 stays: the
     * oldest left. Copy thread: 2's slot is held until its copy ends, so 4's demotion drops 3 */
    assert_int_equal(get_prompt(&v, 2, 1), 1);
    int32_t t3[BS];
    kt_tokens(t3, BS, 3);
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, t3, BS), g_sync ? 1 : 0);
    put_prompt(&v, 6, 1); /* pool evicts 5 -> host full -> 3 goes (oldest) */
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, t3, BS), 0);
    assert_int_equal(get_prompt(&v, 4, 1), 1);
    env_close(&v);
}

/* Prompt 1's chain ends up in the pool, the host tier and the disk tier at once; one lookup
 * finds it whole (token-verified, same bytes); the snapshot lists each where it is. */
static void test_chain_across_tiers(void **state)
{
    (void)state;
    env v;
    env_open(&v, 4, 2, 4);
    struct stat sb;
    assert_int_equal(stat(v.sub, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0700);
    put_prompt(&v, 1, 4);
    put_prompt(&v, 2, 3); /* evicts 1's blocks 3, 2, 1: 3 then goes on to disk */
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].used, 2);
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].used, 1);
    assert_true(find_ev(&v, 0, KVF_KV_EVENT_STORED, hash_of(&v, 1, 3), KVF_KV_TIER_DISK) >= 0);
    /* the snapshot: 4 pool blocks (1's block 0, 2's three), 2 host, 1 disk */
    kt_env snap;
    memset(&snap, 0, sizeof snap);
    assert_int_equal(kvf_kv_prefix_snapshot(v.e.pool, kt_on_event, &snap), 7);
    int per[3] = {0};
    for (int i = 0; i < snap.n_ev; i++)
        per[snap.ev[i].tier]++;
    assert_int_equal(per[0], 4);
    assert_int_equal(per[1], 2);
    assert_int_equal(per[2], 1);
    int32_t toks[16];
    kt_tokens(toks, 16, 1);
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, toks, 16), 4);
    assert_int_equal(get_prompt(&v, 1, 4), 4);
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].promoted, 2);
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].promoted, 1);
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].corrupt, 0);
    /* synchronous: prompt 2 went down in turn, and comes back too. Copy thread: every tier
     * slot was pinned by 1's copies while 2's blocks left the pool, so they were dropped */
    assert_int_equal(get_prompt(&v, 2, 3), g_sync ? 3 : 0);
    env_close(&v);
}

/* A tier entry under the right hash with other tokens (or another parent) is a miss. */
static void test_collision_in_tier(void **state)
{
    (void)state;
    env v;
    env_open(&v, 1, 4, 0);
    put_prompt(&v, 1, 1);
    put_prompt(&v, 2, 1); /* 1 -> host */
    int32_t other[BS];
    kt_tokens(other, BS, 77);
    uint64_t forged = hash_of(&v, 1, 0);
    kvf_kv_seq s;
    kvf_err err = {0};
    kvf_kv_seq_init(&s, v.e.pool, v.root);
    int32_t hit = -1;
    assert_int_equal(kvf_kv_prefix_lookup_hashes(&s, &forged, other, 1, &hit, &err), KVF_OK);
    assert_int_equal(hit, 0);
    kvf_kv_seq *all[] = {&s};
    kt_check(v.e.pool, all, 1);
    kvf_kv_seq_fini(&s);
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].mismatches, 1);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].promoted, 0);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].used, 1);
    /* the real tokens still hit */
    assert_int_equal(get_prompt(&v, 1, 1), 1);
    env_close(&v);
}

/* Flips one byte of every disk slot's block bytes, or cuts the file: reads are refused, the
 * lookup misses (the slot dropped with a REMOVED event), and recomputing works. */
static void damage_and_check(env *v, bool truncate_file)
{
    put_prompt(v, 1, 1);
    put_prompt(v, 2, 1);
    put_prompt(v, 3, 1); /* pool 3; host 2; disk 1 */
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(v->tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].used, 1);
    const char *path = kvf_kv_tier_disk_path(v->tier);
    int64_t sb = kvf_kv_tier_disk_slot_bytes(v->tier);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    if (truncate_file) {
        assert_int_equal(ftruncate(fd, sb / 2), 0);
    } else {
        struct stat st;
        assert_int_equal(fstat(fd, &st), 0);
        for (int64_t off = sb - 5; off < st.st_size; off += sb) {
            unsigned char c;
            assert_int_equal(pread(fd, &c, 1, off), 1);
            c ^= 0x40;
            assert_int_equal(pwrite(fd, &c, 1, off), 1);
        }
    }
    close(fd);
    int n0 = v->e.n_ev;
    int64_t corrupt0 = ts.tier[KVF_KV_TIER_DISK].corrupt;
    assert_int_equal(get_prompt(v, 1, 1), 0);
    kvf_kv_tier_get_stats(v->tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].corrupt, corrupt0 + 1);
    /* synchronous: the read is refused before a pool block is taken; copy thread: the pool
     * block taken demoted 3, which pushed 2 down to disk */
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].used, g_sync ? 0 : 1);
    assert_true(find_ev(v, n0, KVF_KV_EVENT_REMOVED, hash_of(v, 1, 0), KVF_KV_TIER_DISK) >= 0);
    /* computed again, it is a hit again (the right bytes: get_prompt checks them) */
    put_prompt(v, 1, 1);
    assert_int_equal(get_prompt(v, 1, 1), 1);
    kvf_kv_pool_clear_cache(v->e.pool, NULL);
    kt_check(v->e.pool, NULL, 0);
}

static void test_disk_corrupt_and_truncated(void **state)
{
    (void)state;
    env v;
    env_open(&v, 1, 1, 2);
    damage_and_check(&v, false);
    damage_and_check(&v, true);
    env_close(&v);
}

/* A block computed again while a tier holds its hash moves to the pool (one place only). */
static void test_recomputed_block_leaves_tier(void **state)
{
    (void)state;
    env v;
    env_open(&v, 1, 2, 0);
    put_prompt(&v, 1, 1);
    put_prompt(&v, 2, 1); /* 1 -> host */
    /* a sequence that skips the lookup and computes prompt 1 again */
    put_prompt(&v, 1, 1); /* 2 -> host; 1 registered in the pool, its host copy gone */
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].used, 1);
    assert_int_equal(get_prompt(&v, 1, 1), 1);
    assert_int_equal(get_prompt(&v, 2, 1), 1);
    env_close(&v);
}

/* One block's whole life in events: STORED pool, STORED host (demoted), STORED disk (the host
 * tier's victim), REMOVED (the disk tier's victim: gone from every tier), nothing else. */
static void test_events_through_every_tier(void **state)
{
    (void)state;
    env v;
    env_open(&v, 1, 1, 1);
    for (int32_t s = 1; s <= 4; s++)
        put_prompt(&v, s, 1);
    uint64_t h = hash_of(&v, 1, 0);
    int want[4][2] = {{KVF_KV_EVENT_STORED, KVF_KV_TIER_POOL},
                      {KVF_KV_EVENT_STORED, KVF_KV_TIER_HOST},
                      {KVF_KV_EVENT_STORED, KVF_KV_TIER_DISK},
                      {KVF_KV_EVENT_REMOVED, KVF_KV_TIER_DISK}};
    int n = 0;
    for (int i = 0; i < v.e.n_ev; i++) {
        if (v.e.ev[i].hash != h)
            continue;
        assert_true(n < 4);
        assert_int_equal(v.e.ev[i].type, want[n][0]);
        assert_int_equal(v.e.ev[i].tier, want[n][1]);
        n++;
    }
    assert_int_equal(n, 4);
    /* 2 is on disk now, 3 in the host tier, 4 in the pool: each found, each the same bytes */
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].dropped, 1);
    assert_int_equal(get_prompt(&v, 2, 1), 1);
    /* copy thread: 2's disk slot is held while 4 comes down, so 3 (the host tier's victim)
     * finds no room on disk and is dropped */
    assert_int_equal(get_prompt(&v, 3, 1), g_sync ? 1 : 0);
    assert_int_equal(get_prompt(&v, 4, 1), 1);
    assert_int_equal(get_prompt(&v, 1, 1), 0);
    env_close(&v);
}

/* A previous run's tier file is removed at start, a foreign file of kvfleet-kv-* kind is not;
 * the file goes at destroy. */
static void test_disk_dir_emptied(void **state)
{
    (void)state;
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvf-tier-XXXXXX");
    assert_non_null(mkdtemp(dir));
    char old[128], other[128], keep[128];
    snprintf(old, sizeof old, "%s/kvfleet-kv-tier.bin", dir);
    snprintf(other, sizeof other, "%s/kvfleet-kv-other", dir);
    snprintf(keep, sizeof keep, "%s/notes.txt", dir);
    int fd = open(old, O_CREAT | O_WRONLY, 0600);
    assert_int_equal(write(fd, "stale", 5), 5);
    close(fd);
    close(open(other, O_CREAT | O_WRONLY, 0600));
    close(open(keep, O_CREAT | O_WRONLY, 0600));
    kvf_kv_layout l;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_layout_init(1, 1, 2, BS, KVF_DTYPE_F32, &l, &err), KVF_OK);
    kvf_kv_tier_cfg c = {.host_bytes = l.block_bytes, .disk_dir = dir, .disk_bytes = 1 << 16};
    kvf_kv_tier *t = NULL;
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_OK);
    struct stat sb;
    assert_int_equal(stat(old, &sb), 0); /* made afresh: empty */
    assert_int_equal(sb.st_size, 0);
    assert_int_equal(access(other, F_OK), 0);
    assert_int_equal(access(keep, F_OK), 0);
    assert_int_equal(access(kvf_kv_tier_disk_path(t), F_OK), 0);
    char path[256];
    snprintf(path, sizeof path, "%s", kvf_kv_tier_disk_path(t));
    kvf_kv_tier_destroy(t);
    assert_int_not_equal(access(path, F_OK), 0);
    assert_int_equal(access(other, F_OK), 0);
    unlink(other);
    unlink(keep);
    rmdir(dir);
}

/* The disk directory must be private: group- or world-writable is refused naming the flag; a
 * symbolic link planted at the tier file's name is not followed (its target keeps its bytes);
 * a second tier on a directory a live one uses is refused, and allowed once that one is gone. */
static void test_disk_dir_safety(void **state)
{
    (void)state;
    kvf_kv_layout l;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_layout_init(1, 1, 2, BS, KVF_DTYPE_F32, &l, &err), KVF_OK);
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvf-tier-XXXXXX");
    assert_non_null(mkdtemp(dir));
    kvf_kv_tier_cfg c = {.host_bytes = l.block_bytes, .disk_dir = dir, .disk_bytes = 1 << 16};
    kvf_kv_tier *t = NULL, *t2 = NULL;

    assert_int_equal(chmod(dir, 0777), 0);
    assert_int_not_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_OK);
    assert_null(t);
    assert_non_null(strstr(err.msg, "--kv-disk-dir="));
    assert_non_null(strstr(err.msg, "writable by group or others"));
    assert_int_equal(chmod(dir, 0700), 0);

    /* a link at the file's name to a file of ours: removed, its target untouched */
    char target[128], link[128];
    snprintf(target, sizeof target, "%s-target", dir);
    snprintf(link, sizeof link, "%s/kvfleet-kv-tier.bin", dir);
    int fd = open(target, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "precious", 8), 8);
    close(fd);
    assert_int_equal(symlink(target, link), 0);
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_OK);
    struct stat sb;
    assert_int_equal(lstat(link, &sb), 0);
    assert_true(S_ISREG(sb.st_mode)); /* the tier's own file, not the link */
    assert_int_equal(stat(target, &sb), 0);
    assert_int_equal(sb.st_size, 8);

    /* a second tier on the same directory, while the first lives */
    err = (kvf_err){0};
    assert_int_not_equal(kvf_kv_tier_create(&c, &l, &t2, &err), KVF_OK);
    assert_null(t2);
    assert_non_null(strstr(err.msg, "in use by another"));
    assert_int_equal(access(link, F_OK), 0); /* the first one's file is still there */
    kvf_kv_tier_destroy(t);
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t2, &err), KVF_OK);
    kvf_kv_tier_destroy(t2);
    unlink(target);
    rmdir(dir);
}

/* Waits (up to 10 s) until n copies are held at the closed gate. */
static void gate_wait_held(int n)
{
    for (int i = 0; i < 10000; i++) {
        pthread_mutex_lock(&g_gate.mu);
        int w = g_gate.waiting;
        pthread_mutex_unlock(&g_gate.mu);
        if (w >= n)
            return;
        usleep(1000);
    }
    fail_msg("the copy thread never reached the gate");
}

/* Looks up seed's n_blocks-block prompt into s (initialised here); returns the tokens hit. */
static int64_t lookup(env *v, kvf_kv_seq *s, int32_t seed, int32_t n_blocks)
{
    int32_t toks[64];
    kt_tokens(toks, (int64_t)n_blocks * BS, seed);
    kvf_err err = {0};
    kvf_kv_seq_init(s, v->e.pool, v->root);
    int64_t hit = -1;
    assert_int_equal(kvf_kv_prefix_lookup(s, toks, (int64_t)n_blocks * BS, &hit, &err), KVF_OK);
    return hit;
}

/* (a) and (b): while a promotion is in flight its hash is not registered: another lookup of the
 * same prefix misses there (and probes say so), the sequence refuses writes; after it lands the
 * bytes are the demoted ones and a third lookup hits them in the pool. */
static void test_async_in_flight_invisible(void **state)
{
    (void)state;
    env v;
    env_open(&v, 4, 8, 0);
    put_prompt(&v, 1, 2);
    put_prompt(&v, 2, 4); /* prompt 1 -> host */
    gate_set(true);
    kvf_kv_seq a, b;
    assert_int_equal(lookup(&v, &a, 1, 2), 2 * BS);
    assert_int_equal(kvf_kv_seq_promotions_pending(&a), 2);
    kvf_kv_seq *one[] = {&a};
    kt_check(v.e.pool, one, 1);
    gate_wait_held(1);
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(v.e.pool, &ps);
    assert_int_equal(ps.promoting, 2);
    assert_int_equal(ps.promoted, 0);
    int32_t toks[8];
    kt_tokens(toks, 8, 1);
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, toks, 8), 0);
    assert_int_equal(lookup(&v, &b, 1, 2), 0); /* not visible: a miss for now */
    kvf_kv_seq *two[] = {&a, &b};
    kt_check(v.e.pool, two, 2);
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 1, &err), KVF_ERR_STATE);
    assert_int_equal(kvf_kv_pool_poll_promotions(v.e.pool), 0); /* held at the gate */
    /* the snapshot still lists them in the host tier (no event moved them yet) */
    kt_env snap;
    memset(&snap, 0, sizeof snap);
    kvf_kv_prefix_snapshot(v.e.pool, kt_on_event, &snap);
    int in_host = 0;
    for (int i = 0; i < snap.n_ev; i++)
        in_host += snap.ev[i].tier == KVF_KV_TIER_HOST &&
                   (snap.ev[i].hash == hash_of(&v, 1, 0) || snap.ev[i].hash == hash_of(&v, 1, 1));
    assert_int_equal(in_host, 2);
    int n0 = v.e.n_ev;
    gate_set(false);
    while (kvf_kv_seq_promotions_pending(&a) > 0) {
        kvf_kv_pool_wait_promotions(v.e.pool, 1000000000);
        kt_check(v.e.pool, two, 2);
    }
    assert_int_equal(a.n_tokens, 2 * BS);
    assert_true(stamped(&a, 1, 0) && stamped(&a, 1, 1)); /* (b) the demoted bytes */
    assert_true(find_ev(&v, n0, KVF_KV_EVENT_STORED, hash_of(&v, 1, 1), KVF_KV_TIER_POOL) >= 0);
    kvf_kv_pool_get_stats(v.e.pool, &ps);
    assert_int_equal(ps.promoting, 0);
    assert_int_equal(ps.promoted, 2);
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, toks, 8), 2);
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 1, &err), KVF_OK);
    kvf_kv_seq_fini(&b);
    kvf_kv_seq c;
    assert_int_equal(lookup(&v, &c, 1, 2), 2 * BS); /* pool hits now */
    assert_int_equal(kvf_kv_seq_promotions_pending(&c), 0);
    assert_int_equal(c.blocks[0], a.blocks[0]);
    kvf_kv_seq_fini(&c);
    kvf_kv_seq_fini(&a);
    kt_check(v.e.pool, NULL, 0);
    env_close(&v);
}

/* (c) a sequence freed while its copies are in flight: its blocks are LANDING, never on the
 * free list (an allocation of everything available does not get them), until the copies end;
 * then they are CACHED under their hashes and every block is back in the pool. */
static void test_async_free_in_flight(void **state)
{
    (void)state;
    env v;
    env_open(&v, 6, 8, 0);
    put_prompt(&v, 1, 3);
    put_prompt(&v, 2, 6); /* prompt 1 -> host */
    gate_set(true);
    kvf_kv_seq a;
    assert_int_equal(lookup(&v, &a, 1, 3), 3 * BS);
    int32_t ids[3];
    memcpy(ids, a.blocks, sizeof ids);
    gate_wait_held(1);
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_free(&a, &err), KVF_OK);
    kvf_kv_seq_fini(&a);
    kt_check(v.e.pool, NULL, 0);
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(v.e.pool, &ps);
    assert_int_equal(ps.landing, 3);
    assert_int_equal(ps.free + ps.cached + ps.landing, ps.total);
    /* everything that can be allocated now: none of the landing blocks */
    kvf_kv_seq w;
    kvf_kv_seq_init(&w, v.e.pool, v.root);
    int32_t avail = kvf_kv_pool_available(v.e.pool);
    assert_int_equal(avail, 3);
    assert_int_equal(kvf_kv_seq_prepare_write(&w, (int64_t)avail * BS, &err), KVF_OK);
    for (int32_t i = 0; i < w.n_blocks; i++)
        for (int k = 0; k < 3; k++)
            assert_int_not_equal(w.blocks[i], ids[k]);
    assert_int_equal(kvf_kv_seq_prepare_write(&w, 1, &err), KVF_ERR_FULL);
    kvf_kv_seq *one[] = {&w};
    kt_check(v.e.pool, one, 1);
    assert_int_equal(kvf_kv_seq_adopt(&w, ids, 1, BS, &err), KVF_ERR_STATE);
    gate_set(false);
    while (kvf_kv_pool_get_stats(v.e.pool, &ps), ps.promoting > 0) {
        kvf_kv_pool_wait_promotions(v.e.pool, 1000000000);
        kt_check(v.e.pool, one, 1);
    }
    assert_int_equal(ps.landing, 0);
    kvf_kv_seq_fini(&w);
    kvf_kv_pool_get_stats(v.e.pool, &ps);
    assert_int_equal(ps.free + ps.cached, ps.total);
    kt_check(v.e.pool, NULL, 0);
    /* the copies landed whole: the prompt is a pool hit with its bytes */
    assert_int_equal(get_prompt(&v, 1, 3), 3);
    env_close(&v);
}

/* (d) the copy thread finds a disk slot corrupt: the sequence's prefix is cut at that block
 * (the block before it, from the host tier, stays with its bytes), the slot is dropped
 * (REMOVED, corrupt counted), and the rest computes again. */
static void test_async_disk_corrupt_cuts(void **state)
{
    (void)state;
    env v;
    env_open(&v, 3, 1, 4);
    put_prompt(&v, 1, 3);
    put_prompt(&v, 2, 3); /* 1's blocks 2, 1 -> host -> disk, then 0 -> host */
    kvf_kv_tier_stats ts;
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_int_equal(ts.tier[KVF_KV_TIER_HOST].used, 1);
    assert_true(ts.tier[KVF_KV_TIER_DISK].used >= 2);
    int fd = open(kvf_kv_tier_disk_path(v.tier), O_RDWR);
    assert_true(fd >= 0);
    int64_t sb = kvf_kv_tier_disk_slot_bytes(v.tier);
    struct stat st;
    assert_int_equal(fstat(fd, &st), 0);
    for (int64_t off = sb - 5; off < st.st_size; off += sb) {
        unsigned char c;
        assert_int_equal(pread(fd, &c, 1, off), 1);
        c ^= 0x40;
        assert_int_equal(pwrite(fd, &c, 1, off), 1);
    }
    close(fd);
    kvf_kv_seq a;
    int n0 = v.e.n_ev;
    assert_int_equal(lookup(&v, &a, 1, 3), 3 * BS); /* all three found, copies queued */
    assert_int_equal(kvf_kv_seq_promotions_pending(&a), 3);
    kvf_kv_seq *one[] = {&a};
    while (kvf_kv_seq_promotions_pending(&a) > 0) {
        kvf_kv_pool_wait_promotions(v.e.pool, 1000000000);
        kt_check(v.e.pool, one, 1);
    }
    assert_int_equal(a.n_blocks, 1);
    assert_int_equal(a.n_hashed, 1);
    assert_int_equal(a.n_tokens, BS);
    assert_true(stamped(&a, 1, 0));
    kvf_kv_tier_get_stats(v.tier, &ts);
    assert_true(ts.tier[KVF_KV_TIER_DISK].corrupt >= 1);
    assert_true(find_ev(&v, n0, KVF_KV_EVENT_REMOVED, hash_of(&v, 1, 1), KVF_KV_TIER_DISK) >= 0);
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(v.e.pool, &ps);
    assert_true(ps.promote_failed >= 1);
    /* the blocks cut off the sequence land (their copies may still run: a slow build lets
     * them) before the pool can hand them out again */
    while (ps.landing > 0 || ps.promoting > 0) {
        kvf_kv_pool_wait_promotions(v.e.pool, 1000000000);
        kt_check(v.e.pool, one, 1);
        kvf_kv_pool_get_stats(v.e.pool, &ps);
    }
    /* the rest is computed again: writable now, and registered like any other */
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_prepare_write(&a, 2 * BS, &err), KVF_OK);
    stamp(&a, 1, 1);
    int32_t toks[12];
    kt_tokens(toks, 12, 1);
    assert_int_equal(kvf_kv_seq_commit(&a, toks, 12, &err), KVF_OK);
    kt_check(v.e.pool, one, 1);
    kvf_kv_seq_fini(&a);
    assert_int_equal(get_prompt(&v, 1, 3), 3);
    env_close(&v);
}

/* clear_cache while copies are in flight: their hashes are REMOVED at once; the copies land
 * in the sequence (its bytes are right) but are not registered. */
static void test_async_clear_in_flight(void **state)
{
    (void)state;
    env v;
    env_open(&v, 4, 8, 0);
    put_prompt(&v, 1, 2);
    put_prompt(&v, 2, 4); /* prompt 1 -> host */
    gate_set(true);
    kvf_kv_seq a;
    assert_int_equal(lookup(&v, &a, 1, 2), 2 * BS);
    int n0 = v.e.n_ev;
    int32_t n = 0;
    kvf_kv_pool_clear_cache(v.e.pool, &n);
    assert_true(find_ev(&v, n0, KVF_KV_EVENT_REMOVED, hash_of(&v, 1, 0), KVF_KV_TIER_HOST) >= 0);
    assert_true(find_ev(&v, n0, KVF_KV_EVENT_REMOVED, hash_of(&v, 1, 1), KVF_KV_TIER_HOST) >= 0);
    kvf_kv_seq *one[] = {&a};
    kt_check(v.e.pool, one, 1);
    kt_env snap;
    memset(&snap, 0, sizeof snap);
    assert_int_equal(kvf_kv_prefix_snapshot(v.e.pool, kt_on_event, &snap), 0);
    gate_set(false);
    while (kvf_kv_seq_promotions_pending(&a) > 0) {
        kvf_kv_pool_wait_promotions(v.e.pool, 1000000000);
        kt_check(v.e.pool, one, 1);
    }
    assert_int_equal(a.n_tokens, 2 * BS);
    assert_true(stamped(&a, 1, 0) && stamped(&a, 1, 1));
    int32_t toks[8];
    kt_tokens(toks, 8, 1);
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, toks, 8), 0); /* not registered */
    kvf_kv_seq_fini(&a);
    env_close(&v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_errors),
        cmocka_unit_test(test_create_beyond_machine),
        cmocka_unit_test(test_promote_time_excludes_demotion),
        cmocka_unit_test(test_demote_promote_bytes_and_events),
        cmocka_unit_test(test_host_lru),
        cmocka_unit_test(test_chain_across_tiers),
        cmocka_unit_test(test_collision_in_tier),
        cmocka_unit_test(test_disk_corrupt_and_truncated),
        cmocka_unit_test(test_recomputed_block_leaves_tier),
        cmocka_unit_test(test_events_through_every_tier),
        cmocka_unit_test(test_disk_dir_emptied),
        cmocka_unit_test(test_disk_dir_safety),
    };
    const struct CMUnitTest async_only[] = {
        cmocka_unit_test(test_async_in_flight_invisible),
        cmocka_unit_test(test_async_free_in_flight),
        cmocka_unit_test(test_async_disk_corrupt_cuts),
        cmocka_unit_test(test_async_clear_in_flight),
    };
    g_sync = false; /* the default: the copy thread */
    int rc = cmocka_run_group_tests_name("copy thread", tests, NULL, NULL);
    rc |= cmocka_run_group_tests_name("copy thread only", async_only, NULL, NULL);
    g_sync = true;
    rc |= cmocka_run_group_tests_name("synchronous", tests, NULL, NULL);
    return rc;
}
