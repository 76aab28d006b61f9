/* core/platform/reflection_index: every kind of name is found in the file that
 * defines it, a file comes with its imports (transitively, each once), unknown
 * names and broken sets are refused. Two sets: meshd's own, as the daemons
 * embed it, and fixtures/reflection/refl/ for what meshd's protos lack
 * (nested messages, extensions). */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"
#include "command_service.h"
#include "data_service.h"
#include "load_service.h"
#include "reflection.h"
#include "reflection_index.h"
#include "session_service.h"
#include "tensor_service.h"

extern const unsigned char reflection_fixture_set[];
extern const size_t reflection_fixture_set_len;

static refl_index_t *ix;

static void meshd_set(void) {
  char err[256] = "";
  ix = refl_index_create(meshd_descriptor_set, meshd_descriptor_set_len, err, sizeof err);
  cr_assert_not_null(ix, "%s", err);
}

static void fixture_set(void) {
  char err[256] = "";
  ix = refl_index_create(reflection_fixture_set, reflection_fixture_set_len, err, sizeof err);
  cr_assert_not_null(ix, "%s", err);
}

static void done(void) {
  refl_index_destroy(ix);
  ix = NULL;
}

static const char *file_name(int f) { return refl_index_file(ix, f, NULL, NULL); }

/* The one file defining `name`, which must be a `kind`. */
static const char *defined_in(const char *name, refl_symbol_kind_t kind) {
  int files[8];
  refl_symbol_kind_t got = REFL_PACKAGE;
  size_t n = refl_index_find_symbol(ix, name, files, 8, &got);
  cr_assert_eq(n, 1, "%s: %zu files define it", name, n);
  cr_assert_eq(got, kind, "%s is a %s, not a %s", name, refl_symbol_kind_name(got),
               refl_symbol_kind_name(kind));
  return file_name(files[0]);
}

static void expect_closure(const char *file, const char *const *want, size_t nwant) {
  int root = refl_index_find_file(ix, file);
  cr_assert_geq(root, 0, "%s", file);
  int out[64];
  cr_assert_leq(refl_index_files(ix), 64);
  size_t n = refl_index_closure(ix, &root, 1, out);
  cr_assert_eq(n, nwant, "%s: %zu files, want %zu", file, n, nwant);
  for (size_t i = 0; i < n; i++) cr_assert_str_eq(file_name(out[i]), want[i], "file %zu", i);
}

TestSuite(reflection_meshd, .init = meshd_set, .fini = done);

Test(reflection_meshd, holds_every_api_file) {
  static const char *const files[] = {
      "grpc/health/v1/health.proto",          "meshd/v1/tensor_service.proto",
      "meshd/v1/agent_registry.proto",        "meshd/agent/v1/agent.proto",
      "grpc/reflection/v1/reflection.proto",  "grpc/reflection/v1alpha/reflection.proto"};
  cr_assert_eq(refl_index_files(ix), sizeof files / sizeof files[0]);
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
    int f = refl_index_find_file(ix, files[i]);
    cr_assert_geq(f, 0, "%s", files[i]);
    const uint8_t *bytes = NULL;
    size_t len = 0;
    cr_assert_str_eq(refl_index_file(ix, f, &bytes, &len), files[i]);
    cr_assert(bytes && len > 0);
  }
}

Test(reflection_meshd, finds_every_kind_of_name) {
  const char *ts = "meshd/v1/tensor_service.proto";
  cr_assert_str_eq(defined_in("meshd.v1.TensorService", REFL_SERVICE), ts);
  cr_assert_str_eq(defined_in("meshd.v1.TensorService.Submit", REFL_METHOD), ts);
  cr_assert_str_eq(defined_in("meshd.v1.Command", REFL_MESSAGE), ts);
  cr_assert_str_eq(defined_in(".meshd.v1.Command", REFL_MESSAGE), ts);
  cr_assert_str_eq(defined_in("meshd.v1.Command.seq", REFL_FIELD), ts);
  cr_assert_str_eq(defined_in("meshd.v1.Command.kind", REFL_ONEOF), ts);
  cr_assert_str_eq(defined_in("meshd.v1.TensorState", REFL_ENUM), ts);
  /* Enum values are siblings of their enum, and found under it too. */
  cr_assert_str_eq(defined_in("meshd.v1.TENSOR_STATE_LIVE", REFL_ENUM_VALUE), ts);
  cr_assert_str_eq(defined_in("meshd.v1.TensorState.TENSOR_STATE_LIVE", REFL_ENUM_VALUE), ts);
  const char *h = "grpc/health/v1/health.proto";
  cr_assert_str_eq(defined_in("grpc.health.v1.HealthCheckResponse.ServingStatus", REFL_ENUM), h);
  cr_assert_str_eq(defined_in("grpc.health.v1.HealthCheckResponse.SERVING", REFL_ENUM_VALUE), h);
  cr_assert_str_eq(defined_in("grpc.health.v1.Health.Watch", REFL_METHOD), h);
  cr_assert_str_eq(defined_in("meshd.agent.v1.Agent", REFL_SERVICE), "meshd/agent/v1/agent.proto");
  cr_assert_str_eq(defined_in("meshd.v1.AgentRegistry", REFL_SERVICE), "meshd/v1/agent_registry.proto");
  cr_assert_str_eq(defined_in("grpc.reflection.v1.ServerReflection.ServerReflectionInfo", REFL_METHOD),
                   "grpc/reflection/v1/reflection.proto");
  cr_assert_str_eq(defined_in("grpc.reflection.v1alpha.ServerReflectionResponse", REFL_MESSAGE),
                   "grpc/reflection/v1alpha/reflection.proto");

  /* meshd.v1 is spread over two files: both. */
  int files[8];
  refl_symbol_kind_t kind;
  size_t n = refl_index_find_symbol(ix, "meshd.v1", files, 8, &kind);
  cr_assert_eq(n, 2);
  cr_assert_eq(kind, REFL_PACKAGE);
  cr_assert_str_neq(file_name(files[0]), file_name(files[1]));
}

