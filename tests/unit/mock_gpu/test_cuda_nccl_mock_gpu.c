/* cuda_nccl.c's real-device path (NCCL communicators bootstrapped over the data
 * plane) on a mock GPU: fake NCCL, CUDA runtime and data plane
 * (fake_nccl_cuda.c), agents as threads. Covers the native and fallback
 * reductions, the rooted ones (ncclReduce, a grouped gather to the root,
 * ncclBroadcast), host staging, point to point in both directions, the cache, and
 * every way a round fails: a missing member, an init that never finishes or
 * errs, a peer that skips an op, an NCCL error mid-op, members that disagree,
 * a stale id from a missed round; then session end (peers holding their
 * communicators in different orders included) and teardown. Each failure
 * must come back within a short comm_timeout_ms, name the op and its ranks,
 * abort the communicator and free what it made. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "cuda_internal.h"
#include "cuda_nccl.h"
#include "fake_nccl_cuda.h"

#define NA 4
#define COMM_TIMEOUT_MS 200
#define DP_TIMEOUT_MS 300

typedef struct {
  backend_t b;
  cuda_state_t st;
  dataplane_t net;
} agent_t;

static agent_t A[NA];
static bool agents_closed;
static const uint32_t RANKS[] = {0, 1, 2, 3};
static const char *const ADDRS[] = {"h:0", "h:1", "h:2", "h:3"};
static const uint8_t SECRET[DP_SECRET_LEN] = "mock gpu group secret..........";

static void agents_open(void) {
  for (int i = 0; i < NA; i++) {
    memset(&A[i], 0, sizeof A[i]);
    A[i].st.device = FAKE_DEVICE;
    A[i].st.comm_timeout_ms = COMM_TIMEOUT_MS;
    A[i].st.comms = cuda_comms_create();
    A[i].net = (dataplane_t){(uint32_t)i, DP_TIMEOUT_MS};
    A[i].b = (backend_t){.impl = &A[i].st, .net = &A[i].net};
  }
  agents_closed = false;
}

static void agents_close(void) {
  if (agents_closed) return;
  for (int i = 0; i < NA; i++) cuda_comms_destroy(A[i].st.comms);
  fake_dp_drain();
  agents_closed = true;
}

TestSuite(cuda_nccl_mock_gpu, .init = agents_open, .fini = agents_close, .timeout = 20);

/* The data plane call number groups get (dp_group_t.call): a test that runs
 * rounds of one comm numbers them, as the server does. */
static uint64_t call_no = 1;

