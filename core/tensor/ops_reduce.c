/* Reductions, softmax and matrix products. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "ops_internal.h"

/* The reduced dims as a mask; *all when every dim is reduced because none was named. */
static int reduce_mask(const op_args_t *a, const tensor_meta_t *t, uint32_t *mask, bool *all,
                       meshd_error_t *e) {
  const int64_t *dims;
  size_t n = 0;
  *all = arg_none(a, 1) || (op_value_ints(&a->v[1], &dims, &n) && n == 0);
  if (*all) {
    *mask = t->layout.ndim ? (uint32_t)((1ull << t->layout.ndim) - 1) : 1u;
    return 0;
  }
  if (n > LAYOUT_MAX_DIMS)
    return error_set(e, ERR_BAD_DIM, "%s: argument 'dim' names %zu dims; a tensor has at most %d",
                     OPN(a), n, LAYOUT_MAX_DIMS);
  return ops__dims_to_mask(a, 1, dims, n, t->layout.ndim, true, mask, e);
}

/* torch refuses max/amax/argmax over nothing: there is no identity to return. */
static int check_nonempty(const op_args_t *a, const tensor_meta_t *t, uint32_t mask, bool all,
                          meshd_error_t *e) {
  char buf[LAYOUT_SHAPE_BUF];
  if (all) {
    if (layout_numel(&t->layout) != 0) return 0;
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: argument 'self' has no elements (shape %s); name the dims to reduce "
                     "with argument 'dim'",
                     OPN(a), ops__shape_str(t, buf));
  }
  for (int d = 0; d < t->layout.ndim; d++)
    if ((mask & (1u << d)) && t->layout.sizes[d] == 0)
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "%s: argument 'dim': dim %d of self (shape %s) has size 0, and %s over an "
                       "empty dim has no value",
                       OPN(a), d, ops__shape_str(t, buf), OPN(a));
  return 0;
}

int ops__rule_reduce(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  int variant = a->op->variant;
  bool keepdim = arg_bool(a, 2), all;
  uint32_t mask;
  if (reduce_mask(a, t, &mask, &all, e)) return -1;
  dtype_t dt = t->dtype, given = a->op->nparams > 3 ? arg_dtype(a, 3) : DTYPE_INVALID;
  switch (variant) {
  case RED_SUM:
  case RED_PROD:
    if (variant == RED_PROD && all && keepdim)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: argument 'keepdim' needs argument 'dim' (prod reduces one named dim)",
                       OPN(a));
    dt = given ? given : dtype_is_integral(dt, true) ? DTYPE_INT64 : dt;
    break;
  case RED_MEAN:
    if (given && !dtype_is_floating(given))
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: argument 'dtype' must be a floating dtype, got %s", OPN(a),
                       dtype_name(given));
    if (!given && !dtype_is_floating(dt))
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: argument 'self' is %s, but mean needs a floating dtype (pass "
                       "dtype=float32 or cast self)",
                       OPN(a), dtype_name(dt));
    if (given) dt = given;
    break;
  case RED_MAXMIN:
    if (all && keepdim)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: argument 'keepdim' needs argument 'dim' (without it %s returns one "
                       "value)",
                       OPN(a), OPN(a));
    /* fall through */
  case RED_AMAXMIN:
    if (check_nonempty(a, t, mask, all, e)) return -1;
    break;
  case RED_ARG:
    if (dt == DTYPE_BOOL)
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: argument 'self' is a bool tensor, which %s does not support", OPN(a),
                       OPN(a));
    if (check_nonempty(a, t, mask, all, e)) return -1;
    dt = DTYPE_INT64;
    break;
  default: break;
  }
  int64_t shape[LAYOUT_MAX_DIMS];
  int nd = 0;
  for (int d = 0; d < t->layout.ndim; d++) {
    if (!(mask & (1u << d))) shape[nd++] = t->layout.sizes[d];
    else if (keepdim) shape[nd++] = 1;
  }
  if (ops__push_fresh(a, out, dt, shape, nd, e)) return -1;
  if (variant == RED_MAXMIN && !all) return ops__push_fresh(a, out, DTYPE_INT64, shape, nd, e);
  return 0;
}

int ops__rule_softmax(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  int64_t d;
  if (ops__wrap_dim_arg(a, 1, arg_int(a, 1), t->layout.ndim, true, &d, e)) return -1;
  dtype_t given = arg_dtype(a, 2), dt = given ? given : t->dtype;
  if (!dtype_is_floating(dt))
    return error_set(e, ERR_DTYPE_MISMATCH,
                     "%s: argument '%s' is %s, but %s needs a floating dtype (pass dtype=float32)",
                     OPN(a), given ? "dtype" : "self", dtype_name(dt), OPN(a));
  return ops__push_fresh(a, out, dt, t->layout.sizes, t->layout.ndim, e);
}

