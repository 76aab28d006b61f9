/* Factories (tensors made from nothing) and the fills. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ops_internal.h"

/* The int[] size at `param`, checked as the shape of a tensor of dt. */
static int size_arg(const op_args_t *a, int param, dtype_t dt, const int64_t **sizes, int *ndim,
                    meshd_error_t *e) {
  size_t n;
  char ctx[3 * OP_NAME_MAX];
  op_value_ints(&a->v[param], sizes, &n);
  if (layout_check_shape(ops__arg_ctx(a, param, ctx, sizeof ctx), *sizes,
                         (int64_t)(n > INT32_MAX ? INT32_MAX : n), dtype_size(dt), e))
    return -1;
  *ndim = (int)n;
  return 0;
}

static dtype_t dtype_or(const op_args_t *a, int param, dtype_t dflt) {
  dtype_t d = arg_dtype(a, param);
  return d == DTYPE_INVALID ? dflt : d;
}

int ops__rule_filled(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  dtype_t dt = dtype_or(a, 1, DTYPE_DEFAULT_FLOAT);
  const int64_t *sizes;
  int n;
  if (size_arg(a, 0, dt, &sizes, &n, e)) return -1;
  return ops__push_fresh(a, out, dt, sizes, n, e);
}

int ops__rule_full(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  /* Like torch.full: without a dtype the fill value's kind decides. */
  value_kind_t k = a->v[1].kind;
  dtype_t dt = dtype_or(a, 2, k == VAL_BOOL  ? DTYPE_BOOL
                              : k == VAL_INT ? DTYPE_INT64
                                             : DTYPE_DEFAULT_FLOAT);
  const int64_t *sizes;
  int n;
  if (size_arg(a, 0, dt, &sizes, &n, e) || ops__scalar_fits_arg(a, 1, dt, e)) return -1;
  return ops__push_fresh(a, out, dt, sizes, n, e);
}

/* A Scalar as an int64 the way c10 converts it (truncating a float); false when
 * it does not fit. */
static bool to_int64(const op_value_t *v, int64_t *out) {
  if (v->kind == VAL_INT) *out = v->i;
  else if (v->kind == VAL_BOOL) *out = v->b;
  else if (isnan(v->f) || v->f < -9223372036854775808.0 || v->f >= 9223372036854775808.0) return false;
  else *out = (int64_t)v->f;
  return true;
}

/* ceil((end - start) / step) without libm (meshd_tensor does not link it). */
static double ceil_(double start, double end, double step) {
  double q = (end - start) / step;
  if (!(q > -9.2e18 && q < 9.2e18)) return q; /* huge values are integers already */
  double t = (double)(int64_t)q;
  return t < q ? t + 1 : t;
}

