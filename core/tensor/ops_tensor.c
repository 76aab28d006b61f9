/* Copies, casts, joins (cat, stack) and indexing. */
#include <inttypes.h>
#include <stdio.h>

#include "ops_internal.h"

int ops__rule_clone(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  return ops__push_fresh(a, out, t->dtype, t->layout.sizes, t->layout.ndim, e);
}

int ops__rule_to(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  dtype_t dt = arg_dtype(a, 1);
  /* to() returns self itself when nothing changes and no copy was asked for. */
  if (a->op->variant == TO_TO && dt == t->dtype && !arg_bool(a, 3)) {
    ops__push_view(out, t->dtype, &t->layout, 0);
    return 0;
  }
  return ops__push_fresh(a, out, dt, t->layout.sizes, t->layout.ndim, e);
}

static const tensor_meta_t *list_at(const op_args_t *a, size_t i) { return a->v[0].tensors[i]; }

static int nonempty_list(const op_args_t *a, meshd_error_t *e) {
  if (a->v[0].ntensors) return 0;
  return error_set(e, ERR_BAD_ARGUMENT, "%s: argument 'tensors' must be a non-empty list",
                   OPN(a));
}

/* A 1-D tensor with no elements: torch's cat ignores it, for legacy code. */
static bool cat_skipped(const tensor_meta_t *t) {
  return t->layout.ndim == 1 && t->layout.sizes[0] == 0;
}

int ops__rule_cat(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  if (nonempty_list(a, e)) return -1;
  size_t n = a->v[0].ntensors;
  const op_value_t *vals[1] = {&a->v[0]};
  dtype_t dt = ops_result_type(vals, 1);
  char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF];
  for (size_t i = 0; i < n; i++)
    if (list_at(a, i)->layout.ndim == 0)
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "%s: argument 'tensors': entry %zu is 0-dim and can't be concatenated "
                       "(unsqueeze it or use stack)",
                       OPN(a), i);
  const tensor_meta_t *ref = NULL;
  size_t ref_i = 0;
  for (size_t i = 0; i < n && !ref; i++)
    if (!cat_skipped(list_at(a, i))) ref = list_at(a, i), ref_i = i;
  if (!ref) { /* all empty 1-D: the result is one too */
    int64_t zero = 0;
    return ops__push_fresh(a, out, dt, &zero, 1, e);
  }
  int64_t d;
  if (ops__wrap_dim_arg(a, 1, arg_int(a, 1), ref->layout.ndim, false, &d, e)) return -1;
  int64_t shape[LAYOUT_MAX_DIMS], total = 0;
  int nd = ref->layout.ndim;
  for (int k = 0; k < nd; k++) shape[k] = ref->layout.sizes[k];
  for (size_t i = 0; i < n; i++) {
    const tensor_meta_t *t = list_at(a, i);
    if (cat_skipped(t)) continue;
    if (t->layout.ndim != nd)
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "%s: argument 'tensors': entries must have the same number of dims, but "
                       "entry %zu is %s and entry %zu is %s",
                       OPN(a), ref_i, ops__shape_str(ref, b1), i, ops__shape_str(t, b2));
    for (int k = 0; k < nd; k++)
      if (k != d && t->layout.sizes[k] != shape[k])
        return error_set(e, ERR_SHAPE_MISMATCH,
                         "%s: argument 'tensors': sizes must match except in dim %" PRId64
                         ", but entry %zu is %s and entry %zu is %s (dim %d)",
                         OPN(a), d, ref_i, ops__shape_str(ref, b1), i, ops__shape_str(t, b2), k);
    if (__builtin_add_overflow(total, t->layout.sizes[d], &total))
      return error_set(e, ERR_BAD_ARGUMENT, "%s: the result is too large", OPN(a));
  }
  shape[d] = total;
  return ops__push_fresh(a, out, dt, shape, nd, e);
}

