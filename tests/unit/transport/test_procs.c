/* test_procs.c: kvf_xfer over UCX between two real processes (this one and the xfer_peer
 * helper, exec'ed fresh, talking over a socketpair in place of the control plane), over tcp and
 * over shared memory: random block-pair lists verified byte for byte at the receiver after the
 * completion notice; the receiver killed mid-transfer (the sender's event is an error, within
 * the deadline, naming the transfer, and its source blocks go back to its kv/pool.h pool); the
 * sender killed mid-transfer (the receiver's expectation times out, naming the transfer, and
 * the adopted destination blocks go back to the pool); the receiver stopped (SIGSTOP) mid-
 * transfer (the sender's write still ends by its deadline). Every wait is bounded; children are
 * killed. */
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <cmocka.h>

#include "common/log.h"
#include "kv/hash.h"
#include "kv/pool.h"
#include "peer_proto.h"
#include "peer_test.h"

extern char **environ;

/* Starts xfer_peer with one end of a socketpair; returns our end. */
static int spawn_peer(const char *role, const char *transport, int n_layers, int n_blocks)
{
    int sv[2];
    char fd_s[16], layers_s[16], blocks_s[16];
    peer_socketpair(sv, fd_s);
    snprintf(layers_s, sizeof layers_s, "%d", n_layers);
    snprintf(blocks_s, sizeof blocks_s, "%d", n_blocks);
    char *argv[] = {(char *)KVF_XFER_PEER_BIN, fd_s, (char *)role, (char *)transport, layers_s,
                    blocks_s, NULL};
    return peer_spawn(KVF_XFER_PEER_BIN, argv, sv);
}

/* Kills and reaps the child (if still there); returns its wait status. */
static int reap_peer(void)
{
    return peer_reap(NULL);
}

static int teardown(void **state)
{
    reap_peer();
    return 0;
}

/* kv/pool.h memory ops over a pool the transport allocated (how a worker gets a KV pool that
 * same-host peers can put into with one copy): the pool takes the xfer's memory as its one
 * allocation; copies are the host ones. */
static kvf_status xfer_mem_alloc(void *ctx, int64_t bytes, void **base_out, kvf_err *err)
{
    *base_out = kvf_xfer_pool_base(ctx);
    return KVF_OK;
}

static void xfer_mem_free(void *ctx, void *base, int64_t bytes)
{
}

static kvf_kv_mem_ops xfer_mem;

/* A real KV pool (kv/pool.h) and a kvf_xfer on its memory. Over tcp the pool allocates and
 * the transport registers it; over sm the transport allocates and the pool uses it. */
static kvf_kv_pool *make_kv_pool(const char *transport, int n_layers, int n_blocks,
                                 kvf_xfer **x_out)
{
    kvf_kv_pool_cfg cfg = {.layout = peer_layout(n_layers), .n_blocks = n_blocks};
    kvf_xfer_pool xp = {.base = NULL, .layout = cfg.layout, .n_blocks = n_blocks};
    kvf_xfer_cfg xc = {.backend = "ucx", .transport = transport};
    kvf_kv_pool *pool = NULL;
    kvf_err err = {0};
    bool transport_allocates = strcmp(transport, "sm") == 0;
    if (transport_allocates) {
        if (kvf_xfer_create(&xc, &xp, x_out, &err) != KVF_OK)
            fail_msg("create: %s", err.msg);
        xfer_mem = kvf_kv_mem_host;
        xfer_mem.name = "xfer";
        xfer_mem.alloc = xfer_mem_alloc;
        xfer_mem.free = xfer_mem_free;
        cfg.mem = &xfer_mem;
        cfg.mem_ctx = *x_out;
    }
    if (kvf_kv_pool_create(&cfg, &pool, &err) != KVF_OK)
        fail_msg("kv pool: %s", err.msg);
    if (!transport_allocates) {
        xp.base = kvf_kv_pool_base(pool);
        if (kvf_xfer_create(&xc, &xp, x_out, &err) != KVF_OK)
            fail_msg("create: %s", err.msg);
    }
    assert_ptr_equal(kvf_kv_pool_base(pool), kvf_xfer_pool_base(*x_out));
    return pool;
}

