/* grammar.h: constrained decoding's grammars (issue 24). One grammar form for everything a
 * request may constrain its output with (a JSON schema, "any JSON object", a regular expression,
 * a choice among strings): rules whose bodies are expressions over bytes and references to
 * rules, executed as a pushdown automaton over bytes. A matcher follows one sequence's output
 * through a grammar; over a vocabulary (the tokenizer's token bytes in a trie) it gives the set
 * of tokens that keep the output inside the grammar as a bitset, cached per automaton state.
 *
 * Threads: compiling is reentrant. A grammar's mask cache is written by its matchers, so a
 * grammar, its matchers and a vocabulary used with them belong to one thread at a time (a
 * worker's engine thread; the router only compiles, to refuse bad input, and destroys).
 *
 * Hostile input: schema and regex text come from clients. Compiling bounds the grammar's size
 * (KVF_TEXT_GRAMMAR_MAX_NODES after repetitions are expanded) and nesting depth, and refuses
 * past them with an error naming the cause; running bounds the automaton's stack depth and the
 * number of live stacks (an error from accept/mask, never unbounded memory or time). No input
 * aborts the process. */
#ifndef KVF_TEXT_GRAMMAR_H
#define KVF_TEXT_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "text/tokenizer.h"

#define KVF_TEXT_GRAMMAR_MAX_NODES (1 << 18) /* expression nodes after expansion */
#define KVF_TEXT_GRAMMAR_MAX_DEPTH 128       /* nesting of a schema or a regex */
#define KVF_TEXT_GRAMMAR_MAX_STACKS 1024     /* live automaton stacks of one matcher */
#define KVF_TEXT_GRAMMAR_MAX_STACK 256       /* rule references open at once */

typedef struct kvf_text_grammar kvf_text_grammar; /* compiled: immutable but for its mask cache */
typedef struct kvf_text_gb kvf_text_gb;           /* a grammar being built */
typedef struct kvf_text_gx kvf_text_gx;           /* an expression; owned by its builder */

/* ---- building (what the regex and schema compilers use) ----
 * Expression constructors return NULL only when memory runs out or a limit is passed; the
 * builder remembers the first such failure and kvf_text_gb_finish reports it, so callers may
 * chain constructors and check once. Expressions may be shared between parents. */
kvf_status kvf_text_gb_create(kvf_text_gb **out, kvf_err *err);
void kvf_text_gb_destroy(kvf_text_gb *b); /* NULL is fine; grammars built from it live on */

/* A new rule, defined later with kvf_text_gb_define (so rules may refer to each other and to
 * themselves, as JSON Schema's $ref and nested values need). A rule's body must not be able to
 * reach a reference to itself without consuming a byte first (no left recursion):
 * kvf_text_gb_finish refuses such a grammar by name. */
int32_t kvf_text_gb_rule(kvf_text_gb *b);
kvf_status kvf_text_gb_define(kvf_text_gb *b, int32_t rule, kvf_text_gx *body, kvf_err *err);
/* Optional: a name for a rule that errors use ("rule 3 (/properties/a) is left-recursive"), such
 * as a schema's JSON pointer; copied (up to 200 bytes). */
kvf_status kvf_text_gb_rule_name(kvf_text_gb *b, int32_t rule, const char *name);

kvf_text_gx *kvf_text_gx_lit(kvf_text_gb *b, const void *bytes, size_t n); /* n == 0: empty */
kvf_text_gx *kvf_text_gx_bytes(kvf_text_gb *b, uint8_t lo, uint8_t hi);   /* one byte in [lo, hi] */
/* One character: the UTF-8 encoding of a code point in one of the n ranges [lo, hi] (inclusive),
 * or with negate, of any code point 0..0x10FFFF in none of them. Surrogates (D800-DFFF) are never
 * matched. */
kvf_text_gx *kvf_text_gx_chars(kvf_text_gb *b, const uint32_t (*ranges)[2], size_t n,
                               bool negate);
