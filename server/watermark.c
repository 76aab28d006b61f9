#include "watermark.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

#include "log.h"

typedef struct wait wait_t;

/* One target of a wait, linked into its rank's pending list. */
typedef struct node {
  struct node *prev, *next;
  wait_t *w;
  uint32_t rank;
  uint64_t seq;
  bool linked;
} node_t;

#define SESSION_KEY_MAX 64

struct wait {
  wait_t *prev, *next; /* every pending wait, for cancel and destroy */
  uint64_t id;
  char session[SESSION_KEY_MAX]; /* "": every session */
  watermark_fn cb;
  void *arg;
  size_t remaining; /* targets not yet executed */
  size_t n;
  watermark_result_t result;  /* set when it leaves the pending lists */
  uint32_t lost_rank;
  wait_t *fire_next;
  node_t nodes[];
};

typedef struct range {
  uint64_t lo, hi; /* inclusive */
} range_t;

/* What the last report said of one session on a rank. */
typedef struct sess_prog {
  char session[SESSION_KEY_MAX];
  uint64_t through;
  UT_hash_handle hh;
} sess_prog_t;

typedef struct rank_state {
  uint64_t executed;
  uint64_t received; /* 0: no per-session progress */
  sess_prog_t *prog; /* sessions behind `received`, by id */
  node_t *head, *tail; /* pending targets, in registration order */
  range_t *lost;       /* one per link that broke with work in flight */
  size_t nlost, caplost;
} rank_state_t;

struct watermark {
  pthread_mutex_t mu;
  rank_state_t *ranks;
  size_t cap;
  wait_t *waits; /* pending */
  size_t npending;
  uint64_t next_id;
  watermark_kick_fn kick; /* set once, before any wait */
  void *kick_arg;
};

void watermark_set_kick(watermark_t *w, watermark_kick_fn fn, void *arg) {
  w->kick = fn;
  w->kick_arg = arg;
}

watermark_t *watermark_create(void) {
  watermark_t *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  pthread_mutex_init(&w->mu, NULL);
  w->next_id = 1;
  return w;
}

static bool grow_locked(watermark_t *w, uint32_t rank) {
  if (rank < w->cap) return true;
  size_t cap = w->cap ? w->cap : 8;
  while (cap <= rank) cap *= 2;
  rank_state_t *r = realloc(w->ranks, cap * sizeof *r);
  if (!r) return false;
  memset(r + w->cap, 0, (cap - w->cap) * sizeof *r);
  w->ranks = r;
  w->cap = cap;
  return true;
}

static bool in_lost(const rank_state_t *r, uint64_t seq) {
  for (size_t i = 0; i < r->nlost; i++)
    if (seq >= r->lost[i].lo && seq <= r->lost[i].hi) return true;
  return false;
}

/* Whether seq ran on the rank, for a wait of `session` ("" : all sessions). */
static bool reached(const rank_state_t *r, const char *session, uint64_t seq) {
  if (seq <= r->executed) return true;
  if (!session[0] || !r->received) return false;
  sess_prog_t *sp = NULL;
  HASH_FIND_STR(r->prog, session, sp);
  return seq <= (sp ? sp->through : r->received);
}

static void unlink_node(rank_state_t *r, node_t *n) {
  if (!n->linked) return;
  if (n->prev) n->prev->next = n->next;
  else r->head = n->next;
  if (n->next) n->next->prev = n->prev;
  else r->tail = n->prev;
  n->prev = n->next = NULL;
  n->linked = false;
}

/* Takes a pending wait out of every list; the caller fires or frees it. */
static void retire_locked(watermark_t *w, wait_t *wt) {
  for (size_t i = 0; i < wt->n; i++) unlink_node(&w->ranks[wt->nodes[i].rank], &wt->nodes[i]);
  if (wt->prev) wt->prev->next = wt->next;
  else w->waits = wt->next;
  if (wt->next) wt->next->prev = wt->prev;
  wt->prev = wt->next = NULL;
  w->npending--;
}

/* Callbacks run after the lock is dropped, in the order the waits retired. */
static void fire(wait_t *list) {
  while (list) {
    wait_t *next = list->fire_next;
    list->cb(list->result, list->lost_rank, list->arg);
    free(list);
    list = next;
  }
}

static void push_fire(wait_t **head, wait_t **tail, wait_t *wt) {
  wt->fire_next = NULL;
  if (*tail) (*tail)->fire_next = wt;
  else *head = wt;
  *tail = wt;
}

