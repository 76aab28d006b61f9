/* tensor_file: .npy headers of files numpy wrote (fixtures/tensor_file/, by
 * make_fixtures.py), safetensors files written byte for byte from the format's
 * spec, every malformed case, and the shard ranges. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_file.h"

static uint8_t *read_fixture(const char *name, size_t *len) {
  const char *src = getenv("MESHD_SOURCE_DIR");
  char path[1024];
  snprintf(path, sizeof path, "%s/tests/unit/fixtures/tensor_file/%s", src ? src : ".", name);
  FILE *f = fopen(path, "rb");
  cr_assert(f, "cannot open %s (MESHD_SOURCE_DIR set?)", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *b = malloc((size_t)n + 1);
  cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  *len = (size_t)n;
  return b;
}

/* Parses buf as a reader would: the first 8 bytes, then as many as asked. */
static int parse_incrementally(const uint8_t *buf, size_t len, tensor_file_t *f, meshd_error_t *e,
                               int *rounds) {
  tensor_file_opts_t o = {.file_size = len};
  uint64_t have = len < 8 ? len : 8, need;
  *rounds = 0;
  for (;;) {
    ++*rounds;
    int rc = tensor_file_parse(buf, (size_t)have, &o, f, &need, e);
    if (rc != TENSOR_FILE_NEED_MORE) return rc;
    cr_assert_gt(need, have);
    cr_assert_leq(need, len, "asked for %llu bytes of a %zu-byte file", (unsigned long long)need,
                  len);
    have = need;
  }
}

static int parse(const uint8_t *buf, size_t len, uint64_t file_size, tensor_file_t *f,
                 meshd_error_t *e) {
  tensor_file_opts_t o = {.file_size = file_size};
  uint64_t need;
  return tensor_file_parse(buf, len, &o, f, &need, e);
}

/* ---- .npy ---- */

Test(tensor_file, npy_files_numpy_wrote) {
  struct {
    const char *file;
    dtype_t dtype;
    int ndim;
    int64_t shape[3];
  } rows[] = {
      {"f4_2x3.npy", DTYPE_FLOAT32, 2, {2, 3}},     {"f8_4.npy", DTYPE_FLOAT64, 1, {4}},
      {"f2_2x2.npy", DTYPE_FLOAT16, 2, {2, 2}},     {"i8_scalar.npy", DTYPE_INT64, 0, {0}},
      {"i4_3x1x2.npy", DTYPE_INT32, 3, {3, 1, 2}},  {"i2_5.npy", DTYPE_INT16, 1, {5}},
      {"i1_4.npy", DTYPE_INT8, 1, {4}},             {"u1_6.npy", DTYPE_UINT8, 1, {6}},
      {"b1_3.npy", DTYPE_BOOL, 1, {3}},             {"f4_empty_0x3.npy", DTYPE_FLOAT32, 2, {0, 3}},
      {"f4_v2_2x3.npy", DTYPE_FLOAT32, 2, {2, 3}},  {"f4_v3_2x3.npy", DTYPE_FLOAT32, 2, {2, 3}},
      {"f4_fortran_1x4.npy", DTYPE_FLOAT32, 2, {1, 4}},
  };
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    size_t len;
    uint8_t *b = read_fixture(rows[i].file, &len);
    tensor_file_t f;
    meshd_error_t e = {0};
    int rounds;
    cr_assert_eq(parse_incrementally(b, len, &f, &e, &rounds), TENSOR_FILE_OK, "%s: %s",
                 rows[i].file, e.msg);
    cr_assert_eq(rounds, 3, "%s: 8 bytes, the length field, the header", rows[i].file);
    cr_assert_eq(f.format, TENSOR_FILE_NPY);
    cr_assert_eq(f.count, 1);
    const tensor_file_entry_t *t = tensor_file_find(&f, NULL);
    cr_assert_eq(t, &f.tensors[0]);
    cr_assert_str_eq(t->name, "");
    cr_assert_eq(t->dtype, rows[i].dtype, "%s", rows[i].file);
    cr_assert_eq(t->ndim, rows[i].ndim, "%s", rows[i].file);
    for (int d = 0; d < t->ndim; d++) cr_assert_eq(t->shape[d], rows[i].shape[d]);
    cr_assert_eq(t->offset, f.header_bytes);
    cr_assert_eq(t->offset + t->nbytes, len, "%s: the data runs to the end of the file",
                 rows[i].file);
    tensor_file_free(&f);
    free(b);
  }
}

Test(tensor_file, npy_values_at_the_offset) {
  size_t len;
  uint8_t *b = read_fixture("f4_2x3.npy", &len);
  tensor_file_t f;
  meshd_error_t e;
  cr_assert_eq(parse(b, len, len, &f, &e), 0, "%s", e.msg);
  float v[6];
  memcpy(v, b + f.tensors[0].offset, sizeof v);
  for (int i = 0; i < 6; i++) cr_assert_eq(v[i], (float)i);
  tensor_file_free(&f);
  free(b);
  b = read_fixture("i8_scalar.npy", &len);
  cr_assert_eq(parse(b, len, len, &f, &e), 0, "%s", e.msg);
  cr_assert_eq(f.tensors[0].nbytes, 8);
  tensor_file_free(&f);
  free(b);
}

