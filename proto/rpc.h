/* rpc.h: the RPC layer the roles use, over gRPC C core, without any grpc type in sight: an async
 * server (one completion queue polled by one thread, handlers run on a small pool) and an async
 * client (unary and server-streaming calls with deadlines and cancel). Messages are bytes; the
 * Worker service's messages and their checks are in proto/worker.h.
 *
 * Which foreign headers leak: none. The Worker messages reach the roles as kvfleet structs
 * (proto/worker.h); nothing outside proto/ includes grpc or protobuf-c headers.
 *
 * Thread-safety: every function here may be called from any thread, except that one object is
 * destroyed once, by one thread, after the calls on it have returned. Handlers and callbacks run
 * on the layer's threads, as each says below.
 * Process-wide: the first server or channel starts gRPC's threads (so fork() before, never
 * after), routes gRPC's log lines through kvf_log and, unless GRPC_DNS_RESOLVER is set, makes
 * gRPC resolve names with getaddrinfo.
 * Limits: messages are capped at max_msg_bytes (4 MiB unless set) in both directions, on both
 * sides; a larger message fails with KVF_ERR_LIMIT. KV bytes never travel here. */
#ifndef KVF_PROTO_RPC_H
#define KVF_PROTO_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define KVF_RPC_PROTOCOL_VERSION 1u            /* InfoResponse.protocol_version */
#define KVF_RPC_DEFAULT_MAX_MSG (4 * 1024 * 1024) /* bytes per message, each direction */
#define KVF_RPC_NO_DEADLINE INT64_MAX
#define KVF_RPC_DEFAULT_KEEPALIVE_MS 10000 /* ping an idle connection this often */

typedef struct kvf_rpc_server kvf_rpc_server;
typedef struct kvf_rpc_call kvf_rpc_call;       /* one call as the server sees it */
typedef struct kvf_rpc_channel kvf_rpc_channel; /* a client connection to one target */
typedef struct kvf_rpc_stream kvf_rpc_stream;   /* a client's server-streaming call */

/* A message: data is malloc()ed and owned by whoever holds the struct (kvf_rpc_buf_free). */
typedef struct kvf_rpc_buf {
    uint8_t *data; /* may be NULL when len is 0 */
    size_t len;
} kvf_rpc_buf;

void kvf_rpc_buf_free(kvf_rpc_buf *b); /* frees data, zeroes the struct */

/* Optional TLS with gRPC's SSL credentials. The strings are file names of PEM files; NULL or ""
 * means unset.
 *   server: cert_file + key_file serve TLS; with ca_file too, every client must present a
 *           certificate signed by that CA (mutual TLS: the fleet's worker plane);
 *   client: ca_file checks the server's certificate; with cert_file + key_file it presents its
 *           own. server_name: the name the server's certificate must carry instead of the
 *           target's host (a fleet's certificates carry the fleet's name, so peers reached by
 *           IP or any DNS name check one name).
 * Files are read when a server or channel is made and again after kvf_rpc_tls_reload: a server
 * hands the new certificate to every later handshake, a channel makes later calls on a
 * connection with the new files; a file that fails to read keeps the old ones (logged). */
typedef struct kvf_rpc_tls {
    const char *cert_file;   /* this side's certificate chain */
    const char *key_file;    /* its private key */
    const char *ca_file;     /* the CA peers' certificates must be signed by */
    const char *server_name; /* client: name to check instead of the target's host */
} kvf_rpc_tls;

/* True when tls names any file (the caller asked for TLS). */
bool kvf_rpc_tls_on(const kvf_rpc_tls *tls);
/* For a fleet member (every role): cert_file, key_file and ca_file go together, and each reads
 * as PEM. Errors start with who and name the flag. OK when none is set (plaintext). */
kvf_status kvf_rpc_tls_check_member(const kvf_rpc_tls *tls, const char *who, kvf_err *err);
/* Asks every server and channel of the process to read its TLS files again (SIGHUP). Safe in
 * a signal handler (one atomic increment). */
void kvf_rpc_tls_reload(void);

