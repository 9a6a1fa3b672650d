/* test_jinja_names.c: the Jinja name tables (filters, tests, methods, globals resolved once at
 * parse time): every name and alias resolves and renders what Jinja renders on a small input;
 * names resolved from template data at render time (select's test, map's filter) work; an
 * unknown name in a branch that never runs renders fine, and fails with Jinja's message, where
 * it ran before, only when its branch runs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "text/jinja.h"
#include "text/jinja_int.h"

/* Renders src with no variables; returns the output (caller frees) or NULL with *st set. */
static char *render(const char *src, kvf_status *st, kvf_err *err)
{
    kvf_text_jinja *t = NULL;
    char *out = NULL;
    size_t len = 0;
    *st = kvf_text_jinja_compile(src, strlen(src), 0, &t, err);
    if (*st == KVF_OK)
        *st = kvf_text_jinja_render(t, NULL, NULL, &out, &len, err);
    kvf_text_jinja_destroy(t);
    return *st == KVF_OK ? out : NULL;
}

static void expect(const char *src, const char *want)
{
    kvf_status st;
    kvf_err err = {0};
    char *out = render(src, &st, &err);
    if (st != KVF_OK)
        fail_msg("%s: %s", src, err.msg);
    if (strcmp(out, want) != 0)
        fail_msg("%s: got \"%s\", want \"%s\"", src, out, want);
    free(out);
}

static void expect_fail(const char *src, const char *msg)
{
    kvf_status st;
    kvf_err err = {0};
    char *out = render(src, &st, &err);
    free(out);
    if (st == KVF_OK)
        fail_msg("%s rendered; want an error with \"%s\"", src, msg);
    if (!strstr(err.msg, msg))
        fail_msg("%s: error \"%s\" does not say \"%s\"", src, err.msg, msg);
}

