#include "session_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uthash.h>

#include "runtime.h"

/* One stream of the session: how far its worker has queued work. */
struct stream_progress {
  uint64_t id;
  uint64_t queued_seq;  /* last seq whose work is queued on the device */
  backend_stream_t *bs; /* the worker's backend stream (NULL: cpu, or not made yet) */
  UT_hash_handle hh;
};

/* A ref defined on one stream and first read on another (borrow handles,
 * to_mesh results on another stream): readers wait for (stream, seq). */
struct pending_def {
  uint64_t ref, stream, seq;
  UT_hash_handle hh;
};

struct borrow_record {
  uint64_t id, from_stream, to_stream;
  uint64_t last_use_seq, last_use_stream; /* the LAST_USE instruction, as it ran */
  UT_hash_handle hh;
};

/* What a Snapshot instruction left for its Read. */
struct kept_snapshot {
  uint64_t seq, ref;
  snapshot_t *snap; /* NULL: rc and why say what the ref was */
  int rc;
  ref_failure_t *why;
  kept_snapshot_t *next;
};

static void kept_free(kept_snapshot_t *k) {
  snapshot_release(k->snap);
  free(k->why);
  free(k);
}

/* A Snapshot routed and not run yet (session_state_t.coming). */
struct coming_snapshot {
  uint64_t seq;
  bool dropped; /* its DropSnapshot came first: it keeps nothing */
  UT_hash_handle hh;
};

static void coming_clear_locked(session_state_t *s) {
  coming_snapshot_t *c, *tmp;
  HASH_ITER(hh, s->coming, c, tmp) {
    HASH_DEL(s->coming, c);
    free(c);
  }
}

session_state_t *session_state_new(const char *id, backend_t *backend) {
  session_state_t *s = calloc(1, sizeof *s);
  if (!s || !(s->id = strdup(id))) {
    free(s);
    return NULL;
  }
  s->backend = backend;
  s->key = 1469598103934665603ull; /* FNV-1a */
  for (const char *p = id; *p; p++) s->key = (s->key ^ (uint8_t)*p) * 1099511628211ull;
  refs_init(&s->refs);
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->progress, NULL);
  return s;
}

void session_state_free(session_state_t *s) {
  if (!s) return;
  backend_t *b = s->backend;
  while (s->snapshots) {
    kept_snapshot_t *k = s->snapshots;
    s->snapshots = k->next;
    kept_free(k);
  }
  coming_clear_locked(s);
  refs_clear(&s->refs);
  pthread_mutex_destroy(&s->refs.mu);
  stream_progress_t *p, *p2;
  HASH_ITER(hh, s->streams, p, p2) {
    HASH_DEL(s->streams, p);
    if (p->bs) b->ops->stream_destroy(b, p->bs);
    free(p);
  }
  if (b && b->ops->session_end) b->ops->session_end(b, s->key);
  pending_def_t *d, *d2;
  HASH_ITER(hh, s->defs, d, d2) {
    HASH_DEL(s->defs, d);
    free(d);
  }
  borrow_record_t *r, *r2;
  HASH_ITER(hh, s->borrows, r, r2) {
    HASH_DEL(s->borrows, r);
    free(r);
  }
  dataplane_t *net = b ? b->net : NULL;
  for (size_t i = 0; net && i < s->ncomms; i++) {
    dataplane_drop_comm(net, s->comms[i]);
    dataplane_forget_comm(net, s->comms[i]); /* no call of it can start any more */
  }
  free(s->comms);
  pthread_cond_destroy(&s->progress);
  pthread_mutex_destroy(&s->mu);
  free(s->id);
  free(s);
}

/* ------------------------------------------------------------------ streams */

stream_progress_t *session_state_add_stream(session_state_t *s, uint64_t stream) {
  pthread_mutex_lock(&s->mu);
  stream_progress_t *p = NULL;
  HASH_FIND(hh, s->streams, &stream, sizeof stream, p);
  if (!p && (p = calloc(1, sizeof *p))) {
    p->id = stream;
    HASH_ADD(hh, s->streams, id, sizeof p->id, p);
  }
  pthread_mutex_unlock(&s->mu);
  return p;
}

