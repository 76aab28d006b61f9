#include "layout.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>

#define CTX(c) ((c) ? (c) : "shape"), ": "

static _Atomic int max_dims = LAYOUT_MAX_DIMS;
static _Atomic int64_t max_elements = LAYOUT_MAX_BYTES;

void layout_set_limits(const layout_limits_t *l) {
  int d = l ? l->max_dims : LAYOUT_MAX_DIMS;
  int64_t n = l ? l->max_elements : LAYOUT_MAX_BYTES;
  atomic_store(&max_dims, d < 1 ? 1 : d > LAYOUT_MAX_DIMS ? LAYOUT_MAX_DIMS : d);
  atomic_store(&max_elements, n < 1 ? 1 : n > LAYOUT_MAX_BYTES ? LAYOUT_MAX_BYTES : n);
}

static _Thread_local bool limits_off;

void layout_limits_off(bool off) { limits_off = off; }

layout_limits_t layout_get_limits(void) {
  return (layout_limits_t){atomic_load(&max_dims), atomic_load(&max_elements)};
}

int layout_check_shape(const char *ctx, const int64_t *sizes, int64_t ndim, size_t elem_size,
                       meshd_error_t *e) {
  if (ndim < 0 || ndim > LAYOUT_MAX_DIMS)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s%s%" PRId64 " dims is too many: meshd tensors have at most %d dims",
                     CTX(ctx), ndim, LAYOUT_MAX_DIMS);
  int dims_limit = limits_off ? LAYOUT_MAX_DIMS : atomic_load(&max_dims);
  if (ndim > dims_limit)
    return error_set(e, ERR_QUOTA,
                     "%s%s%" PRId64 " dims is more than the %d a tensor may have here "
                     "(--max-tensor-dims)",
                     CTX(ctx), ndim, dims_limit);
  bool zero = false;
  for (int i = 0; i < ndim; i++) {
    if (sizes[i] < 0)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s%snegative size %" PRId64 " at dim %d; sizes must be >= 0", CTX(ctx),
                       sizes[i], i);
    if (sizes[i] == 0) zero = true;
  }
  /* A size 0 counts as 1: an empty tensor still has strides, which must fit
   * (torch's "Stride calculation overflowed"). */
  int64_t bytes = elem_size ? (int64_t)elem_size : 1;
  for (int i = 0; i < ndim; i++) {
    int64_t size = sizes[i] ? sizes[i] : 1;
    if (__builtin_mul_overflow(bytes, size, &bytes) || bytes > LAYOUT_MAX_BYTES) {
      char buf[LAYOUT_SHAPE_BUF];
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s%sshape %s with %zu-byte elements exceeds 2^62 bytes%s", CTX(ctx),
                       layout_format_shape(sizes, (int)ndim, buf, sizeof buf),
                       elem_size ? elem_size : 1,
                       zero ? " (in its strides: its sizes other than 0 multiply past it)" : "");
    }
  }
  /* Within 2^62 bytes, so the count does not overflow. */
  int64_t numel = 1, limit = limits_off ? LAYOUT_MAX_BYTES : atomic_load(&max_elements);
  for (int i = 0; i < ndim; i++) numel *= sizes[i];
  if (numel > limit) {
    char buf[LAYOUT_SHAPE_BUF];
    return error_set(e, ERR_QUOTA,
                     "%s%sshape %s has %" PRId64 " elements, more than the %" PRId64
                     " a tensor may have here (--max-tensor-elements)",
                     CTX(ctx), layout_format_shape(sizes, (int)ndim, buf, sizeof buf), numel,
                     limit);
  }
  return 0;
}

void layout_make_contiguous(layout_t *l) {
  int64_t stride = 1;
  for (int i = l->ndim - 1; i >= 0; i--) {
    l->strides[i] = stride;
    if (i > 0) stride *= l->sizes[i] > 1 ? l->sizes[i] : 1;
  }
  l->offset = 0;
}

