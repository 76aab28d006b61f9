/* server/ndslice: Monarch's Slice arithmetic and validation. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "ndslice.h"

static meshd_error_t err;

#define I64(...) ((const int64_t[]){__VA_ARGS__})

static ndslice_t mk(int64_t offset, const int64_t *sizes, const int64_t *strides, int n) {
  ndslice_t s;
  memset(&err, 0, sizeof err);
  cr_assert_eq(ndslice_init(&s, offset, sizes, n, strides, n, &err), 0, "init: %s", err.msg);
  return s;
}

static ndslice_t dense(const int64_t *sizes, int n) {
  ndslice_t s;
  cr_assert_eq(ndslice_dense(&s, sizes, n, &err), 0, "dense: %s", err.msg);
  return s;
}

/* Every rank in row-major order, checked against want[]; also checks get/index. */
static void expect_ranks(const ndslice_t *s, const int64_t *want, int64_t n) {
  cr_assert_eq(ndslice_len(s), n);
  ndslice_iter_t it;
  int64_t r, i = 0;
  for (ndslice_iter_init(&it, s); ndslice_iter_next(&it, &r); i++) {
    cr_assert_lt(i, n, "more ranks than expected");
    cr_assert_eq(r, want[i], "rank %lld: got %lld, want %lld", (long long)i, (long long)r,
                 (long long)want[i]);
    cr_assert_eq(ndslice_get(s, i, &err), want[i]);
    cr_assert_eq(ndslice_index(s, want[i]), i);
    cr_assert(ndslice_contains(s, want[i]));
  }
  cr_assert_eq(i, n, "fewer ranks than expected: %lld", (long long)i);
}

static void expect_err(int rc, error_kind_t kind, const char *needle) {
  cr_assert_eq(rc, -1);
  cr_assert_eq(err.kind, kind, "kind %s, message: %s", error_kind_name(err.kind), err.msg);
  cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
}

static int init_rc(int64_t offset, const int64_t *sizes, int ns, const int64_t *strides, int nt) {
  ndslice_t s;
  memset(&err, 0, sizeof err);
  return ndslice_init(&s, offset, sizes, ns, strides, nt, &err);
}

Test(ndslice, dense_row_major) {
  ndslice_t s = dense(I64(2, 4), 2);
  cr_assert_eq(s.offset, 0);
  cr_assert_eq(s.strides[0], 4);
  cr_assert_eq(s.strides[1], 1);
  expect_ranks(&s, I64(0, 1, 2, 3, 4, 5, 6, 7), 8);
}

Test(ndslice, dense_4x4x4_is_0_to_63) { /* Monarch's doc example */
  ndslice_t s = dense(I64(4, 4, 4), 3);
  cr_assert_eq(s.strides[0], 16);
  cr_assert_eq(s.strides[1], 4);
  cr_assert_eq(s.strides[2], 1);
  int64_t want[64];
  for (int i = 0; i < 64; i++) want[i] = i;
  expect_ranks(&s, want, 64);
}

Test(ndslice, monarch_at_example) {
  /* Slice::new(0, [2,4,2], [8,2,1]).at(1, 3) == Slice::new(6, [2,2], [8,1]) */
  ndslice_t s = mk(0, I64(2, 4, 2), I64(8, 2, 1), 3), sub, at;
  sub = mk(2 * 3, I64(2, 2), I64(8, 1), 2);
  cr_assert_eq(ndslice_at(&s, 1, 3, &at, &err), 0, "%s", err.msg);
  cr_assert_eq(at.offset, sub.offset);
  cr_assert_eq(at.ndim, 2);
  cr_assert_eq(memcmp(at.sizes, sub.sizes, 2 * sizeof(int64_t)), 0);
  cr_assert_eq(memcmp(at.strides, sub.strides, 2 * sizeof(int64_t)), 0);
  for (int x = 0; x < 2; x++)
    for (int y = 0; y < 2; y++)
      cr_assert_eq(ndslice_rank_of(&sub, I64(x, y), &err), ndslice_rank_of(&s, I64(x, 3, y), &err));
}

