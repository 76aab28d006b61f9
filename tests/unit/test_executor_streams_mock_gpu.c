/* The executor's stream plumbing for backends with device streams (cuda), on a
 * MOCK GPU: the cpu backend's kernels behind stream, event and sync slots that
 * log what the executor asks of them. It checks what only a GPU would show:
 * one device stream per (session, stream); a borrow's first use makes the
 * borrowing stream wait on an event recorded on the origin, its drop the
 * reverse; the watermark moves only after the stream was synchronised; session
 * end destroys the streams and releases the session's communicators. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "executor.h"
#include "instr_build.h"
#include "snapshot.h"

/* ---- the mock device ---- */

struct backend_stream {
  int id;
};

typedef struct {
  int stream;
} mock_event_t;

#define LOG_MAX 256
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static char log_lines[LOG_MAX][64];
static int nlog, next_stream;
static bool gate_open;
static int sync_fail; /* stream_sync fails this many more times */
static int wait_fail; /* event_wait fails this many more times */
static int create_fail; /* stream_create fails (NULL) this many more times */

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&mu);
  if (nlog < LOG_MAX) vsnprintf(log_lines[nlog++], sizeof log_lines[0], fmt, ap);
  pthread_mutex_unlock(&mu);
  va_end(ap);
}

static backend_stream_t *m_stream_create(backend_t *b) {
  pthread_mutex_lock(&mu);
  bool fail = create_fail > 0;
  if (fail) create_fail--;
  pthread_mutex_unlock(&mu);
  if (fail) {
    logf_("create failed");
    return NULL;
  }
  backend_stream_t *s = calloc(1, sizeof *s);
  pthread_mutex_lock(&mu);
  s->id = ++next_stream;
  pthread_mutex_unlock(&mu);
  logf_("create %d", s->id);
  return s;
}

static void m_stream_destroy(backend_t *b, backend_stream_t *s) {
  logf_("destroy %d", s->id);
  free(s);
}

static int m_stream_sync(backend_t *b, backend_stream_t *s, meshd_error_t *e) {
  pthread_mutex_lock(&mu);
  while (!gate_open) pthread_cond_wait(&gate_cv, &mu);
  bool fail = sync_fail > 0;
  if (fail) sync_fail--;
  pthread_mutex_unlock(&mu);
  logf_("sync %d", s ? s->id : 0);
  return fail ? error_set(e, ERR_REMOTE_FAILURE, "mock device: an illegal address") : 0;
}

static backend_event_t *m_event_record(backend_t *b, backend_stream_t *s) {
  mock_event_t *ev = calloc(1, sizeof *ev);
  ev->stream = s ? s->id : 0;
  logf_("record %d", ev->stream);
  return (backend_event_t *)ev;
}

static int m_event_wait(backend_t *b, backend_stream_t *t, backend_event_t *ev) {
  pthread_mutex_lock(&mu);
  bool fail = wait_fail > 0;
  if (fail) wait_fail--;
  pthread_mutex_unlock(&mu);
  logf_("%s %d<-%d", fail ? "wait-failed" : "wait", t ? t->id : 0, ((mock_event_t *)ev)->stream);
  return fail ? -1 : 0;
}

static void m_event_destroy(backend_t *b, backend_event_t *ev) { free(ev); }

static int m_run_op(backend_t *b, backend_stream_t *s, const op_args_t *a, agent_tensor_t **res,
                    int nres, const op_infer_t *inf, uint32_t rank, int64_t coord,
                    meshd_error_t *e) {
  logf_("op %d %s", s ? s->id : 0, a->op->name);
  return cpu_backend_ops.run_op(b, NULL, a, res, nres, inf, rank, coord, e);
}

static int m_to_host(backend_t *b, backend_stream_t *s, const agent_tensor_t *t, void *dst,
                     meshd_error_t *e) {
  logf_("to_host %d", s ? s->id : 0);
  return cpu_backend_ops.to_host(b, NULL, t, dst, e);
}

static void m_session_end(backend_t *b, uint64_t session) { logf_("end %016llx", (unsigned long long)session); }

static backend_ops_t mock_ops;
static backend_t B;
static _Atomic int64_t rank0;
static executor_t *X;
static _Atomic uint64_t reported;

static void on_report(const executor_report_t *r, void *arg) {
  atomic_store(&reported, r->executed_through);
}

