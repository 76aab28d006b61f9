#include "rpc_baseline.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "echo_server.h"
#include "rpc.h"
#include "runtime.h"

/* 33 bytes, the size of the Echo text in the first measurements (GRPC_NOTES). */
static const char text33[] = "0123456789abcdef0123456789abcdef0";

/* ------------------------------------------------------------ server child */

int bench_echo_fork(int threads, bench_echo_child_t *child, char *err, size_t errlen) {
  int ctl[2], rep[2];
  if (pipe2(ctl, O_CLOEXEC) != 0) {
    snprintf(err, errlen, "pipe: %s", strerror(errno));
    return -1;
  }
  if (pipe2(rep, O_CLOEXEC) != 0) {
    snprintf(err, errlen, "pipe: %s", strerror(errno));
    close(ctl[0]);
    close(ctl[1]);
    return -1;
  }
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    snprintf(err, errlen, "fork: %s", strerror(errno));
    close(ctl[0]);
    close(ctl[1]);
    close(rep[0]);
    close(rep[1]);
    return -1;
  }
  if (pid == 0) {
    close(ctl[1]);
    close(rep[0]);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    runtime_tune_malloc(); /* as meshd's daemons do: the same allocator behind both */
    rpc_init();
    rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = threads,
                           .max_message_bytes = RPC_BASELINE_MAX_MESSAGE};
    char e[256] = "";
    echo_server_t *es = echo_server_start(&o, e, sizeof e);
    int port = es ? echo_server_port(es) : -1;
    bool ok = write(rep[1], &port, sizeof port) == (ssize_t)sizeof port;
    if (ok && !es) ok = write(rep[1], e, strlen(e)) >= 0;
    close(rep[1]);
    char b;
    ssize_t r;
    do r = read(ctl[0], &b, 1);
    while (r > 0 || (r < 0 && errno == EINTR));
    echo_server_stop(es, 1);
    rpc_shutdown();
    _exit(es && ok ? 0 : 1);
  }
  close(ctl[0]);
  close(rep[1]);
  int port = -1;
  ssize_t n;
  do n = read(rep[0], &port, sizeof port);
  while (n < 0 && errno == EINTR);
  if (n != (ssize_t)sizeof port || port <= 0) {
    char e[256] = "";
    ssize_t m = n == (ssize_t)sizeof port ? read(rep[0], e, sizeof e - 1) : 0;
    e[m > 0 ? m : 0] = '\0';
    snprintf(err, errlen, "echo server child: %s", e[0] ? e : "did not start");
    close(rep[0]);
    close(ctl[1]);
    waitpid(pid, NULL, 0);
    return -1;
  }
  close(rep[0]);
  child->pid = pid;
  child->port = port;
  child->ctl_fd = ctl[1];
  return 0;
}