void session_state_remove_stream(session_state_t *s, stream_progress_t *p) {
  pthread_mutex_lock(&s->mu);
  HASH_DEL(s->streams, p);
  pthread_mutex_unlock(&s->mu);
  free(p);
}

void session_state_stream_ready(session_state_t *s, stream_progress_t *p, backend_stream_t *bs) {
  pthread_mutex_lock(&s->mu);
  p->bs = bs;
  pthread_mutex_unlock(&s->mu);
}

void session_state_queued(session_state_t *s, stream_progress_t *p, uint64_t seq) {
  pthread_mutex_lock(&s->mu);
  p->queued_seq = seq;
  pthread_cond_broadcast(&s->progress);
  pthread_mutex_unlock(&s->mu);
}

void session_state_close(session_state_t *s) {
  pthread_mutex_lock(&s->mu);
  s->closing = true;
  pthread_cond_broadcast(&s->progress);
  /* Dropped now (the calls on them end), and kept: a call that joined its
   * comm before now may file its connections after this drop, and
   * session_state_free drops the list again (they leaked, in CLOSE_WAIT,
   * for the agent's life). Under mu: the lock order is s->mu, then dp's. */
  dataplane_t *net = s->backend ? s->backend->net : NULL;
  /* Ended, not only dropped: a worker still running an instruction of the
   * session may join its call after this, and must fail at once too. */
  for (size_t i = 0; net && i < s->ncomms; i++) dataplane_end_comm(net, s->comms[i]);
  pthread_mutex_unlock(&s->mu);
}

void session_state_drop_data(session_state_t *s) {
  pthread_mutex_lock(&s->mu);
  kept_snapshot_t *k = s->snapshots;
  s->snapshots = s->snapshots_tail = NULL;
  s->nsnapshots = 0;
  pthread_mutex_unlock(&s->mu);
  while (k) {
    kept_snapshot_t *next = k->next;
    kept_free(k);
    k = next;
  }
  refs_clear(&s->refs);
}

bool session_state_closing(session_state_t *s) {
  pthread_mutex_lock(&s->mu);
  bool closing = s->closing;
  pthread_mutex_unlock(&s->mu);
  return closing;
}

void session_state_note_comm(session_state_t *s, uint64_t comm_id) {
  pthread_mutex_lock(&s->mu);
  bool known = false;
  for (size_t i = 0; i < s->ncomms && !known; i++) known = s->comms[i] == comm_id;
  if (!known && s->ncomms == s->capcomms) {
    size_t cap = s->capcomms ? 2 * s->capcomms : 8;
    uint64_t *c = realloc(s->comms, cap * sizeof *c);
    if (c) {
      s->comms = c;
      s->capcomms = cap;
    }
  }
  bool added = !known && s->ncomms < s->capcomms;
  if (added) s->comms[s->ncomms++] = comm_id;
  /* A comm first used after the session closed (a worker that was running
   * then): ended as session_state_close ends the others (and forgotten with
   * them, at session_state_free). */
  dataplane_t *net = s->backend ? s->backend->net : NULL;
  if (added && s->closing && net) dataplane_end_comm(net, comm_id);
  pthread_mutex_unlock(&s->mu);
}

/* ------------------------------------------------------------------ ordering */

static void add_def_locked(session_state_t *s, uint64_t ref, uint64_t stream, uint64_t seq) {
  pending_def_t *d = NULL;
  HASH_FIND(hh, s->defs, &ref, sizeof ref, d);
  if (!d) {
    if (!(d = calloc(1, sizeof *d))) return;
    d->ref = ref;
    HASH_ADD(hh, s->defs, ref, sizeof d->ref, d);
  }
  d->stream = stream;
  d->seq = seq;
}

