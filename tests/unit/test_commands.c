/* server/commands: command_run end to end, in process, without agents.
 *
 * The pool holds 8 registered agents marked healthy but with no Execute link,
 * so CreateMesh accepts meshes over ranks 0..7 and every instruction the
 * handlers emit fails to send (logged, ignored): only the server-side checks
 * and metadata are under test. Criterion forks per test. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "commands.h"
#include "emit.h"
#include "reduction.h"
#include "log.h"
#include "rpc.h"

/* Out of memory on demand (calloc interposed in this test binary): armed
 * with N, the Nth calloc of one server storage record (objects_new_tensor's
 * first allocation) from then on fails. Idle otherwise. */
#if !defined(__SANITIZE_ADDRESS__)
extern void *__libc_calloc(size_t n, size_t size);
static atomic_int storage_fail_in;

void *calloc(size_t n, size_t size) {
  if (n == 1 && size == sizeof(storage_t) && atomic_load(&storage_fail_in) > 0 &&
      atomic_fetch_sub(&storage_fail_in, 1) == 1)
    return NULL;
  return __libc_calloc(n, size);
}
#endif

typedef Meshd__V1__Arg arg_t;
typedef Meshd__V1__Kwarg kwarg_t;
typedef Meshd__V1__MeshSelector sel_t;
typedef Meshd__V1__TensorMeta tmeta_t;

static agent_pool_t *pool;
static frontend_t fe;
static session_table_t *table;
static session_t *sess;
static objects_t *objs;
static cmd_out_t out;
static meshd_error_t err;
static uint64_t last_seq = 100;

/* Messages built by the helpers below, freed after each test. */
static void *arena[1024];
static size_t narena;

static void *keep(size_t size) {
  cr_assert_lt(narena, sizeof arena / sizeof *arena, "test arena full");
  void *p = calloc(1, size);
  cr_assert_not_null(p);
  return arena[narena++] = p;
}

/* World: meshes ROOT {host: 2, gpu: 4} (ranks 0..7) and SUB = ROOT[host=1]
 * {gpu: 4} (ranks 4..7), stream SIDE "side". Tests use refs from 10 on. */
#define ROOT 1
#define SUB 2
#define SIDE 3

static void destroy_objects(void *p) { objects_destroy(p); }

static void open_session(uint64_t quota) {
  if (sess) session_release(sess);
  cr_assert_eq(session_create(table, "anonymous", "unit", 0, quota, &sess, &err), 0, "%s", err.msg);
  objs = objects_create();
  cr_assert_not_null(objs);
  pthread_mutex_lock(&sess->mu);
  session_set_objects(sess, objs, destroy_objects);
  pthread_mutex_unlock(&sess->mu);
}

static int run(Meshd__V1__Command *c) {
  cmd_out_free(&out);
  c->seq = ++last_seq;
  cmd_out_init(&out, c->seq);
  memset(&err, 0, sizeof err);
  return command_run(&fe, sess, objs, c, &out, &err);
}

static void ok(int rc) {
  cr_assert_eq(rc, 0, "rejected: %s: %s", error_kind_name(err.kind), err.msg);
  cr_assert_null(out.res.error);
  cr_assert_eq(out.res.seq, last_seq);
}

/* rc is a rejection of `kind` whose message holds every needle (NULL-ended). */
static void expect_reject(int rc, error_kind_t kind, ...) {
  cr_assert_eq(rc, -1, "accepted, but %s was expected", error_kind_name(kind));
  cr_assert_eq(err.kind, kind, "kind %s, want %s: %s", error_kind_name(err.kind),
               error_kind_name(kind), err.msg);
  va_list ap;
  va_start(ap, kind);
  for (const char *n; (n = va_arg(ap, const char *));)
    cr_assert(strstr(err.msg, n), "message '%s' lacks '%s'", err.msg, n);
  va_end(ap);
}
#define REJECT(rc, kind, ...) expect_reject(rc, kind, __VA_ARGS__, (const char *)NULL)

/* ------------------------------------------------------------------ builders */

#define NAMES(...) ((const char *const[]){__VA_ARGS__})
#define I64(...) ((const int64_t[]){__VA_ARGS__})
#define COUNT(T, ...) (sizeof((T[]){__VA_ARGS__}) / sizeof(T))

static int create_mesh(uint64_t ref, const char *const *names, const int64_t *sizes, size_t n) {
  Meshd__V1__CreateMesh m = MESHD__V1__CREATE_MESH__INIT;
  Meshd__V1__Dim dims[8], *dimp[8];
  for (size_t i = 0; i < n; i++) {
    meshd__v1__dim__init(&dims[i]);
    dims[i].name = (char *)names[i];
    dims[i].size = sizes[i];
    dimp[i] = &dims[i];
  }
  m.ref = ref;
  m.n_dims = n;
  m.dims = dimp;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_CREATE_MESH;
  c.create_mesh = &m;
  return run(&c);
}

static sel_t *sel_index(const char *dim, int64_t i) {
  sel_t *s = keep(sizeof *s);
  meshd__v1__mesh_selector__init(s);
  s->dim = (char *)dim;
  s->sel_case = MESHD__V1__MESH_SELECTOR__SEL_INDEX;
  s->index = i;
  return s;
}

static sel_t *sel_range(const char *dim, int64_t start, int64_t stop) {
  sel_t *s = keep(sizeof *s);
  meshd__v1__mesh_selector__init(s);
  Meshd__V1__Range *r = keep(sizeof *r);
  meshd__v1__range__init(r);
  r->start = start;
  r->stop = stop;
  r->has_stop = true;
  s->dim = (char *)dim;
  s->sel_case = MESHD__V1__MESH_SELECTOR__SEL_RANGE;
  s->range = r;
  return s;
}

static int slice_mesh(uint64_t ref, uint64_t parent, sel_t **sel, size_t n) {
  Meshd__V1__SliceMesh m = MESHD__V1__SLICE_MESH__INIT;
  m.ref = ref;
  m.parent = parent;
  m.n_selectors = n;
  m.selectors = sel;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_SLICE_MESH;
  c.slice_mesh = &m;
  return run(&c);
}
#define SELS(...) (sel_t *[]){__VA_ARGS__}, COUNT(sel_t *, __VA_ARGS__)

static int create_stream(uint64_t ref, const char *name) {
  Meshd__V1__CreateStream m = MESHD__V1__CREATE_STREAM__INIT;
  m.ref = ref;
  m.name = (char *)name;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_CREATE_STREAM;
  c.create_stream = &m;
  return run(&c);
}

typedef struct fac {
  uint64_t ref, mesh, stream;
  const char *kind;
  const int64_t *shape;
  size_t nshape;
  int dtype;
  double value, start, end, step;
  const char *dim;
  bool has_seed;
  uint64_t seed;
} fac_t;

static int factory(fac_t f) {
  Meshd__V1__Factory m = MESHD__V1__FACTORY__INIT;
  m.ref = f.ref;
  m.mesh = f.mesh;
  m.stream = f.stream;
  m.kind = (char *)(f.kind ? f.kind : "zeros");
  m.shape = (int64_t *)f.shape;
  m.n_shape = f.nshape;
  m.dtype = (Meshd__V1__DType)f.dtype;
  m.value = f.value;
  m.start = f.start;
  m.end = f.end;
  m.step = f.step;
  m.has_seed = f.has_seed;
  m.seed = f.seed;
  if (f.dim) m.dim = (char *)f.dim;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_FACTORY;
  c.factory = &m;
  return run(&c);
}
#define FACTORY(...) factory((fac_t){__VA_ARGS__})
#define SHAPE(...) .shape = I64(__VA_ARGS__), .nshape = COUNT(int64_t, __VA_ARGS__)

/* zeros of `shape` (float32 unless dtype) on ROOT/main, which must be accepted. */
static void zeros(uint64_t ref, uint64_t mesh, uint64_t stream, int dtype, const int64_t *shape,
                  size_t n) {
  ok(factory((fac_t){.ref = ref, .mesh = mesh, .stream = stream, .dtype = dtype, .shape = shape,
                     .nshape = n}));
}
#define ZEROS(ref, ...) zeros(ref, ROOT, STREAM_MAIN, 0, I64(__VA_ARGS__), COUNT(int64_t, __VA_ARGS__))

static arg_t *new_arg(Meshd__V1__Arg__ValueCase k) {
  arg_t *a = keep(sizeof *a);
  meshd__v1__arg__init(a);
  a->value_case = k;
  return a;
}
static arg_t *aref(uint64_t r) {
  arg_t *a = new_arg(MESHD__V1__ARG__VALUE_REF);
  a->ref = r;
  return a;
}
static arg_t *aint(int64_t i) {
  arg_t *a = new_arg(MESHD__V1__ARG__VALUE_I);
  a->i = i;
  return a;
}
static arg_t *afloat(double f) {
  arg_t *a = new_arg(MESHD__V1__ARG__VALUE_F);
  a->f = f;
  return a;
}
static arg_t *abool(bool b) {
  arg_t *a = new_arg(MESHD__V1__ARG__VALUE_B);
  a->b = b;
  return a;
}
static arg_t *adtype(int d) {
  arg_t *a = new_arg(MESHD__V1__ARG__VALUE_DTYPE);
  a->dtype = (Meshd__V1__DType)d;
  return a;
}
static arg_t *aints_(const int64_t *v, size_t n) {
  arg_t *a = new_arg(MESHD__V1__ARG__VALUE_INTS);
  Meshd__V1__IntList *l = keep(sizeof *l);
  meshd__v1__int_list__init(l);
  l->values = keep(sizeof(int64_t) * (n ? n : 1));
  memcpy(l->values, v, sizeof(int64_t) * n);
  l->n_values = n;
  a->ints = l;
  return a;
}
#define AINTS(...) aints_(I64(__VA_ARGS__), COUNT(int64_t, __VA_ARGS__))
static arg_t *arefs_(const uint64_t *v, size_t n) {
  arg_t *a = new_arg(MESHD__V1__ARG__VALUE_REFS);
  Meshd__V1__RefList *l = keep(sizeof *l);
  meshd__v1__ref_list__init(l);
  l->refs = keep(sizeof(uint64_t) * (n ? n : 1));
  memcpy(l->refs, v, sizeof(uint64_t) * n);
  l->n_refs = n;
  a->refs = l;
  return a;
}
#define AREFS(...) arefs_((const uint64_t[]){__VA_ARGS__}, COUNT(uint64_t, __VA_ARGS__))
static kwarg_t *kw(const char *name, arg_t *v) {
  kwarg_t *k = keep(sizeof *k);
  meshd__v1__kwarg__init(k);
  k->name = (char *)name;
  k->value = v;
  return k;
}

static int call_full(const char *op, uint64_t stream, arg_t **args, size_t nargs, kwarg_t **kws,
                     size_t nkw, const uint64_t *results, size_t nres) {
  Meshd__V1__Call m = MESHD__V1__CALL__INIT;
  m.op = (char *)op;
  m.stream = stream;
  m.args = args;
  m.n_args = nargs;
  m.kwargs = kws;
  m.n_kwargs = nkw;
  m.results = (uint64_t *)results;
  m.n_results = nres;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_CALL;
  c.call = &m;
  return run(&c);
}
#define ARGS(...) (arg_t *[]){__VA_ARGS__}, COUNT(arg_t *, __VA_ARGS__)
#define KWARGS(...) (kwarg_t *[]){__VA_ARGS__}, COUNT(kwarg_t *, __VA_ARGS__)
#define NOKW NULL, 0
#define RES(...) (const uint64_t[]){__VA_ARGS__}, COUNT(uint64_t, __VA_ARGS__)
#define NORES NULL, 0
/* CALL(op, stream, ARGS(...), RES(...)) without keywords. */
#define CALL(op, stream, args, res) call_full(op, stream, args, NOKW, res)

typedef struct red {
  uint64_t ref, input, out, stream;
  const char *dims[4];
  const char *reduction;
  bool scatter, inplace;
} red_t;

static int reduce(red_t r) {
  Meshd__V1__Reduce m = MESHD__V1__REDUCE__INIT;
  m.ref = r.ref;
  m.input = r.input;
  m.out = r.out;
  m.stream = r.stream;
  size_t n = 0;
  while (n < 4 && r.dims[n]) n++;
  m.dims = (char **)r.dims;
  m.n_dims = n;
  m.reduction = (char *)(r.reduction ? r.reduction : "sum");
  m.scatter = r.scatter;
  m.inplace = r.inplace;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_REDUCE;
  c.reduce = &m;
  return run(&c);
}
#define REDUCE(...) reduce((red_t){__VA_ARGS__})

typedef struct tomesh {
  uint64_t ref, input, dst_mesh, dst_stream;
  sel_t *sel[4];
} tomesh_t;

static int to_mesh(tomesh_t t) {
  Meshd__V1__ToMesh m = MESHD__V1__TO_MESH__INIT;
  m.ref = t.ref;
  m.input = t.input;
  m.dst_mesh = t.dst_mesh;
  m.dst_stream = t.dst_stream;
  size_t n = 0;
  while (n < 4 && t.sel[n]) n++;
  m.selection = t.sel;
  m.n_selection = n;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_TO_MESH;
  c.to_mesh = &m;
  return run(&c);
}
#define TO_MESH(...) to_mesh((tomesh_t){__VA_ARGS__})

static int borrow(uint64_t handle, uint64_t input, uint64_t stream, bool mut, uint64_t bref) {
  Meshd__V1__Borrow m = MESHD__V1__BORROW__INIT;
  m.ref = handle;
  m.input = input;
  m.stream = stream;
  m.mutable_ = mut;
  m.borrow = bref;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_BORROW;
  c.borrow = &m;
  return run(&c);
}

static int drop_borrow(uint64_t bref) {
  Meshd__V1__DropBorrow m = MESHD__V1__DROP_BORROW__INIT;
  m.borrow = bref;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_DROP_BORROW;
  c.drop_borrow = &m;
  return run(&c);
}

static int drop_(const uint64_t *refs, size_t n) {
  Meshd__V1__Drop m = MESHD__V1__DROP__INIT;
  m.refs = (uint64_t *)refs;
  m.n_refs = n;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_DROP;
  c.drop = &m;
  return run(&c);
}
#define DROP(...) drop_((const uint64_t[]){__VA_ARGS__}, COUNT(uint64_t, __VA_ARGS__))

static int sync_(bool has_stream, uint64_t stream) {
  Meshd__V1__Sync m = MESHD__V1__SYNC__INIT;
  m.has_stream = has_stream;
  m.stream = stream;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_SYNC;
  c.sync = &m;
  return run(&c);
}

static int describe(uint64_t ref) {
  Meshd__V1__Describe m = MESHD__V1__DESCRIBE__INIT;
  m.ref = ref;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_DESCRIBE;
  c.describe = &m;
  return run(&c);
}

/* ------------------------------------------------------------------ result checks */

