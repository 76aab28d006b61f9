#include "commands.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "borrow.h"
#include "checks.h"
#include "emit.h"
#include "flow.h"
#include "reduction.h"
#include "runtime.h"

#define MAX_ARGS 16
#define MAX_LIST 64
/* What an agent holds for one Call (agent/run.c MAX_HELD, MAX_LISTS): more is
 * refused here, not accepted and failed there. */
#define MAX_TENSORS 64
#define MAX_LISTS 8

/* ------------------------------------------------------------------ results */

void cmd_out_init(cmd_out_t *out, uint64_t seq) {
  memset(out, 0, sizeof *out);
  meshd__v1__command_result__init(&out->res);
  out->res.seq = seq;
}

static void *out_alloc(cmd_out_t *out, size_t size) {
  if (out->nallocs == CMD_MAX_ALLOCS) return NULL;
  void *p = calloc(1, size ? size : 1);
  if (p) out->allocs[out->nallocs++] = p;
  return p;
}

void cmd_out_free(cmd_out_t *out) {
  for (int i = 0; i < out->nallocs; i++) free(out->allocs[i]);
  out->nallocs = 0;
}

void cmd_out_error(cmd_out_t *out, const meshd_error_t *e) {
  Meshd__V1__Error *err = out_alloc(out, sizeof *err);
  if (!err) return;
  meshd__v1__error__init(err);
  err->kind = (Meshd__V1__ErrorKind)e->kind;
  err->message = (char *)e->msg;
  err->code = (int32_t)error_kind_code(e->kind);
  err->seq = out->res.seq;
  out->res.error = err;
}

void command_tensor_meta(Meshd__V1__TensorMeta *m, const obj_t *t, int64_t *dims) {
  tensor_meta_t tm;
  const layout_t *l = &obj_meta(t, &tm)->layout;
  meshd__v1__tensor_meta__init(m);
  m->ref = t->ref;
  m->n_shape = m->n_strides = (size_t)l->ndim;
  m->shape = dims;
  m->strides = dims + l->ndim;
  memcpy(m->shape, l->sizes, sizeof(int64_t) * (size_t)l->ndim);
  memcpy(m->strides, l->strides, sizeof(int64_t) * (size_t)l->ndim);
  m->storage_offset = l->offset;
  m->dtype = (Meshd__V1__DType)tm.dtype;
  m->mesh = t->tensor.mesh;
  m->stream = t->tensor.stream;
  m->state = (Meshd__V1__TensorState)t->state;
  m->storage = t->tensor.storage->id;
}

static Meshd__V1__TensorMeta *describe_tensor(cmd_out_t *out, const obj_t *t) {
  Meshd__V1__TensorMeta *m = out_alloc(out, sizeof *m);
  int ndim = meta_packed_ndim(t->meta);
  int64_t *dims = out_alloc(out, sizeof(int64_t) * 2 * (size_t)(ndim ? ndim : 1));
  if (!m || !dims) return NULL;
  command_tensor_meta(m, t, dims);
  if (t->state == TENSOR_FAILED) {
    Meshd__V1__Error *err = out_alloc(out, sizeof *err);
    if (err) {
      meshd__v1__error__init(err);
      err->kind = (Meshd__V1__ErrorKind)obj_fail_kind(t);
      err->message = (char *)obj_fail_msg(t);
      err->code = (int32_t)error_kind_code(obj_fail_kind(t));
      err->seq = obj_fail_root_seq(t);
      err->ref = t->ref;
      m->error = err;
    }
  }
  return m;
}

static int add_tensor(cmd_out_t *out, const obj_t *t) {
  if (!out->res.tensors) {
    out->res.tensors = out_alloc(out, sizeof(Meshd__V1__TensorMeta *) * OP_MAX_RESULTS);
    if (!out->res.tensors) return -1;
  }
  if (out->res.n_tensors == OP_MAX_RESULTS) return -1;
  Meshd__V1__TensorMeta *m = describe_tensor(out, t);
  if (!m) return -1;
  out->res.tensors[out->res.n_tensors++] = m;
  return 0;
}

/* The first rank of the mesh whose agent predates LiteralOp (its version in
 * version), -1 if none; a rank too when out of memory (version "unknown"). */
static int64_t first_without_literals(frontend_t *fe, const mesh_t *mesh, char *version,
                                      size_t len) {
  size_t n = mesh_len(mesh);
  uint32_t *r = malloc((n ? n : 1) * sizeof *r);
  if (!r) {
    snprintf(version, len, "unknown");
    return 0;
  }
  mesh_ranks(mesh, r);
  int64_t old = agent_pool_first_without(fe->pool, r, n, MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL,
                                         version, len);
  free(r);
  return old;
}

static int add_mesh(frontend_t *fe, cmd_out_t *out, const mesh_t *mesh) {
  Meshd__V1__MeshMeta *m = out_alloc(out, sizeof *m);
  Meshd__V1__Dim *dims = out_alloc(out, sizeof *dims * (size_t)mesh->ndim);
  Meshd__V1__Dim **dimp = out_alloc(out, sizeof *dimp * (size_t)mesh->ndim);
  size_t n = (size_t)mesh_len(mesh);
  uint32_t *ranks = out_alloc(out, sizeof *ranks * n);
  if (!m || !dims || !dimp || !ranks) return -1;
  meshd__v1__mesh_meta__init(m);
  m->ref = mesh->ref;
  for (int i = 0; i < mesh->ndim; i++) {
    meshd__v1__dim__init(&dims[i]);
    dims[i].name = (char *)mesh->names[i];
    dims[i].size = mesh->slice.sizes[i];
    dimp[i] = &dims[i];
  }
  m->n_dims = (size_t)mesh->ndim;
  m->dims = dimp;
  mesh_ranks(mesh, ranks);
  m->n_ranks = n;
  m->ranks = ranks;
  char version[32];
  m->literals = first_without_literals(fe, mesh, version, sizeof version) < 0;
  out->res.mesh = m;
  return 0;
}

/* ------------------------------------------------------------------ refs */

/* A command's new refs must be fresh and increasing; they are claimed only
 * once the command is accepted, so a rejected command consumes nothing. */
static int check_new_refs(session_t *s, const char *cmd, const uint64_t *refs, size_t n,
                          meshd_error_t *e) {
  if (session_check_refs(s, refs, n, e) == 0) return 0;
  error_prefix(e, cmd, ": ");
  return -1;
}

int command_check_limits(const session_t *s, const objects_t *o, obj_kind_t kind, size_t n,
                         const char *cmd, meshd_error_t *e) {
  const session_limits_t *l = &s->limits;
  uint64_t made = kind == OBJ_MESH ? o->meshes : kind == OBJ_STREAM ? o->streams : 0;
  uint64_t max = kind == OBJ_MESH ? l->max_meshes : kind == OBJ_STREAM ? l->max_streams : 0;
  if (max && made + n > max)
    return error_set(e, ERR_QUOTA,
                     "%s: session %.8s has made %llu %s, the most a session may make here "
                     "(--session-max-%s %llu); a %s lasts as long as its session: reuse the "
                     "ones it has, or close it and open a new session",
                     cmd, s->id, (unsigned long long)made, kind == OBJ_MESH ? "meshes" : "streams",
                     kind == OBJ_MESH ? "meshes" : "streams", (unsigned long long)max,
                     obj_kind_name(kind));
  uint64_t live = objects_live_refs(o);
  if (l->max_refs && live + n > l->max_refs)
    return error_set(e, ERR_QUOTA,
                     "%s: session %.8s holds %llu live refs (tensors and their views, meshes, "
                     "streams, borrows) and this command adds %zu, more than a session may hold "
                     "here (--session-max-refs %llu); drop tensors it no longer needs",
                     cmd, s->id, (unsigned long long)live, n, (unsigned long long)l->max_refs);
  return 0;
}

/* A command's new refs: fresh and increasing, and within the session's limits. */
static int check_new(session_t *s, objects_t *o, const char *cmd, obj_kind_t kind,
                     const uint64_t *refs, size_t n, meshd_error_t *e) {
  if (check_new_refs(s, cmd, refs, n, e)) return -1;
  return command_check_limits(s, o, kind, n, cmd, e);
}

static void claim_refs(session_t *s, const uint64_t *refs, size_t n) {
  if (n) session_claim_ref(s, refs[n - 1], NULL); /* checked: the last is the highest */
}

/* A mesh one of whose agents was lost after it was made runs nothing more
 * (mesh.h: losses_seen). Lock-free while no agent was lost. */
int command_check_mesh_alive(agent_pool_t *pool, const mesh_t *mesh, const char *cmd,
                             meshd_error_t *e) {
  if (agent_pool_losses(pool) == mesh->losses_seen) return 0;
  size_t n = mesh_len(mesh);
  uint32_t *ranks = malloc((n ? n : 1) * sizeof *ranks);
  if (!ranks) return error_set(e, ERR_QUOTA, "%s: out of memory on the server", cmd);
  mesh_ranks(mesh, ranks);
  int rc = agent_pool_check_lost(pool, ranks, n, mesh->losses_seen, cmd, e);
  free(ranks);
  return rc;
}

/* Room for a result of per_rank bytes on each of the mesh's ranks: the
 * mesh's agents are all there, then their registered capacity (mesh.h), then
 * the session's quota. */
