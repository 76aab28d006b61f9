/* What an agent checks in every instruction (validate.h). */
#include "validate.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "dataplane/dataplane.h"
#include "grant.h"
#include "layout.h"
#include "reduction.h"
#include "url_fetch.h"

typedef Meshd__Agent__V1__Instruction instr_t;
typedef Meshd__Agent__V1__TensorSpec spec_t;

/* ------------------------------------------------------------------ envelope */

int validate_session_id(const char *id, char *why, size_t len) {
  size_t n = strlen(id ? id : "");
  if (n == 0) return snprintf(why, len, "session_id is empty"), -1;
  if (n > VALIDATE_SESSION_ID_MAX)
    return snprintf(why, len, "session_id has %zu characters, more than %d", n,
                    VALIDATE_SESSION_ID_MAX), -1;
  for (size_t i = 0; i < n; i++) {
    unsigned char ch = (unsigned char)id[i];
    if (ch <= 0x20 || ch >= 0x7f)
      return snprintf(why, len, "session_id has byte 0x%02x at %zu (printable ASCII only)", ch, i),
             -1;
  }
  return 0;
}

int validate_envelope(const instr_t *ins, char *why, size_t len) {
  char sid[120];
  if (validate_session_id(ins->session_id, sid, sizeof sid)) {
    snprintf(why, len, "instruction seq %" PRIu64 ": %s", ins->seq, sid);
    return -1;
  }
  if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY__NOT_SET) {
    snprintf(why, len,
             "instruction seq %" PRIu64 " has no body (or one this agent does not know: is the "
             "agent older than the server?)", ins->seq);
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------ specs */

/* Field names ("OpCall add args[1]") are formatted only once an instruction
 * failed: validate_instruction checks it a second time with names on. On the
 * hot path, formatting them cost more than the checks themselves. */
static _Thread_local bool naming;

static void vname_field(char *buf, size_t len, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));
static void vname_field(char *buf, size_t len, const char *fmt, va_list ap) {
  if (naming) vsnprintf(buf, len, fmt, ap);
  else buf[0] = 0;
}

static void name_field(char *buf, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void name_field(char *buf, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vname_field(buf, len, fmt, ap);
  va_end(ap);
}

int validate_spec(const spec_t *sp, const char *field, meshd_error_t *e) {
  tensor_meta_t m;
  return validate_spec_meta(sp, field, &m, e);
}

int validate_spec_meta(const spec_t *sp, const char *field, tensor_meta_t *m, meshd_error_t *e) {
  if (!sp) return error_set(e, ERR_BAD_ARGUMENT, "%s is missing", field);
  dtype_t dt = (dtype_t)sp->dtype;
  if (!dtype_valid(dt))
    return error_set(e, ERR_BAD_ARGUMENT, "%s.dtype: unknown dtype %d", field, (int)sp->dtype);
  if (layout_check_shape(NULL, sp->shape, (int64_t)sp->n_shape, dtype_size(dt), e)) {
    char ctx[96]; /* again, for the message: only on failure */
    snprintf(ctx, sizeof ctx, "%s.shape", field);
    layout_check_shape(ctx, sp->shape, (int64_t)sp->n_shape, dtype_size(dt), e);
    return -1;
  }
  if (sp->n_strides && sp->n_strides != sp->n_shape)
    return error_set(e, ERR_BAD_ARGUMENT, "%s.strides: %zu strides for %zu dims (give one per dim, "
                     "or none for row-major)", field, sp->n_strides, sp->n_shape);
  if (sp->storage_offset < 0)
    return error_set(e, ERR_BAD_ARGUMENT, "%s.storage_offset: %" PRId64 " is negative", field,
                     sp->storage_offset);
  memset(m, 0, sizeof *m);
  m->dtype = dt;
  m->layout.ndim = (int)sp->n_shape;
  for (size_t i = 0; i < sp->n_shape; i++) m->layout.sizes[i] = sp->shape[i];
  layout_make_contiguous(&m->layout);
  if (!sp->n_strides && !sp->storage_offset) return 0;
  for (size_t i = 0; i < sp->n_strides; i++) {
    if (sp->strides[i] < 0)
      return error_set(e, ERR_BAD_ARGUMENT, "%s.strides[%zu]: %" PRId64 " is negative", field, i,
                       sp->strides[i]);
    m->layout.strides[i] = sp->strides[i];
  }
  m->layout.offset = sp->storage_offset;
  if (layout_numel(&m->layout) == 0) return 0;
  /* The last element it views, in bytes, stays below 2^62 (no overflow on the way). */
  int64_t last = sp->storage_offset, span, bytes;
  for (size_t i = 0; i < sp->n_strides; i++)
    if (__builtin_mul_overflow(sp->shape[i] - 1, sp->strides[i], &span) ||
        __builtin_add_overflow(last, span, &last))
      goto far;
  if (__builtin_add_overflow(last, 1, &last) ||
      __builtin_mul_overflow(last, (int64_t)dtype_size(dt), &bytes) || bytes > LAYOUT_MAX_BYTES)
    goto far;
  return 0;
far:
  return error_set(e, ERR_BAD_ARGUMENT,
                   "%s: offset %" PRId64 " and its strides view elements past 2^62 bytes of "
                   "storage", field, sp->storage_offset);
}

/* Specs in one instruction that name the same storage view the same memory:
 * one dtype (no op in the catalogue reinterprets a storage). */
typedef struct storages {
  const spec_t *v[OP_MAX_RESULTS + VALIDATE_LIST_MAX];
  char field[OP_MAX_RESULTS + VALIDATE_LIST_MAX][64];
  size_t n;
} storages_t;

static int same_storage_dtype(storages_t *s, const spec_t *sp, const char *field, meshd_error_t *e) {
  if (!sp || !sp->storage) return 0;
  for (size_t i = 0; i < s->n; i++)
    if (s->v[i]->storage == sp->storage && s->v[i]->dtype != sp->dtype)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "%s: storage %" PRIu64 " is %s here but %s in %s (views of one storage "
                       "share its dtype)", field, sp->storage, dtype_name((dtype_t)sp->dtype),
                       dtype_name((dtype_t)s->v[i]->dtype), s->field[i]);
  if (s->n < sizeof s->v / sizeof s->v[0]) {
    s->v[s->n] = sp;
    name_field(s->field[s->n++], sizeof s->field[0], "%s", field);
  }
  return 0;
}

