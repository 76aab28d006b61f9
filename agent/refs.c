#include "refs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

struct ref_slot {
  uint64_t ref;
  bool failed;
  agent_tensor_t t;      /* when !failed */
  ref_failure_t *why;    /* when failed */
  UT_hash_handle hh;
};

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

size_t tensor_nbytes(const tensor_meta_t *m) {
  return (size_t)layout_numel(&m->layout) * dtype_size(m->dtype);
}

int tensor_alloc(backend_t *b, backend_stream_t *s, const tensor_meta_t *meta, agent_tensor_t *out,
                 const char *what, meshd_error_t *err) {
  out->meta = *meta;
  layout_make_contiguous(&out->meta.layout);
  out->storage = storage_new(b, s, tensor_nbytes(meta), what, err);
  return out->storage ? 0 : -1;
}

void refs_init(refs_t *r) {
  pthread_mutex_init(&r->mu, NULL);
  r->map = NULL;
}

static void slot_reset(ref_slot_t *s) {
  if (s->failed) free(s->why);
  else storage_release(s->t.storage);
  s->why = NULL;
  s->t.storage = NULL;
}

void refs_clear(refs_t *r) {
  pthread_mutex_lock(&r->mu);
  ref_slot_t *s, *tmp;
  HASH_ITER(hh, r->map, s, tmp) {
    HASH_DEL(r->map, s);
    slot_reset(s);
    free(s);
  }
  pthread_mutex_unlock(&r->mu);
}

int refs_get(refs_t *r, uint64_t ref, agent_tensor_t *out, ref_failure_t *why) {
  pthread_mutex_lock(&r->mu);
  ref_slot_t *s = NULL;
  HASH_FIND(hh, r->map, &ref, sizeof ref, s);
  int rc = -1;
  if (s && s->failed) {
    if (why) *why = *s->why;
    rc = 1;
  } else if (s) {
    *out = s->t;
    storage_retain(out->storage);
    rc = 0;
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* The slot for ref, emptied, in the table; NULL out of memory. Holds mu. */
static ref_slot_t *slot_locked(refs_t *r, uint64_t ref) {
  ref_slot_t *s = NULL;
  HASH_FIND(hh, r->map, &ref, sizeof ref, s);
  if (s) {
    slot_reset(s);
    return s;
  }
  s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->ref = ref;
  HASH_ADD(hh, r->map, ref, sizeof s->ref, s);
  return s;
}

int refs_put(refs_t *r, uint64_t ref, const agent_tensor_t *t) {
  storage_retain(t->storage);
  pthread_mutex_lock(&r->mu);
  ref_slot_t *s = slot_locked(r, ref);
  if (s) {
    s->failed = false;
    s->t = *t;
  }
  pthread_mutex_unlock(&r->mu);
  if (!s) storage_release(t->storage);
  return s ? 0 : -1;
}

int refs_fail(refs_t *r, uint64_t ref, const ref_failure_t *why) {
  ref_failure_t *copy = malloc(sizeof *copy);
  if (!copy) return -1;
  *copy = *why;
  pthread_mutex_lock(&r->mu);
  ref_slot_t *s = slot_locked(r, ref);
  if (s) {
    s->failed = true;
    s->why = copy;
  }
  pthread_mutex_unlock(&r->mu);
  if (!s) free(copy);
  return s ? 0 : -1;
}

void refs_delete(refs_t *r, uint64_t ref) {
  pthread_mutex_lock(&r->mu);
  ref_slot_t *s = NULL;
  HASH_FIND(hh, r->map, &ref, sizeof ref, s);
  if (s) {
    HASH_DEL(r->map, s);
    slot_reset(s);
    free(s);
  }
  pthread_mutex_unlock(&r->mu);
}

size_t refs_count(refs_t *r) {
  pthread_mutex_lock(&r->mu);
  size_t n = HASH_COUNT(r->map);
  pthread_mutex_unlock(&r->mu);
  return n;
}
