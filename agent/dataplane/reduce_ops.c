/* Typed element-wise reductions for the data plane (reduce_ops.h). */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "reduce_ops.h"
#include "half.h"

int dp_reduce_check(reduction_t op, dtype_t dtype, meshd_error_t *err) {
  if (op != RED_INVALID && !reduction_combines(op))
    return error_set(err, ERR_BAD_ARGUMENT,
                     "reduction '%s' gathers rather than combines; it has no element-wise form",
                     reduction_name(op));
  return reduction_check_dtype(op, dtype, err);
}

/* ------------------------------------------------------------------- kernels */

static inline double fmin_nan(double a, double b) { return isnan(a) ? a : isnan(b) ? b : a < b ? a : b; }
static inline double fmax_nan(double a, double b) { return isnan(a) ? a : isnan(b) ? b : a > b ? a : b; }

#define FLOAT_KERNEL(NAME, T)                                                             \
  static void NAME(reduction_t op, T *d, const T *s, size_t n) {                          \
    switch (op) {                                                                         \
    case RED_SUM:                                                                         \
    case RED_AVG:                                                                         \
      for (size_t i = 0; i < n; i++) d[i] = d[i] + s[i];                                  \
      break;                                                                              \
    case RED_PRODUCT:                                                                     \
      for (size_t i = 0; i < n; i++) d[i] = d[i] * s[i];                                  \
      break;                                                                              \
    case RED_MIN:                                                                         \
      for (size_t i = 0; i < n; i++) d[i] = (T)fmin_nan(d[i], s[i]);                      \
      break;                                                                              \
    case RED_MAX:                                                                         \
      for (size_t i = 0; i < n; i++) d[i] = (T)fmax_nan(d[i], s[i]);                      \
      break;                                                                              \
    default:                                                                              \
      break;                                                                              \
    }                                                                                     \
  }

FLOAT_KERNEL(reduce_f32, float)
FLOAT_KERNEL(reduce_f64, double)

/* 16-bit floats: widen a block to float32, reduce, round back. */
static void reduce_half(reduction_t op, bool bf16, uint16_t *d, const uint16_t *s, size_t n) {
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
  static void NAME(reduction_t op, T *d, const T *s, size_t n) {                           \
    switch (op) {                                                                          \
    case RED_SUM:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = (T)(U)((U)d[i] + (U)s[i]);                     \
      break;                                                                               \
    case RED_PRODUCT:                                                                      \
      for (size_t i = 0; i < n; i++) d[i] = (T)(U)((uint64_t)(U)d[i] * (uint64_t)(U)s[i]); \
      break;                                                                               \
    case RED_MIN:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = s[i] < d[i] ? s[i] : d[i];                     \
      break;                                                                               \
    case RED_MAX:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = s[i] > d[i] ? s[i] : d[i];                     \
      break;                                                                               \
    case RED_BAND:                                                                         \
      for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] & s[i]);                              \
      break;                                                                               \
    case RED_BOR:                                                                          \
      for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] | s[i]);                              \
      break;                                                                               \
    case RED_BXOR:                                                                         \
      for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] ^ s[i]);                              \
      break;                                                                               \
    default: /* avg and stack are not element-wise on integers (dp_reduce_check) */        \
      break;                                                                               \
    }                                                                                      \
  }

INT_KERNEL(reduce_i8, int8_t, uint8_t)
INT_KERNEL(reduce_u8, uint8_t, uint8_t)
INT_KERNEL(reduce_i16, int16_t, uint16_t)
INT_KERNEL(reduce_i32, int32_t, uint32_t)
INT_KERNEL(reduce_i64, int64_t, uint64_t)

/* bool as torch sees it: sum/max/bor = or, product/min/band = and, bxor = xor. */
static void reduce_bool(reduction_t op, uint8_t *d, const uint8_t *s, size_t n) {
  for (size_t i = 0; i < n; i++) {
    bool a = d[i] != 0, b = s[i] != 0;
    switch (op) {
    case RED_SUM: case RED_MAX: case RED_BOR: d[i] = a || b; break;
    case RED_PRODUCT: case RED_MIN: case RED_BAND: d[i] = a && b; break;
    case RED_BXOR: d[i] = a != b; break;
    default: break; /* avg and stack are not defined on bool */
    }
  }
}

void dp_reduce_apply(reduction_t op, dtype_t dtype, void *dst, const void *src, size_t count) {
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

void dp_reduce_finish(reduction_t op, dtype_t dtype, void *buf, size_t count, size_t members) {
  if (op != RED_AVG || members <= 1) return;
  switch (dtype) { /* avg is defined on floating dtypes only (reduction.h) */
  case DTYPE_FLOAT32: {
    float *p = buf, m = (float)members;
    for (size_t i = 0; i < count; i++) p[i] = p[i] / m;
    break;
  }
  case DTYPE_FLOAT64: {
    double *p = buf, m = (double)members;
    for (size_t i = 0; i < count; i++) p[i] = p[i] / m;
    break;
  }
  case DTYPE_FLOAT16:
  case DTYPE_BFLOAT16: {
    uint16_t *p = buf;
    bool bf16 = dtype == DTYPE_BFLOAT16;
    for (size_t i = 0; i < count; i++) {
      float v = (bf16 ? bf16_to_float(p[i]) : half_to_float(p[i])) / (float)members;
      p[i] = bf16 ? float_to_bf16(v) : float_to_half(v);
    }
    break;
  }
  default:
    break;
  }
}
