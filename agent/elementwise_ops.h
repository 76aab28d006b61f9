/* The per-element semantics of the elementwise kernels, written once for the
 * cpu backend (agent/cpu/kernels_elementwise.c) and the cuda backend
 * (agent/cuda/kernels_elementwise.cu, host and device code): the op enums and
 * their names, a Scalar argument's 8-byte buffer, and the math of every binary
 * and unary op. Integral ops compute in int64, floating ones in double; the
 * *_f32 functions are the float32 fast paths (float op float -> float, as
 * torch computes it).
 *
 * Rounding is the same bits on every side: on the device, sums and products
 * that the host rounds one by one go through the _rn intrinsics (nvcc would
 * otherwise contract a + alpha * b into an fma), and float exp/log/tanh are the
 * double functions rounded once, nearer to glibc's float versions than CUDA's.
 * Plain C11 compiled with -std=c11 does not contract, so the host side is plain
 * arithmetic. */
#ifndef MESHD_AGENT_ELEMENTWISE_OPS_H
#define MESHD_AGENT_ELEMENTWISE_OPS_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "ops.h"

#ifdef __CUDACC__
#define EW_FN static __host__ __device__ __forceinline__
#else
#define EW_FN static inline
#endif

/* ---- ops and their names ---- */

/* X(op, name, in-place name): NULL names are ops chosen by an argument
 * (div's rounding_mode). The order is the enum's; ops from B_BAND on are
 * bitwise and always integral. */
#define EW_BINARY_OPS(X)                                                                \
  X(B_ADD, "add", "add_") X(B_SUB, "sub", "sub_") X(B_MUL, "mul", "mul_")                 \
  X(B_DIV, "div", "div_") X(B_DIV_TRUNC, NULL, NULL) X(B_DIV_FLOOR, NULL, NULL)           \
  X(B_POW, "pow", NULL) X(B_MAX, "maximum", NULL) X(B_MIN, "minimum", NULL)               \
  X(B_EQ, "eq", NULL) X(B_NE, "ne", NULL) X(B_LT, "lt", NULL) X(B_LE, "le", NULL)         \
  X(B_GT, "gt", NULL) X(B_GE, "ge", NULL) X(B_LAND, "logical_and", NULL)                  \
  X(B_LOR, "logical_or", NULL) X(B_BAND, "bitwise_and", NULL)                             \
  X(B_BOR, "bitwise_or", NULL) X(B_BXOR, "bitwise_xor", NULL)

/* X(op, name): U_GELU_TANH is gelu with approximate="tanh". */
#define EW_UNARY_OPS(X)                                                                 \
  X(U_NEG, "neg") X(U_ABS, "abs") X(U_EXP, "exp") X(U_LOG, "log") X(U_SQRT, "sqrt")       \
  X(U_RSQRT, "rsqrt") X(U_SIN, "sin") X(U_COS, "cos") X(U_TANH, "tanh")                   \
  X(U_SIGMOID, "sigmoid") X(U_RECIP, "reciprocal") X(U_RELU, "relu") X(U_GELU, "gelu")    \
  X(U_GELU_TANH, NULL) X(U_SILU, "silu") X(U_SIGN, "sign") X(U_NOT, "logical_not")

#define EW_ENUM_BINARY(op, name, inplace) op,
#define EW_ENUM_UNARY(op, name) op,
enum { EW_BINARY_OPS(EW_ENUM_BINARY) };
enum { EW_UNARY_OPS(EW_ENUM_UNARY) };
#undef EW_ENUM_BINARY
#undef EW_ENUM_UNARY

/* The B_* op of an op name (in-place names too), or -1. */
static inline int ew_binary_op(const char *name) {
#define EW_NAME_BINARY(op, name, inplace) {name, inplace},
  static const struct {
    const char *name, *inplace;
  } t[] = {EW_BINARY_OPS(EW_NAME_BINARY)};
#undef EW_NAME_BINARY
  for (int k = 0; k < (int)(sizeof t / sizeof t[0]); k++)
    if ((t[k].name && strcmp(t[k].name, name) == 0) ||
        (t[k].inplace && strcmp(t[k].inplace, name) == 0))
      return k;
  return -1;
}

