/* http_int.h: what the router's HTTP layer (http.c) lends the files that serve it, inside
 * router/ only: the one loop's wake-up for streams read on it. libevent stays in http.c; the
 * streams themselves are watch.c's and request.c's. */
#ifndef KVF_ROUTER_HTTP_INT_H
#define KVF_ROUTER_HTTP_INT_H

#include <stdatomic.h>
#include <stdbool.h>

#include "router/http.h"

/* One stream's wake-up: set on a completion-queue thread when the stream has something to read,
 * taken on the loop thread, which then reads the stream until it says "nothing now". */
typedef struct kvf_router_wake {
    kvf_router_http *h; /* whose loop to wake */
    atomic_bool ready;
} kvf_router_wake;

/* Marks the stream of `wake` (a kvf_router_wake) ready and wakes the loop. Any thread (it is
 * the callback given to kvf_rpc_stream_notify, called with the stream's lock held); it touches
 * nothing else of the router. The loop thread calls it too: a client left, a drain stopped. */
void kvf_router_wake_notify(void *wake);
/* Loop thread: whether the stream was marked ready since the last take; clears the mark. */
bool kvf_router_wake_take(kvf_router_wake *w);

#endif
