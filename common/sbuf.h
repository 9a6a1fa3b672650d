/* sbuf.h: a growable byte/string buffer (always NUL-terminated). The caller owns the struct;
 * kvf_sbuf_fini frees the bytes. A failed allocation sets `oom` and later appends do nothing. */
#ifndef KVF_COMMON_SBUF_H
#define KVF_COMMON_SBUF_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

typedef struct kvf_sbuf {
    char *data; /* NUL-terminated when len > 0 or after any append */
    size_t len, cap;
    bool oom;
} kvf_sbuf;

void kvf_sbuf_init(kvf_sbuf *b);
void kvf_sbuf_fini(kvf_sbuf *b);
void kvf_sbuf_reset(kvf_sbuf *b); /* len = 0, keeps capacity */
kvf_status kvf_sbuf_reserve(kvf_sbuf *b, size_t extra);
kvf_status kvf_sbuf_append(kvf_sbuf *b, const void *data, size_t n);
kvf_status kvf_sbuf_puts(kvf_sbuf *b, const char *s);
kvf_status kvf_sbuf_putc(kvf_sbuf *b, char c);
kvf_status kvf_sbuf_printf(kvf_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
kvf_status kvf_sbuf_vprintf(kvf_sbuf *b, const char *fmt, va_list ap);
/* Hands the bytes to the caller (free() them); the buffer is left empty. */
char *kvf_sbuf_take(kvf_sbuf *b);
/* Appends the whole file at path. KVF_ERR_IO naming the path when it cannot be opened or read,
 * KVF_ERR_NOMEM when the buffer cannot grow. */
kvf_status kvf_sbuf_read_file(kvf_sbuf *b, const char *path, kvf_err *err);

#endif
