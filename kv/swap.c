/* swap.c: the host tier of kv/swap.h: a slab of host slots with a free stack, and the copies
 * out of and back into the pool through the pool's memory ops. */
#include "kv/swap.h"

#include <stdlib.h>
#include <string.h>

#include "kv/pool_internal.h"

struct kvf_kv_swap {
    kvf_kv_pool *pool;
    int64_t block_bytes;
    int32_t n_slots, n_free;
    char *host;          /* [n_slots][block_bytes] */
    int32_t *free_stack; /* [n_slots] */
    uint8_t *in_use;     /* [n_slots] */
    uint8_t *mark;       /* [n_slots] scratch for kvf_kv_swap_check, zero between calls */
};

kvf_status kvf_kv_swap_create(kvf_kv_pool *pool, int32_t n_slots, kvf_kv_swap **out, kvf_err *err)
{
    if (!pool || !out)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: swap_create needs a pool and an out pointer");
    int64_t bb = kvf_kv_pool_layout(pool)->block_bytes;
    if (n_slots <= 0 || bb > INT64_MAX / n_slots || (uint64_t)(bb * n_slots) > SIZE_MAX)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: swap tier of %d slots of %lld bytes is not "
                           "allowed (at least 1 slot, within the address space)", n_slots,
                           (long long)bb);
    kvf_kv_swap *s = calloc(1, sizeof *s);
    if (!s)
        return kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of memory for a swap tier");
    s->pool = pool;
    s->block_bytes = bb;
    s->n_slots = n_slots;
    s->host = malloc((size_t)(bb * n_slots));
    s->free_stack = malloc((size_t)n_slots * sizeof *s->free_stack);
    s->in_use = calloc((size_t)n_slots, 1);
    s->mark = calloc((size_t)n_slots, 1);
    if (!s->host || !s->free_stack || !s->in_use || !s->mark) {
        kvf_kv_swap_destroy(s);
        return kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of host memory for a swap tier of %d "
                           "slots of %lld bytes", n_slots, (long long)bb);
    }
    for (int32_t i = 0; i < n_slots; i++)
        s->free_stack[s->n_free++] = n_slots - 1 - i;
    *out = s;
    return KVF_OK;
}

void kvf_kv_swap_destroy(kvf_kv_swap *s)
{
    if (!s)
        return;
    free(s->host);
    free(s->free_stack);
    free(s->in_use);
    free(s->mark);
    free(s);
}

int32_t kvf_kv_swap_slots_total(const kvf_kv_swap *s) { return s->n_slots; }
int32_t kvf_kv_swap_slots_free(const kvf_kv_swap *s) { return s->n_free; }

const void *kvf_kv_swap_slot_ptr(const kvf_kv_swap *s, int32_t slot)
{
    return slot >= 0 && slot < s->n_slots ? s->host + (int64_t)slot * s->block_bytes : NULL;
}

static void slot_put(kvf_kv_swap *s, int32_t slot)
{
    s->in_use[slot] = 0;
    s->free_stack[s->n_free++] = slot;
}

kvf_status kvf_kv_swap_out(kvf_kv_swap *s, kvf_kv_seq *seq, kvf_err *err)
{
    if (!s || !seq || seq->pool != s->pool)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: swap_out: the sequence is not of this "
                           "tier's pool");
    if (seq->state != KVF_KV_SEQ_ACTIVE)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: swap_out: sequence is %s (must be active)",
                           seq->state == KVF_KV_SEQ_SWAPPED ? "already swapped out" : "released");
    if (seq->n_promoting > 0)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: swap_out: %d blocks of the sequence are still "
                           "being promoted from a tier", seq->n_promoting);
    if (seq->n_blocks > s->n_free)
        return kvf_err_set(err, KVF_ERR_FULL, "kv: swap_out: %d blocks but only %d host slots "
                           "are free", seq->n_blocks, s->n_free);
    kvf_status st = kvf_kv_seq_check_held(seq, err);
    if (st != KVF_OK)
        return st;
    void *ctx;
    const kvf_kv_mem_ops *mem = kvf_kv_pool_mem(s->pool, &ctx);
    const void *base = kvf_kv_pool_base(s->pool);
    /* Copy everything first; on a failed copy give the slots back and change nothing. */
    int32_t n = seq->n_blocks;
    for (int32_t i = 0; i < n; i++) {
        int32_t slot = s->free_stack[s->n_free - 1 - i];
        st = mem->to_host(ctx, s->host + (int64_t)slot * s->block_bytes, base, s->block_bytes,
                          seq->blocks[i], err);
        if (st != KVF_OK)
            return kvf_err_prefix(err, "kv: swap_out of block %d", seq->blocks[i]);
    }
    kvf_kv_seq_release_blocks(seq);
    for (int32_t i = 0; i < n; i++) {
        int32_t slot = s->free_stack[--s->n_free];
        s->in_use[slot] = 1;
        seq->blocks[i] = slot;
    }
    seq->n_blocks = n;
    seq->state = KVF_KV_SEQ_SWAPPED;
    seq->swap = s;
    return KVF_OK;
}

