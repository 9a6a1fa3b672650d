/* tokenizer_internal.h: the loaded form of a tokenizer.json, shared by the tokenizer's own files
 * (load, encode, decode, default writer). Not for use outside text/tokenizer*.c: the public
 * API is text/tokenizer.h. */
#ifndef KVF_TEXT_TOKENIZER_INTERNAL_H
#define KVF_TEXT_TOKENIZER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/sbuf.h"
#include "common/status.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

/* Largest id a tokenizer may use: bounds allocations made from untrusted files. */
#define KVF_TEXT_TOK_MAX_ID (1 << 21)

/* string -> id, open addressing over ids; the strings live in the owner's arena. */
typedef struct kvf_text_tok_strmap {
    int32_t *slots; /* [cap] id, or -1 for empty */
    size_t cap;     /* power of two */
    size_t n;
} kvf_text_tok_strmap;

/* (left id, right id) -> (rank, merged id). */
typedef struct kvf_text_tok_merge {
    uint64_t key; /* left << 32 | right; UINT64_MAX for an empty slot */
    int32_t rank, id;
} kvf_text_tok_merge;

typedef struct kvf_text_tok_mergemap {
    kvf_text_tok_merge *slots; /* [cap] */
    size_t cap;           /* power of two */
    size_t n;
} kvf_text_tok_mergemap;

typedef enum kvf_text_tok_norm_kind {
    KVF_TEXT_TOK_NORM_NFC,
    KVF_TEXT_TOK_NORM_NFD,
    KVF_TEXT_TOK_NORM_NFKC,
    KVF_TEXT_TOK_NORM_NFKD,
    KVF_TEXT_TOK_NORM_LOWERCASE,
    KVF_TEXT_TOK_NORM_PREPEND,
    KVF_TEXT_TOK_NORM_REPLACE,
} kvf_text_tok_norm_kind;

typedef struct kvf_text_tok_norm {
    kvf_text_tok_norm_kind kind;
    char *a, *b; /* PREPEND: a = text; REPLACE: a = pattern, b = content */
    size_t a_len, b_len;
} kvf_text_tok_norm;

typedef enum kvf_text_tok_pre_kind {
    KVF_TEXT_TOK_PRE_SPLIT,     /* regex or literal split */
    KVF_TEXT_TOK_PRE_BYTELEVEL, /* optional prefix space + GPT-2 regex; marks the model byte-level */
    KVF_TEXT_TOK_PRE_METASPACE, /* ' ' -> replacement, optional prepend, optional split */
    KVF_TEXT_TOK_PRE_DIGITS,    /* runs of digits, or each digit alone */
} kvf_text_tok_pre_kind;

typedef enum kvf_text_tok_split_behavior {
    KVF_TEXT_TOK_SPLIT_ISOLATED,
    KVF_TEXT_TOK_SPLIT_REMOVED,
    KVF_TEXT_TOK_SPLIT_MERGED_PREV,
    KVF_TEXT_TOK_SPLIT_MERGED_NEXT,
} kvf_text_tok_split_behavior;

typedef enum kvf_text_tok_prepend {
    KVF_TEXT_TOK_PREPEND_ALWAYS,
    KVF_TEXT_TOK_PREPEND_FIRST,
    KVF_TEXT_TOK_PREPEND_NEVER,
} kvf_text_tok_prepend;

typedef struct kvf_text_tok_pre {
    kvf_text_tok_pre_kind kind;
    void *re; /* pcre2_code_8 * (SPLIT, BYTELEVEL with use_regex) or NULL */
    kvf_text_tok_split_behavior behavior;
    bool add_prefix_space;   /* BYTELEVEL */
    char *repl;              /* METASPACE replacement (UTF-8) */
    size_t repl_len;
    kvf_text_tok_prepend prepend; /* METASPACE */
    bool split;              /* METASPACE: split before each replacement */
    bool individual;         /* DIGITS */
} kvf_text_tok_pre;

typedef struct kvf_text_tok_added {
    char *content;
    size_t len;
    int32_t id;
    bool special;
    bool lstrip, rstrip; /* the match swallows the whitespace on its left / right */
} kvf_text_tok_added;

struct kvf_text_tokenizer {
    /* model vocabulary: id -> string (arena offsets; len -1 for an unused id) */
    int32_t n_ids;     /* vocab size: max id + 1 over vocab and added tokens */
    int64_t *str_off;  /* [n_ids] */
    int32_t *str_len;  /* [n_ids]; -1 when the id has no model token */
    kvf_sbuf strs;     /* arena of NUL-terminated token strings */
    kvf_text_tok_strmap vocab;
    kvf_text_tok_mergemap merges;

    /* BPE options */
    bool byte_level;      /* initial symbols are bytes through the GPT-2 byte map */
    bool word_split;      /* no pre-tokenizer, and no token has "▁" after another character:
                           * BPE may run word by word (before each "▁") with the same result */
    bool byte_fallback;   /* unknown chars become <0xNN> tokens */
    bool fuse_unk;
    bool ignore_merges;
    int32_t unk_id;       /* -1 when none */
    int32_t byte_id[256]; /* byte-level: id of each byte's mapped char; fallback: <0xNN>; -1 */

    /* pipeline */
    kvf_text_tok_norm *norms;
    size_t n_norms;
    kvf_text_tok_pre *pres;
    size_t n_pres;
    kvf_text_tok_added *added; /* sorted by content length, longest first */
    size_t n_added;
    bool added_first[256]; /* bytes that start some added token */
    size_t *added_lens;    /* distinct content lengths, longest first */
    size_t n_added_lens;
    kvf_text_tok_strmap added_map; /* content -> index into added */
    uint8_t *is_special;      /* [n_ids] */
    int32_t *added_idx;       /* [n_ids] index into added, or -1 */
    int32_t *prefix_ids, *suffix_ids; /* post-processor: added around the text */
    size_t n_prefix, n_suffix;

    /* decoding: the bytes each id decodes to, before UTF-8 repair */
    int64_t *dec_off; /* [n_ids] into dec */
    int32_t *dec_len; /* [n_ids] */
    kvf_sbuf dec;
    int32_t strip_start; /* leading spaces the decoder strips from the whole text */

    /* companions */
    char *bos_token, *eos_token, *pad_token, *chat_template;
    int32_t bos_id, eos_id, pad_id;
    int32_t *eos_ids;
    size_t n_eos_ids;
};

/* The GPT-2 byte-to-unicode map: the code point byte b stands for in byte-level vocabularies. */
uint32_t kvf_text_tok_byte_to_cp(uint8_t b);
/* Inverse: the byte a code point stands for, or -1. */
int kvf_text_tok_cp_to_byte(uint32_t cp);

/* Maps. */
kvf_status kvf_text_tok_strmap_init(kvf_text_tok_strmap *m, size_t expect);
void kvf_text_tok_strmap_fini(kvf_text_tok_strmap *m);
int32_t kvf_text_tok_vocab_find(const kvf_text_tokenizer *tok, const char *s, size_t len);
int32_t kvf_text_tok_added_find(const kvf_text_tokenizer *tok, const char *s, size_t len);
const kvf_text_tok_added *kvf_text_tok_added_lookup(const kvf_text_tokenizer *tok, const char *s, size_t len);
const kvf_text_tok_merge *kvf_text_tok_merge_find(const kvf_text_tok_mergemap *m, int32_t a, int32_t b);

/* The GPT-2 pre-tokenizer regex ByteLevel uses with use_regex. */
extern const char kvf_text_tok_gpt2_regex[];

#endif
