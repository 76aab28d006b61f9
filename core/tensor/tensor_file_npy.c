/* The .npy format (numpy.lib.format): "\x93NUMPY", major and minor version,
 * the header's length (2 bytes little-endian in 1.0, 4 in 2.0 and 3.0), then
 * the header, a Python dict literal such as
 *   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
 * padded with spaces and a '\n'; the data follows at once. The dict is read
 * by a parser for exactly what numpy writes and ast.literal_eval accepts of
 * it, not by a Python evaluator: strings without escapes, True/False, tuples
 * of ints (with Python 2's 'L' suffix, which old numpy wrote). */
#include <ctype.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_file_internal.h"

#define CTX "npy header"

typedef struct {
  const char *p, *end, *start;
  meshd_error_t *e;
} cursor_t;

static int fail_at(cursor_t *c, const char *what) {
  if (c->p >= c->end)
    return error_set(c->e, ERR_BAD_ARGUMENT, CTX ": the dict ends early: expected %s", what);
  unsigned char ch = (unsigned char)*c->p;
  if (isprint(ch))
    return error_set(c->e, ERR_BAD_ARGUMENT, CTX ": at byte %td: expected %s, found '%c'",
                     c->p - c->start, what, ch);
  return error_set(c->e, ERR_BAD_ARGUMENT, CTX ": at byte %td: expected %s, found byte 0x%02x",
                   c->p - c->start, what, ch);
}

/* Python's whitespace between tokens (numpy writes spaces and a final '\n'). */
static void skip_ws(cursor_t *c) {
  while (c->p < c->end && *c->p && strchr(" \t\n\r\f", *c->p)) c->p++;
}

static bool eat(cursor_t *c, char ch) {
  skip_ws(c);
  if (c->p < c->end && *c->p == ch) {
    c->p++;
    return true;
  }
  return false;
}

/* A quoted string of at most cap - 1 bytes into buf. */
static int parse_string(cursor_t *c, char *buf, size_t cap, const char *what) {
  skip_ws(c);
  if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return fail_at(c, what);
  char q = *c->p++;
  size_t n = 0;
  for (; c->p < c->end && *c->p != q; c->p++) {
    if (*c->p == '\\')
      return error_set(c->e, ERR_BAD_ARGUMENT,
                       CTX ": at byte %td: escape sequences in strings are not supported",
                       c->p - c->start);
    if (*c->p == '\n' || *c->p == '\0') break;
    if (n + 1 >= cap)
      return error_set(c->e, ERR_BAD_ARGUMENT, CTX ": at byte %td: a string longer than %zu bytes",
                       c->p - c->start, cap - 1);
    buf[n++] = *c->p;
  }
  if (c->p >= c->end || *c->p != q) return fail_at(c, "the string's closing quote");
  c->p++;
  buf[n] = 0;
  return 0;
}

static int parse_bool(cursor_t *c, bool *out) {
  skip_ws(c);
  size_t left = (size_t)(c->end - c->p);
  if (left >= 4 && memcmp(c->p, "True", 4) == 0) {
    *out = true, c->p += 4;
  } else if (left >= 5 && memcmp(c->p, "False", 5) == 0) {
    *out = false, c->p += 5;
  } else {
    return fail_at(c, "True or False for 'fortran_order'");
  }
  if (c->p < c->end && (isalnum((unsigned char)*c->p) || *c->p == '_'))
    return fail_at(c, "True or False for 'fortran_order'");
  return 0;
}

/* A tuple of ints: "()", "(3,)", "(3, 4)"; "(3)" is an int in Python, not a
 * tuple, and numpy refuses it. Sizes past LAYOUT_MAX_DIMS are counted, not kept. */
