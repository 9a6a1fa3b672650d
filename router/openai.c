/* openai.c: OpenAI request parsing/validation and answer/chunk JSON for the router. Checks every
 * known field's type and range and answers as OpenAI does (400 with param naming the field);
 * what the model allows (context length, tokenizer) is checked by the caller. */
#include "router/openai.h"

#include "common/json.h"
#include "proto/worker.h"
#include "text/guide.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kvf_status kvf_router_oai_error_set(kvf_router_oai_error *e, int http_status, const char *type,
                                    const char *param, const char *code, const char *fmt, ...)
{
    if (!e)
        return KVF_ERR_INVALID;
    e->http_status = http_status;
    e->type = type;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return KVF_ERR_INVALID;
}

const char *kvf_router_oai_template_error(const char *msg, char *buf, size_t cap)
{
    const char *p = strncmp(msg, "chat template (", 15) == 0 ? strstr(msg, "): ") : NULL;
    if (!p)
        return msg;
    snprintf(buf, cap, "chat template: %s", p + 3);
    return buf;
}

kvf_status kvf_router_oai_error_json(const kvf_router_oai_error *e, kvf_sbuf *out)
{
    json_t *err = json_object();
    json_object_set_new(err, "message", json_string(e->message));
    json_object_set_new(err, "type", json_string(e->type ? e->type : "invalid_request_error"));
    json_object_set_new(err, "param", e->param[0] ? json_string(e->param) : json_null());
    json_object_set_new(err, "code", e->code[0] ? json_string(e->code) : json_null());
    json_t *root = json_object();
    json_object_set_new(root, "error", err);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!s)
        return KVF_ERR_NOMEM;
    kvf_status st = kvf_sbuf_puts(out, s);
    free(s);
    return st;
}

void kvf_router_oai_req_fini(kvf_router_oai_req *req)
{
    if (!req)
        return;
    free(req->model);
    free(req->prompt_text);
    free(req->prompt_ids);
    json_decref(req->messages);
    json_decref(req->chat_extra);
    for (size_t i = 0; i < req->n_stop; i++)
        free(req->stop[i]);
    free(req->cache_salt);
    free(req->bias_ids);
    free(req->bias_vals);
    json_decref(req->tools);
    free(req->guide);
    free(req->tool_forced);
    memset(req, 0, sizeof *req);
}

static kvf_status bad_type(kvf_router_oai_error *e, const char *field, const char *want,
                           const json_t *v)
{
    return kvf_router_oai_error_set(e, 400, "invalid_request_error", field, "invalid_type",
                                    "'%s' must be %s, got %s", field, want, kvf_json_kind(v));
}

/* Reads an optional number field within [lo, hi]. */
static kvf_status opt_num(const json_t *o, const char *key, double lo, double hi, double *out,
                          kvf_router_oai_error *e)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v))
        return KVF_OK;
    if (!json_is_number(v))
        return bad_type(e, key, "a number", v);
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", key, "invalid_value",
                                        "'%s' is %g; allowed: %g to %g", key, d, lo, hi);
    *out = d;
    return KVF_OK;
}

static kvf_status opt_int(const json_t *o, const char *key, int64_t lo, int64_t hi,
                          int64_t *out, bool *set, kvf_router_oai_error *e)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v))
        return KVF_OK;
    if (!json_is_integer(v))
        return bad_type(e, key, "an integer", v);
    int64_t x = (int64_t)json_integer_value(v);
    if (x < lo || x > hi)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", key, "invalid_value",
                                        "'%s' is %lld; allowed: %lld to %lld", key,
                                        (long long)x, (long long)lo, (long long)hi);
    *out = x;
    if (set)
        *set = true;
    return KVF_OK;
}

static kvf_status opt_bool(const json_t *o, const char *key, bool *out, kvf_router_oai_error *e)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v))
        return KVF_OK;
    if (!json_is_boolean(v))
        return bad_type(e, key, "a boolean", v);
    *out = json_is_true(v);
    return KVF_OK;
}

static kvf_status parse_prompt(const json_t *p, kvf_router_oai_req *r, kvf_router_oai_error *e);

/* A list of prompts (strings or token id lists): each is checked, the one at `index` kept. */
static kvf_status parse_prompt_list(const json_t *p, size_t index, kvf_router_oai_req *r,
                                    kvf_router_oai_error *e)
{
    size_t n = json_array_size(p);
    if (n > KVF_ROUTER_OAI_MAX_PROMPTS)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                        "'prompt' holds %zu prompts; at most %d are allowed in one request",
                                        n, KVF_ROUTER_OAI_MAX_PROMPTS);
    if (index >= n)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                        "'prompt' has no prompt %zu", index);
    for (size_t i = 0; i < n; i++) {
        const json_t *x = json_array_get(p, i);
        if (!json_is_string(x) && !json_is_array(x))
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_type",
                                            "'prompt'[%zu] is %s; a list of prompts holds strings or "
                                            "arrays of token ids", i, kvf_json_kind(x));
        if (json_is_array(x)) {
            if (!json_array_size(x))
                return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                                "'prompt'[%zu] is empty; give at least one token id", i);
            size_t k;
            const json_t *v;
            json_array_foreach(x, k, v)
                if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
                    return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                                    "'prompt'[%zu][%zu] is not a token id (an integer from 0 to %d)",
                                                    i, k, INT32_MAX);
        }
    }
    r->n_prompts = (int32_t)n;
    r->prompt_index = (int32_t)index;
    return parse_prompt(json_array_get(p, index), r, e);
}

static kvf_status parse_prompt(const json_t *p, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    if (!p || json_is_null(p))
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "missing_required_parameter",
                                        "'prompt' is required (text, or an array of token ids)");
    if (json_is_string(p)) {
        r->prompt_text = strdup(json_string_value(p));
        return r->prompt_text ? KVF_OK : KVF_ERR_NOMEM;
    }
    if (!json_is_array(p))
        return bad_type(e, "prompt", "a string or an array of token ids", p);
    size_t n = json_array_size(p);
    if (n == 0)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                        "'prompt' is empty; give text or at least one token id");
    const json_t *first = json_array_get(p, 0);
    if ((json_is_string(first) || json_is_array(first)) && r->n_prompts == 0)
        return parse_prompt_list(p, (size_t)r->prompt_index, r, e);
    if (json_is_string(first) || json_is_array(first))
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_type",
                                        "'prompt' nests lists too deeply");
    r->prompt_ids = malloc(n * sizeof *r->prompt_ids);
    if (!r->prompt_ids)
        return KVF_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(p, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            free(r->prompt_ids);
            r->prompt_ids = NULL;
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                                            "'prompt'[%zu] is %s; token ids are integers from 0 to %d",
                                            i, json_is_integer(v) ? "out of range" : kvf_json_kind(v), INT32_MAX);
        }
        r->prompt_ids[i] = (int32_t)json_integer_value(v);
    }
    r->n_prompt_ids = n;
    return KVF_OK;
}

/* ---- chat messages as the template takes them; tools and tool_choice ----------------------- */

