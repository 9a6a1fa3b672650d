/* test_local.c: the backend-independent half of kvf_xfer, driven through the local (memcpy)
 * backend: descriptors (round trip, every corruption refused with a message), layout mismatch
 * refused at connect naming both values, pair checks, coalescing, events, expectations with
 * deadlines, cancel, and an in-process UCX round trip over shared memory and tcp. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <poll.h>

#include "common/cfg.h"
#include "common/hash.h"
#include "common/log.h"
#include "common/time.h"
#include "transport/xfer.h"

#define SEC 1000000000LL

typedef struct side {
    kvf_kv_layout layout;
    int64_t n_blocks;
    uint8_t *mem;
    bool owned; /* mem came from the transport (pool.base NULL) */
    kvf_xfer *x;
} side;

static bool transport_allocates; /* side_open leaves the pool to the transport */
static const char *data_path;     /* side_open's kvf_xfer_cfg.data_path */

static void side_open(side *s, const char *backend, const char *transport, int32_t block_size,
                      kvf_dtype dtype, int32_t kv_heads, int64_t n_blocks, uint8_t fill)
{
    kvf_err err = {0};
    assert_int_equal(kvf_kv_layout_init(2, kv_heads, 8, block_size, dtype, &s->layout, &err),
                     KVF_OK);
    s->n_blocks = n_blocks;
    s->owned = transport_allocates;
    s->mem = s->owned ? NULL : malloc((size_t)(n_blocks * s->layout.block_bytes));
    assert_true(s->owned || s->mem);
    kvf_xfer_pool pool = {.base = s->mem, .layout = s->layout, .n_blocks = n_blocks};
    kvf_xfer_cfg cfg = {.backend = backend, .transport = transport, .data_path = data_path};
    kvf_status st = kvf_xfer_create(&cfg, &pool, &s->x, &err);
    if (st != KVF_OK)
        fail_msg("kvf_xfer_create: %s", err.msg);
    if (s->owned) {
        s->mem = kvf_xfer_pool_base(s->x);
        for (int64_t i = 0; i < n_blocks * s->layout.block_bytes; i++)
            assert_int_equal(s->mem[i], 0); /* handed out zeroed */
    }
    memset(s->mem, fill, (size_t)(n_blocks * s->layout.block_bytes));
}

static void side_close(side *s)
{
    kvf_xfer_destroy(s->x);
    if (!s->owned)
        free(s->mem);
}

static uint8_t *block(side *s, int64_t b)
{
    return s->mem + b * s->layout.block_bytes;
}

/* Fills every block of s with bytes derived from (block, offset). */
static void fill_pattern(side *s, uint32_t seed)
{
    for (int64_t b = 0; b < s->n_blocks; b++)
        for (int64_t i = 0; i < s->layout.block_bytes; i++)
            block(s, b)[i] = (uint8_t)((b * 131 + i * 7 + seed) ^ (i >> 8));
}

static kvf_xfer_peer *connect_to(side *from, side *to)
{
    uint8_t *desc;
    size_t len;
    kvf_err err = {0};
    kvf_xfer_peer *peer = NULL;
    assert_int_equal(kvf_xfer_desc_export(to->x, &desc, &len, &err), KVF_OK);
    kvf_status st = kvf_xfer_connect(from->x, desc, len, &peer, &err);
    free(desc);
    if (st != KVF_OK)
        fail_msg("connect: %s", err.msg);
    return peer;
}

static void test_desc_round_trip(void **state)
{
    side a;
    side_open(&a, "local", NULL, 16, KVF_DTYPE_BF16, 4, 10, 0);
    uint8_t *desc;
    size_t len;
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_desc_export(a.x, &desc, &len, &err), KVF_OK);
    assert_memory_equal(desc, "KVFX", 4);
    kvf_xfer_desc_info d;
    assert_int_equal(kvf_xfer_desc_parse(desc, len, &d, &err), KVF_OK);
    assert_int_equal(d.version, KVF_XFER_DESC_VERSION);
    assert_string_equal(d.backend, "local");
    assert_int_equal(d.n_blocks, 10);
    assert_int_equal(d.layout.block_size, 16);
    assert_int_equal(d.layout.n_kv_heads, 4);
    assert_int_equal(d.layout.dtype, KVF_DTYPE_BF16);
    assert_int_equal(d.layout.block_bytes, a.layout.block_bytes);
    assert_int_equal(d.blob_len, 16);
    free(desc);
    side_close(&a);
}

/* Rewrites a descriptor's trailing checksum after a deliberate edit. */
static void reseal(uint8_t *d, size_t len)
{
    uint64_t h = kvf_hash64(d, len - 8);
    for (int i = 0; i < 8; i++)
        d[len - 8 + i] = (uint8_t)(h >> (8 * i));
}

