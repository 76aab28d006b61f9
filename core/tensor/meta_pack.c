#include "meta_pack.h"

#include <stdbool.h>
#include <string.h>

enum { HAS_OFFSET = 1, HAS_STRIDES = 2 };

/* Whether l's strides are the ones layout_make_contiguous gives its sizes. */
static bool row_major(const layout_t *l) {
  layout_t c = *l;
  layout_make_contiguous(&c);
  return memcmp(c.strides, l->strides, sizeof *l->strides * (size_t)l->ndim) == 0;
}

static unsigned flags_of(const tensor_meta_t *m) {
  return (m->layout.offset ? HAS_OFFSET : 0u) | (row_major(&m->layout) ? 0u : HAS_STRIDES);
}

size_t meta_packed_size(const tensor_meta_t *m) {
  unsigned f = flags_of(m);
  size_t n = (size_t)m->layout.ndim;
  return 4 + (f & HAS_OFFSET ? 8 : 0) + 8 * n * (f & HAS_STRIDES ? 2 : 1);
}

void meta_pack(uint8_t *dst, const tensor_meta_t *m) {
  unsigned f = flags_of(m);
  size_t n = (size_t)m->layout.ndim;
  dst[0] = (uint8_t)m->dtype;
  dst[1] = (uint8_t)n;
  dst[2] = (uint8_t)f;
  dst[3] = 0;
  dst += 4;
  if (f & HAS_OFFSET) {
    memcpy(dst, &m->layout.offset, 8);
    dst += 8;
  }
  memcpy(dst, m->layout.sizes, 8 * n);
  if (f & HAS_STRIDES) memcpy(dst + 8 * n, m->layout.strides, 8 * n);
}

void meta_unpack(const uint8_t *src, tensor_meta_t *out) {
  memset(out, 0, sizeof *out);
  unsigned f = src[2];
  size_t n = src[1];
  out->dtype = (dtype_t)src[0];
  out->layout.ndim = (int)n;
  src += 4;
  if (f & HAS_OFFSET) {
    memcpy(&out->layout.offset, src, 8);
    src += 8;
  }
  memcpy(out->layout.sizes, src, 8 * n);
  if (f & HAS_STRIDES) {
    memcpy(out->layout.strides, src + 8 * n, 8 * n);
  } else {
    int64_t offset = out->layout.offset;
    layout_make_contiguous(&out->layout);
    out->layout.offset = offset;
  }
}

int meta_packed_ndim(const uint8_t *src) { return src[1]; }
