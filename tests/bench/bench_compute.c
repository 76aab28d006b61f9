/* bench_compute: what cpu agents compute and move, each as a ratio to a
 * baseline measured by this program in the same run.
 *
 *   bench_compute [--seconds S] [--min-bytes A] [--max-bytes B] [--members 2,4]
 *                 [--broadcast-bytes B] [--broadcast-dests 2,4,8]
 *                 [--skip-kernels] [--skip-commands]
 *
 * Cases (one JSON line each on stdout; progress on stderr):
 *   loopback   bytes/s of one TCP connection on 127.0.0.1 (a writer and a
 *              reader thread, 4 MiB writes) — the baseline of allreduce;
 *   allreduce  N data planes in this process (one thread per member) on
 *              127.0.0.1, float32 sum in place, 1 KiB .. 256 MiB per member;
 *              busbw = 2(N-1)/N * bytes / time (NCCL's definition), ratio to
 *              loopback;
 *   broadcast  to_mesh's broadcast on the data plane: --broadcast-bytes (64 MiB;
 *              0 skips it) from one source to 2, 4 and 8 destinations down the
 *              chain (dp_broadcast), and the source sending to each in turn
 *              (star), each as a ratio to one point-to-point copy of the same
 *              bytes (a chain of one destination), best of ROUNDS alternating
 *              rounds. As agents on one host run it (same-host links: one
 *              memfd mapped by every destination; buffers are private
 *              mappings, as the cpu backend's tensors of 4 MiB and more), and
 *              with TCP links only (chain_tcp, p2p_tcp: agents on separate
 *              hosts, all of them on this machine's cores);
 *   memcpy     GB/s of memcpy of 64 Mi float32, counting read + write bytes;
 *   add        GB/s of add(a, b) on 64 Mi float32 through cpu_backend_ops.run_op,
 *              counting 3 * n * 4 bytes (two reads, one write), ratio to memcpy;
 *   sgemm      GFLOP/s of cblas_sgemm 1024 x 1024 float32 called directly;
 *   mm         GFLOP/s of op "mm" on the same sizes through run_op, ratio to sgemm;
 *   commands   end-to-end pipelined tiny-op commands/s: this program runs
 *              bench_commands (next to it) with --live-tensors 0, whose lines
 *              (its rpc baseline, then one per agent count) pass through to
 *              stdout; --skip-commands leaves it out.
 *
 * Every case runs ROUNDS timed rounds after a warm-up and reports its best round
 * (the least disturbed by other load); a kernel and its baseline alternate
 * round by round, so that a change of load hits both. --seconds: target time of
 * one round (default 0.5; at least 2 iterations per round); --min-bytes,
 * --max-bytes: the allreduce sizes run (1 KiB .. 256 MiB); --members: the group
 * sizes (2..4); --skip-kernels: no add / mm cases. Not a test: run by hand, on an otherwise idle
 * machine (cpu_util fields show how many cores this process kept busy). */
#include <arpa/inet.h>
#include <cblas.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "bench_util.h"
#include "dataplane/dataplane.h"
#include "layout.h"
#include "ops.h"

#define MIB ((size_t)1 << 20)

#define ROUNDS 3

static double g_seconds = 0.5;

static void json_numf(bench_json_t *j, const char *key, double value, int prec) {
  if (j->len >= sizeof j->buf) return;
  size_t room = sizeof j->buf - j->len;
  int n = isfinite(value) ? snprintf(j->buf + j->len, room, ",\"%s\":%.*f", key, prec, value)
                          : snprintf(j->buf + j->len, room, ",\"%s\":null", key);
  j->len += n > 0 ? (size_t)n : 0;
}

