/* Reduce instructions run by an agent's executor (run.c) on every backend this
 * build has — cpu, and cuda:emulated where the cuda backend is built: the
 * agent checks a Reduce with the catalogue's rule (core/tensor/reduction.h),
 * the same the server applies, so a refused reduction (integer avg) fails on
 * the agent exactly as the server would refuse it. One-member groups: no
 * data plane is needed. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "executor.h"
#include "instr_build.h"

typedef Meshd__Agent__V1__Instruction instr_t;

static const char *SESSION = "reduce-session";
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char errors[16][700];
static uint64_t error_seqs[16];
static int nerrors;
/* The last report's per-session progress. */
static uint64_t last_received;
static char last_behind[4][64];
static uint64_t last_behind_through[4];
static size_t last_nbehind;

static void on_report(const executor_report_t *r, void *arg) {
  Meshd__V1__Error **errs = r->errors;
  size_t n = r->n_errors;
  pthread_mutex_lock(&mu);
  last_received = r->received_through;
  last_nbehind = 0;
  for (size_t i = 0; i < r->n_sessions && i < 4; i++) {
    snprintf(last_behind[i], sizeof last_behind[i], "%s", r->sessions[i]->session_id);
    last_behind_through[i] = r->sessions[i]->executed_through;
    last_nbehind++;
  }
  for (size_t i = 0; i < n && nerrors < 16; i++) {
    snprintf(errors[nerrors], sizeof errors[0], "%s", errs[i]->message);
    error_seqs[nerrors++] = errs[i]->seq;
  }
  pthread_mutex_unlock(&mu);
}

typedef struct {
  backend_t b;
  run_env_t env;
  executor_t *x;
  _Atomic int64_t rank;
} agent_t;

static int open_agent_with(agent_t *a, const char *device, fault_t *fault);
static int open_agent(agent_t *a, const char *device) { return open_agent_with(a, device, NULL); }

static int open_agent_with(agent_t *a, const char *device, fault_t *fault) {
  memset(a, 0, sizeof *a);
  const backend_ops_t *ops = backend_for_device(device);
  if (!ops) return -1;
  meshd_error_t e = {0};
  a->b.ops = ops;
  a->b.capacity = 1 << 26;
  cr_assert_eq(ops->open(&a->b, device, &e), 0, "%s: %s", device, e.msg);
  atomic_store(&a->rank, 0);
  a->env = (run_env_t){.backend = &a->b, .rank = &a->rank, .fault = fault};
  a->x = executor_create(&a->env, on_report, NULL);
  cr_assert_not_null(a->x);
  nerrors = 0;
  return 0;
}

static void close_agent(agent_t *a) {
  executor_close(a->x);
  cr_assert_eq(executor_wait_all_freed(5000), 0);
  a->b.ops->close(&a->b);
}

static void submit(agent_t *a, instr_t *ins, uint64_t seq) {
  ins->seq = seq;
  ins->session_id = (char *)SESSION;
  ins->stream = 1;
  cr_assert_eq(executor_submit(a->x, ins), 0);
}

static Meshd__Agent__V1__TensorSpec spec(uint64_t ref, int64_t *shape, dtype_t dt) {
  Meshd__Agent__V1__TensorSpec sp = MESHD__AGENT__V1__TENSOR_SPEC__INIT;
  sp.ref = ref;
  sp.n_shape = 1;
  sp.shape = shape;
  sp.dtype = (Meshd__V1__DType)dt;
  return sp;
}

static void submit_ones(agent_t *a, uint64_t seq, uint64_t ref, dtype_t dt, int64_t *shape) {
  factory_instr_t b;
  submit(a, factory_instr(&b, "ones", ref, shape[0], dt), seq);
}

/* Reduce `reduction` of input (shape [n], dt) into result (shape [rn]) over a
 * one-member group. */
