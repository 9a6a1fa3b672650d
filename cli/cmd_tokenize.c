/* cmd_tokenize.c: `kvfleet tokenize`: encodes text to token ids or decodes ids to text with a
 * model's tokenizer.json (text/tokenizer.h). Plain output is comma-separated ids or the text;
 * --json prints {"ids":[...],"text":"..."} either way. */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/cfg.h"
#include "common/json.h"
#include "common/sbuf.h"
#include "text/tokenizer.h"

typedef struct tokenize_cfg {
    const char *model, *tokenizer, *text, *ids;
    bool special, skip_special, json;
} tokenize_cfg;

static const kvf_cfg_opt tokenize_opts[] = {
    {"model", NULL, "a model directory holding tokenizer.json (and tokenizer_config.json)", offsetof(tokenize_cfg, model), KVF_CFG_STR},
    {"tokenizer", NULL, "a tokenizer.json file (instead of --model)", offsetof(tokenize_cfg, tokenizer), KVF_CFG_STR},
    {"text", NULL, "text to encode; '-' reads standard input", offsetof(tokenize_cfg, text), KVF_CFG_STR},
    {"ids", NULL, "token ids to decode, e.g. 1,2,3 (commas or spaces)", offsetof(tokenize_cfg, ids), KVF_CFG_STR},
    {"special", NULL, "encode: add the tokenizer's default special tokens (e.g. BOS)", offsetof(tokenize_cfg, special), KVF_CFG_BOOL},
    {"skip-special", NULL, "decode: leave special tokens out of the text", offsetof(tokenize_cfg, skip_special), KVF_CFG_BOOL},
    {"json", NULL, "print {\"ids\":[...],\"text\":\"...\"}", offsetof(tokenize_cfg, json), KVF_CFG_BOOL},
    {NULL},
};

static const kvf_cfg_spec tokenize_spec = {
    .prog = "kvfleet tokenize",
    .summary = "Encode text to token ids (--text) or decode token ids to text (--ids) with a model's\n"
               "tokenizer (--model DIR or --tokenizer FILE). Special-token text such as <|im_start|>\n"
               "in the input is matched as its token, as Hugging Face does.",
    .opts = tokenize_opts,
};

static kvf_status read_stdin(kvf_sbuf *b, kvf_err *err)
{
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, stdin)) > 0)
        kvf_sbuf_append(b, chunk, n);
    if (ferror(stdin) || b->oom)
        return kvf_err_set(err, KVF_ERR_IO, "tokenize: cannot read standard input");
    return KVF_OK;
}

static void print_result(const tokenize_cfg *c, const int32_t *ids, size_t n, const char *text, size_t len,
                         bool decoding)
{
    if (c->json) {
        json_t *arr = json_array();
        for (size_t i = 0; i < n; i++)
            json_array_append_new(arr, json_integer(ids[i]));
        json_t *o = json_object();
        json_object_set_new(o, "ids", arr);
        json_t *t = json_stringn(text, len);
        json_object_set_new(o, "text", t ? t : json_null());
        char *s = json_dumps(o, JSON_COMPACT);
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(o);
        return;
    }
    if (decoding) {
        fwrite(text, 1, len, stdout);
        putchar('\n');
        return;
    }
    for (size_t i = 0; i < n; i++)
        printf(i ? ",%d" : "%d", ids[i]);
    putchar('\n');
}

int kvf_cli_tokenize(int argc, char **argv)
{
    tokenize_cfg c = {0};
    kvf_err err = {0};
    kvf_status st = kvf_cfg_parse(&tokenize_spec, &c, argc, argv, NULL, &err);
    if (st != KVF_OK)
        return kvf_cli_exit(st, &err);
    if (!c.model == !c.tokenizer) {
        kvf_err_set(&err, KVF_ERR_INVALID, "tokenize: give exactly one of --model DIR and --tokenizer FILE");
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    if (!c.text == !c.ids) {
        kvf_err_set(&err, KVF_ERR_INVALID, "tokenize: give exactly one of --text TEXT (to encode) and --ids 1,2,3 (to decode)");
        return kvf_cli_exit(KVF_ERR_INVALID, &err);
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (c.ids && (st = kvf_cli_parse_ids("tokenize: --ids", c.ids, &ids, &n, &err)) != KVF_OK)
        return kvf_cli_exit(st, &err);

    kvf_text_tokenizer *tok = NULL;
    kvf_sbuf in;
    kvf_sbuf_init(&in);
    char *text = NULL;
    size_t len = 0;
    if ((st = kvf_text_tokenizer_load(c.model ? c.model : c.tokenizer, &tok, &err)) != KVF_OK)
        goto done;
    if (c.ids) {
        if ((st = kvf_text_tokenizer_decode(tok, ids, n, c.skip_special, &text, &len, &err)) != KVF_OK)
            goto done;
        print_result(&c, ids, n, text, len, true);
    } else {
        const char *src = c.text;
        len = strlen(c.text);
        if (strcmp(c.text, "-") == 0) {
            if ((st = read_stdin(&in, &err)) != KVF_OK)
                goto done;
            src = in.data ? in.data : "";
            len = in.len;
        }
        if ((st = kvf_text_tokenizer_encode(tok, src, len, c.special, &ids, &n, &err)) != KVF_OK)
            goto done;
        print_result(&c, ids, n, src, len, false);
    }
done:
    free(ids);
    free(text);
    kvf_sbuf_fini(&in);
    kvf_text_tokenizer_destroy(tok);
    return kvf_cli_exit(st, &err);
}
