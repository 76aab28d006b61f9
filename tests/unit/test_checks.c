/* server/checks: Monarch's InputChecker (check_tensor, check_uses). */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "borrow.h"
#include "checks.h"

static objects_t *o;
static meshd_error_t err;

/* Meshes: 1 = {host: 2, gpu: 4}, 2 = {gpu: 4} (ranks 4..7). Streams: 3 "side". */
#define ROOT 1
#define SUB 2
#define SIDE 3

static void setup(void) {
  o = objects_create();
  cr_assert_not_null(o);
  memset(&err, 0, sizeof err);
  bool healthy[8];
  for (int i = 0; i < 8; i++) healthy[i] = true;
  mesh_t root, sub;
  cr_assert_eq(mesh_create_root(ROOT, (const char *const[]){"host", "gpu"}, (const int64_t[]){2, 4},
                                2, healthy, 8, &root, &err),
               0, "%s", err.msg);
  mesh_selector_t sel = {.dim = "host", .index = 1};
  cr_assert_eq(mesh_slice(&root, SUB, &sel, 1, &sub, &err), 0, "%s", err.msg);
  cr_assert_not_null(objects_add_mesh(o, ROOT, &root));
  cr_assert_not_null(objects_add_mesh(o, SUB, &sub));
  cr_assert_not_null(objects_add_stream(o, SIDE, "side"));
}

static void teardown(void) { objects_destroy(o); }

TestSuite(checks, .init = setup, .fini = teardown, .timeout = 30);

static obj_t *tensor(uint64_t ref, uint64_t mesh, uint64_t stream) {
  tensor_meta_t m = {.dtype = DTYPE_FLOAT32};
  cr_assert_eq(layout_contiguous(&m.layout, (const int64_t[]){2, 2}, 2, 4, "test", &err), 0);
  obj_t *t = objects_new_tensor(o, ref, &m, mesh, stream, mesh_len(objects_get(o, mesh)->mesh));
  cr_assert_not_null(t);
  return t;
}

static void expect_null(const void *got, error_kind_t kind, const char *needle) {
  cr_assert_null(got);
  cr_assert_eq(err.kind, kind, "kind %s: %s", error_kind_name(err.kind), err.msg);
  cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
}

static void expect_err(int rc, error_kind_t kind, const char *needle) {
  cr_assert_eq(rc, -1);
  cr_assert_eq(err.kind, kind, "kind %s: %s", error_kind_name(err.kind), err.msg);
  cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
}

#define USES(...) ((const tensor_use_t[]){__VA_ARGS__})
#define NUSES(...) (sizeof USES(__VA_ARGS__) / sizeof(tensor_use_t))
/* check_uses on the command's stream, mesh inferred from the first tensor. */
#define CHECK_USES(stream, ...) check_uses(o, "Call add", USES(__VA_ARGS__), NUSES(__VA_ARGS__), &mesh, stream, &err)

/* ------------------------------------------------------------------ check_tensor */

Test(checks, check_tensor_finds_live_and_failed_tensors) {
  obj_t *t = tensor(10, ROOT, STREAM_MAIN);
  cr_assert_eq(check_tensor(o, "Call add", "argument 'self'", 10, &err), t);
  objects_fail_tensor(o, t, 11, ERR_REMOTE_FAILURE, 11, "boom");
  cr_assert_eq(check_tensor(o, "Call add", "argument 'self'", 10, &err), t,
               "failed tensors pass: their readers fail at run time");
}

Test(checks, check_tensor_unknown_ref) {
  expect_null(check_tensor(o, "Call add", "argument 'other'", 99, &err), ERR_UNKNOWN_REF,
              "Call add: argument 'other' is ref 99, which this session never defined");
  expect_null(check_tensor(o, "Reduce", "input", 0, &err), ERR_UNKNOWN_REF,
              "Reduce: input is ref 0, which this session never defined");
}

Test(checks, check_tensor_wrong_kind_is_unknown_ref) {
  expect_null(check_tensor(o, "Call add", "argument 'self'", ROOT, &err), ERR_UNKNOWN_REF,
              "Call add: argument 'self' is ref 1, which is a mesh, not a tensor");
  expect_null(check_tensor(o, "ToMesh", "input", SIDE, &err), ERR_UNKNOWN_REF,
              "ToMesh: input is ref 3, which is a stream, not a tensor");
  obj_t *t = tensor(10, ROOT, STREAM_MAIN);
  cr_assert_eq(borrow_create(o, 12, 11, t, SIDE, false, &err), 0, "%s", err.msg);
  expect_null(check_tensor(o, "Call neg", "argument 'self'", 12, &err), ERR_UNKNOWN_REF,
              "Call neg: argument 'self' is ref 12, which is a borrow, not a tensor");
}

