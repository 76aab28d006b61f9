/* cuda_nccl_plan: which reductions run as one NCCL call and which move bytes
 * and reduce locally, for every dtype x reduction. The semantics to keep are
 * the cpu data plane's (agent/cpu/reduce_ops.c). */
#include <criterion/criterion.h>
#include <nccl.h>

#include "cuda/cuda_nccl.h"

static const dtype_t all_dtypes[] = {DTYPE_FLOAT32, DTYPE_FLOAT64, DTYPE_FLOAT16, DTYPE_BFLOAT16,
                                     DTYPE_INT8,    DTYPE_UINT8,   DTYPE_INT16,   DTYPE_INT32,
                                     DTYPE_INT64,   DTYPE_BOOL};
static const dp_reduce_t all_ops[] = {DP_SUM, DP_AVG,  DP_PRODUCT, DP_MIN,
                                      DP_MAX, DP_BAND, DP_BOR,     DP_BXOR};

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

static cuda_plan_kind_t expected_kind(dtype_t d, dp_reduce_t op) {
  bool floating = d == DTYPE_FLOAT32 || d == DTYPE_FLOAT64 || d == DTYPE_FLOAT16 ||
                  d == DTYPE_BFLOAT16;
  bool bitwise = op == DP_BAND || op == DP_BOR || op == DP_BXOR;
  if (bitwise && floating) return CUDA_PLAN_INVALID;
  if (op == DP_AVG && d == DTYPE_BOOL) return CUDA_PLAN_INVALID;
  if (d == DTYPE_INT16 || d == DTYPE_BOOL) return CUDA_PLAN_GATHER; /* no NCCL type */
  if (bitwise) return CUDA_PLAN_GATHER;                              /* no NCCL op */
  if (op == DP_AVG && !floating) return CUDA_PLAN_GATHER;            /* ints truncate */
  if ((op == DP_MIN || op == DP_MAX) && floating) return CUDA_PLAN_GATHER; /* NaN propagates */
  return CUDA_PLAN_NATIVE;
}

static int expected_op(dp_reduce_t op) {
  switch (op) {
  case DP_SUM: return ncclSum;
  case DP_AVG: return ncclAvg;
  case DP_PRODUCT: return ncclProd;
  case DP_MIN: return ncclMin;
  case DP_MAX: return ncclMax;
  default: return -1;
  }
}

Test(cuda_comm_plan, every_dtype_and_reduction) {
  for (size_t i = 0; i < sizeof all_dtypes / sizeof all_dtypes[0]; i++) {
    for (size_t k = 0; k < sizeof all_ops / sizeof all_ops[0]; k++) {
      dtype_t d = all_dtypes[i];
      dp_reduce_t op = all_ops[k];
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
  cuda_nccl_plan_t p = cuda_nccl_plan(DTYPE_FLOAT32, DP_AVG);
  cr_assert_eq(p.kind, CUDA_PLAN_NATIVE);
  cr_assert_eq(p.nccl_op, ncclAvg);
  cr_assert_eq(cuda_nccl_plan(DTYPE_INT32, DP_AVG).kind, CUDA_PLAN_GATHER);
  cr_assert_eq(cuda_nccl_plan(DTYPE_INT64, DP_BXOR).kind, CUDA_PLAN_GATHER);
  cr_assert_eq(cuda_nccl_plan(DTYPE_INT16, DP_SUM).kind, CUDA_PLAN_GATHER);
  cr_assert_eq(cuda_nccl_plan(DTYPE_BOOL, DP_MAX).kind, CUDA_PLAN_GATHER);
  cr_assert_eq(cuda_nccl_plan(DTYPE_BFLOAT16, DP_BAND).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan(DTYPE_BOOL, DP_AVG).kind, CUDA_PLAN_INVALID);
}

Test(cuda_comm_plan, rejects_unknown_dtype_and_reduction) {
  cr_assert_eq(cuda_nccl_plan(DTYPE_INVALID, DP_SUM).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan((dtype_t)99, DP_SUM).kind, CUDA_PLAN_INVALID);
  cr_assert_eq(cuda_nccl_plan(DTYPE_FLOAT32, (dp_reduce_t)42).kind, CUDA_PLAN_INVALID);
}
