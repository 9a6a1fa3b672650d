/* peer_proto.h: what test_procs.c and its helper process xfer_peer.c share: the little framed
 * protocol they speak over a socketpair (standing in for the control plane, which carries
 * descriptors and transfer ids), the pool shape, and the byte pattern every block is filled
 * with so the receiver can verify every byte. Header-only. */
#ifndef KVF_TEST_PEER_PROTO_H
#define KVF_TEST_PEER_PROTO_H

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/time.h"
#include "transport/xfer.h"

enum {
    MSG_DESC = 1,   /* payload: a descriptor */
    MSG_EXPECT = 2, /* u64 id | i64 timeout_ms | u32 n | n * (i32 src, i32 dst) */
    MSG_READY = 3,  /* u64 id */
    MSG_RESULT = 4, /* u64 id | i32 status | i64 bad bytes */
    MSG_WRITE = 5,  /* u64 id | i64 timeout_ms | u32 die | u32 n | pairs: die=1: SIGKILL self
                       right after the write is posted */
    MSG_SENT = 6,   /* u64 id | i32 status */
    MSG_QUIT = 7,
};

#define PEER_MAX_MSG (1 << 20)

typedef struct peer_msg {
    uint32_t type, len;
    uint8_t data[PEER_MAX_MSG];
} peer_msg;

/* The pool: n_layers x 8 KiB per block (2 kv heads, head_dim 64, 16 tokens, f16). */
static inline kvf_kv_layout peer_layout(int32_t n_layers)
{
    kvf_kv_layout l;
    kvf_kv_layout_init(n_layers, 2, 64, 16, KVF_DTYPE_F16, &l, NULL);
    return l;
}

static inline uint64_t peer_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Block b of a sender's pool holds word k = peer_mix(b << 32 | k). */
static inline void peer_fill_block(uint8_t *blk, int64_t bytes, int64_t b)
{
    uint64_t *w = (uint64_t *)blk;
    for (int64_t k = 0; k < bytes / 8; k++)
        w[k] = peer_mix((uint64_t)b << 32 | (uint64_t)k);
}

/* Bytes of blk that differ from what source block src holds (src < 0: zeros). */
static inline int64_t peer_check_block(const uint8_t *blk, int64_t bytes, int64_t src)
{
    const uint64_t *w = (const uint64_t *)blk;
    int64_t bad = 0;
    for (int64_t k = 0; k < bytes / 8; k++) {
        uint64_t want = src < 0 ? 0 : peer_mix((uint64_t)src << 32 | (uint64_t)k);
        if (w[k] != want)
            for (int i = 0; i < 8; i++)
                bad += ((w[k] >> (8 * i)) & 0xff) != ((want >> (8 * i)) & 0xff);
    }
    return bad;
}

static inline int peer_write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t k = write(fd, b, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

static inline int peer_read_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n) {
        ssize_t k = read(fd, b, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

static inline int peer_send(int fd, uint32_t type, const void *data, uint32_t len)
{
    uint32_t h[2] = {type, len};
    return peer_write_all(fd, h, sizeof h) || (len && peer_write_all(fd, data, len)) ? -1 : 0;
}

/* Waits for one message while progressing x (when not NULL); events stay queued in x.
 * Returns 1 with a message, 0 at the deadline, -1 when the other side closed. */
static inline int peer_recv(int fd, kvf_xfer *x, peer_msg *m, int64_t deadline_ns)
{
    for (;;) {
        /* Sleep on the socket and the transport's event fd together (a spinning receiver would
         * take the CPU its sender needs on a small machine). */
        struct pollfd pfd[2] = {{.fd = fd, .events = POLLIN}, {.fd = -1, .events = POLLIN}};
        int timeout_ms = 10;
        if (x) {
            pfd[1].fd = kvf_xfer_event_fd(x);
            timeout_ms = pfd[1].fd >= 0 && kvf_xfer_arm(x) ? 1 : 0;
        }
        int r = poll(pfd, 2, timeout_ms);
        if (r > 0 && (pfd[0].revents & (POLLIN | POLLHUP | POLLERR))) {
            uint32_t h[2];
            if (peer_read_all(fd, h, sizeof h) || h[1] > PEER_MAX_MSG)
                return -1;
            m->type = h[0];
            m->len = h[1];
            return peer_read_all(fd, m->data, m->len) ? -1 : 1;
        }
        if (x)
            for (int i = 0; i < 16; i++)
                kvf_xfer_progress(x);
        if (kvf_now_ns() >= deadline_ns)
            return 0;
    }
}

/* Little helpers to pack and unpack fixed-width fields in host order (same machine). */
#define PEER_PUT(buf, off, v) (memcpy((buf) + (off), &(v), sizeof(v)), (off) += sizeof(v))
#define PEER_GET(buf, off, v) (memcpy(&(v), (buf) + (off), sizeof(v)), (off) += sizeof(v))

/* The head of a MSG_EXPECT or MSG_WRITE in m: its id, timeout, die flag (MSG_WRITE only, else
 * 0) and pair count; returns the offset of the n pairs that follow. */
static inline size_t peer_get_transfer(const peer_msg *m, uint64_t *id, int64_t *timeout_ms,
                                       uint32_t *die, uint32_t *n)
{
    size_t off = 0;
    *die = 0;
    PEER_GET(m->data, off, *id);
    PEER_GET(m->data, off, *timeout_ms);
    if (m->type == MSG_WRITE)
        PEER_GET(m->data, off, *die);
    PEER_GET(m->data, off, *n);
    return off;
}

/* The fields of a MSG_RESULT in m: transfer id, status, bytes that differed. */
static inline void peer_get_result(const peer_msg *m, uint64_t *id, int32_t *st, int64_t *bad)
{
    size_t off = 0;
    PEER_GET(m->data, off, *id);
    PEER_GET(m->data, off, *st);
    PEER_GET(m->data, off, *bad);
}

/* A MSG_SENT for transfer id with status st. */
static inline int peer_send_sent(int fd, uint64_t id, int32_t st)
{
    uint8_t out[12];
    size_t o = 0;
    PEER_PUT(out, o, id);
    PEER_PUT(out, o, st);
    return peer_send(fd, MSG_SENT, out, (uint32_t)o);
}

/* A MSG_RESULT: transfer id, its status, and the bytes that differed at the receiver. */
static inline int peer_send_result(int fd, uint64_t id, int32_t st, int64_t bad)
{
    uint8_t out[20];
    size_t o = 0;
    PEER_PUT(out, o, id);
    PEER_PUT(out, o, st);
    PEER_PUT(out, o, bad);
    return peer_send(fd, MSG_RESULT, out, (uint32_t)o);
}

#endif
