/* peer_test.h: the parent side the two-process transport tests share (test_procs.c, test_gpu.c,
 * gpu_xfer.c): the child's pid and socket, starting and reaping it, waiting for and sending
 * peer_proto.h messages, connecting from a received descriptor, a kvf_xfer on a host pool, the
 * random-lists rounds (batches of transfers in flight at once, each verified by the receiver),
 * and the writes to a killed receiver, from a killed sender and to a stopped receiver (also
 * nccl_test.c). Header-only; include after cmocka's headers and peer_proto.h. */
#ifndef KVF_TEST_PEER_TEST_H
#define KVF_TEST_PEER_TEST_H

#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "peer_proto.h"

#define MS 1000000LL
#define SEC 1000000000LL

static peer_msg msg;
static pid_t child = -1;
static int child_fd = -1;

extern char **environ;

/* Opens the socketpair to a child; fd_s gets its end (sv[1]) as text for its command line. */
static inline void peer_socketpair(int sv[2], char fd_s[16])
{
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    snprintf(fd_s, 16, "%d", sv[1]);
}

/* Starts bin with argv as the child, which keeps sv[1] and not sv[0]; returns our end. */
static inline int peer_spawn(const char *bin, char *const argv[], int sv[2])
{
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addclose(&fa, sv[0]);
    assert_int_equal(posix_spawn(&child, bin, &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(sv[1]);
    child_fd = sv[0];
    return sv[0];
}

/* Kills and reaps the child (if still there), calling after_kill (when not NULL) with its pid
 * for what a killed child could not clean up; returns its wait status. */
static inline int peer_reap(void (*after_kill)(pid_t pid))
{
    int ws = 0;
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, &ws, 0);
        if (after_kill)
            after_kill(child);
    }
    if (child_fd >= 0)
        close(child_fd);
    child = -1;
    child_fd = -1;
    return ws;
}

/* Waits for the child to exit by itself (after MSG_QUIT) and checks it exited with 0. */
static inline void peer_wait_exit_ok(void)
{
    int ws = 0;
    waitpid(child, &ws, 0);
    child = -1;
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
}

/* Waits for a message of type want, progressing x meanwhile. */
static inline void expect_msg(int fd, kvf_xfer *x, uint32_t want, int64_t timeout_ns)
{
    int r = peer_recv(fd, x, &msg, kvf_now_ns() + timeout_ns);
    if (r != 1 || msg.type != want)
        fail_msg("waited for message %u: got %s (type %u)", want,
                 r == 0 ? "nothing" : r < 0 ? "a closed socket" : "another", msg.type);
}

static inline void send_pairs(int fd, uint32_t type, uint64_t id, int64_t timeout_ms, int die,
                              const kvf_xfer_pair *pairs, uint32_t n)
{
    static uint8_t buf[PEER_MAX_MSG];
    size_t off = 0;
    uint32_t d = (uint32_t)die;
    PEER_PUT(buf, off, id);
    PEER_PUT(buf, off, timeout_ms);
    if (type == MSG_WRITE)
        PEER_PUT(buf, off, d);
    PEER_PUT(buf, off, n);
    memcpy(buf + off, pairs, n * sizeof *pairs);
    off += n * sizeof *pairs;
    assert_int_equal(peer_send(fd, type, buf, (uint32_t)off), 0);
}

/* Connects x to the descriptor in msg (a MSG_DESC) and waits until the peer is wired up, so
 * "mid-transfer" in a test means mid-transfer, not mid-connect. */
static inline kvf_xfer_peer *connect_from_msg(kvf_xfer *x)
{
    assert_int_equal(msg.type, MSG_DESC);
    kvf_xfer_peer *p = NULL;
    kvf_err err = {0};
    if (kvf_xfer_connect(x, msg.data, msg.len, &p, &err) != KVF_OK)
        fail_msg("connect: %s", err.msg);
    int64_t until = kvf_now_ns() + 20 * SEC;
    while (kvf_xfer_peer_status(p) == KVF_ERR_BUSY && kvf_now_ns() < until)
        kvf_xfer_progress(x);
    assert_int_equal(kvf_xfer_peer_status(p), KVF_OK);
    return p;
}

