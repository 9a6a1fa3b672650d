/* test_bench_cli.c: `kvfleet bench kv` runs end to end with tiny settings, prints its table,
 * the ratio and the summary line, and refuses bad flags with exit code 2. Skips when the
 * kvfleet binary (KVF_BIN) has not been built. No timing is asserted. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

static const char *bin(void)
{
    const char *b = getenv("KVF_BIN");
    return b && *b && access(b, X_OK) == 0 ? b : NULL;
}

/* Runs the command, returns its exit code and its stdout+stderr in out. */
static int run(const char *args, char *out, size_t cap)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s bench kv %s 2>&1", bin(), args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_bench_runs(void **state)
{
    if (!bin())
        skip();
    static char out[16384];
    int rc = run("--seconds 0.01 --blocks 256 --seqs 16 --hash-bytes 64K", out, sizeof out);
    if (rc != 0)
        fprintf(stderr, "%s\n", out);
    assert_int_equal(rc, 0);
    const char *want[] = {"allocate", "free", "decode step", "insert", "lookup hit",
                          "lookup miss", "hash blocks", "memory read",
                          "hash / memory read of the same", "summary: allocate"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        assert_non_null(strstr(out, want[i]));
}

static void test_bench_rejects(void **state)
{
    if (!bin())
        skip();
    static char out[4096];
    assert_int_equal(run("--seqs 0", out, sizeof out), 2);
    assert_non_null(strstr(out, "--seqs (0)"));
    assert_int_equal(run("--block-size 24", out, sizeof out), 2);
    assert_non_null(strstr(out, "block_size 24"));
    assert_int_equal(run("--no-such-flag", out, sizeof out), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_runs),
        cmocka_unit_test(test_bench_rejects),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
