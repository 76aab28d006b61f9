/* Fuzz target: the op catalogue's binder and shape rules (core/tensor/ops*.c)
 * with arbitrary arguments, as the server (commands.c) and the agents
 * (agent/run.c) use them.
 *
 * The first byte picks the form of the input:
 *   even: built from the bytes: an op chosen by a byte out of every op in the
 *         catalogue, some tensors (valid layouts: contiguous, or strided views
 *         that stay inside a storage), then Arg and Kwarg messages of every
 *         kind (refs, ref lists, ints, floats, bools, int lists, dtypes,
 *         strings, None);
 *   odd:  the rest is a serialized meshd.v1.Call (protobuf), decoded as the
 *         server decodes it; its refs name the fixed tensors below (ref r is
 *         tensor r-1, refs past them are unknown).
 * Either way the arguments are resolved as commands.c resolves them
 * (op_value_from_arg), bound (ops_bind) and inferred (ops_infer), twice, and
 * checked: refusals carry a kind and a message that starts with the op name;
 * accepted results have valid dtypes, fresh ones are contiguous, views stay
 * inside the storage of the tensor they alias and keep its dtype, in-place ops
 * write a tensor parameter and return it unchanged. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtype.h"
#include "fuzz_input.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "ops.h"

#define MAX_ARGS 16 /* as commands.c */
#define MAX_LIST 64
#define NFIXED 8
#define NGEN 4

typedef Meshd__V1__Arg arg_t;

/* Tensors a ref may name: the fixed ones, then any made from the input. */
static tensor_meta_t tensors[NFIXED + NGEN];
static size_t ntensors;

static void contiguous(tensor_meta_t *t, dtype_t dt, const int64_t *sizes, int ndim) {
  meshd_error_t e;
  memset(t, 0, sizeof *t);
  t->dtype = dt;
  FZ_CHECK(layout_contiguous(&t->layout, sizes, ndim, dtype_size(dt), NULL, &e) == 0, "%s", e.msg);
}

static void fixed_tensors(void) {
  contiguous(&tensors[0], DTYPE_FLOAT32, (int64_t[]){2, 3}, 2);
  contiguous(&tensors[1], DTYPE_FLOAT32, (int64_t[]){3}, 1);
  contiguous(&tensors[2], DTYPE_FLOAT32, NULL, 0);
  contiguous(&tensors[3], DTYPE_INT64, (int64_t[]){2, 3}, 2);
  contiguous(&tensors[4], DTYPE_BOOL, (int64_t[]){2, 1}, 2);
  contiguous(&tensors[5], DTYPE_FLOAT16, (int64_t[]){4, 2, 3}, 3);
  /* [3, 2] transposed view of a [2, 3] storage; and an expanded [2, 3] of a [3]. */
  tensors[6] = tensors[0];
  tensors[6].layout.sizes[0] = 3, tensors[6].layout.sizes[1] = 2;
  tensors[6].layout.strides[0] = 1, tensors[6].layout.strides[1] = 3;
  tensors[7] = tensors[0];
  tensors[7].layout.strides[0] = 0;
  ntensors = NFIXED;
}

/* Lowest and highest element a non-empty layout reaches (strides >= 0). */
static void extent(const layout_t *l, __int128 *lo, __int128 *hi) {
  *lo = *hi = l->offset;
  for (int i = 0; i < l->ndim; i++) {
    __int128 span = (__int128)(l->sizes[i] - 1) * l->strides[i];
    if (span < 0) *lo += span;
    else *hi += span;
  }
}

/* A tensor from the input: a valid shape, contiguous or a strided view whose
 * elements all lie inside 2^62 bytes (what the server and a checked agent
 * hold); the dtype is sometimes invalid. */
