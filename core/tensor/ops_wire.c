/* Arguments as they travel (meshd.v1.Arg) -> op_value_t, shared by the server
 * (checks) and the agents (execution). */
#include <string.h>

#include "meshd/v1/tensor_service.pb-c.h"
#include "ops.h"

int op_value_from_arg(const Meshd__V1__Arg *a, op_value_t *v) {
  memset(v, 0, sizeof *v);
  switch (a->value_case) {
    case MESHD__V1__ARG__VALUE_F: v->kind = VAL_FLOAT; v->f = a->f; return 0;
    case MESHD__V1__ARG__VALUE_I: v->kind = VAL_INT; v->i = a->i; return 0;
    case MESHD__V1__ARG__VALUE_B: v->kind = VAL_BOOL; v->b = a->b; return 0;
    case MESHD__V1__ARG__VALUE_INTS:
      v->kind = VAL_INTS;
      v->ints = a->ints->values;
      v->nints = a->ints->n_values;
      return 0;
    case MESHD__V1__ARG__VALUE_DTYPE:
      if (!dtype_valid((dtype_t)a->dtype)) return -1;
      v->kind = VAL_DTYPE;
      v->dtype = (dtype_t)a->dtype;
      return 0;
    case MESHD__V1__ARG__VALUE_S: v->kind = VAL_STRING; v->s = a->s; return 0;
    case MESHD__V1__ARG__VALUE_NONE: v->kind = VAL_NONE; return 0;
    default: return 1; /* a tensor (ref / refs) or no value: the caller's part */
  }
}
