/* common.c: what the benchmarks share. */
#include <stdint.h>
#include <string.h>

#include "bench/bench.h"
#include "common/time.h"

double kvf_bench_memread_bps(const void *buf, size_t n, double min_s)
{
    const uint64_t *p = buf;
    size_t words = n / 8;
    volatile uint64_t sink = 0;
    int64_t reps = 0;
    double t0 = kvf_now_s(), el;
    do {
        uint64_t a = 0, b = 0, c = 0, d = 0;
        size_t i = 0;
        for (; i + 4 <= words; i += 4) {
            a ^= p[i];
            b ^= p[i + 1];
            c ^= p[i + 2];
            d ^= p[i + 3];
        }
        for (; i < words; i++)
            a ^= p[i];
        sink ^= a ^ b ^ c ^ d;
        reps++;
        el = kvf_now_s() - t0;
    } while (el < min_s);
    (void)sink;
    return (double)words * 8 * (double)reps / el;
}