/* CPU time (user + system) of this process so far, in seconds. */
static double cpu_seconds(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static void die(const char *what) {
  fprintf(stderr, "bench_compute: %s: %s\n", what, strerror(errno));
  exit(1);
}

/* Iterations so that `iters` of `one_s` seconds take about g_seconds; >= 2. */
static int iters_for(double one_s, int max) {
  double n = one_s > 0 ? g_seconds / one_s : max;
  if (n < 2) n = 2;
  if (n > max) n = max;
  return (int)n;
}

/* ------------------------------------------------------------------ loopback */

#define LB_CHUNK (4 * MIB)

typedef struct {
  int fd;
  double seconds;
  uint64_t bytes;
  int64_t t0, t1;
} lb_t;

static void *lb_writer(void *p) {
  lb_t *l = p;
  char *buf = malloc(LB_CHUNK);
  memset(buf, 0x5a, LB_CHUNK);
  int64_t end = bench_now_ns() + (int64_t)(l->seconds * 1e9);
  while (bench_now_ns() < end) {
    size_t off = 0;
    while (off < LB_CHUNK) {
      ssize_t n = write(l->fd, buf + off, LB_CHUNK - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) die("loopback write");
      off += (size_t)n;
    }
  }
  shutdown(l->fd, SHUT_WR);
  free(buf);
  return NULL;
}

static void *lb_reader(void *p) {
  lb_t *l = p;
  char *buf = malloc(LB_CHUNK);
  int64_t warm_end = 0;
  for (;;) {
    ssize_t n = read(l->fd, buf, LB_CHUNK);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die("loopback read");
    int64_t now = bench_now_ns();
    if (n == 0) {
      l->t1 = now;
      break;
    }
    if (!warm_end) warm_end = now + 200000000; /* 0.2 s unmeasured */
    if (!l->t0 && now >= warm_end) l->t0 = now;
    else if (l->t0) l->bytes += (uint64_t)n;
  }
  free(buf);
  return NULL;
}

/* One connection, g_seconds of data; bytes/s, and the cores busy in *util. */
static double loopback_round(double *util) {
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof a;
  if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1) ||
      getsockname(ls, (struct sockaddr *)&a, &alen))
    die("loopback listen");
  int c = socket(AF_INET, SOCK_STREAM, 0);
  if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof a)) die("loopback connect");
  int s = accept(ls, NULL, NULL);
  if (s < 0) die("loopback accept");
  close(ls);
  int one = 1;
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  lb_t w = {.fd = c, .seconds = g_seconds + 0.2}, r = {.fd = s};
  pthread_t tw, tr;
  int64_t t0 = bench_now_ns();
  double c0 = cpu_seconds();
  pthread_create(&tr, NULL, lb_reader, &r);
  pthread_create(&tw, NULL, lb_writer, &w);
  pthread_join(tw, NULL);
  pthread_join(tr, NULL);
  close(c);
  close(s);
  *util = (cpu_seconds() - c0) / ((double)(bench_now_ns() - t0) / 1e9);
  return (double)r.bytes / ((double)(r.t1 - r.t0) / 1e9);
}

static double loopback_case(void) {
  double bps = 0, util = NAN;
  for (int i = 0; i < ROUNDS; i++) {
    double u, b = loopback_round(&u);
    if (b > bps) bps = b, util = u;
  }
  bench_json_t j;
  bench_json_begin(&j, "loopback_tcp");
  bench_json_num(&j, "write_bytes", (double)LB_CHUNK);
  bench_json_num(&j, "rounds", ROUNDS);
  json_numf(&j, "round_seconds", g_seconds, 2);
  json_numf(&j, "bytes_per_s", bps, 0);
  json_numf(&j, "gb_per_s", bps / 1e9, 3);
  json_numf(&j, "cpu_util", util, 2);
  bench_json_end(&j, stdout);
  return bps;
}

/* ------------------------------------------------------------------ allreduce */

#define MAXN 9 /* a broadcast's source and 8 destinations */

typedef struct {
  size_t n;
  dataplane_t *dp[MAXN];
  uint32_t ranks[MAXN];
  char addr_buf[MAXN][64];
  const char *addrs[MAXN];
  pthread_barrier_t bar; /* members + main */
} world_t;

typedef struct {
  world_t *w;
  size_t me;
  uint64_t comm;
  float *buf;
  size_t count;
  int warm, iters;
  int rc;
  bool checked;
  meshd_error_t err;
} member_t;

static void *member_main(void *p) {
  member_t *m = p;
  static const uint8_t secret[DP_SECRET_LEN] = "bench_compute group secret.....";
  dp_group_t g = {.comm_id = m->comm, .ranks = m->w->ranks, .addrs = m->w->addrs, .n = m->w->n,
                  .me = m->me, .secret = secret};
  for (size_t i = 0; i < m->count; i++) m->buf[i] = (float)(m->me + 1);
  for (int i = 0; i < m->warm && m->rc == 0; i++) {
    m->rc = dp_allreduce(m->w->dp[m->me], &g, m->buf, m->count, DTYPE_FLOAT32, RED_SUM, &m->err);
    if (i == 0 && m->rc == 0 && m->count) { /* the first result is known */
      float want = (float)(m->w->n * (m->w->n + 1) / 2);
      m->checked = m->buf[0] == want && m->buf[m->count - 1] == want &&
                   m->buf[m->count / 2] == want;
      memset(m->buf, 0, m->count * sizeof(float)); /* keep sums finite */
    }
  }
  pthread_barrier_wait(&m->w->bar);
  for (int i = 0; i < m->iters && m->rc == 0; i++)
    m->rc = dp_allreduce(m->w->dp[m->me], &g, m->buf, m->count, DTYPE_FLOAT32, RED_SUM, &m->err);
  pthread_barrier_wait(&m->w->bar);
  return NULL;
}

