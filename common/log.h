/* log.h: one line per event, with a level and a folder prefix chosen by the caller:
 *   kvf_log(KVF_LOG_INFO, "decode: req %s: %d blocks in %.1f ms", id, n, ms);
 * The sink is replaceable (tests capture lines); the default writes to stderr. Thread-safe. */
#ifndef KVF_COMMON_LOG_H
#define KVF_COMMON_LOG_H

typedef enum kvf_log_level {
    KVF_LOG_DEBUG = 0,
    KVF_LOG_INFO = 1,
    KVF_LOG_WARN = 2,
    KVF_LOG_ERROR = 3,
    KVF_LOG_OFF = 4,
} kvf_log_level;

/* A sink receives one formatted line without its trailing newline. */
typedef void (*kvf_log_sink_fn)(void *ctx, kvf_log_level level, const char *line);

void kvf_log(kvf_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvf_log_set_level(kvf_log_level level);
kvf_log_level kvf_log_get_level(void);
int kvf_log_enabled(kvf_log_level level);
/* Replaces the sink; NULL restores the stderr sink. */
void kvf_log_set_sink(kvf_log_sink_fn fn, void *ctx);
/* Parses "debug", "info", "warn", "error", "off"; returns -1 for anything else. */
int kvf_log_level_parse(const char *s);
const char *kvf_log_level_name(kvf_log_level level);

#endif
