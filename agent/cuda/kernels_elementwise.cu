/* Elementwise kernels of the cuda backend: binary ops with broadcasting,
 * scalars and alpha; unary ops; where; clamp. The per-element math is
 * agent/elementwise_ops.h, shared with the cpu backend; the compute dtypes and
 * float32 fast paths are those of agent/cpu/kernels_elementwise.c, so both
 * backends give the same bits. */
#include <math.h>
#include <string.h>

#include "kernels.cuh"
#include "elementwise_ops.h"
#include "kernel_plan.h"

namespace {

/* ---- operands: a tensor (in the iterator) or a Scalar (by value) ---- */

/* A Scalar argument as the cpu sees it (its 8-byte buffer read in its dtype). */
struct scal_t {
  bool sc; /* a Scalar, not a tensor */
  uint8_t byte0;
  float f32;
  double f;
  int64_t i;
};

static scal_t scal_of(const scalar_buf_t *buf, dtype_t dt) {
  scal_t s;
  const char *p = (const char *)buf;
  s.sc = true;
  s.byte0 = buf->b;
  s.f = cu_ld_f(dt, p);
  s.i = cu_ld_i(dt, p);
  s.f32 = dt == DTYPE_FLOAT32 ? buf->f32 : dt == DTYPE_INT64 ? (float)s.i : (float)s.f;
  return s;
}

/* Adds argument param (a tensor or a Scalar) to the iterator. */
static scal_t add_operand(cu_iter_t *it, const kernel_call_t *c, int param) {
  agent_tensor_t *t = kernel_arg(c, param);
  scal_t s;
  memset(&s, 0, sizeof s);
  if (t) {
    cu_iter_add(it, t);
    return s;
  }
  scalar_buf_t buf;
  dtype_t dt = scalar_to_buf(&c->a->v[param], &buf);
  cu_iter_add_scalar(it, NULL, dt);
  return scal_of(&buf, dt);
}

CU_HD double ld_f(const scal_t &s, dtype_t dt, const char *p) {
  return s.sc ? s.f : cu_ld_f(dt, p);
}
CU_HD int64_t ld_i(const scal_t &s, dtype_t dt, const char *p) {
  return s.sc ? s.i : cu_ld_i(dt, p);
}
CU_HD float ld_f32(const scal_t &s, const char *p) { return s.sc ? s.f32 : *(const float *)p; }

/* The tensor written: self for in-place ops, else the fresh result. */
static agent_tensor_t *output_of(const kernel_call_t *c) {
  return c->a->op->is_inplace ? kernel_arg(c, 0) : c->res[0];
}


/* ---- binary ---- */

struct Binary {
  cu_iter_t it; /* out, x, y */
  scal_t s[2];
  int op;
  bool is_int, f32;
  dtype_t cast[2];  /* kernel_binary_t.cast */
  bool cast_int[2]; /* operand k is integral or bool (cast with ew_round_i) */
  double alpha_f;
  int64_t alpha_i;
  float alpha32;
  int *zero_div; /* device flag, for integer division */

  /* Operand k at q as a double, cast as kernel_binary_t.cast says. */
  CU_HD double ld_cast(int k, const char *q) const {
    if (!cast[k]) return ld_f(s[k], it.dt[k + 1], q);
    if (cast_int[k]) return ew_round_i(cast[k], ld_i(s[k], it.dt[k + 1], q));
    return ew_round_to(cast[k], ld_f(s[k], it.dt[k + 1], q));
  }

  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    if (f32) {
      *(float *)p[0] = ew_bin_f32(op, alpha32, ld_f32(s[0], p[1]), ld_f32(s[1], p[2]));
    } else if (is_int) {
      int64_t a = ld_i(s[0], it.dt[1], p[1]), b = ld_i(s[1], it.dt[2], p[2]);
      if (cast[0]) a = ew_wrap_i(cast[0], a);
      if (cast[1]) b = ew_wrap_i(cast[1], b);
      cu_st_i(it.dt[0], p[0], ew_bin_i(op, alpha_i, a, b, zero_div));
    } else {
      double a = ld_cast(0, p[1]), b = ld_cast(1, p[2]);
      cu_st_f(it.dt[0], p[0], ew_bin_f(op, alpha_f, a, b));
    }
  }
};

}  // namespace

