/* bench_gpu: the cuda backend on a GPU, each case as a ratio to a baseline
 * measured by this program in the same run.
 *
 *   bench_gpu [--device cuda:0] [--smoke] [--json FILE]
 *
 * Cases (one JSON line each on stdout, and in FILE with --json; progress on
 * stderr):
 *   gpu_device    which device ran (and whether --smoke);
 *   gpu_add       GB/s of add(a, b) on 64 MiB tensors, float32 and bfloat16,
 *                 through cuda_backend_ops.run_op on a backend stream, counting
 *                 3 x tensor bytes (two reads, one write); baseline: a
 *                 device-to-device cudaMemcpyAsync of 64 MiB on a stream of this
 *                 program, counting 2 x bytes; ratio_to_memcpy;
 *   gpu_mm        TFLOP/s of op "mm" on bfloat16 4096 x 4096 x 4096 through
 *                 run_op; baseline: cublasGemmEx on the same device buffers,
 *                 shapes and types (CUBLAS_COMPUTE_32F, default math mode and
 *                 algorithm, its own handle and stream); ratio_to_cublas;
 *   gpu_transfer  GB/s of fetch (to_host) and upload (from_host) of 256 MiB;
 *                 baseline: cudaMemcpy device->host / host->device with the same
 *                 pageable host buffers; ratio_to_cuda_memcpy;
 *   gpu_overhead  microseconds per add of 4 float32 elements (20000 in a row)
 *                 through run_op on the cuda backend, syncing its stream after
 *                 every op and only at the end; baseline: the same adds on the
 *                 cpu backend (cpu_backend_ops); ratios to cpu.
 *
 * Every timed call is queued ITERS times between two syncs (ops->stream_sync
 * or cudaStreamSynchronize), timed with clock_gettime; after a warm-up call,
 * a case and its baseline alternate round by round, and each reports its best
 * round. Not a test of speed: no pass/fail on the numbers. A device that does
 * not open (no GPU) prints {"bench":"gpu","skipped":"<why>"} and exits 0.
 *
 * --smoke: every case with tiny sizes and two iterations, for ctest on
 * "cuda:emulated" (the backend's kernels on the host). There the baselines,
 * which are CUDA runtime and cuBLAS calls, are not made: their fields read
 * "skipped" (the cpu baseline of gpu_overhead still runs). Exit status 1 when
 * a result is wrong or a call fails, else 0. */
#include <errno.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "backend.h"
#include "bench_util.h"
#include "layout.h"
#include "ops.h"

#define MIB ((size_t)1 << 20)

/* Sizes and repetitions: full run, and --smoke. */
typedef struct {
  size_t add_bytes;      /* per tensor */
  int mm_n;              /* m = n = k */
  size_t transfer_bytes;
  int overhead_iters;
  int rounds;
  int max_iters;         /* per round; calibrated to about round_s below that */
  double round_s;
} plan_t;

static const plan_t FULL = {64 * MIB, 4096, 256 * MIB, 20000, 5, 1000, 0.25};
static const plan_t SMOKE = {64 * 1024, 64, 1 * MIB, 200, 2, 2, 0};

static plan_t P;
static bool g_emulated;   /* no CUDA runtime or cuBLAS call may be made */
static FILE *g_json_file; /* --json */
static int g_rc;          /* 1 once a result was wrong */

static backend_t G; /* the cuda backend under test */
static backend_t C; /* the cpu backend: gpu_overhead's baseline */

/* ------------------------------------------------------------------ output */

static void json_numf(bench_json_t *j, const char *key, double value, int prec) {
  if (j->len >= sizeof j->buf) return;
  size_t room = sizeof j->buf - j->len;
  int n = isfinite(value) ? snprintf(j->buf + j->len, room, ",\"%s\":%.*f", key, prec, value)
                          : snprintf(j->buf + j->len, room, ",\"%s\":null", key);
  j->len += n > 0 ? (size_t)n : 0;
}

/* A baseline's field: its value, or "skipped" when the baseline did not run. */
static void json_base(bench_json_t *j, const char *key, double value, int prec, bool ran) {
  if (ran) json_numf(j, key, value, prec);
  else bench_json_str(j, key, "skipped");
}

