/* attn_bench.h: the device-side helpers `kvfleet bench attn` (bench/attn.c) and the GPU
 * attention test need, as plain C so neither includes a CUDA header: device buffers, a random
 * fill in a KV dtype, and CUDA-event timing of attention calls, of a device-to-device copy and of
 * a bare read.
 * Not for the serving path (the backend owns its memory and streams). */
#ifndef KVF_CUDA_ATTN_BENCH_H
#define KVF_CUDA_ATTN_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "cuda/attn.h"

/* Device memory on the current device (zeroed). Free with kvf_cuda_bench_free (NULL is fine). */
kvf_status kvf_cuda_bench_alloc(size_t bytes, void **out, kvf_err *err);
void kvf_cuda_bench_free(void *dev);
/* Synchronous copies host -> device and device -> host. */
kvf_status kvf_cuda_bench_upload(void *dev, const void *host, size_t bytes, kvf_err *err);
kvf_status kvf_cuda_bench_download(void *host, const void *dev, size_t bytes, kvf_err *err);
/* Fills n elements of dtype dt at dev with values uniform in [-1, 1) from seed; synchronous. */
kvf_status kvf_cuda_bench_fill_random(void *dev, size_t n, kvf_dtype dt, uint32_t seed,
                                      kvf_err *err);
/* Waits for the device; a kernel's asynchronous failure shows here. */
kvf_status kvf_cuda_bench_sync(kvf_err *err);
/* The current device's name and its memory, free and total, in bytes. */
kvf_status kvf_cuda_bench_device(char *name, size_t name_len, size_t *free_out,
                                 size_t *total_out, kvf_err *err);

/* Mean GPU milliseconds of one kvf_cuda_attention(p) over iters calls on one stream, timed
 * with CUDA events. With flush (flush_bytes of device memory) the buffer is overwritten
 * before every call, so each call starts with a cold L2 cache and is timed alone; without it
 * the iters calls run back to back between two events. */
kvf_status kvf_cuda_bench_attn_ms(const kvf_cuda_attn_params *p, void *flush, size_t flush_bytes,
                                  int32_t iters, double *ms_out, kvf_err *err);
/* The same for cudaMemcpyAsync(dst, src, bytes, device to device). */
kvf_status kvf_cuda_bench_copy_ms(void *dst, const void *src, size_t bytes, void *flush,
                                  size_t flush_bytes, int32_t iters, double *ms_out, kvf_err *err);
/* The same for one kernel that only reads bytes at src (16-byte aligned, a multiple of 16) and
 * keeps nothing (sink: 4 bytes of device memory it practically never writes): the fastest any
 * single kernel reading those bytes could be, timed like the rest. */
kvf_status kvf_cuda_bench_read_ms(const void *src, size_t bytes, void *sink, void *flush,
                                  size_t flush_bytes, int32_t iters, double *ms_out, kvf_err *err);

#endif
