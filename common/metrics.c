/* metrics.c: metric series as atomics, rendered in Prometheus text format. */
#include "common/metrics.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct kvf_metric {
    kvf_metric_type type;
    char *name, *labels, *help;
    _Atomic uint64_t value; /* double bits: counter/gauge value, histogram sum */
    _Atomic uint64_t count; /* histogram observations */
    double *bounds;
    _Atomic uint64_t *buckets; /* [n_bounds + 1], not cumulative */
    size_t n_bounds;
};

struct kvf_metrics {
    pthread_mutex_t mu;
    kvf_metric **series;
    size_t n, cap;
};

static uint64_t d2u(double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    return u;
}

static double u2d(uint64_t u)
{
    double d;
    memcpy(&d, &u, 8);
    return d;
}

static void atomic_add_double(_Atomic uint64_t *a, double v)
{
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(a, &old, d2u(u2d(old) + v),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

kvf_status kvf_metrics_create(kvf_metrics **out)
{
    kvf_metrics *m = calloc(1, sizeof *m);
    if (!m)
        return KVF_ERR_NOMEM;
    pthread_mutex_init(&m->mu, NULL);
    *out = m;
    return KVF_OK;
}

static void metric_free(kvf_metric *s)
{
    free(s->name);
    free(s->labels);
    free(s->help);
    free(s->bounds);
    free(s->buckets);
    free(s);
}

void kvf_metrics_destroy(kvf_metrics *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n; i++)
        metric_free(m->series[i]);
    free(m->series);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static bool valid_name(const char *s)
{
    if (!s || !(isalpha((unsigned char)*s) || *s == '_' || *s == ':'))
        return false;
    for (s++; *s; s++)
        if (!(isalnum((unsigned char)*s) || *s == '_' || *s == ':'))
            return false;
    return true;
}

static const char *type_name(kvf_metric_type t)
{
    return t == KVF_METRIC_COUNTER ? "counter" : t == KVF_METRIC_GAUGE ? "gauge" : "histogram";
}

static kvf_status reg(kvf_metrics *m, kvf_metric_type type, const char *name, const char *labels,
                      const char *help, const double *bounds, size_t n_bounds, kvf_metric **out,
                      kvf_err *err)
{
    if (!valid_name(name))
        return kvf_err_set(err, KVF_ERR_INVALID, "metrics: '%s' is not a valid metric name",
                           name ? name : "(null)");
    for (size_t i = 1; i < n_bounds; i++)
        if (!(bounds[i] > bounds[i - 1]))
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "metrics: %s: bucket bounds must increase (%g after %g)", name,
                               bounds[i], bounds[i - 1]);
    if (!labels)
        labels = "";
    kvf_status st = KVF_OK;
    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < m->n; i++) {
        kvf_metric *s = m->series[i];
        if (strcmp(s->name, name) != 0)
            continue;
        if (s->type != type) {
            st = kvf_err_set(err, KVF_ERR_INVALID, "metrics: %s is a %s, not a %s", name,
                             type_name(s->type), type_name(type));
            goto out;
        }
        if (strcmp(s->labels, labels) == 0) {
            *out = s;
            goto out;
        }
    }
    if (m->n == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 32;
        kvf_metric **p = realloc(m->series, cap * sizeof *p);
        if (!p) {
            st = kvf_err_set(err, KVF_ERR_NOMEM, "metrics: out of memory");
            goto out;
        }
        m->series = p;
        m->cap = cap;
    }
    kvf_metric *s = calloc(1, sizeof *s);
    if (!s) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "metrics: out of memory");
        goto out;
    }
    s->type = type;
    s->name = strdup(name);
    s->labels = strdup(labels);
    s->help = strdup(help ? help : "");
    s->n_bounds = n_bounds;
    if (type == KVF_METRIC_HISTOGRAM) {
        s->bounds = malloc((n_bounds ? n_bounds : 1) * sizeof *s->bounds);
        s->buckets = calloc(n_bounds + 1, sizeof *s->buckets);
        if (s->bounds)
            memcpy(s->bounds, bounds, n_bounds * sizeof *bounds);
    }
    if (!s->name || !s->labels || !s->help ||
        (type == KVF_METRIC_HISTOGRAM && (!s->bounds || !s->buckets))) {
        metric_free(s);
        st = kvf_err_set(err, KVF_ERR_NOMEM, "metrics: out of memory");
        goto out;
    }
    m->series[m->n++] = s;
    *out = s;
out:
    pthread_mutex_unlock(&m->mu);
    return st;
}

kvf_status kvf_metrics_counter(kvf_metrics *m, const char *name, const char *labels,
                               const char *help, kvf_metric **out, kvf_err *err)
{
    return reg(m, KVF_METRIC_COUNTER, name, labels, help, NULL, 0, out, err);
}

