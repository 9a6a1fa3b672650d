/* status.h: kvfleet's status codes and the error message that travels with them.
 * Library code returns a kvf_status and fills a kvf_err the caller can show; only main exits. */
#ifndef KVF_COMMON_STATUS_H
#define KVF_COMMON_STATUS_H

#include <stdarg.h>

/* One list makes the enum and the strings. Codes are stable: they travel in logs and RPCs. */
#define KVF_STATUS_MAP(X)                                   \
    X(OK, 0, "ok")                                          \
    X(ERR_INVALID, -1, "invalid argument")                  \
    X(ERR_NOMEM, -2, "out of memory")                       \
    X(ERR_TIMEOUT, -3, "timed out")                         \
    X(ERR_PEER_LOST, -4, "peer lost")                       \
    X(ERR_NOT_FOUND, -5, "not found")                       \
    X(ERR_EXISTS, -6, "already exists")                     \
    X(ERR_IO, -7, "input/output error")                     \
    X(ERR_PARSE, -8, "parse error")                         \
    X(ERR_UNSUPPORTED, -9, "unsupported")                   \
    X(ERR_FULL, -10, "no space left")                       \
    X(ERR_CANCELLED, -11, "cancelled")                      \
    X(ERR_BUSY, -12, "busy")                                \
    X(ERR_STATE, -13, "invalid state")                      \
    X(ERR_LIMIT, -14, "limit exceeded")                     \
    X(ERR_INTERNAL, -15, "internal error")                  \
    X(HELP, 1, "help requested")

typedef enum kvf_status {
#define KVF_STATUS_ENUM_(name, code, text) KVF_##name = code,
    KVF_STATUS_MAP(KVF_STATUS_ENUM_)
#undef KVF_STATUS_ENUM_
} kvf_status;

/* The fixed text of a status ("timed out"); never NULL. */
const char *kvf_status_str(kvf_status st);
/* The stable upper-case name of a status ("ERR_TIMEOUT"); never NULL. */
const char *kvf_status_name(kvf_status st);

/* An error message that says what was wrong, the value, and what is allowed.
 * Caller-owned; functions fill it only when they fail. */
#define KVF_ERR_MSG_MAX 512
typedef struct kvf_err {
    kvf_status status;
    char msg[KVF_ERR_MSG_MAX];
} kvf_err;

/* Fills err (which may be NULL) with a formatted message and returns st, so a failure reads
 *   return kvf_err_set(err, KVF_ERR_INVALID, "kv: block %d is not in this pool", id); */
kvf_status kvf_err_set(kvf_err *err, kvf_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
kvf_status kvf_err_setv(kvf_err *err, kvf_status st, const char *fmt, va_list ap);
/* Prepends "prefix: " to the message already in err (for adding context on the way up). */
kvf_status kvf_err_prefix(kvf_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvf_err_clear(kvf_err *err);

#endif