static const tmeta_t *result(size_t i) {
  cr_assert_gt(out.res.n_tensors, i, "the result has %zu tensors", out.res.n_tensors);
  return out.res.tensors[i];
}

static void expect_ints(const int64_t *got, size_t n, const int64_t *want, size_t nwant,
                        const char *what) {
  char g[200] = "", w[200] = "";
  for (size_t i = 0; i < n; i++) snprintf(g + strlen(g), sizeof g - strlen(g), "%lld ", (long long)got[i]);
  for (size_t i = 0; i < nwant; i++) snprintf(w + strlen(w), sizeof w - strlen(w), "%lld ", (long long)want[i]);
  cr_assert_str_eq(g, w, "%s: got [%s], want [%s]", what, g, w);
}
#define EXPECT_SHAPE(m, ...) expect_ints((m)->shape, (m)->n_shape, I64(__VA_ARGS__), COUNT(int64_t, __VA_ARGS__), "shape")
#define EXPECT_STRIDES(m, ...) expect_ints((m)->strides, (m)->n_strides, I64(__VA_ARGS__), COUNT(int64_t, __VA_ARGS__), "strides")
#define EXPECT_SCALAR(m) cr_assert_eq((m)->n_shape, 0, "a 0-dim result, got %zu dims", (m)->n_shape)

static void expect_meta(const tmeta_t *m, uint64_t ref, int dtype, uint64_t mesh, uint64_t stream) {
  cr_assert_eq(m->ref, ref, "ref %llu, want %llu", (unsigned long long)m->ref, (unsigned long long)ref);
  cr_assert_eq((int)m->dtype, dtype, "dtype %d, want %d", (int)m->dtype, dtype);
  cr_assert_eq(m->mesh, mesh, "mesh %llu, want %llu", (unsigned long long)m->mesh, (unsigned long long)mesh);
  cr_assert_eq(m->stream, stream);
  cr_assert_eq(m->state, MESHD__V1__TENSOR_STATE__TENSOR_STATE_LIVE);
  cr_assert_null(m->error);
}

static void expect_mesh_ranks(const Meshd__V1__MeshMeta *m, const uint32_t *want, size_t n) {
  cr_assert_eq(m->n_ranks, n, "%zu ranks, want %zu", m->n_ranks, n);
  for (size_t i = 0; i < n; i++) cr_assert_eq(m->ranks[i], want[i], "rank %zu: %u, want %u", i, m->ranks[i], want[i]);
}
#define EXPECT_RANKS(m, ...) expect_mesh_ranks(m, (const uint32_t[]){__VA_ARGS__}, COUNT(uint32_t, __VA_ARGS__))

static void expect_mesh_dims(const Meshd__V1__MeshMeta *m, const char *const *names, const int64_t *sizes,
                             size_t n) {
  cr_assert_eq(m->n_dims, n);
  for (size_t i = 0; i < n; i++) {
    cr_assert_str_eq(m->dims[i]->name, names[i]);
    cr_assert_eq(m->dims[i]->size, sizes[i], "dim %s", names[i]);
  }
}

static tensor_state_t state_of(uint64_t ref) {
  obj_t *t = objects_get(objs, ref);
  cr_assert(t && t->kind == OBJ_TENSOR, "ref %llu is not a tensor (%p kind %d)", (unsigned long long)ref, (void *)t, t ? (int)t->kind : -1);
  return t->state;
}

/* ref was dropped: its record is gone and its tombstone says when. */
static uint64_t dropped_seq(uint64_t ref) {
  cr_assert_null(objects_get(objs, ref), "ref %llu still has a record", (unsigned long long)ref);
  const tombstone_t *g = objects_dropped(objs, ref);
  cr_assert_not_null(g, "ref %llu has no tombstone", (unsigned long long)ref);
  return g->seq;
}

static void expect_described_dropped(uint64_t ref, uint64_t seq) {
  ok(describe(ref));
  const tmeta_t *m = result(0);
  cr_assert_eq(m->ref, ref);
  cr_assert_eq(m->state, MESHD__V1__TENSOR_STATE__TENSOR_STATE_DROPPED);
  cr_assert_not_null(m->error);
  cr_assert_eq((int)m->error->kind, ERR_DROPPED);
  cr_assert_eq(m->error->seq, seq);
  cr_assert_eq(m->error->ref, ref);
  char want[64];
  snprintf(want, sizeof want, "dropped at command seq %llu", (unsigned long long)seq);
  cr_assert(strstr(m->error->message, want), "%s", m->error->message);
}

/* The next ref is still free: a rejected command consumed nothing. */
static void expect_ref_free(uint64_t ref) {
  cr_assert_null(objects_get(objs, ref), "ref %llu was defined by a rejected command",
                 (unsigned long long)ref);
  meshd_error_t e;
  cr_assert_eq(session_check_ref(sess, ref, &e), 0, "ref %llu was claimed: %s",
               (unsigned long long)ref, e.msg);
}

/* ------------------------------------------------------------------ fixture */

/* n agents "<prefix>-<i>" at ranks 0 .. n - 1, not healthy yet. */
static void add_agents(agent_pool_t *p, const char *prefix, int n, int port_base) {
  for (int i = 0; i < n; i++) {
    agent_desc_t d = {0};
    snprintf(d.agent_id, sizeof d.agent_id, "%s-%d", prefix, i);
    snprintf(d.address, sizeof d.address, "127.0.0.1:%d", port_base + i);
    snprintf(d.device, sizeof d.device, "cpu");
    d.instructions = MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL;
    char msg[200];
    cr_assert_eq(agent_pool_add(p, &d, i, msg, sizeof msg), i, "%s", msg);
  }
}

static void setup(void) {
  log_set_level(LOG_LEVEL_ERROR); /* every send fails: no links */
  rpc_init();
  pool = agent_pool_create(NULL);
  cr_assert_not_null(pool);
  add_agents(pool, "agent", 8, 1000);
  for (int i = 0; i < 8; i++) {
    char id[32];
    snprintf(id, sizeof id, "agent-%d", i);
    agent_pool_set_healthy(pool, (uint32_t)i, id, 0, true);
  }
  cr_assert_eq(agent_pool_healthy(pool), 8);
  fe.pool = pool;
  table = session_table_create(300, 0, NULL, NULL);
  cr_assert_not_null(table);
  open_session(0);
  ok(create_mesh(ROOT, NAMES("host", "gpu"), I64(2, 4), 2));
  ok(slice_mesh(SUB, ROOT, SELS(sel_index("host", 1))));
  ok(create_stream(SIDE, "side"));
}

static void teardown(void) {
  cmd_out_free(&out);
  if (sess) session_release(sess);
  session_table_destroy(table);
  agent_pool_destroy(pool);
  rpc_shutdown();
  for (size_t i = 0; i < narena; i++) free(arena[i]);
}

TestSuite(commands, .init = setup, .fini = teardown, .timeout = 60);

/* ------------------------------------------------------------------ meshes */

Test(commands, create_mesh_returns_dims_and_ranks) {
  ok(create_mesh(10, NAMES("dp", "tp"), I64(2, 2), 2));
  const Meshd__V1__MeshMeta *m = out.res.mesh;
  cr_assert_not_null(m);
  cr_assert_eq(m->ref, 10);
  expect_mesh_dims(m, NAMES("dp", "tp"), I64(2, 2), 2);
  EXPECT_RANKS(m, 0, 1, 2, 3);
  cr_assert_eq(out.res.n_tensors, 0);
  cr_assert_eq(objects_get(objs, 10)->kind, OBJ_MESH);
  /* Describe of a mesh gives the same */
  ok(describe(ROOT));
  expect_mesh_dims(out.res.mesh, NAMES("host", "gpu"), I64(2, 4), 2);
  EXPECT_RANKS(out.res.mesh, 0, 1, 2, 3, 4, 5, 6, 7);
}

Test(commands, create_mesh_rejections) {
  REJECT(create_mesh(SIDE, NAMES("gpu"), I64(2), 1), ERR_REF_REUSED, "CreateMesh: ref 3 was already used",
         "the next free ref is 4");
  REJECT(create_mesh(10, NAMES("a", "a"), I64(2, 2), 2), ERR_BAD_DIM, "CreateMesh: dim 'a' appears twice");
  expect_ref_free(10);
  REJECT(create_mesh(10, NAMES("gpu"), I64(16), 1), ERR_BAD_ARGUMENT, "CreateMesh {gpu: 16}",
         "needs 16 agents (ranks 0..15) but only 8 are healthy");
  REJECT(create_mesh(10, NAMES("gpu"), I64(0), 1), ERR_BAD_ARGUMENT, "CreateMesh: dim 'gpu' has size 0");
  REJECT(create_mesh(10, NAMES("gpu"), I64(1), 0), ERR_BAD_ARGUMENT, "CreateMesh needs at least one dim");
  expect_ref_free(10);
  ok(create_mesh(10, NAMES("gpu"), I64(8), 1));
}

Test(commands, create_mesh_without_healthy_agents) {
  agent_pool_t *empty = agent_pool_create(NULL);
  frontend_t saved = fe;
  fe.pool = empty;
  REJECT(create_mesh(10, NAMES("gpu"), I64(2), 1), ERR_BAD_ARGUMENT,
         "CreateMesh {gpu: 2} needs 2 agents (ranks 0..1) but none of them is healthy");
  fe = saved;
  agent_pool_destroy(empty);
  expect_ref_free(10);
}

Test(commands, slice_mesh_index_and_range) {
  ok(describe(SUB));
  expect_mesh_dims(out.res.mesh, NAMES("gpu"), I64(4), 1);
  EXPECT_RANKS(out.res.mesh, 4, 5, 6, 7);

  ok(slice_mesh(10, ROOT, SELS(sel_range("gpu", 1, 3))));
  cr_assert_eq(out.res.mesh->ref, 10);
  expect_mesh_dims(out.res.mesh, NAMES("host", "gpu"), I64(2, 2), 2);
  EXPECT_RANKS(out.res.mesh, 1, 2, 5, 6);

  sel_t *open_end = sel_range("gpu", 2, 0);
  open_end->range->has_stop = false; /* gpu=2: */
  ok(slice_mesh(12, ROOT, SELS(open_end)));
  expect_mesh_dims(out.res.mesh, NAMES("host", "gpu"), I64(2, 2), 2);
  EXPECT_RANKS(out.res.mesh, 2, 3, 6, 7);

  ok(slice_mesh(13, 10, SELS(sel_index("host", 0), sel_index("gpu", -1))));
  cr_assert_eq(out.res.mesh->n_dims, 0, "every dim sliced away");
  EXPECT_RANKS(out.res.mesh, 2);
}

Test(commands, slice_mesh_rejections) {
  REJECT(slice_mesh(SUB, ROOT, SELS(sel_index("host", 0))), ERR_REF_REUSED, "SliceMesh: ref 2");
  REJECT(slice_mesh(10, 0, SELS(sel_index("host", 0))), ERR_BAD_ARGUMENT,
         "SliceMesh: parent is missing");
  REJECT(slice_mesh(10, SIDE, SELS(sel_index("host", 0))), ERR_UNKNOWN_REF,
         "SliceMesh: parent is ref 3, which is a stream, not a mesh");
  REJECT(slice_mesh(10, 99, SELS(sel_index("host", 0))), ERR_UNKNOWN_REF,
         "SliceMesh: parent is ref 99, which this session never defined");
  REJECT(slice_mesh(10, ROOT, SELS(sel_index("rack", 0))), ERR_BAD_DIM, "SliceMesh", "'rack'");
  REJECT(slice_mesh(10, ROOT, SELS(sel_index("host", 0), sel_index("host", 1))), ERR_BAD_DIM,
         "SliceMesh", "host");
  REJECT(slice_mesh(10, ROOT, SELS(sel_index("host", 2))), ERR_BAD_ARGUMENT,
         "SliceMesh: index 2 is out of range for dim 'host' of size 2");
  sel_t *none = sel_index("gpu", 0);
  none->sel_case = MESHD__V1__MESH_SELECTOR__SEL__NOT_SET;
  REJECT(slice_mesh(10, ROOT, SELS(none)), ERR_BAD_ARGUMENT,
         "SliceMesh: the selector for dim 'gpu' has neither an index nor a range");
  expect_ref_free(10);
}

/* ------------------------------------------------------------------ streams */

Test(commands, create_stream_and_use_it) {
  ok(create_stream(10, "comm"));
  cr_assert_eq(out.res.n_tensors, 0);
  cr_assert_null(out.res.mesh);
  cr_assert_str_eq(objects_stream_name(objs, 10), "comm");
  ok(FACTORY(.ref = 11, .mesh = ROOT, .stream = 10, SHAPE(2)));
  cr_assert_eq(result(0)->stream, 10);
}

Test(commands, create_stream_rejections) {
  REJECT(create_stream(10, ""), ERR_BAD_ARGUMENT, "CreateStream: the name must be 1..63 characters, got 0");
  char longname[65];
  memset(longname, 'x', 64);
  longname[64] = '\0';
  REJECT(create_stream(10, longname), ERR_BAD_ARGUMENT, "CreateStream", "got 64");
  REJECT(create_stream(SIDE, "other"), ERR_REF_REUSED, "CreateStream: ref 3 was already used");
  expect_ref_free(10);
  cr_assert_str_eq(objects_stream_name(objs, SIDE), "side", "the refused command renamed nothing");
}

/* A stream's name is a label, as Monarch's Stream(name) is: two modules that
 * each make Stream("side") (or a Stream("main") beside the default stream)
 * get streams of their own, each with its tensors and borrows, and messages
 * tell same-named streams apart by ref. Before, the second "side" was refused
 * ("names are unique per session"). */
Test(commands, streams_may_share_a_name) {
  ok(create_stream(10, "side")); /* SIDE (ref 3) is "side" too */
  ok(create_stream(11, "main"));
  cr_assert_eq(objs->streams, 3);
  zeros(20, ROOT, SIDE, 0, I64(2), 1);
  zeros(21, ROOT, 10, 0, I64(2), 1);
  zeros(22, ROOT, 11, 0, I64(2), 1);
  ZEROS(23, 2);
  ok(CALL("neg", 10, ARGS(aref(21)), RES(30)));
  expect_meta(result(0), 30, DTYPE_FLOAT32, ROOT, 10);
  REJECT(CALL("add", SIDE, ARGS(aref(20), aref(21)), RES(31)), ERR_WRONG_STREAM,
         "Call add: argument 'other' (tensor 21) is on stream 'side' (ref 10) but the command "
         "runs on stream 'side' (ref 3); borrow it onto 'side' (ref 3) first, or run the command "
         "on 'side' (ref 10)");
  REJECT(CALL("neg", STREAM_MAIN, ARGS(aref(22)), RES(31)), ERR_WRONG_STREAM,
         "(tensor 22) is on stream 'main' (ref 11) but the command runs on stream 'main' (ref 0)");
  REJECT(CALL("neg", 11, ARGS(aref(23)), RES(31)), ERR_WRONG_STREAM,
         "(tensor 23) is on stream 'main' (ref 0) but the command runs on stream 'main' (ref 11)");
  expect_ref_free(31);
  /* borrows between the two "side" streams keep every check */
  ok(borrow(31, 21, SIDE, true, 32));
  ok(CALL("add_", SIDE, ARGS(aref(31), aref(20)), NORES));
  REJECT(CALL("neg", 10, ARGS(aref(21)), RES(33)), ERR_BORROWED,
         "(tensor 21) is mutably borrowed (borrow 32)");
  REJECT(borrow(33, 20, SIDE, false, 34), ERR_BAD_ARGUMENT,
         "Borrow: tensor 20 is already on stream 'side' (ref 3)");
  ok(drop_borrow(32));
  ok(CALL("neg", 10, ARGS(aref(21)), RES(33)));
  /* a name no other stream has keeps its plain label */
  ok(create_stream(40, "solo"));
  zeros(41, ROOT, 40, 0, I64(2), 1);
  REJECT(CALL("neg", STREAM_MAIN, ARGS(aref(41)), RES(42)), ERR_WRONG_STREAM,
         "(tensor 41) is on stream 'solo' but the command runs on stream 'main' (ref 0);");
}