static kvf_status missing(kvf_router_oai_error *e, const char *param)
{
    return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "missing_required_parameter",
                                    "'%s' is required", param);
}

/* Message i's content as one string (vLLM's "string" content format): a string as it is, null
 * or absent as "", an array of text parts joined by "\n"; other part types are refused. */
static kvf_status content_string(size_t i, const json_t *c, json_t **out, kvf_router_oai_error *e)
{
    char param[96];
    if (!c || json_is_null(c) || json_is_string(c)) {
        *out = c && json_is_string(c) ? json_incref((json_t *)c) : json_string("");
        return *out ? KVF_OK : KVF_ERR_NOMEM;
    }
    snprintf(param, sizeof param, "messages.[%zu].content", i);
    if (!json_is_array(c))
        return bad_type(e, param, "a string or an array of content parts", c);
    kvf_sbuf b;
    kvf_sbuf_init(&b);
    size_t j;
    const json_t *part;
    json_array_foreach(c, j, part) {
        const json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        kvf_status st = KVF_OK;
        if (!json_is_object(part)) {
            snprintf(param, sizeof param, "messages.[%zu].content.[%zu]", i, j);
            st = bad_type(e, param, "a content part object", part);
        } else if (!json_is_string(type)) {
            snprintf(param, sizeof param, "messages.[%zu].content.[%zu].type", i, j);
            st = type ? bad_type(e, param, "a string", type) : missing(e, param);
        } else if (strcmp(json_string_value(type), "text") != 0) {
            snprintf(param, sizeof param, "messages.[%zu].content.[%zu].type", i, j);
            st = kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "unsupported_content_type",
                                          "content part type '%.40s' is not supported by this server (only 'text'; "
                                          "the model takes no images, audio, video or files)", json_string_value(type));
        } else if (!json_is_string(text)) {
            snprintf(param, sizeof param, "messages.[%zu].content.[%zu].text", i, j);
            st = text ? bad_type(e, param, "a string", text) : missing(e, param);
        }
        if (st != KVF_OK) {
            kvf_sbuf_fini(&b);
            return st;
        }
        if (j)
            kvf_sbuf_putc(&b, '\n');
        kvf_sbuf_append(&b, json_string_value(text), json_string_length(text));
    }
    *out = b.oom ? NULL : json_stringn_nocheck(b.data ? b.data : "", b.len);
    kvf_sbuf_fini(&b);
    return *out ? KVF_OK : KVF_ERR_NOMEM;
}

/* An assistant message's tool_calls, checked; each function.arguments (a JSON string) becomes
 * the value it holds, as HF templates expect (`arguments | tojson`) and vLLM passes them. */
static kvf_status tool_calls_decoded(size_t i, json_t *calls, kvf_router_oai_error *e)
{
    char param[96];
    snprintf(param, sizeof param, "messages.[%zu].tool_calls", i);
    if (!json_is_array(calls))
        return bad_type(e, param, "an array", calls);
    size_t k;
    json_t *tc;
    json_array_foreach(calls, k, tc) {
        snprintf(param, sizeof param, "messages.[%zu].tool_calls.[%zu]", i, k);
        if (!json_is_object(tc))
            return bad_type(e, param, "an object", tc);
        const json_t *type = json_object_get(tc, "type"), *id = json_object_get(tc, "id");
        json_t *fn = json_object_get(tc, "function");
        snprintf(param, sizeof param, "messages.[%zu].tool_calls.[%zu].type", i, k);
        if (type && !(json_is_string(type) && strcmp(json_string_value(type), "function") == 0))
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_value",
                                            "'%s' must be \"function\"", param);
        snprintf(param, sizeof param, "messages.[%zu].tool_calls.[%zu].id", i, k);
        if (id && !json_is_null(id) && !json_is_string(id))
            return bad_type(e, param, "a string", id);
        snprintf(param, sizeof param, "messages.[%zu].tool_calls.[%zu].function", i, k);
        if (!json_is_object(fn))
            return fn ? bad_type(e, param, "an object", fn) : missing(e, param);
        const json_t *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
        snprintf(param, sizeof param, "messages.[%zu].tool_calls.[%zu].function.name", i, k);
        if (!json_is_string(name))
            return name ? bad_type(e, param, "a string", name) : missing(e, param);
        snprintf(param, sizeof param, "messages.[%zu].tool_calls.[%zu].function.arguments", i, k);
        if (!json_is_string(args))
            return args ? bad_type(e, param, "a string of JSON", args) : missing(e, param);
        json_error_t je;
        json_t *v = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, &je);
        if (!v)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_value",
                                            "'%s' is not valid JSON: %s (column %d)", param, je.text, je.column);
        json_object_set_new(fn, "arguments", v);
    }
    return KVF_OK;
}

/* r->messages: a copy of m as the chat template takes it (see openai.h). */
static kvf_status normalize_messages(const json_t *m, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    json_t *out = json_array();
    kvf_status st = out ? KVF_OK : KVF_ERR_NOMEM;
    size_t i;
    const json_t *msg;
    json_array_foreach(m, i, msg) {
        json_t *copy = json_deep_copy(msg), *content = NULL;
        if (!copy || json_array_append_new(out, copy) != 0) {
            st = KVF_ERR_NOMEM;
            break;
        }
        if ((st = content_string(i, json_object_get(msg, "content"), &content, e)) != KVF_OK)
            break;
        json_object_set_new(copy, "content", content);
        const char *role = json_string_value(json_object_get(msg, "role"));
        json_t *calls = json_object_get(copy, "tool_calls");
        if (calls && json_is_null(calls))
            json_object_del(copy, "tool_calls");
        else if (calls && strcmp(role, "assistant") == 0 && (st = tool_calls_decoded(i, calls, e)) != KVF_OK)
            break;
        const json_t *tcid = json_object_get(msg, "tool_call_id");
        char param[64];
        snprintf(param, sizeof param, "messages.[%zu].tool_call_id", i);
        if (strcmp(role, "tool") == 0 && !json_is_string(tcid)) {
            st = tcid && !json_is_null(tcid) ? bad_type(e, param, "a string", tcid) : missing(e, param);
            break;
        }
    }
    if (st != KVF_OK) {
        json_decref(out);
        return st;
    }
    r->messages = out;
    return KVF_OK;
}

/* A function name as OpenAI allows it: [a-zA-Z0-9_-]{1,64}. */
static bool function_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n < 1 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