kvf_text_gx *kvf_text_gx_seq(kvf_text_gb *b, kvf_text_gx *const *xs, size_t n); /* 0: empty */
kvf_text_gx *kvf_text_gx_alt(kvf_text_gb *b, kvf_text_gx *const *xs, size_t n); /* 0: nothing */
/* x repeated min..max times; max -1: unbounded. */
kvf_text_gx *kvf_text_gx_rep(kvf_text_gb *b, kvf_text_gx *x, int32_t min, int32_t max);
kvf_text_gx *kvf_text_gx_ref(kvf_text_gb *b, int32_t rule);
/* One of n byte strings (lens[i] bytes each; lens NULL: NUL-terminated), with shared prefixes
 * merged so that a state stays a few stacks however many strings there are. For enums and
 * choices. kvf_text_gx_alt of 8 or more literals (kvf_text_gx_lit) merges them the same way;
 * an alternation of other expressions keeps a stack per live branch, and past
 * KVF_TEXT_GRAMMAR_MAX_STACKS of them compiling (or a step) fails. */
kvf_text_gx *kvf_text_gx_choice(kvf_text_gb *b, const char *const *strs, const size_t *lens,
                                size_t n);

/* The grammar whose language is root's. Every rule referred to must be defined. A grammar no
 * output can match is refused, and branches that can never end (an empty choice or class) are
 * pruned, so a byte or token a matcher allows never leads into a dead end. b may be destroyed
 * afterwards (or used for nothing else). */
kvf_status kvf_text_gb_finish(kvf_text_gb *b, kvf_text_gx *root, kvf_text_grammar **out,
                              kvf_err *err);

void kvf_text_grammar_destroy(kvf_text_grammar *g); /* NULL is fine */

/* For benchmarks and metrics: the automaton's states, and its mask cache (entries, bytes held,
 * lookups that hit and that missed). */
typedef struct kvf_text_grammar_stats {
    int32_t n_states;
    size_t cache_entries, cache_bytes;
    uint64_t cache_hits, cache_misses;
} kvf_text_grammar_stats;
void kvf_text_grammar_stats_get(const kvf_text_grammar *g, kvf_text_grammar_stats *out);

/* ---- compilers ----
 * Errors name what was wrong in err->msg, in words a client can act on (the keyword, the
 * offset in the regex); they never carry server paths. */

/* A regular expression, matched against the whole output (as vLLM's guided_regex: the output is
 * one match, as if anchored at both ends). Syntax: the common subset of Python's re and
 * ECMAScript: literals; escapes \\ \. \n \t \r \f \v \0 \xHH \uHHHH \u{H...} and escaped
 * punctuation; \d \D \w \W \s \S (ASCII classes); "." (any character but \n); classes [...]
 * with ranges, negation and the escapes above; groups ( ), (?: ) and named (?P<n> ) / (?<n> );
 * alternation |; quantifiers * + ? {m} {m,} {m,n} (a lazy suffix ? is accepted: the language
 * is the same); ^ at the very start and $ at the very end. Anything else (backreferences,
 * lookaround, \b, inline flags, possessive quantifiers, which change the language, {,n}, which
 * Python and ECMAScript read differently, ^ or $ elsewhere) is refused by name with its
 * offset. Characters are code points, encoded as UTF-8; \v is U+000B (as in Python and
 * ECMAScript, not PCRE's vertical-space class). */
kvf_status kvf_text_regex_compile(kvf_text_gb *b, const char *re, size_t len,
                                  kvf_text_gx **out, kvf_err *err);
kvf_status kvf_text_grammar_regex(const char *re, size_t len, kvf_text_grammar **out,
                                  kvf_err *err);

/* One of n strings, exactly (vLLM's guided_choice). n >= 1. */
kvf_status kvf_text_grammar_choice(const char *const *choices, const size_t *lens, size_t n,
                                   kvf_text_grammar **out, kvf_err *err);

/* JSON text valid under a JSON Schema given as JSON text. Supported keywords: type (a name or a
 * list, "null" included), properties, required, additionalProperties (false, true, or a schema),
 * items, prefixItems, minItems, maxItems, enum, const, anyOf, oneOf (as anyOf), allOf of one
 * schema, string minLength / maxLength / pattern / format (date, time, date-time, uuid, email as
 * patterns), integer and number minimum / maximum / exclusiveMinimum / exclusiveMaximum where a
 * grammar can express them, local $ref ("#", "#/$defs/x", "#/definitions/x"), and the
 * annotations that do not constrain (title, description, default, examples, $schema, $id,
 * $comment). Any other keyword is refused by name ("unsupported JSON Schema keyword
 * \"if\" at /properties/a"). An empty schema {} or true is any JSON value. The output is JSON
 * with properties in the schema's order (required ones always present, optional ones may be
 * left out) and whitespace bounded: at most one " " or one "\n" followed by up to 20 spaces or
 * tabs between tokens, so a model cannot spend its budget on blanks. */