/* The one place kvf_status and gRPC status codes (the wire numbers, 0..16) meet. The server
 * also sends the exact kvf_status in trailing metadata, so a client gets back the code the
 * handler returned; from_grpc is the fallback for peers that do not. */
int kvf_status_to_grpc(kvf_status st);
kvf_status kvf_status_from_grpc(int grpc_code);
const char *kvf_rpc_grpc_code_name(int grpc_code); /* "DEADLINE_EXCEEDED"; never NULL */

/* ---------------------------------------------------------------------------------------- */
/* Server                                                                                    */

typedef struct kvf_rpc_server_opts {
    const char *address;     /* "127.0.0.1:0" picks a free port (kvf_rpc_server_port) */
    int n_threads;           /* handler threads; 0 means 2 */
    int64_t max_msg_bytes;   /* 0 means KVF_RPC_DEFAULT_MAX_MSG */
    const kvf_rpc_tls *tls;  /* NULL or no cert: plaintext */
    int64_t keepalive_ms;    /* ping clients this often (a router gone silent ends its streams);
                                0 means KVF_RPC_DEFAULT_KEEPALIVE_MS, negative: off */
} kvf_rpc_server_opts;

/* A unary handler: runs on a pool thread with the request bytes; returns KVF_OK and a malloc()ed
 * response in *resp_out (the layer frees it), or a status and a message in err (sent to the
 * client as the gRPC status, and logged at debug). It may look at the call
 * (kvf_rpc_call_is_cancelled, kvf_rpc_call_remaining_ms) but must not finish it. */
typedef kvf_status (*kvf_rpc_unary_fn)(void *ctx, kvf_rpc_call *call, const uint8_t *req,
                                       size_t req_len, kvf_rpc_buf *resp_out, kvf_err *err);

/* A server-streaming handler: runs on a pool thread with the request bytes (valid until it
 * returns). It owns the call: it writes messages with kvf_rpc_call_send/_write from any thread,
 * and ends the call with kvf_rpc_call_finish exactly once, before or after returning. A handler
 * that loops for the life of a long stream (WatchKv) holds a pool thread all that time: such
 * streams should hand the call to the role's own thread and return, or n_threads must count
 * them, or other calls wait in the queue. */
typedef void (*kvf_rpc_stream_fn)(void *ctx, kvf_rpc_call *call, const uint8_t *req,
                                  size_t req_len);

kvf_status kvf_rpc_server_create(const kvf_rpc_server_opts *opts, kvf_rpc_server **out,
                                 kvf_err *err);
/* The bound port (the real one when the address asked for port 0). */
int kvf_rpc_server_port(const kvf_rpc_server *s);
/* Register a handler by full method name ("/kvfleet.v1.Worker/Info") before start. A call to a
 * name with no handler ends with KVF_ERR_UNSUPPORTED (gRPC UNIMPLEMENTED). */
kvf_status kvf_rpc_server_add_unary(kvf_rpc_server *s, const char *method, kvf_rpc_unary_fn fn,
                                    void *ctx, kvf_err *err);
kvf_status kvf_rpc_server_add_stream(kvf_rpc_server *s, const char *method,
                                     kvf_rpc_stream_fn fn, void *ctx, kvf_err *err);
kvf_status kvf_rpc_server_start(kvf_rpc_server *s, kvf_err *err);
/* Calls of `method` (a registered name) accepted and not yet finished. Any thread. */
int kvf_rpc_server_live(kvf_rpc_server *s, const char *method);
/* Stops taking calls, lets calls in flight run for up to grace_ms, then cancels the rest (their
 * clients see CANCELLED or UNAVAILABLE; their handlers see kvf_rpc_call_is_cancelled and writes
 * failing) and waits for every handler to finish its call. Idempotent. Handlers that never
 * finish their call make this wait forever: that is a bug in the handler. Not from a handler
 * (it would wait for its own call). */
void kvf_rpc_server_shutdown(kvf_rpc_server *s, int64_t grace_ms);
/* Shuts down (grace 0) if needed and frees everything. NULL is fine. */
void kvf_rpc_server_destroy(kvf_rpc_server *s);