static void test_desc_corruptions_refused(void **state)
{
    side a;
    side_open(&a, "local", NULL, 16, KVF_DTYPE_F16, 2, 4, 0);
    uint8_t *desc;
    size_t len;
    kvf_err err = {0};
    kvf_xfer_desc_info d;
    assert_int_equal(kvf_xfer_desc_export(a.x, &desc, &len, &err), KVF_OK);
    uint8_t *bad = malloc(len);

    /* Every truncation is refused (the checksum, if nothing else, catches it). */
    for (size_t n = 0; n < len; n++) {
        err.msg[0] = 0;
        assert_int_not_equal(kvf_xfer_desc_parse(desc, n, &d, &err), KVF_OK);
        assert_true(err.msg[0] != 0);
    }
    /* Bad magic. */
    memcpy(bad, desc, len);
    bad[0] = 'X';
    assert_int_equal(kvf_xfer_desc_parse(bad, len, &d, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "KVFX"));
    /* A damaged byte fails the checksum. */
    memcpy(bad, desc, len);
    bad[len / 2] ^= 1;
    assert_int_equal(kvf_xfer_desc_parse(bad, len, &d, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "checksum"));
    /* Another version names both. */
    memcpy(bad, desc, len);
    bad[4] = 2;
    reseal(bad, len);
    assert_int_equal(kvf_xfer_desc_parse(bad, len, &d, &err), KVF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "version 2"));
    assert_non_null(strstr(err.msg, "reads 1"));
    /* block_size not a power of two (the field after the 5-byte name "local"). */
    memcpy(bad, desc, len);
    size_t bs_off = 4 + 4 + 1 + 5 + 12;
    bad[bs_off] = 24;
    reseal(bad, len);
    assert_int_equal(kvf_xfer_desc_parse(bad, len, &d, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block_size 24"));
    /* One byte more than the blob length says. */
    uint8_t *longer = malloc(len + 1);
    memcpy(longer, desc, len - 8);
    longer[len - 8] = 0;
    reseal(longer, len + 1);
    assert_int_equal(kvf_xfer_desc_parse(longer, len + 1, &d, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "backend bytes"));
    free(longer);
    /* Random byte flips never crash and never pass silently with a wrong layout. */
    srand(7);
    for (int i = 0; i < 2000; i++) {
        memcpy(bad, desc, len);
        bad[rand() % len] ^= (uint8_t)(1 + rand() % 255);
        if (kvf_xfer_desc_parse(bad, len, &d, &err) == KVF_OK) {
            kvf_kv_layout chk;
            assert_int_equal(kvf_kv_layout_init(d.layout.n_layers, d.layout.n_kv_heads,
                                                d.layout.head_dim, d.layout.block_size,
                                                d.layout.dtype, &chk, &err), KVF_OK);
            assert_int_equal(chk.block_bytes, d.layout.block_bytes);
        }
    }
    free(bad);
    free(desc);
    side_close(&a);
}

static void expect_connect_refused(side *from, side *to, const char *a, const char *b)
{
    uint8_t *desc;
    size_t len;
    kvf_err err = {0};
    kvf_xfer_peer *peer = NULL;
    assert_int_equal(kvf_xfer_desc_export(to->x, &desc, &len, &err), KVF_OK);
    assert_int_equal(kvf_xfer_connect(from->x, desc, len, &peer, &err), KVF_ERR_INVALID);
    assert_null(peer);
    if (!strstr(err.msg, a) || !strstr(err.msg, b))
        fail_msg("message '%s' lacks '%s' or '%s'", err.msg, a, b);
    free(desc);
}

static void test_layout_mismatch_refused_at_connect(void **state)
{
    side a, b, c, d, u;
    side_open(&a, "local", NULL, 16, KVF_DTYPE_F16, 2, 4, 0);
    side_open(&b, "local", NULL, 32, KVF_DTYPE_F16, 2, 4, 0);
    side_open(&c, "local", NULL, 16, KVF_DTYPE_BF16, 2, 4, 0);
    side_open(&d, "local", NULL, 16, KVF_DTYPE_F16, 4, 4, 0);
    side_open(&u, "ucx", "sm", 16, KVF_DTYPE_F16, 2, 4, 0);
    expect_connect_refused(&a, &b, "block_size differs: 16 at this side, 32 at the peer",
                           "connect refused");
    expect_connect_refused(&a, &c, "f16 at this side", "bf16 at the peer");
    expect_connect_refused(&a, &d, "n_kv_heads differs: 2", "4 at the peer");
    /* Same layout, other backend. */
    expect_connect_refused(&a, &u, "backend 'ucx'", "uses 'local'");
    side_close(&a);
    side_close(&b);
    side_close(&c);
    side_close(&d);
    side_close(&u);
}

/* The transport's cfg table, included by a role at its kvf_xfer_cfg member: flags and
 * KVFLEET_XFER_* variables reach kvf_xfer_cfg; the role's own flags still work; the old
 * --transport says what it became. */
typedef struct role_cfg {
    int32_t other;
    kvf_xfer_cfg xfer;
} role_cfg;

static const kvf_cfg_opt role_opts[] = {
    {"other", "1", "something else", offsetof(role_cfg, other), KVF_CFG_INT},
    {NULL},
};

static const kvf_cfg_table role_tables[] = {
    {kvf_xfer_cfg_opts, offsetof(role_cfg, xfer)},
    {NULL, 0},
};

static void test_cfg_table_lines(void **state)
{
    kvf_cfg_spec spec = {.prog = "role", .opts = role_opts, .tables = role_tables};
    role_cfg c = {0};
    kvf_err err = {0};
    setenv("KVFLEET_XFER_TRANSPORT", "sm", 1);
    char *argv[] = {"role", "--xfer-net-devices=lo", NULL};
    assert_int_equal(kvf_cfg_parse(&spec, &c, 2, argv, NULL, &err), KVF_OK);
    unsetenv("KVFLEET_XFER_TRANSPORT");
    assert_string_equal(c.xfer.backend, "auto");
    assert_string_equal(kvf_xfer_backend_pick(c.xfer.backend, false, false), "ucx");
    assert_string_equal(kvf_xfer_backend_pick(c.xfer.backend, true, false), "cuda_ipc");
    assert_string_equal(kvf_xfer_backend_pick(c.xfer.backend, true, true), "ucx");
    assert_int_equal(c.other, 1);
    assert_string_equal(c.xfer.transport, "sm");
    assert_string_equal(c.xfer.net_devices, "lo");
    assert_string_equal(c.xfer.data_path, "auto");
    char *argv2[] = {"role", "--xfer-transport", "tcp", "--xfer-backend=local", NULL};
    assert_int_equal(kvf_cfg_parse(&spec, &c, 4, argv2, NULL, &err), KVF_OK);
    assert_string_equal(c.xfer.transport, "tcp");
    assert_string_equal(c.xfer.backend, "local");
    char *argv3[] = {"role", "--other=7", "--xfer-gpu-staging", "--xfer-notice-host", "10.0.0.7", NULL};
    assert_int_equal(kvf_cfg_parse(&spec, &c, 5, argv3, NULL, &err), KVF_OK);
    assert_int_equal(c.other, 7);
    assert_true(c.xfer.gpu_staging);
    assert_string_equal(c.xfer.notice_host, "10.0.0.7");
    char *argv4[] = {"role", "--transport", "ucx", NULL};
    assert_int_equal(kvf_cfg_parse(&spec, &c, 3, argv4, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "--transport was renamed: use --xfer-backend"));
}

static void test_bad_cfg_refused(void **state)
{
    kvf_kv_layout l;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_layout_init(1, 1, 8, 16, KVF_DTYPE_F32, &l, &err), KVF_OK);
    uint8_t mem[1024];
    kvf_xfer_pool pool = {.base = mem, .layout = l, .n_blocks = 1};
    kvf_xfer *x = NULL;
    kvf_xfer_cfg cfg = {.backend = "rdma"};
    assert_int_equal(kvf_xfer_create(&cfg, &pool, &x, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'rdma'"));
    cfg = (kvf_xfer_cfg){.backend = "ucx", .transport = "ib"};
    assert_int_equal(kvf_xfer_create(&cfg, &pool, &x, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'ib'"));
    assert_non_null(strstr(err.msg, "auto, tcp or sm"));
    cfg = (kvf_xfer_cfg){.backend = "local"};
    pool.n_blocks = 0;
    assert_int_equal(kvf_xfer_create(&cfg, &pool, &x, &err), KVF_ERR_INVALID);
    pool.n_blocks = 1;
    pool.layout.block_bytes = 999;
    assert_int_equal(kvf_xfer_create(&cfg, &pool, &x, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "999"));
    assert_null(x);
}

static void test_pairs_checked(void **state)
{
    side a, b;
    side_open(&a, "local", NULL, 16, KVF_DTYPE_F16, 2, 8, 1);
    side_open(&b, "local", NULL, 16, KVF_DTYPE_F16, 2, 4, 0);
    kvf_xfer_peer *p = connect_to(&a, &b);
    kvf_err err = {0};
    int64_t dl = kvf_now_ns() + 5 * SEC;
    kvf_xfer_pair src_out[] = {{0, 0}, {8, 1}};
    assert_int_equal(kvf_xfer_write(a.x, p, 1, src_out, 2, dl, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "source block 8"));
    assert_non_null(strstr(err.msg, "0 to 7"));
    kvf_xfer_pair dst_out[] = {{7, 4}};
    assert_int_equal(kvf_xfer_write(a.x, p, 1, dst_out, 1, dl, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "destination block 4"));
    assert_non_null(strstr(err.msg, "0 to 3"));
    kvf_xfer_pair dup[] = {{0, 2}, {1, 3}, {2, 2}};
    assert_int_equal(kvf_xfer_write(a.x, p, 1, dup, 3, dl, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "destination block 2 appears twice"));
    assert_int_equal(kvf_xfer_write(a.x, p, 1, dup, 0, dl, &err), KVF_ERR_INVALID);
    kvf_xfer_pair neg[] = {{-1, 0}};
    assert_int_equal(kvf_xfer_write(a.x, p, 1, neg, 1, dl, &err), KVF_ERR_INVALID);
    /* Nothing was started, so no event and no byte moved. */
    kvf_xfer_event ev;
    kvf_xfer_progress(a.x);
    assert_false(kvf_xfer_poll(a.x, &ev));
    for (int64_t i = 0; i < 4 * b.layout.block_bytes; i++)
        assert_int_equal(b.mem[i], 0);
    kvf_xfer_stats s;
    kvf_xfer_stats_get(a.x, &s);
    assert_int_equal(s.writes, 0);
    assert_int_equal(s.in_flight, 0);
    side_close(&a);
    side_close(&b);
}

/* Random pair lists: every destination byte equals its source block, every other block is
 * untouched, and the number of puts equals the number of adjacent runs. */
static void test_random_lists_local(void **state)
{
    side a, b;
    side_open(&a, "local", NULL, 16, KVF_DTYPE_F16, 2, 64, 0);
    side_open(&b, "local", NULL, 16, KVF_DTYPE_F16, 2, 48, 0);
    fill_pattern(&a, 3);
    kvf_xfer_peer *p = connect_to(&a, &b);
    int32_t owner[48]; /* which source block each destination holds; -1: none */
    for (int i = 0; i < 48; i++)
        owner[i] = -1;
    srand(11);
    kvf_err err = {0};
    int64_t total_runs = 0;
    for (uint64_t id = 1; id <= 50; id++) {
        kvf_xfer_pair pairs[48];
        int perm[48];
        for (int i = 0; i < 48; i++)
            perm[i] = i;
        for (int i = 47; i > 0; i--) {
            int j = rand() % (i + 1), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        int n = 1 + rand() % 20;
        /* Half the time a contiguous run, else scattered destinations. */
        int start = rand() % (48 - n + 1), src0 = rand() % (64 - n + 1);
        bool run = rand() % 2;
        for (int i = 0; i < n; i++) {
            pairs[i].dst = run ? start + i : perm[i];
            pairs[i].src = run ? src0 + i : rand() % 64;
        }
        /* The expected number of runs, counted independently. */
        bool used[48] = {0};
        int32_t src_of[48];
        for (int i = 0; i < n; i++)
            used[pairs[i].dst] = true, src_of[pairs[i].dst] = pairs[i].src;
        for (int d = 0; d < 48; d++)
            if (used[d] && !(d > 0 && used[d - 1] && src_of[d - 1] + 1 == src_of[d]))
                total_runs++;
        assert_int_equal(kvf_xfer_expect(b.x, id, kvf_now_ns() + 5 * SEC, &err), KVF_OK);
        assert_int_equal(kvf_xfer_write(a.x, p, id, pairs, (size_t)n, kvf_now_ns() + 5 * SEC,
                                        &err), KVF_OK);
        kvf_xfer_event ev;
        assert_int_equal(kvf_xfer_wait(a.x, &ev, kvf_now_ns() + SEC, &err), KVF_OK);
        assert_int_equal(ev.kind, KVF_XFER_SENT);
        assert_int_equal(ev.id, id);
        assert_int_equal(ev.status, KVF_OK);
        assert_int_equal(kvf_xfer_wait(b.x, &ev, kvf_now_ns() + SEC, &err), KVF_OK);
        assert_int_equal(ev.kind, KVF_XFER_RECEIVED);
        assert_int_equal(ev.id, id);
        assert_int_equal(ev.status, KVF_OK);
        for (int i = 0; i < n; i++)
            owner[pairs[i].dst] = pairs[i].src;
        for (int d = 0; d < 48; d++) {
            if (owner[d] >= 0) {
                assert_memory_equal(block(&b, d), block(&a, owner[d]), b.layout.block_bytes);
            } else {
                for (int64_t k = 0; k < b.layout.block_bytes; k++)
                    assert_int_equal(block(&b, d)[k], 0);
            }
        }
    }
    kvf_xfer_stats s;
    kvf_xfer_stats_get(a.x, &s);
    assert_int_equal(s.writes, 50);
    assert_int_equal(s.sent_ok, 50);
    assert_int_equal(s.puts, total_runs);
    assert_int_equal(s.in_flight, 0);
    kvf_xfer_stats_get(b.x, &s);
    assert_int_equal(s.received_ok, 50);
    assert_int_equal(s.expected, 0);
    side_close(&a);
    side_close(&b);
}

static void test_expect_timeout_cancel_and_late_notice(void **state)
{
    side a, b;
    side_open(&a, "local", NULL, 16, KVF_DTYPE_F16, 2, 4, 5);
    side_open(&b, "local", NULL, 16, KVF_DTYPE_F16, 2, 4, 0);
    kvf_xfer_peer *p = connect_to(&a, &b);
    kvf_err err = {0};
    kvf_xfer_event ev;
    /* A transfer nobody writes times out at its deadline, naming its id. */
    int64_t t0 = kvf_now_ns();
    assert_int_equal(kvf_xfer_expect(b.x, 41, t0 + SEC / 5, &err), KVF_OK);
    assert_int_equal(kvf_xfer_expect(b.x, 41, t0 + SEC / 5, &err), KVF_ERR_EXISTS);
    assert_int_equal(kvf_xfer_expect(b.x, 42, t0 + 10 * SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_wait(b.x, &ev, t0 + 5 * SEC, &err), KVF_OK);
    int64_t el = kvf_now_ns() - t0;
    assert_int_equal(ev.kind, KVF_XFER_RECEIVED);
    assert_int_equal(ev.id, 41);
    assert_int_equal(ev.status, KVF_ERR_TIMEOUT);
    assert_true(el >= SEC / 5 && el < 2 * SEC);
    /* Receiver cancel ends 42 at once. */
    assert_int_equal(kvf_xfer_cancel(b.x, 42, &err), KVF_OK);
    assert_true(kvf_xfer_poll(b.x, &ev));
    assert_int_equal(ev.id, 42);
    assert_int_equal(ev.status, KVF_ERR_CANCELLED);
    assert_int_equal(kvf_xfer_cancel(b.x, 42, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "42"));
    /* A write for the timed-out id lands but its notice is dropped: no RECEIVED event. */
    kvf_log_set_level(KVF_LOG_OFF);
    kvf_xfer_pair pr[] = {{0, 0}};
    assert_int_equal(kvf_xfer_write(a.x, p, 41, pr, 1, kvf_now_ns() + SEC, &err), KVF_OK);
    kvf_log_set_level(KVF_LOG_INFO);
    assert_true(kvf_xfer_poll(a.x, &ev));
    assert_int_equal(ev.status, KVF_OK);
    kvf_xfer_progress(b.x);
    assert_false(kvf_xfer_poll(b.x, &ev));
    kvf_xfer_stats s;
    kvf_xfer_stats_get(b.x, &s);
    assert_int_equal(s.late_notices, 1);
    assert_int_equal(s.received_failed, 2);
    assert_int_equal(s.expected, 0);
    /* wait with nothing pending times out, promptly. */
    t0 = kvf_now_ns();
    assert_int_equal(kvf_xfer_wait(b.x, &ev, t0 + SEC / 10, &err), KVF_ERR_TIMEOUT);
    assert_true(kvf_now_ns() - t0 < SEC);
    /* A destroyed receiver: the next write reports a lost peer and starts nothing. */
    side_close(&b);
    assert_int_equal(kvf_xfer_write(a.x, p, 43, pr, 1, kvf_now_ns() + SEC, &err),
                     KVF_ERR_PEER_LOST);
    assert_int_equal(kvf_xfer_peer_status(p), KVF_ERR_PEER_LOST);
    assert_false(kvf_xfer_poll(a.x, &ev));
    side_close(&a);
}

/* In one process, two UCX workers: the same random lists over shared memory and over tcp. */
static void ucx_in_process(const char *transport)
{
    side a, b;
    side_open(&a, "ucx", transport, 16, KVF_DTYPE_F16, 2, 32, 0);
    side_open(&b, "ucx", transport, 16, KVF_DTYPE_F16, 2, 32, 0);
    fill_pattern(&a, 9);
    kvf_xfer_peer *p = connect_to(&a, &b);
    kvf_err err = {0};
    srand(5);
    for (uint64_t id = 100; id < 120; id++) {
        kvf_xfer_pair pairs[32];
        int n = 1 + rand() % 32, start = rand() % (32 - n + 1);
        for (int i = 0; i < n; i++)
            pairs[i] = (kvf_xfer_pair){.src = (int32_t)((start + i * 3) % 32),
                                       .dst = (int32_t)(start + i)};
        memset(b.mem, 0, (size_t)(32 * b.layout.block_bytes));
        assert_int_equal(kvf_xfer_expect(b.x, id, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
        assert_int_equal(kvf_xfer_write(a.x, p, id, pairs, (size_t)n, kvf_now_ns() + 10 * SEC,
                                        &err), KVF_OK);
        bool sent = false, recv = false;
        int64_t until = kvf_now_ns() + 10 * SEC;
        while (!(sent && recv) && kvf_now_ns() < until) {
            kvf_xfer_event ev;
            kvf_xfer_progress(a.x);
            kvf_xfer_progress(b.x);
            if (kvf_xfer_poll(a.x, &ev)) {
                assert_int_equal(ev.id, id);
                assert_int_equal(ev.status, KVF_OK);
                sent = true;
            }
            if (kvf_xfer_poll(b.x, &ev)) {
                assert_int_equal(ev.id, id);
                assert_int_equal(ev.status, KVF_OK);
                recv = true;
                for (int i = 0; i < n; i++)
                    assert_memory_equal(block(&b, pairs[i].dst), block(&a, pairs[i].src),
                                        a.layout.block_bytes);
            }
        }
        assert_true(sent && recv);
    }
    side_close(&a);
    side_close(&b);
}

static void test_ucx_in_process_sm(void **state)
{
    ucx_in_process("sm");
}

static void test_ucx_in_process_tcp(void **state)
{
    ucx_in_process("tcp");
}

/* A receiver asleep on its event fd wakes when the notice arrives (no spinning needed). */
static void ucx_event_fd_wakes(const char *transport)
{
    side a, b;
    side_open(&a, "ucx", transport, 16, KVF_DTYPE_F16, 2, 8, 0);
    side_open(&b, "ucx", transport, 16, KVF_DTYPE_F16, 2, 8, 0);
    fill_pattern(&a, 1);
    kvf_xfer_peer *p = connect_to(&a, &b);
    int64_t until = kvf_now_ns() + 10 * SEC;
    while (kvf_xfer_peer_status(p) == KVF_ERR_BUSY && kvf_now_ns() < until) {
        kvf_xfer_progress(a.x);
        kvf_xfer_progress(b.x);
    }
    assert_int_equal(kvf_xfer_peer_status(p), KVF_OK);
    int fd = kvf_xfer_event_fd(b.x);
    assert_true(fd >= 0);
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_expect(b.x, 5, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
    /* Idle receiver: drain, then arm (may take a few tries while wire-up traffic settles). */
    bool armed = false;
    for (int i = 0; i < 1000 && !armed; i++) {
        kvf_xfer_progress(b.x);
        armed = kvf_xfer_arm(b.x);
    }
    assert_true(armed);
    kvf_xfer_pair pr[] = {{3, 4}, {4, 5}};
    assert_int_equal(kvf_xfer_write(a.x, p, 5, pr, 2, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
    /* The receiver does nothing until its fd says there is work. */
    kvf_xfer_event ev;
    bool woke = false, recv = false, sent = false;
    until = kvf_now_ns() + 10 * SEC;
    while (!(recv && sent) && kvf_now_ns() < until) {
        kvf_xfer_progress(a.x);
        if (kvf_xfer_poll(a.x, &ev)) {
            assert_int_equal(ev.status, KVF_OK);
            sent = true;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (!woke && poll(&pfd, 1, 0) > 0)
            woke = true;
        if (woke) {
            kvf_xfer_progress(b.x);
            if (kvf_xfer_poll(b.x, &ev)) {
                assert_int_equal(ev.id, 5);
                assert_int_equal(ev.status, KVF_OK);
                recv = true;
            }
        }
    }
    assert_true(woke);
    assert_true(recv && sent);
    assert_memory_equal(block(&b, 4), block(&a, 3), a.layout.block_bytes);
    assert_memory_equal(block(&b, 5), block(&a, 4), a.layout.block_bytes);
    side_close(&a);
    side_close(&b);
}

/* A write that reaches a receiver which already timed out: the receiver drops the notice (and,
 * on the am path, the bytes: the blocks stay as they were), the sender hears KVF_ERR_CANCELLED. */
static void late_write(const char *transport)
{
    side a, b;
    side_open(&a, "ucx", transport, 16, KVF_DTYPE_F16, 2, 8, 0);
    side_open(&b, "ucx", transport, 16, KVF_DTYPE_F16, 2, 8, 0);
    fill_pattern(&a, 2);
    kvf_xfer_peer *p = connect_to(&a, &b);
    kvf_err err = {0};
    kvf_xfer_event ev;
    kvf_log_set_level(KVF_LOG_ERROR);
    assert_int_equal(kvf_xfer_expect(b.x, 77, kvf_now_ns() + SEC / 20, &err), KVF_OK);
    assert_int_equal(kvf_xfer_wait(b.x, &ev, kvf_now_ns() + 5 * SEC, &err), KVF_OK);
    assert_int_equal(ev.status, KVF_ERR_TIMEOUT);
    kvf_xfer_pair pr[] = {{1, 2}, {2, 3}};
    assert_int_equal(kvf_xfer_write(a.x, p, 77, pr, 2, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
    bool sent = false;
    int64_t until = kvf_now_ns() + 10 * SEC;
    while (!sent && kvf_now_ns() < until) {
        kvf_xfer_progress(a.x);
        kvf_xfer_progress(b.x);
        assert_false(kvf_xfer_poll(b.x, &ev));
        if (kvf_xfer_poll(a.x, &ev)) {
            assert_int_equal(ev.id, 77);
            assert_int_equal(ev.status, KVF_ERR_CANCELLED);
            sent = true;
        }
    }
    kvf_log_set_level(KVF_LOG_INFO);
    assert_true(sent);
    kvf_xfer_stats s;
    kvf_xfer_stats_get(b.x, &s);
    assert_int_equal(s.late_notices, 1);
    if (strcmp(transport, "tcp") == 0) /* am path */
        for (int64_t i = 0; i < 8 * b.layout.block_bytes; i++)
            assert_int_equal(b.mem[i], 0);
    side_close(&a);
    side_close(&b);
}

/* A sender that cancels before its notice went out: its event says CANCELLED, the receiver never
 * hears of the transfer (its expectation times out), and a cancel of nothing is NOT_FOUND. */
static void sender_cancel(const char *transport)
{
    side a, b;
    side_open(&a, "ucx", transport, 16, KVF_DTYPE_F16, 2, 8, 0);
    side_open(&b, "ucx", transport, 16, KVF_DTYPE_F16, 2, 8, 0);
    kvf_xfer_peer *p = connect_to(&a, &b);
    kvf_err err = {0};
    kvf_log_set_level(KVF_LOG_ERROR);
    assert_int_equal(kvf_xfer_expect(b.x, 9, kvf_now_ns() + SEC / 2, &err), KVF_OK);
    kvf_xfer_pair pr[] = {{0, 0}, {1, 1}, {2, 2}};
    assert_int_equal(kvf_xfer_write(a.x, p, 9, pr, 3, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_cancel(a.x, 9, &err), KVF_OK);
    bool sent = false, recv = false;
    kvf_xfer_event ev;
    int64_t until = kvf_now_ns() + 10 * SEC;
    while (!(sent && recv) && kvf_now_ns() < until) {
        kvf_xfer_progress(a.x);
        kvf_xfer_progress(b.x);
        if (kvf_xfer_poll(a.x, &ev)) {
            assert_int_equal(ev.id, 9);
            assert_int_equal(ev.status, KVF_ERR_CANCELLED);
            sent = true;
        }
        if (kvf_xfer_poll(b.x, &ev)) {
            assert_int_equal(ev.id, 9);
            assert_int_equal(ev.status, KVF_ERR_TIMEOUT);
            recv = true;
        }
    }
    kvf_log_set_level(KVF_LOG_INFO);
    assert_true(sent && recv);
    assert_int_equal(kvf_xfer_cancel(a.x, 9, &err), KVF_ERR_NOT_FOUND);
    kvf_xfer_stats s;
    kvf_xfer_stats_get(a.x, &s);
    assert_int_equal(s.in_flight, 0);
    assert_int_equal(s.sent_failed, 1);
    side_close(&a);
    side_close(&b);
}

/* The attack: a sender without the transfer's token (it reached the notice channel or the UCX
 * listener, but was not handed the token over the control plane) writes an expected id. Its
 * notice is dropped and counted (no RECEIVED; on the am path its bytes do not land either),
 * the expectation stays, and the sender holding the token then completes the transfer. */
static void forged_write(const char *backend, const char *transport)
{
    side a, b;
    side_open(&a, backend, transport, 16, KVF_DTYPE_F16, 2, 8, 0);
    side_open(&b, backend, transport, 16, KVF_DTYPE_F16, 2, 8, 0);
    fill_pattern(&a, 3);
    kvf_xfer_peer *p = connect_to(&a, &b);
    kvf_err err = {0};
    kvf_xfer_token good, bad;
    assert_int_equal(kvf_xfer_token_new(&good, &err), KVF_OK);
    assert_int_equal(kvf_xfer_token_new(&bad, &err), KVF_OK);
    assert_memory_not_equal(good.b, bad.b, sizeof good.b);
    int32_t dst[] = {2, 3};
    assert_int_equal(kvf_xfer_expect_token(b.x, 88, &good, dst, 2, kvf_now_ns() + 20 * SEC, &err),
                     KVF_OK);
    kvf_xfer_pair pr[] = {{1, 2}, {2, 3}};
    kvf_log_set_level(KVF_LOG_ERROR);
    const kvf_xfer_token *tokens[2] = {&bad, NULL}; /* a wrong one, then none (zero) */
    for (int k = 0; k < 2; k++) {
        assert_int_equal(kvf_xfer_write_token(a.x, p, 88, tokens[k], pr, 2,
                                              kvf_now_ns() + 10 * SEC, &err), KVF_OK);
        bool sent = false;
        kvf_xfer_event ev;
        for (int64_t until = kvf_now_ns() + 10 * SEC; !sent && kvf_now_ns() < until;) {
            kvf_xfer_progress(a.x);
            kvf_xfer_progress(b.x);
            assert_false(kvf_xfer_poll(b.x, &ev));
            if (kvf_xfer_poll(a.x, &ev)) {
                assert_int_equal(ev.id, 88);
                sent = true;
            }
        }
        assert_true(sent);
        kvf_xfer_stats s;
        kvf_xfer_stats_get(b.x, &s);
        assert_true(s.forged_notices >= k + 1);
        assert_int_equal(s.received_ok, 0);
        assert_int_equal(s.expected, 1);
        if (transport && strcmp(transport, "tcp") == 0) /* am path: nothing landed */
            for (int64_t i = 0; i < 8 * b.layout.block_bytes; i++)
                assert_int_equal(b.mem[i], 0);
    }
    kvf_log_set_level(KVF_LOG_INFO);
    /* the sender given the token */
    assert_int_equal(kvf_xfer_write_token(a.x, p, 88, &good, pr, 2, kvf_now_ns() + 10 * SEC, &err),
                     KVF_OK);
    bool sent = false, recv = false;
    kvf_xfer_event ev;
    for (int64_t until = kvf_now_ns() + 10 * SEC; !(sent && recv) && kvf_now_ns() < until;) {
        kvf_xfer_progress(a.x);
        kvf_xfer_progress(b.x);
        if (kvf_xfer_poll(a.x, &ev)) {
            assert_int_equal(ev.status, KVF_OK);
            sent = true;
        }
        if (kvf_xfer_poll(b.x, &ev)) {
            assert_int_equal(ev.id, 88);
            assert_int_equal(ev.status, KVF_OK);
            recv = true;
        }
    }
    assert_true(sent && recv);
    assert_memory_equal(block(&b, 2), block(&a, 1), a.layout.block_bytes);
    assert_memory_equal(block(&b, 3), block(&a, 2), a.layout.block_bytes);
    side_close(&a);
    side_close(&b);
}

static void test_forged_notice_refused(void **state)
{
    forged_write("local", NULL);
    forged_write("ucx", "tcp");
    forged_write("ucx", "sm");
}

static void test_sender_cancel(void **state)
{
    sender_cancel("tcp");
    sender_cancel("sm");
}

static void test_late_write_refused(void **state)
{
    late_write("tcp");
    late_write("sm");
}

/* Both data paths over both transports ("auto" picks am for tcp, put for sm). */
static void test_data_paths_forced(void **state)
{
    data_path = "am";
    ucx_in_process("sm");
    data_path = "put";
    ucx_in_process("tcp");
    data_path = NULL;
    kvf_kv_layout l;
    kvf_err err = {0};
    assert_int_equal(kvf_kv_layout_init(1, 1, 8, 16, KVF_DTYPE_F32, &l, &err), KVF_OK);
    kvf_xfer_pool pool = {.base = NULL, .layout = l, .n_blocks = 1};
    kvf_xfer_cfg cfg = {.backend = "ucx", .transport = "tcp", .data_path = "rdma"};
    kvf_xfer *x = NULL;
    assert_int_equal(kvf_xfer_create(&cfg, &pool, &x, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "data path 'rdma'"));
    assert_null(x);
}

static void test_event_fd(void **state)
{
    side l;
    side_open(&l, "local", NULL, 16, KVF_DTYPE_F16, 2, 2, 0);
    assert_int_equal(kvf_xfer_event_fd(l.x), -1);
    assert_false(kvf_xfer_arm(l.x));
    side_close(&l);
    ucx_event_fd_wakes("tcp");
    transport_allocates = true; /* sm puts need no receiver progress then */
    ucx_event_fd_wakes("sm");
    transport_allocates = false;
}

/* The same with pools the transport allocated (UCX: mappable by a peer on the same host). */
static void test_transport_allocated_pools(void **state)
{
    transport_allocates = true;
    ucx_in_process("sm");
    ucx_in_process("tcp");
    transport_allocates = false;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_desc_round_trip),
        cmocka_unit_test(test_desc_corruptions_refused),
        cmocka_unit_test(test_layout_mismatch_refused_at_connect),
        cmocka_unit_test(test_bad_cfg_refused),
        cmocka_unit_test(test_cfg_table_lines),
        cmocka_unit_test(test_pairs_checked),
        cmocka_unit_test(test_random_lists_local),
        cmocka_unit_test(test_expect_timeout_cancel_and_late_notice),
        cmocka_unit_test(test_ucx_in_process_sm),
        cmocka_unit_test(test_ucx_in_process_tcp),
        cmocka_unit_test(test_transport_allocated_pools),
        cmocka_unit_test(test_event_fd),
        cmocka_unit_test(test_data_paths_forced),
        cmocka_unit_test(test_late_write_refused),
        cmocka_unit_test(test_sender_cancel),
        cmocka_unit_test(test_forged_notice_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
