/* Fuzz target: shapes and layouts (core/tensor/layout), NDSlice
 * (server/ndslice) and mesh selection (server/mesh).
 *
 * The input is a list of cases; its first byte picks each one (layout check,
 * broadcast, dim wrapping, an NDSlice with at/select, a mesh with slices) and
 * the bytes after it give the arguments (fuzz_input.h). Every accepted value
 * is checked against an independent computation: the accepted shapes are
 * exactly those of the header's rule, a slice's walk yields exactly len
 * distinct ranks that index, get, coords and contains agree on, and every
 * rank of a selection lies in its parent at the coordinates the selectors
 * name. Refusals must say so in a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"
#include "layout.h"
#include "mesh.h"
#include "ndslice.h"

#define WALK_MAX 128 /* ranks walked per slice */

static void check_refusal(int rc, const meshd_error_t *e, const char *what) {
  FZ_CHECK(rc == -1, "%s returned %d", what, rc);
  FZ_CHECK(e->kind != ERR_NONE && e->msg[0], "%s refused without a kind or message", what);
  FZ_CHECK(memchr(e->msg, '\0', sizeof e->msg), "%s: unterminated message", what);
}

/* ------------------------------------------------------------------ layouts */

static int fz_ndim(fz_t *in) {
  uint8_t sel = fz_u8(in);
  if (sel < 240) return sel % (LAYOUT_MAX_DIMS + 1);
  return (int)fz_i64(in); /* out of range sometimes */
}

static size_t fz_elem_size(fz_t *in) {
  static const size_t sizes[] = {1, 2, 4, 8, 0, 3, 16, SIZE_MAX / 2};
  return sizes[fz_u8(in) % 8];
}

/* The rule of layout_check_shape (layout.h), computed in 128 bits: sizes >= 0
 * whose product, 0 counted as 1, times elem_size is at most 2^62. */
static bool shape_ok(const int64_t *sizes, int64_t ndim, size_t elem_size) {
  if (ndim < 0 || ndim > LAYOUT_MAX_DIMS) return false;
  unsigned __int128 bytes = elem_size ? elem_size : 1;
  for (int64_t i = 0; i < ndim; i++) {
    if (sizes[i] < 0) return false;
    bytes *= (uint64_t)(sizes[i] ? sizes[i] : 1);
    if (bytes > (unsigned __int128)LAYOUT_MAX_BYTES) return false;
  }
  return true;
}