/* A spec with its field name made from fmt. */
static int check_spec(storages_t *st, const spec_t *sp, meshd_error_t *e, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int check_spec(storages_t *st, const spec_t *sp, meshd_error_t *e, const char *fmt, ...) {
  char field[64];
  va_list ap;
  va_start(ap, fmt);
  vname_field(field, sizeof field, fmt, ap);
  va_end(ap);
  if (validate_spec(sp, field, e)) return -1;
  if (!sp->ref) return error_set(e, ERR_BAD_ARGUMENT, "%s.ref is 0 (refs start at 1)", field);
  return st ? same_storage_dtype(st, sp, field, e) : 0;
}

static bool same_meta(const tensor_meta_t *a, const tensor_meta_t *b) {
  return a->dtype == b->dtype && layout_same_shape(&a->layout, &b->layout);
}

static int meta_differs(meshd_error_t *e, const char *field, const tensor_meta_t *got,
                        const tensor_meta_t *want, const char *because) {
  char g[LAYOUT_SHAPE_BUF], w[LAYOUT_SHAPE_BUF];
  layout_format_shape(got->layout.sizes, got->layout.ndim, g, sizeof g);
  layout_format_shape(want->layout.sizes, want->layout.ndim, w, sizeof w);
  return error_set(e, ERR_BAD_ARGUMENT, "%s is %s %s but %s gives %s %s", field,
                   dtype_name(got->dtype), g, because, dtype_name(want->dtype), w);
}

/* ------------------------------------------------------------------ bodies */

static int check_factory(const Meshd__Agent__V1__FactoryOp *fo, meshd_error_t *e) {
  if (!fo->factory) return error_set(e, ERR_BAD_ARGUMENT, "FactoryOp.factory is missing");
  op_args_t args;
  op_infer_t inf;
  if (ops_bind_factory(fo->factory, &args, e)) return -1;
  if (ops_infer(&args, &inf, e)) {
    error_prefix(e, "Factory", " ");
    return -1;
  }
  uint64_t ref = fo->result ? fo->result->ref : fo->factory->ref;
  if (!ref) return error_set(e, ERR_BAD_ARGUMENT, "FactoryOp names no result ref");
  if (!fo->result) return 0;
  tensor_meta_t m;
  if (validate_spec_meta(fo->result, "FactoryOp.result", &m, e)) return -1;
  if (fo->factory->ref && fo->factory->ref != ref)
    return error_set(e, ERR_BAD_ARGUMENT, "FactoryOp.result.ref %" PRIu64 " differs from "
                     "FactoryOp.factory.ref %" PRIu64, ref, fo->factory->ref);
  if (!same_meta(&m, &inf.results[0].meta))
    return meta_differs(e, "FactoryOp.result", &m, &inf.results[0].meta, fo->factory->kind);
  return 0;
}

/* A Load's tensor in the file, and this rank's part of it, as the result. */
static int check_load(const Meshd__Agent__V1__LoadOp *lo, meshd_error_t *e) {
  const Meshd__V1__Load *l = lo->load;
  if (!l) return error_set(e, ERR_BAD_ARGUMENT, "LoadOp.load is missing");
  size_t len = strlen(l->url ? l->url : "");
  if (len == 0 || len > 8192)
    return error_set(e, ERR_BAD_ARGUMENT, "LoadOp.load.url: %zu characters, expected 1..8192", len);
  if (l->version && !url_version_ok(l->version))
    return error_set(e, ERR_BAD_ARGUMENT, "LoadOp.load.version: not printable ASCII under %d "
                     "characters", URL_VERSION_MAX);
  dtype_t dt = (dtype_t)l->dtype;
  if (l->dtype == MESHD__V1__DTYPE__DTYPE_UNSPECIFIED || !dtype_valid(dt))
    return error_set(e, ERR_BAD_ARGUMENT, "LoadOp.load.dtype: %d is not a dtype", (int)l->dtype);
  tensor_meta_t want = {.dtype = dt};
  if (layout_contiguous(&want.layout, l->shape, (int64_t)l->n_shape, dtype_size(dt),
                        "LoadOp.load.shape", e))
    return -1;
  uint64_t nbytes = (uint64_t)layout_numel(&want.layout) * dtype_size(dt);
  if (l->offset > UINT64_MAX - nbytes || (l->file_size && l->offset + nbytes > l->file_size))
    return error_set(e, ERR_BAD_ARGUMENT, "LoadOp.load: bytes from offset %" PRIu64
                     " pass the file's end", l->offset);
  if (lo->parts < 1 || lo->coordinate < 0 || lo->coordinate >= lo->parts)
    return error_set(e, ERR_BAD_ARGUMENT, "LoadOp: coordinate %" PRId64 " of %" PRId64 " parts",
                     lo->coordinate, lo->parts);
  if (lo->parts > 1) {
    if (l->dim < 0 || l->dim >= want.layout.ndim || want.layout.sizes[l->dim] % lo->parts)
      return error_set(e, ERR_BAD_ARGUMENT, "LoadOp: dim %d does not split in %" PRId64 " parts",
                       (int)l->dim, lo->parts);
    want.layout.sizes[l->dim] /= lo->parts;
    layout_make_contiguous(&want.layout);
  }
  if (!lo->result || !lo->result->ref)
    return error_set(e, ERR_BAD_ARGUMENT, "LoadOp names no result ref");
  if (l->ref && l->ref != lo->result->ref)
    return error_set(e, ERR_BAD_ARGUMENT, "LoadOp.result.ref %" PRIu64 " differs from "
                     "LoadOp.load.ref %" PRIu64, lo->result->ref, l->ref);
  tensor_meta_t m;
  if (validate_spec_meta(lo->result, "LoadOp.result", &m, e)) return -1;
  if (!same_meta(&m, &want)) return meta_differs(e, "LoadOp.result", &m, &want, "the load");
  return 0;
}

/* A Literal's bytes fill a fresh, row-major result exactly. */
static int check_literal(const Meshd__Agent__V1__LiteralOp *lo, meshd_error_t *e) {
  if (!lo->result || !lo->result->ref)
    return error_set(e, ERR_BAD_ARGUMENT, "LiteralOp names no result ref");
  tensor_meta_t m;
  if (validate_spec_meta(lo->result, "LiteralOp.result", &m, e)) return -1;
  if (m.layout.offset || !layout_is_contiguous(&m.layout))
    return error_set(e, ERR_BAD_ARGUMENT, "LiteralOp.result: a literal is row-major from offset 0");
  uint64_t nbytes = (uint64_t)layout_numel(&m.layout) * dtype_size(m.dtype);
  if (lo->data.len != nbytes)
    return error_set(e, ERR_BAD_ARGUMENT, "LiteralOp.data: %zu bytes where its result needs "
                     "%" PRIu64, lo->data.len, nbytes);
  return 0;
}

static int check_arg(const Meshd__V1__Arg *a, const char *field, size_t *tensors, meshd_error_t *e) {
  if (!a) return error_set(e, ERR_BAD_ARGUMENT, "%s is missing", field);
  switch (a->value_case) {
    case MESHD__V1__ARG__VALUE_REF:
      if (!a->ref) return error_set(e, ERR_BAD_ARGUMENT, "%s.ref is 0 (refs start at 1)", field);
      ++*tensors;
      return 0;
    case MESHD__V1__ARG__VALUE_REFS:
      if (!a->refs) return error_set(e, ERR_BAD_ARGUMENT, "%s.refs is missing", field);
      if (a->refs->n_refs > VALIDATE_LIST_MAX)
        return error_set(e, ERR_BAD_ARGUMENT, "%s.refs: %zu tensors, more than %d", field,
                         a->refs->n_refs, VALIDATE_LIST_MAX);
      for (size_t i = 0; i < a->refs->n_refs; i++)
        if (!a->refs->refs[i])
          return error_set(e, ERR_BAD_ARGUMENT, "%s.refs[%zu] is 0 (refs start at 1)", field, i);
      *tensors += a->refs->n_refs;
      return 0;
    case MESHD__V1__ARG__VALUE_INTS:
      if (!a->ints) return error_set(e, ERR_BAD_ARGUMENT, "%s.ints is missing", field);
      return 0;
    case MESHD__V1__ARG__VALUE_DTYPE:
      if (!dtype_valid((dtype_t)a->dtype))
        return error_set(e, ERR_BAD_ARGUMENT, "%s.dtype: unknown dtype %d", field, (int)a->dtype);
      return 0;
    default:
      return 0;
  }
}

static int check_call(const Meshd__Agent__V1__OpCall *c, meshd_error_t *e) {
  const char *name = c->op ? c->op : "";
  const op_def_t *op = ops_find(name);
  if (!op) return error_set(e, ERR_UNKNOWN_OP, "OpCall.op: unknown op '%.40s'", name);
  if (c->n_args > VALIDATE_ARGS_MAX || c->n_kwargs > VALIDATE_ARGS_MAX)
    return error_set(e, ERR_BAD_ARGUMENT, "OpCall %s: %zu arguments and %zu keyword arguments, "
                     "more than %d", op->name, c->n_args, c->n_kwargs, VALIDATE_ARGS_MAX);
  size_t tensors = 0;
  char field[96];
  for (size_t i = 0; i < c->n_args; i++) {
    name_field(field, sizeof field, "OpCall %s args[%zu]", op->name, i);
    if (check_arg(c->args[i], field, &tensors, e)) return -1;
  }
  for (size_t i = 0; i < c->n_kwargs; i++) {
    const Meshd__V1__Kwarg *k = c->kwargs[i];
    name_field(field, sizeof field, "OpCall %s kwargs[%zu]", op->name, i);
    if (!k || !k->name || !*k->name)
      return error_set(e, ERR_BAD_ARGUMENT, "%s has no name", field);
    if (!k->value) return error_set(e, ERR_BAD_ARGUMENT, "%s ('%.40s') has no value", field, k->name);
    if (check_arg(k->value, field, &tensors, e)) return -1;
  }
  if (tensors > VALIDATE_LIST_MAX)
    return error_set(e, ERR_BAD_ARGUMENT, "OpCall %s: %zu tensor arguments, more than %d", op->name,
                     tensors, VALIDATE_LIST_MAX);
  if (c->n_results > OP_MAX_RESULTS)
    return error_set(e, ERR_BAD_ARGUMENT, "OpCall %s: %zu results, more than %d", op->name,
                     c->n_results, OP_MAX_RESULTS);
  if (c->n_inputs > VALIDATE_LIST_MAX)
    return error_set(e, ERR_BAD_ARGUMENT, "OpCall %s: %zu input specs, more than %d", op->name,
                     c->n_inputs, VALIDATE_LIST_MAX);
  storages_t st = {.n = 0};
  for (size_t i = 0; i < c->n_results; i++) {
    if (check_spec(&st, c->results[i], e, "OpCall.results[%zu]", i)) return -1;
    for (size_t j = 0; j < i; j++)
      if (c->results[j]->ref == c->results[i]->ref)
        return error_set(e, ERR_BAD_ARGUMENT, "OpCall %s: results[%zu] and results[%zu] are both "
                         "ref %" PRIu64, op->name, j, i, c->results[i]->ref);
  }
  for (size_t i = 0; i < c->n_inputs; i++)
    if (check_spec(&st, c->inputs[i], e, "OpCall.inputs[%zu]", i)) return -1;
  if (c->n_mutates > OP_MAX_RESULTS)
    return error_set(e, ERR_BAD_ARGUMENT, "OpCall %s: %zu mutated parameters, more than %d",
                     op->name, c->n_mutates, OP_MAX_RESULTS);
  for (size_t i = 0; i < c->n_mutates; i++)
    if (c->mutates[i] >= (uint64_t)op->nparams)
      return error_set(e, ERR_BAD_ARGUMENT, "OpCall %s: mutates[%zu] is parameter %" PRIu64
                       ", but %s has %d", op->name, i, c->mutates[i], op->name, op->nparams);
  return 0;
}

/* A group holds distinct ranks below the limit, an address each, and this
 * agent exactly once. */
static int check_group(const Meshd__Agent__V1__Group *g, const char *what,
                       const validate_self_t *self, meshd_error_t *e) {
  if (!g) return error_set(e, ERR_BAD_ARGUMENT, "%s.group is missing", what);
  size_t n = g->n_ranks;
  if (n == 0 || n > VALIDATE_GROUP_MAX)
    return error_set(e, ERR_BAD_ARGUMENT, "%s.group has %zu ranks (1..%d)", what, n,
                     VALIDATE_GROUP_MAX);
  if (g->n_addresses != n)
    return error_set(e, ERR_BAD_ARGUMENT, "%s.group has %zu ranks but %zu addresses (one each)",
                     what, n, g->n_addresses);
  if (!g->comm_id) return error_set(e, ERR_BAD_ARGUMENT, "%s.group.comm_id is 0", what);
  if (g->pair_secrets.len != 0 && g->pair_secrets.len != n * DP_SECRET_LEN)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s.group.pair_secrets has %zu bytes where its %zu members need %zu (%d each) "
                     "or none",
                     what, g->pair_secrets.len, n, n * DP_SECRET_LEN, DP_SECRET_LEN);
  size_t mine = 0, mine_by_addr = 0;
  for (size_t i = 0; i < n; i++) {
    if (g->ranks[i] >= VALIDATE_RANK_MAX)
      return error_set(e, ERR_BAD_ARGUMENT, "%s.group.ranks[%zu]: rank %u is not below %u", what, i,
                       g->ranks[i], VALIDATE_RANK_MAX);
    for (size_t j = 0; j < i; j++)
      if (g->ranks[j] == g->ranks[i])
        return error_set(e, ERR_BAD_ARGUMENT, "%s.group.ranks: rank %u is listed twice (at %zu and "
                         "%zu)", what, g->ranks[i], j, i);
    const char *a = g->addresses[i] ? g->addresses[i] : "";
    size_t len = strlen(a);
    if (len > VALIDATE_ADDRESS_MAX || (n > 1 && len == 0))
      return error_set(e, ERR_BAD_ARGUMENT, "%s.group.addresses[%zu]: %zu characters (1..%d)",
                       what, i, len, VALIDATE_ADDRESS_MAX);
    if (self->rank >= 0 && g->ranks[i] == (uint64_t)self->rank) mine++;
    if (self->data_address && *self->data_address && !strcmp(a, self->data_address)) mine_by_addr++;
  }
  if (self->rank >= 0 && mine != 1)
    return error_set(e, ERR_BAD_ARGUMENT, "%s.group does not hold this agent's rank %" PRId64,
                     what, self->rank);
  if (self->rank < 0 && self->data_address && *self->data_address && mine_by_addr != 1)
    return error_set(e, ERR_BAD_ARGUMENT, "%s.group does not hold this agent's address %s once",
                     what, self->data_address);
  return 0;
}

