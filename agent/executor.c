#include "executor.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <pthread.h>
#include <stdatomic.h>
#include <uthash.h>

#include "log.h"
#include "runtime.h"
#include "run.h"
#include "session_state.h"
#include "validate.h"

typedef Meshd__Agent__V1__Instruction instr_t;

struct executor_batch {
  _Atomic int refs;
  rpc_kept_t *kept;
};

executor_batch_t *executor_batch_new(rpc_kept_t *kept) {
  executor_batch_t *b = malloc(sizeof *b);
  if (!b) return NULL;
  atomic_init(&b->refs, 1);
  b->kept = kept;
  return b;
}

void executor_batch_release(executor_batch_t *b) {
  if (!b || atomic_fetch_sub(&b->refs, 1) != 1) return;
  rpc_kept_free(b->kept);
  free(b);
}

typedef struct item {
  instr_t *ins; /* an unpacked copy, owned; or inside batch */
  executor_batch_t *batch; /* holds ins (a reference), or NULL */
  meshd_error_t *refused; /* owned: the instruction failed validation; NULL: run it */
  struct item *next;
} item_t;

typedef struct xsession xsession_t;

/* The executor's pending seqs (the watermark section). */
typedef struct pending {
  uint64_t *v;
  size_t head, n, cap, dead;
} pending_t;
/* Marks a done entry still held among pending ones (seqs stay below 2^63:
 * execute.c refuses larger ones). */
#define PENDING_DEAD ((uint64_t)1 << 63)
#define PENDING_MIN 64

/* One (session, stream) queue and its worker. Fields guarded by executor.mu. */
/* Streams one batch's deferred wake-ups track; past it, a stream is woken at
 * once, as outside a batch. */
#define WAKE_MAX 16

typedef struct xstream {
  uint64_t id;
  xsession_t *sess;
  stream_progress_t *progress; /* the stream in the session's state */
  item_t *head, *tail;
  /* Not yet done besides the queue: the seq being run, and the first of the
   * seqs run but waiting for their device work (0: none). */
  uint64_t running, unsynced_first;
  bool stop; /* the session ended: drop what is queued (not run), then exit */
  bool wake_deferred; /* in executor.wake */
  bool idle; /* its worker waits: nothing it may run now (stream_runnable_locked) */
  pthread_cond_t wake;
  UT_hash_handle hh;
} xstream_t;

/* A session as the executor routes it: its queues and workers; what it keeps
 * between instructions is its session_state_t. Guarded by executor.mu. */
struct xsession {
  session_state_t *state;
  xstream_t *streams;
  /* stream workers, refusers (start_refuser_locked), and whoever lets go
   * of its data when it ends (drop_ended_data) */
  int live_workers;
  /* Its instructions on refuser threads, not done yet: the session has not
   * run them (session_through_locked) until their failures are queued. */
  struct refuser *refusing;
  uint64_t end_seq; /* EndSession's seq; 0 while open */
  bool ended;       /* EndSession, or the executor closed: the last live worker frees it */
  struct xsession *live_prev, *live_next; /* executor.live: not yet freed */
  UT_hash_handle hh;
};

/* What a worker thread is handed: a (session, stream) to run, or an ended
 * session whose data to let go of (drop_ended_data_locked). */
typedef struct work {
  struct xstream *st;
  xsession_t *drop;
} work_t;

/* A worker thread parked between streams (on its own stack), waiting to be
 * handed one: thread creation costs ~0.5 ms here, more than a short session. */
typedef struct idle_worker {
  pthread_cond_t cv;
  work_t work; /* set by the one who hands it work */
  struct idle_worker *next;
} idle_worker_t;

struct executor {
  run_env_t env;
  pthread_mutex_t mu;
  pthread_cond_t progress; /* broadcast whenever a seq completes */
  pthread_cond_t report_cv;
  xsession_t *sessions; /* open sessions by id */
  xsession_t *live;     /* every session not yet freed, open or ended */

  /* Watermark: the seqs taken and not yet done (pending_t), and the last
   * seq taken. */
  pending_t pending;
  uint64_t last;

  Meshd__V1__Error **errs;
  size_t nerrs, caperrs;
  bool dirty, report_stop, closing;
  bool report_holding; /* the reporter waits for the work it would report to end */
  uint64_t reported_alloc;
  executor_report_fn report;
  void *arg;
  pthread_t reporter;
  bool has_reporter;
  _Atomic int refs;
  /* executor_submit_begin..end: streams to wake at the end, each once (mu). */
  bool deferring;
  size_t nwake;
  xstream_t *wake[WAKE_MAX];
  int workers; /* worker threads alive, parked ones too (mu) */
  int refusers; /* refuser threads alive that refuse (mu; start_refuser_locked) */
  int deleters; /* and that delete (refuser_t.deletes), counted apart (mu) */
  idle_worker_t *idle; /* parked workers (mu) */
  int nidle;
  int max_workers; /* MAX_WORKERS, or a test's (executor_set_max_workers_for_test) */
  /* A test's hold of each refuser thread before it refuses (mu). */
  void (*refuser_hold)(void *arg, uint64_t seq);
  void *refuser_hold_arg;
  int idle_waiters; /* in executor_wait_stream_idle_for_test (mu) */
};

/* Worker threads one executor runs at most: one per (session, stream) with
 * work, so far beyond what a server's limits allow (--session-max-streams per
 * session), but a bound on what a corrupt instruction stream can start. */
#define MAX_WORKERS 4096
/* Workers kept parked at most, and how long one waits for a stream. */
#define MAX_IDLE_WORKERS 16
/* Refuser threads (start_refuser_locked) one executor runs at most; past
 * it, an instruction that could not be queued fails without telling its
 * peers, as before. */
#define MAX_REFUSERS 64
/* And those that delete (a DeleteRefs no worker can be had for), bounded
 * apart: one may wait long (for a slow stream's earlier instructions), and
 * deletes that took the refusers' places left a later collective that could
 * not be queued none, failing without telling its peers (they waited out
 * the comm timeout). */
#define MAX_DELETERS 64
#define IDLE_WORKER_MS 10000

/* ------------------------------------------------------------------ watermark */

/* The seqs not done yet, in the order taken (ascending: submit takes them in
 * seq order), in a ring of cap entries (a power of 2) from head; a done one
 * left among them is marked DEAD until compaction. Only what is pending is
 * kept: seqs that finish behind one that hangs (a slow step, a wait for a
 * peer) cost nothing, where a done flag per seq from the oldest pending one
 * grew without bound. Its size is bounded by the work queued, which the
 * instructions themselves already hold in memory. */
static uint64_t *pending_at(const pending_t *p, size_t i) {
  return &p->v[(p->head + i) & (p->cap - 1)];
}

/* Moves the live entries into a ring of cap entries: 0, or -1 out of memory
 * (p unchanged). */
static int pending_resize(pending_t *p, size_t cap) {
  uint64_t *v = malloc(cap * sizeof *v);
  if (!v) return -1;
  size_t n = 0;
  for (size_t i = 0; i < p->n; i++)
    if (!(*pending_at(p, i) & PENDING_DEAD)) v[n++] = *pending_at(p, i);
  free(p->v);
  *p = (pending_t){.v = v, .cap = cap, .n = n};
  return 0;
}

static int pending_add(pending_t *p, uint64_t seq) {
  if (p->n == p->cap && pending_resize(p, p->cap ? 2 * p->cap : PENDING_MIN) != 0) return -1;
  *pending_at(p, p->n++) = seq;
  return 0;
}

