/* frame.c: HTTP/1.x request framing on the wire (frame.h). Stricter than evhttp where the two
 * could disagree about where a request ends (whitespace before a colon, folded header lines,
 * two Content-Lengths, Transfer-Encoding other than chunked, or both framings at once): such a
 * request is refused here rather than read one way by us and another by evhttp. */
#include "router/frame.h"

#include <string.h>
#include <strings.h>

enum { C_SIZE, C_SIZE_LF, C_EXT, C_DATA, C_DATA_CR, C_DATA_LF, C_TR_START, C_TR_LINE, C_TR_LF, C_DONE };

#define MAX_SIZE_LINE 1024 /* a chunk-size line, its extension included */

static bool is_tchar(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

/* The length of the head at the start of p[len] (through its empty line), or 0. */
static size_t head_length(const char *p, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        if (p[i] != '\n')
            continue;
        if (i + 1 < len && p[i + 1] == '\n')
            return i + 2;
        if (i + 2 < len && p[i + 1] == '\r' && p[i + 2] == '\n')
            return i + 3;
    }
    return 0;
}

static void bad(kvf_router_frame *f, const char *why)
{
    f->kind = KVF_FRAME_BAD;
    f->why = why;
}

/* The request line, line[n] without its line end: METHOD SP TARGET SP HTTP/1.x */
static bool request_line(const char *line, size_t n, kvf_router_frame *f)
{
    size_t i = 0;
    while (i < n && is_tchar((unsigned char)line[i]))
        i++;
    size_t mlen = i;
    if (!mlen || mlen > 32 || i >= n || line[i] != ' ') {
        bad(f, "the request line does not start with a method");
        return false;
    }
    size_t t0 = ++i;
    while (i < n && (unsigned char)line[i] > ' ' && line[i] != 0x7f)
        i++;
    size_t t1 = i;
    if (t1 == t0 || i >= n || line[i] != ' ') {
        bad(f, "the request line has no target");
        return false;
    }
    i++;
    if (n - i != 8 || memcmp(line + i, "HTTP/1.", 7) || line[i + 7] < '0' || line[i + 7] > '9') {
        bad(f, "the request line does not end in HTTP/1.x");
        return false;
    }
    if ((mlen == 3 && !memcmp(line, "GET", 3)) || (mlen == 4 && !memcmp(line, "HEAD", 4))) {
        static const char *const paths[] = {"/health", "/ready", "/metrics"};
        for (size_t k = 0; k < sizeof paths / sizeof paths[0]; k++) {
            size_t pl = strlen(paths[k]);
            if (t1 - t0 >= pl && !memcmp(line + t0, paths[k], pl) && (t1 - t0 == pl || line[t0 + pl] == '?'))
                f->probe = true;
        }
    }
    return true;
}

/* value[n], whitespace trimmed: Content-Length digits (an overflow reads as INT64_MAX). */
static bool parse_length(const char *v, size_t n, int64_t *out)
{
    if (!n)
        return false;
    int64_t x = 0;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9')
            return false;
        x = x > (INT64_MAX - 9) / 10 ? INT64_MAX : x * 10 + (v[i] - '0');
    }
    *out = x;
    return true;
}

void kvf_router_frame_head(const char *p, size_t len, int64_t max_head, int64_t max_body, kvf_router_frame *out)
{
    kvf_router_frame f = {.kind = KVF_FRAME_MORE};
    if (max_head > 1 << 30)
        max_head = 1 << 30;
    size_t look = len < (size_t)max_head + 3 ? len : (size_t)max_head + 3;
    size_t hl = head_length(p, look);
    if (hl > (size_t)max_head || (!hl && look > (size_t)max_head)) {
        f.kind = KVF_FRAME_HEAD_LARGE;
        *out = f;
        return;
    }
    if (!hl) {
        /* a head that cannot become a request line is refused before it completes */
        if (len && !is_tchar((unsigned char)p[0]))
            bad(&f, "the request line does not start with a method");
        *out = f;
        return;
    }
    f.head_len = hl;
    if (memchr(p, 0, hl)) {
        bad(&f, "the request head holds a NUL byte");
        *out = f;
        return;
    }
    bool have_cl = false, have_te = false;
    int64_t cl = 0;
    const char *line = p, *end = p + hl;
    for (int ln = 0; line < end; ln++) {
        const char *eol = memchr(line, '\n', (size_t)(end - line));
        size_t n = (size_t)(eol - line);
        if (n && line[n - 1] == '\r')
            n--;
        if (!n && ln == 0) {
            bad(&f, "the request line is empty");
            *out = f;
            return;
        }
        if (!n)
            break; /* the empty line ending the head */
        for (size_t i = 0; i < n; i++)
            if (((unsigned char)line[i] < ' ' && line[i] != '\t') || line[i] == 0x7f) {
                bad(&f, "the request head holds a control character");
                *out = f;
                return;
            }
        if (ln == 0) {
            if (!request_line(line, n, &f)) {
                *out = f;
                return;
            }
        } else {
            size_t c = 0;
            while (c < n && is_tchar((unsigned char)line[c]))
                c++;
            if (!c || c >= n || line[c] != ':') {
                bad(&f, line[0] == ' ' || line[0] == '\t' ? "folded header lines are not accepted"
                                                            : "a header line is not NAME: VALUE");
                *out = f;
                return;
            }
            const char *v = line + c + 1, *ve = line + n;
            while (v < ve && (*v == ' ' || *v == '\t'))
                v++;
            while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
                ve--;
            if (c == 14 && !strncasecmp(line, "content-length", 14)) {
                int64_t x;
                if (!parse_length(v, (size_t)(ve - v), &x) || (have_cl && x != cl)) {
                    bad(&f, "Content-Length is not one decimal number");
                    *out = f;
                    return;
                }
                have_cl = true;
                cl = x;
            } else if (c == 17 && !strncasecmp(line, "transfer-encoding", 17)) {
                if (have_te || ve - v != 7 || strncasecmp(v, "chunked", 7)) {
                    bad(&f, "Transfer-Encoding other than chunked is not accepted");
                    *out = f;
                    return;
                }
                have_te = true;
            }
        }
        line = eol + 1;
    }
    if (have_cl && have_te) {
        bad(&f, "a request cannot carry both Content-Length and Transfer-Encoding");
        *out = f;
        return;
    }
    f.chunked = have_te;
    f.body_len = have_cl ? cl : 0;
    f.kind = have_cl && cl > max_body ? KVF_FRAME_BODY_LARGE : KVF_FRAME_OK;
    *out = f;
}

