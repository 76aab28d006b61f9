/* Reductions (sum mean prod max min amax amin argmax argmin) and softmax. Each
 * output element walks its reduced dims in row-major order, so the walk's count
 * is the index argmax reports (flat over all dims when no dim is named). */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

enum { R_SUM, R_MEAN, R_PROD, R_MAX, R_MIN, R_ARGMAX, R_ARGMIN };

typedef struct {
  int op;
  bool is_int;
  dtype_t in_dt, out_dt;
  const char *in;
  char *out, *idx;          /* idx: int64 indices (max/min with dim), or NULL */
  int nk, nr;
  int64_t ksize[LAYOUT_MAX_DIMS], kin[LAYOUT_MAX_DIMS], kout[LAYOUT_MAX_DIMS];
  int64_t rsize[LAYOUT_MAX_DIMS], rin[LAYOUT_MAX_DIMS], rout[LAYOUT_MAX_DIMS];
  int64_t rcount;
} red_t;

/* Splits in's dims into kept and reduced ones (mask bits); `out` has the kept
 * dims, plus the reduced ones as size 1 (keepdim) or in full (softmax) when
 * out_has_reduced. Strides are in bytes. */
static void plan(red_t *r, const agent_tensor_t *in, uint32_t mask, const layout_t *out,
                 size_t out_esz, bool out_has_reduced) {
  const layout_t *l = &in->meta.layout;
  size_t esz = dtype_size(in->meta.dtype);
  int j = 0;
  r->nk = r->nr = 0;
  r->rcount = 1;
  for (int d = 0; d < l->ndim; d++) {
    if (mask & (1u << d)) {
      r->rsize[r->nr] = l->sizes[d];
      r->rin[r->nr] = l->strides[d] * (int64_t)esz;
      r->rout[r->nr] = out_has_reduced ? out->strides[j] * (int64_t)out_esz : 0;
      r->rcount *= l->sizes[d];
      r->nr++;
      if (out->ndim == l->ndim) j++; /* keepdim, or softmax */
    } else {
      r->ksize[r->nk] = l->sizes[d];
      r->kin[r->nk] = l->strides[d] * (int64_t)esz;
      r->kout[r->nk] = out->strides[j++] * (int64_t)out_esz;
      r->nk++;
    }
  }
}

/* Offsets of kept position `o` (row-major over the kept dims). */
static void kept_offsets(const red_t *r, int64_t o, int64_t *in_off, int64_t *out_off) {
  *in_off = *out_off = 0;
  for (int k = r->nk - 1; k >= 0; k--) {
    int64_t i = o % r->ksize[k];
    o /= r->ksize[k];
    *in_off += i * r->kin[k];
    *out_off += i * r->kout[k];
  }
}

/* Byte offset of reduced position `n` into in (and into out, for softmax). */
static int64_t reduced_offset(const red_t *r, int64_t n, int64_t *out_off) {
  int64_t off = 0, oo = 0;
  for (int k = r->nr - 1; k >= 0; k--) {
    int64_t i = n % r->rsize[k];
    n /= r->rsize[k];
    off += i * r->rin[k];
    oo += i * r->rout[k];
  }
  if (out_off) *out_off = oo;
  return off;
}

static void reduce_range(void *p, int64_t begin, int64_t end) {
  const red_t *r = p;
  bool is_max = r->op == R_MAX || r->op == R_ARGMAX;
  bool is_arg = r->op >= R_MAX;
  int64_t inner_n = r->nr ? r->rsize[r->nr - 1] : 1, inner_s = r->nr ? r->rin[r->nr - 1] : 0;
  for (int64_t o = begin; o < end; o++) {
    int64_t in_off, out_off;
    kept_offsets(r, o, &in_off, &out_off);
    double accf = r->op == R_PROD ? 1 : 0;
    int64_t acci = r->op == R_PROD ? 1 : 0, best = -1;
    bool nan_seen = false;
    for (int64_t n = 0; n < r->rcount; n += inner_n) {
      const char *q = r->in + in_off + reduced_offset(r, n, NULL);
      for (int64_t t = 0; t < inner_n; t++, q += inner_s) {
        int64_t pos = n + t;
        if (r->is_int) {
          int64_t v = cpu_ld_i(r->in_dt, q);
          if (r->op == R_SUM || r->op == R_MEAN) acci = (int64_t)((uint64_t)acci + (uint64_t)v);
          else if (r->op == R_PROD) acci = (int64_t)((uint64_t)acci * (uint64_t)v);
          else if (best < 0 || (is_max ? v > acci : v < acci)) acci = v, best = pos;
        } else {
          double v = cpu_ld_f(r->in_dt, q);
          if (r->op == R_SUM || r->op == R_MEAN) accf += v;
          else if (r->op == R_PROD) accf *= v;
          else if (!nan_seen) {
            if (isnan(v)) nan_seen = true, accf = v, best = pos;
            else if (best < 0 || (is_max ? v > accf : v < accf)) accf = v, best = pos;
          }
        }
      }
    }
    char *dst = r->out + out_off;
    if (r->op == R_ARGMAX || r->op == R_ARGMIN) {
      cpu_st_i(DTYPE_INT64, dst, best);
      continue;
    }
    if (r->op == R_MEAN) accf = r->is_int ? (double)acci : accf, accf /= (double)r->rcount;
    if (r->is_int && r->op != R_MEAN) cpu_st_i(r->out_dt, dst, acci);
    else cpu_st_f(r->out_dt, dst, accf);
    if (is_arg && r->idx) cpu_st_i(DTYPE_INT64, r->idx + out_off / (int64_t)dtype_size(r->out_dt) * 8, best);
  }
}

