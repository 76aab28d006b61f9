/* server/watermark.c: waits on (rank, seq) targets, fed by advance/lost. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>

#include "watermark.h"

typedef struct fired {
  int calls;
  watermark_result_t result;
  uint32_t lost_rank;
} fired_t;

static void on_fire(watermark_result_t result, uint32_t lost_rank, void *arg) {
  fired_t *f = arg;
  f->calls++;
  f->result = result;
  f->lost_rank = lost_rank;
}

static watermark_t *w;

static void setup(void) { w = watermark_create(); }
static void teardown(void) { watermark_destroy(w); }

TestSuite(watermark, .init = setup, .fini = teardown, .timeout = 10);

Test(watermark, reached_now_does_not_call_back) {
  watermark_advance(w, 0, 10);
  watermark_advance(w, 3, 5);
  fired_t f = {0};
  watermark_target_t t[] = {{0, 10}, {3, 4}, {7, 0}};
  uint64_t id = 99;
  cr_assert_eq(watermark_wait(w, t, 3, on_fire, &f, &id, NULL), WATERMARK_REACHED);
  cr_assert_eq(id, 0);
  cr_assert_eq(watermark_wait(w, NULL, 0, on_fire, &f, NULL, NULL), WATERMARK_REACHED);
  cr_assert_eq(f.calls, 0);
  cr_assert_eq(watermark_pending(w), 0);
}

Test(watermark, fires_when_every_rank_is_through) {
  fired_t f = {0};
  watermark_target_t t[] = {{0, 5}, {1, 7}, {0, 3}};
  uint64_t id = 0;
  cr_assert_eq(watermark_wait(w, t, 3, on_fire, &f, &id, NULL), WATERMARK_PENDING);
  cr_assert_neq(id, 0);
  watermark_advance(w, 0, 4);
  watermark_advance(w, 1, 7);
  cr_assert_eq(f.calls, 0, "rank 0 is only through 4");
  watermark_advance(w, 0, 3); /* lower values are ignored */
  cr_assert_eq(watermark_executed(w, 0), 4);
  watermark_advance(w, 0, 9);
  cr_assert_eq(f.calls, 1);
  cr_assert_eq(f.result, WATERMARK_REACHED);
  cr_assert_eq(watermark_pending(w), 0);
  cr_assert_not(watermark_cancel(w, id), "a fired wait cannot be cancelled");
  watermark_advance(w, 0, 20);
  cr_assert_eq(f.calls, 1, "fires once");
}

Test(watermark, cancel_before_fire) {
  fired_t f = {0};
  watermark_target_t t[] = {{2, 5}};
  uint64_t id;
  cr_assert_eq(watermark_wait(w, t, 1, on_fire, &f, &id, NULL), WATERMARK_PENDING);
  cr_assert(watermark_cancel(w, id));
  cr_assert_not(watermark_cancel(w, id));
  watermark_advance(w, 2, 10);
  cr_assert_eq(f.calls, 0);
}

/* An agent that crash-loops on its own work: each link is lost with nothing
 * executed, and the next starts where the last one's seqs ended. The ranges
 * join (one, not 1000), and every seq of them still fails a wait; a seq in
 * no lost run (executed before) still succeeds. */
Test(watermark, adjacent_losses_share_one_range) {
  watermark_advance(w, 3, 10);
  for (uint64_t k = 0; k < 1000; k++) watermark_lost(w, 3, 10 + 5 * k, 10 + 5 * (k + 1));
  cr_assert_eq(watermark_lost_ranges(w, 3), 1);
  fired_t f = {0};
  for (uint64_t seq = 11; seq <= 5010; seq += 499) {
    watermark_target_t t[] = {{3, seq}};
    cr_assert_eq(watermark_wait(w, t, 1, on_fire, &f, NULL, NULL), WATERMARK_LOST, "seq %llu",
                 (unsigned long long)seq);
  }
  watermark_target_t done[] = {{3, 10}};
  cr_assert_eq(watermark_wait(w, done, 1, on_fire, &f, NULL, NULL), WATERMARK_REACHED);
  /* A link that executed some of its run before it was lost: a new range. */
  watermark_advance(w, 3, 5100);
  watermark_lost(w, 3, 5100, 5200);
  cr_assert_eq(watermark_lost_ranges(w, 3), 2);
  watermark_target_t between[] = {{3, 5050}};
  cr_assert_eq(watermark_wait(w, between, 1, on_fire, &f, NULL, NULL), WATERMARK_REACHED);
}