static dp_group_t group(uint64_t comm_id, uint64_t session, size_t n, size_t me) {
  return (dp_group_t){.comm_id = comm_id, .call = call_no, .session = session, .ranks = RANKS,
                      .addrs = ADDRS, .n = n, .me = me, .secret = SECRET};
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* One agent's outcome; Criterion asserts only on the main thread. */
typedef struct {
  int me;
  int rc;
  meshd_error_t e;
  int wrong; /* results that differ from the expected ones */
  double secs;
} res_t;

typedef void (*agent_fn)(agent_t *a, res_t *r);
typedef struct {
  agent_fn fn;
  res_t *r;
} thread_arg_t;

static void *agent_main(void *p) {
  thread_arg_t *t = p;
  double t0 = now_s();
  t->fn(&A[t->r->me], t->r);
  t->r->secs = now_s() - t0;
  return NULL;
}

/* Runs fn as agents 0 .. n-1 at once; results in r[0 .. n). */
static void run_agents(int n, agent_fn fn, res_t *r) {
  pthread_t th[NA];
  thread_arg_t args[NA];
  for (int i = 0; i < n; i++) {
    memset(&r[i], 0, sizeof r[i]);
    r[i].me = i;
    args[i] = (thread_arg_t){fn, &r[i]};
    cr_assert_eq(pthread_create(&th[i], NULL, agent_main, &args[i]), 0);
  }
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

static void expect_ok(const res_t *r, int n) {
  for (int i = 0; i < n; i++) {
    cr_expect_eq(r[i].rc, 0, "agent %d failed: %s", i, r[i].e.msg);
    cr_expect_eq(r[i].wrong, 0, "agent %d got %d wrong results", i, r[i].wrong);
  }
}

/* Fails with REMOTE_FAILURE, the message holding every fragment, within a
 * bounded time (fails fast: no hang up to some larger default). */
static void expect_failed(const res_t *r, double max_secs, const char *frag1, const char *frag2) {
  cr_assert_neq(r->rc, 0, "agent %d should have failed", r->me);
  cr_expect_eq(r->e.kind, ERR_REMOTE_FAILURE, "agent %d: kind %d: %s", r->me, (int)r->e.kind,
               r->e.msg);
  cr_expect(strstr(r->e.msg, frag1), "agent %d: '%s' lacks '%s'", r->me, r->e.msg, frag1);
  if (frag2) cr_expect(strstr(r->e.msg, frag2), "agent %d: '%s' lacks '%s'", r->me, r->e.msg, frag2);
  cr_expect_lt(r->secs, max_secs, "agent %d took %.2f s", r->me, r->secs);
}

static void expect_nothing_left(void) {
  cr_expect_eq(fake.scratch_live, 0, "scratch not freed: %d", (int)fake.scratch_live);
  cr_expect_eq(fake_dev_live(), 0, "device buffers not freed: %d", fake_dev_live());
}

/* ------------------------------------------------------- collectives */

static void allreduce_on_device(agent_t *a, res_t *r) {
  dp_group_t g = group(100, 7, 2, (size_t)r->me);
  int32_t *d = fake_dev_alloc(4 * sizeof *d);
  for (int i = 0; i < 4; i++) d[i] = (r->me + 1) * 10 + i;
  r->rc |= cuda_allreduce(&a->b, NULL, &g, d, 4, DTYPE_INT32, RED_SUM, &r->e);
  for (int i = 0; i < 4; i++) r->wrong += d[i] != 30 + 2 * i;
  for (int i = 0; i < 4; i++) d[i] = (r->me + 1) * 10 + i;
  r->rc |= cuda_allreduce(&a->b, NULL, &g, d, 4, DTYPE_INT32, RED_MAX, &r->e);
  for (int i = 0; i < 4; i++) r->wrong += d[i] != 20 + i;
  fake_dev_free(d);
}

Test(cuda_nccl_mock_gpu, native_allreduce_on_device_buffers_reuses_one_communicator) {
  res_t r[2];
  run_agents(2, allreduce_on_device, r);
  expect_ok(r, 2);
  cr_expect_eq(fake.ids, 1, "one unique id for the group, made once: %d", (int)fake.ids);
  cr_expect_eq(fake.inits, 2, "one communicator per member, cached: %d", (int)fake.inits);
  cr_expect_eq(fake.native_ops, 4);
  cr_expect_eq(fake.reduce_slices, 0, "sum and max on int32 are native NCCL reductions");
  cr_expect_eq(fake.aborts, 0);
  expect_nothing_left(); /* device buffers: nothing staged */
}

static void mixed_on_host(agent_t *a, res_t *r) {
  int me = r->me;
  dp_group_t g = group(101, 7, 2, (size_t)me);
  meshd_error_t *e = &r->e;
  /* int16 has no NCCL type: allgather, then reduced locally */
  int16_t h[3] = {(int16_t)(me + 1), (int16_t)(me + 2), -5};
  r->rc |= cuda_allreduce(&a->b, NULL, &g, h, 3, DTYPE_INT16, RED_SUM, e);
  r->wrong += h[0] != 3 || h[1] != 5 || h[2] != -10;
  /* bitwise or has no NCCL op: alltoall, then reduced locally */
  int32_t in[4] = {me * 100 + 1, me * 100 + 3, me * 100 + 6, me * 100 + 8}, out[2] = {0};
  r->rc |= cuda_reduce_scatter(&a->b, NULL, &g, in, out, 2, DTYPE_INT32, RED_BOR, e);
  for (int j = 0; j < 2; j++) {
    int32_t v0 = in[me * 2 + j] - me * 100; /* member 0's element */
    r->wrong += out[j] != (v0 | (v0 + 100));
  }
  /* float avg is NCCL's */
  float fin[4] = {1, 2, 3, 4 + (float)me}, fout[2] = {0};
  r->rc |= cuda_reduce_scatter(&a->b, NULL, &g, fin, fout, 2, DTYPE_FLOAT32, RED_AVG, e);
  r->wrong += me == 0 ? fout[0] != 1 || fout[1] != 2 : fout[0] != 3 || fout[1] != 4.5f;
  int64_t gi[2] = {me, me + 10}, go[4] = {0};
  r->rc |= cuda_allgather(&a->b, NULL, &g, gi, go, 2, DTYPE_INT64, e);
  r->wrong += go[0] != 0 || go[1] != 10 || go[2] != 1 || go[3] != 11;
  double ti[4] = {me * 10 + 0, me * 10 + 1, me * 10 + 2, me * 10 + 3}, to[4] = {0};
  r->rc |= cuda_alltoall(&a->b, NULL, &g, ti, to, 2, DTYPE_FLOAT64, e);
  for (int i = 0; i < 2; i++) /* slice i = member i's slice me */
    for (int j = 0; j < 2; j++) r->wrong += to[i * 2 + j] != i * 10 + me * 2 + j;
  int32_t x[2] = {me ? 6 : 3, 1};
  r->rc |= cuda_allreduce(&a->b, NULL, &g, x, 2, DTYPE_INT32, RED_BXOR, e);
  r->wrong += x[0] != 5 || x[1] != 0;
}

Test(cuda_nccl_mock_gpu, host_buffers_are_staged_and_fallback_plans_reduce_locally) {
  res_t r[2];
  run_agents(2, mixed_on_host, r); /* the fakes abort on any host pointer reaching NCCL */
  expect_ok(r, 2);
  cr_expect_eq(fake.reduce_slices, 6, "int16 sum, int32 bor, int32 bxor per agent: %d",
               (int)fake.reduce_slices);
  cr_expect_eq(fake.native_ops, 2, "only the float avg is a native NCCL reduction");
  cr_expect_eq(fake.inits, 2, "six ops on one cached communicator per agent");
  expect_nothing_left();
}

static void send_recv_both_ways(agent_t *a, res_t *r) {
  int me = r->me, peer = 1 - me;
  for (int rep = 0; rep < 2; rep++) {
    int64_t mine = me + 40 + rep, got = 0;
    if (me == 0) {
      r->rc |= cuda_send(&a->b, NULL, 7, 200, 1, SECRET, (uint32_t)peer, ADDRS[peer], &mine, sizeof mine, &r->e);
      r->rc |= cuda_recv(&a->b, NULL, 7, 200, 1, SECRET, (uint32_t)peer, ADDRS[peer], &got, sizeof got, &r->e);
    } else {
      r->rc |= cuda_recv(&a->b, NULL, 7, 200, 1, SECRET, (uint32_t)peer, ADDRS[peer], &got, sizeof got, &r->e);
      r->rc |= cuda_send(&a->b, NULL, 7, 200, 1, SECRET, (uint32_t)peer, ADDRS[peer], &mine, sizeof mine, &r->e);
    }
    r->wrong += got != peer + 40 + rep;
  }
}

Test(cuda_nccl_mock_gpu, send_and_recv_in_both_directions_use_one_communicator_each) {
  res_t r[2];
  run_agents(2, send_recv_both_ways, r);
  expect_ok(r, 2);
  cr_expect_eq(fake.ids, 2, "one id per direction: %d", (int)fake.ids);
  cr_expect_eq(fake.inits, 4, "two directional communicators on each end, cached: %d",
               (int)fake.inits);
  cr_expect_eq(fake.p2p_ops, 8, "two sends and two receives per agent: %d", (int)fake.p2p_ops);
  expect_nothing_left();
}

/* ------------------------------------------------------- rooted */

#define RN 3 /* members of the rooted reductions and gathers */
#define RCOUNT 5

static float f32_in(int m, int i) { return (float)((m + 1) * 1.5 - i) * (m == 1 ? -1.0f : 1.0f); }
static int32_t i32_in(int m, int i) { return (m + 1) * 10 - 7 * i * m + (m == 2 ? -40 : 0); }

/* Reduces to member 1 in place: float32 sum on device buffers, int32 sum and
 * max on host ones (staged). The root checks against sums and maxima computed
 * here; the others check that their buffers still hold their input. */
static void reduce_native_to_root(agent_t *a, res_t *r) {
  const size_t root = 1;
  int me = r->me;
  dp_group_t g = group(1000, 7, RN, (size_t)me);
  float *f = fake_dev_alloc(RCOUNT * sizeof *f);
  for (int i = 0; i < RCOUNT; i++) f[i] = f32_in(me, i);
  r->rc |= cuda_reduce_root(&a->b, NULL, &g, root, f, RCOUNT, DTYPE_FLOAT32, RED_SUM, &r->e);
  for (int i = 0; i < RCOUNT; i++) {
    float want = 0;
    for (int m = 0; m < RN; m++) want += f32_in(m, i);
    r->wrong += (size_t)me == root ? f[i] != want : f[i] != f32_in(me, i);
  }
  fake_dev_free(f);
  for (int k = 0; k < 2; k++) {
    reduction_t op = k ? RED_MAX : RED_SUM;
    int32_t h[RCOUNT];
    for (int i = 0; i < RCOUNT; i++) h[i] = i32_in(me, i);
    r->rc |= cuda_reduce_root(&a->b, NULL, &g, root, h, RCOUNT, DTYPE_INT32, op, &r->e);
    for (int i = 0; i < RCOUNT; i++) {
      int32_t want = i32_in(0, i);
      for (int m = 1; m < RN; m++)
        want = op == RED_SUM ? want + i32_in(m, i) : i32_in(m, i) > want ? i32_in(m, i) : want;
      r->wrong += (size_t)me == root ? h[i] != want : h[i] != i32_in(me, i);
    }
  }
}

Test(cuda_nccl_mock_gpu, reduce_to_a_nonzero_root_is_ncclReduce_and_leaves_the_others_untouched) {
  res_t r[RN];
  run_agents(RN, reduce_native_to_root, r);
  expect_ok(r, RN);
  cr_expect_eq(fake.reduce_ops, 3 * RN, "ncclReduce for each of 3 reductions on each member: %d",
               (int)fake.reduce_ops);
  cr_expect_eq(fake.native_ops, 0, "no all-reduce: %d", (int)fake.native_ops);
  cr_expect_eq(fake.gather_ops + fake.p2p_ops, 0, "no all-gather nor sends");
  cr_expect_eq(fake.reduce_slices, 0);
  cr_expect_eq(fake.inits, RN, "one cached group communicator per member: %d", (int)fake.inits);
  expect_nothing_left();
}

/* float32 max and int16 sum have no NCCL reduction: the raw bytes go to the
 * root (member 2), which reduces them; the others only send. */
static void reduce_fallback_to_root(agent_t *a, res_t *r) {
  const size_t root = 2;
  int me = r->me;
  dp_group_t g = group(1001, 7, RN, (size_t)me);
  float *f = fake_dev_alloc(RCOUNT * sizeof *f);
  for (int i = 0; i < RCOUNT; i++) f[i] = f32_in(me, i);
  r->rc |= cuda_reduce_root(&a->b, NULL, &g, root, f, RCOUNT, DTYPE_FLOAT32, RED_MAX, &r->e);
  for (int i = 0; i < RCOUNT; i++) {
    float want = f32_in(0, i);
    for (int m = 1; m < RN; m++) want = f32_in(m, i) > want ? f32_in(m, i) : want;
    r->wrong += (size_t)me == root ? f[i] != want : f[i] != f32_in(me, i);
  }
  fake_dev_free(f);
  int16_t h[RCOUNT];
  for (int i = 0; i < RCOUNT; i++) h[i] = (int16_t)i32_in(me, i);
  r->rc |= cuda_reduce_root(&a->b, NULL, &g, root, h, RCOUNT, DTYPE_INT16, RED_SUM, &r->e);
  for (int i = 0; i < RCOUNT; i++) {
    int16_t want = 0;
    for (int m = 0; m < RN; m++) want = (int16_t)(want + i32_in(m, i));
    r->wrong += (size_t)me == root ? h[i] != want : h[i] != (int16_t)i32_in(me, i);
  }
}

Test(cuda_nccl_mock_gpu, reduce_without_a_native_nccl_op_gathers_to_the_root_and_reduces_there) {
  res_t r[RN];
  run_agents(RN, reduce_fallback_to_root, r);
  expect_ok(r, RN);
  cr_expect_eq(fake.reduce_slices, 2, "reduced on the root only, twice: %d",
               (int)fake.reduce_slices);
  cr_expect_eq(fake.gather_ops + fake.native_ops + fake.reduce_ops, 0,
               "no all-gather nor NCCL reduction");
  cr_expect_eq(fake.p2p_ops, 2 * (RN + RN), "a send on each member, RN receives on the root: %d",
               (int)fake.p2p_ops);
  for (int m = 0; m < RN; m++)
    cr_expect_eq(fake.p2p_bytes_in[m], m == 2 ? RN * RCOUNT * (4 + 2) : 0,
                 "member %d received %d bytes", m, (int)fake.p2p_bytes_in[m]);
  expect_nothing_left();
}

#define GSENT -77

/* Gathers to member 2 every member's own int64 values (host buffers, staged)
 * and then float64 ones (device buffers, no out off the root). */
static void gather_to_root(agent_t *a, res_t *r) {
  const size_t root = 2;
  int me = r->me;
  dp_group_t g = group(1002, 7, RN, (size_t)me);
  int64_t in[RCOUNT], out[RN * RCOUNT];
  for (int i = 0; i < RCOUNT; i++) in[i] = 1000 * me + i * i - 3;
  for (int i = 0; i < RN * RCOUNT; i++) out[i] = GSENT;
  r->rc |= cuda_gather_root(&a->b, NULL, &g, root, in, out, RCOUNT, DTYPE_INT64, &r->e);
  for (int m = 0; m < RN; m++)
    for (int i = 0; i < RCOUNT; i++)
      r->wrong += out[m * RCOUNT + i] != ((size_t)me == root ? 1000 * m + i * i - 3 : GSENT);
  double *din = fake_dev_alloc(2 * sizeof *din);
  double *dout = (size_t)me == root ? fake_dev_alloc(RN * 2 * sizeof *dout) : NULL;
  din[0] = me + 0.25, din[1] = -me;
  r->rc |= cuda_gather_root(&a->b, NULL, &g, root, din, dout, 2, DTYPE_FLOAT64, &r->e);
  for (int m = 0; dout && m < RN; m++) r->wrong += dout[2 * m] != m + 0.25 || dout[2 * m + 1] != -m;
  fake_dev_free(din);
  fake_dev_free(dout);
}

Test(cuda_nccl_mock_gpu, gather_to_a_root_is_grouped_sends_and_only_the_root_receives) {
  res_t r[RN];
  run_agents(RN, gather_to_root, r);
  expect_ok(r, RN);
  cr_expect_eq(fake.gather_ops, 0, "no all-gather: %d", (int)fake.gather_ops);
  cr_expect_eq(fake.native_ops + fake.reduce_ops, 0);
  cr_expect_eq(fake.p2p_ops, 2 * (RN + RN), "a send on each member, RN receives on the root: %d",
               (int)fake.p2p_ops);
  for (int m = 0; m < RN; m++)
    cr_expect_eq(fake.p2p_bytes_in[m], m == 2 ? RN * (RCOUNT * 8 + 2 * 8) : 0,
                 "member %d received %d bytes", m, (int)fake.p2p_bytes_in[m]);
  cr_expect_eq(fake.inits, RN, "one cached group communicator per member: %d", (int)fake.inits);
  expect_nothing_left();
}

/* Member 0's bytes to all four, twice (ToMesh's flag, then its data): odd
 * members on device buffers, even ones on host buffers (staged). */
static void broadcast_from_0(agent_t *a, res_t *r) {
  int me = r->me;
  dp_group_t g = group(1003, 7, NA, (size_t)me);
  for (int rep = 0; rep < 2; rep++) {
    size_t n = 37 + (size_t)rep * 64;
    uint8_t host[128];
    uint8_t *buf = me % 2 ? fake_dev_alloc(n) : host;
    for (size_t i = 0; i < n; i++) buf[i] = me == 0 ? (uint8_t)(i * 7 + rep) : 0xee;
    r->rc |= cuda_broadcast(&a->b, NULL, &g, buf, n, &r->e);
    for (size_t i = 0; i < n; i++) r->wrong += buf[i] != (uint8_t)(i * 7 + rep);
    if (me % 2) fake_dev_free(buf);
  }
}

Test(cuda_nccl_mock_gpu, broadcast_over_four_members_is_ncclBroadcast_on_one_group_communicator) {
  res_t r[NA];
  run_agents(NA, broadcast_from_0, r);
  expect_ok(r, NA);
  cr_expect_eq(fake.broadcast_ops, 2 * NA, "ncclBroadcast twice on each member: %d",
               (int)fake.broadcast_ops);
  cr_expect_eq(fake.p2p_ops, 0, "no point-to-point sends: %d", (int)fake.p2p_ops);
  cr_expect_eq(fake.ids, 1, "one group id, not one per destination: %d", (int)fake.ids);
  cr_expect_eq(fake.inits, NA, "cached across both broadcasts: %d", (int)fake.inits);
  expect_nothing_left();
}

static void reduce_of_three_to_1(agent_t *a, res_t *r) {
  dp_group_t g = group(1004, 8, RN, (size_t)r->me);
  int32_t *d = fake_dev_alloc(sizeof *d);
  *d = r->me + 1;
  r->rc = cuda_reduce_root(&a->b, NULL, &g, 1, d, 1, DTYPE_INT32, RED_SUM, &r->e);
  r->wrong += !r->rc && r->me == 1 && *d != 6;
  fake_dev_free(d);
}

static void broadcast_of_four(agent_t *a, res_t *r) {
  dp_group_t g = group(1005, 8, NA, (size_t)r->me);
  int64_t v = r->me ? 0 : 99;
  r->rc = cuda_broadcast(&a->b, NULL, &g, &v, sizeof v, &r->e);
  r->wrong += !r->rc && v != 99;
}

Test(cuda_nccl_mock_gpu, rooted_failures_name_the_op_its_root_and_the_group) {
  res_t r[NA];
  run_agents(RN, reduce_of_three_to_1, r);
  expect_ok(r, RN);
  fake_op_error = ncclRemoteError;
  run_agents(RN, reduce_of_three_to_1, r);
  for (int i = 0; i < RN; i++)
    expect_failed(&r[i], 2.0,
                  "reduce to rank 1 over ranks [0,1,2]: NCCL failed: fake remote error: fake last "
                  "error; the communicator was aborted", NULL);
  cr_expect_eq(fake.comms_live, 0);
  fake_op_error = 0;
  run_agents(NA - 1, broadcast_of_four, r); /* member 3 never comes */
  for (int i = 0; i < NA - 1; i++)
    expect_failed(&r[i], 2.0, "broadcast over ranks [0,1,2,3]: setting up the NCCL communicator",
                  "took longer than 0.2 s");
  cr_expect_eq(fake.comms_live, 0);
  expect_nothing_left();
}

/* ------------------------------------------------------- failures */

static void allreduce_of_three(agent_t *a, res_t *r) {
  dp_group_t g = group(300, 8, 3, (size_t)r->me);
  int32_t *d = fake_dev_alloc(sizeof *d);
  *d = r->me + 1;
  r->rc = cuda_allreduce(&a->b, NULL, &g, d, 1, DTYPE_INT32, RED_SUM, &r->e);
  r->wrong += !r->rc && *d != 6;
  fake_dev_free(d);
}

Test(cuda_nccl_mock_gpu, missing_member_times_out_at_setup_naming_the_group) {
  res_t r[2];
  run_agents(2, allreduce_of_three, r); /* rank 2 never comes */
  for (int i = 0; i < 2; i++)
    expect_failed(&r[i], 2.0, "allreduce over ranks [0,1,2]: setting up the NCCL communicator",
                  "took longer than 0.2 s");
  cr_expect_eq(fake.aborts, 2);
  cr_expect_eq(fake.comms_live, 0);
  cr_expect_eq(fake.streams_live, 0, "the failed communicator's stream is destroyed");
  cr_expect_eq(fake.events_live, 0);
  expect_nothing_left();
}

Test(cuda_nccl_mock_gpu, member_that_missed_a_round_skips_its_stale_id) {
  res_t r[NA];
  run_agents(2, allreduce_of_three, r); /* the id meant for rank 2 stays queued */
  cr_assert(r[0].rc && r[1].rc);
  call_no++; /* the next round is the next call */
  run_agents(3, allreduce_of_three, r);
  expect_ok(r, 3);
  cr_expect_eq(fake.ids, 2);
  cr_expect_eq(fake.comms_live, 3);
}

static void allreduce_of_two(agent_t *a, res_t *r) {
  dp_group_t g = group(400, 9, 2, (size_t)r->me);
  int32_t *d = fake_dev_alloc(sizeof *d);
  *d = r->me + 1;
  r->rc = cuda_allreduce(&a->b, NULL, &g, d, 1, DTYPE_INT32, RED_SUM, &r->e);
  r->wrong += !r->rc && *d != 3;
  fake_dev_free(d);
}

Test(cuda_nccl_mock_gpu, init_that_never_completes_is_aborted_at_the_deadline) {
  fake_never_join = 1;
  res_t r[2];
  run_agents(2, allreduce_of_two, r);
  for (int i = 0; i < 2; i++)
    expect_failed(&r[i], 2.0, "allreduce over ranks [0,1]: setting up the NCCL communicator took "
                              "longer than 0.2 s (a peer did not join); it was aborted", NULL);
  cr_expect_eq(fake.aborts, 2);
  cr_expect_eq(fake.comms_live, 0);
  cr_expect_eq(fake.streams_live, 0);
  cr_expect_eq(fake.events_live, 0);
}

Test(cuda_nccl_mock_gpu, init_error_reports_the_nccl_strings) {
  fake_init_error = ncclSystemError;
  res_t r[2];
  run_agents(2, allreduce_of_two, r);
  expect_failed(&r[0], 2.0,
                "allreduce over ranks [0,1]: NCCL failed setting up the communicator: "
                "fake system error: fake last error", NULL);
  /* every member's init fails (or finds member 0's id gone): each fails its
   * call at once, no retry */
  expect_failed(&r[1], 2.0,
                "allreduce over ranks [0,1]: NCCL failed setting up the communicator: "
                "fake system error", NULL);
  cr_expect_eq(fake.comms_live, 0, "every communicator that joined was aborted");
  cr_expect_eq(fake.streams_live, 0);
}

static void build_then_zero_goes_again(agent_t *a, res_t *r) {
  dp_group_t g = group(500, 10, 2, (size_t)r->me);
  int16_t h[2] = {1, 2}; /* host int16: staged and gathered, scratch to free */
  r->rc = cuda_allreduce(&a->b, NULL, &g, h, 2, DTYPE_INT16, RED_SUM, &r->e);
  r->wrong += !r->rc && (h[0] != 2 || h[1] != 4);
  if (r->rc || r->me != 0) return;
  r->rc = cuda_allreduce(&a->b, NULL, &g, h, 2, DTYPE_INT16, RED_SUM, &r->e) ? 2 : 0;
}

Test(cuda_nccl_mock_gpu, peer_skipping_an_op_times_out_and_aborts_the_communicator) {
  res_t r[2];
  run_agents(2, build_then_zero_goes_again, r);
  cr_assert_eq(r[1].rc, 0, "%s", r[1].e.msg);
  cr_assert_eq(r[0].rc, 2, "the first round succeeds, the second fails: %s", r[0].e.msg);
  expect_failed(&r[0], 3.0,
                "allreduce over ranks [0,1]: a peer did not take part within 0.2 s; the "
                "communicator was aborted", NULL);
  cr_expect_eq(fake.aborts, 1);
  cr_expect_eq(fake.comms_live, 1, "only agent 1's communicator is left");
  expect_nothing_left(); /* staging and gather scratch freed on failure */

  /* dropped from agent 0's cache: its next call makes a new id */
  int ids = fake.ids;
  run_agents(1, build_then_zero_goes_again, r);
  cr_expect_neq(r[0].rc, 0);
  cr_expect_eq(fake.ids, ids + 1, "a failed communicator must not be reused");
}

static void *declare_rank1_lost(void *arg) {
  struct timespec ts = {0, 400 * 1000000L}; /* after round one, within round two */
  nanosleep(&ts, NULL);
  cuda_peer_lost(&A[0].b, 10, 1); /* session key 10, as build_then_zero_goes_again's group */
  return arg;
}

Test(cuda_nccl_mock_gpu, a_peer_declared_lost_aborts_a_waiting_communicator_at_once) {
  A[0].st.comm_timeout_ms = 10000; /* only the loss may end agent 0's wait */
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, declare_rank1_lost, NULL), 0);
  res_t r[2];
  run_agents(2, build_then_zero_goes_again, r);
  pthread_join(t, NULL);
  cr_assert_eq(r[1].rc, 0, "%s", r[1].e.msg);
  cr_assert_eq(r[0].rc, 2, "the first round succeeds, the second fails: %s", r[0].e.msg);
  cr_expect_eq(r[0].e.kind, ERR_AGENT_LOST, "%s", r[0].e.msg);
  cr_expect(strstr(r[0].e.msg, "rank 1 was declared lost"), "%s", r[0].e.msg);
  cr_expect_lt(r[0].secs, 3.0, "waited %.2f s: the loss did not end the wait", r[0].secs);
  cr_expect_eq(fake.aborts, 1);
  expect_nothing_left();
  /* Another session's communicator with the same ranks is not touched. */
  cuda_peer_lost(&A[0].b, 999, 1);
  cr_expect_eq(fake.aborts, 1);
}

