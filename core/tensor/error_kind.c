#include "error_kind.h"

#include <stdio.h>
#include <string.h>

const char *error_kind_name(error_kind_t k) {
  switch (k) {
#define XX(name, value, code) \
  case ERR_##name:            \
    return #name;
    ERROR_KIND_MAP(XX)
#undef XX
  }
  return "UNKNOWN_KIND";
}

grpc_status_code error_kind_code(error_kind_t k) {
  switch (k) {
#define XX(name, value, code) \
  case ERR_##name:            \
    return code;
    ERROR_KIND_MAP(XX)
#undef XX
  }
  return GRPC_STATUS_INTERNAL;
}

int error_set(meshd_error_t *e, error_kind_t kind, const char *fmt, ...) {
  if (!e) return -1;
  e->kind = kind;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
  return -1;
}

void error_prefix(meshd_error_t *e, const char *prefix, const char *sep) {
  size_t lp = strlen(prefix), ls = strlen(sep), p = lp + ls;
  size_t n = strlen(e->msg), cap = sizeof e->msg - 1;
  if (p >= cap) return;
  if (n > cap - p) n = cap - p;
  memmove(e->msg + p, e->msg, n);
  e->msg[p + n] = '\0';
  memcpy(e->msg, prefix, lp);
  memcpy(e->msg + lp, sep, ls);
}