Test(watermark, lost_fails_pending_in_range_only) {
  watermark_advance(w, 0, 10);
  fired_t in_range = {0}, newer = {0}, other = {0};
  watermark_target_t a[] = {{1, 1}, {0, 15}};
  watermark_target_t b[] = {{0, 25}}; /* beyond the lost link: a newer link's seq */
  watermark_target_t c[] = {{1, 3}};
  cr_assert_eq(watermark_wait(w, a, 2, on_fire, &in_range, NULL, NULL), WATERMARK_PENDING);
  cr_assert_eq(watermark_wait(w, b, 1, on_fire, &newer, NULL, NULL), WATERMARK_PENDING);
  cr_assert_eq(watermark_wait(w, c, 1, on_fire, &other, NULL, NULL), WATERMARK_PENDING);
  watermark_lost(w, 0, 10, 20);
  cr_assert_eq(in_range.calls, 1);
  cr_assert_eq(in_range.result, WATERMARK_LOST);
  cr_assert_eq(in_range.lost_rank, 0);
  cr_assert_eq(newer.calls, 0);
  cr_assert_eq(other.calls, 0);
  cr_assert_eq(watermark_pending(w), 2);

  /* Later waits on lost seqs fail at once; executed ones still succeed. */
  uint32_t lost_rank = 99;
  watermark_target_t d[] = {{1, 0}, {0, 11}};
  cr_assert_eq(watermark_wait(w, d, 2, on_fire, &other, NULL, &lost_rank), WATERMARK_LOST);
  cr_assert_eq(lost_rank, 0);
  watermark_target_t e[] = {{0, 10}};
  cr_assert_eq(watermark_wait(w, e, 1, on_fire, &other, NULL, NULL), WATERMARK_REACHED);

  /* The next link on rank 0 starts at 21 and reaches 25. */
  watermark_advance(w, 0, 25);
  cr_assert_eq(newer.calls, 1);
  cr_assert_eq(newer.result, WATERMARK_REACHED);
  cr_assert_eq(watermark_wait(w, d, 2, on_fire, &other, NULL, NULL), WATERMARK_LOST,
               "seq 11 stays lost even though rank 0 is now through 25");
  cr_assert_eq(other.calls, 0);
}

Test(watermark, lost_with_nothing_in_flight_records_nothing) {
  watermark_advance(w, 4, 8);
  watermark_lost(w, 4, 8, 8);
  fired_t f = {0};
  watermark_target_t t[] = {{4, 9}};
  cr_assert_eq(watermark_wait(w, t, 1, on_fire, &f, NULL, NULL), WATERMARK_PENDING);
  watermark_advance(w, 4, 9);
  cr_assert_eq(f.calls, 1);
  cr_assert_eq(f.result, WATERMARK_REACHED);
}

/* A wait with several targets on the lost rank, interleaved with another
 * wait's targets in that rank's list, is retired once and cleanly. */
Test(watermark, lost_interleaved_targets) {
  fired_t f1 = {0}, f2 = {0};
  watermark_target_t t1[] = {{0, 3}, {0, 5}};
  watermark_target_t t2[] = {{0, 4}};
  watermark_target_t t3[] = {{0, 6}, {1, 1}};
  cr_assert_eq(watermark_wait(w, t1, 2, on_fire, &f1, NULL, NULL), WATERMARK_PENDING);
  cr_assert_eq(watermark_wait(w, t2, 1, on_fire, &f2, NULL, NULL), WATERMARK_PENDING);
  cr_assert_eq(watermark_wait(w, t3, 2, on_fire, &f1, NULL, NULL), WATERMARK_PENDING);
  watermark_lost(w, 0, 0, 10);
  cr_assert_eq(f1.calls, 2);
  cr_assert_eq(f2.calls, 1);
  cr_assert_eq(watermark_pending(w), 0);
}

static void refire(watermark_result_t result, uint32_t lost_rank, void *arg) {
  fired_t *f = arg;
  f->calls++;
  /* Callbacks run without the lock: registering from one must work. */
  watermark_target_t t[] = {{0, 100}};
  cr_assert_eq(watermark_wait(w, t, 1, on_fire, f + 1, NULL, NULL), WATERMARK_PENDING);
}

Test(watermark, callback_may_reenter) {
  fired_t f[2] = {{0}, {0}};
  watermark_target_t t[] = {{0, 1}};
  cr_assert_eq(watermark_wait(w, t, 1, refire, f, NULL, NULL), WATERMARK_PENDING);
  watermark_advance(w, 0, 1);
  cr_assert_eq(f[0].calls, 1);
  cr_assert_eq(watermark_pending(w), 1);
  watermark_advance(w, 0, 100);
  cr_assert_eq(f[1].calls, 1);
}

static fired_t destroyed;
Test(watermark, destroy_cancels_pending) {
  watermark_t *w2 = watermark_create();
  watermark_target_t t[] = {{9, 1}};
  cr_assert_eq(watermark_wait(w2, t, 1, on_fire, &destroyed, NULL, NULL), WATERMARK_PENDING);
  watermark_destroy(w2);
  cr_assert_eq(destroyed.calls, 1);
  cr_assert_eq(destroyed.result, WATERMARK_CANCELLED);
}

