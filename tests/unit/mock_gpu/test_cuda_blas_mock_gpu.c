/* cuda_blas.c's cuBLAS path (matmul mm bmm) on a mock GPU: cuBLAS, the CUDA
 * runtime and the backend helpers it calls are host fakes
 * (fake_cublas_cuda.c) with cuBLAS's column-major contract. Products over
 * random shapes, views, offsets, transposes, steps and broadcast batches must
 * equal a plain host GEMM computed from the tensors' own layouts; the handle
 * is made once per stream and released; errors name the op and free scratch. */
#include <criterion/criterion.h>
#include <string.h>

#include "cpu/cpu_internal.h"
#include "cuda_blas.h"
#include "fake_cublas_cuda.h"

static backend_t B;
static cuda_state_t ST;
static int stream_tokens[3]; /* what the fake streams point at */

static void open_backend(void) {
  memset(&ST, 0, sizeof ST);
  ST.own.s = (cudaStream_t)(void *)&stream_tokens[0];
  B = (backend_t){.impl = &ST};
}

static void close_backend(void) {
  cuda_blas_release(&B, &ST.own);
  cuda_blas_close(&B);
}

TestSuite(cuda_blas_mock_gpu, .init = open_backend, .fini = close_backend, .timeout = 30);

/* ---- tensors in fake device memory ---- */

typedef struct {
  agent_storage_t st;
  agent_tensor_t t;
} tens_t;

static unsigned long long rng = 88172645463325252ull;
static int R(int n) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (int)((rng >> 11) % (unsigned long long)n);
}

/* A view `l` on fresh storage big enough for it, filled with quarter values
 * in [-2, 2] (exact in every floating dtype, so sums are exact in double). */
static void tens_make(tens_t *x, dtype_t dt, const layout_t *l) {
  int64_t extent = l->offset + 1;
  for (int d = 0; d < l->ndim; d++) extent += l->sizes[d] > 0 ? (l->sizes[d] - 1) * l->strides[d] : 0;
  size_t esz = dtype_size(dt), bytes = (size_t)extent * esz;
  x->st = (agent_storage_t){.refs = 1, .backend = &B, .data = fake_dev_alloc(bytes), .bytes = bytes};
  x->t = (agent_tensor_t){.meta = {.dtype = dt, .layout = *l}, .storage = &x->st};
  for (int64_t i = 0; i < extent; i++) cpu_st_f(dt, (char *)x->st.data + i * (int64_t)esz, (R(17) - 8) / 4.0);
}

static void tens_free(tens_t *x) { fake_dev_free(x->st.data); }

static layout_t contiguous(int nd, const int64_t *sizes) {
  layout_t l;
  meshd_error_t e;
  cr_assert_eq(layout_contiguous(&l, sizes, nd, 1, "t", &e), 0, "%s", e.msg);
  return l;
}

/* sizes in a random memory order, maybe every second element of the
 * innermost memory dim, maybe offset. */
