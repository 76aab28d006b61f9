#include "flow.h"

#include <pthread.h>
#include <stdlib.h>

/* Counts are cumulative per window: accepted >= marked >= done. The window's
 * queue is accepted - done; its share of the total is marked - done. */
typedef struct amount {
  uint64_t commands, bytes;
} amount_t;

struct flow_window {
  flow_t *f;
  amount_t accepted, marked, done;
  _Atomic uint64_t *gauge;
  int refs; /* the owner until close, + pending checkpoints */
  bool closed;
};

struct flow_checkpoint {
  flow_window_t *w;
  amount_t mark;
};

typedef struct waiter {
  struct waiter *prev, *next;
  struct waiter *fire_next;
  uint64_t id;
  flow_window_t *w;
  flow_fn cb;
  void *arg;
} waiter_t;

struct flow {
  pthread_mutex_t mu;
  flow_limits_t lim;
  amount_t total; /* sum over windows of marked - done */
  uint64_t windows; /* not yet freed */
  uint64_t checkpoints;
  waiter_t *waiters;
  uint64_t nwaiters, waits_total, next_id;
  bool destroyed; /* freed with its last window */
};

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

flow_t *flow_create(const flow_limits_t *limits) {
  flow_t *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  pthread_mutex_init(&f->mu, NULL);
  f->lim = *limits;
  if (!f->lim.every_commands)
    f->lim.every_commands = f->lim.session_commands ? min_u64(256, f->lim.session_commands / 4) : 256;
  if (!f->lim.every_commands) f->lim.every_commands = 1;
  if (!f->lim.every_bytes)
    f->lim.every_bytes = f->lim.session_bytes ? min_u64(1 << 20, f->lim.session_bytes / 4) : 1 << 20;
  if (!f->lim.every_bytes) f->lim.every_bytes = 1;
  f->next_id = 1;
  return f;
}

flow_limits_t flow_limits(const flow_t *f) { return f->lim; }

static void flow_free(flow_t *f) {
  pthread_mutex_destroy(&f->mu);
  free(f);
}

static uint64_t queued(const flow_window_t *w) { return w->accepted.commands - w->done.commands; }

static void update_gauge(flow_window_t *w) {
  if (w->gauge) atomic_store(w->gauge, queued(w));
}

static bool session_over_locked(const flow_t *f, const flow_window_t *w) {
  const flow_limits_t *l = &f->lim;
  return (l->session_commands && queued(w) >= l->session_commands) ||
         (l->session_bytes && w->accepted.bytes - w->done.bytes >= l->session_bytes);
}

static bool total_over_locked(const flow_t *f) {
  const flow_limits_t *l = &f->lim;
  return (l->total_commands && f->total.commands >= l->total_commands) ||
         (l->total_bytes && f->total.bytes >= l->total_bytes);
}

static bool over_locked(const flow_t *f, const flow_window_t *w) {
  if (w->closed || f->destroyed) return false;
  return session_over_locked(f, w) || total_over_locked(f);
}

static void unlink_waiter(flow_t *f, waiter_t *wt) {
  if (wt->prev) wt->prev->next = wt->next;
  else f->waiters = wt->next;
  if (wt->next) wt->next->prev = wt->prev;
  wt->prev = wt->next = NULL;
  f->nwaiters--;
}

/* Takes every wait that may go now out of the list (all when `all`). */
static waiter_t *collect_locked(flow_t *f, bool all) {
  waiter_t *head = NULL, **tail = &head;
  for (waiter_t *wt = f->waiters, *next; wt; wt = next) {
    next = wt->next;
    if (!all && over_locked(f, wt->w)) continue;
    unlink_waiter(f, wt);
    wt->fire_next = NULL;
    *tail = wt;
    tail = &wt->fire_next;
  }
  return head;
}

static void fire(waiter_t *list) {
  while (list) {
    waiter_t *next = list->fire_next;
    list->cb(list->arg);
    free(list);
    list = next;
  }
}

/* Drops one reference to w; frees it (and a destroyed flow with its last
 * window) when none is left. Returns true if the flow itself must be freed. */
static bool window_unref_locked(flow_window_t *w) {
  if (--w->refs > 0) return false;
  flow_t *f = w->f;
  free(w);
  return --f->windows == 0 && f->destroyed;
}

void flow_destroy(flow_t *f) {
  if (!f) return;
  pthread_mutex_lock(&f->mu);
  f->destroyed = true;
  waiter_t *list = collect_locked(f, true);
  bool free_now = f->windows == 0;
  pthread_mutex_unlock(&f->mu);
  fire(list);
  if (free_now) flow_free(f);
}

flow_window_t *flow_window_open(flow_t *f, _Atomic uint64_t *gauge) {
  flow_window_t *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  w->f = f;
  w->gauge = gauge;
  w->refs = 1;
  if (gauge) atomic_store(gauge, 0);
  pthread_mutex_lock(&f->mu);
  f->windows++;
  pthread_mutex_unlock(&f->mu);
  return w;
}