static int check_room(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh,
                      const char *cmd, uint64_t per_rank, meshd_error_t *e) {
  if (command_check_mesh_alive(fe->pool, mesh, cmd, e)) return -1;
  if (mesh_check_capacity(mesh, cmd, per_rank, e)) return -1;
  uint64_t ranks = (uint64_t)mesh_len(mesh), add, total;
  /* Checked sums: a wrapped one would slip under any quota (and under none,
   * corrupt the session's count). */
  if (__builtin_mul_overflow(per_rank, ranks, &add) || __builtin_add_overflow(o->bytes, add, &total))
    return error_set(e, ERR_QUOTA,
                     "%s: the result needs %llu bytes on each of %llu ranks, more than the "
                     "session can hold (2^64 bytes in all); use a smaller shape",
                     cmd, (unsigned long long)per_rank, (unsigned long long)ranks);
  uint64_t quota = s->quota_bytes;
  if (quota && total > quota)
    return error_set(e, ERR_QUOTA,
                     "%s: the result needs %llu bytes across its mesh, but the session holds %llu "
                     "of its %llu-byte quota; drop tensors you no longer need",
                     cmd, (unsigned long long)add, (unsigned long long)o->bytes,
                     (unsigned long long)quota);
  return 0;
}

/* A stream argument: 0 is main, anything else must be a stream. */
static int resolve_stream(objects_t *o, const char *cmd, uint64_t ref, meshd_error_t *e) {
  if (ref == STREAM_MAIN) return 0;
  char what[160];
  snprintf(what, sizeof what, "%.100s: stream", cmd);
  return objects_expect(o, ref, OBJ_STREAM, what, e) ? 0 : -1;
}

static mesh_t *resolve_mesh(objects_t *o, const char *cmd, const char *what, uint64_t ref,
                            meshd_error_t *e) {
  char where[96];
  snprintf(where, sizeof where, "%s: %s", cmd, what);
  if (ref == 0) {
    error_set(e, ERR_BAD_ARGUMENT, "%s is missing: name a mesh created with CreateMesh", where);
    return NULL;
  }
  obj_t *m = objects_expect(o, ref, OBJ_MESH, where, e);
  return m ? m->mesh : NULL;
}

/* Failure flows from inputs to results (DEPENDENT_FAILURE naming the root). */
static const obj_t *first_failed(obj_t *const *ins, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (ins[i] && ins[i]->state == TENSOR_FAILED) return ins[i];
  return NULL;
}

static void inherit_failure(objects_t *o, obj_t *t, const obj_t *root, uint64_t seq) {
  if (!root) return;
  /* A dependent's dependent keeps the message that names the root (Monarch's
   * DependentError(root)): wrapped once per step, a chain of a few ops cut
   * the root's own error off. */
  if (obj_fail_kind(root) == ERR_DEPENDENT_FAILURE && root->tensor.fail) {
    objects_fail_tensor(o, t, seq, ERR_DEPENDENT_FAILURE, obj_fail_root_seq(root),
                        obj_fail_msg(root));
    return;
  }
  char msg[sizeof ((meshd_error_t *)0)->msg + 96];
  snprintf(msg, sizeof msg, "depends on tensor %llu, which failed at command seq %llu: %s",
           (unsigned long long)root->ref, (unsigned long long)obj_fail_root_seq(root),
           obj_fail_msg(root));
  objects_fail_tensor(o, t, seq, ERR_DEPENDENT_FAILURE, obj_fail_root_seq(root), msg);
}

void command_inherit_failure(objects_t *o, obj_t *t, const obj_t *root, uint64_t seq) {
  inherit_failure(o, t, root, seq);
}

/* ------------------------------------------------------------------ meshes, streams */

/* MeshSelector messages -> mesh_slice. */
static int mesh_slice_proto(const mesh_t *parent, uint64_t ref, Meshd__V1__MeshSelector *const *sel,
                            size_t n, const char *cmd, mesh_t *out, meshd_error_t *e) {
  mesh_selector_t ms[NDSLICE_MAX_DIMS];
  if (n > NDSLICE_MAX_DIMS)
    return error_set(e, ERR_BAD_DIM, "%s: %zu selectors, but a mesh has at most %d dims", cmd, n,
                     NDSLICE_MAX_DIMS);
  for (size_t i = 0; i < n; i++) {
    const Meshd__V1__MeshSelector *x = sel[i];
    ms[i] = (mesh_selector_t){.dim = x->dim};
    if (x->sel_case == MESHD__V1__MESH_SELECTOR__SEL_INDEX) {
      ms[i].index = x->index;
    } else if (x->sel_case == MESHD__V1__MESH_SELECTOR__SEL_RANGE) {
      ms[i].is_range = true;
      ms[i].start = x->range->start;
      ms[i].stop = x->range->stop;
      ms[i].has_stop = x->range->has_stop;
      ms[i].has_step = x->range->has_step;
      ms[i].step = x->range->step;
    } else {
      return error_set(e, ERR_BAD_ARGUMENT, "%s: the selector for dim '%s' has neither an index nor a range",
                       cmd, x->dim);
    }
  }
  if (mesh_slice(parent, ref, ms, n, out, e)) {
    if (strncmp(e->msg, cmd, strlen(cmd)) != 0) error_prefix(e, cmd, ": "); /* mesh.c names SliceMesh */
    return -1;
  }
  return 0;
}

/* What each rank of the mesh can hold (its agents' registered capacity),
 * checked before any command on it is accepted (check_room). */
static int set_capacity(frontend_t *fe, mesh_t *mesh, const char *cmd, meshd_error_t *e) {
  size_t n = mesh_len(mesh);
  uint32_t *ranks = malloc((n ? n : 1) * sizeof *ranks);
  if (!ranks) return error_set(e, ERR_QUOTA, "%s: out of memory on the server", cmd);
  mesh_ranks(mesh, ranks);
  mesh->rank_capacity = agent_pool_min_capacity(fe->pool, ranks, n);
  free(ranks);
  return 0;
}

static int cmd_create_mesh(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                           cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__CreateMesh *m = c->create_mesh;
  if (check_new(s, o, "CreateMesh", OBJ_MESH, &m->ref, 1, e)) return -1;
  if (m->n_dims > NDSLICE_MAX_DIMS)
    return error_set(e, ERR_BAD_ARGUMENT, "CreateMesh: %zu dims; a mesh has at most %d", m->n_dims,
                     NDSLICE_MAX_DIMS);
  const char *names[NDSLICE_MAX_DIMS];
  int64_t sizes[NDSLICE_MAX_DIMS];
  for (size_t i = 0; i < m->n_dims; i++) {
    names[i] = m->dims[i]->name;
    sizes[i] = m->dims[i]->size;
  }
  size_t world = 0;
  uint64_t losses = agent_pool_losses(fe->pool); /* before the health it checks */
  bool *healthy = agent_pool_healthy_map(fe->pool, &world);
  /* Ranks drained before the session began are not for it (agent_pool.h). */
  bool *drained = healthy ? agent_pool_drained_map(fe->pool, s->created_ms, world) : NULL;
  mesh_t mesh;
  int rc = mesh_create_placed(m->ref, names, sizes, (int)m->n_dims, healthy, drained, world, &mesh,
                              e);
  free(drained);
  free(healthy);
  if (rc) return -1;
  mesh.losses_seen = losses;
  if (set_capacity(fe, &mesh, "CreateMesh", e)) return -1;
  obj_t *obj = objects_add_mesh(o, m->ref, &mesh);
  if (!obj) return error_set(e, ERR_QUOTA, "CreateMesh: out of memory on the server");
  claim_refs(s, &m->ref, 1);
  return add_mesh(fe, out, obj->mesh);
}

static int cmd_slice_mesh(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                          cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__SliceMesh *m = c->slice_mesh;
  if (check_new(s, o, "SliceMesh", OBJ_MESH, &m->ref, 1, e)) return -1;
  mesh_t *parent = resolve_mesh(o, "SliceMesh", "parent", m->parent, e);
  if (!parent) return -1;
  mesh_t mesh;
  if (mesh_slice_proto(parent, m->ref, m->selectors, m->n_selectors, "SliceMesh", &mesh, e) ||
      set_capacity(fe, &mesh, "SliceMesh", e))
    return -1;
  obj_t *obj = objects_add_mesh(o, m->ref, &mesh);
  if (!obj) return error_set(e, ERR_QUOTA, "SliceMesh: out of memory on the server");
  claim_refs(s, &m->ref, 1);
  return add_mesh(fe, out, obj->mesh);
}

static int cmd_create_stream(frontend_t *fe, session_t *s, objects_t *o,
                             const Meshd__V1__Command *c, cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__CreateStream *m = c->create_stream;
  if (check_new(s, o, "CreateStream", OBJ_STREAM, &m->ref, 1, e)) return -1;
  size_t len = strlen(m->name);
  if (len == 0 || len > OBJ_STREAM_NAME_MAX)
    return error_set(e, ERR_BAD_ARGUMENT, "CreateStream: the name must be 1..%d characters, got %zu",
                     OBJ_STREAM_NAME_MAX, len);
  /* No check that the name is new: it is a label (Monarch's Stream(name)), and
   * the ref identifies the stream; messages add the ref to a shared name. */
  if (!objects_add_stream(o, m->ref, m->name))
    return error_set(e, ERR_QUOTA, "CreateStream: out of memory on the server");
  claim_refs(s, &m->ref, 1);
  return 0;
}

/* ------------------------------------------------------------------ factories */

static const char *const factory_kinds[] = {"empty", "zeros", "ones", "full",
                                            "arange", "rand", "randn", "rank"};

