/* The cuda backend against the cpu backend, op by op: fixed, seeded random
 * cases for every op family of the catalogue (core/tensor/ops*.c) and every dtype,
 * on strided, permuted, offset and broadcast views, scalars, NaN/inf/±0/ties,
 * empty tensors and index errors. Each case runs on "cpu" and on
 * "cuda:emulated" (the cuda kernels' functors on the host) with identical
 * inputs; both must succeed or fail alike (same error kind and message), give
 * the same result bytes, write mutated inputs alike and leave every other input
 * untouched. Where the backends are documented to differ
 * (agent/cuda/kernels_reduce.cu, agent/cuda/cuda_blas.c) results are compared
 * within a tight tolerance, NaN as NaN: float32/float64 matmul (cpu: OpenBLAS)
 * and float sums, means, products and softmax on the two-stage path.
 * cuda_reduce_slices is checked against the cpu data plane's reductions.
 *
 * A failure names the family, the case index and its seed, the op and every
 * argument (dtype, sizes, strides, offset, scalars); cases are deterministic,
 * so rerunning the test reproduces it. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#ifdef MESHD_HAVE_CUDA

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu_internal.h"
#include "dataplane/reduce_ops.h"
#include "cuda/cuda_internal.h"

/* ------------------------------------------------------------------ harness */

static backend_t bk[2];
static const backend_ops_t *bops[2];
static const char *const bname[2] = {"cpu", "cuda:emulated"};

static void setup(void) {
  bops[0] = &cpu_backend_ops;
  bops[1] = &cuda_backend_ops;
  for (int b = 0; b < 2; b++) {
    memset(&bk[b], 0, sizeof bk[b]);
    bk[b].ops = bops[b];
    meshd_error_t e = {0};
    cr_assert_eq(bops[b]->open(&bk[b], bname[b], &e), 0, "open %s: %s", bname[b], e.msg);
  }
}

static void teardown(void) {
  for (int b = 0; b < 2; b++) bops[b]->close(&bk[b]);
}

TestSuite(backend_differential, .init = setup, .fini = teardown);

/* xorshift64, reseeded per case from (family seed, case index). */
static uint64_t rs;
static uint64_t case_seed;
static uint64_t rnd(void) {
  rs ^= rs << 13;
  rs ^= rs >> 7;
  rs ^= rs << 17;
  return rs;
}
static int ri(int n) { return (int)(rnd() % (uint64_t)n); }

static const dtype_t all_dtypes[] = {DTYPE_FLOAT32, DTYPE_FLOAT64, DTYPE_FLOAT16, DTYPE_BFLOAT16,
                                     DTYPE_INT8,    DTYPE_UINT8,   DTYPE_INT16,   DTYPE_INT32,
                                     DTYPE_INT64,   DTYPE_BOOL};
#define NDTYPES 10
static dtype_t rdt(void) { return all_dtypes[ri(NDTYPES)]; }

/* Per family: cases run, mismatches, the first failure's text, and per-op
 * counts so the test can insist every op of the family really ran. */
static struct {
  const char *family;
  long index;
  long runs, errors, fails;
  char first[4096];
  int nops;
  const char *op[48];
  long ok[48];
} st;
static long nan_bits; /* NaN-for-NaN differences let through, for the log */

static void begin_family(const char *family) {
  memset(&st, 0, sizeof st);
  st.family = family;
}

static void begin_case(uint64_t base, long i) {
  uint64_t z = base + 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1); /* splitmix64 */
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  rs = case_seed = z ? z : 1;
  st.index = i;
}

static void count_op(const char *name, bool ok) {
  int k;
  for (k = 0; k < st.nops && strcmp(st.op[k], name); k++) {}
  if (k == st.nops && st.nops < 48) st.op[st.nops++] = name;
  if (k < 48 && ok) st.ok[k]++;
}

