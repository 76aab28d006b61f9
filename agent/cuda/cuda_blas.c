/* matmul, mm, bmm on cuBLAS: one strided-batched GEMM per call, in the row-major
 * trick (C^T = B^T A^T: cuBLAS is column-major). float16/bfloat16 compute in
 * float32 (tensor cores), float32 in full float32 (no TF32), float64 in
 * float64. Operands cuBLAS cannot address (no unit stride in the matrix, or
 * batch offsets that are not one uniform stride) are first copied to
 * contiguous scratch. The emulated device, integer dtypes, k == 0 and sizes
 * past cuBLAS's int range go to the functor matmul (kernels_matmul.cu).
 *
 * Results differ from the cpu backend's within float rounding: its float32 and
 * float64 go through OpenBLAS, its 16-bit floats through a double loop. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <cublas_v2.h>

#include "cuda_blas.h"

/* ---- cuBLAS, opened on first use ----
 *
 * Not linked: libcublasLt's initialisers cost every process that loads it
 * about 0.4 s of CPU, which every agent of a cuda build paid at start, cpu
 * agents included. The first matmul on a GPU opens it: symbols the process
 * already has come first (the mock-GPU suite defines its fakes), then
 * libcublas.so.<major> by the loader's search, then the toolkit's copy this
 * build linked against. Every call below goes through the table. */
#define BLAS_FUNCS(X)                                                                              \
  X(cublasCreate)                                                                                  \
  X(cublasDestroy)                                                                                 \
  X(cublasSetStream)                                                                               \
  X(cublasSetMathMode)                                                                             \
  X(cublasSetWorkspace)                                                                            \
  X(cublasGetStatusString)                                                                         \
  X(cublasGemmStridedBatchedEx)
/* The exported name: several are macros for their _v2 functions. */
#define BLAS_NAME_(f) #f
#define BLAS_NAME(f) BLAS_NAME_(f)

static struct {
#define X(f) __typeof__(f) *f;
  BLAS_FUNCS(X)
#undef X
} blas;
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static char blas_why[320]; /* why it could not be opened; "" once it is */

/* The handle to look the functions up in (RTLD_DEFAULT is NULL); false with
 * blas_why set when there is none. */
static bool blas_open(void **h) {
  *h = RTLD_DEFAULT;
  if (dlsym(RTLD_DEFAULT, BLAS_NAME(cublasCreate))) return true;
  char name[32];
  snprintf(name, sizeof name, "libcublas.so.%d", CUBLAS_VER_MAJOR);
  if ((*h = dlopen(name, RTLD_NOW | RTLD_LOCAL))) return true;
  snprintf(blas_why, sizeof blas_why, "%s", dlerror());
#ifdef MESHD_CUBLAS_PATH
  if ((*h = dlopen(MESHD_CUBLAS_PATH, RTLD_NOW | RTLD_LOCAL))) return true;
#endif
  return false;
}

static void blas_load(void) {
  void *h;
  if (!blas_open(&h)) return;
#define X(f)                                                                                       \
  if (!(*(void **)&blas.f = dlsym(h, BLAS_NAME(f)))) {                                             \
    snprintf(blas_why, sizeof blas_why, "%s", dlerror());                                          \
    return;                                                                                        \
  }
  BLAS_FUNCS(X)
#undef X
  blas_why[0] = '\0';
}

bool cuda_blas_available(const char **why) {
  pthread_once(&blas_once, blas_load);
  if (why) *why = blas_why;
  return blas_why[0] == '\0';
}

/* Each stream's cuBLAS workspace (cuBLAS recommends 32 MiB on Hopper). */
#define BLAS_WS_BYTES ((size_t)32 << 20)

/* One matrix of batch 0: rows x cols, strides in elements. */
typedef struct {
  char *p;
  int64_t rows, cols, rs, cs;
} mat_t;

/* An operand as cuBLAS reads it: the column-major matrix in memory, whether it
 * is the transpose of the row-major one (op N) or the matrix itself (op T),
 * and its batch stride. */
typedef struct {
  cublasOperation_t op;
  int64_t ld, batch_stride;
} blas_mat_t;

static char *tensor_data(const agent_tensor_t *t) {
  return (char *)t->storage->data + t->meta.layout.offset * (int64_t)dtype_size(t->meta.dtype);
}

