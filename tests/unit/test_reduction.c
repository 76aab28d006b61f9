/* The reduction catalogue (core/tensor/reduction.h): names, dtype rules and
 * reduce_infer, the one rule the server's checks and the agents share. */
#include <criterion/criterion.h>
#include <string.h>

#include "reduction.h"

static tensor_meta_t meta(dtype_t dt, int ndim, const int64_t *sizes) {
  tensor_meta_t m = {.dtype = dt};
  m.layout.ndim = ndim;
  for (int i = 0; i < ndim; i++) m.layout.sizes[i] = sizes[i];
  layout_make_contiguous(&m.layout);
  return m;
}

Test(reduction, names_round_trip_and_list_in_table_order) {
  const char *names[] = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor", "stack"};
  cr_assert_eq(RED_COUNT, 9);
  for (int r = 0; r < RED_COUNT; r++) {
    cr_assert_str_eq(reduction_name((reduction_t)r), names[r]);
    cr_assert_eq(reduction_parse(names[r]), (reduction_t)r);
  }
  cr_assert_eq(reduction_parse("gather"), RED_INVALID);
  cr_assert_eq(reduction_parse("SUM"), RED_INVALID);
  cr_assert_eq(reduction_parse(NULL), RED_INVALID);
  cr_assert_str_eq(reduction_name(RED_INVALID), "unknown");
  cr_assert_str_eq(reduction_names(), "sum, avg, product, min, max, band, bor, bxor, stack");
}

Test(reduction, collectives_follow_monarchs_table) {
  cr_assert(reduction_combines(RED_SUM) && reduction_combines(RED_BXOR));
  cr_assert(!reduction_combines(RED_STACK) && !reduction_combines(RED_INVALID));
  cr_assert_str_eq(reduction_collective(RED_AVG, false), "allreduce");
  cr_assert_str_eq(reduction_collective(RED_AVG, true), "reduce_scatter");
  cr_assert_str_eq(reduction_collective(RED_STACK, false), "allgather");
  cr_assert_str_eq(reduction_collective(RED_STACK, true), "alltoall");
}

/* Every (reduction, dtype) pair: the rule is one place, so one matrix. */
Test(reduction, dtype_rules) {
  for (int r = 0; r < RED_COUNT; r++) {
#define XX(name, value, str, size, cat)                                                       \
  {                                                                                           \
    dtype_t d = DTYPE_##name;                                                                 \
    bool floating = dtype_is_floating(d);                                                     \
    bool want = r == RED_AVG ? floating                                                       \
                : (r == RED_BAND || r == RED_BOR || r == RED_BXOR) ? !floating                \
                                                                   : true;                    \
    meshd_error_t e = {0};                                                                    \
    int rc = reduction_check_dtype((reduction_t)r, d, &e);                                    \
    cr_expect_eq(reduction_dtype_ok((reduction_t)r, d), want, "%s on %s", reduction_name(r), \
                 str);                                                                        \
    cr_expect_eq(rc, want ? 0 : -1, "%s on %s", reduction_name(r), str);                      \
    if (!want) {                                                                              \
      cr_expect_eq(e.kind, ERR_DTYPE_MISMATCH);                                               \
      cr_expect(strstr(e.msg, reduction_name(r)) && strstr(e.msg, str), "%s", e.msg);         \
    }                                                                                         \
  }
    DTYPE_MAP(XX)
#undef XX
  }
  meshd_error_t e = {0};
  cr_assert_eq(reduction_check_dtype(RED_INVALID, DTYPE_FLOAT32, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  cr_assert_eq(reduction_check_dtype(RED_SUM, DTYPE_INVALID, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
}

Test(reduction, integer_avg_is_refused_with_the_fix_in_the_message) {
  int64_t s[1] = {4};
  tensor_meta_t in = meta(DTYPE_INT32, 1, s), res;
  reduce_args_t a = {.reduction = RED_AVG, .input = &in, .group = 2, .ndims = 1};
  meshd_error_t e = {0};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_DTYPE_MISMATCH);
  cr_assert_str_eq(e.msg, "Reduce: 'avg' needs a floating dtype, not int32; cast first or use 'sum'");
  in.dtype = DTYPE_BOOL;
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_DTYPE_MISMATCH);
  in.dtype = DTYPE_BFLOAT16;
  cr_assert_eq(reduce_infer(&a, &res, &e), 0, "%s", e.msg);
}

static void expect_shape(const tensor_meta_t *m, int ndim, const int64_t *sizes) {
  cr_assert_eq(m->layout.ndim, ndim);
  for (int i = 0; i < ndim; i++) cr_assert_eq(m->layout.sizes[i], sizes[i], "dim %d", i);
  cr_assert(layout_is_contiguous(&m->layout));
}

Test(reduction, result_shapes_of_the_four_collectives) {
  int64_t s[2] = {4, 3};
  tensor_meta_t in = meta(DTYPE_FLOAT32, 2, s), res;
  meshd_error_t e = {0};
  reduce_args_t a = {.reduction = RED_SUM, .input = &in, .group = 4, .ndims = 2};
  cr_assert_eq(reduce_infer(&a, &res, &e), 0, "%s", e.msg); /* allreduce over two dims */
  expect_shape(&res, 2, (int64_t[]){4, 3});
  cr_assert_eq(res.dtype, DTYPE_FLOAT32);
  a.ndims = 1;
  a.scatter = true; /* reduce_scatter: shape[1:] */
  cr_assert_eq(reduce_infer(&a, &res, &e), 0, "%s", e.msg);
  expect_shape(&res, 1, (int64_t[]){3});
  a.reduction = RED_STACK; /* alltoall: the same shape */
  cr_assert_eq(reduce_infer(&a, &res, &e), 0, "%s", e.msg);
  expect_shape(&res, 2, (int64_t[]){4, 3});
  a.scatter = false; /* allgather: [N, *shape] */
  cr_assert_eq(reduce_infer(&a, &res, &e), 0, "%s", e.msg);
  expect_shape(&res, 3, (int64_t[]){4, 4, 3});
}

/* What a server accepts, its agents run: a group beyond the data plane's
 * REDUCE_GROUP_MAX is refused (agents refused it at run time), and so is a
 * result written into memory its elements share (an expanded view), in place
 * or as `out`, which would keep only the last of several values. */
Test(reduction, groups_over_the_bound_and_overlapping_results_are_refused) {
  int64_t s[1] = {4};
  tensor_meta_t in = meta(DTYPE_FLOAT32, 1, s), res;
  meshd_error_t e = {0};
  reduce_args_t a = {.reduction = RED_SUM, .input = &in, .group = REDUCE_GROUP_MAX, .ndims = 1};
  cr_assert_eq(reduce_infer(&a, &res, &e), 0, "%s", e.msg);
  a.group = REDUCE_GROUP_MAX + 1;
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(e.msg, "the group has 257 ranks"), "%s", e.msg);

  tensor_meta_t expanded = in; /* [4] viewing one element */
  expanded.layout.strides[0] = 0;
  a = (reduce_args_t){.reduction = RED_SUM, .inplace = true, .input = &expanded, .group = 2,
                      .ndims = 1};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(e.msg, "in place into a tensor whose elements share memory"), "%s", e.msg);
  a = (reduce_args_t){.reduction = RED_SUM, .input = &in, .out = &expanded, .group = 2,
                      .ndims = 1};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert(strstr(e.msg, "out is a tensor whose elements share memory"), "%s", e.msg);
  a.input = &expanded; /* reading shared memory is fine */
  a.out = &in;
  cr_assert_eq(reduce_infer(&a, &res, &e), 0, "%s", e.msg);
}

