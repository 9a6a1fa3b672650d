/* cuda.h: the public face of cuda/ for the rest of kvfleet, plain C (no CUDA types): is a GPU
 * usable, the CUDA backend behind kvf_backend, and the device-memory KV pool. Which GPU and
 * stream a backend context uses is its own business (cuda/backend.cu). */
#ifndef KVF_CUDA_CUDA_H
#define KVF_CUDA_CUDA_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

/* True when a CUDA device can be used. Otherwise false with why filled ("no CUDA device:
 * CUDA driver version is insufficient for CUDA runtime version (35)"). GPU tests skip on false. */
bool kvf_cuda_available(char *why, size_t why_len);

/* Turns a cudaError_t (passed as int) into a status with "what: <cuda message> (<code>)". */
kvf_status kvf_cuda_status(int cuda_err, const char *what, kvf_err *err);

#endif
