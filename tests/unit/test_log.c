#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

/* Captures what is written to fd 2 between capture_begin and capture_end. */
static int saved_stderr = -1;
static int pipe_fds[2];
static char captured[1 << 16];

static void capture_begin(void) {
  cr_assert_eq(pipe(pipe_fds), 0);
  saved_stderr = dup(STDERR_FILENO);
  cr_assert_geq(saved_stderr, 0);
  cr_assert_geq(dup2(pipe_fds[1], STDERR_FILENO), 0);
  close(pipe_fds[1]);
}

static const char *capture_end(void) {
  dup2(saved_stderr, STDERR_FILENO);
  close(saved_stderr);
  size_t len = 0;
  ssize_t n;
  while (len < sizeof captured - 1 &&
         (n = read(pipe_fds[0], captured + len, sizeof captured - 1 - len)) > 0)
    len += (size_t)n;
  close(pipe_fds[0]);
  captured[len] = '\0';
  return captured;
}

static void assert_matches(const char *text, const char *pattern) {
  regex_t re;
  cr_assert_eq(regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB), 0, "bad regex %s", pattern);
  int rc = regexec(&re, text, 0, NULL, 0);
  regfree(&re);
  cr_assert_eq(rc, 0, "'%s' does not match /%s/", text, pattern);
}

static size_t count_lines(const char *text) {
  size_t n = 0;
  for (; *text; text++)
    n += *text == '\n';
  return n;
}

static void init(void) {
  unsetenv("MESHD_LOG_LEVEL");
}

TestSuite(log, .init = init);

Test(log, line_format_at_info) {
  log_set_level(LOG_LEVEL_INFO);
  capture_begin();
  log_info("server", "listening on %s:%d", "0.0.0.0", 50051);
  const char *out = capture_end();
  assert_matches(out, "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
                      "INFO  server: listening on 0\\.0\\.0\\.0:50051\n$");
}

Test(log, timestamp_is_utc_now) {
  log_set_level(LOG_LEVEL_INFO);
  /* clock_gettime, as the log does: time() reads a coarser clock that can
   * still show the previous second when the log's shows the next. */
  struct timespec t0, t1;
  clock_gettime(CLOCK_REALTIME, &t0);
  capture_begin();
  log_warn("agent", "x");
  const char *out = capture_end();
  clock_gettime(CLOCK_REALTIME, &t1);
  time_t before = t0.tv_sec, after = t1.tv_sec;
  struct tm tm = {0};
  int ms = -1;
  cr_assert_eq(sscanf(out, "%4d-%2d-%2dT%2d:%2d:%2d.%3dZ", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
                      &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &ms),
               7, "%s", out);
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  time_t logged = timegm(&tm);
  cr_assert(logged >= before && logged <= after, "logged %ld, now %ld..%ld", (long)logged,
            (long)before, (long)after);
  cr_assert(ms >= 0 && ms <= 999);
}

Test(log, levels_are_padded_to_five) {
  log_set_level(LOG_LEVEL_INFO);
  capture_begin();
  log_info("c", "i");
  log_warn("c", "w");
  log_error("c", "e");
  const char *out = capture_end();
  assert_matches(out, "Z INFO  c: i\n.*Z WARN  c: w\n.*Z ERROR c: e\n$");
  cr_assert_eq(count_lines(out), 3);
}

Test(log, filtering_by_level) {
  log_set_level(LOG_LEVEL_WARN);
  capture_begin();
  log_debug("c", "d");
  log_info("c", "i");
  log_warn("c", "w");
  log_error("c", "e");
  const char *out = capture_end();
  cr_assert_eq(count_lines(out), 2, "%s", out);
  cr_assert_null(strstr(out, "c: d"));
  cr_assert_null(strstr(out, "c: i"));
  cr_assert_not_null(strstr(out, "WARN  c: w"));
  cr_assert_not_null(strstr(out, "ERROR c: e"));

  log_set_level(LOG_LEVEL_ERROR);
  capture_begin();
  log_warn("c", "w");
  log_error("c", "e");
  out = capture_end();
  cr_assert_eq(count_lines(out), 1, "%s", out);
  cr_assert_not_null(strstr(out, "ERROR c: e"));
}