static void *declare_rank1_lost_in_setup(void *arg) {
  struct timespec ts = {0, 300 * 1000000L}; /* agent 0 is in init, which never completes */
  nanosleep(&ts, NULL);
  cuda_peer_lost(&A[0].b, 9, 1); /* session key 9, as allreduce_of_two's group */
  return arg;
}

/* A peer declared lost while this agent sets the communicator up (bootstrap
 * done, init polling): the wait ends at once with AGENT_LOST, as it does for
 * a communicator already made, not at comm_timeout_ms with "a peer did not
 * join". */
Test(cuda_nccl_mock_gpu, a_peer_declared_lost_aborts_a_communicator_being_set_up) {
  fake_never_join = 1;
  A[0].st.comm_timeout_ms = 10000; /* only the loss may end agent 0's wait */
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, declare_rank1_lost_in_setup, NULL), 0);
  res_t r[2];
  run_agents(2, allreduce_of_two, r);
  pthread_join(t, NULL);
  cr_assert_neq(r[0].rc, 0, "agent 0 should have failed");
  cr_expect_eq(r[0].e.kind, ERR_AGENT_LOST, "%s", r[0].e.msg);
  cr_expect(strstr(r[0].e.msg, "allreduce over ranks [0,1]: rank 1 was declared lost"), "%s",
            r[0].e.msg);
  cr_expect_lt(r[0].secs, 3.0, "waited %.2f s: the loss did not end the setup", r[0].secs);
  cr_expect_eq(fake.comms_live, 0);
  cr_expect_eq(fake.streams_live, 0);
  cr_expect_eq(fake.events_live, 0);
  /* Nothing is left flagged: the next round of the session makes a new one. */
  fake_never_join = 0;
  A[0].st.comm_timeout_ms = COMM_TIMEOUT_MS;
  call_no++;
  run_agents(2, allreduce_of_two, r);
  expect_ok(r, 2);
}

