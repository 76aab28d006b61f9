/* Flow control accounting (server/flow.h): windows, checkpoints, bounds, waits. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "flow.h"

static int fired;
static void count_fire(void *arg) {
  (void)arg;
  fired++;
}

static flow_t *make(uint64_t session, uint64_t total, uint64_t every) {
  flow_limits_t l = {.session_commands = session, .total_commands = total, .every_commands = every};
  flow_t *f = flow_create(&l);
  cr_assert_not_null(f);
  fired = 0;
  return f;
}

static uint64_t queued(flow_t *f, flow_window_t *w) {
  flow_stats_t st;
  flow_stats(f, w, &st);
  return st.queued_commands;
}

Test(flow, default_checkpoint_interval) {
  flow_t *f = flow_create(&(flow_limits_t){.session_commands = 64});
  cr_assert_eq(flow_limits(f).every_commands, 16, "a quarter of the session bound");
  flow_destroy(f);
  f = flow_create(&(flow_limits_t){.session_commands = 100000});
  cr_assert_eq(flow_limits(f).every_commands, 256, "at most 256");
  flow_destroy(f);
  f = flow_create(&(flow_limits_t){0});
  cr_assert_eq(flow_limits(f).every_commands, 256);
  cr_assert_eq(flow_limits(f).every_bytes, 1 << 20);
  flow_destroy(f);
  f = flow_create(&(flow_limits_t){.session_commands = 2});
  cr_assert_eq(flow_limits(f).every_commands, 1, "never 0");
  flow_destroy(f);
}

Test(flow, checkpoint_due_every_k_commands) {
  flow_t *f = make(0, 0, 4);
  _Atomic uint64_t gauge = 99;
  flow_window_t *w = flow_window_open(f, &gauge);
  cr_assert_eq(atomic_load(&gauge), 0);
  for (int i = 1; i <= 3; i++) cr_assert_eq(flow_accept(w, 10), 0u, "command %d", i);
  cr_assert_eq(flow_accept(w, 10), FLOW_CHECKPOINT);
  cr_assert_eq(atomic_load(&gauge), 4);
  flow_checkpoint_t *cp = flow_checkpoint(w);
  cr_assert_not_null(cp);
  cr_assert_null(flow_checkpoint(w), "nothing new since the mark");
  flow_stats_t st;
  flow_stats(f, NULL, &st);
  cr_assert_eq(st.queued_commands, 4, "a checkpoint puts the commands in the total");
  cr_assert_eq(st.queued_bytes, 40);
  cr_assert_eq(st.pending_checkpoints, 1);
  cr_assert_eq(flow_accept(w, 10), 0u, "the interval restarts at the mark");
  flow_checkpoint_done(cp);
  cr_assert_eq(atomic_load(&gauge), 1, "the command after the mark stays queued");
  flow_stats(f, NULL, &st);
  cr_assert_eq(st.queued_commands, 0, "an uncovered tail is not in the total");
  cr_assert_eq(st.pending_checkpoints, 0);
  flow_window_close(w);
  cr_assert_eq(atomic_load(&gauge), 0);
  flow_destroy(f);
}

Test(flow, bytes_make_a_checkpoint_due) {
  flow_t *f = flow_create(&(flow_limits_t){.every_commands = 100, .every_bytes = 1000});
  flow_window_t *w = flow_window_open(f, NULL);
  cr_assert_eq(flow_accept(w, 600), 0u);
  cr_assert_eq(flow_accept(w, 600), FLOW_CHECKPOINT);
  flow_window_close(w);
  flow_destroy(f);
}

Test(flow, session_bound_waits_until_a_checkpoint_fires) {
  flow_t *f = make(8, 0, 2);
  flow_window_t *w = flow_window_open(f, NULL);
  flow_checkpoint_t *cps[4];
  int n = 0;
  for (int i = 1; i <= 7; i++) {
    unsigned fl = flow_accept(w, 1);
    cr_assert_eq(fl & FLOW_OVER, 0u, "command %d is under the bound", i);
    if (fl & FLOW_CHECKPOINT) cps[n++] = flow_checkpoint(w);
  }
  cr_assert_eq(n, 3);
  unsigned fl = flow_accept(w, 1);
  cr_assert_eq(fl, FLOW_OVER | FLOW_CHECKPOINT, "the 8th reaches the bound");
  cps[n++] = flow_checkpoint(w);
  bool wide = true;
  cr_assert(flow_over(w, &wide));
  cr_assert_not(wide, "over its own bound");
  uint64_t id = flow_wait(w, count_fire, NULL);
  cr_assert_gt(id, 0);
  flow_stats_t st;
  flow_stats(f, NULL, &st);
  cr_assert_eq(st.waits, 1);
  cr_assert_eq(st.waits_total, 1);
  cr_assert_eq(fired, 0);
  flow_checkpoint_done(cps[0]); /* 2 commands ran */
  cr_assert_eq(fired, 1, "room: the wait fired");
  cr_assert_eq(queued(f, w), 6);
  cr_assert_not(flow_over(w, NULL));
  cr_assert_eq(flow_wait(w, count_fire, NULL), 0, "room now: no wait");
  cr_assert_not(flow_cancel(f, id), "a fired wait cannot be cancelled");
  for (int i = 1; i < n; i++) flow_checkpoint_done(cps[i]);
  cr_assert_eq(queued(f, w), 0);
  cr_assert_eq(fired, 1);
  flow_window_close(w);
  flow_destroy(f);
}

