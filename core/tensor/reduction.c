#include "reduction.h"

#include <string.h>

static const struct {
  const char *name;
  reduction_dtypes_t dtypes;
  bool combines;
} table[RED_COUNT] = {
#define XX(name, str, dtypes, combines) [RED_##name] = {str, dtypes, combines},
    REDUCTION_MAP(XX)
#undef XX
};

static bool valid(reduction_t r) { return r >= 0 && r < RED_COUNT; }

reduction_t reduction_parse(const char *name) {
  if (!name) return RED_INVALID;
  for (int r = 0; r < RED_COUNT; r++)
    if (strcmp(name, table[r].name) == 0) return (reduction_t)r;
  return RED_INVALID;
}

const char *reduction_name(reduction_t r) { return valid(r) ? table[r].name : "unknown"; }

const char *reduction_names(void) {
#define XX(name, str, dtypes, combines) ", " str
  static const char names[] = "" REDUCTION_MAP(XX);
#undef XX
  return names + 2; /* past the first ", " */
}

bool reduction_combines(reduction_t r) { return valid(r) && table[r].combines; }

const char *reduction_collective(reduction_t r, bool scatter) {
  if (reduction_combines(r)) return scatter ? "reduce_scatter" : "allreduce";
  return scatter ? "alltoall" : "allgather";
}

bool reduction_dtype_ok(reduction_t r, dtype_t dtype) {
  if (!valid(r) || !dtype_valid(dtype)) return false;
  switch (table[r].dtypes) {
    case RED_DTYPES_ALL: return true;
    case RED_DTYPES_FLOATING: return dtype_is_floating(dtype);
    case RED_DTYPES_INTEGRAL: return dtype_is_integral(dtype, true);
  }
  return false;
}

int reduction_check_dtype(reduction_t r, dtype_t dtype, meshd_error_t *err) {
  if (!valid(r))
    return error_set(err, ERR_BAD_ARGUMENT, "unknown reduction %d; expected one of %s", (int)r,
                     reduction_names());
  if (!dtype_valid(dtype))
    return error_set(err, ERR_BAD_ARGUMENT, "dtype %d is not a known dtype", (int)dtype);
  if (reduction_dtype_ok(r, dtype)) return 0;
  if (table[r].dtypes == RED_DTYPES_INTEGRAL)
    return error_set(err, ERR_DTYPE_MISMATCH,
                     "'%s' is bitwise and needs an integer or bool tensor, not %s",
                     table[r].name, dtype_name(dtype));
  return error_set(err, ERR_DTYPE_MISMATCH,
                   "'%s' needs a floating dtype, not %s; cast first or use 'sum'", table[r].name,
                   dtype_name(dtype));
}

static bool same_shape(const int64_t *a, int na, const int64_t *b, int nb) {
  return na == nb && memcmp(a, b, sizeof(int64_t) * (size_t)na) == 0;
}

int reduce_infer(const reduce_args_t *a, tensor_meta_t *result, meshd_error_t *err) {
  reduction_t r = a->reduction;
  if (!valid(r))
    return error_set(err, ERR_BAD_ARGUMENT, "Reduce: unknown reduction %d; expected one of %s",
                     (int)r, reduction_names());
  bool stack = !table[r].combines;
  if ((stack || a->scatter) && a->ndims != 1)
    return error_set(err, ERR_BAD_DIM,
                     "Reduce: %s works over exactly one mesh dim, but %d were given (%s); reduce "
                     "one dim at a time",
                     stack ? "stack" : "scatter", a->ndims,
                     a->dims_named ? "as named" : "all dims of the mesh");
  if (a->group > REDUCE_GROUP_MAX)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "Reduce: the group has %lld ranks (%s); a collective runs on at most %d: "
                     "reduce over a sub-mesh, then across the partial results",
                     (long long)a->group, a->dims_named ? "the dims named" : "all dims of the mesh",
                     REDUCE_GROUP_MAX);
  const tensor_meta_t *im = a->input;
  if (reduction_check_dtype(r, im->dtype, err) != 0) {
    if (err) error_prefix(err, "Reduce", ": ");
    return -1;
  }
  const layout_t *il = &im->layout;
  if (a->scatter && (il->ndim == 0 || il->sizes[0] != a->group)) {
    char shape[LAYOUT_SHAPE_BUF];
    layout_format_shape(il->sizes, il->ndim, shape, sizeof shape);
    return error_set(err, ERR_SHAPE_MISMATCH,
                     "Reduce: when scattering, the input's size(0) must equal the group size %lld "
                     "(dim '%s'), but the input has shape %s",
                     (long long)a->group, a->dim ? a->dim : "?", shape);
  }
  int64_t sizes[LAYOUT_MAX_DIMS + 1];
  int nd = 0;
  if (stack && !a->scatter) { /* allgather: [N, *shape] */
    if (il->ndim + 1 > LAYOUT_MAX_DIMS)
      return error_set(err, ERR_BAD_ARGUMENT, "Reduce: stacking would give more than %d dims",
                       LAYOUT_MAX_DIMS);
    sizes[nd++] = a->group;
    for (int i = 0; i < il->ndim; i++) sizes[nd++] = il->sizes[i];
  } else if (a->scatter && !stack) { /* reduce_scatter: shape[1:] */
    for (int i = 1; i < il->ndim; i++) sizes[nd++] = il->sizes[i];
  } else { /* allreduce, alltoall: the input's shape */
    for (int i = 0; i < il->ndim; i++) sizes[nd++] = il->sizes[i];
  }
  tensor_meta_t rm = *im;
  if (layout_contiguous(&rm.layout, sizes, nd, dtype_size(im->dtype), "Reduce", err)) return -1;
  /* Each result element is written once: not into memory several elements
   * share (an expand), as torch's in-place ops refuse too. */
  if (a->inplace && layout_has_internal_overlap(il))
    return error_set(err, ERR_BAD_ARGUMENT,
                     "Reduce: in place into a tensor whose elements share memory (an expanded "
                     "view); clone it first");
  if (a->out && layout_has_internal_overlap(&a->out->layout))
    return error_set(err, ERR_BAD_ARGUMENT,
                     "Reduce: out is a tensor whose elements share memory (an expanded view); "
                     "clone it first");
  if (a->inplace && !same_shape(sizes, nd, il->sizes, il->ndim))
    return error_set(err, ERR_BAD_ARGUMENT,
                     "Reduce: in-place is only possible when the result has the input's shape; %s "
                     "changes it",
                     stack ? "stack" : "scatter");
  if (a->out) {
    const tensor_meta_t *om = a->out;
    if (!same_shape(om->layout.sizes, om->layout.ndim, sizes, nd)) {
      char want[LAYOUT_SHAPE_BUF], got[LAYOUT_SHAPE_BUF];
      layout_format_shape(sizes, nd, want, sizeof want);
      layout_format_shape(om->layout.sizes, om->layout.ndim, got, sizeof got);
      return error_set(err, ERR_SHAPE_MISMATCH, "Reduce: out has shape %s but the result has shape %s",
                       got, want);
    }
    if (om->dtype != im->dtype)
      return error_set(err, ERR_DTYPE_MISMATCH, "Reduce: out is %s but the input is %s",
                       dtype_name(om->dtype), dtype_name(im->dtype));
  }
  *result = rm;
  return 0;
}
