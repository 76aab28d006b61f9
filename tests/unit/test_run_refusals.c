/* A member that fails a collective on its own, before it joins the data plane
 * call its peers run, must tell them why at once (dp_refuse): they fail
 * naming its rank and the cause, well before --comm-timeout-ms, instead of
 * waiting it out and blaming a connection.
 *
 * - agent/executor.c: a Reduce refused only by this agent's own
 *   --max-tensor-elements (QUOTA, validate.h) when no stream worker can be
 *   started for it (this suite's pthread_create fails once, when armed);
 *   and, the same way, that its seq is not done, for its session either,
 *   before its failure is queued (a peer that never answers holds the
 *   refuser thread); and that the later instructions of its stream run only
 *   after that thread failed its results (a lowered worker cap and a held
 *   refuser: executor_set_max_workers_for_test, _set_refuser_hold_for_test);
 *   and that an instruction with no data plane call, failed at once as it
 *   is routed, fails its results and what it writes in place (run_refused),
 *   but for a DeleteRefs, which still deletes; and that a DropSnapshot
 *   queued behind a held instruction (a held refuser) is done at once;
 * - agent/dataplane/transfer.c: dp__plan_init's own allocations fail (this
 *   suite's calloc refuses the plan's transfer array once, on the armed
 *   thread only). Both interpositions are off under ASan and TSan, whose
 *   allocators and thread starts they would bypass (TSan's free of a calloc
 *   from libc aborts). */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "backend.h"
#include "dataplane/dataplane.h"
#include "dataplane/dp_internal.h"
#include "executor.h"
#include "instr_build.h"
#include "layout.h"
#include "refs.h"
#include "session_state.h"
#include "snapshot.h"

typedef Meshd__Agent__V1__Instruction instr_t;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define INTERPOSED 0
#else
#define INTERPOSED 1
#endif

#if INTERPOSED
static _Atomic bool fail_next_detached; /* the next detached thread of the armed thread */
static pthread_t armed_thread;

int pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*fn)(void *), void *arg) {
  static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
  if (!real) real = (int (*)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *))
                        dlsym(RTLD_NEXT, "pthread_create");
  int detached = 0;
  if (attr) pthread_attr_getdetachstate(attr, &detached);
  if (detached == PTHREAD_CREATE_DETACHED && atomic_load(&fail_next_detached) &&
      pthread_equal(pthread_self(), armed_thread) && atomic_exchange(&fail_next_detached, false))
    return EAGAIN;
  return real(t, attr, fn, arg);
}

extern void *__libc_calloc(size_t n, size_t size);
static _Thread_local bool fail_plan_calloc; /* the next calloc of a plan's xfer_t array */
static atomic_int plan_calloc_fired;

void *calloc(size_t n, size_t size) {
  if (fail_plan_calloc && size == sizeof(xfer_t)) {
    fail_plan_calloc = false;
    atomic_store(&plan_calloc_fired, 1);
    return NULL;
  }
  return __libc_calloc(n, size);
}
#endif

static const char *SESSION = "refusal-session";
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char errors[16][700];
static uint64_t error_seqs[16], error_refs[16];
static int nerrors;

/* A report that said SESSION ran seq 1 (listed with its own watermark past
 * it, or not listed: it ran everything taken) before one carried seq 1's
 * failure: the server would read seq 1 as done and fine. */
static bool ran_seq1, ran_seq1_before_its_failure;

static void on_report(const executor_report_t *r, void *arg) {
  (void)arg;
  pthread_mutex_lock(&mu);
  bool failure_seen = false;
  for (int k = 0; k < nerrors; k++) failure_seen |= error_seqs[k] == 1;
  for (size_t i = 0; i < r->n_errors && nerrors < 16; i++) {
    snprintf(errors[nerrors], sizeof errors[0], "%s", r->errors[i]->message);
    error_refs[nerrors] = r->errors[i]->ref;
    failure_seen |= r->errors[i]->seq == 1;
    error_seqs[nerrors++] = r->errors[i]->seq;
  }
  uint64_t through = r->received_through;
  for (size_t i = 0; i < r->n_sessions; i++)
    if (strcmp(r->sessions[i]->session_id, SESSION) == 0)
      through = r->sessions[i]->executed_through;
  if (through >= 1 && !ran_seq1) {
    ran_seq1 = true;
    ran_seq1_before_its_failure = !failure_seen;
  }
  pthread_mutex_unlock(&mu);
}

