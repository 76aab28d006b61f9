/* libFuzzer target: the agent's instruction execution on the cpu backend.
 *
 * Each input becomes one InstructionBatch, run the way an Execute stream runs
 * it: seqs numbered from 1 (execute.c refuses anything else before it gets
 * this far), each instruction through validate_envelope (the first refused
 * one ends the batch, as it ends the stream) and then executor_submit on a
 * real cpu backend without a data plane (groups of more than one member must
 * fail cleanly). Once the batch ran, every session it used is ended, and the
 * agent must be back to no open session and zero bytes allocated: a leaked
 * storage aborts, and so does any wait that does not end. One executor serves
 * the whole run, as one Execute call serves its server for hours.
 *
 * Two ways from bytes to a batch (the first byte picks):
 *   even: the rest is a packed InstructionBatch (the corpus's realistic
 *         batches, and whatever the mutator makes of them);
 *   odd:  the rest drives a builder that keeps a model of each session's
 *         tensors, so most instructions name live refs with their true
 *         shapes and results the rules give (ops_infer, reduce_infer), and
 *         reach the kernels; some bytes spoil a field on purpose.
 * Both end packed and decoded again, exactly as the agent receives them.
 *
 * Build (until tests/fuzz/CMakeLists.txt registers it):
 *   clang -fsanitize=fuzzer,address,undefined with meshd_agent, meshd_platform,
 *   meshd_tensor, meshd_proto, grpc, protobuf-c, openblas, m, pthread. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "executor.h"
#include "log.h"
#include "reduction.h"
#include "validate.h"

typedef Meshd__Agent__V1__Instruction instr_t;
typedef Meshd__Agent__V1__TensorSpec spec_t;

#define MAX_INSTRUCTIONS 48
#define MAX_SESSIONS 8
#define NREFS 16
#define WAIT_MS 30000

static backend_t B;
static _Atomic int64_t self_rank;
static run_env_t env;
/* One executor for the whole run, as one Execute call serves a server for
 * hours: seqs go on from input to input, every input ends its sessions. */
static executor_t *X;
static uint64_t last_seq;

/* FUZZ_VERBOSE=1 prints every failure the agent reports (to see how deep
 * the inputs reach). */
static bool verbose;

static void on_report(const executor_report_t *r, void *arg) {
  (void)arg;
  for (size_t i = 0; verbose && i < r->n_errors; i++)
    fprintf(stderr, "seq %llu: %s\n", (unsigned long long)r->errors[i]->seq,
            r->errors[i]->message);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  log_set_level(LOG_LEVEL_ERROR);
  verbose = getenv("FUZZ_VERBOSE") != NULL;
  B.ops = backend_for_device("cpu");
  /* Large allocations fail fast with QUOTA. FUZZ_CAPACITY (bytes) changes it:
   * long runs go faster with less, since ASan maps and unmaps big blocks. */
  const char *cap = getenv("FUZZ_CAPACITY");
  B.capacity = cap ? strtoull(cap, NULL, 0) : 64u << 20;
  meshd_error_t e = {0};
  if (!B.ops || B.ops->open(&B, "cpu", &e)) {
    fprintf(stderr, "cpu backend: %s\n", e.msg);
    abort();
  }
  atomic_store(&self_rank, 0);
  env = (run_env_t){.backend = &B, .rank = &self_rank};
  if (!(X = executor_create(&env, on_report, NULL))) abort();
  return 0;
}

/* ================================================================ builder */

static uint8_t arena[1 << 20];
static size_t arena_used;

static void *A(size_t n) {
  size_t at = (arena_used + 15) & ~(size_t)15;
  if (at + n > sizeof arena) abort(); /* the builder's bounds keep it far below */
  arena_used = at + n;
  return memset(arena + at, 0, n);
}

typedef struct rd {
  const uint8_t *p;
  size_t n;
} rd_t;

