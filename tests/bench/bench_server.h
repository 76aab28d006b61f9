/* What meshd's benchmarks share: a meshd with local agents in a child process
 * (started on a free port, stopped with SIGTERM, its log scanned), and
 * /proc readings of its and its agents' CPU and memory. */
#ifndef MESHD_BENCH_SERVER_H
#define MESHD_BENCH_SERVER_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "bench_util.h"
#include "rpc.h"

#define HEALTH_CHECK "/grpc.health.v1.Health/Check"
#define TENSOR_SERVICE "meshd.v1.TensorService"
#define MAX_AGENTS 64

/* The program's name, for messages ("bench_commands"). */
extern const char *bench_name;
/* sysconf(_SC_CLK_TCK): set once by main. */
extern int64_t clk_tck;
/* Where meshd is: $MESHD_BIN_DIR, or this program's directory (find_bin_dir). */
extern char bin_dir[PATH_MAX];

/* ppid, state and utime+stime (µs) of pid; -1 if it is gone. */
int proc_stat(pid_t pid, pid_t *ppid, char *state, int64_t *cpu_us);
int64_t proc_cpu_us(pid_t pid);
/* Context switches of every live thread of pid; -1 if it is gone. */
int64_t proc_ctx_switches(pid_t pid);
/* A "VmRSS:" style line of /proc/<pid>/status, in bytes; -1 if absent. */
int64_t proc_status_bytes(pid_t pid, const char *key);
/* Live (not zombie) children of ppid. */
int proc_children(pid_t ppid, pid_t *out, int max);
bool proc_alive(pid_t pid);
int64_t agents_cpu_us(const pid_t *pids, int n);
int64_t agents_rss(const pid_t *pids, int n);
int64_t self_cpu_us(void);

typedef struct {
  pid_t pid;
  int port;
  char dir[PATH_MAX];
  char log[PATH_MAX + 16];
  char target[64];
  pid_t agents[MAX_AGENTS];
  int nagents;
  int exit_status;     /* after server_stop: exit code, or 128 + signal */
  int agents_left;     /* agents still alive 5 s after the server exited */
} server_t;

void find_bin_dir(const char *argv0);
/* Starts meshd --local-agents nagents (plus extra flags); returns once
 * TensorService is SERVING. 0, or -1 with a message on stderr. */
int server_start(server_t *s, int nagents, const char *const *extra, size_t nextra);
/* SIGTERM to the meshd we started, then wait; checks its agents are gone. */
void server_stop(server_t *s);
/* Counts WARN and ERROR lines in the log and echoes the first few to stderr. */
void log_scan(const server_t *s, int *warns, int *errors);
/* CreateSession named bench_name on ch: the session's id and token (each
 * buffer of 128 bytes) and the metadata every later call carries (md[0..1]
 * point into id and token). 0, or -1 with a message on stderr. */
int bench_create_session(rpc_channel_t *ch, char id[128], char token[128], rpc_md_t md[2]);
/* Removes the server's directory, unless keep (then says where it is). */
void server_cleanup(const server_t *s, bool keep);

#endif