static int parse_shape(cursor_t *c, tensor_file_entry_t *t) {
  if (!eat(c, '(')) {
    skip_ws(c);
    if (c->p < c->end && *c->p == '[')
      return error_set(c->e, ERR_BAD_ARGUMENT,
                       CTX ": 'shape' is a list; numpy writes (and reads) a tuple such as (3, 4)");
    return fail_at(c, "'(' to open the 'shape' tuple");
  }
  int n = 0;
  bool comma = false;
  while (!eat(c, ')')) {
    if (n && !comma) return fail_at(c, "',' or ')' in 'shape'");
    skip_ws(c);
    bool neg = c->p < c->end && *c->p == '-';
    if (neg) c->p++;
    if (c->p >= c->end || !isdigit((unsigned char)*c->p)) return fail_at(c, "a size in 'shape'");
    int64_t v = 0;
    for (; c->p < c->end && isdigit((unsigned char)*c->p); c->p++)
      if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, *c->p - '0', &v))
        return error_set(c->e, ERR_BAD_ARGUMENT,
                         CTX ": 'shape': size %d does not fit in 64 bits", n);
    if (c->p < c->end && (*c->p == 'L' || *c->p == 'l')) c->p++;
    if (n < LAYOUT_MAX_DIMS) t->shape[n] = neg ? -v : v;
    if (n < INT32_MAX) n++;
    comma = eat(c, ',');
  }
  if (n == 1 && !comma)
    return error_set(c->e, ERR_BAD_ARGUMENT,
                     CTX ": 'shape' (%" PRId64 ") is an int, not a tuple: write (%" PRId64 ",)",
                     t->shape[0], t->shape[0]);
  t->ndim = n;
  return 0;
}

/* numpy's descr ('<f4') to a dtype: little-endian ('<'; '|' and '=' are what
 * numpy writes for one-byte types and native order) and a type meshd has. */
static int map_descr(const char *d, dtype_t *out, meshd_error_t *e) {
  static const struct {
    const char *code;
    dtype_t dtype;
  } map[] = {{"f2", DTYPE_FLOAT16}, {"f4", DTYPE_FLOAT32}, {"f8", DTYPE_FLOAT64},
             {"i1", DTYPE_INT8},    {"i2", DTYPE_INT16},   {"i4", DTYPE_INT32},
             {"i8", DTYPE_INT64},   {"u1", DTYPE_UINT8},   {"b1", DTYPE_BOOL}};
  char order = d[0];
  const char *code = order && strchr("<>|=", order) ? d + 1 : d;
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
    if (strcmp(code, map[i].code) != 0) continue;
    if (order == '>' && dtype_size(map[i].dtype) > 1)
      return error_set(e, ERR_BAD_ARGUMENT,
                       CTX ": descr '%s' is big-endian; meshd reads little-endian data only: save "
                       "a.astype(a.dtype.newbyteorder('<'))",
                       d);
    *out = map[i].dtype;
    return 0;
  }
  return error_set(e, ERR_BAD_ARGUMENT,
                   CTX ": descr '%s' has no meshd dtype (meshd reads '<f2' '<f4' '<f8' '|i1' '<i2' "
                   "'<i4' '<i8' '|u1' '|b1'; bfloat16 has no .npy descr: use safetensors)",
                   d);
}

static int parse_dict(cursor_t *c, tensor_file_entry_t *t) {
  char key[32], descr[64];
  bool fortran = false, seen[3] = {false, false, false};
  static const char *const keys[3] = {"descr", "fortran_order", "shape"};
  if (!eat(c, '{')) return fail_at(c, "'{' to open the dict");
  bool comma = true;
  while (!eat(c, '}')) {
    if (!comma) return fail_at(c, "',' or '}'");
    if (parse_string(c, key, sizeof key, "a quoted key or '}'")) return -1;
    int k = 0;
    while (k < 3 && strcmp(key, keys[k]) != 0) k++;
    if (k == 3)
      return error_set(c->e, ERR_BAD_ARGUMENT,
                       CTX ": unknown key '%s'; a .npy header has 'descr', 'fortran_order' and "
                       "'shape' only",
                       key);
    if (seen[k]) return error_set(c->e, ERR_BAD_ARGUMENT, CTX ": key '%s' appears twice", key);
    seen[k] = true;
    if (!eat(c, ':')) return fail_at(c, "':' after the key");
    if (k == 0) {
      skip_ws(c);
      if (c->p < c->end && *c->p == '[')
        return error_set(c->e, ERR_BAD_ARGUMENT,
                         CTX ": 'descr' is a list: structured dtypes are not supported");
      if (parse_string(c, descr, sizeof descr, "a quoted 'descr' such as '<f4'") ||
          map_descr(descr, &t->dtype, c->e))
        return -1;
    } else if (k == 1) {
      if (parse_bool(c, &fortran)) return -1;
    } else if (parse_shape(c, t)) {
      return -1;
    }
    comma = eat(c, ',');
  }
  skip_ws(c);
  if (c->p != c->end) return fail_at(c, "only spaces and '\\n' after the dict");
  for (int k = 0; k < 3; k++)
    if (!seen[k])
      return error_set(c->e, ERR_BAD_ARGUMENT,
                       CTX ": key '%s' is missing (a .npy header has 'descr', 'fortran_order' and "
                       "'shape')",
                       keys[k]);
  if (fortran) {
    /* Column-major bytes are row-major ones too when at most one dim is > 1. */
    int big = 0;
    bool empty = false;
    for (int i = 0; i < t->ndim && i < LAYOUT_MAX_DIMS; i++) {
      big += t->shape[i] > 1;
      empty |= t->shape[i] == 0;
    }
    if (big > 1 && !empty)
      return error_set(c->e, ERR_BAD_ARGUMENT,
                       CTX ": fortran_order is True: column-major data is not supported; save "
                       "np.ascontiguousarray(a) instead");
  }
  return 0;
}

