/* openai.h: the OpenAI wire format of the router: parsing and validating /v1/completions and
 * /v1/chat/completions bodies, error bodies as OpenAI writes them, and the JSON of answers and
 * SSE chunks. Pure functions over jansson; HTTP, tokenization and workers live elsewhere. */
#ifndef KVF_ROUTER_OPENAI_H
#define KVF_ROUTER_OPENAI_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/sbuf.h"
#include "common/status.h"
#include "router/toolcall.h"

#define KVF_ROUTER_OAI_MAX_STOP 4 /* stop strings per request, as OpenAI allows */
#define KVF_ROUTER_OAI_MAX_N 64   /* choices per request (KVF_RPC_MAX_N) */
#define KVF_ROUTER_OAI_MAX_PROMPTS 64   /* prompts in one completions request */
#define KVF_ROUTER_OAI_MAX_LOGPROBS 20  /* top logprobs per token (KVF_RPC_MAX_LOGPROBS) */
#define KVF_ROUTER_OAI_MAX_BIAS 1024    /* logit_bias entries (KVF_RPC_MAX_BIAS) */
#define KVF_ROUTER_OAI_MAX_STOP_IDS 16  /* stop_token_ids with the model's eos ids: what a sequence
                                         * holds (KVF_ENGINE_MAX_STOP) */

typedef enum kvf_router_oai_kind {
    KVF_ROUTER_OAI_COMPLETIONS, /* POST /v1/completions */
    KVF_ROUTER_OAI_CHAT,        /* POST /v1/chat/completions */
} kvf_router_oai_kind;

/* An error answer: HTTP status and the four fields of {"error":{message,type,param,code}}.
 * param and code are "" for JSON null. */
typedef struct kvf_router_oai_error {
    int http_status;
    const char *type; /* "invalid_request_error", "not_found_error", "server_error", ... */
    char param[64];
    char code[64];
    char message[KVF_ERR_MSG_MAX];
} kvf_router_oai_error;