/* The failure reported for seq (a bounded wait, kicking the reporter), or NULL. */
__attribute__((unused)) static const char *wait_error(executor_t *x, uint64_t seq) {
  const char *m = NULL;
  for (int i = 0; i < 1000 && !m; i++) {
    pthread_mutex_lock(&mu);
    for (int k = 0; k < nerrors && !m; k++)
      if (error_seqs[k] == seq) m = errors[k];
    pthread_mutex_unlock(&mu);
    if (!m) {
      executor_kick(x);
      nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
  }
  return m;
}

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One member's allreduce of 8 floats, call 3 of comm 9 (data plane call 12,
 * as an instruction's Group.call 3), on its own data plane. */
typedef struct {
  dataplane_t *dp;
  const char *const *addrs;
  const uint8_t *secret;
  uint32_t me;
  bool oom; /* its plan's allocation fails */
  int rc;
  meshd_error_t err;
  int64_t took_ms;
} member_job_t;

static const uint32_t RANKS[2] = {0, 1};

__attribute__((unused)) static void *member_allreduce(void *arg) {
  member_job_t *j = arg;
  dp_group_t g = {.comm_id = 9, .call = 3 * 4, .ranks = RANKS, .addrs = j->addrs, .n = 2,
                  .me = j->me, .secret = j->secret};
  float v[8] = {1, 1, 1, 1, 1, 1, 1, 1};
#if INTERPOSED
  fail_plan_calloc = j->oom;
#endif
  int64_t t0 = mono_ms();
  j->rc = dp_allreduce(j->dp, &g, v, 8, DTYPE_FLOAT32, RED_SUM, &j->err);
  j->took_ms = mono_ms() - t0;
  return NULL;
}

__attribute__((unused)) static const uint8_t SECRET[32] = "0123456789abcdef0123456789abcde";

/* A Reduce (sum) of ref 1, n floats, into ref 9001 over ranks 0 and 1 at
 * addrs (comm 9, call 3), as seq 1 of SESSION on stream 1; built in place. */
typedef struct {
  int64_t shape[1];
  Meshd__V1__Reduce r;
  Meshd__Agent__V1__TensorSpec is, rs;
  Meshd__Agent__V1__Group g;
  Meshd__Agent__V1__ReduceOp ro;
  instr_t ins;
} reduce_instr_t;

__attribute__((unused)) static instr_t *reduce_instr(reduce_instr_t *b, const char **addrs,
                                                     int64_t n) {
  b->shape[0] = n;
  meshd__v1__reduce__init(&b->r);
  b->r.ref = 9001;
  b->r.input = 1;
  b->r.reduction = "sum";
  meshd__agent__v1__tensor_spec__init(&b->is);
  meshd__agent__v1__tensor_spec__init(&b->rs);
  b->is.ref = 1;
  b->rs.ref = 9001;
  b->is.n_shape = b->rs.n_shape = 1;
  b->is.shape = b->rs.shape = b->shape;
  b->is.dtype = b->rs.dtype = (Meshd__V1__DType)DTYPE_FLOAT32;
  meshd__agent__v1__group__init(&b->g);
  b->g.n_ranks = b->g.n_addresses = 2;
  b->g.ranks = (uint32_t *)RANKS;
  b->g.addresses = (char **)addrs;
  b->g.comm_id = 9;
  b->g.call = 3;
  b->g.secret.len = 32;
  b->g.secret.data = (uint8_t *)SECRET;
  meshd__agent__v1__reduce_op__init(&b->ro);
  b->ro.reduce = &b->r;
  b->ro.input = &b->is;
  b->ro.result = &b->rs;
  b->ro.group = &b->g;
  meshd__agent__v1__instruction__init(&b->ins);
  b->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE;
  b->ins.reduce = &b->ro;
  b->ins.seq = 1;
  b->ins.session_id = (char *)SESSION;
  b->ins.stream = 1;
  return &b->ins;
}

/* Rank 0's agent: an executor on the cpu backend reporting to on_report and,
 * when comm_timeout_ms > 0, its own data plane (that comm timeout) at me,
 * with its peer, rank 1, at other (127.0.0.1:peer_port): addrs, by rank. */
typedef struct {
  backend_t b;
  _Atomic int64_t rank;
  run_env_t env;
  executor_t *x;
  char me[64], other[64];
  const char *addrs[2];
} rank0_agent_t;

static void rank0_agent_start(rank0_agent_t *a, int comm_timeout_ms, int peer_port) {
  *a = (rank0_agent_t){.b = {.ops = &cpu_backend_ops, .capacity = 1 << 26}};
  meshd_error_t e = {0};
  cr_assert_eq(cpu_backend_ops.open(&a->b, "cpu", &e), 0, "%s", e.msg);
  a->env = (run_env_t){.backend = &a->b, .rank = &a->rank};
  if (comm_timeout_ms > 0) {
    a->b.net = dataplane_start("127.0.0.1", 0, comm_timeout_ms, &e);
    cr_assert_not_null(a->b.net, "%s", e.msg);
    snprintf(a->me, sizeof a->me, "127.0.0.1:%d", dataplane_port(a->b.net));
    snprintf(a->other, sizeof a->other, "127.0.0.1:%d", peer_port);
    a->env.data_address = a->me;
  }
  a->addrs[0] = a->me;
  a->addrs[1] = a->other;
  a->x = executor_create(&a->env, on_report, NULL);
  cr_assert_not_null(a->x);
}

static void rank0_agent_stop(rank0_agent_t *a) {
  dataplane_t *net = a->b.net;
  executor_close(a->x);
  cr_assert_eq(executor_wait_all_freed(10000), 0);
  cpu_backend_ops.close(&a->b);
  if (net) dataplane_stop(net);
}

#if INTERPOSED
/* Submits ins while no stream worker can be started for it (the next
 * detached thread this thread creates fails): true if one was asked for, so
 * that the instruction went to a refuser thread. */
static bool submit_with_no_worker(executor_t *x, instr_t *ins) {
  armed_thread = pthread_self();
  atomic_store(&fail_next_detached, true);
  executor_submit(x, ins); /* -1 or 0: either way it is not run */
  return !atomic_exchange(&fail_next_detached, false);
}
#endif

/* Rank 0's agent has --max-tensor-elements 4, below the Reduce's 8 elements
 * that its peer (and the server) accept; it has no stream worker for the
 * Reduce's stream (no thread). It refuses the Reduce in its checks (QUOTA:
 * its own limits only) and, as it cannot queue it, on a refuser thread of
 * its own: that thread must tell the peer, which waits in the allreduce. */
Test(run_refusals, a_collective_over_the_agents_own_limits_it_cannot_queue_fails_its_peers_at_once,
     .timeout = 60) {
#if !INTERPOSED
  cr_skip_test("pthread_create is interposed");
#else
  meshd_error_t e = {0};
  dataplane_t *peer = dataplane_start("127.0.0.1", 1, 10000, &e);
  cr_assert_not_null(peer, "%s", e.msg);
  rank0_agent_t a;
  rank0_agent_start(&a, 10000, dataplane_port(peer));
  executor_t *x = a.x;
  layout_set_limits(&(layout_limits_t){.max_dims = 8, .max_elements = 4});

  member_job_t pj = {.dp = peer, .addrs = a.addrs, .secret = SECRET, .me = 1};
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, member_allreduce, &pj), 0);
  usleep(100 * 1000); /* the peer waits for rank 0 */

  reduce_instr_t ri;
  bool fired = submit_with_no_worker(x, reduce_instr(&ri, a.addrs, 8));
  pthread_join(th, NULL);
  cr_assert(fired, "no worker thread was asked for");
  cr_assert_eq(executor_wait(x, 1, 10000), 0, "seq 1 not done");
  const char *m = wait_error(x, 1);
  cr_assert_not_null(m, "no error reported for the Reduce");
  cr_assert(strstr(m, "--max-tensor-elements"), "the agent's error: %s", m);
  cr_assert_eq(pj.rc, -1, "the peer's allreduce succeeded");
  cr_assert(pj.took_ms < 3000, "the peer failed after %lld ms (comm timeout 10 s): %s",
            (long long)pj.took_ms, pj.err.msg);
  cr_assert(strstr(pj.err.msg, "rank 0") && strstr(pj.err.msg, "--max-tensor-elements"),
            "the peer's error does not say why rank 0 did not take part: %s", pj.err.msg);
  layout_set_limits(NULL);
  rank0_agent_stop(&a);
  dataplane_stop(peer);
