/* The safetensors format (huggingface/safetensors): N as 8 bytes little-endian,
 * N bytes of JSON (padded with spaces), then the data:
 *   {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...,
 *    "__metadata__": {"format": "pt"}}
 * Offsets count from the end of the header. The JSON goes through json-c
 * (reentrant, exact 64-bit integers). Its objects keep the last of duplicate
 * keys and cut a key at \u0000, so the header's names are checked apart
 * (check_names): a name given twice, or holding \u0000, is refused. Gaps
 * between tensors are allowed (the reference refuses them; they are harmless
 * here: only overlaps are refused). Even in strict mode json-c takes a few
 * things JSON does not: single-quoted keys and NaN and Infinity (refused
 * anyway where a number is read: sizes and offsets must be integers). */
#include <inttypes.h>
#include <json-c/json.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_file_internal.h"

#define CTX "safetensors header"

static const struct {
  const char *name;
  dtype_t dtype;
} dtypes[] = {{"F64", DTYPE_FLOAT64}, {"F32", DTYPE_FLOAT32}, {"F16", DTYPE_FLOAT16},
              {"BF16", DTYPE_BFLOAT16}, {"I64", DTYPE_INT64}, {"I32", DTYPE_INT32},
              {"I16", DTYPE_INT16},   {"I8", DTYPE_INT8},     {"U8", DTYPE_UINT8},
              {"BOOL", DTYPE_BOOL}};

static int entry_dtype(const char *name, json_object *v, dtype_t *out, meshd_error_t *e) {
  if (!v || !json_object_is_type(v, json_type_string))
    return error_set(e, ERR_BAD_ARGUMENT, CTX ": tensor '%.*s': \"dtype\" must be a string such "
                     "as \"F32\"", TF_NAME_MAX, name);
  const char *s = json_object_get_string(v);
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
    if (strcmp(s, dtypes[i].name) == 0) return *out = dtypes[i].dtype, 0;
  return error_set(e, ERR_BAD_ARGUMENT,
                   CTX ": tensor '%.*s': dtype \"%.32s\" has no meshd dtype (meshd reads F64 F32 "
                   "F16 BF16 I64 I32 I16 I8 U8 BOOL)",
                   TF_NAME_MAX, name, s);
}

/* An integer array element; json-c saturates values past int64 at INT64_MAX,
 * which no valid size or offset reaches. */
static int get_int(json_object *v, int64_t *out) {
  if (!v || !json_object_is_type(v, json_type_int)) return -1;
  *out = json_object_get_int64(v);
  return *out == INT64_MAX ? -1 : 0;
}

static int entry_shape(const char *name, json_object *v, tensor_file_entry_t *t, meshd_error_t *e) {
  if (!v || !json_object_is_type(v, json_type_array))
    return error_set(e, ERR_BAD_ARGUMENT, CTX ": tensor '%.*s': \"shape\" must be an array of "
                     "sizes such as [2, 3]", TF_NAME_MAX, name);
  size_t n = json_object_array_length(v);
  for (size_t i = 0; i < n && i < LAYOUT_MAX_DIMS; i++)
    if (get_int(json_object_array_get_idx(v, i), &t->shape[i]))
      return error_set(e, ERR_BAD_ARGUMENT,
                       CTX ": tensor '%.*s': \"shape\"[%zu] is not an integer below 2^63",
                       TF_NAME_MAX, name, i);
  t->ndim = n > INT32_MAX ? INT32_MAX : (int)n;
  return 0;
}

static int entry_offsets(const char *name, json_object *v, int64_t off[2], meshd_error_t *e) {
  if (!v || !json_object_is_type(v, json_type_array) || json_object_array_length(v) != 2 ||
      get_int(json_object_array_get_idx(v, 0), &off[0]) ||
      get_int(json_object_array_get_idx(v, 1), &off[1]) || off[0] < 0 || off[1] < off[0])
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": tensor '%.*s': \"data_offsets\" must be [begin, end] with "
                     "0 <= begin <= end",
                     TF_NAME_MAX, name);
  return 0;
}

static int check_metadata(json_object *v, meshd_error_t *e) {
  if (!json_object_is_type(v, json_type_object))
    return error_set(e, ERR_BAD_ARGUMENT, CTX ": \"__metadata__\" must be an object of strings");
  json_object_object_foreach(v, k, val) {
    if (!json_object_is_type(val, json_type_string))
      return error_set(e, ERR_BAD_ARGUMENT,
                       CTX ": \"__metadata__\" entry '%.*s' is not a string (the format allows "
                       "strings only)",
                       TF_NAME_MAX, k);
  }
  return 0;
}

