/* bench_data: tensor bytes up (Upload) and down (Fetch) through meshd, in MB/s
 * and as ratios to the rpc layer's raw streaming of the same bytes in the same
 * run. The C counterpart of bench_data.py (which measures grpcio and the Python
 * client); both print the same JSON lines.
 *
 *   bench_data [--sizes 1,64,1024] [--agents 1,4] [--rounds 3] [--skip-baseline]
 *              [--paths c,c_direct,c_small] [--server-flag --meshd-flag=value]...
 *
 * Paths: "c" (Upload and Fetch through the server), "c_direct" and "c_small"
 * (below).
 *
 * --sizes: MiB per tensor; --agents: agent counts; --rounds: runs per figure,
 * the best of which is reported (machines here are noisy), for 64 MiB and
 * more (smaller sizes run up to 16 times as many); --paths: which of
 * them; --server-flag: a meshd flag (e.g. --server-flag --stream-window-bytes=0).
 *
 * Ratios: each figure starts with a round of the path and one of its baseline
 * that are not measured (warm-up: the path's first transfer pays for its
 * channels' flow-control windows growing and its buffers' first pages, which
 * the baseline's channel paid in the "raw" lines before). Each measured round
 * of a path runs right after a round of its baseline, and
 * "ratio" is the path's best over the baseline's best in those same rounds
 * (a baseline measured once, apart, drifted 2x within one run here);
 * "ratio_median" the median over rounds of path / baseline of the round (a
 * lucky round of either side moves it little). The
 * "raw" lines are the baseline measured alone first, for the chart.
 *
 * Baseline: an Echo server in a child process (rpc_baseline.h); "upload" is
 * ClientStream with the bytes as 1 MiB payloads, "fetch" is ServerStream
 * answering with them. Both sides unpack each message, as a client of meshd
 * does.
 *
 * meshd: `meshd --local-agents N` in a child process (bench_server.h). Upload
 * sends an UploadHeader, then the bytes in 1 MiB UploadChunk{data} messages
 * (none across two ranks' slices, as the clients send them) packed by hand
 * (rpc_bytes_field: what a C client that does not copy sends);
 * with N agents it is per_rank (a 1/N slice per rank). Fetch reads every
 * rank's shard, all at once, on the rpc layer's pull thread. Before each
 * upload round, untimed, the last round's tensor is dropped.
 *
 * c_direct (docs/protocol.md, Direct data path): the C client library
 * (clients/c/meshd.h) with its data path set to direct: PlanTransfer, then
 * every shard's Agent/Write (one thread per shard) or Agent/Read (all on the
 * pull thread) straight to its agent under the grant, then FinishUpload (the
 * receipts) or
 * FinishFetch. Uploads stream from one buffer of the tensor's size, fetches
 * write into it (each rank's slice). Its channels to the agents are made once
 * per agent count, as a client keeps them.
 *
 * JSON lines on stdout; progress on stderr. Not a test: run by hand. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_server.h"
#include "meshd.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "meshd/test/v1/echo.pb-c.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "rpc.h"
#include "rpc_baseline.h"
#include "runtime.h"

#define SVC "/meshd.v1.TensorService/"
#define CHUNK (1u << 20)
#define CALL_MS 600000
#define MAX_SIZES 8

typedef struct {
  int sizes[MAX_SIZES], nsizes;
  int agents[8], nagents;
  int rounds;
  bool skip_baseline;
  const char *paths; /* --paths: comma-separated names; NULL: every path */
  const char *server_flags[8]; /* --server-flag, each passed to meshd as is */
  size_t nserver_flags;
} opts_t;

static void usage(void) {
  fprintf(stderr, "usage: bench_data [--sizes 1,64,1024] [--agents 1,4] [--rounds 3] "
                  "[--skip-baseline] [--paths c,c_direct,c_small] [--server-flag --flag=value]...\n");
  exit(2);
}

/* Rounds for a size: --rounds for 64 MiB and more, up to 16 times as many for
 * smaller ones (a 1 MiB round is a millisecond: one hiccup of the machine is
 * its whole time). */
static int rounds_for(const opts_t *o, int mib) {
  int k = 64 / mib;
  return o->rounds * (k < 1 ? 1 : k > 16 ? 16 : k);
}

static int parse_list(const char *v, int *out, int max, int lo, int hi) {
  char buf[128];
  snprintf(buf, sizeof buf, "%s", v);
  int n = 0;
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && n < max;
       t = strtok_r(NULL, ",", &save)) {
    out[n] = atoi(t);
    if (out[n] < lo || out[n] > hi) usage();
    n++;
  }
  return n;
}

/* ------------------------------------------------------------------ the baseline */

