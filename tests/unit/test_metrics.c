#include <criterion/criterion.h>
#include <curl/curl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "build_info.h"
#include "metrics.h"

static char *render(metrics_registry_t *r) {
  size_t len = 0;
  char *s = metrics_render(r, &len);
  cr_assert_not_null(s);
  cr_assert_eq(len, strlen(s));
  return s;
}

Test(metrics, counters_and_labels_render_exactly) {
  metrics_registry_t *r = metrics_create();
  cr_assert_eq(metrics_define(r, "meshd_commands_total", METRIC_COUNTER, "Commands run."), 0);
  cr_assert_eq(metrics_define(r, "meshd_commands_total", METRIC_GAUGE, "again"), -1);
  cr_assert_eq(metrics_define(r, "meshd_sessions", METRIC_GAUGE, "Open sessions."), 0);
  metrics_inc(r, "meshd_commands_total", (const char *[]){"kind", "Call", "status", "ok", NULL}, 1);
  metrics_inc(r, "meshd_commands_total", (const char *[]){"kind", "Call", "status", "ok", NULL}, 2);
  metrics_inc(r, "meshd_commands_total", (const char *[]){"kind", "Sync", "status", "QUOTA", NULL}, 1);
  metrics_inc(r, "meshd_commands_total", (const char *[]){"kind", "a\"b\\c\nd", NULL}, 1);
  metrics_set(r, "meshd_sessions", NULL, 4);
  metrics_set(r, "meshd_sessions", NULL, 2.5);
  metrics_inc(r, "meshd_unknown", NULL, 1);              /* ignored */
  metrics_observe(r, "meshd_sessions", NULL, 1);          /* wrong type: ignored */
  char *s = render(r);
  cr_assert_str_eq(s,
                   "# HELP meshd_commands_total Commands run.\n"
                   "# TYPE meshd_commands_total counter\n"
                   "meshd_commands_total{kind=\"Call\",status=\"ok\"} 3\n"
                   "meshd_commands_total{kind=\"Sync\",status=\"QUOTA\"} 1\n"
                   "meshd_commands_total{kind=\"a\\\"b\\\\c\\nd\"} 1\n"
                   "# HELP meshd_sessions Open sessions.\n"
                   "# TYPE meshd_sessions gauge\n"
                   "meshd_sessions 2.5\n");
  free(s);
  metrics_destroy(r);
}

static double seven(void *arg) { return *(double *)arg; }

Test(metrics, gauge_callbacks_read_at_render) {
  metrics_registry_t *r = metrics_create();
  metrics_define(r, "meshd_agents", METRIC_GAUGE, "Agents.");
  double v = 7;
  metrics_set_fn(r, "meshd_agents", (const char *[]){"state", "healthy", NULL}, seven, &v);
  char *s = render(r);
  cr_assert(strstr(s, "meshd_agents{state=\"healthy\"} 7\n"), "%s", s);
  free(s);
  v = 9;
  s = render(r);
  cr_assert(strstr(s, "meshd_agents{state=\"healthy\"} 9\n"), "%s", s);
  free(s);
  metrics_destroy(r);
}

Test(metrics, histogram_renders_cumulative_buckets) {
  metrics_registry_t *r = metrics_create();
  const double b[] = {0.1, 1};
  cr_assert_eq(metrics_define_histogram(r, "meshd_command_duration_seconds", "Command time.", b, 2), 0);
  const char *const call[] = {"kind", "Call", NULL};
  metrics_observe(r, "meshd_command_duration_seconds", call, 0.05);
  metrics_observe(r, "meshd_command_duration_seconds", call, 0.1); /* le is inclusive */
  metrics_observe(r, "meshd_command_duration_seconds", call, 0.5);
  metrics_observe(r, "meshd_command_duration_seconds", call, 2);
  char *s = render(r);
  cr_assert_str_eq(s,
                   "# HELP meshd_command_duration_seconds Command time.\n"
                   "# TYPE meshd_command_duration_seconds histogram\n"
                   "meshd_command_duration_seconds_bucket{kind=\"Call\",le=\"0.1\"} 2\n"
                   "meshd_command_duration_seconds_bucket{kind=\"Call\",le=\"1\"} 3\n"
                   "meshd_command_duration_seconds_bucket{kind=\"Call\",le=\"+Inf\"} 4\n"
                   "meshd_command_duration_seconds_sum{kind=\"Call\"} 2.65\n"
                   "meshd_command_duration_seconds_count{kind=\"Call\"} 4\n");
  free(s);
  metrics_destroy(r);
}

Test(metrics, histogram_without_labels) {
  metrics_registry_t *r = metrics_create();
  const double b[] = {1};
  metrics_define_histogram(r, "h_seconds", "H.", b, 1);
  metrics_observe(r, "h_seconds", NULL, 3);
  char *s = render(r);
  cr_assert_str_eq(s,
                   "# HELP h_seconds H.\n"
                   "# TYPE h_seconds histogram\n"
                   "h_seconds_bucket{le=\"1\"} 0\n"
                   "h_seconds_bucket{le=\"+Inf\"} 1\n"
                   "h_seconds_sum 3\n"
                   "h_seconds_count 1\n");
  free(s);
  metrics_destroy(r);
}