Test(cuda_nccl_mock_gpu, nccl_error_mid_op_aborts_both_and_the_next_call_rebuilds) {
  res_t r[2];
  run_agents(2, allreduce_of_two, r);
  expect_ok(r, 2);
  fake_op_error = ncclRemoteError;
  run_agents(2, allreduce_of_two, r);
  for (int i = 0; i < 2; i++)
    expect_failed(&r[i], 2.0,
                  "allreduce over ranks [0,1]: NCCL failed: fake remote error: fake last error; "
                  "the communicator was aborted", NULL);
  cr_expect_eq(fake.aborts, 2);
  cr_expect_eq(fake.comms_live, 0);
  fake_op_error = 0;
  run_agents(2, allreduce_of_two, r);
  expect_ok(r, 2);
  cr_expect_eq(fake.inits, 4, "rebuilt after the abort: %d", (int)fake.inits);
  cr_expect_eq(fake.ids, 2);
}

Test(cuda_nccl_mock_gpu, aborted_work_that_does_not_stop_orders_the_callers_stream_and_loses_the_device) {
  /* The NCCL kernels go on after the abort (the communicator's stream never
   * drains): the caller frees its buffers after the call, so its stream must
   * wait for the communicator's, and the device is taken as lost. */
  fake_op_error = ncclRemoteError;
  fake_stream_busy = 1;
  res_t r[2];
  int waits = fake.stream_waits;
  run_agents(2, allreduce_of_two, r);
  fake_op_error = 0;
  fake_stream_busy = 0;
  for (int i = 0; i < 2; i++) {
    expect_failed(&r[i], 3.0, "the communicator was aborted", NULL);
    cr_expect(A[i].st.lost, "agent %d: device not taken as lost", i);
    cr_expect(strstr(A[i].st.lost_why, "the aborted NCCL work did not stop"), "agent %d: %s", i,
              A[i].st.lost_why);
  }
  cr_expect_eq(fake.marked_lost, 2);
  /* per agent: the communicator after the caller, then the caller after it */
  cr_expect_eq(fake.stream_waits - waits, 4, "%d", fake.stream_waits - waits);
}