/* A kvf_xfer made from cfg on the pool at mem (n_blocks blocks of peer_layout(n_layers)), which
 * is first filled with the pattern or zeroed. */
static inline kvf_xfer *peer_xfer_create(const kvf_xfer_cfg *cfg, uint8_t *mem, int n_layers,
                                         int n_blocks, bool pattern)
{
    kvf_kv_layout l = peer_layout(n_layers);
    for (int64_t b = 0; b < n_blocks; b++) {
        if (pattern)
            peer_fill_block(mem + b * l.block_bytes, l.block_bytes, b);
        else
            memset(mem + b * l.block_bytes, 0, (size_t)l.block_bytes);
    }
    kvf_xfer_pool pool = {.base = mem, .layout = l, .n_blocks = n_blocks};
    kvf_xfer *x = NULL;
    kvf_err err = {0};
    if (kvf_xfer_create(cfg, &pool, &x, &err) != KVF_OK)
        fail_msg("create: %s", err.msg);
    return x;
}

/* peer_xfer_create on a new host-memory pool; its memory (free it after the kvf_xfer) in
 * mem_out. */
static inline kvf_xfer *peer_make_xfer(const kvf_xfer_cfg *cfg, int n_layers, int n_blocks,
                                       bool pattern, uint8_t **mem_out)
{
    uint8_t *mem = aligned_alloc(4096, (size_t)(n_blocks * peer_layout(n_layers).block_bytes));
    assert_non_null(mem);
    *mem_out = mem;
    return peer_xfer_create(cfg, mem, n_layers, n_blocks, pattern);
}

/* A receiver killed mid-transfer: transfer 7 of blocks 0..n-1 to n-1..0 is expected by the
 * child, written with a 3 s deadline (the log set to errors only), then the child is killed
 * (peer_reap(after_kill)). The one event must be SENT for 7 with PEER_LOST or TIMEOUT within
 * 3.5 s of the write, and nothing left in flight. */
static inline void peer_receiver_killed(int fd, kvf_xfer *x, kvf_xfer_peer *p, int n,
                                        void (*after_kill)(pid_t pid))
{
    kvf_xfer_pair *pairs = malloc((size_t)n * sizeof *pairs);
    assert_non_null(pairs);
    for (int i = 0; i < n; i++)
        pairs[i] = (kvf_xfer_pair){.src = i, .dst = n - 1 - i};
    send_pairs(fd, MSG_EXPECT, 7, 20000, 0, pairs, (uint32_t)n);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    kvf_err err = {0};
    int64_t t0 = kvf_now_ns(), deadline = t0 + 3 * SEC;
    kvf_log_set_level(KVF_LOG_ERROR);
    assert_int_equal(kvf_xfer_write(x, p, 7, pairs, (uint32_t)n, deadline, &err), KVF_OK);
    free(pairs);
    int ws = peer_reap(after_kill);
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
    kvf_xfer_event ev;
    assert_int_equal(kvf_xfer_wait(x, &ev, deadline + 2 * SEC, &err), KVF_OK);
    assert_int_equal(ev.kind, KVF_XFER_SENT);
    assert_int_equal(ev.id, 7);
    if (ev.status != KVF_ERR_PEER_LOST && ev.status != KVF_ERR_TIMEOUT)
        fail_msg("transfer 7 ended with %s", kvf_status_str(ev.status));
    assert_true(kvf_now_ns() - t0 <= 3 * SEC + 500 * MS);
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.in_flight, 0);
    assert_int_equal(s.sent_failed, 1);
}

/* The pairs the sender-killed tests write: block i to block (i * 7) % n (7 is prime to the 64
 * blocks they use, so every block is hit once, shuffled); dsts gets the destinations. */
static inline void peer_stride_pairs(kvf_xfer_pair *pairs, int32_t *dsts, int n)
{
    for (int i = 0; i < n; i++) {
        pairs[i] = (kvf_xfer_pair){.src = i, .dst = (i * 7) % n};
        dsts[i] = pairs[i].dst;
    }
}

