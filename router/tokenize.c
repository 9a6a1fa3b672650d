/* tokenize.c: POST /tokenize and POST /detokenize as vLLM serves them, run on the router's
 * prep threads (request.c's queue): the body parsed and checked (every field honoured or a 400
 * naming it), the chat template applied as for /v1/chat/completions, the text tokenized or the
 * ids decoded, and the answer's JSON written. Reads only the model's immutable pieces. */
#include "router/tokenize.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "common/log.h"

/* The fields each form takes; anything else is refused, never ignored. */
static const char *const prompt_fields[] = {"model", "prompt", "add_special_tokens", "return_token_strs", NULL};
static const char *const chat_fields[] = {"model", "messages", "add_generation_prompt", "continue_final_message",
                                          "add_special_tokens", "chat_template_kwargs", "tools",
                                          "return_token_strs", NULL};
static const char *const detok_fields[] = {"model", "tokens", NULL};

static kvf_status bad_type(kvf_router_oai_error *e, const char *field, const char *want, const json_t *v)
{
    return kvf_router_oai_error_set(e, 400, "invalid_request_error", field, "invalid_type",
                                    "'%s' must be %s, got %s", field, want, kvf_json_kind(v));
}

/* The body as a JSON object with only the given fields, and its model (absent, or the one this
 * router serves). *o_out is the caller's on success. */
static kvf_status load_body(const kvf_router_reqs_cfg *c, const char *body, size_t len, const char *what,
                            json_t **o_out, kvf_router_oai_error *e)
{
    json_error_t jerr;
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (!o)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", NULL, "invalid_json",
                                        "the body is not valid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                                        jerr.column);
    if (!json_is_object(o)) {
        kvf_router_oai_error_set(e, 400, "invalid_request_error", NULL, "invalid_json",
                                 "the body must be a JSON object, got %s", kvf_json_kind(o));
        json_decref(o);
        return KVF_ERR_INVALID;
    }
    const json_t *m = json_object_get(o, "model");
    kvf_status st = KVF_OK;
    if (m && !json_is_null(m) && !json_is_string(m))
        st = bad_type(e, "model", "a string", m);
    else if (json_is_string(m) && strcmp(json_string_value(m), c->served) != 0)
        st = kvf_router_oai_error_set(e, 404, "invalid_request_error", "model", "model_not_found",
                                      "The model '%.200s' does not exist; this server serves '%s'",
                                      json_string_value(m), c->served);
    else if (!c->tok)
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", NULL, "no_tokenizer",
                                      "model '%s' has no tokenizer: /%s needs one", c->served, what);
    if (st != KVF_OK) {
        json_decref(o);
        return st;
    }
    *o_out = o;
    return KVF_OK;
}

/* Refuses the first field of o not in `allowed` (form: what the fields belong to). */
static kvf_status only_fields(const json_t *o, const char *const *allowed, const char *form,
                              kvf_router_oai_error *e)
{
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)o, key, v) {
        bool ok = false;
        for (size_t i = 0; allowed[i] && !ok; i++)
            ok = strcmp(key, allowed[i]) == 0;
        if (ok)
            continue;
        char list[256] = "";
        for (size_t i = 0, n = 0; allowed[i] && n < sizeof list; i++)
            n += (size_t)snprintf(list + n, sizeof list - n, "%s%s", i ? ", " : "", allowed[i]);
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", key, "unknown_parameter",
                                        "Unrecognized request argument supplied: '%.60s' (%s takes: %s)", key, form,
                                        list);
    }
    return KVF_OK;
}

/* An optional boolean field (null: the default). */
static kvf_status opt_bool(const json_t *o, const char *key, bool dflt, bool *out, kvf_router_oai_error *e)
{
    const json_t *v = json_object_get(o, key);
    *out = dflt;
    if (!v || json_is_null(v))
        return KVF_OK;
    if (!json_is_boolean(v))
        return bad_type(e, key, "a boolean", v);
    *out = json_is_true(v);
    return KVF_OK;
}

/* Memory's last occurrence of needle in hay, or NULL. */
static const char *last_of(const char *hay, size_t n, const char *needle, size_t m)
{
    if (!m || m > n)
        return NULL;
    for (size_t i = n - m + 1; i-- > 0;)
        if (memcmp(hay + i, needle, m) == 0)
            return hay + i;
    return NULL;
}

/* continue_final_message, as transformers' apply_chat_template does it: the chat rendered without
 * a generation prompt is cut right after the final message's text (its last text part for a
 * list of parts), so the model continues that message. */
