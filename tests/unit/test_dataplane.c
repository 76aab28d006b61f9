/* agent/dataplane/: N data planes in one process on 127.0.0.1:0, one
 * thread per member, results checked against values computed here. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dataplane/dataplane.h"
#include "dataplane/wire.h"
#include "half.h"
#include "runtime.h"


#define MAXN 5

/* The groups' secret (the server's HMAC(comm_key, comm_id) in the agent). */
static const uint8_t SECRET[DP_SECRET_LEN] = "0123456789abcdef0123456789abcde";

typedef struct world {
  size_t n;
  dataplane_t *dp[MAXN];
  uint32_t ranks[MAXN];
  char addr_buf[MAXN][300];
  const char *addrs[MAXN];
  /* world_pairs: member i's pair secrets (Group.pair_secrets), entry j the
   * secret of the pair {i, j}, as the server derives one per pair. */
  bool pairs;
  uint8_t pair[MAXN][MAXN * DP_SECRET_LEN];
} world_t;

/* The secret of the pair {i, j} of world w, for a test: any bytes that differ
 * from pair to pair (and from SECRET). */
static void pair_secret(size_t i, size_t j, uint8_t out[DP_SECRET_LEN]) {
  size_t a = i < j ? i : j, b = i ^ j ^ a;
  for (size_t k = 0; k < DP_SECRET_LEN; k++) out[k] = (uint8_t)(0xa0 + 16 * a + b + 7 * k);
}

/* The groups of w prove per-pair secrets from now on. */
static void world_pairs(world_t *w) {
  w->pairs = true;
  for (size_t i = 0; i < MAXN; i++)
    for (size_t j = 0; j < MAXN; j++) {
      if (i == j) memset(w->pair[i] + j * DP_SECRET_LEN, 0, DP_SECRET_LEN);
      else pair_secret(i, j, w->pair[i] + j * DP_SECRET_LEN);
    }
}

/* n data planes advertising host (NULL: 127.0.0.1). */
static void world_start_at(world_t *w, size_t n, int timeout_ms, const char *host) {
  memset(w, 0, sizeof *w);
  w->n = n;
  host = host ? host : "127.0.0.1";
  for (size_t i = 0; i < n; i++) {
    meshd_error_t err = {0};
    w->ranks[i] = 10 + (uint32_t)i;
    w->dp[i] = dataplane_start(host, w->ranks[i], timeout_ms, &err);
    cr_assert(w->dp[i], "dataplane_start: %s", err.msg);
    snprintf(w->addr_buf[i], sizeof w->addr_buf[i], "%s:%d", host, dataplane_port(w->dp[i]));
    w->addrs[i] = w->addr_buf[i];
  }
}

static void world_start(world_t *w, size_t n, int timeout_ms) {
  world_start_at(w, n, timeout_ms, NULL);
}

static void world_stop(world_t *w) {
  for (size_t i = 0; i < w->n; i++)
    if (w->dp[i]) dataplane_stop(w->dp[i]);
}

static dp_group_t group(const world_t *w, uint64_t comm, size_t me) {
  return (dp_group_t){.comm_id = comm, .ranks = w->ranks, .addrs = w->addrs, .n = w->n, .me = me,
                      .secret = SECRET, .pair_secrets = w->pairs ? w->pair[me] : NULL};
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ------------------------------------------------------------ one call per member */

typedef enum {
  K_ALLREDUCE, K_RS, K_AG, K_A2A, K_REDUCE_ROOT, K_GATHER_ROOT, K_BROADCAST,
  K_REFUSE,                 /* dp_refuse of the group */
  K_SEND, K_RECV,           /* to / from member `root`, count bytes */
  K_REFUSE_SEND, K_REFUSE_RECV /* dp_refuse of that send / recv */
} kind_t;

typedef struct job {
  world_t *w;
  size_t me;
  uint64_t comm, call;
  kind_t kind;
  dtype_t dtype;
  reduction_t op;
  size_t count, root;
  void *in, *out;
  bool map; /* broadcast: in is a private mapping the data plane may map over */
  int delay_ms; /* waited before the call */
  bool flag;    /* then, if it succeeded, a failure flag's allreduce (call + 1), as an agent does */
  const char *why; /* a refusal's reason */
  int rc;
  meshd_error_t err;
  int64_t took_ms;
} job_t;

static void *job_main(void *arg) {
  job_t *j = arg;
  dp_group_t g = group(j->w, j->comm, j->me);
  g.mappable = j->map;
  g.call = j->call;
  if (j->delay_ms > 0) usleep((useconds_t)j->delay_ms * 1000);
  /* A send or recv's group: the one peer. */
  const char *peer_addr[1] = {j->w->addrs[j->root]};
  dp_group_t pg = {.comm_id = j->comm, .call = j->call, .ranks = &j->w->ranks[j->root],
                   .addrs = peer_addr, .n = 1, .secret = SECRET};
  int64_t t0 = now_ms();
  switch (j->kind) {
  /* Two calls, as an agent's instruction makes (a collective, its failure flag). */
  case K_REFUSE: j->rc = dp_refuse(j->w->dp[j->me], &g, DP_REFUSE_GROUP, 2, j->why, &j->err); break;
  case K_REFUSE_SEND: j->rc = dp_refuse(j->w->dp[j->me], &pg, DP_REFUSE_SEND, 2, j->why, &j->err); break;
  case K_REFUSE_RECV: j->rc = dp_refuse(j->w->dp[j->me], &pg, DP_REFUSE_RECV, 2, j->why, &j->err); break;
  case K_SEND:
    j->rc = dp_send(j->w->dp[j->me], j->comm, j->call, SECRET, j->w->ranks[j->root],
                    j->w->addrs[j->root], j->in, j->count, &j->err);
    break;
  case K_RECV:
    j->rc = dp_recv(j->w->dp[j->me], j->comm, j->call, SECRET, j->w->ranks[j->root],
                    j->w->addrs[j->root], j->in, j->count, &j->err);
    break;
  case K_ALLREDUCE: j->rc = dp_allreduce(j->w->dp[j->me], &g, j->in, j->count, j->dtype, j->op, &j->err); break;
  case K_RS: j->rc = dp_reduce_scatter(j->w->dp[j->me], &g, j->in, j->out, j->count, j->dtype, j->op, &j->err); break;
  case K_AG: j->rc = dp_allgather(j->w->dp[j->me], &g, j->in, j->out, j->count, j->dtype, &j->err); break;
  case K_A2A: j->rc = dp_alltoall(j->w->dp[j->me], &g, j->in, j->out, j->count, j->dtype, &j->err); break;
  case K_REDUCE_ROOT:
    j->rc = dp_reduce_root(j->w->dp[j->me], &g, j->root, j->in, j->count, j->dtype, j->op, &j->err);
    break;
  case K_BROADCAST: j->rc = dp_broadcast(j->w->dp[j->me], &g, j->in, j->count, &j->err); break;
  case K_GATHER_ROOT:
    j->rc = dp_gather_root(j->w->dp[j->me], &g, j->root, j->in, j->out, j->count, j->dtype, &j->err);
    break;
  }
  if (j->rc == 0 && j->flag) {
    float f = 0;
    g.call++;
    j->rc = dp_allreduce(j->w->dp[j->me], &g, &f, 1, DTYPE_FLOAT32, RED_MAX, &j->err);
  }
  j->took_ms = now_ms() - t0;
  return NULL;
}

/* Runs jobs[0..n) on their own threads; jobs with skip[i] set do not join. */
static void run_jobs(job_t *jobs, size_t n) {
  pthread_t th[MAXN * 2];
  for (size_t i = 0; i < n; i++) pthread_create(&th[i], NULL, job_main, &jobs[i]);
  for (size_t i = 0; i < n; i++) pthread_join(th[i], NULL);
}

/* ------------------------------------------------------------ values */

static float fval(size_t r, size_t i) { return (float)((i * 7 + r * 3) % 11) - 5.0f; }
static int32_t ival(size_t r, size_t i, reduction_t op) {
  if (op >= RED_BAND) return (int32_t)((uint32_t)i * 2654435761u ^ (uint32_t)r * 40503u);
  return (int32_t)((i * 13 + r * 7) % 1000) - 500;
}
static uint8_t bval(size_t r, size_t i) { return (i + r) % 3 == 0; }

static void fill(dtype_t dt, reduction_t op, size_t r, void *buf, size_t count, size_t base) {
  for (size_t i = 0; i < count; i++) {
    size_t k = base + i;
    switch (dt) {
    case DTYPE_FLOAT32: ((float *)buf)[i] = fval(r, k); break;
    case DTYPE_INT32: ((int32_t *)buf)[i] = ival(r, k, op); break;
    case DTYPE_BOOL: ((uint8_t *)buf)[i] = bval(r, k); break;
    case DTYPE_FLOAT16: ((uint16_t *)buf)[i] = float_to_half((float)(k % 5 + r)); break;
    case DTYPE_BFLOAT16: ((uint16_t *)buf)[i] = float_to_bf16((float)(k % 5 + r)); break;
    default: cr_assert_fail("dtype");
    }
  }
}

/* Checks buf against the reduction over n members of element base + i. */
static void expect_reduced(dtype_t dt, reduction_t op, size_t n, const void *buf, size_t count,
                           size_t base, const char *ctx) {
  for (size_t i = 0; i < count; i++) {
    size_t k = base + i;
    if (dt == DTYPE_FLOAT32) {
      float acc = fval(0, k);
      for (size_t r = 1; r < n; r++) {
        float v = fval(r, k);
        switch (op) {
        case RED_SUM: case RED_AVG: acc += v; break;
        case RED_PRODUCT: acc *= v; break;
        case RED_MIN: acc = v < acc ? v : acc; break;
        case RED_MAX: acc = v > acc ? v : acc; break;
        default: break;
        }
      }
      if (op == RED_AVG) acc /= (float)n;
      float got = ((const float *)buf)[i];
      if (got != acc) cr_assert_fail("%s: element %zu = %g, expected %g", ctx, i, got, acc);
    } else if (dt == DTYPE_INT32) {
      uint32_t acc = (uint32_t)ival(0, k, op);
      for (size_t r = 1; r < n; r++) {
        int32_t v = ival(r, k, op);
        switch (op) {
        case RED_SUM: case RED_AVG: acc += (uint32_t)v; break;
        case RED_PRODUCT: acc *= (uint32_t)v; break;
        case RED_MIN: acc = v < (int32_t)acc ? (uint32_t)v : acc; break;
        case RED_MAX: acc = v > (int32_t)acc ? (uint32_t)v : acc; break;
        case RED_BAND: acc &= (uint32_t)v; break;
        case RED_BOR: acc |= (uint32_t)v; break;
        case RED_BXOR: acc ^= (uint32_t)v; break;
        default: break;
        }
      }
      int32_t want = (int32_t)acc;
      int32_t got = ((const int32_t *)buf)[i];
      if (got != want) cr_assert_fail("%s: element %zu = %d, expected %d", ctx, i, got, want);
    } else if (dt == DTYPE_BOOL) {
      bool acc = bval(0, k);
      for (size_t r = 1; r < n; r++) {
        bool v = bval(r, k);
        switch (op) {
        case RED_SUM: case RED_MAX: case RED_BOR: acc = acc || v; break;
        case RED_PRODUCT: case RED_MIN: case RED_BAND: acc = acc && v; break;
        case RED_BXOR: acc = acc != v; break;
        default: break;
        }
      }
      uint8_t got = ((const uint8_t *)buf)[i];
      if (got != acc) cr_assert_fail("%s: element %zu = %u, expected %d", ctx, i, got, acc);
    } else {
      float want = 0;
      for (size_t r = 0; r < n; r++) want += (float)(k % 5 + r);
      uint16_t h = ((const uint16_t *)buf)[i];
      float got = dt == DTYPE_FLOAT16 ? half_to_float(h) : bf16_to_float(h);
      if (got != want) cr_assert_fail("%s: element %zu = %g, expected %g", ctx, i, got, want);
    }
  }
}

#define BIG_BYTES ((size_t)4 << 20)
#define DP_TEST_SHM_BELOW (((size_t)1 << 20) - 1) /* under DP_SHM_MIN */

static void allreduce_case(world_t *w, uint64_t comm, dtype_t dt, reduction_t op, size_t count) {
  job_t jobs[MAXN];
  size_t esz = dtype_size(dt);
  for (size_t r = 0; r < w->n; r++) {
    jobs[r] = (job_t){.w = w, .me = r, .comm = comm, .kind = K_ALLREDUCE, .dtype = dt, .op = op,
                      .count = count};
    jobs[r].in = malloc(count * esz + 1);
    fill(dt, op, r, jobs[r].in, count, 0);
  }
  run_jobs(jobs, w->n);
  char ctx[128];
  for (size_t r = 0; r < w->n; r++) {
    snprintf(ctx, sizeof ctx, "allreduce n=%zu %s op=%d count=%zu member %zu", w->n, dtype_name(dt),
             (int)op, count, r);
    cr_assert_eq(jobs[r].rc, 0, "%s: %s", ctx, jobs[r].err.msg);
    expect_reduced(dt, op, w->n, jobs[r].in, count, 0, ctx);
    if (r > 0) cr_assert(memcmp(jobs[r].in, jobs[0].in, count * esz) == 0, "%s differs from 0", ctx);
  }
  for (size_t r = 0; r < w->n; r++) free(jobs[r].in);
}

static void allreduce_all(size_t n) {
  world_t w;
  world_start(&w, n, 5000);
  const size_t sizes[] = {0, 1, 1009, 20000, BIG_BYTES / 4 + 7};
  uint64_t comm = 1;
  for (int op = RED_SUM; op <= RED_BXOR; op++) {
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
      if (op <= RED_MAX) allreduce_case(&w, comm++, DTYPE_FLOAT32, (reduction_t)op, sizes[s]);
      if (op == RED_AVG) continue; /* floating only (reduction.h) */
      allreduce_case(&w, comm++, DTYPE_INT32, (reduction_t)op, sizes[s]);
      allreduce_case(&w, comm++, DTYPE_BOOL, (reduction_t)op, sizes[s]);
    }
  }
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    allreduce_case(&w, 7, DTYPE_FLOAT16, RED_SUM, sizes[s]); /* one comm reused */
    allreduce_case(&w, 8, DTYPE_BFLOAT16, RED_SUM, sizes[s]);
  }
  world_stop(&w);
}

Test(dataplane, allreduce_every_op_n2, .timeout = 120) { allreduce_all(2); }
Test(dataplane, allreduce_every_op_n3, .timeout = 120) { allreduce_all(3); }
Test(dataplane, allreduce_every_op_n4, .timeout = 120) { allreduce_all(4); }

/* Reduce onto one member (reduce onto a sub-mesh): the root's buffer holds the
 * reduction, over the direct exchange (small) and the ring then a gather of
 * segments (large, uneven); every root; then a gather of whole buffers. */
static void rooted_case(world_t *w, uint64_t comm, dtype_t dt, reduction_t op, size_t count,
                        size_t root) {
  job_t jobs[MAXN];
  size_t esz = dtype_size(dt), n = w->n;
  for (size_t r = 0; r < n; r++) {
    jobs[r] = (job_t){.w = w, .me = r, .comm = comm, .kind = K_REDUCE_ROOT, .dtype = dt, .op = op,
                      .count = count, .root = root};
    jobs[r].in = malloc(count * esz + 1);
    fill(dt, op, r, jobs[r].in, count, 0);
  }
  run_jobs(jobs, n);
  char ctx[128];
  snprintf(ctx, sizeof ctx, "reduce to %zu of n=%zu %s op=%d count=%zu", root, n, dtype_name(dt),
           (int)op, count);
  for (size_t r = 0; r < n; r++) cr_assert_eq(jobs[r].rc, 0, "%s member %zu: %s", ctx, r, jobs[r].err.msg);
  expect_reduced(dt, op, n, jobs[root].in, count, 0, ctx);
  for (size_t r = 0; r < n; r++) free(jobs[r].in);
}

static void gather_root_case(world_t *w, uint64_t comm, size_t count, size_t root) {
  job_t jobs[MAXN];
  size_t n = w->n;
  for (size_t r = 0; r < n; r++) {
    jobs[r] = (job_t){.w = w, .me = r, .comm = comm, .kind = K_GATHER_ROOT, .dtype = DTYPE_INT32,
                      .op = RED_SUM, .count = count, .root = root};
    jobs[r].in = malloc(count * 4 + 1);
    fill(DTYPE_INT32, RED_SUM, r, jobs[r].in, count, 0);
    jobs[r].out = r == root ? malloc(n * count * 4 + 1) : NULL; /* the others need none */
  }
  run_jobs(jobs, n);
  for (size_t r = 0; r < n; r++)
    cr_assert_eq(jobs[r].rc, 0, "gather to %zu, member %zu: %s", root, r, jobs[r].err.msg);
  for (size_t r = 0; r < n; r++)
    cr_assert(memcmp((int32_t *)jobs[root].out + r * count, jobs[r].in, count * 4) == 0,
              "gather to %zu of n=%zu count=%zu: slice %zu", root, n, count, r);
  for (size_t r = 0; r < n; r++) {
    free(jobs[r].in);
    free(jobs[r].out);
  }
}

Test(dataplane, reduce_and_gather_to_a_root, .timeout = 120) {
  const size_t sizes[] = {0, 1, 1009, BIG_BYTES / 4 + 7};
  uint64_t comm = 300;
  for (size_t n = 2; n <= 4; n++) {
    world_t w;
    world_start(&w, n, 5000);
    for (size_t root = 0; root < n; root++)
      for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        rooted_case(&w, comm++, DTYPE_FLOAT32, root == 1 ? RED_AVG : RED_SUM, sizes[k], root);
        rooted_case(&w, comm++, DTYPE_INT32, root == 0 ? RED_BXOR : RED_MAX, sizes[k], root);
        gather_root_case(&w, comm++, sizes[k], root);
      }
    rooted_case(&w, 9, DTYPE_BFLOAT16, RED_SUM, 50000, n - 1); /* a comm reused */
    rooted_case(&w, 9, DTYPE_BFLOAT16, RED_SUM, 3, 0);
    world_stop(&w);
  }
  world_t w;
  world_start(&w, 2, 1000);
  dp_group_t g = group(&w, 1, 0);
  float f = 1;
  meshd_error_t err = {0};
  cr_assert_eq(dp_reduce_root(w.dp[0], &g, 2, &f, 1, DTYPE_FLOAT32, RED_SUM, &err), -1);
  cr_assert(strstr(err.msg, "root 2 is not a member of a group of 2"), "%s", err.msg);
  world_stop(&w);
}

/* to_mesh's broadcast: member 0's bytes reach every member down the chain,
 * for sizes from nothing to many frames (each relay forwards while it
 * receives), on a comm used again and again. */
Test(dataplane, broadcast_down_the_chain, .timeout = 120) {
  const size_t sizes[] = {0, 1, 1009, BIG_BYTES + 7};
  for (size_t n = 2; n <= 5; n++) {
    world_t w;
    world_start(&w, n, 5000);
    if (n % 2) world_pairs(&w);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
      job_t jobs[MAXN];
      size_t bytes = sizes[k];
      for (size_t r = 0; r < n; r++) {
        jobs[r] = (job_t){.w = &w, .me = r, .comm = 500 + n, .kind = K_BROADCAST, .count = bytes};
        uint8_t *b = malloc(bytes + 1);
        for (size_t i = 0; i < bytes; i++) b[i] = r == 0 ? (uint8_t)(i * 31 + 7) : 0xee;
        jobs[r].in = b;
      }
      run_jobs(jobs, n);
      for (size_t r = 0; r < n; r++) {
        cr_assert_eq(jobs[r].rc, 0, "n=%zu bytes=%zu member %zu: %s", n, bytes, r, jobs[r].err.msg);
        cr_assert(memcmp(jobs[r].in, jobs[0].in, bytes) == 0, "n=%zu bytes=%zu: member %zu differs",
                  n, bytes, r);
      }
      for (size_t i = 0; i < bytes; i += 4099)
        cr_assert_eq(((uint8_t *)jobs[0].in)[i], (uint8_t)(i * 31 + 7), "the source changed");
      for (size_t r = 0; r < n; r++) free(jobs[r].in);
    }
    world_stop(&w);
  }
}

Test(dataplane, allreduce_bitwise_identical_on_every_rank) {
  world_t w;
  world_start(&w, 3, 5000);
  size_t count = 300001;
  job_t jobs[3];
  for (size_t r = 0; r < 3; r++) {
    jobs[r] = (job_t){.w = &w, .me = r, .comm = 5, .dtype = DTYPE_FLOAT32, .op = RED_SUM, .count = count};
    float *f = malloc(count * 4);
    for (size_t i = 0; i < count; i++) f[i] = (float)((i * 2654435761u + r * 977u) % 100003) / 7.3f;
    jobs[r].in = f;
  }
  run_jobs(jobs, 3);
  for (size_t r = 0; r < 3; r++) cr_assert_eq(jobs[r].rc, 0, "%s", jobs[r].err.msg);
  for (size_t r = 1; r < 3; r++) cr_assert(memcmp(jobs[r].in, jobs[0].in, count * 4) == 0);
  for (size_t r = 0; r < 3; r++) free(jobs[r].in);
  world_stop(&w);
}

/* A ring keeps its scratch segment for the next ring (no fresh pages each
 * call), but not a big one: 48 MiB over two members needs 24 MiB of scratch,
 * freed when the call ends, not held outside --memory-bytes for good. */
Test(dataplane, a_big_rings_scratch_is_not_kept, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 10000);
  size_t sizes[] = {(size_t)1 << 20, (size_t)12 << 20}; /* int32 elements: 4 MiB, 48 MiB */
  for (size_t k = 0; k < 2; k++) {
    job_t jobs[2];
    for (size_t r = 0; r < 2; r++) {
      jobs[r] = (job_t){.w = &w, .me = r, .comm = 60 + k, .dtype = DTYPE_INT32, .op = RED_SUM,
                        .count = sizes[k]};
      int32_t *v = malloc(sizes[k] * 4);
      cr_assert_not_null(v);
      for (size_t i = 0; i < sizes[k]; i++) v[i] = (int32_t)(i % 1000) + (int32_t)r;
      jobs[r].in = v;
    }
    run_jobs(jobs, 2);
    for (size_t r = 0; r < 2; r++) {
      cr_assert_eq(jobs[r].rc, 0, "%s", jobs[r].err.msg);
      int32_t *v = jobs[r].in;
      for (size_t i = 0; i < sizes[k]; i += 4099)
        cr_assert_eq(v[i], 2 * (int32_t)(i % 1000) + 1, "element %zu", i);
      free(v);
    }
    for (size_t r = 0; r < 2; r++) {
      size_t kept = dataplane_scratch_bytes(w.dp[r]);
      if (k == 0) /* 2 MiB segments: kept for the next ring */
        cr_assert_geq(kept, sizes[0] * 4 / 2, "member %zu kept %zu bytes of scratch", r, kept);
      else /* 24 MiB segments: freed (the 2 MiB spare was too small: freed too) */
        cr_assert_eq(kept, 0, "member %zu kept %zu bytes of scratch", r, kept);
    }
  }
  world_stop(&w);
}