/* Index of seq among the entries (dead ones keep their seq's order), or n. */
static size_t pending_find(const pending_t *p, uint64_t seq) {
  size_t lo = 0, hi = p->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if ((*pending_at(p, mid) & ~PENDING_DEAD) < seq) lo = mid + 1;
    else hi = mid;
  }
  return lo < p->n && *pending_at(p, lo) == seq ? lo : p->n;
}

/* seq is done: false when it was not pending. */
static bool pending_remove(pending_t *p, uint64_t seq) {
  size_t i = pending_find(p, seq);
  if (i == p->n) return false;
  *pending_at(p, i) |= PENDING_DEAD;
  p->dead++;
  while (p->n && (*pending_at(p, 0) & PENDING_DEAD)) {
    p->head = (p->head + 1) & (p->cap - 1);
    p->n--;
    p->dead--;
  }
  while (p->n && (*pending_at(p, p->n - 1) & PENDING_DEAD)) {
    p->n--;
    p->dead--;
  }
  /* Dead entries held behind a pending one: dropped once they are half, and
   * a ring left mostly empty shrinks (out of memory: kept as it is). */
  size_t live = p->n - p->dead, cap = p->cap;
  while (cap > PENDING_MIN && live < cap / 4) cap /= 2;
  if ((p->dead > PENDING_MIN && p->dead > live) || cap != p->cap) pending_resize(p, cap);
  return true;
}

/* The oldest pending seq, 0 when none. */
static uint64_t pending_first(const pending_t *p) { return p->n ? *pending_at(p, 0) : 0; }

static uint64_t through_locked(const executor_t *x) {
  uint64_t first = pending_first(&x->pending);
  return first ? first - 1 : x->last;
}

static void mark_done_locked(executor_t *x, uint64_t seq) {
  if (!pending_remove(&x->pending, seq)) return;
  x->dirty = true;
  /* A holding reporter wants only the end of the work (reporter_main). */
  if (!x->report_holding || !x->pending.n) pthread_cond_signal(&x->report_cv);
  pthread_cond_broadcast(&x->progress);
}

/* The oldest seq of the stream not yet done, 0 when none: seqs finish in
 * order within a stream, so it is the unsynced one, else the running one,
 * else the head of the queue. */
static uint64_t oldest_locked(const xstream_t *st) {
  if (st->unsynced_first) return st->unsynced_first;
  if (st->running) return st->running;
  return st->head ? st->head->ins->seq : 0;
}

static uint64_t refusing_oldest_locked(const xsession_t *s);
static bool refusing_stream_locked(const xsession_t *s, uint64_t stream);

/* Every seq of session s <= the result is done: the oldest pending one of
 * its streams and its refusers - 1, or everything taken when none is
 * pending. Holds mu. */
static uint64_t session_through_locked(const executor_t *x, xsession_t *s) {
  uint64_t low = refusing_oldest_locked(s);
  xstream_t *st, *tmp;
  HASH_ITER(hh, s->streams, st, tmp) {
    uint64_t o = oldest_locked(st);
    if (o && (!low || o < low)) low = o;
  }
  return low ? low - 1 : x->last;
}

uint64_t executor_executed(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  uint64_t t = through_locked(x);
  pthread_mutex_unlock(&x->mu);
  return t;
}

int executor_wait(executor_t *x, uint64_t seq, int timeout_ms) {
  struct timespec dl;
  runtime_deadline(&dl, CLOCK_REALTIME, timeout_ms);
  pthread_mutex_lock(&x->mu);
  int rc = 0;
  while (through_locked(x) < seq && !x->closing && rc == 0)
    rc = pthread_cond_timedwait(&x->progress, &x->mu, &dl);
  bool ok = through_locked(x) >= seq;
  pthread_mutex_unlock(&x->mu);
  return ok ? 0 : -1;
}

static xsession_t *session_find_locked(executor_t *x, const char *id);

int executor_wait_session(executor_t *x, const char *session, uint64_t seq, int timeout_ms) {
  struct timespec dl;
  runtime_deadline(&dl, CLOCK_REALTIME, timeout_ms);
  pthread_mutex_lock(&x->mu);
  int rc = 0;
  bool ok;
  for (;;) {
    xsession_t *s = session_find_locked(x, session);
    ok = (s ? session_through_locked(x, s) : x->last) >= seq;
    if (ok || x->closing || rc != 0) break;
    rc = pthread_cond_timedwait(&x->progress, &x->mu, &dl);
  }
  pthread_mutex_unlock(&x->mu);
  return ok ? 0 : -1;
}

/* ------------------------------------------------------------------ reports */

/* A failure for a report; NULL out of memory. */
static Meshd__V1__Error *error_new(const char *session, error_kind_t kind, const char *msg,
                                   uint64_t seq, uint64_t ref) {
  Meshd__V1__Error *e = calloc(1, sizeof *e);
  char *m = strdup(msg ? msg : "");
  char *sid = strdup(session ? session : "");
  if (!e || !m || !sid) {
    free(e);
    free(m);
    free(sid);
    return NULL;
  }
  meshd__v1__error__init(e);
  e->kind = (Meshd__V1__ErrorKind)kind;
  e->message = m;
  e->code = (int32_t)error_kind_code(kind);
  e->seq = seq;
  e->ref = ref;
  e->session_id = sid;
  return e;
}

static void error_free(Meshd__V1__Error *e) {
  if (!e) return;
  free(e->message);
  free(e->session_id);
  free(e);
}

/* Queues e (NULL: a no-op) for the next report. Holds mu. */
static void error_push_locked(executor_t *x, Meshd__V1__Error *e) {
  if (!e) return;
  if (x->nerrs == x->caperrs) {
    size_t cap = x->caperrs ? 2 * x->caperrs : 8;
    Meshd__V1__Error **n = realloc(x->errs, cap * sizeof *n);
    if (!n) {
      error_free(e);
      return;
    }
    x->errs = n;
    x->caperrs = cap;
  }
  x->errs[x->nerrs++] = e;
  x->dirty = true;
  pthread_cond_signal(&x->report_cv);
}

/* Queues the failures running (or refusing) ins appended, each under its
 * ref, for the next report. Holds mu. */
static void report_failures_locked(executor_t *x, const char *session, const instr_t *ins,
                                   const run_failures_t *failed) {
  for (size_t i = 0; i < failed->n; i++) {
    const run_failure_t *f = &failed->v[i];
    Meshd__V1__Error *e = error_new(session, f->kind, f->msg, ins->seq, f->ref);
    if (!e) continue;
    e->command_seq = ins->command_seq; /* the server names the client's command by it */
    error_push_locked(x, e);
  }
}

static void report_failures(executor_t *x, const char *session, const instr_t *ins,
                            const run_failures_t *failed) {
  if (!failed->n) return;
  pthread_mutex_lock(&x->mu);
  report_failures_locked(x, session, ins, failed);
  pthread_mutex_unlock(&x->mu);
}

static uint64_t allocated(const executor_t *x) {
  return x->env.backend ? atomic_load(&x->env.backend->allocated) : 0;
}

/* How often the reporter looks at the agent's allocated bytes without news:
 * memory can be freed outside any instruction of this call (an earlier
 * Execute call's orphaned work finishing, a Read letting go of a storage), and
 * the server's ListAgents knows only what reports say. */
