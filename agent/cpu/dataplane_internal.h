/* Private to agent/cpu/dataplane.c and agent/cpu/reduce_ops.c: the typed
 * element-wise reductions the data plane applies to received chunks. */
#ifndef MESHD_AGENT_CPU_DATAPLANE_INTERNAL_H
#define MESHD_AGENT_CPU_DATAPLANE_INTERNAL_H

#include <stddef.h>

#include "dataplane.h"

/* 0 when `op` is defined on `dtype`; otherwise -1 with BAD_ARGUMENT naming both:
 * bitwise ops (band bor bxor) only on integer and bool dtypes, avg not on bool. */
int dp_reduce_check(dp_reduce_t op, dtype_t dtype, meshd_error_t *err);

/* dst[i] = dst[i] OP src[i] for `count` elements. DP_AVG accumulates a sum (see
 * dp_reduce_finish). Integers wrap (two's complement, as torch does);
 * float16/bfloat16 are computed in float32 and rounded to nearest even; float
 * min/max propagate NaN. `op` must have passed dp_reduce_check. */
void dp_reduce_apply(dp_reduce_t op, dtype_t dtype, void *dst, const void *src, size_t count);

/* After a reduction over `members` contributions: DP_AVG divides buf by
 * `members` (integers truncate toward zero); every other op is a no-op. */
void dp_reduce_finish(dp_reduce_t op, dtype_t dtype, void *buf, size_t count, size_t members);

#endif
