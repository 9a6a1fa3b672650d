/* rpc_common.c: the pieces shared by the RPC server and client: the status mapping between
 * kvf_status and gRPC codes (the one place it happens), byte buffers, deadlines, channel
 * arguments and PEM files. */
#include "proto/rpc_internal.h"

#include <stdatomic.h>

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <grpc/status.h>
#include <grpc/support/log.h>

#include "common/log.h"

void kvf_rpc_buf_free(kvf_rpc_buf *b)
{
    if (!b)
        return;
    free(b->data);
    b->data = NULL;
    b->len = 0;
}

int kvf_status_to_grpc(kvf_status st)
{
    switch (st) {
    case KVF_OK: return GRPC_STATUS_OK;
    case KVF_ERR_INVALID: return GRPC_STATUS_INVALID_ARGUMENT;
    case KVF_ERR_PARSE: return GRPC_STATUS_INVALID_ARGUMENT;
    case KVF_ERR_NOMEM: return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case KVF_ERR_FULL: return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case KVF_ERR_LIMIT: return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case KVF_ERR_TIMEOUT: return GRPC_STATUS_DEADLINE_EXCEEDED;
    case KVF_ERR_PEER_LOST: return GRPC_STATUS_UNAVAILABLE;
    case KVF_ERR_BUSY: return GRPC_STATUS_UNAVAILABLE; /* retry elsewhere */
    case KVF_ERR_NOT_FOUND: return GRPC_STATUS_NOT_FOUND;
    case KVF_ERR_EXISTS: return GRPC_STATUS_ALREADY_EXISTS;
    case KVF_ERR_UNSUPPORTED: return GRPC_STATUS_UNIMPLEMENTED;
    case KVF_ERR_CANCELLED: return GRPC_STATUS_CANCELLED;
    case KVF_ERR_STATE: return GRPC_STATUS_FAILED_PRECONDITION;
    case KVF_ERR_IO: return GRPC_STATUS_INTERNAL;
    case KVF_ERR_INTERNAL: return GRPC_STATUS_INTERNAL;
    case KVF_HELP: return GRPC_STATUS_UNKNOWN;
    }
    return GRPC_STATUS_UNKNOWN;
}

kvf_status kvf_status_from_grpc(int grpc_code)
{
    switch (grpc_code) {
    case GRPC_STATUS_OK: return KVF_OK;
    case GRPC_STATUS_CANCELLED: return KVF_ERR_CANCELLED;
    case GRPC_STATUS_INVALID_ARGUMENT: return KVF_ERR_INVALID;
    case GRPC_STATUS_OUT_OF_RANGE: return KVF_ERR_INVALID;
    case GRPC_STATUS_DEADLINE_EXCEEDED: return KVF_ERR_TIMEOUT;
    case GRPC_STATUS_NOT_FOUND: return KVF_ERR_NOT_FOUND;
    case GRPC_STATUS_ALREADY_EXISTS: return KVF_ERR_EXISTS;
    case GRPC_STATUS_PERMISSION_DENIED: return KVF_ERR_INVALID;
    case GRPC_STATUS_UNAUTHENTICATED: return KVF_ERR_INVALID;
    case GRPC_STATUS_RESOURCE_EXHAUSTED: return KVF_ERR_LIMIT;
    case GRPC_STATUS_FAILED_PRECONDITION: return KVF_ERR_STATE;
    case GRPC_STATUS_ABORTED: return KVF_ERR_BUSY;
    case GRPC_STATUS_UNIMPLEMENTED: return KVF_ERR_UNSUPPORTED;
    case GRPC_STATUS_UNAVAILABLE: return KVF_ERR_PEER_LOST;
    case GRPC_STATUS_DATA_LOSS: return KVF_ERR_IO;
    default: return KVF_ERR_INTERNAL; /* UNKNOWN, INTERNAL, anything newer */
    }
}

const char *kvf_rpc_grpc_code_name(int grpc_code)
{
    static const char *const names[] = {
        "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
        "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
        "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
        "UNAUTHENTICATED"};
    if (grpc_code < 0 || grpc_code >= (int)(sizeof names / sizeof names[0]))
        return "UNKNOWN_CODE";
    return names[grpc_code];
}