static void expect_fixture_refused(const char *file, const char *needle) {
  size_t len;
  uint8_t *b = read_fixture(file, &len);
  tensor_file_t f;
  meshd_error_t e = {0};
  cr_assert_eq(parse(b, len, len, &f, &e), -1, "%s parsed", file);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(e.msg, needle), "%s: '%s' lacks '%s'", file, e.msg, needle);
  cr_assert(strstr(e.msg, "npy header"), "%s", e.msg);
  cr_assert_null(f.tensors);
  free(b);
}

Test(tensor_file, npy_refusals_of_numpy_files) {
  expect_fixture_refused("f4_fortran_2x3.npy", "fortran_order is True");
  expect_fixture_refused("f4_bigendian_3.npy", "descr '>f4' is big-endian");
  expect_fixture_refused("u2_3.npy", "descr '<u2' has no meshd dtype");
  expect_fixture_refused("c8_2.npy", "descr '<c8' has no meshd dtype");
}

/* A version 1.0 file with this header (padded to 64 bytes) and data bytes. */
static uint8_t *make_npy(const char *header, size_t data, size_t *len) {
  size_t h = strlen(header), total = (10 + h + 1 + 63) / 64 * 64;
  uint8_t *b = calloc(1, total + data + 1);
  memcpy(b, "\x93NUMPY\x01\x00", 8);
  b[8] = (uint8_t)((total - 10) & 0xff);
  b[9] = (uint8_t)((total - 10) >> 8);
  memset(b + 10, ' ', total - 10);
  memcpy(b + 10, header, h);
  b[total - 1] = '\n';
  *len = total + data;
  return b;
}

static void expect_npy(const char *header, size_t data, int rc_want, error_kind_t kind,
                       const char *needle) {
  size_t len;
  uint8_t *b = make_npy(header, data, &len);
  tensor_file_t f;
  meshd_error_t e = {0};
  int rc = parse(b, len, len, &f, &e);
  cr_assert_eq(rc, rc_want, "header %s: rc %d (%s)", header, rc, e.msg);
  if (rc == 0) {
    tensor_file_free(&f);
  } else {
    cr_assert_eq(e.kind, kind, "header %s: kind %s", header, error_kind_name(e.kind));
    cr_assert(strstr(e.msg, needle), "header %s: '%s' lacks '%s'", header, e.msg, needle);
  }
  free(b);
}

Test(tensor_file, npy_header_grammar) {
  /* What numpy writes, and what literal_eval also takes. */
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 24, 0, 0, "");
  expect_npy("{\"shape\":(2,3),\"descr\":\"<f4\",\"fortran_order\":False}", 24, 0, 0, "");
  expect_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (3L, 1L), }", 24, 0, 0, "");
  expect_npy("{'descr': '|u1', 'fortran_order': False, 'shape': (), }", 1, 0, 0, "");
  expect_npy("{'descr': '<f4', 'fortran_order': True, 'shape': (1, 4, 1), }", 16, 0, 0, "");
  /* Refused, each naming what was wrong. */
  expect_npy("{'descr': '<f4', 'shape': (2, 3), }", 24, -1, ERR_BAD_ARGUMENT,
             "key 'fortran_order' is missing");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", 8, -1,
             ERR_BAD_ARGUMENT, "unknown key 'x'");
  expect_npy("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", 8, -1,
             ERR_BAD_ARGUMENT, "key 'descr' appears twice");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }", 24, -1,
             ERR_BAD_ARGUMENT, "'shape' is a list");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (3), }", 12, -1,
             ERR_BAD_ARGUMENT, "is an int, not a tuple");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", 24, -1,
             ERR_BAD_ARGUMENT, "negative size -3 at dim 1");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': "
             "(1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1), }",
             4, -1, ERR_BAD_ARGUMENT, "17 dims is too many");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", 4,
             -1, ERR_BAD_ARGUMENT, "does not fit in 64 bits");
  expect_npy("{'descr': '<f\\x34', 'fortran_order': False, 'shape': (1,), }", 4, -1,
             ERR_BAD_ARGUMENT, "escape sequences");
  expect_npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", 4, -1,
             ERR_BAD_ARGUMENT, "structured dtypes");
  expect_npy("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (1,), }", 4, -1,
             ERR_BAD_ARGUMENT, "True or False");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,) ", 4, -1, ERR_BAD_ARGUMENT,
             "the dict ends early");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} x", 4, -1,
             ERR_BAD_ARGUMENT, "only spaces");
  expect_npy("{'descr': '<f4' 'fortran_order': False, 'shape': (1,)}", 4, -1, ERR_BAD_ARGUMENT,
             "expected ',' or '}'");
  expect_npy("{'descr': '<V2', 'fortran_order': False, 'shape': (1,)}", 2, -1, ERR_BAD_ARGUMENT,
             "bfloat16 has no .npy descr");
}