static kvf_status check_tool(size_t i, const json_t *t, kvf_router_oai_error *e)
{
    char param[64];
    snprintf(param, sizeof param, "tools.[%zu]", i);
    if (!json_is_object(t))
        return bad_type(e, param, "an object", t);
    const json_t *type = json_object_get(t, "type"), *fn = json_object_get(t, "function");
    snprintf(param, sizeof param, "tools.[%zu].type", i);
    if (!json_is_string(type))
        return type ? bad_type(e, param, "a string", type) : missing(e, param);
    if (strcmp(json_string_value(type), "function") != 0)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_value",
                                        "tool type '%.40s' is not supported (only \"function\")", json_string_value(type));
    snprintf(param, sizeof param, "tools.[%zu].function", i);
    if (!json_is_object(fn))
        return fn ? bad_type(e, param, "an object", fn) : missing(e, param);
    const json_t *name = json_object_get(fn, "name"), *desc = json_object_get(fn, "description"),
                 *params = json_object_get(fn, "parameters"), *strict = json_object_get(fn, "strict");
    snprintf(param, sizeof param, "tools.[%zu].function.name", i);
    if (!json_is_string(name))
        return name ? bad_type(e, param, "a string", name) : missing(e, param);
    if (!function_name_ok(json_string_value(name)))
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_value",
                                        "'%s' is '%.80s'; allowed: 1 to 64 of a-z, A-Z, 0-9, _ and -", param,
                                        json_string_value(name));
    snprintf(param, sizeof param, "tools.[%zu].function.description", i);
    if (desc && !json_is_null(desc) && !json_is_string(desc))
        return bad_type(e, param, "a string", desc);
    snprintf(param, sizeof param, "tools.[%zu].function.parameters", i);
    if (params && !json_is_null(params) && !json_is_object(params))
        return bad_type(e, param, "an object (a JSON Schema)", params);
    snprintf(param, sizeof param, "tools.[%zu].function.strict", i);
    if (strict && !json_is_null(strict) && !json_is_boolean(strict))
        return bad_type(e, param, "a boolean", strict);
    return KVF_OK;
}

/* ---- structured output: response_format, vLLM's guided_*, tool_choice forcing a tool ------- */

/* Makes text (malloc'd; NULL for json_object) r's guide, from field param. A second guide is
 * refused by name: each would constrain the same output. */
static kvf_status set_guide(kvf_router_oai_req *r, const char *param, int32_t kind, char *text,
                            kvf_router_oai_error *e)
{
    if (r->guide_kind != KVF_TEXT_GUIDE_NONE) {
        free(text);
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_value",
                                        "'%s' and '%s' both constrain the output; give one of them", r->guide_param,
                                        param);
    }
    r->guide_kind = kind;
    r->guide = text;
    r->guide_len = text ? strlen(text) : 0;
    snprintf(r->guide_param, sizeof r->guide_param, "%s", param);
    return KVF_OK;
}

static char *dump_compact(const json_t *v)
{
    return json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
}

/* A JSON Schema given as an object, or (guided_json) as JSON text. */
static kvf_status guide_schema(kvf_router_oai_req *r, const char *param, const json_t *v,
                               bool text_ok, kvf_router_oai_error *e)
{
    json_t *parsed = NULL;
    if (text_ok && json_is_string(v)) {
        json_error_t je;
        if (!(parsed = json_loadb(json_string_value(v), json_string_length(v), JSON_REJECT_DUPLICATES, &je)))
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_value",
                                            "'%s' is not valid JSON: %s", param, je.text);
        v = parsed;
    }
    if (!json_is_object(v) && !json_is_boolean(v)) {
        kvf_status st = bad_type(e, param, "an object (a JSON Schema)", v);
        json_decref(parsed);
        return st;
    }
    char *text = dump_compact(v);
    json_decref(parsed);
    if (!text)
        return KVF_ERR_NOMEM;
    return set_guide(r, param, KVF_TEXT_GUIDE_JSON_SCHEMA, text, e);
}

static kvf_status guide_regex(kvf_router_oai_req *r, const char *param, const json_t *v,
                              kvf_router_oai_error *e)
{
    if (!json_is_string(v))
        return bad_type(e, param, "a string (a regular expression)", v);
    char *text = strdup(json_string_value(v));
    if (!text)
        return KVF_ERR_NOMEM;
    return set_guide(r, param, KVF_TEXT_GUIDE_REGEX, text, e);
}

static kvf_status guide_choice(kvf_router_oai_req *r, const char *param, const json_t *v,
                               kvf_router_oai_error *e)
{
    if (!json_is_array(v) || json_array_size(v) == 0)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_value",
                                        "'%s' must be a non-empty list of strings", param);
    size_t i;
    const json_t *c;
    json_array_foreach(v, i, c)
        if (!json_is_string(c))
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_type",
                                            "'%s'[%zu] must be a string, got %s", param, i, kvf_json_kind(c));
    char *text = dump_compact(v);
    if (!text)
        return KVF_ERR_NOMEM;
    return set_guide(r, param, KVF_TEXT_GUIDE_CHOICE, text, e);
}

static kvf_status parse_response_format(const json_t *rf, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    if (!json_is_object(rf))
        return bad_type(e, "response_format", "an object", rf);
    const json_t *t = json_object_get(rf, "type");
    if (!json_is_string(t))
        return t ? bad_type(e, "response_format.type", "a string", t) : missing(e, "response_format.type");
    const char *ts = json_string_value(t);
    if (strcmp(ts, "text") == 0)
        return KVF_OK;
    if (strcmp(ts, "json_object") == 0)
        return set_guide(r, "response_format", KVF_TEXT_GUIDE_JSON_OBJECT, NULL, e);
    if (strcmp(ts, "json_schema") != 0)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "response_format.type", "invalid_value",
                                        "response_format type '%.40s' is not one of \"text\", \"json_object\" and "
                                        "\"json_schema\"", ts);
    const json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js))
        return js ? bad_type(e, "response_format.json_schema", "an object", js)
                  : missing(e, "response_format.json_schema");
    const json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict"),
                 *schema = json_object_get(js, "schema");
    if (name && !json_is_null(name) && !json_is_string(name))
        return bad_type(e, "response_format.json_schema.name", "a string", name);
    if (strict && !json_is_null(strict) && !json_is_boolean(strict))
        return bad_type(e, "response_format.json_schema.strict", "a boolean", strict);
    if (!schema || json_is_null(schema))
        return missing(e, "response_format.json_schema.schema");
    return guide_schema(r, "response_format.json_schema.schema", schema, false, e);
}

/* response_format, guided_json / guided_regex / guided_choice (vLLM's extras), and vLLM's newer
 * structured_outputs object holding the same as json / regex / choice / json_object. */
