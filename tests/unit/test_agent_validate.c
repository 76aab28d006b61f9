/* An agent validates every instruction, Read and Write (agent/validate.c,
 * run.c, data.c): each rejection class by validate_instruction alone; then
 * what a refused or mismatched instruction does on a cpu executor (its
 * results fail with the reason, the agent keeps computing); then the Agent
 * service over rpc: a planted shape read back, Writes and Reads that are
 * refused, and cancelled Reads that give their threads back at once. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"
#include "agent_link.h"
#include "backend.h"
#include "executor.h"
#include "proc_threads.h"
#include "rpc.h"
#include "session_state.h"
#include "validate.h"

typedef Meshd__Agent__V1__Instruction instr_t;
typedef Meshd__Agent__V1__TensorSpec spec_t;

#define F32 MESHD__V1__DTYPE__DTYPE_FLOAT32
static const int64_t BIG = (int64_t)1 << 31;

/* ================================================================ builders */

static spec_t mkspec(uint64_t ref, const int64_t *shape, size_t n, int dtype) {
  spec_t sp = MESHD__AGENT__V1__TENSOR_SPEC__INIT;
  sp.ref = ref;
  sp.shape = (int64_t *)shape;
  sp.n_shape = n;
  sp.dtype = (Meshd__V1__DType)dtype;
  return sp;
}

static int64_t four[1] = {4};
static uint32_t rank0[1] = {0};
static char *addr0[1] = {"127.0.0.1:1"};

/* One instruction of every kind, valid, for the tests to spoil. */
typedef struct kit {
  instr_t ins;
  Meshd__V1__Factory f;
  Meshd__Agent__V1__FactoryOp fo;
  Meshd__V1__Reduce r;
  Meshd__Agent__V1__ReduceOp ro;
  Meshd__Agent__V1__Group g;
  Meshd__V1__Arg a, b;
  Meshd__V1__Arg *args[2];
  Meshd__Agent__V1__OpCall call;
  Meshd__Agent__V1__SendTensor send;
  Meshd__Agent__V1__BorrowOp borrow;
  Meshd__V1__Load l;
  Meshd__Agent__V1__LoadOp lo;
  Meshd__Agent__V1__LiteralOp lit;
  spec_t in, res;
  spec_t *results[1];
} kit_t;

static void kit_init(kit_t *k, uint64_t seq, const char *session) {
  memset(k, 0, sizeof *k);
  meshd__agent__v1__instruction__init(&k->ins);
  k->ins.seq = seq;
  k->ins.session_id = (char *)session;
  k->ins.stream = 1;
}

static instr_t *factory(kit_t *k, uint64_t ref, const char *kind, int64_t *shape, size_t n) {
  meshd__v1__factory__init(&k->f);
  k->f.ref = ref;
  k->f.kind = (char *)kind;
  k->f.shape = shape;
  k->f.n_shape = n;
  k->f.dtype = F32;
  k->res = mkspec(ref, shape, n, F32);
  meshd__agent__v1__factory_op__init(&k->fo);
  k->fo.factory = &k->f;
  k->fo.result = &k->res;
  k->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY;
  k->ins.factory = &k->fo;
  return &k->ins;
}

/* A one-member reduce of `in` (shape ishape) into `out` (shape oshape). */
static instr_t *reduce(kit_t *k, const char *red, uint64_t in, const int64_t *ishape, size_t ni,
                       uint64_t out, const int64_t *oshape, size_t no) {
  meshd__v1__reduce__init(&k->r);
  k->r.reduction = (char *)red;
  k->r.input = in;
  k->r.ref = out;
  k->in = mkspec(in, ishape, ni, F32);
  k->res = mkspec(out, oshape, no, F32);
  meshd__agent__v1__group__init(&k->g);
  k->g.ranks = rank0;
  k->g.n_ranks = 1;
  k->g.addresses = addr0;
  k->g.n_addresses = 1;
  k->g.comm_id = 7;
  meshd__agent__v1__reduce_op__init(&k->ro);
  k->ro.reduce = &k->r;
  k->ro.input = &k->in;
  k->ro.result = &k->res;
  k->ro.group = &k->g;
  k->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE;
  k->ins.reduce = &k->ro;
  return &k->ins;
}

/* add(x, y) -> out, its result spec of shape [n]. */
static instr_t *add(kit_t *k, uint64_t x, uint64_t y, uint64_t out, int64_t *shape) {
  meshd__v1__arg__init(&k->a);
  k->a.value_case = MESHD__V1__ARG__VALUE_REF;
  k->a.ref = x;
  meshd__v1__arg__init(&k->b);
  k->b.value_case = MESHD__V1__ARG__VALUE_REF;
  k->b.ref = y;
  k->args[0] = &k->a;
  k->args[1] = &k->b;
  k->res = mkspec(out, shape, 1, F32);
  k->results[0] = &k->res;
  meshd__agent__v1__op_call__init(&k->call);
  k->call.op = "add";
  k->call.args = k->args;
  k->call.n_args = 2;
  k->call.results = k->results;
  k->call.n_results = 1;
  k->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CALL;
  k->ins.call = &k->call;
  return &k->ins;
}

/* A local copy (ToMesh within one rank) of in -> out. */
static instr_t *copy(kit_t *k, uint64_t in, const int64_t *ishape, uint64_t out,
                     const int64_t *oshape) {
  k->in = mkspec(in, ishape, 1, F32);
  k->res = mkspec(out, oshape, 1, F32);
  meshd__agent__v1__send_tensor__init(&k->send);
  k->send.input = &k->in;
  k->send.result = &k->res;
  k->send.to_stream = 1;
  k->send.comm_id = 9;
  k->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SEND;
  k->ins.send = &k->send;
  return &k->ins;
}

static instr_t *borrow(kit_t *k, Meshd__Agent__V1__BorrowOp__Phase phase, uint64_t stream) {
  meshd__agent__v1__borrow_op__init(&k->borrow);
  k->borrow.phase = phase;
  k->borrow.borrow = 5;
  k->borrow.tensor = 10;
  k->borrow.result = 11;
  k->borrow.from_stream = 1;
  k->borrow.to_stream = 2;
  k->ins.stream = stream;
  k->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW;
  k->ins.borrow = &k->borrow;
  return &k->ins;
}

static const validate_self_t SELF = {.rank = 0, .data_address = NULL};

/* The instruction is refused with a message holding both needles. */
static void refused(const instr_t *ins, const char *n1, const char *n2) {
  meshd_error_t e = {0};
  cr_assert_eq(validate_instruction(ins, &SELF, &e), -1, "accepted; expected '%s'", n1);
  cr_assert(strstr(e.msg, n1), "'%s' lacks '%s'", e.msg, n1);
  if (n2) cr_assert(strstr(e.msg, n2), "'%s' lacks '%s'", e.msg, n2);
}

static void accepted(const instr_t *ins) {
  meshd_error_t e = {0};
  cr_assert_eq(validate_instruction(ins, &SELF, &e), 0, "%s", e.msg);
}

/* ================================================================ static rules */

Test(validate, realistic_instructions_pass) {
  kit_t k;
  kit_init(&k, 1, "s");
  accepted(factory(&k, 10, "ones", four, 1));
  kit_init(&k, 2, "s");
  accepted(add(&k, 10, 10, 11, four));
  kit_init(&k, 3, "s");
  accepted(reduce(&k, "sum", 10, four, 1, 12, four, 1));
  kit_init(&k, 4, "s");
  accepted(copy(&k, 10, four, 13, four));
  kit_init(&k, 5, "s");
  accepted(borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE, 1));
  accepted(borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__LAST_USE, 2));
  accepted(borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__DROP, 1));
}

