/* tokenizer.h: Hugging Face tokenizer.json (BPE: byte-level with a regex split, and
 * SentencePiece-style with byte fallback), its tokenizer_config.json / generation_config.json
 * (BOS, EOS, special tokens), a streaming detokenizer, and a writer for a small default tokenizer.
 * Chat templates live elsewhere; this file only turns text into ids and back. */
#ifndef KVF_TEXT_TOKENIZER_H
#define KVF_TEXT_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/sbuf.h"
#include "common/status.h"

/* Immutable once loaded: every function taking a const tokenizer is safe to call from many
 * threads at once. */
typedef struct kvf_text_tokenizer kvf_text_tokenizer;

/* Supported tokenizer.json parts (anything else is refused with KVF_ERR_UNSUPPORTED naming it):
 *   model: BPE (vocab + merges as "a b" or ["a", "b"]; byte_fallback, unk_token, fuse_unk,
 *     ignore_merges); normalizer: NFC, NFD, NFKC, NFKD (utf8proc), Lowercase, Prepend,
 *     Replace (String pattern), Sequence; pre_tokenizer: Split (PCRE2 with Unicode properties;
 *     Isolated, Removed, MergedWithPrevious, MergedWithNext), ByteLevel, Metaspace, Digits,
 *     Sequence; post_processor: TemplateProcessing, ByteLevel, Roberta/BertProcessing, Sequence;
 *     decoder: ByteLevel, ByteFallback, Fuse, Strip (leading spaces), Replace, Metaspace.
 *   Added tokens are matched in the raw text, lstrip/rstrip swallowing whitespace beside
 *   them; their single_word/normalized flags are not applied. Characters with no token and no unk/byte fallback are dropped, as Hugging
 *   Face does. Ids are limited to 0..2^21-1. */

/* Loads a tokenizer. path is either a model directory (reads DIR/tokenizer.json and, when
 * present, DIR/tokenizer_config.json and DIR/generation_config.json) or a tokenizer.json file
 * (the two companions are then looked for beside it). A malformed or unsupported file gives
 * KVF_ERR_PARSE / KVF_ERR_INVALID / KVF_ERR_UNSUPPORTED with a message naming the file and the
 * field. *out is the caller's: free it with kvf_text_tokenizer_destroy. */
kvf_status kvf_text_tokenizer_load(const char *path, kvf_text_tokenizer **out, kvf_err *err);

/* The same from memory. config_json (tokenizer_config.json) and gen_json
 * (generation_config.json) may be NULL. Used by the fuzz target. */
kvf_status kvf_text_tokenizer_load_buf(const char *tok_json, size_t tok_len,
                                        const char *config_json, size_t config_len,
                                        const char *gen_json, size_t gen_len,
                                        kvf_text_tokenizer **out, kvf_err *err);

void kvf_text_tokenizer_destroy(kvf_text_tokenizer *tok); /* NULL is fine */

/* Encodes len bytes of UTF-8 text. Added tokens (special or not, e.g. "<|im_start|>",
 * "<think>", "<s>") written in the text are matched first, leftmost-longest, as Hugging Face
 * does. add_special adds the tokenizer's default special tokens (its post-processor: Mistral's
 * BOS; nothing for Qwen). Text that is not valid UTF-8 gives KVF_ERR_INVALID naming the byte
 * offset. *ids_out is malloc'd (free it; non-NULL even when *n_out is 0). */
kvf_status kvf_text_tokenizer_encode(const kvf_text_tokenizer *tok, const char *text,
                                      size_t len, bool add_special, int32_t **ids_out,
                                      size_t *n_out, kvf_err *err);

/* Decodes ids to UTF-8 text, as Hugging Face's decode with clean_up_tokenization_spaces=false.
 * skip_special drops special tokens. Bytes that do not form valid UTF-8 become U+FFFD, one per
 * maximal invalid sequence (as Hugging Face's byte-level decoder; its byte-fallback decoder
 * writes one per byte, so runs of broken <0xNN> tokens may differ in the count). An id
 * outside [0, vocab size) gives KVF_ERR_INVALID. *text_out is malloc'd and NUL-terminated
 * (free it); *len_out (may be NULL) is its length without the NUL. */
kvf_status kvf_text_tokenizer_decode(const kvf_text_tokenizer *tok, const int32_t *ids,
                                      size_t n, bool skip_special, char **text_out,
                                      size_t *len_out, kvf_err *err);

/* Vocabulary lookups. token_to_id takes the vocabulary form of a token ("<|im_end|>", "<s>",
 * "Ġworld", "▁Hello") and returns -1 when absent. id_to_token returns NULL for an id out of
 * range; the string is borrowed from tok. */
int32_t kvf_text_tokenizer_token_to_id(const kvf_text_tokenizer *tok, const char *token);
const char *kvf_text_tokenizer_id_to_token(const kvf_text_tokenizer *tok, int32_t id);
/* The bytes one id decodes to on its own (byte-level unmapped, "<0xNN>" as its byte, "\u2581" as
 * a space; no leading-space strip): what OpenAI's logprobs call a token's bytes, which may be a
 * part of a UTF-8 character. Borrowed; NULL (and *len_out 0) for an id out of range. */
