/* Inside the cpu backend: per-dtype loads and stores, half conversions, the
 * strided N-d iterator every elementwise kernel runs on, and the kernels that
 * run_op dispatches to (kernels_*.c). */
#ifndef MESHD_CPU_INTERNAL_H
#define MESHD_CPU_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "backend.h"
#include "kernel_family.h"
#include "half.h"

/* Freed tensors of MAP_FROM bytes or more that the cpu backend keeps for
 * the next tensor of the same rounded size (cpu_backend.c), within its bytes'
 * bound: 256, so that a loop's 128 KiB..4 MiB temporaries do not push its
 * large tensors out, and a burst of them comes back whole (64 pipelined
 * 256 KiB Literals, dropped and made again, found 16 kept and faulted the
 * other 48 in fresh: 889 us a Literal where 64 KiB ones, off the heap, took
 * 92). */
#define CPU_CACHE_SLOTS 256

typedef struct cpu_block {
  void *p;
  size_t size; /* rounded to its block_align */
} cpu_block_t;

/* backend_t.impl of the cpu backend. */
typedef struct cpu_state {
  _Atomic uint64_t rand_offset; /* the running offset of unseeded draws (philox.h) */
  pthread_mutex_t cache_mu;
  cpu_block_t cache[CPU_CACHE_SLOTS]; /* oldest first */
  int ncache;
  _Atomic size_t cache_bytes; /* changed under cache_mu; read without it as a hint */
  size_t cache_max;
} cpu_state_t;

/* ---- loads and stores: floating values as double, integral ones as int64 ---- */

static inline double cpu_ld_f(dtype_t dt, const char *p) {
  switch (dt) {
  case DTYPE_FLOAT32: { float v; memcpy(&v, p, 4); return v; }
  case DTYPE_FLOAT64: { double v; memcpy(&v, p, 8); return v; }
  case DTYPE_FLOAT16: { uint16_t v; memcpy(&v, p, 2); return half_to_float(v); }
  case DTYPE_BFLOAT16: { uint16_t v; memcpy(&v, p, 2); return bf16_to_float(v); }
  case DTYPE_INT8: return *(const int8_t *)p;
  case DTYPE_UINT8: return *(const uint8_t *)p;
  case DTYPE_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
  case DTYPE_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
  case DTYPE_INT64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
  case DTYPE_BOOL: return *(const uint8_t *)p != 0;
  default: return 0;
  }
}

/* A double to int64 the way a cast does, without undefined behaviour outside
 * the range (NaN -> 0, saturating). */
