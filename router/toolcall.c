/* toolcall.c: finds tool calls in a chat answer's text (Hermes <tool_call> blocks, Llama 3 JSON
 * objects), as vLLM's hermes and llama3_json parsers do, and tells a streaming answer how much of
 * its text is surely content. Anything malformed stays text: a model's output is never an error.
 * The answer's JSON is openai.c's; when to parse is request.c's. */
#include "router/toolcall.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char HERMES_OPEN[] = "<tool_call>", HERMES_CLOSE[] = "</tool_call>";
static const char PYTHON_TAG[] = "<|python_tag|>";

static const struct {
    const char *name;
    kvf_router_toolcall_format f;
} formats[] = {
    {"auto", KVF_ROUTER_TOOLCALL_AUTO},
    {"none", KVF_ROUTER_TOOLCALL_NONE},
    {"hermes", KVF_ROUTER_TOOLCALL_HERMES},
    {"llama3_json", KVF_ROUTER_TOOLCALL_LLAMA3_JSON},
};

kvf_status kvf_router_toolcall_format_parse(const char *name, kvf_router_toolcall_format *out,
                                            kvf_err *err)
{
    for (size_t i = 0; name && i < sizeof formats / sizeof formats[0]; i++)
        if (strcmp(name, formats[i].name) == 0) {
            *out = formats[i].f;
            return KVF_OK;
        }
    return kvf_err_set(err, KVF_ERR_INVALID,
                       "router: --tool-call-parser=%s is not known (use auto, hermes, llama3_json or none)",
                       name ? name : "(none)");
}

const char *kvf_router_toolcall_format_name(kvf_router_toolcall_format f)
{
    for (size_t i = 0; i < sizeof formats / sizeof formats[0]; i++)
        if (formats[i].f == f)
            return formats[i].name;
    return "?";
}

kvf_router_toolcall_format kvf_router_toolcall_detect(const char *src)
{
    if (!src)
        return KVF_ROUTER_TOOLCALL_NONE;
    if (strstr(src, HERMES_OPEN))
        return KVF_ROUTER_TOOLCALL_HERMES;
    if (strstr(src, PYTHON_TAG) || strstr(src, "ipython"))
        return KVF_ROUTER_TOOLCALL_LLAMA3_JSON;
    return KVF_ROUTER_TOOLCALL_NONE;
}

/* ---- whole text --------------------------------------------------------------------------- */

static bool is_ws(char c)
{
    return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

static size_t skip_ws(const char *t, size_t len, size_t i)
{
    while (i < len && is_ws(t[i]))
        i++;
    return i;
}

/* text[i..len) starts with s (length n) */
static bool starts(const char *t, size_t len, size_t i, const char *s, size_t n)
{
    return len - i >= n && memcmp(t + i, s, n) == 0;
}

/* First occurrence of s (length n) in t[from..len), or len. */
static size_t find(const char *t, size_t len, size_t from, const char *s, size_t n)
{
    for (size_t i = from; i + n <= len; i++)
        if (memcmp(t + i, s, n) == 0)
            return i;
    return len;
}

void kvf_router_toolcall_result_fini(kvf_router_toolcall_result *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->n_calls; i++) {
        free(r->calls[i].name);
        free(r->calls[i].arguments);
    }
    free(r->calls);
    free(r->content);
    memset(r, 0, sizeof *r);
}

/* Adds a call from a decoded object {"name": string, args_key: object}; false when o is not
 * such an object. *oom is set when memory ran out. */
static bool add_call(kvf_router_toolcall_result *r, const json_t *o, bool llama, bool *oom)
{
    const json_t *name = json_object_get(o, "name");
    const json_t *args = json_object_get(o, llama && json_object_get(o, "parameters") ? "parameters" : "arguments");
    if (!json_is_object(o) || !json_is_string(name) || !json_string_length(name) || !json_is_object(args))
        return false;
    kvf_router_toolcall *calls = realloc(r->calls, (r->n_calls + 1) * sizeof *calls);
    if (!calls) {
        *oom = true;
        return false;
    }
    r->calls = calls;
    char *a = json_dumps(args, JSON_COMPACT), *n = strdup(json_string_value(name));
    if (!a || !n) {
        free(a);
        free(n);
        *oom = true;
        return false;
    }
    r->calls[r->n_calls++] = (kvf_router_toolcall){.name = n, .arguments = a};
    return true;
}