static layout_t random_view(int nd, const int64_t *sizes) {
  int perm[LAYOUT_MAX_DIMS];
  for (int i = 0; i < nd; i++) perm[i] = i;
  for (int i = nd - 1; i > 0; i--) {
    int j = R(i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  int64_t step = R(3) == 0 ? 2 : 1, acc = step;
  layout_t l = {.ndim = nd, .offset = R(3)};
  for (int i = nd - 1; i >= 0; i--) {
    l.sizes[perm[i]] = sizes[perm[i]];
    l.strides[perm[i]] = acc;
    acc *= sizes[perm[i]] > 0 ? sizes[perm[i]] : 1;
  }
  return l;
}

static char *element(const agent_tensor_t *t, const int64_t *idx) {
  const layout_t *l = &t->meta.layout;
  int64_t off = l->offset;
  for (int d = 0; d < l->ndim; d++) off += idx[d] * l->strides[d];
  return (char *)t->storage->data + off * (int64_t)dtype_size(t->meta.dtype);
}

/* torch.matmul of x and y by the definition, from their layouts; the number
 * of elements of out that differ from it. */
static int wrong_elements(const agent_tensor_t *x, const agent_tensor_t *y, const agent_tensor_t *out) {
  const layout_t *lx = &x->meta.layout, *ly = &y->meta.layout, *lo = &out->meta.layout;
  dtype_t dt = out->meta.dtype;
  int n1 = lx->ndim, n2 = ly->ndim, nb = lo->ndim - (n1 > 1) - (n2 > 1);
  int nbx = n1 > 2 ? n1 - 2 : 0, nby = n2 > 2 ? n2 - 2 : 0;
  int64_t k = lx->sizes[n1 - 1], total = layout_numel(lo), oi[LAYOUT_MAX_DIMS] = {0};
  int wrong = 0;
  for (int64_t e = 0; e < total; e++) {
    int64_t xi[LAYOUT_MAX_DIMS], yi[LAYOUT_MAX_DIMS];
    for (int d = 0; d < nbx; d++) xi[d] = lx->sizes[d] == 1 ? 0 : oi[nb - nbx + d];
    for (int d = 0; d < nby; d++) yi[d] = ly->sizes[d] == 1 ? 0 : oi[nb - nby + d];
    double acc = 0;
    for (int64_t l = 0; l < k; l++) {
      if (n1 > 1) xi[n1 - 2] = oi[nb], xi[n1 - 1] = l;
      else xi[0] = l;
      if (n2 > 1) yi[n2 - 2] = l, yi[n2 - 1] = oi[lo->ndim - 1];
      else yi[0] = l;
      acc += cpu_ld_f(dt, element(x, xi)) * cpu_ld_f(dt, element(y, yi));
    }
    char want[8];
    cpu_st_f(dt, want, dt == DTYPE_FLOAT64 ? acc : (double)(float)acc);
    if (memcmp(want, element(out, oi), dtype_size(dt))) {
      if (!wrong)
        cr_log_error("%s element %ld: want %g got %g", dtype_name(dt), (long)e,
                     cpu_ld_f(dt, want), cpu_ld_f(dt, element(out, oi)));
      wrong++;
    }
    for (int d = lo->ndim - 1; d >= 0; d--) {
      if (++oi[d] < lo->sizes[d]) break;
      oi[d] = 0;
    }
  }
  return wrong;
}

#define VT(x) ((op_value_t){.kind = VAL_TENSOR, .tensor = &(x)->t.meta})

/* Binds and infers `name` on x, y; out gets the inferred meta, on storage of
 * its own unless out_view (then that view of the same shape). Runs the
 * kernel on `bs` (the backend's own stream when NULL). */
static int multiply_on(backend_stream_t *bs, const char *name, tens_t *x, tens_t *y, tens_t *out,
                       const layout_t *out_view, meshd_error_t *e) {
  const op_def_t *op = ops_find(name);
  cr_assert(op, "%s", name);
  op_value_t args[2] = {VT(x), VT(y)};
  static op_args_t a; /* the kernel keeps pointers into it only during the call */
  op_infer_t inf;
  cr_assert_eq(ops_bind(op, args, 2, NULL, 0, &a, e), 0, "%s", e->msg);
  cr_assert_eq(ops_infer(&a, &inf, e), 0, "%s", e->msg);
  const layout_t *lo = &inf.results[0].meta.layout;
  layout_t l = *lo;
  if (out_view) {
    cr_assert_eq(out_view->ndim, lo->ndim);
    for (int d = 0; d < lo->ndim; d++) cr_assert_eq(out_view->sizes[d], lo->sizes[d]);
    l = *out_view;
  }
  tens_make(out, inf.results[0].meta.dtype, &l);
  memset(out->st.data, 0, out->st.bytes); /* what a k == 0 product leaves */
  agent_tensor_t *res[1] = {&out->t};
  kernel_call_t c = {.b = &B, .bs = bs ? bs : &ST.own, .a = &a, .res = res, .nres = 1,
                     .inf = &inf, .rank = 3, .coordinate = 0};
  return cuda_kernel_matmul(&c, e);
}

static int multiply(const char *name, tens_t *x, tens_t *y, tens_t *out, const layout_t *out_view,
                    meshd_error_t *e) {
  return multiply_on(NULL, name, x, y, out, out_view, e);
}

static const dtype_t FLOATS[] = {DTYPE_FLOAT32, DTYPE_FLOAT64, DTYPE_FLOAT16, DTYPE_BFLOAT16};

/* One random product: mm, bmm, or matmul with 1-D operands and broadcast
 * batches; random operand views; a strided or transposed result sometimes. */
static int random_case(int *skipped) {
  dtype_t dt = FLOATS[R(4)];
  int which = R(3);
  int64_t n = 1 + R(6), k = R(8) == 0 ? 0 : 1 + R(6), m = 1 + R(6);
  if (R(5) == 0) k = 20 + R(40);
  if (R(20) == 0) n = 0;
  int n1, n2;
  int64_t s1[LAYOUT_MAX_DIMS], s2[LAYOUT_MAX_DIMS];
  const char *name;
  if (which == 0) {
    name = "mm";
    n1 = n2 = 2;
    s1[0] = n, s1[1] = k, s2[0] = k, s2[1] = m;
  } else if (which == 1) {
    name = "bmm";
    int64_t b = 1 + R(3);
    n1 = n2 = 3;
    s1[0] = b, s1[1] = n, s1[2] = k, s2[0] = b, s2[1] = k, s2[2] = m;
  } else {
    name = "matmul";
    n1 = 1 + R(4);
    n2 = 1 + R(4);
    int64_t g[2] = {1 + R(3), 1 + R(3)}; /* the broadcast batch, right-aligned */
    int nb1 = n1 > 2 ? n1 - 2 : 0, nb2 = n2 > 2 ? n2 - 2 : 0;
    for (int i = 0; i < nb1; i++) s1[i] = R(3) ? g[2 - nb1 + i] : 1;
    for (int i = 0; i < nb2; i++) s2[i] = R(3) ? g[2 - nb2 + i] : 1;
    if (n1 >= 2) s1[n1 - 2] = n, s1[n1 - 1] = k;
    else s1[0] = k;
    if (n2 >= 2) s2[n2 - 2] = k, s2[n2 - 1] = m;
    else s2[0] = k;
  }
  layout_t l1 = random_view(n1, s1), l2 = random_view(n2, s2);
  tens_t x, y, out;
  tens_make(&x, dt, &l1);
  tens_make(&y, dt, &l2);
  meshd_error_t e = {0};
  /* the inferred result's shape, for a custom view of it */
  const op_def_t *op = ops_find(name);
  op_value_t args[2] = {VT(&x), VT(&y)};
  op_args_t a;
  op_infer_t inf;
  cr_assert_eq(ops_bind(op, args, 2, NULL, 0, &a, &e), 0, "%s", e.msg);
  cr_assert_eq(ops_infer(&a, &inf, &e), 0, "%s", e.msg);
  const layout_t *lo = &inf.results[0].meta.layout;
  layout_t ov = R(4) == 0 ? random_view(lo->ndim, lo->sizes) : *lo;
  int rc = multiply(name, &x, &y, &out, &ov, &e);
  cr_assert_eq(rc, 0, "%s %s: %s", name, dtype_name(dt), e.msg);
  int wrong = wrong_elements(&x.t, &y.t, &out.t);
  if (wrong)
    cr_log_error("%s %s n1=%d n2=%d n=%ld k=%ld m=%ld: %d wrong", name, dtype_name(dt), n1, n2,
                 (long)n, (long)k, (long)m, wrong);
  *skipped += n == 0 || k == 0;
  tens_free(&x);
  tens_free(&y);
  tens_free(&out);
  return wrong != 0;
}

Test(cuda_blas_mock_gpu, random_products_equal_a_host_gemm) {
  int failed = 0, skipped = 0, cases = 400;
  for (int i = 0; i < cases; i++) failed += random_case(&skipped);
  cr_expect_eq(failed, 0, "%d of %d products differ from the host GEMM", failed, cases);
  cr_expect_geq(fake.gemms, cases - skipped - 10, "most products ran on (fake) cuBLAS: %d",
                fake.gemms);
  cr_expect_gt(fake.copy_calls, 20, "views cuBLAS cannot read went through scratch");
  cr_expect_eq(fake.creates, 1, "one handle for the stream: %d", fake.creates);
  cr_expect_eq(fake.scratch_live, 0);
}

/* x is [n, k] stored transposed; y [k, m] with every second element. */
static void transposed_and_stepped(tens_t *x, tens_t *y, dtype_t dt) {
  int64_t n = 3, k = 4, m = 5;
  layout_t lx = {.ndim = 2, .sizes = {n, k}, .strides = {1, n}};
  layout_t ly = {.ndim = 2, .sizes = {k, m}, .strides = {2 * m, 2}, .offset = 1};
  tens_make(x, dt, &lx);
  tens_make(y, dt, &ly);
}

Test(cuda_blas_mock_gpu, transposed_operand_is_read_in_place_and_stepped_one_copied) {
  tens_t x, y, out;
  meshd_error_t e = {0};
  transposed_and_stepped(&x, &y, DTYPE_FLOAT32);
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(wrong_elements(&x.t, &y.t, &out.t), 0);
  cr_expect_eq(fake.gemms, 1);
  cr_expect_eq(fake.scratch_allocs, 1, "only the stepped operand needs a contiguous copy");
  cr_expect_eq(fake.copy_calls, 1);
  cr_expect_eq(fake.scratch_live, 0);
  tens_free(&out);

  /* a transposed result is written through scratch and copied back */
  layout_t tr = {.ndim = 2, .sizes = {3, 5}, .strides = {1, 3}};
  cr_assert_eq(multiply("mm", &x, &y, &out, &tr, &e), 0, "%s", e.msg);
  cr_expect_eq(wrong_elements(&x.t, &y.t, &out.t), 0);
  cr_expect_eq(fake.scratch_allocs, 3);
  cr_expect_eq(fake.copy_calls, 3, "stepped operand in, result out");
  cr_expect_eq(fake.scratch_live, 0);
  tens_free(&out);
  tens_free(&x);
  tens_free(&y);
}

Test(cuda_blas_mock_gpu, broadcast_batches_without_one_stride_are_expanded) {
  /* x [1, 3, 2, 4] against y [2, 1, 4, 5]: batch [2, 3]; neither has a
   * uniform batch stride */
  int64_t sx[] = {1, 3, 2, 4}, sy[] = {2, 1, 4, 5};
  layout_t lx = contiguous(4, sx), ly = contiguous(4, sy);
  tens_t x, y, out;
  tens_make(&x, DTYPE_FLOAT64, &lx);
  tens_make(&y, DTYPE_FLOAT64, &ly);
  meshd_error_t e = {0};
  cr_assert_eq(multiply("matmul", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(out.t.meta.layout.ndim, 4);
  cr_expect_eq(wrong_elements(&x.t, &y.t, &out.t), 0);
  cr_expect_eq(fake.gemms, 1, "one strided-batched GEMM for all six products");
  cr_expect_eq(fake.scratch_allocs, 2);
  cr_expect_eq(fake.scratch_live, 0);
  tens_free(&x);
  tens_free(&y);
  tens_free(&out);
}

static void square(tens_t *x, tens_t *y, dtype_t dt) {
  int64_t s[] = {4, 4};
  layout_t l = contiguous(2, s);
  tens_make(x, dt, &l);
  tens_make(y, dt, &l);
}

Test(cuda_blas_mock_gpu, compute_types_follow_the_dtype) {
  static const struct {
    dtype_t dt;
    cudaDataType type;
    cublasComputeType_t compute;
  } want[] = {{DTYPE_FLOAT16, CUDA_R_16F, CUBLAS_COMPUTE_32F},
              {DTYPE_BFLOAT16, CUDA_R_16BF, CUBLAS_COMPUTE_32F},
              {DTYPE_FLOAT32, CUDA_R_32F, CUBLAS_COMPUTE_32F},
              {DTYPE_FLOAT64, CUDA_R_64F, CUBLAS_COMPUTE_64F}};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    tens_t x, y, out;
    meshd_error_t e = {0};
    square(&x, &y, want[i].dt);
    cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
    cr_expect_eq(fake.last_type, want[i].type, "%s", dtype_name(want[i].dt));
    cr_expect_eq(fake.last_compute, want[i].compute, "%s", dtype_name(want[i].dt));
    cr_expect_eq(wrong_elements(&x.t, &y.t, &out.t), 0, "%s", dtype_name(want[i].dt));
    tens_free(&x);
    tens_free(&y);
    tens_free(&out);
  }
}

Test(cuda_blas_mock_gpu, one_handle_per_stream_with_workspace_and_no_reduced_precision) {
  tens_t x, y, out;
  meshd_error_t e = {0};
  square(&x, &y, DTYPE_FLOAT32);
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
    tens_free(&out);
  }
  cr_expect_eq(fake.creates, 1, "made by the first product on the stream, then reused");
  cr_expect_eq(fake.last_stream, ST.own.s, "bound to the stream it multiplies on");
  cr_expect_eq(fake.last_math,
               (cublasMath_t)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  cr_expect_eq(fake.last_ws_bytes, (size_t)32 << 20, "the workspace survives SetStream");
  cr_expect_eq(fake.workspaces_live, 1);
  cr_expect_eq(ST.own.blas_ws_bytes, (size_t)32 << 20);

  backend_stream_t other = {.s = (cudaStream_t)(void *)&stream_tokens[1]};
  cr_assert_eq(multiply_on(&other, "mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  tens_free(&out);
  cr_expect_eq(fake.creates, 2, "each stream its own handle");
  cr_expect_eq(fake.last_stream, other.s);
  cr_expect_eq(fake.handles_live, 2);

  cr_expect_eq(B.allocated, (uint64_t)2 * (32 << 20), "each workspace counts as device memory");
  cuda_blas_release(&B, &other);
  cuda_blas_release(&B, &ST.own);
  cuda_blas_release(&B, &ST.own); /* nothing left: no double free */
  cr_expect_eq(B.allocated, 0, "the workspaces' bytes were not given back");
  cr_expect_eq(fake.handles_live, 2, "kept for later streams");
  cr_expect_eq(ST.blas_nidle, 2);
  cr_expect_eq(fake.workspaces_live, 0);
  cr_expect(!ST.own.blas && !ST.own.blas_ws && ST.own.blas_ws_bytes == 0);
  cuda_blas_close(&B);
  cr_expect_eq(fake.handles_live, 0, "the backend's close destroys the kept handles");
  cr_expect_eq(ST.blas_nidle, 0);
  tens_free(&x);
  tens_free(&y);
  cr_expect_eq(fake_dev_live(), 0);
}

/* A stream's workspace is made and given back in the stream's own order: a
 * cudaMalloc / cudaFree (which wait for every stream of the device: every
 * session's work) at each stream's first matmul and at each stream's end
 * stalled the whole agent for the longest kernel in flight. So did the
 * handle's cublasDestroy at each stream's end: the handle is kept for the
 * next stream, which binds it to itself. */
Test(cuda_blas_mock_gpu, a_stream_workspace_comes_and_goes_without_synchronising_the_device) {
  tens_t x, y, out;
  meshd_error_t e = {0};
  square(&x, &y, DTYPE_FLOAT32);
  backend_stream_t other = {.s = (cudaStream_t)(void *)&stream_tokens[1]};
  cr_assert_eq(multiply_on(&other, "mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  tens_free(&out);
  cr_expect_eq(fake.workspaces_live, 1);
  cuda_blas_release(&B, &other); /* the stream's end (cuda_stream_destroy) */
  cr_expect_eq(fake.workspaces_live, 0);
  cr_expect_eq(fake.device_syncs, 0, "%d device-wide synchronisations for one stream's workspace "
               "and handle", fake.device_syncs);
  backend_stream_t next = {.s = (cudaStream_t)(void *)&stream_tokens[2]};
  cr_assert_eq(multiply_on(&next, "mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(wrong_elements(&x.t, &y.t, &out.t), 0);
  tens_free(&out);
  cr_expect_eq(fake.creates, 1, "the next stream made a handle instead of taking the kept one");
  cr_expect_eq(fake.last_stream, next.s, "the kept handle is bound to the stream that takes it");
  cr_expect_eq(fake.last_ws_bytes, (size_t)32 << 20, "and given that stream's workspace");
  cuda_blas_release(&B, &next);
  cr_expect_eq(fake.device_syncs, 0, "%d device-wide synchronisations", fake.device_syncs);
  cr_expect_eq(B.allocated, 0);
  tens_free(&x);
  tens_free(&y);
  cr_expect_eq(fake_dev_live(), 0);
}

/* A stream's workspace is held for good: an agent without room for it under
 * --memory-bytes fails the matmul as QUOTA, naming the workspace, makes no
 * handle, and keeps nothing; with room, the next product makes it. */
Test(cuda_blas_mock_gpu, a_workspace_without_room_is_a_quota_error) {
  tens_t x, y, out;
  meshd_error_t e = {0};
  square(&x, &y, DTYPE_FLOAT32);
  B.capacity = 16 << 20;
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), -1, "a 32 MiB workspace fit in 16 MiB");
  cr_expect_eq(e.kind, ERR_QUOTA, "%s", e.msg);
  cr_expect(strstr(e.msg, "no room on this agent for cuBLAS's 32 MiB workspace"), "%s", e.msg);
  cr_expect_eq(fake.handles_live + fake.workspaces_live, 0);
  cr_expect_eq(B.allocated, 0);
  B.capacity = 64 << 20;
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(B.allocated, (uint64_t)32 << 20);
  tens_free(&out);
  tens_free(&x);
  tens_free(&y);
}

Test(cuda_blas_mock_gpu, integers_emulation_and_empty_sizes_skip_cublas) {
  tens_t x, y, out;
  meshd_error_t e = {0};
  square(&x, &y, DTYPE_INT32);
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(fake.functor_calls, 1, "integers go to the functor matmul");
  tens_free(&out);
  tens_free(&x);
  tens_free(&y);

  square(&x, &y, DTYPE_FLOAT32);
  ST.emulated = true;
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(fake.functor_calls, 2, "the emulated device has no cuBLAS");
  ST.emulated = false;
  tens_free(&out);
  tens_free(&x);
  tens_free(&y);

  int64_t sa[] = {3, 0}, sb[] = {0, 2}, sc[] = {0, 4}, sd[] = {4, 2};
  layout_t la = contiguous(2, sa), lb = contiguous(2, sb), lc = contiguous(2, sc), ld = contiguous(2, sd);
  tens_make(&x, DTYPE_FLOAT32, &la);
  tens_make(&y, DTYPE_FLOAT32, &lb);
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(fake.functor_calls, 3, "k == 0: zeros from the functor");
  tens_free(&out);
  tens_free(&x);
  tens_free(&y);
  tens_make(&x, DTYPE_FLOAT32, &lc);
  tens_make(&y, DTYPE_FLOAT32, &ld);
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(fake.functor_calls, 3, "an empty result needs no work");
  tens_free(&out);
  tens_free(&x);
  tens_free(&y);
  cr_expect_eq(fake.gemms + fake.creates, 0, "no cuBLAS call at all");
}

Test(cuda_blas_mock_gpu, gemm_failures_name_the_op_and_free_scratch) {
  tens_t x, y, out;
  meshd_error_t e = {0};
  transposed_and_stepped(&x, &y, DTYPE_FLOAT32); /* y needs scratch */
  fake_gemm_status = CUBLAS_STATUS_EXECUTION_FAILED;
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), -1);
  cr_expect_eq(e.kind, ERR_REMOTE_FAILURE);
  cr_expect_str_eq(e.msg, "mm: cuBLAS gemm failed: fake execution failed");
  cr_expect_eq(fake.get_last_error_calls, 1, "a failed execution asks CUDA for a sticky error");
  cr_expect(ST.lost, "the sticky error reached the health state");
  cr_expect_eq(fake.scratch_live, 0);
  tens_free(&out);

  fake_gemm_status = CUBLAS_STATUS_ALLOC_FAILED;
  cr_assert_eq(multiply("matmul", &x, &y, &out, NULL, &e), -1);
  cr_expect_eq(e.kind, ERR_QUOTA);
  cr_expect_str_eq(e.msg, "matmul: cuBLAS gemm: out of device memory");
  cr_expect_eq(fake.get_last_error_calls, 1);
  cr_expect_eq(fake.scratch_live, 0);
  tens_free(&out);
  tens_free(&x);
  tens_free(&y);
}

Test(cuda_blas_mock_gpu, handle_setup_failures_leave_nothing_and_are_retried) {
  tens_t x, y, out;
  meshd_error_t e = {0};
  square(&x, &y, DTYPE_FLOAT32);
  fake_create_status = CUBLAS_STATUS_NOT_INITIALIZED;
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), -1);
  cr_expect_eq(e.kind, ERR_REMOTE_FAILURE);
  cr_expect_str_eq(e.msg, "mm: cuBLAS handle creation failed: fake status");
  cr_expect(!ST.own.blas);
  tens_free(&out);

  fake_create_status = CUBLAS_STATUS_SUCCESS;
  fake_malloc_fails = 1;
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), -1);
  cr_expect_eq(e.kind, ERR_QUOTA, "no memory for the workspace: %s", e.msg);
  cr_expect_eq(fake.handles_live, 1, "the handle is kept for the next try, not leaked");
  cr_expect_eq(ST.blas_nidle, 1);
  cr_expect(!ST.own.blas && !ST.own.blas_ws);
  tens_free(&out);

  fake_malloc_fails = 0;
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), 0, "%s", e.msg);
  cr_expect_eq(wrong_elements(&x.t, &y.t, &out.t), 0);
  cr_expect_eq(fake.handles_live, 1);
  cr_expect_eq(fake.creates, 1, "the kept handle was taken");
  cr_expect_eq(ST.blas_nidle, 0);
  tens_free(&out);
  tens_free(&x);
  tens_free(&y);
}

