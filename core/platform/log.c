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

static atomic_int current_format = LOG_FORMAT_TEXT;
static _Atomic int64_t default_rank = -1;

void log_set_rank(int64_t rank) { atomic_store(&default_rank, rank < 0 ? -1 : rank); }

void log_set_format(log_format_t format) {
  if (format == LOG_FORMAT_TEXT || format == LOG_FORMAT_JSON) atomic_store(&current_format, (int)format);
}

log_format_t log_get_format(void) { return (log_format_t)atomic_load(&current_format); }

bool log_parse_format(const char *text, log_format_t *out) {
  log_format_t f;
  if (text && !strcasecmp(text, "text")) f = LOG_FORMAT_TEXT;
  else if (text && !strcasecmp(text, "json")) f = LOG_FORMAT_JSON;
  else return false;
  if (out) *out = f;
  return true;
}

/* Length of the valid UTF-8 sequence at s (n bytes left), 0 if invalid
 * (overlong forms, surrogates and code points past U+10FFFF are invalid). */
static size_t utf8_len(const unsigned char *s, size_t n) {
  unsigned char c = s[0];
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF; /* the second byte's range */
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else return 0;
  if (n < len || s[1] < lo || s[1] > hi) return 0;
  for (size_t i = 2; i < len; i++)
    if ((s[i] & 0xC0) != 0x80) return 0;
  return len;
}

/* Escapes in[0, len) as the inside of a JSON string into out (at most cap
 * bytes, no NUL), never splitting an escape or a character. Returns the bytes
 * written; *cut says whether some input did not fit. */
static size_t json_escape(char *out, size_t cap, const char *in, size_t len, bool *cut) {
  const unsigned char *p = (const unsigned char *)in;
  size_t o = 0, i = 0;
  *cut = false;
  while (i < len) {
    char esc[8];
    const char *piece = esc;
    size_t plen, step = 1;
    unsigned char c = p[i];
    if (c == '"' || c == '\\') {
      esc[0] = '\\';
      esc[1] = (char)c;
      plen = 2;
    } else if (c < 0x20 || c == 0x7F) {
      const char *short_form = c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t"
                               : c == '\b' ? "\\b" : c == '\f' ? "\\f" : NULL;
      if (short_form) {
        piece = short_form;
        plen = 2;
      } else {
        snprintf(esc, sizeof esc, "\\u%04x", c);
        plen = 6;
      }
    } else if (c < 0x80) {
      piece = in + i;
      plen = 1;
    } else if ((step = utf8_len(p + i, len - i)) > 0) {
      piece = in + i;
      plen = step;
    } else {
      piece = "\\ufffd";
      plen = 6;
      step = 1;
    }
    if (o + plen > cap) {
      *cut = true;
      break;
    }
    memcpy(out + o, piece, plen);
    o += plen;
    i += step;
  }
  return o;
}

static const char *const json_levels[] = {"debug", "info", "warn", "error"};

/* Appends to buf (cap bytes, len used), never past cap - 1; returns the new length. */
__attribute__((format(printf, 4, 5))) static size_t append(char *buf, size_t cap, size_t len,
                                                          const char *fmt, ...) {
  if (len + 1 >= cap) return len;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf + len, cap - len, fmt, ap);
  va_end(ap);
  if (n < 0) return len;
  return len + (size_t)n >= cap ? cap - 1 : len + (size_t)n;
}

/* The JSON line for an event whose message is msg[0, msg_len); msg_cut: the
 * message was cut already. Returns its length, newline included. */
static size_t json_line(char *buf, const struct timespec *now, log_level_t level,
                        const char *component, const log_fields_t *fields, const char *file,
                        int line, bool debug, const char *msg, size_t msg_len, bool msg_cut) {
  struct tm tm;
  gmtime_r(&now->tv_sec, &tm);
  char when[32];
  strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
  bool cut;
  char comp[COMPONENT_MAX * 6];
  const char *c = component ? component : "meshd";
  size_t clen = json_escape(comp, sizeof comp, c, strnlen(c, COMPONENT_MAX), &cut);
  size_t len = (size_t)snprintf(buf, LINE_MAX_BYTES, "{\"time\":\"%s.%03dZ\",\"level\":\"%s\","
                                "\"component\":\"%.*s\",\"msg\":\"", when,
                                (int)(now->tv_nsec / 1000000), json_levels[level], (int)clen, comp);
  /* What follows the message, kept whole even when the message is cut (under
   * 700 bytes: at most 64 bytes of the session, escaped; 184 of the source). */
  char tail[1024];
  size_t tlen = 0;
  tlen = append(tail, sizeof tail, tlen, "\"");
  if (fields && fields->session) {
    char sess[64 * 6];
    size_t n = json_escape(sess, sizeof sess, fields->session, strnlen(fields->session, 64), &cut);
    tlen = append(tail, sizeof tail, tlen, ",\"session\":\"%.*s\"", (int)n, sess);
  }
  int64_t rank = fields && fields->has_rank ? (int64_t)fields->rank : atomic_load(&default_rank);
  if (rank >= 0) tlen = append(tail, sizeof tail, tlen, ",\"rank\":%lld", (long long)rank);
  if (fields && fields->seq)
    tlen = append(tail, sizeof tail, tlen, ",\"seq\":%llu", (unsigned long long)fields->seq);
  if (debug && file) {
    char src[184];
    const char *b = base_name(file);
    size_t n = json_escape(src, sizeof src, b, strlen(b), &cut);
    tlen = append(tail, sizeof tail, tlen, ",\"source\":\"%.*s:%d\"", (int)n, src, line);
  }
  tlen = append(tail, sizeof tail, tlen, "}\n");
  size_t room = LINE_MAX_BYTES - len - tlen - 3; /* 3: "..." */
  len += json_escape(buf + len, room, msg, msg_len, &cut);
  if (cut || msg_cut) {
    memcpy(buf + len, "...", 3);
    len += 3;
  }
  memcpy(buf + len, tail, tlen);
  return len + tlen;
}

static void vwrite(log_level_t level, const char *component, const log_fields_t *fields,
                   const char *file, int line, const char *fmt, va_list ap) {
  if (level < LOG_LEVEL_DEBUG || level > LOG_LEVEL_ERROR)
    level = LOG_LEVEL_ERROR;
  log_level_t threshold = effective_level();
  if (level < threshold)
    return;
  int saved_errno = errno;

  char buf[LINE_MAX_BYTES + 1]; /* + 1: vsnprintf's NUL */
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);

  if (log_get_format() == LOG_FORMAT_JSON) {
    char msg[LINE_MAX_BYTES + 1];
    int want = vsnprintf(msg, sizeof msg, fmt, ap);
    size_t msg_len = want < 0 ? 0 : (size_t)want;
    bool cut = msg_len > LINE_MAX_BYTES;
    if (cut) msg_len = LINE_MAX_BYTES;
    size_t len = json_line(buf, &now, level, component, fields, file, line,
                           threshold == LOG_LEVEL_DEBUG, msg, msg_len, cut);
    write_all(buf, len);
    errno = saved_errno;
    return;
  }

  struct tm tm;
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
  int want = vsnprintf(buf + len, room + 1, fmt, ap);
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

void log_write(log_level_t level, const char *component, const char *file, int line,
               const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vwrite(level, component, NULL, file, line, fmt, ap);
  va_end(ap);
}

void log_write_fields(log_level_t level, const char *component, const char *file, int line,
                      const log_fields_t *fields, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vwrite(level, component, fields, file, line, fmt, ap);
  va_end(ap);
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