static void setup(void) {
  mock_ops = cpu_backend_ops;
  mock_ops.name = "mock-gpu";
  mock_ops.stream_create = m_stream_create;
  mock_ops.stream_destroy = m_stream_destroy;
  mock_ops.stream_sync = m_stream_sync;
  mock_ops.event_record = m_event_record;
  mock_ops.event_wait = m_event_wait;
  mock_ops.event_destroy = m_event_destroy;
  mock_ops.run_op = m_run_op;
  mock_ops.to_host = m_to_host;
  mock_ops.session_end = m_session_end;
  memset(&B, 0, sizeof B);
  B.ops = &mock_ops;
  B.capacity = 1 << 20;
  meshd_error_t e;
  cr_assert_eq(cpu_backend_ops.open(&B, "cpu", &e), 0, "%s", e.msg);
  nlog = next_stream = 0;
  gate_open = false;
  sync_fail = wait_fail = create_fail = 0;
  atomic_store(&reported, 0);
  static run_env_t env;
  env = (run_env_t){.backend = &B, .rank = &rank0};
  X = executor_create(&env, on_report, NULL);
  cr_assert_not_null(X);
}

static void teardown(void) {
  pthread_mutex_lock(&mu);
  gate_open = true;
  pthread_cond_broadcast(&gate_cv);
  pthread_mutex_unlock(&mu);
  executor_close(X);
  /* the workers end on their own; give them a moment before the backend goes */
  for (int i = 0; i < 200 && atomic_load(&B.allocated); i++) nanosleep(&(struct timespec){0, 5000000}, NULL);
  cpu_backend_ops.close(&B);
}

TestSuite(executor_streams_mock_gpu, .init = setup, .fini = teardown, .timeout = 30);

static void open_gate(void) {
  pthread_mutex_lock(&mu);
  gate_open = true;
  pthread_cond_broadcast(&gate_cv);
  pthread_mutex_unlock(&mu);
}

/* Index of the first log line equal to want at or after `from`, or -1. */
static int find_line(const char *want, int from) {
  pthread_mutex_lock(&mu);
  int at = -1;
  for (int i = from; i < nlog && at < 0; i++)
    if (!strcmp(log_lines[i], want)) at = i;
  pthread_mutex_unlock(&mu);
  return at;
}

/* The device stream id the op `name` ran on, or -1. */
static int stream_of_op(const char *name) {
  int id = -1;
  char fmt[64];
  snprintf(fmt, sizeof fmt, " %s", name);
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nlog && id < 0; i++) {
    size_t n = strlen(log_lines[i]), k = strlen(fmt);
    if (!strncmp(log_lines[i], "op ", 3) && n > k && !strcmp(log_lines[i] + n - k, fmt))
      id = atoi(log_lines[i] + 3);
  }
  pthread_mutex_unlock(&mu);
  return id;
}

static void dump_log(void) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nlog; i++) fprintf(stderr, "  log %2d: %s\n", i, log_lines[i]);
  pthread_mutex_unlock(&mu);
}

/* ---- instructions ---- */

static const char *SESSION = "mock-gpu-session";

typedef Meshd__Agent__V1__Instruction instr_t;

static void submit(instr_t *ins, uint64_t seq, uint64_t stream) {
  ins->seq = seq;
  ins->session_id = (char *)SESSION;
  ins->stream = stream;
  cr_assert_eq(executor_submit(X, ins), 0, "seq %llu", (unsigned long long)seq);
}

static void submit_factory_ones(uint64_t seq, uint64_t stream, uint64_t ref) {
  factory_instr_t b;
  submit(factory_instr(&b, "ones", ref, 4, MESHD__V1__DTYPE__DTYPE_FLOAT32), seq, stream);
}

static void submit_borrow(uint64_t seq, uint64_t stream, Meshd__Agent__V1__BorrowOp__Phase phase,
                          uint64_t borrow, uint64_t tensor, uint64_t result) {
  borrow_instr_t b;
  submit(borrow_instr(&b, phase, borrow, tensor, result), seq, stream);
}

static void submit_add(uint64_t seq, uint64_t stream, uint64_t a, uint64_t out) {
  static int64_t shape[] = {4};
  Meshd__V1__Arg x = MESHD__V1__ARG__INIT;
  x.value_case = MESHD__V1__ARG__VALUE_REF;
  x.ref = a;
  Meshd__V1__Arg *args[] = {&x, &x};
  Meshd__Agent__V1__TensorSpec res = MESHD__AGENT__V1__TENSOR_SPEC__INIT;
  res.ref = out;
  res.n_shape = 1;
  res.shape = shape;
  res.dtype = MESHD__V1__DTYPE__DTYPE_FLOAT32;
  Meshd__Agent__V1__TensorSpec *results[] = {&res};
  Meshd__Agent__V1__OpCall call = MESHD__AGENT__V1__OP_CALL__INIT;
  call.op = "add";
  call.n_args = 2;
  call.args = args;
  call.n_results = 1;
  call.results = results;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CALL;
  ins.call = &call;
  submit(&ins, seq, stream);
}

