/* What meshd's benchmarks share (bench_server.h). */
#include "bench_server.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "grpc/health/v1/health.pb-c.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "rpc.h"

const char *bench_name = "bench";

/* ------------------------------------------------------------------ /proc */

int64_t clk_tck;

/* ppid, state and utime+stime (µs) of pid; -1 if it is gone. */
int proc_stat(pid_t pid, pid_t *ppid, char *state, int64_t *cpu_us) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return -1;
  buf[n] = '\0';
  char *p = strrchr(buf, ')'); /* comm may hold spaces */
  if (!p) return -1;
  char st;
  int pp;
  unsigned long long ut, stime;
  /* after ')': state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
  if (sscanf(p + 1, " %c %d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &st, &pp, &ut,
             &stime) != 4)
    return -1;
  if (ppid) *ppid = pp;
  if (state) *state = st;
  if (cpu_us) *cpu_us = (int64_t)(ut + stime) * 1000000 / clk_tck;
  return 0;
}

/* CPU time of pid (every thread, live or ended), in µs, from its process CPU
 * clock: exact, where /proc/<pid>/stat counts whole clock ticks (10 ms), more
 * than a short benchmark window's server spends (a 0.2 s smoke window read 0). */
int64_t proc_cpu_us(pid_t pid) {
  clockid_t clock;
  struct timespec ts;
  if (clock_getcpuclockid(pid, &clock) == 0 && clock_gettime(clock, &ts) == 0)
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
  int64_t us = 0;
  return proc_stat(pid, NULL, NULL, &us) == 0 ? us : -1;
}

/* Context switches (voluntary and not) of every live thread of pid, from
 * /proc/<pid>/task/<tid>/status; -1 if the process is gone. */
int64_t proc_ctx_switches(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  if (!d) return -1;
  int64_t n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char file[128], line[256];
    snprintf(file, sizeof file, "/proc/%d/task/%.20s/status", (int)pid, e->d_name);
    FILE *f = fopen(file, "re");
    if (!f) continue;
    while (fgets(line, sizeof line, f)) {
      long long v;
      if (sscanf(line, "voluntary_ctxt_switches: %lld", &v) == 1 ||
          sscanf(line, "nonvoluntary_ctxt_switches: %lld", &v) == 1)
        n += v;
    }
    fclose(f);
  }
  closedir(d);
  return n;
}

/* A "VmRSS:" style line of /proc/<pid>/status, in bytes; -1 if absent. */
int64_t proc_status_bytes(pid_t pid, const char *key) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "re");
  if (!f) return -1;
  int64_t v = -1;
  size_t kl = strlen(key);
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, key, kl) == 0 && line[kl] == ':') {
      long long kb;
      if (sscanf(line + kl + 1, "%lld", &kb) == 1) v = kb * 1024;
      break;
    }
  }
  fclose(f);
  return v;
}

/* Live (not zombie) children of ppid, by scanning /proc. */
int proc_children(pid_t ppid, pid_t *out, int max) {
  DIR *d = opendir("/proc");
  if (!d) return 0;
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d)) && n < max) {
    char *end;
    long pid = strtol(de->d_name, &end, 10);
    if (*end || pid <= 0) continue;
    pid_t pp;
    char st;
    if (proc_stat((pid_t)pid, &pp, &st, NULL) == 0 && pp == ppid && st != 'Z')
      out[n++] = (pid_t)pid;
  }
  closedir(d);
  return n;
}

bool proc_alive(pid_t pid) {
  char st;
  return proc_stat(pid, NULL, &st, NULL) == 0 && st != 'Z';
}

int64_t agents_cpu_us(const pid_t *pids, int n) {
  int64_t sum = 0;
  for (int i = 0; i < n; i++) {
    int64_t v = proc_cpu_us(pids[i]);
    if (v > 0) sum += v;
  }
  return sum;
}

int64_t agents_rss(const pid_t *pids, int n) {
  int64_t sum = 0;
  for (int i = 0; i < n; i++) {
    int64_t v = proc_status_bytes(pids[i], "VmRSS");
    if (v > 0) sum += v;
  }
  return sum;
}

int64_t self_cpu_us(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (int64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000 + ru.ru_utime.tv_usec +
         ru.ru_stime.tv_usec;
}

/* ------------------------------------------------------------------ the server child */



char bin_dir[PATH_MAX];

void find_bin_dir(const char *argv0) {
  const char *env = getenv("MESHD_BIN_DIR");
  if (env && *env) {
    snprintf(bin_dir, sizeof bin_dir, "%s", env);
    return;
  }
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
  } else {
    snprintf(self, sizeof self, "%s", argv0);
  }
  snprintf(bin_dir, sizeof bin_dir, "%s", dirname(self));
}

