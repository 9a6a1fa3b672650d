/* cuda_rt_emu.cpp: the CUDA runtime and cuBLAS calls that cuda/backend.cu, cuda/device.cu and
 * cuda/xfer_gpu.cu make, on the host: device memory is host memory (filled with 0xff bytes, NaN
 * floats, so a read of memory nobody wrote shows), streams run their work at once, a capturing
 * stream records launches, copies, memsets and GEMMs by value into a graph that cudaGraphLaunch
 * replays, and cublasGemmEx is written from cuBLAS's documented column-major semantics. CUDA IPC
 * works between processes: an exported allocation moves onto a memfd, and the handle names it
 * as /proc/<pid>/fd/<n> for the other process to map. Every entry point holds one process-wide
 * recursive lock (a worker calls the backend and the transport's GPU table from two threads);
 * the last error and the capture a thread runs are per thread, as in CUDA. Misuses a GPU would
 * not report at once are counted (cuda_rt_emu_c.h) for a test to assert on, or abort a program
 * that asked for that (kvfleet_emu). Another engine's operations (kvfleet_emu's NCCL emulation)
 * can sit on a stream (kvf_emu_rt_ext_enqueue): later work there waits for them. */
#include "cuda_rt_emu.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "cuda_rt_emu_c.h"

typedef std::vector<std::function<void()>> node_list;

/* Another engine's operation on a stream (kvf_emu_rt_ext_enqueue: an NCCL send or recv): its
 * place in the stream's order and the engine's handle. */
