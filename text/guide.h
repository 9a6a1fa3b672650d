/* guide.h: what a request constrains its output with, by kind, compiled to a grammar
 * (text/grammar.h). The one place the kinds are read, so the router (which compiles a guide
 * to refuse a bad one with a 400) and the engine (which compiles it to decode) agree. */
#ifndef KVF_TEXT_GUIDE_H
#define KVF_TEXT_GUIDE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "text/grammar.h"

/* The same numbers as proto/kvfleet.proto's Guide.Kind. */
typedef enum kvf_text_guide_kind {
    KVF_TEXT_GUIDE_NONE = 0,
    KVF_TEXT_GUIDE_JSON_SCHEMA = 1, /* text: a JSON Schema */
    KVF_TEXT_GUIDE_REGEX = 2,       /* text: a regular expression the whole output matches */
    KVF_TEXT_GUIDE_CHOICE = 3,      /* text: a JSON array of strings; the output is one */
    KVF_TEXT_GUIDE_JSON_OBJECT = 4, /* any JSON object; no text */
} kvf_text_guide_kind;

#define KVF_TEXT_GUIDE_MAX_CHOICES 4096

/* "json_schema", "regex", "choice", "json_object", "none"; "?" for another value. */
const char *kvf_text_guide_kind_name(int32_t kind);

/* Compiles a guide. Errors (KVF_ERR_INVALID) name what was wrong in words a client can act on;
 * NONE or an unknown kind is refused too. */
kvf_status kvf_text_guide_compile(int32_t kind, const char *text, size_t len,
                                  kvf_text_grammar **out, kvf_err *err);

#endif
