/* fuzz_toolcall.c: the router's tool-call parser (router/toolcall.h) on arbitrary model output.
 * The first byte picks the format; the rest is the text. Properties: no crash; content is null
 * only with calls, and otherwise a prefix of the text (the whole text without calls); every call
 * has a name and arguments that are a JSON object; the streaming hold-back point never moves
 * back as the text grows, and what it let through is a prefix of the final content. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "router/toolcall.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    kvf_router_toolcall_format f = data[0] % 3 == 0 ? KVF_ROUTER_TOOLCALL_HERMES
                                   : data[0] % 3 == 1 ? KVF_ROUTER_TOOLCALL_LLAMA3_JSON
                                                      : KVF_ROUTER_TOOLCALL_NONE;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    kvf_router_toolcall_result r;
    if (kvf_router_toolcall_parse(f, text, len, &r) != KVF_OK)
        return 0; /* out of memory only */
    if (!r.content && !r.n_calls)
        abort();
    if (r.content && (r.content_len > len || memcmp(r.content, text, r.content_len) != 0 ||
                      r.content[r.content_len] != 0))
        abort();
    if (!r.n_calls && r.content_len != len)
        abort();
    for (size_t k = 0; k < r.n_calls; k++) {
        json_t *a = json_loads(r.calls[k].arguments, 0, NULL);
        if (!r.calls[k].name[0] || !json_is_object(a))
            abort();
        json_decref(a);
    }
    size_t emitted = 0;
    for (size_t p = 0; p <= len; p += 1 + p / 64) {
        size_t safe = kvf_router_toolcall_safe_len(f, text, p, 0);
        if (safe > p || safe < emitted || kvf_router_toolcall_safe_len(f, text, p, emitted) != safe ||
            kvf_router_toolcall_safe_len(f, text, p, emitted / 2) != safe)
            abort();
        emitted = safe;
    }
    size_t safe = kvf_router_toolcall_safe_len(f, text, len, 0);
    if (safe < emitted || (!r.content && safe) || (r.content && safe > r.content_len))
        abort();
    kvf_router_toolcall_result_fini(&r);
    return 0;
}