static void report(const char *fmt, ...) {
  char msg[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (++st.fails == 1) snprintf(st.first, sizeof st.first, "%s", msg);
  if (st.fails <= 10) cr_log_error("%s", msg);
}

/* Every op in names ran successfully at least once, and nothing mismatched. */
static void end_family(const char *const *names, size_t n) {
  cr_log_info("%s: %ld cases run (%ld failed alike on both), %ld mismatched, "
              "%ld NaNs with other bits",
              st.family, st.runs, st.errors, st.fails, nan_bits);
  cr_assert_eq(st.fails, 0, "%s: %ld of %ld cases differ; first: %s", st.family, st.fails,
               st.runs, st.first);
  for (size_t i = 0; i < n; i++) {
    long ok = 0;
    for (int k = 0; k < st.nops; k++)
      if (!strcmp(st.op[k], names[i])) ok = st.ok[k];
    cr_expect_gt(ok, 0, "%s: op %s never ran successfully", st.family, names[i]);
  }
}

/* ------------------------------------------------------------------ values */

typedef enum {
  FILL_MIX,     /* small ints, reals, and now and then NaN, ±inf, ±0, extremes, ties */
  FILL_PLAIN,   /* small ints and reals only */
  FILL_SMALL,   /* integers in [-4, 4], ±0, rarely ±inf/NaN: exact sums in any order */
  FILL_NONNEG,  /* reals in [0, 1), rarely inf/NaN: sums without cancellation */
  FILL_NEAR1,   /* floats in [0.99, 1.01], ints ±1: long products neither overflow nor vanish */
} fill_t;

static void rand_val(dtype_t dt, char *p, fill_t mode) {
  if (dt == DTYPE_BOOL) {
    *(uint8_t *)p = (uint8_t)ri(2);
    return;
  }
  if (dtype_is_floating(dt)) {
    static const double sp[] = {0.0,  -0.0, INFINITY, -INFINITY, NAN,  -NAN, 1e30, -1e-30, 65504,
                                70000, 0.5, -2.5,     3.5,       1e-8, 255,  300,  -129,   1.0,
                                -1.0,  2.0, 1e-40,    6e-8,      -0.5, 1.5};
    double v;
    int k = ri(100);
    switch (mode) {
    case FILL_SMALL:
      v = k < 2 ? (ri(2) ? NAN : INFINITY * (ri(2) ? 1 : -1)) : k < 6 ? -0.0 : (double)(ri(9) - 4);
      break;
    case FILL_NONNEG:
      v = k < 1 ? (ri(2) ? NAN : INFINITY) : k < 4 ? 0.0 : (double)(rnd() % 1000000) / 1e6;
      break;
    case FILL_NEAR1: v = 0.99 + (double)(rnd() % 20001) / 1e6; break;
    default:
      if (mode == FILL_MIX && k < 10) v = sp[ri(sizeof sp / sizeof sp[0])];
      else if (k < 40) v = (double)(ri(21) - 10);
      else if (k < 50) v = (double)(ri(9) - 4) + 0.5; /* ties */
      else v = (double)(rnd() % 2000001) / 100000.0 - 10.0;
    }
    cpu_st_f(dt, p, v);
    return;
  }
  int64_t v;
  int k = ri(100);
  if (mode == FILL_NEAR1) v = ri(8) ? 1 : -1;
  else if (mode == FILL_NONNEG) v = ri(5);
  else if (mode == FILL_SMALL) v = ri(9) - 4;
  else if (mode == FILL_MIX && k < 8) {
    static const int64_t sp[] = {INT64_MIN, INT64_MAX, 127,         -128,
                                 255,       32767,     -32768,      2147483647,
                                 -2147483647 - 1,      0,           -1, 1};
    v = sp[ri(sizeof sp / sizeof sp[0])];
  } else {
    v = k < 15 ? 0 : ri(41) - 20;
  }
  cpu_st_i(dt, p, v);
}

/* ------------------------------------------------------------------ tensor pairs */

/* The same tensor on both backends. Owners hold their storages and a copy of
 * the bytes they started with; views (alias pairs) share an owner's storage. */
typedef struct {
  agent_tensor_t *t[2];
  char *orig; /* owners: the storage's bytes at creation (after any rewrite) */
  bool owner;
} pair_t;

#define MAXP 64
static pair_t P[MAXP];
static int np;

/* Views: 0 contiguous; 1 permuted, stepped, offset; 2 also broadcast (stride 0). */
static int mkpair_from(dtype_t dt, int nd, const int64_t *sizes, fill_t mode, int views,
                       const void *data) {
  cr_assert_lt(np, MAXP);
  layout_t l;
  memset(&l, 0, sizeof l);
  l.ndim = nd;
  int perm[LAYOUT_MAX_DIMS];
  for (int i = 0; i < nd; i++) perm[i] = i;
  bool permute = views && ri(3) == 0, step = views && ri(3) == 0;
  if (permute)
    for (int i = nd - 1; i > 0; i--) {
      int j = ri(i + 1), t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
  int64_t stride = 1;
  for (int k = nd - 1; k >= 0; k--) {
    int d = perm[k];
    int64_t s = step ? 1 + ri(2) : 1;
    l.strides[d] = stride * s;
    stride *= (sizes[d] ? sizes[d] : 1) * s;
  }
  for (int d = 0; d < nd; d++) {
    l.sizes[d] = sizes[d];
    if (views == 2 && ri(6) == 0) l.strides[d] = 0;
  }
  l.offset = views && ri(3) == 0 ? ri(5) : 0;
  int64_t span = l.offset + 1;
  for (int d = 0; d < nd; d++)
    if (sizes[d] > 0) span += (sizes[d] - 1) * l.strides[d];
  size_t esz = dtype_size(dt), bytes = (size_t)span * esz;
  char *host = malloc(bytes);
  if (data) {
    cr_assert_eq(nd, 1);
    l.offset = 0;
    l.strides[0] = 1;
    memcpy(host, data, bytes);
  } else {
    for (int64_t i = 0; i < span; i++) rand_val(dt, host + i * (int64_t)esz, mode);
  }
  for (int b = 0; b < 2; b++) {
    agent_storage_t *s = calloc(1, sizeof *s);
    s->refs = 1;
    s->backend = &bk[b];
    s->bytes = bytes;
    s->data = bops[b]->alloc(&bk[b], NULL, bytes);
    cr_assert_not_null(s->data);
    memcpy(s->data, host, bytes); /* emulated: device memory is host memory */
    agent_tensor_t *t = calloc(1, sizeof *t);
    t->meta.dtype = dt;
    t->meta.layout = l;
    t->storage = s;
    P[np].t[b] = t;
  }
  P[np].orig = host;
  P[np].owner = true;
  return np++;
}

static int mkpair(dtype_t dt, int nd, const int64_t *sizes, fill_t mode, int views) {
  return mkpair_from(dt, nd, sizes, mode, views, NULL);
}

/* A view on pair base's storage with layout l. */
static int mkalias(int base, dtype_t dt, const layout_t *l) {
  cr_assert_lt(np, MAXP);
  for (int b = 0; b < 2; b++) {
    agent_tensor_t *t = calloc(1, sizeof *t);
    t->meta.dtype = dt;
    t->meta.layout = *l;
    t->storage = P[base].t[b]->storage;
    t->storage->refs++;
    P[np].t[b] = t;
  }
  P[np].orig = NULL;
  P[np].owner = false;
  return np++;
}

/* After writing a pair's storages directly: the new bytes are its original. */
static void resnapshot(int p) {
  agent_storage_t *s = P[p].t[0]->storage;
  memcpy(P[p].orig, s->data, s->bytes);
  cr_assert_eq(memcmp(s->data, P[p].t[1]->storage->data, s->bytes), 0);
}

static void drop(int b, agent_tensor_t *t) {
  agent_storage_t *s = t->storage;
  if (--s->refs == 0) {
    bops[b]->free(&bk[b], s->data, s->bytes ? s->bytes : 1);
    free(s);
  }
  free(t);
}

static void freeall(void) {
  for (int i = 0; i < np; i++) {
    for (int b = 0; b < 2; b++) drop(b, P[i].t[b]);
    free(P[i].orig);
  }
  np = 0;
}

/* ------------------------------------------------------------------ arguments */

typedef struct {
  op_value_t v;
  int pair;    /* >= 0: a tensor argument */
  int list[8]; /* VAL_TENSORS: pairs */
  int nlist;
} spec_t;

static spec_t T(int p) {
  spec_t s = {.v.kind = VAL_TENSOR, .pair = p};
  return s;
}
static spec_t V(op_value_t v) {
  spec_t s = {.v = v, .pair = -1};
  return s;
}
static op_value_t vi(int64_t i) { return (op_value_t){.kind = VAL_INT, .i = i}; }
static op_value_t vf(double f) { return (op_value_t){.kind = VAL_FLOAT, .f = f}; }
static op_value_t vb(bool b) { return (op_value_t){.kind = VAL_BOOL, .b = b}; }
static op_value_t vs(const char *s) { return (op_value_t){.kind = VAL_STRING, .s = s}; }
static op_value_t vd(dtype_t d) { return (op_value_t){.kind = VAL_DTYPE, .dtype = d}; }
static op_value_t vnone(void) { return (op_value_t){.kind = VAL_NONE}; }
static int64_t ints_store[64][LAYOUT_MAX_DIMS + 2];
static int nints;
static op_value_t vints(int n, const int64_t *x) {
  int64_t *s = ints_store[nints++ % 64];
  memcpy(s, x, (size_t)n * sizeof *x);
  return (op_value_t){.kind = VAL_INTS, .ints = s, .nints = (size_t)n};
}

static op_value_t rscalar(void) {
  switch (ri(6)) {
  case 0: return vi(ri(11) - 5);
  case 1: return vb(ri(2));
  case 2: return vf((double)(ri(41) - 20) / 4.0);
  case 3: {
    static const double sp[] = {NAN, INFINITY, -INFINITY, -0.0, 0.0, 1e10, -1e-10, 2.5, 0.5};
    return vf(sp[ri(sizeof sp / sizeof sp[0])]);
  }
  case 4: return vi(ri(2) ? 300 : -129);
  default: return vf((double)(rnd() % 100000) / 7777.0 - 6);
  }
}

/* ------------------------------------------------------------------ descriptions */

static void app(char *buf, size_t cap, const char *fmt, ...) {
  size_t len = strlen(buf);
  if (len + 1 >= cap) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + len, cap - len, fmt, ap);
  va_end(ap);
}

static void app_tensor(char *buf, size_t cap, const agent_tensor_t *t) {
  const layout_t *l = &t->meta.layout;
  app(buf, cap, "%s[", dtype_name(t->meta.dtype));
  for (int d = 0; d < l->ndim; d++) app(buf, cap, "%s%" PRId64, d ? "," : "", l->sizes[d]);
  app(buf, cap, "]{strides ");
  for (int d = 0; d < l->ndim; d++) app(buf, cap, "%s%" PRId64, d ? "," : "", l->strides[d]);
  app(buf, cap, " offset %" PRId64 "}", l->offset);
}

static void app_value(char *buf, size_t cap, const spec_t *s) {
  const op_value_t *v = &s->v;
  if (s->pair >= 0) {
    app_tensor(buf, cap, P[s->pair].t[0]);
    return;
  }
  switch (v->kind) {
  case VAL_NONE: app(buf, cap, "None"); break;
  case VAL_INT: app(buf, cap, "%" PRId64, v->i); break;
  case VAL_FLOAT: app(buf, cap, "%.17g", v->f); break;
  case VAL_BOOL: app(buf, cap, "%s", v->b ? "True" : "False"); break;
  case VAL_STRING: app(buf, cap, "'%s'", v->s); break;
  case VAL_DTYPE: app(buf, cap, "%s", dtype_name(v->dtype)); break;
  case VAL_INTS:
    app(buf, cap, "[");
    for (size_t i = 0; i < v->nints; i++) app(buf, cap, "%s%" PRId64, i ? "," : "", v->ints[i]);
    app(buf, cap, "]");
    break;
  case VAL_TENSORS:
    app(buf, cap, "[");
    for (int i = 0; i < s->nlist; i++) {
      if (i) app(buf, cap, ", ");
      app_tensor(buf, cap, P[s->list[i]].t[0]);
    }
    app(buf, cap, "]");
    break;
  default: app(buf, cap, "kind %d", (int)v->kind);
  }
}

static void describe(char *buf, size_t cap, const char *name, const spec_t *sp, int n,
                     const op_kwarg_t *kw, int nk, uint32_t rank, int64_t coord) {
  buf[0] = 0;
  app(buf, cap, "[%s case %ld, seed 0x%016" PRIx64 "] %s(", st.family, st.index, case_seed, name);
  for (int i = 0; i < n; i++) {
    if (i) app(buf, cap, ", ");
    app_value(buf, cap, &sp[i]);
  }
  for (int i = 0; i < nk; i++) {
    spec_t s = V(kw[i].value);
    app(buf, cap, ", %s=", kw[i].name);
    app_value(buf, cap, &s);
  }
  app(buf, cap, ") rank %u coordinate %" PRId64, rank, coord);
}

/* ------------------------------------------------------------------ comparing */

/* How values are compared. Results and written storages: bytes, except that
 * a NaN equals any NaN (NaN sign and payload bits are documented to differ:
 * which operand's NaN an x86 add keeps depends on how the compiler ordered
 * it); where the accumulation is documented to differ, floats also within
 * |x - y| <= rel * max(|x|, |y|) + abs, -0 == 0. Untouched inputs: bytes. */
typedef struct {
  bool nan_any, loose;
  double rel, abs;
} cmp_t;
static const cmp_t STRICT = {true, false, 0, 0};
static const cmp_t BYTES = {false, false, 0, 0};

static double eps_of(dtype_t dt) {
  switch (dt) {
  case DTYPE_FLOAT64: return 0x1p-52;
  case DTYPE_FLOAT16: return 0x1p-10;
  case DTYPE_BFLOAT16: return 0x1p-7;
  default: return 0x1p-23;
  }
}

/* Index of the first element that differs, or -1. */
static int64_t first_diff(dtype_t dt, const char *a, const char *b, int64_t n, cmp_t c) {
  size_t esz = dtype_size(dt);
  for (int64_t i = 0; i < n; i++) {
    const char *x = a + i * (int64_t)esz, *y = b + i * (int64_t)esz;
    if (!memcmp(x, y, esz)) continue;
    if ((c.nan_any || c.loose) && dtype_is_floating(dt)) {
      double fx = cpu_ld_f(dt, x), fy = cpu_ld_f(dt, y);
      if (isnan(fx) && isnan(fy)) {
        nan_bits++;
        continue;
      }
    }
    if (c.loose && dtype_is_floating(dt)) {
      double fx = cpu_ld_f(dt, x), fy = cpu_ld_f(dt, y);
      if (fx == fy) continue;
      if (fabs(fx - fy) <= c.rel * fmax(fabs(fx), fabs(fy)) + c.abs) continue;
    }
    return i;
  }
  return -1;
}

static void app_elem(char *buf, size_t cap, dtype_t dt, const char *p) {
  uint64_t bits = 0;
  memcpy(&bits, p, dtype_size(dt));
  if (dtype_is_floating(dt))
    app(buf, cap, "%.17g (bits 0x%" PRIx64 ")", cpu_ld_f(dt, p), bits);
  else app(buf, cap, "%" PRId64, cpu_ld_i(dt, p));
}

static void mismatch(const char *desc, const char *what, dtype_t dt, const char *a, const char *b,
                     int64_t at, const agent_tensor_t *shape) {
  char m[1024] = "";
  app(m, sizeof m, "%s element %" PRId64, what, at);
  if (shape) {
    app(m, sizeof m, " of ");
    app_tensor(m, sizeof m, shape);
  }
  app(m, sizeof m, ": cpu ");
  app_elem(m, sizeof m, dt, a + at * (int64_t)dtype_size(dt));
  app(m, sizeof m, ", cuda:emulated ");
  app_elem(m, sizeof m, dt, b + at * (int64_t)dtype_size(dt));
  report("%s\n  %s", desc, m);
}

/* ------------------------------------------------------------------ running */

/* Runs op name on both backends with the same arguments and compares. Returns
 * -1 when the op's schema or shape rule rejects the arguments (no kernel case),
 * 1 when the kernels failed, else 0. */
static int run2(const char *name, const spec_t *sp, int n, const op_kwarg_t *kw, int nk,
                uint32_t rank, int64_t coord, cmp_t cmp) {
  const op_def_t *op = ops_find(name);
  cr_assert_not_null(op, "no op %s", name);
  op_value_t args[2][OP_MAX_PARAMS];
  const tensor_meta_t *lists[2][OP_MAX_PARAMS][8];
  op_args_t a[2];
  op_infer_t inf[2];
  agent_tensor_t *res[2][OP_MAX_RESULTS];
  int rc[2], nres = 0;
  meshd_error_t e[2];
  for (int b = 0; b < 2; b++) {
    for (int i = 0; i < n; i++) {
      args[b][i] = sp[i].v;
      if (sp[i].pair >= 0) args[b][i].tensor = &P[sp[i].pair].t[b]->meta;
      if (sp[i].v.kind == VAL_TENSORS) {
        for (int k = 0; k < sp[i].nlist; k++) lists[b][i][k] = &P[sp[i].list[k]].t[b]->meta;
        args[b][i].tensors = lists[b][i];
        args[b][i].ntensors = (size_t)sp[i].nlist;
      }
    }
    memset(&e[b], 0, sizeof e[b]);
    if (ops_bind(op, args[b], (size_t)n, kw, (size_t)nk, &a[b], &e[b]) ||
        ops_infer(&a[b], &inf[b], &e[b])) {
      cr_assert_eq(b, 0, "%s: bound on cpu but not on cuda", name);
      return -1;
    }
    nres = inf[b].nresults;
    for (int i = 0; i < nres; i++) {
      const op_result_t *r = &inf[b].results[i];
      agent_tensor_t *t = calloc(1, sizeof *t);
      t->meta = r->meta;
      if (r->alias_param >= 0) {
        t->storage = agent_tensor_of(a[b].v[r->alias_param].tensor)->storage;
        t->storage->refs++;
      } else {
        size_t bytes = (size_t)layout_numel(&r->meta.layout) * dtype_size(r->meta.dtype);
        agent_storage_t *s = calloc(1, sizeof *s);
        s->refs = 1;
        s->backend = &bk[b];
        s->bytes = bytes;
        s->data = bops[b]->alloc(&bk[b], NULL, bytes ? bytes : 1);
        cr_assert_not_null(s->data);
        memset(s->data, 0xA5 + b, bytes); /* different on each: catches unwritten elements */
        t->storage = s;
      }
      res[b][i] = t;
    }
  }
  for (int b = 0; b < 2; b++)
    rc[b] = bops[b]->run_op(&bk[b], NULL, &a[b], res[b], nres, &inf[b], rank, coord, &e[b]);

  st.runs++;
  if (rc[0]) st.errors++;
  count_op(name, rc[0] == 0 && rc[1] == 0);
  char desc[3072];
  describe(desc, sizeof desc, name, sp, n, kw, nk, rank, coord);
  long fails_before = st.fails;

  if (rc[0] != rc[1] || (rc[0] && (e[0].kind != e[1].kind || strcmp(e[0].msg, e[1].msg))))
    report("%s\n  outcome: cpu rc %d %s '%s'; cuda:emulated rc %d %s '%s'", desc, rc[0],
           rc[0] ? error_kind_name(e[0].kind) : "-", rc[0] ? e[0].msg : "", rc[1],
           rc[1] ? error_kind_name(e[1].kind) : "-", rc[1] ? e[1].msg : "");
  for (int i = 0; i < nres && !rc[0] && !rc[1] && st.fails == fails_before; i++) {
    dtype_t dt = res[0][i]->meta.dtype;
    int64_t nel = layout_numel(&res[0][i]->meta.layout);
    size_t bytes = (size_t)nel * dtype_size(dt);
    char *h[2];
    for (int b = 0; b < 2; b++) {
      meshd_error_t te;
      h[b] = malloc(bytes + 1);
      cr_assert_eq(bops[b]->to_host(&bk[b], NULL, res[b][i], h[b], &te), 0, "to_host: %s", te.msg);
    }
    int64_t at = first_diff(dt, h[0], h[1], nel, cmp);
    if (at >= 0) {
      char what[32];
      snprintf(what, sizeof what, "result %d", i);
      mismatch(desc, what, dt, h[0], h[1], at, res[0][i]);
    }
    free(h[0]);
    free(h[1]);
  }
  /* Storages: written ones (mutated arguments' and views of them) alike on both
   * backends, byte for byte; every other input exactly as it was. */
  for (int p = 0; p < np && st.fails == fails_before; p++) {
    if (!P[p].owner) continue;
    agent_storage_t *s0 = P[p].t[0]->storage, *s1 = P[p].t[1]->storage;
    bool written = false;
    for (int m = 0; m < inf[0].nmutates; m++) {
      const op_value_t *v = &a[0].v[inf[0].mutates[m]];
      if (v->kind == VAL_TENSOR && agent_tensor_of(v->tensor)->storage == s0) written = true;
    }
    dtype_t dt = P[p].t[0]->meta.dtype;
    int64_t nel = (int64_t)(s0->bytes / dtype_size(dt));
    char what[64];
    /* emulated: device memory is host memory */
    int64_t at = first_diff(dt, s0->data, s1->data, nel, written ? STRICT : BYTES);
    if (at >= 0) {
      snprintf(what, sizeof what, "%s storage of input pair %d", written ? "written" : "unwritten",
               p);
      mismatch(desc, what, dt, s0->data, s1->data, at, NULL);
    } else if (!written && (at = first_diff(dt, P[p].orig, s0->data, nel, BYTES)) >= 0) {
      snprintf(what, sizeof what, "input pair %d changed (original vs both backends)", p);
      mismatch(desc, what, dt, P[p].orig, s0->data, at, NULL);
    }
  }
  for (int b = 0; b < 2; b++)
    for (int i = 0; i < nres; i++) drop(b, res[b][i]);
  return rc[0] ? 1 : 0;
}

/* ------------------------------------------------------------------ shapes */

static int rshape(int64_t *s, int maxnd, int maxsize) {
  int nd = ri(maxnd + 1);
  for (int i = 0; i < nd; i++) s[i] = ri(5) == 0 ? 1 : 1 + ri(maxsize);
  if (nd && ri(25) == 0) s[ri(nd)] = 0;
  return nd;
}

/* A shape that broadcasts to s: some dims 1, maybe fewer leading dims. */
static int bshape(const int64_t *s, int nd, int64_t *o) {
  int drop_n = ri(nd + 1) / 2, on = nd - drop_n;
  for (int i = 0; i < on; i++) o[i] = ri(3) == 0 ? 1 : s[drop_n + i];
  return on;
}

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))

