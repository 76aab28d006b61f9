/* Snapshots for Agent/Read (snapshot.h). */
#include "snapshot.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "refs.h"

struct snapshot {
  pthread_mutex_t mu; /* a read, or the copy before a write: one at a time */
  backend_t *b;
  agent_tensor_t t;   /* t.storage retained while pinned; NULL once copied */
  /* Device order (backends with streams): the point of the stream that the
   * snapshot is of, and the stream the copies out run on, made by the first
   * copy to wait for that point only: a Read never waits for what its stream
   * (or any other) queued after the Snapshot. NULL on cpu. */
  backend_event_t *at;
  backend_stream_t *copies;
  bool ordered;       /* copies waits for `at` */
  uint8_t *host;      /* the copy, once a write came */
  size_t bytes;
  struct snapshot *next; /* on t.storage->pinned (pin_mu) */
};

/* Guards every storage's `pinned` list. Writers take it only when a storage
 * has pins. */
static pthread_mutex_t pin_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t copies;

uint64_t snapshot_copies(void) { return atomic_load(&copies); }

snapshot_t *snapshot_pin(backend_t *b, backend_stream_t *bs, const agent_tensor_t *t,
                         meshd_error_t *err) {
  snapshot_t *s = calloc(1, sizeof *s);
  if (!s) {
    error_set(err, ERR_QUOTA, "agent out of host memory");
    return NULL;
  }
  if (b->ops->event_record && !(s->at = b->ops->event_record(b, bs))) {
    error_set(err, ERR_REMOTE_FAILURE, "the device cannot record the stream's point (an event)");
    free(s);
    return NULL;
  }
  pthread_mutex_init(&s->mu, NULL);
  s->b = b;
  s->t = *t;
  s->bytes = tensor_nbytes(&t->meta);
  storage_retain(t->storage);
  pthread_mutex_lock(&pin_mu);
  s->next = t->storage->pinned;
  t->storage->pinned = s;
  atomic_fetch_add(&t->storage->pins, 1);
  pthread_mutex_unlock(&pin_mu);
  return s;
}

const tensor_meta_t *snapshot_meta(const snapshot_t *s) { return &s->t.meta; }

size_t snapshot_bytes(const snapshot_t *s) { return s->bytes; }

/* Copies t's row-major elements [first, first + count) into dst, as
 * box-shaped views of t handed to the backend's to_host: each box fixes the
 * leading indices, takes a run along one dim and every index of the dims
 * after it, so it is `count` consecutive elements at most. */
static int read_elements(backend_t *b, backend_stream_t *bs, const agent_tensor_t *t,
                         int64_t first, int64_t count, uint8_t *dst, meshd_error_t *err) {
  const layout_t *l = &t->meta.layout;
  size_t es = dtype_size(t->meta.dtype);
  if (l->ndim == 0) return count ? b->ops->to_host(b, bs, t, dst, err) : 0;
  int64_t inner[LAYOUT_MAX_DIMS];
  inner[l->ndim - 1] = 1;
  for (int d = l->ndim - 1; d > 0; d--) inner[d - 1] = inner[d] * l->sizes[d];
  while (count > 0) {
    int k = l->ndim - 1;
    for (int d = 0; d < l->ndim; d++)
      if (first % inner[d] == 0 && inner[d] <= count) {
        k = d;
        break;
      }
    agent_tensor_t v = *t;
    layout_t *vl = &v.meta.layout;
    int64_t rest = first;
    for (int d = 0; d <= k; d++) {
      int64_t idx = rest / inner[d];
      rest %= inner[d];
      vl->offset += idx * l->strides[d];
      vl->sizes[d] = 1;
      if (d == k) {
        int64_t run = count / inner[k];
        vl->sizes[k] = run < l->sizes[k] - idx ? run : l->sizes[k] - idx;
      }
    }
    int64_t n = vl->sizes[k] * inner[k];
    if (b->ops->to_host(b, bs, &v, dst, err)) return -1;
    dst += (size_t)n * es;
    first += n;
    count -= n;
  }
  return 0;
}