Test(log, info_hides_debug_and_location) {
  log_set_level(LOG_LEVEL_INFO);
  capture_begin();
  log_debug("c", "hidden");
  log_info("c", "shown");
  const char *out = capture_end();
  cr_assert_eq(count_lines(out), 1, "%s", out);
  cr_assert_null(strstr(out, "hidden"));
  cr_assert_null(strstr(out, "test_log.c"));
}

Test(log, debug_appends_basename_and_line) {
  log_set_level(LOG_LEVEL_DEBUG);
  capture_begin();
  log_debug("rpc", "call %d", 7);
  log_write(LOG_LEVEL_INFO, "rpc", "/some/dir/file.c", 123, "hello");
  const char *out = capture_end();
  char want[64];
  snprintf(want, sizeof want, "Z DEBUG rpc: call 7 \\(test_log\\.c:%d\\)\n", __LINE__ - 4);
  assert_matches(out, want);
  assert_matches(out, "Z INFO  rpc: hello \\(file\\.c:123\\)\n$");
  cr_assert_null(strstr(out, "/some/dir"));
}

Test(log, default_level_is_info) {
  cr_assert_eq(log_get_level(), LOG_LEVEL_INFO);
}

Test(log, env_sets_level_at_first_use) {
  setenv("MESHD_LOG_LEVEL", "DeBuG", 1);
  cr_assert_eq(log_get_level(), LOG_LEVEL_DEBUG);
  /* Read once only. */
  setenv("MESHD_LOG_LEVEL", "error", 1);
  cr_assert_eq(log_get_level(), LOG_LEVEL_DEBUG);
}

Test(log, env_applies_to_first_write) {
  setenv("MESHD_LOG_LEVEL", "error", 1);
  capture_begin();
  log_warn("c", "w");
  log_error("c", "e");
  const char *out = capture_end();
  cr_assert_eq(count_lines(out), 1, "%s", out);
}

Test(log, set_level_beats_env) {
  setenv("MESHD_LOG_LEVEL", "error", 1);
  log_set_level(LOG_LEVEL_DEBUG);
  cr_assert_eq(log_get_level(), LOG_LEVEL_DEBUG);
}

Test(log, bad_env_means_info) {
  setenv("MESHD_LOG_LEVEL", "loud", 1);
  cr_assert_eq(log_get_level(), LOG_LEVEL_INFO);
}

Test(log, parse_level) {
  log_level_t l = LOG_LEVEL_ERROR;
  cr_assert(log_parse_level("debug", &l));
  cr_assert_eq(l, LOG_LEVEL_DEBUG);
  cr_assert(log_parse_level("INFO", &l));
  cr_assert_eq(l, LOG_LEVEL_INFO);
  cr_assert(log_parse_level("Warn", &l));
  cr_assert_eq(l, LOG_LEVEL_WARN);
  cr_assert(log_parse_level("error", &l));
  cr_assert_eq(l, LOG_LEVEL_ERROR);
  l = LOG_LEVEL_WARN;
  cr_assert_not(log_parse_level("verbose", &l));
  cr_assert_not(log_parse_level("", &l));
  cr_assert_not(log_parse_level("info ", &l));
  cr_assert_not(log_parse_level(NULL, &l));
  cr_assert_eq(l, LOG_LEVEL_WARN);
}

Test(log, long_messages_are_truncated_with_ellipsis) {
  log_set_level(LOG_LEVEL_DEBUG);
  static char big[20000];
  memset(big, 'a', sizeof big - 1);
  capture_begin();
  log_write(LOG_LEVEL_INFO, "c", "x.c", 9, "%s", big);
  const char *out = capture_end();
  size_t len = strlen(out);
  cr_assert_eq(count_lines(out), 1);
  cr_assert_leq(len, 4096);
  cr_assert_gt(len, 3000);
  /* The location and the newline survive the cut. */
  assert_matches(out, "aaa\\.\\.\\. \\(x\\.c:9\\)\n$");
}

Test(log, exact_fit_is_not_truncated) {
  log_set_level(LOG_LEVEL_INFO);
  static char msg[4096];
  /* Header is 24 (time) + 1 + 5 + 1 + "c: " = 34 bytes; line max is 4096 incl. '\n'. */
  memset(msg, 'b', 4096 - 34 - 1);
  capture_begin();
  log_info("c", "%s", msg);
  const char *out = capture_end();
  cr_assert_eq(strlen(out), 4096);
  cr_assert_null(strstr(out, "..."));
  memset(msg, 'b', 4096 - 34);
  capture_begin();
  log_info("c", "%s", msg);
  out = capture_end();
  cr_assert_eq(strlen(out), 4096);
  assert_matches(out, "bbb\\.\\.\\.\n$");
}