Test(tensor_file, npy_too_many_dims_for_the_process_limit_is_quota) {
  layout_set_limits(&(layout_limits_t){.max_dims = 2, .max_elements = 1000});
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1), }", 4, -1, ERR_QUOTA,
             "--max-tensor-dims");
  expect_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (100, 100), }", 40000, -1,
             ERR_QUOTA, "--max-tensor-elements");
  layout_set_limits(NULL);
}

Test(tensor_file, npy_bad_magic_version_and_lengths) {
  size_t len;
  uint8_t *b = read_fixture("f4_2x3.npy", &len);
  tensor_file_t f;
  meshd_error_t e;
  uint64_t need;
  tensor_file_opts_t npy = {.format = TENSOR_FILE_NPY, .file_size = len};

  b[1] = 'X';
  cr_assert_eq(tensor_file_parse(b, len, &npy, &f, &need, &e), -1);
  cr_assert(strstr(e.msg, "does not start with"), "%s", e.msg);
  b[1] = 'N';

  b[6] = 4;
  cr_assert_eq(parse(b, len, len, &f, &e), -1);
  cr_assert(strstr(e.msg, "format version 4.0 is not supported"), "%s", e.msg);
  b[6] = 1;

  /* A version 2.0 file of 11 bytes ends inside its 4-byte length field (fuzz). */
  b[6] = 2;
  cr_assert_eq(parse(b, 11, 11, &f, &e), -1);
  cr_assert(strstr(e.msg, "npy: the 11-byte file ends inside the header's length field"), "%s",
            e.msg);
  b[6] = 1;

  /* The header alone is 128 bytes: a 100-byte file cannot hold it. */
  cr_assert_eq(parse(b, 100, 100, &f, &e), -1);
  cr_assert(strstr(e.msg, "runs past the end of the 100-byte file"), "%s", e.msg);
  /* Header complete, data short. */
  cr_assert_eq(parse(b, len - 1, len - 1, &f, &e), -1);
  cr_assert(strstr(e.msg, "npy data: float32 [2, 3] needs 24 bytes after the 128-byte header, "
                          "but the file has 23"),
            "%s", e.msg);
  /* A header longer than the caller allows. */
  tensor_file_opts_t small = {.max_header_bytes = 64};
  cr_assert_eq(tensor_file_parse(b, len, &small, &f, &need, &e), -1);
  cr_assert(strstr(e.msg, "more than the 64-byte limit"), "%s", e.msg);
  /* Unknown file size: only what the header needs. */
  cr_assert_eq(tensor_file_parse(b, 20, NULL, &f, &need, &e), TENSOR_FILE_NEED_MORE);
  cr_assert_eq(need, 128);
  cr_assert_eq(tensor_file_parse(b, 128, NULL, &f, &need, &e), TENSOR_FILE_OK, "%s", e.msg);
  tensor_file_free(&f);
  free(b);
}

Test(tensor_file, too_short_files) {
  tensor_file_t f;
  meshd_error_t e;
  uint64_t need;
  cr_assert_eq(tensor_file_parse("\x93NU", 3, NULL, &f, &need, &e), TENSOR_FILE_NEED_MORE);
  cr_assert_eq(need, 8);
  tensor_file_opts_t o = {.file_size = 3};
  cr_assert_eq(tensor_file_parse("\x93NU", 3, &o, &f, &need, &e), -1);
  cr_assert(strstr(e.msg, "3 bytes is too short"), "%s", e.msg);
}

/* ---- safetensors ---- */

/* 8-byte little-endian length, the JSON, then data bytes 0, 1, 2, ... */
static uint8_t *make_st(const char *json, size_t data, size_t *len) {
  size_t n = strlen(json);
  uint8_t *b = malloc(8 + n + data + 1);
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)n >> (8 * i));
  memcpy(b + 8, json, n);
  for (size_t i = 0; i < data; i++) b[8 + n + i] = (uint8_t)i;
  *len = 8 + n + data;
  return b;
}

