/* bench_commands: commands/s accepted by meshd on Submit, as a ratio to the rpc
 * layer's raw bidi-stream baseline measured in the same run, server CPU per
 * command, and server memory per live tensor.
 *
 *   bench_commands [--seconds N] [--warmup S] [--agents 1,4] [--drop-batch B]
 *                  [--batch K] [--live-tensors K] [--memory-seconds M] [--skip-baseline]
 *                  [--c-client] [--unary-seconds U]
 *
 * Each agent count's line also has the p50 and p99 of tiny Calls sent one at a
 * time by unary Execute, with the ratio of that p50 to the echo server's unary
 * p50 (unary_p50_ratio_to_echo). The two are measured in alternating rounds of
 * a tenth of --seconds each (baseline_unary_p50_us is the echo's p50 from
 * those rounds), so that drift in the machine's load hits both alike.
 * unary_server_ctx_switches_per_call and baseline_unary_ctx_switches_per_call
 * count the context switches of every thread of each server per call: the
 * handoffs between threads (pollers, workers) that a unary call costs.
 * --unary-seconds: that phase's length instead of --seconds (to profile it:
 * --seconds 0.2 --unary-seconds 30).
 * --seconds: measured time per case (default 2); --warmup: unmeasured time
 * before it (0.5); --agents: the agent counts of the command cases (1,4);
 * --drop-batch: results dropped per Drop (256); --live-tensors: live refs made
 * by the memory case (1000000; 0 skips it); --memory-seconds: the memory case
 * stops making refs after this long and reports how many it made (90);
 * --batch: Calls per Submit message (1: one each; K > 1: a batch Command of K,
 * answered in one SubmitReply{results}, docs/protocol.md), the Drops between.
 * --c-client: after each agent count's command case, the same tiny adds (and
 * Drops) through the C client library's pipeline (meshd_session_call with
 * meshd_session_set_pipeline's defaults: batches of up to 256, 200 µs), one
 * thread making calls as fast as it can; its line ("c_client") has commands
 * answered per second, the ratio to the raw bidi baseline and to the raw
 * command case of the same run (pass --batch 256 for a batched one).
 *
 * Each case starts its own server, `$MESHD_BIN_DIR/meshd --listen 127.0.0.1:0
 * --port-file F --local-agents N` (MESHD_BIN_DIR defaults to this program's
 * directory), in a child process, and stops it with SIGTERM at the end.
 *
 * Command case: CreateSession; on one Submit stream CreateMesh {gpu: N}, Factory
 * zeros [4], then a writer thread pipelines Call add(t, 1.0) with a fresh result
 * each, dropping the results every B calls, while a reader thread consumes the
 * SubmitReplies; a Sync at the end is waited for. Counts are replies (every
 * command is answered once); CPU comes from /proc/<pid>/stat.
 *
 * Memory case: one agent, no drops; K Call results kept live (sent --batch at a
 * time), Sync; VmRSS of the server and of the agent before and after, per live
 * tensor.
 *
 * Where the backlog sits when the measured window closes: in_flight_at_stop
 * counts commands written and not yet answered (in the client's and server's
 * transport, not yet read by the server: bounded by the server's
 * --stream-window-bytes), server_queued_at_stop the session's accepted commands
 * the agents have not run yet (ListSessions queued_commands: bounded by
 * --session-max-queued). sync_wait_ms is the final Sync's wait for both.
 *
 * Prints JSON lines on stdout (the baseline's, then one per case); progress and
 * diagnostics go to stderr. Not a test: run by hand. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "grpc/health/v1/health.pb-c.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "meshd.h"
#include "rpc.h"
#include "bench_server.h"
#include "rpc_baseline.h"

#define SVC "/meshd.v1.TensorService/"
#define READ_TIMEOUT_MS 15000 /* a reply gap this long is a stall */

static void usage(void) {
  fprintf(stderr,
          "usage: bench_commands [--seconds N] [--warmup S] [--agents 1,4] [--drop-batch B] [--batch K]\n"
          "                      [--live-tensors K] [--memory-seconds M] [--skip-baseline]\n"
          "                      [--c-client] [--unary-seconds U]\n");
  exit(2);
}

/* Context switches of every thread of the agents (bench_server's proc_ctx_switches). */
static int64_t agents_ctx_switches(const pid_t *pids, int n) {
  int64_t sum = 0;
  for (int i = 0; i < n; i++) {
    int64_t v = proc_ctx_switches(pids[i]);
    if (v > 0) sum += v;
  }
  return sum;
}

/* ------------------------------------------------------------------ JSON */

/* bench_json_num keeps one decimal; ratios and small costs need more. */
static void json_numf(bench_json_t *j, const char *key, double value, int prec) {
  if (j->len >= sizeof j->buf) return;
  size_t room = sizeof j->buf - j->len;
  int n = isfinite(value) ? snprintf(j->buf + j->len, room, ",\"%s\":%.*f", key, prec, value)
                          : snprintf(j->buf + j->len, room, ",\"%s\":null", key);
  j->len += n > 0 ? (size_t)n : 0;
}

/* ------------------------------------------------------------------ session, stream */

typedef struct {
  rpc_channel_t *ch;
  rpc_stream_t *st;
  char id[128], token[128];
  rpc_md_t md[2];
} client_t;

static int client_open(client_t *c, const char *target) {
  memset(c, 0, sizeof *c);
  rpc_channel_opts_t co = {.own_connection = true};
  c->ch = rpc_channel_create(target, &co);
  if (!c->ch || !rpc_channel_wait_ready(c->ch, 5000)) {
    fprintf(stderr, "bench_commands: %s is not ready\n", target);
    return -1;
  }
  if (bench_create_session(c->ch, c->id, c->token, c->md) != 0) return -1;
  c->st = rpc_stream_open(c->ch, SVC "Submit", c->md, 2, 0);
  if (!c->st) {
    fprintf(stderr, "bench_commands: Submit did not open\n");
    return -1;
  }
  return 0;
}

static void client_close(client_t *c) {
  if (c->st) rpc_stream_destroy(c->st);
  if (c->ch) rpc_channel_destroy(c->ch);
  memset(c, 0, sizeof *c);
}