/* One timed round: warm + iters allreduces on every member; seconds per call. */
static double allreduce_round(world_t *w, member_t *ms, uint64_t comm, size_t count, int warm,
                              int iters, double *cpu_util, bool *ok, char *err, size_t errlen) {
  pthread_t th[MAXN];
  for (size_t r = 0; r < w->n; r++) {
    ms[r].w = w;
    ms[r].me = r;
    ms[r].comm = comm;
    ms[r].count = count;
    ms[r].warm = warm;
    ms[r].iters = iters;
    ms[r].rc = 0;
    ms[r].checked = warm == 0;
    pthread_create(&th[r], NULL, member_main, &ms[r]);
  }
  pthread_barrier_wait(&w->bar);
  int64_t t0 = bench_now_ns();
  double c0 = cpu_seconds();
  pthread_barrier_wait(&w->bar);
  int64_t t1 = bench_now_ns();
  if (cpu_util) *cpu_util = (cpu_seconds() - c0) / ((double)(t1 - t0) / 1e9);
  *ok = true;
  for (size_t r = 0; r < w->n; r++) {
    pthread_join(th[r], NULL);
    if (ms[r].rc != 0) {
      *ok = false;
      snprintf(err, errlen, "member %zu: %s", r, ms[r].err.msg);
    } else if (!ms[r].checked) {
      *ok = false;
      snprintf(err, errlen, "member %zu: wrong sum", r);
    }
  }
  return (double)(t1 - t0) / 1e9 / iters;
}

/* n data planes on 127.0.0.1, ranks 0..n-1: 0, or -1 (said on stderr). */
static int world_start(world_t *w, size_t n) {
  memset(w, 0, sizeof *w);
  w->n = n;
  for (size_t i = 0; i < n; i++) {
    meshd_error_t e = {0};
    w->ranks[i] = (uint32_t)i;
    w->dp[i] = dataplane_start("127.0.0.1", w->ranks[i], 30000, &e);
    if (!w->dp[i]) {
      fprintf(stderr, "bench_compute: dataplane_start: %s\n", e.msg);
      return -1;
    }
    snprintf(w->addr_buf[i], sizeof w->addr_buf[i], "127.0.0.1:%d", dataplane_port(w->dp[i]));
    w->addrs[i] = w->addr_buf[i];
  }
  return 0;
}

static int allreduce_cases(size_t n, size_t min_bytes, size_t max_bytes, double loopback_bps) {
  world_t w;
  if (world_start(&w, n) != 0) return -1;
  pthread_barrier_init(&w.bar, NULL, (unsigned)n + 1);
  member_t ms[MAXN];
  memset(ms, 0, sizeof ms);
  int rc = 0;
  uint64_t comm = 1000 * n;
  static const size_t sizes[] = {1024, 64 * 1024, MIB, 16 * MIB, 256 * MIB};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0] && sizes[s] <= max_bytes; s++) {
    size_t bytes = sizes[s], count = bytes / sizeof(float);
    if (bytes < min_bytes) continue;
    for (size_t r = 0; r < n; r++) {
      ms[r].buf = malloc(bytes);
      if (!ms[r].buf) die("malloc");
    }
    bool ok;
    char err[512] = "";
    /* a probe (which also checks the sum), then ROUNDS rounds of about g_seconds */
    double util = NAN;
    double probe = allreduce_round(&w, ms, comm++, count, 1, 1, NULL, &ok, err, sizeof err);
    int iters = iters_for(probe, 10000);
    double per = INFINITY;
    for (int k = 0; k < ROUNDS && ok; k++) {
      double u, t = allreduce_round(&w, ms, comm++, count, 0, iters, &u, &ok, err, sizeof err);
      if (t < per) per = t, util = u;
    }
    if (!ok) per = NAN;
    double algbw = (double)bytes / per;
    double busbw = algbw * 2.0 * (double)(n - 1) / (double)n;
    bench_json_t j;
    bench_json_begin(&j, "allreduce");
    bench_json_num(&j, "members", (double)n);
    bench_json_str(&j, "dtype", "float32");
    bench_json_num(&j, "bytes", (double)bytes);
    bench_json_num(&j, "iters_per_round", iters);
    bench_json_num(&j, "rounds", ROUNDS);
    json_numf(&j, "us_per_call", per * 1e6, 1);
    json_numf(&j, "algbw_gb_per_s", algbw / 1e9, 3);
    json_numf(&j, "busbw_gb_per_s", busbw / 1e9, 3);
    json_numf(&j, "loopback_gb_per_s", loopback_bps / 1e9, 3);
    json_numf(&j, "ratio_busbw_to_loopback", busbw / loopback_bps, 3);
    json_numf(&j, "cpu_util", util, 2); /* cores busy in this process while timed */
    bench_json_str(&j, "status", ok ? "ok" : "failed");
    if (!ok) bench_json_str(&j, "error", err);
    bench_json_end(&j, stdout);
    if (!ok) rc = -1;
    for (size_t r = 0; r < n; r++) free(ms[r].buf);
  }
  pthread_barrier_destroy(&w.bar);
  for (size_t i = 0; i < n; i++) dataplane_stop(w.dp[i]);
  return rc;
}

