#include "refs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "meta_pack.h"

/* One ref: a tensor (its storage and packed meta) or the failure in its place. */
typedef struct ref_slot {
  uint64_t ref; /* first: the index's key */
  union {
    agent_storage_t *storage; /* when !failed */
    ref_failure_t *why;       /* when failed */
  };
  bool failed;
  uint8_t meta[]; /* when !failed: dtype and layout */
} ref_slot_t;

agent_storage_t *storage_new(backend_t *b, backend_stream_t *st, size_t bytes, const char *what,
                             meshd_error_t *err) {
  if (!bytes) bytes = 1;
  agent_storage_t *s = calloc(1, sizeof *s);
  void *data = s ? b->ops->alloc(b, st, bytes) : NULL;
  if (!data) {
    free(s);
    error_set(err, ERR_QUOTA,
              "%s: the agent cannot allocate %zu bytes (it holds %llu of its %llu bytes); drop "
              "tensors you no longer need", what, bytes,
              (unsigned long long)atomic_load(&b->allocated), (unsigned long long)b->capacity);
    return NULL;
  }
  atomic_init(&s->refs, 1);
  s->backend = b;
  s->data = data;
  s->bytes = bytes;
  return s;
}

void storage_retain(agent_storage_t *s) { atomic_fetch_add(&s->refs, 1); }

void storage_release(agent_storage_t *s) {
  if (!s || atomic_fetch_sub(&s->refs, 1) != 1) return;
  backend_t *b = s->backend;
  b->ops->free(b, s->data, s->bytes);
  free(s);
}

size_t tensor_nbytes(const tensor_meta_t *m) { return (size_t)meta_nbytes(m); }

int tensor_alloc(backend_t *b, backend_stream_t *s, const tensor_meta_t *meta, agent_tensor_t *out,
                 const char *what, meshd_error_t *err) {
  out->meta = *meta;
  layout_make_contiguous(&out->meta.layout);
  out->storage = storage_new(b, s, tensor_nbytes(meta), what, err);
  return out->storage ? 0 : -1;
}

void refs_init(refs_t *r) {
  pthread_mutex_init(&r->mu, NULL);
  r->map = (refmap_t){0};
  r->undone = NULL;
  r->nundone = r->undone_cap = 0;
}

static void slot_free(ref_slot_t *s) {
  if (!s) return;
  if (s->failed) free(s->why);
  else storage_release(s->storage);
  free(s);
}

void refs_clear(refs_t *r) {
  pthread_mutex_lock(&r->mu);
  refmap_t map = r->map;
  r->map = (refmap_t){0};
  free(r->undone);
  r->undone = NULL;
  r->nundone = r->undone_cap = 0;
  pthread_mutex_unlock(&r->mu);
  ref_slot_t *s;
  for (size_t i = 0; (s = refmap_next(&map, &i));) slot_free(s);
  refmap_free(&map);
}