#endif
}

/* A Reduce that no stream worker can be started for is refused on a
 * refuser thread, which tells its peers before it fails the result: here
 * the peer is a listener that never answers, so the telling takes the data
 * plane's whole timeout. The session had no stream with work pending, so its
 * own watermark (a report's session list, executor_wait_session: what a
 * Read of the result waits for) passed seq 1 at once, while its failure came
 * only when the refuser was done: a Read then found the result missing (or
 * an old value) instead of the failure. */
Test(run_refusals, a_refused_instruction_on_a_refuser_thread_is_not_done_before_its_failure,
     .timeout = 60) {
#if !INTERPOSED
  cr_skip_test("pthread_create is interposed");
#else
  /* The peer: accepts connections (the kernel does) and never answers. */
  int silent = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t slen = sizeof sa;
  cr_assert(silent >= 0 && bind(silent, (struct sockaddr *)&sa, sizeof sa) == 0 &&
            listen(silent, 8) == 0 && getsockname(silent, (struct sockaddr *)&sa, &slen) == 0);
  rank0_agent_t a;
  rank0_agent_start(&a, 1000, ntohs(sa.sin_port));
  executor_t *x = a.x;

  reduce_instr_t ri;
  cr_assert(submit_with_no_worker(x, reduce_instr(&ri, a.addrs, 8)),
            "no worker thread was asked for");
  /* The refuser dials the silent peer until the data plane's timeout. */
  bool early = executor_wait_session(x, SESSION, 1, 0) == 0;
  const char *m = NULL;
  pthread_mutex_lock(&mu);
  for (int k = 0; k < nerrors && !m; k++)
    if (error_seqs[k] == 1) m = errors[k];
  pthread_mutex_unlock(&mu);
  cr_expect(!early || m, "the session had run seq 1 while its failure was not queued");
  for (int i = 0; i < 10 && executor_wait(x, 1, 0) != 0; i++) { /* reports while it refuses */
    executor_kick(x);
    nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
  }
  cr_assert_eq(executor_wait(x, 1, 20000), 0, "seq 1 not done");
  cr_assert_eq(executor_wait_session(x, SESSION, 1, 0), 0);
  m = wait_error(x, 1);
  cr_assert_not_null(m, "no error reported for the Reduce");
  cr_assert(strstr(m, "queueing instruction seq 1"), "the agent's error: %s", m);
  for (int i = 0; i < 500; i++) { /* a report that covers seq 1 */
    pthread_mutex_lock(&mu);
    bool ran = ran_seq1;
    pthread_mutex_unlock(&mu);
    if (ran) break;
    executor_kick(x);
    nanosleep(&(struct timespec){0, 2000000}, NULL);
  }
  pthread_mutex_lock(&mu);
  bool ran = ran_seq1, before = ran_seq1_before_its_failure;
  pthread_mutex_unlock(&mu);
  cr_assert(ran, "no report said the session ran seq 1");
  cr_assert(!before, "a report said the session ran seq 1 before one carried its failure");
  rank0_agent_stop(&a);
  close(silent);
#endif
}

/* The test's hold of a refuser thread (executor_set_refuser_hold_for_test):
 * until let_go, bounded so that a hang fails rather than the CI clock. */
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static uint64_t held_seq;
static bool let_go;

static struct timespec in_10s(void) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 10;
  return dl;
}

static void hold_refuser(void *arg, uint64_t seq) {
  (void)arg;
  struct timespec dl = in_10s();
  pthread_mutex_lock(&hold_mu);
  held_seq = seq;
  pthread_cond_broadcast(&hold_cv);
  while (!let_go && pthread_cond_timedwait(&hold_cv, &hold_mu, &dl) == 0) {
  }
  pthread_mutex_unlock(&hold_mu);
}

/* Submits ins as instruction seq of SESSION on stream: executor_submit's result. */
static int submit_on(executor_t *x, instr_t *ins, uint64_t seq, uint64_t stream) {
  ins->seq = seq;
  ins->session_id = (char *)SESSION;
  ins->stream = stream;
  return executor_submit(x, ins);
}