Test(flow, over_makes_a_checkpoint_due_for_the_tail) {
  flow_t *f = make(4, 0, 100);
  flow_window_t *w = flow_window_open(f, NULL);
  for (int i = 0; i < 3; i++) cr_assert_eq(flow_accept(w, 1), 0u);
  cr_assert_eq(flow_accept(w, 1), FLOW_OVER | FLOW_CHECKPOINT,
               "a window that is over must be covered, or its wait might never end");
  flow_checkpoint_t *cp = flow_checkpoint(w);
  cr_assert_gt(flow_wait(w, count_fire, NULL), 0);
  flow_checkpoint_done(cp);
  cr_assert_eq(fired, 1);
  cr_assert_eq(queued(f, w), 0);
  flow_window_close(w);
  flow_destroy(f);
}

Test(flow, later_checkpoint_first_covers_the_earlier) {
  flow_t *f = make(0, 0, 4);
  flow_window_t *w = flow_window_open(f, NULL);
  for (int i = 0; i < 4; i++) flow_accept(w, 5);
  flow_checkpoint_t *a = flow_checkpoint(w);
  for (int i = 0; i < 4; i++) flow_accept(w, 5);
  flow_checkpoint_t *b = flow_checkpoint(w);
  flow_stats_t st;
  flow_stats(f, NULL, &st);
  cr_assert_eq(st.queued_commands, 8);
  flow_checkpoint_done(b);
  cr_assert_eq(queued(f, w), 0);
  flow_checkpoint_done(a);
  cr_assert_eq(queued(f, w), 0, "no underflow");
  flow_stats(f, NULL, &st);
  cr_assert_eq(st.queued_commands, 0);
  cr_assert_eq(st.queued_bytes, 0);
  flow_window_close(w);
  flow_destroy(f);
}

Test(flow, total_bound_holds_every_session) {
  flow_t *f = make(0, 10, 6);
  flow_window_t *a = flow_window_open(f, NULL), *b = flow_window_open(f, NULL);
  flow_checkpoint_t *ca = NULL, *cb = NULL;
  for (int i = 0; i < 6; i++)
    if (flow_accept(a, 1) & FLOW_CHECKPOINT) ca = flow_checkpoint(a);
  cr_assert_not_null(ca);
  cr_assert_not(flow_over(a, NULL));
  for (int i = 0; i < 6; i++)
    if (flow_accept(b, 1) & FLOW_CHECKPOINT) cb = flow_checkpoint(b);
  cr_assert_not_null(cb);
  bool wide = false;
  cr_assert(flow_over(a, &wide), "12 queued in total, bound 10: a waits too");
  cr_assert(wide, "a is over the total's bound, not its own");
  cr_assert(flow_over(b, NULL));
  cr_assert_eq(flow_accept(a, 1), FLOW_OVER | FLOW_CHECKPOINT);
  cr_assert_gt(flow_wait(a, count_fire, NULL), 0);
  cr_assert_gt(flow_wait(b, count_fire, NULL), 0);
  flow_checkpoint_t *ca2 = flow_checkpoint(a); /* a's tail of 1 joins the total: 13 */
  flow_checkpoint_done(cb);
  cr_assert_eq(fired, 2, "b ran its 6: 7 in total, both go on");
  flow_checkpoint_done(ca);
  flow_checkpoint_done(ca2);
  flow_window_close(a);
  flow_window_close(b);
  flow_destroy(f);
}