static unsigned u8(rd_t *r) {
  if (!r->n) return 0;
  r->n--;
  return *r->p++;
}

static uint64_t u64(rd_t *r) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v = v << 8 | u8(r);
  return v;
}

/* Mostly small values; sometimes one a hostile server would send. */
static int64_t dim(rd_t *r) {
  static const int64_t wild[] = {-1, 0, (int64_t)1 << 31, (int64_t)1 << 40, INT64_MAX, INT64_MIN};
  unsigned v = u8(r);
  if (v >= 250) return wild[(v - 250) % 6];
  return (int64_t)(v % 5);
}

typedef struct model {
  bool live[NREFS + 1];
  tensor_meta_t m[NREFS + 1];
} model_t;

static const char *const SESSIONS[] = {"s0", "s1"};
static model_t models[2];

static spec_t *spec_of(uint64_t ref, const tensor_meta_t *m) {
  spec_t *sp = A(sizeof *sp);
  meshd__agent__v1__tensor_spec__init(sp);
  sp->ref = ref;
  sp->dtype = (Meshd__V1__DType)m->dtype;
  sp->n_shape = sp->n_strides = (size_t)m->layout.ndim;
  sp->shape = A(sizeof(int64_t) * (size_t)(m->layout.ndim + 1));
  sp->strides = A(sizeof(int64_t) * (size_t)(m->layout.ndim + 1));
  for (int i = 0; i < m->layout.ndim; i++) {
    sp->shape[i] = m->layout.sizes[i];
    sp->strides[i] = m->layout.strides[i];
  }
  sp->storage_offset = m->layout.offset;
  sp->storage = ref;
  return sp;
}

/* A random spec of up to 3 dims. */
static spec_t *random_spec(rd_t *r, uint64_t ref) {
  tensor_meta_t m = {.dtype = (dtype_t)(u8(r) % 12)};
  m.layout.ndim = (int)(u8(r) % 4);
  int64_t stride = 1;
  for (int i = m.layout.ndim - 1; i >= 0; i--) { /* row-major, saturating: sizes may be wild */
    m.layout.sizes[i] = dim(r);
    m.layout.strides[i] = stride;
    if (__builtin_mul_overflow(stride, m.layout.sizes[i] > 1 ? m.layout.sizes[i] : 1, &stride))
      stride = INT64_MAX;
  }
  return spec_of(ref, &m);
}

/* Spoils one field of sp when the next byte says so (1 in 16). */
static void spoil(rd_t *r, spec_t *sp) {
  unsigned v = u8(r);
  if (!sp || v < 240) return;
  switch (v % 6) {
    case 0: if (sp->n_shape) sp->shape[0] = dim(r) == 0 ? -5 : dim(r); break;
    case 1: sp->dtype = (Meshd__V1__DType)(u8(r) % 14); break;
    case 2: if (sp->n_strides) sp->strides[0] = (int64_t)u64(r); break;
    case 3: sp->storage_offset = (int64_t)u64(r); break;
    case 4: sp->n_strides = 0; sp->storage_offset = 0; sp->ref = u8(r) % (NREFS + 1); break;
    case 5: sp->n_shape = u8(r) % 20; sp->n_strides = 0; break;
  }
  if (sp->n_shape > 3) { /* the arrays hold what spec_of made: widen them */
    int64_t *s = A(sizeof(int64_t) * sp->n_shape);
    for (size_t i = 0; i < sp->n_shape; i++) s[i] = (int64_t)(i % 3) + 1;
    sp->shape = s;
  }
}

static uint64_t pick_live(rd_t *r, model_t *m) {
  unsigned start = u8(r);
  for (unsigned i = 0; i < NREFS; i++) {
    uint64_t ref = 1 + (start + i) % NREFS;
    if (m->live[ref]) return ref;
  }
  return 1 + start % NREFS;
}

