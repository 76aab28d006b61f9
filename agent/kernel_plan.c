#include "kernel_plan.h"

#include <inttypes.h>
#include <string.h>

#include "elementwise_ops.h"

/* `l` on t's storage. */
static agent_tensor_t view_of(const agent_tensor_t *t, const layout_t *l) {
  agent_tensor_t v = {.meta = {.dtype = t->meta.dtype, .layout = *l}, .storage = t->storage};
  return v;
}

int kernel_copy(const kernel_call_t *c, kernel_copy_fn copy, meshd_error_t *e) {
  agent_tensor_t *self = kernel_arg(c, 0);
  if (c->a->op->is_inplace) /* copy_(self, src): src broadcasts to self */
    return copy(c, self, kernel_arg(c, 1), e);
  agent_tensor_t *out = c->res[0];
  if (!layout_same_shape(&out->meta.layout, &self->meta.layout)) {
    /* reshape that cannot view: self's elements in row-major order */
    layout_t l = self->meta.layout;
    layout_make_contiguous(&l);
    l.offset = out->meta.layout.offset;
    agent_tensor_t v = view_of(out, &l);
    return copy(c, &v, self, e);
  }
  return copy(c, out, self, e);
}

int kernel_cat(const kernel_call_t *c, kernel_copy_fn copy, meshd_error_t *e) {
  const op_value_t *list = &c->a->v[0];
  agent_tensor_t *out = c->res[0];
  const layout_t *lo = &out->meta.layout;
  int64_t d = c->a->v[1].i;
  if (d < 0) d += lo->ndim;
  int64_t start = 0;
  for (size_t i = 0; i < list->ntensors; i++) {
    agent_tensor_t *t = agent_tensor_of(list->tensors[i]);
    const layout_t *lt = &t->meta.layout;
    if (lt->ndim == 1 && lt->sizes[0] == 0) continue; /* torch skips empty 1-D entries */
    layout_t v = *lo;
    v.sizes[d] = lt->sizes[d];
    v.offset = lo->offset + start * lo->strides[d];
    agent_tensor_t view = view_of(out, &v);
    if (copy(c, &view, t, e)) return -1;
    start += lt->sizes[d];
  }
  return 0;
}

int kernel_stack(const kernel_call_t *c, kernel_copy_fn copy, meshd_error_t *e) {
  const op_value_t *list = &c->a->v[0];
  agent_tensor_t *out = c->res[0];
  const layout_t *lo = &out->meta.layout;
  int64_t d = c->a->v[1].i;
  if (d < 0) d += lo->ndim;
  for (size_t i = 0; i < list->ntensors; i++) {
    layout_t v = kernel_select_dim(lo, d, (int64_t)i);
    agent_tensor_t view = view_of(out, &v);
    if (copy(c, &view, agent_tensor_of(list->tensors[i]), e)) return -1;
  }
  return 0;
}

layout_t kernel_select_dim(const layout_t *l, int64_t d, int64_t i) {
  if (d < 0) return *l;
  layout_t v = {.ndim = l->ndim - 1, .offset = l->offset + i * l->strides[d]};
  for (int k = 0, j = 0; k < l->ndim; k++) {
    if (k == d) continue;
    v.sizes[j] = l->sizes[k];
    v.strides[j++] = l->strides[k];
  }
  return v;
}

int kernel_index_error(const kernel_call_t *c, int64_t idx, int64_t dim, int64_t size,
                       meshd_error_t *e) {
  return error_set(e, ERR_REMOTE_FAILURE,
                   "%s: index %" PRId64 " is out of range for dim %" PRId64 " of size %" PRId64
                   " (rank %u)",
                   kernel_opname(c), idx, dim, size, c->rank);
}

/* ---- binary elementwise ops ---- */

/* A double to int64 as a cast does, without undefined behaviour outside the
 * range (NaN -> 0, saturating): the backends' cpu_f2i / cu_f2i. */
