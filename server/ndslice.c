#include "ndslice.h"

#include <string.h>

/* Dim numbers of s sorted by (stride, size), as Slice::new sorts its pairs. */
static void sort_dims(const int64_t *sizes, const int64_t *strides, int ndim, int *order) {
  for (int i = 0; i < ndim; i++) {
    int j = i;
    while (j > 0) {
      int p = order[j - 1];
      bool after = strides[p] > strides[i] || (strides[p] == strides[i] && sizes[p] > sizes[i]);
      if (!after) break;
      order[j] = p;
      j--;
    }
    order[j] = i;
  }
}

int ndslice_init(ndslice_t *out, int64_t offset, const int64_t *sizes, int nsizes,
                 const int64_t *strides, int nstrides, meshd_error_t *err) {
  if (nsizes != nstrides)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "NDSlice needs one stride per size: got %d sizes and %d strides", nsizes,
                     nstrides);
  if (nsizes < 0 || nsizes > NDSLICE_MAX_DIMS)
    return error_set(err, ERR_BAD_ARGUMENT, "NDSlice has %d dims; it may have 0 to %d", nsizes,
                     NDSLICE_MAX_DIMS);
  if (offset < 0)
    return error_set(err, ERR_BAD_ARGUMENT, "NDSlice offset %lld must be >= 0", (long long)offset);
  for (int i = 0; i < nsizes; i++) {
    if (sizes[i] < 1)
      return error_set(err, ERR_BAD_ARGUMENT, "NDSlice dim %d has size %lld; sizes must be >= 1", i,
                       (long long)sizes[i]);
    if (strides[i] < 1)
      return error_set(err, ERR_BAD_ARGUMENT,
                       "NDSlice dim %d has stride %lld; strides must be >= 1", i,
                       (long long)strides[i]);
  }

  int order[NDSLICE_MAX_DIMS];
  sort_dims(sizes, strides, nsizes, order);
  int64_t total = 1, last = 0;
  for (int k = 0; k < nsizes; k++) {
    int d = order[k];
    if (k > 0) {
      int p = order[k - 1];
      if (strides[d] % strides[p] != 0)
        return error_set(err, ERR_BAD_ARGUMENT,
                         "NDSlice is not rectangular: stride %lld of dim %d is not a multiple of "
                         "stride %lld of dim %d (sorted strides must each divide the next)",
                         (long long)strides[d], d, (long long)strides[p], p);
      if (strides[d] == strides[p] && sizes[d] != 1 && sizes[p] != 1)
        return error_set(err, ERR_BAD_ARGUMENT,
                         "NDSlice strides are not unique: dims %d and %d both have stride %lld "
                         "(only a size-1 dim may share a stride)",
                         p, d, (long long)strides[d]);
    }
    if (total > strides[d])
      return error_set(err, ERR_BAD_ARGUMENT,
                       "NDSlice dims overlap: stride %lld of dim %d is smaller than %lld, the "
                       "extent of the dims with smaller strides",
                       (long long)strides[d], d, (long long)total);
    if (__builtin_mul_overflow(strides[d], sizes[d], &total))
      return error_set(err, ERR_BAD_ARGUMENT,
                       "NDSlice dim %d (size %lld, stride %lld) is too large", d,
                       (long long)sizes[d], (long long)strides[d]);
    int64_t span = (sizes[d] - 1) * strides[d]; /* <= total, no overflow */
    last += span;                               /* < total by the overlap rule */
  }
  int64_t max_rank;
  if (__builtin_add_overflow(offset, last, &max_rank))
    return error_set(err, ERR_BAD_ARGUMENT, "NDSlice offset %lld puts its last rank past 2^63",
                     (long long)offset);

  ndslice_t s = {.ndim = nsizes, .offset = offset};
  if (nsizes > 0) {
    memcpy(s.sizes, sizes, sizeof sizes[0] * (size_t)nsizes);
    memcpy(s.strides, strides, sizeof strides[0] * (size_t)nsizes);
  }
  *out = s;
  return 0;
}

int ndslice_dense(ndslice_t *out, const int64_t *sizes, int ndim, meshd_error_t *err) {
  if (ndim < 0 || ndim > NDSLICE_MAX_DIMS)
    return error_set(err, ERR_BAD_ARGUMENT, "NDSlice has %d dims; it may have 0 to %d", ndim,
                     NDSLICE_MAX_DIMS);
  int64_t strides[NDSLICE_MAX_DIMS];
  int64_t acc = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    if (sizes[i] < 1)
      return error_set(err, ERR_BAD_ARGUMENT, "NDSlice dim %d has size %lld; sizes must be >= 1", i,
                       (long long)sizes[i]);
    strides[i] = acc;
    if (__builtin_mul_overflow(acc, sizes[i], &acc))
      return error_set(err, ERR_BAD_ARGUMENT, "NDSlice sizes multiply past 2^63");
  }
  return ndslice_init(out, 0, sizes, ndim, strides, ndim, err);
}

int64_t ndslice_len(const ndslice_t *s) {
  int64_t n = 1;
  for (int i = 0; i < s->ndim; i++) n *= s->sizes[i];
  return n;
}

int64_t ndslice_rank_of(const ndslice_t *s, const int64_t *coords, meshd_error_t *err) {
  int64_t rank = s->offset;
  for (int i = 0; i < s->ndim; i++) {
    if (coords[i] < 0 || coords[i] >= s->sizes[i])
      return error_set(err, ERR_BAD_ARGUMENT,
                       "coordinate %lld is out of range for dim %d of size %lld (use 0..%lld)",
                       (long long)coords[i], i, (long long)s->sizes[i], (long long)s->sizes[i] - 1);
    rank += coords[i] * s->strides[i];
  }
  return rank;
}

