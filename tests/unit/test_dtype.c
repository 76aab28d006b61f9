#include <criterion/criterion.h>
#include <string.h>

#include "dtype.h"
#include "meshd/v1/tensor_service.pb-c.h"

Test(dtype, values_equal_the_proto_enum) {
  cr_assert_eq(DTYPE_INVALID, MESHD__V1__DTYPE__DTYPE_UNSPECIFIED);
  cr_assert_eq(DTYPE_FLOAT32, MESHD__V1__DTYPE__DTYPE_FLOAT32);
  cr_assert_eq(DTYPE_FLOAT64, MESHD__V1__DTYPE__DTYPE_FLOAT64);
  cr_assert_eq(DTYPE_FLOAT16, MESHD__V1__DTYPE__DTYPE_FLOAT16);
  cr_assert_eq(DTYPE_BFLOAT16, MESHD__V1__DTYPE__DTYPE_BFLOAT16);
  cr_assert_eq(DTYPE_INT8, MESHD__V1__DTYPE__DTYPE_INT8);
  cr_assert_eq(DTYPE_UINT8, MESHD__V1__DTYPE__DTYPE_UINT8);
  cr_assert_eq(DTYPE_INT16, MESHD__V1__DTYPE__DTYPE_INT16);
  cr_assert_eq(DTYPE_INT32, MESHD__V1__DTYPE__DTYPE_INT32);
  cr_assert_eq(DTYPE_INT64, MESHD__V1__DTYPE__DTYPE_INT64);
  cr_assert_eq(DTYPE_BOOL, MESHD__V1__DTYPE__DTYPE_BOOL);
}

Test(dtype, names_sizes_and_categories) {
  struct {
    dtype_t d;
    const char *name;
    size_t size;
    bool floating, integral, integral_or_bool;
  } rows[] = {
      {DTYPE_FLOAT32, "float32", 4, true, false, false},
      {DTYPE_FLOAT64, "float64", 8, true, false, false},
      {DTYPE_FLOAT16, "float16", 2, true, false, false},
      {DTYPE_BFLOAT16, "bfloat16", 2, true, false, false},
      {DTYPE_INT8, "int8", 1, false, true, true},
      {DTYPE_UINT8, "uint8", 1, false, true, true},
      {DTYPE_INT16, "int16", 2, false, true, true},
      {DTYPE_INT32, "int32", 4, false, true, true},
      {DTYPE_INT64, "int64", 8, false, true, true},
      {DTYPE_BOOL, "bool", 1, false, false, true},
  };
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    cr_assert(dtype_valid(rows[i].d));
    cr_assert_str_eq(dtype_name(rows[i].d), rows[i].name);
    cr_assert_eq(dtype_size(rows[i].d), rows[i].size, "%s", rows[i].name);
    cr_assert_eq(dtype_is_floating(rows[i].d), rows[i].floating, "%s", rows[i].name);
    cr_assert_eq(dtype_is_integral(rows[i].d, false), rows[i].integral, "%s", rows[i].name);
    cr_assert_eq(dtype_is_integral(rows[i].d, true), rows[i].integral_or_bool, "%s", rows[i].name);
    cr_assert_eq(dtype_parse(rows[i].name), rows[i].d, "%s", rows[i].name);
  }
}

Test(dtype, invalid_values) {
  cr_assert_not(dtype_valid(DTYPE_INVALID));
  cr_assert_not(dtype_valid((dtype_t)11));
  cr_assert_not(dtype_valid((dtype_t)-1));
  cr_assert_str_eq(dtype_name(DTYPE_INVALID), "invalid");
  cr_assert_str_eq(dtype_name((dtype_t)99), "invalid");
  cr_assert_eq(dtype_size(DTYPE_INVALID), 0);
  cr_assert_not(dtype_is_floating(DTYPE_INVALID));
  cr_assert_not(dtype_is_integral(DTYPE_INVALID, true));
  cr_assert_eq(dtype_promote(DTYPE_INVALID, DTYPE_FLOAT32), DTYPE_INVALID);
  cr_assert_eq(dtype_promote(DTYPE_INT8, (dtype_t)42), DTYPE_INVALID);
  cr_assert_not(dtype_can_cast(DTYPE_INVALID, DTYPE_FLOAT32));
  cr_assert_not(dtype_can_cast(DTYPE_FLOAT32, DTYPE_INVALID));
}