#define ALLOC_POLL_MS 1000
/* While instructions it received still run, a report waits up to this long
 * for them: a batch is reported once, when it is done, instead of at every
 * wake-up of the reporter while it runs. Errors, and the agent running out
 * of work, are reported at once. */
#define REPORT_HOLD_MS 1

/* A test's hold of each report (MESHD_FAULT report:slow=MS): the progress and
 * failures it carries reach the server MS later, as from an agent whose
 * reporter is not scheduled. Ends early at a stop. Holds mu. */
static void report_fault_locked(executor_t *x) {
  int ms = 0;
  int64_t rank = x->env.rank ? atomic_load(x->env.rank) : -1;
  if (fault_hit(x->env.fault, "report", rank, &ms) != FAULT_SLOW) return;
  struct timespec until;
  runtime_deadline(&until, CLOCK_MONOTONIC, ms);
  while (!x->report_stop && pthread_cond_timedwait(&x->report_cv, &x->mu, &until) != ETIMEDOUT) {
  }
}

/* Some received seq is not done yet. Holds mu. */
static bool busy_locked(const executor_t *x) { return x->pending.n > 0; }

static void *reporter_main(void *arg) {
  executor_t *x = arg;
  pthread_setname_np(pthread_self(), "reporter");
  pthread_mutex_lock(&x->mu);
  for (;;) {
    while (!x->dirty && !x->report_stop) {
      struct timespec until;
      runtime_deadline(&until, CLOCK_MONOTONIC, ALLOC_POLL_MS);
      if (pthread_cond_timedwait(&x->report_cv, &x->mu, &until) == ETIMEDOUT &&
          allocated(x) != x->reported_alloc)
        x->dirty = true;
    }
    if (!x->report_stop && !x->nerrs && busy_locked(x)) {
      struct timespec until;
      runtime_deadline(&until, CLOCK_MONOTONIC, REPORT_HOLD_MS);
      x->report_holding = true;
      while (!x->report_stop && !x->nerrs && busy_locked(x) &&
             pthread_cond_timedwait(&x->report_cv, &x->mu, &until) != ETIMEDOUT) {
      }
      x->report_holding = false;
    }
    if (!x->report_stop) report_fault_locked(x);
    if (x->report_stop) break;
    x->dirty = false;
    executor_report_t r = {.executed_through = through_locked(x), .received_through = x->last};
    r.errors = x->errs;
    r.n_errors = x->nerrs;
    x->errs = NULL;
    x->nerrs = x->caperrs = 0;
    r.allocated_bytes = allocated(x);
    x->reported_alloc = r.allocated_bytes;
    /* Sessions behind what was taken: each with its own watermark. */
    size_t nsess = HASH_COUNT(x->sessions);
    Meshd__Agent__V1__SessionProgress *prog = nsess ? calloc(nsess, sizeof *prog) : NULL;
    Meshd__Agent__V1__SessionProgress **ptrs = nsess ? calloc(nsess, sizeof *ptrs) : NULL;
    char *ids = nsess ? malloc(nsess * 64) : NULL;
    if (prog && ptrs && ids) {
      xsession_t *s, *tmp;
      HASH_ITER(hh, x->sessions, s, tmp) {
        uint64_t t = session_through_locked(x, s);
        if (t >= r.received_through) continue;
        Meshd__Agent__V1__SessionProgress *p = &prog[r.n_sessions];
        meshd__agent__v1__session_progress__init(p);
        p->session_id = ids + 64 * r.n_sessions;
        snprintf(p->session_id, 64, "%s", s->state->id);
        p->executed_through = t;
        ptrs[r.n_sessions++] = p;
      }
      r.sessions = ptrs;
    } else if (nsess) {
      /* Without the list every session is as far as the slowest: still correct. */
      r.received_through = r.executed_through;
    }
    pthread_mutex_unlock(&x->mu);
    x->report(&r, x->arg);
    for (size_t i = 0; i < r.n_errors; i++) {
      free(r.errors[i]->session_id);
      free(r.errors[i]->message);
      free(r.errors[i]);
    }
    free(r.errors);
    free(prog);
    free(ptrs);
    free(ids);
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

/* Sessions in any executor's table: the agent's meshd_agent_sessions gauge. */
static atomic_size_t open_sessions;

size_t executor_open_sessions(void) { return atomic_load(&open_sessions); }

static xsession_t *session_get_locked(executor_t *x, const char *id) {
  xsession_t *s = session_find_locked(x, id);
  if (s) return s;
  s = calloc(1, sizeof *s);
  if (!s || !(s->state = session_state_new(id, x->env.backend))) {
    free(s);
    return NULL;
  }
  HASH_ADD_KEYPTR(hh, x->sessions, s->state->id, strlen(s->state->id), s);
  atomic_fetch_add(&open_sessions, 1);
  s->live_next = x->live;
  if (x->live) x->live->live_prev = s;
  x->live = s;
  pthread_cond_broadcast(&x->progress); /* executor_wait_open */
  return s;
}

/* Frees an ended session whose workers are gone. Without mu (frees memory);
 * the caller took it off executor.live. */
static void session_free(xsession_t *s) {
  xstream_t *st, *st2;
  HASH_ITER(hh, s->streams, st, st2) {
    HASH_DEL(s->streams, st);
    pthread_cond_destroy(&st->wake);
    free(st);
  }
  session_state_free(s->state);
  free(s);
}

static void unlink_live_locked(executor_t *x, xsession_t *s) {
  if (s->live_prev) s->live_prev->live_next = s->live_next;
  else x->live = s->live_next;
  if (s->live_next) s->live_next->live_prev = s->live_prev;
  s->live_prev = s->live_next = NULL;
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
  work_t work;
} worker_arg_t;

/* A live worker of session s (a stream's, or a refuser) is done with it;
 * the last one out of an ended session frees it and completes its
 * EndSession's seq. Called with mu, returns without it. */
static void leave_session_locked(executor_t *x, xsession_t *s) {
  bool last = --s->live_workers == 0 && s->ended;
  uint64_t end_seq = s->end_seq;
  if (last) unlink_live_locked(x, s);
  pthread_mutex_unlock(&x->mu);
  if (last) {
    session_free(s);
    pthread_mutex_lock(&x->mu);
    mark_done_locked(x, end_seq);
    pthread_mutex_unlock(&x->mu);
  }
}

/* The stream's worker may run the head of its queue now: there is one, and
 * no refuser thread of its stream still fails an instruction sent before it
 * (start_refuser_locked). Holds mu. */
static bool stream_runnable_locked(const xstream_t *st) {
  return st->head && !refusing_stream_locked(st->sess, st->id);
}

/* Seqs a worker ran whose device work may still be in flight (backends with
 * stream_sync): marked done together once the stream is synchronised, when
 * the queue runs dry or this many are waiting. */
#define MAX_UNSYNCED 64

/* Runs one (session, stream) until its session ends; the last of the
 * session's workers frees it. Called and returns without mu. */
static void run_stream(executor_t *x, xstream_t *st) {
  xsession_t *s = st->sess;
  session_state_t *ss = s->state;
  backend_t *b = x->env.backend;
  backend_stream_t *bs = b && b->ops->stream_create ? b->ops->stream_create(b) : NULL;
  /* A device backend that could make no stream for it: its instructions fail
   * rather than run on a stream and library handles other threads use. */
  meshd_error_t no_stream = {0};
  if (b && b->ops->stream_create && !bs)
    error_set(&no_stream, ERR_UNAVAILABLE,
              "the agent could not create a device stream for stream %" PRIu64
              " of this session (out of device resources)", st->id);
  session_state_stream_ready(ss, st->progress, bs);
  bool deferred = b && b->ops->stream_sync;
  uint64_t unsynced[MAX_UNSYNCED];
  int nunsynced = 0;
  run_failures_t failed;
  pthread_mutex_lock(&x->mu);
  for (;;) {
    if (nunsynced && (!st->head || nunsynced == MAX_UNSYNCED)) {
      pthread_mutex_unlock(&x->mu);
      meshd_error_t e = {0};
      if (b->ops->stream_sync(b, bs, &e) != 0)
        log_event(LOG_LEVEL_ERROR, "executor", &(log_fields_t){.session = ss->id},
                  "session %.8s stream %" PRIu64 ": %s", ss->id, st->id, e.msg);
      pthread_mutex_lock(&x->mu);
      st->unsynced_first = 0;
      for (int i = 0; i < nunsynced; i++) mark_done_locked(x, unsynced[i]);
      nunsynced = 0;
      continue;
    }
    while (!stream_runnable_locked(st) && !st->stop) {
      st->idle = true;
      if (x->idle_waiters) pthread_cond_broadcast(&x->progress);
      pthread_cond_wait(&st->wake, &x->mu);
      st->idle = false;
    }
    item_t *it = st->head;
    if (!it) break;
    st->head = it->next;
    if (!st->head) st->tail = NULL;
    uint64_t seq = it->ins->seq;
    st->running = seq;
    /* The session ended (EndSession, or its Execute call is gone: a server
     * that lost this agent failed that work already): what is still queued
     * is dropped, not run. */
    bool skip = st->stop;
    pthread_mutex_unlock(&x->mu);
    failed.n = 0;
    /* Refused by its checks: every member refuses alike, and is not told,
     * unless only this agent's own limits refused it (QUOTA, validate.h). */
    if (!skip && it->refused)
      run_refused(&x->env, ss, it->ins, it->refused, it->refused->kind == ERR_QUOTA, &failed);
    else if (!skip && no_stream.kind != ERR_NONE)
      run_refused(&x->env, ss, it->ins, &no_stream, true, &failed);
    else if (!skip) run_instruction(&x->env, ss, bs, it->ins, &failed);
    report_failures(x, ss->id, it->ins, &failed);
    if (it->batch) executor_batch_release(it->batch);
    else protobuf_c_message_free_unpacked(&it->ins->base, NULL);
    free(it->refused);
    free(it);
    /* Cross-stream waiters need only the work queued (session_state.h). */
    session_state_queued(ss, st->progress, seq);
    pthread_mutex_lock(&x->mu);
    st->running = 0;
    if (deferred) {
      if (nunsynced == 0) st->unsynced_first = seq;
      unsynced[nunsynced++] = seq;
    } else {
      mark_done_locked(x, seq);
    }
  }
  leave_session_locked(x, s);
}

static bool has_work(const work_t *w) { return w->st || w->drop; }

/* Parks the calling worker until it is handed work (returned), or
 * IDLE_WORKER_MS pass, or the executor closes (none: the thread ends). */
static work_t park(executor_t *x) {
  idle_worker_t me = {.work = {0}};
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&me.cv, &ca);
  pthread_condattr_destroy(&ca);
  struct timespec dl;
  runtime_deadline(&dl, CLOCK_MONOTONIC, IDLE_WORKER_MS);
  pthread_mutex_lock(&x->mu);
  if (!x->closing && x->nidle < MAX_IDLE_WORKERS) {
    me.next = x->idle;
    x->idle = &me;
    x->nidle++;
    int rc = 0;
    while (!has_work(&me.work) && !x->closing && rc != ETIMEDOUT)
      rc = pthread_cond_timedwait(&me.cv, &x->mu, &dl);
    if (!has_work(&me.work)) { /* still listed: whoever hands out work unlinks */
      for (idle_worker_t **p = &x->idle; *p; p = &(*p)->next)
        if (*p == &me) {
          *p = me.next;
          break;
        }
      x->nidle--;
    }
  }
  if (!has_work(&me.work)) x->workers--;
  pthread_mutex_unlock(&x->mu);
  pthread_cond_destroy(&me.cv);
  return me.work;
}

static void drop_ended_data_locked(executor_t *x, xsession_t *s);

static void *worker_main(void *arg) {
  worker_arg_t *wa = arg;
  executor_t *x = wa->x;
  work_t w = wa->work;
  free(wa);
  pthread_setname_np(pthread_self(), "stream-worker");
  while (has_work(&w)) {
    if (w.st) {
      run_stream(x, w.st);
    } else {
      pthread_mutex_lock(&x->mu);
      drop_ended_data_locked(x, w.drop);
    }
    w = park(x);
  }
  executor_unref(x);
  return NULL;
}

/* Hands w to a parked worker, or starts a worker thread for it. Holds mu.
 * 0, or -1 when there is neither (MAX_WORKERS, or no memory or thread). */
static int start_work_locked(executor_t *x, work_t w) {
  if (x->idle) {
    idle_worker_t *iw = x->idle;
    x->idle = iw->next;
    x->nidle--;
    iw->work = w;
    pthread_cond_signal(&iw->cv);
    return 0;
  }
  if (x->workers >= x->max_workers) return -1;
  worker_arg_t *wa = malloc(sizeof *wa);
  if (!wa) return -1;
  *wa = (worker_arg_t){x, w};
  executor_ref(x);
  if (runtime_spawn_detached("stream-worker", worker_main, wa) != 0) {
    atomic_fetch_sub(&x->refs, 1); /* cannot be the last: the caller holds one */
    free(wa);
    return -1;
  }
  x->workers++;
  return 0;
}

static xstream_t *stream_get_locked(executor_t *x, xsession_t *s, uint64_t id) {
  xstream_t *st = NULL;
  HASH_FIND(hh, s->streams, &id, sizeof id, st);
  if (st) return st;
  if (!x->idle && x->workers >= x->max_workers) {
    log_warn("executor", "session %.8s stream %" PRIu64 ": %d worker threads already run",
             s->state->id, id, x->max_workers);
    return NULL;
  }
  st = calloc(1, sizeof *st);
  if (!st) return NULL;
  if (!(st->progress = session_state_add_stream(s->state, id))) {
    free(st);
    return NULL;
  }
  st->id = id;
  st->sess = s;
  pthread_cond_init(&st->wake, NULL);
  if (start_work_locked(x, (work_t){.st = st}) != 0) {
    pthread_cond_destroy(&st->wake);
    session_state_remove_stream(s->state, st->progress);
    free(st);
    return NULL;
  }
  s->live_workers++;
  HASH_ADD(hh, s->streams, id, sizeof st->id, st);
  return st;
}

/* An instruction with a data plane call (a Reduce, a ToMesh broadcast or
 * transfer) that could not be queued (no worker for its stream: MAX_WORKERS,
 * or no memory or thread): its peers wait for this agent in that call. A
 * thread of its own refuses it as its worker would have (run_refused: the
 * peers are told why at once rather than at the comm timeout, its results
 * fail here), counted as a live worker of the session so that the session
 * outlives it; its seq is done when it returns. It keeps its place in its
 * stream's order: the stream's later instructions, queued once a worker
 * can be had, run only after it (stream_runnable_locked), or they would read
 * the old value of a result it fails (an in-place Reduce's out=, read by
 * the Snapshot of a Fetch that then answered it as fine). A DeleteRefs the
 * router cannot do at once (delete_now_locked) runs on one the same way,
 * deleting instead (the test's hold is only of those that refuse). */
typedef struct refuser {
  executor_t *x;
  xsession_t *s;
  instr_t *ins; /* owned, or inside batch */
  executor_batch_t *batch;
  meshd_error_t why;
  uint64_t seq, stream;
  void (*hold)(void *arg, uint64_t seq); /* executor.refuser_hold */
  void *hold_arg;
  /* A DeleteRefs the router could not do at once (delete_now_locked): it
   * deletes, after the refusers of its stream before it, instead of
   * refusing. */
  bool deletes;
  struct refuser *next; /* xsession.refusing (executor.mu) */
} refuser_t;

/* The oldest seq of s a refuser still runs, 0 when none. Holds mu. */
static uint64_t refusing_oldest_locked(const xsession_t *s) {
  uint64_t low = 0;
  for (const refuser_t *r = s->refusing; r; r = r->next)
    if (!low || r->seq < low) low = r->seq;
  return low;
}

/* A refuser of s still runs an instruction of stream. Holds mu. */
static bool refusing_stream_locked(const xsession_t *s, uint64_t stream) {
  for (const refuser_t *r = s->refusing; r; r = r->next)
    if (r->stream == stream) return true;
  return false;
}

/* A refuser of s runs an instruction of r's stream sent before r's. Holds mu. */
static bool refusing_before_locked(const xsession_t *s, const refuser_t *r) {
  for (const refuser_t *o = s->refusing; o; o = o->next)
    if (o->stream == r->stream && o->seq < r->seq) return true;
  return false;
}

static void refusing_unlink_locked(xsession_t *s, refuser_t *r) {
  for (refuser_t **p = &s->refusing; *p; p = &(*p)->next)
    if (*p == r) {
      *p = r->next;
      return;
    }
}

/* r (a refuser thread's, or the router's own: router_take_locked) is done:
 * off its session's list, its stream's worker may run what it holds, its seq
 * is done, and the session has one live worker less. Called with mu (after
 * r's failures are queued), returns without it; s may be freed then. */
static void refusing_end_locked(executor_t *x, xsession_t *s, refuser_t *r) {
  refusing_unlink_locked(s, r);
  xstream_t *st = NULL;
  HASH_FIND(hh, s->streams, &r->stream, sizeof r->stream, st);
  if (st) pthread_cond_signal(&st->wake);
  mark_done_locked(x, r->seq);
  leave_session_locked(x, s);
}

static void queue_failure_msg(const executor_t *x, char *buf, size_t len, uint64_t seq) {
  snprintf(buf, len, "agent out of memory or threads queueing instruction seq %" PRIu64
           " (it runs at most %d streams at once, over all sessions)", seq, x->max_workers);
}

static bool has_data_plane_call(const instr_t *ins) {
  switch (ins->body_case) {
    case MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE:
      return ins->reduce && ins->reduce->group && ins->reduce->group->n_ranks > 1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST:
      return ins->broadcast && ins->broadcast->group && ins->broadcast->group->n_ranks > 1;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_SEND:
      return ins->send && !ins->send->input != !ins->send->result;
    default: return false;
  }
}

/* The refs of DeleteRefs ins go, each once its definition on another stream
 * is queued (session_state_delete), as run_delete does on a worker; here on
 * no device stream (a refuser thread, or the router: delete_now_locked). */
static void delete_refs(session_state_t *ss, const instr_t *ins) {
  const Meshd__Agent__V1__DeleteRefs *d = ins->delete_refs;
  for (size_t i = 0; i < d->n_refs; i++)
    session_state_delete(ss, ins->stream, ins->seq, NULL, d->refs[i]);
}

static void *refuser_main(void *arg) {
  refuser_t *r = arg;
  executor_t *x = r->x;
  xsession_t *s = r->s;
  session_state_t *ss = s->state;
  uint64_t seq = r->seq;
  pthread_setname_np(pthread_self(), "refuser");
  if (r->hold) r->hold(r->hold_arg, seq);
  run_failures_t failed;
  failed.n = 0;
  if (r->deletes) {
    /* After the earlier instructions of its stream (their refusers fail
     * what they define, which a delete before them left defined), and each
     * ref's definition on another stream (session_state_delete waits). */
    pthread_mutex_lock(&x->mu);
    while (refusing_before_locked(s, r)) pthread_cond_wait(&x->progress, &x->mu);
    pthread_mutex_unlock(&x->mu);
    delete_refs(ss, r->ins);
    if (x->env.stats) atomic_fetch_add(&x->env.stats->instructions, 1);
  } else {
    run_refused(&x->env, ss, r->ins, &r->why, true, &failed);
  }
  report_failures(x, ss->id, r->ins, &failed);
  if (r->batch) executor_batch_release(r->batch);
  else protobuf_c_message_free_unpacked(&r->ins->base, NULL);
  /* Done, for the executor and for its session, only now that its failures
   * are queued: a report (or a Read's executor_wait_session) that passes the
   * seq carries them. */
  pthread_mutex_lock(&x->mu);
  if (r->deletes) x->deleters--;
  else x->refusers--;
  refusing_end_locked(x, s, r);
  free(r);
  executor_unref(x);
  return NULL;
}

/* Hands ins (the caller's copy, or inside batch) to a refuser: true when one
 * took it. why: the refusal its checks made (only this agent's limits:
 * QUOTA), or NULL for the queue's failure. Holds mu. */
static bool start_refuser_locked(executor_t *x, xsession_t *s, instr_t *ins,
                                 executor_batch_t *batch, const meshd_error_t *why) {
  bool deletes = ins && ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS &&
                 ins->delete_refs && !why;
  if (!ins || !(deletes || has_data_plane_call(ins))) return false;
  if (deletes ? x->deleters >= MAX_DELETERS : x->refusers >= MAX_REFUSERS) return false;
  refuser_t *r = malloc(sizeof *r);
  if (!r) return false;
  char msg[160];
  queue_failure_msg(x, msg, sizeof msg, ins->seq);
  *r = (refuser_t){.x = x, .s = s, .ins = ins, .batch = batch, .seq = ins->seq,
                   .stream = ins->stream, .hold = deletes ? NULL : x->refuser_hold,
                   .hold_arg = x->refuser_hold_arg, .deletes = deletes};
  if (why) r->why = *why;
  else error_set(&r->why, ERR_REMOTE_FAILURE, "%s", msg);
  executor_ref(x);
  if (batch) atomic_fetch_add(&batch->refs, 1);
  int rc = runtime_spawn_detached("refuser", refuser_main, r);
  if (rc != 0) { /* neither count can drop to 0: the caller holds one of each */
    atomic_fetch_sub(&x->refs, 1);
    if (batch) atomic_fetch_sub(&batch->refs, 1);
    free(r);
    return false;
  }
  s->live_workers++;
  if (deletes) x->deleters++;
  else x->refusers++;
  r->next = s->refusing; /* before the thread can take mu: we hold it */
  s->refusing = r;
  return true;
}

/* ins (of session s) can be neither queued nor handed to a refuser: it fails
 * here, as a refusal on its worker would (run_refused), with why (its
 * checks' refusal) or, NULL, the queue's failure. Its results and what it
 * writes in place fail in the session's table with that root cause, each
 * reported under its ref: a tensor it writes in place (an add_'s self) no
 * longer reads as its old value to the stream's later instructions (a
 * Fetch's Snapshot), and a fresh result is failed, not missing. Peers are
 * not told (no data plane call, or MAX_REFUSERS already run). The router
 * does it (router_do) before it routes the next instruction, and its seq is
 * done once the failures are queued. */
static void refuse_now(executor_t *x, session_state_t *ss, const instr_t *ins,
                       const meshd_error_t *why, run_failures_t *failed) {
  meshd_error_t queue_err;
  if (!why) {
    char msg[160];
    queue_failure_msg(x, msg, sizeof msg, ins->seq);
    error_set(&queue_err, ERR_REMOTE_FAILURE, "%s", msg);
    why = &queue_err;
  }
  run_refused(&x->env, ss, ins, why, false, failed);
}

/* A DeleteRefs that no worker can be had for (MAX_WORKERS) still deletes:
 * failed, its refs stayed on the agent until the session ended, a leak per
 * session under load. The router does it at once, when nothing before it in
 * its stream's order is still to run there: its stream has no queue (no
 * worker was ever had for it, so none of its instructions waits) and no
 * refuser thread, and each ref's definition on another stream is queued
 * (session_state_def_queued). A reader that took the tensor before holds
 * its storage (refs_get), and the backend orders the free after the device
 * work queued on it. Otherwise it goes to a refuser thread (refuser_t.deletes)
 * that waits for those first (the router must not: it would hold up every
 * session's instructions): a delete done before an earlier instruction of its
 * stream that a refuser still fails (a Reduce's result) was undone by that
 * failure. With no thread to be had either, it fails as before and its refs
 * go when the session ends. Holds mu. */
static bool delete_now_locked(const xsession_t *s, const instr_t *ins) {
  const Meshd__Agent__V1__DeleteRefs *d = ins->delete_refs;
  if (ins->body_case != MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS || !d) return false;
  xstream_t *st = NULL;
  HASH_FIND(hh, s->streams, &ins->stream, sizeof ins->stream, st);
  if (st || refusing_stream_locked(s, ins->stream)) return false;
  for (size_t i = 0; i < d->n_refs; i++)
    if (!session_state_def_queued(s->state, ins->stream, ins->seq, d->refs[i])) return false;
  return true;
}

/* What the router does itself rather than queue (router_do). */
typedef enum { ROUTER_NONE, ROUTER_REFUSE, ROUTER_DELETE, ROUTER_DROP_SNAPSHOT } router_job_t;

/* The router takes ins (of session s) to do itself once it lets go of mu
 * (router_do): it frees memory, which under mu held up every worker and the
 * reporter. Listed meanwhile among the session's refusing instructions in r,
 * as a refuser thread is, so that neither the session's watermark nor its
 * stream's later instructions pass it; and holding the session, so that it
 * is not freed. Holds mu. */
static void router_take_locked(xsession_t *s, refuser_t *r, const instr_t *ins) {
  *r = (refuser_t){.s = s, .seq = ins->seq, .stream = ins->stream, .next = s->refusing};
  s->refusing = r;
  s->live_workers++;
}

/* Does job for ins (router_take_locked took it in r; why: as refuse_now),
 * queues its failures, and completes its seq. Without mu. */
static void router_do(executor_t *x, router_job_t job, refuser_t *r, const instr_t *ins,
                      const meshd_error_t *why) {
  session_state_t *ss = r->s->state;
  run_failures_t failed;
  failed.n = 0;
  switch (job) {
    case ROUTER_REFUSE: refuse_now(x, ss, ins, why, &failed); break;
    case ROUTER_DELETE:
      /* No wait: delete_now_locked found nothing before it to wait for. */
      delete_refs(ss, ins);
      break;
    case ROUTER_DROP_SNAPSHOT: session_state_drop_snapshot(ss, ins->drop_snapshot->seq); break;
    case ROUTER_NONE: break;
  }
  if (job != ROUTER_REFUSE && x->env.stats) /* it ran, as on a worker (run_instruction) */
    atomic_fetch_add(&x->env.stats->instructions, 1);
  pthread_mutex_lock(&x->mu);
  report_failures_locked(x, ss->id, ins, &failed);
  refusing_end_locked(x, r->s, r); /* a report follows, with the bytes freed */
}

/* ------------------------------------------------------------------ routing */

/* Wakes the streams executor_submit_begin deferred. Holds mu. */
static void wake_deferred_locked(executor_t *x) {
  for (size_t i = 0; i < x->nwake; i++) {
    x->wake[i]->wake_deferred = false;
    pthread_cond_signal(&x->wake[i]->wake);
  }
  x->nwake = 0;
}

/* A stream got work: its worker wakes now, or at the batch's end. Holds mu. */
static void wake_stream_locked(executor_t *x, xstream_t *st) {
  if (st->wake_deferred) return;
  if (x->deferring && x->nwake < WAKE_MAX) {
    st->wake_deferred = true;
    x->wake[x->nwake++] = st;
    return;
  }
  pthread_cond_signal(&st->wake);
}

void executor_submit_begin(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  x->deferring = true;
  pthread_mutex_unlock(&x->mu);
}

void executor_submit_end(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  x->deferring = false;
  wake_deferred_locked(x);
  pthread_mutex_unlock(&x->mu);
}

/* Ends a session: its workers stop after their queues; the last one frees it
 * and completes `seq`. Holds mu; returns a session to free now (no workers). */
static xsession_t *end_session_locked(executor_t *x, xsession_t *s, uint64_t seq) {
  wake_deferred_locked(x); /* its streams may end and be freed before the batch's end */
  HASH_DEL(x->sessions, s);
  atomic_fetch_sub(&open_sessions, 1);
  s->end_seq = seq;
  s->ended = true;
  session_state_close(s->state); /* waits (a hung instruction) end; nothing reads it after */
  if (s->live_workers == 0) {
    unlink_live_locked(x, s);
    return s;
  }
  xstream_t *st, *tmp;
  HASH_ITER(hh, s->streams, st, tmp) {
    st->stop = true;
    pthread_cond_signal(&st->wake);
  }
  return NULL;
}

/* An ended session's memory goes now, but for what its running steps hold
 * (a slow step held all of it until it returned); and the session itself
 * when no worker of it is left. Called with mu, holding s as one more live
 * worker (so that it is not freed meanwhile); returns without mu, and s may
 * be freed then. On a worker (submit hands it one), not on the thread that
 * reads the Execute stream, where a large free delayed the instructions of
 * every other session behind it. */
static void drop_ended_data_locked(executor_t *x, xsession_t *s) {
  pthread_mutex_unlock(&x->mu);
  session_state_drop_data(s->state);
  pthread_mutex_lock(&x->mu);
  x->dirty = true; /* the bytes freed go out in the next report */
  pthread_cond_signal(&x->report_cv);
  leave_session_locked(x, s);
}

static int submit(executor_t *x, const Meshd__Agent__V1__Instruction *ins,
                  executor_batch_t *batch) {
  instr_t *copy = NULL;
  if (batch) {
    copy = (instr_t *)ins; /* queued in place: the batch holds it */
  } else { /* the caller's message: keep a copy */
    size_t len = protobuf_c_message_get_packed_size(&ins->base);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf) {
      protobuf_c_message_pack(&ins->base, buf);
      copy = meshd__agent__v1__instruction__unpack(NULL, len, buf);
      free(buf);
    }
  }
  item_t *it = copy ? calloc(1, sizeof *it) : NULL;
  /* Checked before it is queued (validate.h); a refused instruction still
   * takes its place in its stream, where it fails what it would define. */
  validate_self_t self = {.rank = x->env.rank ? atomic_load(x->env.rank) : -1,
                          .data_address = x->env.data_address};
  meshd_error_t verr = {0};
  bool refused = validate_instruction(ins, &self, &verr) != 0;
  if (!refused) run_expect(&x->env, ins);
  meshd_error_t *why = NULL;
  Meshd__V1__Error *refusal = NULL; /* reported with the seq, when it is done at once */
  if (refused) {
    log_event(LOG_LEVEL_WARN, "executor", &(log_fields_t){.session = ins->session_id, .seq = ins->seq},
              "session %.8s: %s", ins->session_id ? ins->session_id : "", verr.msg);
    if ((why = malloc(sizeof *why))) *why = verr;
    refusal = error_new(ins->session_id, ERR_REMOTE_FAILURE, verr.msg, ins->seq, 0);
  }
  pthread_mutex_lock(&x->mu);
  if (pending_add(&x->pending, ins->seq) != 0) {
    pthread_mutex_unlock(&x->mu);
    log_error("executor", "out of memory tracking seq %" PRIu64, ins->seq);
    if (copy && !batch) protobuf_c_message_free_unpacked(&copy->base, NULL);
    free(it);
    free(why);
    error_free(refusal);
    return -1;
  }
  x->last = ins->seq;
  bool done_now = false, failed = false, refuse_later = false;
  bool failures_queued = false; /* router_do reports them */
  xsession_t *to_drop = NULL;
  router_job_t job = ROUTER_NONE; /* done after mu (router_do) */
  refuser_t own;                  /* its place in its session's refusing list */
  const Meshd__Agent__V1__PeerLost *lost = NULL;
  switch (ins->body_case) {
    case MESHD__AGENT__V1__INSTRUCTION__BODY_PEER_LOST: {
      /* Before anything queued runs: the session's work that needs the peer
       * fails instead of waiting for it. */
      done_now = true;
      if (refused) break;
      lost = ins->peer_lost;
      xsession_t *s = session_find_locked(x, ins->session_id);
      if (s) session_state_peer_lost(s->state, lost->rank, ins->seq, lost->reason);
      break;
    }
    case MESHD__AGENT__V1__INSTRUCTION__BODY_REVOKE_GRANTS:
      /* Acted on as it arrived (execute.c); opens no session. */
      done_now = true;
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_DROP_SNAPSHOT: {
      /* Acted on as it arrives, not in its stream's order
       * (session_state_drop_snapshot says why); opens no session. */
      xsession_t *s = refused ? NULL : session_find_locked(x, ins->session_id);
      if (s) {
        router_take_locked(s, &own, ins);
        job = ROUTER_DROP_SNAPSHOT;
      }
      done_now = !s;
      break;
    }
    case MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS:
    case MESHD__AGENT__V1__INSTRUCTION__BODY_CREATE_STREAM:
      /* They open the session (Agent/Write and Read need it open), and the
       * watermark is contiguous: this seq is passed once all before it ran. */
      session_get_locked(x, ins->session_id);
      done_now = true;
      break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION: {
      xsession_t *s = session_find_locked(x, ins->session_id);
      if (s) {
        /* Held for drop_ended_data_locked (so end_session_locked frees
         * nothing here), which a worker runs; the last one out frees the
         * session and completes this seq. With no worker to be had: here. */
        s->live_workers++;
        end_session_locked(x, s, ins->seq);
        if (start_work_locked(x, (work_t){.drop = s}) != 0) to_drop = s;
      }
      done_now = !s;
      break;
    }
    default: {
      xsession_t *s = it ? session_get_locked(x, ins->session_id) : NULL;
      xstream_t *st = s && (!refused || why) ? stream_get_locked(x, s, ins->stream) : NULL;
      xsession_t *owner = st ? NULL : s ? s : session_find_locked(x, ins->session_id);
      if (!st && !refused && owner && delete_now_locked(owner, ins)) {
        router_take_locked(owner, &own, ins);
        job = ROUTER_DELETE;
        break;
      }
      if (!st) {
        /* Peers that wait for it in its data plane call are told, on a
         * thread of its own (which reports it and completes the seq). */
        /* Refused by this agent's own limits alone (QUOTA): its peers may run
         * it, and are told as its worker would have told them. */
        bool tell = !refused || (why && why->kind == ERR_QUOTA);
        if (s && tell && start_refuser_locked(x, s, copy, batch, refused ? why : NULL)) {
          refuse_later = copy->body_case != MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS;
          copy = NULL;
          break;
        }
        failed = true;
        /* An open session (its item could not be allocated: s is NULL)
         * fails the results; without one, the seq's one failure below. */
        if (owner) {
          router_take_locked(owner, &own, ins);
          job = ROUTER_REFUSE;
          failures_queued = true;
        }
        done_now = !owner;
        break;
      }
      session_state_note_order(s->state, copy);
      it->ins = copy;
      copy = NULL;
      if ((it->batch = batch)) atomic_fetch_add(&batch->refs, 1);
      it->refused = why;
      why = NULL;
      if (st->tail) st->tail->next = it;
      else st->head = it;
      st->tail = it;
      it = NULL;
      wake_stream_locked(x, st);
    }
  }
  /* The failure goes in before the watermark passes the seq: a report that
   * says it ran says how it failed. */
  char failmsg[160] = "";
  bool seq_failure = failed && !failures_queued; /* one error for the seq, ref 0 */
  if (seq_failure) queue_failure_msg(x, failmsg, sizeof failmsg, ins->seq);
  if (done_now && refused && !failures_queued) error_push_locked(x, refusal);
  else error_free(refusal);
  if (seq_failure)
    error_push_locked(x, error_new(ins->session_id, ERR_REMOTE_FAILURE, failmsg, ins->seq, 0));
  if (done_now) mark_done_locked(x, ins->seq);
  pthread_mutex_unlock(&x->mu);
  if (lost) {
    backend_t *b = x->env.backend;
    if (b && b->net && lost->data_address && *lost->data_address)
      dataplane_peer_lost(b->net, lost->data_address, lost->rank, lost->reason);
    if (b && b->ops->peer_lost) {
      xsession_t *s;
      uint64_t key = 0;
      pthread_mutex_lock(&x->mu);
      if ((s = session_find_locked(x, ins->session_id))) key = s->state->key;
      pthread_mutex_unlock(&x->mu);
      if (key) b->ops->peer_lost(b, key, lost->rank);
    }
  }
  if (job != ROUTER_NONE) router_do(x, job, &own, ins, refused ? &verr : NULL);
  if (copy && !batch) protobuf_c_message_free_unpacked(&copy->base, NULL);
  free(it);
  free(why);
  if (to_drop) {
    pthread_mutex_lock(&x->mu);
    drop_ended_data_locked(x, to_drop);
  }
  return failed || refuse_later ? -1 : 0;
}