static kvf_status parse_guides(const json_t *o, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    kvf_status st = KVF_OK;
    const json_t *v;
    if ((v = json_object_get(o, "response_format")) && !json_is_null(v) &&
        (st = parse_response_format(v, r, e)) != KVF_OK)
        return st;
    if ((v = json_object_get(o, "guided_json")) && !json_is_null(v) &&
        (st = guide_schema(r, "guided_json", v, true, e)) != KVF_OK)
        return st;
    if ((v = json_object_get(o, "guided_regex")) && !json_is_null(v) &&
        (st = guide_regex(r, "guided_regex", v, e)) != KVF_OK)
        return st;
    if ((v = json_object_get(o, "guided_choice")) && !json_is_null(v) &&
        (st = guide_choice(r, "guided_choice", v, e)) != KVF_OK)
        return st;
    if ((v = json_object_get(o, "guided_decoding_backend")) && !json_is_null(v) && !json_is_string(v))
        return bad_type(e, "guided_decoding_backend", "a string", v);
    const json_t *so = json_object_get(o, "structured_outputs");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return bad_type(e, "structured_outputs", "an object", so);
        const char *k;
        json_object_foreach((json_t *)so, k, v) {
            if (json_is_null(v))
                continue;
            char param[48];
            snprintf(param, sizeof param, "structured_outputs.%.24s", k);
            if (strcmp(k, "json") == 0)
                st = guide_schema(r, param, v, true, e);
            else if (strcmp(k, "regex") == 0)
                st = guide_regex(r, param, v, e);
            else if (strcmp(k, "choice") == 0)
                st = guide_choice(r, param, v, e);
            else if (strcmp(k, "json_object") == 0)
                st = !json_is_boolean(v) ? bad_type(e, param, "a boolean", v)
                     : json_is_true(v)   ? set_guide(r, param, KVF_TEXT_GUIDE_JSON_OBJECT, NULL, e)
                                         : KVF_OK;
            else
                st = kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "unsupported_parameter",
                                              "'%s' is not supported (json, regex, choice and json_object are)", param);
            if (st != KVF_OK)
                return st;
        }
    }
    return KVF_OK;
}

/* The guide compiles, or the request is a 400 naming the field and what the compiler found. */
static kvf_status check_guide(const kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    if (r->guide_kind == KVF_TEXT_GUIDE_NONE)
        return KVF_OK;
    if (r->guide_len > KVF_RPC_MAX_GUIDE_BYTES)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", r->guide_param, "invalid_value",
                                        "%s is %zu bytes as JSON; at most %d are allowed", r->guide_param,
                                        r->guide_len, KVF_RPC_MAX_GUIDE_BYTES);
    kvf_text_grammar *g = NULL;
    kvf_err err = {0};
    kvf_status st = kvf_text_guide_compile(r->guide_kind, r->guide, r->guide_len, &g, &err);
    kvf_text_grammar_destroy(g);
    if (st == KVF_ERR_NOMEM)
        return st;
    if (st != KVF_OK)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", r->guide_param, "invalid_value",
                                        "%s: %s", r->guide_param, err.msg);
    return KVF_OK;
}

/* tool_choice {"type": "function", "function": {"name": N}}: N must be one of tools. */
static kvf_status named_tool(const json_t *choice, const json_t *tools, kvf_router_oai_req *r,
                             kvf_router_oai_error *e)
{
    const json_t *type = json_object_get(choice, "type"), *fn = json_object_get(choice, "function");
    const json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
    if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0 || !json_is_string(name))
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "tool_choice", "invalid_value",
                                        "a named 'tool_choice' is "
                                        "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t) {
        const json_t *tn = json_object_get(json_object_get(t, "function"), "name");
        if (json_is_string(tn) && strcmp(json_string_value(tn), json_string_value(name)) == 0) {
            if (!(r->tool_forced = strdup(json_string_value(name))))
                return KVF_ERR_NOMEM;
            return KVF_OK;
        }
    }
    return kvf_router_oai_error_set(e, 400, "invalid_request_error", "tool_choice", "invalid_value",
                                    "tool_choice names function '%.64s', which is not in 'tools'",
                                    json_string_value(name));
}

/* A tool's parameters schema; a tool without one takes any object. */
static json_t *tool_params(const json_t *t)
{
    const json_t *p = json_object_get(json_object_get(t, "function"), "parameters");
    return json_is_object(p) ? json_incref((json_t *)p) : json_pack("{s:s}", "type", "object");
}

/* The guide of a forced tool choice, as vLLM builds it: a named function's output is its
 * arguments (its parameters schema); "required" outputs a JSON list of one or more
 * {"name", "parameters"} objects, one of the tools each (one at most without parallel calls). */
static kvf_status force_tools(kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    json_t *schema = NULL;
    if (r->tool_forced) {
        size_t i;
        const json_t *t;
        json_array_foreach(r->tools, i, t) {
            const json_t *tn = json_object_get(json_object_get(t, "function"), "name");
            if (json_is_string(tn) && strcmp(json_string_value(tn), r->tool_forced) == 0) {
                schema = tool_params(t);
                break;
            }
        }
    } else {
        json_t *any = json_array();
        size_t i;
        const json_t *t;
        json_array_foreach(r->tools, i, t) {
            const json_t *tn = json_object_get(json_object_get(t, "function"), "name");
            json_array_append_new(any, json_pack("{s:s, s:{s:{s:O}, s:o}, s:[s,s], s:b}", "type", "object",
                                                 "properties", "name", "const", tn, "parameters", tool_params(t),
                                                 "required", "name", "parameters", "additionalProperties", 0));
        }
        schema = json_pack("{s:s, s:i, s:{s:o}}", "type", "array", "minItems", 1, "items", "anyOf", any);
        if (schema && !r->parallel_tool_calls)
            json_object_set_new(schema, "maxItems", json_integer(1));
    }
    char *text = schema ? dump_compact(schema) : NULL;
    json_decref(schema);
    if (!text)
        return KVF_ERR_NOMEM;
    return set_guide(r, "tool_choice", KVF_TEXT_GUIDE_JSON_SCHEMA, text, e);
}

/* tools, tool_choice and parallel_tool_calls of a chat request (vLLM's rules: tool_choice other
 * than "none" needs tools; "required" and a named function force a guide, force_tools). */
static kvf_status parse_tools(const json_t *o, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    const json_t *tools = json_object_get(o, "tools"), *choice = json_object_get(o, "tool_choice");
    static const char *const legacy[] = {"functions", "function_call"};
    for (size_t i = 0; i < 2; i++) {
        const json_t *v = json_object_get(o, legacy[i]);
        if (v && !json_is_null(v))
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", legacy[i], "unsupported_parameter",
                                            "'%s' (deprecated by OpenAI) is not supported; use 'tools' and 'tool_choice'",
                                            legacy[i]);
    }
    kvf_status st = opt_bool(o, "parallel_tool_calls", &r->parallel_tool_calls, e);
    if (st != KVF_OK)
        return st;
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools))
            return bad_type(e, "tools", "an array", tools);
        size_t i;
        const json_t *t;
        json_array_foreach(tools, i, t) {
            if ((st = check_tool(i, t, e)) != KVF_OK)
                return st;
            const char *name = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
            for (size_t k = 0; k < i; k++)
                if (strcmp(name, json_string_value(json_object_get(
                                     json_object_get(json_array_get(tools, k), "function"), "name"))) == 0) {
                    char param[64];
                    snprintf(param, sizeof param, "tools.[%zu].function.name", i);
                    return kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "invalid_value",
                                                    "two tools are named '%s'", name);
                }
        }
    } else {
        tools = NULL;
    }
    if (choice && !json_is_null(choice)) {
        if (json_is_string(choice) && strcmp(json_string_value(choice), "none") == 0) {
            r->tool_choice_none = true;
        } else if (!tools) {
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "tool_choice", "invalid_value",
                                            "'tool_choice' other than \"none\" needs 'tools'");
        } else if (json_is_string(choice) && strcmp(json_string_value(choice), "required") == 0) {
            r->tool_required = true;
        } else if (json_is_object(choice)) {
            if ((st = named_tool(choice, tools, r, e)) != KVF_OK)
                return st;
        } else if (!json_is_string(choice) || strcmp(json_string_value(choice), "auto") != 0) {
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "tool_choice", "invalid_value",
                                            "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                                            "{\"type\": \"function\", \"function\": {\"name\": ...}}");
        }
    }
    r->tools = tools ? json_incref((json_t *)tools) : NULL;
    if (r->tool_required || r->tool_forced)
        return force_tools(r, e);
    return KVF_OK;
}

