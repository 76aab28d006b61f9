/* The op catalogue: binding, and every rule's shapes, dtypes, strides, aliasing
 * and errors, with torch's answers as the expected values. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ops.h"

/* ---- building inputs ---- */

static tensor_meta_t make(dtype_t dt, const int64_t *sizes, int n) {
  tensor_meta_t t = {.dtype = dt};
  meshd_error_t e;
  cr_assert_eq(layout_contiguous(&t.layout, sizes, n, dtype_size(dt), "test", &e), 0, "%s", e.msg);
  return t;
}
#define NI(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t))
#define T(dt, ...) make(dt, (int64_t[]){__VA_ARGS__}, (int)NI(__VA_ARGS__))
#define T0(dt) make(dt, NULL, 0)

static tensor_meta_t strided(dtype_t dt, int n, const int64_t *sizes, const int64_t *strides,
                             int64_t offset) {
  tensor_meta_t t = {.dtype = dt, .layout = {.ndim = n, .offset = offset}};
  for (int i = 0; i < n; i++) t.layout.sizes[i] = sizes[i], t.layout.strides[i] = strides[i];
  return t;
}

static op_value_t vt(const tensor_meta_t *t) { return (op_value_t){.kind = VAL_TENSOR, .tensor = t}; }
static op_value_t vi(int64_t i) { return (op_value_t){.kind = VAL_INT, .i = i}; }
static op_value_t vf(double f) { return (op_value_t){.kind = VAL_FLOAT, .f = f}; }
static op_value_t vb(bool b) { return (op_value_t){.kind = VAL_BOOL, .b = b}; }
static op_value_t vd(dtype_t d) { return (op_value_t){.kind = VAL_DTYPE, .dtype = d}; }
static op_value_t vs(const char *s) { return (op_value_t){.kind = VAL_STRING, .s = s}; }
static op_value_t vnone(void) { return (op_value_t){.kind = VAL_NONE}; }
#define VI(...) \
  ((op_value_t){.kind = VAL_INTS, .ints = (const int64_t[]){__VA_ARGS__}, .nints = NI(__VA_ARGS__)})
#define VI0 ((op_value_t){.kind = VAL_INTS, .ints = NULL, .nints = 0})
#define VTS(...)                                                          \
  ((op_value_t){.kind = VAL_TENSORS,                                      \
                .tensors = (const tensor_meta_t *const[]){__VA_ARGS__}, \
                .ntensors = sizeof((const tensor_meta_t *[]){__VA_ARGS__}) / sizeof(void *)})

/* ---- running ops ---- */

typedef struct {
  int rc;
  op_args_t a;
  op_infer_t r;
  meshd_error_t e;
} res_t;

static res_t run(const char *name, const op_value_t *args, size_t n, const op_kwarg_t *kw,
                 size_t nk) {
  res_t r;
  memset(&r, 0, sizeof r);
  const op_def_t *op = ops_find(name);
  cr_assert_not_null(op, "no op %s", name);
  r.rc = ops_bind(op, args, n, kw, nk, &r.a, &r.e);
  if (r.rc == 0) r.rc = ops_infer(&r.a, &r.r, &r.e);
  return r;
}
#define A(...) (op_value_t[]){__VA_ARGS__}, sizeof((op_value_t[]){__VA_ARGS__}) / sizeof(op_value_t)
#define K(...) (op_kwarg_t[]){__VA_ARGS__}, sizeof((op_kwarg_t[]){__VA_ARGS__}) / sizeof(op_kwarg_t)
#define NOKW NULL, 0
#define RUN(name, ...) run(name, A(__VA_ARGS__), NOKW)

/* ---- checking results ---- */

#define OK(r) cr_assert_eq((r).rc, 0, "unexpected error: %s", (r).e.msg)

/* The call failed with `kind`, and the message starts with "op: " and names `arg`. */
static void expect_err(const res_t *r, error_kind_t kind, const char *op, const char *arg, int line) {
  cr_assert_eq(r->rc, -1, "line %d: %s should fail", line, op);
  cr_assert_eq(r->e.kind, kind, "line %d: kind %s, want %s: %s", line, error_kind_name(r->e.kind),
               error_kind_name(kind), r->e.msg);
  size_t n = strlen(op);
  cr_assert(strncmp(r->e.msg, op, n) == 0 && r->e.msg[n] == ':' && r->e.msg[n + 1] == ' ',
            "line %d: message does not start with \"%s: \": %s", line, op, r->e.msg);
  if (arg) cr_assert(strstr(r->e.msg, arg), "line %d: message lacks %s: %s", line, arg, r->e.msg);
}
#define ERR(r, kind, op, arg) expect_err(&(r), ERR_##kind, op, arg, __LINE__)
#define HAS(r, s) cr_assert(strstr((r).e.msg, s), "message lacks \"%s\": %s", s, (r).e.msg)

static void expect_shape(const op_result_t *res, dtype_t dt, const int64_t *sizes, int n, int line) {
  cr_assert_eq(res->meta.dtype, dt, "line %d: dtype %s, want %s", line, dtype_name(res->meta.dtype),
               dtype_name(dt));
  cr_assert_eq(res->meta.layout.ndim, n, "line %d: ndim %d, want %d", line, res->meta.layout.ndim, n);
  for (int i = 0; i < n; i++)
    cr_assert_eq(res->meta.layout.sizes[i], sizes[i], "line %d: size[%d] = %lld, want %lld", line, i,
                 (long long)res->meta.layout.sizes[i], (long long)sizes[i]);
}
static void expect_strides(const op_result_t *res, int64_t offset, const int64_t *strides, int n,
                           int line) {
  cr_assert_eq(res->meta.layout.offset, offset, "line %d: offset %lld, want %lld", line,
               (long long)res->meta.layout.offset, (long long)offset);
  cr_assert_eq(res->meta.layout.ndim, n, "line %d", line);
  for (int i = 0; i < n; i++)
    cr_assert_eq(res->meta.layout.strides[i], strides[i], "line %d: stride[%d] = %lld, want %lld",
                 line, i, (long long)res->meta.layout.strides[i], (long long)strides[i]);
}
/* One fresh row-major result, nothing mutated. */
static void expect_fresh(const res_t *r, int line) {
  cr_assert_eq(r->rc, 0, "line %d: %s", line, r->e.msg);
  cr_assert_eq(r->r.nresults, 1, "line %d", line);
  cr_assert_eq(r->r.nmutates, 0, "line %d", line);
  const op_result_t *res = &r->r.results[0];
  cr_assert_eq(res->alias_param, -1, "line %d: alias_param %d", line, res->alias_param);
  int64_t stride = 1;
  cr_assert_eq(res->meta.layout.offset, 0, "line %d", line);
  for (int i = res->meta.layout.ndim - 1; i >= 0; i--) {
    cr_assert_eq(res->meta.layout.strides[i], stride, "line %d: stride[%d]", line, i);
    stride *= res->meta.layout.sizes[i] > 1 ? res->meta.layout.sizes[i] : 1;
  }
}
/* One result viewing parameter 0, nothing mutated. */
static void expect_view(const res_t *r, int line) {
  cr_assert_eq(r->rc, 0, "line %d: %s", line, r->e.msg);
  cr_assert_eq(r->r.nresults, 1, "line %d", line);
  cr_assert_eq(r->r.nmutates, 0, "line %d", line);
  cr_assert_eq(r->r.results[0].alias_param, 0, "line %d: alias_param %d", line,
               r->r.results[0].alias_param);
}
static bool meta_eq(const tensor_meta_t *a, const tensor_meta_t *b) {
  if (a->dtype != b->dtype || a->layout.ndim != b->layout.ndim || a->layout.offset != b->layout.offset)
    return false;
  for (int i = 0; i < a->layout.ndim; i++)
    if (a->layout.sizes[i] != b->layout.sizes[i] || a->layout.strides[i] != b->layout.strides[i])
      return false;
  return true;
}
/* In place on self: the result is self's exact meta and param 0 is mutated. */
static void expect_inplace(const res_t *r, const tensor_meta_t *self, int line) {
  cr_assert_eq(r->rc, 0, "line %d: %s", line, r->e.msg);
  cr_assert_eq(r->r.nresults, 1, "line %d", line);
  cr_assert_eq(r->r.results[0].alias_param, 0, "line %d", line);
  cr_assert_eq(r->r.nmutates, 1, "line %d", line);
  cr_assert_eq(r->r.mutates[0], 0, "line %d", line);
  cr_assert(meta_eq(&r->r.results[0].meta, self), "line %d: meta differs", line);
}
#define SHAPE(r, i, dt, ...) expect_shape(&(r).r.results[i], dt, (int64_t[]){__VA_ARGS__}, (int)NI(__VA_ARGS__), __LINE__)
#define SHAPE0(r, i, dt) expect_shape(&(r).r.results[i], dt, NULL, 0, __LINE__)
#define STRIDES(r, offset, ...) expect_strides(&(r).r.results[0], offset, (int64_t[]){__VA_ARGS__}, (int)NI(__VA_ARGS__), __LINE__)
#define FRESH(r) expect_fresh(&(r), __LINE__)
#define VIEW(r) expect_view(&(r), __LINE__)
#define INPLACE(r, self) expect_inplace(&(r), self, __LINE__)

/* ================= the catalogue ================= */

static const char *const required[] = {
    "empty", "zeros", "ones", "full", "arange", "rand", "randn", "rank", "add", "sub", "mul",
    "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "bitwise_and", "bitwise_or", "bitwise_xor", "neg", "abs", "exp", "log", "sqrt",
    "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu", "reciprocal", "sign",
    "logical_not", "sum", "mean", "prod", "max", "min", "amax", "amin", "argmax", "argmin",
    "softmax", "log_softmax", "matmul", "mm", "bmm", "view", "reshape", "transpose", "t",
    "permute", "select", "narrow", "slice", "unsqueeze", "squeeze", "expand", "clone",
    "contiguous", "cat", "stack", "to", "cast", "index_select", "gather", "where", "clamp",
    "add_", "sub_", "mul_", "div_", "copy_", "fill_", "zero_", "clamp_"};
#define NREQUIRED (sizeof required / sizeof required[0])

Test(catalogue, holds_every_required_op_once) {
  cr_assert_eq(ops_count(), NREQUIRED, "the catalogue has %zu ops; update the test's list",
               ops_count());
  for (size_t i = 0; i < NREQUIRED; i++) {
    const op_def_t *op = ops_find(required[i]);
    cr_assert_not_null(op, "missing op %s", required[i]);
    cr_assert_str_eq(op_name(op), required[i]);
    cr_assert_eq(ops_at((size_t)op_id(op)), op);
    size_t n = strlen(required[i]);
    cr_assert(strncmp(op_schema(op), required[i], n) == 0 && op_schema(op)[n] == '(', "%s",
              op_schema(op));
  }
  for (size_t i = 0; i < ops_count(); i++) {
    cr_assert_eq(op_id(ops_at(i)), (int)i);
    cr_assert_eq(ops_find(op_name(ops_at(i))), ops_at(i), "duplicate name %s", op_name(ops_at(i)));
  }
  cr_assert_null(ops_at(ops_count()));
  cr_assert_null(ops_find("nope"));
  cr_assert_null(ops_find("Add"));
  cr_assert_null(ops_find(""));
  cr_assert_null(ops_find(NULL));
}

Test(catalogue, flags_come_from_the_schema) {
  const char *factories[] = {"empty", "zeros", "ones", "full", "arange", "rand", "randn", "rank"};
  const char *views[] = {"view",   "reshape",   "transpose", "t",      "permute",    "select",
                         "narrow", "slice",     "unsqueeze", "squeeze", "expand",    "contiguous",
                         "to"};
  for (size_t i = 0; i < ops_count(); i++) {
    const op_def_t *op = ops_at(i);
    bool factory = false, view = false;
    for (size_t k = 0; k < sizeof factories / sizeof *factories; k++)
      factory |= strcmp(op->name, factories[k]) == 0;
    for (size_t k = 0; k < sizeof views / sizeof *views; k++) view |= strcmp(op->name, views[k]) == 0;
    bool inplace = op->name[strlen(op->name) - 1] == '_';
    cr_assert_eq(op->is_factory, factory, "%s", op->name);
    cr_assert_eq(op->is_view, view, "%s", op->name);
    cr_assert_eq(op->is_inplace, inplace, "%s", op->name);
    cr_assert(op->nparams >= 1 && op->nparams <= OP_MAX_PARAMS, "%s", op->name);
  }
}

Test(catalogue, parameters_and_defaults) {
  const op_def_t *add = ops_find("add");
  cr_assert_str_eq(op_schema(add), "add(Tensor self, Tensor|Scalar other, *, Scalar alpha=1) -> Tensor");
  cr_assert_eq(add->nparams, 3);
  cr_assert_str_eq(add->params[0].name, "self");
  cr_assert_eq(add->params[0].type, PARAM_TENSOR);
  cr_assert_str_eq(add->params[1].name, "other");
  cr_assert_eq(add->params[1].type, PARAM_TENSOR_OR_SCALAR);
  cr_assert_not(add->params[1].kwonly);
  cr_assert_str_eq(add->params[2].name, "alpha");
  cr_assert(add->params[2].kwonly);
  cr_assert(add->params[2].has_default);
  cr_assert_eq(add->params[2].def.kind, VAL_INT);
  cr_assert_eq(add->params[2].def.i, 1);
  cr_assert_eq(op_param_index(add, "alpha"), 2);
  cr_assert_eq(op_param_index(add, "beta"), -1);

  const op_def_t *sum = ops_find("sum");
  cr_assert_eq(sum->params[1].type, PARAM_INTS);
  cr_assert(sum->params[1].optional);
  cr_assert_eq(sum->params[1].def.kind, VAL_NONE);
  cr_assert_eq(sum->params[2].def.kind, VAL_BOOL);
  cr_assert_not(sum->params[2].def.b);
  cr_assert_eq(sum->params[3].type, PARAM_DTYPE);

  const op_def_t *amax = ops_find("amax");
  cr_assert_eq(amax->params[1].def.kind, VAL_INTS);
  cr_assert_eq(amax->params[1].def.nints, 0);
  const op_def_t *gelu = ops_find("gelu");
  cr_assert_eq(gelu->params[1].def.kind, VAL_STRING);
  cr_assert_str_eq(gelu->params[1].def.s, "none");
  const op_def_t *cat = ops_find("cat");
  cr_assert_eq(cat->params[0].type, PARAM_TENSORS);
  const op_def_t *view = ops_find("view");
  cr_assert_str_eq(view->params[0].name, "self"); /* the "(a)" annotation is not part of the type */
  cr_assert_eq(view->params[0].type, PARAM_TENSOR);
  const op_def_t *clamp = ops_find("clamp");
  cr_assert_eq(clamp->params[1].type, PARAM_TENSOR_OR_SCALAR);
  cr_assert(clamp->params[1].optional);
}