void flow_window_close(flow_window_t *w) {
  if (!w) return;
  flow_t *f = w->f;
  pthread_mutex_lock(&f->mu);
  f->total.commands -= w->marked.commands - w->done.commands;
  f->total.bytes -= w->marked.bytes - w->done.bytes;
  w->marked = w->done = w->accepted;
  w->closed = true;
  update_gauge(w);
  w->gauge = NULL; /* the owner's counter may go with it */
  /* Its own waits go (a closed window is never over), and the total went down. */
  waiter_t *list = collect_locked(f, false);
  bool free_flow = window_unref_locked(w);
  pthread_mutex_unlock(&f->mu);
  fire(list);
  if (free_flow) flow_free(f);
}

unsigned flow_accept(flow_window_t *w, uint64_t bytes) {
  flow_t *f = w->f;
  pthread_mutex_lock(&f->mu);
  w->accepted.commands++;
  w->accepted.bytes += bytes;
  update_gauge(w);
  bool over = over_locked(f, w);
  /* Over: every queued command must be under a checkpoint, or the wait for
   * room might never end. */
  bool due = w->accepted.commands - w->marked.commands >= f->lim.every_commands ||
             w->accepted.bytes - w->marked.bytes >= f->lim.every_bytes || over;
  pthread_mutex_unlock(&f->mu);
  return (due ? FLOW_CHECKPOINT : 0u) | (over ? FLOW_OVER : 0u);
}

flow_checkpoint_t *flow_checkpoint(flow_window_t *w) {
  flow_t *f = w->f;
  flow_checkpoint_t *cp = malloc(sizeof *cp);
  if (!cp) return NULL;
  pthread_mutex_lock(&f->mu);
  if (w->closed || w->accepted.commands == w->marked.commands) {
    pthread_mutex_unlock(&f->mu);
    free(cp);
    return NULL;
  }
  f->total.commands += w->accepted.commands - w->marked.commands;
  f->total.bytes += w->accepted.bytes - w->marked.bytes;
  w->marked = w->accepted;
  cp->w = w;
  cp->mark = w->marked;
  w->refs++;
  f->checkpoints++;
  pthread_mutex_unlock(&f->mu);
  return cp;
}

void flow_checkpoint_done(flow_checkpoint_t *cp) {
  flow_window_t *w = cp->w;
  flow_t *f = w->f;
  pthread_mutex_lock(&f->mu);
  f->checkpoints--;
  /* A later mark may have completed first; after close done == accepted. */
  if (cp->mark.commands > w->done.commands) {
    f->total.commands -= cp->mark.commands - w->done.commands;
    f->total.bytes -= cp->mark.bytes - w->done.bytes;
    w->done = cp->mark;
    update_gauge(w);
  }
  waiter_t *list = f->nwaiters ? collect_locked(f, false) : NULL;
  bool free_flow = window_unref_locked(w);
  pthread_mutex_unlock(&f->mu);
  free(cp);
  fire(list);
  if (free_flow) flow_free(f);
}

bool flow_over(flow_window_t *w, bool *server_wide) {
  flow_t *f = w->f;
  pthread_mutex_lock(&f->mu);
  bool over = over_locked(f, w);
  if (server_wide) *server_wide = over && !session_over_locked(f, w);
  pthread_mutex_unlock(&f->mu);
  return over;
}

uint64_t flow_wait(flow_window_t *w, flow_fn cb, void *arg) {
  flow_t *f = w->f;
  waiter_t *wt = calloc(1, sizeof *wt);
  pthread_mutex_lock(&f->mu);
  uint64_t id = 0;
  /* Out of memory: do not wait. The bound is then passed by one command,
   * which beats a stream that never resumes. */
  if (wt && over_locked(f, w)) {
    wt->id = id = f->next_id++;
    wt->w = w;
    wt->cb = cb;
    wt->arg = arg;
    wt->next = f->waiters;
    if (f->waiters) f->waiters->prev = wt;
    f->waiters = wt;
    f->nwaiters++;
    f->waits_total++;
  }
  pthread_mutex_unlock(&f->mu);
  if (!id) free(wt);
  return id;
}

bool flow_cancel(flow_t *f, uint64_t id) {
  if (!id) return false;
  pthread_mutex_lock(&f->mu);
  waiter_t *wt = f->waiters;
  while (wt && wt->id != id) wt = wt->next;
  if (wt) unlink_waiter(f, wt);
  pthread_mutex_unlock(&f->mu);
  free(wt);
  return wt != NULL;
}

void flow_stats(flow_t *f, flow_window_t *w, flow_stats_t *out) {
  pthread_mutex_lock(&f->mu);
  *out = (flow_stats_t){.pending_checkpoints = f->checkpoints, .waits = f->nwaiters,
                        .waits_total = f->waits_total};
  if (w) {
    out->queued_commands = queued(w);
    out->queued_bytes = w->accepted.bytes - w->done.bytes;
  } else {
    out->queued_commands = f->total.commands;
    out->queued_bytes = f->total.bytes;
  }
  pthread_mutex_unlock(&f->mu);
}