Test(dataplane, rejects_undefined_reductions) {
  world_t w;
  world_start(&w, 1, 1000);
  dp_group_t g = group(&w, 1, 0);
  float f = 1;
  uint8_t b = 1;
  int32_t i = 3;
  meshd_error_t err = {0};
  /* The catalogue's rules (reduction.h), the same the server checks. */
  cr_assert_eq(dp_allreduce(w.dp[0], &g, &f, 1, DTYPE_FLOAT32, RED_BXOR, &err), -1);
  cr_assert_eq(err.kind, ERR_DTYPE_MISMATCH);
  cr_assert(strstr(err.msg, "bxor") && strstr(err.msg, "float32"), "%s", err.msg);
  cr_assert_eq(dp_allreduce(w.dp[0], &g, &b, 1, DTYPE_BOOL, RED_AVG, &err), -1);
  cr_assert_eq(err.kind, ERR_DTYPE_MISMATCH);
  cr_assert_eq(dp_allreduce(w.dp[0], &g, &i, 1, DTYPE_INT32, RED_AVG, &err), -1);
  cr_assert_eq(err.kind, ERR_DTYPE_MISMATCH);
  cr_assert(strstr(err.msg, "allreduce: 'avg' needs a floating dtype, not int32"), "%s", err.msg);
  cr_assert_eq(i, 3, "a refused reduction leaves the buffer alone");
  cr_assert_eq(dp_reduce_scatter(w.dp[0], &g, &i, &i, 1, DTYPE_INT32, RED_STACK, &err), -1);
  cr_assert_eq(err.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(err.msg, "stack"), "%s", err.msg);
  world_stop(&w);
}

/* ------------------------------------------------------------ other collectives */

static void rs_case(world_t *w, uint64_t comm, dtype_t dt, reduction_t op, size_t count) {
  job_t jobs[MAXN];
  size_t n = w->n, esz = dtype_size(dt);
  for (size_t r = 0; r < n; r++) {
    jobs[r] = (job_t){.w = w, .me = r, .comm = comm, .kind = K_RS, .dtype = dt, .op = op, .count = count};
    jobs[r].in = malloc(n * count * esz + 1);
    jobs[r].out = malloc(count * esz + 1);
    fill(dt, op, r, jobs[r].in, n * count, 0);
  }
  run_jobs(jobs, n);
  char ctx[128];
  for (size_t r = 0; r < n; r++) {
    snprintf(ctx, sizeof ctx, "reduce_scatter n=%zu count=%zu op=%d member %zu", n, count, (int)op, r);
    cr_assert_eq(jobs[r].rc, 0, "%s: %s", ctx, jobs[r].err.msg);
    expect_reduced(dt, op, n, jobs[r].out, count, r * count, ctx);
  }
  for (size_t r = 0; r < n; r++) free(jobs[r].in), free(jobs[r].out);
}

static void gather_case(world_t *w, uint64_t comm, kind_t kind, size_t count) {
  job_t jobs[MAXN];
  size_t n = w->n;
  size_t in_count = kind == K_AG ? count : n * count;
  for (size_t r = 0; r < n; r++) {
    jobs[r] = (job_t){.w = w, .me = r, .comm = comm, .kind = kind, .dtype = DTYPE_INT32, .count = count};
    int32_t *in = malloc(in_count * 4 + 4);
    for (size_t i = 0; i < in_count; i++) in[i] = (int32_t)(r * 1000003 + i);
    jobs[r].in = in;
    jobs[r].out = malloc(n * count * 4 + 4);
  }
  run_jobs(jobs, n);
  for (size_t r = 0; r < n; r++) {
    cr_assert_eq(jobs[r].rc, 0, "kind %d n=%zu count=%zu member %zu: %s", kind, n, count, r,
                 jobs[r].err.msg);
    const int32_t *out = jobs[r].out;
    for (size_t s = 0; s < n; s++)
      for (size_t i = 0; i < count; i++) {
        /* allgather: slice s = member s's in; alltoall: slice s = member s's in slice r */
        int32_t want = (int32_t)(s * 1000003 + (kind == K_AG ? i : r * count + i));
        if (out[s * count + i] != want)
          cr_assert_fail("kind %d n=%zu count=%zu member %zu slice %zu [%zu] = %d, want %d", kind,
                         n, count, r, s, i, out[s * count + i], want);
      }
  }
  for (size_t r = 0; r < n; r++) free(jobs[r].in), free(jobs[r].out);
}

Test(dataplane, reduce_scatter_allgather_alltoall, .timeout = 120) {
  for (size_t n = 2; n <= 4; n++) {
    world_t w;
    world_start(&w, n, 5000);
    if (n > 2) world_pairs(&w); /* per-pair secrets (Group.pair_secrets) */
    const size_t sizes[] = {0, 1, 1009, 70001, BIG_BYTES / 4 / 2 + 3};
    uint64_t comm = 100;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
      rs_case(&w, comm++, DTYPE_FLOAT32, RED_SUM, sizes[s]);
      rs_case(&w, comm++, DTYPE_INT32, RED_MAX, sizes[s]);
      rs_case(&w, comm++, DTYPE_FLOAT32, RED_AVG, sizes[s]);
      rs_case(&w, comm++, DTYPE_BOOL, RED_BXOR, sizes[s]);
      gather_case(&w, comm++, K_AG, sizes[s]);
      gather_case(&w, comm++, K_A2A, sizes[s]);
    }
    world_stop(&w);
  }
}

/* ------------------------------------------------------------ send / recv */

typedef struct p2p_job {
  world_t *w;
  size_t me, peer;
  uint64_t comm, call;
  bool send;
  uint8_t *buf;
  size_t bytes;
  const uint8_t *secret; /* NULL: SECRET */
  int delay_ms;          /* waited before the call */
  int rc;
  meshd_error_t err;
} p2p_job_t;

static void *p2p_main(void *arg) {
  p2p_job_t *j = arg;
  const uint8_t *secret = j->secret ? j->secret : SECRET;
  if (j->delay_ms > 0) usleep((useconds_t)j->delay_ms * 1000);
  j->rc = j->send ? dp_send(j->w->dp[j->me], j->comm, j->call, secret, j->w->ranks[j->peer],
                            j->w->addrs[j->peer], j->buf, j->bytes, &j->err)
                  : dp_recv(j->w->dp[j->me], j->comm, j->call, secret, j->w->ranks[j->peer],
                            j->w->addrs[j->peer], j->buf, j->bytes, &j->err);
  return NULL;
}

Test(dataplane, send_recv_odd_sizes_both_ways, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 5000);
  const size_t sizes[] = {0, 1, 3, 1009, 1000003, BIG_BYTES + 1};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    size_t b = sizes[s];
    p2p_job_t j[4];
    for (int k = 0; k < 4; k++) {
      size_t me = (size_t)k / 2, peer = 1 - me;
      bool send = k % 2 == 0;
      j[k] = (p2p_job_t){.w = &w, .me = me, .peer = peer, .comm = 900, .send = send, .bytes = b};
      j[k].buf = malloc(b + 1);
      for (size_t i = 0; i < b; i++) j[k].buf[i] = send ? (uint8_t)(i * 31 + me * 7) : 0xee;
    }
    pthread_t th[4];
    for (int k = 0; k < 4; k++) pthread_create(&th[k], NULL, p2p_main, &j[k]);
    for (int k = 0; k < 4; k++) pthread_join(th[k], NULL);
    for (int k = 0; k < 4; k++) {
      cr_assert_eq(j[k].rc, 0, "size %zu job %d: %s", b, k, j[k].err.msg);
      if (!j[k].send)
        for (size_t i = 0; i < b; i++)
          if (j[k].buf[i] != (uint8_t)(i * 31 + j[k].peer * 7))
            cr_assert_fail("size %zu: byte %zu wrong", b, i);
    }
    for (int k = 0; k < 4; k++) free(j[k].buf);
  }
  world_stop(&w);
}

/* A ToMesh channel carries both directions between two agents (x from rank 0
 * to 1 and y from 1 to 0 on the same streams), each direction proving its own
 * pair secret. A member's hello that comes while the receiver runs only its
 * own send the other way on the channel is for a call not started there yet:
 * held, as any early hello, and taken when the recv starts; not closed as a
 * stranger's bad proof (counted, logged at warn, and redialed meanwhile). */
Test(dataplane_security, a_channels_other_direction_is_no_bad_proof, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 5000);
  uint8_t s01[DP_SECRET_LEN], s10[DP_SECRET_LEN];
  memset(s01, 0x51, sizeof s01);
  memset(s10, 0x15, sizeof s10);
  uint8_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {9, 10, 11, 12, 13, 14, 15, 16};
  uint8_t got_a[8] = {0}, got_b[8] = {0};
  p2p_job_t j[4] = {
      {.w = &w, .me = 0, .peer = 1, .comm = 905, .call = 1, .send = true, .buf = a, .bytes = 8,
       .secret = s01},
      {.w = &w, .me = 1, .peer = 0, .comm = 905, .call = 2, .send = true, .buf = b, .bytes = 8,
       .secret = s10},
      {.w = &w, .me = 1, .peer = 0, .comm = 905, .call = 1, .buf = got_a, .bytes = 8,
       .secret = s01, .delay_ms = 500},
      {.w = &w, .me = 0, .peer = 1, .comm = 905, .call = 2, .buf = got_b, .bytes = 8,
       .secret = s10, .delay_ms = 500}};
  pthread_t th[4];
  for (int k = 0; k < 4; k++) pthread_create(&th[k], NULL, p2p_main, &j[k]);
  for (int k = 0; k < 4; k++) pthread_join(th[k], NULL);
  for (int k = 0; k < 4; k++) cr_assert_eq(j[k].rc, 0, "job %d: %s", k, j[k].err.msg);
  cr_assert(memcmp(a, got_a, 8) == 0 && memcmp(b, got_b, 8) == 0);
  for (size_t r = 0; r < 2; r++)
    cr_assert_eq(dataplane_rejected(w.dp[r], DP_REJECT_BAD_PROOF), 0,
                 "rank %zu closed %llu of its peer's hellos as bad proofs", r,
                 (unsigned long long)dataplane_rejected(w.dp[r], DP_REJECT_BAD_PROOF));
  world_stop(&w);
}

Test(dataplane, send_recv_size_mismatch_fails_both) {
  world_t w;
  world_start(&w, 2, 1000);
  uint8_t a[100] = {0}, b[50];
  p2p_job_t j[2] = {{.w = &w, .me = 0, .peer = 1, .comm = 3, .send = true, .buf = a, .bytes = 100},
                    {.w = &w, .me = 1, .peer = 0, .comm = 3, .send = false, .buf = b, .bytes = 50}};
  pthread_t th[2];
  for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, p2p_main, &j[k]);
  for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
  cr_assert_eq(j[1].rc, -1);
  cr_assert(strstr(j[1].err.msg, "same arguments"), "%s", j[1].err.msg);
  world_stop(&w);
}

/* ------------------------------------------------------------ concurrency */

Test(dataplane, two_comms_concurrently, .timeout = 60) {
  world_t w;
  world_start(&w, 3, 5000);
  for (int rep = 0; rep < 3; rep++) {
    job_t jobs[6];
    size_t counts[2] = {BIG_BYTES / 4 + 1, 1009};
    for (size_t c = 0; c < 2; c++)
      for (size_t r = 0; r < 3; r++) {
        job_t *j = &jobs[c * 3 + r];
        *j = (job_t){.w = &w, .me = r, .comm = 40 + c, .kind = K_ALLREDUCE, .dtype = DTYPE_INT32,
                     .op = c ? RED_MAX : RED_SUM, .count = counts[c]};
        j->in = malloc(counts[c] * 4);
        fill(DTYPE_INT32, j->op, r, j->in, counts[c], 0);
      }
    run_jobs(jobs, 6);
    for (size_t k = 0; k < 6; k++) {
      cr_assert_eq(jobs[k].rc, 0, "%s", jobs[k].err.msg);
      expect_reduced(DTYPE_INT32, jobs[k].op, 3, jobs[k].in, jobs[k].count, 0, "two comms");
      free(jobs[k].in);
    }
  }
  world_stop(&w);
}

/* ------------------------------------------------------------ failures */

static void expect_names(const job_t *j, const world_t *w, size_t missing, int64_t within_ms) {
  char rank[32];
  snprintf(rank, sizeof rank, "rank %u", w->ranks[missing]);
  cr_assert_eq(j->rc, -1, "member %zu succeeded without its peer", j->me);
  cr_assert(strstr(j->err.msg, rank) && strstr(j->err.msg, w->addrs[missing]),
            "member %zu: message does not name %s at %s: %s", j->me, rank, w->addrs[missing],
            j->err.msg);
  cr_assert(j->took_ms <= within_ms, "member %zu took %lld ms (limit %lld): %s", j->me,
            (long long)j->took_ms, (long long)within_ms, j->err.msg);
}

/* Failed calls counted on data plane dp, by reason (meshd_collective_aborts_total). */
static uint64_t aborts(const world_t *w, size_t r, int reason) {
  uint64_t n = 0;
  for (int k = 0; k < DP_ABORT_COUNT; k++)
    if (reason < 0 || k == reason) n += dataplane_aborts(w->dp[r], (dp_abort_t)k);
  return n;
}

/* jobs[0..n): a float sum allreduce of `count` elements on comm, call `call`;
 * each member's input has room for `cap` elements (at least count), the
 * first count filled from element 1000 * call. */
static void sum_jobs(job_t *jobs, world_t *w, size_t n, uint64_t comm, uint64_t call, size_t count,
                     size_t cap) {
  for (size_t r = 0; r < n; r++) {
    jobs[r] = (job_t){.w = w, .me = r, .comm = comm, .call = call, .kind = K_ALLREDUCE,
                      .dtype = DTYPE_FLOAT32, .op = RED_SUM, .count = count};
    jobs[r].in = calloc(cap, 4);
    fill(DTYPE_FLOAT32, RED_SUM, r, jobs[r].in, count, 1000 * call);
  }
}

/* call: the first call's number, the retry's the next (0: both unnumbered). */
static void missing_member_case(size_t n, size_t count, uint64_t call) {
  world_t w;
  world_start(&w, n, 1000);
  size_t missing = n - 1;
  job_t jobs[MAXN];
  sum_jobs(jobs, &w, n - 1, 77, call, count, count);
  run_jobs(jobs, n - 1);
  for (size_t r = 0; r < n - 1; r++) expect_names(&jobs[r], &w, missing, 2000);
  /* Each member's failed call counts once: a timeout where the absent member
   * was awaited, a peer's abort (or a timeout) elsewhere. */
  uint64_t timeouts = 0, total = 0;
  for (size_t r = 0; r < n - 1; r++) {
    cr_assert_eq(aborts(&w, r, -1), 1, "member %zu counted %llu aborts", r,
                 (unsigned long long)aborts(&w, r, -1));
    cr_assert_eq(aborts(&w, r, DP_ABORT_AGENT_LOST) + aborts(&w, r, DP_ABORT_ERROR), 0,
                 "member %zu: %s", r, jobs[r].err.msg);
    timeouts += aborts(&w, r, DP_ABORT_TIMEOUT);
    total += aborts(&w, r, -1);
  }
  cr_assert_geq(timeouts, 1);

  /* The agents keep serving: the same comm with everyone present works again. */
  for (size_t r = 0; r < n; r++) {
    if (r == n - 1) {
      jobs[r] = jobs[0];
      jobs[r].me = r;
      jobs[r].in = calloc(count, 4);
    }
    jobs[r].rc = -1;
    jobs[r].call = call ? call + 1 : 0;
    fill(DTYPE_FLOAT32, RED_SUM, r, jobs[r].in, count, 0);
  }
  run_jobs(jobs, n);
  for (size_t r = 0; r < n; r++) {
    cr_assert_eq(jobs[r].rc, 0, "after the failure, member %zu: %s", r, jobs[r].err.msg);
    if (r < n - 1) total -= aborts(&w, r, -1);
    expect_reduced(DTYPE_FLOAT32, RED_SUM, n, jobs[r].in, count, 0, "after failure");
    free(jobs[r].in);
  }
  cr_assert_eq(total, 0, "a call that succeeded was counted as aborted");
  world_stop(&w);
}

Test(dataplane, member_never_joins_small, .timeout = 30) {
  for (uint64_t call = 0; call <= 1; call++) {
    missing_member_case(2, 5, call);
    missing_member_case(3, 5, call);
    missing_member_case(4, 1009, call);
  }
}

Test(dataplane, member_never_joins_ring, .timeout = 30) {
  for (uint64_t call = 0; call <= 1; call++) {
    missing_member_case(3, BIG_BYTES / 4, call);
    missing_member_case(4, 100000, call);
  }
}

/* ------------------------------------------------------------ refusals */

#define REFUSAL "Reduce: no memory for the staging copy (a test's refusal)"

/* Member r's job for call `call` of a collective of kind k over w: count
 * float elements per member (a broadcast: count * 4 bytes), inputs filled. */
static void kind_job(job_t *j, world_t *w, size_t r, kind_t k, uint64_t comm, uint64_t call,
                     size_t count) {
  size_t n = w->n;
  *j = (job_t){.w = w, .me = r, .comm = comm, .call = call, .kind = k, .dtype = DTYPE_FLOAT32,
               .op = RED_SUM, .count = k == K_BROADCAST ? count * 4 : count};
  size_t in = k == K_RS || k == K_A2A ? n * count : count;
  size_t out = k == K_AG || k == K_GATHER_ROOT || k == K_A2A ? n * count : count;
  j->in = calloc(in + 1, 4);
  j->out = calloc(out + 1, 4);
  fill(DTYPE_FLOAT32, RED_SUM, r, j->in, in, 0);
}

static void free_jobs(job_t *jobs, size_t n) {
  for (size_t r = 0; r < n; r++) {
    free(jobs[r].in);
    free(jobs[r].out);
  }
}

/* A peer's error after a refusal: the refusal's reason and who refused, or a
 * link closed by a member that failed in the middle of a frame (it could not
 * pass the reason on). */
static bool told(const job_t *j, const char *who) {
  return (strstr(j->err.msg, REFUSAL) && strstr(j->err.msg, who)) ||
         strstr(j->err.msg, "closed the connection");
}

/* Member `refuser` refuses calls 2 and 3 of comm 40 (dp_refuse: a collective
 * of kind k and its failure flag, as an agent's instruction has) while its
 * peers run call 2: 100 ms before they start, or 100 ms after they are
 * waiting for it. With kept_links, call 1 ran first with everyone, so the
 * comm's links are kept ones; else each is dialed for the refused call.
 * Every peer fails at once (not after the 10 s timeout), told why: one that
 * receives at call 2; one that only sends may complete it, and then fails
 * its flag (call 3). Call 4 with everyone succeeds. */
static void refusal_case(size_t n, kind_t k, size_t count, size_t refuser, bool refuse_first,
                         bool kept_links) {
  world_t w;
  world_start(&w, n, 10000);
  if (refuser == 1) world_pairs(&w);
  const uint64_t comm = 40;
  job_t jobs[MAXN];
  char ctx[200], who[32];
  snprintf(ctx, sizeof ctx, "n=%zu kind=%d count=%zu refuser=%zu %s, %s", n, (int)k, count,
           refuser, refuse_first ? "refusing first" : "refusing while the peers wait",
           kept_links ? "kept links" : "fresh links");
  snprintf(who, sizeof who, "rank %u", w.ranks[refuser]);
  if (kept_links) {
    for (size_t r = 0; r < n; r++) kind_job(&jobs[r], &w, r, k, comm, 1, count);
    run_jobs(jobs, n);
    for (size_t r = 0; r < n; r++)
      cr_assert_eq(jobs[r].rc, 0, "%s: call 1, member %zu: %s", ctx, r, jobs[r].err.msg);
    free_jobs(jobs, n);
  }
  for (size_t r = 0; r < n; r++) {
    kind_job(&jobs[r], &w, r, k, comm, 2, count);
    jobs[r].flag = true;
    if (r == refuser) {
      jobs[r].kind = K_REFUSE;
      jobs[r].why = REFUSAL;
      jobs[r].flag = false;
    }
    jobs[r].delay_ms = (r == refuser) == refuse_first ? 0 : 100;
  }
  run_jobs(jobs, n);
  cr_assert_eq(jobs[refuser].rc, 0, "%s: the refusal: %s", ctx, jobs[refuser].err.msg);
  cr_assert_eq(dataplane_aborts(w.dp[refuser], DP_ABORT_REFUSED), 1, "%s", ctx);
  size_t named = 0;
  for (size_t r = 0; r < n; r++) {
    if (r == refuser) continue;
    cr_assert_eq(jobs[r].rc, -1, "%s: member %zu ran its call and flag without the refuser", ctx, r);
    cr_assert(jobs[r].took_ms < 3000, "%s: member %zu failed after %lld ms: %s", ctx, r,
              (long long)jobs[r].took_ms, jobs[r].err.msg);
    cr_assert(told(&jobs[r], who), "%s: member %zu's error does not say who refused and why: %s",
              ctx, r, jobs[r].err.msg);
    cr_assert_eq(aborts(&w, r, DP_ABORT_TIMEOUT), 0, "%s: member %zu timed out", ctx, r);
    named += strstr(jobs[r].err.msg, REFUSAL) != NULL;
  }
  cr_assert_geq(named, 1, "%s: no peer learned the refusal's reason", ctx);
  free_jobs(jobs, n);
  for (size_t r = 0; r < n; r++) kind_job(&jobs[r], &w, r, k, comm, 4, count);
  run_jobs(jobs, n);
  for (size_t r = 0; r < n; r++) {
    cr_assert_eq(jobs[r].rc, 0, "%s: call 4 after the refusal, member %zu: %s", ctx, r,
                 jobs[r].err.msg);
    if (k == K_ALLREDUCE) expect_reduced(DTYPE_FLOAT32, RED_SUM, n, jobs[r].in, count, 0, ctx);
  }
  free_jobs(jobs, n);
  world_stop(&w);
}