static int cmd_factory(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                       cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__Factory *f = c->factory;
  if (check_new(s, o, "Factory", OBJ_TENSOR, &f->ref, 1, e)) return -1;
  bool known = false;
  for (size_t i = 0; i < sizeof factory_kinds / sizeof *factory_kinds; i++)
    known |= strcmp(f->kind, factory_kinds[i]) == 0;
  if (!known)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Factory: unknown kind '%s'; expected one of empty, zeros, ones, full, arange, "
                     "rand, randn, rank", f->kind);
  mesh_t *mesh = resolve_mesh(o, "Factory", "mesh", f->mesh, e);
  if (!mesh || resolve_stream(o, "Factory", f->stream, e)) return -1;
  const op_def_t *op = ops_find(f->kind);
  if (!op) return error_set(e, ERR_UNKNOWN_OP, "Factory: '%s' is missing from the op catalogue", f->kind);

  op_kwarg_t kw[6];
  size_t nkw = 0;
  op_value_t pos[3];
  size_t npos = 0;
  if (f->dtype != MESHD__V1__DTYPE__DTYPE_UNSPECIFIED) {
    if (!dtype_name((dtype_t)f->dtype) || f->dtype > MESHD__V1__DTYPE__DTYPE_BOOL)
      return error_set(e, ERR_BAD_ARGUMENT, "Factory: unknown dtype %d", (int)f->dtype);
    kw[nkw++] = (op_kwarg_t){"dtype", {.kind = VAL_DTYPE, .dtype = (dtype_t)f->dtype}};
  }
  if (strcmp(f->kind, "rank") == 0) {
    if (mesh_find_dim(mesh, f->dim) < 0) {
      char dims[200];
      mesh_format(mesh, dims, sizeof dims);
      return error_set(e, ERR_BAD_DIM, "Factory rank: mesh %llu %s has no dim '%s'",
                       (unsigned long long)mesh->ref, dims, f->dim);
    }
    pos[npos++] = (op_value_t){.kind = VAL_STRING, .s = f->dim};
  } else if (strcmp(f->kind, "arange") == 0) {
    pos[npos++] = (op_value_t){.kind = VAL_FLOAT, .f = f->start};
    pos[npos++] = (op_value_t){.kind = VAL_FLOAT, .f = f->end};
    pos[npos++] = (op_value_t){.kind = VAL_FLOAT, .f = f->step};
  } else {
    pos[npos++] = (op_value_t){.kind = VAL_INTS, .ints = f->shape, .nints = f->n_shape};
    if (strcmp(f->kind, "full") == 0) pos[npos++] = (op_value_t){.kind = VAL_FLOAT, .f = f->value};
    if (f->has_seed && (strcmp(f->kind, "rand") == 0 || strcmp(f->kind, "randn") == 0))
      kw[nkw++] = (op_kwarg_t){"seed", {.kind = VAL_INT, .i = (int64_t)f->seed}};
  }
  op_args_t args;
  op_infer_t inf;
  if (ops_bind(op, pos, npos, kw, nkw, &args, e) || ops_infer(&args, &inf, e)) {
    error_prefix(e, "Factory", " "); /* "zeros: ..." -> "Factory zeros: ..." */
    return -1;
  }
  uint64_t ranks = (uint64_t)mesh_len(mesh);
  if (check_room(fe, s, o, mesh, "Factory", meta_nbytes(&inf.results[0].meta), e)) return -1;
  obj_t *t = objects_new_tensor(o, f->ref, &inf.results[0].meta, mesh->ref, f->stream, ranks);
  if (!t) return error_set(e, ERR_QUOTA, "Factory: out of memory on the server");
  claim_refs(s, &f->ref, 1);
  /* rand/randn without a seed draw a fresh one here, so every rank of the mesh
   * uses the same seed (and its own rank's stream of it). */
  Meshd__V1__Factory fx = *f;
  if (!fx.has_seed && (strcmp(f->kind, "rand") == 0 || strcmp(f->kind, "randn") == 0)) {
    if (getrandom(&fx.seed, sizeof fx.seed, 0) != (ssize_t)sizeof fx.seed)
      fx.seed = (uint64_t)rpc_now_ms() * 0x9e3779b97f4a7c15ull ^ f->ref;
    fx.has_seed = true;
  }
  emit_factory(fe, s, o, mesh, t, &fx);
  return add_tensor(out, t);
}

/* ------------------------------------------------------------------ literals */

/* What the Literals of the Submit message this thread runs sent so far; -1:
 * none (an Execute). */
static _Thread_local int64_t batch_literal_sent = -1;

void command_batch_begin(void) { batch_literal_sent = 0; }
void command_batch_end(void) { batch_literal_sent = -1; }

/* Every agent of the mesh runs LiteralOp: an older one would end its Execute
 * link on the unknown body (a rolling upgrade: the server goes first). */
static int check_runs_literals(frontend_t *fe, const mesh_t *mesh, meshd_error_t *e) {
  char version[32];
  int64_t old = first_without_literals(fe, mesh, version, sizeof version);
  if (old < 0) return 0;
  return error_set(e, ERR_UNAVAILABLE,
                   "Literal: the agent at rank %lld (version %s) predates the Literal command; "
                   "send the tensor with Upload, or upgrade the agent",
                   (long long)old, version);
}

/* A small tensor whose bytes come in the command (Literal in
 * tensor_service.proto): the checks of an UploadHeader, then the bytes go to
 * each rank as an instruction, in order with the session's other commands. */
static int cmd_literal(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                       cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__Literal *l = c->literal;
  if (check_new(s, o, "Literal", OBJ_TENSOR, &l->ref, 1, e)) return -1;
  if (l->data.len > LITERAL_MAX_BYTES)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Literal: %zu bytes of data, more than a Literal carries (%d); send larger "
                     "tensors with Upload", l->data.len, LITERAL_MAX_BYTES);
  mesh_t *mesh = resolve_mesh(o, "Literal", "mesh", l->mesh, e);
  if (!mesh || resolve_stream(o, "Literal", l->stream, e)) return -1;
  dtype_t dt = (dtype_t)l->dtype;
  if (!dtype_valid(dt) || !dtype_name(dt))
    return error_set(e, ERR_BAD_ARGUMENT, "Literal: unknown dtype %d; name one of float32, ..., bool",
                     (int)l->dtype);
  tensor_meta_t meta = {.dtype = dt};
  if (layout_contiguous(&meta.layout, l->shape, (int64_t)l->n_shape, dtype_size(dt),
                        "Literal: shape", e))
    return -1;
  uint64_t each = (uint64_t)layout_numel(&meta.layout) * dtype_size(dt);
  uint64_t ranks = (uint64_t)mesh_len(mesh);
  if (each > LITERAL_MAX_BYTES)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Literal: shape and dtype need %llu bytes%s, more than a Literal carries (%d); "
                     "send larger tensors with Upload", (unsigned long long)each,
                     l->per_rank ? " per rank" : "", LITERAL_MAX_BYTES);
  uint64_t want = l->per_rank ? each * ranks : each; /* no overflow: each <= 1 MiB */
  if (want != l->data.len)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Literal: %zu bytes of data, but shape and dtype%s need %llu", l->data.len,
                     l->per_rank ? " (per rank, times the mesh's ranks)" : "",
                     (unsigned long long)want);
  uint64_t sent = l->per_rank ? want : want * ranks; /* to the agents, in all */
  if (sent > LITERAL_MAX_SENT_BYTES) /* (per_rank: want <= 1 MiB, it is the data) */
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Literal: its %llu bytes would go to each of the mesh's %llu ranks, %llu in "
                     "all, more than a Literal sends (%d); send it with Upload",
                     (unsigned long long)want, (unsigned long long)ranks, (unsigned long long)sent,
                     LITERAL_MAX_SENT_BYTES);
  if (batch_literal_sent >= 0 && (uint64_t)batch_literal_sent + sent > LITERAL_MAX_SENT_BYTES)
    return error_set(e, ERR_QUOTA,
                     "Literal: the Literals of one Submit message send at most %d bytes to the "
                     "agents, and this one would make %llu; send it in a later message",
                     LITERAL_MAX_SENT_BYTES, (unsigned long long)(batch_literal_sent + sent));
  /* A Submit stream stops reading while the session's window is full; Execute
   * calls in parallel would each still run: one more Literal waits for room.
   * Only the session's own window refuses it: the server over its bound because
   * of other sessions' work holds its answer (run_one), as any Execute's. */
  bool server_wide = false;
  if (batch_literal_sent < 0 && o->flow && flow_over(o->flow, &server_wide) && !server_wide)
    return error_set(e, ERR_QUOTA,
                     "Literal: session %.8s already has more queued for its agents than "
                     "flow control allows (--session-max-queued or "
                     "--session-max-queued-bytes); wait for its Executes' answers, or "
                     "Sync, and send it again", s->id);
  if (check_room(fe, s, o, mesh, "Literal", meta_nbytes(&meta), e) ||
      check_runs_literals(fe, mesh, e))
    return -1;
  obj_t *t = objects_new_tensor(o, l->ref, &meta, mesh->ref, l->stream, ranks);
  if (!t) return error_set(e, ERR_QUOTA, "Literal: out of memory on the server");
  claim_refs(s, &l->ref, 1);
  if (batch_literal_sent >= 0) batch_literal_sent += (int64_t)sent;
  emit_literal(fe, s, o, mesh, t, l);
  return add_tensor(out, t);
}

/* ------------------------------------------------------------------ loads */