void watermark_destroy(watermark_t *w) {
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  wait_t *head = NULL, *tail = NULL;
  while (w->waits) {
    wait_t *wt = w->waits;
    retire_locked(w, wt);
    wt->result = WATERMARK_CANCELLED;
    push_fire(&head, &tail, wt);
  }
  pthread_mutex_unlock(&w->mu);
  fire(head);
  for (size_t i = 0; i < w->cap; i++) {
    free(w->ranks[i].lost);
    sess_prog_t *sp, *tmp;
    HASH_ITER(hh, w->ranks[i].prog, sp, tmp) {
      HASH_DEL(w->ranks[i].prog, sp);
      free(sp);
    }
  }
  free(w->ranks);
  pthread_mutex_destroy(&w->mu);
  free(w);
}

watermark_result_t watermark_wait(watermark_t *w, const watermark_target_t *targets, size_t n,
                                  watermark_fn cb, void *arg, uint64_t *id, uint32_t *lost_rank) {
  return watermark_wait_session(w, NULL, targets, n, cb, arg, id, lost_rank);
}

watermark_result_t watermark_wait_session(watermark_t *w, const char *session,
                                          const watermark_target_t *targets, size_t n,
                                          watermark_fn cb, void *arg, uint64_t *id,
                                          uint32_t *lost_rank) {
  if (id) *id = 0;
  wait_t *wt = calloc(1, sizeof *wt + n * sizeof wt->nodes[0]);
  if (!wt) {
    log_error("watermark", "out of memory registering a wait on %zu rank(s)", n);
    return WATERMARK_CANCELLED;
  }
  snprintf(wt->session, sizeof wt->session, "%s", session ? session : "");
  watermark_result_t res = WATERMARK_REACHED;
  pthread_mutex_lock(&w->mu);
  /* Decide first, link after: a wait that is already decided touches no list. */
  for (size_t i = 0; i < n; i++) {
    const watermark_target_t *t = &targets[i];
    if (t->seq == 0) continue;
    if (!grow_locked(w, t->rank)) {
      res = WATERMARK_CANCELLED;
      break;
    }
    rank_state_t *r = &w->ranks[t->rank];
    /* Lost first: a newer link's progress says nothing of the seqs of an
     * older one that broke before running them. */
    if (in_lost(r, t->seq)) {
      res = WATERMARK_LOST;
      if (lost_rank) *lost_rank = t->rank;
      break;
    }
    if (!reached(r, wt->session, t->seq)) {
      node_t *nd = &wt->nodes[wt->n++];
      nd->w = wt;
      nd->rank = t->rank;
      nd->seq = t->seq;
      res = WATERMARK_PENDING;
    }
  }
  if (res == WATERMARK_PENDING) {
    for (size_t i = 0; i < wt->n; i++) {
      node_t *nd = &wt->nodes[i];
      rank_state_t *r = &w->ranks[nd->rank];
      nd->prev = r->tail;
      if (r->tail) r->tail->next = nd;
      else r->head = nd;
      r->tail = nd;
      nd->linked = true;
    }
    wt->remaining = wt->n;
    wt->cb = cb;
    wt->arg = arg;
    wt->id = w->next_id++;
    wt->next = w->waits;
    if (w->waits) w->waits->prev = wt;
    w->waits = wt;
    w->npending++;
    if (id) *id = wt->id;
  }
  pthread_mutex_unlock(&w->mu);
  if (res != WATERMARK_PENDING) {
    free(wt);
    return res;
  }
  /* wt may be gone already: the targets are the caller's. */
  for (size_t i = 0; w->kick && i < n; i++)
    if (targets[i].seq) w->kick(targets[i].rank, w->kick_arg);
  return res;
}

bool watermark_cancel(watermark_t *w, uint64_t id) {
  if (id == 0) return false;
  pthread_mutex_lock(&w->mu);
  wait_t *wt = w->waits;
  while (wt && wt->id != id) wt = wt->next;
  if (wt) retire_locked(w, wt);
  pthread_mutex_unlock(&w->mu);
  free(wt);
  return wt != NULL;
}

void watermark_advance(watermark_t *w, uint32_t rank, uint64_t executed) {
  watermark_progress(w, rank, executed, 0, NULL, 0);
}

