/* One line per event: "2026-11-30T13:20:58.123Z INFO  server: message".
 * Thread-safe; each line is written with a single write(2) to stderr, at most
 * 4096 bytes (PIPE_BUF) with the newline: longer messages end in "...", and
 * newlines inside a message become spaces. errno is preserved.
 * The level is info unless log_set_level is called or, before that, the first
 * log call finds MESHD_LOG_LEVEL set to a level name. */
#ifndef MESHD_LOG_H
#define MESHD_LOG_H

#include <stdbool.h>

typedef enum { LOG_LEVEL_DEBUG, LOG_LEVEL_INFO, LOG_LEVEL_WARN, LOG_LEVEL_ERROR } log_level_t;

void log_set_level(log_level_t level);
log_level_t log_get_level(void);
/* "debug", "info", "warn", "error" (case-insensitive). false if unknown. */
bool log_parse_level(const char *text, log_level_t *out);
/* `component` names the part that speaks ("server", "agent", "rpc", "supervisor").
 * When the level is debug every line ends in " (basename.c:line)". */
void log_write(log_level_t level, const char *component, const char *file, int line,
               const char *fmt, ...) __attribute__((format(printf, 5, 6)));

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

#endif
