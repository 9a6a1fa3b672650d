/* gpu_double.h: a host-memory stand-in for the transport's GPU ops table (kvf_xfer_gpu), so the
 * GPU code paths of transport/ run on machines without a GPU. "Device memory" is host memory;
 * copies are queued like stream work and run only when a mark after them is queried (the first
 * query of every mark answers "busy"), so code that touches bytes before its mark is done sees
 * stale data and fails the byte checks. IPC: "device" pools made with gpu_double_dev_alloc live
 * in POSIX shared memory whose name is the handle, so cuda_ipc runs between two real processes.
 * Work of another engine can sit on the stream as a gate (gpu_double_push_gate): started when
 * the stream reaches it, holding back everything after it until it is done; included after
 * nccl_emu.h, gpu_double_nccl_streams puts the NCCL emulation's operations there. Counters of
 * live marks, stream-ordered allocations and gates let tests check that everything is freed.
 * Header-only; one double per process, used from one thread (gates may finish on others). */
#ifndef KVF_TEST_GPU_DOUBLE_H
#define KVF_TEST_GPU_DOUBLE_H

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "transport/xfer.h"

/* Another engine's work on the stream (a gate): start it, ask whether it is done, let go. */
typedef struct dbl_gate_ops {
    void (*start)(void *gate);
    bool (*done)(void *gate);
    void (*release)(void *gate);
} dbl_gate_ops;

typedef struct dbl_op {
    void *dst; /* NULL: a deferred free of src, or a gate */
    const void *src;
    size_t n;
    const dbl_gate_ops *gate_ops; /* a gate: src is the gate */
    bool started;
} dbl_op;

typedef struct dbl_shm {
    void *base;
    size_t bytes;
    char name[48];
    bool owner; /* created here (unlinked at free), else opened from a handle */
} dbl_shm;

typedef struct gpu_double {
    bool available;
    const char *why;
    dbl_op *q; /* [n_q] queued, in stream order; q_done of them ran; q[0] is op number q_base */
    size_t n_q, cap_q, q_done, q_base;
    dbl_shm shm[16];
    int n_shm, next_shm;
    int64_t copies, busy_answers;
    int64_t marks_live, dev_live, gates_live; /* made and not yet freed / released */
    int64_t dev_allocs;                       /* dev_alloc_async calls that succeeded */
} gpu_double;

static gpu_double dbl = {.available = true};

typedef struct dbl_mark {
    size_t upto; /* op number (absolute) the mark comes after */
    int queries;
} dbl_mark_t;

/* Runs queued work up to op index upto (relative to q_base); false when a gate that is not
 * done holds it back (what is before the gate ran, the gate was started). */
static bool dbl_run(size_t upto)
{
    for (; dbl.q_done < upto; dbl.q_done++) {
        dbl_op *o = &dbl.q[dbl.q_done];
        if (o->gate_ops) {
            void *g = (void *)o->src;
            if (!o->started) {
                o->started = true;
                o->gate_ops->start(g);
            }
            if (!o->gate_ops->done(g))
                return false;
            o->gate_ops->release(g);
            dbl.gates_live--;
        } else if (o->dst) {
            memcpy(o->dst, o->src, o->n);
        } else {
            free((void *)o->src);
            dbl.dev_live--;
        }
    }
    if (dbl.q_done == dbl.n_q) {
        dbl.q_base += dbl.n_q;
        dbl.n_q = dbl.q_done = 0;
    }
    return true;
}

static kvf_status dbl_push(dbl_op op, kvf_err *err)
{
    if (dbl.n_q == dbl.cap_q) {
        size_t cap = dbl.cap_q ? dbl.cap_q * 2 : 64;
        dbl_op *nq = realloc(dbl.q, cap * sizeof *nq);
        if (!nq)
            return kvf_err_set(err, KVF_ERR_NOMEM, "gpu double: out of memory");
        dbl.q = nq;
        dbl.cap_q = cap;
    }
    dbl.q[dbl.n_q++] = op;
    return KVF_OK;
}

static bool dbl_available(void *ctx, char *why, size_t why_len)
{
    if (!dbl.available && why)
        snprintf(why, why_len, "%s", dbl.why ? dbl.why : "no device (test double)");
    return dbl.available;
}