/* The U_* op of an op name, or -1. */
static inline int ew_unary_op(const char *name) {
#define EW_NAME_UNARY(op, name) name,
  static const char *const t[] = {EW_UNARY_OPS(EW_NAME_UNARY)};
#undef EW_NAME_UNARY
  for (int k = 0; k < (int)(sizeof t / sizeof t[0]); k++)
    if (t[k] && strcmp(t[k], name) == 0) return k;
  return -1;
}

/* Whether ew_bin_f32 / ew_un_f32 compute op (else float32 goes through double). */
EW_FN bool ew_bin_has_f32(int op) {
  return op == B_ADD || op == B_SUB || op == B_MUL || op == B_DIV;
}
EW_FN bool ew_un_has_f32(int op) {
  return op == U_NEG || op == U_ABS || op == U_EXP || op == U_LOG || op == U_SQRT ||
         op == U_RELU || op == U_SIGMOID || op == U_SILU || op == U_TANH;
}

/* ---- Scalar arguments ---- */

/* A Scalar argument as an 8-byte value of its own dtype (zero-filled). */
typedef union {
  double f;
  int64_t i;
  uint8_t b;
  float f32;
} scalar_buf_t;

/* Fills *buf from v (VAL_FLOAT, VAL_BOOL or VAL_INT) and returns its dtype. */
static inline dtype_t scalar_to_buf(const op_value_t *v, scalar_buf_t *buf) {
  memset(buf, 0, sizeof *buf);
  if (v->kind == VAL_FLOAT) {
    buf->f = v->f;
    return DTYPE_FLOAT64;
  }
  if (v->kind == VAL_BOOL) {
    buf->b = v->b;
    return DTYPE_BOOL;
  }
  buf->i = v->i;
  return DTYPE_INT64;
}

/* ---- arithmetic rounded as the host rounds it ---- */

#ifdef __CUDA_ARCH__
#define EW_RN(dev, host) return dev
#else
#define EW_RN(dev, host) return host
#endif
EW_FN double ew_dmul(double a, double b) { EW_RN(__dmul_rn(a, b), a * b); }
EW_FN double ew_dadd(double a, double b) { EW_RN(__dadd_rn(a, b), a + b); }
EW_FN double ew_dsub(double a, double b) { EW_RN(__dsub_rn(a, b), a - b); }
EW_FN float ew_fmul(float a, float b) { EW_RN(__fmul_rn(a, b), a * b); }
EW_FN float ew_fadd(float a, float b) { EW_RN(__fadd_rn(a, b), a + b); }
EW_FN float ew_fsub(float a, float b) { EW_RN(__fsub_rn(a, b), a - b); }
EW_FN float ew_fexp(float a) { EW_RN((float)exp((double)a), expf(a)); }
EW_FN float ew_flog(float a) { EW_RN((float)log((double)a), logf(a)); }
EW_FN float ew_ftanh(float a) { EW_RN((float)tanh((double)a), tanhf(a)); }
#undef EW_RN

/* C's NAN as a double: the positive quiet NaN. */
EW_FN double ew_qnan(void) {
  uint64_t b = UINT64_C(0x7ff8000000000000);
  double d;
  memcpy(&d, &b, 8);
  return d;
}
EW_FN bool ew_is_nan(double v) { return v != v; }

/* v rounded to float32, float16 or bfloat16 (other dtypes: v itself): a
 * comparison's operands are cast to their common dtype first, and a sum's or
 * product's input to its dtype=, as torch and numpy do (float32 0.1 == 0.1
 * holds). */
