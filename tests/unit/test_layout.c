#include <criterion/criterion.h>
#include <string.h>

#include "layout.h"

#define SZ(...) (int64_t[]){__VA_ARGS__}, (int64_t)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t))

static void assert_msg_has(const meshd_error_t *e, const char *s) {
  cr_assert(strstr(e->msg, s), "message \"%s\" lacks \"%s\"", e->msg, s);
}

Test(layout, contiguous_strides_row_major) {
  layout_t l;
  meshd_error_t e = {0};
  cr_assert_eq(layout_contiguous(&l, SZ(2, 3, 4), 4, "t", &e), 0);
  cr_assert_eq(l.ndim, 3);
  cr_assert_eq(l.offset, 0);
  cr_assert_eq(l.strides[0], 12);
  cr_assert_eq(l.strides[1], 4);
  cr_assert_eq(l.strides[2], 1);
  cr_assert_eq(layout_numel(&l), 24);
  cr_assert(layout_is_contiguous(&l));
  /* torch: a size-0 dim counts as 1 in the strides of the dims before it. */
  cr_assert_eq(layout_contiguous(&l, SZ(2, 0, 3), 4, "t", &e), 0);
  cr_assert_eq(l.strides[0], 3);
  cr_assert_eq(l.strides[1], 3);
  cr_assert_eq(l.strides[2], 1);
  cr_assert_eq(layout_numel(&l), 0);
  cr_assert_eq(layout_contiguous(&l, NULL, 0, 8, "t", &e), 0);
  cr_assert_eq(l.ndim, 0);
  cr_assert_eq(layout_numel(&l), 1);
}