/* A tensor each agent fetches from a URL (Load in tensor_service.proto). The
 * URL is checked against --url-allow here, before any agent connects; each
 * agent checks every address it connects to again. */
static int cmd_load(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                    cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__Load *l = c->load;
  if (check_new(s, o, "Load", OBJ_TENSOR, &l->ref, 1, e)) return -1;
  if (!fe->urls) return error_set(e, ERR_PERMISSION_DENIED, "Load: this server loads no URLs");
  if (!l->url || !*l->url) return error_set(e, ERR_BAD_ARGUMENT, "Load: the url is empty");
  if (strlen(l->url) > 8192)
    return error_set(e, ERR_BAD_ARGUMENT, "Load: the url is %zu characters; at most 8192",
                     strlen(l->url));
  if (url_policy_check(fe->urls, l->url, e)) return -1;
  if (l->version && !url_version_ok(l->version))
    return error_set(e, ERR_BAD_ARGUMENT, "Load: version is not what InspectUrl gives (printable "
                     "ASCII, under %d characters)", URL_VERSION_MAX);
  mesh_t *mesh = resolve_mesh(o, "Load", "mesh", l->mesh, e);
  if (!mesh || resolve_stream(o, "Load", l->stream, e)) return -1;
  dtype_t dt = (dtype_t)l->dtype;
  if (l->dtype == MESHD__V1__DTYPE__DTYPE_UNSPECIFIED || !dtype_valid(dt) || !dtype_name(dt))
    return error_set(e, ERR_BAD_ARGUMENT, "Load: dtype %d is not a meshd dtype (give dtype=)",
                     (int)l->dtype);
  tensor_meta_t meta = {.dtype = dt};
  if (layout_contiguous(&meta.layout, l->shape, (int64_t)l->n_shape, dtype_size(dt), "Load", e))
    return -1;
  uint64_t nbytes = (uint64_t)layout_numel(&meta.layout) * dtype_size(dt);
  if (l->offset > UINT64_MAX - nbytes)
    return error_set(e, ERR_BAD_ARGUMENT, "Load: offset %llu overflows", (unsigned long long)l->offset);
  if (l->file_size && l->offset + nbytes > l->file_size)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Load: the tensor's bytes [%llu, %llu) pass the end of the %llu-byte file",
                     (unsigned long long)l->offset, (unsigned long long)(l->offset + nbytes),
                     (unsigned long long)l->file_size);
  if (l->shard && *l->shard) {
    int md = mesh_find_dim(mesh, l->shard);
    if (md < 0) {
      char dims[200];
      mesh_format(mesh, dims, sizeof dims);
      return error_set(e, ERR_BAD_DIM, "Load: mesh %llu %s has no dim '%s' to shard over",
                       (unsigned long long)mesh->ref, dims, l->shard);
    }
    int64_t parts = mesh->slice.sizes[md];
    if (l->dim < 0 || l->dim >= meta.layout.ndim)
      return error_set(e, ERR_BAD_DIM, "Load: dim %d is not a dim of a %d-dim tensor", (int)l->dim,
                       meta.layout.ndim);
    if (meta.layout.sizes[l->dim] % parts != 0)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "Load: dim %d has size %lld, which does not split evenly over the %lld "
                       "ranks of mesh dim '%s'",
                       (int)l->dim, (long long)meta.layout.sizes[l->dim], (long long)parts, l->shard);
    meta.layout.sizes[l->dim] /= parts;
    layout_make_contiguous(&meta.layout);
  }
  uint64_t local = (uint64_t)layout_numel(&meta.layout) * dtype_size(dt);
  if (local > fe->urls->opts.max_bytes)
    return error_set(e, ERR_QUOTA,
                     "Load: %llu bytes per rank is more than one load may fetch (--url-max-bytes "
                     "%llu)", (unsigned long long)local, (unsigned long long)fe->urls->opts.max_bytes);
  if (check_room(fe, s, o, mesh, "Load", meta_nbytes(&meta), e)) return -1;
  obj_t *t = objects_new_tensor(o, l->ref, &meta, mesh->ref, l->stream, (uint64_t)mesh_len(mesh));
  if (!t) return error_set(e, ERR_QUOTA, "Load: out of memory on the server");
  claim_refs(s, &l->ref, 1);
  emit_load(fe, s, o, mesh, t, l);
  return add_tensor(out, t);
}

/* ------------------------------------------------------------------ op calls */

/* Arguments of a Call resolved against the session. */
typedef struct call_args {
  op_value_t pos[MAX_ARGS];
  op_kwarg_t kw[MAX_ARGS];
  size_t npos, nkw;
  obj_t *tensors[MAX_TENSORS]; /* every tensor named, list entries too, for checks */
  const tensor_meta_t *meta_of[MAX_TENSORS]; /* tensors[i]'s dtype and layout */
  const char *names[MAX_TENSORS];
  size_t ntensors;
  tensor_meta_t metas[MAX_ARGS * 2]; /* unpacked for the op's checks: a tensor argument's */
  size_t nmetas;
  const tensor_meta_t *lists[MAX_LISTS][MAX_LIST];
  tensor_meta_t *list_metas[MAX_LISTS]; /* a list argument's, malloc'd */
  size_t nlists;
  char labels[MAX_TENSORS][48];
} call_args_t;

/* A Call's arguments, some tens of KiB: one per thread (runtime.h), as cmd_call
 * does not recurse. NULL out of memory. */
static call_args_t *call_args_get(void) {
  static runtime_scratch_t scratch = RUNTIME_SCRATCH_INIT(sizeof(call_args_t));
  return runtime_scratch(&scratch);
}

static void call_args_done(call_args_t *ca) {
  for (size_t i = 0; ca && i < ca->nlists; i++) free(ca->list_metas[i]);
  if (ca) ca->nlists = 0;
}

/* The tensor whose unpacked meta an op value points at. */
static obj_t *obj_of_meta(const call_args_t *ca, const tensor_meta_t *m) {
  for (size_t i = 0; i < ca->ntensors; i++)
    if (ca->meta_of[i] == m) return ca->tensors[i];
  return NULL;
}

static int resolve_arg(objects_t *o, const char *cmd, const Meshd__V1__Arg *a, const char *label,
                       call_args_t *ca, op_value_t *v, meshd_error_t *e) {
  memset(v, 0, sizeof *v);
  switch (a->value_case) {
    case MESHD__V1__ARG__VALUE_REF: {
      if (ca->ntensors == MAX_TENSORS)
        return error_set(e, ERR_BAD_ARGUMENT, "%s: %s: at most %d tensors in all, lists included",
                         cmd, label, MAX_TENSORS);
      obj_t *t = check_tensor(o, cmd, label, a->ref, e);
      if (!t) return -1;
      snprintf(ca->labels[ca->ntensors], sizeof ca->labels[0], "%s", label);
      ca->names[ca->ntensors] = ca->labels[ca->ntensors];
      v->kind = VAL_TENSOR;
      v->tensor = ca->meta_of[ca->ntensors] = obj_meta(t, &ca->metas[ca->nmetas++]);
      ca->tensors[ca->ntensors++] = t;
      return 0;
    }
    case MESHD__V1__ARG__VALUE_REFS: {
      if (a->refs->n_refs > MAX_LIST)
        return error_set(e, ERR_BAD_ARGUMENT, "%s: %s: at most %d tensors in a list", cmd, label,
                         MAX_LIST);
      if (ca->nlists == MAX_LISTS)
        return error_set(e, ERR_BAD_ARGUMENT, "%s: %s: at most %d tensor-list arguments", cmd,
                         label, MAX_LISTS);
      if (a->refs->n_refs > MAX_TENSORS - ca->ntensors)
        return error_set(e, ERR_BAD_ARGUMENT, "%s: %s: at most %d tensors in all, lists included",
                         cmd, label, MAX_TENSORS);
      const tensor_meta_t **list = ca->lists[ca->nlists];
      tensor_meta_t *metas = malloc(sizeof *metas * (a->refs->n_refs ? a->refs->n_refs : 1));
      if (!metas) return error_set(e, ERR_QUOTA, "%s: out of memory on the server", cmd);
      ca->list_metas[ca->nlists++] = metas;
      for (size_t i = 0; i < a->refs->n_refs; i++) {
        char item[48];
        snprintf(item, sizeof item, "%s[%zu]", label, i);
        obj_t *t = check_tensor(o, cmd, item, a->refs->refs[i], e);
        if (!t) return -1;
        list[i] = obj_meta(t, &metas[i]);
        snprintf(ca->labels[ca->ntensors], sizeof ca->labels[0], "%s", item);
        ca->names[ca->ntensors] = ca->labels[ca->ntensors];
        ca->meta_of[ca->ntensors] = list[i];
        ca->tensors[ca->ntensors++] = t; /* every entry is checked like any argument */
      }
      v->kind = VAL_TENSORS;
      v->tensors = list;
      v->ntensors = a->refs->n_refs;
      return 0;
    }
    default: {
      int rc = op_value_from_arg(a, v);
      if (rc < 0)
        return error_set(e, ERR_BAD_ARGUMENT, "%s: %s: unknown dtype %d", cmd, label, (int)a->dtype);
      if (rc > 0) return error_set(e, ERR_BAD_ARGUMENT, "%s: %s has no value", cmd, label);
      return 0;
    }
  }
}

