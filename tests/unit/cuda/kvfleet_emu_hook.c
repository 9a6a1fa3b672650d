/* kvfleet_emu_hook.c: the one thing kvfleet_emu adds to the kvfleet sources: before main, a
 * misuse of the emulated CUDA runtime becomes fatal (printed, then abort), since no test counts
 * misuses inside a worker process; a dead worker fails the test that drove it. The emulator's
 * own invariant checks (cuda_emu.h: a barrier some thread never reaches) use cmocka's fail_msg,
 * which outside a test would exit(255) from whatever thread: CMOCKA_TEST_ABORT makes it abort. */
#include <stdlib.h>

#include "cuda_rt_emu_c.h"

__attribute__((constructor)) static void kvfleet_emu_misuse_fatal(void)
{
    kvf_emu_rt_misuse_fatal(1);
    setenv("CMOCKA_TEST_ABORT", "1", 0);
}