Test(checks, check_tensor_dropped_names_the_seq) {
  obj_t *t = tensor(10, ROOT, STREAM_MAIN);
  objects_drop_storage(o, t->tensor.storage, 42);
  expect_null(check_tensor(o, "Call add", "argument 'self'", 10, &err), ERR_DROPPED,
              "Call add: argument 'self' (tensor 10) was dropped at command seq 42 and can no "
              "longer be used");
}

Test(checks, check_tensor_dropped_borrow_handle) {
  obj_t *t = tensor(10, ROOT, STREAM_MAIN);
  cr_assert_eq(borrow_create(o, 12, 11, t, SIDE, false, &err), 0, "%s", err.msg);
  cr_assert_eq(borrow_drop(o, objects_get(o, 12), 30, &err), 0, "%s", err.msg);
  expect_null(check_tensor(o, "Call neg", "argument 'self'", 11, &err), ERR_DROPPED,
              "Call neg: argument 'self' (tensor 11) was dropped at command seq 30, when its "
              "borrow 12 was dropped; borrow the tensor again to use it on this stream");
  cr_assert_eq(check_tensor(o, "Call neg", "argument 'self'", 10, &err), t,
               "the origin is usable again");
}

Test(checks, check_tensor_handle_dropped_by_drop_does_not_blame_the_borrow) {
  /* The client dropped the handle itself (Drop at seq 20); its borrow is still
   * live, so the message must not say the borrow was dropped. */
  obj_t *t = tensor(10, ROOT, STREAM_MAIN);
  cr_assert_eq(borrow_create(o, 12, 11, t, SIDE, false, &err), 0, "%s", err.msg);
  objects_drop_storage(o, objects_get(o, 11)->tensor.storage, 20);
  expect_null(check_tensor(o, "Call neg", "argument 'self'", 11, &err), ERR_DROPPED,
              "Call neg: argument 'self' (tensor 11) was dropped at command seq 20");
  cr_assert_null(strstr(err.msg, "borrow 12 was dropped"), "message: %s", err.msg);
}

/* ------------------------------------------------------------------ check_uses */

