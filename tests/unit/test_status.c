#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "log.h"
#include "status.h"

Test(status, names_and_descriptions_come_from_the_table) {
  cr_assert_str_eq(meshd_status_name(MESHD_OK), "OK");
  cr_assert_str_eq(meshd_status_name(MESHD_INVALID), "INVALID");
  cr_assert_str_eq(meshd_status_name(MESHD_NO_MEMORY), "NO_MEMORY");
  cr_assert_str_eq(meshd_status_name(MESHD_INTERNAL), "INTERNAL");
  cr_assert_str_eq(meshd_status_str(MESHD_OK), "ok");
  cr_assert_str_eq(meshd_status_str(MESHD_INVALID), "invalid argument");
  cr_assert_str_eq(meshd_status_str(MESHD_TIMEOUT), "timed out");
  cr_assert_str_eq(meshd_status_str(MESHD_IO), "i/o error");
  cr_assert_str_eq(meshd_status_str(MESHD_INTERNAL), "internal error");
}

Test(status, every_row_round_trips_through_the_table) {
  /* Expected values are written out from the table independently of status.c. */
  struct {
    meshd_status_t s;
    const char *name, *text;
    grpc_status_code grpc;
  } rows[] = {
#define XX(name, grpc, text) {MESHD_##name, #name, text, grpc},
      MESHD_STATUS_MAP(XX)
#undef XX
  };
  cr_assert_eq(sizeof rows / sizeof rows[0], MESHD_STATUS_COUNT);
  for (size_t i = 0; i < MESHD_STATUS_COUNT; i++) {
    cr_assert_eq((size_t)rows[i].s, i);
    cr_assert_str_eq(meshd_status_name(rows[i].s), rows[i].name);
    cr_assert_str_eq(meshd_status_str(rows[i].s), rows[i].text);
    cr_assert_eq(meshd_status_to_grpc(rows[i].s), rows[i].grpc, "%s", rows[i].name);
    /* Back from gRPC: the same code (rows may share one). */
    meshd_status_t back = meshd_status_from_grpc(rows[i].grpc);
    cr_assert_eq(meshd_status_to_grpc(back), rows[i].grpc, "%s", rows[i].name);
    for (size_t j = 0; j < i; j++)
      cr_assert_str_neq(meshd_status_name(rows[j].s), rows[i].name);
  }
}

Test(status, to_grpc_spot_checks) {
  cr_assert_eq(meshd_status_to_grpc(MESHD_OK), GRPC_STATUS_OK);
  cr_assert_eq(meshd_status_to_grpc(MESHD_INVALID), GRPC_STATUS_INVALID_ARGUMENT);
  cr_assert_eq(meshd_status_to_grpc(MESHD_EXISTS), GRPC_STATUS_ALREADY_EXISTS);
  cr_assert_eq(meshd_status_to_grpc(MESHD_NO_MEMORY), GRPC_STATUS_RESOURCE_EXHAUSTED);
  cr_assert_eq(meshd_status_to_grpc(MESHD_TIMEOUT), GRPC_STATUS_DEADLINE_EXCEEDED);
  cr_assert_eq(meshd_status_to_grpc(MESHD_IO), GRPC_STATUS_UNAVAILABLE);
  cr_assert_eq(meshd_status_to_grpc(MESHD_UNAUTHENTICATED), GRPC_STATUS_UNAUTHENTICATED);
}

Test(status, from_grpc_takes_the_first_row_and_falls_back_to_internal) {
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_OK), MESHD_OK);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_INVALID_ARGUMENT), MESHD_INVALID);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_NOT_FOUND), MESHD_NOT_FOUND);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_DEADLINE_EXCEEDED), MESHD_TIMEOUT);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_CANCELLED), MESHD_CANCELLED);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_UNAVAILABLE), MESHD_UNAVAILABLE);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_RESOURCE_EXHAUSTED), MESHD_EXHAUSTED);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_UNIMPLEMENTED), MESHD_UNIMPLEMENTED);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_FAILED_PRECONDITION), MESHD_PRECONDITION);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_UNAUTHENTICATED), MESHD_UNAUTHENTICATED);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_UNKNOWN), MESHD_INTERNAL);
  cr_assert_eq(meshd_status_from_grpc(GRPC_STATUS_DATA_LOSS), MESHD_INTERNAL);
  cr_assert_eq(meshd_status_from_grpc((grpc_status_code)99), MESHD_INTERNAL);
}