static inline int64_t cpu_f2i(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

static inline int64_t cpu_ld_i(dtype_t dt, const char *p) {
  switch (dt) {
  case DTYPE_INT8: return *(const int8_t *)p;
  case DTYPE_UINT8: return *(const uint8_t *)p;
  case DTYPE_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
  case DTYPE_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
  case DTYPE_INT64: { int64_t v; memcpy(&v, p, 8); return v; }
  case DTYPE_BOOL: return *(const uint8_t *)p != 0;
  default: return cpu_f2i(cpu_ld_f(dt, p));
  }
}

static inline void cpu_st_f(dtype_t dt, char *p, double v) {
  switch (dt) {
  case DTYPE_FLOAT32: { float f = (float)v; memcpy(p, &f, 4); return; }
  case DTYPE_FLOAT64: memcpy(p, &v, 8); return;
  case DTYPE_FLOAT16: { uint16_t h = float_to_half((float)v); memcpy(p, &h, 2); return; }
  case DTYPE_BFLOAT16: { uint16_t h = float_to_bf16((float)v); memcpy(p, &h, 2); return; }
  case DTYPE_BOOL: *(uint8_t *)p = v != 0; return;
  default: break;
  }
  int64_t i = cpu_f2i(v);
  switch (dt) {
  case DTYPE_INT8: *(int8_t *)p = (int8_t)i; return;
  case DTYPE_UINT8: *(uint8_t *)p = (uint8_t)i; return;
  case DTYPE_INT16: { int16_t x = (int16_t)i; memcpy(p, &x, 2); return; }
  case DTYPE_INT32: { int32_t x = (int32_t)i; memcpy(p, &x, 4); return; }
  case DTYPE_INT64: memcpy(p, &i, 8); return;
  default: return;
  }
}

static inline void cpu_st_i(dtype_t dt, char *p, int64_t i) {
  switch (dt) {
  case DTYPE_INT8: *(int8_t *)p = (int8_t)i; return;
  case DTYPE_UINT8: *(uint8_t *)p = (uint8_t)i; return;
  case DTYPE_INT16: { int16_t x = (int16_t)i; memcpy(p, &x, 2); return; }
  case DTYPE_INT32: { int32_t x = (int32_t)i; memcpy(p, &x, 4); return; }
  case DTYPE_INT64: memcpy(p, &i, 8); return;
  case DTYPE_BOOL: *(uint8_t *)p = i != 0; return;
  case DTYPE_FLOAT64: cpu_st_f(dt, p, (double)i); return;
  /* rounded once, to float: through double, 2^60 + 2^36 + 1 fell on a tie */
  default: cpu_st_f(dt, p, (double)(float)i); return;
  }
}

/* Whether values of dt are computed as int64 (integers, bool) or as double. */
static inline bool cpu_is_int(dtype_t dt) { return !dtype_is_floating(dt); }

/* ---- the strided N-d iterator ---- */

#define CPU_MAX_OPS 6

/* Operands (output first by convention) share one shape; each has its own
 * byte strides (0 where it broadcasts). */
typedef struct cpu_iter {
  int nd, nops;
  int64_t sizes[LAYOUT_MAX_DIMS];
  int64_t strides[CPU_MAX_OPS][LAYOUT_MAX_DIMS];
  char *base[CPU_MAX_OPS];
} cpu_iter_t;

/* One row of n elements; p[k] is operand k's first element, st[k] its stride. */
typedef void (*cpu_row_fn)(void *ctx, char *const *p, const int64_t *st, int64_t n);

void cpu_iter_init(cpu_iter_t *it, const int64_t *sizes, int nd);
/* Adds a tensor broadcast to the iterator's shape (right-aligned; its size-1
 * dims get stride 0). Returns the operand's index. */
int cpu_iter_add(cpu_iter_t *it, const agent_tensor_t *t);
/* Adds raw memory with a layout (strides in elements of esz bytes). */
int cpu_iter_add_raw(cpu_iter_t *it, char *data, const layout_t *l, size_t esz);
/* Adds one value that every element reads (stride 0). */
int cpu_iter_add_scalar(cpu_iter_t *it, char *p);
/* Runs fn over every row, splitting rows among threads when it pays: fn must
 * only write its own output elements. */
void cpu_iter_run(cpu_iter_t *it, cpu_row_fn fn, void *ctx);

/* Calls fn(ctx, begin, end) over [0, n) in chunks of at least `grain`,
 * on several threads when n > grain. */
void cpu_parallel_for(int64_t n, int64_t grain, void (*fn)(void *ctx, int64_t begin, int64_t end),
                      void *ctx);

/* Element pointer of t at its offset. */
static inline char *cpu_data(const agent_tensor_t *t) {
  return (char *)t->storage->data + t->meta.layout.offset * (int64_t)dtype_size(t->meta.dtype);
}

/* Copies src into dst, casting, with src broadcast to dst's shape. */
void cpu_copy_broadcast(agent_tensor_t *dst, const agent_tensor_t *src);
/* A view of t: `l` on t's storage. */
static inline agent_tensor_t cpu_view(const agent_tensor_t *t, const layout_t *l) {
  agent_tensor_t v = {.meta = {.dtype = t->meta.dtype, .layout = *l}, .storage = t->storage};
  return v;
}

/* ---- kernels ---- */

/* One kernel per family of kernel_family.h: cpu_kernel_fill ... cpu_kernel_gather
 * (kernels_*.c). */
KERNEL_FAMILY_DECLARE(cpu_kernel_)

#endif