Test(reduction, the_checks_name_what_is_wrong) {
  int64_t s[2] = {4, 3};
  tensor_meta_t in = meta(DTYPE_FLOAT32, 2, s), res;
  meshd_error_t e = {0};
  reduce_args_t a = {.reduction = RED_STACK, .input = &in, .group = 4, .ndims = 2};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_DIM);
  cr_assert(strstr(e.msg, "stack works over exactly one mesh dim, but 2 were given (all dims"),
            "%s", e.msg);

  a = (reduce_args_t){.reduction = RED_SUM, .scatter = true, .input = &in, .group = 2,
                      .ndims = 1, .dim = "gpu"};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_SHAPE_MISMATCH);
  cr_assert(strstr(e.msg, "size(0) must equal the group size 2 (dim 'gpu')"), "%s", e.msg);

  a = (reduce_args_t){.reduction = RED_STACK, .inplace = true, .input = &in, .group = 4, .ndims = 1};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(e.msg, "in-place is only possible"), "%s", e.msg);

  int64_t os[1] = {3};
  tensor_meta_t out = meta(DTYPE_FLOAT32, 1, os);
  a = (reduce_args_t){.reduction = RED_MAX, .input = &in, .out = &out, .group = 4, .ndims = 1};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_SHAPE_MISMATCH);
  out = meta(DTYPE_FLOAT64, 2, s);
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_DTYPE_MISMATCH);
  out.dtype = DTYPE_FLOAT32;
  cr_assert_eq(reduce_infer(&a, &res, &e), 0, "%s", e.msg);

  int64_t deep[LAYOUT_MAX_DIMS];
  for (int i = 0; i < LAYOUT_MAX_DIMS; i++) deep[i] = 1;
  tensor_meta_t big = meta(DTYPE_INT8, LAYOUT_MAX_DIMS, deep);
  a = (reduce_args_t){.reduction = RED_STACK, .input = &big, .group = 2, .ndims = 1};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);

  a = (reduce_args_t){.reduction = RED_INVALID, .input = &in, .group = 2, .ndims = 1};
  cr_assert_eq(reduce_infer(&a, &res, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
}