static int blas_error(const kernel_call_t *c, cublasStatus_t rc, const char *step,
                      meshd_error_t *e) {
  /* a failed execution may have killed the context: let the health slot see it */
  if (rc == CUBLAS_STATUS_EXECUTION_FAILED)
    (void)cuda_check(cuda_state(c->b), cudaGetLastError(), kernel_opname(c), NULL);
  if (rc == CUBLAS_STATUS_ALLOC_FAILED)
    return error_set(e, ERR_QUOTA, "%s: cuBLAS %s: out of device memory", kernel_opname(c), step);
  return error_set(e, ERR_REMOTE_FAILURE, "%s: cuBLAS %s failed: %s", kernel_opname(c), step,
                   blas.cublasGetStatusString(rc));
}

/* Handles are made lazily by whichever thread first multiplies on a stream;
 * the backend's own stream may be used by several. */
static pthread_mutex_t handle_mu = PTHREAD_MUTEX_INITIALIZER;

/* A handle no stream uses any more, kept for the next (bound to its stream
 * and given its workspace then: cublasSetStream and cublasSetWorkspace do not
 * synchronise); destroyed only past the pool's room. handle_mu held. */
static void handle_put_locked(cuda_state_t *st, cublasHandle_t h) {
  int room = (int)(sizeof st->blas_idle / sizeof st->blas_idle[0]);
  if (st->blas_nidle < room) st->blas_idle[st->blas_nidle++] = (void *)h;
  else blas.cublasDestroy(h);
}

static int blas_handle(const kernel_call_t *c, cublasHandle_t *out, meshd_error_t *e) {
  backend_stream_t *bs = c->bs;
  cublasHandle_t h = NULL;
  void *ws = NULL;
  cublasStatus_t rc;
  int ret = 0;
  bool broken = false; /* h failed its setup: destroyed, not kept */
  const char *why;
  *out = NULL;
  if (!cuda_blas_available(&why))
    return error_set(e, ERR_REMOTE_FAILURE, "%s: cuBLAS could not be loaded: %s", kernel_opname(c),
                     why);
  cuda_state_t *st = cuda_state(c->b);
  bool reserved = false;
  pthread_mutex_lock(&handle_mu);
  if (bs->blas) goto out;
  /* The workspace is device memory the stream holds for good: counted
   * against --memory-bytes like a tensor, before anything is made. */
  if (!backend_reserve(c->b, BLAS_WS_BYTES)) {
    ret = error_set(e, ERR_QUOTA,
                    "%s: no room on this agent for cuBLAS's %d MiB workspace of this stream (it "
                    "holds %llu of its %llu bytes); drop tensors you no longer need",
                    kernel_opname(c), (int)(BLAS_WS_BYTES >> 20),
                    (unsigned long long)atomic_load(&c->b->allocated),
                    (unsigned long long)c->b->capacity);
    goto out;
  }
  reserved = true;
  if (st->blas_nidle > 0) {
    h = (cublasHandle_t)st->blas_idle[--st->blas_nidle]; /* an ended stream's */
  } else if ((rc = blas.cublasCreate(&h)) != CUBLAS_STATUS_SUCCESS) {
    h = NULL;
    ret = blas_error(c, rc, "handle creation", e);
    goto out;
  }
  /* SetStream resets the workspace, so it comes first. */
  if ((rc = blas.cublasSetStream(h, bs->s)) != CUBLAS_STATUS_SUCCESS ||
      (rc = blas.cublasSetMathMode(h, CUBLAS_DEFAULT_MATH |
                                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)) !=
          CUBLAS_STATUS_SUCCESS) {
    broken = true;
    ret = blas_error(c, rc, "handle setup", e);
    goto out;
  }
  /* From the device's pool in the stream's order, given back the same way
   * (cuda_blas_release): cudaMalloc / cudaFree wait for every stream of the
   * device, every session's work. */
  if ((ret = cuda_check(st, cudaMallocFromPoolAsync(&ws, BLAS_WS_BYTES, st->pool, bs->s),
                        kernel_opname(c), e)) != 0) {
    ws = NULL;
    goto out;
  }
  if ((rc = blas.cublasSetWorkspace(h, ws, BLAS_WS_BYTES)) != CUBLAS_STATUS_SUCCESS) {
    broken = true;
    ret = blas_error(c, rc, "workspace setup", e);
    goto out;
  }
  bs->blas = h;
  bs->blas_ws = ws;
  bs->blas_ws_bytes = BLAS_WS_BYTES;
  h = NULL;
  ws = NULL;
  reserved = false; /* the stream's now */
out:
  if (h && broken) blas.cublasDestroy(h);
  else if (h) handle_put_locked(st, h); /* (no memory for the workspace: kept for later) */
  if (ws) cudaFreeAsync(ws, bs->s);
  if (reserved) backend_unreserve(c->b, BLAS_WS_BYTES);
  *out = (cublasHandle_t)bs->blas;
  pthread_mutex_unlock(&handle_mu);
  return ret;
}