int executor_submit(executor_t *x, const Meshd__Agent__V1__Instruction *ins) {
  return submit(x, ins, NULL);
}

int executor_submit_in(executor_t *x, const Meshd__Agent__V1__Instruction *ins,
                       executor_batch_t *b) {
  return submit(x, ins, b);
}

/* ------------------------------------------------------------------ data */

int executor_lookup(executor_t *x, const char *session, uint64_t ref, agent_tensor_t *out,
                    ref_failure_t *why) {
  pthread_mutex_lock(&x->mu);
  xsession_t *s = session_find_locked(x, session);
  int rc = -1;
  if (s) rc = refs_get(&s->state->refs, ref, out, why);
  pthread_mutex_unlock(&x->mu);
  if (rc < 0 && why && s)
    snprintf(why->msg, sizeof why->msg, "ref %llu is not on this agent (session %.8s)",
             (unsigned long long)ref, session);
  else if (rc < 0 && why)
    snprintf(why->msg, sizeof why->msg, "session %.63s is not open on this agent (ref %llu)",
             session, (unsigned long long)ref);
  return rc;
}

int executor_take_snapshot(executor_t *x, const char *session, uint64_t seq, uint64_t ref,
                           snapshot_t **snap, ref_failure_t *why) {
  pthread_mutex_lock(&x->mu);
  xsession_t *s = session_find_locked(x, session);
  int rc = -1;
  if (s) rc = session_state_take_snapshot(s->state, seq, ref, snap, why);
  pthread_mutex_unlock(&x->mu);
  if (!s)
    snprintf(why->msg, sizeof why->msg, "session %.63s is not open on this agent (ref %llu)",
             session, (unsigned long long)ref);
  return rc;
}

