/* metrics.h: a registry of counters, gauges and histograms that renders the Prometheus text
 * format (version 0.0.4). Registration happens at start-up and may allocate; updates are
 * lock-free atomics safe from any thread. The registry owns every series it returns. */
#ifndef KVF_COMMON_METRICS_H
#define KVF_COMMON_METRICS_H

#include <stddef.h>

#include "common/sbuf.h"
#include "common/status.h"

typedef struct kvf_metrics kvf_metrics;
typedef struct kvf_metric kvf_metric;

typedef enum kvf_metric_type {
    KVF_METRIC_COUNTER,
    KVF_METRIC_GAUGE,
    KVF_METRIC_HISTOGRAM,
} kvf_metric_type;

kvf_status kvf_metrics_create(kvf_metrics **out);
void kvf_metrics_destroy(kvf_metrics *m);

/* Registers (or finds) the series name{labels}. labels is Prometheus label text without braces,
 * e.g. `role="decode"`, or NULL. Registering an existing name with another type, or a name that
 * is not [a-zA-Z_:][a-zA-Z0-9_:]*, fails with KVF_ERR_INVALID. bounds (histograms only) are the
 * upper bounds of the buckets in increasing order; +Inf is implied. */
kvf_status kvf_metrics_counter(kvf_metrics *m, const char *name, const char *labels,
                               const char *help, kvf_metric **out, kvf_err *err);
kvf_status kvf_metrics_gauge(kvf_metrics *m, const char *name, const char *labels,
                             const char *help, kvf_metric **out, kvf_err *err);
kvf_status kvf_metrics_histogram(kvf_metrics *m, const char *name, const char *labels,
                                 const char *help, const double *bounds, size_t n_bounds,
                                 kvf_metric **out, kvf_err *err);

void kvf_metric_add(kvf_metric *s, double v);     /* counters (v >= 0) and gauges */
void kvf_metric_set(kvf_metric *s, double v);     /* gauges */
void kvf_metric_observe(kvf_metric *s, double v); /* histograms */
double kvf_metric_value(const kvf_metric *s);     /* counter/gauge value; histogram count */
double kvf_metric_sum(const kvf_metric *s);       /* histogram sum */

/* Appends the whole registry in Prometheus text format. */
kvf_status kvf_metrics_render(kvf_metrics *m, kvf_sbuf *out);

#endif