extern "C" int cuda_kernel_binary(const kernel_call_t *c, meshd_error_t *e) {
  const op_args_t *a = c->a;
  kernel_binary_t bp = kernel_binary_plan(c);
  dtype_t rt = bp.rt;
  Binary x;
  memset(&x, 0, sizeof x);
  x.op = bp.op;
  x.is_int = bp.is_int;
  x.alpha_f = bp.alpha_f;
  x.alpha_i = bp.alpha_i;
  x.cast[0] = bp.cast[0];
  x.cast[1] = bp.cast[1];
  x.alpha32 = (float)x.alpha_f;
  agent_tensor_t *out = output_of(c);
  cu_iter_init(&x.it, out->meta.layout.sizes, out->meta.layout.ndim);
  cu_iter_add(&x.it, out);
  x.s[0] = add_operand(&x.it, c, 0);
  x.s[1] = add_operand(&x.it, c, 1);
  dtype_t o = x.it.dt[0], i0 = x.it.dt[1], i1 = x.it.dt[2];
  bool f32 = o == DTYPE_FLOAT32 && i0 == DTYPE_FLOAT32 && i1 == DTYPE_FLOAT32;
  if (!f32 && o == DTYPE_FLOAT32 && i0 == DTYPE_FLOAT32 && rt == DTYPE_FLOAT32 &&
      a->v[1].kind != VAL_TENSOR) {
    /* A Python scalar against a float32 tensor is a float32 value in torch. */
    scalar_buf_t buf;
    memset(&buf, 0, sizeof buf);
    buf.f32 = x.s[1].f32;
    x.s[1] = scal_of(&buf, DTYPE_FLOAT32);
    x.it.dt[2] = DTYPE_FLOAT32;
    f32 = true;
  }
  x.cast_int[0] = !dtype_is_floating(x.it.dt[1]);
  x.cast_int[1] = !dtype_is_floating(x.it.dt[2]);
  /* The cpu's float32 rows cover these four ops; the rest go through double. */
  x.f32 = f32 && ew_bin_has_f32(x.op);
  cu_iter_coalesce(&x.it);
  int64_t n = cu_iter_numel(&x.it);
  bool int_div = x.is_int && (x.op == B_DIV_TRUNC || x.op == B_DIV_FLOOR) && n > 0;
  if (!int_div) return cuda_launch(c->b, c->bs, n, x, kernel_opname(c), e);

  int ret = -1, zero_div = 0;
  x.zero_div = (int *)cuda_scratch_alloc(c->b, c->bs, sizeof(int));
  if (!x.zero_div)
    return error_set(e, ERR_QUOTA, "%s: out of device memory (scratch)", kernel_opname(c));
  if (cuda_memset(c->b, c->bs, x.zero_div, 0, sizeof(int), e) ||
      cuda_launch(c->b, c->bs, n, x, kernel_opname(c), e) ||
      cuda_readback(c, &zero_div, x.zero_div, sizeof(int), e))
    goto out;
  if (zero_div) {
    error_set(e, ERR_REMOTE_FAILURE, "%s: ZeroDivisionError: integer division by zero (rank %u)",
              kernel_opname(c), c->rank);
    goto out;
  }
  ret = 0;
out:
  cuda_scratch_free(c->b, c->bs, x.zero_div, sizeof(int));
  return ret;
}

namespace {

/* ---- unary ---- */

struct Unary {
  cu_iter_t it; /* out, in */
  int op;
  bool is_int, f32;
  dtype_t cast; /* an integer input rounded to this first (ew_round_i) */

  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    if (f32) *(float *)p[0] = ew_un_f32(op, *(const float *)p[1]);
    else if (is_int) cu_st_i(it.dt[0], p[0], ew_un_i(op, cu_ld_i(it.dt[1], p[1])));
    else if (cast) cu_st_f(it.dt[0], p[0], ew_un_f(op, ew_round_i(cast, cu_ld_i(it.dt[1], p[1]))));
    else cu_st_f(it.dt[0], p[0], ew_un_f(op, cu_ld_f(it.dt[1], p[1])));
  }
};

}  // namespace