/* ------------------------------------------------------------------ broadcast */

typedef struct {
  world_t *w;
  size_t me, n; /* members 0..n-1 of w take part; 0 is the source */
  bool star;    /* the source sends to each in turn, instead of the chain */
  uint64_t comm;
  uint8_t *buf;
  size_t bytes;
  int rc;
  meshd_error_t err;
} bmember_t;

static void *bmember_main(void *p) {
  bmember_t *m = p;
  static const uint8_t secret[DP_SECRET_LEN] = "bench_compute group secret.....";
  world_t *w = m->w;
  if (!m->star) {
    dp_group_t g = {.comm_id = m->comm, .ranks = w->ranks, .addrs = w->addrs, .n = m->n,
                    .me = m->me, .secret = secret, .mappable = true};
    m->rc = dp_broadcast(w->dp[m->me], &g, m->buf, m->bytes, &m->err);
  } else if (m->me == 0) {
    for (size_t j = 1; j < m->n && m->rc == 0; j++)
      m->rc = dp_send(w->dp[0], m->comm, 0, secret, w->ranks[j], w->addrs[j], m->buf, m->bytes,
                      &m->err);
  } else {
    m->rc = dp_recv(w->dp[m->me], m->comm, 0, secret, w->ranks[0], w->addrs[0], m->buf, m->bytes,
                    &m->err);
  }
  return NULL;
}

/* A destination's buffer as a fresh tensor's (to_mesh allocates its result):
 * new zero pages, on 2 MiB ones where the kernel allows (the cpu backend
 * advises that for tensors of 4 MiB and more). */
static int fresh_buffer(uint8_t *buf, size_t bytes) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), span = (bytes + page - 1) / page * page;
  if (span && mmap(buf, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
                   0) == MAP_FAILED)
    return -1;
  if (span) (void)madvise(buf, span, MADV_HUGEPAGE);
  return 0;
}

/* One broadcast of `bytes` from member 0 to members 1..n-1: seconds, and
 * whether every destination got the source's bytes. */
static double broadcast_round(world_t *w, bmember_t *ms, size_t n, bool star, bool same_host,
                              uint64_t comm, size_t bytes, bool *ok, char *err, size_t errlen) {
  pthread_t th[MAXN];
  for (size_t r = 0; r < n; r++) dataplane_same_host(w->dp[r], same_host);
  for (size_t r = 0; r < n; r++) {
    ms[r].w = w, ms[r].me = r, ms[r].n = n, ms[r].star = star, ms[r].comm = comm;
    ms[r].bytes = bytes, ms[r].rc = 0;
    if (r > 0 && fresh_buffer(ms[r].buf, bytes) != 0) die("mmap");
  }
  int64_t t0 = bench_now_ns();
  for (size_t r = 0; r < n; r++) pthread_create(&th[r], NULL, bmember_main, &ms[r]);
  for (size_t r = 0; r < n; r++) pthread_join(th[r], NULL);
  int64_t t1 = bench_now_ns();
  *ok = true;
  for (size_t r = 0; r < n && *ok; r++) {
    if (ms[r].rc != 0) {
      *ok = false;
      snprintf(err, errlen, "member %zu: %.400s", r, ms[r].err.msg);
    } else if (r > 0 && memcmp(ms[r].buf, ms[0].buf, bytes) != 0) {
      *ok = false;
      snprintf(err, errlen, "member %zu: wrong bytes", r);
    }
  }
  return (double)(t1 - t0) / 1e9;
}

/* to_mesh's broadcast on the data plane: `bytes` from one source to each of
 * dests[i] destinations down the chain (dp_broadcast), and the old way (the
 * source sends to each in turn), each as a ratio to one point-to-point copy of
 * the same bytes (a chain of one destination), rounds alternating. */