static kvf_status parse_messages(const json_t *m, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    if (!m || json_is_null(m))
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", "missing_required_parameter",
                                        "'messages' is required");
    if (!json_is_array(m))
        return bad_type(e, "messages", "an array", m);
    if (json_array_size(m) == 0)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "messages", "invalid_value",
                                        "'messages' is empty; give at least one message");
    size_t i;
    json_t *msg;
    json_array_foreach(m, i, msg) {
        char param[48];
        snprintf(param, sizeof param, "messages.[%zu]", i);
        if (!json_is_object(msg))
            return bad_type(e, param, "an object", msg);
        const json_t *role = json_object_get(msg, "role");
        if (!json_is_string(role)) {
            snprintf(param, sizeof param, "messages.[%zu].role", i);
            return role ? bad_type(e, param, "a string", role)
                        : kvf_router_oai_error_set(e, 400, "invalid_request_error", param, "missing_required_parameter",
                                                   "'%s' is required", param);
        }
    }
    return normalize_messages(m, r, e);
}

static kvf_status parse_stop(const json_t *s, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    if (!s || json_is_null(s))
        return KVF_OK;
    if (json_is_string(s)) {
        if (!json_string_length(s))
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "stop", "invalid_value",
                                            "'stop' strings must not be empty");
        r->stop[0] = strdup(json_string_value(s));
        if (!r->stop[0])
            return KVF_ERR_NOMEM;
        r->n_stop = 1;
        return KVF_OK;
    }
    if (!json_is_array(s))
        return bad_type(e, "stop", "a string or an array of strings", s);
    if (json_array_size(s) > KVF_ROUTER_OAI_MAX_STOP)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "stop", "invalid_value",
                                        "'stop' has %zu strings; at most %d are allowed",
                                        json_array_size(s), KVF_ROUTER_OAI_MAX_STOP);
    size_t i;
    json_t *v;
    json_array_foreach(s, i, v) {
        if (!json_is_string(v) || !json_string_length(v))
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "stop", "invalid_value",
                                            "'stop'[%zu] is %s; stop entries are non-empty strings", i,
                                            json_is_string(v) ? "empty" : kvf_json_kind(v));
        if (!(r->stop[r->n_stop] = strdup(json_string_value(v))))
            return KVF_ERR_NOMEM;
        r->n_stop++;
    }
    return KVF_OK;
}

/* logit_bias: {"token id": bias, ...}, bias in [-100, 100]. */
static kvf_status parse_bias(const json_t *b, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    if (!b || json_is_null(b))
        return KVF_OK;
    if (!json_is_object(b))
        return bad_type(e, "logit_bias", "an object of token ids to biases", b);
    size_t n = json_object_size(b);
    if (n > KVF_ROUTER_OAI_MAX_BIAS)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "logit_bias", "invalid_value",
                                        "'logit_bias' has %zu entries; at most %d are allowed", n,
                                        KVF_ROUTER_OAI_MAX_BIAS);
    if (!n)
        return KVF_OK;
    if (!(r->bias_ids = malloc(n * sizeof *r->bias_ids)) || !(r->bias_vals = malloc(n * sizeof *r->bias_vals)))
        return KVF_ERR_NOMEM;
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)b, k, v) {
        char *end = NULL;
        long id = strtol(k, &end, 10);
        if (!*k || *end || id < 0 || id > INT32_MAX || (k[0] == '0' && k[1]) || k[0] == '+' || k[0] == ' ')
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "logit_bias", "invalid_value",
                                            "'logit_bias' key \"%.40s\" is not a token id (a non-negative integer)", k);
        if (!json_is_number(v) || !(json_number_value(v) >= -100 && json_number_value(v) <= 100))
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "logit_bias", "invalid_value",
                                            "'logit_bias'[\"%s\"] must be a number from -100 to 100", k);
        r->bias_ids[r->n_bias] = (int32_t)id;
        r->bias_vals[r->n_bias++] = (float)json_number_value(v);
    }
    return KVF_OK;
}

static kvf_status parse_stop_ids(const json_t *a, kvf_router_oai_req *r, kvf_router_oai_error *e)
{
    if (!a || json_is_null(a))
        return KVF_OK;
    if (!json_is_array(a))
        return bad_type(e, "stop_token_ids", "an array of token ids", a);
    if (json_array_size(a) > KVF_ROUTER_OAI_MAX_STOP_IDS)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "stop_token_ids", "invalid_value",
                                        "'stop_token_ids' has %zu ids; at most %d are allowed",
                                        json_array_size(a), KVF_ROUTER_OAI_MAX_STOP_IDS);
    size_t i;
    const json_t *v;
    json_array_foreach(a, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
            return kvf_router_oai_error_set(e, 400, "invalid_request_error", "stop_token_ids", "invalid_value",
                                            "'stop_token_ids'[%zu] is not a token id (a non-negative integer)", i);
        r->stop_ids[r->n_stop_ids++] = (int32_t)json_integer_value(v);
    }
    return KVF_OK;
}

/* logprobs: completions take an integer (the top count, 0..20: the chosen token's always);
 * chat takes a boolean and top_logprobs. */
static kvf_status parse_logprobs(kvf_router_oai_kind kind, const json_t *o, kvf_router_oai_req *r,
                                 kvf_router_oai_error *e)
{
    const json_t *lp = json_object_get(o, "logprobs");
    int64_t top = 0;
    bool top_set = false;
    if (kind == KVF_ROUTER_OAI_COMPLETIONS) {
        if (!lp || json_is_null(lp) || json_is_false(lp))
            return KVF_OK;
        kvf_status st = opt_int(o, "logprobs", 0, KVF_ROUTER_OAI_MAX_LOGPROBS, &top, NULL, e);
        if (st != KVF_OK)
            return st;
        r->logprobs = true;
        r->top_logprobs = (int32_t)top;
        return KVF_OK;
    }
    kvf_status st = opt_bool(o, "logprobs", &r->logprobs, e);
    if (st == KVF_OK)
        st = opt_int(o, "top_logprobs", 0, KVF_ROUTER_OAI_MAX_LOGPROBS, &top, &top_set, e);
    if (st != KVF_OK)
        return st;
    if (top_set && !r->logprobs)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", "top_logprobs", "invalid_value",
                                        "'top_logprobs' needs 'logprobs' set to true");
    r->top_logprobs = (int32_t)top;
    return KVF_OK;
}

/* Every field a request may carry: honoured, or (harmless, documented in router/README.md)
 * accepted without effect; anything else is refused, naming it, rather than ignored. */
