/* Elementwise ops: binary (with broadcasting and Python-scalar promotion),
 * unary, where, clamp, and their in-place forms. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "ops_internal.h"

/* "int32 tensor", "float scalar" */
static const char *operand_desc(const op_value_t *v, char *buf, size_t n) {
  switch (v->kind) {
  case VAL_TENSOR: snprintf(buf, n, "%s tensor", dtype_name(v->tensor->dtype)); break;
  case VAL_INT: snprintf(buf, n, "int scalar"); break;
  case VAL_FLOAT: snprintf(buf, n, "float scalar"); break;
  case VAL_BOOL: snprintf(buf, n, "bool scalar"); break;
  default: snprintf(buf, n, "None"); break;
  }
  return buf;
}

static bool is_bool_operand(const op_value_t *v) {
  return (v->kind == VAL_TENSOR && v->tensor->dtype == DTYPE_BOOL) || v->kind == VAL_BOOL;
}

/* The message of a broadcast that failed at params[upto], against `shape`,
 * the broadcast of the tensors before it: named only now, as formatting the
 * names for every call cost more than the broadcast. */
static int broadcast_error(const op_args_t *a, const int *params, int upto, const int64_t *shape,
                           int nd, meshd_error_t *e) {
  char names[4 * OP_NAME_MAX] = "", label[5 * OP_NAME_MAX];
  int joined = 0;
  for (int k = 0; k < upto; k++) {
    if (!arg_tensor(a, params[k])) continue;
    size_t len = strlen(names);
    snprintf(names + len, sizeof names - len, "%s%s", joined ? " and " : "", PN(a, params[k]));
    joined++;
  }
  if (joined > 1) snprintf(label, sizeof label, "the broadcast of %s", names);
  else snprintf(label, sizeof label, "%s", names);
  const tensor_meta_t *t = arg_tensor(a, params[upto]);
  int64_t out[LAYOUT_MAX_DIMS];
  int nout;
  layout_broadcast(OPN(a), label, shape, nd, PN(a, params[upto]), t->layout.sizes, t->layout.ndim,
                   out, &nout, e);
  return -1;
}

/* Broadcasts the tensors among params[0..n) (scalars and None take no part). */
static int broadcast_params(const op_args_t *a, const int *params, int n, int64_t *shape, int *nd,
                            meshd_error_t *e) {
  *nd = -1;
  for (int k = 0; k < n; k++) {
    const tensor_meta_t *t = arg_tensor(a, params[k]);
    if (!t) continue;
    if (*nd >= 0) {
      if (layout_broadcast(NULL, "", shape, *nd, "", t->layout.sizes, t->layout.ndim, shape, nd,
                           e))
        return broadcast_error(a, params, k, shape, *nd, e);
    } else {
      *nd = t->layout.ndim;
      memcpy(shape, t->layout.sizes, sizeof(int64_t) * (size_t)t->layout.ndim);
    }
  }
  if (*nd < 0) *nd = 0;
  return 0;
}

static int finish(const op_args_t *a, op_infer_t *out, dtype_t dt, const int64_t *shape, int nd,
                  meshd_error_t *e) {
  if (!a->op->is_inplace) return ops__push_fresh(a, out, dt, shape, nd, e);
  if (ops__check_inplace(a, 0, dt, shape, nd, e)) return -1;
  ops__push_inplace(out, a, 0);
  return 0;
}

