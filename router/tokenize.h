/* tokenize.h: POST /tokenize and POST /detokenize in vLLM's shapes, as prep jobs
 * (request.h): run on the router's prep threads, never on the event loop. Parsing, validation
 * and the answer's JSON are here; the route and the queue are http.c's and request.c's. */
#ifndef KVF_ROUTER_TOKENIZE_H
#define KVF_ROUTER_TOKENIZE_H

#include "router/request.h"

/* /tokenize: {"model"?, "prompt": "text", "add_special_tokens"?: true} or {"model"?, "messages":
 * [...], "add_generation_prompt"?: true, "continue_final_message"?: false,
 * "add_special_tokens"?: false, "chat_template_kwargs"?, "tools"?}, each with an optional
 * "return_token_strs": false. Answers {"count", "max_model_len", "tokens", "token_strs" (the
 * vocabulary forms, or null)}. Any other field, or a field of the wrong type, is a 400 naming
 * it; another model a 404 model_not_found. */
kvf_status kvf_router_tokenize_run(const kvf_router_reqs_cfg *cfg, const char *body, size_t len,
                                   kvf_sbuf *out, kvf_router_oai_error *e);
/* /detokenize: {"model"?, "tokens": [ids]} -> {"prompt": "text"} (special tokens kept, as
 * vLLM's decode); an id outside the vocabulary is a 400 naming "tokens". */
kvf_status kvf_router_detokenize_run(const kvf_router_reqs_cfg *cfg, const char *body, size_t len,
                                     kvf_sbuf *out, kvf_router_oai_error *e);

extern const kvf_router_prep_job kvf_router_tokenize_job;
extern const kvf_router_prep_job kvf_router_detokenize_job;

#endif
