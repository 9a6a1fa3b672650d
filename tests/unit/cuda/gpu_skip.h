/* gpu_skip.h: the start of every GPU test's main here: when no CUDA device is usable it prints
 * "skipped: <why>" (ctest's skip line) and the caller returns 77. Header-only. */
#ifndef KVF_TEST_GPU_SKIP_H
#define KVF_TEST_GPU_SKIP_H

#include <stdbool.h>
#include <stdio.h>

#include "cuda/cuda.h"

/* True (after printing why) when the test must exit 77 for lack of a device. */
static inline bool kvf_test_gpu_skip(void)
{
    char why[256];
    if (kvf_cuda_available(why, sizeof why))
        return false;
    printf("skipped: %s\n", why);
    return true;
}

#endif