Test(dataplane, a_member_that_refuses_a_call_fails_its_peers_at_once, .timeout = 120) {
  const struct {
    kind_t k;
    size_t count;
  } cases[] = {{K_ALLREDUCE, 5},   {K_ALLREDUCE, BIG_BYTES / 4}, {K_REDUCE_ROOT, 5},
               {K_REDUCE_ROOT, BIG_BYTES / 4}, {K_GATHER_ROOT, 1009}, {K_BROADCAST, 1009},
               {K_RS, 1009}, {K_AG, 20000}, {K_A2A, 7}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
    for (size_t refuser = 0; refuser < 3; refuser++)
      refusal_case(3, cases[c].k, cases[c].count, refuser, refuser != 1, (refuser + c) % 2 == 0);
  refusal_case(2, K_ALLREDUCE, 5, 1, true, false);
  refusal_case(2, K_BROADCAST, 5, 1, false, true);
  refusal_case(4, K_ALLREDUCE, 100000, 2, false, false);
  refusal_case(4, K_BROADCAST, 100000, 3, true, true);
}

/* Point to point: member 0 sends to member 1 on a channel; one side refuses
 * its transfer, before the other starts or while it waits. The other fails
 * at once with the reason, and the next transfer on the channel delivers. */
static void refusal_p2p_case(bool sender_refuses, bool refuse_first, bool kept_links) {
  world_t w;
  world_start(&w, 2, 10000);
  const uint64_t comm = 60;
  /* More than the sockets buffer: a send is done only once its receiver took it. */
  const size_t bytes = (size_t)6 << 20;
  char ctx[160], who[32];
  size_t refuser = sender_refuses ? 0 : 1, other = 1 - refuser;
  snprintf(ctx, sizeof ctx, "the %s refuses %s, %s", sender_refuses ? "sender" : "receiver",
           refuse_first ? "first" : "while the other waits", kept_links ? "kept link" : "fresh link");
  snprintf(who, sizeof who, "rank %u", w.ranks[refuser]);
  job_t jobs[2];
  /* Calls 2 and 3 are refused (a header and a body, as an agent's send has). */
  for (uint64_t call = kept_links ? 1 : 2; call <= 4; call += call == 2 ? 2 : 1) {
    jobs[0] = (job_t){.w = &w, .me = 0, .root = 1, .comm = comm, .call = call, .kind = K_SEND,
                      .count = bytes, .in = malloc(bytes)};
    jobs[1] = (job_t){.w = &w, .me = 1, .root = 0, .comm = comm, .call = call, .kind = K_RECV,
                      .count = bytes, .in = calloc(1, bytes)};
    memset(jobs[0].in, (int)call, bytes);
    if (call == 2) {
      jobs[refuser].kind = sender_refuses ? K_REFUSE_SEND : K_REFUSE_RECV;
      jobs[refuser].why = REFUSAL;
      jobs[refuse_first ? other : refuser].delay_ms = 100;
    }
    run_jobs(jobs, 2);
    if (call == 2) {
      cr_assert_eq(jobs[refuser].rc, 0, "%s: the refusal: %s", ctx, jobs[refuser].err.msg);
      cr_assert_eq(jobs[other].rc, -1, "%s: the transfer ran without its peer", ctx);
      cr_assert(strstr(jobs[other].err.msg, REFUSAL) && strstr(jobs[other].err.msg, who),
                "%s: the error does not say who refused and why: %s", ctx, jobs[other].err.msg);
      cr_assert(jobs[other].took_ms < 3000, "%s: failed after %lld ms", ctx,
                (long long)jobs[other].took_ms);
    } else {
      cr_assert_eq(jobs[0].rc, 0, "%s: send %llu: %s", ctx, (unsigned long long)call, jobs[0].err.msg);
      cr_assert_eq(jobs[1].rc, 0, "%s: recv %llu: %s", ctx, (unsigned long long)call, jobs[1].err.msg);
      cr_assert(memcmp(jobs[0].in, jobs[1].in, bytes) == 0, "%s: transfer %llu delivered other bytes",
                ctx, (unsigned long long)call);
    }
    free(jobs[0].in);
    free(jobs[1].in);
  }
  world_stop(&w);
}

Test(dataplane, a_refused_send_or_recv_fails_its_peer_at_once, .timeout = 60) {
  for (int c = 0; c < 8; c++) refusal_p2p_case(c & 1, c & 2, c & 4);
}

/* A member that runs out of memory for a buffer of its own inside a
 * collective (reduce_scatter's working copy, a ring's scratch segment), after
 * the agent joined the call: its peers fail at once with its reason, not
 * after the comm timeout with "did not connect". The allocation is made to
 * fail by that member's count alone (no address space holds it); nothing of
 * its buffers is touched before the allocation. */
#if defined(__SANITIZE_ADDRESS__)
/* oom_case's allocation: NULL from the sanitizer's allocator too, not a
 * report that ends the suite. */
const char *__asan_default_options(void);
__attribute__((visibility("default"))) const char *__asan_default_options(void) {
  return "allocator_may_return_null=1";
}
#endif

static void oom_case(kind_t k, size_t count, size_t oom) {
  world_t w;
  world_start(&w, 3, 10000);
  const uint64_t comm = 41;
  job_t jobs[MAXN];
  char ctx[120], who[32];
  snprintf(ctx, sizeof ctx, "kind=%d count=%zu member %zu out of memory", (int)k, count, oom);
  snprintf(who, sizeof who, "rank %u", w.ranks[oom]);
  for (size_t r = 0; r < w.n; r++) {
    kind_job(&jobs[r], &w, r, k, comm, 2, count);
    jobs[r].flag = true;
    jobs[r].root = 0;
  }
  jobs[oom].count = (size_t)1 << 48; /* 1 PiB of floats: no malloc gets that */
  jobs[oom].delay_ms = 100;          /* its peers are waiting for it */
  run_jobs(jobs, w.n);
  cr_assert_eq(jobs[oom].rc, -1, "%s: the call succeeded", ctx);
  cr_assert(strstr(jobs[oom].err.msg, "out of memory"), "%s: %s", ctx, jobs[oom].err.msg);
  /* As after a refusal (told): a peer may instead see a link closed by
   * another peer that failed mid-frame; one at least names the cause. */
  size_t named = 0;
  for (size_t r = 0; r < w.n; r++) {
    if (r == oom) continue;
    cr_assert_eq(jobs[r].rc, -1, "%s: member %zu succeeded", ctx, r);
    cr_assert(jobs[r].took_ms < 3000, "%s: member %zu failed after %lld ms: %s", ctx, r,
              (long long)jobs[r].took_ms, jobs[r].err.msg);
    bool says = strstr(jobs[r].err.msg, who) && strstr(jobs[r].err.msg, "out of memory");
    cr_assert(says || strstr(jobs[r].err.msg, "closed the connection"),
              "%s: member %zu's error does not say that %s ran out of memory: %s", ctx, r, who,
              jobs[r].err.msg);
    named += says;
  }
  cr_assert_geq(named, 1, "%s: no peer learned that %s ran out of memory", ctx, who);
  free_jobs(jobs, w.n);
  /* The next call with everyone delivers. */
  for (size_t r = 0; r < w.n; r++) kind_job(&jobs[r], &w, r, k, comm, 4, count);
  run_jobs(jobs, w.n);
  for (size_t r = 0; r < w.n; r++)
    cr_assert_eq(jobs[r].rc, 0, "%s: call 4, member %zu: %s", ctx, r, jobs[r].err.msg);
  free_jobs(jobs, w.n);
  world_stop(&w);
}

Test(dataplane, a_member_out_of_memory_inside_a_collective_fails_its_peers_at_once,
     .timeout = 120) {
  oom_case(K_RS, 20000, 1);                      /* the ring's working copy */
  oom_case(K_ALLREDUCE, BIG_BYTES / 4, 2);       /* the ring's scratch */
  oom_case(K_REDUCE_ROOT, BIG_BYTES / 4, 1);     /* the same, rooted */
}

/* A member waiting in NCCL (cuda:N) watches the data plane for a refusal of
 * its call (dp_watch): member 2 refuses calls 8..11 while members 0 and 1
 * watch call 8 (with pair secrets); both watches fire within a second with
 * the reason, the refusal tells both, and a watch of call 12 does not fire. */
static void *refuse_later(void *arg) {
  job_t *j = arg;
  usleep(100 * 1000);
  dp_group_t g = group(j->w, j->comm, j->me);
  g.call = j->call;
  j->rc = dp_refuse(j->w->dp[j->me], &g, DP_REFUSE_GROUP, 4, REFUSAL, &j->err);
  return NULL;
}

Test(dataplane, a_refusal_fires_the_watches_of_members_waiting_outside_the_data_plane,
     .timeout = 30) {
  world_t w;
  world_start(&w, 3, 5000);
  world_pairs(&w);
  dp_group_t g0 = group(&w, 80, 0), g1 = group(&w, 80, 1);
  g0.call = g1.call = 8;
  dp_watch_t *w0 = dp_watch_begin(w.dp[0], &g0), *w1 = dp_watch_begin(w.dp[1], &g1);
  cr_assert(w0 && w1);
  char why[600] = "";
  cr_assert(!dp_watch_fired(w.dp[0], w0, why, sizeof why), "fired before any refusal: %s", why);
  job_t r = {.w = &w, .me = 2, .comm = 80, .call = 8};
  pthread_t th;
  pthread_create(&th, NULL, refuse_later, &r);
  int64_t t0 = now_ms();
  bool f0 = false, f1 = false;
  char why1[600] = "";
  while ((!f0 || !f1) && now_ms() - t0 < 3000) {
    f0 = f0 || dp_watch_fired(w.dp[0], w0, why, sizeof why);
    f1 = f1 || dp_watch_fired(w.dp[1], w1, why1, sizeof why1);
    usleep(2000);
  }
  pthread_join(th, NULL);
  cr_assert(f0 && f1, "watches fired: %d %d", f0, f1);
  cr_assert(now_ms() - t0 < 1000, "took %lld ms", (long long)(now_ms() - t0));
  cr_assert(strstr(why, REFUSAL) && strstr(why, "rank 12"), "%s", why);
  cr_assert(strstr(why1, REFUSAL), "%s", why1);
  cr_assert_eq(r.rc, 0, "the refusal: %s", r.err.msg);
  dp_watch_end(w.dp[0], w0);
  dp_watch_end(w.dp[1], w1);
  dp_group_t later = group(&w, 80, 0);
  later.call = 12;
  dp_watch_t *w2 = dp_watch_begin(w.dp[0], &later);
  cr_assert(!dp_watch_fired(w.dp[0], w2, why, sizeof why), "a later call's watch fired: %s", why);
  dp_watch_end(w.dp[0], w2);
  world_stop(&w);
}

/* A p2p job: member `me` sends `bytes` to (or receives them from) member
 * `peer` on comm, call `call`, after delay_ms. */
static job_t p2p_job(world_t *w, kind_t k, size_t me, size_t peer, uint64_t comm, uint64_t call,
                     size_t bytes, int delay_ms) {
  return (job_t){.w = w, .me = me, .root = peer, .comm = comm, .call = call, .kind = k,
                 .count = bytes, .in = calloc(1, bytes ? bytes : 1), .delay_ms = delay_ms};
}

/* A refused send names one direction of a channel: member 1's own send to
 * member 0 on the same channel, waiting on a kept link for member 0's recv,
 * is not aborted by member 0's refusal of its send to member 1 (the abort
 * once went on every link from member 1). */
Test(dataplane, a_refused_send_spares_the_peers_send_the_other_way, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 3000);
  const size_t big = (size_t)24 << 20; /* more than the sockets hold */
  job_t j[3] = {p2p_job(&w, K_SEND, 1, 0, 70, 4, 1000, 0), p2p_job(&w, K_RECV, 0, 1, 70, 4, 1000, 0)};
  run_jobs(j, 2); /* a kept link 1 -> 0 */
  cr_assert_eq(j[0].rc + j[1].rc, 0, "%s %s", j[0].err.msg, j[1].err.msg);
  free(j[0].in);
  free(j[1].in);
  j[0] = p2p_job(&w, K_SEND, 1, 0, 70, 8, big, 0);
  j[1] = p2p_job(&w, K_RECV, 0, 1, 70, 8, big, 800);
  j[2] = p2p_job(&w, K_REFUSE_SEND, 0, 1, 70, 12, 0, 200);
  j[2].why = REFUSAL;
  run_jobs(j, 3);
  cr_assert_eq(j[2].rc, 0, "the refusal: %s", j[2].err.msg);
  cr_assert_eq(j[0].rc, 0, "the other direction's send failed: %s", j[0].err.msg);
  cr_assert_eq(j[1].rc, 0, "the other direction's recv failed: %s", j[1].err.msg);
  for (size_t i = 0; i < 3; i++) free(j[i].in);
  world_stop(&w);
}

/* Member 0 refuses its recv from member 1 while it sends to member 2 on the
 * same channel: member 1's send is told at once (a call of the channel
 * running here once kept the refusal's answer from every hello of it). */
Test(dataplane, a_refused_recv_is_told_while_another_call_of_the_channel_runs, .timeout = 60) {
  world_t w;
  world_start(&w, 3, 2000);
  const size_t big = (size_t)24 << 20;
  job_t j[4] = {p2p_job(&w, K_SEND, 0, 2, 71, 40, big, 0), p2p_job(&w, K_RECV, 2, 0, 71, 40, big, 1500),
                p2p_job(&w, K_REFUSE_RECV, 0, 1, 71, 44, 0, 100),
                p2p_job(&w, K_SEND, 1, 0, 71, 44, big, 300)};
  j[2].why = REFUSAL;
  run_jobs(j, 4);
  cr_assert_eq(j[0].rc + j[1].rc, 0, "the other pair: %s %s", j[0].err.msg, j[1].err.msg);
  cr_assert_eq(j[3].rc, -1, "the refused transfer was sent");
  cr_assert(j[3].took_ms < 1000 && strstr(j[3].err.msg, REFUSAL),
            "the refused sender failed after %lld ms: %s", (long long)j[3].took_ms, j[3].err.msg);
  for (size_t i = 0; i < 4; i++) free(j[i].in);
  world_stop(&w);
}

/* A member already declared lost is not dialed: the refusal does not wait
 * out the timeout on it, and the member still waiting is told at once. */
Test(dataplane, a_refusal_skips_a_peer_declared_lost, .timeout = 60) {
  world_t w;
  world_start(&w, 3, 2000);
  dataplane_stop(w.dp[1]);
  w.dp[1] = NULL;
  dataplane_peer_lost(w.dp[0], w.addrs[1], w.ranks[1], "test: lost");
  job_t j[2] = {{.w = &w, .me = 0, .comm = 72, .call = 2, .kind = K_REFUSE, .why = REFUSAL},
                p2p_job(&w, K_RECV, 2, 0, 72, 2, 100, 0)};
  run_jobs(j, 2);
  cr_assert(j[0].took_ms < 1000, "the refusal took %lld ms: %s", (long long)j[0].took_ms,
            j[0].err.msg);
  cr_assert(j[1].rc == -1 && j[1].took_ms < 1000 && strstr(j[1].err.msg, REFUSAL),
            "member 2 (%lld ms): %s", (long long)j[1].took_ms, j[1].err.msg);
  free(j[1].in);
  world_stop(&w);
}

/* A refusal on a kept link leaves what an earlier send queued on it (it once
 * closed the link, resetting it): the receiver, busy until after the
 * refusal, still gets the earlier send whole. Over TCP. */
static void *send_then_refuse(void *arg) {
  job_t *j = arg;
  job_main(&j[0]);
  job_main(&j[1]);
  return NULL;
}

Test(dataplane, a_refusal_after_a_queued_send_keeps_its_bytes, .timeout = 60) {
  const size_t sizes[] = {(size_t)1 << 20, (size_t)8 << 20};
  for (size_t k = 0; k < 2; k++) {
    world_t w;
    world_start(&w, 2, 3000);
    for (size_t i = 0; i < 2; i++) dataplane_same_host(w.dp[i], false);
    job_t j[2] = {p2p_job(&w, K_SEND, 0, 1, 73, 4, 10, 0), p2p_job(&w, K_RECV, 1, 0, 73, 4, 10, 0)};
    run_jobs(j, 2); /* a kept link 0 -> 1 */
    cr_assert_eq(j[0].rc + j[1].rc, 0, "%s %s", j[0].err.msg, j[1].err.msg);
    free(j[0].in);
    free(j[1].in);
    j[0] = p2p_job(&w, K_SEND, 0, 1, 73, 40, sizes[k], 0);
    memset(j[0].in, 7, sizes[k]);
    j[1] = p2p_job(&w, K_REFUSE_SEND, 0, 1, 73, 44, 0, 0);
    j[1].why = REFUSAL;
    job_t r = p2p_job(&w, K_RECV, 1, 0, 73, 40, sizes[k], 1500);
    pthread_t a, b;
    pthread_create(&a, NULL, send_then_refuse, j);
    pthread_create(&b, NULL, job_main, &r);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    cr_assert(j[0].rc != 0 || (r.rc == 0 && memcmp(r.in, j[0].in, sizes[k]) == 0),
              "%zu bytes: the send succeeded but its receiver did not get it: %s", sizes[k],
              r.err.msg);
    free(j[0].in);
    free(j[1].in);
    free(r.in);
    world_stop(&w);
  }
}

/* ------------------------------------------------------------ pair secrets */

/* Member 2 of {10, 11, 12} knows its own pair secrets, {2, 0} and {2, 1}, and
 * the group's. Here it claims to be member 1 (a data plane of rank 11) and
 * dials member 0, which waits for member 1 in an allreduce. With per-pair
 * secrets member 0 refuses it (bad_proof: the hello would need {0, 1}'s);
 * with the group's secret alone (an older server) it is let in, which is what
 * the pairs are for. */
static uint64_t impostor_admitted(bool pairs) {
  world_t w;
  world_start(&w, 3, 1000);
  if (pairs) world_pairs(&w);
  meshd_error_t err = {0};
  dataplane_t *impostor = dataplane_start("127.0.0.1", w.ranks[1], 1000, &err);
  cr_assert(impostor, "%s", err.msg);
  job_t victim;
  kind_job(&victim, &w, 0, K_ALLREDUCE, 50, 1, 5);
  pthread_t th;
  pthread_create(&th, NULL, job_main, &victim);
  /* What member 2 knows, put where member 1's would be: entry 0 is {2, 0}'s. */
  uint8_t knows[MAXN * DP_SECRET_LEN];
  memcpy(knows, w.pair[2], sizeof knows);
  dp_group_t g = group(&w, 50, 1);
  g.call = 1;
  g.pair_secrets = pairs ? knows : NULL;
  float buf[5] = {0};
  dp_allreduce(impostor, &g, buf, 5, DTYPE_FLOAT32, RED_SUM, &err);
  pthread_join(th, NULL);
  cr_assert_eq(victim.rc, -1, "the allreduce ran without member 2");
  uint64_t bad = dataplane_rejected(w.dp[0], DP_REJECT_BAD_PROOF);
  free_jobs(&victim, 1);
  dataplane_stop(impostor);
  world_stop(&w);
  return bad;
}

Test(dataplane_security, a_member_cannot_pass_for_another_with_pair_secrets, .timeout = 30) {
  cr_assert_geq(impostor_admitted(true), 1, "member 0 took the impostor's hello");
  cr_assert_eq(impostor_admitted(false), 0,
               "with the group's secret alone the impostor was refused: the test shows nothing");
}

/* A member that starts a call more than the timeout late, after its peers
 * gave up on it and began their next call on the comm: it must not pair with
 * that next call (before frames carried the call, it did, and both reported
 * success with a mix of two calls' data). It fails at once, then catches up:
 * the peers' next call, and the one after, succeed with the right values. */
static void late_member_case(size_t n, size_t count) {
  world_t w;
  world_start(&w, n, 400);
  const uint64_t comm = 77;
  job_t jobs[MAXN];
  sum_jobs(jobs, &w, n, comm, 1, count, count);
  /* Call 1 without the last member: the others give up on it. */
  for (size_t r = 0; r + 1 < n; r++) fill(DTYPE_FLOAT32, RED_SUM, r, jobs[r].in, count, 1000);
  run_jobs(jobs, n - 1);
  for (size_t r = 0; r + 1 < n; r++) cr_assert_eq(jobs[r].rc, -1, "call 1 ran without a member");
  /* The others start call 2; the last member now starts call 1, then call 2. */
  pthread_t th[MAXN];
  for (size_t r = 0; r < n; r++) {
    jobs[r].call = 2;
    fill(DTYPE_FLOAT32, RED_SUM, r, jobs[r].in, count, 2000);
  }
  for (size_t r = 0; r + 1 < n; r++) pthread_create(&th[r], NULL, job_main, &jobs[r]);
  usleep(100 * 1000);
  job_t late = jobs[n - 1];
  late.call = 1;
  late.in = calloc(count, 4);
  fill(DTYPE_FLOAT32, RED_SUM, n - 1, late.in, count, 1000);
  job_main(&late);
  cr_assert_eq(late.rc, -1, "n=%zu count=%zu: the late member's call 1 paired with call 2", n,
               count);
  cr_assert(strstr(late.err.msg, "later call") && strstr(late.err.msg, "call 2; this is call 1"),
            "%s", late.err.msg);
  cr_assert(late.took_ms < 300, "the late call took %lld ms to fail", (long long)late.took_ms);
  cr_assert_eq(dataplane_aborts(w.dp[n - 1], DP_ABORT_BEHIND), 1);
  job_main(&jobs[n - 1]);
  for (size_t r = 0; r + 1 < n; r++) pthread_join(th[r], NULL);
  for (size_t r = 0; r < n; r++) {
    cr_assert_eq(jobs[r].rc, 0, "n=%zu count=%zu: call 2 on member %zu: %s", n, count, r,
                 jobs[r].err.msg);
    expect_reduced(DTYPE_FLOAT32, RED_SUM, n, jobs[r].in, count, 2000, "call 2");
  }
  /* The group is in step again. */
  for (size_t r = 0; r < n; r++) {
    jobs[r].call = 3;
    fill(DTYPE_FLOAT32, RED_SUM, r, jobs[r].in, count, 3000);
  }
  run_jobs(jobs, n);
  for (size_t r = 0; r < n; r++) {
    cr_assert_eq(jobs[r].rc, 0, "call 3 on member %zu: %s", r, jobs[r].err.msg);
    expect_reduced(DTYPE_FLOAT32, RED_SUM, n, jobs[r].in, count, 3000, "call 3");
    free(jobs[r].in);
  }
  free(late.in);
  world_stop(&w);
}

