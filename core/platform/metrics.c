/* Prometheus registry and its HTTP endpoint. See metrics.h. */
#include "metrics.h"
#include "runtime.h"

#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

const double metrics_duration_buckets[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                           0.1,    0.25,  0.5,    1,     2.5,  5,     10};
const size_t metrics_duration_nbuckets = sizeof metrics_duration_buckets / sizeof metrics_duration_buckets[0];

struct family;
struct metrics_registry;

typedef struct metrics_series {
  struct metrics_registry *r;
  struct family *f;
  char *labels; /* rendered: kind="Call",status="ok" ("" for none) */
  double value; /* counter, gauge; histogram: sum */
  uint64_t count;
  uint64_t *buckets; /* histogram: per bound, not cumulative; [nbounds] is +Inf */
  metrics_gauge_fn fn;
  void *arg;
  struct metrics_series *next;
} series_t;

typedef struct family {
  char *name, *help;
  metric_type_t type;
  double *bounds;
  size_t nbounds;
  series_t *series, **tail;
  struct family *next;
} family_t;

struct metrics_registry {
  pthread_mutex_t mu;
  family_t *families, **tail;
};

/* ---- growing string ---- */

typedef struct {
  char *p;
  size_t len, cap;
  bool oom;
} buf_t;

__attribute__((format(printf, 2, 3))) static void bprintf(buf_t *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = true;
      return;
    }
    if (b->p && b->len + (size_t)n < b->cap) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap ? b->cap : 256;
    while (cap <= b->len + (size_t)n) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = true;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
}

/* Shortest of %.15g/%.17g that reads back exactly; +Inf, -Inf, NaN as Prometheus writes them. */
static void bnum(buf_t *b, double v) {
  if (isnan(v)) return bprintf(b, "NaN");
  if (isinf(v)) return bprintf(b, v > 0 ? "+Inf" : "-Inf");
  char s[40];
  snprintf(s, sizeof s, "%.15g", v);
  if (strtod(s, NULL) != v) snprintf(s, sizeof s, "%.17g", v);
  bprintf(b, "%s", s);
}

/* name="value",... with \\, \" and \n escaped. */
static char *render_labels(const char *const *labels) {
  buf_t b = {0};
  bprintf(&b, "%s", "");
  for (size_t i = 0; labels && labels[i] && labels[i + 1]; i += 2) {
    bprintf(&b, "%s%s=\"", i ? "," : "", labels[i]);
    for (const char *c = labels[i + 1]; *c; c++) {
      if (*c == '\\') bprintf(&b, "\\\\");
      else if (*c == '"') bprintf(&b, "\\\"");
      else if (*c == '\n') bprintf(&b, "\\n");
      else bprintf(&b, "%c", *c);
    }
    bprintf(&b, "\"");
  }
  if (b.oom) {
    free(b.p);
    return NULL;
  }
  return b.p;
}

/* ---- registry ---- */

metrics_registry_t *metrics_create(void) {
  metrics_registry_t *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  pthread_mutex_init(&r->mu, NULL);
  r->tail = &r->families;
  return r;
}

void metrics_destroy(metrics_registry_t *r) {
  if (!r) return;
  for (family_t *f = r->families, *fn; f; f = fn) {
    fn = f->next;
    for (series_t *s = f->series, *sn; s; s = sn) {
      sn = s->next;
      free(s->labels);
      free(s->buckets);
      free(s);
    }
    free(f->name);
    free(f->help);
    free(f->bounds);
    free(f);
  }
  pthread_mutex_destroy(&r->mu);
  free(r);
}

static family_t *find_family(metrics_registry_t *r, const char *name) {
  for (family_t *f = r->families; f; f = f->next)
    if (!strcmp(f->name, name)) return f;
  return NULL;
}

static int define(metrics_registry_t *r, const char *name, metric_type_t type, const char *help,
                  const double *bounds, size_t n) {
  family_t *f = calloc(1, sizeof *f);
  if (!f) return -1;
  f->name = strdup(name);
  f->help = strdup(help ? help : "");
  f->type = type;
  f->nbounds = n;
  f->bounds = malloc((n ? n : 1) * sizeof *bounds);
  f->tail = &f->series;
  if (!f->name || !f->help || !f->bounds) {
    free(f->name);
    free(f->help);
    free(f->bounds);
    free(f);
    return -1;
  }
  if (n) memcpy(f->bounds, bounds, n * sizeof *bounds);
  pthread_mutex_lock(&r->mu);
  int rc = 0;
  if (find_family(r, name)) {
    rc = -1;
  } else {
    *r->tail = f;
    r->tail = &f->next;
  }
  pthread_mutex_unlock(&r->mu);
  if (rc) {
    free(f->name);
    free(f->help);
    free(f->bounds);
    free(f);
  }
  return rc;
}

