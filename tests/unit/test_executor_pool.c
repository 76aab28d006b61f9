/* agent/executor.c: its worker threads, and deletes ordered after definitions on other streams (executor_refs). Worker threads: a worker whose session ended parks and
 * serves the next (session, stream) instead of a new thread being started
 * (thread creation costs ~0.5 ms on these machines, more than a short
 * session), and parked workers end when the executor closes. Real executor,
 * real cpu backend; threads are read from /proc/self/task. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "executor.h"
#include "instr_build.h"

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

static void submit_factory(executor_t *x, const char *sid, uint64_t seq, uint64_t stream,
                           uint64_t ref, int64_t n);

static void submit_ones(executor_t *x, const char *session, uint64_t seq) {
  submit_factory(x, session, seq, 1, 1, 4);
}

static void submit_end(executor_t *x, const char *session, uint64_t seq) {
  control_instr_t c;
  instr_t *ins = control_instr(&c, MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION);
  ins->seq = seq;
  ins->session_id = (char *)session;
  cr_assert_eq(executor_submit(x, ins), 0);
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

/* ------------------------------------------------------------ deletes after definitions */

/* ins (its body set) as instruction seq of session sid on stream. */
static void submit_ins(executor_t *x, const char *sid, uint64_t seq, uint64_t stream,
                       instr_t *ins) {
  ins->seq = seq;
  ins->session_id = (char *)sid;
  ins->stream = stream;
  cr_assert_eq(executor_submit(x, ins), 0);
}

/* A factory of n float32 ones as ref on stream. */
static void submit_factory(executor_t *x, const char *sid, uint64_t seq, uint64_t stream,
                           uint64_t ref, int64_t n) {
  factory_instr_t b;
  submit_ins(x, sid, seq, stream, factory_instr(&b, "ones", ref, n, DTYPE_FLOAT32));
}

static void submit_delete(executor_t *x, const char *sid, uint64_t seq, uint64_t stream,
                          uint64_t ref) {
  Meshd__Agent__V1__DeleteRefs d = MESHD__AGENT__V1__DELETE_REFS__INIT;
  d.refs = &ref;
  d.n_refs = 1;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS;
  ins.delete_refs = &d;
  submit_ins(x, sid, seq, stream, &ins);
}

static void submit_borrow(executor_t *x, const char *sid, uint64_t seq, uint64_t stream, int phase,
                          uint64_t id, uint64_t tensor, uint64_t result) {
  borrow_instr_t b;
  submit_ins(x, sid, seq, stream, borrow_instr(&b, phase, id, tensor, result));
}

/* A same-rank copy of ref in (on stream 1) as ref out on stream 2 (a to_mesh). */
static void submit_local_send(executor_t *x, const char *sid, uint64_t seq, uint64_t in,
                              uint64_t out, int64_t n) {
  int64_t shape[1] = {n};
  Meshd__Agent__V1__TensorSpec a = MESHD__AGENT__V1__TENSOR_SPEC__INIT;
  a.ref = in;
  a.n_shape = 1;
  a.shape = shape;
  a.dtype = (Meshd__V1__DType)DTYPE_FLOAT32;
  Meshd__Agent__V1__TensorSpec r = a;
  r.ref = out;
  Meshd__Agent__V1__SendTensor st = MESHD__AGENT__V1__SEND_TENSOR__INIT;
  st.input = &a;
  st.result = &r;
  st.from_rank = st.to_rank = 0;
  st.to_stream = 2;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SEND;
  ins.send = &st;
  submit_ins(x, sid, seq, 1, &ins);
}

/* Stream 1 made busy (40 tensors of 16 MiB made and dropped) after ref 1 (4 MiB),
 * with stream 2's worker started; returns the last seq. */
static uint64_t busy_stream_1(executor_t *x, const char *sid) {
  uint64_t seq = 0;
  submit_factory(x, sid, ++seq, 2, 50, 4);
  cr_assert_eq(executor_wait(x, seq, 10000), 0);
  submit_factory(x, sid, ++seq, 1, 1, 1 << 20);
  for (int i = 0; i < 40; i++) submit_factory(x, sid, ++seq, 1, 100 + (uint64_t)i, 1 << 22);
  for (int i = 0; i < 40; i++) submit_delete(x, sid, ++seq, 1, 100 + (uint64_t)i);
  return seq;
}