Test(flow, uncovered_tails_never_hold_others) {
  flow_t *f = make(0, 4, 100);
  flow_window_t *a = flow_window_open(f, NULL), *b = flow_window_open(f, NULL);
  for (int i = 0; i < 50; i++) cr_assert_eq(flow_accept(a, 1), 0u);
  cr_assert_not(flow_over(b, NULL), "a's tail has no checkpoint: it is not in the total");
  cr_assert_eq(queued(f, a), 50, "but a counts it");
  flow_window_close(a);
  flow_window_close(b);
  flow_destroy(f);
}

Test(flow, session_bytes_bound) {
  flow_t *f = flow_create(&(flow_limits_t){.session_bytes = 1000, .every_commands = 100});
  flow_window_t *w = flow_window_open(f, NULL);
  cr_assert_eq(flow_accept(w, 600) & FLOW_OVER, 0u);
  cr_assert_eq(flow_accept(w, 600) & FLOW_OVER, FLOW_OVER);
  flow_stats_t st;
  flow_stats(f, w, &st);
  cr_assert_eq(st.queued_bytes, 1200);
  flow_window_close(w);
  flow_destroy(f);
}

Test(flow, close_fires_waits_and_empties_the_queue) {
  flow_t *f = make(2, 0, 1);
  _Atomic uint64_t gauge = 0;
  flow_window_t *w = flow_window_open(f, &gauge);
  flow_accept(w, 1);
  flow_checkpoint_t *c1 = flow_checkpoint(w);
  flow_accept(w, 1);
  flow_checkpoint_t *c2 = flow_checkpoint(w);
  cr_assert_gt(flow_wait(w, count_fire, NULL), 0);
  flow_stats_t st;
  flow_stats(f, NULL, &st);
  cr_assert_eq(st.queued_commands, 2);
  flow_window_close(w);
  cr_assert_eq(fired, 1, "the session ended: its wait goes on");
  cr_assert_eq(atomic_load(&gauge), 0);
  flow_stats(f, NULL, &st);
  cr_assert_eq(st.queued_commands, 0, "its queue left the total");
  cr_assert_eq(st.waits, 0);
  /* Its checkpoints still complete later (the window lives until then). */
  flow_checkpoint_done(c2);
  flow_checkpoint_done(c1);
  flow_stats(f, NULL, &st);
  cr_assert_eq(st.queued_commands, 0);
  cr_assert_eq(st.pending_checkpoints, 0);
  flow_destroy(f);
}

Test(flow, cancel_withdraws_a_wait) {
  flow_t *f = make(1, 0, 1);
  flow_window_t *w = flow_window_open(f, NULL);
  flow_accept(w, 1);
  flow_checkpoint_t *cp = flow_checkpoint(w);
  uint64_t id = flow_wait(w, count_fire, NULL);
  cr_assert_gt(id, 0);
  cr_assert(flow_cancel(f, id));
  cr_assert_not(flow_cancel(f, id), "only once");
  cr_assert_not(flow_cancel(f, 0));
  flow_checkpoint_done(cp);
  cr_assert_eq(fired, 0, "a cancelled wait never fires");
  flow_window_close(w);
  flow_destroy(f);
}