Test(dataplane, a_member_late_past_the_timeout_fails_its_call_and_catches_up, .timeout = 60) {
  late_member_case(2, 5);
  late_member_case(3, 1009);
  late_member_case(3, BIG_BYTES / 4); /* the ring: frames of 1 MiB, some left mid-way */
}

/* Point to point: a receiver that gave up on send 1 (the sender was late)
 * skips it and gets send 2; a receiver that is late fails its recv 3 (the
 * sender gave up on it), then receives send 4 whole. */
Test(dataplane, a_late_send_or_recv_never_delivers_the_wrong_message, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 400);
  const size_t big = (size_t)6 << 20; /* more than the sockets buffer: a send waits for its receiver */
  uint8_t *one = malloc(big), *two = malloc(big), *got = malloc(big);
  memset(one, 1, big);
  memset(two, 2, big);
  /* The sender late: recv 1 times out, recv 2 waits; send 1, then send 2. */
  p2p_job_t rx = {.w = &w, .me = 0, .peer = 1, .comm = 5, .call = 1, .buf = got, .bytes = big};
  p2p_main(&rx);
  cr_assert_eq(rx.rc, -1);
  rx.call = 2;
  memset(got, 0, big);
  pthread_t th;
  pthread_create(&th, NULL, p2p_main, &rx);
  usleep(100 * 1000);
  p2p_job_t tx = {.w = &w, .me = 1, .peer = 0, .comm = 5, .call = 1, .send = true, .buf = one,
                  .bytes = big};
  p2p_main(&tx); /* the receiver drains it, or it fails: either way nobody gets it */
  tx.call = 2;
  tx.buf = two;
  p2p_main(&tx);
  pthread_join(th, NULL);
  cr_assert_eq(tx.rc, 0, "%s", tx.err.msg);
  cr_assert_eq(rx.rc, 0, "%s", rx.err.msg);
  cr_assert(memcmp(got, two, big) == 0, "recv 2 got send 1's bytes");
  /* The receiver late: send 3 times out (nobody reads), send 4 goes ahead;
   * then recv 3, and recv 4. */
  tx.call = 3;
  tx.buf = one;
  p2p_main(&tx);
  cr_assert_eq(tx.rc, -1);
  tx.call = 4;
  tx.buf = two;
  pthread_create(&th, NULL, p2p_main, &tx);
  usleep(100 * 1000);
  rx.call = 3;
  memset(got, 0, big);
  p2p_main(&rx);
  /* It reads what send 3 left on the link it gave up (and fails there), or
   * finds send 4's first frame (and fails as behind). */
  cr_assert_eq(rx.rc, -1, "recv 3 got send 4");
  cr_assert(strstr(rx.err.msg, "later call") || strstr(rx.err.msg, "closed the connection"), "%s",
            rx.err.msg);
  rx.call = 4;
  p2p_main(&rx);
  pthread_join(th, NULL);
  cr_assert_eq(rx.rc, 0, "%s", rx.err.msg);
  cr_assert_eq(tx.rc, 0, "%s", tx.err.msg);
  cr_assert(memcmp(got, two, big) == 0, "recv 4 got the wrong bytes");
  free(one);
  free(two);
  free(got);
  world_stop(&w);
}

/* The session ended here (dataplane_drop_comm) while a call of it waited for
 * a peer that never came: the call fails at once, not at the comm timeout,
 * whether it waits for a connection in (a receive) or for the peer's ack
 * (a send to a listener that holds its hello); a call on another comm runs on. */
static void *drop_later(void *arg) {
  world_t *w = arg;
  usleep(300 * 1000);
  dataplane_drop_comm(w->dp[0], 61);
  return NULL;
}

Test(dataplane, dropping_a_comm_fails_its_calls_that_wait_to_connect, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 20000);
  uint8_t buf[8] = {0};
  p2p_job_t waits[2] = {
      {.w = &w, .me = 0, .peer = 1, .comm = 61, .call = 1, .buf = buf, .bytes = 8},
      {.w = &w, .me = 0, .peer = 1, .comm = 61, .call = 1, .send = true, .buf = buf, .bytes = 8}};
  for (int k = 0; k < 2; k++) {
    pthread_t th;
    pthread_create(&th, NULL, drop_later, &w);
    int64_t t0 = now_ms();
    p2p_main(&waits[k]);
    int64_t took = now_ms() - t0;
    pthread_join(th, NULL);
    cr_assert_eq(waits[k].rc, -1, "%s", k ? "send" : "recv");
    cr_assert(strstr(waits[k].err.msg, "channel was closed on this agent"), "%s", waits[k].err.msg);
    cr_assert(took < 2000, "%s took %lld ms after its comm was dropped", k ? "send" : "recv",
              (long long)took);
  }
  /* Another comm, and the dropped one's next call, are unharmed. */
  uint8_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {0};
  for (uint64_t comm = 60; comm <= 61; comm++) {
    p2p_job_t pair[2] = {
        {.w = &w, .me = 0, .peer = 1, .comm = comm, .call = 2, .send = true, .buf = a, .bytes = 8},
        {.w = &w, .me = 1, .peer = 0, .comm = comm, .call = 2, .buf = b, .bytes = 8}};
    pthread_t th[2];
    for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, p2p_main, &pair[k]);
    for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
    cr_assert_eq(pair[0].rc, 0, "%s", pair[0].err.msg);
    cr_assert_eq(pair[1].rc, 0, "%s", pair[1].err.msg);
    cr_assert(memcmp(a, b, 8) == 0);
  }
  world_stop(&w);
}

/* A member waiting in NCCL (cuda:N: a communicator's setup or its op) when
 * its session ends here (dataplane_end_comm, at EndSession): its watch fires
 * at once, so that the wait ends and the session's state is freed, instead of
 * the EndSession waiting out the comm timeout for a peer that never comes. A
 * watch begun after the end fires too. */
Test(dataplane, a_session_end_fires_the_watch_of_a_member_waiting_outside_the_data_plane,
     .timeout = 30) {
  world_t w;
  world_start(&w, 2, 20000);
  dp_group_t g0 = group(&w, 83, 0);
  g0.call = 5;
  dp_watch_t *w0 = dp_watch_begin(w.dp[0], &g0);
  cr_assert(w0);
  char why[600] = "";
  cr_assert(!dp_watch_fired(w.dp[0], w0, why, sizeof why), "fired before the end: %s", why);
  int64_t t0 = now_ms();
  dataplane_end_comm(w.dp[0], 83);
  bool fired = false;
  while (!fired && now_ms() - t0 < 3000) {
    fired = dp_watch_fired(w.dp[0], w0, why, sizeof why);
    usleep(2000);
  }
  cr_assert(fired, "the session's end did not fire the watch in 3 s");
  cr_expect(now_ms() - t0 < 1000, "took %lld ms", (long long)(now_ms() - t0));
  cr_expect(strstr(why, "session ended"), "%s", why);
  dp_watch_end(w.dp[0], w0);
  dp_watch_t *late = dp_watch_begin(w.dp[0], &g0);
  cr_assert(late);
  usleep(2000);
  cr_expect(dp_watch_fired(w.dp[0], late, why, sizeof why), "a watch begun after the end");
  dp_watch_end(w.dp[0], late);
  dataplane_forget_comm(w.dp[0], 83);
  world_stop(&w);
}

/* The session ended here (dataplane_end_comm) before a worker of it joined
 * its call: that call fails at once (its peers have left), a send and a
 * receive alike, instead of waiting out the comm timeout; once the session is
 * gone (dataplane_forget_comm) the comm serves calls again. */
Test(dataplane, a_call_that_starts_after_its_session_ended_fails_at_once, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 20000);
  dataplane_end_comm(w.dp[0], 62);
  uint8_t buf[8] = {0};
  for (int k = 0; k < 2; k++) {
    p2p_job_t late = {.w = &w, .me = 0, .peer = 1, .comm = 62, .call = 3, .send = k == 1,
                      .buf = buf, .bytes = 8};
    int64_t t0 = now_ms();
    p2p_main(&late);
    int64_t took = now_ms() - t0;
    cr_assert_eq(late.rc, -1, "%s", k ? "send" : "recv");
    cr_assert(strstr(late.err.msg, "channel was closed on this agent"), "%s", late.err.msg);
    cr_assert(took < 2000, "%s took %lld ms on an ended comm", k ? "send" : "recv",
              (long long)took);
  }
  dataplane_forget_comm(w.dp[0], 62);
  uint8_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {0};
  p2p_job_t pair[2] = {
      {.w = &w, .me = 0, .peer = 1, .comm = 62, .call = 4, .send = true, .buf = a, .bytes = 8},
      {.w = &w, .me = 1, .peer = 0, .comm = 62, .call = 4, .buf = b, .bytes = 8}};
  pthread_t th[2];
  for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, p2p_main, &pair[k]);
  for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
  cr_assert_eq(pair[0].rc, 0, "%s", pair[0].err.msg);
  cr_assert_eq(pair[1].rc, 0, "%s", pair[1].err.msg);
  cr_assert(memcmp(a, b, 8) == 0);
  world_stop(&w);
}

Test(dataplane, member_stopped_mid_call, .timeout = 30) {
  /* Member 2 is stuck in a collective with an absent member 3 when its data
   * plane stops; members 0 and 1, in a collective with 0..2, fail promptly. */
  world_t w;
  world_start(&w, 4, 10000);
  world_t w3 = w; /* the view of members 0..2 */
  w3.n = 3;
  size_t count = BIG_BYTES / 4;
  job_t jobs[3];
  for (size_t r = 0; r < 3; r++) {
    jobs[r] = (job_t){.w = r == 2 ? &w : &w3, .me = r, .comm = r == 2 ? 91 : 90,
                      .kind = K_ALLREDUCE, .dtype = DTYPE_FLOAT32, .op = RED_SUM, .count = count};
    jobs[r].in = calloc(count, 4);
  }
  pthread_t th[3];
  for (size_t r = 0; r < 3; r++) pthread_create(&th[r], NULL, job_main, &jobs[r]);
  usleep(300 * 1000);
  int64_t t0 = now_ms();
  dataplane_stop(w.dp[2]);
  w.dp[2] = NULL;
  for (size_t r = 0; r < 3; r++) pthread_join(th[r], NULL);
  int64_t took = now_ms() - t0;
  cr_assert(took < 2000, "stop took %lld ms", (long long)took);
  cr_assert_eq(jobs[2].rc, -1);
  for (size_t r = 0; r < 2; r++) expect_names(&jobs[r], &w, 2, 300 + 2000);
  for (size_t r = 0; r < 3; r++) free(jobs[r].in);
  world_stop(&w);
}

/* The agent's exit: shutdown fails a call that waits on a peer at once, and
 * every later call too, while the data plane stays allocated for the workers
 * that still hold it; only then is it freed (issue 12: exit without races). */
Test(dataplane, shutdown_fails_waiting_and_later_calls_before_it_is_freed) {
  world_t w;
  world_start(&w, 2, 20000);
  size_t count = 16;
  job_t j = {.w = &w, .me = 0, .comm = 77, .kind = K_ALLREDUCE, .dtype = DTYPE_FLOAT32,
             .op = RED_SUM, .count = count};
  j.in = calloc(count, 4);
  pthread_t th;
  pthread_create(&th, NULL, job_main, &j); /* member 1 never joins: it waits */
  usleep(300 * 1000);
  int64_t t0 = now_ms();
  dataplane_shutdown(w.dp[0]);
  int64_t took = now_ms() - t0;
  pthread_join(th, NULL);
  cr_assert(took < 1500, "shutdown took %lld ms with a call waiting", (long long)took);
  cr_assert_eq(j.rc, -1);
  cr_assert_eq(j.err.kind, ERR_UNAVAILABLE, "%s", j.err.msg);
  cr_assert(strstr(j.err.msg, "stopping"), "%s", j.err.msg);
  cr_assert(j.took_ms < 300 + 1500, "the waiting call took %lld ms", (long long)j.took_ms);
  cr_assert_eq(aborts(&w, 0, DP_ABORT_ERROR), 1);
  /* A worker that still holds the data plane calls in: refused at once. */
  float f[16] = {0};
  meshd_error_t err = {0};
  dp_group_t g = group(&w, 78, 0);
  t0 = now_ms();
  cr_assert_eq(dp_allreduce(w.dp[0], &g, f, 16, DTYPE_FLOAT32, RED_SUM, &err), -1);
  cr_assert_eq(err.kind, ERR_UNAVAILABLE, "%s", err.msg);
  cr_assert_eq(dp_send(w.dp[0], 79, 0, SECRET, w.ranks[1], w.addrs[1], f, sizeof f, &err), -1);
  cr_assert_eq(err.kind, ERR_UNAVAILABLE, "%s", err.msg);
  cr_assert_eq(aborts(&w, 0, -1), 1, "calls refused before they began are not aborts");
  cr_assert(now_ms() - t0 < 200, "refusals took %lld ms", (long long)(now_ms() - t0));
  dataplane_shutdown(w.dp[0]); /* a second shutdown is a no-op */
  dataplane_stop(w.dp[0]);
  w.dp[0] = NULL;
  free(j.in);
  world_stop(&w);
}

Test(dataplane, unreachable_peer_fails_within_timeout) {
  world_t w;
  world_start(&w, 2, 1000);
  dataplane_stop(w.dp[1]); /* its port is closed now */
  w.dp[1] = NULL;
  job_t j = {.w = &w, .me = 0, .comm = 5, .kind = K_ALLREDUCE, .dtype = DTYPE_INT32, .op = RED_SUM,
             .count = 4};
  int32_t buf[4] = {0};
  j.in = buf;
  job_main(&j);
  expect_names(&j, &w, 1, 2000);
  world_stop(&w);
}

/* PeerLost (issue 12): a member declared lost ends, at once, every call in
 * progress whose group has its address -- a wait for its connection and a
 * ring whose bytes stopped moving -- with AGENT_LOST naming it; calls that
 * start afterwards (a replacement at the same rank) are not affected. */
Test(dataplane, a_peer_declared_lost_fails_the_calls_waiting_on_it_at_once) {
  world_t w;
  world_start(&w, 3, 20000);
  world_t w2 = w; /* members 0 and 1 only */
  w2.n = 2;
  size_t count = 16;
  /* Member 0 waits for member 2 (which never joins) in a 3-member allreduce,
   * and, meanwhile, runs nothing else. */
  job_t j = {.w = &w, .me = 0, .comm = 81, .kind = K_ALLREDUCE, .dtype = DTYPE_FLOAT32,
             .op = RED_SUM, .count = count};
  j.in = calloc(count, 4);
  pthread_t th;
  pthread_create(&th, NULL, job_main, &j);
  usleep(300 * 1000);
  int64_t t0 = now_ms();
  dataplane_peer_lost(w.dp[0], w.addrs[2], w.ranks[2], "was lost at 12:00:00.000 UTC");
  pthread_join(th, NULL);
  int64_t took = now_ms() - t0;
  cr_assert_eq(j.rc, -1);
  cr_assert_eq(j.err.kind, ERR_AGENT_LOST, "%s", j.err.msg);
  cr_assert(strstr(j.err.msg, "was lost at 12:00:00.000 UTC"), "%s", j.err.msg);
  cr_assert(took < 1000, "the loss ended the wait after %lld ms", (long long)took);
  cr_assert_eq(aborts(&w, 0, DP_ABORT_AGENT_LOST), 1);
  cr_assert_eq(aborts(&w, 0, -1), 1);
  /* A call between 0 and 1 that starts now does not care about member 2. */
  job_t a = {.w = &w2, .me = 0, .comm = 82, .kind = K_ALLREDUCE, .dtype = DTYPE_FLOAT32,
             .op = RED_SUM, .count = count};
  job_t b = a;
  b.me = 1;
  a.in = calloc(count, 4);
  b.in = calloc(count, 4);
  pthread_t ta, tb;
  pthread_create(&ta, NULL, job_main, &a);
  pthread_create(&tb, NULL, job_main, &b);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  cr_assert_eq(a.rc, 0, "%s", a.err.msg);
  cr_assert_eq(b.rc, 0, "%s", b.err.msg);
  cr_assert_eq(aborts(&w, 0, -1) + aborts(&w, 1, -1), 1);
  /* A group with the lost address that starts afterwards is not refused by the
   * data plane (the agent checks the session's PeerLost first): it waits as usual. */
  cr_assert_eq(dataplane_generation(w.dp[0]), 1);
  free(j.in);
  free(a.in);
  free(b.in);
  world_stop(&w);
}

/* ------------------------------------------------------------ strangers
 * Only members get in (issue 13): a connection to a data port must prove the
 * group's secret over the acceptor's fresh nonce before a byte of payload is
 * read, and sockets that never prove anything cannot starve members. */

static const uint8_t WRONG[DP_SECRET_LEN] = "not the secret of any group....";

/* A TCP connection to w's member `to`, from this test (a stranger). */
static int stranger_connect(const world_t *w, size_t to) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  cr_assert(fd >= 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)dataplane_port(w->dp[to]))};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0, "connect: %s", strerror(errno));
  struct timeval tv = {.tv_sec = 3};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/* Reads the acceptor's challenge: its nonce. */
static void stranger_challenge(int fd, uint8_t nonce[DP_NONCE_LEN]) {
  uint8_t ch[DP_CHALLENGE_LEN];
  cr_assert_eq(recv(fd, ch, sizeof ch, MSG_WAITALL), (ssize_t)sizeof ch, "no challenge: %s",
               strerror(errno));
  cr_assert_eq(dp_wire_parse_challenge(ch, sizeof ch, nonce, NULL, 0), DP_PARSE_OK);
}

/* A data frame of `count` int32 values v (what the finding injected). */
static void stranger_frame(int fd, uint64_t comm, int32_t v, size_t count) {
  uint8_t buf[DP_HDR_LEN + 64 * 4];
  dp_wire_frame(buf, DP_MAGIC_DATA, (uint32_t)(count * 4), comm, 0, 0);
  for (size_t i = 0; i < count; i++) memcpy(buf + DP_HDR_LEN + 4 * i, &v, 4);
  ssize_t wr = send(fd, buf, DP_HDR_LEN + count * 4, MSG_NOSIGNAL);
  (void)wr; /* it may already be closed */
}

/* True when the acceptor closed fd within ms without sending a byte (no ack). */
static bool closed_without_ack(int fd, int ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  if (poll(&p, 1, ms) <= 0) return false;
  uint8_t b[DP_ACK_LEN];
  ssize_t r = recv(fd, b, sizeof b, MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno == ECONNRESET);
}

static uint64_t wait_rejected(dataplane_t *dp, dp_reject_t reason, uint64_t at_least, int ms) {
  int64_t until = now_ms() + ms;
  uint64_t n;
  while ((n = dataplane_rejected(dp, reason)) < at_least && now_ms() < until) usleep(10 * 1000);
  return n;
}

/* Member jobs of a 2-member int32 allreduce of `count` ones; each member's
 * buffer must become 2 everywhere. */
static void ones_jobs(job_t *jobs, world_t *w, uint64_t comm, size_t count) {
  for (size_t r = 0; r < 2; r++) {
    jobs[r] = (job_t){.w = w, .me = r, .comm = comm, .kind = K_ALLREDUCE, .dtype = DTYPE_INT32,
                      .op = RED_SUM, .count = count};
    int32_t *in = malloc(count * 4 + 4);
    for (size_t i = 0; i < count; i++) in[i] = 1;
    jobs[r].in = in;
  }
}

static void expect_twos(job_t *jobs, size_t n, const char *ctx) {
  for (size_t r = 0; r < n; r++) {
    cr_assert_eq(jobs[r].rc, 0, "%s: member %zu: %s", ctx, jobs[r].me, jobs[r].err.msg);
    const int32_t *v = jobs[r].in;
    for (size_t i = 0; i < jobs[r].count; i++)
      if (v[i] != 2) cr_assert_fail("%s: member %zu element %zu = %d, expected 2", ctx, jobs[r].me, i, v[i]);
    free(jobs[r].in);
  }
}

/* The finding: a hello with the right (to, from, comm_id) followed by frames
 * of 1000s made a victim's allreduce 1001. Now the hello must prove the
 * secret: a wrong mac, no mac, or the old hello are closed unread, counted,
 * and the members' allreduce is 2. */
/* Peers named by addresses as long as an instruction may carry (255
 * characters: Kubernetes names run past 90; here a 240-character numeric
 * host for 127.0.0.1): collectives run, kept links are reused, and a peer
 * declared lost by that address ends the calls waiting on it at once. (The
 * data plane kept 95 characters: longer hosts were never dialed, longer
 * addresses never matched a loss.) */
Test(dataplane, peers_with_addresses_of_255_characters, .timeout = 60) {
  char host[241];
  memset(host, '0', 231);
  strcpy(host + 231, "177.0.0.1"); /* octal 0177: 127.0.0.1 */
  world_t w;
  world_start_at(&w, 3, 20000, host);
  cr_assert_geq(strlen(w.addrs[0]), 246);
  size_t count = 4096;
  job_t jobs[MAXN];
  for (uint64_t call = 1; call <= 2; call++) {
    sum_jobs(jobs, &w, 3, 91, call, count, count);
    run_jobs(jobs, 3);
    for (size_t r = 0; r < 3; r++) {
      cr_assert_eq(jobs[r].rc, 0, "call %llu, member %zu: %s", (unsigned long long)call, r,
                   jobs[r].err.msg);
      expect_reduced(DTYPE_FLOAT32, RED_SUM, 3, jobs[r].in, count, 1000 * call, "long address");
      free(jobs[r].in);
    }
  }
  size_t links = dataplane_links(w.dp[0]);
  cr_assert_gt(links, 0);
  sum_jobs(jobs, &w, 3, 91, 3, count, count);
  run_jobs(jobs, 3);
  for (size_t r = 0; r < 3; r++) {
    cr_assert_eq(jobs[r].rc, 0, "%s", jobs[r].err.msg);
    free(jobs[r].in);
  }
  cr_assert_eq(dataplane_links(w.dp[0]), links, "the kept links were not reused");

  job_t j = {.w = &w, .me = 0, .comm = 92, .kind = K_ALLREDUCE, .dtype = DTYPE_FLOAT32,
             .op = RED_SUM, .count = 16};
  j.in = calloc(16, 4);
  pthread_t th;
  pthread_create(&th, NULL, job_main, &j); /* member 2 never joins */
  usleep(300 * 1000);
  int64_t t0 = now_ms();
  dataplane_peer_lost(w.dp[0], w.addrs[2], w.ranks[2], "was lost (long address)");
  pthread_join(th, NULL);
  cr_assert_eq(j.rc, -1);
  cr_assert_eq(j.err.kind, ERR_AGENT_LOST, "%s", j.err.msg);
  cr_assert_lt(now_ms() - t0, 1000, "the loss ended the wait after %lld ms",
               (long long)(now_ms() - t0));
  free(j.in);
  world_stop(&w);
}