/* s->copies ready to copy the snapshot out (under s->mu): a stream of its
 * own that waits for the snapshot's point (the backend's own stream if none
 * can be made). 0, or -1 with err. */
static int copies_ordered(snapshot_t *s, meshd_error_t *err) {
  if (s->ordered || !s->at) return 0;
  backend_t *b = s->b;
  if (b->ops->stream_create) s->copies = b->ops->stream_create(b);
  if (b->ops->event_wait(b, s->copies, s->at)) {
    if (s->copies) b->ops->stream_destroy(b, s->copies); /* the next copy makes another */
    s->copies = NULL;
    return error_set(err, ERR_REMOTE_FAILURE,
                     "the device cannot order the copy after the snapshot's point");
  }
  s->ordered = true;
  return 0;
}

int snapshot_read(snapshot_t *s, size_t off, size_t n, void *dst, meshd_error_t *err) {
  if (off > s->bytes || n > s->bytes - off)
    return error_set(err, ERR_REMOTE_FAILURE, "Read: bytes %zu..%zu are past the tensor's %zu", off,
                     off + n, s->bytes);
  size_t es = dtype_size(s->t.meta.dtype);
  pthread_mutex_lock(&s->mu);
  int rc = 0;
  if (s->host) memcpy(dst, s->host + off, n);
  else if (n && !(rc = copies_ordered(s, err)))
    rc = read_elements(s->b, s->copies, &s->t, (int64_t)(off / es), (int64_t)(n / es), dst, err);
  pthread_mutex_unlock(&s->mu);
  return rc;
}

int snapshot_before_write(backend_t *b, agent_storage_t *st, meshd_error_t *err) {
  if (!st || atomic_load(&st->pins) == 0) return 0;
  int rc = 0, moved = 0;
  pthread_mutex_lock(&pin_mu);
  while (st->pinned) {
    snapshot_t *s = st->pinned;
    pthread_mutex_lock(&s->mu); /* a chunk being read out finishes first */
    uint8_t *host = malloc(s->bytes ? s->bytes : 1);
    if (!host) {
      pthread_mutex_unlock(&s->mu);
      rc = error_set(err, ERR_QUOTA, "agent out of host memory setting aside a %zu-byte tensor "
                     "that a Fetch still reads, before writing it", s->bytes);
      break;
    }
    if (s->bytes && (copies_ordered(s, err) || b->ops->to_host(b, s->copies, &s->t, host, err))) {
      pthread_mutex_unlock(&s->mu);
      free(host);
      rc = -1;
      break;
    }
    s->host = host;
    s->t.storage = NULL;
    /* Reads come from host now: the device's stream and event go (each live
     * stream costs every free an event, cuda_backend.c). */
    if (s->copies) b->ops->stream_destroy(b, s->copies);
    if (s->at) b->ops->event_destroy(b, s->at);
    s->copies = NULL;
    s->at = NULL;
    st->pinned = s->next;
    s->next = NULL;
    moved++;
    atomic_fetch_sub(&st->pins, 1);
    atomic_fetch_add(&copies, 1);
    pthread_mutex_unlock(&s->mu);
  }
  pthread_mutex_unlock(&pin_mu);
  /* Their references to st: the writer holds one more, so never the last. */
  while (moved--) storage_release(st);
  return rc;
}

void snapshot_release(snapshot_t *s) {
  if (!s) return;
  agent_storage_t *st = NULL;
  pthread_mutex_lock(&pin_mu);
  if (!s->host) {
    st = s->t.storage;
    snapshot_t **p = &st->pinned;
    while (*p && *p != s) p = &(*p)->next;
    if (*p) *p = s->next;
    atomic_fetch_sub(&st->pins, 1);
  }
  pthread_mutex_unlock(&pin_mu);
  storage_release(st);
  if (s->copies) s->b->ops->stream_destroy(s->b, s->copies);
  if (s->at) s->b->ops->event_destroy(s->b, s->at);
  free(s->host);
  pthread_mutex_destroy(&s->mu);
  free(s);
}