int bench_echo_child_stop(bench_echo_child_t *child) {
  if (child->pid <= 0) return 0;
  close(child->ctl_fd);
  int st = 0;
  while (waitpid(child->pid, &st, 0) < 0 && errno == EINTR) {
  }
  child->pid = 0;
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------ unary cases */

typedef struct {
  rpc_channel_t *ch;
  size_t payload_len;
  int64_t warm_end_ns, end_ns;
  atomic_int failed;
} unary_case_t;

typedef struct {
  unary_case_t *c;
  pthread_t tid;
  bench_samples_t lat;
  uint64_t calls;
  int64_t last_ns;
} unary_worker_t;

static void *unary_worker(void *p) {
  unary_worker_t *w = p;
  unary_case_t *c = w->c;
  uint8_t *payload = NULL;
  if (c->payload_len) {
    payload = malloc(c->payload_len);
    if (!payload) {
      atomic_store(&c->failed, 1);
      return NULL;
    }
    for (size_t i = 0; i < c->payload_len; i++) payload[i] = (uint8_t)i;
  }
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = (char *)text33;
  req.payload.data = payload;
  req.payload.len = c->payload_len;
  for (;;) {
    int64_t t0 = bench_now_ns();
    if (t0 >= c->end_ns || atomic_load(&c->failed)) break;
    ProtobufCMessage *rep = NULL;
    rpc_status_t st;
    grpc_status_code code = rpc_unary(c->ch, ECHO_UNARY, &req.base, &echo_reply__descriptor,
                                      &rep, NULL, 0, 30000, &st);
    int64_t t1 = bench_now_ns();
    if (code != GRPC_STATUS_OK || ((EchoReply *)rep)->payload.len != c->payload_len) {
      if (!atomic_exchange(&c->failed, 1))
        fprintf(stderr, "bench_rpc: unary failed: code %d: %s\n", code,
                code != GRPC_STATUS_OK ? st.message : "short reply");
      if (rep) protobuf_c_message_free_unpacked(rep, NULL);
      break;
    }
    protobuf_c_message_free_unpacked(rep, NULL);
    if (t0 >= c->warm_end_ns) {
      if (!bench_samples_add(&w->lat, t1 - t0)) atomic_store(&c->failed, 1);
      w->calls++;
      w->last_ns = t1;
    }
  }
  free(payload);
  return NULL;
}

int rpc_baseline_echo_once(rpc_channel_t *ch) {
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = (char *)text33;
  ProtobufCMessage *rep = NULL;
  rpc_status_t st;
  grpc_status_code code =
      rpc_unary(ch, ECHO_UNARY, &req.base, &echo_reply__descriptor, &rep, NULL, 0, 30000, &st);
  if (rep) protobuf_c_message_free_unpacked(rep, NULL);
  if (code == GRPC_STATUS_OK) return 0;
  fprintf(stderr, "bench_rpc: unary echo failed: code %d: %s\n", code, st.message);
  return -1;
}

/* Runs `threads` callers on one shared channel (one connection). */
static int unary_case(const char *target, int threads, size_t payload_len,
                      const rpc_baseline_opts_t *o, double *calls_per_s, double *p50,
                      double *p99) {
  rpc_channel_opts_t co = {.max_message_bytes = RPC_BASELINE_MAX_MESSAGE, .own_connection = true};
  unary_case_t c = {.ch = rpc_channel_create(target, &co), .payload_len = payload_len};
  if (!c.ch || !rpc_channel_wait_ready(c.ch, 5000)) {
    fprintf(stderr, "bench_rpc: %s is not ready\n", target);
    if (c.ch) rpc_channel_destroy(c.ch);
    return -1;
  }
  unary_worker_t *w = calloc((size_t)threads, sizeof *w);
  if (!w) {
    rpc_channel_destroy(c.ch);
    return -1;
  }
  c.warm_end_ns = bench_now_ns() + (int64_t)(o->warmup_seconds * 1e9);
  c.end_ns = c.warm_end_ns + (int64_t)(o->seconds * 1e9);
  int started = 0;
  for (; started < threads; started++) {
    w[started].c = &c;
    if (pthread_create(&w[started].tid, NULL, unary_worker, &w[started]) != 0) {
      atomic_store(&c.failed, 1);
      break;
    }
  }
  bench_samples_t all = {0};
  uint64_t calls = 0;
  int64_t last = c.warm_end_ns;
  for (int i = 0; i < started; i++) {
    pthread_join(w[i].tid, NULL);
    if (!bench_samples_merge(&all, &w[i].lat)) atomic_store(&c.failed, 1);
    calls += w[i].calls;
    if (w[i].last_ns > last) last = w[i].last_ns;
    bench_samples_free(&w[i].lat);
  }
  free(w);
  rpc_channel_destroy(c.ch);
  double secs = (double)(last - c.warm_end_ns) / 1e9;
  *calls_per_s = secs > 0 ? (double)calls / secs : NAN;
  *p50 = bench_percentile(&all, 50);
  *p99 = bench_percentile(&all, 99);
  bench_samples_free(&all);
  return atomic_load(&c.failed) ? -1 : 0;
}

/* ------------------------------------------------------------ bidi case */

typedef struct {
  rpc_stream_t *s;
  atomic_bool stop;
  int64_t warm_end_ns, measure_ns;
  uint64_t written, count0, count1;
  int64_t t0, t1;
  int write_err, read_end;
} bidi_case_t;

static void *bidi_writer(void *p) {
  bidi_case_t *b = p;
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = (char *)text33;
  while (!atomic_load(&b->stop)) {
    if (rpc_stream_write(b->s, &req.base, false) != 0) {
      b->write_err = 1;
      return NULL;
    }
    b->written++;
  }
  if (rpc_stream_close_send(b->s) != 0) b->write_err = 1;
  return NULL;
}

static void *bidi_reader(void *p) {
  bidi_case_t *b = p;
  uint64_t n = 0;
  for (;;) {
    ProtobufCMessage *rep = NULL;
    int r = rpc_stream_read(b->s, &echo_reply__descriptor, &rep, 30000);
    if (r != 1) {
      b->read_end = r;
      atomic_store(&b->stop, true); /* the stream ended: stop the writer too */
      return NULL;
    }
    protobuf_c_message_free_unpacked(rep, NULL);
    n++;
    int64_t now = bench_now_ns();
    if (!b->t0 && now >= b->warm_end_ns) {
      b->t0 = now;
      b->count0 = n;
    } else if (b->t0 && !b->t1 && now >= b->t0 + b->measure_ns) {
      b->t1 = now;
      b->count1 = n;
      atomic_store(&b->stop, true);
    }
  }
}

static int bidi_case(const char *target, const rpc_baseline_opts_t *o, double *msgs_per_s) {
  *msgs_per_s = NAN;
  rpc_channel_opts_t co = {.max_message_bytes = RPC_BASELINE_MAX_MESSAGE, .own_connection = true};
  rpc_channel_t *ch = rpc_channel_create(target, &co);
  if (!ch || !rpc_channel_wait_ready(ch, 5000)) {
    if (ch) rpc_channel_destroy(ch);
    return -1;
  }
  bidi_case_t b = {.s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 0)};
  if (!b.s) {
    rpc_channel_destroy(ch);
    return -1;
  }
  b.warm_end_ns = bench_now_ns() + (int64_t)(o->warmup_seconds * 1e9);
  b.measure_ns = (int64_t)(o->seconds * 1e9);
  pthread_t w, r;
  pthread_create(&r, NULL, bidi_reader, &b);
  pthread_create(&w, NULL, bidi_writer, &b);
  pthread_join(w, NULL);
  pthread_join(r, NULL);
  rpc_status_t st;
  grpc_status_code code = rpc_stream_finish(b.s, &st);
  rpc_stream_destroy(b.s);
  rpc_channel_destroy(ch);
  if (code != GRPC_STATUS_OK || b.write_err || b.read_end != 0 || !b.t1) {
    fprintf(stderr, "bench_rpc: bidi failed: code %d (%s), write_err %d, read_end %d\n", code,
            st.message, b.write_err, b.read_end);
    return -1;
  }
  *msgs_per_s = (double)(b.count1 - b.count0) / ((double)(b.t1 - b.t0) / 1e9);
  return 0;
}

