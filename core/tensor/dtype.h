/* Element types. The values equal meshd.v1.DType in tensor_service.proto, so a
 * dtype read off the wire is a dtype_t without a lookup. One table gives each
 * dtype's name (torch's spelling), element size and category. */
#ifndef MESHD_DTYPE_H
#define MESHD_DTYPE_H

#include <stdbool.h>
#include <stddef.h>

/* Categories in promotion order: a value may be cast to its own or a higher one. */
typedef enum { DTYPE_CAT_BOOL = 0, DTYPE_CAT_INT = 1, DTYPE_CAT_FLOAT = 2 } dtype_category_t;

/* XX(NAME, proto value, name, element size in bytes, category) */
#define DTYPE_MAP(XX)                                     \
  XX(FLOAT32, 1, "float32", 4, DTYPE_CAT_FLOAT)          \
  XX(FLOAT64, 2, "float64", 8, DTYPE_CAT_FLOAT)          \
  XX(FLOAT16, 3, "float16", 2, DTYPE_CAT_FLOAT)          \
  XX(BFLOAT16, 4, "bfloat16", 2, DTYPE_CAT_FLOAT)        \
  XX(INT8, 5, "int8", 1, DTYPE_CAT_INT)                  \
  XX(UINT8, 6, "uint8", 1, DTYPE_CAT_INT)                \
  XX(INT16, 7, "int16", 2, DTYPE_CAT_INT)                \
  XX(INT32, 8, "int32", 4, DTYPE_CAT_INT)                \
  XX(INT64, 9, "int64", 8, DTYPE_CAT_INT)                \
  XX(BOOL, 10, "bool", 1, DTYPE_CAT_BOOL)

typedef enum {
  DTYPE_INVALID = 0, /* DTYPE_UNSPECIFIED on the wire */
#define XX(name, value, str, size, cat) DTYPE_##name = value,
  DTYPE_MAP(XX)
#undef XX
} dtype_t;

/* Torch's default floating dtype (torch.get_default_dtype()). */
#define DTYPE_DEFAULT_FLOAT DTYPE_FLOAT32

bool dtype_valid(dtype_t d);
/* "float32"; "invalid" for a value outside the table. */
const char *dtype_name(dtype_t d);
/* Bytes per element; 0 for an invalid dtype. */
size_t dtype_size(dtype_t d);
dtype_category_t dtype_category(dtype_t d);
/* A table name, optionally prefixed "torch.", or a torch alias: float double half
 * long int short. DTYPE_INVALID for anything else (and for NULL). */
dtype_t dtype_parse(const char *s);
bool dtype_is_floating(dtype_t d);
/* Integer dtypes; bool counts only when include_bool. */
bool dtype_is_integral(dtype_t d, bool include_bool);
/* torch.promote_types: the smallest dtype both values fit in (bf16+f16 -> f32,
 * uint8+int8 -> int16, bool+x -> x). DTYPE_INVALID if either is invalid. */
dtype_t dtype_promote(dtype_t a, dtype_t b);
/* torch.can_cast: false only when casting down a category (float -> int,
 * float or int -> bool). */
bool dtype_can_cast(dtype_t from, dtype_t to);

#endif