Test(ndslice, rank_of_and_coords) {
  ndslice_t s = mk(3, I64(2, 3), I64(10, 2), 2); /* ranks 3 5 7 13 15 17 */
  cr_assert_eq(ndslice_rank_of(&s, I64(1, 2), &err), 3 + 10 + 4);
  expect_ranks(&s, I64(3, 5, 7, 13, 15, 17), 6);
  int64_t c[2];
  cr_assert_eq(ndslice_coords(&s, 15, c), 0);
  cr_assert_eq(c[0], 1);
  cr_assert_eq(c[1], 1);
  cr_assert_eq(ndslice_coords(&s, 4, c), -1);  /* between */
  cr_assert_eq(ndslice_coords(&s, 2, c), -1);  /* below offset */
  cr_assert_eq(ndslice_coords(&s, 19, c), -1); /* past the end */
  cr_assert_eq(ndslice_coords(&s, 9, c), -1);  /* 3 + 3*2: coord 3 is out of dim 1 */
  cr_assert_eq(ndslice_index(&s, 9), -1);
  cr_assert_not(ndslice_contains(&s, 23));

  memset(&err, 0, sizeof err);
  cr_assert_eq(ndslice_rank_of(&s, I64(2, 0), &err), -1);
  cr_assert_eq(err.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(err.msg, "coordinate 2 is out of range for dim 0 of size 2"), "%s", err.msg);
  cr_assert_eq(ndslice_rank_of(&s, I64(0, -1), &err), -1);
}

Test(ndslice, column_major_iterates_row_major) {
  ndslice_t s = mk(0, I64(2, 3), I64(1, 2), 2);
  expect_ranks(&s, I64(0, 2, 4, 1, 3, 5), 6);
  int64_t c[2];
  cr_assert_eq(ndslice_coords(&s, 3, c), 0);
  cr_assert_eq(c[0], 1);
  cr_assert_eq(c[1], 1);
}

Test(ndslice, get_out_of_range) {
  ndslice_t s = dense(I64(2, 2), 2);
  cr_assert_eq(ndslice_get(&s, 4, &err), -1);
  cr_assert_eq(err.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(err.msg, "index 4 is out of range for a slice of 4 ranks"), "%s", err.msg);
  cr_assert_eq(ndslice_get(&s, -1, &err), -1);
}

Test(ndslice, init_errors) {
  expect_err(init_rc(0, I64(2, 2), 2, I64(2), 1), ERR_BAD_ARGUMENT, "got 2 sizes and 1 strides");
  int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  expect_err(init_rc(0, nine, 9, nine, 9), ERR_BAD_ARGUMENT, "has 9 dims");
  expect_err(init_rc(0, nine, -1, nine, -1), ERR_BAD_ARGUMENT, "has -1 dims");
  expect_err(init_rc(-1, I64(2), 1, I64(1), 1), ERR_BAD_ARGUMENT, "offset -1 must be >= 0");
  expect_err(init_rc(0, I64(2, 0), 2, I64(1, 2), 2), ERR_BAD_ARGUMENT,
             "dim 1 has size 0; sizes must be >= 1");
  expect_err(init_rc(0, I64(2, 2), 2, I64(0, 2), 2), ERR_BAD_ARGUMENT,
             "dim 0 has stride 0; strides must be >= 1");
  expect_err(init_rc(0, I64(2, 2), 2, I64(-4, 1), 2), ERR_BAD_ARGUMENT, "stride -4");
  /* sorted strides 4, 6: 6 is not a multiple of 4 */
  expect_err(init_rc(0, I64(2, 2), 2, I64(6, 4), 2), ERR_BAD_ARGUMENT,
             "not rectangular: stride 6 of dim 0 is not a multiple of stride 4 of dim 1");
  expect_err(init_rc(0, I64(2, 2), 2, I64(4, 4), 2), ERR_BAD_ARGUMENT,
             "dims 0 and 1 both have stride 4");
  /* sizes [2,4] strides [2,1]: dim 1 spans 0..3, dim 0 steps by 2 inside it */
  expect_err(init_rc(0, I64(2, 4), 2, I64(2, 1), 2), ERR_BAD_ARGUMENT,
             "overlap: stride 2 of dim 0 is smaller than 4");
  /* [4,1] with strides [1,2]: a size-1 dim still may not sit inside another */
  expect_err(init_rc(0, I64(4, 1), 2, I64(1, 2), 2), ERR_BAD_ARGUMENT, "overlap");
  expect_err(init_rc(0, I64((int64_t)1 << 62, 4), 2, I64(1, (int64_t)1 << 62), 2), ERR_BAD_ARGUMENT,
             "too large");
  expect_err(init_rc(INT64_MAX, I64(2), 1, I64(1), 1), ERR_BAD_ARGUMENT, "past 2^63");
  ndslice_t s;
  expect_err(ndslice_dense(&s, I64(2, -3), 2, &err), ERR_BAD_ARGUMENT, "dim 1 has size -3");
  expect_err(ndslice_dense(&s, I64((int64_t)1 << 40, (int64_t)1 << 40), 2, &err), ERR_BAD_ARGUMENT,
             "past 2^63");
}

