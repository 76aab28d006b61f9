/* A tensor_meta_t in as few bytes as its shape needs, for tables that hold
 * many tensors (the server's objects, an agent's refs): a 4-byte header
 * (dtype, ndim, flags), the offset only when it is not 0, the sizes, and the
 * strides only when they are not row-major. A 1-D contiguous tensor takes 12
 * bytes instead of sizeof(tensor_meta_t), 272.
 *
 *   uint8_t *p = malloc(meta_packed_size(&m));  meta_pack(p, &m);
 *   tensor_meta_t back;  meta_unpack(p, &back);   // == m on every used slot
 *
 * The packed bytes need no alignment. Slots of sizes and strides past ndim
 * come back zero. */
#ifndef MESHD_META_PACK_H
#define MESHD_META_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"

/* Bytes meta_pack writes for m (at most META_PACKED_MAX). */
size_t meta_packed_size(const tensor_meta_t *m);
#define META_PACKED_MAX (4 + 8 + 2 * 8 * LAYOUT_MAX_DIMS)
void meta_pack(uint8_t *dst, const tensor_meta_t *m);
void meta_unpack(const uint8_t *src, tensor_meta_t *out);
/* The ndim without unpacking the rest. */
int meta_packed_ndim(const uint8_t *src);

#endif