/* Every op called with nothing names its first parameter as missing. */
Test(catalogue, every_op_reports_its_first_missing_argument) {
  for (size_t i = 0; i < ops_count(); i++) {
    const op_def_t *op = ops_at(i);
    op_args_t a;
    meshd_error_t e = {0};
    cr_assert_eq(ops_bind(op, NULL, 0, NULL, 0, &a, &e), -1, "%s", op->name);
    cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
    char want[128];
    snprintf(want, sizeof want, "%s: missing argument '%s' (expected ", op->name,
             op->params[0].name);
    cr_assert(strncmp(e.msg, want, strlen(want)) == 0, "%s", e.msg);
  }
}

/* ================= binding ================= */

Test(bind, positional_keywords_and_defaults) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3), y = T(DTYPE_FLOAT32, 3);
  res_t r = RUN("add", vt(&x), vi(1));
  OK(r);
  cr_assert_eq(r.a.nparams, 3);
  cr_assert_eq(r.a.v[1].kind, VAL_INT);
  cr_assert_eq(r.a.v[2].kind, VAL_INT); /* alpha filled from its default */
  cr_assert_eq(r.a.v[2].i, 1);
  r = run("add", NULL, 0, K({"other", vt(&y)}, {"self", vt(&x)}, {"alpha", vf(0.5)}));
  OK(r);
  cr_assert_eq(r.a.v[0].tensor, &x);
  cr_assert_eq(r.a.v[1].tensor, &y);
  cr_assert_eq(r.a.v[2].kind, VAL_FLOAT);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  /* one int stands for a one-element int[] */
  r = RUN("sum", vt(&x), vi(1));
  OK(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2);
  const int64_t *ints;
  size_t n;
  cr_assert(op_value_ints(&r.a.v[1], &ints, &n));
  cr_assert_eq(n, 1);
  cr_assert_eq(ints[0], 1);
  cr_assert_not(op_value_ints(&r.a.v[0], &ints, &n));
}

Test(bind, missing_argument) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2);
  res_t r = RUN("add", vt(&x));
  ERR(r, BAD_ARGUMENT, "add", "'other'");
  cr_assert_str_eq(r.e.msg, "add: missing argument 'other' (expected Tensor or Scalar)");
}

Test(bind, unknown_keyword_suggests_from_a_fixed_list) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2);
  res_t r = run("sum", A(vt(&x)), K({"axis", vi(0)}));
  ERR(r, BAD_ARGUMENT, "sum", "'axis'");
  cr_assert_str_eq(r.e.msg, "sum: unknown keyword argument 'axis'; did you mean 'dim'?");
  r = run("sum", A(vt(&x)), K({"keepdims", vb(true)}));
  cr_assert_str_eq(r.e.msg, "sum: unknown keyword argument 'keepdims'; did you mean 'keepdim'?");
  r = run("pow", A(vt(&x)), K({"other", vi(2)}));
  cr_assert_str_eq(r.e.msg, "pow: unknown keyword argument 'other'; did you mean 'exponent'?");
  /* no suggestion when the op has no such parameter: the parameters are listed */
  r = run("add", A(vt(&x), vi(1)), K({"axis", vi(0)}));
  ERR(r, BAD_ARGUMENT, "add", "'axis'");
  cr_assert_null(strstr(r.e.msg, "did you mean"));
  HAS(r, "add takes self, other, alpha");
  r = run("sum", A(vt(&x)), K({"foo", vi(0)}));
  HAS(r, "unknown keyword argument 'foo' (sum takes self, dim, keepdim, dtype)");
  r = run("sum", A(vt(&x)), K({NULL, vi(0)}));
  ERR(r, BAD_ARGUMENT, "sum", "unknown keyword argument ''");
}

Test(bind, duplicate_and_too_many) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2);
  res_t r = run("add", A(vt(&x), vi(1)), K({"other", vi(2)}));
  ERR(r, BAD_ARGUMENT, "add", "'other'");
  cr_assert_str_eq(r.e.msg, "add: got multiple values for argument 'other'");
  r = run("add", A(vt(&x)), K({"alpha", vi(2)}, {"alpha", vi(3)}));
  ERR(r, BAD_ARGUMENT, "add", "multiple values for argument 'alpha'");
  r = RUN("add", vt(&x), vi(1), vi(2)); /* alpha is keyword-only */
  ERR(r, BAD_ARGUMENT, "add", "takes 2 positional arguments but 3 were given");
  HAS(r, "keyword-only");
  r = RUN("neg", vt(&x), vt(&x));
  ERR(r, BAD_ARGUMENT, "neg", "takes 1 positional argument but 2 were given");
}

Test(bind, type_checks) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3);
  res_t r = RUN("add", vt(&x), VI(1, 2));
  ERR(r, BAD_ARGUMENT, "add", "'other'");
  cr_assert_str_eq(r.e.msg, "add: argument 'other' must be a Tensor or Scalar, got int list");
  r = RUN("add", vt(&x), vnone());
  cr_assert_str_eq(r.e.msg, "add: argument 'other' must be a Tensor or Scalar, got None");
  r = RUN("add", vi(1), vt(&x));
  cr_assert_str_eq(r.e.msg, "add: argument 'self' must be a Tensor, got int");
  r = run("add", A(vt(&x), vi(1)), K({"alpha", vt(&x)}));
  ERR(r, BAD_ARGUMENT, "add", "argument 'alpha' must be a Scalar, got Tensor");
  r = RUN("select", vt(&x), vb(true), vi(0)); /* bool is not an int */
  ERR(r, BAD_ARGUMENT, "select", "argument 'dim' must be an int, got bool");
  r = RUN("select", vt(&x), vf(1.0), vi(0));
  ERR(r, BAD_ARGUMENT, "select", "argument 'dim' must be an int, got float");
  r = RUN("sum", vt(&x), vf(1.0));
  ERR(r, BAD_ARGUMENT, "sum", "argument 'dim' must be an int or int list or None, got float");
  r = RUN("sum", vt(&x), vi(0), vi(1));
  ERR(r, BAD_ARGUMENT, "sum", "argument 'keepdim' must be a bool, got int");
  r = RUN("cat", vt(&x));
  ERR(r, BAD_ARGUMENT, "cat", "argument 'tensors' must be a list of Tensors, got Tensor");
  r = RUN("rank", vi(0));
  ERR(r, BAD_ARGUMENT, "rank", "argument 'dim' must be a str, got int");
  r = RUN("zeros", vs("2"));
  ERR(r, BAD_ARGUMENT, "zeros", "argument 'size' must be an int or int list, got str");
  r = run("gelu", A(vt(&x)), K({"approximate", vnone()}));
  ERR(r, BAD_ARGUMENT, "gelu", "argument 'approximate' must be a str, got None");
  /* Scalars accept int, float and bool */
  OK(RUN("mul", vt(&x), vi(2)));
  OK(RUN("mul", vt(&x), vf(2.5)));
  OK(RUN("mul", vt(&x), vb(true)));
  /* None is fine where the schema says `?` */
  OK(run("sum", A(vt(&x)), K({"dim", vnone()}, {"dtype", vnone()})));
}

Test(bind, dtype_values) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2);
  res_t r = run("zeros", A(VI(2)), K({"dtype", vs("float64")}));
  OK(r);
  cr_assert_eq(r.a.v[1].kind, VAL_DTYPE);
  SHAPE(r, 0, DTYPE_FLOAT64, 2);
  r = run("zeros", A(VI(2)), K({"dtype", vs("long")}));
  SHAPE(r, 0, DTYPE_INT64, 2);
  r = run("zeros", A(VI(2)), K({"dtype", vs("floaty")}));
  ERR(r, BAD_ARGUMENT, "zeros", "'dtype'");
  HAS(r, "unknown dtype 'floaty'");
  r = run("zeros", A(VI(2)), K({"dtype", vd((dtype_t)42)}));
  ERR(r, BAD_ARGUMENT, "zeros", "argument 'dtype' is dtype value 42");
  /* DTYPE_UNSPECIFIED for an optional dtype means "not given" */
  r = run("zeros", A(VI(2)), K({"dtype", vd(DTYPE_INVALID)}));
  OK(r);
  cr_assert_eq(r.a.v[1].kind, VAL_NONE);
  SHAPE(r, 0, DTYPE_FLOAT32, 2);
  r = RUN("to", vt(&x), vd(DTYPE_INVALID));
  ERR(r, BAD_ARGUMENT, "to", "'dtype'");
  r = RUN("to", vt(&x), vi(3));
  ERR(r, BAD_ARGUMENT, "to", "argument 'dtype' must be a dtype, got int");
}

Test(bind, malformed_tensors_are_rejected) {
  tensor_meta_t bad_dtype = T(DTYPE_FLOAT32, 2);
  bad_dtype.dtype = (dtype_t)77;
  res_t r = RUN("neg", vt(&bad_dtype));
  ERR(r, BAD_ARGUMENT, "neg", "argument 'self'");
  HAS(r, "invalid dtype 77");
  tensor_meta_t too_deep = T(DTYPE_FLOAT32, 2);
  too_deep.layout.ndim = 17;
  r = RUN("neg", vt(&too_deep));
  ERR(r, BAD_ARGUMENT, "neg", "argument 'self'");
  HAS(r, "at most 16");
  tensor_meta_t negative = T(DTYPE_FLOAT32, 2);
  negative.layout.sizes[0] = -3;
  r = RUN("neg", vt(&negative));
  ERR(r, BAD_ARGUMENT, "neg", "negative size -3");
  r = RUN("neg", ((op_value_t){.kind = VAL_TENSOR, .tensor = NULL}));
  ERR(r, BAD_ARGUMENT, "neg", "argument 'self'");
  tensor_meta_t ok = T(DTYPE_FLOAT32, 2);
  r = RUN("cat", VTS(&ok, NULL));
  ERR(r, BAD_ARGUMENT, "cat", "argument 'tensors'");
  r = RUN("cat", ((op_value_t){.kind = VAL_TENSORS, .tensors = NULL, .ntensors = 2}));
  ERR(r, BAD_ARGUMENT, "cat", "argument 'tensors'");
}