Test(validate, shapes_follow_core_tensor_rules) {
  kit_t k;
  int64_t huge[3] = {BIG, BIG, BIG}, neg[1] = {-1}, many[17];
  for (int i = 0; i < 17; i++) many[i] = 1;
  kit_init(&k, 1, "s");
  refused(reduce(&k, "sum", 10, huge, 3, 11, huge, 3), "ReduceOp.input.shape",
          "exceeds 2^62 bytes");
  refused(reduce(&k, "sum", 10, neg, 1, 11, neg, 1), "ReduceOp.input.shape",
          "negative size -1 at dim 0");
  refused(reduce(&k, "sum", 10, many, 17, 11, many, 17), "ReduceOp.input.shape",
          "17 dims is too many");
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.in.dtype = 99;
  refused(&k.ins, "ReduceOp.input.dtype", "unknown dtype 99");
}

Test(validate, strides_and_offsets_stay_in_bounds) {
  kit_t k;
  kit_init(&k, 1, "s");
  int64_t strides[2] = {1, 1};
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.in.strides = strides;
  k.in.n_strides = 2;
  refused(&k.ins, "ReduceOp.input.strides", "2 strides for 1 dims");
  int64_t negs[1] = {-1};
  k.in.strides = negs;
  k.in.n_strides = 1;
  refused(&k.ins, "ReduceOp.input.strides[0]", "-1 is negative");
  k.in.n_strides = 0;
  k.in.storage_offset = -3;
  refused(&k.ins, "storage_offset", "-3");
  int64_t far[1] = {(int64_t)1 << 61};
  k.in.storage_offset = 0;
  k.in.strides = far;
  k.in.n_strides = 1;
  refused(&k.ins, "ReduceOp.input", "past 2^62 bytes");
}

Test(validate, op_calls) {
  kit_t k;
  kit_init(&k, 1, "s");
  add(&k, 10, 10, 11, four);
  k.call.op = "no_such_op";
  refused(&k.ins, "OpCall.op", "unknown op 'no_such_op'");
  add(&k, 10, 0, 11, four);
  refused(&k.ins, "args[1].ref is 0", NULL);
  add(&k, 10, 10, 0, four);
  refused(&k.ins, "OpCall.results[0].ref is 0", NULL);
  add(&k, 10, 10, 11, four);
  k.call.n_args = 17;
  refused(&k.ins, "17 arguments", NULL);
  add(&k, 10, 10, 11, four);
  Meshd__V1__Kwarg kw = MESHD__V1__KWARG__INIT, *kws[1] = {&kw};
  kw.name = "alpha";
  k.call.kwargs = kws;
  k.call.n_kwargs = 1;
  refused(&k.ins, "kwargs[0] ('alpha') has no value", NULL);
  add(&k, 10, 10, 11, four);
  uint64_t mut[1] = {7};
  k.call.mutates = mut;
  k.call.n_mutates = 1;
  refused(&k.ins, "mutates[0] is parameter 7", NULL);
  /* Two views of one storage with two dtypes. */
  add(&k, 10, 10, 11, four);
  spec_t i0 = mkspec(10, four, 1, F32), i1 = mkspec(12, four, 1, MESHD__V1__DTYPE__DTYPE_INT64);
  i0.storage = i1.storage = 3;
  spec_t *ins[2] = {&i0, &i1};
  k.call.inputs = ins;
  k.call.n_inputs = 2;
  refused(&k.ins, "storage 3 is int64 here but float32", "OpCall.inputs[0]");
}

Test(validate, factories) {
  kit_t k;
  kit_init(&k, 1, "s");
  factory(&k, 10, "add", four, 1);
  refused(&k.ins, "unknown kind 'add'", NULL);
  int64_t neg[1] = {-2};
  factory(&k, 10, "zeros", neg, 1);
  refused(&k.ins, "Factory zeros", "-2");
  factory(&k, 10, "ones", four, 1);
  int64_t three[1] = {3};
  k.res.shape = three;
  refused(&k.ins, "FactoryOp.result is float32 [3]", "ones gives float32 [4]");
  factory(&k, 10, "ones", four, 1);
  k.f.dtype = 77;
  refused(&k.ins, "unknown dtype 77", NULL);
  factory(&k, 10, "ones", four, 1);
  k.fo.factory = NULL;
  refused(&k.ins, "FactoryOp.factory is missing", NULL);
}

/* A LoadOp of float32 [8, 2] split along dim 0 in `parts`; the result is
 * this rank's part. */
static int64_t eight_two[2] = {8, 2};
static instr_t *load(kit_t *k, int64_t parts, int64_t coordinate, const int64_t *local) {
  meshd__v1__load__init(&k->l);
  k->l.ref = 10;
  k->l.url = "http://127.0.0.1:9/w.bin";
  k->l.dtype = F32;
  k->l.shape = eight_two;
  k->l.n_shape = 2;
  k->l.shard = parts > 1 ? "gpu" : "";
  k->res = mkspec(10, local, 2, F32);
  meshd__agent__v1__load_op__init(&k->lo);
  k->lo.load = &k->l;
  k->lo.result = &k->res;
  k->lo.parts = parts;
  k->lo.coordinate = coordinate;
  k->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_LOAD;
  k->ins.load = &k->lo;
  return &k->ins;
}

Test(validate, loads) {
  kit_t k;
  kit_init(&k, 1, "s");
  int64_t two_two[2] = {2, 2}, four_two[2] = {4, 2};
  accepted(load(&k, 4, 3, two_two));
  accepted(load(&k, 1, 0, eight_two));
  refused(load(&k, 4, 3, four_two), "LoadOp.result is float32 [4, 2]", "the load gives float32 [2, 2]");
  refused(load(&k, 4, 4, two_two), "coordinate 4 of 4 parts", NULL);
  refused(load(&k, 0, 0, two_two), "coordinate 0 of 0 parts", NULL);
  refused(load(&k, 3, 0, two_two), "dim 0 does not split in 3 parts", NULL);
  load(&k, 4, 0, two_two);
  k.l.url = "";
  refused(&k.ins, "LoadOp.load.url", "1..8192");
  load(&k, 4, 0, two_two);
  k.l.dtype = 0;
  refused(&k.ins, "LoadOp.load.dtype", NULL);
  load(&k, 4, 0, two_two);
  k.l.offset = UINT64_MAX - 8;
  refused(&k.ins, "pass the file's end", NULL);
  load(&k, 4, 0, two_two);
  k.l.file_size = 60; /* the tensor's 64 bytes do not fit */
  refused(&k.ins, "pass the file's end", NULL);
  load(&k, 4, 0, two_two);
  k.res.ref = 11;
  refused(&k.ins, "LoadOp.result.ref 11 differs", NULL);
  load(&k, 4, 0, two_two);
  k.lo.load = NULL;
  refused(&k.ins, "LoadOp.load is missing", NULL);
  /* What a refused LoadOp fails: its result. */
  load(&k, 4, 0, two_two);
  uint64_t refs[4];
  cr_assert_eq(validate_result_refs(&k.ins, refs, 4), 1);
  cr_assert_eq(refs[0], 10);
}

/* A LiteralOp of float32 [4] holding `bytes` bytes (16 fill it). */
static const float LIT_VALUES[4] = {0.5f, 0.5f, 0.5f, 0.5f};
static instr_t *literal(kit_t *k, uint64_t ref, size_t bytes) {
  meshd__agent__v1__literal_op__init(&k->lit);
  k->res = mkspec(ref, four, 1, MESHD__V1__DTYPE__DTYPE_FLOAT32);
  k->lit.result = &k->res;
  k->lit.data = (ProtobufCBinaryData){bytes, (uint8_t *)LIT_VALUES};
  k->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL;
  k->ins.literal = &k->lit;
  return &k->ins;
}

