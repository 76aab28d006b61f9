/* Copies and casts (clone contiguous to cast copy_), joins (cat stack) and
 * indexing (index_select gather) of the cuda backend, with the semantics of
 * agent/cpu/kernels_tensor.c and cpu_copy_broadcast (kernels_iter.c). */
#include <string.h>

#include "kernels.cuh"
#include "kernel_plan.h"

namespace {

/* One element from s (dtype st) to d (dtype dt): the bytes when the dtypes
 * agree, else cast as the cpu's copy_row casts. */
CU_HD void copy_elem(dtype_t dt, char *d, dtype_t st, const char *s) {
  if (dt == st) {
    switch (cu_size(dt)) {
      case 8: *(uint64_t *)d = *(const uint64_t *)s; return;
      case 4: *(uint32_t *)d = *(const uint32_t *)s; return;
      case 2: *(uint16_t *)d = *(const uint16_t *)s; return;
      default: *(uint8_t *)d = *(const uint8_t *)s; return;
    }
  }
  if (cu_is_int(st)) cu_st_i(dt, d, cu_ld_i(st, s));
  else cu_st_f(dt, d, cu_ld_f(st, s));
}

/* ---- casting copy ---- */

template <class T>
struct CopySame {
  cu_iter_t it; /* dst, src */
  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    *(T *)p[0] = *(const T *)p[1];
  }
};

struct CopyCast {
  cu_iter_t it; /* dst, src */
  bool src_int;
  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    if (src_int) cu_st_i(it.dt[0], p[0], cu_ld_i(it.dt[1], p[1]));
    else cu_st_f(it.dt[0], p[0], cu_ld_f(it.dt[1], p[1]));
  }
};

template <class T>
static int copy_same(backend_t *b, backend_stream_t *bs, const cu_iter_t *it, meshd_error_t *e) {
  CopySame<T> f;
  f.it = *it;
  return cuda_launch(b, bs, cu_iter_numel(it), f, "copy", e);
}

}  // namespace

extern "C" int cuda_copy_broadcast(backend_t *b, backend_stream_t *bs, agent_tensor_t *dst,
                                   const agent_tensor_t *src, meshd_error_t *e) {
  cu_iter_t it;
  cu_iter_init(&it, dst->meta.layout.sizes, dst->meta.layout.ndim);
  cu_iter_add(&it, dst);
  cu_iter_add(&it, src);
  cu_iter_coalesce(&it);
  int64_t n = cu_iter_numel(&it);
  if (n <= 0) return 0;
  dtype_t dt = dst->meta.dtype, st = src->meta.dtype;
  if (dt != st) {
    CopyCast f;
    f.it = it;
    f.src_int = cu_is_int(st);
    return cuda_launch(b, bs, n, f, "copy", e);
  }
  int esz = cu_size(dt);
  if (it.nd == 0 || (it.nd == 1 && it.strides[0][0] == esz && it.strides[1][0] == esz)) {
    if (it.base[0] == it.base[1]) return 0;
    return cuda_memcpy(b, bs, it.base[0], it.base[1], (size_t)n * esz, e);
  }
  switch (esz) {
    case 8: return copy_same<uint64_t>(b, bs, &it, e);
    case 4: return copy_same<uint32_t>(b, bs, &it, e);
    case 2: return copy_same<uint16_t>(b, bs, &it, e);
    default: return copy_same<uint8_t>(b, bs, &it, e);
  }
}

/* The copy family, cat and stack: views and copies planned in kernel_plan.c. */
static int copy(const kernel_call_t *c, agent_tensor_t *dst, const agent_tensor_t *src,
                meshd_error_t *e) {
  return cuda_copy_broadcast(c->b, c->bs, dst, src, e);
}

extern "C" int cuda_kernel_copy(const kernel_call_t *c, meshd_error_t *e) {
  return kernel_copy(c, copy, e);
}
extern "C" int cuda_kernel_cat(const kernel_call_t *c, meshd_error_t *e) {
  return kernel_cat(c, copy, e);
}
extern "C" int cuda_kernel_stack(const kernel_call_t *c, meshd_error_t *e) {
  return kernel_stack(c, copy, e);
}

namespace {

/* ---- indexing ---- */

CU_HD void atomic_min_i64(int64_t *p, int64_t v) {
#ifdef __CUDA_ARCH__
  if (v < *(volatile int64_t *)p) atomicMin((long long *)p, (long long)v);
#else
  if (v < *p) *p = v;
#endif
}

/* *first = the smallest linear (row-major) position of an index outside [0, size). */
struct IndexCheck {
  cu_iter_t it; /* the index */
  int64_t size;
  int64_t *first;
  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    int64_t v = cu_ld_i(it.dt[0], p[0]);
    if (v < 0 || v >= size) atomic_min_i64(first, i);
  }
};


/* Checks every index of `index` against [0, size) before anything is written,
 * and reports the first one out of range (in row-major order) as the cpu does.
 * 0, or -1 with e. */