static int raw_upload(rpc_channel_t *ch, size_t bytes, const uint8_t *block) {
  rpc_stream_t *s = rpc_stream_open(ch, "/meshd.test.v1.Echo/ClientStream", NULL, 0, CALL_MS);
  Meshd__Test__V1__EchoRequest r = MESHD__TEST__V1__ECHO_REQUEST__INIT;
  r.payload.data = (uint8_t *)block;
  int rc = s ? 0 : -1;
  for (size_t off = 0; rc == 0 && off < bytes; off += CHUNK) {
    r.payload.len = bytes - off < CHUNK ? bytes - off : CHUNK;
    rc = rpc_stream_write(s, &r.base, false);
  }
  if (rc == 0) rc = rpc_stream_close_send(s);
  ProtobufCMessage *m = NULL;
  while (rc == 0 && rpc_stream_read(s, &meshd__test__v1__echo_reply__descriptor, &m, CALL_MS) == 1) {
    protobuf_c_message_free_unpacked(m, NULL);
    m = NULL;
  }
  if (s && rpc_stream_finish(s, NULL) != GRPC_STATUS_OK) rc = -1;
  rpc_stream_destroy(s);
  return rc;
}

static int raw_fetch(rpc_channel_t *ch, size_t bytes, const uint8_t *block) {
  rpc_stream_t *s = rpc_stream_open(ch, "/meshd.test.v1.Echo/ServerStream", NULL, 0, CALL_MS);
  Meshd__Test__V1__EchoRequest r = MESHD__TEST__V1__ECHO_REQUEST__INIT;
  r.payload.data = (uint8_t *)block;
  r.payload.len = CHUNK;
  r.reply_count = (int32_t)(bytes / CHUNK);
  size_t got = 0;
  int rc = s ? rpc_stream_write(s, &r.base, true) : -1;
  ProtobufCMessage *m = NULL;
  while (rc == 0 && rpc_stream_read(s, &meshd__test__v1__echo_reply__descriptor, &m, CALL_MS) == 1) {
    got += ((Meshd__Test__V1__EchoReply *)m)->payload.len;
    protobuf_c_message_free_unpacked(m, NULL);
    m = NULL;
  }
  if (s && rpc_stream_finish(s, NULL) != GRPC_STATUS_OK) rc = -1;
  rpc_stream_destroy(s);
  return rc == 0 && got == (size_t)r.reply_count * CHUNK ? 0 : -1;
}

/* ------------------------------------------------------------------ meshd */

typedef struct {
  rpc_channel_t *ch;
  char id[128], token[128];
  rpc_md_t md[2];
  uint64_t seq, ref, mesh;
} session_t;

static int session_open(session_t *c, const char *target, int nagents) {
  memset(c, 0, sizeof *c);
  c->ch = rpc_channel_create(target, &(rpc_channel_opts_t){.max_message_bytes = 8 << 20});
  if (!c->ch || !rpc_channel_wait_ready(c->ch, 5000)) return -1;
  if (bench_create_session(c->ch, c->id, c->token, c->md) != 0) return -1;
  ProtobufCMessage *rep = NULL;
  rpc_status_t st;
  Meshd__V1__Dim dim = MESHD__V1__DIM__INIT;
  dim.name = "gpu";
  dim.size = nagents;
  Meshd__V1__Dim *dims[1] = {&dim};
  Meshd__V1__CreateMesh cm = MESHD__V1__CREATE_MESH__INIT;
  cm.ref = c->mesh = ++c->ref;
  cm.n_dims = 1;
  cm.dims = dims;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.seq = ++c->seq;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_CREATE_MESH;
  cmd.create_mesh = &cm;
  if (rpc_unary(c->ch, SVC "Execute", &cmd.base, &meshd__v1__command_result__descriptor, &rep,
                c->md, 2, 10000, &st) != GRPC_STATUS_OK) {
    fprintf(stderr, "bench_data: CreateMesh: %s\n", st.message);
    return -1;
  }
  protobuf_c_message_free_unpacked(rep, NULL);
  return 0;
}

static void session_close(session_t *c) {
  if (c->ch) rpc_channel_destroy(c->ch);
  memset(c, 0, sizeof *c);
}

static int drop(session_t *c, uint64_t ref) {
  Meshd__V1__Drop d = MESHD__V1__DROP__INIT;
  d.refs = &ref;
  d.n_refs = 1;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.seq = ++c->seq;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_DROP;
  cmd.drop = &d;
  ProtobufCMessage *rep = NULL;
  grpc_status_code code = rpc_unary(c->ch, SVC "Execute", &cmd.base,
                                    &meshd__v1__command_result__descriptor, &rep, c->md, 2, 10000,
                                    NULL);
  if (rep) protobuf_c_message_free_unpacked(rep, NULL);
  return code == GRPC_STATUS_OK ? 0 : -1;
}

/* The header of a float32 upload of `bytes` (per_rank over nagents when > 1)
 * under a fresh ref; shape[1] is its storage. */