static int broadcast_cases(size_t bytes, const size_t *dests, int ndests) {
  world_t w;
  size_t most = 2;
  for (int i = 0; i < ndests; i++) most = dests[i] + 1 > most ? dests[i] + 1 : most;
  if (world_start(&w, most) != 0) return -1;
  bmember_t ms[MAXN];
  memset(ms, 0, sizeof ms);
  /* As the cpu backend holds a tensor of 4 MiB or more: a private mapping on
   * 2 MiB boundaries, advised onto huge pages. */
  size_t huge = (size_t)2 << 20, span = (bytes ? bytes : 1) + huge;
  uint8_t *base[MAXN];
  for (size_t r = 0; r < most; r++) {
    base[r] = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base[r] == MAP_FAILED) die("mmap");
    ms[r].buf = (uint8_t *)(((uintptr_t)base[r] + huge - 1) & ~(uintptr_t)(huge - 1));
    (void)madvise(ms[r].buf, span - huge, MADV_HUGEPAGE);
  }
  for (size_t i = 0; i < bytes; i++) ms[0].buf[i] = (uint8_t)(i * 131 + 17);
  int rc = 0;
  uint64_t comm = 90000;
  for (int d = 0; d < ndests; d++) {
    size_t k = dests[d];
    /* p2p, chain, star on same-host links; p2p and chain on TCP ones. */
    double best[5] = {INFINITY, INFINITY, INFINITY, INFINITY, INFINITY};
    const size_t members[5] = {2, k + 1, k + 1, 2, k + 1};
    const bool stars[5] = {false, false, true, false, false}, local[5] = {1, 1, 1, 0, 0};
    bool ok = true;
    char err[512] = "";
    for (int round = 0; round <= ROUNDS && ok; round++) /* round 0: warm-up */
      for (int c = 0; c < 5 && ok; c++) {
        double t = broadcast_round(&w, ms, members[c], stars[c], local[c], comm++, bytes, &ok, err,
                                   sizeof err);
        if (round && t < best[c]) best[c] = t;
      }
    double p2p = best[0], chain = best[1], star = best[2], p2p_tcp = best[3], chain_tcp = best[4];
    uint64_t mapped = 0, shm = dataplane_shm_received(w.dp[1], &mapped);
    bench_json_t j;
    bench_json_begin(&j, "broadcast");
    bench_json_num(&j, "destinations", (double)k);
    bench_json_num(&j, "bytes", (double)bytes);
    bench_json_num(&j, "rounds", ROUNDS);
    json_numf(&j, "p2p_ms", p2p * 1e3, 2);
    json_numf(&j, "chain_ms", chain * 1e3, 2);
    json_numf(&j, "star_ms", star * 1e3, 2);
    json_numf(&j, "chain_ratio_to_p2p", chain / p2p, 3);
    json_numf(&j, "star_ratio_to_p2p", star / p2p, 3);
    json_numf(&j, "p2p_tcp_ms", p2p_tcp * 1e3, 2);
    json_numf(&j, "chain_tcp_ms", chain_tcp * 1e3, 2);
    json_numf(&j, "chain_tcp_ratio_to_p2p_tcp", chain_tcp / p2p_tcp, 3);
    /* Member 1 took part in every round: how many came as shared memory, mapped. */
    json_numf(&j, "member1_shm_received", (double)shm, 0);
    json_numf(&j, "member1_shm_mapped", (double)mapped, 0);
    json_numf(&j, "cpu_cores", (double)sysconf(_SC_NPROCESSORS_ONLN), 0);
    bench_json_str(&j, "status", ok ? "ok" : "failed");
    if (!ok) bench_json_str(&j, "error", err);
    bench_json_end(&j, stdout);
    if (!ok) rc = -1;
  }
  for (size_t r = 0; r < most; r++) munmap(base[r], span);
  for (size_t i = 0; i < most; i++) dataplane_stop(w.dp[i]);
  return rc;
}

/* ------------------------------------------------------------------ kernels */

static backend_t B;

static agent_tensor_t *tensor_new(int nd, const int64_t *sizes) {
  agent_tensor_t *t = calloc(1, sizeof *t);
  meshd_error_t e;
  t->meta.dtype = DTYPE_FLOAT32;
  if (layout_contiguous(&t->meta.layout, sizes, nd, sizeof(float), "bench", &e) != 0) {
    fprintf(stderr, "bench_compute: layout: %s\n", e.msg);
    exit(1);
  }
  agent_storage_t *s = calloc(1, sizeof *s);
  atomic_init(&s->refs, 1);
  s->backend = &B;
  s->bytes = (size_t)layout_numel(&t->meta.layout) * sizeof(float);
  s->data = cpu_backend_ops.alloc(&B, NULL, s->bytes);
  if (!s->data) die("backend alloc");
  t->storage = s;
  return t;
}