void session_state_note_order(session_state_t *s, const Meshd__Agent__V1__Instruction *ins) {
  pthread_mutex_lock(&s->mu);
  if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW) {
    const Meshd__Agent__V1__BorrowOp *b = ins->borrow;
    borrow_record_t *r = NULL;
    HASH_FIND(hh, s->borrows, &b->borrow, sizeof b->borrow, r);
    if (b->phase == MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE) {
      if (!r && (r = calloc(1, sizeof *r))) {
        r->id = b->borrow;
        HASH_ADD(hh, s->borrows, id, sizeof r->id, r);
      }
      if (r) {
        r->from_stream = b->from_stream;
        r->to_stream = b->to_stream;
      }
      add_def_locked(s, b->result, ins->stream, ins->seq);
    } else if (b->phase == MESHD__AGENT__V1__BORROW_OP__PHASE__LAST_USE && r) {
      r->last_use_seq = ins->seq;
      r->last_use_stream = ins->stream;
    }
  } else if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_SEND) {
    const Meshd__Agent__V1__SendTensor *t = ins->send;
    if (t->input && t->result && t->to_stream != ins->stream)
      add_def_locked(s, t->result->ref, ins->stream, ins->seq);
  } else if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT) {
    /* Out of memory: not listed, and a drop before it runs finds nothing
     * (it is kept until read or evicted, as before drops came at once). */
    coming_snapshot_t *c = NULL;
    HASH_FIND(hh, s->coming, &ins->seq, sizeof ins->seq, c);
    if (!c && (c = calloc(1, sizeof *c))) {
      c->seq = ins->seq;
      HASH_ADD(hh, s->coming, seq, sizeof c->seq, c);
    }
  }
  pthread_mutex_unlock(&s->mu);
}

void session_state_wait_stream(session_state_t *s, uint64_t stream, uint64_t seq, uint64_t waiter,
                               uint64_t waiter_seq, backend_stream_t *wbs) {
  if (stream == waiter || seq >= waiter_seq) return;
  pthread_mutex_lock(&s->mu);
  stream_progress_t *p = NULL;
  HASH_FIND(hh, s->streams, &stream, sizeof stream, p);
  while (p && p->queued_seq < seq && !s->closing) pthread_cond_wait(&s->progress, &s->mu);
  /* The stream lives as long as the session (session_state_free destroys it). */
  backend_stream_t *sbs = p ? p->bs : NULL;
  pthread_mutex_unlock(&s->mu);
  backend_t *b = s->backend;
  /* No waiter stream (a DeleteRefs on a refuser thread, executor.c): nothing
   * to order on the device; a free once the work is queued is the backend's
   * to order (backend.h). */
  if (sbs && wbs && b && b->ops->event_record) {
    backend_event_t *ev = b->ops->event_record(b, sbs);
    int rc = ev ? b->ops->event_wait(b, wbs, ev) : -1;
    if (ev) b->ops->event_destroy(b, ev);
    if (rc != 0) { /* no event to be had, or not waited on: wait on the host instead */
      meshd_error_t e;
      b->ops->stream_sync(b, sbs, &e);
    }
  }
}

/* The instruction (stream, seq) orders after ref's definition when that is on
 * another stream (and may still be to come there). */
static void wait_definition(session_state_t *s, uint64_t stream, uint64_t seq,
                            backend_stream_t *bs, uint64_t ref) {
  pthread_mutex_lock(&s->mu);
  pending_def_t *d = NULL;
  HASH_FIND(hh, s->defs, &ref, sizeof ref, d);
  uint64_t dstream = d ? d->stream : stream, dseq = d ? d->seq : 0;
  pthread_mutex_unlock(&s->mu);
  if (dstream != stream) session_state_wait_stream(s, dstream, dseq, stream, seq, bs);
}

bool session_state_def_queued(session_state_t *s, uint64_t stream, uint64_t seq, uint64_t ref) {
  pthread_mutex_lock(&s->mu);
  pending_def_t *d = NULL;
  HASH_FIND(hh, s->defs, &ref, sizeof ref, d);
  stream_progress_t *p = NULL;
  /* As session_state_wait_stream: no wait for a definition after seq, on an
   * unknown stream, or once the session closes. */
  if (d && d->stream != stream && d->seq < seq && !s->closing)
    HASH_FIND(hh, s->streams, &d->stream, sizeof d->stream, p);
  bool queued = !p || p->queued_seq >= d->seq;
  pthread_mutex_unlock(&s->mu);
  return queued;
}

