/* test_gpu.c: the GPU paths of kvf_xfer on a machine without a GPU, through the host-memory
 * double of the GPU ops table (gpu_double.h): refusals (GPU backends without the table or
 * without a device, staging without ucx, missing destination blocks), descriptor round-trips and layout mismatch for cuda_ipc and nccl, the cuda_ipc
 * protocol between two real processes (its "device" pools in shared memory: random block lists
 * verified byte for byte, receiver killed, sender killed), and UCX with GPU pools through the
 * pinned staging mirror over tcp and shared memory (sender staging to a staging receiver, and a
 * plain UCX sender to a staging receiver). Every wait is bounded; children are killed. The nccl
 * protocol itself runs between two processes in nccl_test.c, on the NCCL emulation. */
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
#include "gpu_double.h"
#include "transport/xfer_impl.h" /* stage_rx: to cancel while a landing is being copied */
#include "peer_proto.h"
#include "peer_test.h"

extern char **environ;

static int spawn_peer(const char *role, const char *transport, int n_layers, int n_blocks,
                      bool staging)
{
    int sv[2];
    char fd_s[16], layers_s[16], blocks_s[16];
    peer_socketpair(sv, fd_s);
    snprintf(layers_s, sizeof layers_s, "%d", n_layers);
    snprintf(blocks_s, sizeof blocks_s, "%d", n_blocks);
    char *argv[] = {(char *)KVF_XFER_PEER_BIN, fd_s, (char *)role, (char *)transport, layers_s,
                    blocks_s, staging ? "staging" : NULL, NULL};
    return peer_spawn(KVF_XFER_PEER_BIN, argv, sv);
}

/* The shared memory of a killed child's "device" pool, which it could not remove. */
static void unlink_child_shm(pid_t pid)
{
    char name[48];
    snprintf(name, sizeof name, "/kvf-gpudbl-%d-0", (int)pid);
    shm_unlink(name);
}

/* Kills and reaps the child; removes the shared memory a killed child could not. */
static int reap_peer(void)
{
    return peer_reap(unlink_child_shm);
}

static int setup(void **state)
{
    dbl.available = true;
    dbl.why = NULL;
    return 0;
}

static int teardown(void **state)
{
    reap_peer();
    kvf_log_set_level(KVF_LOG_INFO);
    return 0;
}

/* A kvf_xfer on a "device" pool: "cuda_ipc" (shared-memory pool, IPC-able) or a ucx transport
 * with staging. pattern: filled like a sender's pool, else zeroed. */
static kvf_xfer *make_gpu_xfer(const char *transport, int n_layers, int n_blocks, bool pattern,
                               uint8_t **mem_out)
{
    kvf_kv_layout l = peer_layout(n_layers);
    bool ipc = strcmp(transport, "cuda_ipc") == 0;
    size_t bytes = (size_t)(n_blocks * l.block_bytes);
    uint8_t *mem = ipc ? gpu_double_dev_alloc(bytes) : aligned_alloc(4096, bytes);
    assert_non_null(mem);
    kvf_xfer_cfg cfg = {.backend = ipc ? "cuda_ipc" : "ucx", .transport = ipc ? NULL : transport,
                        .gpu = &gpu_double_ops, .gpu_staging = !ipc};
    kvf_xfer *x = peer_xfer_create(&cfg, mem, n_layers, n_blocks, pattern);
    assert_ptr_equal(kvf_xfer_pool_base(x), mem); /* the device pool, not the mirror */
    *mem_out = mem;
    return x;
}

static void free_gpu_mem(const char *transport, uint8_t *mem)
{
    if (strcmp(transport, "cuda_ipc") == 0)
        gpu_double_dev_free(mem);
    else
        free(mem);
}

/* ---- refusals ---- */

static kvf_status try_create(const kvf_xfer_cfg *cfg, void *base, kvf_xfer **x, kvf_err *err)
{
    kvf_xfer_pool pool = {.base = base, .layout = peer_layout(1), .n_blocks = 4};
    *x = NULL;
    return kvf_xfer_create(cfg, &pool, x, err);
}

