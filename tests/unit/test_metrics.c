#include <criterion/criterion.h>
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
