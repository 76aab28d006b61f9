/* The functor matmul: one output element per index, its dot product walked in
 * order. The emulated device and integer dtypes use it; cuda_blas.c sends
 * floating products on a GPU to cuBLAS. Geometry as agent/cpu/kernels_linalg.c:
 * a 1-D self is a row [1, k], a 1-D other a column [k, 1], batch dims
 * broadcast right-aligned. */
extern "C" {
/* The core headers lack C++ guards (see kernels_reduce.cu). */
#include "ops.h"
}
#include "kernels.cuh" /* first: it prepares backend.h for C++ */
#include "cuda_blas.h"

namespace {

struct Matmul {
  dtype_t dt;
  int64_t esz;
  const char *x, *y;
  char *out;
  int nb;                          /* batch dims of the result */
  int64_t bsize[LAYOUT_MAX_DIMS];  /* their sizes */
  int64_t bx[LAYOUT_MAX_DIMS], by[LAYOUT_MAX_DIMS], bo[LAYOUT_MAX_DIMS]; /* strides, 0: broadcast */
  int64_t n, m, k;
  int64_t ars, acs, brs, bcs, crs, ccs; /* strides in elements */

  CU_HD void operator()(int64_t i) const {
    int64_t j = i % m, r = i / m, row = r % n, rem = r / n;
    int64_t offx = 0, offy = 0, offo = 0;
    for (int d = nb - 1; d >= 0; d--) {
      int64_t t = rem % bsize[d];
      rem /= bsize[d];
      offx += t * bx[d];
      offy += t * by[d];
      offo += t * bo[d];
    }
    const char *a = x + (offx + row * ars) * esz, *b = y + (offy + j * bcs) * esz;
    char *dst = out + (offo + row * crs + j * ccs) * esz;
    int64_t sa = acs * esz, sb = brs * esz;
    if (cu_is_int(dt)) {
      uint64_t acc = 0;
      for (int64_t t = 0; t < k; t++, a += sa, b += sb)
        acc += (uint64_t)cu_ld_i(dt, a) * (uint64_t)cu_ld_i(dt, b);
      cu_st_i(dt, dst, (int64_t)acc);
      return;
    }
    double acc = 0;
    for (int64_t t = 0; t < k; t++, a += sa, b += sb) {
#ifdef __CUDA_ARCH__
      /* no fused multiply-add: the cpu rounds the product, then the sum */
      acc = __dadd_rn(acc, __dmul_rn(cu_ld_f(dt, a), cu_ld_f(dt, b)));
#else
      acc += cu_ld_f(dt, a) * cu_ld_f(dt, b);
#endif
    }
    if (dt == DTYPE_FLOAT32 || dt == DTYPE_FLOAT16 || dt == DTYPE_BFLOAT16) acc = (float)acc;
    cu_st_f(dt, dst, acc);
  }
};

}  // namespace

extern "C" int cuda_matmul_functor(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *x = kernel_arg(c, 0), *y = kernel_arg(c, 1), *out = c->res[0];
  const layout_t *lx = &x->meta.layout, *ly = &y->meta.layout, *lo = &out->meta.layout;
  int n1 = lx->ndim, n2 = ly->ndim;
  Matmul f;
  memset(&f, 0, sizeof f);
  f.dt = out->meta.dtype;
  f.esz = cu_size(f.dt);
  f.x = cu_data(x);
  f.y = cu_data(y);
  f.out = cu_data(out);
  f.n = n1 > 1 ? lx->sizes[n1 - 2] : 1;
  f.k = lx->sizes[n1 - 1];
  f.m = n2 > 1 ? ly->sizes[n2 - 1] : 1;
  f.ars = n1 > 1 ? lx->strides[n1 - 2] : 0;
  f.acs = lx->strides[n1 - 1];
  f.brs = n2 > 1 ? ly->strides[n2 - 2] : ly->strides[0];
  f.bcs = n2 > 1 ? ly->strides[n2 - 1] : 0;
  f.nb = lo->ndim - (n1 > 1) - (n2 > 1);
  f.crs = n1 > 1 ? lo->strides[f.nb] : 0;
  f.ccs = n2 > 1 ? lo->strides[lo->ndim - 1] : 0;
  int bx = n1 > 2 ? n1 - 2 : 0, by = n2 > 2 ? n2 - 2 : 0;
  int64_t nbatch = 1;
  for (int d = 0; d < f.nb; d++) {
    int dx = d - (f.nb - bx), dy = d - (f.nb - by);
    f.bsize[d] = lo->sizes[d];
    f.bo[d] = lo->strides[d];
    f.bx[d] = dx >= 0 && lx->sizes[dx] != 1 ? lx->strides[dx] : 0;
    f.by[d] = dy >= 0 && ly->sizes[dy] != 1 ? ly->strides[dy] : 0;
    nbatch *= lo->sizes[d];
  }
  return cuda_launch(c->b, c->bs, nbatch * f.n * f.m, f, kernel_opname(c), e);
}