static const char *const ADDRS_OTHER[] = {"h:0", "h:9"};

static void disagree_on_addresses(agent_t *a, res_t *r) {
  dp_group_t g = group(600, 11, 2, (size_t)r->me);
  if (r->me == 1) g.addrs = ADDRS_OTHER;
  int32_t *d = fake_dev_alloc(sizeof *d);
  r->rc = cuda_allreduce(&a->b, NULL, &g, d, 1, DTYPE_INT32, RED_SUM, &r->e);
  fake_dev_free(d);
}

/* A member that fails before it joins refuses the call (backend refuse):
 * its peer, waiting in NCCL, watches the data plane and fails at once with
 * the reason instead of at the 2 s timeout; the refuser drops its cached
 * communicator as the peer drops its own, so the next call rebuilds it with
 * both and runs. */
static void refuse_round(agent_t *a, res_t *r) {
  dp_group_t g = group(620, 13, 2, (size_t)r->me);
  int32_t *d = fake_dev_alloc(sizeof *d);
  *d = r->me + 1;
  if (r->me == 1 && call_no == 8) { /* calls 8 .. 11: an instruction's steps */
    usleep(100 * 1000); /* agent 0 waits in NCCL by then */
    cuda_refuse(&a->b, &g, DP_REFUSE_GROUP, 4, "no device memory for the staging copy");
  } else {
    r->rc = cuda_allreduce(&a->b, NULL, &g, d, 1, DTYPE_INT32, RED_SUM, &r->e);
    r->wrong += r->rc == 0 && *d != 3;
  }
  fake_dev_free(d);
}

Test(cuda_nccl_mock_gpu, a_refusal_fails_the_peer_waiting_in_nccl_at_once) {
  res_t r[2];
  call_no = 4;
  run_agents(2, refuse_round, r);
  expect_ok(r, 2);
  cr_expect_eq(fake.ids, 1);
  call_no = 8;
  run_agents(2, refuse_round, r);
  expect_failed(&r[0], 1.0, "rank 1 did not take part: no device memory for the staging copy",
                "the communicator was aborted");
  cr_expect_eq(fake.dp_refusals, 1);
  cr_expect_geq(fake.dp_watches, 3, "the waits watched the data plane");
  cr_expect_eq(fake.comms_live, 0, "the refuser kept its communicator");
  call_no = 12;
  run_agents(2, refuse_round, r);
  expect_ok(r, 2);
  cr_expect_eq(fake.ids, 2, "the next call did not rebuild the communicator");
}

