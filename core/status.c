#include "status.h"

#include <errno.h>

const char *meshd_status_name(meshd_status_t s) {
  switch (s) {
#define XX(name, grpc, text) \
  case MESHD_##name:         \
    return #name;
    MESHD_STATUS_MAP(XX)
#undef XX
  default:
    return "UNKNOWN_STATUS";
  }
}

const char *meshd_status_str(meshd_status_t s) {
  switch (s) {
#define XX(name, grpc, text) \
  case MESHD_##name:         \
    return text;
    MESHD_STATUS_MAP(XX)
#undef XX
  default:
    return "unknown status";
  }
}

grpc_status_code meshd_status_to_grpc(meshd_status_t s) {
  switch (s) {
#define XX(name, grpc, text) \
  case MESHD_##name:         \
    return grpc;
    MESHD_STATUS_MAP(XX)
#undef XX
  default:
    return GRPC_STATUS_INTERNAL;
  }
}

meshd_status_t meshd_status_from_grpc(grpc_status_code c) {
  /* Several rows may share a gRPC code; the first one in the table wins. */
#define XX(name, grpc, text) \
  if (c == (grpc))           \
    return MESHD_##name;
  MESHD_STATUS_MAP(XX)
#undef XX
  return MESHD_INTERNAL;
}

meshd_status_t meshd_status_from_errno(int err) {
  switch (err) {
  case 0:
    return MESHD_OK;
  case EINVAL:
  case ERANGE:
  case EDOM:
  case E2BIG:
  case ENAMETOOLONG:
  case EMSGSIZE:
    return MESHD_INVALID;
  case ENOENT:
  case ESRCH:
  case ENXIO:
  case ENODEV:
    return MESHD_NOT_FOUND;
  case EEXIST:
  case EADDRINUSE:
    return MESHD_EXISTS;
  case ENOMEM:
    return MESHD_NO_MEMORY;
  case ENOSPC:
  case EMFILE:
  case ENFILE:
  case ENOBUFS:
  case EDQUOT:
    return MESHD_EXHAUSTED;
  case EAGAIN:
#if EWOULDBLOCK != EAGAIN
  case EWOULDBLOCK:
#endif
  case EBUSY:
  case ECONNREFUSED:
  case ECONNRESET:
  case ECONNABORTED:
  case EPIPE:
  case ENOTCONN:
  case EHOSTUNREACH:
  case ENETUNREACH:
  case ENETDOWN:
  case EADDRNOTAVAIL:
    return MESHD_UNAVAILABLE;
  case ETIMEDOUT:
  case ETIME:
    return MESHD_TIMEOUT;
  case ECANCELED:
    return MESHD_CANCELLED;
  case ENOSYS:
  case ENOTSUP:
#if EOPNOTSUPP != ENOTSUP
  case EOPNOTSUPP:
#endif
  case EAFNOSUPPORT:
  case EPROTONOSUPPORT:
    return MESHD_UNIMPLEMENTED;
  case EBADF:
  case EFAULT:
  case ENOTSOCK:
    return MESHD_INTERNAL;
  default:
    return MESHD_IO;
  }
}

const char *meshd_grpc_code_name(grpc_status_code c) {
  switch (c) {
  case GRPC_STATUS_OK: return "OK";
  case GRPC_STATUS_CANCELLED: return "CANCELLED";
  case GRPC_STATUS_UNKNOWN: return "UNKNOWN";
  case GRPC_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
  case GRPC_STATUS_DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
  case GRPC_STATUS_NOT_FOUND: return "NOT_FOUND";
  case GRPC_STATUS_ALREADY_EXISTS: return "ALREADY_EXISTS";
  case GRPC_STATUS_PERMISSION_DENIED: return "PERMISSION_DENIED";
  case GRPC_STATUS_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
  case GRPC_STATUS_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
  case GRPC_STATUS_ABORTED: return "ABORTED";
  case GRPC_STATUS_OUT_OF_RANGE: return "OUT_OF_RANGE";
  case GRPC_STATUS_UNIMPLEMENTED: return "UNIMPLEMENTED";
  case GRPC_STATUS_INTERNAL: return "INTERNAL";
  case GRPC_STATUS_UNAVAILABLE: return "UNAVAILABLE";
  case GRPC_STATUS_DATA_LOSS: return "DATA_LOSS";
  case GRPC_STATUS_UNAUTHENTICATED: return "UNAUTHENTICATED";
  default:
    /* The gRPC spec treats codes outside 0..16 as UNKNOWN. */
    return "UNKNOWN";
  }
}