Test(tensor_file, safetensors_from_the_spec) {
  const char *json = "{\"__metadata__\":{\"format\":\"pt\"},"
                     "\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                     "\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[24,30]},"
                     "\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[30,38]},"
                     "\"e\":{\"dtype\":\"BOOL\",\"shape\":[0,4],\"data_offsets\":[38,38]}}    ";
  size_t len;
  uint8_t *b = make_st(json, 38, &len);
  tensor_file_t f;
  meshd_error_t e = {0};
  int rounds;
  cr_assert_eq(parse_incrementally(b, len, &f, &e, &rounds), 0, "%s", e.msg);
  cr_assert_eq(rounds, 2);
  uint64_t start = 8 + strlen(json);
  cr_assert_eq(f.format, TENSOR_FILE_SAFETENSORS);
  cr_assert_eq(f.header_bytes, start);
  cr_assert_eq(f.count, 4);
  cr_assert_str_eq(f.metadata_json, "{\"format\":\"pt\"}");
  const tensor_file_entry_t *w = tensor_file_find(&f, "w"), *bb = tensor_file_find(&f, "b"),
                            *s = tensor_file_find(&f, "s"), *em = tensor_file_find(&f, "e");
  cr_assert(w && bb && s && em);
  cr_assert_null(tensor_file_find(&f, "nope"));
  cr_assert_eq(w->dtype, DTYPE_FLOAT32);
  cr_assert_eq(w->ndim, 2);
  cr_assert_eq(w->shape[1], 3);
  cr_assert_eq(w->offset, start);
  cr_assert_eq(w->nbytes, 24);
  cr_assert_eq(bb->dtype, DTYPE_BFLOAT16);
  cr_assert_eq(bb->offset, start + 24);
  cr_assert_eq(bb->nbytes, 6);
  cr_assert_eq(s->dtype, DTYPE_INT64);
  cr_assert_eq(s->ndim, 0);
  cr_assert_eq(s->nbytes, 8);
  cr_assert_eq(b[s->offset], 30);
  cr_assert_eq(em->nbytes, 0);
  tensor_file_free(&f);
  tensor_file_free(&f); /* zeroed: a second free is harmless */
  free(b);
}

Test(tensor_file, safetensors_dtypes) {
  const char *names[] = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"};
  dtype_t want[] = {DTYPE_FLOAT64, DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16, DTYPE_INT64,
                    DTYPE_INT32,   DTYPE_INT16,   DTYPE_INT8,    DTYPE_UINT8,    DTYPE_BOOL};
  for (int i = 0; i < 10; i++) {
    char json[200];
    size_t sz = dtype_size(want[i]), len;
    snprintf(json, sizeof json, "{\"t\":{\"dtype\":\"%s\",\"shape\":[2],\"data_offsets\":[0,%zu]}}",
             names[i], 2 * sz);
    uint8_t *b = make_st(json, 2 * sz, &len);
    tensor_file_t f;
    meshd_error_t e;
    cr_assert_eq(parse(b, len, len, &f, &e), 0, "%s: %s", names[i], e.msg);
    cr_assert_eq(f.tensors[0].dtype, want[i], "%s", names[i]);
    tensor_file_free(&f);
    free(b);
  }
}

static void expect_st(const char *json, size_t data, int rc_want, error_kind_t kind,
                      const char *needle) {
  size_t len;
  uint8_t *b = make_st(json, data, &len);
  tensor_file_t f;
  meshd_error_t e = {0};
  int rc = parse(b, len, len, &f, &e);
  cr_assert_eq(rc, rc_want, "%s: rc %d (%s)", json, rc, e.msg);
  if (rc == 0) {
    tensor_file_free(&f);
  } else {
    cr_assert_eq(e.kind, kind, "%s: kind %s", json, error_kind_name(e.kind));
    cr_assert(strstr(e.msg, needle), "%s:\n '%s'\n lacks '%s'", json, e.msg, needle);
    cr_assert_null(f.tensors);
    cr_assert_null(f.metadata_json);
  }
  free(b);
}

Test(tensor_file, safetensors_malformed) {
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,10]}}", 12, -1,
            ERR_BAD_ARGUMENT,
            "safetensors header: tensor 'w': data_offsets [0, 10] hold 10 bytes but float32 [3] "
            "needs 12");
  expect_st("{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[3],\"data_offsets\":[0,3]}}", 3, -1,
            ERR_BAD_ARGUMENT, "tensor 'w': dtype \"F8_E4M3\" has no meshd dtype");
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
            "\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
            12, -1, ERR_BAD_ARGUMENT, "tensors 'w' [0, 8] and 'v' [4, 12] overlap");
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", 8, -1,
            ERR_BAD_ARGUMENT, "run past the end of the file, whose data part has 8 bytes");
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"
            "\"data_offsets\":[0,4]}}",
            4, -1, ERR_BAD_ARGUMENT, "tensor 'w': shape: 17 dims is too many");
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,-2],\"data_offsets\":[0,0]}}", 0, -1,
            ERR_BAD_ARGUMENT, "negative size -2 at dim 1");
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, -1,
            ERR_BAD_ARGUMENT, "\"shape\"[0] is not an integer");
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, -1,
            ERR_BAD_ARGUMENT, "0 <= begin <= end");
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, -1,
            ERR_BAD_ARGUMENT, "\"data_offsets\" must be [begin, end]");
  expect_st("{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, -1, ERR_BAD_ARGUMENT,
            "\"dtype\" must be a string");
  expect_st("{\"w\":[1,2]}", 0, -1, ERR_BAD_ARGUMENT, "tensor 'w' is not an object");
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, -1,
            ERR_BAD_ARGUMENT, "the JSON ends early");
  expect_st("{\"w\":{\"dtype\":\"F32\",,}}", 0, -1, ERR_BAD_ARGUMENT, "bad JSON near byte");
  expect_st("{\"w\": [1 2]}", 0, -1, ERR_BAD_ARGUMENT, "bad JSON");
  expect_st("[1, 2]", 0, -1, ERR_BAD_ARGUMENT, "does not start with '{'");
  expect_st("{} x", 0, -1, ERR_BAD_ARGUMENT, "byte 3 after the JSON object is not padding");
  expect_st("{\"__metadata__\":{\"n\":1}}", 0, -1, ERR_BAD_ARGUMENT,
            "\"__metadata__\" entry 'n' is not a string");
  expect_st("{\"__metadata__\":[]}", 0, -1, ERR_BAD_ARGUMENT, "must be an object of strings");
  /* Accepted: no tensors; empty tensors anywhere; gaps between tensors. */
  expect_st("{}", 0, 0, 0, "");
  expect_st("{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]},"
            "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
            8, 0, 0, "");
  expect_st("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[6,8]},"
            "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}",
            8, 0, 0, "");
}

