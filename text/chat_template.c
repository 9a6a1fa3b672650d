/* chat_template.c: picks a model's chat template (its own, or a built-in one per family),
 * compiles it as transformers does, and renders a conversation with the variables
 * apply_chat_template passes. The Jinja interpreter itself is jinja_*.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/json.h"
#include "common/sbuf.h"
#include "text/chat_template.h"
#include "text/jinja.h"

struct kvf_text_chat_template {
    kvf_text_jinja *jinja;
    json_t *vars; /* special-token variables from tokenizer_config.json (an object) */
    char source[600];
    char *text; /* the template's Jinja source */
};

/* ---- built-in templates (written for kvfleet; the prompt formats are the families' own) ---- */

#define TEXT_MACRO                                                                               \
    "{%- macro text(c) -%}"                                                                      \
    "{%- if c is string -%}{{ c }}"                                                              \
    "{%- elif c is iterable and c is not mapping -%}"                                            \
    "{%- for p in c -%}"                                                                         \
    "{%- if p is string -%}{{ p }}{%- elif p is mapping and p.type == 'text' -%}{{ p.text }}{%- endif -%}" \
    "{%- endfor -%}"                                                                             \
    "{%- endif -%}"                                                                              \
    "{%- endmacro -%}\n"

#define ALTERNATE_CHECK                                                                          \
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"                               \
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}" \
    "{%- endif %}\n"

static const char tmpl_chatml[] =
    TEXT_MACRO
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n";

static const char tmpl_llama3[] =
    TEXT_MACRO
    "{{- bos_token if bos_token is defined and bos_token is not none else '<|begin_of_text|>' }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + text(message.content) | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n";

static const char tmpl_llama2[] =
    TEXT_MACRO
    "{%- set bos = bos_token if bos_token is defined and bos_token is not none else '<s>' %}\n"
    "{%- set eos = eos_token if eos_token is defined and eos_token is not none else '</s>' %}\n"
    "{%- if messages and messages[0].role == 'system' %}\n"
    "{%- set sys = text(messages[0].content) %}{%- set msgs = messages[1:] %}\n"
    "{%- else %}\n"
    "{%- set sys = '' %}{%- set msgs = messages %}\n"
    "{%- endif %}\n"
    "{%- for message in msgs %}\n"
    ALTERNATE_CHECK
    "{%- if message.role == 'user' %}\n"
    "{%- if loop.first and sys %}\n"
    "{%- set content = '<<SYS>>\\n' + sys + '\\n<</SYS>>\\n\\n' + text(message.content) %}\n"
    "{%- else %}\n"
    "{%- set content = text(message.content) %}\n"
    "{%- endif %}\n"
    "{{- bos + '[INST] ' + content | trim + ' [/INST]' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- ' ' + text(message.content) | trim + ' ' + eos }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n";

static const char tmpl_mistral[] =
    TEXT_MACRO
    "{%- set bos = bos_token if bos_token is defined and bos_token is not none else '<s>' %}\n"
    "{%- set eos = eos_token if eos_token is defined and eos_token is not none else '</s>' %}\n"
    "{%- if messages and messages[0].role == 'system' %}\n"
    "{%- set sys = text(messages[0].content) + '\\n\\n' %}{%- set msgs = messages[1:] %}\n"
    "{%- else %}\n"
    "{%- set sys = '' %}{%- set msgs = messages %}\n"
    "{%- endif %}\n"
    "{{- bos }}\n"
    "{%- for message in msgs %}\n"
    ALTERNATE_CHECK
    "{%- if message.role == 'user' %}\n"
    "{{- '[INST] ' + (sys if loop.first else '') + text(message.content) + ' [/INST]' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- text(message.content) + eos }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n";

static const struct {
    const char *name;
    const char *src;
} builtins[] = {
    {"llama2", tmpl_llama2}, {"llama3", tmpl_llama3}, {"chatml", tmpl_chatml},
    {"qwen", tmpl_chatml},   {"qwen2", tmpl_chatml},  {"qwen3", tmpl_chatml},
    {"mistral", tmpl_mistral},
};

/* ---- compile ------------------------------------------------------------------------------ */

