/* lru.h: a bounded set of block hashes with LRU order over unpinned entries and a reference
 * count that pins entries in use (the workers' eviction rule: LRU over unreferenced blocks).
 * The simulator's worker caches and the router's approximate mode are built on it. */
#ifndef KVF_ROUTER_LRU_H
#define KVF_ROUTER_LRU_H

#include <stdint.h>

#include "common/status.h"

typedef struct kvf_router_lru kvf_router_lru;

/* capacity: most entries held at once (1 .. 2^30). */
kvf_status kvf_router_lru_create(int64_t capacity, kvf_router_lru **out, kvf_err *err);
void kvf_router_lru_destroy(kvf_router_lru *c);

/* The entry holding key, or -1. Entry ids stay valid until the entry is evicted or removed. */
int32_t kvf_router_lru_find(const kvf_router_lru *c, uint64_t key);
/* Adds an absent key, pinned once when pin is set, else as most recently used. When full it
 * first evicts the least recently used unpinned entry, reporting its key in *evicted_key_out
 * with *evicted_out = 1. Returns the entry, or -1 when every entry is pinned (nothing added). */
int32_t kvf_router_lru_insert(kvf_router_lru *c, uint64_t key, int pin, double now,
                              int *evicted_out, uint64_t *evicted_key_out);
void kvf_router_lru_pin(kvf_router_lru *c, int32_t e);
/* Drops one reference; at zero the entry becomes the most recently used, stamped now. */
void kvf_router_lru_unpin(kvf_router_lru *c, int32_t e, double now);
/* Makes an unpinned entry the most recently used, stamped now. */
void kvf_router_lru_touch(kvf_router_lru *c, int32_t e, double now);
/* Evicts the least recently used unpinned entry if its stamp is before `before`; returns 1 and
 * its key, or 0 when there is none. */
int kvf_router_lru_pop(kvf_router_lru *c, double before, uint64_t *key_out);
void kvf_router_lru_remove(kvf_router_lru *c, int32_t e);

int64_t kvf_router_lru_size(const kvf_router_lru *c);
int64_t kvf_router_lru_capacity(const kvf_router_lru *c);
int32_t kvf_router_lru_refs(const kvf_router_lru *c, int32_t e);

#endif
