/* The catalogue table, its schema parser and the argument binder. */
#include "ops.h"

#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops_internal.h"

/* `r` names a rule of ops_internal.h without its ops__ prefix. */
#define OP(s, r, v) {.schema = (s), .rule = ops__##r, .variant = (v)}

static op_def_t table[] = {
    /* factories */
    OP("empty(int[] size, *, ScalarType? dtype=None) -> Tensor", rule_filled, 0),
    OP("zeros(int[] size, *, ScalarType? dtype=None) -> Tensor", rule_filled, 0),
    OP("ones(int[] size, *, ScalarType? dtype=None) -> Tensor", rule_filled, 0),
    OP("full(int[] size, Scalar fill_value, *, ScalarType? dtype=None) -> Tensor", rule_full, 0),
    OP("arange(Scalar start, Scalar? end=None, Scalar step=1, *, ScalarType? dtype=None) -> Tensor",
       rule_arange, 0),
    OP("rand(int[] size, *, ScalarType? dtype=None, int? seed=None) -> Tensor", rule_rand,
       RAND_UNIFORM),
    OP("randn(int[] size, *, ScalarType? dtype=None, int? seed=None) -> Tensor", rule_rand,
       RAND_NORMAL),
    OP("rank(str dim) -> Tensor", rule_rank, 0),
    /* elementwise binary */
    OP("add(Tensor self, Tensor|Scalar other, *, Scalar alpha=1) -> Tensor", rule_binary, BIN_ADD),
    OP("sub(Tensor self, Tensor|Scalar other, *, Scalar alpha=1) -> Tensor", rule_binary, BIN_SUB),
    OP("mul(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_MUL),
    OP("div(Tensor self, Tensor|Scalar other, *, str? rounding_mode=None) -> Tensor", rule_binary,
       BIN_DIV),
    OP("pow(Tensor self, Tensor|Scalar exponent) -> Tensor", rule_binary, BIN_POW),
    OP("maximum(Tensor self, Tensor other) -> Tensor", rule_binary, BIN_MAXMIN),
    OP("minimum(Tensor self, Tensor other) -> Tensor", rule_binary, BIN_MAXMIN),
    OP("eq(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_COMPARE),
    OP("ne(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_COMPARE),
    OP("lt(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_COMPARE),
    OP("le(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_COMPARE),
    OP("gt(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_COMPARE),
    OP("ge(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_COMPARE),
    OP("logical_and(Tensor self, Tensor other) -> Tensor", rule_binary, BIN_LOGICAL),
    OP("logical_or(Tensor self, Tensor other) -> Tensor", rule_binary, BIN_LOGICAL),
    OP("bitwise_and(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_BITWISE),
    OP("bitwise_or(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_BITWISE),
    OP("bitwise_xor(Tensor self, Tensor|Scalar other) -> Tensor", rule_binary, BIN_BITWISE),
    /* elementwise unary */
    OP("neg(Tensor self) -> Tensor", rule_unary, UN_NEG),
    OP("abs(Tensor self) -> Tensor", rule_unary, UN_ABS),
    OP("exp(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("log(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("sqrt(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("rsqrt(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("sin(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("cos(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("tanh(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("sigmoid(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("reciprocal(Tensor self) -> Tensor", rule_unary, UN_TO_FLOAT),
    OP("relu(Tensor self) -> Tensor", rule_unary, UN_RELU),
    OP("gelu(Tensor self, *, str approximate='none') -> Tensor", rule_unary, UN_FLOAT_ONLY),
    OP("silu(Tensor self) -> Tensor", rule_unary, UN_FLOAT_ONLY),
    OP("sign(Tensor self) -> Tensor", rule_unary, UN_SIGN),
    OP("logical_not(Tensor self) -> Tensor", rule_unary, UN_LOGICAL_NOT),
    /* reductions */
    OP("sum(Tensor self, int[]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
       rule_reduce, RED_SUM),
    OP("mean(Tensor self, int[]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
       rule_reduce, RED_MEAN),
    OP("prod(Tensor self, int? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
       rule_reduce, RED_PROD),
    OP("max(Tensor self, int? dim=None, bool keepdim=False) -> Tensor | (Tensor values, Tensor "
       "indices)",
       rule_reduce, RED_MAXMIN),
    OP("min(Tensor self, int? dim=None, bool keepdim=False) -> Tensor | (Tensor values, Tensor "
       "indices)",
       rule_reduce, RED_MAXMIN),
    OP("amax(Tensor self, int[] dim=[], bool keepdim=False) -> Tensor", rule_reduce, RED_AMAXMIN),
    OP("amin(Tensor self, int[] dim=[], bool keepdim=False) -> Tensor", rule_reduce, RED_AMAXMIN),
    OP("argmax(Tensor self, int? dim=None, bool keepdim=False) -> Tensor", rule_reduce, RED_ARG),
    OP("argmin(Tensor self, int? dim=None, bool keepdim=False) -> Tensor", rule_reduce, RED_ARG),
    OP("softmax(Tensor self, int dim, ScalarType? dtype=None) -> Tensor", rule_softmax, 0),
    OP("log_softmax(Tensor self, int dim, ScalarType? dtype=None) -> Tensor", rule_softmax, 0),
    /* linear algebra */
    OP("matmul(Tensor self, Tensor other) -> Tensor", rule_matmul, 0),
    OP("mm(Tensor self, Tensor mat2) -> Tensor", rule_mm, 0),
    OP("bmm(Tensor self, Tensor mat2) -> Tensor", rule_bmm, 0),
    /* views */
    OP("view(Tensor(a) self, int[] size) -> Tensor(a)", rule_view, 0),
    OP("reshape(Tensor(a) self, int[] shape) -> Tensor(a)", rule_reshape, 0),
    OP("transpose(Tensor(a) self, int dim0, int dim1) -> Tensor(a)", rule_transpose, 0),
    OP("t(Tensor(a) self) -> Tensor(a)", rule_t, 0),
    OP("permute(Tensor(a) self, int[] dims) -> Tensor(a)", rule_permute, 0),
    OP("select(Tensor(a) self, int dim, int index) -> Tensor(a)", rule_select, 0),
    OP("narrow(Tensor(a) self, int dim, int start, int length) -> Tensor(a)", rule_narrow, 0),
    OP("slice(Tensor(a) self, int dim=0, int? start=None, int? end=None, int step=1) -> Tensor(a)",
       rule_slice, 0),
    OP("unsqueeze(Tensor(a) self, int dim) -> Tensor(a)", rule_unsqueeze, 0),
    OP("squeeze(Tensor(a) self, int[]? dim=None) -> Tensor(a)", rule_squeeze, 0),
    OP("expand(Tensor(a) self, int[] size, *, bool implicit=False) -> Tensor(a)", rule_expand, 0),
    /* copies */
    OP("clone(Tensor self) -> Tensor", rule_clone, 0),
    OP("contiguous(Tensor(a) self) -> Tensor(a)", rule_contiguous, 0),
    OP("cat(Tensor[] tensors, int dim=0) -> Tensor", rule_cat, 0),
    OP("stack(Tensor[] tensors, int dim=0) -> Tensor", rule_stack, 0),
    OP("to(Tensor(a) self, ScalarType dtype, bool non_blocking=False, bool copy=False) -> Tensor(a)",
       rule_to, TO_TO),
    OP("cast(Tensor self, ScalarType dtype) -> Tensor", rule_to, TO_CAST),
    /* indexing and selection */
    OP("index_select(Tensor self, int dim, Tensor index) -> Tensor", rule_index_select, 0),
    OP("gather(Tensor self, int dim, Tensor index, *, bool sparse_grad=False) -> Tensor",
       rule_gather, 0),
    OP("where(Tensor condition, Tensor|Scalar self, Tensor|Scalar other) -> Tensor", rule_where, 0),
    OP("clamp(Tensor self, Tensor|Scalar? min=None, Tensor|Scalar? max=None) -> Tensor", rule_clamp,
       0),
    /* in place */
    OP("add_(Tensor(a!) self, Tensor|Scalar other, *, Scalar alpha=1) -> Tensor(a!)", rule_binary,
       BIN_ADD),
    OP("sub_(Tensor(a!) self, Tensor|Scalar other, *, Scalar alpha=1) -> Tensor(a!)", rule_binary,
       BIN_SUB),
    OP("mul_(Tensor(a!) self, Tensor|Scalar other) -> Tensor(a!)", rule_binary, BIN_MUL),
    OP("div_(Tensor(a!) self, Tensor|Scalar other, *, str? rounding_mode=None) -> Tensor(a!)",
       rule_binary, BIN_DIV),
    OP("copy_(Tensor(a!) self, Tensor src, bool non_blocking=False) -> Tensor(a!)", rule_copy_, 0),
    OP("fill_(Tensor(a!) self, Tensor|Scalar value) -> Tensor(a!)", rule_fill_, 0),
    OP("zero_(Tensor(a!) self) -> Tensor(a!)", rule_zero_, 0),
    OP("clamp_(Tensor(a!) self, Tensor|Scalar? min=None, Tensor|Scalar? max=None) -> Tensor(a!)",
       rule_clamp, 0),
};
#define NOPS (sizeof table / sizeof table[0])

/* ---- schema parsing (once, at first use) ---- */

static const char *skip_ws(const char *p) {
  while (*p == ' ') p++;
  return p;
}

/* Copies a type or name token ([A-Za-z0-9_|[]?]) into buf, dropping an alias
 * annotation such as the "(a!)" of "Tensor(a!)". */
static const char *read_token(const char *p, char *buf, size_t n) {
  size_t k = 0;
  p = skip_ws(p);
  while (*p && (isalnum((unsigned char)*p) || strchr("_|[]?(", *p))) {
    if (*p == '(') {
      if (!k) break;
      while (*p && *p != ')') p++;
      if (*p) p++;
      continue;
    }
    if (k + 1 < n) buf[k++] = *p;
    p++;
  }
  buf[k] = 0;
  return p;
}

static int parse_type(const char *t, op_param_t *p) {
  char base[OP_NAME_MAX];
  snprintf(base, sizeof base, "%s", t);
  size_t n = strlen(base);
  if (n && base[n - 1] == '?') {
    p->optional = true;
    base[--n] = 0;
  }
  static const struct {
    const char *name;
    param_type_t type;
  } types[] = {
      {"Tensor", PARAM_TENSOR}, {"Tensor[]", PARAM_TENSORS}, {"Scalar", PARAM_SCALAR},
      {"Tensor|Scalar", PARAM_TENSOR_OR_SCALAR}, {"int", PARAM_INT}, {"int[]", PARAM_INTS},
      {"float", PARAM_FLOAT}, {"bool", PARAM_BOOL}, {"ScalarType", PARAM_DTYPE},
      {"str", PARAM_STRING},
  };
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
    if (strcmp(base, types[i].name) == 0) {
      p->type = types[i].type;
      return 0;
    }
  return -1;
}

static int parse_default(const char *s, op_param_t *p) {
  op_value_t *v = &p->def;
  p->has_default = true;
  if (strcmp(s, "None") == 0) {
    v->kind = VAL_NONE;
    return p->optional ? 0 : -1;
  }
  if (strcmp(s, "True") == 0 || strcmp(s, "False") == 0) {
    v->kind = VAL_BOOL;
    v->b = s[0] == 'T';
    return 0;
  }
  if (s[0] == '\'') {
    size_t n = strlen(s);
    if (n < 2 || s[n - 1] != '\'' || n - 2 >= sizeof p->def_str) return -1;
    memcpy(p->def_str, s + 1, n - 2);
    p->def_str[n - 2] = 0;
    v->kind = VAL_STRING;
    v->s = p->def_str;
    return 0;
  }
  if (s[0] == '[') {
    const char *q = s + 1;
    v->kind = VAL_INTS;
    v->ints = p->def_ints;
    v->nints = 0;
    while (*(q = skip_ws(q)) && *q != ']') {
      char *end;
      if (v->nints == LAYOUT_MAX_DIMS) return -1;
      p->def_ints[v->nints++] = strtoll(q, &end, 10);
      if (end == q) return -1;
      q = skip_ws(end);
      if (*q == ',') q++;
    }
    return *q == ']' ? 0 : -1;
  }
  if (dtype_parse(s) != DTYPE_INVALID) {
    v->kind = VAL_DTYPE;
    v->dtype = dtype_parse(s);
    return 0;
  }
  char *end;
  if (strpbrk(s, ".e")) {
    v->kind = VAL_FLOAT;
    v->f = strtod(s, &end);
  } else {
    v->kind = VAL_INT;
    v->i = strtoll(s, &end, 10);
  }
  return *end ? -1 : 0;
}

static int parse_schema(op_def_t *op) {
  const char *p = op->schema, *open = strchr(p, '(');
  if (!open || (size_t)(open - p) >= sizeof op->name) return -1;
  memcpy(op->name, p, (size_t)(open - p));
  op->name[open - p] = 0;
  p = open + 1;
  bool kwonly = false, has_tensor = false;
  while (*(p = skip_ws(p)) != ')') {
    if (*p == '*') {
      kwonly = true;
      p = skip_ws(p + 1);
      if (*p == ',') p++;
      continue;
    }
    if (op->nparams == OP_MAX_PARAMS) return -1;
    op_param_t *prm = &op->params[op->nparams++];
    char type[OP_NAME_MAX], def[OP_NAME_MAX];
    p = read_token(p, type, sizeof type);
    p = read_token(p, prm->name, sizeof prm->name);
    if (!prm->name[0] || parse_type(type, prm)) return -1;
    prm->kwonly = kwonly;
    if (prm->type == PARAM_TENSOR || prm->type == PARAM_TENSORS ||
        prm->type == PARAM_TENSOR_OR_SCALAR)
      has_tensor = true;
    p = skip_ws(p);
    if (*p == '=') {
      size_t k = 0;
      p = skip_ws(p + 1);
      while (*p && *p != ',' && *p != ')' && k + 1 < sizeof def) {
        if (*p == '[')
          while (*p && *p != ']' && k + 1 < sizeof def) def[k++] = *p++;
        def[k++] = *p++;
      }
      while (k && def[k - 1] == ' ') k--;
      def[k] = 0;
      if (parse_default(def, prm)) return -1;
    } else if (prm->optional) {
      return -1; /* every optional parameter spells its default */
    }
    p = skip_ws(p);
    if (*p == ',') p++;
    else if (*p != ')') return -1;
  }
  const char *ret = strstr(p, "->");
  if (!ret) return -1;
  op->is_inplace = strstr(ret, "(a!)") != NULL;
  op->is_view = !op->is_inplace && strstr(ret, "(a)") != NULL;
  op->is_factory = !has_tensor;
  return 0;
}

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void build_table(void) {
  for (size_t i = 0; i < NOPS; i++) {
    table[i].id = (int)i;
    if (parse_schema(&table[i])) {
      /* A typo in the table above: fail loudly at the first use, in every test. */
      fprintf(stderr, "ops: bad schema in the catalogue: %s\n", table[i].schema);
      abort();
    }
  }
}

const op_def_t *ops_find(const char *name) {
  pthread_once(&once, build_table);
  if (!name) return NULL;
  for (size_t i = 0; i < NOPS; i++)
    if (strcmp(table[i].name, name) == 0) return &table[i];
  return NULL;
}

size_t ops_count(void) { return NOPS; }

const op_def_t *ops_at(size_t id) {
  pthread_once(&once, build_table);
  return id < NOPS ? &table[id] : NULL;
}

const char *op_name(const op_def_t *op) { return op->name; }
const char *op_schema(const op_def_t *op) { return op->schema; }
int op_id(const op_def_t *op) { return op->id; }

int op_param_index(const op_def_t *op, const char *name) {
  for (int i = 0; i < op->nparams; i++)
    if (strcmp(op->params[i].name, name) == 0) return i;
  return -1;
}

bool op_value_ints(const op_value_t *v, const int64_t **ints, size_t *n) {
  if (v->kind == VAL_INTS) {
    *ints = v->ints;
    *n = v->nints;
    return true;
  }
  if (v->kind == VAL_INT) {
    *ints = &v->i;
    *n = 1;
    return true;
  }
  return false;
}

/* ---- binding ---- */

static const char *type_desc(const op_param_t *p) {
  static const char *const desc[] = {
      [PARAM_TENSOR] = "Tensor",       [PARAM_TENSORS] = "list of Tensors",
      [PARAM_SCALAR] = "Scalar",       [PARAM_TENSOR_OR_SCALAR] = "Tensor or Scalar",
      [PARAM_INT] = "int",             [PARAM_INTS] = "int or int list",
      [PARAM_FLOAT] = "float",         [PARAM_BOOL] = "bool",
      [PARAM_DTYPE] = "dtype",         [PARAM_STRING] = "str",
  };
  return desc[p->type];
}

static const char *kind_desc(value_kind_t k) {
  switch (k) {
  case VAL_NONE: return "None";
  case VAL_TENSOR: return "Tensor";
  case VAL_TENSORS: return "list of Tensors";
  case VAL_INT: return "int";
  case VAL_FLOAT: return "float";
  case VAL_BOOL: return "bool";
  case VAL_INTS: return "int list";
  case VAL_DTYPE: return "dtype";
  case VAL_STRING: return "str";
  }
  return "unknown value";
}

static int check_tensor_meta(const op_def_t *op, const op_param_t *p, const tensor_meta_t *t,
                             meshd_error_t *e) {
  if (t && dtype_valid(t->dtype) &&
      layout_check_shape(NULL, t->layout.sizes, t->layout.ndim, dtype_size(t->dtype), e) == 0)
    return 0; /* the common case: no message, so no need to format its context */
  char ctx[OP_NAME_MAX * 3];
  snprintf(ctx, sizeof ctx, "%s: argument '%s'", op->name, p->name);
  if (!t) return error_set(e, ERR_BAD_ARGUMENT, "%s: tensor is missing", ctx);
  if (!dtype_valid(t->dtype))
    return error_set(e, ERR_BAD_ARGUMENT, "%s: tensor has invalid dtype %d", ctx, (int)t->dtype);
  return layout_check_shape(ctx, t->layout.sizes, t->layout.ndim, dtype_size(t->dtype), e);
}

/* Checks `in` against parameter p and stores the bound value in *out. */
static int bind_value(const op_def_t *op, const op_param_t *p, const op_value_t *in,
                      op_value_t *out, meshd_error_t *e) {
  *out = *in;
  bool ok = false;
  switch (in->kind) {
  case VAL_NONE: ok = p->optional; break;
  case VAL_TENSOR:
    ok = p->type == PARAM_TENSOR || p->type == PARAM_TENSOR_OR_SCALAR;
    if (ok && check_tensor_meta(op, p, in->tensor, e)) return -1;
    break;
  case VAL_TENSORS:
    ok = p->type == PARAM_TENSORS;
    if (ok && in->ntensors && !in->tensors) return check_tensor_meta(op, p, NULL, e);
    for (size_t i = 0; ok && i < in->ntensors; i++)
      if (check_tensor_meta(op, p, in->tensors[i], e)) return -1;
    break;
  case VAL_INT:
    ok = p->type == PARAM_INT || p->type == PARAM_INTS || p->type == PARAM_SCALAR ||
         p->type == PARAM_TENSOR_OR_SCALAR || p->type == PARAM_FLOAT;
    break;
  case VAL_FLOAT:
  case VAL_BOOL:
    ok = p->type == PARAM_SCALAR || p->type == PARAM_TENSOR_OR_SCALAR ||
         (in->kind == VAL_FLOAT ? p->type == PARAM_FLOAT : p->type == PARAM_BOOL);
    break;
  case VAL_INTS:
    ok = p->type == PARAM_INTS && (in->ints || !in->nints);
    break;
  case VAL_DTYPE:
    ok = p->type == PARAM_DTYPE;
    if (ok && in->dtype == DTYPE_INVALID && p->optional) {
      out->kind = VAL_NONE;
    } else if (ok && !dtype_valid(in->dtype)) {
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: argument '%s' is dtype value %d, which is not a dtype (expected "
                       "1..10, e.g. float32)",
                       op->name, p->name, (int)in->dtype);
    }
    break;
  case VAL_STRING:
    ok = (p->type == PARAM_STRING || p->type == PARAM_DTYPE) && in->s;
    if (ok && p->type == PARAM_DTYPE) {
      out->kind = VAL_DTYPE;
      out->dtype = dtype_parse(in->s);
      if (out->dtype == DTYPE_INVALID)
        return error_set(e, ERR_BAD_ARGUMENT,
                         "%s: argument '%s': unknown dtype '%s' (expected float32, float64, "
                         "float16, bfloat16, int8, uint8, int16, int32, int64 or bool)",
                         op->name, p->name, in->s);
    }
    break;
  }
  if (!ok)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: argument '%s' must be a%s %s%s, got %s", op->name,
                     p->name, strchr("AEIOUaeiou", type_desc(p)[0]) ? "n" : "", type_desc(p),
                     p->optional ? " or None" : "", kind_desc(in->kind));
  return 0;
}

/* Keywords people reach for from numpy or other torch functions. */
static const char *suggest(const op_def_t *op, const char *name) {
  static const char *const aliases[][2] = {
      {"axis", "dim"},        {"axes", "dim"},          {"dims", "dim"},
      {"dim", "dims"},        {"keepdims", "keepdim"},  {"keep_dim", "keepdim"},
      {"input", "self"},      {"x", "self"},            {"shape", "size"},
      {"size", "shape"},      {"value", "fill_value"},  {"fill_value", "value"},
      {"other", "exponent"},  {"exponent", "other"},    {"other", "mat2"},
      {"mat2", "other"},      {"a_min", "min"},         {"a_max", "max"},
      {"type", "dtype"},      {"cond", "condition"},    {"mask", "condition"},
      {"approx", "approximate"}, {"rounding", "rounding_mode"}, {"indices", "index"},
      {"tensor", "tensors"},  {"alpha", "other"},
  };
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
    if (strcmp(name, aliases[i][0]) == 0 && op_param_index(op, aliases[i][1]) >= 0)
      return aliases[i][1];
  return NULL;
}

static int unknown_keyword(const op_def_t *op, const char *name, meshd_error_t *e) {
  const char *s = suggest(op, name);
  if (s)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: unknown keyword argument '%s'; did you mean '%s'?",
                     op->name, name, s);
  char list[OP_MAX_PARAMS * (OP_NAME_MAX + 2)] = "";
  size_t at = 0;
  for (int i = 0; i < op->nparams && at < sizeof list; i++)
    at += (size_t)snprintf(list + at, sizeof list - at, "%s%s", i ? ", " : "", op->params[i].name);
  return error_set(e, ERR_BAD_ARGUMENT, "%s: unknown keyword argument '%s' (%s takes %s)",
                   op->name, name, op->name, op->nparams ? list : "no arguments");
}

int ops_bind(const op_def_t *op, const op_value_t *args, size_t nargs, const op_kwarg_t *kwargs,
             size_t nkwargs, op_args_t *out, meshd_error_t *e) {
  if (!op) return error_set(e, ERR_UNKNOWN_OP, "ops_bind: no op");
  memset(out, 0, sizeof *out);
  out->op = op;
  out->nparams = op->nparams;
  bool set[OP_MAX_PARAMS] = {false};
  size_t npos = 0;
  while (npos < (size_t)op->nparams && !op->params[npos].kwonly) npos++;
  if (nargs > npos)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: takes %zu positional argument%s but %zu were given%s", op->name, npos,
                     npos == 1 ? "" : "s", nargs,
                     npos < (size_t)op->nparams ? " (the rest are keyword-only)" : "");
  for (size_t i = 0; i < nargs; i++) {
    if (bind_value(op, &op->params[i], &args[i], &out->v[i], e)) return -1;
    set[i] = true;
  }
  for (size_t k = 0; k < nkwargs; k++) {
    const char *name = kwargs[k].name ? kwargs[k].name : "";
    int i = op_param_index(op, name);
    if (i < 0) return unknown_keyword(op, name, e);
    if (set[i])
      return error_set(e, ERR_BAD_ARGUMENT, "%s: got multiple values for argument '%s'", op->name,
                       name);
    if (bind_value(op, &op->params[i], &kwargs[k].value, &out->v[i], e)) return -1;
    set[i] = true;
  }
  for (int i = 0; i < op->nparams; i++) {
    if (set[i]) continue;
    const op_param_t *p = &op->params[i];
    if (!p->has_default)
      return error_set(e, ERR_BAD_ARGUMENT, "%s: missing argument '%s' (expected %s)", op->name,
                       p->name, type_desc(p));
    out->v[i] = p->def;
  }
  return 0;
}

int ops_infer(const op_args_t *a, op_infer_t *out, meshd_error_t *e) {
  memset(out, 0, sizeof *out);
  if (!a || !a->op || a->nparams != a->op->nparams)
    return error_set(e, ERR_BAD_ARGUMENT, "ops_infer: arguments were not bound by ops_bind");
  if (a->op->rule(a, out, e)) return -1;
  for (int i = 0; i < out->nresults; i++) {
    const tensor_meta_t *m = &out->results[i].meta;
    if (layout_check_shape(NULL, m->layout.sizes, m->layout.ndim, dtype_size(m->dtype), e) == 0)
      continue;
    char ctx[OP_NAME_MAX + 16]; /* again, for the message */
    snprintf(ctx, sizeof ctx, "%s: result", a->op->name);
    layout_check_shape(ctx, m->layout.sizes, m->layout.ndim, dtype_size(m->dtype), e);
    return -1;
  }
  return 0;
}