int read_port_file(const char *path) {
  FILE *f = fopen(path, "re");
  if (!f) return -1;
  int port = -1;
  if (fscanf(f, "%d", &port) != 1) port = -1;
  fclose(f);
  return port;
}

grpc_status_code health_check(rpc_channel_t *ch, int *status) {
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = TENSOR_SERVICE;
  ProtobufCMessage *rep = NULL;
  grpc_status_code code = rpc_unary(ch, HEALTH_CHECK, &req.base,
                                    &grpc__health__v1__health_check_response__descriptor, &rep,
                                    NULL, 0, 2000, NULL);
  if (code == GRPC_STATUS_OK) {
    *status = (int)((Grpc__Health__V1__HealthCheckResponse *)rep)->status;
    protobuf_c_message_free_unpacked(rep, NULL);
  }
  return code;
}

void server_stop(server_t *s);

/* Starts meshd with n local agents; returns once TensorService is SERVING. */
int server_start(server_t *s, int nagents, const char *const *extra, size_t nextra) {
  memset(s, 0, sizeof *s);
  const char *tmp = getenv("TMPDIR");
  snprintf(s->dir, sizeof s->dir, "%s/%s.XXXXXX", tmp && *tmp ? tmp : "/tmp", bench_name);
  if (!mkdtemp(s->dir)) {
    fprintf(stderr, "%s: mkdtemp: %s\n", bench_name, strerror(errno));
    return -1;
  }
  char meshd[PATH_MAX + 8], port_file[PATH_MAX + 16], agents[16];
  snprintf(meshd, sizeof meshd, "%s/meshd", bin_dir);
  snprintf(port_file, sizeof port_file, "%s/port", s->dir);
  snprintf(s->log, sizeof s->log, "%s/meshd.log", s->dir);
  snprintf(agents, sizeof agents, "%d", nagents);
  if (access(meshd, X_OK) != 0) {
    fprintf(stderr, "%s: %s: %s (set MESHD_BIN_DIR)\n", bench_name, meshd, strerror(errno));
    return -1;
  }
  char *argv[32] = {meshd, "--listen", "127.0.0.1:0", "--port-file", port_file,
                    "--local-agents", agents};
  size_t argc = 7;
  for (size_t i = 0; i < nextra && argc < 31; i++) argv[argc++] = (char *)extra[i];
  argv[argc] = NULL;
  /* Its TMPDIR is s->dir: the join token directory it makes for its local
   * agents goes with s->dir (server_cleanup) even if it had to be SIGKILLed. */
  extern char **environ;
  static char tmpdir_var[PATH_MAX + 8];
  static char *envp[512];
  snprintf(tmpdir_var, sizeof tmpdir_var, "TMPDIR=%s", s->dir);
  size_t ne = 0;
  for (char **e = environ; *e && ne < 510; e++)
    if (strncmp(*e, "TMPDIR=", 7) != 0) envp[ne++] = *e;
  envp[ne++] = tmpdir_var;
  envp[ne] = NULL;
  int logfd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (logfd < 0) {
    fprintf(stderr, "%s: %s: %s\n", bench_name, s->log, strerror(errno));
    return -1;
  }
  fflush(stdout);
  fflush(stderr);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    fprintf(stderr, "%s: fork: %s\n", bench_name, strerror(errno));
    close(logfd);
    return -1;
  }
  if (pid == 0) { /* async-signal-safe calls only until exec */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(logfd, 1);
    dup2(logfd, 2);
    execve(meshd, argv, envp);
    _exit(127);
  }
  close(logfd);
  s->pid = pid;

  int64_t deadline = bench_now_ns() + 15 * 1000000000LL;
  while ((s->port = read_port_file(port_file)) <= 0) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      fprintf(stderr, "%s: meshd exited at start (status 0x%x); log: %s\n", bench_name, st, s->log);
      s->pid = 0;
      return -1;
    }
    if (bench_now_ns() > deadline) {
      fprintf(stderr, "%s: meshd wrote no port file in 15 s; log: %s\n", bench_name, s->log);
      server_stop(s);
      return -1;
    }
    usleep(20000);
  }
  snprintf(s->target, sizeof s->target, "127.0.0.1:%d", s->port);

  rpc_channel_t *ch = rpc_channel_create(s->target, NULL);
  int status = 0;
  deadline = bench_now_ns() + 30 * 1000000000LL;
  while (!(health_check(ch, &status) == GRPC_STATUS_OK && status == 1 /* SERVING */)) {
    if (bench_now_ns() > deadline) {
      fprintf(stderr, "%s: %s not SERVING after 30 s (status %d); log: %s\n", bench_name,
              TENSOR_SERVICE, status, s->log);
      rpc_channel_destroy(ch);
      server_stop(s);
      return -1;
    }
    usleep(50000);
  }
  rpc_channel_destroy(ch);
  /* The agents registered before SERVING, so they are all there. */
  s->nagents = proc_children(s->pid, s->agents, MAX_AGENTS);
  if (s->nagents != nagents)
    fprintf(stderr, "%s: meshd has %d child process(es), expected %d agents\n", bench_name,
            s->nagents, nagents);
  return 0;
}

