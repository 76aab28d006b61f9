/* NDSlice: Monarch's map from mesh coordinates to world ranks.
 *
 * A slice is {offset, sizes[], strides[]}: the coordinate (c0, …, cn-1) names
 * rank = offset + Σ cᵢ·strideᵢ. Iteration and ndslice_get/ndslice_index use
 * row-major order over the coordinates. Values are plain structs: copy freely.
 *
 * Every ndslice_t that leaves this module is valid in the sense of Monarch's
 * Slice::new: sorted by stride, each stride divides the next, no dim overlaps
 * the extent of the smaller ones, and strides are unique except for size-1 dims.
 * Two deliberate departures, both for clients' sake:
 *   - ndslice_at and ndslice_select accept negative positions counted from the
 *     end, as Python does;
 *   - ndslice_select keeps the stride of a dim it narrows to size 1 (no rank
 *     depends on it), so such a selection never fails the rectangle check.
 *
 * Errors are BAD_ARGUMENT, except a dim number outside the slice (BAD_DIM). */
#ifndef MESHD_NDSLICE_H
#define MESHD_NDSLICE_H

#include <stdbool.h>
#include <stdint.h>

#include "error_kind.h"

#define NDSLICE_MAX_DIMS 8

typedef struct ndslice {
  int ndim; /* 0..NDSLICE_MAX_DIMS; 0 is a single rank */
  int64_t offset;
  int64_t sizes[NDSLICE_MAX_DIMS];   /* each >= 1 */
  int64_t strides[NDSLICE_MAX_DIMS]; /* each >= 1 */
} ndslice_t;

/* Validates like Slice::new and fills *out. nsizes must equal nstrides. Also
 * checks offset >= 0 and that the largest rank fits in int64. Returns 0, or -1
 * with err set (out untouched). */
int ndslice_init(ndslice_t *out, int64_t offset, const int64_t *sizes, int nsizes,
                 const int64_t *strides, int nstrides, meshd_error_t *err);
/* Row-major slice of the given sizes from offset 0 (ranks 0..len-1). */
int ndslice_dense(ndslice_t *out, const int64_t *sizes, int ndim, meshd_error_t *err);

/* Number of ranks: the product of the sizes (1 for ndim 0). */
int64_t ndslice_len(const ndslice_t *s);
/* offset + Σ coords[i]·strides[i]; -1 with err if a coordinate is outside
 * 0..sizes[i]-1. coords has s->ndim entries. */
int64_t ndslice_rank_of(const ndslice_t *s, const int64_t *coords, meshd_error_t *err);
/* The rank at row-major position i (0..len-1); -1 with err otherwise. */
int64_t ndslice_get(const ndslice_t *s, int64_t i, meshd_error_t *err);
/* Inverse of ndslice_get: the row-major position of rank, or -1 if the slice
 * does not contain it. */
int64_t ndslice_index(const ndslice_t *s, int64_t rank);
/* Coordinates of rank into out[s->ndim]. Returns 0, or -1 if rank is not in s. */
int ndslice_coords(const ndslice_t *s, int64_t rank, int64_t *out);
bool ndslice_contains(const ndslice_t *s, int64_t rank);

/* Fixes dim at index and removes it: offset += index·stride. index may be
 * -size..size-1. out may be s. */
int ndslice_at(const ndslice_t *s, int dim, int64_t index, ndslice_t *out, meshd_error_t *err);
/* Restricts dim to start:stop:step (Python slice rules for step >= 1: negative
 * start/stop count from the end, both are clamped to 0..size) and keeps it:
 * offset += start·stride, size = ceil((stop-start)/step), stride *= step.
 * step < 1, an empty range, or a result that is not rectangular is
 * BAD_ARGUMENT. out may be s. */
int ndslice_select(const ndslice_t *s, int dim, int64_t start, int64_t stop, int64_t step,
                   ndslice_t *out, meshd_error_t *err);

/* Row-major walk over every rank:
 *   ndslice_iter_t it; int64_t r;
 *   for (ndslice_iter_init(&it, s); ndslice_iter_next(&it, &r);) ...
 * The slice must outlive the iterator and not change during the walk. */
typedef struct ndslice_iter {
  const ndslice_t *s;
  int64_t coords[NDSLICE_MAX_DIMS];
  int64_t rank;
  bool done;
} ndslice_iter_t;

void ndslice_iter_init(ndslice_iter_t *it, const ndslice_t *s);
bool ndslice_iter_next(ndslice_iter_t *it, int64_t *rank);

#endif