static void submit_reduce(agent_t *a, uint64_t seq, const char *reduction, uint64_t in, int64_t *shape,
                          uint64_t out, int64_t *rshape, dtype_t dt) {
  static uint32_t ranks[1] = {0};
  static char *addrs[1] = {"127.0.0.1:1"};
  Meshd__V1__Reduce r = MESHD__V1__REDUCE__INIT;
  r.ref = out;
  r.input = in;
  r.reduction = (char *)reduction;
  Meshd__Agent__V1__TensorSpec is = spec(in, shape, dt), rs = spec(out, rshape, dt);
  Meshd__Agent__V1__Group g = MESHD__AGENT__V1__GROUP__INIT;
  g.n_ranks = 1;
  g.ranks = ranks;
  g.comm_id = 7;
  g.n_addresses = 1;
  g.addresses = addrs;
  Meshd__Agent__V1__ReduceOp ro = MESHD__AGENT__V1__REDUCE_OP__INIT;
  ro.reduce = &r;
  ro.input = &is;
  ro.result = &rs;
  ro.group = &g;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE;
  ins.reduce = &ro;
  submit(a, &ins, seq);
}

static const char *error_of(uint64_t seq) {
  pthread_mutex_lock(&mu);
  const char *m = NULL;
  for (int i = 0; i < nerrors && !m; i++)
    if (error_seqs[i] == seq) m = errors[i];
  pthread_mutex_unlock(&mu);
  return m;
}

/* The failure reported for seq once the executor ran through `through`
 * (reports come from the reporter thread: waited for, bounded), or NULL. */
static const char *wait_error(agent_t *a, uint64_t through, uint64_t seq) {
  cr_assert_eq(executor_wait(a->x, through, 10000), 0, "seq %llu not executed",
               (unsigned long long)through);
  const char *m = NULL;
  for (int i = 0; i < 1000 && !(m = error_of(seq)); i++) {
    executor_kick(a->x);
    nanosleep(&(struct timespec){0, 2000000}, NULL);
  }
  return m;
}

static const char *const devices[] = {"cpu", "cuda:emulated"};

Test(run_reduce, integer_avg_fails_on_the_agent_as_on_the_server) {
  for (size_t d = 0; d < sizeof devices / sizeof devices[0]; d++) {
    agent_t a;
    if (open_agent(&a, devices[d]) != 0) continue; /* not in this build */
    int64_t shape[1] = {4};
    submit_ones(&a, 1, 10, DTYPE_INT32, shape);
    submit_reduce(&a, 2, "avg", 10, shape, 11, shape, DTYPE_INT32);
    const char *m = wait_error(&a, 2, 2);
    cr_assert_not_null(m, "%s: no failure reported for seq 2", devices[d]);
    cr_assert(strstr(m, "Reduce: 'avg' needs a floating dtype, not int32"), "%s: %s", devices[d], m);
    agent_tensor_t t;
    ref_failure_t why;
    cr_assert_eq(executor_lookup(a.x, SESSION, 11, &t, &why), 1, "%s: the result is failed",
                 devices[d]);
    cr_assert_eq(executor_lookup(a.x, SESSION, 10, &t, &why), 0, "%s: the input is intact",
                 devices[d]);
    storage_release(t.storage);
    close_agent(&a);
  }
}

Test(run_reduce, float_avg_over_one_member_is_the_identity) {
  for (size_t d = 0; d < sizeof devices / sizeof devices[0]; d++) {
    agent_t a;
    if (open_agent(&a, devices[d]) != 0) continue;
    int64_t shape[1] = {4};
    submit_ones(&a, 1, 10, DTYPE_FLOAT32, shape);
    submit_reduce(&a, 2, "avg", 10, shape, 11, shape, DTYPE_FLOAT32);
    cr_assert_eq(executor_wait(a.x, 2, 10000), 0);
    agent_tensor_t t;
    ref_failure_t why;
    cr_assert_eq(executor_lookup(a.x, SESSION, 11, &t, &why), 0, "%s: %s", devices[d], why.msg);
    float host[4] = {0};
    meshd_error_t e = {0};
    cr_assert_eq(a.b.ops->to_host(&a.b, NULL, &t, host, &e), 0, "%s", e.msg);
    for (int i = 0; i < 4; i++) cr_assert_eq(host[i], 1.0f, "%s: element %d", devices[d], i);
    storage_release(t.storage);
    cr_assert_null(error_of(2), "%s: %s", devices[d], error_of(2));
    close_agent(&a);
  }
}