Test(dataplane_security, a_stranger_with_a_wrong_or_missing_proof_is_closed_before_any_payload,
     .timeout = 30) {
  world_t w;
  world_start(&w, 2, 3000);
  const uint64_t comm = 4242;
  job_t jobs[2];
  ones_jobs(jobs, &w, comm, 16);
  /* Member 0 starts alone: its group is registered, it waits for member 1. */
  pthread_t th0, th1;
  pthread_create(&th0, NULL, job_main, &jobs[0]);
  usleep(200 * 1000);
  for (int attempt = 0; attempt < 3; attempt++) {
    int fd = stranger_connect(&w, 0);
    uint8_t nonce[DP_NONCE_LEN], nonce_d[DP_NONCE_LEN] = {1, 2, 3}, hello[DP_HELLO_LEN];
    stranger_challenge(fd, nonce);
    /* Pretends to be member 1 (rank 11) of comm 4242, to member 0 (rank 10). */
    dp_wire_hello(hello, w.ranks[0], w.ranks[1], comm, 0, nonce_d, nonce, WRONG);
    if (attempt == 1) memset(hello + DP_HELLO_SIGNED, 0, DP_MAC_LEN); /* no proof at all */
    if (attempt == 2) { /* the old hello: {magic, to, from, 0, comm_id} */
      memset(hello, 0, sizeof hello);
      dp__put32(hello, DP_MAGIC_HELLO);
      dp__put32(hello + 4, w.ranks[0]);
      dp__put32(hello + 8, w.ranks[1]);
      dp__put64(hello + 16, comm);
    }
    cr_assert_eq(send(fd, hello, attempt == 2 ? 24 : sizeof hello, MSG_NOSIGNAL),
                 attempt == 2 ? 24 : (ssize_t)sizeof hello);
    stranger_frame(fd, comm, 1000, 16);
    cr_assert(closed_without_ack(fd, 2000), "attempt %d: the stranger's connection stays open", attempt);
    close(fd);
  }
  cr_assert_eq(wait_rejected(w.dp[0], DP_REJECT_BAD_PROOF, 2, 1000), 2);
  cr_assert_eq(wait_rejected(w.dp[0], DP_REJECT_MALFORMED, 1, 1000), 1, "the old hello");
  pthread_create(&th1, NULL, job_main, &jobs[1]);
  pthread_join(th0, NULL);
  pthread_join(th1, NULL);
  expect_twos(jobs, 2, "allreduce with a stranger around");
  cr_assert_eq(dataplane_rejected(w.dp[1], DP_REJECT_BAD_PROOF), 0);
  world_stop(&w);
}

/* A hello recorded on one connection proves nothing on another: the acceptor's
 * nonce differs. The first connection (made with the secret) is admitted and
 * acknowledged with a mac the dialer can check; its replay is closed. */
Test(dataplane_security, a_replayed_hello_is_refused, .timeout = 30) {
  world_t w;
  world_start(&w, 2, 1500);
  const uint64_t comm = 4343;
  job_t j = {.w = &w, .me = 0, .comm = comm, .kind = K_ALLREDUCE, .dtype = DTYPE_INT32,
             .op = RED_SUM, .count = 4};
  int32_t buf[4] = {0};
  j.in = buf;
  pthread_t th;
  pthread_create(&th, NULL, job_main, &j); /* member 1 never joins: the call fails */
  usleep(200 * 1000);
  int a = stranger_connect(&w, 0), b = stranger_connect(&w, 0);
  uint8_t na[DP_NONCE_LEN], nb[DP_NONCE_LEN], nd[DP_NONCE_LEN] = {9}, hello[DP_HELLO_LEN];
  stranger_challenge(a, na);
  stranger_challenge(b, nb);
  cr_assert(memcmp(na, nb, DP_NONCE_LEN) != 0, "two connections got the same nonce");
  dp_wire_hello(hello, w.ranks[0], w.ranks[1], comm, 0, nd, na, SECRET);
  cr_assert_eq(send(a, hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
  uint8_t ack[DP_ACK_LEN];
  cr_assert_eq(recv(a, ack, sizeof ack, MSG_WAITALL), (ssize_t)sizeof ack, "no ack for a member");
  cr_assert(dp_wire_ack_proves(ack, sizeof ack, hello, na, SECRET));
  cr_assert(!dp_wire_ack_proves(ack, sizeof ack, hello, na, WRONG));
  cr_assert_eq(send(b, hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello); /* the replay */
  cr_assert(closed_without_ack(b, 2000), "the replayed hello was not refused");
  cr_assert_eq(wait_rejected(w.dp[0], DP_REJECT_BAD_PROOF, 1, 1000), 1);
  pthread_join(th, NULL);
  cr_assert_eq(j.rc, -1);
  close(a);
  close(b);
  world_stop(&w);
}

/* A silent socket is closed at the hello deadline; a complete hello for a
 * call that never starts here, after timeout_ms. Both counted. */
Test(dataplane_security, silent_and_unknown_hellos_are_closed_at_their_deadlines, .timeout = 30) {
  world_t w;
  world_start(&w, 2, 800);
  int silent = stranger_connect(&w, 1), half = stranger_connect(&w, 1), unknown = stranger_connect(&w, 1);
  uint8_t nonce[DP_NONCE_LEN], hello[DP_HELLO_LEN], nd[DP_NONCE_LEN] = {0};
  stranger_challenge(silent, nonce); /* then says nothing */
  stranger_challenge(half, nonce);
  dp_wire_hello(hello, w.ranks[1], w.ranks[0], 77, 0, nd, nonce, SECRET);
  cr_assert_eq(send(half, hello, 10, MSG_NOSIGNAL), 10); /* a valid prefix, then silence */
  stranger_challenge(unknown, nonce);
  dp_wire_hello(hello, w.ranks[1], w.ranks[0], 78, 0, nd, nonce, SECRET);
  cr_assert_eq(send(unknown, hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
  int64_t t0 = now_ms();
  cr_assert(closed_without_ack(silent, 3000), "a silent socket stays open");
  cr_assert(closed_without_ack(half, 3000), "a socket with half a hello stays open");
  cr_assert(closed_without_ack(unknown, 3000), "a hello for no call here stays open");
  cr_assert(now_ms() - t0 < 2000, "closing them took %lld ms", (long long)(now_ms() - t0));
  cr_assert_eq(wait_rejected(w.dp[1], DP_REJECT_HELLO_TIMEOUT, 2, 1000), 2);
  cr_assert_eq(wait_rejected(w.dp[1], DP_REJECT_UNKNOWN_GROUP, 1, 1000), 1);
  cr_assert_str_eq(dp_reject_name(DP_REJECT_HELLO_TIMEOUT), "hello_timeout");
  close(silent);
  close(half);
  close(unknown);
  world_stop(&w);
}

/* The finding: 300 silent sockets on a data port made a victim's collective
 * fail after 30 s. Now, past the cap on unproven sockets (lowered here to 64,
 * so that 300 and more overflow it), silent ones make room for new ones, and
 * members' collectives -- each on a fresh comm, so each dials and proves
 * anew -- complete while strangers keep connecting. */
typedef struct flood {
  world_t *w;
  atomic_bool stop;
  int fds[600];
  size_t n;
} flood_t;

static void *flood_main(void *arg) {
  flood_t *f = arg;
  while (!atomic_load(&f->stop) && f->n < sizeof f->fds / sizeof f->fds[0]) {
    f->fds[f->n] = stranger_connect(f->w, f->n % 2);
    f->n++;
    usleep(1000);
  }
  return NULL;
}

Test(dataplane_security, silent_sockets_beyond_the_cap_do_not_starve_members, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 5000);
  for (size_t i = 0; i < 2; i++) dataplane_max_unproven(w.dp[i], 64);
  flood_t f = {.w = &w};
  for (int i = 0; i < 300; i++) f.fds[f.n++] = stranger_connect(&w, (size_t)i % 2);
  pthread_t th;
  pthread_create(&th, NULL, flood_main, &f);
  int64_t t0 = now_ms();
  for (uint64_t k = 0; k < 12; k++) {
    job_t jobs[2];
    ones_jobs(jobs, &w, 5000 + k, k % 2 ? 300000 : 16); /* the ring and the direct exchange */
    run_jobs(jobs, 2);
    expect_twos(jobs, 2, "allreduce among silent sockets");
  }
  int64_t took = now_ms() - t0;
  atomic_store(&f.stop, true);
  pthread_join(th, NULL);
  cr_assert(took < 15000, "12 allreduces among %zu strangers took %lld ms", f.n, (long long)took);
  /* The listeners may still hold strangers in their accept queues when the
   * flood stops: wait (bounded) for them to be seen, not for the clock. */
  uint64_t crowded = 0;
  for (int64_t until = now_ms() + 10000; now_ms() < until; usleep(10 * 1000)) {
    crowded = dataplane_rejected(w.dp[0], DP_REJECT_TOO_MANY_PENDING) +
              dataplane_rejected(w.dp[1], DP_REJECT_TOO_MANY_PENDING);
    if (crowded >= f.n - 2 * 64) break;
  }
  cr_assert(crowded >= f.n - 2 * 64, "only %llu of %zu strangers were crowded out",
            (unsigned long long)crowded, f.n);
  for (size_t i = 0; i < f.n; i++) close(f.fds[i]);
  world_stop(&w);
}

/* 300 silent sockets that arrive at once (a port scan, a stranger's burst)
 * held a member's connection in the listen backlog behind them: the listener
 * took them 64 at a time and closed a generation only once it was 500 ms old,
 * so the member got in ~2 s later, after ~236 of them were closed (a
 * collective with a 2 s timeout failed). Now they fit under the cap: the
 * member, dialing over TCP as from another host, is accepted and proven while
 * every one of them is still open. */
Test(dataplane_security, a_member_is_admitted_at_once_behind_300_silent_sockets, .timeout = 30) {
  runtime_raise_fd_limit(); /* as the agent does before its data plane starts */
  struct rlimit lim;
  cr_assert_eq(getrlimit(RLIMIT_NOFILE, &lim), 0);
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < 4 * 400)
    cr_skip_test("the fd limit (%llu) keeps the cap on unproven sockets below 400",
                 (unsigned long long)lim.rlim_cur);
  world_t w;
  world_start(&w, 2, 5000);
  for (size_t i = 0; i < 2; i++) dataplane_same_host(w.dp[i], false);
  int silent[300];
  for (size_t i = 0; i < 300; i++) silent[i] = stranger_connect(&w, 1);
  job_t jobs[2];
  ones_jobs(jobs, &w, 5100, 16);
  run_jobs(jobs, 2);
  uint64_t crowded = dataplane_rejected(w.dp[1], DP_REJECT_TOO_MANY_PENDING),
           late = dataplane_rejected(w.dp[1], DP_REJECT_HELLO_TIMEOUT);
  cr_assert_eq(crowded + late, 0,
               "the member got in after %llu of the 300 silent sockets were closed as too many "
               "and %llu at their hello deadline",
               (unsigned long long)crowded, (unsigned long long)late);
  expect_twos(jobs, 2, "allreduce behind 300 silent sockets");
  for (size_t i = 0; i < 300; i++) close(silent[i]);
  world_stop(&w);
}

/* Past the cap, a newcomer takes the place of a socket that has sent nothing
 * (once 100 ms old), not of one mid-hello: that one keeps its 500 ms grace,
 * and its hello deadline (a member's hello on a slow path). The cap lowered
 * to 64: a socket sends 10 bytes of a hello, then 120 silent ones come; the
 * 57 beyond the cap replace silent ones (before, the one mid-hello, the
 * oldest, went first). */
Test(dataplane_security, past_the_cap_silent_sockets_make_room_before_one_mid_hello,
     .timeout = 30) {
  world_t w;
  world_start(&w, 1, 5000);
  dataplane_max_unproven(w.dp[0], 64);
  uint8_t nonce[DP_NONCE_LEN], hello[DP_HELLO_LEN], nd[DP_NONCE_LEN] = {0};
  int half = stranger_connect(&w, 0);
  stranger_challenge(half, nonce);
  dp_wire_hello(hello, w.ranks[0], w.ranks[0] + 1, 77, 0, nd, nonce, SECRET);
  cr_assert_eq(send(half, hello, 10, MSG_NOSIGNAL), 10); /* read before the others are accepted */
  int silent[120];
  for (size_t i = 0; i < 120; i++) silent[i] = stranger_connect(&w, 0);
  uint64_t crowded = wait_rejected(w.dp[0], DP_REJECT_TOO_MANY_PENDING, 120 - 63, 5000);
  cr_assert_geq(crowded, 120 - 63, "only %llu closed past the cap", (unsigned long long)crowded);
  cr_assert(!closed_without_ack(half, 0), "the socket mid-hello was closed for a silent newcomer");
  cr_assert_eq(dataplane_rejected(w.dp[0], DP_REJECT_HELLO_TIMEOUT), 0);
  close(half);
  for (size_t i = 0; i < 120; i++) close(silent[i]);
  world_stop(&w);
}

/* ------------------------------------------------------------ wire (pure) */

/* A dialer that closes before its hello's first byte withdrew (a member whose
 * dial gave up under load does it): counted apart, no rejection; one that
 * sends part of a hello and closes is malformed. */
Test(dataplane_security, a_connection_closed_before_its_hello_withdrew, .timeout = 30) {
  world_t w;
  world_start(&w, 1, 1000);
  uint8_t nonce[DP_NONCE_LEN];
  int fd = stranger_connect(&w, 0);
  stranger_challenge(fd, nonce);
  close(fd);
  int64_t until = now_ms() + 2000;
  while (dataplane_withdrawn(w.dp[0]) < 1 && now_ms() < until) usleep(10 * 1000);
  cr_assert_eq(dataplane_withdrawn(w.dp[0]), 1);
  for (int r = 0; r < DP_REJECT_COUNT; r++)
    cr_assert_eq(dataplane_rejected(w.dp[0], (dp_reject_t)r), 0, "counted as %s",
                 dp_reject_name((dp_reject_t)r));
  fd = stranger_connect(&w, 0);
  stranger_challenge(fd, nonce);
  cr_assert_eq(send(fd, "MDPH", 4, MSG_NOSIGNAL), 4);
  close(fd);
  cr_assert_eq(wait_rejected(w.dp[0], DP_REJECT_MALFORMED, 1, 2000), 1, "a hello cut short");
  cr_assert_eq(dataplane_withdrawn(w.dp[0]), 1);
  world_stop(&w);
}

Test(dataplane_wire, a_hello_proves_only_its_secret_nonce_rank_and_comm) {
  uint8_t na[DP_NONCE_LEN] = {7}, nd[DP_NONCE_LEN] = {8}, hello[DP_HELLO_LEN];
  uint32_t ranks[3] = {4, 5, 6};
  dp_wire_group_t g[2] = {{.comm_id = 99, .ranks = ranks, .n = 2, .secret = WRONG},
                          {.comm_id = 100, .ranks = ranks, .n = 3, .secret = SECRET}};
  char why[200];
  size_t which = 9;
  dp_wire_hello(hello, 4, 6, 100, 0, nd, na, SECRET);
  for (size_t len = 0; len < DP_HELLO_LEN; len++)
    cr_assert_eq(dp_wire_admit(hello, len, 4, na, g, 2, &which, why, sizeof why), DP_ADMIT_MORE);
  cr_assert_eq(dp_wire_admit(hello, sizeof hello, 4, na, g, 2, &which, why, sizeof why), DP_ADMIT_OK);
  cr_assert_eq(which, 1);
  /* Every single changed byte (field or mac) is refused. */
  for (size_t i = 0; i < DP_HELLO_LEN; i++) {
    uint8_t t[DP_HELLO_LEN];
    memcpy(t, hello, sizeof t);
    t[i] ^= 0x41;
    cr_assert_neq(dp_wire_admit(t, sizeof t, 4, na, g, 2, NULL, why, sizeof why), DP_ADMIT_OK,
                  "byte %zu changed and still admitted", i);
  }
  na[0] ^= 1; /* another connection: a replay */
  cr_assert_eq(dp_wire_admit(hello, sizeof hello, 4, na, g, 2, NULL, why, sizeof why), DP_ADMIT_BAD_PROOF);
  cr_assert(strstr(why, "rank 6") && strstr(why, "comm 100"), "%s", why);
  na[0] ^= 1;
  cr_assert_eq(dp_wire_admit(hello, sizeof hello, 5, na, g, 2, NULL, why, sizeof why), DP_ADMIT_MALFORMED);
  cr_assert(strstr(why, "addressed to rank 4, but this is rank 5"), "%s", why);
  cr_assert_eq(dp_wire_admit(hello, sizeof hello, 4, na, g, 1, NULL, why, sizeof why),
               DP_ADMIT_UNKNOWN_GROUP, "comm 100 not registered: %s", why);
  /* A wrong mac for another call of the comm: held (that call may prove another secret). */
  dp_wire_hello(hello, 4, 6, 100, 7, nd, na, WRONG);
  cr_assert_eq(dp_wire_admit(hello, sizeof hello, 4, na, g, 2, NULL, why, sizeof why),
               DP_ADMIT_UNKNOWN_GROUP, "%s", why);
  dp_wire_hello(hello, 4, 6, 99, 0, nd, na, WRONG); /* rank 6 is not in comm 99's group */
  cr_assert_eq(dp_wire_admit(hello, sizeof hello, 4, na, g, 2, NULL, why, sizeof why), DP_ADMIT_UNKNOWN_GROUP);
  dp_wire_hello(hello, 4, 4, 100, 0, nd, na, SECRET); /* from itself */
  cr_assert_eq(dp_wire_admit(hello, sizeof hello, 4, na, g, 2, NULL, why, sizeof why), DP_ADMIT_UNKNOWN_GROUP);
  const uint8_t junk[8] = "GET / HT";
  cr_assert_eq(dp_wire_admit(junk, 4, 4, na, g, 2, NULL, why, sizeof why), DP_ADMIT_MALFORMED);
  cr_assert(strstr(why, "not a data plane hello"), "%s", why);
}

Test(dataplane_wire, frames_are_classified) {
  uint8_t h[DP_HDR_LEN];
  dp_frame_t f;
  const size_t max = 1u << 20;
  dp_wire_frame(h, DP_MAGIC_DATA, 100, 5, 40, 3);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 3, 100, max, &f), DP_FRAME_DATA);
  cr_assert_eq(f.call, 40);
  cr_assert_eq(dp_wire_parse_frame(h, 6, 40, 3, 100, max, &f), DP_FRAME_FOREIGN);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 4, 100, max, &f), DP_FRAME_SKEWED);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 3, 99, max, &f), DP_FRAME_SKEWED);
  /* Another call's data: skipped when older, fails the call when newer; a
   * frame out of sequence or over the limit is skewed whatever its call. */
  cr_assert_eq(dp_wire_parse_frame(h, 5, 41, 3, 7, max, &f), DP_FRAME_STALE);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 39, 3, 7, max, &f), DP_FRAME_AHEAD);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 41, 2, 100, max, &f), DP_FRAME_SKEWED);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 41, 3, 100, 99, &f), DP_FRAME_SKEWED);
  cr_assert_eq(dp_wire_parse_frame(h, 6, 41, 3, 100, max, &f), DP_FRAME_FOREIGN);
  dp_wire_frame(h, DP_MAGIC_ABORT, 0xffffffffu, 5, 40, 0);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 0, 0, max, &f), DP_FRAME_ABORT);
  cr_assert_eq(f.len, DP_ABORT_MAX, "an abort's text is capped");
  cr_assert_eq(dp_wire_parse_frame(h, 5, 41, 0, 0, max, &f), DP_FRAME_ABORT, "whatever its call");
  dp_wire_frame(h, DP_MAGIC_HELLO, 1, 5, 40, 0);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 0, 1, max, &f), DP_FRAME_FOREIGN);
  /* A shared-memory frame stands for a message of any length; its own length is the count's. */
  dp_wire_frame(h, DP_MAGIC_SHM, DP_SHM_PAYLOAD, 5, 40, 3);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 3, 1u << 20, max, &f), DP_FRAME_SHM);
  cr_assert_eq(dp_wire_parse_frame(h, 6, 40, 3, 1u << 20, max, &f), DP_FRAME_FOREIGN);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 2, 1u << 20, max, &f), DP_FRAME_SKEWED);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 41, 3, 1u << 20, max, &f), DP_FRAME_STALE);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 39, 3, 1u << 20, max, &f), DP_FRAME_AHEAD);
  dp_wire_frame(h, DP_MAGIC_SHM, 9, 5, 40, 3);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 3, 9, max, &f), DP_FRAME_SKEWED);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 41, 3, 9, max, &f), DP_FRAME_SKEWED);
  /* A goodbye: of this comm, empty, whatever its call and seq. */
  dp_wire_frame(h, DP_MAGIC_BYE, 0, 5, 0, 9);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 3, 100, max, &f), DP_FRAME_BYE);
  cr_assert_eq(dp_wire_parse_frame(h, 6, 40, 3, 100, max, &f), DP_FRAME_FOREIGN);
  dp_wire_frame(h, DP_MAGIC_BYE, 1, 5, 0, 9);
  cr_assert_eq(dp_wire_parse_frame(h, 5, 40, 3, 100, max, &f), DP_FRAME_FOREIGN);
}