static int resolve_call_args(objects_t *o, const char *cmd, const op_def_t *op,
                             const Meshd__V1__Call *call, call_args_t *ca, meshd_error_t *e) {
  memset(ca, 0, offsetof(call_args_t, metas));
  ca->nmetas = ca->nlists = 0;
  if (call->n_args > MAX_ARGS || call->n_kwargs > MAX_ARGS)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: at most %d positional and %d keyword arguments", cmd,
                     MAX_ARGS, MAX_ARGS);
  for (size_t i = 0; i < call->n_args; i++) {
    char label[48];
    if ((int)i < op->nparams) snprintf(label, sizeof label, "argument '%s'", op->params[i].name);
    else snprintf(label, sizeof label, "argument %zu", i);
    if (resolve_arg(o, cmd, call->args[i], label, ca, &ca->pos[i], e)) return -1;
  }
  ca->npos = call->n_args;
  for (size_t i = 0; i < call->n_kwargs; i++) {
    const Meshd__V1__Kwarg *k = call->kwargs[i];
    if (!k->value)
      return error_set(e, ERR_BAD_ARGUMENT, "%s: keyword argument '%s' has no value", cmd, k->name);
    char label[48];
    snprintf(label, sizeof label, "argument '%.32s'", k->name);
    ca->kw[i].name = k->name;
    if (resolve_arg(o, cmd, k->value, label, ca, &ca->kw[i].value, e)) return -1;
  }
  ca->nkw = call->n_kwargs;
  return 0;
}

/* Same offset, sizes and strides (slots past ndim are not part of a layout;
 * the stride of a size-1 dim moves nowhere, so it does not count). */
static bool same_view(const layout_t *a, const layout_t *b) {
  if (a->ndim != b->ndim || a->offset != b->offset) return false;
  for (int i = 0; i < a->ndim; i++)
    if (a->sizes[i] != b->sizes[i] || (a->sizes[i] > 1 && a->strides[i] != b->strides[i]))
      return false;
  return true;
}

/* The bytes of its storage a view may touch: [*lo, *hi). false for no element. */
static bool byte_span(const tensor_meta_t *m, int64_t *lo, int64_t *hi) {
  const layout_t *l = &m->layout;
  int64_t es = (int64_t)dtype_size(m->dtype), first = l->offset, last = l->offset;
  for (int i = 0; i < l->ndim; i++) {
    if (l->sizes[i] == 0) return false;
    int64_t reach = (l->sizes[i] - 1) * l->strides[i];
    if (reach < 0) first += reach;
    else last += reach;
  }
  *lo = first * es;
  *hi = (last + 1) * es;
  return true;
}

/* The steps views_may_share searches before it answers "they may". */
#define SHARE_STEPS 1024

/* One stride of the merged views, with the multiples of it the two may add:
 * a's indices count up, b's down (a's offset + a's sum == b's offset + b's sum). */
typedef struct share_dim {
  int64_t stride;
  __int128 lo, hi;
} share_dim_t;

static __int128 floor_div(__int128 a, __int128 b) { /* b > 0 */
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

/* 1: rem is a sum of k_i * stride_i with lo_i <= k_i <= hi_i (i >= at); 0: it
 * is not; -1: out of steps. low[i], high[i]: the least and greatest sums of
 * dims i.. (d is sorted by stride, largest first, so they bound the rest). */
static int share_search(const share_dim_t *d, int n, int at, __int128 rem, const __int128 *low,
                        const __int128 *high, int *steps) {
  if (at == n) return rem == 0;
  __int128 s = d[at].stride;
  __int128 kmin = -floor_div(-(rem - high[at + 1]), s), kmax = floor_div(rem - low[at + 1], s);
  if (kmin < d[at].lo) kmin = d[at].lo;
  if (kmax > d[at].hi) kmax = d[at].hi;
  for (__int128 k = kmin; k <= kmax; k++) {
    if (--*steps < 0) return -1;
    int r = share_search(d, n, at + 1, rem - k * s, low, high, steps);
    if (r) return r;
  }
  return 0;
}

static int share_add(share_dim_t *d, int n, int64_t stride, __int128 lo, __int128 hi) {
  if (stride < 0) {
    __int128 t = lo;
    lo = -hi, hi = -t, stride = -stride;
  }
  for (int i = 0; i < n; i++)
    if (d[i].stride == stride) {
      d[i].lo += lo, d[i].hi += hi;
      return n;
    }
  d[n] = (share_dim_t){stride, lo, hi};
  return n + 1;
}

/* Whether views a and b of one storage, with elements of one size, may reach a
 * common element: an exact search over their strides (the offsets' difference
 * as a sum of stride multiples within the sizes), e.g. false for the columns
 * x[:, 0] and x[:, 1] or x[::2] and x[1::2], whose byte ranges interleave.
 * Past SHARE_STEPS steps of search it answers true (conservative). */
static bool views_may_share(const layout_t *a, const layout_t *b) {
  share_dim_t d[2 * LAYOUT_MAX_DIMS];
  int n = 0;
  for (int i = 0; i < a->ndim; i++) {
    if (a->sizes[i] == 0) return false;
    if (a->sizes[i] > 1 && a->strides[i] != 0)
      n = share_add(d, n, a->strides[i], 0, a->sizes[i] - 1);
  }
  for (int i = 0; i < b->ndim; i++) {
    if (b->sizes[i] == 0) return false;
    if (b->sizes[i] > 1 && b->strides[i] != 0)
      n = share_add(d, n, b->strides[i], -(b->sizes[i] - 1), 0);
  }
  for (int i = 1; i < n; i++) /* by stride, largest first */
    for (int j = i; j > 0 && d[j].stride > d[j - 1].stride; j--) {
      share_dim_t t = d[j];
      d[j] = d[j - 1], d[j - 1] = t;
    }
  __int128 low[2 * LAYOUT_MAX_DIMS + 1], high[2 * LAYOUT_MAX_DIMS + 1];
  low[n] = high[n] = 0;
  for (int i = n - 1; i >= 0; i--) {
    low[i] = low[i + 1] + d[i].lo * d[i].stride;
    high[i] = high[i + 1] + d[i].hi * d[i].stride;
  }
  int steps = SHARE_STEPS;
  return share_search(d, n, 0, (__int128)b->offset - a->offset, low, high, &steps) != 0;
}

/* Two views of one storage that share no byte (torch's rule for in-place
 * ops: only a partial overlap is refused), e.g. x[0] and x[1], or x[:, 0] and
 * x[:, 1], whose byte ranges interleave: then the strides decide
 * (views_may_share, exact within its steps, else "they may"). */
static bool disjoint(const tensor_meta_t *a, const tensor_meta_t *b) {
  int64_t alo, ahi, blo, bhi;
  if (!byte_span(a, &alo, &ahi) || !byte_span(b, &blo, &bhi)) return true;
  if (ahi <= blo || bhi <= alo) return true;
  return dtype_size(a->dtype) == dtype_size(b->dtype) && !views_may_share(&a->layout, &b->layout);
}

static bool param_mutated(const op_infer_t *inf, int param) {
  for (int i = 0; i < inf->nmutates; i++)
    if (inf->mutates[i] == param) return true;
  return false;
}

static int cmd_call(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                    cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__Call *call = c->call;
  char cmd[96];
  /* "Call add", for messages; built without printf, which cost more than the checks. */
  size_t oplen = strnlen(call->op, 64);
  memcpy(cmd, "Call ", 5);
  memcpy(cmd + 5, call->op, oplen);
  cmd[5 + oplen] = '\0';
  const op_def_t *op = ops_find(call->op);
  if (!op)
    return error_set(e, ERR_UNKNOWN_OP,
                     "Call: no op named '%.64s' in the catalogue; ops use ATen names, e.g. add, "
                     "matmul, sum, relu", call->op);
  if (op->is_factory)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: factories run on a mesh; send a Factory command",
                     cmd);
  if (check_new(s, o, cmd, OBJ_TENSOR, call->results, call->n_results, e)) return -1;
  if (resolve_stream(o, cmd, call->stream, e)) return -1;
  call_args_t *ca = call_args_get();
  if (!ca) return error_set(e, ERR_QUOTA, "%s: out of memory on the server", cmd);
  int rc = -1;
  op_args_t args;
  op_infer_t inf;
  if (resolve_call_args(o, cmd, op, call, ca, e)) goto out;
  if (ops_bind(op, ca->pos, ca->npos, ca->kw, ca->nkw, &args, e) || ops_infer(&args, &inf, e)) {
    error_prefix(e, "Call", " "); /* "add: ..." -> "Call add: ..." */
    goto out;
  }
  if (ca->ntensors == 0) {
    error_set(e, ERR_BAD_ARGUMENT, "%s: needs at least one tensor argument (it runs on their mesh)",
              cmd);
    goto out;
  }
  /* Which tensors the op writes: the parameters in inf.mutates. */
  tensor_use_t uses[MAX_TENSORS];
  for (size_t i = 0; i < ca->ntensors; i++) uses[i] = (tensor_use_t){ca->tensors[i], ca->names[i], false};
  for (int p = 0; p < args.nparams; p++) {
    if (args.v[p].kind != VAL_TENSOR || !param_mutated(&inf, p)) continue;
    for (size_t i = 0; i < ca->ntensors; i++)
      if (ca->meta_of[i] == args.v[p].tensor) uses[i].write = true;
  }
  uint64_t mesh_ref = 0;
  if (check_uses(o, cmd, uses, ca->ntensors, &mesh_ref, call->stream, e)) goto out;
  /* Like torch: an input may be the written tensor itself, or a view of the
   * same memory that shares none of its bytes, but not one that overlaps it
   * (the result would depend on the kernel's order). */
  for (size_t i = 0; i < ca->ntensors; i++) {
    if (!uses[i].write) continue;
    const tensor_obj_t *w = &ca->tensors[i]->tensor;
    for (size_t j = 0; j < ca->ntensors; j++) {
      const tensor_obj_t *r = &ca->tensors[j]->tensor;
      if (j == i || r->storage != w->storage) continue;
      if (same_view(&ca->meta_of[j]->layout, &ca->meta_of[i]->layout)) continue;
      if (disjoint(ca->meta_of[j], ca->meta_of[i])) continue;
      /* x.fill_(x[k]), as torch allows: the 0-dim value is read and written
       * with the same bits wherever it overlaps, so no kernel order matters. */
      if (strcmp(op->name, "fill_") == 0 && args.v[1].kind == VAL_TENSOR &&
          args.v[1].tensor == ca->meta_of[j] &&
          ca->meta_of[j]->dtype == ca->meta_of[i]->dtype)
        continue;
      error_set(e, ERR_BAD_ARGUMENT,
                "%s: %s (tensor %llu) writes memory that %s (tensor %llu) views differently; "
                "clone the input first", cmd, uses[i].what, (unsigned long long)ca->tensors[i]->ref,
                uses[j].what, (unsigned long long)ca->tensors[j]->ref);
      goto out;
    }
  }
  bool inplace = op->is_inplace;
  if (call->n_results != (size_t)inf.nresults && !(inplace && call->n_results == 0)) {
    error_set(e, ERR_BAD_ARGUMENT, "%s returns %d tensor%s but the command names %zu result ref%s",
              cmd, inf.nresults, inf.nresults == 1 ? "" : "s", call->n_results,
              call->n_results == 1 ? "" : "s");
    goto out;
  }
  obj_t *mesh_obj = objects_get(o, mesh_ref);
  uint64_t ranks = (uint64_t)mesh_len(mesh_obj->mesh);
  uint64_t need = 0; /* per rank */
  for (size_t i = 0; i < call->n_results; i++)
    if (inf.results[i].alias_param < 0) need += meta_nbytes(&inf.results[i].meta);
  if (check_room(fe, s, o, mesh_obj->mesh, cmd, need, e)) goto out;

  /* Accepted: define the results. */
  const obj_t *failed = first_failed(ca->tensors, ca->ntensors);
  obj_t *results[OP_MAX_RESULTS] = {0};
  for (size_t i = 0; i < call->n_results; i++) {
    const op_result_t *r = &inf.results[i];
    if (r->alias_param >= 0 && args.v[r->alias_param].kind == VAL_TENSOR)
      results[i] = objects_new_view(o, call->results[i], &r->meta,
                                    obj_of_meta(ca, args.v[r->alias_param].tensor));
    else
      results[i] = objects_new_tensor(o, call->results[i], &r->meta, mesh_ref, call->stream, ranks);
    if (!results[i]) {
      error_set(e, ERR_QUOTA, "%s: out of memory on the server", cmd);
      /* The refs stay unclaimed (a retry reuses them): the records made so
       * far go, or they would hold quota and refs, and a retry would put a
       * second record under the same ref. */
      for (size_t k = 0; k < i; k++) objects_release(o, results[k], out->res.seq);
      goto out;
    }
    inherit_failure(o, results[i], failed, out->res.seq);
  }
  for (int p = 0; failed && p < args.nparams; p++)
    if (args.v[p].kind == VAL_TENSOR && param_mutated(&inf, p))
      inherit_failure(o, obj_of_meta(ca, args.v[p].tensor), failed, out->res.seq);
  claim_refs(s, call->results, call->n_results);
  emit_call(fe, s, o, mesh_obj->mesh, call, ca->tensors, ca->ntensors, results, call->n_results,
            &inf);
  for (size_t i = 0; i < call->n_results; i++) add_tensor(out, results[i]);
  rc = 0;
out:
  call_args_done(ca);
  return rc;
}