Test(validate, literals) {
  kit_t k;
  kit_init(&k, 1, "s");
  accepted(literal(&k, 10, 16));
  refused(literal(&k, 10, 15), "invalid LiteralOp (seq 1)", "15 bytes where its result needs 16");
  refused(literal(&k, 10, 0), "LiteralOp.data", "0 bytes");
  refused(literal(&k, 0, 16), "LiteralOp names no result ref", NULL);
  literal(&k, 10, 16);
  int64_t two[1] = {2};
  k.res.strides = two;
  k.res.n_strides = 1;
  refused(&k.ins, "LiteralOp.result", "row-major");
  literal(&k, 10, 16);
  k.res.storage_offset = 1;
  refused(&k.ins, "LiteralOp.result", "row-major");
  literal(&k, 10, 16);
  k.res.dtype = 999;
  refused(&k.ins, "LiteralOp.result.dtype", "999");
  literal(&k, 10, 16);
  k.lit.result = NULL;
  refused(&k.ins, "LiteralOp names no result ref", NULL);
  /* What a refused LiteralOp fails: its result. */
  literal(&k, 10, 15);
  uint64_t refs[4];
  cr_assert_eq(validate_result_refs(&k.ins, refs, 4), 1);
  cr_assert_eq(refs[0], 10);
}

Test(validate, groups) {
  kit_t k;
  kit_init(&k, 1, "s");
  uint32_t two[2] = {0, 0}, big[1] = {1u << 30}, other[1] = {3};
  char *addrs[2] = {"a:1", "b:2"};
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.g.n_ranks = 0;
  refused(&k.ins, "ReduceOp.group has 0 ranks", NULL);
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.g.n_addresses = 0;
  refused(&k.ins, "1 ranks but 0 addresses", NULL);
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.g.comm_id = 0;
  refused(&k.ins, "comm_id is 0", NULL);
  uint8_t pairs[33] = {0};
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.g.pair_secrets = (ProtobufCBinaryData){33, pairs};
  refused(&k.ins, "pair_secrets has 33 bytes where its 1 members need 32 (32 each) or none", NULL);
  k.g.pair_secrets = (ProtobufCBinaryData){32, pairs};
  accepted(&k.ins);
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.g.ranks = big;
  refused(&k.ins, "rank 1073741824 is not below", NULL);
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.g.ranks = two;
  k.g.n_ranks = 2;
  k.g.addresses = addrs;
  k.g.n_addresses = 2;
  refused(&k.ins, "rank 0 is listed twice", NULL);
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.g.ranks = other;
  refused(&k.ins, "does not hold this agent's rank 0", NULL);
  /* Onto a sub-mesh: the root is a member of the group, and nothing is scattered. */
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.ro.rooted = true;
  accepted(&k.ins);
  k.ro.root = 1;
  refused(&k.ins, "ReduceOp.root 1 is not an index of its group of 1", NULL);
  k.ro.root = 0;
  k.r.scatter = true;
  refused(&k.ins, "onto a sub-mesh (rooted), but scatter is set", NULL);
  /* The [2^31]^3 reduce of the report: refused before anything is stored. */
  int64_t huge[3] = {BIG, BIG, BIG};
  refused(reduce(&k, "sum", 10, huge, 3, 11, huge, 3), "exceeds 2^62 bytes", NULL);
}

Test(validate, reduce_rules) {
  kit_t k;
  kit_init(&k, 1, "s");
  refused(reduce(&k, "median", 10, four, 1, 11, four, 1), "unknown reduction 'median'", NULL);
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.r.inplace = true;
  refused(&k.ins, "in place, but the result is ref 11 and the input ref 10", NULL);
  k.r.out = 12;
  refused(&k.ins, "inplace and out 12 both given", NULL);
  int64_t three[1] = {3};
  refused(reduce(&k, "sum", 10, four, 1, 11, three, 1),
          "result is float32 [3] but its input and group of 1 give float32 [4]", NULL);
}

/* Over this agent's own --max-tensor-* only (QUOTA): a peer with other limits
 * runs it, so the executor tells the peers; anything else wrong with it
 * (BAD_ARGUMENT) every member refuses alike. */
Test(validate, only_this_agents_limits_refuse_with_quota) {
  kit_t k;
  kit_init(&k, 1, "s");
  meshd_error_t e = {0};
  layout_set_limits(&(layout_limits_t){LAYOUT_MAX_DIMS, 3});
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  cr_assert_eq(validate_instruction(&k.ins, &SELF, &e), -1);
  cr_expect_eq(e.kind, ERR_QUOTA, "%s", e.msg);
  cr_expect(strstr(e.msg, "--max-tensor-elements"), "%s", e.msg);
  int64_t three[1] = {3}; /* and a wrong result: refused alike everywhere */
  reduce(&k, "sum", 10, four, 1, 11, three, 1);
  cr_assert_eq(validate_instruction(&k.ins, &SELF, &e), -1);
  cr_expect_eq(e.kind, ERR_BAD_ARGUMENT, "%s", e.msg);
  uint32_t other[1] = {3}; /* not this agent's group */
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  k.g.ranks = other;
  cr_assert_eq(validate_instruction(&k.ins, &SELF, &e), -1);
  cr_expect_eq(e.kind, ERR_BAD_ARGUMENT, "%s", e.msg);
  layout_set_limits(NULL);
  reduce(&k, "sum", 10, four, 1, 11, four, 1);
  cr_expect_eq(validate_instruction(&k.ins, &SELF, &e), 0, "%s", e.msg);
}

Test(validate, sends) {
  kit_t k;
  kit_init(&k, 1, "s");
  int64_t three[1] = {3};
  refused(copy(&k, 10, four, 11, three), "SendTensor.result is float32 [3]",
          "its input gives float32 [4]");
  copy(&k, 10, four, 11, four);
  k.send.to_rank = 1;
  refused(&k.ins, "a local copy (input and result) from rank 0 to rank 1", NULL);
  copy(&k, 10, four, 11, four);
  k.send.result = NULL;
  k.send.to_rank = 1;
  refused(&k.ins, "SendTensor.peer_address: 0 characters", NULL);
  k.send.peer_address = "127.0.0.1:2";
  accepted(&k.ins);
  k.send.from_rank = 2;
  refused(&k.ins, "a send from rank 2 to rank 1 on rank 0", NULL);
  copy(&k, 10, four, 11, four);
  k.send.input = NULL;
  k.send.from_rank = 1;
  k.send.peer_address = "127.0.0.1:2";
  k.send.comm_id = 0;
  refused(&k.ins, "SendTensor.comm_id is 0", NULL);
  k.send.result = NULL;
  refused(&k.ins, "neither input", NULL);
}

Test(validate, borrows_and_the_rest) {
  kit_t k;
  kit_init(&k, 1, "s");
  borrow(&k, 9, 1);
  refused(&k.ins, "BorrowOp.phase: unknown phase 9", NULL);
  borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE, 2);
  refused(&k.ins, "BorrowOp CREATE runs on stream 2, not on the borrow's origin stream 1", NULL);
  borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE, 1);
  k.borrow.result = 10;
  refused(&k.ins, "must be two refs", NULL);
  borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__DROP, 1);
  k.borrow.borrow = 0;
  refused(&k.ins, "BorrowOp DROP: borrow is 0", NULL);

  Meshd__Agent__V1__PeerLost pl = MESHD__AGENT__V1__PEER_LOST__INIT;
  pl.rank = 1u << 21;
  k.ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_PEER_LOST;
  k.ins.peer_lost = &pl;
  refused(&k.ins, "PeerLost.rank: 2097152", NULL);
  char name[100];
  memset(name, 'n', sizeof name - 1);
  name[sizeof name - 1] = 0;
  Meshd__Agent__V1__CreateStream cs = MESHD__AGENT__V1__CREATE_STREAM__INIT;
  cs.name = name;
  k.ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CREATE_STREAM;
  k.ins.create_stream = &cs;
  refused(&k.ins, "CreateStream.name: 99 characters", NULL);
}