static kvf_status make(const char *src, size_t len, const char *source,
                       kvf_text_chat_template **out, kvf_err *err)
{
    kvf_text_chat_template *t = calloc(1, sizeof *t);
    if (!t || !(t->vars = json_object()) || !(t->text = strndup(src, len))) {
        if (t)
            json_decref(t->vars);
        free(t);
        return kvf_err_set(err, KVF_ERR_NOMEM, "chat template: out of memory");
    }
    kvf_status st = kvf_text_jinja_compile(src, len, KVF_TEXT_JINJA_TRIM_BLOCKS | KVF_TEXT_JINJA_LSTRIP_BLOCKS,
                                            &t->jinja, err);
    if (st != KVF_OK) {
        kvf_text_chat_template_destroy(t);
        return kvf_err_prefix(err, "chat template (%s)", source);
    }
    snprintf(t->source, sizeof t->source, "%s", source);
    *out = t;
    return KVF_OK;
}

kvf_status kvf_text_chat_template_compile(const char *src, size_t len,
                                           kvf_text_chat_template **out, kvf_err *err)
{
    return make(src, len, "string", out, err);
}

kvf_status kvf_text_chat_template_builtin(const char *family, kvf_text_chat_template **out,
                                           kvf_err *err)
{
    for (size_t i = 0; family && i < sizeof builtins / sizeof builtins[0]; i++) {
        if (strcmp(family, builtins[i].name) != 0)
            continue;
        char source[64];
        snprintf(source, sizeof source, "built-in %s", builtins[i].name);
        return make(builtins[i].src, strlen(builtins[i].src), source, out, err);
    }
    return kvf_err_set(err, KVF_ERR_INVALID,
                       "chat template: family '%s' is not built in (use llama2, llama3, chatml, "
                       "qwen, qwen2, qwen3 or mistral)", family ? family : "(none)");
}

void kvf_text_chat_template_destroy(kvf_text_chat_template *t)
{
    if (!t)
        return;
    kvf_text_jinja_destroy(t->jinja);
    json_decref(t->vars);
    free(t->text);
    free(t);
}

const char *kvf_text_chat_template_source(const kvf_text_chat_template *t)
{
    return t->source;
}

const char *kvf_text_chat_template_text(const kvf_text_chat_template *t)
{
    return t->text;
}

/* ---- load from a model directory ---------------------------------------------------------- */

static bool file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static kvf_status read_file(const char *path, char **out, size_t *len_out, kvf_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvf_err_set(err, KVF_ERR_IO, "%s: cannot open", path);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 > cap) {
            cap = cap ? cap * 2 : 65536;
            if (cap > (64u << 20)) {
                free(buf);
                fclose(f);
                return kvf_err_set(err, KVF_ERR_INVALID, "%s: larger than 64 MiB", path);
            }
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
            }
            buf = nb;
        }
        size_t n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0)
            break;
    }
    fclose(f);
    buf[len] = 0;
    *out = buf;
    *len_out = len;
    return KVF_OK;
}

/* A special token in tokenizer_config.json: a string, or an AddedToken {"content": ...}. */
static json_t *token_text(json_t *v)
{
    if (json_is_string(v))
        return json_incref(v);
    if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
        return json_incref(json_object_get(v, "content"));
    return NULL;
}

static void collect_special(json_t *cfg, json_t *vars)
{
    static const char *const keys[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                       "pad_token", "cls_token", "mask_token", NULL};
    for (int i = 0; keys[i]; i++) {
        json_t *t = token_text(json_object_get(cfg, keys[i]));
        if (t)
            json_object_set_new(vars, keys[i], t);
    }
    json_t *extra = json_object_get(cfg, "additional_special_tokens");
    if (json_is_array(extra)) {
        json_t *list = json_array();
        size_t i;
        json_t *v;
        json_array_foreach(extra, i, v) {
            json_t *t = token_text(v);
            if (t)
                json_array_append_new(list, t);
        }
        json_object_set_new(vars, "additional_special_tokens", list);
    }
}