/* ------------------------------------------------------------------ factories */

Test(commands, factory_kinds_and_result_metadata) {
  ok(FACTORY(.ref = 10, .mesh = ROOT, SHAPE(2, 3)));
  const tmeta_t *m = result(0);
  expect_meta(m, 10, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(m, 2, 3);
  EXPECT_STRIDES(m, 3, 1);
  cr_assert_eq(m->storage_offset, 0);
  cr_assert_eq(objs->bytes, 2 * 3 * 4 * 8, "24 bytes on each of 8 ranks");
  cr_assert_eq(objs->live_tensors, 1);

  ok(FACTORY(.ref = 11, .mesh = SUB, .stream = SIDE, .kind = "ones", .dtype = DTYPE_INT64, SHAPE(4)));
  expect_meta(result(0), 11, DTYPE_INT64, SUB, SIDE);
  EXPECT_SHAPE(result(0), 4);
  cr_assert_eq(objs->bytes, 192 + 4 * 8 * 4, "the sub-mesh has 4 ranks");

  ok(FACTORY(.ref = 12, .mesh = ROOT, .kind = "full", .value = 7, .dtype = DTYPE_FLOAT64, SHAPE(1, 2, 3)));
  expect_meta(result(0), 12, DTYPE_FLOAT64, ROOT, STREAM_MAIN);
  EXPECT_STRIDES(result(0), 6, 3, 1);

  ok(FACTORY(.ref = 13, .mesh = ROOT, .kind = "empty", .dtype = DTYPE_BOOL, SHAPE(0, 5)));
  EXPECT_SHAPE(result(0), 0, 5);
  cr_assert_eq((int)result(0)->dtype, DTYPE_BOOL);

  ok(FACTORY(.ref = 14, .mesh = ROOT, .kind = "arange", .start = 0, .end = 10, .step = 2));
  EXPECT_SHAPE(result(0), 5);

  ok(FACTORY(.ref = 15, .mesh = ROOT, .kind = "rand", .has_seed = true, .seed = 3, SHAPE(3)));
  expect_meta(result(0), 15, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  ok(FACTORY(.ref = 16, .mesh = ROOT, .kind = "randn", .dtype = DTYPE_FLOAT16, SHAPE(3)));
  expect_meta(result(0), 16, DTYPE_FLOAT16, ROOT, STREAM_MAIN);

  ok(FACTORY(.ref = 17, .mesh = ROOT, .kind = "rank", .dim = "gpu"));
  expect_meta(result(0), 17, DTYPE_INT64, ROOT, STREAM_MAIN);
  EXPECT_SCALAR(result(0));

  ok(FACTORY(.ref = 18, .mesh = ROOT, SHAPE(0)));
  EXPECT_SHAPE(result(0), 0);
  ok(FACTORY(.ref = 19, .mesh = ROOT, .kind = "zeros"));
  EXPECT_SCALAR(result(0));
  cr_assert_eq(objs->live_tensors, 10);
}

Test(commands, factory_rejections) {
  uint64_t bytes = objs->bytes;
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, .kind = "eye", SHAPE(2)), ERR_BAD_ARGUMENT,
         "Factory: unknown kind 'eye'; expected one of empty, zeros");
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, .dtype = 99, SHAPE(2)), ERR_BAD_ARGUMENT,
         "Factory: unknown dtype 99");
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, .dtype = -1, SHAPE(2)), ERR_BAD_ARGUMENT,
         "Factory: unknown dtype -1");
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, SHAPE(2, -3)), ERR_BAD_ARGUMENT,
         "zeros: argument 'size': negative size -3 at dim 1");
  REJECT(FACTORY(.ref = 10, .mesh = 0, SHAPE(2)), ERR_BAD_ARGUMENT,
         "Factory: mesh is missing: name a mesh created with CreateMesh");
  REJECT(FACTORY(.ref = 10, .mesh = SIDE, SHAPE(2)), ERR_UNKNOWN_REF,
         "Factory: mesh is ref 3, which is a stream, not a mesh");
  REJECT(FACTORY(.ref = 10, .mesh = 77, SHAPE(2)), ERR_UNKNOWN_REF,
         "Factory: mesh is ref 77, which this session never defined");
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, .stream = 77, SHAPE(2)), ERR_UNKNOWN_REF,
         "Factory: stream is ref 77, which this session never defined");
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, .stream = ROOT, SHAPE(2)), ERR_UNKNOWN_REF,
         "Factory: stream is ref 1, which is a mesh, not a stream");
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, .kind = "rank", .dim = "rack"), ERR_BAD_DIM,
         "Factory rank: mesh 1 {host: 2, gpu: 4} has no dim 'rack'");
  REJECT(FACTORY(.ref = 10, .mesh = SUB, .kind = "rank", .dim = "host"), ERR_BAD_DIM,
         "Factory rank: mesh 2 {gpu: 4} has no dim 'host'");
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, .kind = "rank"), ERR_BAD_DIM, "Factory rank", "no dim ''");
  REJECT(FACTORY(.ref = SIDE, .mesh = ROOT, SHAPE(2)), ERR_REF_REUSED, "Factory: ref 3 was already used");
  REJECT(FACTORY(.ref = 0, .mesh = ROOT, SHAPE(2)), ERR_BAD_ARGUMENT, "Factory: ref 0 is not valid");
  expect_ref_free(10);
  cr_assert_eq(objs->bytes, bytes);
  cr_assert_eq(objs->live_tensors, 0);
  cr_assert_eq(objs->ntouched, 0, "no rejected command reached an agent");
}

/* ------------------------------------------------------------------ literals */

static int literal(uint64_t ref, uint64_t mesh, int dtype, const int64_t *shape, size_t n,
                   size_t bytes, bool per_rank) {
  static uint8_t data[4 << 20];
  Meshd__V1__Literal l = MESHD__V1__LITERAL__INIT;
  l.ref = ref;
  l.mesh = mesh;
  l.dtype = (Meshd__V1__DType)dtype;
  l.shape = (int64_t *)shape;
  l.n_shape = n;
  l.per_rank = per_rank;
  l.data = (ProtobufCBinaryData){bytes, data};
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.kind_case = MESHD__V1__COMMAND__KIND_LITERAL;
  c.literal = &l;
  return run(&c);
}
#define LITERAL(ref, mesh, dtype, bytes, per_rank, ...) \
  literal(ref, mesh, dtype, I64(__VA_ARGS__), COUNT(int64_t, __VA_ARGS__), bytes, per_rank)

