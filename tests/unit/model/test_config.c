/* test_config.c: config.json parsing: the shared fixtures, real-world shapes (Llama-3.1 with
 * rope_scaling and an EOS list, Mistral with a sliding window, Qwen2 with biases and
 * use_sliding_window), and errors that name the field, the value and what is allowed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "model/config.h"
#include "testutil.h"

static kvf_status parse(const char *json, kvf_model_config *c, kvf_err *err)
{
    return kvf_model_config_parse(json, strlen(json), "x/config.json", c, err);
}

static void test_fixture_configs(void **state)
{
    kvf_model_config c;
    kvf_err err = {0};
    assert_int_equal(kvf_model_config_load(kvf_test_shared_path("fixtures/models/tiny-gqa-f32"), &c, &err), KVF_OK);
    assert_int_equal(c.arch, KVF_MODEL_ARCH_LLAMA);
    assert_int_equal(c.dim, 64);
    assert_int_equal(c.hidden_dim, 176);
    assert_int_equal(c.n_layers, 2);
    assert_int_equal(c.n_heads, 4);
    assert_int_equal(c.n_kv_heads, 2);
    assert_int_equal(c.head_dim, 16);
    assert_int_equal(c.vocab_size, 320);
    assert_int_equal(c.max_pos, 256);
    assert_true(c.norm_eps == 1e-5f);
    assert_true(c.rope_theta == 10000.0);
    assert_int_equal(c.rope_scaling, KVF_MODEL_ROPE_NONE);
    assert_false(c.tie_embeddings || c.qkv_bias || c.o_bias || c.mlp_bias);
    assert_int_equal(c.bos_id, 1);
    assert_int_equal(c.n_eos, 1);
    assert_int_equal(c.eos_ids[0], 2);
    assert_int_equal(c.torch_dtype, KVF_DTYPE_F32);
    assert_int_equal(kvf_model_config_window(&c, 0), 0);
    assert_int_equal(kvf_model_config_load(kvf_test_shared_path("fixtures/models/tiny-mha-tied-f32/config.json"), &c, &err), KVF_OK);
    assert_true(c.tie_embeddings);
    assert_int_equal(kvf_model_config_load(kvf_test_shared_path("fixtures/models/small-gqa-bf16-theta5e5"), &c, &err), KVF_OK);
    assert_true(c.rope_theta == 500000.0);
    assert_int_equal(c.head_dim, 32);
    assert_int_equal(c.torch_dtype, KVF_DTYPE_BF16);
    assert_int_equal(kvf_model_config_load("/nonexistent", &c, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "/nonexistent/config.json"));
}

static void test_llama31(void **state)
{
    kvf_model_config c;
    kvf_err err = {0};
    const char *j = "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"hidden_size\":4096,"
                    "\"intermediate_size\":14336,\"num_hidden_layers\":32,\"num_attention_heads\":32,"
                    "\"num_key_value_heads\":8,\"vocab_size\":128256,\"max_position_embeddings\":131072,"
                    "\"rms_norm_eps\":1e-05,\"rope_theta\":500000.0,\"rope_scaling\":{\"factor\":8.0,"
                    "\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192,"
                    "\"rope_type\":\"llama3\"},\"tie_word_embeddings\":false,\"bos_token_id\":128000,"
                    "\"eos_token_id\":[128001,128008,128009],\"torch_dtype\":\"bfloat16\",\"attention_bias\":false,"
                    "\"mlp_bias\":false,\"hidden_act\":\"silu\",\"pretraining_tp\":1}";
    assert_int_equal(parse(j, &c, &err), KVF_OK);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.n_kv_heads, 8);
    assert_int_equal(c.rope_scaling, KVF_MODEL_ROPE_LLAMA3);
    assert_true(c.rope_factor == 8.0 && c.rope_low_freq_factor == 1.0 && c.rope_high_freq_factor == 4.0);
    assert_int_equal(c.rope_orig_max_pos, 8192);
    assert_int_equal(c.n_eos, 3);
    assert_int_equal(c.eos_ids[2], 128009);
    assert_int_equal(c.bos_id, 128000);
    /* Llama-3.1-8B: about 8.03 billion parameters */
    int64_t n = kvf_model_config_n_params(&c);
    assert_true(n > 8000000000ll && n < 8050000000ll);
}

