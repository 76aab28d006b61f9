/* Reading a fuzz input as a stream of choices, for the fuzz targets.
 *
 *   fz_t in = fz_open(data, size);
 *   int ndim = (int)fz_range(&in, 0, 8);
 *   int64_t size = fz_i64(&in);    // small values mostly, edge values often
 *
 * Past the end every read returns 0 (fz_done says so), so a target never reads
 * out of bounds and a short input still makes a complete, if plain, case.
 * FZ_CHECK aborts with a message when an invariant fails: libFuzzer reports
 * the abort as a crash and saves the input. Header-only (static inline). */
#ifndef MESHD_FUZZ_INPUT_H
#define MESHD_FUZZ_INPUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fz {
  const uint8_t *p;
  size_t n, at;
} fz_t;

static inline fz_t fz_open(const uint8_t *data, size_t size) { return (fz_t){data, size, 0}; }
static inline bool fz_done(const fz_t *in) { return in->at >= in->n; }
static inline size_t fz_left(const fz_t *in) { return in->at < in->n ? in->n - in->at : 0; }

static inline uint8_t fz_u8(fz_t *in) { return in->at < in->n ? in->p[in->at++] : 0; }

static inline uint64_t fz_u64_raw(fz_t *in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; i++) v |= (uint64_t)fz_u8(in) << (8 * i);
  return v;
}

static inline bool fz_bool(fz_t *in) { return fz_u8(in) & 1; }

/* lo..hi inclusive (hi - lo < 2^32). */
static inline int64_t fz_range(fz_t *in, int64_t lo, int64_t hi) {
  uint64_t span = (uint64_t)(hi - lo) + 1;
  uint64_t v = span <= 256 ? fz_u8(in) : fz_u64_raw(in, 4);
  return lo + (int64_t)(v % span);
}

/* A signed value: small ones mostly, the edges of every width often. */
static inline int64_t fz_i64(fz_t *in) {
  static const int64_t edges[] = {
      0, 1, -1, 2, 3, 4, 7, 8, 16, 63, 64, 255, 256, 65535, 65536,
      INT32_MAX, (int64_t)INT32_MAX + 1, INT32_MIN, UINT32_MAX, (int64_t)UINT32_MAX + 1,
      (int64_t)1 << 31, (int64_t)1 << 40, (int64_t)1 << 61, (int64_t)1 << 62,
      ((int64_t)1 << 62) + 1, INT64_MAX, INT64_MAX - 1, INT64_MIN, INT64_MIN + 1, -2, -8, -64};
  uint8_t sel = fz_u8(in);
  switch (sel >> 6) {
  case 0: return (int64_t)(sel & 0x3f) - 8; /* -8..55 */
  case 1: return edges[(sel & 0x3f) % (sizeof edges / sizeof edges[0])];
  case 2: return (int64_t)(int16_t)fz_u64_raw(in, 2);
  default: return (int64_t)fz_u64_raw(in, 8);
  }
}

static inline uint64_t fz_u64(fz_t *in) { return (uint64_t)fz_i64(in); }

/* A size for a dim: 0..8 mostly, any value sometimes. */
static inline int64_t fz_size(fz_t *in) {
  uint8_t sel = fz_u8(in);
  if (sel < 200) return sel % 9;
  if (sel < 240) return sel % 64;
  return fz_i64(in);
}

/* A NUL-terminated string of up to max-1 bytes into buf (max >= 1): bytes of
 * the input, cut at the first NUL. */
static inline char *fz_str(fz_t *in, char *buf, size_t max) {
  size_t len = (size_t)fz_u8(in) % max;
  size_t k = 0;
  for (size_t i = 0; i < len && !fz_done(in); i++) {
    char c = (char)fz_u8(in);
    if (!c) break;
    buf[k++] = c;
  }
  buf[k] = '\0';
  return buf;
}

/* One of n strings, or (1 time in 8) a string from the input into buf. */
static inline const char *fz_pick_str(fz_t *in, const char *const *names, size_t n, char *buf,
                                      size_t max) {
  uint8_t sel = fz_u8(in);
  if (n == 0 || sel % 8 == 7) return fz_str(in, buf, max);
  return names[(sel >> 3) % n];
}

#define FZ_CHECK(cond, ...)                                                      \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: invariant failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                              \
      fputc('\n', stderr);                                                       \
      abort();                                                                   \
    }                                                                            \
  } while (0)

#endif