Test(ndslice, init_accepts_monarch_valid_shapes) {
  cr_assert_eq(init_rc(0, I64(1, 2), 2, I64(1, 1), 2), 0, "%s",
               err.msg); /* shared stride, size 1 */
  cr_assert_eq(init_rc(0, I64(2, 1), 2, I64(1, 1), 2), 0, "%s", err.msg);
  cr_assert_eq(init_rc(5, I64(2, 2), 2, I64(8, 2), 2), 0, "%s", err.msg); /* gaps are fine */
  cr_assert_eq(init_rc(0, NULL, 0, NULL, 0), 0, "%s", err.msg);           /* a single rank */
}

Test(ndslice, at_drops_the_dim) {
  ndslice_t s = dense(I64(2, 4), 2), a;
  cr_assert_eq(ndslice_at(&s, 1, 1, &a, &err), 0);
  cr_assert_eq(a.ndim, 1);
  expect_ranks(&a, I64(1, 5), 2);
  cr_assert_eq(ndslice_at(&s, 0, 1, &a, &err), 0);
  expect_ranks(&a, I64(4, 5, 6, 7), 4);
  cr_assert_eq(ndslice_at(&s, 1, -1, &a, &err), 0); /* from the end */
  expect_ranks(&a, I64(3, 7), 2);
  /* down to no dims: one rank */
  cr_assert_eq(ndslice_at(&a, 0, 1, &a, &err), 0);
  cr_assert_eq(a.ndim, 0);
  expect_ranks(&a, I64(7), 1);
  cr_assert_eq(ndslice_rank_of(&a, NULL, &err), 7);
}

Test(ndslice, at_errors) {
  ndslice_t s = dense(I64(2, 4), 2), a;
  expect_err(ndslice_at(&s, 1, 4, &a, &err), ERR_BAD_ARGUMENT,
             "index 4 is out of range for dim 1 of size 4 (use 0..3, or -4..-1 from the end)");
  expect_err(ndslice_at(&s, 1, -5, &a, &err), ERR_BAD_ARGUMENT, "of size 4");
  expect_err(ndslice_at(&s, 2, 0, &a, &err), ERR_BAD_DIM, "no dim 2 (it has 2 dims)");
  expect_err(ndslice_at(&s, -1, 0, &a, &err), ERR_BAD_DIM, "no dim -1");
}

