/* log.c: the logger, the one piece of global mutable state kvfleet allows (STYLE.md). */
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
    /* One event, one line: fold any newline the message carries. */
    for (char *p = line; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';

    pthread_mutex_lock(&log_mu);
    if (log_sink)
        log_sink(log_sink_ctx, level, line);
    else
        fprintf(stderr, "%s\n", line);
    pthread_mutex_unlock(&log_mu);
}