static void submit_end(uint64_t seq) {
  Meshd__Agent__V1__EndSession end = MESHD__AGENT__V1__END_SESSION__INIT;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION;
  ins.end_session = &end;
  submit(&ins, seq, 0);
}

/* A borrow of ref 10 (made on stream 1) used on stream 2 and dropped. */
static void submit_borrow_program(void) {
  submit_factory_ones(1, 1, 10);
  submit_borrow(2, 1, MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE, 1, 10, 11);
  submit_add(3, 2, 11, 12);
  submit_borrow(4, 2, MESHD__AGENT__V1__BORROW_OP__PHASE__LAST_USE, 1, 10, 11);
  submit_borrow(5, 1, MESHD__AGENT__V1__BORROW_OP__PHASE__DROP, 1, 10, 11);
}

static void expect_twos(uint64_t ref) {
  agent_tensor_t t;
  ref_failure_t why;
  cr_assert_eq(executor_lookup(X, SESSION, ref, &t, &why), 0, "ref %llu: %s",
               (unsigned long long)ref, why.msg);
  float v[4];
  meshd_error_t e;
  cr_assert_eq(cpu_backend_ops.to_host(&B, NULL, &t, v, &e), 0);
  storage_release(t.storage);
  for (int i = 0; i < 4; i++) cr_assert_eq(v[i], 2.0f, "element %d: %g", i, v[i]);
}

/* ---- tests ---- */

Test(executor_streams_mock_gpu, borrows_order_device_streams_with_events) {
  open_gate();
  submit_borrow_program();
  cr_assert_eq(executor_wait(X, 5, 10000), 0, "executed through 5");
  expect_twos(12);
  int s1 = stream_of_op("ones"), s2 = stream_of_op("add");
  cr_assert(s1 > 0 && s2 > 0 && s1 != s2, "factory on stream %d, add on stream %d", s1, s2);
  char line[64];
  /* first use: the borrowing stream waits for an event recorded on the origin */
  snprintf(line, sizeof line, "record %d", s1);
  int rec = find_line(line, 0);
  snprintf(line, sizeof line, "wait %d<-%d", s2, s1);
  int wait = find_line(line, rec < 0 ? 0 : rec);
  snprintf(line, sizeof line, "op %d add", s2);
  int add = find_line(line, 0);
  if (rec < 0 || wait < 0 || add < 0 || wait > add) dump_log();
  cr_assert(rec >= 0 && wait > rec && add > wait,
            "stream %d must wait on an event of stream %d before the add", s2, s1);
  /* drop: the origin waits for an event recorded on the borrower after its last use */
  snprintf(line, sizeof line, "record %d", s2);
  int rec2 = find_line(line, add);
  snprintf(line, sizeof line, "wait %d<-%d", s1, s2);
  int wait2 = find_line(line, rec2 < 0 ? 0 : rec2);
  if (rec2 < 0 || wait2 < 0) dump_log();
  cr_assert(rec2 > add && wait2 > rec2, "the drop must make stream %d wait on stream %d", s1, s2);
  /* exactly one device stream per (session, stream) */
  cr_assert_eq(find_line("create 3", 0), -1, "a third device stream was made");
}

/* ones [4] as ref 10 on stream 1 (seq 1), its Snapshot (seq 2), taken as a
 * Read takes it. */
static snapshot_t *snapshot_of_ones(void) {
  open_gate();
  submit_factory_ones(1, 1, 10);
  Meshd__Agent__V1__Snapshot snap = MESHD__AGENT__V1__SNAPSHOT__INIT;
  snap.ref = 10;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT;
  ins.snapshot = &snap;
  submit(&ins, 2, 1);
  cr_assert_eq(executor_wait(X, 2, 10000), 0, "executed through 2");
  snapshot_t *sn = NULL;
  ref_failure_t why = {0};
  cr_assert_eq(executor_take_snapshot(X, SESSION, 2, 10, &sn, &why), 0, "%s", why.msg);
  return sn;
}

/* A Fetch's Read copies the tensor as its Snapshot left it, on a device
 * stream of its own that waits for an event recorded at the Snapshot: never
 * on the session's stream (it would wait for what the stream queued after
 * the Snapshot) nor on the backend's own (shared by every session). */
