/* test_tier.c: kv/tier.h under a pool: demotion on eviction and promotion on lookup give the
 * same bytes, LRU order inside the host tier, one chain found whole across pool, host and disk,
 * a hash collision in a tier is a miss, a corrupted or truncated disk file is a miss, events
 * carry their tiers in order, snapshots list tier blocks. Invariants after every step, and
 * every block back in its pool at the end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvtest.h"
#include "kv/tier.h"

#define BS 4

typedef struct env {
    kt_env e;
    kvf_kv_tier *tier;
    char dir[64], sub[96];
    uint64_t root;
} env;

static void env_open(env *v, int32_t n_blocks, int64_t host_blocks, int64_t disk_slots)
{
    memset(v, 0, sizeof *v);
    v->e.now = 1000;
    kvf_kv_pool_cfg c = kt_cfg(&v->e, n_blocks, BS);
    kvf_kv_tier_cfg tc = {.host_bytes = host_blocks * c.layout.block_bytes};
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

static void env_close(env *v)
{
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

/* Looks seed's prompt up; returns the blocks hit and checks each one's bytes. The sequence is
 * freed again. */
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
    /* promoting 2 makes room; demoting 4 then takes it; 3 stays: the oldest left */
    assert_int_equal(get_prompt(&v, 2, 1), 1);
    int32_t t3[BS];
    kt_tokens(t3, BS, 3);
    assert_int_equal(kvf_kv_prefix_probe(v.e.pool, v.root, t3, BS), 1);
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
    /* prompt 2 went down in turn, and comes back too */
    assert_int_equal(get_prompt(&v, 2, 3), 3);
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
    assert_int_equal(ts.tier[KVF_KV_TIER_DISK].used, 0);
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
    assert_int_equal(get_prompt(&v, 3, 1), 1);
    assert_int_equal(get_prompt(&v, 4, 1), 1);
    assert_int_equal(get_prompt(&v, 1, 1), 0);
    env_close(&v);
}

/* Tier files of a previous run are removed at start; the file goes at destroy. */
static void test_disk_dir_emptied(void **state)
{
    (void)state;
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/kvf-tier-XXXXXX");
    assert_non_null(mkdtemp(dir));
    char old[128], keep[128];
    snprintf(old, sizeof old, "%s/kvfleet-kv-old.bin", dir);
    snprintf(keep, sizeof keep, "%s/notes.txt", dir);
    close(open(old, O_CREAT | O_WRONLY, 0600));
    close(open(keep, O_CREAT | O_WRONLY, 0600));
    kvf_kv_layout l;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_layout_init(1, 1, 2, BS, KVF_DTYPE_F32, &l, &err), KVF_OK);
    kvf_kv_tier_cfg c = {.host_bytes = l.block_bytes, .disk_dir = dir, .disk_bytes = 1 << 16};
    kvf_kv_tier *t = NULL;
    assert_int_equal(kvf_kv_tier_create(&c, &l, &t, &err), KVF_OK);
    assert_int_not_equal(access(old, F_OK), 0);
    assert_int_equal(access(keep, F_OK), 0);
    assert_int_equal(access(kvf_kv_tier_disk_path(t), F_OK), 0);
    char path[256];
    snprintf(path, sizeof path, "%s", kvf_kv_tier_disk_path(t));
    kvf_kv_tier_destroy(t);
    assert_int_not_equal(access(path, F_OK), 0);
    unlink(keep);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_errors),
        cmocka_unit_test(test_demote_promote_bytes_and_events),
        cmocka_unit_test(test_host_lru),
        cmocka_unit_test(test_chain_across_tiers),
        cmocka_unit_test(test_collision_in_tier),
        cmocka_unit_test(test_disk_corrupt_and_truncated),
        cmocka_unit_test(test_recomputed_block_leaves_tier),
        cmocka_unit_test(test_events_through_every_tier),
        cmocka_unit_test(test_disk_dir_emptied),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
