/* lru.c: entries live in parallel arrays with a free list; a doubly linked list orders the
 * unpinned ones (head = least recently used); an open-addressing map finds an entry by key. */
#include "router/lru.h"

#include <stdlib.h>

typedef struct map_slot {
    uint64_t key;
    int32_t e; /* -1: empty */
} map_slot;

struct kvf_router_lru {
    int64_t cap, size;
    uint64_t *key;
    int32_t *prev, *next, *ref;
    double *stamp;
    int32_t head, tail, free_head;
    map_slot *map;
    uint64_t mask;
    int shift;
};

static inline uint64_t home_of(const kvf_router_lru *c, uint64_t key)
{
    return (key * 0x9E3779B97F4A7C15ull) >> c->shift;
}

kvf_status kvf_router_lru_create(int64_t capacity, kvf_router_lru **out, kvf_err *err)
{
    if (capacity < 1 || capacity > ((int64_t)1 << 30))
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "router: cache capacity %lld is out of range (1 .. 2^30 blocks)",
                           (long long)capacity);
    kvf_router_lru *c = calloc(1, sizeof *c);
    if (!c)
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory");
    uint64_t m = 16;
    while (m < (uint64_t)capacity * 2)
        m *= 2;
    c->cap = capacity;
    c->key = malloc((size_t)capacity * sizeof *c->key);
    c->prev = malloc((size_t)capacity * sizeof *c->prev);
    c->next = malloc((size_t)capacity * sizeof *c->next);
    c->ref = calloc((size_t)capacity, sizeof *c->ref);
    c->stamp = malloc((size_t)capacity * sizeof *c->stamp);
    c->map = malloc(m * sizeof *c->map);
    if (!c->key || !c->prev || !c->next || !c->ref || !c->stamp || !c->map) {
        kvf_router_lru_destroy(c);
        return kvf_err_set(err, KVF_ERR_NOMEM, "router: out of memory for a cache of %lld blocks",
                           (long long)capacity);
    }
    for (uint64_t i = 0; i < m; i++)
        c->map[i].e = -1;
    c->mask = m - 1;
    c->shift = 64 - __builtin_ctzll(m);
    for (int64_t i = 0; i < capacity; i++)
        c->next[i] = i + 1 < capacity ? (int32_t)(i + 1) : -1;
    c->free_head = 0;
    c->head = c->tail = -1;
    *out = c;
    return KVF_OK;
}

void kvf_router_lru_destroy(kvf_router_lru *c)
{
    if (!c)
        return;
    free(c->key);
    free(c->prev);
    free(c->next);
    free(c->ref);
    free(c->stamp);
    free(c->map);
    free(c);
}

int32_t kvf_router_lru_find(const kvf_router_lru *c, uint64_t key)
{
    for (uint64_t i = home_of(c, key);; i = (i + 1) & c->mask) {
        if (c->map[i].e < 0)
            return -1;
        if (c->map[i].key == key)
            return c->map[i].e;
    }
}

static void map_delete(kvf_router_lru *c, uint64_t key)
{
    uint64_t i = home_of(c, key);
    while (c->map[i].key != key || c->map[i].e < 0)
        i = (i + 1) & c->mask;
    for (uint64_t j = i;;) {
        j = (j + 1) & c->mask;
        if (c->map[j].e < 0)
            break;
        uint64_t h = home_of(c, c->map[j].key);
        int stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (!stays) {
            c->map[i] = c->map[j];
            i = j;
        }
    }
    c->map[i].e = -1;
}

static void list_unlink(kvf_router_lru *c, int32_t e)
{
    if (c->prev[e] >= 0)
        c->next[c->prev[e]] = c->next[e];
    else
        c->head = c->next[e];
    if (c->next[e] >= 0)
        c->prev[c->next[e]] = c->prev[e];
    else
        c->tail = c->prev[e];
}

static void list_append(kvf_router_lru *c, int32_t e)
{
    c->prev[e] = c->tail;
    c->next[e] = -1;
    if (c->tail >= 0)
        c->next[c->tail] = e;
    else
        c->head = e;
    c->tail = e;
}

/* Frees an unpinned entry (it must be in the list). */
static void drop(kvf_router_lru *c, int32_t e)
{
    list_unlink(c, e);
    map_delete(c, c->key[e]);
    c->next[e] = c->free_head;
    c->free_head = e;
    c->size--;
}

int32_t kvf_router_lru_insert(kvf_router_lru *c, uint64_t key, int pin, double now,
                              int *evicted_out, uint64_t *evicted_key_out)
{
    *evicted_out = 0;
    if (c->free_head < 0) {
        if (c->head < 0)
            return -1;
        *evicted_out = 1;
        *evicted_key_out = c->key[c->head];
        drop(c, c->head);
    }
    int32_t e = c->free_head;
    c->free_head = c->next[e];
    c->key[e] = key;
    c->stamp[e] = now;
    c->ref[e] = pin ? 1 : 0;
    if (!pin)
        list_append(c, e);
    uint64_t i = home_of(c, key);
    while (c->map[i].e >= 0)
        i = (i + 1) & c->mask;
    c->map[i].key = key;
    c->map[i].e = e;
    c->size++;
    return e;
}

void kvf_router_lru_pin(kvf_router_lru *c, int32_t e)
{
    if (c->ref[e]++ == 0)
        list_unlink(c, e);
}

void kvf_router_lru_unpin(kvf_router_lru *c, int32_t e, double now)
{
    if (c->ref[e] <= 0)
        return;
    if (--c->ref[e] == 0) {
        c->stamp[e] = now;
        list_append(c, e);
    }
}

void kvf_router_lru_touch(kvf_router_lru *c, int32_t e, double now)
{
    if (c->ref[e] > 0)
        return;
    c->stamp[e] = now;
    list_unlink(c, e);
    list_append(c, e);
}

int kvf_router_lru_pop(kvf_router_lru *c, double before, uint64_t *key_out)
{
    if (c->head < 0 || !(c->stamp[c->head] < before))
        return 0;
    *key_out = c->key[c->head];
    drop(c, c->head);
    return 1;
}

void kvf_router_lru_remove(kvf_router_lru *c, int32_t e)
{
    if (c->ref[e] > 0) {
        c->ref[e] = 0;
        list_append(c, e);
    }
    drop(c, e);
}

int64_t kvf_router_lru_size(const kvf_router_lru *c) { return c->size; }
int64_t kvf_router_lru_capacity(const kvf_router_lru *c) { return c->cap; }
int32_t kvf_router_lru_refs(const kvf_router_lru *c, int32_t e) { return c->ref[e]; }