Test(metrics, series_handles_update_without_lookup) {
  metrics_registry_t *r = metrics_create();
  const double b[] = {0.01, 0.1, 1};
  metrics_define_histogram(r, "meshd_sync_duration_seconds", "Sync time.", b, 3);
  metrics_define(r, "meshd_transfer_bytes_total", METRIC_COUNTER, "Bytes.");
  metrics_series_t *h = metrics_series(r, "meshd_sync_duration_seconds", NULL);
  metrics_series_t *up = metrics_series(r, "meshd_transfer_bytes_total",
                                        (const char *[]){"direction", "upload", NULL});
  cr_assert_not_null(h);
  cr_assert_not_null(up);
  cr_assert_null(metrics_series(r, "meshd_nope", NULL));
  cr_assert_eq(metrics_series(r, "meshd_sync_duration_seconds", NULL), h, "one series per labels");
  const double obs[] = {0.001, 0.01, 0.05, 0.5, 0.5, 7};
  for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++) metrics_series_observe(h, obs[i]);
  metrics_series_inc(h, 5);       /* wrong type: ignored */
  metrics_series_observe(up, 1);  /* wrong type: ignored */
  metrics_series_inc(up, 4096);
  metrics_series_inc(up, 1);
  metrics_series_inc(NULL, 1);    /* NULL: ignored */
  metrics_series_observe(NULL, 1);
  char *s = render(r);
  cr_assert_str_eq(s,
                   "# HELP meshd_sync_duration_seconds Sync time.\n"
                   "# TYPE meshd_sync_duration_seconds histogram\n"
                   "meshd_sync_duration_seconds_bucket{le=\"0.01\"} 2\n"
                   "meshd_sync_duration_seconds_bucket{le=\"0.1\"} 3\n"
                   "meshd_sync_duration_seconds_bucket{le=\"1\"} 5\n"
                   "meshd_sync_duration_seconds_bucket{le=\"+Inf\"} 6\n"
                   "meshd_sync_duration_seconds_sum 8.061\n"
                   "meshd_sync_duration_seconds_count 6\n"
                   "# HELP meshd_transfer_bytes_total Bytes.\n"
                   "# TYPE meshd_transfer_bytes_total counter\n"
                   "meshd_transfer_bytes_total{direction=\"upload\"} 4097\n");
  free(s);
  metrics_destroy(r);
}

typedef struct {
  metrics_series_t *h;
  int n;
} observer_t;

static void *observe_many(void *arg) {
  observer_t *o = arg;
  for (int i = 0; i < o->n; i++) metrics_series_observe(o->h, (i % 3) * 0.5);
  return NULL;
}

Test(metrics, histogram_counts_every_observation_from_threads) {
  metrics_registry_t *r = metrics_create();
  const double b[] = {0.25, 0.75};
  metrics_define_histogram(r, "h_seconds", "H.", b, 2);
  observer_t o = {metrics_series(r, "h_seconds", NULL), 30000};
  pthread_t t[4];
  for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, observe_many, &o);
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  char *s = render(r);
  /* 0, 0.5, 1 in turn: 40000 of each. */
  cr_assert(strstr(s, "h_seconds_bucket{le=\"0.25\"} 40000\n"), "%s", s);
  cr_assert(strstr(s, "h_seconds_bucket{le=\"0.75\"} 80000\n"), "%s", s);
  cr_assert(strstr(s, "h_seconds_bucket{le=\"+Inf\"} 120000\n"), "%s", s);
  cr_assert(strstr(s, "h_seconds_sum 60000\n"), "%s", s);
  cr_assert(strstr(s, "h_seconds_count 120000\n"), "%s", s);
  free(s);
  metrics_destroy(r);
}

/* The value of the sample line `series` in text, or NAN. */
static double sample_value(const char *text, const char *series) {
  size_t n = strlen(series);
  for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
    if (!strncmp(l, series, n) && l[n] == ' ') return strtod(l + n + 1, NULL);
  return NAN;
}

