/* frame.h: HTTP/1.x request framing on the wire, for the router's connection filter (conn.c):
 * where a request head ends, whether it is well formed, how long its body is, and a chunked
 * body's chunks counted as they pass. Pure functions over bytes (no I/O), fuzzed by
 * tests/fuzz/fuzz_frame.c. evhttp parses the request itself afterwards; these checks run first
 * so that the limits hold before anything is buffered and every refusal is OpenAI JSON. */
#ifndef KVF_ROUTER_FRAME_H
#define KVF_ROUTER_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    KVF_FRAME_MORE,       /* the head is not complete yet (and within the limit) */
    KVF_FRAME_OK,         /* a head of head_len bytes; then body_len bytes, or a chunked body */
    KVF_FRAME_BAD,        /* 400: not an HTTP/1.x request head (why: in .why) */
    KVF_FRAME_HEAD_LARGE, /* 431: the head is longer than max_head */
    KVF_FRAME_BODY_LARGE, /* 413: Content-Length above max_body (in body_len) */
} kvf_router_frame_kind;

typedef struct kvf_router_frame {
    kvf_router_frame_kind kind;
    size_t head_len;  /* KVF_FRAME_OK: through the empty line */
    int64_t body_len; /* KVF_FRAME_OK (not chunked), KVF_FRAME_BODY_LARGE */
    bool chunked;     /* Transfer-Encoding: chunked (it wins over Content-Length) */
    bool probe;       /* GET or HEAD of /health, /ready or /metrics */
    const char *why;  /* KVF_FRAME_BAD: a static phrase naming what was wrong */
} kvf_router_frame;

/* The first len bytes of a request (its head at p). */
void kvf_router_frame_head(const char *p, size_t len, int64_t max_head, int64_t max_body, kvf_router_frame *out);

/* A chunked body as it passes: feed the bytes that follow the head, in any pieces. */
typedef struct kvf_router_chunks {
    int st;         /* internal */
    int64_t left;   /* bytes of the current chunk (or its line) still to come */
    int64_t total;  /* chunk data so far */
    int64_t line;   /* bytes of the current size or trailer line */
    int64_t trailer;/* bytes of the trailer so far */
    bool digits;    /* the size line has a digit */
} kvf_router_chunks;

typedef enum {
    KVF_CHUNKS_MORE,  /* all len bytes belong to the body; more to come */
    KVF_CHUNKS_DONE,  /* the body ended after *used bytes (the next request may follow) */
    KVF_CHUNKS_BAD,   /* 400: not chunked framing */
    KVF_CHUNKS_LARGE, /* 413: more than max_body bytes of chunk data */
} kvf_router_chunks_result;

kvf_router_chunks_result kvf_router_chunks_feed(kvf_router_chunks *c, const char *p, size_t len, int64_t max_body,
                                                int64_t max_trailer, size_t *used);

#endif