static void upload_header(session_t *c, int nagents, size_t bytes, int64_t *shape,
                          Meshd__V1__UploadHeader *h) {
  shape[0] = (int64_t)(bytes / (size_t)nagents / 4);
  meshd__v1__upload_header__init(h);
  h->ref = ++c->ref;
  h->mesh = c->mesh;
  h->shape = shape;
  h->n_shape = 1;
  h->dtype = MESHD__V1__DTYPE__DTYPE_FLOAT32;
  h->per_rank = nagents > 1;
  h->total_bytes = bytes;
}

/* Uploads `bytes` (per_rank over nagents when > 1); the new ref in *ref. */
static int upload(session_t *c, int nagents, size_t bytes, const uint8_t *block, uint64_t *ref) {
  rpc_stream_t *s = rpc_stream_open(c->ch, SVC "Upload", c->md, 2, CALL_MS);
  if (!s) return -1;
  int64_t shape[1];
  Meshd__V1__UploadHeader h;
  upload_header(c, nagents, bytes, shape, &h);
  *ref = h.ref;
  Meshd__V1__UploadChunk first = MESHD__V1__UPLOAD_CHUNK__INIT;
  first.part_case = MESHD__V1__UPLOAD_CHUNK__PART_HEADER;
  first.header = &h;
  int rc = rpc_stream_write(s, &first.base, false);
  size_t slice = bytes / (size_t)nagents; /* chunks end with a rank's slice, as the clients' */
  for (size_t off = 0, n; rc == 0 && off < bytes; off += n) {
    n = bytes - off < CHUNK ? bytes - off : CHUNK;
    if (slice - off % slice < n)
      n = slice - off % slice;
    uint8_t *dst;
    rpc_bytes_t *m = rpc_bytes_field(MESHD__V1__UPLOAD_CHUNK__PART_DATA, n, &dst);
    memcpy(dst, block, n); /* the one copy a client makes, from its array */
    rc = rpc_stream_write_raw(s, m);
    rpc_bytes_free(m);
  }
  if (rc == 0) rc = rpc_stream_close_send(s);
  ProtobufCMessage *rep = NULL;
  while (rpc_stream_read(s, &meshd__v1__upload_reply__descriptor, &rep, CALL_MS) == 1) {
    protobuf_c_message_free_unpacked(rep, NULL);
    rep = NULL;
  }
  rpc_status_t st;
  if (rpc_stream_finish(s, &st) != GRPC_STATUS_OK) {
    fprintf(stderr, "bench_data: Upload: %s\n", st.message);
    rc = -1;
  }
  rpc_stream_destroy(s);
  return rc;
}

/* Every rank's Fetch at once, as pulls: the rpc layer's one pull thread reads
 * them all (as the C client library does; a thread per rank, each plucking
 * its own stream, took turns as gRPC's poller and cost the client 1.7 times
 * the CPU per GB over 4 ranks). Chunks are read packed: a data chunk's bytes
 * are used where they lie. */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int left;
} pulls_t;

typedef struct {
  pulls_t *all;
  size_t got;
  int rc;
} pull_job_t;

static void fetch_pulled(rpc_pull_t *p, rpc_bytes_t *m, void *arg) {
  pull_job_t *j = arg;
  if (m) {
    size_t len = 0;
    if (rpc_bytes_is_field(m, MESHD__V1__FETCH_CHUNK__PART_DATA, &len)) j->got += len;
    rpc_bytes_free(m);
    rpc_pull_next(p);
    return;
  }
  j->rc = rpc_pull_status(p, NULL) == GRPC_STATUS_OK ? 0 : -1;
  pthread_mutex_lock(&j->all->mu);
  if (--j->all->left == 0) pthread_cond_signal(&j->all->cv);
  pthread_mutex_unlock(&j->all->mu);
}

static int fetch_all(session_t *c, uint64_t ref, int nagents, size_t bytes) {
  pulls_t all = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, nagents};
  pull_job_t jobs[MAX_AGENTS];
  rpc_pull_t *p[MAX_AGENTS];
  Meshd__V1__Coordinate co[MAX_AGENTS];
  Meshd__V1__Coordinate *coords[MAX_AGENTS];
  for (int i = 0; i < nagents; i++) {
    jobs[i] = (pull_job_t){&all, 0, -1};
    meshd__v1__coordinate__init(&co[i]);
    co[i].dim = "gpu";
    co[i].index = i;
    coords[i] = &co[i];
    Meshd__V1__FetchRequest r = MESHD__V1__FETCH_REQUEST__INIT;
    r.ref = ref;
    r.coords = &coords[i];
    r.n_coords = 1;
    p[i] = rpc_pull_open_raw(c->ch, SVC "Fetch", &r.base, c->md, 2, CALL_MS, fetch_pulled, &jobs[i]);
    if (p[i]) rpc_pull_next(p[i]);
    else {
      pthread_mutex_lock(&all.mu);
      all.left--;
      pthread_mutex_unlock(&all.mu);
    }
  }
  pthread_mutex_lock(&all.mu);
  while (all.left > 0) pthread_cond_wait(&all.cv, &all.mu);
  pthread_mutex_unlock(&all.mu);
  size_t got = 0;
  int rc = 0;
  for (int i = 0; i < nagents; i++) {
    rpc_pull_destroy(p[i]);
    got += jobs[i].got;
    rc |= jobs[i].rc;
  }
  return rc == 0 && got == bytes ? 0 : -1;
}