Test(validate, envelopes) {
  kit_t k;
  char why[300];
  char long_id[80];
  memset(long_id, 'a', sizeof long_id - 1);
  long_id[sizeof long_id - 1] = 0;
  kit_init(&k, 3, long_id);
  factory(&k, 10, "ones", four, 1);
  cr_assert_eq(validate_envelope(&k.ins, why, sizeof why), -1);
  cr_assert(strstr(why, "seq 3: session_id has 79 characters, more than 63"), "%s", why);
  kit_init(&k, 4, "bad\x01id");
  factory(&k, 10, "ones", four, 1);
  cr_assert_eq(validate_envelope(&k.ins, why, sizeof why), -1);
  cr_assert(strstr(why, "byte 0x01 at 3"), "%s", why);
  kit_init(&k, 5, "ok");
  cr_assert_eq(validate_envelope(&k.ins, why, sizeof why), -1);
  cr_assert(strstr(why, "has no body"), "%s", why);
}

/* ================================================================ on an executor */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char errors[32][700];
static uint64_t error_seqs[32];
static int error_kinds[32];
static int nerrors;

static void on_report(const executor_report_t *r, void *arg) {
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < r->n_errors && nerrors < 32; i++) {
    snprintf(errors[nerrors], sizeof errors[0], "%s", r->errors[i]->message);
    error_kinds[nerrors] = r->errors[i]->kind;
    error_seqs[nerrors++] = r->errors[i]->seq;
  }
  pthread_mutex_unlock(&mu);
}

static backend_t B;
static _Atomic int64_t my_rank;
static run_env_t env;
static executor_t *X;

static void open_executor(void) {
  memset(&B, 0, sizeof B);
  B.ops = backend_for_device("cpu");
  B.capacity = 1 << 26;
  meshd_error_t e = {0};
  cr_assert_eq(B.ops->open(&B, "cpu", &e), 0, "%s", e.msg);
  atomic_store(&my_rank, 0);
  env = (run_env_t){.backend = &B, .rank = &my_rank};
  X = executor_create(&env, on_report, NULL);
  cr_assert_not_null(X);
  nerrors = 0;
}

static void close_executor(void) {
  executor_close(X);
  cr_assert_eq(executor_wait_all_freed(5000), 0);
  cr_assert_eq(atomic_load(&B.allocated), 0, "the agent's memory is freed");
  B.ops->close(&B);
}

TestSuite(refused, .init = open_executor, .fini = close_executor, .timeout = 30);

static void submit(instr_t *ins) { cr_assert_eq(executor_submit(X, ins), 0); }

/* The failure reported for seq once the executor ran through it (bounded). */
static const char *error_of(uint64_t seq, int *kind) {
  cr_assert_eq(executor_wait(X, seq, 10000), 0, "seq %llu not executed", (unsigned long long)seq);
  for (int tries = 0; tries < 1000; tries++) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nerrors; i++)
      if (error_seqs[i] == seq) {
        if (kind) *kind = error_kinds[i];
        pthread_mutex_unlock(&mu);
        return errors[i];
      }
    pthread_mutex_unlock(&mu);
    executor_kick(X);
    nanosleep(&(struct timespec){0, 2000000}, NULL);
  }
  return NULL;
}

static void assert_failed(uint64_t ref, const char *needle) {
  agent_tensor_t t;
  ref_failure_t why = {0};
  int rc = executor_lookup(X, "s", ref, &t, &why);
  if (rc == 0) storage_release(t.storage);
  cr_assert_eq(rc, 1, "ref %llu is failed", (unsigned long long)ref);
  cr_assert(strstr(why.msg, needle), "'%s' lacks '%s'", why.msg, needle);
}

static void assert_values(uint64_t ref, float want) {
  agent_tensor_t t;
  ref_failure_t why = {0};
  cr_assert_eq(executor_lookup(X, "s", ref, &t, &why), 0, "ref %llu: %s", (unsigned long long)ref,
               why.msg);
  float host[4] = {0};
  meshd_error_t e = {0};
  cr_assert_eq(B.ops->to_host(&B, NULL, &t, host, &e), 0, "%s", e.msg);
  storage_release(t.storage);
  for (int i = 0; i < 4; i++) cr_assert_eq(host[i], want, "ref %llu[%d]", (unsigned long long)ref, i);
}

Test(refused, a_planted_shape_fails_its_result_and_the_agent_computes_on) {
  kit_t k;
  int64_t huge[3] = {BIG, BIG, BIG};
  kit_init(&k, 1, "s");
  submit(factory(&k, 10, "ones", four, 1));
  kit_init(&k, 2, "s");
  submit(reduce(&k, "sum", 10, huge, 3, 11, huge, 3));
  kit_init(&k, 3, "s");
  submit(add(&k, 11, 10, 12, four)); /* reads the refused result */
  kit_init(&k, 4, "s");
  submit(add(&k, 10, 10, 13, four));
  int kind = 0;
  const char *m = error_of(2, &kind);
  cr_assert_not_null(m, "no failure reported for the planted reduce");
  cr_assert(strstr(m, "invalid ReduceOp (seq 2): ReduceOp.input.shape: shape [2147483648, "
                      "2147483648, 2147483648] with 4-byte elements exceeds 2^62 bytes"), "%s", m);
  cr_assert_eq(kind, ERR_REMOTE_FAILURE);
  assert_failed(11, "exceeds 2^62 bytes");
  m = error_of(3, &kind);
  cr_assert_not_null(m);
  cr_assert_eq(kind, ERR_DEPENDENT_FAILURE, "%s", m);
  assert_failed(12, "depends on tensor 11");
  cr_assert_eq(executor_wait(X, 4, 10000), 0);
  assert_values(13, 2.0f);
  assert_values(10, 1.0f);
}

Test(refused, a_literal_defines_its_bytes_and_a_short_one_fails_only_its_result) {
  kit_t k;
  kit_init(&k, 1, "s");
  submit(literal(&k, 10, 16));
  kit_init(&k, 2, "s");
  submit(literal(&k, 11, 12)); /* planted: 12 bytes for 16 */
  kit_init(&k, 3, "s");
  submit(add(&k, 10, 10, 12, four));
  const char *m = error_of(2, NULL);
  cr_assert_not_null(m, "no failure reported for the short literal");
  cr_assert(strstr(m, "invalid LiteralOp (seq 2): LiteralOp.data: 12 bytes where its result "
                      "needs 16"), "%s", m);
  assert_failed(11, "12 bytes");
  cr_assert_eq(executor_wait(X, 3, 10000), 0);
  assert_values(10, 0.5f);
  assert_values(12, 1.0f);
}

Test(refused, an_input_unlike_its_spec_fails_the_reduce) {
  kit_t k;
  int64_t eight[1] = {8};
  kit_init(&k, 1, "s");
  submit(factory(&k, 10, "ones", four, 1));
  kit_init(&k, 2, "s");
  submit(reduce(&k, "sum", 10, eight, 1, 11, eight, 1));
  const char *m = error_of(2, NULL);
  cr_assert_not_null(m);
  cr_assert(strstr(m, "Reduce: the instruction's input is float32 [8] but tensor 10 on this "
                      "agent is float32 [4]"), "%s", m);
  assert_failed(11, "float32 [8]");
  assert_values(10, 1.0f);
}