/* ------------------------------------------------------------------ reduce */

/* Reduce onto a sub-mesh: target holds exactly one member of each group (the
 * ranks of src sharing every coordinate outside the reduced dims) and none of
 * the reduced dims. */
static int check_reduce_target(const mesh_t *src, const mesh_t *target, const int *dims, int ndims,
                               meshd_error_t *e) {
  char sd[200], td[200];
  mesh_format(src, sd, sizeof sd);
  mesh_format(target, td, sizeof td);
  unsigned long long tref = (unsigned long long)target->ref, sref = (unsigned long long)src->ref;
  for (int i = 0; i < ndims; i++)
    if (mesh_find_dim(target, src->names[dims[i]]) >= 0)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "Reduce: the target mesh %llu %s still has the reduced dim '%s'; reduce onto "
                       "a slice without it, e.g. mesh.slice(%s=0)",
                       tref, td, src->names[dims[i]], src->names[dims[i]]);
  size_t n = mesh_len(target), groups = mesh_len(src);
  for (int i = 0; i < ndims; i++) groups /= (size_t)src->slice.sizes[dims[i]];
  uint32_t *ranks = malloc(sizeof *ranks * (n ? n : 1));
  uint32_t *seen = calloc(groups ? groups : 1, sizeof *seen); /* group -> its target rank + 1 */
  int rc = 0;
  if (!ranks || !seen) {
    rc = error_set(e, ERR_QUOTA, "Reduce: out of memory on the server");
    goto out;
  }
  mesh_ranks(target, ranks);
  for (size_t k = 0; k < n && !rc; k++) {
    if (!mesh_contains(src, ranks[k])) {
      rc = error_set(e, ERR_WRONG_MESH,
                     "Reduce: the target mesh %llu %s is not a sub-mesh of the input's mesh %llu "
                     "%s: rank %u is not in it", tref, td, sref, sd, ranks[k]);
      break;
    }
    /* The group's index: row-major over the dims that are not reduced. */
    size_t g = 0;
    for (int d = 0; d < src->ndim; d++) {
      bool reduced = false;
      for (int i = 0; i < ndims; i++) reduced |= dims[i] == d;
      if (!reduced) g = g * (size_t)src->slice.sizes[d] + (size_t)mesh_coord(src, ranks[k], d);
    }
    if (seen[g])
      rc = error_set(e, ERR_WRONG_MESH,
                     "Reduce: ranks %u and %u of the target mesh %llu %s are in the same reduced "
                     "group of mesh %llu %s; the target needs exactly one rank of each group",
                     seen[g] - 1, ranks[k], tref, td, sref, sd);
    seen[g] = ranks[k] + 1;
  }
  if (!rc && n != groups)
    rc = error_set(e, ERR_WRONG_MESH,
                   "Reduce: the target mesh %llu %s has %zu rank(s) but reducing mesh %llu %s makes "
                   "%zu group(s); the target needs exactly one rank of each group", tref, td, n,
                   sref, sd, groups);
out:
  free(ranks);
  free(seen);
  return rc;
}