/* ------------------------------------------------------------------ direct */

/* The C client library (clients/c/meshd.h) with its data path set to direct:
 * one implementation of the direct path, the one meshctl and users run. */
typedef struct {
  meshd_client_t *c;
  meshd_session_t *s;
  meshd_ref_t mesh;
  uint8_t *buf; /* the tensor: uploaded from, fetched into */
  size_t cap;
} lib_t;

static int lib_fail(lib_t *l, const char *what) {
  fprintf(stderr, "bench_data: %s: %s\n", what, meshd_last_error(l->c)->message);
  return -1;
}

static int lib_open(lib_t *l, const char *target, int nagents) {
  meshd_err_t e;
  memset(l, 0, sizeof *l);
  if (!(l->c = meshd_connect(target, CALL_MS, &e))) {
    fprintf(stderr, "bench_data: connect: %s\n", meshd_strerror(e));
    return -1;
  }
  if (!(l->s = meshd_session_open(l->c, "bench_data", &e))) return lib_fail(l, "session");
  meshd_session_set_data_path(l->s, MESHD_DATA_PATH_DIRECT);
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {nagents};
  if (meshd_session_create_mesh(l->s, dims, sizes, 1, &l->mesh) != MESHD_E_OK)
    return lib_fail(l, "CreateMesh");
  return 0;
}

static void lib_close(lib_t *l) {
  meshd_session_close(l->s);
  meshd_close(l->c);
  free(l->buf);
  memset(l, 0, sizeof *l);
}

/* A buffer of `bytes`: block over and over. */
static int lib_buffer(lib_t *l, size_t bytes, const uint8_t *block) {
  if (bytes > l->cap) {
    uint8_t *b = realloc(l->buf, bytes);
    if (!b) return -1;
    l->buf = b;
    l->cap = bytes;
  }
  for (size_t off = 0; off < bytes; off += CHUNK)
    memcpy(l->buf + off, block, bytes - off < CHUNK ? bytes - off : CHUNK);
  return 0;
}

/* Uploads `bytes` (per_rank over nagents when > 1); the new ref in *ref. */
static int direct_upload(lib_t *l, int nagents, size_t bytes, uint64_t *ref) {
  int64_t shape[1] = {(int64_t)(bytes / (size_t)nagents / 4)};
  meshd_upload_options_t o = MESHD_UPLOAD_OPTIONS_INIT;
  o.per_rank = nagents > 1;
  if (meshd_session_upload_with(l->s, l->mesh, "float32", shape, 1, l->buf, bytes, &o, ref) !=
      MESHD_E_OK)
    return lib_fail(l, "direct upload");
  return 0;
}

/* Every rank's shard at once, each into its slice of the buffer. */
static int direct_fetch(lib_t *l, uint64_t ref, int nagents, size_t bytes) {
  const char *dims[] = {"gpu"};
  int64_t idx[MAX_AGENTS];
  meshd_fetch_part_t parts[MAX_AGENTS];
  size_t each = bytes / (size_t)nagents;
  for (int i = 0; i < nagents; i++) {
    idx[i] = i;
    parts[i] = (meshd_fetch_part_t){dims, &idx[i], 1, l->buf + (size_t)i * each, each, 0};
  }
  if (meshd_session_fetch_bytes(l->s, ref, parts, (size_t)nagents, NULL) != MESHD_E_OK)
    return lib_fail(l, "direct fetch");
  size_t got = 0;
  for (int i = 0; i < nagents; i++) got += parts[i].nbytes;
  return got == bytes ? 0 : -1;
}

static int lib_drop(lib_t *l, uint64_t ref) {
  return meshd_session_drop(l->s, &ref, 1) == MESHD_E_OK ? 0 : lib_fail(l, "Drop");
}

/* ------------------------------------------------------------------ reporting */

/* CPU time each side spent in a path's rounds (from /proc, 10 ms ticks):
 * cores are what bound a transfer on a machine with fewer cores than busy
 * processes, and CPU per byte does not drift with the machine's load. */
typedef struct {
  pid_t server;          /* meshd, or the baseline's Echo child */
  const pid_t *agents;
  int nagents;
} cpu_probe_t;

typedef struct {
  int64_t client, server, agents; /* µs */
  double bytes;
} cpu_tally_t;

/* CPU ms per GB of t's side, or nothing when t measured nothing. */
static void emit_cpu(bench_json_t *j, const char *key, int64_t us, const cpu_tally_t *t) {
  if (t && t->bytes > 0) bench_json_num(j, key, (double)us / 1e3 / (t->bytes / 1e9));
}

