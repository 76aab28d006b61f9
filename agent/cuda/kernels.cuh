/* The device side of the cuda backend's kernels (C++, .cu files only):
 * per-dtype loads and stores computed exactly as the cpu backend computes them
 * (agent/cpu/cpu_internal.h: floating values as double, integral ones as
 * int64, the same bit-level half/bfloat16 rounding), so both backends give the
 * same bits; the strided N-d iterator; and cuda_launch, which runs a
 * per-element functor on the GPU (grid-stride loop) or, emulated, in a host
 * loop (cuda_internal.h).
 *
 *   struct Neg { cu_iter_t it; __host__ __device__ void operator()(int64_t i) const {
 *       char *p[CU_MAX_OPS]; it.at(i, p);
 *       cu_st_f(it.dt[0], p[0], -cu_ld_f(it.dt[1], p[1])); } };
 *   cu_iter_t it; cu_iter_init(&it, out->meta.layout.sizes, out->meta.layout.ndim);
 *   cu_iter_add(&it, out); cu_iter_add(&it, in);
 *   return cuda_launch(c->b, c->bs, cu_iter_numel(&it), Neg{it}, "neg", e); */
#ifndef MESHD_CUDA_KERNELS_CUH
#define MESHD_CUDA_KERNELS_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

/* backend.h uses C11 _Atomic on fields no kernel touches (storage refcounts,
 * byte counters); C++ reads the same layout without it (same size and
 * alignment on every target we build for). */
#define _Atomic
#include "cuda_internal.h"
#undef _Atomic
#include "half.h"

#define CU_HD __host__ __device__ __forceinline__
#define CU_MAX_OPS 6

/* ---- loads and stores: floating values as double, integral ones as int64 ---- */

CU_HD bool cu_is_int(dtype_t dt) {
  return !(dt == DTYPE_FLOAT32 || dt == DTYPE_FLOAT64 || dt == DTYPE_FLOAT16 ||
           dt == DTYPE_BFLOAT16);
}

CU_HD int cu_size(dtype_t dt) {
  switch (dt) {
    case DTYPE_FLOAT64: case DTYPE_INT64: return 8;
    case DTYPE_FLOAT32: case DTYPE_INT32: return 4;
    case DTYPE_FLOAT16: case DTYPE_BFLOAT16: case DTYPE_INT16: return 2;
    default: return 1;
  }
}

/* Elements are naturally aligned (allocations are, offsets count elements). */
CU_HD double cu_ld_f(dtype_t dt, const char *p) {
  switch (dt) {
    case DTYPE_FLOAT32: return *(const float *)p;
    case DTYPE_FLOAT64: return *(const double *)p;
    case DTYPE_FLOAT16: return half_to_float(*(const uint16_t *)p);
    case DTYPE_BFLOAT16: return bf16_to_float(*(const uint16_t *)p);
    case DTYPE_INT8: return *(const int8_t *)p;
    case DTYPE_UINT8: return *(const uint8_t *)p;
    case DTYPE_INT16: return *(const int16_t *)p;
    case DTYPE_INT32: return *(const int32_t *)p;
    case DTYPE_INT64: return (double)*(const int64_t *)p;
    case DTYPE_BOOL: return *(const uint8_t *)p != 0;
    default: return 0;
  }
}

