#include "workpool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime.h"

/* A job handed to a parked thread. */
typedef struct handoff {
  struct handoff *next;
  void (*fn)(void *arg);
  void *arg;
} handoff_t;

struct workpool {
  pthread_mutex_t mu;
  pthread_cond_t wake; /* a job was handed over, or the pool stops */
  pthread_cond_t gone; /* the last thread ended */
  handoff_t *jobs;     /* handed over, not yet taken */
  int njobs;
  int parked;          /* threads waiting for a job */
  int threads;         /* alive */
  unsigned long started; /* threads started, ever */
  int max_parked, park_ms;
  bool stop;
  char name[16];
};

typedef struct start {
  workpool_t *p;
  void (*fn)(void *arg);
  void *arg;
} start_t;

static void *worker_main(void *arg) {
  start_t st = *(start_t *)arg;
  free(arg);
  workpool_t *p = st.p;
  pthread_setname_np(pthread_self(), p->name);
  void (*fn)(void *) = st.fn;
  void *job_arg = st.arg;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    pthread_mutex_unlock(&p->mu);
    fn(job_arg);
    pthread_mutex_lock(&p->mu);
    if (p->stop || p->parked >= p->max_parked) break;
    p->parked++;
    struct timespec dl;
    runtime_deadline(&dl, CLOCK_REALTIME, p->park_ms);
    int rc = 0;
    while (!p->jobs && !p->stop && rc == 0) rc = pthread_cond_timedwait(&p->wake, &p->mu, &dl);
    p->parked--;
    if (!p->jobs) break; /* timed out, or the pool stops */
    handoff_t *h = p->jobs;
    p->jobs = h->next;
    p->njobs--;
    fn = h->fn;
    job_arg = h->arg;
    free(h);
  }
  if (--p->threads == 0) pthread_cond_broadcast(&p->gone);
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

workpool_t *workpool_create(const char *name, int max_parked, int park_ms) {
  workpool_t *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->gone, NULL);
  p->max_parked = max_parked;
  p->park_ms = park_ms;
  snprintf(p->name, sizeof p->name, "%s", name ? name : "work");
  return p;
}

int workpool_run(workpool_t *p, void (*fn)(void *arg), void *arg) {
  pthread_mutex_lock(&p->mu);
  if (!p->stop && p->parked > p->njobs) { /* a parked thread will take it */
    handoff_t *h = malloc(sizeof *h);
    if (h) {
      *h = (handoff_t){NULL, fn, arg};
      handoff_t **at = &p->jobs;
      while (*at) at = &(*at)->next;
      *at = h;
      p->njobs++;
      pthread_cond_signal(&p->wake);
      pthread_mutex_unlock(&p->mu);
      return 0;
    }
  }
  p->threads++;
  p->started++;
  pthread_mutex_unlock(&p->mu);
  start_t *st = malloc(sizeof *st);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  int rc = -1;
  if (st) {
    *st = (start_t){p, fn, arg};
    rc = pthread_create(&t, &attr, worker_main, st);
  }
  pthread_attr_destroy(&attr);
  if (rc == 0) return 0;
  free(st);
  pthread_mutex_lock(&p->mu);
  p->started--;
  if (--p->threads == 0) pthread_cond_broadcast(&p->gone);
  pthread_mutex_unlock(&p->mu);
  return -1;
}

workpool_stats_t workpool_stats(workpool_t *p) {
  pthread_mutex_lock(&p->mu);
  workpool_stats_t st = {p->threads, p->parked, p->started};
  pthread_mutex_unlock(&p->mu);
  return st;
}

void workpool_destroy(workpool_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = true;
  pthread_cond_broadcast(&p->wake);
  while (p->threads > 0) pthread_cond_wait(&p->gone, &p->mu);
  pthread_mutex_unlock(&p->mu);
  /* A job handed over as the pool stopped was taken by its thread (a parked
   * thread takes what is there before it looks at stop). */
  pthread_cond_destroy(&p->gone);
  pthread_cond_destroy(&p->wake);
  pthread_mutex_destroy(&p->mu);
  free(p);
}