/* Reads one reply; returns 0 if it answers seq without an error. */
static int read_ok(client_t *c, uint64_t seq, const char *what) {
  ProtobufCMessage *m = NULL;
  int r = rpc_stream_read(c->st, &meshd__v1__submit_reply__descriptor, &m, READ_TIMEOUT_MS);
  if (r != 1) {
    rpc_status_t st = {0};
    if (r == -2) rpc_stream_cancel(c->st);
    grpc_status_code code = r == 0 || r == -2 ? rpc_stream_finish(c->st, &st) : GRPC_STATUS_OK;
    fprintf(stderr, "bench_commands: %s: no reply (read %d; stream status %d: %s)\n", what, r,
            code, st.message);
    return -1;
  }
  Meshd__V1__SubmitReply *rep = (Meshd__V1__SubmitReply *)m;
  int rc = 0;
  if (!rep->result || rep->result->seq != seq || rep->result->error) {
    fprintf(stderr, "bench_commands: %s: bad reply (seq %llu, error %s)\n", what,
            rep->result ? (unsigned long long)rep->result->seq : 0ULL,
            rep->result && rep->result->error ? rep->result->error->message : "none");
    rc = -1;
  }
  protobuf_c_message_free_unpacked(m, NULL);
  return rc;
}

/* Refs: the mesh is 1, the input tensor 2, results from 3 up. */
#define MESH_REF 1
#define INPUT_REF 2

static int write_cmd(client_t *c, Meshd__V1__Command *cmd) {
  return rpc_stream_write(c->st, &cmd->base, false);
}

/* CreateMesh {gpu: n}, Factory zeros [4], Sync; each answered in turn. */
static int setup_session(client_t *c, int nagents, uint64_t *next_seq) {
  Meshd__V1__Dim dim = MESHD__V1__DIM__INIT;
  dim.name = "gpu";
  dim.size = nagents;
  Meshd__V1__Dim *dims[1] = {&dim};
  Meshd__V1__CreateMesh cm = MESHD__V1__CREATE_MESH__INIT;
  cm.ref = MESH_REF;
  cm.n_dims = 1;
  cm.dims = dims;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.seq = 1;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_CREATE_MESH;
  cmd.create_mesh = &cm;
  if (write_cmd(c, &cmd) || read_ok(c, 1, "CreateMesh")) return -1;

  int64_t shape[1] = {4};
  Meshd__V1__Factory f = MESHD__V1__FACTORY__INIT;
  f.ref = INPUT_REF;
  f.mesh = MESH_REF;
  f.kind = "zeros";
  f.n_shape = 1;
  f.shape = shape;
  f.dtype = MESHD__V1__DTYPE__DTYPE_FLOAT32;
  cmd = (Meshd__V1__Command)MESHD__V1__COMMAND__INIT;
  cmd.seq = 2;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_FACTORY;
  cmd.factory = &f;
  if (write_cmd(c, &cmd) || read_ok(c, 2, "Factory")) return -1;

  Meshd__V1__Sync sy = MESHD__V1__SYNC__INIT;
  cmd = (Meshd__V1__Command)MESHD__V1__COMMAND__INIT;
  cmd.seq = 3;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_SYNC;
  cmd.sync = &sy;
  if (write_cmd(c, &cmd) || read_ok(c, 3, "Sync")) return -1;
  *next_seq = 4;
  return 0;
}

/* ------------------------------------------------------------------ the pipelined run */

typedef struct {
  rpc_stream_t *s;
  const client_t *client; /* for ListSessions at the window's close */
  pid_t server;
  const pid_t *agents;
  int nagents;
  /* knobs */
  int drop_batch;        /* 0: never drop */
  int batch;             /* Calls per Submit message (<= 1: one each) */
  uint64_t max_calls;    /* 0: until stop */
  int64_t deadline_ns;   /* the writer stops making calls after this (0: none) */
  int64_t warm_end_ns, measure_ns; /* 0 measure_ns: no window */
  /* writer */
  uint64_t seq, ref;
  uint64_t calls_written, drops_written;
  _Atomic uint64_t sync_seq;
  int64_t stop_ns, sync_sent_ns;
  uint64_t written_at_stop;
  int write_err;
  /* reader */
  atomic_bool stop;
  uint64_t replies, call_replies, errors;
  char first_error[512];
  uint64_t n0, n1, c0, c1; /* replies and call replies at t0, t1 */
  int64_t t0, t1, sync_ns;
  int64_t srv_cpu0, srv_cpu1, srv_cpu_sync, ag_cpu0, ag_cpu1, ag_cpu_sync, self_cpu0, self_cpu1;
  int64_t rss0, rss1;
  int64_t queued_at_stop; /* the server's queued_commands for the session (-1: unknown) */
  int read_end;
  bool sync_ok;
} run_t;

/* The benchmark's tiny command: Call add(input, 1.0) into *result. The caller
 * keeps t alive while the command is used; seq and *result are its to set. */
typedef struct {
  Meshd__V1__Arg a_in, a_f;
  Meshd__V1__Arg *args[2];
  Meshd__V1__Call call;
  Meshd__V1__Command cmd;
} tiny_add_t;

static void tiny_add_init(tiny_add_t *t, uint64_t *result) {
  meshd__v1__arg__init(&t->a_in);
  t->a_in.value_case = MESHD__V1__ARG__VALUE_REF;
  t->a_in.ref = INPUT_REF;
  meshd__v1__arg__init(&t->a_f);
  t->a_f.value_case = MESHD__V1__ARG__VALUE_F;
  t->a_f.f = 1.0;
  t->args[0] = &t->a_in;
  t->args[1] = &t->a_f;
  meshd__v1__call__init(&t->call);
  t->call.op = "add";
  t->call.n_args = 2;
  t->call.args = t->args;
  t->call.n_results = 1;
  t->call.results = result;
  meshd__v1__command__init(&t->cmd);
  t->cmd.kind_case = MESHD__V1__COMMAND__KIND_CALL;
  t->cmd.call = &t->call;
}