EW_FN double ew_round_to(dtype_t dt, double v) {
  switch (dt) {
  case DTYPE_FLOAT32: return (float)v;
  case DTYPE_FLOAT16: return half_to_float(float_to_half((float)v));
  case DTYPE_BFLOAT16: return bf16_to_float(float_to_bf16((float)v));
  default: return v;
  }
}

/* An integer v cast to float32, float16 or bfloat16 (other dtypes: v as a
 * double): rounded once to float32 (through double, 2^60 + 2^36 + 1 fell on a
 * tie), and from there to float16/bfloat16, as a cast does. */
EW_FN double ew_round_i(dtype_t dt, int64_t v) {
  switch (dt) {
  case DTYPE_FLOAT32: return (float)v;
  case DTYPE_FLOAT16: return half_to_float(float_to_half((float)v));
  case DTYPE_BFLOAT16: return bf16_to_float(float_to_bf16((float)v));
  default: return (double)v;
  }
}

/* An integer v cast to a narrower integer dtype dt, wrapping (other dtypes: v). */
EW_FN int64_t ew_wrap_i(dtype_t dt, int64_t v) {
  switch (dt) {
  case DTYPE_UINT8: return (uint8_t)v;
  case DTYPE_INT8: return (int8_t)v;
  case DTYPE_INT16: return (int16_t)v;
  case DTYPE_INT32: return (int32_t)v;
  default: return v;
  }
}

/* ---- binary ---- */

EW_FN int64_t ipow(int64_t a, int64_t b) {
  if (b < 0) return a == 1 ? 1 : a == -1 ? (b & 1 ? -1 : 1) : 0;
  uint64_t r = 1, x = (uint64_t)a;
  while (b) {
    if (b & 1) r *= x;
    x *= x;
    b >>= 1;
  }
  return (int64_t)r;
}

/* a op b in int64 (wrapping), alpha scaling b for add/sub. An integer division
 * by zero returns 0 and sets *zero_div to 1 (never cleared here). */
EW_FN int64_t ew_bin_i(int op, int64_t alpha, int64_t a, int64_t b, int *zero_div) {
  switch (op) {
  case B_ADD: return (int64_t)((uint64_t)a + (uint64_t)alpha * (uint64_t)b);
  case B_SUB: return (int64_t)((uint64_t)a - (uint64_t)alpha * (uint64_t)b);
  case B_MUL: return (int64_t)((uint64_t)a * (uint64_t)b);
  case B_DIV_TRUNC:
  case B_DIV_FLOOR: {
    if (b == 0) {
      *zero_div = 1;
      return 0;
    }
    if (b == -1) return (int64_t)(0 - (uint64_t)a); /* INT64_MIN / -1 wraps */
    int64_t q = a / b;
    if (op == B_DIV_FLOOR && a % b != 0 && ((a < 0) != (b < 0))) q--;
    return q;
  }
  case B_POW: return ipow(a, b);
  case B_MAX: return a > b ? a : b;
  case B_MIN: return a < b ? a : b;
  case B_EQ: return a == b;
  case B_NE: return a != b;
  case B_LT: return a < b;
  case B_LE: return a <= b;
  case B_GT: return a > b;
  case B_GE: return a >= b;
  case B_LAND: return a && b;
  case B_LOR: return a || b;
  case B_BAND: return a & b;
  case B_BOR: return a | b;
  case B_BXOR: return a ^ b;
  default: return 0;
  }
}

/* torch's div_floor_floating. */
EW_FN double floor_div(double a, double b) {
  if (b == 0) return a / b;
  double mod = fmod(a, b), div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
  if (div == 0) return copysign(0.0, a / b);
  double fl = floor(div);
  if (div - fl > 0.5) fl += 1;
  return fl;
}