Test(commands, literals_define_a_tensor_of_their_bytes) {
  ok(LITERAL(10, ROOT, DTYPE_FLOAT32, 24, false, 2, 3));
  expect_meta(result(0), 10, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(result(0), 2, 3);
  cr_assert_eq(objs->bytes, 24 * 8, "24 bytes on each of 8 ranks");
  cr_assert_eq(objs->ntouched, 8, "every rank of the mesh got its instruction");
  ok(LITERAL(11, SUB, DTYPE_INT64, 4 * 16, true, 2)); /* 4 ranks, 16 bytes each */
  EXPECT_SHAPE(result(0), 2);
  ok(LITERAL(12, ROOT, DTYPE_INT64, 1 << 20, false, 1 << 17)); /* 1 MiB to 8 ranks: 8 MiB */
  ok(LITERAL(13, ROOT, DTYPE_BOOL, 0, false, 0, 5));
  cr_assert_eq(objs->live_tensors, 4);
}

Test(commands, literal_rejections) {
  uint64_t bytes = objs->bytes;
  REJECT(LITERAL(10, ROOT, DTYPE_FLOAT32, 20, false, 2, 3), ERR_BAD_ARGUMENT,
         "Literal: 20 bytes of data, but shape and dtype need 24");
  REJECT(LITERAL(10, SUB, DTYPE_FLOAT32, 24, true, 2, 3), ERR_BAD_ARGUMENT,
         "Literal: 24 bytes of data, but shape and dtype (per rank, times the mesh's ranks) "
         "need 96");
  REJECT(LITERAL(10, ROOT, DTYPE_FLOAT32, (1 << 20) + 4, false, (1 << 18) + 1), ERR_BAD_ARGUMENT,
         "Literal: 1048580 bytes of data, more than a Literal carries (1048576)");
  REJECT(LITERAL(10, ROOT, DTYPE_FLOAT32, 0, true, 1 << 19), ERR_BAD_ARGUMENT,
         "Literal: shape and dtype need 2097152 bytes per rank, more than a Literal carries");
  ok(LITERAL(10, ROOT, DTYPE_FLOAT32, 1 << 20, true, 1 << 15)); /* per rank: 1 MiB in all */
  bytes = objs->bytes;
  REJECT(LITERAL(11, ROOT, 99, 8, false, 2), ERR_BAD_ARGUMENT, "Literal: unknown dtype 99");
  REJECT(LITERAL(11, ROOT, DTYPE_FLOAT32, 8, false, 2, -1), ERR_BAD_ARGUMENT, "-1");
  REJECT(LITERAL(11, 0, DTYPE_FLOAT32, 8, false, 2), ERR_BAD_ARGUMENT, "Literal: mesh is missing");
  REJECT(LITERAL(11, SIDE, DTYPE_FLOAT32, 8, false, 2), ERR_UNKNOWN_REF,
         "Literal: mesh is ref 3, which is a stream, not a mesh");
  REJECT(LITERAL(SIDE, ROOT, DTYPE_FLOAT32, 8, false, 2), ERR_REF_REUSED, "Literal: ref 3 was already used");
  expect_ref_free(11);
  cr_assert_eq(objs->bytes, bytes);
  cr_assert_eq(objs->live_tensors, 1);
}

/* Agents at ranks 8 .. 15; `old` of them (the last ones) predate LiteralOp. */
static void add_eight_more(int old) {
  for (uint32_t r = 8; r < 16; r++) {
    agent_desc_t d = {0};
    snprintf(d.agent_id, sizeof d.agent_id, "more-%u", r);
    snprintf(d.address, sizeof d.address, "127.0.0.1:%u", 2000 + r);
    snprintf(d.device, sizeof d.device, "cpu");
    snprintf(d.version, sizeof d.version, "%s", r >= 16u - (uint32_t)old ? "0.0.9" : "0.1.0");
    d.instructions = r >= 16u - (uint32_t)old ? 0 : MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL;
    char msg[200];
    cr_assert_eq(agent_pool_add(pool, &d, (int)r, msg, sizeof msg), (int)r, "%s", msg);
    agent_pool_set_healthy(pool, r, d.agent_id, 0, true);
  }
}

/* A replicated literal goes to every rank: at most 8 MiB in all. */
Test(commands, a_replicated_literal_sends_at_most_8_mib) {
  add_eight_more(0);
  ok(create_mesh(10, NAMES("x"), I64(16), 1));
  ok(LITERAL(11, 10, DTYPE_FLOAT32, 512 << 10, false, 1 << 17)); /* 16 x 512 KiB: 8 MiB */
  REJECT(LITERAL(12, 10, DTYPE_FLOAT32, (512 << 10) + 4, false, (1 << 17) + 1), ERR_BAD_ARGUMENT,
         "Literal: its 524292 bytes would go to each of the mesh's 16 ranks, 8388672 in all, "
         "more than a Literal sends (8388608); send it with Upload");
  ok(LITERAL(12, 10, DTYPE_FLOAT32, 1 << 20, true, 1 << 14)); /* per rank: 1 MiB in all */
}

/* Flow control holds a session back between messages only: the Literals of
 * one Submit batch send at most 8 MiB together. */
Test(commands, the_literals_of_one_batch_send_at_most_8_mib) {
  command_batch_begin();
  ok(LITERAL(10, ROOT, DTYPE_FLOAT32, 512 << 10, false, 1 << 17)); /* 8 ranks: 4 MiB */
  ok(LITERAL(11, ROOT, DTYPE_FLOAT32, 1 << 20, true, 1 << 15));    /* per rank: 1 MiB */
  ok(LITERAL(12, SUB, DTYPE_FLOAT32, 3 << 18, false, 3 << 16));    /* 4 ranks: 3 MiB */
  REJECT(LITERAL(13, ROOT, DTYPE_FLOAT32, 4, false, 1), ERR_QUOTA,
         "Literal: the Literals of one Submit message send at most 8388608 bytes to the agents, "
         "and this one would make 8388640; send it in a later message");
  ok(FACTORY(.ref = 13, .mesh = ROOT, SHAPE(2))); /* other commands go on */
  command_batch_end();
  ok(LITERAL(14, ROOT, DTYPE_FLOAT32, 4, false, 1)); /* the next message: room again */
  command_batch_begin();
  ok(LITERAL(15, ROOT, DTYPE_FLOAT32, 512 << 10, false, 1 << 17));
  command_batch_end();
}

/* An agent older than LiteralOp would end its link on it: the server refuses
 * a Literal on a mesh holding one, and sends it nothing. */
Test(commands, a_literal_on_a_mesh_with_an_older_agent_is_refused) {
  add_eight_more(2);
  ok(create_mesh(10, NAMES("x"), I64(16), 1));
  cr_assert_not(out.res.mesh->literals, "the mesh's answer says an agent predates Literal");
  ok(create_mesh(11, NAMES("x"), I64(8), 1)); /* ranks 0..7: all new */
  cr_assert(out.res.mesh->literals);
  size_t touched = objs->ntouched;
  REJECT(LITERAL(12, 10, DTYPE_FLOAT32, 8, false, 2), ERR_UNAVAILABLE,
         "Literal: the agent at rank 14 (version 0.0.9) predates the Literal command; send the "
         "tensor with Upload, or upgrade the agent");
  cr_assert_eq(objs->ntouched, touched, "nothing went to any agent");
  expect_ref_free(12);
  ok(LITERAL(12, 11, DTYPE_FLOAT32, 8, false, 2));
}

/* ------------------------------------------------------------------ calls */

Test(commands, call_results_shapes_dtypes_and_views) {
  ZEROS(10, 2, 3);
  zeros(11, ROOT, STREAM_MAIN, DTYPE_INT64, I64(3), 1);
  ok(CALL("add", STREAM_MAIN, ARGS(aref(11), aref(10)), RES(12)));
  expect_meta(result(0), 12, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(result(0), 2, 3);
  EXPECT_STRIDES(result(0), 3, 1);
  cr_assert_neq(objects_get(objs, 12)->tensor.storage, objects_get(objs, 10)->tensor.storage);

  uint64_t bytes = objs->bytes;
  ok(CALL("transpose", STREAM_MAIN, ARGS(aref(10), aint(0), aint(1)), RES(13)));
  expect_meta(result(0), 13, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(result(0), 3, 2);
  EXPECT_STRIDES(result(0), 1, 3);
  cr_assert_eq(objects_get(objs, 13)->tensor.storage, objects_get(objs, 10)->tensor.storage,
               "a view shares its base's storage");
  cr_assert_eq(objs->bytes, bytes, "a view needs no bytes");

  ok(CALL("select", STREAM_MAIN, ARGS(aref(10), aint(1), aint(2)), RES(14)));
  EXPECT_SHAPE(result(0), 2);
  EXPECT_STRIDES(result(0), 3);
  cr_assert_eq(result(0)->storage_offset, 2);

  ok(call_full("sum", STREAM_MAIN, ARGS(aref(10)), KWARGS(kw("dim", AINTS(1)), kw("keepdim", abool(true))),
               RES(15)));
  EXPECT_SHAPE(result(0), 2, 1);

  ok(CALL("max", STREAM_MAIN, ARGS(aref(10), aint(0)), RES(16, 17)));
  cr_assert_eq(out.res.n_tensors, 2);
  expect_meta(result(0), 16, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  expect_meta(result(1), 17, DTYPE_INT64, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(result(1), 3);

  ok(CALL("matmul", STREAM_MAIN, ARGS(aref(10), aref(13)), RES(18)));
  EXPECT_SHAPE(result(0), 2, 2);

  ok(CALL("cat", STREAM_MAIN, ARGS(AREFS(10, 12), aint(0)), RES(19)));
  EXPECT_SHAPE(result(0), 4, 3);

  ok(CALL("to", STREAM_MAIN, ARGS(aref(10), adtype(DTYPE_FLOAT64)), RES(20)));
  expect_meta(result(0), 20, DTYPE_FLOAT64, ROOT, STREAM_MAIN);

  /* in place without a result ref: the command names no result */
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(10), afloat(1.5)), NORES));
  cr_assert_eq(out.res.n_tensors, 0);
  /* in place with a result ref: a new name for self's memory */
  ok(CALL("mul_", STREAM_MAIN, ARGS(aref(10), aref(12)), RES(21)));
  expect_meta(result(0), 21, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(result(0), 2, 3);
  cr_assert_eq(objects_get(objs, 21)->tensor.storage, objects_get(objs, 10)->tensor.storage);

  /* ops on a sub-mesh and another stream run there */
  zeros(22, SUB, SIDE, 0, I64(4), 1);
  ok(CALL("neg", SIDE, ARGS(aref(22)), RES(23)));
  expect_meta(result(0), 23, DTYPE_FLOAT32, SUB, SIDE);
}

Test(commands, call_rejections_by_kind) {
  ZEROS(10, 2, 3);
  ZEROS(11, 4);
  zeros(12, SUB, STREAM_MAIN, 0, I64(2, 3), 2);
  zeros(13, ROOT, SIDE, 0, I64(2, 3), 2);
  zeros(14, ROOT, STREAM_MAIN, DTYPE_INT32, I64(2, 3), 2);
  uint64_t bytes = objs->bytes, live = objs->live_tensors;

  REJECT(CALL("frobnicate", STREAM_MAIN, ARGS(aref(10)), RES(20)), ERR_UNKNOWN_OP,
         "Call: no op named 'frobnicate' in the catalogue");
  REJECT(CALL("zeros", STREAM_MAIN, ARGS(AINTS(2)), RES(20)), ERR_BAD_ARGUMENT,
         "Call zeros: factories run on a mesh; send a Factory command");
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(10), aref(10)), RES(14)), ERR_REF_REUSED,
         "Call add: ref 14 was already used");
  REJECT(CALL("max", STREAM_MAIN, ARGS(aref(10), aint(0)), RES(21, 20)), ERR_REF_REUSED,
         "Call max: ref 20 comes after ref 21 in this command");
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(10), aref(99)), RES(20)), ERR_UNKNOWN_REF,
         "Call add: argument 'other' is ref 99, which this session never defined");
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(ROOT), aref(10)), RES(20)), ERR_UNKNOWN_REF,
         "Call add: argument 'self' is ref 1, which is a mesh, not a tensor");
  REJECT(CALL("cat", STREAM_MAIN, ARGS(AREFS(10, 98)), RES(20)), ERR_UNKNOWN_REF,
         "Call cat: argument 'tensors'[1] is ref 98");
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(10), aref(11)), RES(20)), ERR_SHAPE_MISMATCH,
         "add: self [2, 3] and other [4] can't be broadcast together");
  REJECT(CALL("bitwise_and", STREAM_MAIN, ARGS(aref(10), aref(10)), RES(20)), ERR_DTYPE_MISMATCH,
         "bitwise_and: only integer and bool dtypes", "self is float32");
  REJECT(CALL("add_", STREAM_MAIN, ARGS(aref(14), aref(10)), NORES), ERR_DTYPE_MISMATCH,
         "add_: result type float32 can't be cast to the desired output type int32 of argument 'self'");
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(10), aref(10)), RES(20, 21)), ERR_BAD_ARGUMENT,
         "Call add returns 1 tensor but the command names 2 result refs");
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(10), aref(10)), NORES), ERR_BAD_ARGUMENT,
         "Call add returns 1 tensor but the command names 0 result refs");
  REJECT(CALL("to", STREAM_MAIN, ARGS(aref(10), adtype(42)), RES(20)), ERR_BAD_ARGUMENT,
         "Call to: argument 'dtype': unknown dtype 42");
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(10), aref(12)), RES(20)), ERR_WRONG_MESH,
         "Call add: argument 'other' (tensor 12) is on mesh 2 {gpu: 4} but argument 'self' (tensor "
         "10) is on mesh 1 {host: 2, gpu: 4}");
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(10), aref(13)), RES(20)), ERR_WRONG_STREAM,
         "Call add: argument 'other' (tensor 13) is on stream 'side' but the command runs on "
         "stream 'main'; borrow it onto 'main' first, or run the command on 'side'");
  REJECT(CALL("neg", SIDE, ARGS(aref(10)), RES(20)), ERR_WRONG_STREAM,
         "Call neg: argument 'self' (tensor 10) is on stream 'main' but the command runs on stream 'side'");
  REJECT(CALL("neg", 77, ARGS(aref(10)), RES(20)), ERR_UNKNOWN_REF,
         "Call neg: stream is ref 77, which this session never defined");
  expect_ref_free(20);
  cr_assert_eq(objs->bytes, bytes);
  cr_assert_eq(objs->live_tensors, live);
  cr_assert_eq(state_of(14), TENSOR_LIVE);

  ok(DROP(11));
  uint64_t drop_seq = last_seq;
  char site[64];
  snprintf(site, sizeof site, "was dropped at command seq %llu", (unsigned long long)drop_seq);
  REJECT(CALL("neg", STREAM_MAIN, ARGS(aref(11)), RES(20)), ERR_DROPPED,
         "Call neg: argument 'self' (tensor 11)", site);
  expect_ref_free(20);
}

/* Every entry of a tensor list is checked like any argument, the 40th too (the
 * server once tracked only the first 32: a later entry on another mesh or
 * stream, or mutably borrowed, reached the agents); more tensors than an agent
 * holds for one call (64 in all, 8 lists) are refused here. */
Test(commands, call_checks_every_list_entry) {
  uint64_t refs[65];
  for (int i = 0; i < 65; i++) {
    refs[i] = 100 + (uint64_t)i;
    ZEROS(refs[i], 1);
  }
  zeros(200, SUB, STREAM_MAIN, 0, I64(1), 1);
  zeros(201, ROOT, SIDE, 0, I64(1), 1);
  ZEROS(202, 1);
  ok(borrow(203, 202, SIDE, true, 204)); /* 202 mutably borrowed onto side */
  uint64_t list[40];
  memcpy(list, refs, sizeof list);
  list[39] = 200;
  REJECT(CALL("cat", STREAM_MAIN, ARGS(arefs_(list, 40)), RES(300)), ERR_WRONG_MESH,
         "argument 'tensors'[39] (tensor 200) is on mesh 2");
  list[39] = 201;
  REJECT(CALL("cat", STREAM_MAIN, ARGS(arefs_(list, 40)), RES(300)), ERR_WRONG_STREAM,
         "argument 'tensors'[39] (tensor 201) is on stream 'side'");
  list[39] = 202;
  REJECT(CALL("cat", STREAM_MAIN, ARGS(arefs_(list, 40)), RES(300)), ERR_BORROWED,
         "tensor 202");
  REJECT(CALL("cat", STREAM_MAIN, ARGS(arefs_(refs, 65)), RES(300)), ERR_BAD_ARGUMENT,
         "at most 64 tensors in a list");
  REJECT(call_full("add", STREAM_MAIN, ARGS(aref(100), aref(101)),
                   KWARGS(kw("alpha", arefs_(refs, 63))), RES(300)),
         ERR_BAD_ARGUMENT, "at most 64 tensors in all, lists included");
  expect_ref_free(300);
  ok(CALL("cat", STREAM_MAIN, ARGS(arefs_(refs, 64)), RES(300)));
  tensor_meta_t m;
  cr_assert_eq(obj_meta(objects_get(objs, 300), &m)->layout.sizes[0], 64);
}

Test(commands, call_borrow_checks) {
  ZEROS(10, 4);
  ZEROS(11, 4);
  ok(borrow(12, 10, SIDE, true, 13));   /* 10 mutably borrowed onto side */
  ok(borrow(14, 11, SIDE, false, 15));  /* 11 read borrowed onto side */
  REJECT(CALL("neg", STREAM_MAIN, ARGS(aref(10)), RES(20)), ERR_BORROWED,
         "Call neg: argument 'self' (tensor 10) is mutably borrowed (borrow 13); it cannot be used "
         "until the borrow is dropped");
  ok(CALL("neg", STREAM_MAIN, ARGS(aref(11)), RES(20)));
  REJECT(CALL("add_", STREAM_MAIN, ARGS(aref(11), afloat(1)), NORES), ERR_MUTATING_BORROW,
         "Call add_: argument 'self' (tensor 11) cannot be mutated while it (or a view of it) is "
         "borrowed for reading (borrow 15); drop the borrow first");
  REJECT(CALL("add_", SIDE, ARGS(aref(14), afloat(1)), NORES), ERR_MUTATING_BORROW,
         "Call add_: argument 'self' (tensor 14) is a read-only borrow (borrow 15) and cannot be "
         "mutated; borrow it with mutable=True to write to it");
  ok(CALL("add_", SIDE, ARGS(aref(12), aref(14)), NORES));
  ok(drop_borrow(13));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(10), afloat(1)), NORES));
  ok(drop_borrow(15));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(11), afloat(1)), NORES));
}

Test(commands, rejected_commands_consume_no_ref) {
  ZEROS(10, 2, 3);
  REJECT(CALL("add", STREAM_MAIN, ARGS(aref(10), aref(99)), RES(50)), ERR_UNKNOWN_REF, "Call add");
  expect_ref_free(50);
  REJECT(FACTORY(.ref = 50, .mesh = ROOT, SHAPE(-1)), ERR_BAD_ARGUMENT, "zeros");
  expect_ref_free(50);
  REJECT(REDUCE(.ref = 50, .input = 10, .dims = {"rack"}), ERR_BAD_DIM, "Reduce");
  expect_ref_free(50);
  REJECT(TO_MESH(.ref = 50, .input = 10, .dst_mesh = SUB), ERR_BAD_DIM, "ToMesh");
  expect_ref_free(50);
  REJECT(borrow(50, 10, STREAM_MAIN, false, 51), ERR_BAD_ARGUMENT, "Borrow");
  expect_ref_free(50);
  expect_ref_free(51);
  /* the same ref then works, and a lower one afterwards is REF_REUSED */
  ok(CALL("neg", STREAM_MAIN, ARGS(aref(10)), RES(50)));
  REJECT(FACTORY(.ref = 49, .mesh = ROOT, SHAPE(1)), ERR_REF_REUSED, "Factory: ref 49",
         "the next free ref is 51");
}

/* ------------------------------------------------------------------ failure propagation */