static void assert_all_free(kvf_kv_pool *kp)
{
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(kp, &ps);
    assert_int_equal(ps.used, 0);
    assert_int_equal(ps.free + ps.cached, ps.total);
}

static kvf_xfer *make_xfer(const char *transport, int n_layers, int n_blocks, bool pattern,
                           uint8_t **mem_out)
{
    kvf_xfer_cfg cfg = {.backend = "ucx", .transport = transport};
    return peer_make_xfer(&cfg, n_layers, n_blocks, pattern, mem_out);
}

/* Random lists, three transfers in flight at once, each verified by the receiver. */
static void random_lists(const char *transport)
{
    enum { SRC_BLOCKS = PEER_SRC_BLOCKS, DST_BLOCKS = PEER_DST_BLOCKS, BATCH = PEER_BATCH,
           ROUNDS = 10 };
    int fd = spawn_peer("recv", transport, 2, DST_BLOCKS);
    uint8_t *mem;
    kvf_xfer *x = make_xfer(transport, 2, SRC_BLOCKS, true, &mem);
    expect_msg(fd, x, MSG_DESC, 20 * SEC);
    kvf_xfer_peer *p = connect_from_msg(x);
    peer_random_rounds(fd, x, p, 1234, ROUNDS);
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.sent_ok, ROUNDS * BATCH);
    assert_int_equal(s.in_flight, 0);
    assert_true(s.puts <= s.bytes / peer_layout(2).block_bytes); /* coalescing never adds puts */
    peer_send(fd, MSG_QUIT, NULL, 0);
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    free(mem);
    peer_wait_exit_ok();
}

static void test_random_lists_tcp(void **state)
{
    random_lists("tcp");
}

static void test_random_lists_sm(void **state)
{
    random_lists("sm");
}

/* The receiver dies right after the sender posted a 64 MiB write: the sender's event names the
 * transfer, is an error, and arrives within the deadline; the peer is then unusable. */