static uint64_t pick_free(rd_t *r, model_t *m) {
  unsigned start = u8(r);
  for (unsigned i = 0; i < NREFS; i++) {
    uint64_t ref = 1 + (start + i) % NREFS;
    if (!m->live[ref]) return ref;
  }
  return 1 + start % NREFS;
}

static const char *const KINDS[] = {"zeros", "ones", "full", "empty", "arange", "rand", "randn",
                                    "rank", "add"};

static void build_factory(rd_t *r, instr_t *ins, model_t *mo) {
  Meshd__V1__Factory *f = A(sizeof *f);
  meshd__v1__factory__init(f);
  f->kind = (char *)KINDS[u8(r) % 9];
  f->n_shape = u8(r) % 4;
  f->shape = A(sizeof(int64_t) * 4);
  for (size_t i = 0; i < f->n_shape; i++) f->shape[i] = dim(r);
  f->dtype = (Meshd__V1__DType)(u8(r) % 11);
  f->value = (double)(int8_t)u8(r);
  f->start = (double)(u8(r) % 4);
  f->end = (double)(u8(r) % 12);
  f->step = (double)((int)(u8(r) % 5) - 1);
  f->dim = "x";
  f->has_seed = u8(r) & 1;
  f->seed = u8(r);
  f->ref = pick_free(r, mo);
  Meshd__Agent__V1__FactoryOp *fo = A(sizeof *fo);
  meshd__agent__v1__factory_op__init(fo);
  fo->factory = f;
  fo->coordinate = (int64_t)(u8(r) % 3);
  fo->mesh_rank = u8(r) % 3;
  op_args_t a;
  op_infer_t inf;
  meshd_error_t e;
  if (!ops_bind_factory(f, &a, &e) && !ops_infer(&a, &inf, &e)) {
    fo->result = spec_of(f->ref, &inf.results[0].meta);
    mo->live[f->ref] = true;
    mo->m[f->ref] = inf.results[0].meta;
  } else {
    fo->result = random_spec(r, f->ref);
  }
  spoil(r, fo->result);
  ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY;
  ins->factory = fo;
}

static Meshd__V1__Arg *scalar_arg(rd_t *r) {
  Meshd__V1__Arg *a = A(sizeof *a);
  meshd__v1__arg__init(a);
  switch (u8(r) % 6) {
    case 0: a->value_case = MESHD__V1__ARG__VALUE_I; a->i = (int8_t)u8(r); break;
    case 1: a->value_case = MESHD__V1__ARG__VALUE_F; a->f = (double)(int8_t)u8(r) / 4; break;
    case 2: a->value_case = MESHD__V1__ARG__VALUE_B; a->b = u8(r) & 1; break;
    case 3: {
      a->value_case = MESHD__V1__ARG__VALUE_INTS;
      a->ints = A(sizeof *a->ints);
      meshd__v1__int_list__init(a->ints);
      a->ints->n_values = u8(r) % 4;
      a->ints->values = A(sizeof(int64_t) * 4);
      for (size_t i = 0; i < a->ints->n_values; i++) a->ints->values[i] = (int8_t)u8(r) % 4;
      break;
    }
    case 4: a->value_case = MESHD__V1__ARG__VALUE_DTYPE; a->dtype = (Meshd__V1__DType)(u8(r) % 12); break;
    default: a->value_case = MESHD__V1__ARG__VALUE_NONE; a->none = true; break;
  }
  return a;
}