/* Calls without a secret are refused up front, naming what is missing. */
Test(dataplane_security, a_group_without_a_secret_is_refused) {
  world_t w;
  world_start(&w, 2, 1000);
  dp_group_t g = group(&w, 1, 0);
  g.secret = NULL;
  int32_t v[2] = {1, 1};
  meshd_error_t err = {0};
  cr_assert_eq(dp_allreduce(w.dp[0], &g, v, 2, DTYPE_INT32, RED_SUM, &err), -1);
  cr_assert_eq(err.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(err.msg, "no secret"), "%s", err.msg);
  cr_assert_eq(dp_send(w.dp[0], 2, 0, NULL, w.ranks[1], w.addrs[1], v, 8, &err), -1);
  cr_assert(strstr(err.msg, "missing: secret"), "%s", err.msg);
  g.n = 1; /* alone: nothing to prove */
  cr_assert_eq(dp_allreduce(w.dp[0], &g, v, 2, DTYPE_INT32, RED_SUM, &err), 0, "%s", err.msg);
  world_stop(&w);
}

/* ------------------------------------------------------------ same host */

static uint8_t *map_buffer(size_t bytes) {
  uint8_t *b = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  cr_assert(b != MAP_FAILED, "mmap: %s", strerror(errno));
  return b;
}

/* One broadcast of `bytes` from member 0 over w (destinations' buffers are
 * mappings, `map` as given), checked byte for byte. The buffers are left in
 * bufs[] (munmap them). */
static void broadcast_once(world_t *w, uint64_t comm, size_t bytes, bool map, uint8_t **bufs) {
  job_t jobs[MAXN];
  for (size_t r = 0; r < w->n; r++) {
    bufs[r] = map_buffer(bytes);
    for (size_t i = 0; i < bytes; i += r == 0 ? 1 : 4096) bufs[r][i] = r == 0 ? (uint8_t)(i * 7 + 1) : 0xee;
    jobs[r] = (job_t){.w = w, .me = r, .comm = comm, .kind = K_BROADCAST, .count = bytes,
                      .in = bufs[r], .map = map && r > 0};
  }
  run_jobs(jobs, w->n);
  for (size_t r = 0; r < w->n; r++) {
    cr_assert_eq(jobs[r].rc, 0, "member %zu: %s", r, jobs[r].err.msg);
    cr_assert(memcmp(bufs[r], bufs[0], bytes) == 0, "member %zu differs from the source", r);
  }
}

static void expect_shm(const world_t *w, uint64_t received, uint64_t mapped, const char *ctx) {
  for (size_t r = 0; r < w->n; r++) {
    uint64_t m = 0, got = dataplane_shm_received(w->dp[r], &m);
    cr_assert_eq(got, r == 0 ? 0 : received, "%s: member %zu received %llu as shared memory", ctx,
                 r, (unsigned long long)got);
    cr_assert_eq(m, r == 0 ? 0 : mapped, "%s: member %zu mapped %llu", ctx, r, (unsigned long long)m);
  }
}

/* Between data planes of one host a large broadcast is one sealed memfd:
 * every destination gets the source's bytes (an odd length: the last page
 * is partly past the end) mapped copy-on-write over its buffer, or copied
 * when its buffer is not its own mapping; a write to one destination's
 * bytes changes nobody else's. With same-host links off it goes as frames. */
Test(dataplane, same_host_broadcast_maps_one_memfd, .timeout = 60) {
  world_t w;
  world_start(&w, 4, 5000);
  size_t bytes = 3 * BIG_BYTES / 4 + 5;
  uint8_t *bufs[MAXN];
  broadcast_once(&w, 700, bytes, true, bufs);
  expect_shm(&w, 1, 1, "mappable");
  bufs[1][0] ^= 0xff;
  bufs[1][bytes - 1] ^= 0xff;
  cr_assert_eq(bufs[2][0], bufs[0][0], "a write to one destination reached another");
  cr_assert_eq(bufs[3][bytes - 1], bufs[0][bytes - 1], "a write to one destination reached another");
  cr_assert_eq(bufs[0][0], 1, "a write to a destination reached the source");
  for (size_t r = 0; r < w.n; r++) munmap(bufs[r], bytes);

  broadcast_once(&w, 700, bytes, false, bufs); /* the same comm again: its links are reused */
  expect_shm(&w, 2, 1, "copied");
  for (size_t r = 0; r < w.n; r++) munmap(bufs[r], bytes);

  broadcast_once(&w, 701, DP_TEST_SHM_BELOW, true, bufs); /* small: frames */
  expect_shm(&w, 2, 1, "below the threshold");
  for (size_t r = 0; r < w.n; r++) munmap(bufs[r], DP_TEST_SHM_BELOW);

  for (size_t r = 0; r < w.n; r++) dataplane_same_host(w.dp[r], false);
  broadcast_once(&w, 702, bytes, true, bufs);
  expect_shm(&w, 2, 1, "same-host links off");
  for (size_t r = 0; r < w.n; r++) munmap(bufs[r], bytes);
  world_stop(&w);
}

/* A member that dials w's member `to` on its same-host socket and proves
 * the group's secret as rank `from` of comm: the connected socket. */
static int local_member_dial(const world_t *w, size_t to, uint32_t from, uint64_t comm) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  cr_assert(fd >= 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int n = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "meshd-dp:%d", dataplane_port(w->dp[to]));
  cr_assert_eq(connect(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n)),
               0, "connect to the same-host socket: %s", strerror(errno));
  struct timeval tv = {.tv_sec = 3};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  uint8_t na[DP_NONCE_LEN], nd[DP_NONCE_LEN] = {5}, hello[DP_HELLO_LEN], ack[DP_ACK_LEN];
  stranger_challenge(fd, na);
  dp_wire_hello(hello, w->ranks[to], from, comm, 0, nd, na, SECRET);
  cr_assert_eq(send(fd, hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
  cr_assert_eq(recv(fd, ack, sizeof ack, MSG_WAITALL), (ssize_t)sizeof ack, "no ack");
  cr_assert(dp_wire_ack_proves(ack, sizeof ack, hello, na, SECRET));
  return fd;
}

/* A frame header (+ payload) with descriptor `pass` attached (-1: none). */
static void send_with_fd(int fd, uint32_t magic, uint64_t comm, const void *pay, size_t len, int pass) {
  uint8_t buf[DP_HDR_LEN + 64];
  dp_wire_frame(buf, magic, (uint32_t)len, comm, 0, 0);
  memcpy(buf + DP_HDR_LEN, pay, len);
  struct iovec iov = {buf, DP_HDR_LEN + len};
  dp_fd_ctl_t ctl;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (pass >= 0) dp_wire_attach_fd(&mh, &ctl, pass);
  cr_assert_eq(sendmsg(fd, &mh, MSG_NOSIGNAL), (ssize_t)(DP_HDR_LEN + len), "sendmsg: %s", strerror(errno));
}

static int memfd_of(size_t bytes, bool seal) {
  int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  cr_assert(fd >= 0);
  cr_assert_eq(ftruncate(fd, (off_t)bytes), 0);
  if (seal) cr_assert_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

/* A member (it holds the secret) whose same-host frames carry the wrong
 * descriptor: an unsealed memfd (it could change the pages under a
 * mapping), one of the wrong size, none, or one riding on a data frame. The
 * receiver fails the call naming what was wrong, its buffer untouched, and
 * a broadcast among the members right after succeeds. */
Test(dataplane_security, a_member_passing_a_bad_descriptor_is_refused, .timeout = 60) {
  world_t w;
  world_start(&w, 3, 3000);
  const size_t bytes = BIG_BYTES / 2;
  const uint32_t rogue = 30;
  const char *rogue_addr = "127.0.0.1:9";
  struct {
    uint32_t magic;
    int fd;
    uint64_t count;
    const char *says;
  } cases[] = {
      {DP_MAGIC_SHM, memfd_of(bytes, false), bytes, "not a memfd sealed against writes"},
      {DP_MAGIC_SHM, memfd_of(bytes / 2, true), bytes, "memfd of"},
      {DP_MAGIC_SHM, -1, bytes, "without its memfd"},
      {DP_MAGIC_SHM, memfd_of(bytes, true), bytes - 1, "for a message of"},
      {DP_MAGIC_DATA, memfd_of(bytes, true), 0, "file descriptor that no frame"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    uint64_t comm = 800 + k;
    /* Member 1 of {rogue, w's member 1} waits to receive from the rogue. */
    world_t v = w;
    v.n = 2;
    v.ranks[0] = rogue;
    v.addrs[0] = rogue_addr;
    uint8_t *buf = map_buffer(bytes);
    memset(buf, 0xee, bytes);
    job_t j = {.w = &v, .me = 1, .comm = comm, .kind = K_BROADCAST, .count = bytes, .in = buf,
               .map = true};
    pthread_t th;
    pthread_create(&th, NULL, job_main, &j);
    int fd = local_member_dial(&w, 1, rogue, comm);
    uint8_t pay[8];
    dp__put64(pay, cases[k].count);
    if (cases[k].magic == DP_MAGIC_SHM) send_with_fd(fd, DP_MAGIC_SHM, comm, pay, 8, cases[k].fd);
    else send_with_fd(fd, DP_MAGIC_DATA, comm, buf, 16, cases[k].fd);
    pthread_join(th, NULL);
    cr_assert_eq(j.rc, -1, "case %zu: the call succeeded", k);
    cr_assert(strstr(j.err.msg, cases[k].says), "case %zu: %s", k, j.err.msg);
    cr_assert(strstr(j.err.msg, "rank 30"), "case %zu names no sender: %s", k, j.err.msg);
    for (size_t i = 0; i < bytes; i += 4096) cr_assert_eq(buf[i], 0xee, "case %zu: the buffer changed", k);
    close(fd);
    if (cases[k].fd >= 0) close(cases[k].fd);
    munmap(buf, bytes);
  }
  uint8_t *bufs[MAXN];
  broadcast_once(&w, 900, bytes, true, bufs);
  for (size_t r = 0; r < w.n; r++) munmap(bufs[r], bytes);
  world_stop(&w);
}

static int open_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  cr_assert(d);
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

/* This process out of descriptors but for one (RLIMIT_NOFILE lowered, the
 * rest filled with dups of stderr, in dups[64]): room for a newcomer's socket,
 * none for the listener's end of it. *old: the limit fds_restore puts back.
 * Returns how many dups are open. */
static int fds_fill_but_one(int *dups, struct rlimit *old) {
  cr_assert_eq(getrlimit(RLIMIT_NOFILE, old), 0);
  struct rlimit low = {.rlim_cur = (rlim_t)open_fds() + 8, .rlim_max = old->rlim_max};
  cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
  int n = 0;
  while (n < 64 && (dups[n] = dup(2)) >= 0) n++;
  cr_assert_lt(n, 64, "the fd limit was not reached");
  close(dups[--n]);
  return n;
}

static void fds_restore(int *dups, int n, const struct rlimit *old) {
  for (int i = 0; i < n; i++) close(dups[i]);
  cr_assert_eq(setrlimit(RLIMIT_NOFILE, old), 0);
}

/* A same-host broadcast whose middle member never comes: the source (which
 * made its memfd) and the last member fail within the timeout, naming it; the
 * same comm with everyone present then succeeds; and once the data planes
 * stop, no descriptor is left open (memfds made, passed or received, and
 * sockets). */
Test(dataplane, same_host_broadcast_with_a_missing_member_fails_and_leaks_nothing,
     .timeout = 60) {
  int before = open_fds();
  world_t w;
  world_start(&w, 3, 1000);
  size_t bytes = BIG_BYTES / 2;
  job_t jobs[3];
  uint8_t *bufs[3];
  for (size_t r = 0; r < 3; r++) {
    bufs[r] = map_buffer(bytes);
    memset(bufs[r], r == 0 ? 0x5a : 0, bytes);
    jobs[r] = (job_t){.w = &w, .me = r, .comm = 990, .kind = K_BROADCAST, .count = bytes,
                      .in = bufs[r], .map = r > 0};
  }
  job_t present[2] = {jobs[0], jobs[2]};
  run_jobs(present, 2);
  for (size_t k = 0; k < 2; k++) expect_names(&present[k], &w, 1, 3000);
  cr_assert_eq(bufs[2][0], 0, "the last member got bytes past a missing one");
  run_jobs(jobs, 3);
  for (size_t r = 0; r < 3; r++) {
    cr_assert_eq(jobs[r].rc, 0, "after the failure, member %zu: %s", r, jobs[r].err.msg);
    cr_assert(memcmp(bufs[r], bufs[0], bytes) == 0, "member %zu differs", r);
  }
  for (size_t r = 0; r < 3; r++) munmap(bufs[r], bytes);
  expect_shm(&w, 1, 1, "after the failure");
  world_stop(&w);
  cr_assert_eq(open_fds(), before, "descriptors left open: %d before, %d after", before, open_fds());
}

/* Anyone on the host can bind an agent's abstract name before it does. A
 * squatter running as another user is not dialed: the sender never sends it
 * a byte (not even a hello) and goes to TCP, where nobody listens here. Needs
 * root (to run the squatter as nobody); skipped otherwise. */
Test(dataplane_security, a_same_host_socket_of_another_user_is_not_dialed, .timeout = 30) {
  if (geteuid() != 0) cr_skip_test("needs root to run a squatter as another user");
  int probe = socket(AF_INET, SOCK_STREAM, 0); /* a free port nobody listens on */
  struct sockaddr_in sa = {.sin_family = AF_INET};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  socklen_t sl = sizeof sa;
  cr_assert_eq(bind(probe, (struct sockaddr *)&sa, sizeof sa), 0);
  getsockname(probe, (struct sockaddr *)&sa, &sl);
  int port = ntohs(sa.sin_port);
  close(probe);
  int ready[2], told[2];
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(told), 0);
  pid_t child = fork();
  cr_assert(child >= 0);
  if (child == 0) { /* the squatter: nobody, on @meshd-dp:PORT */
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    int l = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    int n = snprintf(un.sun_path + 1, sizeof un.sun_path - 1, "meshd-dp:%d", port);
    if (bind(l, (struct sockaddr *)&un, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n)) != 0 ||
        listen(l, 4) != 0)
      _exit(3);
    if (write(ready[1], "r", 1) != 1) _exit(4);
    struct pollfd p = {.fd = l, .events = POLLIN};
    char got = 'n'; /* n: nobody came; 0: came, sent nothing; b: sent bytes */
    if (poll(&p, 1, 5000) == 1) {
      int c = accept(l, NULL, NULL);
      char b[8];
      struct pollfd q = {.fd = c, .events = POLLIN};
      got = poll(&q, 1, 3000) == 1 && recv(c, b, sizeof b, 0) > 0 ? 'b' : '0';
    }
    _exit(write(told[1], &got, 1) == 1 ? 0 : 5);
  }
  close(ready[1]);
  close(told[1]);
  char r;
  if (read(ready[0], &r, 1) != 1) { /* it exited first */
    int st = 0;
    waitpid(child, &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 2) cr_skip_test("cannot become nobody here");
    cr_assert_fail("the squatter did not start (status %d)", st);
  }
  world_t w;
  world_start(&w, 1, 1000);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  uint8_t buf[16] = {0};
  meshd_error_t err = {0};
  cr_assert_eq(dp_send(w.dp[0], 4545, 0, SECRET, 99, addr, buf, sizeof buf, &err), -1);
  cr_assert(strstr(err.msg, "unreachable") && strstr(err.msg, "cannot connect"),
            "not a TCP dial that found nobody: %s", err.msg);
  char got = '?';
  cr_assert_eq(read(told[0], &got, 1), 1);
  cr_assert(got != 'b', "the squatter of another user got bytes from a member");
  int status = 0;
  waitpid(child, &status, 0);
  cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "squatter exit %d", status);
  world_stop(&w);
}

/* Out of file descriptors, the listener cannot accept what waits in its
 * backlog, and its socket stays readable: it must back off, not spin (it took
 * a whole core). This process's fds are used up; a child (its own fd table)
 * fills the backlog. */
Test(dataplane, a_listener_out_of_fds_does_not_spin, .timeout = 60) {
  meshd_error_t err = {0};
  dataplane_t *dp = dataplane_start("127.0.0.1", 0, 2000, &err);
  cr_assert(dp, "dataplane_start: %s", err.msg);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)dataplane_port(dp))};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  struct rlimit old;
  cr_assert_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
  int open_now = 0;
  DIR *d = opendir("/proc/self/fd");
  for (struct dirent *e; d && (e = readdir(d));) open_now += e->d_name[0] != '.';
  if (d) closedir(d);
  struct rlimit low = {.rlim_cur = (rlim_t)open_now + 16, .rlim_max = old.rlim_max};
  cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
  int dups[64], n = 0;
  while (n < 64 && (dups[n] = dup(2)) >= 0) n++;
  cr_assert_lt(n, 64, "the fd limit was not reached");
  pid_t child = fork();
  if (child == 0) {
    for (int i = 0; i < n; i++) close(dups[i]);
    for (int i = 0; i < 8; i++) {
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      if (fd >= 0) connect(fd, (struct sockaddr *)&a, sizeof a);
    }
    sleep(5);
    _exit(0);
  }
  cr_assert_gt(child, 0);
  struct timespec pause = {0, 200 * 1000 * 1000};
  nanosleep(&pause, NULL); /* the child connected; the listener met EMFILE */
  struct rusage r0, r1;
  getrusage(RUSAGE_SELF, &r0);
  for (int i = 0; i < 3; i++) nanosleep(&pause, NULL);
  getrusage(RUSAGE_SELF, &r1);
  double cpu = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec -
                        r0.ru_stime.tv_sec) +
               (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec -
                r0.ru_stime.tv_usec) / 1e6;
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  fds_restore(dups, n, &old);
  cr_assert_lt(cpu, 0.15, "the process used %.2f CPU-s in 0.6 s while out of fds: the "
               "listener spins", cpu);
  dataplane_stop(dp);
}

/* Out of descriptors with strangers holding them unproven, the listener only
 * backed off: a member's dial waited in the backlog until the strangers'
 * hello deadlines (5 s) freed some. Now the unproven socket the cap would
 * close first goes (here the oldest silent one: the grace is 0), never a
 * held one, and the newcomer is accepted and challenged at once. The fd
 * limit is lowered in this test's own process (Criterion runs each test in
 * one), filled with dups but for the newcomer's own socket. */
Test(dataplane_security, out_of_fds_an_unproven_socket_makes_room_for_a_newcomer, .timeout = 30) {
  world_t w;
  world_start(&w, 2, 10000);
  dataplane_silent_grace(w.dp[0], 0);
  dp_group_t g = group(&w, 78, 0);
  cr_assert_eq(dataplane_expect(w.dp[0], &g), 0);
  uint8_t na[DP_NONCE_LEN], nd[DP_NONCE_LEN] = {3}, hello[DP_HELLO_LEN];
  int held = stranger_connect(&w, 0); /* the oldest: a member's hello, proven and held */
  stranger_challenge(held, na);
  dp_wire_hello(hello, w.ranks[0], w.ranks[1], 78, 1, nd, na, SECRET);
  cr_assert_eq(send(held, hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
  size_t proven = 0;
  for (int64_t until = now_ms() + 5000; proven < 1 && now_ms() < until; usleep(5 * 1000))
    dataplane_parked(w.dp[0], &proven);
  cr_assert_eq(proven, 1, "the member's hello was not held");
  int silent[4];
  for (size_t i = 0; i < 4; i++) {
    silent[i] = stranger_connect(&w, 0);
    stranger_challenge(silent[i], na); /* accepted: pending */
  }
  struct rlimit old;
  int dups[64], n = fds_fill_but_one(dups, &old);
  int newcomer = stranger_connect(&w, 0);
  uint8_t ch[DP_CHALLENGE_LEN];
  ssize_t got = recv(newcomer, ch, sizeof ch, MSG_WAITALL); /* 3 s at most (SO_RCVTIMEO) */
  fds_restore(dups, n, &old);
  cr_assert_eq(got, (ssize_t)sizeof ch, "the newcomer was not accepted within 3 s: %s",
               got < 0 ? strerror(errno) : "closed");
  cr_assert_eq(dataplane_rejected(w.dp[0], DP_REJECT_TOO_MANY_PENDING), 1);
  cr_assert_eq(dataplane_rejected(w.dp[0], DP_REJECT_HELLO_TIMEOUT), 0);
  cr_assert(closed_without_ack(silent[0], 2000), "the oldest unproven socket is still open");
  for (size_t i = 1; i < 4; i++)
    cr_assert(!closed_without_ack(silent[i], 0), "silent socket %zu was closed as well", i);
  cr_assert(!closed_without_ack(held, 0), "the held hello was closed");
  cr_assert_eq(dataplane_parked(w.dp[0], &proven), 1);
  cr_assert_eq(proven, 1);
  close(newcomer);
  close(held);
  for (size_t i = 0; i < 4; i++) close(silent[i]);
  world_stop(&w);
}

/* One send from member `from` to the other on comm, call `call`: bytes a land in b. */
static void pair_once(world_t *w, size_t from, uint64_t comm, uint64_t call) {
  uint8_t a[64], b[64];
  for (size_t i = 0; i < sizeof a; i++) a[i] = (uint8_t)(comm * 7 + i + call);
  memset(b, 0, sizeof b);
  p2p_job_t pair[2] = {{.w = w, .me = from, .peer = 1 - from, .comm = comm, .call = call,
                        .send = true, .buf = a, .bytes = sizeof a},
                       {.w = w, .me = 1 - from, .peer = from, .comm = comm, .call = call, .buf = b,
                        .bytes = sizeof b}};
  pthread_t th[2];
  for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, p2p_main, &pair[k]);
  for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
  for (int k = 0; k < 2; k++)
    cr_assert_eq(pair[k].rc, 0, "comm %llu call %llu: %s", (unsigned long long)comm,
                 (unsigned long long)call, pair[k].err.msg);
  cr_assert(memcmp(a, b, sizeof a) == 0, "comm %llu call %llu: wrong bytes",
            (unsigned long long)comm, (unsigned long long)call);
}

/* Out of descriptors with no unproven socket to close, the listener paused
 * accepting 100 ms at a time: a member dialing then waited for the pause to
 * end even when the data plane had closed a descriptor of its own at once.
 * Such a close now wakes it. The pause is made a minute here, so that only
 * the wake-up lets the newcomer in within the wait (its socket's 3 s). The fd
 * limit is lowered in this test's own process, filled with dups but for the
 * newcomer's socket, as above. */
Test(dataplane_security, out_of_fds_a_descriptor_the_data_plane_closes_lets_a_newcomer_in,
     .timeout = 30) {
  world_t w;
  world_start(&w, 2, 10000);
  pair_once(&w, 1, 81, 1); /* member 0 keeps the link it accepted */
  cr_assert_gt(dataplane_links(w.dp[0]), 0);
  dataplane_accept_backoff(w.dp[0], 60000);
  struct rlimit old;
  int dups[64], n = fds_fill_but_one(dups, &old);
  int newcomer = stranger_connect(&w, 0);
  int64_t until = now_ms() + 5000;
  while (!dataplane_accept_paused(w.dp[0]) && now_ms() < until) usleep(1000);
  bool paused = dataplane_accept_paused(w.dp[0]);
  dataplane_drop_comm(w.dp[0], 81); /* closes that link: a descriptor of its own */
  uint8_t ch[DP_CHALLENGE_LEN];
  ssize_t got = paused ? recv(newcomer, ch, sizeof ch, MSG_WAITALL) : -1;
  int e = errno;
  fds_restore(dups, n, &old);
  cr_assert(paused, "the listener did not pause, out of descriptors");
  cr_assert_eq(got, (ssize_t)sizeof ch, "the newcomer was not accepted within 3 s: %s",
               got < 0 ? strerror(e) : "closed");
  close(newcomer);
  world_stop(&w);
}

/* A session that makes comm after comm (meshes sliced in a loop) kept two
 * descriptors per comm and peer until it ended, until the agent ran out of
 * them. With a cap on kept links, descriptors stay bounded, and calls on
 * comms whose links were closed dial again and move the right bytes, in both
 * directions. */
Test(dataplane, kept_links_are_capped_and_closed_ones_dial_again, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 5000);
  for (size_t i = 0; i < 2; i++) dataplane_max_links(w.dp[i], 8);
  int before = open_fds();
  for (uint64_t round = 0; round < 2; round++)
    for (uint64_t comm = 1000; comm < 1060; comm++) pair_once(&w, (comm + round) % 2, comm, 1 + round);
  /* 60 comms, each dialed both ways: 240 descriptors in this process uncapped. */
  size_t links = dataplane_links(w.dp[0]) + dataplane_links(w.dp[1]);
  int grew = open_fds() - before;
  cr_assert(links <= 4 * 8 + 4, "%zu links kept", links);
  cr_assert(grew <= 4 * 8 + 8, "%d descriptors more after 120 transfers", grew);
  world_stop(&w);
}