/* ------------------------------------------------------------------ elementwise */

static const char *const binary_ops[] = {
    "add",         "sub",        "mul",         "div",         "pow",        "maximum",
    "minimum",     "eq",         "ne",          "lt",          "le",         "gt",
    "ge",          "logical_and", "logical_or", "bitwise_and", "bitwise_or", "bitwise_xor",
    "add_",        "sub_",       "mul_",        "div_"};

static void case_binary(long i) {
  int64_t s[8], s2[8];
  int nd = rshape(s, 4, 5);
  const char *name = binary_ops[(i / NDTYPES) % NELEM(binary_ops)];
  bool inplace = name[strlen(name) - 1] == '_';
  dtype_t d0 = all_dtypes[i % NDTYPES], d1 = ri(2) ? d0 : rdt();
  spec_t sp[2];
  sp[0] = T(mkpair(d0, nd, s, FILL_MIX, inplace ? 1 : 2));
  if (ri(4) == 0) sp[1] = V(rscalar());
  else {
    int n2 = ri(4) ? bshape(s, nd, s2) : nd;
    if (n2 == nd) memcpy(s2, s, sizeof s);
    sp[1] = T(mkpair(d1, n2, s2, FILL_MIX, 2));
  }
  op_kwarg_t kw[1];
  int nk = 0;
  if ((!strncmp(name, "add", 3) || !strncmp(name, "sub", 3)) && ri(2)) {
    kw[0] = (op_kwarg_t){.name = "alpha", .value = rscalar()};
    nk = 1;
  } else if (!strncmp(name, "div", 3) && ri(3)) {
    kw[0] = (op_kwarg_t){.name = "rounding_mode", .value = ri(2) ? vs("floor") : vs("trunc")};
    nk = 1;
  }
  run2(name, sp, 2, kw, nk, 0, 0, STRICT);
}