static int check_reduce(const Meshd__Agent__V1__ReduceOp *ro, const validate_self_t *self,
                        meshd_error_t *e) {
  const Meshd__V1__Reduce *r = ro->reduce;
  if (!r) return error_set(e, ERR_BAD_ARGUMENT, "ReduceOp.reduce is missing");
  storages_t st = {.n = 0};
  tensor_meta_t im, rm, want;
  if (check_spec(&st, ro->input, e, "ReduceOp.input") ||
      check_spec(&st, ro->result, e, "ReduceOp.result") ||
      check_group(ro->group, "ReduceOp", self, e))
    return -1;
  validate_spec_meta(ro->input, "ReduceOp.input", &im, e);
  validate_spec_meta(ro->result, "ReduceOp.result", &rm, e);
  reduction_t red = reduction_parse(r->reduction);
  if (red == RED_INVALID)
    return error_set(e, ERR_BAD_ARGUMENT, "Reduce: unknown reduction '%.40s'; expected one of %s",
                     r->reduction ? r->reduction : "", reduction_names());
  if (r->inplace && r->out)
    return error_set(e, ERR_BAD_ARGUMENT, "Reduce: inplace and out %" PRIu64 " both given", r->out);
  if (ro->rooted && (r->scatter || r->inplace))
    return error_set(e, ERR_BAD_ARGUMENT, "Reduce: onto a sub-mesh (rooted), but %s",
                     r->scatter ? "scatter is set" : "in place");
  if (ro->rooted && ro->root >= ro->group->n_ranks)
    return error_set(e, ERR_BAD_ARGUMENT, "ReduceOp.root %u is not an index of its group of %zu",
                     ro->root, ro->group->n_ranks);
  if (r->inplace && ro->result->ref != ro->input->ref)
    return error_set(e, ERR_BAD_ARGUMENT, "Reduce: in place, but the result is ref %" PRIu64
                     " and the input ref %" PRIu64, ro->result->ref, ro->input->ref);
  /* The server's rule (reduction.h): every member checks the same, so all
   * of them agree and none is left waiting in the collective. */
  reduce_args_t a = {.reduction = red, .scatter = r->scatter, .inplace = r->inplace, .input = &im,
                     .group = (int64_t)ro->group->n_ranks, .ndims = 1, .dims_named = true};
  if (reduce_infer(&a, &want, e)) return -1;
  if (!same_meta(&rm, &want)) {
    char got[LAYOUT_SHAPE_BUF], expect[LAYOUT_SHAPE_BUF];
    layout_format_shape(rm.layout.sizes, rm.layout.ndim, got, sizeof got);
    layout_format_shape(want.layout.sizes, want.layout.ndim, expect, sizeof expect);
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Reduce: the instruction's result is %s %s but its input and group of %zu "
                     "give %s %s", dtype_name(rm.dtype), got, ro->group->n_ranks,
                     dtype_name(want.dtype), expect);
  }
  return 0;
}

