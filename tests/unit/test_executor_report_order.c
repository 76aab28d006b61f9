/* agent/executor.c: a report whose watermark passes a seq carries that seq's
 * root failure, or an earlier report did. The server reads "executed through
 * S, no error for S" as "S succeeded" (a Sync returns OK), so a failure queued
 * after the watermark moved is reported too late.
 *
 * The window is made wide without touching the executor: this suite's strdup
 * (the executor copies a failure's message with it before it queues the
 * failure) pauses on the refused instruction's message, so that the reporter
 * the watermark's move woke runs meanwhile. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "executor.h"

typedef Meshd__Agent__V1__Instruction instr_t;

static _Atomic bool slow_copies;

char *strdup(const char *s) {
  size_t n = strlen(s) + 1;
  if (atomic_load(&slow_copies) && strstr(s, "CreateStream.name")) {
    struct timespec ts = {0, 300 * 1000000L};
    nanosleep(&ts, NULL);
  }
  char *p = malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t watch_seq;       /* the seq whose failure is watched (0: none) */
static bool error_seen;          /* a report carried watch_seq's failure */
static bool covered;             /* a report's watermark reached watch_seq */
static bool error_when_covered;  /* error_seen, as the first covering report left it */

static void on_report(const executor_report_t *r, void *arg) {
  (void)arg;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < r->n_errors; i++)
    if (watch_seq && r->errors[i]->seq == watch_seq) error_seen = true;
  if (watch_seq && !covered && r->executed_through >= watch_seq) {
    covered = true;
    error_when_covered = error_seen;
  }
  pthread_mutex_unlock(&mu);
}

static void submit_status(executor_t *x, uint64_t seq) {
  Meshd__Agent__V1__StatusRequest st = MESHD__AGENT__V1__STATUS_REQUEST__INIT;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.seq = seq;
  ins.session_id = "s";
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS;
  ins.status = &st;
  cr_assert_eq(executor_submit(x, &ins), 0);
}

Test(executor_report_order, a_refused_instructions_failure_is_in_the_report_that_passes_it,
     .timeout = 30) {
  run_env_t env = {0}; /* no backend: a CreateStream needs none */
  executor_t *x = executor_create(&env, on_report, NULL);
  cr_assert_not_null(x);
  submit_status(x, 1);
  cr_assert_eq(executor_wait(x, 1, 5000), 0);

  /* A CreateStream whose name is too long: refused, done at once. */
  char name[80];
  memset(name, 'n', 70);
  name[70] = '\0';
  Meshd__Agent__V1__CreateStream cs = MESHD__AGENT__V1__CREATE_STREAM__INIT;
  cs.name = name;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.seq = 2;
  ins.session_id = "s";
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CREATE_STREAM;
  ins.create_stream = &cs;
  pthread_mutex_lock(&mu);
  watch_seq = 2;
  pthread_mutex_unlock(&mu);
  atomic_store(&slow_copies, true);
  executor_submit(x, &ins);
  atomic_store(&slow_copies, false);

  bool seen = false;
  for (int i = 0; i < 500 && !seen; i++) {
    pthread_mutex_lock(&mu);
    seen = error_seen && covered;
    pthread_mutex_unlock(&mu);
    if (!seen) nanosleep(&(struct timespec){0, 10 * 1000000L}, NULL);
  }
  executor_close(x);
  cr_assert(seen, "seq 2's failure was never reported");
  cr_expect(error_when_covered,
            "a report said executed_through >= 2 before seq 2's failure was reported");
}
