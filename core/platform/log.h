/* One line per event, in one of two formats (log_set_format):
 *   text (default): "2026-11-30T13:20:58.123Z INFO  server: message"
 *   json: {"time":"2026-11-30T13:20:58.123Z","level":"info","component":"server",
 *          "msg":"message","session":"…","rank":0,"seq":12}
 * JSON lines carry session, rank and seq only when the call site knows them
 * (log_event), and at debug "source":"file.c:line". Strings are escaped so
 * that every line is valid JSON whatever the bytes: quotes, backslashes and
 * control characters escaped, invalid UTF-8 replaced by U+FFFD.
 * Thread-safe; each line is written with a single write(2) to stderr, at most
 * 4096 bytes (PIPE_BUF) with the newline: longer messages end in "...", and
 * newlines inside a message become spaces (text) or \n (json). errno is
 * preserved. The level is info unless log_set_level is called or, before
 * that, the first log call finds MESHD_LOG_LEVEL set to a level name. */
#ifndef MESHD_LOG_H
#define MESHD_LOG_H

#include <stdbool.h>
#include <stdint.h>

typedef enum { LOG_LEVEL_DEBUG, LOG_LEVEL_INFO, LOG_LEVEL_WARN, LOG_LEVEL_ERROR } log_level_t;

void log_set_level(log_level_t level);
log_level_t log_get_level(void);
/* "debug", "info", "warn", "error" (case-insensitive). false if unknown. */
bool log_parse_level(const char *text, log_level_t *out);
typedef enum { LOG_FORMAT_TEXT, LOG_FORMAT_JSON } log_format_t;
void log_set_format(log_format_t format);
log_format_t log_get_format(void);
/* "text", "json" (case-insensitive). false if unknown. */
bool log_parse_format(const char *text, log_format_t *out);

/* What an event is about, when the call site knows it: JSON lines carry the
 * fields set; text lines ignore them (their messages say it in words). */
typedef struct log_fields {
  const char *session; /* a session id; NULL: none */
  uint64_t seq;        /* a command or instruction seq; 0: none */
  uint32_t rank;
  bool has_rank;       /* rank is set (rank 0 is a rank) */
} log_fields_t;
#define LOG_RANK(r) .rank = (uint32_t)(r), .has_rank = true
/* The rank JSON lines carry when their fields set none (an agent's own rank,
 * once known); negative: none (the default). */
void log_set_rank(int64_t rank);

/* `component` names the part that speaks ("server", "agent", "rpc", "supervisor").
 * When the level is debug every line ends in " (basename.c:line)". */
void log_write(log_level_t level, const char *component, const char *file, int line,
               const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* log_write with fields (NULL: none). */
void log_write_fields(log_level_t level, const char *component, const char *file, int line,
                      const log_fields_t *fields, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* A rate limit for lines an outsider can cause (refused calls): at most `burst`
 * lines per `window_ms`. Zero-initialize one per kind of line (static storage).
 * log_allow returns true if this line may be written; then *suppressed (may be
 * NULL) is how many were held back since the last line allowed, for the line to
 * say ("... (12 more refused meanwhile)"). Thread-safe. */
typedef struct log_limit {
  _Atomic long long window_start_ms;
  _Atomic int written, suppressed;
} log_limit_t;
bool log_allow(log_limit_t *l, int burst, int window_ms, int *suppressed);

#define log_debug(comp, ...) log_write(LOG_LEVEL_DEBUG, comp, __FILE__, __LINE__, __VA_ARGS__)
#define log_info(comp, ...) log_write(LOG_LEVEL_INFO, comp, __FILE__, __LINE__, __VA_ARGS__)
#define log_warn(comp, ...) log_write(LOG_LEVEL_WARN, comp, __FILE__, __LINE__, __VA_ARGS__)
#define log_error(comp, ...) log_write(LOG_LEVEL_ERROR, comp, __FILE__, __LINE__, __VA_ARGS__)
/* With fields: log_event(LOG_LEVEL_WARN, "command",
 *   &(log_fields_t){.session = s->id, LOG_RANK(r)}, "rank %u lost", r); */
#define log_event(level, comp, ...) log_write_fields(level, comp, __FILE__, __LINE__, __VA_ARGS__)

#endif
