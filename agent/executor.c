#include "executor.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "exec_internal.h"
#include "log.h"

struct executor {
  executor_env_t env;
  pthread_mutex_t mu;
  pthread_cond_t progress; /* broadcast whenever a seq completes */
  pthread_cond_t report_cv;
  xsession_t *sessions;

  /* Watermark: done flags for seqs [front, last] in a ring of cap entries. */
  uint64_t front, last;
  bool *done;
  size_t cap;

  Meshd__V1__Error **errs;
  size_t nerrs, caperrs;
  bool dirty, report_stop, closing;
  uint64_t reported_alloc;
  executor_report_fn report;
  void *arg;
  pthread_t reporter;
  bool has_reporter;
  _Atomic int refs;
};

/* ------------------------------------------------------------------ watermark */

static uint64_t through_locked(const executor_t *x) { return x->front ? x->front - 1 : 0; }

/* Room for seq in the ring. Holds mu. */
static int ring_reserve_locked(executor_t *x, uint64_t seq) {
  if (x->front && seq - x->front < x->cap) return 0;
  if (!x->front) x->front = seq;
  size_t need = (size_t)(seq - x->front + 1), cap = x->cap ? x->cap : 1024;
  while (cap < need) cap *= 2;
  if (cap == x->cap) return 0;
  bool *d = calloc(cap, sizeof *d);
  if (!d) return -1;
  for (uint64_t s = x->front; x->done && s <= x->last; s++) d[s % cap] = x->done[s % x->cap];
  free(x->done);
  x->done = d;
  x->cap = cap;
  return 0;
}

static void mark_done_locked(executor_t *x, uint64_t seq) {
  if (seq < x->front || seq > x->last) return;
  x->done[seq % x->cap] = true;
  while (x->front <= x->last && x->done[x->front % x->cap]) {
    x->done[x->front % x->cap] = false;
    x->front++;
  }
  x->dirty = true;
  pthread_cond_signal(&x->report_cv);
  pthread_cond_broadcast(&x->progress);
}

uint64_t executor_executed(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  uint64_t t = through_locked(x);
  pthread_mutex_unlock(&x->mu);
  return t;
}

int executor_wait(executor_t *x, uint64_t seq, int timeout_ms) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += timeout_ms / 1000;
  dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&x->mu);
  int rc = 0;
  while (through_locked(x) < seq && !x->closing && rc == 0)
    rc = pthread_cond_timedwait(&x->progress, &x->mu, &dl);
  bool ok = through_locked(x) >= seq;
  pthread_mutex_unlock(&x->mu);
  return ok ? 0 : -1;
}

/* ------------------------------------------------------------------ reports */

void exec_report_error(executor_t *x, const char *session, error_kind_t kind, const char *msg,
                       uint64_t seq, uint64_t ref) {
  Meshd__V1__Error *e = calloc(1, sizeof *e);
  char *m = strdup(msg ? msg : "");
  char *sid = strdup(session ? session : "");
  if (!e || !m || !sid) {
    free(e);
    free(m);
    free(sid);
    return;
  }
  meshd__v1__error__init(e);
  e->kind = (Meshd__V1__ErrorKind)kind;
  e->message = m;
  e->code = (int32_t)error_kind_code(kind);
  e->seq = seq;
  e->ref = ref;
  e->session_id = sid;
  pthread_mutex_lock(&x->mu);
  if (x->nerrs == x->caperrs) {
    size_t cap = x->caperrs ? 2 * x->caperrs : 8;
    Meshd__V1__Error **n = realloc(x->errs, cap * sizeof *n);
    if (!n) {
      pthread_mutex_unlock(&x->mu);
      free(m);
      free(sid);
      free(e);
      return;
    }
    x->errs = n;
    x->caperrs = cap;
  }
  x->errs[x->nerrs++] = e;
  x->dirty = true;
  pthread_cond_signal(&x->report_cv);
  pthread_mutex_unlock(&x->mu);
}

static uint64_t allocated(const executor_t *x) {
  return x->env.backend ? atomic_load(&x->env.backend->allocated) : 0;
}

