/* Stand-ins for cuBLAS, the CUDA runtime and the cuda backend pieces that
 * cuda_blas.c calls (fake_cublas_cuda.h). A broken contract aborts the
 * process: the test that provoked it fails as crashed. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu_internal.h"
#include "cuda_blas.h"
#include "fake_device_memory.h"
#include "fake_cublas_cuda.h"

fake_counters_t fake;
cublasStatus_t fake_create_status = CUBLAS_STATUS_SUCCESS;
cublasStatus_t fake_gemm_status = CUBLAS_STATUS_SUCCESS;
int fake_malloc_fails;
int fake_scratch_fails_after = -1;


/* ------------------------------------------------------------ CUDA runtime */

cudaError_t cudaMalloc(void **p, size_t bytes) {
  if (fake_malloc_fails) {
    *p = NULL;
    return cudaErrorMemoryAllocation;
  }
  *p = fake_dev_alloc(bytes);
  fake.workspaces_live++;
  fake.device_syncs++;
  return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
  REQUIRE(p);
  fake_dev_free(p);
  fake.workspaces_live--;
  fake.device_syncs++; /* cudaFree waits for every stream of the device */
  return cudaSuccess;
}

/* The stream-ordered pair: no device-wide wait. */
cudaError_t cudaMallocFromPoolAsync(void **p, size_t bytes, cudaMemPool_t pool, cudaStream_t s) {
  REQUIRE(s);
  if (fake_malloc_fails) {
    *p = NULL;
    return cudaErrorMemoryAllocation;
  }
  *p = fake_dev_alloc(bytes);
  fake.workspaces_live++;
  return cudaSuccess;
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
  REQUIRE(p && s);
  fake_dev_free(p);
  fake.workspaces_live--;
  fake.last_free_stream = s;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  fake.get_last_error_calls++;
  return cudaErrorLaunchFailure;
}

/* ------------------------------------------- cuda helpers (cuda_device.c) */

/* As the backend's: launch failures are sticky and mark the device lost. */
int cuda_check(cuda_state_t *st, cudaError_t rc, const char *what, meshd_error_t *e) {
  if (rc == cudaSuccess) return 0;
  if (st && rc == cudaErrorLaunchFailure) st->lost = true;
  if (rc == cudaErrorMemoryAllocation)
    return error_set(e, ERR_QUOTA, "%s: fake out of device memory", what);
  return error_set(e, ERR_REMOTE_FAILURE, "%s: fake cuda error %d", what, (int)rc);
}

void *cuda_scratch_alloc(backend_t *b, backend_stream_t *bs, size_t bytes) {
  REQUIRE(b && bs);
  if (fake_scratch_fails_after >= 0 && fake.scratch_allocs >= fake_scratch_fails_after) return NULL;
  fake.scratch_allocs++;
  fake.scratch_live++;
  return fake_dev_alloc(bytes);
}

void cuda_scratch_free(backend_t *b, backend_stream_t *bs, void *p, size_t bytes) {
  REQUIRE(fake_is_dev(p, bytes));
  fake.scratch_live--;
  fake_dev_free(p);
}

/* ------------------------------------------------ kernels (kernels_*.cu) */

static char *element(const agent_tensor_t *t, const int64_t *idx) {
  const layout_t *l = &t->meta.layout;
  int64_t off = l->offset;
  for (int d = 0; d < l->ndim; d++) off += idx[d] * l->strides[d];
  return (char *)t->storage->data + off * (int64_t)dtype_size(t->meta.dtype);
}

/* dst = src broadcast to dst's shape (right-aligned); cuda_blas.c only copies
 * within one dtype. */
int cuda_copy_broadcast(backend_t *b, backend_stream_t *bs, agent_tensor_t *dst,
                        const agent_tensor_t *src, meshd_error_t *e) {
  const layout_t *ld = &dst->meta.layout, *ls = &src->meta.layout;
  REQUIRE(dst->meta.dtype == src->meta.dtype && ls->ndim <= ld->ndim);
  fake.copy_calls++;
  size_t esz = dtype_size(dst->meta.dtype);
  int64_t n = layout_numel(ld), di[LAYOUT_MAX_DIMS] = {0}, si[LAYOUT_MAX_DIMS];
  int lead = ld->ndim - ls->ndim;
  for (int d = 0; d < ls->ndim; d++) REQUIRE(ls->sizes[d] == 1 || ls->sizes[d] == ld->sizes[lead + d]);
  for (int64_t i = 0; i < n; i++) {
    for (int d = 0; d < ls->ndim; d++) si[d] = ls->sizes[d] == 1 ? 0 : di[lead + d];
    char *to = element(dst, di);
    const char *from = element(src, si);
    REQUIRE(fake_is_dev(to, esz) && fake_is_dev(from, esz));
    memcpy(to, from, esz);
    for (int d = ld->ndim - 1; d >= 0; d--) {
      if (++di[d] < ld->sizes[d]) break;
      di[d] = 0;
    }
  }
  return 0;
}

int cuda_matmul_functor(const kernel_call_t *c, meshd_error_t *e) {
  fake.functor_calls++;
  return 0;
}

/* ------------------------------------------------------------------ cuBLAS */

typedef struct {
  cudaStream_t stream;
  cublasMath_t math;
  void *ws;
  size_t ws_bytes;
} handle_t;