struct ext_pending {
    uint64_t seq;
    void *op;
};
struct CUstream_st {
    unsigned flags = 0;
    bool capturing = false, invalidated = false;
    pthread_t capturer{}; /* the thread that began the capture in progress */
    node_list nodes;      /* of the capture in progress */
    std::deque<ext_pending> ext; /* started, not yet seen done; in stream order */
    uint64_t ext_seq = 0;        /* operations ever enqueued on it */
};
struct CUevent_st {
    double t_ms = 0;
    unsigned flags = 0;
    bool recorded = false;
    int queries = 0; /* since the last record */
    /* the stream's other-engine operations before the record: those with seq < ext_upto on
     * ext_stream (NULL: none pending when it was recorded, or that stream is gone) */
    CUstream_st *ext_stream = nullptr;
    uint64_t ext_upto = 0;
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
/* One lock for the whole runtime: every entry point takes it (EMU_API), so the backend on a
 * worker's engine thread and the transport's copies on another thread never interleave inside
 * the emulator; a kernel runs to its end under it. Recursive: entry points call each other. */
pthread_mutex_t api_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
thread_local int api_depth = 0; /* how many times this thread holds api_mu */
struct api_lock {
    api_lock()
    {
        pthread_mutex_lock(&api_mu);
        api_depth++;
    }
    ~api_lock()
    {
        api_depth--;
        pthread_mutex_unlock(&api_mu);
    }
    api_lock(const api_lock &) = delete;
    api_lock &operator=(const api_lock &) = delete;
};
#define EMU_API api_lock emu_api_lock_
/* Lets go of every hold this thread has on api_mu for a scope (a wait on another engine, which
 * may need the NCCL thread, another thread of ours, or the other process to move), then takes
 * them back. What the lock guarded may have changed meanwhile. */
struct api_unlocked {
    int n;
    api_unlocked() : n(api_depth)
    {
        for (int i = 0; i < n; i++) {
            api_depth--;
            pthread_mutex_unlock(&api_mu);
        }
    }
    ~api_unlocked()
    {
        for (int i = 0; i < n; i++) {
            pthread_mutex_lock(&api_mu);
            api_depth++;
        }
    }
    api_unlocked(const api_unlocked &) = delete;
    api_unlocked &operator=(const api_unlocked &) = delete;
};

std::map<uintptr_t, size_t> allocs; /* device allocations: base -> bytes */
std::set<cudaStream_t> streams;
std::set<cudaEvent_t> events;
int n_capturing_blocking = 0;          /* captures on blocking streams (the legacy stream syncs with them) */
thread_local int my_captures = 0;      /* captures this thread began and has not ended */
thread_local cudaError_t last_err = cudaSuccess; /* per host thread, as in CUDA */
kvf_emu_rt_stats st_;
bool replaying = false;
bool invalidate_next = false;
int fail_launch_in = -1; /* launches to go before the refused one; -1: none */
int misuse_fatal = -1;   /* -1: not decided yet (KVF_EMU_MISUSE, else count) */

void problem(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void problem(const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    st_.misuses++;
    if (!st_.first_problem[0])
        snprintf(st_.first_problem, sizeof st_.first_problem, "%s", buf);
    const char *env = getenv("KVF_EMU_MISUSE");
    bool fatal = env && !strcmp(env, "abort") ? true : env && !strcmp(env, "count") ? false : misuse_fatal == 1;
    fprintf(stderr, "cuda_rt_emu: %s%s\n", buf, fatal ? " (misuse is fatal in this program: aborting)" : "");
    if (fatal)
        abort();
}

cudaError_t set_err(cudaError_t e)
{
    last_err = e;
    return e;
}

/* An IPC mapping of another process's allocation (cudaIpcOpenMemHandle): device memory here. */
struct ipc_map {
    size_t bytes;          /* the exporter's allocation */
    void *map;             /* the reservation: the memfd's pages, then an inaccessible page */
    size_t len;
    int refs;              /* opens of the same handle share one mapping, as in CUDA */
    uint64_t pid, ino;     /* which exported allocation */
};
std::map<uintptr_t, ipc_map> ipc_maps; /* base (as returned) -> mapping */

/* The map entry whose range [base, base + bytes) holds p, or end(). */
template <class M, class F>
typename M::iterator find_holding(M &m, const void *p, F bytes_of)
{
    uintptr_t a = (uintptr_t)p;
    auto it = m.upper_bound(a);
    if (it == m.begin())
        return m.end();
    --it;
    return a >= it->first && a < it->first + bytes_of(it->second) ? it : m.end();
}

/* true when [p, p + bytes) lies inside one device allocation, or one IPC mapping of another
 * process's (device memory either way) */
bool in_alloc(const void *p, size_t bytes)
{
    uintptr_t a = (uintptr_t)p;
    auto it = find_holding(allocs, p, [](size_t b) { return b; });
    if (it != allocs.end())
        return a + bytes <= it->first + it->second;
    auto im = find_holding(ipc_maps, p, [](const ipc_map &m) { return m.bytes; });
    return im != ipc_maps.end() && a + bytes <= im->first + im->second.bytes;
}

bool any_alloc_holds(const void *p)
{
    return in_alloc(p, 1);
}

/* An unsafe call (allocation, host wait) while this thread captures: this thread's captures are
 * invalidated (cudaStreamCaptureModeThreadLocal, the mode backend.cu uses: another thread's
 * calls do not touch them). */
bool refuse_in_capture(const char *what)
{
    if (!my_captures)
        return false;
    pthread_t me = pthread_self();
    for (cudaStream_t s : streams)
        if (s->capturing && !s->invalidated && pthread_equal(s->capturer, me)) {
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

/* ---- other engines' operations on our streams (kvf_emu_rt_ext_enqueue): an NCCL send or recv
 * is started when it is enqueued (the stream's earlier work already ran: work runs when it is
 * issued); later work on that stream waits for it first (the host thread issuing it blocks,
 * api_mu released, up to ext_wait_s), an event recorded after it is not ready until it is done,
 * and synchronizing waits. Consecutive operations on one stream run at once here (as those of
 * one NCCL group would), not one after the other. */
kvf_emu_rt_ext_ops ext_ops;
bool have_ext = false;
int ext_waiters = 0;     /* threads waiting on an operation (api_mu released): none is freed meanwhile */
CUstream_st legacy_ext;  /* what the legacy default stream (nullptr) has pending */

CUstream_st *ext_of(cudaStream_t s)
{
    return s ? s : &legacy_ext;
}

int64_t mono_ns()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The seconds a stream waits for an operation before that is called a misuse (a peer that never
 * posts the matching call): KVF_EMU_EXT_WAIT_S, default 30. */
int64_t ext_wait_ns()
{
    const char *e = getenv("KVF_EMU_EXT_WAIT_S");
    long v = e ? strtol(e, nullptr, 10) : 0;
    return (int64_t)(v > 0 ? v : 30) * 1000000000LL;
}

/* Lets go of the operations on s that are done (none while a thread waits on one). */
void ext_reap(CUstream_st *s)
{
    if (!have_ext || ext_waiters)
        return;
    for (auto it = s->ext.begin(); it != s->ext.end();)
        if (ext_ops.done(it->op)) {
            ext_ops.release(it->op);
            it = s->ext.erase(it);
        } else {
            ++it;
        }
}

/* The first operation on s enqueued before seq upto that is not seen done, or nullptr. */
void *ext_first_pending(CUstream_st *s, uint64_t upto)
{
    for (auto &p : s->ext)
        if (p.seq < upto && !ext_ops.done(p.op))
            return p.op;
    return nullptr;
}

/* Waits until every operation enqueued on s before seq upto is done, api_mu released while
 * waiting; false (a misuse, reported) when one is not done within ext_wait_ns. */
bool ext_wait(CUstream_st *s, uint64_t upto, const char *what)
{
    if (!have_ext || s->ext.empty())
        return true;
    int64_t deadline = mono_ns() + ext_wait_ns();
    for (;;) {
        void *op = ext_first_pending(s, upto);
        if (!op) {
            ext_reap(s);
            return true;
        }
        int64_t left = deadline - mono_ns();
        if (left <= 0) {
            problem("%s waited %lld s for an NCCL operation before it on its stream, which never ended "
                    "(a peer that never posts the matching call, and nobody aborts the communicator?)",
                    what, (long long)(ext_wait_ns() / 1000000000LL));
            return false;
        }
        ext_waiters++;
        {
            api_unlocked u;
            ext_ops.wait(op, std::min<int64_t>(left, 100000000LL));
        }
        ext_waiters--;
    }
}

/* Runs work on stream s now (after the other engines' operations before it: ext_wait), or
 * records it when s captures; wait_ext false: do not wait for them (an event record). */
cudaError_t submit(cudaStream_t s, std::function<void()> work, bool wait_ext = true)
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
        if (n_capturing_blocking)
            return set_err(cudaErrorStreamCaptureImplicit);
    }
    if (s && s->capturing) {
        if (s->invalidated)
            return set_err(cudaErrorStreamCaptureInvalidated);
        s->nodes.push_back(std::move(work));
        return cudaSuccess;
    }
    if (wait_ext && !ext_wait(ext_of(s), UINT64_MAX, "work on a stream"))
        return set_err(cudaErrorLaunchTimeout);
    if (!stream_ok(s))
        return set_err(cudaErrorInvalidResourceHandle); /* destroyed while it waited */
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
    EMU_API;
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
    EMU_API;
    invalidate_next = true;
}

extern "C" void kvf_emu_rt_fail_launch(int skip)
{
    EMU_API;
    fail_launch_in = skip;
}

extern "C" void kvf_emu_rt_set_ext_ops(const kvf_emu_rt_ext_ops *ops)
{
    EMU_API;
    have_ext = ops != nullptr;
    if (ops)
        ext_ops = *ops;
}

extern "C" int kvf_emu_rt_ext_enqueue(void *stream, void *op)
{
    EMU_API;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (!have_ext) {
        problem("kvf_emu_rt_ext_enqueue before kvf_emu_rt_set_ext_ops");
        return 0;
    }
    if (!stream_ok(s)) {
        problem("an NCCL operation enqueued on stream %p, which is not a live stream", stream);
        return 0;
    }
    if (s && s->capturing) {
        problem("an NCCL operation enqueued on a capturing stream (not emulated)");
        return 0;
    }
    CUstream_st *x = ext_of(s);
    ext_reap(x);
    ext_ops.start(op); /* the stream's earlier work ran when it was issued */
    x->ext.push_back({x->ext_seq++, op});
    return 1;
}

extern "C" void kvf_emu_rt_misuse_fatal(int fatal)
{
    EMU_API;
    misuse_fatal = fatal ? 1 : 0;
}

extern "C" void kvf_emu_rt_stats_get(kvf_emu_rt_stats *out)
{
    EMU_API;
    st_.ipc_live = (int64_t)ipc_maps.size();
    st_.live_allocs = (int64_t)allocs.size();
    st_.live_bytes = 0;
    for (auto &a : allocs)
        st_.live_bytes += (int64_t)a.second;
    *out = st_;
}

/* ---- runtime */

cudaError_t cudaGetDeviceCount(int *count)
{
    EMU_API;
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    EMU_API;
    return device == 0 ? cudaSuccess : set_err(cudaErrorInvalidDevice);
}

cudaError_t cudaGetLastError(void)
{
    EMU_API;
    cudaError_t e = last_err;
    last_err = cudaSuccess;
    return e;
}

const char *cudaGetErrorString(cudaError_t e)
{
    EMU_API;
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
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchTimeout: return "the launch timed out and was terminated";
    case cudaErrorDeviceUninitialized: return "invalid device context";
    case cudaErrorMapBufferObjectFailed: return "mapping of buffer object failed";
    case cudaErrorStreamCaptureWrongThread: return "attempt to terminate a thread-local capture sequence from another thread";
    default: return "emulated CUDA error";
    }
}

/* Device memory: its own pages, ending 256-aligned just before an inaccessible page, so a kernel
 * that writes or reads past the end of an allocation faults at once instead of corrupting the
 * host heap; freed, its addresses are never handed out again. Private anonymous pages until
 * cudaIpcGetMemHandle exports the allocation: then the same addresses are remapped onto a memfd
 * holding the same bytes (fd kept until cudaFree), which another process maps by its name. */
namespace {
const size_t page = 4096;
struct region {
    void *map;
    size_t len;       /* usable pages, then the guard page */
    int fd = -1;      /* memfd once exported */
    uint64_t ino = 0; /* the memfd's inode: names the allocation in a handle */
};
std::map<uintptr_t, region> regions; /* device allocations: base -> pages */

struct host_region {
    size_t bytes;
    void *map;
    size_t len;
};
std::map<uintptr_t, host_region> host_allocs; /* cudaHostAlloc: base -> pages */

/* Pages for bytes, ending 256-aligned before an inaccessible page, 0xff-filled; base_out and
 * the mapping. */
bool map_guarded(size_t bytes, char **base_out, void **map_out, size_t *len_out)
{
    size_t n = (bytes + 255) / 256 * 256;
    if (!n)
        n = 256;
    size_t usable = (n + page - 1) / page * page, len = usable + page;
    void *m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return false;
    mprotect(static_cast<char *>(m) + usable, page, PROT_NONE);
    char *base = static_cast<char *>(m) + usable - n;
    memset(base, 0xff, n); /* NaN as f32: unwritten memory shows */
    *base_out = base;
    *map_out = m;
    *len_out = len;
    return true;
}

/* The pages go back but the addresses stay reserved and inaccessible: a later allocation never
 * reuses them, so a graph or kernel that reads freed memory faults instead of reading whatever
 * was allocated there next. */
void unmap_keep_reserved(void *map, size_t len)
{
    mmap(map, len, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
}

cudaError_t alloc_device(void **p, size_t bytes)
{
    char *base;
    void *m;
    size_t len;
    if (!map_guarded(bytes, &base, &m, &len))
        return set_err(cudaErrorMemoryAllocation);
    allocs[(uintptr_t)base] = bytes;
    regions[(uintptr_t)base] = {m, len};
    *p = base;
    return cudaSuccess;
}

cudaError_t free_device(void *p, const char *what)
{
    auto it = allocs.find((uintptr_t)p);
    if (it == allocs.end()) {
        problem("%s of %p, which cudaMalloc did not return%s", what, p,
                ipc_maps.count((uintptr_t)p) ? " (an IPC mapping: cudaIpcCloseMemHandle it)" : "");
        return set_err(cudaErrorInvalidValue);
    }
    allocs.erase(it);
    auto r = regions.find((uintptr_t)p);
    if (r->second.fd >= 0)
        close(r->second.fd); /* mappings in other processes keep the pages */
    unmap_keep_reserved(r->second.map, r->second.len);
    regions.erase(r);
    return cudaSuccess;
}
} /* namespace */

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    EMU_API;
    *p = nullptr;
    if (refuse_in_capture("cudaMalloc"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    return alloc_device(p, bytes);
}

cudaError_t cudaFree(void *p)
{
    EMU_API;
    if (!p)
        return cudaSuccess;
    if (refuse_in_capture("cudaFree"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    return free_device(p, "cudaFree");
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b)
{
    EMU_API;
    size_t used = 0;
    for (auto &a : allocs)
        used += a.second;
    *total_b = (size_t)80 << 30;
    *free_b = *total_b - used;
    return cudaSuccess;
}

namespace {
/* Where [p, p + n) lies, for cudaMemcpyDefault (unified addressing): device memory (an allocation
 * or an IPC mapping), pinned host memory (cudaHostAlloc), pageable host memory (nothing of ours
 * holds its first byte), or across an end of one of ours (a misuse either way). */
enum mem_kind { MEM_DEVICE, MEM_PINNED, MEM_PAGEABLE, MEM_ACROSS };
mem_kind classify(const void *p, size_t n)
{
    if (any_alloc_holds(p))
        return in_alloc(p, n) ? MEM_DEVICE : MEM_ACROSS;
    auto h = find_holding(host_allocs, p, [](const host_region &r) { return r.bytes; });
    if (h != host_allocs.end())
        return (uintptr_t)p + n <= h->first + h->second.bytes ? MEM_PINNED : MEM_ACROSS;
    return MEM_PAGEABLE;
}
} /* namespace */

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t s)
{
    EMU_API;
    if (!n)
        return cudaSuccess;
    if (kind == cudaMemcpyDefault) {
        /* the direction follows from the addresses (xfer_gpu.cu's copies: device, IPC-mapped
         * or pinned memory at both ends; pageable memory there is a caller's mistake) */
        mem_kind dk = classify(dst, n), sk = classify(src, n);
        if (dk == MEM_ACROSS || sk == MEM_ACROSS || dk == MEM_PAGEABLE || sk == MEM_PAGEABLE) {
            st_.bad_ranges++;
            problem("cudaMemcpyAsync (default kind) of %zu bytes %p -> %p: an end is %s", n, src, dst,
                    dk == MEM_ACROSS || sk == MEM_ACROSS ? "not inside one allocation"
                                                         : "pageable host memory, not device, IPC-mapped or pinned");
            return set_err(cudaErrorInvalidValue);
        }
        kind = dk == MEM_DEVICE ? (sk == MEM_DEVICE ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                : (sk == MEM_DEVICE ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
        if (kind == cudaMemcpyHostToHost) {
            problem("cudaMemcpyAsync (default kind) of %zu bytes between two pinned host buffers", n);
            return set_err(cudaErrorInvalidValue);
        }
    }
    bool dd = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyHostToDevice;
    bool sd = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyDeviceToHost;
    if (kind == cudaMemcpyHostToHost) {
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
    EMU_API;
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
    EMU_API;
    if (refuse_in_capture("cudaStreamCreate"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    cudaStream_t n = new CUstream_st;
    n->flags = flags;
    streams.insert(n);
    *s = n;
    return cudaSuccess;
}

/* the bookkeeping of a capture that ends (the stream's flag is the caller's) */
static void capture_over(cudaStream_t s)
{
    if (!(s->flags & cudaStreamNonBlocking))
        n_capturing_blocking--;
    if (pthread_equal(s->capturer, pthread_self()))
        my_captures--;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    EMU_API;
    if (!s || !streams.count(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (s->capturing) {
        problem("a stream destroyed while capturing");
        capture_over(s);
    }
    /* its NCCL operations end first (CUDA returns at once and lets the work finish) */
    if (!ext_wait(s, UINT64_MAX, "cudaStreamDestroy"))
        return set_err(cudaErrorLaunchTimeout);
    if (!streams.count(s))
        return set_err(cudaErrorInvalidResourceHandle); /* destroyed meanwhile by another thread */
    for (cudaEvent_t e : events)
        if (e->ext_stream == s)
            e->ext_stream = nullptr;
    streams.erase(s);
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    EMU_API;
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
    /* work ran when it was issued; NCCL operations on it may still be going */
    if (!ext_wait(ext_of(s), UINT64_MAX, "cudaStreamSynchronize"))
        return set_err(cudaErrorLaunchTimeout);
    return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode)
{
    EMU_API;
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
    s->capturer = pthread_self();
    my_captures++;
    if (!(s->flags & cudaStreamNonBlocking))
        n_capturing_blocking++;
    st_.captures_begun++;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g)
{
    EMU_API;
    *g = nullptr;
    if (!s || !streams.count(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (!s->capturing)
        return set_err(cudaErrorIllegalState);
    if (!pthread_equal(s->capturer, pthread_self())) {
        problem("cudaStreamEndCapture on a thread other than the one that began the capture");
        return set_err(cudaErrorStreamCaptureWrongThread);
    }
    s->capturing = false;
    capture_over(s);
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
    EMU_API;
    if (!g)
        return set_err(cudaErrorInvalidValue);
    cudaGraphExec_t e = new CUgraphExec_st;
    e->nodes = g->nodes; /* copies: the graph may be destroyed at once */
    *exec = e;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g)
{
    EMU_API;
    delete g;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e)
{
    EMU_API;
    delete e;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s)
{
    EMU_API;
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
    EMU_API;
    *h = new cublasContext;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h)
{
    EMU_API;
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s)
{
    EMU_API;
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *ws, size_t bytes)
{
    EMU_API;
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
    EMU_API;
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    h->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusName(cublasStatus_t s)
{
    EMU_API;
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
    EMU_API;
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
    EMU_API;
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

namespace {
bool event_ok(cudaEvent_t e)
{
    return e && events.count(e);
}
} /* namespace */

static double now_ms()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

cudaError_t cudaDeviceSynchronize(void)
{
    EMU_API;
    if (refuse_in_capture("cudaDeviceSynchronize"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    std::vector<CUstream_st *> all(streams.begin(), streams.end());
    all.push_back(&legacy_ext);
    for (CUstream_st *x : all)
        if ((x == &legacy_ext || streams.count(x)) && !ext_wait(x, UINT64_MAX, "cudaDeviceSynchronize"))
            return set_err(cudaErrorLaunchTimeout);
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    EMU_API;
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    EMU_API;
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
    EMU_API;
    if (refuse_in_capture("cudaMemcpy"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    return cudaMemcpyAsync(dst, src, n, kind, nullptr);
}

cudaError_t cudaMemset(void *p, int v, size_t n)
{
    EMU_API;
    if (refuse_in_capture("cudaMemset"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    return cudaMemsetAsync(p, v, n, nullptr);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags)
{
    EMU_API;
    *e = nullptr;
    if (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess))
        return set_err(cudaErrorInvalidValue);
    cudaEvent_t n = new CUevent_st;
    n->flags = flags;
    events.insert(n);
    *e = n;
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    EMU_API;
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    EMU_API;
    if (!event_ok(e))
        return set_err(cudaErrorInvalidResourceHandle);
    events.erase(e);
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    EMU_API;
    if (!event_ok(e))
        return set_err(cudaErrorInvalidResourceHandle);
    e->recorded = true;
    e->queries = 0;
    e->ext_stream = nullptr;
    if (stream_ok(s) && !(s && s->capturing)) {
        CUstream_st *x = ext_of(s);
        ext_reap(x);
        if (!x->ext.empty()) {
            e->ext_stream = x;
            e->ext_upto = x->ext_seq;
        }
    }
    /* no wait for the stream's NCCL operations: the event is complete once they are */
    cudaError_t r = submit(s, [e] { e->t_ms = now_ms(); }, false);
    return r == cudaSuccess ? r : set_err(r);
}

/* Work runs when it is issued, so a recorded event is complete at once unless an NCCL operation
 * before it on its stream is still going; and its first query after each record answers
 * cudaErrorNotReady (as a GPU still copying would), so a caller's polling path runs too. Not an
 * error: the last error is left alone, as CUDA does. */
cudaError_t cudaEventQuery(cudaEvent_t e)
{
    EMU_API;
    if (!event_ok(e))
        return set_err(cudaErrorInvalidResourceHandle);
    if (e->ext_stream) {
        ext_reap(e->ext_stream);
        if (ext_first_pending(e->ext_stream, e->ext_upto))
            return cudaErrorNotReady;
        e->ext_stream = nullptr;
    }
    if (e->recorded && e->queries++ == 0)
        return cudaErrorNotReady;
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    EMU_API;
    if (!event_ok(e))
        return set_err(cudaErrorInvalidResourceHandle);
    if (refuse_in_capture("cudaEventSynchronize"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    if (e->ext_stream) {
        if (!ext_wait(e->ext_stream, e->ext_upto, "cudaEventSynchronize"))
            return set_err(cudaErrorLaunchTimeout);
        if (event_ok(e)) /* (destroyed meanwhile by another thread: the caller's misuse) */
            e->ext_stream = nullptr;
    }
    e->queries = 1;
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    EMU_API;
    if (!event_ok(a) || !event_ok(b))
        return set_err(cudaErrorInvalidResourceHandle);
    if ((a->flags | b->flags) & cudaEventDisableTiming)
        return set_err(cudaErrorInvalidResourceHandle);
    *ms = (float)(b->t_ms - a->t_ms);
    return cudaSuccess;
}

/* ---- what cuda/xfer_gpu.cu adds (the transport's GPU ops table): IPC, pinned host memory,
 * stream-ordered allocations, pointer attributes, the driver's cuMemGetAddressRange */

namespace {
/* The 64-byte handle: which process, which of its fds (a memfd), that memfd's inode (so a handle
 * of a freed allocation whose fd number was reused is refused), its size, and where in it the
 * allocation starts. */
struct emu_ipc_handle {
    char magic[8]; /* "kvfemu1" */
    uint64_t pid;
    int64_t fd;
    uint64_t ino;
    uint64_t map_bytes; /* the memfd's size: the allocation's usable pages */
    uint64_t offset;    /* of the allocation's base in it */
    uint64_t bytes;     /* the allocation's size */
};
static_assert(sizeof(emu_ipc_handle) <= sizeof(cudaIpcMemHandle_t), "the handle must fit CUDA's");
const char ipc_magic[8] = "kvfemu1";

/* Moves an allocation's pages (the guard page stays) onto a memfd at the same addresses, same
 * bytes: from now on another process can map them. */
cudaError_t share_region(region &r)
{
    if (r.fd >= 0)
        return cudaSuccess;
    size_t usable = r.len - page;
    int fd = memfd_create("kvf-emu-device", MFD_CLOEXEC);
    if (fd < 0)
        return cudaErrorMemoryAllocation;
    struct stat sb;
    void *tmp = MAP_FAILED;
    if (ftruncate(fd, (off_t)usable) != 0 || fstat(fd, &sb) != 0 ||
        (tmp = mmap(nullptr, usable, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        close(fd);
        return cudaErrorMemoryAllocation;
    }
    memcpy(tmp, r.map, usable);
    munmap(tmp, usable);
    if (mmap(r.map, usable, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        close(fd);
        return cudaErrorMemoryAllocation; /* (MAP_FIXED failing leaves the old pages in place) */
    }
    r.fd = fd;
    r.ino = (uint64_t)sb.st_ino;
    return cudaSuccess;
}

/* the driver's cuMemGetAddressRange (v3020): the allocation (or IPC mapping) holding ptr */
int emu_cuMemGetAddressRange(unsigned long long *base, size_t *size, unsigned long long ptr)
{
    EMU_API;
    const void *p = (const void *)(uintptr_t)ptr;
    auto it = find_holding(allocs, p, [](size_t b) { return b; });
    if (it != allocs.end()) {
        if (base)
            *base = it->first;
        if (size)
            *size = it->second;
        return 0;
    }
    auto im = find_holding(ipc_maps, p, [](const ipc_map &m) { return m.bytes; });
    if (im != ipc_maps.end()) {
        if (base)
            *base = im->first;
        if (size)
            *size = im->second.bytes;
        return 0;
    }
    return 1; /* CUDA_ERROR_INVALID_VALUE */
}
} /* namespace */

/* As CUDA: the handle names the whole allocation that holds devPtr (a peer maps it from its
 * start), whatever offset devPtr has in it. */
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr)
{
    EMU_API;
    if (!handle)
        return set_err(cudaErrorInvalidValue);
    auto it = find_holding(allocs, devPtr, [](size_t b) { return b; });
    if (it == allocs.end())
        return set_err(cudaErrorInvalidValue); /* not an allocation of this process (an IPC mapping either) */
    region &r = regions[it->first];
    cudaError_t e = share_region(r);
    if (e != cudaSuccess)
        return set_err(e);
    emu_ipc_handle h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, ipc_magic, sizeof h.magic);
    h.pid = (uint64_t)getpid();
    h.fd = r.fd;
    h.ino = r.ino;
    h.map_bytes = r.len - page;
    h.offset = it->first - (uintptr_t)r.map;
    h.bytes = it->second;
    memset(handle, 0, sizeof *handle);
    memcpy(handle, &h, sizeof h);
    st_.ipc_exported++;
    return cudaSuccess;
}

/* Maps another process's exported allocation (its memfd through /proc/<pid>/fd/<n>) before an
 * inaccessible page. A handle of this very process is refused, as CUDA refuses it (invalid
 * device context); the same handle opened twice shares one mapping with a count. */
cudaError_t cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags)
{
    EMU_API;
    if (!devPtr)
        return set_err(cudaErrorInvalidValue);
    *devPtr = nullptr;
    if (flags != cudaIpcMemLazyEnablePeerAccess)
        return set_err(cudaErrorInvalidValue);
    if (refuse_in_capture("cudaIpcOpenMemHandle"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    emu_ipc_handle h;
    memcpy(&h, &handle, sizeof h);
    if (memcmp(h.magic, ipc_magic, sizeof h.magic) != 0 || h.fd < 0 || h.offset + h.bytes > h.map_bytes)
        return set_err(cudaErrorInvalidResourceHandle);
    if (h.pid == (uint64_t)getpid())
        return set_err(cudaErrorDeviceUninitialized); /* CUDA: "invalid device context" */
    for (auto &m : ipc_maps)
        if (m.second.pid == h.pid && m.second.ino == h.ino) {
            m.second.refs++;
            *devPtr = (void *)m.first;
            return cudaSuccess;
        }
    char path[64];
    snprintf(path, sizeof path, "/proc/%llu/fd/%lld", (unsigned long long)h.pid, (long long)h.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return set_err(cudaErrorMapBufferObjectFailed); /* the exporter is gone, or freed it */
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_ino != h.ino || (uint64_t)sb.st_size != h.map_bytes) {
        close(fd);
        return set_err(cudaErrorInvalidResourceHandle); /* that fd is something else now */
    }
    size_t len = (size_t)h.map_bytes + page;
    void *m = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED ||
        mmap(m, (size_t)h.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        if (m != MAP_FAILED)
            munmap(m, len);
        close(fd);
        return set_err(cudaErrorMapBufferObjectFailed);
    }
    close(fd); /* the mapping keeps the pages */
    char *base = static_cast<char *>(m) + h.offset;
    ipc_maps[(uintptr_t)base] = {(size_t)h.bytes, m, len, 1, h.pid, h.ino};
    st_.ipc_opened++;
    *devPtr = base;
    return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void *devPtr)
{
    EMU_API;
    auto it = ipc_maps.find((uintptr_t)devPtr);
    if (it == ipc_maps.end())
        return set_err(cudaErrorInvalidValue);
    if (--it->second.refs > 0)
        return cudaSuccess;
    /* as cudaFree: a copy into the closed mapping faults instead of landing anywhere */
    unmap_keep_reserved(it->second.map, it->second.len);
    ipc_maps.erase(it);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attr, const void *ptr)
{
    EMU_API;
    if (!attr)
        return set_err(cudaErrorInvalidValue);
    memset(attr, 0, sizeof *attr);
    if (any_alloc_holds(ptr)) {
        attr->type = cudaMemoryTypeDevice;
        attr->device = 0;
        attr->devicePointer = const_cast<void *>(ptr);
        return cudaSuccess;
    }
    if (find_holding(host_allocs, ptr, [](const host_region &r) { return r.bytes; }) != host_allocs.end()) {
        attr->type = cudaMemoryTypeHost;
        attr->device = 0;
        attr->devicePointer = attr->hostPointer = const_cast<void *>(ptr);
        return cudaSuccess;
    }
    attr->type = cudaMemoryTypeUnregistered; /* plain host memory: not an error since CUDA 11 */
    attr->device = -2;
    attr->hostPointer = const_cast<void *>(ptr);
    return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr, unsigned int cudaVersion,
                                             unsigned long long flags, cudaDriverEntryPointQueryResult *driverStatus)
{
    EMU_API;
    if (!symbol || !funcPtr)
        return set_err(cudaErrorInvalidValue);
    *funcPtr = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (!strcmp(symbol, "cuMemGetAddressRange")) {
        q = cudaVersion >= 3020 ? cudaDriverEntryPointSuccess : cudaDriverEntryPointVersionNotSufficent;
        if (q == cudaDriverEntryPointSuccess)
            *funcPtr = (void *)&emu_cuMemGetAddressRange;
    }
    if (driverStatus)
        *driverStatus = q;
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned int flags)
{
    EMU_API;
    if (!p)
        return set_err(cudaErrorInvalidValue);
    *p = nullptr;
    if (refuse_in_capture("cudaHostAlloc"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    char *base;
    void *m;
    size_t len;
    if (!map_guarded(bytes, &base, &m, &len))
        return set_err(cudaErrorMemoryAllocation);
    host_allocs[(uintptr_t)base] = {bytes, m, len};
    *p = base;
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p)
{
    EMU_API;
    if (!p)
        return cudaSuccess;
    if (refuse_in_capture("cudaFreeHost"))
        return set_err(cudaErrorStreamCaptureUnsupported);
    auto it = host_allocs.find((uintptr_t)p);
    if (it == host_allocs.end()) {
        problem("cudaFreeHost of %p, which cudaHostAlloc did not return", p);
        return set_err(cudaErrorInvalidValue);
    }
    unmap_keep_reserved(it->second.map, it->second.len);
    host_allocs.erase(it);
    return cudaSuccess;
}

/* Stream-ordered allocations: the stream's earlier work has run already (work runs when it is
 * issued), so they are plain allocations made and freed now. Inside a capture they would be
 * graph memory nodes, which this emulation does not record. */
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s)
{
    EMU_API;
    if (!p)
        return set_err(cudaErrorInvalidValue);
    *p = nullptr;
    if (!stream_ok(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (s && s->capturing) {
        problem("cudaMallocAsync inside a stream capture (graph memory nodes are not emulated)");
        return set_err(cudaErrorStreamCaptureUnsupported);
    }
    return alloc_device(p, bytes);
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t s)
{
    EMU_API;
    if (!stream_ok(s))
        return set_err(cudaErrorInvalidResourceHandle);
    if (s && s->capturing) {
        problem("cudaFreeAsync inside a stream capture (graph memory nodes are not emulated)");
        return set_err(cudaErrorStreamCaptureUnsupported);
    }
    if (!p)
        return cudaSuccess;
    /* an NCCL recv before it on the stream may still be writing p */
    if (!ext_wait(ext_of(s), UINT64_MAX, "cudaFreeAsync"))
        return set_err(cudaErrorLaunchTimeout);
    return free_device(p, "cudaFreeAsync");
}