/* json-c keeps the last of duplicate keys and cuts a key at \u0000: names given
 * twice, or equal up to a NUL, would silently become one tensor. */
Test(tensor_file, safetensors_names_given_twice_or_holding_nul) {
#define W(a, b) "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[" #a "," #b "]}"
  expect_st("{\"w\":" W(0, 8) ",\"w\":" W(8, 16) "}", 16, -1, ERR_BAD_ARGUMENT,
            "safetensors header: the name 'w' appears more than once");
  expect_st("{\"w\":" W(0, 8) ",\"v\":" W(8, 16) ", \"w\" :" W(16, 24) "}", 24, -1,
            ERR_BAD_ARGUMENT, "the name 'w' appears more than once");
  expect_st("{\"w\":" W(0, 8) ",\"\\u0077\":" W(8, 16) "}", 16, -1, ERR_BAD_ARGUMENT,
            "the name 'w' appears more than once");
  /* The header's metadata is no tensor: its message says so. */
  expect_st("{\"__metadata__\":{},\"__metadata__\":{}}", 0, -1, ERR_BAD_ARGUMENT,
            "the key '__metadata__' appears more than once at the top level, at bytes 1 and 19");
  expect_st("{\"a\\u0000x\":" W(0, 8) ",\"a\\u0000y\":" W(8, 16) "}", 16, -1, ERR_BAD_ARGUMENT,
            "holds \\u0000");
  expect_st("{\"a\\u0000x\":" W(0, 8) "}", 8, -1, ERR_BAD_ARGUMENT,
            "the name 'a\\u0000...' holds \\u0000");
  /* Accepted: the same keys inside each tensor, names that only look alike, escapes,
   * and keys in strings. */
  expect_st("{\"w\":" W(0, 8) ",\"w \":" W(8, 16) ",\"W\":" W(16, 24) ",\"a\\\"b\\\\\":"
            W(24, 32) ",\"__metadata__\":{\"w\":\"w:\",\"x\":\"{\\\"w\\\": 1}\"}}",
            32, 0, 0, "");
#undef W
}

Test(tensor_file, safetensors_header_length) {
  size_t len;
  uint8_t *b = make_st("{}", 0, &len);
  tensor_file_t f;
  meshd_error_t e;
  uint64_t need;
  /* Length past the file. */
  b[0] = 200;
  cr_assert_eq(parse(b, len, len, &f, &e), -1);
  cr_assert(strstr(e.msg, "safetensors header: its length 200 runs past the end of the 10-byte "
                          "file"),
            "%s", e.msg);
  /* Unknown size: asks for 8 + N. */
  cr_assert_eq(tensor_file_parse(b, len, NULL, &f, &need, &e), TENSOR_FILE_NEED_MORE);
  cr_assert_eq(need, 208);
  /* Past the caller's limit, and past the format's 100 MB. */
  tensor_file_opts_t o = {.max_header_bytes = 100};
  cr_assert_eq(tensor_file_parse(b, len, &o, &f, &need, &e), -1);
  cr_assert(strstr(e.msg, "its length 200 is more than the 100-byte limit"), "%s", e.msg);
  memset(b, 0xff, 8);
  cr_assert_eq(tensor_file_parse(b, len, NULL, &f, &need, &e), -1);
  cr_assert(strstr(e.msg, "is more than the 100000000-byte limit"), "%s", e.msg);
  /* guessed, not asked for: raw bytes without a dtype and shape are likelier */
  cr_assert(strstr(e.msg, "; raw bytes need a dtype and a shape"), "%s", e.msg);
  o = (tensor_file_opts_t){.format = TENSOR_FILE_SAFETENSORS};
  cr_assert_eq(tensor_file_parse(b, len, &o, &f, &need, &e), -1);
  cr_assert(!strstr(e.msg, "raw bytes"), "asked for safetensors: %s", e.msg);
  free(b);
}

