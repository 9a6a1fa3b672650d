/* toolcall.h: tool calls in a chat answer's text, in the two formats models write them: Hermes
 * (Qwen: <tool_call>{json}</tool_call> blocks) and Llama 3 JSON ({"name", "parameters"} objects
 * separated by ';', optionally after <|python_tag|>). Pure functions over text (jansson inside);
 * when to parse and how the calls reach the client is request.c's and openai.c's. */
#ifndef KVF_ROUTER_TOOLCALL_H
#define KVF_ROUTER_TOOLCALL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum kvf_router_toolcall_format {
    KVF_ROUTER_TOOLCALL_AUTO = -1, /* decided from the chat template (kvf_router_toolcall_detect) */
    KVF_ROUTER_TOOLCALL_NONE = 0,  /* never parsed: the text stays content */
    KVF_ROUTER_TOOLCALL_HERMES,
    KVF_ROUTER_TOOLCALL_LLAMA3_JSON,
    KVF_ROUTER_TOOLCALL_FORCED, /* tool_choice forced a call through a guide: never a flag's
                                 * value; parsed by kvf_router_toolcall_parse_forced */
} kvf_router_toolcall_format;

/* --tool-call-parser NAME: "auto", "hermes", "llama3_json" or "none". Anything else gives
 * KVF_ERR_INVALID naming the value and the choices. */
kvf_status kvf_router_toolcall_format_parse(const char *name, kvf_router_toolcall_format *out,
                                            kvf_err *err);
const char *kvf_router_toolcall_format_name(kvf_router_toolcall_format f);
/* The format a chat template's source implies: "<tool_call>" in it: hermes; "<|python_tag|>"
 * or "ipython": llama3_json; else none (also for NULL). */
kvf_router_toolcall_format kvf_router_toolcall_detect(const char *template_src);

/* One parsed call: both strings malloc'd, NUL-terminated. */
typedef struct kvf_router_toolcall {
    char *name;
    char *arguments; /* compact JSON of the arguments object */
} kvf_router_toolcall;

/* The answer's text split into content and calls. content is NULL (JSON null) when calls were
 * found and the text before them is empty or white space; otherwise it is the text before the
 * first call (hermes) or the whole text when there are no calls (n_calls 0). Malformed calls
 * (bad JSON, a block without name or arguments object, an unclosed tag, text between or after
 * blocks) make the whole text content, never an error. Owned by the caller: _fini frees it. */
typedef struct kvf_router_toolcall_result {
    char *content;
    size_t content_len;
    kvf_router_toolcall *calls;
    size_t n_calls;
} kvf_router_toolcall_result;

/* Parses text[0..len) (need not be NUL-terminated). KVF_ERR_NOMEM is the only failure. */
kvf_status kvf_router_toolcall_parse(kvf_router_toolcall_format f, const char *text, size_t len,
                                     kvf_router_toolcall_result *out);
void kvf_router_toolcall_result_fini(kvf_router_toolcall_result *r);

/* An answer a guide forced into calls (tool_choice): with name (a function the client named),
 * the whole text is its arguments object; without, a JSON list of {"name", "parameters"}
 * objects. Text that is not that (a guided answer cut by max_tokens) is all content. As
 * kvf_router_toolcall_parse otherwise; streaming holds the whole answer (safe_len 0). */
kvf_status kvf_router_toolcall_parse_forced(const char *name, const char *text, size_t len,
                                            kvf_router_toolcall_result *out);

/* Streaming: of the text generated so far, how many leading bytes are content whatever comes
 * next (they may be sent now); the rest may start a tool call and is held until the answer
 * ends, when kvf_router_toolcall_parse decides. The held part never shrinks as text grows, so
 * content streamed this way, followed at the end by what parse gives beyond it, is the content
 * parse gives for the whole text (null content: nothing streamed). `from`: 0, or at most what
 * this function answered for a shorter text of the same answer; the search starts there, so a
 * stream that passes what it has sent scans each byte about once. */
size_t kvf_router_toolcall_safe_len(kvf_router_toolcall_format f, const char *text, size_t len,
                                    size_t from);

/* A call id, "call_" and 24 letters or digits derived from the request id, the choice and the
 * call's index (stable, so a retried request names its calls alike). out: at least 32 bytes. */
void kvf_router_toolcall_id(const char *request_id, int32_t choice, size_t k, char *out);

#endif
