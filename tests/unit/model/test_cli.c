/* test_cli.c: `kvfleet generate` and `gen-model` run as a user runs them (KVF_BIN): generate
 * reproduces every fixture case, stops at EOS and names bad input; gen-model writes a loadable,
 * deterministic model whose tokenizer drives --prompt. Skips when the binary is not built. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/sbuf.h"
#include "testutil.h"

static const char *bin(void)
{
    const char *b = getenv("KVF_BIN");
    struct stat sb;
    return b && *b && stat(b, &sb) == 0 ? b : NULL;
}

/* Runs a shell command; stdout into out (may be NULL); returns the exit code. */
static int run(const char *cmd, kvf_sbuf *out)
{
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0)
        if (out)
            kvf_sbuf_append(out, buf, n);
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_generate_fixtures(void **state)
{
    if (!bin())
        skip();
    const char *models[] = {"tiny-gqa-f32", "tiny-mha-tied-f32", "tiny-mqa-bf16", "small-gqa-bf16-theta5e5"};
    int n_runs = 0;
    for (size_t mi = 0; mi < 4; mi++) {
        char rel[256];
        snprintf(rel, sizeof rel, "fixtures/models/%s/expected.json", models[mi]);
        json_error_t je;
        json_t *exp = json_load_file(kvf_test_shared_path(rel), 0, &je);
        assert_non_null(exp);
        snprintf(rel, sizeof rel, "fixtures/models/%s", models[mi]);
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", kvf_test_shared_path(rel));
        json_t *cases = json_object_get(exp, "cases");
        int n_new = (int)json_integer_value(json_object_get(exp, "n_new"));
        for (size_t ci = 0; ci < json_array_size(cases); ci++) {
            json_t *c = json_array_get(cases, ci);
            kvf_sbuf cmd, out;
            kvf_sbuf_init(&cmd);
            kvf_sbuf_init(&out);
            kvf_sbuf_printf(&cmd, "'%s' generate --model '%s' --max-tokens %d --ignore-eos --json --threads 1 "
                                  "--prefill-chunk %d --prompt-ids ",
                            bin(), dir, n_new, ci % 2 ? 7 : 512);
            json_t *pr = json_object_get(c, "prompt");
            for (size_t i = 0; i < json_array_size(pr); i++)
                kvf_sbuf_printf(&cmd, "%s%lld", i ? "," : "", (long long)json_integer_value(json_array_get(pr, i)));
            kvf_sbuf_puts(&cmd, " 2>/dev/null");
            assert_int_equal(run(cmd.data, &out), 0);
            json_t *j = json_loads(out.data, 0, &je);
            if (!j)
                fail_msg("%s: not JSON: %s", cmd.data, out.data);
            assert_true(json_equal(json_object_get(j, "prompt_ids"), pr));
            if (!json_equal(json_object_get(j, "output_ids"), json_object_get(c, "greedy")))
                fail_msg("%s %s: output_ids differ from the fixture's greedy list: %s", models[mi],
                         json_string_value(json_object_get(c, "name")), out.data);
            assert_string_equal(json_string_value(json_object_get(j, "finish_reason")), "length");
            json_decref(j);
            kvf_sbuf_fini(&cmd);
            kvf_sbuf_fini(&out);
            n_runs++;
        }
        json_decref(exp);
    }
    print_message("%d generate runs matched their fixture\n", n_runs);
}

static char tmp[256];

static void rm_tmp(void)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    assert_int_equal(system(cmd), 0);
}