static void *reporter_main(void *arg) {
  executor_t *x = arg;
  pthread_mutex_lock(&x->mu);
  for (;;) {
    while (!x->dirty && !x->report_stop) pthread_cond_wait(&x->report_cv, &x->mu);
    if (x->report_stop) break;
    x->dirty = false;
    uint64_t through = through_locked(x);
    Meshd__V1__Error **errs = x->errs;
    size_t n = x->nerrs;
    x->errs = NULL;
    x->nerrs = x->caperrs = 0;
    uint64_t alloc = allocated(x);
    x->reported_alloc = alloc;
    pthread_mutex_unlock(&x->mu);
    x->report(through, errs, n, alloc, x->arg);
    for (size_t i = 0; i < n; i++) {
      free(errs[i]->session_id);
      free(errs[i]->message);
      free(errs[i]);
    }
    free(errs);
    pthread_mutex_lock(&x->mu);
  }
  pthread_mutex_unlock(&x->mu);
  return NULL;
}

void executor_kick(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  x->dirty = true;
  pthread_cond_signal(&x->report_cv);
  pthread_mutex_unlock(&x->mu);
}

/* ------------------------------------------------------------------ sessions */

static xsession_t *session_find_locked(executor_t *x, const char *id) {
  xsession_t *s = NULL;
  HASH_FIND_STR(x->sessions, id, s);
  return s;
}

static xsession_t *session_get_locked(executor_t *x, const char *id) {
  xsession_t *s = session_find_locked(x, id);
  if (s) return s;
  s = calloc(1, sizeof *s);
  if (!s || !(s->id = strdup(id))) {
    free(s);
    return NULL;
  }
  refs_init(&s->refs);
  s->key = 1469598103934665603ull; /* FNV-1a */
  for (const char *p = id; *p; p++) s->key = (s->key ^ (uint8_t)*p) * 1099511628211ull;
  HASH_ADD_KEYPTR(hh, x->sessions, s->id, strlen(s->id), s);
  return s;
}

/* Frees an ended session whose workers are gone. Without mu (frees memory). */
static void session_free(backend_t *b, xsession_t *s) {
  refs_clear(&s->refs);
  pthread_mutex_destroy(&s->refs.mu);
  xstream_t *st, *st2;
  HASH_ITER(hh, s->streams, st, st2) {
    HASH_DEL(s->streams, st);
    pthread_cond_destroy(&st->wake);
    if (st->bs) b->ops->stream_destroy(b, st->bs);
    free(st);
  }
  if (b && b->ops->session_end) b->ops->session_end(b, s->key);
  pending_def_t *d, *d2;
  HASH_ITER(hh, s->defs, d, d2) {
    HASH_DEL(s->defs, d);
    free(d);
  }
  xborrow_t *r, *r2;
  HASH_ITER(hh, s->borrows, r, r2) {
    HASH_DEL(s->borrows, r);
    free(r);
  }
  free(s->id);
  free(s);
}

size_t executor_sessions(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  size_t n = HASH_COUNT(x->sessions);
  pthread_mutex_unlock(&x->mu);
  return n;
}

/* ------------------------------------------------------------------ workers */

typedef struct worker_arg {
  executor_t *x;
  xstream_t *st;
} worker_arg_t;

/* Seqs a worker ran whose device work may still be in flight (backends with
 * stream_sync): marked done together once the stream is synchronised, when
 * the queue runs dry or this many are waiting. */
#define MAX_UNSYNCED 64

static void *worker_main(void *arg) {
  worker_arg_t *wa = arg;
  executor_t *x = wa->x;
  xstream_t *st = wa->st;
  xsession_t *s = st->sess;
  backend_t *b = x->env.backend;
  free(wa);
  backend_stream_t *bs = b && b->ops->stream_create ? b->ops->stream_create(b) : NULL;
  bool deferred = b && b->ops->stream_sync;
  uint64_t unsynced[MAX_UNSYNCED];
  int nunsynced = 0;
  pthread_mutex_lock(&x->mu);
  st->bs = bs;
  for (;;) {
    if (nunsynced && (!st->head || nunsynced == MAX_UNSYNCED)) {
      pthread_mutex_unlock(&x->mu);
      meshd_error_t e = {0};
      if (b->ops->stream_sync(b, bs, &e) != 0)
        log_error("executor", "session %.8s stream %" PRIu64 ": %s", s->id, st->id, e.msg);
      pthread_mutex_lock(&x->mu);
      for (int i = 0; i < nunsynced; i++) mark_done_locked(x, unsynced[i]);
      st->done_seq = unsynced[nunsynced - 1];
      nunsynced = 0;
      continue;
    }
    while (!st->head && !st->stop) pthread_cond_wait(&st->wake, &x->mu);
    item_t *it = st->head;
    if (!it) break;
    st->head = it->next;
    if (!st->head) st->tail = NULL;
    pthread_mutex_unlock(&x->mu);
    run_instruction(x, s, bs, it->ins);
    uint64_t seq = it->ins->seq;
    protobuf_c_message_free_unpacked(&it->ins->base, NULL);
    free(it);
    pthread_mutex_lock(&x->mu);
    st->queued_seq = seq;
    if (deferred) {
      unsynced[nunsynced++] = seq;
      pthread_cond_broadcast(&x->progress); /* cross-stream waiters need only queued_seq */
    } else {
      st->done_seq = seq;
      mark_done_locked(x, seq);
    }
  }
  bool last = --s->live_workers == 0;
  uint64_t end_seq = s->end_seq;
  pthread_mutex_unlock(&x->mu);
  if (last) {
    session_free(b, s);
    pthread_mutex_lock(&x->mu);
    mark_done_locked(x, end_seq);
    pthread_mutex_unlock(&x->mu);
  }
  executor_unref(x);
  return NULL;
}