static kvf_status cut_after_final(const json_t *messages, char *text, size_t *len, kvf_router_oai_error *e)
{
    const json_t *last = json_array_get(messages, json_array_size(messages) - 1);
    const json_t *content = json_object_get(last, "content");
    if (json_is_array(content)) {
        const json_t *t = NULL;
        for (size_t i = json_array_size(content); i-- > 0 && !t;)
            if (json_is_string(json_object_get(json_array_get(content, i), "text")))
                t = json_object_get(json_array_get(content, i), "text");
        content = t;
    }
    if (!json_is_string(content))
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "continue_final_message", "invalid_value",
                                        "continue_final_message is set but the final message has no text to continue");
    const char *fm = json_string_value(content);
    size_t fl = json_string_length(content), lo = 0, hi = fl;
    while (lo < hi && strchr(" \t\r\n\v\f", fm[lo]))
        lo++;
    while (hi > lo && strchr(" \t\r\n\v\f", fm[hi - 1]))
        hi--;
    const char *at = last_of(text, *len, fm + lo, hi - lo);
    if (!at)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "continue_final_message", "invalid_value",
                                        "continue_final_message is set but the final message does not appear in the "
                                        "chat after applying the chat template");
    /* the template kept the message as it is (no leading spaces, its trailing ones kept): cut
     * after all of it; else after its stripped text (transformers compares the same way) */
    size_t at_off = (size_t)(at - text), keep = at_off + fl;
    if (lo != 0 || keep > *len || memcmp(at, fm, fl) != 0)
        keep = at_off + (hi - lo);
    *len = keep;
    text[keep] = 0;
    return KVF_OK;
}

/* The chat form's text: the template with the request's options. *text_out is malloc'd. */
static kvf_status chat_text(const kvf_router_reqs_cfg *c, const json_t *o, char **text_out, size_t *len_out,
                            kvf_router_oai_error *e)
{
    const json_t *kw = json_object_get(o, "chat_template_kwargs");
    bool gen, cont;
    kvf_status st;
    if (kw && !json_is_null(kw) && !json_is_object(kw))
        return bad_type(e, "chat_template_kwargs", "an object", kw);
    if ((st = opt_bool(o, "add_generation_prompt", true, &gen, e)) != KVF_OK ||
        (st = opt_bool(o, "continue_final_message", false, &cont, e)) != KVF_OK)
        return st;
    if (gen && cont)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "continue_final_message", "invalid_value",
                                        "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                        "True (add_generation_prompt defaults to true: set it to false)");
    if (!c->tmpl)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", "no_chat_template",
                                        "model '%s' has no chat template: %s", c->served, c->tmpl_err);
    /* the messages and tools exactly as /v1/chat/completions hands them to the template */
    json_t *messages = NULL, *tools = NULL;
    if ((st = kvf_router_oai_chat_inputs(o, &messages, &tools, e)) != KVF_OK)
        return st;
    kvf_text_chat_request cr = {.messages = messages, .add_generation_prompt = gen, .tools = tools,
                                .extra = json_is_object(kw) ? kw : NULL};
    kvf_err err = {0};
    if (kvf_text_chat_template_render(c->tmpl, &cr, text_out, len_out, NULL, &err) != KVF_OK) {
        char buf[KVF_ERR_MSG_MAX];
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", NULL, "%s",
                                      kvf_router_oai_template_error(err.msg, buf, sizeof buf));
    } else if (cont && (st = cut_after_final(messages, *text_out, len_out, e)) != KVF_OK) {
        free(*text_out);
        *text_out = NULL;
    }
    json_decref(messages);
    json_decref(tools);
    return st;
}

