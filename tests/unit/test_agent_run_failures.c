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
 *   kernel would": an in-place op's target fails with it. */
#include <criterion/criterion.h>
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

Test(agent_oom, a_result_the_ref_table_cannot_record_fails_and_is_reported) {
#if defined(__SANITIZE_ADDRESS__)
  cr_skip_test("calloc is the sanitizer's");
#else
  backend_t b = {.ops = &cpu_backend_ops, .capacity = 1 << 26};
  meshd_error_t e = {0};
  cr_assert_eq(cpu_backend_ops.open(&b, "cpu", &e), 0, "%s", e.msg);
  _Atomic int64_t rank = 0;
  run_env_t env = {.backend = &b, .rank = &rank};
  executor_t *x = executor_create(&env, on_report, NULL);
  cr_assert_not_null(x);

  factory_instr_t f;
  Meshd__Agent__V1__Instruction *ins = factory_instr(&f, "ones", 10, 4, DTYPE_FLOAT32);
  ins->seq = 1;
  ins->session_id = (char *)SESSION;
  ins->stream = 1;
  atomic_store(&fail_index_growth, 1);
  cr_assert_eq(executor_submit(x, ins), 0);
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
  executor_close(x);
  cr_assert_eq(executor_wait_all_freed(5000), 0);
  cpu_backend_ops.close(&b);
#endif
}

/* call:fail on an in-place op (add_ of tensor 10 into itself): its target
 * fails on the agent and is named in the report, as when add_'s kernel fails
 * (run_call: "what it wrote in place fails with it"). The fault used to fire
 * before the op's arguments were resolved, so the report named no tensor and
 * tensor 10 stayed live here and on the server. */
Test(agent_fault, call_fail_fails_an_in_place_target_as_a_kernel_failure_would) {
  backend_t b = {.ops = &cpu_backend_ops, .capacity = 1 << 26};
  meshd_error_t e = {0};
  cr_assert_eq(cpu_backend_ops.open(&b, "cpu", &e), 0, "%s", e.msg);
  fault_t fault;
  char why[200];
  cr_assert_eq(fault_parse("call:fail", FAULT_AGENT_PLACES, &fault, why, sizeof why), 0, "%s", why);
  _Atomic int64_t rank = 0;
  run_env_t env = {.backend = &b, .rank = &rank, .fault = &fault};
  executor_t *x = executor_create(&env, on_report, NULL);
  cr_assert_not_null(x);

  factory_instr_t f;
  Meshd__Agent__V1__Instruction *ins = factory_instr(&f, "ones", 10, 4, DTYPE_FLOAT32);
  ins->seq = 1;
  ins->session_id = (char *)SESSION;
  ins->stream = 1;
  cr_assert_eq(executor_submit(x, ins), 0);

  Meshd__V1__Arg a0 = MESHD__V1__ARG__INIT, a1 = MESHD__V1__ARG__INIT;
  a0.value_case = a1.value_case = MESHD__V1__ARG__VALUE_REF;
  a0.ref = a1.ref = 10;
  Meshd__V1__Arg *args[2] = {&a0, &a1};
  Meshd__Agent__V1__OpCall call = MESHD__AGENT__V1__OP_CALL__INIT;
  call.op = "add_";
  call.n_args = 2;
  call.args = args;
  Meshd__Agent__V1__Instruction ci = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ci.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CALL;
  ci.call = &call;
  ci.seq = 2;
  ci.session_id = (char *)SESSION;
  ci.stream = 1;
  cr_assert_eq(executor_submit(x, &ci), 0);
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
  executor_close(x);
  cr_assert_eq(executor_wait_all_freed(5000), 0);
  cpu_backend_ops.close(&b);
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
