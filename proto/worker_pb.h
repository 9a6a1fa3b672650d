/* worker_pb.h: TRANSITIONAL. The Worker messages as protobuf-c structs, for the router files that
 * have not moved to proto/worker.h's kvfleet structs yet. Goes away once they have. */
#ifndef KVF_PROTO_WORKER_PB_H
#define KVF_PROTO_WORKER_PB_H

#include "proto/kvfleet.pb-c.h"
#include "proto/rpc.h"

kvf_status kvf_rpc_msg_encode(const void *msg, kvf_rpc_buf *out, kvf_err *err);
void kvf_rpc_msg_free(void *msg);
kvf_status kvf_rpc_info_response_decode(const uint8_t *data, size_t len,
                                        Kvfleet__V1__InfoResponse **out, kvf_err *err);
kvf_status kvf_rpc_generate_response_decode(const uint8_t *data, size_t len,
                                            Kvfleet__V1__GenerateResponse **out, kvf_err *err);
kvf_status kvf_rpc_watch_kv_response_decode(const uint8_t *data, size_t len,
                                            Kvfleet__V1__WatchKvResponse **out, kvf_err *err);
kvf_status kvf_rpc_health_response_decode(const uint8_t *data, size_t len,
                                          Kvfleet__V1__HealthResponse **out, kvf_err *err);

#endif
