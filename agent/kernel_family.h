/* Which kernel family runs each catalogue op: one table for every backend.
 * A backend has one kernel per family, named <prefix><kernel> (cpu_kernel_fill,
 * cuda_kernel_fill, ...), declared and tabled from this same list; ops that
 * only make views (the result aliases its input) need no kernel and have none.
 * Every kernel takes the same call (kernel_call_t). */
#ifndef MESHD_AGENT_KERNEL_FAMILY_H
#define MESHD_AGENT_KERNEL_FAMILY_H

#include "backend.h"
#include "ops.h"

/* XX(FAMILY, kernel, "the catalogue ops it runs", a, b): a and b are passed
 * through for the users below. COPY runs reshape when it cannot view. */
#define KERNEL_FAMILY_MAP(XX, a, b)                                                    \
  XX(FILL, fill, "empty zeros ones full", a, b)                                        \
  XX(ARANGE, arange, "arange", a, b)                                                   \
  XX(RAND, rand, "rand randn", a, b)                                                   \
  XX(RANK, rank, "rank", a, b)                                                         \
  XX(FILL_, fill_, "fill_ zero_", a, b)                                                \
  XX(BINARY, binary,                                                                   \
     "add sub mul div pow maximum minimum eq ne lt le gt ge logical_and logical_or "   \
     "bitwise_and bitwise_or bitwise_xor add_ sub_ mul_ div_", a, b)                   \
  XX(UNARY, unary,                                                                     \
     "neg abs exp log sqrt rsqrt sin cos tanh sigmoid reciprocal relu gelu silu sign " \
     "logical_not", a, b)                                                              \
  XX(WHERE, where, "where", a, b)                                                      \
  XX(CLAMP, clamp, "clamp clamp_", a, b)                                               \
  XX(REDUCE, reduce, "sum mean prod max min amax amin argmax argmin", a, b)            \
  XX(SOFTMAX, softmax, "softmax log_softmax", a, b)                                    \
  XX(MATMUL, matmul, "matmul mm bmm", a, b)                                            \
  XX(COPY, copy, "clone contiguous to cast copy_ reshape", a, b)                       \
  XX(CAT, cat, "cat", a, b)                                                            \
  XX(STACK, stack, "stack", a, b)                                                      \
  XX(INDEX_SELECT, index_select, "index_select", a, b)                                 \
  XX(GATHER, gather, "gather", a, b)

#define KERNEL_FAMILY_ENUM_(name, kernel, ops, a, b) KF_##name,
typedef enum {
  KF_NONE, /* views, or an op no family runs */
  KERNEL_FAMILY_MAP(KERNEL_FAMILY_ENUM_, _, _)
  KF_COUNT
} kernel_family_t;

/* One kernel call: run_op's arguments (backend.h), on the backend's stack for
 * the length of the call; every pointer is borrowed. The same for every
 * backend: what one backend needs beyond it comes from b (its impl) or bs. */
typedef struct kernel_call {
  backend_t *b;
  backend_stream_t *bs; /* the stream it runs on: cuda never NULL (its own stream
                           for a NULL slot argument); cpu always NULL */
  const op_args_t *a;   /* bound arguments; tensors are agent_tensor_t views */
  agent_tensor_t **res; /* nres results, allocated from inf's metas */
  int nres;
  const op_infer_t *inf;
  uint32_t rank;      /* this agent's mesh rank: rand's stream, messages */
  int64_t coordinate; /* rank()'s value */
} kernel_call_t;

/* A family's kernel: 0, or -1 with e (REMOTE_FAILURE naming the op, QUOTA). */
typedef int (*kernel_fn)(const kernel_call_t *c, meshd_error_t *e);

/* The tensor argument at param (NULL when the value is not a tensor). */
static inline agent_tensor_t *kernel_arg(const kernel_call_t *c, int param) {
  const op_value_t *v = &c->a->v[param];
  return v->kind == VAL_TENSOR ? agent_tensor_of(v->tensor) : NULL;
}
static inline const char *kernel_opname(const kernel_call_t *c) { return c->a->op->name; }

/* KERNEL_FAMILY_DECLARE(cpu_kernel_) declares
 * int cpu_kernel_fill(const kernel_call_t *c, meshd_error_t *e) ... for every
 * family; KERNEL_FAMILY_TABLE(cpu_kernel_) initialises a kernel_fn array
 * indexed by kernel_family_t with them. */
#define KERNEL_FAMILY_DECL_(name, kernel, ops, prefix, unused) \
  int prefix##kernel(const kernel_call_t *c, meshd_error_t *e);
#define KERNEL_FAMILY_DECLARE(prefix) KERNEL_FAMILY_MAP(KERNEL_FAMILY_DECL_, prefix, _)
#define KERNEL_FAMILY_ENTRY_(name, kernel, ops, prefix, unused) [KF_##name] = prefix##kernel,
#define KERNEL_FAMILY_TABLE(prefix) {KERNEL_FAMILY_MAP(KERNEL_FAMILY_ENTRY_, prefix, _)}

/* The family of op (KF_NONE for views and unknown ops). Thread-safe. */
kernel_family_t kernel_family_of(const op_def_t *op);

#endif