Test(tensor_file, safetensors_shape_past_the_process_limit_is_quota) {
  layout_set_limits(&(layout_limits_t){.max_dims = 1, .max_elements = 1 << 20});
  expect_st("{\"w\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[0,8]}}", 8, -1,
            ERR_QUOTA, "tensor 'w': shape: 2 dims is more than the 1");
  layout_set_limits(NULL);
}

/* ---- safetensors index ---- */

/* What huggingface's save_pretrained writes next to the shards (indented). */
static const char hf_index[] =
    "{\n  \"metadata\": {\n    \"total_size\": 28\n  },\n  \"weight_map\": {\n"
    "    \"lm_head.weight\": \"model-00002-of-00002.safetensors\",\n"
    "    \"model.embed.weight\": \"model-00001-of-00002.safetensors\",\n"
    "    \"model.norm.weight\": \"sub/dir/model-00002-of-00002.safetensors\"\n  }\n}\n";

Test(tensor_file, safetensors_index_as_huggingface_writes_it) {
  size_t len = strlen(hf_index);
  tensor_file_t f;
  meshd_error_t e = {0};
  int rounds;
  /* Whatever the first read holds, the whole file is asked for, then parsed. */
  cr_assert_eq(parse_incrementally((const uint8_t *)hf_index, len, &f, &e, &rounds), 0, "%s",
               e.msg);
  cr_assert_eq(rounds, 2);
  cr_assert_eq(f.format, TENSOR_FILE_SAFETENSORS_INDEX);
  cr_assert_eq(f.count, 3);
  cr_assert_str_eq(f.metadata_json, "{\"total_size\":28}");
  const tensor_file_entry_t *t = tensor_file_find(&f, "model.norm.weight");
  cr_assert(t);
  cr_assert_str_eq(t->file, "sub/dir/model-00002-of-00002.safetensors");
  cr_assert_str_eq(tensor_file_find(&f, "lm_head.weight")->file,
                   "model-00002-of-00002.safetensors");
  cr_assert_null(tensor_file_find(&f, "missing"));
  tensor_file_free(&f);
  /* A safetensors file is still one, even when its header's length starts
   * with '{' (0x7b = 123 bytes of JSON): its high length bytes are 0. */
  char json[124];
  memset(json, ' ', sizeof json);
  static const char w[] = "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  memcpy(json, w, strlen(w));
  json[123] = 0;
  size_t slen;
  uint8_t *b = make_st(json, 1, &slen);
  cr_assert_eq(b[0], '{');
  cr_assert_eq(parse(b, slen, slen, &f, &e), 0, "%s", e.msg);
  cr_assert_eq(f.format, TENSOR_FILE_SAFETENSORS);
  cr_assert_null(f.tensors[0].file);
  tensor_file_free(&f);
  free(b);
}

static void expect_index(const char *json, error_kind_t kind, const char *needle) {
  tensor_file_t f;
  meshd_error_t e = {0};
  size_t len = strlen(json);
  int rc = parse((const uint8_t *)json, len, len, &f, &e);
  cr_assert_eq(rc, -1, "%s: rc %d", json, rc);
  cr_assert_eq(e.kind, kind, "%s: kind %s", json, error_kind_name(e.kind));
  cr_assert(strstr(e.msg, needle), "%s:\n '%s'\n lacks '%s'", json, e.msg, needle);
  cr_assert_null(f.tensors);
  cr_assert_null(f.metadata_json);
}

