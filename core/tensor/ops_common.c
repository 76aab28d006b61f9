/* Helpers the rules share: reading arguments, dims, scalar range checks, type
 * promotion and producing results. */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>

#include "ops_internal.h"

const char *ops__shape_str(const tensor_meta_t *t, char *buf) {
  return layout_format_shape(t->layout.sizes, t->layout.ndim, buf, LAYOUT_SHAPE_BUF);
}

const char *ops__arg_ctx(const op_args_t *a, int i, char *buf, size_t n) {
  snprintf(buf, n, "%s: argument '%s'", OPN(a), PN(a, i));
  return buf;
}

int ops__wrap_dim_arg(const op_args_t *a, int param, int64_t dim, int ndim, bool wrap_scalar,
                      int64_t *out, meshd_error_t *e) {
  char ctx[3 * OP_NAME_MAX];
  return layout_wrap_dim(ops__arg_ctx(a, param, ctx, sizeof ctx), dim, ndim, wrap_scalar, out, e);
}

int ops__dims_to_mask(const op_args_t *a, int param, const int64_t *dims, size_t n, int ndim,
                      bool wrap_scalar, uint32_t *mask, meshd_error_t *e) {
  *mask = 0;
  for (size_t k = 0; k < n; k++) {
    int64_t d;
    if (ops__wrap_dim_arg(a, param, dims[k], ndim, wrap_scalar, &d, e)) return -1;
    if (*mask & (1u << d))
      return error_set(e, ERR_BAD_DIM,
                       "%s: argument '%s': dim %" PRId64 " appears more than once in the list",
                       OPN(a), PN(a, param), d);
    *mask |= 1u << d;
  }
  return 0;
}

/* c10::overflows for a Scalar converted to dt. */
static bool int_overflows(int64_t v, dtype_t dt) {
  switch (dt) {
  case DTYPE_BOOL: return v > 1 || v < -1; /* unsigned targets let negatives wrap once */
  case DTYPE_UINT8: return v > UINT8_MAX || v < -(int64_t)UINT8_MAX;
  case DTYPE_INT8: return v > INT8_MAX || v < INT8_MIN;
  case DTYPE_INT16: return v > INT16_MAX || v < INT16_MIN;
  case DTYPE_INT32: return v > INT32_MAX || v < INT32_MIN;
  case DTYPE_FLOAT16: return v > 65504 || v < -65504;
  default: return false;
  }
}

static bool float_overflows(double v, dtype_t dt) {
  double lo, hi;
  switch (dt) {
  case DTYPE_FLOAT64: return false;
  case DTYPE_FLOAT32: lo = -FLT_MAX, hi = FLT_MAX; break;
  case DTYPE_FLOAT16: lo = -65504.0, hi = 65504.0; break;
  case DTYPE_BFLOAT16: lo = -3.3895313892515355e38, hi = 3.3895313892515355e38; break;
  case DTYPE_BOOL: lo = 0, hi = 1; break;
  case DTYPE_UINT8: lo = 0, hi = UINT8_MAX; break;
  case DTYPE_INT8: lo = INT8_MIN, hi = INT8_MAX; break;
  case DTYPE_INT16: lo = INT16_MIN, hi = INT16_MAX; break;
  case DTYPE_INT32: lo = INT32_MIN, hi = INT32_MAX; break;
  default: lo = (double)INT64_MIN, hi = (double)INT64_MAX; break;
  }
  if (dtype_is_floating(dt)) {
    if (isinf(v) || isnan(v)) return false;
  } else if (isnan(v)) {
    return true;
  }
  return v < lo || v > hi;
}

int ops__scalar_fits_arg(const op_args_t *a, int param, dtype_t dt, meshd_error_t *e) {
  const op_value_t *v = &a->v[param];
  bool over = v->kind == VAL_INT ? int_overflows(v->i, dt)
              : v->kind == VAL_FLOAT ? float_overflows(v->f, dt)
                                     : false;
  if (!over) return 0;
  char val[48];
  if (v->kind == VAL_INT) snprintf(val, sizeof val, "%" PRId64, v->i);
  else snprintf(val, sizeof val, "%g", v->f);
  return error_set(e, ERR_BAD_ARGUMENT,
                   "%s: argument '%s' (%s) can't be converted to %s without overflow", OPN(a),
                   PN(a, param), val, dtype_name(dt));
}

