/* Typed element-wise reductions for the cpu data plane. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "dataplane_internal.h"
#include "half.h"

int dp_reduce_parse(const char *name) {
  static const char *const names[] = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor"};
  if (!name) return -1;
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcmp(name, names[i]) == 0) return (int)i;
  return -1;
}

static const char *op_name(dp_reduce_t op) {
  static const char *const names[] = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor"};
  return (unsigned)op < sizeof names / sizeof names[0] ? names[op] : "unknown";
}

int dp_reduce_check(dp_reduce_t op, dtype_t dtype, meshd_error_t *err) {
  if (!dtype_valid(dtype))
    return error_set(err, ERR_BAD_ARGUMENT, "dtype %d is not a known dtype", (int)dtype);
  if ((unsigned)op > DP_BXOR)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "reduction %d is unknown (expected one of sum avg product min max "
                     "band bor bxor)",
                     (int)op);
  bool bitwise = op == DP_BAND || op == DP_BOR || op == DP_BXOR;
  if (bitwise && dtype_is_floating(dtype))
    return error_set(err, ERR_BAD_ARGUMENT,
                     "reduction '%s' is bitwise and is defined only on integer and bool "
                     "dtypes, not %s",
                     op_name(op), dtype_name(dtype));
  if (op == DP_AVG && dtype == DTYPE_BOOL)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "reduction 'avg' is not defined on bool; cast to a floating dtype");
  return 0;
}

/* ------------------------------------------------------------ 16-bit floats */

/* ------------------------------------------------------------------- kernels */

static inline double fmin_nan(double a, double b) { return isnan(a) ? a : isnan(b) ? b : a < b ? a : b; }
static inline double fmax_nan(double a, double b) { return isnan(a) ? a : isnan(b) ? b : a > b ? a : b; }

#define FLOAT_KERNEL(NAME, T)                                                             \
  static void NAME(dp_reduce_t op, T *d, const T *s, size_t n) {                          \
    switch (op) {                                                                         \
    case DP_SUM:                                                                          \
    case DP_AVG:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = d[i] + s[i];                                  \
      break;                                                                              \
    case DP_PRODUCT:                                                                      \
      for (size_t i = 0; i < n; i++) d[i] = d[i] * s[i];                                  \
      break;                                                                              \
    case DP_MIN:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = (T)fmin_nan(d[i], s[i]);                      \
      break;                                                                              \
    case DP_MAX:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = (T)fmax_nan(d[i], s[i]);                      \
      break;                                                                              \
    default:                                                                              \
      break;                                                                              \
    }                                                                                     \
  }

FLOAT_KERNEL(reduce_f32, float)
FLOAT_KERNEL(reduce_f64, double)

/* 16-bit floats: widen a block to float32, reduce, round back. */
static void reduce_half(dp_reduce_t op, bool bf16, uint16_t *d, const uint16_t *s, size_t n) {
  float a[256], b[256];
  for (size_t at = 0; at < n; at += 256) {
    size_t k = n - at < 256 ? n - at : 256;
    for (size_t i = 0; i < k; i++) {
      a[i] = bf16 ? bf16_to_float(d[at + i]) : half_to_float(d[at + i]);
      b[i] = bf16 ? bf16_to_float(s[at + i]) : half_to_float(s[at + i]);
    }
    reduce_f32(op, a, b, k);
    for (size_t i = 0; i < k; i++) d[at + i] = bf16 ? float_to_bf16(a[i]) : float_to_half(a[i]);
  }
}

/* Integers: sums and products in the unsigned type of the same width (wrapping,
 * never undefined); products widened to 64 bits first so that uint16 * uint16
 * does not overflow int. */
#define INT_KERNEL(NAME, T, U)                                                             \
  static void NAME(dp_reduce_t op, T *d, const T *s, size_t n) {                           \
    switch (op) {                                                                          \
    case DP_SUM:                                                                           \
    case DP_AVG:                                                                           \
      for (size_t i = 0; i < n; i++) d[i] = (T)(U)((U)d[i] + (U)s[i]);                     \
      break;                                                                               \
    case DP_PRODUCT:                                                                       \
      for (size_t i = 0; i < n; i++) d[i] = (T)(U)((uint64_t)(U)d[i] * (uint64_t)(U)s[i]); \
      break;                                                                               \
    case DP_MIN:                                                                           \
      for (size_t i = 0; i < n; i++) d[i] = s[i] < d[i] ? s[i] : d[i];                     \
      break;                                                                               \
    case DP_MAX:                                                                           \
      for (size_t i = 0; i < n; i++) d[i] = s[i] > d[i] ? s[i] : d[i];                     \
      break;                                                                               \
    case DP_BAND:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] & s[i]);                              \
      break;                                                                               \
    case DP_BOR:                                                                           \
      for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] | s[i]);                              \
      break;                                                                               \
    case DP_BXOR:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] ^ s[i]);                              \
      break;                                                                               \
    }                                                                                      \
  }

