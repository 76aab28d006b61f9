/* agent/executor.c's worker threads: a worker whose session ended parks and
 * serves the next (session, stream) instead of a new thread being started
 * (thread creation costs ~0.5 ms on these machines, more than a short
 * session), and parked workers end when the executor closes. Real executor,
 * real cpu backend; threads are read from /proc/self/task. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "executor.h"

typedef Meshd__Agent__V1__Instruction instr_t;

static void on_report(const executor_report_t *r, void *arg) {
  (void)r;
  (void)arg;
}

/* The tids of this process's threads. */
static size_t tids(long *out, size_t cap) {
  DIR *d = opendir("/proc/self/task");
  cr_assert_not_null(d);
  size_t n = 0;
  for (struct dirent *e; (e = readdir(d)) && n < cap;)
    if (e->d_name[0] != '.') out[n++] = atol(e->d_name);
  closedir(d);
  return n;
}

static bool has(const long *v, size_t n, long t) {
  for (size_t i = 0; i < n; i++)
    if (v[i] == t) return true;
  return false;
}

static void submit_ones(executor_t *x, const char *session, uint64_t seq) {
  int64_t shape[1] = {4};
  Meshd__V1__Factory f = MESHD__V1__FACTORY__INIT;
  f.ref = 1;
  f.kind = "ones";
  f.n_shape = 1;
  f.shape = shape;
  f.dtype = (Meshd__V1__DType)DTYPE_FLOAT32;
  Meshd__Agent__V1__TensorSpec res = MESHD__AGENT__V1__TENSOR_SPEC__INIT;
  res.ref = 1;
  res.n_shape = 1;
  res.shape = shape;
  res.dtype = (Meshd__V1__DType)DTYPE_FLOAT32;
  Meshd__Agent__V1__FactoryOp fo = MESHD__AGENT__V1__FACTORY_OP__INIT;
  fo.factory = &f;
  fo.result = &res;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.seq = seq;
  ins.session_id = (char *)session;
  ins.stream = 1;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY;
  ins.factory = &fo;
  cr_assert_eq(executor_submit(x, &ins), 0);
}

static void submit_end(executor_t *x, const char *session, uint64_t seq) {
  Meshd__Agent__V1__EndSession es = MESHD__AGENT__V1__END_SESSION__INIT;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.seq = seq;
  ins.session_id = (char *)session;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION;
  ins.end_session = &es;
  cr_assert_eq(executor_submit(x, &ins), 0);
}

Test(executor_pool, a_parked_worker_serves_the_next_session_and_ends_at_close, .timeout = 60) {
  backend_t b = {.ops = backend_for_device("cpu"), .capacity = 1 << 20};
  meshd_error_t e = {0};
  cr_assert_eq(b.ops->open(&b, "cpu", &e), 0, "%s", e.msg);
  _Atomic int64_t rank = 0;
  run_env_t env = {.backend = &b, .rank = &rank};
  executor_t *x = executor_create(&env, on_report, NULL);
  cr_assert_not_null(x);
  long base[256], now[256], workers[256];
  size_t nbase = tids(base, 256), nworkers = 0;

  /* Ten sessions one after another, each ended before the next starts. */
  enum { SESSIONS = 10 };
  uint64_t seq = 0;
  for (int i = 0; i < SESSIONS; i++) {
    char id[32];
    snprintf(id, sizeof id, "pool-session-%02d", i);
    submit_ones(x, id, ++seq);
    cr_assert_eq(executor_wait(x, seq, 10000), 0, "session %d's factory did not run", i);
    size_t n = tids(now, 256); /* its worker is alive now */
    for (size_t k = 0; k < n; k++)
      if (!has(base, nbase, now[k]) && !has(workers, nworkers, now[k]) && nworkers < 256)
        workers[nworkers++] = now[k];
    submit_end(x, id, ++seq);
    cr_assert_eq(executor_wait(x, seq, 10000), 0, "session %d did not end", i);
    nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL); /* time to park */
  }
  /* One thread served them all (two or three if a session came before the
   * last one's worker had parked); a thread per session was ten. */
  cr_assert_geq(nworkers, 1);
  cr_assert_leq(nworkers, 3, "%zu worker threads served %d sessions in turn", nworkers, SESSIONS);
  cr_assert_eq(executor_sessions(x), 0);
  cr_assert_eq(atomic_load(&b.allocated), 0, "every session's tensors were freed");

  /* Parked workers wait 10 s for work, but closing ends them at once. */
  executor_close(x);
  cr_assert_eq(executor_wait_all_freed(3000), 0, "parked workers outlived the executor's close");
  for (size_t k = 0; k < nworkers; k++) { /* each returns right after its last unref */
    bool alive = true;
    for (int i = 0; i < 200 && alive; i++) {
      size_t n = tids(now, 256);
      if ((alive = has(now, n, workers[k]))) nanosleep(&(struct timespec){0, 10 * 1000000L}, NULL);
    }
    cr_assert_not(alive, "worker %ld still runs 2 s after close", workers[k]);
  }
  b.ops->close(&b);
}