Test(executor_streams_mock_gpu, a_snapshot_is_read_on_its_own_stream_after_its_point) {
  snapshot_t *sn = snapshot_of_ones();
  ref_failure_t why = {0};
  float v[4];
  meshd_error_t e;
  cr_assert_eq(snapshot_read(sn, 0, sizeof v, v, &e), 0, "%s", e.msg);
  cr_assert_eq(snapshot_read(sn, 0, sizeof v, v, &e), 0, "%s", e.msg);
  for (int i = 0; i < 4; i++) cr_assert_eq(v[i], 1.0f, "element %d: %g", i, v[i]);
  int s1 = stream_of_op("ones");
  char line[64];
  snprintf(line, sizeof line, "record %d", s1);
  int rec = find_line(line, 0);
  snprintf(line, sizeof line, "create %d", s1 + 1);
  int made = find_line(line, 0);
  snprintf(line, sizeof line, "wait %d<-%d", s1 + 1, s1);
  int wait = find_line(line, 0);
  snprintf(line, sizeof line, "to_host %d", s1 + 1);
  int copy = find_line(line, 0), again = find_line(line, copy + 1);
  if (rec < 0 || made < 0 || wait < rec || copy < wait || again < copy) dump_log();
  cr_assert(rec >= 0 && made >= 0 && wait > rec && wait > made && copy > wait && again > copy,
            "the reads must copy on a stream of their own, after the Snapshot's event");
  cr_assert_eq(find_line("create 3", 0), -1, "one stream for the snapshot's reads, not one each");
  /* A write to the tensor moves the snapshot to host memory: its stream goes
   * then (every live stream costs each free an event), not at its release. */
  agent_tensor_t t;
  cr_assert_eq(executor_lookup(X, SESSION, 10, &t, &why), 0, "%s", why.msg);
  cr_assert_eq(snapshot_before_write(&B, t.storage, &e), 0, "%s", e.msg);
  storage_release(t.storage);
  snprintf(line, sizeof line, "destroy %d", s1 + 1);
  cr_assert_geq(find_line(line, again), 0, "the reads' stream goes once the snapshot is on the host");
  cr_assert_eq(snapshot_read(sn, 0, sizeof v, v, &e), 0, "%s", e.msg);
  for (int i = 0; i < 4; i++) cr_assert_eq(v[i], 1.0f, "element %d from host: %g", i, v[i]);
  snapshot_release(sn);
}

/* A snapshot read, then released, takes its read stream with it. */
Test(executor_streams_mock_gpu, a_snapshot_read_to_its_end_releases_its_stream) {
  snapshot_t *sn = snapshot_of_ones();
  float v[4];
  meshd_error_t e;
  cr_assert_eq(snapshot_read(sn, 0, sizeof v, v, &e), 0, "%s", e.msg);
  snapshot_release(sn);
  int s1 = stream_of_op("ones");
  char line[64];
  snprintf(line, sizeof line, "destroy %d", s1 + 1);
  cr_assert_geq(find_line(line, 0), 0, "the reads' stream goes with the snapshot");
}

Test(executor_streams_mock_gpu, a_stream_wait_that_fails_falls_back_to_a_host_sync) {
  /* The device refused to order the borrower after the origin's event: the
   * origin stream is synchronised on the host before the borrower's add. */
  wait_fail = 1;
  open_gate();
  submit_borrow_program();
  cr_assert_eq(executor_wait(X, 5, 10000), 0, "executed through 5");
  expect_twos(12);
  int s1 = stream_of_op("ones"), s2 = stream_of_op("add");
  char line[64];
  snprintf(line, sizeof line, "wait-failed %d<-%d", s2, s1);
  int failed = find_line(line, 0);
  snprintf(line, sizeof line, "sync %d", s1);
  int sync = find_line(line, failed < 0 ? 0 : failed);
  snprintf(line, sizeof line, "op %d add", s2);
  int add = find_line(line, 0);
  if (failed < 0 || sync < 0 || add < 0 || sync > add) dump_log();
  cr_assert(failed >= 0 && sync > failed && add > sync,
            "after a failed wait, stream %d must be synchronised before the add on %d", s1, s2);
}