const uint8_t *kvf_text_tokenizer_token_bytes(const kvf_text_tokenizer *tok, int32_t id,
                                              size_t *len_out);
/* Number of ids: one more than the largest id of the model vocabulary and the added tokens. */
int32_t kvf_text_tokenizer_vocab_size(const kvf_text_tokenizer *tok);
/* The most bytes of input text one token can stand for, so that any text of len bytes encodes to
 * at least len / this tokens and a text longer than n * this bytes can never fit in n tokens
 * (callers refuse such text before encoding it). It is the longest vocabulary form or added
 * token (at least 4, a character), times 4 when a Unicode normalizer or lowercasing may shorten
 * the text. 0 when no such bound holds: added tokens that swallow whitespace (lstrip/rstrip),
 * a Split that removes what it matches, a Replace that shortens text, or characters dropped or
 * fused into one unknown token. */
int64_t kvf_text_tokenizer_max_bytes_per_token(const kvf_text_tokenizer *tok);
/* True when id is an added token marked "special" (skipped by decode with skip_special). */
bool kvf_text_tokenizer_is_special(const kvf_text_tokenizer *tok, int32_t id);

/* Special tokens from tokenizer_config.json (bos_token, eos_token, pad_token, unk_token), with
 * generation_config.json's ids taking precedence for BOS and EOS. The strings are borrowed
 * from tok and NULL when the model has none (Qwen3 has no BOS); the ids are -1 then. */
const char *kvf_text_tokenizer_bos_token(const kvf_text_tokenizer *tok);
const char *kvf_text_tokenizer_eos_token(const kvf_text_tokenizer *tok);
const char *kvf_text_tokenizer_pad_token(const kvf_text_tokenizer *tok);
int32_t kvf_text_tokenizer_bos_id(const kvf_text_tokenizer *tok);
int32_t kvf_text_tokenizer_eos_id(const kvf_text_tokenizer *tok);
int32_t kvf_text_tokenizer_pad_id(const kvf_text_tokenizer *tok);
/* Every id that ends generation: generation_config.json's eos_token_id (a number or a list)
 * and tokenizer_config.json's eos_token. Borrowed from tok; *n_out may be 0. */
const int32_t *kvf_text_tokenizer_eos_ids(const kvf_text_tokenizer *tok, size_t *n_out);
/* The "chat_template" string of tokenizer_config.json, or NULL. Borrowed from tok. */
const char *kvf_text_tokenizer_chat_template(const kvf_text_tokenizer *tok);

/* Streaming detokenizer: feed ids as they are generated, get text out that never ends in half
 * a UTF-8 character. Bytes held back (at most 3) come out with the next feed or at finish;
 * invalid bytes become U+FFFD. The concatenation of everything appended equals
 * kvf_text_tokenizer_decode of all the ids fed. The detokenizer borrows tok (which must
 * outlive it) and is owned by one thread at a time. */
typedef struct kvf_text_detok kvf_text_detok;

kvf_status kvf_text_detok_create(const kvf_text_tokenizer *tok, bool skip_special,
                                  kvf_text_detok **out, kvf_err *err);
void kvf_text_detok_destroy(kvf_text_detok *d); /* NULL is fine */
/* Appends the complete UTF-8 text that ids [n] make available to out (which the caller owns).
 * On an invalid id nothing is appended and the state is unchanged. */
kvf_status kvf_text_detok_feed(kvf_text_detok *d, const int32_t *ids, size_t n,
                                kvf_sbuf *out, kvf_err *err);
/* Ends the stream: appends U+FFFD for a held-back incomplete character, then resets the
 * detokenizer for a new stream. */
kvf_status kvf_text_detok_finish(kvf_text_detok *d, kvf_sbuf *out, kvf_err *err);

/* Writes a small but real byte-level BPE tokenizer into dir (which must exist):
 * tokenizer.json and tokenizer_config.json. Ids 0-255 are the 256 bytes (GPT-2 byte-to-unicode
 * form), then merges learned deterministically from a built-in English sample, then the
 * special tokens <|begin_of_text|> (BOS), <|end_of_text|> (EOS), <|im_start|>, <|im_end|>, then
 * <|reserved_special_token_N|> fillers when the sample runs out of merges, so the vocabulary
 * has exactly vocab_size ids (at least 260). The same vocab_size always gives the same files.
 * tokenizer_config.json carries a ChatML chat_template, bos_token <|begin_of_text|> and eos_token
 * <|end_of_text|>; encode with add_special puts BOS first. A generation_config.json (gen-model's)
 * may add <|im_end|> to the EOS ids for chat. Look ids up with token_to_id after loading. */
#define KVF_TEXT_TOKENIZER_MIN_VOCAB 260
kvf_status kvf_text_tokenizer_write_default(const char *dir, int32_t vocab_size, kvf_err *err);

#endif
