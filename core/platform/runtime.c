#include "runtime.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

static sigset_t blocked(void) {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGTERM);
  sigaddset(&s, SIGINT);
  sigaddset(&s, SIGHUP);
  return s;
}

/* The thread that blocked the signals, and waits for them (main). */
static pthread_t signal_waiter;

/* A thread a library started before main blocked the signals (OpenBLAS starts
 * its workers when it loads) has none blocked, and the kernel may hand it a
 * signal sent to the process when the waiting thread is not in its wait: with
 * the default action the process would end at once, without its shutdown. Such
 * a thread catches it here and passes it on to the waiter. */
static void forward_signal(int sig) {
  int saved = errno;
  pthread_kill(signal_waiter, sig);
  errno = saved;
}

void runtime_block_signals(void) {
  sigset_t s = blocked();
  pthread_sigmask(SIG_BLOCK, &s, NULL);
  signal_waiter = pthread_self();
  struct sigaction sa = {.sa_handler = forward_signal};
  sigfillset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
}

int runtime_wait_signal(int timeout_ms) {
  sigset_t s = blocked();
  struct timespec ts = {timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L};
  int sig = sigtimedwait(&s, NULL, &ts);
  return sig > 0 ? sig : 0;
}

int runtime_write_port_file(const char *path, int port) {
  char tmp[4096];
  if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof tmp) {
    errno = ENAMETOOLONG;
    return -1;
  }
  FILE *f = fopen(tmp, "w");
  if (!f) return -1;
  int ok = fprintf(f, "%d\n", port) > 0;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) {
    int e = errno;
    unlink(tmp);
    errno = e;
    return -1;
  }
  return 0;
}

void runtime_random_hex(char *out, size_t n) {
  unsigned char buf[64];
  if (n > sizeof buf) n = sizeof buf;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  ssize_t got = fd >= 0 ? read(fd, buf, n) : -1;
  if (fd >= 0) close(fd);
  if (got != (ssize_t)n) { /* no urandom: time and pid still make ids unique enough per host */
    srand((unsigned)time(NULL) ^ (unsigned)getpid());
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)rand();
  }
  for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", buf[i]);
  out[2 * n] = '\0';
}

void runtime_local_address(const char *listen, int port, char *out, size_t len) {
  const char *colon = strrchr(listen, ':');
  size_t hostlen = colon ? (size_t)(colon - listen) : strlen(listen);
  char host[256];
  if (hostlen >= sizeof host) hostlen = sizeof host - 1;
  memcpy(host, listen, hostlen);
  host[hostlen] = '\0';
  if (!*host || !strcmp(host, "0.0.0.0") || !strcmp(host, "[::]") || !strcmp(host, "::") ||
      !strcmp(host, "*"))
    snprintf(host, sizeof host, "127.0.0.1");
  snprintf(out, len, "%s:%d", host, port);
}

int runtime_check_port(const char *addr, char *err, size_t errlen) {
  const char *colon = addr ? strrchr(addr, ':') : NULL;
  if (!colon || !colon[1] || strspn(colon + 1, "0123456789") != strlen(colon + 1)) return 0;
  if (strlen(colon + 1) <= 5 && atol(colon + 1) <= 65535) return 0;
  snprintf(err, errlen, "cannot listen on %s: port %s is out of range (0..65535; 0 picks a "
           "free port)", addr, colon + 1);
  return -1;
}

void runtime_host_of(const char *addr, char *out, size_t len) {
  out[0] = '\0';
  const char *colon = addr ? strrchr(addr, ':') : NULL;
  if (!colon) return;
  const char *h = addr;
  size_t n = (size_t)(colon - addr);
  if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
    h++;
    n -= 2;
  }
  snprintf(out, len, "%.*s", (int)n, h);
}

void runtime_tune_malloc(void) {
  /* Below 8 MiB from the heap (not a fresh mmap each time), and up to
   * 32 MiB free at a heap's top kept rather than trimmed. */
  mallopt(M_MMAP_THRESHOLD, 8 << 20);
  mallopt(M_TRIM_THRESHOLD, 32 << 20);
}

void runtime_raise_fd_limit(void) {
  struct rlimit r;
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;
  rlim_t want = r.rlim_max == RLIM_INFINITY || r.rlim_max > (1u << 20) ? (1u << 20) : r.rlim_max;
  if (r.rlim_cur == RLIM_INFINITY || r.rlim_cur >= want) return;
  r.rlim_cur = want;
  setrlimit(RLIMIT_NOFILE, &r); /* (a refusal leaves the limit as it was) */
}