Test(ndslice, select_keeps_the_dim) {
  ndslice_t s = dense(I64(2, 4), 2), a;
  /* gpu=slice(1,4,2): offset 1, size ceil(3/2)=2, stride 2 -> [[1,3],[5,7]] */
  cr_assert_eq(ndslice_select(&s, 1, 1, 4, 2, &a, &err), 0, "%s", err.msg);
  cr_assert_eq(a.offset, 1);
  cr_assert_eq(a.sizes[1], 2);
  cr_assert_eq(a.strides[1], 2);
  expect_ranks(&a, I64(1, 3, 5, 7), 4);
  /* host=slice(1,2) */
  cr_assert_eq(ndslice_select(&s, 0, 1, 2, 1, &a, &err), 0);
  cr_assert_eq(a.ndim, 2);
  expect_ranks(&a, I64(4, 5, 6, 7), 4);
  /* Python rules: negative start, stop past the end is clamped */
  cr_assert_eq(ndslice_select(&s, 1, -3, 100, 1, &a, &err), 0);
  expect_ranks(&a, I64(1, 2, 3, 5, 6, 7), 6);
  cr_assert_eq(ndslice_select(&s, 1, -100, -2, 1, &a, &err), 0);
  expect_ranks(&a, I64(0, 1, 4, 5), 4);
  /* in place */
  a = s;
  cr_assert_eq(ndslice_select(&a, 1, 0, 4, 2, &a, &err), 0);
  expect_ranks(&a, I64(0, 2, 4, 6), 4);
}

Test(ndslice, select_to_one_keeps_stride) {
  ndslice_t s = dense(I64(2, 4), 2), a;
  /* 1:2:3 has one element; its stride stays 1 so the slice stays rectangular */
  cr_assert_eq(ndslice_select(&s, 1, 1, 2, 3, &a, &err), 0, "%s", err.msg);
  cr_assert_eq(a.sizes[1], 1);
  cr_assert_eq(a.strides[1], 1);
  expect_ranks(&a, I64(1, 5), 2);
  /* a 1-D slice takes any step */
  ndslice_t line = dense(I64(8), 1);
  cr_assert_eq(ndslice_select(&line, 0, 0, 8, 3, &a, &err), 0, "%s", err.msg);
  expect_ranks(&a, I64(0, 3, 6), 3);
}

Test(ndslice, select_errors) {
  ndslice_t s = dense(I64(2, 4), 2), a;
  expect_err(ndslice_select(&s, 1, 0, 4, 0, &a, &err), ERR_BAD_ARGUMENT, "step 0 must be >= 1");
  expect_err(ndslice_select(&s, 1, 0, 4, -1, &a, &err), ERR_BAD_ARGUMENT, "step -1");
  expect_err(ndslice_select(&s, 1, 3, 2, 1, &a, &err), ERR_BAD_ARGUMENT,
             "range 3:2:1 selects nothing from dim 1 of size 4");
  expect_err(ndslice_select(&s, 1, 4, 10, 1, &a, &err), ERR_BAD_ARGUMENT, "selects nothing");
  expect_err(ndslice_select(&s, 1, -1, -1, 1, &a, &err), ERR_BAD_ARGUMENT, "selects nothing");
  expect_err(ndslice_select(&s, 2, 0, 1, 1, &a, &err), ERR_BAD_DIM, "no dim 2");
  /* 0:4:3 on {2,4}: strides [4,3]; 3 does not divide 4 (Monarch rejects it too) */
  expect_err(ndslice_select(&s, 1, 0, 4, 3, &a, &err), ERR_BAD_ARGUMENT, "not rectangular");
}

Test(ndslice, get_index_roundtrip_on_strided_3d) {
  ndslice_t s = mk(7, I64(3, 2, 4), I64(2, 48, 8), 3);
  int64_t n = ndslice_len(&s);
  cr_assert_eq(n, 24);
  for (int64_t i = 0; i < n; i++) {
    int64_t r = ndslice_get(&s, i, &err), c[3];
    cr_assert_geq(r, 7);
    cr_assert_eq(ndslice_index(&s, r), i);
    cr_assert_eq(ndslice_coords(&s, r, c), 0);
    cr_assert_eq(ndslice_rank_of(&s, c, &err), r);
    cr_assert_eq(c[0] * 8 + c[1] * 4 + c[2], i); /* row-major position */
  }
}
