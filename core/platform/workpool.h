/* A few threads for short jobs that would otherwise start a thread each
 * (a transfer's helper): between jobs a thread waits, parked, for the next
 * one for a while. A thread start cost about 0.5 ms here, as much as moving
 * a 1 MiB tensor.
 *
 *   workpool_t *p = workpool_create("upload", 8, 10000);
 *   if (workpool_run(p, fn, arg)) -> no thread could start; fn did not run
 *   workpool_destroy(p);   // after every job ended: parked threads exit
 *
 * A job runs at once: on a parked thread, else on a new one (there is no
 * queue and no bound: callers bound their own jobs). */
#ifndef MESHD_WORKPOOL_H
#define MESHD_WORKPOOL_H

typedef struct workpool workpool_t;

/* NULL when out of memory. At most max_parked threads wait, each park_ms at
 * most; name (15 characters) names the threads. */
workpool_t *workpool_create(const char *name, int max_parked, int park_ms);
/* 0, or -1 when no thread could start (fn did not run). */
int workpool_run(workpool_t *p, void (*fn)(void *arg), void *arg);
/* Threads alive now (running a job or parked), those of them parked, and
 * the threads the pool ever started. */
typedef struct workpool_stats {
  int threads, parked;
  unsigned long started;
} workpool_stats_t;
workpool_stats_t workpool_stats(workpool_t *p);
/* Wakes the parked threads and waits until every thread of the pool ended
 * (a job still running finishes first). NULL is a no-op. */
void workpool_destroy(workpool_t *p);

#endif
