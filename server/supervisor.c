#include "supervisor.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "rpc.h"

#define POLL_MS 50

typedef struct child {
  pid_t pid;
  int restarts_in_row;
  int64_t started_ms;
  int64_t restart_at_ms; /* when pid == 0: when to start it again */
  bool restarting;       /* it exited: the next start is a restart */
  bool failing;          /* SUPERVISOR_FAIL_AFTER fast exits in a row, and not run 5 s since */
} child_t;

struct supervisor {
  supervisor_opts_t o;
  child_t *children;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool stopping;
  int failing; /* children with .failing */
  pthread_t thread;
  char **env;      /* the agents' environment (agent_env) */
  char blas[48];   /* its OPENBLAS_NUM_THREADS=N, where meshd's environment has none */
};

#define LIVED_MS 5000 /* an exit this long after the start is not a fast one */

static void set_failing(supervisor_t *s, int i, bool failing) {
  child_t *c = &s->children[i];
  if (c->failing == failing) return;
  c->failing = failing;
  s->failing += failing ? 1 : -1;
  if (s->o.on_failing) s->o.on_failing(i, failing, s->failing, s->o.arg);
}

/* Runs in the child between fork and exec: async-signal-safe calls only. */
static void exec_agent(char *const argv[], char *const env[], pid_t parent) {
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  /* meshd's handlers pass these on to its main thread (runtime_block_signals),
   * which this child has not: until the exec they end it, as the death signal
   * below must. */
  sigaction(SIGTERM, &dfl, NULL);
  sigaction(SIGINT, &dfl, NULL);
  sigaction(SIGHUP, &dfl, NULL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL); /* meshd blocks signals for sigwait; agents must not inherit that */
  sigaction(SIGPIPE, &dfl, NULL);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(1); /* meshd died before prctl took effect */
  /* A group of its own: a terminal's Ctrl-C (or a kill of meshd's process
   * group) reaches meshd alone, which drains its sessions and then stops the
   * agents, rather than the agents dying under the draining sessions. */
  setpgid(0, 0);
  execve(argv[0], argv, env);
  _exit(127);
}

static pid_t spawn(supervisor_t *s, int i) {
  char rank[16], mem[32], device[32], dims[24], elems[24], msg[24], metrics[320];
  snprintf(rank, sizeof rank, "%d", i);
  const char *dev = s->o.device ? s->o.device : "cpu";
  if (!strcmp(dev, "cuda")) snprintf(device, sizeof device, "cuda:%d", i);
  else snprintf(device, sizeof device, "%s", dev);
  snprintf(mem, sizeof mem, "%llu", (unsigned long long)s->o.memory_bytes);
  char *argv[52];
  int n = 0;
  argv[n++] = (char *)s->o.agent_binary;
  argv[n++] = "--server";
  argv[n++] = (char *)s->o.server;
  argv[n++] = "--listen";
  argv[n++] = "127.0.0.1:0";
  argv[n++] = "--rank";
  argv[n++] = rank;
  argv[n++] = "--device";
  argv[n++] = device;
  if (s->o.memory_bytes) {
    argv[n++] = "--memory-bytes";
    argv[n++] = mem;
  }
  /* All on one GPU (cuda:K): each reports its share of the GPU's memory, which
   * only the agent can read, rather than each the whole of it. */
  char share[32];
  if (!strncmp(dev, "cuda:", 5) && strcmp(dev, "cuda:emulated") != 0 && s->o.count > 1 &&
      !s->o.memory_bytes) {
    snprintf(share, sizeof share, "--memory-share=%d", s->o.count);
    argv[n++] = share;
  }
  /* Always explicit: an agent's own MESHD_REFLECTION must not differ from its server. */
  argv[n++] = s->o.reflection ? "--reflection=true" : "--reflection=false";
  /* The server's own outputs, which the agents would read from its MESHD_*
   * environment (every flag is a variable too): none of theirs. Each would
   * overwrite the server's port file, or bind its health port and exit. */
  argv[n++] = "--port-file=";
  argv[n++] = "--health-listen=";
  argv[n++] = "--metrics-port-file=";
  argv[n++] = "--health-port-file=";
  if (s->o.log_level) {
    argv[n++] = "--log-level";
    argv[n++] = (char *)s->o.log_level;
  }
  if (s->o.metrics_port_base > 0) {
    const char *h = s->o.metrics_host ? s->o.metrics_host : "127.0.0.1"; /* "": every address */
    bool v6 = strchr(h, ':') && h[0] != '[';
    snprintf(metrics, sizeof metrics, "--metrics-listen=%s%s%s:%d", v6 ? "[" : "", h,
             v6 ? "]" : "", s->o.metrics_port_base + i);
  } else {
    /* Off, whatever MESHD_METRICS_LISTEN the agent inherits (the server's port). */
    snprintf(metrics, sizeof metrics, "--metrics-listen=");
  }
  argv[n++] = metrics;
  snprintf(dims, sizeof dims, "%lld", (long long)s->o.max_tensor_dims);
  snprintf(elems, sizeof elems, "%lld", (long long)s->o.max_tensor_elements);
  snprintf(msg, sizeof msg, "%llu", (unsigned long long)s->o.max_message_bytes);
  char rpcmem[32], handshake[32];
  snprintf(rpcmem, sizeof rpcmem, "%llu", (unsigned long long)s->o.rpc_memory_bytes);
  snprintf(handshake, sizeof handshake, "%g", s->o.handshake_timeout);
  const struct { const char *flag, *value; } creds[] = {
      {"--log-format", s->o.log_format},
      {"--max-tensor-dims", s->o.max_tensor_dims ? dims : NULL},
      {"--max-tensor-elements", s->o.max_tensor_elements ? elems : NULL},
      {"--max-message-bytes", s->o.max_message_bytes ? msg : NULL},
      {"--rpc-memory-bytes", s->o.rpc_memory_bytes ? rpcmem : NULL},
      {"--handshake-timeout", s->o.handshake_timeout > 0 ? handshake : NULL},
      {"--join-token-file", s->o.join_token_file}, {"--cluster-ca", s->o.cluster_ca},
      {"--cluster-cert", s->o.cluster_cert},       {"--cluster-key", s->o.cluster_key},
      {"--cluster-name", s->o.cluster_ca ? s->o.cluster_name : NULL}};
  for (size_t k = 0; k < sizeof creds / sizeof creds[0]; k++) {
    if (!creds[k].value) continue;
    argv[n++] = (char *)creds[k].flag;
    argv[n++] = (char *)creds[k].value;
  }
  argv[n] = NULL;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) exec_agent(argv, s->env, parent);
  if (pid < 0) {
    log_error("supervisor", "cannot start agent %d: %s", i, strerror(errno));
    return 0;
  }
  log_event(LOG_LEVEL_INFO, "supervisor", &(log_fields_t){LOG_RANK(i)},
            "started agent rank %d (pid %d)", i, (int)pid);
  return pid;
}