int ops__rule_stack(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  if (nonempty_list(a, e)) return -1;
  size_t n = a->v[0].ntensors;
  const tensor_meta_t *first = list_at(a, 0);
  int nd = first->layout.ndim;
  int64_t d;
  if (ops__wrap_dim_arg(a, 1, arg_int(a, 1), nd + 1, false, &d, e)) return -1;
  char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF];
  for (size_t i = 1; i < n; i++)
    if (!layout_same_shape(&first->layout, &list_at(a, i)->layout))
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "%s: argument 'tensors': every entry must have the same shape, but entry "
                       "0 is %s and entry %zu is %s",
                       OPN(a), ops__shape_str(first, b1), i, ops__shape_str(list_at(a, i), b2));
  if (nd + 1 > LAYOUT_MAX_DIMS)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: argument 'tensors': entries have %d dims, so the result would have "
                     "more than %d",
                     OPN(a), nd, LAYOUT_MAX_DIMS);
  if ((int64_t)n > INT64_MAX / 2)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: too many tensors", OPN(a));
  int64_t shape[LAYOUT_MAX_DIMS];
  for (int k = 0, j = 0; k <= nd; k++) shape[k] = k == d ? (int64_t)n : first->layout.sizes[j++];
  const op_value_t *vals[1] = {&a->v[0]};
  return ops__push_fresh(a, out, ops_result_type(vals, 1), shape, nd + 1, e);
}

int ops__rule_index_select(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0), *idx = arg_tensor(a, 2);
  char buf[LAYOUT_SHAPE_BUF];
  int64_t d;
  if (ops__wrap_dim_arg(a, 1, arg_int(a, 1), t->layout.ndim, true, &d, e)) return -1;
  if (idx->dtype != DTYPE_INT64 && idx->dtype != DTYPE_INT32)
    return error_set(e, ERR_DTYPE_MISMATCH,
                     "%s: argument 'index' must be an int64 or int32 tensor, got %s", OPN(a),
                     dtype_name(idx->dtype));
  if (idx->layout.ndim > 1)
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: argument 'index' must be 1-D (or 0-D), got shape %s", OPN(a),
                     ops__shape_str(idx, buf));
  int64_t count = layout_numel(&idx->layout);
  if (t->layout.ndim == 0) {
    if (count != 1)
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "%s: argument 'index' must hold exactly one index for a 0-dim self, got "
                       "%" PRId64,
                       OPN(a), count);
    return ops__push_fresh(a, out, t->dtype, NULL, 0, e);
  }
  int64_t shape[LAYOUT_MAX_DIMS];
  for (int k = 0; k < t->layout.ndim; k++) shape[k] = k == d ? count : t->layout.sizes[k];
  return ops__push_fresh(a, out, t->dtype, shape, t->layout.ndim, e);
}

int ops__rule_gather(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0), *idx = arg_tensor(a, 2);
  int64_t d;
  if (ops__wrap_dim_arg(a, 1, arg_int(a, 1), t->layout.ndim, true, &d, e)) return -1;
  /* Like torch, an empty index is not checked further: the result is empty. */
  if (layout_numel(&idx->layout) != 0) {
    char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF];
    if (idx->dtype != DTYPE_INT64)
      return error_set(e, ERR_DTYPE_MISMATCH, "%s: argument 'index' must be an int64 tensor, got %s",
                       OPN(a), dtype_name(idx->dtype));
    int nt = t->layout.ndim ? t->layout.ndim : 1, ni = idx->layout.ndim ? idx->layout.ndim : 1;
    if (nt != ni)
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "%s: argument 'index' (shape %s) must have as many dims as self (shape %s)",
                       OPN(a), ops__shape_str(idx, b1), ops__shape_str(t, b2));
    for (int k = 0; k < idx->layout.ndim && t->layout.ndim; k++)
      if (k != d && idx->layout.sizes[k] > t->layout.sizes[k])
        return error_set(e, ERR_SHAPE_MISMATCH,
                         "%s: argument 'index' (shape %s) is larger than self (shape %s) at dim "
                         "%d; only dim %" PRId64 " may be larger",
                         OPN(a), ops__shape_str(idx, b1), ops__shape_str(t, b2), k, d);
  }
  return ops__push_fresh(a, out, t->dtype, idx->layout.sizes, idx->layout.ndim, e);
}
