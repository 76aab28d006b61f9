/* Elementwise kernels: binary ops with broadcasting, scalars and alpha; unary
 * ops; where; clamp. Values are computed as int64 when the op's computation
 * dtype is integral or bool, as double otherwise (float32 gets its own fast
 * rows; float16/bfloat16 round through float32 on store), each operand first
 * cast to the computation dtype as torch casts it (kernel_binary_t.cast). */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"
#include "elementwise_ops.h"
#include "kernel_plan.h"

typedef struct {
  int op;
  bool is_int;       /* computed as int64 */
  dtype_t out, in[3];
  dtype_t cast[2];   /* kernel_binary_t.cast */
  bool cast_int[2];  /* operand k is integral or bool (cast with ew_round_i) */
  double alpha_f;
  int64_t alpha_i;
  _Atomic int zero_div; /* an integer division by zero happened */
} ew_ctx_t;

/* Adds argument param (a tensor or a Scalar) to the iterator; its dtype into *dt. */
static void add_operand(cpu_iter_t *it, const kernel_call_t *c, int param, scalar_buf_t *buf,
                        dtype_t *dt) {
  agent_tensor_t *t = kernel_arg(c, param);
  if (t) {
    cpu_iter_add(it, t);
    *dt = t->meta.dtype;
  } else {
    *dt = scalar_to_buf(&c->a->v[param], buf);
    cpu_iter_add_scalar(it, (char *)buf);
  }
}

/* The tensor written: self for in-place ops, else the fresh result. */
static agent_tensor_t *output_of(const kernel_call_t *c) {
  return c->a->op->is_inplace ? kernel_arg(c, 0) : c->res[0];
}

/* ---- binary ---- */

/* Operand k at p as a double, cast as kernel_binary_t.cast says. */
static inline double ld_cast(const ew_ctx_t *c, int k, const char *p) {
  if (!c->cast[k]) return cpu_ld_f(c->in[k], p);
  if (c->cast_int[k]) return ew_round_i(c->cast[k], cpu_ld_i(c->in[k], p));
  return ew_round_to(c->cast[k], cpu_ld_f(c->in[k], p));
}

static void bin_row(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  ew_ctx_t *c = p;
  char *o = ptr[0];
  const char *x = ptr[1], *y = ptr[2];
  if (c->is_int) {
    int zero_div = 0;
    for (int64_t i = 0; i < n; i++, o += s[0], x += s[1], y += s[2]) {
      int64_t a = cpu_ld_i(c->in[0], x), b = cpu_ld_i(c->in[1], y);
      if (c->cast[0]) a = ew_wrap_i(c->cast[0], a);
      if (c->cast[1]) b = ew_wrap_i(c->cast[1], b);
      cpu_st_i(c->out, o, ew_bin_i(c->op, c->alpha_i, a, b, &zero_div));
    }
    if (zero_div) atomic_store(&c->zero_div, 1);
  } else {
    for (int64_t i = 0; i < n; i++, o += s[0], x += s[1], y += s[2]) {
      double a = ld_cast(c, 0, x), b = ld_cast(c, 1, y);
      cpu_st_f(c->out, o, ew_bin_f(c->op, c->alpha_f, a, b));
    }
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
    if (alpha == 1) F32_LOOP(ew_bin_f32(B_ADD, 1.0f, a, b));
    else F32_LOOP(ew_bin_f32(B_ADD, alpha, a, b));
    break;
  case B_SUB:
    if (alpha == 1) F32_LOOP(ew_bin_f32(B_SUB, 1.0f, a, b));
    else F32_LOOP(ew_bin_f32(B_SUB, alpha, a, b));
    break;
  case B_MUL: F32_LOOP(ew_bin_f32(B_MUL, 1.0f, a, b)); break;
  case B_DIV: F32_LOOP(ew_bin_f32(B_DIV, 1.0f, a, b)); break;
  default: bin_row(p, ptr, s, n); break;
  }
}