static void case_layout(fz_t *in) {
  int64_t sizes[LAYOUT_MAX_DIMS + 1] = {0};
  int64_t ndim = fz_ndim(in);
  int64_t n = ndim < 0 ? 0 : ndim > LAYOUT_MAX_DIMS ? LAYOUT_MAX_DIMS + 1 : ndim;
  for (int64_t i = 0; i < n; i++) sizes[i] = fz_size(in);
  size_t esz = fz_elem_size(in);
  const char *ctx = fz_bool(in) ? "fuzz: argument 'size'" : NULL;
  meshd_error_t e = {0};
  bool want = shape_ok(sizes, ndim, esz);
  int rc = layout_check_shape(ctx, sizes, ndim, esz, &e);
  FZ_CHECK((rc == 0) == want, "layout_check_shape ndim %lld: rc %d, expected %s (%s)",
           (long long)ndim, rc, want ? "ok" : "a refusal", e.msg);
  layout_t l;
  memset(&l, 0xa5, sizeof l);
  meshd_error_t e2 = {0};
  int rc2 = layout_contiguous(&l, sizes, ndim, esz, ctx, &e2);
  FZ_CHECK(rc2 == rc, "layout_contiguous disagrees with layout_check_shape");
  if (rc) {
    check_refusal(rc, &e, "layout_check_shape");
    FZ_CHECK(e.kind == ERR_BAD_ARGUMENT, "kind %d", e.kind);
    FZ_CHECK(strncmp(e.msg, ctx ? ctx : "shape", strlen(ctx ? ctx : "shape")) == 0,
             "message does not start with its context: %s", e.msg);
    return;
  }
  /* Row-major, offset 0, contiguous, no overlap, numel = product. */
  FZ_CHECK(l.ndim == ndim && l.offset == 0, "ndim %d offset %lld", l.ndim, (long long)l.offset);
  int64_t stride = 1, numel = 1;
  for (int i = l.ndim - 1; i >= 0; i--) {
    FZ_CHECK(l.sizes[i] == sizes[i], "size %d changed", i);
    FZ_CHECK(l.strides[i] == stride, "dim %d stride %lld, expected %lld", i,
             (long long)l.strides[i], (long long)stride);
    stride *= l.sizes[i] > 1 ? l.sizes[i] : 1;
    numel *= l.sizes[i];
  }
  FZ_CHECK(layout_numel(&l) == numel, "numel %lld, expected %lld", (long long)layout_numel(&l),
           (long long)numel);
  FZ_CHECK(layout_is_contiguous(&l), "a contiguous layout is not contiguous");
  FZ_CHECK(!layout_has_internal_overlap(&l), "a contiguous layout overlaps");
  layout_t m = l;
  for (int i = 0; i < m.ndim; i++) m.strides[i] = fz_i64(in);
  m.offset = fz_i64(in);
  layout_make_contiguous(&m);
  FZ_CHECK(memcmp(&m, &l, sizeof m) == 0, "layout_make_contiguous differs from layout_contiguous");
  FZ_CHECK(layout_same_shape(&l, &m), "same shape");

  /* Formatting: always terminated, complete in LAYOUT_SHAPE_BUF. */
  char buf[LAYOUT_SHAPE_BUF];
  size_t cap = fz_bool(in) ? sizeof buf : (size_t)fz_range(in, 0, sizeof buf);
  memset(buf, 'x', sizeof buf);
  layout_format_shape(l.sizes, l.ndim, buf, cap);
  if (cap) FZ_CHECK(memchr(buf, '\0', cap), "layout_format_shape overran %zu bytes", cap);
  if (cap == sizeof buf) {
    size_t len = strlen(buf);
    FZ_CHECK(len >= 2 && buf[0] == '[' && buf[len - 1] == ']', "shape text '%s' is cut", buf);
  }
}

static void case_broadcast(fz_t *in) {
  int64_t a[LAYOUT_MAX_DIMS], b[LAYOUT_MAX_DIMS];
  int na = (int)fz_range(in, 0, LAYOUT_MAX_DIMS), nb = (int)fz_range(in, 0, LAYOUT_MAX_DIMS);
  for (int i = 0; i < na; i++) a[i] = fz_bool(in) ? 1 : fz_size(in);
  for (int i = 0; i < nb; i++) b[i] = fz_bool(in) ? 1 : fz_size(in);
  int64_t out[LAYOUT_MAX_DIMS], out2[LAYOUT_MAX_DIMS];
  int nout = -1, nout2 = -1;
  meshd_error_t e = {0}, e2 = {0};
  int rc = layout_broadcast("fuzz", "self", a, na, "other", b, nb, out, &nout, &e);
  int rc2 = layout_broadcast("fuzz", "other", b, nb, "self", a, na, out2, &nout2, &e2);
  FZ_CHECK(rc == rc2, "broadcast is not symmetric");
  int n = na > nb ? na : nb;
  bool ok = true;
  for (int i = 0; i < n; i++) {
    int ia = i - (n - na), ib = i - (n - nb);
    int64_t sa = ia >= 0 ? a[ia] : 1, sb = ib >= 0 ? b[ib] : 1;
    if (sa != sb && sa != 1 && sb != 1) {
      ok = false;
      continue;
    }
    if (rc == 0)
      FZ_CHECK(out[i] == (sa == 1 ? sb : sa) && out2[i] == out[i], "dim %d broadcast to %lld", i,
               (long long)out[i]);
  }
  FZ_CHECK((rc == 0) == ok, "layout_broadcast rc %d, expected %s", rc, ok ? "ok" : "a refusal");
  if (rc) {
    check_refusal(rc, &e, "layout_broadcast");
    FZ_CHECK(e.kind == ERR_SHAPE_MISMATCH && strncmp(e.msg, "fuzz: ", 6) == 0, "%s", e.msg);
  } else {
    FZ_CHECK(nout == n && nout2 == n, "broadcast has %d dims, expected %d", nout, n);
  }
}

