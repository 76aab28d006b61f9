#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

/* PIPE_BUF: a line this long or shorter reaches a pipe in one piece even when
 * several processes (server and its local agents) share it. */
#define LINE_MAX_BYTES 4096
#define COMPONENT_MAX 64
#define LEVEL_UNSET (-1)

static atomic_int current_level = LEVEL_UNSET;
static pthread_once_t env_once = PTHREAD_ONCE_INIT;

static const char *const level_names[] = {"DEBUG", "INFO", "WARN", "ERROR"};

static void level_from_env(void) {
  log_level_t level = LOG_LEVEL_INFO;
  const char *env = getenv("MESHD_LOG_LEVEL");
  if (env && !log_parse_level(env, &level))
    level = LOG_LEVEL_INFO;
  int unset = LEVEL_UNSET;
  /* Loses to a log_set_level that got there first. */
  atomic_compare_exchange_strong(&current_level, &unset, (int)level);
}

static log_level_t effective_level(void) {
  int level = atomic_load_explicit(&current_level, memory_order_relaxed);
  if (level == LEVEL_UNSET) {
    pthread_once(&env_once, level_from_env);
    level = atomic_load(&current_level);
  }
  return (log_level_t)level;
}

void log_set_level(log_level_t level) {
  if (level < LOG_LEVEL_DEBUG || level > LOG_LEVEL_ERROR)
    return;
  atomic_store(&current_level, (int)level);
}

log_level_t log_get_level(void) { return effective_level(); }

bool log_parse_level(const char *text, log_level_t *out) {
  if (!text)
    return false;
  for (size_t i = 0; i < sizeof level_names / sizeof level_names[0]; i++) {
    if (strcasecmp(text, level_names[i]) == 0) {
      if (out)
        *out = (log_level_t)i;
      return true;
    }
  }
  return false;
}

static const char *base_name(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

static void write_all(const char *buf, size_t len) {
  while (len > 0) {
    ssize_t n = write(STDERR_FILENO, buf, len);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return;
    }
    buf += n;
    len -= (size_t)n;
  }
}

void log_write(log_level_t level, const char *component, const char *file, int line,
               const char *fmt, ...) {
  if (level < LOG_LEVEL_DEBUG || level > LOG_LEVEL_ERROR)
    level = LOG_LEVEL_ERROR;
  log_level_t threshold = effective_level();
  if (level < threshold)
    return;
  int saved_errno = errno;

  char buf[LINE_MAX_BYTES + 1]; /* + 1: vsnprintf's NUL */
  struct timespec now;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &now);
  gmtime_r(&now.tv_sec, &tm);
  size_t len = strftime(buf, LINE_MAX_BYTES, "%Y-%m-%dT%H:%M:%S", &tm);
  len += (size_t)snprintf(buf + len, LINE_MAX_BYTES - len, ".%03dZ %-5s %.*s: ",
                          (int)(now.tv_nsec / 1000000), level_names[level], COMPONENT_MAX,
                          component ? component : "meshd");

  /* The location and the newline are kept even when the message is cut. */
  char suffix[128];
  int suffix_len = 0;
  if (threshold == LOG_LEVEL_DEBUG && file)
    suffix_len = snprintf(suffix, sizeof suffix, " (%s:%d)", base_name(file), line);
  if (suffix_len < 0 || (size_t)suffix_len >= sizeof suffix)
    suffix_len = 0;

  size_t room = LINE_MAX_BYTES - len - (size_t)suffix_len - 1; /* 1: '\n' */
  va_list ap;
  va_start(ap, fmt);
  int want = vsnprintf(buf + len, room + 1, fmt, ap);
  va_end(ap);
  size_t msg_len = want < 0 ? 0 : (size_t)want;
  if (msg_len > room) {
    msg_len = room;
    memcpy(buf + len + msg_len - 3, "...", 3);
  }
  /* One event, one line. */
  for (char *p = buf + len; p < buf + len + msg_len; p++)
    if (*p == '\n' || *p == '\r')
      *p = ' ';
  len += msg_len;
  memcpy(buf + len, suffix, (size_t)suffix_len);
  len += (size_t)suffix_len;
  buf[len++] = '\n';

  write_all(buf, len);
  errno = saved_errno;
}

bool log_allow(log_limit_t *l, int burst, int window_ms, int *suppressed) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  long long now = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
  long long start = atomic_load(&l->window_start_ms);
  /* One thread opens the next window; the others count in whichever they see. */
  if (now - start >= window_ms && atomic_compare_exchange_strong(&l->window_start_ms, &start, now))
    atomic_store(&l->written, 0);
  if (atomic_fetch_add(&l->written, 1) >= burst) {
    atomic_fetch_add(&l->suppressed, 1);
    return false;
  }
  int held = atomic_exchange(&l->suppressed, 0);
  if (suppressed) *suppressed = held;
  return true;
}