static void *writer(void *p) {
  run_t *r = p;
  uint64_t result = 0;
  tiny_add_t add;
  tiny_add_init(&add, &result);
  Meshd__V1__Call call = add.call;
  Meshd__V1__Command cmd = add.cmd;
  cmd.call = &call;

  size_t cap = r->drop_batch > 0 ? (size_t)r->drop_batch : 1;
  uint64_t *pending = malloc(cap * sizeof *pending);
  size_t npending = 0;
  Meshd__V1__Drop drop = MESHD__V1__DROP__INIT;
  drop.refs = pending;
  Meshd__V1__Command dcmd = MESHD__V1__COMMAND__INIT;
  dcmd.kind_case = MESHD__V1__COMMAND__KIND_DROP;
  dcmd.drop = &drop;
  if (!pending) {
    r->write_err = 1;
    atomic_store(&r->stop, true);
  }

  /* --batch K: K Calls (each with its own result ref) in one batch Command. */
  int k = r->batch > 1 ? r->batch : 1;
  Meshd__V1__Call *bcalls = calloc((size_t)k, sizeof *bcalls);
  Meshd__V1__Command *bcmds = calloc((size_t)k, sizeof *bcmds);
  Meshd__V1__Command **bptrs = calloc((size_t)k, sizeof *bptrs);
  uint64_t *bresults = calloc((size_t)k, sizeof *bresults);
  Meshd__V1__Command batch = MESHD__V1__COMMAND__INIT;
  if (!bcalls || !bcmds || !bptrs || !bresults) {
    r->write_err = 1;
    atomic_store(&r->stop, true);
  }
  for (int i = 0; bptrs && i < k; i++) {
    bcalls[i] = call;
    bcalls[i].results = &bresults[i];
    bcmds[i] = cmd;
    bcmds[i].call = &bcalls[i];
    bptrs[i] = &bcmds[i];
  }
  batch.batch = bptrs;

  while (!atomic_load(&r->stop)) {
    if (r->max_calls && r->calls_written >= r->max_calls) break;
    if (r->deadline_ns && (r->calls_written & 1023) < (uint64_t)k && bench_now_ns() > r->deadline_ns)
      break;
    /* K Calls in one batch message, or one Call alone; their results pend for the Drops. */
    const ProtobufCMessage *msg = &cmd.base;
    uint64_t *made = &result;
    if (k > 1) {
      for (int i = 0; i < k; i++) {
        bcmds[i].seq = r->seq++;
        bresults[i] = r->ref++;
      }
      batch.n_batch = (size_t)k;
      msg = &batch.base;
      made = bresults;
    } else {
      cmd.seq = r->seq++;
      result = r->ref++;
    }
    if (rpc_stream_write(r->s, msg, false) != 0) {
      r->write_err = 1;
      goto out;
    }
    r->calls_written += (uint64_t)k;
    for (int i = 0; r->drop_batch > 0 && i < k; i++) {
      pending[npending++] = made[i];
      if (npending == cap) {
        dcmd.seq = r->seq++;
        drop.n_refs = npending;
        if (rpc_stream_write(r->s, &dcmd.base, false) != 0) {
          r->write_err = 1;
          goto out;
        }
        r->drops_written++;
        npending = 0;
      }
    }
  }
  r->stop_ns = bench_now_ns();
  r->written_at_stop = r->calls_written + r->drops_written;
  if (npending) {
    dcmd.seq = r->seq++;
    drop.n_refs = npending;
    if (rpc_stream_write(r->s, &dcmd.base, false) != 0) {
      r->write_err = 1;
      goto out;
    }
    r->drops_written++;
  }
  Meshd__V1__Sync sy = MESHD__V1__SYNC__INIT;
  Meshd__V1__Command scmd = MESHD__V1__COMMAND__INIT;
  scmd.seq = r->seq++;
  scmd.kind_case = MESHD__V1__COMMAND__KIND_SYNC;
  scmd.sync = &sy;
  atomic_store(&r->sync_seq, scmd.seq);
  r->sync_sent_ns = bench_now_ns();
  if (rpc_stream_write(r->s, &scmd.base, true) != 0) r->write_err = 1;
out:
  free(pending);
  free(bcalls);
  free(bcmds);
  free(bptrs);
  free(bresults);
  return NULL;
}

static const char *kind_name(int kind) {
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&meshd__v1__error_kind__descriptor, kind);
  return v ? v->name : "?";
}

/* The server's count of the session's accepted commands not yet run on the
 * agents (SessionInfo.queued_commands); -1 if unknown. */
static int64_t server_queued(const client_t *c) {
  if (!c) return -1;
  Meshd__V1__ListSessionsRequest req = MESHD__V1__LIST_SESSIONS_REQUEST__INIT;
  ProtobufCMessage *rep = NULL;
  if (rpc_unary(c->ch, SVC "ListSessions", &req.base, &meshd__v1__list_sessions_reply__descriptor,
                &rep, NULL, 0, 5000, NULL) != GRPC_STATUS_OK)
    return -1;
  int64_t v = -1;
  Meshd__V1__ListSessionsReply *r = (Meshd__V1__ListSessionsReply *)rep;
  for (size_t i = 0; i < r->n_sessions; i++)
    if (strcmp(r->sessions[i]->session_id, c->id) == 0) v = (int64_t)r->sessions[i]->queued_commands;
  protobuf_c_message_free_unpacked(rep, NULL);
  return v;
}