Test(bind, null_op_and_unbound_args) {
  op_args_t a;
  op_infer_t out;
  meshd_error_t e = {0};
  cr_assert_eq(ops_bind(NULL, NULL, 0, NULL, 0, &a, &e), -1);
  memset(&a, 0, sizeof a);
  cr_assert_eq(ops_infer(&a, &out, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  cr_assert_eq(ops_infer(NULL, &out, &e), -1);
}

/* ================= type promotion ================= */

static dtype_t rt2(const op_value_t a, const op_value_t b) {
  const op_value_t *v[2] = {&a, &b};
  return ops_result_type(v, 2);
}

Test(promotion, result_type_follows_torch) {
  tensor_meta_t i32 = T(DTYPE_INT32, 2), f16 = T(DTYPE_FLOAT16, 2), b = T(DTYPE_BOOL, 2),
                u8 = T(DTYPE_UINT8, 2), i8 = T(DTYPE_INT8, 2), bf = T(DTYPE_BFLOAT16, 2),
                f64_0 = T0(DTYPE_FLOAT64), i16_0 = T0(DTYPE_INT16), f16_0 = T0(DTYPE_FLOAT16),
                i32_0 = T0(DTYPE_INT32), b_0 = T0(DTYPE_BOOL);
  cr_assert_eq(rt2(vt(&i32), vf(2.5)), DTYPE_FLOAT32);   /* scalar raises the category */
  cr_assert_eq(rt2(vt(&b), vi(1)), DTYPE_INT64);
  cr_assert_eq(rt2(vt(&b), vb(true)), DTYPE_BOOL);
  cr_assert_eq(rt2(vt(&u8), vi(1000)), DTYPE_UINT8);     /* same category: tensor wins */
  cr_assert_eq(rt2(vt(&f16), vf(1e10)), DTYPE_FLOAT16);
  cr_assert_eq(rt2(vt(&i8), vt(&i16_0)), DTYPE_INT8);    /* dim tensor outranks 0-dim */
  cr_assert_eq(rt2(vt(&i32), vt(&f64_0)), DTYPE_FLOAT64); /* ...unless the category rises */
  cr_assert_eq(rt2(vt(&f16), vt(&f64_0)), DTYPE_FLOAT16);
  cr_assert_eq(rt2(vt(&f16), vt(&bf)), DTYPE_FLOAT32);
  cr_assert_eq(rt2(vt(&u8), vt(&i8)), DTYPE_INT16);
  cr_assert_eq(rt2(vt(&f16_0), vf(2.5)), DTYPE_FLOAT16);
  cr_assert_eq(rt2(vt(&i32_0), vf(2.5)), DTYPE_FLOAT32);
  cr_assert_eq(rt2(vt(&b_0), vt(&i32_0)), DTYPE_INT32);
  cr_assert_eq(rt2(vi(1), vf(2.0)), DTYPE_FLOAT32);
  cr_assert_eq(rt2(vi(1), vi(2)), DTYPE_INT64);
  cr_assert_eq(rt2(vb(true), vnone()), DTYPE_BOOL);
  cr_assert_eq(rt2(vnone(), vnone()), DTYPE_INVALID);
}

/* ================= factories ================= */

Test(factory, empty_zeros_ones) {
  const char *names[] = {"empty", "zeros", "ones"};
  for (int k = 0; k < 3; k++) {
    res_t r = RUN(names[k], VI(2, 3));
    FRESH(r);
    SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
    STRIDES(r, 0, 3, 1);
    r = run(names[k], A(VI(4)), K({"dtype", vd(DTYPE_INT64)}));
    FRESH(r);
    SHAPE(r, 0, DTYPE_INT64, 4);
    r = run(names[k], A(vi(5)), K({"dtype", vd(DTYPE_BOOL)}));
    FRESH(r);
    SHAPE(r, 0, DTYPE_BOOL, 5);
    r = RUN(names[k], VI0);
    FRESH(r);
    SHAPE0(r, 0, DTYPE_FLOAT32);
    r = RUN(names[k], VI(2, 0, 3));
    FRESH(r);
    SHAPE(r, 0, DTYPE_FLOAT32, 2, 0, 3);
  }
}

Test(factory, bad_sizes) {
  const char *names[] = {"empty", "zeros", "ones", "rand", "randn"};
  int64_t deep[17];
  for (int i = 0; i < 17; i++) deep[i] = 1;
  for (int k = 0; k < 5; k++) {
    res_t r = RUN(names[k], VI(2, -1));
    ERR(r, BAD_ARGUMENT, names[k], "argument 'size'");
    HAS(r, "negative size -1 at dim 1");
    r = RUN(names[k], ((op_value_t){.kind = VAL_INTS, .ints = deep, .nints = 17}));
    ERR(r, BAD_ARGUMENT, names[k], "argument 'size'");
    HAS(r, "at most 16");
    r = RUN(names[k], VI((int64_t)1 << 31, (int64_t)1 << 31));
    ERR(r, BAD_ARGUMENT, names[k], "argument 'size'");
    HAS(r, "exceeds 2^62 bytes");
    r = RUN(names[k], VI(INT64_MAX, INT64_MAX));
    ERR(r, BAD_ARGUMENT, names[k], "exceeds 2^62 bytes");
    r = RUN(names[k], vf(2.0));
    ERR(r, BAD_ARGUMENT, names[k], "argument 'size'");
  }
  /* 2^62 bytes of int8 is allowed; the same count of float32 is not */
  res_t r = run("zeros", A(VI((int64_t)1 << 31, (int64_t)1 << 31)), K({"dtype", vd(DTYPE_INT8)}));
  FRESH(r);
  r = run("zeros", A(VI((int64_t)1 << 62)), K({"dtype", vd(DTYPE_UINT8)}));
  FRESH(r);
  r = run("zeros", A(VI((int64_t)1 << 61)), K({"dtype", vd(DTYPE_INT16)}));
  FRESH(r);
  r = run("zeros", A(VI((int64_t)1 << 61)), K({"dtype", vd(DTYPE_INT32)}));
  ERR(r, BAD_ARGUMENT, "zeros", "exceeds 2^62 bytes");
}

/* The process's limits (layout_set_limits) hold for every result, a view's too:
 * a 2^40-element factory is refused when checked, never run. */
Test(factory, the_tensor_limits_hold_at_check_time) {
  layout_set_limits(&(layout_limits_t){4, (int64_t)1 << 34});
  res_t r = RUN("zeros", VI((int64_t)1 << 20, (int64_t)1 << 20));
  ERR(r, QUOTA, "zeros", "argument 'size'");
  HAS(r, "shape [1048576, 1048576] has 1099511627776 elements, more than the 17179869184");
  HAS(r, "(--max-tensor-elements)");
  r = RUN("zeros", VI(1, 1, 1, 1, 1));
  ERR(r, QUOTA, "zeros", "argument 'size'");
  HAS(r, "(--max-tensor-dims)");
  r = RUN("zeros", VI((int64_t)1 << 17, (int64_t)1 << 17));
  FRESH(r);
  tensor_meta_t x = T(DTYPE_FLOAT32, 1, 1);
  r = RUN("expand", vt(&x), VI((int64_t)1 << 20, (int64_t)1 << 20));
  ERR(r, QUOTA, "expand", "result");
  HAS(r, "(--max-tensor-elements)");
  tensor_meta_t four = T(DTYPE_FLOAT32, 1, 1, 1, 1);
  r = RUN("unsqueeze", vt(&four), vi(0));
  ERR(r, QUOTA, "unsqueeze", "(--max-tensor-dims)");
  layout_set_limits(NULL);
  r = RUN("zeros", VI((int64_t)1 << 20, (int64_t)1 << 20));
  FRESH(r);
}

Test(factory, full_infers_dtype_from_the_value) {
  res_t r = RUN("full", VI(2, 3), vf(1.5));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  r = RUN("full", VI(2), vi(7));
  SHAPE(r, 0, DTYPE_INT64, 2);
  r = RUN("full", VI(2), vb(true));
  SHAPE(r, 0, DTYPE_BOOL, 2);
  r = run("full", A(VI(2), vi(7)), K({"dtype", vd(DTYPE_FLOAT16)}));
  SHAPE(r, 0, DTYPE_FLOAT16, 2);
  r = run("full", A(VI(2), vf(1.5)), K({"dtype", vd(DTYPE_INT32)})); /* truncates, like torch */
  FRESH(r);
  SHAPE(r, 0, DTYPE_INT32, 2);
  r = run("full", A(VI(2), vi(-1)), K({"dtype", vd(DTYPE_UINT8)})); /* wraps once, like torch */
  FRESH(r);
  r = run("full", A(VI(2), vf(INFINITY)), K({"dtype", vd(DTYPE_FLOAT16)}));
  FRESH(r);
  r = run("full", A(VI(2), vi(1)), K({"dtype", vd(DTYPE_BOOL)}));
  FRESH(r);
}

Test(factory, full_rejects_values_that_overflow) {
  struct {
    op_value_t v;
    dtype_t dt;
  } bad[] = {
      {vi(300), DTYPE_UINT8},    {vi(-256), DTYPE_UINT8},    {vi(128), DTYPE_INT8},
      {vi(-129), DTYPE_INT8},    {vi(40000), DTYPE_INT16},   {vi(1ll << 31), DTYPE_INT32},
      {vi(2), DTYPE_BOOL},       {vi(65505), DTYPE_FLOAT16}, {vf(1e6), DTYPE_FLOAT16},
      {vf(NAN), DTYPE_INT32},    {vf(INFINITY), DTYPE_INT64}, {vf(-1.0), DTYPE_UINT8},
      {vf(1e39), DTYPE_FLOAT32}, {vf(1e39), DTYPE_BFLOAT16},  {vf(2.0), DTYPE_BOOL},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    res_t r = run("full", A(VI(2), bad[i].v), K({"dtype", vd(bad[i].dt)}));
    ERR(r, BAD_ARGUMENT, "full", "argument 'fill_value'");
    HAS(r, "without overflow");
    HAS(r, dtype_name(bad[i].dt));
  }
  res_t r = RUN("full", VI(2));
  ERR(r, BAD_ARGUMENT, "full", "missing argument 'fill_value'");
  r = RUN("full", VI(-2), vi(1));
  ERR(r, BAD_ARGUMENT, "full", "argument 'size'");
  r = RUN("full", VI(2), VI(1));
  ERR(r, BAD_ARGUMENT, "full", "argument 'fill_value' must be a Scalar");
  r = run("full", A(VI(2), vf(NAN)), K({"dtype", vd(DTYPE_FLOAT32)}));
  FRESH(r);
}

Test(factory, arange_lengths) {
  res_t r = RUN("arange", vi(5));
  FRESH(r);
  SHAPE(r, 0, DTYPE_INT64, 5);
  r = RUN("arange", vi(0), vi(10), vi(3));
  SHAPE(r, 0, DTYPE_INT64, 4); /* 0 3 6 9 */
  r = RUN("arange", vi(10), vi(0), vi(-3));
  SHAPE(r, 0, DTYPE_INT64, 4); /* 10 7 4 1 */
  r = RUN("arange", vf(0.0), vf(1.0), vf(0.25));
  SHAPE(r, 0, DTYPE_FLOAT32, 4);
  r = RUN("arange", vi(0), vf(2.5));
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = RUN("arange", vf(1.0), vf(0.0), vf(-0.3));
  SHAPE(r, 0, DTYPE_FLOAT32, 4); /* 1 .7 .4 .1 */
  r = RUN("arange", vf(-2.5), vf(-1.0), vf(0.5));
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = RUN("arange", vi(1), vi(1));
  FRESH(r);
  SHAPE(r, 0, DTYPE_INT64, 0);
  r = run("arange", A(vi(0), vi(5)), K({"dtype", vd(DTYPE_FLOAT64)}));
  SHAPE(r, 0, DTYPE_FLOAT64, 5);
  /* int64 truncates the bounds first: end 2.5 -> 2 */
  r = run("arange", A(vi(0), vf(2.5)), K({"dtype", vd(DTYPE_INT64)}));
  SHAPE(r, 0, DTYPE_INT64, 2);
  r = run("arange", A(vi(0), vf(2.5)), K({"dtype", vd(DTYPE_INT32)}));
  SHAPE(r, 0, DTYPE_INT32, 3);
  r = RUN("arange", vi(-5), vi(5), vi(4));
  SHAPE(r, 0, DTYPE_INT64, 3); /* -5 -1 3 */
  r = RUN("arange", vi(0), vi(INT64_MAX), vi(1ll << 40));
  SHAPE(r, 0, DTYPE_INT64, 8388608);
}

Test(factory, arange_errors) {
  res_t r = RUN("arange", vi(0), vi(10), vi(0));
  ERR(r, BAD_ARGUMENT, "arange", "argument 'step' must be nonzero");
  r = RUN("arange", vf(0), vf(1), vf(0.0));
  ERR(r, BAD_ARGUMENT, "arange", "'step'");
  r = run("arange", A(vf(0.5), vf(0.7), vf(0.1)), K({"dtype", vd(DTYPE_INT32)}));
  ERR(r, BAD_ARGUMENT, "arange", "'step'"); /* step truncates to 0 */
  r = RUN("arange", vi(0), vi(10), vi(-1));
  ERR(r, BAD_ARGUMENT, "arange", "argument 'step'");
  HAS(r, "wrong sign");
  r = RUN("arange", vi(0), vf(INFINITY));
  ERR(r, BAD_ARGUMENT, "arange", "'end'");
  HAS(r, "finite");
  r = RUN("arange", vf(NAN), vf(1));
  ERR(r, BAD_ARGUMENT, "arange", "'start'");
  r = run("arange", A(vi(5)), K({"dtype", vd(DTYPE_BOOL)}));
  ERR(r, DTYPE_MISMATCH, "arange", "argument 'dtype'");
  r = run("arange", A(vi(0), vf(1e30)), K({"dtype", vd(DTYPE_INT64)}));
  ERR(r, BAD_ARGUMENT, "arange", "argument 'end'");
  r = RUN("arange", vf(0), vf(4.7e18), vf(1));
  ERR(r, BAD_ARGUMENT, "arange", "exceeds 2^62 bytes");
  r = RUN("arange", VI(1, 2));
  ERR(r, BAD_ARGUMENT, "arange", "argument 'start' must be a Scalar");
  r = RUN("arange", vi(0), vi(5), vnone());
  ERR(r, BAD_ARGUMENT, "arange", "argument 'step' must be a Scalar, got None");
}

Test(factory, rand_and_randn) {
  const char *names[] = {"rand", "randn"};
  for (int k = 0; k < 2; k++) {
    res_t r = RUN(names[k], VI(2, 3));
    FRESH(r);
    SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
    r = run(names[k], A(VI(4)), K({"dtype", vd(DTYPE_BFLOAT16)}, {"seed", vi(7)}));
    FRESH(r);
    SHAPE(r, 0, DTYPE_BFLOAT16, 4);
    r = run(names[k], A(VI(4)), K({"dtype", vd(DTYPE_INT64)}));
    ERR(r, DTYPE_MISMATCH, names[k], "argument 'dtype'");
    HAS(r, "int64");
    r = run(names[k], A(VI(4)), K({"dtype", vd(DTYPE_BOOL)}));
    ERR(r, DTYPE_MISMATCH, names[k], "argument 'dtype'");
    r = run(names[k], A(VI(4)), K({"seed", vf(1.5)}));
    ERR(r, BAD_ARGUMENT, names[k], "argument 'seed'");
    r = RUN(names[k], VI(4), vi(1)); /* dtype and seed are keyword-only */
    ERR(r, BAD_ARGUMENT, names[k], "positional");
  }
}

Test(factory, rank_is_an_int64_scalar) {
  res_t r = RUN("rank", vs("gpu"));
  FRESH(r);
  SHAPE0(r, 0, DTYPE_INT64);
  r = RUN("rank", vs(""));
  ERR(r, BAD_ARGUMENT, "rank", "argument 'dim'");
  r = RUN("rank", vnone());
  ERR(r, BAD_ARGUMENT, "rank", "argument 'dim'");
}

/* ================= elementwise binary ================= */

static const char *const binaries[] = {
    "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "bitwise_and", "bitwise_or", "bitwise_xor"};
#define NBIN (sizeof binaries / sizeof binaries[0])

static bool is_predicate(const char *op) {
  return strlen(op) == 2 || strncmp(op, "logical", 7) == 0;
}

Test(binary, every_op_broadcasts) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 1, 3), y = T(DTYPE_FLOAT32, 4, 1);
  tensor_meta_t i = T(DTYPE_INT32, 2, 1, 3), j = T(DTYPE_INT32, 4, 1);
  for (size_t k = 0; k < NBIN; k++) {
    bool bitwise = strncmp(binaries[k], "bitwise", 7) == 0;
    res_t r = bitwise ? RUN(binaries[k], vt(&i), vt(&j)) : RUN(binaries[k], vt(&x), vt(&y));
    FRESH(r);
    dtype_t want = is_predicate(binaries[k]) ? DTYPE_BOOL : bitwise ? DTYPE_INT32 : DTYPE_FLOAT32;
    SHAPE(r, 0, want, 2, 4, 3);
    STRIDES(r, 0, 12, 3, 1);
  }
}

Test(binary, every_op_rejects_unbroadcastable_shapes) {
  tensor_meta_t x = T(DTYPE_INT32, 2, 3), y = T(DTYPE_INT32, 4);
  for (size_t k = 0; k < NBIN; k++) {
    res_t r = RUN(binaries[k], vt(&x), vt(&y));
    ERR(r, SHAPE_MISMATCH, binaries[k], "self [2, 3]");
    HAS(r, "[4]");
    HAS(r, "at dim 1");
    HAS(r, strcmp(binaries[k], "pow") == 0 ? "exponent" : "other");
    r = RUN(binaries[k], vt(&x));
    ERR(r, BAD_ARGUMENT, binaries[k], "missing argument");
  }
}

Test(binary, scalar_forms) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 3), i = T(DTYPE_INT32, 3), b = T(DTYPE_BOOL, 3),
                u8 = T(DTYPE_UINT8, 3), h = T(DTYPE_FLOAT16, 3);
  res_t r = RUN("add", vt(&i), vf(2.5));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = RUN("add", vt(&b), vi(1));
  SHAPE(r, 0, DTYPE_INT64, 3);
  r = RUN("mul", vt(&u8), vi(1000));
  SHAPE(r, 0, DTYPE_UINT8, 3);
  r = RUN("sub", vt(&h), vf(1.0));
  SHAPE(r, 0, DTYPE_FLOAT16, 3);
  r = RUN("mul", vt(&b), vt(&b));
  SHAPE(r, 0, DTYPE_BOOL, 3);
  r = RUN("add", vt(&b), vb(true));
  SHAPE(r, 0, DTYPE_BOOL, 3);
  r = RUN("eq", vt(&f), vi(1));
  SHAPE(r, 0, DTYPE_BOOL, 3);
  r = RUN("lt", vt(&i), vf(0.5));
  SHAPE(r, 0, DTYPE_BOOL, 3);
  r = RUN("bitwise_xor", vt(&u8), vi(1));
  SHAPE(r, 0, DTYPE_UINT8, 3);
  r = RUN("bitwise_or", vt(&b), vt(&b));
  SHAPE(r, 0, DTYPE_BOOL, 3);
  r = RUN("pow", vt(&i), vi(2));
  SHAPE(r, 0, DTYPE_INT32, 3);
  r = RUN("pow", vt(&i), vf(0.5));
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = RUN("pow", vt(&f), vi(-1));
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = RUN("maximum", vt(&i), vt(&f));
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = RUN("logical_and", vt(&f), vt(&i));
  SHAPE(r, 0, DTYPE_BOOL, 3);
  tensor_meta_t s = T0(DTYPE_FLOAT64);
  r = RUN("add", vt(&s), vi(1));
  FRESH(r);
  SHAPE0(r, 0, DTYPE_FLOAT64);
  /* tensor-only ops refuse scalars, as ATen's schemas do */
  const char *tensor_only[] = {"maximum", "minimum", "logical_and", "logical_or"};
  for (int k = 0; k < 4; k++) {
    r = RUN(tensor_only[k], vt(&f), vi(1));
    ERR(r, BAD_ARGUMENT, tensor_only[k], "argument 'other' must be a Tensor, got int");
  }
}