static int check_peer(const char *what, const char *addr, uint64_t comm_id, meshd_error_t *e) {
  size_t len = strlen(addr ? addr : "");
  if (len == 0 || len > VALIDATE_ADDRESS_MAX)
    return error_set(e, ERR_BAD_ARGUMENT, "%s.peer_address: %zu characters (1..%d)", what, len,
                     VALIDATE_ADDRESS_MAX);
  if (!comm_id) return error_set(e, ERR_BAD_ARGUMENT, "%s.comm_id is 0", what);
  return 0;
}

static int check_send(const Meshd__Agent__V1__SendTensor *t, const validate_self_t *self,
                      meshd_error_t *e) {
  const char *w = "SendTensor";
  if (t->to_rank >= VALIDATE_RANK_MAX || t->from_rank >= VALIDATE_RANK_MAX)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: ranks %u -> %u, not below %u", w, t->from_rank,
                     t->to_rank, VALIDATE_RANK_MAX);
  storages_t st = {.n = 0};
  if (t->input && check_spec(&st, t->input, e, "SendTensor.input")) return -1;
  if (t->result && check_spec(&st, t->result, e, "SendTensor.result")) return -1;
  bool known = self->rank >= 0;
  uint32_t me = known ? (uint32_t)self->rank : 0;
  if (t->input && t->result) { /* a local copy */
    tensor_meta_t im, rm;
    validate_spec_meta(t->input, "SendTensor.input", &im, e);
    validate_spec_meta(t->result, "SendTensor.result", &rm, e);
    if (t->to_rank != t->from_rank || (known && t->to_rank != me))
      return error_set(e, ERR_BAD_ARGUMENT, "%s: a local copy (input and result) from rank %u to "
                       "rank %u on rank %u", w, t->from_rank, t->to_rank, me);
    if (!same_meta(&rm, &im)) return meta_differs(e, "SendTensor.result", &rm, &im, "its input");
    if (t->result->ref == t->input->ref)
      return error_set(e, ERR_BAD_ARGUMENT, "%s: result and input are both ref %" PRIu64, w,
                       t->input->ref);
    return 0;
  }
  if (t->input) { /* the sender */
    if (t->to_rank == t->from_rank || (known && t->from_rank != me))
      return error_set(e, ERR_BAD_ARGUMENT, "%s: a send from rank %u to rank %u on rank %u", w,
                       t->from_rank, t->to_rank, me);
    return check_peer(w, t->peer_address, t->comm_id, e);
  }
  if (t->result) { /* the receiver */
    if (t->to_rank == t->from_rank || (known && t->to_rank != me))
      return error_set(e, ERR_BAD_ARGUMENT, "%s: a receive from rank %u to rank %u on rank %u", w,
                       t->from_rank, t->to_rank, me);
    return check_peer(w, t->peer_address, t->comm_id, e);
  }
  return error_set(e, ERR_BAD_ARGUMENT,
                   "%s: neither input (a sender's) nor result (a receiver's) is set", w);
}