Test(cuda_blas_mock_gpu, out_of_scratch_is_a_quota_error_naming_the_argument) {
  tens_t x, y, out;
  meshd_error_t e = {0};
  transposed_and_stepped(&x, &y, DTYPE_FLOAT32);
  fake_scratch_fails_after = 0;
  cr_assert_eq(multiply("mm", &x, &y, &out, NULL, &e), -1);
  cr_expect_eq(e.kind, ERR_QUOTA);
  cr_expect_str_eq(e.msg, "mm: out of device memory for a 80-byte contiguous copy of argument "
                          "'other' (rank 3)");
  tens_free(&out);

  /* x copied (stepped too), then y fails: x's scratch is given back */
  layout_t lx = {.ndim = 2, .sizes = {3, 4}, .strides = {8, 2}};
  tens_t xs;
  tens_make(&xs, DTYPE_FLOAT32, &lx);
  fake_scratch_fails_after = fake.scratch_allocs + 1;
  cr_assert_eq(multiply("mm", &xs, &y, &out, NULL, &e), -1);
  cr_expect(strstr(e.msg, "argument 'other'"), "%s", e.msg);
  cr_expect_eq(fake.scratch_live, 0);
  tens_free(&out);

  /* operands fine, the transposed result's scratch fails */
  int64_t s[] = {3, 4};
  layout_t lc = contiguous(2, s), tr = {.ndim = 2, .sizes = {3, 5}, .strides = {1, 3}};
  tens_t xc;
  tens_make(&xc, DTYPE_FLOAT32, &lc);
  layout_t ly = {.ndim = 2, .sizes = {4, 5}, .strides = {5, 1}};
  tens_t yc;
  tens_make(&yc, DTYPE_FLOAT32, &ly);
  fake_scratch_fails_after = fake.scratch_allocs;
  cr_assert_eq(multiply("mm", &xc, &yc, &out, &tr, &e), -1);
  cr_expect_str_eq(e.msg, "mm: out of device memory for a 60-byte result scratch (rank 3)");
  cr_expect_eq(fake.scratch_live, 0);
  cr_expect_eq(fake.gemms, 0);
  tens_free(&out);
  tens_free(&xs);
  tens_free(&xc);
  tens_free(&yc);
  tens_free(&x);
  tens_free(&y);
}