Test(binary, add_sub_alpha) {
  tensor_meta_t i = T(DTYPE_INT32, 3), f = T(DTYPE_FLOAT32, 3), b = T(DTYPE_BOOL, 3);
  res_t r = run("add", A(vt(&f), vt(&f)), K({"alpha", vf(2.5)}));
  FRESH(r);
  r = run("add", A(vt(&i), vf(1.5)), K({"alpha", vf(2.5)})); /* float result: fine */
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = run("add", A(vt(&b), vt(&b)), K({"alpha", vb(true)}));
  SHAPE(r, 0, DTYPE_BOOL, 3);
  const char *ops[] = {"add", "sub"};
  for (int k = 0; k < 2; k++) {
    r = run(ops[k], A(vt(&i), vt(&i)), K({"alpha", vf(2.5)}));
    ERR(r, DTYPE_MISMATCH, ops[k], "argument 'alpha'");
    r = run(ops[k], A(vt(&i), vt(&i)), K({"alpha", vb(true)}));
    ERR(r, DTYPE_MISMATCH, ops[k], "argument 'alpha'");
    r = run(ops[k], A(vt(&i), vt(&i)), K({"alpha", vs("2")}));
    ERR(r, BAD_ARGUMENT, ops[k], "argument 'alpha'");
  }
}

Test(binary, sub_refuses_bool) {
  tensor_meta_t i = T(DTYPE_INT32, 3), b = T(DTYPE_BOOL, 3);
  res_t r = RUN("sub", vt(&b), vt(&b));
  ERR(r, DTYPE_MISMATCH, "sub", "self is bool tensor");
  r = RUN("sub", vt(&b), vi(1));
  ERR(r, DTYPE_MISMATCH, "sub", "self is bool tensor");
  r = RUN("sub", vt(&i), vb(true));
  ERR(r, DTYPE_MISMATCH, "sub", "other is bool scalar");
  r = RUN("sub", vt(&i), vt(&b));
  ERR(r, DTYPE_MISMATCH, "sub", "other is bool tensor");
}

Test(binary, div_modes) {
  tensor_meta_t i = T(DTYPE_INT64, 3), h = T(DTYPE_FLOAT16, 3), b = T(DTYPE_BOOL, 3);
  res_t r = RUN("div", vt(&i), vt(&i));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 3); /* true division */
  r = RUN("div", vt(&b), vt(&b));
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = RUN("div", vt(&h), vi(2));
  SHAPE(r, 0, DTYPE_FLOAT16, 3);
  r = run("div", A(vt(&i), vi(2)), K({"rounding_mode", vs("floor")}));
  SHAPE(r, 0, DTYPE_INT64, 3);
  r = run("div", A(vt(&i), vi(2)), K({"rounding_mode", vs("trunc")}));
  SHAPE(r, 0, DTYPE_INT64, 3);
  r = run("div", A(vt(&i), vi(2)), K({"rounding_mode", vnone()}));
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = run("div", A(vt(&i), vi(2)), K({"rounding_mode", vs("round")}));
  ERR(r, BAD_ARGUMENT, "div", "argument 'rounding_mode'");
  HAS(r, "'round'");
  r = run("div", A(vt(&b), vt(&b)), K({"rounding_mode", vs("trunc")}));
  ERR(r, DTYPE_MISMATCH, "div", "argument 'rounding_mode'");
}

Test(binary, pow_rules) {
  tensor_meta_t i = T(DTYPE_INT64, 3), b = T(DTYPE_BOOL, 3);
  res_t r = RUN("pow", vt(&i), vi(-1));
  ERR(r, BAD_ARGUMENT, "pow", "argument 'exponent'");
  HAS(r, "negative integer powers");
  r = RUN("pow", vt(&b), vi(-2));
  ERR(r, BAD_ARGUMENT, "pow", "argument 'exponent'");
  r = RUN("pow", vt(&i), vf(-1.0)); /* a float exponent is fine */
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  r = RUN("pow", vt(&b), vt(&b));
  ERR(r, DTYPE_MISMATCH, "pow", "exponent");
  r = RUN("pow", vt(&b), vb(true));
  ERR(r, DTYPE_MISMATCH, "pow", "exponent");
  r = RUN("pow", vt(&b), vi(2));
  SHAPE(r, 0, DTYPE_INT64, 3);
}

Test(binary, bitwise_needs_integers) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 3), i = T(DTYPE_INT32, 3), l = T(DTYPE_INT64, 3);
  const char *ops[] = {"bitwise_and", "bitwise_or", "bitwise_xor"};
  for (int k = 0; k < 3; k++) {
    res_t r = RUN(ops[k], vt(&i), vt(&l));
    SHAPE(r, 0, DTYPE_INT64, 3);
    r = RUN(ops[k], vt(&f), vi(1));
    ERR(r, DTYPE_MISMATCH, ops[k], "self is float32 tensor");
    r = RUN(ops[k], vt(&i), vf(1.5));
    ERR(r, DTYPE_MISMATCH, ops[k], "other is float scalar");
    r = RUN(ops[k], vt(&i), vt(&f));
    ERR(r, DTYPE_MISMATCH, ops[k], "other is float32 tensor");
  }
}

/* ================= elementwise unary ================= */

static const char *const unaries[] = {"neg", "abs", "exp", "log", "sqrt", "rsqrt",
                                      "sin", "cos", "tanh", "sigmoid", "relu", "gelu",
                                      "silu", "reciprocal", "sign", "logical_not"};
#define NUN (sizeof unaries / sizeof unaries[0])

static bool in_list(const char *op, const char *list) {
  char key[32];
  snprintf(key, sizeof key, " %s ", op);
  return strstr(list, key) != NULL;
}
#define TO_FLOAT " exp log sqrt rsqrt sin cos tanh sigmoid reciprocal "
#define FLOAT_ONLY " gelu silu "
#define NO_BOOL " neg abs relu "

Test(unary, dtypes_per_op) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3), h = T(DTYPE_FLOAT16, 2, 3), i = T(DTYPE_INT64, 2, 3),
                b = T(DTYPE_BOOL, 2, 3);
  for (size_t k = 0; k < NUN; k++) {
    const char *op = unaries[k];
    bool lnot = strcmp(op, "logical_not") == 0;
    res_t r = RUN(op, vt(&f));
    FRESH(r);
    SHAPE(r, 0, lnot ? DTYPE_BOOL : DTYPE_FLOAT32, 2, 3);
    r = RUN(op, vt(&h));
    SHAPE(r, 0, lnot ? DTYPE_BOOL : DTYPE_FLOAT16, 2, 3);
    r = RUN(op, vt(&i));
    if (in_list(op, FLOAT_ONLY)) {
      ERR(r, DTYPE_MISMATCH, op, "argument 'self'");
      HAS(r, "int64");
    } else {
      SHAPE(r, 0, lnot ? DTYPE_BOOL : in_list(op, TO_FLOAT) ? DTYPE_FLOAT32 : DTYPE_INT64, 2, 3);
    }
    r = RUN(op, vt(&b));
    if (in_list(op, FLOAT_ONLY) || in_list(op, NO_BOOL)) {
      ERR(r, DTYPE_MISMATCH, op, "argument 'self'");
      HAS(r, "bool");
    } else {
      SHAPE(r, 0, in_list(op, TO_FLOAT) ? DTYPE_FLOAT32 : DTYPE_BOOL, 2, 3);
    }
  }
}

Test(unary, shapes_and_misuse) {
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  int64_t sz[2] = {3, 2}, st[2] = {1, 3};
  tensor_meta_t tr = strided(DTYPE_FLOAT32, 2, sz, st, 5);
  for (size_t k = 0; k < NUN; k++) {
    res_t r = RUN(unaries[k], vt(&s));
    FRESH(r);
    cr_assert_eq(r.r.results[0].meta.layout.ndim, 0);
    r = RUN(unaries[k], vt(&tr)); /* a strided input gives a fresh row-major result */
    FRESH(r);
    STRIDES(r, 0, 2, 1);
    r = RUN(unaries[k], vi(1));
    ERR(r, BAD_ARGUMENT, unaries[k], "argument 'self' must be a Tensor, got int");
    r = RUN(unaries[k], vt(&s), vi(1));
    ERR(r, BAD_ARGUMENT, unaries[k], "positional");
  }
  tensor_meta_t f = T(DTYPE_FLOAT32, 2);
  res_t r = run("gelu", A(vt(&f)), K({"approximate", vs("tanh")}));
  FRESH(r);
  r = run("gelu", A(vt(&f)), K({"approximate", vs("fast")}));
  ERR(r, BAD_ARGUMENT, "gelu", "argument 'approximate'");
  HAS(r, "'fast'");
}

/* ================= where, clamp ================= */

Test(where, broadcasts_three_and_promotes_two) {
  tensor_meta_t c = T(DTYPE_BOOL, 2, 1), x = T(DTYPE_FLOAT32, 3), i = T(DTYPE_INT32, 3),
                l = T(DTYPE_INT64, 1);
  res_t r = RUN("where", vt(&c), vt(&x), vi(0));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  r = RUN("where", vt(&c), vi(1), vf(0.5));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 1);
  r = RUN("where", vt(&c), vi(1), vi(2));
  SHAPE(r, 0, DTYPE_INT64, 2, 1);
  r = RUN("where", vt(&c), vt(&i), vt(&l));
  SHAPE(r, 0, DTYPE_INT64, 2, 3);
  r = RUN("where", vt(&c), vt(&i), vf(1.5));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
}

Test(where, misuse) {
  tensor_meta_t c = T(DTYPE_BOOL, 2, 1), f = T(DTYPE_FLOAT32, 2, 1), x = T(DTYPE_FLOAT32, 3),
                y = T(DTYPE_FLOAT32, 4), u = T(DTYPE_UINT8, 2, 1);
  res_t r = RUN("where", vt(&f), vt(&x), vt(&x));
  ERR(r, DTYPE_MISMATCH, "where", "argument 'condition'");
  HAS(r, "float32");
  r = RUN("where", vt(&u), vt(&x), vt(&x));
  ERR(r, DTYPE_MISMATCH, "where", "argument 'condition'");
  r = RUN("where", vt(&c), vt(&x), vt(&y));
  ERR(r, SHAPE_MISMATCH, "where", "the broadcast of condition and self [2, 3]");
  HAS(r, "other [4]");
  r = RUN("where", vt(&c), vt(&x));
  ERR(r, BAD_ARGUMENT, "where", "missing argument 'other'");
  r = RUN("where", vb(true), vt(&x), vt(&x));
  ERR(r, BAD_ARGUMENT, "where", "argument 'condition' must be a Tensor");
}