/* Every method the daemons register is described, so grpcurl can call it. */
Test(reflection_meshd, describes_every_method_the_daemons_serve) {
  const rpc_method_t *(*tables[])(size_t *) = {tensor_service_methods, session_service_methods,
                                               command_service_methods, data_service_methods,
                                               load_service_methods, agent_service_methods};
  size_t total = 0;
  for (size_t t = 0; t < sizeof tables / sizeof tables[0]; t++) {
    size_t n;
    const rpc_method_t *rows = tables[t](&n);
    for (size_t i = 0; i < n; i++, total++) {
      char name[256];
      snprintf(name, sizeof name, "%s", rows[i].path + 1); /* "/pkg.Svc/M" -> "pkg.Svc.M" */
      *strrchr(name, '/') = '.';
      defined_in(name, REFL_METHOD);
    }
  }
  cr_assert_gt(total, 20);
}

Test(reflection_meshd, closure_brings_imports_once) {
  static const char *const agent[] = {"meshd/agent/v1/agent.proto", "meshd/v1/tensor_service.proto"};
  expect_closure(agent[0], agent, 2);
  static const char *const ts[] = {"meshd/v1/tensor_service.proto"};
  expect_closure(ts[0], ts, 1);
}

Test(reflection_meshd, refuses_unknown_names) {
  static const char *const unknown[] = {"meshd.v1.Nope", "meshd.v", "meshd", "", ".",
                                        "meshd.v1.TensorService.Submit.x", "TensorService",
                                        "meshd.v1.TensorService/Submit", "meshd.v1.command"};
  int files[4];
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++)
    cr_assert_eq(refl_index_find_symbol(ix, unknown[i], files, 4, NULL), 0, "'%s'", unknown[i]);
  cr_assert_eq(refl_index_find_file(ix, "tensor_service.proto"), -1);
  cr_assert_eq(refl_index_find_file(ix, "meshd/v1/nope.proto"), -1);
  cr_assert_eq(refl_index_find_extension(ix, "meshd.v1.Command", 100), -1);
  cr_assert_eq(refl_index_extension_numbers(ix, "meshd.v1.Command", NULL, 0), 0);
}

TestSuite(reflection_fixture, .init = fixture_set, .fini = done);