kvf_status kvf_kv_swap_in(kvf_kv_swap *s, kvf_kv_seq *seq, kvf_err *err)
{
    if (!s || !seq || seq->state != KVF_KV_SEQ_SWAPPED || seq->swap != s)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: swap_in: the sequence is not swapped out to "
                           "this tier");
    int32_t n = seq->n_blocks;
    if (n > kvf_kv_pool_available(s->pool))
        return kvf_err_set(err, KVF_ERR_FULL, "kv: swap_in: %d blocks needed but only %d are "
                           "available", n, kvf_kv_pool_available(s->pool));
    void *ctx;
    const kvf_kv_mem_ops *mem = kvf_kv_pool_mem(s->pool, &ctx);
    void *base = kvf_kv_pool_base(s->pool);
    /* The slots move to hashes[] (forgotten anyway) so a failed copy can be rolled back. */
    for (int32_t i = 0; i < n; i++)
        seq->hashes[i] = (uint64_t)seq->blocks[i];
    for (int32_t i = 0; i < n; i++) {
        int32_t id = kvf_kv_pool_take_block(s->pool);
        int32_t slot = (int32_t)seq->hashes[i];
        kvf_status st = mem->from_host(ctx, base, s->block_bytes, id,
                                       s->host + (int64_t)slot * s->block_bytes, err);
        if (st != KVF_OK) {
            kvf_kv_pool_put_block(s->pool, id);
            for (int32_t j = 0; j < i; j++)
                kvf_kv_pool_put_block(s->pool, seq->blocks[j]);
            for (int32_t j = 0; j < n; j++)
                seq->blocks[j] = (int32_t)seq->hashes[j];
            return kvf_err_prefix(err, "kv: swap_in of host slot %d", slot);
        }
        seq->blocks[i] = id;
    }
    for (int32_t i = 0; i < n; i++)
        slot_put(s, (int32_t)seq->hashes[i]);
    seq->n_hashed = 0;
    seq->state = KVF_KV_SEQ_ACTIVE;
    seq->swap = NULL;
    return KVF_OK;
}

kvf_status kvf_kv_swap_drop(kvf_kv_swap *s, kvf_kv_seq *seq, kvf_err *err)
{
    if (!s || !seq || seq->state != KVF_KV_SEQ_SWAPPED || seq->swap != s)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: swap_drop: the sequence is not swapped out "
                           "to this tier");
    for (int32_t i = 0; i < seq->n_blocks; i++) {
        int32_t slot = seq->blocks[i];
        if (slot < 0 || slot >= s->n_slots || !s->in_use[slot])
            return kvf_err_set(err, KVF_ERR_STATE, "kv: swap_drop: host slot %d at position %d "
                               "is not held (0 to %d in use only)", slot, i, s->n_slots - 1);
    }
    for (int32_t i = 0; i < seq->n_blocks; i++)
        slot_put(s, seq->blocks[i]);
    seq->n_blocks = 0;
    seq->n_tokens = 0;
    seq->n_hashed = 0;
    seq->state = KVF_KV_SEQ_RELEASED;
    seq->swap = NULL;
    return KVF_OK;
}

kvf_status kvf_kv_swap_check(const kvf_kv_swap *s, const kvf_kv_seq *const *seqs, size_t n_seqs,
                             kvf_err *err)
{
    kvf_status st = KVF_OK;
    int64_t held = 0;
    for (size_t i = 0; i < n_seqs && st == KVF_OK; i++) {
        const kvf_kv_seq *q = seqs[i];
        if (q->state != KVF_KV_SEQ_SWAPPED || q->swap != s)
            continue;
        for (int32_t j = 0; j < q->n_blocks; j++) {
            int32_t slot = q->blocks[j];
            if (slot < 0 || slot >= s->n_slots || !s->in_use[slot] || s->mark[slot]) {
                st = kvf_err_set(err, KVF_ERR_INTERNAL, "kv: swap invariant: sequence %zu "
                                 "position %d names host slot %d (outside, not in use, or held "
                                 "twice)", i, j, slot);
                break;
            }
            s->mark[slot] = 1;
            held++;
        }
    }
    int32_t in_use = 0;
    for (int32_t i = 0; i < s->n_slots; i++) {
        in_use += s->in_use[i];
        if (st == KVF_OK && s->in_use[i] && !s->mark[i])
            st = kvf_err_set(err, KVF_ERR_INTERNAL, "kv: swap invariant: host slot %d is in use "
                             "but no swapped sequence holds it", i);
        s->mark[i] = 0;
    }
    for (int32_t i = 0; i < s->n_free && st == KVF_OK; i++)
        if (s->in_use[s->free_stack[i]])
            st = kvf_err_set(err, KVF_ERR_INTERNAL, "kv: swap invariant: host slot %d is both "
                             "free and in use", s->free_stack[i]);
    if (st == KVF_OK && (held != in_use || in_use + s->n_free != s->n_slots))
        st = kvf_err_set(err, KVF_ERR_INTERNAL, "kv: swap invariant: %lld slots held, %d in use, "
                         "%d free of %d", (long long)held, in_use, s->n_free, s->n_slots);
    return st;
}
