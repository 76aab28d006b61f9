/* Failures inside an agent's run.c that only a test can cause, run by an
 * in-process executor on the cpu backend:
 *
 * - recording a result runs out of memory: the ref table's put fails (its
 *   index cannot grow). The instruction must fail that result (QUOTA,
 *   reported to the server), not leave the ref undefined while the server
 *   holds it defined (a later reader then failed with a misleading "tensor N
 *   is not on the agent"). The allocation failure is made deterministic by
 *   interposing calloc in this test binary: armed, it refuses the first
 *   calloc of 16 pointers, which is the first growth of an empty ref index
 *   (core/tensor/refmap.c);
 * - the injected fault call:fail (core/platform/fault.h) fails an op "as a
 *   kernel would": an in-place op's target fails with it;
 * - a step that does not end (call:slow, whose sleep this suite's nanosleep
 *   turns into a gate the test opens): the seqs done behind it cost the
 *   executor nothing, and a session ended meanwhile frees at once what the
 *   step does not hold. */
#include <criterion/criterion.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "executor.h"
#include "fault.h"
#include "instr_build.h"

#if !defined(__SANITIZE_ADDRESS__)
extern void *__libc_calloc(size_t n, size_t size);
static atomic_int fail_index_growth; /* armed: the next calloc(16, sizeof(void *)) fails */
static atomic_int fired;

void *calloc(size_t n, size_t size) {
  if (n == 16 && size == sizeof(void *) && atomic_load(&fail_index_growth) &&
      atomic_exchange(&fail_index_growth, 0)) {
    atomic_store(&fired, 1);
    return NULL;
  }
  return __libc_calloc(n, size);
}
#endif

static const char *SESSION = "oom-session";
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char errors[16][700];
static uint64_t error_seqs[16], error_refs[16];
static int error_kinds[16];
static int nerrors;

static void on_report(const executor_report_t *r, void *arg) {
  (void)arg;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < r->n_errors && nerrors < 16; i++) {
    snprintf(errors[nerrors], sizeof errors[0], "%s", r->errors[i]->message);
    error_refs[nerrors] = r->errors[i]->ref;
    error_kinds[nerrors] = (int)r->errors[i]->kind;
    error_seqs[nerrors++] = r->errors[i]->seq;
  }
  pthread_mutex_unlock(&mu);
}

/* The failure reported for seq (the reporter thread's: a bounded wait), or
 * NULL; *ref and *kind its fields. */