static void tensor_free(agent_tensor_t *t) {
  cpu_backend_ops.free(&B, t->storage->data, t->storage->bytes);
  free(t->storage);
  free(t);
}

/* A bound, inferred op on two tensors, its result preallocated in `out`. */
typedef struct {
  op_args_t a;
  op_infer_t inf;
  agent_tensor_t *out;
} bound_t;

static void bind2(bound_t *b, const char *name, agent_tensor_t *x, agent_tensor_t *y) {
  meshd_error_t e = {0};
  const op_def_t *op = ops_find(name);
  op_value_t args[2] = {{.kind = VAL_TENSOR, .tensor = &x->meta},
                        {.kind = VAL_TENSOR, .tensor = &y->meta}};
  if (!op || ops_bind(op, args, 2, NULL, 0, &b->a, &e) || ops_infer(&b->a, &b->inf, &e)) {
    fprintf(stderr, "bench_compute: %s: %s\n", name, op ? e.msg : "unknown op");
    exit(1);
  }
  const tensor_meta_t *m = &b->inf.results[0].meta;
  b->out = tensor_new(m->layout.ndim, m->layout.sizes);
}

static void run_bound(bound_t *b) {
  meshd_error_t e = {0};
  agent_tensor_t *res[1] = {b->out};
  if (cpu_backend_ops.run_op(&B, NULL, &b->a, res, 1, &b->inf, 0, 0, &e) != 0) {
    fprintf(stderr, "bench_compute: run_op %s: %s\n", op_name(b->a.op), e.msg);
    exit(1);
  }
}

static void fill(agent_tensor_t *t, float base) {
  float *f = t->storage->data;
  size_t n = t->storage->bytes / sizeof(float);
  for (size_t i = 0; i < n; i++) f[i] = base + (float)(i % 97) * 0.25f;
}

/* A baseline and the kernel it judges, timed alternately: after one warm call
 * of each, ROUNDS rounds of `iters` calls of the baseline then of the kernel;
 * the best seconds per call of each. */
typedef struct {
  void (*fn)(void *ctx);
  void *ctx;
  int iters;
  double best_s;
} timed_t;

static double time_calls(timed_t *t, int n) {
  int64_t t0 = bench_now_ns();
  for (int i = 0; i < n; i++) t->fn(t->ctx);
  return (double)(bench_now_ns() - t0) / 1e9;
}

static void time_pair(timed_t *base, timed_t *kernel) {
  timed_t *both[2] = {base, kernel};
  for (int k = 0; k < 2; k++) {
    time_calls(both[k], 1); /* warm: faults pages in */
    both[k]->iters = iters_for(time_calls(both[k], 1), 10000);
    both[k]->best_s = INFINITY;
  }
  for (int r = 0; r < ROUNDS; r++)
    for (int k = 0; k < 2; k++) {
      double per = time_calls(both[k], both[k]->iters) / both[k]->iters;
      if (per < both[k]->best_s) both[k]->best_s = per;
    }
}

typedef struct {
  void *dst;
  const void *src;
  size_t bytes;
} copy_ctx_t;

static void do_memcpy(void *p) {
  copy_ctx_t *c = p;
  memcpy(c->dst, c->src, c->bytes);
}

static void do_bound(void *p) { run_bound(p); }

#define ADD_N ((int64_t)64 << 20)