Test(commands, readers_of_a_failed_tensor_fail_with_dependent_failure) {
  ZEROS(10, 2, 3);
  ZEROS(11, 2, 3);
  ZEROS(12, 2, 3);
  objects_fail_tensor(objs, objects_get(objs, 10), 40, ERR_REMOTE_FAILURE, 40,
                      "Call index_select: index 9 out of range on rank 3");

  ok(CALL("add", STREAM_MAIN, ARGS(aref(11), aref(10)), RES(20)));
  const tmeta_t *m = result(0);
  cr_assert_eq(m->ref, 20);
  cr_assert_eq(m->state, MESHD__V1__TENSOR_STATE__TENSOR_STATE_FAILED);
  cr_assert_not_null(m->error);
  cr_assert_eq((int)m->error->kind, ERR_DEPENDENT_FAILURE);
  cr_assert_eq(m->error->seq, 40, "the root command's seq");
  cr_assert_eq(m->error->ref, 20);
  cr_assert_eq(m->error->code, (int32_t)error_kind_code(ERR_DEPENDENT_FAILURE));
  cr_assert(strstr(m->error->message, "depends on tensor 10, which failed at command seq 40"), "%s",
            m->error->message);
  cr_assert(strstr(m->error->message, "index 9 out of range on rank 3"), "%s", m->error->message);
  cr_assert_eq(state_of(11), TENSOR_LIVE, "a read input is not failed");

  /* dependents of dependents still name the root */
  ok(CALL("neg", STREAM_MAIN, ARGS(aref(20)), RES(21)));
  cr_assert_eq((int)result(0)->error->kind, ERR_DEPENDENT_FAILURE);
  cr_assert_eq(result(0)->error->seq, 40);

  /* a tensor mutated with a failed input fails too, with its views */
  ok(CALL("view", STREAM_MAIN, ARGS(aref(12), AINTS(6)), RES(22)));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(12), aref(10)), NORES));
  cr_assert_eq(state_of(12), TENSOR_FAILED);
  cr_assert_eq(state_of(22), TENSOR_FAILED, "views of a mutated storage fail with it");
  ok(describe(22));
  cr_assert_eq((int)result(0)->error->kind, ERR_DEPENDENT_FAILURE);
  cr_assert_eq(result(0)->error->seq, 40);

  /* collectives and to_mesh on a failed input are accepted and fail their result */
  ok(REDUCE(.ref = 23, .input = 10, .dims = {"gpu"}));
  cr_assert_eq(result(0)->state, MESHD__V1__TENSOR_STATE__TENSOR_STATE_FAILED);
  cr_assert_eq(result(0)->error->seq, 40);
  ok(TO_MESH(.ref = 24, .input = 10, .dst_mesh = ROOT));
  cr_assert_eq(result(0)->state, MESHD__V1__TENSOR_STATE__TENSOR_STATE_FAILED);
  cr_assert_eq((int)result(0)->error->kind, ERR_DEPENDENT_FAILURE);

  /* Describe shows the root failure itself */
  ok(describe(10));
  cr_assert_eq((int)result(0)->error->kind, ERR_REMOTE_FAILURE);
  cr_assert_str_eq(result(0)->error->message, "Call index_select: index 9 out of range on rank 3");

  /* a command not touching the failed tensor is unaffected */
  ok(CALL("neg", STREAM_MAIN, ARGS(aref(11)), RES(25)));
  expect_meta(result(0), 25, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  /* a borrow of a failed tensor: its handle is failed too */
  ok(borrow(125, 10, SIDE, false, 126));
  cr_assert_eq(result(0)->state, MESHD__V1__TENSOR_STATE__TENSOR_STATE_FAILED);
  cr_assert_eq((int)result(0)->error->kind, ERR_DEPENDENT_FAILURE);
  cr_assert_eq(result(0)->error->seq, 40);
  /* a mutable borrow's handle mutated with a failed input fails its origin
   * (the same memory on the agents), through a borrow of the borrow too */
  ZEROS(127, 2, 3);
  ok(borrow(128, 127, SIDE, true, 129));
  ok(borrow(130, 128, STREAM_MAIN, true, 131));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(130), aref(10)), NORES));
  cr_assert_eq(state_of(130), TENSOR_FAILED);
  cr_assert_eq(state_of(128), TENSOR_FAILED, "the borrowed handle failed with its borrow's");
  cr_assert_eq(state_of(127), TENSOR_FAILED, "the origin failed with its mutable borrow's handle");
  ok(drop_borrow(131));
  ok(drop_borrow(129));
  ok(describe(127));
  cr_assert_eq((int)result(0)->error->kind, ERR_DEPENDENT_FAILURE);
  cr_assert_eq(result(0)->error->seq, 40);
  /* a read borrow's origin is not failed by its handle's readers */
  ZEROS(134, 2, 3);
  ok(borrow(135, 134, SIDE, false, 136));
  ok(CALL("add", SIDE, ARGS(aref(135), aref(125)), RES(137)));
  cr_assert_eq(state_of(137), TENSOR_FAILED);
  cr_assert_eq(state_of(134), TENSOR_LIVE);
  ok(drop_borrow(136));
  ok(drop_borrow(126));
}

/* ------------------------------------------------------------------ reduce */

Test(commands, reduce_result_shapes) {
  ZEROS(10, 4, 3);
  ok(REDUCE(.ref = 11, .input = 10, .dims = {"gpu"}));
  expect_meta(result(0), 11, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(result(0), 4, 3);
  EXPECT_STRIDES(result(0), 3, 1);
  cr_assert_neq(objects_get(objs, 11)->tensor.storage, objects_get(objs, 10)->tensor.storage);

  ok(REDUCE(.ref = 12, .input = 10, .dims = {"gpu"}, .scatter = true));
  EXPECT_SHAPE(result(0), 3);

  ok(REDUCE(.ref = 13, .input = 10, .dims = {"host"}, .reduction = "stack"));
  EXPECT_SHAPE(result(0), 2, 4, 3);
  EXPECT_STRIDES(result(0), 12, 3, 1);

  ok(REDUCE(.ref = 14, .input = 10, .dims = {"gpu"}, .reduction = "stack", .scatter = true));
  EXPECT_SHAPE(result(0), 4, 3);

  ok(REDUCE(.ref = 15, .input = 10, .reduction = "max"));
  EXPECT_SHAPE(result(0), 4, 3);
  ok(REDUCE(.ref = 16, .input = 10, .dims = {"host", "gpu"}, .reduction = "avg"));
  EXPECT_SHAPE(result(0), 4, 3);

  /* out=: the result is out itself, or a new name for it */
  ZEROS(17, 3);
  ok(REDUCE(.input = 10, .out = 17, .dims = {"gpu"}, .scatter = true));
  cr_assert_eq(result(0)->ref, 17);
  EXPECT_SHAPE(result(0), 3);
  ok(REDUCE(.ref = 18, .input = 10, .out = 17, .dims = {"gpu"}, .scatter = true));
  cr_assert_eq(result(0)->ref, 18);
  cr_assert_eq(objects_get(objs, 18)->tensor.storage, objects_get(objs, 17)->tensor.storage);

  /* in place: the input */
  uint64_t bytes = objs->bytes;
  ok(REDUCE(.input = 10, .dims = {"gpu"}, .inplace = true));
  cr_assert_eq(result(0)->ref, 10);
  EXPECT_SHAPE(result(0), 4, 3);
  cr_assert_eq(objs->bytes, bytes, "in place allocates nothing");

  /* integers and bools: bitwise reductions */
  zeros(19, ROOT, STREAM_MAIN, DTYPE_INT32, I64(2), 1);
  ok(REDUCE(.ref = 20, .input = 19, .reduction = "bxor"));
  expect_meta(result(0), 20, DTYPE_INT32, ROOT, STREAM_MAIN);

  /* on a sub-mesh, over its only dim */
  zeros(21, SUB, SIDE, 0, I64(4), 1);
  ok(REDUCE(.ref = 22, .input = 21, .stream = SIDE, .reduction = "stack"));
  expect_meta(result(0), 22, DTYPE_FLOAT32, SUB, SIDE);
  EXPECT_SHAPE(result(0), 4, 4);
}

Test(commands, reduce_rejections) {
  ZEROS(10, 4, 3);
  zeros(11, ROOT, STREAM_MAIN, DTYPE_INT64, I64(4), 1);
  ZEROS(12, 5);
  zeros(13, ROOT, STREAM_MAIN, DTYPE_FLOAT64, I64(3), 1);
  zeros(14, ROOT, SIDE, 0, I64(4), 1);
  zeros(15, SUB, STREAM_MAIN, 0, I64(4), 1);
  uint64_t bytes = objs->bytes;

  REJECT(REDUCE(.ref = 30, .input = 10, .reduction = "mean"), ERR_BAD_ARGUMENT,
         "Reduce: unknown reduction 'mean'; expected one of sum");
  REJECT(REDUCE(.ref = 30, .input = 10, .inplace = true), ERR_BAD_ARGUMENT,
         "Reduce: an in-place reduce (reduce_) returns its input; leave ref at 0");
  REJECT(REDUCE(.input = 10), ERR_BAD_ARGUMENT, "Reduce: ref (the result) is missing");
  REJECT(REDUCE(.ref = 14, .input = 10), ERR_REF_REUSED, "Reduce: ref 14 was already used");
  REJECT(REDUCE(.ref = 30, .input = 99), ERR_UNKNOWN_REF, "Reduce: input is ref 99");
  REJECT(REDUCE(.ref = 30, .input = 10, .out = 98), ERR_UNKNOWN_REF, "Reduce: out is ref 98");
  REJECT(REDUCE(.ref = 30, .input = 10, .stream = 97), ERR_UNKNOWN_REF, "Reduce: stream is ref 97");
  REJECT(REDUCE(.input = 10, .out = 12, .inplace = true), ERR_BAD_ARGUMENT,
         "Reduce: inplace and out cannot both be given");

  REJECT(REDUCE(.ref = 30, .input = 10, .dims = {"rack"}), ERR_BAD_DIM,
         "Reduce: mesh 1 {host: 2, gpu: 4} has no dim 'rack'");
  REJECT(REDUCE(.ref = 30, .input = 10, .dims = {"gpu", "gpu"}), ERR_BAD_DIM,
         "Reduce: dim 'gpu' is named twice");
  REJECT(REDUCE(.ref = 30, .input = 10, .dims = {"host", "gpu"}, .reduction = "stack"), ERR_BAD_DIM,
         "Reduce: stack works over exactly one mesh dim, but 2 were given (as named)");
  REJECT(REDUCE(.ref = 30, .input = 10, .reduction = "stack"), ERR_BAD_DIM,
         "Reduce: stack works over exactly one mesh dim, but 2 were given (all dims of the mesh)");
  REJECT(REDUCE(.ref = 30, .input = 10, .dims = {"host", "gpu"}, .scatter = true), ERR_BAD_DIM,
         "Reduce: scatter works over exactly one mesh dim, but 2 were given");

  REJECT(REDUCE(.ref = 30, .input = 10, .reduction = "band"), ERR_DTYPE_MISMATCH,
         "Reduce: 'band' is bitwise and needs an integer or bool tensor, not float32");
  REJECT(REDUCE(.ref = 30, .input = 11, .reduction = "avg"), ERR_DTYPE_MISMATCH,
         "Reduce: 'avg' needs a floating dtype, not int64");

  REJECT(REDUCE(.ref = 30, .input = 10, .dims = {"host"}, .scatter = true), ERR_SHAPE_MISMATCH,
         "Reduce: when scattering, the input's size(0) must equal the group size 2 (dim 'host'), but "
         "the input has shape [4, 3]");
  REJECT(REDUCE(.ref = 30, .input = 10, .dims = {"gpu"}, .out = 12), ERR_SHAPE_MISMATCH,
         "Reduce: out has shape [5] but the result has shape [4, 3]");
  REJECT(REDUCE(.input = 10, .dims = {"gpu"}, .scatter = true, .out = 13), ERR_DTYPE_MISMATCH,
         "Reduce: out is float64 but the input is float32");
  REJECT(REDUCE(.input = 10, .dims = {"gpu"}, .scatter = true, .inplace = true), ERR_BAD_ARGUMENT,
         "Reduce: in-place is only possible when the result has the input's shape; scatter changes it");
  REJECT(REDUCE(.input = 10, .dims = {"gpu"}, .reduction = "stack", .inplace = true), ERR_BAD_ARGUMENT,
         "stack changes it");

  REJECT(REDUCE(.ref = 30, .input = 14), ERR_WRONG_STREAM,
         "Reduce: input (tensor 14) is on stream 'side' but the command runs on stream 'main'");
  REJECT(REDUCE(.ref = 30, .input = 15, .out = 11), ERR_WRONG_MESH,
         "Reduce: out (tensor 11) is on mesh 1 {host: 2, gpu: 4} but input (tensor 15) is on mesh 2 "
         "{gpu: 4}");
  expect_ref_free(30);
  cr_assert_eq(objs->bytes, bytes);

  ok(borrow(31, 10, SIDE, false, 32));
  REJECT(REDUCE(.input = 10, .dims = {"gpu"}, .inplace = true), ERR_MUTATING_BORROW,
         "Reduce: input (tensor 10) cannot be mutated while it (or a view of it) is borrowed for "
         "reading (borrow 32)");
  ok(borrow(33, 13, SIDE, true, 34));
  REJECT(REDUCE(.ref = 35, .input = 13), ERR_BORROWED, "Reduce: input (tensor 13) is mutably borrowed (borrow 34)");
  ok(DROP(12));
  REJECT(REDUCE(.ref = 35, .input = 12), ERR_DROPPED, "Reduce: input (tensor 12) was dropped at command seq");
  REJECT(REDUCE(.ref = 35, .input = 11, .out = 12), ERR_DROPPED, "Reduce: out (tensor 12) was dropped");
  expect_ref_free(35);
}

/* ------------------------------------------------------------------ to_mesh */

Test(commands, to_mesh_moves_and_broadcasts) {
  zeros(10, SUB, STREAM_MAIN, 0, I64(2, 3), 2);
  /* {gpu: 4} -> {host: 2, gpu: 4}: host is broadcast */
  ok(TO_MESH(.ref = 11, .input = 10, .dst_mesh = ROOT));
  expect_meta(result(0), 11, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(result(0), 2, 3);
  EXPECT_STRIDES(result(0), 3, 1);
  cr_assert_eq(objs->bytes, 24 * 4 + 24 * 8);
  /* a non-contiguous view arrives contiguous, on the destination stream */
  ok(CALL("t", STREAM_MAIN, ARGS(aref(10)), RES(12)));
  EXPECT_STRIDES(result(0), 1, 3);
  ok(TO_MESH(.ref = 13, .input = 12, .dst_mesh = SUB, .dst_stream = SIDE));
  expect_meta(result(0), 13, DTYPE_FLOAT32, SUB, SIDE);
  EXPECT_SHAPE(result(0), 3, 2);
  EXPECT_STRIDES(result(0), 2, 1);
  /* with a selection of the source: ROOT[host=0] -> SUB */
  ZEROS(14, 5);
  ok(TO_MESH(.ref = 15, .input = 14, .dst_mesh = SUB, .sel = {sel_index("host", 0)}));
  expect_meta(result(0), 15, DTYPE_FLOAT32, SUB, STREAM_MAIN);
  EXPECT_SHAPE(result(0), 5);
}

/* The data plane secret is per group, not per comm: the two groups of a Reduce
 * over gpu on {host: 2, gpu: 2} share a comm_id, and a member of one once held
 * the other's secret (so it could pass for one of its members); the same for
 * the pairs of a ToMesh, which share the session's channel. Equal members give
 * equal secrets (every member derives the one its peers prove). */
Test(commands, every_group_of_a_comm_proves_its_own_secret) {
  uint8_t a[EMIT_SECRET_LEN], b[EMIT_SECRET_LEN], c[EMIT_SECRET_LEN], d[EMIT_SECRET_LEN];
  cr_assert(emit_group_secret(sess, 77, (uint32_t[]){0, 1}, 2, a));
  cr_assert(emit_group_secret(sess, 77, (uint32_t[]){2, 3}, 2, b));
  cr_assert(emit_group_secret(sess, 77, (uint32_t[]){0, 1}, 2, c));
  cr_assert(emit_group_secret(sess, 78, (uint32_t[]){0, 1}, 2, d));
  cr_assert(memcmp(a, b, sizeof a) != 0, "two groups of one comm share a secret");
  cr_assert(memcmp(a, c, sizeof a) == 0, "one group, two secrets");
  cr_assert(memcmp(a, d, sizeof a) != 0, "two comms share a secret");
  cr_assert(emit_group_secret(sess, 77, (uint32_t[]){1, 0}, 2, b));
  cr_assert(memcmp(a, b, sizeof a) != 0, "a send and its reverse share a secret");
  uint32_t many[REDUCE_GROUP_MAX + 1] = {0};
  cr_assert_not(emit_group_secret(sess, 77, many, REDUCE_GROUP_MAX + 1, b));
  uint8_t zeros[EMIT_SECRET_LEN] = {0};
  cr_assert(memcmp(b, zeros, sizeof b) == 0);
}

/* Pair secrets (Group.pair_secrets): member i's entry j is member j's entry
 * i (both ends of a link prove the same), every pair's differs from every
 * other's and from the group's, a member's own entry is zeros, and another
 * comm has other ones. */
Test(commands, each_pair_of_a_group_has_its_own_secret) {
  const uint32_t ranks[4] = {5, 9, 2, 7};
  uint8_t rows[4][4 * EMIT_SECRET_LEN], other[4 * EMIT_SECRET_LEN], group[EMIT_SECRET_LEN];
  uint8_t zeros[EMIT_SECRET_LEN] = {0};
  for (size_t i = 0; i < 4; i++) cr_assert(emit_pair_secrets(sess, 77, ranks, 4, i, rows[i]));
  cr_assert(emit_group_secret(sess, 77, ranks, 4, group));
  for (size_t i = 0; i < 4; i++)
    for (size_t j = 0; j < 4; j++) {
      const uint8_t *e = rows[i] + j * EMIT_SECRET_LEN;
      if (i == j) {
        cr_assert(memcmp(e, zeros, EMIT_SECRET_LEN) == 0, "member %zu's own entry", i);
        continue;
      }
      cr_assert(memcmp(e, rows[j] + i * EMIT_SECRET_LEN, EMIT_SECRET_LEN) == 0,
                "the two ends of pair {%zu, %zu} differ", i, j);
      cr_assert(memcmp(e, group, EMIT_SECRET_LEN) != 0, "pair {%zu, %zu} is the group's", i, j);
      for (size_t k = 0; k < 4; k++)
        if (k != i && k != j)
          cr_assert(memcmp(e, rows[i] + k * EMIT_SECRET_LEN, EMIT_SECRET_LEN) != 0,
                    "pairs {%zu, %zu} and {%zu, %zu} share a secret", i, j, i, k);
    }
  cr_assert(emit_pair_secrets(sess, 78, ranks, 4, 0, other));
  cr_assert(memcmp(other + EMIT_SECRET_LEN, rows[0] + EMIT_SECRET_LEN, EMIT_SECRET_LEN) != 0,
            "two comms share a pair secret");
}

/* A broadcast to more destinations than one collective group holds goes as
 * several chains, each a group the agents run (they refuse more than
 * REDUCE_GROUP_MAX members), none a lone destination. */
Test(commands, long_broadcast_chains_split_into_groups_the_agents_run) {
  cr_assert_eq(emit_chain_pieces(2), 1);
  cr_assert_eq(emit_chain_pieces(REDUCE_GROUP_MAX - 1), 1);
  cr_assert_eq(emit_chain_pieces(REDUCE_GROUP_MAX), 2);
  for (size_t n = 2; n <= 3000; n++) {
    size_t sum = 0;
    for (size_t k = 0; k < emit_chain_pieces(n); k++) {
      size_t len = emit_chain_piece_len(n, k);
      cr_assert(len >= 2 && len + 1 <= REDUCE_GROUP_MAX, "n %zu piece %zu: %zu", n, k, len);
      sum += len;
    }
    cr_assert_eq(sum, n);
  }
}

Test(commands, to_mesh_rejections) {
  ZEROS(10, 2);
  ok(slice_mesh(11, ROOT, SELS(sel_range("gpu", 0, 2))));  /* {host: 2, gpu: 2} */
  zeros(12, SUB, STREAM_MAIN, 0, I64(2), 1);
  uint64_t bytes = objs->bytes;
  REJECT(TO_MESH(.ref = 12, .input = 10, .dst_mesh = ROOT), ERR_REF_REUSED, "ToMesh: ref 12");
  REJECT(TO_MESH(.ref = 20, .input = 99, .dst_mesh = ROOT), ERR_UNKNOWN_REF, "ToMesh: input is ref 99");
  REJECT(TO_MESH(.ref = 20, .input = 10), ERR_BAD_ARGUMENT, "ToMesh: dst_mesh is missing");
  REJECT(TO_MESH(.ref = 20, .input = 10, .dst_mesh = SIDE), ERR_UNKNOWN_REF,
         "ToMesh: dst_mesh is ref 3, which is a stream, not a mesh");
  REJECT(TO_MESH(.ref = 20, .input = 10, .dst_mesh = ROOT, .dst_stream = 10), ERR_UNKNOWN_REF,
         "ToMesh: stream is ref 10, which is a tensor, not a stream");
  REJECT(TO_MESH(.ref = 20, .input = 10, .dst_mesh = SUB), ERR_BAD_DIM,
         "ToMesh: the source mesh {host: 2, gpu: 4} has dim 'host', which the destination {gpu: 4} "
         "lacks; select one index of it first (slice_mesh(host=i))");
  REJECT(TO_MESH(.ref = 20, .input = 10, .dst_mesh = 11), ERR_SHAPE_MISMATCH,
         "ToMesh: dim 'gpu' has size 4 on the source {host: 2, gpu: 4} but 2 on the destination "
         "{host: 2, gpu: 2}");
  REJECT(TO_MESH(.ref = 20, .input = 10, .dst_mesh = ROOT, .sel = {sel_index("rack", 0)}), ERR_BAD_DIM,
         "ToMesh", "rack");
  REJECT(TO_MESH(.ref = 20, .input = 12, .dst_mesh = 11), ERR_SHAPE_MISMATCH,
         "ToMesh: dim 'gpu' has size 4 on the source {gpu: 4} but 2 on the destination");
  expect_ref_free(20);
  cr_assert_eq(objs->bytes, bytes);
  ok(borrow(20, 10, SIDE, true, 21));
  REJECT(TO_MESH(.ref = 22, .input = 10, .dst_mesh = ROOT), ERR_BORROWED,
         "ToMesh: input (tensor 10) is mutably borrowed (borrow 21)");
  ok(DROP(12));
  REJECT(TO_MESH(.ref = 22, .input = 12, .dst_mesh = SUB), ERR_DROPPED,
         "ToMesh: input (tensor 12) was dropped at command seq");
  expect_ref_free(22);
}

/* ------------------------------------------------------------------ borrows, drop */

Test(commands, borrow_and_drop_borrow) {
  ZEROS(10, 2, 3);
  ok(borrow(11, 10, SIDE, false, 12));
  expect_meta(result(0), 11, DTYPE_FLOAT32, ROOT, SIDE);
  EXPECT_SHAPE(result(0), 2, 3);
  cr_assert_eq(objects_get(objs, 12)->kind, OBJ_BORROW);
  ok(CALL("neg", SIDE, ARGS(aref(11)), RES(13)));
  expect_meta(result(0), 13, DTYPE_FLOAT32, ROOT, SIDE);
  ok(drop_borrow(12));
  cr_assert_eq(out.res.n_tensors, 0);
  uint64_t drop_seq = last_seq;
  cr_assert_eq(dropped_seq(11), drop_seq);
  cr_assert_eq(objects_dropped(objs, 11)->borrow, 12);
  char site[160];
  snprintf(site, sizeof site, "was dropped at command seq %llu, when its borrow 12 was dropped",
           (unsigned long long)drop_seq);
  REJECT(CALL("neg", SIDE, ARGS(aref(11)), RES(14)), ERR_DROPPED, "Call neg: argument 'self' (tensor 11)",
         site);
  expect_described_dropped(11, drop_seq);
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(10), afloat(1)), NORES));
}

