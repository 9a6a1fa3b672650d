/* test_cfg.c: flags, environment and defaults from one table; sizes; errors that name the flag. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "common/cfg.h"

typedef struct demo_cfg {
    int32_t block_size;
    int64_t count;
    int64_t memory;
    double alpha;
    const char *name;
    bool verbose;
    bool cache;
} demo_cfg;

static const kvf_cfg_opt demo_opts[] = {
    {"block-size", "16", "tokens per block", offsetof(demo_cfg, block_size), KVF_CFG_INT},
    {"count", "3", "a count", offsetof(demo_cfg, count), KVF_CFG_INT64},
    {"memory", "1G", "a budget", offsetof(demo_cfg, memory), KVF_CFG_SIZE},
    {"alpha", "0.5", "a weight", offsetof(demo_cfg, alpha), KVF_CFG_DOUBLE},
    {"name", NULL, "a name", offsetof(demo_cfg, name), KVF_CFG_STR},
    {"verbose", NULL, "talk more", offsetof(demo_cfg, verbose), KVF_CFG_BOOL},
    {"cache", "true", "use the cache", offsetof(demo_cfg, cache), KVF_CFG_BOOL},
    {NULL},
};
static const kvf_cfg_spec demo_spec = {.prog = "demo", .opts = demo_opts};

static void test_defaults(void **state)
{
    unsetenv("KVFLEET_BLOCK_SIZE");
    demo_cfg c = {0};
    char *argv[] = {"demo", NULL};
    kvf_err err = {0};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 1, argv, NULL, &err), KVF_OK);
    assert_int_equal(c.block_size, 16);
    assert_int_equal(c.count, 3);
    assert_int_equal(c.memory, 1073741824);
    assert_true(c.alpha == 0.5);
    assert_null(c.name);
    assert_false(c.verbose);
    assert_true(c.cache);
}

static void test_flags_env_precedence(void **state)
{
    setenv("KVFLEET_BLOCK_SIZE", "32", 1);
    setenv("KVFLEET_NAME", "from-env", 1);
    demo_cfg c = {0};
    char *argv[] = {"demo", "--name=flag", "--count", "7", "--verbose", "--no-cache", "pos1",
                    "--memory=64KiB", "--", "--alpha", NULL};
    int n_pos = 0;
    kvf_err err = {0};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 10, argv, &n_pos, &err), KVF_OK);
    assert_int_equal(c.block_size, 32); /* environment beats default */
    assert_string_equal(c.name, "flag"); /* flag beats environment */
    assert_int_equal(c.count, 7);
    assert_true(c.verbose);
    assert_false(c.cache);
    assert_int_equal(c.memory, 65536);
    assert_int_equal(n_pos, 2);
    assert_string_equal(argv[1], "pos1");
    assert_string_equal(argv[2], "--alpha"); /* after "--" flags are positional */
    unsetenv("KVFLEET_BLOCK_SIZE");
    unsetenv("KVFLEET_NAME");
}

static void test_errors_name_the_flag(void **state)
{
    demo_cfg c = {0};
    kvf_err err = {0};
    char *bad_int[] = {"demo", "--block-size=abc", NULL};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 2, bad_int, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "--block-size='abc'"));
    assert_non_null(strstr(err.msg, "integer"));

    char *unknown[] = {"demo", "--nope", NULL};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 2, unknown, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "unknown flag '--nope'"));

    char *missing[] = {"demo", "--count", NULL};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 2, missing, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "--count needs a value"));

    char *positional[] = {"demo", "stray", NULL};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 2, positional, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "unexpected argument 'stray'"));

    char *too_big[] = {"demo", "--block-size=3000000000", NULL};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 2, too_big, NULL, &err), KVF_ERR_INVALID);

    setenv("KVFLEET_COUNT", "x1", 1);
    char *none[] = {"demo", NULL};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 1, none, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "KVFLEET_COUNT"));
    unsetenv("KVFLEET_COUNT");
}

static void test_help(void **state)
{
    demo_cfg c = {0};
    char *argv[] = {"demo", "--help", NULL};
    assert_int_equal(kvf_cfg_parse(&demo_spec, &c, 2, argv, NULL, NULL), KVF_HELP);
    char env[64];
    kvf_cfg_env_name("local-prefill-max-tokens", env, sizeof env);
    assert_string_equal(env, "KVFLEET_LOCAL_PREFILL_MAX_TOKENS");
}

static void test_sizes(void **state)
{
    int64_t v;
    assert_int_equal(kvf_cfg_parse_size("512", &v), KVF_OK);
    assert_int_equal(v, 512);
    assert_int_equal(kvf_cfg_parse_size("40G", &v), KVF_OK);
    assert_int_equal(v, 40LL << 30);
    assert_int_equal(kvf_cfg_parse_size("40GiB", &v), KVF_OK);
    assert_int_equal(v, 40LL << 30);
    assert_int_equal(kvf_cfg_parse_size("1.5M", &v), KVF_OK);
    assert_int_equal(v, 3LL << 19);
    assert_int_equal(kvf_cfg_parse_size("16mb", &v), KVF_OK);
    assert_int_equal(v, 16LL << 20);
    assert_int_equal(kvf_cfg_parse_size("-1", &v), KVF_ERR_INVALID);
    assert_int_equal(kvf_cfg_parse_size("12Q", &v), KVF_ERR_INVALID);
    assert_int_equal(kvf_cfg_parse_size("", &v), KVF_ERR_INVALID);
    assert_int_equal(kvf_cfg_parse_size("99999999T", &v), KVF_ERR_INVALID);
    int b;
    assert_int_equal(kvf_cfg_parse_bool("YES", &b), KVF_OK);
    assert_int_equal(b, 1);
    assert_int_equal(kvf_cfg_parse_bool("maybe", &b), KVF_ERR_INVALID);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_flags_env_precedence),
        cmocka_unit_test(test_errors_name_the_flag),
        cmocka_unit_test(test_help),
        cmocka_unit_test(test_sizes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