static void gpr_to_kvf_log(gpr_log_func_args *a)
{
    kvf_log_level level = a->severity == GPR_LOG_SEVERITY_ERROR ? KVF_LOG_WARN : KVF_LOG_DEBUG;
    const char *file = a->file ? strrchr(a->file, '/') : NULL;
    kvf_log(level, "rpc: grpc: %s (%s:%d)", a->message, file ? file + 1 : a->file, a->line);
}

static pthread_once_t log_once = PTHREAD_ONCE_INIT;

/* Once per process, before gRPC starts. Names are resolved with getaddrinfo (gRPC's "native"
 * resolver), like the rest of kvfleet, unless GRPC_DNS_RESOLVER says otherwise: c-ares leaks a
 * few bytes per process that LeakSanitizer reports in every test. */
static void set_log_function(void)
{
    gpr_set_log_function(gpr_to_kvf_log);
    setenv("GRPC_DNS_RESOLVER", "native", 0);
}

void kvf_rpc_grpc_init(void)
{
    pthread_once(&log_once, set_log_function);
    grpc_init();
}

void kvf_rpc_cq_poll(grpc_completion_queue *cq)
{
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            return;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        rpc_tag *t = ev.tag;
        t->fn(t, ev.success != 0);
    }
}

kvf_status kvf_rpc_bb_read(grpc_byte_buffer *bb, kvf_rpc_buf *out, kvf_err *err)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return kvf_err_set(err, KVF_ERR_PARSE, "rpc: cannot read a received message "
                                               "(unsupported compression)");
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    size_t n = GRPC_SLICE_LENGTH(s);
    uint8_t *data = malloc(n ? n : 1);
    if (!data) {
        grpc_slice_unref(s);
        return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: no memory for a %zu-byte message", n);
    }
    memcpy(data, GRPC_SLICE_START_PTR(s), n);
    grpc_slice_unref(s);
    out->data = data;
    out->len = n;
    return KVF_OK;
}