static void case_wrap_dim(fz_t *in) {
  int64_t dim = fz_i64(in);
  int ndim = (int)fz_range(in, 0, LAYOUT_MAX_DIMS);
  bool scalar = fz_bool(in);
  int64_t out = -12345;
  meshd_error_t e = {0};
  int rc = layout_wrap_dim("fuzz", dim, ndim, scalar, &out, &e);
  int64_t n = ndim == 0 && scalar ? 1 : ndim;
  bool ok = n > 0 && dim >= -n && dim < n;
  FZ_CHECK((rc == 0) == ok, "layout_wrap_dim(%lld, %d) rc %d", (long long)dim, ndim, rc);
  if (rc) {
    check_refusal(rc, &e, "layout_wrap_dim");
    FZ_CHECK(e.kind == ERR_BAD_DIM, "kind %d", e.kind);
  } else {
    FZ_CHECK(out >= 0 && out < n && (out == dim || out == dim + n), "wrapped %lld to %lld",
             (long long)dim, (long long)out);
  }
}

/* ------------------------------------------------------------------ NDSlice */

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* A slice's ranks against its own index, get, coords and contains. */
static void check_slice(const ndslice_t *s, fz_t *in) {
  FZ_CHECK(s->ndim >= 0 && s->ndim <= NDSLICE_MAX_DIMS && s->offset >= 0, "ndim %d offset %lld",
           s->ndim, (long long)s->offset);
  __int128 len = 1, last = s->offset;
  for (int d = 0; d < s->ndim; d++) {
    FZ_CHECK(s->sizes[d] >= 1 && s->strides[d] >= 1, "dim %d size %lld stride %lld", d,
             (long long)s->sizes[d], (long long)s->strides[d]);
    len *= s->sizes[d];
    last += (__int128)(s->sizes[d] - 1) * s->strides[d];
    FZ_CHECK(len <= INT64_MAX && last <= INT64_MAX, "slice extent passes 2^63");
  }
  FZ_CHECK(ndslice_len(s) == (int64_t)len, "len %lld", (long long)ndslice_len(s));
  meshd_error_t e;
  int64_t seen[WALK_MAX];
  size_t nseen = 0;
  ndslice_iter_t it;
  int64_t r, pos = 0;
  for (ndslice_iter_init(&it, s); nseen < WALK_MAX && ndslice_iter_next(&it, &r); pos++) {
    FZ_CHECK(r >= s->offset && r <= (int64_t)last, "rank %lld outside %lld..%lld", (long long)r,
             (long long)s->offset, (long long)last);
    FZ_CHECK(ndslice_get(s, pos, &e) == r, "get(%lld) != walk rank %lld", (long long)pos,
             (long long)r);
    FZ_CHECK(ndslice_index(s, r) == pos, "index(%lld) = %lld, walk position %lld", (long long)r,
             (long long)ndslice_index(s, r), (long long)pos);
    FZ_CHECK(ndslice_contains(s, r), "walk rank %lld not contained", (long long)r);
    int64_t c[NDSLICE_MAX_DIMS];
    FZ_CHECK(ndslice_coords(s, r, c) == 0, "no coords for %lld", (long long)r);
    FZ_CHECK(ndslice_rank_of(s, c, &e) == r, "rank_of(coords(%lld))", (long long)r);
    seen[nseen++] = r;
  }
  qsort(seen, nseen, sizeof *seen, cmp_i64);
  for (size_t i = 1; i < nseen; i++) FZ_CHECK(seen[i] != seen[i - 1], "rank %lld twice", (long long)seen[i]);
  if (len <= WALK_MAX) {
    FZ_CHECK(pos == (int64_t)len && !ndslice_iter_next(&it, &r), "walk of %lld ranks, len %lld",
             (long long)pos, (long long)len);
  }
  FZ_CHECK(ndslice_get(s, -1, &e) == -1 && ndslice_get(s, (int64_t)len, &e) == -1,
           "get past the end");
  /* A few positions anywhere, and arbitrary ranks. */
  for (int k = 0; k < 4; k++) {
    int64_t p = (int64_t)(fz_u64(in) % (uint64_t)len);
    int64_t q = ndslice_get(s, p, &e);
    FZ_CHECK(q >= s->offset && ndslice_index(s, q) == p, "get/index at %lld", (long long)p);
    int64_t x = fz_i64(in);
    int64_t i = ndslice_index(s, x);
    FZ_CHECK(ndslice_contains(s, x) == (i >= 0), "contains/index disagree on %lld", (long long)x);
    if (i >= 0) FZ_CHECK(ndslice_get(s, i, &e) == x, "get(index(%lld))", (long long)x);
  }
  if (s->offset > 0) FZ_CHECK(!ndslice_contains(s, s->offset - 1), "contains offset-1");
  if (last < INT64_MAX) FZ_CHECK(!ndslice_contains(s, (int64_t)last + 1), "contains last+1");
}

