/* utf8.h: small UTF-8 helpers shared by the tokenizer and its JSON reader (so neither includes
 * the other's internals). Plain byte work; classification (categories, case) is utf8proc's. */
#ifndef KVF_TEXT_UTF8_H
#define KVF_TEXT_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* Writes the UTF-8 of cp to out (4 bytes room) and returns its length (1-4). */
size_t kvf_text_utf8_put(uint32_t cp, char *out);
/* Length of the valid UTF-8 character at s[0..n) (shortest form, no surrogates, at most
 * U+10FFFF), or 0 when s does not start with one. */
size_t kvf_text_utf8_len(const uint8_t *s, size_t n);

#endif