static void elementwise_cases(void) {
  agent_tensor_t *x = tensor_new(1, (const int64_t[]){ADD_N});
  agent_tensor_t *y = tensor_new(1, (const int64_t[]){ADD_N});
  agent_tensor_t *z = tensor_new(1, (const int64_t[]){ADD_N}); /* memcpy's destination */
  fill(x, 1);
  fill(y, 2);
  size_t bytes = (size_t)ADD_N * sizeof(float);
  bound_t b;
  bind2(&b, "add", x, y);
  copy_ctx_t cc = {z->storage->data, x->storage->data, bytes};
  timed_t base = {.fn = do_memcpy, .ctx = &cc}, kern = {.fn = do_bound, .ctx = &b};
  time_pair(&base, &kern);

  /* memcpy moves 2 * bytes (read + write); add 3 * bytes (two reads, one write) */
  double memcpy_gbs = 2.0 * (double)bytes / base.best_s / 1e9;
  double add_gbs = 3.0 * (double)bytes / kern.best_s / 1e9;
  const float *o = b.out->storage->data, *xf = x->storage->data, *yf = y->storage->data;
  bool ok = o[0] == xf[0] + yf[0] && o[ADD_N - 1] == xf[ADD_N - 1] + yf[ADD_N - 1] &&
            o[ADD_N / 2 + 5] == xf[ADD_N / 2 + 5] + yf[ADD_N / 2 + 5];
  bench_json_t j;
  bench_json_begin(&j, "memcpy");
  bench_json_num(&j, "bytes_copied", (double)bytes);
  bench_json_num(&j, "iters_per_round", base.iters);
  bench_json_num(&j, "rounds", ROUNDS);
  json_numf(&j, "ms_per_call", base.best_s * 1e3, 3);
  json_numf(&j, "gb_per_s_read_plus_write", memcpy_gbs, 3);
  bench_json_end(&j, stdout);
  bench_json_begin(&j, "add");
  bench_json_str(&j, "dtype", "float32");
  bench_json_num(&j, "elements", (double)ADD_N);
  bench_json_num(&j, "iters_per_round", kern.iters);
  bench_json_num(&j, "rounds", ROUNDS);
  json_numf(&j, "ms_per_call", kern.best_s * 1e3, 3);
  json_numf(&j, "gb_per_s", add_gbs, 3);
  json_numf(&j, "memcpy_gb_per_s", memcpy_gbs, 3);
  json_numf(&j, "ratio_to_memcpy", add_gbs / memcpy_gbs, 3);
  json_numf(&j, "elements_per_s", (double)ADD_N / kern.best_s, 0);
  bench_json_str(&j, "status", ok ? "ok" : "wrong result");
  bench_json_end(&j, stdout);
  tensor_free(b.out);
  tensor_free(x);
  tensor_free(y);
  tensor_free(z);
}

#define MM_N 1024

typedef struct {
  const float *a, *b;
  float *c;
} gemm_ctx_t;

static void do_sgemm(void *p) {
  gemm_ctx_t *g = p;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, MM_N, MM_N, MM_N, 1.0f, g->a, MM_N, g->b,
              MM_N, 0.0f, g->c, MM_N);
}

static void matmul_cases(void) {
  const int64_t sz[2] = {MM_N, MM_N};
  agent_tensor_t *x = tensor_new(2, sz), *y = tensor_new(2, sz), *c = tensor_new(2, sz);
  fill(x, 0.5f);
  fill(y, -0.25f);
  double flop = 2.0 * MM_N * MM_N * MM_N;
  bound_t b;
  bind2(&b, "mm", x, y);
  gemm_ctx_t g = {x->storage->data, y->storage->data, c->storage->data};
  timed_t base = {.fn = do_sgemm, .ctx = &g}, kern = {.fn = do_bound, .ctx = &b};
  time_pair(&base, &kern);
  double sgemm_gf = flop / base.best_s / 1e9, mm_gf = flop / kern.best_s / 1e9;
  bool ok = memcmp(b.out->storage->data, c->storage->data, (size_t)MM_N * MM_N * sizeof(float)) == 0;
  const char *coretype = getenv("OPENBLAS_CORETYPE");
  bench_json_t j;
  bench_json_begin(&j, "sgemm");
  bench_json_num(&j, "n", MM_N);
  bench_json_num(&j, "iters_per_round", base.iters);
  bench_json_num(&j, "rounds", ROUNDS);
  json_numf(&j, "ms_per_call", base.best_s * 1e3, 3);
  json_numf(&j, "gflop_per_s", sgemm_gf, 2);
  bench_json_str(&j, "openblas_config", openblas_get_config());
  bench_json_str(&j, "openblas_core", openblas_get_corename());
  bench_json_num(&j, "openblas_threads", openblas_get_num_threads());
  bench_json_str(&j, "OPENBLAS_CORETYPE", coretype ? coretype : "");
  bench_json_end(&j, stdout);
  bench_json_begin(&j, "mm");
  bench_json_str(&j, "dtype", "float32");
  bench_json_num(&j, "n", MM_N);
  bench_json_num(&j, "iters_per_round", kern.iters);
  bench_json_num(&j, "rounds", ROUNDS);
  json_numf(&j, "ms_per_call", kern.best_s * 1e3, 3);
  json_numf(&j, "gflop_per_s", mm_gf, 2);
  json_numf(&j, "sgemm_gflop_per_s", sgemm_gf, 2);
  json_numf(&j, "ratio_to_sgemm", mm_gf / sgemm_gf, 3);
  bench_json_str(&j, "status", ok ? "ok" : "result differs from sgemm");
  bench_json_end(&j, stdout);
  tensor_free(b.out);
  tensor_free(x);
  tensor_free(y);
  tensor_free(c);
}