/* A copy of tiny-gqa-f32 whose EOS is its "five" case's 4th greedy token: generation stops there. */
static void test_generate_stops_at_eos(void **state)
{
    if (!bin())
        skip();
    snprintf(tmp, sizeof tmp, "/tmp/kvf_test_cli_XXXXXX");
    assert_non_null(mkdtemp(tmp));
    json_error_t je;
    json_t *cfg = json_load_file(kvf_test_shared_path("fixtures/models/tiny-gqa-f32/config.json"), 0, &je);
    assert_non_null(cfg);
    /* "five": [1, 195, 85, 66, 95] -> 70, 25, 164, 264, ... */
    json_object_set_new(cfg, "eos_token_id", json_pack("[i,i]", 319, 164));
    char p[512], cmd[12288];
    snprintf(p, sizeof p, "%s/config.json", tmp);
    assert_int_equal(json_dump_file(cfg, p, 0), 0);
    json_decref(cfg);
    snprintf(p, sizeof p, "%s/model.safetensors", tmp);
    assert_int_equal(symlink(kvf_test_shared_path("fixtures/models/tiny-gqa-f32/model.safetensors"), p), 0);
    kvf_sbuf out;
    kvf_sbuf_init(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1,195,85,66,95 --max-tokens 10 --json 2>/dev/null",
             bin(), tmp);
    assert_int_equal(run(cmd, &out), 0);
    assert_non_null(strstr(out.data, "\"output_ids\":[70,25,164]"));
    assert_non_null(strstr(out.data, "\"finish_reason\":\"stop\""));
    kvf_sbuf_fini(&out);
    rm_tmp();
}

static void test_generate_errors(void **state)
{
    if (!bin())
        skip();
    char cmd[12288];
    const char *dir = kvf_test_shared_path("fixtures/models/tiny-gqa-f32");
    kvf_sbuf out;
    kvf_sbuf_init(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1,320 2>&1", bin(), dir);
    assert_int_equal(run(cmd, &out), 2);
    assert_non_null(strstr(out.data, "token 320 at index 1 is outside the vocabulary (0 to 319)"));
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1,x 2>&1", bin(), dir);
    assert_int_equal(run(cmd, &out), 2);
    assert_non_null(strstr(out.data, "is not a token id"));
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1 --max-tokens 300 2>&1", bin(), dir);
    assert_int_equal(run(cmd, &out), 2);
    assert_non_null(strstr(out.data, "max_position_embeddings (256)"));
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1 --kv-memory 1K 2>&1", bin(), dir);
    assert_int_equal(run(cmd, &out), 1);
    assert_non_null(strstr(out.data, "holds 0 blocks; this request needs 2 (16384 bytes)"));
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --prompt-ids 1 2>&1", bin());
    assert_int_equal(run(cmd, &out), 2);
    assert_non_null(strstr(out.data, "--model"));
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model /nonexistent --prompt-ids 1 2>&1", bin());
    assert_int_equal(run(cmd, &out), 1);
    assert_non_null(strstr(out.data, "/nonexistent/config.json"));
    kvf_sbuf_reset(&out);
    /* --weight-dtype: an unknown value and q8 with --half-weights are refused by name; q8 runs */
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1 --weight-dtype q4 2>&1", bin(), dir);
    assert_int_equal(run(cmd, &out), 2);
    assert_non_null(strstr(out.data, "--weight-dtype=q4 is not supported (use f32 or q8)"));
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1 --weight-dtype q8 --half-weights 2>&1",
             bin(), dir);
    assert_int_equal(run(cmd, &out), 2);
    assert_non_null(strstr(out.data, "--half-weights and --weight-dtype q8 cannot be combined"));
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1,2,3 --max-tokens 4 --weight-dtype q8 --json 2>/dev/null",
             bin(), dir);
    assert_int_equal(run(cmd, &out), 0);
    assert_non_null(strstr(out.data, "\"output_ids\""));
    kvf_sbuf_reset(&out);
    /* capacity: the plan figures for the pool */
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s' --prompt-ids 1,2 --kv-memory 1M 2>&1 >/dev/null", bin(), dir);
    assert_int_equal(run(cmd, &out), 0);
    /* 2 layers * 2 kv heads * 16 * 4 bytes * 2 = 512 bytes/token; 8192/block; 128 blocks in 1 MiB */
    assert_non_null(strstr(out.data, "512 bytes/token, 8192 bytes/block (16 tokens); pool 128 blocks = 2048 tokens"));
    kvf_sbuf_fini(&out);
}