static const char *wait_error(executor_t *x, uint64_t seq, uint64_t *ref, int *kind) {
  const char *m = NULL;
  for (int i = 0; i < 1000 && !m; i++) {
    pthread_mutex_lock(&mu);
    for (int k = 0; k < nerrors && !m; k++)
      if (error_seqs[k] == seq) {
        m = errors[k];
        *ref = error_refs[k];
        *kind = error_kinds[k];
      }
    pthread_mutex_unlock(&mu);
    if (!m) {
      executor_kick(x);
      nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
  }
  return m;
}

/* An executor on the cpu backend reporting to on_report, with the injected
 * fault fault_spec (core/platform/fault.h; NULL: none). */
typedef struct {
  backend_t b;
  fault_t fault;
  _Atomic int64_t rank;
  run_env_t env;
  executor_t *x;
} cpu_agent_t;

static void cpu_agent_start(cpu_agent_t *a, const char *fault_spec) {
  *a = (cpu_agent_t){.b = {.ops = &cpu_backend_ops, .capacity = 1 << 28}};
  meshd_error_t e = {0};
  cr_assert_eq(cpu_backend_ops.open(&a->b, "cpu", &e), 0, "%s", e.msg);
  a->env = (run_env_t){.backend = &a->b, .rank = &a->rank};
  if (fault_spec) {
    char why[200];
    cr_assert_eq(fault_parse(fault_spec, FAULT_AGENT_PLACES, &a->fault, why, sizeof why), 0,
                 "%s", why);
    a->env.fault = &a->fault;
  }
  a->x = executor_create(&a->env, on_report, NULL);
  cr_assert_not_null(a->x);
}

static void cpu_agent_stop(cpu_agent_t *a) {
  executor_close(a->x);
  cr_assert_eq(executor_wait_all_freed(10000), 0);
  cpu_backend_ops.close(&a->b);
}

/* ones(n) as ref, seq of session on stream 1. */
static void submit_ones(executor_t *x, const char *session, uint64_t seq, uint64_t ref, int64_t n) {
  factory_instr_t f;
  Meshd__Agent__V1__Instruction *ins = factory_instr(&f, "ones", ref, n, DTYPE_FLOAT32);
  ins->seq = seq;
  ins->session_id = (char *)session;
  ins->stream = 1;
  cr_assert_eq(executor_submit(x, ins), 0);
}

/* add_(ref, ref) on stream 1: an in-place op (under call:slow, the slow step). */
static void submit_add_(executor_t *x, const char *session, uint64_t seq, uint64_t ref) {
  Meshd__V1__Arg a0 = MESHD__V1__ARG__INIT, a1 = MESHD__V1__ARG__INIT;
  a0.value_case = a1.value_case = MESHD__V1__ARG__VALUE_REF;
  a0.ref = a1.ref = ref;
  Meshd__V1__Arg *args[2] = {&a0, &a1};
  Meshd__Agent__V1__OpCall call = MESHD__AGENT__V1__OP_CALL__INIT;
  call.op = "add_";
  call.n_args = 2;
  call.args = args;
  Meshd__Agent__V1__Instruction ci = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ci.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CALL;
  ci.call = &call;
  ci.seq = seq;
  ci.session_id = (char *)session;
  ci.stream = 1;
  cr_assert_eq(executor_submit(x, &ci), 0);
}

/* A Status or an EndSession (body_case, instr_build.h's control_instr) as seq of session. */
static void submit_control(executor_t *x, const char *session, uint64_t seq, int body_case) {
  control_instr_t c;
  Meshd__Agent__V1__Instruction *ins = control_instr(&c, body_case);
  ins->seq = seq;
  ins->session_id = (char *)session;
  cr_assert_eq(executor_submit(x, ins), 0);
}

Test(agent_oom, a_result_the_ref_table_cannot_record_fails_and_is_reported) {
#if defined(__SANITIZE_ADDRESS__)
  cr_skip_test("calloc is the sanitizer's");
#else
  cpu_agent_t a;
  cpu_agent_start(&a, NULL);
  executor_t *x = a.x;
  atomic_store(&fail_index_growth, 1);
  submit_ones(x, SESSION, 1, 10, 4);
  cr_assert_eq(executor_wait(x, 1, 10000), 0, "seq 1 not executed");
  atomic_store(&fail_index_growth, 0);
  cr_assert(atomic_load(&fired), "the interposed calloc did not fire");

  uint64_t ref = 0;
  int kind = 0;
  const char *m = wait_error(x, 1, &ref, &kind);
  cr_assert_not_null(m, "seq 1's result could not be recorded, and nothing was reported");
  cr_assert_eq(ref, 10, "the report names result 10 (%s)", m);
  cr_assert_eq(kind, MESHD__V1__ERROR_KIND__ERROR_KIND_QUOTA, "kind %d: %s", kind, m);
  cr_assert(strstr(m, "out of memory"), "%s", m);
  agent_tensor_t t;
  ref_failure_t why;
  cr_assert_eq(executor_lookup(x, SESSION, 10, &t, &why), 1, "ref 10 is failed, not missing");
  cpu_agent_stop(&a);
#endif
}

/* call:fail on an in-place op (add_ of tensor 10 into itself): its target
 * fails on the agent and is named in the report, as when add_'s kernel fails
 * (run_call: "what it wrote in place fails with it"). The fault used to fire
 * before the op's arguments were resolved, so the report named no tensor and
 * tensor 10 stayed live here and on the server. */
Test(agent_fault, call_fail_fails_an_in_place_target_as_a_kernel_failure_would) {
  cpu_agent_t a;
  cpu_agent_start(&a, "call:fail");
  executor_t *x = a.x;
  submit_ones(x, SESSION, 1, 10, 4);
  submit_add_(x, SESSION, 2, 10);
  cr_assert_eq(executor_wait(x, 2, 10000), 0, "seq 2 not executed");

  uint64_t ref = 0;
  int kind = 0;
  const char *m = wait_error(x, 2, &ref, &kind);
  cr_assert_not_null(m, "no failure reported for add_");
  cr_assert(strstr(m, "injected fault"), "%s", m);
  cr_assert_eq(ref, 10, "the report names the in-place target 10, not %llu (%s)",
               (unsigned long long)ref, m);
  agent_tensor_t t;
  ref_failure_t rf;
  int rc = executor_lookup(x, SESSION, 10, &t, &rf);
  if (rc == 0) storage_release(t.storage);
  cr_assert_eq(rc, 1, "tensor 10 failed with its in-place op");
  cpu_agent_stop(&a);
}

/* A ref deleted here before it was defined (the server undid a transfer
 * whose Write had not finished) is remembered, so that the late Write defines
 * nothing (it would hold its memory for the session's life, unknown to the
 * server). The list is bounded (REFS_UNDONE_MAX); once it was full, every
 * later undo was forgotten at once, so a late Write of any recent transfer
 * defined its ref again. Late Writes come within a grant's lifetime, after
 * the most recent undos: the oldest entries are the ones to forget. */
Test(agent_refs, the_latest_undone_refs_are_remembered_past_the_bound) {
  refs_t r;
  refs_init(&r);
  for (uint64_t ref = 1; ref <= REFS_UNDONE_MAX; ref++) refs_delete(&r, ref);
  uint64_t late = REFS_UNDONE_MAX + 100;
  refs_delete(&r, late);
  backend_t b = {.ops = &cpu_backend_ops, .capacity = 1 << 20};
  meshd_error_t e = {0};
  cr_assert_eq(cpu_backend_ops.open(&b, "cpu", &e), 0, "%s", e.msg);
  tensor_meta_t m = {.dtype = DTYPE_FLOAT32};
  cr_assert_eq(layout_contiguous(&m.layout, (const int64_t[]){4}, 1, 4, "t", &e), 0);
  agent_tensor_t t;
  cr_assert_eq(tensor_alloc(&b, NULL, &m, &t, "test", &e), 0, "%s", e.msg);
  cr_assert_eq(refs_put_write(&r, late, &t), 2, "the late Write of the latest undone ref defined it");
  cr_assert_eq(refs_count(&r), 0);
  cr_assert_eq(refs_put_write(&r, REFS_UNDONE_MAX, &t), 2, "a recent one is still remembered");
  storage_release(t.storage);
  refs_clear(&r);
  pthread_mutex_destroy(&r.mu);
  cr_assert_eq(atomic_load(&b.allocated), 0);
  cpu_backend_ops.close(&b);
}

/* ------------------------------------------------- a step that does not end */

/* call:slow=GATE_MS: the slow op's sleep (run.c's nanosleep of exactly that
 * long) waits instead for the test to open the gate, so that "while the step
 * runs" is a state the test holds, not a time it guesses. */
#define GATE_MS 4321
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool gate_entered, gate_open;

int nanosleep(const struct timespec *req, struct timespec *rem) {
  (void)rem;
  bool gated = req->tv_sec == GATE_MS / 1000 && req->tv_nsec == (GATE_MS % 1000) * 1000000L;
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  if (gated) {
    dl.tv_sec += 30; /* a test that never opens it fails, it does not hang */
    pthread_mutex_lock(&gate_mu);
    gate_entered = true;
    pthread_cond_broadcast(&gate_cv);
    while (!gate_open && pthread_cond_timedwait(&gate_cv, &gate_mu, &dl) == 0) {
    }
    pthread_mutex_unlock(&gate_mu);
    return 0;
  }
  /* Other sleeps (the tests' polls): a timed wait on a private condition. */
  dl.tv_sec += req->tv_sec;
  dl.tv_nsec += req->tv_nsec;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t c = PTHREAD_COND_INITIALIZER;
  pthread_mutex_lock(&m);
  while (pthread_cond_timedwait(&c, &m, &dl) == 0) {
  }
  pthread_mutex_unlock(&m);
  return 0;
}

static bool gate_wait_entered(void) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 10;
  pthread_mutex_lock(&gate_mu);
  while (!gate_entered && pthread_cond_timedwait(&gate_cv, &gate_mu, &dl) == 0) {
  }
  bool in = gate_entered;
  pthread_mutex_unlock(&gate_mu);
  return in;
}

