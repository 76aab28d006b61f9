/* Shared by ops*.c: the rules the table points at, their variants, and helpers
 * for reading bound arguments and producing results. Internal to the ops module
 * (included only by core/tensor/ops*.c): its functions carry the ops__ prefix. */
#ifndef MESHD_OPS_INTERNAL_H
#define MESHD_OPS_INTERNAL_H

#include <stdint.h>

#include "ops.h"

/* ops__rule_binary */
enum { BIN_ADD, BIN_SUB, BIN_MUL, BIN_DIV, BIN_POW, BIN_MAXMIN, BIN_COMPARE, BIN_LOGICAL, BIN_BITWISE };
/* ops__rule_unary */
enum { UN_NEG, UN_ABS, UN_TO_FLOAT, UN_RELU, UN_FLOAT_ONLY, UN_SIGN, UN_LOGICAL_NOT };
/* ops__rule_reduce */
enum { RED_SUM, RED_MEAN, RED_PROD, RED_MAXMIN, RED_AMAXMIN, RED_ARG };
/* ops__rule_rand */
enum { RAND_UNIFORM, RAND_NORMAL };
/* ops__rule_to */
enum { TO_TO, TO_CAST };

#define RULE(name) int name(const op_args_t *a, op_infer_t *out, meshd_error_t *e)
/* ops_factory.c */
RULE(ops__rule_filled);
RULE(ops__rule_full);
RULE(ops__rule_arange);
RULE(ops__rule_rand);
RULE(ops__rule_rank);
RULE(ops__rule_fill_);
RULE(ops__rule_zero_);
/* ops_elementwise.c */
RULE(ops__rule_binary);
RULE(ops__rule_unary);
RULE(ops__rule_where);
RULE(ops__rule_clamp);
RULE(ops__rule_copy_);
/* ops_reduce.c */
RULE(ops__rule_reduce);
RULE(ops__rule_softmax);
RULE(ops__rule_matmul);
RULE(ops__rule_mm);
RULE(ops__rule_bmm);
/* ops_views.c */
RULE(ops__rule_view);
RULE(ops__rule_reshape);
RULE(ops__rule_transpose);
RULE(ops__rule_t);
RULE(ops__rule_permute);
RULE(ops__rule_select);
RULE(ops__rule_narrow);
RULE(ops__rule_slice);
RULE(ops__rule_unsqueeze);
RULE(ops__rule_squeeze);
RULE(ops__rule_expand);
RULE(ops__rule_contiguous);
/* ops_tensor.c */
RULE(ops__rule_clone);
RULE(ops__rule_to);
RULE(ops__rule_cat);
RULE(ops__rule_stack);
RULE(ops__rule_index_select);
RULE(ops__rule_gather);
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
const char *ops__shape_str(const tensor_meta_t *t, char *buf);
/* "op: argument 'name'" into buf, the ctx for layout_* calls. */
const char *ops__arg_ctx(const op_args_t *a, int i, char *buf, size_t n);
int ops__wrap_dim_arg(const op_args_t *a, int param, int64_t dim, int ndim, bool wrap_scalar,
                      int64_t *out, meshd_error_t *e);
/* Wraps a dim list into a bit mask; a dim named twice is BAD_DIM. */
int ops__dims_to_mask(const op_args_t *a, int param, const int64_t *dims, size_t n, int ndim,
                      bool wrap_scalar, uint32_t *mask, meshd_error_t *e);
/* BAD_ARGUMENT unless the Scalar at param converts to dt without overflow (c10's
 * checked_convert: ints into unsigned may wrap once, floats keep inf/nan). */
int ops__scalar_fits_arg(const op_args_t *a, int param, dtype_t dt, meshd_error_t *e);

/* Producing results. */
int ops__push_fresh(const op_args_t *a, op_infer_t *out, dtype_t dt, const int64_t *sizes,
                    int ndim, meshd_error_t *e);
void ops__push_view(op_infer_t *out, dtype_t dt, const layout_t *l, int alias_param);
/* The op writes parameter `param` in place and returns it. */
void ops__push_inplace(op_infer_t *out, const op_args_t *a, int param);
/* BAD_ARGUMENT when parameter `param` has elements sharing memory (expanded). */
int ops__check_no_overlap(const op_args_t *a, int param, meshd_error_t *e);
/* For an in-place op: the computed dtype must cast to self's and the broadcast
 * shape must be self's. */
int ops__check_inplace(const op_args_t *a, int param, dtype_t result, const int64_t *shape,
                       int ndim, meshd_error_t *e);

#endif