int64_t ndslice_get(const ndslice_t *s, int64_t i, meshd_error_t *err) {
  int64_t len = ndslice_len(s);
  if (i < 0 || i >= len)
    return error_set(err, ERR_BAD_ARGUMENT, "index %lld is out of range for a slice of %lld ranks",
                     (long long)i, (long long)len);
  int64_t rank = s->offset;
  for (int d = s->ndim - 1; d >= 0; d--) {
    rank += (i % s->sizes[d]) * s->strides[d];
    i /= s->sizes[d];
  }
  return rank;
}

int ndslice_coords(const ndslice_t *s, int64_t rank, int64_t *out) {
  if (rank < s->offset) return -1;
  int64_t pos = rank - s->offset;
  int order[NDSLICE_MAX_DIMS];
  sort_dims(s->sizes, s->strides, s->ndim, order);
  int64_t c[NDSLICE_MAX_DIMS];
  /* Largest stride first; each dim's stride exceeds the span of all smaller ones,
   * so the greedy split is the only one. */
  for (int k = s->ndim - 1; k >= 0; k--) {
    int d = order[k];
    if (s->sizes[d] == 1) {
      c[d] = 0;
      continue;
    }
    c[d] = pos / s->strides[d];
    if (c[d] >= s->sizes[d]) return -1;
    pos %= s->strides[d];
  }
  if (pos != 0) return -1;
  for (int d = 0; d < s->ndim; d++) out[d] = c[d];
  return 0;
}

bool ndslice_contains(const ndslice_t *s, int64_t rank) {
  int64_t c[NDSLICE_MAX_DIMS];
  return ndslice_coords(s, rank, c) == 0;
}

int64_t ndslice_index(const ndslice_t *s, int64_t rank) {
  int64_t c[NDSLICE_MAX_DIMS];
  if (ndslice_coords(s, rank, c) != 0) return -1;
  int64_t i = 0;
  for (int d = 0; d < s->ndim; d++) i = i * s->sizes[d] + c[d];
  return i;
}

static int check_dim(const ndslice_t *s, int dim, const char *what, meshd_error_t *err) {
  if (dim < 0 || dim >= s->ndim)
    return error_set(err, ERR_BAD_DIM, "%s: the slice has no dim %d (it has %d dim%s)", what, dim,
                     s->ndim, s->ndim == 1 ? "" : "s");
  return 0;
}

int ndslice_at(const ndslice_t *s, int dim, int64_t index, ndslice_t *out, meshd_error_t *err) {
  if (check_dim(s, dim, "at", err) != 0) return -1;
  int64_t size = s->sizes[dim];
  if (index < -size || index >= size)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "index %lld is out of range for dim %d of size %lld (use 0..%lld, or "
                     "-%lld..-1 from the end)",
                     (long long)index, dim, (long long)size, (long long)size - 1, (long long)size);
  if (index < 0) index += size;
  int64_t sizes[NDSLICE_MAX_DIMS], strides[NDSLICE_MAX_DIMS];
  int n = 0;
  for (int d = 0; d < s->ndim; d++) {
    if (d == dim) continue;
    sizes[n] = s->sizes[d];
    strides[n] = s->strides[d];
    n++;
  }
  return ndslice_init(out, s->offset + index * s->strides[dim], sizes, n, strides, n, err);
}

static int64_t clamp_pos(int64_t v, int64_t size) {
  if (v < 0) {
    v += size;
    return v < 0 ? 0 : v;
  }
  return v > size ? size : v;
}

int ndslice_select(const ndslice_t *s, int dim, int64_t start, int64_t stop, int64_t step,
                   ndslice_t *out, meshd_error_t *err) {
  if (check_dim(s, dim, "select", err) != 0) return -1;
  if (step < 1) return error_set(err, ERR_BAD_ARGUMENT, "step %lld must be >= 1", (long long)step);
  int64_t size = s->sizes[dim];
  int64_t b = clamp_pos(start, size), e = clamp_pos(stop, size);
  if (e <= b)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "range %lld:%lld:%lld selects nothing from dim %d of size %lld",
                     (long long)start, (long long)stop, (long long)step, dim, (long long)size);
  int64_t n = (e - b - 1) / step + 1;
  int64_t sizes[NDSLICE_MAX_DIMS], strides[NDSLICE_MAX_DIMS];
  memcpy(sizes, s->sizes, sizeof sizes);
  memcpy(strides, s->strides, sizeof strides);
  sizes[dim] = n;
  /* n > 1 means step < size, so stride*step stays below stride*size. */
  if (n > 1) strides[dim] *= step;
  return ndslice_init(out, s->offset + b * s->strides[dim], sizes, s->ndim, strides, s->ndim, err);
}

void ndslice_iter_init(ndslice_iter_t *it, const ndslice_t *s) {
  memset(it, 0, sizeof *it);
  it->s = s;
  it->rank = s->offset;
}

bool ndslice_iter_next(ndslice_iter_t *it, int64_t *rank) {
  if (it->done) return false;
  *rank = it->rank;
  const ndslice_t *s = it->s;
  for (int d = s->ndim - 1; d >= 0; d--) {
    if (it->coords[d] + 1 < s->sizes[d]) {
      it->coords[d]++;
      it->rank += s->strides[d];
      return true;
    }
    it->rank -= (s->sizes[d] - 1) * s->strides[d];
    it->coords[d] = 0;
  }
  it->done = true;
  return true;
}