static void submit_seq(executor_t *x, instr_t *ins, uint64_t seq) { submit_on(x, ins, seq, 1); }

/* A started agent with SESSION open (seq 1) and no stream worker to be had:
 * what is routed goes to refuser threads, which the test holds
 * (hold_refuser) until release_refuser. */
static executor_t *refusing_agent(rank0_agent_t *a) {
  rank0_agent_start(a, 0, 0);
  executor_t *x = a->x;
  executor_set_refuser_hold_for_test(x, hold_refuser, NULL);
  executor_set_max_workers_for_test(x, 0);
  control_instr_t ci;
  submit_seq(x, control_instr(&ci, MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS), 1);
  return x;
}

/* A Reduce into 9100 (a result of its own) as instruction seq on stream; on
 * a refusing_agent, a refuser thread takes it (held by the test). */
static void submit_reduce_9100(executor_t *x, reduce_instr_t *ri, uint64_t seq,
                               uint64_t stream) {
  static const char *addrs[2] = {"127.0.0.1:1", "127.0.0.1:2"}; /* no data plane: nobody to tell */
  instr_t *ins = reduce_instr(ri, addrs, 8);
  ri->r.ref = ri->rs.ref = 9100;
  submit_on(x, ins, seq, stream);
}

/* A Snapshot of ref (a Fetch's) as instruction seq on stream (submit copies it). */
static void submit_snapshot_on(executor_t *x, uint64_t ref, uint64_t seq, uint64_t stream) {
  Meshd__Agent__V1__Snapshot snap = MESHD__AGENT__V1__SNAPSHOT__INIT;
  snap.ref = ref;
  instr_t sins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  sins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT;
  sins.snapshot = &snap;
  submit_on(x, &sins, seq, stream);
}

/* A local SendTensor (a same-rank to_mesh) of ref in (8 floats) on stream
 * as ref out on to_stream, instruction seq. */
static void submit_local_copy(executor_t *x, uint64_t in, uint64_t out, uint64_t seq,
                              uint64_t stream, uint64_t to_stream) {
  int64_t shape[1] = {8};
  Meshd__Agent__V1__TensorSpec ispec = MESHD__AGENT__V1__TENSOR_SPEC__INIT, ospec;
  ispec.ref = in;
  ispec.n_shape = 1;
  ispec.shape = shape;
  ispec.dtype = (Meshd__V1__DType)DTYPE_FLOAT32;
  ospec = ispec;
  ospec.ref = out;
  Meshd__Agent__V1__SendTensor copy = MESHD__AGENT__V1__SEND_TENSOR__INIT;
  copy.input = &ispec;
  copy.result = &ospec;
  copy.to_stream = to_stream;
  instr_t cins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  cins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SEND;
  cins.send = &copy;
  submit_on(x, &cins, seq, stream);
}

static void submit_snapshot(executor_t *x, uint64_t ref, uint64_t seq) {
  submit_snapshot_on(x, ref, seq, 1);
}

/* The Snapshot seq took of ref (8 floats) is its failure with root seq root
 * (the queue's message), not the old value: `after` names what failed. */
static void assert_snapshot_failed(executor_t *x, uint64_t seq, uint64_t ref, uint64_t root,
                                   const char *after) {
  snapshot_t *sn = NULL;
  ref_failure_t why = {0};
  meshd_error_t e = {0};
  int rc = executor_take_snapshot(x, SESSION, seq, ref, &sn, &why);
  float v[8] = {0};
  if (rc == 0) {
    snapshot_read(sn, 0, sizeof v, v, &e);
    snapshot_release(sn);
  }
  cr_assert_eq(rc, 1, "the Snapshot after %s took ref %llu's old value (%g), not its failure "
               "(rc %d: %s)", after, (unsigned long long)ref, v[0], rc, why.msg);
  cr_assert_eq(why.root_seq, root, "the Snapshot's failure is not from %s: %s", after, why.msg);
  char want[64];
  snprintf(want, sizeof want, "queueing instruction seq %llu", (unsigned long long)root);
  cr_assert(strstr(why.msg, want), "the Snapshot's failure: %s", why.msg);
}

static void define_sevens(rank0_agent_t *a, uint64_t ref);

/* A Reduce into a tensor written before (out=, ref 9001, 8 floats of 7, an
 * upload) that no stream worker can be had for goes to a refuser thread,
 * outside its stream's order; a worker frees, and the next instructions of
 * the stream (a Fetch's Snapshot of the tensor, a copy of it) start the
 * stream and ran before the refuser failed the tensor: the Snapshot kept the
 * old 7s and the Fetch answered them as fine. Here the refuser is held until
 * the stream's worker has nothing it may run (it ran them, or they wait
 * behind the refuser); both must then see the Reduce's failure. */
