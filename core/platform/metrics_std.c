/* The families every daemon serves: build info and process metrics. See metrics.h. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "build_info.h"
#include "metrics.h"

/* Fields of /proc/self/stat after the command name (field 3 is rest[0]). */
typedef struct proc_stat {
  double utime, stime;     /* clock ticks */
  double starttime;        /* clock ticks after boot */
  double vsize;            /* bytes */
  double rss;              /* pages */
} proc_stat_t;

static int read_stat(proc_stat_t *st) {
  char buf[1024];
  FILE *f = fopen("/proc/self/stat", "r");
  if (!f) return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces and ')' */
  if (!p) return -1;
  p++;
  double v[24] = {0};
  for (int field = 3; field <= 24; field++) {
    char *end;
    while (*p == ' ') p++;
    if (field == 3) { /* the state: a letter */
      p++;
      continue;
    }
    v[field - 3] = strtod(p, &end);
    if (end == p) return -1;
    p = end;
  }
  st->utime = v[14 - 3];
  st->stime = v[15 - 3];
  st->starttime = v[22 - 3];
  st->vsize = v[23 - 3];
  st->rss = v[24 - 3];
  return 0;
}

static double ticks_per_second(void) {
  long t = sysconf(_SC_CLK_TCK);
  return t > 0 ? (double)t : 100;
}

static double cpu_seconds(void *arg) {
  (void)arg;
  proc_stat_t st;
  return read_stat(&st) ? 0 : (st.utime + st.stime) / ticks_per_second();
}

static double resident_bytes(void *arg) {
  (void)arg;
  proc_stat_t st;
  long page = sysconf(_SC_PAGESIZE);
  return read_stat(&st) ? 0 : st.rss * (double)(page > 0 ? page : 4096);
}

static double virtual_bytes(void *arg) {
  (void)arg;
  proc_stat_t st;
  return read_stat(&st) ? 0 : st.vsize;
}

static double open_fds(void *arg) {
  (void)arg;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return 0;
  double n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory's own descriptor */
}

static double max_fds(void *arg) {
  (void)arg;
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 0;
  return (double)rl.rlim_cur;
}

/* Boot time (/proc/stat btime) plus the process's start in ticks after boot:
 * fixed, so computed once when the family is defined. */
static double start_time;
static double start_time_fn(void *arg) {
  (void)arg;
  return start_time;
}

static double boot_time(void) {
  FILE *f = fopen("/proc/stat", "r");
  if (!f) return 0;
  char line[256];
  double bt = 0;
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, "btime ", 6)) {
      bt = strtod(line + 6, NULL);
      break;
    }
  fclose(f);
  return bt;
}

int metrics_define_std(metrics_registry_t *r) {
  const build_info_t *bi = build_info();
  int rc = metrics_define(r, "meshd_build_info", METRIC_GAUGE,
                          "Always 1; the labels say which build runs.");
  metrics_set(r, "meshd_build_info",
              (const char *[]){"version", bi->version, "commit", bi->commit, "cuda",
                               bi->cuda ? "true" : "false", NULL},
              1);
  static const struct {
    const char *name;
    metric_type_t type;
    const char *help;
    metrics_gauge_fn fn;
  } procs[] = {
      {"process_cpu_seconds_total", METRIC_COUNTER, "User and system CPU time spent, in seconds.",
       cpu_seconds},
      {"process_resident_memory_bytes", METRIC_GAUGE, "Resident memory size, in bytes.",
       resident_bytes},
      {"process_virtual_memory_bytes", METRIC_GAUGE, "Virtual memory size, in bytes.",
       virtual_bytes},
      {"process_open_fds", METRIC_GAUGE, "Open file descriptors.", open_fds},
      {"process_max_fds", METRIC_GAUGE, "Limit on open file descriptors.", max_fds},
      {"process_start_time_seconds", METRIC_GAUGE,
       "Start time of the process since the Unix epoch, in seconds.", start_time_fn},
  };
  proc_stat_t st;
  if (read_stat(&st) == 0) start_time = boot_time() + st.starttime / ticks_per_second();
  for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
    rc |= metrics_define(r, procs[i].name, procs[i].type, procs[i].help);
    metrics_set_fn(r, procs[i].name, NULL, procs[i].fn, NULL);
  }
  return rc ? -1 : 0;
}
