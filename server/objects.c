#include "objects.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

objects_t *objects_create(void) { return calloc(1, sizeof(objects_t)); }

static void storage_unref(storage_t *s) {
  if (s && --s->refs == 0) free(s);
}

void objects_destroy(objects_t *o) {
  if (!o) return;
  obj_t *it;
  for (size_t i = 0; (it = refmap_next(&o->table, &i));) {
    if (it->kind == OBJ_TENSOR) {
      storage_unref(it->tensor.storage);
      free(it->tensor.fail);
    } else if (it->kind == OBJ_BORROW) {
      storage_unref(it->borrow.origin_storage);
      storage_unref(it->borrow.result_storage);
    } else if (it->kind == OBJ_MESH) {
      free(it->mesh);
    } else if (it->kind == OBJ_STREAM) {
      free(it->stream.name);
    }
    free(it);
  }
  refmap_free(&o->table);
  for (size_t i = 0; i < o->gcap; i++) free(o->graves[i].fail);
  free(o->graves);
  free(o->unreported);
  free(o->unreported_seq);
  free(o->touched);
  free(o->last_seq);
  free(o->opened_seq);
  free(o);
}

void objects_note_failure(objects_t *o, error_kind_t kind, const char *msg, uint64_t seq) {
  enum { MAX_UNREPORTED = 256 };
  if (!o->unreported) o->unreported = calloc(MAX_UNREPORTED, sizeof *o->unreported);
  if (!o->unreported_seq) o->unreported_seq = calloc(MAX_UNREPORTED, sizeof *o->unreported_seq);
  if (!o->unreported || !o->unreported_seq) return;
  size_t at = o->nunreported;
  /* One failure told for each result of one command (max's values and
   * indices): one note. */
  if (at > 0 && o->unreported_seq[at - 1] == seq && seq && o->unreported[at - 1].kind == kind &&
      strcmp(o->unreported[at - 1].msg, msg) == 0)
    return;
  if (at == MAX_UNREPORTED) {
    /* Full: an agent's loss still gets in, over the newest other failure (a
     * Sync waiting on that agent takes its note; it was silently dropped and
     * the Sync said AGENT_LOST without naming the loss). Others are dropped. */
    if (kind != ERR_AGENT_LOST) return;
    size_t run = at; /* the losses already at the end stay, in order, after it */
    while (run > 0 && o->unreported[run - 1].kind == ERR_AGENT_LOST) run--;
    if (run == 0) return; /* every one a loss already */
    memmove(&o->unreported[run - 1], &o->unreported[run], (at - run) * sizeof *o->unreported);
    memmove(&o->unreported_seq[run - 1], &o->unreported_seq[run],
            (at - run) * sizeof *o->unreported_seq);
    at--;
  } else {
    o->nunreported++;
  }
  error_set(&o->unreported[at], kind, "%s", msg);
  o->unreported_seq[at] = seq;
}

bool objects_touch(objects_t *o, uint32_t rank) {
  if (rank >= o->ntouched) {
    size_t n = o->ntouched ? o->ntouched : 8;
    while (n <= rank) n *= 2;
    uint8_t *t = realloc(o->touched, n);
    if (!t) return false;
    o->touched = t;
    uint64_t *ls = realloc(o->last_seq, n * sizeof *ls);
    if (!ls) return false;
    o->last_seq = ls;
    uint64_t *os = realloc(o->opened_seq, n * sizeof *os);
    if (!os) return false;
    o->opened_seq = os;
    memset(t + o->ntouched, 0, n - o->ntouched);
    memset(ls + o->ntouched, 0, (n - o->ntouched) * sizeof *ls);
    memset(os + o->ntouched, 0, (n - o->ntouched) * sizeof *os);
    o->ntouched = n;
  }
  o->touched[rank] = 1;
  return true;
}