static void *reader(void *p) {
  run_t *r = p;
  int64_t next_progress = bench_now_ns() + 5 * 1000000000LL;
  for (;;) {
    ProtobufCMessage *m = NULL;
    int rc = rpc_stream_read(r->s, &meshd__v1__submit_reply__descriptor, &m, READ_TIMEOUT_MS);
    if (rc != 1) {
      r->read_end = rc;
      if (rc == -2) {
        fprintf(stderr,
                "bench_commands: STALL: no reply for %d ms; %llu calls and %llu drops written, "
                "%llu replies read, sync %s\n",
                READ_TIMEOUT_MS, (unsigned long long)r->calls_written,
                (unsigned long long)r->drops_written, (unsigned long long)r->replies,
                atomic_load(&r->sync_seq) ? "sent" : "not sent");
        rpc_stream_cancel(r->s);
      }
      atomic_store(&r->stop, true);
      return NULL;
    }
    Meshd__V1__SubmitReply *rep = (Meshd__V1__SubmitReply *)m;
    const Meshd__V1__CommandResult *res = rep->result;
    size_t nres = rep->n_results ? rep->n_results : 1; /* a batch's answers, or one */
    for (size_t i = 0; i < nres; i++) {
      if (rep->n_results) res = rep->results[i];
      r->replies++;
      if (res && res->n_tensors > 0) r->call_replies++;
      if (!res || res->error) {
        if (r->errors++ == 0)
          snprintf(r->first_error, sizeof r->first_error, "seq %llu: %s: %s",
                   res ? (unsigned long long)res->seq : 0ULL,
                   res && res->error ? kind_name(res->error->kind) : "no result",
                   res && res->error ? res->error->message : "");
        atomic_store(&r->stop, true);
      }
    }
    uint64_t sseq = atomic_load(&r->sync_seq);
    if (res && sseq && res->seq == sseq) {
      r->sync_ns = bench_now_ns();
      r->sync_ok = res->error == NULL;
      r->srv_cpu_sync = proc_cpu_us(r->server);
      r->ag_cpu_sync = agents_cpu_us(r->agents, r->nagents);
    }
    protobuf_c_message_free_unpacked(m, NULL);
    int64_t now = bench_now_ns();
    if (r->measure_ns) {
      if (!r->t0 && now >= r->warm_end_ns) {
        r->t0 = now;
        r->n0 = r->replies;
        r->c0 = r->call_replies;
        r->srv_cpu0 = proc_cpu_us(r->server);
        r->ag_cpu0 = agents_cpu_us(r->agents, r->nagents);
        r->self_cpu0 = self_cpu_us();
        r->rss0 = proc_status_bytes(r->server, "VmRSS");
      } else if (r->t0 && !r->t1 && now >= r->t0 + r->measure_ns) {
        r->t1 = now;
        r->n1 = r->replies;
        r->c1 = r->call_replies;
        r->srv_cpu1 = proc_cpu_us(r->server);
        r->ag_cpu1 = agents_cpu_us(r->agents, r->nagents);
        r->self_cpu1 = self_cpu_us();
        r->rss1 = proc_status_bytes(r->server, "VmRSS");
        atomic_store(&r->stop, true);
        r->queued_at_stop = server_queued(r->client);
      }
    } else if (now >= next_progress) {
      fprintf(stderr, "  ... %llu replies\n", (unsigned long long)r->replies);
      next_progress = now + 5 * 1000000000LL;
    }
  }
}

/* Runs writer + reader to the end of the stream; returns 0 if all went well. */
static int run_pipeline(run_t *r) {
  pthread_t w, rd;
  if (pthread_create(&rd, NULL, reader, r) != 0) return -1;
  if (pthread_create(&w, NULL, writer, r) != 0) {
    rpc_stream_cancel(r->s);
    pthread_join(rd, NULL);
    return -1;
  }
  pthread_join(w, NULL);
  pthread_join(rd, NULL);
  rpc_status_t st = {0};
  grpc_status_code code = rpc_stream_finish(r->s, &st);
  int rc = 0;
  if (code != GRPC_STATUS_OK || r->write_err || r->read_end != 0 || r->errors || !r->sync_ok) {
    fprintf(stderr,
            "bench_commands: Submit failed: stream status %d (%s) [%s], write_err %d, read_end %d, "
            "%llu error replies (first: %s), sync %s; %llu calls + %llu drops written, %llu "
            "replies\n",
            code, st.message, st.kind, r->write_err, r->read_end, (unsigned long long)r->errors,
            r->first_error, r->sync_ok ? "answered" : "NOT answered",
            (unsigned long long)r->calls_written, (unsigned long long)r->drops_written,
            (unsigned long long)r->replies);
    rc = -1;
  }
  return rc;
}

/* ------------------------------------------------------------------ cases */

typedef struct {
  double seconds, warmup;
  double unary_seconds; /* the unary latency phase; < 0: seconds */
  int drop_batch, batch;
  uint64_t live_tensors;
  double memory_seconds;
} opts_t;

/* ------------------------------------------------------------------ unary latency */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Latencies of one kind of call, in µs. */
typedef struct {
  double *v;
  size_t n, cap;
} lat_t;

static double lat_percentile(lat_t *l, int pct) {
  if (l->n == 0) return NAN;
  qsort(l->v, l->n, sizeof *l->v, cmp_double);
  return l->v[l->n * (size_t)pct / 100];
}

/* Unary latency, in rounds: each round one tiny Call (add of the input and
 * 1.0) per unary Execute, one at a time, for a tenth of `seconds`, then, with
 * an echo channel, as long of one echo at a time. The first round is not
 * measured. Interleaving puts both under the same conditions however the
 * machine's load drifts during the run. p50 and p99 of the round trips in µs
 * (the server answers once it accepted the command); the echo's NAN without
 * echo. */
#define UNARY_ROUNDS 10
typedef struct {
  rpc_channel_t *echo; /* NULL: no echo rounds */
  pid_t echo_pid, server;
  const pid_t *agents;
  int nagents;
  /* out: */
  double p50, p99, echo_p50, echo_p99;
  /* CPU per call in the measured rounds: meshd and its agents during the
   * Execute slices, the echo server during the echo slices. */
  double server_cpu_us, agents_cpu_us, echo_cpu_us;
  /* Context switches per call of the server's and the echo server's threads:
   * the handoffs between threads that a unary call costs. */
  double server_ctxsw, echo_ctxsw, agents_ctxsw;
} unary_t;

