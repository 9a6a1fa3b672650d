/* test_device.c: the GPU is reachable (or the test says why not and skips). */
#include <stdio.h>

#include "cuda/cuda.h"
#include "gpu_skip.h"

int main(void)
{
    if (kvf_test_gpu_skip())
        return 77;
    printf("a CUDA device is usable\n");
    return 0;
}
