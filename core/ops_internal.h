/* Shared by ops*.c: the rules the table points at, their variants, and helpers
 * for reading bound arguments and producing results. */
#ifndef MESHD_OPS_INTERNAL_H
#define MESHD_OPS_INTERNAL_H

#include <stdint.h>

#include "ops.h"

/* rule_binary */
enum { BIN_ADD, BIN_SUB, BIN_MUL, BIN_DIV, BIN_POW, BIN_MAXMIN, BIN_COMPARE, BIN_LOGICAL, BIN_BITWISE };
/* rule_unary */
enum { UN_NEG, UN_ABS, UN_TO_FLOAT, UN_RELU, UN_FLOAT_ONLY, UN_SIGN, UN_LOGICAL_NOT };
/* rule_reduce */
enum { RED_SUM, RED_MEAN, RED_PROD, RED_MAXMIN, RED_AMAXMIN, RED_ARG };
/* rule_rand */
enum { RAND_UNIFORM, RAND_NORMAL };
/* rule_to */
enum { TO_TO, TO_CAST };

#define RULE(name) int name(const op_args_t *a, op_infer_t *out, meshd_error_t *e)
/* ops_factory.c */
RULE(rule_filled);
RULE(rule_full);
RULE(rule_arange);
RULE(rule_rand);
RULE(rule_rank);
RULE(rule_fill_);
RULE(rule_zero_);
/* ops_elementwise.c */
RULE(rule_binary);
RULE(rule_unary);
RULE(rule_where);
RULE(rule_clamp);
RULE(rule_copy_);
/* ops_reduce.c */
RULE(rule_reduce);
RULE(rule_softmax);
RULE(rule_matmul);
RULE(rule_mm);
RULE(rule_bmm);
/* ops_views.c */
RULE(rule_view);
RULE(rule_reshape);
RULE(rule_transpose);
RULE(rule_t);
RULE(rule_permute);
RULE(rule_select);
RULE(rule_narrow);
RULE(rule_slice);
RULE(rule_unsqueeze);
RULE(rule_squeeze);
RULE(rule_expand);
RULE(rule_contiguous);
/* ops_tensor.c */
RULE(rule_clone);
RULE(rule_to);
RULE(rule_cat);
RULE(rule_stack);
RULE(rule_index_select);
RULE(rule_gather);
#undef RULE

/* Reading bound arguments (the binder guarantees the kinds). */
#define OPN(a) ((a)->op->name)
#define PN(a, i) ((a)->op->params[(i)].name)
static inline bool arg_none(const op_args_t *a, int i) { return a->v[i].kind == VAL_NONE; }
static inline const tensor_meta_t *arg_tensor(const op_args_t *a, int i) {
  return a->v[i].kind == VAL_TENSOR ? a->v[i].tensor : NULL;
}
static inline int64_t arg_int(const op_args_t *a, int i) { return a->v[i].i; }
static inline bool arg_bool(const op_args_t *a, int i) { return a->v[i].b; }
static inline dtype_t arg_dtype(const op_args_t *a, int i) {
  return a->v[i].kind == VAL_DTYPE ? a->v[i].dtype : DTYPE_INVALID;
}
static inline const char *arg_str(const op_args_t *a, int i) {
  return a->v[i].kind == VAL_STRING ? a->v[i].s : NULL;
}

/* "[2, 3]" of a tensor into buf (LAYOUT_SHAPE_BUF bytes). */
const char *shape_str(const tensor_meta_t *t, char *buf);
/* "op: argument 'name'" into buf, the ctx for layout_* calls. */
const char *arg_ctx(const op_args_t *a, int i, char *buf, size_t n);
int wrap_dim_arg(const op_args_t *a, int param, int64_t dim, int ndim, bool wrap_scalar,
                 int64_t *out, meshd_error_t *e);
/* Wraps a dim list into a bit mask; a dim named twice is BAD_DIM. */
int dims_to_mask(const op_args_t *a, int param, const int64_t *dims, size_t n, int ndim,
                 bool wrap_scalar, uint32_t *mask, meshd_error_t *e);
/* BAD_ARGUMENT unless the Scalar at param converts to dt without overflow (c10's
 * checked_convert: ints into unsigned may wrap once, floats keep inf/nan). */
int scalar_fits_arg(const op_args_t *a, int param, dtype_t dt, meshd_error_t *e);

/* Producing results. */
int push_fresh(const op_args_t *a, op_infer_t *out, dtype_t dt, const int64_t *sizes, int ndim,
               meshd_error_t *e);
void push_view(op_infer_t *out, dtype_t dt, const layout_t *l, int alias_param);
/* The op writes parameter `param` in place and returns it. */
void push_inplace(op_infer_t *out, const op_args_t *a, int param);
/* BAD_ARGUMENT when parameter `param` has elements sharing memory (expanded). */
int check_no_overlap(const op_args_t *a, int param, meshd_error_t *e);
/* For an in-place op: the computed dtype must cast to self's and the broadcast
 * shape must be self's. */
int check_inplace(const op_args_t *a, int param, dtype_t result, const int64_t *shape, int ndim,
                  meshd_error_t *e);

#endif