/* The built-in family a config.json's model_type implies, or NULL. */
static const char *family_of(const char *dir, char *why, size_t why_cap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!file_exists(path)) {
        snprintf(why, why_cap, "there is no %.500s", path);
        return NULL;
    }
    json_t *cfg;
    kvf_err e = {0};
    if (kvf_json_load_file(path, &cfg, &e) != KVF_OK) {
        snprintf(why, why_cap, "%s", e.msg);
        return NULL;
    }
    const char *type = json_string_value(json_object_get(cfg, "model_type"));
    const char *fam = NULL;
    if (type && strcmp(type, "llama") == 0) {
        json_t *vs = json_object_get(cfg, "vocab_size");
        fam = json_is_integer(vs) && json_integer_value(vs) >= 128000 ? "llama3" : "llama2";
    } else if (type && (strcmp(type, "mistral") == 0 || strcmp(type, "mixtral") == 0)) {
        fam = "mistral";
    } else if (type && (strncmp(type, "qwen2", 5) == 0 || strncmp(type, "qwen3", 5) == 0)) {
        fam = "chatml";
    } else {
        snprintf(why, why_cap, "%.400s: model_type %s%.60s%s has no built-in template", path,
                 type ? "'" : "", type ? type : "is missing", type ? "'" : "");
    }
    json_decref(cfg);
    return fam;
}

kvf_status kvf_text_chat_template_load(const char *dir, const char *family, bool force_family,
                                        const char *name, kvf_text_chat_template **out,
                                        kvf_err *err)
{
    char path[4096], source[600];
    json_t *cfg = NULL, *vars = json_object();
    kvf_text_chat_template *t = NULL;
    kvf_status st = KVF_OK;
    char *src = NULL;
    size_t len = 0;
    if (!vars)
        return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");

    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (file_exists(path)) {
        /* integers as reals: many configs hold a model_max_length beyond 64 bits (1e30) */
        json_error_t je;
        if (!(cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je))) {
            st = kvf_err_set(err, KVF_ERR_PARSE, "%s: line %d column %d: %s", path, je.line, je.column, je.text);
            goto done;
        }
        collect_special(cfg, vars);
    }
    if (force_family && family) {
        st = kvf_text_chat_template_builtin(family, &t, err);
        goto done;
    }
    /* the model's own template */
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    if (file_exists(path)) {
        if ((st = read_file(path, &src, &len, err)) != KVF_OK)
            goto done;
        snprintf(source, sizeof source, "%.500s", path);
    } else if (cfg && json_object_get(cfg, "chat_template")) {
        json_t *ct = json_object_get(cfg, "chat_template");
        const char *want = name ? name : "default";
        snprintf(source, sizeof source, "%.500s/tokenizer_config.json", dir);
        if (json_is_array(ct)) {
            size_t i;
            json_t *e, *found = NULL;
            json_array_foreach(ct, i, e) {
                const char *n = json_string_value(json_object_get(e, "name"));
                if (n && strcmp(n, want) == 0)
                    found = json_object_get(e, "template");
            }
            if (!found && !name && json_array_size(ct) > 0)
                found = json_object_get(json_array_get(ct, 0), "template");
            if (!json_is_string(found)) {
                st = kvf_err_set(err, KVF_ERR_NOT_FOUND, "%s: \"chat_template\" has no template named '%s'",
                                 source, want);
                goto done;
            }
            ct = found;
            snprintf(source + strlen(source), sizeof source - strlen(source), " (%s)", want);
        } else if (!json_is_string(ct)) {
            st = kvf_err_set(err, KVF_ERR_INVALID, "%s: \"chat_template\" is %s, expected a string or a list of {name, template}",
                             source, kvf_json_kind(ct));
            goto done;
        } else if (name && strcmp(name, "default") != 0) {
            st = kvf_err_set(err, KVF_ERR_NOT_FOUND, "%s: \"chat_template\" is a single template, not one named '%s'",
                             source, name);
            goto done;
        }
        len = json_string_length(ct);
        if (!(src = malloc(len + 1))) {
            st = kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
            goto done;
        }
        memcpy(src, json_string_value(ct), len + 1);
    }
    if (src) {
        st = make(src, len, source, &t, err);
        goto done;
    }
    /* no template of its own: a built-in one */
    if (!family) {
        char why[600];
        family = family_of(dir, why, sizeof why);
        if (!family) {
            st = kvf_err_set(err, KVF_ERR_NOT_FOUND,
                             "chat template: %s has no chat_template.jinja and no \"chat_template\" in "
                             "tokenizer_config.json, and %s; name a family (llama2, llama3, chatml, mistral)",
                             dir, why);
            goto done;
        }
    }
    st = kvf_text_chat_template_builtin(family, &t, err);
