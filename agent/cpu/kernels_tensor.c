/* Copies and casts (clone contiguous to cast copy_), joins (cat stack) and
 * indexing (index_select gather). */
#include <string.h>

#include "cpu_internal.h"
#include "kernel_plan.h"

/* The copy family, cat and stack: views and copies planned in kernel_plan.c. */
static int copy(const kernel_call_t *c, agent_tensor_t *dst, const agent_tensor_t *src,
                meshd_error_t *e) {
  cpu_copy_broadcast(dst, src);
  return 0;
}

int cpu_kernel_copy(const kernel_call_t *c, meshd_error_t *e) { return kernel_copy(c, copy, e); }
int cpu_kernel_cat(const kernel_call_t *c, meshd_error_t *e) { return kernel_cat(c, copy, e); }
int cpu_kernel_stack(const kernel_call_t *c, meshd_error_t *e) { return kernel_stack(c, copy, e); }

int cpu_kernel_index_select(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = kernel_arg(c, 0), *index = kernel_arg(c, 2), *out = c->res[0];
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
    if (v < 0 || v >= size) return kernel_index_error(c, v, d < 0 ? 0 : d, size, e);
  }
  for (int64_t j = 0; j < count; j++) {
    int64_t v = cpu_ld_i(index->meta.dtype, ip + j * istride * (int64_t)iesz);
    layout_t src = kernel_select_dim(ls, d, v), dst = kernel_select_dim(&out->meta.layout, d, j);
    agent_tensor_t sv = cpu_view(self, &src), dv = cpu_view(out, &dst);
    cpu_copy_broadcast(&dv, &sv);
  }
  return 0;
}

int cpu_kernel_gather(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = kernel_arg(c, 0), *index = kernel_arg(c, 2), *out = c->res[0];
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
      if (pass == 0 && (v < 0 || v >= size)) return kernel_index_error(c, v, d, size, e);
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