void objects_sent(objects_t *o, uint32_t rank, uint64_t seq, uint64_t bytes) {
  o->sent_bytes += bytes;
  if (objects_touch(o, rank) && seq > o->last_seq[rank]) o->last_seq[rank] = seq;
}

bool objects_holds_on(objects_t *o, uint32_t rank) {
  obj_t *it;
  for (size_t i = 0; (it = refmap_next(&o->table, &i));) {
    if (it->kind != OBJ_TENSOR || it->state == TENSOR_DROPPED) continue;
    obj_t *m = objects_get(o, it->tensor.mesh);
    if (m && m->kind == OBJ_MESH && mesh_contains(m->mesh, rank)) return true;
  }
  return false;
}

uint64_t objects_last_seq(const objects_t *o, uint32_t rank) {
  return rank < o->ntouched ? o->last_seq[rank] : 0;
}

const char *obj_kind_name(obj_kind_t k) {
  switch (k) {
    case OBJ_MESH: return "mesh";
    case OBJ_STREAM: return "stream";
    case OBJ_TENSOR: return "tensor";
    case OBJ_BORROW: return "borrow";
  }
  return "object";
}

obj_t *objects_get(objects_t *o, uint64_t ref) { return refmap_get(&o->table, ref); }

/* A zeroed record with `extra` bytes after it (a tensor's packed meta). */
static obj_t *add_record(objects_t *o, uint64_t ref, obj_kind_t kind, size_t extra) {
  obj_t *it = calloc(1, sizeof *it + extra);
  if (!it) return NULL;
  it->ref = ref;
  it->kind = (uint8_t)kind;
  if (refmap_put(&o->table, it)) {
    free(it);
    return NULL;
  }
  if (kind == OBJ_MESH) o->meshes++;
  else if (kind == OBJ_STREAM) o->streams++;
  else if (kind == OBJ_BORROW) o->live_borrows++;
  return it;
}

obj_t *objects_add(objects_t *o, uint64_t ref, obj_kind_t kind) {
  return add_record(o, ref, kind, 0);
}

/* Marks the session's streams named like the new stream s, and s itself if
 * there was one. Streams are never dropped, so a shared name stays shared.
 * O(records), once per CreateStream (--session-max-streams of them). */
static void mark_shared_name(objects_t *o, obj_t *s) {
  const char *name = s->stream.name;
  bool shared = false;
  if (strcmp(name, "main") == 0) shared = o->main_name_shared = true;
  obj_t *it;
  for (size_t i = 0; (it = refmap_next(&o->table, &i));) {
    if (it != s && it->kind == OBJ_STREAM && strcmp(it->stream.name, name) == 0)
      shared = it->stream.name_shared = true;
  }
  s->stream.name_shared = shared;
}

obj_t *objects_add_stream(objects_t *o, uint64_t ref, const char *name) {
  char *copy = strndup(name, OBJ_STREAM_NAME_MAX);
  obj_t *it = copy ? add_record(o, ref, OBJ_STREAM, 0) : NULL;
  if (!it) {
    free(copy);
    return NULL;
  }
  it->stream.name = copy;
  mark_shared_name(o, it);
  return it;
}

uint64_t objects_live_refs(const objects_t *o) {
  return o->live_tensors + o->meshes + o->streams + o->live_borrows;
}

obj_t *objects_add_mesh(objects_t *o, uint64_t ref, const mesh_t *mesh) {
  mesh_t *copy = malloc(sizeof *copy);
  obj_t *it = copy ? objects_add(o, ref, OBJ_MESH) : NULL;
  if (!it) {
    free(copy);
    return NULL;
  }
  *copy = *mesh;
  it->mesh = copy;
  return it;
}

static size_t grave_slot(const tombstone_t *g, size_t cap, uint64_t ref) {
  size_t i = (size_t)(ref * 0x9e3779b97f4a7c15ull) & (cap - 1);
  while (g[i].ref && g[i].ref != ref) i = (i + 1) & (cap - 1);
  return i;
}

