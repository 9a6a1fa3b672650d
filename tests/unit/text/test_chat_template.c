/* test_chat_template.c: the chat-template interpreter (text/jinja.h) construct by construct,
 * whitespace control, error positions, raise_exception, render limits, and text/chat_template.h:
 * every qwen3 chat case of ../shared rendered (and tokenized) exactly, built-in families, and
 * template selection from a model directory. The expected strings of the construct tables were
 * produced by Python Jinja2 3.1.6 set up as transformers sets it up (sandboxed, trim_blocks,
 * lstrip_blocks, loopcontrols, json.dumps-based tojson). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/json.h"
#include "text/chat_template.h"
#include "text/jinja.h"
#include "text/tokenizer.h"
#include "testutil.h"

#define BOTH (KVF_TEXT_JINJA_TRIM_BLOCKS | KVF_TEXT_JINJA_LSTRIP_BLOCKS)

typedef struct jcase {
    const char *tmpl, *vars, *want;
} jcase;

/* Renders src with vars (JSON text) and flags; returns the status, *out the text or error. */
static kvf_status render(const char *src, const char *vars, unsigned flags,
                         const kvf_text_jinja_limits *lim, char **out, kvf_err *err)
{
    kvf_text_jinja *t = NULL;
    kvf_status st = kvf_text_jinja_compile(src, strlen(src), flags, &t, err);
    if (st != KVF_OK)
        return st;
    json_t *v = NULL;
    if (vars) {
        v = json_loads(vars, 0, NULL);
        assert_non_null(v);
    }
    size_t len = 0;
    st = kvf_text_jinja_render(t, v, lim, out, &len, err);
    if (st == KVF_OK)
        assert_int_equal(len, strlen(*out));
    json_decref(v);
    kvf_text_jinja_destroy(t);
    return st;
}

static void run_cases(const jcase *cases)
{
    for (const jcase *c = cases; c->tmpl; c++) {
        char *out = NULL;
        kvf_err err = {0};
        kvf_status st = render(c->tmpl, c->vars, BOTH, NULL, &out, &err);
        if (st != KVF_OK)
            fail_msg("template %s: %s", c->tmpl, err.msg);
        if (strcmp(out, c->want) != 0)
            fail_msg("template %s\n  got  [%s]\n  want [%s]", c->tmpl, out, c->want);
        free(out);
    }
}

/* Expects a failure with status st whose message contains each of the NULL-ended strings. */
static void expect_fail(const char *src, const char *vars, kvf_status st, ...)
{
    char *out = NULL;
    kvf_err err = {0};
    kvf_status got = render(src, vars, BOTH, NULL, &out, &err);
    if (got == KVF_OK) {
        fail_msg("template %s rendered [%s], expected %s", src, out, kvf_status_name(st));
        free(out);
    }
    if (got != st)
        fail_msg("template %s: got %s (%s), expected %s", src, kvf_status_name(got), err.msg,
                 kvf_status_name(st));
    va_list ap;
    va_start(ap, st);
    for (const char *s; (s = va_arg(ap, const char *));)
        if (!strstr(err.msg, s))
            fail_msg("template %s: message [%s] lacks [%s]", src, err.msg, s);
    va_end(ap);
}