Test(run_refusals, instructions_after_a_refused_one_on_its_stream_see_its_failure, .timeout = 30) {
  rank0_agent_t a;
  executor_t *x = refusing_agent(&a);
  define_sevens(&a, 9001);

  reduce_instr_t ri;
  const char *addrs[2] = {"127.0.0.1:1", "127.0.0.1:2"}; /* no data plane: nobody to tell */
  submit_seq(x, reduce_instr(&ri, addrs, 8), 2); /* no worker: a refuser, held */
  executor_set_max_workers_for_test(x, -1);       /* a worker frees */
  submit_snapshot(x, 9001, 3);
  submit_local_copy(x, 9001, 9002, 4, 1, 2); /* a value of its own, on stream 2 */
  cr_assert_eq(executor_wait_stream_idle_for_test(x, SESSION, 1, 10000), 0,
               "stream 1's worker never came to wait");
  struct timespec dl = in_10s();
  pthread_mutex_lock(&hold_mu);
  while (!held_seq && pthread_cond_timedwait(&hold_cv, &hold_mu, &dl) == 0) {
  }
  uint64_t held = held_seq;
  let_go = true;
  pthread_cond_broadcast(&hold_cv);
  pthread_mutex_unlock(&hold_mu);
  cr_assert_eq(held, 2, "the Reduce (seq 2) did not go to a refuser thread");
  cr_assert_eq(executor_wait(x, 4, 10000), 0, "seqs 2..4 not done");

  assert_snapshot_failed(x, 3, 9001, 2, "the refused Reduce");
  agent_tensor_t t;
  ref_failure_t why = {0};
  int rc = executor_lookup(x, SESSION, 9002, &t, &why);
  if (rc == 0) storage_release(t.storage);
  cr_assert_eq(rc, 1, "the copy after the refused Reduce copied ref 9001's old value (rc %d: %s)",
               rc, why.msg);
  cr_assert_eq(why.root_seq, 2, "the copy's failure is not the Reduce's: %s", why.msg);
  rank0_agent_stop(&a);
}

/* The seq the test's refuser threads (hold_refuser) hold last, once it is
 * `want` (0: any): a bounded wait. */
static uint64_t wait_held_for(uint64_t want) {
  struct timespec dl = in_10s();
  pthread_mutex_lock(&hold_mu);
  while ((want ? held_seq != want : !held_seq) &&
         pthread_cond_timedwait(&hold_cv, &hold_mu, &dl) == 0) {
  }
  uint64_t held = held_seq;
  pthread_mutex_unlock(&hold_mu);
  return held;
}

static uint64_t wait_held(void) { return wait_held_for(0); }

static void release_refuser(void) {
  pthread_mutex_lock(&hold_mu);
  let_go = true;
  pthread_cond_broadcast(&hold_cv);
  pthread_mutex_unlock(&hold_mu);
}

/* The DropSnapshot of Snapshot `of` as instruction seq on stream. */
static void submit_drop_snapshot(executor_t *x, uint64_t of, uint64_t seq, uint64_t stream) {
  Meshd__Agent__V1__DropSnapshot d = MESHD__AGENT__V1__DROP_SNAPSHOT__INIT;
  d.seq = of;
  instr_t dins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  dins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DROP_SNAPSHOT;
  dins.drop_snapshot = &d;
  submit_on(x, &dins, seq, stream);
}


/* A Fetch's DropSnapshot queued on its stream behind a long instruction
 * (here a Reduce its refuser thread holds, which stream 1's later
 * instructions wait for) while the session's next Fetches' Snapshots run on
 * another stream: the agent held one snapshot too many (it keeps the 64
 * latest unread) and let the oldest unread one go, another Fetch's (seq 2),
 * whose Read then failed NOT_FOUND. A drop is done as it arrives: of a
 * snapshot kept already (seq 3), and of one still queued (seq 6), which then
 * keeps nothing when it runs. */
Test(run_refusals, a_drop_snapshot_queued_behind_a_long_instruction_evicts_no_other_snapshot,
     .timeout = 30) {
  rank0_agent_t a;
  rank0_agent_start(&a, 0, 0);
  executor_t *x = a.x;
  executor_set_refuser_hold_for_test(x, hold_refuser, NULL);
  control_instr_t ci;
  submit_seq(x, control_instr(&ci, MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS), 1);
  define_sevens(&a, 9001);
  submit_snapshot_on(x, 9001, 2, 3); /* a Fetch whose Read comes last */
  submit_snapshot_on(x, 9001, 3, 3); /* a Fetch that ends unread */
  cr_assert_eq(executor_wait(x, 3, 10000), 0, "seqs 1..3 not done");

  executor_set_max_workers_for_test(x, 0); /* stream 1's Reduce goes to a refuser, held */
  reduce_instr_t ri;
  submit_reduce_9100(x, &ri, 4, 1);
  executor_set_max_workers_for_test(x, -1);
  cr_assert_eq(wait_held(), 4, "the Reduce (seq 4) did not go to a refuser thread");
  submit_drop_snapshot(x, 3, 5, 1); /* behind the Reduce */
  submit_snapshot_on(x, 9001, 6, 1); /* another Fetch, behind the Reduce too */
  submit_drop_snapshot(x, 6, 7, 1);
  enum { FIRST = 8, LAST = FIRST + SESSION_SNAPSHOTS_MAX - 2 }; /* 63 more on stream 2 */
  for (uint64_t seq = FIRST; seq <= LAST; seq++) submit_snapshot_on(x, 9001, seq, 2);
  cr_assert_eq(executor_wait_stream_idle_for_test(x, SESSION, 2, 10000), 0,
               "stream 2's worker never came to wait");
  release_refuser();
  cr_assert_eq(executor_wait(x, LAST, 10000), 0, "seqs 4..%d not done", LAST);

  snapshot_t *sn = NULL;
  ref_failure_t why = {0};
  for (uint64_t seq = 2; seq <= LAST; seq++) {
    if (seq >= 3 && seq < FIRST) continue;
    memset(&why, 0, sizeof why);
    int rc = executor_take_snapshot(x, SESSION, seq, 9001, &sn, &why);
    cr_assert_eq(rc, 0, "the unread snapshot of seq %llu went while drops waited (rc %d: %s)",
                 (unsigned long long)seq, rc, why.msg);
    snapshot_release(sn);
  }
  cr_assert_eq(executor_take_snapshot(x, SESSION, 3, 9001, &sn, &why), -1, "seq 3 not dropped");
  cr_assert_eq(executor_take_snapshot(x, SESSION, 6, 9001, &sn, &why), -1, "seq 6 kept a snapshot");
  rank0_agent_stop(&a);
}