/* Decodes one JSON object at t[i..end); true with *next after it. */
static bool object_at(const char *t, size_t end, size_t i, json_t **out, size_t *next)
{
    json_error_t je;
    json_t *o = json_loadb(t + i, end - i, JSON_DISABLE_EOF_CHECK, &je);
    if (!o)
        return false;
    *out = o;
    *next = i + (size_t)je.position;
    return true;
}

/* Hermes: [content] <tool_call> {json} </tool_call> (ws <tool_call> {json} </tool_call>)* ws */
static bool parse_hermes(const char *t, size_t len, kvf_router_toolcall_result *r, size_t *content_len,
                         bool *oom)
{
    size_t on = sizeof HERMES_OPEN - 1, cn = sizeof HERMES_CLOSE - 1;
    size_t i = find(t, len, 0, HERMES_OPEN, on);
    if (i == len)
        return false;
    *content_len = i;
    while (i < len) {
        if (!starts(t, len, i, HERMES_OPEN, on))
            return false;
        size_t body = i + on, close = find(t, len, body, HERMES_CLOSE, cn);
        if (close == len)
            return false; /* unclosed */
        size_t b = skip_ws(t, close, body), next;
        json_t *o = NULL;
        bool ok = object_at(t, close, b, &o, &next) && skip_ws(t, close, next) == close &&
                  add_call(r, o, false, oom);
        json_decref(o);
        if (!ok)
            return false;
        i = skip_ws(t, len, close + cn);
    }
    return true;
}

/* Llama 3: ws [<|python_tag|>] ws {json} (ws ; ws {json})* [ws ;] ws */
static bool parse_llama3(const char *t, size_t len, kvf_router_toolcall_result *r, bool *oom)
{
    size_t pn = sizeof PYTHON_TAG - 1, i = skip_ws(t, len, 0);
    if (starts(t, len, i, PYTHON_TAG, pn))
        i = skip_ws(t, len, i + pn);
    if (i == len || t[i] != '{')
        return false;
    while (i < len) {
        json_t *o = NULL;
        size_t next;
        bool ok = object_at(t, len, i, &o, &next) && add_call(r, o, true, oom);
        json_decref(o);
        if (!ok)
            return false;
        i = skip_ws(t, len, next);
        if (i < len && t[i] == ';')
            i = skip_ws(t, len, i + 1);
        else if (i < len)
            return false;
    }
    return true;
}

static bool all_ws(const char *t, size_t n)
{
    return skip_ws(t, n, 0) == n;
}

kvf_status kvf_router_toolcall_parse(kvf_router_toolcall_format f, const char *text, size_t len,
                                     kvf_router_toolcall_result *out)
{
    memset(out, 0, sizeof *out);
    if (!text)
        len = 0;
    bool oom = false, found = false;
    size_t content_len = 0;
    if (f == KVF_ROUTER_TOOLCALL_HERMES)
        found = parse_hermes(text, len, out, &content_len, &oom);
    else if (f == KVF_ROUTER_TOOLCALL_LLAMA3_JSON)
        found = parse_llama3(text, len, out, &oom);
    if (oom) {
        kvf_router_toolcall_result_fini(out);
        return KVF_ERR_NOMEM;
    }
    if (!found) {
        kvf_router_toolcall_result_fini(out); /* calls parsed before the malformed part */
        content_len = len;
    } else if (all_ws(text, content_len)) {
        return KVF_OK; /* calls, content null */
    }
    if (!(out->content = malloc(content_len + 1))) {
        kvf_router_toolcall_result_fini(out);
        return KVF_ERR_NOMEM;
    }
    if (content_len)
        memcpy(out->content, text, content_len);
    out->content[content_len] = 0;
    out->content_len = content_len;
    return KVF_OK;
}

