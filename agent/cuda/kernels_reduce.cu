/* Reductions (sum mean prod max min amax amin argmax argmin), softmax, and the
 * element-wise slice reductions the communicators fall back on.
 *
 * Every output walks its reduced dims in row-major order, as the cpu backend
 * does (agent/cpu/kernels_reduce.c), so the walk's count is the index argmax
 * reports. A long reduced extent with few outputs is split into chunks: stage 1
 * reduces each (output, chunk) into a partial in scratch memory, stage 2 folds
 * an output's partials in chunk order. The split depends on the shape only, so
 * the GPU and the emulated device give the same bits.
 *
 * Where results may differ from cpu: integer results, max/min/arg* (values,
 * indices, NaN and tie rules) never do. Float sums, means and products, and
 * softmax's sum of exponentials, are bit-identical while one chunk covers the
 * extent (rcount <= RED_SEQ_MAX, or >= RED_PAR_OUT outputs); with several
 * chunks the double accumulation is reassociated (ulps of double, rarely
 * visible after rounding to float32; the sign of a NaN made by inf - inf may
 * differ). On the GPU softmax uses CUDA's exp/log (within 1 ulp of double)
 * where emulation uses the host's, and a NaN the GPU creates is its canonical
 * one, so NaN sign and payload bits may differ from x86's. */
extern "C" {
/* The core headers lack C++ guards; cuda_internal.h includes them outside its
 * extern "C" block. */
#include "ops.h"
#include "dataplane/reduce_ops.h"
}
#include <math.h>

#include "kernels.cuh"
#include "elementwise_ops.h"
#include "kernel_plan.h"

/* One chunk covers up to RED_SEQ_MAX reduced elements; past that, outputs are
 * split until about RED_PAR_OUT (output, chunk) pairs run, chunks of at least
 * RED_MIN_CHUNK. Overridable for tests of the two-stage path. */
#ifndef RED_SEQ_MAX
#define RED_SEQ_MAX 2048
#endif
#ifndef RED_PAR_OUT
#define RED_PAR_OUT 65536
#endif
#ifndef RED_MIN_CHUNK
#define RED_MIN_CHUNK 1024
#endif

/* File-local types and helpers live in an anonymous namespace: kernel templates
 * instantiated on them (cu_grid_loop<F>) then get internal linkage and cannot
 * merge with a same-named functor of another .cu at link time. */
namespace {

/* in's dims split into kept and reduced ones, as the cpu's (kernel_plan.h),
 * walked on the device. */
struct red_plan_t : kernel_reduce_plan_t {
  /* Offsets of kept position o (row-major over the kept dims). */
  CU_HD void kept(int64_t o, int64_t *in_off, int64_t *out_off) const {
    int64_t a = 0, b = 0;
    for (int k = nk - 1; k >= 0; k--) {
      int64_t i = o % ksize[k];
      o /= ksize[k];
      a += i * kin[k];
      b += i * kout[k];
    }
    *in_off = a;
    *out_off = b;
  }

  /* Byte offset of reduced position n into in, and into out (softmax). */
  CU_HD int64_t reduced(int64_t n, int64_t *out_off) const {
    int64_t a = 0, b = 0;
    for (int k = nr - 1; k >= 0; k--) {
      int64_t i = n % rsize[k];
      n /= rsize[k];
      a += i * rin[k];
      b += i * rout[k];
    }
    if (out_off) *out_off = b;
    return a;
  }
};

/* Walks reduced positions [p0, p1) of one output, in order (an odometer: no
 * division per element). */
struct red_walk_t {
  int64_t idx[LAYOUT_MAX_DIMS];
  int64_t off;

