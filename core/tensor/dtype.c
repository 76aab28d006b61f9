#include "dtype.h"

#include <string.h>

bool dtype_valid(dtype_t d) {
  switch (d) {
#define XX(name, value, str, size, cat) case DTYPE_##name:
    DTYPE_MAP(XX)
#undef XX
    return true;
  case DTYPE_INVALID:
    break;
  }
  return false;
}

const char *dtype_name(dtype_t d) {
  switch (d) {
#define XX(name, value, str, size, cat) \
  case DTYPE_##name:                    \
    return str;
    DTYPE_MAP(XX)
#undef XX
  case DTYPE_INVALID:
    break;
  }
  return "invalid";
}

size_t dtype_size(dtype_t d) {
  switch (d) {
#define XX(name, value, str, size, cat) \
  case DTYPE_##name:                    \
    return size;
    DTYPE_MAP(XX)
#undef XX
  case DTYPE_INVALID:
    break;
  }
  return 0;
}

dtype_category_t dtype_category(dtype_t d) {
  switch (d) {
#define XX(name, value, str, size, cat) \
  case DTYPE_##name:                    \
    return cat;
    DTYPE_MAP(XX)
#undef XX
  case DTYPE_INVALID:
    break;
  }
  return DTYPE_CAT_BOOL;
}

dtype_t dtype_parse(const char *s) {
  static const struct {
    const char *alias;
    dtype_t d;
  } aliases[] = {
      {"float", DTYPE_FLOAT32}, {"double", DTYPE_FLOAT64}, {"half", DTYPE_FLOAT16},
      {"long", DTYPE_INT64},    {"int", DTYPE_INT32},      {"short", DTYPE_INT16},
  };
  if (!s) return DTYPE_INVALID;
  if (strncmp(s, "torch.", 6) == 0) s += 6;
#define XX(name, value, str, size, cat) \
  if (strcmp(s, str) == 0) return DTYPE_##name;
  DTYPE_MAP(XX)
#undef XX
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
    if (strcmp(s, aliases[i].alias) == 0) return aliases[i].d;
  return DTYPE_INVALID;
}

bool dtype_is_floating(dtype_t d) {
  return dtype_valid(d) && dtype_category(d) == DTYPE_CAT_FLOAT;
}

bool dtype_is_integral(dtype_t d, bool include_bool) {
  if (!dtype_valid(d)) return false;
  return dtype_category(d) == DTYPE_CAT_INT || (include_bool && d == DTYPE_BOOL);
}

/* Floating dtypes ordered so that the wider one wins; f16 and bf16 share a rank
 * (neither holds the other, so they meet at f32). */
static int float_rank(dtype_t d) {
  switch (d) {
  case DTYPE_FLOAT16:
  case DTYPE_BFLOAT16: return 1;
  case DTYPE_FLOAT32: return 2;
  default: return 3;
  }
}

dtype_t dtype_promote(dtype_t a, dtype_t b) {
  if (!dtype_valid(a) || !dtype_valid(b)) return DTYPE_INVALID;
  if (a == b) return a;
  if (a == DTYPE_BOOL) return b;
  if (b == DTYPE_BOOL) return a;
  bool fa = dtype_is_floating(a), fb = dtype_is_floating(b);
  if (fa && fb) {
    int ra = float_rank(a), rb = float_rank(b);
    if (ra == rb) return DTYPE_FLOAT32; /* f16 with bf16 */
    return ra > rb ? a : b;
  }
  if (fa) return a;
  if (fb) return b;
  /* Two different integer dtypes. uint8 meets a signed type at the smallest
   * signed type holding 0..255, i.e. at least int16. */
  if (a == DTYPE_UINT8 || b == DTYPE_UINT8) {
    dtype_t s = a == DTYPE_UINT8 ? b : a;
    return dtype_size(s) >= 2 ? s : DTYPE_INT16;
  }
  return dtype_size(a) >= dtype_size(b) ? a : b;
}

bool dtype_can_cast(dtype_t from, dtype_t to) {
  if (!dtype_valid(from) || !dtype_valid(to)) return false;
  return dtype_category(from) <= dtype_category(to);
}
