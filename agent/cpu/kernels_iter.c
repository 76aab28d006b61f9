/* The strided N-d iterator, the thread splitter, and the casting copy. */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "cpu_internal.h"

#define MAX_THREADS 64
/* Elements below which one thread does the whole job. */
#define PARALLEL_GRAIN ((int64_t)1 << 15)

static int ncpu(void) {
  static _Atomic int n;
  int v = atomic_load(&n);
  if (!v) {
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    v = c < 1 ? 1 : c > MAX_THREADS ? MAX_THREADS : (int)c;
    atomic_store(&n, v);
  }
  return v;
}

typedef struct {
  void (*fn)(void *, int64_t, int64_t);
  void *ctx;
  int64_t begin, end;
} chunk_t;

static void *chunk_main(void *p) {
  chunk_t *c = p;
  c->fn(c->ctx, c->begin, c->end);
  return NULL;
}

void cpu_parallel_for(int64_t n, int64_t grain, void (*fn)(void *ctx, int64_t begin, int64_t end),
                      void *ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int64_t nt = n / grain;
  if (nt > ncpu()) nt = ncpu();
  if (nt <= 1) {
    fn(ctx, 0, n);
    return;
  }
  chunk_t chunks[MAX_THREADS];
  pthread_t th[MAX_THREADS];
  bool started[MAX_THREADS] = {0};
  for (int64_t t = 0; t < nt; t++)
    chunks[t] = (chunk_t){fn, ctx, n * t / nt, n * (t + 1) / nt};
  for (int64_t t = 1; t < nt; t++)
    started[t] = pthread_create(&th[t], NULL, chunk_main, &chunks[t]) == 0;
  chunk_main(&chunks[0]);
  for (int64_t t = 1; t < nt; t++) {
    if (started[t]) pthread_join(th[t], NULL);
    else chunk_main(&chunks[t]); /* no thread to be had: do it here */
  }
}

void cpu_iter_init(cpu_iter_t *it, const int64_t *sizes, int nd) {
  memset(it, 0, sizeof *it);
  it->nd = nd;
  for (int d = 0; d < nd; d++) it->sizes[d] = sizes[d];
}

int cpu_iter_add_raw(cpu_iter_t *it, char *data, const layout_t *l, size_t esz) {
  int k = it->nops++;
  it->base[k] = data;
  int shift = it->nd - l->ndim;
  for (int d = 0; d < it->nd; d++) {
    int sd = d - shift;
    it->strides[k][d] =
        sd < 0 || l->sizes[sd] == 1 ? 0 : l->strides[sd] * (int64_t)esz;
  }
  return k;
}

int cpu_iter_add(cpu_iter_t *it, const agent_tensor_t *t) {
  return cpu_iter_add_raw(it, cpu_data(t), &t->meta.layout, dtype_size(t->meta.dtype));
}

int cpu_iter_add_scalar(cpu_iter_t *it, char *p) {
  int k = it->nops++;
  it->base[k] = p;
  for (int d = 0; d < it->nd; d++) it->strides[k][d] = 0;
  return k;
}

/* Drops size-1 dims and merges dims that every operand walks as one. */
static void coalesce(cpu_iter_t *it) {
  int nd = 0;
  for (int d = 0; d < it->nd; d++) {
    if (it->sizes[d] == 1) continue;
    if (nd > 0) {
      bool merge = true;
      for (int k = 0; k < it->nops && merge; k++)
        merge = it->strides[k][nd - 1] == it->strides[k][d] * it->sizes[d];
      if (merge) {
        it->sizes[nd - 1] *= it->sizes[d];
        for (int k = 0; k < it->nops; k++) it->strides[k][nd - 1] = it->strides[k][d];
        continue;
      }
    }
    it->sizes[nd] = it->sizes[d];
    for (int k = 0; k < it->nops; k++) it->strides[k][nd] = it->strides[k][d];
    nd++;
  }
  it->nd = nd;
}

typedef struct {
  const cpu_iter_t *it;
  cpu_row_fn fn;
  void *ctx;
} run_t;

/* Rows [begin, end): a row is one walk of the innermost dim. */
static void run_rows(void *p, int64_t begin, int64_t end) {
  const run_t *r = p;
  const cpu_iter_t *it = r->it;
  int nd = it->nd, outer = nd - 1;
  int64_t inner = nd ? it->sizes[nd - 1] : 1;
  int64_t idx[LAYOUT_MAX_DIMS] = {0}, st[CPU_MAX_OPS];
  char *ptr[CPU_MAX_OPS];
  for (int k = 0; k < it->nops; k++) st[k] = nd ? it->strides[k][nd - 1] : 0;
  int64_t rem = begin;
  for (int d = outer - 1; d >= 0; d--) {
    idx[d] = rem % it->sizes[d];
    rem /= it->sizes[d];
  }
  for (int64_t row = begin; row < end; row++) {
    for (int k = 0; k < it->nops; k++) {
      char *q = it->base[k];
      for (int d = 0; d < outer; d++) q += idx[d] * it->strides[k][d];
      ptr[k] = q;
    }
    r->fn(r->ctx, ptr, st, inner);
    for (int d = outer - 1; d >= 0; d--) {
      if (++idx[d] < it->sizes[d]) break;
      idx[d] = 0;
    }
  }
}

void cpu_iter_run(cpu_iter_t *it, cpu_row_fn fn, void *ctx) {
  for (int d = 0; d < it->nd; d++)
    if (it->sizes[d] == 0) return;
  coalesce(it);
  int64_t inner = it->nd ? it->sizes[it->nd - 1] : 1, rows = 1;
  for (int d = 0; d + 1 < it->nd; d++) rows *= it->sizes[d];
  run_t r = {it, fn, ctx};
  int64_t grain = inner >= PARALLEL_GRAIN ? 1 : PARALLEL_GRAIN / inner;
  cpu_parallel_for(rows, grain, run_rows, &r);
}

/* ---- casting copy ---- */

typedef struct {
  dtype_t dt, st;
} copy_ctx_t;

static void copy_row(void *p, char *const *ptr, const int64_t *s, int64_t n) {
  const copy_ctx_t *c = p;
  char *d = ptr[0];
  const char *src = ptr[1];
  if (c->dt == c->st) {
    size_t esz = dtype_size(c->dt);
    if (s[0] == (int64_t)esz && s[1] == (int64_t)esz) {
      memmove(d, src, (size_t)n * esz);
      return;
    }
    for (int64_t i = 0; i < n; i++, d += s[0], src += s[1]) memcpy(d, src, esz);
  } else if (cpu_is_int(c->st)) {
    for (int64_t i = 0; i < n; i++, d += s[0], src += s[1]) cpu_st_i(c->dt, d, cpu_ld_i(c->st, src));
  } else {
    for (int64_t i = 0; i < n; i++, d += s[0], src += s[1]) cpu_st_f(c->dt, d, cpu_ld_f(c->st, src));
  }
}

void cpu_copy_broadcast(agent_tensor_t *dst, const agent_tensor_t *src) {
  cpu_iter_t it;
  cpu_iter_init(&it, dst->meta.layout.sizes, dst->meta.layout.ndim);
  cpu_iter_add(&it, dst);
  cpu_iter_add(&it, src);
  copy_ctx_t c = {dst->meta.dtype, src->meta.dtype};
  cpu_iter_run(&it, copy_row, &c);
}