done:
    free(src);
    json_decref(cfg);
    if (st != KVF_OK) {
        json_decref(vars);
        kvf_text_chat_template_destroy(t);
        return st;
    }
    json_decref(t->vars);
    t->vars = vars;
    *out = t;
    return KVF_OK;
}

/* ---- render --------------------------------------------------------------------------------- */

/* A copy of messages whose text-only part lists are strings; NULL on OOM. */
static json_t *flatten_text_parts(const json_t *messages)
{
    json_t *out = json_array();
    size_t i;
    json_t *m;
    json_array_foreach((json_t *)messages, i, m) {
        json_t *content = json_object_get(m, "content");
        bool text_only = json_is_array(content) && json_array_size(content) > 0;
        size_t k;
        json_t *part;
        json_array_foreach(content, k, part) {
            if (!json_is_string(json_object_get(part, "text")) ||
                !json_is_string(json_object_get(part, "type")) ||
                strcmp(json_string_value(json_object_get(part, "type")), "text") != 0)
                text_only = false;
        }
        if (!text_only) {
            json_array_append(out, m);
            continue;
        }
        kvf_sbuf b;
        kvf_sbuf_init(&b);
        json_array_foreach(content, k, part) {
            if (k)
                kvf_sbuf_putc(&b, '\n');
            kvf_sbuf_append(&b, json_string_value(json_object_get(part, "text")),
                            json_string_length(json_object_get(part, "text")));
        }
        json_t *copy = json_copy(m);
        if (!copy || b.oom || json_object_set_new(copy, "content", json_stringn(b.data ? b.data : "", b.len)) != 0) {
            json_decref(copy);
            kvf_sbuf_fini(&b);
            json_decref(out);
            return NULL;
        }
        kvf_sbuf_fini(&b);
        json_array_append_new(out, copy);
    }
    return out;
}

kvf_status kvf_text_chat_template_render(const kvf_text_chat_template *t,
                                          const kvf_text_chat_request *req, char **out,
                                          size_t *len_out, bool *raised_out, kvf_err *err)
{
    if (raised_out)
        *raised_out = false;
    if (!req || !json_is_array(req->messages))
        return kvf_err_set(err, KVF_ERR_INVALID, "chat template: \"messages\" must be an array, not %s",
                           req ? kvf_json_kind(req->messages) : "missing");
    if (req->tools && !json_is_array(req->tools) && !json_is_null(req->tools))
        return kvf_err_set(err, KVF_ERR_INVALID, "chat template: \"tools\" must be an array, not %s",
                           kvf_json_kind(req->tools));
    if (req->extra && !json_is_object(req->extra))
        return kvf_err_set(err, KVF_ERR_INVALID, "chat template: extra variables must be an object, not %s",
                           kvf_json_kind(req->extra));
    /* as transformers: special tokens, then keyword arguments, then the named ones */
    json_t *vars = json_copy(t->vars);
    if (!vars)
        return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
    if (req->extra) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)req->extra, k, v) {
            if (strcmp(k, "messages") && strcmp(k, "tools") && strcmp(k, "add_generation_prompt"))
                json_object_set(vars, k, v);
        }
    }
    if (req->bos_token)
        json_object_set_new(vars, "bos_token", json_string(req->bos_token));
    if (req->eos_token)
        json_object_set_new(vars, "eos_token", json_string(req->eos_token));
    if (req->text_parts_as_string) {
        json_t *flat = flatten_text_parts(req->messages);
        if (!flat) {
            json_decref(vars);
            return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory");
        }
        json_object_set_new(vars, "messages", flat);
    } else {
        json_object_set(vars, "messages", (json_t *)req->messages);
    }
    json_object_set_new(vars, "tools", req->tools ? json_incref((json_t *)req->tools) : json_null());
    json_object_set_new(vars, "documents", json_null());
    json_object_set_new(vars, "add_generation_prompt", json_boolean(req->add_generation_prompt));
    kvf_status st = kvf_text_jinja_render(t->jinja, vars, req->limits, out, len_out, err);
    json_decref(vars);
    if (st == KVF_ERR_INVALID) {
        if (raised_out)
            *raised_out = true;
    } else if (st != KVF_OK && st != KVF_ERR_NOMEM) {
        kvf_err_prefix(err, "chat template (%s)", t->source);
    }
    return st;
}
