/* workpool: jobs run at once, a thread that finished one waits parked for the
 * next (no new thread for a job that finds one parked), at most max_parked
 * wait, a parked thread leaves after park_ms, and destroy ends the parked
 * ones and waits for a running job. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "rpc.h"
#include "workpool.h"

static _Atomic int ran;
static _Atomic int distinct; /* jobs that ran on a thread no earlier job ran on */
static __thread int seen;    /* this thread ran a job before */

static void count(void *arg) {
  (void)arg;
  if (!seen) atomic_fetch_add(&distinct, 1);
  seen = 1;
  atomic_fetch_add(&ran, 1);
}

static void slow(void *arg) {
  usleep((useconds_t)(intptr_t)arg * 1000);
  atomic_fetch_add(&ran, 1);
}

/* Waits up to 5 s for *v to reach want. */
static int wait_for(_Atomic int *v, int want) {
  int64_t end = rpc_now_ms() + 5000;
  while (atomic_load(v) < want && rpc_now_ms() < end) usleep(1000);
  return atomic_load(v);
}

static int wait_threads(workpool_t *p, int want) {
  int64_t end = rpc_now_ms() + 5000;
  while (workpool_stats(p).threads != want && rpc_now_ms() < end) usleep(1000);
  return workpool_stats(p).threads;
}

Test(workpool, a_job_after_another_runs_on_the_parked_thread) {
  atomic_store(&ran, 0);
  atomic_store(&distinct, 0);
  workpool_t *p = workpool_create("test", 4, 10000);
  cr_assert_not_null(p);
  for (int i = 0; i < 20; i++) {
    cr_assert_eq(workpool_run(p, count, NULL), 0);
    cr_assert_eq(wait_for(&ran, i + 1), i + 1);
    int64_t end = rpc_now_ms() + 5000; /* it parks right after the job */
    while (workpool_stats(p).parked != 1 && rpc_now_ms() < end) usleep(100);
  }
  cr_assert_eq(workpool_stats(p).threads, 1, "one parked thread, not one per job");
  cr_assert_eq(atomic_load(&distinct), 1, "%d threads ran the 20 jobs", atomic_load(&distinct));
  workpool_destroy(p);
}

Test(workpool, at_most_max_parked_wait_and_they_leave_after_park_ms) {
  atomic_store(&ran, 0);
  workpool_t *p = workpool_create("test", 2, 300);
  for (int i = 0; i < 5; i++) cr_assert_eq(workpool_run(p, slow, (void *)(intptr_t)100), 0);
  cr_assert_eq(workpool_stats(p).threads, 5, "five jobs at once: five threads");
  cr_assert_eq(wait_for(&ran, 5), 5);
  cr_assert_eq(wait_threads(p, 2), 2, "only two stay parked");
  cr_assert_eq(wait_threads(p, 0), 0, "parked threads leave after park_ms");
  workpool_destroy(p);
}

Test(workpool, destroy_ends_parked_threads_and_waits_for_a_running_job) {
  atomic_store(&ran, 0);
  workpool_t *p = workpool_create("test", 4, 60000);
  cr_assert_eq(workpool_run(p, count, NULL), 0);
  cr_assert_eq(wait_for(&ran, 1), 1);
  cr_assert_eq(workpool_run(p, slow, (void *)(intptr_t)300), 0);
  int64_t t0 = rpc_now_ms();
  workpool_destroy(p); /* a parked thread (60 s) and a running job (300 ms) */
  int64_t took = rpc_now_ms() - t0;
  cr_assert_eq(atomic_load(&ran), 2, "destroy returned before the running job ended");
  cr_assert_lt(took, 5000, "destroy waited for the parked thread's 60 s: %lld ms",
               (long long)took);
}