Test(executor_streams_mock_gpu, a_stream_the_device_cannot_make_fails_its_instructions) {
  /* Stream 1's device stream cannot be made: its instructions fail, naming
   * why, instead of running on a stream (and library handles) other threads
   * use; stream 2 runs as usual. */
  create_fail = 1;
  open_gate();
  submit_factory_ones(1, 1, 10);
  cr_assert_eq(executor_wait(X, 1, 10000), 0, "executed through 1"); /* stream 1's made first */
  submit_factory_ones(2, 2, 20);
  cr_assert_eq(executor_wait(X, 2, 10000), 0, "executed through 2");
  agent_tensor_t t;
  ref_failure_t why;
  cr_assert_neq(executor_lookup(X, SESSION, 10, &t, &why), 0, "ref 10 ran without a stream");
  cr_assert(strstr(why.msg, "could not create a device stream for stream 1"), "%s", why.msg);
  cr_assert_eq(executor_lookup(X, SESSION, 20, &t, &why), 0, "%s", why.msg);
  storage_release(t.storage);
  cr_assert_eq(stream_of_op("ones"), 1, "stream 2's factory on the one device stream made");
}

Test(executor_streams_mock_gpu, the_watermark_waits_for_the_device) {
  submit_borrow_program();
  /* every kernel is queued, but no stream has synchronised: nothing is executed */
  cr_assert_eq(executor_wait(X, 1, 300), -1, "seq 1 executed before its stream synchronised");
  cr_assert_eq(executor_executed(X), 0);
  cr_assert_eq(atomic_load(&reported), 0, "a report ran ahead of the device");
  open_gate();
  cr_assert_eq(executor_wait(X, 5, 10000), 0);
  cr_assert(find_line("sync 1", 0) >= 0 && find_line("sync 2", 0) >= 0,
            "both streams ran work and synchronised");
  expect_twos(12);
}

Test(executor_streams_mock_gpu, a_failed_sync_is_logged_and_execution_goes_on) {
  sync_fail = 1;
  open_gate();
  submit_factory_ones(1, 1, 10);
  cr_assert_eq(executor_wait(X, 1, 10000), 0, "a device error must not stall the watermark");
  submit_add(2, 1, 10, 12);
  cr_assert_eq(executor_wait(X, 2, 10000), 0);
  expect_twos(12);
}

Test(executor_streams_mock_gpu, session_end_destroys_streams_and_releases_comms) {
  open_gate();
  submit_borrow_program();
  submit_end(6);
  cr_assert_eq(executor_wait(X, 6, 10000), 0);
  for (int i = 0; i < 200 && find_line("destroy 2", 0) < 0; i++)
    nanosleep(&(struct timespec){0, 5000000}, NULL);
  cr_assert_geq(find_line("destroy 1", 0), 0);
  cr_assert_geq(find_line("destroy 2", 0), 0);
  uint64_t key = 1469598103934665603ull; /* FNV-1a of the session id (dp_group_t.session) */
  for (const char *p = SESSION; *p; p++) key = (key ^ (uint8_t)*p) * 1099511628211ull;
  char line[64];
  snprintf(line, sizeof line, "end %016llx", (unsigned long long)key);
  int end = find_line(line, 0);
  if (end < 0) dump_log();
  cr_assert_geq(end, 0, "session_end with the session's key");
  cr_assert_gt(end, find_line("destroy 2", 0) > find_line("destroy 1", 0)
                        ? find_line("destroy 2", 0) : find_line("destroy 1", 0),
               "communicators are released after the streams");
  cr_assert_eq(atomic_load(&B.allocated), 0, "the session's memory is freed");
}

/* review: a read whose ordering failed once (event_wait) makes a second
 * stream on the next read; the first one must not be left behind (it stays in
 * the backend's stream list for good otherwise: every free waits on it). */
Test(executor_streams_mock_gpu, a_failed_read_ordering_leaves_no_stream_behind) {
  snapshot_t *sn = snapshot_of_ones();
  float v[4];
  meshd_error_t e;
  pthread_mutex_lock(&mu);
  wait_fail = 1;
  pthread_mutex_unlock(&mu);
  cr_assert_neq(snapshot_read(sn, 0, sizeof v, v, &e), 0, "the read's ordering failed");
  cr_assert_eq(snapshot_read(sn, 0, sizeof v, v, &e), 0, "%s", e.msg);
  snapshot_release(sn);
  int s1 = stream_of_op("ones");
  char line[64];
  for (int id = s1 + 1; id <= s1 + 2; id++) {
    snprintf(line, sizeof line, "create %d", id);
    if (find_line(line, 0) < 0) continue;
    snprintf(line, sizeof line, "destroy %d", id);
    if (find_line(line, 0) < 0) dump_log();
    cr_assert_geq(find_line(line, 0), 0, "stream %d made for the snapshot's reads is never destroyed", id);
  }
}
