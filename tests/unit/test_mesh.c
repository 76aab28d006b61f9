/* server/mesh: named meshes, root allocation from the pool, slicing. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mesh.h"

static meshd_error_t err;
static bool all_healthy[64];

static void init_healthy(void) {
  for (size_t i = 0; i < sizeof all_healthy; i++) all_healthy[i] = true;
  memset(&err, 0, sizeof err);
}

TestSuite(mesh, .init = init_healthy);

#define NAMES(...) ((const char *const[]){__VA_ARGS__})
#define I64(...) ((const int64_t[]){__VA_ARGS__})

/* {host: 2, gpu: 4} over 8 healthy agents. */
static mesh_t host_gpu(void) {
  mesh_t m;
  cr_assert_eq(mesh_create_root(1, NAMES("host", "gpu"), I64(2, 4), 2, all_healthy, 8, &m, &err), 0,
               "%s", err.msg);
  return m;
}

static void expect_ranks(const mesh_t *m, const uint32_t *want, size_t n) {
  uint32_t got[64];
  cr_assert_eq(mesh_len(m), n, "len %zu, want %zu", mesh_len(m), n);
  cr_assert_eq(mesh_ranks(m, got), n);
  for (size_t i = 0; i < n; i++)
    cr_assert_eq(got[i], want[i], "rank %zu: got %u, want %u", i, got[i], want[i]);
}
#define RANKS(m, ...)                              \
  expect_ranks(m, (const uint32_t[]){__VA_ARGS__}, \
               sizeof((const uint32_t[]){__VA_ARGS__}) / sizeof(uint32_t))

static void expect_err(int rc, error_kind_t kind, const char *needle) {
  cr_assert_eq(rc, -1);
  cr_assert_eq(err.kind, kind, "kind %s, message: %s", error_kind_name(err.kind), err.msg);
  cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
}

static mesh_selector_t idx(const char *dim, int64_t i) {
  return (mesh_selector_t){.dim = dim, .index = i};
}

static mesh_selector_t rng(const char *dim, int64_t start, int64_t stop, int64_t step) {
  return (mesh_selector_t){
      .dim = dim, .is_range = true, .start = start, .stop = stop, .has_stop = true, .step = step};
}

static int slice1(const mesh_t *m, mesh_selector_t s, mesh_t *out) {
  return mesh_slice(m, 2, &s, 1, out, &err);
}

Test(mesh, root_is_dense_over_ranks_0_to_k) {
  mesh_t m = host_gpu();
  char buf[64];
  cr_assert_str_eq(mesh_format(&m, buf, sizeof buf), "{host: 2, gpu: 4}");
  cr_assert_eq(m.ref, 1);
  cr_assert_eq(m.ndim, 2);
  cr_assert_str_eq(m.names[0], "host");
  cr_assert_str_eq(m.names[1], "gpu");
  RANKS(&m, 0, 1, 2, 3, 4, 5, 6, 7);
  cr_assert_eq(mesh_find_dim(&m, "gpu"), 1);
  cr_assert_eq(mesh_find_dim(&m, "host"), 0);
  cr_assert_eq(mesh_find_dim(&m, "gpux"), -1);
  cr_assert_eq(mesh_find_dim(&m, NULL), -1);
  cr_assert_eq(mesh_coord(&m, 5, 0), 1);
  cr_assert_eq(mesh_coord(&m, 5, 1), 1);
  cr_assert_eq(mesh_coord(&m, 8, 0), -1);
  cr_assert_eq(mesh_coord(&m, 5, 2), -1);
}

Test(mesh, root_uses_only_the_first_k_ranks) {
  bool h[16] = {0};
  for (int i = 0; i < 8; i++) h[i] = true;
  mesh_t m;
  cr_assert_eq(mesh_create_root(1, NAMES("gpu"), I64(8), 1, h, 16, &m, &err), 0, "%s", err.msg);
  RANKS(&m, 0, 1, 2, 3, 4, 5, 6, 7);
}

Test(mesh, slice_index_drops_the_dim) {
  mesh_t m = host_gpu(), s;
  cr_assert_eq(slice1(&m, idx("gpu", 1), &s), 0, "%s", err.msg);
  cr_assert_eq(s.ref, 2);
  cr_assert_eq(s.ndim, 1);
  cr_assert_str_eq(s.names[0], "host");
  RANKS(&s, 1, 5);
  char buf[64];
  cr_assert_str_eq(mesh_format(&s, buf, sizeof buf), "{host: 2}");
  cr_assert_eq(mesh_coord(&s, 5, 0), 1);
  cr_assert_eq(mesh_coord(&s, 2, 0), -1);

  cr_assert_eq(slice1(&m, idx("host", 1), &s), 0, "%s", err.msg);
  RANKS(&s, 4, 5, 6, 7);
  cr_assert_str_eq(s.names[0], "gpu");

  cr_assert_eq(slice1(&m, idx("gpu", -1), &s), 0, "%s", err.msg);
  RANKS(&s, 3, 7);
}