static const tombstone_t *grave(const objects_t *o, uint64_t ref) {
  if (!o->gcap || ref == 0) return NULL;
  const tombstone_t *t = &o->graves[grave_slot(o->graves, o->gcap, ref)];
  return t->ref == ref ? t : NULL;
}

const tombstone_t *objects_dropped(const objects_t *o, uint64_t ref) {
  const tombstone_t *t = grave(o, ref);
  return t && t->borrow != ref ? t : NULL;
}

bool objects_dropped_failure_first(objects_t *o, uint64_t ref) {
  tombstone_t *t = (tombstone_t *)objects_dropped(o, ref);
  if (!t || t->failure_noted) return false;
  t->failure_noted = true;
  return true;
}

/* The ref halfway between the smallest and the largest of the tombstones (of
 * those holding a failure record only, with fails_only): refs only grow within
 * a session, so the ones at or below it are the older half. */
static uint64_t graves_mid_ref(const objects_t *o, bool fails_only) {
  uint64_t lo = UINT64_MAX, hi = 0;
  for (size_t i = 0; i < o->gcap; i++)
    if (fails_only ? o->graves[i].fail != NULL : o->graves[i].ref != 0) {
      if (o->graves[i].ref < lo) lo = o->graves[i].ref;
      if (o->graves[i].ref > hi) hi = o->graves[i].ref;
    }
  return lo + (hi - lo) / 2;
}

/* At OBJECTS_GRAVE_FAILS_MAX: lets the failure records of the older half (by
 * ref) of the tombstones holding one go. */
static void forget_older_fails(objects_t *o) {
  uint64_t cut = graves_mid_ref(o, true);
  for (size_t i = 0; i < o->gcap; i++)
    if (o->graves[i].fail && o->graves[i].ref <= cut) {
      free(o->graves[i].fail);
      o->graves[i].fail = NULL;
      o->ngrave_fails--;
    }
}

/* A tombstone's failure record: f (taken; NULL: a new one), its message cut
 * to OBJECTS_GRAVE_FAIL_MSG. NULL on OOM (f is then freed). */
static tensor_failure_t *grave_fail(objects_t *o, tensor_failure_t *f, const char *msg) {
  if (o->ngrave_fails >= OBJECTS_GRAVE_FAILS_MAX) forget_older_fails(o);
  size_t len = strlen(f ? f->msg : msg);
  if (len > OBJECTS_GRAVE_FAIL_MSG) len = OBJECTS_GRAVE_FAIL_MSG;
  tensor_failure_t *g = realloc(f, sizeof *g + len + 1);
  if (!g) {
    free(f);
    return NULL;
  }
  if (!f) {
    memset(g, 0, sizeof *g);
    memcpy(g->msg, msg, len);
  }
  g->msg[len] = '\0';
  o->ngrave_fails++;
  return g;
}

static void grave_failure_origin(objects_t *o, tombstone_t *t, error_kind_t kind, uint32_t rank,
                                 uint64_t seq, uint64_t command, const char *msg) {
  if (t->fail) {
    objects_failure_origin(t->fail, rank, seq, command);
    return;
  }
  tensor_failure_t *f = grave_fail(o, NULL, msg ? msg : "");
  if (!f) return;
  f->kind = kind;
  f->root_seq = command ? command : seq;
  f->rank = rank;
  f->rank_seq = seq;
  f->rank_command = command;
  t->fail = f;
}

void objects_dropped_failure_origin(objects_t *o, uint64_t ref, error_kind_t kind, uint32_t rank,
                                    uint64_t seq, uint64_t command, const char *msg) {
  tombstone_t *t = (tombstone_t *)objects_dropped(o, ref);
  if (!t) return;
  grave_failure_origin(o, t, kind, rank, seq, command, msg);
  /* The other views of its storage hold the same bytes (a report names only
   * the ref its instruction used): their tombstones fail too, as every alias
   * of a live tensor does (objects_fail_tensor). */
  for (size_t i = 0; t->storage && i < o->gcap; i++)
    if (o->graves[i].storage == t->storage && o->graves[i].ref != ref &&
        o->graves[i].borrow != o->graves[i].ref)
      grave_failure_origin(o, &o->graves[i], kind, rank, seq, command, msg);
}