Test(run_reduce, a_result_spec_the_rule_does_not_give_is_refused) {
  for (size_t d = 0; d < sizeof devices / sizeof devices[0]; d++) {
    agent_t a;
    if (open_agent(&a, devices[d]) != 0) continue;
    int64_t shape[1] = {4}, wrong[1] = {3};
    submit_ones(&a, 1, 10, DTYPE_FLOAT32, shape);
    submit_reduce(&a, 2, "sum", 10, shape, 11, wrong, DTYPE_FLOAT32);
    submit_reduce(&a, 3, "median", 10, shape, 12, shape, DTYPE_FLOAT32);
    const char *m = wait_error(&a, 3, 2);
    cr_assert_not_null(m, "%s", devices[d]);
    cr_assert(strstr(m, "result is float32 [3] but its input and group of 1 give float32 [4]"),
              "%s: %s", devices[d], m);
    m = wait_error(&a, 3, 3);
    cr_assert_not_null(m, "%s", devices[d]);
    cr_assert(strstr(m, "unknown reduction 'median'"), "%s: %s", devices[d], m);
    close_agent(&a);
  }
}

/* Progress per session (issue 12): a reduce hung by fault injection holds its
 * own session only; the reports list that session behind, with its own
 * watermark, and PeerLost for it ends the hang. */
Test(run_reduce, a_hung_reduce_holds_only_its_own_session) {
  fault_t fault;
  char why[200];
  cr_assert_eq(fault_parse("reduce:hang,count=1", FAULT_AGENT_PLACES, &fault, why, sizeof why), 0, "%s", why);
  agent_t a;
  open_agent_with(&a, "cpu", &fault);
  int64_t shape[1] = {4};
  submit_ones(&a, 1, 1, DTYPE_FLOAT32, shape);
  submit_reduce(&a, 2, "sum", 1, shape, 2, shape, DTYPE_FLOAT32); /* hangs */
  /* Another session, after it on the same agent. */
  factory_instr_t b;
  instr_t *ins = factory_instr(&b, "zeros", 1, shape[0], DTYPE_FLOAT32);
  ins->seq = 3;
  ins->session_id = "other-session";
  cr_assert_eq(executor_submit(a.x, ins), 0);
  cr_assert_eq(executor_wait_session(a.x, "other-session", 3, 5000), 0,
               "the other session waited for the hung one");
  cr_assert_eq(executor_wait(a.x, 2, 200), -1, "the hung reduce ran?");
  cr_assert_eq(executor_wait_session(a.x, SESSION, 2, 100), -1);
  /* The reports say so: received through 3, only the hung session behind, at 1. */
  bool seen = false;
  for (int i = 0; i < 500 && !seen; i++) {
    executor_kick(a.x);
    struct timespec ts = {0, 10 * 1000000L};
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&mu);
    seen = last_received == 3 && last_nbehind == 1 && !strcmp(last_behind[0], SESSION) &&
           last_behind_through[0] == 1;
    pthread_mutex_unlock(&mu);
  }
  cr_assert(seen, "report: received %llu, %zu behind",
            (unsigned long long)last_received, last_nbehind);
  /* PeerLost for the hung session ends its hang; its reduce fails. */
  Meshd__Agent__V1__PeerLost pl = MESHD__AGENT__V1__PEER_LOST__INIT;
  pl.rank = 3;
  pl.reason = "was lost at 12:00:00.000 UTC";
  instr_t lost = MESHD__AGENT__V1__INSTRUCTION__INIT;
  lost.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_PEER_LOST;
  lost.peer_lost = &pl;
  submit(&a, &lost, 4);
  cr_assert_eq(executor_wait(a.x, 4, 5000), 0, "PeerLost did not end the hang");
  cr_assert_not_null(wait_error(&a, 4, 2));
  close_agent(&a);
}

/* An instruction from a server older than the data plane's handshake carries
 * no group secret: the agent refuses it, saying why, instead of dialing peers
 * it could not prove itself to (docs/protocol.md "Data plane handshake"). */