static int hexval(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    c |= 0x20;
    return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

kvf_router_chunks_result kvf_router_chunks_feed(kvf_router_chunks *c, const char *p, size_t len, int64_t max_body,
                                                int64_t max_trailer, size_t *used)
{
    size_t i = 0;
    kvf_router_chunks_result r = KVF_CHUNKS_MORE;
    while (i < len && r == KVF_CHUNKS_MORE) {
        unsigned char b = (unsigned char)p[i];
        if (c->st == C_DATA) {
            size_t n = len - i < (uint64_t)c->left ? len - i : (size_t)c->left;
            c->left -= (int64_t)n;
            i += n;
            if (!c->left)
                c->st = C_DATA_CR;
            continue;
        }
        i++;
        switch (c->st) {
        case C_SIZE: {
            int h = hexval(b);
            if (++c->line > MAX_SIZE_LINE)
                r = KVF_CHUNKS_BAD;
            else if (h >= 0) {
                if (c->left > max_body / 16 + 1)
                    r = KVF_CHUNKS_LARGE;
                c->left = c->left * 16 + h;
                c->digits = true;
            } else if (!c->digits)
                r = KVF_CHUNKS_BAD;
            else if (b == ' ' || b == '\t')
                c->st = C_EXT;
            else if (b == '\r')
                c->st = C_SIZE_LF;
            else if (b != '\n')
                r = KVF_CHUNKS_BAD; /* ";ext": evhttp does not take chunk extensions */
            if (r == KVF_CHUNKS_MORE && b == '\n')
                goto size_done;
            break;
        }
        case C_EXT:
            if (++c->line > MAX_SIZE_LINE)
                r = KVF_CHUNKS_BAD;
            else if (b == '\n')
                goto size_done;
            break;
        case C_SIZE_LF:
            if (b != '\n')
                r = KVF_CHUNKS_BAD;
            else
                goto size_done;
            break;
        case C_DATA_CR:
            c->st = b == '\r' ? C_DATA_LF : b == '\n' ? C_SIZE : -1;
            if (c->st < 0)
                r = KVF_CHUNKS_BAD;
            break;
        case C_DATA_LF:
            c->st = C_SIZE;
            if (b != '\n')
                r = KVF_CHUNKS_BAD;
            break;
        case C_TR_START:
            if (b == '\n')
                c->st = C_DONE;
            else
                c->st = b == '\r' ? C_TR_LF : C_TR_LINE;
            if (++c->trailer > max_trailer)
                r = KVF_CHUNKS_BAD;
            break;
        case C_TR_LINE:
            if (b == '\n')
                c->st = C_TR_START;
            if (++c->trailer > max_trailer)
                r = KVF_CHUNKS_BAD;
            break;
        case C_TR_LF:
            c->st = C_DONE;
            if (b != '\n')
                r = KVF_CHUNKS_BAD;
            break;
        default:
            r = KVF_CHUNKS_BAD;
        }
        if (c->st == C_DONE && r == KVF_CHUNKS_MORE)
            r = KVF_CHUNKS_DONE;
        continue;
    size_done:
        /* the size line ended: c->left bytes of data follow, or (0) the trailer */
        c->line = 0;
        c->digits = false;
        if (c->left > max_body - c->total) {
            r = KVF_CHUNKS_LARGE;
            break;
        }
        c->total += c->left;
        c->st = c->left ? C_DATA : C_TR_START;
    }
    *used = i;
    return r;
}