static void receiver_killed(const char *transport)
{
    enum { LAYERS = 32, BLOCKS = 256 }; /* 256 KiB blocks, 64 MiB */
    int fd = spawn_peer("recv", transport, LAYERS, BLOCKS);
    /* The sender's KV: a sequence of BLOCKS blocks in a real pool, as prefill would hold it. */
    kvf_xfer *x;
    kvf_kv_pool *kp = make_kv_pool(transport, LAYERS, BLOCKS, &x);
    kvf_kv_seq seq;
    kvf_kv_seq_init(&seq, kp, kvf_kv_hash_root("test", NULL, 0));
    kvf_err err = {0};
    assert_int_equal(kvf_kv_seq_prepare_write(&seq, (int64_t)BLOCKS * 16, &err), KVF_OK);
    assert_int_equal(seq.n_blocks, BLOCKS);
    int64_t bb = peer_layout(LAYERS).block_bytes;
    for (int i = 0; i < BLOCKS; i++)
        peer_fill_block((uint8_t *)kvf_kv_pool_base(kp) + seq.blocks[i] * bb, bb, seq.blocks[i]);
    expect_msg(fd, x, MSG_DESC, 20 * SEC);
    kvf_xfer_peer *p = connect_from_msg(x);
    kvf_xfer_pair pairs[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) /* reversed destinations: no runs, 256 puts */
        pairs[i] = (kvf_xfer_pair){.src = seq.blocks[i], .dst = BLOCKS - 1 - i};
    send_pairs(fd, MSG_EXPECT, 7, 20000, 0, pairs, BLOCKS);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    int64_t t0 = kvf_now_ns(), deadline = t0 + 3 * SEC;
    kvf_log_set_level(KVF_LOG_ERROR);
    assert_int_equal(kvf_xfer_write(x, p, 7, pairs, BLOCKS, deadline, &err), KVF_OK);
    int ws = reap_peer(); /* before any progress: the notice cannot have been acknowledged */
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
    kvf_xfer_event ev;
    assert_int_equal(kvf_xfer_wait(x, &ev, deadline + 2 * SEC, &err), KVF_OK);
    int64_t el = kvf_now_ns() - t0;
    assert_int_equal(ev.kind, KVF_XFER_SENT);
    assert_int_equal(ev.id, 7);
    if (ev.status != KVF_ERR_PEER_LOST && ev.status != KVF_ERR_TIMEOUT)
        fail_msg("transfer 7 ended with %s", kvf_status_str(ev.status));
    assert_true(el <= 3 * SEC + 500 * MS);
    /* Nothing of it is left in flight: the source blocks may go back to the pool. */
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.in_flight, 0);
    assert_int_equal(s.sent_failed, 1);
    /* The event named transfer 7, whose source blocks the sequence holds: give them back. */
    kvf_kv_pool_stats ps;
    kvf_kv_pool_get_stats(kp, &ps);
    assert_int_equal(ps.used, BLOCKS);
    /* A second write to the dead peer also ends in an error, within its own deadline. */
    t0 = kvf_now_ns();
    kvf_status st = kvf_xfer_write(x, p, 8, pairs, 4, t0 + SEC, &err);
    if (st == KVF_OK) {
        assert_int_equal(kvf_xfer_wait(x, &ev, t0 + 3 * SEC, &err), KVF_OK);
        assert_int_equal(ev.id, 8);
        assert_int_not_equal(ev.status, KVF_OK);
        assert_true(kvf_now_ns() - t0 <= SEC + 500 * MS);
    } else {
        assert_int_equal(st, KVF_ERR_PEER_LOST);
    }
    kvf_log_set_level(KVF_LOG_INFO);
    assert_int_equal(kvf_kv_seq_free(&seq, &err), KVF_OK);
    assert_all_free(kp);
    kvf_xfer_disconnect(x, p);
    kvf_kv_seq_fini(&seq);
    kvf_kv_pool_destroy(kp);
    kvf_xfer_destroy(x); /* after the pool: over sm the pool's memory is the transport's */
}

static void test_receiver_killed_tcp(void **state)
{
    receiver_killed("tcp");
}

static void test_receiver_killed_sm(void **state)
{
    receiver_killed("sm");
}

/* The receiver stops (SIGSTOP: alive but silent, like a cut link) mid-transfer: the sender's
 * write still ends by its deadline, with an error naming it, and never hangs. */
static void receiver_stalled(const char *transport)
{
    enum { LAYERS = 32, BLOCKS = 256 };
    int fd = spawn_peer("recv", transport, LAYERS, BLOCKS);
    uint8_t *mem;
    kvf_xfer *x = make_xfer(transport, LAYERS, BLOCKS, true, &mem);
    expect_msg(fd, x, MSG_DESC, 20 * SEC);
    kvf_xfer_peer *p = connect_from_msg(x);
    kvf_xfer_event ev;
    int64_t el = peer_stalled_write(fd, x, p, BLOCKS, &ev);
    assert_int_equal(ev.kind, KVF_XFER_SENT);
    assert_int_equal(ev.id, 21);
    if (ev.status != KVF_ERR_TIMEOUT && ev.status != KVF_ERR_PEER_LOST)
        fail_msg("transfer 21 ended with %s", kvf_status_str(ev.status));
    assert_true(el <= 2 * SEC + 500 * MS);
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.in_flight, 0);
    kvf_log_set_level(KVF_LOG_INFO);
    reap_peer(); /* SIGKILL works on a stopped process */
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    free(mem);
}

static void test_receiver_stalled_tcp(void **state)
{
    receiver_stalled("tcp");
}

static void test_receiver_stalled_sm(void **state)
{
    receiver_stalled("sm");
}

/* The sender dies right after posting its puts: our expectation times out at its deadline and
 * names the transfer, so the caller can return its destination blocks; then a fresh sender
 * writes into the same blocks and every byte is right. */