Test(log, embedded_newlines_stay_on_one_line) {
  log_set_level(LOG_LEVEL_INFO);
  capture_begin();
  log_info("c", "two\nlines\r");
  const char *out = capture_end();
  cr_assert_eq(count_lines(out), 1, "%s", out);
  assert_matches(out, "c: two lines \n$");
}

Test(log, preserves_errno) {
  log_set_level(LOG_LEVEL_INFO);
  capture_begin();
  errno = ENOENT;
  log_info("c", "x");
  int e = errno;
  capture_end();
  cr_assert_eq(e, ENOENT);
}

#define THREADS 8
#define PER_THREAD 200

static void *spam(void *arg) {
  for (int i = 0; i < PER_THREAD; i++)
    log_info("t", "thread %d line %d end", (int)(intptr_t)arg, i);
  return NULL;
}

/* Each line goes out in one write(2): lines from many threads never tear. */
Test(log, threads_do_not_interleave) {
  log_set_level(LOG_LEVEL_INFO);
  /* Write to a file so the pipe never fills while threads run. */
  char path[] = "/tmp/meshd_test_log_XXXXXX";
  int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  unlink(path);
  int saved = dup(STDERR_FILENO);
  dup2(fd, STDERR_FILENO);
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++)
    pthread_create(&t[i], NULL, spam, (void *)(intptr_t)i);
  for (int i = 0; i < THREADS; i++)
    pthread_join(t[i], NULL);
  dup2(saved, STDERR_FILENO);
  close(saved);

  off_t size = lseek(fd, 0, SEEK_END);
  char *buf = malloc((size_t)size + 1);
  cr_assert_eq(pread(fd, buf, (size_t)size, 0), size);
  buf[size] = '\0';
  close(fd);
  regex_t re;
  cr_assert_eq(regcomp(&re, "^[0-9T:.Z-]{24} INFO  t: thread [0-9]+ line [0-9]+ end$",
                       REG_EXTENDED | REG_NOSUB),
               0);
  size_t lines = 0;
  for (char *save = NULL, *l = strtok_r(buf, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
    cr_assert_eq(regexec(&re, l, 0, NULL, 0), 0, "torn line: %s", l);
    lines++;
  }
  regfree(&re);
  free(buf);
  cr_assert_eq(lines, THREADS * PER_THREAD);
}

/* ---- JSON ---- */

#define JSON_TIME "\\{\"time\":\"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z\""

Test(log, json_line_has_the_fields_given) {
  log_set_level(LOG_LEVEL_INFO);
  log_set_format(LOG_FORMAT_JSON);
  capture_begin();
  log_event(LOG_LEVEL_WARN, "command", &(log_fields_t){.session = "abc123", .seq = 7, LOG_RANK(0)},
            "rank %u lost", 0u);
  const char *out = capture_end();
  assert_matches(out, "^" JSON_TIME ",\"level\":\"warn\",\"component\":\"command\",\"msg\":\"rank 0 "
                      "lost\",\"session\":\"abc123\",\"rank\":0,\"seq\":7\\}\n$");
}

Test(log, json_line_leaves_out_unknown_fields) {
  log_set_level(LOG_LEVEL_INFO);
  log_set_format(LOG_FORMAT_JSON);
  capture_begin();
  log_info("server", "listening");
  log_event(LOG_LEVEL_ERROR, "x", &(log_fields_t){.session = "s"}, "m");
  const char *out = capture_end();
  cr_assert_eq(count_lines(out), 2);
  assert_matches(out, "^" JSON_TIME ",\"level\":\"info\",\"component\":\"server\",\"msg\":"
                      "\"listening\"\\}\n" JSON_TIME ",\"level\":\"error\",\"component\":\"x\","
                      "\"msg\":\"m\",\"session\":\"s\"\\}\n$");
}