static void build_call(rd_t *r, instr_t *ins, model_t *mo) {
  const op_def_t *op = ops_at(u8(r) % ops_count());
  Meshd__Agent__V1__OpCall *c = A(sizeof *c);
  meshd__agent__v1__op_call__init(c);
  c->op = (char *)op_name(op);
  c->n_args = (size_t)(u8(r) % 4);
  c->args = A(sizeof *c->args * 4);
  op_value_t vals[4];
  const tensor_meta_t *lists[4][3];
  for (size_t i = 0; i < c->n_args; i++) {
    unsigned kind = u8(r) % 4;
    Meshd__V1__Arg *a;
    if (kind <= 1) { /* a tensor, the usual case */
      a = A(sizeof *a);
      meshd__v1__arg__init(a);
      a->value_case = MESHD__V1__ARG__VALUE_REF;
      a->ref = pick_live(r, mo);
      vals[i] = (op_value_t){.kind = mo->live[a->ref] ? VAL_TENSOR : VAL_NONE,
                             .tensor = &mo->m[a->ref]};
    } else if (kind == 2) { /* a list of tensors (cat, stack) */
      a = A(sizeof *a);
      meshd__v1__arg__init(a);
      a->value_case = MESHD__V1__ARG__VALUE_REFS;
      a->refs = A(sizeof *a->refs);
      meshd__v1__ref_list__init(a->refs);
      a->refs->n_refs = 1 + u8(r) % 3;
      a->refs->refs = A(sizeof(uint64_t) * 3);
      vals[i] = (op_value_t){.kind = VAL_TENSORS, .tensors = lists[i], .ntensors = a->refs->n_refs};
      for (size_t j = 0; j < a->refs->n_refs; j++) {
        a->refs->refs[j] = pick_live(r, mo);
        lists[i][j] = &mo->m[a->refs->refs[j]];
        if (!mo->live[a->refs->refs[j]]) vals[i].kind = VAL_NONE;
      }
    } else {
      a = scalar_arg(r);
      op_value_from_arg(a, &vals[i]);
    }
    c->args[i] = a;
  }
  op_args_t args;
  op_infer_t inf;
  meshd_error_t e;
  bool ok = !ops_bind(op, vals, c->n_args, NULL, 0, &args, &e) && !ops_infer(&args, &inf, &e);
  c->n_results = ok ? (size_t)inf.nresults : u8(r) % 2;
  c->results = A(sizeof *c->results * OP_MAX_RESULTS);
  for (size_t i = 0; i < c->n_results; i++) {
    uint64_t ref = pick_free(r, mo);
    c->results[i] = ok ? spec_of(ref, &inf.results[i].meta) : random_spec(r, ref);
    spoil(r, c->results[i]);
    if (ok) {
      mo->live[ref] = true;
      mo->m[ref] = inf.results[i].meta;
    }
  }
  ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CALL;
  ins->call = c;
}

static const char *const REDUCTIONS[] = {"sum", "avg", "product", "min", "max",
                                         "band", "bor", "bxor", "stack", "median"};

static Meshd__Agent__V1__Group *group(rd_t *r) {
  Meshd__Agent__V1__Group *g = A(sizeof *g);
  meshd__agent__v1__group__init(g);
  unsigned v = u8(r);
  g->n_ranks = g->n_addresses = v >= 240 ? 2 : 1; /* two members: no data plane, fails */
  g->ranks = A(sizeof(uint32_t) * 2);
  g->addresses = A(sizeof(char *) * 2);
  for (size_t i = 0; i < g->n_ranks; i++) {
    g->ranks[i] = (uint32_t)i;
    g->addresses[i] = i ? "127.0.0.1:9" : "127.0.0.1:8";
  }
  if (v == 255) g->ranks[0] = 7; /* not this agent */
  g->comm_id = 1 + u8(r);
  return g;
}