static xstream_t *stream_get_locked(executor_t *x, xsession_t *s, uint64_t id) {
  xstream_t *st = NULL;
  HASH_FIND(hh, s->streams, &id, sizeof id, st);
  if (st) return st;
  st = calloc(1, sizeof *st);
  worker_arg_t *wa = malloc(sizeof *wa);
  if (!st || !wa) goto fail;
  st->id = id;
  st->sess = s;
  pthread_cond_init(&st->wake, NULL);
  *wa = (worker_arg_t){x, st};
  executor_ref(x);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  int rc = pthread_create(&t, &attr, worker_main, wa);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    atomic_fetch_sub(&x->refs, 1); /* cannot be the last: the caller holds one */
    pthread_cond_destroy(&st->wake);
    goto fail;
  }
  s->live_workers++;
  HASH_ADD(hh, s->streams, id, sizeof st->id, st);
  return st;
fail:
  free(st);
  free(wa);
  return NULL;
}

static void add_def_locked(xsession_t *s, uint64_t ref, uint64_t stream, uint64_t seq) {
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

/* What ordering an instruction needs besides its own queue, recorded when it
 * is routed (in seq order, before any later reader is routed). Holds mu. */
static void note_order_locked(xsession_t *s, const instr_t *ins) {
  if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW) {
    const Meshd__Agent__V1__BorrowOp *b = ins->borrow;
    xborrow_t *r = NULL;
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
    }
  } else if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_SEND) {
    const Meshd__Agent__V1__SendTensor *t = ins->send;
    if (t->input && t->result && t->to_stream != ins->stream)
      add_def_locked(s, t->result->ref, ins->stream, ins->seq);
  }
}

void exec_wait_stream(executor_t *x, xsession_t *s, uint64_t stream, uint64_t seq,
                      uint64_t waiter, backend_stream_t *wbs) {
  if (stream == waiter) return;
  pthread_mutex_lock(&x->mu);
  xstream_t *st = NULL;
  HASH_FIND(hh, s->streams, &stream, sizeof stream, st);
  while (st && st->queued_seq < seq && !x->closing) pthread_cond_wait(&x->progress, &x->mu);
  /* The stream lives as long as the session (session_free destroys it). */
  backend_stream_t *sbs = st ? st->bs : NULL;
  pthread_mutex_unlock(&x->mu);
  backend_t *b = x->env.backend;
  if (sbs && b && b->ops->event_record) {
    backend_event_t *ev = b->ops->event_record(b, sbs);
    if (ev) {
      b->ops->event_wait(b, wbs, ev);
      b->ops->event_destroy(b, ev);
    } else { /* no event to be had: wait on the host instead */
      meshd_error_t e;
      b->ops->stream_sync(b, sbs, &e);
    }
  }
}

int exec_get(executor_t *x, xsession_t *s, uint64_t stream, backend_stream_t *bs, uint64_t ref,
             agent_tensor_t *out, ref_failure_t *why) {
  pthread_mutex_lock(&x->mu);
  pending_def_t *d = NULL;
  HASH_FIND(hh, s->defs, &ref, sizeof ref, d);
  uint64_t dstream = d ? d->stream : stream, dseq = d ? d->seq : 0;
  pthread_mutex_unlock(&x->mu);
  if (dstream != stream) exec_wait_stream(x, s, dstream, dseq, stream, bs);
  return refs_get(&s->refs, ref, out, why);
}