/* Call accessors: valid until the call is finished. */
const char *kvf_rpc_call_method(const kvf_rpc_call *c);
/* The client's address as gRPC names it ("ipv4:10.0.0.3:51234"), for logs; never NULL. */
const char *kvf_rpc_call_peer(const kvf_rpc_call *c);
/* Milliseconds left before the client's deadline (negative once past); KVF_RPC_NO_DEADLINE if
 * the client set none. */
int64_t kvf_rpc_call_remaining_ms(const kvf_rpc_call *c);
/* True once the client cancelled, the deadline passed, the connection broke or the server is
 * shutting down the call. */
bool kvf_rpc_call_is_cancelled(const kvf_rpc_call *c);
/* fn(arg) runs once when the call is cancelled (at once, on this thread, if it already is), on
 * the completion-queue thread otherwise: it must be short and must not block, write or finish
 * the call (signal the thread that owns the call instead). It never runs after
 * kvf_rpc_call_finish has returned. Replaces an earlier callback. */
void kvf_rpc_call_on_cancel(kvf_rpc_call *c, void (*fn)(void *arg), void *arg);
/* Messages a streaming call holds for a client that reads slower than the handler sends. */
#define KVF_RPC_SEND_QUEUE_MAX 1024

/* Queues one message on a streaming call and returns at once (for loops that must not wait on
 * one slow client, like the decode step loop); messages go out in the order queued, from any
 * number of threads. Fails with KVF_ERR_CANCELLED once the call is cancelled, KVF_ERR_FULL when
 * KVF_RPC_SEND_QUEUE_MAX messages already wait (the client is not reading: cancel or slow
 * down), KVF_ERR_LIMIT above max_msg_bytes, KVF_ERR_STATE after finish or on a unary call. */
kvf_status kvf_rpc_call_send(kvf_rpc_call *c, const void *msg, size_t len, kvf_err *err);
/* The same, then waits until gRPC has taken this message (flow control holds it while the
 * client is slow): the simple choice for a handler thread that produces messages itself. */
kvf_status kvf_rpc_call_write(kvf_rpc_call *c, const void *msg, size_t len, kvf_err *err);
/* Ends a streaming call with a status (and message, may be NULL) and releases it; the call
 * pointer is invalid afterwards. Does not wait: the status follows the queued messages. */
void kvf_rpc_call_finish(kvf_rpc_call *c, kvf_status st, const char *msg);
/* Ends a call without an answer from the handler, for when the handler cannot vouch for what it
 * started (a write it could not stop): queued messages are dropped and gRPC cancels the call, so
 * the client sees UNAVAILABLE with by_server false, as for a lost connection. Releases the call
 * like kvf_rpc_call_finish; use one of the two, once. */
void kvf_rpc_call_abandon(kvf_rpc_call *c, const char *msg);

/* ---------------------------------------------------------------------------------------- */
/* Client                                                                                    */

typedef struct kvf_rpc_channel_opts {
    const kvf_rpc_tls *tls; /* NULL or no ca_file: plaintext */
    int64_t max_msg_bytes;  /* 0 means KVF_RPC_DEFAULT_MAX_MSG */
    int64_t keepalive_ms;   /* ping the server this often, so a vanished peer fails the calls
                               (KVF_ERR_PEER_LOST) instead of hanging them; 0 means
                               KVF_RPC_DEFAULT_KEEPALIVE_MS, negative: off */
} kvf_rpc_channel_opts;

/* A channel to "host:port" (opts may be NULL). It connects lazily: a dead target shows up as
 * KVF_ERR_PEER_LOST on the first call (gRPC UNAVAILABLE), not here; a target that comes back
 * is reconnected to within about 2 s. */
kvf_status kvf_rpc_channel_create(const char *target, const kvf_rpc_channel_opts *opts,
                                  kvf_rpc_channel **out, kvf_err *err);