Test(run_reduce, a_group_or_send_without_a_secret_is_refused) {
  agent_t a;
  open_agent(&a, "cpu");
  meshd_error_t e = {0};
  a.b.net = dataplane_start("127.0.0.1", 0, 1000, &e);
  cr_assert_not_null(a.b.net, "%s", e.msg);
  char me[64];
  snprintf(me, sizeof me, "127.0.0.1:%d", dataplane_port(a.b.net));
  static uint32_t ranks[2] = {0, 1};
  char *addrs[2] = {me, "127.0.0.1:1"};
  int64_t shape[1] = {4};
  submit_ones(&a, 1, 10, DTYPE_FLOAT32, shape);
  Meshd__V1__Reduce r = MESHD__V1__REDUCE__INIT;
  r.ref = 11;
  r.input = 10;
  r.reduction = "sum";
  Meshd__Agent__V1__TensorSpec is = spec(10, shape, DTYPE_FLOAT32), rs = spec(11, shape, DTYPE_FLOAT32);
  Meshd__Agent__V1__Group g = MESHD__AGENT__V1__GROUP__INIT;
  g.n_ranks = g.n_addresses = 2;
  g.ranks = ranks;
  g.addresses = addrs;
  g.comm_id = 9;
  Meshd__Agent__V1__ReduceOp ro = MESHD__AGENT__V1__REDUCE_OP__INIT;
  ro.reduce = &r;
  ro.input = &is;
  ro.result = &rs;
  ro.group = &g;
  instr_t ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE;
  ins.reduce = &ro;
  submit(&a, &ins, 2);
  Meshd__Agent__V1__TensorSpec res = spec(12, shape, DTYPE_FLOAT32);
  Meshd__Agent__V1__SendTensor st = MESHD__AGENT__V1__SEND_TENSOR__INIT;
  st.result = &res;
  st.from_rank = 1;
  st.to_rank = 0;
  st.comm_id = 10;
  st.peer_address = "127.0.0.1:1";
  instr_t recv = MESHD__AGENT__V1__INSTRUCTION__INIT;
  recv.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SEND;
  recv.send = &st;
  submit(&a, &recv, 3);
  const char *m = wait_error(&a, 3, 2);
  cr_assert_not_null(m);
  cr_assert(strstr(m, "Reduce: the instruction's group has a 0-byte secret where 32 bytes are "
                      "needed") && strstr(m, "upgrade the server"), "%s", m);
  m = wait_error(&a, 3, 3);
  cr_assert_not_null(m);
  cr_assert(strstr(m, "ToMesh: the instruction has a 0-byte secret where 32 bytes are needed"),
            "%s", m);
  close_agent(&a);
  dataplane_stop(a.b.net);
}

/* hello:old (a rolling-upgrade drill) is an action of the registration only:
 * it matches its rank, never an instruction, and any:... never matches it; a
 * mix of the two grammars is refused with what goes with what. */
Test(run_reduce, the_hello_old_fault_is_the_registrations_alone) {
  fault_t f;
  char why[200];
  int ms = 0;
  cr_assert_eq(fault_parse("hello:old,rank=1", FAULT_AGENT_PLACES, &f, why, sizeof why), 0, "%s", why);
  cr_assert_eq(fault_hit(&f, "hello", 1, &ms), FAULT_OLD);
  cr_assert_eq(fault_hit(&f, "hello", 0, &ms), FAULT_NONE);
  cr_assert_eq(fault_hit(&f, "reduce", 1, &ms), FAULT_NONE);
  cr_assert_eq(fault_parse("any:fail", FAULT_AGENT_PLACES, &f, why, sizeof why), 0, "%s", why);
  cr_assert_eq(fault_hit(&f, "hello", 0, &ms), FAULT_NONE);
  cr_assert_eq(fault_hit(&f, "send", 0, &ms), FAULT_FAIL);
  cr_assert_eq(fault_hit(&f, "write", 0, &ms), FAULT_NONE); /* not an instruction */
  cr_assert_eq(fault_parse("hello:fail", FAULT_AGENT_PLACES, &f, why, sizeof why), -1);
  cr_assert(strstr(why, "hello takes the ACTION old alone"), "%s", why);
  cr_assert_eq(fault_parse("reduce:old", FAULT_AGENT_PLACES, &f, why, sizeof why), -1);
  cr_assert(strstr(why, "ACTION old goes with WHERE hello"), "%s", why);
  cr_assert_eq(fault_parse("hello:old=5", FAULT_AGENT_PLACES, &f, why, sizeof why), -1);
  cr_assert_eq(fault_parse("boot:old", FAULT_AGENT_PLACES, &f, why, sizeof why), -1);
  cr_assert(strstr(why, "not one of reduce, send, call, any, hello, write"), "%s", why);
  /* the server's places are its own (--server-fault): an agent's is refused */
  cr_assert_eq(fault_parse("reduce:fail", FAULT_SERVER_PLACES, &f, why, sizeof why), -1);
  cr_assert(strstr(why, "not one of plan"), "%s", why);
  cr_assert_eq(fault_parse("plan:slow=20,count=1", FAULT_SERVER_PLACES, &f, why, sizeof why), 0,
               "%s", why);
  cr_assert_eq(fault_hit(&f, "plan", -1, &ms), FAULT_SLOW);
  cr_assert_eq(ms, 20);
  cr_assert_eq(fault_hit(&f, "plan", -1, &ms), FAULT_NONE);
}

