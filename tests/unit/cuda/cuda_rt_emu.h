/* cuda_rt_emu.h: what each copy of a cuda/*.cu file rewritten by emu_rewrite_launches.py sees
 * first: the toolkit's host headers (types only; the functions come from cuda_rt_emu.cpp, not
 * libcudart or libcublas), cuda_emu.h's built-ins, and emu::launch_k, which turns a launch into a
 * grid run on fibers, or into a node of the graph its stream is capturing. C++17. */
#ifndef KVF_TEST_CUDA_RT_EMU_H
#define KVF_TEST_CUDA_RT_EMU_H

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>

#include <algorithm>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

extern "C" {
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
}

#include "cuda_emu.h"

#define rsqrtf(x) (1.0f / sqrtf(x))
using std::max;
using std::min;

namespace emu {
/* a launch's <<<grid, block, smem, stream>>> */
struct cfg_t {
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;
};
inline cfg_t cfg(dim3 grid, dim3 block, size_t smem = 0, cudaStream_t stream = 0)
{
    return {grid, block, smem, stream};
}

/* cuda_rt_emu.cpp: checks the configuration (an error becomes cudaGetLastError's, as on the
 * GPU), then runs body as the grid now, or appends it to the graph the stream is capturing. */
void enqueue_kernel(const cfg_t &c, std::function<void()> body);

/* A launch: the arguments are converted to the kernel's parameter types and copied now, as
 * CUDA does, so a captured launch replays with these values. */
template <class... P, class... A>
void launch_k(const cfg_t &c, void (*k)(P...), A &&...a)
{
    std::tuple<std::decay_t<P>...> t(std::forward<A>(a)...);
    enqueue_kernel(c, [k, t] { std::apply(k, t); });
}
} /* namespace emu */

#endif