/* The sender closes an idle link (past its cap) just after the receiver took
 * it for a call: the receiver reads the goodbye and waits for the sender to
 * dial again, instead of failing on the closed link. */
Test(dataplane, a_receiver_on_a_link_closed_idle_waits_for_the_next_dial, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 5000);
  dataplane_max_links(w.dp[0], 2);
  pair_once(&w, 0, 2000, 1); /* the link 0 -> 1 of comm 2000, kept */
  uint8_t got[64] = {0};
  p2p_job_t rx = {.w = &w, .me = 1, .peer = 0, .comm = 2000, .call = 2, .buf = got,
                  .bytes = sizeof got};
  pthread_t th;
  pthread_create(&th, NULL, p2p_main, &rx); /* takes the kept link and waits on it */
  usleep(200 * 1000);
  for (uint64_t comm = 2001; comm < 2004; comm++) pair_once(&w, 0, comm, 1); /* closes it */
  uint8_t a[64];
  for (size_t i = 0; i < sizeof a; i++) a[i] = (uint8_t)(2000 * 7 + i + 2);
  p2p_job_t tx = {.w = &w, .me = 0, .peer = 1, .comm = 2000, .call = 2, .send = true, .buf = a,
                  .bytes = sizeof a};
  p2p_main(&tx);
  pthread_join(th, NULL);
  cr_assert_eq(tx.rc, 0, "%s", tx.err.msg);
  cr_assert_eq(rx.rc, 0, "the receiver failed on the link closed idle: %s", rx.err.msg);
  cr_assert(memcmp(a, got, sizeof a) == 0);
  world_stop(&w);
}

/* A send that ended before its receiver read it (the bytes wait in the
 * link), then the sender closed that link idle (past its cap): the receiver
 * still gets them, and its next recv waits for the next dial. (Sweeping the
 * closed link, or the newer one replacing it, lost the bytes.) */
Test(dataplane, a_link_closed_idle_still_delivers_what_was_sent_on_it, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 5000);
  dataplane_max_links(w.dp[0], 2);
  pair_once(&w, 0, 3000, 1); /* the link 0 -> 1 of comm 3000 */
  uint8_t a[64], got[64] = {0};
  for (size_t i = 0; i < sizeof a; i++) a[i] = (uint8_t)(i * 3 + 1);
  p2p_job_t tx = {.w = &w, .me = 0, .peer = 1, .comm = 3000, .call = 2, .send = true, .buf = a,
                  .bytes = sizeof a};
  p2p_main(&tx); /* into the link's buffers: nobody reads yet */
  cr_assert_eq(tx.rc, 0, "%s", tx.err.msg);
  for (uint64_t comm = 3001; comm < 3005; comm++) pair_once(&w, 0, comm, 1); /* closes it */
  usleep(100 * 1000);
  p2p_job_t rx = {.w = &w, .me = 1, .peer = 0, .comm = 3000, .call = 2, .buf = got,
                  .bytes = sizeof got};
  p2p_main(&rx);
  cr_assert_eq(rx.rc, 0, "the bytes sent before the link was closed idle were lost: %s",
               rx.err.msg);
  cr_assert(memcmp(a, got, sizeof a) == 0);
  pair_once(&w, 0, 3000, 3);
  world_stop(&w);
}

/* Kept links, and a member late for call 2: its peer sent call 2's first
 * frames on the kept link, gave up (an abort after them, and a close), and
 * began call 3 on a new link. The late member's call 2 reads those frames
 * and the abort and fails; its failure must not reach the new link, or the
 * peer loses call 3 as well (it did when a failure closed every link of the
 * comm). Call 3 then succeeds on both. */
Test(dataplane, a_late_members_failure_spares_the_peers_next_call, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 400);
  size_t count = 64 << 10; /* 128 KiB a member: the ring */
  job_t jobs[2];
  sum_jobs(jobs, &w, 2, 88, 1, count, count);
  run_jobs(jobs, 2); /* call 1: the links are made, and kept */
  for (size_t r = 0; r < 2; r++) cr_assert_eq(jobs[r].rc, 0, "call 1: %s", jobs[r].err.msg);
  jobs[0].call = 2;
  fill(DTYPE_FLOAT32, RED_SUM, 0, jobs[0].in, count, 2000);
  job_main(&jobs[0]); /* member 1 is late: member 0 gives up */
  cr_assert_eq(jobs[0].rc, -1);
  pthread_t th;
  jobs[0].call = 3;
  fill(DTYPE_FLOAT32, RED_SUM, 0, jobs[0].in, count, 3000);
  pthread_create(&th, NULL, job_main, &jobs[0]);
  usleep(100 * 1000);
  jobs[1].call = 2; /* late */
  fill(DTYPE_FLOAT32, RED_SUM, 1, jobs[1].in, count, 2000);
  job_main(&jobs[1]);
  cr_assert_eq(jobs[1].rc, -1, "the late call 2 ran without its peer");
  jobs[1].call = 3;
  fill(DTYPE_FLOAT32, RED_SUM, 1, jobs[1].in, count, 3000);
  job_main(&jobs[1]);
  pthread_join(th, NULL);
  for (size_t r = 0; r < 2; r++) {
    cr_assert_eq(jobs[r].rc, 0, "call 3 on member %zu: %s", r, jobs[r].err.msg);
    expect_reduced(DTYPE_FLOAT32, RED_SUM, 2, jobs[r].in, count, 3000, "call 3");
    free(jobs[r].in);
  }
  world_stop(&w);
}

/* A peer failed call 2 while it waited to connect (the late member had not
 * come) and wrote its abort, first and alone, on a kept link to the late
 * member before closing it. The late member's call 2 must read that abort
 * and fail at once with its root cause, not take the link for a dead one and
 * wait out the timeout for a redial that never comes. */
Test(dataplane, a_late_member_reads_the_abort_left_alone_on_a_kept_link, .timeout = 60) {
  world_t w;
  world_start(&w, 2, 600);
  job_t jobs[2];
  sum_jobs(jobs, &w, 2, 66, 1, 5, 5);
  run_jobs(jobs, 2); /* call 1: the links are made, and kept */
  for (size_t r = 0; r < 2; r++) cr_assert_eq(jobs[r].rc, 0, "call 1: %s", jobs[r].err.msg);
  for (size_t r = 0; r < 2; r++) jobs[r].call = 2;
  job_main(&jobs[0]); /* alone: it waits for member 1's link, gives up, aborts */
  cr_assert_eq(jobs[0].rc, -1);
  job_main(&jobs[1]);
  cr_assert_eq(jobs[1].rc, -1);
  cr_assert(strstr(jobs[1].err.msg, "aborted"), "%s", jobs[1].err.msg);
  cr_assert(jobs[1].took_ms < 300, "the late call took %lld ms to fail: %s",
            (long long)jobs[1].took_ms, jobs[1].err.msg);
  for (size_t r = 0; r < 2; r++) free(jobs[r].in);
  world_stop(&w);
}

/* Three members. Member 0 is late for ring call 2; members 1 and 2 give up
 * and begin call 3 (a direct exchange), member 1 on the link to member 0 it
 * kept from call 1, not yet written. Member 0's call 2 then fails (its peer
 * aborted) and closes the untaken links of call 2 or older, that one
 * included. Member 1 must dial it again for call 3, not fail call 3 on an
 * older call's abort. Call 3 then succeeds on all three. */
Test(dataplane, a_link_closed_for_an_older_call_is_dialed_again_by_its_sender, .timeout = 60) {
  world_t w;
  world_start(&w, 3, 500);
  size_t small = 5, big = 3 * (64 << 10); /* direct; ring */
  job_t jobs[3];
  sum_jobs(jobs, &w, 3, 67, 1, small, big);
  run_jobs(jobs, 3); /* call 1, direct: every link made, and kept */
  for (size_t r = 0; r < 3; r++) cr_assert_eq(jobs[r].rc, 0, "call 1: %s", jobs[r].err.msg);
  for (size_t r = 1; r < 3; r++) {
    jobs[r].call = 2;
    jobs[r].count = big;
    fill(DTYPE_FLOAT32, RED_SUM, r, jobs[r].in, big, 2000);
  }
  run_jobs(jobs + 1, 2); /* call 2, the ring, without member 0 */
  for (size_t r = 1; r < 3; r++) cr_assert_eq(jobs[r].rc, -1, "call 2 ran without member 0");
  pthread_t th[3];
  for (size_t r = 1; r < 3; r++) {
    jobs[r].call = 3;
    jobs[r].count = small;
    fill(DTYPE_FLOAT32, RED_SUM, r, jobs[r].in, small, 3000);
    pthread_create(&th[r], NULL, job_main, &jobs[r]);
  }
  usleep(100 * 1000);
  jobs[0].call = 2; /* late */
  jobs[0].count = big;
  fill(DTYPE_FLOAT32, RED_SUM, 0, jobs[0].in, big, 2000);
  job_main(&jobs[0]);
  cr_assert_eq(jobs[0].rc, -1, "the late call 2 ran without its peers");
  int64_t late_ms = jobs[0].took_ms;
  char late_err[sizeof jobs[0].err.msg];
  snprintf(late_err, sizeof late_err, "%s", jobs[0].err.msg);
  jobs[0].call = 3;
  jobs[0].count = small;
  memset(&jobs[0].err, 0, sizeof jobs[0].err);
  fill(DTYPE_FLOAT32, RED_SUM, 0, jobs[0].in, small, 3000);
  job_main(&jobs[0]);
  for (size_t r = 1; r < 3; r++) pthread_join(th[r], NULL);
  for (size_t r = 0; r < 3; r++) {
    cr_assert_eq(jobs[r].rc, 0, "call 3 on member %zu: %s (the late call 2 failed in %lld ms: %s)",
                 r, jobs[r].err.msg, (long long)late_ms, late_err);
    expect_reduced(DTYPE_FLOAT32, RED_SUM, 3, jobs[r].in, small, 3000, "call 3");
    free(jobs[r].in);
  }
  world_stop(&w);
}

/* ------------------------------------------------------------ late members, at random */

/* A seeded chaos soak. Each member runs the same calls of one comm in order
 * on its own thread, as agents do (each call two data plane calls, as an
 * instruction makes them: a reduction and its failure flag, a broadcast's or
 * a send's header and body, the second only if the first succeeded), but
 * starts each call at once, a little late, or about or past the comm timeout
 * late, drawn per member and call. Whatever the timing, every result on every
 * member is a failure or exactly right: never a success with another call's
 * data. Then, nobody late, every call succeeds everywhere (the members caught
 * up), and a second comm running clean calls all along was never disturbed.
 * MESHD_SOAK_SEED=N replays a plan (the timing, of course, differs).
 *
 * With `lose`, the last member dies at a call drawn in the chaos: its data
 * plane shuts down before that call or some ms into it (its connections
 * close, as a killed agent's do), and each survivor is, or is not, told of
 * the loss (PeerLost, as the server tells agents). The survivors' next
 * calls fail within two comm timeouts or are exact (a send between two of
 * them); then, on a new comm of the survivors, every call succeeds, and the
 * bystander comm (the survivors') never noticed. */

typedef enum { SK_SMALL, SK_RING, SK_REDUCE, SK_BCAST, SK_SEND, SK_EXCHANGE, SK_KINDS } soak_kind_t;

static const char *const soak_kind_names[SK_KINDS] = {"allreduce", "ring allreduce", "reduce",
                                                      "broadcast", "send", "exchange"};

/* SK_EXCHANGE's collectives (soak_call_t.sub). */
static const char *const soak_exchange_names[4] = {"allgather", "reduce_scatter", "alltoall",
                                                   "gather to a root"};

typedef struct soak_call {
  soak_kind_t kind;
  size_t count;  /* int32 elements; bytes for a broadcast or a send */
  size_t root;   /* a reduce's root; a send's sender */
  size_t peer;   /* a send's receiver */
  int sub;       /* an exchange's collective (soak_exchange_names) */
  int delay_ms[MAXN];
} soak_call_t;

typedef struct soak_opts {
  size_t n, chaos; /* members; calls drawn at random before the clean ones */
  int timeout_ms;
  int late_pct;    /* draws about or past the timeout late, in percent */
  bool tcp;        /* TCP only (not the same-host socket and its memfds) */
  size_t max_links; /* dataplane_max_links; 0: the default */
  bool lose;        /* the last member dies in the chaos */
} soak_opts_t;

#define SOAK_AFTER_LOSS 3 /* the survivors' calls of the old comm after the loss */
/* The comm timeout of the calls nobody is late for (after the chaos, and
 * the bystander's): with the chaos's, 200 ms, a loaded machine's stall
 * failed them (the lose soak over TCP once in CI; locally a bystander's
 * allreduce whose peer started over 200 ms after it). Such a call still
 * fails the soak if it fails, or waits this long (a member that did not
 * catch up). */
#define SOAK_CLEAN_MS 10000

typedef struct soak {
  world_t *w;
  uint64_t seed, comm;
  const soak_call_t *calls;
  size_t nchaos, ncalls; /* calls [nchaos, ncalls) start at once, after the barrier */
  pthread_barrier_t barrier;
  /* lose: member n-1 dies at call lost_at, lost_after_ms into it (< 0: before
   * it); survivors with declare[r] are told; after the chaos the survivors
   * (the view ws) run the clean calls on comm 3. */
  world_t *ws;
  int timeout_ms;
  size_t lost_at;
  int lost_after_ms;
  bool declare[MAXN];
} soak_t;

typedef struct soak_member {
  soak_t *s;
  size_t me;
  world_t *w;    /* whose comm it calls on: everyone's, or the survivors' */
  uint64_t comm;
  size_t ok, failed, clean_failed;
  char wrong[800];     /* the first success with wrong data */
  char clean_err[800]; /* the first failure of a call after the chaos */
  char slow[800];      /* the first call after the loss that took too long to fail */
  char undead[800];    /* the first call after the loss that succeeded with the dead in it */
} soak_member_t;