static int entry_parse(const char *name, json_object *v, uint64_t data_start, uint64_t data_size,
                       tensor_file_entry_t *t, meshd_error_t *e) {
  char ctx[TF_NAME_MAX + 64], shape[LAYOUT_SHAPE_BUF];
  int64_t off[2] = {0, 0};
  if (!json_object_is_type(v, json_type_object))
    return error_set(e, ERR_BAD_ARGUMENT, CTX ": tensor '%.*s' is not an object with \"dtype\", "
                     "\"shape\" and \"data_offsets\"", TF_NAME_MAX, name);
  json_object *d = NULL, *s = NULL, *o = NULL;
  json_object_object_get_ex(v, "dtype", &d);
  json_object_object_get_ex(v, "shape", &s);
  json_object_object_get_ex(v, "data_offsets", &o);
  snprintf(ctx, sizeof ctx, CTX ": tensor '%.*s': shape", TF_NAME_MAX, name);
  if (entry_dtype(name, d, &t->dtype, e) || entry_shape(name, s, t, e) ||
      entry_offsets(name, o, off, e) || tensor_file_entry_finish(t, ctx, e))
    return -1;
  uint64_t held = (uint64_t)(off[1] - off[0]);
  if (held != t->nbytes)
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": tensor '%.*s': data_offsets [%" PRId64 ", %" PRId64 "] hold %" PRIu64
                     " bytes but %s %s needs %" PRIu64,
                     TF_NAME_MAX, name, off[0], off[1], held, dtype_name(t->dtype),
                     layout_format_shape(t->shape, t->ndim, shape, sizeof shape), t->nbytes);
  if (data_size != UINT64_MAX && (uint64_t)off[1] > data_size)
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": tensor '%.*s': data_offsets [%" PRId64 ", %" PRId64 "] run past the "
                     "end of the file, whose data part has %" PRIu64 " bytes",
                     TF_NAME_MAX, name, off[0], off[1], data_size);
  t->offset = data_start + (uint64_t)off[0];
  return 0;
}

static int by_offset(const void *a, const void *b) {
  const tensor_file_entry_t *x = *(tensor_file_entry_t *const *)a, *y = *(tensor_file_entry_t *const *)b;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Empty tensors hold no bytes and overlap nothing. */
static int check_overlaps(tensor_file_t *f, uint64_t data_start, meshd_error_t *e) {
  if (f->count < 2) return 0;
  tensor_file_entry_t **v = malloc(f->count * sizeof *v);
  if (!v) return error_set(e, ERR_QUOTA, CTX ": out of memory");
  size_t n = 0;
  for (size_t i = 0; i < f->count; i++)
    if (f->tensors[i].nbytes) v[n++] = &f->tensors[i];
  qsort(v, n, sizeof *v, by_offset);
  int rc = 0;
  for (size_t i = 1; i < n && !rc; i++) {
    const tensor_file_entry_t *a = v[i - 1], *b = v[i];
    if (b->offset < a->offset + a->nbytes)
      rc = error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": tensors '%.*s' [%" PRIu64 ", %" PRIu64 "] and '%.*s' [%" PRIu64
                     ", %" PRIu64 "] overlap",
                     TF_NAME_MAX, a->name, a->offset - data_start, a->offset - data_start + a->nbytes,
                     TF_NAME_MAX, b->name, b->offset - data_start, b->offset - data_start + b->nbytes);
  }
  free(v);
  return rc;
}

int tensor_file_json(const char *ctx, const char *text, size_t n, const char *padding,
                     json_object **out, meshd_error_t *e) {
  struct json_tokener *tok = json_tokener_new_ex(JSON_DEPTH);
  if (!tok) return error_set(e, ERR_QUOTA, "%s: out of memory", ctx);
  json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_ALLOW_TRAILING_CHARS |
                                  JSON_TOKENER_VALIDATE_UTF8);
  json_object *root = json_tokener_parse_ex(tok, text, (int)n);
  enum json_tokener_error err = json_tokener_get_error(tok);
  size_t end = json_tokener_get_parse_end(tok);
  json_tokener_free(tok);
  int rc = 0;
  if (err == json_tokener_continue)
    rc = error_set(e, ERR_BAD_ARGUMENT, "%s: the JSON ends early (%zu bytes)", ctx, n);
  else if (err != json_tokener_success || !root)
    rc = error_set(e, ERR_BAD_ARGUMENT, "%s: bad JSON near byte %zu: %s", ctx, end,
                   json_tokener_error_desc(err));
  else if (!json_object_is_type(root, json_type_object))
    rc = error_set(e, ERR_BAD_ARGUMENT, "%s: the JSON is a %s, not an object", ctx,
                   json_type_to_name(json_object_get_type(root)));
  for (size_t i = end; !rc && i < n; i++)
    if (!strchr(padding, text[i]) || !text[i])
      rc = error_set(e, ERR_BAD_ARGUMENT, "%s: byte %zu after the JSON object is not padding "
                     "(whitespace)", ctx, i);
  if (rc) json_object_put(root);
  else *out = root;
  return rc;
}