static void describe_exit(int status, char *buf, size_t len) {
  if (WIFEXITED(status)) snprintf(buf, len, "exit code %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status)) snprintf(buf, len, "signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
  else snprintf(buf, len, "status %d", status);
}

static void *watch(void *arg) {
  supervisor_t *s = arg;
  pthread_mutex_lock(&s->mu);
  while (!s->stopping) {
    int64_t now = rpc_now_ms();
    for (int i = 0; i < s->o.count; i++) {
      child_t *c = &s->children[i];
      if (c->pid > 0) {
        int status;
        pid_t r = waitpid(c->pid, &status, WNOHANG);
        if (r != c->pid) {
          if (c->failing && now - c->started_ms > LIVED_MS) {
            log_event(LOG_LEVEL_INFO, "supervisor", &(log_fields_t){LOG_RANK(i)},
                      "agent rank %d (pid %d) has run %d s: no longer failing", i,
                      (int)c->pid, LIVED_MS / 1000);
            c->restarts_in_row = 0;
            set_failing(s, i, false);
          }
          continue;
        }
        char why[96];
        describe_exit(status, why, sizeof why);
        /* An agent that lived a while gets restarted at once; one that keeps
         * dying right after start backs off (100 ms doubling, at most 1 s),
         * and after SUPERVISOR_FAIL_AFTER such exits is retried only every
         * SUPERVISOR_FAILING_RETRY_MS: a wrong flag or a missing device does
         * not mend itself, and each start may cost a device's initialization. */
        if (now - c->started_ms > LIVED_MS) c->restarts_in_row = 0;
        int delay = c->restarts_in_row == 0 ? 0 : 100 << (c->restarts_in_row < 5 ? c->restarts_in_row - 1 : 4);
        if (delay > 1000) delay = 1000;
        c->restarts_in_row++;
        if (c->restarts_in_row >= SUPERVISOR_FAIL_AFTER) {
          delay = SUPERVISOR_FAILING_RETRY_MS;
          if (!c->failing)
            log_event(LOG_LEVEL_ERROR, "supervisor", &(log_fields_t){LOG_RANK(i)},
                      "agent rank %d keeps exiting within %d s of its start (%d times in a "
                      "row, the last with %s): failing; its own log says why; retried every "
                      "%d s",
                      i, LIVED_MS / 1000, c->restarts_in_row, why,
                      SUPERVISOR_FAILING_RETRY_MS / 1000);
          set_failing(s, i, true);
        }
        log_event(LOG_LEVEL_WARN, "supervisor", &(log_fields_t){LOG_RANK(i)},
                  "agent rank %d (pid %d) exited with %s; restarting in %d ms", i,
                  (int)c->pid, why, delay);
        c->pid = 0;
        c->restart_at_ms = now + delay;
        c->restarting = true;
      }
      if (c->pid == 0 && now >= c->restart_at_ms) {
        c->pid = spawn(s, i);
        c->started_ms = now;
        if (c->pid > 0 && c->restarting) {
          c->restarting = false;
          if (s->o.on_restart) s->o.on_restart(i, s->o.arg);
        }
        if (c->pid == 0) c->restart_at_ms = now + 1000;
      }
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_nsec += POLL_MS * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec++;
      until.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&s->cv, &s->mu, &until);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* The local agents share this host's cores: unless meshd's environment sets
 * OPENBLAS_NUM_THREADS, each agent's BLAS (the cpu backend's matmul) gets
 * cores / agents threads (at least 1). OpenBLAS starts a thread per core in
 * every process, and its idle threads spin (sched_yield) for a while after
 * each call and at start: N agents of as many threads each contended for the
 * same cores (a tenth of the agents' CPU time in the test suites, 2 cores).
 * The rest of the environment is meshd's. NULL when out of memory. */
static char **agent_env(supervisor_t *s) {
  extern char **environ;
  size_t n = 0;
  bool set = false;
  for (char **e = environ; *e; e++, n++) set |= strncmp(*e, "OPENBLAS_NUM_THREADS=", 21) == 0;
  char **env = calloc(n + 2, sizeof *env);
  if (!env) return NULL;
  memcpy(env, environ, n * sizeof *env);
  if (!set) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long each = cores > 0 && s->o.count > 0 ? cores / s->o.count : 1;
    snprintf(s->blas, sizeof s->blas, "OPENBLAS_NUM_THREADS=%ld", each > 0 ? each : 1);
    env[n] = s->blas;
  }
  return env;
}

supervisor_t *supervisor_start(const supervisor_opts_t *opts) {
  if (access(opts->agent_binary, X_OK) != 0) {
    log_error("supervisor", "cannot run the agent binary %s: %s (set --agent-binary)",
              opts->agent_binary, strerror(errno));
    return NULL;
  }
  supervisor_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->o = *opts;
  s->children = calloc((size_t)opts->count, sizeof *s->children);
  s->env = agent_env(s);
  pthread_mutex_init(&s->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  /* The watch thread forks: PR_SET_PDEATHSIG follows the thread that forked,
   * and this thread lives until supervisor_stop joins it. Its end is already
   * the children's SIGTERM (the death signal); supervisor_stop then sends its
   * own, reaps them, and SIGKILLs what outlives its timeout. */
  if (!s->children || !s->env || pthread_create(&s->thread, NULL, watch, s) != 0) {
    free(s->children);
    free(s->env);
    free(s);
    return NULL;
  }
  return s;
}

pid_t supervisor_pid(supervisor_t *s, int i) {
  pthread_mutex_lock(&s->mu);
  pid_t pid = i >= 0 && i < s->o.count ? s->children[i].pid : 0;
  pthread_mutex_unlock(&s->mu);
  return pid;
}

void supervisor_stop(supervisor_t *s, double timeout_s) {
  if (!s) return;
  pthread_mutex_lock(&s->mu);
  s->stopping = true;
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);

  for (int i = 0; i < s->o.count; i++)
    if (s->children[i].pid > 0) kill(s->children[i].pid, SIGTERM);
  int64_t deadline = rpc_now_ms() + (int64_t)(timeout_s * 1000);
  for (;;) {
    int left = 0;
    for (int i = 0; i < s->o.count; i++) {
      child_t *c = &s->children[i];
      if (c->pid <= 0) continue;
      int status;
      if (waitpid(c->pid, &status, WNOHANG) == c->pid) c->pid = 0;
      else left++;
    }
    if (left == 0) break;
    if (rpc_now_ms() >= deadline) {
      for (int i = 0; i < s->o.count; i++) {
        child_t *c = &s->children[i];
        if (c->pid <= 0) continue;
        log_warn("supervisor", "agent rank %d (pid %d) ignored SIGTERM; killing it", i, (int)c->pid);
        kill(c->pid, SIGKILL);
        waitpid(c->pid, NULL, 0);
        c->pid = 0;
      }
      break;
    }
    usleep(20000);
  }
  log_info("supervisor", "all %d agents stopped", s->o.count);
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
  free(s->children);
  free(s->env);
  free(s);
}