/* a op b in double, alpha scaling b for add/sub; comparisons give 0 or 1. */
EW_FN double ew_bin_f(int op, double alpha, double a, double b) {
  switch (op) {
  case B_ADD: return ew_dadd(a, ew_dmul(alpha, b));
  case B_SUB: return ew_dsub(a, ew_dmul(alpha, b));
  case B_MUL: return a * b;
  case B_DIV: return a / b;
  case B_DIV_TRUNC: return trunc(a / b);
  case B_DIV_FLOOR: return floor_div(a, b);
  case B_POW: return pow(a, b);
  case B_MAX: return ew_is_nan(a) || ew_is_nan(b) ? ew_qnan() : a > b ? a : b;
  case B_MIN: return ew_is_nan(a) || ew_is_nan(b) ? ew_qnan() : a < b ? a : b;
  case B_EQ: return a == b;
  case B_NE: return a != b;
  case B_LT: return a < b;
  case B_LE: return a <= b;
  case B_GT: return a > b;
  case B_GE: return a >= b;
  case B_LAND: return a != 0 && b != 0;
  case B_LOR: return a != 0 || b != 0;
  default: return 0;
  }
}

/* a op b in float for the ops of ew_bin_has_f32. */
EW_FN float ew_bin_f32(int op, float alpha, float a, float b) {
  switch (op) {
  case B_ADD: return alpha == 1 ? ew_fadd(a, b) : ew_fadd(a, ew_fmul(alpha, b));
  case B_SUB: return alpha == 1 ? ew_fsub(a, b) : ew_fsub(a, ew_fmul(alpha, b));
  case B_MUL: return a * b;
  default: return a / b; /* B_DIV */
  }
}

/* ---- unary ---- */

EW_FN int64_t ew_un_i(int op, int64_t v) {
  switch (op) {
  case U_NEG: return (int64_t)(0 - (uint64_t)v);
  case U_ABS: return v < 0 ? (int64_t)(0 - (uint64_t)v) : v;
  case U_RELU: return v > 0 ? v : 0;
  case U_SIGN: return (v > 0) - (v < 0);
  case U_NOT: return !v;
  default: return 0;
  }
}

EW_FN double ew_un_f(int op, double v) {
  switch (op) {
  case U_NEG: return -v;
  case U_ABS: return fabs(v);
  case U_EXP: return exp(v);
  case U_LOG: return log(v);
  case U_SQRT: return sqrt(v);
  case U_RSQRT: return 1.0 / sqrt(v);
  case U_SIN: return sin(v);
  case U_COS: return cos(v);
  case U_TANH: return tanh(v);
  case U_SIGMOID: return 1.0 / (1.0 + exp(-v));
  case U_RECIP: return 1.0 / v;
  case U_RELU: return ew_is_nan(v) ? v : v > 0 ? v : 0;
  case U_GELU: return 0.5 * v * (1.0 + erf(v * M_SQRT1_2));
  case U_GELU_TANH: {
    double k = M_SQRT2 * M_2_SQRTPI * 0.5; /* sqrt(2 / pi) */
    double inner = ew_dadd(v, ew_dmul(ew_dmul(ew_dmul(0.044715, v), v), v));
    return 0.5 * v * (1.0 + tanh(k * inner));
  }
  case U_SILU: return v / (1.0 + exp(-v));
  case U_SIGN: return ew_is_nan(v) ? v : (double)((v > 0) - (v < 0));
  case U_NOT: return v == 0;
  default: return 0;
  }
}

/* op(a) in float for the ops of ew_un_has_f32. */
EW_FN float ew_un_f32(int op, float a) {
  switch (op) {
  case U_NEG: return -a;
  case U_ABS: return fabsf(a);
  case U_EXP: return ew_fexp(a);
  case U_LOG: return ew_flog(a);
  case U_SQRT: return sqrtf(a);
  case U_RELU: return a > 0 ? a : (a != a ? a : 0.0f);
  case U_SIGMOID: return 1.0f / (1.0f + ew_fexp(-a));
  case U_SILU: return a / (1.0f + ew_fexp(-a));
  default: return ew_ftanh(a); /* U_TANH */
  }
}

#endif
