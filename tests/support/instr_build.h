/* Agent instructions the executor tests submit, built in place: each *_instr_t
 * holds every part its instruction points to, so it lives as long as the
 * caller's variable (executor_submit copies what it keeps). The caller sets
 * seq, session_id and stream. */
#ifndef MESHD_TEST_INSTR_BUILD_H
#define MESHD_TEST_INSTR_BUILD_H

#include <stdint.h>

#include "meshd/agent/v1/agent.pb-c.h"

/* A Factory of `kind` ("ones", "zeros") of n values of dtype as ref. */
typedef struct factory_instr {
  int64_t shape[1];
  Meshd__V1__Factory f;
  Meshd__Agent__V1__TensorSpec res;
  Meshd__Agent__V1__FactoryOp op;
  Meshd__Agent__V1__Instruction ins;
} factory_instr_t;

static inline Meshd__Agent__V1__Instruction *factory_instr(factory_instr_t *b, const char *kind,
                                                           uint64_t ref, int64_t n, int dtype) {
  b->shape[0] = n;
  meshd__v1__factory__init(&b->f);
  b->f.ref = ref;
  b->f.kind = (char *)kind;
  b->f.n_shape = 1;
  b->f.shape = b->shape;
  b->f.dtype = (Meshd__V1__DType)dtype;
  meshd__agent__v1__tensor_spec__init(&b->res);
  b->res.ref = ref;
  b->res.n_shape = 1;
  b->res.shape = b->shape;
  b->res.dtype = (Meshd__V1__DType)dtype;
  meshd__agent__v1__factory_op__init(&b->op);
  b->op.factory = &b->f;
  b->op.result = &b->res;
  meshd__agent__v1__instruction__init(&b->ins);
  b->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY;
  b->ins.factory = &b->op;
  return &b->ins;
}

/* A BorrowOp phase of borrow id: tensor (on stream 1) as result on stream 2. */
typedef struct borrow_instr {
  Meshd__Agent__V1__BorrowOp op;
  Meshd__Agent__V1__Instruction ins;
} borrow_instr_t;

static inline Meshd__Agent__V1__Instruction *borrow_instr(borrow_instr_t *b, int phase,
                                                          uint64_t id, uint64_t tensor,
                                                          uint64_t result) {
  meshd__agent__v1__borrow_op__init(&b->op);
  b->op.phase = (Meshd__Agent__V1__BorrowOp__Phase)phase;
  b->op.borrow = id;
  b->op.tensor = tensor;
  b->op.result = result;
  b->op.from_stream = 1;
  b->op.to_stream = 2;
  meshd__agent__v1__instruction__init(&b->ins);
  b->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW;
  b->ins.borrow = &b->op;
  return &b->ins;
}

/* A Status (the executor reports what it ran) or an EndSession: the
 * instructions whose bodies have no fields; body_case says which. */
typedef struct control_instr {
  Meshd__Agent__V1__StatusRequest status;
  Meshd__Agent__V1__EndSession end;
  Meshd__Agent__V1__Instruction ins;
} control_instr_t;

static inline Meshd__Agent__V1__Instruction *control_instr(control_instr_t *b, int body_case) {
  meshd__agent__v1__status_request__init(&b->status);
  meshd__agent__v1__end_session__init(&b->end);
  meshd__agent__v1__instruction__init(&b->ins);
  b->ins.body_case = (Meshd__Agent__V1__Instruction__BodyCase)body_case;
  if (body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS)
    b->ins.status = &b->status;
  else
    b->ins.end_session = &b->end;
  return &b->ins;
}

#endif
