/* Views: results that share self's storage, with torch's exact strides and
 * offsets. reshape and contiguous view when they can and copy otherwise. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "ops_internal.h"

static int too_many_dims(const op_args_t *a, int param, size_t n, meshd_error_t *e) {
  return error_set(e, ERR_BAD_ARGUMENT,
                   "%s: argument '%s' has %zu entries, but a tensor has at most %d dims", OPN(a),
                   PN(a, param), n, LAYOUT_MAX_DIMS);
}

/* torch's infer_size: resolves one -1 so that the shape holds numel elements. */
static int infer_size(const op_args_t *a, int param, const tensor_meta_t *t, int64_t *res,
                      int *nres, meshd_error_t *e) {
  const int64_t *shape;
  size_t n;
  op_value_ints(&a->v[param], &shape, &n);
  if (n > LAYOUT_MAX_DIMS) return too_many_dims(a, param, n, e);
  int64_t numel = layout_numel(&t->layout), newsize = 1;
  int infer = -1;
  bool overflow = false, zero = false;
  for (size_t i = 0; i < n; i++) {
    res[i] = shape[i];
    if (shape[i] == -1) {
      if (infer >= 0)
        return error_set(e, ERR_BAD_ARGUMENT,
                         "%s: argument '%s': only one dim can be -1 (inferred), but dims %d and "
                         "%zu are",
                         OPN(a), PN(a, param), infer, i);
      infer = (int)i;
    } else if (shape[i] < 0) {
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: argument '%s': invalid size %" PRId64 " at dim %zu (sizes are >= 0, "
                       "or -1 to infer one)",
                       OPN(a), PN(a, param), shape[i], i);
    } else if (shape[i] == 0) {
      zero = true;
    } else if (!overflow) {
      overflow = __builtin_mul_overflow(newsize, shape[i], &newsize);
    }
  }
  if (zero) newsize = 0, overflow = false;
  *nres = (int)n;
  char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF];
  if (!overflow && (numel == newsize || (infer >= 0 && newsize > 0 && numel % newsize == 0))) {
    if (infer >= 0 && newsize == 0)
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "%s: argument '%s': can't infer the -1 in %s for a tensor of 0 elements "
                       "(any size would do)",
                       OPN(a), PN(a, param), layout_format_shape(shape, (int)n, b1, sizeof b1));
    if (infer >= 0) res[infer] = numel / newsize;
    /* An empty tensor takes any shape with a 0 in it: its strides must fit all
     * the same (the other sizes' product can overflow). */
    char ctx[96];
    snprintf(ctx, sizeof ctx, "%s: argument '%s'", OPN(a), PN(a, param));
    return layout_check_shape(ctx, res, (int64_t)n, dtype_size(t->dtype), e);
  }
  return error_set(e, ERR_SHAPE_MISMATCH,
                   "%s: argument '%s': shape %s is invalid for self of shape %s (%" PRId64
                   " elements)",
                   OPN(a), PN(a, param), layout_format_shape(shape, (int)n, b1, sizeof b1),
                   ops__shape_str(t, b2), numel);
}

/* torch's computeStride: strides viewing `old` as `shape`, or false when some
 * new dim would span two non-contiguous chunks of old. */