/* Fills e and returns KVF_ERR_INVALID (for `return kvf_router_oai_error_set(...)`). */
kvf_status kvf_router_oai_error_set(kvf_router_oai_error *e, int http_status, const char *type,
                                    const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
/* A chat template's error as a client may read it: the template file's path is the server's
 * business, so "chat template (PATH): WHAT" becomes "chat template: WHAT" (written to buf). */
const char *kvf_router_oai_template_error(const char *msg, char *buf, size_t cap);
/* Appends {"error":{...}} to out. */
kvf_status kvf_router_oai_error_json(const kvf_router_oai_error *e, kvf_sbuf *out);

/* A parsed request. Owned by the caller: kvf_router_oai_req_fini frees what parse allocated. */
typedef struct kvf_router_oai_req {
    kvf_router_oai_kind kind;
    char *model;
    char *prompt_text;    /* completions with a text prompt, else NULL */
    int32_t *prompt_ids;  /* completions with token ids, else NULL */
    size_t n_prompt_ids;
    int32_t n_prompts;    /* completions: prompts in the request's list (1 for a lone prompt);
                           * prompt_text/prompt_ids hold the one at prompt_index */
    int32_t prompt_index;
    json_t *messages;     /* chat: the messages as the chat template takes them (a copy:
                             content parts joined into a string, null content "", tool call
                             arguments decoded from their JSON strings), as vLLM passes them */
    json_t *chat_extra;   /* chat: chat_template_kwargs object, or NULL */
    int32_t max_tokens;   /* 0 when the client gave none */
    double temperature;   /* default 1 */
    double top_p;         /* default 1 */
    int32_t top_k;        /* extension; 0 = off */
    uint64_t seed;
    bool has_seed;
    char *stop[KVF_ROUTER_OAI_MAX_STOP];
    size_t n_stop;
    int32_t n;            /* default 1 */
    bool stream;
    bool include_usage;   /* stream_options.include_usage */
    bool ignore_eos;      /* extension */
    bool skip_special_tokens; /* extension; default true */
    char *cache_salt;     /* extension; NULL = none */
    /* Logit processing (vLLM's definitions, engine/sample.h); each default is "off". */
    double presence_penalty, frequency_penalty; /* [-2, 2] */
    double repetition_penalty;                  /* extension; (0, 2], default 1 */
    double min_p;                               /* extension; [0, 1] */
    int32_t min_tokens;                         /* extension; <= max_tokens */
    int32_t *bias_ids;   /* logit_bias: [n_bias] token ids (the caller checks the vocabulary) */
    float *bias_vals;    /* [n_bias], -100..100 */
    size_t n_bias;
    int32_t stop_ids[KVF_ROUTER_OAI_MAX_STOP_IDS]; /* extension stop_token_ids */
    size_t n_stop_ids;
    /* Log-probabilities: completions' integer logprobs N is logprobs + top_logprobs N; chat's
     * logprobs true and top_logprobs. */
    bool logprobs;
    int32_t top_logprobs;
    bool echo;            /* completions: the prompt leads each choice's text */
    int32_t best_of;      /* completions: samples drawn, the n with the highest cumulative
                           * logprob returned; 0 when not given (= n) */
    json_t *tools;        /* chat: the checked tools array (a reference), or NULL */
    bool tool_choice_none;    /* chat: tool_choice "none" (tools rendered, output not parsed) */
    bool parallel_tool_calls; /* chat: default true; false keeps the first parsed call */
    /* Structured output (text/guide.h): response_format, vLLM's guided_json / guided_regex /
     * guided_choice (or structured_outputs), or tool_choice forcing a tool; compiled once here
     * so a bad one is a 400 naming it. */
    int32_t guide_kind;   /* kvf_text_guide_kind; NONE: unconstrained */
    char *guide;          /* its text (NUL-terminated), NULL for json_object */
    size_t guide_len;
    char guide_param[48]; /* the field it came from, for errors */
    /* chat: tool_choice "required" (the output is a JSON list of {"name", "parameters"}) or
     * naming a function (the output is its arguments): the guide makes the output so */
    bool tool_required;
    char *tool_forced;    /* the named function, or NULL */
} kvf_router_oai_req;

/* Parses and validates a request body. Unknown fields are ignored; a known field of the wrong
 * type or out of range fails with an OpenAI-style 400 in e (param naming the field), as do
 * malformed JSON and a missing prompt/messages/model. On failure req holds nothing to free. */
kvf_status kvf_router_oai_parse(kvf_router_oai_kind kind, const char *body, size_t len,
                                kvf_router_oai_req *req, kvf_router_oai_error *e);
void kvf_router_oai_req_fini(kvf_router_oai_req *req);
/* The same, keeping prompt prompt_index of a list of prompts (choices prompt_index * n ..). */
kvf_status kvf_router_oai_parse_at(kvf_router_oai_kind kind, const char *body, size_t len,
                                   int32_t prompt_index, kvf_router_oai_req *req,
                                   kvf_router_oai_error *e);

/* A chat body's messages and tools as the chat template takes them, checked as
 * kvf_router_oai_parse checks them (content parts joined, null content "", tool call arguments
 * decoded): for /tokenize, so it counts exactly what /v1/chat/completions renders. Both outputs
 * are the caller's references (tools NULL when none). */
kvf_status kvf_router_oai_chat_inputs(const json_t *o, json_t **messages_out, json_t **tools_out,
                                      kvf_router_oai_error *e);

/* OpenAI's finish_reason strings: "stop", "length", or NULL (JSON null) while running. */
typedef enum kvf_router_oai_finish {
    KVF_ROUTER_OAI_FINISH_NONE = 0,
    KVF_ROUTER_OAI_FINISH_STOP,
    KVF_ROUTER_OAI_FINISH_LENGTH,
    KVF_ROUTER_OAI_FINISH_ABORT, /* cancelled or failed mid-way ("abort", as vLLM says) */
    KVF_ROUTER_OAI_FINISH_TOOL_CALLS, /* chat: the answer ended in tool calls */
} kvf_router_oai_finish;
const char *kvf_router_oai_finish_str(kvf_router_oai_finish f);

/* One choice of an answer or a chunk. token_ids may be NULL when n_ids is 0. */
typedef struct kvf_router_oai_choice {
    int32_t index;
    const char *text;       /* the text (answer) or the new text (chunk); may be NULL */
    size_t text_len;
    const int32_t *token_ids; /* the ids (answer) or the new ids (chunk) */
    size_t n_ids;
    kvf_router_oai_finish finish;
    bool first_chunk;       /* chat streaming: the delta also carries role "assistant" */
    json_t *logprobs;       /* borrowed (kvf_router_oai_lp_append); NULL writes null */
    /* chat: tool calls (message.tool_calls, or a delta's, indexed from 0), their ids beside */
    const kvf_router_toolcall *tool_calls;
    const char (*tool_call_ids)[32]; /* [n_tool_calls] */
    size_t n_tool_calls;
    bool content_null;      /* chat answer with tool calls: "content": null */
} kvf_router_oai_choice;

/* One position's log-probabilities as an answer shows them: the token's bytes (a token may hold
 * part of a UTF-8 character), its log-probability (NaN: none, as the first prompt token of an
 * echo) and the largest ones. */
typedef struct kvf_router_oai_lp {
    const uint8_t *bytes;
    size_t len;
    float logprob;
    int32_t n_top;
    const uint8_t *top_bytes[KVF_ROUTER_OAI_MAX_LOGPROBS];
    size_t top_len[KVF_ROUTER_OAI_MAX_LOGPROBS];
    float top_lp[KVF_ROUTER_OAI_MAX_LOGPROBS];
} kvf_router_oai_lp;

/* Appends one position to a choice's logprobs object, making it when *lp is NULL: chat
 * {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}; completions
 * {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}, text_offset being
 * where the token's text starts in the choice's text (in characters, as OpenAI counts). Token
 * strings are the bytes with invalid UTF-8 as U+FFFD. */
kvf_status kvf_router_oai_lp_append(kvf_router_oai_kind kind, json_t **lp,
                                    const kvf_router_oai_lp *p, int64_t text_offset);

typedef struct kvf_router_oai_usage {
    int64_t prompt_tokens, completion_tokens, cached_tokens;
} kvf_router_oai_usage;

/* The whole non-streaming answer (usage always present). */
kvf_status kvf_router_oai_answer_json(kvf_router_oai_kind kind, const char *id,
                                      const char *model, int64_t created,
                                      const kvf_router_oai_choice *choices, size_t n_choices,
                                      const kvf_router_oai_usage *usage, kvf_sbuf *out);
/* One SSE event "data: {...}\n\n" with the given choices (n_choices may be 0 for the usage
 * chunk); usage NULL writes no usage field unless null_usage says "usage": null. */
kvf_status kvf_router_oai_chunk_sse(kvf_router_oai_kind kind, const char *id, const char *model,
                                    int64_t created, const kvf_router_oai_choice *choices,
                                    size_t n_choices, const kvf_router_oai_usage *usage,
                                    bool null_usage, kvf_sbuf *out);

/* Stop strings: the offset in text[0..len) where the earliest stop string starts, searching
 * from `from` (the caller passes where new text began minus the longest stop length), or -1. */
int64_t kvf_router_oai_find_stop(const char *text, size_t len, size_t from,
                                 char *const *stop, size_t n_stop);

#endif