static void test_mistral_qwen2(void **state)
{
    kvf_model_config c;
    kvf_err err = {0};
    const char *mistral = "{\"model_type\":\"mistral\",\"hidden_size\":4096,\"intermediate_size\":14336,"
                          "\"num_hidden_layers\":32,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
                          "\"vocab_size\":32000,\"sliding_window\":4096,\"rope_theta\":10000.0}";
    assert_int_equal(parse(mistral, &c, &err), KVF_OK);
    assert_int_equal(c.arch, KVF_MODEL_ARCH_MISTRAL);
    assert_int_equal(kvf_model_config_window(&c, 0), 4096);
    assert_int_equal(kvf_model_config_window(&c, 31), 4096);
    const char *mistral_nowin = "{\"model_type\":\"mistral\",\"hidden_size\":64,\"intermediate_size\":128,"
                                "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,"
                                "\"sliding_window\":null,\"head_dim\":32}";
    assert_int_equal(parse(mistral_nowin, &c, &err), KVF_OK);
    assert_int_equal(kvf_model_config_window(&c, 0), 0);
    assert_int_equal(c.head_dim, 32); /* explicit head_dim wins over hidden/heads */
    assert_int_equal(c.n_kv_heads, 4);

    const char *qwen = "{\"model_type\":\"qwen2\",\"hidden_size\":896,\"intermediate_size\":4864,"
                       "\"num_hidden_layers\":24,\"num_attention_heads\":14,\"num_key_value_heads\":2,"
                       "\"vocab_size\":151936,\"rope_theta\":1000000.0,\"sliding_window\":32768,"
                       "\"use_sliding_window\":false,\"max_window_layers\":21,\"tie_word_embeddings\":true,"
                       "\"rms_norm_eps\":1e-06,\"eos_token_id\":151643}";
    assert_int_equal(parse(qwen, &c, &err), KVF_OK);
    assert_int_equal(c.arch, KVF_MODEL_ARCH_QWEN2);
    assert_true(c.qkv_bias);
    assert_false(c.o_bias);
    assert_true(c.tie_embeddings);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(kvf_model_config_window(&c, 23), 0); /* use_sliding_window false */
    char buf[1024];
    snprintf(buf, sizeof buf, "%.*s,\"use_sliding_window\":true}", (int)strlen(qwen) - 1, qwen);
    /* a duplicate key: jansson keeps the last, so the window turns on from layer 21 */
    assert_int_equal(parse(buf, &c, &err), KVF_OK);
    assert_int_equal(kvf_model_config_window(&c, 20), 0);
    assert_int_equal(kvf_model_config_window(&c, 21), 32768);
}

static void test_errors(void **state)
{
    static const struct {
        const char *json;
        kvf_status st;
        const char *needle;
    } bad[] = {
        {"{\"model_type\":\"llama\",\"hidden_size\":4096,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":32,\"num_key_value_heads\":5,\"vocab_size\":10}",
         KVF_ERR_INVALID, "\"num_key_value_heads\" (5) does not divide \"num_attention_heads\" (32)"},
        {"{\"model_type\":\"gpt2\"}", KVF_ERR_UNSUPPORTED, "\"gpt2\" is not supported (use llama, mistral or qwen2)"},
        {"{\"hidden_size\":4}", KVF_ERR_INVALID, "\"model_type\""},
        {"{\"model_type\":\"llama\",\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":1,\"vocab_size\":10}", KVF_ERR_INVALID, "\"hidden_size\" is missing"},
        {"{\"model_type\":\"llama\",\"hidden_size\":-64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":1,\"vocab_size\":10}", KVF_ERR_INVALID, "\"hidden_size\" is -64 (allowed: 1 to"},
        {"{\"model_type\":\"llama\",\"hidden_size\":\"64\",\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":1,\"vocab_size\":10}", KVF_ERR_INVALID, "\"hidden_size\" is a string"},
        {"{\"model_type\":\"llama\",\"hidden_size\":66,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10}", KVF_ERR_INVALID, "does not divide \"hidden_size\" (66)"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10,\"head_dim\":15}", KVF_ERR_INVALID, "odd"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}",
         KVF_ERR_UNSUPPORTED, "\"yarn\" is not supported (use llama3, linear or default)"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10,\"rope_scaling\":{\"rope_type\":\"llama3\"}}",
         KVF_ERR_INVALID, "\"factor\""},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10,\"hidden_act\":\"gelu\"}", KVF_ERR_UNSUPPORTED,
         "\"hidden_act\" \"gelu\" is not supported (use silu)"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10,\"eos_token_id\":[1,99]}", KVF_ERR_INVALID,
         "\"eos_token_id\"[1] is not a token id (0 to 9)"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10,\"rms_norm_eps\":-1}", KVF_ERR_INVALID, "\"rms_norm_eps\" is -1"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10,\"tie_word_embeddings\":1}", KVF_ERR_INVALID,
         "\"tie_word_embeddings\" is an integer, expected a boolean"},
        {"{\"model_type\":\"qwen2\",\"hidden_size\":64,\"intermediate_size\":1,\"num_hidden_layers\":1,"
         "\"num_attention_heads\":4,\"vocab_size\":10,\"use_sliding_window\":true}", KVF_ERR_INVALID,
         "\"sliding_window\" is missing"},
        {"[1,2,3]", KVF_ERR_INVALID, "expected a JSON object"},
        {"{\"model_type\":", KVF_ERR_PARSE, "x/config.json: line 1"},
    };
    kvf_model_config c;
    kvf_err err = {0};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvf_status st = parse(bad[i].json, &c, &err);
        if (st != bad[i].st)
            fail_msg("case %zu: status %s, want %s (%s)", i, kvf_status_name(st), kvf_status_name(bad[i].st), err.msg);
        if (!strstr(err.msg, bad[i].needle))
            fail_msg("case %zu: \"%s\" not in: %s", i, bad[i].needle, err.msg);
        assert_non_null(strstr(err.msg, "model: "));
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_configs),
        cmocka_unit_test(test_llama31),
        cmocka_unit_test(test_mistral_qwen2),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