static kvf_status dbl_ipc_export(void *ctx, void *base, uint8_t handle_out[KVF_XFER_IPC_HANDLE_BYTES],
                                 kvf_err *err)
{
    for (int i = 0; i < dbl.n_shm; i++)
        if (dbl.shm[i].base == base && dbl.shm[i].owner) {
            memset(handle_out, 0, KVF_XFER_IPC_HANDLE_BYTES);
            memcpy(handle_out, dbl.shm[i].name, strlen(dbl.shm[i].name));
            return KVF_OK;
        }
    return kvf_err_set(err, KVF_ERR_INVALID, "gpu double: %p is not the start of a "
                       "gpu_double_dev_alloc allocation", base);
}

static kvf_status dbl_ipc_open(void *ctx, const uint8_t handle[KVF_XFER_IPC_HANDLE_BYTES],
                               void **base_out, kvf_err *err)
{
    if (dbl.n_shm == 16)
        return kvf_err_set(err, KVF_ERR_FULL, "gpu double: too many mappings");
    dbl_shm *s = &dbl.shm[dbl.n_shm];
    memset(s, 0, sizeof *s);
    memcpy(s->name, handle, sizeof s->name - 1);
    int fd = shm_open(s->name, O_RDWR, 0600);
    struct stat stt;
    if (fd < 0 || fstat(fd, &stt) != 0) {
        if (fd >= 0)
            close(fd);
        return kvf_err_set(err, KVF_ERR_INVALID, "gpu double: no shared memory '%s'", s->name);
    }
    s->bytes = (size_t)stt.st_size;
    s->base = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (s->base == MAP_FAILED)
        return kvf_err_set(err, KVF_ERR_NOMEM, "gpu double: mapping '%s' failed", s->name);
    dbl.n_shm++;
    *base_out = s->base;
    return KVF_OK;
}

static void dbl_shm_remove(int i)
{
    munmap(dbl.shm[i].base, dbl.shm[i].bytes);
    if (dbl.shm[i].owner)
        shm_unlink(dbl.shm[i].name);
    dbl.shm[i] = dbl.shm[--dbl.n_shm];
}

static void dbl_ipc_close(void *ctx, void *base)
{
    for (int i = 0; i < dbl.n_shm; i++)
        if (dbl.shm[i].base == base && !dbl.shm[i].owner) {
            dbl_shm_remove(i);
            return;
        }
}

static kvf_status dbl_copy_async(void *ctx, void *dst, const void *src, size_t bytes, kvf_err *err)
{
    dbl.copies++;
    return dbl_push((dbl_op){.dst = dst, .src = src, .n = bytes}, err);
}

static kvf_status dbl_mark(void *ctx, void **mark_out, kvf_err *err)
{
    dbl_mark_t *m = calloc(1, sizeof *m);
    if (!m)
        return kvf_err_set(err, KVF_ERR_NOMEM, "gpu double: out of memory");
    m->upto = dbl.q_base + dbl.n_q;
    dbl.marks_live++;
    *mark_out = m;
    return KVF_OK;
}

static kvf_status dbl_mark_query(void *ctx, void *mark, kvf_err *err)
{
    dbl_mark_t *m = mark;
    if (m->queries++ == 0) {
        dbl.busy_answers++;
        return KVF_ERR_BUSY;
    }
    if (m->upto > dbl.q_base + dbl.q_done && !dbl_run(m->upto - dbl.q_base))
        return KVF_ERR_BUSY; /* behind a gate still running */
    return KVF_OK;
}

static void dbl_mark_free(void *ctx, void *mark)
{
    dbl.marks_live--;
    free(mark);
}

/* Runs everything; a gate still running is waited for, up to 30 s. */
static kvf_status dbl_sync(void *ctx, kvf_err *err)
{
    for (int i = 0; i < 30000; i++) {
        if (dbl_run(dbl.n_q))
            return KVF_OK;
        nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    }
    return kvf_err_set(err, KVF_ERR_TIMEOUT, "gpu double: sync: work of another engine on the "
                       "stream did not finish in 30 s");
}

