/* gpu_xfer.c: GPU-to-GPU KV transfer between two real processes (label gpu; prints "skipped:"
 * and exits 77 without a device). This program is both sides: the test re-executes itself as
 * the peer ("gpu_xfer child <fd> recv|send <backend> <device>"), before any CUDA call, and they
 * talk over a socketpair in place of the control plane (peer_proto.h). Cases: cuda_ipc on one
 * GPU (random block pairs, every byte verified after RECEIVED; receiver killed: the sender's
 * event is an error within the deadline; sender killed: the receiver's expect times out), and
 * the same over nccl between GPU 0 and GPU 1 (skipped with fewer than two GPUs: NCCL refuses
 * two ranks on one device) and over ucx with gpu_staging (pinned mirrors, one GPU). Every wait
 * is bounded; the child is killed at the end. */
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

#include <cuda_runtime.h>

#include "common/log.h"
#include "cuda/cuda.h"
#include "cuda/xfer_gpu.h"
#include "peer_proto.h"
#include "peer_test.h"

extern char **environ;

#define LAYERS 4
#define BLOCKS 64

static const char *self_path;

/* ---- device pools ---- */

static int64_t block_bytes(void)
{
    return peer_layout(LAYERS).block_bytes;
}

/* One cudaMalloc (IPC needs the allocation's start), filled with the pattern or zeroed. */
static uint8_t *pool_make(bool pattern)
{
    int64_t bb = block_bytes();
    size_t bytes = (size_t)(BLOCKS * bb);
    void *d = NULL;
    if (cudaMalloc(&d, bytes) != cudaSuccess)
        return NULL;
    uint8_t *h = malloc(bytes);
    for (int64_t b = 0; b < BLOCKS; b++) {
        if (pattern)
            peer_fill_block(h + b * bb, bb, b);
        else
            memset(h + b * bb, 0, (size_t)bb);
    }
    cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    free(h);
    return d;
}

/* Bytes of the destination blocks of pairs that differ from their sources' pattern. */
static int64_t pool_check(const uint8_t *dev, const kvf_xfer_pair *pairs, uint32_t n)
{
    int64_t bb = block_bytes(), bad = 0;
    uint8_t *h = malloc((size_t)bb);
    for (uint32_t i = 0; i < n; i++) {
        if (cudaMemcpy(h, dev + pairs[i].dst * bb, (size_t)bb, cudaMemcpyDeviceToHost) !=
            cudaSuccess)
            return -1;
        bad += peer_check_block(h, bb, pairs[i].src);
    }
    free(h);
    return bad;
}

static kvf_xfer *xfer_make(const char *backend, uint8_t *dev, kvf_err *err)
{
    kvf_xfer_pool pool = {.base = dev, .layout = peer_layout(LAYERS), .n_blocks = BLOCKS};
    kvf_xfer_cfg cfg = {.backend = backend, .gpu = kvf_cuda_xfer_gpu()};
    cfg.gpu_staging = strcmp(backend, "ucx") == 0; /* a GPU pool over UCX: through the mirror */
    kvf_xfer *x = NULL;
    return kvf_xfer_create(&cfg, &pool, &x, err) == KVF_OK ? x : NULL;
}

/* Progresses until the peer is usable (both sides progress: the other one is in its loop). */
static bool peer_wait_ready(kvf_xfer *x, kvf_xfer_peer *p, int64_t timeout_ns)
{
    int64_t until = kvf_now_ns() + timeout_ns;
    while (kvf_xfer_peer_status(p) == KVF_ERR_BUSY && kvf_now_ns() < until)
        kvf_xfer_progress(x);
    return kvf_xfer_peer_status(p) == KVF_OK;
}

/* ---- the child ---- */