int executor_define(executor_t *x, const char *session, uint64_t ref, const agent_tensor_t *t) {
  pthread_mutex_lock(&x->mu);
  xsession_t *s = session_find_locked(x, session);
  int rc = !s ? 1 : refs_put_write(&s->state->refs, ref, t);
  /* Its bytes go out with the next report (within ALLOC_POLL_MS), not one of
   * their own: a Write is no numbered command, nothing waits on a report of
   * it, and a report per Write woke the reporter and sent the server a
   * message (on its one rpc thread) right as the Write answered, on an
   * Upload's way to its answer. */
  x->dirty = true;
  pthread_mutex_unlock(&x->mu);
  return rc;
}

backend_t *executor_backend(executor_t *x) { return x->env.backend; }

bool executor_session_open(executor_t *x, const char *session) {
  pthread_mutex_lock(&x->mu);
  bool open = session_find_locked(x, session) != NULL;
  pthread_mutex_unlock(&x->mu);
  return open;
}

bool executor_wait_open(executor_t *x, const char *session, int timeout_ms) {
  struct timespec dl;
  runtime_deadline(&dl, CLOCK_REALTIME, timeout_ms);
  pthread_mutex_lock(&x->mu);
  int rc = 0;
  bool open;
  while (!(open = session_find_locked(x, session) != NULL) && !x->closing && rc == 0)
    rc = pthread_cond_timedwait(&x->progress, &x->mu, &dl);
  pthread_mutex_unlock(&x->mu);
  return open;
}

