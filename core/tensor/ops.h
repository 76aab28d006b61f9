/* The op catalogue: one table of the ops a Call (or Factory) may name. Each op
 * has an ATen-style schema, from which its parameters, defaults and flags are
 * read, and a rule that checks bound arguments and infers the results' dtype,
 * layout and aliasing without touching data (Monarch's fake-tensor pass).
 *
 *   const op_def_t *op = ops_find("add");          NULL: unknown op
 *   op_args_t a;  op_infer_t r;  meshd_error_t e;
 *   if (ops_bind(op, args, n, kwargs, nk, &a, &e) || ops_infer(&a, &r, &e)) reject(&e);
 *
 * Schema notation: `Tensor(a) self ... -> Tensor(a)` marks a view of self,
 * `Tensor(a!)` an in-place op; `Tensor|Scalar` takes either; `T?` may be None;
 * parameters after `*` are keyword-only. Every message starts with the op name
 * and names the argument at fault. Thread-safe: the table is built once. */
#ifndef MESHD_OPS_H
#define MESHD_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "error_kind.h"
#include "layout.h"

typedef struct tensor_meta {
  dtype_t dtype;
  layout_t layout;
} tensor_meta_t;

/* Bytes a contiguous tensor of m's dtype and shape holds: numel * element size. */
static inline uint64_t meta_nbytes(const tensor_meta_t *m) {
  return (uint64_t)layout_numel(&m->layout) * dtype_size(m->dtype);
}

/* An argument as the server resolves it from a proto Arg. */
typedef enum {
  VAL_NONE,
  VAL_TENSOR,
  VAL_TENSORS,
  VAL_INT,
  VAL_FLOAT,
  VAL_BOOL,
  VAL_INTS,
  VAL_DTYPE,
  VAL_STRING
} value_kind_t;

/* Only the fields of `kind` are read. Pointers are borrowed: they must outlive
 * every op_args_t bound from this value. */
typedef struct op_value {
  value_kind_t kind;
  int64_t i;                          /* VAL_INT */
  double f;                           /* VAL_FLOAT */
  bool b;                             /* VAL_BOOL */
  dtype_t dtype;                      /* VAL_DTYPE */
  const char *s;                      /* VAL_STRING */
  const int64_t *ints;                /* VAL_INTS */
  size_t nints;
  const tensor_meta_t *tensor;        /* VAL_TENSOR */
  const tensor_meta_t *const *tensors; /* VAL_TENSORS */
  size_t ntensors;
} op_value_t;

typedef struct op_kwarg {
  const char *name;
  op_value_t value;
} op_kwarg_t;

#define OP_MAX_PARAMS 8
#define OP_MAX_RESULTS 4
#define OP_NAME_MAX 32

typedef enum {
  PARAM_TENSOR,           /* Tensor */
  PARAM_TENSORS,          /* Tensor[] */
  PARAM_SCALAR,           /* Scalar: int, float or bool */
  PARAM_TENSOR_OR_SCALAR, /* Tensor|Scalar */
  PARAM_INT,              /* int */
  PARAM_INTS,             /* int[]: a list, or one int standing for a list of one */
  PARAM_FLOAT,            /* float: float or int */
  PARAM_BOOL,             /* bool */
  PARAM_DTYPE,            /* ScalarType: a dtype, or its name as a string */
  PARAM_STRING            /* str */
} param_type_t;

typedef struct op_param {
  char name[OP_NAME_MAX];
  param_type_t type;
  bool optional;   /* `?`: None is accepted */
  bool kwonly;     /* after `*` */
  bool has_default;
  op_value_t def;  /* when has_default; pointers refer into this struct */
  int64_t def_ints[LAYOUT_MAX_DIMS];
  char def_str[OP_NAME_MAX];
} op_param_t;

typedef struct op_args op_args_t;
typedef struct op_infer op_infer_t;
typedef int (*op_rule_fn)(const op_args_t *a, op_infer_t *out, meshd_error_t *e);

