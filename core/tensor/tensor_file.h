/* The headers of tensor files (.npy and safetensors): which tensors a file
 * holds, their dtype and shape, and where each one's bytes lie, so an agent
 * can fetch only the bytes it needs (with HTTP Range requests, url_fetch.h).
 * Pure functions of the bytes given: no I/O, thread-safe.
 *
 *   uint8_t head[TENSOR_FILE_PROBE_BYTES];       the file's first bytes
 *   tensor_file_t f;  uint64_t need;  meshd_error_t e;
 *   int rc = tensor_file_parse(head, n, &opts, &f, &need, &e);
 *   while (rc == TENSOR_FILE_NEED_MORE) { fetch the first `need` bytes; parse again }
 *   if (rc < 0) reject(&e);
 *   tensor_file_slice_t s;                        rank 1 of 4, split along dim 0
 *   tensor_file_shard(&f.tensors[0], 0, 4, 1, &s, &e);
 *   ... fetch s.count ranges of s.length bytes, s.stride apart from s.first ...
 *   tensor_file_free(&f);
 *
 * Error messages name the part of the file at fault ("safetensors header:
 * tensor 'w': ..."); the caller puts the file's name in front (error_prefix). */
#ifndef MESHD_TENSOR_FILE_H
#define MESHD_TENSOR_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "error_kind.h"
#include "layout.h"

/* Enough leading bytes to parse most files' headers in one go. */
#define TENSOR_FILE_PROBE_BYTES 65536
/* The safetensors format's own bound on its header (its spec: 100 MB). */
#define TENSOR_FILE_MAX_HEADER 100000000u

typedef enum {
  TENSOR_FILE_AUTO = 0, /* by the first bytes: "\x93NUMPY" is .npy; JSON text ('{' after
                           optional spaces, and no NUL in the first 8 bytes, where a
                           safetensors length has its high zero bytes) is an index; else
                           safetensors */
  TENSOR_FILE_NPY = 1,
  TENSOR_FILE_SAFETENSORS = 2,
  /* A checkpoint split over several safetensors files, as Hugging Face writes it
   * (model.safetensors.index.json): {"metadata": {...}, "weight_map": {tensor
   * name: file name}}. Its entries have a name and a file only (dtype, shape and
   * offset are in that file's header); the whole file is the header. */
  TENSOR_FILE_SAFETENSORS_INDEX = 3,
} tensor_file_format_t;

/* One tensor of a file: row-major (C order), little-endian, contiguous. */
typedef struct tensor_file_entry {
  char *name; /* the safetensors key; "" in a .npy file. Owned by the tensor_file_t */
  char *file; /* index only: the file holding it, relative to the index (a path of
                 [A-Za-z0-9._-] segments; no "..", no leading '/'); else NULL. Owned */
  dtype_t dtype;
  int ndim;
  int64_t shape[LAYOUT_MAX_DIMS];
  uint64_t offset; /* of its first byte, from the start of the file */
  uint64_t nbytes; /* numel * dtype_size(dtype) */
} tensor_file_entry_t;

/* A parsed header. Owner: the caller, who frees it with tensor_file_free. */
typedef struct tensor_file {
  tensor_file_format_t format;
  uint64_t header_bytes; /* bytes before the data: 8 + N (safetensors), magic to padding (.npy) */
  size_t count;          /* 1 for .npy */
  tensor_file_entry_t *tensors; /* in header order */
  char *metadata_json;   /* safetensors "__metadata__" (an index's "metadata") as JSON text,
                            or NULL */
} tensor_file_t;

typedef struct tensor_file_opts {
  tensor_file_format_t format; /* AUTO: by the magic */
  uint64_t file_size;          /* 0: unknown (an empty file is no tensor file: don't
                                  parse one); else every tensor must lie within it */
  uint64_t max_header_bytes;   /* 0: TENSOR_FILE_MAX_HEADER; larger values are clamped to it */
} tensor_file_opts_t;

enum { TENSOR_FILE_OK = 0, TENSOR_FILE_NEED_MORE = 1 };

/* Parses the header at the start of buf (len bytes: the file's first bytes,
 * or all of it; opts may be NULL). Returns
 *   TENSOR_FILE_OK         *out describes the file (free it with tensor_file_free);
 *   TENSOR_FILE_NEED_MORE  the header is longer than len: call again with at
 *                          least the first *need bytes (*need > len);
 *   -1                     *e says what is wrong (BAD_ARGUMENT; QUOTA for a shape
 *                          past layout_get_limits()); *out holds nothing.
 * Every shape passes layout_check_shape; an entry's bytes are exactly its
 * numel times its dtype's size; safetensors entries do not overlap. */
int tensor_file_parse(const void *buf, size_t len, const tensor_file_opts_t *opts,
                      tensor_file_t *out, uint64_t *need, meshd_error_t *e);
/* Frees what *f owns and zeroes it; a zeroed tensor_file_t is fine. */
void tensor_file_free(tensor_file_t *f);
/* The entry named `name` (any entry when the file is a .npy), or NULL. */
const tensor_file_entry_t *tensor_file_find(const tensor_file_t *f, const char *name);

/* One rank's part of a tensor split evenly along a dim: its local shape and
 * where its bytes lie in the file, as `count` ranges of `length` bytes, the
 * i-th at first + i * stride. Adjacent ranges are merged: a split along the
 * first dim of size > 1 (or over one rank) is a single range. count is 0 when
 * the part is empty. */
typedef struct tensor_file_slice {
  int ndim;
  int64_t shape[LAYOUT_MAX_DIMS];
  uint64_t first, length, stride, count;
} tensor_file_slice_t;

typedef struct tensor_file_range {
  uint64_t offset, length;
} tensor_file_range_t;

/* Rank `rank` (0 <= rank < nranks) of t split along `dim` (negative counts from
 * the end) into nranks equal parts, in order: rank r gets indices
 * [r * size / nranks, (r + 1) * size / nranks) of that dim. The size must be a
 * multiple of nranks (every rank holds the same local shape, as with a per_rank
 * Upload), else BAD_ARGUMENT naming both. BAD_DIM for a dim out of range. */
int tensor_file_shard(const tensor_file_entry_t *t, int64_t dim, int64_t nranks, int64_t rank,
                      tensor_file_slice_t *out, meshd_error_t *e);
/* The i-th range of s (i < s->count). */
tensor_file_range_t tensor_file_slice_range(const tensor_file_slice_t *s, uint64_t i);

#endif