static void test_filters(void **state)
{
    static const char *const cases[][2] = {
        {"{{ -3 | abs }}", "3"},
        {"{{ 'ab cd' | capitalize }}", "Ab cd"},
        {"{{ x | default('y') }}{{ x | d('z') }}", "yz"},
        {"{{ {'b': 1, 'a': 2} | dictsort }}", "[('a', 2), ('b', 1)]"},
        {"{{ '<a>' | escape }}{{ '&' | e }}{{ '\"' | forceescape }}", "&lt;a&gt;&amp;&#34;"},
        {"{{ [3, 4] | first }}{{ [3, 4] | last }}", "34"},
        {"{{ '2.5' | float }}{{ '7' | int }}", "2.57"},
        {"{{ 'a\nb' | indent(2) }}", "a\n  b"},
        {"{{ {'k': 1} | items | list }}", "[('k', 1)]"},
        {"{{ [1, 2] | join('-') }}", "1-2"},
        {"{{ [1, 2] | length }}{{ 'abc' | count }}", "23"},
        {"{{ 'AbC' | lower }}{{ 'AbC' | upper }}{{ 'ab cd' | title }}", "abcABCAb Cd"},
        {"{{ [1, 2] | map('string') | join }}", "12"},
        {"{{ [3, 1, 2] | max }}{{ [3, 1, 2] | min }}{{ [3, 1, 2] | sum }}", "316"},
        {"{{ [1, 2, 3] | select('odd') | list }}{{ [1, 2, 3] | reject('odd') | list }}", "[1, 3][2]"},
        {"{{ [{'a': 1}, {'a': 0}] | selectattr('a') | list }}", "[{'a': 1}]"},
        {"{{ [{'a': 1}, {'a': 0}] | rejectattr('a') | list }}", "[{'a': 0}]"},
        {"{{ 'aXa' | replace('a', 'b') }}", "bXb"},
        {"{{ [1, 2] | reverse | list }}{{ 2.567 | round(1) }}", "[2, 1]2.6"},
        {"{{ '<b>' | safe }}{{ 5 | string }}", "<b>5"},
        {"{{ [2, 1] | sort }}{{ [1, 1, 2] | unique | list }}", "[1, 2][1, 2]"},
        {"{{ {'a': [1]} | tojson }}", "{\"a\": [1]}"},
        {"{{ '  x ' | trim }}{{ 'a b  c' | wordcount }}", "x3"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect(cases[i][0], cases[i][1]);
    (void)state;
}

static void test_tests(void **state)
{
    static const char *const cases[][2] = {
        {"{% macro m() %}{% endmacro %}{{ true is boolean }}{{ m is callable }}{{ x is defined }}"
         "{{ x is undefined }}",
         "TrueTrueFalseTrue"},
        {"{{ 6 is divisibleby 3 }}{{ 2 is even }}{{ 3 is odd }}{{ false is false }}", "TrueTrueTrueTrue"},
        {"{{ 1.5 is float }}{{ 1 is integer }}{{ 'a' is iterable }}{{ {} is mapping }}", "TrueTrueTrueTrue"},
        {"{{ none is none }}{{ 1 is number }}{{ [] is sequence }}{{ 'a' is string }}{{ true is true }}",
         "TrueTrueTrueTrueTrue"},
        {"{{ 'ab' is lower }}{{ 'AB' is upper }}{{ none is sameas none }}", "TrueTrueTrue"},
        {"{{ 1 is eq 1 }}{{ 1 is equalto 1 }}{{ 1 is ne 2 }}{{ 1 is lt 2 }}{{ 1 is lessthan 2 }}",
         "TrueTrueTrueTrueTrue"},
        {"{{ 1 is le 1 }}{{ 2 is gt 1 }}{{ 2 is greaterthan 1 }}{{ 2 is ge 2 }}{{ 1 is in [1] }}",
         "TrueTrueTrueTrueTrue"},
        {"{{ 1 is not odd }}", "False"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect(cases[i][0], cases[i][1]);
    (void)state;
}

static void test_methods_and_globals(void **state)
{
    static const char *const cases[][2] = {
        {"{{ 'ab'.startswith('a') }}{{ 'ab'.endswith('b') }}{{ 'ab'.find('b') }}{{ 'aa'.count('a') }}",
         "TrueTrue12"},
        {"{{ ' a '.strip() }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}", "a|a | a"},
        {"{{ 'a b'.split() }}{{ 'a b c'.rsplit(' ', 1) }}{{ 'a\nb'.splitlines() }}",
         "['a', 'b']['a b', 'c']['a', 'b']"},
        {"{{ 'ab'.upper() }}{{ 'AB'.lower() }}{{ 'ab cd'.title() }}{{ 'ab'.capitalize() }}",
         "ABabAb CdAb"},
        {"{{ 'aXa'.replace('a', 'b') }}{{ '-'.join(['x', 'y']) }}", "bXbx-y"},
        {"{{ ' '.isspace() }}{{ '1'.isdigit() }}{{ 'a'.isalpha() }}{{ 'A'.isupper() }}{{ 'a'.islower() }}",
         "TrueTrueTrueTrueTrue"},
        {"{{ {'k': 1}.items() | list }}{{ {'k': 1}.keys() | list }}{{ {'k': 1}.values() | list }}"
         "{{ {'k': 1}.get('k') }}",
         "[('k', 1)]['k'][1]1"},
        {"{% for i in range(3) %}{{ loop.cycle('a', 'b') }}{% endfor %}", "aba"},
        {"{% set ns = namespace(a=1) %}{{ ns.a }}{{ dict(b=2) }}", "1{'b': 2}"},
        {"{{ strftime_now('%%') }}", "%"},
        /* a global function's name is defined (Llama 3.2: `if strftime_now is defined`); an
         * attribute of that name is not */
        {"{{ strftime_now is defined }}{{ raise_exception is undefined }}{{ range is not defined }}"
         "{{ nosuch is defined }}{{ {}.strftime_now is defined }}",
         "TrueFalseFalseFalseFalse"},
        /* a variable named like a global wins, as in Jinja */
        {"{% set range = 'r' %}{{ range }}", "r"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect(cases[i][0], cases[i][1]);
    expect_fail("{{ raise_exception('stop here') }}", "stop here");
    (void)state;
}

static void test_tables_resolve_every_name(void **state)
{
    /* aliases go to their canonical entry; unknown names to -1 */
    assert_int_equal(kvf_text_jinja_filter_id("d"), kvf_text_jinja_filter_id("default"));
    assert_int_equal(kvf_text_jinja_filter_id("count"), kvf_text_jinja_filter_id("length"));
    assert_int_equal(kvf_text_jinja_filter_id("e"), kvf_text_jinja_filter_id("escape"));
    assert_int_equal(kvf_text_jinja_filter_id("forceescape"), kvf_text_jinja_filter_id("escape"));
    assert_int_equal(kvf_text_jinja_test_id("equalto"), kvf_text_jinja_test_id("eq"));
    assert_int_equal(kvf_text_jinja_test_id("lessthan"), kvf_text_jinja_test_id("lt"));
    assert_int_equal(kvf_text_jinja_test_id("greaterthan"), kvf_text_jinja_test_id("gt"));
    assert_int_equal(kvf_text_jinja_filter_id("nope"), JF_UNKNOWN);
    assert_int_equal(kvf_text_jinja_test_id("nope"), JT_UNKNOWN);
    assert_int_equal(kvf_text_jinja_method_id("nope"), JM_UNKNOWN);
    assert_int_equal(kvf_text_jinja_global_id("nope"), JG_UNKNOWN);
    assert_int_equal(kvf_text_jinja_filter_id(""), JF_UNKNOWN);
    assert_int_equal(kvf_text_jinja_filter_id("wordcount"), JF_WORDCOUNT);
    assert_int_equal(kvf_text_jinja_filter_id("abs"), JF_ABS);
    assert_int_equal(kvf_text_jinja_method_id("values"), JM_VALUES);
    assert_int_equal(kvf_text_jinja_method_id("capitalize"), JM_CAPITALIZE);
    assert_int_equal(kvf_text_jinja_global_id("strftime_now"), JG_STRFTIME_NOW);
    assert_int_equal(kvf_text_jinja_test_id("undefined"), JT_UNDEFINED);
    (void)state;
}

static void test_unknown_names_fail_only_where_they_run(void **state)
{
    /* never run: renders */
    expect("{% if false %}{{ 1 | nosuchfilter }}{{ 1 is nosuchtest }}{{ 'a'.nosuchmethod() }}"
           "{{ nosuchglobal() }}{% endif %}ok",
           "ok");
    /* run: Jinja's messages */
    expect_fail("{{ 1 | nosuchfilter }}", "unknown filter 'nosuchfilter'");
    expect_fail("{{ 1 is nosuchtest }}", "unknown test 'nosuchtest'");
    expect_fail("{{ 'a'.nosuchmethod() }}", "'str' object has no attribute 'nosuchmethod'");
    expect_fail("{{ nosuchglobal() }}", "'nosuchglobal' is undefined");
    /* a method of another type: dict's keys() on a string is no method there */
    expect_fail("{{ 'a'.keys() }}", "'str' object has no attribute 'keys'");
    /* names from template data, resolved when the filter runs */
    expect_fail("{{ [1] | select('nosuchtest') | list }}", "unknown test 'nosuchtest'");
    expect_fail("{{ [1] | map('nosuchfilter') | list }}", "unknown filter 'nosuchfilter'");
    (void)state;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_filters),
        cmocka_unit_test(test_tests),
        cmocka_unit_test(test_methods_and_globals),
        cmocka_unit_test(test_tables_resolve_every_name),
        cmocka_unit_test(test_unknown_names_fail_only_where_they_run),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