static bool compute_stride(const layout_t *old, const int64_t *shape, int n, int64_t *stride) {
  if (old->ndim == 0) {
    for (int i = 0; i < n; i++) stride[i] = 1;
    return true;
  }
  int64_t numel = layout_numel(old);
  if (numel == 0) {
    bool same = n == old->ndim;
    for (int i = 0; same && i < n; i++) same = shape[i] == old->sizes[i];
    if (same) {
      memcpy(stride, old->strides, sizeof(int64_t) * (size_t)n);
      return true;
    }
    for (int d = n - 1; d >= 0; d--)
      stride[d] = d == n - 1 ? 1 : (shape[d + 1] > 1 ? shape[d + 1] : 1) * stride[d + 1];
    return true;
  }
  int view_d = n - 1;
  int64_t chunk_base_stride = old->strides[old->ndim - 1], tensor_numel = 1, view_numel = 1;
  for (int td = old->ndim - 1; td >= 0; td--) {
    tensor_numel *= old->sizes[td];
    if (td == 0 ||
        (old->sizes[td - 1] != 1 && old->strides[td - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        stride[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return false;
      if (td > 0) {
        chunk_base_stride = old->strides[td - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

int ops__rule_view(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  layout_t l = t->layout;
  if (infer_size(a, 1, t, l.sizes, &l.ndim, e)) return -1;
  if (!compute_stride(&t->layout, l.sizes, l.ndim, l.strides)) {
    char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF], b3[LAYOUT_SHAPE_BUF];
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: argument 'size' %s is not compatible with self's shape %s and strides "
                     "%s (a new dim would span non-contiguous memory); use reshape(...) instead",
                     OPN(a), layout_format_shape(l.sizes, l.ndim, b1, sizeof b1),
                     ops__shape_str(t, b2),
                     layout_format_shape(t->layout.strides, t->layout.ndim, b3, sizeof b3));
  }
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_reshape(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  layout_t l = t->layout;
  if (infer_size(a, 1, t, l.sizes, &l.ndim, e)) return -1;
  if (compute_stride(&t->layout, l.sizes, l.ndim, l.strides)) {
    ops__push_view(out, t->dtype, &l, 0);
    return 0;
  }
  return ops__push_fresh(a, out, t->dtype, l.sizes, l.ndim, e);
}

int ops__rule_transpose(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  layout_t l = t->layout;
  int64_t d0, d1;
  if (ops__wrap_dim_arg(a, 1, arg_int(a, 1), l.ndim, true, &d0, e) ||
      ops__wrap_dim_arg(a, 2, arg_int(a, 2), l.ndim, true, &d1, e))
    return -1;
  if (l.ndim > 0) {
    int64_t s = l.sizes[d0], st = l.strides[d0];
    l.sizes[d0] = l.sizes[d1], l.strides[d0] = l.strides[d1];
    l.sizes[d1] = s, l.strides[d1] = st;
  }
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_t(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  layout_t l = t->layout;
  if (l.ndim > 2) {
    char buf[LAYOUT_SHAPE_BUF];
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: argument 'self' must have at most 2 dims, got shape %s (use transpose "
                     "or permute)",
                     OPN(a), ops__shape_str(t, buf));
  }
  if (l.ndim == 2) {
    int64_t s = l.sizes[0], st = l.strides[0];
    l.sizes[0] = l.sizes[1], l.strides[0] = l.strides[1];
    l.sizes[1] = s, l.strides[1] = st;
  }
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_permute(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  const int64_t *dims;
  size_t n;
  op_value_ints(&a->v[1], &dims, &n);
  if (n != (size_t)t->layout.ndim) {
    char buf[LAYOUT_SHAPE_BUF];
    return error_set(e, ERR_BAD_DIM,
                     "%s: argument 'dims' has %zu entries but self (shape %s) has %d dims; name "
                     "each dim once",
                     OPN(a), n, ops__shape_str(t, buf), t->layout.ndim);
  }
  uint32_t mask;
  if (ops__dims_to_mask(a, 1, dims, n, t->layout.ndim, false, &mask, e)) return -1;
  layout_t l = t->layout;
  for (size_t i = 0; i < n; i++) {
    int64_t d = dims[i] < 0 ? dims[i] + l.ndim : dims[i];
    l.sizes[i] = t->layout.sizes[d];
    l.strides[i] = t->layout.strides[d];
  }
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

static int need_dims(const op_args_t *a, const tensor_meta_t *t, meshd_error_t *e) {
  if (t->layout.ndim > 0) return 0;
  return error_set(e, ERR_BAD_DIM, "%s: argument 'self' is 0-dim, so it has no dim to %s", OPN(a),
                   OPN(a));
}

static void drop_dim(layout_t *l, int d) {
  for (int i = d; i < l->ndim - 1; i++) {
    l->sizes[i] = l->sizes[i + 1];
    l->strides[i] = l->strides[i + 1];
  }
  l->ndim--;
}

int ops__rule_select(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  int64_t d, idx = arg_int(a, 2);
  if (need_dims(a, t, e) || ops__wrap_dim_arg(a, 1, arg_int(a, 1), t->layout.ndim, false, &d, e))
    return -1;
  int64_t size = t->layout.sizes[d];
  if (idx < -size || idx >= size)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: argument 'index' %" PRId64 " is out of range for dim %" PRId64
                     " of size %" PRId64 " (expected %" PRId64 "..%" PRId64 ")",
                     OPN(a), idx, d, size, -size, size - 1);
  if (idx < 0) idx += size;
  layout_t l = t->layout;
  l.offset += idx * l.strides[d];
  drop_dim(&l, (int)d);
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_narrow(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  int64_t d, start = arg_int(a, 2), length = arg_int(a, 3);
  if (need_dims(a, t, e) || ops__wrap_dim_arg(a, 1, arg_int(a, 1), t->layout.ndim, false, &d, e))
    return -1;
  int64_t size = t->layout.sizes[d];
  if (length < 0)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: argument 'length' must be >= 0, got %" PRId64,
                     OPN(a), length);
  if (start < -size || start > size)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: argument 'start' %" PRId64 " is out of range for dim %" PRId64
                     " of size %" PRId64 " (expected %" PRId64 "..%" PRId64 ")",
                     OPN(a), start, d, size, -size, size);
  if (start < 0) start += size;
  if (start > size - length)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: argument 'start' (%" PRId64 ") + argument 'length' (%" PRId64
                     ") exceeds dim %" PRId64 " of size %" PRId64,
                     OPN(a), start, length, d, size);
  layout_t l = t->layout;
  l.offset += start * l.strides[d];
  l.sizes[d] = length;
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_slice(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  int64_t d, step = arg_int(a, 4);
  if (need_dims(a, t, e) || ops__wrap_dim_arg(a, 1, arg_int(a, 1), t->layout.ndim, false, &d, e))
    return -1;
  if (step <= 0)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: argument 'step' must be positive, got %" PRId64,
                     OPN(a), step);
  int64_t size = t->layout.sizes[d];
  int64_t start = arg_none(a, 2) ? 0 : arg_int(a, 2);
  int64_t end = arg_none(a, 3) ? INT64_MAX : arg_int(a, 3);
  /* Python slice semantics: negatives count from the end, then clamp. */
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = start < 0 ? 0 : start > size ? size : start;
  end = end < start ? start : end > size ? size : end;
  int64_t len = end - start;
  layout_t l = t->layout;
  l.offset += start * l.strides[d];
  l.sizes[d] = len == 0 ? 0 : (len - 1) / step + 1;
  int64_t stride;
  /* Overflow means step > size, so at most one element and the stride is moot. */
  if (!__builtin_mul_overflow(l.strides[d], step, &stride)) l.strides[d] = stride;
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_unsqueeze(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  int64_t d;
  if (ops__wrap_dim_arg(a, 1, arg_int(a, 1), t->layout.ndim + 1, false, &d, e)) return -1;
  if (t->layout.ndim + 1 > LAYOUT_MAX_DIMS)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: argument 'self' already has %d dims, the most a tensor may have",
                     OPN(a), LAYOUT_MAX_DIMS);
  layout_t l = t->layout;
  int64_t stride = d >= l.ndim ? 1 : l.sizes[d] * l.strides[d];
  for (int i = l.ndim; i > d; i--) {
    l.sizes[i] = l.sizes[i - 1];
    l.strides[i] = l.strides[i - 1];
  }
  l.sizes[d] = 1;
  l.strides[d] = stride;
  l.ndim++;
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_squeeze(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  uint32_t mask = UINT32_MAX;
  if (!arg_none(a, 1)) {
    const int64_t *dims;
    size_t n;
    op_value_ints(&a->v[1], &dims, &n);
    if (n > LAYOUT_MAX_DIMS) return too_many_dims(a, 1, n, e);
    if (ops__dims_to_mask(a, 1, dims, n, t->layout.ndim, true, &mask, e)) return -1;
  }
  layout_t l = t->layout;
  for (int i = t->layout.ndim - 1; i >= 0; i--)
    if ((mask & (1u << i)) && l.sizes[i] == 1) drop_dim(&l, i);
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_expand(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  const int64_t *sizes;
  size_t n;
  op_value_ints(&a->v[1], &sizes, &n);
  if (n > LAYOUT_MAX_DIMS) return too_many_dims(a, 1, n, e);
  char b1[LAYOUT_SHAPE_BUF], b2[LAYOUT_SHAPE_BUF];
  int nd = (int)n, td = t->layout.ndim;
  if (nd < td)
    return error_set(e, ERR_SHAPE_MISMATCH,
                     "%s: argument 'size' %s has %d dims, fewer than self's %d (shape %s)", OPN(a),
                     layout_format_shape(sizes, nd, b1, sizeof b1), nd, td, ops__shape_str(t, b2));
  layout_t l = {.ndim = nd, .offset = t->layout.offset};
  for (int i = nd - 1; i >= 0; i--) {
    int dim = td - (nd - i);
    int64_t size = dim >= 0 ? t->layout.sizes[dim] : 1;
    int64_t stride = td == 0 ? 0 : dim >= 0 ? t->layout.strides[dim] : l.sizes[i + 1] * l.strides[i + 1];
    int64_t target = sizes[i];
    if (target == -1) {
      if (dim < 0)
        return error_set(e, ERR_BAD_ARGUMENT,
                         "%s: argument 'size': -1 (keep the size) is not allowed at dim %d, a new "
                         "leading dim of %s",
                         OPN(a), i, layout_format_shape(sizes, nd, b1, sizeof b1));
      target = size;
    }
    if (target < 0)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: argument 'size': invalid size %" PRId64 " at dim %d of %s", OPN(a),
                       target, i, layout_format_shape(sizes, nd, b1, sizeof b1));
    if (size != target) {
      if (size != 1)
        return error_set(e, ERR_SHAPE_MISMATCH,
                         "%s: argument 'size': the expanded size %" PRId64 " must match the "
                         "existing size %" PRId64 " at non-singleton dim %d (size %s, self %s)",
                         OPN(a), target, size, i, layout_format_shape(sizes, nd, b1, sizeof b1),
                         ops__shape_str(t, b2));
      size = target;
      stride = 0;
    }
    l.sizes[i] = size;
    l.strides[i] = stride;
  }
  ops__push_view(out, t->dtype, &l, 0);
  return 0;
}

int ops__rule_contiguous(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  const tensor_meta_t *t = arg_tensor(a, 0);
  if (layout_is_contiguous(&t->layout)) {
    ops__push_view(out, t->dtype, &t->layout, 0);
    return 0;
  }
  return ops__push_fresh(a, out, t->dtype, t->layout.sizes, t->layout.ndim, e);
}