static const char *const unary_ops[] = {"neg",     "abs",        "exp",  "log",  "sqrt",
                                        "rsqrt",   "sin",        "cos",  "tanh", "sigmoid",
                                        "reciprocal", "relu",    "gelu", "silu", "sign",
                                        "logical_not"};

static void case_unary(long i) {
  int64_t s[8];
  int nd = rshape(s, 4, 6);
  const char *name = unary_ops[(i / NDTYPES) % NELEM(unary_ops)];
  spec_t sp[1] = {T(mkpair(all_dtypes[i % NDTYPES], nd, s, FILL_MIX, 2))};
  op_kwarg_t kw[1];
  int nk = 0;
  if (!strcmp(name, "gelu") && ri(2)) {
    kw[0] = (op_kwarg_t){.name = "approximate", .value = vs(ri(4) ? "tanh" : "none")};
    nk = 1;
  }
  run2(name, sp, 1, kw, nk, 0, 0, STRICT);
}

static const char *const where_clamp_ops[] = {"where", "clamp", "clamp_"};

static void case_where_clamp(long i) {
  int64_t s[8], s2[8];
  int nd = rshape(s, 4, 5);
  const char *name = where_clamp_ops[(i / NDTYPES) % NELEM(where_clamp_ops)];
  dtype_t d = all_dtypes[i % NDTYPES];
  spec_t sp[3];
  if (!strcmp(name, "where")) {
    int n2 = bshape(s, nd, s2);
    sp[0] = T(mkpair(DTYPE_BOOL, n2, s2, FILL_MIX, 2));
    for (int k = 1; k < 3; k++) {
      if (ri(3) == 0) sp[k] = V(rscalar());
      else {
        n2 = bshape(s, nd, s2);
        sp[k] = T(mkpair(ri(2) ? d : rdt(), n2, s2, FILL_MIX, 2));
      }
    }
    if (sp[1].pair < 0 && sp[2].pair < 0) sp[1] = T(mkpair(d, nd, s, FILL_MIX, 2));
  } else {
    sp[0] = T(mkpair(d, nd, s, FILL_MIX, name[5] ? 1 : 2));
    for (int k = 1; k < 3; k++) {
      int m = ri(3);
      if (m == 0) sp[k] = V(vnone());
      else if (m == 1) sp[k] = V(rscalar());
      else {
        int n2 = bshape(s, nd, s2);
        sp[k] = T(mkpair(ri(2) ? d : rdt(), n2, s2, FILL_MIX, 2));
      }
    }
  }
  run2(name, sp, 3, NULL, 0, 0, 0, STRICT);
}