static void gen_tensor(fz_t *in, tensor_meta_t *t) {
  uint8_t dsel = fz_u8(in);
  dtype_t dt = dsel < 248 ? (dtype_t)(1 + dsel % 10) : (dtype_t)(dsel % 13);
  int64_t sizes[LAYOUT_MAX_DIMS];
  int ndim = fz_u8(in) < 240 ? (int)fz_range(in, 0, 4) : (int)fz_range(in, 0, LAYOUT_MAX_DIMS);
  for (int i = 0; i < ndim; i++) sizes[i] = fz_size(in);
  meshd_error_t e;
  memset(t, 0, sizeof *t);
  t->dtype = dt;
  size_t esz = dtype_size(dt) ? dtype_size(dt) : 1;
  if (layout_contiguous(&t->layout, sizes, ndim, esz, NULL, &e)) {
    t->layout.ndim = 0; /* a scalar rather than an invalid shape */
    return;
  }
  if (fz_u8(in) < 160) return;
  layout_t v = t->layout;
  v.offset = fz_range(in, 0, 64);
  for (int i = 0; i < ndim; i++) {
    uint8_t s = fz_u8(in);
    if (s < 64) v.strides[i] = 0;
    else if (s >= 192) v.strides[i] = s % 32;
    else if (__builtin_mul_overflow(v.strides[i], s % 4 + 1, &v.strides[i])) return;
  }
  __int128 lo, hi;
  extent(&v, &lo, &hi);
  if (layout_numel(&v) > 0 && lo >= 0 && (hi + 1) * (__int128)esz <= LAYOUT_MAX_BYTES)
    t->layout = v;
}

/* ------------------------------------------------------------------ building Args */

static const char *const strings[] = {
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
    "bool", "torch.float32", "float", "double", "half", "long", "int", "short", "floor", "trunc",
    "tanh", "none", "", "dim", "self"};

static double fz_double(fz_t *in) {
  static const double edges[] = {0.0, -0.0, 1.0, -1.0, 0.5, 2.5, 1e300, -1e300, 65504.0, 65505.0,
                                 3.5e38, 1e-310, 255.0, 256.0, 9.3e18, -9.3e18};
  uint8_t sel = fz_u8(in);
  if (sel < 128) return edges[sel % 16];
  if (sel < 192) return (double)fz_i64(in);
  if (sel < 200) return sel & 1 ? INFINITY : -INFINITY;
  if (sel < 208) return NAN;
  uint64_t bits = fz_u64_raw(in, 8);
  double d;
  memcpy(&d, &bits, sizeof d);
  return d;
}

/* Storage for the Arg messages of one input. */
typedef struct argbuf {
  arg_t args[MAX_ARGS + 2], kwvals[MAX_ARGS + 2];
  arg_t *argp[MAX_ARGS + 2];
  Meshd__V1__Kwarg kwargs[MAX_ARGS + 2], *kwp[MAX_ARGS + 2];
  Meshd__V1__IntList ints[2 * MAX_ARGS + 4];
  int64_t intvals[2 * MAX_ARGS + 4][LAYOUT_MAX_DIMS + 2];
  Meshd__V1__RefList refs[2 * MAX_ARGS + 4];
  uint64_t refvals[2 * MAX_ARGS + 4][MAX_LIST + 2];
  char strs[2 * MAX_ARGS + 4][40];
  size_t nints, nrefs, nstrs;
} argbuf_t;

static uint64_t gen_ref(fz_t *in) {
  uint8_t sel = fz_u8(in);
  if (sel < 240) return 1 + (uint64_t)(sel % (ntensors + 1)); /* one past the end: unknown */
  return fz_u64(in);
}

static void gen_arg(fz_t *in, argbuf_t *b, arg_t *a) {
  meshd__v1__arg__init(a);
  switch (fz_u8(in) % 11) {
  case 0:
  case 1:
    a->value_case = MESHD__V1__ARG__VALUE_REF;
    a->ref = gen_ref(in);
    break;
  case 2: {
    Meshd__V1__RefList *l = &b->refs[b->nrefs];
    uint64_t *v = b->refvals[b->nrefs++];
    meshd__v1__ref_list__init(l);
    l->n_refs = fz_u8(in) < 240 ? (size_t)fz_range(in, 0, 4) : (size_t)fz_range(in, 0, MAX_LIST + 1);
    for (size_t i = 0; i < l->n_refs; i++) v[i] = gen_ref(in);
    l->refs = v;
    a->value_case = MESHD__V1__ARG__VALUE_REFS;
    a->refs = l;
    break;
  }
  case 3:
    a->value_case = MESHD__V1__ARG__VALUE_I;
    a->i = fz_i64(in);
    break;
  case 4:
    a->value_case = MESHD__V1__ARG__VALUE_F;
    a->f = fz_double(in);
    break;
  case 5:
    a->value_case = MESHD__V1__ARG__VALUE_B;
    a->b = fz_bool(in);
    break;
  case 6:
  case 7: {
    Meshd__V1__IntList *l = &b->ints[b->nints];
    int64_t *v = b->intvals[b->nints++];
    meshd__v1__int_list__init(l);
    l->n_values = (size_t)fz_range(in, 0, LAYOUT_MAX_DIMS + 1);
    for (size_t i = 0; i < l->n_values; i++) v[i] = fz_bool(in) ? fz_size(in) : fz_i64(in);
    l->values = v;
    a->value_case = MESHD__V1__ARG__VALUE_INTS;
    a->ints = l;
    break;
  }
  case 8:
    a->value_case = MESHD__V1__ARG__VALUE_DTYPE;
    a->dtype = (Meshd__V1__DType)fz_range(in, 0, 12);
    break;
  case 9: {
    char *s = b->strs[b->nstrs++];
    const char *p = fz_pick_str(in, strings, sizeof strings / sizeof *strings, s, 40);
    if (p != s) snprintf(s, 40, "%s", p);
    a->value_case = MESHD__V1__ARG__VALUE_S;
    a->s = s;
    break;
  }
  default:
    a->value_case = fz_u8(in) < 16 ? MESHD__V1__ARG__VALUE__NOT_SET : MESHD__V1__ARG__VALUE_NONE;
    a->none = true;
    break;
  }
}