Test(mesh, slice_range_keeps_the_dim) {
  mesh_t m = host_gpu(), s;
  cr_assert_eq(slice1(&m, rng("gpu", 1, 4, 2), &s), 0, "%s", err.msg);
  cr_assert_eq(s.ndim, 2);
  cr_assert_eq(s.slice.sizes[0], 2);
  cr_assert_eq(s.slice.sizes[1], 2);
  RANKS(&s, 1, 3, 5, 7); /* [[1,3],[5,7]] */
  char buf[64];
  cr_assert_str_eq(mesh_format(&s, buf, sizeof buf), "{host: 2, gpu: 2}");
  cr_assert_eq(mesh_coord(&s, 7, 1), 1);
  cr_assert_eq(mesh_coord(&s, 7, 0), 1);
  cr_assert_eq(mesh_coord(&s, 3, 1), 1);
  cr_assert_eq(mesh_coord(&s, 2, 1), -1);

  /* no step means 1; no stop means "to the end" (so does a stop past the end) */
  mesh_selector_t open_end = {.dim = "gpu", .is_range = true, .start = 1, .step = 2};
  cr_assert_eq(slice1(&m, open_end, &s), 0, "%s", err.msg);
  RANKS(&s, 1, 3, 5, 7);
  cr_assert_eq(slice1(&m, rng("gpu", 2, INT64_MAX, 0), &s), 0, "%s", err.msg);
  RANKS(&s, 2, 3, 6, 7);
  cr_assert_eq(slice1(&m, rng("gpu", -2, 100, 1), &s), 0, "%s", err.msg);
  RANKS(&s, 2, 3, 6, 7);
}

Test(mesh, slice_several_dims_and_slices_of_slices) {
  mesh_t m = host_gpu(), s, t;
  mesh_selector_t both[] = {idx("host", 1), idx("gpu", 2)};
  cr_assert_eq(mesh_slice(&m, 3, both, 2, &s, &err), 0, "%s", err.msg);
  cr_assert_eq(s.ndim, 0);
  RANKS(&s, 6);
  char buf[16];
  cr_assert_str_eq(mesh_format(&s, buf, sizeof buf), "{}");

  mesh_selector_t mixed[] = {rng("gpu", 1, 4, 2), idx("host", 0)};
  cr_assert_eq(mesh_slice(&m, 3, mixed, 2, &s, &err), 0, "%s", err.msg);
  RANKS(&s, 1, 3);
  cr_assert_str_eq(s.names[0], "gpu");

  cr_assert_eq(slice1(&m, rng("gpu", 1, 4, 2), &s), 0);
  cr_assert_eq(slice1(&s, idx("gpu", 1), &t), 0, "%s", err.msg);
  RANKS(&t, 3, 7);

  /* no selectors: the same ranks under the new ref; in place works */
  cr_assert_eq(mesh_slice(&m, 9, NULL, 0, &s, &err), 0);
  cr_assert_eq(s.ref, 9);
  RANKS(&s, 0, 1, 2, 3, 4, 5, 6, 7);
  s = m;
  cr_assert_eq(slice1(&s, idx("host", 0), &s), 0);
  RANKS(&s, 0, 1, 2, 3);
}

Test(mesh, slice_errors) {
  mesh_t m = host_gpu(), s;
  expect_err(slice1(&m, idx("gpux", 0), &s), ERR_BAD_DIM,
             "SliceMesh: mesh has no dim 'gpux' (dims: host, gpu)");
  mesh_selector_t twice[] = {idx("gpu", 0), rng("gpu", 0, 2, 1)};
  expect_err(mesh_slice(&m, 2, twice, 2, &s, &err), ERR_BAD_DIM, "dim 'gpu' is selected twice");
  expect_err(slice1(&m, idx("", 0), &s), ERR_BAD_DIM, "has no dim name");
  expect_err(slice1(&m, idx(NULL, 0), &s), ERR_BAD_DIM, "has no dim name");
  expect_err(slice1(&m, idx("gpu", 4), &s), ERR_BAD_ARGUMENT,
             "SliceMesh: index 4 is out of range for dim 'gpu' of size 4 (use 0..3");
  expect_err(slice1(&m, idx("host", -3), &s), ERR_BAD_ARGUMENT, "dim 'host' of size 2");
  expect_err(slice1(&m, rng("gpu", 0, 4, -1), &s), ERR_BAD_ARGUMENT,
             "step -1 for dim 'gpu' must be >= 1");
  expect_err(slice1(&m, rng("gpu", 3, 1, 1), &s), ERR_BAD_ARGUMENT,
             "SliceMesh: gpu=3:1:1 selects nothing from dim 'gpu' of size 4");
  mesh_selector_t past_end = {.dim = "gpu", .is_range = true, .start = 4, .step = 1};
  expect_err(slice1(&m, past_end, &s), ERR_BAD_ARGUMENT, "gpu=4::1 selects nothing");
  expect_err(slice1(&m, rng("gpu", 0, 4, 3), &s), ERR_BAD_ARGUMENT, "not rectangular");
  /* a dim sliced away is gone */
  cr_assert_eq(slice1(&m, idx("gpu", 0), &s), 0);
  expect_err(slice1(&s, idx("gpu", 0), &s), ERR_BAD_DIM, "no dim 'gpu' (dims: host)");
  cr_assert_eq(slice1(&s, idx("host", 0), &s), 0);
  expect_err(slice1(&s, idx("host", 0), &s), ERR_BAD_DIM, "dims: none");
}

