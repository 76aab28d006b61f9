/* cuda_nccl_plan: which reductions run as one NCCL call and which move bytes
 * and reduce locally, for every dtype x reduction. The semantics to keep are
 * the data plane's (agent/dataplane/reduce_ops.c), whose dtype rules are the
 * catalogue's (core/tensor/reduction.h). */
#include <criterion/criterion.h>
#include <nccl.h>

#include "cuda/cuda_nccl.h"

static const dtype_t all_dtypes[] = {DTYPE_FLOAT32, DTYPE_FLOAT64, DTYPE_FLOAT16, DTYPE_BFLOAT16,
                                     DTYPE_INT8,    DTYPE_UINT8,   DTYPE_INT16,   DTYPE_INT32,
                                     DTYPE_INT64,   DTYPE_BOOL};
static const reduction_t all_ops[] = {RED_SUM, RED_AVG,  RED_PRODUCT, RED_MIN,
                                      RED_MAX, RED_BAND, RED_BOR,     RED_BXOR};

static int expected_type(dtype_t d) {
  switch (d) {
  case DTYPE_FLOAT32: return ncclFloat32;
  case DTYPE_FLOAT64: return ncclFloat64;
  case DTYPE_FLOAT16: return ncclFloat16;
  case DTYPE_BFLOAT16: return ncclBfloat16;
  case DTYPE_INT8: return ncclInt8;
  case DTYPE_UINT8: return ncclUint8;
  case DTYPE_INT32: return ncclInt32;
  case DTYPE_INT64: return ncclInt64;
  default: return -1;
  }
}

static cuda_plan_kind_t expected_kind(dtype_t d, reduction_t op) {
  bool floating = d == DTYPE_FLOAT32 || d == DTYPE_FLOAT64 || d == DTYPE_FLOAT16 ||
                  d == DTYPE_BFLOAT16;
  bool bitwise = op == RED_BAND || op == RED_BOR || op == RED_BXOR;
  if (bitwise && floating) return CUDA_PLAN_INVALID;
  if (op == RED_AVG && !floating) return CUDA_PLAN_INVALID; /* avg: floating only */
  if (d == DTYPE_INT16 || d == DTYPE_BOOL) return CUDA_PLAN_GATHER; /* no NCCL type */
  if (bitwise) return CUDA_PLAN_GATHER;                              /* no NCCL op */
  if ((op == RED_MIN || op == RED_MAX) && floating) return CUDA_PLAN_GATHER; /* NaN propagates */
  return CUDA_PLAN_NATIVE;
}

static int expected_op(reduction_t op) {
  switch (op) {
  case RED_SUM: return ncclSum;
  case RED_AVG: return ncclAvg;
  case RED_PRODUCT: return ncclProd;
  case RED_MIN: return ncclMin;
  case RED_MAX: return ncclMax;
  default: return -1;
  }
}

Test(cuda_comm_plan, every_dtype_and_reduction) {
  for (size_t i = 0; i < sizeof all_dtypes / sizeof all_dtypes[0]; i++) {
    for (size_t k = 0; k < sizeof all_ops / sizeof all_ops[0]; k++) {
      dtype_t d = all_dtypes[i];
      reduction_t op = all_ops[k];
      cuda_nccl_plan_t p = cuda_nccl_plan(d, op);
      cuda_plan_kind_t want = expected_kind(d, op);
      cr_assert_eq(p.kind, want, "%s %d: kind %d, expected %d", dtype_name(d), (int)op,
                   (int)p.kind, (int)want);
      if (want == CUDA_PLAN_NATIVE) {
        cr_assert_eq(p.nccl_dtype, expected_type(d), "%s %d: NCCL type", dtype_name(d), (int)op);
        cr_assert_eq(p.nccl_op, expected_op(op), "%s %d: NCCL op", dtype_name(d), (int)op);
      } else {
        cr_assert_eq(p.nccl_dtype, -1, "%s %d: no NCCL type off the native path", dtype_name(d),
                     (int)op);
        cr_assert_eq(p.nccl_op, -1, "%s %d: no NCCL op off the native path", dtype_name(d),
                     (int)op);
      }
    }
  }
}

Test(cuda_comm_plan, spot_checks) {
  cuda_nccl_plan_t p = cuda_nccl_plan(DTYPE_FLOAT32, RED_AVG);
  cr_assert_eq(p.kind, CUDA_PLAN_NATIVE);
  cr_assert_eq(p.nccl_op, ncclAvg);
  cr_assert_eq(cuda_nccl_plan(DTYPE_INT32, RED_AVG).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan(DTYPE_INT64, RED_BXOR).kind, CUDA_PLAN_GATHER);
  cr_assert_eq(cuda_nccl_plan(DTYPE_INT16, RED_SUM).kind, CUDA_PLAN_GATHER);
  cr_assert_eq(cuda_nccl_plan(DTYPE_BOOL, RED_MAX).kind, CUDA_PLAN_GATHER);
  cr_assert_eq(cuda_nccl_plan(DTYPE_BFLOAT16, RED_BAND).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan(DTYPE_BOOL, RED_AVG).kind, CUDA_PLAN_INVALID);
}

Test(cuda_comm_plan, rejects_unknown_dtype_and_reduction) {
  cr_assert_eq(cuda_nccl_plan(DTYPE_INVALID, RED_SUM).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan((dtype_t)99, RED_SUM).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan(DTYPE_FLOAT32, (reduction_t)42).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan(DTYPE_FLOAT32, RED_STACK).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan(DTYPE_FLOAT32, RED_INVALID).kind, CUDA_PLAN_INVALID);
}