/* DeleteRefs of refs[0..n) as instruction seq on stream: executor_submit's result. */
static int submit_delete(executor_t *x, uint64_t *refs, size_t n, uint64_t seq, uint64_t stream) {
  Meshd__Agent__V1__DeleteRefs d = MESHD__AGENT__V1__DELETE_REFS__INIT;
  d.n_refs = n;
  d.refs = refs;
  instr_t dins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  dins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS;
  dins.delete_refs = &d;
  return submit_on(x, &dins, seq, stream);
}

/* ref is not on the agent any more (deleted): neither a tensor nor a failure. */
static void assert_deleted(executor_t *x, uint64_t ref, const char *what) {
  agent_tensor_t t;
  ref_failure_t why = {0};
  int rc = executor_lookup(x, SESSION, ref, &t, &why);
  if (rc == 0) storage_release(t.storage);
  cr_assert_eq(rc, -1, "%s %llu is still on the agent (rc %d: %s)", what, (unsigned long long)ref,
               rc, rc == 1 ? why.msg : "a tensor");
}

/* A DeleteRefs that no stream worker can be had for (MAX_WORKERS) was failed
 * as it was routed: its tensor (an upload, 8 floats) stayed on the agent until
 * the session ended, a leak per session under load. Nothing before it on its
 * stream is still to run (the stream has no queue), so it deletes at once.
 * Behind a refuser thread of its stream (a held Reduce, which fails its
 * result 9100) it deletes once that is done: deleted before, 9100 was failed
 * again after it, and stayed. */
Test(run_refusals, a_delete_no_worker_can_be_had_for_still_deletes, .timeout = 30) {
  rank0_agent_t a;
  executor_t *x = refusing_agent(&a);
  uint64_t before = atomic_load(&a.b.allocated);
  define_sevens(&a, 9001);
  cr_assert_gt(atomic_load(&a.b.allocated), before);
  int submitted = submit_delete(x, (uint64_t[]){9001}, 1, 2, 1);
  cr_assert_eq(executor_wait(x, 2, 10000), 0, "seq 2 not done");
  assert_deleted(x, 9001, "the deleted tensor");
  cr_assert_eq(atomic_load(&a.b.allocated), before, "its memory was not freed");
  cr_assert_eq(submitted, 0, "the DeleteRefs was failed as it was routed");

  reduce_instr_t ri;
  submit_reduce_9100(x, &ri, 3, 5); /* no worker: a refuser, held */
  define_sevens(&a, 9002);
  submit_delete(x, (uint64_t[]){9100, 9002}, 2, 4, 5);
  cr_assert_eq(wait_held(), 3, "the Reduce (seq 3) did not go to a refuser thread");
  release_refuser();
  cr_assert_eq(executor_wait(x, 4, 10000), 0, "seqs 3, 4 not done");
  assert_deleted(x, 9100, "the refused Reduce's deleted result");
  assert_deleted(x, 9002, "the deleted tensor");
  cr_assert_eq(atomic_load(&a.b.allocated), before, "the memory was not freed");
  rank0_agent_stop(&a);
}

/* A DeleteRefs with no worker whose ref another stream still has to define
 * (a local SendTensor from stream 1 to stream 2, queued behind a held
 * refuser there): deleted at once, before the copy defined it, the copy's
 * tensor stayed until the session ended. It deletes once the definition is
 * queued (session_state_def_queued, then session_state_delete's wait). */
Test(run_refusals, a_delete_no_worker_can_be_had_for_waits_for_a_definition_to_come,
     .timeout = 30) {
  rank0_agent_t a;
  executor_t *x = refusing_agent(&a);
  define_sevens(&a, 9001);
  uint64_t before = atomic_load(&a.b.allocated);
  reduce_instr_t ri;
  submit_reduce_9100(x, &ri, 2, 1); /* no worker: a refuser, held */
  cr_assert_eq(wait_held(), 2, "the Reduce (seq 2) did not go to a refuser thread");
  executor_set_max_workers_for_test(x, -1); /* stream 1 gets a worker, behind the Reduce */
  submit_local_copy(x, 9001, 9002, 3, 1, 2);
  executor_set_max_workers_for_test(x, 0); /* stream 2 gets none */
  submit_delete(x, (uint64_t[]){9002}, 1, 4, 2);
  release_refuser();
  cr_assert_eq(executor_wait(x, 4, 10000), 0, "seqs 2..4 not done");
  assert_deleted(x, 9002, "the copy deleted after it");
  cr_assert_eq(atomic_load(&a.b.allocated), before, "the copy's memory was not freed");
  rank0_agent_stop(&a);
}

/* Deletes waiting on refuser threads (behind a held Reduce of their stream)
 * took the refusers' places: with 64 of them, a Reduce of another stream
 * that no worker could be had for got no refuser thread and failed without
 * telling its peers (they wait out the comm timeout). Deleters are bounded
 * apart (MAX_DELETERS), so it still gets one. */
Test(run_refusals, deletes_waiting_on_refuser_threads_leave_a_collective_its_refuser,
     .timeout = 30) {
  rank0_agent_t a;
  executor_t *x = refusing_agent(&a);
  reduce_instr_t ri;
  const char *addrs[2] = {"127.0.0.1:1", "127.0.0.1:2"}; /* no data plane: nobody to tell */
  submit_seq(x, reduce_instr(&ri, addrs, 8), 2); /* no worker: a refuser, held */
  cr_assert_eq(wait_held(), 2, "the Reduce (seq 2) did not go to a refuser thread");
  uint64_t seq = 3;
  for (int i = 0; i < 64; i++, seq++) /* each on a refuser thread, behind seq 2 */
    submit_delete(x, (uint64_t[]){9001}, 1, seq, 1);
  reduce_instr_t r2;
  submit_reduce_9100(x, &r2, seq, 2);
  uint64_t held = wait_held_for(seq);
  release_refuser();
  cr_assert_eq(held, seq, "the Reduce of stream 2 (seq %llu) got no refuser thread",
               (unsigned long long)seq);
  cr_assert_eq(executor_wait(x, seq, 10000), 0, "seqs 2..%llu not done", (unsigned long long)seq);
  rank0_agent_stop(&a);
}