/* The same on a communicator's first use: members 0 and 1 set it up (the
 * id handed out, ncclCommInitRank waiting for member 2) while member 2
 * refuses; the setup watches the data plane and is aborted at once, naming
 * the refusal, rather than at the timeout. */
static void refuse_first_use(agent_t *a, res_t *r) {
  dp_group_t g = group(630, 14, 3, (size_t)r->me);
  int32_t *d = fake_dev_alloc(sizeof *d);
  if (r->me == 2) {
    usleep(100 * 1000);
    cuda_refuse(&a->b, &g, DP_REFUSE_GROUP, 4, "no device stream");
  } else {
    r->rc = cuda_allreduce(&a->b, NULL, &g, d, 1, DTYPE_INT32, RED_SUM, &r->e);
  }
  fake_dev_free(d);
}

Test(cuda_nccl_mock_gpu, a_refusal_aborts_a_communicator_being_set_up) {
  res_t r[3];
  fake_never_join = 1; /* init completes only with every member: never, here */
  run_agents(3, refuse_first_use, r);
  for (int i = 0; i < 2; i++)
    expect_failed(&r[i], 1.0, "rank 2 did not take part: no device stream",
                  "setting up the NCCL communicator was aborted");
  cr_expect_eq(fake.comms_live, 0);
}

Test(cuda_nccl_mock_gpu, members_disagreeing_on_the_group_fail_at_bootstrap) {
  res_t r[2];
  run_agents(2, disagree_on_addresses, r);
  expect_failed(&r[1], 2.0,
                "allreduce over ranks [0,1]: rank 0 sent an NCCL id for another communicator",
                NULL);
  expect_failed(&r[0], 2.0, "took longer than 0.2 s", NULL);
  cr_expect_eq(fake.inits, 1, "agent 1 must not join with the wrong id");
  cr_expect_eq(fake.comms_live, 0);
}

/* Pair secrets (Group.pair_secrets): member 0 hands the NCCL id to member i
 * over a link that proves their pair's secret, not the group's. Entry j of
 * member i's row: bytes of the pair {i, j}; member 2's row for member 0 is
 * wrong in the second run, so the id never reaches it (a member that does not
 * hold {0, 2}'s secret gets nothing), while member 1 joins as before. */
static uint8_t pair_rows[3][3 * DP_SECRET_LEN];
static void pair_rows_fill(bool spoil) {
  for (size_t i = 0; i < 3; i++)
    for (size_t j = 0; j < 3; j++) {
      size_t a = i < j ? i : j, b = i ^ j ^ a;
      memset(pair_rows[i] + j * DP_SECRET_LEN, i == j ? 0 : (int)(0x40 + 4 * a + b), DP_SECRET_LEN);
    }
  if (spoil) pair_rows[2][0] ^= 1;
}

static uint64_t pair_comm = 610;
static void boot_with_pairs(agent_t *a, res_t *r) {
  dp_group_t g = group(pair_comm, 12, 3, (size_t)r->me);
  g.pair_secrets = pair_rows[r->me];
  int32_t *d = fake_dev_alloc(sizeof *d);
  *d = r->me + 1;
  r->rc = cuda_allreduce(&a->b, NULL, &g, d, 1, DTYPE_INT32, RED_SUM, &r->e);
  r->wrong += r->rc == 0 && *d != 6;
  fake_dev_free(d);
}

Test(cuda_nccl_mock_gpu, the_bootstrap_proves_pair_secrets) {
  res_t r[3];
  pair_rows_fill(false);
  run_agents(3, boot_with_pairs, r);
  expect_ok(r, 3);
  cr_expect_eq(fake.inits, 3);
  fake.inits = 0;
  pair_rows_fill(true);
  pair_comm++;
  call_no++;
  run_agents(3, boot_with_pairs, r);
  expect_failed(&r[2], 2.0, "receiving the NCCL id from rank 0 failed", NULL);
  cr_expect_eq(fake.inits, 2, "member 2 joined without the id (%d inits)", (int)fake.inits);
}

/* ------------------------------------------------------- lifetime */

static void build_two_sessions(agent_t *a, res_t *r) {
  for (uint64_t comm = 700; comm < 703; comm++) { /* session 7: three communicators */
    dp_group_t g = group(comm, 7, 2, (size_t)r->me);
    int32_t *d = fake_dev_alloc(sizeof *d);
    *d = 1;
    r->rc |= cuda_allreduce(&a->b, NULL, &g, d, 1, DTYPE_INT32, RED_SUM, &r->e);
    r->wrong += *d != 2;
    fake_dev_free(d);
  }
  dp_group_t g = group(800, 8, 2, (size_t)r->me); /* session 8: one */
  int32_t v = 5;
  r->rc |= cuda_allreduce(&a->b, NULL, &g, &v, 1, DTYPE_INT32, RED_SUM, &r->e);
  r->wrong += v != 10;
}

static void end_session_7(agent_t *a, res_t *r) { cuda_session_end(&a->b, 7); }

Test(cuda_nccl_mock_gpu, session_end_finalizes_its_communicators_only_and_they_rebuild) {
  res_t r[2];
  run_agents(2, build_two_sessions, r);
  expect_ok(r, 2);
  cr_assert_eq(fake.comms_live, 8);
  run_agents(2, end_session_7, r);
  cr_expect_eq(fake.finalizes, 6);
  cr_expect_eq(fake.destroys, 6, "finalized, then destroyed: %d", (int)fake.destroys);
  cr_expect_eq(fake.aborts, 0);
  cr_expect_eq(fake.comms_live, 2, "session 8's communicators stay");
  cr_expect_eq(fake.streams_live, 2);
  cr_expect_eq(fake.events_live, 4);
  int inits = fake.inits;
  run_agents(2, build_two_sessions, r);
  expect_ok(r, 2);
  cr_expect_eq(fake.inits, inits + 6, "session 7 rebuilt, session 8 reused: %d",
               (int)fake.inits - inits);
}

Test(cuda_nccl_mock_gpu, finalize_that_hangs_is_aborted_with_one_deadline_per_session) {
  res_t r[2];
  run_agents(2, build_two_sessions, r);
  expect_ok(r, 2);
  fake_finalize_hangs = 1;
  /* One deadline of 1 s, or three (3 s): 1 s of slack either way for a loaded machine. */
  A[0].st.comm_timeout_ms = 1000;
  double t0 = now_s();
  cuda_session_end(&A[0].b, 7);
  double secs = now_s() - t0;
  cr_expect_eq(fake.aborts, 3);
  cr_expect_eq(fake.destroys, 0);
  cr_expect_geq(secs, 0.95, "gave finalize %.3f s", secs);
  cr_expect_lt(secs, 2.0, "three hung communicators cost %.2f s, not one timeout", secs);
  cr_expect_eq(fake.streams_live, 5, "agent 0's session 7 streams destroyed");
}

