/* Elementwise kernels: binary ops with broadcasting, scalars and alpha; unary
 * ops; where; clamp. Values are computed as int64 when the op's computation
 * dtype is integral or bool, as double otherwise (float32 gets its own fast
 * rows; float16/bfloat16 round through float32 on store). */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

enum {
  B_ADD, B_SUB, B_MUL, B_DIV, B_DIV_TRUNC, B_DIV_FLOOR, B_POW, B_MAX, B_MIN,
  B_EQ, B_NE, B_LT, B_LE, B_GT, B_GE, B_LAND, B_LOR, B_BAND, B_BOR, B_BXOR
};

static const struct {
  const char *name;
  int op;
} binary_names[] = {
    {"add", B_ADD}, {"sub", B_SUB}, {"mul", B_MUL}, {"div", B_DIV}, {"pow", B_POW},
    {"maximum", B_MAX}, {"minimum", B_MIN}, {"eq", B_EQ}, {"ne", B_NE}, {"lt", B_LT},
    {"le", B_LE}, {"gt", B_GT}, {"ge", B_GE}, {"logical_and", B_LAND}, {"logical_or", B_LOR},
    {"bitwise_and", B_BAND}, {"bitwise_or", B_BOR}, {"bitwise_xor", B_BXOR},
    {"add_", B_ADD}, {"sub_", B_SUB}, {"mul_", B_MUL}, {"div_", B_DIV},
};

typedef struct {
  int op;
  bool is_int;       /* computed as int64 */
  dtype_t out, in[3];
  double alpha_f;
  int64_t alpha_i;
  _Atomic int zero_div; /* an integer division by zero happened */
} ew_ctx_t;

/* A Scalar argument as an 8-byte value of its own dtype, for cpu_iter_add_scalar. */
typedef union {
  double f;
  int64_t i;
  uint8_t b;
} scalar_buf_t;