/* Puts another engine's work on the stream (see dbl_gate_ops). */
static inline kvf_status gpu_double_push_gate(const dbl_gate_ops *ops, void *gate, kvf_err *err)
{
    kvf_status st = dbl_push((dbl_op){.src = gate, .gate_ops = ops}, err);
    if (st == KVF_OK)
        dbl.gates_live++;
    return st;
}

static kvf_status dbl_host_alloc(void *ctx, size_t bytes, void **out, kvf_err *err)
{
    *out = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    return *out ? KVF_OK : kvf_err_set(err, KVF_ERR_NOMEM, "gpu double: out of memory");
}

static void dbl_host_free(void *ctx, void *p)
{
    free(p);
}

static kvf_status dbl_dev_alloc_async(void *ctx, size_t bytes, void **out, kvf_err *err)
{
    *out = malloc(bytes);
    if (*out) {
        dbl.dev_live++;
        dbl.dev_allocs++;
    }
    return *out ? KVF_OK : kvf_err_set(err, KVF_ERR_NOMEM, "gpu double: out of memory");
}

static void dbl_dev_free_async(void *ctx, void *p)
{
    if (dbl_push((dbl_op){.dst = NULL, .src = p}, NULL) != KVF_OK) {
        free(p); /* out of memory: the queue is empty of its users by then in these tests */
        dbl.dev_live--;
    }
}

static void *dbl_stream(void *ctx)
{
    return NULL;
}

static const kvf_xfer_gpu gpu_double_ops = {
    .name = "double",
    .ctx = &dbl,
    .available = dbl_available,
    .ipc_export = dbl_ipc_export,
    .ipc_open = dbl_ipc_open,
    .ipc_close = dbl_ipc_close,
    .copy_async = dbl_copy_async,
    .mark = dbl_mark,
    .mark_query = dbl_mark_query,
    .mark_free = dbl_mark_free,
    .sync = dbl_sync,
    .host_alloc = dbl_host_alloc,
    .host_free = dbl_host_free,
    .dev_alloc_async = dbl_dev_alloc_async,
    .dev_free_async = dbl_dev_free_async,
    .stream = dbl_stream,
};

#ifdef KVF_TEST_NCCL_EMU_H
/* The NCCL emulation's operations as gates on the double's one stream. */
static void dbl_nccl_start(void *g)
{
    kvf_nccl_emu_op_start(g);
}

static bool dbl_nccl_done(void *g)
{
    return kvf_nccl_emu_op_done(g);
}

static void dbl_nccl_release(void *g)
{
    kvf_nccl_emu_op_release(g);
}

static const dbl_gate_ops dbl_nccl_gate = {
    .start = dbl_nccl_start, .done = dbl_nccl_done, .release = dbl_nccl_release,
};

static bool dbl_nccl_enqueue(void *ctx, void *stream, kvf_nccl_emu_op *op)
{
    return gpu_double_push_gate(&dbl_nccl_gate, op, NULL) == KVF_OK;
}

static const kvf_nccl_emu_streams gpu_double_nccl_streams = {
    .ctx = &dbl, .enqueue = dbl_nccl_enqueue,
};
#endif

/* A zeroed "device" pool in shared memory (so its handle can be opened by another process). */
static inline void *gpu_double_dev_alloc(size_t bytes)
{
    if (dbl.n_shm == 16)
        return NULL;
    dbl_shm *s = &dbl.shm[dbl.n_shm];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "/kvf-gpudbl-%d-%d", (int)getpid(), dbl.next_shm++);
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return NULL;
    if (ftruncate(fd, (off_t)bytes) != 0) {
        close(fd);
        shm_unlink(s->name);
        return NULL;
    }
    s->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (s->base == MAP_FAILED) {
        shm_unlink(s->name);
        return NULL;
    }
    s->bytes = bytes;
    s->owner = true;
    dbl.n_shm++;
    return s->base;
}

static inline void gpu_double_dev_free(void *base)
{
    for (int i = 0; i < dbl.n_shm; i++)
        if (dbl.shm[i].base == base && dbl.shm[i].owner) {
            dbl_shm_remove(i);
            return;
        }
}

#endif