/* ------------------------------------------------------------ driver */

int rpc_baseline_measure(const char *target, const rpc_baseline_opts_t *opts,
                         rpc_baseline_t *out) {
  rpc_baseline_opts_t o = *opts;
  if (o.seconds <= 0) o.seconds = 2;
  if (o.warmup_seconds <= 0) o.warmup_seconds = 0.5;
  int ret = 0;
  double unused1, unused2;

  ret |= unary_case(target, 1, 0, &o, &out->unary_1_calls_per_s, &out->unary_1_p50_us,
                    &out->unary_1_p99_us);
  fprintf(stderr, "unary x1:  %.0f calls/s, p50 %.0f us, p99 %.0f us\n",
          out->unary_1_calls_per_s, out->unary_1_p50_us, out->unary_1_p99_us);
  ret |= unary_case(target, 16, 0, &o, &out->unary_16_calls_per_s, &out->unary_16_p50_us,
                    &out->unary_16_p99_us);
  fprintf(stderr, "unary x16: %.0f calls/s, p50 %.0f us, p99 %.0f us\n",
          out->unary_16_calls_per_s, out->unary_16_p50_us, out->unary_16_p99_us);
  ret |= bidi_case(target, &o, &out->bidi_msgs_per_s);
  fprintf(stderr, "bidi:      %.0f msgs/s\n", out->bidi_msgs_per_s);
  double calls_4mib;
  ret |= unary_case(target, 1, 4 << 20, &o, &calls_4mib, &unused1, &unused2);
  out->bytes_4mib_per_s = calls_4mib * (double)(4 << 20);
  fprintf(stderr, "4 MiB:     %.1f MiB/s (%.1f calls/s)\n", out->bytes_4mib_per_s / (1 << 20),
          calls_4mib);
  return ret ? -1 : 0;
}

void rpc_baseline_json(bench_json_t *j, const rpc_baseline_t *r) {
  bench_json_num(j, "unary_1_calls_per_s", r->unary_1_calls_per_s);
  bench_json_num(j, "unary_1_p50_us", r->unary_1_p50_us);
  bench_json_num(j, "unary_1_p99_us", r->unary_1_p99_us);
  bench_json_num(j, "unary_16_calls_per_s", r->unary_16_calls_per_s);
  bench_json_num(j, "unary_16_p50_us", r->unary_16_p50_us);
  bench_json_num(j, "unary_16_p99_us", r->unary_16_p99_us);
  bench_json_num(j, "bidi_msgs_per_s", r->bidi_msgs_per_s);
  bench_json_num(j, "bytes_4mib_per_s", r->bytes_4mib_per_s);
}