static void emit(int nagents, int mib, const char *path, const char *direction, double mbs,
                 double raw, double median, const cpu_tally_t *cpu, const cpu_tally_t *raw_cpu) {
  bench_json_t j;
  bench_json_begin(&j, "data");
  if (nagents) bench_json_num(&j, "agents", nagents);
  bench_json_num(&j, "mib", mib);
  bench_json_str(&j, "path", path);
  bench_json_str(&j, "direction", direction);
  bench_json_num(&j, "mb_s", mbs);
  if (nagents) bench_json_num(&j, "raw_mb_s", raw);
  /* CPU ms per GB moved: this path's client, server (meshd), agents; the
   * baseline's client and server (its Echo child), in the same rounds. */
  if (cpu) {
    emit_cpu(&j, "client_cpu_ms_gb", cpu->client, cpu);
    emit_cpu(&j, "server_cpu_ms_gb", cpu->server, cpu);
    emit_cpu(&j, "agents_cpu_ms_gb", cpu->agents, cpu);
  }
  if (raw_cpu) {
    emit_cpu(&j, "raw_client_cpu_ms_gb", raw_cpu->client, raw_cpu);
    emit_cpu(&j, "raw_server_cpu_ms_gb", raw_cpu->server, raw_cpu);
  }
  /* bench_json_num keeps one decimal: a ratio needs three. */
  if (j.len < sizeof j.buf) {
    int n = isfinite(mbs / raw)
                ? snprintf(j.buf + j.len, sizeof j.buf - j.len, ",\"ratio\":%.3f", mbs / raw)
                : snprintf(j.buf + j.len, sizeof j.buf - j.len, ",\"ratio\":null");
    j.len += n > 0 ? (size_t)n : 0;
  }
  if (nagents && j.len < sizeof j.buf) {
    int n = isfinite(median)
                ? snprintf(j.buf + j.len, sizeof j.buf - j.len, ",\"ratio_median\":%.3f", median)
                : snprintf(j.buf + j.len, sizeof j.buf - j.len, ",\"ratio_median\":null");
    j.len += n > 0 ? (size_t)n : 0;
  }
  bench_json_end(&j, stdout);
}

/* Best MB/s of `rounds` runs of one direction; NAN when a run failed. */
typedef int (*run_fn)(void *arg);

static const cpu_probe_t *probe; /* what run_mbs reads; NULL: nothing */

static void cpu_read(int64_t v[3]) {
  v[0] = self_cpu_us();
  v[1] = probe ? proc_cpu_us(probe->server) : 0;
  v[2] = probe ? agents_cpu_us(probe->agents, probe->nagents) : 0;
}

static double run_mbs_tally(run_fn fn, void *arg, size_t bytes, cpu_tally_t *t) {
  int64_t c0[3], c1[3];
  cpu_read(c0);
  int64_t t0 = bench_now_ns();
  if (fn(arg) != 0) return NAN;
  double mbs = (double)bytes / ((double)(bench_now_ns() - t0) / 1e9) / 1e6;
  cpu_read(c1);
  if (t) {
    t->client += c1[0] - c0[0];
    t->server += c1[1] - c0[1];
    t->agents += c1[2] - c0[2];
    t->bytes += (double)bytes;
  }
  return mbs;
}

static double run_mbs(run_fn fn, void *arg, size_t bytes) {
  return run_mbs_tally(fn, arg, bytes, NULL);
}

static double best_mbs(run_fn fn, void *arg, int rounds, size_t bytes) {
  double best = 0;
  for (int r = 0; r < rounds; r++) {
    double mbs = run_mbs(fn, arg, bytes);
    if (!isfinite(mbs)) return NAN;
    if (mbs > best) best = mbs;
  }
  return best;
}

/* best_mbs of fn, each round right after a round of the baseline `raw` (NULL:
 * none), whose best over the same rounds lands in *raw_best: a ratio from one
 * window of time, which machines here need (a baseline measured alone drifted
 * 2x over one run). `before` (NULL: none) runs ahead of each round of fn,
 * untimed. */
static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double paired_mbs(run_fn before, run_fn fn, void *arg, const cpu_probe_t *fn_probe,
                         cpu_tally_t *fn_cpu, run_fn raw, void *raw_arg,
                         const cpu_probe_t *raw_probe, cpu_tally_t *raw_cpu, int rounds, size_t bytes, double *raw_best,
                         double *median) {
  double best = 0, rbest = 0;
  double *ratios = calloc((size_t)rounds, sizeof *ratios);
  int nr = 0;
  *median = NAN;
  /* One round unmeasured first, of both: a path's first transfer pays for its
   * channels' flow-control windows growing and its buffers' first pages, which
   * the baseline's channel paid already in the "raw" lines. */
  if ((before && before(arg) != 0) || (raw && raw(raw_arg) != 0) || fn(arg) != 0) {
    free(ratios);
    return NAN;
  }
  for (int r = 0; r < rounds; r++) {
    if (before && before(arg) != 0) {
      free(ratios);
      return NAN;
    }
    probe = raw_probe;
    double rm = raw ? run_mbs_tally(raw, raw_arg, bytes, raw_cpu) : NAN;
    if (rm > rbest) rbest = rm;
    probe = fn_probe;
    double mbs = run_mbs_tally(fn, arg, bytes, fn_cpu);
    probe = NULL;
    fprintf(stderr, "bench_data:   round %d: baseline %.0f MB/s, path %.0f MB/s\n", r + 1, rm, mbs);
    if (!isfinite(mbs)) {
      free(ratios);
      return NAN;
    }
    if (mbs > best) best = mbs;
    if (ratios && isfinite(rm) && rm > 0) ratios[nr++] = mbs / rm;
  }
  if (nr) {
    qsort(ratios, (size_t)nr, sizeof *ratios, cmp_double);
    *median = nr % 2 ? ratios[nr / 2] : (ratios[nr / 2 - 1] + ratios[nr / 2]) / 2;
  }
  free(ratios);
  *raw_best = raw ? rbest : NAN;
  return best;
}