int refs_get(refs_t *r, uint64_t ref, agent_tensor_t *out, ref_failure_t *why) {
  pthread_mutex_lock(&r->mu);
  ref_slot_t *s = refmap_get(&r->map, ref);
  int rc = -1;
  if (s && s->failed) {
    if (why) *why = *s->why;
    rc = 1;
  } else if (s) {
    meta_unpack(s->meta, &out->meta);
    out->storage = s->storage;
    storage_retain(out->storage);
    rc = 0;
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* Puts s in place of ref's slot, if any. 0, or -1 out of memory (s freed). */
static bool undone_locked(const refs_t *r, uint64_t ref) {
  for (size_t i = 0; i < r->nundone; i++)
    if (r->undone[i] == ref) return true;
  return false;
}

/* The other live refs viewing `shared` fail as *why (Monarch fails every
 * alias of memory a failed in-place write leaves undefined); their old slots
 * go into *gone, for the caller to free outside the lock. Under r->mu. */
static void fail_sharing_locked(refs_t *r, const agent_storage_t *shared, const ref_failure_t *why,
                                ref_slot_t ***gone, size_t *ngone) {
  size_t n = 0, cap = 0;
  uint64_t *refs = NULL;
  ref_slot_t *it;
  for (size_t i = 0; (it = refmap_next(&r->map, &i));) {
    if (it->failed || it->storage != shared) continue;
    if (n == cap) {
      size_t c = cap ? 2 * cap : 8;
      uint64_t *v = realloc(refs, c * sizeof *v);
      if (!v) break;
      refs = v;
      cap = c;
    }
    refs[n++] = it->ref;
  }
  ref_slot_t **olds = n ? calloc(n, sizeof *olds) : NULL;
  size_t k = 0;
  for (size_t i = 0; olds && i < n; i++) {
    ref_slot_t *f = malloc(sizeof *f);
    ref_failure_t *copy = f ? malloc(sizeof *copy) : NULL;
    if (!copy) {
      free(f);
      break;
    }
    *copy = *why;
    copy->by_sharing = true;
    *f = (ref_slot_t){.ref = refs[i], .failed = true, .why = copy};
    ref_slot_t *old = refmap_remove(&r->map, refs[i]);
    if (refmap_put(&r->map, f)) { /* out of memory: the old one stays */
      refmap_put(&r->map, old);
      slot_free(f);
      continue;
    }
    olds[k++] = old;
  }
  free(refs);
  *gone = olds;
  *ngone = k;
}

/* s replaces ref's slot; unless `write` and ref was deleted before (2). A
 * failure in place of a live tensor whose storage others hold fails the
 * other refs viewing it too (fail_sharing_locked). */
static int replace(refs_t *r, ref_slot_t *s, bool write) {
  pthread_mutex_lock(&r->mu);
  if (write && undone_locked(r, s->ref)) {
    pthread_mutex_unlock(&r->mu);
    slot_free(s);
    return 2;
  }
  ref_slot_t *old = refmap_remove(&r->map, s->ref);
  int rc = refmap_put(&r->map, s);
  ref_slot_t **gone = NULL;
  size_t ngone = 0;
  if (!rc && s->failed && old && !old->failed && atomic_load(&old->storage->refs) > 1)
    fail_sharing_locked(r, old->storage, s->why, &gone, &ngone);
  pthread_mutex_unlock(&r->mu);
  slot_free(old);
  for (size_t i = 0; i < ngone; i++) slot_free(gone[i]);
  free(gone);
  if (rc) slot_free(s);
  return rc;
}

static int put(refs_t *r, uint64_t ref, const agent_tensor_t *t, bool write) {
  ref_slot_t *s = malloc(sizeof *s + meta_packed_size(&t->meta));
  if (!s) return -1;
  s->ref = ref;
  s->failed = false;
  s->storage = t->storage;
  storage_retain(t->storage);
  meta_pack(s->meta, &t->meta);
  return replace(r, s, write);
}

int refs_put(refs_t *r, uint64_t ref, const agent_tensor_t *t) { return put(r, ref, t, false); }

int refs_put_write(refs_t *r, uint64_t ref, const agent_tensor_t *t) { return put(r, ref, t, true); }

int refs_fail(refs_t *r, uint64_t ref, const ref_failure_t *why) {
  ref_slot_t *s = malloc(sizeof *s);
  ref_failure_t *copy = s ? malloc(sizeof *copy) : NULL;
  if (!copy) {
    free(s);
    return -1;
  }
  *copy = *why;
  copy->by_sharing = false; /* its own failure, reported for it */
  s->ref = ref;
  s->failed = true;
  s->why = copy;
  return replace(r, s, false);
}

void refs_told(refs_t *r, uint64_t ref) {
  pthread_mutex_lock(&r->mu);
  ref_slot_t *s = refmap_get(&r->map, ref);
  if (s && s->failed && s->why) s->why->by_sharing = false;
  pthread_mutex_unlock(&r->mu);
}

void refs_delete(refs_t *r, uint64_t ref) {
  pthread_mutex_lock(&r->mu);
  ref_slot_t *s = refmap_remove(&r->map, ref);
  if (!s && !undone_locked(r, ref)) {
    if (r->nundone == REFS_UNDONE_MAX) { /* the oldest goes: its Write is long over */
      memmove(r->undone, r->undone + 1, (REFS_UNDONE_MAX - 1) * sizeof *r->undone);
      r->nundone--;
    }
    if (r->nundone == r->undone_cap) {
      size_t cap = r->undone_cap ? 2 * r->undone_cap : 16;
      uint64_t *v = realloc(r->undone, cap * sizeof *v);
      if (v) {
        r->undone = v;
        r->undone_cap = cap;
      }
    }
    if (r->nundone < r->undone_cap) r->undone[r->nundone++] = ref;
  }
  pthread_mutex_unlock(&r->mu);
  slot_free(s);
}

size_t refs_count(refs_t *r) {
  pthread_mutex_lock(&r->mu);
  size_t n = r->map.n;
  pthread_mutex_unlock(&r->mu);
  return n;
}