Test(status, out_of_range_values) {
  cr_assert_str_eq(meshd_status_name(MESHD_STATUS_COUNT), "UNKNOWN_STATUS");
  cr_assert_str_eq(meshd_status_name((meshd_status_t)-1), "UNKNOWN_STATUS");
  cr_assert_not_null(meshd_status_str(MESHD_STATUS_COUNT));
  cr_assert_eq(meshd_status_to_grpc(MESHD_STATUS_COUNT), GRPC_STATUS_INTERNAL);
}

Test(status, from_errno) {
  cr_assert_eq(meshd_status_from_errno(0), MESHD_OK);
  cr_assert_eq(meshd_status_from_errno(ENOMEM), MESHD_NO_MEMORY);
  cr_assert_eq(meshd_status_from_errno(ETIMEDOUT), MESHD_TIMEOUT);
  cr_assert_eq(meshd_status_from_errno(ENOENT), MESHD_NOT_FOUND);
  cr_assert_eq(meshd_status_from_errno(EEXIST), MESHD_EXISTS);
  cr_assert_eq(meshd_status_from_errno(EINVAL), MESHD_INVALID);
  cr_assert_eq(meshd_status_from_errno(ENOSPC), MESHD_EXHAUSTED);
  cr_assert_eq(meshd_status_from_errno(EMFILE), MESHD_EXHAUSTED);
  cr_assert_eq(meshd_status_from_errno(ECONNREFUSED), MESHD_UNAVAILABLE);
  cr_assert_eq(meshd_status_from_errno(EAGAIN), MESHD_UNAVAILABLE);
  cr_assert_eq(meshd_status_from_errno(ECANCELED), MESHD_CANCELLED);
  cr_assert_eq(meshd_status_from_errno(ENOSYS), MESHD_UNIMPLEMENTED);
  cr_assert_eq(meshd_status_from_errno(EIO), MESHD_IO);
  cr_assert_eq(meshd_status_from_errno(EBADF), MESHD_INTERNAL);
  cr_assert_eq(meshd_status_from_errno(12345), MESHD_IO);
}

Test(status, grpc_code_names) {
  static const char *const want[17] = {
      "OK",           "CANCELLED",          "UNKNOWN",           "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",     "ALREADY_EXISTS",    "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",    "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",          "UNAVAILABLE",       "DATA_LOSS",
      "UNAUTHENTICATED"};
  for (int c = 0; c <= 16; c++)
    cr_assert_str_eq(meshd_grpc_code_name((grpc_status_code)c), want[c], "code %d", c);
  cr_assert_str_eq(meshd_grpc_code_name((grpc_status_code)17), "UNKNOWN");
  cr_assert_str_eq(meshd_grpc_code_name((grpc_status_code)-1), "UNKNOWN");
}

static meshd_status_t fail_with(meshd_status_t s) { return s; }

static meshd_status_t uses_check_goto(meshd_status_t first, bool *cleaned, bool *reached) {
  meshd_status_t ret = MESHD_OK;
  CHECK_GOTO(fail_with(first), ret, out);
  *reached = true;
out:
  *cleaned = true;
  return ret;
}

Test(status, check_goto_jumps_on_failure_only) {
  bool cleaned = false, reached = false;
  cr_assert_eq(uses_check_goto(MESHD_OK, &cleaned, &reached), MESHD_OK);
  cr_assert(cleaned && reached);
  cleaned = reached = false;
  cr_assert_eq(uses_check_goto(MESHD_NOT_FOUND, &cleaned, &reached), MESHD_NOT_FOUND);
  cr_assert(cleaned && !reached);
}
