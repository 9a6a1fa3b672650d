/* cuda.h: the public face of cuda/ for the rest of kvfleet, plain C (no CUDA types): is a GPU
 * usable, the CUDA backend behind kvf_backend, and the device-memory KV pool. Which GPU and
 * stream a backend context uses is its own business (cuda/backend.cu). */
#ifndef KVF_CUDA_CUDA_H
#define KVF_CUDA_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "model/backend.h"

/* True when a CUDA device can be used. Otherwise false with why filled ("no CUDA device:
 * CUDA driver version is insufficient for CUDA runtime version (35)"). GPU tests skip on false. */
bool kvf_cuda_available(char *why, size_t why_len);

/* Turns a cudaError_t (passed as int) into a status with "what: <cuda message> (<code>)". */
kvf_status kvf_cuda_status(int cuda_err, const char *what, kvf_err *err);
/* The same for a cublasStatus_t: "what: cuBLAS <name>: <message> (<code>)". */
kvf_status kvf_cuda_blas_status(int blas_status, const char *what, kvf_err *err);

/* The CUDA backend (cuda/backend.cu): device 0, one stream, a cuBLAS handle on it. Its create
 * fails with a status saying why when no device is usable. Memory from alloc and the KV pool
 * (its kv_mem ops) is device memory; upload/download are ordered on the stream and have
 * finished when they return. Ops queue work and record the first error, which sync returns.
 * Decode-only steps whose key repeats are captured as CUDA graphs (at most
 * KVF_CUDA_MAX_GRAPHS kept, least recently used dropped) unless opts->no_graphs. */
const kvf_backend *kvf_cuda_backend(void);

#define KVF_CUDA_MAX_GRAPHS 16

/* What a backend context did (for tests and logs). */
typedef struct kvf_cuda_stats {
    int64_t graphs_captured, graph_replays, graph_evictions, graph_failures;
    int64_t eager_steps;
    int32_t graphs_cached;
    int64_t device_bytes; /* in use on the device (cudaMemGetInfo: total - free), all users */
} kvf_cuda_stats;
void kvf_cuda_backend_stats(void *be_ctx, kvf_cuda_stats *out);

/* One row's sampling parameters for kvf_cuda_sample. top_k >= vocab also means all. mask: a
 * host bitset from the caller; in the rows the kernel reads, the device copy kvf_cuda_sample
 * made of it. */
typedef kvf_backend_sample_row kvf_cuda_sample_row;

/* One token per row of logits (device memory of a kvf_cuda_backend context, [n][vocab]) into
 * out_host[n], finished on return. The rule: NaN logits and ids a row's mask leaves out are
 * never kept; K = the tokens whose
 * logit is >= the k-th largest logit (all when top_k is 0 or >= vocab; ties at the cut are all
 * kept); w_i = exp((logit_i - max) / temperature); P = the tokens of K whose logit is >= the
 * largest threshold whose kept w-mass is >= top_p * (w-mass of K); then the token i of P, in id
 * order, at which the running sum of w first exceeds u * (w-mass of P); a row whose largest
 * kept logit is +inf or -inf, or whose 1/temperature overflows a float, takes the lowest kept id
 * holding its largest logit instead (the weights would be NaN; 0 when no id is kept). Rows that fail the
 * parameter check (temperature <= 0, top_p outside (0, 1], u outside [0, 1), top_k < 0) are
 * refused with ERR_INVALID naming the row. The backend's `sample` op (kvf_backend_sample in
 * model/backend.h), which the engine uses for rows that draw with a temperature. */
kvf_status kvf_cuda_sample(void *be_ctx, const float *logits, int64_t n, int64_t vocab,
                           const kvf_cuda_sample_row *rows_host /* [n] */,
                           int32_t *out_host /* [n] */, kvf_err *err);

#endif
