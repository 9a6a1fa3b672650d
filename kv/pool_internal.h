/* pool_internal.h: what kv/swap.c needs from kv/pool.c beyond the public API. Not for use
 * outside kv/. */
#ifndef KVF_KV_POOL_INTERNAL_H
#define KVF_KV_POOL_INTERNAL_H

#include "kv/pool.h"

/* The pool's memory table and its context. */
const kvf_kv_mem_ops *kvf_kv_pool_mem(const kvf_kv_pool *pool, void **ctx_out);
/* Takes one block (free first, else evicts the LRU cached one) with refcount 1; -1 when none. */
int32_t kvf_kv_pool_take_block(kvf_kv_pool *pool);
/* Returns one reference on a block (for rolling back a take). */
void kvf_kv_pool_put_block(kvf_kv_pool *pool, int32_t id);
/* Checks that every block id of an ACTIVE seq is inside the pool and that releasing them all
 * would not drive a refcount below zero. Changes nothing. */
kvf_status kvf_kv_seq_check_held(const kvf_kv_seq *seq, kvf_err *err);
/* Releases every block of seq, last block first, and empties its table (n_blocks = 0). */
void kvf_kv_seq_release_blocks(kvf_kv_seq *seq);

#endif