static const char *const known_common[] = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "n", "stop", "ignore_eos", "skip_special_tokens", "cache_salt", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
    "stop_token_ids", "logprobs", "user", "metadata", "store", "service_tier", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_decoding_backend", "structured_outputs",
    NULL};
static const char *const known_completions[] = {"prompt", "echo", "best_of", NULL};
static const char *const known_chat[] = {
    "messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs", "tools",
    "tool_choice", "parallel_tool_calls", NULL};

static bool in_list(const char *const *l, const char *k)
{
    for (; *l; l++)
        if (strcmp(*l, k) == 0)
            return true;
    return false;
}

static kvf_status check_fields(kvf_router_oai_kind kind, const json_t *o, kvf_router_oai_error *e)
{
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)o, k, v) {
        if (in_list(known_common, k) ||
            in_list(kind == KVF_ROUTER_OAI_CHAT ? known_chat : known_completions, k))
            continue;
        const char *why = strcmp(k, "suffix") == 0 ? " (text insertion is not supported)"
                          : strcmp(k, "guided_grammar") == 0
                              ? " (EBNF grammars are not; use guided_json, guided_regex or guided_choice)"
                          : strncmp(k, "guided_", 7) == 0
                              ? " (guided_json, guided_regex and guided_choice are)"
                          : strcmp(k, "functions") == 0 || strcmp(k, "function_call") == 0
                              ? " (use 'tools' and 'tool_choice')"
                              : "";
        /* null and the neutral value of a few known-elsewhere fields ask for nothing */
        if (json_is_null(v) ||
            (strcmp(k, "suffix") == 0 && json_is_string(v) && !json_string_length(v)))
            continue;
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", k, "unsupported_parameter",
                                        "'%.48s' is not supported by this server%s", k, why);
    }
    return KVF_OK;
}

kvf_status kvf_router_oai_chat_inputs(const json_t *o, json_t **messages_out, json_t **tools_out,
                                      kvf_router_oai_error *e)
{
    kvf_router_oai_req r;
    memset(&r, 0, sizeof r);
    r.kind = KVF_ROUTER_OAI_CHAT;
    *messages_out = *tools_out = NULL;
    kvf_status st = parse_messages(json_object_get(o, "messages"), &r, e);
    if (st == KVF_OK)
        st = parse_tools(o, &r, e);
    if (st == KVF_OK) {
        *messages_out = r.messages;
        *tools_out = r.tools;
        r.messages = r.tools = NULL;
    }
    kvf_router_oai_req_fini(&r);
    if (st == KVF_ERR_NOMEM)
        kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return st;
}

kvf_status kvf_router_oai_parse(kvf_router_oai_kind kind, const char *body, size_t len,
                                kvf_router_oai_req *req, kvf_router_oai_error *e)
{
    return kvf_router_oai_parse_at(kind, body, len, 0, req, e);
}

kvf_status kvf_router_oai_parse_at(kvf_router_oai_kind kind, const char *body, size_t len,
                                   int32_t prompt_index, kvf_router_oai_req *req,
                                   kvf_router_oai_error *e)
{
    memset(req, 0, sizeof *req);
    req->prompt_index = prompt_index;
    req->kind = kind;
    req->temperature = 1.0;
    req->top_p = 1.0;
    req->n = 1;
    req->skip_special_tokens = true;
    req->repetition_penalty = 1.0;
    json_error_t jerr;
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (!o)
        return kvf_router_oai_error_set(e, 400, "invalid_request_error", NULL, "invalid_json",
                                        "the body is not valid JSON: %s (line %d, column %d)",
                                        jerr.text, jerr.line, jerr.column);
    kvf_status st = KVF_OK;
    if (!json_is_object(o)) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", NULL, "invalid_json",
                                      "the body must be a JSON object, got %s", kvf_json_kind(o));
        goto fail;
    }
    if ((st = check_fields(kind, o, e)) != KVF_OK)
        goto fail;
    const json_t *model = json_object_get(o, "model");
    if (!model || json_is_null(model)) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "model", "missing_required_parameter",
                                      "'model' is required (see GET /v1/models)");
        goto fail;
    }
    if (!json_is_string(model)) {
        st = bad_type(e, "model", "a string", model);
        goto fail;
    }
    if (!(req->model = strdup(json_string_value(model)))) {
        st = KVF_ERR_NOMEM;
        goto fail;
    }
    if (kind == KVF_ROUTER_OAI_COMPLETIONS)
        st = parse_prompt(json_object_get(o, "prompt"), req, e);
    else
        st = parse_messages(json_object_get(o, "messages"), req, e);
    if (req->n_prompts == 0) /* a lone prompt, or chat */
        req->n_prompts = 1;
    if (st != KVF_OK)
        goto fail;

    int64_t mt = 0, n = 1, topk = 0, seed = 0, min_tokens = 0, best_of = 0;
    bool set = false, mt_set = false;
    const char *mt_key = kind == KVF_ROUTER_OAI_CHAT && json_object_get(o, "max_completion_tokens")
                             ? "max_completion_tokens" : "max_tokens";
    if ((st = opt_int(o, mt_key, 1, INT32_MAX, &mt, &mt_set, e)) != KVF_OK ||
        (st = opt_num(o, "presence_penalty", -2, 2, &req->presence_penalty, e)) != KVF_OK ||
        (st = opt_num(o, "frequency_penalty", -2, 2, &req->frequency_penalty, e)) != KVF_OK ||
        (st = opt_num(o, "repetition_penalty", 0, 2, &req->repetition_penalty, e)) != KVF_OK ||
        (st = opt_num(o, "min_p", 0, 1, &req->min_p, e)) != KVF_OK ||
        (st = opt_int(o, "min_tokens", 0, mt_set ? mt : INT32_MAX, &min_tokens, NULL, e)) != KVF_OK ||
        (st = opt_int(o, "best_of", 1, KVF_ROUTER_OAI_MAX_N, &best_of, NULL, e)) != KVF_OK ||
        (st = opt_bool(o, "echo", &req->echo, e)) != KVF_OK ||
        (st = parse_bias(json_object_get(o, "logit_bias"), req, e)) != KVF_OK ||
        (st = parse_stop_ids(json_object_get(o, "stop_token_ids"), req, e)) != KVF_OK ||
        (st = parse_logprobs(kind, o, req, e)) != KVF_OK ||
        (st = opt_num(o, "temperature", 0, 2, &req->temperature, e)) != KVF_OK ||
        (st = opt_num(o, "top_p", 0, 1, &req->top_p, e)) != KVF_OK ||
        (st = opt_int(o, "top_k", -1, INT32_MAX, &topk, NULL, e)) != KVF_OK ||
        (st = opt_int(o, "seed", INT64_MIN, INT64_MAX, &seed, &req->has_seed, e)) != KVF_OK ||
        (st = opt_int(o, "n", 1, KVF_ROUTER_OAI_MAX_N, &n, &set, e)) != KVF_OK ||
        (st = opt_bool(o, "stream", &req->stream, e)) != KVF_OK ||
        (st = opt_bool(o, "ignore_eos", &req->ignore_eos, e)) != KVF_OK ||
        (st = opt_bool(o, "skip_special_tokens", &req->skip_special_tokens, e)) != KVF_OK ||
        (st = parse_stop(json_object_get(o, "stop"), req, e)) != KVF_OK)
        goto fail;
    if (req->top_p <= 0) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "top_p", "invalid_value",
                                      "'top_p' is 0; allowed: above 0, up to 1");
        goto fail;
    }
    if (req->repetition_penalty <= 0) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "repetition_penalty", "invalid_value",
                                      "'repetition_penalty' is 0; allowed: above 0, up to 2");
        goto fail;
    }
    if (best_of && best_of < n) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "best_of", "invalid_value",
                                      "'best_of' is %lld; it must be at least n (%lld)", (long long)best_of,
                                      (long long)n);
        goto fail;
    }
    if (best_of > n && req->stream) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "best_of", "invalid_value",
                                      "'best_of' above n is not allowed with 'stream'");
        goto fail;
    }
    req->min_tokens = (int32_t)min_tokens;
    req->best_of = (int32_t)best_of;
    req->max_tokens = (int32_t)mt;
    req->top_k = topk < 0 ? 0 : (int32_t)topk;
    req->seed = (uint64_t)seed;
    req->n = (int32_t)n;
    const json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) {
            st = bad_type(e, "stream_options", "an object", so);
            goto fail;
        }
        const json_t *iu = json_object_get(so, "include_usage");
        if (iu && !json_is_null(iu) && !json_is_boolean(iu)) {
            st = bad_type(e, "stream_options.include_usage", "a boolean", iu);
            goto fail;
        }
        req->include_usage = json_is_true(iu);
    }
    if (so && !json_is_null(so) && !req->stream) {
        st = kvf_router_oai_error_set(e, 400, "invalid_request_error", "stream_options", "invalid_value",
                                      "'stream_options' is only allowed when 'stream' is true");
        goto fail;
    }
    const json_t *salt = json_object_get(o, "cache_salt");
    if (salt && !json_is_null(salt)) {
        if (!json_is_string(salt)) {
            st = bad_type(e, "cache_salt", "a string", salt);
            goto fail;
        }
        if (!(req->cache_salt = strdup(json_string_value(salt)))) {
            st = KVF_ERR_NOMEM;
            goto fail;
        }
    }
    const json_t *kw = json_object_get(o, "chat_template_kwargs");
    if (kind == KVF_ROUTER_OAI_CHAT && kw && !json_is_null(kw)) {
        if (!json_is_object(kw)) {
            st = bad_type(e, "chat_template_kwargs", "an object", kw);
            goto fail;
        }
        req->chat_extra = json_incref((json_t *)kw);
    }
    req->parallel_tool_calls = true;
    if ((st = parse_guides(o, req, e)) != KVF_OK)
        goto fail;
    if (kind == KVF_ROUTER_OAI_CHAT && (st = parse_tools(o, req, e)) != KVF_OK)
        goto fail;
    if ((st = check_guide(req, e)) != KVF_OK)
        goto fail;
    json_decref(o);
    return KVF_OK;
