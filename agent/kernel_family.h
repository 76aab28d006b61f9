/* Which kernel family runs each catalogue op: one table for every backend.
 * A backend maps families to its own kernels (cpu: cpu_kernel_*, cuda:
 * cuda_kernel_*) with one array indexed by kernel_family_t; ops that only
 * make views (the result aliases its input) need no kernel and have none. */
#ifndef MESHD_AGENT_KERNEL_FAMILY_H
#define MESHD_AGENT_KERNEL_FAMILY_H

#include "ops.h"

/* XX(FAMILY, "the catalogue ops it runs") */
#define KERNEL_FAMILY_MAP(XX)                                                                   \
  XX(FILL, "empty zeros ones full")                                                           \
  XX(ARANGE, "arange")                                                                        \
  XX(RAND, "rand randn")                                                                      \
  XX(RANK, "rank")                                                                            \
  XX(FILL_, "fill_ zero_")                                                                    \
  XX(BINARY, "add sub mul div pow maximum minimum eq ne lt le gt ge logical_and logical_or "  \
             "bitwise_and bitwise_or bitwise_xor add_ sub_ mul_ div_")                        \
  XX(UNARY, "neg abs exp log sqrt rsqrt sin cos tanh sigmoid reciprocal relu gelu silu sign " \
            "logical_not")                                                                    \
  XX(WHERE, "where")                                                                          \
  XX(CLAMP, "clamp clamp_")                                                                   \
  XX(REDUCE, "sum mean prod max min amax amin argmax argmin")                                 \
  XX(SOFTMAX, "softmax log_softmax")                                                          \
  XX(MATMUL, "matmul mm bmm")                                                                 \
  XX(COPY, "clone contiguous to cast copy_ reshape") /* reshape: when it cannot view */      \
  XX(CAT, "cat")                                                                              \
  XX(STACK, "stack")                                                                          \
  XX(INDEX_SELECT, "index_select")                                                            \
  XX(GATHER, "gather")

typedef enum {
  KF_NONE, /* views, or an op no family runs */
#define XX(name, ops) KF_##name,
  KERNEL_FAMILY_MAP(XX)
#undef XX
  KF_COUNT
} kernel_family_t;

/* The family of op (KF_NONE for views and unknown ops). Thread-safe. */
kernel_family_t kernel_family_of(const op_def_t *op);

#endif