/* A Call for op built from the input. */
static void gen_call(fz_t *in, const op_def_t *op, argbuf_t *b, Meshd__V1__Call *call) {
  meshd__v1__call__init(call);
  call->op = (char *)op_name(op);
  call->n_args = fz_u8(in) < 240 ? (size_t)fz_range(in, 0, op->nparams + 1)
                                 : (size_t)fz_range(in, 0, MAX_ARGS + 1);
  for (size_t i = 0; i < call->n_args; i++) {
    gen_arg(in, b, &b->args[i]);
    b->argp[i] = &b->args[i];
  }
  call->args = b->argp;
  call->n_kwargs = (size_t)fz_range(in, 0, 4);
  for (size_t i = 0; i < call->n_kwargs; i++) {
    Meshd__V1__Kwarg *k = &b->kwargs[i];
    meshd__v1__kwarg__init(k);
    char *s = b->strs[b->nstrs++];
    if (op->nparams && fz_u8(in) < 224) {
      snprintf(s, 40, "%s", op->params[fz_range(in, 0, op->nparams - 1)].name);
    } else {
      const char *p = fz_pick_str(in, (const char *const[]){"axis", "keepdims", "input", "dims",
                                                            "alpha", "dtype", "out"},
                                  7, s, 40);
      if (p != s) snprintf(s, 40, "%s", p);
    }
    k->name = s;
    if (fz_u8(in) >= 8) {
      gen_arg(in, b, &b->kwvals[i]);
      k->value = &b->kwvals[i];
    }
    b->kwp[i] = k;
  }
  call->kwargs = b->kwp;
}

/* ------------------------------------------------------------------ resolving, as commands.c */

typedef struct resolved {
  op_value_t pos[MAX_ARGS];
  op_kwarg_t kw[MAX_ARGS];
  size_t npos, nkw;
  const tensor_meta_t *lists[MAX_ARGS][MAX_LIST];
  size_t nlists;
} resolved_t;

static const tensor_meta_t *tensor_of(uint64_t ref) {
  return ref >= 1 && ref <= ntensors ? &tensors[ref - 1] : NULL;
}

/* 0, or -1 where the server would refuse the argument before binding. */
static int resolve(const arg_t *a, resolved_t *r, op_value_t *v) {
  memset(v, 0, sizeof *v);
  switch (a->value_case) {
  case MESHD__V1__ARG__VALUE_REF:
    v->kind = VAL_TENSOR;
    v->tensor = tensor_of(a->ref);
    return v->tensor ? 0 : -1;
  case MESHD__V1__ARG__VALUE_REFS: {
    if (r->nlists == MAX_ARGS || a->refs->n_refs > MAX_LIST) return -1;
    const tensor_meta_t **list = r->lists[r->nlists++];
    for (size_t i = 0; i < a->refs->n_refs; i++)
      if (!(list[i] = tensor_of(a->refs->refs[i]))) return -1;
    v->kind = VAL_TENSORS;
    v->tensors = list;
    v->ntensors = a->refs->n_refs;
    return 0;
  }
  default: {
    int rc = op_value_from_arg(a, v);
    if (rc > 0) FZ_CHECK(a->value_case == MESHD__V1__ARG__VALUE__NOT_SET, "case %d", a->value_case);
    if (rc < 0) FZ_CHECK(a->value_case == MESHD__V1__ARG__VALUE_DTYPE && !dtype_valid((dtype_t)a->dtype),
                         "op_value_from_arg refused a valid dtype %d", (int)a->dtype);
    return rc ? -1 : 0;
  }
  }
}