  CU_HD void start(const red_plan_t &r, int64_t p0) {
    off = 0;
    for (int k = 0; k < r.nr; k++) idx[k] = 0;
    if (r.rcount == 0) return; /* nothing to walk (and a size 0 to divide by) */
    for (int k = r.nr - 1; k >= 0; k--) {
      idx[k] = p0 % r.rsize[k];
      p0 /= r.rsize[k];
      off += idx[k] * r.rin[k];
    }
  }
  CU_HD void next(const red_plan_t &r) {
    for (int k = r.nr - 1; k >= 0; k--) {
      off += r.rin[k];
      if (++idx[k] < r.rsize[k]) return;
      off -= r.rin[k] * r.rsize[k];
      idx[k] = 0;
    }
  }
};

/* How an output's reduced extent is chunked: *nch chunks of *chunk positions. */
void plan_chunks(int64_t nout, int64_t rcount, int64_t *nch, int64_t *chunk) {
  *nch = 1;
  *chunk = rcount;
  if (rcount <= RED_SEQ_MAX || nout >= RED_PAR_OUT || nout == 0) return;
  int64_t want = (RED_PAR_OUT + nout - 1) / nout;
  int64_t most = (rcount + RED_MIN_CHUNK - 1) / RED_MIN_CHUNK;
  int64_t n = want < most ? want : most;
  if (n <= 1) return;
  *chunk = (rcount + n - 1) / n;
  *nch = (rcount + *chunk - 1) / *chunk;
}

/* ---- sum mean prod max min amax amin argmax argmin ---- */

/* What one output (or one chunk of it) has seen so far. */
struct red_part_t {
  double f;     /* float sum/product/extreme */
  int64_t i;    /* integer sum/product/extreme */
  int64_t best; /* position of the extreme; -1 before the first */
  int32_t nan;  /* a NaN was seen (float max/min: it wins) */
  int32_t pad;
};

struct red_args_t {
  red_plan_t p;
  int op;
  bool is_int;
  bool cast_in; /* sum/prod/mean with dtype=: each input value cast to out_dt first */
  dtype_t in_dt, out_dt;
  const char *in;
  char *out, *idx; /* idx: int64 indices (max/min with dim), or NULL */
  int64_t out_esz;
  int64_t nch, chunk;

  CU_HD bool is_max() const { return op == REDUCE_MAX || op == REDUCE_ARGMAX; }

  /* Positions [p0, p1) of the output whose kept in-offset is in_off. */
  CU_HD red_part_t scan(int64_t in_off, int64_t p0, int64_t p1) const {
    red_part_t a;
    a.f = op == REDUCE_PROD ? 1 : 0;
    a.i = op == REDUCE_PROD ? 1 : 0;
    a.best = -1;
    a.nan = 0;
    a.pad = 0;
    bool mx = is_max();
    red_walk_t w;
    w.start(p, p0);
    for (int64_t pos = p0; pos < p1; pos++, w.next(p)) {
      const char *q = in + in_off + w.off;
      if (is_int) {
        int64_t v = cast_in && out_dt == DTYPE_BOOL ? cu_ld_f(in_dt, q) != 0 : cu_ld_i(in_dt, q);
        if (op == REDUCE_SUM || op == REDUCE_MEAN)
          a.i = (int64_t)((uint64_t)a.i + (uint64_t)v);
        else if (op == REDUCE_PROD) a.i = (int64_t)((uint64_t)a.i * (uint64_t)v);
        else if (a.best < 0 || (mx ? v > a.i : v < a.i)) a.i = v, a.best = pos;
      } else {
        double v = cu_ld_f(in_dt, q);
        if (cast_in) v = ew_round_to(out_dt, v);
        if (op == REDUCE_SUM || op == REDUCE_MEAN) a.f += v;
        else if (op == REDUCE_PROD) a.f *= v;
        else if (!a.nan) {
          if (v != v) a.nan = 1, a.f = v, a.best = pos;
          else if (a.best < 0 || (mx ? v > a.f : v < a.f)) a.f = v, a.best = pos;
        }
      }
    }
    return a;
  }