/* Every walked rank of sub lies in s. */
static void check_within(const ndslice_t *sub, const ndslice_t *s) {
  ndslice_iter_t it;
  int64_t r;
  int k = 0;
  for (ndslice_iter_init(&it, sub); k < WALK_MAX && ndslice_iter_next(&it, &r); k++)
    FZ_CHECK(ndslice_contains(s, r), "sub-slice rank %lld is outside its parent", (long long)r);
}

/* Python's len(range(size)[start:stop:step]) for step >= 1. */
static int64_t py_slice_len(int64_t size, int64_t start, int64_t stop, int64_t step) {
  __int128 b = start, e = stop;
  if (b < 0) b = b + size < 0 ? 0 : b + size;
  else if (b > size) b = size;
  if (e < 0) e = e + size < 0 ? 0 : e + size;
  else if (e > size) e = size;
  if (e <= b) return 0;
  return (int64_t)((e - b - 1) / step + 1);
}

static void case_ndslice(fz_t *in) {
  ndslice_t s;
  meshd_error_t e = {0};
  int64_t sizes[NDSLICE_MAX_DIMS + 2], strides[NDSLICE_MAX_DIMS + 2];
  int rc;
  if (fz_bool(in)) {
    int ndim = (int)fz_range(in, 0, NDSLICE_MAX_DIMS + 1);
    for (int i = 0; i < ndim; i++) sizes[i] = fz_size(in);
    rc = ndslice_dense(&s, sizes, ndim, &e);
    if (rc == 0) {
      ndslice_iter_t it;
      int64_t r, want = 0;
      for (ndslice_iter_init(&it, &s); want < WALK_MAX && ndslice_iter_next(&it, &r); want++)
        FZ_CHECK(r == want, "dense slice walk gave %lld at %lld", (long long)r, (long long)want);
    }
  } else {
    int nsizes = (int)fz_range(in, -1, NDSLICE_MAX_DIMS + 1);
    int nstrides = fz_u8(in) < 240 ? nsizes : (int)fz_range(in, -1, NDSLICE_MAX_DIMS + 1);
    int64_t offset = fz_bool(in) ? 0 : fz_i64(in);
    for (int i = 0; i < NDSLICE_MAX_DIMS + 2; i++) {
      sizes[i] = i < nsizes ? fz_size(in) : 1;
      strides[i] = i < nstrides ? (fz_bool(in) ? (int64_t)1 << fz_range(in, 0, 62) : fz_i64(in)) : 1;
    }
    rc = ndslice_init(&s, offset, sizes, nsizes, strides, nstrides, &e);
  }
  if (rc) {
    check_refusal(rc, &e, "ndslice_init");
    return;
  }
  check_slice(&s, in);
  for (int round = 0; round < 3 && !fz_done(in) && s.ndim > 0; round++) {
    ndslice_t sub;
    meshd_error_t se = {0};
    int dim = fz_u8(in) < 240 ? (int)fz_range(in, 0, s.ndim - 1) : (int)fz_i64(in);
    if (fz_bool(in)) {
      int64_t index = fz_i64(in);
      rc = ndslice_at(&s, dim, index, &sub, &se);
      if (rc) {
        check_refusal(rc, &se, "ndslice_at");
        continue;
      }
      FZ_CHECK(sub.ndim == s.ndim - 1 && ndslice_len(&sub) * s.sizes[dim] == ndslice_len(&s),
               "at: %d dims, len %lld", sub.ndim, (long long)ndslice_len(&sub));
    } else {
      int64_t start = fz_i64(in), stop = fz_bool(in) ? INT64_MAX : fz_i64(in), step = fz_i64(in);
      rc = ndslice_select(&s, dim, start, stop, step, &sub, &se);
      if (rc) {
        check_refusal(rc, &se, "ndslice_select");
        continue;
      }
      int64_t want = py_slice_len(s.sizes[dim], start, stop, step);
      FZ_CHECK(step >= 1 && sub.ndim == s.ndim && sub.sizes[dim] == want,
               "select %lld:%lld:%lld of %lld: size %lld, expected %lld", (long long)start,
               (long long)stop, (long long)step, (long long)s.sizes[dim],
               (long long)sub.sizes[dim], (long long)want);
    }
    check_slice(&sub, in);
    check_within(&sub, &s);
    s = sub;
  }
}