/* `value` as a JSON string body: quotes, backslashes and control bytes escaped. */
static void json_escape(char *out, size_t cap, const char *value) {
  size_t o = 0;
  for (const char *p = value; *p && o + 7 < cap; p++) {
    unsigned char c = (unsigned char)*p;
    if (c == '"' || c == '\\') {
      out[o++] = '\\';
      out[o++] = (char)c;
    } else if (c < 0x20) {
      o += (size_t)snprintf(out + o, cap - o, "\\u%04x", c);
    } else {
      out[o++] = (char)c;
    }
  }
  out[o] = '\0';
}

static void emit(bench_json_t *j) {
  bench_json_end(j, stdout);
  if (g_json_file) bench_json_end(j, g_json_file);
}

static void fail(const char *what, const char *why) {
  fprintf(stderr, "bench_gpu: %s: %s\n", what, why);
  exit(1);
}

#define CUDA_OK(call)                                                           \
  do {                                                                          \
    cudaError_t rc_ = (call);                                                   \
    if (rc_ != cudaSuccess) fail(#call, cudaGetErrorString(rc_));               \
  } while (0)
#define CUBLAS_OK(call)                                                         \
  do {                                                                          \
    cublasStatus_t rc_ = (call);                                                \
    if (rc_ != CUBLAS_STATUS_SUCCESS) fail(#call, cublasGetStatusString(rc_));  \
  } while (0)

/* ------------------------------------------------------------------ tensors */

static agent_tensor_t *tensor_new(backend_t *b, dtype_t dt, int nd, const int64_t *sizes) {
  agent_tensor_t *t = calloc(1, sizeof *t);
  agent_storage_t *s = calloc(1, sizeof *s);
  meshd_error_t e = {0};
  if (!t || !s) fail("tensor", "out of memory");
  t->meta.dtype = dt;
  if (layout_contiguous(&t->meta.layout, sizes, nd, dtype_size(dt), "bench", &e) != 0)
    fail("layout", e.msg);
  atomic_init(&s->refs, 1);
  s->backend = b;
  s->bytes = (size_t)layout_numel(&t->meta.layout) * dtype_size(dt);
  s->data = b->ops->alloc(b, NULL, s->bytes); /* NULL stream: ready for every stream */
  if (!s->data) fail(b->ops->name, "alloc: out of device memory");
  t->storage = s;
  return t;
}

static void tensor_free(agent_tensor_t *t) {
  if (!t) return;
  backend_t *b = t->storage->backend;
  b->ops->free(b, t->storage->data, t->storage->bytes);
  free(t->storage);
  free(t);
}

static void upload(agent_tensor_t *t, const void *src) {
  meshd_error_t e = {0};
  backend_t *b = t->storage->backend;
  if (b->ops->from_host(b, NULL, t, src, &e) != 0) fail("from_host", e.msg);
}

static void fetch(const agent_tensor_t *t, void *dst) {
  meshd_error_t e = {0};
  backend_t *b = t->storage->backend;
  if (b->ops->to_host(b, NULL, t, dst, &e) != 0) fail("to_host", e.msg);
}

static uint16_t bf16_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (isnan(f)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

static float float_of_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Element i of a host buffer of dtype dt (float32 or bfloat16). */
static float host_ld(dtype_t dt, const void *p, size_t i) {
  return dt == DTYPE_BFLOAT16 ? float_of_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* A host buffer of n elements of dt, element i = f(i). Caller frees. */
static void *host_fill(dtype_t dt, size_t n, float (*f)(size_t)) {
  void *p = malloc(n * dtype_size(dt) + 1);
  if (!p) fail("malloc", strerror(errno));
  for (size_t i = 0; i < n; i++) {
    if (dt == DTYPE_BFLOAT16) ((uint16_t *)p)[i] = bf16_of(f(i));
    else ((float *)p)[i] = f(i);
  }
  return p;
}

/* ------------------------------------------------------------------ bound ops */

/* A bound, inferred op on two tensors of one backend, its result in `out`. */
typedef struct {
  backend_t *b;
  backend_stream_t *s; /* NULL on cpu */
  op_args_t a;
  op_infer_t inf;
  agent_tensor_t *out;
  bool sync_each; /* gpu_overhead: wait for every op */
} bound_t;

static void bind2(bound_t *o, backend_t *b, backend_stream_t *s, const char *name,
                  agent_tensor_t *x, agent_tensor_t *y) {
  meshd_error_t e = {0};
  const op_def_t *op = ops_find(name);
  op_value_t args[2] = {{.kind = VAL_TENSOR, .tensor = &x->meta},
                        {.kind = VAL_TENSOR, .tensor = &y->meta}};
  memset(o, 0, sizeof *o);
  if (!op || ops_bind(op, args, 2, NULL, 0, &o->a, &e) || ops_infer(&o->a, &o->inf, &e))
    fail(name, op ? e.msg : "unknown op");
  const tensor_meta_t *m = &o->inf.results[0].meta;
  o->b = b;
  o->s = s;
  o->out = tensor_new(b, m->dtype, m->layout.ndim, m->layout.sizes);
}

static void sync_bound(void *p) {
  bound_t *o = p;
  meshd_error_t e = {0};
  if (o->b->ops->stream_sync && o->b->ops->stream_sync(o->b, o->s, &e) != 0)
    fail("stream_sync", e.msg);
}

static void run_bound(void *p) {
  bound_t *o = p;
  meshd_error_t e = {0};
  agent_tensor_t *res[1] = {o->out};
  if (o->b->ops->run_op(o->b, o->s, &o->a, res, 1, &o->inf, 0, 0, &e) != 0)
    fail(op_name(o->a.op), e.msg);
  if (o->sync_each) sync_bound(o);
}

/* ------------------------------------------------------------------ timing */

/* One thing timed: `queue` queues (or runs) one call, `wait` returns once
 * every queued call has run. iters 0: calibrated to about P.round_s. */
typedef struct {
  void (*queue)(void *ctx);
  void (*wait)(void *ctx);
  void *ctx;
  int iters;
  double best_s; /* seconds per call of the best round */
} timed_t;

static void no_wait(void *ctx) { (void)ctx; }

static double time_calls(timed_t *t, int n) {
  t->wait(t->ctx);
  int64_t t0 = bench_now_ns();
  for (int i = 0; i < n; i++) t->queue(t->ctx);
  t->wait(t->ctx);
  return (double)(bench_now_ns() - t0) / 1e9;
}

/* Warms each of ts[0..n) (NULL entries: baselines not run) with one call,
 * calibrates its iterations, then P.rounds rounds of all of them in turn. */
static void measure(timed_t **ts, int n) {
  for (int k = 0; k < n; k++) {
    timed_t *t = ts[k];
    if (!t) continue;
    time_calls(t, 1);
    if (!t->iters) {
      double one = time_calls(t, 1);
      double want = one > 0 ? P.round_s / one : P.max_iters;
      t->iters = want < 2 ? 2 : want > P.max_iters ? P.max_iters : (int)want;
    }
    t->best_s = INFINITY;
  }
  for (int r = 0; r < P.rounds; r++)
    for (int k = 0; k < n; k++) {
      timed_t *t = ts[k];
      if (!t) continue;
      double per = time_calls(t, t->iters) / t->iters;
      if (per < t->best_s) t->best_s = per;
    }
}

/* ------------------------------------------------------------------ baselines (CUDA) */

static cudaStream_t g_cs;      /* the baselines' stream */
static cublasHandle_t g_blas;  /* on g_cs */

static void cuda_wait(void *ctx) {
  (void)ctx;
  CUDA_OK(cudaStreamSynchronize(g_cs));
}

typedef struct {
  void *dst;
  const void *src;
  size_t bytes;
  enum cudaMemcpyKind kind;
} copy_t;

static void queue_d2d(void *p) {
  copy_t *c = p;
  CUDA_OK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, g_cs));
}

static void run_cuda_memcpy(void *p) { /* synchronous, pageable host memory */
  copy_t *c = p;
  CUDA_OK(cudaMemcpy(c->dst, c->src, c->bytes, c->kind));
}

typedef struct {
  const void *x, *y; /* row-major n x n, bfloat16 */
  void *out;
  int n;
} gemm_t;

static void queue_gemm(void *p) {
  gemm_t *g = p;
  float alpha = 1.0f, beta = 0.0f;
  /* row-major out = x y as column-major out^T = y^T x^T */
  CUBLAS_OK(cublasGemmEx(g_blas, CUBLAS_OP_N, CUBLAS_OP_N, g->n, g->n, g->n, &alpha, g->y,
                         CUDA_R_16BF, g->n, g->x, CUDA_R_16BF, g->n, &beta, g->out, CUDA_R_16BF,
                         g->n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* ------------------------------------------------------------------ gpu_add */

static float add_x(size_t i) { return (float)(i % 97) * 0.25f; }
static float add_y(size_t i) { return 1.0f + (float)(i % 13) * 0.5f; }

/* Exact in bfloat16 too: every value fits its 8-bit significand. */
static bool add_correct(dtype_t dt, const agent_tensor_t *out, size_t n) {
  void *h = malloc(n * dtype_size(dt) + 1);
  if (!h) fail("malloc", strerror(errno));
  fetch(out, h);
  bool ok = true;
  for (size_t i = 0; i < n && ok; i += 1 + n / 4099)
    ok = host_ld(dt, h, i) == add_x(i) + add_y(i);
  ok = ok && host_ld(dt, h, n - 1) == add_x(n - 1) + add_y(n - 1);
  free(h);
  return ok;
}

static void add_case(backend_stream_t *s, dtype_t dt) {
  size_t esz = dtype_size(dt), n = P.add_bytes / esz, bytes = n * esz;
  const int64_t sz[1] = {(int64_t)n};
  agent_tensor_t *x = tensor_new(&G, dt, 1, sz), *y = tensor_new(&G, dt, 1, sz);
  agent_tensor_t *z = tensor_new(&G, dt, 1, sz); /* memcpy's destination */
  void *hx = host_fill(dt, n, add_x), *hy = host_fill(dt, n, add_y);
  upload(x, hx);
  upload(y, hy);
  bound_t op;
  bind2(&op, &G, s, "add", x, y);
  copy_t cp = {z->storage->data, x->storage->data, bytes, cudaMemcpyDeviceToDevice};
  timed_t base = {queue_d2d, cuda_wait, &cp, 0, NAN};
  timed_t kern = {run_bound, sync_bound, &op, 0, NAN};
  timed_t *ts[2] = {g_emulated ? NULL : &base, &kern};
  measure(ts, 2);
  bool ok = add_correct(dt, op.out, n);
  if (!ok) g_rc = 1;

  double add_gbs = 3.0 * (double)bytes / kern.best_s / 1e9;
  double memcpy_gbs = 2.0 * (double)bytes / base.best_s / 1e9;
  bench_json_t j;
  bench_json_begin(&j, "gpu_add");
  bench_json_str(&j, "dtype", dtype_name(dt));
  bench_json_num(&j, "elements", (double)n);
  bench_json_num(&j, "bytes_per_tensor", (double)bytes);
  bench_json_num(&j, "iters_per_round", kern.iters);
  bench_json_num(&j, "rounds", P.rounds);
  json_numf(&j, "ms_per_call", kern.best_s * 1e3, 4);
  json_numf(&j, "gb_per_s", add_gbs, 2);
  json_base(&j, "memcpy_ms_per_call", base.best_s * 1e3, 4, !g_emulated);
  json_base(&j, "memcpy_gb_per_s", memcpy_gbs, 2, !g_emulated);
  json_base(&j, "ratio_to_memcpy", add_gbs / memcpy_gbs, 3, !g_emulated);
  bench_json_str(&j, "status", ok ? "ok" : "wrong result");
  emit(&j);
  free(hx);
  free(hy);
  tensor_free(op.out);
  tensor_free(x);
  tensor_free(y);
  tensor_free(z);
}

/* ------------------------------------------------------------------ gpu_mm */

static float mm_x(size_t i) { return (float)((int)(i % 17) - 8) / 16.0f; }
static float mm_y(size_t i) { return (float)((int)(i % 13) - 6) / 8.0f; }

/* Output (r, c) against a double-precision dot product on the host; the
 * bfloat16 result is within its rounding (2^-8 relative) plus summation order. */
static bool mm_correct(const agent_tensor_t *out, int n) {
  size_t nn = (size_t)n * (size_t)n;
  uint16_t *h = malloc(nn * sizeof *h);
  if (!h) fail("malloc", strerror(errno));
  fetch(out, h);
  const int at[][2] = {{0, 0}, {n - 1, n - 1}, {n / 2, n / 3}, {1, n - 2}, {n - 3, 2}};
  bool ok = true;
  for (size_t p = 0; p < sizeof at / sizeof at[0] && ok; p++) {
    size_t r = (size_t)at[p][0], c = (size_t)at[p][1];
    double want = 0;
    for (size_t k = 0; k < (size_t)n; k++)
      want += (double)mm_x(r * (size_t)n + k) * (double)mm_y(k * (size_t)n + c);
    double got = float_of_bf16(h[r * (size_t)n + c]);
    ok = fabs(got - want) <= 1e-2 * (1 + fabs(want));
    if (!ok) fprintf(stderr, "bench_gpu: mm (%zu, %zu): %g, want %g\n", r, c, got, want);
  }
  free(h);
  return ok;
}

static void mm_case(backend_stream_t *s) {
  int n = P.mm_n;
  size_t nn = (size_t)n * (size_t)n;
  const int64_t sz[2] = {n, n};
  agent_tensor_t *x = tensor_new(&G, DTYPE_BFLOAT16, 2, sz);
  agent_tensor_t *y = tensor_new(&G, DTYPE_BFLOAT16, 2, sz);
  agent_tensor_t *c = tensor_new(&G, DTYPE_BFLOAT16, 2, sz); /* cuBLAS's result */
  void *hx = host_fill(DTYPE_BFLOAT16, nn, mm_x), *hy = host_fill(DTYPE_BFLOAT16, nn, mm_y);
  upload(x, hx);
  upload(y, hy);
  bound_t op;
  bind2(&op, &G, s, "mm", x, y);
  gemm_t g = {x->storage->data, y->storage->data, c->storage->data, n};
  timed_t base = {queue_gemm, cuda_wait, &g, 0, NAN};
  timed_t kern = {run_bound, sync_bound, &op, 0, NAN};
  timed_t *ts[2] = {g_emulated ? NULL : &base, &kern};
  measure(ts, 2);
  bool ok = mm_correct(op.out, n) && (g_emulated || mm_correct(c, n));
  if (!ok) g_rc = 1;

  double flop = 2.0 * n * (double)n * n;
  double mm_tf = flop / kern.best_s / 1e12, cublas_tf = flop / base.best_s / 1e12;
  bench_json_t j;
  bench_json_begin(&j, "gpu_mm");
  bench_json_str(&j, "dtype", "bfloat16");
  bench_json_num(&j, "m", n);
  bench_json_num(&j, "n", n);
  bench_json_num(&j, "k", n);
  bench_json_num(&j, "iters_per_round", kern.iters);
  bench_json_num(&j, "rounds", P.rounds);
  json_numf(&j, "ms_per_call", kern.best_s * 1e3, 4);
  json_numf(&j, "tflop_per_s", mm_tf, 3);
  json_base(&j, "cublas_ms_per_call", base.best_s * 1e3, 4, !g_emulated);
  json_base(&j, "cublas_tflop_per_s", cublas_tf, 3, !g_emulated);
  json_base(&j, "ratio_to_cublas", mm_tf / cublas_tf, 3, !g_emulated);
  bench_json_str(&j, "status", ok ? "ok" : "wrong result");
  emit(&j);
  free(hx);
  free(hy);
  tensor_free(op.out);
  tensor_free(x);
  tensor_free(y);
  tensor_free(c);
}

/* ------------------------------------------------------------------ gpu_transfer */

typedef struct {
  agent_tensor_t *t;
  void *host;
} xfer_t;

static void run_fetch(void *p) {
  xfer_t *x = p;
  fetch(x->t, x->host);
}

static void run_upload(void *p) {
  xfer_t *x = p;
  upload(x->t, x->host);
}

static void transfer_line(const char *direction, size_t bytes, const timed_t *kern,
                          const timed_t *base, bool ok) {
  double gbs = (double)bytes / kern->best_s / 1e9, base_gbs = (double)bytes / base->best_s / 1e9;
  bench_json_t j;
  bench_json_begin(&j, "gpu_transfer");
  bench_json_str(&j, "direction", direction);
  bench_json_str(&j, "host_memory", "pageable");
  bench_json_num(&j, "bytes", (double)bytes);
  bench_json_num(&j, "iters_per_round", kern->iters);
  bench_json_num(&j, "rounds", P.rounds);
  json_numf(&j, "ms_per_call", kern->best_s * 1e3, 3);
  json_numf(&j, "gb_per_s", gbs, 2);
  json_base(&j, "cuda_memcpy_ms_per_call", base->best_s * 1e3, 3, !g_emulated);
  json_base(&j, "cuda_memcpy_gb_per_s", base_gbs, 2, !g_emulated);
  json_base(&j, "ratio_to_cuda_memcpy", gbs / base_gbs, 3, !g_emulated);
  bench_json_str(&j, "status", ok ? "ok" : "wrong result");
  emit(&j);
}

static void transfer_case(void) {
  size_t bytes = P.transfer_bytes;
  const int64_t sz[1] = {(int64_t)bytes};
  agent_tensor_t *t = tensor_new(&G, DTYPE_UINT8, 1, sz);
  uint8_t *src = malloc(bytes), *dst = malloc(bytes);
  if (!src || !dst) fail("malloc", strerror(errno));
  for (size_t i = 0; i < bytes; i++) src[i] = (uint8_t)(i * 131 + (i >> 12));
  memset(dst, 0, bytes); /* both touched: page faults stay out of the rounds */

  xfer_t up = {t, src}, down = {t, dst};
  copy_t cup = {t->storage->data, src, bytes, cudaMemcpyHostToDevice};
  copy_t cdown = {dst, t->storage->data, bytes, cudaMemcpyDeviceToHost};
  timed_t k_up = {run_upload, no_wait, &up, 0, NAN}, k_down = {run_fetch, no_wait, &down, 0, NAN};
  timed_t b_up = {run_cuda_memcpy, no_wait, &cup, 0, NAN};
  timed_t b_down = {run_cuda_memcpy, no_wait, &cdown, 0, NAN};
  timed_t *ts[4] = {g_emulated ? NULL : &b_up, &k_up, g_emulated ? NULL : &b_down, &k_down};
  measure(ts, 4);
  /* every copy above moved src's bytes; the last fetch left them in dst */
  bool ok = memcmp(src, dst, bytes) == 0;
  if (!ok) g_rc = 1;
  transfer_line("fetch", bytes, &k_down, &b_down, ok);
  transfer_line("upload", bytes, &k_up, &b_up, ok);
  free(src);
  free(dst);
  tensor_free(t);
}

/* ------------------------------------------------------------------ gpu_overhead */

#define TINY_N 4

static float tiny_x(size_t i) { return (float)i; }
static float tiny_y(size_t i) { return 0.5f + (float)i; }

typedef struct {
  agent_tensor_t *x, *y;
  bound_t op;
} tiny_t;

static void tiny_new(tiny_t *t, backend_t *b, backend_stream_t *s, bool sync_each) {
  const int64_t sz[1] = {TINY_N};
  float hx[TINY_N], hy[TINY_N];
  for (size_t i = 0; i < TINY_N; i++) hx[i] = tiny_x(i), hy[i] = tiny_y(i);
  t->x = tensor_new(b, DTYPE_FLOAT32, 1, sz);
  t->y = tensor_new(b, DTYPE_FLOAT32, 1, sz);
  upload(t->x, hx);
  upload(t->y, hy);
  bind2(&t->op, b, s, "add", t->x, t->y);
  t->op.sync_each = sync_each;
}

static bool tiny_done(tiny_t *t) {
  float h[TINY_N];
  fetch(t->op.out, h);
  bool ok = true;
  for (size_t i = 0; i < TINY_N; i++) ok = ok && h[i] == tiny_x(i) + tiny_y(i);
  tensor_free(t->op.out);
  tensor_free(t->x);
  tensor_free(t->y);
  return ok;
}

static void overhead_case(backend_stream_t *s) {
  tiny_t each, end, cpu;
  tiny_new(&each, &G, s, true);
  tiny_new(&end, &G, s, false);
  tiny_new(&cpu, &C, NULL, false);
  int n = P.overhead_iters;
  timed_t k_each = {run_bound, sync_bound, &each.op, n, NAN};
  timed_t k_end = {run_bound, sync_bound, &end.op, n, NAN};
  timed_t base = {run_bound, sync_bound, &cpu.op, n, NAN};
  timed_t *ts[3] = {&base, &k_each, &k_end};
  measure(ts, 3);
  bool ok = tiny_done(&each);
  ok = tiny_done(&end) && ok; /* each frees its tensors: all three run */
  ok = tiny_done(&cpu) && ok;
  if (!ok) g_rc = 1;

  double us_each = k_each.best_s * 1e6, us_end = k_end.best_s * 1e6, us_cpu = base.best_s * 1e6;
  bench_json_t j;
  bench_json_begin(&j, "gpu_overhead");
  bench_json_str(&j, "op", "add");
  bench_json_str(&j, "dtype", "float32");
  bench_json_num(&j, "elements", TINY_N);
  bench_json_num(&j, "iters_per_round", n);
  bench_json_num(&j, "rounds", P.rounds);
  json_numf(&j, "us_per_op_sync_each", us_each, 3);
  json_numf(&j, "us_per_op_sync_end", us_end, 3);
  json_numf(&j, "cpu_us_per_op", us_cpu, 3);
  json_numf(&j, "ratio_sync_each_to_cpu", us_each / us_cpu, 2);
  json_numf(&j, "ratio_sync_end_to_cpu", us_end / us_cpu, 2);
  bench_json_str(&j, "status", ok ? "ok" : "wrong result");
  emit(&j);
}

/* ------------------------------------------------------------------ main */

static void usage(void) {
  fprintf(stderr, "usage: bench_gpu [--device cuda:N|cuda:emulated] [--smoke] [--json FILE]\n");
  exit(2);
}

static void device_line(const char *device, bool smoke) {
  bench_json_t j;
  bench_json_begin(&j, "gpu_device");
  bench_json_str(&j, "device", device);
  if (!g_emulated) {
    int ordinal;
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDevice(&ordinal));
    CUDA_OK(cudaGetDeviceProperties(&prop, ordinal));
    char name[2 * sizeof prop.name];
    json_escape(name, sizeof name, prop.name);
    bench_json_str(&j, "name", name);
    json_numf(&j, "sm", prop.major * 10 + prop.minor, 0);
    json_numf(&j, "memory_gib", (double)prop.totalGlobalMem / (double)(1u << 30), 1);
  } else {
    bench_json_str(&j, "name", "emulated (kernels on the host)");
  }
  json_numf(&j, "smoke", smoke, 0);
  emit(&j);
}

int main(int argc, char **argv) {
  const char *device = "cuda:0", *json_path = NULL;
  bool smoke = false;
  for (int i = 1; i < argc; i++) {
    const char *v;
    if ((v = bench_arg(argc, argv, &i, "--device"))) device = v;
    else if ((v = bench_arg(argc, argv, &i, "--json"))) json_path = v;
    else if (strcmp(argv[i], "--smoke") == 0) smoke = true;
    else usage();
  }
  if (backend_for_device(device) != &cuda_backend_ops) {
    fprintf(stderr, "bench_gpu: '%s' is not a cuda device (cuda:N or cuda:emulated)\n", device);
    usage();
  }
  if (json_path && !(g_json_file = fopen(json_path, "w"))) fail(json_path, strerror(errno));
  P = smoke ? SMOKE : FULL;
  g_emulated = strcmp(device, "cuda:emulated") == 0;

  meshd_error_t e = {0};
  G.ops = &cuda_backend_ops;
  if (cuda_backend_ops.open(&G, device, &e) != 0) {
    char why[2 * sizeof e.msg];
    json_escape(why, sizeof why, e.msg);
    bench_json_t j;
    bench_json_begin(&j, "gpu");
    bench_json_str(&j, "skipped", why);
    emit(&j);
    if (g_json_file) fclose(g_json_file);
    return 0;
  }
  C.ops = &cpu_backend_ops;
  if (cpu_backend_ops.open(&C, "cpu", &e) != 0) fail("cpu backend", e.msg);
  backend_stream_t *s = cuda_backend_ops.stream_create(&G);
  if (!s) fail("stream_create", "no stream");
  if (!g_emulated) {
    CUDA_OK(cudaStreamCreateWithFlags(&g_cs, cudaStreamNonBlocking));
    CUBLAS_OK(cublasCreate(&g_blas));
    CUBLAS_OK(cublasSetStream(g_blas, g_cs));
  }

  device_line(device, smoke);
  fprintf(stderr, "bench_gpu: add (float32, bfloat16) on %s\n", device);
  add_case(s, DTYPE_FLOAT32);
  add_case(s, DTYPE_BFLOAT16);
  fprintf(stderr, "bench_gpu: mm (bfloat16)\n");
  mm_case(s);
  fprintf(stderr, "bench_gpu: fetch / upload\n");
  transfer_case();
  fprintf(stderr, "bench_gpu: per-op overhead\n");
  overhead_case(s);

  if (!g_emulated) {
    CUBLAS_OK(cublasDestroy(g_blas));
    CUDA_OK(cudaStreamDestroy(g_cs));
  }
  cuda_backend_ops.stream_destroy(&G, s);
  cuda_backend_ops.close(&G);
  cpu_backend_ops.close(&C);
  if (g_json_file && fclose(g_json_file) != 0) fail(json_path, strerror(errno));
  return g_rc;
}