/* A sender killed mid-transfer: x expects transfer 9 into dsts (NULL: kvf_xfer_expect, no
 * blocks named) with a 2 s deadline (the log set to errors only) and the sending child on fd is
 * told to write pairs and die (die as in MSG_WRITE). The event must be RECEIVED for 9 with
 * TIMEOUT, 2 to 3 s after the expectation. */
static inline void peer_expect_write_timeout(int fd, kvf_xfer *x, const kvf_xfer_pair *pairs,
                                             const int32_t *dsts, int n, int die)
{
    kvf_err err = {0};
    int64_t t0 = kvf_now_ns();
    kvf_log_set_level(KVF_LOG_ERROR);
    if (dsts)
        assert_int_equal(kvf_xfer_expect_blocks(x, 9, dsts, (uint32_t)n, t0 + 2 * SEC, &err),
                         KVF_OK);
    else
        assert_int_equal(kvf_xfer_expect(x, 9, t0 + 2 * SEC, &err), KVF_OK);
    send_pairs(fd, MSG_WRITE, 9, 20000, die, pairs, (uint32_t)n);
    kvf_xfer_event ev;
    assert_int_equal(kvf_xfer_wait(x, &ev, t0 + 10 * SEC, &err), KVF_OK);
    int64_t el = kvf_now_ns() - t0;
    assert_int_equal(ev.kind, KVF_XFER_RECEIVED);
    assert_int_equal(ev.id, 9);
    assert_int_equal(ev.status, KVF_ERR_TIMEOUT);
    assert_true(el >= 2 * SEC && el < 3 * SEC);
}

/* The healthy write after a killed sender: x expects transfer id into dsts (NULL: as in
 * peer_expect_write_timeout), the sending child on fd writes pairs, and the event is id with OK
 * (the caller checks the bytes). */
static inline void peer_expect_write_ok(int fd, kvf_xfer *x, uint64_t id,
                                        const kvf_xfer_pair *pairs, const int32_t *dsts, int n)
{
    kvf_err err = {0};
    int64_t deadline = kvf_now_ns() + 20 * SEC;
    if (dsts)
        assert_int_equal(kvf_xfer_expect_blocks(x, id, dsts, (uint32_t)n, deadline, &err), KVF_OK);
    else
        assert_int_equal(kvf_xfer_expect(x, id, deadline, &err), KVF_OK);
    send_pairs(fd, MSG_WRITE, id, 20000, 0, pairs, (uint32_t)n);
    kvf_xfer_event ev;
    assert_int_equal(kvf_xfer_wait(x, &ev, kvf_now_ns() + 25 * SEC, &err), KVF_OK);
    assert_int_equal(ev.id, id);
    assert_int_equal(ev.status, KVF_OK);
}

/* A receiver stopped mid-transfer: transfer 21 of blocks 0..n-1 one to one is expected by the
 * child, which is stopped (SIGSTOP) once ready; then written with a 2 s deadline (the log set to
 * errors only) and its event waited for up to 3 s past that. Returns the time from the write
 * to the event, which is in ev. */
static inline int64_t peer_stalled_write(int fd, kvf_xfer *x, kvf_xfer_peer *p, int n,
                                         kvf_xfer_event *ev)
{
    kvf_xfer_pair *pairs = malloc((size_t)n * sizeof *pairs);
    assert_non_null(pairs);
    for (int i = 0; i < n; i++)
        pairs[i] = (kvf_xfer_pair){.src = i, .dst = i};
    send_pairs(fd, MSG_EXPECT, 21, 60000, 0, pairs, (uint32_t)n);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    assert_int_equal(kill(child, SIGSTOP), 0);
    kvf_err err = {0};
    kvf_log_set_level(KVF_LOG_ERROR);
    int64_t t0 = kvf_now_ns(), deadline = t0 + 2 * SEC;
    assert_int_equal(kvf_xfer_write(x, p, 21, pairs, (uint32_t)n, deadline, &err), KVF_OK);
    assert_int_equal(kvf_xfer_wait(x, ev, deadline + 3 * SEC, &err), KVF_OK);
    int64_t el = kvf_now_ns() - t0;
    free(pairs);
    return el;
}