/* Static: the executor's workers may free a session after executor_close
 * returned, and the backend must outlive them (an agent's lives as long as it). */
typedef struct {
  backend_t b;
  _Atomic int64_t rank;
  run_env_t env;
  executor_t *x;
} agent_t;

static agent_t the_agent;

static void agent_open(agent_t *a) {
  memset(a, 0, sizeof *a);
  a->b.ops = backend_for_device("cpu");
  meshd_error_t e = {0};
  cr_assert_eq(a->b.ops->open(&a->b, "cpu", &e), 0, "%s", e.msg);
  a->env = (run_env_t){.backend = &a->b, .rank = &a->rank};
  a->x = executor_create(&a->env, on_report, NULL);
}

/* Every ref deleted: ref 2 is not defined, and no tensor byte is held. */
static void expect_all_gone(agent_t *a, const char *sid, uint64_t seq) {
  cr_assert_eq(executor_wait(a->x, seq, 30000), 0);
  agent_tensor_t t;
  int rc = executor_lookup(a->x, sid, 2, &t, NULL);
  if (rc == 0) storage_release(t.storage);
  cr_expect_neq(rc, 0, "ref 2 is still defined after its delete");
  cr_expect_eq(atomic_load(&a->b.allocated), 0, "%llu bytes still held",
               (unsigned long long)atomic_load(&a->b.allocated));
  executor_close(a->x);
}

/* A borrow dropped unused: its handle's last use (on the borrowing stream) is
 * queued before the busy lending stream made the handle. The delete waits for
 * the definition, as a read does; else the handle held its storage until the
 * session ended. */
Test(executor_refs, a_borrow_handles_last_use_waits_for_its_creation, .timeout = 60) {
  agent_t *a = &the_agent;
  agent_open(a);
  const char *sid = "s1";
  uint64_t seq = busy_stream_1(a->x, sid);
  submit_borrow(a->x, sid, ++seq, 1, MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE, 7, 1, 2);
  submit_borrow(a->x, sid, ++seq, 2, MESHD__AGENT__V1__BORROW_OP__PHASE__LAST_USE, 7, 1, 2);
  submit_borrow(a->x, sid, ++seq, 1, MESHD__AGENT__V1__BORROW_OP__PHASE__DROP, 7, 1, 2);
  submit_delete(a->x, sid, ++seq, 1, 1);
  submit_delete(a->x, sid, ++seq, 2, 50);
  expect_all_gone(a, sid, seq);
}

/* A same-rank to_mesh's result, made on the input's busy stream, dropped unused
 * on its own stream: the delete waits for the copy. */
Test(executor_refs, a_delete_on_the_results_stream_waits_for_a_copy_on_another, .timeout = 60) {
  agent_t *a = &the_agent;
  agent_open(a);
  const char *sid = "s2";
  uint64_t seq = busy_stream_1(a->x, sid);
  submit_local_send(a->x, sid, ++seq, 1, 2, 1 << 20);
  submit_delete(a->x, sid, ++seq, 2, 2);
  submit_delete(a->x, sid, ++seq, 1, 1);
  submit_delete(a->x, sid, ++seq, 2, 50);
  expect_all_gone(a, sid, seq);
}

/* The server undid a failed transfer (DeleteRefs of a ref its Write had not
 * defined yet here): the Write may not define it after, which would hold the
 * tensor until the session ended; another ref's Write still defines. */
Test(executor_refs, a_write_may_not_define_a_ref_deleted_before_it, .timeout = 30) {
  agent_t *a = &the_agent;
  agent_open(a);
  const char *sid = "s3";
  uint64_t seq = 0;
  submit_factory(a->x, sid, ++seq, 1, 1, 4);
  submit_delete(a->x, sid, ++seq, 1, 9); /* never defined here */
  cr_assert_eq(executor_wait(a->x, seq, 10000), 0);
  agent_tensor_t t, u;
  cr_assert_eq(executor_lookup(a->x, sid, 1, &t, NULL), 0);
  cr_assert_eq(executor_define(a->x, sid, 9, &t), 2);
  cr_assert_neq(executor_lookup(a->x, sid, 9, &u, NULL), 0, "the undone ref was defined");
  cr_assert_eq(executor_define(a->x, sid, 10, &t), 0);
  cr_assert_eq(executor_lookup(a->x, sid, 10, &u, NULL), 0);
  storage_release(u.storage);
  storage_release(t.storage);
  submit_delete(a->x, sid, ++seq, 1, 1);
  submit_delete(a->x, sid, ++seq, 1, 10);
  cr_assert_eq(executor_wait(a->x, seq, 10000), 0);
  cr_expect_eq(atomic_load(&a->b.allocated), 0);
  executor_close(a->x);
}