obj_t *objects_dropped_live_alias(objects_t *o, uint64_t ref) {
  const tombstone_t *t = objects_dropped(o, ref);
  if (!t || !t->storage) return NULL;
  obj_t *it;
  for (size_t i = 0; (it = refmap_next(&o->table, &i));)
    if (it->kind == OBJ_TENSOR && it->tensor.storage->id == t->storage &&
        it->tensor.storage->shared)
      return it;
  return NULL;
}

const tombstone_t *objects_dropped_borrow(const objects_t *o, uint64_t ref) {
  const tombstone_t *t = grave(o, ref);
  return t && t->borrow == ref ? t : NULL;
}

bool objects_forgotten(const objects_t *o, uint64_t ref) {
  return ref && ref <= o->graves_forgotten && !objects_get((objects_t *)o, ref);
}

/* At OBJECTS_GRAVES_MAX: lets the older half go (refs only grow within a
 * session, so the smaller refs are the older drops), in place. */
static void forget_older_half(objects_t *o) {
  uint64_t cut = graves_mid_ref(o, false);
  tombstone_t *g = calloc(o->gcap, sizeof *g);
  if (!g) return;
  size_t n = 0;
  for (size_t i = 0; i < o->gcap; i++)
    if (o->graves[i].ref > cut) {
      g[grave_slot(g, o->gcap, o->graves[i].ref)] = o->graves[i];
      n++;
    } else if (o->graves[i].fail) {
      free(o->graves[i].fail);
      o->ngrave_fails--;
    }
  free(o->graves);
  o->graves = g;
  o->ngraves = n;
  if (cut > o->graves_forgotten) o->graves_forgotten = cut;
}

/* failed: the tensor failed already, so its failure is told (failure_noted);
 * fail: its failure record, taken (kept for fetches planned before the drop). */
static void bury(objects_t *o, uint64_t ref, uint64_t seq, uint64_t borrow, bool failed,
                 tensor_failure_t *fail, uint64_t storage) {
  if (o->ngraves >= OBJECTS_GRAVES_MAX) forget_older_half(o);
  if (fail) fail = grave_fail(o, fail, NULL);
  if ((o->ngraves + 1) * 2 > o->gcap) { /* keep the load under 1/2 */
    size_t cap = o->gcap ? o->gcap * 2 : 1024;
    tombstone_t *g = calloc(cap, sizeof *g);
    if (!g) { /* a lost tombstone only degrades DROPPED to UNKNOWN_REF */
      if (fail) o->ngrave_fails--;
      free(fail);
      return;
    }
    for (size_t i = 0; i < o->gcap; i++)
      if (o->graves[i].ref) g[grave_slot(g, cap, o->graves[i].ref)] = o->graves[i];
    free(o->graves);
    o->graves = g;
    o->gcap = cap;
  }
  size_t i = grave_slot(o->graves, o->gcap, ref);
  if (!o->graves[i].ref) o->ngraves++;
  if (o->graves[i].fail) o->ngrave_fails--;
  free(o->graves[i].fail);
  o->graves[i] = (tombstone_t){ref, seq, borrow, fail, failed, storage};
}

void objects_bury_borrow(objects_t *o, obj_t *b, uint64_t seq) {
  bury(o, b->ref, seq, b->ref, false, NULL, 0);
  refmap_remove(&o->table, b->ref);
  storage_unref(b->borrow.origin_storage);
  storage_unref(b->borrow.result_storage);
  free(b);
}