/* A step is 1..the dim's size: 0 (given), negative or past the size is
 * BAD_ARGUMENT, never read as 1 or as "one rank" (issue 13). */
Test(mesh, slice_steps_run_from_1_to_the_dim_size) {
  mesh_t m = host_gpu(), s;
  mesh_selector_t zero = rng("gpu", 0, 4, 0);
  zero.has_step = true;
  expect_err(slice1(&m, zero, &s), ERR_BAD_ARGUMENT,
             "SliceMesh: step 0 for dim 'gpu' must be >= 1 (leave it out for 1)");
  expect_err(slice1(&m, rng("gpu", 0, 4, INT64_MIN), &s), ERR_BAD_ARGUMENT,
             "step -9223372036854775808 for dim 'gpu' must be >= 1");
  expect_err(slice1(&m, rng("gpu", 0, 4, 5), &s), ERR_BAD_ARGUMENT,
             "SliceMesh: step 5 for dim 'gpu' is beyond the dim's size 4; a step may be at most "
             "the size (to pick one rank, give an index)");
  expect_err(slice1(&m, rng("host", 0, 2, INT64_MAX), &s), ERR_BAD_ARGUMENT,
             "step 9223372036854775807 for dim 'host' is beyond the dim's size 2");
  /* the size itself is a step: one rank, the dim kept */
  cr_assert_eq(slice1(&m, rng("gpu", 1, 4, 4), &s), 0, "%s", err.msg);
  cr_assert_eq(s.ndim, 2);
  RANKS(&s, 1, 5);
  /* a step counts against the dim as sliced so far */
  mesh_selector_t twice[] = {rng("gpu", 0, 2, 1)};
  cr_assert_eq(mesh_slice(&m, 3, twice, 1, &s, &err), 0, "%s", err.msg);
  expect_err(slice1(&s, rng("gpu", 0, 2, 3), &s), ERR_BAD_ARGUMENT, "beyond the dim's size 2");
  /* not given: 1 */
  cr_assert_eq(slice1(&m, rng("gpu", 1, 3, 0), &s), 0, "%s", err.msg);
  RANKS(&s, 1, 2, 5, 6);
}

static int create(const char *const *names, const int64_t *sizes, int n, const bool *h,
                  size_t world) {
  mesh_t m;
  memset(&err, 0, sizeof err);
  return mesh_create_root(1, names, sizes, n, h, world, &m, &err);
}