void cuda_blas_release(backend_t *b, backend_stream_t *bs) {
  if (bs->blas) {
    pthread_mutex_lock(&handle_mu);
    handle_put_locked(cuda_state(b), (cublasHandle_t)bs->blas);
    pthread_mutex_unlock(&handle_mu);
  }
  if (bs->blas_ws) {
    cudaFreeAsync(bs->blas_ws, bs->s); /* after the stream's last use: no device-wide wait */
    backend_unreserve(b, bs->blas_ws_bytes);
  }
  bs->blas = NULL;
  bs->blas_ws = NULL;
  bs->blas_ws_bytes = 0;
}

void cuda_blas_close(backend_t *b) {
  cuda_state_t *st = cuda_state(b);
  pthread_mutex_lock(&handle_mu);
  while (st->blas_nidle > 0) blas.cublasDestroy((cublasHandle_t)st->blas_idle[--st->blas_nidle]);
  pthread_mutex_unlock(&handle_mu);
}

/* ---- geometry ---- */

/* Whether batch offsets sum_d idx[d] * s[d] over sizes bsize[0..nb) are
 * bi * *q for the flat batch index bi. */
static bool uniform_batch(const int64_t *bsize, const int64_t *s, int nb, int64_t *q) {
  int64_t inner = 1;
  *q = 0;
  bool have = false;
  for (int d = nb - 1; d >= 0; d--) {
    if (bsize[d] == 1) continue;
    if (!have) {
      *q = s[d];
      have = true;
    } else if (s[d] != *q * inner) {
      return false;
    }
    inner *= bsize[d];
  }
  return true;
}

/* A row-major rows x cols matrix as cuBLAS can read it (kernels_linalg.c's
 * blas_view, column-major side): false when neither dim has a unit stride. */
static bool blas_view(const mat_t *m, blas_mat_t *v) {
  int64_t r1 = m->rows > 1 ? m->rows : 1, c1 = m->cols > 1 ? m->cols : 1;
  if ((m->cols == 1 || m->cs == 1) && (m->rows == 1 || m->rs >= c1)) {
    v->op = CUBLAS_OP_N; /* memory holds the transpose, column-major */
    v->ld = m->rows == 1 ? c1 : m->rs;
  } else if ((m->rows == 1 || m->rs == 1) && (m->cols == 1 || m->cs >= r1)) {
    v->op = CUBLAS_OP_T; /* memory holds the matrix, column-major */
    v->ld = m->cols == 1 ? r1 : m->cs;
  } else {
    return false;
  }
  return v->ld <= INT32_MAX;
}

/* One operand of the product: its tensor, which matrix dims it has (a 1-D self
 * is a row, a 1-D other a column), and what cuBLAS gets. */
typedef struct {
  const agent_tensor_t *t;
  bool is_self;
  mat_t m;
  blas_mat_t v;
  agent_storage_t scratch_st; /* when copied: the scratch behind `copy` */
  agent_tensor_t copy;
  size_t scratch_bytes;
} operand_t;

/* Matrix and batch strides of layout l as operand `self` (true) or `other`,
 * against the result's nb batch dims (0 where l broadcasts). */
static void operand_geometry(const layout_t *l, bool self, int nb, mat_t *m, int64_t *s) {
  int nd = l->ndim, own = nd > 2 ? nd - 2 : 0;
  if (self) {
    m->rows = nd > 1 ? l->sizes[nd - 2] : 1;
    m->cols = l->sizes[nd - 1];
    m->rs = nd > 1 ? l->strides[nd - 2] : 0;
    m->cs = l->strides[nd - 1];
  } else {
    m->rows = nd > 1 ? l->sizes[nd - 2] : l->sizes[0];
    m->cols = nd > 1 ? l->sizes[nd - 1] : 1;
    m->rs = nd > 1 ? l->strides[nd - 2] : l->strides[0];
    m->cs = nd > 1 ? l->strides[nd - 1] : 0;
  }
  for (int d = 0; d < nb; d++) {
    int od = d - (nb - own);
    s[d] = od >= 0 && l->sizes[od] != 1 ? l->strides[od] : 0;
  }
}