/* Two streams of each agent make a communicator at once: an allreduce's
 * (comm 900) and a send from agent 1 to agent 0 (comm 901). NCCL rank 1's
 * inits are held until each agent has made its rank 0 one, so agent 0 holds
 * 900 before 901 and agent 1 holds 901 before 900. */
static void allreduce_900(agent_t *a, res_t *r) {
  dp_group_t g = group(900, 9, 2, (size_t)r->me);
  int32_t v = r->me + 1;
  r->rc |= cuda_allreduce(&a->b, NULL, &g, &v, 1, DTYPE_INT32, RED_SUM, &r->e);
  r->wrong += v != 3;
}

static void send_901(agent_t *a, res_t *r) {
  int64_t v = 901;
  r->rc |= cuda_send(&a->b, NULL, 9, 901, 1, SECRET, 0, ADDRS[0], &v, sizeof v, &r->e);
}

static void recv_901(agent_t *a, res_t *r) {
  int64_t v = 0;
  r->rc |= cuda_recv(&a->b, NULL, 9, 901, 1, SECRET, 1, ADDRS[1], &v, sizeof v, &r->e);
  r->wrong += v != 901;
}

static void end_session_9(agent_t *a, res_t *r) { cuda_session_end(&a->b, 9); }

Test(cuda_nccl_mock_gpu, session_end_finalizes_together_when_peers_made_them_in_another_order) {
  static const agent_fn fns[4] = {allreduce_900, allreduce_900, send_901, recv_901};
  static const int who[4] = {0, 1, 1, 0};
  res_t r[4];
  pthread_t th[4];
  thread_arg_t args[4];
  /* Long enough that a loaded machine never reaches it: the proof is the
   * abort count (finalized one by one, each agent waits for this long). */
  A[0].st.comm_timeout_ms = A[1].st.comm_timeout_ms = 3000;
  fake_hold_rank1_inits = 1;
  for (int i = 0; i < 4; i++) {
    memset(&r[i], 0, sizeof r[i]);
    r[i].me = who[i];
    args[i] = (thread_arg_t){fns[i], &r[i]};
    cr_assert_eq(pthread_create(&th[i], NULL, agent_main, &args[i]), 0);
  }
  /* Agent 0's allreduce and agent 1's send are posted: their communicators
   * are cached first. */
  double until = now_s() + 5;
  while ((fake.native_ops < 1 || fake.p2p_ops < 1) && now_s() < until) usleep(200);
  bool ordered = fake.native_ops == 1 && fake.p2p_ops == 1;
  fake_hold_rank1_inits = 0;
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  cr_assert(ordered, "the rank 0 communicators were not made first (%d, %d ops)",
            (int)fake.native_ops, (int)fake.p2p_ops);
  expect_ok(r, 4);
  cr_assert_eq(fake.comms_live, 4);
  /* Finalized one at a time, each agent would wait for the other's first
   * until the deadline, then abort them all. */
  run_agents(2, end_session_9, r);
  cr_expect_eq(fake.finalizes, 4);
  cr_expect_eq(fake.aborts, 0, "finalizes that waited on each other were aborted: %d",
               (int)fake.aborts);
  cr_expect_eq(fake.destroys, 4, "finalized, then destroyed: %d", (int)fake.destroys);
  cr_expect_eq(fake.comms_live, 0);
  cr_expect_eq(fake.streams_live, 0);
  cr_log_info("session end took %.3f s and %.3f s", r[0].secs, r[1].secs);
}

static void build_group_and_pairs(agent_t *a, res_t *r) {
  allreduce_on_device(a, r);
  send_recv_both_ways(a, r);
}

Test(cuda_nccl_mock_gpu, comms_destroy_aborts_and_frees_everything) {
  res_t r[2];
  run_agents(2, build_group_and_pairs, r);
  expect_ok(r, 2);
  cr_assert_eq(fake.comms_live, 6);
  cr_assert_eq(fake.streams_live, 6);
  cr_assert_eq(fake.events_live, 12);
  agents_close();
  cr_expect_eq(fake.aborts, 6);
  cr_expect_eq(fake.comms_live, 0);
  cr_expect_eq(fake.streams_live, 0);
  cr_expect_eq(fake.events_live, 0);
  expect_nothing_left();
}

/* ------------------------------------------------------- arguments */

static void expect_refused(int rc, const meshd_error_t *e, error_kind_t kind, const char *frag) {
  cr_expect_eq(rc, -1);
  cr_expect_eq(e->kind, kind, "%s", e->msg);
  cr_expect(strstr(e->msg, frag), "'%s' lacks '%s'", e->msg, frag);
}

static void expect_bad(int rc, const meshd_error_t *e, const char *frag) {
  expect_refused(rc, e, ERR_BAD_ARGUMENT, frag);
}

Test(cuda_nccl_mock_gpu, bad_arguments_are_rejected_before_any_nccl_call) {
  backend_t *b = &A[0].b;
  dp_group_t g = group(900, 1, 2, 0);
  meshd_error_t e = {0};
  float f[4] = {0};
  /* The catalogue's dtype rules (reduction.h), as the server and the cpu data plane. */
  int rc = cuda_allreduce(b, NULL, &g, f, 1, DTYPE_FLOAT32, RED_BXOR, &e);
  expect_refused(rc, &e, ERR_DTYPE_MISMATCH,
                 "allreduce: 'bxor' is bitwise and needs an integer or bool tensor, not float32");
  uint8_t bools[4] = {0};
  rc = cuda_reduce_scatter(b, NULL, &g, bools, bools + 2, 1, DTYPE_BOOL, RED_AVG, &e);
  expect_refused(rc, &e, ERR_DTYPE_MISMATCH, "reduce_scatter: 'avg' needs a floating dtype, not bool");
  int32_t ints[4] = {0};
  rc = cuda_allreduce(b, NULL, &g, ints, 1, DTYPE_INT32, RED_AVG, &e);
  expect_refused(rc, &e, ERR_DTYPE_MISMATCH, "allreduce: 'avg' needs a floating dtype, not int32");
  rc = cuda_allreduce(b, NULL, &g, f, 1, DTYPE_FLOAT32, RED_STACK, &e);
  expect_bad(rc, &e, "allreduce: reduction 'stack' gathers rather than combines");
  rc = cuda_allgather(b, NULL, &g, f, f, 1, (dtype_t)99, &e);
  expect_bad(rc, &e, "allgather: dtype 99 is not a known dtype");
  const char *holes[] = {"h:0", NULL};
  g.addrs = holes;
  rc = cuda_alltoall(b, NULL, &g, f, f + 2, 1, DTYPE_FLOAT32, &e);
  expect_bad(rc, &e, "alltoall: group member 1 has no address");
  g.addrs = ADDRS;
  g.me = 2;
  rc = cuda_allreduce(b, NULL, &g, f, 1, DTYPE_FLOAT32, RED_SUM, &e);
  expect_bad(rc, &e, "allreduce: needs a group with this agent in it");
  rc = cuda_send(b, NULL, 1, 900, 1, SECRET, 1, NULL, f, 4, &e);
  expect_bad(rc, &e, "send on comm 900: needs a peer address, a buffer and the channel's secret (missing: address)");
  rc = cuda_recv(b, NULL, 1, 900, 1, SECRET, 1, "h:1", NULL, 4, &e);
  expect_bad(rc, &e, "recv on comm 900: needs a peer address, a buffer and the channel's secret (missing: buffer)");
  rc = cuda_send(b, NULL, 1, 900, 1, NULL, 1, "h:1", f, 4, &e);
  expect_bad(rc, &e, "(missing: secret)");
  g.me = 0;
  g.secret = NULL;
  rc = cuda_allreduce(b, NULL, &g, f, 1, DTYPE_FLOAT32, RED_SUM, &e);
  expect_bad(rc, &e, "allreduce on comm 900: the group has no secret");
  g.secret = SECRET;
  rc = cuda_reduce_root(b, NULL, &g, 2, f, 1, DTYPE_FLOAT32, RED_SUM, &e);
  expect_bad(rc, &e, "reduce: root 2 is not a member of a group of 2");
  rc = cuda_gather_root(b, NULL, &g, 5, f, f + 2, 1, DTYPE_FLOAT32, &e);
  expect_bad(rc, &e, "gather: root 5 is not a member of a group of 2");
  rc = cuda_reduce_root(b, NULL, &g, 1, f, 1, DTYPE_FLOAT32, RED_BAND, &e);
  expect_refused(rc, &e, ERR_DTYPE_MISMATCH,
                 "reduce: 'band' is bitwise and needs an integer or bool tensor, not float32");
  rc = cuda_gather_root(b, NULL, &g, 1, f, f + 2, 1, (dtype_t)99, &e);
  expect_bad(rc, &e, "gather: dtype 99 is not a known dtype");
  g.me = 2;
  rc = cuda_broadcast(b, NULL, &g, f, 4, &e);
  expect_bad(rc, &e, "broadcast: needs a group with this agent in it");
  g.me = 0;
  rc = cuda_broadcast(b, NULL, &g, NULL, 4, &e);
  expect_bad(rc, &e, "broadcast: no buffer for 4 bytes");
  g.me = 2;

  A[0].b.net = NULL; /* the data plane failed to start */
  g.me = 0;
  rc = cuda_allreduce(b, NULL, &g, f, 1, DTYPE_FLOAT32, RED_SUM, &e);
  cr_expect_eq(rc, -1);
  cr_expect_eq(e.kind, ERR_REMOTE_FAILURE);
  cr_expect(strstr(e.msg, "allreduce over ranks [0,1]: this agent has no data plane"), "%s", e.msg);
  cr_expect_eq(fake.ids + fake.inits + fake.streams_live, 0, "no NCCL or CUDA object made");
}

