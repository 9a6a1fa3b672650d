/* xfer_peer.c: the other process of test_procs.c. As "recv" it registers a zeroed pool, sends
 * its descriptor, expects the transfers it is told about and, after each completion notice,
 * verifies every byte of its pool against the pattern; as "send" it fills its pool with the
 * pattern, connects to the descriptor it is given and writes what it is told (optionally
 * killing itself right after posting a write). It exits when the socket closes, or after 90 s.
 * GPU paths through the host-memory double (gpu_double.h): transport "cuda_ipc" uses that
 * backend on a shared-memory "device" pool; a last argument "staging" makes the pool "device"
 * memory moved over UCX through the pinned staging mirror. Receivers then announce their blocks.
 * Built a second time as xfer_peer_emu, on the test-only transport with the NCCL emulation
 * (nccl_emu.h): transport "nccl" then runs that backend on a "device" pool of host memory, its
 * operations ordered on the double's stream; a sender told die=2 holds its sends' bytes, lets
 * the notice and its send go out for 300 ms and then dies. At a clean exit it checks that every
 * mark, staging buffer, stream gate, NCCL operation and communicator was freed (exit 3 if not).
 *   usage: xfer_peer <fd> recv|send <transport> <n_layers> <n_blocks> [staging] */
#include <signal.h>
#include <stdio.h>

#ifdef KVF_XFER_PEER_NCCL_EMU
#include "nccl_emu.h"
#endif
#include "gpu_double.h"
#include "peer_proto.h"

#define MS 1000000LL

typedef struct pending {
    uint64_t id;
    uint32_t n;
    kvf_xfer_pair *pairs;
} pending;

static peer_msg msg;

static int die(const char *what, const kvf_err *err)
{
    fprintf(stderr, "xfer_peer: %s: %s\n", what, err ? err->msg : "");
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 6 && argc != 7) {
        fprintf(stderr, "usage: xfer_peer <fd> recv|send <transport> <n_layers> <n_blocks> "
                        "[staging]\n");
        return 2;
    }
    bool ipc = strcmp(argv[3], "cuda_ipc") == 0, nccl = strcmp(argv[3], "nccl") == 0;
#ifdef KVF_XFER_PEER_NCCL_EMU
    kvf_nccl_emu_set_streams(&gpu_double_nccl_streams);