typedef struct {
  rpc_channel_t *ch;
  session_t *c;
  lib_t *lib; /* direct */
  int nagents;
  size_t bytes;
  const uint8_t *block;
  uint64_t ref;
} run_t;

static int run_raw_upload(void *p) {
  run_t *r = p;
  return raw_upload(r->ch, r->bytes, r->block);
}
static int run_raw_fetch(void *p) {
  run_t *r = p;
  return raw_fetch(r->ch, r->bytes, r->block);
}
/* Before an upload round, untimed: the last round's tensor goes (the
 * baseline keeps nothing either). */
static int run_drop_last(void *p) {
  run_t *r = p;
  if (r->ref && drop(r->c, r->ref) != 0) return -1;
  r->ref = 0;
  return 0;
}
static int run_upload(void *p) {
  run_t *r = p;
  return upload(r->c, r->nagents, r->bytes, r->block, &r->ref);
}
static int run_fetch(void *p) {
  run_t *r = p;
  return fetch_all(r->c, r->ref, r->nagents, r->bytes);
}
static int run_direct_drop_last(void *p) {
  run_t *r = p;
  if (r->ref && lib_drop(r->lib, r->ref) != 0) return -1;
  r->ref = 0;
  return 0;
}
static int run_direct_upload(void *p) {
  run_t *r = p;
  return direct_upload(r->lib, r->nagents, r->bytes, &r->ref);
}
static int run_direct_fetch(void *p) {
  run_t *r = p;
  return direct_fetch(r->lib, r->ref, r->nagents, r->bytes);
}

/* ------------------------------------------------------------------ small tensors */

/* c_small: tensors of a few bytes to 256 KiB, replicated on every rank, as a
 * user making scalars, biases and labels makes them: µs per tensor until every
 * rank holds it, for
 *   c_upload            meshd_session_upload (the session's path: direct here);
 *   c_literal           meshd_session_literal, then Sync;
 *   c_literal_pipelined SMALL_BATCH Literals on a pipeline, then one Sync;
 * and the baseline, one raw client-streaming call of the same bytes (raw_upload).
 * Rounds of each alternate with the baseline's; the best round of each is
 * reported, "ratio" is raw µs / path µs, "vs_upload" c_upload µs / path µs.
 * Tensors are dropped between rounds, untimed. */
#define SMALL_BATCH 64
#define SMALL_ROUNDS 12

typedef struct {
  lib_t *lib;
  rpc_channel_t *raw;
  size_t bytes;
  const uint8_t *block;
  meshd_ref_t refs[SMALL_BATCH];
  size_t nrefs;
} small_t;

static int small_drop(small_t *m) {
  int rc = 0;
  if (m->nrefs && meshd_session_drop(m->lib->s, m->refs, m->nrefs) != MESHD_E_OK)
    rc = lib_fail(m->lib, "Drop");
  m->nrefs = 0;
  return rc;
}

/* One round of `path` (0 upload, 1 literal, 2 pipelined literals): µs per
 * tensor, or NAN when a call failed. */
static double small_round(small_t *m, int path) {
  meshd_session_t *s = m->lib->s;
  int64_t shape[1] = {(int64_t)m->bytes};
  size_t n = path == 2 ? SMALL_BATCH : 4;
  meshd_pipeline_options_t po = MESHD_PIPELINE_OPTIONS_INIT;
  if (path == 2 && meshd_session_set_pipeline(s, &po) != MESHD_E_OK) return NAN;
  int64_t t0 = bench_now_ns();
  meshd_err_t e = MESHD_E_OK;
  for (size_t i = 0; e == MESHD_E_OK && i < n; i++) {
    meshd_ref_t *out = &m->refs[m->nrefs];
    e = path == 0 ? meshd_session_upload(s, m->lib->mesh, "uint8", shape, 1, m->block, m->bytes, out)
                  : meshd_session_literal(s, m->lib->mesh, "uint8", shape, 1, m->block, m->bytes,
                                          NULL, out);
    if (e == MESHD_E_OK) m->nrefs++;
    if (e == MESHD_E_OK && path == 1) e = meshd_session_sync(s);
  }
  if (e == MESHD_E_OK && path == 2) e = meshd_session_sync(s);
  double us = (double)(bench_now_ns() - t0) / 1e3 / (double)n;
  if (path == 2) meshd_session_set_pipeline(s, NULL);
  if (e != MESHD_E_OK) {
    lib_fail(m->lib, path == 0 ? "small upload" : "small literal");
    return NAN;
  }
  return small_drop(m) == 0 ? us : NAN;
}

