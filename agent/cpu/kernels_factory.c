/* Factories (empty zeros ones full arange rand randn rank) and the fills. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"
#include "philox.h"

/* Writes the Scalar v into every element of t (any layout). */
static void fill_value(agent_tensor_t *t, const op_value_t *v) {
  char buf[16];
  dtype_t dt = t->meta.dtype;
  if (v->kind == VAL_FLOAT) cpu_st_f(dt, buf, v->f);
  else cpu_st_i(dt, buf, v->kind == VAL_BOOL ? v->b : v->i);
  agent_storage_t st = {.data = buf};
  agent_tensor_t one = {.meta = {.dtype = dt, .layout = {.ndim = 0}}, .storage = &st};
  cpu_copy_broadcast(t, &one);
}

int cpu_kernel_fill(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *t = c->res[0];
  const char *name = kernel_opname(c);
  int64_t n = layout_numel(&t->meta.layout);
  size_t bytes = (size_t)n * dtype_size(t->meta.dtype);
  /* Fresh results are contiguous at offset 0. */
  if (strcmp(name, "empty") == 0 || strcmp(name, "zeros") == 0) {
    memset(cpu_data(t), 0, bytes); /* empty too: never hand out stale memory */
    return 0;
  }
  op_value_t one = {.kind = VAL_INT, .i = 1};
  fill_value(t, strcmp(name, "ones") == 0 ? &one : &c->a->v[1]);
  return 0;
}

static double scalar_f(const op_value_t *v) {
  return v->kind == VAL_FLOAT ? v->f : v->kind == VAL_BOOL ? (double)v->b : (double)v->i;
}

int cpu_kernel_arange(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *t = c->res[0];
  const op_value_t *start = &c->a->v[0], *step = &c->a->v[2];
  op_value_t zero = {.kind = VAL_INT, .i = 0};
  if (c->a->v[1].kind == VAL_NONE) start = &zero;
  dtype_t dt = t->meta.dtype;
  int64_t n = t->meta.layout.sizes[0];
  char *p = cpu_data(t);
  size_t esz = dtype_size(dt);
  if (cpu_is_int(dt)) {
    /* torch truncates float bounds for integer dtypes */
    int64_t s = start->kind == VAL_INT ? start->i : cpu_f2i(scalar_f(start));
    int64_t st = step->kind == VAL_INT ? step->i : cpu_f2i(scalar_f(step));
    for (int64_t i = 0; i < n; i++)
      cpu_st_i(dt, p + i * (int64_t)esz, (int64_t)((uint64_t)s + (uint64_t)i * (uint64_t)st));
  } else {
    double s = scalar_f(start), st = scalar_f(step);
    for (int64_t i = 0; i < n; i++) cpu_st_f(dt, p + i * (int64_t)esz, s + (double)i * st);
  }
  return 0;
}

typedef struct {
  char *out;
  dtype_t dt;
  bool normal;
  int bits;
  uint64_t seed, offset;
  uint32_t rank;
  int64_t n;
} rand_ctx_t;

/* Blocks [begin, end) of 4 elements each, counted from the draw's offset. */
static void rand_blocks(void *p, int64_t begin, int64_t end) {
  const rand_ctx_t *r = p;
  size_t esz = dtype_size(r->dt);
  for (int64_t blk = begin; blk < end; blk++) {
    uint64_t g0 = r->offset + (uint64_t)blk * 4; /* element index of lane 0 */
    uint32_t w[4];
    philox_block(r->seed, r->rank, g0 / 4, w);
    double v[4];
    if (r->normal) {
      for (int pr = 0; pr < 2; pr++) {
        double u1 = philox_uniform(w[2 * pr], 24), u2 = philox_uniform(w[2 * pr + 1], 24);
        double rad = sqrt(-2.0 * log(1.0 - u1)), th = 2.0 * M_PI * u2;
        v[2 * pr] = rad * cos(th);
        v[2 * pr + 1] = rad * sin(th);
      }
    } else {
      for (int j = 0; j < 4; j++) v[j] = philox_uniform(w[j], r->bits);
    }
    for (int j = 0; j < 4; j++) {
      int64_t i = blk * 4 + j;
      if (i < r->n) cpu_st_f(r->dt, r->out + i * (int64_t)esz, v[j]);
    }
  }
}

int cpu_kernel_rand(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *t = c->res[0];
  dtype_t dt = t->meta.dtype;
  rand_ctx_t r = {
      .out = cpu_data(t),
      .dt = dt,
      .normal = strcmp(kernel_opname(c), "randn") == 0,
      .bits = dt == DTYPE_FLOAT16 ? 11 : dt == DTYPE_BFLOAT16 ? 8 : 24,
      .rank = c->rank,
      .n = layout_numel(&t->meta.layout),
  };
  const op_value_t *seed = &c->a->v[2];
  if (seed->kind == VAL_INT) {
    r.seed = (uint64_t)seed->i;
  } else {
    cpu_state_t *s = c->b->impl;
    r.seed = PHILOX_DEFAULT_SEED;
    r.offset = atomic_fetch_add(&s->rand_offset, ((uint64_t)r.n + 3) / 4 * 4);
  }
  /* The offset is a multiple of 4, so blocks of the draw are whole blocks. */
  cpu_parallel_for((r.n + 3) / 4, 4096, rand_blocks, &r);
  return 0;
}

int cpu_kernel_rank(const kernel_call_t *c, meshd_error_t *e) {
  cpu_st_i(DTYPE_INT64, cpu_data(c->res[0]), c->coordinate);
  return 0;
}

int cpu_kernel_fill_(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = kernel_arg(c, 0);
  if (strcmp(kernel_opname(c), "zero_") == 0) {
    op_value_t zero = {.kind = VAL_INT, .i = 0};
    fill_value(self, &zero);
    return 0;
  }
  agent_tensor_t *v = kernel_arg(c, 1);
  if (v) cpu_copy_broadcast(self, v);
  else fill_value(self, &c->a->v[1]);
  return 0;
}
