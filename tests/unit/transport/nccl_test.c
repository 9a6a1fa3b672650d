/* nccl_test.c (transport_nccl_emu): the nccl backend between two real processes on a machine
 * without a GPU: the test-only transport copy built against the NCCL emulation (nccl_emu.h),
 * "device" pools in host memory and NCCL operations ordered on the GPU double's stream
 * (gpu_double.h), xfer_peer_emu as the other process. Plain kvf_xfer_connect sets the pair up
 * (the hello with the unique id goes over the notice channel). Cases: hellos a receiver must
 * refuse (no unique id, one NCCL refuses: the channel is dropped), random run lists (several
 * transfers in flight; gathered and single-run sends, receiver scatter), receiver killed, sender
 * killed before and after its notice and send went out, cancel and a write that reaches a
 * receiver that gave up, receiver stalled (the sender's deadline aborts the communicator); after
 * each, every mark, staging buffer, stream gate, NCCL operation and communicator is freed here,
 * and the child checks the same at its clean exit. Every wait is bounded; children are killed. */
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
#include <arpa/inet.h>
#include <netinet/in.h>
#include <cmocka.h>

#include <nccl.h>

#include "common/log.h"
#include "nccl_emu.h"
#include "gpu_double.h"
#include "peer_proto.h"
#include "peer_test.h"

extern char **environ;

static int spawn_peer(const char *role, int n_layers, int n_blocks)
{
    int sv[2];
    char fd_s[16], layers_s[16], blocks_s[16];
    peer_socketpair(sv, fd_s);
    snprintf(layers_s, sizeof layers_s, "%d", n_layers);
    snprintf(blocks_s, sizeof blocks_s, "%d", n_blocks);
    char *argv[] = {(char *)KVF_XFER_PEER_BIN, fd_s, (char *)role, "nccl", layers_s, blocks_s,
                    NULL};
    return peer_spawn(KVF_XFER_PEER_BIN, argv, sv);
}

/* What was alive when the test began (a failed test leaves its objects behind). */
static kvf_nccl_emu_stats base_emu;
static int64_t base_marks, base_dev, base_gates;

static int setup(void **state)
{
    kvf_nccl_emu_stats_get(&base_emu);
    base_marks = dbl.marks_live;
    base_dev = dbl.dev_live;
    base_gates = dbl.gates_live;
    dbl.available = true;
    dbl.why = NULL;
    kvf_nccl_emu_set_streams(&gpu_double_nccl_streams);
    kvf_nccl_emu_hold_sends(false);
    return 0;
}

static int teardown(void **state)
{
    peer_reap(NULL);
    kvf_log_set_level(KVF_LOG_INFO);
    return 0;
}

/* A nccl kvf_xfer on a host-memory "device" pool, filled with the pattern or zeroed. */
static kvf_xfer *make_xfer(int n_layers, int n_blocks, bool pattern, uint8_t **mem_out)
{
    kvf_xfer_cfg cfg = {.backend = "nccl", .gpu = &gpu_double_ops};
    return peer_make_xfer(&cfg, n_layers, n_blocks, pattern, mem_out);
}

/* After a kvf_xfer is destroyed: once the stream ran what was left on it, nothing the backend
 * made is still alive (marks, stream-ordered staging, gates, NCCL operations, communicators,
 * unique-id listeners). */
static void assert_all_freed(void)
{
    kvf_err err = {0};
    assert_int_equal(dbl_sync(NULL, &err), KVF_OK);
    kvf_nccl_emu_stats es;
    kvf_nccl_emu_stats_get(&es);
    int64_t left[6] = {dbl.marks_live - base_marks, dbl.dev_live - base_dev,
                       dbl.gates_live - base_gates, es.ops_live - base_emu.ops_live,
                       es.comms_live - base_emu.comms_live, es.listeners - base_emu.listeners};
    if (left[0] || left[1] || left[2] || left[3] || left[4] || left[5])
        fail_msg("left behind: %lld marks, %lld staging buffers, %lld stream gates, %lld NCCL "
                 "operations, %lld communicators, %lld unique-id listeners", (long long)left[0],
                 (long long)left[1], (long long)left[2], (long long)left[3], (long long)left[4],
                 (long long)left[5]);
}