/* add_(self, self) (a Call writing self in place, `mutates` it; no data
 * plane call) with result ref `result`, a view of it. */
typedef struct {
  Meshd__V1__Arg a0, a1;
  Meshd__V1__Arg *args[2];
  int64_t shape[1];
  Meshd__Agent__V1__TensorSpec res;
  Meshd__Agent__V1__TensorSpec *resp[1];
  uint64_t mutates[1];
  Meshd__Agent__V1__OpCall call;
  instr_t ins;
} add_inplace_instr_t;

static instr_t *add_inplace_instr(add_inplace_instr_t *b, uint64_t self, uint64_t result) {
  meshd__v1__arg__init(&b->a0);
  b->a0.value_case = MESHD__V1__ARG__VALUE_REF;
  b->a0.ref = self;
  b->a1 = b->a0;
  b->args[0] = &b->a0;
  b->args[1] = &b->a1;
  b->shape[0] = 8;
  meshd__agent__v1__tensor_spec__init(&b->res);
  b->res.ref = result;
  b->res.n_shape = 1;
  b->res.shape = b->shape;
  b->res.dtype = (Meshd__V1__DType)DTYPE_FLOAT32;
  b->resp[0] = &b->res;
  b->mutates[0] = 0; /* self */
  meshd__agent__v1__op_call__init(&b->call);
  b->call.op = "add_";
  b->call.n_args = 2;
  b->call.args = b->args;
  b->call.n_results = 1;
  b->call.results = b->resp;
  b->call.n_mutates = 1;
  b->call.mutates = b->mutates;
  meshd__agent__v1__instruction__init(&b->ins);
  b->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CALL;
  b->ins.call = &b->call;
  return &b->ins;
}

/* ref: 8 floats of 7, written in SESSION (an upload). */
static void define_sevens(rank0_agent_t *a, uint64_t ref) {
  agent_tensor_t t;
  meshd_error_t e = {0};
  tensor_meta_t m = {.dtype = DTYPE_FLOAT32, .layout = {.ndim = 1, .sizes = {8}}};
  cr_assert_eq(tensor_alloc(&a->b, NULL, &m, &t, "test", &e), 0, "%s", e.msg);
  for (int i = 0; i < 8; i++) ((float *)t.storage->data)[i] = 7;
  cr_assert_eq(executor_define(a->x, SESSION, ref, &t), 0);
  storage_release(t.storage);
}

/* The error reported for (seq, ref) (a bounded wait, kicking the reporter):
 * its message, or NULL; *count: how many were reported for seq. */