int ops__rule_binary(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const op_value_t *vals[2] = {&a->v[0], &a->v[1]};
  dtype_t rt = ops_result_type(vals, 2), dt = rt;
  int64_t shape[LAYOUT_MAX_DIMS];
  int nd;
  static const int params[2] = {0, 1};
  if (broadcast_params(a, params, 2, shape, &nd, e)) return -1;
  char d0[48], d1[48];
  switch (a->op->variant) {
  case BIN_SUB:
    if (is_bool_operand(vals[0]) || is_bool_operand(vals[1]))
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: subtraction with a bool operand is not supported (self is %s, %s is "
                       "%s); use logical_xor or logical_not instead",
                       OPN(a), operand_desc(vals[0], d0, sizeof d0), PN(a, 1),
                       operand_desc(vals[1], d1, sizeof d1));
    /* fall through */
  case BIN_ADD:
    if (a->v[2].kind == VAL_BOOL && rt != DTYPE_BOOL)
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: argument 'alpha' is a bool, which is only allowed when the result is "
                       "bool (here %s)",
                       OPN(a), dtype_name(rt));
    if (a->v[2].kind == VAL_FLOAT && !dtype_is_floating(rt))
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: argument 'alpha' is a float, which is not allowed when the result is "
                       "integral (here %s)",
                       OPN(a), dtype_name(rt));
    break;
  case BIN_DIV: {
    const char *mode = arg_str(a, 2);
    if (!mode) {
      if (!dtype_is_floating(rt)) dt = DTYPE_DEFAULT_FLOAT; /* true division */
    } else if (strcmp(mode, "trunc") == 0 || strcmp(mode, "floor") == 0) {
      if (rt == DTYPE_BOOL)
        return error_set(e, ERR_DTYPE_MISMATCH,
                         "%s: argument 'rounding_mode' '%s' is not supported for bool operands",
                         OPN(a), mode);
    } else {
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: argument 'rounding_mode' must be None, 'trunc' or 'floor', got '%s'",
                       OPN(a), mode);
    }
    break;
  }
  case BIN_POW:
    if (dtype_is_integral(vals[0]->tensor->dtype, true) && vals[1]->kind == VAL_INT &&
        vals[1]->i < 0)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: argument 'exponent' is %" PRId64 ", but integers can't be raised to "
                       "negative integer powers (self is %s)",
                       OPN(a), vals[1]->i, dtype_name(vals[0]->tensor->dtype));
    if (rt == DTYPE_BOOL)
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: not supported when both self and exponent are bool", OPN(a));
    break;
  case BIN_COMPARE:
  case BIN_LOGICAL: dt = DTYPE_BOOL; break;
  case BIN_BITWISE:
    if (!dtype_is_integral(rt, true))
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: only integer and bool dtypes are supported, but self is %s and %s is "
                       "%s (result type %s)",
                       OPN(a), operand_desc(vals[0], d0, sizeof d0), PN(a, 1),
                       operand_desc(vals[1], d1, sizeof d1), dtype_name(rt));
    break;
  default: break;
  }
  return finish(a, out, dt, shape, nd, e);
}

int ops__rule_unary(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  dtype_t dt = t->dtype;
  switch (a->op->variant) {
  case UN_NEG:
  case UN_ABS:
  case UN_RELU:
    if (dt == DTYPE_BOOL)
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: argument 'self' is a bool tensor, which %s does not support%s", OPN(a),
                       OPN(a),
                       a->op->variant == UN_NEG ? " (to invert a mask use logical_not)" : "");
    break;
  case UN_TO_FLOAT:
    if (!dtype_is_floating(dt)) dt = DTYPE_DEFAULT_FLOAT;
    break;
  case UN_FLOAT_ONLY: {
    if (!dtype_is_floating(dt))
      return error_set(e, ERR_DTYPE_MISMATCH,
                       "%s: argument 'self' must have a floating dtype, got %s (cast it with to())",
                       OPN(a), dtype_name(dt));
    const char *approx = a->op->nparams > 1 ? arg_str(a, 1) : NULL;
    if (approx && strcmp(approx, "none") != 0 && strcmp(approx, "tanh") != 0)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: argument 'approximate' must be 'none' or 'tanh', got '%s'", OPN(a),
                       approx);
    break;
  }
  case UN_LOGICAL_NOT: dt = DTYPE_BOOL; break;
  default: break;
  }
  return ops__push_fresh(a, out, dt, t->layout.sizes, t->layout.ndim, e);
}

int ops__rule_where(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *c = arg_tensor(a, 0);
  if (c->dtype != DTYPE_BOOL)
    return error_set(e, ERR_DTYPE_MISMATCH,
                     "%s: argument 'condition' must be a bool tensor, got %s (compare it, e.g. "
                     "ne(condition, 0))",
                     OPN(a), dtype_name(c->dtype));
  const op_value_t *vals[2] = {&a->v[1], &a->v[2]};
  static const int params[3] = {0, 1, 2};
  int64_t shape[LAYOUT_MAX_DIMS];
  int nd;
  if (broadcast_params(a, params, 3, shape, &nd, e)) return -1;
  return ops__push_fresh(a, out, ops_result_type(vals, 2), shape, nd, e);
}

int ops__rule_clamp(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  if (arg_none(a, 1) && arg_none(a, 2))
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: at least one of arguments 'min' and 'max' must be given", OPN(a));
  const op_value_t *vals[3] = {&a->v[0], &a->v[1], &a->v[2]};
  dtype_t rt = ops_result_type(vals, 3);
  if (rt == DTYPE_BOOL)
    return error_set(e, ERR_DTYPE_MISMATCH,
                     "%s: bool is not supported (self and the bounds are all bool)", OPN(a));
  static const int params[3] = {0, 1, 2};
  int64_t shape[LAYOUT_MAX_DIMS];
  int nd;
  if (broadcast_params(a, params, 3, shape, &nd, e)) return -1;
  return finish(a, out, rt, shape, nd, e);
}

int ops__rule_copy_(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  static const int params[2] = {0, 1};
  int64_t shape[LAYOUT_MAX_DIMS];
  int nd;
  if (broadcast_params(a, params, 2, shape, &nd, e)) return -1;
  /* copy_ casts to self's dtype whatever the source's. */
  return finish(a, out, arg_tensor(a, 0)->dtype, shape, nd, e);
}