static void test_gen_model(void **state)
{
    if (!bin())
        skip();
    snprintf(tmp, sizeof tmp, "/tmp/kvf_test_cli_XXXXXX");
    assert_non_null(mkdtemp(tmp));
    char cmd[12288];
    kvf_sbuf out;
    kvf_sbuf_init(&out);
    snprintf(cmd, sizeof cmd, "'%s' gen-model --out '%s/a' --dtype bf16 --seed 5 && '%s' gen-model --out '%s/b/c' --dtype bf16 --seed 5 "
                              "&& cmp '%s/a/model.safetensors' '%s/b/c/model.safetensors' && cmp '%s/a/config.json' '%s/b/c/config.json'",
             bin(), tmp, bin(), tmp, tmp, tmp, tmp, tmp);
    assert_int_equal(run(cmd, &out), 0);
    assert_non_null(strstr(out.data, "tiny preset"));
    const char *files[] = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"};
    for (size_t i = 0; i < 5; i++) {
        char p[512];
        struct stat sb;
        snprintf(p, sizeof p, "%s/a/%s", tmp, files[i]);
        if (stat(p, &sb) != 0)
            fail_msg("gen-model did not write %s", p);
    }
    /* a text prompt through the tokenizer it wrote */
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' generate --model '%s/a' --prompt 'Hello world' --max-tokens 6 --ignore-eos --json 2>/dev/null",
             bin(), tmp);
    assert_int_equal(run(cmd, &out), 0);
    json_error_t je;
    json_t *j = json_loads(out.data, 0, &je);
    assert_non_null(j);
    assert_int_equal(json_array_size(json_object_get(j, "output_ids")), 6);
    assert_true(json_array_size(json_object_get(j, "prompt_ids")) >= 2);
    assert_non_null(json_object_get(j, "text"));
    json_decref(j);
    /* a different seed gives different weights */
    snprintf(cmd, sizeof cmd, "'%s' gen-model --out '%s/d' --dtype bf16 --seed 6 >/dev/null && ! cmp -s '%s/a/model.safetensors' '%s/d/model.safetensors'",
             bin(), tmp, tmp, tmp);
    assert_int_equal(run(cmd, NULL), 0);
    /* the other architectures load and generate too */
    const char *arches[] = {"mistral", "qwen2"};
    for (int i = 0; i < 2; i++) {
        kvf_sbuf_reset(&out);
        snprintf(cmd, sizeof cmd, "'%s' gen-model --out '%s/%s' --arch %s --dtype f16 >/dev/null && "
                                  "'%s' generate --model '%s/%s' --prompt-ids 3,4,5 --max-tokens 4 --ignore-eos --json 2>/dev/null",
                 bin(), tmp, arches[i], arches[i], bin(), tmp, arches[i]);
        assert_int_equal(run(cmd, &out), 0);
        assert_non_null(strstr(out.data, "\"finish_reason\":\"length\""));
    }
    /* bad flags */
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' gen-model --out '%s/e' --preset huge 2>&1", bin(), tmp);
    assert_int_equal(run(cmd, &out), 2);
    assert_non_null(strstr(out.data, "\"huge\" is not known (use tiny, small, medium or 1b)"));
    kvf_sbuf_reset(&out);
    snprintf(cmd, sizeof cmd, "'%s' gen-model --out '%s/e' --dtype fp8 2>&1", bin(), tmp);
    assert_int_equal(run(cmd, &out), 2);
    kvf_sbuf_fini(&out);
    rm_tmp();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_generate_fixtures),
        cmocka_unit_test(test_generate_stops_at_eos),
        cmocka_unit_test(test_generate_errors),
        cmocka_unit_test(test_gen_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