Test(metrics, std_families_follow_the_exposition_rules) {
  metrics_registry_t *r = metrics_create();
  cr_assert_eq(metrics_define_std(r), 0);
  char *s = render(r);
  const build_info_t *bi = build_info();
  char line[256];
  snprintf(line, sizeof line, "meshd_build_info{version=\"%s\",commit=\"%s\",cuda=\"%s\"} 1\n",
           bi->version, bi->commit, bi->cuda ? "true" : "false");
  cr_assert(strstr(s, line), "%s", s);
  const struct { const char *name, *type; } fams[] = {
      {"meshd_build_info", "gauge"},
      {"process_cpu_seconds_total", "counter"},
      {"process_resident_memory_bytes", "gauge"},
      {"process_virtual_memory_bytes", "gauge"},
      {"process_open_fds", "gauge"},
      {"process_max_fds", "gauge"},
      {"process_start_time_seconds", "gauge"},
  };
  for (size_t i = 0; i < sizeof fams / sizeof fams[0]; i++) {
    snprintf(line, sizeof line, "# HELP %s ", fams[i].name);
    cr_assert(strstr(s, line), "no HELP for %s", fams[i].name);
    snprintf(line, sizeof line, "# TYPE %s %s\n", fams[i].name, fams[i].type);
    cr_assert(strstr(s, line), "no TYPE %s for %s", fams[i].type, fams[i].name);
  }
  cr_assert_gt(sample_value(s, "process_resident_memory_bytes"), 1 << 20);
  cr_assert_geq(sample_value(s, "process_virtual_memory_bytes"),
                sample_value(s, "process_resident_memory_bytes"));
  cr_assert_geq(sample_value(s, "process_cpu_seconds_total"), 0);
  cr_assert_geq(sample_value(s, "process_open_fds"), 3);
  cr_assert_gt(sample_value(s, "process_max_fds"), 0);
  double start = sample_value(s, "process_start_time_seconds"), now = (double)time(NULL);
  cr_assert(start <= now + 1 && start > now - 3600, "start %f, now %f", start, now);
  /* Read at each scrape: a new descriptor shows at once. */
  double fds = sample_value(s, "process_open_fds");
  free(s);
  int fd = dup(0);
  s = render(r);
  cr_assert_eq(sample_value(s, "process_open_fds"), fds + 1, "%s", s);
  close(fd);
  free(s);
  metrics_destroy(r);
}

/* ---- HTTP ---- */

typedef struct {
  char *p;
  size_t n;
} body_t;

static size_t collect(char *data, size_t size, size_t nmemb, void *arg) {
  body_t *b = arg;
  size_t add = size * nmemb;
  char *p = realloc(b->p, b->n + add + 1);
  if (!p) return 0;
  memcpy(p + b->n, data, add);
  b->n += add;
  p[b->n] = '\0';
  b->p = p;
  return add;
}

static long get(int port, const char *path, body_t *body, char *ctype, size_t ctlen) {
  char url[128];
  snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
  CURL *c = curl_easy_init();
  cr_assert_not_null(c);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, body);
  curl_easy_setopt(c, CURLOPT_TIMEOUT, 10L);
  CURLcode rc = curl_easy_perform(c);
  cr_assert_eq(rc, CURLE_OK, "%s", curl_easy_strerror(rc));
  long status = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  char *ct = NULL;
  curl_easy_getinfo(c, CURLINFO_CONTENT_TYPE, &ct);
  if (ctype) snprintf(ctype, ctlen, "%s", ct ? ct : "");
  curl_easy_cleanup(c);
  return status;
}

Test(metrics, http_serves_metrics_and_404) {
  metrics_registry_t *r = metrics_create();
  metrics_define(r, "meshd_sessions", METRIC_GAUGE, "Open sessions.");
  metrics_set(r, "meshd_sessions", NULL, 3);
  char err[256] = "";
  metrics_http_t *h = metrics_http_start(r, "127.0.0.1:0", err, sizeof err);
  cr_assert_not_null(h, "%s", err);
  int port = metrics_http_port(h);
  cr_assert_gt(port, 0);

  body_t b = {0};
  char ct[128];
  cr_assert_eq(get(port, "/metrics", &b, ct, sizeof ct), 200);
  cr_assert_str_eq(ct, "text/plain; version=0.0.4; charset=utf-8");
  cr_assert_str_eq(b.p, "# HELP meshd_sessions Open sessions.\n# TYPE meshd_sessions gauge\nmeshd_sessions 3\n");
  free(b.p);

  metrics_set(r, "meshd_sessions", NULL, 4);
  b = (body_t){0};
  cr_assert_eq(get(port, "/metrics", &b, NULL, 0), 200);
  cr_assert(strstr(b.p, "meshd_sessions 4\n"));
  free(b.p);

  b = (body_t){0};
  cr_assert_eq(get(port, "/other", &b, NULL, 0), 404);
  free(b.p);
  metrics_http_stop(h);
  metrics_destroy(r);
}

Test(metrics, http_rejects_bad_addresses) {
  metrics_registry_t *r = metrics_create();
  char err[256] = "";
  cr_assert_null(metrics_http_start(r, "nonsense", err, sizeof err));
  cr_assert(strstr(err, "host:port"), "%s", err);
  cr_assert_null(metrics_http_start(r, "127.0.0.1:", err, sizeof err));
  metrics_http_t *a = metrics_http_start(r, "127.0.0.1:0", err, sizeof err);
  cr_assert_not_null(a, "%s", err);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", metrics_http_port(a));
  cr_assert_null(metrics_http_start(r, addr, err, sizeof err)); /* in use */
  metrics_http_stop(a);
  metrics_destroy(r);
}