Test(refused, a_result_already_defined_is_left_alone) {
  kit_t k;
  kit_init(&k, 1, "s");
  submit(factory(&k, 10, "ones", four, 1));
  kit_init(&k, 2, "s");
  submit(factory(&k, 10, "zeros", four, 1));
  kit_init(&k, 3, "s");
  submit(add(&k, 10, 10, 10, four));
  const char *m = error_of(2, NULL);
  cr_assert_not_null(m);
  cr_assert(strstr(m, "result ref 10 is already defined on this agent"), "%s", m);
  cr_assert_not_null(error_of(3, NULL));
  assert_values(10, 1.0f);
}

Test(refused, call_results_must_be_what_the_rule_gives) {
  kit_t k;
  int64_t three[1] = {3};
  kit_init(&k, 1, "s");
  submit(factory(&k, 10, "ones", four, 1));
  kit_init(&k, 2, "s");
  submit(add(&k, 10, 10, 11, three));
  kit_init(&k, 3, "s");
  add(&k, 10, 10, 12, four);
  k.call.n_results = 0; /* add is not in place: its one result must be named */
  submit(&k.ins);
  const char *m = error_of(2, NULL);
  cr_assert_not_null(m);
  cr_assert(strstr(m, "add: results[0] is float32 [3] but what its inputs give is float32 [4]"),
            "%s", m);
  assert_failed(11, "float32 [3]");
  m = error_of(3, NULL);
  cr_assert_not_null(m);
  cr_assert(strstr(m, "add returns 1 tensor but the instruction names 0 results"), "%s", m);
}

Test(refused, a_local_copy_of_a_mismatched_input_fails) {
  kit_t k;
  int64_t eight[1] = {8};
  kit_init(&k, 1, "s");
  submit(factory(&k, 10, "ones", four, 1));
  kit_init(&k, 2, "s");
  submit(copy(&k, 10, eight, 11, eight));
  const char *m = error_of(2, NULL);
  cr_assert_not_null(m);
  cr_assert(strstr(m, "ToMesh: the instruction's input is float32 [8]"), "%s", m);
  assert_failed(11, "float32 [8]");
}

static void on_stream(kit_t *k, uint64_t seq, uint64_t stream) {
  k->ins.seq = seq;
  k->ins.stream = stream;
  submit(&k->ins);
}

/* Found by fuzz_agent_instructions: two streams each reading a ref that the
 * other defines later (a borrow handle) waited for each other for ever. An
 * instruction now never waits for one sent after it. */
Test(refused, a_read_never_waits_for_a_later_instruction) {
  /* Slow reduces first on both streams, so that everything is routed (and
   * its cross-stream defs recorded) before the readers run. */
  executor_close(X);
  static fault_t slow;
  char why[200];
  cr_assert_eq(fault_parse("reduce:slow=300", FAULT_AGENT_PLACES, &slow, why, sizeof why), 0, "%s", why);
  env.fault = &slow;
  X = executor_create(&env, on_report, NULL);
  kit_t k;
  kit_init(&k, 0, "s");
  factory(&k, 1, "ones", four, 1);
  on_stream(&k, 1, 0);
  factory(&k, 2, "ones", four, 1);
  on_stream(&k, 2, 1);
  reduce(&k, "sum", 1, four, 1, 40, four, 1);
  on_stream(&k, 3, 0);
  reduce(&k, "sum", 2, four, 1, 41, four, 1);
  on_stream(&k, 4, 1);
  add(&k, 10, 10, 30, four); /* stream 0 reads 10, defined on stream 1 at seq 7 */
  on_stream(&k, 5, 0);
  add(&k, 20, 20, 31, four); /* stream 1 reads 20, defined on stream 0 at seq 8 */
  on_stream(&k, 6, 1);
  borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE, 1);
  k.borrow.from_stream = 1;
  k.borrow.to_stream = 0;
  k.borrow.tensor = 2;
  k.borrow.result = 10;
  on_stream(&k, 7, 1);
  borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE, 0);
  k.borrow.from_stream = 0;
  k.borrow.to_stream = 1;
  k.borrow.borrow = 6;
  k.borrow.tensor = 1;
  k.borrow.result = 20;
  on_stream(&k, 8, 0);
  /* A drop ordered after a last use sent later (on the other stream). */
  borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__DROP, 0);
  k.borrow.from_stream = 0;
  k.borrow.to_stream = 1;
  k.borrow.borrow = 6;
  on_stream(&k, 9, 0);
  borrow(&k, MESHD__AGENT__V1__BORROW_OP__PHASE__LAST_USE, 1);
  k.borrow.from_stream = 0;
  k.borrow.to_stream = 1;
  k.borrow.borrow = 6;
  k.borrow.result = 20;
  on_stream(&k, 10, 1);
  cr_assert_eq(executor_wait(X, 10, 5000), 0, "two streams wait for each other");
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nerrors; i++)
    cr_assert_not(strstr(errors[i], "invalid BorrowOp"), "a borrow was refused: %s", errors[i]);
  pthread_mutex_unlock(&mu);
  env.fault = NULL;
}

Test(refused, status_opens_a_session_and_end_session_closes_it) {
  kit_t k;
  Meshd__Agent__V1__StatusRequest sr = MESHD__AGENT__V1__STATUS_REQUEST__INIT;
  Meshd__Agent__V1__EndSession es = MESHD__AGENT__V1__END_SESSION__INIT;
  cr_assert_not(executor_session_open(X, "s"));
  kit_init(&k, 1, "s");
  k.ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS;
  k.ins.status = &sr;
  submit(&k.ins);
  cr_assert(executor_session_open(X, "s"));
  agent_tensor_t t;
  meshd_error_t e = {0};
  tensor_meta_t m = {.dtype = DTYPE_FLOAT32, .layout = {.ndim = 1, .sizes = {4}}};
  cr_assert_eq(tensor_alloc(&B, NULL, &m, &t, "test", &e), 0);
  cr_assert_eq(executor_define(X, "s", 20, &t), 0);
  cr_assert_eq(executor_define(X, "invented", 20, &t), 1, "a session never opened takes nothing");
  storage_release(t.storage);
  kit_init(&k, 2, "s");
  k.ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION;
  k.ins.end_session = &es;
  submit(&k.ins);
  cr_assert_not(executor_session_open(X, "s"));
  cr_assert_eq(executor_wait(X, 2, 5000), 0);
}

/* ================================================================ over rpc */

static agent_info_t info = {.id = "0123456789abcdef0123456789abcdef", .device = "cpu"};
static rpc_server_t *srv;
static rpc_channel_t *ch;
static rpc_stream_t *exec_stream;
static uint64_t next_seq = 1;

static void serve(void) {
  open_executor(); /* only for its backend: the service makes its own executor */
  executor_close(X);
  cr_assert_eq(executor_wait_all_freed(5000), 0);
  info.env = env;
  rpc_init();
  /* Room for the 64 Reads that one test sends at once: past the default
   * bound of requests not yet read (16), a burst's oldest were cancelled
   * RESOURCE_EXHAUSTED before they could wait (about 1 run in 8). */
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 2,
                         .max_unauthenticated_requests = 128};
  char err[256];
  srv = rpc_server_create(&o, err, sizeof err);
  cr_assert_not_null(srv, "%s", err);
  size_t n;
  const rpc_method_t *m = agent_service_methods(&n);
  cr_assert_eq(rpc_server_add_methods(srv, m, n, &info), 0);
  int port = rpc_server_start(srv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", port);
  /* A live peer: a loaded machine may take over 100 ms to connect. */
  ch = rpc_channel_create(target, &(rpc_channel_opts_t){.connect_timeout_ms = 5000});
  /* Connected first: a call on a channel still connecting may fail fast
   * (UNAVAILABLE) on a slow (sanitized, loaded) machine. */
  cr_assert(rpc_channel_wait_ready(ch, 20000), "no connection to the agent");
  exec_stream = rpc_stream_open(ch, AGENT_LINK_METHOD, NULL, 0, 60000);
  cr_assert_not_null(exec_stream);
  next_seq = 1;
  /* Every batch is answered: once the first report is in, the agent has its
   * Execute call (Read and Write need one). */
  Meshd__Agent__V1__InstructionBatch b = MESHD__AGENT__V1__INSTRUCTION_BATCH__INIT;
  cr_assert_eq(rpc_stream_write(exec_stream, &b.base, false), 0);
  ProtobufCMessage *rep = NULL;
  cr_assert_eq(rpc_stream_read(exec_stream, &meshd__agent__v1__agent_report__descriptor, &rep,
                               10000), 1, "no first report");
  protobuf_c_message_free_unpacked(rep, NULL);
}

