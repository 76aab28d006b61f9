/* bench_rpc: the rpc layer's baseline on loopback (see rpc_baseline.h).
 *
 *   bench_rpc [--seconds N] [--warmup S] [--threads T] [--inproc]
 *
 * --seconds: measured time per case (default 2); --warmup: unmeasured time
 * before each case (0.5); --threads: server completion-queue threads (2);
 * --inproc: serve from this process instead of a forked child.
 * Prints one JSON line on stdout; progress goes to stderr. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "echo_server.h"
#include "rpc.h"
#include "rpc_baseline.h"

static void usage(void) {
  fprintf(stderr, "usage: bench_rpc [--seconds N] [--warmup S] [--threads T] [--inproc]\n");
  exit(2);
}

int main(int argc, char **argv) {
  rpc_baseline_opts_t opts = {.seconds = 2, .warmup_seconds = 0.5};
  int threads = 2;
  bool inproc = false;
  for (int i = 1; i < argc; i++) {
    const char *v;
    if ((v = bench_arg(argc, argv, &i, "--seconds")))
      opts.seconds = atof(v);
    else if ((v = bench_arg(argc, argv, &i, "--warmup")))
      opts.warmup_seconds = atof(v);
    else if ((v = bench_arg(argc, argv, &i, "--threads")))
      threads = atoi(v);
    else if (strcmp(argv[i], "--inproc") == 0)
      inproc = true;
    else
      usage();
  }
  if (opts.seconds <= 0 || threads <= 0) usage();

  char err[256] = "";
  bench_echo_child_t child = {0};
  echo_server_t *es = NULL;
  int port = 0;
  if (!inproc) {
    if (bench_echo_fork(threads, &child, err, sizeof err) != 0) {
      fprintf(stderr, "bench_rpc: %s\n", err);
      return 1;
    }
    port = child.port;
  }
  rpc_init();
  if (inproc) {
    rpc_server_opts_t so = {.listen = "127.0.0.1:0", .threads = threads,
                            .max_message_bytes = RPC_BASELINE_MAX_MESSAGE};
    es = echo_server_start(&so, err, sizeof err);
    if (!es) {
      fprintf(stderr, "bench_rpc: %s\n", err);
      rpc_shutdown();
      return 1;
    }
    port = echo_server_port(es);
  }
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", port);
  fprintf(stderr, "bench_rpc: server %s (%s, %d threads), %.1f s per case\n", target,
          inproc ? "in process" : "child process", threads, opts.seconds);

  rpc_baseline_t r = {NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN};
  int rc = rpc_baseline_measure(target, &opts, &r);

  if (es) echo_server_stop(es, 1);
  if (!inproc && bench_echo_child_stop(&child) != 0) {
    fprintf(stderr, "bench_rpc: the server child did not exit cleanly\n");
    rc = -1;
  }
  rpc_shutdown();

  bench_json_t j;
  bench_json_begin(&j, "rpc");
  rpc_baseline_json(&j, &r);
  bench_json_end(&j, stdout);
  return rc == 0 ? 0 : 1;
}