Test(dtype, parse_accepts_torch_aliases_and_prefix) {
  cr_assert_eq(dtype_parse("float"), DTYPE_FLOAT32);
  cr_assert_eq(dtype_parse("double"), DTYPE_FLOAT64);
  cr_assert_eq(dtype_parse("half"), DTYPE_FLOAT16);
  cr_assert_eq(dtype_parse("long"), DTYPE_INT64);
  cr_assert_eq(dtype_parse("int"), DTYPE_INT32);
  cr_assert_eq(dtype_parse("short"), DTYPE_INT16);
  cr_assert_eq(dtype_parse("torch.bfloat16"), DTYPE_BFLOAT16);
  cr_assert_eq(dtype_parse("torch.long"), DTYPE_INT64);
  cr_assert_eq(dtype_parse("Float32"), DTYPE_INVALID);
  cr_assert_eq(dtype_parse("float31"), DTYPE_INVALID);
  cr_assert_eq(dtype_parse(""), DTYPE_INVALID);
  cr_assert_eq(dtype_parse("torch."), DTYPE_INVALID);
  cr_assert_eq(dtype_parse(NULL), DTYPE_INVALID);
}

/* torch.promote_types, transcribed from c10's _promoteTypesLookup (complex and
 * quantized columns dropped). */
Test(dtype, promote_matches_torch_table) {
  enum { u1, i1, i2, i4, i8, f2, f4, f8, b1, bf, N };
  const dtype_t d[N] = {DTYPE_UINT8,   DTYPE_INT8,    DTYPE_INT16,   DTYPE_INT32, DTYPE_INT64,
                        DTYPE_FLOAT16, DTYPE_FLOAT32, DTYPE_FLOAT64, DTYPE_BOOL,  DTYPE_BFLOAT16};
  const int table[N][N] = {
      /*        u1  i1  i2  i4  i8  f2  f4  f8  b1  bf */
      /* u1 */ {u1, i2, i2, i4, i8, f2, f4, f8, u1, bf},
      /* i1 */ {i2, i1, i2, i4, i8, f2, f4, f8, i1, bf},
      /* i2 */ {i2, i2, i2, i4, i8, f2, f4, f8, i2, bf},
      /* i4 */ {i4, i4, i4, i4, i8, f2, f4, f8, i4, bf},
      /* i8 */ {i8, i8, i8, i8, i8, f2, f4, f8, i8, bf},
      /* f2 */ {f2, f2, f2, f2, f2, f2, f4, f8, f2, f4},
      /* f4 */ {f4, f4, f4, f4, f4, f4, f4, f8, f4, f4},
      /* f8 */ {f8, f8, f8, f8, f8, f8, f8, f8, f8, f8},
      /* b1 */ {u1, i1, i2, i4, i8, f2, f4, f8, b1, bf},
      /* bf */ {bf, bf, bf, bf, bf, f4, f4, f8, bf, bf},
  };
  for (int i = 0; i < N; i++)
    for (int j = 0; j < N; j++)
      cr_assert_eq(dtype_promote(d[i], d[j]), d[table[i][j]], "promote(%s, %s) = %s, want %s",
                   dtype_name(d[i]), dtype_name(d[j]), dtype_name(dtype_promote(d[i], d[j])),
                   dtype_name(d[table[i][j]]));
}

Test(dtype, can_cast_matches_torch) {
  /* torch.can_cast: not float -> int/bool, not int -> bool; everything else. */
  const dtype_t all[] = {DTYPE_FLOAT32, DTYPE_FLOAT64, DTYPE_FLOAT16, DTYPE_BFLOAT16, DTYPE_INT8,
                         DTYPE_UINT8,   DTYPE_INT16,   DTYPE_INT32,   DTYPE_INT64,    DTYPE_BOOL};
  for (size_t i = 0; i < 10; i++)
    for (size_t j = 0; j < 10; j++) {
      dtype_t f = all[i], t = all[j];
      bool want = true;
      if (dtype_is_floating(f) && !dtype_is_floating(t)) want = false;
      if (f != DTYPE_BOOL && t == DTYPE_BOOL) want = false;
      cr_assert_eq(dtype_can_cast(f, t), want, "%s -> %s", dtype_name(f), dtype_name(t));
    }
  cr_assert(dtype_can_cast(DTYPE_INT64, DTYPE_FLOAT16));
  cr_assert(dtype_can_cast(DTYPE_FLOAT64, DTYPE_BFLOAT16));
  cr_assert(dtype_can_cast(DTYPE_INT64, DTYPE_UINT8));
  cr_assert_not(dtype_can_cast(DTYPE_FLOAT16, DTYPE_INT64));
  cr_assert_not(dtype_can_cast(DTYPE_UINT8, DTYPE_BOOL));
  cr_assert(dtype_can_cast(DTYPE_BOOL, DTYPE_UINT8));
}
