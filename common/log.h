/* log.h: one line per event, with a level and a folder prefix chosen by the caller:
 *   kvf_log(KVF_LOG_INFO, "decode: req %s: %d blocks in %.1f ms", id, n, ms);
 * The sink is replaceable (tests capture lines); the default writes to stderr, as text or as
 * one JSON object per line (kvf_log_set_format). Thread-safe. */
#ifndef KVF_COMMON_LOG_H
#define KVF_COMMON_LOG_H

typedef enum kvf_log_level {
    KVF_LOG_DEBUG = 0,
    KVF_LOG_INFO = 1,
    KVF_LOG_WARN = 2,
    KVF_LOG_ERROR = 3,
    KVF_LOG_OFF = 4,
} kvf_log_level;

/* The default sink's format. KVF_LOG_FORMAT_JSON writes one object per line:
 *   {"ts":"2026-11-29T01:16:50.535Z","level":"info","component":"decode","request_id":"r1",
 *    "msg":"decode: req r1: ..."}
 * "component" is the message's folder prefix (a leading [a-z][a-z0-9_-]* followed by ": ");
 * "request_id" is ID when that prefix is followed by "req ID" (ID runs to the next space, less
 * one trailing ':', as in "decode: req %s: ..."). Either field is left out when absent. "msg" is
 * the whole message (cut to about 2 KB, as in text), newlines included; control bytes are
 * escaped and bytes that are not UTF-8 become U+FFFD. */
typedef enum kvf_log_format {
    KVF_LOG_FORMAT_TEXT = 0,
    KVF_LOG_FORMAT_JSON = 1,
} kvf_log_format;

/* A sink receives one formatted line without its trailing newline. */
typedef void (*kvf_log_sink_fn)(void *ctx, kvf_log_level level, const char *line);

void kvf_log(kvf_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvf_log_set_level(kvf_log_level level);
kvf_log_level kvf_log_get_level(void);
int kvf_log_enabled(kvf_log_level level);
/* Replaces the sink; NULL restores the stderr sink. A custom sink gets the text line whatever
 * the format. */
void kvf_log_set_sink(kvf_log_sink_fn fn, void *ctx);
/* Parses "debug", "info", "warn", "error", "off"; returns -1 for anything else. */
int kvf_log_level_parse(const char *s);
const char *kvf_log_level_name(kvf_log_level level);
void kvf_log_set_format(kvf_log_format format);
/* Parses "text" or "json"; returns -1 for anything else. */
int kvf_log_format_parse(const char *s);

#endif