static int check_indices(const kernel_call_t *c, const agent_tensor_t *index, int64_t dim,
                         int64_t size, meshd_error_t *e) {
  const layout_t *li = &index->meta.layout;
  int64_t n = layout_numel(li);
  if (n <= 0) return 0;
  IndexCheck f;
  cu_iter_init(&f.it, li->sizes, li->ndim);
  cu_iter_add(&f.it, index);
  cu_iter_coalesce(&f.it);
  f.size = size;
  f.first = (int64_t *)cuda_scratch_alloc(c->b, c->bs, sizeof(int64_t));
  if (!f.first)
    return error_set(e, ERR_QUOTA, "%s: out of device memory (scratch)", kernel_opname(c));
  int ret = -1;
  int64_t first = INT64_MAX, v = 0;
  /* 0x7f bytes: a position past every index */
  if (cuda_memset(c->b, c->bs, f.first, 0x7f, sizeof(int64_t), e) ||
      cuda_launch(c->b, c->bs, n, f, kernel_opname(c), e) ||
      cuda_readback(c, &first, f.first, sizeof first, e))
    goto out;
  if (first >= n) {
    ret = 0;
    goto out;
  }
  {
    int64_t off = 0, rem = first; /* the element at row-major position `first` */
    for (int k = li->ndim - 1; k >= 0; k--) {
      off += (rem % li->sizes[k]) * li->strides[k];
      rem /= li->sizes[k];
    }
    char buf[8] = {0};
    int iesz = cu_size(index->meta.dtype);
    if (cuda_readback(c, buf, cu_data(index) + off * iesz, (size_t)iesz, e)) goto out;
    v = cu_ld_i(index->meta.dtype, buf);
  }
  kernel_index_error(c, v, dim, size, e);
out:
  cuda_scratch_free(c->b, c->bs, f.first, sizeof(int64_t));
  return ret;
}

/* out = self[..., index[j], ...]: self's operand walks every dim but the
 * indexed one, whose byte offset comes from the index operand. */
struct Take {
  cu_iter_t it; /* out, self (stride 0 along the indexed dim), index */
  int64_t sd;   /* self's byte stride along the indexed dim */
  int64_t size;
  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    int64_t v = cu_ld_i(it.dt[2], p[2]);
    if (v < 0 || v >= size) return; /* checked before; never read outside self */
    copy_elem(it.dt[0], p[0], it.dt[1], p[1] + v * sd);
  }
};

}  // namespace

extern "C" int cuda_kernel_index_select(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = kernel_arg(c, 0), *index = kernel_arg(c, 2), *out = c->res[0];
  const layout_t *ls = &self->meta.layout, *li = &index->meta.layout, *lo = &out->meta.layout;
  int64_t d = c->a->v[1].i;
  if (ls->ndim == 0) d = -1;
  else if (d < 0) d += ls->ndim;
  int64_t size = d < 0 ? 1 : ls->sizes[d], count = layout_numel(li);
  if (check_indices(c, index, d < 0 ? 0 : d, size, e)) return -1;
  if (d < 0) return count > 0 ? cuda_copy_broadcast(c->b, c->bs, out, self, e) : 0;

  Take f;
  cu_iter_init(&f.it, lo->sizes, lo->ndim);
  cu_iter_add(&f.it, out);
  layout_t s = *ls;
  s.sizes[d] = 1; /* stride 0 along d */
  cu_iter_add_raw(&f.it, cu_data(self), self->meta.dtype, &s);
  layout_t ix;
  memset(&ix, 0, sizeof ix);
  ix.ndim = lo->ndim;
  for (int k = 0; k < ix.ndim; k++) ix.sizes[k] = 1;
  ix.sizes[d] = count;
  ix.strides[d] = li->ndim ? li->strides[0] : 0;
  cu_iter_add_raw(&f.it, cu_data(index), index->meta.dtype, &ix);
  cu_iter_coalesce(&f.it);
  f.sd = ls->strides[d] * (int64_t)cu_size(self->meta.dtype);
  f.size = size;
  return cuda_launch(c->b, c->bs, cu_iter_numel(&f.it), f, kernel_opname(c), e);
}

extern "C" int cuda_kernel_gather(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = kernel_arg(c, 0), *index = kernel_arg(c, 2), *out = c->res[0];
  const layout_t *ls = &self->meta.layout, *li = &index->meta.layout, *lo = &out->meta.layout;
  int64_t d = c->a->v[1].i;
  int nd = li->ndim;
  if (ls->ndim == 0) d = 0;
  else if (d < 0) d += ls->ndim;
  int64_t size = ls->ndim ? ls->sizes[d] : 1;
  if (check_indices(c, index, d, size, e)) return -1;

  Take f;
  cu_iter_init(&f.it, li->sizes, nd);
  cu_iter_add_raw(&f.it, cu_data(out), out->meta.dtype, lo);
  layout_t s;
  memset(&s, 0, sizeof s);
  s.ndim = nd;
  for (int k = 0; k < nd; k++) {
    s.sizes[k] = li->sizes[k];
    s.strides[k] = k != d && ls->ndim ? ls->strides[k] : 0;
  }
  cu_iter_add_raw(&f.it, cu_data(self), self->meta.dtype, &s);
  cu_iter_add(&f.it, index);
  cu_iter_coalesce(&f.it);
  f.sd = ls->ndim ? ls->strides[d] * (int64_t)cu_size(self->meta.dtype) : 0;
  f.size = size;
  return cuda_launch(c->b, c->bs, cu_iter_numel(&f.it), f, kernel_opname(c), e);
}