Test(clamp, bounds_and_dtypes) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3), i = T(DTYPE_INT32, 2, 3), b = T(DTYPE_BOOL, 2, 3),
                h = T(DTYPE_FLOAT16, 2), lo = T(DTYPE_FLOAT32, 3), f0 = T0(DTYPE_FLOAT32);
  res_t r = run("clamp", A(vt(&f)), K({"min", vi(0)}));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  r = RUN("clamp", vt(&i), vi(0), vf(1.5));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  r = run("clamp", A(vt(&i)), K({"max", vi(5)}));
  SHAPE(r, 0, DTYPE_INT32, 2, 3);
  r = RUN("clamp", vt(&b), vi(0), vi(1)); /* promotes to int64 like torch */
  SHAPE(r, 0, DTYPE_INT64, 2, 3);
  r = RUN("clamp", vt(&f), vt(&lo));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  r = run("clamp", A(vt(&h)), K({"max", vt(&f0)}));
  SHAPE(r, 0, DTYPE_FLOAT16, 2);
}

Test(clamp, misuse) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3), b = T(DTYPE_BOOL, 2, 3), bad = T(DTYPE_FLOAT32, 4);
  res_t r = RUN("clamp", vt(&f));
  ERR(r, BAD_ARGUMENT, "clamp", "'min'");
  HAS(r, "'max'");
  r = RUN("clamp", vt(&f), vnone(), vnone());
  ERR(r, BAD_ARGUMENT, "clamp", "at least one");
  r = run("clamp", A(vt(&b)), K({"min", vb(false)}));
  ERR(r, DTYPE_MISMATCH, "clamp", "self");
  r = RUN("clamp", vt(&f), vt(&bad));
  ERR(r, SHAPE_MISMATCH, "clamp", "min [4]");
  r = run("clamp", A(vt(&f)), K({"max", vt(&bad)}));
  ERR(r, SHAPE_MISMATCH, "clamp", "max [4]");
  r = RUN("clamp", vt(&f), VI(1));
  ERR(r, BAD_ARGUMENT, "clamp", "argument 'min' must be a Tensor or Scalar or None");
}

/* ================= reductions ================= */

Test(reduce, sum_dims_and_dtypes) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3, 4), i = T(DTYPE_INT32, 2, 3), b = T(DTYPE_BOOL, 5),
                h = T(DTYPE_FLOAT16, 2), s = T0(DTYPE_FLOAT32);
  res_t r = RUN("sum", vt(&x));
  FRESH(r);
  SHAPE0(r, 0, DTYPE_FLOAT32);
  r = RUN("sum", vt(&x), vi(1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 4);
  r = RUN("sum", vt(&x), VI(0, 2), vb(true));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 1, 3, 1);
  r = RUN("sum", vt(&x), VI(-1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  r = RUN("sum", vt(&x), VI0); /* an empty list reduces everything, like torch */
  SHAPE0(r, 0, DTYPE_FLOAT32);
  r = RUN("sum", vt(&x), VI0, vb(true));
  SHAPE(r, 0, DTYPE_FLOAT32, 1, 1, 1);
  r = RUN("sum", vt(&i));
  SHAPE0(r, 0, DTYPE_INT64);
  r = RUN("sum", vt(&b), vi(0));
  SHAPE0(r, 0, DTYPE_INT64);
  r = RUN("sum", vt(&h));
  SHAPE0(r, 0, DTYPE_FLOAT16);
  r = run("sum", A(vt(&i)), K({"dtype", vd(DTYPE_FLOAT64)}));
  SHAPE0(r, 0, DTYPE_FLOAT64);
  r = RUN("sum", vt(&s), vi(-1)); /* a 0-dim tensor answers to dim 0 and -1 */
  SHAPE0(r, 0, DTYPE_FLOAT32);
}

Test(reduce, dim_errors) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3), s = T0(DTYPE_FLOAT32);
  const char *ops[] = {"sum", "mean", "amax", "amin"};
  for (int k = 0; k < 4; k++) {
    res_t r = RUN(ops[k], vt(&x), vi(3));
    ERR(r, BAD_DIM, ops[k], "argument 'dim'");
    HAS(r, "dim 3 is out of range for a tensor of 2 dims (expected -2..1)");
    r = RUN(ops[k], vt(&x), VI(0, -2));
    ERR(r, BAD_DIM, ops[k], "argument 'dim'");
    HAS(r, "more than once");
    r = RUN(ops[k], vt(&x), VI(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
    ERR(r, BAD_DIM, ops[k], "argument 'dim'");
    r = RUN(ops[k], vt(&s), vi(1));
    ERR(r, BAD_DIM, ops[k], "expected -1..0");
    r = RUN(ops[k], vt(&x), vi(0), vi(1));
    ERR(r, BAD_ARGUMENT, ops[k], "argument 'keepdim'");
  }
  const char *single[] = {"prod", "max", "min", "argmax", "argmin"};
  for (int k = 0; k < 5; k++) {
    res_t r = RUN(single[k], vt(&x), vi(-3));
    ERR(r, BAD_DIM, single[k], "argument 'dim'");
    r = RUN(single[k], vt(&x), VI(0, 1)); /* one dim only */
    ERR(r, BAD_ARGUMENT, single[k], "argument 'dim' must be an int or None, got int list");
  }
}

Test(reduce, mean_needs_floats) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3, 4), i = T(DTYPE_INT64, 2, 3), b = T(DTYPE_BOOL, 2);
  res_t r = run("mean", A(vt(&f)), K({"dim", vi(0)}));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 4);
  r = run("mean", A(vt(&f)), K({"dim", VI(1)}, {"keepdim", vb(true)}, {"dtype", vd(DTYPE_FLOAT64)}));
  SHAPE(r, 0, DTYPE_FLOAT64, 2, 1, 4);
  r = run("mean", A(vt(&i)), K({"dtype", vd(DTYPE_FLOAT32)}));
  SHAPE0(r, 0, DTYPE_FLOAT32);
  r = RUN("mean", vt(&i));
  ERR(r, DTYPE_MISMATCH, "mean", "argument 'self'");
  HAS(r, "int64");
  r = RUN("mean", vt(&b));
  ERR(r, DTYPE_MISMATCH, "mean", "argument 'self'");
  r = run("mean", A(vt(&f)), K({"dtype", vd(DTYPE_INT32)}));
  ERR(r, DTYPE_MISMATCH, "mean", "argument 'dtype'");
}

Test(reduce, prod) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3, 4), i = T(DTYPE_INT32, 2, 3);
  res_t r = RUN("prod", vt(&i));
  FRESH(r);
  SHAPE0(r, 0, DTYPE_INT64);
  r = RUN("prod", vt(&f), vi(1), vb(true));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 1, 4);
  r = run("prod", A(vt(&i), vi(0)), K({"dtype", vd(DTYPE_FLOAT16)}));
  SHAPE(r, 0, DTYPE_FLOAT16, 3);
  r = run("prod", A(vt(&f)), K({"keepdim", vb(true)}));
  ERR(r, BAD_ARGUMENT, "prod", "argument 'keepdim'");
  HAS(r, "'dim'");
}

Test(reduce, max_min) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3), b = T(DTYPE_BOOL, 4), e = T(DTYPE_FLOAT32, 0, 3);
  const char *ops[] = {"max", "min"};
  for (int k = 0; k < 2; k++) {
    res_t r = RUN(ops[k], vt(&f));
    FRESH(r);
    SHAPE0(r, 0, DTYPE_FLOAT32);
    r = RUN(ops[k], vt(&f), vi(1)); /* values and indices */
    OK(r);
    cr_assert_eq(r.r.nresults, 2);
    cr_assert_eq(r.r.results[0].alias_param, -1);
    cr_assert_eq(r.r.results[1].alias_param, -1);
    SHAPE(r, 0, DTYPE_FLOAT32, 2);
    SHAPE(r, 1, DTYPE_INT64, 2);
    r = RUN(ops[k], vt(&f), vi(0), vb(true));
    SHAPE(r, 0, DTYPE_FLOAT32, 1, 3);
    SHAPE(r, 1, DTYPE_INT64, 1, 3);
    r = RUN(ops[k], vt(&b));
    SHAPE0(r, 0, DTYPE_BOOL);
    r = RUN(ops[k], vt(&e), vi(1)); /* reducing a non-empty dim of an empty tensor is fine */
    SHAPE(r, 0, DTYPE_FLOAT32, 0);
    r = RUN(ops[k], vt(&e));
    ERR(r, SHAPE_MISMATCH, ops[k], "argument 'self'");
    HAS(r, "no elements");
    r = RUN(ops[k], vt(&e), vi(0));
    ERR(r, SHAPE_MISMATCH, ops[k], "argument 'dim'");
    HAS(r, "size 0");
    r = run(ops[k], A(vt(&f)), K({"keepdim", vb(true)}));
    ERR(r, BAD_ARGUMENT, ops[k], "argument 'keepdim'");
  }
}

Test(reduce, amax_amin) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3, 4), e = T(DTYPE_INT32, 0, 3);
  const char *ops[] = {"amax", "amin"};
  for (int k = 0; k < 2; k++) {
    res_t r = RUN(ops[k], vt(&f), VI(0, 2));
    FRESH(r);
    SHAPE(r, 0, DTYPE_FLOAT32, 3);
    r = RUN(ops[k], vt(&f));
    cr_assert_eq(r.r.nresults, 1);
    SHAPE0(r, 0, DTYPE_FLOAT32);
    r = RUN(ops[k], vt(&f), vi(1), vb(true));
    SHAPE(r, 0, DTYPE_FLOAT32, 2, 1, 4);
    r = RUN(ops[k], vt(&e), vi(1));
    SHAPE(r, 0, DTYPE_INT32, 0);
    r = RUN(ops[k], vt(&e));
    ERR(r, SHAPE_MISMATCH, ops[k], "argument 'self'");
    r = RUN(ops[k], vt(&e), VI(1, 0));
    ERR(r, SHAPE_MISMATCH, ops[k], "argument 'dim'");
    r = RUN(ops[k], vt(&f), vnone()); /* int[] without `?`: None is not a list */
    ERR(r, BAD_ARGUMENT, ops[k], "argument 'dim' must be an int or int list, got None");
  }
}

Test(reduce, argmax_argmin) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3), b = T(DTYPE_BOOL, 4), e = T(DTYPE_FLOAT32, 0, 3),
                h = T(DTYPE_FLOAT16, 5);
  const char *ops[] = {"argmax", "argmin"};
  for (int k = 0; k < 2; k++) {
    res_t r = RUN(ops[k], vt(&f));
    FRESH(r);
    SHAPE0(r, 0, DTYPE_INT64);
    r = RUN(ops[k], vt(&f), vi(1));
    cr_assert_eq(r.r.nresults, 1);
    SHAPE(r, 0, DTYPE_INT64, 2);
    r = RUN(ops[k], vt(&f), vi(-1), vb(true));
    SHAPE(r, 0, DTYPE_INT64, 2, 1);
    r = run(ops[k], A(vt(&f)), K({"keepdim", vb(true)})); /* all dims kept as 1 */
    SHAPE(r, 0, DTYPE_INT64, 1, 1);
    r = RUN(ops[k], vt(&h));
    SHAPE0(r, 0, DTYPE_INT64);
    r = RUN(ops[k], vt(&b));
    ERR(r, DTYPE_MISMATCH, ops[k], "argument 'self'");
    r = RUN(ops[k], vt(&e));
    ERR(r, SHAPE_MISMATCH, ops[k], "argument 'self'");
    r = RUN(ops[k], vt(&e), vi(0));
    ERR(r, SHAPE_MISMATCH, ops[k], "argument 'dim'");
  }
}

Test(reduce, softmax_and_log_softmax) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3), i = T(DTYPE_INT64, 2, 3), h = T(DTYPE_FLOAT16, 4),
                s = T0(DTYPE_FLOAT64);
  const char *ops[] = {"softmax", "log_softmax"};
  for (int k = 0; k < 2; k++) {
    res_t r = RUN(ops[k], vt(&f), vi(1));
    FRESH(r);
    SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
    r = RUN(ops[k], vt(&h), vi(-1));
    SHAPE(r, 0, DTYPE_FLOAT16, 4);
    r = RUN(ops[k], vt(&i), vi(0), vd(DTYPE_FLOAT64));
    SHAPE(r, 0, DTYPE_FLOAT64, 2, 3);
    r = RUN(ops[k], vt(&s), vi(0));
    SHAPE0(r, 0, DTYPE_FLOAT64);
    r = RUN(ops[k], vt(&i), vi(0));
    ERR(r, DTYPE_MISMATCH, ops[k], "argument 'self'");
    r = RUN(ops[k], vt(&f), vi(0), vd(DTYPE_INT32));
    ERR(r, DTYPE_MISMATCH, ops[k], "argument 'dtype'");
    r = RUN(ops[k], vt(&f), vi(2));
    ERR(r, BAD_DIM, ops[k], "argument 'dim'");
    r = RUN(ops[k], vt(&f));
    ERR(r, BAD_ARGUMENT, ops[k], "missing argument 'dim'");
  }
}

/* ================= matrix products ================= */