/* ------------------------------------------------------------ an ended session's memory */

/* The cpu backend, with a free that notes whether it ran on the thread that
 * submits (the test's; in the agent, the one reading the Execute stream) and,
 * while hold_frees is set, waits to be let go (2 s at most). */
static backend_ops_t held_ops;
static pthread_t submitter;
static _Atomic bool hold_frees, free_held, freed_on_submitter;

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void held_free(backend_t *b, void *ptr, size_t bytes) {
  if (pthread_equal(pthread_self(), submitter)) atomic_store(&freed_on_submitter, true);
  if (atomic_load(&hold_frees)) {
    atomic_store(&free_held, true);
    for (int64_t end = mono_ms() + 2000; atomic_load(&hold_frees) && mono_ms() < end;)
      nanosleep(&(struct timespec){0, 1000000L}, NULL);
  }
  backend_for_device("cpu")->free(b, ptr, bytes);
}

static agent_t held_agent; /* static: see the_agent */

/* EndSession lets go of the session's tensors on a worker, not in the submit
 * call: in the agent that runs on the thread reading the Execute stream, and
 * a large free there (a device's) held every other session's instructions
 * behind it. Here session A's free is held until session B's next
 * instruction ran. */
Test(executor_pool, an_ended_sessions_memory_is_freed_off_the_submitting_thread, .timeout = 30) {
  agent_t *a = &held_agent;
  held_ops = *backend_for_device("cpu");
  held_ops.free = held_free;
  a->b.ops = &held_ops;
  meshd_error_t e = {0};
  cr_assert_eq(a->b.ops->open(&a->b, "cpu", &e), 0, "%s", e.msg);
  a->env = (run_env_t){.backend = &a->b, .rank = &a->rank};
  a->x = executor_create(&a->env, on_report, NULL);
  cr_assert_not_null(a->x);
  submitter = pthread_self();
  uint64_t seq = 0;
  submit_factory(a->x, "A", ++seq, 1, 1, 1 << 20);
  submit_factory(a->x, "B", ++seq, 1, 1, 4);
  cr_assert_eq(executor_wait(a->x, seq, 10000), 0);

  atomic_store(&hold_frees, true);
  submit_end(a->x, "A", ++seq);
  uint64_t end_a = seq;
  cr_assert_not(atomic_load(&freed_on_submitter), "EndSession freed A's tensor in the submit call");
  int64_t end = mono_ms() + 5000;
  while (!atomic_load(&free_held) && mono_ms() < end) nanosleep(&(struct timespec){0, 1000000L}, NULL);
  cr_assert(atomic_load(&free_held), "A's tensor was never freed");
  submit_factory(a->x, "B", ++seq, 1, 2, 4); /* while A's free is held */
  cr_assert_eq(executor_wait_session(a->x, "B", seq, 10000), 0);
  cr_assert(atomic_load(&hold_frees) && executor_executed(a->x) < end_a,
            "A's free was not held while B ran");
  atomic_store(&hold_frees, false);
  cr_assert_eq(executor_wait(a->x, seq, 10000), 0, "A's EndSession never completed");

  submit_end(a->x, "B", ++seq); /* a session whose worker is idle */
  cr_assert_eq(executor_wait(a->x, seq, 10000), 0);
  cr_assert_eq(executor_sessions(a->x), 0);
  cr_assert_eq(atomic_load(&a->b.allocated), 0, "%llu bytes still held",
               (unsigned long long)atomic_load(&a->b.allocated));
  cr_assert_not(atomic_load(&freed_on_submitter), "a session's tensors were freed in the submit call");
  executor_close(a->x);
}