int metrics_define(metrics_registry_t *r, const char *name, metric_type_t type, const char *help) {
  if (!r || type == METRIC_HISTOGRAM) return -1;
  return define(r, name, type, help, NULL, 0);
}

int metrics_define_histogram(metrics_registry_t *r, const char *name, const char *help,
                             const double *bounds, size_t n) {
  if (!r) return -1;
  return define(r, name, METRIC_HISTOGRAM, help, bounds, n);
}

/* With r->mu held: the series, created on first use; NULL on OOM. */
static series_t *get_series(metrics_registry_t *r, family_t *f, const char *labels) {
  for (series_t *s = f->series; s; s = s->next)
    if (!strcmp(s->labels, labels)) return s;
  series_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->r = r;
  s->f = f;
  s->labels = strdup(labels);
  if (f->type == METRIC_HISTOGRAM) s->buckets = calloc(f->nbounds + 1, sizeof *s->buckets);
  if (!s->labels || (f->type == METRIC_HISTOGRAM && !s->buckets)) {
    free(s->labels);
    free(s->buckets);
    free(s);
    return NULL;
  }
  *f->tail = s;
  f->tail = &s->next;
  return s;
}

/* With r->mu held. NaN lands in +Inf only (it is <= no bound). */
static void observe_locked(series_t *s, double v) {
  const family_t *f = s->f;
  size_t i = 0;
  while (i < f->nbounds && !(v <= f->bounds[i])) i++;
  s->buckets[i]++;
  s->count++;
  s->value += v;
}

typedef enum { OP_INC, OP_SET, OP_OBSERVE, OP_FN } op_t;

static void update(metrics_registry_t *r, const char *name, const char *const *labels, op_t op,
                   double v, metrics_gauge_fn fn, void *arg) {
  if (!r) return;
  char *l = render_labels(labels);
  if (!l) return;
  pthread_mutex_lock(&r->mu);
  family_t *f = find_family(r, name);
  bool ok = f && (op == OP_INC ? f->type != METRIC_HISTOGRAM
                  : op == OP_OBSERVE ? f->type == METRIC_HISTOGRAM
                  : op == OP_SET     ? f->type == METRIC_GAUGE
                                     : f->type != METRIC_HISTOGRAM);
  series_t *s = ok ? get_series(r, f, l) : NULL;
  if (s) {
    switch (op) {
      case OP_INC: s->value += v; break;
      case OP_SET: s->value = v; s->fn = NULL; break;
      case OP_FN: s->fn = fn; s->arg = arg; break;
      case OP_OBSERVE: observe_locked(s, v); break;
    }
  }
  pthread_mutex_unlock(&r->mu);
  free(l);
}

metrics_series_t *metrics_series(metrics_registry_t *r, const char *name, const char *const *labels) {
  if (!r) return NULL;
  char *l = render_labels(labels);
  if (!l) return NULL;
  pthread_mutex_lock(&r->mu);
  family_t *f = find_family(r, name);
  series_t *s = f ? get_series(r, f, l) : NULL;
  pthread_mutex_unlock(&r->mu);
  free(l);
  return s;
}

void metrics_series_inc(metrics_series_t *s, double delta) {
  if (!s || s->f->type == METRIC_HISTOGRAM) return;
  pthread_mutex_lock(&s->r->mu);
  s->value += delta;
  pthread_mutex_unlock(&s->r->mu);
}

void metrics_series_observe(metrics_series_t *s, double v) {
  if (!s || s->f->type != METRIC_HISTOGRAM) return;
  pthread_mutex_lock(&s->r->mu);
  observe_locked(s, v);
  pthread_mutex_unlock(&s->r->mu);
}

void metrics_inc(metrics_registry_t *r, const char *name, const char *const *labels, double delta) {
  update(r, name, labels, OP_INC, delta, NULL, NULL);
}
void metrics_set(metrics_registry_t *r, const char *name, const char *const *labels, double v) {
  update(r, name, labels, OP_SET, v, NULL, NULL);
}
void metrics_observe(metrics_registry_t *r, const char *name, const char *const *labels, double v) {
  update(r, name, labels, OP_OBSERVE, v, NULL, NULL);
}
void metrics_set_fn(metrics_registry_t *r, const char *name, const char *const *labels,
                    metrics_gauge_fn fn, void *arg) {
  update(r, name, labels, OP_FN, 0, fn, arg);
}