grpc_byte_buffer *kvf_rpc_bb_from(const void *data, size_t len)
{
    grpc_slice s = grpc_slice_from_copied_buffer(data ? data : "", data ? len : 0);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

gpr_timespec kvf_rpc_deadline_from_ms(int64_t timeout_ms)
{
    if (timeout_ms == KVF_RPC_NO_DEADLINE)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    if (timeout_ms < 0)
        timeout_ms = 0;
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

int64_t kvf_rpc_deadline_remaining_ms(gpr_timespec deadline)
{
    if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) == 0)
        return KVF_RPC_NO_DEADLINE;
    gpr_timespec d = gpr_convert_clock_type(deadline, GPR_CLOCK_MONOTONIC);
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

static void arg_int(rpc_args *a, const char *key, int64_t v)
{
    grpc_arg *g = &a->arg[a->args.num_args++];
    g->type = GRPC_ARG_INTEGER;
    g->key = (char *)key;
    g->value.integer = v > INT_MAX ? INT_MAX : (int)v;
}

void kvf_rpc_args_init(rpc_args *a, int64_t max_bytes, bool server, int64_t keepalive_ms,
                   const char *ssl_target_override)
{
    memset(a, 0, sizeof *a);
    a->args.args = a->arg;
    arg_int(a, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max_bytes);
    arg_int(a, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max_bytes);
    if (keepalive_ms > 0) {
        arg_int(a, GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms);
        arg_int(a, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_ms < 5000 ? keepalive_ms : 5000);
        arg_int(a, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
        arg_int(a, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    }
    if (server) {
        arg_int(a, GRPC_ARG_ALLOW_REUSEPORT, 0);
        arg_int(a, GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
        arg_int(a, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 100);
    } else {
        arg_int(a, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
        /* Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also uses it as the time a connection
         * and its TLS handshake may take, and 100 ms fails handshakes on a busy machine. */
        arg_int(a, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    }
    if (ssl_target_override && *ssl_target_override) {
        grpc_arg *g = &a->arg[a->args.num_args++];
        g->type = GRPC_ARG_STRING;
        g->key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        g->value.string = (char *)ssl_target_override;
    }
}

int64_t kvf_rpc_keepalive_ms(int64_t v)
{
    if (v == 0)
        return KVF_RPC_DEFAULT_KEEPALIVE_MS;
    return v < 0 ? 0 : v;
}

kvf_status kvf_rpc_max_msg_check(int64_t v, const char *who, int64_t *out, kvf_err *err)
{
    if (v == 0)
        v = KVF_RPC_DEFAULT_MAX_MSG;
    if (v < 1024 || v > INT_MAX)
        return kvf_err_set(err, KVF_ERR_INVALID,
                           "rpc: %s: max message size %lld is out of range (1 KiB .. 2 GiB)", who,
                           (long long)v);
    *out = v;
    return KVF_OK;
}

kvf_status kvf_rpc_pem_read(const char *path, const char *what, char **out, kvf_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvf_err_set(err, KVF_ERR_IO, "rpc: %s %s: cannot open: %s", what, path,
                           strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            size_t ncap = cap ? cap * 2 : 8192;
            if (ncap > (size_t)16 << 20) {
                free(buf);
                fclose(f);
                return kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s %s: larger than 16 MiB, not a "
                                                         "PEM file", what, path);
            }
            char *nb = realloc(buf, ncap);
            if (!nb) {
                free(buf);
                fclose(f);
                return kvf_err_set(err, KVF_ERR_NOMEM, "rpc: %s %s: out of memory", what, path);
            }
            buf = nb;
            cap = ncap;
        }
        size_t n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return kvf_err_set(err, KVF_ERR_IO, "rpc: %s %s: read error", what, path);
    }
    buf[len] = '\0';
    if (!strstr(buf, "-----BEGIN ")) {
        free(buf);
        return kvf_err_set(err, KVF_ERR_PARSE, "rpc: %s %s: not a PEM file (no -----BEGIN line)",
                           what, path);
    }
    *out = buf;
    return KVF_OK;
}

/* ---- TLS files -------------------------------------------------------------------------------- */

static atomic_uint_fast64_t tls_gen;

void kvf_rpc_tls_reload(void)
{
    atomic_fetch_add(&tls_gen, 1);
}

uint64_t kvf_rpc_tls_generation(void)
{
    return atomic_load(&tls_gen);
}

static bool set(const char *s) { return s && *s; }

bool kvf_rpc_tls_on(const kvf_rpc_tls *tls)
{
    return tls && (set(tls->cert_file) || set(tls->key_file) || set(tls->ca_file));
}

kvf_status kvf_rpc_tls_check_member(const kvf_rpc_tls *tls, const char *who, kvf_err *err)
{
    if (!kvf_rpc_tls_on(tls))
        return KVF_OK;
    if (!set(tls->cert_file) || !set(tls->key_file) || !set(tls->ca_file))
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: --tls-cert, --tls-key and --tls-ca go together "
                           "(mutual TLS between fleet members; missing: %s%s%s)", who,
                           set(tls->cert_file) ? "" : "--tls-cert ", set(tls->key_file) ? "" : "--tls-key ",
                           set(tls->ca_file) ? "" : "--tls-ca");
    const char *files[3] = {tls->cert_file, tls->key_file, tls->ca_file};
    const char *flags[3] = {"--tls-cert", "--tls-key", "--tls-ca"};
    for (int i = 0; i < 3; i++) {
        char *pem = NULL;
        kvf_status st = kvf_rpc_pem_read(files[i], flags[i], &pem, err);
        if (st == KVF_OK && !strstr(pem, "-----BEGIN "))
            st = kvf_err_set(err, KVF_ERR_INVALID, "rpc: %s %s: not a PEM file (no -----BEGIN "
                             "line)", flags[i], files[i]);
        free(pem);
        if (st != KVF_OK)
            return kvf_err_prefix(err, "%s", who);
    }
    return KVF_OK;
}