/* ------------------------------------------------------------------ meshes */

static const char *const dim_names[] = {"host", "gpu", "dp", "tp", "pp", "a", "b", "_x"};

/* Coordinate of rank r along every dim of m into c (via mesh_coord). */
static void coords_of(const mesh_t *m, uint32_t r, int64_t *c) {
  for (int d = 0; d < m->ndim; d++) {
    c[d] = mesh_coord(m, r, d);
    FZ_CHECK(c[d] >= 0 && c[d] < m->slice.sizes[d], "rank %u has coordinate %lld on dim %d", r,
             (long long)c[d], d);
  }
}

static void check_mesh(const mesh_t *m) {
  FZ_CHECK(m->ndim == m->slice.ndim, "ndim %d, slice ndim %d", m->ndim, m->slice.ndim);
  for (int d = 0; d < m->ndim; d++) {
    FZ_CHECK(memchr(m->names[d], '\0', sizeof m->names[d]) && m->names[d][0], "dim %d name", d);
    FZ_CHECK(mesh_find_dim(m, m->names[d]) == d, "dim %d name '%s' not unique", d, m->names[d]);
  }
  size_t len = mesh_len(m);
  FZ_CHECK((int64_t)len == ndslice_len(&m->slice), "mesh_len");
  if (len <= WALK_MAX) {
    uint32_t ranks[WALK_MAX + 1];
    ranks[len] = 0xdeadbeef;
    FZ_CHECK(mesh_ranks(m, ranks) == len && ranks[len] == 0xdeadbeef, "mesh_ranks count");
    for (size_t i = 0; i < len; i++) {
      FZ_CHECK(mesh_contains(m, ranks[i]), "rank %u not in its mesh", ranks[i]);
      FZ_CHECK(ndslice_index(&m->slice, ranks[i]) == (int64_t)i, "rank %u at %zu", ranks[i], i);
    }
  }
  char buf[200];
  size_t cap = (size_t)(len % sizeof buf);
  memset(buf, 'x', sizeof buf);
  mesh_format(m, buf, cap);
  if (cap) FZ_CHECK(memchr(buf, '\0', cap), "mesh_format overran %zu bytes", cap);
}