static void gate_release(void) {
  pthread_mutex_lock(&gate_mu);
  gate_open = true;
  pthread_cond_broadcast(&gate_cv);
  pthread_mutex_unlock(&gate_mu);
}

/* An executor whose first op Call is slow (gated). */
static void slow_agent_start(cpu_agent_t *a) {
  char spec[64];
  snprintf(spec, sizeof spec, "call:slow=%d,count=1", GATE_MS);
  cpu_agent_start(a, spec);
}

static size_t heap_in_use(void) {
  struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
}

/* agent/executor.c: while one instruction hangs, the watermark stays behind
 * it and later instructions finish ahead of it. The executor kept a done flag
 * for every seq from the hung one to the last taken (a ring that doubled), so
 * an agent whose one step hung grew by a byte per instruction any session ran
 * meanwhile, without bound. It now keeps only the seqs not yet done: the
 * 600000 instructions run behind the hung one cost nothing once done. */
Test(agent_watermark, seqs_done_behind_a_hung_one_are_not_kept, .timeout = 120) {
  cpu_agent_t a;
  slow_agent_start(&a);
  submit_ones(a.x, "hung", 1, 10, 4);
  submit_add_(a.x, "hung", 2, 10);
  cr_assert(gate_wait_entered(), "the slow step did not start");
  enum { BEHIND = 600000 };
  uint64_t last = 2 + BEHIND;
  /* opens the session: its table exists before the count */
  submit_control(a.x, "busy", 3, MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS);
  size_t before = heap_in_use();
  for (uint64_t seq = 4; seq <= last; seq++)
    submit_control(a.x, "busy", seq, MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS);
  size_t after = heap_in_use();
  cr_assert_eq(executor_executed(a.x), 1, "the watermark passed the hung seq 2");
  cr_assert_eq(executor_received(a.x), last);
  (void)before;
  (void)after;
#if !defined(__SANITIZE_ADDRESS__) /* its allocator is not glibc's: mallinfo2 sees nothing */
  cr_expect(after < before + 256 * 1024,
            "%d seqs done behind the hung one took %zu bytes (before %zu, after %zu)", BEHIND,
            after - before, before, after);
#endif
  gate_release();
  cr_assert_eq(executor_wait(a.x, last, 20000), 0, "the hung seq's end did not pass the rest");
  cpu_agent_stop(&a);
}