INT_KERNEL(reduce_i8, int8_t, uint8_t)
INT_KERNEL(reduce_u8, uint8_t, uint8_t)
INT_KERNEL(reduce_i16, int16_t, uint16_t)
INT_KERNEL(reduce_i32, int32_t, uint32_t)
INT_KERNEL(reduce_i64, int64_t, uint64_t)

/* bool as torch sees it: sum/max/bor = or, product/min/band = and, bxor = xor. */
static void reduce_bool(dp_reduce_t op, uint8_t *d, const uint8_t *s, size_t n) {
  for (size_t i = 0; i < n; i++) {
    bool a = d[i] != 0, b = s[i] != 0;
    switch (op) {
    case DP_SUM: case DP_AVG: case DP_MAX: case DP_BOR: d[i] = a || b; break;
    case DP_PRODUCT: case DP_MIN: case DP_BAND: d[i] = a && b; break;
    case DP_BXOR: d[i] = a != b; break;
    }
  }
}

void dp_reduce_apply(dp_reduce_t op, dtype_t dtype, void *dst, const void *src, size_t count) {
  switch (dtype) {
  case DTYPE_FLOAT32: reduce_f32(op, dst, src, count); break;
  case DTYPE_FLOAT64: reduce_f64(op, dst, src, count); break;
  case DTYPE_FLOAT16: reduce_half(op, false, dst, src, count); break;
  case DTYPE_BFLOAT16: reduce_half(op, true, dst, src, count); break;
  case DTYPE_INT8: reduce_i8(op, dst, src, count); break;
  case DTYPE_UINT8: reduce_u8(op, dst, src, count); break;
  case DTYPE_INT16: reduce_i16(op, dst, src, count); break;
  case DTYPE_INT32: reduce_i32(op, dst, src, count); break;
  case DTYPE_INT64: reduce_i64(op, dst, src, count); break;
  case DTYPE_BOOL: reduce_bool(op, dst, src, count); break;
  case DTYPE_INVALID: break;
  }
}

#define DIV_LOOP(T, CAST)                                         \
  do {                                                            \
    T *p = buf;                                                   \
    for (size_t i = 0; i < count; i++) p[i] = (T)((CAST)p[i] / m); \
  } while (0)

void dp_reduce_finish(dp_reduce_t op, dtype_t dtype, void *buf, size_t count, size_t members) {
  if (op != DP_AVG || members <= 1) return;
  if (dtype == DTYPE_FLOAT16 || dtype == DTYPE_BFLOAT16) {
    uint16_t *p = buf;
    bool bf16 = dtype == DTYPE_BFLOAT16;
    for (size_t i = 0; i < count; i++) {
      float v = (bf16 ? bf16_to_float(p[i]) : half_to_float(p[i])) / (float)members;
      p[i] = bf16 ? float_to_bf16(v) : float_to_half(v);
    }
    return;
  }
  if (dtype == DTYPE_FLOAT32) {
    float m = (float)members;
    DIV_LOOP(float, float);
  } else if (dtype == DTYPE_FLOAT64) {
    double m = (double)members;
    DIV_LOOP(double, double);
  } else {
    /* Widened so that a member count beyond the type's range divides correctly. */
    int64_t m = (int64_t)members;
    switch (dtype) {
    case DTYPE_INT8: DIV_LOOP(int8_t, int64_t); break;
    case DTYPE_UINT8: DIV_LOOP(uint8_t, int64_t); break;
    case DTYPE_INT16: DIV_LOOP(int16_t, int64_t); break;
    case DTYPE_INT32: DIV_LOOP(int32_t, int64_t); break;
    case DTYPE_INT64: DIV_LOOP(int64_t, int64_t); break;
    default: break;
    }
  }
}