static int cmd_reduce(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                      cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__Reduce *r = c->reduce;
  const char *cmd = "Reduce";
  reduction_t red = reduction_parse(r->reduction);
  if (red == RED_INVALID)
    return error_set(e, ERR_BAD_ARGUMENT, "Reduce: unknown reduction '%s'; expected one of %s",
                     r->reduction, reduction_names());
  if (r->inplace && r->ref)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Reduce: an in-place reduce (reduce_) returns its input; leave ref at 0");
  if (r->ref && check_new(s, o, cmd, OBJ_TENSOR, &r->ref, 1, e)) return -1;
  if (!r->inplace && !r->out && !r->ref)
    return error_set(e, ERR_BAD_ARGUMENT, "Reduce: ref (the result) is missing");
  if (resolve_stream(o, cmd, r->stream, e)) return -1;
  obj_t *in = check_tensor(o, cmd, "input", r->input, e);
  if (!in) return -1;
  obj_t *outt = NULL;
  if (r->out && !(outt = check_tensor(o, cmd, "out", r->out, e))) return -1;
  if (r->inplace && outt)
    return error_set(e, ERR_BAD_ARGUMENT, "Reduce: inplace and out cannot both be given");
  const mesh_t *target = NULL;
  if (r->mesh) {
    if (r->scatter)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "Reduce: scatter onto mesh %llu: a reduce-scatter leaves a part on every "
                       "member; onto a sub-mesh one member of each group keeps the whole result "
                       "(drop scatter or mesh)", (unsigned long long)r->mesh);
    if (r->inplace)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "Reduce: in place onto mesh %llu: the input's mesh keeps its tensor; use "
                       "reduce(..., mesh=) for a new result there", (unsigned long long)r->mesh);
    if (!(target = resolve_mesh(o, cmd, "mesh", r->mesh, e))) return -1;
  }

  tensor_use_t uses[2] = {{in, "input", r->inplace}, {outt, "out", true}};
  uint64_t mesh_ref = 0;
  if (check_uses(o, cmd, uses, outt && !target ? 2 : 1, &mesh_ref, r->stream, e)) return -1;
  uint64_t target_ref = target ? target->ref : 0;
  if (outt && target && check_uses(o, cmd, &uses[1], 1, &target_ref, r->stream, e)) return -1;
  const mesh_t *mesh = objects_get(o, mesh_ref)->mesh;
  char mesh_dims[200];
  mesh_format(mesh, mesh_dims, sizeof mesh_dims);

  /* dims: () means every dim of the mesh. */
  int dims[NDSLICE_MAX_DIMS], ndims = 0;
  if (r->n_dims == 0) {
    for (int i = 0; i < mesh->ndim; i++) dims[ndims++] = i;
  } else {
    if (r->n_dims > NDSLICE_MAX_DIMS)
      return error_set(e, ERR_BAD_DIM, "Reduce: %zu dims, but the mesh has %d", r->n_dims, mesh->ndim);
    for (size_t i = 0; i < r->n_dims; i++) {
      int d = mesh_find_dim(mesh, r->dims[i]);
      if (d < 0)
        return error_set(e, ERR_BAD_DIM, "Reduce: mesh %llu %s has no dim '%s'",
                         (unsigned long long)mesh->ref, mesh_dims, r->dims[i]);
      for (int j = 0; j < ndims; j++)
        if (dims[j] == d)
          return error_set(e, ERR_BAD_DIM, "Reduce: dim '%s' is named twice", r->dims[i]);
      dims[ndims++] = d;
    }
  }
  int64_t group = 1;
  for (int i = 0; i < ndims; i++) group *= mesh->slice.sizes[dims[i]];
  /* The shape and dtype rules are the agents' too (reduction.h). */
  tensor_meta_t in_meta, out_meta;
  reduce_args_t ra = {.reduction = red,
                      .scatter = r->scatter,
                      .inplace = r->inplace,
                      .input = obj_meta(in, &in_meta),
                      .out = outt ? obj_meta(outt, &out_meta) : NULL,
                      .group = group,
                      .ndims = ndims,
                      .dims_named = r->n_dims > 0,
                      .dim = ndims == 1 ? mesh->names[dims[0]] : NULL};
  tensor_meta_t rm;
  if (reduce_infer(&ra, &rm, e)) return -1;
  if (target && check_reduce_target(mesh, target, dims, ndims, e)) return -1;
  const mesh_t *home = target ? target : mesh; /* where the result lives */
  if (command_check_mesh_alive(fe->pool, mesh, cmd, e)) return -1;
  if (!r->inplace && !outt && check_room(fe, s, o, home, cmd, meta_nbytes(&rm), e)) return -1;
  /* Its instructions grow with the group's ranks squared: one too big to
   * queue even alone is refused (a Submit message waits for room past it). */
  uint64_t bytes = emit_reduce_bytes_min(fe, mesh, group, fe->max_command_bytes);
  if (bytes > fe->max_command_bytes)
    return error_set(e, ERR_QUOTA,
                     "Reduce: over mesh %llu %s in groups of %lld ranks, this one command would "
                     "queue at least %llu bytes of instructions for the agents (every rank's lists "
                     "its group), more than one command or Submit message may (%llu: 4x the "
                     "session's flow bound, --session-max-queued-bytes); reduce over fewer "
                     "ranks, or raise the bound", (unsigned long long)mesh->ref, mesh_dims,
                     (long long)group, (unsigned long long)bytes,
                     (unsigned long long)fe->max_command_bytes);

  obj_t *res;
  if (r->inplace) res = in;
  else if (r->ref == 0) res = outt;
  else if (outt) res = objects_new_view(o, r->ref, &out_meta, outt);
  else res = objects_new_tensor(o, r->ref, &rm, home->ref, r->stream, (uint64_t)mesh_len(home));
  if (!res) return error_set(e, ERR_QUOTA, "Reduce: out of memory on the server");
  if (r->ref) claim_refs(s, &r->ref, 1);
  /* out is a mutated input too (Monarch: ts = [self, out]): a result under its
   * own ref is a view of out's storage, failed if out is. */
  obj_t *ins[2] = {in, outt};
  inherit_failure(o, res, first_failed(ins, 2), out->res.seq);
  emit_reduce(fe, s, o, mesh, target, r, in, res, dims, ndims);
  return add_tensor(out, res);
}

/* ------------------------------------------------------------------ to_mesh */

static int cmd_to_mesh(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                       cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__ToMesh *t = c->to_mesh;
  const char *cmd = "ToMesh";
  if (check_new(s, o, cmd, OBJ_TENSOR, &t->ref, 1, e)) return -1;
  obj_t *in = check_tensor(o, cmd, "input", t->input, e);
  if (!in) return -1;
  tensor_use_t use = {in, "input", false};
  uint64_t src_ref = 0;
  if (check_uses(o, cmd, &use, 1, &src_ref, in->tensor.stream, e)) return -1;
  const mesh_t *whole = objects_get(o, src_ref)->mesh;
  mesh_t src = *whole;
  if (t->n_selection && mesh_slice_proto(whole, whole->ref, t->selection, t->n_selection, cmd, &src, e))
    return -1;
  mesh_t *dst = resolve_mesh(o, cmd, "dst_mesh", t->dst_mesh, e);
  if (!dst || resolve_stream(o, cmd, t->dst_stream, e)) return -1;
  char sd[200], dd[200];
  mesh_format(&src, sd, sizeof sd);
  mesh_format(dst, dd, sizeof dd);
  for (int i = 0; i < src.ndim; i++) {
    int j = mesh_find_dim(dst, src.names[i]);
    if (j < 0)
      return error_set(e, ERR_BAD_DIM,
                       "ToMesh: the source mesh %s has dim '%s', which the destination %s lacks; "
                       "select one index of it first (slice_mesh(%s=i))",
                       sd, src.names[i], dd, src.names[i]);
    if (dst->slice.sizes[j] != src.slice.sizes[i])
      return error_set(e, ERR_SHAPE_MISMATCH,
                       "ToMesh: dim '%s' has size %lld on the source %s but %lld on the destination %s",
                       src.names[i], (long long)src.slice.sizes[i], sd,
                       (long long)dst->slice.sizes[j], dd);
  }
  tensor_meta_t rm, im;
  obj_meta(in, &im);
  rm.dtype = im.dtype;
  if (layout_contiguous(&rm.layout, im.layout.sizes, im.layout.ndim, dtype_size(rm.dtype), "ToMesh", e))
    return -1;
  uint64_t ranks = (uint64_t)mesh_len(dst);
  /* The senders too: a lost one would leave its receivers waiting. */
  if (command_check_mesh_alive(fe->pool, &src, cmd, e)) return -1;
  if (check_room(fe, s, o, dst, cmd, meta_nbytes(&rm), e)) return -1;
  obj_t *res = objects_new_tensor(o, t->ref, &rm, dst->ref, t->dst_stream, ranks);
  if (!res) return error_set(e, ERR_QUOTA, "ToMesh: out of memory on the server");
  claim_refs(s, &t->ref, 1);
  obj_t *ins[1] = {in};
  inherit_failure(o, res, first_failed(ins, 1), out->res.seq);
  emit_to_mesh(fe, s, o, &src, dst, in, res);
  return add_tensor(out, res);
}

/* ------------------------------------------------------------------ borrows, drop */

static int cmd_borrow(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                      cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__Borrow *b = c->borrow;
  uint64_t refs[2] = {b->ref, b->borrow};
  if (check_new(s, o, "Borrow", OBJ_BORROW, refs, 2, e)) return -1;
  if (resolve_stream(o, "Borrow", b->stream, e)) return -1;
  obj_t *in = check_tensor(o, "Borrow", "input", b->input, e);
  if (!in) return -1;
  if (borrow_create(o, b->borrow, b->ref, in, b->stream, b->mutable_, e)) return -1;
  claim_refs(s, refs, 2);
  obj_t *handle = objects_get(o, b->ref);
  obj_t *ins[1] = {in};
  inherit_failure(o, handle, first_failed(ins, 1), out->res.seq); /* as the agents do */
  emit_borrow(fe, s, o, objects_get(o, b->borrow), in, handle, false);
  return add_tensor(out, handle);
}

static int cmd_drop_borrow(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                           cmd_out_t *out, meshd_error_t *e) {
  obj_t *b = objects_expect(o, c->drop_borrow->borrow, OBJ_BORROW, "DropBorrow: borrow", e);
  if (!b) return -1;
  /* Its handle borrowed in turn (through a view too, the handle released or
   * not): dropping it would leave that borrow's origin gone. */
  storage_t *hs = b->borrow.result_storage;
  if (hs->read_borrows || hs->mutable_borrow)
    return error_set(e, ERR_BORROWED,
                     "DropBorrow: borrow %llu's tensor %llu (or a view of it) is borrowed in turn "
                     "(borrow %llu); drop that borrow first", (unsigned long long)b->ref,
                     (unsigned long long)b->borrow.result,
                     (unsigned long long)borrow_holder(o, hs));
  /* The handle's views go on the agents too, before its last use (which
   * deletes the handle itself): they hold the origin's memory. */
  emit_deletes_t del = {0};
  for (const obj_t *a = hs->aliases; a; a = a->tensor.next_alias)
    if (a->ref != b->borrow.result)
      emit_delete_add(fe, s, o, &del, a->tensor.mesh, b->borrow.to_stream, a->ref);
  emit_delete_flush(fe, s, o, &del);
  emit_borrow(fe, s, o, b, objects_get(o, b->borrow.origin), objects_get(o, b->borrow.result),
              true);
  return borrow_drop(o, b, out->res.seq, e); /* frees b */
}

/* At most --max-command-refs refs in one Drop or Release. */
static int check_command_refs(const session_t *s, const char *what, const char *verb, size_t n,
                              meshd_error_t *e) {
  uint64_t most = s->limits.max_command_refs;
  if (!most || n <= most) return 0;
  return error_set(e, ERR_QUOTA,
                   "%s: %zu refs in one command, more than the %llu one command may name here "
                   "(--max-command-refs); %s them in several commands",
                   what, n, (unsigned long long)most, verb);
}