/* ------------------------------------------------------------------ factories */

static const char *const factory_ops[] = {"empty", "zeros", "ones", "full", "arange",
                                          "rand",  "randn", "rank", "fill_", "zero_"};

static void case_factory(long i) {
  int64_t s[8];
  int nd = rshape(s, 3, 6);
  const char *name = factory_ops[(i / NDTYPES) % NELEM(factory_ops)];
  dtype_t dt = all_dtypes[i % NDTYPES];
  op_kwarg_t kw[2];
  int nk = 0;
  spec_t sp[3];
  if (!strcmp(name, "empty") || !strcmp(name, "zeros") || !strcmp(name, "ones")) {
    sp[0] = V(vints(nd, s));
    if (ri(4)) kw[nk++] = (op_kwarg_t){.name = "dtype", .value = vd(dt)};
    run2(name, sp, 1, kw, nk, 0, 0, STRICT);
  } else if (!strcmp(name, "full")) {
    sp[0] = V(vints(nd, s));
    sp[1] = V(rscalar());
    if (ri(4)) kw[nk++] = (op_kwarg_t){.name = "dtype", .value = vd(dt)};
    run2(name, sp, 2, kw, nk, 0, 0, STRICT);
  } else if (!strcmp(name, "arange")) {
    op_value_t a = ri(2) ? vi(ri(20) - 10) : vf((ri(200) - 100) / 7.0);
    op_value_t b = ri(2) ? vi(ri(40) - 10) : vf((ri(400) - 100) / 7.0);
    op_value_t step = ri(2) ? vi(ri(2) ? (ri(2) ? 1 : 3) : -2) : vf(ri(2) ? 0.1 : -0.37);
    if (ri(4)) kw[nk++] = (op_kwarg_t){.name = "dtype", .value = vd(dt)};
    if (ri(3)) {
      sp[0] = V(a);
      sp[1] = V(b);
      sp[2] = V(step);
      run2(name, sp, 3, kw, nk, 0, 0, STRICT);
    } else {
      sp[0] = V(ri(2) ? vi(ri(30)) : vf(ri(300) / 7.0));
      run2(name, sp, 1, kw, nk, 0, 0, STRICT);
    }
  } else if (!strcmp(name, "rand") || !strcmp(name, "randn")) {
    if (nd == 0) nd = 1;
    s[0] = ri(8) == 0 ? 1000 + ri(3000) : ri(40); /* odd counts: partial Philox blocks */
    sp[0] = V(vints(nd, s));
    if (ri(4)) kw[nk++] = (op_kwarg_t){.name = "dtype", .value = vd(dt)};
    if (ri(2)) kw[nk++] = (op_kwarg_t){.name = "seed", .value = vi((int64_t)(rnd() >> 1))};
    run2(name, sp, 1, kw, nk, (uint32_t)ri(4), 0, STRICT);
  } else if (!strcmp(name, "rank")) {
    sp[0] = V(vs("x"));
    run2(name, sp, 1, NULL, 0, (uint32_t)ri(8), ri(100) - 50, STRICT);
  } else if (!strcmp(name, "fill_")) {
    sp[0] = T(mkpair(dt, nd, s, FILL_MIX, 1));
    if (ri(3)) sp[1] = V(rscalar());
    else sp[1] = T(mkpair(rdt(), 0, s, FILL_MIX, 1));
    run2(name, sp, 2, NULL, 0, 0, 0, STRICT);
  } else {
    sp[0] = T(mkpair(dt, nd, s, FILL_MIX, 1));
    run2(name, sp, 1, NULL, 0, 0, 0, STRICT);
  }
}

/* ------------------------------------------------------------------ copies and joins */

static const char *const copies_ops[] = {"clone", "contiguous", "to",   "cast",
                                          "copy_", "cat",        "stack"};

static void case_copies(long i) {
  int64_t s[8], s2[8];
  int nd = rshape(s, 4, 5);
  const char *name = copies_ops[(i / NDTYPES) % NELEM(copies_ops)];
  dtype_t dt = all_dtypes[i % NDTYPES];
  spec_t sp[4];
  op_kwarg_t kw[1];
  int nk = 0;
  if (!strcmp(name, "clone") || !strcmp(name, "contiguous")) {
    sp[0] = T(mkpair(dt, nd, s, FILL_MIX, 2));
    run2(name, sp, 1, NULL, 0, 0, 0, STRICT);
  } else if (!strcmp(name, "to") || !strcmp(name, "cast")) {
    sp[0] = T(mkpair(dt, nd, s, FILL_MIX, 2));
    sp[1] = V(vd(ri(4) ? rdt() : dt));
    if (!strcmp(name, "to") && ri(2)) kw[nk++] = (op_kwarg_t){.name = "copy", .value = vb(ri(2))};
    run2(name, sp, 2, kw, nk, 0, 0, STRICT);
  } else if (!strcmp(name, "copy_")) {
    sp[0] = T(mkpair(dt, nd, s, FILL_MIX, 1));
    int n2 = bshape(s, nd, s2);
    sp[1] = T(mkpair(rdt(), n2, s2, FILL_MIX, 2));
    run2(name, sp, 2, NULL, 0, 0, 0, STRICT);
  } else {
    bool cat = !strcmp(name, "cat");
    if (nd == 0 && (cat || ri(2))) {
      nd = 1;
      s[0] = 3;
    }
    int cnt = 1 + ri(4), d = nd ? ri(nd + (cat ? 0 : 1)) : 0;
    spec_t l = V((op_value_t){.kind = VAL_TENSORS});
    for (int k = 0; k < cnt; k++) {
      memcpy(s2, s, sizeof s);
      if (cat && d < nd) s2[d] = ri(4);
      if (cat && ri(8) == 0) {
        int64_t z = 0; /* torch's legacy empty [0] joins anything */
        l.list[l.nlist++] = mkpair(ri(2) ? dt : rdt(), 1, &z, FILL_MIX, 0);
      } else {
        l.list[l.nlist++] = mkpair(ri(2) ? dt : rdt(), nd, s2, FILL_MIX, 2);
      }
    }
    sp[0] = l;
    int dims = nd + (cat ? 0 : 1);
    sp[1] = V(vi(ri(2) || !dims ? d : d - dims));
    run2(name, sp, 2, NULL, 0, 0, 0, STRICT);
  }
}