int session_state_get(session_state_t *s, uint64_t stream, uint64_t seq, backend_stream_t *bs,
                      uint64_t ref, agent_tensor_t *out, ref_failure_t *why) {
  wait_definition(s, stream, seq, bs, ref);
  return refs_get(&s->refs, ref, out, why);
}

void session_state_delete(session_state_t *s, uint64_t stream, uint64_t seq, backend_stream_t *bs,
                          uint64_t ref) {
  wait_definition(s, stream, seq, bs, ref);
  refs_delete(&s->refs, ref);
  session_state_forget_def(s, ref);
}

void session_state_forget_def(session_state_t *s, uint64_t ref) {
  pthread_mutex_lock(&s->mu);
  pending_def_t *d = NULL;
  HASH_FIND(hh, s->defs, &ref, sizeof ref, d);
  if (d) {
    HASH_DEL(s->defs, d);
    free(d);
  }
  pthread_mutex_unlock(&s->mu);
}

void session_state_end_borrow(session_state_t *s, uint64_t borrow, uint64_t stream, uint64_t seq,
                              backend_stream_t *bs) {
  pthread_mutex_lock(&s->mu);
  borrow_record_t *r = NULL;
  HASH_FIND(hh, s->borrows, &borrow, sizeof borrow, r);
  if (r) HASH_DEL(s->borrows, r);
  pthread_mutex_unlock(&s->mu);
  /* The origin waits for the borrower's last use (on the device too). */
  if (r && r->last_use_seq)
    session_state_wait_stream(s, r->last_use_stream, r->last_use_seq, stream, seq, bs);
  free(r);
}

/* ------------------------------------------------------------------ lost peers */

void session_state_peer_lost(session_state_t *s, uint32_t rank, uint64_t seq, const char *why) {
  pthread_mutex_lock(&s->mu);
  lost_peer_t *l = NULL;
  for (size_t i = 0; i < s->nlost; i++)
    if (s->lost[i].rank == rank) l = &s->lost[i]; /* lost again: the later PeerLost counts */
  if (!l) {
    if (s->nlost == SESSION_LOST_MAX) { /* the oldest goes: its instructions ran long ago */
      memmove(s->lost, s->lost + 1, (SESSION_LOST_MAX - 1) * sizeof s->lost[0]);
      s->nlost--;
    }
    l = &s->lost[s->nlost++];
  }
  l->rank = rank;
  l->seq = seq;
  snprintf(l->why, sizeof l->why, "%s", why && *why ? why : "was lost");
  pthread_cond_broadcast(&s->progress);
  pthread_mutex_unlock(&s->mu);
}

