/* cuda_rt_emu_c.h: what host_backend_emu.c (plain C) and kvfleet_emu ask of the emulated CUDA
 * runtime in cuda_rt_emu.cpp: counters of what the backend did, the misuses the emulation saw that
 * a GPU would not report at once (a launch on the legacy default stream, a copy outside any
 * allocation, a GEMM reading past its matrices), whether a misuse ends the process, and the hook
 * that puts another engine's operations (the NCCL emulation's) in a stream's order. */
#ifndef KVF_TEST_CUDA_RT_EMU_C_H
#define KVF_TEST_CUDA_RT_EMU_C_H

#include <stdbool.h>
#include <stdint.h>

typedef struct kvf_emu_rt_stats {
    int64_t launches, launches_replayed, gemms, memcpys, memsets;
    int64_t captures_begun, captures_ended, captures_invalidated, graph_launches;
    int64_t default_stream_ops;  /* work on stream 0 while a non-blocking stream exists */
    int64_t bad_ranges;          /* copy, memset or GEMM operand outside an allocation */
    int64_t bad_configs;         /* launches refused (grid, block or shared memory) */
    int64_t live_allocs, live_bytes;
    int64_t misuses;             /* every misuse reported (the counters above and the rest) */
    int64_t ipc_exported, ipc_opened, ipc_live; /* handles made; maps opened; maps open now */
    char first_problem[256];     /* the first misuse seen, "" when none */
} kvf_emu_rt_stats;

#ifdef __cplusplus
extern "C" {
#endif
void kvf_emu_rt_stats_get(kvf_emu_rt_stats *out);
/* Faults on demand, for the backend's error paths: the next stream capture is invalidated as it
 * begins (as if its first op could not be captured), so every op issued into it fails; the
 * launch after the next `skip` launches is refused with cudaErrorLaunchOutOfResources (not
 * sticky) instead of running. */
void kvf_emu_rt_invalidate_next_capture(void);
void kvf_emu_rt_fail_launch(int skip);
/* A misuse is printed to stderr and counted (the default: a cmocka test asserts on the counters),
 * or, once fatal is set, printed and then abort()ed on the spot: what a program that is not a
 * test (kvfleet_emu) sets, so the process dies loudly at the call instead of serving on. The
 * environment variable KVF_EMU_MISUSE=abort or =count, read at the first misuse, overrides. */
void kvf_emu_rt_misuse_fatal(int fatal);

/* Another engine's operations ordered on the emulated streams (kvfleet_emu_hook.c wires the NCCL
 * emulation, tests/unit/transport/nccl_emu.h, to it; nothing else does, so other programs run as
 * before and the runtime does not link the NCCL emulation). start: the operation may begin; done:
 * whether it is over; wait: up to timeout_ns for done; release: the stream is finished with it. */
typedef struct kvf_emu_rt_ext_ops {
    void (*start)(void *op);
    bool (*done)(void *op);
    bool (*wait)(void *op, int64_t timeout_ns);
    void (*release)(void *op);
} kvf_emu_rt_ext_ops;
/* Registers them (copied; NULL: none). Set before the first kvf_emu_rt_ext_enqueue. */
void kvf_emu_rt_set_ext_ops(const kvf_emu_rt_ext_ops *ops);
/* Puts op on stream (a cudaStream_t; NULL: the legacy stream) and starts it at once: the stream's
 * earlier work already ran. Later work on that stream (copies, memsets, kernels, GEMMs, graph
 * launches, cudaFreeAsync) first waits for it, with the calling thread blocked (the runtime's
 * lock released) up to KVF_EMU_EXT_WAIT_S seconds (default 30; longer is a misuse); an event
 * recorded after it is not ready until it is done; stream, event and device synchronization wait
 * for it. 0: refused (no ops registered, a dead or capturing stream: a misuse, reported). */
int kvf_emu_rt_ext_enqueue(void *stream, void *op);
#ifdef __cplusplus
}
#endif

#endif
