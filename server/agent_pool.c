#include "agent_pool.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"

typedef struct agent {
  bool used;
  bool healthy;
  agent_desc_t d;
  uint64_t allocated_bytes;
  int64_t registered_unix_ms;
  rpc_channel_t *channel;
} agent_t;

struct agent_pool {
  pthread_mutex_t mu;
  agent_t *agents; /* indexed by rank */
  size_t cap;
  int healthy;
  agent_pool_changed_fn changed;
  void *arg;
};

agent_pool_t *agent_pool_create(agent_pool_changed_fn changed, void *arg) {
  agent_pool_t *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  pthread_mutex_init(&p->mu, NULL);
  p->changed = changed;
  p->arg = arg;
  return p;
}

void agent_pool_destroy(agent_pool_t *p) {
  if (!p) return;
  for (size_t i = 0; i < p->cap; i++) rpc_channel_destroy(p->agents[i].channel);
  free(p->agents);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

static int64_t unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static bool grow_locked(agent_pool_t *p, size_t need) {
  if (need <= p->cap) return true;
  size_t cap = p->cap ? p->cap : 8;
  while (cap < need) cap *= 2;
  agent_t *a = realloc(p->agents, cap * sizeof *a);
  if (!a) return false;
  memset(a + p->cap, 0, (cap - p->cap) * sizeof *a);
  p->agents = a;
  p->cap = cap;
  return true;
}

static agent_t *find_locked(agent_pool_t *p, uint32_t rank, const char *agent_id) {
  if (rank >= p->cap || !p->agents[rank].used) return NULL;
  agent_t *a = &p->agents[rank];
  return strcmp(a->d.agent_id, agent_id) == 0 ? a : NULL;
}

/* Recounts healthy agents; returns true if the count changed. */
static bool recount_locked(agent_pool_t *p, int *count) {
  int n = 0;
  for (size_t i = 0; i < p->cap; i++) n += p->agents[i].used && p->agents[i].healthy;
  bool changed = n != p->healthy;
  p->healthy = n;
  *count = n;
  return changed;
}

static void notify(agent_pool_t *p, bool changed, int count) {
  if (changed && p->changed) p->changed(count, p->arg);
}

int agent_pool_add(agent_pool_t *p, const agent_desc_t *d, int requested, char *err,
                   size_t errlen) {
  pthread_mutex_lock(&p->mu);
  int rank = -1;
  for (size_t i = 0; i < p->cap; i++) {
    if (p->agents[i].used && strcmp(p->agents[i].d.agent_id, d->agent_id) == 0) {
      snprintf(err, errlen, "agent %s is already registered as rank %zu", d->agent_id, i);
      goto out;
    }
  }
  if (requested >= 0) {
    if (!grow_locked(p, (size_t)requested + 1)) {
      snprintf(err, errlen, "out of memory");
      goto out;
    }
    agent_t *a = &p->agents[requested];
    if (a->used) {
      snprintf(err, errlen, "rank %d is held by agent %s at %s; start this agent with another --rank",
               requested, a->d.agent_id, a->d.address);
      goto out;
    }
    rank = requested;
  } else {
    size_t i = 0;
    while (i < p->cap && p->agents[i].used) i++;
    if (!grow_locked(p, i + 1)) {
      snprintf(err, errlen, "out of memory");
      goto out;
    }
    rank = (int)i;
  }
  agent_t *a = &p->agents[rank];
  memset(a, 0, sizeof *a);
  a->used = true;
  a->d = *d;
  a->registered_unix_ms = unix_ms();
out:
  pthread_mutex_unlock(&p->mu);
  return rank;
}

void agent_pool_remove(agent_pool_t *p, uint32_t rank, const char *agent_id, const char *why) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id);
  rpc_channel_t *ch = NULL;
  int count = 0;
  bool changed = false;
  if (a) {
    log_info("pool", "agent rank %u (%s, %s) left: %s", rank, a->d.address, a->d.agent_id, why);
    ch = a->channel;
    memset(a, 0, sizeof *a);
    changed = recount_locked(p, &count);
  }
  pthread_mutex_unlock(&p->mu);
  rpc_channel_destroy(ch);
  notify(p, changed, count);
}

void agent_pool_set_healthy(agent_pool_t *p, uint32_t rank, const char *agent_id, bool healthy) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id);
  int count = 0;
  bool changed = false;
  if (a && a->healthy != healthy) {
    a->healthy = healthy;
    log_info("pool", "agent rank %u (%s) is %s", rank, a->d.address, healthy ? "healthy" : "unhealthy");
    changed = recount_locked(p, &count);
  }
  pthread_mutex_unlock(&p->mu);
  notify(p, changed, count);
}

void agent_pool_set_allocated(agent_pool_t *p, uint32_t rank, const char *agent_id, uint64_t bytes) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id);
  if (a) a->allocated_bytes = bytes;
  pthread_mutex_unlock(&p->mu);
}

void agent_pool_set_channel(agent_pool_t *p, uint32_t rank, const char *agent_id, rpc_channel_t *ch) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id);
  rpc_channel_t *old = NULL;
  if (a) {
    old = a->channel;
    a->channel = ch;
  } else {
    old = ch; /* the agent left meanwhile */
  }
  pthread_mutex_unlock(&p->mu);
  rpc_channel_destroy(old);
}

int agent_pool_healthy(agent_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  int n = p->healthy;
  pthread_mutex_unlock(&p->mu);
  return n;
}

int agent_pool_size(agent_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  int n = 0;
  for (size_t i = 0; i < p->cap; i++) n += p->agents[i].used;
  pthread_mutex_unlock(&p->mu);
  return n;
}

int agent_pool_snapshot(agent_pool_t *p, Meshd__V1__AgentInfo ***out, size_t *n) {
  pthread_mutex_lock(&p->mu);
  size_t count = 0;
  for (size_t i = 0; i < p->cap; i++) count += p->agents[i].used;
  Meshd__V1__AgentInfo **infos = calloc(count ? count : 1, sizeof *infos);
  size_t k = 0;
  for (size_t i = 0; infos && i < p->cap; i++) {
    agent_t *a = &p->agents[i];
    if (!a->used) continue;
    Meshd__V1__AgentInfo *info = malloc(sizeof *info);
    if (!info) break;
    meshd__v1__agent_info__init(info);
    info->rank = (uint32_t)i;
    info->address = strdup(a->d.address);
    info->device = strdup(a->d.device);
    info->agent_id = strdup(a->d.agent_id);
    info->memory_bytes = a->d.memory_bytes;
    info->allocated_bytes = a->allocated_bytes;
    info->healthy = a->healthy;
    info->data_port = a->d.data_port;
    info->registered_unix_ms = (uint64_t)a->registered_unix_ms;
    infos[k++] = info;
  }
  pthread_mutex_unlock(&p->mu);
  *out = infos;
  *n = k;
  if (!infos || k != count) {
    agent_pool_snapshot_free(infos, k);
    *out = NULL;
    *n = 0;
    return -1;
  }
  return 0;
}

void agent_pool_snapshot_free(Meshd__V1__AgentInfo **infos, size_t n) {
  for (size_t i = 0; infos && i < n; i++) {
    free(infos[i]->address);
    free(infos[i]->device);
    free(infos[i]->agent_id);
    free(infos[i]);
  }
  free(infos);
}