/* torch's ResultTypeState: one promoted dtype per priority tier. */
static dtype_t promote_skip(dtype_t a, dtype_t b) {
  if (a == DTYPE_INVALID) return b;
  if (b == DTYPE_INVALID) return a;
  return dtype_promote(a, b);
}

static dtype_t combine_categories(dtype_t higher, dtype_t lower) {
  if (dtype_is_floating(higher)) return higher;
  if (higher == DTYPE_BOOL || dtype_is_floating(lower)) return promote_skip(higher, lower);
  return higher != DTYPE_INVALID ? higher : lower;
}

dtype_t ops_result_type(const op_value_t *const *vals, size_t n) {
  dtype_t dim = DTYPE_INVALID, zero = DTYPE_INVALID, wrapped = DTYPE_INVALID;
  for (size_t i = 0; i < n; i++) {
    const op_value_t *v = vals[i];
    if (!v) continue;
    switch (v->kind) {
    case VAL_TENSOR:
      if (v->tensor->layout.ndim > 0) dim = promote_skip(dim, v->tensor->dtype);
      else zero = promote_skip(zero, v->tensor->dtype);
      break;
    case VAL_TENSORS:
      for (size_t k = 0; k < v->ntensors; k++) {
        const tensor_meta_t *t = v->tensors[k];
        if (t->layout.ndim > 0) dim = promote_skip(dim, t->dtype);
        else zero = promote_skip(zero, t->dtype);
      }
      break;
    case VAL_INT: wrapped = promote_skip(wrapped, DTYPE_INT64); break;
    case VAL_FLOAT: wrapped = promote_skip(wrapped, DTYPE_DEFAULT_FLOAT); break;
    case VAL_BOOL: wrapped = promote_skip(wrapped, DTYPE_BOOL); break;
    default: break;
    }
  }
  return combine_categories(dim, combine_categories(zero, wrapped));
}

int ops__push_fresh(const op_args_t *a, op_infer_t *out, dtype_t dt, const int64_t *sizes,
                    int ndim, meshd_error_t *e) {
  op_result_t *r = &out->results[out->nresults];
  if (layout_contiguous(&r->meta.layout, sizes, ndim, dtype_size(dt), NULL, e)) {
    char ctx[OP_NAME_MAX + 16]; /* again, for the message */
    snprintf(ctx, sizeof ctx, "%s: result", OPN(a));
    layout_contiguous(&r->meta.layout, sizes, ndim, dtype_size(dt), ctx, e);
    return -1;
  }
  r->meta.dtype = dt;
  r->alias_param = -1;
  out->nresults++;
  return 0;
}

void ops__push_view(op_infer_t *out, dtype_t dt, const layout_t *l, int alias_param) {
  op_result_t *r = &out->results[out->nresults++];
  r->meta.dtype = dt;
  r->meta.layout = *l;
  r->alias_param = alias_param;
}

void ops__push_inplace(op_infer_t *out, const op_args_t *a, int param) {
  const tensor_meta_t *t = arg_tensor(a, param);
  ops__push_view(out, t->dtype, &t->layout, param);
  out->mutates[out->nmutates++] = param;
}

int ops__check_no_overlap(const op_args_t *a, int param, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, param);
  if (!layout_has_internal_overlap(&t->layout)) return 0;
  char buf[LAYOUT_SHAPE_BUF];
  return error_set(e, ERR_BAD_ARGUMENT,
                   "%s: argument '%s' (shape %s) has several elements at one memory location "
                   "(an expanded view), so it can't be written in place; clone() it first",
                   OPN(a), PN(a, param), ops__shape_str(t, buf));
}

int ops__check_inplace(const op_args_t *a, int param, dtype_t result, const int64_t *shape,
                       int ndim, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, param);
  if (!dtype_can_cast(result, t->dtype))
    return error_set(e, ERR_DTYPE_MISMATCH,
                     "%s: result type %s can't be cast to the desired output type %s of "
                     "argument '%s'",
                     OPN(a), dtype_name(result), dtype_name(t->dtype), PN(a, param));
  bool same = ndim == t->layout.ndim;
  for (int i = 0; same && i < ndim; i++) same = shape[i] == t->layout.sizes[i];
  if (!same) {
    char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF];
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: argument '%s' has shape %s but the broadcast shape is %s; an in-place "
                     "op can't resize '%s'",
                     OPN(a), PN(a, param), ops__shape_str(t, b1),
                     layout_format_shape(shape, ndim, b2, sizeof b2), PN(a, param));
  }
  return ops__check_no_overlap(a, param, e);
}