/* ------------------------------------------------------------------ indexing */

static const char *const index_ops[] = {"index_select", "gather"};

/* Writes the index values vals (n of them, row-major over t's shape) into pair
 * p's storages, then takes them as its original bytes. */
static void write_index(int p, const int64_t *vals, int64_t n) {
  for (int b = 0; b < 2; b++) {
    agent_tensor_t *t = P[p].t[b];
    const layout_t *l = &t->meta.layout;
    for (int64_t j = 0; j < n; j++) {
      int64_t off = l->offset, rem = j;
      for (int k = l->ndim - 1; k >= 0; k--) {
        off += (rem % l->sizes[k]) * l->strides[k];
        rem /= l->sizes[k];
      }
      cpu_st_i(t->meta.dtype, (char *)t->storage->data + off * (int64_t)dtype_size(t->meta.dtype),
               vals[j]);
    }
  }
  resnapshot(p);
}

static void case_index(long i) {
  int64_t s[8], si[8], vals[512];
  int nd = rshape(s, 3, 5);
  const char *name = index_ops[(i / NDTYPES) % NELEM(index_ops)];
  bool bad = ri(4) == 0;
  int d = nd ? ri(nd) : 0;
  int64_t size = nd ? s[d] : 1;
  spec_t sp[3];
  sp[0] = T(mkpair(all_dtypes[i % NDTYPES], nd, s, FILL_MIX, 2));
  sp[1] = V(vi(nd && ri(2) ? d - nd : d));
  int ind;
  dtype_t idt;
  if (!strcmp(name, "index_select")) {
    ind = nd == 0 ? ri(2) : (ri(5) == 0 ? 0 : 1);
    si[0] = ind ? ri(6) : 1;
    idt = ri(2) ? DTYPE_INT64 : DTYPE_INT32;
  } else {
    ind = nd ? nd : ri(2);
    for (int k = 0; k < ind; k++)
      si[k] = nd ? (k == d ? ri(5) : (s[k] ? 1 + ri((int)s[k]) : 0)) : 1 + ri(3);
    idt = DTYPE_INT64;
  }
  int p = mkpair(idt, ind, si, FILL_PLAIN, 1);
  int64_t n = layout_numel(&P[p].t[0]->meta.layout);
  cr_assert_leq(n, 512);
  for (int64_t j = 0; j < n; j++) {
    vals[j] = size ? ri((int)size) - (ri(12) == 0 ? size : 0) : 0; /* negative: from the end */
    if (bad && (j == n / 2 || j == n - 1)) vals[j] = ri(2) ? -size - 1 - ri(3) : size + ri(3);
  }
  write_index(p, vals, n);
  sp[2] = T(p);
  run2(name, sp, 3, NULL, 0, 3, 0, STRICT);
}

/* ------------------------------------------------------------------ views */

static const char *const views_ops[] = {"view",   "reshape", "transpose", "t",         "permute",
                                       "select", "narrow",  "slice",     "unsqueeze", "squeeze",
                                       "expand"};

/* Runs a view op on both backends (no kernel: the result aliases its input),
 * then reads and writes through the view with kernels. */
static void case_views(long i) {
  int64_t s[8], t[10];
  int nd = 1 + ri(4);
  for (int k = 0; k < nd; k++) s[k] = ri(4) == 0 ? 1 : 1 + ri(4);
  if (ri(20) == 0) s[ri(nd)] = 0;
  const char *name = views_ops[(i / NDTYPES) % NELEM(views_ops)];
  dtype_t dt = all_dtypes[i % NDTYPES];
  int base = mkpair(dt, nd, s, FILL_MIX, ri(3) ? 0 : 1);
  spec_t sp[5];
  int n = 1;
  sp[0] = T(base);
  int d = ri(nd), e2 = ri(nd);
  int64_t size = s[d];
  if (!strcmp(name, "view") || !strcmp(name, "reshape")) {
    int m = 0; /* merge adjacent dims at random, maybe one -1 */
    for (int k = 0; k < nd; k++) {
      if (m && ri(2)) t[m - 1] *= s[k];
      else t[m++] = s[k];
    }
    if (ri(3) == 0) t[ri(m)] = -1;
    sp[n++] = V(vints(m, t));
  } else if (!strcmp(name, "transpose")) {
    sp[n++] = V(vi(d));
    sp[n++] = V(vi(e2 - (ri(2) ? nd : 0)));
  } else if (!strcmp(name, "permute")) {
    for (int k = 0; k < nd; k++) t[k] = k;
    for (int k = nd - 1; k > 0; k--) {
      int j = ri(k + 1);
      int64_t x = t[k];
      t[k] = t[j];
      t[j] = x;
    }
    sp[n++] = V(vints(nd, t));
  } else if (!strcmp(name, "select")) {
    sp[n++] = V(vi(d));
    sp[n++] = V(vi(size ? ri((int)(2 * size)) - size : 0));
  } else if (!strcmp(name, "narrow")) {
    int64_t st0 = ri((int)size + 1);
    sp[n++] = V(vi(d));
    sp[n++] = V(vi(st0));
    sp[n++] = V(vi(ri((int)(size - st0) + 1)));
  } else if (!strcmp(name, "slice")) {
    sp[n++] = V(vi(d));
    sp[n++] = ri(4) ? V(vi(ri((int)size + 2) - 1)) : V(vnone());
    sp[n++] = ri(4) ? V(vi(ri((int)size + 3) - 1)) : V(vnone());
    sp[n++] = V(vi(1 + ri(3)));
  } else if (!strcmp(name, "unsqueeze")) {
    sp[n++] = V(vi(ri(2 * nd + 2) - nd - 1));
  } else if (!strcmp(name, "squeeze")) {
    if (ri(2)) sp[n++] = V(vnone());
    else sp[n++] = V(vi(d));
  } else if (!strcmp(name, "expand")) {
    int lead = ri(3);
    for (int k = 0; k < lead; k++) t[k] = 1 + ri(3);
    for (int k = 0; k < nd; k++) t[lead + k] = s[k] == 1 ? 1 + ri(3) : (ri(4) ? s[k] : -1);
    sp[n++] = V(vints(lead + nd, t));
  }
  /* The view's layout, as the rule gives it. A reshape that cannot view makes
   * a fresh tensor, for which neither backend has a kernel (each says so in
   * its own words): not a case here. */
  op_value_t args[OP_MAX_PARAMS];
  for (int k = 0; k < n; k++) {
    args[k] = sp[k].v;
    if (sp[k].pair >= 0) args[k].tensor = &P[sp[k].pair].t[0]->meta;
  }
  op_args_t a;
  op_infer_t inf;
  meshd_error_t e;
  if (ops_bind(ops_find(name), args, (size_t)n, NULL, 0, &a, &e) || ops_infer(&a, &inf, &e) ||
      inf.results[0].alias_param < 0)
    return;
  if (run2(name, sp, n, NULL, 0, 0, 0, STRICT)) return;
  /* Kernels reading and writing through the view. */
  int v = mkalias(base, dt, &inf.results[0].meta.layout);
  const layout_t *vl = &inf.results[0].meta.layout;
  bool broadcast = false;
  for (int k = 0; k < vl->ndim; k++) broadcast |= vl->strides[k] == 0 && vl->sizes[k] > 1;
  spec_t sp2[3] = {T(v)};
  switch (broadcast ? ri(2) : ri(5)) {
  case 0: run2("clone", sp2, 1, NULL, 0, 0, 0, STRICT); break;
  case 1: {
    sp2[1] = V(vi(-1));
    sp2[2] = V(vb(ri(2)));
    run2(vl->ndim ? "sum" : "neg", sp2, vl->ndim ? 3 : 1, NULL, 0, 0, 0, STRICT);
    break;
  }
  case 2:
    sp2[1] = V(rscalar());
    run2(ri(2) ? "mul_" : "add_", sp2, 2, NULL, 0, 0, 0, STRICT);
    break;
  case 3:
    sp2[1] = V(rscalar());
    run2("fill_", sp2, 2, NULL, 0, 0, 0, STRICT);
    break;
  default: {
    sp2[1] = T(mkpair(rdt(), vl->ndim, vl->sizes, FILL_MIX, 2));
    run2("copy_", sp2, 2, NULL, 0, 0, 0, STRICT);
  }
  }
}