/* A receiving child and our sender connected to it with plain kvf_xfer_connect (waits until
 * the pair is usable: both communicator inits done, the channel up). */
static kvf_xfer *open_to_receiver(int n_layers, int dst_blocks, int src_blocks, int *fd_out,
                                  uint8_t **mem_out, kvf_xfer_peer **peer_out)
{
    *fd_out = spawn_peer("recv", n_layers, dst_blocks);
    kvf_xfer *x = make_xfer(n_layers, src_blocks, true, mem_out);
    expect_msg(*fd_out, x, MSG_DESC, 20 * SEC);
    *peer_out = connect_from_msg(x);
    return x;
}

static void close_sender(kvf_xfer *x, kvf_xfer_peer *p, uint8_t *mem)
{
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    free(mem);
    assert_all_freed();
}

/* Asks the child to quit, checks it exited cleanly (its own check: nothing left behind), then
 * closes our sender. */
static void quit_and_close(int fd, kvf_xfer *x, kvf_xfer_peer *p, uint8_t *mem)
{
    peer_send(fd, MSG_QUIT, NULL, 0);
    peer_wait_exit_ok();
    close_sender(x, p, mem);
}

/* Waits for the child's MSG_RESULT of transfer id and checks it. */
static void expect_result(int fd, kvf_xfer *x, uint64_t id, kvf_status want)
{
    expect_msg(fd, x, MSG_RESULT, 20 * SEC);
    uint64_t rid;
    int32_t st;
    int64_t bad;
    peer_get_result(&msg, &rid, &st, &bad);
    assert_int_equal(rid, id);
    if (st != (int32_t)want || bad != 0)
        fail_msg("transfer %llu at the receiver: %s, %lld bytes differ (wanted %s, 0)",
                 (unsigned long long)id, kvf_status_str((kvf_status)st), (long long)bad,
                 kvf_status_str(want));
}

/* Random lists, three transfers in flight at once, each verified by the child: slices filled
 * in order (one run: sent straight from the pool, received straight into the blocks) or
 * shuffled (gathered into staging, scattered at the receiver). */
static void test_nccl_random_lists(void **state)
{
    enum { ROUNDS = 8 };
    int fd;
    uint8_t *mem;
    kvf_xfer_peer *p;
    kvf_xfer *x = open_to_receiver(2, PEER_DST_BLOCKS, PEER_SRC_BLOCKS, &fd, &mem, &p);
    kvf_nccl_emu_stats e0, e1;
    kvf_nccl_emu_stats_get(&e0);
    int64_t copies0 = dbl.copies, allocs0 = dbl.dev_allocs;
    peer_random_rounds(fd, x, p, 4321, ROUNDS);
    kvf_nccl_emu_stats_get(&e1);
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.sent_ok, ROUNDS * PEER_BATCH);
    assert_int_equal(s.in_flight, 0);
    /* The bytes went through NCCL sends, and the gathered ones through the double's copies. */
    assert_int_equal(e1.sends_done - e0.sends_done, ROUNDS * PEER_BATCH);
    assert_true(e1.bytes_sent - e0.bytes_sent == s.bytes);
    assert_true(dbl.copies > copies0);
    /* Both paths ran: staging for the gathered writes, none for the single-run ones. */
    assert_true(dbl.dev_allocs > allocs0);
    assert_true(dbl.dev_allocs - allocs0 < ROUNDS * PEER_BATCH);
    quit_and_close(fd, x, p, mem);
}

/* The receiver dies right after the write: the sender's event is an error naming the transfer,
 * within the deadline. */