/* One catalogue entry; read-only, obtained from ops_find / ops_at. */
typedef struct op_def {
  /* from the table */
  const char *schema;
  op_rule_fn rule;
  int variant; /* selects the behaviour of a rule shared by several ops */
  /* read from the schema when the table is built */
  int id;
  char name[OP_NAME_MAX];
  bool is_factory; /* no tensor parameter: makes a tensor from nothing */
  bool is_view;    /* the result may alias self (-> Tensor(a)) */
  bool is_inplace; /* writes self and returns it (-> Tensor(a!)) */
  int nparams;
  op_param_t params[OP_MAX_PARAMS];
} op_def_t;

/* NULL for a name not in the table (the caller reports UNKNOWN_OP). */
const op_def_t *ops_find(const char *name);
size_t ops_count(void);
/* NULL past the end. */
const op_def_t *ops_at(size_t id);
const char *op_name(const op_def_t *op);
const char *op_schema(const op_def_t *op);
int op_id(const op_def_t *op);

/* Arguments bound to the schema in parameter order, defaults filled in. Values
 * keep the kind they arrived with (a single int for an int[] stays VAL_INT; read
 * lists with op_value_ints), except that None for an optional parameter is
 * VAL_NONE, a dtype name becomes VAL_DTYPE, and DTYPE_INVALID (the wire's
 * DTYPE_UNSPECIFIED) given for an optional dtype becomes VAL_NONE. */
struct op_args {
  const op_def_t *op;
  int nparams;
  op_value_t v[OP_MAX_PARAMS];
};

/* Binds positional args then keywords, checking each value's kind against its
 * parameter. BAD_ARGUMENT for a missing, unknown, repeated or ill-typed argument,
 * too many positional ones, or a tensor whose layout is out of bounds. */
int ops_bind(const op_def_t *op, const op_value_t *args, size_t nargs, const op_kwarg_t *kwargs,
             size_t nkwargs, op_args_t *out, meshd_error_t *e);

typedef struct op_result {
  tensor_meta_t meta;
  int alias_param; /* -1: fresh storage; else the parameter whose storage it views */
} op_result_t;

struct op_infer {
  int nresults;
  op_result_t results[OP_MAX_RESULTS];
  int nmutates;
  int mutates[OP_MAX_RESULTS]; /* parameters written in place */
};

/* Runs the op's rule on bound arguments. Fresh results are contiguous with
 * offset 0; views carry torch's exact strides and offset. Every result passes
 * layout_check_shape. */
int ops_infer(const op_args_t *a, op_infer_t *out, meshd_error_t *e);

/* The list an int[] value stands for (VAL_INTS, or a VAL_INT as a list of one);
 * the pointer is into *v. False for other kinds. */
bool op_value_ints(const op_value_t *v, const int64_t **ints, size_t *n);
/* Index of the parameter called name, or -1. */
int op_param_index(const op_def_t *op, const char *name);

/* torch.result_type over tensors and Python scalars: dims > 0 tensors outrank
 * 0-dim tensors, which outrank scalars, but a lower rank of a higher category
 * (bool < int < float) still raises the result (int tensor + 2.5 -> float32).
 * Scalars count as int64 / float32 (the default dtype) / bool. Values of other
 * kinds and VAL_NONE are skipped. DTYPE_INVALID if nothing counted. */
dtype_t ops_result_type(const op_value_t *const *vals, size_t n);

/* A non-tensor argument as it travels (meshd.v1.Arg) as an op_value_t: 0 done;
 * -1 an unknown dtype; 1 the argument is a tensor, a tensor list or empty, for
 * the caller to resolve against its own tensors. (Declared with the protobuf-c
 * type's tag so this header needs no generated include.) */
struct Meshd__V1__Arg;
int op_value_from_arg(const struct Meshd__V1__Arg *a, op_value_t *v);
/* A Factory as it travels, bound to its catalogue op (kind "zeros" binds
 * zeros(size, dtype=...), "arange" its start/end/step, "rank" its dim):
 * 0, or -1 with e (BAD_ARGUMENT: a kind that is no factory, an unknown
 * dtype, or ops_bind's refusal, prefixed "Factory "). *out borrows f's
 * shape and dim, so f must outlive it; ops_infer gives the result. */
struct Meshd__V1__Factory;
int ops_bind_factory(const struct Meshd__V1__Factory *f, op_args_t *out, meshd_error_t *e);

#endif
