/* xfer_gpu.h: the CUDA implementation of the transport's GPU ops table (transport/xfer.h,
 * kvf_xfer_gpu): IPC handles, copies and marks on one stream, pinned host memory and
 * stream-ordered device memory. Plain C; the caller puts the table in kvf_xfer_cfg.gpu. */
#ifndef KVF_CUDA_XFER_GPU_H
#define KVF_CUDA_XFER_GPU_H

#include "transport/xfer.h"

/* The process-wide table for the current device (device 0 unless the caller chose another with
 * its own CUDA set-up before the first call). Its stream is created on first use of an op that
 * needs it; the table lives until exit. Never NULL; without a device, available() says why and
 * every other op returns a status naming the CUDA error. */
const kvf_xfer_gpu *kvf_cuda_xfer_gpu(void);

#endif