static int resolve_call(const Meshd__V1__Call *call, resolved_t *r) {
  memset(r, 0, sizeof *r);
  if (call->n_args > MAX_ARGS || call->n_kwargs > MAX_ARGS) return -1;
  for (size_t i = 0; i < call->n_args; i++)
    if (resolve(call->args[i], r, &r->pos[i])) return -1;
  r->npos = call->n_args;
  for (size_t i = 0; i < call->n_kwargs; i++) {
    const Meshd__V1__Kwarg *k = call->kwargs[i];
    if (!k->value) return -1;
    r->kw[i].name = k->name;
    if (resolve(k->value, r, &r->kw[i].value)) return -1;
  }
  r->nkw = call->n_kwargs;
  return 0;
}

/* ------------------------------------------------------------------ checks */

/* Field by field: struct copies need not copy padding. */
static bool same_meta(const tensor_meta_t *a, const tensor_meta_t *b) {
  if (a->dtype != b->dtype || a->layout.ndim != b->layout.ndim || a->layout.offset != b->layout.offset)
    return false;
  for (int d = 0; d < a->layout.ndim; d++)
    if (a->layout.sizes[d] != b->layout.sizes[d] || a->layout.strides[d] != b->layout.strides[d])
      return false;
  return true;
}

static bool same_infer(const op_infer_t *a, const op_infer_t *b) {
  if (a->nresults != b->nresults || a->nmutates != b->nmutates) return false;
  for (int i = 0; i < a->nresults && i < OP_MAX_RESULTS; i++)
    if (!same_meta(&a->results[i].meta, &b->results[i].meta) ||
        a->results[i].alias_param != b->results[i].alias_param)
      return false;
  for (int i = 0; i < a->nmutates && i < OP_MAX_RESULTS; i++)
    if (a->mutates[i] != b->mutates[i]) return false;
  return true;
}

static bool is_tensor_param(const op_args_t *a, int p) {
  return p >= 0 && p < a->nparams && a->v[p].kind == VAL_TENSOR && a->v[p].tensor;
}

static void check_refusal(const op_def_t *op, const meshd_error_t *e, const char *what) {
  const char *name = op_name(op);
  FZ_CHECK(e->kind != ERR_NONE && e->msg[0], "%s %s refused without a kind or message", name, what);
  FZ_CHECK(memchr(e->msg, '\0', sizeof e->msg), "%s: unterminated message", name);
  FZ_CHECK(strncmp(e->msg, name, strlen(name)) == 0 && e->msg[strlen(name)] == ':',
           "%s %s: message does not start with the op name: %s", name, what, e->msg);
}