Test(matmul, shapes_follow_torch_matmul) {
  struct {
    int n1, n2, nout;
    int64_t s1[4], s2[4], out[4];
  } cases[] = {
      {1, 1, 0, {3}, {3}, {0}},
      {2, 1, 1, {2, 3}, {3}, {2}},
      {1, 2, 1, {3}, {3, 4}, {4}},
      {2, 2, 2, {2, 3}, {3, 4}, {2, 4}},
      {3, 2, 3, {5, 2, 3}, {3, 4}, {5, 2, 4}},
      {3, 1, 2, {5, 2, 3}, {3}, {5, 2}},
      {1, 3, 2, {3}, {5, 3, 4}, {5, 4}},
      {2, 3, 3, {2, 3}, {5, 3, 4}, {5, 2, 4}},
      {4, 3, 4, {7, 1, 2, 3}, {5, 3, 4}, {7, 5, 2, 4}},
      {3, 3, 3, {1, 2, 3}, {6, 3, 0}, {6, 2, 0}},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    tensor_meta_t x = make(DTYPE_FLOAT32, cases[c].s1, cases[c].n1),
                  y = make(DTYPE_FLOAT32, cases[c].s2, cases[c].n2);
    res_t r = RUN("matmul", vt(&x), vt(&y));
    FRESH(r);
    expect_shape(&r.r.results[0], DTYPE_FLOAT32, cases[c].out, cases[c].nout, (int)c);
  }
  tensor_meta_t a = T(DTYPE_INT64, 2, 3), b = T(DTYPE_INT64, 3, 2);
  res_t r = RUN("matmul", vt(&a), vt(&b));
  SHAPE(r, 0, DTYPE_INT64, 2, 2);
}

Test(matmul, misuse) {
  tensor_meta_t a = T(DTYPE_FLOAT32, 2, 3), b = T(DTYPE_FLOAT32, 4, 5), s = T0(DTYPE_FLOAT32),
                d = T(DTYPE_FLOAT64, 3, 4), bo = T(DTYPE_BOOL, 2, 2), ba = T(DTYPE_FLOAT32, 2, 2, 3),
                bb = T(DTYPE_FLOAT32, 3, 3, 4);
  res_t r = RUN("matmul", vt(&a), vt(&b));
  ERR(r, SHAPE_MISMATCH, "matmul", "other");
  cr_assert_str_eq(r.e.msg, "matmul: self is [2, 3] and other is [4, 5]: inner dims 3 and 4 must match");
  r = RUN("matmul", vt(&s), vt(&a));
  ERR(r, SHAPE_MISMATCH, "matmul", "self is 0-D");
  r = RUN("matmul", vt(&a), vt(&d));
  ERR(r, DTYPE_MISMATCH, "matmul", "other is float64");
  r = RUN("matmul", vt(&bo), vt(&bo));
  ERR(r, DTYPE_MISMATCH, "matmul", "bool");
  r = RUN("matmul", vt(&ba), vt(&bb));
  ERR(r, SHAPE_MISMATCH, "matmul", "the batch dims of self [2]");
  HAS(r, "the batch dims of other [3]");
  r = RUN("matmul", vt(&a), vi(2));
  ERR(r, BAD_ARGUMENT, "matmul", "argument 'other' must be a Tensor");
  /* a result past 2^62 bytes is refused even though both inputs are small */
  tensor_meta_t tall = T(DTYPE_FLOAT32, 1ll << 31, 1), wide = T(DTYPE_FLOAT32, 1, 1ll << 31);
  r = RUN("matmul", vt(&tall), vt(&wide));
  ERR(r, BAD_ARGUMENT, "matmul", "exceeds 2^62 bytes");
}

Test(matmul, mm) {
  tensor_meta_t a = T(DTYPE_FLOAT32, 2, 3), b = T(DTYPE_FLOAT32, 3, 4), c = T(DTYPE_FLOAT32, 4, 5),
                v = T(DTYPE_FLOAT32, 3), t3 = T(DTYPE_FLOAT32, 2, 3, 4), h = T(DTYPE_FLOAT16, 3, 4);
  res_t r = RUN("mm", vt(&a), vt(&b));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 4);
  r = RUN("mm", vt(&a), vt(&c));
  ERR(r, SHAPE_MISMATCH, "mm", "mat2");
  cr_assert_str_eq(r.e.msg, "mm: self is [2, 3] and mat2 is [4, 5]: inner dims 3 and 4 must match");
  r = RUN("mm", vt(&t3), vt(&b));
  ERR(r, SHAPE_MISMATCH, "mm", "argument 'self' must be a 2-D tensor");
  r = RUN("mm", vt(&a), vt(&v));
  ERR(r, SHAPE_MISMATCH, "mm", "argument 'mat2' must be a 2-D tensor");
  r = RUN("mm", vt(&a), vt(&h));
  ERR(r, DTYPE_MISMATCH, "mm", "mat2 is float16");
}

Test(matmul, bmm) {
  tensor_meta_t a = T(DTYPE_FLOAT32, 5, 2, 3), b = T(DTYPE_FLOAT32, 5, 3, 4),
                c = T(DTYPE_FLOAT32, 6, 3, 4), d = T(DTYPE_FLOAT32, 5, 4, 4), m = T(DTYPE_FLOAT32, 3, 4);
  res_t r = RUN("bmm", vt(&a), vt(&b));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 5, 2, 4);
  r = RUN("bmm", vt(&a), vt(&c));
  ERR(r, SHAPE_MISMATCH, "bmm", "mat2 is [6, 3, 4]");
  HAS(r, "batch sizes 5 and 6");
  r = RUN("bmm", vt(&a), vt(&d));
  ERR(r, SHAPE_MISMATCH, "bmm", "mat2 is [5, 4, 4]: inner dims 3 and 4 must match");
  r = RUN("bmm", vt(&m), vt(&b));
  ERR(r, SHAPE_MISMATCH, "bmm", "argument 'self' must be a 3-D tensor");
  r = RUN("bmm", vt(&a), vt(&m));
  ERR(r, SHAPE_MISMATCH, "bmm", "argument 'mat2' must be a 3-D tensor");
}

/* ================= views ================= */

Test(views, view_computes_torch_strides) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3, 4);
  x.layout.offset = 7;
  res_t r = RUN("view", vt(&x), VI(6, 4));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 6, 4);
  STRIDES(r, 7, 4, 1);
  r = RUN("view", vt(&x), vi(-1));
  SHAPE(r, 0, DTYPE_FLOAT32, 24);
  STRIDES(r, 7, 1);
  r = RUN("view", vt(&x), VI(4, -1));
  SHAPE(r, 0, DTYPE_FLOAT32, 4, 6);
  r = RUN("view", vt(&x), VI(1, 24, 1));
  STRIDES(r, 7, 24, 1, 1);
  /* transpose(0, 1) of [2, 3, 4]: splitting the last dim is fine, merging is not */
  int64_t sz[3] = {3, 2, 4}, st[3] = {4, 12, 1};
  tensor_meta_t tr = strided(DTYPE_FLOAT32, 3, sz, st, 0);
  r = RUN("view", vt(&tr), VI(3, 2, 2, 2));
  VIEW(r);
  STRIDES(r, 0, 4, 12, 2, 1);
  r = RUN("view", vt(&tr), VI(3, 8));
  ERR(r, SHAPE_MISMATCH, "view", "argument 'size' [3, 8]");
  HAS(r, "reshape");
  HAS(r, "strides [4, 12, 1]");
  /* a strided 1-D tensor */
  int64_t sz1[1] = {3}, st1[1] = {2};
  tensor_meta_t ev = strided(DTYPE_FLOAT32, 1, sz1, st1, 1);
  r = RUN("view", vt(&ev), VI(3, 1));
  STRIDES(r, 1, 2, 2);
  tensor_meta_t s = T0(DTYPE_INT8);
  r = RUN("view", vt(&s), VI(1, 1));
  SHAPE(r, 0, DTYPE_INT8, 1, 1);
  STRIDES(r, 0, 1, 1);
  tensor_meta_t z = T(DTYPE_FLOAT32, 0, 3);
  r = RUN("view", vt(&z), VI(3, 0, 2));
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 0, 2);
  STRIDES(r, 0, 2, 2, 1);
}

Test(views, view_size_errors) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3), z = T(DTYPE_FLOAT32, 0, 3);
  const char *ops[] = {"view", "reshape"};
  const char *arg[] = {"'size'", "'shape'"};
  for (int k = 0; k < 2; k++) {
    res_t r = RUN(ops[k], vt(&x), VI(5, 5));
    ERR(r, SHAPE_MISMATCH, ops[k], arg[k]);
    HAS(r, "[5, 5] is invalid for self of shape [2, 3] (6 elements)");
    r = RUN(ops[k], vt(&x), VI(-1, -1));
    ERR(r, BAD_ARGUMENT, ops[k], arg[k]);
    HAS(r, "only one dim can be -1");
    r = RUN(ops[k], vt(&x), VI(-2, -3));
    ERR(r, BAD_ARGUMENT, ops[k], arg[k]);
    HAS(r, "invalid size -2");
    r = RUN(ops[k], vt(&x), VI(4, -1));
    ERR(r, SHAPE_MISMATCH, ops[k], arg[k]);
    r = RUN(ops[k], vt(&z), VI(0, -1));
    ERR(r, SHAPE_MISMATCH, ops[k], arg[k]);
    HAS(r, "0 elements");
    r = RUN(ops[k], vt(&x), VI(1ll << 40, 1ll << 40, 6));
    ERR(r, SHAPE_MISMATCH, ops[k], arg[k]);
    /* An empty tensor takes any shape with a 0, but its strides must still fit
     * (the product of its other sizes overflowed computing them: fuzz_ops_bind). */
    r = RUN(ops[k], vt(&z), VI(0, 7427280210464079871ll, 3));
    ERR(r, BAD_ARGUMENT, ops[k], arg[k]);
    HAS(r, "exceeds 2^62 bytes (in its strides");
    r = RUN(ops[k], vt(&z), VI(0, 1ll << 30, 1ll << 20)); /* 2^52 elements' strides: fine */
    SHAPE(r, 0, DTYPE_FLOAT32, 0, 1ll << 30, 1ll << 20);
    int64_t many[17];
    for (int i = 0; i < 17; i++) many[i] = 1;
    many[0] = 6;
    r = RUN(ops[k], vt(&x), ((op_value_t){.kind = VAL_INTS, .ints = many, .nints = 17}));
    ERR(r, BAD_ARGUMENT, ops[k], arg[k]);
    HAS(r, "at most 16");
  }
}

Test(views, reshape_views_when_it_can) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3, 4);
  res_t r = RUN("reshape", vt(&x), VI(4, 6));
  VIEW(r);
  STRIDES(r, 0, 6, 1);
  int64_t sz[2] = {3, 2}, st[2] = {1, 3};
  tensor_meta_t tr = strided(DTYPE_FLOAT32, 2, sz, st, 4);
  r = RUN("reshape", vt(&tr), vi(-1)); /* needs a copy */
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 6);
  r = RUN("reshape", vt(&tr), VI(3, 2, 1)); /* adding a 1 is still a view */
  VIEW(r);
  STRIDES(r, 4, 1, 3, 3);
}

Test(views, transpose_and_t) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3, 4);
  x.layout.offset = 3;
  res_t r = RUN("transpose", vt(&x), vi(0), vi(2));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 4, 3, 2);
  STRIDES(r, 3, 1, 4, 12);
  r = RUN("transpose", vt(&x), vi(-1), vi(1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 4, 3);
  STRIDES(r, 3, 12, 1, 4);
  r = RUN("transpose", vt(&x), vi(0), vi(3));
  ERR(r, BAD_DIM, "transpose", "argument 'dim1'");
  r = RUN("transpose", vt(&x), vi(-4), vi(0));
  ERR(r, BAD_DIM, "transpose", "argument 'dim0'");
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  r = RUN("transpose", vt(&s), vi(0), vi(-1));
  VIEW(r);
  SHAPE0(r, 0, DTYPE_FLOAT32);

  tensor_meta_t m = T(DTYPE_FLOAT32, 2, 3), v = T(DTYPE_INT32, 5);
  r = RUN("t", vt(&m));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 2);
  STRIDES(r, 0, 1, 3);
  r = RUN("t", vt(&v));
  VIEW(r);
  SHAPE(r, 0, DTYPE_INT32, 5);
  STRIDES(r, 0, 1);
  r = RUN("t", vt(&s));
  VIEW(r);
  r = RUN("t", vt(&x));
  ERR(r, SHAPE_MISMATCH, "t", "argument 'self'");
  HAS(r, "[2, 3, 4]");
}

Test(views, permute) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3, 4);
  res_t r = RUN("permute", vt(&x), VI(2, 0, 1));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 4, 2, 3);
  STRIDES(r, 0, 1, 12, 4);
  r = RUN("permute", vt(&x), VI(-1, 0, -2));
  SHAPE(r, 0, DTYPE_FLOAT32, 4, 2, 3);
  r = RUN("permute", vt(&x), VI(0, 1));
  ERR(r, BAD_DIM, "permute", "argument 'dims'");
  HAS(r, "has 2 entries");
  r = RUN("permute", vt(&x), VI(0, 0, 1));
  ERR(r, BAD_DIM, "permute", "argument 'dims'");
  HAS(r, "more than once");
  r = RUN("permute", vt(&x), VI(0, -3, 1)); /* -3 is 0 again */
  ERR(r, BAD_DIM, "permute", "more than once");
  r = RUN("permute", vt(&x), VI(0, 1, 3));
  ERR(r, BAD_DIM, "permute", "argument 'dims'");
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  r = RUN("permute", vt(&s), VI0);
  VIEW(r);
}

