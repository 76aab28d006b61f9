/* matmul, mm, bmm: a batch of strided matrix products. float32 and float64 go
 * to OpenBLAS (packing a matrix first when neither of its dims is unit-stride);
 * other dtypes run a plain triple loop (halves accumulate in float, integers in
 * int64, as torch does). */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

/* One matrix: rows x cols with strides in elements. */
typedef struct {
  char *p;
  int64_t rows, cols, rs, cs;
} mat_t;

/* BLAS can read m as it is: row-major (NoTrans) or column-major (Trans). */
static bool blas_view(const mat_t *m, CBLAS_TRANSPOSE *tr, int64_t *ld) {
  int64_t r1 = m->rows > 1 ? m->rows : 1, c1 = m->cols > 1 ? m->cols : 1;
  if ((m->cols == 1 || m->cs == 1) && (m->rows == 1 || m->rs >= c1)) {
    *tr = CblasNoTrans;
    *ld = m->rows == 1 ? c1 : m->rs;
  } else if ((m->rows == 1 || m->rs == 1) && (m->cols == 1 || m->cs >= r1)) {
    *tr = CblasTrans;
    *ld = m->cols == 1 ? r1 : m->cs;
  } else {
    return false;
  }
  return *ld <= INT32_MAX;
}

/* A row-major copy of m in buf. */
static void pack(const mat_t *m, size_t esz, char *buf) {
  for (int64_t i = 0; i < m->rows; i++)
    for (int64_t j = 0; j < m->cols; j++)
      memcpy(buf + (i * m->cols + j) * (int64_t)esz,
             m->p + (i * m->rs + j * m->cs) * (int64_t)esz, esz);
}

/* C (n x m) = A (n x k) @ B (k x m) in dtype dt. Returns -1 when out of memory. */
static int gemm(dtype_t dt, const mat_t *A, const mat_t *B, const mat_t *C, int64_t k) {
  int64_t n = A->rows, m = B->cols;
  size_t esz = dtype_size(dt);
  if (n == 0 || m == 0) return 0;
  bool blas = (dt == DTYPE_FLOAT32 || dt == DTYPE_FLOAT64) && n <= INT32_MAX && m <= INT32_MAX &&
              k <= INT32_MAX && k > 0;
  if (blas) {
    mat_t a = *A, b = *B;
    char *abuf = NULL, *bbuf = NULL, *cbuf = NULL;
    CBLAS_TRANSPOSE ta = CblasNoTrans, tb = CblasNoTrans, tc = CblasNoTrans;
    int64_t lda = 0, ldb = 0, ldc = 0; /* set by blas_view; initialised for -O3 */
    int rc = -1;
    if (!blas_view(&a, &ta, &lda)) {
      if (!(abuf = malloc((size_t)(n * k) * esz))) goto out;
      pack(A, esz, abuf);
      a = (mat_t){abuf, n, k, k, 1};
      blas_view(&a, &ta, &lda);
    }
    if (!blas_view(&b, &tb, &ldb)) {
      if (!(bbuf = malloc((size_t)(k * m) * esz))) goto out;
      pack(B, esz, bbuf);
      b = (mat_t){bbuf, k, m, m, 1};
      blas_view(&b, &tb, &ldb);
    }
    mat_t cm = *C;
    if (!blas_view(&cm, &tc, &ldc) || tc != CblasNoTrans) {
      if (!(cbuf = malloc((size_t)(n * m) * esz))) goto out;
      cm = (mat_t){cbuf, n, m, m, 1};
      ldc = m;
    }
    if (dt == DTYPE_FLOAT32)
      cblas_sgemm(CblasRowMajor, ta, tb, (int)n, (int)m, (int)k, 1.0f, (const float *)a.p,
                  (int)lda, (const float *)b.p, (int)ldb, 0.0f, (float *)cm.p, (int)ldc);
    else
      cblas_dgemm(CblasRowMajor, ta, tb, (int)n, (int)m, (int)k, 1.0, (const double *)a.p,
                  (int)lda, (const double *)b.p, (int)ldb, 0.0, (double *)cm.p, (int)ldc);
    if (cbuf)
      for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < m; j++)
          memcpy(C->p + (i * C->rs + j * C->cs) * (int64_t)esz, cbuf + (i * m + j) * (int64_t)esz,
                 esz);
    rc = 0;
  out:
    free(abuf);
    free(bbuf);
    free(cbuf);
    return rc;
  }
  bool is_int = cpu_is_int(dt);
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < m; j++) {
      char *dst = C->p + (i * C->rs + j * C->cs) * (int64_t)esz;
      if (is_int) {
        uint64_t acc = 0;
        for (int64_t t = 0; t < k; t++)
          acc += (uint64_t)cpu_ld_i(dt, A->p + (i * A->rs + t * A->cs) * (int64_t)esz) *
                 (uint64_t)cpu_ld_i(dt, B->p + (t * B->rs + j * B->cs) * (int64_t)esz);
        cpu_st_i(dt, dst, (int64_t)acc);
      } else {
        double acc = 0;
        for (int64_t t = 0; t < k; t++)
          acc += cpu_ld_f(dt, A->p + (i * A->rs + t * A->cs) * (int64_t)esz) *
                 cpu_ld_f(dt, B->p + (t * B->rs + j * B->cs) * (int64_t)esz);
        if (dt == DTYPE_FLOAT32 || dt == DTYPE_FLOAT16 || dt == DTYPE_BFLOAT16) acc = (float)acc;
        cpu_st_f(dt, dst, acc);
      }
    }
  return 0;
}

