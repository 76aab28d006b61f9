/* Small helpers shared by meshd's benchmarks: a monotonic clock, latency
 * samples with percentiles, and the one-line JSON every benchmark prints.
 * Header-only; everything is static inline. */
#ifndef MESHD_BENCH_UTIL_H
#define MESHD_BENCH_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline int64_t bench_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Latency samples in microseconds; grows as needed. Owned by one thread. */
typedef struct {
  uint32_t *v;
  size_t n, cap;
} bench_samples_t;

static inline bool bench_samples_add(bench_samples_t *s, int64_t ns) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 4096;
    uint32_t *grown = realloc(s->v, cap * sizeof *grown);
    if (!grown) return false;
    s->v = grown;
    s->cap = cap;
  }
  int64_t us = (ns + 500) / 1000;
  s->v[s->n++] = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
  return true;
}

/* Appends src to dst (for merging per-thread samples). */
static inline bool bench_samples_merge(bench_samples_t *dst, const bench_samples_t *src) {
  if (dst->n + src->n > dst->cap) {
    size_t cap = dst->n + src->n;
    uint32_t *grown = realloc(dst->v, cap * sizeof *grown);
    if (!grown) return false;
    dst->v = grown;
    dst->cap = cap;
  }
  if (src->n) memcpy(dst->v + dst->n, src->v, src->n * sizeof *src->v);
  dst->n += src->n;
  return true;
}

static inline void bench_samples_free(bench_samples_t *s) {
  free(s->v);
  memset(s, 0, sizeof *s);
}

static inline int bench_cmp_u32(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x > y) - (x < y);
}

/* Nearest-rank percentile (p in 0..100) of the samples; sorts them in place.
 * NAN when there are none. */
static inline double bench_percentile(bench_samples_t *s, double p) {
  if (s->n == 0) return NAN;
  qsort(s->v, s->n, sizeof *s->v, bench_cmp_u32);
  size_t rank = (size_t)ceil(p / 100.0 * (double)s->n);
  if (rank < 1) rank = 1;
  if (rank > s->n) rank = s->n;
  return s->v[rank - 1];
}

/* One JSON object on one line: {"bench":"rpc","key":number,...}. */
typedef struct {
  char buf[4096];
  size_t len;
} bench_json_t;

static inline void bench_json_begin(bench_json_t *j, const char *bench) {
  j->len = (size_t)snprintf(j->buf, sizeof j->buf, "{\"bench\":\"%s\"", bench);
}

/* Non-finite values (a case that did not run) are written as null. */
static inline void bench_json_num(bench_json_t *j, const char *key, double value) {
  if (j->len >= sizeof j->buf) return;
  size_t room = sizeof j->buf - j->len;
  int n = isfinite(value) ? snprintf(j->buf + j->len, room, ",\"%s\":%.1f", key, value)
                          : snprintf(j->buf + j->len, room, ",\"%s\":null", key);
  j->len += n > 0 ? (size_t)n : 0;
}

static inline void bench_json_str(bench_json_t *j, const char *key, const char *value) {
  if (j->len >= sizeof j->buf) return;
  size_t room = sizeof j->buf - j->len;
  int n = snprintf(j->buf + j->len, room, ",\"%s\":\"%s\"", key, value);
  j->len += n > 0 ? (size_t)n : 0;
}

static inline void bench_json_end(bench_json_t *j, FILE *out) {
  if (j->len >= sizeof j->buf) j->len = sizeof j->buf - 1;
  fprintf(out, "%.*s}\n", (int)j->len, j->buf);
  fflush(out);
}

/* "--name value" or "--name=value" at argv[*i]; advances *i past a separate value. */
static inline const char *bench_arg(int argc, char **argv, int *i, const char *name) {
  size_t n = strlen(name);
  if (strncmp(argv[*i], name, n) != 0) return NULL;
  if (argv[*i][n] == '=') return argv[*i] + n + 1;
  if (argv[*i][n] == '\0' && *i + 1 < argc) return argv[++*i];
  return NULL;
}

#endif