/* Cancels the calls still running on the channel (their callbacks and reads see
 * KVF_ERR_CANCELLED), waits until every unary callback has run, and frees it. Streams that are
 * still open must be destroyed before the channel. */
void kvf_rpc_channel_destroy(kvf_rpc_channel *ch);

/* A blocking unary call; timeout_ms bounds the whole call (KVF_RPC_NO_DEADLINE for none).
 * On KVF_OK *resp_out holds the response (caller frees). A failure fills err with the method,
 * the gRPC code and the server's message, and returns the server's kvf_status (KVF_ERR_TIMEOUT
 * for a passed deadline, KVF_ERR_PEER_LOST for an unreachable server). */
kvf_status kvf_rpc_unary(kvf_rpc_channel *ch, const char *method, const void *req, size_t len,
                         int64_t timeout_ms, kvf_rpc_buf *resp_out, kvf_err *err);

/* The same call, asynchronous: done runs once, on the channel's completion-queue thread (keep it
 * short; it must not destroy the channel), with the status, the response (owned by the layer:
 * copy what you keep), the error message (NULL on success) and by_server: true when the
 * server's handler (or this layer on the server) ended the call, false when gRPC did (a passed
 * deadline, a lost connection, a cancel, a server shutting down), so the handler may still be
 * running. Returns an error, and never calls done, if the call cannot start. */
typedef void (*kvf_rpc_unary_done_fn)(void *arg, kvf_status st, const uint8_t *resp,
                                      size_t resp_len, const char *msg, bool by_server);
kvf_status kvf_rpc_unary_async(kvf_rpc_channel *ch, const char *method, const void *req,
                               size_t len, int64_t timeout_ms, kvf_rpc_unary_done_fn done,
                               void *arg, kvf_err *err);

/* Opens a server-streaming call: sends the request and returns at once; messages are read
 * ahead (a few dozen at most) as they arrive. A unary method may be called this way too (one
 * message, then the end) when the caller needs to cancel it. */
kvf_status kvf_rpc_stream_open(kvf_rpc_channel *ch, const char *method, const void *req,
                               size_t len, int64_t timeout_ms, kvf_rpc_stream **out,
                               kvf_err *err);
/* Waits up to timeout_ms (0: poll; KVF_RPC_NO_DEADLINE: forever) for the next message.
 * *done_out says whether the call is over (the status returned is then its final status):
 *  - KVF_OK, done false: *msg_out holds a message (caller frees);
 *  - KVF_OK, done true: the server finished with OK and every message has been read;
 *  - KVF_ERR_TIMEOUT, done false: nothing within timeout_ms; the stream is still usable;
 *  - any other status, done true: the call ended so (server error, deadline, cancel), after
 *    every message received before the end has been read.
 * One reader at a time. */
kvf_status kvf_rpc_stream_read(kvf_rpc_stream *s, int64_t timeout_ms, kvf_rpc_buf *msg_out,
                               bool *done_out, kvf_err *err);
/* Wakes a reader instead of making it poll. fn(arg) runs each time the stream may have
 * something new for kvf_rpc_stream_read (a message arrived, or the call ended), on the
 * channel's completion-queue thread with the stream's lock held: it must be short and must not
 * call any kvf_rpc_stream_* function (wake the reader's own thread instead, e.g. with libevent's
 * event_active). It may run when nothing new is readable (a read with timeout 0 then answers
 * KVF_ERR_TIMEOUT), and several arrivals may share one call. When something is readable
 * already, fn runs once at once, on the calling thread. Once this returns with fn NULL, or
 * kvf_rpc_stream_destroy returns, the old fn never runs again. */
void kvf_rpc_stream_notify(kvf_rpc_stream *s, void (*fn)(void *arg), void *arg);
/* Cancels the call (the server handler sees it); later reads return KVF_ERR_CANCELLED once
 * the messages already received are read. Any thread, any number of times. */
void kvf_rpc_stream_cancel(kvf_rpc_stream *s);
/* Cancels the call if it is still running and releases the stream. NULL is fine. */
void kvf_rpc_stream_destroy(kvf_rpc_stream *s);

#endif