static double small_raw(small_t *m) {
  int64_t t0 = bench_now_ns();
  for (int i = 0; i < 4; i++)
    if (raw_upload(m->raw, m->bytes, m->block) != 0) return NAN;
  return (double)(bench_now_ns() - t0) / 1e3 / 4;
}

static void emit_small(int nagents, size_t bytes, const char *path, double us, double raw_us,
                       double upload_us) {
  bench_json_t j;
  bench_json_begin(&j, "data_small");
  bench_json_num(&j, "agents", nagents);
  bench_json_num(&j, "bytes", (double)bytes);
  bench_json_str(&j, "path", path);
  bench_json_num(&j, "us", us);
  bench_json_num(&j, "raw_us", raw_us);
  if (j.len < sizeof j.buf) { /* three decimals (bench_json_num keeps one) */
    int n = snprintf(j.buf + j.len, sizeof j.buf - j.len, ",\"ratio\":%.3f,\"vs_upload\":%.3f",
                     raw_us / us, upload_us / us);
    j.len += n > 0 ? (size_t)n : 0;
  }
  bench_json_end(&j, stdout);
}

static int small_case(int nagents, lib_t *lib, rpc_channel_t *raw, const uint8_t *block) {
  static const size_t sizes[] = {64, 4096, 65536, 262144};
  static const char *const names[] = {"c_upload", "c_literal", "c_literal_pipelined"};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    small_t m = {.lib = lib, .raw = raw, .bytes = sizes[i], .block = block};
    double best[3] = {INFINITY, INFINITY, INFINITY}, raw_best = INFINITY;
    for (int p = 0; p < 3; p++) small_round(&m, p); /* warm-up, unmeasured */
    if (raw) small_raw(&m);
    for (int r = 0; r < SMALL_ROUNDS; r++)
      for (int p = 0; p < 3; p++) {
        double rus = raw ? small_raw(&m) : NAN, us = small_round(&m, p);
        if (!isfinite(us)) return -1;
        if (us < best[p]) best[p] = us;
        if (rus < raw_best) raw_best = rus;
      }
    for (int p = 0; p < 3; p++)
      emit_small(nagents, sizes[i], names[p], best[p], raw ? raw_best : NAN, best[0]);
  }
  return 0;
}

/* Is path `name` one of --paths? */
static bool path_wanted(const opts_t *o, const char *name) {
  if (!o->paths) return true;
  size_t n = strlen(name);
  for (const char *p = o->paths; *p;) {
    size_t len = strcspn(p, ",");
    if (len == n && strncmp(p, name, n) == 0) return true;
    p += len + (p[len] == ',');
  }
  return false;
}

