/* The rpc layer's baseline on loopback against the Echo service, reusable by
 * later benchmarks that report ratios to it.
 *
 * Typical use (fork before rpc_init: gRPC does not survive a fork):
 *
 *   bench_echo_child_t child;
 *   bench_echo_fork(2, &child, err, sizeof err);
 *   rpc_init();
 *   rpc_baseline_measure(target_of(child.port), &opts, &result);
 *   bench_echo_child_stop(&child);
 *   rpc_shutdown(); */
#ifndef MESHD_BENCH_RPC_BASELINE_H
#define MESHD_BENCH_RPC_BASELINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>

#include "bench_util.h"
#include "rpc.h"

/* Every message size the baseline uses fits under this, on both sides. */
#define RPC_BASELINE_MAX_MESSAGE (8 << 20)

typedef struct {
  double unary_1_calls_per_s, unary_1_p50_us, unary_1_p99_us;
  double unary_16_calls_per_s, unary_16_p50_us, unary_16_p99_us;
  double bidi_msgs_per_s;    /* one stream, writer + reader thread, 33-byte texts */
  double bytes_4mib_per_s;   /* 4 MiB payload echoed, 1 in flight; payload bytes
                                per second in one direction (each call carries
                                them both ways) */
} rpc_baseline_t;

typedef struct {
  double seconds;        /* measured time per case; <= 0: 2 */
  double warmup_seconds; /* unmeasured time before each case; <= 0: 0.5 */
} rpc_baseline_opts_t;

/* An Echo server in a child process, so client and server share no heap or
 * allocator locks. */
typedef struct {
  pid_t pid;
  int port;
  int ctl_fd; /* the child stops when this closes (or this process dies) */
} bench_echo_child_t;

/* Forks a child serving Echo on 127.0.0.1:0 with `threads` completion-queue
 * threads and RPC_BASELINE_MAX_MESSAGE. Must run before rpc_init in this
 * process. Returns 0, or -1 with a message in err. */
int bench_echo_fork(int threads, bench_echo_child_t *child, char *err, size_t errlen);
/* Stops the child and waits for it. Returns its exit status (0 = clean). */
int bench_echo_child_stop(bench_echo_child_t *child);

/* Runs the cases against an Echo server at target ("127.0.0.1:port"); rpc_init
 * must have run. Progress goes to stderr. Returns 0, or -1 if a call failed. */
int rpc_baseline_measure(const char *target, const rpc_baseline_opts_t *opts,
                         rpc_baseline_t *out);
/* One unary Echo of the 33-byte text on ch (a channel to the echo server),
 * as the unary cases make it: for benchmarks that interleave their own calls
 * with the baseline's. Returns 0, or -1 if it failed. */
int rpc_baseline_echo_once(rpc_channel_t *ch);

/* Adds the result's fields to a JSON line, under the names bench_rpc prints. */
void rpc_baseline_json(bench_json_t *j, const rpc_baseline_t *r);

#endif
