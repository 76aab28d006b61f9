/* Objects of another session in the C client: refs are numbered per session,
 * so two sessions made the same way hand out the same ref numbers, and a ref of
 * session B used in a call of session A named another object of A (wrong
 * results, no error). Every call that sends a ref refuses one of another
 * session (MESHD_E_INVALID naming the argument). Also: an unknown dtype is
 * BAD_ARGUMENT and a bad shard dim BAD_DIM (DESIGN.md section 6). Against a
 * live `meshd --local-agents 2`, as test_c_client.c. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "meshd.h"

#include "c_client_server.h"

TestSuite(c_sessions, .init = start_server, .fini = stop_server, .timeout = 60);

static meshd_client_t *connect_ok(void) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 10000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  return c;
}

/* A session with a mesh gpu=2, a stream, and full(value) of shape [2] on it. */
typedef struct {
  meshd_session_t *s;
  meshd_ref_t mesh, slice, stream, x;
} world_t;

static world_t world(meshd_client_t *c, double value) {
  world_t w = {0};
  w.s = meshd_session_open(c, "c-sessions", NULL);
  cr_assert_not_null(w.s, "%s", meshd_last_error(c)->message);
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {2}, at0[] = {0}, shape[] = {2};
  cr_assert_eq(meshd_session_create_mesh(w.s, dims, sizes, 1, &w.mesh), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_slice_mesh(w.s, w.mesh, dims, at0, 1, &w.slice), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_stream(w.s, "side", &w.stream), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_factory(w.s, w.mesh, "full", shape, 1, value, &w.x), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  return w;
}

/* The call was refused by the client, naming `what`. */
#define expect_refused(c, call, what)                                                        \
  do {                                                                                       \
    meshd_err_t r_ = (call);                                                                 \
    cr_expect_eq(r_, MESHD_E_INVALID, "%s: got %s (%s), want MESHD_E_INVALID", #call,       \
                 meshd_strerror(r_), r_ ? meshd_last_error(c)->message : "no error");        \
    if (r_ == MESHD_E_INVALID) {                                                             \
      cr_expect(strstr(meshd_last_error(c)->message, "another session") &&                  \
                    strstr(meshd_last_error(c)->message, what),                              \
                "%s: %s", #call, meshd_last_error(c)->message);                              \
    }                                                                                        \
  } while (0)

static double first_value(meshd_client_t *c, meshd_session_t *s, meshd_ref_t t) {
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, t, dims, at0, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_geq(v.n, 1);
  double x = v.values[0];
  meshd_values_free(&v);
  return x;
}

Test(c_sessions, objects_of_another_session_are_refused) {
  meshd_client_t *c = connect_ok();
  world_t a = world(c, 1.0), b = world(c, 10.0);
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0}, shape[] = {2};
  float data[2] = {3, 3};
  meshd_ref_t out = 0, out2 = 0;

  /* Call arguments: a + b.x was a.x + a.x (2, not 11), without an error. */
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = a.x}, {.type = MESHD_ARG_REF, .ref = b.x}};
  expect_refused(c, meshd_session_call(a.s, "add", args, 2, &out), "argument 1");
  expect_refused(c, meshd_session_factory(a.s, b.mesh, "ones", shape, 1, 0, &out), "mesh");
  expect_refused(c, meshd_session_slice_mesh(a.s, b.mesh, dims, at0, 1, &out), "parent");
  expect_refused(c, meshd_session_reduce(a.s, b.x, "gpu", "sum", &out), "input");
  expect_refused(c, meshd_session_reduce_onto(a.s, a.x, "gpu", "sum", b.slice, &out), "mesh");
  expect_refused(c, meshd_session_to_mesh(a.s, a.x, b.mesh, &out), "mesh");
  expect_refused(c, meshd_session_to_mesh(a.s, b.x, a.mesh, &out), "input");
  expect_refused(c, meshd_session_borrow(a.s, a.x, b.stream, false, &out, &out2), "stream");
  expect_refused(c, meshd_session_borrow(a.s, b.x, a.stream, false, &out, &out2), "input");
  expect_refused(c, meshd_session_upload(a.s, b.mesh, "float32", shape, 1, data, sizeof data, &out),
                 "mesh");
  meshd_upload_options_t uo = MESHD_UPLOAD_OPTIONS_INIT;
  uo.stream = b.stream;
  expect_refused(c, meshd_session_upload_with(a.s, a.mesh, "float32", shape, 1, data, sizeof data,
                                              &uo, &out),
                 "stream");
  expect_refused(c, meshd_session_literal(a.s, b.mesh, "float32", shape, 1, data, sizeof data,
                                          NULL, &out),
                 "mesh");
  meshd_load_options_t lo = {.dtype = "float32", .shape = shape, .ndim = 1};
  expect_refused(c, meshd_session_load(a.s, b.mesh, "http://127.0.0.1:9/none.bin", &lo, &out), "mesh");
  meshd_load_progress_t lp;
  expect_refused(c, meshd_session_load_progress(a.s, &b.x, 1, &lp), "refs[0]");
  meshd_values_t v;
  expect_refused(c, meshd_session_fetch(a.s, b.x, dims, at0, 1, &v), "tensor");
  float buf[2];
  meshd_fetch_part_t part = {dims, at0, 1, buf, sizeof buf, 0};
  expect_refused(c, meshd_session_fetch_bytes(a.s, b.x, &part, 1, NULL), "tensor");
  meshd_ref_t both[2] = {a.x, b.x};
  expect_refused(c, meshd_session_drop(a.s, both, 2), "refs[1]");
  expect_refused(c, meshd_session_release(a.s, &b.x, 1), "refs[0]");

  /* Nothing of a's was touched: a.x is still 1, b.x still 10. */
  cr_assert_eq(meshd_session_sync(a.s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_expect_float_eq(first_value(c, a.s, a.x), 1.0, 1e-9);
  cr_expect_float_eq(first_value(c, b.s, b.x), 10.0, 1e-9);
  /* ...and each session's own objects still work. */
  meshd_arg_t own[2] = {{.type = MESHD_ARG_REF, .ref = a.x}, {.type = MESHD_ARG_FLOAT, .f = 2}};
  cr_assert_eq(meshd_session_call(a.s, "add", own, 2, &out), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_expect_float_eq(first_value(c, a.s, out), 3.0, 1e-9);
  cr_assert_eq(meshd_session_to_mesh(b.s, b.x, b.mesh, &out), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_expect_float_eq(first_value(c, b.s, out), 10.0, 1e-9);
  meshd_session_close(b.s);
  meshd_session_close(a.s);
  meshd_close(c);
}

/* The same with a pipeline on: the refusal comes at the call, nothing is queued. */
Test(c_sessions, objects_of_another_session_are_refused_pipelined) {
  meshd_client_t *c = connect_ok();
  world_t a = world(c, 1.0), b = world(c, 10.0);
  cr_assert_eq(meshd_session_set_pipeline(a.s, &(meshd_pipeline_options_t)MESHD_PIPELINE_OPTIONS_INIT),
               MESHD_E_OK);
  meshd_ref_t out = 0;
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = a.x}, {.type = MESHD_ARG_REF, .ref = b.x}};
  expect_refused(c, meshd_session_call(a.s, "add", args, 2, &out), "argument 1");
  expect_refused(c, meshd_session_drop(a.s, &b.x, 1), "refs[0]");
  expect_refused(c, meshd_session_drop_borrow(a.s, b.x), "borrow");
  cr_assert_eq(meshd_session_sync(a.s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_expect_float_eq(first_value(c, a.s, a.x), 1.0, 1e-9);
  meshd_session_close(b.s);
  meshd_session_close(a.s);
  meshd_close(c);
}

/* DESIGN.md section 6: unknown dtype -> BAD_ARGUMENT, a shard dim the mesh lacks -> BAD_DIM. */
Test(c_sessions, unknown_dtype_and_bad_shard_dim_have_their_kinds) {
  meshd_client_t *c = connect_ok();
  world_t a = world(c, 1.0);
  int64_t shape[] = {2};
  float data[2] = {1, 2};
  meshd_ref_t out = 0;
  cr_expect_eq(meshd_session_upload(a.s, a.mesh, "float33", shape, 1, data, sizeof data, &out),
               MESHD_E_INVALID);
  cr_expect_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT", "%s", meshd_last_error(c)->message);
  cr_expect_eq(meshd_session_literal(a.s, a.mesh, "complex64", shape, 1, data, sizeof data, NULL,
                                     &out),
               MESHD_E_INVALID);
  cr_expect_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT", "%s", meshd_last_error(c)->message);
  meshd_load_options_t lo = {.dtype = "float33", .shape = shape, .ndim = 1};
  cr_expect_eq(meshd_session_load(a.s, a.mesh, "http://127.0.0.1:9/none.bin", &lo, &out), MESHD_E_INVALID);
  cr_expect_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT", "%s", meshd_last_error(c)->message);
  lo = (meshd_load_options_t){.dtype = "float32", .shape = shape, .ndim = 1, .shard = "nodim"};
  cr_expect_neq(meshd_session_load(a.s, a.mesh, "http://127.0.0.1:9/none.bin", &lo, &out), MESHD_E_OK);
  cr_expect_str_eq(meshd_last_error(c)->kind, "BAD_DIM", "%s", meshd_last_error(c)->message);
  meshd_session_close(a.s);
  meshd_close(c);
}