obj_t *objects_expect(objects_t *o, uint64_t ref, obj_kind_t kind, const char *what,
                      meshd_error_t *e) {
  if (kind == OBJ_STREAM && ref == STREAM_MAIN) return NULL; /* caller handles main */
  obj_t *it = objects_get(o, ref);
  const tombstone_t *gb = it ? NULL : objects_dropped_borrow(o, ref);
  if (gb && kind == OBJ_BORROW) {
    error_set(e, ERR_DROPPED, "%s %llu was already dropped by command %llu", what,
              (unsigned long long)ref, (unsigned long long)gb->seq);
    return NULL;
  }
  if (gb) {
    error_set(e, ERR_UNKNOWN_REF, "%s is ref %llu, which is a borrow (dropped by command %llu), "
              "not a %s", what, (unsigned long long)ref, (unsigned long long)gb->seq,
              obj_kind_name(kind));
    return NULL;
  }
  if (!it) {
    if (objects_forgotten(o, ref))
      error_set(e, ERR_UNKNOWN_REF, "%s is ref %llu, which is not live: it was dropped before "
                "the session's last %d drops (their sites are not kept) or never defined", what,
                (unsigned long long)ref, OBJECTS_GRAVES_MAX);
    else
      error_set(e, ERR_UNKNOWN_REF, "%s is ref %llu, which this session never defined", what,
                (unsigned long long)ref);
    return NULL;
  }
  if (it->kind != kind) {
    error_set(e, ERR_UNKNOWN_REF, "%s is ref %llu, which is a %s, not a %s", what,
              (unsigned long long)ref, obj_kind_name(it->kind), obj_kind_name(kind));
    return NULL;
  }
  return it;
}

static const stream_obj_t *stream_record(objects_t *o, uint64_t ref) {
  obj_t *s = objects_get(o, ref);
  return s && s->kind == OBJ_STREAM ? &s->stream : NULL;
}

const char *objects_stream_name(objects_t *o, uint64_t ref) {
  if (ref == STREAM_MAIN) return "main";
  const stream_obj_t *s = stream_record(o, ref);
  return s ? s->name : "?";
}

const char *objects_stream_label(objects_t *o, uint64_t ref, char *buf, size_t size) {
  const stream_obj_t *s = ref == STREAM_MAIN ? NULL : stream_record(o, ref);
  bool shared = ref == STREAM_MAIN ? o->main_name_shared : s && s->name_shared;
  if (shared)
    snprintf(buf, size, "'%s' (ref %llu)", objects_stream_name(o, ref), (unsigned long long)ref);
  else
    snprintf(buf, size, "'%s'", objects_stream_name(o, ref));
  return buf;
}

static obj_t *new_tensor_record(objects_t *o, uint64_t ref, const tensor_meta_t *meta,
                                uint64_t mesh, uint64_t stream, storage_t *s) {
  obj_t *t = add_record(o, ref, OBJ_TENSOR, meta_packed_size(meta));
  if (!t) return NULL;
  meta_pack(t->meta, meta);
  t->tensor.storage = s;
  t->tensor.mesh = mesh;
  t->tensor.stream = stream;
  t->state = TENSOR_LIVE;
  t->tensor.born_seq = o->current_seq;
  if (s->aliases) s->shared = true;
  t->tensor.next_alias = s->aliases;
  s->aliases = t;
  s->refs++;
  s->live_aliases++;
  o->live_tensors++;
  return t;
}

obj_t *objects_new_tensor(objects_t *o, uint64_t ref, const tensor_meta_t *meta, uint64_t mesh,
                          uint64_t stream, uint64_t ranks) {
  storage_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->id = ref;
  s->access = ACCESS_R | ACCESS_W;
  s->bytes = meta_nbytes(meta); /* a fresh storage is contiguous */
  s->ranks = ranks;
  obj_t *t = new_tensor_record(o, ref, meta, mesh, stream, s);
  if (!t) {
    free(s);
    return NULL;
  }
  o->bytes += s->bytes * s->ranks;
  return t;
}

