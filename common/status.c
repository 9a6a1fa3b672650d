/* status.c: status strings and error-message helpers. */
#include "common/status.h"

#include <stdio.h>
#include <string.h>

const char *kvf_status_str(kvf_status st)
{
    switch (st) {
#define KVF_STATUS_STR_(name, code, text) case KVF_##name: return text;
        KVF_STATUS_MAP(KVF_STATUS_STR_)
#undef KVF_STATUS_STR_
    }
    return "unknown status";
}

const char *kvf_status_name(kvf_status st)
{
    switch (st) {
#define KVF_STATUS_NAME_(name, code, text) case KVF_##name: return #name;
        KVF_STATUS_MAP(KVF_STATUS_NAME_)
#undef KVF_STATUS_NAME_
    }
    return "UNKNOWN";
}

kvf_status kvf_err_setv(kvf_err *err, kvf_status st, const char *fmt, va_list ap)
{
    if (err) {
        err->status = st;
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    }
    return st;
}

kvf_status kvf_err_set(kvf_err *err, kvf_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvf_err_setv(err, st, fmt, ap);
    va_end(ap);
    return st;
}

kvf_status kvf_err_prefix(kvf_err *err, const char *fmt, ...)
{
    if (!err)
        return KVF_ERR_INTERNAL;
    char prefix[KVF_ERR_MSG_MAX], old[KVF_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    size_t n = strnlen(prefix, sizeof err->msg - 3);
    memcpy(err->msg, prefix, n);
    memcpy(err->msg + n, ": ", 2);
    size_t rest = sizeof err->msg - n - 3;
    size_t m = strnlen(old, rest);
    memcpy(err->msg + n + 2, old, m);
    err->msg[n + 2 + m] = '\0';
    return err->status;
}

void kvf_err_clear(kvf_err *err)
{
    if (err) {
        err->status = KVF_OK;
        err->msg[0] = '\0';
    }
}