Test(views, select) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3, 4);
  x.layout.offset = 5;
  res_t r = RUN("select", vt(&x), vi(1), vi(2));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 4);
  STRIDES(r, 5 + 8, 12, 1);
  r = RUN("select", vt(&x), vi(0), vi(-1));
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 4);
  STRIDES(r, 5 + 12, 4, 1);
  r = RUN("select", vt(&x), vi(1), vi(3));
  ERR(r, BAD_ARGUMENT, "select", "argument 'index' 3");
  HAS(r, "expected -3..2");
  r = RUN("select", vt(&x), vi(1), vi(-4));
  ERR(r, BAD_ARGUMENT, "select", "argument 'index'");
  r = RUN("select", vt(&x), vi(3), vi(0));
  ERR(r, BAD_DIM, "select", "argument 'dim'");
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  r = RUN("select", vt(&s), vi(0), vi(0));
  ERR(r, BAD_DIM, "select", "argument 'self'");
  HAS(r, "0-dim");
  tensor_meta_t v = T(DTYPE_INT8, 4);
  r = RUN("select", vt(&v), vi(0), vi(3));
  VIEW(r);
  SHAPE0(r, 0, DTYPE_INT8);
  cr_assert_eq(r.r.results[0].meta.layout.offset, 3);
}

Test(views, narrow) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 4, 6);
  res_t r = RUN("narrow", vt(&x), vi(1), vi(2), vi(3));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 4, 3);
  STRIDES(r, 2, 6, 1);
  r = RUN("narrow", vt(&x), vi(0), vi(-2), vi(2));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 6);
  STRIDES(r, 12, 6, 1);
  r = RUN("narrow", vt(&x), vi(0), vi(4), vi(0)); /* start == size with length 0 */
  SHAPE(r, 0, DTYPE_FLOAT32, 0, 6);
  STRIDES(r, 24, 6, 1);
  r = RUN("narrow", vt(&x), vi(0), vi(-5), vi(1));
  ERR(r, BAD_ARGUMENT, "narrow", "argument 'start' -5");
  r = RUN("narrow", vt(&x), vi(0), vi(5), vi(0));
  ERR(r, BAD_ARGUMENT, "narrow", "argument 'start' 5");
  r = RUN("narrow", vt(&x), vi(0), vi(0), vi(-1));
  ERR(r, BAD_ARGUMENT, "narrow", "argument 'length'");
  r = RUN("narrow", vt(&x), vi(0), vi(3), vi(2));
  ERR(r, BAD_ARGUMENT, "narrow", "argument 'start' (3) + argument 'length' (2) exceeds dim 0 of size 4");
  r = RUN("narrow", vt(&x), vi(2), vi(0), vi(1));
  ERR(r, BAD_DIM, "narrow", "argument 'dim'");
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  r = RUN("narrow", vt(&s), vi(0), vi(0), vi(1));
  ERR(r, BAD_DIM, "narrow", "argument 'self'");
}

Test(views, slice) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 10);
  res_t r = RUN("slice", vt(&x), vi(0), vi(2), vi(8), vi(3));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2); /* 2, 5 */
  STRIDES(r, 2, 3);
  r = RUN("slice", vt(&x));
  SHAPE(r, 0, DTYPE_FLOAT32, 10);
  STRIDES(r, 0, 1);
  r = run("slice", A(vt(&x)), K({"start", vi(-3)}));
  SHAPE(r, 0, DTYPE_FLOAT32, 3);
  STRIDES(r, 7, 1);
  r = run("slice", A(vt(&x)), K({"end", vi(-1)}, {"step", vi(4)}));
  SHAPE(r, 0, DTYPE_FLOAT32, 3); /* 0, 4, 8 */
  STRIDES(r, 0, 4);
  r = run("slice", A(vt(&x)), K({"start", vi(20)}));
  SHAPE(r, 0, DTYPE_FLOAT32, 0);
  STRIDES(r, 10, 1);
  r = run("slice", A(vt(&x)), K({"start", vi(5)}, {"end", vi(2)}));
  SHAPE(r, 0, DTYPE_FLOAT32, 0);
  STRIDES(r, 5, 1);
  r = run("slice", A(vt(&x)), K({"start", vi(-100)}, {"end", vi(100)}));
  SHAPE(r, 0, DTYPE_FLOAT32, 10);
  r = run("slice", A(vt(&x)), K({"start", vi(INT64_MIN)}, {"end", vi(INT64_MAX)}, {"step", vi(INT64_MAX)}));
  SHAPE(r, 0, DTYPE_FLOAT32, 1);
  tensor_meta_t m = T(DTYPE_FLOAT32, 4, 6);
  r = RUN("slice", vt(&m), vi(1), vi(1), vnone(), vi(2));
  SHAPE(r, 0, DTYPE_FLOAT32, 4, 3);
  STRIDES(r, 1, 6, 2);
  r = RUN("slice", vt(&m), vi(-2), vi(1), vi(3));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 6);
  STRIDES(r, 6, 6, 1);
  r = run("slice", A(vt(&x)), K({"step", vi(0)}));
  ERR(r, BAD_ARGUMENT, "slice", "argument 'step' must be positive");
  r = run("slice", A(vt(&x)), K({"step", vi(-1)}));
  ERR(r, BAD_ARGUMENT, "slice", "argument 'step'");
  r = RUN("slice", vt(&m), vi(2));
  ERR(r, BAD_DIM, "slice", "argument 'dim'");
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  r = RUN("slice", vt(&s));
  ERR(r, BAD_DIM, "slice", "argument 'self'");
  r = RUN("slice", vt(&x), vi(0), vf(1.0));
  ERR(r, BAD_ARGUMENT, "slice", "argument 'start' must be an int or None");
}

Test(views, unsqueeze) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3);
  res_t r = RUN("unsqueeze", vt(&x), vi(0));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 1, 2, 3);
  STRIDES(r, 0, 6, 3, 1);
  r = RUN("unsqueeze", vt(&x), vi(1));
  STRIDES(r, 0, 3, 3, 1);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 1, 3);
  r = RUN("unsqueeze", vt(&x), vi(-1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3, 1);
  STRIDES(r, 0, 3, 1, 1);
  r = RUN("unsqueeze", vt(&x), vi(3));
  ERR(r, BAD_DIM, "unsqueeze", "argument 'dim'");
  HAS(r, "expected -3..2");
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  r = RUN("unsqueeze", vt(&s), vi(0));
  SHAPE(r, 0, DTYPE_FLOAT32, 1);
  STRIDES(r, 0, 1);
  int64_t ones[16];
  for (int i = 0; i < 16; i++) ones[i] = 1;
  tensor_meta_t deep = make(DTYPE_FLOAT32, ones, 16);
  r = RUN("unsqueeze", vt(&deep), vi(0));
  ERR(r, BAD_ARGUMENT, "unsqueeze", "argument 'self'");
  HAS(r, "16 dims");
}

Test(views, squeeze) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 1, 2, 1, 3);
  res_t r = RUN("squeeze", vt(&x));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  STRIDES(r, 0, 3, 1);
  r = RUN("squeeze", vt(&x), vi(0));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 1, 3);
  r = RUN("squeeze", vt(&x), vi(1)); /* not size 1: left alone */
  SHAPE(r, 0, DTYPE_FLOAT32, 1, 2, 1, 3);
  r = RUN("squeeze", vt(&x), VI(0, -2));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  r = RUN("squeeze", vt(&x), VI(0, 0));
  ERR(r, BAD_DIM, "squeeze", "argument 'dim'");
  r = RUN("squeeze", vt(&x), vi(4));
  ERR(r, BAD_DIM, "squeeze", "argument 'dim'");
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  r = RUN("squeeze", vt(&s), vi(0));
  SHAPE0(r, 0, DTYPE_FLOAT32);
}

Test(views, expand) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 3, 1);
  x.layout.offset = 2;
  res_t r = RUN("expand", vt(&x), VI(2, 3, 4));
  VIEW(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3, 4);
  STRIDES(r, 2, 0, 1, 0);
  r = RUN("expand", vt(&x), VI(-1, 4));
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 4);
  STRIDES(r, 2, 1, 0);
  /* torch gives a new leading dim of size 1 the stride of the dim below */
  r = RUN("expand", vt(&x), VI(1, 3, 1));
  STRIDES(r, 2, 3, 1, 1);
  tensor_meta_t s = T0(DTYPE_FLOAT32);
  r = RUN("expand", vt(&s), VI(2, 1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 1);
  STRIDES(r, 0, 0, 0);
  r = RUN("expand", vt(&x), VI(3));
  ERR(r, SHAPE_MISMATCH, "expand", "argument 'size' [3]");
  HAS(r, "fewer than self's 2");
  r = RUN("expand", vt(&x), VI(2, 4));
  ERR(r, SHAPE_MISMATCH, "expand", "argument 'size'");
  HAS(r, "expanded size 2 must match the existing size 3 at non-singleton dim 0");
  r = RUN("expand", vt(&x), VI(-1, 3, 4));
  ERR(r, BAD_ARGUMENT, "expand", "argument 'size'");
  HAS(r, "leading");
  r = RUN("expand", vt(&x), VI(3, -2));
  ERR(r, BAD_ARGUMENT, "expand", "argument 'size'");
  HAS(r, "invalid size -2");
  r = RUN("expand", vt(&x), VI(1ll << 40, 1ll << 40, 3, 4));
  ERR(r, BAD_ARGUMENT, "expand", "exceeds 2^62 bytes");
}

Test(views, contiguous) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 2, 3);
  x.layout.offset = 4;
  res_t r = RUN("contiguous", vt(&x));
  VIEW(r);
  cr_assert(meta_eq(&r.r.results[0].meta, &x));
  int64_t sz[2] = {3, 2}, st[2] = {1, 3};
  tensor_meta_t tr = strided(DTYPE_FLOAT32, 2, sz, st, 1);
  r = RUN("contiguous", vt(&tr));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 2);
  r = RUN("contiguous", vi(1));
  ERR(r, BAD_ARGUMENT, "contiguous", "argument 'self'");
}

/* ================= copies and joins ================= */

Test(copies, clone_to_cast) {
  int64_t sz[2] = {3, 2}, st[2] = {1, 3};
  tensor_meta_t tr = strided(DTYPE_FLOAT32, 2, sz, st, 1);
  res_t r = RUN("clone", vt(&tr));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 2);
  r = RUN("to", vt(&tr), vd(DTYPE_FLOAT64));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT64, 3, 2);
  r = RUN("to", vt(&tr), vd(DTYPE_FLOAT32)); /* same dtype: self itself */
  VIEW(r);
  cr_assert(meta_eq(&r.r.results[0].meta, &tr));
  r = run("to", A(vt(&tr), vd(DTYPE_FLOAT32)), K({"copy", vb(true)}));
  FRESH(r);
  r = RUN("to", vt(&tr), vs("half"));
  SHAPE(r, 0, DTYPE_FLOAT16, 3, 2);
  r = RUN("cast", vt(&tr), vd(DTYPE_FLOAT32)); /* cast always copies */
  FRESH(r);
  r = RUN("cast", vt(&tr), vd(DTYPE_INT8));
  SHAPE(r, 0, DTYPE_INT8, 3, 2);
  r = RUN("to", vt(&tr));
  ERR(r, BAD_ARGUMENT, "to", "missing argument 'dtype'");
  r = RUN("cast", vt(&tr), vs("complex64"));
  ERR(r, BAD_ARGUMENT, "cast", "argument 'dtype'");
  r = RUN("clone", vi(1));
  ERR(r, BAD_ARGUMENT, "clone", "argument 'self'");
}

Test(copies, cat) {
  tensor_meta_t a = T(DTYPE_FLOAT32, 2, 3), b = T(DTYPE_FLOAT32, 4, 3), c = T(DTYPE_FLOAT32, 2, 5),
                h = T(DTYPE_FLOAT16, 1, 3), i = T(DTYPE_INT32, 1, 3), empty = T(DTYPE_FLOAT64, 0);
  res_t r = RUN("cat", VTS(&a, &b));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 6, 3);
  r = RUN("cat", VTS(&a, &c), vi(1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 8);
  r = RUN("cat", VTS(&a, &c), vi(-1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 8);
  r = RUN("cat", VTS(&h, &a));
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 3); /* promoted */
  r = RUN("cat", VTS(&i, &h));
  SHAPE(r, 0, DTYPE_FLOAT16, 2, 3);
  r = RUN("cat", VTS(&a));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3);
  /* legacy: empty 1-D tensors are skipped for shapes, not for the dtype */
  r = RUN("cat", VTS(&empty, &a, &empty), vi(1));
  SHAPE(r, 0, DTYPE_FLOAT64, 2, 3);
  r = RUN("cat", VTS(&empty, &empty));
  SHAPE(r, 0, DTYPE_FLOAT64, 0);
}

Test(copies, cat_misuse) {
  tensor_meta_t a = T(DTYPE_FLOAT32, 2, 3), c = T(DTYPE_FLOAT32, 2, 5), v = T(DTYPE_FLOAT32, 3),
                s = T0(DTYPE_FLOAT32);
  res_t r = RUN("cat", ((op_value_t){.kind = VAL_TENSORS, .ntensors = 0}));
  ERR(r, BAD_ARGUMENT, "cat", "argument 'tensors' must be a non-empty list");
  r = RUN("cat", VTS(&a, &s));
  ERR(r, SHAPE_MISMATCH, "cat", "argument 'tensors': entry 1 is 0-dim");
  r = RUN("cat", VTS(&a, &v));
  ERR(r, SHAPE_MISMATCH, "cat", "argument 'tensors'");
  HAS(r, "same number of dims");
  r = RUN("cat", VTS(&a, &c));
  ERR(r, SHAPE_MISMATCH, "cat", "argument 'tensors'");
  HAS(r, "sizes must match except in dim 0, but entry 0 is [2, 3] and entry 1 is [2, 5] (dim 1)");
  r = RUN("cat", VTS(&a, &a), vi(2));
  ERR(r, BAD_DIM, "cat", "argument 'dim'");
  r = RUN("cat", VTS(&a), VI(0));
  ERR(r, BAD_ARGUMENT, "cat", "argument 'dim' must be an int");
}