static int check_borrow(const Meshd__Agent__V1__BorrowOp *b, uint64_t stream, meshd_error_t *e) {
  const char *phase = NULL;
  uint64_t want_stream = b->from_stream;
  switch (b->phase) {
    case MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE:
      phase = "CREATE";
      if (!b->tensor || !b->result || b->tensor == b->result)
        return error_set(e, ERR_BAD_ARGUMENT, "BorrowOp CREATE: tensor %" PRIu64 " and result %"
                         PRIu64 " must be two refs, neither 0", b->tensor, b->result);
      break;
    case MESHD__AGENT__V1__BORROW_OP__PHASE__FIRST_USE:
      phase = "FIRST_USE";
      want_stream = b->to_stream;
      break;
    case MESHD__AGENT__V1__BORROW_OP__PHASE__LAST_USE:
      phase = "LAST_USE";
      want_stream = b->to_stream;
      if (!b->result) return error_set(e, ERR_BAD_ARGUMENT, "BorrowOp LAST_USE: result is 0");
      break;
    case MESHD__AGENT__V1__BORROW_OP__PHASE__DROP:
      phase = "DROP";
      break;
    default:
      return error_set(e, ERR_BAD_ARGUMENT, "BorrowOp.phase: unknown phase %d", (int)b->phase);
  }
  if (!b->borrow) return error_set(e, ERR_BAD_ARGUMENT, "BorrowOp %s: borrow is 0", phase);
  if (stream != want_stream)
    return error_set(e, ERR_BAD_ARGUMENT, "BorrowOp %s runs on stream %" PRIu64 ", not on the "
                     "%s stream %" PRIu64, phase, stream,
                     want_stream == b->from_stream ? "borrow's origin" : "borrowing", want_stream);
  return 0;
}

