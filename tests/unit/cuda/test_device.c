/* test_device.c: the GPU is reachable (or the test says why not and skips). */
#include <stdio.h>

#include "cuda/cuda.h"

int main(void)
{
    char why[256];
    if (!kvf_cuda_available(why, sizeof why)) {
        printf("skipped: %s\n", why);
        return 77;
    }
    printf("a CUDA device is usable\n");
    return 0;
}
