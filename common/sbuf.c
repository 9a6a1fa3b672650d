/* sbuf.c: growable buffer. */
#include "common/sbuf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvf_sbuf_init(kvf_sbuf *b) { memset(b, 0, sizeof *b); }

void kvf_sbuf_fini(kvf_sbuf *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

void kvf_sbuf_reset(kvf_sbuf *b)
{
    b->len = 0;
    b->oom = false;
    if (b->data)
        b->data[0] = '\0';
}

kvf_status kvf_sbuf_reserve(kvf_sbuf *b, size_t extra)
{
    if (b->oom)
        return KVF_ERR_NOMEM;
    if (b->len + extra + 1 <= b->cap)
        return KVF_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) {
        b->oom = true;
        return KVF_ERR_NOMEM;
    }
    b->data = p;
    b->cap = cap;
    return KVF_OK;
}

kvf_status kvf_sbuf_append(kvf_sbuf *b, const void *data, size_t n)
{
    if (kvf_sbuf_reserve(b, n) != KVF_OK)
        return KVF_ERR_NOMEM;
    if (n)
        memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = '\0';
    return KVF_OK;
}

kvf_status kvf_sbuf_puts(kvf_sbuf *b, const char *s) { return kvf_sbuf_append(b, s, strlen(s)); }

kvf_status kvf_sbuf_putc(kvf_sbuf *b, char c) { return kvf_sbuf_append(b, &c, 1); }

kvf_status kvf_sbuf_vprintf(kvf_sbuf *b, const char *fmt, va_list ap)
{
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    if (n < 0)
        return KVF_ERR_INVALID;
    if (kvf_sbuf_reserve(b, (size_t)n) != KVF_OK)
        return KVF_ERR_NOMEM;
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    b->len += (size_t)n;
    return KVF_OK;
}

kvf_status kvf_sbuf_printf(kvf_sbuf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvf_status st = kvf_sbuf_vprintf(b, fmt, ap);
    va_end(ap);
    return st;
}

char *kvf_sbuf_take(kvf_sbuf *b)
{
    if (!b->data && kvf_sbuf_reserve(b, 0) != KVF_OK)
        return NULL;
    char *p = b->data;
    p[b->len] = '\0';
    memset(b, 0, sizeof *b);
    return p;
}

kvf_status kvf_sbuf_read_file(kvf_sbuf *b, const char *path, kvf_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvf_err_set(err, KVF_ERR_IO, "cannot open %s", path);
    char chunk[65536];
    size_t got;
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0)
        kvf_sbuf_append(b, chunk, got);
    bool bad = ferror(f) != 0;
    fclose(f);
    if (bad)
        return kvf_err_set(err, KVF_ERR_IO, "cannot read %s", path);
    if (b->oom)
        return kvf_err_set(err, KVF_ERR_NOMEM, "out of memory reading %s", path);
    return KVF_OK;
}