Test(layout, rejects_too_many_dims) {
  int64_t sizes[17];
  for (int i = 0; i < 17; i++) sizes[i] = 1;
  layout_t l;
  meshd_error_t e = {0};
  cr_assert_eq(layout_contiguous(&l, sizes, 16, 4, "zeros: argument 'size'", &e), 0);
  cr_assert_eq(layout_contiguous(&l, sizes, 17, 4, "zeros: argument 'size'", &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  assert_msg_has(&e, "zeros: argument 'size': ");
  assert_msg_has(&e, "17 dims");
  assert_msg_has(&e, "at most 16");
  cr_assert_eq(layout_check_shape("x", sizes, -1, 4, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
}

Test(layout, rejects_negative_sizes) {
  meshd_error_t e = {0};
  cr_assert_eq(layout_check_shape("ones: argument 'size'", SZ(2, -1), 4, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  assert_msg_has(&e, "ones: argument 'size': ");
  assert_msg_has(&e, "negative size -1 at dim 1");
}

Test(layout, byte_limit_is_two_to_the_62) {
  meshd_error_t e = {0};
  int64_t g = (int64_t)1 << 30, h = (int64_t)1 << 31;
  /* exactly 2^62 bytes passes, one element more does not */
  cr_assert_eq(layout_check_shape("t", (int64_t[]){g, g}, 2, 4, &e), 0);
  cr_assert_eq(layout_check_shape("t", (int64_t[]){h, h}, 2, 1, &e), 0);
  cr_assert_eq(layout_check_shape("t", (int64_t[]){h, h + 1}, 2, 1, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  assert_msg_has(&e, "exceeds 2^62 bytes");
  cr_assert_eq(layout_check_shape("t", (int64_t[]){g, g}, 2, 8, &e), -1);
  assert_msg_has(&e, "exceeds 2^62 bytes");
  /* products that overflow int64 are caught, not wrapped */
  int64_t big = (int64_t)1 << 62;
  cr_assert_eq(layout_check_shape("t", (int64_t[]){big, big, big, 4}, 4, 1, &e), -1);
  assert_msg_has(&e, "exceeds 2^62 bytes");
  cr_assert_eq(layout_check_shape("t", (int64_t[]){INT64_MAX, 2}, 2, 1, &e), -1);
  cr_assert_eq(layout_check_shape("t", (int64_t[]){(int64_t)1 << 62}, 1, 1, &e), 0);
  cr_assert_eq(layout_check_shape("t", (int64_t[]){((int64_t)1 << 62) + 1}, 1, 1, &e), -1);
  /* a zero size makes an empty tensor, but its strides (the product of the
   * other sizes) must still fit: found by fuzz_agent_instructions, where
   * zeros([0, 2^63-1, 2]) overflowed layout_make_contiguous */
  cr_assert_eq(layout_check_shape("t", (int64_t[]){(int64_t)1 << 40, 0}, 2, 4, &e), 0);
  cr_assert_eq(layout_check_shape("t", (int64_t[]){INT64_MAX, INT64_MAX, 0}, 3, 8, &e), -1);
  assert_msg_has(&e, "exceeds 2^62 bytes");
  cr_assert_eq(layout_check_shape("t", (int64_t[]){0, INT64_MAX, 2}, 3, 4, &e), -1);
  /* any zero size makes an empty tensor, but its strides must still fit (torch's
   * "Stride calculation overflowed"; found by tests/fuzz/fuzz_shapes) */
  cr_assert_eq(layout_check_shape("t", (int64_t[]){g, g, 0}, 3, 4, &e), 0);
  cr_assert_eq(layout_check_shape("t", (int64_t[]){0, g, g}, 3, 4, &e), 0);
  cr_assert_eq(layout_check_shape("t", (int64_t[]){INT64_MAX, INT64_MAX, 0}, 3, 8, &e), -1);
  assert_msg_has(&e, "exceeds 2^62 bytes (in its strides");
  cr_assert_eq(layout_check_shape("t", (int64_t[]){0, h, h + 1}, 3, 1, &e), -1);
}

Test(layout, contiguous_strides_of_an_empty_tensor_fit) {
  meshd_error_t e = {0};
  layout_t l;
  int64_t g = (int64_t)1 << 30;
  cr_assert_eq(layout_contiguous(&l, (int64_t[]){0, g, g}, 3, 4, NULL, &e), 0);
  cr_assert_eq(l.strides[0], g * g);
  cr_assert_eq(l.strides[1], g);
  cr_assert_eq(l.strides[2], 1);
  cr_assert_eq(layout_contiguous(&l, (int64_t[]){(int64_t)1 << 32, (int64_t)1 << 32, 0}, 3, 1,
                                 "zeros: argument 'size'", &e), -1);
  assert_msg_has(&e, "zeros: argument 'size': shape [4294967296, 4294967296, 0]");
}

Test(layout, is_contiguous_follows_torch) {
  layout_t l = {.ndim = 2, .sizes = {3, 2}, .strides = {1, 3}}; /* transposed [2, 3] */
  cr_assert_not(layout_is_contiguous(&l));
  layout_t one = {.ndim = 3, .sizes = {2, 1, 3}, .strides = {3, 99, 1}};
  cr_assert(layout_is_contiguous(&one)); /* size-1 strides don't matter */
  layout_t empty = {.ndim = 2, .sizes = {0, 3}, .strides = {7, 5}};
  cr_assert(layout_is_contiguous(&empty));
  layout_t sliced = {.ndim = 1, .offset = 4, .sizes = {3}, .strides = {2}};
  cr_assert_not(layout_is_contiguous(&sliced));
  layout_t offset = {.ndim = 1, .offset = 4, .sizes = {3}, .strides = {1}};
  cr_assert(layout_is_contiguous(&offset));
  layout_t scalar = {.ndim = 0};
  cr_assert(layout_is_contiguous(&scalar));
}

Test(layout, internal_overlap_and_same_shape) {
  layout_t x = {.ndim = 2, .sizes = {4, 3}, .strides = {0, 1}};
  cr_assert(layout_has_internal_overlap(&x));
  layout_t y = {.ndim = 2, .sizes = {1, 3}, .strides = {0, 1}};
  cr_assert_not(layout_has_internal_overlap(&y));
  cr_assert_not(layout_same_shape(&x, &y));
  y.sizes[0] = 4;
  cr_assert(layout_same_shape(&x, &y));
  layout_t z = {.ndim = 1, .sizes = {4}};
  cr_assert_not(layout_same_shape(&x, &z));
}

Test(layout, broadcast_rules) {
  int64_t out[LAYOUT_MAX_DIMS];
  int n;
  meshd_error_t e = {0};
  cr_assert_eq(layout_broadcast("add", "self", (int64_t[]){2, 1, 3}, 3, "other",
                                (int64_t[]){4, 1}, 2, out, &n, &e),
               0);
  cr_assert_eq(n, 3);
  cr_assert_eq(out[0], 2);
  cr_assert_eq(out[1], 4);
  cr_assert_eq(out[2], 3);
  cr_assert_eq(layout_broadcast("add", "self", NULL, 0, "other", (int64_t[]){5}, 1, out, &n, &e),
               0);
  cr_assert_eq(n, 1);
  cr_assert_eq(out[0], 5);
  /* size 0 broadcasts against 1, not against 2 */
  cr_assert_eq(layout_broadcast("add", "a", (int64_t[]){0}, 1, "b", (int64_t[]){1}, 1, out, &n, &e),
               0);
  cr_assert_eq(out[0], 0);
  cr_assert_eq(layout_broadcast("add", "self", (int64_t[]){2, 3}, 2, "other", (int64_t[]){4}, 1,
                                out, &n, &e),
               -1);
  cr_assert_eq(e.kind, ERR_SHAPE_MISMATCH);
  assert_msg_has(&e, "add: ");
  assert_msg_has(&e, "self [2, 3]");
  assert_msg_has(&e, "other [4]");
  assert_msg_has(&e, "at dim 1");
  assert_msg_has(&e, "3 and 4");
}

Test(layout, wrap_dim) {
  int64_t d;
  meshd_error_t e = {0};
  cr_assert_eq(layout_wrap_dim("sum: argument 'dim'", -1, 2, false, &d, &e), 0);
  cr_assert_eq(d, 1);
  cr_assert_eq(layout_wrap_dim("sum: argument 'dim'", -2, 2, false, &d, &e), 0);
  cr_assert_eq(d, 0);
  cr_assert_eq(layout_wrap_dim("sum: argument 'dim'", 3, 2, false, &d, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_DIM);
  cr_assert_str_eq(e.msg,
                   "sum: argument 'dim': dim 3 is out of range for a tensor of 2 dims (expected "
                   "-2..1)");
  cr_assert_eq(layout_wrap_dim("x", -3, 2, false, &d, &e), -1);
  cr_assert_eq(layout_wrap_dim("x", 0, 0, false, &d, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_DIM);
  /* a 0-dim tensor answers to dims 0 and -1 where torch wraps scalars */
  cr_assert_eq(layout_wrap_dim("x", -1, 0, true, &d, &e), 0);
  cr_assert_eq(d, 0);
  cr_assert_eq(layout_wrap_dim("x", 1, 0, true, &d, &e), -1);
  assert_msg_has(&e, "expected -1..0");
  cr_assert_eq(layout_wrap_dim("x", INT64_MIN, 3, false, &d, &e), -1);
}

Test(layout, format_shape) {
  char buf[LAYOUT_SHAPE_BUF];
  cr_assert_str_eq(layout_format_shape((int64_t[]){2, 3}, 2, buf, sizeof buf), "[2, 3]");
  cr_assert_str_eq(layout_format_shape(NULL, 0, buf, sizeof buf), "[]");
  cr_assert_str_eq(layout_format_shape((int64_t[]){-1}, 1, buf, sizeof buf), "[-1]");
  char small[5];
  layout_format_shape((int64_t[]){123, 456}, 2, small, sizeof small);
  cr_assert_eq(strlen(small), 4); /* truncated, still terminated */
  int64_t max[LAYOUT_MAX_DIMS];
  for (int i = 0; i < LAYOUT_MAX_DIMS; i++) max[i] = INT64_MIN;
  layout_format_shape(max, LAYOUT_MAX_DIMS, buf, sizeof buf);
  cr_assert_eq(buf[strlen(buf) - 1], ']'); /* the buffer holds the widest shape */
}

/* ---- limits (--max-tensor-dims, --max-tensor-elements) ---- */

Test(limits, default_to_the_hard_bounds_and_clamp_into_them) {
  layout_limits_t l = layout_get_limits();
  cr_assert_eq(l.max_dims, LAYOUT_MAX_DIMS);
  cr_assert_eq(l.max_elements, LAYOUT_MAX_BYTES);
  layout_set_limits(&(layout_limits_t){0, 0});
  l = layout_get_limits();
  cr_assert_eq(l.max_dims, 1);
  cr_assert_eq(l.max_elements, 1);
  layout_set_limits(&(layout_limits_t){99, INT64_MAX});
  l = layout_get_limits();
  cr_assert_eq(l.max_dims, LAYOUT_MAX_DIMS);
  cr_assert_eq(l.max_elements, LAYOUT_MAX_BYTES);
  layout_set_limits(&(layout_limits_t){3, 7});
  layout_set_limits(NULL);
  l = layout_get_limits();
  cr_assert_eq(l.max_dims, LAYOUT_MAX_DIMS);
  cr_assert_eq(l.max_elements, LAYOUT_MAX_BYTES);
}

Test(limits, more_dims_than_allowed_is_quota_naming_the_flag) {
  layout_set_limits(&(layout_limits_t){3, LAYOUT_MAX_BYTES});
  meshd_error_t e = {0};
  cr_assert_eq(layout_check_shape("zeros: argument 'size'", SZ(1, 2, 3), 4, &e), 0);
  cr_assert_eq(layout_check_shape("zeros: argument 'size'", SZ(1, 2, 3, 4), 4, &e), -1);
  cr_assert_eq(e.kind, ERR_QUOTA);
  cr_assert_str_eq(e.msg, "zeros: argument 'size': 4 dims is more than the 3 a tensor may have "
                          "here (--max-tensor-dims)");
  /* past the hard bound it stays BAD_ARGUMENT: no flag allows 17 */
  int64_t deep[17] = {0};
  cr_assert_eq(layout_check_shape("t", deep, 17, 4, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  assert_msg_has(&e, "at most 16");
}

Test(limits, more_elements_than_allowed_is_quota_naming_the_flag) {
  layout_set_limits(&(layout_limits_t){LAYOUT_MAX_DIMS, 100});
  meshd_error_t e = {0};
  cr_assert_eq(layout_check_shape("t", SZ(10, 10), 8, &e), 0);
  cr_assert_eq(layout_check_shape("t", SZ(100), 1, &e), 0);
  cr_assert_eq(layout_check_shape("t", SZ(0, (int64_t)1 << 40), 4, &e), 0); /* empty */
  cr_assert_eq(layout_check_shape("Upload: shape", SZ(10, 11), 4, &e), -1);
  cr_assert_eq(e.kind, ERR_QUOTA);
  cr_assert_str_eq(e.msg, "Upload: shape: shape [10, 11] has 110 elements, more than the 100 a "
                          "tensor may have here (--max-tensor-elements)");
  /* the byte bound still comes first, and still catches overflow */
  cr_assert_eq(layout_check_shape("t", SZ(INT64_MAX, INT64_MAX), 1, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  assert_msg_has(&e, "exceeds 2^62 bytes");
  layout_t l;
  cr_assert_eq(layout_contiguous(&l, SZ(101), 1, "ToMesh", &e), -1);
  cr_assert_eq(e.kind, ERR_QUOTA);
  assert_msg_has(&e, "ToMesh: shape [101] has 101 elements");
}

/* meta_pack.h: every kind of layout comes back as it went in, in the bytes
 * the header promises, and a 1-D contiguous one takes 12. */
#include "meta_pack.h"

static void round_trip(const tensor_meta_t *m, size_t want_size) {
  uint8_t buf[META_PACKED_MAX + 8];
  memset(buf, 0xa5, sizeof buf);
  size_t n = meta_packed_size(m);
  cr_assert_leq(n, META_PACKED_MAX);
  if (want_size) cr_assert_eq(n, want_size, "packed size %zu, want %zu", n, want_size);
  meta_pack(buf + 1, m); /* unaligned on purpose */
  cr_assert_eq(buf[1 + n], 0xa5, "meta_pack wrote past meta_packed_size");
  tensor_meta_t back;
  memset(&back, 0x5a, sizeof back);
  meta_unpack(buf + 1, &back);
  cr_assert_eq(back.dtype, m->dtype);
  cr_assert_eq(meta_packed_ndim(buf + 1), m->layout.ndim);
  cr_assert_eq(back.layout.ndim, m->layout.ndim);
  cr_assert_eq(back.layout.offset, m->layout.offset);
  for (int i = 0; i < m->layout.ndim; i++) {
    cr_assert_eq(back.layout.sizes[i], m->layout.sizes[i], "size %d", i);
    cr_assert_eq(back.layout.strides[i], m->layout.strides[i], "stride %d", i);
  }
  for (int i = m->layout.ndim; i < LAYOUT_MAX_DIMS; i++)
    cr_assert(back.layout.sizes[i] == 0 && back.layout.strides[i] == 0, "slot %d not zeroed", i);
}

Test(layout, meta_pack_round_trips_every_kind_of_layout) {
  meshd_error_t e;
  tensor_meta_t m = {.dtype = DTYPE_FLOAT32};
  cr_assert_eq(layout_contiguous(&m.layout, (const int64_t[]){4}, 1, 4, "t", &e), 0);
  round_trip(&m, 12); /* header + one size */
  m.layout.offset = 3;
  round_trip(&m, 20); /* + the offset */
  cr_assert_eq(layout_contiguous(&m.layout, NULL, 0, 4, "t", &e), 0);
  round_trip(&m, 4); /* a scalar: the header alone */
  m.dtype = DTYPE_BFLOAT16;
  cr_assert_eq(layout_contiguous(&m.layout, (const int64_t[]){2, 0, 3}, 3, 2, "t", &e), 0);
  round_trip(&m, 4 + 3 * 8); /* empty: its row-major strides are still implied */
  /* A transpose: strides that are not row-major are kept. */
  cr_assert_eq(layout_contiguous(&m.layout, (const int64_t[]){2, 3}, 2, 2, "t", &e), 0);
  m.layout.sizes[0] = 3;
  m.layout.sizes[1] = 2;
  m.layout.strides[0] = 1;
  m.layout.strides[1] = 3;
  round_trip(&m, 4 + 2 * 2 * 8);
  /* expand: a stride 0; a size-1 dim with an odd stride. */
  m.layout.strides[0] = 0;
  round_trip(&m, 4 + 2 * 2 * 8);
  m.layout.sizes[0] = 1;
  m.layout.strides[0] = 77;
  m.layout.strides[1] = 1;
  round_trip(&m, 4 + 2 * 2 * 8);
  /* The most dims, with an offset and strides. */
  m.dtype = DTYPE_INT64;
  m.layout.ndim = LAYOUT_MAX_DIMS;
  m.layout.offset = 1;
  for (int i = 0; i < LAYOUT_MAX_DIMS; i++) {
    m.layout.sizes[i] = 2;
    m.layout.strides[i] = (int64_t)1 << (i + 1);
  }
  round_trip(&m, META_PACKED_MAX);
}
