#include "mesh.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* How many rank runs ("0..5") a CreateMesh message lists before "and N more". */
#define MAX_RUNS 6

typedef struct strbuf {
  char *p;
  size_t len, used;
} strbuf_t;

__attribute__((format(printf, 2, 3))) static void sb_printf(strbuf_t *b, const char *fmt, ...) {
  if (b->used + 1 >= b->len) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(b->p + b->used, b->len - b->used, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  b->used += (size_t)n;
  if (b->used >= b->len) b->used = b->len - 1;
}

static void format_dims(strbuf_t *b, const char *const names[], const int64_t sizes[], int ndim) {
  sb_printf(b, "{");
  for (int i = 0; i < ndim; i++)
    sb_printf(b, "%s%.40s: %lld", i ? ", " : "", names[i] ? names[i] : "", (long long)sizes[i]);
  sb_printf(b, "}");
}

char *mesh_format(const mesh_t *m, char *buf, size_t len) {
  if (len == 0) return buf;
  buf[0] = '\0';
  const char *names[NDSLICE_MAX_DIMS];
  for (int i = 0; i < m->ndim; i++) names[i] = m->names[i];
  strbuf_t b = {buf, len, 0};
  format_dims(&b, names, m->slice.sizes, m->ndim);
  return buf;
}

static void format_dim_list(strbuf_t *b, const mesh_t *m) {
  if (m->ndim == 0) sb_printf(b, "none, every dim was sliced away");
  for (int i = 0; i < m->ndim; i++) sb_printf(b, "%s%s", i ? ", " : "", m->names[i]);
}

static bool is_identifier(const char *s) {
  if (!(isalpha((unsigned char)s[0]) || s[0] == '_')) return false;
  for (const char *p = s + 1; *p; p++)
    if (!(isalnum((unsigned char)*p) || *p == '_')) return false;
  return true;
}

static bool healthy_at(const bool *healthy, size_t world, int64_t r) {
  return healthy && (uint64_t)r < world && healthy[r];
}

/* End of the run of ranks starting at r that are all healthy or all not,
 * within [0, k). Ranks at or past world are all missing. */
static int64_t run_end(const bool *healthy, size_t world, int64_t k, int64_t r) {
  bool s = healthy_at(healthy, world, r);
  if ((uint64_t)r >= world) return k;
  int64_t e = r + 1;
  while (e < k && (uint64_t)e < world && healthy_at(healthy, world, e) == s) e++;
  if ((uint64_t)e >= world && !s) e = k;
  return e;
}

/* "0, 1, 3..7" for the ranks of [0, k) whose health equals want. */
static void format_runs(strbuf_t *b, const bool *healthy, size_t world, int64_t k, bool want) {
  int runs = 0, more = 0;
  for (int64_t r = 0; r < k;) {
    int64_t e = run_end(healthy, world, k, r);
    if (healthy_at(healthy, world, r) == want) {
      if (runs++ >= MAX_RUNS)
        more++;
      else if (e - r == 1)
        sb_printf(b, "%s%lld", runs > 1 ? ", " : "", (long long)r);
      else if (e - r == 2)
        sb_printf(b, "%s%lld, %lld", runs > 1 ? ", " : "", (long long)r, (long long)r + 1);
      else
        sb_printf(b, "%s%lld..%lld", runs > 1 ? ", " : "", (long long)r, (long long)e - 1);
    }
    r = e;
  }
  if (more) sb_printf(b, " and %d more run%s", more, more == 1 ? "" : "s");
}

/* CreateMesh's names and sizes; *k gets the number of ranks. */
static int check_dims(const char *const names[], const int64_t sizes[], int ndim, int64_t *k_out,
                      meshd_error_t *err) {
  if (ndim < 1)
    return error_set(err, ERR_BAD_ARGUMENT, "CreateMesh needs at least one dim, e.g. {gpu: 4}");
  if (ndim > NDSLICE_MAX_DIMS)
    return error_set(err, ERR_BAD_ARGUMENT, "CreateMesh has %d dims; at most %d are supported",
                     ndim, NDSLICE_MAX_DIMS);
  for (int i = 0; i < ndim; i++) {
    const char *n = names[i];
    if (!n || !n[0])
      return error_set(
          err, ERR_BAD_ARGUMENT,
          "CreateMesh: dim %d has an empty name; name every dim, e.g. {host: 2, gpu: 4}", i);
    size_t len = strlen(n);
    if (len > MESH_DIM_NAME_MAX)
      return error_set(err, ERR_BAD_ARGUMENT,
                       "CreateMesh: dim name '%.40s...' is %zu characters; at most %d are allowed",
                       n, len, MESH_DIM_NAME_MAX);
    if (!is_identifier(n))
      return error_set(err, ERR_BAD_ARGUMENT,
                       "CreateMesh: dim name '%s' is not an identifier (letters, digits and _, "
                       "not starting with a digit)",
                       n);
    for (int j = 0; j < i; j++)
      if (strcmp(names[j], n) == 0)
        return error_set(err, ERR_BAD_DIM, "CreateMesh: dim '%s' appears twice", n);
  }
  int64_t k = 1;
  for (int i = 0; i < ndim; i++) {
    if (sizes[i] < 1)
      return error_set(err, ERR_BAD_ARGUMENT,
                       "CreateMesh: dim '%s' has size %lld; sizes must be >= 1", names[i],
                       (long long)sizes[i]);
    if (__builtin_mul_overflow(k, sizes[i], &k) || k > (int64_t)UINT32_MAX + 1) {
      char dims[300];
      strbuf_t b = {dims, sizeof dims, 0};
      format_dims(&b, names, sizes, ndim);
      return error_set(err, ERR_BAD_ARGUMENT,
                       "CreateMesh %s asks for more than 2^32 ranks; ask for a smaller mesh", dims);
    }
  }
  *k_out = k;
  return 0;
}

int mesh_create_placed(uint64_t ref, const char *const names[], const int64_t sizes[], int ndim,
                       const bool *healthy_by_rank, const bool *drained_by_rank, size_t world,
                       mesh_t *out, meshd_error_t *err) {
  int64_t k;
  if (check_dims(names, sizes, ndim, &k, err) != 0) return -1;
  bool avoid = false;
  for (int64_t r = 0; drained_by_rank && r < k && (uint64_t)r < world; r++)
    avoid |= drained_by_rank[r];
  if (!avoid || !healthy_by_rank)
    return mesh_create_root(ref, names, sizes, ndim, healthy_by_rank, world, out, err);
  char dims[300];
  strbuf_t b = {dims, sizeof dims, 0};
  format_dims(&b, names, sizes, ndim);
  int64_t run = 0;
  for (int64_t r = 0; (uint64_t)r < world; r++) {
    run = healthy_by_rank[r] && !drained_by_rank[r] ? run + 1 : 0;
    if (run < k) continue;
    int64_t strides[NDSLICE_MAX_DIMS];
    int64_t stride = 1;
    for (int i = ndim; i-- > 0;) {
      strides[i] = stride;
      stride *= sizes[i];
    }
    mesh_t m = {.ref = ref, .ndim = ndim};
    if (ndslice_init(&m.slice, r - k + 1, sizes, ndim, strides, ndim, err) != 0) return -1;
    for (int i = 0; i < ndim; i++) snprintf(m.names[i], sizeof m.names[i], "%s", names[i]);
    *out = m;
    return 0;
  }
  char drained[200] = "";
  b = (strbuf_t){drained, sizeof drained, 0};
  int64_t usable = 0;
  for (size_t r = 0; r < world; r++) {
    if (drained_by_rank[r]) sb_printf(&b, "%s%zu", b.used ? ", " : "", r);
    usable += healthy_by_rank[r] && !drained_by_rank[r];
  }
  return error_set(err, ERR_QUOTA,
                   "CreateMesh %s needs %lld consecutive healthy agents, but rank%s %s %s drained "
                   "(meshctl drain) and no other run of %lld is free (%lld healthy undrained "
                   "agent%s in all); undrain a rank (meshctl undrain RANK), start more agents or "
                   "ask for a smaller mesh",
                   dims, (long long)k, strchr(drained, ',') ? "s" : "", drained,
                   strchr(drained, ',') ? "are" : "is", (long long)k, (long long)usable,
                   usable == 1 ? "" : "s");
}

int mesh_create_root(uint64_t ref, const char *const names[], const int64_t sizes[], int ndim,
                     const bool *healthy_by_rank, size_t world, mesh_t *out, meshd_error_t *err) {
  int64_t k;
  if (check_dims(names, sizes, ndim, &k, err) != 0) return -1;

  int64_t have = 0;
  for (int64_t r = 0; r < k && (uint64_t)r < world; r++)
    have += healthy_at(healthy_by_rank, world, r);
  if (have < k) {
    char dims[300], ok[200] = "", missing[200] = "";
    strbuf_t b = {dims, sizeof dims, 0};
    format_dims(&b, names, sizes, ndim);
    b = (strbuf_t){ok, sizeof ok, 0};
    format_runs(&b, healthy_by_rank, world, k, true);
    b = (strbuf_t){missing, sizeof missing, 0};
    format_runs(&b, healthy_by_rank, world, k, false);
    char need[64];
    if (k == 1)
      snprintf(need, sizeof need, "1 agent (rank 0)");
    else
      snprintf(need, sizeof need, "%lld agents (ranks 0..%lld)", (long long)k, (long long)k - 1);
    /* Healthy agents at ranks >= k (an agent started with --rank 3 alone) do not
     * help, which "start more agents" alone does not tell. */
    int64_t past = 0, first_past = -1;
    for (size_t r = (size_t)k; healthy_by_rank && r < world; r++)
      if (healthy_by_rank[r] && past++ == 0) first_past = (int64_t)r;
    char hint[160] = "";
    if (past)
      snprintf(hint, sizeof hint,
               " (%lld healthy agent%s from rank %lld on do%s not count: a mesh takes ranks from "
               "0, see meshd-agent --rank)",
               (long long)past, past == 1 ? "" : "s", (long long)first_past,
               past == 1 ? "es" : "");
    if (have == 0)
      return error_set(err, ERR_BAD_ARGUMENT,
                       "CreateMesh %s needs %s but none of them is healthy (missing: %s); start "
                       "more agents or ask for a smaller mesh%s",
                       dims, need, missing, hint);
    return error_set(
        err, ERR_BAD_ARGUMENT,
        "CreateMesh %s needs %s but only %lld %s healthy: %s (missing: %s); start more "
        "agents or ask for a smaller mesh%s",
        dims, need, (long long)have, have == 1 ? "is" : "are", ok, missing, hint);
  }

  mesh_t m = {.ref = ref, .ndim = ndim};
  if (ndslice_dense(&m.slice, sizes, ndim, err) != 0) return -1;
  for (int i = 0; i < ndim; i++) snprintf(m.names[i], sizeof m.names[i], "%s", names[i]);
  *out = m;
  return 0;
}

int mesh_check_capacity(const mesh_t *m, const char *cmd, uint64_t per_rank, meshd_error_t *err) {
  if (!m->rank_capacity || per_rank <= m->rank_capacity) return 0;
  char dims[200];
  mesh_format(m, dims, sizeof dims);
  return error_set(err, ERR_QUOTA,
                   "%s: the result needs %llu bytes on each rank, but the smallest agent of mesh "
                   "%llu %s holds at most %llu bytes; use a smaller shape, or spread the tensor "
                   "over more ranks",
                   cmd, (unsigned long long)per_rank, (unsigned long long)m->ref, dims,
                   (unsigned long long)m->rank_capacity);
}

int mesh_find_dim(const mesh_t *m, const char *name) {
  if (!name) return -1;
  for (int i = 0; i < m->ndim; i++)
    if (strcmp(m->names[i], name) == 0) return i;
  return -1;
}

/* Python's slice.indices for step >= 1. */
static int64_t clamp_pos(int64_t v, int64_t size) {
  if (v < 0) {
    v += size;
    return v < 0 ? 0 : v;
  }
  return v > size ? size : v;
}

static void remove_name(mesh_t *m, int dim) {
  for (int i = dim; i + 1 < m->ndim; i++) memcpy(m->names[i], m->names[i + 1], sizeof m->names[i]);
  m->ndim--;
  memset(m->names[m->ndim], 0, sizeof m->names[m->ndim]);
}

int mesh_slice(const mesh_t *parent, uint64_t ref, const mesh_selector_t *sel, size_t nsel,
               mesh_t *out, meshd_error_t *err) {
  for (size_t i = 0; i < nsel; i++) {
    const char *d = sel[i].dim;
    if (!d || !d[0])
      return error_set(err, ERR_BAD_DIM, "SliceMesh: selector %zu has no dim name", i);
    if (mesh_find_dim(parent, d) < 0) {
      char dims[300];
      strbuf_t b = {dims, sizeof dims, 0};
      format_dim_list(&b, parent);
      return error_set(err, ERR_BAD_DIM, "SliceMesh: mesh has no dim '%.40s' (dims: %s)", d, dims);
    }
    for (size_t j = 0; j < i; j++)
      if (strcmp(sel[j].dim, d) == 0)
        return error_set(err, ERR_BAD_DIM,
                         "SliceMesh: dim '%s' is selected twice; give each dim at most once", d);
  }

  mesh_t m = *parent;
  m.ref = ref;
  for (size_t i = 0; i < nsel; i++) {
    const mesh_selector_t *s = &sel[i];
    int dim = mesh_find_dim(&m, s->dim);
    int64_t size = m.slice.sizes[dim];
    meshd_error_t e;
    if (!s->is_range) {
      if (s->index < -size || s->index >= size)
        return error_set(err, ERR_BAD_ARGUMENT,
                         "SliceMesh: index %lld is out of range for dim '%s' of size %lld (use "
                         "0..%lld, or -%lld..-1 from the end)",
                         (long long)s->index, s->dim, (long long)size, (long long)size - 1,
                         (long long)size);
      if (ndslice_at(&m.slice, dim, s->index, &m.slice, &e) != 0)
        return error_set(err, e.kind, "SliceMesh %s=%lld: %s", s->dim, (long long)s->index, e.msg);
      remove_name(&m, dim);
      continue;
    }
    int64_t step = s->has_step || s->step != 0 ? s->step : 1;
    if (step < 1)
      return error_set(err, ERR_BAD_ARGUMENT,
                       "SliceMesh: step %lld for dim '%s' must be >= 1 (leave it out for 1)",
                       (long long)step, s->dim);
    if (step > size)
      return error_set(err, ERR_BAD_ARGUMENT,
                       "SliceMesh: step %lld for dim '%s' is beyond the dim's size %lld; a step "
                       "may be at most the size (to pick one rank, give an index)",
                       (long long)step, s->dim, (long long)size);
    int64_t stop = s->has_stop ? s->stop : INT64_MAX;
    char range[96];
    if (!s->has_stop)
      snprintf(range, sizeof range, "%lld::%lld", (long long)s->start, (long long)step);
    else
      snprintf(range, sizeof range, "%lld:%lld:%lld", (long long)s->start, (long long)s->stop,
               (long long)step);
    if (clamp_pos(stop, size) <= clamp_pos(s->start, size))
      return error_set(err, ERR_BAD_ARGUMENT,
                       "SliceMesh: %s=%s selects nothing from dim '%s' of size %lld", s->dim, range,
                       s->dim, (long long)size);
    if (ndslice_select(&m.slice, dim, s->start, stop, step, &m.slice, &e) != 0)
      return error_set(err, e.kind, "SliceMesh: %s=%s leaves a mesh that is not valid (%s)", s->dim,
                       range, e.msg);
  }
  *out = m;
  return 0;
}

size_t mesh_len(const mesh_t *m) { return (size_t)ndslice_len(&m->slice); }

size_t mesh_ranks(const mesh_t *m, uint32_t *out) {
  ndslice_iter_t it;
  int64_t r;
  size_t n = 0;
  for (ndslice_iter_init(&it, &m->slice); ndslice_iter_next(&it, &r);) out[n++] = (uint32_t)r;
  return n;
}

bool mesh_contains(const mesh_t *m, uint32_t rank) { return ndslice_contains(&m->slice, rank); }

int64_t mesh_coord(const mesh_t *m, uint32_t rank, int dim) {
  int64_t c[NDSLICE_MAX_DIMS];
  if (dim < 0 || dim >= m->ndim) return -1;
  if (ndslice_coords(&m->slice, rank, c) != 0) return -1;
  return c[dim];
}