static int check_broadcast(const Meshd__Agent__V1__BroadcastOp *bo, const validate_self_t *self,
                           meshd_error_t *e) {
  storages_t st = {.n = 0};
  if (check_spec(&st, bo->input, e, "BroadcastOp.input") ||
      check_spec(&st, bo->result, e, "BroadcastOp.result") ||
      check_group(bo->group, "BroadcastOp", self, e))
    return -1;
  if (bo->group->n_ranks < 2)
    return error_set(e, ERR_BAD_ARGUMENT, "BroadcastOp.group has %zu rank(s): a source and at least "
                     "one destination are needed", bo->group->n_ranks);
  if (bo->input->ref == bo->result->ref)
    return error_set(e, ERR_BAD_ARGUMENT, "BroadcastOp: result and input are both ref %" PRIu64,
                     bo->input->ref);
  tensor_meta_t im, rm;
  validate_spec_meta(bo->input, "BroadcastOp.input", &im, e);
  validate_spec_meta(bo->result, "BroadcastOp.result", &rm, e);
  if (!same_meta(&rm, &im)) return meta_differs(e, "BroadcastOp.result", &rm, &im, "its input");
  return 0;
}

static int check_body(const instr_t *ins, const validate_self_t *self, meshd_error_t *e) {
  switch (ins->body_case) {
    case MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY:
      return ins->factory ? check_factory(ins->factory, e) : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_CALL:
      return ins->call ? check_call(ins->call, e) : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_LOAD:
      return ins->load ? check_load(ins->load, e) : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL:
      return ins->literal ? check_literal(ins->literal, e) : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE:
      return ins->reduce ? check_reduce(ins->reduce, self, e) : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_SEND:
      return ins->send ? check_send(ins->send, self, e) : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST:
      return ins->broadcast ? check_broadcast(ins->broadcast, self, e) : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW:
      return ins->borrow ? check_borrow(ins->borrow, ins->stream, e) : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS:
      return ins->delete_refs ? 0 : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_CREATE_STREAM: {
      if (!ins->create_stream) return -1;
      size_t len = strlen(ins->create_stream->name ? ins->create_stream->name : "");
      if (len > 63)
        return error_set(e, ERR_BAD_ARGUMENT, "CreateStream.name: %zu characters, more than 63", len);
      return 0;
    }
    case MESHD__AGENT__V1__INSTRUCTION__BODY_PEER_LOST: {
      const Meshd__Agent__V1__PeerLost *p = ins->peer_lost;
      if (!p) return -1;
      if (p->rank >= VALIDATE_RANK_MAX)
        return error_set(e, ERR_BAD_ARGUMENT, "PeerLost.rank: %u is not below %u", p->rank,
                         VALIDATE_RANK_MAX);
      size_t len = strlen(p->data_address ? p->data_address : "");
      if (len > VALIDATE_ADDRESS_MAX)
        return error_set(e, ERR_BAD_ARGUMENT, "PeerLost.data_address: %zu characters, more than %d",
                         len, VALIDATE_ADDRESS_MAX);
      return 0;
    }
    case MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT:
      if (!ins->snapshot) return -1;
      return ins->snapshot->ref ? 0 : error_set(e, ERR_BAD_ARGUMENT, "Snapshot.ref: ref 0");
    case MESHD__AGENT__V1__INSTRUCTION__BODY_DROP_SNAPSHOT:
      return ins->drop_snapshot ? 0 : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_REVOKE_GRANTS: {
      const Meshd__Agent__V1__RevokeGrants *r = ins->revoke_grants;
      if (!r) return -1;
      if (r->n_nonces > VALIDATE_REVOKE_MAX)
        return error_set(e, ERR_BAD_ARGUMENT, "RevokeGrants.nonces: %zu, more than %d",
                         r->n_nonces, VALIDATE_REVOKE_MAX);
      for (size_t i = 0; i < r->n_nonces; i++)
        if (r->nonces[i].len != GRANT_NONCE_LEN)
          return error_set(e, ERR_BAD_ARGUMENT, "RevokeGrants.nonces[%zu]: %zu bytes, not %d", i,
                           r->nonces[i].len, GRANT_NONCE_LEN);
      return 0;
    }
    case MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS:
      return ins->status ? 0 : -1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION:
      return ins->end_session ? 0 : -1;
    default:
      return error_set(e, ERR_BAD_ARGUMENT, "unknown body %d", (int)ins->body_case);
  }
}

