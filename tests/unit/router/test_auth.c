/* test_auth.c: the router's API key table: keys from a list and from a file's lines, the bearer
 * header's forms, refusals that name the line but never the key, and the comparison. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "router/auth.h"

static void test_list_and_text(void **state)
{
    kvf_router_auth *a;
    kvf_err e = {0};
    assert_int_equal(kvf_router_auth_create(&a, &e), KVF_OK);
    assert_int_equal(kvf_router_auth_count(a), 0);
    assert_int_equal(kvf_router_auth_add_list(a, "sk-one,sk-two", &e), KVF_OK);
    const char *file = "# keys\n\nsk-alpha  tenant-a\r\n  sk-beta\ttenant_b\nsk-gamma tenant-a";
    assert_int_equal(kvf_router_auth_add_text(a, "keys.txt", file, strlen(file), &e), KVF_OK);
    assert_int_equal(kvf_router_auth_count(a), 5);
    assert_string_equal(kvf_router_auth_check(a, "Bearer sk-one"), "default");
    assert_string_equal(kvf_router_auth_check(a, "Bearer sk-two"), "default");
    assert_string_equal(kvf_router_auth_check(a, "bearer   sk-alpha "), "tenant-a");
    assert_string_equal(kvf_router_auth_check(a, "Bearer sk-beta"), "tenant_b");
    assert_string_equal(kvf_router_auth_check(a, "Bearer sk-gamma"), "tenant-a");
    /* the attacks: no header, another scheme, a prefix, a longer key, one byte off */
    assert_null(kvf_router_auth_check(a, NULL));
    assert_null(kvf_router_auth_check(a, "Basic sk-one"));
    assert_null(kvf_router_auth_check(a, "Bearersk-one"));
    assert_null(kvf_router_auth_check(a, "Bearer sk-on"));
    assert_null(kvf_router_auth_check(a, "Bearer sk-one1"));
    assert_null(kvf_router_auth_check(a, "Bearer sk-onf"));
    assert_null(kvf_router_auth_check(a, "Bearer "));
    kvf_router_auth_destroy(a);
}

static void test_refusals(void **state)
{
    kvf_router_auth *a;
    kvf_err e = {0};
    assert_int_equal(kvf_router_auth_create(&a, &e), KVF_OK);
    const char *bad[] = {"sk-only-a-key\n", "sk-x tenant extra\n", "sk-y ten/ant\n"};
    const char *why[] = {"want \"KEY TENANT\"", "want \"KEY TENANT\"", "the tenant must be"};
    for (int i = 0; i < 3; i++) {
        char text[64];
        snprintf(text, sizeof text, "# first\n%s", bad[i]);
        assert_int_equal(kvf_router_auth_add_text(a, "keys.txt", text, strlen(text), &e) == KVF_OK, 0);
        assert_non_null(strstr(e.msg, "keys.txt line 2"));
        assert_non_null(strstr(e.msg, why[i]));
        assert_null(strstr(e.msg, "sk-")); /* a key never reaches a message */
    }
    assert_int_not_equal(kvf_router_auth_add_list(a, "sk-a,,sk-b", &e), KVF_OK);
    assert_non_null(strstr(e.msg, "--api-key item 2"));
    assert_int_not_equal(kvf_router_auth_add_list(a, "sk-dup,sk-dup", &e), KVF_OK);
    assert_non_null(strstr(e.msg, "given twice"));
    assert_null(strstr(e.msg, "sk-dup"));
    assert_int_equal(kvf_router_auth_add_file(a, "/nonexistent/keys", &e), KVF_ERR_IO);
    assert_non_null(strstr(e.msg, "--api-key-file /nonexistent/keys"));
    kvf_router_auth_destroy(a);
}

static void test_file(void **state)
{
    char path[] = "/tmp/kvf_keys_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char *text = "sk-file tenant-f\n";
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    kvf_router_auth *a;
    kvf_err e = {0};
    assert_int_equal(kvf_router_auth_create(&a, &e), KVF_OK);
    assert_int_equal(kvf_router_auth_add_file(a, path, &e), KVF_OK);
    assert_string_equal(kvf_router_auth_check(a, "Bearer sk-file"), "tenant-f");
    kvf_router_auth_destroy(a);
    unlink(path);
}

static void test_equal(void **state)
{
    assert_true(kvf_router_auth_equal("abc", 3, "abc", 3));
    assert_false(kvf_router_auth_equal("abc", 3, "abd", 3));
    assert_false(kvf_router_auth_equal("abc", 3, "ab", 2));
    assert_false(kvf_router_auth_equal("abc", 3, "abc\0", 4));
    assert_false(kvf_router_auth_equal("", 0, "a", 1));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_list_and_text),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_file),
        cmocka_unit_test(test_equal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