kvf_status kvf_text_grammar_schema(const char *schema, size_t len, kvf_text_grammar **out,
                                   kvf_err *err);
/* Any JSON object ({"type": "object"} with any properties): response_format json_object. */
kvf_status kvf_text_grammar_json_object(kvf_text_grammar **out, kvf_err *err);

/* ---- vocabulary and matching ---- */

/* A tokenizer's tokens as a trie of their bytes (kvf_text_tokenizer_token_bytes), for ids
 * 0..n_ids-1, n_ids the model's vocabulary (ids the tokenizer does not have are never allowed).
 * Special tokens (kvf_text_tokenizer_is_special) and tokens of no bytes are never allowed by a
 * mask except as end ids (below). Independent of any grammar; build it once per tokenizer. */
typedef struct kvf_text_vocab kvf_text_vocab;
kvf_status kvf_text_vocab_create(const kvf_text_tokenizer *tok, int32_t n_ids,
                                 kvf_text_vocab **out, kvf_err *err);
void kvf_text_vocab_destroy(kvf_text_vocab *v); /* NULL is fine */
int32_t kvf_text_vocab_size(const kvf_text_vocab *v); /* n_ids */
/* Words of a mask over v: (n_ids + 31) / 32. Bit (id % 32) of word id / 32 set: id allowed. */
size_t kvf_text_vocab_mask_words(const kvf_text_vocab *v);

/* One sequence's position in a grammar. end_ids (EOS and stop ids, copied) are allowed exactly
 * where the output so far is a complete match; accepting one ends the match (done). g and v must
 * outlive the matcher. v may be NULL for a matcher that only follows bytes (no masks, no
 * accept by id). */
typedef struct kvf_text_matcher kvf_text_matcher;
kvf_status kvf_text_matcher_create(kvf_text_grammar *g, const kvf_text_vocab *v,
                                   const int32_t *end_ids, size_t n_end,
                                   kvf_text_matcher **out, kvf_err *err);
void kvf_text_matcher_destroy(kvf_text_matcher *m); /* NULL is fine */
/* A copy at the same position (for parallel samples of one prompt). */
kvf_status kvf_text_matcher_clone(const kvf_text_matcher *m, kvf_text_matcher **out,
                                  kvf_err *err);
/* Back to the start of the grammar. */
void kvf_text_matcher_reset(kvf_text_matcher *m);

/* The ids allowed next, into mask[kvf_text_vocab_mask_words(v)]: a token is allowed when all
 * its bytes can follow the output so far inside the grammar; end ids when the output is a
 * complete match. Cached per automaton state in the grammar (a state reached again costs a
 * lookup and a copy). Once an end id was accepted, nothing is allowed. An error only past a
 * running bound. The cache holds at most 64 MiB of keys and masks per grammar; when a new mask
 * would pass that, it is emptied and starts again. */
kvf_status kvf_text_matcher_mask(kvf_text_matcher *m, uint32_t *mask, kvf_err *err);
/* Advances on token id. KVF_ERR_INVALID (naming the id) and no change when the mask would not
 * allow it. */
kvf_status kvf_text_matcher_accept(kvf_text_matcher *m, int32_t id, kvf_err *err);
/* Advances on bytes (tests, benches, replay of text): KVF_ERR_INVALID and no change when they
 * cannot follow. */
kvf_status kvf_text_matcher_accept_bytes(kvf_text_matcher *m, const void *bytes, size_t n,
                                         kvf_err *err);
/* The bytes that can come next (one step each, exact), into set: bit (b % 32) of set[b / 32].
 * For tests, fuzzing and tools that walk a grammar byte by byte; the engine uses masks. */
kvf_status kvf_text_matcher_next_bytes(kvf_text_matcher *m, uint32_t set[8], kvf_err *err);
/* The output so far is a complete match (an end id would be allowed). */
bool kvf_text_matcher_accepting(const kvf_text_matcher *m);
/* An end id was accepted, or the output is complete and no byte can follow it (then only end
 * ids are allowed; once one is accepted, nothing is). */
bool kvf_text_matcher_done(const kvf_text_matcher *m);

#endif