/* A mesh from the input: by CreateMesh's rules, or (for large ones) by hand. */
static int make_mesh(fz_t *in, mesh_t *m) {
  meshd_error_t e = {0};
  int ndim = (int)fz_range(in, 0, NDSLICE_MAX_DIMS + 1);
  const char *names[NDSLICE_MAX_DIMS + 1];
  char bufs[NDSLICE_MAX_DIMS + 1][48];
  int64_t sizes[NDSLICE_MAX_DIMS + 1];
  for (int i = 0; i < ndim; i++) {
    names[i] = fz_pick_str(in, dim_names, 8, bufs[i], sizeof bufs[i]);
    sizes[i] = fz_size(in);
  }
  if (fz_u8(in) < 64) { /* past any pool: a dense mesh of up to 2^32 ranks, as CreateMesh allows */
    if (ndim > NDSLICE_MAX_DIMS) return -1;
    memset(m, 0, sizeof *m);
    m->ref = 1;
    m->ndim = ndim;
    for (int i = 0; i < ndim; i++) snprintf(m->names[i], sizeof m->names[i], "%s", dim_names[i]);
    if (ndslice_dense(&m->slice, sizes, ndim, &e)) return -1;
    return ndslice_len(&m->slice) <= (int64_t)UINT32_MAX + 1 ? 0 : -1;
  }
  bool healthy[96];
  size_t world = (size_t)fz_range(in, 0, sizeof healthy);
  uint8_t holes = fz_u8(in);
  for (size_t r = 0; r < world; r++) healthy[r] = !(holes && r % 97 == holes % 97);
  int rc = mesh_create_root(1, names, sizes, ndim, healthy, world, m, &e);
  if (rc) {
    check_refusal(rc, &e, "mesh_create_root");
    FZ_CHECK(strncmp(e.msg, "CreateMesh", 10) == 0, "message: %s", e.msg);
    return -1;
  }
  size_t len = mesh_len(m);
  FZ_CHECK(len <= world, "mesh of %zu ranks on a world of %zu", len, world);
  for (int i = 0; i < ndim; i++) FZ_CHECK(strcmp(m->names[i], names[i]) == 0, "name %d", i);
  ndslice_iter_t it;
  int64_t r, want = 0;
  for (ndslice_iter_init(&it, &m->slice); ndslice_iter_next(&it, &r); want++)
    FZ_CHECK(r == want && healthy[r], "root mesh rank %lld at %lld", (long long)r, (long long)want);
  return 0;
}