void exec_forget_def(executor_t *x, xsession_t *s, uint64_t ref) {
  pthread_mutex_lock(&x->mu);
  pending_def_t *d = NULL;
  HASH_FIND(hh, s->defs, &ref, sizeof ref, d);
  if (d) {
    HASH_DEL(s->defs, d);
    free(d);
  }
  pthread_mutex_unlock(&x->mu);
}

xborrow_t *exec_take_borrow(executor_t *x, xsession_t *s, uint64_t id) {
  pthread_mutex_lock(&x->mu);
  xborrow_t *b = NULL;
  HASH_FIND(hh, s->borrows, &id, sizeof id, b);
  if (b) HASH_DEL(s->borrows, b);
  pthread_mutex_unlock(&x->mu);
  return b;
}

const executor_env_t *exec_env(executor_t *x) { return &x->env; }

/* ------------------------------------------------------------------ routing */

/* Ends a session: its workers stop after their queues; the last one frees it
 * and completes `seq`. Holds mu; returns a session to free now (no workers). */
static xsession_t *end_session_locked(executor_t *x, xsession_t *s, uint64_t seq) {
  HASH_DEL(x->sessions, s);
  s->end_seq = seq;
  if (s->live_workers == 0) return s;
  xstream_t *st, *tmp;
  HASH_ITER(hh, s->streams, st, tmp) {
    st->stop = true;
    pthread_cond_signal(&st->wake);
  }
  return NULL;
}

int executor_submit(executor_t *x, const Meshd__Agent__V1__Instruction *ins) {
  /* The batch belongs to the rpc layer: keep a copy. */
  size_t len = protobuf_c_message_get_packed_size(&ins->base);
  uint8_t *buf = malloc(len ? len : 1);
  instr_t *copy = NULL;
  if (buf) {
    protobuf_c_message_pack(&ins->base, buf);
    copy = meshd__agent__v1__instruction__unpack(NULL, len, buf);
    free(buf);
  }
  item_t *it = copy ? calloc(1, sizeof *it) : NULL;
  pthread_mutex_lock(&x->mu);
  if (ring_reserve_locked(x, ins->seq) != 0) {
    pthread_mutex_unlock(&x->mu);
    log_error("executor", "out of memory tracking seq %" PRIu64, ins->seq);
    if (copy) protobuf_c_message_free_unpacked(&copy->base, NULL);
    free(it);
    return -1;
  }
  x->last = ins->seq;
  bool done_now = false, failed = false;
  xsession_t *to_free = NULL;
  switch (ins->body_case) {
    case MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS:
    case MESHD__AGENT__V1__INSTRUCTION__BODY_CREATE_STREAM:
      /* The watermark is contiguous: this seq is passed once all before it ran. */
      done_now = true;
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION: {
      xsession_t *s = session_find_locked(x, ins->session_id);
      if (s) to_free = end_session_locked(x, s, ins->seq);
      done_now = !s;
      break;
    }
    default: {
      xsession_t *s = it ? session_get_locked(x, ins->session_id) : NULL;
      xstream_t *st = s ? stream_get_locked(x, s, ins->stream) : NULL;
      if (!st) {
        done_now = failed = true;
        break;
      }
      note_order_locked(s, copy);
      it->ins = copy;
      copy = NULL;
      if (st->tail) st->tail->next = it;
      else st->head = it;
      st->tail = it;
      it = NULL;
      pthread_cond_signal(&st->wake);
    }
  }
  if (done_now && !to_free) mark_done_locked(x, ins->seq);
  pthread_mutex_unlock(&x->mu);
  if (copy) protobuf_c_message_free_unpacked(&copy->base, NULL);
  free(it);
  if (to_free) {
    session_free(x->env.backend, to_free);
    pthread_mutex_lock(&x->mu);
    mark_done_locked(x, ins->seq);
    pthread_mutex_unlock(&x->mu);
  }
  if (failed) {
    char msg[160];
    snprintf(msg, sizeof msg, "agent out of memory or threads queueing instruction seq %" PRIu64,
             ins->seq);
    exec_report_error(x, ins->session_id, ERR_REMOTE_FAILURE, msg, ins->seq, 0);
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------ data */

int executor_lookup(executor_t *x, const char *session, uint64_t ref, agent_tensor_t *out,
                    ref_failure_t *why) {
  pthread_mutex_lock(&x->mu);
  xsession_t *s = session_find_locked(x, session);
  int rc = -1;
  if (s) rc = refs_get(&s->refs, ref, out, why);
  pthread_mutex_unlock(&x->mu);
  if (rc < 0 && why)
    snprintf(why->msg, sizeof why->msg, "%s %llu is not on this agent (session %.8s)",
             s ? "ref" : "session of ref", (unsigned long long)ref, session);
  return rc;
}

int executor_define(executor_t *x, const char *session, uint64_t ref, const agent_tensor_t *t) {
  pthread_mutex_lock(&x->mu);
  xsession_t *s = session_get_locked(x, session);
  int rc = s ? refs_put(&s->refs, ref, t) : -1;
  x->dirty = true;
  pthread_cond_signal(&x->report_cv);
  pthread_mutex_unlock(&x->mu);
  return rc;
}

backend_t *executor_backend(executor_t *x) { return x->env.backend; }

/* ------------------------------------------------------------------ lifecycle */

/* Executors not yet freed, process-wide: the backend outlives them all. */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t live_cv = PTHREAD_COND_INITIALIZER;
static int live_executors;

int executor_wait_all_freed(int timeout_ms) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += timeout_ms / 1000;
  dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&live_mu);
  int rc = 0;
  while (live_executors > 0 && rc == 0) rc = pthread_cond_timedwait(&live_cv, &live_mu, &dl);
  int left = live_executors;
  pthread_mutex_unlock(&live_mu);
  return left ? -1 : 0;
}

