/* Process plumbing shared by meshd and meshd-agent. */
#ifndef MESHD_RUNTIME_H
#define MESHD_RUNTIME_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <time.h>

/* Blocks SIGTERM, SIGINT and SIGHUP in the calling thread (call it first in
 * main, before any thread exists, so every thread inherits the mask) and
 * ignores SIGPIPE. A thread that exists already (a library's, started when it
 * loaded) and gets one of them passes it on to the calling thread, which must
 * live as long as the process (runtime_wait_signal takes it there). */
void runtime_block_signals(void);
/* Keeps freed memory of bulk transfers' sizes in the process: glibc would
 * give each freed 1 MiB message buffer back to the kernel (madvise) and
 * page-fault it in again for the next one, which was most of an agent's CPU
 * in an Upload. Daemons call it once at startup. */
void runtime_tune_malloc(void);
/* Raises the soft limit on open files to the hard one (at most 2^20): every
 * port a daemon opens takes strangers' connections, one fd each until the
 * handshake timeout, and a soft limit of 1,024 (many containers' default)
 * let a few hundred of them refuse clients and agents. */
void runtime_raise_fd_limit(void);
/* Waits up to timeout_ms for one of the blocked signals; returns it, or 0. */
int runtime_wait_signal(int timeout_ms);
/* Writes "PORT\n" to path atomically (temp file + rename), so a reader never
 * sees a partial file. Returns 0, or -1 with errno set. */
int runtime_write_port_file(const char *path, int port);
/* 2*n random hex characters from /dev/urandom into out (size >= 2n+1). */
void runtime_random_hex(char *out, size_t n);
/* "HOST:PORT" that a local peer dials to reach a server listening on `listen`
 * with bound port `port`: a wildcard host (0.0.0.0, [::], empty) becomes 127.0.0.1. */
void runtime_local_address(const char *listen, int port, char *out, size_t len);
/* The host of "HOST:PORT" ("[::1]:5" -> "::1"; "" when addr has no port). */
void runtime_host_of(const char *addr, char *out, size_t len);
/* A listen address's decimal port fits 0..65535: gRPC and getaddrinfo take it
 * modulo 65536 ("HOST:99999" listened on 34463). Returns 0, or -1 with err
 * naming addr; an address without a decimal port is left to the listener. */
int runtime_check_port(const char *addr, char *err, size_t errlen);

/* Starts fn(arg) on a detached thread named `name` (at most 15 characters:
 * what top -H, perf and runtime_await_named_threads show): 0, or the
 * pthread_create error (then fn does not run and arg is still the caller's). */
int runtime_spawn_detached(const char *name, void *(*fn)(void *), void *arg);

/* Waits, at most timeout_ms, until no thread but the caller has a name other
 * than the caller's, and returns how many are left (0; -1 when /proc cannot
 * tell), their names in left (n bytes, ", "-separated). gRPC's threads and
 * meshd's are named; unnamed ones are libraries' pools that live to the end
 * (OpenBLAS's). A daemon's last step: a thread still ending when main returns
 * may be mid-way through its thread-exit hooks, and the leak check at exit
 * then reports what they were freeing (OpenSSL's per-thread error state, CI
 * run 173); and a thread that never ends is named in the log. */
int runtime_await_named_threads(int timeout_ms, char *left, size_t n);
/* The daemons' last step: runtime_await_named_threads for at most timeout_ms,
 * then a warning from `component` naming the threads left, if any. */
void runtime_await_exit_threads(const char *component, int timeout_ms);
#define EXIT_THREADS_WAIT_MS 1000 /* the daemons' bound for it */

/* Physical memory, or the container's limit when that is smaller (cgroup v2
 * memory.max, v1 memory.limit_in_bytes): allocating past a cgroup limit gets a
 * process OOM-killed, not an error. 0 when neither is known. */
unsigned long long runtime_memory_bytes(void);
/* The same, reading the limit from the first of `files` that holds a number
 * ("max" or none: no limit); for tests. */
unsigned long long runtime_memory_bytes_in(const char *const *files, size_t n);

/* Per-thread scratch memory of a fixed size, for a record too big for the stack
 * that a hot path needs once per call (a malloc of that size each call made
 * glibc consolidate its free lists): allocated on a thread's first use, kept,
 * freed when the thread ends. The caller must not need two at once.
 *
 *   static runtime_scratch_t s = RUNTIME_SCRATCH_INIT(sizeof(big_t));
 *   big_t *b = runtime_scratch(&s);   // NULL out of memory (uninitialised bytes) */
typedef struct runtime_scratch {
  atomic_bool ready;
  pthread_key_t key;
  size_t size;
} runtime_scratch_t;
#define RUNTIME_SCRATCH_INIT(bytes) {false, 0, (bytes)}
void *runtime_scratch(runtime_scratch_t *s);

/* *ts = now on `clock` + ms: the deadline of a pthread_cond_timedwait (whose
 * condition variable uses that clock). */
static inline void runtime_deadline(struct timespec *ts, clockid_t clock, int ms) {
  clock_gettime(clock, ts);
  ts->tv_sec += ms / 1000;
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

#endif