Test(log, json_default_rank_fills_lines_without_one) {
  log_set_level(LOG_LEVEL_INFO);
  log_set_format(LOG_FORMAT_JSON);
  log_set_rank(3);
  capture_begin();
  log_info("agent", "a");
  log_event(LOG_LEVEL_INFO, "agent", &(log_fields_t){LOG_RANK(5)}, "b");
  const char *out = capture_end();
  assert_matches(out, "\"msg\":\"a\",\"rank\":3\\}\n.*\"msg\":\"b\",\"rank\":5\\}\n$");
  log_set_rank(-1);
}

Test(log, json_escapes_every_byte_into_valid_json) {
  log_set_level(LOG_LEVEL_INFO);
  log_set_format(LOG_FORMAT_JSON);
  capture_begin();
  /* quote, backslash, newline, tab, control, DEL, é, €, a lone byte, a cut
   * sequence, a surrogate, an overlong slash */
  log_event(LOG_LEVEL_INFO, "c", &(log_fields_t){.session = "s\"\n\xff"},
            "q\" b\\ n\n t\t c\x01 d\x7f e\xc3\xa9 eu\xe2\x82\xac x\xff y\xe2\x82 z\xed\xa0\x80 o\xc0\xaf.");
  const char *out = capture_end();
  const char *want = "\"msg\":\"q\\\" b\\\\ n\\n t\\t c\\u0001 d\\u007f e\xc3\xa9 eu\xe2\x82\xac "
                     "x\\ufffd y\\ufffd\\ufffd z\\ufffd\\ufffd\\ufffd o\\ufffd\\ufffd.\","
                     "\"session\":\"s\\\"\\n\\ufffd\"}\n";
  cr_assert(strstr(out, want), "got %s", out);
}

Test(log, json_long_messages_are_cut_between_escapes) {
  log_set_level(LOG_LEVEL_INFO);
  log_set_format(LOG_FORMAT_JSON);
  static char big[6000];
  memset(big, '"', sizeof big - 1); /* each escapes to two bytes */
  capture_begin();
  log_event(LOG_LEVEL_INFO, "c", &(log_fields_t){.seq = 9}, "%s", big);
  const char *out = capture_end();
  size_t len = strlen(out);
  cr_assert_eq(count_lines(out), 1);
  cr_assert_leq(len, 4096);
  cr_assert_gt(len, 4000);
  /* ...\"\"..." then the fields: an escape is never split. */
  assert_matches(out, "[^\\\\]\\\\\"\\.\\.\\.\",\"seq\":9\\}\n$");
}

Test(log, json_long_fields_are_cut_too) {
  log_set_level(LOG_LEVEL_DEBUG);
  log_set_format(LOG_FORMAT_JSON);
  static char sess[300], file[400];
  memset(sess, '"', sizeof sess - 1);
  memset(file, 'f', sizeof file - 1);
  capture_begin();
  log_write_fields(LOG_LEVEL_INFO, "c", file, 1, &(log_fields_t){.session = sess, .seq = 5}, "m");
  const char *out = capture_end();
  cr_assert_eq(count_lines(out), 1);
  /* 64 bytes of the session, each escaped; the source cut between characters. */
  char want[200] = ",\"session\":\"";
  for (int i = 0; i < 64; i++) strcat(want, "\\\"");
  strcat(want, "\",\"seq\":5,\"source\":\"fff");
  cr_assert(strstr(out, want), "%s", out);
  assert_matches(out, "f:1\"\\}\n$");
}

Test(log, json_at_debug_names_the_source) {
  log_set_level(LOG_LEVEL_DEBUG);
  log_set_format(LOG_FORMAT_JSON);
  capture_begin();
  log_write(LOG_LEVEL_DEBUG, "c", "dir/x.c", 12, "m");
  const char *out = capture_end();
  assert_matches(out, "\"level\":\"debug\",\"component\":\"c\",\"msg\":\"m\",\"source\":\"x\\.c:12\"\\}\n$");
}

Test(log, parse_format) {
  log_format_t f = LOG_FORMAT_JSON;
  cr_assert(log_parse_format("text", &f));
  cr_assert_eq(f, LOG_FORMAT_TEXT);
  cr_assert(log_parse_format("JSON", &f));
  cr_assert_eq(f, LOG_FORMAT_JSON);
  cr_assert_not(log_parse_format("yaml", &f));
  cr_assert_not(log_parse_format("", &f));
  cr_assert_not(log_parse_format(NULL, &f));
  cr_assert_eq(log_get_format(), LOG_FORMAT_TEXT); /* the default */
}