/* double -> int64 as a cast does, without UB outside the range (NaN -> 0, saturating). */
CU_HD int64_t cu_f2i(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

CU_HD int64_t cu_ld_i(dtype_t dt, const char *p) {
  switch (dt) {
    case DTYPE_INT8: return *(const int8_t *)p;
    case DTYPE_UINT8: return *(const uint8_t *)p;
    case DTYPE_INT16: return *(const int16_t *)p;
    case DTYPE_INT32: return *(const int32_t *)p;
    case DTYPE_INT64: return *(const int64_t *)p;
    case DTYPE_BOOL: return *(const uint8_t *)p != 0;
    default: return cu_f2i(cu_ld_f(dt, p));
  }
}

CU_HD void cu_st_f(dtype_t dt, char *p, double v) {
  switch (dt) {
    case DTYPE_FLOAT32: *(float *)p = (float)v; return;
    case DTYPE_FLOAT64: *(double *)p = v; return;
    case DTYPE_FLOAT16: *(uint16_t *)p = float_to_half((float)v); return;
    case DTYPE_BFLOAT16: *(uint16_t *)p = float_to_bf16((float)v); return;
    case DTYPE_BOOL: *(uint8_t *)p = v != 0; return;
    default: break;
  }
  int64_t i = cu_f2i(v);
  switch (dt) {
    case DTYPE_INT8: *(int8_t *)p = (int8_t)i; return;
    case DTYPE_UINT8: *(uint8_t *)p = (uint8_t)i; return;
    case DTYPE_INT16: *(int16_t *)p = (int16_t)i; return;
    case DTYPE_INT32: *(int32_t *)p = (int32_t)i; return;
    case DTYPE_INT64: *(int64_t *)p = i; return;
    default: return;
  }
}

CU_HD void cu_st_i(dtype_t dt, char *p, int64_t i) {
  switch (dt) {
    case DTYPE_INT8: *(int8_t *)p = (int8_t)i; return;
    case DTYPE_UINT8: *(uint8_t *)p = (uint8_t)i; return;
    case DTYPE_INT16: *(int16_t *)p = (int16_t)i; return;
    case DTYPE_INT32: *(int32_t *)p = (int32_t)i; return;
    case DTYPE_INT64: *(int64_t *)p = i; return;
    case DTYPE_BOOL: *(uint8_t *)p = i != 0; return;
    case DTYPE_FLOAT64: cu_st_f(dt, p, (double)i); return;
    default: cu_st_f(dt, p, (double)(float)i); return; /* rounded once, as the cpu's */
  }
}

/* ---- the strided N-d iterator (passed to kernels by value, ~1 KiB) ---- */

/* Operands (output first by convention) share one shape; each has its own byte
 * strides (0 where it broadcasts) and dtype. */
struct cu_iter_t {
  int nd, nops;
  int64_t sizes[LAYOUT_MAX_DIMS];
  int64_t strides[CU_MAX_OPS][LAYOUT_MAX_DIMS];
  char *base[CU_MAX_OPS];
  dtype_t dt[CU_MAX_OPS];

  /* p[k] = operand k's element at linear (row-major) index i. */
  CU_HD void at(int64_t i, char **p) const {
    for (int k = 0; k < nops; k++) p[k] = base[k];
    for (int d = nd - 1; d >= 0; d--) { /* the outermost dim needs no division */
      int64_t n = sizes[d], c = d == 0 ? i : n > 1 ? i % n : 0;
      i = d == 0 || n <= 1 ? i : i / n;
      for (int k = 0; k < nops; k++) p[k] += c * strides[k][d];
    }
  }
};

/* Host side: building an iterator. */
static inline void cu_iter_init(cu_iter_t *it, const int64_t *sizes, int nd) {
  memset(it, 0, sizeof *it);
  it->nd = nd;
  for (int d = 0; d < nd; d++) it->sizes[d] = sizes[d];
}

/* Adds raw memory with a layout (strides in elements), right-aligned broadcast
 * to the iterator's shape. Returns the operand's index. */
static inline int cu_iter_add_raw(cu_iter_t *it, char *data, dtype_t dt, const layout_t *l) {
  int k = it->nops++;
  it->base[k] = data;
  it->dt[k] = dt;
  int shift = it->nd - l->ndim, esz = cu_size(dt);
  for (int d = 0; d < it->nd; d++) {
    int sd = d - shift;
    it->strides[k][d] = sd < 0 || l->sizes[sd] == 1 ? 0 : l->strides[sd] * (int64_t)esz;
  }
  return k;
}

static inline char *cu_data(const agent_tensor_t *t) {
  return (char *)t->storage->data + t->meta.layout.offset * (int64_t)cu_size(t->meta.dtype);
}

static inline int cu_iter_add(cu_iter_t *it, const agent_tensor_t *t) {
  return cu_iter_add_raw(it, cu_data(t), t->meta.dtype, &t->meta.layout);
}

/* Adds one value every element reads (stride 0): p is device memory (host
 * memory when emulated), or NULL for a scalar the functor carries by value. */
static inline int cu_iter_add_scalar(cu_iter_t *it, char *p, dtype_t dt) {
  int k = it->nops++;
  it->base[k] = p;
  it->dt[k] = dt;
  return k;
}

static inline int64_t cu_iter_numel(const cu_iter_t *it) {
  int64_t n = 1;
  for (int d = 0; d < it->nd; d++) n *= it->sizes[d];
  return n;
}

/* Merges adjacent dims that every operand walks as one (fewer divisions per
 * element). Call after adding every operand. */
static inline void cu_iter_coalesce(cu_iter_t *it) {
  if (it->nd <= 1) return;
  int out = 0;
  for (int d = 1; d < it->nd; d++) {
    bool merge = true;
    for (int k = 0; k < it->nops && merge; k++)
      merge = it->strides[k][out] == it->strides[k][d] * it->sizes[d] || it->sizes[d] == 1 ||
              it->sizes[out] == 1;
    if (merge && it->sizes[out] != 1 && it->sizes[d] != 1) {
      for (int k = 0; k < it->nops; k++) it->strides[k][out] = it->strides[k][d];
      it->sizes[out] *= it->sizes[d];
    } else if (merge && it->sizes[d] == 1) {
      /* a size-1 dim adds nothing */
    } else if (merge && it->sizes[out] == 1) {
      for (int k = 0; k < it->nops; k++) it->strides[k][out] = it->strides[k][d];
      it->sizes[out] = it->sizes[d];
    } else {
      out++;
      it->sizes[out] = it->sizes[d];
      for (int k = 0; k < it->nops; k++) it->strides[k][out] = it->strides[k][d];
    }
  }
  it->nd = out + 1;
}

/* Device -> host of a few bytes (an error flag, an index), in bs's order,
 * waiting for them: the kernel's result is known before it returns. */
static inline int cuda_readback(const kernel_call_t *c, void *host, const void *dev, size_t n,
                                meshd_error_t *e) {
  if (cuda_emulated(c)) {
    memcpy(host, dev, n);
    return 0;
  }
  cuda_state_t *st = cuda_state(c->b);
  if (cuda_check(st, cudaMemcpyAsync(host, dev, n, cudaMemcpyDeviceToHost, c->bs->s),
                 kernel_opname(c), e))
    return -1;
  return cuda_check(st, cudaStreamSynchronize(c->bs->s), kernel_opname(c), e);
}

/* ---- launching ---- */

template <class F>
__global__ void cu_grid_loop(int64_t n, F f) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    f(i);
}

#define CU_BLOCK 256
#define CU_MAX_BLOCKS 65536

/* Runs f(i) for i in [0, n) in bs's order (emulated: now, on this thread).
 * 0, or -1 with e naming `what` when the launch fails. */
template <class F>
static inline int cuda_launch(backend_t *b, backend_stream_t *bs, int64_t n, const F &f,
                              const char *what, meshd_error_t *e) {
  if (n <= 0) return 0;
  cuda_state_t *st = cuda_state(b);
  if (st->emulated) {
    for (int64_t i = 0; i < n; i++) f(i);
    return 0;
  }
  int64_t blocks = (n + CU_BLOCK - 1) / CU_BLOCK;
  if (blocks > CU_MAX_BLOCKS) blocks = CU_MAX_BLOCKS;
  cu_grid_loop<F><<<(unsigned)blocks, CU_BLOCK, 0, bs->s>>>(n, f);
  return cuda_check(st, cudaGetLastError(), what, e);
}

#endif