static const jcase cases_expressions[] = {
    {"{{ 'a' ~ 1 ~ none ~ true }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "a1NoneTrue"},
    {"{{ 1 + 2 * 3 - 4 / 2 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}|{{ 7.5 // 2 }}|{{ -7.5 % 2 }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "5.0|3|-4|2|1024|3.0|0.5"},
    {"{{ {'a': 1, 'b': [1, 'x', none, true, 1.5]} }}|{{ (1, 2) }}|{{ (1,) }}|{{ 'it\\'s' }}|{{ [\"a'b\"] }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "{'a': 1, 'b': [1, 'x', None, True, 1.5]}|(1, 2)|(1,)|it's|[\"a'b\"]"},
    {"{{ x if c else y }}|{{ x if not c }}|{{ 'yes' if 1 in [1,2] else 'no' }}|{{ 'b' not in 'abc' }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "2|1|yes|False"},
    {"{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 'a' < 'b' }}{{ [1, 2] < [1, 3] }}{{ 1 == 1.0 }}{{ true == 1 }}{{ none == none }}{{ u == u2 }}{{ 2 >= 2 }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "TrueFalseTrueTrueTrueTrueTrueTrueTrue"},
    {"{{ 'x' * 3 }}{{ [1] * 2 }}{{ [1] + [2] }}{{ 'a' + 'b' }}{{ 1.5 + 1 }}{{ 10 / 4 }}{{ 1e20 }}{{ 1.0e-5 }}{{ 0.1 + 0.2 }}{{ 1/3 }}{{ 2.0 }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "xxx[1, 1][1, 2]ab2.52.51e+201e-050.300000000000000040.33333333333333332.0"},
    {"{{ 10000000000000000.0 }}{{ 1.5e-7 }}{{ 100.0 }}{{ -0.0 }}{{ 0.001 }}{{ 0.0001 }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "1e+161.5e-07100.0-0.00.0010.0001"},
    {"{{ 'a' in {'a': 1} }}{{ 2 in [1, 2] }}{{ '' in 'x' }}{{ not 0 and 1 or 2 }}{{ none or 'd' }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "TrueTrueTrue1d"},
    {"{{ ('a' ~ 'b') | length }}{{ 'a' 'b' }}{{ \"\\n\" | length }}{{ '\\x41\\u00e9' }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "2ab1A\303\251"},
    {"{{ {'a': {'b': 1}} }}{{ {'x': [1, {'y': 2}]}['x'][1].y }}{{ -(3) }}{{ +2 }}",
     "{\"x\": 1, \"y\": 2, \"c\": false}",
     "{'a': {'b': 1}}2-32"},
    {NULL, NULL, NULL},
};

static const jcase cases_access[] = {
    {"{{ [1, 2, 3][::-1] }}|{{ 'hello'[1:3] }}|{{ 'h\303\251llo'[::-1] }}|{{ [1,2,3,4,5][1:-1:2] }}|{{ 'abc'[-1] }}|{{ 'h\303\251llo'[1] }}|{{ [1,2][5:] }}",
     "{}",
     "[3, 2, 1]|el|oll\303\251h|[2, 4]|c|\303\251|[]"},
    {"{{ d.get('a') }}{{ d.get('zz', 5) }}{{ d.keys() | list }}{{ d.values() | list }}{{ d['a'] }}{{ d.a }}{{ d.missing is defined }}{{ l.0 }}",
     "{\"d\": {\"a\": 1}, \"l\": [7]}",
     "15['a'][1]11False7"},
    {"{{ x }}|{{ x.y is defined }}|{{ n.y is defined }}|{{ l[5] is defined }}",
     "{\"x\": null, \"n\": 5, \"l\": []}",
     "None|False|False|False"},
    {"{{ messages[0]['content'][0]['text'] }}{% for p in messages[0].content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}",
     "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"T\"}, {\"type\": \"image\"}]}]}",
     "TT"},
    {NULL, NULL, NULL},
};

static const jcase cases_for[] = {
    {"{% for x in xs %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}-{% else %}empty{% endfor %}",
     "{\"xs\": [1, 2, 3]}",
     "01TrueFalse33-12FalseFalse32-23FalseTrue31-"},
    {"{% for x in xs %}{{ x }}{% else %}empty{% endfor %}",
     "{\"xs\": []}",
     "empty"},
    {"{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
     "{\"d\": {\"b\": 1, \"a\": 2}}",
     "b=1;a=2;ba"},
    {"{% for x in xs if x > 1 %}{{ x }}{{ loop.length }}{% endfor %}",
     "{\"xs\": [1, 2, 3]}",
     "2232"},
    {"{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
     "{\"xs\": [1, 2, 3, 4, 5]}",
     "13"},
    {"{% for i in range(2) %}{% for j in range(2) %}{{ loop.index }}{{ i }}{% endfor %}{{ loop.index }}{% endfor %}",
     "{}",
     "1020111212"},
    {"{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}{% set x, y = 1, 2 %}{{ x }}{{ y }}",
     "{}",
     "3712"},
    {"{{ range(5) | list }}{{ range(1, 10, 3) | list }}{{ range(5, 0, -2) | list }}{% for i in range(3) %}{{ loop.cycle('a', 'b') }}{% endfor %}",
     "{}",
     "[0, 1, 2, 3, 4][1, 4, 7][5, 3, 1]aba"},
    {"{% for m in messages %}{{ loop.previtem is defined }}{{ loop.nextitem is defined }}{% endfor %}{% for x in 'ab' %}{{ x }}{% endfor %}{% for x in nothing %}{{ x }}{% endfor %}",
     "{\"messages\": [1, 2]}",
     "FalseTrueTrueFalseab"},
    {"{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = i + 5 %}{{ x }};{% endfor %}{{ x }}",
     "{}",
     "05;06;07;0"},
    {NULL, NULL, NULL},
};

static const jcase cases_if[] = {
    {"{% if a %}A{% elif b %}B{% else %}C{% endif %}{% if b %}B{% elif a == 0 %}Z{% endif %}",
     "{\"a\": 0, \"b\": \"\"}",
     "CZ"},
    {"{% set content = 'a' %}{% if true %}{% set content = 'b' %}{% endif %}{{ content }}",
     "{}",
     "b"},
    {NULL, NULL, NULL},
};

static const jcase cases_set[] = {
    {"{% set x = 1 %}{% for i in range(3) %}{% set x = i %}{{ x }}{% endfor %}{{ x }}",
     "{}",
     "0121"},
    {"{% set ns = namespace(c=0, s='') %}{% for i in range(4) %}{% set ns.c = ns.c + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.c }} {{ ns.s }}",
     "{}",
     "6 0123"},
    {"{%- set ns = namespace(found=false) -%}{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.found = true -%}{%- endif -%}{%- endfor -%}{{ ns.found }}",
     "{\"messages\": [{\"role\": \"system\"}]}",
     "True"},
    {"{% set x %}block {{ 1 }}{% endset %}{{ x }}{% set y = [1, 2] %}{% set z = {'k': y} %}{{ z.k[1] }}",
     "{}",
     "block 12"},
    {NULL, NULL, NULL},
};

static const jcase cases_macro[] = {
    {"{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ m(b=3, a=4) }}",
     "{}",
     "[1B][12][43]"},
    {"{% macro w(x) %}<{{ caller() }}{{ x }}>{% endmacro %}{% call w(5) %}inner{% endcall %}",
     "{}",
     "<inner5>"},
    {"{% macro w() %}{% for i in [1,2] %}{{ caller(i) }}{% endfor %}{% endmacro %}{% call(v) w() %}({{ v }}){% endcall %}",
     "{}",
     "(1)(2)"},
    {"{% macro rec(n) %}{% if n > 0 %}{{ n }}{{ rec(n - 1) }}{% endif %}{% endmacro %}{{ rec(5) }}",
     "{}",
     "54321"},
    {NULL, NULL, NULL},
};

static const jcase cases_tests[] = {
    {"{{ a is defined }}{{ b is defined }}{{ n is none }}{{ s is string }}{{ d is mapping }}{{ l is iterable }}{{ s is sequence }}{{ 1 is number }}{{ true is boolean }}{{ t is true }}{{ f is false }}{{ 1 is true }}{{ d is iterable }}{{ 5 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 1.0 is number }}{{ n is not none }}{{ s is not mapping }}{{ l is sequence }}{{ 1 is string }}",
     "{\"a\": 1, \"n\": null, \"s\": \"x\", \"d\": {}, \"l\": [], \"t\": true, \"f\": false}",
     "TrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueFalseTrueTrueFalse"},
    {NULL, NULL, NULL},
};

static const jcase cases_filters[] = {
    {"{{ '  hi  ' | trim }}|{{ [1,2,3] | length }}|{{ 'h\303\251llo' | length }}|{{ 'AbC' | lower }}{{ 'abc' | upper }}|{{ [1,2] | join(', ') }}|{{ [1,2] | first }}{{ [1,2] | last }}|{{ u | default('D') }}|{{ '' | default('E', true) }}|{{ none | string }}|{{ 'abc' | list }}|{{ 'a-b-a' | replace('a', 'x') }}|{{ 'x' | safe }}|{{ 'xxhixx' | trim('x') }}",
     "{}",
     "hi|3|5|abcABC|1, 2|12|D|E|None|['a', 'b', 'c']|x-b-x|x|hi"},
    {"{{ d | items | list }}|{{ d | length }}|{{ u | length }}|{{ 'Hello' ~ ' ' ~ name | upper }}{{ -1 | abs }}{{ 3.7 | int }}{{ '42' | int + 1 }}{{ 'x' | int }}{{ 2 | float }}",
     "{\"d\": {\"z\": 1, \"a\": 2}, \"name\": \"bob\"}",
     "[('z', 1), ('a', 2)]|2|0|Hello BOB134302.0"},
    {"{{ 'a\nb\n\nc' | indent(2) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'a\n\nb' | indent(4, blank=true) }}|{{ 'a\nb' | indent('>>') }}|{{ 'x\n' | indent }}",
     "{}",
     "a\n  b\n\n  c|  a\n  b|a\n    \n    b|a\n>>b|x\n"},
    {"{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('|') }}|{{ messages | rejectattr('role', 'eq', 'user') | list | length }}|{{ [3,1,2] | sort }}|{{ [1,2,2,3] | unique | list }}|{{ [1,2,3] | reverse | list }}|{{ [1,2,3] | sum }}|{{ 'abc' | reverse }}",
     "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"bot\", \"content\": \"b\"}, {\"role\": \"user\", \"content\": \"c\"}]}",
     "a|c|1|[1, 2, 3]|[1, 2, 3]|[3, 2, 1]|6|cba"},
    {"{{ [1,2,3] | select('odd') | list }}{{ [0,1,''] | select | list }}{{ [1,2,3] | reject('even') | list }}{{ ['a','b'] | map('upper') | list }}{{ d | dictsort }}{{ ['b', 'A', 'c'] | sort }}{{ [1, 5, 3] | max }}{{ [4, 2] | min }}{% filter upper %}abc {{ 'd' }}{% endfilter %}",
     "{\"d\": {\"b\": 1, \"a\": 2}}",
     "[1, 3][1][1, 3]['A', 'B'][('a', 2), ('b', 1)]['A', 'b', 'c']52ABC D"},
    {"{{ calls | map(attribute='function.name') | join(',') }}|{{ calls | selectattr('function.args.0') | list | length }}|"
     "{{ calls | map(attribute='nope', default='D') | list }}|{{ calls | sort(attribute='function.name') | map(attribute='function.name') | join }}",
     "{\"calls\": [{\"function\": {\"name\": \"b\", \"args\": [1]}}, {\"function\": {\"name\": \"a\", \"args\": []}}]}",
     "b,a|1|['D', 'D']|ab"},
    {"{{ '[hello] it''s (a-b) wORLD' | title }}|{{ 'one, two_three 4' | wordcount }}|{{ {'a': 1} is lower }}|"
     "{{ 1.0 is odd }}|{{ false | map('string') | list }}|{{ 0 | select | list }}|{{ 1 in ([] | first) }}",
     "{}",
     "[Hello] Its (A-B) World|3|True|True|[]|[]|False"},
    {NULL, NULL, NULL},
};

static const jcase cases_tojson[] = {
    {"{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|{{ d | tojson(sort_keys=true) }}|{{ d | tojson(separators=(',', ':')) }}",
     "{\"d\": {\"z\": [1, 2.5, null, true, \"\\u00e9\\n\\\"\\\\\\u0001<&>\"], \"a\": {}}}",
     "{\"z\": [1, 2.5, null, true, \"\303\251\\n\\\"\\\\\\u0001<&>\"], \"a\": {}}|{\n  \"z\": [\n    1,\n    2.5,\n    null,\n    true,\n    \"\303\251\\n\\\"\\\\\\u0001<&>\"\n  ],\n  \"a\": {}\n}|[]|{\"a\": {}, \"z\": [1, 2.5, null, true, \"\303\251\\n\\\"\\\\\\u0001<&>\"]}|{\"z\":[1,2.5,null,true,\"\303\251\\n\\\"\\\\\\u0001<&>\"],\"a\":{}}"},
    {"{{ '\303\251' | tojson }}{{ 'a\\u2028' | tojson }}{{ 3.0 | tojson }}{{ 1e100 | tojson }}{{ [1,[2,{}]] | tojson(indent=1) }}{{ x | tojson(indent='\\t') }}{{ x | tojson(indent=0) }}",
     "{\"x\": {\"a\": [1]}}",
     "\"\303\251\"\"a\342\200\250\"3.01e+100[\n 1,\n [\n  2,\n  {}\n ]\n]{\n\t\"a\": [\n\t\t1\n\t]\n}{\n\"a\": [\n1\n]\n}"},
    {"{{ x | tojson(ensure_ascii=true) }}|{{ {'\303\251': 1} | tojson(ensure_ascii=true, indent=1) }}",
     "{\"x\": [\"\\u00e9\\ud83d\\ude00\\u4e2d\", \"\\u0001\"]}",
     "[\"\\u00e9\\ud83d\\ude00\\u4e2d\", \"\\u0001\"]|{\n \"\\u00e9\": 1\n}"},
    {NULL, NULL, NULL},
};

static const jcase cases_methods[] = {
    {"{{ s.startswith('ab') }}{{ s.endswith('yz') }}{{ s.startswith(('x', 'a')) }}|{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\n\na\n'.lstrip('\n') }}|{{ 'a  '.rstrip() }}|{{ ' a  b c '.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a,b,c'.split(',', 1) }}",
     "{\"s\": \"abcxyz\"}",
     "TrueTrueTrue|a b|a|a\n|a|['a', 'b', 'c']|['a', 'b', '', 'c']|['a', 'b,c']"},
    {"{{ 'hello wORLD x1y'.title() }}|{{ 'aaa'.replace('a', 'b', 2) }}|{{ 'abc'.replace('', '-') }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ '\303\237'.upper() }}{{ '\303\211COLE'.lower() }}{{ 'aBc'.capitalize() }}{{ 'hello world' | title }}{{ 'abc'.islower() }}|{{ '\343\200\200 x\302\240'.strip() }}|{{ 'a\342\200\203b'.split() }}",
     "{}",
     "Hello World X1Y|bba|-a-b-c-|['a,b', 'c']|SS\303\251coleAbcHello WorldTrue|x|['a', 'b']"},
    {NULL, NULL, NULL},
};

static const jcase cases_whitespace[] = {
    {"{%- for m in messages -%}\n  {{ m.role }}: {{ m.content }}\n{%- endfor %}",
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}",
     "user: hiassistant: yo"},
    {"  {% if true %}\n    x\n  {% endif %}\n  {# comment #}\n  y {{ 1 }}  \n{%+ if true %}z{% endif +%}\nw",
     "{}",
     "    x\n  y 1  \nz\nw"},
    {"a  {%- if true -%}  b  {%- endif -%}  c\n  {{- ' d ' -}}  \n e",
     "{}",
     "abc d e"},
    {"\n{% if true %}\nA\n{% endif %}\n\n{%- if true %}\nB\n{% endif -%}\n\nC",
     "{}",
     "\nA\nB\nC"},
    {"a\n    {% if true %}\n    b\n    {% endif %}\nc",
     "{}",
     "a\n    b\nc"},
    {"a {% if true %}b{% endif %} c\n  {% if 1 %}d\n{% endif %}",
     "{}",
     "a b c\nd\n"},
    {"{# c #}\n  {# d #}\nx\n\t{%- set y = 1 -%}\n\ty",
     "{}",
     "xy"},
    {"{{ 'a' }}\n{{ 'b' }}\n  {{ 'c' }}",
     "{}",
     "a\nb\n  c"},
    {"{% for i in range(2) %}\n  {{ i }}\n{% endfor %}\n",
     "{}",
     "  0\n  1\n"},
    {"x  {%+ if true %}y{% endif %}",
     "{}",
     "x  y"},
    {"{%- if true -%}\n\n  a  \n\n{%- endif -%}\n\n",
     "{}",
     "a"},
    {"{% raw %}\n  {{ x }}\n{% endraw %}\nz",
     "{}",
     "\n  {{ x }}\nz"},
    {"a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc",
     "{}",
     "a\nb\nc"},
    {"   {# only #}   \n",
     "{}",
     "   "},
    {NULL, NULL, NULL},
};

static void test_expressions(void **state) { run_cases(cases_expressions); }
static void test_access_and_slices(void **state) { run_cases(cases_access); }
static void test_for(void **state) { run_cases(cases_for); }
static void test_if(void **state) { run_cases(cases_if); }
static void test_set_and_namespace(void **state) { run_cases(cases_set); }
static void test_macro_and_call(void **state) { run_cases(cases_macro); }
static void test_tests(void **state) { run_cases(cases_tests); }
static void test_filters(void **state) { run_cases(cases_filters); }
static void test_tojson(void **state) { run_cases(cases_tojson); }
static void test_string_methods(void **state) { run_cases(cases_methods); }
static void test_whitespace_control(void **state) { run_cases(cases_whitespace); }

/* transformers' {% generation %} marker renders its body; escape is HTML escaping. */
static void test_generation_tag_and_escape(void **state)
{
    char *out = NULL;
    kvf_err err = {0};
    assert_int_equal(render("{% for m in messages %}{% generation %}[{{ m }}]{% endgeneration %}{% endfor %}"
                            "{{ '<a href=\"x\">&\\'' | e }}",
                            "{\"messages\": [1, 2]}", BOTH, NULL, &out, &err), KVF_OK);
    assert_string_equal(out, "[1][2]&lt;a href=&#34;x&#34;&gt;&amp;&#39;");
    free(out);
}

/* trim_blocks and lstrip_blocks are flags: off, the text around tags stays. */
static void test_whitespace_flags(void **state)
{
    const char *src = "a\n  {% if true %}\nb\n  {# c #}\n{% endif %}\nd";
    static const struct { unsigned flags; const char *want; } cases[] = {
        {0, "a\n  \nb\n  \n\nd"},
        {KVF_TEXT_JINJA_TRIM_BLOCKS, "a\n  b\n  d"},
        {KVF_TEXT_JINJA_LSTRIP_BLOCKS, "a\n\nb\n\n\nd"},
        {BOTH, "a\nb\nd"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        kvf_err err = {0};
        assert_int_equal(render(src, NULL, cases[i].flags, NULL, &out, &err), KVF_OK);
        assert_string_equal(out, cases[i].want);
        free(out);
    }
}

static void test_syntax_errors_name_position(void **state)
{
    expect_fail("{% if x %}a", NULL, KVF_ERR_PARSE, "line 1 col 12", "unexpected end of template",
                "'endif'", NULL);
    expect_fail("ok\n{{ 1 + }}", NULL, KVF_ERR_PARSE, "line 2 col 8", "unexpected '}}'", NULL);
    expect_fail("{% for x in %}", NULL, KVF_ERR_PARSE, "line 1 col 13", "expected an expression", NULL);
    expect_fail("{% endif %}", NULL, KVF_ERR_PARSE, "line 1 col 4", "unexpected 'endif'", NULL);
    expect_fail("x\n\n  {{ 'abc }}", NULL, KVF_ERR_PARSE, "line 3 col 6", "unterminated string", NULL);
    expect_fail("{% foo %}", NULL, KVF_ERR_PARSE, "line 1 col 4", "unknown tag 'foo'", NULL);
    expect_fail("{{ x }", NULL, KVF_ERR_PARSE, "line 1 col 7", "expected '}}'", NULL);
    expect_fail("x {# open", NULL, KVF_ERR_PARSE, "line 1 col 3", "unterminated comment", NULL);
    expect_fail("{{ a b }}", NULL, KVF_ERR_PARSE, "line 1 col 6", "unexpected 'b'", NULL);
    expect_fail("{{ 'é' $ }}", NULL, KVF_ERR_PARSE, "line 1 col 8", "unexpected character '$'", NULL);
    expect_fail("{{ 99999999999999999999 }}", NULL, KVF_ERR_PARSE, "too large", NULL);
    expect_fail("{% for x in y %}{% else %}{% else %}{% endfor %}", NULL, KVF_ERR_PARSE, "line 1 col 30", NULL);
    char deep[600] = "{{ ";
    for (int i = 0; i < 200; i++)
        strcat(deep, "(");
    strcat(deep, "1");
    for (int i = 0; i < 200; i++)
        strcat(deep, ")");
    strcat(deep, " }}");
    expect_fail(deep, NULL, KVF_ERR_PARSE, "nested too deeply", NULL);
}

static void test_render_errors_name_position(void **state)
{
    expect_fail("line1\n  {{ x.y.z }}", "{}", KVF_ERR_STATE, "line 2 col 7", "'x' is undefined", NULL);
    expect_fail("{{ x | nofilter }}", "{}", KVF_ERR_STATE, "line 1 col 6", "unknown filter 'nofilter'", NULL);
    expect_fail("{{ x is nottest }}", "{}", KVF_ERR_STATE, "unknown test 'nottest'", NULL);
    expect_fail("{{ 1 / 0 }}", "{}", KVF_ERR_STATE, "line 1 col 6", "division by zero", NULL);
    expect_fail("{{ [1] + 'a' }}", "{}", KVF_ERR_STATE, "'list' and 'str'", NULL);
    expect_fail("{{ 'a' < 1 }}", "{}", KVF_ERR_STATE, "'<' not supported", NULL);
    expect_fail("{% set a.b = 1 %}", "{}", KVF_ERR_STATE, "not a namespace()", NULL);
    expect_fail("{{ 9223372036854775807 + 1 }}", "{}", KVF_ERR_STATE, "integer overflow", NULL);
    expect_fail("{% for a, b in [1] %}{% endfor %}", "{}", KVF_ERR_STATE, "cannot unpack", NULL);
    expect_fail("{{ {[1]: 2} }}", "{}", KVF_ERR_STATE, "unhashable", NULL);
    expect_fail("{{ m.content.startswith('x') }}", "{\"m\": {\"content\": 5}}", KVF_ERR_STATE,
                "line 1 col 13", "'int' object has no attribute 'startswith'", NULL);
    expect_fail("{{ 'x'.split('') }}", "{}", KVF_ERR_STATE, "empty separator", NULL);
    expect_fail("{{ undefined_fn(1) }}", "{}", KVF_ERR_STATE, "'undefined_fn' is undefined", NULL);
    expect_fail("{{ x | tojson }}", "{}", KVF_ERR_STATE, "'x' is undefined", NULL);
    expect_fail("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "{}", KVF_ERR_STATE, "at most 1", NULL);
    expect_fail("{{ 5 | indent }}", "{}", KVF_ERR_STATE, "indent: expected a string, not int", NULL);
    expect_fail("{{ u | int }}", "{}", KVF_ERR_STATE, "'u' is undefined", NULL);
}

static void test_raise_exception(void **state)
{
    /* the jinja layer: INVALID and the message alone, without a position */
    char *out = NULL;
    kvf_err err = {0};
    assert_int_equal(render("a{{ raise_exception('Only user and assistant roles are supported! got ' ~ r) }}",
                            "{\"r\": \"tool\"}", BOTH, NULL, &out, &err), KVF_ERR_INVALID);
    assert_string_equal(err.msg, "Only user and assistant roles are supported! got tool");
    assert_null(out);

    /* the chat layer says it was a raise, so the router can answer 400 with the message */
    kvf_text_chat_template *t;
    const char *src = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok";
    assert_int_equal(kvf_text_chat_template_compile(src, strlen(src), &t, &err), KVF_OK);
    json_t *msgs = json_loads("[{\"role\": \"assistant\", \"content\": \"x\"}]", 0, NULL);
    kvf_text_chat_request req = {.messages = msgs};
    bool raised = false;
    assert_int_equal(kvf_text_chat_template_render(t, &req, &out, NULL, &raised, &err), KVF_ERR_INVALID);
    assert_true(raised);
    assert_string_equal(err.msg, "first message must be from the user");
    /* and an ordinary template error is not a raise */
    json_decref(msgs);
    msgs = json_loads("[]", 0, NULL);
    req.messages = msgs;
    assert_int_equal(kvf_text_chat_template_render(t, &req, &out, NULL, &raised, &err), KVF_ERR_STATE);
    assert_false(raised);
    assert_non_null(strstr(err.msg, "line 1 col"));
    json_decref(msgs);
    kvf_text_chat_template_destroy(t);
}

/* Hostile templates stop at the limits, quickly, with KVF_ERR_LIMIT. */
static void test_limits(void **state)
{
    kvf_text_jinja_limits lim = {.max_output = 1 << 16, .max_iters = 10000, .max_steps = 200000, .max_depth = 64};
    static const struct { const char *src, *what; } cases[] = {
        {"{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "nested deeper than 64"},
        {"{% for i in range(100000) %}{% endfor %}", "range() of 100000 items"},
        {"{% for i in range(100) %}{% for j in range(100) %}{% for k in range(100) %}{% endfor %}{% endfor %}{% endfor %}",
         "more than 10000 loop iterations"},
        {"{{ 'x' * 100000000 }}", "more than the 65536 allowed"},
        {"{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
         "more than the 65536 allowed"},
        {"{% for i in range(5000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}", "output would exceed 65536"},
        {"{% for i in range(9000) %}{{ i + i + i + i + i + i + i + i + i + i + i + i + i + i + i + i + i + i }}{% endfor %}",
         "more than 200000 steps"},
        {"{{ [1, 2] * 100000 }}", "more than 10000 items"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        kvf_err err = {0};
        kvf_status st = render(cases[i].src, "{}", BOTH, &lim, &out, &err);
        if (st != KVF_ERR_LIMIT || !strstr(err.msg, cases[i].what))
            fail_msg("%s: got %s [%s], want a limit [%s]", cases[i].src, kvf_status_name(st), err.msg, cases[i].what);
    }
}

/* Every qwen3 chat case renders byte for byte and tokenizes to its ids. */
static void test_qwen3_chat_cases(void **state)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", kvf_test_shared_path("fixtures/tokenizers/qwen3"));
    char path[4200];
    snprintf(path, sizeof path, "%s/chat_cases.json", dir);
    json_t *cc;
    kvf_err err = {0};
    if (kvf_json_load_file(path, &cc, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    kvf_text_chat_template *t;
    if (kvf_text_chat_template_load(dir, NULL, false, NULL, &t, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    assert_non_null(strstr(kvf_text_chat_template_source(t), "tokenizer_config.json"));
    kvf_text_tokenizer *tok = NULL;
    if (kvf_text_tokenizer_load(dir, &tok, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    json_t *cases = json_object_get(cc, "cases"), *c;
    size_t i;
    assert_true(json_array_size(cases) >= 6);
    json_array_foreach(cases, i, c) {
        kvf_text_chat_request req = {
            .messages = json_object_get(c, "messages"),
            .tools = json_object_get(c, "tools"),
            .add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
            .extra = json_object_get(c, "extra_context"),
        };
        char *out = NULL;
        size_t len = 0;
        bool raised;
        if (kvf_text_chat_template_render(t, &req, &out, &len, &raised, &err) != KVF_OK)
            fail_msg("case %zu: %s", i, err.msg);
        const char *want = json_string_value(json_object_get(c, "rendered"));
        if (strcmp(out, want) != 0)
            fail_msg("case %s\n  got  [%s]\n  want [%s]", json_string_value(json_object_get(c, "id")), out, want);
        int32_t *ids = NULL;
        size_t n = 0;
        if (kvf_text_tokenizer_encode(tok, out, len, false, &ids, &n, &err) != KVF_OK)
            fail_msg("case %zu: %s", i, err.msg);
        json_t *want_ids = json_object_get(c, "ids");
        assert_int_equal(n, json_array_size(want_ids));
        for (size_t k = 0; k < n; k++)
            assert_int_equal(ids[k], json_integer_value(json_array_get(want_ids, k)));
        free(ids);
        free(out);
    }
    kvf_text_tokenizer_destroy(tok);
    kvf_text_chat_template_destroy(t);
    json_decref(cc);
}

/* One compiled template renders on many threads at once (the router's case). */
typedef struct race_arg {
    const kvf_text_chat_template *t;
    const kvf_text_chat_request *req;
    const char *want;
    int bad;
} race_arg;

static void *race_thread(void *p)
{
    race_arg *a = p;
    for (int i = 0; i < 200; i++) {
        char *out = NULL;
        kvf_err err = {0};
        if (kvf_text_chat_template_render(a->t, a->req, &out, NULL, NULL, &err) != KVF_OK ||
            strcmp(out, a->want) != 0)
            a->bad++;
        free(out);
    }
    return NULL;
}

static void test_concurrent_renders(void **state)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", kvf_test_shared_path("fixtures/tokenizers/qwen3"));
    char path[4200];
    snprintf(path, sizeof path, "%s/chat_cases.json", dir);
    json_t *cc;
    kvf_err err = {0};
    assert_int_equal(kvf_json_load_file(path, &cc, &err), KVF_OK);
    kvf_text_chat_template *t;
    assert_int_equal(kvf_text_chat_template_load(dir, NULL, false, NULL, &t, &err), KVF_OK);
    json_t *c = json_array_get(json_object_get(cc, "cases"), 5); /* tools and tool calls */
    kvf_text_chat_request req = {
        .messages = json_object_get(c, "messages"),
        .tools = json_object_get(c, "tools"),
        .add_generation_prompt = true,
    };
    race_arg args[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (race_arg){.t = t, .req = &req, .want = json_string_value(json_object_get(c, "rendered"))};
        assert_int_equal(pthread_create(&th[i], NULL, race_thread, &args[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].bad, 0);
    }
    kvf_text_chat_template_destroy(t);
    json_decref(cc);
}

static char *render_family(const char *family, const char *messages, bool gen, kvf_status *st_out,
                           kvf_err *err)
{
    kvf_text_chat_template *t;
    assert_int_equal(kvf_text_chat_template_builtin(family, &t, err), KVF_OK);
    json_t *m = json_loads(messages, 0, NULL);
    assert_non_null(m);
    kvf_text_chat_request req = {.messages = m, .add_generation_prompt = gen};
    char *out = NULL;
    *st_out = kvf_text_chat_template_render(t, &req, &out, NULL, NULL, err);
    json_decref(m);
    kvf_text_chat_template_destroy(t);
    return out;
}

static void test_builtin_families(void **state)
{
    const char *conv = "[{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \" U \"},"
                       " {\"role\": \"assistant\", \"content\": \"A\"},"
                       " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"U2\"}, {\"type\": \"image\"}]}]";
    static const struct { const char *family, *want; } cases[] = {
        {"chatml", "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n U <|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
                   "<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n"},
        {"qwen2", "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n U <|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
                  "<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n"},
        {"llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"},
        {"llama2", "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\n U [/INST] A </s><s>[INST] U2 [/INST]"},
        {"mistral", "<s>[INST] S\n\n U  [/INST]A</s>[INST] U2 [/INST]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvf_status st;
        kvf_err err = {0};
        char *out = render_family(cases[i].family, conv, true, &st, &err);
        if (st != KVF_OK)
            fail_msg("%s: %s", cases[i].family, err.msg);
        if (strcmp(out, cases[i].want) != 0)
            fail_msg("%s\n  got  [%s]\n  want [%s]", cases[i].family, out, cases[i].want);
        free(out);
    }
    /* Llama 2 and Mistral insist on alternating roles, through raise_exception */
    kvf_status st;
    kvf_err err = {0};
    char *out = render_family("mistral", "[{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"user\", \"content\": \"b\"}]",
                              true, &st, &err);
    assert_null(out);
    assert_int_equal(st, KVF_ERR_INVALID);
    assert_string_equal(err.msg, "Conversation roles must alternate user/assistant/user/assistant/...");
    kvf_text_chat_template *t;
    assert_int_equal(kvf_text_chat_template_builtin("gpt2", &t, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'gpt2' is not built in"));
}

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void remove_file(const char *dir, const char *name)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unlink(path);
}

static char *render_dir(const char *dir, const char *family, bool force, const char *name,
                        const char *source_has)
{
    kvf_text_chat_template *t;
    kvf_err err = {0};
    if (kvf_text_chat_template_load(dir, family, force, name, &t, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    if (source_has && !strstr(kvf_text_chat_template_source(t), source_has))
        fail_msg("source [%s] lacks [%s]", kvf_text_chat_template_source(t), source_has);
    json_t *m = json_loads("[{\"role\": \"user\", \"content\": \"hi\"}]", 0, NULL);
    kvf_text_chat_request req = {.messages = m, .add_generation_prompt = true};
    char *out = NULL;
    if (kvf_text_chat_template_render(t, &req, &out, NULL, NULL, &err) != KVF_OK)
        fail_msg("%s", err.msg);
    json_decref(m);
    kvf_text_chat_template_destroy(t);
    return out;
}

/* Which template a model directory gets, and the special-token variables it passes. */
static void test_load_from_model_dir(void **state)
{
    char dir[] = "/tmp/kvf_chat_test_XXXXXX";
    assert_non_null(mkdtemp(dir));
    kvf_text_chat_template *t;
    kvf_err err = {0};

    /* nothing at all: a message naming what is missing and the families */
    assert_int_equal(kvf_text_chat_template_load(dir, NULL, false, NULL, &t, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "name a family"));

    /* config.json alone: the family model_type implies */
    write_file(dir, "config.json", "{\"model_type\": \"llama\", \"vocab_size\": 128256}");
    char *out = render_dir(dir, NULL, false, NULL, "built-in llama3");
    assert_string_equal(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                             "<|start_header_id|>assistant<|end_header_id|>\n\n");
    free(out);
    write_file(dir, "config.json", "{\"model_type\": \"llama\", \"vocab_size\": 32000}");
    out = render_dir(dir, NULL, false, NULL, "built-in llama2");
    free(out);
    write_file(dir, "config.json", "{\"model_type\": \"qwen2\"}");
    out = render_dir(dir, NULL, false, NULL, "built-in chatml");
    free(out);
    write_file(dir, "config.json", "{\"model_type\": \"gpt_neox\"}");
    assert_int_equal(kvf_text_chat_template_load(dir, NULL, false, NULL, &t, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "model_type 'gpt_neox' has no built-in template"));
    out = render_dir(dir, "mistral", false, NULL, "built-in mistral");
    assert_string_equal(out, "<s>[INST] hi [/INST]");
    free(out);

    /* tokenizer_config.json: its template and special tokens (string or AddedToken form), with
     * the beyond-64-bit model_max_length many real configs carry */
    write_file(dir, "tokenizer_config.json",
               "{\"bos_token\": {\"content\": \"<B>\", \"__type\": \"AddedToken\"}, \"eos_token\": \"<E>\","
               " \"pad_token\": null, \"model_max_length\": 1000000000000000019884624838656, \"chat_template\": \"{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
               "{{ eos_token }}{{ pad_token is defined }}\"}");
    out = render_dir(dir, NULL, false, NULL, "tokenizer_config.json");
    assert_string_equal(out, "<B>hi<E>False");
    free(out);
    /* the model's bos token reaches the built-in templates too, and a family can be forced */
    out = render_dir(dir, "llama2", true, NULL, "built-in llama2");
    assert_string_equal(out, "<B>[INST] hi [/INST]");
    free(out);

    /* a list of named templates */
    write_file(dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"default\", \"template\": \"D{{ messages|length }}\"},"
               " {\"name\": \"tool_use\", \"template\": \"T{{ tools is none }}\"}]}");
    out = render_dir(dir, NULL, false, NULL, "(default)");
    assert_string_equal(out, "D1");
    free(out);
    out = render_dir(dir, NULL, false, "tool_use", "(tool_use)");
    assert_string_equal(out, "TTrue");
    free(out);
    assert_int_equal(kvf_text_chat_template_load(dir, NULL, false, "rag", &t, &err), KVF_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "no template named 'rag'"));

    /* chat_template.jinja wins over tokenizer_config.json */
    write_file(dir, "chat_template.jinja", "J{{ add_generation_prompt }}\n");
    out = render_dir(dir, NULL, false, NULL, "chat_template.jinja");
    assert_string_equal(out, "JTrue");
    free(out);

    /* a broken template names its file, line and column */
    write_file(dir, "chat_template.jinja", "ok\n{% for %}");
    assert_int_equal(kvf_text_chat_template_load(dir, NULL, false, NULL, &t, &err), KVF_ERR_PARSE);
    assert_non_null(strstr(err.msg, "chat_template.jinja"));
    assert_non_null(strstr(err.msg, "line 2 col 8"));

    remove_file(dir, "chat_template.jinja");
    remove_file(dir, "tokenizer_config.json");
    remove_file(dir, "config.json");
    rmdir(dir);
}

/* The request's own variables: tools none when absent, extra keys, bos/eos overrides. */
static void test_request_variables(void **state)
{
    const char *src = "{{ tools is none }}|{{ enable_thinking }}|{{ bos_token }}|{{ eos_token }}|"
                      "{{ add_generation_prompt }}|{{ messages | length }}|{{ documents is none }}";
    kvf_text_chat_template *t;
    kvf_err err = {0};
    assert_int_equal(kvf_text_chat_template_compile(src, strlen(src), &t, &err), KVF_OK);
    json_t *m = json_loads("[{\"role\": \"user\", \"content\": \"x\"}]", 0, NULL);
    json_t *extra = json_loads("{\"enable_thinking\": false, \"messages\": 5, \"add_generation_prompt\": 1}", 0, NULL);
    kvf_text_chat_request req = {.messages = m, .extra = extra, .bos_token = "<s>", .eos_token = "</s>"};
    char *out = NULL;
    assert_int_equal(kvf_text_chat_template_render(t, &req, &out, NULL, NULL, &err), KVF_OK);
    assert_string_equal(out, "True|False|<s>|</s>|False|1|True");
    free(out);
    /* malformed requests */
    req.messages = extra;
    assert_int_equal(kvf_text_chat_template_render(t, &req, &out, NULL, NULL, &err), KVF_ERR_INVALID);
    assert_non_null(strstr(err.msg, "\"messages\" must be an array"));
    req.messages = m;
    req.tools = m;
    req.extra = m;
    assert_int_equal(kvf_text_chat_template_render(t, &req, &out, NULL, NULL, &err), KVF_ERR_INVALID);
    json_decref(m);
    json_decref(extra);
    kvf_text_chat_template_destroy(t);

    /* OpenAI text parts as one string, for templates that call string methods on content */
    src = "{% for m in messages %}[{{ m.content.strip() if m.content is string else m.content | length }}]{% endfor %}";
    assert_int_equal(kvf_text_chat_template_compile(src, strlen(src), &t, &err), KVF_OK);
    m = json_loads("[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \" a\"}, {\"type\": \"text\", \"text\": \"b \"}]},"
                   " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"c\"}, {\"type\": \"image_url\"}]},"
                   " {\"role\": \"user\", \"content\": \" d \"}]", 0, NULL);
    kvf_text_chat_request req2 = {.messages = m};
    assert_int_equal(kvf_text_chat_template_render(t, &req2, &out, NULL, NULL, &err), KVF_OK);
    assert_string_equal(out, "[2][2][d]");
    free(out);
    req2.text_parts_as_string = true;
    assert_int_equal(kvf_text_chat_template_render(t, &req2, &out, NULL, NULL, &err), KVF_OK);
    assert_string_equal(out, "[a\nb][2][d]");
    free(out);
    /* the caller's messages are left as they were */
    assert_true(json_is_array(json_object_get(json_array_get(m, 0), "content")));
    json_decref(m);
    kvf_text_chat_template_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_expressions),
        cmocka_unit_test(test_access_and_slices),
        cmocka_unit_test(test_for),
        cmocka_unit_test(test_if),
        cmocka_unit_test(test_set_and_namespace),
        cmocka_unit_test(test_macro_and_call),
        cmocka_unit_test(test_tests),
        cmocka_unit_test(test_filters),
        cmocka_unit_test(test_tojson),
        cmocka_unit_test(test_string_methods),
        cmocka_unit_test(test_whitespace_control),
        cmocka_unit_test(test_whitespace_flags),
        cmocka_unit_test(test_generation_tag_and_escape),
        cmocka_unit_test(test_syntax_errors_name_position),
        cmocka_unit_test(test_render_errors_name_position),
        cmocka_unit_test(test_raise_exception),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_qwen3_chat_cases),
        cmocka_unit_test(test_concurrent_renders),
        cmocka_unit_test(test_builtin_families),
        cmocka_unit_test(test_load_from_model_dir),
        cmocka_unit_test(test_request_variables),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