Test(reflection_fixture, finds_nested_names_and_extensions) {
  const char *base = "refl/base.proto", *mid = "refl/mid.proto";
  cr_assert_str_eq(defined_in("refl.base.Base.Inner", REFL_MESSAGE), base);
  cr_assert_str_eq(defined_in("refl.base.Base.Inner.Deeper", REFL_MESSAGE), base);
  cr_assert_str_eq(defined_in("refl.base.Base.Inner.Deeper.c", REFL_FIELD), base);
  cr_assert_str_eq(defined_in("refl.base.Base.pick", REFL_ONEOF), base);
  cr_assert_str_eq(defined_in("refl.base.Base.b", REFL_FIELD), base);
  cr_assert_str_eq(defined_in("refl.base.Base.Color", REFL_ENUM), base);
  cr_assert_str_eq(defined_in("refl.base.Base.GREEN", REFL_ENUM_VALUE), base);
  cr_assert_str_eq(defined_in("refl.base.TOP_ZERO", REFL_ENUM_VALUE), base);
  cr_assert_str_eq(defined_in("refl.app.level", REFL_EXTENSION), mid);
  cr_assert_str_eq(defined_in("refl.app.Mid.Ext.tag", REFL_EXTENSION), mid);
  cr_assert_str_eq(defined_in("refl.app.App.Do", REFL_METHOD), "refl/app.proto");

  cr_assert_str_eq(file_name(refl_index_find_extension(ix, "refl.base.Base", 100)), mid);
  cr_assert_str_eq(file_name(refl_index_find_extension(ix, ".refl.base.Base", 101)), mid);
  cr_assert_eq(refl_index_find_extension(ix, "refl.base.Base", 102), -1);
  cr_assert_eq(refl_index_find_extension(ix, "refl.app.Mid", 100), -1);
  int32_t nums[4] = {0};
  cr_assert_eq(refl_index_extension_numbers(ix, "refl.base.Base", nums, 4), 2);
  cr_assert((nums[0] == 100 && nums[1] == 101) || (nums[0] == 101 && nums[1] == 100));
  cr_assert_eq(refl_index_extension_numbers(ix, "refl.base.Base", nums, 1), 2, "counts past cap");
}

Test(reflection_fixture, closure_is_transitive_and_lists_each_file_once) {
  /* app imports base and mid; mid imports base again. */
  static const char *const app[] = {"refl/app.proto", "refl/base.proto", "refl/mid.proto"};
  expect_closure(app[0], app, 3);
  static const char *const mid[] = {"refl/mid.proto", "refl/base.proto"};
  expect_closure(mid[0], mid, 2);

  /* A package over two files, as roots: each once, then their imports. */
  int roots[4], out[8];
  size_t n = refl_index_find_symbol(ix, "refl.app", roots, 4, NULL);
  cr_assert_eq(n, 2);
  roots[2] = roots[0];
  roots[3] = 99; /* out of range: skipped */
  cr_assert_eq(refl_index_closure(ix, roots, 4, out), 3);
  cr_assert_str_eq(file_name(out[2]), "refl/base.proto");
}

/* --- sets the index refuses ------------------------------------------------ */

static void expect_refused(const uint8_t *set, size_t len, const char *needle) {
  char err[256] = "";
  refl_index_t *bad = refl_index_create(set, len, err, sizeof err);
  cr_assert_null(bad, "accepted a broken set (%s)", needle);
  cr_assert(strstr(err, needle), "error '%s' lacks '%s'", err, needle);
}

/* One FileDescriptorSet entry: field 1, length-delimited (lengths < 16384). */
static size_t put_file(uint8_t *out, const uint8_t *bytes, size_t len) {
  size_t n = 0;
  out[n++] = 0x0a;
  if (len >= 128) out[n++] = (uint8_t)(len | 0x80), out[n++] = (uint8_t)(len >> 7);
  else out[n++] = (uint8_t)len;
  memcpy(out + n, bytes, len);
  return n + len;
}

Test(reflection_fixture, refuses_broken_sets) {
  static const uint8_t junk[] = {0x12, 0x01, 0x00};
  expect_refused(junk, sizeof junk, "byte 0");
  static const uint8_t cut[] = {0x0a, 0x05, 0x0a};
  expect_refused(cut, sizeof cut, "byte 0");
  static const uint8_t not_a_file[] = {0x0a, 0x02, 0xff, 0xff};
  expect_refused(not_a_file, sizeof not_a_file, "file #1 is not a valid FileDescriptorProto");
  static const uint8_t nameless[] = {0x0a, 0x02, 0x12, 0x00};
  expect_refused(nameless, sizeof nameless, "file #1 has no name");

  /* The same file twice; a file without its imports. */
  uint8_t set[4096];
  const uint8_t *bytes;
  size_t len;
  int app = refl_index_find_file(ix, "refl/app.proto");
  refl_index_file(ix, refl_index_find_file(ix, "refl/base.proto"), &bytes, &len);
  cr_assert_lt(2 * (len + 3), sizeof set);
  size_t n = put_file(set, bytes, len);
  n += put_file(set + n, bytes, len);
  expect_refused(set, n, "two files are named refl/base.proto");
  refl_index_file(ix, app, &bytes, &len);
  n = put_file(set, bytes, len);
  expect_refused(set, n, "refl/app.proto imports refl/base.proto, which the set does not hold");

  /* The empty set is a set. */
  char err[64];
  refl_index_t *empty = refl_index_create(set, 0, err, sizeof err);
  cr_assert_not_null(empty);
  cr_assert_eq(refl_index_files(empty), 0);
  cr_assert_eq(refl_index_find_symbol(empty, "x", NULL, 0, NULL), 0);
  refl_index_destroy(empty);
}