/* Fills o->m, o->v, o->v.batch_stride, copying the operand to contiguous
 * scratch when cuBLAS cannot read it as it is. */
static int operand_prepare(const kernel_call_t *c, operand_t *o, int nb, const int64_t *bsize,
                           meshd_error_t *e) {
  const layout_t *l = &o->t->meta.layout;
  int64_t s[LAYOUT_MAX_DIMS];
  operand_geometry(l, o->is_self, nb, &o->m, s);
  o->m.p = tensor_data(o->t);
  if (uniform_batch(bsize, s, nb, &o->v.batch_stride) && blas_view(&o->m, &o->v)) return 0;

  /* A contiguous copy of its own shape; of the broadcast shape when even that
   * has no uniform batch stride. */
  layout_t cl = *l;
  layout_make_contiguous(&cl);
  operand_geometry(&cl, o->is_self, nb, &o->m, s);
  if (!uniform_batch(bsize, s, nb, &o->v.batch_stride)) {
    int nd = l->ndim, k = 0;
    cl.ndim = nb + (nd > 1 ? 2 : 1);
    for (int d = 0; d < nb; d++) cl.sizes[k++] = bsize[d];
    for (int d = nd > 1 ? nd - 2 : 0; d < nd; d++) cl.sizes[k++] = l->sizes[d];
    layout_make_contiguous(&cl);
    operand_geometry(&cl, o->is_self, nb, &o->m, s);
    uniform_batch(bsize, s, nb, &o->v.batch_stride);
  }
  dtype_t dt = o->t->meta.dtype;
  o->scratch_bytes = (size_t)layout_numel(&cl) * dtype_size(dt);
  void *p = cuda_scratch_alloc(c->b, c->bs, o->scratch_bytes ? o->scratch_bytes : 1);
  if (!p)
    return error_set(e, ERR_QUOTA, "%s: out of device memory for a %zu-byte contiguous copy of "
                     "argument '%s' (rank %u)", kernel_opname(c), o->scratch_bytes,
                     o->is_self ? "self" : "other", c->rank);
  o->scratch_st = (agent_storage_t){.refs = 1, .backend = c->b, .data = p,
                                    .bytes = o->scratch_bytes};
  o->copy = (agent_tensor_t){.meta = {.dtype = dt, .layout = cl}, .storage = &o->scratch_st};
  o->m.p = p;
  blas_view(&o->m, &o->v);
  return cuda_copy_broadcast(c->b, c->bs, &o->copy, o->t, e);
}

static void operand_release(const kernel_call_t *c, operand_t *o) {
  if (o->scratch_st.data) cuda_scratch_free(c->b, c->bs, o->scratch_st.data,
                                            o->scratch_bytes ? o->scratch_bytes : 1);
}

/* The cuBLAS types of dt; false for dtypes it does not multiply. */
static bool blas_types(dtype_t dt, cudaDataType *type, cublasComputeType_t *compute) {
  switch (dt) {
    case DTYPE_FLOAT16: *type = CUDA_R_16F; *compute = CUBLAS_COMPUTE_32F; return true;
    case DTYPE_BFLOAT16: *type = CUDA_R_16BF; *compute = CUBLAS_COMPUTE_32F; return true;
    case DTYPE_FLOAT32: *type = CUDA_R_32F; *compute = CUBLAS_COMPUTE_32F; return true;
    case DTYPE_FLOAT64: *type = CUDA_R_64F; *compute = CUBLAS_COMPUTE_64F; return true;
    default: return false;
  }
}