  /* Folds the partial of a later chunk into a: the same result as scanning on. */
  CU_HD void fold(red_part_t *a, const red_part_t &b) const {
    bool mx = is_max();
    if (op == REDUCE_SUM || op == REDUCE_MEAN) {
      a->i = (int64_t)((uint64_t)a->i + (uint64_t)b.i);
      a->f += b.f;
    } else if (op == REDUCE_PROD) {
      a->i = (int64_t)((uint64_t)a->i * (uint64_t)b.i);
      a->f *= b.f;
    } else if (is_int) {
      if (a->best < 0 || (mx ? b.i > a->i : b.i < a->i)) a->i = b.i, a->best = b.best;
    } else if (!a->nan) {
      if (b.nan || a->best < 0 || (mx ? b.f > a->f : b.f < a->f)) *a = b;
    }
  }

  CU_HD void finish(int64_t out_off, const red_part_t &a) const {
    char *dst = out + out_off;
    if (op == REDUCE_ARGMAX || op == REDUCE_ARGMIN) {
      cu_st_i(DTYPE_INT64, dst, a.best);
      return;
    }
    double f = a.f;
    if (op == REDUCE_MEAN) f = (is_int ? (double)a.i : f) / (double)p.rcount;
    if (is_int && op != REDUCE_MEAN) cu_st_i(out_dt, dst, a.i);
    else cu_st_f(out_dt, dst, f);
    if (op >= REDUCE_MAX && idx) cu_st_i(DTYPE_INT64, idx + out_off / out_esz * 8, a.best);
  }
};

/* One output, its whole extent in one walk (exactly the cpu's order). */
struct ReduceOne {
  red_args_t r;
  CU_HD void operator()(int64_t o) const {
    int64_t in_off, out_off;
    r.p.kept(o, &in_off, &out_off);
    r.finish(out_off, r.scan(in_off, 0, r.p.rcount));
  }
};

/* Stage 1: partial i = chunk i % nch of output i / nch. */
struct ReducePart {
  red_args_t r;
  red_part_t *parts;
  CU_HD void operator()(int64_t i) const {
    int64_t o = i / r.nch, c = i % r.nch, in_off, out_off;
    int64_t p0 = c * r.chunk, p1 = p0 + r.chunk < r.p.rcount ? p0 + r.chunk : r.p.rcount;
    r.p.kept(o, &in_off, &out_off);
    parts[i] = r.scan(in_off, p0, p1);
  }
};

/* Stage 2: output o from its partials, in chunk order. */
struct ReduceFold {
  red_args_t r;
  const red_part_t *parts;
  CU_HD void operator()(int64_t o) const {
    int64_t in_off, out_off;
    r.p.kept(o, &in_off, &out_off);
    red_part_t a = parts[o * r.nch];
    for (int64_t c = 1; c < r.nch; c++) r.fold(&a, parts[o * r.nch + c]);
    r.finish(out_off, a);
  }
};

int scratch_oom(const kernel_call_t *c, size_t bytes, meshd_error_t *e) {
  return error_set(e, ERR_QUOTA, "%s: out of device memory for %zu bytes of scratch (rank %u)",
                   kernel_opname(c), bytes, c->rank);
}

}  // namespace

extern "C" int cuda_kernel_reduce(const kernel_call_t *c, meshd_error_t *e) {
  red_args_t r;
  memset(&r, 0, sizeof r);
  r.op = kernel_reduce_op(kernel_opname(c));
  if (r.op < 0)
    return error_set(e, ERR_REMOTE_FAILURE, "%s: not a reduction the cuda backend knows",
                     kernel_opname(c));
  agent_tensor_t *in = kernel_arg(c, 0), *out = c->res[0];
  uint32_t mask = kernel_reduce_mask(c, &in->meta.layout);
  r.in_dt = in->meta.dtype;
  r.out_dt = out->meta.dtype;
  r.in = cu_data(in);
  r.out = cu_data(out);
  r.idx = c->nres > 1 && c->inf->nresults > 1 ? cu_data(c->res[1]) : NULL;
  r.out_esz = cu_size(r.out_dt);
  /* sums and products accumulate in the result dtype, max/min compare in self's */
  r.is_int = r.op <= REDUCE_PROD ? cu_is_int(r.out_dt) && r.op != REDUCE_MEAN
                                 : cu_is_int(r.in_dt);
  r.cast_in = r.op <= REDUCE_PROD && r.in_dt != r.out_dt;
  kernel_reduce_plan(&r.p, in, mask, &out->meta.layout, r.out_esz, false);
  int64_t nout = layout_numel(&out->meta.layout);
  plan_chunks(nout, r.p.rcount, &r.nch, &r.chunk);
  if (r.nch == 1) return cuda_launch(c->b, c->bs, nout, ReduceOne{r}, kernel_opname(c), e);

  size_t bytes = (size_t)(nout * r.nch) * sizeof(red_part_t);
  red_part_t *parts = (red_part_t *)cuda_scratch_alloc(c->b, c->bs, bytes);
  if (!parts) return scratch_oom(c, bytes, e);
  int rc = cuda_launch(c->b, c->bs, nout * r.nch, ReducePart{r, parts}, kernel_opname(c), e);
  if (rc == 0) rc = cuda_launch(c->b, c->bs, nout, ReduceFold{r, parts}, kernel_opname(c), e);
  cuda_scratch_free(c->b, c->bs, parts, bytes);
  return rc;
}

