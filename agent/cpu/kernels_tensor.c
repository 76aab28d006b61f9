/* Copies and casts (clone contiguous to cast copy_), joins (cat stack) and
 * indexing (index_select gather). */
#include <inttypes.h>
#include <string.h>

#include "cpu_internal.h"

int cpu_kernel_copy(const cpu_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = cpu_arg(c, 0);
  if (c->a->op->is_inplace) { /* copy_(self, src): src broadcasts to self */
    cpu_copy_broadcast(self, cpu_arg(c, 1));
    return 0;
  }
  agent_tensor_t *out = c->res[0];
  if (!layout_same_shape(&out->meta.layout, &self->meta.layout)) {
    /* reshape that cannot view: self's elements in row-major order */
    layout_t l = self->meta.layout;
    layout_make_contiguous(&l);
    l.offset = out->meta.layout.offset;
    agent_tensor_t v = cpu_view(out, &l);
    cpu_copy_broadcast(&v, self);
    return 0;
  }
  cpu_copy_broadcast(out, self);
  return 0;
}

/* Each entry is copied (cast to the result dtype) into its narrow of the result. */
int cpu_kernel_cat(const cpu_call_t *c, meshd_error_t *e) {
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
    agent_tensor_t view = cpu_view(out, &v);
    cpu_copy_broadcast(&view, t);
    start += lt->sizes[d];
  }
  return 0;
}

int cpu_kernel_stack(const cpu_call_t *c, meshd_error_t *e) {
  const op_value_t *list = &c->a->v[0];
  agent_tensor_t *out = c->res[0];
  const layout_t *lo = &out->meta.layout;
  int64_t d = c->a->v[1].i;
  if (d < 0) d += lo->ndim;
  for (size_t i = 0; i < list->ntensors; i++) {
    layout_t v = {.ndim = lo->ndim - 1, .offset = lo->offset + (int64_t)i * lo->strides[d]};
    for (int k = 0, j = 0; k < lo->ndim; k++) {
      if (k == d) continue;
      v.sizes[j] = lo->sizes[k];
      v.strides[j++] = lo->strides[k];
    }
    agent_tensor_t view = cpu_view(out, &v);
    cpu_copy_broadcast(&view, agent_tensor_of(list->tensors[i]));
  }
  return 0;
}

static int out_of_range(const cpu_call_t *c, int64_t idx, int64_t dim, int64_t size,
                        meshd_error_t *e) {
  return error_set(e, ERR_REMOTE_FAILURE,
                   "%s: index %" PRId64 " is out of range for dim %" PRId64 " of size %" PRId64
                   " (rank %u)",
                   cpu_opname(c), idx, dim, size, c->rank);
}

/* `l` with dim d fixed at i (d < 0: l itself, for 0-dim tensors). */
static layout_t select_dim(const layout_t *l, int64_t d, int64_t i) {
  if (d < 0) return *l;
  layout_t v = {.ndim = l->ndim - 1, .offset = l->offset + i * l->strides[d]};
  for (int k = 0, j = 0; k < l->ndim; k++) {
    if (k == d) continue;
    v.sizes[j] = l->sizes[k];
    v.strides[j++] = l->strides[k];
  }
  return v;
}

int cpu_kernel_index_select(const cpu_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = cpu_arg(c, 0), *index = cpu_arg(c, 2), *out = c->res[0];
  const layout_t *ls = &self->meta.layout, *li = &index->meta.layout;
  int64_t d = c->a->v[1].i;
  if (ls->ndim == 0) d = -1;
  else if (d < 0) d += ls->ndim;
  int64_t size = d < 0 ? 1 : ls->sizes[d], count = layout_numel(li);
  int64_t istride = li->ndim ? li->strides[0] : 0;
  size_t iesz = dtype_size(index->meta.dtype);
  const char *ip = cpu_data(index);
  /* Check every index before writing anything. */
  for (int64_t j = 0; j < count; j++) {
    int64_t v = cpu_ld_i(index->meta.dtype, ip + j * istride * (int64_t)iesz);
    if (v < 0 || v >= size) return out_of_range(c, v, d < 0 ? 0 : d, size, e);
  }
  for (int64_t j = 0; j < count; j++) {
    int64_t v = cpu_ld_i(index->meta.dtype, ip + j * istride * (int64_t)iesz);
    layout_t src = select_dim(ls, d, v), dst = select_dim(&out->meta.layout, d, j);
    agent_tensor_t sv = cpu_view(self, &src), dv = cpu_view(out, &dst);
    cpu_copy_broadcast(&dv, &sv);
  }
  return 0;
}

int cpu_kernel_gather(const cpu_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = cpu_arg(c, 0), *index = cpu_arg(c, 2), *out = c->res[0];
  const layout_t *ls = &self->meta.layout, *li = &index->meta.layout, *lo = &out->meta.layout;
  int64_t d = c->a->v[1].i;
  int nd = li->ndim;
  if (ls->ndim == 0) d = 0;
  else if (d < 0) d += ls->ndim;
  int64_t size = ls->ndim ? ls->sizes[d] : 1, n = layout_numel(li);
  dtype_t dt = self->meta.dtype;
  size_t esz = dtype_size(dt);
  const char *sp = cpu_data(self), *ip = cpu_data(index);
  char *op = cpu_data(out);
  int64_t idx[LAYOUT_MAX_DIMS] = {0};
  for (int pass = 0; pass < 2; pass++) { /* check everything, then write */
    memset(idx, 0, sizeof idx);
    for (int64_t t = 0; t < n; t++) {
      int64_t ioff = 0, soff = 0, ooff = 0;
      for (int k = 0; k < nd; k++) {
        ioff += idx[k] * li->strides[k];
        ooff += idx[k] * lo->strides[k];
        if (k != d && ls->ndim) soff += idx[k] * ls->strides[k];
      }
      int64_t v = cpu_ld_i(index->meta.dtype, ip + ioff * 8);
      if (pass == 0 && (v < 0 || v >= size)) return out_of_range(c, v, d, size, e);
      if (pass == 1) {
        if (ls->ndim) soff += v * ls->strides[d];
        memcpy(op + ooff * (int64_t)esz, sp + soff * (int64_t)esz, esz);
      }
      for (int k = nd - 1; k >= 0; k--) {
        if (++idx[k] < li->sizes[k]) break;
        idx[k] = 0;
      }
    }
  }
  return 0;
}