static void assert_refused(const kvf_xfer_cfg *cfg, void *base, kvf_status want, const char *says)
{
    kvf_xfer *x;
    kvf_err err = {0};
    kvf_status st = try_create(cfg, base, &x, &err);
    if (st == KVF_OK)
        kvf_xfer_destroy(x);
    if (st != want || !strstr(err.msg, says))
        fail_msg("backend %s: got %s \"%s\", wanted %s with \"%s\"", cfg->backend,
                 kvf_status_str(st), err.msg, kvf_status_str(want), says);
}

static void test_refusals(void **state)
{
    static uint8_t mem[4 * 8192] __attribute__((aligned(64)));
    kvf_xfer_cfg c = {.backend = "cuda_ipc"};
    assert_refused(&c, mem, KVF_ERR_INVALID, "needs the GPU ops table");
    c.backend = "nccl";
#ifdef KVF_HAVE_NCCL
    assert_refused(&c, mem, KVF_ERR_INVALID, "needs the GPU ops table");
#else
    assert_refused(&c, mem, KVF_ERR_UNSUPPORTED, "built without NCCL");
#endif
    /* A table whose device is missing: the reason is passed on. */
    dbl.available = false;
    dbl.why = "no CUDA device: CUDA driver version is insufficient (35)";
    c = (kvf_xfer_cfg){.backend = "cuda_ipc", .gpu = &gpu_double_ops};
    assert_refused(&c, mem, KVF_ERR_UNSUPPORTED, "needs a GPU: no CUDA device");
    c = (kvf_xfer_cfg){.backend = "ucx", .gpu = &gpu_double_ops, .gpu_staging = true};
    assert_refused(&c, mem, KVF_ERR_UNSUPPORTED, "insufficient (35)");
    dbl.available = true;
    /* Staging is explicit and for ucx only; a GPU pool is the caller's. */
    c = (kvf_xfer_cfg){.backend = "ucx", .gpu = &gpu_double_ops};
    assert_refused(&c, mem, KVF_ERR_INVALID, "gpu_staging");
    c = (kvf_xfer_cfg){.backend = "ucx", .gpu_staging = true};
    assert_refused(&c, mem, KVF_ERR_INVALID, "needs the GPU ops table");
    c = (kvf_xfer_cfg){.backend = "local", .gpu = &gpu_double_ops, .gpu_staging = true};
    assert_refused(&c, mem, KVF_ERR_INVALID, "for backend ucx only");
    c = (kvf_xfer_cfg){.backend = "local", .gpu = &gpu_double_ops};
    assert_refused(&c, mem, KVF_ERR_INVALID, "cannot reach a GPU pool");
    c = (kvf_xfer_cfg){.backend = "cuda_ipc", .gpu = &gpu_double_ops};
    assert_refused(&c, NULL, KVF_ERR_INVALID, "must be given");
    /* cuda_ipc: the pool must be one exportable allocation (here: not a shared "device" one). */
    assert_refused(&c, mem, KVF_ERR_INVALID, "not the start of");
    kvf_xfer_gpu partial = gpu_double_ops;
    partial.ipc_open = NULL;
    c.gpu = &partial;
    assert_refused(&c, mem, KVF_ERR_INVALID, "has no IPC ops");
    partial = gpu_double_ops;
    partial.mark_query = NULL;
    c = (kvf_xfer_cfg){.backend = "ucx", .gpu = &partial, .gpu_staging = true};
    assert_refused(&c, mem, KVF_ERR_INVALID, "lacks an op");

    /* Staging receivers name their blocks. */
    kvf_xfer *x;
    kvf_err err = {0};
    c = (kvf_xfer_cfg){.backend = "ucx", .transport = "tcp", .gpu = &gpu_double_ops,
                       .gpu_staging = true};
    assert_int_equal(try_create(&c, mem, &x, &err), KVF_OK);
    assert_int_equal(kvf_xfer_expect(x, 1, kvf_now_ns() + SEC, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "kvf_xfer_expect_blocks"));
    int32_t bad[] = {1, 4};
    assert_int_equal(kvf_xfer_expect_blocks(x, 1, bad, 2, kvf_now_ns() + SEC, &err),
                     KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block 4 is not in this pool (0 to 3)"));
    int32_t twice[] = {2, 1, 2};
    assert_int_equal(kvf_xfer_expect_blocks(x, 1, twice, 3, kvf_now_ns() + SEC, &err),
                     KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block 2 appears twice"));
    int32_t good[] = {3, 0};
    assert_int_equal(kvf_xfer_expect_blocks(x, 1, good, 2, kvf_now_ns() + SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_cancel(x, 1, &err), KVF_OK);
    kvf_xfer_event ev;
    assert_true(kvf_xfer_poll(x, &ev));
    assert_int_equal(ev.status, KVF_ERR_CANCELLED);
    kvf_xfer_destroy(x);
}

/* ---- descriptors ---- */

static void test_desc_roundtrip(void **state)
{
    kvf_kv_layout l = peer_layout(2);
    uint8_t *mem = gpu_double_dev_alloc((size_t)(8 * l.block_bytes));
    assert_non_null(mem);
    kvf_xfer_pool pool = {.base = mem, .layout = l, .n_blocks = 8};
    kvf_xfer_cfg c = {.backend = "cuda_ipc", .gpu = &gpu_double_ops};
    kvf_xfer *x, *y;
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_create(&c, &pool, &x, &err), KVF_OK);
    uint8_t *desc;
    size_t len;
    assert_int_equal(kvf_xfer_desc_export(x, &desc, &len, &err), KVF_OK);
    kvf_xfer_desc_info d;
    assert_int_equal(kvf_xfer_desc_parse(desc, len, &d, &err), KVF_OK);
    assert_string_equal(d.backend, "cuda_ipc");
    assert_int_equal(d.n_blocks, 8);
    assert_int_equal(d.layout.block_bytes, l.block_bytes);
    assert_true(d.blob_len > KVF_XFER_IPC_HANDLE_BYTES);
    /* One byte changed anywhere: refused by the checksum. */
    desc[len / 2] ^= 1;
    assert_int_equal(kvf_xfer_desc_parse(desc, len, &d, &err), KVF_ERR_PARSE);
    desc[len / 2] ^= 1;
    /* The same process cannot map its own handle: a clear refusal, not a CUDA error. */
    uint8_t *mem2 = gpu_double_dev_alloc((size_t)(8 * l.block_bytes));
    pool.base = mem2;
    assert_int_equal(kvf_xfer_create(&c, &pool, &y, &err), KVF_OK);
    kvf_xfer_peer *p;
    assert_int_equal(kvf_xfer_connect(y, desc, len, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "from this process"));
    kvf_xfer_destroy(y);
    /* A layout that differs is refused at connect, naming both values. */
    kvf_kv_layout l4 = peer_layout(4);
    uint8_t *mem3 = gpu_double_dev_alloc((size_t)(4 * l4.block_bytes));
    kvf_xfer_pool pool4 = {.base = mem3, .layout = l4, .n_blocks = 4};
    assert_int_equal(kvf_xfer_create(&c, &pool4, &y, &err), KVF_OK);
    assert_int_not_equal(kvf_xfer_connect(y, desc, len, &p, &err), KVF_OK);
    assert_non_null(strstr(err.msg, "n_layers"));
    assert_non_null(strstr(err.msg, "4"));
    assert_non_null(strstr(err.msg, "2"));
    kvf_xfer_destroy(y);
    /* A ucx side refuses a cuda_ipc descriptor, naming both backends. */
    kvf_xfer_cfg uc = {.backend = "ucx", .transport = "tcp", .gpu = &gpu_double_ops,
                       .gpu_staging = true};
    pool.base = mem2;
    assert_int_equal(kvf_xfer_create(&uc, &pool, &y, &err), KVF_OK);
    assert_int_equal(kvf_xfer_connect(y, desc, len, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'cuda_ipc'"));
    kvf_xfer_destroy(y);
    free(desc);
    kvf_xfer_destroy(x);
#ifdef KVF_HAVE_NCCL
    /* nccl (real libnccl here: no communicator is made): the descriptor round-trips, and a
     * cuda_ipc side refuses it, naming both backends. Connecting runs in nccl_test.c. */
    c.backend = "nccl";
    pool.base = mem;
    assert_int_equal(kvf_xfer_create(&c, &pool, &x, &err), KVF_OK);
    assert_int_equal(kvf_xfer_desc_export(x, &desc, &len, &err), KVF_OK);
    assert_int_equal(kvf_xfer_desc_parse(desc, len, &d, &err), KVF_OK);
    assert_string_equal(d.backend, "nccl");
    c.backend = "cuda_ipc";
    pool.base = mem2;
    assert_int_equal(kvf_xfer_create(&c, &pool, &y, &err), KVF_OK);
    assert_int_equal(kvf_xfer_connect(y, desc, len, &p, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'nccl'"));
    kvf_xfer_destroy(y);
    kvf_xfer_destroy(x);
    free(desc);
#endif
    gpu_double_dev_free(mem);
    gpu_double_dev_free(mem2);
    gpu_double_dev_free(mem3);
}

/* ---- staging in one process: cancel, and exactly one event each ---- */

/* A staging sender and a staging receiver in this process over UCX: a write cancelled while its
 * device -> mirror copies are pending ends CANCELLED (once the copies are done) and never reaches
 * the receiver; a receiver cannot cancel a transfer whose mirror -> device copies are running;
 * every write and expect gets exactly one event, and every byte lands in "device" memory. */
static void staging_one_process(const char *transport)
{
    enum { N = 16 };
    kvf_kv_layout l = peer_layout(1);
    int64_t bb = l.block_bytes;
    uint8_t *src = aligned_alloc(4096, (size_t)(N * bb)), *dst = aligned_alloc(4096, (size_t)(N * bb));
    for (int b = 0; b < N; b++)
        peer_fill_block(src + b * bb, bb, b);
    memset(dst, 0, (size_t)(N * bb));
    kvf_xfer_cfg c = {.backend = "ucx", .transport = transport, .gpu = &gpu_double_ops,
                      .gpu_staging = true};
    kvf_xfer_pool ps = {.base = src, .layout = l, .n_blocks = N}, pd = ps;
    pd.base = dst;
    kvf_xfer *tx, *rx;
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_create(&c, &ps, &tx, &err), KVF_OK);
    assert_int_equal(kvf_xfer_create(&c, &pd, &rx, &err), KVF_OK);
    uint8_t *desc;
    size_t len;
    assert_int_equal(kvf_xfer_desc_export(rx, &desc, &len, &err), KVF_OK);
    kvf_xfer_peer *p;
    assert_int_equal(kvf_xfer_connect(tx, desc, len, &p, &err), KVF_OK);
    free(desc);
    int64_t until = kvf_now_ns() + 20 * SEC;
    while (kvf_xfer_peer_status(p) == KVF_ERR_BUSY && kvf_now_ns() < until) {
        kvf_xfer_progress(tx);
        kvf_xfer_progress(rx);
    }
    assert_int_equal(kvf_xfer_peer_status(p), KVF_OK);

    kvf_xfer_pair pairs[N];
    int32_t dsts[N];
    for (int i = 0; i < N; i++) {
        pairs[i] = (kvf_xfer_pair){.src = i, .dst = N - 1 - i};
        dsts[i] = N - 1 - i;
    }
    /* Cancelled while staging: CANCELLED, nothing expected at the receiver changes. */
    assert_int_equal(kvf_xfer_write(tx, p, 1, pairs, N, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_write(tx, p, 1, pairs, N, kvf_now_ns() + 10 * SEC, &err),
                     KVF_ERR_EXISTS);
    assert_int_equal(kvf_xfer_cancel(tx, 1, &err), KVF_OK);
    kvf_xfer_event ev;
    assert_int_equal(kvf_xfer_wait(tx, &ev, kvf_now_ns() + 5 * SEC, &err), KVF_OK);
    assert_int_equal(ev.id, 1);
    assert_int_equal(ev.status, KVF_ERR_CANCELLED);
    /* A real one: RECEIVED only after the mirror -> device copies, with every byte in place. */
    assert_int_equal(kvf_xfer_expect_blocks(rx, 2, dsts, N, kvf_now_ns() + 10 * SEC, &err),
                     KVF_OK);
    assert_int_equal(kvf_xfer_write(tx, p, 2, pairs, N, kvf_now_ns() + 10 * SEC, &err), KVF_OK);
    bool sent = false, received = false, tried_cancel = false;
    until = kvf_now_ns() + 20 * SEC;
    while ((!sent || !received) && kvf_now_ns() < until) {
        kvf_xfer_progress(tx);
        kvf_xfer_progress(rx);
        if (!received && !tried_cancel && rx->stage_rx) {
            assert_int_equal(kvf_xfer_cancel(rx, 2, &err), KVF_ERR_STATE);
            tried_cancel = true;
        }
        while (kvf_xfer_poll(tx, &ev)) {
            assert_false(sent);
            assert_int_equal(ev.id, 2);
            assert_int_equal(ev.status, KVF_OK);
            sent = true;
        }
        while (kvf_xfer_poll(rx, &ev)) {
            assert_false(received);
            assert_int_equal(ev.kind, KVF_XFER_RECEIVED);
            assert_int_equal(ev.id, 2);
            assert_int_equal(ev.status, KVF_OK);
            for (int i = 0; i < N; i++)
                assert_int_equal(peer_check_block(dst + (N - 1 - i) * bb, bb, i), 0);
            received = true;
        }
    }
    assert_true(sent && received && tried_cancel);
    for (int i = 0; i < 50; i++) {
        kvf_xfer_progress(tx);
        kvf_xfer_progress(rx);
    }
    assert_false(kvf_xfer_poll(tx, &ev));
    assert_false(kvf_xfer_poll(rx, &ev));
    kvf_xfer_stats s;
    kvf_xfer_stats_get(rx, &s);
    assert_int_equal(s.received_ok, 1);
    assert_int_equal(s.expected, 0);
    kvf_xfer_stats_get(tx, &s);
    assert_int_equal(s.sent_ok, 1);
    assert_int_equal(s.sent_failed, 1);
    assert_int_equal(s.in_flight, 0);
    kvf_xfer_disconnect(tx, p);
    kvf_xfer_destroy(tx);
    kvf_xfer_destroy(rx);
    free(src);
    free(dst);
}

static void test_staging_one_process_tcp(void **state)
{
    staging_one_process("tcp");
}

static void test_staging_one_process_sm(void **state)
{
    staging_one_process("sm");
}

/* ---- two processes ---- */

/* A receiving child on transport (its pool n_blocks blocks, staged when child_staging) and our
 * GPU-pool sender of `src_blocks` blocks connected to it: returns the sender, with the child's
 * socket, our device memory and the peer. */
static kvf_xfer *open_to_receiver(const char *transport, int n_layers, int dst_blocks,
                                  int src_blocks, bool child_staging, int *fd_out,
                                  uint8_t **mem_out, kvf_xfer_peer **peer_out)
{
    *fd_out = spawn_peer("recv", transport, n_layers, dst_blocks, child_staging);
    kvf_xfer *x = make_gpu_xfer(transport, n_layers, src_blocks, true, mem_out);
    expect_msg(*fd_out, x, MSG_DESC, 20 * SEC);
    *peer_out = connect_from_msg(x);
    return x;
}

/* Random lists, three transfers in flight at once, each verified by the receiver (the child). */
static void random_lists(const char *transport, bool child_staging)
{
    enum { SRC_BLOCKS = PEER_SRC_BLOCKS, DST_BLOCKS = PEER_DST_BLOCKS, BATCH = PEER_BATCH,
           ROUNDS = 6 };
    int fd;
    uint8_t *mem;
    kvf_xfer_peer *p;
    kvf_xfer *x = open_to_receiver(transport, 2, DST_BLOCKS, SRC_BLOCKS, child_staging, &fd,
                                   &mem, &p);
    int64_t copies0 = dbl.copies;
    peer_random_rounds(fd, x, p, 4321, ROUNDS);
    assert_true(dbl.copies > copies0); /* the bytes went through the GPU table's copies */
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.sent_ok, ROUNDS * BATCH);
    assert_int_equal(s.in_flight, 0);
    peer_send(fd, MSG_QUIT, NULL, 0);
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    free_gpu_mem(transport, mem);
    peer_wait_exit_ok();
}

static void test_cudaipc_random_lists(void **state)
{
    random_lists("cuda_ipc", false);
}

static void test_staging_random_lists_tcp(void **state)
{
    random_lists("tcp", true);
}

static void test_staging_random_lists_sm(void **state)
{
    random_lists("sm", true);
}

/* The receiver dies right after the write was posted: the sender's event is an error naming
 * the transfer, within the deadline. */
static void receiver_killed(const char *transport, bool staging)
{
    enum { LAYERS = 8, BLOCKS = 64 };
    int fd;
    uint8_t *mem;
    kvf_xfer_peer *p;
    kvf_xfer *x = open_to_receiver(transport, LAYERS, BLOCKS, BLOCKS, staging, &fd, &mem, &p);
    peer_receiver_killed(fd, x, p, BLOCKS, unlink_child_shm);
    kvf_xfer_event ev;
    assert_false(kvf_xfer_poll(x, &ev)); /* exactly one event */
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    free_gpu_mem(transport, mem);
}

static void test_cudaipc_receiver_killed(void **state)
{
    receiver_killed("cuda_ipc", false);
}

/* cuda_ipc cancel: before the notice went out the write ends CANCELLED (once its copies are
 * done) and the receiver hears nothing; the peer stays usable for the next write. */
static void test_cudaipc_cancel(void **state)
{
    enum { LAYERS = 2, BLOCKS = 16 };
    int fd;
    uint8_t *mem;
    kvf_xfer_peer *p;
    kvf_xfer *x = open_to_receiver("cuda_ipc", LAYERS, BLOCKS, BLOCKS, false, &fd, &mem, &p);
    kvf_xfer_pair pairs[BLOCKS];
    for (int i = 0; i < BLOCKS; i++)
        pairs[i] = (kvf_xfer_pair){.src = BLOCKS - 1 - i, .dst = i};
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_write(x, p, 5, pairs, BLOCKS, kvf_now_ns() + 5 * SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_write(x, p, 5, pairs, BLOCKS, kvf_now_ns() + 5 * SEC, &err),
                     KVF_ERR_EXISTS);
    assert_int_equal(kvf_xfer_cancel(x, 5, &err), KVF_OK);
    kvf_xfer_event ev;
    assert_int_equal(kvf_xfer_wait(x, &ev, kvf_now_ns() + 5 * SEC, &err), KVF_OK);
    assert_int_equal(ev.id, 5);
    assert_int_equal(ev.status, KVF_ERR_CANCELLED);
    assert_int_equal(kvf_xfer_cancel(x, 5, &err), KVF_ERR_NOT_FOUND);
    /* The same blocks again, expected this time: every byte verified by the child. */
    send_pairs(fd, MSG_EXPECT, 6, 20000, 0, pairs, BLOCKS);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    assert_int_equal(kvf_xfer_write(x, p, 6, pairs, BLOCKS, kvf_now_ns() + 20 * SEC, &err), KVF_OK);
    assert_int_equal(kvf_xfer_wait(x, &ev, kvf_now_ns() + 20 * SEC, &err), KVF_OK);
    assert_int_equal(ev.id, 6);
    assert_int_equal(ev.status, KVF_OK);
    expect_msg(fd, x, MSG_RESULT, 20 * SEC);
    uint64_t rid;
    int32_t st;
    int64_t bad;
    peer_get_result(&msg, &rid, &st, &bad);
    assert_int_equal(rid, 6);
    assert_int_equal(st, KVF_OK);
    assert_int_equal(bad, 0);
    assert_false(kvf_xfer_poll(x, &ev));
    reap_peer();
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    gpu_double_dev_free(mem);
}

/* The receiver stops (alive, silent) before acknowledging: the write ends TIMEOUT by its
 * deadline, naming the transfer. */
static void test_cudaipc_receiver_stalled(void **state)
{
    enum { LAYERS = 2, BLOCKS = 16 };
    int fd;
    uint8_t *mem;
    kvf_xfer_peer *p;
    kvf_xfer *x = open_to_receiver("cuda_ipc", LAYERS, BLOCKS, BLOCKS, false, &fd, &mem, &p);
    kvf_xfer_event ev;
    int64_t el = peer_stalled_write(fd, x, p, BLOCKS, &ev);
    assert_int_equal(ev.id, 21);
    assert_int_equal(ev.status, KVF_ERR_TIMEOUT);
    assert_true(el >= 2 * SEC && el <= 2 * SEC + 500 * MS);
    reap_peer();
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    gpu_double_dev_free(mem);
}

static void test_staging_receiver_killed_tcp(void **state)
{
    receiver_killed("tcp", true);
}

/* The sender dies right after posting its write: our expectation times out at its deadline,
 * naming the transfer; then a fresh sender fills the same blocks and every byte is right in
 * our "device" pool. With staging on our side only, the sender is plain UCX: the mirror is a
 * local matter, the descriptor is an ordinary ucx one. */
static void sender_killed(const char *transport, bool our_staging)
{
    enum { LAYERS = 8, BLOCKS = 64 };
    int64_t bb = peer_layout(LAYERS).block_bytes;
    uint8_t *mem;
    kvf_xfer *x = make_gpu_xfer(transport, LAYERS, BLOCKS, false, &mem);
    assert_true(our_staging || strcmp(transport, "cuda_ipc") == 0);
    uint8_t *desc;
    size_t len;
    kvf_err err = {0};
    assert_int_equal(kvf_xfer_desc_export(x, &desc, &len, &err), KVF_OK);
    kvf_xfer_pair pairs[BLOCKS];
    int32_t dsts[BLOCKS];
    peer_stride_pairs(pairs, dsts, BLOCKS);
    int fd = spawn_peer("send", transport, LAYERS, BLOCKS, false);
    assert_int_equal(peer_send(fd, MSG_DESC, desc, (uint32_t)len), 0);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    peer_expect_write_timeout(fd, x, pairs, dsts, BLOCKS, 1);
    int ws = reap_peer();
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);

    memset(mem, 0, (size_t)(BLOCKS * bb));
    fd = spawn_peer("send", transport, LAYERS, BLOCKS, false);
    assert_int_equal(peer_send(fd, MSG_DESC, desc, (uint32_t)len), 0);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    peer_expect_write_ok(fd, x, 10, pairs, dsts, BLOCKS);
    for (int i = 0; i < BLOCKS; i++)
        assert_int_equal(peer_check_block(mem + pairs[i].dst * bb, bb, pairs[i].src), 0);
    expect_msg(fd, x, MSG_SENT, 20 * SEC);
    reap_peer();
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.expected, 0);
    assert_int_equal(s.received_failed, 1);
    assert_int_equal(s.received_ok, 1);
    free(desc);
    kvf_xfer_destroy(x);
    free_gpu_mem(transport, mem);
}

static void test_cudaipc_sender_killed(void **state)
{
    sender_killed("cuda_ipc", false);
}

static void test_staging_receive_tcp(void **state)
{
    sender_killed("tcp", true);
}

static void test_staging_receive_sm(void **state)
{
    sender_killed("sm", true);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_desc_roundtrip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staging_one_process_tcp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staging_one_process_sm, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cudaipc_random_lists, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cudaipc_receiver_killed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cudaipc_receiver_stalled, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cudaipc_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cudaipc_sender_killed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staging_random_lists_tcp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staging_random_lists_sm, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staging_receiver_killed_tcp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staging_receive_tcp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staging_receive_sm, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
