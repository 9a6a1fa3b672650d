/* emu_side.h: one backend's side of a host emulation test: the backend context, a forward pass
 * over a model and a KV pool of N_POOL blocks made through the backend's kv_mem ops (device
 * memory on the emulated GPU). Header-only, for host_backend_emu.c and host_sample_emu.c;
 * include after cmocka's headers. */
#ifndef KVF_TEST_EMU_SIDE_H
#define KVF_TEST_EMU_SIDE_H

#include <string.h>

#include "kv/pool.h"
#include "model/forward.h"

typedef struct side {
    const kvf_backend *be;
    void *ctx;
    kvf_model_fwd *fwd;
    const kvf_kv_mem_ops *mem;
    void *pool;
    kvf_kv_layout lay;
} side;

#define N_POOL 40

static void side_open(side *s, const kvf_backend *be, const kvf_model *m, const kvf_backend_opts *bo,
                      kvf_dtype kv)
{
    kvf_err err = {0};
    memset(s, 0, sizeof *s);
    s->be = be;
    if (kvf_backend_create(be, bo, &s->ctx, &err) != KVF_OK)
        fail_msg("%s create: %s", kvf_backend_name(be), err.msg);
    assert_int_equal(kvf_model_kv_layout(m, 16, kv, &s->lay, &err), KVF_OK);
    kvf_model_fwd_opts o = {.max_tokens = 128, .max_seqs = 4, .max_ctx = 256};
    if (kvf_model_fwd_create(m, be, s->ctx, &s->lay, &o, &s->fwd, &err) != KVF_OK)
        fail_msg("%s fwd_create: %s", kvf_backend_name(be), err.msg);
    s->mem = kvf_backend_kv_mem(be, s->ctx);
    if (!s->mem) /* host memory */
        s->mem = &kvf_kv_mem_host;
    if (s->mem->alloc(s->ctx, N_POOL * s->lay.block_bytes, &s->pool, &err) != KVF_OK)
        fail_msg("%s pool: %s", kvf_backend_name(be), err.msg);
}

static void side_close(side *s)
{
    kvf_err err = {0};
    s->mem->free(s->ctx, s->pool, N_POOL * s->lay.block_bytes);
    kvf_model_fwd_destroy(s->fwd);
    assert_int_equal(kvf_backend_sync(s->be, s->ctx, &err), KVF_OK);
    kvf_backend_destroy(s->be, s->ctx);
}

#endif