kvf_status kvf_router_toolcall_parse_forced(const char *name, const char *text, size_t len,
                                            kvf_router_toolcall_result *out)
{
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *v = text ? json_loadb(text, len, 0, &je) : NULL;
    bool oom = false, ok = false;
    if (name && json_is_object(v)) {
        json_t *o = json_pack("{s:s, s:O}", "name", name, "arguments", v);
        ok = o && add_call(out, o, false, &oom);
        oom = oom || !o;
        json_decref(o);
    } else if (!name && json_is_array(v) && json_array_size(v) > 0) {
        size_t i;
        const json_t *o;
        ok = true;
        json_array_foreach(v, i, o)
            if (!(ok = add_call(out, o, true, &oom)))
                break;
    }
    json_decref(v);
    if (oom) {
        kvf_router_toolcall_result_fini(out);
        return KVF_ERR_NOMEM;
    }
    if (ok)
        return KVF_OK; /* calls, content null */
    kvf_router_toolcall_result_fini(out);
    return kvf_router_toolcall_parse(KVF_ROUTER_TOOLCALL_NONE, text, len, out);
}

/* ---- streaming ---------------------------------------------------------------------------- */

/* The longest suffix of t[0..len) that is a proper prefix of s: where a tag may be starting. */
static size_t partial_suffix(const char *t, size_t len, const char *s, size_t n)
{
    for (size_t k = n - 1 < len ? n - 1 : len; k > 0; k--)
        if (memcmp(t + len - k, s, k) == 0)
            return k;
    return 0;
}

size_t kvf_router_toolcall_safe_len(kvf_router_toolcall_format f, const char *text, size_t len,
                                    size_t from)
{
    if (!text)
        return 0;
    if (f == KVF_ROUTER_TOOLCALL_FORCED)
        return 0; /* the answer is calls, or (cut short) content: known at its end */
    if (f != KVF_ROUTER_TOOLCALL_HERMES && f != KVF_ROUTER_TOOLCALL_LLAMA3_JSON)
        return len;
    if (from > len)
        from = len;
    size_t on = sizeof HERMES_OPEN - 1;
    if (from > 0) {
        /* text[0..from) held something other than white space and no tag can start in it (a
         * tag, whole or begun, was never let through): llama3_json decided content; hermes
         * looks for a tag from there on */
        if (f == KVF_ROUTER_TOOLCALL_LLAMA3_JSON)
            return len;
        size_t tag = find(text, len, from, HERMES_OPEN, on);
        return tag < len ? tag : len - partial_suffix(text, len, HERMES_OPEN, on);
    }
    size_t i = skip_ws(text, len, 0);
    if (i == len)
        return 0; /* white space only: content null if calls follow */
    if (f == KVF_ROUTER_TOOLCALL_LLAMA3_JSON) {
        size_t pn = sizeof PYTHON_TAG - 1, rest = len - i;
        if (text[i] == '{' || memcmp(text + i, PYTHON_TAG, rest < pn ? rest : pn) == 0)
            return 0; /* a call, or the start of one: decided at the end */
        return len;
    }
    size_t tag = find(text, len, 0, HERMES_OPEN, on);
    if (tag < len)
        return all_ws(text, tag) ? 0 : tag;
    size_t safe = len - partial_suffix(text, len, HERMES_OPEN, on);
    return all_ws(text, safe) ? 0 : safe;
}

/* ---- ids ---------------------------------------------------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void kvf_router_toolcall_id(const char *request_id, int32_t choice, size_t k, char *out)
{
    static const char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a of the request id */
    for (const char *p = request_id ? request_id : ""; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    h = mix64(h ^ mix64(((uint64_t)(uint32_t)choice << 32) ^ (uint64_t)k));
    memcpy(out, "call_", 5);
    for (int i = 0; i < 24; i++) {
        if (i % 8 == 0)
            h = mix64(h + (uint64_t)i);
        out[5 + i] = abc[h % 62];
        h /= 62;
    }
    out[29] = 0;
}