int cpu_kernel_matmul(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *x = kernel_arg(c, 0), *y = kernel_arg(c, 1), *out = c->res[0];
  const layout_t *lx = &x->meta.layout, *ly = &y->meta.layout, *lo = &out->meta.layout;
  dtype_t dt = out->meta.dtype;
  size_t esz = dtype_size(dt);
  int n1 = lx->ndim, n2 = ly->ndim;
  /* 1-D self is a row [1, k]; 1-D other a column [k, 1]. */
  int64_t n = n1 > 1 ? lx->sizes[n1 - 2] : 1, k = lx->sizes[n1 - 1];
  int64_t m = n2 > 1 ? ly->sizes[n2 - 1] : 1;
  int64_t ars = n1 > 1 ? lx->strides[n1 - 2] : 0, acs = lx->strides[n1 - 1];
  int64_t brs = n2 > 1 ? ly->strides[n2 - 2] : ly->strides[0], bcs = n2 > 1 ? ly->strides[n2 - 1] : 0;
  int ob = lo->ndim - (n1 > 1) - (n2 > 1); /* batch dims of the result */
  int64_t crs = n1 > 1 ? lo->strides[ob] : 0, ccs = n2 > 1 ? lo->strides[lo->ndim - 1] : 0;
  int bx = n1 > 2 ? n1 - 2 : 0, by = n2 > 2 ? n2 - 2 : 0;
  int64_t nbatch = 1;
  for (int d = 0; d < ob; d++) nbatch *= lo->sizes[d];
  for (int64_t bi = 0; bi < nbatch; bi++) {
    int64_t rem = bi, offx = 0, offy = 0, offo = 0;
    for (int d = ob - 1; d >= 0; d--) {
      int64_t i = rem % lo->sizes[d];
      rem /= lo->sizes[d];
      offo += i * lo->strides[d];
      int dx = d - (ob - bx), dy = d - (ob - by);
      if (dx >= 0 && lx->sizes[dx] != 1) offx += i * lx->strides[dx];
      if (dy >= 0 && ly->sizes[dy] != 1) offy += i * ly->strides[dy];
    }
    mat_t A = {cpu_data(x) + offx * (int64_t)esz, n, k, ars, acs};
    mat_t B = {cpu_data(y) + offy * (int64_t)esz, k, m, brs, bcs};
    mat_t C = {cpu_data(out) + offo * (int64_t)esz, n, m, crs, ccs};
    if (k == 0) {
      for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < m; j++) memset(C.p + (i * crs + j * ccs) * (int64_t)esz, 0, esz);
      continue;
    }
    if (gemm(dt, &A, &B, &C, k))
      return error_set(e, ERR_REMOTE_FAILURE, "%s: out of host memory for a packed operand (rank %u)",
                       kernel_opname(c), c->rank);
  }
  return 0;
}
