#include "borrow.h"

#include <stdlib.h>

int borrow_create(objects_t *o, uint64_t ref, uint64_t result, obj_t *origin, uint64_t to_stream,
                  bool is_mutable, meshd_error_t *e) {
  storage_t *s = origin->tensor.storage;
  char label[OBJ_STREAM_LABEL_MAX];
  if (origin->tensor.stream == to_stream)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Borrow: tensor %llu is already on stream %s; borrow it onto another stream",
                     (unsigned long long)origin->ref,
                     objects_stream_label(o, to_stream, label, sizeof label));
  if (!(s->access & ACCESS_R))
    return error_set(e, ERR_BORROWED,
                     "Borrow: tensor %llu (or a view of it) is mutably borrowed by borrow %llu; "
                     "drop that borrow before borrowing it again",
                     (unsigned long long)origin->ref, (unsigned long long)s->mutable_borrow);
  if (is_mutable && !(s->access & ACCESS_W)) {
    if (s->borrow && s->read_borrows == 0)
      return error_set(e, ERR_BORROWED,
                       "Borrow: tensor %llu is a read-only borrow (borrow %llu) and cannot be "
                       "borrowed mutably", (unsigned long long)origin->ref,
                       (unsigned long long)s->borrow);
    return error_set(e, ERR_BORROWED,
                     "Borrow: cannot borrow tensor %llu mutably because it (or a view) is already "
                     "being borrowed non-mutably (%d read borrow%s); drop them first",
                     (unsigned long long)origin->ref, s->read_borrows, s->read_borrows == 1 ? "" : "s");
  }
  obj_t *b = objects_add(o, ref, OBJ_BORROW);
  if (!b) return error_set(e, ERR_QUOTA, "Borrow: out of memory on the server");
  tensor_meta_t m;
  obj_t *handle = objects_new_borrowed(o, result, obj_meta(origin, &m), origin, to_stream, ref);
  if (!handle) { /* the borrow's record goes too: nothing half-made stays under its ref */
    refmap_remove(&o->table, ref);
    o->live_borrows--;
    free(b);
    return error_set(e, ERR_QUOTA, "Borrow: out of memory on the server");
  }
  b->borrow = (borrow_obj_t){.origin = origin->ref,
                             .result = result,
                             .origin_storage = s,
                             .result_storage = handle->tensor.storage,
                             .is_mutable = is_mutable,
                             .from_stream = origin->tensor.stream,
                             .to_stream = to_stream};
  s->refs++;
  handle->tensor.storage->refs++;
  if (is_mutable) {
    s->access = 0;
    s->mutable_borrow = ref;
    handle->tensor.storage->access = ACCESS_R | ACCESS_W;
  } else {
    s->access = ACCESS_R;
    s->read_borrows++;
    handle->tensor.storage->access = ACCESS_R;
  }
  return 0;
}

/* The access a storage has with no borrow taken from it: a read borrow's
 * handle stays read-only. */
static unsigned own_access(objects_t *o, const storage_t *s) {
  const obj_t *b = s->borrow ? objects_get(o, s->borrow) : NULL;
  if (b && b->kind == OBJ_BORROW && !b->borrow.is_mutable) return ACCESS_R;
  return ACCESS_R | ACCESS_W;
}

int borrow_drop(objects_t *o, obj_t *b, uint64_t seq, meshd_error_t *e) {
  (void)e; /* a dropped borrow has no record left: objects_expect reports it */
  borrow_obj_t *x = &b->borrow;
  /* The handle and every view of it, the handle released or not (the borrow
   * holds the storage, so nothing is freed here). */
  objects_drop_storage(o, x->result_storage, seq);
  storage_t *s = x->origin_storage;
  if (x->is_mutable) s->mutable_borrow = 0;
  else s->read_borrows--;
  if (s->read_borrows == 0 && s->mutable_borrow == 0) s->access = own_access(o, s);
  o->live_borrows--;
  objects_bury_borrow(o, b, seq); /* frees b (and s, if nothing else holds it) */
  return 0;
}

uint64_t borrow_holder(objects_t *o, const storage_t *s) {
  if (s->mutable_borrow) return s->mutable_borrow;
  obj_t *it;
  for (size_t i = 0; (it = refmap_next(&o->table, &i));) {
    if (it->kind == OBJ_BORROW && it->borrow.origin_storage == s) return it->ref;
  }
  return 0;
}
