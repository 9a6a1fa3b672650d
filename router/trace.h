/* trace.h: Mooncake traces (JSON Lines: timestamp ms, input_length, output_length, hash_ids of
 * 512-token blocks) in the router's terms: each trace block becomes token ids derived from its id,
 * hashed into chained blocks (kv/hash.h), so equal ids give equal prefixes. */
#ifndef KVF_ROUTER_TRACE_H
#define KVF_ROUTER_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct kvf_router_trace_req {
    double t_s;             /* arrival, seconds from the trace start */
    int64_t n_tokens;       /* prompt tokens */
    int32_t n_out;          /* output tokens */
    int32_t n_trace_blocks; /* entries of hash_ids */
    int64_t first;          /* index of its first block hash in kvf_router_trace.hashes */
    int32_t n_blocks;       /* full blocks hashed: n_tokens / block_size */
} kvf_router_trace_req;

typedef struct kvf_router_trace {
    kvf_router_trace_req *reqs; /* [n_reqs], arrival order */
    size_t n_reqs;
    uint64_t *hashes;           /* [n_hashes] every request's block hashes, back to back */
    size_t n_hashes;
    int32_t block_size;         /* tokens per hashed block (16) */
    int32_t trace_block_tokens; /* tokens per trace block (512) */
} kvf_router_trace;

/* Loads at most max_requests (0 = all) from path and hashes them under model's root.
 * trace_block_tokens must be a multiple of block_size. Errors name the line and field. The
 * trace owns its arrays: free them with kvf_router_trace_fini. */
kvf_status kvf_router_trace_load(const char *path, const char *model, int32_t block_size,
                                 int32_t trace_block_tokens, size_t max_requests,
                                 kvf_router_trace *out, kvf_err *err);
/* The same from len bytes in memory (not NUL-terminated; a NUL byte is a parse error in its
 * line); name stands for the path in messages. For tests and the fuzz target. */
kvf_status kvf_router_trace_parse(const char *name, const void *data, size_t len,
                                  const char *model, int32_t block_size,
                                  int32_t trace_block_tokens, size_t max_requests,
                                  kvf_router_trace *out, kvf_err *err);
void kvf_router_trace_fini(kvf_router_trace *t);

/* The token ids of trace block `id`, positions offset .. offset+n-1 (ids in 1 .. 32000). */
void kvf_router_trace_block_tokens(int64_t id, int32_t offset, int32_t n, int32_t *out /* [n] */);

#endif