/* Appends the answer: {"count", "max_model_len", "tokens", "token_strs"}. */
static kvf_status tokens_json(const kvf_router_reqs_cfg *c, const int32_t *ids, size_t n, bool strs, kvf_sbuf *out,
                              kvf_router_oai_error *e)
{
    json_t *toks = json_array(), *ts = strs ? json_array() : json_null();
    bool ok = toks && ts;
    for (size_t i = 0; ok && i < n; i++) {
        ok = json_array_append_new(toks, json_integer(ids[i])) == 0;
        if (ok && strs) {
            const char *s = kvf_text_tokenizer_id_to_token(c->tok, ids[i]);
            ok = json_array_append_new(ts, s ? json_string(s) : json_null()) == 0;
        }
    }
    json_t *o = ok ? json_pack("{s:I,s:i,s:o,s:o}", "count", (json_int_t)n, "max_model_len", c->max_len, "tokens",
                               toks, "token_strs", ts)
                   : NULL;
    if (!o) {
        if (!ok) {
            json_decref(toks);
            json_decref(ts);
        }
        return kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    kvf_status st = s ? kvf_sbuf_puts(out, s) : KVF_ERR_NOMEM;
    free(s);
    if (st != KVF_OK)
        return kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return KVF_OK;
}

kvf_status kvf_router_tokenize_run(const kvf_router_reqs_cfg *c, const char *body, size_t len, kvf_sbuf *out,
                                   kvf_router_oai_error *e)
{
    kvf_log(KVF_LOG_DEBUG, "router: tokenize: %zu bytes", len);
    json_t *o = NULL;
    kvf_status st = load_body(c, body, len, "tokenize", &o, e);
    if (st != KVF_OK)
        return st;
    const json_t *prompt = json_object_get(o, "prompt"), *messages = json_object_get(o, "messages");
    bool chat = messages != NULL, add_special, strs;
    char *text = NULL;
    size_t text_len = 0;
    int32_t *ids = NULL;
    size_t n = 0;
    kvf_err err = {0};
    /* 1. The form: a prompt or messages, and only that form's fields. */
    if (prompt && messages) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", "invalid_value",
                                      "give either 'prompt' or 'messages', not both");
        goto done;
    }
    if (!prompt && !messages) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "missing_required_parameter",
                                      "'prompt' (a string) or 'messages' (a chat) is required");
        goto done;
    }
    const char *form = chat ? "/tokenize with messages" : "/tokenize with a prompt";
    if ((st = only_fields(o, chat ? chat_fields : prompt_fields, form, e)) != KVF_OK ||
        (st = opt_bool(o, "add_special_tokens", !chat, &add_special, e)) != KVF_OK ||
        (st = opt_bool(o, "return_token_strs", false, &strs, e)) != KVF_OK)
        goto done;
    /* 2. The text: the prompt as it is, or the chat through the template. */
    if (chat) {
        if ((st = chat_text(c, o, &text, &text_len, e)) != KVF_OK)
            goto done;
    } else if (!json_is_string(prompt)) {
        st = bad_type(e, "prompt", "a string", prompt);
        goto done;
    }
    const char *src = chat ? text : json_string_value(prompt);
    size_t src_len = chat ? text_len : json_string_length(prompt);
    /* 3. A text no context can hold is refused before the tokenizer spends time on it, as for
     * generation (the bound never refuses a text that could fit). */
    if (c->max_prompt_bytes > 0 && src_len > (size_t)c->max_prompt_bytes) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", chat ? "messages" : "prompt",
                                      "context_length_exceeded",
                                      "This model's maximum context length is %d tokens. However, your %s is %zu "
                                      "bytes, more than %d tokens can hold (%lld bytes at most).",
                                      c->max_len, chat ? "chat" : "prompt", src_len, c->max_len,
                                      (long long)c->max_prompt_bytes);
        goto done;
    }
    /* 4. Tokens, and the answer. */
    if (kvf_text_tokenizer_encode(c->tok, src, src_len, add_special, &ids, &n, &err) != KVF_OK) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", chat ? "messages" : "prompt", NULL, "%s",
                                      err.msg);
        goto done;
    }
    st = tokens_json(c, ids, n, strs, out, e);
done:
    free(ids);
    free(text);
    json_decref(o);
    return st;
}

kvf_status kvf_router_detokenize_run(const kvf_router_reqs_cfg *c, const char *body, size_t len, kvf_sbuf *out,
                                     kvf_router_oai_error *e)
{
    json_t *o = NULL;
    kvf_status st = load_body(c, body, len, "detokenize", &o, e);
    if (st != KVF_OK)
        return st;
    if ((st = only_fields(o, detok_fields, "/detokenize", e)) != KVF_OK) {
        json_decref(o);
        return st;
    }
    const json_t *toks = json_object_get(o, "tokens");
    int32_t *ids = NULL;
    char *text = NULL;
    size_t n = json_array_size(toks), text_len = 0;
    int32_t vocab = kvf_text_tokenizer_vocab_size(c->tok);
    kvf_err err = {0};
    if (!toks) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "tokens", "missing_required_parameter",
                                      "'tokens' (an array of token ids) is required");
        goto done;
    }
    if (!json_is_array(toks)) {
        st = bad_type(e, "tokens", "an array of token ids", toks);
        goto done;
    }
    if (!(ids = malloc((n ? n : 1) * sizeof *ids))) {
        st = kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(toks, i);
        if (!json_is_integer(v)) {
            st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "tokens", "invalid_type",
                                          "'tokens'[%zu] must be an integer token id, got %s", i, kvf_json_kind(v));
            goto done;
        }
        json_int_t id = json_integer_value(v);
        if (id < 0 || id >= vocab) {
            st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "tokens", "invalid_value",
                                          "'tokens'[%zu] is token id %lld; this model's ids are 0 to %d", i,
                                          (long long)id, vocab - 1);
            goto done;
        }
        ids[i] = (int32_t)id;
    }
    if (kvf_text_tokenizer_decode(c->tok, ids, n, false, &text, &text_len, &err) != KVF_OK) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "tokens", "invalid_value", "%s", err.msg);
        goto done;
    }
    json_t *a = json_pack("{s:s%}", "prompt", text, text_len);
    char *s = a ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    st = s ? kvf_sbuf_puts(out, s) : KVF_ERR_NOMEM;
    free(s);
    if (st != KVF_OK)
        st = kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
done:
    free(text);
    free(ids);
    json_decref(o);
    return st;
}

const kvf_router_prep_job kvf_router_tokenize_job = {.name = "tokenize", .run = kvf_router_tokenize_run};
const kvf_router_prep_job kvf_router_detokenize_job = {.name = "detokenize", .run = kvf_router_detokenize_run};