static int unary_latency(client_t *c, uint64_t *seq, uint64_t *ref, double seconds, unary_t *u) {
  uint64_t result = 0;
  tiny_add_t add;
  tiny_add_init(&add, &result);
  Meshd__V1__Command *cmd = &add.cmd;
  lat_t ex = {.cap = 1 << 20}, ec = {.cap = 1 << 20};
  ex.v = malloc(ex.cap * sizeof *ex.v);
  ec.v = malloc(ec.cap * sizeof *ec.v);
  int rc = ex.v && ec.v ? 0 : -1;
  int64_t slice = (int64_t)(seconds * 1e9 / UNARY_ROUNDS);
  int64_t srv_cpu = 0, ag_cpu = 0, echo_cpu = 0, srv_sw = 0, echo_sw = 0, ag_sw = 0;
  for (int round = 0; round <= UNARY_ROUNDS && rc == 0; round++) {
    int64_t srv0 = proc_cpu_us(u->server), ag0 = agents_cpu_us(u->agents, u->nagents);
    int64_t sw0 = proc_ctx_switches(u->server), agsw0 = agents_ctx_switches(u->agents, u->nagents);
    int64_t end = bench_now_ns() + slice;
    for (int64_t now = bench_now_ns(); now < end && ex.n < ex.cap; now = bench_now_ns()) {
      cmd->seq = (*seq)++;
      result = (*ref)++;
      ProtobufCMessage *resp = NULL;
      rpc_status_t st = {0};
      int64_t t0 = bench_now_ns();
      grpc_status_code code = rpc_unary(c->ch, SVC "Execute", &cmd->base,
                                        &meshd__v1__command_result__descriptor, &resp, c->md, 2,
                                        READ_TIMEOUT_MS, &st);
      int64_t t1 = bench_now_ns();
      bool ok = code == GRPC_STATUS_OK && !((Meshd__V1__CommandResult *)resp)->error;
      if (resp) protobuf_c_message_free_unpacked(resp, NULL);
      if (!ok) {
        fprintf(stderr, "bench_commands: unary Execute failed (status %d: %s)\n", code, st.message);
        rc = -1;
        break;
      }
      if (round > 0) ex.v[ex.n++] = (double)(t1 - t0) / 1e3;
    }
    if (round > 0) {
      srv_cpu += proc_cpu_us(u->server) - srv0;
      ag_cpu += agents_cpu_us(u->agents, u->nagents) - ag0;
      srv_sw += proc_ctx_switches(u->server) - sw0;
      ag_sw += agents_ctx_switches(u->agents, u->nagents) - agsw0;
    }
    int64_t echo0 = u->echo ? proc_cpu_us(u->echo_pid) : 0;
    int64_t esw0 = u->echo ? proc_ctx_switches(u->echo_pid) : 0;
    end = bench_now_ns() + slice;
    for (int64_t now = bench_now_ns(); u->echo && rc == 0 && now < end && ec.n < ec.cap;
         now = bench_now_ns()) {
      int64_t t0 = bench_now_ns();
      if (rpc_baseline_echo_once(u->echo) != 0) rc = -1;
      int64_t t1 = bench_now_ns();
      if (round > 0) ec.v[ec.n++] = (double)(t1 - t0) / 1e3;
    }
    if (round > 0 && u->echo) {
      echo_cpu += proc_cpu_us(u->echo_pid) - echo0;
      echo_sw += proc_ctx_switches(u->echo_pid) - esw0;
    }
  }
  u->server_ctxsw = ex.n ? (double)srv_sw / (double)ex.n : NAN;
  u->agents_ctxsw = ex.n ? (double)ag_sw / (double)ex.n : NAN;
  u->echo_ctxsw = ec.n ? (double)echo_sw / (double)ec.n : NAN;
  u->server_cpu_us = ex.n ? (double)srv_cpu / (double)ex.n : NAN;
  u->agents_cpu_us = ex.n ? (double)ag_cpu / (double)ex.n : NAN;
  u->echo_cpu_us = ec.n ? (double)echo_cpu / (double)ec.n : NAN;
  u->p50 = lat_percentile(&ex, 50);
  u->p99 = lat_percentile(&ex, 99);
  u->echo_p50 = lat_percentile(&ec, 50);
  u->echo_p99 = lat_percentile(&ec, 99);
  if (ex.n == 0) rc = -1;
  free(ex.v);
  free(ec.v);
  return rc;
}

