/* chat_template.h: turning an OpenAI-style conversation into a prompt exactly as Hugging Face's
 * apply_chat_template does: picks the model's Jinja chat template (or a built-in one per family)
 * and renders it with the variables transformers passes. Tokenizing the prompt is tokenizer.h's. */
#ifndef KVF_TEXT_CHAT_TEMPLATE_H
#define KVF_TEXT_CHAT_TEMPLATE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"
#include "text/jinja.h"

/* A compiled chat template plus the model's special-token variables. Immutable once made:
 * many threads may render with one template at once. */
typedef struct kvf_text_chat_template kvf_text_chat_template;

/* Compiles a template string with the environment transformers uses (trim_blocks and
 * lstrip_blocks on). A syntax error gives KVF_ERR_PARSE, "chat template: line L col C: ...". */
kvf_status kvf_text_chat_template_compile(const char *src, size_t len,
                                           kvf_text_chat_template **out, kvf_err *err);

/* The built-in template of a family: "llama2", "llama3", "chatml" (also "qwen", "qwen2",
 * "qwen3") or "mistral". An unknown name gives KVF_ERR_INVALID listing the names. */
kvf_status kvf_text_chat_template_builtin(const char *family, kvf_text_chat_template **out,
                                           kvf_err *err);

/* The template of a model directory, in this order: DIR/chat_template.jinja; the
 * "chat_template" of DIR/tokenizer_config.json (a string, or a list of {name, template} from
 * which `name` is taken, "default" when name is NULL); else the built-in template of `family`,
 * or when family is NULL the one config.json's "model_type" implies (llama: llama3 when
 * vocab_size >= 128000, else llama2; mistral, mixtral: mistral; qwen2*, qwen3*: chatml).
 * A given family overrides only a missing template; force_family overrides the model's own.
 * bos_token, eos_token, pad_token, unk_token and additional_special_tokens of
 * tokenizer_config.json become template variables, as transformers passes them. */
kvf_status kvf_text_chat_template_load(const char *dir, const char *family, bool force_family,
                                        const char *name, kvf_text_chat_template **out,
                                        kvf_err *err);

void kvf_text_chat_template_destroy(kvf_text_chat_template *t); /* NULL is fine */

/* Where the template came from: "DIR/tokenizer_config.json", "built-in llama3", ... (borrowed) */
const char *kvf_text_chat_template_source(const kvf_text_chat_template *t);
/* The template's Jinja source, NUL-terminated (borrowed; e.g. to tell its tool-call format). */
const char *kvf_text_chat_template_text(const kvf_text_chat_template *t);

typedef struct kvf_text_chat_request {
    const json_t *messages;     /* array of {role, content (string or list of parts),
                                   tool_calls, reasoning_content, ...}; required */
    const json_t *tools;        /* array, or NULL (the template then sees tools = none) */
    bool add_generation_prompt;
    const json_t *extra;        /* object: more template variables (enable_thinking, ...), or
                                   NULL; keys messages, tools, add_generation_prompt are ignored */
    const char *bos_token;      /* overrides the model's when not NULL */
    const char *eos_token;
    bool text_parts_as_string;  /* a content that is a list of only {"type": "text"} parts
                                   reaches the template as one string, the texts joined by
                                   "\n" (for templates that expect strings, as vLLM does);
                                   off: contents pass exactly as given, as transformers does */
    const kvf_text_jinja_limits *limits; /* NULL: the defaults in jinja.h */
} kvf_text_chat_request;

/* Renders the prompt. Statuses:
 *   KVF_ERR_INVALID  the request is malformed, or the template called raise_exception(msg):
 *                    then *raised_out (may be NULL) is true and err->msg is msg exactly, for
 *                    the client's 400 answer;
 *   KVF_ERR_LIMIT    a render limit was hit;
 *   KVF_ERR_STATE    the template failed otherwise ("chat template: line L col C: ...");
 *   KVF_ERR_NOMEM.
 * *out is malloc'd and NUL-terminated (free it); *len_out (may be NULL) is its length. */
kvf_status kvf_text_chat_template_render(const kvf_text_chat_template *t,
                                          const kvf_text_chat_request *req, char **out,
                                          size_t *len_out, bool *raised_out, kvf_err *err);

#endif