static void test_nccl_receiver_killed(void **state)
{
    enum { LAYERS = 8, BLOCKS = 64 };
    int fd;
    uint8_t *mem;
    kvf_xfer_peer *p;
    kvf_xfer *x = open_to_receiver(LAYERS, BLOCKS, BLOCKS, &fd, &mem, &p);
    peer_receiver_killed(fd, x, p, BLOCKS, NULL);
    assert_int_equal(kvf_xfer_peer_status(p), KVF_ERR_PEER_LOST);
    for (int i = 0; i < 20; i++)
        kvf_xfer_progress(x);
    kvf_xfer_event ev;
    assert_false(kvf_xfer_poll(x, &ev)); /* exactly one event */
    close_sender(x, p, mem);
}

/* The sender (the child) dies after its write: die=1 right after kvf_xfer_write (nothing went
 * out), die=2 after 300 ms of progress with its bytes held (the notice arrived, our recv was
 * posted and waits). Our expectation times out at its deadline, naming the transfer; then a
 * fresh sender fills the same blocks (shuffled: staging and scatter here) and every byte is
 * right. */
static void sender_killed(int die)
{
    enum { LAYERS = 8, BLOCKS = 64 };
    int64_t bb = peer_layout(LAYERS).block_bytes;
    uint8_t *mem;
    kvf_xfer *x = make_xfer(LAYERS, BLOCKS, false, &mem);
    uint8_t *desc;
    size_t len;
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_desc_export(x, &desc, &len, &err), KVF_OK);
    kvf_xfer_pair pairs[BLOCKS];
    int32_t dsts[BLOCKS];
    peer_stride_pairs(pairs, dsts, BLOCKS);
    int fd = spawn_peer("send", LAYERS, BLOCKS);
    assert_int_equal(peer_send(fd, MSG_DESC, desc, (uint32_t)len), 0);
    expect_msg(fd, x, MSG_READY, 20 * SEC); /* its pair is usable: our init ran on our progress */
    kvf_nccl_emu_stats e0, e1;
    kvf_nccl_emu_stats_get(&e0);
    peer_expect_write_timeout(fd, x, pairs, dsts, BLOCKS, die);
    int ws = peer_reap(NULL);
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
    /* die=2: the notice came and our recv was posted; die=1: nothing reached us. Either way
     * the pair's communicator was aborted here once the sender's end closed. */
    kvf_nccl_emu_stats_get(&e1);
    assert_int_equal(e1.ops_posted - e0.ops_posted, die == 2 ? 1 : 0);
    assert_int_equal(e1.recvs_done, e0.recvs_done);
    assert_int_equal(e1.aborts - e0.aborts, 1);

    memset(mem, 0, (size_t)(BLOCKS * bb));
    fd = spawn_peer("send", LAYERS, BLOCKS);
    assert_int_equal(peer_send(fd, MSG_DESC, desc, (uint32_t)len), 0);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    peer_expect_write_ok(fd, x, 10, pairs, dsts, BLOCKS);
    for (int i = 0; i < BLOCKS; i++)
        if (peer_check_block(mem + pairs[i].dst * bb, bb, pairs[i].src) != 0)
            fail_msg("block %d (from %d) differs after RECEIVED", pairs[i].dst, pairs[i].src);
    expect_msg(fd, x, MSG_SENT, 20 * SEC);
    peer_send(fd, MSG_QUIT, NULL, 0);
    peer_wait_exit_ok();
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.expected, 0);
    assert_int_equal(s.received_failed, 1);
    assert_int_equal(s.received_ok, 1);
    free(desc);
    kvf_xfer_destroy(x);
    free(mem);
    assert_all_freed();
}

static void test_nccl_sender_killed(void **state)
{
    sender_killed(1);
}

static void test_nccl_sender_killed_mid(void **state)
{
    sender_killed(2);
}

/* Cancel before the send was posted: CANCELLED, the receiver hears nothing. A write whose
 * receiver already gave up (its expectation timed out) is still taken there (into staging,
 * dropped) and ends CANCELLED here. The pair survives both: the next write lands. */
