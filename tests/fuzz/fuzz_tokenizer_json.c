/* fuzz_tokenizer_json.c: tokenizer.json loading. The input is a tokenizer.json, optionally
 * followed by a NUL byte and a tokenizer_config.json. A malformed file must give an error with
 * a message, never a crash; a file that loads must encode and decode a fixed text. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "text/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvf_log_set_level(KVF_LOG_OFF); /* warnings about fuzzed companions are expected */
    const char *s = (const char *)data;
    const char *nul = memchr(s, 0, size);
    size_t tok_len = nul ? (size_t)(nul - s) : size;
    const char *cfg = nul ? nul + 1 : NULL;
    size_t cfg_len = nul ? size - tok_len - 1 : 0;
    kvf_text_tokenizer *t = NULL;
    kvf_err err = {0};
    kvf_status st = kvf_text_tokenizer_load_buf(s, tok_len, cfg, cfg_len, NULL, 0, &t, &err);
    if (st != KVF_OK) {
        if (t || err.msg[0] == 0)
            abort(); /* a failure leaves no tokenizer and says why */
        return 0;
    }
    static const char text[] = "Hello, world! <s> 123 caf\xC3\xA9 \xF0\x9F\x98\x80\n\tend  ";
    int32_t *ids = NULL;
    size_t n = 0;
    if (kvf_text_tokenizer_encode(t, text, sizeof text - 1, true, &ids, &n, &err) != KVF_OK)
        abort();
    char *out = NULL;
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= kvf_text_tokenizer_vocab_size(t))
            abort();
    if (kvf_text_tokenizer_decode(t, ids, n, false, &out, NULL, &err) != KVF_OK)
        abort();
    kvf_text_tokenizer_token_to_id(t, "<s>");
    kvf_text_tokenizer_id_to_token(t, 0);
    kvf_text_tokenizer_bos_token(t);
    free(out);
    free(ids);
    kvf_text_tokenizer_destroy(t);
    return 0;
}