static void sender_killed(const char *transport)
{
    enum { LAYERS = 32, BLOCKS = 128 };
    int64_t bb = peer_layout(LAYERS).block_bytes;
    kvf_xfer *x;
    kvf_kv_pool *kp = make_kv_pool(transport, LAYERS, BLOCKS, &x);
    uint8_t *mem = kvf_kv_pool_base(kp);
    memset(mem, 0, (size_t)(BLOCKS * bb));
    /* The destination blocks a decode worker would hand the prefill worker: adopted by a
     * sequence, so they are USED until the transfer ends one way or the other. */
    kvf_kv_seq seq;
    kvf_kv_seq_init(&seq, kp, kvf_kv_hash_root("test", NULL, 0));
    int32_t ids[BLOCKS];
    for (int i = 0; i < BLOCKS; i++)
        ids[i] = i;
    uint8_t *desc;
    size_t len;
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_desc_export(x, &desc, &len, &err), KVF_OK);
    kvf_xfer_pair pairs[BLOCKS];
    for (int i = 0; i < BLOCKS; i++)
        pairs[i] = (kvf_xfer_pair){.src = i, .dst = i};

    int fd = spawn_peer("send", transport, LAYERS, BLOCKS);
    assert_int_equal(peer_send(fd, MSG_DESC, desc, (uint32_t)len), 0);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    assert_int_equal(kvf_kv_seq_adopt(&seq, ids, BLOCKS, (int64_t)BLOCKS * 16, &err), KVF_OK);
    peer_expect_write_timeout(fd, x, pairs, NULL, BLOCKS, 1);
    int ws = reap_peer();
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.expected, 0);
    assert_int_equal(s.received_failed, 1);
    /* The event named transfer 9: its destination blocks return to the pool. */
    assert_int_equal(kvf_kv_seq_free(&seq, &err), KVF_OK);
    assert_all_free(kp);

    /* A healthy sender fills the same blocks, adopted again; every byte is right. */
    memset(mem, 0, (size_t)(BLOCKS * bb));
    assert_int_equal(kvf_kv_seq_reset(&seq, kvf_kv_hash_root("test", NULL, 0), &err), KVF_OK);
    assert_int_equal(kvf_kv_seq_adopt(&seq, ids, BLOCKS, (int64_t)BLOCKS * 16, &err), KVF_OK);
    fd = spawn_peer("send", transport, LAYERS, BLOCKS);
    assert_int_equal(peer_send(fd, MSG_DESC, desc, (uint32_t)len), 0);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    peer_expect_write_ok(fd, x, 10, pairs, NULL, BLOCKS);
    for (int b = 0; b < BLOCKS; b++)
        assert_int_equal(peer_check_block(mem + b * bb, bb, b), 0);
    expect_msg(fd, x, MSG_SENT, 20 * SEC);
    kvf_log_set_level(KVF_LOG_INFO);
    reap_peer();
    assert_int_equal(kvf_kv_seq_free(&seq, &err), KVF_OK);
    assert_all_free(kp);
    free(desc);
    kvf_kv_seq_fini(&seq);
    kvf_kv_pool_destroy(kp);
    kvf_xfer_destroy(x);
}

static void test_sender_killed_tcp(void **state)
{
    sender_killed("tcp");
}

static void test_sender_killed_sm(void **state)
{
    sender_killed("sm");
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_random_lists_tcp, teardown),
        cmocka_unit_test_teardown(test_random_lists_sm, teardown),
        cmocka_unit_test_teardown(test_receiver_killed_tcp, teardown),
        cmocka_unit_test_teardown(test_receiver_killed_sm, teardown),
        cmocka_unit_test_teardown(test_receiver_stalled_tcp, teardown),
        cmocka_unit_test_teardown(test_receiver_stalled_sm, teardown),
        cmocka_unit_test_teardown(test_sender_killed_tcp, teardown),
        cmocka_unit_test_teardown(test_sender_killed_sm, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
