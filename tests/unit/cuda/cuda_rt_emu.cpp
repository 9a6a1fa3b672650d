/* cuda_rt_emu.cpp: the CUDA runtime and cuBLAS calls that cuda/backend.cu and cuda/device.cu
 * make, on the host: device memory is host memory (filled with 0xff bytes, NaN floats, so a read
 * of memory nobody wrote shows), streams run their work at once, a capturing stream records
 * launches, copies, memsets and GEMMs by value into a graph that cudaGraphLaunch replays, and
 * cublasGemmEx is written from cuBLAS's documented column-major semantics. Misuses a GPU would
 * not report at once are counted (cuda_rt_emu_c.h) for the test to assert on. */
#include "cuda_rt_emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#include <map>
#include <memory>
#include <set>
#include <vector>

#include "cuda_rt_emu_c.h"

typedef std::vector<std::function<void()>> node_list;

struct CUstream_st {
    unsigned flags = 0;
    bool capturing = false, invalidated = false;
    node_list nodes; /* of the capture in progress */
};
struct CUgraph_st {
    node_list nodes;
};
struct CUgraphExec_st {
    node_list nodes;
};
struct cublasContext {
    cudaStream_t stream = nullptr;
    void *ws = nullptr;
    size_t ws_bytes = 0;
    cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

namespace {
std::map<uintptr_t, size_t> allocs; /* base -> bytes */
std::set<cudaStream_t> streams;
int n_capturing = 0;
cudaError_t last_err = cudaSuccess;
kvf_emu_rt_stats st_;
bool replaying = false;
bool invalidate_next = false;
int fail_launch_in = -1; /* launches to go before the refused one; -1: none */

void problem(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void problem(const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (!st_.first_problem[0])
        snprintf(st_.first_problem, sizeof st_.first_problem, "%s", buf);
    print_message("cuda_rt_emu: %s\n", buf);
}

cudaError_t set_err(cudaError_t e)
{
    last_err = e;
    return e;
}

/* true when [p, p + bytes) lies inside one allocation */
bool in_alloc(const void *p, size_t bytes)
{
    uintptr_t a = (uintptr_t)p;
    auto it = allocs.upper_bound(a);
    if (it == allocs.begin())
        return false;
    --it;
    return a >= it->first && a + bytes <= it->first + it->second;
}

bool any_alloc_holds(const void *p)
{
    return in_alloc(p, 1);
}

/* an unsafe call (allocation, host wait) while this thread captures: every capture is
 * invalidated (cudaStreamCaptureModeThreadLocal, the mode backend.cu uses) */
bool refuse_in_capture(const char *what)
{
    if (!n_capturing)
        return false;
    for (cudaStream_t s : streams)
        if (s->capturing && !s->invalidated) {
            s->invalidated = true;
            st_.captures_invalidated++;
        }
    problem("%s during a stream capture (invalidates it)", what);
    return true;
}

bool stream_ok(cudaStream_t s)
{
    return s == nullptr || streams.count(s);
}

/* Runs work on stream s now, or records it when s captures. */
cudaError_t submit(cudaStream_t s, std::function<void()> work)
{
    if (!stream_ok(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (s == nullptr) {
        for (cudaStream_t o : streams)
            if (o->flags & cudaStreamNonBlocking) {
                st_.default_stream_ops++;
                problem("work on the legacy default stream beside a non-blocking stream (unordered with it on a GPU)");
                break;
            }
        if (n_capturing)
            return set_err(cudaErrorStreamCaptureImplicit);
    }
    if (s && s->capturing) {
        if (s->invalidated)
            return set_err(cudaErrorStreamCaptureInvalidated);
        s->nodes.push_back(std::move(work));
        return cudaSuccess;
    }
    work();
    return cudaSuccess;
}

float load(const void *p, cudaDataType t, size_t i)
{
    switch (t) {
    case CUDA_R_16BF: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    case CUDA_R_16F: return __half2float(static_cast<const __half *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
    }
}

void store(void *p, cudaDataType t, size_t i, float v)
{
    switch (t) {
    case CUDA_R_16BF: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); return;
    case CUDA_R_16F: static_cast<__half *>(p)[i] = __float2half_rn(v); return;
    default: static_cast<float *>(p)[i] = v; return;
    }
}

size_t type_size(cudaDataType t)
{
    return t == CUDA_R_32F ? 4 : 2;
}
} /* namespace */

namespace emu {
void enqueue_kernel(const cfg_t &c, std::function<void()> body)
{
    const dim3 g = c.grid, b = c.block;
    if (!g.x || !g.y || !g.z || !b.x || !b.y || !b.z || g.y > 65535 || g.z > 65535 || b.z > 64 ||
        (uint64_t)b.x * b.y * b.z > 1024 || c.smem > 48 * 1024) {
        st_.bad_configs++;
        problem("launch refused: grid (%u,%u,%u) block (%u,%u,%u) shared %zu", g.x, g.y, g.z, b.x, b.y, b.z, c.smem);
        set_err(cudaErrorInvalidConfiguration);
        return;
    }
    if (fail_launch_in >= 0 && fail_launch_in-- == 0) {
        set_err(cudaErrorLaunchOutOfResources);
        return;
    }
    st_.launches++;
    cudaError_t e = submit(c.stream, [g, b, body] {
        if (replaying)
            st_.launches_replayed++;
        emu::launch_fibers({g.x, g.y, g.z}, {b.x, b.y, b.z}, 256 << 10, body);
    });
    if (e != cudaSuccess)
        set_err(e);
}
} /* namespace emu */

extern "C" void kvf_emu_rt_invalidate_next_capture(void)
{
    invalidate_next = true;
}

extern "C" void kvf_emu_rt_fail_launch(int skip)
{
    fail_launch_in = skip;
}

extern "C" void kvf_emu_rt_stats_get(kvf_emu_rt_stats *out)
{
    st_.live_allocs = (int64_t)allocs.size();
    st_.live_bytes = 0;
    for (auto &a : allocs)
        st_.live_bytes += (int64_t)a.second;
    *out = st_;
}

/* ---- runtime */

cudaError_t cudaGetDeviceCount(int *count)
{
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    return device == 0 ? cudaSuccess : set_err(cudaErrorInvalidDevice);
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = last_err;
    last_err = cudaSuccess;
    return e;
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    default: return "emulated CUDA error";
    }
}

/* Device memory: its own pages, ending 256-aligned just before an inaccessible page, so a kernel
 * that writes or reads past the end of an allocation faults at once instead of corrupting the
 * host heap; freed, its addresses are never handed out again. */
namespace {
const size_t page = 4096;
struct region {
    void *map;
    size_t len;
};
std::map<uintptr_t, region> regions;
} /* namespace */

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    *p = nullptr;
    if (refuse_in_capture("cudaMalloc"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    size_t n = (bytes + 255) / 256 * 256;
    if (!n)
        n = 256;
    size_t usable = (n + page - 1) / page * page, len = usable + page;
    void *m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return set_err(cudaErrorMemoryAllocation);
    mprotect(static_cast<char *>(m) + usable, page, PROT_NONE);
    char *base = static_cast<char *>(m) + usable - n;
    memset(base, 0xff, n); /* NaN as f32: unwritten memory shows */
    allocs[(uintptr_t)base] = bytes;
    regions[(uintptr_t)base] = {m, len};
    *p = base;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    if (!p)
        return cudaSuccess;
    if (refuse_in_capture("cudaFree"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    auto it = allocs.find((uintptr_t)p);
    if (it == allocs.end()) {
        problem("cudaFree of %p, which cudaMalloc did not return", p);
        return set_err(cudaErrorInvalidValue);
    }
    allocs.erase(it);
    /* the pages go back but the addresses stay reserved and inaccessible: a later allocation
     * never reuses them, so a graph or kernel that reads freed memory faults instead of reading
     * whatever was allocated there next */
    auto r = regions.find((uintptr_t)p);
    mmap(r->second.map, r->second.len, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    regions.erase(r);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b)
{
    size_t used = 0;
    for (auto &a : allocs)
        used += a.second;
    *total_b = (size_t)80 << 30;
    *free_b = *total_b - used;
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t s)
{
    if (!n)
        return cudaSuccess;
    bool dd = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyHostToDevice;
    bool sd = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyDeviceToHost;
    if (kind == cudaMemcpyHostToHost || kind == cudaMemcpyDefault) {
        problem("cudaMemcpyAsync kind %d is not one backend.cu should use", (int)kind);
        return set_err(cudaErrorInvalidValue);
    }
    if ((dd && !in_alloc(dst, n)) || (!dd && any_alloc_holds(dst)) || (sd && !in_alloc(src, n)) ||
        (!sd && any_alloc_holds(src))) {
        st_.bad_ranges++;
        problem("cudaMemcpyAsync kind %d of %zu bytes %p -> %p: an end is not where its kind says", (int)kind, n, src, dst);
        return set_err(cudaErrorInvalidValue);
    }
    st_.memcpys++;
    if (s && s->capturing && kind != cudaMemcpyDeviceToDevice) {
        /* pageable host memory cannot be a graph node */
        if (!s->invalidated) {
            s->invalidated = true;
            st_.captures_invalidated++;
        }
        return set_err(cudaErrorStreamCaptureUnsupported);
    }
    cudaError_t e = submit(s, [dst, src, n] { memmove(dst, src, n); });
    return e == cudaSuccess ? e : set_err(e);
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s)
{
    if (!n)
        return cudaSuccess;
    if (!in_alloc(p, n)) {
        st_.bad_ranges++;
        problem("cudaMemsetAsync of %zu bytes at %p: outside every allocation", n, p);
        return set_err(cudaErrorInvalidValue);
    }
    st_.memsets++;
    cudaError_t e = submit(s, [p, v, n] { memset(p, v, n); });
    return e == cudaSuccess ? e : set_err(e);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags)
{
    if (refuse_in_capture("cudaStreamCreate"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    cudaStream_t n = new CUstream_st;
    n->flags = flags;
    streams.insert(n);
    *s = n;
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s || !streams.count(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (s->capturing) {
        problem("a stream destroyed while capturing");
        n_capturing--;
    }
    streams.erase(s);
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    if (!stream_ok(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (s && s->capturing) {
        if (!s->invalidated) {
            s->invalidated = true;
            st_.captures_invalidated++;
        }
        return set_err(cudaErrorStreamCaptureUnsupported);
    }
    if (refuse_in_capture("cudaStreamSynchronize"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    return cudaSuccess; /* work ran when it was issued */
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode)
{
    if (!s)
        return set_err(cudaErrorStreamCaptureUnsupported); /* the legacy stream cannot capture */
    if (!streams.count(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (s->capturing)
        return set_err(cudaErrorIllegalState);
    s->capturing = true;
    s->invalidated = invalidate_next;
    if (invalidate_next)
        st_.captures_invalidated++;
    invalidate_next = false;
    s->nodes.clear();
    n_capturing++;
    st_.captures_begun++;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g)
{
    *g = nullptr;
    if (!s || !streams.count(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (!s->capturing)
        return set_err(cudaErrorIllegalState);
    s->capturing = false;
    n_capturing--;
    st_.captures_ended++;
    if (s->invalidated) {
        s->nodes.clear();
        return set_err(cudaErrorStreamCaptureInvalidated);
    }
    cudaGraph_t n = new CUgraph_st;
    n->nodes.swap(s->nodes);
    *g = n;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long flags)
{
    if (!g)
        return set_err(cudaErrorInvalidValue);
    cudaGraphExec_t e = new CUgraphExec_st;
    e->nodes = g->nodes; /* copies: the graph may be destroyed at once */
    *exec = e;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g)
{
    delete g;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e)
{
    delete e;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s)
{
    if (!e)
        return set_err(cudaErrorInvalidValue);
    st_.graph_launches++;
    node_list *nodes = &e->nodes;
    cudaError_t r = submit(s, [nodes] {
        bool was = replaying;
        replaying = true;
        for (auto &n : *nodes)
            n();
        replaying = was;
    });
    return r == cudaSuccess ? r : set_err(r);
}

/* ---- cuBLAS */

cublasStatus_t cublasCreate_v2(cublasHandle_t *h)
{
    *h = new cublasContext;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *ws, size_t bytes)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (bytes && !in_alloc(ws, bytes)) {
        st_.bad_ranges++;
        problem("cublasSetWorkspace: %zu bytes at %p are not device memory", bytes, ws);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    h->ws = ws;
    h->ws_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    h->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusName(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS_INTERNAL_ERROR";
    }
}

const char *cublasGetStatusString(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    default: return "emulated cuBLAS failure";
    }
}

/* C = alpha * op(A) op(B) + beta * C, column-major: op(A) is m x k, op(B) k x n, C m x n with
 * element (i, j) at C[i + j * ldc]. A stored for transa N as m x k (A[i + l * lda], lda >= m),
 * for T as k x m (op(A)(i, l) = A[l + i * lda], lda >= k); B likewise with ldb. Inputs of one
 * type (f32, f16 or bf16), C of that type or f32, f32 accumulation. beta 0: C is not read. */
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                            int k, const void *alpha, const void *A, cudaDataType at, int lda,
                            const void *B, cudaDataType bt, int ldb, const void *beta, void *C,
                            cudaDataType ct, int ldc, cublasComputeType_t compute, cublasGemmAlgo_t algo)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    auto op_ok = [](cublasOperation_t o) { return o == CUBLAS_OP_N || o == CUBLAS_OP_T || o == CUBLAS_OP_C; };
    if (!op_ok(ta) || !op_ok(tb) || m < 0 || n < 0 || k < 0)
        return CUBLAS_STATUS_INVALID_VALUE;
    const bool tA = ta != CUBLAS_OP_N, tB = tb != CUBLAS_OP_N; /* real types: C is T */
    if (lda < std::max(1, tA ? k : m) || ldb < std::max(1, tB ? n : k) || ldc < std::max(1, m))
        return CUBLAS_STATUS_INVALID_VALUE;
    bool types_ok = at == bt && (at == CUDA_R_32F || at == CUDA_R_16F || at == CUDA_R_16BF) &&
                    (ct == at || (ct == CUDA_R_32F && at != CUDA_R_32F));
    if (compute != CUBLAS_COMPUTE_32F || !types_ok)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (!m || !n)
        return CUBLAS_STATUS_SUCCESS;
    /* operand extents in elements: columns of the stored matrix times its leading dimension */
    size_t a_cols = (size_t)(tA ? m : k), b_cols = (size_t)(tB ? k : n);
    size_t a_rows = (size_t)(tA ? k : m), b_rows = (size_t)(tB ? n : k);
    size_t a_el = a_cols ? (a_cols - 1) * (size_t)lda + a_rows : 0;
    size_t b_el = b_cols ? (b_cols - 1) * (size_t)ldb + b_rows : 0;
    size_t c_el = ((size_t)n - 1) * (size_t)ldc + (size_t)m;
    if ((k && (!in_alloc(A, a_el * type_size(at)) || !in_alloc(B, b_el * type_size(bt)))) ||
        !in_alloc(C, c_el * type_size(ct))) {
        st_.bad_ranges++;
        problem("cublasGemmEx m %d n %d k %d lda %d ldb %d ldc %d: an operand runs outside its allocation", m, n, k,
                lda, ldb, ldc);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    const float al = *static_cast<const float *>(alpha), be = *static_cast<const float *>(beta);
    st_.gemms++;
    cudaError_t e = submit(h->stream, [=] {
        /* op(A) as row i of k, op(B) as column j of k, both f32 */
        std::vector<float> a((size_t)m * k), b((size_t)n * k);
        for (int i = 0; i < m; i++)
            for (int l = 0; l < k; l++)
                a[(size_t)i * k + l] = load(A, at, tA ? (size_t)l + (size_t)i * lda : (size_t)i + (size_t)l * lda);
        for (int j = 0; j < n; j++)
            for (int l = 0; l < k; l++)
                b[(size_t)j * k + l] = load(B, bt, tB ? (size_t)j + (size_t)l * ldb : (size_t)l + (size_t)j * ldb);
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                const float *ar = &a[(size_t)i * k], *bc = &b[(size_t)j * k];
                float acc = 0.0f;
                for (int l = 0; l < k; l++)
                    acc += ar[l] * bc[l];
                size_t ci = (size_t)i + (size_t)j * ldc;
                float v = al * acc;
                if (be != 0.0f)
                    v += be * load(C, ct, ci);
                store(C, ct, ci, v);
            }
    });
    return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

/* ---- what cuda/attn_bench.cu adds (test_attn.c's device memory and its timings) */

struct CUevent_st {
    double t_ms = 0;
};

static double now_ms()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

cudaError_t cudaDeviceSynchronize(void)
{
    if (refuse_in_capture("cudaDeviceSynchronize"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    if (device != 0)
        return set_err(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "host emulation");
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 1;
    prop->totalGlobalMem = (size_t)80 << 30;
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind)
{
    if (refuse_in_capture("cudaMemcpy"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    return cudaMemcpyAsync(dst, src, n, kind, nullptr);
}

cudaError_t cudaMemset(void *p, int v, size_t n)
{
    if (refuse_in_capture("cudaMemset"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    return cudaMemsetAsync(p, v, n, nullptr);
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    *e = new CUevent_st;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    if (!e)
        return set_err(cudaErrorInvalidResourceHandle);
    cudaError_t r = submit(s, [e] { e->t_ms = now_ms(); });
    return r == cudaSuccess ? r : set_err(r);
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    return e ? cudaSuccess : set_err(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    if (!a || !b)
        return set_err(cudaErrorInvalidResourceHandle);
    *ms = (float)(b->t_ms - a->t_ms);
    return cudaSuccess;
}