/* ------------------------------------------------------------------ commands */

/* Runs bench_commands (next to this program, or in $MESHD_BIN_DIR) for the
 * end-to-end case; its JSON lines go straight to our stdout. */
static int commands_case(void) {
  char self[PATH_MAX], prog[PATH_MAX + 32];
  const char *env = getenv("MESHD_BIN_DIR");
  if (env && *env) {
    snprintf(prog, sizeof prog, "%s/bench_commands", env);
  } else {
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return -1;
    self[n] = '\0';
    snprintf(prog, sizeof prog, "%s/bench_commands", dirname(self));
  }
  fprintf(stderr, "bench_compute: commands: %s --agents 1,4 --live-tensors 0\n", prog);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    char *argv[] = {prog, "--agents", "1,4", "--live-tensors", "0", "--seconds", "2", NULL};
    execv(prog, argv);
    fprintf(stderr, "bench_compute: %s: %s\n", prog, strerror(errno));
    _exit(127);
  }
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------------ main */

static void usage(void) {
  fprintf(stderr,
          "usage: bench_compute [--seconds S] [--min-bytes A] [--max-bytes B] [--members 2,4]\n"
          "                     [--skip-kernels] [--skip-commands]\n");
  exit(2);
}

int main(int argc, char **argv) {
  size_t min_bytes = 0, max_bytes = 256 * MIB;
  size_t members[4] = {2, 4};
  int nmembers = 2;
  bool skip_commands = false, skip_kernels = false;
  size_t bcast_bytes = 64 * MIB, bcast_dests[4] = {2, 4, 8};
  int nbcast = 3;
  for (int i = 1; i < argc; i++) {
    const char *v;
    if ((v = bench_arg(argc, argv, &i, "--seconds"))) {
      g_seconds = atof(v);
    } else if ((v = bench_arg(argc, argv, &i, "--min-bytes"))) {
      min_bytes = strtoull(v, NULL, 10);
    } else if ((v = bench_arg(argc, argv, &i, "--max-bytes"))) {
      max_bytes = strtoull(v, NULL, 10);
    } else if ((v = bench_arg(argc, argv, &i, "--members"))) {
      nmembers = 0;
      char buf[64];
      snprintf(buf, sizeof buf, "%s", v);
      for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && nmembers < 4;
           t = strtok_r(NULL, ",", &save)) {
        int m = atoi(t);
        if (m < 2 || m > 4) usage();
        members[nmembers++] = (size_t)m;
      }
    } else if ((v = bench_arg(argc, argv, &i, "--broadcast-bytes"))) {
      bcast_bytes = strtoull(v, NULL, 10);
    } else if ((v = bench_arg(argc, argv, &i, "--broadcast-dests"))) {
      nbcast = 0;
      char buf[64];
      snprintf(buf, sizeof buf, "%s", v);
      for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && nbcast < 4;
           t = strtok_r(NULL, ",", &save)) {
        int m = atoi(t);
        if (m < 1 || m > MAXN - 1) usage();
        bcast_dests[nbcast++] = (size_t)m;
      }
    } else if (strcmp(argv[i], "--skip-kernels") == 0) {
      skip_kernels = true;
    } else if (strcmp(argv[i], "--skip-commands") == 0) {
      skip_commands = true;
    } else {
      usage();
    }
  }
  if (g_seconds <= 0) usage();
  signal(SIGPIPE, SIG_IGN);
  int rc = 0;

  fprintf(stderr, "bench_compute: loopback tcp\n");
  double lb = loopback_case();
  for (int i = 0; i < nmembers; i++) {
    fprintf(stderr, "bench_compute: allreduce on %zu members\n", members[i]);
    if (allreduce_cases(members[i], min_bytes, max_bytes, lb) != 0) rc = 1;
  }

  if (bcast_bytes > 0) {
    fprintf(stderr, "bench_compute: broadcast of %zu bytes\n", bcast_bytes);
    if (broadcast_cases(bcast_bytes, bcast_dests, nbcast) != 0) rc = 1;
  }

  if (!skip_kernels) {
    B.ops = &cpu_backend_ops;
    meshd_error_t e = {0};
    if (cpu_backend_ops.open(&B, "cpu", &e) != 0) {
      fprintf(stderr, "bench_compute: cpu backend: %s\n", e.msg);
      return 1;
    }
    fprintf(stderr, "bench_compute: elementwise add\n");
    elementwise_cases();
    fprintf(stderr, "bench_compute: matmul\n");
    matmul_cases();
    cpu_backend_ops.close(&B);
  }

  if (!skip_commands && commands_case() != 0) rc = 1;
  return rc;
}
