/* Fuzz target: the .npy, safetensors and safetensors index parsers (core/tensor/tensor_file)
 * and the shard ranges of what they accept.
 *
 * The input is a whole file (the seeds in corpus/tensor_file/ are real .npy
 * and safetensors files). It is parsed as a reader would, from 8 bytes on,
 * passing as many bytes as the parser asks for, with the file's size known;
 * then all at once with the size unknown, which must describe the same
 * tensors. Accepted files are checked: every tensor within the file and after
 * the header, its bytes its numel times its dtype's size, no two overlapping;
 * and every even split of each tensor along each dim gives ranges inside the
 * tensor that add up to its share. Refusals must say so in a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"
#include "tensor_file.h"

static void check_refusal(const tensor_file_t *f, const meshd_error_t *e) {
  FZ_CHECK(e->kind != ERR_NONE && e->msg[0], "refused without a kind or message");
  FZ_CHECK(memchr(e->msg, '\0', sizeof e->msg), "unterminated message");
  FZ_CHECK(!f->tensors && !f->count && !f->metadata_json, "a refusal left a description");
}

static void check_shards(const tensor_file_entry_t *t) {
  for (int d = 0; d < t->ndim; d++) {
    for (int64_t n = 1; n <= 4; n++) {
      for (int64_t r = 0; r < n; r++) {
        tensor_file_slice_t s;
        meshd_error_t e = {0};
        if (tensor_file_shard(t, d, n, r, &s, &e)) {
          FZ_CHECK(t->shape[d] % n != 0, "an even split of dim %d over %lld refused: %s", d,
                   (long long)n, e.msg);
          continue;
        }
        FZ_CHECK(t->shape[d] % n == 0, "an uneven split accepted");
        uint64_t sum = 0;
        for (uint64_t i = 0; i < s.count && i < 64; i++) {
          tensor_file_range_t rg = tensor_file_slice_range(&s, i);
          FZ_CHECK(rg.offset >= t->offset && rg.offset + rg.length <= t->offset + t->nbytes,
                   "range %llu+%llu outside the tensor", (unsigned long long)rg.offset,
                   (unsigned long long)rg.length);
        }
        sum = s.count * s.length;
        FZ_CHECK(sum == t->nbytes / (uint64_t)n, "shares of %llu bytes for a %llu-byte tensor",
                 (unsigned long long)sum, (unsigned long long)t->nbytes);
      }
    }
  }
}

/* An index's entries: a name and a plain relative file path, nothing else. */
static void check_index(const tensor_file_t *f, size_t size) {
  FZ_CHECK(f->header_bytes == size && f->count > 0, "an index is its whole file");
  for (size_t i = 0; i < f->count; i++) {
    const tensor_file_entry_t *t = &f->tensors[i];
    FZ_CHECK(t->name && t->file && t->file[0] && t->file[0] != '/' && !t->nbytes && !t->ndim,
             "index entry %zu", i);
    FZ_CHECK(strspn(t->file, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/") ==
                 strlen(t->file),
             "index file '%s' has a character outside the plain set", t->file);
    char padded[1100];
    snprintf(padded, sizeof padded, "/%s/", t->file);
    FZ_CHECK(!strstr(padded, "/../") && !strstr(padded, "/./") && !strstr(padded, "//"),
             "index file '%s' has a '.', '..' or empty segment", t->file);
  }
}

static void check_file(const tensor_file_t *f, size_t size) {
  FZ_CHECK(f->header_bytes <= size, "header past the file");
  if (f->format == TENSOR_FILE_SAFETENSORS_INDEX) {
    check_index(f, size);
    return;
  }
  FZ_CHECK(f->format != TENSOR_FILE_NPY || f->count == 1, "npy with %zu tensors", f->count);
  for (size_t i = 0; i < f->count; i++) {
    const tensor_file_entry_t *t = &f->tensors[i];
    FZ_CHECK(dtype_valid(t->dtype) && t->name, "bad dtype or name");
    FZ_CHECK(t->ndim >= 0 && t->ndim <= LAYOUT_MAX_DIMS, "ndim %d", t->ndim);
    unsigned __int128 n = dtype_size(t->dtype);
    for (int d = 0; d < t->ndim; d++) {
      FZ_CHECK(t->shape[d] >= 0, "negative size");
      n *= (uint64_t)t->shape[d];
    }
    FZ_CHECK(n == t->nbytes, "nbytes %llu is not numel * size", (unsigned long long)t->nbytes);
    FZ_CHECK(t->offset >= f->header_bytes && t->offset <= size && t->nbytes <= size - t->offset,
             "tensor %zu at %llu+%llu outside the %zu-byte file", i,
             (unsigned long long)t->offset, (unsigned long long)t->nbytes, size);
    for (size_t j = 0; j < i && j < 256; j++) {
      const tensor_file_entry_t *u = &f->tensors[j];
      FZ_CHECK(!t->nbytes || !u->nbytes || t->offset + t->nbytes <= u->offset ||
                   u->offset + u->nbytes <= t->offset,
               "tensors %zu and %zu overlap", j, i);
    }
    if (i < 4) check_shards(t);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  tensor_file_t f, g;
  meshd_error_t e = {0};
  uint64_t need;
  tensor_file_opts_t known = {.file_size = size};
  if (size == 0) { /* file_size 0 means unknown: an empty file is no tensor file */
    FZ_CHECK(tensor_file_parse(data, 0, &known, &f, &need, &e) == TENSOR_FILE_NEED_MORE &&
                 need == 8,
             "an empty prefix must ask for 8 bytes");
    return 0;
  }
  size_t have = size < 8 ? size : 8;
  int rc;
  for (;;) {
    rc = tensor_file_parse(data, have, &known, &f, &need, &e);
    if (rc != TENSOR_FILE_NEED_MORE) break;
    FZ_CHECK(need > have && need <= size, "asked for %llu bytes holding %zu of %zu",
             (unsigned long long)need, have, size);
    have = (size_t)need;
  }
  if (rc < 0) {
    check_refusal(&f, &e);
    return 0;
  }
  FZ_CHECK(rc == TENSOR_FILE_OK, "rc %d", rc);
  check_file(&f, size);
  /* All bytes, size unknown: the same tensors (file-size checks aside). */
  rc = tensor_file_parse(data, size, NULL, &g, &need, &e);
  FZ_CHECK(rc == TENSOR_FILE_OK, "accepted with its size known, refused without: %s", e.msg);
  FZ_CHECK(g.count == f.count && g.header_bytes == f.header_bytes, "descriptions differ");
  for (size_t i = 0; i < f.count; i++)
    FZ_CHECK(g.tensors[i].offset == f.tensors[i].offset &&
                 g.tensors[i].nbytes == f.tensors[i].nbytes &&
                 strcmp(g.tensors[i].name, f.tensors[i].name) == 0 &&
                 !g.tensors[i].file == !f.tensors[i].file,
             "tensor %zu differs", i);
  tensor_file_free(&g);
  tensor_file_free(&f);
  return 0;
}