int cpu_kernel_binary(const kernel_call_t *c, meshd_error_t *e) {
  const op_args_t *a = c->a;
  kernel_binary_t bp = kernel_binary_plan(c);
  dtype_t rt = bp.rt;
  ew_ctx_t x = {.op = bp.op, .is_int = bp.is_int, .alpha_f = bp.alpha_f, .alpha_i = bp.alpha_i,
                .cast = {bp.cast[0], bp.cast[1]}};
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
    float f = x.in[1] == DTYPE_INT64 ? (float)bufs[1].i /* rounded once */
                                     : (float)cpu_ld_f(x.in[1], (const char *)&bufs[1]);
    memcpy(&bufs[1], &f, 4);
    x.in[1] = DTYPE_FLOAT32;
    f32 = true;
  }
  for (int k = 0; k < 2; k++) x.cast_int[k] = !dtype_is_floating(x.in[k]);
  cpu_iter_run(&it, f32 ? bin_row_f32 : bin_row, &x);
  if (atomic_load(&x.zero_div))
    return error_set(e, ERR_REMOTE_FAILURE,
                     "%s: ZeroDivisionError: integer division by zero (rank %u)", kernel_opname(c),
                     c->rank);
  return 0;
}

/* ---- unary ---- */

static void un_row(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  const ew_ctx_t *c = p;
  char *o = ptr[0];
  const char *x = ptr[1];
  if (c->is_int) {
    for (int64_t i = 0; i < n; i++, o += s[0], x += s[1])
      cpu_st_i(c->out, o, ew_un_i(c->op, cpu_ld_i(c->in[0], x)));
  } else {
    for (int64_t i = 0; i < n; i++, o += s[0], x += s[1])
      cpu_st_f(c->out, o, ew_un_f(c->op, ld_cast(c, 0, x)));
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
  /* A constant op per loop: each inlines to its own math. */
  case U_NEG: F32_UN_LOOP(ew_un_f32(U_NEG, a)); break;
  case U_ABS: F32_UN_LOOP(ew_un_f32(U_ABS, a)); break;
  case U_EXP: F32_UN_LOOP(ew_un_f32(U_EXP, a)); break;
  case U_LOG: F32_UN_LOOP(ew_un_f32(U_LOG, a)); break;
  case U_SQRT: F32_UN_LOOP(ew_un_f32(U_SQRT, a)); break;
  case U_RELU: F32_UN_LOOP(ew_un_f32(U_RELU, a)); break;
  case U_SIGMOID: F32_UN_LOOP(ew_un_f32(U_SIGMOID, a)); break;
  case U_SILU: F32_UN_LOOP(ew_un_f32(U_SILU, a)); break;
  case U_TANH: F32_UN_LOOP(ew_un_f32(U_TANH, a)); break;
  default: un_row(p, ptr, s, n); break;
  }
}

int cpu_kernel_unary(const kernel_call_t *c, meshd_error_t *e) {
  ew_ctx_t x = {.op = ew_unary_op(kernel_opname(c))};
  if (x.op == U_GELU && c->a->v[1].kind == VAL_STRING && strcmp(c->a->v[1].s, "tanh") == 0)
    x.op = U_GELU_TANH;
  agent_tensor_t *out = c->res[0], *in = kernel_arg(c, 0);
  x.out = out->meta.dtype;
  x.in[0] = in->meta.dtype;
  /* logical_not reads any dtype as double; the others compute in their result dtype. */
  x.is_int = x.op != U_NOT && cpu_is_int(x.out);
  /* an integer input of a floating op is cast to its result dtype first (torch) */
  x.cast_int[0] = !dtype_is_floating(x.in[0]);
  if (!x.is_int && x.op != U_NOT && x.cast_int[0]) x.cast[0] = x.out;
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

int cpu_kernel_where(const kernel_call_t *c, meshd_error_t *e) {
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
  dtype_t rt; /* the computation dtype: integer bounds wrap into it, as torch casts them */
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
        int64_t l = ew_wrap_i(c->rt, cpu_ld_i(x->in[1], lo));
        r = r < l ? l : r;
      }
      if (c->has_hi) {
        int64_t h = ew_wrap_i(c->rt, cpu_ld_i(x->in[2], hi));
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

int cpu_kernel_clamp(const kernel_call_t *c, meshd_error_t *e) {
  const op_value_t *vals[3] = {&c->a->v[0], &c->a->v[1], &c->a->v[2]};
  dtype_t rt = ops_result_type(vals, 3);
  agent_tensor_t *out = output_of(c);
  clamp_ctx_t x = {.ew = {.out = out->meta.dtype, .is_int = cpu_is_int(rt)},
                   .rt = rt,
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