static void sample(buf_t *b, const char *name, const char *suffix, const char *labels,
                   const char *extra, double v) {
  bool any = *labels || extra;
  bprintf(b, "%s%s%s%s%s%s%s ", name, suffix, any ? "{" : "", labels,
          *labels && extra ? "," : "", extra ? extra : "", any ? "}" : "");
  bnum(b, v);
  bprintf(b, "\n");
}

char *metrics_render(metrics_registry_t *r, size_t *len) {
  buf_t b = {0};
  bprintf(&b, "%s", "");
  pthread_mutex_lock(&r->mu);
  for (family_t *f = r->families; f; f = f->next) {
    static const char *const types[] = {"counter", "gauge", "histogram"};
    bprintf(&b, "# HELP %s ", f->name);
    for (const char *c = f->help; *c; c++) {
      if (*c == '\\') bprintf(&b, "\\\\");
      else if (*c == '\n') bprintf(&b, "\\n");
      else bprintf(&b, "%c", *c);
    }
    bprintf(&b, "\n# TYPE %s %s\n", f->name, types[f->type]);
    for (series_t *s = f->series; s; s = s->next) {
      if (f->type != METRIC_HISTOGRAM) {
        sample(&b, f->name, "", s->labels, NULL, s->fn ? s->fn(s->arg) : s->value);
        continue;
      }
      uint64_t cum = 0;
      for (size_t i = 0; i <= f->nbounds; i++) {
        buf_t le = {0};
        bprintf(&le, "le=\"");
        bnum(&le, i < f->nbounds ? f->bounds[i] : INFINITY);
        bprintf(&le, "\"");
        cum += s->buckets[i];
        if (le.oom) b.oom = true;
        else sample(&b, f->name, "_bucket", s->labels, le.p, (double)cum);
        free(le.p);
      }
      sample(&b, f->name, "_sum", s->labels, NULL, s->value);
      sample(&b, f->name, "_count", s->labels, NULL, (double)s->count);
    }
  }
  pthread_mutex_unlock(&r->mu);
  if (b.oom) {
    free(b.p);
    return NULL;
  }
  if (len) *len = b.len;
  return b.p;
}

/* ---- HTTP ---- */

/* A connection's deadline (its MHD socket context). */
typedef struct conn_deadline {
  struct conn_deadline *prev, *next;
  int fd;
  double deadline;
  bool cut;
} conn_deadline_t;

struct metrics_http {
  struct MHD_Daemon *d;
  metrics_registry_t *r;
  int port;
  /* The reaper shuts down (never closes: MHD owns the descriptor) the socket
   * of a connection past its deadline; MHD then sees it end and closes it.
   * A node leaves the list (mu) in NOTIFY_CLOSED, before MHD closes its fd. */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  conn_deadline_t *conns;
  bool stopping, reaping;
  pthread_t reaper;
};

static double mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
  metrics_http_t *h = cls;
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    conn_deadline_t *c = ci ? calloc(1, sizeof *c) : NULL;
    *socket_context = c;
    if (!c) return;
    c->fd = ci->connect_fd;
    c->deadline = mono_now() + METRICS_HTTP_REQUEST_SECONDS;
    pthread_mutex_lock(&h->mu);
    c->next = h->conns;
    if (h->conns) h->conns->prev = c;
    h->conns = c;
    pthread_mutex_unlock(&h->mu);
    return;
  }
  conn_deadline_t *c = *socket_context;
  if (!c) return;
  pthread_mutex_lock(&h->mu);
  if (c->prev) c->prev->next = c->next;
  else h->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  pthread_mutex_unlock(&h->mu);
  free(c);
  *socket_context = NULL;
}

