/* The live server the C client suites run against: `meshd --local-agents N`
 * from $MESHD_BIN_DIR on a free port, in a temporary directory; included by
 * test_c_client.c and test_c_client_sessions.c (one copy of each per suite). */
#ifndef MESHD_TEST_C_CLIENT_SERVER_H
#define MESHD_TEST_C_CLIENT_SERVER_H

#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static pid_t server_pid = -1;
static pid_t stopped_agent = -1; /* SIGSTOPped by a test; SIGCONTed at teardown whatever happens */
static char dir[64];
static char target[64];
#define REPORTS_ENV "MESHD_TEST_SANITIZER_REPORTS" /* the runner's file of teardowns' reports */

static inline void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static inline const char *bin_dir(void) {
  const char *d = getenv("MESHD_BIN_DIR");
  cr_assert(d && *d, "MESHD_BIN_DIR is not set (run through ctest)");
  return d;
}

/* Where the meshd these suites start is: $MESHD_SERVER_BIN_DIR where set (the
 * sanitizer pass of .ci/test points it at the plain build: these suites test the
 * client library, sanitized; the daemons' paths run sanitized in the integration
 * suites), else $MESHD_BIN_DIR. */
static inline const char *server_bin_dir(void) {
  const char *d = getenv("MESHD_SERVER_BIN_DIR");
  return d && *d ? d : bin_dir();
}

/* Reads a whole small file into buf (NUL-terminated); returns its length or -1. */
static inline long slurp(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  size_t n = fread(buf, 1, len - 1, f);
  buf[n] = '\0';
  fclose(f);
  return (long)n;
}

static inline void stop_server(void);

/* A start that failed: the start of meshd's log on stderr, then the server
 * stopped and dir removed (Criterion runs no .fini after a failed .init). */
static inline void start_failed(void) {
  char path[128], text[4096];
  snprintf(path, sizeof path, "%s/meshd.log", dir);
  if (slurp(path, text, sizeof text) > 0)
    fprintf(stderr, "--- meshd log ---\n%s\n", text);
  stop_server();
}

/* meshd --local-agents `agents` and the NULL-terminated `extra` flags; ready
 * once TensorService is SERVING to a client connected with `o` (NULL: plaintext). */
