/* fuzz_proto.c: random bytes into every checked decoder of the Worker service's messages
 * (proto/worker.h). A decoder must refuse or accept without crashing or leaking; whatever it
 * accepts must encode and decode again, and pass its checks again. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/worker.h"

typedef kvf_status (*decode_fn)(const uint8_t *data, size_t len, void **out, kvf_err *err);

#define DECODER(f) ((decode_fn)(void (*)(void))(f))

static const decode_fn decoders[] = {
    DECODER(kvf_rpc_info_request_decode),
    DECODER(kvf_rpc_generate_request_decode),
    DECODER(kvf_rpc_remote_prefill_request_decode),
    DECODER(kvf_rpc_watch_kv_request_decode),
    DECODER(kvf_rpc_cancel_request_decode),
    DECODER(kvf_rpc_health_request_decode),
    DECODER(kvf_rpc_info_response_decode),
    DECODER(kvf_rpc_generate_response_decode),
    DECODER(kvf_rpc_remote_prefill_response_decode),
    DECODER(kvf_rpc_watch_kv_response_decode),
    DECODER(kvf_rpc_cancel_response_decode),
    DECODER(kvf_rpc_health_response_decode),
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (size_t i = 0; i < sizeof decoders / sizeof decoders[0]; i++) {
        void *msg = NULL;
        kvf_err err;
        kvf_status st = decoders[i](data, size, &msg, &err);
        if (st != KVF_OK) {
            if (msg || !err.msg[0])
                abort(); /* a refusal hands nothing out and always says why */
            continue;
        }
        kvf_rpc_buf b = {0};
        if (kvf_rpc_msg_encode(msg, &b, &err) != KVF_OK)
            abort();
        void *again = NULL;
        if (decoders[i](b.data, b.len, &again, &err) != KVF_OK)
            abort();
        kvf_rpc_buf b2 = {0};
        if (kvf_rpc_msg_encode(again, &b2, &err) != KVF_OK || b2.len != b.len ||
            memcmp(b.data, b2.data, b.len) != 0)
            abort();
        kvf_rpc_buf_free(&b);
        kvf_rpc_buf_free(&b2);
        kvf_rpc_msg_free(again);
        kvf_rpc_msg_free(msg);
    }
    return 0;
}
