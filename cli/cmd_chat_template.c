/* cmd_chat_template.c: `kvfleet chat-template`: renders a model's chat template for a
 * conversation file, as Hugging Face's apply_chat_template would (text/chat_template.h), and
 * with --json also tokenizes the prompt (text/tokenizer.h). */
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "common/json.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

typedef struct chat_cfg {
    const char *model, *messages, *family, *name;
    bool force_family, json, join_text_parts;
} chat_cfg;

static const kvf_cfg_opt chat_opts[] = {
    {"model", NULL, "a model directory (tokenizer_config.json, tokenizer.json; config.json for built-ins)", offsetof(chat_cfg, model), KVF_CFG_STR},
    {"messages", NULL, "a JSON file: {\"messages\": [...], \"tools\": [...], \"add_generation_prompt\": true, other variables}; '-' reads standard input", offsetof(chat_cfg, messages), KVF_CFG_STR},
    {"family", NULL, "built-in template when the model has none: llama2, llama3, chatml, mistral", offsetof(chat_cfg, family), KVF_CFG_STR},
    {"force-family", NULL, "use the --family template even when the model has its own", offsetof(chat_cfg, force_family), KVF_CFG_BOOL},
    {"template-name", NULL, "which of a list of named templates (default: \"default\")", offsetof(chat_cfg, name), KVF_CFG_STR},
    {"join-text-parts", NULL, "pass a content made only of text parts as one string (texts joined by newlines)", offsetof(chat_cfg, join_text_parts), KVF_CFG_BOOL},
    {"json", NULL, "print {\"prompt\":\"...\",\"ids\":[...]} (ids from the model's tokenizer)", offsetof(chat_cfg, json), KVF_CFG_BOOL},
    {NULL},
};

static const kvf_cfg_spec chat_spec = {
    .prog = "kvfleet chat-template",
    .summary = "Render the prompt a conversation becomes under a model's chat template, exactly as\n"
               "Hugging Face's apply_chat_template does. Keys of the --messages file other than\n"
               "messages, tools and add_generation_prompt (e.g. enable_thinking) are template\n"
               "variables. The prompt is printed as is, with no newline added.",
    .opts = chat_opts,
};

static int fail(kvf_status st, kvf_err *err, json_t *conv, kvf_text_chat_template *t, char *prompt)
{
    json_decref(conv);
    kvf_text_chat_template_destroy(t);
    free(prompt);
    return kvf_cli_exit(st, err);
}

int kvf_cli_chat_template(int argc, char **argv)
{
    chat_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&chat_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (!c.model || !c.messages) {
        kvf_err_set(&err, KVF_ERR_INVALID, "chat-template: give --model DIR and --messages FILE.json (missing %s)",
                    !c.model ? "--model" : "--messages");
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (c.force_family && !c.family) {
        kvf_err_set(&err, KVF_ERR_INVALID, "chat-template: --force-family needs --family (llama2, llama3, chatml, mistral)");
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }

    /* the conversation */
    json_t *conv = NULL;
    if (strcmp(c.messages, "-") == 0) {
        json_error_t je;
        conv = json_loadf(stdin, 0, &je);
        if (!conv)
            st = kvf_err_set(&err, KVF_ERR_PARSE, "chat-template: standard input: line %d column %d: %s",
                             je.line, je.column, je.text);
    } else {
        st = kvf_json_load_file(c.messages, &conv, &err);
        if (st != KVF_OK)
            kvf_err_prefix(&err, "chat-template");
    }
    if (st != KVF_OK)
        return fail(st, &err, NULL, NULL, NULL);
    if (!json_is_object(conv)) {
        kvf_err_set(&err, KVF_ERR_INVALID, "chat-template: %s: expected an object with \"messages\", found %s",
                    c.messages, kvf_json_kind(conv));
        return fail(KVF_ERR_INVALID, &err, conv, NULL, NULL);
    }
    json_t *gen = json_object_get(conv, "add_generation_prompt");
    if (gen && !json_is_boolean(gen)) {
        kvf_err_set(&err, KVF_ERR_INVALID, "chat-template: %s: \"add_generation_prompt\" is %s, expected a boolean",
                    c.messages, kvf_json_kind(gen));
        return fail(KVF_ERR_INVALID, &err, conv, NULL, NULL);
    }
    kvf_text_chat_request req = {
        .messages = json_object_get(conv, "messages"),
        .tools = json_object_get(conv, "tools"),
        .add_generation_prompt = json_is_true(gen),
        .extra = conv, /* the reserved keys are skipped by the renderer */
        .text_parts_as_string = c.join_text_parts,
    };
    if (!req.messages) {
        kvf_err_set(&err, KVF_ERR_INVALID, "chat-template: %s: \"messages\" is missing", c.messages);
        return fail(KVF_ERR_INVALID, &err, conv, NULL, NULL);
    }

    /* the template and the prompt */
    kvf_text_chat_template *t = NULL;
    if ((st = kvf_text_chat_template_load(c.model, c.family, c.force_family, c.name, &t, &err)) != KVF_OK)
        return fail(st, &err, conv, NULL, NULL);
    char *prompt = NULL;
    size_t len = 0;
    bool raised = false;
    st = kvf_text_chat_template_render(t, &req, &prompt, &len, &raised, &err);
    if (st != KVF_OK) {
        if (raised)
            kvf_err_prefix(&err, "chat-template: the template refused the conversation");
        return fail(st, &err, conv, t, NULL);
    }
    if (!c.json) {
        fwrite(prompt, 1, len, stdout);
        fflush(stdout);
        json_decref(conv);
        kvf_text_chat_template_destroy(t);
        free(prompt);
        return 0;
    }

    /* --json: the ids too, encoded as apply_chat_template(tokenize=True) does */
    kvf_text_tokenizer *tok = NULL;
    if ((st = kvf_text_tokenizer_load(c.model, &tok, &err)) != KVF_OK)
        return fail(st, &err, conv, t, prompt);
    int32_t *ids = NULL;
    size_t n = 0;
    st = kvf_text_tokenizer_encode(tok, prompt, len, false, &ids, &n, &err);
    kvf_text_tokenizer_destroy(tok);
    if (st != KVF_OK)
        return fail(st, &err, conv, t, prompt);
    json_t *out = json_object(), *arr = json_array();
    json_object_set_new(out, "prompt", json_stringn(prompt, len));
    for (size_t i = 0; i < n; i++)
        json_array_append_new(arr, json_integer(ids[i]));
    json_object_set_new(out, "ids", arr);
    char *s = json_dumps(out, JSON_COMPACT);
    if (s)
        printf("%s\n", s);
    free(s);
    json_decref(out);
    free(ids);
    json_decref(conv);
    kvf_text_chat_template_destroy(t);
    free(prompt);
    return s ? 0 : 1;
}
