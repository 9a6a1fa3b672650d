/* rpc_internal.h: what the server and client halves of proto/ share: completion-queue tags,
 * byte-buffer and deadline conversions, channel arguments, TLS credentials. Private to proto/
 * (it includes grpc); nothing outside this folder may include it. */
#ifndef KVF_PROTO_RPC_INTERNAL_H
#define KVF_PROTO_RPC_INTERNAL_H

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "proto/rpc.h"

/* Every event on a completion queue carries one of these (embedded in the object it belongs
 * to); the polling thread calls fn with the event's success bit. */
typedef struct rpc_tag {
    void (*fn)(struct rpc_tag *tag, bool ok);
} rpc_tag;

#define RPC_CONTAINER_OF(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

/* grpc_init, with gRPC's own log lines sent through kvf_log ("rpc: grpc: ..."), once per
 * process. Pair with grpc_shutdown. */
void kvf_rpc_grpc_init(void);

/* Polls cq until it is shut down, dispatching each event to its tag. */
void kvf_rpc_cq_poll(grpc_completion_queue *cq);

/* Copies a (possibly multi-slice) received message into out. */
kvf_status kvf_rpc_bb_read(grpc_byte_buffer *bb, kvf_rpc_buf *out, kvf_err *err);
/* A byte buffer holding a copy of data; NULL when out of memory. */
grpc_byte_buffer *kvf_rpc_bb_from(const void *data, size_t len);

/* timeout_ms from now as a gRPC deadline (KVF_RPC_NO_DEADLINE: infinite). */
gpr_timespec kvf_rpc_deadline_from_ms(int64_t timeout_ms);
/* Milliseconds left before a deadline (KVF_RPC_NO_DEADLINE for an infinite one). */
int64_t kvf_rpc_deadline_remaining_ms(gpr_timespec deadline);

/* Channel arguments: both message-size limits; keepalive pings every keepalive_ms (0 or less:
 * none) so that a peer that vanished without closing is noticed; a client reconnects within
 * 2 s of a worker coming back (gRPC's default backoff grows to 2 minutes); a server accepts
 * pings as often as they come and turns off SO_REUSEPORT, so a port in use is an error rather
 * than a shared port. Self-referring: initialise in place, do not copy. */
typedef struct rpc_args {
    grpc_arg arg[12];
    grpc_channel_args args;
} rpc_args;
void kvf_rpc_args_init(rpc_args *a, int64_t max_bytes, bool server, int64_t keepalive_ms,
                   const char *ssl_target_override);

/* Normalises a keepalive option: 0 -> KVF_RPC_DEFAULT_KEEPALIVE_MS, negative -> off (0). */
int64_t kvf_rpc_keepalive_ms(int64_t v);

/* How many times kvf_rpc_tls_reload ran. */
uint64_t kvf_rpc_tls_generation(void);

/* Reads a whole PEM file into a NUL-terminated malloc()ed string. what names the flag. */
kvf_status kvf_rpc_pem_read(const char *path, const char *what, char **out, kvf_err *err);

/* Registers a unary (u) or streaming (f, when not NULL) handler whose ctx the server owns:
 * ctx_free(ctx) runs when the server is destroyed, or at once when the registration fails. For
 * proto/worker.c's typed handlers, whose adapters live as long as the server. */
kvf_status kvf_rpc_server_add_owned(kvf_rpc_server *s, const char *method, kvf_rpc_unary_fn u,
                                    kvf_rpc_stream_fn f, void *ctx, void (*ctx_free)(void *),
                                    kvf_err *err);

/* The key of the trailing metadata that carries the exact kvf_status. */
#define RPC_KVF_STATUS_KEY "kvf-status"

/* Normalises a max-message option: 0 -> default; checks the range. */
kvf_status kvf_rpc_max_msg_check(int64_t v, const char *who, int64_t *out, kvf_err *err);

#endif