static void build_reduce(rd_t *r, instr_t *ins, model_t *mo) {
  Meshd__V1__Reduce *red = A(sizeof *red);
  meshd__v1__reduce__init(red);
  red->reduction = (char *)REDUCTIONS[u8(r) % 10];
  unsigned flags = u8(r);
  red->scatter = flags & 1;
  red->inplace = (flags >> 1) & 1;
  red->input = pick_live(r, mo);
  Meshd__Agent__V1__ReduceOp *ro = A(sizeof *ro);
  meshd__agent__v1__reduce_op__init(ro);
  ro->reduce = red;
  ro->group = group(r);
  tensor_meta_t im = mo->live[red->input] ? mo->m[red->input] : (tensor_meta_t){.dtype = DTYPE_FLOAT32};
  ro->input = spec_of(red->input, &im);
  uint64_t out = red->inplace ? red->input : pick_free(r, mo);
  if (!red->inplace) red->ref = out;
  reduce_args_t ra = {.reduction = reduction_parse(red->reduction), .scatter = red->scatter,
                      .inplace = red->inplace, .input = &im, .group = (int64_t)ro->group->n_ranks,
                      .ndims = 1, .dims_named = true};
  tensor_meta_t rm;
  meshd_error_t e;
  if (!reduce_infer(&ra, &rm, &e)) {
    ro->result = spec_of(out, &rm);
    if (ro->group->n_ranks == 1) {
      mo->live[out] = true;
      mo->m[out] = rm;
    }
  } else {
    ro->result = random_spec(r, out);
  }
  spoil(r, ro->input);
  spoil(r, ro->result);
  /* Onto a sub-mesh: a root that may be outside the group. */
  ro->rooted = (flags >> 2) & 1;
  ro->root = (flags >> 3) % (uint32_t)(ro->group->n_ranks + 1);
  if (((flags >> 6) & 3) == 3) { /* the same specs and group as to_mesh's broadcast chain */
    Meshd__Agent__V1__BroadcastOp *bo = A(sizeof *bo);
    meshd__agent__v1__broadcast_op__init(bo);
    bo->input = ro->input;
    bo->result = ro->result;
    bo->group = ro->group;
    ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST;
    ins->broadcast = bo;
    return;
  }
  ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE;
  ins->reduce = ro;
}

static void build_send(rd_t *r, instr_t *ins, model_t *mo) {
  Meshd__Agent__V1__SendTensor *st = A(sizeof *st);
  meshd__agent__v1__send_tensor__init(st);
  uint64_t in = pick_live(r, mo), out = pick_free(r, mo);
  tensor_meta_t m = mo->live[in] ? mo->m[in] : (tensor_meta_t){.dtype = DTYPE_FLOAT32};
  unsigned role = u8(r) % 4;
  st->comm_id = 1 + u8(r);
  st->to_stream = u8(r) % 2;
  if (role <= 1) { /* a local copy, the one kind that runs without a data plane */
    st->input = spec_of(in, &m);
    st->result = spec_of(out, &m);
    mo->live[out] = mo->live[in];
    mo->m[out] = m;
  } else if (role == 2) {
    st->input = spec_of(in, &m);
    st->to_rank = 1;
    st->peer_address = "127.0.0.1:9";
  } else {
    st->result = spec_of(out, &m);
    st->from_rank = 1;
    st->peer_address = "127.0.0.1:9";
  }
  spoil(r, st->input);
  spoil(r, st->result);
  ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SEND;
  ins->send = st;
}

static void build_borrow(rd_t *r, instr_t *ins, model_t *mo) {
  Meshd__Agent__V1__BorrowOp *b = A(sizeof *b);
  meshd__agent__v1__borrow_op__init(b);
  b->phase = (Meshd__Agent__V1__BorrowOp__Phase)(u8(r) % 5);
  b->borrow = 1 + u8(r) % 3;
  b->tensor = pick_live(r, mo);
  b->result = pick_free(r, mo);
  b->from_stream = u8(r) % 2;
  b->to_stream = u8(r) % 2;
  /* The stream each phase runs on, as the server sends it (mostly). */
  bool origin = b->phase == MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE ||
                b->phase == MESHD__AGENT__V1__BORROW_OP__PHASE__DROP;
  ins->stream = u8(r) >= 240 ? u8(r) % 3 : origin ? b->from_stream : b->to_stream;
  if (b->phase == MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE && mo->live[b->tensor]) {
    mo->live[b->result] = true;
    mo->m[b->result] = mo->m[b->tensor];
  }
  ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW;
  ins->borrow = b;
}