/* The reduced dims of argument 'dim' (None or [] reduce all). */
static uint32_t reduce_mask(const cpu_call_t *c, const layout_t *l, bool *all) {
  const int64_t *dims;
  size_t n = 0;
  *all = c->a->v[1].kind == VAL_NONE || (op_value_ints(&c->a->v[1], &dims, &n) && n == 0);
  if (*all) return l->ndim ? (uint32_t)((1ull << l->ndim) - 1) : 0;
  uint32_t mask = 0;
  for (size_t k = 0; k < n; k++) {
    int64_t d = dims[k] < 0 ? dims[k] + l->ndim : dims[k];
    if (l->ndim == 0) continue; /* a 0-dim tensor reduces over nothing */
    mask |= 1u << d;
  }
  return mask;
}

int cpu_kernel_reduce(const cpu_call_t *c, meshd_error_t *e) {
  static const struct {
    const char *name;
    int op;
  } names[] = {{"sum", R_SUM},   {"mean", R_MEAN}, {"prod", R_PROD},     {"max", R_MAX},
               {"min", R_MIN},   {"amax", R_MAX},  {"amin", R_MIN},      {"argmax", R_ARGMAX},
               {"argmin", R_ARGMIN}};
  red_t r = {.op = -1};
  for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
    if (strcmp(names[k].name, cpu_opname(c)) == 0) r.op = names[k].op;
  agent_tensor_t *in = cpu_arg(c, 0), *out = c->res[0];
  bool all;
  uint32_t mask = reduce_mask(c, &in->meta.layout, &all);
  r.in_dt = in->meta.dtype;
  r.out_dt = out->meta.dtype;
  r.in = cpu_data(in);
  r.out = cpu_data(out);
  r.idx = c->nres > 1 && c->inf->nresults > 1 ? cpu_data(c->res[1]) : NULL;
  /* sums and products accumulate in the result dtype, max/min compare in self's */
  r.is_int = r.op <= R_PROD ? cpu_is_int(r.out_dt) && r.op != R_MEAN : cpu_is_int(r.in_dt);
  plan(&r, in, mask, &out->meta.layout, dtype_size(r.out_dt), false);
  int64_t nout = layout_numel(&out->meta.layout);
  int64_t grain = r.rcount >= 4096 ? 1 : 4096 / (r.rcount ? r.rcount : 1);
  cpu_parallel_for(nout, grain, reduce_range, &r);
  return 0;
}

/* ---- softmax ---- */

typedef struct {
  red_t r;
  bool log;
} softmax_t;

static void softmax_range(void *p, int64_t begin, int64_t end) {
  const softmax_t *s = p;
  const red_t *r = &s->r;
  for (int64_t o = begin; o < end; o++) {
    int64_t in_off, out_off;
    kept_offsets(r, o, &in_off, &out_off);
    double mx = -INFINITY, sum = 0;
    for (int64_t n = 0; n < r->rcount; n++) {
      double v = cpu_ld_f(r->in_dt, r->in + in_off + reduced_offset(r, n, NULL));
      if (v > mx || isnan(v)) mx = isnan(mx) ? mx : v;
    }
    for (int64_t n = 0; n < r->rcount; n++)
      sum += exp(cpu_ld_f(r->in_dt, r->in + in_off + reduced_offset(r, n, NULL)) - mx);
    double lse = log(sum);
    for (int64_t n = 0; n < r->rcount; n++) {
      int64_t oo;
      double v = cpu_ld_f(r->in_dt, r->in + in_off + reduced_offset(r, n, &oo)) - mx;
      cpu_st_f(r->out_dt, r->out + out_off + oo, s->log ? v - lse : exp(v) / sum);
    }
  }
}

int cpu_kernel_softmax(const cpu_call_t *c, meshd_error_t *e) {
  agent_tensor_t *in = cpu_arg(c, 0), *out = c->res[0];
  const layout_t *l = &in->meta.layout;
  int64_t d = c->a->v[1].i < 0 ? c->a->v[1].i + l->ndim : c->a->v[1].i;
  softmax_t s = {.log = strcmp(cpu_opname(c), "log_softmax") == 0};
  s.r.in_dt = in->meta.dtype;
  s.r.out_dt = out->meta.dtype;
  s.r.in = cpu_data(in);
  s.r.out = cpu_data(out);
  plan(&s.r, in, l->ndim ? 1u << d : 0, &out->meta.layout, dtype_size(s.r.out_dt), true);
  int64_t nout = layout_numel(l) / (s.r.rcount ? s.r.rcount : 1);
  if (s.r.rcount == 0) return 0;
  cpu_parallel_for(nout, s.r.rcount >= 4096 ? 1 : 4096 / s.r.rcount, softmax_range, &s);
  return 0;
}