Test(flow, destroy_fires_waits_and_outlives_late_checkpoints) {
  flow_t *f = make(1, 0, 1);
  flow_window_t *w = flow_window_open(f, NULL);
  flow_accept(w, 1);
  flow_checkpoint_t *cp = flow_checkpoint(w);
  cr_assert_gt(flow_wait(w, count_fire, NULL), 0);
  flow_window_close(w); /* the session table goes first at shutdown */
  cr_assert_eq(fired, 1);
  flow_destroy(f);
  /* The watermark, destroyed after the command service, cancels its waits:
   * the checkpoint completes on a destroyed flow, which it then frees. */
  flow_checkpoint_done(cp);
}

Test(flow, destroy_with_an_open_window_fires_its_waits) {
  flow_t *f = make(1, 0, 1);
  flow_window_t *w = flow_window_open(f, NULL);
  flow_accept(w, 1);
  flow_checkpoint_t *cp = flow_checkpoint(w);
  cr_assert_gt(flow_wait(w, count_fire, NULL), 0);
  flow_destroy(f);
  cr_assert_eq(fired, 1);
  flow_checkpoint_done(cp);
  flow_window_close(w); /* the last user frees the flow */
}

/* Many threads accept and checkpoint while another completes checkpoints: in
 * the end nothing is queued and every wait fired. */
typedef struct {
  flow_t *f;
  flow_checkpoint_t *queue[4096];
  int head, tail;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  atomic_int producers, wakes;
} race_t;

static void wake(void *arg) { atomic_fetch_add(&((race_t *)arg)->wakes, 1); }

static void *producer(void *p) {
  race_t *r = p;
  flow_window_t *w = flow_window_open(r->f, NULL);
  for (int i = 0; i < 2000; i++) {
    unsigned fl = flow_accept(w, 3);
    if (fl & FLOW_CHECKPOINT) {
      flow_checkpoint_t *cp = flow_checkpoint(w);
      if (cp) {
        pthread_mutex_lock(&r->mu);
        r->queue[r->tail++ % 4096] = cp;
        pthread_cond_signal(&r->cv);
        pthread_mutex_unlock(&r->mu);
      }
    }
    if (fl & FLOW_OVER) {
      if (flow_wait(w, wake, r)) {
        while (flow_over(w, NULL)) sched_yield(); /* a real caller returns; this one spins */
      }
    }
  }
  /* A last checkpoint covers the tail. */
  flow_checkpoint_t *cp = flow_checkpoint(w);
  pthread_mutex_lock(&r->mu);
  if (cp) r->queue[r->tail++ % 4096] = cp;
  r->producers--;
  pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
  return w;
}

static void *completer(void *p) {
  race_t *r = p;
  pthread_mutex_lock(&r->mu);
  for (;;) {
    while (r->head == r->tail && r->producers > 0) pthread_cond_wait(&r->cv, &r->mu);
    if (r->head == r->tail) break;
    flow_checkpoint_t *cp = r->queue[r->head++ % 4096];
    pthread_mutex_unlock(&r->mu);
    flow_checkpoint_done(cp);
    pthread_mutex_lock(&r->mu);
  }
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

Test(flow, concurrent_accepts_and_completions) {
  race_t *r = calloc(1, sizeof *r);
  r->f = make(64, 128, 8);
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  r->producers = 4;
  pthread_t prod[4], comp;
  pthread_create(&comp, NULL, completer, r);
  for (int i = 0; i < 4; i++) pthread_create(&prod[i], NULL, producer, r);
  flow_window_t *w[4];
  for (int i = 0; i < 4; i++) pthread_join(prod[i], (void **)&w[i]);
  pthread_join(comp, NULL);
  flow_stats_t st;
  flow_stats(r->f, NULL, &st);
  cr_assert_eq(st.queued_commands, 0);
  cr_assert_eq(st.queued_bytes, 0);
  cr_assert_eq(st.pending_checkpoints, 0);
  cr_assert_eq(st.waits, 0);
  cr_assert_eq((uint64_t)atomic_load(&r->wakes), st.waits_total, "every wait fired once");
  for (int i = 0; i < 4; i++) {
    cr_assert_eq(queued(r->f, w[i]), 0);
    flow_window_close(w[i]);
  }
  flow_destroy(r->f);
  free(r);
}
