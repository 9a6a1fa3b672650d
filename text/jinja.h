/* jinja.h: a small interpreter for the part of Jinja that Hugging Face chat templates use:
 * compile a template once, render it many times (from many threads) with variables given as
 * JSON. Chat-specific policy (which template, which variables) lives in chat_template.h.
 *
 * What it runs, with Jinja 3's meaning (Python's for values, str() and repr()):
 *   {{ }} {% %} {# #} with -, + and the trim_blocks / lstrip_blocks options; \r\n becomes \n and
 *   one trailing newline is dropped, as Jinja does; raw.
 *   for (tuple targets, `if` filter, else, loop.index/index0/revindex/revindex0/first/last/
 *   length/previtem/nextitem/cycle, break, continue), if/elif/else, set (names, tuples,
 *   namespace attributes, blocks), macro (defaults, keywords), call (with caller(args)),
 *   filter blocks, and transformers' {% generation %}.
 *   Expressions: literals, lists, tuples, dicts, .attr, [item], slices, calls, and/or/not,
 *   comparisons (chained), in / not in, + - * / // % **, ~, x if c else y.
 *   Tests: defined undefined none string mapping iterable sequence number integer float
 *   boolean true false callable odd even divisibleby eq ne lt le gt ge in sameas lower upper.
 *   Filters: trim length count tojson (indent, separators, sort_keys, ensure_ascii, as
 *   json.dumps) string lower upper capitalize title join first last default items list
 *   replace indent safe escape abs int float round reverse unique sort dictsort map select
 *   reject selectattr rejectattr sum min max wordcount.
 *   Methods: str startswith endswith strip lstrip rstrip split rsplit splitlines title upper
 *   lower capitalize replace join find count isspace isdigit isalpha isupper islower; dict
 *   items keys values get.
 *   Globals: raise_exception, namespace, range, dict, strftime_now.
 * Not there: recursive loops, extends/include/import, string % formatting, the format filter.
 * Lists and dicts are immutable, as in transformers' sandbox. */
#ifndef KVF_TEXT_JINJA_H
#define KVF_TEXT_JINJA_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct kvf_text_jinja kvf_text_jinja;

/* Compile flags: the environment options transformers sets (both on for chat templates). */
#define KVF_TEXT_JINJA_TRIM_BLOCKS 1u  /* drop the first newline after a block or comment tag */
#define KVF_TEXT_JINJA_LSTRIP_BLOCKS 2u /* drop spaces/tabs before a block or comment tag */

/* Bounds on one render, so a hostile template cannot hang or exhaust a worker. Zero fields take
 * the defaults in brackets. */
typedef struct kvf_text_jinja_limits {
    size_t max_output;     /* bytes of output, and of any one string built [8 MiB] */
    int64_t max_iters;     /* loop iterations over the whole render, and items in range() [1M] */
    int64_t max_steps;     /* expression and statement evaluations [20M] */
    int32_t max_depth;     /* nesting of evaluation, macro calls included [256] */
} kvf_text_jinja_limits;

/* Compiles src[0..len). A syntax error gives KVF_ERR_PARSE with a message
 * "line L col C: <what was unexpected>". *out is the caller's: kvf_text_jinja_destroy. */
kvf_status kvf_text_jinja_compile(const char *src, size_t len, unsigned flags,
                                   kvf_text_jinja **out, kvf_err *err);
void kvf_text_jinja_destroy(kvf_text_jinja *t); /* NULL is fine */

/* Renders with vars (a JSON object: each key is a template variable; NULL for none). Globals
 * raise_exception, namespace, range, dict and strftime_now are always there. Recursion is
 * bounded by max_depth; at the default a render needs well under 1 MiB of stack. Statuses:
 *   KVF_ERR_INVALID  the template called raise_exception(msg): err->msg is msg exactly;
 *   KVF_ERR_LIMIT    a limit was hit (the message names it);
 *   KVF_ERR_STATE    any other evaluation error ("line L col C: ...");
 *   KVF_ERR_NOMEM.
 * *out is malloc'd and NUL-terminated (free it); *len_out (may be NULL) its length. */
kvf_status kvf_text_jinja_render(const kvf_text_jinja *t, const json_t *vars,
                                  const kvf_text_jinja_limits *limits, char **out,
                                  size_t *len_out, kvf_err *err);

#endif
