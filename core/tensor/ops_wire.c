/* Arguments as they travel (meshd.v1.Arg, meshd.v1.Factory) -> op_value_t,
 * shared by the server (checks) and the agents (execution). */
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

int ops_bind_factory(const Meshd__V1__Factory *f, op_args_t *out, meshd_error_t *e) {
  const char *kind = f->kind ? f->kind : "";
  const op_def_t *op = ops_find(kind);
  if (!op || !op->is_factory)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Factory: unknown kind '%.40s'; expected one of empty, zeros, ones, full, "
                     "arange, rand, randn, rank", kind);
  op_kwarg_t kw[2];
  op_value_t pos[3];
  size_t nkw = 0, npos = 0;
  if (f->dtype != MESHD__V1__DTYPE__DTYPE_UNSPECIFIED) {
    if (!dtype_valid((dtype_t)f->dtype))
      return error_set(e, ERR_BAD_ARGUMENT, "Factory %s: unknown dtype %d", op->name, (int)f->dtype);
    kw[nkw++] = (op_kwarg_t){"dtype", {.kind = VAL_DTYPE, .dtype = (dtype_t)f->dtype}};
  }
  if (!strcmp(kind, "rank")) {
    pos[npos++] = (op_value_t){.kind = VAL_STRING, .s = f->dim ? f->dim : ""};
  } else if (!strcmp(kind, "arange")) {
    pos[npos++] = (op_value_t){.kind = VAL_FLOAT, .f = f->start};
    pos[npos++] = (op_value_t){.kind = VAL_FLOAT, .f = f->end};
    pos[npos++] = (op_value_t){.kind = VAL_FLOAT, .f = f->step};
  } else {
    pos[npos++] = (op_value_t){.kind = VAL_INTS, .ints = f->shape, .nints = f->n_shape};
    if (!strcmp(kind, "full")) pos[npos++] = (op_value_t){.kind = VAL_FLOAT, .f = f->value};
    if (f->has_seed && (!strcmp(kind, "rand") || !strcmp(kind, "randn")))
      kw[nkw++] = (op_kwarg_t){"seed", {.kind = VAL_INT, .i = (int64_t)f->seed}};
  }
  if (ops_bind(op, pos, npos, kw, nkw, out, e)) {
    error_prefix(e, "Factory", " ");
    return -1;
  }
  return 0;
}