static const char *wait_ref_error(executor_t *x, uint64_t seq, uint64_t ref, int *count) {
  const char *m = NULL;
  for (int i = 0; i < 1000 && !m; i++) {
    pthread_mutex_lock(&mu);
    *count = 0;
    for (int k = 0; k < nerrors; k++)
      if (error_seqs[k] == seq) {
        ++*count;
        if (error_refs[k] == ref && !m) m = errors[k];
      }
    pthread_mutex_unlock(&mu);
    if (!m) {
      executor_kick(x);
      nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
  }
  return m;
}

/* An instruction with no data plane call that no stream worker can be had
 * for fails at once in the router: add_(t, t) of a tensor written
 * before (ref 9001, 8 floats of 7), with a fresh result (9003). It only
 * reported one failure for its seq (ref 0) and failed none of its refs on
 * the agent: once a worker was free, a Fetch's Snapshot of 9001 on its
 * stream read the old 7s as fine, and 9003 was missing ("not on this
 * agent"), not failed. Both must fail with its root cause, each reported
 * under its ref. */
Test(run_refusals, an_instruction_failed_at_once_in_routing_fails_what_it_writes,
     .timeout = 30) {
  rank0_agent_t a;
  rank0_agent_start(&a, 0, 0);
  executor_t *x = a.x;
  executor_set_max_workers_for_test(x, 0);
  control_instr_t ci;
  submit_seq(x, control_instr(&ci, MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS), 1);
  define_sevens(&a, 9001);
  agent_tensor_t t;

  add_inplace_instr_t ai;
  submit_seq(x, add_inplace_instr(&ai, 9001, 9003), 2); /* no worker, no refuser: fails at once */
  cr_assert_eq(executor_wait(x, 2, 10000), 0, "seq 2 not done");
  executor_set_max_workers_for_test(x, -1); /* a worker frees */
  submit_snapshot(x, 9001, 3);
  cr_assert_eq(executor_wait(x, 3, 10000), 0, "seq 3 not done");

  assert_snapshot_failed(x, 3, 9001, 2, "the failed add_");
  ref_failure_t why = {0};
  int rc = executor_lookup(x, SESSION, 9003, &t, &why);
  if (rc == 0) storage_release(t.storage);
  cr_assert_eq(rc, 1, "the add's fresh result 9003 is not failed (rc %d: %s)", rc, why.msg);
  cr_assert_eq(why.root_seq, 2, "9003's failure is not the add's: %s", why.msg);
  cr_assert(strstr(why.msg, "queueing instruction seq 2"), "9003's failure: %s", why.msg);

  /* Reported under each ref (the server fails both tensors), once each. */
  int n = 0;
  const char *m3 = wait_ref_error(x, 2, 9003, &n);
  cr_assert_not_null(m3, "no failure of seq 2 reported for ref 9003");
  cr_assert(strstr(m3, "queueing instruction seq 2"), "%s", m3);
  const char *m1 = wait_ref_error(x, 2, 9001, &n);
  cr_assert_not_null(m1, "no failure of seq 2 reported for ref 9001");
  cr_assert_eq(n, 2, "seq 2 reported %d failures, not one per tensor", n);

  /* The same on its worker: an add_ its checks refuse (a result dtype no
   * agent knows) fails its self too, not only its result. */
  define_sevens(&a, 9004);
  add_inplace_instr_t bad;
  instr_t *bins = add_inplace_instr(&bad, 9004, 9005);
  bad.res.dtype = (Meshd__V1__DType)999;
  submit_seq(x, bins, 4);
  cr_assert_eq(executor_wait(x, 4, 10000), 0, "seq 4 not done");
  memset(&why, 0, sizeof why);
  rc = executor_lookup(x, SESSION, 9004, &t, &why);
  if (rc == 0) storage_release(t.storage);
  cr_assert_eq(rc, 1, "the refused add_ left its self 9004 live (rc %d: %s)", rc, why.msg);
  cr_assert_eq(why.root_seq, 4, "9004's failure is not the add_'s: %s", why.msg);
  cr_assert(strstr(why.msg, "invalid OpCall"), "9004's failure: %s", why.msg);
  rank0_agent_stop(&a);
}

/* Rank 0's data plane cannot allocate its plan for the allreduce (a tiny
 * calloc in dp__plan_init): it fails, and its peer must learn why at once. */
Test(run_refusals, a_member_whose_plan_cannot_be_allocated_fails_its_peers_at_once, .timeout = 60) {
#if !INTERPOSED
  cr_skip_test("calloc is the sanitizer's");
#else
  meshd_error_t e = {0};
  dataplane_t *dp[2];
  char addr[2][64];
  for (int i = 0; i < 2; i++) {
    dp[i] = dataplane_start("127.0.0.1", (uint32_t)i, 10000, &e);
    cr_assert_not_null(dp[i], "%s", e.msg);
    snprintf(addr[i], sizeof addr[i], "127.0.0.1:%d", dataplane_port(dp[i]));
  }
  const char *addrs[2] = {addr[0], addr[1]};
  member_job_t j[2];
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    j[i] = (member_job_t){.dp = dp[i], .addrs = addrs, .secret = SECRET, .me = (uint32_t)i,
                          .oom = i == 0};
  }
  cr_assert_eq(pthread_create(&th[1], NULL, member_allreduce, &j[1]), 0);
  usleep(100 * 1000); /* the peer waits for rank 0 */
  cr_assert_eq(pthread_create(&th[0], NULL, member_allreduce, &j[0]), 0);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  cr_assert(atomic_load(&plan_calloc_fired), "the interposed calloc did not fire");
  cr_assert_eq(j[0].rc, -1, "rank 0 ran without its plan");
  cr_assert(strstr(j[0].err.msg, "out of memory"), "rank 0's error: %s", j[0].err.msg);
  cr_assert_eq(j[1].rc, -1, "the peer's allreduce succeeded");
  cr_assert(j[1].took_ms < 3000, "the peer failed after %lld ms (comm timeout 10 s): %s",
            (long long)j[1].took_ms, j[1].err.msg);
  cr_assert(strstr(j[1].err.msg, "rank 0") && strstr(j[1].err.msg, "out of memory"),
            "the peer's error does not say why rank 0 did not take part: %s", j[1].err.msg);
  for (int i = 0; i < 2; i++) dataplane_stop(dp[i]);
#endif
}

/* A Borrow whose origin tensor is not on the agent (never defined here: the
 * server believes otherwise) fails its handle and says so, as any other
 * reader of a missing tensor does: the handle was left undefined and nothing
 * was reported, so the server held the borrow live and its first reader
 * failed later with a root failure of its own naming the handle, not the
 * missing origin. */
Test(run_refusals, a_borrow_of_a_tensor_not_on_the_agent_fails_its_handle_and_is_reported,
     .timeout = 30) {
  rank0_agent_t a;
  rank0_agent_start(&a, 0, 0);
  executor_t *x = a.x;
  borrow_instr_t bi;
  instr_t *ins = borrow_instr(&bi, MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE, 1, 5, 6);
  ins->seq = 1;
  ins->session_id = (char *)SESSION;
  ins->stream = 1;
  cr_assert_eq(executor_submit(x, ins), 0);
  cr_assert_eq(executor_wait(x, 1, 10000), 0, "seq 1 not done");
  const char *m = NULL;
  uint64_t ref = 0;
  for (int i = 0; i < 500 && !m; i++) {
    pthread_mutex_lock(&mu);
    for (int k = 0; k < nerrors && !m; k++)
      if (error_seqs[k] == 1) {
        m = errors[k];
        ref = error_refs[k];
      }
    pthread_mutex_unlock(&mu);
    if (!m) {
      executor_kick(x);
      nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
  }
  cr_assert_not_null(m, "a Borrow of a tensor not on the agent reported nothing");
  cr_assert_eq(ref, 6, "the report names handle 6 (%s)", m);
  cr_assert(strstr(m, "tensor 5") && strstr(m, "not on the agent"), "%s", m);
  agent_tensor_t t;
  ref_failure_t why;
  cr_assert_eq(executor_lookup(x, SESSION, 6, &t, &why), 1, "handle 6 is failed, not missing");
  rank0_agent_stop(&a);
}