/* A peer's side of a Reduce's allreduce (call 3 of comm 9: data plane call
 * 12), on its own data plane. */
typedef struct {
  dataplane_t *dp;
  const char *const *addrs;
  const uint8_t *secret;
  int rc;
  meshd_error_t err;
  int64_t took_ms;
} peer_job_t;

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void *peer_allreduce(void *arg) {
  peer_job_t *j = arg;
  static const uint32_t ranks[2] = {0, 1};
  dp_group_t g = {.comm_id = 9, .call = 3 * 4, .ranks = ranks, .addrs = j->addrs, .n = 2, .me = 1,
                  .secret = j->secret};
  float v[4] = {1, 1, 1, 1};
  int64_t t0 = mono_ms();
  j->rc = dp_allreduce(j->dp, &g, v, 4, DTYPE_FLOAT32, RED_SUM, &j->err);
  j->took_ms = mono_ms() - t0;
  return NULL;
}

/* A sum Reduce of ref 1 into ref 9001, [1] float32, over ranks 0 (the agent)
 * and 1 at addrs with secret, comm 9 call 3: what peer_allreduce joins. The
 * instruction points into *sr. */
typedef struct {
  Meshd__V1__Reduce r;
  Meshd__Agent__V1__TensorSpec is, rs;
  Meshd__Agent__V1__Group g;
  Meshd__Agent__V1__ReduceOp ro;
  instr_t ins;
  int64_t one[1];
} sum_reduce_t;

static instr_t *sum_reduce(sum_reduce_t *sr, const char **addrs, const uint8_t *secret) {
  static uint32_t ranks[2] = {0, 1};
  sr->one[0] = 1;
  sr->r = (Meshd__V1__Reduce)MESHD__V1__REDUCE__INIT;
  sr->r.ref = 9001;
  sr->r.input = 1;
  sr->r.reduction = "sum";
  sr->is = spec(1, sr->one, DTYPE_FLOAT32);
  sr->rs = spec(9001, sr->one, DTYPE_FLOAT32);
  sr->g = (Meshd__Agent__V1__Group)MESHD__AGENT__V1__GROUP__INIT;
  sr->g.n_ranks = sr->g.n_addresses = 2;
  sr->g.ranks = ranks;
  sr->g.addresses = (char **)addrs;
  sr->g.comm_id = 9;
  sr->g.call = 3;
  sr->g.secret.len = 32;
  sr->g.secret.data = (uint8_t *)secret;
  sr->ro = (Meshd__Agent__V1__ReduceOp)MESHD__AGENT__V1__REDUCE_OP__INIT;
  sr->ro.reduce = &sr->r;
  sr->ro.input = &sr->is;
  sr->ro.result = &sr->rs;
  sr->ro.group = &sr->g;
  sr->ins = (instr_t)MESHD__AGENT__V1__INSTRUCTION__INIT;
  sr->ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE;
  sr->ins.reduce = &sr->ro;
  return &sr->ins;
}

/* An agent with a data plane and its peer's (world rank 1): their
 * addresses in me and other. */
static dataplane_t *two_data_planes(agent_t *a, char me[64], char other[64]) {
  meshd_error_t e = {0};
  a->b.net = dataplane_start("127.0.0.1", 0, 10000, &e);
  cr_assert_not_null(a->b.net, "%s", e.msg);
  dataplane_t *peer = dataplane_start("127.0.0.1", 1, 10000, &e);
  cr_assert_not_null(peer, "%s", e.msg);
  snprintf(me, 64, "127.0.0.1:%d", dataplane_port(a->b.net));
  snprintf(other, 64, "127.0.0.1:%d", dataplane_port(peer));
  return peer;
}

/* An agent that already runs as many stream workers as it may (4096, over
 * all sessions) cannot queue a Reduce on a new stream: its peer, waiting for
 * it in the allreduce, fails at once with that reason, not after the comm
 * timeout with "did not connect". */