/* SIGTERM to the meshd we started, then wait; checks its agents are gone. */
void server_stop(server_t *s) {
  if (s->pid <= 0) return;
  pid_t agents[MAX_AGENTS];
  int nagents = proc_children(s->pid, agents, MAX_AGENTS); /* now, after any restart */
  kill(s->pid, SIGTERM);
  int st = 0;
  int64_t deadline = bench_now_ns() + 20 * 1000000000LL;
  pid_t r;
  while ((r = waitpid(s->pid, &st, WNOHANG)) == 0 && bench_now_ns() < deadline) usleep(20000);
  if (r == 0) {
    fprintf(stderr, "%s: meshd %d did not exit 20 s after SIGTERM; SIGKILL\n", bench_name,
            (int)s->pid);
    kill(s->pid, SIGKILL);
    waitpid(s->pid, &st, 0);
  }
  s->exit_status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  s->pid = 0;
  /* The agents die with meshd (supervisor stop, or PDEATHSIG); give them 5 s. */
  deadline = bench_now_ns() + 5 * 1000000000LL;
  int left;
  do {
    left = 0;
    for (int i = 0; i < nagents; i++) left += proc_alive(agents[i]);
    if (left) usleep(20000);
  } while (left && bench_now_ns() < deadline);
  s->agents_left = left;
  for (int i = 0; left && i < nagents; i++) {
    if (!proc_alive(agents[i])) continue;
    fprintf(stderr, "%s: agent %d outlived meshd by 5 s; SIGKILL\n", bench_name, (int)agents[i]);
    kill(agents[i], SIGKILL);
  }
}

/* Counts WARN and ERROR lines in the log and echoes the first few to stderr;
 * not the warning every server without TLS or tokens (as here) logs at start. */
void log_scan(const server_t *s, int *warns, int *errors) {
  *warns = *errors = 0;
  FILE *f = fopen(s->log, "re");
  if (!f) return;
  char line[4096];
  int shown = 0;
  while (fgets(line, sizeof line, f)) {
    bool w = strstr(line, "Z WARN ") != NULL && !strstr(line, "server: this server is open:"),
         e = strstr(line, "Z ERROR ") != NULL;
    *warns += w;
    *errors += e;
    if ((w || e) && shown++ < 10) fprintf(stderr, "  meshd log: %s", line);
  }
  fclose(f);
}

void server_cleanup(const server_t *s, bool keep) {
  if (keep) {
    fprintf(stderr, "%s: kept %s\n", bench_name, s->dir);
    return;
  }
  char path[PATH_MAX + 300];
  snprintf(path, sizeof path, "%s/port", s->dir);
  unlink(path);
  unlink(s->log);
  /* A SIGKILLed meshd's join token (its TMPDIR is s->dir). */
  DIR *d = opendir(s->dir);
  struct dirent *de;
  while (d && (de = readdir(d))) {
    if (strncmp(de->d_name, "meshd-join-", 11) != 0) continue;
    snprintf(path, sizeof path, "%s/%s/join-token", s->dir, de->d_name);
    unlink(path);
    *strrchr(path, '/') = '\0';
    rmdir(path);
  }
  if (d) closedir(d);
  rmdir(s->dir);
}


int bench_create_session(rpc_channel_t *ch, char id[128], char token[128], rpc_md_t md[2]) {
  Meshd__V1__CreateSessionRequest req = MESHD__V1__CREATE_SESSION_REQUEST__INIT;
  req.client_name = (char *)bench_name;
  ProtobufCMessage *rep = NULL;
  rpc_status_t st;
  grpc_status_code code =
      rpc_unary(ch, "/meshd.v1.TensorService/CreateSession", &req.base,
                &meshd__v1__create_session_reply__descriptor, &rep, NULL, 0, 5000, &st);
  if (code != GRPC_STATUS_OK) {
    fprintf(stderr, "%s: CreateSession: code %d: %s\n", bench_name, code, st.message);
    return -1;
  }
  Meshd__V1__CreateSessionReply *r = (Meshd__V1__CreateSessionReply *)rep;
  snprintf(id, 128, "%s", r->session_id);
  snprintf(token, 128, "%s", r->token);
  protobuf_c_message_free_unpacked(rep, NULL);
  md[0] = (rpc_md_t){"meshd-session", id};
  md[1] = (rpc_md_t){"meshd-token", token};
  return 0;
}