int session_state_check_peers(session_state_t *s, const uint32_t *ranks, size_t n, uint64_t seq,
                              const char *what, meshd_error_t *err) {
  pthread_mutex_lock(&s->mu);
  int rc = 0;
  for (size_t i = 0; i < s->nlost && rc == 0; i++)
    for (size_t j = 0; j < n && seq < s->lost[i].seq; j++)
      if (ranks[j] == s->lost[i].rank) {
        rc = error_set(err, ERR_AGENT_LOST,
                       "%s: the agent of rank %u %s; not run (create a new mesh to use its "
                       "replacement)", what, ranks[j], s->lost[i].why);
        break;
      }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

bool session_state_wait_lost(session_state_t *s, int timeout_ms) {
  struct timespec dl;
  runtime_deadline(&dl, CLOCK_REALTIME, timeout_ms);
  pthread_mutex_lock(&s->mu);
  int rc = 0;
  while (s->nlost == 0 && !s->closing && rc == 0)
    rc = pthread_cond_timedwait(&s->progress, &s->mu, &dl);
  bool early = s->nlost > 0 || s->closing;
  pthread_mutex_unlock(&s->mu);
  return early;
}

/* ------------------------------------------------------------------ snapshots */

/* Snapshot seq runs: no longer coming. true when its DropSnapshot came
 * first (it keeps nothing). Holds mu. */
static bool coming_done_locked(session_state_t *s, uint64_t seq) {
  coming_snapshot_t *c = NULL;
  HASH_FIND(hh, s->coming, &seq, sizeof seq, c);
  if (!c) return false;
  bool dropped = c->dropped;
  HASH_DEL(s->coming, c);
  free(c);
  return dropped;
}

void session_state_keep_snapshot(session_state_t *s, uint64_t seq, uint64_t ref, snapshot_t *snap,
                                 int rc, const ref_failure_t *why) {
  kept_snapshot_t *k = calloc(1, sizeof *k);
  if (k && !snap && why && !(k->why = malloc(sizeof *k->why))) {
    free(k);
    k = NULL;
  }
  if (k) {
    k->seq = seq;
    k->ref = ref;
    k->snap = snap;
    k->rc = snap ? 0 : rc;
    if (k->why) *k->why = *why;
  }
  kept_snapshot_t *old = NULL;
  pthread_mutex_lock(&s->mu);
  /* Checked and kept under one lock: a drop in between would find neither. */
  bool dropped = coming_done_locked(s, seq);
  if (k && !dropped) {
    if (s->snapshots_tail) s->snapshots_tail->next = k;
    else s->snapshots = k;
    s->snapshots_tail = k;
    if (++s->nsnapshots > SESSION_SNAPSHOTS_MAX) {
      old = s->snapshots;
      s->snapshots = old->next;
      s->nsnapshots--;
    }
  }
  pthread_mutex_unlock(&s->mu);
  if (old) kept_free(old);
  if (k && dropped) kept_free(k); /* its pin or copy goes at once */
  else if (!k) snapshot_release(snap); /* its Read finds nothing kept and says so */
}

/* Takes what Snapshot `seq` kept (of *ref, when given) out of the list;
 * NULL when nothing matches. Holds mu. */
static kept_snapshot_t *kept_remove_locked(session_state_t *s, uint64_t seq, const uint64_t *ref) {
  kept_snapshot_t **p = &s->snapshots, *prev = NULL;
  while (*p && !((*p)->seq == seq && (!ref || (*p)->ref == *ref))) {
    prev = *p;
    p = &(*p)->next;
  }
  kept_snapshot_t *k = *p;
  if (k) {
    *p = k->next;
    if (s->snapshots_tail == k) s->snapshots_tail = prev;
    s->nsnapshots--;
  }
  return k;
}

int session_state_take_snapshot(session_state_t *s, uint64_t seq, uint64_t ref, snapshot_t **snap,
                                ref_failure_t *why) {
  pthread_mutex_lock(&s->mu);
  kept_snapshot_t *k = kept_remove_locked(s, seq, &ref);
  pthread_mutex_unlock(&s->mu);
  if (!k) {
    snprintf(why->msg, sizeof why->msg,
             "no snapshot of tensor %llu at seq %llu in session %.8s on this agent (a Read "
             "answers only the Snapshot its server sent; a session keeps the %d latest unread)",
             (unsigned long long)ref, (unsigned long long)seq, s->id, SESSION_SNAPSHOTS_MAX);
    return -1;
  }
  int rc = k->rc;
  *snap = k->snap;
  k->snap = NULL;
  if (k->why) *why = *k->why;
  else if (rc < 0)
    snprintf(why->msg, sizeof why->msg, "ref %llu is not on this agent (session %.8s)",
             (unsigned long long)ref, s->id);
  kept_free(k);
  return rc;
}

void session_state_drop_snapshot(session_state_t *s, uint64_t seq) {
  pthread_mutex_lock(&s->mu);
  kept_snapshot_t *k = kept_remove_locked(s, seq, NULL);
  coming_snapshot_t *c = NULL;
  if (!k) HASH_FIND(hh, s->coming, &seq, sizeof seq, c);
  if (c) c->dropped = true; /* it runs later (queued, or running now) */
  pthread_mutex_unlock(&s->mu);
  if (k) kept_free(k);
}