static void unserve(void) {
  rpc_stream_destroy(exec_stream);
  rpc_channel_destroy(ch);
  rpc_server_destroy(srv);
  rpc_shutdown();
  cr_assert_eq(executor_wait_all_freed(5000), 0);
  cr_assert_eq(atomic_load(&B.allocated), 0, "the agent's memory is freed");
  B.ops->close(&B);
}

TestSuite(service, .init = serve, .fini = unserve, .timeout = 60);

/* Sends ins as the next seq and waits until the agent executed it. */
static uint64_t execute(instr_t *ins) {
  ins->seq = next_seq++;
  Meshd__Agent__V1__InstructionBatch b = MESHD__AGENT__V1__INSTRUCTION_BATCH__INIT;
  b.instructions = &ins;
  b.n_instructions = 1;
  cr_assert_eq(rpc_stream_write(exec_stream, &b.base, false), 0);
  for (;;) {
    ProtobufCMessage *m = NULL;
    int rc = rpc_stream_read(exec_stream, &meshd__agent__v1__agent_report__descriptor, &m, 5000);
    cr_assert_eq(rc, 1, "no report within 5 s");
    uint64_t through = ((Meshd__Agent__V1__AgentReport *)m)->executed_through;
    protobuf_c_message_free_unpacked(m, NULL);
    if (through >= ins->seq) return ins->seq;
  }
}

static void open_session(const char *session) {
  kit_t k;
  Meshd__Agent__V1__StatusRequest sr = MESHD__AGENT__V1__STATUS_REQUEST__INIT;
  kit_init(&k, 0, session);
  k.ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS;
  k.ins.status = &sr;
  execute(&k.ins);
}

/* A Snapshot of ref (what the server sends before each Read): its seq, the
 * after_seq of the Read that streams it. */
static uint64_t snapshot(const char *session, uint64_t ref) {
  kit_t k;
  Meshd__Agent__V1__Snapshot sn = MESHD__AGENT__V1__SNAPSHOT__INIT;
  kit_init(&k, 0, session);
  sn.ref = ref;
  k.ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT;
  k.ins.snapshot = &sn;
  return execute(&k.ins);
}

/* Agent/Read of ref: its status; the data (as floats) into out when given. */
static grpc_status_code read_ref(const char *session, uint64_t ref, uint64_t after_seq,
                                 int timeout_ms, float *out, size_t n, rpc_status_t *st) {
  rpc_stream_t *s = rpc_stream_open(ch, "/meshd.agent.v1.Agent/Read", NULL, 0, timeout_ms);
  Meshd__Agent__V1__ReadRequest rq = MESHD__AGENT__V1__READ_REQUEST__INIT;
  rq.session_id = (char *)session;
  rq.ref = ref;
  rq.after_seq = after_seq;
  cr_assert_eq(rpc_stream_write(s, &rq.base, true), 0);
  ProtobufCMessage *m = NULL;
  size_t got = 0;
  while (rpc_stream_read(s, &meshd__agent__v1__data_chunk__descriptor, &m, 0) == 1) {
    const Meshd__Agent__V1__DataChunk *c = (const void *)m;
    if (c->part_case == MESHD__AGENT__V1__DATA_CHUNK__PART_DATA && out) {
      size_t k = c->data.len < n * sizeof(float) - got ? c->data.len : n * sizeof(float) - got;
      memcpy((char *)out + got, c->data.data, k);
      got += k;
    }
    protobuf_c_message_free_unpacked(m, NULL);
    m = NULL;
  }
  grpc_status_code code = rpc_stream_finish(s, st);
  rpc_stream_destroy(s);
  return code;
}

/* Agent/Write of `bytes` bytes under a spec of shape [n] float32. */
static grpc_status_code write_ref(const char *session, uint64_t ref, const int64_t *shape,
                                  size_t ndim, int dtype, size_t bytes, rpc_status_t *st) {
  rpc_stream_t *s = rpc_stream_open(ch, "/meshd.agent.v1.Agent/Write", NULL, 0, 10000);
  spec_t sp = mkspec(ref, shape, ndim, dtype);
  Meshd__Agent__V1__DataChunk c = MESHD__AGENT__V1__DATA_CHUNK__INIT;
  c.session_id = (char *)session;
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_SPEC;
  c.spec = &sp;
  uint8_t *data = calloc(1, bytes ? bytes : 1);
  if (rpc_stream_write(s, &c.base, false) == 0) {
    c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_DATA;
    c.spec = NULL;
    c.data.data = data;
    c.data.len = bytes;
    if (rpc_stream_write(s, &c.base, false) == 0) rpc_stream_close_send(s);
  }
  free(data);
  ProtobufCMessage *m = NULL;
  while (rpc_stream_read(s, &meshd__agent__v1__write_reply__descriptor, &m, 0) == 1) {
    protobuf_c_message_free_unpacked(m, NULL);
    m = NULL;
  }
  grpc_status_code code = rpc_stream_finish(s, st);
  rpc_stream_destroy(s);
  return code;
}

Test(service, reading_the_planted_tensor_is_a_clear_error) {
  kit_t k;
  int64_t huge[3] = {BIG, BIG, BIG};
  kit_init(&k, 0, "victim");
  execute(factory(&k, 10, "ones", four, 1));
  kit_init(&k, 0, "victim");
  execute(reduce(&k, "sum", 10, huge, 3, 11, huge, 3));
  rpc_status_t st;
  cr_assert_eq(read_ref("victim", 11, snapshot("victim", 11), 5000, NULL, 0, &st), GRPC_STATUS_ABORTED, "%d %s",
               st.code, st.message);
  cr_assert_str_eq(st.kind, "REMOTE_FAILURE");
  cr_assert(strstr(st.message, "ReduceOp.input.shape: shape [2147483648, 2147483648, "
                               "2147483648] with 4-byte elements exceeds 2^62 bytes"),
            "%s", st.message);
  float v[4] = {0};
  cr_assert_eq(read_ref("victim", 10, snapshot("victim", 10), 5000, v, 4, &st), GRPC_STATUS_OK, "%s", st.message);
  for (int i = 0; i < 4; i++) cr_assert_eq(v[i], 1.0f);
}