static int64_t f2i(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

kernel_binary_t kernel_binary_plan(const kernel_call_t *c) {
  const op_args_t *a = c->a;
  kernel_binary_t p = {.op = ew_binary_op(kernel_opname(c)), .alpha_f = 1, .alpha_i = 1};
  const op_value_t *vals[2] = {&a->v[0], &a->v[1]};
  p.rt = ops_result_type(vals, 2);
  if (p.op == B_DIV && a->v[2].kind == VAL_STRING)
    p.op = strcmp(a->v[2].s, "floor") == 0 ? B_DIV_FLOOR : B_DIV_TRUNC;
  if ((p.op == B_ADD || p.op == B_SUB) && a->v[2].kind != VAL_NONE) {
    const op_value_t *al = &a->v[2];
    p.alpha_f = al->kind == VAL_FLOAT ? al->f : al->kind == VAL_BOOL ? al->b : (double)al->i;
    p.alpha_i = al->kind == VAL_INT ? al->i : al->kind == VAL_BOOL ? al->b : f2i(al->f);
  }
  p.is_int = p.op == B_DIV || p.op == B_LAND || p.op == B_LOR ? false : !dtype_is_floating(p.rt);
  if (p.op >= B_BAND) p.is_int = true;
  /* torch casts the operands to their common dtype (float32 for a true division
   * of integers) and computes in it: a float64 scalar or 0-dim tensor against a
   * float32 tensor compares as float32, int64 + float32 adds float32(int64). */
  if (p.op == B_LAND || p.op == B_LOR) return p;
  dtype_t comp = p.op == B_DIV && !dtype_is_floating(p.rt) ? DTYPE_DEFAULT_FLOAT : p.rt;
  bool compare = p.op >= B_EQ && p.op <= B_GE;
  for (int k = 0; k < 2; k++) {
    const op_value_t *v = &a->v[k];
    dtype_t dt = v->kind == VAL_TENSOR ? v->tensor->dtype
                 : v->kind == VAL_FLOAT ? DTYPE_FLOAT64
                 : v->kind == VAL_BOOL  ? DTYPE_BOOL
                                        : DTYPE_INT64;
    if (dt == comp) continue;
    if (p.is_int) {
      if (comp != DTYPE_INT64 && comp != DTYPE_BOOL && dt != DTYPE_BOOL) p.cast[k] = comp;
    } else if (compare || comp == DTYPE_FLOAT32) {
      p.cast[k] = comp;
    } else if (comp == DTYPE_FLOAT16 || comp == DTYPE_BFLOAT16) {
      if (v->kind == VAL_TENSOR) p.cast[k] = comp;
    }
  }
  return p;
}

/* ---- reductions ---- */

int kernel_reduce_op(const char *name) {
  static const struct {
    const char *name;
    kernel_reduce_op_t op;
  } names[] = {{"sum", REDUCE_SUM},       {"mean", REDUCE_MEAN},    {"prod", REDUCE_PROD},
               {"max", REDUCE_MAX},       {"min", REDUCE_MIN},      {"amax", REDUCE_MAX},
               {"amin", REDUCE_MIN},      {"argmax", REDUCE_ARGMAX}, {"argmin", REDUCE_ARGMIN}};
  for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
    if (strcmp(names[k].name, name) == 0) return (int)names[k].op;
  return -1;
}

uint32_t kernel_reduce_mask(const kernel_call_t *c, const layout_t *l) {
  const int64_t *dims;
  size_t n = 0;
  bool all = c->a->v[1].kind == VAL_NONE || (op_value_ints(&c->a->v[1], &dims, &n) && n == 0);
  if (all) return l->ndim ? (uint32_t)((1ull << l->ndim) - 1) : 0;
  uint32_t mask = 0;
  for (size_t k = 0; k < n; k++) {
    int64_t d = dims[k] < 0 ? dims[k] + l->ndim : dims[k];
    if (l->ndim == 0) continue; /* a 0-dim tensor reduces over nothing */
    mask |= 1u << d;
  }
  return mask;
}

void kernel_reduce_plan(kernel_reduce_plan_t *r, const agent_tensor_t *in, uint32_t mask,
                        const layout_t *out, int64_t out_esz, bool out_has_reduced) {
  const layout_t *l = &in->meta.layout;
  int64_t esz = (int64_t)dtype_size(in->meta.dtype);
  int j = 0;
  memset(r, 0, sizeof *r);
  r->rcount = 1;
  for (int d = 0; d < l->ndim; d++) {
    if (mask & (1u << d)) {
      r->rsize[r->nr] = l->sizes[d];
      r->rin[r->nr] = l->strides[d] * esz;
      r->rout[r->nr] = out_has_reduced ? out->strides[j] * out_esz : 0;
      r->rcount *= l->sizes[d];
      r->nr++;
      if (out->ndim == l->ndim) j++; /* keepdim, or softmax */
    } else {
      r->ksize[r->nk] = l->sizes[d];
      r->kin[r->nk] = l->strides[d] * esz;
      r->kout[r->nk] = out->strides[j++] * out_esz;
      r->nk++;
    }
  }
}