static int agents_case(int nagents, const opts_t *o, rpc_channel_t *raw_ch,
                       const cpu_probe_t *echo_probe, const uint8_t *block) {
  server_t srv;
  if (server_start(&srv, nagents, o->server_flags, o->nserver_flags) != 0) return -1;
  const cpu_probe_t meshd_probe = {.server = srv.pid, .agents = srv.agents, .nagents = srv.nagents};
  session_t c;
  lib_t lib = {0};
  int rc = session_open(&c, srv.target, nagents);
  if (rc == 0 && (path_wanted(o, "c_direct") || path_wanted(o, "c_small")))
    rc = lib_open(&lib, srv.target, nagents);
  if (rc == 0 && path_wanted(o, "c_small")) {
    fprintf(stderr, "bench_data: %d agent(s), small tensors\n", nagents);
    rc = small_case(nagents, &lib, raw_ch, block);
  }
  static const struct {
    const char *name;
    run_fn before_up, up, down;
  } paths[] = {{"c", run_drop_last, run_upload, run_fetch},
               {"c_direct", run_direct_drop_last, run_direct_upload, run_direct_fetch}};
  for (int i = 0; rc == 0 && i < o->nsizes; i++) {
    size_t bytes = (size_t)o->sizes[i] << 20;
    bytes -= bytes % ((size_t)nagents * 4);
    int rounds = rounds_for(o, o->sizes[i]);
    fprintf(stderr, "bench_data: %d agent(s), %d MiB\n", nagents, o->sizes[i]);
    run_t raw = {.ch = raw_ch, .bytes = bytes, .block = block};
    for (size_t k = 0; rc == 0 && k < sizeof paths / sizeof *paths; k++) {
      if (!path_wanted(o, paths[k].name)) continue;
      bool lib_path = paths[k].up == run_direct_upload;
      if (lib_path && lib_buffer(&lib, bytes, block) != 0) {
        rc = -1;
        break;
      }
      run_t r = {.c = &c, .lib = &lib, .nagents = nagents, .bytes = bytes, .block = block};
      double rup = NAN, rdown = NAN, mup = NAN, mdown = NAN;
      cpu_tally_t cu = {0}, cd = {0}, ru = {0}, rd = {0};
      double up = paired_mbs(paths[k].before_up, paths[k].up, &r, &meshd_probe, &cu,
                             raw_ch ? run_raw_upload : NULL, &raw, echo_probe, &ru, rounds,
                             bytes, &rup, &mup);
      double down = isfinite(up) ? paired_mbs(NULL, paths[k].down, &r, &meshd_probe, &cd,
                                              raw_ch ? run_raw_fetch : NULL, &raw, echo_probe,
                                              &rd, rounds, bytes, &rdown, &mdown)
                                 : NAN;
      if (r.ref && lib_path) lib_drop(&lib, r.ref);
      else if (r.ref) drop(&c, r.ref);
      emit(nagents, o->sizes[i], paths[k].name, "upload", up, rup, mup, &cu, raw_ch ? &ru : NULL);
      emit(nagents, o->sizes[i], paths[k].name, "fetch", down, rdown, mdown, &cd,
           raw_ch ? &rd : NULL);
      if (!isfinite(up) || !isfinite(down)) rc = -1;
    }
  }
  if (lib.s) lib_close(&lib);
  session_close(&c);
  server_stop(&srv);
  int warns, errors;
  log_scan(&srv, &warns, &errors);
  server_cleanup(&srv, rc != 0 || errors);
  return rc;
}

int main(int argc, char **argv) {
  opts_t o = {.sizes = {1, 64, 1024}, .nsizes = 3, .agents = {1, 4}, .nagents = 2, .rounds = 3};
  for (int i = 1; i < argc; i++) {
    const char *v;
    if ((v = bench_arg(argc, argv, &i, "--sizes"))) o.nsizes = parse_list(v, o.sizes, MAX_SIZES, 1, 16384);
    else if ((v = bench_arg(argc, argv, &i, "--agents"))) o.nagents = parse_list(v, o.agents, 8, 1, MAX_AGENTS);
    else if ((v = bench_arg(argc, argv, &i, "--rounds"))) o.rounds = atoi(v);
    else if (strcmp(argv[i], "--skip-baseline") == 0) o.skip_baseline = true;
    else if ((v = bench_arg(argc, argv, &i, "--paths"))) o.paths = v;
    else if ((v = bench_arg(argc, argv, &i, "--server-flag")) && o.nserver_flags < 8)
      o.server_flags[o.nserver_flags++] = v;
    else usage();
  }
  if (o.rounds < 1 || o.nsizes < 1 || o.nagents < 1) usage();
  bench_name = "bench_data";
  clk_tck = sysconf(_SC_CLK_TCK);
  find_bin_dir(argv[0]);
  signal(SIGPIPE, SIG_IGN);
  uint8_t *block = calloc(1, CHUNK);
  if (!block) return 1;
  char err[256] = "";
  bench_echo_child_t echo = {0};
  if (!o.skip_baseline && bench_echo_fork(2, &echo, err, sizeof err) != 0) {
    fprintf(stderr, "bench_data: %s\n", err);
    return 1;
  }
  runtime_tune_malloc(); /* the client side of both, as meshd's daemons */
  rpc_init();
  int rc = 0;
  rpc_channel_t *ch = NULL;
  if (!o.skip_baseline) {
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", echo.port);
    ch = rpc_channel_create(target, &(rpc_channel_opts_t){.max_message_bytes = RPC_BASELINE_MAX_MESSAGE});
    rpc_channel_wait_ready(ch, 5000);
    for (int i = 0; i < o.nsizes; i++) {
      size_t bytes = (size_t)o.sizes[i] << 20;
      run_t r = {.ch = ch, .bytes = bytes, .block = block};
      double up = best_mbs(run_raw_upload, &r, rounds_for(&o, o.sizes[i]), bytes);
      double down = best_mbs(run_raw_fetch, &r, rounds_for(&o, o.sizes[i]), bytes);
      emit(0, o.sizes[i], "raw", "upload", up, up, NAN, NULL, NULL);
      emit(0, o.sizes[i], "raw", "fetch", down, down, NAN, NULL, NULL);
    }
  }
  for (int i = 0; i < o.nagents; i++)
    if (agents_case(o.agents[i], &o, ch, &(cpu_probe_t){.server = echo.pid}, block) != 0) rc = 1;
  if (ch) rpc_channel_destroy(ch);
  if (!o.skip_baseline && bench_echo_child_stop(&echo) != 0) rc = 1;
  rpc_shutdown();
  free(block);
  return rc;
}
