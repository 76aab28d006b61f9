/* url_fetch against tests/support/range_http_server.py (started per test on a
 * free port, ended in fini: range_server.h), file:// URLs, and the allow list. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "range_server.h"
#include "url_allow.h"
#include "url_fetch.h"

static pid_t server_pid = -1;
static int server_stdin = -1, port;

static void start_server(void) {
  char why[1200];
  port = range_server_start(&server_pid, &server_stdin, why, sizeof why);
  cr_assert_gt(port, 0, "%s", why);
}

static void stop_server(void) {
  if (server_pid > 0) range_server_stop(server_pid, server_stdin);
  server_pid = -1, server_stdin = -1;
}

TestSuite(url_fetch, .init = start_server, .fini = stop_server);

static const char *url(const char *path) {
  static char buf[4][512];
  static int i;
  char *u = buf[i++ % 4];
  snprintf(u, 512, "http://127.0.0.1:%d%s", port, path);
  return u;
}

static uint8_t pattern(uint64_t i) { return (uint8_t)((i * 7 + 3) % 256); }

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

#define HAS(e, s) cr_assert(strstr((e).msg, (s)), "'%s'\n lacks '%s'", (e).msg, (s))

static const url_fetch_opts_t quick = {.max_retries = 0, .backoff_ms = 10, .timeout_ms = 5000};

Test(url_fetch, range_matches_the_bytes) {
  uint8_t buf[300];
  url_fetch_info_t info;
  meshd_error_t e;
  cr_assert_eq(url_fetch_range(url("/bytes/1000"), 100, 300, buf, &quick, &info, &e), 0, "%s",
               e.msg);
  for (int i = 0; i < 300; i++) cr_assert_eq(buf[i], pattern(100 + (uint64_t)i));
  cr_assert_eq(info.status, 206);
  cr_assert_eq(info.attempts, 1);
  cr_assert_eq(info.bytes, 300);
  cr_assert_eq(info.skipped, 0);
  /* The last byte alone. */
  cr_assert_eq(url_fetch_range(url("/bytes/1000"), 999, 1, buf, &quick, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(buf[0], pattern(999));
}

Test(url_fetch, whole_body) {
  uint8_t buf[2000];
  size_t got;
  meshd_error_t e;
  cr_assert_eq(url_fetch_all(url("/bytes/1000"), buf, sizeof buf, &got, &quick, NULL, &e), 0,
               "%s", e.msg);
  cr_assert_eq(got, 1000);
  for (int i = 0; i < 1000; i++) cr_assert_eq(buf[i], pattern((uint64_t)i));
  cr_assert_eq(url_fetch_all(url("/bytes/1000"), buf, 500, &got, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  HAS(e, "the body is longer than the 500 bytes allowed");
  url_fetch_opts_t o = quick;
  o.max_bytes = 100;
  cr_assert_eq(url_fetch_all(url("/bytes/1000"), buf, sizeof buf, &got, &o, NULL, &e), -1);
  HAS(e, "longer than the 100 bytes allowed");
}

Test(url_fetch, http_errors_name_url_and_status) {
  uint8_t buf[10];
  meshd_error_t e;
  char want[256];
  cr_assert_eq(url_fetch_range(url("/status/404"), 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  snprintf(want, sizeof want, "fetch http://127.0.0.1:%d/status/404: HTTP 404 (not found)", port);
  cr_assert_str_eq(e.msg, want);
  cr_assert_eq(url_fetch_range(url("/status/403"), 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED);
  HAS(e, "HTTP 403 (forbidden)");
  cr_assert_eq(url_fetch_range(url("/status/418"), 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  HAS(e, "HTTP 418");
  /* 4xx is not retried. */
  url_fetch_opts_t o = quick;
  o.max_retries = 3;
  url_fetch_info_t info;
  cr_assert_eq(url_fetch_range(url("/status/404"), 0, 10, buf, &o, &info, &e), -1);
  cr_assert_eq(info.attempts, 1);
}

Test(url_fetch, server_errors_are_retried_with_backoff) {
  uint8_t buf[100];
  meshd_error_t e;
  url_fetch_info_t info;
  url_fetch_opts_t o = quick;
  o.max_retries = 3;
  o.backoff_ms = 50;
  double t0 = now();
  cr_assert_eq(url_fetch_range(url("/flaky/a/2/100"), 10, 20, buf, &o, &info, &e), 0, "%s", e.msg);
  double took = now() - t0;
  cr_assert_eq(info.attempts, 3);
  cr_assert_geq(took, 0.15 - 0.01, "backoff 50 ms then 100 ms, took %.3f s", took);
  for (int i = 0; i < 20; i++) cr_assert_eq(buf[i], pattern(10 + (uint64_t)i));
  /* Bounded: one retry is not enough for two 500s. */
  o.max_retries = 1;
  cr_assert_eq(url_fetch_range(url("/flaky/b/2/100"), 0, 10, buf, &o, &info, &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE);
  cr_assert_eq(info.attempts, 2);
  HAS(e, "HTTP 500 (internal server error) (2 attempts)");
  char count[8] = {0};
  size_t got;
  cr_assert_eq(url_fetch_all(url("/count/b"), count, sizeof count - 1, &got, &quick, NULL, &e), 0);
  cr_assert_str_eq(count, "2", "the server saw each attempt");
}

Test(url_fetch, connection_resets_are_retried) {
  uint8_t buf[100];
  meshd_error_t e;
  url_fetch_info_t info;
  url_fetch_opts_t o = quick;
  o.max_retries = 2;
  cr_assert_eq(url_fetch_range(url("/reset/a/1/100"), 0, 100, buf, &o, &info, &e), 0, "%s", e.msg);
  cr_assert_eq(info.attempts, 2);
  cr_assert_eq(url_fetch_range(url("/reset/b/5/100"), 0, 100, buf, &quick, &info, &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE);
  HAS(e, "the connection failed (curl: ");
}

Test(url_fetch, truncated_body) {
  uint8_t buf[100];
  size_t got;
  meshd_error_t e;
  url_fetch_info_t info;
  url_fetch_opts_t o = quick;
  o.max_retries = 1;
  cr_assert_eq(url_fetch_all(url("/truncated/100"), buf, sizeof buf, &got, &o, &info, &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE);
  HAS(e, "/truncated/100: the body was cut short after 50 bytes (curl: ");
  HAS(e, "(2 attempts)");
  cr_assert_eq(url_fetch_range(url("/truncated/100"), 10, 40, buf, &quick, NULL, &e), -1);
  HAS(e, "cut short after 20 bytes");
}

Test(url_fetch, short_and_unsatisfiable_ranges) {
  uint8_t buf[40];
  meshd_error_t e;
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 80, 40, buf, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  HAS(e, "got 20 of the 40 bytes asked (bytes 80-119 of the 100-byte resource)");
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 150, 10, buf, &quick, NULL, &e), -1);
  HAS(e, "HTTP 416 (range not satisfiable): bytes 150-159 are past the end (Content-Range: "
         "bytes */100)");
}

Test(url_fetch, server_ignoring_range) {
  uint8_t buf[50];
  meshd_error_t e;
  url_fetch_info_t info;
  cr_assert_eq(url_fetch_range(url("/norange/1000"), 100, 50, buf, &quick, &info, &e), 0, "%s",
               e.msg);
  cr_assert_eq(info.status, 200);
  cr_assert_eq(info.skipped, 100);
  for (int i = 0; i < 50; i++) cr_assert_eq(buf[i], pattern(100 + (uint64_t)i));
  url_fetch_opts_t o = quick;
  o.max_bytes = 120;
  cr_assert_eq(url_fetch_range(url("/norange/1000"), 100, 50, buf, &o, &info, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  HAS(e, "the server ignored the Range request (HTTP 200 with the whole body); reading up to byte "
         "150 would pass the 120-byte limit");
  /* A range past a Range-ignoring server's body. */
  cr_assert_eq(url_fetch_range(url("/norange/120"), 100, 50, buf, &quick, NULL, &e), -1);
  HAS(e, "got 20 of the 50 bytes asked");
}

/* A Range request answered with a 2xx other than 200 or 206 and a body that
 * never ends: refused at its first bytes, not read until a timeout (or, with
 * none, for ever) after the slice is full. A 200's rest is dropped unread. */
Test(url_fetch, an_endless_body_under_another_2xx_is_refused_at_once) {
  uint8_t buf[1000];
  meshd_error_t e;
  url_fetch_info_t info;
  url_fetch_opts_t o = quick;
  o.timeout_ms = 4000; /* bounds the test on code that reads on */
  double t0 = now();
  cr_assert_eq(url_fetch_range(url("/endless/200"), 100, sizeof buf, buf, &o, &info, &e), 0,
               "%s", e.msg);
  for (int i = 0; i < (int)sizeof buf; i++) cr_assert_eq(buf[i], pattern(100 + (uint64_t)i));
  cr_assert_lt(now() - t0, 2.0);
  t0 = now();
  int rc = url_fetch_range(url("/endless/203"), 100, sizeof buf, buf, &o, &info, &e);
  double took = now() - t0;
  cr_assert_eq(rc, -1);
  cr_assert_lt(took, 2.0, "took %.1f s: %s", took, e.msg);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE, "%s", e.msg);
  HAS(e, "unexpected HTTP 203");
}

Test(url_fetch, timeouts) {
  uint8_t buf[10];
  meshd_error_t e;
  url_fetch_opts_t o = quick;
  o.timeout_ms = 300;
  o.max_retries = 2; /* timeouts are not retried */
  url_fetch_info_t info;
  double t0 = now();
  cr_assert_eq(url_fetch_range(url("/slow/3000/10"), 0, 10, buf, &o, &info, &e), -1);
  cr_assert_lt(now() - t0, 2.0);
  cr_assert_eq(e.kind, ERR_DEADLINE_EXCEEDED);
  cr_assert_eq(info.attempts, 1);
  HAS(e, "/slow/3000/10: timed out (curl: ");
}

/* A server that drips its body slower than min_speed over slow_s fails the
 * attempt as a timeout, even without timeout_ms (a byte now and then passed
 * before: the check was "nothing at all for 60 s"); one that keeps above it
 * finishes. */
Test(url_fetch, a_body_dripped_under_min_speed_times_out) {
  static uint8_t buf[6000];
  meshd_error_t e;
  url_fetch_opts_t o = quick;
  o.timeout_ms = 0;
  o.max_retries = 2;
  o.min_speed = 2000;
  o.slow_s = 1;
  url_fetch_info_t info;
  double t0 = now();
  cr_assert_eq(url_fetch_range(url("/drip/200/6000"), 0, 6000, buf, &o, &info, &e), -1);
  double took = now() - t0;
  cr_assert_lt(took, 5.0, "took %.1f s", took);
  cr_assert_eq(e.kind, ERR_DEADLINE_EXCEEDED, "%s", e.msg);
  cr_assert_eq(info.attempts, 1);
  HAS(e, "/drip/200/6000: timed out (curl: ");
  HAS(e, "2000 bytes/sec");
  t0 = now();
  o.min_speed = 100;
  cr_assert_eq(url_fetch_range(url("/drip/4000/6000"), 0, 6000, buf, &o, &info, &e), 0, "%s",
               e.msg);
  cr_assert_eq(info.bytes, 6000);
  for (int i = 0; i < 6000; i++) cr_assert_eq(buf[i], (uint8_t)(i * 7 + 3));
}

/* A caller's stop ends a transfer that waits for bytes, at curl's next
 * progress look (about a second), and is not retried. */
static bool stop_after(void *arg) {
  double *at = arg;
  return now() >= *at;
}

Test(url_fetch, a_callers_stop_ends_the_wait) {
  uint8_t buf[10];
  meshd_error_t e;
  url_fetch_opts_t o = quick;
  o.timeout_ms = 0;
  o.max_retries = 3;
  double t0 = now(), at = t0 + 0.3;
  o.stop = stop_after;
  o.stop_arg = &at;
  url_fetch_info_t info;
  cr_assert_eq(url_fetch_range(url("/slow/5000/10"), 0, 10, buf, &o, &info, &e), -1);
  cr_assert_lt(now() - t0, 2.5, "took %.2f s", now() - t0);
  cr_assert_eq(e.kind, ERR_NO_SESSION, "%s", e.msg);
  cr_assert_eq(info.attempts, 1);
  HAS(e, "/slow/5000/10: stopped by its caller");
}

/* A stop that comes while the fetch waits to retry (a 5 s backoff here) ends
 * it at once, as NO_SESSION naming why the last attempt failed; the retry
 * never goes. */
Test(url_fetch, a_callers_stop_ends_the_backoff_before_a_retry) {
  uint8_t buf[10];
  meshd_error_t e;
  url_fetch_opts_t o = quick;
  o.max_retries = 3;
  o.backoff_ms = 5000;
  double t0 = now(), at = t0 + 0.3;
  o.stop = stop_after;
  o.stop_arg = &at;
  url_fetch_info_t info;
  cr_assert_eq(url_fetch_range(url("/flaky/stop/3/100"), 0, 10, buf, &o, &info, &e), -1);
  cr_assert_lt(now() - t0, 2.0, "the backoff ran on past the stop: %.2f s", now() - t0);
  cr_assert_eq(e.kind, ERR_NO_SESSION, "%s", e.msg);
  cr_assert_eq(info.attempts, 1);
  HAS(e, "stopped by its caller before a retry (it failed: HTTP 500");
  char count[8] = {0};
  size_t got;
  cr_assert_eq(url_fetch_all(url("/count/stop"), count, sizeof count - 1, &got, &quick, NULL, &e), 0);
  cr_assert_str_eq(count, "1", "no retry went after the stop");
}

Test(url_fetch, connection_refused) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  cr_assert_eq(bind(s, (struct sockaddr *)&a, sizeof a), 0);
  cr_assert_eq(getsockname(s, (struct sockaddr *)&a, &len), 0);
  close(s); /* a port nobody listens on */
  char u[64];
  snprintf(u, sizeof u, "http://127.0.0.1:%d/x", ntohs(a.sin_port));
  uint8_t buf[10];
  meshd_error_t e;
  cr_assert_eq(url_fetch_range(u, 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE);
  HAS(e, "could not connect (curl: ");
  HAS(e, u);
}

Test(url_fetch, private_addresses_refused_before_connecting) {
  const char *urls[] = {"http://10.0.0.1/model.safetensors", "http://169.254.169.254/latest",
                        "http://[fe80::1]/x", "http://[fd00::5]:8080/x", "https://192.168.1.1/x",
                        "http://172.16.0.1/x", "http://167772161/x" /* 10.0.0.1 in decimal */};
  const char *why[] = {"10.0.0.1 is a private address (10.0.0.0/8)",
                       "169.254.169.254 is a link-local address (169.254.0.0/16)",
                       "fe80::1 is a link-local address (fe80::/10)",
                       "fd00::5 is a unique local (private) address (fc00::/7)",
                       "192.168.1.1 is a private address (192.168.0.0/16)",
                       "172.16.0.1 is a private address (172.16.0.0/12)",
                       "10.0.0.1 is a private address (10.0.0.0/8)"};
  for (size_t i = 0; i < sizeof urls / sizeof urls[0]; i++) {
    uint8_t buf[10];
    meshd_error_t e;
    url_fetch_opts_t o = quick;
    o.connect_timeout_ms = 5000;
    double t0 = now();
    cr_assert_eq(url_fetch_range(urls[i], 0, 10, buf, &o, NULL, &e), -1, "%s", urls[i]);
    cr_assert_lt(now() - t0, 0.5, "%s: refused without trying to connect", urls[i]);
    cr_assert_eq(e.kind, ERR_PERMISSION_DENIED, "%s: %s", urls[i], e.msg);
    HAS(e, "refused before connecting: ");
    HAS(e, why[i]);
  }
  /* Listed networks are allowed: then the connection is tried (and times out). */
  url_allow_t allow = {.nets = (const char *[]){"10.0.0.0/24"}, .n_nets = 1};
  url_fetch_opts_t o = quick;
  o.allow = &allow;
  o.connect_timeout_ms = 100;
  uint8_t buf[10];
  meshd_error_t e;
  cr_assert_eq(url_fetch_range("http://10.0.0.1/x", 0, 10, buf, &o, NULL, &e), -1);
  cr_assert(!strstr(e.msg, "refused before connecting"), "%s", e.msg);
  allow.nets = (const char *[]){"10.0.0/24"};
  cr_assert_eq(url_fetch_range("http://10.0.0.1/x", 0, 10, buf, &o, NULL, &e), -1);
  HAS(e, "URL allow list: network '10.0.0/24' is not an address or address/prefix");
}

static bool allowed(const url_allow_t *a, const char *addr) {
  struct sockaddr_storage ss = {0};
  char why[200];
  if (strchr(addr, ':')) {
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
    s6->sin6_family = AF_INET6;
    cr_assert_eq(inet_pton(AF_INET6, addr, &s6->sin6_addr), 1);
  } else {
    struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
    s4->sin_family = AF_INET;
    cr_assert_eq(inet_pton(AF_INET, addr, &s4->sin_addr), 1);
  }
  return url_allow_address(a, (struct sockaddr *)&ss, why, sizeof why);
}

/* The check the socket callback makes on every address a name resolves to. */
Test(url_fetch, address_rules) {
  const char *ok[] = {"8.8.8.8", "127.0.0.1", "127.5.6.7", "::1", "2606:4700::1111",
                      "::ffff:1.1.1.1", "64:ff9b::808:808", "2002:0808:0808::1"};
  const char *refused[] = {"10.1.2.3",      "172.31.255.255", "192.168.0.1",   "169.254.169.254",
                           "100.64.0.1",    "0.0.0.0",        "224.0.0.1",     "255.255.255.255",
                           "::",            "::ffff:10.0.0.1", "fc00::1",      "fe80::1",
                           "2001:db8::1",   "ff02::1",        "64:ff9b::a00:1", "2002:0a00:0001::1",
                           "100::1"};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) cr_assert(allowed(NULL, ok[i]), "%s", ok[i]);
  for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
    cr_assert(!allowed(NULL, refused[i]), "%s", refused[i]);
  url_allow_t nets = {.nets = (const char *[]){"10.1.0.0/16", "fd00::/8", "192.168.7.7"},
                      .n_nets = 3};
  cr_assert(allowed(&nets, "10.1.200.3"));
  cr_assert(allowed(&nets, "::ffff:10.1.0.1"));
  cr_assert(!allowed(&nets, "10.2.0.1"));
  cr_assert(allowed(&nets, "fd12::1"));
  cr_assert(!allowed(&nets, "fc00::1"));
  cr_assert(allowed(&nets, "192.168.7.7"));
  cr_assert(!allowed(&nets, "192.168.7.8"));
  url_allow_t any = {.allow_private = true};
  cr_assert(allowed(&any, "10.0.0.1"));
}

Test(url_fetch, schemes_and_hosts) {
  uint8_t buf[10];
  meshd_error_t e;
  cr_assert_eq(url_fetch_range("ftp://example.com/x", 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED);
  cr_assert_str_eq(e.msg, "fetch ftp://example.com/x: scheme 'ftp' is not allowed (allowed: http, "
                          "https; the server's --url-allow lists them)");
  cr_assert_eq(url_fetch_range("file:///etc/hostname", 0, 1, buf, &quick, NULL, &e), -1);
  HAS(e, "scheme 'file' is not allowed");
  url_allow_t gopher = {.schemes = (const char *[]){"gopher"}, .n_schemes = 1};
  url_fetch_opts_t o = quick;
  o.allow = &gopher;
  cr_assert_eq(url_fetch_range("gopher://example.com/x", 0, 10, buf, &o, NULL, &e), -1);
  HAS(e, "scheme 'gopher' is not supported (http, https, file)");
  cr_assert_eq(url_fetch_range("not a url", 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  HAS(e, "not a URL");

  url_allow_t hosts = {.hosts = (const char *[]){"*.example.com", "models.internal"}, .n_hosts = 2};
  o.allow = &hosts;
  cr_assert_eq(url_fetch_range(url("/bytes/10"), 0, 10, buf, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED);
  HAS(e, "host '127.0.0.1' is not in the URL allow list");
  cr_assert_eq(url_fetch_range("http://example.com/x", 0, 10, buf, &o, NULL, &e), -1);
  HAS(e, "host 'example.com' is not in the URL allow list");
  hosts.hosts = (const char *[]){"127.0.0.1"};
  hosts.n_hosts = 1;
  cr_assert_eq(url_fetch_range(url("/bytes/10"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
}

Test(url_fetch, credentials_and_query_stay_out_of_messages) {
  char u[256], out[256];
  snprintf(u, sizeof u,
           "http://alice:s3cr3t@127.0.0.1:%d/status/404?X-Amz-Signature=deadbeef&X-Amz-Credential=AKIA#frag",
           port);
  uint8_t buf[10];
  meshd_error_t e;
  cr_assert_eq(url_fetch_range(u, 0, 10, buf, &quick, NULL, &e), -1);
  char want[128];
  snprintf(want, sizeof want, "fetch http://127.0.0.1:%d/status/404: HTTP 404", port);
  HAS(e, want);
  const char *secrets[] = {"alice", "s3cr3t", "Signature", "deadbeef", "AKIA", "frag", "?", "@"};
  for (size_t i = 0; i < sizeof secrets / sizeof secrets[0]; i++)
    cr_assert(!strstr(e.msg, secrets[i]), "'%s' shows '%s'", e.msg, secrets[i]);
  /* Also on failures before any request, and in url_redact itself. */
  cr_assert_eq(url_fetch_range("http://bob:pw@10.0.0.1/x?sig=1", 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert(!strstr(e.msg, "bob") && !strstr(e.msg, "pw") && !strstr(e.msg, "sig"), "%s", e.msg);
  cr_assert_str_eq(url_redact("https://u:p@h.example:8443/a/b?q=1#f", out, sizeof out),
                   "https://h.example:8443/a/b");
  cr_assert_str_eq(url_redact("https://h/a@b?x", out, sizeof out), "https://h/a@b");

  cr_assert_str_eq(url_redact("https://user@[::1]:80#x", out, sizeof out), "https://[::1]:80/");
  /* One or three slashes: curl reads the credentials there too (and sends them). */
  cr_assert_str_eq(url_redact("https:///u:pw@h.example/f?s", out, sizeof out), "https://h.example/f");
  cr_assert_str_eq(url_redact("https:/u:pw@h.example/f", out, sizeof out), "https://h.example/f");
  cr_assert_str_eq(url_redact("HTTP://U:PW@H/a", out, sizeof out), "http://H/a");
  /* Not a URL curl reads: its scheme at most. */
  cr_assert_str_eq(url_redact("u:p@host/path?q", out, sizeof out), "u:... (not shown: not a URL)");
  cr_assert_str_eq(url_redact("ht tp://u:p@w@h/x?y", out, sizeof out), "... (not shown: not a URL)");
  cr_assert_str_eq(url_redact("https://u:p?ss@h:x/", out, sizeof out),
                   "https:... (not shown: not a URL)");
  cr_assert_str_eq(url_redact("file:///data/w.npy", out, sizeof out), "file:///data/w.npy");
}

Test(url_fetch, redirects_followed_and_checked) {
  uint8_t buf[10];
  meshd_error_t e;
  url_fetch_info_t info;
  cr_assert_eq(url_fetch_range(url("/redirect/redirect/bytes/100"), 5, 10, buf, &quick, &info, &e),
               0, "%s", e.msg);
  cr_assert_eq(info.redirects, 2);
  cr_assert_eq(buf[0], pattern(5));
  cr_assert_eq(url_fetch_range(url("/redirect-to?url=http://10.0.0.1/x"), 0, 10, buf, &quick,
                               NULL, &e),
               -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED);
  HAS(e, "(redirected to http://10.0.0.1/x): refused before connecting");
  url_fetch_opts_t o = quick;
  o.max_redirects = 1;
  cr_assert_eq(url_fetch_range(url("/redirect/redirect/bytes/100"), 0, 10, buf, &o, NULL, &e), -1);
  HAS(e, "more than 1 redirects");
  url_allow_t both = {.schemes = (const char *[]){"http", "file"}, .n_schemes = 2};
  o.allow = &both;
  cr_assert_eq(url_fetch_range(url("/redirect-to?url=file:///etc/hostname"), 0, 1, buf, &o, NULL,
                               &e),
               -1);
  HAS(e, "a redirect to scheme file is not followed");
}

Test(url_fetch, size_from_head_or_a_range_get) {
  uint64_t size = 0;
  meshd_error_t e;
  url_fetch_info_t info;
  cr_assert_eq(url_fetch_size(url("/bytes/1234"), &quick, &size, &info, &e), 0, "%s", e.msg);
  cr_assert_eq(size, 1234);
  cr_assert_eq(url_fetch_size(url("/nohead/777"), &quick, &size, &info, &e), 0, "%s", e.msg);
  cr_assert_eq(size, 777);
  cr_assert_eq(info.status, 206);
  cr_assert_eq(url_fetch_size(url("/norange/55"), &quick, &size, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(size, 55);
  cr_assert_eq(url_fetch_size(url("/status/404"), &quick, &size, NULL, &e), -1);
  HAS(e, "HTTP 404");
  cr_assert_eq(url_fetch_size("http://10.0.0.1/x", &quick, &size, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED);
}

/* A Content-Range whose total is not past its range's end ("bytes 0-9/5")
 * contradicts itself: refused, naming the URL and the header, on a range
 * read and on the size probe (a HEAD-refusing server), not taken as the
 * resource's length. */
Test(url_fetch, a_content_range_total_before_its_end_is_refused) {
  uint8_t buf[10];
  uint64_t size = 0;
  meshd_error_t e;
  const char *u = url("/badtotal/5/10");
  cr_assert_eq(url_fetch_range(u, 0, 10, buf, &quick, NULL, &e), -1, "a range read of bytes 0-9 "
               "of a 5-byte resource was accepted");
  cr_assert_eq(e.kind, ERR_UNAVAILABLE);
  HAS(e, u);
  HAS(e, "Content-Range");
  HAS(e, "bytes 0-9/5");
  cr_assert_eq(url_fetch_size(url("/badtotal/0/10"), &quick, &size, NULL, &e), -1,
               "the size probe took %llu from \"bytes 0-0/0\"", (unsigned long long)size);
  HAS(e, "bytes 0-0/0");
  HAS(e, "/badtotal/0/10");
  /* A consistent one still reads. */
  cr_assert_eq(url_fetch_range(url("/badtotal/10/10"), 0, 10, buf, &quick, NULL, &e), 0, "%s",
               e.msg);
  cr_assert_eq(url_fetch_size(url("/badtotal/10/10"), &quick, &size, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(size, 10);
}

Test(url_fetch, max_bytes_per_fetch) {
  uint8_t buf[10];
  meshd_error_t e;
  url_fetch_opts_t o = quick;
  o.max_bytes = 5;
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 0, 10, buf, &o, NULL, &e), -1);
  HAS(e, "10 bytes is more than one fetch may read (5)");
}

Test(url_fetch, file_urls) {
  char dir[] = "/tmp/url_fetch_XXXXXX", path[128], u[160];
  cr_assert(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/data.bin", dir);
  FILE *f = fopen(path, "wb");
  for (int i = 0; i < 4096; i++) fputc(pattern((uint64_t)i), f);
  fclose(f);
  snprintf(u, sizeof u, "file://%s", path);
  url_allow_t allow = {.schemes = (const char *[]){"file"}, .n_schemes = 1,
                       .file_roots = (const char *[]){dir}, .n_file_roots = 1};
  url_fetch_opts_t o = quick;
  o.allow = &allow;
  uint8_t buf[4096];
  meshd_error_t e;
  url_fetch_info_t info;
  cr_assert_eq(url_fetch_range(u, 1000, 500, buf, &o, &info, &e), 0, "%s", e.msg);
  for (int i = 0; i < 500; i++) cr_assert_eq(buf[i], pattern(1000 + (uint64_t)i));
  size_t got;
  cr_assert_eq(url_fetch_all(u, buf, sizeof buf, &got, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(got, 4096);
  uint64_t size;
  cr_assert_eq(url_fetch_size(u, &o, &size, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(size, 4096);
  cr_assert_eq(url_fetch_range(u, 4000, 200, buf, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  HAS(e, "got 96 of the 200 bytes asked");
  /* Outside the roots, also through "..". */
  char outside[200];
  snprintf(outside, sizeof outside, "file://%s/../%s/../../etc/hostname", dir, dir + 5);
  cr_assert_eq(url_fetch_range(outside, 0, 1, buf, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED, "%s", e.msg);
  HAS(e, "the file is outside the directories the URL allow list gives");
  snprintf(outside, sizeof outside, "file://%s/missing", dir);
  cr_assert_eq(url_fetch_range(outside, 0, 1, buf, &o, NULL, &e), -1);
  HAS(e, "no such file");
  /* Outside the roots, whether it exists or not: the same answer. */
  cr_assert_eq(url_fetch_range("file:///etc/no-such-file-here", 0, 1, buf, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED, "%s", e.msg);
  HAS(e, "the file is outside the directories the URL allow list gives");
  /* Encoded dots are not undone into a way out. */
  snprintf(outside, sizeof outside, "file://%s/%%2e%%2e/x", dir);
  cr_assert_eq(url_fetch_range(outside, 0, 1, buf, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT, "%s", e.msg);
  HAS(e, "'.' or '..' segment");
  /* A link inside a root to a file outside it. */
  char link[180];
  snprintf(link, sizeof link, "%s/escape", dir);
  cr_assert_eq(symlink("/etc/hostname", link), 0);
  snprintf(outside, sizeof outside, "file://%s", link);
  cr_assert_eq(url_fetch_range(outside, 0, 1, buf, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED, "%s", e.msg);
  HAS(e, "through a symbolic link");
  unlink(link);
  /* A FIFO is refused, not waited on for a writer that never comes. */
  char fifo[180];
  snprintf(fifo, sizeof fifo, "%s/fifo", dir);
  cr_assert_eq(mkfifo(fifo, 0600), 0);
  snprintf(outside, sizeof outside, "file://%s", fifo);
  cr_assert_eq(url_fetch_range(outside, 0, 1, buf, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT, "%s", e.msg);
  HAS(e, "not a regular file");
  unlink(fifo);
  unlink(path);
  rmdir(dir);
}

Test(url_fetch, a_file_checked_is_the_file_read_whatever_its_path_names_later) {
  /* The check opens the file and hands back that descriptor: a link swapped
   * in after the check (to a file outside the roots) changes nothing read. */
  char dir[] = "/tmp/url_fetch_XXXXXX", path[128], u[160], moved[140];
  cr_assert(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/data.txt", dir);
  FILE *f = fopen(path, "w");
  fputs("inside", f);
  fclose(f);
  snprintf(u, sizeof u, "file://%s", path);
  url_allow_t allow = {.schemes = (const char *[]){"file"}, .n_schemes = 1,
                       .file_roots = (const char *[]){dir}, .n_file_roots = 1};
  char scheme[16];
  meshd_error_t e;
  int fd = -1;
  cr_assert_eq(url_allow_check_url(&allow, u, u, &fd, scheme, sizeof scheme, &e), 0, "%s", e.msg);
  cr_assert_geq(fd, 0, "the check opened nothing");
  snprintf(moved, sizeof moved, "%s/moved.txt", dir);
  cr_assert_eq(rename(path, moved), 0);
  cr_assert_eq(symlink("/etc/hostname", path), 0);
  char got[16] = {0};
  cr_assert_eq(pread(fd, got, sizeof got - 1, 0), 6);
  cr_assert_str_eq(got, "inside");
  close(fd);
  /* Checked again, the link is refused; as text only, nothing is opened. */
  cr_assert_eq(url_allow_check_url(&allow, u, u, &fd, scheme, sizeof scheme, &e), -1);
  HAS(e, "through a symbolic link");
  cr_assert_eq(fd, -1);
  cr_assert_eq(url_allow_check_url(&allow, u, u, NULL, scheme, sizeof scheme, &e), 0, "%s", e.msg);
  unlink(path);
  unlink(moved);
  rmdir(dir);
}

/* ------------------------------------------------ a load reads one version
 * The range server's /versioned/KEY/HOW/1/N changes (same size, new
 * validators and bytes) after the first GET that follows its first HEAD:
 * the size and version are read, one range sees version 1, the next one
 * version 2, as when a checkpoint is saved again in place mid-load. */

/* The resource's version, then the first half (version 1) under it. */
static void read_version_then_half(const char *u, char *version, url_fetch_opts_t *o) {
  uint64_t size = 0;
  uint8_t buf[500];
  meshd_error_t e;
  cr_assert_eq(url_fetch_size_version(u, o, &size, version, URL_VERSION_MAX, NULL, &e), 0, "%s",
               e.msg);
  cr_assert_eq(size, 1000);
  o->expect_version = version;
  o->max_retries = 3; /* a change is not retried */
  cr_assert_eq(url_fetch_range(u, 0, 500, buf, o, NULL, &e), 0, "%s", e.msg);
  for (int i = 0; i < 500; i++) cr_assert_eq(buf[i], pattern((uint64_t)i));
}

static int count_bytes(void *arg, uint64_t pos, const void *bytes, size_t n, meshd_error_t *e) {
  (void)pos, (void)bytes, (void)e;
  *(uint64_t *)arg += n;
  return 0;
}

/* The second half must fail as a change; returns its message. */
static meshd_error_t second_half_fails(const char *u, const url_fetch_opts_t *o) {
  meshd_error_t e = {0};
  url_fetch_info_t info;
  uint64_t given = 0;
  cr_assert_eq(url_fetch_range_to(u, 500, 500, count_bytes, &given, o, &info, &e), -1,
               "%s: the second half of a changed resource was read", u);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT, "%s", e.msg);
  char want[300];
  snprintf(want, sizeof want, "fetch %s: the resource changed during the load (", u);
  HAS(e, want);
  HAS(e, "); load it again");
  cr_assert_eq(info.attempts, 1, "a change is not retried: %s", e.msg);
  cr_assert_eq(given, 0, "%" PRIu64 " bytes of the new version reached the caller", given);
  return e;
}

Test(url_fetch, a_change_mid_load_fails_the_next_range_by_etag) {
  char version[URL_VERSION_MAX];
  url_fetch_opts_t o = quick;
  read_version_then_half(url("/versioned/e/etag/1/1000"), version, &o);
  cr_assert_str_eq(version, "etag \"e-v1\"");
  meshd_error_t e = second_half_fails(url("/versioned/e/etag/1/1000"), &o);
  HAS(e, "HTTP 412 Precondition Failed: it is no longer etag \"e-v1\"");
}

Test(url_fetch, a_change_mid_load_fails_the_next_range_by_last_modified) {
  char version[URL_VERSION_MAX];
  url_fetch_opts_t o = quick;
  read_version_then_half(url("/versioned/m/mtime/1/1000"), version, &o);
  cr_assert_str_eq(version, "mtime 1700000000");
  meshd_error_t e = second_half_fails(url("/versioned/m/mtime/1/1000"), &o);
  HAS(e, "HTTP 412 Precondition Failed: it is no longer mtime 1700000000");
}

/* A server that ignores If-Match and If-Unmodified-Since: the answer's own
 * ETag or Last-Modified tells, before any of its bytes are taken. */
Test(url_fetch, a_change_mid_load_is_seen_where_the_server_ignores_preconditions) {
  char version[URL_VERSION_MAX];
  url_fetch_opts_t o = quick;
  read_version_then_half(url("/versioned/le/etag-lax/1/1000"), version, &o);
  meshd_error_t e = second_half_fails(url("/versioned/le/etag-lax/1/1000"), &o);
  HAS(e, "it was etag \"le-v1\", now etag \"le-v2\"");
  o = quick;
  read_version_then_half(url("/versioned/lm/mtime-lax/1/1000"), version, &o);
  e = second_half_fails(url("/versioned/lm/mtime-lax/1/1000"), &o);
  HAS(e, "it was mtime 1700000000, now mtime 1700000060");
}

/* An unchanged resource read in many ranges under its validator, as a
 * sharded load reads its rows: every range passes, strict server or not. */
Test(url_fetch, a_sharded_load_of_an_unchanged_resource_passes_its_preconditions) {
  const char *paths[] = {"/versioned/s1/etag/99/4096", "/versioned/s2/mtime/99/4096",
                         "/versioned/s3/etag-lax/99/4096"};
  for (size_t p = 0; p < sizeof paths / sizeof paths[0]; p++) {
    const char *u = url(paths[p]);
    char version[URL_VERSION_MAX];
    uint64_t size;
    meshd_error_t e;
    url_fetch_opts_t o = quick;
    cr_assert_eq(url_fetch_size_version(u, &o, &size, version, sizeof version, NULL, &e), 0, "%s",
                 e.msg);
    o.expect_version = version;
    uint8_t buf[4096];
    for (uint64_t row = 0; row < 8; row++) {
      url_fetch_info_t info;
      cr_assert_eq(url_fetch_range(u, row * 512, 512, buf + row * 512, &o, &info, &e), 0,
                   "%s row %" PRIu64 ": %s", u, row, e.msg);
      cr_assert_eq(info.status, 206);
    }
    for (int i = 0; i < 4096; i++) cr_assert_eq(buf[i], pattern((uint64_t)i), "%s", u);
    size_t got;
    cr_assert_eq(url_fetch_all(u, buf, sizeof buf, &got, &o, NULL, &e), 0, "%s", e.msg);
  }
  /* Not a validator url_fetch_size_version gives: refused, nothing sent. */
  url_fetch_opts_t o = quick;
  o.expect_version = "sha 1234";
  uint8_t b[4];
  meshd_error_t e;
  cr_assert_eq(url_fetch_range(url("/bytes/10"), 0, 4, b, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  HAS(e, "expect_version 'sha 1234' is neither \"etag TAG\" nor \"mtime SECONDS\"");
  o.expect_version = "mtime 99999999999999999"; /* past any HTTP date */
  cr_assert_eq(url_fetch_range(url("/bytes/10"), 0, 4, b, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
}

/* file://: the file's mtime, read after the bytes, must still be the one
 * expected: a file rewritten in place before or during the read fails. */
Test(url_fetch, a_file_changed_mid_load_fails) {
  char dir[] = "/tmp/url_fetch_XXXXXX", path[128], u[160];
  cr_assert(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/data.bin", dir);
  FILE *f = fopen(path, "wb");
  for (int i = 0; i < 1000; i++) fputc(pattern((uint64_t)i), f);
  fclose(f);
  struct timespec old[2] = {{1700000000, 0}, {1700000000, 0}};
  cr_assert_eq(utimensat(AT_FDCWD, path, old, 0), 0);
  snprintf(u, sizeof u, "file://%s", path);
  url_allow_t allow = {.schemes = (const char *[]){"file"}, .n_schemes = 1,
                       .file_roots = (const char *[]){dir}, .n_file_roots = 1};
  url_fetch_opts_t o = quick;
  o.allow = &allow;
  char version[URL_VERSION_MAX];
  uint64_t size;
  uint8_t buf[500];
  meshd_error_t e;
  cr_assert_eq(url_fetch_size_version(u, &o, &size, version, sizeof version, NULL, &e), 0, "%s",
               e.msg);
  cr_assert_str_eq(version, "mtime 1700000000");
  o.expect_version = version;
  cr_assert_eq(url_fetch_range(u, 0, 500, buf, &o, NULL, &e), 0, "%s", e.msg);
  f = fopen(path, "r+b"); /* saved again in place, the same size */
  fputc(0, f);
  fclose(f);
  cr_assert_eq(url_fetch_range(u, 500, 500, buf, &o, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT, "%s", e.msg);
  char want[300];
  snprintf(want, sizeof want, "fetch %s: the resource changed during the load (it was mtime "
           "1700000000, now mtime ", u);
  HAS(e, want);
  /* Without file roots (curl opens the file, not url_fetch): the same. */
  allow.n_file_roots = 0;
  cr_assert_eq(url_fetch_range(u, 500, 500, buf, &o, NULL, &e), -1);
  HAS(e, want);
  cr_assert_eq(utimensat(AT_FDCWD, path, old, 0), 0);
  cr_assert_eq(url_fetch_range(u, 500, 500, buf, &o, NULL, &e), 0, "%s", e.msg);
  unlink(path);
  rmdir(dir);
}

/* Which file a file:// URL names here: the same file by any spelling of its
 * path gives one identity, a file put in its place (a host's own copy, a
 * rename) another, and no file or another scheme none. */
Test(url_fetch, file_identity_tells_a_file_from_its_copy) {
  char dir[] = "/tmp/url_fetch_XXXXXX", path[128], tmp[128], u[200], v[200];
  char a[128], b[128], c[128];
  cr_assert(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/m x.bin", dir);
  snprintf(tmp, sizeof tmp, "%s/copy.bin", dir);
  FILE *f = fopen(path, "wb");
  fputs("same bytes", f);
  fclose(f);
  snprintf(u, sizeof u, "file://%s/m%%20x.bin", dir);
  snprintf(v, sizeof v, "file://localhost%s/./m%%20x.bin", dir);
  url_file_identity(u, a, sizeof a);
  cr_assert(strlen(a) > 4 && strchr(a, ':'), "%s", a);
  cr_assert_str_eq(url_file_identity(v, b, sizeof b), a);
  f = fopen(tmp, "wb");
  fputs("same bytes", f);
  fclose(f);
  cr_assert_eq(rename(tmp, path), 0);
  cr_assert_str_neq(url_file_identity(u, c, sizeof c), a);
  /* Read back by a load's check: a file renamed into place (another inode on
   * this machine's device) with another mtime is refused, where /proc gives
   * the boot id that says it is this machine. */
  char inspected[300];
  snprintf(inspected, sizeof inspected, "mtime 1" URL_FILE_MARK "%s", a);
  cr_assert_eq(url_version_match(inspected, "mtime 2", c),
               a[0] != ':' ? URL_VERSION_REPLACED : URL_VERSION_COPY, "%s, now %s", a, c);
  cr_assert_eq(url_version_match(inspected, "mtime 1", c), URL_VERSION_COPY);
  cr_assert_str_eq(url_file_identity("https://example.com/m.bin", c, sizeof c), "");
  snprintf(v, sizeof v, "file://%s/missing.bin", dir);
  cr_assert_str_eq(url_file_identity(v, c, sizeof c), "");
  unlink(path);
  rmdir(dir);
}

/* A load's version check: the inspection's version (for file://, which file it
 * read) against a rank's own version and file. */
Test(url_fetch, version_match_tells_a_replaced_file_from_a_copy) {
  static const struct {
    const char *inspected, *mine, *identity;
    url_version_match_t want;
  } cases[] = {
      /* the file inspected: its mtime decides */
      {"mtime 100 file B1:7:42", "mtime 100", "B1:7:42", URL_VERSION_SAME},
      {"mtime 100 file B1:7:42", "mtime 101", "B1:7:42", URL_VERSION_CHANGED},
      /* another inode on the inspected machine's device: renamed into place
       * since (its own mtime), or a copy that kept the mtime (its header checked) */
      {"mtime 100 file B1:7:42", "mtime 101", "B1:7:43", URL_VERSION_REPLACED},
      {"mtime 100 file B1:7:42", "mtime 100", "B1:7:43", URL_VERSION_COPY},
      /* another machine or another device: a copy with its own mtime */
      {"mtime 100 file B1:7:42", "mtime 101", "B2:7:42", URL_VERSION_COPY},
      {"mtime 100 file B1:7:42", "mtime 101", "B1:8:43", URL_VERSION_COPY},
      /* no boot id (no /proc): never known to be one machine */
      {"mtime 100 file :7:42", "mtime 101", ":7:43", URL_VERSION_COPY},
      {"mtime 100 file :7:42", "mtime 101", ":7:42", URL_VERSION_CHANGED},
      /* what a later agent adds after the identity is not read */
      {"mtime 100 file B1:7:42 ns 5", "mtime 100", "B1:7:42", URL_VERSION_SAME},
      {"mtime 100 file B1:7:42 ns 5", "mtime 101", "B1:7:43", URL_VERSION_REPLACED},
      /* a mark of another form names another file */
      {"mtime 100 file 7:42", "mtime 101", "B1:7:43", URL_VERSION_COPY},
      {"mtime 100 file B1::42", "mtime 101", "B1::43", URL_VERSION_COPY},
      {"mtime 100 file ", "mtime 101", "B1:7:43", URL_VERSION_COPY},
      /* unmarked (an older inspecting agent), or not file://: compared whole */
      {"mtime 100", "mtime 101", "B1:7:42", URL_VERSION_CHANGED},
      {"etag \"a file B1:7:42\"", "etag \"a file B1:7:42\"", NULL, URL_VERSION_SAME},
      {"etag \"a file B1:7:42\"", "etag \"a\"", NULL, URL_VERSION_CHANGED},
      /* nothing inspected: nothing to compare */
      {"", "mtime 101", "B1:7:42", URL_VERSION_SAME},
      {NULL, "mtime 101", NULL, URL_VERSION_SAME},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    cr_assert_eq(url_version_match(cases[i].inspected, cases[i].mine, cases[i].identity),
                 cases[i].want, "%s, now %s in %s", cases[i].inspected ? cases[i].inspected : "-",
                 cases[i].mine, cases[i].identity ? cases[i].identity : "-");
}

/* ------------------------------------------------ connections kept (url_share_t)
 * The range server counts the TCP connections it accepted (/connections). */

/* Connections the server accepted before this question (its own not counted). */
static int accepted(void) {
  char n[24] = {0};
  size_t got;
  meshd_error_t e;
  cr_assert_eq(url_fetch_all(url("/connections"), n, sizeof n - 1, &got, &quick, NULL, &e), 0,
               "%s", e.msg);
  return atoi(n) - 1;
}

/* Rows of a load split along dim 1: n ranges of len bytes, stride apart. */
static double read_rows(const char *u, int n, uint64_t len, uint64_t stride,
                        const url_fetch_opts_t *o) {
  uint8_t buf[64];
  meshd_error_t e;
  url_fetch_info_t info;
  double t0 = now();
  for (int i = 0; i < n; i++) {
    uint64_t off = (uint64_t)i * stride + 3;
    cr_assert_eq(url_fetch_range(u, off, len, buf, o, &info, &e), 0, "row %d: %s", i, e.msg);
    cr_assert_eq(info.attempts, 1);
    for (uint64_t j = 0; j < len; j++) cr_assert_eq(buf[j], pattern(off + j), "row %d", i);
  }
  return now() - t0;
}

Test(url_fetch, the_ranges_of_a_share_reuse_its_connection) {
  enum { ROWS = 200 };
  const char *u = url("/bytes/20000");
  url_fetch_opts_t o = quick;
  int before = accepted();
  double alone = read_rows(u, ROWS, 40, 100, &o);
  int unshared = accepted() - before - 1;
  cr_assert_eq(unshared, ROWS, "without a share every range opens its own connection");

  url_share_t *s = url_share_new();
  cr_assert(s);
  o.share = s;
  before = accepted();
  uint64_t size = 0;
  char version[URL_VERSION_MAX];
  meshd_error_t e;
  cr_assert_eq(url_fetch_size_version(u, &o, &size, version, sizeof version, NULL, &e), 0, "%s",
               e.msg);
  cr_assert_eq(size, 20000);
  double shared = read_rows(u, ROWS, 40, 100, &o);
  int opened = accepted() - before - 1;
  cr_assert_leq(opened, 2, "a share opened %d connections for a HEAD and %d ranges", opened, ROWS);
  cr_log_info("%d ranges: %.3f s on %d connections, %.3f s on %d shared (%.1fx)", ROWS, alone,
              unshared, shared, opened, alone / shared);
  url_share_free(s);
  url_share_free(NULL);
}

Test(url_fetch, a_share_keeps_no_allow_list_decision) {
  uint8_t buf[100];
  meshd_error_t e;
  url_fetch_info_t info;
  url_share_t *s = url_share_new();
  url_fetch_opts_t o = quick;
  o.share = s;
  int before = accepted();
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 10, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(accepted() - before - 1, 1);

  /* A redirect to another name of the same address opens (and checks) its own
   * socket; that one is kept too. */
  char to[160];
  snprintf(to, sizeof to, "/redirect-to?url=http://localhost:%d/bytes/100", port);
  before = accepted();
  cr_assert_eq(url_fetch_range(url(to), 0, 10, buf, &o, &info, &e), 0, "%s", e.msg);
  cr_assert_eq(info.redirects, 1);
  char direct[80];
  snprintf(direct, sizeof direct, "http://localhost:%d/bytes/100", port);
  cr_assert_eq(url_fetch_range(direct, 20, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(buf[0], pattern(20));
  cr_assert_eq(accepted() - before - 1, 1, "one new connection, for localhost");

  /* With connections open, a refused address is still refused, through a
   * redirect too. */
  cr_assert_eq(url_fetch_range(url("/redirect-to?url=http://10.0.0.1/x"), 0, 10, buf, &o, NULL,
                               &e), -1);
  cr_assert_eq(e.kind, ERR_PERMISSION_DENIED);
  HAS(e, "(redirected to http://10.0.0.1/x): refused before connecting");
  /* Checks of the URL as text run on every call. */
  url_allow_t named = {.hosts = (const char *[]){"localhost"}, .n_hosts = 1};
  o.allow = &named;
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 0, 10, buf, &o, NULL, &e), -1);
  HAS(e, "host '127.0.0.1' is not in the URL allow list");

  /* Another allow list does not use connections checked under the first:
   * each of its calls opens its own socket, checked against it. */
  url_allow_t other = {.nets = (const char *[]){"10.1.0.0/16"}, .n_nets = 1};
  o.allow = &other;
  before = accepted();
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(accepted() - before - 1, 2);
  /* The same rules in another struct are the same list. */
  url_allow_t same = {0};
  o.allow = &same;
  before = accepted();
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(accepted() - before - 1, 0);
  url_share_free(s);

  /* file:// through a share: read as without one. */
  char dir[] = "/tmp/url_share_XXXXXX", path[128], u[160];
  cr_assert(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/f.bin", dir);
  FILE *f = fopen(path, "wb");
  for (int i = 0; i < 100; i++) fputc(pattern((uint64_t)i), f);
  fclose(f);
  snprintf(u, sizeof u, "file://%s", path);
  url_allow_t files = {.schemes = (const char *[]){"file", "http"}, .n_schemes = 2,
                       .file_roots = (const char *[]){dir}, .n_file_roots = 1};
  o.allow = &files;
  o.share = s = url_share_new();
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(url_fetch_range(u, 50, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
    cr_assert_eq(buf[0], pattern(50));
    cr_assert_eq(url_fetch_range(url("/bytes/100"), 50, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  }
  url_share_free(s);
  unlink(path);
  rmdir(dir);
}

/* A kept connection the server closes as the next request arrives (no byte
 * of an answer): curl sends the request again on a new one, within the same
 * attempt; not a failure, not a retry, not a body cut short. */
Test(url_fetch, a_kept_connection_the_server_dropped_is_replaced) {
  uint8_t buf[100];
  meshd_error_t e;
  url_fetch_info_t info;
  url_share_t *s = url_share_new();
  url_fetch_opts_t o = quick; /* no retries */
  o.share = s;
  int before = accepted();
  cr_assert_eq(url_fetch_range(url("/lastcall/100"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 30, 50, buf, &o, &info, &e), 0, "%s", e.msg);
  cr_assert_eq(info.attempts, 1);
  cr_assert_eq(info.bytes, 50);
  for (int i = 0; i < 50; i++) cr_assert_eq(buf[i], pattern(30 + (uint64_t)i));
  /* A HEAD too. */
  cr_assert_eq(url_fetch_range(url("/lastcall/100"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  uint64_t size = 0;
  cr_assert_eq(url_fetch_size(url("/bytes/100"), &o, &size, &info, &e), 0, "%s", e.msg);
  cr_assert_eq(size, 100);
  cr_assert_eq(info.attempts, 1);
  cr_assert_eq(accepted() - before - 1, 3);
  url_share_free(s);
}

/* A share another thread's call holds is not waited for: the call runs
 * without it. */
static void *slow_through(void *arg) {
  uint8_t buf[10];
  meshd_error_t e;
  url_fetch_opts_t o = quick;
  o.share = arg;
  cr_assert_eq(url_fetch_range(url("/slow/600/10"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  return NULL;
}

Test(url_fetch, a_share_in_use_is_not_waited_for) {
  url_share_t *s = url_share_new();
  url_fetch_opts_t o = quick;
  o.share = s;
  uint8_t buf[10];
  meshd_error_t e;
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 0, 10, buf, &o, NULL, &e), 0, "%s", e.msg);
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, slow_through, s), 0);
  usleep(200 * 1000);
  double t0 = now();
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 5, 5, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_lt(now() - t0, 0.3, "waited %.2f s for the other call", now() - t0);
  cr_assert_eq(buf[0], pattern(5));
  pthread_join(th, NULL);
  /* Free again: its connection is used. */
  int before = accepted();
  cr_assert_eq(url_fetch_range(url("/bytes/100"), 5, 5, buf, &o, NULL, &e), 0, "%s", e.msg);
  cr_assert_eq(accepted() - before - 1, 0);
  url_share_free(s);
}

/* IPv6's special-purpose ranges that are not global (RFC 6890 and the IANA
 * registry): the documentation prefix of RFC 9637, benchmarking (RFC 5180),
 * ORCHIDv2, and Teredo, whose address carries an IPv4 one. */
Test(url_fetch, address_rules_ipv6_special_purpose) {
  const char *refused[] = {"3fff::1", "2001:2::1", "2001:20::1", "2001:0:a00:1::1"};
  for (size_t i = 0; i < sizeof refused / sizeof *refused; i++)
    cr_expect(!allowed(NULL, refused[i]), "%s was allowed", refused[i]);
}

/* curl reads "example.com%25.evil.example" as the host "example.com%.evil.example"
 * (it decodes the %25) and resolves that name: the allow list must match the
 * whole of it, not the part before a '%' (a zone id is only an IPv6 literal's,
 * and curl gives that apart from the host). fuzz_url checks it too
 * (tests/fuzz/corpus/url/crash-host-cut-at-percent). */
Test(url_allow, a_percent_in_a_host_name_does_not_cut_it_for_the_host_patterns) {
  url_allow_t hosts = {.hosts = (const char *[]){"models.internal", "*.example.com"},
                       .n_hosts = 2};
  const char *refused[] = {"https://models.internal%25.evil.example/w.npy",
                           "https://models.internal%.evil.example/w.npy",
                           "https://a.example.com%25.evil.example/w.npy"};
  for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
    char scheme[16];
    meshd_error_t e = {0};
    cr_expect_eq(url_allow_check_url(&hosts, refused[i], refused[i], NULL, scheme, sizeof scheme,
                                     &e),
                 -1, "%s was allowed", refused[i]);
    cr_expect_eq(e.kind, ERR_PERMISSION_DENIED, "%s: %s", refused[i], e.msg);
  }
  /* An IPv6 literal's zone still goes (curl hands it apart from the host). */
  url_allow_t v6 = {.hosts = (const char *[]){"fe80::1"}, .n_hosts = 1, .allow_private = true};
  char scheme[16];
  meshd_error_t e = {0};
  cr_expect_eq(url_allow_check_url(&v6, "http://[fe80::1%25eth0]/x", "x", NULL, scheme,
                                   sizeof scheme, &e), 0, "%s", e.msg);
  cr_expect_eq(url_allow_check_url(&hosts, "https://models.internal./w.npy", "x", NULL, scheme,
                                   sizeof scheme, &e), 0, "%s", e.msg);
}

/* An error after a redirect names the URL asked and the one it led to, both
 * without credentials or query: a user who asked for A must see A. */
Test(url_fetch, an_error_after_a_redirect_names_the_url_asked_and_its_target) {
  uint8_t buf[10];
  meshd_error_t e;
  char u[256], want[384];
  snprintf(u, sizeof u, "http://alice:s3cr3t@127.0.0.1:%d/redirect/status/404?sig=deadbeef", port);
  cr_assert_eq(url_fetch_range(u, 0, 10, buf, &quick, NULL, &e), -1);
  snprintf(want, sizeof want,
           "fetch http://127.0.0.1:%d/redirect/status/404 (redirected to "
           "http://127.0.0.1:%d/status/404): HTTP 404 (not found)", port, port);
  cr_assert_str_eq(e.msg, want);
  const char *secrets[] = {"alice", "s3cr3t", "sig", "deadbeef"};
  for (size_t i = 0; i < sizeof secrets / sizeof secrets[0]; i++)
    cr_assert(!strstr(e.msg, secrets[i]), "'%s' shows '%s'", e.msg, secrets[i]);
  /* Refused by the allow list at the target: both again. */
  cr_assert_eq(url_fetch_range(url("/redirect-to?url=http://u:pw@10.0.0.1/x"), 0, 10, buf, &quick,
                               NULL, &e), -1);
  snprintf(want, sizeof want, "fetch http://127.0.0.1:%d/redirect-to (redirected to "
           "http://10.0.0.1/x): refused before connecting", port);
  HAS(e, want);
  cr_assert(!strstr(e.msg, "pw"), "%s", e.msg);
  /* Without a redirect: the URL alone, as before. */
  cr_assert_eq(url_fetch_range(url("/status/404"), 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert(!strstr(e.msg, "redirected"), "%s", e.msg);
}

/* The size probe asks byte 0: a 206 for another range (whose total may be
 * another resource's), or with a Content-Range that does not parse, is
 * refused naming the URL (without its credentials) and what came back, not
 * taken as the length. */
Test(url_fetch, a_size_probe_answered_with_another_range_is_refused) {
  uint64_t size = 0;
  meshd_error_t e;
  char u[600];
  snprintf(u, sizeof u, "http://user:secret@127.0.0.1:%d/cr206/100?cr=bytes%%205-5/100", port);
  cr_assert_eq(url_fetch_size(u, &quick, &size, NULL, &e), -1, "took %llu from \"bytes 5-5/100\"",
               (unsigned long long)size);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE, "%s", error_kind_name(e.kind));
  HAS(e, "/cr206/100");
  HAS(e, "asked bytes 0-0, the server answered bytes 5-5");
  HAS(e, "bytes 5-5/100");
  cr_assert(!strstr(e.msg, "secret") && !strstr(e.msg, "user"), "%s", e.msg);
  /* More than byte 0, its body as long as its Content-Range says: still another range. */
  cr_assert_eq(url_fetch_size(url("/cr206/100?cr=bytes%200-9/100"), &quick, &size, NULL, &e), -1,
               "took %llu from \"bytes 0-9/100\"", (unsigned long long)size);
  HAS(e, "the server answered bytes 0-9");
  cr_assert_eq(url_fetch_size(url("/cr206/100?cr=bytes%20zero/100"), &quick, &size, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE, "%s", error_kind_name(e.kind));
  HAS(e, "/cr206/100");
  HAS(e, "without a valid Content-Range (\"bytes zero/100\")");
  /* The range asked: its total is the size. */
  cr_assert_eq(url_fetch_size(url("/cr206/100?cr=bytes%200-0/100"), &quick, &size, NULL, &e), 0,
               "%s", e.msg);
  cr_assert_eq(size, 100);
}

/* A server whose 206 contradicts itself (an empty body, or a body of another
 * length than its Content-Range) is named for what it did, not taken for a
 * server that gives no length or a resource that is shorter. */
Test(url_fetch, a_206_whose_body_contradicts_its_content_range_says_so) {
  uint8_t buf[10];
  uint64_t size = 0;
  meshd_error_t e;
  /* The size probe (HEAD refused): 206 "bytes 0-0/100" and no body. */
  cr_assert_eq(url_fetch_size(url("/empty206/100"), &quick, &size, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE, "%s", error_kind_name(e.kind));
  HAS(e, "HTTP 206 with an empty body");
  HAS(e, "bytes 0-0/100");
  cr_assert(!strstr(e.msg, "neither on HEAD"), "%s", e.msg);
  /* ... and "bytes 0-0/100" over a 5-byte body. */
  cr_assert_eq(url_fetch_size(url("/shortbody/5/100"), &quick, &size, NULL, &e), -1);
  HAS(e, "bytes 0-0/100");
  HAS(e, "5 bytes");
  /* A range read: "bytes 0-9/100" and no body, or a 5-byte body. */
  cr_assert_eq(url_fetch_range(url("/empty206/100"), 0, 10, buf, &quick, NULL, &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE, "%s", error_kind_name(e.kind));
  HAS(e, "bytes 0-9/100");
  cr_assert(!strstr(e.msg, "the resource is shorter"), "%s", e.msg);
  cr_assert_eq(url_fetch_range(url("/shortbody/5/100"), 0, 10, buf, &quick, NULL, &e), -1);
  HAS(e, "bytes 0-9/100");
  HAS(e, "5 bytes");
  cr_assert(!strstr(e.msg, "the resource is shorter"), "%s", e.msg);
  /* A range cut at the resource's end, said so in its Content-Range: shorter. */
  cr_assert_eq(url_fetch_range(url("/bytes/5"), 0, 10, buf, &quick, NULL, &e), -1);
  HAS(e, "the resource is shorter");
}