/* A request answered: the next one on the connection has a bound of its own. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **req_cls,
                         enum MHD_RequestTerminationCode toe) {
  metrics_http_t *h = cls;
  (void)req_cls;
  (void)toe;
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  conn_deadline_t *c = ci ? ci->socket_context : NULL;
  if (!c) return;
  pthread_mutex_lock(&h->mu);
  c->deadline = mono_now() + METRICS_HTTP_REQUEST_SECONDS;
  pthread_mutex_unlock(&h->mu);
}

static void *reaper(void *arg) {
  metrics_http_t *h = arg;
  pthread_mutex_lock(&h->mu);
  while (!h->stopping) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 250 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    double now = mono_now();
    for (conn_deadline_t *c = h->conns; c; c = c->next)
      if (!c->cut && now >= c->deadline) {
        shutdown(c->fd, SHUT_RDWR);
        c->cut = true;
      }
  }
  pthread_mutex_unlock(&h->mu);
  return NULL;
}

static void stop_reaper(metrics_http_t *h) {
  if (!h->reaping) return;
  pthread_mutex_lock(&h->mu);
  h->stopping = true;
  pthread_cond_signal(&h->cv);
  pthread_mutex_unlock(&h->mu);
  pthread_join(h->reaper, NULL);
  h->reaping = false;
}

static enum MHD_Result answer(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_size, void **req_cls) {
  metrics_http_t *h = cls;
  (void)version;
  (void)upload_data;
  (void)upload_size;
  (void)req_cls;
  unsigned status;
  const char *type = "text/plain; charset=utf-8";
  char *body = NULL;
  size_t len = 0;
  bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
  if (strcmp(url, "/metrics") != 0) {
    status = MHD_HTTP_NOT_FOUND;
    body = strdup("not found: try /metrics\n");
  } else if (!get) {
    status = MHD_HTTP_METHOD_NOT_ALLOWED;
    body = strdup("only GET\n");
  } else {
    status = MHD_HTTP_OK;
    type = "text/plain; version=0.0.4; charset=utf-8";
    body = metrics_render(h->r, &len);
  }
  if (!body) return MHD_NO;
  if (status != MHD_HTTP_OK) len = strlen(body);
  struct MHD_Response *resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
  if (!resp) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  enum MHD_Result rc = MHD_queue_response(conn, status, resp);
  MHD_destroy_response(resp);
  return rc;
}

metrics_http_t *metrics_http_start(metrics_registry_t *r, const char *listen, char *err, size_t errlen) {
  char host[256];
  const char *colon = listen ? strrchr(listen, ':') : NULL;
  if (!r || !colon || colon == listen || (size_t)(colon - listen) >= sizeof host || !colon[1]) {
    snprintf(err, errlen, "metrics address '%s' is not host:port", listen ? listen : "");
    return NULL;
  }
  memcpy(host, listen, (size_t)(colon - listen));
  host[colon - listen] = '\0';
  char *h0 = host;
  if (h0[0] == '[') {
    size_t n = strlen(h0);
    if (n < 2 || h0[n - 1] != ']') {
      snprintf(err, errlen, "metrics address '%s' is not host:port", listen);
      return NULL;
    }
    h0[n - 1] = '\0';
    h0++;
  }
  if (runtime_check_port(listen, err, errlen) != 0) return NULL;
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV | AI_PASSIVE};
  struct addrinfo *ai = NULL;
  int g = getaddrinfo(*h0 ? h0 : NULL, colon + 1, &hints, &ai);
  if (g != 0) {
    snprintf(err, errlen, "metrics address '%s': %s", listen, gai_strerror(g));
    return NULL;
  }
  metrics_http_t *h = calloc(1, sizeof *h);
  if (!h) {
    freeaddrinfo(ai);
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  h->r = r;
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO;
  if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
  /* Anyone who reaches the port may connect: a few connections per address
   * and a bound on all (each idle one closed after 10 s), so that a stranger
   * holding slow connections takes neither every scrape nor the process's
   * file descriptors. */
  h->d = MHD_start_daemon(flags, 0, NULL, NULL, answer, h, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                          MHD_OPTION_CONNECTION_TIMEOUT, 10u,
                          MHD_OPTION_CONNECTION_LIMIT, (unsigned)METRICS_HTTP_CONNECTIONS,
                          MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                          (unsigned)METRICS_HTTP_CONNECTIONS_PER_IP,
                          MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
                          MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_END);
  freeaddrinfo(ai);
  if (h->d) h->reaping = pthread_create(&h->reaper, NULL, reaper, h) == 0;
  if (!h->d || !h->reaping) {
    snprintf(err, errlen, "cannot serve metrics on %s (address in use or not local?)", listen);
    if (h->d) MHD_stop_daemon(h->d);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h);
    return NULL;
  }
  pthread_setname_np(h->reaper, "metrics-reaper");
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
  h->port = info ? (int)info->port : 0;
  return h;
}

int metrics_http_port(const metrics_http_t *h) { return h ? h->port : -1; }

void metrics_http_stop(metrics_http_t *h) {
  if (!h) return;
  stop_reaper(h);
  MHD_stop_daemon(h->d);
  pthread_cond_destroy(&h->cv);
  pthread_mutex_destroy(&h->mu);
  free(h);
}