int layout_contiguous(layout_t *out, const int64_t *sizes, int64_t ndim, size_t elem_size,
                      const char *ctx, meshd_error_t *e) {
  if (layout_check_shape(ctx, sizes, ndim, elem_size, e)) return -1;
  out->ndim = (int)ndim;
  for (int i = 0; i < ndim; i++) out->sizes[i] = sizes[i];
  layout_make_contiguous(out);
  return 0;
}

int64_t layout_numel(const layout_t *l) {
  int64_t n = 1;
  for (int i = 0; i < l->ndim; i++) n *= l->sizes[i];
  return n;
}

bool layout_is_contiguous(const layout_t *l) {
  if (layout_numel(l) == 0) return true;
  int64_t expected = 1;
  for (int i = l->ndim - 1; i >= 0; i--) {
    if (l->sizes[i] == 1) continue;
    if (l->strides[i] != expected) return false;
    expected *= l->sizes[i];
  }
  return true;
}

bool layout_has_internal_overlap(const layout_t *l) {
  for (int i = 0; i < l->ndim; i++)
    if (l->strides[i] == 0 && l->sizes[i] > 1) return true;
  return false;
}

bool layout_same_shape(const layout_t *a, const layout_t *b) {
  if (a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (a->sizes[i] != b->sizes[i]) return false;
  return true;
}

int layout_broadcast(const char *ctx, const char *a_name, const int64_t *a, int na,
                     const char *b_name, const int64_t *b, int nb, int64_t *out, int *nout,
                     meshd_error_t *e) {
  int n = na > nb ? na : nb;
  int64_t res[LAYOUT_MAX_DIMS];
  for (int i = n - 1; i >= 0; i--) {
    int ia = i - (n - na), ib = i - (n - nb);
    int64_t sa = ia >= 0 ? a[ia] : 1, sb = ib >= 0 ? b[ib] : 1;
    if (sa != sb && sa != 1 && sb != 1) {
      char ba[LAYOUT_SHAPE_BUF], bb[LAYOUT_SHAPE_BUF];
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "%s%s%s %s and %s %s can't be broadcast together: at dim %d the sizes "
                       "are %" PRId64 " and %" PRId64 " (each must match or be 1)",
                       CTX(ctx), a_name, layout_format_shape(a, na, ba, sizeof ba), b_name,
                       layout_format_shape(b, nb, bb, sizeof bb), i, sa, sb);
    }
    res[i] = sa == 1 ? sb : sa;
  }
  for (int i = 0; i < n; i++) out[i] = res[i];
  *nout = n;
  return 0;
}

int layout_wrap_dim(const char *ctx, int64_t dim, int ndim, bool wrap_scalar, int64_t *out,
                    meshd_error_t *e) {
  int64_t n = ndim == 0 && wrap_scalar ? 1 : ndim;
  if (n == 0)
    return error_set(e, ERR_BAD_DIM,
                     "%s%sdim %" PRId64 " is out of range: the tensor has 0 dims (no dim can "
                     "be named)",
                     CTX(ctx), dim);
  if (dim < -n || dim >= n)
    return error_set(e, ERR_BAD_DIM,
                     "%s%sdim %" PRId64 " is out of range for a tensor of %d dim%s (expected "
                     "%" PRId64 "..%" PRId64 ")",
                     CTX(ctx), dim, ndim, ndim == 1 ? "" : "s", -n, n - 1);
  *out = dim < 0 ? dim + n : dim;
  return 0;
}

const char *layout_format_shape(const int64_t *sizes, int ndim, char *buf, size_t n) {
  if (!n) return buf;
  size_t at = 0;
  int w = snprintf(buf, n, "[");
  at = w > 0 ? (size_t)w : 0;
  for (int i = 0; i < ndim && at < n; i++) {
    w = snprintf(buf + at, n - at, "%s%" PRId64, i ? ", " : "", sizes[i]);
    if (w < 0) break;
    at += (size_t)w;
  }
  if (at < n) snprintf(buf + at, n - at, "]");
  return buf;
}