void watermark_progress(watermark_t *w, uint32_t rank, uint64_t executed, uint64_t received,
                        const watermark_session_t *sessions, size_t n) {
  wait_t *head = NULL, *tail = NULL;
  pthread_mutex_lock(&w->mu);
  if (!grow_locked(w, rank)) goto out;
  rank_state_t *r = &w->ranks[rank];
  bool moved = executed > r->executed;
  if (moved) r->executed = executed;
  if (received) {
    /* The report replaces what the last one said of the sessions. */
    sess_prog_t *sp, *tmp;
    HASH_ITER(hh, r->prog, sp, tmp) {
      HASH_DEL(r->prog, sp);
      free(sp);
    }
    for (size_t i = 0; i < n; i++) {
      if (!sessions[i].session || sessions[i].through >= received) continue;
      sp = calloc(1, sizeof *sp);
      if (!sp) { /* without it the session waits for the slowest: still correct */
        received = 0;
        break;
      }
      snprintf(sp->session, sizeof sp->session, "%s", sessions[i].session);
      sp->through = sessions[i].through;
      HASH_ADD_STR(r->prog, session, sp);
    }
    /* A session leaving the list moves on even when `received` stays. */
    moved = true;
    r->received = received;
  }
  if (moved) {
    for (node_t *nd = r->head, *next; nd; nd = next) {
      next = nd->next;
      if (!reached(r, nd->w->session, nd->seq)) continue;
      unlink_node(r, nd);
      wait_t *wt = nd->w;
      if (--wt->remaining > 0) continue;
      retire_locked(w, wt);
      wt->result = WATERMARK_REACHED;
      push_fire(&head, &tail, wt);
    }
  }
out:
  pthread_mutex_unlock(&w->mu);
  fire(head);
}

size_t watermark_lost_ranges(watermark_t *w, uint32_t rank) {
  pthread_mutex_lock(&w->mu);
  size_t n = rank < w->cap ? w->ranks[rank].nlost : 0;
  pthread_mutex_unlock(&w->mu);
  return n;
}

void watermark_lost(watermark_t *w, uint32_t rank, uint64_t executed, uint64_t last_seq) {
  wait_t *head = NULL, *tail = NULL;
  pthread_mutex_lock(&w->mu);
  if (!grow_locked(w, rank) || last_seq <= executed) goto out;
  rank_state_t *r = &w->ranks[rank];
  range_t *prev = r->nlost ? &r->lost[r->nlost - 1] : NULL;
  /* Joins the last range when they touch (an agent that crash-loops on its
   * own work loses run after run with nothing executed between): the list,
   * which every wait scans, stays short. */
  bool merged = prev && executed + 1 <= prev->hi + 1 && last_seq + 1 >= prev->lo;
  if (merged) {
    if (executed + 1 < prev->lo) prev->lo = executed + 1;
    if (last_seq > prev->hi) prev->hi = last_seq;
  } else if (r->nlost == r->caplost) {
    size_t cap = r->caplost ? r->caplost * 2 : 4;
    range_t *l = realloc(r->lost, cap * sizeof *l);
    if (!l) {
      /* Without the record a later wait on these seqs would hang; fail loudly. */
      log_error("watermark", "out of memory recording rank %u's lost seqs %llu..%llu", rank,
                (unsigned long long)executed + 1, (unsigned long long)last_seq);
    } else {
      r->lost = l;
      r->caplost = cap;
    }
  }
  if (!merged && r->nlost < r->caplost) r->lost[r->nlost++] = (range_t){executed + 1, last_seq};
  /* Targets above last_seq belong to a newer link on this rank: they stay. */
  for (node_t *nd = r->head, *next; nd; nd = next) {
    next = nd->next;
    if (nd->seq <= executed || nd->seq > last_seq) continue;
    wait_t *wt = nd->w;
    /* retire_locked may unlink `next` if it belongs to the same wait. */
    while (next && next->w == wt) next = next->next;
    retire_locked(w, wt);
    wt->result = WATERMARK_LOST;
    wt->lost_rank = rank;
    push_fire(&head, &tail, wt);
  }
out:
  pthread_mutex_unlock(&w->mu);
  fire(head);
}

bool watermark_reached(watermark_t *w, uint32_t rank, const char *session, uint64_t seq) {
  if (seq == 0) return true;
  pthread_mutex_lock(&w->mu);
  bool ok = false;
  if (rank < w->cap) {
    const rank_state_t *r = &w->ranks[rank];
    ok = !in_lost(r, seq) && reached(r, session ? session : "", seq);
  }
  pthread_mutex_unlock(&w->mu);
  return ok;
}

uint64_t watermark_executed(watermark_t *w, uint32_t rank) {
  pthread_mutex_lock(&w->mu);
  uint64_t e = rank < w->cap ? w->ranks[rank].executed : 0;
  pthread_mutex_unlock(&w->mu);
  return e;
}

size_t watermark_pending(watermark_t *w) {
  pthread_mutex_lock(&w->mu);
  size_t n = w->npending;
  pthread_mutex_unlock(&w->mu);
  return n;
}