static void test_nccl_cancel(void **state)
{
    enum { LAYERS = 2, BLOCKS = 16 };
    int fd;
    uint8_t *mem;
    kvf_xfer_peer *p;
    kvf_xfer *x = open_to_receiver(LAYERS, BLOCKS, BLOCKS, &fd, &mem, &p);
    kvf_xfer_pair pairs[BLOCKS];
    for (int i = 0; i < BLOCKS; i++)
        pairs[i] = (kvf_xfer_pair){.src = BLOCKS - 1 - i, .dst = i};
    kvf_err err = {0};
    kvf_xfer_event ev;
    assert_int_equal(kvf_xfer_write(x, p, 5, pairs, BLOCKS, kvf_now_ns() + 5 * SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_write(x, p, 5, pairs, BLOCKS, kvf_now_ns() + 5 * SEC, &err),
                     KVF_ERR_EXISTS);
    assert_int_equal(kvf_xfer_cancel(x, 5, &err), KVF_OK);
    assert_int_equal(kvf_xfer_wait(x, &ev, kvf_now_ns() + 5 * SEC, &err), KVF_OK);
    assert_int_equal(ev.id, 5);
    assert_int_equal(ev.status, KVF_ERR_CANCELLED);
    assert_int_equal(kvf_xfer_cancel(x, 5, &err), KVF_ERR_NOT_FOUND);

    /* The receiver's expectation of 6 ends (1 ms) before our write: CANCELLED by its answer. */
    kvf_log_set_level(KVF_LOG_ERROR);
    send_pairs(fd, MSG_EXPECT, 6, 1, 0, pairs, BLOCKS);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    expect_result(fd, x, 6, KVF_ERR_TIMEOUT);
    assert_int_equal(kvf_xfer_write(x, p, 6, pairs, BLOCKS, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_wait(x, &ev, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
    assert_int_equal(ev.id, 6);
    assert_int_equal(ev.status, KVF_ERR_CANCELLED);
    assert_int_equal(kvf_xfer_peer_status(p), KVF_OK);

    /* The same blocks again, expected this time: every byte verified by the child. */
    send_pairs(fd, MSG_EXPECT, 7, 20000, 0, pairs, BLOCKS);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    assert_int_equal(kvf_xfer_write(x, p, 7, pairs, BLOCKS, kvf_now_ns() + 20 * SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_wait(x, &ev, kvf_now_ns() + 20 * SEC, &err), KVF_OK);
    assert_int_equal(ev.id, 7);
    assert_int_equal(ev.status, KVF_OK);
    expect_result(fd, x, 7, KVF_OK);
    assert_false(kvf_xfer_poll(x, &ev));
    quit_and_close(fd, x, p, mem);
}

/* The receiver stops (alive, silent) before its recv is posted: the send waits, as a kernel
 * would, until the write's deadline aborts the communicator; the event is TIMEOUT by the
 * deadline, and the pair is lost. */
static void test_nccl_receiver_stalled(void **state)
{
    enum { LAYERS = 2, BLOCKS = 16 };
    int fd;
    uint8_t *mem;
    kvf_xfer_peer *p;
    kvf_xfer *x = open_to_receiver(LAYERS, BLOCKS, BLOCKS, &fd, &mem, &p);
    kvf_nccl_emu_stats e0, e1;
    kvf_nccl_emu_stats_get(&e0);
    kvf_xfer_event ev;
    int64_t el = peer_stalled_write(fd, x, p, BLOCKS, &ev);
    assert_int_equal(ev.id, 21);
    assert_int_equal(ev.status, KVF_ERR_TIMEOUT);
    assert_true(el >= 2 * SEC && el <= 2 * SEC + 500 * MS);
    kvf_nccl_emu_stats_get(&e1);
    assert_int_equal(e1.aborts - e0.aborts, 1); /* the abort is what ended it */
    assert_int_equal(e1.sends_done, e0.sends_done);
    assert_int_equal(kvf_xfer_peer_status(p), KVF_ERR_PEER_LOST);
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_write(x, p, 22, (kvf_xfer_pair[]){{0, 0}}, 1,
                                    kvf_now_ns() + SEC, &err), KVF_ERR_PEER_LOST);
    peer_reap(NULL);
    close_sender(x, p, mem);
}

/* A raw TCP connection to x's notice channel (the address in its descriptor). */
static int raw_connect(kvf_xfer *x)
{
    uint8_t *desc;
    size_t len;
    kvf_err err = {0};
    kvf_xfer_desc_info d;
    assert_int_equal(kvf_xfer_desc_export(x, &desc, &len, &err), KVF_OK);
    assert_int_equal(kvf_xfer_desc_parse(desc, len, &d, &err), KVF_OK);
    const uint8_t *b = desc + d.blob_off; /* u16 port | u8 host length | host */
    char host[64] = {0};
    memcpy(host, b + 3, b[2]);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(b[0] | b[1] << 8))};
    assert_int_equal(inet_pton(AF_INET, host, &sa.sin_addr), 1);
    free(desc);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    return fd;
}

/* Sends one channel frame (xfer_chan.c: u32 type | i32 status | u64 id | u64 value | u32 body
 * length | u32 zero | 16-byte token | body) of type HELLO with value 77 and body_len bytes of
 * body. */
static void raw_hello(int fd, const uint8_t *body, uint32_t body_len)
{
    uint8_t h[48] = {1};
    h[16] = 77;
    memcpy(h + 24, &body_len, 4); /* little-endian host */
    assert_int_equal(peer_write_all(fd, h, sizeof h), 0);
    if (body_len)
        assert_int_equal(peer_write_all(fd, body, body_len), 0);
}

/* Whether x closed fd within 5 s (progressing x meanwhile). */
static bool closed_by(kvf_xfer *x, int fd)
{
    for (int64_t until = kvf_now_ns() + 5 * SEC; kvf_now_ns() < until;) {
        kvf_xfer_progress(x);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        char c;
        if (poll(&p, 1, 5) > 0 && recv(fd, &c, 1, MSG_DONTWAIT) == 0)
            return true;
    }
    return false;
}

/* A receiver given a hello with no unique id, or one NCCL refuses, kills that pair and drops
 * its channel at once (a real sender would see the peer lost, not wait), and keeps nothing. */
static void test_nccl_bad_hello(void **state)
{
    uint8_t *mem;
    kvf_xfer *x = make_xfer(1, 4, false, &mem);
    kvf_log_set_level(KVF_LOG_ERROR);
    int fd = raw_connect(x);
    raw_hello(fd, NULL, 0);
    assert_true(closed_by(x, fd));
    close(fd);
    uint8_t junk[128] = "not an id";
    fd = raw_connect(x);
    raw_hello(fd, junk, sizeof junk);
    assert_true(closed_by(x, fd));
    close(fd);
    /* A well-formed hello is taken: the channel stays while the init waits for its rank 0. */
    ncclUniqueId id;
    assert_int_equal(ncclGetUniqueId(&id), ncclSuccess);
    fd = raw_connect(x);
    raw_hello(fd, (const uint8_t *)id.internal, sizeof id.internal);
    for (int i = 0; i < 50; i++)
        kvf_xfer_progress(x);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 50), 0);
    close(fd); /* the sender goes: the pair dies with its channel */
    kvf_xfer_destroy(x);
    free(mem);
    /* The id's listener was taken by our rank-1 init (the ranks accept or connect by who holds
     * it); a rank 0 that never comes leaves nothing behind once the communicator is aborted. */
    assert_all_freed();
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_nccl_bad_hello, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nccl_random_lists, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nccl_receiver_killed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nccl_sender_killed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nccl_sender_killed_mid, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nccl_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nccl_receiver_stalled, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