/* ---- softmax, log_softmax ---- */

namespace {

/* Per row: stats[2 * row] the max, stats[2 * row + 1] the sum of exp(v - max). */
struct sm_args_t {
  red_plan_t p;
  bool log;
  dtype_t in_dt, out_dt;
  const char *in;
  char *out;
  int64_t nch, chunk;
  double *parts, *stats;

  CU_HD void range(int64_t i, int64_t *in_off, int64_t *p0, int64_t *p1) const {
    int64_t o = i / nch, c = i % nch, out_off;
    p.kept(o, in_off, &out_off);
    *p0 = c * chunk;
    *p1 = *p0 + chunk < p.rcount ? *p0 + chunk : p.rcount;
  }
};

/* The cpu's running max: NaN sticks once seen, ties keep the first. */
CU_HD void sm_max(double *mx, double v) {
  if (v > *mx || v != v) *mx = *mx != *mx ? *mx : v;
}

struct SoftmaxPartMax {
  sm_args_t s;
  CU_HD void operator()(int64_t i) const {
    int64_t in_off, p0, p1;
    s.range(i, &in_off, &p0, &p1);
    double mx = -INFINITY;
    red_walk_t w;
    w.start(s.p, p0);
    for (int64_t n = p0; n < p1; n++, w.next(s.p)) sm_max(&mx, cu_ld_f(s.in_dt, s.in + in_off + w.off));
    s.parts[i] = mx;
  }
};

struct SoftmaxPartSum {
  sm_args_t s;
  CU_HD void operator()(int64_t i) const {
    int64_t in_off, p0, p1;
    s.range(i, &in_off, &p0, &p1);
    double mx = s.stats[2 * (i / s.nch)], sum = 0;
    red_walk_t w;
    w.start(s.p, p0);
    for (int64_t n = p0; n < p1; n++, w.next(s.p))
      sum += exp(cu_ld_f(s.in_dt, s.in + in_off + w.off) - mx);
    s.parts[i] = sum;
  }
};

/* Row o's partials into stats[2 * o + which] (which 0: max, 1: sum). */
struct SoftmaxFold {
  sm_args_t s;
  int which;
  CU_HD void operator()(int64_t o) const {
    const double *q = s.parts + o * s.nch;
    double a = q[0];
    for (int64_t c = 1; c < s.nch; c++) {
      if (which == 0) sm_max(&a, q[c]);
      else a += q[c];
    }
    s.stats[2 * o + which] = a;
  }
};

/* One element: i = row * rcount + reduced position. */
struct SoftmaxWrite {
  sm_args_t s;
  CU_HD void operator()(int64_t i) const {
    int64_t o = i / s.p.rcount, n = i % s.p.rcount, in_off, out_off, oo;
    s.p.kept(o, &in_off, &out_off);
    int64_t io = s.p.reduced(n, &oo);
    double mx = s.stats[2 * o], sum = s.stats[2 * o + 1];
    double v = cu_ld_f(s.in_dt, s.in + in_off + io) - mx;
    cu_st_f(s.out_dt, s.out + out_off + oo, s.log ? v - log(sum) : exp(v) / sum);
  }
};

}  // namespace