static void check_results(const op_args_t *a, const op_infer_t *inf) {
  const op_def_t *op = a->op;
  const char *name = op_name(op);
  FZ_CHECK(inf->nresults >= 0 && inf->nresults <= OP_MAX_RESULTS, "%s: %d results", name,
           inf->nresults);
  FZ_CHECK(inf->nmutates >= 0 && inf->nmutates <= OP_MAX_RESULTS, "%s: %d mutates", name,
           inf->nmutates);
  for (int i = 0; i < inf->nmutates; i++)
    FZ_CHECK(is_tensor_param(a, inf->mutates[i]), "%s mutates parameter %d, not a tensor", name,
             inf->mutates[i]);
  FZ_CHECK(!op->is_inplace || inf->nmutates >= 1, "in-place %s mutates nothing", name);
  FZ_CHECK(op->is_inplace || inf->nmutates == 0, "%s is not in place but mutates", name);
  for (int i = 0; i < inf->nresults; i++) {
    const op_result_t *r = &inf->results[i];
    const layout_t *l = &r->meta.layout;
    FZ_CHECK(dtype_valid(r->meta.dtype), "%s result %d has dtype %d", name, i, (int)r->meta.dtype);
    FZ_CHECK(l->ndim >= 0 && l->ndim <= LAYOUT_MAX_DIMS, "%s result %d ndim %d", name, i, l->ndim);
    for (int d = 0; d < l->ndim; d++)
      FZ_CHECK(l->strides[d] >= 0, "%s result %d: stride %lld at dim %d", name, i,
               (long long)l->strides[d], d);
    if (r->alias_param < 0) {
      FZ_CHECK(!op->is_inplace, "in-place %s returns a fresh tensor", name);
      FZ_CHECK(l->offset == 0 && layout_is_contiguous(l), "%s: fresh result %d is not contiguous",
               name, i);
      continue;
    }
    FZ_CHECK(op->is_view || op->is_inplace, "%s (neither a view nor in place) aliases", name);
    FZ_CHECK(is_tensor_param(a, r->alias_param), "%s result %d aliases parameter %d, not a tensor",
             name, i, r->alias_param);
    const tensor_meta_t *base = a->v[r->alias_param].tensor;
    FZ_CHECK(r->meta.dtype == base->dtype, "%s: view result %d has dtype %s, its base %s", name, i,
             dtype_name(r->meta.dtype), dtype_name(base->dtype));
    if (op->is_inplace)
      FZ_CHECK(same_meta(&r->meta, base), "in-place %s returns a different tensor", name);
    if (layout_numel(l) == 0 || layout_numel(&base->layout) == 0) continue;
    __int128 vlo, vhi, blo, bhi;
    extent(l, &vlo, &vhi);
    extent(&base->layout, &blo, &bhi);
    FZ_CHECK(vlo >= blo && vhi <= bhi,
             "%s: view result %d reaches elements %lld..%lld, outside its base's %lld..%lld", name,
             i, (long long)vlo, (long long)vhi, (long long)blo, (long long)bhi);
  }
}

static void run(const op_def_t *op, const resolved_t *r) {
  op_args_t args, args2; /* args2: the second bind, for determinism */
  op_infer_t inf, inf2;
  meshd_error_t e = {0}, e2 = {0};
  int rc = ops_bind(op, r->pos, r->npos, r->kw, r->nkw, &args, &e);
  int rc2 = ops_bind(op, r->pos, r->npos, r->kw, r->nkw, &args2, &e2);
  FZ_CHECK(rc == rc2, "%s: ops_bind not deterministic", op_name(op));
  if (rc) {
    FZ_CHECK(rc == -1, "ops_bind returned %d", rc);
    check_refusal(op, &e, "ops_bind");
    return;
  }
  FZ_CHECK(args.op == op && args.nparams == op->nparams, "bound to another op");
  memset(&e, 0, sizeof e);
  rc = ops_infer(&args, &inf, &e);
  rc2 = ops_infer(&args, &inf2, &e2);
  FZ_CHECK(rc == rc2, "%s: ops_infer not deterministic", op_name(op));
  if (rc) {
    FZ_CHECK(rc == -1, "ops_infer returned %d", rc);
    check_refusal(op, &e, "ops_infer");
    FZ_CHECK(strcmp(e.msg, e2.msg) == 0, "%s: two messages", op_name(op));
    return;
  }
  FZ_CHECK(same_infer(&inf, &inf2), "%s: ops_infer not deterministic", op_name(op));
  check_results(&args, &inf);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  FZ_CHECK(ops_count() > 0 && ops_at(0), "empty catalogue");
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_t in = fz_open(data, size);
  fixed_tensors();
  static resolved_t r; /* large: kept off the stack */
  if (fz_u8(&in) & 1) {
    Meshd__V1__Call *call = meshd__v1__call__unpack(NULL, fz_left(&in), data + in.at);
    if (!call) return 0;
    const op_def_t *op = ops_find(call->op);
    if (op && resolve_call(call, &r) == 0) run(op, &r);
    meshd__v1__call__free_unpacked(call, NULL);
    return 0;
  }
  const op_def_t *op = ops_at((size_t)fz_u8(&in) % ops_count());
  FZ_CHECK(op && ops_find(op_name(op)) == op, "ops_at / ops_find disagree");
  size_t ngen = (size_t)fz_range(&in, 0, NGEN);
  for (size_t i = 0; i < ngen; i++) gen_tensor(&in, &tensors[ntensors++]);
  static argbuf_t b;
  memset(&b, 0, sizeof b);
  Meshd__V1__Call call;
  gen_call(&in, op, &b, &call);
  if (resolve_call(&call, &r) == 0) run(op, &r);
  return 0;
}