static void build_other(rd_t *r, instr_t *ins, model_t *mo) {
  switch (u8(r) % 7) {
    case 0: {
      Meshd__Agent__V1__DeleteRefs *d = A(sizeof *d);
      meshd__agent__v1__delete_refs__init(d);
      d->n_refs = 1 + u8(r) % 3;
      d->refs = A(sizeof(uint64_t) * 3);
      for (size_t i = 0; i < d->n_refs; i++) {
        d->refs[i] = pick_live(r, mo);
        mo->live[d->refs[i]] = false;
      }
      ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS;
      ins->delete_refs = d;
      break;
    }
    case 1: {
      Meshd__Agent__V1__StatusRequest *s = A(sizeof *s);
      meshd__agent__v1__status_request__init(s);
      ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS;
      ins->status = s;
      break;
    }
    case 2: {
      Meshd__Agent__V1__CreateStream *s = A(sizeof *s);
      meshd__agent__v1__create_stream__init(s);
      s->name = "side";
      ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CREATE_STREAM;
      ins->create_stream = s;
      break;
    }
    case 3: {
      Meshd__Agent__V1__PeerLost *p = A(sizeof *p);
      meshd__agent__v1__peer_lost__init(p);
      p->rank = u8(r) % 3;
      p->data_address = "127.0.0.1:9";
      p->reason = "lost in the fuzzer";
      ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_PEER_LOST;
      ins->peer_lost = p;
      break;
    }
    case 4: { /* what a Fetch pins: later in-place writes copy it aside */
      Meshd__Agent__V1__Snapshot *s = A(sizeof *s);
      meshd__agent__v1__snapshot__init(s);
      s->ref = pick_live(r, mo);
      ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT;
      ins->snapshot = s;
      break;
    }
    case 5: {
      Meshd__Agent__V1__DropSnapshot *d = A(sizeof *d);
      meshd__agent__v1__drop_snapshot__init(d);
      d->seq = last_seq + u8(r) % 16; /* often a Snapshot of this batch */
      ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DROP_SNAPSHOT;
      ins->drop_snapshot = d;
      break;
    }
    default: {
      Meshd__Agent__V1__EndSession *s = A(sizeof *s);
      meshd__agent__v1__end_session__init(s);
      ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION;
      ins->end_session = s;
      memset(mo, 0, sizeof *mo);
      break;
    }
  }
}

/* A packed batch built from the bytes (malloc'd; *len its size). */
static uint8_t *build(const uint8_t *data, size_t size, size_t *len) {
  rd_t r = {data, size};
  arena_used = 0;
  memset(models, 0, sizeof models);
  Meshd__Agent__V1__InstructionBatch b = MESHD__AGENT__V1__INSTRUCTION_BATCH__INIT;
  b.instructions = A(sizeof *b.instructions * MAX_INSTRUCTIONS);
  while (r.n && b.n_instructions < MAX_INSTRUCTIONS) {
    instr_t *ins = A(sizeof *ins);
    meshd__agent__v1__instruction__init(ins);
    unsigned s = u8(&r) % 2;
    ins->session_id = (char *)SESSIONS[s];
    ins->stream = u8(&r) % 2;
    model_t *mo = &models[s];
    switch (u8(&r) % 7) {
      case 0: build_factory(&r, ins, mo); break;
      case 1: case 2: build_call(&r, ins, mo); break;
      case 3: build_reduce(&r, ins, mo); break;
      case 4: build_send(&r, ins, mo); break;
      case 5: build_borrow(&r, ins, mo); break;
      default: build_other(&r, ins, mo); break;
    }
    b.instructions[b.n_instructions++] = ins;
  }
  *len = protobuf_c_message_get_packed_size(&b.base);
  uint8_t *buf = malloc(*len ? *len : 1);
  if (buf) protobuf_c_message_pack(&b.base, buf);
  return buf;
}