cublasStatus_t cublasCreate_v2(cublasHandle_t *out) {
  if (fake_create_status != CUBLAS_STATUS_SUCCESS) return fake_create_status;
  handle_t *h = calloc(1, sizeof *h);
  REQUIRE(h);
  fake.creates++;
  fake.handles_live++;
  *out = (cublasHandle_t)h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t hh) {
  REQUIRE(hh);
  free(hh);
  fake.handles_live--;
  fake.device_syncs++; /* as cuBLAS's: it implicitly calls cudaDeviceSynchronize */
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t hh, cudaStream_t s) {
  handle_t *h = (handle_t *)hh;
  h->stream = s;
  h->ws = NULL; /* as cuBLAS: setting the stream resets the workspace */
  h->ws_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t hh, cublasMath_t mode) {
  ((handle_t *)hh)->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t hh, void *ws, size_t bytes) {
  handle_t *h = (handle_t *)hh;
  if (!ws || !bytes || !fake_is_dev(ws, bytes)) return CUBLAS_STATUS_INVALID_VALUE;
  h->ws = ws;
  h->ws_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t s) {
  switch (s) {
  case CUBLAS_STATUS_EXECUTION_FAILED: return "fake execution failed";
  case CUBLAS_STATUS_NOT_SUPPORTED: return "fake not supported";
  case CUBLAS_STATUS_INVALID_VALUE: return "fake invalid value";
  default: return "fake status";
  }
}

static dtype_t dtype_of(cudaDataType t) {
  switch (t) {
  case CUDA_R_32F: return DTYPE_FLOAT32;
  case CUDA_R_64F: return DTYPE_FLOAT64;
  case CUDA_R_16F: return DTYPE_FLOAT16;
  case CUDA_R_16BF: return DTYPE_BFLOAT16;
  default: return DTYPE_INVALID;
  }
}

/* The extent of a column-major rows x cols operand with leading dimension ld,
 * over `batch` matrices `stride` apart, must lie inside one allocation. */
static bool operand_in_bounds(const void *p, int rows, int cols, int ld, long long stride,
                              int batch, size_t esz) {
  if (rows == 0 || cols == 0 || batch == 0) return true;
  if (stride < 0) return false;
  long long last = (long long)(batch - 1) * stride + (rows - 1) + (long long)(cols - 1) * ld;
  return fake_is_dev(p, (size_t)(last + 1) * esz);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t hh, cublasOperation_t ta,
                                          cublasOperation_t tb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType at,
                                          int lda, long long sa, const void *B, cudaDataType bt,
                                          int ldb, long long sb, const void *beta, void *C,
                                          cudaDataType ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  handle_t *h = (handle_t *)hh;
  REQUIRE(h && h->ws); /* a workspace set after the stream */
  fake.gemms++;
  fake.last_compute = compute;
  fake.last_type = at;
  fake.last_stream = h->stream;
  fake.last_math = h->math;
  fake.last_ws_bytes = h->ws_bytes;
  if (fake_gemm_status != CUBLAS_STATUS_SUCCESS) return fake_gemm_status;
  dtype_t dt = dtype_of(at);
  if (dt == DTYPE_INVALID || at != bt || at != ct) return CUBLAS_STATUS_NOT_SUPPORTED;
  bool f64 = compute == CUBLAS_COMPUTE_64F;
  if (f64 != (dt == DTYPE_FLOAT64) || (!f64 && compute != CUBLAS_COMPUTE_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
    return CUBLAS_STATUS_INVALID_VALUE;
  /* op(A) is m x k, op(B) k x n, C m x n; memory shapes before the op */
  int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
  int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
  if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < (ar > 1 ? ar : 1) || ldb < (br > 1 ? br : 1) ||
      ldc < (m > 1 ? m : 1))
    return CUBLAS_STATUS_INVALID_VALUE;
  size_t esz = dtype_size(dt);
  REQUIRE(operand_in_bounds(A, ar, ac, lda, sa, batch, esz));
  REQUIRE(operand_in_bounds(B, br, bc, ldb, sb, batch, esz));
  REQUIRE(operand_in_bounds(C, m, n, ldc, sc, batch, esz));
  double al = f64 ? *(const double *)alpha : *(const float *)alpha;
  double be = f64 ? *(const double *)beta : *(const float *)beta;
  for (int p = 0; p < batch; p++)
    for (int i = 0; i < m; i++)
      for (int j = 0; j < n; j++) {
        double acc = 0;
        for (int l = 0; l < k; l++) {
          long long ai = ta == CUBLAS_OP_N ? i + (long long)l * lda : l + (long long)i * lda;
          long long bi = tb == CUBLAS_OP_N ? l + (long long)j * ldb : j + (long long)l * ldb;
          acc += cpu_ld_f(dt, (const char *)A + (p * sa + ai) * (long long)esz) *
                 cpu_ld_f(dt, (const char *)B + (p * sb + bi) * (long long)esz);
        }
        char *c = (char *)C + (p * sc + i + (long long)j * ldc) * (long long)esz;
        double v = al * acc + (be != 0 ? be * cpu_ld_f(dt, c) : 0);
        cpu_st_f(dt, c, f64 ? v : (double)(float)v);
      }
  return CUBLAS_STATUS_SUCCESS;
}
