/* fuzz_chat_template.c: fuzzes the chat-template interpreter with random templates and contexts.
 * Input: template bytes, then optionally "\n#####\n" and a JSON object of variables (a small
 * conversation when absent or invalid). Every input must compile and render, or fail with a
 * message and a known status; tight limits keep each input fast, so a hang is a bug. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja.h"

static const char default_vars[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"hi <think>x</think>\"},"
    " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1}}}]},"
    " {\"role\": \"tool\", \"content\": [{\"type\": \"text\", \"text\": \"r\"}]}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}],"
    " \"add_generation_prompt\": true, \"enable_thinking\": false, \"eos_token\": \"</s>\", \"x\": 1.5}";

static int known(kvf_status st)
{
    return st == KVF_ERR_PARSE || st == KVF_ERR_STATE || st == KVF_ERR_INVALID ||
           st == KVF_ERR_LIMIT || st == KVF_ERR_NOMEM;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char sep[] = "\n#####\n";
    const char *src = (const char *)data;
    size_t tlen = size;
    json_t *vars = NULL;
    const char *hit = size >= sizeof sep - 1 ? memmem(data, size, sep, sizeof sep - 1) : NULL;
    if (hit) {
        tlen = (size_t)(hit - src);
        size_t off = tlen + sizeof sep - 1;
        vars = json_loadb(src + off, size - off, JSON_DECODE_ANY, NULL);
        if (vars && !json_is_object(vars)) {
            json_decref(vars);
            vars = NULL;
        }
    }
    if (!vars)
        vars = json_loads(default_vars, 0, NULL);

    kvf_text_jinja *t = NULL;
    kvf_err err = {0};
    unsigned flags = size ? data[size - 1] & 3u : 3u;
    kvf_status st = kvf_text_jinja_compile(src, tlen, flags, &t, &err);
    if (st != KVF_OK) {
        if (!known(st) || !err.msg[0])
            abort();
        json_decref(vars);
        return 0;
    }
    kvf_text_jinja_limits lim = {.max_output = 1 << 16, .max_iters = 20000, .max_steps = 200000,
                                  .max_depth = 64};
    char *out = NULL;
    size_t len = 0;
    st = kvf_text_jinja_render(t, vars, &lim, &out, &len, &err);
    if (st == KVF_OK) {
        if (!out || len > lim.max_output || strlen(out) > len)
            abort();
        free(out);
    } else if (!known(st) || (st != KVF_ERR_INVALID && !err.msg[0])) {
        abort();
    }
    kvf_text_jinja_destroy(t);
    json_decref(vars);
    return 0;
}
