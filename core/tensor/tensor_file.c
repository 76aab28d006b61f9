#include "tensor_file.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_file_internal.h"

static const uint8_t npy_magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

/* JSON text: '{' after optional whitespace, and no NUL in the first 8 bytes
 * (a safetensors file starts with its header's length, whose high bytes are 0:
 * the format caps it at 100 MB). */
static bool looks_like_json(const uint8_t *b) {
  size_t i = 0;
  if (!memchr(b, 0, 8)) {
    while (i < 8 && strchr(" \t\r\n", b[i])) i++;
    return i < 8 && b[i] == '{';
  }
  return false;
}

int tensor_file_parse(const void *buf, size_t len, const tensor_file_opts_t *opts,
                      tensor_file_t *out, uint64_t *need, meshd_error_t *e) {
  tensor_file_opts_t o = opts ? *opts : (tensor_file_opts_t){0};
  if (!o.max_header_bytes || o.max_header_bytes > TENSOR_FILE_MAX_HEADER)
    o.max_header_bytes = TENSOR_FILE_MAX_HEADER;
  memset(out, 0, sizeof *out);
  *need = 0;
  if (!buf && len) return error_set(e, ERR_BAD_ARGUMENT, "tensor file: no bytes given");
  if (o.file_size && len > o.file_size)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "tensor file: %zu bytes given but the file has only %" PRIu64, len,
                     o.file_size);
  /* Both formats' length fields end within the first 8 bytes (.npy's magic
   * and version, safetensors' header length): the smallest useful prefix. */
  if (len < 8) {
    if (o.file_size && o.file_size < 8)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "tensor file: %" PRIu64 " bytes is too short for a .npy or safetensors "
                       "file (their headers alone are longer)",
                       o.file_size);
    *need = 8;
    return TENSOR_FILE_NEED_MORE;
  }
  tensor_file_format_t f = o.format;
  if (f == TENSOR_FILE_AUTO)
    f = memcmp(buf, npy_magic, sizeof npy_magic) == 0 ? TENSOR_FILE_NPY
        : looks_like_json(buf)                       ? TENSOR_FILE_SAFETENSORS_INDEX
                                                     : TENSOR_FILE_SAFETENSORS;
  switch (f) {
  case TENSOR_FILE_NPY: return npy_header_parse(buf, len, &o, out, need, e);
  case TENSOR_FILE_SAFETENSORS: {
    int rc = safetensors_header_parse(buf, len, &o, out, need, e);
    /* Guessed (neither .npy nor JSON): raw bytes the caller gave no dtype and
     * shape for are likelier than a broken safetensors file. */
    size_t n = rc < 0 ? strlen(e->msg) : 0;
    if (rc < 0 && o.format == TENSOR_FILE_AUTO && strstr(e->msg, "(is this a safetensors file?)"))
      snprintf(e->msg + n, sizeof e->msg - n, "; raw bytes need a dtype and a shape");
    return rc;
  }
  case TENSOR_FILE_SAFETENSORS_INDEX: return safetensors_index_parse(buf, len, &o, out, need, e);
  default:
    return error_set(e, ERR_BAD_ARGUMENT, "tensor file: unknown format %d (0 auto, 1 npy, "
                     "2 safetensors, 3 safetensors index)", (int)f);
  }
}

void tensor_file_free(tensor_file_t *f) {
  if (!f) return;
  for (size_t i = 0; i < f->count && f->tensors; i++) {
    free(f->tensors[i].name);
    free(f->tensors[i].file);
  }
  free(f->tensors);
  free(f->metadata_json);
  memset(f, 0, sizeof *f);
}

const tensor_file_entry_t *tensor_file_find(const tensor_file_t *f, const char *name) {
  if (f->format == TENSOR_FILE_NPY) return f->count ? &f->tensors[0] : NULL;
  for (size_t i = 0; i < f->count; i++)
    if (name && strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
  return NULL;
}

int tensor_file_entry_finish(tensor_file_entry_t *t, const char *ctx, meshd_error_t *e) {
  size_t es = dtype_size(t->dtype);
  if (layout_check_shape(ctx, t->shape, t->ndim, es, e)) return -1;
  /* Within 2^62 bytes once the shape passed: no overflow. */
  uint64_t n = es;
  for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
  t->nbytes = n;
  return 0;
}

int tensor_file_shard(const tensor_file_entry_t *t, int64_t dim, int64_t nranks, int64_t rank,
                      tensor_file_slice_t *out, meshd_error_t *e) {
  char shape[LAYOUT_SHAPE_BUF];
  int64_t d;
  memset(out, 0, sizeof *out);
  if (layout_wrap_dim("tensor_file_shard: dim", dim, t->ndim, false, &d, e)) return -1;
  if (nranks < 1)
    return error_set(e, ERR_BAD_ARGUMENT, "tensor_file_shard: %" PRId64 " ranks; need at least 1",
                     nranks);
  if (rank < 0 || rank >= nranks)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "tensor_file_shard: rank %" PRId64 " is outside [0, %" PRId64 ")", rank,
                     nranks);
  if (t->shape[d] % nranks)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "tensor_file_shard: tensor '%.*s' of shape %s: dim %" PRId64 " (size %" PRId64
                     ") does not split evenly over %" PRId64 " ranks; use a size that is a multiple "
                     "of the ranks",
                     TF_NAME_MAX, t->name ? t->name : "",
                     layout_format_shape(t->shape, t->ndim, shape, sizeof shape), d, t->shape[d],
                     nranks);
  uint64_t inner = dtype_size(t->dtype), outer = 1;
  for (int i = (int)d + 1; i < t->ndim; i++) inner *= (uint64_t)t->shape[i];
  for (int i = 0; i < d; i++) outer *= (uint64_t)t->shape[i];
  uint64_t part = (uint64_t)(t->shape[d] / nranks);
  out->ndim = t->ndim;
  memcpy(out->shape, t->shape, sizeof out->shape);
  out->shape[d] = (int64_t)part;
  /* Products of the entry's checked sizes: each below 2^62. */
  out->length = part * inner;
  out->stride = (uint64_t)t->shape[d] * inner;
  out->first = t->offset + (uint64_t)rank * out->length;
  out->count = out->length ? outer : 0;
  if (out->count > 1 && out->length == out->stride) { /* one rank: the parts touch */
    out->length *= out->count;
    out->count = 1;
  }
  if (out->count <= 1) out->stride = out->length;
  return 0;
}

tensor_file_range_t tensor_file_slice_range(const tensor_file_slice_t *s, uint64_t i) {
  return (tensor_file_range_t){s->first + i * s->stride, s->length};
}
