/* tokenizer_json.h: a small, fast JSON reader for tokenizer files (internal to
 * text/tokenizer*.c). A tokenizer.json holds hundreds of thousands of strings; a general DOM
 * with a malloc per value and a hash table per object spends most of a load in the allocator,
 * so this one parses into one array of values with strings unescaped in place. Lookups in an
 * object are linear: fine for the small objects a loader looks keys up in; big containers are
 * walked with first/next. */
#ifndef KVF_TEXT_TOKENIZER_JSON_H
#define KVF_TEXT_TOKENIZER_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum kvf_text_tok_jtype {
    KVF_TEXT_TOK_JNULL,
    KVF_TEXT_TOK_JFALSE,
    KVF_TEXT_TOK_JTRUE,
    KVF_TEXT_TOK_JNUM,
    KVF_TEXT_TOK_JSTR,
    KVF_TEXT_TOK_JARR,
    KVF_TEXT_TOK_JOBJ,
} kvf_text_tok_jtype;

/* One value. Children and siblings are found by offsets from the value itself, so a value
 * pointer is all a reader needs. In an object the children alternate key (a string), value. */
typedef struct kvf_text_tok_jv {
    uint8_t type;   /* kvf_text_tok_jtype */
    uint8_t is_int; /* JNUM written without fraction or exponent, and fits int64 */
    uint32_t len;   /* JSTR: bytes; JARR: elements; JOBJ: pairs */
    int32_t first;  /* JARR/JOBJ: offset to the first child, 0 when empty */
    int32_t next;   /* offset to the next sibling, 0 for the last */
    union {
        const char *s; /* JSTR: the unescaped bytes, NUL-terminated (may hold NULs) */
        int64_t i;     /* JNUM with is_int */
    };
    double d; /* JNUM */
} kvf_text_tok_jv;

/* A parsed document: owns a copy of the text and the value array. */
typedef struct kvf_text_tok_jdoc {
    char *buf;
    kvf_text_tok_jv *vals;
    size_t n, cap;
} kvf_text_tok_jdoc;

/* Parses text[len] (any top-level value). On failure the message names what (a file name),
 * the line and column, and what was expected; the doc is left empty. Nesting is limited to
 * 256 levels. */
kvf_status kvf_text_tok_json_parse(const char *text, size_t len, const char *what, kvf_text_tok_jdoc *doc,
                              kvf_err *err);
/* The same, parsing buf in place: takes buf (malloc'd, len + 1 bytes, buf[len] == 0) in every case. */
kvf_status kvf_text_tok_json_parse_owned(char *buf, size_t len, const char *what, kvf_text_tok_jdoc *doc,
                                    kvf_err *err);
void kvf_text_tok_json_free(kvf_text_tok_jdoc *doc);
/* The root value, or NULL for an empty doc. */
const kvf_text_tok_jv *kvf_text_tok_json_root(const kvf_text_tok_jdoc *doc);

/* Accessors take NULL and then answer "absent". */
const kvf_text_tok_jv *kvf_text_tok_jget(const kvf_text_tok_jv *obj, const char *key); /* NULL if absent */
const kvf_text_tok_jv *kvf_text_tok_jfirst(const kvf_text_tok_jv *container);          /* NULL if empty */
const kvf_text_tok_jv *kvf_text_tok_jnext(const kvf_text_tok_jv *v);                   /* NULL after the last */
const kvf_text_tok_jv *kvf_text_tok_jat(const kvf_text_tok_jv *arr, size_t i);         /* linear; small arrays */
size_t kvf_text_tok_jsize(const kvf_text_tok_jv *v); /* elements or pairs; 0 otherwise */
const char *kvf_text_tok_jstr(const kvf_text_tok_jv *v); /* NULL unless a string */
bool kvf_text_tok_jis(const kvf_text_tok_jv *v, kvf_text_tok_jtype t);
bool kvf_text_tok_jtrue(const kvf_text_tok_jv *v);
/* "a string", "an integer", "null" (also for an absent value), ... for messages. */
const char *kvf_text_tok_jkind(const kvf_text_tok_jv *v);

#endif
