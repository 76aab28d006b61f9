/* Prometheus metrics: one registry (a table of families, each with labelled
 * series), rendered in the text exposition format 0.0.4, and a small HTTP
 * endpoint (libmicrohttpd) serving it at GET /metrics.
 *
 * Names follow Prometheus conventions: base units (seconds, bytes) and a
 * _total suffix on counters. Every call is thread-safe (one mutex per
 * registry). Labels are given as a NULL-terminated array of name, value pairs:
 *   metrics_inc(r, "meshd_commands_total", (const char *[]){"kind", k, "status", s, NULL}, 1);
 * NULL labels means the series without labels. Operations on a name that was
 * not defined, or with the wrong type, are ignored. */
#ifndef MESHD_METRICS_H
#define MESHD_METRICS_H

#include <stddef.h>
#include <stdint.h>

typedef enum { METRIC_COUNTER, METRIC_GAUGE, METRIC_HISTOGRAM } metric_type_t;

typedef struct metrics_registry metrics_registry_t;

/* A gauge computed at scrape time. Called with the registry lock held: it must
 * not call back into the registry. */
typedef double (*metrics_gauge_fn)(void *arg);

/* Default histogram buckets for durations in seconds (upper bounds). */
extern const double metrics_duration_buckets[];
extern const size_t metrics_duration_nbuckets;

metrics_registry_t *metrics_create(void);
void metrics_destroy(metrics_registry_t *r); /* NULL is a no-op */

/* Defines a counter or gauge family. Rendered in definition order. 0, or -1
 * (out of memory, duplicate name or histogram type). */
int metrics_define(metrics_registry_t *r, const char *name, metric_type_t type, const char *help);
/* Defines a histogram with `n` ascending finite upper bounds (+Inf is implicit). */
int metrics_define_histogram(metrics_registry_t *r, const char *name, const char *help,
                             const double *bounds, size_t n);

void metrics_inc(metrics_registry_t *r, const char *name, const char *const *labels, double delta);
void metrics_set(metrics_registry_t *r, const char *name, const char *const *labels, double v);
void metrics_observe(metrics_registry_t *r, const char *name, const char *const *labels, double v);
/* Makes a gauge or counter series read fn(arg) at each render (for values kept
 * elsewhere, e.g. an atomic counter). */
void metrics_set_fn(metrics_registry_t *r, const char *name, const char *const *labels,
                    metrics_gauge_fn fn, void *arg);

/* A series by handle, for hot paths: found (or created) once, then updated
 * with no lookup and no allocation, under the registry's one mutex. NULL when
 * the family is not defined or out of memory; the updates ignore NULL and a
 * wrong type. Lives as long as the registry. */
typedef struct metrics_series metrics_series_t;
metrics_series_t *metrics_series(metrics_registry_t *r, const char *name, const char *const *labels);
void metrics_series_inc(metrics_series_t *s, double delta); /* counter or gauge */
void metrics_series_observe(metrics_series_t *s, double v); /* histogram */

/* What every meshd daemon serves (metrics_std.c): meshd_build_info{version,
 * commit,cuda} 1 (build_info.h), and the standard process metrics read from
 * /proc/self at each scrape: process_cpu_seconds_total,
 * process_resident_memory_bytes, process_virtual_memory_bytes,
 * process_open_fds, process_max_fds, process_start_time_seconds. 0, or -1
 * when out of memory. */
int metrics_define_std(metrics_registry_t *r);

/* The text format, NUL-terminated, malloc'd (caller frees); *len (may be NULL)
 * gets its length. NULL when out of memory. */
char *metrics_render(metrics_registry_t *r, size_t *len);

/* ---- HTTP endpoint -------------------------------------------------------- */

typedef struct metrics_http metrics_http_t;

/* Connections the metrics port holds at once, in all and per client address. */
#define METRICS_HTTP_CONNECTIONS 64
#define METRICS_HTTP_CONNECTIONS_PER_IP 16
/* Seconds a connection has for each request, from its accept or the end of
 * its previous request to the end of the answer: MHD's own timeout is one of
 * inactivity, which a client sending a byte a second never reaches. */
#define METRICS_HTTP_REQUEST_SECONDS 10
/* Serves GET /metrics (200, "text/plain; version=0.0.4; charset=utf-8") on
 * `listen` ("host:port", "[v6]:port"; port 0 picks a free one) from its own
 * thread; any other path is 404, other methods 405. NULL with a message in
 * err (errlen bytes) on failure. The registry must outlive the handle. */
metrics_http_t *metrics_http_start(metrics_registry_t *r, const char *listen, char *err, size_t errlen);
int metrics_http_port(const metrics_http_t *h);
void metrics_http_stop(metrics_http_t *h); /* NULL is a no-op */

#endif
