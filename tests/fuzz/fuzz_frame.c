/* fuzz_frame.c: the router's wire framing (router/frame.h) on arbitrary bytes. The first byte
 * picks the limits and how the rest is split; the rest is a stream of requests. Properties:
 * no crash; a head found is within the limit and ends in an empty line, and framing its own
 * bytes again gives the same answer; a chunked body fed in pieces is framed exactly as fed
 * whole, and never passes more chunk data than the limit. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "router/frame.h"

static kvf_router_chunks_result feed_split(const char *p, size_t len, size_t piece, int64_t max_body,
                                           size_t *used, int64_t *total)
{
    kvf_router_chunks c;
    memset(&c, 0, sizeof c);
    size_t off = 0;
    kvf_router_chunks_result r = KVF_CHUNKS_MORE;
    while (off < len && r == KVF_CHUNKS_MORE) {
        size_t n = len - off < piece ? len - off : piece, u = 0;
        r = kvf_router_chunks_feed(&c, p + off, n, max_body, 256, &u);
        if (u > n || (r == KVF_CHUNKS_MORE && u != n))
            abort();
        off += u;
    }
    if (c.total > max_body)
        abort();
    *used = off;
    *total = c.total;
    return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int64_t max_head = 16 + (data[0] & 0x3f) * 8;
    int64_t max_body = (data[0] >> 6) * 40;
    size_t piece = 1 + (data[0] & 7);
    const char *p = (const char *)data + 1;
    size_t len = size - 1;
    for (int guard = 0; len && guard < 64; guard++) {
        kvf_router_frame f;
        kvf_router_frame_head(p, len, max_head, max_body, &f);
        if (f.kind == KVF_FRAME_BAD && !f.why)
            abort();
        if (f.kind != KVF_FRAME_OK && f.kind != KVF_FRAME_BODY_LARGE)
            return 0;
        size_t h = f.head_len;
        if (h < 2 || h > len || h > (size_t)max_head || p[h - 1] != '\n' ||
            !(p[h - 2] == '\n' || (h >= 3 && p[h - 2] == '\r' && p[h - 3] == '\n')))
            abort();
        kvf_router_frame g;
        kvf_router_frame_head(p, h, max_head, max_body, &g);
        if (g.kind != f.kind || g.head_len != h || g.body_len != f.body_len || g.chunked != f.chunked ||
            g.probe != f.probe)
            abort();
        if (f.kind == KVF_FRAME_BODY_LARGE) {
            if (f.body_len <= max_body)
                abort();
            return 0;
        }
        if (f.body_len < 0 || f.body_len > max_body || (f.chunked && f.body_len))
            abort();
        p += h;
        len -= h;
        if (f.chunked) {
            size_t u1, u2;
            int64_t t1, t2;
            kvf_router_chunks_result r1 = feed_split(p, len, len ? len : 1, max_body, &u1, &t1);
            kvf_router_chunks_result r2 = feed_split(p, len, piece, max_body, &u2, &t2);
            if (r1 != r2 || u1 != u2 || t1 != t2)
                abort();
            if (r1 != KVF_CHUNKS_DONE)
                return 0;
            p += u1;
            len -= u1;
        } else {
            size_t b = (size_t)f.body_len < len ? (size_t)f.body_len : len;
            p += b;
            len -= b;
        }
    }
    return 0;
}
