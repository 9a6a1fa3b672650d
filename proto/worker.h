/* worker.h: the Worker service of kvfleet.proto for the roles: its method names, encoding and
 * checked decoding of its messages, and the dtype mapping. Deliberately exposes the generated
 * protobuf-c structs (proto/kvfleet.pb-c.h, generated in the build tree, which includes
 * <protobuf-c/protobuf-c.h>): roles fill and read Kvfleet__V1__* messages directly.
 * Decoders own nothing of the input; a decoded message is freed with kvf_rpc_msg_free. */
#ifndef KVF_PROTO_WORKER_H
#define KVF_PROTO_WORKER_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "proto/kvfleet.pb-c.h"
#include "proto/rpc.h"

#define KVF_RPC_WORKER_INFO "/kvfleet.v1.Worker/Info"
#define KVF_RPC_WORKER_GENERATE "/kvfleet.v1.Worker/Generate"           /* server stream */
#define KVF_RPC_WORKER_REMOTE_PREFILL "/kvfleet.v1.Worker/RemotePrefill"
#define KVF_RPC_WORKER_WATCH_KV "/kvfleet.v1.Worker/WatchKv"            /* server stream */
#define KVF_RPC_WORKER_CANCEL "/kvfleet.v1.Worker/Cancel"
#define KVF_RPC_WORKER_HEALTH "/kvfleet.v1.Worker/Health"

/* Limits the decoders enforce (a message over 4 MiB is refused earlier, by gRPC). */
#define KVF_RPC_MAX_ID_LEN 256         /* request ids, router ids, cache salts */
#define KVF_RPC_MAX_STOP_TOKENS 64
#define KVF_RPC_MAX_N 64               /* sequences per prompt */

/* Packs any generated message into a malloc()ed buffer (out is the caller's). */
kvf_status kvf_rpc_msg_encode(const void *msg /* a Kvfleet__V1__* message */, kvf_rpc_buf *out,
                              kvf_err *err);
/* Frees a message a decoder returned; NULL is fine. */
void kvf_rpc_msg_free(void *msg);

/* Request decoders, run by the worker on what a client sent: unpack, then check every field a
 * worker would otherwise trust (ids printable and bounded, token and block ids non-negative,
 * counts consistent, sampling in range). KVF_ERR_PARSE for bytes that are not the message,
 * KVF_ERR_INVALID naming the field, its value and what is allowed. */
kvf_status kvf_rpc_info_request_decode(const uint8_t *data, size_t len,
                                       Kvfleet__V1__InfoRequest **out, kvf_err *err);
kvf_status kvf_rpc_generate_request_decode(const uint8_t *data, size_t len,
                                           Kvfleet__V1__GenerateRequest **out, kvf_err *err);
kvf_status kvf_rpc_remote_prefill_request_decode(const uint8_t *data, size_t len,
                                                 Kvfleet__V1__RemotePrefillRequest **out,
                                                 kvf_err *err);
kvf_status kvf_rpc_watch_kv_request_decode(const uint8_t *data, size_t len,
                                           Kvfleet__V1__WatchKvRequest **out, kvf_err *err);
kvf_status kvf_rpc_cancel_request_decode(const uint8_t *data, size_t len,
                                         Kvfleet__V1__CancelRequest **out, kvf_err *err);
kvf_status kvf_rpc_health_request_decode(const uint8_t *data, size_t len,
                                         Kvfleet__V1__HealthRequest **out, kvf_err *err);

/* Response decoders, run by routers and decode workers on what a worker answered. Info is
 * refused (KVF_ERR_UNSUPPORTED) when its protocol_version is not KVF_RPC_PROTOCOL_VERSION, and
 * (KVF_ERR_INVALID) when its block size or layout is not positive. */
kvf_status kvf_rpc_info_response_decode(const uint8_t *data, size_t len,
                                        Kvfleet__V1__InfoResponse **out, kvf_err *err);
kvf_status kvf_rpc_generate_response_decode(const uint8_t *data, size_t len,
                                            Kvfleet__V1__GenerateResponse **out, kvf_err *err);
kvf_status kvf_rpc_remote_prefill_response_decode(const uint8_t *data, size_t len,
                                                  Kvfleet__V1__RemotePrefillResponse **out,
                                                  kvf_err *err);
kvf_status kvf_rpc_watch_kv_response_decode(const uint8_t *data, size_t len,
                                            Kvfleet__V1__WatchKvResponse **out, kvf_err *err);
kvf_status kvf_rpc_cancel_response_decode(const uint8_t *data, size_t len,
                                          Kvfleet__V1__CancelResponse **out, kvf_err *err);
kvf_status kvf_rpc_health_response_decode(const uint8_t *data, size_t len,
                                          Kvfleet__V1__HealthResponse **out, kvf_err *err);

/* kvf_dtype <-> the proto's DType (which keeps 0 for "not set"). */
Kvfleet__V1__DType kvf_rpc_dtype_to_msg(kvf_dtype t);
kvf_status kvf_rpc_dtype_from_msg(Kvfleet__V1__DType d, kvf_dtype *out, kvf_err *err);

#endif