fail:
    json_decref(o);
    kvf_router_oai_req_fini(req);
    if (st == KVF_ERR_NOMEM)
        kvf_router_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return st;
}

const char *kvf_router_oai_finish_str(kvf_router_oai_finish f)
{
    switch (f) {
    case KVF_ROUTER_OAI_FINISH_STOP: return "stop";
    case KVF_ROUTER_OAI_FINISH_LENGTH: return "length";
    case KVF_ROUTER_OAI_FINISH_ABORT: return "abort";
    case KVF_ROUTER_OAI_FINISH_TOOL_CALLS: return "tool_calls";
    default: return NULL;
    }
}

static json_t *ids_json(const int32_t *ids, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    return a;
}

static json_t *usage_json(const kvf_router_oai_usage *u)
{
    json_t *o = json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)u->prompt_tokens,
                          "completion_tokens", (json_int_t)u->completion_tokens, "total_tokens",
                          (json_int_t)(u->prompt_tokens + u->completion_tokens));
    json_object_set_new(o, "prompt_tokens_details",
                        json_pack("{s:I}", "cached_tokens", (json_int_t)u->cached_tokens));
    return o;
}

static json_t *finish_json(kvf_router_oai_finish f)
{
    const char *s = kvf_router_oai_finish_str(f);
    return s ? json_string(s) : json_null();
}

static json_t *text_json(const char *t, size_t n)
{
    return json_stringn_nocheck(t ? t : "", t ? n : 0);
}

static kvf_status dump(json_t *o, const char *pre, const char *post, kvf_sbuf *out)
{
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s)
        return KVF_ERR_NOMEM;
    kvf_sbuf_puts(out, pre);
    kvf_sbuf_puts(out, s);
    kvf_status st = kvf_sbuf_puts(out, post);
    free(s);
    return out->oom ? KVF_ERR_NOMEM : st;
}

static json_t *head(kvf_router_oai_kind kind, bool chunk, const char *id, const char *model,
                    int64_t created)
{
    const char *obj = kind == KVF_ROUTER_OAI_CHAT ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                                  : "text_completion";
    return json_pack("{s:s,s:s,s:I,s:s}", "id", id, "object", obj, "created", (json_int_t)created,
                     "model", model);
}

/* The fields every choice ends with (plain and streamed), then ch joins arr. */
static void choice_end(json_t *ch, const kvf_router_oai_choice *c, json_t *arr)
{
    json_object_set_new(ch, "token_ids", ids_json(c->token_ids, c->n_ids));
    json_object_set_new(ch, "logprobs", c->logprobs ? json_incref(c->logprobs) : json_null());
    json_object_set_new(ch, "finish_reason", finish_json(c->finish));
    json_array_append_new(arr, ch);
}

/* A choice's tool calls as OpenAI writes them (deltas carry their index). */
static json_t *tool_calls_json(const kvf_router_oai_choice *c, bool delta)
{
    json_t *a = json_array();
    for (size_t k = 0; k < c->n_tool_calls; k++) {
        json_t *tc = json_object();
        if (delta)
            json_object_set_new(tc, "index", json_integer((json_int_t)k));
        json_object_set_new(tc, "id", json_string(c->tool_call_ids[k]));
        json_object_set_new(tc, "type", json_string("function"));
        json_object_set_new(tc, "function", json_pack("{s:s,s:s}", "name", c->tool_calls[k].name,
                                                      "arguments", c->tool_calls[k].arguments));
        json_array_append_new(a, tc);
    }
    return a;
}