int npy_header_parse(const uint8_t *buf, size_t len, const tensor_file_opts_t *o,
                     tensor_file_t *out, uint64_t *need, meshd_error_t *e) {
  if (memcmp(buf, "\x93NUMPY", 6) != 0)
    return error_set(e, ERR_BAD_ARGUMENT, "npy: the file does not start with \"\\x93NUMPY\"");
  int major = buf[6], minor = buf[7];
  if (minor != 0 || major < 1 || major > 3)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "npy: format version %d.%d is not supported (1.0, 2.0 and 3.0 are)", major,
                     minor);
  uint64_t prefix = major == 1 ? 10 : 12;
  if (o->file_size && prefix > o->file_size)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "npy: the %" PRIu64 "-byte file ends inside the header's length field",
                     o->file_size);
  if (len < prefix) {
    *need = prefix;
    return TENSOR_FILE_NEED_MORE;
  }
  uint64_t hlen = major == 1 ? (uint64_t)buf[8] | (uint64_t)buf[9] << 8
                             : (uint64_t)buf[8] | (uint64_t)buf[9] << 8 |
                                   (uint64_t)buf[10] << 16 | (uint64_t)buf[11] << 24;
  uint64_t total = prefix + hlen;
  if (total > o->max_header_bytes)
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": %" PRIu64 " bytes is more than the %" PRIu64 "-byte limit", hlen,
                     o->max_header_bytes);
  if (o->file_size && total > o->file_size)
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": its length %" PRIu64 " runs past the end of the %" PRIu64
                     "-byte file",
                     hlen, o->file_size);
  if (len < total) {
    *need = total;
    return TENSOR_FILE_NEED_MORE;
  }
  tensor_file_entry_t t = {.dtype = DTYPE_INVALID};
  cursor_t c = {(const char *)buf + prefix, (const char *)buf + total, (const char *)buf + prefix, e};
  if (parse_dict(&c, &t) || tensor_file_entry_finish(&t, CTX ": 'shape'", e)) return -1;
  t.offset = total;
  if (o->file_size && t.nbytes > o->file_size - total) {
    char shape[LAYOUT_SHAPE_BUF];
    return error_set(e, ERR_BAD_ARGUMENT,
                     "npy data: %s %s needs %" PRIu64 " bytes after the %" PRIu64
                     "-byte header, but the file has %" PRIu64,
                     dtype_name(t.dtype), layout_format_shape(t.shape, t.ndim, shape, sizeof shape),
                     t.nbytes, total, o->file_size - total);
  }
  out->tensors = calloc(1, sizeof *out->tensors);
  if (!out->tensors || !(t.name = strdup(""))) {
    free(out->tensors);
    out->tensors = NULL;
    return error_set(e, ERR_QUOTA, CTX ": out of memory");
  }
  out->tensors[0] = t;
  out->count = 1;
  out->format = TENSOR_FILE_NPY;
  out->header_bytes = total;
  return TENSOR_FILE_OK;
}