typedef struct {
  const char *s;
  size_t len;
  size_t at; /* its opening quote's byte in the text */
} key_t_;

static int by_key(const void *a, const void *b) {
  const key_t_ *x = a, *y = b;
  size_t n = x->len < y->len ? x->len : y->len;
  int c = memcmp(x->s, y->s, n);
  return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* Whether key k names a tensor: every key checked, where they are tensor
 * names, but a header's "__metadata__". */
static bool names_a_tensor(const key_t_ *k, const char *within, bool tensor_names) {
  static const char meta[] = "__metadata__";
  return tensor_names && (within || k->len != sizeof meta - 1 || memcmp(k->s, meta, k->len) != 0);
}

/* Key a given again as b: named with both places, and why once is the rule
 * (a tensor's file or entry would be one of two; any other key's value too). */
static int duplicate_key(const char *ctx, const char *within, bool tensor_names,
                         const key_t_ *a, const key_t_ *b, meshd_error_t *e) {
  char where[TF_NAME_MAX + 16] = "at the top level";
  if (within) snprintf(where, sizeof where, "in \"%.*s\"", TF_NAME_MAX, within);
  size_t first = a->at < b->at ? a->at : b->at, second = a->at < b->at ? b->at : a->at;
  int len = (int)(b->len < TF_NAME_MAX ? b->len : TF_NAME_MAX);
  if (names_a_tensor(b, within, tensor_names))
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: the name '%.*s' appears more than once %s, at bytes %zu and %zu of "
                     "its JSON (each tensor must be named once)",
                     ctx, len, b->s, where, first, second);
  return error_set(e, ERR_BAD_ARGUMENT,
                   "%s: the key '%.*s' appears more than once %s, at bytes %zu and %zu of its "
                   "JSON (each key must be given once: a JSON reader keeps only one of them)",
                   ctx, len, b->s, where, first, second);
}

/* json-c keeps the last of duplicate keys and cuts a key at \u0000, so two
 * tensors could silently become one. The root object's keys are found by a
 * scan of its text (valid JSON: json-c parsed it) that follows only strings
 * and brackets, and each is decoded by json-c: a name that holds NUL or
 * appears twice is refused. The index (within "weight_map") is checked by
 * the same scan, one level down. */