kvf_status kvf_router_oai_answer_json(kvf_router_oai_kind kind, const char *id,
                                      const char *model, int64_t created,
                                      const kvf_router_oai_choice *choices, size_t n_choices,
                                      const kvf_router_oai_usage *usage, kvf_sbuf *out)
{
    json_t *o = head(kind, false, id, model, created);
    json_t *arr = json_array();
    for (size_t i = 0; i < n_choices; i++) {
        const kvf_router_oai_choice *c = &choices[i];
        json_t *ch = json_pack("{s:i}", "index", c->index);
        if (kind == KVF_ROUTER_OAI_CHAT) {
            json_t *msg = json_pack("{s:s}", "role", "assistant");
            json_object_set_new(msg, "content", c->content_null ? json_null() : text_json(c->text, c->text_len));
            if (c->n_tool_calls)
                json_object_set_new(msg, "tool_calls", tool_calls_json(c, false));
            json_object_set_new(ch, "message", msg);
        } else {
            json_object_set_new(ch, "text", text_json(c->text, c->text_len));
        }
        choice_end(ch, c, arr);
    }
    json_object_set_new(o, "choices", arr);
    kvf_router_oai_usage zero = {0};
    json_object_set_new(o, "usage", usage_json(usage ? usage : &zero));
    return dump(o, "", "", out);
}

kvf_status kvf_router_oai_chunk_sse(kvf_router_oai_kind kind, const char *id, const char *model,
                                    int64_t created, const kvf_router_oai_choice *choices,
                                    size_t n_choices, const kvf_router_oai_usage *usage,
                                    bool null_usage, kvf_sbuf *out)
{
    json_t *o = head(kind, true, id, model, created);
    json_t *arr = json_array();
    for (size_t i = 0; i < n_choices; i++) {
        const kvf_router_oai_choice *c = &choices[i];
        json_t *ch = json_pack("{s:i}", "index", c->index);
        if (kind == KVF_ROUTER_OAI_CHAT) {
            json_t *delta = json_object();
            if (c->first_chunk)
                json_object_set_new(delta, "role", json_string("assistant"));
            if (c->text_len || c->first_chunk)
                json_object_set_new(delta, "content", c->content_null && !c->text_len ? json_null()
                                                      : text_json(c->text, c->text_len));
            if (c->n_tool_calls)
                json_object_set_new(delta, "tool_calls", tool_calls_json(c, true));
            json_object_set_new(ch, "delta", delta);
        } else {
            json_object_set_new(ch, "text", text_json(c->text, c->text_len));
        }
        choice_end(ch, c, arr);
    }
    json_object_set_new(o, "choices", arr);
    if (usage)
        json_object_set_new(o, "usage", usage_json(usage));
    else if (null_usage)
        json_object_set_new(o, "usage", json_null());
    return dump(o, "data: ", "\n\n", out);
}

int64_t kvf_router_oai_find_stop(const char *text, size_t len, size_t from,
                                 char *const *stop, size_t n_stop)
{
    int64_t best = -1;
    for (size_t k = 0; k < n_stop; k++) {
        size_t sl = strlen(stop[k]);
        if (!sl || sl > len)
            continue;
        for (size_t i = from; i + sl <= len; i++) {
            if (best >= 0 && (int64_t)i >= best)
                break;
            if (memcmp(text + i, stop[k], sl) == 0) {
                best = (int64_t)i;
                break;
            }
        }
    }
    return best;
}

/* The bytes as a JSON string, invalid UTF-8 as U+FFFD (one per byte that starts no character). */
static json_t *lossy_string(const uint8_t *b, size_t n)
{
    kvf_sbuf t;
    kvf_sbuf_init(&t);
    for (size_t i = 0; i < n;) {
        uint8_t c = b[i];
        size_t need = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3
                    : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        bool ok = need > 0 && i + need <= n;
        for (size_t k = 1; ok && k < need; k++)
            ok = (b[i + k] & 0xC0) == 0x80;
        if (ok && need == 3)
            ok = !(c == 0xE0 && b[i + 1] < 0xA0) && !(c == 0xED && b[i + 1] > 0x9F);
        if (ok && need == 4)
            ok = !(c == 0xF0 && b[i + 1] < 0x90) && !(c == 0xF4 && b[i + 1] > 0x8F);
        if (ok) {
            kvf_sbuf_append(&t, b + i, need);
            i += need;
        } else {
            kvf_sbuf_append(&t, "\xEF\xBF\xBD", 3);
            i++;
        }
    }
    json_t *j = json_stringn(t.data ? t.data : "", t.len);
    kvf_sbuf_fini(&t);
    return j ? j : json_string("");
}

static json_t *bytes_json(const uint8_t *b, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_integer(b[i]));
    return a;
}

/* A log-probability as JSON: NaN is null; -inf is the most negative float (JSON has no
 * infinity; vLLM writes -9999.0 in its place: a finite number keeps clients' parsers happy). */
static json_t *lp_json(float v)
{
    if (v != v)
        return json_null();
    return json_real(isinf(v) ? -9999.0 : (double)v);
}

kvf_status kvf_router_oai_lp_append(kvf_router_oai_kind kind, json_t **lp,
                                    const kvf_router_oai_lp *p, int64_t text_offset)
{
    if (!*lp) {
        *lp = kind == KVF_ROUTER_OAI_CHAT
                  ? json_pack("{s:[]}", "content")
                  : json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs",
                              "text_offset");
        if (!*lp)
            return KVF_ERR_NOMEM;
    }
    int32_t nt = p->n_top < 0 ? 0 : p->n_top > KVF_ROUTER_OAI_MAX_LOGPROBS ? KVF_ROUTER_OAI_MAX_LOGPROBS : p->n_top;
    if (kind == KVF_ROUTER_OAI_CHAT) {
        json_t *tops = json_array();
        for (int32_t k = 0; k < nt; k++) {
            json_t *t = json_object();
            json_object_set_new(t, "token", lossy_string(p->top_bytes[k], p->top_len[k]));
            json_object_set_new(t, "logprob", lp_json(p->top_lp[k]));
            json_object_set_new(t, "bytes", bytes_json(p->top_bytes[k], p->top_len[k]));
            json_array_append_new(tops, t);
        }
        json_t *x = json_object();
        json_object_set_new(x, "token", lossy_string(p->bytes, p->len));
        json_object_set_new(x, "logprob", lp_json(p->logprob));
        json_object_set_new(x, "bytes", bytes_json(p->bytes, p->len));
        json_object_set_new(x, "top_logprobs", tops);
        json_array_append_new(json_object_get(*lp, "content"), x);
        return KVF_OK;
    }
    json_array_append_new(json_object_get(*lp, "tokens"), lossy_string(p->bytes, p->len));
    json_array_append_new(json_object_get(*lp, "token_logprobs"), lp_json(p->logprob));
    json_t *tops = json_null();
    if (p->logprob == p->logprob) { /* the first prompt token of an echo has none */
        tops = json_object();
        for (int32_t k = 0; k < nt; k++) {
            json_t *key = lossy_string(p->top_bytes[k], p->top_len[k]);
            const char *ks = json_string_value(key);
            if (!json_object_get(tops, ks)) /* equal strings: the first (largest) stays */
                json_object_set_new(tops, ks, lp_json(p->top_lp[k]));
            json_decref(key);
        }
    }
    json_array_append_new(json_object_get(*lp, "top_logprobs"), tops);
    json_array_append_new(json_object_get(*lp, "text_offset"), json_integer((json_int_t)text_offset));
    return KVF_OK;
}