kvf_status kvf_metrics_gauge(kvf_metrics *m, const char *name, const char *labels,
                             const char *help, kvf_metric **out, kvf_err *err)
{
    return reg(m, KVF_METRIC_GAUGE, name, labels, help, NULL, 0, out, err);
}

kvf_status kvf_metrics_histogram(kvf_metrics *m, const char *name, const char *labels,
                                 const char *help, const double *bounds, size_t n_bounds,
                                 kvf_metric **out, kvf_err *err)
{
    return reg(m, KVF_METRIC_HISTOGRAM, name, labels, help, bounds, n_bounds, out, err);
}

void kvf_metric_add(kvf_metric *s, double v) { atomic_add_double(&s->value, v); }

void kvf_metric_set(kvf_metric *s, double v)
{
    atomic_store_explicit(&s->value, d2u(v), memory_order_relaxed);
}

void kvf_metric_observe(kvf_metric *s, double v)
{
    size_t i = 0;
    while (i < s->n_bounds && v > s->bounds[i])
        i++;
    atomic_fetch_add_explicit(&s->buckets[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->count, 1, memory_order_relaxed);
    atomic_add_double(&s->value, v);
}

double kvf_metric_value(const kvf_metric *s)
{
    if (s->type == KVF_METRIC_HISTOGRAM)
        return (double)atomic_load_explicit(&s->count, memory_order_relaxed);
    return u2d(atomic_load_explicit(&s->value, memory_order_relaxed));
}

double kvf_metric_sum(const kvf_metric *s)
{
    return u2d(atomic_load_explicit(&s->value, memory_order_relaxed));
}

/* Prometheus wants +Inf / -Inf / NaN spelled that way; %.17g round-trips everything else. */
static void put_num(kvf_sbuf *out, double v)
{
    if (isnan(v))
        kvf_sbuf_puts(out, "NaN");
    else if (isinf(v))
        kvf_sbuf_puts(out, v > 0 ? "+Inf" : "-Inf");
    else if (v == (double)(int64_t)v && fabs(v) < 1e15)
        kvf_sbuf_printf(out, "%lld", (long long)v);
    else
        kvf_sbuf_printf(out, "%.17g", v);
}

static void put_help(kvf_sbuf *out, const char *help)
{
    for (const char *p = help; *p; p++) {
        if (*p == '\\')
            kvf_sbuf_puts(out, "\\\\");
        else if (*p == '\n')
            kvf_sbuf_puts(out, "\\n");
        else
            kvf_sbuf_putc(out, *p);
    }
}

static void render_series(kvf_sbuf *out, const kvf_metric *s)
{
    const char *lb = s->labels[0] ? "{" : "", *le = s->labels[0] ? "}" : "";
    if (s->type != KVF_METRIC_HISTOGRAM) {
        kvf_sbuf_printf(out, "%s%s%s%s ", s->name, lb, s->labels, le);
        put_num(out, kvf_metric_value(s));
        kvf_sbuf_putc(out, '\n');
        return;
    }
    const char *sep = s->labels[0] ? "," : "";
    uint64_t cum = 0;
    for (size_t i = 0; i <= s->n_bounds; i++) {
        cum += atomic_load_explicit(&s->buckets[i], memory_order_relaxed);
        kvf_sbuf_printf(out, "%s_bucket{%s%sle=\"", s->name, s->labels, sep);
        put_num(out, i < s->n_bounds ? s->bounds[i] : INFINITY);
        kvf_sbuf_printf(out, "\"} %llu\n", (unsigned long long)cum);
    }
    kvf_sbuf_printf(out, "%s_sum%s%s%s ", s->name, lb, s->labels, le);
    put_num(out, kvf_metric_sum(s));
    kvf_sbuf_printf(out, "\n%s_count%s%s%s %llu\n", s->name, lb, s->labels, le,
                    (unsigned long long)cum);
}

kvf_status kvf_metrics_render(kvf_metrics *m, kvf_sbuf *out)
{
    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < m->n; i++) {
        const kvf_metric *s = m->series[i];
        bool first = true; /* families render once, at their first registration */
        for (size_t j = 0; j < i && first; j++)
            if (strcmp(m->series[j]->name, s->name) == 0)
                first = false;
        if (!first)
            continue;
        kvf_sbuf_printf(out, "# HELP %s ", s->name);
        put_help(out, s->help);
        kvf_sbuf_printf(out, "\n# TYPE %s %s\n", s->name, type_name(s->type));
        for (size_t j = i; j < m->n; j++)
            if (strcmp(m->series[j]->name, s->name) == 0)
                render_series(out, m->series[j]);
    }
    pthread_mutex_unlock(&m->mu);
    return out->oom ? KVF_ERR_NOMEM : KVF_OK;
}