/* ------------------------------------------------------------------ reductions */

static const char *const reduce_ops[] = {"sum",  "mean", "prod",   "max",   "min",
                                         "amax", "amin", "argmax", "argmin"};

/* agent/cuda/kernels_reduce.cu: more than RED_SEQ_MAX reduced elements with
 * fewer than RED_PAR_OUT outputs reassociate float accumulations. */
static bool two_stage(int64_t rcount, int64_t numel) {
  int64_t nout = rcount ? numel / rcount : numel;
  return rcount > 2048 && nout < 65536;
}

static cmp_t reassociated(dtype_t out, int64_t rcount) {
  double tol = 4 * eps_of(out) + 2 * (double)rcount * 0x1p-53; /* the double accumulation's */
  return (cmp_t){true, true, tol, tol};
}

static void case_reduce(long i) {
  const char *name = reduce_ops[(i / NDTYPES) % NELEM(reduce_ops)];
  dtype_t dt = all_dtypes[i % NDTYPES];
  bool big = i % 16 == 5;
  int64_t s[8];
  int nd = ri(5);
  for (int k = 0; k < nd; k++) s[k] = ri(6) == 0 ? ri(2) : 1 + ri(big ? 4 : 6);
  if (big && !nd) s[nd++] = 1;
  if (big) s[ri(nd)] = 2049 + ri(2500);
  int64_t numel = 1;
  for (int k = 0; k < nd; k++) numel *= s[k];
  for (int k = 0; k < nd && numel > 60000; k++) /* keep ASan runs short */
    if (s[k] <= 2048) numel /= s[k], s[k] = 1;
  bool multi = !strcmp(name, "sum") || !strcmp(name, "mean") || !strcmp(name, "amax") ||
               !strcmp(name, "amin");
  int64_t dims[8];
  int ndims = 0;
  for (int k = 0; k < nd; k++)
    if (ri(2)) dims[ndims++] = k;
  if (big) /* reduce over the long dim at least */
    for (int k = 0; k < nd; k++)
      if (s[k] > 2048) {
        bool have = false;
        for (int j = 0; j < ndims; j++) have |= dims[j] == k;
        if (!have) dims[ndims++] = k;
      }
  if (!nd && ri(2)) dims[ndims++] = 0;
  fill_t fill = big ? (!strcmp(name, "prod") ? FILL_NEAR1 : ri(2) ? FILL_SMALL : FILL_NONNEG)
                    : (fill_t)ri(3); /* FILL_MIX, FILL_PLAIN, FILL_SMALL */
  spec_t sp[3];
  sp[0] = T(mkpair(dt, nd, s, fill, ri(2) ? 2 : 1));
  int n = 1;
  bool none = ri(5) == 0 && !big;
  int64_t rcount = 1;
  if (multi) {
    if (none) sp[n++] = V(vnone());
    else {
      for (int k = 0; k < ndims; k++) dims[k] -= ri(2) && nd ? nd : 0;
      sp[n++] = V(ndims == 1 && ri(2) ? vi(dims[0]) : vints(ndims, dims));
    }
  } else if (ndims && !none) {
    int k = ndims - 1; /* one dim: the long one when big */
    sp[n++] = V(vi(dims[k] - (ri(2) && nd ? nd : 0)));
    ndims = 1;
    dims[0] = dims[k];
  } else {
    none = true;
  }
  if (n == 2 && ri(2)) sp[n++] = V(vb(ri(2)));
  if (none || (multi && ndims == 0) || !nd) rcount = numel; /* None, [] and int? None: all */
  else
    for (int k = 0; k < ndims; k++) rcount *= s[(dims[k] + nd) % (nd ? nd : 1)];
  op_kwarg_t kw[1];
  int nk = 0;
  if ((!strcmp(name, "sum") || !strcmp(name, "mean") || !strcmp(name, "prod")) && ri(3) == 0)
    kw[nk++] = (op_kwarg_t){.name = "dtype", .value = vd(rdt())};
  bool floating_acc = !strcmp(name, "sum") || !strcmp(name, "mean") || !strcmp(name, "prod");
  cmp_t cmp = STRICT;
  if (floating_acc && two_stage(rcount, numel))
    cmp = reassociated(nk ? kw[0].value.dtype : dtype_is_floating(dt) ? dt : DTYPE_FLOAT32, rcount);
  run2(name, sp, n, kw, nk, 0, 0, cmp);
}

static const char *const softmax_ops[] = {"softmax", "log_softmax"};

static void case_softmax(long i) {
  const char *name = softmax_ops[(i / NDTYPES) % NELEM(softmax_ops)];
  dtype_t dt = all_dtypes[i % NDTYPES];
  bool big = i % 16 == 3;
  int64_t s[8];
  int nd = ri(4);
  for (int k = 0; k < nd; k++) s[k] = ri(6) == 0 ? ri(2) : 1 + ri(6);
  int d = nd ? ri(nd) : 0;
  if (big) {
    if (!nd) s[nd++] = 1;
    d = ri(nd);
    s[d] = 2049 + ri(3000);
    for (int k = 0; k < nd; k++)
      if (k != d) s[k] = 1 + ri(2);
  }
  int64_t numel = 1;
  for (int k = 0; k < nd; k++) numel *= s[k];
  spec_t sp[2];
  sp[0] = T(mkpair(dt, nd, s, big ? FILL_PLAIN : (fill_t)ri(3), ri(2) ? 2 : 1));
  sp[1] = V(vi(nd ? d - (ri(2) ? nd : 0) : 0));
  op_kwarg_t kw[1];
  int nk = 0;
  if (ri(3) == 0) kw[nk++] = (op_kwarg_t){.name = "dtype", .value = vd(all_dtypes[ri(4)])};
  cmp_t cmp = STRICT;
  if (two_stage(nd ? s[d] : 1, numel))
    cmp = reassociated(nk ? kw[0].value.dtype : dtype_is_floating(dt) ? dt : DTYPE_FLOAT32, s[d]);
  run2(name, sp, 2, kw, nk, 0, 0, cmp);
}

/* ------------------------------------------------------------------ matmul */

static const char *const matmul_ops[] = {"mm", "bmm", "matmul"};

