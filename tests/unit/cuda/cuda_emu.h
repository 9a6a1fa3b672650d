/* cuda_emu.h: what the host emulations of the CUDA kernels share (host_attn_emu.cpp,
 * host_ops_emu.cpp, host_backend_emu.c's runtime): the built-ins (thread and block indices, a
 * barrier for __syncthreads, a per-warp exchange for __shfl_xor_sync, statics for __shared__),
 * two grid launchers that run the CTAs one after another (launch: one OS thread per CUDA thread;
 * launch_fibers: one user-space fiber per CUDA thread, much cheaper per CTA, 3-D blocks), and
 * the macros that let a .cu file compile as host C++. C++17; include after cmocka's headers and
 * before the .cu files. The state is inline, so several translation units may include it. */
#ifndef KVF_TEST_CUDA_EMU_H
#define KVF_TEST_CUDA_EMU_H

/* Tells a .cu file compiled as host C++ to use the emulation's stand-ins (emu::mma_16816, a
 * plain copy for cp.async) where it would write inline PTX (KVF_CUDA_HOST_EMU, which
 * host_ops_emu.cpp defines, means something else: leave the launchers out). */
#define KVF_CUDA_EMU_DEVICE 1

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <functional>

namespace emu {
struct idx3 {
    unsigned x, y, z;
};
inline thread_local idx3 tid, bid;
inline idx3 bdim, gdim;
inline pthread_barrier_t cta_bar;
inline pthread_barrier_t warp_bar[32];
inline float xchg[32][32];

/* ---- fibers (launch_fibers): the CTA's threads take turns on the calling OS thread; a thread
 * that reaches a barrier waits until every live thread of its CTA (or warp) has arrived */
#if defined(__x86_64__)
/* Saves the caller's stack pointer in *save and resumes the stack at `to` (the callee-saved
 * registers are the compiler's to spill: every other one is clobbered). Below the 128-byte red
 * zone it pushes rbp and the resume address; a fresh stack holds the entry point instead. */
inline void switch_stack(void **save, void *to)
{
    asm volatile("subq $128, %%rsp\n\t"
                 "leaq 1f(%%rip), %%rax\n\t"
                 "pushq %%rbp\n\t"
                 "pushq %%rax\n\t"
                 "movq %%rsp, (%%rdi)\n\t"
                 "movq %%rsi, %%rsp\n\t"
                 "popq %%rax\n\t"
                 "popq %%rbp\n\t"
                 "jmpq *%%rax\n"
                 "1:\n\t"
                 "addq $128, %%rsp\n\t"
                 : "+D"(save), "+S"(to)
                 :
                 : "rax", "rbx", "rcx", "rdx", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15",
                   "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                   "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
}
#endif

struct fiber {
#if defined(__x86_64__)
    void *sp;
#else
    ucontext_t uc;
#endif
    int state; /* 0 runnable, 1 waiting, 2 done */
    int wait;  /* waiting at: -1 the CTA barrier, w the exchange of warp w */
};
struct fiber_cta {
    fiber *f = nullptr;
    unsigned nt = 0, cur = 0, done = 0;
    unsigned at_cta = 0, at_warp[32] = {}, live_warp[32] = {};
#if defined(__x86_64__)
    void *sched_sp = nullptr;
#else
    ucontext_t sched;
#endif
    char *stacks = nullptr;
    size_t stack_bytes = 0, stacks_len = 0;
    const std::function<void()> *body = nullptr;
};
inline fiber_cta fc;
inline thread_local bool in_fiber = false;

inline void fiber_wait(int at)
{
    fiber &me = fc.f[fc.cur];
    me.state = 1;
    me.wait = at;
#if defined(__x86_64__)
    switch_stack(&me.sp, fc.sched_sp);
#else
    swapcontext(&me.uc, &fc.sched);
#endif
}

/* linear thread id of a (possibly 3-D) block, and its warp and lane */
inline unsigned lin_tid()
{
    return tid.x + bdim.x * (tid.y + bdim.y * tid.z);
}

inline void syncthreads()
{
    if (in_fiber) {
        fiber_wait(-1);
        return;
    }
    pthread_barrier_wait(&cta_bar);
}

/* every lane of a warp calls this in the same order, as on the GPU */
inline float shfl_xor(float v, int o)
{
    if (in_fiber) {
        unsigned t = lin_tid(), w = t / 32, l = t % 32;
        xchg[w][l] = v;
        fiber_wait((int)w);
        float r = xchg[w][l ^ (unsigned)o];
        fiber_wait((int)w);
        return r;
    }
    unsigned w = tid.x / 32, l = tid.x % 32;
    xchg[w][l] = v;
    pthread_barrier_wait(&warp_bar[w]);
    float r = xchg[w][l ^ (unsigned)o];
    pthread_barrier_wait(&warp_bar[w]);
    return r;
}

/* __shfl_sync(mask, v, src) over the whole warp: lane src's v, every lane calling it in the
 * same order */
inline float shfl_idx(float v, int src)
{
    if (in_fiber) {
        unsigned t = lin_tid(), w = t / 32, l = t % 32;
        xchg[w][l] = v;
        fiber_wait((int)w);
        float r = xchg[w][(unsigned)src % 32];
        fiber_wait((int)w);
        return r;
    }
    unsigned w = tid.x / 32, l = tid.x % 32;
    xchg[w][l] = v;
    pthread_barrier_wait(&warp_bar[w]);
    float r = xchg[w][(unsigned)src % 32];
    pthread_barrier_wait(&warp_bar[w]);
    return r;
}

/* A 16-bit float's value: bf16 (the top half of an f32) or IEEE half. */
inline float half_bits_value(uint32_t h, bool bf16)
{
    h &= 0xffffu;
    if (bf16) {
        uint32_t u = h << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    const uint32_t sign = h >> 15, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    float v;
    if (e == 0) {
        v = (float)m * 0x1p-24f; /* subnormal (or zero): exact */
    } else if (e == 31) {
        v = m ? NAN : INFINITY;
    } else { /* normal: the same value as an f32's bits */
        const uint32_t u = ((e + 112u) << 23) | (m << 13);
        memcpy(&v, &u, sizeof v);
    }
    return sign ? -v : v;
}

/* double-buffered by call parity (each lane counts its calls; the lanes of a warp make the
 * same calls): a lane's next call writes the other buffer, and cannot start the one after
 * before every lane has arrived at the next one, so one barrier per call is enough */
inline float mma_a[2][32][32][8], mma_b[2][32][32][4]; /* each lane's halves, decoded */
inline unsigned mma_calls[32][32];

/* mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d += A (16x16) * B (16x8), every lane of
 * the warp calling it in the same order, each holding its fragments in the PTX ISA's layout
 * (g = lane / 4, t = lane % 4): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..],
 * a[3] = A[g+8][2t+8..]; b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g] (first element in the
 * low half); d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]. Products are exact in f32;
 * the sum runs over k in order. */
inline void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2], bool bf16)
{
    unsigned t = lin_tid(), w = t / 32, l = t % 32, pb = mma_calls[w][l]++ & 1u;
    for (unsigned i = 0; i < 8; i++) /* element 2r + h: the low (h 0) or high half of a[r] */
        mma_a[pb][w][l][i] = half_bits_value(a[i / 2] >> (16 * (i % 2)), bf16);
    for (unsigned i = 0; i < 4; i++)
        mma_b[pb][w][l][i] = half_bits_value(b[i / 2] >> (16 * (i % 2)), bf16);
    if (in_fiber)
        fiber_wait((int)w);
    else
        pthread_barrier_wait(&warp_bar[w]);
    auto A = [&](unsigned row, unsigned k) {
        return mma_a[pb][w][(row % 8) * 4 + (k % 8) / 2]
                    [2 * ((row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)) + k % 2];
    };
    auto B = [&](unsigned k, unsigned n) {
        return mma_b[pb][w][n * 4 + (k % 8) / 2][2 * (k >= 8 ? 1 : 0) + k % 2];
    };
    const unsigned g = l / 4, tq = l % 4;
    /* this lane's two rows of A and two columns of B */
    float ar[2][16], bc[2][16];
    for (unsigned h = 0; h < 2; h++)
        for (unsigned k = 0; k < 16; k++) {
            ar[h][k] = A(g + 8 * h, k);
            bc[h][k] = B(k, 2 * tq + h);
        }
    /* a product of two 16-bit floats is exact in f32, so a plain multiply and add is the
     * fused one (and much cheaper than a libm fmaf call) */
    for (unsigned i = 0; i < 4; i++) {
        float acc = d[i];
        for (unsigned k = 0; k < 16; k++)
            acc += ar[i / 2][k] * bc[i % 2][k];
        d[i] = acc;
    }
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

inline int aadd(int *p, int v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

inline int amax(int *p, int v)
{
    int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}

/* Vector accesses the GPU wants aligned (a 16-byte float4 or uint4 __ldg, a cp.async of 16
 * bytes: "misaligned address" on the GPU, where x86 just does it): the first misaligned one of
 * a launch is noted, and the launch fails the test once its grid has run (not from inside a
 * fiber, whose stack a longjmp would leave). */
inline char align_fault[160];

/* whether p is aligned to `align`; if not, notes it (what: the access) */
inline bool aligned_or_note(const void *p, size_t align, size_t bytes, const char *what)
{
    if (reinterpret_cast<uintptr_t>(p) % align == 0)
        return true;
    char expect = 0;
    char msg[sizeof align_fault];
    snprintf(msg, sizeof msg, "%s of %zu bytes at %p: not %zu-byte aligned (block %u,%u,%u thread %u)",
             what, bytes, p, align, bid.x, bid.y, bid.z, lin_tid());
    if (__atomic_compare_exchange_n(&align_fault[0], &expect, 'x', false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        memcpy(align_fault, msg, sizeof msg);
    return false;
}

/* __ldg(p): *p, checked for alignment to T */
template <typename T> inline T ldg(const T *p)
{
    if (!aligned_or_note(p, alignof(T), sizeof(T), "__ldg")) {
        T v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    return *p;
}

/* cp.async of 16 bytes global -> shared: a copy, both ends checked */
inline void cp16(void *dst, const void *src)
{
    aligned_or_note(src, 16, 16, "cp.async source");
    aligned_or_note(dst, 16, 16, "cp.async destination");
    memcpy(dst, src, 16);
}

/* fails the test with the launch's first misaligned access, if any (outside every fiber) */
inline void align_fault_check(const char *who)
{
    if (align_fault[0]) {
        char msg[sizeof align_fault];
        memcpy(msg, align_fault, sizeof msg);
        align_fault[0] = 0;
        fail_msg("%s: %s", who, msg);
    }
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
    align_fault_check("launch");
}
/* a fiber's first frame: run the body, then say so and go back to the scheduler for good */
inline void fiber_entry()
{
    (*fc.body)();
    fc.f[fc.cur].state = 2;
#if defined(__x86_64__)
    void *dead;
    switch_stack(&dead, fc.sched_sp);
    __builtin_unreachable();
#endif
}

/* Runs body as a grid of CTAs of block threads (x fastest), each thread a fiber with stack_bytes
 * of stack; one CTA at a time, on the calling thread. A barrier that some live thread of the CTA
 * never reaches fails the test (it would hang on the GPU). */
inline void launch_fibers(idx3 grid, idx3 block, size_t stack_bytes,
                          const std::function<void()> &body)
{
    unsigned nt = block.x * block.y * block.z;
    if (nt == 0 || nt > 1024)
        fail_msg("launch_fibers: %u threads per CTA", nt);
    gdim = grid;
    bdim = block;
    size_t need = (size_t)nt * stack_bytes;
    if (fc.stacks_len < need || fc.stack_bytes != stack_bytes) {
        if (fc.stacks)
            munmap(fc.stacks, fc.stacks_len);
        void *m = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED)
            fail_msg("launch_fibers: no memory for %zu bytes of stacks", need);
        fc.stacks = static_cast<char *>(m);
        fc.stacks_len = need;
        fc.stack_bytes = stack_bytes;
        delete[] fc.f;
        fc.f = new fiber[1024];
    }
    fc.body = &body;
    fc.nt = nt;
    unsigned n_warps = (nt + 31) / 32;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                fc.done = fc.at_cta = 0;
                for (unsigned w = 0; w < n_warps; w++) {
                    fc.at_warp[w] = 0;
                    fc.live_warp[w] = nt - 32 * w < 32 ? nt - 32 * w : 32;
                }
                for (unsigned i = 0; i < nt; i++) {
                    fiber &f = fc.f[i];
                    f.state = 0;
                    f.wait = 0;
#if defined(__x86_64__)
                    /* top of stack: a null return address (so the entry sees rsp + 8 16-byte
                     * aligned, as after a call), then rbp 0 and the entry for switch_stack's pops */
                    uintptr_t top = ((uintptr_t)(fc.stacks + (size_t)(i + 1) * stack_bytes)) & ~(uintptr_t)15;
                    void **sp = reinterpret_cast<void **>(top);
                    sp[-1] = nullptr;
                    sp[-2] = nullptr;
                    sp[-3] = reinterpret_cast<void *>(&fiber_entry);
                    f.sp = sp - 3;
#else
                    getcontext(&f.uc);
                    f.uc.uc_stack.ss_sp = fc.stacks + (size_t)i * stack_bytes;
                    f.uc.uc_stack.ss_size = stack_bytes;
                    f.uc.uc_link = &fc.sched;
                    makecontext(&f.uc, fiber_entry, 0);
#endif
                }
                bid = {x, y, z};
                in_fiber = true;
                while (fc.done < nt) {
                    bool ran = false;
                    for (unsigned i = 0; i < nt; i++) {
                        fiber &f = fc.f[i];
                        if (f.state != 0)
                            continue;
                        ran = true;
                        fc.cur = i;
                        tid = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
#if defined(__x86_64__)
                        switch_stack(&fc.sched_sp, f.sp);
#else
                        swapcontext(&fc.sched, &f.uc);
#endif
                        unsigned w = i / 32;
                        if (f.state == 2) {
                            fc.done++;
                            fc.live_warp[w]--;
                        } else if (f.wait < 0) {
                            fc.at_cta++;
                        } else {
                            fc.at_warp[f.wait]++;
                        }
                        /* release a barrier every live thread has reached */
                        if (fc.at_cta && fc.at_cta == nt - fc.done) {
                            for (unsigned j = 0; j < nt; j++)
                                if (fc.f[j].state == 1 && fc.f[j].wait < 0)
                                    fc.f[j].state = 0;
                            fc.at_cta = 0;
                        }
                        if (fc.at_warp[w] && fc.at_warp[w] == fc.live_warp[w]) {
                            for (unsigned j = w * 32; j < nt && j < w * 32 + 32; j++)
                                if (fc.f[j].state == 1 && fc.f[j].wait == (int)w)
                                    fc.f[j].state = 0;
                            fc.at_warp[w] = 0;
                        }
                    }
                    if (!ran) {
                        in_fiber = false;
                        fail_msg("launch_fibers: CTA (%u,%u,%u): %u threads wait at a barrier that the "
                                 "other %u live threads never reach", x, y, z, fc.at_cta, nt - fc.done - fc.at_cta);
                    }
                }
                in_fiber = false;
            }
    align_fault_check("launch_fibers");
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
#define __shfl_sync(mask, v, s) emu::shfl_idx((v), (s))
#define __ldg(p) emu::ldg(p)
#define __uint_as_float(u) emu::u2f(u)
#define __float_as_uint(f) emu::f2u(f)
#define atomicMax(p, v) emu::amax((p), (v))
#define atomicAdd(p, v) emu::aadd((p), (v))

#endif