const char *validate_kind_name(const instr_t *ins) {
  switch (ins->body_case) {
    case MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY: return "FactoryOp";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_CALL: return "OpCall";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE: return "ReduceOp";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_SEND: return "SendTensor";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST: return "BroadcastOp";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW: return "BorrowOp";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS: return "DeleteRefs";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS: return "StatusRequest";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION: return "EndSession";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_CREATE_STREAM: return "CreateStream";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_PEER_LOST: return "PeerLost";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT: return "Snapshot";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_DROP_SNAPSHOT: return "DropSnapshot";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_REVOKE_GRANTS: return "RevokeGrants";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_LOAD: return "LoadOp";
    case MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL: return "LiteralOp";
    default: return "instruction";
  }
}

int validate_instruction(const instr_t *ins, const validate_self_t *self, meshd_error_t *e) {
  meshd_error_t err = {0};
  naming = false;
  if (check_body(ins, self, &err) == 0) return 0;
  /* Over this agent's own --max-tensor-dims/--max-tensor-elements (QUOTA) and
   * fine within the hard bounds: a peer with other limits may run it. */
  bool limits_only = false;
  if (err.kind == ERR_QUOTA) {
    meshd_error_t ignored = {0};
    layout_limits_off(true);
    limits_only = check_body(ins, self, &ignored) == 0;
    layout_limits_off(false);
  }
  naming = true; /* again, for a message that names the field */
  memset(&err, 0, sizeof err);
  check_body(ins, self, &err);
  naming = false;
  if (!err.msg[0]) snprintf(err.msg, sizeof err.msg, "%s is missing", validate_kind_name(ins));
  return error_set(e, limits_only ? ERR_QUOTA : ERR_BAD_ARGUMENT, "invalid %s (seq %" PRIu64
                   "): %.520s", validate_kind_name(ins), ins->seq, err.msg);
}

