/* The error kinds a client sees (ErrorKind in tensor_service.proto), with the
 * gRPC status each travels as. One table: names, codes and proto values. */
#ifndef MESHD_ERROR_KIND_H
#define MESHD_ERROR_KIND_H

#include <grpc/status.h>
#include <stdarg.h>
#include <stddef.h>

/* XX(NAME, proto value, gRPC code) */
#define ERROR_KIND_MAP(XX)                                           \
  XX(NONE, 0, GRPC_STATUS_OK)                                        \
  XX(WRONG_MESH, 1, GRPC_STATUS_INVALID_ARGUMENT)                    \
  XX(WRONG_STREAM, 2, GRPC_STATUS_INVALID_ARGUMENT)                  \
  XX(DROPPED, 3, GRPC_STATUS_FAILED_PRECONDITION)                    \
  XX(BORROWED, 4, GRPC_STATUS_FAILED_PRECONDITION)                   \
  XX(MUTATING_BORROW, 5, GRPC_STATUS_FAILED_PRECONDITION)            \
  XX(UNKNOWN_REF, 6, GRPC_STATUS_NOT_FOUND)                          \
  XX(REF_REUSED, 7, GRPC_STATUS_INVALID_ARGUMENT)                    \
  XX(UNKNOWN_OP, 8, GRPC_STATUS_NOT_FOUND)                           \
  XX(BAD_ARGUMENT, 9, GRPC_STATUS_INVALID_ARGUMENT)                  \
  XX(SHAPE_MISMATCH, 10, GRPC_STATUS_INVALID_ARGUMENT)               \
  XX(DTYPE_MISMATCH, 11, GRPC_STATUS_INVALID_ARGUMENT)               \
  XX(BAD_DIM, 12, GRPC_STATUS_INVALID_ARGUMENT)                      \
  XX(QUOTA, 13, GRPC_STATUS_RESOURCE_EXHAUSTED)                      \
  XX(REMOTE_FAILURE, 14, GRPC_STATUS_ABORTED)                        \
  XX(DEPENDENT_FAILURE, 15, GRPC_STATUS_ABORTED)                     \
  XX(AGENT_LOST, 16, GRPC_STATUS_UNAVAILABLE)                        \
  XX(NO_SESSION, 17, GRPC_STATUS_UNAUTHENTICATED)                    \
  XX(UNAVAILABLE, 18, GRPC_STATUS_UNAVAILABLE)                       \
  XX(DEADLINE_EXCEEDED, 19, GRPC_STATUS_DEADLINE_EXCEEDED)          \
  XX(UNAUTHENTICATED, 20, GRPC_STATUS_UNAUTHENTICATED)              \
  XX(PERMISSION_DENIED, 21, GRPC_STATUS_PERMISSION_DENIED)

typedef enum {
#define XX(name, value, code) ERR_##name = value,
  ERROR_KIND_MAP(XX)
#undef XX
} error_kind_t;

/* A rejection: its kind and a message in Monarch's explanatory style (which
 * command, which argument, what was expected, how to fix it). */
typedef struct meshd_error {
  error_kind_t kind;
  char msg[600];
} meshd_error_t;

/* "WRONG_MESH"; "UNKNOWN_KIND" outside the table. */
const char *error_kind_name(error_kind_t k);
grpc_status_code error_kind_code(error_kind_t k);
/* Sets e (which may be NULL) and returns -1, so checks read `return error_set(e, ...);`. */
int error_set(meshd_error_t *e, error_kind_t kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Puts PREFIX and SEP before e's message (truncating the end if need be):
 * error_prefix(e, "Call", " ") turns "add: ..." into "Call add: ...". */
void error_prefix(meshd_error_t *e, const char *prefix, const char *sep);

#endif
