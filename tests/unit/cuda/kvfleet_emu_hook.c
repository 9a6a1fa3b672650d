/* kvfleet_emu_hook.c: what kvfleet_emu adds to the kvfleet sources, before main: a misuse of the
 * emulated CUDA runtime becomes fatal (printed, then abort), since no test counts misuses inside a
 * worker process; a dead worker fails the test that drove it. The emulator's own invariant checks
 * (cuda_emu.h: a barrier some thread never reaches) use cmocka's fail_msg, which outside a test
 * would exit(255) from whatever thread: CMOCKA_TEST_ABORT makes it abort. And the NCCL emulation
 * (tests/unit/transport/nccl_emu.h, linked in place of libnccl) hands its sends and recvs to the
 * emulated streams (cuda_rt_emu_c.h), so they are ordered with the copies around them. */
#include <stdlib.h>

#include "cuda_rt_emu_c.h"
#ifdef KVF_EMU_NCCL
#include "nccl_emu.h"

static void nccl_op_start(void *op)
{
    kvf_nccl_emu_op_start(op);
}

static bool nccl_op_done(void *op)
{
    return kvf_nccl_emu_op_done(op);
}

static bool nccl_op_wait(void *op, int64_t timeout_ns)
{
    return kvf_nccl_emu_op_wait(op, timeout_ns);
}

static void nccl_op_release(void *op)
{
    kvf_nccl_emu_op_release(op);
}

static bool nccl_enqueue(void *ctx, void *stream, kvf_nccl_emu_op *op)
{
    (void)ctx;
    return kvf_emu_rt_ext_enqueue(stream, op) != 0;
}
#endif

__attribute__((constructor)) static void kvfleet_emu_setup(void)
{
    kvf_emu_rt_misuse_fatal(1);
    setenv("CMOCKA_TEST_ABORT", "1", 0);
#ifdef KVF_EMU_NCCL
    static const kvf_emu_rt_ext_ops ops = {
        .start = nccl_op_start, .done = nccl_op_done, .wait = nccl_op_wait, .release = nccl_op_release,
    };
    kvf_emu_rt_set_ext_ops(&ops);
    static const kvf_nccl_emu_streams streams = {.ctx = NULL, .enqueue = nccl_enqueue};
    kvf_nccl_emu_set_streams(&streams);
#endif
}
