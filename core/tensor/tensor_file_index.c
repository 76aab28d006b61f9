/* The index of a checkpoint split over several safetensors files, as Hugging
 * Face's save_pretrained writes it next to them (model.safetensors.index.json):
 *   {"metadata": {"total_size": 140000000000},
 *    "weight_map": {"lm_head.weight": "model-00030-of-00030.safetensors", ...}}
 * The whole file is the header. Each entry gets its name and file; the caller
 * reads dtype, shape and offset from that file's own header. File names are
 * relative to the index and go into URLs, so only plain paths pass: segments
 * of [A-Za-z0-9._-], no "." or ".." segment, no leading '/', no scheme, query
 * or escapes. Keys other than "metadata" and "weight_map" are ignored. A key
 * of the root or of "weight_map" given twice, or holding \u0000, is refused
 * (tensor_file_check_names: json-c would keep the last one, or cut it). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_file_internal.h"

#define CTX "safetensors index"
/* A file name in the index: longer is no checkpoint's. */
#define FILE_NAME_MAX 1024

static bool plain_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == '-';
}

/* 0 if `f` is a plain relative path (see above), else -1 with why. */
static int check_file(const char *name, const char *f, meshd_error_t *e) {
  size_t n = strlen(f);
  const char *why = NULL;
  if (n == 0) why = "is empty";
  else if (n > FILE_NAME_MAX) why = "is longer than 1024 bytes";
  else if (f[0] == '/') why = "starts with '/' (files are named relative to the index)";
  for (size_t i = 0; !why && i < n; i++)
    if (!plain_char(f[i]) && f[i] != '/')
      why = "holds a character other than letters, digits, '.', '_', '-' and '/'";
  for (const char *seg = f; !why && seg <= f + n;) {
    const char *end = strchr(seg, '/');
    size_t len = end ? (size_t)(end - seg) : strlen(seg);
    if (len == 0) why = "has an empty path segment";
    else if ((len == 1 && seg[0] == '.') || (len == 2 && seg[0] == '.' && seg[1] == '.'))
      why = "has a '.' or '..' segment (files are named relative to the index, below it)";
    if (!end) break;
    seg = end + 1;
  }
  if (!why) return 0;
  return error_set(e, ERR_BAD_ARGUMENT, CTX ": tensor '%.*s': file \"%.*s\" %s", TF_NAME_MAX,
                   name, TF_NAME_MAX, f, why);
}

int safetensors_index_parse(const uint8_t *buf, size_t len, const tensor_file_opts_t *o,
                            tensor_file_t *out, uint64_t *need, meshd_error_t *e) {
  if (o->file_size > o->max_header_bytes)
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": the file has %" PRIu64 " bytes, more than the %" PRIu64 "-byte "
                     "limit on a header (is this a safetensors index?)",
                     o->file_size, o->max_header_bytes);
  if (o->file_size && len < o->file_size) {
    *need = o->file_size;
    return TENSOR_FILE_NEED_MORE;
  }
  if (len > o->max_header_bytes)
    return error_set(e, ERR_BAD_ARGUMENT,
                     CTX ": %zu bytes, more than the %" PRIu64 "-byte limit on a header", len,
                     o->max_header_bytes);
  json_object *root;
  if (tensor_file_json(CTX, (const char *)buf, len, " \t\r\n", &root, e)) return -1;
  /* json-c keeps the last of a key given twice: a tensor named twice in the
   * map (or the map given twice) would silently come from one of its files. */
  if (tensor_file_check_names(CTX, (const char *)buf, len, NULL, false, e) ||
      tensor_file_check_names(CTX, (const char *)buf, len, "weight_map", true, e)) {
    json_object_put(root);
    return -1;
  }
  json_object *map = NULL, *meta = NULL;
  json_object_object_get_ex(root, "weight_map", &map);
  json_object_object_get_ex(root, "metadata", &meta);
  int rc = -1;
  out->format = TENSOR_FILE_SAFETENSORS_INDEX;
  out->header_bytes = len;
  if (!map || !json_object_is_type(map, json_type_object)) {
    error_set(e, ERR_BAD_ARGUMENT, CTX ": no \"weight_map\" object of tensor names to file "
              "names (is this a safetensors index?)");
    goto out;
  }
  size_t cap = (size_t)json_object_object_length(map);
  if (cap == 0) {
    error_set(e, ERR_BAD_ARGUMENT, CTX ": \"weight_map\" is empty: no tensors");
    goto out;
  }
  if (meta && !(out->metadata_json =
                    strdup(json_object_to_json_string_ext(meta, JSON_C_TO_STRING_PLAIN)))) {
    error_set(e, ERR_QUOTA, CTX ": out of memory");
    goto out;
  }
  if (!(out->tensors = calloc(cap, sizeof *out->tensors))) {
    error_set(e, ERR_QUOTA, CTX ": out of memory for %zu tensors", cap);
    goto out;
  }
  json_object_object_foreach(map, key, val) {
    if (!json_object_is_type(val, json_type_string)) {
      error_set(e, ERR_BAD_ARGUMENT, CTX ": tensor '%.*s': its file must be a string such as "
                "\"model-00001-of-00002.safetensors\"", TF_NAME_MAX, key);
      goto out;
    }
    const char *file = json_object_get_string(val);
    if (check_file(key, file, e)) goto out;
    tensor_file_entry_t *t = &out->tensors[out->count];
    t->name = strdup(key);
    t->file = strdup(file);
    out->count++; /* owns them from here */
    if (!t->name || !t->file) {
      error_set(e, ERR_QUOTA, CTX ": out of memory");
      goto out;
    }
  }
  rc = TENSOR_FILE_OK;
out:
  json_object_put(root);
  if (rc < 0) tensor_file_free(out);
  return rc;
}