/* Many threads advancing ranks while others wait: every wait fires once. */
#define NTHREADS 4
#define NWAITS 2000
static int fired_count[NWAITS];
static void count_fire(watermark_result_t result, uint32_t lost_rank, void *arg) {
  int i = (int)(intptr_t)arg;
  cr_assert_eq(result, WATERMARK_REACHED);
  __atomic_add_fetch(&fired_count[i], 1, __ATOMIC_SEQ_CST);
}
static void *advancer(void *arg) {
  uint32_t rank = (uint32_t)(intptr_t)arg;
  for (uint64_t s = 1; s <= NWAITS; s++) watermark_advance(w, rank, s);
  return NULL;
}
Test(watermark, concurrent) {
  pthread_t th[NTHREADS];
  for (int i = 0; i < NTHREADS; i++)
    pthread_create(&th[i], NULL, advancer, (void *)(intptr_t)i);
  for (int i = 0; i < NWAITS; i++) {
    watermark_target_t t[NTHREADS];
    for (int r = 0; r < NTHREADS; r++) t[r] = (watermark_target_t){(uint32_t)r, (uint64_t)i + 1};
    watermark_result_t res =
        watermark_wait(w, t, NTHREADS, count_fire, (void *)(intptr_t)i, NULL, NULL);
    if (res == WATERMARK_REACHED) fired_count[i]++;
    else cr_assert_eq(res, WATERMARK_PENDING);
  }
  for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < NWAITS; i++)
    cr_assert_eq(fired_count[i], 1, "wait %d fired %d times", i, fired_count[i]);
  cr_assert_eq(watermark_pending(w), 0);
}

/* Per-session progress (agents list the sessions still behind what they took). */
Test(watermark, a_session_is_not_held_by_another_sessions_stalled_seq) {
  /* Rank 0 took seqs 1..3; session "a" stalls at seq 1, session "b" owns 3. */
  watermark_session_t behind[] = {{"a", 0}, {"b", 2}};
  watermark_progress(w, 0, 0, 3, behind, 2);
  fired_t fa = {0}, fb = {0}, fany = {0};
  watermark_target_t t[] = {{0, 3}};
  cr_assert_eq(watermark_wait_session(w, "b", t, 1, on_fire, &fb, NULL, NULL), WATERMARK_PENDING);
  cr_assert_eq(watermark_wait_session(w, "a", (watermark_target_t[]){{0, 1}}, 1, on_fire, &fa,
                                      NULL, NULL), WATERMARK_PENDING);
  cr_assert_eq(watermark_wait(w, t, 1, on_fire, &fany, NULL, NULL), WATERMARK_PENDING);
  /* "b" leaves the list while `received` stays 3: its wait fires; "a"'s and
   * the all-sessions wait do not. */
  watermark_progress(w, 0, 0, 3, behind, 1);
  cr_assert_eq(fb.calls, 1);
  cr_assert_eq(fb.result, WATERMARK_REACHED);
  cr_assert_eq(fa.calls, 0);
  cr_assert_eq(fany.calls, 0);
  /* A session not listed has run everything taken: reached at once. */
  cr_assert_eq(watermark_wait_session(w, "c", t, 1, on_fire, &fb, NULL, NULL), WATERMARK_REACHED);
  /* "a" catches up: everything ran. */
  watermark_progress(w, 0, 3, 3, NULL, 0);
  cr_assert_eq(fa.calls, 1);
  cr_assert_eq(fany.calls, 1);
  cr_assert_eq(watermark_pending(w), 0);
}

Test(watermark, lost_seqs_stay_lost_for_a_session_too) {
  watermark_session_t behind[] = {{"a", 4}};
  watermark_progress(w, 1, 2, 6, behind, 1);
  fired_t f = {0};
  cr_assert_eq(watermark_wait_session(w, "a", (watermark_target_t[]){{1, 6}}, 1, on_fire, &f, NULL,
                                      NULL), WATERMARK_PENDING);
  watermark_lost(w, 1, 2, 6);
  cr_assert_eq(f.calls, 1);
  cr_assert_eq(f.result, WATERMARK_LOST);
  /* The next link reports session "b" caught up through 9: b's old seq 5 was lost. */
  watermark_progress(w, 1, 9, 9, NULL, 0);
  uint32_t lost = 99;
  cr_assert_eq(watermark_wait_session(w, "b", (watermark_target_t[]){{1, 5}}, 1, on_fire, &f, NULL,
                                      &lost), WATERMARK_LOST);
  cr_assert_eq(lost, 1);
}

Test(watermark, reached_answers_per_session_and_never_for_lost_seqs) {
  watermark_session_t behind[] = {{"a", 2}};
  watermark_progress(w, 0, 1, 5, behind, 1);
  cr_assert(watermark_reached(w, 0, "a", 2));
  cr_assert_not(watermark_reached(w, 0, "a", 3));
  cr_assert(watermark_reached(w, 0, "b", 5), "a session not listed ran all it sent");
  cr_assert_not(watermark_reached(w, 0, NULL, 2), "every session: only through 1");
  cr_assert(watermark_reached(w, 0, "a", 0));
  watermark_lost(w, 0, 1, 5);
  cr_assert_not(watermark_reached(w, 0, "b", 4), "seq 4 was on the broken link");
}