Test(run_reduce, a_reduce_the_agent_cannot_queue_fails_its_peers_at_once, .timeout = 180) {
  agent_t a;
  open_agent(&a, "cpu");
  char me[64], other[64];
  dataplane_t *peer = two_data_planes(&a, me, other);
  a.env.data_address = me;
  /* Every worker the agent may start, each on its own stream. */
  const uint64_t workers = 4096;
  for (uint64_t i = 1; i <= workers; i++) {
    factory_instr_t b;
    instr_t *ins = factory_instr(&b, "ones", i, 1, DTYPE_FLOAT32);
    ins->seq = i;
    ins->session_id = (char *)SESSION;
    ins->stream = i;
    cr_assert_eq(executor_submit(a.x, ins), 0, "stream %llu", (unsigned long long)i);
  }
  cr_assert_eq(executor_wait(a.x, workers, 60000), 0);
  static const uint8_t secret[32] = "0123456789abcdef0123456789abcde";
  const char *addrs[2] = {me, other};
  peer_job_t pj = {.dp = peer, .addrs = addrs, .secret = secret};
  pthread_t th;
  pthread_create(&th, NULL, peer_allreduce, &pj);
  usleep(100 * 1000); /* the peer waits for it */
  sum_reduce_t sr;
  instr_t *ins = sum_reduce(&sr, addrs, secret);
  ins->seq = workers + 1;
  ins->session_id = (char *)SESSION;
  ins->stream = workers + 1;
  executor_submit(a.x, ins); /* -1 or 0: either way it is not run */
  pthread_join(th, NULL);
  const char *m = wait_error(&a, workers + 1, workers + 1);
  cr_assert_not_null(m, "no error reported for the Reduce");
  cr_assert(strstr(m, "streams"), "the agent's error: %s", m);
  cr_assert_eq(pj.rc, -1, "the peer's allreduce succeeded");
  cr_assert(pj.took_ms < 3000, "the peer failed after %lld ms: %s", (long long)pj.took_ms,
            pj.err.msg);
  cr_assert(strstr(pj.err.msg, "rank 0") && strstr(pj.err.msg, "streams"),
            "the peer's error does not say why rank 0 did not take part: %s", pj.err.msg);
  executor_close(a.x);
  cr_assert_eq(executor_wait_all_freed(60000), 0);
  a.b.ops->close(&a.b);
  dataplane_stop(a.b.net);
  dataplane_stop(peer);
}

/* A Reduce queued on an agent announces its group to the data plane
 * (run_expect, from executor_submit): a peer that dials the agent before
 * the agent runs it has its hello proven at once and held apart from the
 * cap on unproven connections, which strangers can fill (and more members
 * than it holds dialing a late root would overflow). */
Test(run_reduce, a_queued_reduce_holds_its_peers_early_hellos_as_proven, .timeout = 30) {
  agent_t a;
  open_agent(&a, "cpu");
  char me[64], other[64];
  dataplane_t *peer = two_data_planes(&a, me, other);
  static const uint8_t secret[32] = "0123456789abcdef0123456789abcde";
  const char *addrs[2] = {me, other};
  static const uint32_t ranks[2] = {0, 1};
  meshd_error_t e = {0};
  sum_reduce_t sr;
  run_expect(&a.env, sum_reduce(&sr, addrs, secret));
  peer_job_t pj = {.dp = peer, .addrs = addrs, .secret = secret};
  pthread_t th;
  pthread_create(&th, NULL, peer_allreduce, &pj);
  size_t proven = 0;
  int64_t until = mono_ms() + 5000;
  while (dataplane_parked(a.b.net, &proven) == 0 && mono_ms() < until) usleep(1000);
  cr_assert_eq(proven, 1, "the peer's early hello was not proven against the Reduce's group");
  /* The agent joins: the held hello is admitted, and the allreduce runs. */
  dp_group_t dg = {.comm_id = 9, .call = 3 * 4, .ranks = ranks, .addrs = addrs, .n = 2, .me = 0,
                   .secret = secret};
  float v[4] = {1, 1, 1, 1};
  cr_assert_eq(dp_allreduce(a.b.net, &dg, v, 4, DTYPE_FLOAT32, RED_SUM, &e), 0, "%s", e.msg);
  pthread_join(th, NULL);
  cr_assert_eq(pj.rc, 0, "%s", pj.err.msg);
  cr_assert_eq(v[0], 2.0f);
  cr_assert_eq(dataplane_parked(a.b.net, &proven), 0);
  cr_assert_eq(proven, 0);
  close_agent(&a);
  dataplane_stop(a.b.net);
  dataplane_stop(peer);
}
