/* swap.h: the host tier for preempted sequences: swap_out copies a sequence's blocks to host
 * slots (through the pool's mem->to_host) and releases its pool blocks; swap_in takes fresh
 * pool blocks and copies the bytes back. Choosing between swap and recompute is the engine's. */
#ifndef KVF_KV_SWAP_H
#define KVF_KV_SWAP_H

#include <stdint.h>

#include "common/status.h"
#include "kv/pool.h"

typedef struct kvf_kv_swap kvf_kv_swap;

/* A host tier of n_slots blocks (n_slots * block_bytes bytes of host memory, owned by the
 * swap) for pool. The pool must outlive it. */
kvf_status kvf_kv_swap_create(kvf_kv_pool *pool, int32_t n_slots, kvf_kv_swap **out,
                              kvf_err *err);
/* Frees the host memory; sequences still SWAPPED into it lose their data (fini them first). */
void kvf_kv_swap_destroy(kvf_kv_swap *swap);

/* Copies every block of an ACTIVE seq to host slots and releases its pool blocks (as
 * kvf_kv_seq_free would, so registered blocks stay cached); seq becomes SWAPPED with
 * blocks[] naming host slots. ERR_FULL when the tier lacks slots; nothing changes then. */
kvf_status kvf_kv_swap_out(kvf_kv_swap *swap, kvf_kv_seq *seq, kvf_err *err);
/* Takes seq->n_blocks pool blocks (all or nothing: ERR_FULL), copies the bytes back, frees the
 * host slots; seq is ACTIVE again with the same n_tokens. Its hashes are forgotten
 * (n_hashed = 0): the next kvf_kv_seq_commit registers its full blocks again. */
kvf_status kvf_kv_swap_in(kvf_kv_swap *swap, kvf_kv_seq *seq, kvf_err *err);
/* Frees the host slots of a SWAPPED seq without copying back (a cancelled request); seq
 * becomes RELEASED. kvf_kv_seq_free and kvf_kv_seq_fini on a SWAPPED seq do the same. */
kvf_status kvf_kv_swap_drop(kvf_kv_swap *swap, kvf_kv_seq *seq, kvf_err *err);

int32_t kvf_kv_swap_slots_total(const kvf_kv_swap *swap);
int32_t kvf_kv_swap_slots_free(const kvf_kv_swap *swap);
/* Host address of a slot (for tests and for a transport that reads swapped blocks). */
const void *kvf_kv_swap_slot_ptr(const kvf_kv_swap *swap, int32_t slot);

/* Slots in use == sum of n_blocks over the SWAPPED sequences of this tier in seqs, each slot
 * held once; ERR_INTERNAL naming the first broken rule. */
kvf_status kvf_kv_swap_check(const kvf_kv_swap *swap, const kvf_kv_seq *const *seqs,
                             size_t n_seqs, kvf_err *err);

#endif