static int commands_case(int nagents, const opts_t *o, double baseline_bidi,
                         const bench_echo_child_t *echo_child, double *cps_out) {
  server_t srv;
  /* --drop-batch may pass 4096 refs per Drop: the session limits would
   * refuse it. */
  static const char *const extra[] = {"--session-max-refs", "0", "--max-command-refs", "0"};
  if (server_start(&srv, nagents, extra, 4) != 0) return -1;
  fprintf(stderr, "bench_commands: meshd %d on %s with %d agent(s)\n", (int)srv.pid, srv.target,
          nagents);
  client_t c;
  run_t r = {0};
  int rc = client_open(&c, srv.target);
  if (rc == 0) rc = setup_session(&c, nagents, &r.seq);
  if (rc == 0) {
    r.s = c.st;
    r.client = &c;
    r.queued_at_stop = -1;
    r.server = srv.pid;
    r.agents = srv.agents;
    r.nagents = srv.nagents;
    r.ref = INPUT_REF + 1;
    r.drop_batch = o->drop_batch;
    r.batch = o->batch;
    r.warm_end_ns = bench_now_ns() + (int64_t)(o->warmup * 1e9);
    r.measure_ns = (int64_t)(o->seconds * 1e9);
    rc = run_pipeline(&r);
    if (!r.t1) rc = -1;
  }
  unary_t u = {.server = srv.pid, .agents = srv.agents, .nagents = srv.nagents,
               .p50 = NAN, .p99 = NAN, .echo_p50 = NAN, .echo_p99 = NAN,
               .server_ctxsw = NAN, .echo_ctxsw = NAN};
  if (rc == 0 && echo_child) {
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", echo_child->port);
    rpc_channel_opts_t co = {.own_connection = true};
    u.echo = rpc_channel_create(target, &co);
    u.echo_pid = echo_child->pid;
    if (!u.echo || !rpc_channel_wait_ready(u.echo, 5000)) {
      fprintf(stderr, "bench_commands: the echo server %s is not ready\n", target);
      rc = -1;
    }
  }
  double unary_s = o->unary_seconds < 0 ? o->seconds : o->unary_seconds;
  if (rc == 0 && unary_latency(&c, &r.seq, &r.ref, unary_s, &u) != 0) rc = -1;
  if (u.echo) rpc_channel_destroy(u.echo);
  int64_t rss_end = proc_status_bytes(srv.pid, "VmRSS");
  int64_t hwm = proc_status_bytes(srv.pid, "VmHWM");
  pid_t agents_end[MAX_AGENTS];
  int nagents_end = proc_children(srv.pid, agents_end, MAX_AGENTS);
  int restarted = 0;
  for (int i = 0; i < nagents_end; i++) {
    bool known = false;
    for (int k = 0; k < srv.nagents; k++) known |= agents_end[i] == srv.agents[k];
    restarted += !known;
  }
  client_close(&c);
  server_stop(&srv);
  int warns, errors;
  log_scan(&srv, &warns, &errors);
  if (srv.exit_status != 0 || srv.agents_left || restarted || nagents_end != nagents) rc = -1;

  double secs = r.t1 > r.t0 ? (double)(r.t1 - r.t0) / 1e9 : NAN;
  double cmds = (double)(r.n1 - r.n0), calls = (double)(r.c1 - r.c0);
  double cps = cmds / secs;
  *cps_out = cps;
  /* Everything from t0 to the Sync's answer: includes the drain of queued work. */
  double cmds_to_end = (double)(r.replies - r.n0);
  bench_json_t j;
  bench_json_begin(&j, "commands");
  bench_json_num(&j, "agents", nagents);
  bench_json_num(&j, "seconds", secs);
  bench_json_num(&j, "commands_per_s", cps);
  bench_json_num(&j, "calls_per_s", calls / secs);
  bench_json_num(&j, "baseline_bidi_msgs_per_s", baseline_bidi);
  json_numf(&j, "ratio_to_bidi", cps / baseline_bidi, 3);
  json_numf(&j, "unary_execute_p50_us", u.p50, 1);
  json_numf(&j, "unary_execute_p99_us", u.p99, 1);
  json_numf(&j, "baseline_unary_p50_us", u.echo_p50, 1);
  json_numf(&j, "baseline_unary_p99_us", u.echo_p99, 1);
  json_numf(&j, "unary_p50_ratio_to_echo", u.p50 / u.echo_p50, 3);
  json_numf(&j, "unary_server_cpu_us_per_call", u.server_cpu_us, 2);
  json_numf(&j, "unary_agents_cpu_us_per_call", u.agents_cpu_us, 2);
  json_numf(&j, "baseline_unary_server_cpu_us_per_call", u.echo_cpu_us, 2);
  json_numf(&j, "unary_server_ctx_switches_per_call", u.server_ctxsw, 2);
  json_numf(&j, "baseline_unary_ctx_switches_per_call", u.echo_ctxsw, 2);
  json_numf(&j, "unary_agents_ctx_switches_per_call", u.agents_ctxsw, 2);
  json_numf(&j, "server_cpu_us_per_command", (double)(r.srv_cpu1 - r.srv_cpu0) / cmds, 2);
  json_numf(&j, "server_cpu_us_per_command_to_sync",
            r.srv_cpu_sync > 0 ? (double)(r.srv_cpu_sync - r.srv_cpu0) / cmds_to_end : NAN, 2);
  json_numf(&j, "agents_cpu_us_per_command", (double)(r.ag_cpu1 - r.ag_cpu0) / cmds, 2);
  json_numf(&j, "client_cpu_us_per_command", (double)(r.self_cpu1 - r.self_cpu0) / cmds, 2);
  json_numf(&j, "server_cpu_util", (double)(r.srv_cpu1 - r.srv_cpu0) / (secs * 1e6), 3);
  json_numf(&j, "agents_cpu_util", (double)(r.ag_cpu1 - r.ag_cpu0) / (secs * 1e6), 3);
  json_numf(&j, "sync_wait_ms",
            r.sync_ns ? (double)(r.sync_ns - r.sync_sent_ns) / 1e6 : NAN, 1);
  /* Written but not yet answered when the window closed: commands buffered in
   * the client's and server's transport, which the Sync waits behind. */
  bench_json_num(&j, "in_flight_at_stop", (double)r.written_at_stop - (double)r.n1);
  /* Of those answered, accepted by the server and not yet run on the agents
   * (its flow control window; -1: the server does not say). */
  bench_json_num(&j, "server_queued_at_stop", (double)r.queued_at_stop);
  bench_json_num(&j, "drop_batch", o->drop_batch);
  bench_json_num(&j, "batch", o->batch > 1 ? o->batch : 1);
  bench_json_num(&j, "calls_total", (double)r.calls_written);
  bench_json_num(&j, "drops_total", (double)r.drops_written);
  bench_json_num(&j, "replies_total", (double)r.replies);
  bench_json_num(&j, "error_replies", (double)r.errors);
  json_numf(&j, "server_rss_growth_bytes_per_command",
            r.rss1 > 0 && r.rss0 > 0 ? (double)(r.rss1 - r.rss0) / cmds : NAN, 1);
  bench_json_num(&j, "server_rss_start_bytes", (double)r.rss0);
  bench_json_num(&j, "server_rss_end_bytes", (double)rss_end);
  bench_json_num(&j, "server_rss_peak_bytes", (double)hwm);
  bench_json_num(&j, "agents_restarted", restarted);
  bench_json_num(&j, "server_exit", srv.exit_status);
  bench_json_num(&j, "agents_left", srv.agents_left);
  bench_json_num(&j, "log_warn_lines", warns);
  bench_json_num(&j, "log_error_lines", errors);
  bench_json_str(&j, "status", rc == 0 ? "ok" : "failed");
  bench_json_end(&j, stdout);
  server_cleanup(&srv, rc != 0 || warns || errors);
  return rc;
}

/* ------------------------------------------------------------------ the C client's pipeline */

/* The command case's loop through the C client library: Call add(input, 1.0)
 * with meshd_session_call on a pipelined session, a Drop every drop_batch
 * results, as fast as one thread goes. Commands per second are the answers
 * the pipeline received in the window (meshd_session_pipeline_stats). */