bool executor_closing(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  bool closing = x->closing;
  pthread_mutex_unlock(&x->mu);
  return closing;
}

uint64_t executor_received(executor_t *x) {
  pthread_mutex_lock(&x->mu);
  uint64_t last = x->last;
  pthread_mutex_unlock(&x->mu);
  return last;
}

/* ------------------------------------------------------------------ lifecycle */

/* Executors not yet freed, process-wide: the backend outlives them all. */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t live_cv = PTHREAD_COND_INITIALIZER;
static int live_executors;

int executor_wait_all_freed(int timeout_ms) {
  struct timespec dl;
  runtime_deadline(&dl, CLOCK_REALTIME, timeout_ms);
  pthread_mutex_lock(&live_mu);
  int rc = 0;
  while (live_executors > 0 && rc == 0) rc = pthread_cond_timedwait(&live_cv, &live_mu, &dl);
  int left = live_executors;
  pthread_mutex_unlock(&live_mu);
  return left ? -1 : 0;
}

executor_t *executor_create(const run_env_t *env, executor_report_fn report, void *arg) {
  executor_t *x = calloc(1, sizeof *x);
  if (!x) return NULL;
  x->env = *env;
  x->report = report;
  x->arg = arg;
  x->max_workers = MAX_WORKERS;
  atomic_init(&x->refs, 1);
  pthread_mutex_lock(&live_mu);
  live_executors++;
  pthread_mutex_unlock(&live_mu);
  pthread_mutex_init(&x->mu, NULL);
  pthread_cond_init(&x->progress, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&x->report_cv, &ca);
  pthread_condattr_destroy(&ca);
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
    atomic_fetch_sub(&open_sessions, 1);
    session_free(s);
  }
  for (size_t i = 0; i < x->nerrs; i++) {
    free(x->errs[i]->session_id);
    free(x->errs[i]->message);
    free(x->errs[i]);
  }
  free(x->errs);
  free(x->pending.v);
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
  for (idle_worker_t *w = x->idle; w; w = w->next) pthread_cond_signal(&w->cv); /* they end */
  /* Waits between streams stop waiting, in sessions already ended too. */
  for (xsession_t *l = x->live; l; l = l->live_next) session_state_close(l->state);
  /* Off the table, a session's hh.next links it into one of these. */
  xsession_t *s, *tmp, *free_now = NULL, *drop_now = NULL;
  HASH_ITER(hh, x->sessions, s, tmp) {
    xsession_t *f = end_session_locked(x, s, 0);
    if (f) {
      f->hh.next = free_now;
      free_now = f;
    } else {
      s->live_workers++; /* held for drop_ended_data_locked */
      s->hh.next = drop_now;
      drop_now = s;
    }
  }
  pthread_mutex_unlock(&x->mu);
  while (free_now) {
    xsession_t *next = free_now->hh.next;
    session_free(free_now);
    free_now = next;
  }
  while (drop_now) {
    xsession_t *next = drop_now->hh.next;
    pthread_mutex_lock(&x->mu);
    drop_ended_data_locked(x, drop_now);
    drop_now = next;
  }
  executor_unref(x);
}