size_t validate_result_refs(const instr_t *ins, uint64_t *refs, size_t cap) {
  size_t n = 0;
#define PUT(r)                            \
  do {                                    \
    if ((r) && n < cap) refs[n++] = (r);  \
  } while (0)
  switch (ins->body_case) {
    case MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY:
      if (ins->factory) {
        if (ins->factory->result) PUT(ins->factory->result->ref);
        else if (ins->factory->factory) PUT(ins->factory->factory->ref);
      }
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_LOAD:
      if (ins->load) {
        if (ins->load->result) PUT(ins->load->result->ref);
        else if (ins->load->load) PUT(ins->load->load->ref);
      }
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL:
      if (ins->literal && ins->literal->result) PUT(ins->literal->result->ref);
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_CALL:
      for (size_t i = 0; ins->call && i < ins->call->n_results; i++)
        if (ins->call->results[i]) PUT(ins->call->results[i]->ref);
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE:
      if (ins->reduce && ins->reduce->result) PUT(ins->reduce->result->ref);
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_SEND:
      if (ins->send && ins->send->result) PUT(ins->send->result->ref);
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST:
      if (ins->broadcast && ins->broadcast->result) PUT(ins->broadcast->result->ref);
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW:
      if (ins->borrow && ins->borrow->phase == MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE)
        PUT(ins->borrow->result);
      break;
    default:
      break;
  }
#undef PUT
  return n;
}