obj_t *objects_new_view(objects_t *o, uint64_t ref, const tensor_meta_t *meta, obj_t *base) {
  return new_tensor_record(o, ref, meta, base->tensor.mesh, base->tensor.stream,
                           base->tensor.storage);
}

obj_t *objects_new_borrowed(objects_t *o, uint64_t ref, const tensor_meta_t *meta, obj_t *origin,
                            uint64_t stream, uint64_t borrow) {
  storage_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->id = ref;
  s->borrow = borrow;
  /* The borrowed side holds no bytes of its own: it is the origin's memory. */
  obj_t *t = new_tensor_record(o, ref, meta, origin->tensor.mesh, stream, s);
  if (!t) free(s);
  return t;
}

void objects_drop_storage(objects_t *o, storage_t *storage, uint64_t seq) {
  for (obj_t *it = storage->aliases, *next; it; it = next) {
    next = it->tensor.next_alias;
    bury(o, it->ref, seq, storage->borrow, it->state == TENSOR_FAILED,
         it->state == TENSOR_FAILED ? it->tensor.fail : NULL, storage->shared ? storage->id : 0);
    if (it->state != TENSOR_FAILED) free(it->tensor.fail);
    refmap_remove(&o->table, it->ref);
    free(it);
    o->live_tensors--;
    storage->refs--;
  }
  storage->aliases = NULL;
  if (storage->live_aliases > 0) o->bytes -= storage->bytes * storage->ranks;
  storage->live_aliases = 0;
  if (storage->refs == 0) free(storage);
}

void objects_release(objects_t *o, obj_t *t, uint64_t seq) {
  storage_t *storage = t->tensor.storage;
  for (obj_t **pp = &storage->aliases; *pp; pp = &(*pp)->tensor.next_alias)
    if (*pp == t) {
      *pp = t->tensor.next_alias;
      break;
    }
  bury(o, t->ref, seq, storage->borrow, t->state == TENSOR_FAILED,
       t->state == TENSOR_FAILED ? t->tensor.fail : NULL, storage->shared ? storage->id : 0);
  if (t->state != TENSOR_FAILED) free(t->tensor.fail);
  refmap_remove(&o->table, t->ref);
  free(t);
  o->live_tensors--;
  if (--storage->live_aliases == 0) o->bytes -= storage->bytes * storage->ranks;
  storage_unref(storage);
}

void objects_fail_tensor(objects_t *o, obj_t *t, uint64_t seq, error_kind_t kind,
                         uint64_t root_seq, const char *msg) {
  if (!msg) msg = "";
  size_t len = strlen(msg);
  /* Every view of the storage, and through a mutable borrow the origin's
   * (the agents' handle is the origin's memory: Monarch fails the origin when
   * the borrow ends), borrows of borrows too. */
  for (storage_t *st = t->tensor.storage; st;) {
    for (obj_t *it = st->aliases; it; it = it->tensor.next_alias) {
      if (it->state != TENSOR_LIVE) continue;
      it->state = TENSOR_FAILED;
      it->tensor.state_seq = seq;
      free(it->tensor.fail);
      it->tensor.fail = malloc(sizeof *it->tensor.fail + len + 1);
      if (!it->tensor.fail) continue; /* obj_fail_* say so */
      it->tensor.fail->kind = kind;
      it->tensor.fail->root_seq = root_seq;
      it->tensor.fail->rank = o->report_rank;
      it->tensor.fail->rank_seq = o->report_seq;
      it->tensor.fail->rank_command = o->report_command;
      it->tensor.fail->ranks = false;
      memcpy(it->tensor.fail->msg, msg, len + 1);
    }
    const obj_t *b = st->borrow ? objects_get(o, st->borrow) : NULL;
    st = b && b->kind == OBJ_BORROW && b->borrow.is_mutable && b->borrow.result_storage == st
             ? b->borrow.origin_storage
             : NULL;
  }
}