static int child_main(int fd, const char *role, const char *backend, int device)
{
    alarm(120);
    if (cudaSetDevice(device) != cudaSuccess)
        return 3;
    bool recv_role = strcmp(role, "recv") == 0;
    uint8_t *dev = pool_make(!recv_role);
    kvf_err err = {0};
    kvf_xfer *x = dev ? xfer_make(backend, dev, &err) : NULL;
    if (!x) {
        fprintf(stderr, "gpu_xfer child: %s\n", err.msg);
        return 1;
    }
    kvf_xfer_peer *peer = NULL;
    struct { uint64_t id; uint32_t n; kvf_xfer_pair pairs[BLOCKS]; } pend[16];
    int n_pend = 0;
    if (recv_role) {
        uint8_t *desc;
        size_t len;
        if (kvf_xfer_desc_export(x, &desc, &len, &err) != KVF_OK)
            return 1;
        peer_send(fd, MSG_DESC, desc, (uint32_t)len);
        free(desc);
    } else {
        if (peer_recv(fd, NULL, &msg, kvf_now_ns() + 30 * SEC) != 1 || msg.type != MSG_DESC)
            return 1;
        /* nccl: the hello with the unique id goes over the pair's notice channel, and the
         * parent's init starts from its own progress (it is in expect_msg meanwhile). */
        if (kvf_xfer_connect(x, msg.data, msg.len, &peer, &err) != KVF_OK) {
            fprintf(stderr, "gpu_xfer child: connect: %s\n", err.msg);
            return 1;
        }
        if (!peer_wait_ready(x, peer, 60 * SEC))
            return 1;
        uint64_t zero = 0;
        peer_send(fd, MSG_READY, &zero, sizeof zero);
    }
    for (;;) {
        int r = peer_recv(fd, x, &msg, kvf_now_ns() + 50 * MS);
        if (r < 0 || (r == 1 && msg.type == MSG_QUIT))
            break;
        if (r == 1 && (msg.type == MSG_EXPECT || msg.type == MSG_WRITE)) {
            uint64_t id;
            int64_t timeout_ms;
            uint32_t n, die_after;
            size_t off = peer_get_transfer(&msg, &id, &timeout_ms, &die_after, &n);
            int64_t dl = kvf_now_ns() + timeout_ms * MS;
            if (msg.type == MSG_EXPECT && n_pend < 16 && n <= BLOCKS) {
                pend[n_pend].id = id;
                pend[n_pend].n = n;
                memcpy(pend[n_pend].pairs, msg.data + off, n * sizeof(kvf_xfer_pair));
                int32_t dsts[BLOCKS];
                for (uint32_t k = 0; k < n; k++)
                    dsts[k] = pend[n_pend].pairs[k].dst;
                n_pend++;
                if (kvf_xfer_expect_blocks(x, id, dsts, n, dl, &err) != KVF_OK)
                    fprintf(stderr, "gpu_xfer child: expect: %s\n", err.msg);
                peer_send(fd, MSG_READY, &id, sizeof id);
            } else if (msg.type == MSG_WRITE) {
                kvf_status st = kvf_xfer_write(x, peer, id, (const kvf_xfer_pair *)(msg.data + off),
                                               n, dl, &err);
                if (die_after)
                    kill(getpid(), SIGKILL);
                if (st != KVF_OK)
                    peer_send_sent(fd, id, st);
            }
        }
        kvf_xfer_event ev;
        while (kvf_xfer_poll(x, &ev)) {
            if (ev.kind == KVF_XFER_SENT) {
                peer_send_sent(fd, ev.id, ev.status);
                continue;
            }
            int64_t bad = 0;
            for (int i = 0; i < n_pend; i++)
                if (pend[i].id == ev.id) {
                    if (ev.status == KVF_OK)
                        bad = pool_check(dev, pend[i].pairs, pend[i].n);
                    pend[i] = pend[--n_pend];
                    break;
                }
            peer_send_result(fd, ev.id, ev.status, bad);
        }
    }
    if (peer)
        kvf_xfer_disconnect(x, peer);
    kvf_xfer_destroy(x);
    cudaFree(dev);
    return 0;
}

/* ---- the parent ---- */

static int spawn_child(const char *role, const char *backend, int device)
{
    int sv[2];
    char fd_s[16], dev_s[16];
    peer_socketpair(sv, fd_s);
    snprintf(dev_s, sizeof dev_s, "%d", device);
    char *argv[] = {(char *)self_path, "child", fd_s, (char *)role, (char *)backend, dev_s, NULL};
    return peer_spawn(self_path, argv, sv);
}

static int reap_child(void)
{
    return peer_reap(NULL);
}

static int teardown(void **state)
{
    reap_child();
    kvf_log_set_level(KVF_LOG_INFO);
    return 0;
}

/* Which device the child uses: cuda_ipc shares device 0; nccl needs a second GPU. Returns -1
 * (and prints why) when the case cannot run here. */
static int child_device(const char *backend)
{
    if (strcmp(backend, "nccl") != 0)
        return 0;
#ifndef KVF_HAVE_NCCL
    print_message("skipped: built without NCCL\n");
    return -1;
#else
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
        print_message("skipped: nccl needs two GPUs (NCCL refuses two ranks on one device); "
                      "this machine has %d\n", n);
        return -1;
    }
    return 1;
#endif
}

/* We send: connect (nccl: the child joins the communicator when the hello on the notice
 * channel reaches it), wait until usable. */