static inline void start_server_full(const char *agents, const char *const *extra,
                              const meshd_connect_options_t *o) {
  char port_file[128], log_file[128], bin[512];
  snprintf(bin, sizeof bin, "%s/meshd", server_bin_dir()); /* before dir: it may fail */
  snprintf(dir, sizeof dir, "/tmp/meshd-c-client-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
  snprintf(port_file, sizeof port_file, "%s/port", dir);
  snprintf(log_file, sizeof log_file, "%s/meshd.log", dir);
  /* Its TMPDIR is dir: the join token directory it makes for its local agents
   * goes with dir (stop_server) even when a test SIGKILLs it. */
  extern char **environ;
  static char tmpdir_var[80];
  static char *envp[512];
  snprintf(tmpdir_var, sizeof tmpdir_var, "TMPDIR=%s", dir);
  size_t ne = 0;
  for (char **e = environ; *e && ne < 510; e++)
    if (strncmp(*e, "TMPDIR=", 7) != 0)
      envp[ne++] = *e;
  envp[ne++] = tmpdir_var;
  envp[ne] = NULL;
  server_pid = fork();
  cr_assert_geq(server_pid, 0);
  if (server_pid == 0) {
    int fd = open(log_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    const char *argv[24] = {bin, "--listen", "127.0.0.1:0", "--port-file", port_file,
                            "--local-agents", agents};
    size_t n = 7;
    for (size_t i = 0; extra && extra[i] && n < 23; i++)
      argv[n++] = extra[i];
    execve(bin, (char *const *)argv, envp);
    _exit(127);
  }
  char buf[64];
  int port = 0;
  for (int i = 0; i < 300 && port <= 0; i++) {
    if (slurp(port_file, buf, sizeof buf) > 0 && strchr(buf, '\n'))
      port = atoi(buf);
    else if (slurp(port_file, buf, sizeof buf) > 0 && i > 5)
      port = atoi(buf);
    if (port <= 0)
      sleep_ms(50);
  }
  if (port <= 0)
    start_failed();
  cr_assert_gt(port, 0, "meshd wrote no port file");
  snprintf(target, sizeof target, "127.0.0.1:%d", port);

  meshd_err_t e;
  meshd_connect_options_t plain = MESHD_CONNECT_OPTIONS_INIT;
  char why[512] = "";
  meshd_client_t *c = meshd_connect_with(target, o ? o : &plain, &e, why, sizeof why);
  if (!c)
    start_failed();
  cr_assert_not_null(c, "connect: %s: %s", meshd_strerror(e), why);
  int status = MESHD_HEALTH_UNKNOWN;
  for (int i = 0; i < 300; i++) {
    if (meshd_health(c, "meshd.v1.TensorService", &status) == MESHD_E_OK &&
        status == MESHD_HEALTH_SERVING)
      break;
    sleep_ms(50);
  }
  meshd_close(c);
  if (status != MESHD_HEALTH_SERVING)
    start_failed();
  cr_assert_eq(status, MESHD_HEALTH_SERVING, "TensorService never became SERVING");
}

static inline void start_server_with(const char *const *extra) { start_server_full("2", extra, NULL); }

static inline void start_server(void) { start_server_with(NULL); }

/* The first sanitizer report in the server's log (its local agents write
 * there too), up to len bytes of it in out; false when there is none. Under
 * ASan+UBSan a leak at exit or an undefined behaviour would otherwise go
 * unseen: the log goes with dir. */
static inline bool sanitizer_report(const char *path, char *out, size_t len) {
  static const char *const marks[] = {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                                      "runtime error:", "WARNING: ThreadSanitizer"};
  FILE *f = fopen(path, "r");
  if (!f)
    return false;
  char line[1024];
  size_t n = 0;
  bool found = false;
  while (fgets(line, sizeof line, f) && n + 1 < len) {
    for (size_t i = 0; !found && i < sizeof marks / sizeof marks[0]; i++)
      found = strstr(line, marks[i]) != NULL;
    if (found) { /* the report's lines, as many as fit */
      size_t k = strlen(line) < len - n - 1 ? strlen(line) : len - n - 1;
      memcpy(out + n, line, k);
      out[n += k] = '\0';
    }
  }
  fclose(f);
  return found;
}

static inline void stop_server(void) {
  if (stopped_agent > 0)
    kill(stopped_agent, SIGCONT);
  if (server_pid > 0) {
    kill(server_pid, SIGTERM);
    int st;
    for (int i = 0; i < 100; i++) {
      if (waitpid(server_pid, &st, WNOHANG) == server_pid) {
        server_pid = -1;
        break;
      }
      sleep_ms(50);
    }
    if (server_pid > 0) {
      kill(server_pid, SIGKILL);
      waitpid(server_pid, &st, 0);
      server_pid = -1;
    }
  }
  char cmd[128], path[128], report[4096] = "";
  snprintf(path, sizeof path, "%s/meshd.log", dir);
  bool reported = dir[0] && sanitizer_report(path, report, sizeof report);
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (dir[0] && system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", dir);
  const char *reports = getenv(REPORTS_ENV);
  if (reported && reports) { /* for the runner: a .fini's assertion (or crash) fails no test */
    FILE *f = fopen(reports, "a");
    if (f) {
      fprintf(f, "%s::%s: a sanitizer report in meshd's log (server or agent):\n%s\n",
              criterion_current_test->category, criterion_current_test->name, report);
      fclose(f);
    }
  }
  cr_assert(!reported, "a sanitizer report in meshd's log (server or agent):\n%s", report);
}

/* The runner makes the file teardowns write their reports to (PRE_ALL, so
 * every test's process inherits its name), and fails the run when one did
 * (POST_ALL): Criterion prints an assertion failed in a .fini, or a crash
 * there, as a warning and counts the test as passed. */
ReportHook(PRE_ALL)(struct criterion_test_set *set) {
  (void)set;
  static char path[64];
  snprintf(path, sizeof path, "/tmp/meshd-c-client-reports-%d", (int)getpid());
  unlink(path);
  setenv(REPORTS_ENV, path, 1);
}

ReportHook(POST_ALL)(struct criterion_global_stats *stats) {
  (void)stats;
  const char *path = getenv(REPORTS_ENV);
  char text[16384];
  if (!path || slurp(path, text, sizeof text) <= 0)
    return;
  unlink(path);
  fprintf(stderr, "FAILED: sanitizer reports of the servers these tests started:\n%s", text);
  exit(1);
}

#endif