/* Matrix products take one dtype, as torch does (no promotion), and not bool. */
static int check_mat_dtypes(const op_args_t *a, const tensor_meta_t *x, const tensor_meta_t *y,
                            meshd_error_t *e) {
  if (x->dtype != y->dtype)
    return error_set(e, ERR_DTYPE_MISMATCH,
                     "%s: self is %s and %s is %s; both must have the same dtype (cast one with "
                     "to())",
                     OPN(a), dtype_name(x->dtype), PN(a, 1), dtype_name(y->dtype));
  if (x->dtype == DTYPE_BOOL)
    return error_set(e, ERR_DTYPE_MISMATCH, "%s: bool matrices are not supported (self and %s)",
                     OPN(a), PN(a, 1));
  return 0;
}

static int inner_mismatch(const op_args_t *a, const tensor_meta_t *x, const tensor_meta_t *y,
                          int64_t k1, int64_t k2, meshd_error_t *e) {
  char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF];
  return error_set(e, ERR_SHAPE_MISMATCH,
                   "%s: self is %s and %s is %s: inner dims %" PRId64 " and %" PRId64
                   " must match",
                   OPN(a), ops__shape_str(x, b1), PN(a, 1), ops__shape_str(y, b2), k1, k2);
}

static int need_ndim(const op_args_t *a, int param, int want, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, param);
  if (t->layout.ndim == want) return 0;
  char buf[LAYOUT_SHAPE_BUF];
  return error_set(e, ERR_SHAPE_MISMATCH, "%s: argument '%s' must be a %d-D tensor, got shape %s",
                   OPN(a), PN(a, param), want, ops__shape_str(t, buf));
}

int ops__rule_matmul(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *x = arg_tensor(a, 0), *y = arg_tensor(a, 1);
  int n1 = x->layout.ndim, n2 = y->layout.ndim;
  const int64_t *s1 = x->layout.sizes, *s2 = y->layout.sizes;
  if (n1 == 0 || n2 == 0)
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: both arguments must be at least 1-D, but self is %d-D and other is "
                     "%d-D",
                     OPN(a), n1, n2);
  if (check_mat_dtypes(a, x, y, e)) return -1;
  /* A 1-D self is a row [1, k], a 1-D other a column [k, 1]; those dims vanish. */
  int64_t k1 = s1[n1 - 1], k2 = n2 > 1 ? s2[n2 - 2] : s2[0];
  if (k1 != k2) return inner_mismatch(a, x, y, k1, k2, e);
  int64_t shape[LAYOUT_MAX_DIMS];
  int nd;
  int b1 = n1 > 2 ? n1 - 2 : 0, b2 = n2 > 2 ? n2 - 2 : 0;
  if (layout_broadcast(OPN(a), "the batch dims of self", s1, b1, "the batch dims of other", s2,
                       b2, shape, &nd, e))
    return -1;
  if (n1 > 1) shape[nd++] = s1[n1 - 2];
  if (n2 > 1) shape[nd++] = s2[n2 - 1];
  return ops__push_fresh(a, out, x->dtype, shape, nd, e);
}

int ops__rule_mm(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  if (need_ndim(a, 0, 2, e) || need_ndim(a, 1, 2, e)) return -1;
  const tensor_meta_t *x = arg_tensor(a, 0), *y = arg_tensor(a, 1);
  if (check_mat_dtypes(a, x, y, e)) return -1;
  if (x->layout.sizes[1] != y->layout.sizes[0])
    return inner_mismatch(a, x, y, x->layout.sizes[1], y->layout.sizes[0], e);
  int64_t shape[2] = {x->layout.sizes[0], y->layout.sizes[1]};
  return ops__push_fresh(a, out, x->dtype, shape, 2, e);
}

int ops__rule_bmm(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  if (need_ndim(a, 0, 3, e) || need_ndim(a, 1, 3, e)) return -1;
  const tensor_meta_t *x = arg_tensor(a, 0), *y = arg_tensor(a, 1);
  if (check_mat_dtypes(a, x, y, e)) return -1;
  if (x->layout.sizes[0] != y->layout.sizes[0]) {
    char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF];
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: self is %s and mat2 is %s: batch sizes %" PRId64 " and %" PRId64
                     " must match (bmm does not broadcast; use matmul)",
                     OPN(a), ops__shape_str(x, b1), ops__shape_str(y, b2), x->layout.sizes[0],
                     y->layout.sizes[0]);
  }
  if (x->layout.sizes[2] != y->layout.sizes[1])
    return inner_mismatch(a, x, y, x->layout.sizes[2], y->layout.sizes[1], e);
  int64_t shape[3] = {x->layout.sizes[0], x->layout.sizes[1], y->layout.sizes[2]};
  return ops__push_fresh(a, out, x->dtype, shape, 3, e);
}