Test(cuda_nccl_mock_gpu, empty_and_one_member_ops_make_no_communicator) {
  backend_t *b = &A[0].b;
  meshd_error_t e = {0};
  dp_group_t two = group(901, 1, 2, 0), one = group(902, 1, 1, 0);
  int32_t buf[2] = {7, 8}, out[2] = {0};
  cr_expect_eq(cuda_allreduce(b, NULL, &two, buf, 0, DTYPE_INT32, RED_SUM, &e), 0);
  cr_expect_eq(cuda_allreduce(b, NULL, &one, buf, 2, DTYPE_INT32, RED_PRODUCT, &e), 0);
  cr_expect(buf[0] == 7 && buf[1] == 8, "a product over one member is the identity");
  cr_expect_eq(cuda_reduce_scatter(b, NULL, &one, buf, out, 2, DTYPE_INT32, RED_SUM, &e), 0);
  cr_expect(out[0] == 7 && out[1] == 8);
  out[0] = out[1] = 0;
  cr_expect_eq(cuda_allgather(b, NULL, &one, buf, out, 2, DTYPE_INT32, &e), 0);
  cr_expect(out[0] == 7 && out[1] == 8);
  out[0] = out[1] = 0;
  cr_expect_eq(cuda_gather_root(b, NULL, &one, 0, buf, out, 2, DTYPE_INT32, &e), 0);
  cr_expect(out[0] == 7 && out[1] == 8);
  cr_expect_eq(cuda_reduce_root(b, NULL, &one, 0, buf, 2, DTYPE_INT32, RED_SUM, &e), 0);
  cr_expect_eq(cuda_reduce_root(b, NULL, &two, 1, buf, 0, DTYPE_INT32, RED_SUM, &e), 0);
  cr_expect_eq(cuda_broadcast(b, NULL, &one, buf, 8, &e), 0);
  cr_expect_eq(cuda_broadcast(b, NULL, &two, buf, 0, &e), 0);
  cr_expect(buf[0] == 7 && buf[1] == 8);
  cr_expect_eq(fake.memcpy_calls, 3, "one-member reduce_scatter, allgather, gather copy locally");
  cr_expect_eq(cuda_send(b, NULL, 1, 903, 1, SECRET, 1, "h:1", buf, 0, &e), 0);
  cr_expect_eq(fake.ids + fake.inits, 0);
}

Test(cuda_nccl_mock_gpu, emulated_device_delegates_to_the_data_plane) {
  backend_t *b = &A[0].b;
  A[0].st.emulated = true;
  A[0].st.device = -1;
  meshd_error_t e = {0};
  dp_group_t g = group(904, 1, 2, 0);
  int32_t buf[4] = {0};
  cr_expect_eq(cuda_allreduce(b, NULL, &g, buf, 1, DTYPE_INT32, RED_SUM, &e), 0);
  cr_expect_eq(cuda_reduce_scatter(b, NULL, &g, buf, buf + 2, 1, DTYPE_INT32, RED_SUM, &e), 0);
  cr_expect_eq(cuda_allgather(b, NULL, &g, buf, buf + 2, 1, DTYPE_INT32, &e), 0);
  cr_expect_eq(cuda_alltoall(b, NULL, &g, buf, buf + 2, 1, DTYPE_INT32, &e), 0);
  cr_expect_eq(cuda_reduce_root(b, NULL, &g, 1, buf, 1, DTYPE_INT32, RED_SUM, &e), 0);
  cr_expect_eq(cuda_gather_root(b, NULL, &g, 1, buf, buf + 2, 1, DTYPE_INT32, &e), 0);
  cr_expect_eq(cuda_broadcast(b, NULL, &g, buf, 4, &e), 0);
  cr_expect_eq(fake.dp_collectives, 7);
  cuda_refuse(b, &g, DP_REFUSE_GROUP, 4, "no room");
  cr_expect_eq(fake.dp_refusals, 1, "a refusal goes to the data plane, where the peers wait");
  cuda_session_end(b, 1);
  cr_expect_eq(fake.ids + fake.inits + fake.streams_live + fake.finalizes, 0,
               "no NCCL or CUDA call when emulated");
  A[0].b.net = NULL;
  cr_expect_eq(cuda_alltoall(b, NULL, &g, buf, buf + 2, 1, DTYPE_INT32, &e), -1);
  cr_expect(strstr(e.msg, "alltoall: this agent has no data plane"), "%s", e.msg);
  cr_expect_eq(cuda_reduce_root(b, NULL, &g, 1, buf, 1, DTYPE_INT32, RED_SUM, &e), -1);
  cr_expect(strstr(e.msg, "reduce: this agent has no data plane"), "%s", e.msg);
  cr_expect_eq(cuda_broadcast(b, NULL, &g, buf, 4, &e), -1);
  cr_expect(strstr(e.msg, "broadcast: this agent has no data plane"), "%s", e.msg);
}