Test(commands, handle_dropped_by_drop_then_borrow_dropped) {
  ZEROS(10, 2);
  ok(borrow(11, 10, SIDE, true, 12));
  ok(DROP(11));
  uint64_t seq = last_seq;
  char site[96];
  snprintf(site, sizeof site, "(tensor 11) was dropped at command seq %llu", (unsigned long long)seq);
  REJECT(CALL("neg", SIDE, ARGS(aref(11)), RES(13)), ERR_DROPPED, "Call neg: argument 'self'", site);
  cr_assert_null(strstr(err.msg, "when its borrow"), "the borrow is still live: %s", err.msg);
  REJECT(CALL("neg", STREAM_MAIN, ARGS(aref(10)), RES(13)), ERR_BORROWED, "borrow 12");
  ok(drop_borrow(12));
  ok(CALL("neg", STREAM_MAIN, ARGS(aref(10)), RES(13)));
  cr_assert_eq(dropped_seq(11), seq);
}

Test(commands, nested_borrows_drop_inner_first) {
  /* 10 --read--> 21 (side) --read--> 23 (third). Dropping the outer borrow
   * would drop 21 while borrow 24 still reads it on 'third' (and free the
   * record DropBorrow 24 later needs): BORROWED, like Drop of a borrowed tensor. */
  ZEROS(10, 2);
  ok(create_stream(20, "third"));
  ok(borrow(21, 10, SIDE, false, 22));
  ok(borrow(23, 21, 20, false, 24));
  REJECT(drop_borrow(22), ERR_BORROWED, "DropBorrow: borrow 22", "tensor 21", "borrow 24",
         "drop that borrow first");
  cr_assert_eq(state_of(21), TENSOR_LIVE, "the rejected DropBorrow changed nothing");
  cr_assert_not_null(objects_get(objs, 22), "borrow 22 is still live");
  ok(drop_borrow(24));
  cr_assert(dropped_seq(23));
  ok(drop_borrow(22));
  cr_assert(dropped_seq(21));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(10), afloat(1)), NORES));
}

Test(commands, borrow_rejections) {
  ZEROS(10, 2);
  zeros(11, ROOT, SIDE, 0, I64(2), 1);
  REJECT(borrow(20, 10, STREAM_MAIN, false, 21), ERR_BAD_ARGUMENT,
         "Borrow: tensor 10 is already on stream 'main'; borrow it onto another stream");
  REJECT(borrow(21, 10, SIDE, false, 20), ERR_REF_REUSED, "Borrow: ref 20 comes after ref 21");
  REJECT(borrow(20, 10, SIDE, false, 11), ERR_REF_REUSED, "Borrow");
  REJECT(borrow(20, 99, SIDE, false, 21), ERR_UNKNOWN_REF, "Borrow: input is ref 99");
  REJECT(borrow(20, 10, 77, false, 21), ERR_UNKNOWN_REF, "Borrow: stream is ref 77");
  REJECT(borrow(20, 10, ROOT, false, 21), ERR_UNKNOWN_REF, "Borrow: stream is ref 1, which is a mesh");
  expect_ref_free(20);
  expect_ref_free(21);

  ok(borrow(20, 10, SIDE, true, 21));
  REJECT(borrow(22, 10, SIDE, true, 23), ERR_BORROWED,
         "Borrow: tensor 10 (or a view of it) is mutably borrowed by borrow 21");
  REJECT(borrow(22, 10, SIDE, false, 23), ERR_BORROWED, "mutably borrowed by borrow 21");
  ok(create_stream(24, "third"));
  ok(borrow(25, 11, STREAM_MAIN, false, 26));
  REJECT(borrow(27, 11, 24, true, 28), ERR_BORROWED,
         "Borrow: cannot borrow tensor 11 mutably because it (or a view) is already being borrowed "
         "non-mutably (1 read borrow)");
  REJECT(borrow(27, 25, 24, true, 28), ERR_BORROWED,
         "Borrow: tensor 25 is a read-only borrow (borrow 26) and cannot be borrowed mutably");
  expect_ref_free(27);

  REJECT(drop_borrow(99), ERR_UNKNOWN_REF, "DropBorrow: borrow is ref 99, which this session never defined");
  REJECT(drop_borrow(10), ERR_UNKNOWN_REF, "DropBorrow: borrow is ref 10, which is a tensor, not a borrow");
  ok(drop_borrow(21));
  uint64_t seq = last_seq;
  char site[96];
  snprintf(site, sizeof site, "DropBorrow: borrow 21 was already dropped by command %llu",
           (unsigned long long)seq);
  REJECT(drop_borrow(21), ERR_DROPPED, site);
  ok(borrow(29, 10, SIDE, true, 30));
}

Test(commands, drop_drops_every_alias_and_frees_bytes) {
  ZEROS(10, 2, 3);
  ZEROS(11, 4);
  ok(CALL("t", STREAM_MAIN, ARGS(aref(10)), RES(12)));
  cr_assert_eq(objs->live_tensors, 3);
  cr_assert_eq(objs->bytes, 24 * 8 + 16 * 8);
  ok(DROP(12));
  uint64_t seq = last_seq;
  cr_assert_eq(out.res.n_tensors, 0);
  cr_assert_eq(dropped_seq(10), seq, "dropping a view drops its base (every alias)");
  cr_assert_eq(dropped_seq(12), seq);
  cr_assert_eq(state_of(11), TENSOR_LIVE);
  cr_assert_eq(objs->live_tensors, 1);
  cr_assert_eq(objs->bytes, 16 * 8);
  expect_described_dropped(10, seq);
  ok(DROP(10, 11, 11)); /* a dropped tensor again, and a ref twice: no-ops */
  cr_assert_eq(dropped_seq(10), seq, "the first drop site is kept");
  cr_assert_eq(dropped_seq(11), last_seq);
  cr_assert_eq(objs->live_tensors, 0);
  cr_assert_eq(objs->bytes, 0);
  char site[64];
  snprintf(site, sizeof site, "(tensor 12) was dropped at command seq %llu", (unsigned long long)seq);
  REJECT(CALL("neg", STREAM_MAIN, ARGS(aref(12)), RES(13)), ERR_DROPPED, "Call neg: argument 'self'", site,
         "can no longer be used");
}

Test(commands, drop_of_two_aliases_in_one_command) {
  ZEROS(10, 2, 3);
  ok(CALL("t", STREAM_MAIN, ARGS(aref(10)), RES(11)));
  ok(DROP(11, 10));
  cr_assert_eq(dropped_seq(10), last_seq);
  cr_assert_eq(dropped_seq(11), last_seq);
  cr_assert_eq(objs->live_tensors, 0);
  cr_assert_eq(objs->bytes, 0);
}

