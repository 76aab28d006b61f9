/* The typed element-wise reductions the data plane applies to received chunks
 * (reduce_ops.c); the semantics every backend's collectives reproduce. */
#ifndef MESHD_AGENT_DATAPLANE_REDUCE_OPS_H
#define MESHD_AGENT_DATAPLANE_REDUCE_OPS_H

#include <stddef.h>

#include "dataplane.h"

/* 0 when `op` combines elements and is defined on `dtype` (the rules of
 * reduction.h: reduction_check_dtype, DTYPE_MISMATCH naming both); -1 with
 * BAD_ARGUMENT for stack or an unknown op. */
int dp_reduce_check(reduction_t op, dtype_t dtype, meshd_error_t *err);

/* dst[i] = dst[i] OP src[i] for `count` elements. RED_AVG accumulates a sum
 * (see dp_reduce_finish). Integers wrap (two's complement, as torch does); bool
 * is logical (sum/max/bor: or; product/min/band: and; bxor: xor);
 * float16/bfloat16 are computed in float32 and rounded to nearest even; float
 * min/max propagate NaN. `op` must have passed dp_reduce_check. */
void dp_reduce_apply(reduction_t op, dtype_t dtype, void *dst, const void *src, size_t count);

/* After a reduction over `members` contributions: RED_AVG divides buf by
 * `members` (floating dtypes); every other op is a no-op. */
void dp_reduce_finish(reduction_t op, dtype_t dtype, void *buf, size_t count, size_t members);

#endif