static int c_client_case(int nagents, const opts_t *o, double baseline_bidi, double raw_cps) {
  server_t srv;
  static const char *const extra[] = {"--session-max-refs", "0", "--max-command-refs", "0"};
  if (server_start(&srv, nagents, extra, 4) != 0) return -1;
  fprintf(stderr, "bench_commands: c_client: meshd %d on %s with %d agent(s)\n", (int)srv.pid,
          srv.target, nagents);
  meshd_err_t err;
  meshd_client_t *c = meshd_connect(srv.target, READ_TIMEOUT_MS, &err);
  meshd_session_t *s = c ? meshd_session_open(c, "bench_commands-c", &err) : NULL;
  int rc = s ? 0 : -1;
  meshd_ref_t mesh = 0, input = 0;
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {nagents}, shape[] = {4};
  meshd_pipeline_options_t po = MESHD_PIPELINE_OPTIONS_INIT;
  if (rc == 0 && (meshd_session_create_mesh(s, dims, sizes, 1, &mesh) != MESHD_E_OK ||
                  meshd_session_factory(s, mesh, "zeros", shape, 1, 0, &input) != MESHD_E_OK ||
                  meshd_session_sync(s) != MESHD_E_OK ||
                  meshd_session_set_pipeline(s, &po) != MESHD_E_OK))
    rc = -1;
  size_t cap = o->drop_batch > 0 ? (size_t)o->drop_batch : 1, np = 0;
  meshd_ref_t *pending = malloc(cap * sizeof *pending);
  if (!pending) rc = -1;
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = input}, {.type = MESHD_ARG_FLOAT, .f = 1.0}};
  meshd_pipeline_stats_t st0 = {0}, st1 = {0}, st_end = {0};
  int64_t t0 = 0, t1 = 0, sync_ns = 0;
  int64_t srv0 = 0, srv1 = 0, ag0 = 0, ag1 = 0, self0 = 0, self1 = 0, agsw0 = 0, agsw1 = 0;
  uint64_t calls = 0;
  int64_t warm_end = bench_now_ns() + (int64_t)(o->warmup * 1e9);
  while (rc == 0) {
    meshd_ref_t r;
    if (meshd_session_call(s, "add", args, 2, &r) != MESHD_E_OK) {
      rc = -1;
      break;
    }
    calls++;
    if (o->drop_batch > 0) {
      pending[np++] = r;
      if (np == cap) {
        if (meshd_session_drop(s, pending, np) != MESHD_E_OK) rc = -1;
        np = 0;
      }
    }
    if ((calls & 255) != 0) continue;
    int64_t now = bench_now_ns();
    if (!t0 && now >= warm_end) {
      meshd_session_pipeline_stats(s, &st0);
      t0 = now;
      srv0 = proc_cpu_us(srv.pid);
      ag0 = agents_cpu_us(srv.agents, srv.nagents);
      agsw0 = agents_ctx_switches(srv.agents, srv.nagents);
      self0 = self_cpu_us();
    } else if (t0 && now >= t0 + (int64_t)(o->seconds * 1e9)) {
      meshd_session_pipeline_stats(s, &st1);
      t1 = bench_now_ns();
      srv1 = proc_cpu_us(srv.pid);
      ag1 = agents_cpu_us(srv.agents, srv.nagents);
      agsw1 = agents_ctx_switches(srv.agents, srv.nagents);
      self1 = self_cpu_us();
      break;
    }
  }
  if (rc == 0 && np && meshd_session_drop(s, pending, np) != MESHD_E_OK) rc = -1;
  int64_t sync0 = bench_now_ns();
  if (rc == 0 && meshd_session_sync(s) != MESHD_E_OK) rc = -1;
  sync_ns = bench_now_ns() - sync0;
  if (rc != 0 && c)
    fprintf(stderr, "bench_commands: c_client: %s\n", meshd_last_error(c)->message);
  else if (rc != 0)
    fprintf(stderr, "bench_commands: c_client: no session: %s\n", meshd_strerror(err));
  if (s) meshd_session_pipeline_stats(s, &st_end);
  free(pending);
  meshd_session_close(s);
  meshd_close(c);
  server_stop(&srv);
  int warns, errors;
  log_scan(&srv, &warns, &errors);
  if (srv.exit_status != 0 || srv.agents_left) rc = -1;

  double secs = t1 > t0 ? (double)(t1 - t0) / 1e9 : NAN;
  double cmds = (double)(st1.commands_answered - st0.commands_answered);
  double msgs = (double)(st1.messages_sent - st0.messages_sent);
  double cps = cmds / secs;
  bench_json_t j;
  bench_json_begin(&j, "c_client");
  bench_json_num(&j, "agents", nagents);
  bench_json_num(&j, "seconds", secs);
  bench_json_num(&j, "commands_per_s", cps);
  bench_json_num(&j, "baseline_bidi_msgs_per_s", baseline_bidi);
  json_numf(&j, "ratio_to_bidi", cps / baseline_bidi, 3);
  bench_json_num(&j, "raw_commands_per_s", raw_cps);
  json_numf(&j, "ratio_to_raw_commands", cps / raw_cps, 3);
  json_numf(&j, "commands_per_message", cmds / msgs, 1);
  json_numf(&j, "delay_flush_share",
            (double)(st1.delay_flushes - st0.delay_flushes) / msgs, 3);
  json_numf(&j, "commands_per_reply", cmds / (double)(st1.replies - st0.replies), 1);
  json_numf(&j, "server_cpu_us_per_command", (double)(srv1 - srv0) / cmds, 2);
  json_numf(&j, "agents_cpu_us_per_command", (double)(ag1 - ag0) / cmds, 2);
  json_numf(&j, "agents_ctx_switches_per_command", (double)(agsw1 - agsw0) / cmds, 3);
  json_numf(&j, "client_cpu_us_per_command", (double)(self1 - self0) / cmds, 2);
  json_numf(&j, "sync_wait_ms", (double)sync_ns / 1e6, 1);
  bench_json_num(&j, "max_batch", (double)po.max_batch);
  bench_json_num(&j, "max_delay_us", po.max_delay_us);
  bench_json_num(&j, "drop_batch", o->drop_batch);
  bench_json_num(&j, "commands_total", (double)st_end.commands_answered);
  bench_json_num(&j, "rejected", (double)st_end.rejected);
  bench_json_num(&j, "server_exit", srv.exit_status);
  bench_json_num(&j, "agents_left", srv.agents_left);
  bench_json_num(&j, "log_warn_lines", warns);
  bench_json_num(&j, "log_error_lines", errors);
  bench_json_str(&j, "status", rc == 0 && st_end.rejected == 0 ? "ok" : "failed");
  bench_json_end(&j, stdout);
  server_cleanup(&srv, rc != 0 || warns || errors);
  return rc == 0 && st_end.rejected == 0 ? 0 : -1;
}