static dtype_t scalar_to_buf(const op_value_t *v, scalar_buf_t *buf) {
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

/* Adds argument param (a tensor or a Scalar) to the iterator; its dtype into *dt. */
static void add_operand(cpu_iter_t *it, const cpu_call_t *c, int param, scalar_buf_t *buf,
                        dtype_t *dt) {
  agent_tensor_t *t = cpu_arg(c, param);
  if (t) {
    cpu_iter_add(it, t);
    *dt = t->meta.dtype;
  } else {
    *dt = scalar_to_buf(&c->a->v[param], buf);
    cpu_iter_add_scalar(it, (char *)buf);
  }
}

/* The tensor written: self for in-place ops, else the fresh result. */
static agent_tensor_t *output_of(const cpu_call_t *c) {
  return c->a->op->is_inplace ? cpu_arg(c, 0) : c->res[0];
}

/* ---- binary ---- */

static inline int64_t ipow(int64_t a, int64_t b) {
  if (b < 0) return a == 1 ? 1 : a == -1 ? (b & 1 ? -1 : 1) : 0;
  uint64_t r = 1, x = (uint64_t)a;
  while (b) {
    if (b & 1) r *= x;
    x *= x;
    b >>= 1;
  }
  return (int64_t)r;
}

static inline int64_t bin_i(ew_ctx_t *c, int64_t a, int64_t b) {
  switch (c->op) {
  case B_ADD: return (int64_t)((uint64_t)a + (uint64_t)c->alpha_i * (uint64_t)b);
  case B_SUB: return (int64_t)((uint64_t)a - (uint64_t)c->alpha_i * (uint64_t)b);
  case B_MUL: return (int64_t)((uint64_t)a * (uint64_t)b);
  case B_DIV_TRUNC:
  case B_DIV_FLOOR: {
    if (b == 0) {
      atomic_store(&c->zero_div, 1);
      return 0;
    }
    if (b == -1) return (int64_t)(0 - (uint64_t)a); /* INT64_MIN / -1 wraps */
    int64_t q = a / b;
    if (c->op == B_DIV_FLOOR && a % b != 0 && ((a < 0) != (b < 0))) q--;
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
static inline double floor_div(double a, double b) {
  if (b == 0) return a / b;
  double mod = fmod(a, b), div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
  if (div == 0) return copysign(0.0, a / b);
  double fl = floor(div);
  if (div - fl > 0.5) fl += 1;
  return fl;
}

static inline double bin_f(const ew_ctx_t *c, double a, double b) {
  switch (c->op) {
  case B_ADD: return a + c->alpha_f * b;
  case B_SUB: return a - c->alpha_f * b;
  case B_MUL: return a * b;
  case B_DIV: return a / b;
  case B_DIV_TRUNC: return trunc(a / b);
  case B_DIV_FLOOR: return floor_div(a, b);
  case B_POW: return pow(a, b);
  case B_MAX: return isnan(a) || isnan(b) ? NAN : a > b ? a : b;
  case B_MIN: return isnan(a) || isnan(b) ? NAN : a < b ? a : b;
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

static void bin_row(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  ew_ctx_t *c = p;
  char *o = ptr[0];
  const char *x = ptr[1], *y = ptr[2];
  if (c->is_int) {
    for (int64_t i = 0; i < n; i++, o += s[0], x += s[1], y += s[2])
      cpu_st_i(c->out, o, bin_i(c, cpu_ld_i(c->in[0], x), cpu_ld_i(c->in[1], y)));
  } else {
    for (int64_t i = 0; i < n; i++, o += s[0], x += s[1], y += s[2])
      cpu_st_f(c->out, o, bin_f(c, cpu_ld_f(c->in[0], x), cpu_ld_f(c->in[1], y)));
  }
}

/* float32 op float32 -> float32, in float as torch computes it. */
#define F32_LOOP(expr)                                                        \
  do {                                                                        \
    if (s[0] == 4 && s[1] == 4 && s[2] == 4) {                                \
      float *o = (float *)ptr[0];                                             \
      const float *x = (const float *)ptr[1], *y = (const float *)ptr[2];     \
      for (int64_t i = 0; i < n; i++) {                                       \
        float a = x[i], b = y[i];                                             \
        o[i] = (expr);                                                        \
      }                                                                       \
    } else {                                                                  \
      char *o = ptr[0];                                                       \
      const char *x = ptr[1], *y = ptr[2];                                    \
      for (int64_t i = 0; i < n; i++, o += s[0], x += s[1], y += s[2]) {      \
        float a = *(const float *)x, b = *(const float *)y;                   \
        *(float *)o = (expr);                                                 \
      }                                                                       \
    }                                                                         \
  } while (0)

static void bin_row_f32(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  const ew_ctx_t *c = p;
  float alpha = (float)c->alpha_f;
  switch (c->op) {
  case B_ADD:
    if (alpha == 1) F32_LOOP(a + b);
    else F32_LOOP(a + alpha * b);
    break;
  case B_SUB:
    if (alpha == 1) F32_LOOP(a - b);
    else F32_LOOP(a - alpha * b);
    break;
  case B_MUL: F32_LOOP(a * b); break;
  case B_DIV: F32_LOOP(a / b); break;
  default: bin_row(p, ptr, s, n); break;
  }
}

int cpu_kernel_binary(const cpu_call_t *c, meshd_error_t *e) {
  const op_args_t *a = c->a;
  ew_ctx_t x = {.op = -1, .alpha_f = 1, .alpha_i = 1};
  for (size_t k = 0; k < sizeof binary_names / sizeof binary_names[0]; k++)
    if (strcmp(binary_names[k].name, cpu_opname(c)) == 0) x.op = binary_names[k].op;
  const op_value_t *vals[2] = {&a->v[0], &a->v[1]};
  dtype_t rt = ops_result_type(vals, 2);
  if (x.op == B_DIV && a->v[2].kind == VAL_STRING)
    x.op = strcmp(a->v[2].s, "floor") == 0 ? B_DIV_FLOOR : B_DIV_TRUNC;
  if ((x.op == B_ADD || x.op == B_SUB) && a->v[2].kind != VAL_NONE) {
    const op_value_t *al = &a->v[2];
    x.alpha_f = al->kind == VAL_FLOAT ? al->f : al->kind == VAL_BOOL ? al->b : (double)al->i;
    x.alpha_i = al->kind == VAL_INT ? al->i : al->kind == VAL_BOOL ? al->b : cpu_f2i(al->f);
  }
  x.is_int = x.op == B_DIV || x.op == B_LAND || x.op == B_LOR ? false : cpu_is_int(rt);
  if (x.op >= B_BAND) x.is_int = true;
  agent_tensor_t *out = output_of(c);
  x.out = out->meta.dtype;
  cpu_iter_t it;
  scalar_buf_t bufs[2];
  cpu_iter_init(&it, out->meta.layout.sizes, out->meta.layout.ndim);
  cpu_iter_add(&it, out);
  add_operand(&it, c, 0, &bufs[0], &x.in[0]);
  add_operand(&it, c, 1, &bufs[1], &x.in[1]);
  bool f32 = x.out == DTYPE_FLOAT32 && x.in[0] == DTYPE_FLOAT32 && x.in[1] == DTYPE_FLOAT32;
  if (!f32 && x.out == DTYPE_FLOAT32 && x.in[0] == DTYPE_FLOAT32 && rt == DTYPE_FLOAT32 &&
      a->v[1].kind != VAL_TENSOR) {
    /* A Python scalar against a float32 tensor is a float32 value in torch. */
    float f = (float)cpu_ld_f(x.in[1], (const char *)&bufs[1]);
    memcpy(&bufs[1], &f, 4);
    x.in[1] = DTYPE_FLOAT32;
    f32 = true;
  }
  cpu_iter_run(&it, f32 ? bin_row_f32 : bin_row, &x);
  if (atomic_load(&x.zero_div))
    return error_set(e, ERR_REMOTE_FAILURE,
                     "%s: ZeroDivisionError: integer division by zero (rank %u)", cpu_opname(c),
                     c->rank);
  return 0;
}

/* ---- unary ---- */

enum {
  U_NEG, U_ABS, U_EXP, U_LOG, U_SQRT, U_RSQRT, U_SIN, U_COS, U_TANH, U_SIGMOID, U_RECIP,
  U_RELU, U_GELU, U_GELU_TANH, U_SILU, U_SIGN, U_NOT
};

static const struct {
  const char *name;
  int op;
} unary_names[] = {
    {"neg", U_NEG}, {"abs", U_ABS}, {"exp", U_EXP}, {"log", U_LOG}, {"sqrt", U_SQRT},
    {"rsqrt", U_RSQRT}, {"sin", U_SIN}, {"cos", U_COS}, {"tanh", U_TANH},
    {"sigmoid", U_SIGMOID}, {"reciprocal", U_RECIP}, {"relu", U_RELU}, {"gelu", U_GELU},
    {"silu", U_SILU}, {"sign", U_SIGN}, {"logical_not", U_NOT},
};

static inline int64_t un_i(int op, int64_t v) {
  switch (op) {
  case U_NEG: return (int64_t)(0 - (uint64_t)v);
  case U_ABS: return v < 0 ? (int64_t)(0 - (uint64_t)v) : v;
  case U_RELU: return v > 0 ? v : 0;
  case U_SIGN: return (v > 0) - (v < 0);
  case U_NOT: return !v;
  default: return 0;
  }
}

static inline double un_f(int op, double v) {
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
  case U_RELU: return isnan(v) ? v : v > 0 ? v : 0;
  case U_GELU: return 0.5 * v * (1.0 + erf(v * M_SQRT1_2));
  case U_GELU_TANH: {
    double k = M_SQRT2 * M_2_SQRTPI * 0.5; /* sqrt(2 / pi) */
    return 0.5 * v * (1.0 + tanh(k * (v + 0.044715 * v * v * v)));
  }
  case U_SILU: return v / (1.0 + exp(-v));
  case U_SIGN: return isnan(v) ? v : (double)((v > 0) - (v < 0));
  case U_NOT: return v == 0;
  default: return 0;
  }
}

static void un_row(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  const ew_ctx_t *c = p;
  char *o = ptr[0];
  const char *x = ptr[1];
  if (c->is_int) {
    for (int64_t i = 0; i < n; i++, o += s[0], x += s[1])
      cpu_st_i(c->out, o, un_i(c->op, cpu_ld_i(c->in[0], x)));
  } else {
    for (int64_t i = 0; i < n; i++, o += s[0], x += s[1])
      cpu_st_f(c->out, o, un_f(c->op, cpu_ld_f(c->in[0], x)));
  }
}

#define F32_UN_LOOP(expr)                                                     \
  do {                                                                        \
    if (s[0] == 4 && s[1] == 4) {                                             \
      float *o = (float *)ptr[0];                                             \
      const float *x = (const float *)ptr[1];                                 \
      for (int64_t i = 0; i < n; i++) {                                       \
        float a = x[i];                                                       \
        o[i] = (expr);                                                        \
      }                                                                       \
    } else {                                                                  \
      char *o = ptr[0];                                                       \
      const char *x = ptr[1];                                                 \
      for (int64_t i = 0; i < n; i++, o += s[0], x += s[1]) {                 \
        float a = *(const float *)x;                                          \
        *(float *)o = (expr);                                                 \
      }                                                                       \
    }                                                                         \
  } while (0)

static void un_row_f32(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  const ew_ctx_t *c = p;
  switch (c->op) {
  case U_NEG: F32_UN_LOOP(-a); break;
  case U_ABS: F32_UN_LOOP(fabsf(a)); break;
  case U_EXP: F32_UN_LOOP(expf(a)); break;
  case U_LOG: F32_UN_LOOP(logf(a)); break;
  case U_SQRT: F32_UN_LOOP(sqrtf(a)); break;
  case U_RELU: F32_UN_LOOP(a > 0 ? a : (a != a ? a : 0.0f)); break;
  case U_SIGMOID: F32_UN_LOOP(1.0f / (1.0f + expf(-a))); break;
  case U_SILU: F32_UN_LOOP(a / (1.0f + expf(-a))); break;
  case U_TANH: F32_UN_LOOP(tanhf(a)); break;
  default: un_row(p, ptr, s, n); break;
  }
}

int cpu_kernel_unary(const cpu_call_t *c, meshd_error_t *e) {
  ew_ctx_t x = {.op = -1};
  for (size_t k = 0; k < sizeof unary_names / sizeof unary_names[0]; k++)
    if (strcmp(unary_names[k].name, cpu_opname(c)) == 0) x.op = unary_names[k].op;
  if (x.op == U_GELU && c->a->v[1].kind == VAL_STRING && strcmp(c->a->v[1].s, "tanh") == 0)
    x.op = U_GELU_TANH;
  agent_tensor_t *out = c->res[0], *in = cpu_arg(c, 0);
  x.out = out->meta.dtype;
  x.in[0] = in->meta.dtype;
  /* logical_not reads any dtype as double; the others compute in their result dtype. */
  x.is_int = x.op != U_NOT && cpu_is_int(x.out);
  cpu_iter_t it;
  cpu_iter_init(&it, out->meta.layout.sizes, out->meta.layout.ndim);
  cpu_iter_add(&it, out);
  cpu_iter_add(&it, in);
  bool f32 = x.out == DTYPE_FLOAT32 && x.in[0] == DTYPE_FLOAT32;
  cpu_iter_run(&it, f32 ? un_row_f32 : un_row, &x);
  return 0;
}

/* ---- where, clamp ---- */

static void where_row(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  const ew_ctx_t *c = p;
  char *o = ptr[0];
  const char *cond = ptr[1], *x = ptr[2], *y = ptr[3];
  for (int64_t i = 0; i < n; i++, o += s[0], cond += s[1], x += s[2], y += s[3]) {
    bool take = *(const uint8_t *)cond != 0;
    if (c->is_int) cpu_st_i(c->out, o, take ? cpu_ld_i(c->in[1], x) : cpu_ld_i(c->in[2], y));
    else cpu_st_f(c->out, o, take ? cpu_ld_f(c->in[1], x) : cpu_ld_f(c->in[2], y));
  }
}

int cpu_kernel_where(const cpu_call_t *c, meshd_error_t *e) {
  agent_tensor_t *out = c->res[0];
  ew_ctx_t x = {.out = out->meta.dtype, .is_int = cpu_is_int(out->meta.dtype)};
  cpu_iter_t it;
  scalar_buf_t bufs[3];
  cpu_iter_init(&it, out->meta.layout.sizes, out->meta.layout.ndim);
  cpu_iter_add(&it, out);
  for (int k = 0; k < 3; k++) add_operand(&it, c, k, &bufs[k], &x.in[k]);
  cpu_iter_run(&it, where_row, &x);
  return 0;
}

typedef struct {
  ew_ctx_t ew;
  bool has_lo, has_hi;
} clamp_ctx_t;

static void clamp_row(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  const clamp_ctx_t *c = p;
  const ew_ctx_t *x = &c->ew;
  char *o = ptr[0];
  const char *v = ptr[1], *lo = ptr[2], *hi = ptr[3];
  for (int64_t i = 0; i < n; i++, o += s[0], v += s[1], lo += s[2], hi += s[3]) {
    if (x->is_int) {
      int64_t r = cpu_ld_i(x->in[0], v);
      if (c->has_lo) {
        int64_t l = cpu_ld_i(x->in[1], lo);
        r = r < l ? l : r;
      }
      if (c->has_hi) {
        int64_t h = cpu_ld_i(x->in[2], hi);
        r = r > h ? h : r;
      }
      cpu_st_i(x->out, o, r);
    } else {
      double r = cpu_ld_f(x->in[0], v);
      if (c->has_lo) {
        double l = cpu_ld_f(x->in[1], lo);
        r = isnan(r) || isnan(l) ? NAN : r < l ? l : r;
      }
      if (c->has_hi) {
        double h = cpu_ld_f(x->in[2], hi);
        r = isnan(r) || isnan(h) ? NAN : r > h ? h : r;
      }
      cpu_st_f(x->out, o, r);
    }
  }
}

int cpu_kernel_clamp(const cpu_call_t *c, meshd_error_t *e) {
  const op_value_t *vals[3] = {&c->a->v[0], &c->a->v[1], &c->a->v[2]};
  dtype_t rt = ops_result_type(vals, 3);
  agent_tensor_t *out = output_of(c);
  clamp_ctx_t x = {.ew = {.out = out->meta.dtype, .is_int = cpu_is_int(rt)},
                   .has_lo = c->a->v[1].kind != VAL_NONE,
                   .has_hi = c->a->v[2].kind != VAL_NONE};
  cpu_iter_t it;
  scalar_buf_t bufs[3];
  cpu_iter_init(&it, out->meta.layout.sizes, out->meta.layout.ndim);
  cpu_iter_add(&it, out);
  for (int k = 0; k < 3; k++) add_operand(&it, c, k, &bufs[k], &x.ew.in[k]);
  cpu_iter_run(&it, clamp_row, &x);
  return 0;
}