Test(copies, stack) {
  tensor_meta_t a = T(DTYPE_FLOAT32, 2, 3), b = T(DTYPE_FLOAT32, 2, 3), i = T(DTYPE_INT8, 2, 3),
                bo = T(DTYPE_BOOL, 2, 3), c = T(DTYPE_FLOAT32, 3, 2), s = T0(DTYPE_INT64);
  res_t r = RUN("stack", VTS(&a, &b, &a));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 3, 2, 3);
  r = RUN("stack", VTS(&a, &b), vi(-1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 3, 2);
  r = RUN("stack", VTS(&a, &b), vi(1));
  SHAPE(r, 0, DTYPE_FLOAT32, 2, 2, 3);
  r = RUN("stack", VTS(&bo, &i));
  SHAPE(r, 0, DTYPE_INT8, 2, 2, 3);
  r = RUN("stack", VTS(&s, &s, &s, &s));
  SHAPE(r, 0, DTYPE_INT64, 4);
  r = RUN("stack", VTS(&a, &b), vi(3));
  ERR(r, BAD_DIM, "stack", "argument 'dim'");
  HAS(r, "expected -3..2");
  r = RUN("stack", VTS(&a, &c));
  ERR(r, SHAPE_MISMATCH, "stack", "argument 'tensors'");
  HAS(r, "entry 0 is [2, 3] and entry 1 is [3, 2]");
  r = RUN("stack", ((op_value_t){.kind = VAL_TENSORS, .ntensors = 0}));
  ERR(r, BAD_ARGUMENT, "stack", "argument 'tensors' must be a non-empty list");
  int64_t ones[16];
  for (int k = 0; k < 16; k++) ones[k] = 1;
  tensor_meta_t deep = make(DTYPE_FLOAT32, ones, 16);
  r = RUN("stack", VTS(&deep, &deep));
  ERR(r, BAD_ARGUMENT, "stack", "argument 'tensors'");
}

/* ================= indexing ================= */

Test(indexing, index_select) {
  tensor_meta_t x = T(DTYPE_FLOAT32, 5, 3), l = T(DTYPE_INT64, 4), i = T(DTYPE_INT32, 2),
                l0 = T0(DTYPE_INT64), f = T(DTYPE_FLOAT32, 4), m = T(DTYPE_INT64, 2, 2),
                u = T(DTYPE_UINT8, 2), s = T0(DTYPE_FLOAT64), two = T(DTYPE_INT64, 2);
  res_t r = RUN("index_select", vt(&x), vi(0), vt(&l));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT32, 4, 3);
  r = RUN("index_select", vt(&x), vi(-1), vt(&i));
  SHAPE(r, 0, DTYPE_FLOAT32, 5, 2);
  r = RUN("index_select", vt(&x), vi(1), vt(&l0));
  SHAPE(r, 0, DTYPE_FLOAT32, 5, 1);
  r = RUN("index_select", vt(&s), vi(0), vt(&l0));
  SHAPE0(r, 0, DTYPE_FLOAT64);
  r = RUN("index_select", vt(&x), vi(0), vt(&f));
  ERR(r, DTYPE_MISMATCH, "index_select", "argument 'index'");
  HAS(r, "float32");
  r = RUN("index_select", vt(&x), vi(0), vt(&u));
  ERR(r, DTYPE_MISMATCH, "index_select", "argument 'index'");
  r = RUN("index_select", vt(&x), vi(0), vt(&m));
  ERR(r, SHAPE_MISMATCH, "index_select", "argument 'index'");
  r = RUN("index_select", vt(&x), vi(2), vt(&l));
  ERR(r, BAD_DIM, "index_select", "argument 'dim'");
  r = RUN("index_select", vt(&s), vi(0), vt(&two));
  ERR(r, SHAPE_MISMATCH, "index_select", "argument 'index'");
  r = RUN("index_select", vt(&x), vi(0), VI(1, 2));
  ERR(r, BAD_ARGUMENT, "index_select", "argument 'index' must be a Tensor");
}

Test(indexing, gather) {
  tensor_meta_t x = T(DTYPE_FLOAT16, 3, 4), idx = T(DTYPE_INT64, 3, 2), wide = T(DTYPE_INT64, 2, 10),
                tall = T(DTYPE_INT64, 4, 2), i32 = T(DTYPE_INT32, 3, 2), flat = T(DTYPE_INT64, 3),
                empty = T(DTYPE_FLOAT32, 0);
  res_t r = RUN("gather", vt(&x), vi(1), vt(&idx));
  FRESH(r);
  SHAPE(r, 0, DTYPE_FLOAT16, 3, 2);
  r = RUN("gather", vt(&x), vi(1), vt(&wide)); /* the gathered dim may be larger */
  SHAPE(r, 0, DTYPE_FLOAT16, 2, 10);
  r = RUN("gather", vt(&x), vi(0), vt(&empty)); /* empty index: no checks, like torch */
  SHAPE(r, 0, DTYPE_FLOAT16, 0);
  r = RUN("gather", vt(&x), vi(1), vt(&tall));
  ERR(r, SHAPE_MISMATCH, "gather", "argument 'index'");
  HAS(r, "at dim 0");
  r = RUN("gather", vt(&x), vi(1), vt(&i32));
  ERR(r, DTYPE_MISMATCH, "gather", "argument 'index'");
  HAS(r, "int32");
  r = RUN("gather", vt(&x), vi(1), vt(&flat));
  ERR(r, SHAPE_MISMATCH, "gather", "argument 'index'");
  HAS(r, "as many dims");
  r = RUN("gather", vt(&x), vi(2), vt(&idx));
  ERR(r, BAD_DIM, "gather", "argument 'dim'");
  r = RUN("gather", vt(&x), vi(1), vt(&idx), vb(false));
  ERR(r, BAD_ARGUMENT, "gather", "positional");
}

/* ================= in place ================= */

Test(inplace, arithmetic_keeps_self) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 2, 3), row = T(DTYPE_FLOAT32, 3), i = T(DTYPE_INT32, 2, 3),
                l = T(DTYPE_INT64, 3);
  int64_t sz[2] = {2, 3}, st[2] = {1, 2};
  tensor_meta_t tr = strided(DTYPE_FLOAT32, 2, sz, st, 6);
  res_t r = RUN("add_", vt(&f), vt(&row));
  INPLACE(r, &f);
  r = run("add_", A(vt(&tr), vi(1)), K({"alpha", vf(0.5)})); /* strides and offset kept */
  INPLACE(r, &tr);
  r = run("sub_", A(vt(&f), vt(&row)), K({"alpha", vi(2)}));
  INPLACE(r, &f);
  r = RUN("mul_", vt(&i), vi(2));
  INPLACE(r, &i);
  r = RUN("add_", vt(&i), vt(&l)); /* int64 result casts into int32 */
  INPLACE(r, &i);
  r = RUN("div_", vt(&f), vi(2));
  INPLACE(r, &f);
  r = run("div_", A(vt(&i), vi(2)), K({"rounding_mode", vs("floor")}));
  INPLACE(r, &i);
}

Test(inplace, arithmetic_misuse) {
  tensor_meta_t f = T(DTYPE_FLOAT32, 3), big = T(DTYPE_FLOAT32, 2, 3), l = T(DTYPE_INT64, 2, 3),
                b = T(DTYPE_BOOL, 3), one = T(DTYPE_FLOAT32, 1, 3), l4 = T(DTYPE_INT64, 4);
  res_t r = RUN("add_", vt(&l), vf(1.5));
  ERR(r, DTYPE_MISMATCH, "add_", "'self'");
  cr_assert(strncmp(r.e.msg, "add_: result type float32 can't be cast to the desired output type int64",
                    strlen("add_: result type float32 can't be cast to the desired output type int64")) == 0,
            "%s", r.e.msg);
  r = RUN("div_", vt(&l), vi(2)); /* true division gives float32 */
  ERR(r, DTYPE_MISMATCH, "div_", "'self'");
  HAS(r, "float32");
  r = RUN("mul_", vt(&l), vt(&big));
  ERR(r, DTYPE_MISMATCH, "mul_", "'self'");
  r = RUN("add_", vt(&b), vi(1));
  ERR(r, DTYPE_MISMATCH, "add_", "output type bool");
  r = RUN("sub_", vt(&b), vt(&b));
  ERR(r, DTYPE_MISMATCH, "sub_", "self is bool tensor");
  const char *ops[] = {"add_", "sub_", "mul_", "div_"};
  tensor_meta_t exp = strided(DTYPE_FLOAT32, 2, (int64_t[]){2, 3}, (int64_t[]){0, 1}, 0);
  for (int k = 0; k < 4; k++) {
    r = RUN(ops[k], vt(&f), vt(&big)); /* self can't grow */
    ERR(r, SHAPE_MISMATCH, ops[k], "argument 'self' has shape [3] but the broadcast shape is [2, 3]");
    r = RUN(ops[k], vt(&one), vt(&big));
    ERR(r, SHAPE_MISMATCH, ops[k], "argument 'self'");
    r = RUN(ops[k], vt(&exp), vi(1)); /* an expanded self has aliased elements */
    ERR(r, BAD_ARGUMENT, ops[k], "argument 'self'");
    HAS(r, "clone()");
    r = RUN(ops[k], vt(&f), vt(&l4));
    ERR(r, SHAPE_MISMATCH, ops[k], "self [3] and other [4]");
    r = RUN(ops[k], vi(1), vi(2));
    ERR(r, BAD_ARGUMENT, ops[k], "argument 'self' must be a Tensor");
  }
}

Test(inplace, copy_) {
  tensor_meta_t i = T(DTYPE_INT32, 2, 3), d = T(DTYPE_FLOAT64, 3), big = T(DTYPE_FLOAT32, 2, 3),
                small = T(DTYPE_FLOAT32, 3), bad = T(DTYPE_FLOAT32, 4);
  res_t r = RUN("copy_", vt(&i), vt(&d)); /* any dtype, broadcast into self */
  INPLACE(r, &i);
  r = run("copy_", A(vt(&i), vt(&d)), K({"non_blocking", vb(true)}));
  INPLACE(r, &i);
  r = RUN("copy_", vt(&small), vt(&big));
  ERR(r, SHAPE_MISMATCH, "copy_", "argument 'self' has shape [3] but the broadcast shape is [2, 3]");
  r = RUN("copy_", vt(&i), vt(&bad));
  ERR(r, SHAPE_MISMATCH, "copy_", "src [4]");
  tensor_meta_t exp = strided(DTYPE_FLOAT32, 2, (int64_t[]){2, 3}, (int64_t[]){0, 1}, 0);
  r = RUN("copy_", vt(&exp), vt(&big));
  ERR(r, BAD_ARGUMENT, "copy_", "argument 'self'");
  r = RUN("copy_", vt(&i), vi(1));
  ERR(r, BAD_ARGUMENT, "copy_", "argument 'src' must be a Tensor");
}

Test(inplace, fill_and_zero_) {
  tensor_meta_t i = T(DTYPE_INT32, 2, 3), u = T(DTYPE_UINT8, 2), f = T(DTYPE_FLOAT32, 2),
                f0 = T0(DTYPE_FLOAT64), v = T(DTYPE_FLOAT32, 3);
  tensor_meta_t exp = strided(DTYPE_FLOAT32, 2, (int64_t[]){2, 3}, (int64_t[]){0, 1}, 0);
  res_t r = RUN("fill_", vt(&i), vi(5));
  INPLACE(r, &i);
  r = RUN("fill_", vt(&i), vf(1.5));
  INPLACE(r, &i);
  r = RUN("fill_", vt(&f), vt(&f0));
  INPLACE(r, &f);
  r = RUN("fill_", vt(&exp), vi(1)); /* filling is idempotent: overlap is fine */
  INPLACE(r, &exp);
  r = RUN("fill_", vt(&u), vi(300));
  ERR(r, BAD_ARGUMENT, "fill_", "argument 'value'");
  HAS(r, "uint8");
  r = RUN("fill_", vt(&f), vt(&v));
  ERR(r, SHAPE_MISMATCH, "fill_", "argument 'value'");
  HAS(r, "[3]");
  r = RUN("fill_", vt(&f));
  ERR(r, BAD_ARGUMENT, "fill_", "missing argument 'value'");
  r = RUN("zero_", vt(&i));
  INPLACE(r, &i);
  r = RUN("zero_", vt(&exp));
  INPLACE(r, &exp);
  r = RUN("zero_", vt(&i), vi(0));
  ERR(r, BAD_ARGUMENT, "zero_", "positional");
  r = RUN("zero_", vf(0));
  ERR(r, BAD_ARGUMENT, "zero_", "argument 'self'");
}

Test(inplace, clamp_) {
  tensor_meta_t i = T(DTYPE_INT32, 2, 3), f = T(DTYPE_FLOAT32, 3), big = T(DTYPE_FLOAT32, 2, 3),
                b = T(DTYPE_BOOL, 2);
  res_t r = RUN("clamp_", vt(&i), vi(0), vi(5));
  INPLACE(r, &i);
  r = run("clamp_", A(vt(&f)), K({"max", vt(&f)}));
  INPLACE(r, &f);
  r = RUN("clamp_", vt(&i), vf(0.5));
  ERR(r, DTYPE_MISMATCH, "clamp_", "result type float32 can't be cast to the desired output type int32");
  r = RUN("clamp_", vt(&b), vi(0), vi(1));
  ERR(r, DTYPE_MISMATCH, "clamp_", "output type bool");
  r = RUN("clamp_", vt(&f), vt(&big));
  ERR(r, SHAPE_MISMATCH, "clamp_", "argument 'self' has shape [3]");
  r = RUN("clamp_", vt(&f));
  ERR(r, BAD_ARGUMENT, "clamp_", "'min'");
  tensor_meta_t exp = strided(DTYPE_FLOAT32, 2, (int64_t[]){2, 3}, (int64_t[]){0, 1}, 0);
  r = RUN("clamp_", vt(&exp), vi(0));
  ERR(r, BAD_ARGUMENT, "clamp_", "argument 'self'");
}