int cuda_kernel_matmul(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *x = kernel_arg(c, 0), *y = kernel_arg(c, 1), *out = c->res[0];
  const layout_t *lx = &x->meta.layout, *ly = &y->meta.layout, *lo = &out->meta.layout;
  dtype_t dt = out->meta.dtype;
  cudaDataType type;
  cublasComputeType_t compute;
  if (cuda_emulated(c) || !blas_types(dt, &type, &compute)) return cuda_matmul_functor(c, e);

  int n1 = lx->ndim, n2 = ly->ndim;
  int64_t n = n1 > 1 ? lx->sizes[n1 - 2] : 1, k = lx->sizes[n1 - 1];
  int64_t m = n2 > 1 ? ly->sizes[n2 - 1] : 1;
  int nb = lo->ndim - (n1 > 1) - (n2 > 1);
  int64_t nbatch = 1;
  for (int d = 0; d < nb; d++) nbatch *= lo->sizes[d];
  if (n == 0 || m == 0 || nbatch == 0) return 0;
  if (k == 0 || n > INT32_MAX || m > INT32_MAX || k > INT32_MAX || nbatch > INT32_MAX)
    return cuda_matmul_functor(c, e); /* zeros; or sizes past cuBLAS's int */

  const int64_t *bsize = lo->sizes;
  operand_t a = {.t = x, .is_self = true}, b = {.t = y, .is_self = false};
  /* The result, written in place when it is row-major with a uniform batch
   * stride (fresh results are), else through a contiguous scratch. */
  operand_t r = {.t = out, .is_self = true};
  int64_t rs[LAYOUT_MAX_DIMS];
  int64_t crs = n1 > 1 ? lo->strides[nb] : 0, ccs = n2 > 1 ? lo->strides[lo->ndim - 1] : 0;
  r.m = (mat_t){tensor_data(out), n, m, crs, ccs};
  for (int d = 0; d < nb; d++) rs[d] = lo->strides[d];
  bool direct = uniform_batch(bsize, rs, nb, &r.v.batch_stride) && blas_view(&r.m, &r.v) &&
                r.v.op == CUBLAS_OP_N;
  int ret = 0;
  if ((ret = operand_prepare(c, &a, nb, bsize, e)) != 0) goto out;
  if ((ret = operand_prepare(c, &b, nb, bsize, e)) != 0) goto out;
  if (!direct) {
    layout_t cl = *lo;
    layout_make_contiguous(&cl);
    r.scratch_bytes = (size_t)layout_numel(&cl) * dtype_size(dt);
    void *p = cuda_scratch_alloc(c->b, c->bs, r.scratch_bytes);
    if (!p) {
      ret = error_set(e, ERR_QUOTA, "%s: out of device memory for a %zu-byte result scratch "
                      "(rank %u)", kernel_opname(c), r.scratch_bytes, c->rank);
      goto out;
    }
    r.scratch_st = (agent_storage_t){.refs = 1, .backend = c->b, .data = p,
                                     .bytes = r.scratch_bytes};
    r.copy = (agent_tensor_t){.meta = {.dtype = dt, .layout = cl}, .storage = &r.scratch_st};
    r.m = (mat_t){p, n, m, n1 > 1 ? cl.strides[nb] : 0, n2 > 1 ? cl.strides[cl.ndim - 1] : 0};
    for (int d = 0; d < nb; d++) rs[d] = cl.strides[d];
    uniform_batch(bsize, rs, nb, &r.v.batch_stride);
    blas_view(&r.m, &r.v);
  }

  cublasHandle_t h;
  if ((ret = blas_handle(c, &h, e)) != 0) goto out;
  float alpha_f = 1.0f, beta_f = 0.0f;
  double alpha_d = 1.0, beta_d = 0.0;
  bool f64 = compute == CUBLAS_COMPUTE_64F;
  /* column-major: C^T (m x n) = op(B-memory) (m x k) * op(A-memory) (k x n) */
  cublasStatus_t rc = blas.cublasGemmStridedBatchedEx(
      h, b.v.op, a.v.op, (int)m, (int)n, (int)k, f64 ? (const void *)&alpha_d : &alpha_f,
      b.m.p, type, (int)b.v.ld, b.v.batch_stride, a.m.p, type, (int)a.v.ld, a.v.batch_stride,
      f64 ? (const void *)&beta_d : &beta_f, r.m.p, type, (int)r.v.ld, r.v.batch_stride,
      (int)nbatch, compute, CUBLAS_GEMM_DEFAULT);
  if (rc != CUBLAS_STATUS_SUCCESS) {
    ret = blas_error(c, rc, "gemm", e);
    goto out;
  }
  if (!direct) ret = cuda_copy_broadcast(c->b, c->bs, out, &r.copy, e);
out:
  operand_release(c, &a);
  operand_release(c, &b);
  operand_release(c, &r);
  return ret;
}