Test(service, writes_are_checked_and_store_nothing_when_refused) {
  open_session("w");
  rpc_status_t st;
  cr_assert_eq(write_ref("w", 1, four, 1, F32, 17, &st), GRPC_STATUS_INVALID_ARGUMENT);
  cr_assert(strstr(st.message, "got at least 17 bytes for tensor 1, which needs 16"), "%s",
            st.message);
  cr_assert_eq(write_ref("w", 2, four, 1, F32, 15, &st), GRPC_STATUS_INVALID_ARGUMENT);
  cr_assert(strstr(st.message, "got 15 bytes for tensor 2, which needs 16"), "%s", st.message);
  int64_t huge[3] = {BIG, BIG, BIG};
  cr_assert_eq(write_ref("w", 3, huge, 3, F32, 4, &st), GRPC_STATUS_INVALID_ARGUMENT);
  cr_assert(strstr(st.message, "Write.spec.shape"), "%s", st.message);
  cr_assert_eq(write_ref("w", 4, four, 1, 42, 16, &st), GRPC_STATUS_INVALID_ARGUMENT);
  cr_assert(strstr(st.message, "Write.spec.dtype: unknown dtype 42"), "%s", st.message);
  int64_t big[1] = {(int64_t)1 << 30};
  cr_assert_eq(write_ref("w", 5, big, 1, F32, 4, &st), GRPC_STATUS_RESOURCE_EXHAUSTED);
  cr_assert(strstr(st.message, "more than this agent's capacity"), "%s", st.message);
  for (uint64_t ref = 1; ref <= 5; ref++)
    cr_assert_eq(read_ref("w", ref, snapshot("w", ref), 5000, NULL, 0, &st), GRPC_STATUS_NOT_FOUND,
                 "ref %llu was stored", (unsigned long long)ref);
  cr_assert_eq(write_ref("w", 6, four, 1, F32, 16, &st), GRPC_STATUS_OK, "%s", st.message);
  float v[4] = {1, 1, 1, 1};
  cr_assert_eq(read_ref("w", 6, snapshot("w", 6), 5000, v, 4, &st), GRPC_STATUS_OK, "%s", st.message);
  cr_assert_eq(v[0], 0.0f);
  cr_assert_eq(atomic_load(&B.allocated), 16 + 0u, "only the good write holds memory");
}

static void drop_snapshot(const char *session, uint64_t seq) {
  kit_t k;
  Meshd__Agent__V1__DropSnapshot d = MESHD__AGENT__V1__DROP_SNAPSHOT__INIT;
  kit_init(&k, 0, session);
  d.seq = seq;
  k.ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DROP_SNAPSHOT;
  k.ins.drop_snapshot = &d;
  execute(&k.ins);
}

Test(service, a_read_streams_its_snapshot_once_and_dropped_or_evicted_ones_are_gone) {
  open_session("d");
  rpc_status_t st;
  cr_assert_eq(write_ref("d", 1, four, 1, F32, 16, &st), GRPC_STATUS_OK, "%s", st.message);
  float v[4];
  uint64_t seq = snapshot("d", 1);
  cr_assert_eq(read_ref("d", 1, seq, 5000, v, 4, &st), GRPC_STATUS_OK, "%s", st.message);
  cr_assert_eq(read_ref("d", 1, seq, 5000, v, 4, &st), GRPC_STATUS_NOT_FOUND);
  cr_assert(strstr(st.message, "no snapshot of tensor 1 at seq"), "%s", st.message);
  cr_assert_eq(read_ref("d", 1, seq - 1, 5000, v, 4, &st), GRPC_STATUS_NOT_FOUND,
               "a seq that was no Snapshot of the ref");

  seq = snapshot("d", 1);
  drop_snapshot("d", seq);
  cr_assert_eq(read_ref("d", 1, seq, 5000, v, 4, &st), GRPC_STATUS_NOT_FOUND, "dropped");
  drop_snapshot("d", seq); /* again, or of nothing: no-op */

  /* Past SESSION_SNAPSHOTS_MAX unread, the oldest goes. */
  uint64_t first = snapshot("d", 1), last = 0;
  for (int i = 0; i < SESSION_SNAPSHOTS_MAX; i++) last = snapshot("d", 1);
  cr_assert_eq(read_ref("d", 1, first, 5000, v, 4, &st), GRPC_STATUS_NOT_FOUND, "evicted");
  cr_assert_eq(read_ref("d", 1, last, 5000, v, 4, &st), GRPC_STATUS_OK, "%s", st.message);
}

Test(service, sessions_never_opened_take_no_writes_and_give_no_reads) {
  rpc_status_t st;
  int64_t t0 = rpc_now_ms();
  cr_assert_eq(write_ref("invented", 1, four, 1, F32, 16, &st), GRPC_STATUS_FAILED_PRECONDITION);
  cr_assert(strstr(st.message, "session invented is not open on this agent"), "%s", st.message);
  cr_assert_lt(rpc_now_ms() - t0, 4500, "the wait for the session is bounded");
  cr_assert_eq(atomic_load(&B.allocated), 0);
  cr_assert_eq(read_ref("invented", 1, 0, 5000, NULL, 0, &st), GRPC_STATUS_NOT_FOUND);
  cr_assert(strstr(st.message, "session invented is not open on this agent"), "%s", st.message);
  cr_assert_eq(read_ref("bad id", 1, 0, 5000, NULL, 0, &st), GRPC_STATUS_INVALID_ARGUMENT);
  cr_assert_eq(read_ref("w", 1, 1u << 30, 5000, NULL, 0, &st), GRPC_STATUS_FAILED_PRECONDITION);
  cr_assert(strstr(st.message, "far beyond"), "%s", st.message);
}

typedef struct late {
  const char *session;
} late_t;

static void *open_later(void *arg) {
  late_t *l = arg;
  nanosleep(&(struct timespec){0, 300 * 1000000L}, NULL);
  open_session(l->session);
  return NULL;
}

Test(service, a_write_that_overtakes_its_sessions_opening_waits_for_it) {
  late_t l = {"late"};
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, open_later, &l), 0);
  rpc_status_t st;
  cr_assert_eq(write_ref("late", 1, four, 1, F32, 16, &st), GRPC_STATUS_OK, "%s", st.message);
  pthread_join(t, NULL);
  cr_assert_eq(read_ref("late", 1, snapshot("late", 1), 5000, NULL, 0, &st), GRPC_STATUS_OK, "%s", st.message);
}

typedef struct reader {
  const char *session;
  int timeout_ms; /* 0: 3 s */
  grpc_status_code code;
  char msg[512];
  _Atomic bool done;
} reader_t;

static void *read_waiting(void *arg) {
  reader_t *r = arg;
  rpc_status_t st;
  /* A seq not sent yet: the Read waits, until its deadline cancels it. */
  r->code = read_ref(r->session, 1, next_seq + 10, r->timeout_ms ? r->timeout_ms : 3000, NULL, 0,
                     &st);
  snprintf(r->msg, sizeof r->msg, "%s", st.message);
  atomic_store(&r->done, true);
  return NULL;
}

Test(service, cancelled_reads_give_their_threads_back_at_once) {
  open_session("r");
  open_session("r2");
  enum { N = 64 };
  pthread_t t[N];
  reader_t r[N];
  cr_assert_eq(data_read_threads(), 0);
  for (int i = 0; i < N; i++) { /* two sessions: one may hold half the places */
    r[i] = (reader_t){.session = i % 2 ? "r2" : "r"};
    cr_assert_eq(pthread_create(&t[i], NULL, read_waiting, &r[i]), 0);
  }
  /* Every slot taken: one more waiting Read is refused at once. */
  int64_t end = rpc_now_ms() + 2500;
  while (data_read_threads() < N && rpc_now_ms() < end) usleep(5000);
  cr_assert_eq(data_read_threads(), N, "the %d Reads wait", N);
  rpc_status_t st;
  grpc_status_code extra = read_ref("r", 1, next_seq + 10, 2000, NULL, 0, &st);
  cr_assert_eq(extra, GRPC_STATUS_RESOURCE_EXHAUSTED, "%d %s", extra, st.message);
  cr_assert(strstr(st.message, "64 Reads already wait"), "%s", st.message);
  for (int i = 0; i < N; i++) {
    pthread_join(t[i], NULL);
    cr_assert_eq(r[i].code, GRPC_STATUS_DEADLINE_EXCEEDED);
  }
  /* Their agent threads end within a poll, not at the 5 s or 600 s bound. */
  end = rpc_now_ms() + 1000;
  while (data_read_threads() > 0 && rpc_now_ms() < end) usleep(10000);
  cr_assert_eq(data_read_threads(), 0, "%d Read threads still wait", data_read_threads());
  /* And the slots are free again. */
  cr_assert_eq(read_ref("r", 1, next_seq + 10, 300, NULL, 0, &st), GRPC_STATUS_DEADLINE_EXCEEDED);
}

