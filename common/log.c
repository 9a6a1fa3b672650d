/* log.c: the logger, the one piece of global mutable state kvfleet allows (STYLE.md): text
 * lines, or JSON lines for log pipelines; where lines go is the sink's business. */
#include "common/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static kvf_log_level log_level = KVF_LOG_INFO;
static kvf_log_sink_fn log_sink;
static void *log_sink_ctx;
static kvf_log_format log_format = KVF_LOG_FORMAT_TEXT;
/* One JSON line, built under log_mu: a message of 2047 bytes escapes to at most 6 times that. */
static char log_json[16384];

static const char *const level_names[] = {"debug", "info", "warn", "error", "off"};
static const char level_chars[] = "DIWE-";

const char *kvf_log_level_name(kvf_log_level level)
{
    return (unsigned)level <= KVF_LOG_OFF ? level_names[level] : "?";
}

int kvf_log_level_parse(const char *s)
{
    for (int i = 0; i <= KVF_LOG_OFF; i++)
        if (s && strcasecmp(s, level_names[i]) == 0)
            return i;
    return -1;
}

void kvf_log_set_level(kvf_log_level level)
{
    pthread_mutex_lock(&log_mu);
    log_level = level;
    pthread_mutex_unlock(&log_mu);
}

kvf_log_level kvf_log_get_level(void)
{
    pthread_mutex_lock(&log_mu);
    kvf_log_level l = log_level;
    pthread_mutex_unlock(&log_mu);
    return l;
}

int kvf_log_enabled(kvf_log_level level)
{
    return level >= kvf_log_get_level() && level < KVF_LOG_OFF;
}

void kvf_log_set_sink(kvf_log_sink_fn fn, void *ctx)
{
    pthread_mutex_lock(&log_mu);
    log_sink = fn;
    log_sink_ctx = ctx;
    pthread_mutex_unlock(&log_mu);
}

void kvf_log_set_format(kvf_log_format format)
{
    pthread_mutex_lock(&log_mu);
    log_format = format;
    pthread_mutex_unlock(&log_mu);
}

int kvf_log_format_parse(const char *s)
{
    if (s && strcmp(s, "text") == 0)
        return KVF_LOG_FORMAT_TEXT;
    if (s && strcmp(s, "json") == 0)
        return KVF_LOG_FORMAT_JSON;
    return -1;
}

/* The length of the valid UTF-8 sequence at p (n bytes left), or 0 when it is not one
 * (overlong forms, surrogates and code points above U+10FFFF are not). */
static size_t utf8_len(const unsigned char *p, size_t n)
{
    unsigned char c = p[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF; /* the second byte's range */
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c >= 0xE0 && c <= 0xEF)
        len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4)
        len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else
        return 0;
    if (n < len || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    return len;
}

/* Appends s[0..n) to b (at *len, cap bytes) as a JSON string with its quotes. Stops short,
 * never mid-escape, when b is full; leaves room for the closing quote. */
static void json_str(char *b, size_t cap, size_t *len, const char *s, size_t n)
{
    size_t o = *len;
    if (o + 2 > cap)
        return;
    b[o++] = '"';
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        const char *out = esc;
        size_t k = 1, used = 1;
        if (c == '"' || c == '\\')
            esc[0] = '\\', esc[1] = (char)c, k = 2;
        else if (c == '\n')
            out = "\\n", k = 2;
        else if (c == '\r')
            out = "\\r", k = 2;
        else if (c == '\t')
            out = "\\t", k = 2;
        else if (c < 0x20 || c == 0x7F)
            k = (size_t)snprintf(esc, sizeof esc, "\\u%04x", c);
        else if (c < 0x80)
            esc[0] = (char)c;
        else if ((used = utf8_len((const unsigned char *)s + i, n - i)) > 0)
            out = s + i, k = used;
        else
            out = "\\ufffd", k = 6, used = 1;
        if (o + k + 1 > cap)
            break;
        memcpy(b + o, out, k);
        o += k;
        i += used;
    }
    b[o++] = '"';
    *len = o;
}

/* Appends the literal s when it fits. */
static void json_lit(char *b, size_t cap, size_t *len, const char *s)
{
    size_t n = strlen(s);
    if (*len + n <= cap) {
        memcpy(b + *len, s, n);
        *len += n;
    }
}

/* The JSON line of one event into log_json (log_mu held); returns its length with the '\n'.
 * ts is the text line's timestamp, msg the message as formatted. */
static size_t log_json_line(const char *ts, size_t ts_len, kvf_log_level level, const char *msg)
{
    char *b = log_json;
    size_t cap = sizeof log_json - 2, len = 0; /* room for "}\n" */
    size_t msg_len = strlen(msg);
    json_lit(b, cap, &len, "{\"ts\":");
    json_str(b, cap, &len, ts, ts_len);
    json_lit(b, cap, &len, ",\"level\":");
    json_str(b, cap, &len, level_names[level], strlen(level_names[level]));
    /* "component": the folder prefix; "request_id": "req ID" right after it (log.h) */
    size_t comp = 0;
    if (msg[0] >= 'a' && msg[0] <= 'z') {
        comp = strspn(msg, "abcdefghijklmnopqrstuvwxyz0123456789_-");
        if (comp > 32 || strncmp(msg + comp, ": ", 2) != 0)
            comp = 0;
    }
    if (comp > 0) {
        json_lit(b, cap, &len, ",\"component\":");
        json_str(b, cap, &len, msg, comp);
        const char *r = msg + comp + 2;
        if (strncmp(r, "req ", 4) == 0) {
            r += 4;
            size_t id = 0;
            while ((unsigned char)r[id] > 0x20 && r[id] != 0x7F) /* to a space, control or NUL */
                id++;
            if (id > 0 && r[id - 1] == ':')
                id--;
            if (id > 0 && id <= 128) {
                json_lit(b, cap, &len, ",\"request_id\":");
                json_str(b, cap, &len, r, id);
            }
        }
    }
    json_lit(b, cap, &len, ",\"msg\":");
    json_str(b, cap, &len, msg, msg_len);
    b[len++] = '}';
    b[len++] = '\n';
    return len;
}

void kvf_log(kvf_log_level level, const char *fmt, ...)
{
    if (!kvf_log_enabled(level))
        return;
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %c ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, level_chars[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);

    pthread_mutex_lock(&log_mu);
    if (!log_sink && log_format == KVF_LOG_FORMAT_JSON) {
        /* the timestamp without its trailing " I " */
        size_t len = log_json_line(line, (size_t)n - 3, level, line + n);
        fwrite(log_json, 1, len, stderr);
    } else {
        /* One event, one line: fold any newline the message carries. */
        for (char *p = line; *p; p++)
            if (*p == '\n' || *p == '\r')
                *p = ' ';
        if (log_sink)
            log_sink(log_sink_ctx, level, line);
        else
            fprintf(stderr, "%s\n", line);
    }
    pthread_mutex_unlock(&log_mu);
}
