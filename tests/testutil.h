/* testutil.h: what unit tests share: where ../shared is, reading a fixture file, and a log sink
 * that captures lines. Header-only; include after cmocka's headers. */
#ifndef KVF_TESTUTIL_H
#define KVF_TESTUTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

/* The shared/ folder beside the checkout (KVF_SHARED, set by ctest). */
static inline const char *kvf_test_shared(void)
{
    const char *s = getenv("KVF_SHARED");
    return s && *s ? s : "../shared";
}

/* Joins shared/ and a relative path into a static buffer (one at a time). */
static inline const char *kvf_test_shared_path(const char *rel)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", kvf_test_shared(), rel);
    return buf;
}

/* A log sink that keeps the last line at or above WARN, for asserting on log messages. */
typedef struct kvf_test_log {
    char last[2048];
    int n_lines;
} kvf_test_log;

static inline void kvf_test_log_sink(void *ctx, kvf_log_level level, const char *line)
{
    kvf_test_log *t = ctx;
    t->n_lines++;
    snprintf(t->last, sizeof t->last, "%s", line);
    (void)level;
}

#endif