static void case_mesh(fz_t *in) {
  mesh_t m;
  if (make_mesh(in, &m)) return;
  check_mesh(&m);
  m.rank_capacity = fz_bool(in) ? 0 : fz_u64(in);
  uint64_t per_rank = fz_u64(in);
  meshd_error_t ce = {0};
  int rc = mesh_check_capacity(&m, "Factory", per_rank, &ce);
  FZ_CHECK((rc == 0) == (!m.rank_capacity || per_rank <= m.rank_capacity), "mesh_check_capacity");
  if (rc) {
    check_refusal(rc, &ce, "mesh_check_capacity");
    FZ_CHECK(ce.kind == ERR_QUOTA && strncmp(ce.msg, "Factory: ", 9) == 0, "%s", ce.msg);
  }
  for (int round = 0; round < 3 && !fz_done(in); round++) {
    mesh_selector_t sel[NDSLICE_MAX_DIMS + 1];
    char bufs[NDSLICE_MAX_DIMS + 1][48];
    size_t nsel = (size_t)fz_range(in, 0, NDSLICE_MAX_DIMS + 1);
    const char *names[NDSLICE_MAX_DIMS];
    for (int d = 0; d < m.ndim; d++) names[d] = m.names[d];
    for (size_t i = 0; i < nsel; i++) {
      sel[i] = (mesh_selector_t){.dim = fz_pick_str(in, names, (size_t)m.ndim, bufs[i], sizeof bufs[i])};
      if (fz_bool(in)) {
        sel[i].index = fz_i64(in);
      } else {
        sel[i].is_range = true;
        sel[i].start = fz_i64(in);
        sel[i].has_stop = fz_bool(in);
        sel[i].stop = fz_i64(in);
        sel[i].step = fz_i64(in);
        sel[i].has_step = fz_bool(in);
      }
    }
    mesh_t sub;
    meshd_error_t e = {0};
    uint64_t ref = fz_u64(in);
    int rc = mesh_slice(&m, ref, sel, nsel, &sub, &e);
    if (rc) {
      check_refusal(rc, &e, "mesh_slice");
      FZ_CHECK(strncmp(e.msg, "SliceMesh", 9) == 0, "message: %s", e.msg);
      continue;
    }
    FZ_CHECK(sub.ref == ref, "ref");
    check_mesh(&sub);
    /* Where each dim of the parent went: fixed at an index, or kept as start + i*step. */
    int64_t fixed[NDSLICE_MAX_DIMS], start[NDSLICE_MAX_DIMS], step[NDSLICE_MAX_DIMS];
    int kept[NDSLICE_MAX_DIMS], nkept = 0;
    for (int d = 0; d < m.ndim; d++) {
      const mesh_selector_t *s = NULL;
      for (size_t i = 0; i < nsel; i++)
        if (strcmp(sel[i].dim, m.names[d]) == 0) s = &sel[i];
      int64_t size = m.slice.sizes[d];
      fixed[d] = -1;
      start[d] = 0;
      step[d] = 1;
      if (s && !s->is_range) {
        fixed[d] = s->index < 0 ? s->index + size : s->index;
        continue;
      }
      if (s) {
        step[d] = s->has_step || s->step ? s->step : 1;
        FZ_CHECK(step[d] >= 1 && step[d] <= size, "dim '%s' of size %lld sliced with step %lld",
                 m.names[d], (long long)size, (long long)step[d]);
        int64_t stop = s->has_stop ? s->stop : INT64_MAX;
        int64_t n = py_slice_len(size, s->start, stop, step[d]);
        start[d] = s->start < 0 ? (s->start + size < 0 ? 0 : s->start + size)
                                : (s->start > size ? size : s->start);
        FZ_CHECK(n >= 1 && sub.slice.sizes[nkept] == n, "dim '%s' kept %lld of %lld, expected %lld",
                 m.names[d], (long long)sub.slice.sizes[nkept], (long long)size, (long long)n);
      } else {
        FZ_CHECK(sub.slice.sizes[nkept] == size, "unselected dim '%s' changed size", m.names[d]);
      }
      FZ_CHECK(strcmp(sub.names[nkept], m.names[d]) == 0, "dim %d is '%s', expected '%s'", nkept,
               sub.names[nkept], m.names[d]);
      kept[nkept++] = d;
    }
    FZ_CHECK(nkept == sub.ndim, "%d dims kept, mesh has %d", nkept, sub.ndim);
    /* Every rank of the selection sits in the parent where the selectors say. */
    ndslice_iter_t it;
    int64_t r;
    int k = 0;
    for (ndslice_iter_init(&it, &sub.slice); k < WALK_MAX && ndslice_iter_next(&it, &r); k++) {
      FZ_CHECK(r >= 0 && r <= UINT32_MAX, "rank %lld", (long long)r);
      FZ_CHECK(mesh_contains(&m, (uint32_t)r), "rank %lld of the slice is outside its parent",
               (long long)r);
      int64_t pc[NDSLICE_MAX_DIMS], sc[NDSLICE_MAX_DIMS];
      coords_of(&m, (uint32_t)r, pc);
      coords_of(&sub, (uint32_t)r, sc);
      for (int d = 0; d < m.ndim; d++)
        if (fixed[d] >= 0)
          FZ_CHECK(pc[d] == fixed[d], "rank %lld: dim '%s' at %lld, selected %lld", (long long)r,
                   m.names[d], (long long)pc[d], (long long)fixed[d]);
      for (int j = 0; j < nkept; j++) {
        int d = kept[j];
        FZ_CHECK(pc[d] == start[d] + sc[j] * step[d],
                 "rank %lld: dim '%s' at %lld in the parent, %lld in the slice (start %lld step %lld)",
                 (long long)r, m.names[d], (long long)pc[d], (long long)sc[j], (long long)start[d],
                 (long long)step[d]);
      }
    }
    m = sub;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_t in = fz_open(data, size);
  for (int n = 0; n < 16 && !fz_done(&in); n++) {
    switch (fz_u8(&in) % 5) {
    case 0: case_layout(&in); break;
    case 1: case_broadcast(&in); break;
    case 2: case_wrap_dim(&in); break;
    case 3: case_ndslice(&in); break;
    default: case_mesh(&in); break;
    }
  }
  return 0;
}
