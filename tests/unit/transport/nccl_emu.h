/* nccl_emu.h: a host emulation of the NCCL calls transport/xfer_nccl.c makes (unique ids,
 * blocking and non-blocking communicator init, async errors, groups, point-to-point send and
 * recv, abort, error strings), so the nccl backend runs between two real processes without a
 * GPU. Built into a test-only copy of the transport (tests/unit/transport/CMakeLists.txt); the
 * real kvf_xfer links libnccl. "Device memory" is host memory. Thread-safe; depends on libc,
 * pthreads and nccl.h's declarations only (no test framework), so an emulated kvfleet binary
 * can link it too.
 *
 * What it models: a communicator has two ranks joined by one TCP connection. The unique id is
 * an address and a nonce: ncclGetUniqueId listens on kvf_nccl_emu_set_host's address (default
 * 127.0.0.1) on an ephemeral port; at init the rank in the process that holds that listener
 * accepts, the other connects, and both check the nonce. A thread per communicator does the
 * init (so a non-blocking init returns ncclInProgress and ncclCommGetAsyncError reports it
 * done) and moves the bytes: a recv, once started, tells the peer it is ready (its size); a
 * send waits for that before its bytes go, so a send whose peer never posts the matching recv
 * never completes (as a GPU kernel would wait) until ncclCommAbort. Sizes must match, as NCCL
 * requires: a mismatch is an async ncclInvalidUsage. A peer whose connection closes makes the
 * communicator's async error ncclRemoteError; its operations still wait for the abort.
 *
 * Stream order: whoever owns the streams (a host GPU double, a host CUDA emulation) registers
 * kvf_nccl_emu_streams. ncclGroupEnd hands each operation to its stream with enqueue(); the
 * stream owner calls kvf_nccl_emu_op_start once everything enqueued on that stream before it is
 * complete (buffers gathered by earlier copies are then in place), and treats everything
 * enqueued after it (copies, marks/events) as not done until kvf_nccl_emu_op_done is true;
 * then it calls kvf_nccl_emu_op_release. An aborted communicator's operations are done (the
 * stream moves on, as after an abort on a GPU). Without registered streams an operation starts
 * when it is posted and nothing waits for it. */
#ifndef KVF_TEST_NCCL_EMU_H
#define KVF_TEST_NCCL_EMU_H

#include <stdbool.h>
#include <stdint.h>

typedef struct kvf_nccl_emu_op kvf_nccl_emu_op;

typedef struct kvf_nccl_emu_streams {
    void *ctx;
    /* Puts op on stream (the cudaStream_t given to ncclSend/ncclRecv) behind what is enqueued
     * there; called from the thread that calls ncclGroupEnd. false: it could not (out of
     * memory); the operation then fails and the communicator's async error says so. */
    bool (*enqueue)(void *ctx, void *stream, kvf_nccl_emu_op *op);
} kvf_nccl_emu_streams;

/* Registers the stream owner (copied; NULL: none). Set it before the first operation. */
void kvf_nccl_emu_set_streams(const kvf_nccl_emu_streams *s);
/* The operation may begin (its stream reached it). Any thread; calling it twice is harmless. */
void kvf_nccl_emu_op_start(kvf_nccl_emu_op *op);
/* Whether it is over: completed, failed or aborted. Any thread. */
bool kvf_nccl_emu_op_done(kvf_nccl_emu_op *op);
/* Waits up to timeout_ns for kvf_nccl_emu_op_done; returns it. */
bool kvf_nccl_emu_op_wait(kvf_nccl_emu_op *op, int64_t timeout_ns);
/* The stream owner is done with op (done or not: a communicator aborted later still ends it). */
void kvf_nccl_emu_op_release(kvf_nccl_emu_op *op);

/* The IPv4 address ncclGetUniqueId listens on (default "127.0.0.1"); false when it is not one. */
bool kvf_nccl_emu_set_host(const char *ipv4);

/* Fault knob: while on, no send's bytes leave this process (its peer's recvs wait), as if the
 * sending kernels were stuck; turning it off lets them go. */
void kvf_nccl_emu_hold_sends(bool hold);

typedef struct kvf_nccl_emu_stats {
    int64_t comms_live;   /* communicators not yet freed (ncclCommAbort/Destroy, then last op) */
    int64_t ops_live;     /* operations not yet freed (done and released) */
    int64_t inits_ok, aborts;
    int64_t ops_posted;   /* sends and recvs accepted by ncclGroupEnd */
    int64_t sends_done, recvs_done; /* completed without error */
    int64_t bytes_sent, bytes_received;
    int64_t listeners;    /* unique ids made and not yet taken by an init */
} kvf_nccl_emu_stats;

void kvf_nccl_emu_stats_get(kvf_nccl_emu_stats *out);

#endif