/* agent/executor.c: a session ended (EndSession) while one of its steps runs,
 * slow and not interruptible (a long kernel; here the gated call:slow), freed
 * its tensors only when that step returned and its last worker exited. What
 * the step does not use is freed at once now: tensor 11 here (the step holds
 * tensor 10 until it returns), by a worker of the executor. */
Test(agent_memory, an_ended_sessions_tensors_go_before_its_running_step_ends, .timeout = 60) {
  cpu_agent_t a;
  slow_agent_start(&a);
  enum { N = 1 << 18 }; /* 1 MiB of floats each */
  submit_ones(a.x, "ending", 1, 10, N);
  submit_ones(a.x, "ending", 2, 11, N);
  submit_add_(a.x, "ending", 3, 10);
  cr_assert(gate_wait_entered(), "the slow step did not start");
  uint64_t both = atomic_load(&a.b.allocated);
  cr_assert_geq(both, 2 * (uint64_t)N * 4, "both tensors are allocated: %llu bytes",
                (unsigned long long)both);
  submit_control(a.x, "ending", 4, MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION);
  /* Let go of on a worker (not in the submit call): soon, the step still held. */
  uint64_t ended = atomic_load(&a.b.allocated);
  for (int i = 0; i < 5000 && ended > both - (uint64_t)N * 4; i++) {
    nanosleep(&(struct timespec){0, 1000000L}, NULL);
    ended = atomic_load(&a.b.allocated);
  }
  cr_expect_leq(ended, both - (uint64_t)N * 4,
                "the ended session still holds tensor 11 (%llu bytes allocated, %llu before its "
                "end) while its step runs", (unsigned long long)ended, (unsigned long long)both);
  cr_expect_geq(ended, (uint64_t)N * 4, "tensor 10, which the step uses, was freed under it");
  cr_assert_eq(executor_sessions(a.x), 0);
  gate_release();
  cr_assert_eq(executor_wait(a.x, 4, 20000), 0, "the session's end did not complete");
  cr_assert_eq(atomic_load(&a.b.allocated), 0, "the session's memory outlived its last step");
  cpu_agent_stop(&a);
}