static int cmd_drop(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                    cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__Drop *d = c->drop;
  if (check_command_refs(s, "Drop", "drop", d->n_refs, e)) return -1;
  for (size_t i = 0; i < d->n_refs; i++) { /* all or nothing */
    uint64_t ref = d->refs[i];
    /* dropping twice is a no-op, also long after the first time */
    const tombstone_t *gb = objects_dropped_borrow(o, ref);
    if (gb)
      return error_set(e, ERR_BAD_ARGUMENT, "Drop: ref %llu is a borrow (dropped by command %llu); "
                       "only tensors are dropped", (unsigned long long)ref,
                       (unsigned long long)gb->seq);
    if (objects_dropped(o, ref) || objects_forgotten(o, ref)) continue;
    obj_t *t = objects_get(o, ref);
    if (!t)
      return error_set(e, ERR_UNKNOWN_REF, "Drop: ref %llu was never defined in this session",
                       (unsigned long long)ref);
    if (t->kind != OBJ_TENSOR)
      return error_set(e, ERR_BAD_ARGUMENT, "Drop: ref %llu is a %s; only tensors are dropped",
                       (unsigned long long)ref, obj_kind_name(t->kind));
    const storage_t *st = t->tensor.storage;
    if (st->read_borrows || st->mutable_borrow)
      return error_set(e, ERR_BORROWED,
                       "Drop: tensor %llu (or a view of it) is borrowed (borrow %llu); drop the "
                       "borrow first", (unsigned long long)ref,
                       (unsigned long long)borrow_holder(o, st));
  }
  emit_deletes_t del = {0};
  for (size_t i = 0; i < d->n_refs; i++) {
    obj_t *t = objects_get(o, d->refs[i]); /* NULL: dropped with an earlier alias */
    if (!t) continue;
    emit_drop(fe, s, o, &del, t);
    objects_drop_storage(o, t->tensor.storage, out->res.seq);
  }
  emit_delete_flush(fe, s, o, &del);
  return 0;
}

/* Release: each ref lets go of its tensor record; aliases keep the storage
 * (docs/protocol.md). Checked whole first: nothing is released on an error. */
static int cmd_release(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                       cmd_out_t *out, meshd_error_t *e) {
  const Meshd__V1__Release *r = c->release;
  if (check_command_refs(s, "Release", "release", r->n_refs, e)) return -1;
  for (size_t i = 0; i < r->n_refs; i++) {
    uint64_t ref = r->refs[i];
    if (objects_dropped_borrow(o, ref))
      return error_set(e, ERR_BAD_ARGUMENT, "Release: ref %llu is a borrow; end it with DropBorrow",
                       (unsigned long long)ref);
    const obj_t *t = objects_get(o, ref);
    if (!t) continue; /* not live: released or dropped before, or its command was rejected */
    if (t->kind != OBJ_TENSOR)
      return error_set(e, ERR_BAD_ARGUMENT, "Release: ref %llu is a %s; only tensors are released%s",
                       (unsigned long long)ref, obj_kind_name(t->kind),
                       t->kind == OBJ_BORROW ? " (end a borrow with DropBorrow)" : "");
    const storage_t *st = t->tensor.storage;
    if (st->read_borrows || st->mutable_borrow)
      return error_set(e, ERR_BORROWED,
                       "Release: tensor %llu (or a view of it) is borrowed (borrow %llu); drop "
                       "the borrow first", (unsigned long long)ref,
                       (unsigned long long)borrow_holder(o, st));
  }
  /* DeleteRefs in batches of refs on one mesh and stream, in the command's order. */
  emit_deletes_t del = {0};
  for (size_t i = 0; i < r->n_refs; i++) {
    obj_t *t = objects_get(o, r->refs[i]);
    if (!t) continue; /* named twice */
    emit_delete_add(fe, s, o, &del, t->tensor.mesh, t->tensor.stream, t->ref);
    objects_release(o, t, out->res.seq);
  }
  emit_delete_flush(fe, s, o, &del);
  return 0;
}

/* ------------------------------------------------------------------ sync, describe */

static int cmd_sync(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                    cmd_out_t *out, meshd_error_t *e) {
  if (c->sync->has_stream && resolve_stream(o, "Sync", c->sync->stream, e)) return -1;
  return 0; /* the caller waits for the agents (emit_sync) before answering */
}

static int cmd_describe(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *c,
                        cmd_out_t *out, meshd_error_t *e) {
  uint64_t ref = c->describe->ref;
  obj_t *it = objects_get(o, ref);
  const tombstone_t *g = it ? NULL : objects_dropped(o, ref);
  if (g) { /* only the drop is known about a dropped tensor */
    Meshd__V1__TensorMeta *m = out_alloc(out, sizeof *m);
    Meshd__V1__TensorMeta **mp = out_alloc(out, sizeof *mp);
    Meshd__V1__Error *err = out_alloc(out, sizeof *err);
    char *msg = out_alloc(out, 96);
    if (!m || !mp || !err || !msg) return error_set(e, ERR_QUOTA, "Describe: out of memory on the server");
    meshd__v1__tensor_meta__init(m);
    meshd__v1__error__init(err);
    snprintf(msg, 96, "dropped at command seq %llu", (unsigned long long)g->seq);
    err->kind = MESHD__V1__ERROR_KIND__ERROR_KIND_DROPPED;
    err->message = msg;
    err->code = (int32_t)error_kind_code(ERR_DROPPED);
    err->seq = g->seq;
    err->ref = ref;
    m->ref = ref;
    m->state = MESHD__V1__TENSOR_STATE__TENSOR_STATE_DROPPED;
    m->error = err;
    *mp = m;
    out->res.tensors = mp;
    out->res.n_tensors = 1;
    return 0;
  }
  const tombstone_t *gb = it ? NULL : objects_dropped_borrow(o, ref);
  if (gb)
    return error_set(e, ERR_BAD_ARGUMENT, "Describe: ref %llu is a borrow (dropped by command "
                     "%llu); Describe takes tensors and meshes", (unsigned long long)ref,
                     (unsigned long long)gb->seq);
  if (!it)
    return error_set(e, ERR_UNKNOWN_REF, "Describe: ref %llu was never defined in this session",
                     (unsigned long long)ref);
  if (it->kind == OBJ_TENSOR) return add_tensor(out, it);
  if (it->kind == OBJ_MESH) return add_mesh(fe, out, it->mesh);
  return error_set(e, ERR_BAD_ARGUMENT, "Describe: ref %llu is a %s; Describe takes tensors and meshes",
                   (unsigned long long)ref, obj_kind_name(it->kind));
}

/* ------------------------------------------------------------------ the table */

typedef int (*handler_fn)(frontend_t *, session_t *, objects_t *, const Meshd__V1__Command *,
                          cmd_out_t *, meshd_error_t *);

static const struct {
  Meshd__V1__Command__KindCase kind;
  const char *name;
  handler_fn fn;
} handlers[] = {
    {MESHD__V1__COMMAND__KIND_CREATE_MESH, "CreateMesh", cmd_create_mesh},
    {MESHD__V1__COMMAND__KIND_SLICE_MESH, "SliceMesh", cmd_slice_mesh},
    {MESHD__V1__COMMAND__KIND_CREATE_STREAM, "CreateStream", cmd_create_stream},
    {MESHD__V1__COMMAND__KIND_FACTORY, "Factory", cmd_factory},
    {MESHD__V1__COMMAND__KIND_CALL, "Call", cmd_call},
    {MESHD__V1__COMMAND__KIND_REDUCE, "Reduce", cmd_reduce},
    {MESHD__V1__COMMAND__KIND_TO_MESH, "ToMesh", cmd_to_mesh},
    {MESHD__V1__COMMAND__KIND_BORROW, "Borrow", cmd_borrow},
    {MESHD__V1__COMMAND__KIND_DROP_BORROW, "DropBorrow", cmd_drop_borrow},
    {MESHD__V1__COMMAND__KIND_DROP, "Drop", cmd_drop},
    {MESHD__V1__COMMAND__KIND_RELEASE, "Release", cmd_release},
    {MESHD__V1__COMMAND__KIND_SYNC, "Sync", cmd_sync},
    {MESHD__V1__COMMAND__KIND_DESCRIBE, "Describe", cmd_describe},
    {MESHD__V1__COMMAND__KIND_LOAD, "Load", cmd_load},
    {MESHD__V1__COMMAND__KIND_LITERAL, "Literal", cmd_literal},
};

const char *command_name(const Meshd__V1__Command *cmd) {
  for (size_t i = 0; i < sizeof handlers / sizeof *handlers; i++)
    if (handlers[i].kind == cmd->kind_case) return handlers[i].name;
  return "(empty command)";
}

int command_run(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *cmd,
                cmd_out_t *out, meshd_error_t *e) {
  for (size_t i = 0; i < sizeof handlers / sizeof *handlers; i++) {
    if (handlers[i].kind != cmd->kind_case) continue;
    memset(e, 0, sizeof *e);
    o->current_seq = cmd->seq;
    return handlers[i].fn(fe, s, o, cmd, out, e);
  }
  return error_set(e, ERR_BAD_ARGUMENT,
                   "Command %llu has no kind: set one of create_mesh, slice_mesh, create_stream, "
                   "factory, call, reduce, to_mesh, borrow, drop_borrow, drop, sync, describe, load, "
                   "release, literal",
                   (unsigned long long)cmd->seq);
}