static void case_matmul(long i) {
  const char *name = matmul_ops[(i / NDTYPES) % NELEM(matmul_ops)];
  dtype_t dt = all_dtypes[i % NDTYPES], dt2 = ri(8) ? dt : rdt();
  int64_t n = ri(7), k = ri(7), m = ri(7), s1[8], s2[8];
  if (ri(4) == 0) k = 50 + ri(100);
  int n1, n2;
  if (!strcmp(name, "mm")) {
    n1 = n2 = 2;
    s1[0] = n, s1[1] = k, s2[0] = k, s2[1] = m;
  } else if (!strcmp(name, "bmm")) {
    int64_t b = ri(4);
    n1 = n2 = 3;
    s1[0] = b, s1[1] = n, s1[2] = k, s2[0] = b, s2[1] = k, s2[2] = m;
  } else {
    n1 = 1 + ri(4);
    n2 = 1 + ri(4);
    int nb1 = n1 > 2 ? n1 - 2 : 0, nb2 = n2 > 2 ? n2 - 2 : 0;
    int64_t bsz[2] = {1 + ri(3), 1 + ri(3)};
    for (int j = 0; j < nb1; j++) s1[j] = ri(2) ? bsz[(nb1 - 1 - j) & 1] : 1;
    for (int j = 0; j < nb2; j++) s2[j] = ri(2) ? bsz[(nb2 - 1 - j) & 1] : 1;
    if (n1 >= 2) s1[n1 - 2] = n;
    s1[n1 - 1] = k;
    if (n2 >= 2) s2[n2 - 2] = k, s2[n2 - 1] = m;
    else s2[0] = k;
  }
  /* float32/float64 go through OpenBLAS on cpu: inputs whose products sum
   * without cancellation (or exactly), compared within rounding. */
  bool blas = dt == DTYPE_FLOAT32 || dt == DTYPE_FLOAT64 || dt2 == DTYPE_FLOAT32 ||
              dt2 == DTYPE_FLOAT64;
  fill_t fill = blas ? (ri(2) ? FILL_SMALL : FILL_NONNEG) : (fill_t)ri(3);
  spec_t sp[2] = {T(mkpair(dt, n1, s1, fill, 2)), T(mkpair(dt2, n2, s2, fill, 2))};
  cmp_t cmp = STRICT;
  if (blas) cmp = (cmp_t){true, true, 2.0 * (double)(k + 2) * eps_of(DTYPE_FLOAT32), 0};
  run2(name, sp, 2, NULL, 0, 0, 0, cmp);
}

/* ------------------------------------------------------------------ the tests */

typedef void (*case_fn)(long i);

static void run_family(const char *family, case_fn fn, long cases, uint64_t seed,
                       const char *const *ops, size_t nops) {
  begin_family(family);
  for (long i = 0; i < cases; i++) {
    begin_case(seed, i);
    fn(i);
    freeall();
  }
  end_family(ops, nops);
}

#define FAMILY(fam, cases, seed)                                                     \
  Test(backend_differential, fam) {                                                  \
    run_family(#fam, case_##fam, cases, seed, fam##_ops, NELEM(fam##_ops));          \
  }

FAMILY(binary, 8800, 0x62696e617279ull)
FAMILY(unary, 4800, 0x756e617279ull)
FAMILY(where_clamp, 3000, 0x7768657265ull)
FAMILY(factory, 4000, 0x666163746f7279ull)
FAMILY(copies, 5600, 0x636f70696573ull)
FAMILY(index, 3000, 0x696e646578ull)
FAMILY(views, 4400, 0x7669657773ull)
FAMILY(reduce, 4320, 0x726564756365ull)
FAMILY(softmax, 1600, 0x736f66746d6178ull)
FAMILY(matmul, 2400, 0x6d61746d756cull)

/* cuda_reduce_slices against the cpu data plane's reductions (reduce_ops.c):
 * every dtype x reduction, several slice counts and lengths. */
Test(backend_differential, reduce_slices) {
  static const reduction_t ops[] = {RED_SUM, RED_AVG,  RED_PRODUCT, RED_MIN,
                                    RED_MAX, RED_BAND, RED_BOR,     RED_BXOR};
  static const char *const op_names[] = {"sum", "avg",  "product", "min",
                                         "max", "band", "bor",     "bxor"};
  static const size_t members[] = {1, 2, 3, 5, 8};
  static const size_t counts[] = {0, 1, 7, 64, 1000};
  begin_family("reduce_slices");
  long i = 0, checked = 0;
  for (size_t di = 0; di < NDTYPES; di++)
    for (size_t oi = 0; oi < NELEM(ops); oi++)
      for (size_t mi = 0; mi < NELEM(members); mi++)
        for (size_t ci = 0; ci < NELEM(counts); ci++, i++) {
          begin_case(0x736c69636573ull, i);
          dtype_t dt = all_dtypes[di];
          reduction_t op = ops[oi];
          size_t n = members[mi], count = counts[ci], esz = dtype_size(dt);
          fill_t fill = op == RED_PRODUCT ? FILL_NEAR1 : (fill_t)ri(3);
          size_t bytes = n * count * esz;
          char *in = malloc(bytes + 1), *orig = malloc(bytes + 1);
          char *want = malloc(count * esz + 1), *got = malloc(count * esz + 1);
          for (size_t j = 0; j < n * count; j++) rand_val(dt, in + j * esz, fill);
          memcpy(orig, in, bytes);
          memset(got, 0xA5, count * esz);
          meshd_error_t e0 = {0}, e1 = {0};
          int rc0 = dp_reduce_check(op, dt, &e0);
          if (!rc0) {
            memcpy(want, in, count * esz);
            for (size_t k = 1; k < n; k++)
              dp_reduce_apply(op, dt, want, in + k * count * esz, count);
            dp_reduce_finish(op, dt, want, count, n);
          }
          /* emulated: device memory is host memory */
          int rc1 = cuda_reduce_slices(&bk[1], &cuda_state(&bk[1])->own, in, got, n, count, dt, op,
                                       &e1);
          st.runs++;
          if (rc0) st.errors++;
          char desc[256];
          snprintf(desc, sizeof desc,
                   "[reduce_slices case %ld, seed 0x%016" PRIx64 "] %s over %zu slices of %zu %s",
                   i, case_seed, op_names[oi], n, count, dtype_name(dt));
          if ((rc0 != 0) != (rc1 != 0) || (rc0 && (e0.kind != e1.kind || strcmp(e0.msg, e1.msg)))) {
            report("%s\n  outcome: data plane rc %d '%s'; cuda_reduce_slices rc %d '%s'", desc, rc0,
                   rc0 ? e0.msg : "", rc1, rc1 ? e1.msg : "");
          } else if (!rc0) {
            int64_t at = first_diff(dt, want, got, (int64_t)count, STRICT);
            if (at >= 0) mismatch(desc, "result", dt, want, got, at, NULL);
            else checked++;
          }
          if (memcmp(in, orig, bytes)) report("%s\n  the input slices changed", desc);
          free(in);
          free(orig);
          free(want);
          free(got);
        }
  cr_log_info("reduce_slices: %ld cases (%ld rejected alike), %ld mismatched", st.runs, st.errors,
              st.fails);
  cr_assert_eq(st.fails, 0, "reduce_slices: %ld of %ld cases differ; first: %s", st.fails, st.runs,
               st.first);
  cr_assert_gt(checked, 0);
}

#else /* !MESHD_HAVE_CUDA */

Test(backend_differential, cuda_emulated) { cr_skip_test("built without the cuda backend"); }

#endif
