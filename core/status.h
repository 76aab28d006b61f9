/* meshd status codes: one small enum for the whole codebase.
 *
 * errno, gRPC, CUDA and NCCL codes are mapped into it at the boundary; nothing
 * else leaks raw codes. The X-macro gives each value its name, its gRPC status
 * code and a short description from a single table. */
#ifndef MESHD_STATUS_H
#define MESHD_STATUS_H

#include <grpc/status.h>

#include "log.h"

#define MESHD_STATUS_MAP(XX)                                                         \
  XX(OK, GRPC_STATUS_OK, "ok")                                                       \
  XX(INVALID, GRPC_STATUS_INVALID_ARGUMENT, "invalid argument")                      \
  XX(NOT_FOUND, GRPC_STATUS_NOT_FOUND, "not found")                                  \
  XX(EXISTS, GRPC_STATUS_ALREADY_EXISTS, "already exists")                           \
  XX(EXHAUSTED, GRPC_STATUS_RESOURCE_EXHAUSTED, "resource exhausted")                \
  XX(NO_MEMORY, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory")                     \
  XX(UNAVAILABLE, GRPC_STATUS_UNAVAILABLE, "unavailable")                            \
  XX(TIMEOUT, GRPC_STATUS_DEADLINE_EXCEEDED, "timed out")                            \
  XX(CANCELLED, GRPC_STATUS_CANCELLED, "cancelled")                                  \
  XX(UNAUTHENTICATED, GRPC_STATUS_UNAUTHENTICATED, "unauthenticated")                \
  XX(PRECONDITION, GRPC_STATUS_FAILED_PRECONDITION, "failed precondition")           \
  XX(UNIMPLEMENTED, GRPC_STATUS_UNIMPLEMENTED, "unimplemented")                      \
  XX(IO, GRPC_STATUS_UNAVAILABLE, "i/o error")                                       \
  XX(INTERNAL, GRPC_STATUS_INTERNAL, "internal error")

typedef enum {
#define XX(name, grpc, text) MESHD_##name,
  MESHD_STATUS_MAP(XX)
#undef XX
  MESHD_STATUS_COUNT
} meshd_status_t;

/* "OK", "INVALID", ... ; "UNKNOWN_STATUS" for values outside the enum. */
const char *meshd_status_name(meshd_status_t s);
/* A short human description: "invalid argument". */
const char *meshd_status_str(meshd_status_t s);
/* The gRPC status code a meshd status travels as. */
grpc_status_code meshd_status_to_grpc(meshd_status_t s);
/* The other direction, for what a peer answered. Where rows share a code the first
 * row wins (RESOURCE_EXHAUSTED -> EXHAUSTED); codes no row uses -> INTERNAL. */
meshd_status_t meshd_status_from_grpc(grpc_status_code c);
/* errno -> status (ENOMEM -> NO_MEMORY, ETIMEDOUT -> TIMEOUT, ...; others -> IO). */
meshd_status_t meshd_status_from_errno(int err);
/* gRPC code name as grpc-status spells it: "INVALID_ARGUMENT"; "UNKNOWN" outside 0..16. */
const char *meshd_grpc_code_name(grpc_status_code c);

/* Fallible call in a function shaped `... out: cleanup; return ret;`.
 * On failure logs file:line and the expression, stores the status in `ret`
 * and jumps to `label`. `call` must evaluate to a meshd_status_t. */
#define CHECK_GOTO(call, ret, label)                                                 \
  do {                                                                               \
    meshd_status_t check_s_ = (call);                                                \
    if (check_s_ != MESHD_OK) {                                                      \
      log_write(LOG_LEVEL_DEBUG, "check", __FILE__, __LINE__, "%s: %s", #call,       \
                meshd_status_str(check_s_));                                         \
      (ret) = check_s_;                                                              \
      goto label;                                                                    \
    }                                                                                \
  } while (0)

#endif