static int memory_case(const opts_t *o) {
  server_t srv;
  /* --live-tensors (10^6) refs live: the session limits would refuse them. */
  static const char *const extra[] = {"--session-max-refs", "0", "--max-command-refs", "0"};
  if (server_start(&srv, 1, extra, 4) != 0) return -1;
  fprintf(stderr, "bench_commands: memory: meshd %d on %s, %llu live refs\n", (int)srv.pid,
          srv.target, (unsigned long long)o->live_tensors);
  client_t c;
  run_t r = {0};
  int64_t rss0 = -1, rss1 = -1, arss0 = -1, arss1 = -1, t0 = 0, t1 = 0;
  int rc = client_open(&c, srv.target);
  if (rc == 0) rc = setup_session(&c, 1, &r.seq);
  if (rc == 0) {
    usleep(200000); /* let the setup's transient allocations settle */
    rss0 = proc_status_bytes(srv.pid, "VmRSS");
    arss0 = agents_rss(srv.agents, srv.nagents);
    r.s = c.st;
    r.server = srv.pid;
    r.agents = srv.agents;
    r.nagents = srv.nagents;
    r.ref = INPUT_REF + 1;
    r.drop_batch = 0;
    r.batch = o->batch;
    r.max_calls = o->live_tensors;
    t0 = bench_now_ns();
    r.deadline_ns = t0 + (int64_t)(o->memory_seconds * 1e9);
    rc = run_pipeline(&r);
    t1 = bench_now_ns();
    rss1 = proc_status_bytes(srv.pid, "VmRSS");
    arss1 = agents_rss(srv.agents, srv.nagents);
  }
  int64_t hwm = proc_status_bytes(srv.pid, "VmHWM");
  client_close(&c);
  server_stop(&srv);
  int warns, errors;
  log_scan(&srv, &warns, &errors);
  if (srv.exit_status != 0 || srv.agents_left) rc = -1;
  double live = (double)r.call_replies;
  bench_json_t j;
  bench_json_begin(&j, "memory");
  bench_json_num(&j, "agents", 1);
  bench_json_num(&j, "live_tensors", live);
  bench_json_num(&j, "live_tensors_requested", (double)o->live_tensors);
  json_numf(&j, "rss_bytes_per_tensor", rss1 > 0 && rss0 > 0 ? (double)(rss1 - rss0) / live : NAN,
            1);
  json_numf(&j, "agents_rss_bytes_per_tensor",
            arss1 > 0 && arss0 > 0 ? (double)(arss1 - arss0) / live : NAN, 1);
  bench_json_num(&j, "server_rss_before_bytes", (double)rss0);
  bench_json_num(&j, "server_rss_after_bytes", (double)rss1);
  bench_json_num(&j, "server_rss_peak_bytes", (double)hwm);
  bench_json_num(&j, "seconds", (double)(t1 - t0) / 1e9);
  bench_json_num(&j, "calls_per_s", live / ((double)(t1 - t0) / 1e9));
  bench_json_num(&j, "error_replies", (double)r.errors);
  bench_json_num(&j, "server_exit", srv.exit_status);
  bench_json_num(&j, "agents_left", srv.agents_left);
  bench_json_num(&j, "log_warn_lines", warns);
  bench_json_num(&j, "log_error_lines", errors);
  bench_json_str(&j, "status", rc == 0 ? "ok" : "failed");
  bench_json_end(&j, stdout);
  server_cleanup(&srv, rc != 0 || warns || errors);
  return rc;
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
  opts_t o = {.seconds = 2, .warmup = 0.5, .unary_seconds = -1, .drop_batch = 256,
              .live_tensors = 1000000, .memory_seconds = 90};
  int agent_counts[8] = {1, 4}, ncounts = 2;
  bool skip_baseline = false, c_client = false;
  for (int i = 1; i < argc; i++) {
    const char *v;
    if ((v = bench_arg(argc, argv, &i, "--seconds"))) {
      o.seconds = atof(v);
    } else if ((v = bench_arg(argc, argv, &i, "--unary-seconds"))) {
      o.unary_seconds = atof(v);
      if (!(o.unary_seconds > 0)) usage();
    } else if ((v = bench_arg(argc, argv, &i, "--warmup"))) {
      o.warmup = atof(v);
    } else if ((v = bench_arg(argc, argv, &i, "--drop-batch"))) {
      o.drop_batch = atoi(v);
    } else if ((v = bench_arg(argc, argv, &i, "--batch"))) {
      o.batch = atoi(v);
      if (o.batch < 1 || o.batch > 4096) usage();
    } else if ((v = bench_arg(argc, argv, &i, "--live-tensors"))) {
      o.live_tensors = strtoull(v, NULL, 10);
    } else if ((v = bench_arg(argc, argv, &i, "--memory-seconds"))) {
      o.memory_seconds = atof(v);
    } else if ((v = bench_arg(argc, argv, &i, "--agents"))) {
      ncounts = 0;
      char buf[128];
      snprintf(buf, sizeof buf, "%s", v);
      for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && ncounts < 8;
           t = strtok_r(NULL, ",", &save)) {
        agent_counts[ncounts] = atoi(t);
        if (agent_counts[ncounts] < 1 || agent_counts[ncounts] > MAX_AGENTS) usage();
        ncounts++;
      }
    } else if (strcmp(argv[i], "--skip-baseline") == 0) {
      skip_baseline = true;
    } else if (strcmp(argv[i], "--c-client") == 0) {
      c_client = true;
    } else {
      usage();
    }
  }
  if (o.seconds <= 0 || o.warmup < 0 || o.drop_batch < 0 || o.memory_seconds <= 0) usage();
  clk_tck = sysconf(_SC_CLK_TCK);
  if (clk_tck <= 0) clk_tck = 100;
  bench_name = "bench_commands";
  find_bin_dir(argv[0]);
  signal(SIGPIPE, SIG_IGN);

  /* The baseline's echo server is forked before rpc_init (gRPC does not
   * survive a fork); meshd children are fork + exec, which is fine later. */
  char err[256] = "";
  bench_echo_child_t echo = {0};
  if (!skip_baseline && bench_echo_fork(2, &echo, err, sizeof err) != 0) {
    fprintf(stderr, "bench_commands: %s\n", err);
    return 1;
  }
  rpc_init();
  int rc = 0;
  rpc_baseline_t base = {NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN};
  if (!skip_baseline) {
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", echo.port);
    rpc_baseline_opts_t bo = {.seconds = o.seconds, .warmup_seconds = o.warmup};
    fprintf(stderr, "bench_commands: rpc baseline against the echo server %s\n", target);
    if (rpc_baseline_measure(target, &bo, &base) != 0) rc = 1;
    bench_json_t j;
    bench_json_begin(&j, "rpc");
    rpc_baseline_json(&j, &base);
    bench_json_end(&j, stdout);
  }
  for (int i = 0; i < ncounts; i++) {
    double raw_cps = NAN;
    if (commands_case(agent_counts[i], &o, base.bidi_msgs_per_s, skip_baseline ? NULL : &echo,
                      &raw_cps) != 0)
      rc = 1;
    if (c_client && c_client_case(agent_counts[i], &o, base.bidi_msgs_per_s, raw_cps) != 0) rc = 1;
  }
  /* The echo server stays up for the command cases' interleaved unary rounds. */
  if (!skip_baseline && bench_echo_child_stop(&echo) != 0) rc = 1;
  if (o.live_tensors > 0 && memory_case(&o) != 0) rc = 1;
  rpc_shutdown();
  return rc;
}
