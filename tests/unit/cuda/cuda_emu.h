/* cuda_emu.h: what the host emulations of the CUDA kernels share (host_attn_emu.cpp,
 * host_ops_emu.cpp): the built-ins (thread and block indices, a barrier for __syncthreads, a
 * per-warp exchange for __shfl_xor_sync, statics for __shared__), a grid launcher that runs the
 * CTAs one after another with one OS thread per CUDA thread, and the macros that let a .cu file
 * compile as host C++. C++ only; include after cmocka's headers and before the .cu files. */
#ifndef KVF_TEST_CUDA_EMU_H
#define KVF_TEST_CUDA_EMU_H

#include <pthread.h>
#include <string.h>

#include <functional>

namespace emu {
struct idx3 {
    unsigned x, y, z;
};
thread_local idx3 tid, bid;
idx3 bdim, gdim;
pthread_barrier_t cta_bar;
pthread_barrier_t warp_bar[32];
float xchg[32][32];

inline void syncthreads()
{
    pthread_barrier_wait(&cta_bar);
}

/* every lane of a warp calls this in the same order, as on the GPU */
inline float shfl_xor(float v, int o)
{
    unsigned w = tid.x / 32, l = tid.x % 32;
    xchg[w][l] = v;
    pthread_barrier_wait(&warp_bar[w]);
    float r = xchg[w][l ^ (unsigned)o];
    pthread_barrier_wait(&warp_bar[w]);
    return r;
}

inline float u2f(unsigned u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

inline unsigned f2u(float f)
{
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}

inline int amax(int *p, int v)
{
    int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}

/* ---- launching a grid: CTAs one after another, each CTA's threads at once */
struct launch_arg {
    const std::function<void()> *body;
    idx3 t, b;
};

inline void *launch_thread(void *p)
{
    const launch_arg *a = static_cast<const launch_arg *>(p);
    tid = a->t;
    bid = a->b;
    (*a->body)();
    return nullptr;
}

/* Runs body as a grid of CTAs of nt threads (x only), each thread with stack_bytes of stack. */
inline void launch(idx3 grid, unsigned nt, size_t stack_bytes, const std::function<void()> &body)
{
    gdim = grid;
    bdim = {nt, 1, 1};
    launch_arg *args = new launch_arg[nt];
    pthread_t *th = new pthread_t[nt];
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, stack_bytes);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                pthread_barrier_init(&cta_bar, nullptr, nt);
                for (unsigned w = 0; w * 32 < nt; w++)
                    pthread_barrier_init(&warp_bar[w], nullptr, nt - 32 * w < 32 ? nt - 32 * w : 32);
                for (unsigned i = 0; i < nt; i++) {
                    args[i] = {&body, {i, 0, 0}, {x, y, z}};
                    if (pthread_create(&th[i], &attr, launch_thread, &args[i]) != 0)
                        fail_msg("pthread_create failed for thread %u", i);
                }
                for (unsigned i = 0; i < nt; i++)
                    pthread_join(th[i], nullptr);
                pthread_barrier_destroy(&cta_bar);
                for (unsigned w = 0; w * 32 < nt; w++)
                    pthread_barrier_destroy(&warp_bar[w]);
            }
    pthread_attr_destroy(&attr);
    delete[] th;
    delete[] args;
}
} /* namespace emu */

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __shared__
#define __shared__ static
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#define threadIdx emu::tid
#define blockIdx emu::bid
#define blockDim emu::bdim
#define gridDim emu::gdim
#define __syncthreads() emu::syncthreads()
#define __shfl_xor_sync(mask, v, o) emu::shfl_xor((v), (o))
#define __ldg(p) (*(p))
#define __uint_as_float(u) emu::u2f(u)
#define __float_as_uint(f) emu::f2u(f)
#define atomicMax(p, v) emu::amax((p), (v))

#endif
