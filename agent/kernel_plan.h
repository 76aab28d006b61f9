/* The host side of kernels that is the same on every backend, written once
 * (kernel_plan.c) and compiled once:
 * - the copy family, cat and stack: narrow views of the result and one
 *   broadcasting copy per entry, through the backend's copy (kernel_copy_fn),
 *   so a backend's kernel of those families is one line:
 *
 *     int cpu_kernel_cat(const kernel_call_t *c, meshd_error_t *e) {
 *       return kernel_cat(c, copy, e);
 *     }
 *
 * - what a binary elementwise op computes, from its arguments;
 * - how a reduction splits its input's dims into kept and reduced ones;
 * - the error messages both backends must word alike.
 * The cuda .cu files include it too: plain C types, C linkage. */
#ifndef MESHD_AGENT_KERNEL_PLAN_H
#define MESHD_AGENT_KERNEL_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "kernel_family.h"

/* dst = src cast to dst's dtype, broadcast to dst's shape (right-aligned), any
 * strides on both, in c's stream order. 0, or -1 with e. */
typedef int (*kernel_copy_fn)(const kernel_call_t *c, agent_tensor_t *dst,
                              const agent_tensor_t *src, meshd_error_t *e);

/* The kernels of families COPY (clone contiguous to cast copy_, and reshape
 * when it cannot view: self's elements in row-major order), CAT and STACK
 * (each entry cast to the result's dtype into its narrow of the result). They
 * return what `copy` returns: the first failure stops them. */
int kernel_copy(const kernel_call_t *c, kernel_copy_fn copy, meshd_error_t *e);
int kernel_cat(const kernel_call_t *c, kernel_copy_fn copy, meshd_error_t *e);
int kernel_stack(const kernel_call_t *c, kernel_copy_fn copy, meshd_error_t *e);

/* `l` with dim d fixed at i (one fewer dim); d < 0: l itself (0-dim tensors). */
layout_t kernel_select_dim(const layout_t *l, int64_t d, int64_t i);

/* index_select / gather found index `idx` outside [0, size) on dim `dim`:
 * REMOTE_FAILURE naming the op and rank. Returns -1. */
int kernel_index_error(const kernel_call_t *c, int64_t idx, int64_t dim, int64_t size,
                       meshd_error_t *e);

/* ---- binary elementwise ops (family BINARY) ---- */

/* What a binary op computes: the per-element math is elementwise_ops.h's. */
typedef struct kernel_binary {
  int op;          /* B_* (elementwise_ops.h); div's rounding_mode picks the B_DIV_* */
  bool is_int;     /* computed as int64: integral and bool result types, except true
                      division and the logical ops; the bitwise ops always */
  double alpha_f;  /* add/sub's alpha (1 without), as double and as int64 */
  int64_t alpha_i;
  dtype_t rt;      /* the result type of self and other (ops_result_type) */
  dtype_t cast[2];  /* what each operand is cast to before the op, as torch casts
                       it to the common dtype (DTYPE_INVALID: nothing): in double,
                       rounded to float32/float16/bfloat16 (ew_round_to, ew_round_i;
                       a Python scalar against a float16/bfloat16 result is left
                       as it is); in int64, wrapped into a narrower integer result
                       type (ew_wrap_i: uint8 < 300 compares with 44, as torch) */
} kernel_binary_t;

kernel_binary_t kernel_binary_plan(const kernel_call_t *c);

/* ---- reductions (family REDUCE, and SOFTMAX's dim) ---- */

/* In this order: sums and products come before the extremes, the arg* last. */
typedef enum {
  REDUCE_SUM,
  REDUCE_MEAN,
  REDUCE_PROD,
  REDUCE_MAX, /* max amax */
  REDUCE_MIN, /* min amin */
  REDUCE_ARGMAX,
  REDUCE_ARGMIN,
} kernel_reduce_op_t;

/* The op a reduction's name computes; -1 for a name of no reduction. */
int kernel_reduce_op(const char *name);

/* The reduced dims of c's argument 1 'dim' as a mask over l's dims (None or []
 * reduce all; a 0-dim tensor reduces over nothing). */
uint32_t kernel_reduce_mask(const kernel_call_t *c, const layout_t *l);

/* A tensor's dims split into kept (k*) and reduced (r*) ones, each with its
 * size and byte strides into the input and into the output. */
typedef struct kernel_reduce_plan {
  int nk, nr;
  int64_t ksize[LAYOUT_MAX_DIMS], kin[LAYOUT_MAX_DIMS], kout[LAYOUT_MAX_DIMS];
  int64_t rsize[LAYOUT_MAX_DIMS], rin[LAYOUT_MAX_DIMS], rout[LAYOUT_MAX_DIMS];
  int64_t rcount; /* reduced elements per output: the product of rsize */
} kernel_reduce_plan_t;

/* Splits in's dims by mask (bit d: dim d is reduced). `out` has the kept dims,
 * plus the reduced ones as size 1 (keepdim) or in full (softmax) when
 * out_has_reduced; its elements are out_esz bytes. */
void kernel_reduce_plan(kernel_reduce_plan_t *r, const agent_tensor_t *in, uint32_t mask,
                        const layout_t *out, int64_t out_esz, bool out_has_reduced);

#ifdef __cplusplus
}
#endif

#endif
