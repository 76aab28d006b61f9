/* Reductions (sum mean prod max min amax amin argmax argmin) and softmax. Each
 * output element walks its reduced dims in row-major order, so the walk's count
 * is the index argmax reports (flat over all dims when no dim is named). */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"
#include "elementwise_ops.h"
#include "kernel_plan.h"

typedef struct {
  kernel_reduce_plan_t p; /* kernel_plan.h */
  int op;                 /* kernel_reduce_op_t */
  bool is_int;
  bool cast_in; /* sum/prod/mean with dtype=: each input value cast to out_dt first */
  dtype_t in_dt, out_dt;
  const char *in;
  char *out, *idx; /* idx: int64 indices (max/min with dim), or NULL */
} red_t;

/* Offsets of kept position `o` (row-major over the kept dims). */
static void kept_offsets(const kernel_reduce_plan_t *r, int64_t o, int64_t *in_off,
                         int64_t *out_off) {
  *in_off = *out_off = 0;
  for (int k = r->nk - 1; k >= 0; k--) {
    int64_t i = o % r->ksize[k];
    o /= r->ksize[k];
    *in_off += i * r->kin[k];
    *out_off += i * r->kout[k];
  }
}

/* Byte offset of reduced position `n` into in (and into out, for softmax). */
static int64_t reduced_offset(const kernel_reduce_plan_t *r, int64_t n, int64_t *out_off) {
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
  const kernel_reduce_plan_t *pl = &r->p;
  bool is_max = r->op == REDUCE_MAX || r->op == REDUCE_ARGMAX;
  bool is_arg = r->op >= REDUCE_MAX;
  int64_t inner_n = pl->nr ? pl->rsize[pl->nr - 1] : 1;
  int64_t inner_s = pl->nr ? pl->rin[pl->nr - 1] : 0;
  for (int64_t o = begin; o < end; o++) {
    int64_t in_off, out_off;
    kept_offsets(pl, o, &in_off, &out_off);
    double accf = r->op == REDUCE_PROD ? 1 : 0;
    int64_t acci = r->op == REDUCE_PROD ? 1 : 0, best = -1;
    bool nan_seen = false;
    for (int64_t n = 0; n < pl->rcount; n += inner_n) {
      const char *q = r->in + in_off + reduced_offset(pl, n, NULL);
      for (int64_t t = 0; t < inner_n; t++, q += inner_s) {
        int64_t pos = n + t;
        if (r->is_int) {
          int64_t v = r->cast_in && r->out_dt == DTYPE_BOOL ? cpu_ld_f(r->in_dt, q) != 0
                                                            : cpu_ld_i(r->in_dt, q);
          if (r->op == REDUCE_SUM || r->op == REDUCE_MEAN)
            acci = (int64_t)((uint64_t)acci + (uint64_t)v);
          else if (r->op == REDUCE_PROD) acci = (int64_t)((uint64_t)acci * (uint64_t)v);
          else if (best < 0 || (is_max ? v > acci : v < acci)) acci = v, best = pos;
        } else {
          double v = cpu_ld_f(r->in_dt, q);
          if (r->cast_in) v = ew_round_to(r->out_dt, v);
          if (r->op == REDUCE_SUM || r->op == REDUCE_MEAN) accf += v;
          else if (r->op == REDUCE_PROD) accf *= v;
          else if (!nan_seen) {
            if (isnan(v)) nan_seen = true, accf = v, best = pos;
            else if (best < 0 || (is_max ? v > accf : v < accf)) accf = v, best = pos;
          }
        }
      }
    }
    char *dst = r->out + out_off;
    if (r->op == REDUCE_ARGMAX || r->op == REDUCE_ARGMIN) {
      cpu_st_i(DTYPE_INT64, dst, best);
      continue;
    }
    if (r->op == REDUCE_MEAN) accf = r->is_int ? (double)acci : accf, accf /= (double)pl->rcount;
    if (r->is_int && r->op != REDUCE_MEAN) cpu_st_i(r->out_dt, dst, acci);
    else cpu_st_f(r->out_dt, dst, accf);
    if (is_arg && r->idx) cpu_st_i(DTYPE_INT64, r->idx + out_off / (int64_t)dtype_size(r->out_dt) * 8, best);
  }
}

int cpu_kernel_reduce(const kernel_call_t *c, meshd_error_t *e) {
  red_t r = {.op = kernel_reduce_op(kernel_opname(c))};
  agent_tensor_t *in = kernel_arg(c, 0), *out = c->res[0];
  uint32_t mask = kernel_reduce_mask(c, &in->meta.layout);
  r.in_dt = in->meta.dtype;
  r.out_dt = out->meta.dtype;
  r.in = cpu_data(in);
  r.out = cpu_data(out);
  r.idx = c->nres > 1 && c->inf->nresults > 1 ? cpu_data(c->res[1]) : NULL;
  /* sums and products accumulate in the result dtype, max/min compare in self's */
  r.is_int = r.op <= REDUCE_PROD ? cpu_is_int(r.out_dt) && r.op != REDUCE_MEAN
                                 : cpu_is_int(r.in_dt);
  r.cast_in = r.op <= REDUCE_PROD && r.in_dt != r.out_dt;
  kernel_reduce_plan(&r.p, in, mask, &out->meta.layout, (int64_t)dtype_size(r.out_dt), false);
  int64_t nout = layout_numel(&out->meta.layout);
  int64_t grain = r.p.rcount >= 4096 ? 1 : 4096 / (r.p.rcount ? r.p.rcount : 1);
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
  const kernel_reduce_plan_t *pl = &r->p;
  for (int64_t o = begin; o < end; o++) {
    int64_t in_off, out_off;
    kept_offsets(pl, o, &in_off, &out_off);
    double mx = -INFINITY, sum = 0;
    for (int64_t n = 0; n < pl->rcount; n++) {
      double v = cpu_ld_f(r->in_dt, r->in + in_off + reduced_offset(pl, n, NULL));
      if (v > mx || isnan(v)) mx = isnan(mx) ? mx : v;
    }
    for (int64_t n = 0; n < pl->rcount; n++)
      sum += exp(cpu_ld_f(r->in_dt, r->in + in_off + reduced_offset(pl, n, NULL)) - mx);
    double lse = log(sum);
    for (int64_t n = 0; n < pl->rcount; n++) {
      int64_t oo;
      double v = cpu_ld_f(r->in_dt, r->in + in_off + reduced_offset(pl, n, &oo)) - mx;
      cpu_st_f(r->out_dt, r->out + out_off + oo, s->log ? v - lse : exp(v) / sum);
    }
  }
}

int cpu_kernel_softmax(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *in = kernel_arg(c, 0), *out = c->res[0];
  const layout_t *l = &in->meta.layout;
  int64_t d = c->a->v[1].i < 0 ? c->a->v[1].i + l->ndim : c->a->v[1].i;
  softmax_t s = {.log = strcmp(kernel_opname(c), "log_softmax") == 0};
  s.r.in_dt = in->meta.dtype;
  s.r.out_dt = out->meta.dtype;
  s.r.in = cpu_data(in);
  s.r.out = cpu_data(out);
  kernel_reduce_plan(&s.r.p, in, l->ndim ? 1u << d : 0, &out->meta.layout,
                     (int64_t)dtype_size(s.r.out_dt), true);
  int64_t rcount = s.r.p.rcount;
  int64_t nout = layout_numel(l) / (rcount ? rcount : 1);
  if (rcount == 0) return 0;
  cpu_parallel_for(nout, rcount >= 4096 ? 1 : 4096 / rcount, softmax_range, &s);
  return 0;
}