enum { PEER_SRC_BLOCKS = 96, PEER_DST_BLOCKS = 64, PEER_BATCH = 3 };

/* rounds rounds of PEER_BATCH transfers in flight at once from x (a sender pool of
 * PEER_SRC_BLOCKS) to the receiving child on fd (PEER_DST_BLOCKS), random lists from rand()
 * seeded with seed: each transfer gets its own slice of the destination, filled in order or
 * shuffled; every SENT event and the receiver's byte check must be clean. Ids start at 1. */
static inline void peer_random_rounds(int fd, kvf_xfer *x, kvf_xfer_peer *p, unsigned seed,
                                      int rounds)
{
    enum { SRC_BLOCKS = PEER_SRC_BLOCKS, DST_BLOCKS = PEER_DST_BLOCKS, BATCH = PEER_BATCH };
    kvf_err err = {0};
    srand(seed);
    uint64_t id = 1;
    for (int round = 0; round < rounds; round++) {
        int perm[DST_BLOCKS / BATCH];
        for (int i = 0; i < DST_BLOCKS / BATCH; i++)
            perm[i] = i;
        for (int i = DST_BLOCKS / BATCH - 1; i > 0; i--) {
            int j = rand() % (i + 1), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        /* Disjoint destinations within a batch: each transfer gets its own slice. */
        kvf_xfer_pair pairs[BATCH][DST_BLOCKS];
        uint32_t n[BATCH];
        for (int t = 0; t < BATCH; t++) {
            n[t] = 1 + (uint32_t)(rand() % (DST_BLOCKS / BATCH));
            int s0 = rand() % SRC_BLOCKS;
            bool runs = rand() % 2;
            for (uint32_t i = 0; i < n[t]; i++) {
                /* A run fills the slice in order; otherwise the slice is visited shuffled. */
                int d = t * (DST_BLOCKS / BATCH) + (runs ? (int)i : perm[i]);
                pairs[t][i].dst = d;
                pairs[t][i].src = runs ? (s0 + (int)i) % SRC_BLOCKS : rand() % SRC_BLOCKS;
            }
            send_pairs(fd, MSG_EXPECT, id + t, 20000, 0, pairs[t], n[t]);
        }
        for (int t = 0; t < BATCH; t++)
            expect_msg(fd, x, MSG_READY, 20 * SEC);
        for (int t = 0; t < BATCH; t++)
            assert_int_equal(kvf_xfer_write(x, p, id + t, pairs[t], n[t],
                                            kvf_now_ns() + 20 * SEC, &err), KVF_OK);
        int sent = 0, results = 0;
        int64_t until = kvf_now_ns() + 30 * SEC;
        while ((sent < BATCH || results < BATCH) && kvf_now_ns() < until) {
            kvf_xfer_event ev;
            while (kvf_xfer_poll(x, &ev)) {
                assert_int_equal(ev.kind, KVF_XFER_SENT);
                assert_true(ev.id >= id && ev.id < id + BATCH);
                if (ev.status != KVF_OK)
                    fail_msg("transfer %llu: %s", (unsigned long long)ev.id,
                             kvf_status_str(ev.status));
                sent++;
            }
            int r = peer_recv(fd, x, &msg, kvf_now_ns() + 20 * MS);
            assert_true(r >= 0);
            if (r == 1) {
                assert_int_equal(msg.type, MSG_RESULT);
                uint64_t rid;
                int32_t st;
                int64_t bad;
                peer_get_result(&msg, &rid, &st, &bad);
                assert_true(rid >= id && rid < id + BATCH);
                assert_int_equal(st, KVF_OK);
                if (bad != 0)
                    fail_msg("transfer %llu: %lld bytes differ at the receiver",
                             (unsigned long long)rid, (long long)bad);
                results++;
            }
        }
        assert_int_equal(sent, BATCH);
        assert_int_equal(results, BATCH);
        id += BATCH;
    }
}

#endif