executor_t *executor_create(const executor_env_t *env, executor_report_fn report, void *arg) {
  executor_t *x = calloc(1, sizeof *x);
  if (!x) return NULL;
  x->env = *env;
  x->report = report;
  x->arg = arg;
  atomic_init(&x->refs, 1);
  pthread_mutex_lock(&live_mu);
  live_executors++;
  pthread_mutex_unlock(&live_mu);
  pthread_mutex_init(&x->mu, NULL);
  pthread_cond_init(&x->progress, NULL);
  pthread_cond_init(&x->report_cv, NULL);
  if (pthread_create(&x->reporter, NULL, reporter_main, x) != 0) {
    executor_unref(x);
    return NULL;
  }
  x->has_reporter = true;
  return x;
}

void executor_ref(executor_t *x) { atomic_fetch_add(&x->refs, 1); }

void executor_unref(executor_t *x) {
  if (!x || atomic_fetch_sub(&x->refs, 1) != 1) return;
  xsession_t *s, *tmp;
  HASH_ITER(hh, x->sessions, s, tmp) { /* only sessions without workers remain */
    HASH_DEL(x->sessions, s);
    session_free(x->env.backend, s);
  }
  for (size_t i = 0; i < x->nerrs; i++) {
    free(x->errs[i]->session_id);
    free(x->errs[i]->message);
    free(x->errs[i]);
  }
  free(x->errs);
  free(x->done);
  pthread_cond_destroy(&x->progress);
  pthread_cond_destroy(&x->report_cv);
  pthread_mutex_destroy(&x->mu);
  free(x);
  pthread_mutex_lock(&live_mu);
  live_executors--;
  pthread_cond_broadcast(&live_cv);
  pthread_mutex_unlock(&live_mu);
}

void executor_close(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  x->report_stop = true;
  pthread_cond_signal(&x->report_cv);
  pthread_mutex_unlock(&x->mu);
  if (x->has_reporter) pthread_join(x->reporter, NULL);
  /* Every session ends: workers drain their queues and free it. */
  pthread_mutex_lock(&x->mu);
  x->closing = true;
  pthread_cond_broadcast(&x->progress);
  xsession_t *s, *tmp, *free_now = NULL;
  HASH_ITER(hh, x->sessions, s, tmp) {
    xsession_t *f = end_session_locked(x, s, 0);
    if (f) {
      f->hh.next = free_now;
      free_now = f;
    }
  }
  pthread_mutex_unlock(&x->mu);
  while (free_now) {
    xsession_t *next = free_now->hh.next;
    session_free(x->env.backend, free_now);
    free_now = next;
  }
  executor_unref(x);
}