Test(checks, check_uses_fills_the_mesh_from_the_first_tensor) {
  obj_t *a = tensor(10, SUB, STREAM_MAIN), *b = tensor(11, SUB, STREAM_MAIN);
  uint64_t mesh = 0;
  cr_assert_eq(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", false}, {b, "argument 'other'", true}), 0,
               "%s", err.msg);
  cr_assert_eq(mesh, SUB);
  mesh = SUB;
  cr_assert_eq(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", false}), 0, "%s", err.msg);
  cr_assert_eq(mesh, SUB, "a given mesh is kept");
  mesh = 0;
  cr_assert_eq(check_uses(o, "Call add", NULL, 0, &mesh, STREAM_MAIN, &err), 0);
  cr_assert_eq(mesh, 0);
}

Test(checks, wrong_mesh_names_both_tensors_and_meshes) {
  obj_t *a = tensor(10, ROOT, STREAM_MAIN), *b = tensor(11, SUB, STREAM_MAIN);
  uint64_t mesh = 0;
  expect_err(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", false}, {b, "argument 'other'", false}),
             ERR_WRONG_MESH,
             "Call add: argument 'other' (tensor 11) is on mesh 2 {gpu: 4} but argument 'self' "
             "(tensor 10) is on mesh 1 {host: 2, gpu: 4}");
  cr_assert(strstr(err.msg, "to_mesh"), "the fix: %s", err.msg);
  /* the command's own mesh (no first tensor to name) */
  mesh = ROOT;
  expect_err(CHECK_USES(STREAM_MAIN, {b, "input", false}), ERR_WRONG_MESH,
             "Call add: input (tensor 11) is on mesh 2 {gpu: 4} but the command runs on mesh 1 "
             "{host: 2, gpu: 4}; move it with to_mesh");
}

Test(checks, wrong_stream_names_both_streams_and_the_fix) {
  obj_t *a = tensor(10, ROOT, SIDE);
  uint64_t mesh = 0;
  expect_err(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", false}), ERR_WRONG_STREAM,
             "Call add: argument 'self' (tensor 10) is on stream 'side' but the command runs on "
             "stream 'main'; borrow it onto 'main' first, or run the command on 'side'");
  obj_t *b = tensor(11, ROOT, STREAM_MAIN);
  mesh = 0;
  expect_err(CHECK_USES(SIDE, {a, "argument 'self'", false}, {b, "argument 'other'", false}),
             ERR_WRONG_STREAM, "argument 'other' (tensor 11) is on stream 'main' but the command runs on stream 'side'");
}

Test(checks, mutably_borrowed_origin_is_borrowed) {
  obj_t *a = tensor(10, ROOT, STREAM_MAIN);
  tensor_meta_t am;
  obj_t *v = objects_new_view(o, 11, obj_meta(a, &am), a);
  cr_assert_eq(borrow_create(o, 13, 12, a, SIDE, true, &err), 0, "%s", err.msg);
  uint64_t mesh = 0;
  expect_err(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", false}), ERR_BORROWED,
             "Call add: argument 'self' (tensor 10) is mutably borrowed (borrow 13); it cannot be "
             "used until the borrow is dropped");
  mesh = 0;
  expect_err(CHECK_USES(STREAM_MAIN, {v, "argument 'other'", false}), ERR_BORROWED,
             "argument 'other' (tensor 11) is mutably borrowed (borrow 13)");
  /* the handle is rw on its stream */
  mesh = 0;
  cr_assert_eq(CHECK_USES(SIDE, {objects_get(o, 12), "argument 'self'", true}), 0, "%s", err.msg);
  /* after the drop, the origin is usable again, for writing too */
  cr_assert_eq(borrow_drop(o, objects_get(o, 13), 20, &err), 0);
  mesh = 0;
  cr_assert_eq(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", true}), 0, "%s", err.msg);
}

Test(checks, writing_an_origin_under_a_read_borrow_is_mutating_borrow) {
  obj_t *a = tensor(10, ROOT, STREAM_MAIN);
  cr_assert_eq(borrow_create(o, 12, 11, a, SIDE, false, &err), 0, "%s", err.msg);
  uint64_t mesh = 0;
  cr_assert_eq(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", false}), 0, "reading is fine: %s", err.msg);
  mesh = 0;
  expect_err(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", true}), ERR_MUTATING_BORROW,
             "Call add: argument 'self' (tensor 10) cannot be mutated while it (or a view of it) "
             "is borrowed for reading (borrow 12); drop the borrow first");
}

Test(checks, writing_a_read_only_handle_is_mutating_borrow) {
  obj_t *a = tensor(10, ROOT, STREAM_MAIN);
  cr_assert_eq(borrow_create(o, 12, 11, a, SIDE, false, &err), 0, "%s", err.msg);
  obj_t *h = objects_get(o, 11);
  uint64_t mesh = 0;
  cr_assert_eq(CHECK_USES(SIDE, {h, "argument 'self'", false}), 0, "%s", err.msg);
  mesh = 0;
  expect_err(CHECK_USES(SIDE, {h, "argument 'self'", true}), ERR_MUTATING_BORROW,
             "Call add: argument 'self' (tensor 11) is a read-only borrow (borrow 12) and cannot "
             "be mutated; borrow it with mutable=True to write to it");
}

Test(checks, writing_a_mutable_handle_under_a_read_borrow_names_that_borrow) {
  obj_t *a = tensor(10, ROOT, STREAM_MAIN);
  cr_assert_eq(borrow_create(o, 12, 11, a, SIDE, true, &err), 0, "%s", err.msg);
  obj_t *h = objects_get(o, 11);
  cr_assert_eq(borrow_create(o, 14, 13, h, STREAM_MAIN, false, &err), 0, "%s", err.msg);
  uint64_t mesh = 0;
  expect_err(CHECK_USES(SIDE, {h, "argument 'self'", true}), ERR_MUTATING_BORROW,
             "(tensor 11) cannot be mutated while it (or a view of it) is borrowed for reading "
             "(borrow 14)");
}

Test(checks, failed_tensors_pass) {
  obj_t *a = tensor(10, ROOT, STREAM_MAIN), *b = tensor(11, ROOT, STREAM_MAIN);
  objects_fail_tensor(o, a, 5, ERR_REMOTE_FAILURE, 5, "boom");
  uint64_t mesh = 0;
  cr_assert_eq(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", true}, {b, "argument 'other'", false}),
               0, "%s", err.msg);
  cr_assert_eq(mesh, ROOT);
}

Test(checks, the_first_failing_use_is_reported) {
  /* a is on the wrong stream, b on the wrong mesh: the check reports the first
   * tensor's problem (in argument order). */
  obj_t *a = tensor(10, ROOT, SIDE), *b = tensor(11, SUB, STREAM_MAIN);
  uint64_t mesh = 0;
  expect_err(CHECK_USES(STREAM_MAIN, {a, "argument 'self'", false}, {b, "argument 'other'", false}),
             ERR_WRONG_STREAM, "argument 'self' (tensor 10)");
}