extern "C" int cuda_kernel_unary(const kernel_call_t *c, meshd_error_t *e) {
  Unary x;
  memset(&x, 0, sizeof x);
  x.op = ew_unary_op(kernel_opname(c));
  if (x.op == U_GELU && c->a->v[1].kind == VAL_STRING && strcmp(c->a->v[1].s, "tanh") == 0)
    x.op = U_GELU_TANH;
  agent_tensor_t *out = c->res[0], *in = kernel_arg(c, 0);
  /* logical_not reads any dtype as double; the others compute in their result dtype. */
  x.is_int = x.op != U_NOT && cu_is_int(out->meta.dtype);
  /* an integer input of a floating op is cast to its result dtype first (torch) */
  if (!x.is_int && x.op != U_NOT && !dtype_is_floating(in->meta.dtype)) x.cast = out->meta.dtype;
  x.f32 = out->meta.dtype == DTYPE_FLOAT32 && in->meta.dtype == DTYPE_FLOAT32 &&
          ew_un_has_f32(x.op);
  cu_iter_init(&x.it, out->meta.layout.sizes, out->meta.layout.ndim);
  cu_iter_add(&x.it, out);
  cu_iter_add(&x.it, in);
  cu_iter_coalesce(&x.it);
  return cuda_launch(c->b, c->bs, cu_iter_numel(&x.it), x, kernel_opname(c), e);
}

namespace {

/* ---- where, clamp ---- */

struct Where {
  cu_iter_t it; /* out, cond, x, y */
  scal_t s[3];
  bool is_int;

  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    bool take = (s[0].sc ? s[0].byte0 : *(const uint8_t *)p[1]) != 0;
    if (is_int)
      cu_st_i(it.dt[0], p[0], take ? ld_i(s[1], it.dt[2], p[2]) : ld_i(s[2], it.dt[3], p[3]));
    else
      cu_st_f(it.dt[0], p[0], take ? ld_f(s[1], it.dt[2], p[2]) : ld_f(s[2], it.dt[3], p[3]));
  }
};

}  // namespace

extern "C" int cuda_kernel_where(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *out = c->res[0];
  Where x;
  memset(&x, 0, sizeof x);
  x.is_int = cu_is_int(out->meta.dtype);
  cu_iter_init(&x.it, out->meta.layout.sizes, out->meta.layout.ndim);
  cu_iter_add(&x.it, out);
  for (int k = 0; k < 3; k++) x.s[k] = add_operand(&x.it, c, k);
  cu_iter_coalesce(&x.it);
  return cuda_launch(c->b, c->bs, cu_iter_numel(&x.it), x, kernel_opname(c), e);
}

namespace {

struct Clamp {
  cu_iter_t it; /* out, self, min, max */
  scal_t s[3];
  dtype_t rt; /* the computation dtype: integer bounds wrap into it, as torch casts them */
  bool is_int, has_lo, has_hi;

  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    if (is_int) {
      int64_t r = ld_i(s[0], it.dt[1], p[1]);
      if (has_lo) {
        int64_t l = ew_wrap_i(rt, ld_i(s[1], it.dt[2], p[2]));
        r = r < l ? l : r;
      }
      if (has_hi) {
        int64_t h = ew_wrap_i(rt, ld_i(s[2], it.dt[3], p[3]));
        r = r > h ? h : r;
      }
      cu_st_i(it.dt[0], p[0], r);
    } else {
      double r = ld_f(s[0], it.dt[1], p[1]);
      if (has_lo) {
        double l = ld_f(s[1], it.dt[2], p[2]);
        r = ew_is_nan(r) || ew_is_nan(l) ? ew_qnan() : r < l ? l : r;
      }
      if (has_hi) {
        double h = ld_f(s[2], it.dt[3], p[3]);
        r = ew_is_nan(r) || ew_is_nan(h) ? ew_qnan() : r > h ? h : r;
      }
      cu_st_f(it.dt[0], p[0], r);
    }
  }
};

}  // namespace

extern "C" int cuda_kernel_clamp(const kernel_call_t *c, meshd_error_t *e) {
  const op_value_t *vals[3] = {&c->a->v[0], &c->a->v[1], &c->a->v[2]};
  dtype_t rt = ops_result_type(vals, 3);
  agent_tensor_t *out = output_of(c);
  Clamp x;
  memset(&x, 0, sizeof x);
  x.is_int = cu_is_int(rt);
  x.rt = rt;
  x.has_lo = c->a->v[1].kind != VAL_NONE;
  x.has_hi = c->a->v[2].kind != VAL_NONE;
  cu_iter_init(&x.it, out->meta.layout.sizes, out->meta.layout.ndim);
  cu_iter_add(&x.it, out);
  for (int k = 0; k < 3; k++) x.s[k] = add_operand(&x.it, c, k);
  cu_iter_coalesce(&x.it);
  return cuda_launch(c->b, c->bs, cu_iter_numel(&x.it), x, kernel_opname(c), e);
}
