/* fuzz_openai.c: the router's OpenAI request parser (the HTTP body of /v1/completions and
 * /v1/chat/completions) on arbitrary bytes: it must accept or refuse with a 4xx error whose
 * JSON renders, never crash, and free everything it allocated. The first byte picks the kind. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/sbuf.h"
#include "router/openai.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    kvf_router_oai_kind kind = (data[0] & 1) ? KVF_ROUTER_OAI_CHAT : KVF_ROUTER_OAI_COMPLETIONS;
    kvf_router_oai_req req;
    kvf_router_oai_error e;
    memset(&req, 0, sizeof req);
    memset(&e, 0, sizeof e);
    kvf_status st = kvf_router_oai_parse(kind, (const char *)data + 1, size - 1, &req, &e);
    if (st != KVF_OK) {
        if (e.http_status < 400 || e.http_status > 499)
            __builtin_trap(); /* bad input is the client's error, always */
        kvf_sbuf out;
        kvf_sbuf_init(&out);
        kvf_router_oai_error_json(&e, &out);
        kvf_sbuf_fini(&out);
    }
    kvf_router_oai_req_fini(&req);
    return 0;
}
