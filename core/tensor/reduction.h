/* The reductions of Reduce (Monarch's `_valid_reduce`), in one table that every
 * part compiles in: the server checks a Reduce with it (reduce_infer), the
 * agents' TCP data plane and the cuda kernels implement each row, and the
 * NCCL mapping starts from it. A reduction name appears nowhere else.
 *
 *   reduction_t r = reduction_parse("avg");                    // RED_AVG, or RED_INVALID
 *   if (reduction_check_dtype(r, DTYPE_INT32, &err) != 0) ...  // DTYPE_MISMATCH
 *   reduce_args_t a = {.reduction = r, .input = &meta, .group = 4, .ndims = 1};
 *   tensor_meta_t result;
 *   reduce_infer(&a, &result, &err);                           // shape and dtype of the result
 *
 * Dtype rules (the same on the server and on every backend):
 * - sum, product, min, max: every dtype. Integers wrap (two's complement, as
 *   torch does); bool is logical (sum/max: or, product/min: and); float
 *   min/max propagate NaN; float16/bfloat16 compute in float32.
 * - avg: floating dtypes only, as torch's mean (and meshd's `mean` op): an
 *   integer or bool tensor is refused with DTYPE_MISMATCH ("cast first or use
 *   'sum'"). Monarch passes avg to ncclAvg unchecked; meshd decides it here,
 *   once, so that no agent ever has to define an integer average.
 * - band, bor, bxor: integer and bool dtypes only.
 * - stack: every dtype; it gathers instead of combining.
 *
 * Collectives (Monarch's table): a combining reduction is an allreduce, or a
 * reduce_scatter with scatter (the input's size(0) is the group size, the
 * result drops that dim); stack is an allgather (the result gains a leading
 * dim of the group size), or an alltoall with scatter (same shape). Stack and
 * scatter work over exactly one mesh dim; in place needs a result of the
 * input's shape. */
#ifndef MESHD_REDUCTION_H
#define MESHD_REDUCTION_H

#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"
#include "error_kind.h"
#include "layout.h"
#include "ops.h"

/* Which dtypes a reduction is defined on. */
typedef enum {
  RED_DTYPES_ALL,      /* every dtype */
  RED_DTYPES_FLOATING, /* floating dtypes only */
  RED_DTYPES_INTEGRAL, /* integer dtypes and bool */
} reduction_dtypes_t;

/* XX(NAME, "name", dtype rule, combines): `combines` is true for the
 * element-wise reductions (allreduce / reduce_scatter), false for stack
 * (allgather / alltoall). The order is the wire's and the messages'. */
#define REDUCTION_MAP(XX)                          \
  XX(SUM, "sum", RED_DTYPES_ALL, true)             \
  XX(AVG, "avg", RED_DTYPES_FLOATING, true)        \
  XX(PRODUCT, "product", RED_DTYPES_ALL, true)     \
  XX(MIN, "min", RED_DTYPES_ALL, true)             \
  XX(MAX, "max", RED_DTYPES_ALL, true)             \
  XX(BAND, "band", RED_DTYPES_INTEGRAL, true)      \
  XX(BOR, "bor", RED_DTYPES_INTEGRAL, true)        \
  XX(BXOR, "bxor", RED_DTYPES_INTEGRAL, true)      \
  XX(STACK, "stack", RED_DTYPES_ALL, false)

typedef enum {
#define XX(name, str, dtypes, combines) RED_##name,
  REDUCTION_MAP(XX)
#undef XX
  RED_COUNT,
  RED_INVALID = -1,
} reduction_t;

/* "avg" -> RED_AVG; RED_INVALID for an unknown name or NULL. */
reduction_t reduction_parse(const char *name);
/* "avg"; "unknown" outside the table. */
const char *reduction_name(reduction_t r);
/* "sum, avg, product, min, max, band, bor, bxor, stack": for messages. */
const char *reduction_names(void);
/* Whether r combines elements (every row but stack). False outside the table. */
bool reduction_combines(reduction_t r);
/* The collective r runs: "allreduce", "reduce_scatter", "allgather", "alltoall". */
const char *reduction_collective(reduction_t r, bool scatter);
/* Whether r is defined on dtype (the rules above). */
bool reduction_dtype_ok(reduction_t r, dtype_t dtype);
/* 0 when r is a reduction defined on dtype; otherwise -1 with err:
 * BAD_ARGUMENT for r outside the table or an invalid dtype, DTYPE_MISMATCH
 * (naming both and what to do) when the rule refuses the dtype. */
int reduction_check_dtype(reduction_t r, dtype_t dtype, meshd_error_t *err);

/* Members of one collective group (a Reduce's, a broadcast chain's): what an
 * agent's data plane runs (agent/validate.h takes the same bound). */
#define REDUCE_GROUP_MAX 256

/* A Reduce command as the checks see it. */
typedef struct reduce_args {
  reduction_t reduction;
  bool scatter, inplace;
  const tensor_meta_t *input;
  const tensor_meta_t *out; /* the `out` tensor, or NULL */
  int64_t group;            /* members: the product of the reduced mesh dims' sizes */
  int ndims;                /* how many mesh dims are reduced */
  bool dims_named;          /* false: the dims are "all dims of the mesh" (for messages) */
  const char *dim;          /* the reduced dim's name when ndims == 1 (for messages) */
} reduce_args_t;

/* The result of a Reduce: every rule but those on refs, meshes and streams
 * (dims exist, no duplicates: the caller's). Sets *result (contiguous,
 * input's dtype) and returns 0, or -1 with err: BAD_ARGUMENT (unknown
 * reduction, in place changing the shape, too many dims), BAD_DIM (stack or
 * scatter over several dims), DTYPE_MISMATCH (the dtype rules; out's dtype),
 * SHAPE_MISMATCH (scatter's size(0), out's shape). Messages start "Reduce: ". */
int reduce_infer(const reduce_args_t *a, tensor_meta_t *result, meshd_error_t *err);

#endif
