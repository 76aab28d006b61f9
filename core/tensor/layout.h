/* Shapes and strides, with torch's rules for contiguity, broadcasting and dim
 * wrapping. Every function that can fail takes `ctx`, the start of its error
 * message ("sum: argument 'dim'"; may be NULL), sets *e and returns -1. */
#ifndef MESHD_LAYOUT_H
#define MESHD_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error_kind.h"

#define LAYOUT_MAX_DIMS 16
/* No tensor may hold more than this many bytes (or elements). */
#define LAYOUT_MAX_BYTES ((int64_t)1 << 62)
/* Enough for layout_format_shape of any valid shape. */
#define LAYOUT_SHAPE_BUF 400

/* A tensor's view of its storage; strides and offset count elements. */
typedef struct layout {
  int ndim;
  int64_t offset;
  int64_t sizes[LAYOUT_MAX_DIMS];
  int64_t strides[LAYOUT_MAX_DIMS];
} layout_t;

/* Limits a process puts on every tensor, below the hard bounds above: the
 * server's checks and the agents' read the same ones. Each daemon sets them
 * once at startup, before serving, from --max-tensor-dims and
 * --max-tensor-elements; until then only the hard bounds hold. */
typedef struct layout_limits {
  int max_dims;         /* 1..LAYOUT_MAX_DIMS */
  int64_t max_elements; /* 1..LAYOUT_MAX_BYTES: elements of one (local) tensor */
} layout_limits_t;

/* Values out of range are clamped into it; NULL restores the hard bounds. */
void layout_set_limits(const layout_limits_t *l);
layout_limits_t layout_get_limits(void);
/* On the calling thread only, checks against the hard bounds alone (true) or
 * the limits again (false): whether a shape fails only because of this
 * process's limits (agent/validate.c). */
void layout_limits_off(bool off);

/* A shape a tensor may have: 0 <= ndim <= LAYOUT_MAX_DIMS, every size >= 0,
 * and the product of the sizes, a size 0 counted as 1, times elem_size is at
 * most 2^62 (computed without overflow): numel * elem_size and every stride in
 * bytes fit, also for an empty tensor; BAD_ARGUMENT otherwise. Then the limits:
 * more dims or elements than they allow is QUOTA, naming the limit and its flag. */
int layout_check_shape(const char *ctx, const int64_t *sizes, int64_t ndim, size_t elem_size,
                       meshd_error_t *e);
/* *out = row-major layout of `sizes`, offset 0, after layout_check_shape. */
int layout_contiguous(layout_t *out, const int64_t *sizes, int64_t ndim, size_t elem_size,
                      const char *ctx, meshd_error_t *e);
/* Rewrites l's strides to row-major for its sizes and its offset to 0 (no checks). */
void layout_make_contiguous(layout_t *l);
/* Product of the sizes (1 for ndim 0). The layout must have passed the checks. */
int64_t layout_numel(const layout_t *l);
/* torch's is_contiguous(): size-1 dims may have any stride; empty tensors are
 * contiguous. The offset does not matter. */
bool layout_is_contiguous(const layout_t *l);
/* Some element is reachable through two indices (a stride 0 on a dim of size > 1,
 * as expand makes): torch refuses to write such a tensor in place. */
bool layout_has_internal_overlap(const layout_t *l);
bool layout_same_shape(const layout_t *a, const layout_t *b);
/* torch broadcasting of shapes a and b (named a_name, b_name in the message) into
 * out (LAYOUT_MAX_DIMS entries) and *nout. SHAPE_MISMATCH when a dim has two
 * sizes neither of which is 1. */
int layout_broadcast(const char *ctx, const char *a_name, const int64_t *a, int na,
                     const char *b_name, const int64_t *b, int nb, int64_t *out, int *nout,
                     meshd_error_t *e);
/* Maps dim in [-ndim, ndim) to [0, ndim). With wrap_scalar a 0-dim tensor takes
 * dims -1 and 0, as torch allows for reductions. BAD_DIM otherwise. */
int layout_wrap_dim(const char *ctx, int64_t dim, int ndim, bool wrap_scalar, int64_t *out,
                    meshd_error_t *e);
/* "[2, 3]" ("[]" for ndim 0) into buf; returns buf. Truncates to n. */
const char *layout_format_shape(const int64_t *sizes, int ndim, char *buf, size_t n);

#endif