extern "C" int cuda_kernel_softmax(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *in = kernel_arg(c, 0), *out = c->res[0];
  const layout_t *l = &in->meta.layout;
  int64_t d = c->a->v[1].i < 0 ? c->a->v[1].i + l->ndim : c->a->v[1].i;
  sm_args_t s;
  memset(&s, 0, sizeof s);
  s.log = strcmp(kernel_opname(c), "log_softmax") == 0;
  s.in_dt = in->meta.dtype;
  s.out_dt = out->meta.dtype;
  s.in = cu_data(in);
  s.out = cu_data(out);
  kernel_reduce_plan(&s.p, in, l->ndim ? 1u << d : 0, &out->meta.layout, cu_size(s.out_dt),
                     true);
  if (s.p.rcount == 0) return 0;
  int64_t nrows = layout_numel(l) / s.p.rcount;
  if (nrows == 0) return 0;
  plan_chunks(nrows, s.p.rcount, &s.nch, &s.chunk);

  size_t bytes = (size_t)(nrows * s.nch + 2 * nrows) * sizeof(double);
  double *scratch = (double *)cuda_scratch_alloc(c->b, c->bs, bytes);
  if (!scratch) return scratch_oom(c, bytes, e);
  s.parts = scratch;
  s.stats = scratch + nrows * s.nch;
  const char *what = kernel_opname(c);
  int rc = cuda_launch(c->b, c->bs, nrows * s.nch, SoftmaxPartMax{s}, what, e);
  if (rc == 0) rc = cuda_launch(c->b, c->bs, nrows, SoftmaxFold{s, 0}, what, e);
  if (rc == 0) rc = cuda_launch(c->b, c->bs, nrows * s.nch, SoftmaxPartSum{s}, what, e);
  if (rc == 0) rc = cuda_launch(c->b, c->bs, nrows, SoftmaxFold{s, 1}, what, e);
  if (rc == 0) rc = cuda_launch(c->b, c->bs, nrows * s.p.rcount, SoftmaxWrite{s}, what, e);
  cuda_scratch_free(c->b, c->bs, scratch, bytes);
  return rc;
}

/* ---- slice reductions for the communicators (agent/dataplane/reduce_ops.c) ---- */