Test(mesh, create_argument_errors) {
  expect_err(create(NAMES("gpu"), I64(1), 0, all_healthy, 8), ERR_BAD_ARGUMENT,
             "CreateMesh needs at least one dim");
  const char *nine[9] = {"a", "b", "c", "d", "e", "f", "g", "h", "i"};
  int64_t ones[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  expect_err(create(nine, ones, 9, all_healthy, 8), ERR_BAD_ARGUMENT, "9 dims; at most 8");
  cr_assert_eq(create(nine, ones, 8, all_healthy, 8), 0, "%s", err.msg);
  expect_err(create(NAMES("host", ""), I64(2, 4), 2, all_healthy, 8), ERR_BAD_ARGUMENT,
             "dim 1 has an empty name");
  expect_err(create(NAMES("host", NULL), I64(2, 4), 2, all_healthy, 8), ERR_BAD_ARGUMENT,
             "empty name");
  char long_name[40];
  memset(long_name, 'x', 32);
  long_name[32] = '\0';
  expect_err(create(NAMES(long_name), I64(2), 1, all_healthy, 8), ERR_BAD_ARGUMENT,
             "is 32 characters; at most 31");
  long_name[31] = '\0';
  cr_assert_eq(create(NAMES(long_name), I64(2), 1, all_healthy, 8), 0, "%s", err.msg);
  expect_err(create(NAMES("1gpu"), I64(2), 1, all_healthy, 8), ERR_BAD_ARGUMENT,
             "'1gpu' is not an identifier");
  expect_err(create(NAMES("a-b"), I64(2), 1, all_healthy, 8), ERR_BAD_ARGUMENT,
             "not an identifier");
  expect_err(create(NAMES("gpu", "host", "gpu"), I64(2, 2, 2), 3, all_healthy, 8), ERR_BAD_DIM,
             "dim 'gpu' appears twice");
  expect_err(create(NAMES("host", "gpu"), I64(2, 0), 2, all_healthy, 8), ERR_BAD_ARGUMENT,
             "dim 'gpu' has size 0; sizes must be >= 1");
  expect_err(create(NAMES("host", "gpu"), I64(-2, 4), 2, all_healthy, 8), ERR_BAD_ARGUMENT,
             "size -2");
  expect_err(create(NAMES("a", "b", "c"), I64(1 << 20, 1 << 20, 1 << 20), 3, all_healthy, 8),
             ERR_BAD_ARGUMENT, "more than 2^32 ranks");
  expect_err(create(NAMES("a", "b"), I64(INT64_MAX, 4), 2, all_healthy, 8), ERR_BAD_ARGUMENT,
             "more than 2^32 ranks");
  cr_assert_eq(create(NAMES("_x9"), I64(1), 1, all_healthy, 8), 0, "%s", err.msg);
}

Test(mesh, create_needs_healthy_agents) {
  bool h[8] = {true, true, false, true, false, false, false, false};
  expect_err(create(NAMES("host", "gpu"), I64(2, 4), 2, h, 8), ERR_BAD_ARGUMENT,
             "CreateMesh {host: 2, gpu: 4} needs 8 agents (ranks 0..7) but only 3 are healthy: "
             "0, 1, 3 (missing: 2, 4..7); start more agents or ask for a smaller mesh");
  /* the pool is smaller than the mesh */
  expect_err(create(NAMES("host", "gpu"), I64(2, 4), 2, all_healthy, 4), ERR_BAD_ARGUMENT,
             "needs 8 agents (ranks 0..7) but only 4 are healthy: 0..3 (missing: 4..7)");
  expect_err(create(NAMES("gpu"), I64(1), 1, NULL, 0), ERR_BAD_ARGUMENT,
             "CreateMesh {gpu: 1} needs 1 agent (rank 0) but none of them is healthy (missing: 0)");
  bool one_down[2] = {true, false};
  expect_err(create(NAMES("gpu"), I64(2), 1, one_down, 2), ERR_BAD_ARGUMENT,
             "only 1 is healthy: 0 (missing: 1)");
  /* healthy agents past the mesh do not help */
  bool gap[4] = {false, true, true, true};
  expect_err(create(NAMES("gpu"), I64(2), 1, gap, 4), ERR_BAD_ARGUMENT, "(missing: 0)");
}

Test(mesh, create_names_healthy_agents_past_the_mesh) {
  /* One agent started as the README shows (--rank 3) and nothing else: "start more
   * agents or ask for a smaller mesh" alone sent a user looking for a smaller mesh
   * than {gpu: 1}; the message says that rank 3 does not count and why. */
  bool only3[4] = {false, false, false, true};
  expect_err(create(NAMES("gpu"), I64(1), 1, only3, 4), ERR_BAD_ARGUMENT,
             "CreateMesh {gpu: 1} needs 1 agent (rank 0) but none of them is healthy (missing: "
             "0); start more agents or ask for a smaller mesh (1 healthy agent from rank 3 on "
             "does not count: a mesh takes ranks from 0, see meshd-agent --rank)");
  bool gap[5] = {false, true, true, true, true};
  expect_err(create(NAMES("gpu"), I64(2), 1, gap, 5), ERR_BAD_ARGUMENT,
             "only 1 is healthy: 1 (missing: 0); start more agents or ask for a smaller mesh (3 "
             "healthy agents from rank 2 on do not count");
}

Test(mesh, create_message_stays_short_for_big_pools) {
  bool *h = calloc(100000, sizeof *h);
  for (int i = 0; i < 100000; i += 2) h[i] = true; /* every odd rank is down */
  expect_err(create(NAMES("gpu"), I64(1000000), 1, h, 100000), ERR_BAD_ARGUMENT,
             "needs 1000000 agents (ranks 0..999999) but only 50000 are healthy: 0, 2, 4, 6, 8, "
             "10 and 49994 more runs (missing: 1, 3, 5, 7, 9, 11 and 49994 more runs)");
  cr_assert_lt(strlen(err.msg), 400);
  free(h);
}