Test(commands, drop_rejections_change_nothing) {
  ZEROS(10, 2);
  ZEROS(11, 2);
  REJECT(DROP(10, 99), ERR_UNKNOWN_REF, "Drop: ref 99 was never defined in this session");
  cr_assert_eq(state_of(10), TENSOR_LIVE, "Drop is all or nothing");
  REJECT(DROP(10, ROOT), ERR_BAD_ARGUMENT, "Drop: ref 1 is a mesh; only tensors are dropped");
  REJECT(DROP(SIDE), ERR_BAD_ARGUMENT, "Drop: ref 3 is a stream");
  cr_assert_eq(state_of(10), TENSOR_LIVE);
  ok(CALL("view", STREAM_MAIN, ARGS(aref(11), AINTS(2)), RES(12)));
  ok(borrow(13, 11, SIDE, false, 14));
  REJECT(DROP(10, 11), ERR_BORROWED,
         "Drop: tensor 11 (or a view of it) is borrowed (borrow 14); drop the borrow first");
  REJECT(DROP(12), ERR_BORROWED, "Drop: tensor 12 (or a view of it) is borrowed (borrow 14)");
  REJECT(DROP(14), ERR_BAD_ARGUMENT, "Drop: ref 14 is a borrow");
  cr_assert_eq(state_of(10), TENSOR_LIVE);
  cr_assert_eq(state_of(11), TENSOR_LIVE);
  cr_assert_eq(objs->live_tensors, 4);
  ok(drop_borrow(14));
  REJECT(DROP(14), ERR_BAD_ARGUMENT, "Drop: ref 14 is a borrow (dropped by command");
  ok(DROP(12));
  cr_assert_eq(dropped_seq(11), last_seq);
}

/* ------------------------------------------------------------------ quota */

Test(commands, quota_rejects_and_changes_nothing) {
  open_session(1000);
  ok(create_mesh(1, NAMES("gpu"), I64(8), 1));
  /* zeros [10] float32 on 8 ranks: 320 bytes each */
  for (uint64_t r = 10; r < 13; r++) ok(FACTORY(.ref = r, .mesh = 1, SHAPE(10)));
  cr_assert_eq(objs->bytes, 960);
  REJECT(FACTORY(.ref = 13, .mesh = 1, SHAPE(10)), ERR_QUOTA,
         "Factory: the result needs 320 bytes across its mesh, but the session holds 960 of its "
         "1000-byte quota; drop tensors you no longer need");
  REJECT(CALL("neg", STREAM_MAIN, ARGS(aref(10)), RES(13)), ERR_QUOTA, "Call neg: the result needs 320 bytes");
  REJECT(REDUCE(.ref = 13, .input = 10), ERR_QUOTA, "Reduce: the result needs 320 bytes");
  REJECT(TO_MESH(.ref = 13, .input = 10, .dst_mesh = 1), ERR_QUOTA, "ToMesh: the result needs 320 bytes");
  expect_ref_free(13);
  cr_assert_eq(objs->bytes, 960);
  cr_assert_eq(objs->live_tensors, 3);
  for (uint64_t r = 10; r < 13; r++) {
    ok(describe(r));
    expect_meta(result(0), r, DTYPE_FLOAT32, 1, STREAM_MAIN);
    EXPECT_SHAPE(result(0), 10);
  }
  /* what needs no new memory still works: views, in place, out= */
  ok(CALL("view", STREAM_MAIN, ARGS(aref(10), AINTS(2, 5)), RES(13)));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(10), aref(11)), NORES));
  ok(REDUCE(.input = 10, .inplace = true));
  ok(REDUCE(.input = 10, .out = 11));
  /* dropping frees room */
  ok(DROP(12));
  ok(FACTORY(.ref = 14, .mesh = 1, SHAPE(10)));
  cr_assert_eq(objs->bytes, 960);
}

/* ------------------------------------------------------------------ limits (issue 13) */

/* A new session under `limits`, with mesh 1 {gpu: 8} (which counts). */
static void limited_session(session_limits_t limits) {
  session_table_set_limits(table, &limits);
  open_session(0);
  cr_assert_eq(sess->limits.max_refs, limits.max_refs);
  ok(create_mesh(1, NAMES("gpu"), I64(8), 1));
}

Test(commands, live_refs_are_bounded_per_session) {
  limited_session((session_limits_t){.max_refs = 6});
  ok(create_stream(2, "side"));
  ZEROS(10, 2);
  ok(CALL("view", STREAM_MAIN, ARGS(aref(10), AINTS(2)), RES(11))); /* views count */
  ok(borrow(12, 10, 2, false, 13));                                /* a borrow and its handle */
  cr_assert_eq(objects_live_refs(objs), 6);
  char who[64];
  snprintf(who, sizeof who, "session %.8s holds 6 live refs", sess->id);
  REJECT(FACTORY(.ref = 14, .mesh = 1, SHAPE(2)), ERR_QUOTA, "Factory: ", who,
         "and this command adds 1, more than a session may hold here (--session-max-refs 6); "
         "drop tensors it no longer needs");
  REJECT(CALL("neg", STREAM_MAIN, ARGS(aref(10)), RES(14)), ERR_QUOTA, "Call neg: session", "--session-max-refs 6");
  REJECT(REDUCE(.ref = 14, .input = 10), ERR_QUOTA, "Reduce: session", "--session-max-refs");
  REJECT(TO_MESH(.ref = 14, .input = 10, .dst_mesh = 1), ERR_QUOTA, "ToMesh: session");
  REJECT(create_mesh(14, NAMES("gpu"), I64(2), 1), ERR_QUOTA, "CreateMesh: session");
  REJECT(slice_mesh(14, 1, SELS(sel_index("gpu", 0))), ERR_QUOTA, "SliceMesh: session");
  REJECT(create_stream(14, "more"), ERR_QUOTA, "CreateStream: session");
  expect_ref_free(14);
  cr_assert_eq(objects_live_refs(objs), 6);
  /* the end of a borrow frees two refs (the borrow, its handle); a borrow needs two */
  ok(drop_borrow(13));
  cr_assert_eq(objects_live_refs(objs), 4);
  ZEROS(14, 2);
  REJECT(borrow(15, 10, 2, false, 16), ERR_QUOTA, "Borrow: session", "holds 5 live refs", "and this command adds 2");
  ZEROS(15, 2);
  REJECT(FACTORY(.ref = 16, .mesh = 1, SHAPE(2)), ERR_QUOTA, "--session-max-refs 6");
  /* what defines no ref still runs; a drop makes room */
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(14), aref(15)), NORES));
  ok(DROP(15));
  ZEROS(16, 2);
}

Test(commands, meshes_and_streams_are_bounded_per_session) {
  limited_session((session_limits_t){.max_meshes = 3, .max_streams = 2});
  ok(slice_mesh(2, 1, SELS(sel_index("gpu", 0))));
  ok(create_mesh(3, NAMES("gpu"), I64(2), 1));
  char who[64];
  snprintf(who, sizeof who, "session %.8s has made 3 meshes", sess->id);
  REJECT(create_mesh(4, NAMES("gpu"), I64(2), 1), ERR_QUOTA, "CreateMesh: ", who,
         "the most a session may make here (--session-max-meshes 3); a mesh lasts as long as its "
         "session: reuse the ones it has, or close it and open a new session");
  REJECT(slice_mesh(4, 1, SELS(sel_index("gpu", 1))), ERR_QUOTA, "SliceMesh: ", who);
  expect_ref_free(4);
  cr_assert_eq(objs->meshes, 3);
  ok(create_stream(4, "a"));
  ok(create_stream(5, "b"));
  REJECT(create_stream(6, "c"), ERR_QUOTA, "CreateStream: session", "has made 2 streams",
         "(--session-max-streams 2); a stream lasts as long as its session");
  expect_ref_free(6);
  /* the meshes and streams it has keep working */
  ok(FACTORY(.ref = 6, .mesh = 3, .stream = 5, SHAPE(2)));
}

Test(commands, refs_per_command_are_bounded) {
  limited_session((session_limits_t){.max_command_refs = 3});
  for (uint64_t r = 10; r < 14; r++) ok(FACTORY(.ref = r, .mesh = 1, SHAPE(2)));
  REJECT(DROP(10, 11, 12, 13), ERR_QUOTA,
         "Drop: 4 refs in one command, more than the 3 one command may name here "
         "(--max-command-refs); drop them in several commands");
  cr_assert_eq(state_of(10), TENSOR_LIVE, "a refused Drop drops nothing");
  cr_assert_eq(objs->live_tensors, 4);
  ok(DROP(10, 11, 12));
  ok(DROP(13));
  cr_assert_eq(objs->live_tensors, 0);
}

Test(commands, without_limits_nothing_is_bounded) {
  limited_session((session_limits_t){0});
  for (uint64_t r = 2; r < 40; r++) ok(slice_mesh(r, 1, SELS(sel_index("gpu", (int64_t)(r % 8)))));
  uint64_t many[5000];
  for (size_t i = 0; i < 5000; i++) many[i] = 100000 + i;
  REJECT(drop_(many, 5000), ERR_UNKNOWN_REF, "Drop: ref 100000 was never defined");
}

/* The element limit holds when the command is checked: a 2^40-element
 * factory on agents that registered no capacity used to be accepted and fail
 * only when an agent ran it (issue 13). */
Test(commands, a_factory_past_the_element_limit_is_refused_at_check_time) {
  layout_set_limits(&(layout_limits_t){LAYOUT_MAX_DIMS, (int64_t)1 << 34});
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, SHAPE((int64_t)1 << 20, (int64_t)1 << 20)), ERR_QUOTA,
         "Factory zeros: argument 'size': shape [1048576, 1048576] has 1099511627776 elements, "
         "more than the 17179869184 a tensor may have here (--max-tensor-elements)");
  expect_ref_free(10);
  cr_assert_eq(objs->live_tensors, 0);
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, SHAPE(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)),
         ERR_BAD_ARGUMENT, "17 dims is too many");
  layout_set_limits(&(layout_limits_t){2, (int64_t)1 << 34});
  REJECT(FACTORY(.ref = 10, .mesh = ROOT, SHAPE(1, 1, 1)), ERR_QUOTA,
         "3 dims is more than the 2 a tensor may have here (--max-tensor-dims)");
  ZEROS(10, 4, 4);
  REJECT(CALL("unsqueeze", STREAM_MAIN, ARGS(aref(10), aint(0)), RES(11)), ERR_QUOTA,
         "Call unsqueeze: result: 3 dims", "(--max-tensor-dims)");
  /* only the hard bounds: the same factory passes the checks (no agent capacity is known here) */
  layout_set_limits(NULL);
  ok(FACTORY(.ref = 11, .mesh = ROOT, SHAPE((int64_t)1 << 20, (int64_t)1 << 20)));
}

static sel_t *sel_step(const char *dim, int64_t start, int64_t step, bool has_step) {
  sel_t *s = sel_range(dim, start, INT64_MAX);
  s->range->has_stop = false;
  s->range->step = step;
  s->range->has_step = has_step;
  return s;
}

Test(commands, slice_steps_are_1_to_the_dim_size) {
  REJECT(slice_mesh(10, ROOT, SELS(sel_step("gpu", 0, 0, true))), ERR_BAD_ARGUMENT,
         "SliceMesh: step 0 for dim 'gpu' must be >= 1 (leave it out for 1)");
  REJECT(slice_mesh(10, ROOT, SELS(sel_step("gpu", 0, INT64_MAX, false))), ERR_BAD_ARGUMENT,
         "SliceMesh: step 9223372036854775807 for dim 'gpu' is beyond the dim's size 4");
  REJECT(slice_mesh(10, ROOT, SELS(sel_step("host", 0, -1, true))), ERR_BAD_ARGUMENT,
         "step -1 for dim 'host' must be >= 1");
  REJECT(TO_MESH(.ref = 10, .input = 99, .dst_mesh = SUB), ERR_UNKNOWN_REF, "ToMesh: input");
  ZEROS(10, 2);
  REJECT(TO_MESH(.ref = 11, .input = 10, .dst_mesh = SUB, .sel = {sel_step("gpu", 0, 5, true)}),
         ERR_BAD_ARGUMENT, "ToMesh: SliceMesh: step 5 for dim 'gpu' is beyond the dim's size 4");
  expect_ref_free(11);
  /* no step given (0 without has_step) is 1; the size itself is a step */
  ok(slice_mesh(11, ROOT, SELS(sel_step("gpu", 1, 0, false))));
  cr_assert_eq(out.res.mesh->n_ranks, 6);
  ok(slice_mesh(12, ROOT, SELS(sel_step("gpu", 1, 4, true))));
  cr_assert_eq(out.res.mesh->n_ranks, 2);
}

/* Found by tests/fuzz/fuzz_commands: the sum of what a session holds and a huge
 * result wrapped past 2^64 and slipped under the quota (agents of unknown
 * capacity, as cuda agents register, check nothing per rank). */
Test(commands, quota_sums_do_not_wrap) {
  open_session(64u << 20);
  ok(create_mesh(1, NAMES("gpu"), I64(8), 1));
  ok(FACTORY(.ref = 10, .mesh = 1, SHAPE(1)));
  cr_assert_eq(objs->bytes, 32);
  /* 2^62 bytes on each of 8 ranks: 2^65 in all */
  REJECT(FACTORY(.ref = 11, .mesh = 1, SHAPE((int64_t)1 << 60)), ERR_QUOTA,
         "Factory: the result needs 4611686018427387904 bytes on each of 8 ranks, more than the "
         "session can hold (2^64 bytes in all)");
  expect_ref_free(11);
  cr_assert_eq(objs->bytes, 32);
  /* without a quota too: the session's count must not wrap */
  open_session(0);
  ok(create_mesh(1, NAMES("gpu"), I64(8), 1));
  ok(FACTORY(.ref = 10, .mesh = 1, SHAPE(1)));
  REJECT(FACTORY(.ref = 11, .mesh = 1, SHAPE((int64_t)1 << 60)), ERR_QUOTA, "more than the session can hold");
  ok(FACTORY(.ref = 12, .mesh = 1, SHAPE((int64_t)1 << 58)));
  cr_assert_eq(objs->bytes, 32 + ((uint64_t)1 << 63));
  REJECT(FACTORY(.ref = 13, .mesh = 1, SHAPE((int64_t)1 << 58)), ERR_QUOTA, "more than the session can hold");
  expect_ref_free(13);
}

/* ------------------------------------------------------------------ sync, describe, misc */

Test(commands, sync_and_describe) {
  ok(sync_(false, 0));
  ok(sync_(true, STREAM_MAIN));
  ok(sync_(true, SIDE));
  REJECT(sync_(true, 77), ERR_UNKNOWN_REF, "Sync: stream is ref 77");
  REJECT(sync_(true, ROOT), ERR_UNKNOWN_REF, "Sync: stream is ref 1, which is a mesh, not a stream");
  ZEROS(10, 3);
  ok(describe(10));
  expect_meta(result(0), 10, DTYPE_FLOAT32, ROOT, STREAM_MAIN);
  EXPECT_SHAPE(result(0), 3);
  REJECT(describe(99), ERR_UNKNOWN_REF, "Describe: ref 99 was never defined in this session");
  REJECT(describe(SIDE), ERR_BAD_ARGUMENT, "Describe: ref 3 is a stream; Describe takes tensors and meshes");
  ok(borrow(11, 10, SIDE, false, 12));
  REJECT(describe(12), ERR_BAD_ARGUMENT, "Describe: ref 12 is a borrow");
  ok(drop_borrow(12));
  REJECT(describe(12), ERR_BAD_ARGUMENT, "Describe: ref 12 is a borrow (dropped by command");
}