/* ------------------------------------------------------------------ tests */

void executor_set_max_workers_for_test(executor_t *x, int n) {
  pthread_mutex_lock(&x->mu);
  x->max_workers = n >= 0 ? n : MAX_WORKERS;
  pthread_mutex_unlock(&x->mu);
}

void executor_set_refuser_hold_for_test(executor_t *x, void (*hold)(void *arg, uint64_t seq),
                                        void *arg) {
  pthread_mutex_lock(&x->mu);
  x->refuser_hold = hold;
  x->refuser_hold_arg = arg;
  pthread_mutex_unlock(&x->mu);
}

int executor_wait_stream_idle_for_test(executor_t *x, const char *session, uint64_t stream,
                                       int timeout_ms) {
  struct timespec dl;
  runtime_deadline(&dl, CLOCK_REALTIME, timeout_ms);
  pthread_mutex_lock(&x->mu);
  x->idle_waiters++;
  int rc = 0;
  bool idle;
  for (;;) {
    xsession_t *s = session_find_locked(x, session);
    xstream_t *st = NULL;
    if (s) HASH_FIND(hh, s->streams, &stream, sizeof stream, st);
    idle = st && st->idle && !stream_runnable_locked(st);
    if (idle || x->closing || rc != 0) break;
    rc = pthread_cond_timedwait(&x->progress, &x->mu, &dl);
  }
  x->idle_waiters--;
  pthread_mutex_unlock(&x->mu);
  return idle ? 0 : -1;
}