/* ================================================================ run */

static void end_session(executor_t *x, const char *session, uint64_t seq) {
  Meshd__Agent__V1__EndSession es = MESHD__AGENT__V1__END_SESSION__INIT;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.seq = seq;
  ins.session_id = (char *)session;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION;
  ins.end_session = &es;
  executor_submit(x, &ins);
}

/* A LoadOp runs with a policy that reaches nothing (file:// under a directory
 * that does not exist): its checks and its failure path run, never the
 * network. */
static char *no_scheme[] = {"file"}, *no_root[] = {"/nonexistent-meshd-fuzz"};
static Meshd__Agent__V1__UrlPolicy no_urls = {
    PROTOBUF_C_MESSAGE_INIT(&meshd__agent__v1__url_policy__descriptor), .n_schemes = 1,
    .schemes = no_scheme, .n_file_roots = 1, .file_roots = no_root, .max_retries = 0};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  Meshd__Agent__V1__InstructionBatch *b;
  if (data[0] & 1) {
    size_t len = 0;
    uint8_t *buf = build(data + 1, size - 1, &len);
    if (!buf) return 0;
    b = meshd__agent__v1__instruction_batch__unpack(NULL, len, buf);
    free(buf);
  } else {
    b = meshd__agent__v1__instruction_batch__unpack(NULL, size - 1, data + 1);
  }
  if (!b) return 0;
  char sessions[MAX_SESSIONS][VALIDATE_SESSION_ID_MAX + 1];
  size_t nsessions = 0, n = 0;
  char why[300] = "";
  for (size_t i = 0; i < b->n_instructions && i < MAX_INSTRUCTIONS; i++) {
    instr_t *ins = b->instructions[i];
    ins->seq = last_seq + 1;
    if (validate_envelope(ins, why, sizeof why)) break; /* execute.c ends the stream here */
    size_t k = 0;
    while (k < nsessions && strcmp(sessions[k], ins->session_id)) k++;
    if (k == nsessions) {
      if (nsessions == MAX_SESSIONS) continue;
      snprintf(sessions[nsessions++], sizeof sessions[0], "%s", ins->session_id);
    }
    last_seq++;
    n++;
    bool load = ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_LOAD && ins->load;
    Meshd__Agent__V1__UrlPolicy *policy = load ? ins->load->policy : NULL;
    if (load) ins->load->policy = &no_urls;
    executor_submit(X, ins); /* queues a copy */
    if (load) ins->load->policy = policy; /* the batch frees its own */
  }
  if (verbose)
    fprintf(stderr, "%zu instruction(s) of %zu session(s)%s%s\n", n, nsessions,
            n < b->n_instructions ? ": " : "", n < b->n_instructions ? why : "");
  /* Everything runs before the sessions end (EndSession drops what is still
   * queued), then the ends free what it made. */
  if (executor_wait(X, last_seq, WAIT_MS) != 0) {
    fprintf(stderr, "fuzz: the batch did not finish within %d ms\n", WAIT_MS);
    abort();
  }
  for (size_t k = 0; k < nsessions; k++) end_session(X, sessions[k], ++last_seq);
  if (executor_wait(X, last_seq, WAIT_MS) != 0) {
    fprintf(stderr, "fuzz: the sessions did not end within %d ms\n", WAIT_MS);
    abort();
  }
  if (verbose) { /* let the reporter tell the last failures */
    executor_kick(X);
    nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
  }
  size_t open = executor_sessions(X);
  uint64_t left = atomic_load(&B.allocated);
  if (open || left) {
    fprintf(stderr, "fuzz: %zu session(s) open and %llu bytes allocated after every session "
            "ended\n", open, (unsigned long long)left);
    abort();
  }
  meshd__agent__v1__instruction_batch__free_unpacked(b, NULL);
  return 0;
}