static kvf_xfer_peer *connect_to_child(kvf_xfer *x, int fd)
{
    expect_msg(fd, x, MSG_DESC, 30 * SEC);
    kvf_xfer_peer *p = NULL;
    kvf_err err = {0};
    if (kvf_xfer_connect(x, msg.data, msg.len, &p, &err) != KVF_OK)
        fail_msg("connect: %s", err.msg);
    if (!peer_wait_ready(x, p, 60 * SEC))
        fail_msg("the peer did not become usable: %s", kvf_status_str(kvf_xfer_peer_status(p)));
    return p;
}

static void random_pairs(const char *backend)
{
    int device = child_device(backend);
    if (device < 0)
        skip();
    int fd = spawn_child("recv", backend, device);
    uint8_t *dev = pool_make(true);
    assert_non_null(dev);
    kvf_err err = {0};
    kvf_xfer *x = xfer_make(backend, dev, &err);
    if (!x)
        fail_msg("create: %s", err.msg);
    kvf_xfer_peer *p = connect_to_child(x, fd);
    srand(99);
    for (uint64_t id = 1; id <= 20; id++) {
        /* A random set of destinations, random sources, sometimes one run. */
        kvf_xfer_pair pairs[BLOCKS];
        int perm[BLOCKS];
        for (int i = 0; i < BLOCKS; i++)
            perm[i] = i;
        for (int i = BLOCKS - 1; i > 0; i--) {
            int j = rand() % (i + 1), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        uint32_t n = 1 + (uint32_t)(rand() % BLOCKS);
        bool run = id % 4 == 0;
        int s0 = rand() % (BLOCKS - (int)n + 1), d0 = rand() % (BLOCKS - (int)n + 1);
        for (uint32_t i = 0; i < n; i++)
            pairs[i] = run ? (kvf_xfer_pair){.src = s0 + (int)i, .dst = d0 + (int)i}
                           : (kvf_xfer_pair){.src = rand() % BLOCKS, .dst = perm[i]};
        send_pairs(fd, MSG_EXPECT, id, 20000, 0, pairs, n);
        expect_msg(fd, x, MSG_READY, 20 * SEC);
        assert_int_equal(kvf_xfer_write(x, p, id, pairs, n, kvf_now_ns() + 20 * SEC, &err),
                         KVF_OK);
        bool sent = false, result = false;
        int64_t until = kvf_now_ns() + 30 * SEC;
        while ((!sent || !result) && kvf_now_ns() < until) {
            kvf_xfer_event ev;
            while (kvf_xfer_poll(x, &ev)) {
                assert_int_equal(ev.id, id);
                if (ev.status != KVF_OK)
                    fail_msg("transfer %llu: %s", (unsigned long long)id,
                             kvf_status_str(ev.status));
                sent = true;
            }
            if (peer_recv(fd, x, &msg, kvf_now_ns() + 20 * MS) == 1) {
                assert_int_equal(msg.type, MSG_RESULT);
                uint64_t rid;
                int32_t st;
                int64_t bad;
                peer_get_result(&msg, &rid, &st, &bad);
                assert_int_equal(rid, id);
                assert_int_equal(st, KVF_OK);
                if (bad != 0)
                    fail_msg("transfer %llu: %lld bytes differ at the receiver",
                             (unsigned long long)id, (long long)bad);
                result = true;
            }
        }
        assert_true(sent && result);
    }
    peer_send(fd, MSG_QUIT, NULL, 0);
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    cudaFree(dev);
    peer_wait_exit_ok();
}

static void receiver_killed(const char *backend)
{
    int device = child_device(backend);
    if (device < 0)
        skip();
    int fd = spawn_child("recv", backend, device);
    uint8_t *dev = pool_make(true);
    kvf_err err = {0};
    kvf_xfer *x = xfer_make(backend, dev, &err);
    if (!x)
        fail_msg("create: %s", err.msg);
    kvf_xfer_peer *p = connect_to_child(x, fd);
    kvf_xfer_pair pairs[BLOCKS];
    for (int i = 0; i < BLOCKS; i++)
        pairs[i] = (kvf_xfer_pair){.src = i, .dst = BLOCKS - 1 - i};
    send_pairs(fd, MSG_EXPECT, 7, 20000, 0, pairs, BLOCKS);
    expect_msg(fd, x, MSG_READY, 20 * SEC);
    kvf_log_set_level(KVF_LOG_ERROR);
    int64_t t0 = kvf_now_ns(), deadline = t0 + 3 * SEC;
    kvf_status st = kvf_xfer_write(x, p, 7, pairs, BLOCKS, deadline, &err);
    /* cuda_ipc copies into the child's memory at write time: let them finish first (touching a
     * dead process's IPC memory is undefined), then kill it before the notice is answered. */
    const kvf_xfer_gpu *g = kvf_cuda_xfer_gpu();
    if (strcmp(backend, "cuda_ipc") == 0)
        assert_int_equal(g->sync(g->ctx, &err), KVF_OK);
    reap_child();
    if (st == KVF_OK) {
        kvf_xfer_event ev;
        assert_int_equal(kvf_xfer_wait(x, &ev, deadline + 2 * SEC, &err), KVF_OK);
        assert_int_equal(ev.id, 7);
        if (ev.status != KVF_ERR_PEER_LOST && ev.status != KVF_ERR_TIMEOUT)
            fail_msg("transfer 7 ended with %s", kvf_status_str(ev.status));
        assert_true(kvf_now_ns() - t0 <= 3 * SEC + 500 * MS);
    } else {
        assert_int_equal(st, KVF_ERR_PEER_LOST);
    }
    kvf_xfer_stats s;
    kvf_xfer_stats_get(x, &s);
    assert_int_equal(s.in_flight, 0);
    kvf_xfer_disconnect(x, p);
    kvf_xfer_destroy(x);
    cudaFree(dev);
}

static void sender_killed(const char *backend)
{
    int device = child_device(backend);
    if (device < 0)
        skip();
    uint8_t *dev = pool_make(false);
    kvf_err err = {0};
    kvf_xfer *x = xfer_make(backend, dev, &err);
    if (!x)
        fail_msg("create: %s", err.msg);
    uint8_t *desc;
    size_t len;
    assert_int_equal(kvf_xfer_desc_export(x, &desc, &len, &err), KVF_OK);
    int fd = spawn_child("send", backend, device);
    assert_int_equal(peer_send(fd, MSG_DESC, desc, (uint32_t)len), 0);
    free(desc);
    /* nccl: our init starts when the child's hello arrives on the channel (from our progress
     * inside expect_msg); its READY says the pair is usable. */
    expect_msg(fd, x, MSG_READY, 60 * SEC);
    kvf_xfer_pair pairs[BLOCKS];
    int32_t dsts[BLOCKS];
    peer_stride_pairs(pairs, dsts, BLOCKS);
    peer_expect_write_timeout(fd, x, pairs, dsts, BLOCKS, 1);
    reap_child();
    /* Nothing hangs afterwards: progress keeps returning and destroy finishes. */
    for (int i = 0; i < 100; i++)
        kvf_xfer_progress(x);
    kvf_xfer_destroy(x);
    cudaFree(dev);
}

static void test_cudaipc_random_pairs(void **state)
{
    random_pairs("cuda_ipc");
}

static void test_cudaipc_receiver_killed(void **state)
{
    receiver_killed("cuda_ipc");
}

static void test_cudaipc_sender_killed(void **state)
{
    sender_killed("cuda_ipc");
}

static void test_staging_random_pairs(void **state)
{
    random_pairs("ucx");
}

static void test_staging_receiver_killed(void **state)
{
    receiver_killed("ucx");
}

static void test_staging_sender_killed(void **state)
{
    sender_killed("ucx");
}

static void test_nccl_random_pairs(void **state)
{
    random_pairs("nccl");
}

static void test_nccl_receiver_killed(void **state)
{
    receiver_killed("nccl");
}

static void test_nccl_sender_killed(void **state)
{
    sender_killed("nccl");
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    self_path = argv[0];
    if (argc == 6 && strcmp(argv[1], "child") == 0)
        return child_main(atoi(argv[2]), argv[3], argv[4], atoi(argv[5]));
    char why[256];
    if (!kvf_cuda_available(why, sizeof why)) {
        printf("skipped: %s\n", why);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_cudaipc_random_pairs, teardown),
        cmocka_unit_test_teardown(test_cudaipc_receiver_killed, teardown),
        cmocka_unit_test_teardown(test_cudaipc_sender_killed, teardown),
        cmocka_unit_test_teardown(test_staging_random_pairs, teardown),
        cmocka_unit_test_teardown(test_staging_receiver_killed, teardown),
        cmocka_unit_test_teardown(test_staging_sender_killed, teardown),
        cmocka_unit_test_teardown(test_nccl_random_pairs, teardown),
        cmocka_unit_test_teardown(test_nccl_receiver_killed, teardown),
        cmocka_unit_test_teardown(test_nccl_sender_killed, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