Test(commands, a_command_without_kind) {
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  REJECT(run(&c), ERR_BAD_ARGUMENT, "has no kind: set one of create_mesh");
  cr_assert_str_eq(command_name(&c), "(empty command)");
  c.kind_case = MESHD__V1__COMMAND__KIND_TO_MESH;
  cr_assert_str_eq(command_name(&c), "ToMesh");
}

Test(commands, cmd_out_error_fills_the_error) {
  REJECT(describe(99), ERR_UNKNOWN_REF, "Describe");
  cmd_out_error(&out, &err);
  cr_assert_not_null(out.res.error);
  cr_assert_eq((int)out.res.error->kind, ERR_UNKNOWN_REF);
  cr_assert_eq(out.res.error->code, GRPC_STATUS_NOT_FOUND);
  cr_assert_eq(out.res.error->seq, last_seq);
  cr_assert_str_eq(out.res.error->message, err.msg);
}

Test(commands, instructions_touch_only_the_mesh_ranks) {
  cr_assert_eq(objs->ntouched, 0, "meshes and streams send nothing");
  zeros(10, SUB, STREAM_MAIN, 0, I64(2), 1);
  for (uint32_t r = 0; r < 8; r++)
    cr_assert_eq(r < objs->ntouched && objs->touched[r], r >= 4, "rank %u", r);
  ok(slice_mesh(11, ROOT, SELS(sel_index("gpu", 1))));  /* ranks 1, 5 */
  zeros(12, 11, STREAM_MAIN, 0, I64(2), 1);
  for (uint32_t r = 0; r < 8; r++)
    cr_assert_eq(r < objs->ntouched && objs->touched[r], r >= 4 || r == 1, "rank %u", r);
}

Test(commands, inplace_refuses_a_partially_overlapping_input) {
  ZEROS(20, 4, 4);
  /* x.add_(x): the same view is fine, as in torch. */
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(20), aref(20)), RES(21)));
  /* x.add_(x.t()): another view of the same memory would depend on kernel order. */
  ok(CALL("t", STREAM_MAIN, ARGS(aref(20)), RES(22)));
  REJECT(CALL("add_", STREAM_MAIN, ARGS(aref(20), aref(22)), RES(23)), ERR_BAD_ARGUMENT,
                "Call add_", "writes memory that", "clone the input first");
  /* A clone is a different storage: accepted. */
  ok(CALL("clone", STREAM_MAIN, ARGS(aref(22)), RES(24)));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(20), aref(24)), RES(25)));
  /* Two views that share no byte: x[0].add_(x[1]) is accepted, as in torch;
   * x[0:2].add_(x[1:3]) overlaps and is not. */
  ok(CALL("select", STREAM_MAIN, ARGS(aref(20), aint(0), aint(0)), RES(26)));
  ok(CALL("select", STREAM_MAIN, ARGS(aref(20), aint(0), aint(1)), RES(27)));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(26), aref(27)), RES(28)));
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(0), aint(0), aint(2)), RES(29)));
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(0), aint(1), aint(3)), RES(30)));
  REJECT(CALL("add_", STREAM_MAIN, ARGS(aref(29), aref(30)), RES(31)), ERR_BAD_ARGUMENT,
         "writes memory that");
}

/* Views of one storage whose byte ranges interleave but share no element
 * (columns, halves of rows, every other row) are disjoint, as in torch and as
 * protocol.md says: only views that share an element are refused. The same
 * elements through another stride on a size-1 dim are the same view. */
Test(commands, inplace_accepts_interleaved_views_that_share_no_element) {
  ZEROS(20, 4, 4);
  /* x[:, 0].copy_(x[:, 1]) */
  ok(CALL("select", STREAM_MAIN, ARGS(aref(20), aint(1), aint(0)), RES(21)));
  ok(CALL("select", STREAM_MAIN, ARGS(aref(20), aint(1), aint(1)), RES(22)));
  ok(CALL("copy_", STREAM_MAIN, ARGS(aref(21), aref(22)), RES(23)));
  /* x[:, :2].add_(x[:, 2:]) */
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(1), aint(0), aint(2)), RES(24)));
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(1), aint(2), aint(4)), RES(25)));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(24), aref(25)), RES(26)));
  /* x[::2].copy_(x[1::2]) */
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(0), aint(0), aint(4), aint(2)), RES(27)));
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(0), aint(1), aint(4), aint(2)), RES(28)));
  ok(CALL("copy_", STREAM_MAIN, ARGS(aref(27), aref(28)), RES(29)));
  /* ... but x[:, 1:].copy_(x[:, :-1]) and x[1:].copy_(x[:-1]) share elements. */
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(1), aint(1), aint(4)), RES(30)));
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(1), aint(0), aint(3)), RES(31)));
  REJECT(CALL("copy_", STREAM_MAIN, ARGS(aref(30), aref(31)), RES(32)), ERR_BAD_ARGUMENT,
         "Call copy_", "writes memory that", "clone the input first");
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(0), aint(1), aint(4)), RES(33)));
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(0), aint(0), aint(3)), RES(34)));
  REJECT(CALL("copy_", STREAM_MAIN, ARGS(aref(33), aref(34)), RES(35)), ERR_BAD_ARGUMENT,
         "writes memory that");
  /* x[:, 0:2] and x[1:3, 1] share x[1, 1] */
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(0), aint(1), aint(3)), RES(36)));
  ok(CALL("select", STREAM_MAIN, ARGS(aref(36), aint(1), aint(1)), RES(37)));
  ok(CALL("slice", STREAM_MAIN, ARGS(aref(20), aint(1), aint(0), aint(2)), RES(38)));
  ok(CALL("select", STREAM_MAIN, ARGS(aref(38), aint(0), aint(1)), RES(39))); /* x[1, 0:2] */
  REJECT(CALL("add_", STREAM_MAIN, ARGS(aref(39), aref(37)), RES(40)), ERR_BAD_ARGUMENT,
         "writes memory that");
  /* y = x[0]: y.unsqueeze(0) (strides [4, 1]) and y.unsqueeze(1).t() (strides
   * [1, 1]) are the same elements in the same order: the same view. */
  ok(CALL("select", STREAM_MAIN, ARGS(aref(20), aint(0), aint(0)), RES(41)));
  ok(CALL("unsqueeze", STREAM_MAIN, ARGS(aref(41), aint(0)), RES(42)));
  ok(CALL("unsqueeze", STREAM_MAIN, ARGS(aref(41), aint(1)), RES(43)));
  ok(CALL("t", STREAM_MAIN, ARGS(aref(43)), RES(44)));
  ok(CALL("add_", STREAM_MAIN, ARGS(aref(42), aref(44)), RES(45)));
}

/* x.fill_(x[1]): torch's fill_ takes a 0-dim value that is a view of self (it
 * clones it first); the fill writes the value's own bits wherever it reads
 * them, so the kernel order cannot matter. Other ops keep the refusal:
 * x.add_(x[1]) and x.copy_(x[1]) are partial overlaps in torch too. */
Test(commands, fill_accepts_a_0dim_view_of_self) {
  ZEROS(20, 4);
  ok(CALL("select", STREAM_MAIN, ARGS(aref(20), aint(0), aint(1)), RES(21)));
  ok(CALL("fill_", STREAM_MAIN, ARGS(aref(20), aref(21)), RES(22)));
  REJECT(CALL("add_", STREAM_MAIN, ARGS(aref(20), aref(21)), RES(23)), ERR_BAD_ARGUMENT,
         "writes memory that");
  REJECT(CALL("copy_", STREAM_MAIN, ARGS(aref(20), aref(21)), RES(24)), ERR_BAD_ARGUMENT,
         "writes memory that");
}

/* DrainAgent: sessions created after a drain get no mesh on the drained rank
 * (the lowest run of healthy undrained ranks instead); older sessions keep it. */
Test(commands, create_mesh_avoids_ranks_drained_before_the_session) {
  meshd_error_t e;
  /* Times are in ms and a drain in the session's own ms counts as before it. */
  nanosleep(&(struct timespec){0, 2000000}, NULL);
  cr_assert_eq(agent_pool_set_drained(pool, 1, true, &e), 0, "%s", e.msg);
  ok(create_mesh(10, NAMES("gpu"), I64(4), 1)); /* the session predates the drain */
  EXPECT_RANKS(out.res.mesh, 0, 1, 2, 3);

  open_session(0);
  ok(create_mesh(1, NAMES("gpu"), I64(4), 1));
  EXPECT_RANKS(out.res.mesh, 2, 3, 4, 5);
  ok(create_mesh(2, NAMES("host", "gpu"), I64(2, 2), 2));
  EXPECT_RANKS(out.res.mesh, 2, 3, 4, 5);
  ok(create_mesh(3, NAMES("gpu"), I64(1), 1)); /* rank 0 is free: nothing moves */
  EXPECT_RANKS(out.res.mesh, 0);
  REJECT(create_mesh(4, NAMES("gpu"), I64(7), 1), ERR_QUOTA, "CreateMesh {gpu: 7}",
         "rank 1 is drained", "7 healthy undrained agents in all");

  /* Undrained: the next session is placed as before. */
  cr_assert_eq(agent_pool_set_drained(pool, 1, false, &e), 0, "%s", e.msg);
  open_session(0);
  ok(create_mesh(1, NAMES("gpu"), I64(4), 1));
  EXPECT_RANKS(out.res.mesh, 0, 1, 2, 3);
}

Test(commands, drain_belongs_to_the_rank) {
  meshd_error_t e;
  cr_assert_eq(agent_pool_set_drained(pool, 9, true, &e), -1);
  cr_assert(strstr(e.msg, "rank 9 has no agent"), "%s", e.msg);
  cr_assert_eq(agent_pool_set_drained(pool, 2, true, &e), 0, "%s", e.msg);
  cr_assert_eq(agent_pool_set_drained(pool, 2, true, &e), 0, "%s", e.msg); /* idempotent */
  /* The agent leaves and another registers at rank 2: still drained. */
  agent_pool_remove(pool, 2, "agent-2", 0, "test");
  agent_desc_t d = {0};
  snprintf(d.agent_id, sizeof d.agent_id, "agent-2b");
  snprintf(d.address, sizeof d.address, "127.0.0.1:2002");
  snprintf(d.device, sizeof d.device, "cpu");
  char msg[200];
  cr_assert_eq(agent_pool_add(pool, &d, 2, msg, sizeof msg), 2, "%s", msg);
  bool *drained = agent_pool_drained_map(pool, rpc_now_ms(), 8);
  cr_assert_not_null(drained);
  for (int i = 0; i < 8; i++) cr_assert_eq(drained[i], i == 2, "rank %d", i);
  free(drained);
  /* Away, it can be undrained (not drained). */
  agent_pool_remove(pool, 2, "agent-2b", 0, "test");
  cr_assert_eq(agent_pool_set_drained(pool, 2, true, &e), -1);
  cr_assert_eq(agent_pool_set_drained(pool, 2, false, &e), 0, "%s", e.msg);
}

/* ------------------------------------------------------------------ pool health */

/* Two agents turn healthy at once: the server's health follows the pool's
 * change notifications, so the last one must carry the last count (the
 * TensorService once stayed NOT_SERVING with both agents healthy: the thread
 * that counted 1 delivered after the one that counted 2). A notification of
 * a partial count is slow here, as under load. */
typedef struct {
  atomic_int last;
  pthread_barrier_t go;
  agent_pool_t *pool;
} health_race_t;

static void health_changed(int healthy, void *arg) {
  health_race_t *h = arg;
  if (healthy == 1) usleep(20 * 1000);
  atomic_store(&h->last, healthy);
}

typedef struct {
  health_race_t *h;
  uint32_t rank;
} turn_healthy_t;

static void *turn_healthy(void *arg) {
  turn_healthy_t *t = arg;
  char id[32];
  snprintf(id, sizeof id, "racer-%u", t->rank);
  pthread_barrier_wait(&t->h->go);
  agent_pool_set_healthy(t->h->pool, t->rank, id, 0, true);
  return NULL;
}

Test(agent_pool, the_last_health_notification_has_the_last_count, .timeout = 60) {
  log_set_level(LOG_LEVEL_ERROR);
  health_race_t h = {0};
  agent_pool_callbacks_t cb = {.changed = health_changed, .arg = &h};
  h.pool = agent_pool_create(&cb);
  cr_assert_not_null(h.pool);
  add_agents(h.pool, "racer", 2, 2000);
  for (int round = 0; round < 20; round++) {
    pthread_barrier_init(&h.go, NULL, 2);
    turn_healthy_t t[2] = {{&h, 0}, {&h, 1}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, turn_healthy, &t[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&h.go);
    cr_assert_eq(agent_pool_healthy(h.pool), 2);
    cr_assert_eq(atomic_load(&h.last), 2, "round %d: the last notification said %d healthy",
                 round, atomic_load(&h.last));
    agent_pool_set_healthy(h.pool, 0, "racer-0", 0, false);
    agent_pool_set_healthy(h.pool, 1, "racer-1", 0, false);
    cr_assert_eq(atomic_load(&h.last), 0);
  }
  agent_pool_destroy(h.pool);
}

/* cmd_call made an op's first result, then ran out of memory making its
 * second: the first stayed in the table, unclaimed, its bytes counted against
 * the session's quota and its ref among the live ones; a retry of the same
 * command then put a second record under the same ref. The records made are
 * taken back: the session is as before, and the retry works. */
Test(commands, a_call_that_runs_out_of_memory_midway_leaves_no_result_behind) {
#if defined(__SANITIZE_ADDRESS__)
  cr_skip_test("calloc is the sanitizer's");
#else
  ZEROS(10, 2, 3);
  uint64_t live = objects_live_refs(objs), bytes = objs->bytes;
  size_t records = objs->table.n;
  atomic_store(&storage_fail_in, 2); /* values made, indices not */
  int rc = CALL("max", STREAM_MAIN, ARGS(aref(10), aint(0)), RES(11, 12));
  int left = atomic_exchange(&storage_fail_in, 0);
  cr_assert_eq(left, 0, "the indices' storage was not the 2nd storage made");
  REJECT(rc, ERR_QUOTA, "out of memory");
  cr_assert_null(objects_get(objs, 11), "the values' record stays");
  cr_assert_eq(objects_live_refs(objs), live, "live refs %llu, were %llu",
               (unsigned long long)objects_live_refs(objs), (unsigned long long)live);
  cr_assert_eq(objs->bytes, bytes, "bytes %llu, were %llu", (unsigned long long)objs->bytes,
               (unsigned long long)bytes);
  ok(CALL("max", STREAM_MAIN, ARGS(aref(10), aint(0)), RES(11, 12)));
  cr_assert_eq(objects_live_refs(objs), live + 2);
  cr_assert_eq(objs->table.n, records + 2, "%zu records, were %zu", objs->table.n, records);
#endif
}