int ops__rule_arange(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  /* arange(end) counts from 0, as Python's range does. */
  op_value_t zero = {.kind = VAL_INT, .i = 0};
  const op_value_t *start = &a->v[0], *end = &a->v[1], *step = &a->v[2];
  int start_p = 0, end_p = 1;
  if (end->kind == VAL_NONE) {
    end = start, end_p = 0;
    start = &zero;
  }
  bool integral = start->kind != VAL_FLOAT && end->kind != VAL_FLOAT && step->kind != VAL_FLOAT;
  dtype_t dt = dtype_or(a, 3, integral ? DTYPE_INT64 : DTYPE_DEFAULT_FLOAT);
  if (dt == DTYPE_BOOL)
    return error_set(e, ERR_DTYPE_MISMATCH,
                     "%s: argument 'dtype' is bool, which arange does not support (use an "
                     "integer or floating dtype)",
                     OPN(a));
  double ds = start->kind == VAL_INT ? (double)start->i : start->kind == VAL_BOOL ? start->b : start->f;
  double de = end->kind == VAL_INT ? (double)end->i : end->kind == VAL_BOOL ? end->b : end->f;
  double dst = step->kind == VAL_INT ? (double)step->i : step->kind == VAL_BOOL ? step->b : step->f;
  int64_t is = 0, ie = 0, ist = 0;
  if (!dtype_is_floating(dt)) {
    /* Integer dtypes check the truncated bounds, as torch's int accumulator does. */
    const op_value_t *vals[3] = {start, end, step};
    int64_t *dst_i[3] = {&is, &ie, &ist};
    int params[3] = {start_p, end_p, 2};
    for (int k = 0; k < 3; k++)
      if (!to_int64(vals[k], dst_i[k]))
        return error_set(e, ERR_BAD_ARGUMENT,
                         "%s: argument '%s' (%g) can't be converted to int64 without overflow",
                         OPN(a), PN(a, params[k]),
                         vals[k]->kind == VAL_FLOAT ? vals[k]->f : 0.0);
  }
  bool fl = dtype_is_floating(dt);
  double xs = fl ? ds : (double)is, xe = fl ? de : (double)ie, xst = fl ? dst : (double)ist;
  if (xst == 0 || isnan(xst))
    return error_set(e, ERR_BAD_ARGUMENT, "%s: argument 'step' must be nonzero", OPN(a));
  if (!isfinite(xs) || !isfinite(xe) || !isfinite(xst))
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: unsupported range: arguments 'start' (%g), 'end' (%g) and 'step' (%g) "
                     "must be finite",
                     OPN(a), xs, xe, xst);
  if ((xst > 0 && xe < xs) || (xst < 0 && xe > xs))
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: argument 'step' (%g) has the wrong sign to go from start %g to end %g",
                     OPN(a), xst, xs, xe);
  int64_t len;
  if (dt == DTYPE_INT64) {
    __int128 sgn = ist > 0 ? 1 : -1;
    __int128 n = ((__int128)ie - is + ist - sgn) / ist;
    if (n > INT64_MAX)
      return error_set(e, ERR_BAD_ARGUMENT, "%s: the range has too many elements", OPN(a));
    len = (int64_t)n;
  } else {
    double n = ceil_(ds, de, dst);
    if (!(n >= 0) || n >= 9223372036854775808.0)
      return error_set(e, ERR_BAD_ARGUMENT, "%s: the range has too many elements", OPN(a));
    len = (int64_t)n;
  }
  return ops__push_fresh(a, out, dt, &len, 1, e);
}

int ops__rule_rand(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  dtype_t dt = dtype_or(a, 1, DTYPE_DEFAULT_FLOAT);
  if (!dtype_is_floating(dt))
    return error_set(e, ERR_DTYPE_MISMATCH,
                     "%s: argument 'dtype' must be a floating dtype (float32, float64, float16 or "
                     "bfloat16), got %s",
                     OPN(a), dtype_name(dt));
  const int64_t *sizes;
  int n;
  if (size_arg(a, 0, dt, &sizes, &n, e)) return -1;
  return ops__push_fresh(a, out, dt, sizes, n, e);
}

int ops__rule_rank(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const char *dim = arg_str(a, 0);
  if (!dim || !dim[0])
    return error_set(e, ERR_BAD_ARGUMENT, "%s: argument 'dim' must name a dim of the mesh, got ''",
                     OPN(a));
  return ops__push_fresh(a, out, DTYPE_INT64, NULL, 0, e);
}

int ops__rule_fill_(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *v = arg_tensor(a, 1);
  if (v && v->layout.ndim != 0) {
    char buf[LAYOUT_SHAPE_BUF];
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: argument '%s' must be a Scalar or a 0-dim tensor, got a tensor of shape "
                     "%s",
                     OPN(a), PN(a, 1), ops__shape_str(v, buf));
  }
  /* Filling is idempotent, so an expanded self is fine (torch agrees). */
  if (!v && ops__scalar_fits_arg(a, 1, arg_tensor(a, 0)->dtype, e)) return -1;
  ops__push_inplace(out, a, 0);
  return 0;
}

int ops__rule_zero_(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  ops__push_inplace(out, a, 0);
  return 0;
}
