#include "checks.h"

#include <stdio.h>

#include "borrow.h"

obj_t *check_tensor(objects_t *o, const char *cmd, const char *what, uint64_t ref,
                    meshd_error_t *e) {
  char where[160];
  snprintf(where, sizeof where, "%s: %s", cmd, what);
  const tombstone_t *g = objects_get(o, ref) ? NULL : objects_dropped(o, ref);
  /* A handle the client dropped itself (Drop) also has g->borrow: blame the
   * borrow only if dropping it is what dropped the handle. */
  const tombstone_t *b = g && g->borrow ? objects_dropped_borrow(o, g->borrow) : NULL;
  if (b && b->seq == g->seq) {
    error_set(e, ERR_DROPPED,
              "%s (tensor %llu) was dropped at command seq %llu, when its borrow %llu was dropped; "
              "borrow the tensor again to use it on this stream",
              where, (unsigned long long)ref, (unsigned long long)g->seq,
              (unsigned long long)g->borrow);
    return NULL;
  }
  if (g) {
    error_set(e, ERR_DROPPED, "%s (tensor %llu) was dropped at command seq %llu and can no longer be used",
              where, (unsigned long long)ref, (unsigned long long)g->seq);
    return NULL;
  }
  return objects_expect(o, ref, OBJ_TENSOR, where, e);
}

static void mesh_text(objects_t *o, uint64_t ref, char *buf, size_t len) {
  obj_t *m = objects_get(o, ref);
  char dims[200] = "?";
  if (m && m->kind == OBJ_MESH) mesh_format(m->mesh, dims, sizeof dims);
  snprintf(buf, len, "mesh %llu %s", (unsigned long long)ref, dims);
}

int check_uses(objects_t *o, const char *cmd, const tensor_use_t *uses, size_t n, uint64_t *mesh,
               uint64_t stream, meshd_error_t *e) {
  const tensor_use_t *first = NULL;
  for (size_t i = 0; i < n; i++) {
    const tensor_use_t *u = &uses[i];
    const tensor_obj_t *t = &u->t->tensor;
    unsigned long long ref = (unsigned long long)u->t->ref;
    if (*mesh == 0) {
      *mesh = t->mesh;
      first = u;
    } else if (t->mesh != *mesh) {
      char want[240], got[240];
      mesh_text(o, *mesh, want, sizeof want);
      mesh_text(o, t->mesh, got, sizeof got);
      if (first)
        return error_set(e, ERR_WRONG_MESH,
                         "%s: %s (tensor %llu) is on %s but %s (tensor %llu) is on %s; every tensor "
                         "of one command must be on the same mesh: move it with to_mesh",
                         cmd, u->what, ref, got, first->what, (unsigned long long)first->t->ref, want);
      return error_set(e, ERR_WRONG_MESH,
                       "%s: %s (tensor %llu) is on %s but the command runs on %s; move it with "
                       "to_mesh", cmd, u->what, ref, got, want);
    }
    if (t->stream != stream) {
      char have[OBJ_STREAM_LABEL_MAX], want[OBJ_STREAM_LABEL_MAX];
      objects_stream_label(o, t->stream, have, sizeof have);
      objects_stream_label(o, stream, want, sizeof want);
      return error_set(e, ERR_WRONG_STREAM,
                       "%s: %s (tensor %llu) is on stream %s but the command runs on stream "
                       "%s; borrow it onto %s first, or run the command on %s",
                       cmd, u->what, ref, have, want, want, have);
    }
    const storage_t *s = t->storage;
    if (!(s->access & ACCESS_R))
      return error_set(e, ERR_BORROWED,
                       "%s: %s (tensor %llu) is mutably borrowed (borrow %llu); it cannot be used "
                       "until the borrow is dropped",
                       cmd, u->what, ref, (unsigned long long)s->mutable_borrow);
    if (u->write && !(s->access & ACCESS_W)) {
      if (s->borrow && s->read_borrows == 0)
        return error_set(e, ERR_MUTATING_BORROW,
                         "%s: %s (tensor %llu) is a read-only borrow (borrow %llu) and cannot be "
                         "mutated; borrow it with mutable=True to write to it",
                         cmd, u->what, ref, (unsigned long long)s->borrow);
      return error_set(e, ERR_MUTATING_BORROW,
                       "%s: %s (tensor %llu) cannot be mutated while it (or a view of it) is "
                       "borrowed for reading (borrow %llu); drop the borrow first",
                       cmd, u->what, ref, (unsigned long long)borrow_holder(o, s));
    }
  }
  return 0;
}