namespace {

/* 16-bit values round through float32 as on the data plane (half.h). */

CU_HD double dp_fmin_nan(double a, double b) { return a != a ? a : b != b ? b : a < b ? a : b; }
CU_HD double dp_fmax_nan(double a, double b) { return a != a ? a : b != b ? b : a > b ? a : b; }

/* d = d OP s in T, as the data plane's FLOAT_KERNEL / INT_KERNEL. */
template <class T>
CU_HD T dp_float_op(reduction_t op, T d, T s) {
  switch (op) {
    case RED_SUM: case RED_AVG: return d + s;
    case RED_PRODUCT: return d * s;
    case RED_MIN: return (T)dp_fmin_nan(d, s);
    case RED_MAX: return (T)dp_fmax_nan(d, s);
    default: return d;
  }
}

template <class T, class U>
CU_HD T dp_int_op(reduction_t op, T d, T s) {
  switch (op) {
    case RED_SUM: return (T)(U)((U)d + (U)s);
    case RED_PRODUCT: return (T)(U)((uint64_t)(U)d * (uint64_t)(U)s);
    case RED_MIN: return s < d ? s : d;
    case RED_MAX: return s > d ? s : d;
    case RED_BAND: return (T)(d & s);
    case RED_BOR: return (T)(d | s);
    case RED_BXOR: return (T)(d ^ s);
    default: return d;
  }
}

CU_HD uint8_t dp_bool_op(reduction_t op, uint8_t d, uint8_t s) {
  bool a = d != 0, b = s != 0;
  switch (op) {
    case RED_SUM: case RED_MAX: case RED_BOR: return a || b;
    case RED_PRODUCT: case RED_MIN: case RED_BAND: return a && b;
    case RED_BXOR: return a != b;
    default: return d;
  }
}

/* Integers (avg is floating only: reduction.h). */
template <class T, class U>
CU_HD void dp_fold_int(reduction_t op, const char *in, char *out, size_t n, size_t count,
                       size_t j) {
  const T *p = (const T *)in;
  T a = p[j];
  for (size_t k = 1; k < n; k++) a = dp_int_op<T, U>(op, a, p[k * count + j]);
  ((T *)out)[j] = a;
}

template <class T>
CU_HD void dp_fold_float(reduction_t op, const char *in, char *out, size_t n, size_t count,
                         size_t j) {
  const T *p = (const T *)in;
  T a = p[j];
  for (size_t k = 1; k < n; k++) a = dp_float_op<T>(op, a, p[k * count + j]);
  if (op == RED_AVG && n > 1) a = (T)(a / (T)n);
  ((T *)out)[j] = a;
}

/* float16/bfloat16: each step widens to float32, reduces, rounds back. */
CU_HD void dp_fold_half(reduction_t op, bool bf16, const char *in, char *out, size_t n,
                        size_t count, size_t j) {
  const uint16_t *p = (const uint16_t *)in;
  uint16_t a = p[j];
  for (size_t k = 1; k < n; k++) {
    uint16_t s = p[k * count + j];
    float x = bf16 ? bf16_to_float(a) : half_to_float(a);
    float y = bf16 ? bf16_to_float(s) : half_to_float(s);
    float r = dp_float_op<float>(op, x, y);
    a = bf16 ? float_to_bf16(r) : float_to_half(r);
  }
  if (op == RED_AVG && n > 1) {
    float v = (bf16 ? bf16_to_float(a) : half_to_float(a)) / (float)n;
    a = bf16 ? float_to_bf16(v) : float_to_half(v);
  }
  ((uint16_t *)out)[j] = a;
}

struct ReduceSlices {
  const char *in;
  char *out;
  size_t n, count;
  dtype_t dt;
  reduction_t op;
  CU_HD void operator()(int64_t i) const {
    size_t j = (size_t)i;
    switch (dt) {
      case DTYPE_FLOAT32: dp_fold_float<float>(op, in, out, n, count, j); break;
      case DTYPE_FLOAT64: dp_fold_float<double>(op, in, out, n, count, j); break;
      case DTYPE_FLOAT16: dp_fold_half(op, false, in, out, n, count, j); break;
      case DTYPE_BFLOAT16: dp_fold_half(op, true, in, out, n, count, j); break;
      case DTYPE_INT8: dp_fold_int<int8_t, uint8_t>(op, in, out, n, count, j); break;
      case DTYPE_UINT8: dp_fold_int<uint8_t, uint8_t>(op, in, out, n, count, j); break;
      case DTYPE_INT16: dp_fold_int<int16_t, uint16_t>(op, in, out, n, count, j); break;
      case DTYPE_INT32: dp_fold_int<int32_t, uint32_t>(op, in, out, n, count, j); break;
      case DTYPE_INT64: dp_fold_int<int64_t, uint64_t>(op, in, out, n, count, j); break;
      case DTYPE_BOOL: {
        const uint8_t *p = (const uint8_t *)in;
        uint8_t a = p[j];
        for (size_t k = 1; k < n; k++) a = dp_bool_op(op, a, p[k * count + j]);
        ((uint8_t *)out)[j] = a;
        break;
      }
      default: break;
    }
  }
};

}  // namespace

extern "C" int cuda_reduce_slices(backend_t *b, backend_stream_t *bs, const void *in, void *out,
                                  size_t n, size_t count, dtype_t dtype, reduction_t op,
                                  meshd_error_t *e) {
  if (dp_reduce_check(op, dtype, e) != 0) return -1; /* the data plane's rules and words */
  if (n == 0 || count == 0) return 0;
  ReduceSlices f = {(const char *)in, (char *)out, n, count, dtype, op};
  return cuda_launch(b, bs, (int64_t)count, f, "reduce slices", e);
}
