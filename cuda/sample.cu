/* sample.cu: one token per logits row under temperature, top-k and top-p, one CTA per row, no
 * sort: the top-k and top-p cut-offs are found by building the threshold key bit by bit (32
 * block-wide counts or sums each), then one uniform picks a token of the kept set in id order.
 * The rule is written out in cuda.h (kvf_cuda_sample); sample_ref in the tests repeats it. */
#include <cuda_runtime.h>
#include <math.h>

#include "cuda/dtype.cuh"

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

#define SAMPLE_THREADS 256

/* An order-preserving unsigned key of a float (larger float, larger key). */
static __device__ __forceinline__ uint32_t fkey(float f)
{
    uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* Sum over the CTA; every thread gets the total. buf holds SAMPLE_THREADS / 32 floats. */
static __device__ float block_sum(float v, float *buf)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* buf may still be read from the last call */
    if ((threadIdx.x & 31) == 0)
        buf[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < SAMPLE_THREADS / 32; i++)
        t += buf[i];
    return t;
}

static __device__ float block_max(float v, float *buf)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        buf[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = -INFINITY;
    for (int i = 0; i < SAMPLE_THREADS / 32; i++)
        t = fmaxf(t, buf[i]);
    return t;
}

static __global__ void sample_kernel(const float *logits, int64_t vocab,
                                     const kvf_cuda_sample_row *rows, int32_t *out)
{
    __shared__ float buf[SAMPLE_THREADS / 32];
    __shared__ float pre[SAMPLE_THREADS];
    __shared__ int32_t pick, neg_first;
    const float *r = logits + (int64_t)blockIdx.x * vocab;
    kvf_cuda_sample_row p = rows[blockIdx.x];
    const uint32_t *mk = p.mask; /* the device copy, or NULL */
    float inv_t = 1.0f / p.temperature;
/* id j may be kept: not NaN, and allowed by the row's mask */
#define KEEP(j) (r[j] == r[j] && (!mk || (mk[(j) >> 5] >> ((j) & 31) & 1u)))

    /* 1. the largest logit (NaN never counts) */
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
        if (KEEP(j))
            m = fmaxf(m, r[j]);
    m = block_max(m, buf);
    if (m == INFINITY || m == -INFINITY || inv_t == INFINITY) { /* the rule's argmax case */
        if (threadIdx.x == 0)
            neg_first = -0x7fffffff - 1;
        __syncthreads();
        for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
            if (r[j] == m && KEEP(j)) {
                atomicMax(&neg_first, (int32_t)-j); /* the lowest id, negated */
                break;
            }
        __syncthreads();
        if (threadIdx.x == 0) /* no id kept at all (a mask allowing none): 0 */
            out[blockIdx.x] = neg_first == -0x7fffffff - 1 ? 0 : -neg_first;
        return;
    }

    /* 2. top-k: the largest key K with count(key >= K) >= k (the k-th largest logit) */
    uint32_t kk = 0;
    if (p.top_k > 0 && p.top_k < vocab) {
        for (int bit = 31; bit >= 0; bit--) {
            uint32_t cand = kk | (1u << bit);
            float c = 0.0f;
            for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
                c += (KEEP(j) && fkey(r[j]) >= cand) ? 1.0f : 0.0f;
            if (block_sum(c, buf) >= (float)p.top_k)
                kk = cand;
        }
    }

    /* 3. top-p: the largest key P >= K whose kept mass reaches top_p of the top-k mass */
    float z = 0.0f;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
        if (KEEP(j) && fkey(r[j]) >= kk)
            z += expf((r[j] - m) * inv_t);
    z = block_sum(z, buf);
    uint32_t thr = kk;
    if (p.top_p < 1.0f) {
        float want = p.top_p * z;
        uint32_t pk = 0;
        for (int bit = 31; bit >= 0; bit--) {
            uint32_t cand = pk | (1u << bit);
            uint32_t t = cand > kk ? cand : kk;
            float s = 0.0f;
            for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
                if (KEEP(j) && fkey(r[j]) >= t)
                    s += expf((r[j] - m) * inv_t);
            if (block_sum(s, buf) >= want)
                pk = cand;
        }
        thr = pk > kk ? pk : kk;
    }

    /* 4. the draw: contiguous chunks per thread, their masses scanned in thread order, and the
     * thread whose chunk holds u * (kept mass) walks it in id order */
    int64_t chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    int64_t j0 = threadIdx.x * chunk, j1 = j0 + chunk < vocab ? j0 + chunk : vocab;
    float mine = 0.0f;
    int32_t last_kept = -1;
    for (int64_t j = j0; j < j1; j++)
        if (KEEP(j) && fkey(r[j]) >= thr) {
            mine += expf((r[j] - m) * inv_t);
            last_kept = (int32_t)j;
        }
    pre[threadIdx.x] = mine;
    if (threadIdx.x == 0)
        pick = -1;
    __syncthreads();
    if (threadIdx.x == 0) { /* exclusive scan over 256 values: cheap next to the passes above */
        float acc = 0.0f;
        for (int i = 0; i < SAMPLE_THREADS; i++) {
            float v = pre[i];
            pre[i] = acc;
            acc += v;
        }
        buf[0] = acc;
    }
    __syncthreads();
    float total = buf[0], target = p.u * total, lo = pre[threadIdx.x];
    if (mine > 0.0f && target >= lo && target < lo + mine) {
        float acc = lo;
        int32_t got = last_kept;
        for (int64_t j = j0; j < j1; j++)
            if (KEEP(j) && fkey(r[j]) >= thr) {
                acc += expf((r[j] - m) * inv_t);
                if (target < acc) {
                    got = (int32_t)j;
                    break;
                }
            }
        atomicMax(&pick, got); /* one thread normally; rounding at a boundary: either is fine */
    }
    __syncthreads();
    if (pick < 0) /* rounding put target past the end: the last kept token */
        atomicMax(&pick, last_kept);
    __syncthreads();
    if (threadIdx.x == 0)
        out[blockIdx.x] = pick < 0 ? 0 : pick;
#undef KEEP
}

#ifndef KVF_CUDA_HOST_EMU /* the launchers; tests/unit/cuda/host_ops_emu.cpp runs the kernels on the host */
extern "C" kvf_status kvf_cuda_sample_launch(const kvf_cuda_sample_params *p, void *stream,
                                             kvf_err *err)
{
    if (p->n < 0 || p->n > 0x7fffffff || p->vocab <= 0 || p->vocab > (1 << 24))
        return kvf_err_set(err, KVF_ERR_INVALID, "cuda: sample: %lld rows of %lld (rows >= 0, vocab 1 to 2^24)",
                           (long long)p->n, (long long)p->vocab);
    if (p->n == 0)
        return KVF_OK;
    sample_kernel<<<(unsigned)p->n, SAMPLE_THREADS, 0, (cudaStream_t)stream>>>(p->logits, p->vocab,
                                                                              p->rows, p->out);
    return kvf_cuda_status(cudaGetLastError(), "cuda: sample", err);
}
#endif