int tensor_file_check_names(const char *ctx, const char *text, size_t n, const char *within,
                            bool tensor_names, meshd_error_t *e) {
  struct json_tokener *tok = json_tokener_new_ex(2);
  key_t_ *keys = NULL;
  json_object **held = NULL;
  size_t nkeys = 0, cap = 0, nheld = 0;
  int depth = 0, rc = 0;
  int want = within ? -1 : 1; /* the depth whose keys are checked; -1: not inside it */
  bool value_next = false;    /* the last root key was `within`: its value comes */
  if (!tok) return error_set(e, ERR_QUOTA, "%s: out of memory", ctx);
  for (size_t i = 0; i < n && !rc; i++) {
    char ch = text[i];
    if (ch == '{' || ch == '[') {
      depth++;
      if (value_next && ch == '{' && depth == 2) want = 2;
      value_next = false;
    } else if (ch == '}' || ch == ']') {
      if (within && depth == want) want = -1;
      depth--;
    } else if (value_next && !strchr(" \t\r\n:", ch)) {
      value_next = false;
    }
    if (ch != '"' && ch != '\'') continue;
    size_t k = i + 1; /* the closing quote */
    for (; k < n && text[k] != ch; k++)
      if (text[k] == '\\') k++;
    if (k >= n) break;
    size_t after = k + 1;
    while (after < n && strchr(" \t\r\n", text[after])) after++;
    bool named = after < n && text[after] == ':';
    bool key = named && depth == want, outer = within && named && depth == 1;
    size_t start = i;
    i = k;
    if (!key && !outer) continue;
    const char *s = text + start + 1;
    size_t len = k - start - 1;
    if (memchr(s, '\\', len)) { /* escapes: json-c decodes them */
      json_tokener_reset(tok);
      json_object *o = json_tokener_parse_ex(tok, text + start, (int)(k - start + 1));
      if (!o || !json_object_is_type(o, json_type_string)) {
        json_object_put(o);
        rc = error_set(e, ERR_BAD_ARGUMENT, "%s: cannot read the name at byte %zu", ctx, start);
        break;
      }
      if (nheld % 64 == 0) {
        json_object **h = realloc(held, (nheld + 64) * sizeof *h);
        if (!h) {
          json_object_put(o);
          rc = error_set(e, ERR_QUOTA, "%s: out of memory", ctx);
          break;
        }
        held = h;
      }
      held[nheld++] = o;
      s = json_object_get_string(o);
      len = (size_t)json_object_get_string_len(o);
    }
    if (outer) {
      value_next = len == strlen(within) && memcmp(s, within, len) == 0;
      continue;
    }
    if (memchr(s, '\0', len)) {
      rc = error_set(e, ERR_BAD_ARGUMENT,
                     "%s: the name '%.*s\\u0000...' holds \\u0000 (NUL), which %s must not",
                     ctx, (int)strnlen(s, TF_NAME_MAX), s, tensor_names ? "tensor names" : "keys");
      break;
    }
    if (nkeys == cap) {
      size_t ncap = cap ? 2 * cap : 64;
      key_t_ *nk = realloc(keys, ncap * sizeof *nk);
      if (!nk) {
        rc = error_set(e, ERR_QUOTA, "%s: out of memory", ctx);
        break;
      }
      keys = nk;
      cap = ncap;
    }
    keys[nkeys++] = (key_t_){s, len, start};
  }
  if (!rc && nkeys > 1) {
    qsort(keys, nkeys, sizeof *keys, by_key);
    for (size_t i = 1; i < nkeys && !rc; i++)
      if (!by_key(&keys[i - 1], &keys[i]))
        rc = duplicate_key(ctx, within, tensor_names, &keys[i - 1], &keys[i], e);
  }
  for (size_t i = 0; i < nheld; i++) json_object_put(held[i]);
  free(held);
  free(keys);
  json_tokener_free(tok);
  return rc;
}

int safetensors_header_parse(const uint8_t *buf, size_t len, const tensor_file_opts_t *o,
                             tensor_file_t *out, uint64_t *need, meshd_error_t *e) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | buf[i];
  if (n > o->max_header_bytes)
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": its length %" PRIu64 " is more than the %" PRIu64 "-byte limit (is "
                     "this a safetensors file?)",
                     n, o->max_header_bytes);
  uint64_t data_start = 8 + n;
  if (o->file_size && data_start > o->file_size)
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": its length %" PRIu64 " runs past the end of the %" PRIu64 "-byte file",
                     n, o->file_size);
  if (len < data_start) {
    *need = data_start;
    return TENSOR_FILE_NEED_MORE;
  }
  if (n < 2 || buf[8] != '{')
    return error_set(e, ERR_BAD_ARGUMENT, CTX ": does not start with '{' (is this a safetensors "
                     "file?)");
  json_object *root;
  if (tensor_file_json(CTX, (const char *)buf + 8, n, " ", &root, e)) return -1;
  if (tensor_file_check_names(CTX, (const char *)buf + 8, n, NULL, true, e)) {
    json_object_put(root);
    return -1;
  }
  uint64_t data_size = o->file_size ? o->file_size - data_start : UINT64_MAX;
  size_t cap = (size_t)json_object_object_length(root);
  int rc = -1;
  out->format = TENSOR_FILE_SAFETENSORS;
  out->header_bytes = data_start;
  if (cap && !(out->tensors = calloc(cap, sizeof *out->tensors))) {
    error_set(e, ERR_QUOTA, CTX ": out of memory");
    goto out;
  }
  json_object_object_foreach(root, key, val) {
    if (strcmp(key, "__metadata__") == 0) {
      if (check_metadata(val, e)) goto out;
      const char *s = json_object_to_json_string_ext(val, JSON_C_TO_STRING_PLAIN);
      if (!(out->metadata_json = strdup(s))) {
        error_set(e, ERR_QUOTA, CTX ": out of memory");
        goto out;
      }
      continue;
    }
    tensor_file_entry_t *t = &out->tensors[out->count];
    if (!(t->name = strdup(key))) {
      error_set(e, ERR_QUOTA, CTX ": out of memory");
      goto out;
    }
    out->count++; /* owns the name from here */
    if (entry_parse(key, val, data_start, data_size, t, e)) goto out;
  }
  rc = check_overlaps(out, data_start, e) ? -1 : TENSOR_FILE_OK;
out:
  json_object_put(root);
  if (rc < 0) tensor_file_free(out);
  return rc;
}