typedef struct late_read {
  uint64_t after_seq;
  grpc_status_code code;
  char msg[512];
  float v[4];
  _Atomic bool done;
} late_read_t;

static void *read_late(void *arg) {
  late_read_t *l = arg;
  rpc_status_t st;
  l->code = read_ref("b", 10, l->after_seq, 20000, l->v, 4, &st);
  snprintf(l->msg, sizeof l->msg, "%s", st.message);
  atomic_store(&l->done, true);
  return NULL;
}

/* Reads that overtake their Snapshot (a client's direct Read can: its plan
 * answers before the agent ran the Snapshot) wait on a helper thread; one
 * after another they share one parked helper instead of starting a thread
 * each (~0.5 ms here, as much as a 1 MiB Read). */
Test(service, reads_that_overtake_their_seq_one_after_another_start_one_helper) {
  kit_t k;
  kit_init(&k, 0, "b");
  execute(factory(&k, 10, "ones", four, 1));
  unsigned long before, started;
  int parked;
  data_read_helpers(&before, &parked);
  for (int i = 0; i < 4; i++) {
    late_read_t l = {.after_seq = next_seq};
    pthread_t lt;
    cr_assert_eq(pthread_create(&lt, NULL, read_late, &l), 0);
    int64_t end = rpc_now_ms() + 2500;
    while (data_read_threads() < 1 && !atomic_load(&l.done) && rpc_now_ms() < end) usleep(1000);
    cr_assert_eq(data_read_threads(), 1, "Read %d waits for its seq: %s", i,
                 atomic_load(&l.done) ? l.msg : "");
    cr_assert_eq(snapshot("b", 10), l.after_seq);
    pthread_join(lt, NULL);
    cr_assert_eq(l.code, GRPC_STATUS_OK, "%d %s", l.code, l.msg);
    for (int e = 0; e < 4; e++) cr_assert_float_eq(l.v[e], 1.0f, 1e-6);
    /* Its helper parks once the Read is answered (a bounded wait: a helper
     * that does not park shows in the count below). */
    end = rpc_now_ms() + 1000;
    do data_read_helpers(&started, &parked);
    while (parked < 1 && rpc_now_ms() < end && usleep(1000) == 0);
  }
  data_read_helpers(&started, &parked);
  cr_assert_leq(started - before, 1, "%lu helper threads started for 4 Reads, one after another",
               started - before);
}

/* The parked helper of a Read that overtook its seq waited out its 10 s park
 * after the agent's shutdown: an idle thread at exit (a sanitized agent's too).
 * data_stop, at the agent's exit, ends it. */
Test(service, the_read_helpers_end_at_the_agents_shutdown) {
  kit_t k;
  kit_init(&k, 0, "b");
  execute(factory(&k, 10, "ones", four, 1));
  late_read_t l = {.after_seq = next_seq};
  pthread_t lt;
  cr_assert_eq(pthread_create(&lt, NULL, read_late, &l), 0);
  int64_t end = rpc_now_ms() + 2500;
  while (data_read_threads() < 1 && !atomic_load(&l.done) && rpc_now_ms() < end) usleep(1000);
  cr_assert_eq(data_read_threads(), 1, "the Read waits for its seq: %s",
               atomic_load(&l.done) ? l.msg : "");
  cr_assert_eq(snapshot("b", 10), l.after_seq);
  pthread_join(lt, NULL);
  cr_assert_eq(l.code, GRPC_STATUS_OK, "%d %s", l.code, l.msg);
  unsigned long started;
  int parked;
  end = rpc_now_ms() + 2000;
  do data_read_helpers(&started, &parked);
  while (parked < 1 && rpc_now_ms() < end && usleep(1000) == 0);
  cr_assert_eq(parked, 1, "the Read's helper did not park");
  cr_assert_eq(proc_threads_named("read-wait"), 1);
  data_stop();
  /* (a thread that ended may show in /proc a moment longer) */
  end = rpc_now_ms() + 2000;
  while (proc_threads_named("read-wait") > 0 && rpc_now_ms() < end) usleep(1000);
  cr_assert_eq(proc_threads_named("read-wait"), 0, "a Read helper outlived the shutdown");
}

/* One session's burst of Reads waiting for seqs (its server lets it have 64
 * transfers in flight) takes half the agent's 64 places at most: its other
 * Reads are refused QUOTA naming the session's share, in words the clients
 * retry ("Reads already wait for seqs"), and another session's Read still
 * waits and gets its bytes (it was refused "64 Reads already wait" until the
 * burst drained). */
Test(service, one_sessions_waiting_reads_leave_places_to_another_session) {
  open_session("a");
  kit_t k;
  kit_init(&k, 0, "b");
  execute(factory(&k, 10, "ones", four, 1));
  enum { N = 64 };
  pthread_t t[N];
  reader_t r[N];
  for (int i = 0; i < N; i++) {
    r[i] = (reader_t){.session = "a", .timeout_ms = 5000}; /* past b's wait below */
    cr_assert_eq(pthread_create(&t[i], NULL, read_waiting, &r[i]), 0);
  }
  int refused = 0;
  int64_t end = rpc_now_ms() + 2500;
  for (;;) { /* every Read of a's burst either waits or was refused */
    refused = 0;
    for (int i = 0; i < N; i++) refused += atomic_load(&r[i].done);
    if (data_read_threads() + refused >= N || rpc_now_ms() >= end) break;
    usleep(5000);
  }
  cr_assert_eq(data_read_threads(), N / 2, "%d of session a's Reads wait", data_read_threads());
  cr_assert_eq(refused, N / 2);
  for (int i = 0; i < N; i++) {
    if (!atomic_load(&r[i].done)) continue;
    cr_assert_eq(r[i].code, GRPC_STATUS_RESOURCE_EXHAUSTED, "%d %s", r[i].code, r[i].msg);
    cr_assert(strstr(r[i].msg, "Read: 32 Reads already wait for seqs of session a on this agent, "
                               "the most one session may hold of its 64 waiting places"),
              "%s", r[i].msg);
  }
  /* b's Read of a seq still to come waits (a thread more), then is answered. */
  late_read_t l = {.after_seq = next_seq};
  pthread_t lt;
  cr_assert_eq(pthread_create(&lt, NULL, read_late, &l), 0);
  end = rpc_now_ms() + 2500;
  while (data_read_threads() < N / 2 + 1 && !atomic_load(&l.done) && rpc_now_ms() < end)
    usleep(5000);
  cr_assert_eq(data_read_threads(), N / 2 + 1, "session b's Read waits: %s", atomic_load(&l.done) ? l.msg : "");
  cr_assert_eq(snapshot("b", 10), l.after_seq);
  pthread_join(lt, NULL);
  cr_assert_eq(l.code, GRPC_STATUS_OK, "%d %s", l.code, l.msg);
  for (int i = 0; i < 4; i++) cr_assert_float_eq(l.v[i], 1.0f, 1e-6);
  for (int i = 0; i < N; i++) pthread_join(t[i], NULL);
  /* The waiting ones ended at their deadline and gave their places back. */
  end = rpc_now_ms() + 1000;
  while (data_read_threads() > 0 && rpc_now_ms() < end) usleep(10000);
  cr_assert_eq(data_read_threads(), 0, "%d Read threads still wait", data_read_threads());
  rpc_status_t st;
  cr_assert_eq(read_ref("a", 1, next_seq + 10, 300, NULL, 0, &st), GRPC_STATUS_DEADLINE_EXCEEDED,
               "%s", st.message);
}