void *runtime_scratch(runtime_scratch_t *s) {
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  if (!atomic_load_explicit(&s->ready, memory_order_acquire)) {
    pthread_mutex_lock(&mu);
    bool made = atomic_load_explicit(&s->ready, memory_order_relaxed) ||
                pthread_key_create(&s->key, free) == 0;
    if (made) atomic_store_explicit(&s->ready, true, memory_order_release);
    pthread_mutex_unlock(&mu);
    if (!made) return NULL;
  }
  void *p = pthread_getspecific(s->key);
  if (!p && (p = malloc(s->size)) && pthread_setspecific(s->key, p) != 0) {
    free(p);
    p = NULL;
  }
  return p;
}

unsigned long long runtime_memory_bytes_in(const char *const *files, size_t n) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  unsigned long long mem = pages > 0 && page > 0 ? (unsigned long long)pages * (unsigned long long)page : 0;
  for (size_t i = 0; i < n; i++) {
    FILE *f = fopen(files[i], "r");
    if (!f) continue;
    unsigned long long v = 0;
    int got = fscanf(f, "%llu", &v);
    fclose(f);
    if (got == 1 && v > 0) {
      if (mem == 0 || v < mem) mem = v;
      break;
    }
  }
  return mem;
}

unsigned long long runtime_memory_bytes(void) {
  static const char *const files[] = {
      "/sys/fs/cgroup/memory.max",                   /* cgroup v2; "max" = none */
      "/sys/fs/cgroup/memory/memory.limit_in_bytes", /* v1; huge = none */
  };
  return runtime_memory_bytes_in(files, sizeof files / sizeof files[0]);
}

/* A thread's name (/proc/self/task/TID/comm); "" when unreadable. */
static void thread_name(const char *tid, char *out, size_t n) {
  char path[300];
  snprintf(path, sizeof path, "/proc/self/task/%s/comm", tid);
  out[0] = 0;
  FILE *f = fopen(path, "r");
  if (!f) return;
  if (fgets(out, (int)n, f)) out[strcspn(out, "\n")] = 0;
  fclose(f);
}

/* The threads other than the caller with a name other than its own, listed
 * into names (n bytes, ", "-separated); -1 when /proc cannot tell. */
static int named_threads(char *names, size_t n) {
  DIR *dir = opendir("/proc/self/task");
  if (!dir) return -1;
  char self[32], own[32];
  snprintf(self, sizeof self, "%ld", (long)gettid());
  thread_name(self, own, sizeof own);
  int count = 0;
  size_t at = 0;
  if (n) names[0] = 0;
  for (struct dirent *e; (e = readdir(dir));) {
    char name[32];
    if (e->d_name[0] == '.' || strcmp(e->d_name, self) == 0) continue;
    thread_name(e->d_name, name, sizeof name);
    if (strcmp(name, own) == 0) continue;
    count++;
    int w = snprintf(names + at, at < n ? n - at : 0, "%s%s", at ? ", " : "", name);
    if (w > 0 && at + (size_t)w < n) at += (size_t)w;
  }
  closedir(dir);
  return count;
}

int runtime_await_named_threads(int timeout_ms, char *left, size_t n) {
  struct timespec t0, now, ms = {0, 1000000};
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    int count = named_threads(left, n);
    if (count <= 0) return count;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if ((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000 >= timeout_ms)
      return count;
    nanosleep(&ms, NULL);
  }
}

void runtime_await_exit_threads(const char *component, int timeout_ms) {
  char names[256];
  int left = runtime_await_named_threads(timeout_ms, names, sizeof names);
  if (left > 0) log_warn(component, "%d thread(s) still running at exit: %s", left, names);
}

typedef struct {
  char name[16];
  void *(*fn)(void *);
  void *arg;
} spawned_t;

/* The thread names itself: a detached thread's handle is no longer valid
 * once it may have ended. */
static void *spawned_main(void *p) {
  spawned_t sp = *(spawned_t *)p;
  free(p);
  pthread_setname_np(pthread_self(), sp.name);
  return sp.fn(sp.arg);
}

int runtime_spawn_detached(const char *name, void *(*fn)(void *), void *arg) {
  spawned_t *sp = malloc(sizeof *sp);
  if (!sp) return ENOMEM;
  snprintf(sp->name, sizeof sp->name, "%s", name);
  sp->fn = fn;
  sp->arg = arg;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  pthread_t th;
  int rc = pthread_create(&th, &at, spawned_main, sp);
  pthread_attr_destroy(&at);
  if (rc != 0) free(sp);
  return rc;
}