static uint64_t soak_rand(uint64_t *state) { /* splitmix64 */
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static size_t soak_pick(uint64_t *state, size_t n) { return (size_t)(soak_rand(state) % n); }

/* Member r's element k in data plane call `no`: different from call to call,
 * so that a mix of two calls cannot pass for either; bounded, so that sums
 * are exact. */
static int32_t soak_val(uint64_t no, size_t r, size_t k) {
  uint64_t st = no * 1000003u + r * 7919u + k * 104729u;
  return (int32_t)(soak_rand(&st) % 2001) - 1000;
}

static uint8_t soak_byte(uint64_t no, size_t k) { return (uint8_t)soak_val(no, MAXN, k); }

static uint64_t soak_seed(void) {
  const char *env = getenv("MESHD_SOAK_SEED");
  if (env && *env) return strtoull(env, NULL, 0);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t st = (uint64_t)ts.tv_sec << 30 ^ (uint64_t)ts.tv_nsec ^ (uint64_t)getpid() << 45;
  return soak_rand(&st) % 1000000000; /* short enough to type */
}

/* How late a member starts a call: about as late as the timeout (its peers
 * give up on the call just as it comes) or past it (they gave up and moved
 * on), late_pct percent of the time, half each; else a little late (well
 * within the timeout) or at once. */
static int soak_delay(uint64_t *st, int timeout_ms, int late_pct) {
  int roll = (int)soak_pick(st, 100);
  if (roll < late_pct / 2) return timeout_ms - 25 + (int)soak_pick(st, 50);
  if (roll < late_pct) return timeout_ms + 30 + (int)soak_pick(st, (size_t)timeout_ms / 2);
  if (roll < late_pct + 25) return 1 + (int)soak_pick(st, (size_t)timeout_ms / 4);
  return 0;
}

/* A call of `kind` (SK_KINDS: any), its size, roots and (chaos) delays. */
static soak_call_t soak_draw(uint64_t *st, const soak_opts_t *o, soak_kind_t kind, bool chaos) {
  soak_call_t c = {.kind = kind < SK_KINDS ? kind : (soak_kind_t)soak_pick(st, SK_KINDS)};
  switch (c.kind) {
  case SK_SMALL: c.count = 1 + soak_pick(st, 4000); break; /* direct: under 64 KiB */
  case SK_RING: /* some of many frames, more than the sockets hold: failures leave some mid-way */
    c.count = (64 << 10) / 4 + 1 + soak_pick(st, soak_pick(st, 4) ? 30000 : 1000000);
    break;
  case SK_REDUCE: c.count = soak_pick(st, 2) ? 1009 : 20011; break; /* direct; ring, then root */
  case SK_BCAST: /* some of 1 MiB or more: one memfd on the same host */
    c.count = soak_pick(st, 4) ? 1 + soak_pick(st, 100000) : ((size_t)1 << 20) + 5;
    break;
  case SK_SEND: c.count = 1 + soak_pick(st, soak_pick(st, 4) ? 300000 : 5000000); break;
  case SK_EXCHANGE:
    c.count = soak_pick(st, 2) ? 1 + soak_pick(st, 2000) : 20011;
    c.sub = (int)soak_pick(st, 4);
    break;
  default: break;
  }
  c.root = soak_pick(st, o->n);
  c.peer = (c.root + 1 + soak_pick(st, o->n - 1)) % o->n;
  for (size_t r = 0; r < o->n; r++)
    c.delay_ms[r] = chaos ? soak_delay(st, o->timeout_ms, o->late_pct) : 0;
  return c;
}

/* Data plane call `no`, step `step` of call i (c), on member m: 0 or -1
 * (err), as the data plane returned it. A success whose data is not exactly
 * right is noted in m->wrong. Step 1 of a reduction is the agent's failure
 * flag (one element, the max over the members); step 0 of a broadcast or a
 * send is its 8-byte header. */
static int soak_step(soak_member_t *m, const soak_call_t *c, size_t i, uint64_t no, int step,
                     meshd_error_t *err) {
  world_t *w = m->w;
  size_t me = m->me, n = w->n;
  dp_group_t g = group(w, m->comm, me);
  g.call = no;
  g.timeout_ms = i >= m->s->nchaos ? SOAK_CLEAN_MS : 0; /* the chaos's: the data plane's */
  char wrong[200] = "";
  int rc;
  if (c->kind == SK_BCAST || c->kind == SK_SEND) {
    size_t bytes = step == 0 ? 8 : c->count;
    bool source = c->kind == SK_BCAST ? me == 0 : me == c->root;
    uint8_t *b = malloc(bytes + 1);
    for (size_t k = 0; k < bytes; k++) b[k] = source ? soak_byte(no, k) : 0xee;
    if (c->kind == SK_BCAST)
      rc = dp_broadcast(w->dp[me], &g, b, bytes, err);
    else
      rc = dp_p2p(w->dp[me], source, g.timeout_ms, g.comm_id, no, SECRET,
                  w->ranks[source ? c->peer : c->root], w->addrs[source ? c->peer : c->root], b,
                  bytes, err);
    for (size_t k = 0; rc == 0 && k < bytes && !*wrong; k++)
      if (b[k] != soak_byte(no, k))
        snprintf(wrong, sizeof wrong, "byte %zu of %zu = %u, expected %u", k, bytes, b[k],
                 soak_byte(no, k));
    free(b);
  } else if (c->kind == SK_EXCHANGE && step == 0) {
    /* Member r's input element k is soak_val(no, r, k); what each member gets
     * follows from the collective's definition (dataplane.h). */
    int x = c->sub;
    size_t cnt = c->count, root = c->root, inlen = x == 1 || x == 2 ? n * cnt : cnt;
    size_t outlen = x == 1 ? cnt : n * cnt;
    int32_t *in = malloc(inlen * 4), *out = malloc(outlen * 4);
    for (size_t k = 0; k < inlen; k++) in[k] = soak_val(no, me, k);
    for (size_t k = 0; k < outlen; k++) out[k] = INT32_MIN;
    rc = x == 0   ? dp_allgather(w->dp[me], &g, in, out, cnt, DTYPE_INT32, err)
         : x == 1 ? dp_reduce_scatter(w->dp[me], &g, in, out, cnt, DTYPE_INT32, RED_SUM, err)
         : x == 2 ? dp_alltoall(w->dp[me], &g, in, out, cnt, DTYPE_INT32, err)
                  : dp_gather_root(w->dp[me], &g, root, in, out, cnt, DTYPE_INT32, err);
    bool holds = x != 3 || me == root; /* the others' out is not touched */
    for (size_t k = 0; rc == 0 && holds && k < outlen && !*wrong; k++) {
      size_t i = k / cnt, j = k % cnt; /* out slice i, element j */
      int32_t want = 0;
      if (x == 1)
        for (size_t r = 0; r < n; r++) want += soak_val(no, r, me * cnt + k);
      else
        want = soak_val(no, i, x == 2 ? me * cnt + j : j);
      if (out[k] != want)
        snprintf(wrong, sizeof wrong, "%s: element %zu of %zu = %d, expected %d",
                 soak_exchange_names[x], k, outlen, out[k], want);
    }
    free(in);
    free(out);
  } else {
    bool flag = step == 1, rooted = c->kind == SK_REDUCE && !flag;
    size_t count = flag ? 1 : c->count;
    reduction_t op = flag ? RED_MAX : rooted ? RED_BXOR : RED_SUM;
    int32_t *v = malloc(count * 4);
    for (size_t k = 0; k < count; k++) v[k] = soak_val(no, me, k);
    rc = rooted ? dp_reduce_root(w->dp[me], &g, c->root, v, count, DTYPE_INT32, op, err)
                : dp_allreduce(w->dp[me], &g, v, count, DTYPE_INT32, op, err);
    bool holds = !rooted || me == c->root; /* the others' buffer is scratch */
    for (size_t k = 0; rc == 0 && holds && k < count && !*wrong; k++) {
      int32_t want = soak_val(no, 0, k);
      for (size_t r = 1; r < n; r++) {
        int32_t x = soak_val(no, r, k);
        want = op == RED_SUM ? want + x : op == RED_BXOR ? want ^ x : x > want ? x : want;
      }
      if (v[k] != want)
        snprintf(wrong, sizeof wrong, "element %zu of %zu = %d, expected %d", k, count, v[k], want);
    }
    free(v);
  }
  if (*wrong && !*m->wrong)
    snprintf(m->wrong, sizeof m->wrong,
             "seed %llu: call %zu (%s of %zu, data plane call %llu) succeeded on member %zu with "
             "wrong data: %s",
             (unsigned long long)m->s->seed, i, soak_kind_names[c->kind], c->count,
             (unsigned long long)no, me, wrong);
  return rc;
}

/* The death of member n-1 (lose): its data plane shuts down, as a killed
 * agent's connections close, then the survivors told of it hear PeerLost. */
static void soak_die(soak_t *s) {
  world_t *w = s->w;
  size_t dead = w->n - 1;
  dataplane_shutdown(w->dp[dead]);
  for (size_t r = 0; r < dead; r++)
    if (s->declare[r])
      dataplane_peer_lost(w->dp[r], w->addrs[dead], w->ranks[dead], "was lost (soak)");
}

static void *soak_killer_main(void *arg) {
  soak_t *s = arg;
  usleep((useconds_t)s->lost_after_ms * 1000);
  soak_die(s);
  return NULL;
}

static void *soak_member_main(void *arg) {
  soak_member_t *m = arg;
  soak_t *s = m->s;
  bool dying = s->ws && m->me == s->w->n - 1;
  for (size_t i = 0; i < s->ncalls; i++) {
    const soak_call_t *c = &s->calls[i];
    if (s->ws && i < s->nchaos && i >= s->lost_at + SOAK_AFTER_LOSS) continue; /* past the loss */
    if (i == s->nchaos) {
      pthread_barrier_wait(&s->barrier); /* everyone (alive) is past the chaos */
      if (s->ws) { /* the survivors' own comm from now on */
        m->w = s->ws;
        m->comm = 3;
      }
    }
    bool in_it = c->kind != SK_SEND || m->me == c->root || m->me == c->peer;
    pthread_t killer;
    if (dying && i == s->lost_at) {
      if (s->lost_after_ms < 0 || !in_it) {
        soak_die(s);
        return NULL;
      }
      pthread_create(&killer, NULL, soak_killer_main, s);
    }
    if (!in_it) continue; /* a send between two others */
    if (c->delay_ms[m->me] > 0) usleep((useconds_t)c->delay_ms[m->me] * 1000);
    uint64_t no = (i + 1) * 4; /* the server's Group.call times the agent's CALL_STEPS */
    meshd_error_t err = {0};
    int rc = 0;
    int64_t t0 = now_ms();
    for (int step = 0; step < 2 && rc == 0; step++)
      rc = soak_step(m, c, i, no + (uint64_t)step, step, &err);
    int64_t took = now_ms() - t0;
    if (dying && i == s->lost_at) { /* its last call: failed, or exact before the end */
      pthread_join(killer, NULL);
      return NULL;
    }
    /* After the loss, a call waiting on the dead member ends in bounded time:
     * each of its two steps within a connect deadline and an idle wait of a
     * comm timeout each, with slack for a loaded machine. */
    int bound = 4 * s->timeout_ms + 2000;
    if (s->ws && i >= s->lost_at && i < s->nchaos && rc != 0 && took > bound && !*m->slow)
      snprintf(m->slow, sizeof m->slow,
               "seed %llu: call %zu (%s of %zu), %zu after the loss, failed on member %zu after "
               "%lld ms (bound %d): %s",
               (unsigned long long)s->seed, i, soak_kind_names[c->kind], c->count, i - s->lost_at,
               m->me, (long long)took, bound, err.msg);
    /* A result made of the dead member's data cannot exist after its death:
     * a reduction's or an exchange's (step 1 of each, the failure flag, is an
     * allreduce), the bytes it sends. A broadcast from member 0, or a send to
     * the dead, may end well for a member that needs nothing of it. */
    size_t dead = s->w->n - 1;
    bool needs_dead = c->kind == SK_SMALL || c->kind == SK_RING || c->kind == SK_REDUCE ||
                      c->kind == SK_EXCHANGE || (c->kind == SK_SEND && c->root == dead);
    if (s->ws && i > s->lost_at && i < s->nchaos && rc == 0 && needs_dead && !*m->undead)
      snprintf(m->undead, sizeof m->undead,
               "seed %llu: call %zu (%s of %zu), after member %zu died, succeeded on member %zu "
               "with its data",
               (unsigned long long)s->seed, i, soak_kind_names[c->kind], c->count, s->w->n - 1,
               m->me);
    if (i < s->nchaos) {
      if (rc == 0) m->ok++;
      else m->failed++;
    } else if (rc != 0 && m->clean_failed++ == 0) {
      snprintf(m->clean_err, sizeof m->clean_err,
               "seed %llu: call %zu (%s of %zu), after the chaos, failed on member %zu: %s",
               (unsigned long long)s->seed, i, soak_kind_names[c->kind], c->count, m->me, err.msg);
    }
  }
  return NULL;
}

/* The bystander: calls on another comm of the same data planes, nobody late,
 * paced to span the soak. */
typedef struct soak_bystander {
  world_t *w;
  size_t me, calls;
  int pause_ms;
  char err[800];
} soak_bystander_t;

static void *soak_bystander_main(void *arg) {
  soak_bystander_t *b = arg;
  for (size_t i = 0; i < b->calls && !*b->err; i++) {
    size_t count = i % 3 == 2 ? 30011 : 1009; /* direct, direct, ring */
    uint64_t no = (i + 1) * 4;
    dp_group_t g = group(b->w, 2, b->me);
    g.call = no;
    g.timeout_ms = SOAK_CLEAN_MS;
    int32_t *v = malloc(count * 4);
    for (size_t k = 0; k < count; k++) v[k] = soak_val(no, b->me, k);
    meshd_error_t err = {0};
    if (dp_allreduce(b->w->dp[b->me], &g, v, count, DTYPE_INT32, RED_SUM, &err) != 0)
      snprintf(b->err, sizeof b->err, "call %zu failed on member %zu: %s", i, b->me, err.msg);
    for (size_t k = 0; k < count && !*b->err; k++) {
      int32_t want = 0;
      for (size_t r = 0; r < b->w->n; r++) want += soak_val(no, r, k);
      if (v[k] != want)
        snprintf(b->err, sizeof b->err, "call %zu on member %zu: element %zu = %d, expected %d",
                 i, b->me, k, v[k], want);
    }
    free(v);
    usleep((useconds_t)b->pause_ms * 1000);
  }
  return NULL;
}

/* Sanitized builds run several times slower, beside other sanitized suites on
 * 2 cores (a clean allgather once made no progress for 250 ms there): the
 * soaks' comm timeout, and the lateness drawn from it, doubles in them. */
#if defined(__SANITIZE_ADDRESS__)
#define SOAK_SCALE 2
#else
#define SOAK_SCALE 1
#endif

static void soak_case(soak_opts_t o) {
  o.timeout_ms *= SOAK_SCALE;
  const size_t n = o.n, nclean = 2 * SK_KINDS + 2; /* + 2: every exchange once */
  soak_t s = {.seed = soak_seed(), .comm = 1, .nchaos = o.chaos, .ncalls = o.chaos + nclean,
              .timeout_ms = o.timeout_ms, .lost_at = SIZE_MAX};
  fprintf(stderr, "late members soak, n=%zu%s: seed %llu (MESHD_SOAK_SEED=%llu replays it)\n", n,
          o.lose ? ", one lost" : "", (unsigned long long)s.seed, (unsigned long long)s.seed);
  soak_call_t calls[128];
  cr_assert_leq(s.ncalls, sizeof calls / sizeof calls[0]);
  uint64_t st = s.seed ^ n ^ (o.lose ? 0x1055 : 0);
  int late = 0, exchanges = 0;
  soak_opts_t survivors = o; /* lose: the clean calls are the survivors' */
  survivors.n = o.lose ? n - 1 : n;
  if (o.lose) {
    s.lost_at = o.chaos / 4 + soak_pick(&st, o.chaos / 4);
    s.lost_after_ms = soak_pick(&st, 3) ? (int)soak_pick(&st, (size_t)o.timeout_ms) : -1;
    for (size_t r = 0; r + 1 < n; r++) s.declare[r] = soak_pick(&st, 2);
    fprintf(stderr, "  member %zu dies at call %zu, %d ms into it\n", n - 1, s.lost_at,
            s.lost_after_ms);
  }
  for (size_t i = 0; i < s.ncalls; i++) {
    /* After the chaos, nobody late: every kind twice, and the exchanges' four
     * collectives each once. */
    bool chaos = i < s.nchaos;
    size_t j = i - s.nchaos;
    soak_kind_t kind = chaos ? SK_KINDS : j < 2 * SK_KINDS ? (soak_kind_t)(j % SK_KINDS) : SK_EXCHANGE;
    calls[i] = soak_draw(&st, chaos ? &o : &survivors, kind, chaos);
    if (!chaos && kind == SK_EXCHANGE) calls[i].sub = exchanges++ % 4;
    /* Late past the timeout, in a call that runs, as a member it involves
     * (not the lost member's calls after its loss, nor chaos calls after
     * SOAK_AFTER_LOSS, which are skipped): such a start fails a call, unless
     * its peers had nothing to wait for (a small send or broadcast delivered
     * into the socket), so three of them must fail one.
     * (Counting every start near the timeout, the check below failed on seed
     * 841794978: 15 such starts, none of them able to fail a call.) */
    for (size_t r = 0; r < n; r++) {
      bool runs = !chaos || !o.lose || (i < s.lost_at + SOAK_AFTER_LOSS && (r + 1 < n || i < s.lost_at));
      bool involved = calls[i].kind != SK_SEND || r == calls[i].root || r == calls[i].peer;
      late += runs && involved && calls[i].delay_ms[r] >= o.timeout_ms + 30;
    }
  }
  s.calls = calls;
  world_t w;
  world_start(&w, n, o.timeout_ms);
  for (size_t r = 0; r < n; r++) {
    if (o.tcp) dataplane_same_host(w.dp[r], false);
    if (o.max_links) dataplane_max_links(w.dp[r], o.max_links);
  }
  s.w = &w;
  world_t ws = w; /* the survivors: every member but the last */
  ws.n = n - 1;
  if (o.lose) s.ws = &ws;
  size_t alive = survivors.n;
  pthread_barrier_init(&s.barrier, NULL, (unsigned)alive);
  soak_member_t m[MAXN];
  soak_bystander_t by[MAXN] = {0};
  pthread_t th[2 * MAXN];
  int64_t t0 = now_ms();
  for (size_t r = 0; r < n; r++) {
    m[r] = (soak_member_t){.s = &s, .me = r, .w = &w, .comm = s.comm};
    by[r] = (soak_bystander_t){.w = o.lose ? &ws : &w, .me = r, .calls = o.chaos / 2,
                               .pause_ms = o.timeout_ms};
    pthread_create(&th[r], NULL, soak_member_main, &m[r]);
    if (r < alive) pthread_create(&th[n + r], NULL, soak_bystander_main, &by[r]);
  }
  for (size_t r = 0; r < n; r++) pthread_join(th[r], NULL);
  for (size_t r = 0; r < alive; r++) pthread_join(th[n + r], NULL);
  int64_t took = now_ms() - t0;
  pthread_barrier_destroy(&s.barrier);
  size_t ok = 0, failed = 0;
  uint64_t why[DP_ABORT_COUNT] = {0};
  for (size_t r = 0; r < n; r++) {
    cr_assert(!*m[r].wrong, "%s", m[r].wrong);
    cr_assert(!*m[r].slow, "%s", m[r].slow);
    cr_assert(!*m[r].undead, "%s", m[r].undead);
    cr_assert_eq(m[r].clean_failed, 0, "%s (and %zu more)", m[r].clean_err, m[r].clean_failed - 1);
    cr_assert(!*by[r].err, "seed %llu: the bystander comm: %s", (unsigned long long)s.seed,
              by[r].err);
    ok += m[r].ok;
    failed += m[r].failed;
    for (int k = 0; k < DP_ABORT_COUNT; k++) why[k] += dataplane_aborts(w.dp[r], (dp_abort_t)k);
    /* Members' own connections are never counted as strangers' (a dial that
     * gave up on the same-host socket went on over TCP past its deadline and
     * sent part of a hello: "malformed"; one that closes before its first
     * byte withdrew, which is no rejection). */
    cr_assert_eq(dataplane_rejected(w.dp[r], DP_REJECT_MALFORMED), 0,
                 "seed %llu: member %zu counted a member's connection as malformed",
                 (unsigned long long)s.seed, r);
  }
  fprintf(stderr,
          "late members soak, n=%zu: seed %llu: %d late starts; %zu calls ok, %zu failed, in %lld "
          "ms; aborts: %llu behind, %llu timeout, %llu peer_aborted, %llu agent_lost, %llu error\n",
          n, (unsigned long long)s.seed, late, ok, failed, (long long)took,
          (unsigned long long)why[DP_ABORT_BEHIND], (unsigned long long)why[DP_ABORT_TIMEOUT],
          (unsigned long long)why[DP_ABORT_PEER_ABORTED],
          (unsigned long long)why[DP_ABORT_AGENT_LOST], (unsigned long long)why[DP_ABORT_ERROR]);
  /* Not vacuous: the chaos made calls fail, and many still went through. */
  cr_assert(late < 3 || failed > 0, "seed %llu: %d late starts and no call failed",
            (unsigned long long)s.seed, late);
  cr_assert_geq(ok * 5, ok + failed, "seed %llu: only %zu of %zu results succeeded",
                (unsigned long long)s.seed, ok, ok + failed);
  world_stop(&w);
}

/* On the same-host sockets (memfd broadcasts among them). */
Test(dataplane, late_members_at_random_fail_or_are_exact_then_catch_up, .timeout = 60) {
  soak_case((soak_opts_t){.n = 3, .chaos = 80, .timeout_ms = 200, .late_pct = 25});
}

/* Over TCP, as between hosts, with few kept links (closed idle with
 * goodbyes between calls of the two comms). */
Test(dataplane, late_members_at_random_fail_or_are_exact_then_catch_up_tcp_n4, .timeout = 60) {
  soak_case((soak_opts_t){.n = 4, .chaos = 60, .timeout_ms = 200, .late_pct = 20, .tcp = true,
                          .max_links = 4});
}

/* A member dies mid-chaos (its data plane shuts down, before or during a
 * call); the survivors fail what waited on it, promptly, then run clean on a
 * comm of their own, and their bystander comm never noticed. */
Test(dataplane, a_member_lost_amid_late_members_fails_only_what_waits_on_it, .timeout = 60) {
  soak_case((soak_opts_t){.n = 4, .chaos = 40, .timeout_ms = 200, .late_pct = 10, .lose = true});
}

/* The same over TCP with few kept links, as between hosts. */
Test(dataplane, a_member_lost_amid_late_members_fails_only_what_waits_on_it_tcp, .timeout = 60) {
  soak_case((soak_opts_t){.n = 4, .chaos = 40, .timeout_ms = 200, .late_pct = 10, .lose = true,
                          .tcp = true, .max_links = 4});
}

/* ------------------------------------------------------------ many members */

#define MANY 80
/* The members' comm timeout: their dials wait this long for member 0. Its
 * wait for their hellos is bounded by half of it: 80 dialers on a loaded
 * 2-core machine (sanitized) may take seconds to arrive. */
#define MANY_TIMEOUT_MS 30000

typedef struct many_job {
  dataplane_t *dp;
  const uint32_t *ranks;
  const char *const *addrs;
  size_t me;
  size_t held;  /* member 0: hellos held proven when it joined */
  float in, *out;
  int rc;
  meshd_error_t err;
} many_job_t;

/* Hellos that reached member 0 so far: held, or closed as too many. */
static size_t many_arrived(dataplane_t *dp) {
  return dataplane_parked(dp, NULL) + (size_t)dataplane_rejected(dp, DP_REJECT_TOO_MANY_PENDING);
}

static void *many_main(void *arg) {
  many_job_t *j = arg;
  dp_group_t g = {.comm_id = 90, .call = 2, .ranks = j->ranks, .addrs = j->addrs, .n = MANY,
                  .me = j->me, .secret = SECRET};
  if (j->me == 0) { /* late: until every other member has dialed it (bounded, within their
                     * dials' MANY_TIMEOUT_MS) */
    int64_t until = now_ms() + MANY_TIMEOUT_MS / 2;
    while (many_arrived(j->dp) < MANY - 1 && now_ms() < until) usleep(2000);
    dataplane_parked(j->dp, &j->held);
  }
  j->rc = dp_gather_root(j->dp, &g, 0, &j->in, j->out, 1, DTYPE_FLOAT32, &j->err);
  return NULL;
}

/* More members than member 0's listener holds unproven connections (its cap
 * lowered to 64 here: the default, 1024, would take a thousand members) all
 * dial it for a gather while it is late. Each member gets in, and the gather
 * delivers; returns how many of their hellos member 0 closed as too many
 * (each one a redial). */
static uint64_t many_members_dial_a_late_root(bool expect) {
  static dataplane_t *dps[MANY];
  static uint32_t ranks[MANY];
  static char abuf[MANY][64];
  static const char *addrs[MANY];
  static many_job_t jobs[MANY];
  static float out[MANY];
  for (size_t i = 0; i < MANY; i++) {
    meshd_error_t e = {0};
    ranks[i] = 100 + (uint32_t)i;
    dps[i] = dataplane_start("127.0.0.1", ranks[i], MANY_TIMEOUT_MS, &e);
    cr_assert(dps[i], "%s", e.msg);
    snprintf(abuf[i], sizeof abuf[i], "127.0.0.1:%d", dataplane_port(dps[i]));
    addrs[i] = abuf[i];
  }
  dataplane_max_unproven(dps[0], 64);
  /* Members past the lowered cap: their dialers (80 threads, sanitized, on a
   * loaded machine) may answer the challenge later than the 100 ms a silent
   * socket is kept (a sanitized CI run closed members as silent after 188 ms):
   * 500 ms, the grace of a hello under way (and of every socket before), where
   * closing some is what is shown. Where none may be closed (expect), the cap's
   * first 64 sockets must only be read before any goes: 10 s for that, not a
   * loaded machine's 500 ms (a socket closed there would fail the test). */
  dataplane_silent_grace(dps[0], expect ? 10000 : 500);
  /* Member 0's instruction is queued before the others dial (its worker is busy). */
  dp_group_t g = {.comm_id = 90, .ranks = ranks, .addrs = addrs, .n = MANY, .secret = SECRET};
  if (expect) cr_assert_eq(dataplane_expect(dps[0], &g), 0);
  pthread_t th[MANY];
  memset(out, 0, sizeof out);
  for (size_t i = 0; i < MANY; i++) {
    jobs[i] = (many_job_t){.dp = dps[i], .ranks = ranks, .addrs = addrs, .me = i,
                           .in = (float)i, .out = out};
    pthread_create(&th[i], NULL, many_main, &jobs[i]);
  }
  for (size_t i = 0; i < MANY; i++) pthread_join(th[i], NULL);
  uint64_t crowded = dataplane_rejected(dps[0], DP_REJECT_TOO_MANY_PENDING);
  for (size_t i = 0; i < MANY; i++)
    cr_assert_eq(jobs[i].rc, 0, "member %zu: %s (%llu closed as too many)", i, jobs[i].err.msg,
                 (unsigned long long)crowded);
  for (size_t i = 0; i < MANY; i++) cr_assert_eq(out[i], (float)i, "slot %zu", i);
  cr_assert_eq(dataplane_parked(dps[0], NULL), 0, "hellos still held after the call");
  size_t held = jobs[0].held;
  for (size_t i = 0; i < MANY; i++) dataplane_stop(dps[i]);
  if (expect) cr_assert_eq(held, MANY - 1, "%zu hellos held proven before member 0 joined", held);
  else cr_assert_eq(held, 0);
  return crowded;
}

/* Its call not known ahead (the cap bounds what strangers hold, and these
 * hellos prove nothing yet): the oldest are closed as too many and their
 * dialers dial again until it starts. */
Test(dataplane, more_than_64_members_dialing_a_late_member_all_get_in, .timeout = 60) {
  uint64_t crowded = many_members_dial_a_late_root(false);
  cr_assert_gt(crowded, 0, "80 members, all held unproven?");
}

/* Its instruction queued here (dataplane_expect): their hellos are proven on
 * arrival and held apart from the cap, so none is closed and none redials. */
Test(dataplane, more_than_64_members_dialing_a_late_member_that_expects_them_are_all_held,
     .timeout = 60) {
  uint64_t crowded = many_members_dial_a_late_root(true);
  cr_assert_eq(crowded, 0, "%llu hellos of members closed as too many",
               (unsigned long long)crowded);
}