#endif
    bool staging = argc == 7 && strcmp(argv[6], "staging") == 0;
    alarm(90);
    int fd = atoi(argv[1]);
    bool recv_role = strcmp(argv[2], "recv") == 0;
    kvf_kv_layout l = peer_layout(atoi(argv[4]));
    int64_t n_blocks = atoll(argv[5]), bb = l.block_bytes;
    uint8_t *mem = ipc ? gpu_double_dev_alloc((size_t)(n_blocks * bb))
                       : aligned_alloc(4096, (size_t)(n_blocks * bb));
    if (!mem)
        return die("out of memory", NULL);
    for (int64_t b = 0; b < n_blocks; b++) {
        if (recv_role)
            memset(mem + b * bb, 0, (size_t)bb);
        else
            peer_fill_block(mem + b * bb, bb, b);
    }
    kvf_xfer_pool pool = {.base = mem, .layout = l, .n_blocks = n_blocks};
    kvf_xfer_cfg cfg = {.backend = ipc ? "cuda_ipc" : nccl ? "nccl" : "ucx",
                        .transport = ipc || nccl ? NULL : argv[3]};
    if (ipc || nccl || staging) {
        cfg.gpu = &gpu_double_ops;
        cfg.gpu_staging = staging;
    }
    kvf_xfer *x;
    kvf_err err = {0};
    if (kvf_xfer_create(&cfg, &pool, &x, &err) != KVF_OK)
        return die("create", &err);
    kvf_xfer_peer *peer = NULL;
    int64_t *owner = malloc((size_t)n_blocks * sizeof *owner); /* recv: source block per dst */
    for (int64_t b = 0; b < n_blocks; b++)
        owner[b] = -1;
    pending pend[64];
    int n_pend = 0;

    if (recv_role) {
        uint8_t *desc;
        size_t len;
        if (kvf_xfer_desc_export(x, &desc, &len, &err) != KVF_OK)
            return die("export", &err);
        peer_send(fd, MSG_DESC, desc, (uint32_t)len);
        free(desc);
    } else {
        if (peer_recv(fd, NULL, &msg, kvf_now_ns() + 30000 * MS) != 1 || msg.type != MSG_DESC)
            return die("no descriptor", NULL);
        if (kvf_xfer_connect(x, msg.data, msg.len, &peer, &err) != KVF_OK)
            return die("connect", &err);
        int64_t until = kvf_now_ns() + 20000 * MS;
        while (kvf_xfer_peer_status(peer) == KVF_ERR_BUSY && kvf_now_ns() < until)
            kvf_xfer_progress(x);
        if (kvf_xfer_peer_status(peer) != KVF_OK)
            return die("wire-up did not finish", NULL);
        uint64_t zero = 0;
        peer_send(fd, MSG_READY, &zero, sizeof zero);
    }

    for (;;) {
        int r = peer_recv(fd, x, &msg, kvf_now_ns() + 50 * MS);
        if (r < 0)
            break;
        if (r == 1 && msg.type == MSG_QUIT)
            break;
        if (r == 1 && (msg.type == MSG_EXPECT || msg.type == MSG_WRITE)) {
            uint64_t id;
            int64_t timeout_ms;
            uint32_t n, die_after;
            size_t off = peer_get_transfer(&msg, &id, &timeout_ms, &die_after, &n);
            kvf_xfer_pair *pairs = malloc(n * sizeof *pairs);
            memcpy(pairs, msg.data + off, n * sizeof *pairs);
            int64_t dl = kvf_now_ns() + timeout_ms * MS;
            if (msg.type == MSG_EXPECT) {
                int32_t *dsts = malloc(n * sizeof *dsts);
                for (uint32_t k = 0; k < n; k++)
                    dsts[k] = pairs[k].dst;
                kvf_status est = ipc || nccl || staging
                                     ? kvf_xfer_expect_blocks(x, id, dsts, n, dl, &err)
                                                : kvf_xfer_expect(x, id, dl, &err);
                free(dsts);
                if (n_pend == 64 || est != KVF_OK)
                    return die("expect", &err);
                pend[n_pend++] = (pending){.id = id, .n = n, .pairs = pairs};
                peer_send(fd, MSG_READY, &id, sizeof id);
            } else {
#ifdef KVF_XFER_PEER_NCCL_EMU
                if (die_after == 2)
                    kvf_nccl_emu_hold_sends(true);
#endif
                kvf_status st = kvf_xfer_write(x, peer, id, pairs, n, dl, &err);
                free(pairs);
                for (int64_t until = kvf_now_ns() + 300 * MS; die_after == 2 && kvf_now_ns() < until;)
                    kvf_xfer_progress(x); /* the notice and the send go out; the bytes do not */
                if (die_after)
                    kill(getpid(), SIGKILL); /* mid-transfer: the puts are posted, no notice */
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
            /* Receiver: after the notice, every byte of the pool must be what we expect. */
            int64_t bad = 0;
            for (int i = 0; i < n_pend; i++) {
                if (pend[i].id != ev.id)
                    continue;
                if (ev.status == KVF_OK)
                    for (uint32_t k = 0; k < pend[i].n; k++)
                        owner[pend[i].pairs[k].dst] = pend[i].pairs[k].src;
                free(pend[i].pairs);
                pend[i] = pend[--n_pend];
                break;
            }
            /* Blocks that transfers still pending may be writing right now are skipped. */
            bool *busy = calloc((size_t)n_blocks, 1);
            for (int i = 0; i < n_pend; i++)
                for (uint32_t k = 0; k < pend[i].n; k++)
                    busy[pend[i].pairs[k].dst] = true;
            if (ev.status == KVF_OK)
                for (int64_t b = 0; b < n_blocks; b++)
                    if (!busy[b])
                        bad += peer_check_block(mem + b * bb, bb, owner[b]);
            free(busy);
            peer_send_result(fd, ev.id, ev.status, bad);
        }
    }
    if (peer)
        kvf_xfer_disconnect(x, peer);
    kvf_xfer_destroy(x);
    free(owner);
    if (ipc)
        gpu_double_dev_free(mem);
    else
        free(mem);
    if (nccl) {
        /* Everything the backend put on the stream ran; nothing is left allocated. */
        dbl_sync(NULL, &err);
        int64_t ops = 0, comms = 0;
#ifdef KVF_XFER_PEER_NCCL_EMU
        kvf_nccl_emu_stats es;
        kvf_nccl_emu_stats_get(&es);
        ops = es.ops_live;
        comms = es.comms_live;
#endif
        if (dbl.marks_live || dbl.dev_live || dbl.gates_live || ops || comms) {
            fprintf(stderr, "xfer_peer: left behind: %lld marks, %lld staging buffers, %lld "
                    "stream gates, %lld NCCL operations, %lld communicators\n",
                    (long long)dbl.marks_live, (long long)dbl.dev_live,
                    (long long)dbl.gates_live, (long long)ops, (long long)comms);
            return 3;
        }
    }
    return 0;
}
