/* fuzz_trace.c: the Mooncake trace reader (router/trace.h, behind `kvfleet sim`) on arbitrary
 * bytes as a JSON Lines file: it must load or fail with a message, never crash, and a loaded
 * trace must hold together (arrivals in order, block counts and hash ranges inside the arrays). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "router/trace.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvf_router_trace t = {0};
    kvf_err err = {0};
    if (kvf_router_trace_parse("fuzz.jsonl", data, size, "fuzz-model", 16, 512, 0, &t, &err) != KVF_OK) {
        if (t.reqs || t.hashes || !err.msg[0])
            abort(); /* a failure leaves nothing behind and says why */
        return 0;
    }
    if (t.n_reqs == 0 || t.block_size != 16 || t.trace_block_tokens != 512)
        abort();
    size_t sum = 0;
    for (size_t i = 0; i < t.n_reqs; i++) {
        const kvf_router_trace_req *r = &t.reqs[i];
        if (r->n_tokens < 1 || r->n_out < 0 || r->n_blocks != r->n_tokens / 16 ||
            r->n_trace_blocks != (r->n_tokens + 511) / 512 || r->first != (int64_t)sum ||
            (i && r->t_s < t.reqs[i - 1].t_s))
            abort();
        sum += (size_t)r->n_blocks;
    }
    if (sum != t.n_hashes)
        abort();
    volatile uint64_t sink = 0;
    for (size_t i = 0; i < t.n_hashes; i++)
        sink ^= t.hashes[i]; /* every hash was written (MSan/valgrind) and lies in the array (ASan) */
    (void)sink;
    kvf_router_trace_fini(&t);
    return 0;
}