Test(tensor_file, safetensors_index_refusals) {
  expect_index("{\"metadata\": {}}   ", ERR_BAD_ARGUMENT, "no \"weight_map\" object");
  expect_index("{\"weight_map\": [\"a\"]}", ERR_BAD_ARGUMENT, "no \"weight_map\" object");
  expect_index("{\"weight_map\": {}}     ", ERR_BAD_ARGUMENT, "\"weight_map\" is empty");
  expect_index("{\"weight_map\": {\"w\": 3}}", ERR_BAD_ARGUMENT,
               "tensor 'w': its file must be a string");
  expect_index("{\"weight_map\": {\"w\": \"a.st\"}} x", ERR_BAD_ARGUMENT,
               "byte 30 after the JSON object is not padding");
  expect_index("{\"weight_map\": {\"w\": \"a.st\"", ERR_BAD_ARGUMENT, "the JSON ends early");
  expect_index("{\"weight_map\": {\"w\": \"a.st\",}}", ERR_BAD_ARGUMENT, "bad JSON near byte");
  /* File names go into URLs: only plain relative paths. */
  static const struct {
    const char *file, *why;
  } bad[] = {
      {"", "is empty"},
      {"/etc/passwd", "starts with '/'"},
      {"../secret.safetensors", "'..' segment"},
      {"a/../../b", "'..' segment"},
      {"./a", "'.' or '..' segment"},
      {"a//b", "empty path segment"},
      {"a/", "empty path segment"},
      {"https://evil.example/x", "a character other than"},
      {"a?x=1", "a character other than"},
      {"a%2e%2e", "a character other than"},
      {"a b", "a character other than"},
      {"a\\\\b", "a character other than"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char json[256];
    snprintf(json, sizeof json, "{\"weight_map\": {\"ok\": \"x.st\", \"w\": \"%s\"}}", bad[i].file);
    char needle[128];
    snprintf(needle, sizeof needle, "tensor 'w': file \"");
    expect_index(json, ERR_BAD_ARGUMENT, needle);
    expect_index(json, ERR_BAD_ARGUMENT, bad[i].why);
  }
  /* An index past the header limit is refused before it is read. */
  tensor_file_opts_t o = {.file_size = 2000, .max_header_bytes = 1000};
  tensor_file_t f;
  meshd_error_t e = {0};
  uint64_t need;
  cr_assert_eq(tensor_file_parse("{ \"weight_map\"", 14, &o, &f, &need, &e), -1);
  cr_assert(strstr(e.msg, "the file has 2000 bytes, more than the 1000-byte limit"), "%s", e.msg);
}

/* ---- shards ---- */

static tensor_file_entry_t entry(dtype_t d, int ndim, const int64_t *shape, uint64_t offset) {
  tensor_file_entry_t t = {.name = "t", .dtype = d, .ndim = ndim, .offset = offset};
  if (ndim) memcpy(t.shape, shape, sizeof(int64_t) * (size_t)ndim);
  meshd_error_t e;
  cr_assert_eq(layout_check_shape(NULL, shape, ndim, dtype_size(d), &e), 0);
  t.nbytes = dtype_size(d);
  for (int i = 0; i < ndim; i++) t.nbytes *= (uint64_t)shape[i];
  return t;
}

Test(tensor_file, shard_ranges) {
  meshd_error_t e;
  tensor_file_slice_t s;
  tensor_file_entry_t t = entry(DTYPE_FLOAT32, 2, (int64_t[]){4, 3}, 100);
  cr_assert_eq(tensor_file_shard(&t, 0, 2, 1, &s, &e), 0, "%s", e.msg);
  cr_assert_eq(s.shape[0], 2);
  cr_assert_eq(s.shape[1], 3);
  cr_assert_eq(s.count, 1);
  cr_assert_eq(s.first, 124);
  cr_assert_eq(s.length, 24);

  t = entry(DTYPE_FLOAT32, 2, (int64_t[]){2, 4}, 0);
  cr_assert_eq(tensor_file_shard(&t, -1, 2, 1, &s, &e), 0, "%s", e.msg);
  cr_assert_eq(s.count, 2);
  cr_assert_eq(s.length, 8);
  cr_assert_eq(s.stride, 16);
  tensor_file_range_t r = tensor_file_slice_range(&s, 1);
  cr_assert_eq(r.offset, 24);
  cr_assert_eq(r.length, 8);

  /* One rank, or a leading dim of 1: one range. */
  cr_assert_eq(tensor_file_shard(&t, 1, 1, 0, &s, &e), 0);
  cr_assert_eq(s.count, 1);
  cr_assert_eq(s.length, 32);
  t = entry(DTYPE_FLOAT32, 2, (int64_t[]){1, 4}, 8);
  cr_assert_eq(tensor_file_shard(&t, 1, 4, 3, &s, &e), 0);
  cr_assert_eq(s.count, 1);
  cr_assert_eq(s.first, 20);
  cr_assert_eq(s.length, 4);

  /* Empty: no ranges. */
  t = entry(DTYPE_FLOAT32, 2, (int64_t[]){0, 4}, 8);
  cr_assert_eq(tensor_file_shard(&t, 1, 2, 0, &s, &e), 0);
  cr_assert_eq(s.count, 0);
}

Test(tensor_file, shard_refusals) {
  meshd_error_t e;
  tensor_file_slice_t s;
  tensor_file_entry_t t = entry(DTYPE_FLOAT32, 2, (int64_t[]){5, 3}, 0);
  cr_assert_eq(tensor_file_shard(&t, 0, 2, 0, &s, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(e.msg, "tensor 't' of shape [5, 3]: dim 0 (size 5) does not split evenly over "
                          "2 ranks"),
            "%s", e.msg);
  cr_assert_eq(tensor_file_shard(&t, 2, 2, 0, &s, &e), -1);
  cr_assert_eq(e.kind, ERR_BAD_DIM);
  cr_assert_eq(tensor_file_shard(&t, 1, 3, 3, &s, &e), -1);
  cr_assert(strstr(e.msg, "rank 3 is outside [0, 3)"), "%s", e.msg);
  cr_assert_eq(tensor_file_shard(&t, 1, 0, 0, &s, &e), -1);
  tensor_file_entry_t scalar = entry(DTYPE_FLOAT32, 0, NULL, 0);
  cr_assert_eq(tensor_file_shard(&scalar, 0, 1, 0, &s, &e), -1);
}

/* Every split of a [4, 6, 2] int8 tensor whose byte i holds i, against the
 * slice computed element by element. */
Test(tensor_file, shard_ranges_match_the_slices) {
  int64_t shape[3] = {4, 6, 2};
  tensor_file_entry_t t = entry(DTYPE_INT8, 3, shape, 5);
  uint8_t file[5 + 48];
  for (int i = 0; i < 48; i++) file[5 + i] = (uint8_t)i;
  for (int d = 0; d < 3; d++) {
    for (int64_t n = 1; n <= shape[d]; n++) {
      if (shape[d] % n) continue;
      for (int64_t r = 0; r < n; r++) {
        tensor_file_slice_t s;
        meshd_error_t e;
        cr_assert_eq(tensor_file_shard(&t, d, n, r, &s, &e), 0, "%s", e.msg);
        uint8_t got[48], want[48];
        size_t ng = 0, nw = 0;
        for (uint64_t i = 0; i < s.count; i++) {
          tensor_file_range_t rg = tensor_file_slice_range(&s, i);
          cr_assert_leq(rg.offset + rg.length, sizeof file);
          memcpy(got + ng, file + rg.offset, rg.length);
          ng += rg.length;
        }
        int64_t part = shape[d] / n;
        for (int a = 0; a < 4; a++)
          for (int b = 0; b < 6; b++)
            for (int c = 0; c < 2; c++) {
              int idx[3] = {a, b, c};
              if (idx[d] >= r * part && idx[d] < (r + 1) * part) want[nw++] = (uint8_t)(a * 12 + b * 2 + c);
            }
        cr_assert_eq(ng, nw, "dim %d, %lld ranks, rank %lld", d, (long long)n, (long long)r);
        cr_assert_arr_eq(got, want, nw, "dim %d, %lld ranks, rank %lld", d, (long long)n,
                         (long long)r);
        cr_assert_eq(s.shape[d], part);
      }
    }
  }
}

/* json-c keeps the last of duplicate keys: an index naming a tensor twice (two
 * files for one tensor) must be refused, not loaded from whichever came last. */
Test(tensor_file, safetensors_index_refuses_a_tensor_named_twice) {
  expect_index("{\"weight_map\": {\"w\": \"a.st\", \"v\": \"a.st\", \"w\": \"b.st\"}}",
               ERR_BAD_ARGUMENT, "safetensors index: the name 'w' appears more than once in "
               "\"weight_map\", at bytes 16 and 42 of its JSON (each tensor must be named once)");
  /* Decoded before compared: "\u0077" is "w". */
  expect_index("{\"weight_map\": {\"w\": \"a.st\", \"\\u0077\": \"b.st\"}}", ERR_BAD_ARGUMENT,
               "the name 'w' appears more than once");
  expect_index("{\"weight_map\": {\"w\\u0000x\": \"a.st\"}}", ERR_BAD_ARGUMENT, "holds \\u0000");
  /* A key of the index's root given twice is refused too, named as the key it
   * is and where, not as a tensor named twice. */
  const char *meta2 = "{\"metadata\": {\"total_size\": 4}, \"metadata\": {}, "
                      "\"weight_map\": {\"w\": \"a.st\"}}";
  expect_index(meta2, ERR_BAD_ARGUMENT, "safetensors index: the key 'metadata' appears more "
               "than once at the top level, at bytes 1 and 32 of its JSON");
  expect_index(meta2, ERR_BAD_ARGUMENT, "each key must be given once");
  {
    tensor_file_t g;
    meshd_error_t ge = {0};
    cr_assert_eq(parse((const uint8_t *)meta2, strlen(meta2), strlen(meta2), &g, &ge), -1);
    cr_assert_null(strstr(ge.msg, "each tensor"), "an index's own key read as a tensor: %s",
                   ge.msg);
  }
  /* The same name in metadata, or a key inside a nested object, is no duplicate. */
  tensor_file_t f;
  meshd_error_t e = {0};
  const char *ok = "{\"metadata\": {\"w\": 1, \"total_size\": 4}, \"x\": {\"w\": 1},"
                   " \"weight_map\": {\"w\": \"a.st\", \"v\": \"a.st\"}}";
  cr_assert_eq(parse((const uint8_t *)ok, strlen(ok), strlen(ok), &f, &e), 0, "%s", e.msg);
  cr_assert_eq(f.count, 2);
  tensor_file_free(&f);
}
