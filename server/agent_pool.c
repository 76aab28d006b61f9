#include "agent_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "grant.h"
#include "log.h"
#include "page_token.h"

/* The pool's side of one Execute link: what its callbacks need, and whether
 * its loss was reported yet (once, by whichever of the link's reader thread
 * and agent_pool_remove gets there first). Owned by the agent slot; freed
 * after the link is stopped. */
typedef struct pool_link {
  agent_pool_t *pool;
  agent_link_t *link;
  uint32_t rank;
  char agent_id[64];
  char data_address[300];
  uint64_t registration; /* its agent's (agent_desc_t) */
  uint64_t first_seq;    /* the link's first seq: every earlier link's are below it */
  atomic_bool gone;
  /* Its number among all losses once counted (under the pool's mu; 0: not yet):
   * when the agent leaves the pool, or when link_gone reports it. */
  uint64_t loss;
  int64_t loss_unix_ms;
} pool_link_t;

typedef struct agent {
  bool used;
  /* Removed, its link not dropped yet (so its loss not recorded yet, nor its
   * unexecuted seqs marked lost): the rank is not given out meanwhile, or a
   * newcomer's first report would pass those seqs as executed. */
  bool leaving;
  bool healthy;
  agent_desc_t d;
  uint64_t allocated_bytes;
  int64_t registered_unix_ms;
  grant_clock_t clock; /* its clock minus ours: from its Hello, then its reports */
  rpc_channel_t *channel;
  pool_link_t *link;
  agent_data_t *data; /* the data calls' channel, made at the first (agent_pool_data) */
  /* Last seq of the rank's earlier links. Survives the agent (kept across the
   * memsets) so that seqs are never reused on a rank: a (rank, seq) the
   * watermark knows as lost cannot come back on the next agent. */
  uint64_t seq_floor;
  /* The rank's last loss (kept across the memsets too): its number among all
   * losses (0: never lost) and when. */
  uint64_t lost_no;
  int64_t lost_unix_ms;
  /* An agent that asked for its rank by number keeps it from agents that ask
   * for any rank until then (kept across the memsets): its replacement, which
   * asks for the same number, finds it free. */
  bool asked;
  int64_t reserved_until_ms;
  /* Drained by an operator (agent_pool_set_drained), and since when
   * (rpc_now_ms clock): a property of the rank, kept across the memsets, so an
   * agent restarted during maintenance comes back drained. */
  bool drained;
  int64_t drained_ms;
} agent_t;

struct agent_pool {
  pthread_mutex_t mu;
  agent_t *agents; /* indexed by rank */
  size_t cap;
  int healthy;
  agent_pool_changed_fn changed;
  void *arg;
  /* Held while changed runs: notifications go one at a time, each with the
   * count as it is then (two threads that each recounted could otherwise
   * deliver theirs out of order, leaving the older count as the last word). */
  pthread_mutex_t notify_mu;
  agent_pool_callbacks_t cb;
  watermark_t *marks;
  uint64_t losses; /* mu */
  uint64_t old_batches, old_instructions; /* mu: sent by links since closed */
  int max_agents;
  uint32_t epoch; /* ListAgents' page tokens (page_token.h) */
  rpc_tls_t agent_tls;
  /* The agent CA as clients get it (agent_pool_client_tls): its own lock, so
   * a file read never holds mu. */
  pthread_mutex_t ca_mu;
  char *client_ca;
  struct timespec client_ca_mtime;
};

static void kick_rank(uint32_t rank, void *arg);

agent_pool_t *agent_pool_create(const agent_pool_callbacks_t *cb) {
  agent_pool_t *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->marks = watermark_create();
  if (!p->marks) {
    free(p);
    return NULL;
  }
  watermark_set_kick(p->marks, kick_rank, p);
  pthread_mutex_init(&p->mu, NULL);
  pthread_mutex_init(&p->ca_mu, NULL);
  pthread_mutex_init(&p->notify_mu, NULL);
  p->max_agents = AGENT_POOL_DEFAULT_MAX;
  p->epoch = page_token_new_epoch();
  if (cb) p->cb = *cb;
  p->changed = p->cb.changed;
  p->arg = p->cb.arg;
  return p;
}

/* ------------------------------------------------------------------ data channels */

struct agent_data {
  _Atomic int refs; /* the agent's, and one per transfer that uses it */
  rpc_channel_t *ch;
};

agent_data_t *agent_pool_data(agent_pool_t *p, uint32_t rank, agent_target_t *t) {
  if (agent_pool_target(p, rank, AGENT_DATA_CONNECT_MS, t)) return NULL;
  t->opts.stream_window_bytes = AGENT_DATA_WINDOW;
  agent_data_t *made = NULL;
  for (;;) {
    pthread_mutex_lock(&p->mu);
    agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
    /* The agent it was made for (a replacement at another address gets its own). */
    if (a && strcmp(a->d.address, t->address) != 0) a = NULL;
    if (a && !a->data && made) {
      a->data = made;
      made = NULL;
    }
    agent_data_t *d = a ? a->data : NULL;
    if (d) atomic_fetch_add(&d->refs, 1);
    pthread_mutex_unlock(&p->mu);
    if (d || !a) {
      agent_data_release(made); /* another call's was installed first, or the agent left */
      return d;
    }
    /* Made outside the lock (a TLS channel's credentials take a while, and every
     * command waits on this lock); the next turn installs it or takes another's. */
    made = calloc(1, sizeof *made);
    if (!made) return NULL;
    atomic_init(&made->refs, 1);
    if (!(made->ch = rpc_channel_create(t->address, &t->opts))) {
      free(made);
      return NULL;
    }
  }
}

rpc_channel_t *agent_data_channel(const agent_data_t *d) { return d->ch; }

void agent_data_release(agent_data_t *d) {
  if (!d || atomic_fetch_sub(&d->refs, 1) != 1) return;
  rpc_channel_destroy(d->ch);
  free(d);
}

void agent_pool_destroy(agent_pool_t *p) {
  if (!p) return;
  /* No on_lost here: the owner is tearing down; pending waits are cancelled. */
  for (size_t i = 0; i < p->cap; i++) {
    pool_link_t *pl = p->agents[i].link;
    if (pl) {
      agent_link_close(pl->link);
      free(pl);
    }
    rpc_channel_destroy(p->agents[i].channel);
    agent_data_release(p->agents[i].data);
  }
  watermark_destroy(p->marks);
  free(p->agents);
  free(p->client_ca);
  pthread_mutex_destroy(&p->ca_mu);
  pthread_mutex_destroy(&p->notify_mu);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

static int64_t unix_ms(void);
static bool grow_locked(agent_pool_t *p, size_t need);

/* ------------------------------------------------------------------ links */

static agent_t *find_locked(agent_pool_t *p, uint32_t rank, const char *agent_id,
                            uint64_t registration);

/* What a report says of its agent, under one lock (one per report): its
 * allocation, and when stamped with its clock, a sample of that clock's
 * offset, so that its grants follow the clock's drift and steps (grant.h,
 * Clocks); both only for this link's registration of it (a link of an
 * earlier registration still ending must not set the new one's figures). */
static void report_note(pool_link_t *pl, const agent_link_report_t *r) {
  agent_pool_t *p = pl->pool;
  bool clock = r->agent_unix_ms > 0;
  int64_t sample = clock ? grant_clock_offset(r->agent_unix_ms, r->recv_unix_ms) : 0;
  int64_t now = clock ? rpc_now_ms() : 0;
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, pl->rank, pl->agent_id, pl->registration);
  if (a) {
    a->allocated_bytes = r->allocated_bytes;
    if (clock) grant_clock_sample(&a->clock, sample, now);
  }
  pthread_mutex_unlock(&p->mu);
}

static void link_report(uint32_t rank, const agent_link_report_t *r, void *arg) {
  pool_link_t *pl = arg;
  agent_pool_t *p = pl->pool;
  report_note(pl, r);
  if (p->cb.on_report) p->cb.on_report(rank, r, p->cb.arg);
  watermark_session_t few[16], *ss = few;
  if (r->n_sessions > 16 && !(ss = malloc(r->n_sessions * sizeof *ss))) {
    watermark_advance(p->marks, rank, r->executed); /* correct, only slower for sessions */
    return;
  }
  for (size_t i = 0; i < r->n_sessions; i++)
    ss[i] = (watermark_session_t){r->sessions[i]->session_id, r->sessions[i]->executed_through};
  watermark_progress(p->marks, rank, r->executed, r->received, ss, r->n_sessions);
  if (ss != few) free(ss);
}

/* Counts pl's loss (once) and records it on its rank. Under p->mu. */
static void count_loss_locked(agent_pool_t *p, pool_link_t *pl) {
  if (pl->loss) return;
  pl->loss = ++p->losses;
  pl->loss_unix_ms = unix_ms();
  if (grow_locked(p, (size_t)pl->rank + 1)) {
    p->agents[pl->rank].lost_no = pl->loss;
    p->agents[pl->rank].lost_unix_ms = pl->loss_unix_ms;
  }
}

/* The link carried its last instruction: tell the owner, then fail the waits
 * on what it had not executed. The link must be broken or stopped, so its
 * numbers are final. */
/* Whether another registration holds pl's rank now: then pl was never put in
 * its slot (a removal waits for an installed link's reader, and the rank is
 * not given again before), so it carried no instruction and nothing was lost
 * on it; a loss counted on the rank would fail the new agent's meshes. */
static bool registered_again_locked(agent_pool_t *p, const pool_link_t *pl) {
  return pl->registration && pl->rank < p->cap && p->agents[pl->rank].used &&
         p->agents[pl->rank].d.registration != pl->registration;
}

static void link_gone(pool_link_t *pl) {
  if (atomic_exchange(&pl->gone, true)) return;
  agent_pool_t *p = pl->pool;
  uint64_t executed = agent_link_executed(pl->link), last = agent_link_last_seq(pl->link);
  agent_lost_t lost = {.rank = pl->rank};
  snprintf(lost.agent_id, sizeof lost.agent_id, "%s", pl->agent_id);
  snprintf(lost.data_address, sizeof lost.data_address, "%s", pl->data_address);
  pthread_mutex_lock(&p->mu);
  bool stale = registered_again_locked(p, pl);
  if (!stale) count_loss_locked(p, pl);
  lost.loss = pl->loss;
  lost.unix_ms = pl->loss_unix_ms;
  pthread_mutex_unlock(&p->mu);
  if (stale) return;
  if (p->cb.on_lost) p->cb.on_lost(&lost, p->cb.arg);
  watermark_lost(p->marks, pl->rank, executed, last);
}

static void link_lost(uint32_t rank, void *arg) {
  pool_link_t *pl = arg;
  /* An agent that cannot take instructions is of no use to sessions. */
  agent_pool_set_healthy(pl->pool, rank, pl->agent_id, pl->registration, false);
  link_gone(pl);
}

/* Stops and frees a link taken out of its slot; reports its loss if the reader
 * did not. Never with the pool lock held: callbacks take it. */
static void drop_link(pool_link_t *pl, const char *why) {
  if (!pl) return;
  agent_link_stop(pl->link);
  agent_link_stats_t st; /* final: the link is stopped */
  agent_link_stats(pl->link, &st);
  if (!atomic_load(&pl->gone)) { /* else the link logged its own loss */
    bool lost_work = st.last_seq > st.executed;
    log_write(lost_work ? LOG_LEVEL_WARN : LOG_LEVEL_INFO, "link", __FILE__, __LINE__,
              "rank %u (agent %s): Execute link closed: %s; executed through seq %llu of %llu, "
              "%zu queued instruction(s) dropped; %llu instruction(s) sent in %llu batch(es), "
              "%llu report(s) taken", pl->rank, pl->agent_id, why,
              (unsigned long long)st.executed, (unsigned long long)st.last_seq, st.queued,
              (unsigned long long)st.instructions_sent, (unsigned long long)st.batches_sent,
              (unsigned long long)st.reports);
  }
  link_gone(pl);
  agent_pool_t *p = pl->pool;
  pthread_mutex_lock(&p->mu);
  p->old_batches += st.batches_sent;
  p->old_instructions += st.instructions_sent;
  pthread_mutex_unlock(&p->mu);
  agent_link_close(pl->link);
  free(pl);
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

/* rank's agent if it is agent_id, and the registration `registration` of it
 * unless that is 0. */
static agent_t *find_locked(agent_pool_t *p, uint32_t rank, const char *agent_id,
                            uint64_t registration) {
  if (rank >= p->cap || !p->agents[rank].used) return NULL;
  agent_t *a = &p->agents[rank];
  if (registration && a->d.registration != registration) return NULL;
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

/* After a recount that changed the count: changed(the count now). */
static void notify(agent_pool_t *p, bool changed) {
  if (!changed || !p->changed) return;
  pthread_mutex_lock(&p->notify_mu);
  pthread_mutex_lock(&p->mu);
  int count = p->healthy;
  pthread_mutex_unlock(&p->mu);
  p->changed(count, p->arg);
  pthread_mutex_unlock(&p->notify_mu);
}

void agent_pool_set_max_agents(agent_pool_t *p, int max) {
  pthread_mutex_lock(&p->mu);
  p->max_agents = max > 0 ? max : AGENT_POOL_DEFAULT_MAX;
  pthread_mutex_unlock(&p->mu);
}

int agent_pool_max_agents(agent_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  int max = p->max_agents;
  pthread_mutex_unlock(&p->mu);
  return max;
}

void agent_pool_set_agent_tls(agent_pool_t *p, const rpc_tls_t *tls) {
  pthread_mutex_lock(&p->mu);
  p->agent_tls = tls ? *tls : (rpc_tls_t){0};
  pthread_mutex_unlock(&p->mu);
}

int agent_pool_client_tls(agent_pool_t *p, char **ca_pem, const char **server_name, char *err,
                          size_t errlen) {
  *ca_pem = NULL;
  *server_name = NULL;
  pthread_mutex_lock(&p->mu);
  rpc_tls_t t = p->agent_tls;
  pthread_mutex_unlock(&p->mu);
  if (!t.on || !t.ca_file) return 0;
  struct stat st;
  struct timespec now = stat(t.ca_file, &st) == 0 ? st.st_mtim : (struct timespec){0, 0};
  pthread_mutex_lock(&p->ca_mu);
  bool changed = !p->client_ca || now.tv_sec != p->client_ca_mtime.tv_sec ||
                 now.tv_nsec != p->client_ca_mtime.tv_nsec;
  if (changed) { /* rotated like the certificates: at the next use after a change */
    char *pem = rpc_tls_read_pem("--cluster-ca", t.ca_file, "CERTIFICATE", err, errlen);
    if (pem) {
      free(p->client_ca);
      p->client_ca = pem;
      p->client_ca_mtime = now;
    } else if (p->client_ca) {
      log_warn("pool", "%s; clients still get the CA read before", err);
      p->client_ca_mtime = now; /* again at the next change, not each call */
    }
  }
  bool have = p->client_ca != NULL;
  char *copy = have ? strdup(p->client_ca) : NULL;
  pthread_mutex_unlock(&p->ca_mu);
  if (!copy) {
    if (have) snprintf(err, errlen, "out of memory");
    return -1;
  }
  *ca_pem = copy;
  *server_name = t.server_name ? t.server_name : "";
  return 0;
}

int agent_pool_add(agent_pool_t *p, const agent_desc_t *d, int requested, char *err,
                   size_t errlen) {
  pthread_mutex_lock(&p->mu);
  int rank = -1;
  if (requested >= p->max_agents) {
    snprintf(err, errlen, "rank %d is beyond this server's pool of %d ranks (0..%d; --max-agents)",
             requested, p->max_agents, p->max_agents - 1);
    goto out;
  }
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
    if (a->leaving) {
      snprintf(err, errlen, "rank %d is still being released by its previous agent; register "
               "again in a moment", requested);
      goto out;
    }
    rank = requested;
  } else {
    /* The lowest free rank not reserved for a replacement; else the lowest free. */
    int64_t now = unix_ms();
    size_t i = 0;
    while (i < p->cap && (p->agents[i].used || p->agents[i].leaving ||
                          p->agents[i].reserved_until_ms > now))
      i++;
    if (i >= (size_t)p->max_agents) {
      i = 0;
      while (i < p->cap && (p->agents[i].used || p->agents[i].leaving)) i++;
    }
    if (i >= (size_t)p->max_agents) {
      snprintf(err, errlen, "the pool is full: %d agents registered (--max-agents %d)",
               p->max_agents, p->max_agents);
      goto out;
    }
    if (!grow_locked(p, i + 1)) {
      snprintf(err, errlen, "out of memory");
      goto out;
    }
    rank = (int)i;
  }
  agent_t *a = &p->agents[rank];
  uint64_t floor = a->seq_floor, lost_no = a->lost_no;
  int64_t lost_ms = a->lost_unix_ms, drained_ms = a->drained_ms;
  bool drained = a->drained;
  memset(a, 0, sizeof *a);
  a->seq_floor = floor;
  a->lost_no = lost_no;
  a->lost_unix_ms = lost_ms;
  a->drained = drained;
  a->drained_ms = drained_ms;
  a->used = true;
  a->asked = requested >= 0;
  a->d = *d;
  a->registered_unix_ms = unix_ms();
out:
  pthread_mutex_unlock(&p->mu);
  return rank;
}

bool agent_pool_holder(agent_pool_t *p, const agent_desc_t *d, int requested,
                       agent_pool_holder_t *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&p->mu);
  agent_t *a = NULL;
  for (size_t i = 0; i < p->cap && !a; i++)
    if (p->agents[i].used && strcmp(p->agents[i].d.agent_id, d->agent_id) == 0) a = &p->agents[i];
  if (!a && requested >= 0 && (size_t)requested < p->cap &&
      (p->agents[requested].used || p->agents[requested].leaving))
    a = &p->agents[requested];
  if (a) {
    out->rank = (uint32_t)(a - p->agents);
    out->leaving = !a->used; /* its slot is emptied before its link is dropped */
    out->healthy = a->used && a->healthy;
    out->registration = a->d.registration;
    snprintf(out->agent_id, sizeof out->agent_id, "%s", a->d.agent_id);
  }
  pthread_mutex_unlock(&p->mu);
  return a != NULL;
}

void agent_pool_remove(agent_pool_t *p, uint32_t rank, const char *agent_id, uint64_t registration,
                       const char *why) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id, registration);
  rpc_channel_t *ch = NULL;
  pool_link_t *pl = NULL;
  agent_data_t *data = NULL;
  int count = 0;
  bool changed = false;
  if (a) {
    log_event(LOG_LEVEL_INFO, "pool", &(log_fields_t){LOG_RANK(rank)},
              "agent rank %u (%s, %s) left: %s", rank, a->d.address, a->d.agent_id, why);
    ch = a->channel;
    pl = a->link;
    data = a->data;
    /* Sends take the pool lock, so the link's last seq is final here. */
    uint64_t floor = pl ? agent_link_last_seq(pl->link) : a->seq_floor, lost_no = a->lost_no;
    int64_t lost_ms = a->lost_unix_ms, drained_ms = a->drained_ms;
    int64_t reserved = a->asked ? unix_ms() + AGENT_POOL_RESERVE_MS : 0;
    bool drained = a->drained;
    memset(a, 0, sizeof *a);
    a->seq_floor = floor;
    a->lost_no = lost_no;
    a->lost_unix_ms = lost_ms;
    a->reserved_until_ms = reserved;
    a->drained = drained;
    a->drained_ms = drained_ms;
    a->leaving = true;
    /* Lost as of now, in the same step that empties the slot: a mesh with this
     * rank must refuse commands (agent_pool_check_lost) from the moment the
     * rank has no agent, not only once drop_link below reports the loss, or a
     * command in between goes out with no address for the rank. */
    if (pl) count_loss_locked(p, pl);
    changed = recount_locked(p, &count);
  }
  pthread_mutex_unlock(&p->mu);
  drop_link(pl, why); /* before its channel goes */
  if (a) {
    pthread_mutex_lock(&p->mu);
    p->agents[rank].leaving = false; /* by index: the array may have grown */
    pthread_mutex_unlock(&p->mu);
  }
  rpc_channel_destroy(ch);
  agent_data_release(data); /* transfers that hold it end on their own */
  notify(p, changed);
}

void agent_pool_set_healthy(agent_pool_t *p, uint32_t rank, const char *agent_id,
                            uint64_t registration, bool healthy) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id, registration);
  int count = 0;
  bool changed = false;
  /* A dialed-back agent needs its Execute link to be of use to sessions. */
  if (a && healthy && a->channel && (!a->link || agent_link_broken(a->link->link))) {
    log_warn("pool", "agent rank %u (%s) stays unhealthy: its Execute link is %s", rank,
             a->d.address, a->link ? "broken" : "not open");
    a = NULL;
  }
  if (a && a->healthy != healthy) {
    a->healthy = healthy;
    log_event(LOG_LEVEL_INFO, "pool", &(log_fields_t){LOG_RANK(rank)},
              "agent rank %u (%s) is %s", rank, a->d.address, healthy ? "healthy" : "unhealthy");
    changed = recount_locked(p, &count);
  }
  pthread_mutex_unlock(&p->mu);
  notify(p, changed);
}

void agent_pool_set_allocated(agent_pool_t *p, uint32_t rank, const char *agent_id,
                              uint64_t registration, uint64_t bytes) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id, registration);
  if (a) a->allocated_bytes = bytes;
  pthread_mutex_unlock(&p->mu);
}

int64_t agent_pool_clock_sample(agent_pool_t *p, uint32_t rank, const char *agent_id,
                                uint64_t registration, int64_t agent_ms, int64_t recv_ms) {
  if (agent_ms <= 0) return 0; /* an older agent: no clock, the server's times */
  int64_t sample = grant_clock_offset(agent_ms, recv_ms), now = rpc_now_ms(), est = 0;
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id, registration);
  if (a) est = grant_clock_sample(&a->clock, sample, now);
  pthread_mutex_unlock(&p->mu);
  return est;
}

void agent_pool_set_channel(agent_pool_t *p, uint32_t rank, const char *agent_id,
                            uint64_t registration, rpc_channel_t *ch) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = find_locked(p, rank, agent_id, registration);
  rpc_channel_t *old = NULL;
  pool_link_t *old_link = NULL;
  uint64_t first_seq = 0;
  char secret[SECRET_HEX_LEN + 1] = "";
  uint64_t reg_no = 0; /* the slot's own, also when the caller named none */
  if (a) {
    reg_no = a->d.registration;
    memcpy(secret, a->d.call_secret, sizeof secret);
    old = a->channel;
    old_link = a->link;
    if (old_link) a->seq_floor = agent_link_last_seq(old_link->link);
    a->channel = NULL;
    a->link = NULL;
    first_seq = a->seq_floor + 1;
  }
  pthread_mutex_unlock(&p->mu);
  drop_link(old_link, "the agent was dialed back again");
  if (old != ch) rpc_channel_destroy(old);
  if (!a) { /* the agent left meanwhile */
    rpc_channel_destroy(ch);
    return;
  }

  /* Opened outside the lock: starting the call may take a round trip. */
  pool_link_t *pl = calloc(1, sizeof *pl);
  if (pl) {
    pl->pool = p;
    pl->rank = rank;
    pl->registration = reg_no;
    pl->first_seq = first_seq;
    snprintf(pl->agent_id, sizeof pl->agent_id, "%s", agent_id);
    agent_pool_data_address(p, rank, pl->data_address, sizeof pl->data_address);
    agent_link_callbacks_t cb = {link_report, link_lost, pl};
    pl->link = agent_link_open(ch, rank, agent_id, first_seq, secret[0] ? secret : NULL, &cb);
    if (!pl->link) {
      free(pl);
      pl = NULL;
    }
  }
  pthread_mutex_lock(&p->mu);
  a = find_locked(p, rank, agent_id, reg_no);
  bool kept = a && !a->channel && !a->link;
  if (kept) {
    a->channel = ch;
    a->link = pl;
  }
  pthread_mutex_unlock(&p->mu);
  if (!kept) {
    drop_link(pl, "the agent left while its link opened");
    rpc_channel_destroy(ch);
  }
}

void agent_pool_flush(agent_pool_t *p, uint32_t rank) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
  if (a && a->link) agent_link_flush(a->link->link);
  pthread_mutex_unlock(&p->mu);
}

/* watermark_set_kick: a wait for rank's progress sends what its link defers. */
static void kick_rank(uint32_t rank, void *arg) { agent_pool_flush(arg, rank); }

int agent_pool_send(agent_pool_t *p, uint32_t rank, const Meshd__Agent__V1__Instruction *ins,
                    uint64_t *seq_out) {
  /* Packed outside the lock: O(size). */
  return agent_pool_send_msg(p, rank, agent_link_pack(ins), seq_out);
}

int agent_pool_send_msg(agent_pool_t *p, uint32_t rank, agent_link_msg_t *m, uint64_t *seq_out) {
  uint64_t seq = 0;
  pthread_mutex_lock(&p->mu);
  agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
  if (a && a->link) seq = agent_link_push(a->link->link, m);
  else agent_link_msg_free(m);
  pthread_mutex_unlock(&p->mu);
  if (seq_out) *seq_out = seq;
  return seq ? 0 : -1;
}

const char *agent_pool_data_address(agent_pool_t *p, uint32_t rank, char *buf, size_t len) {
  buf[0] = '\0';
  pthread_mutex_lock(&p->mu);
  agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
  if (a && a->d.data_port) {
    char host[256];
    snprintf(host, sizeof host, "%s", a->d.address);
    char *colon = strrchr(host, ':');
    if (colon) *colon = '\0';
    snprintf(buf, len, "%s:%u", host, a->d.data_port);
  }
  pthread_mutex_unlock(&p->mu);
  return buf;
}

int agent_pool_address(agent_pool_t *p, uint32_t rank, char *buf, size_t len) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
  if (a) snprintf(buf, len, "%s", a->d.address);
  pthread_mutex_unlock(&p->mu);
  return a ? 0 : -1;
}

int agent_pool_target(agent_pool_t *p, uint32_t rank, int connect_timeout_ms,
                      agent_target_t *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&p->mu);
  agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
  if (a) {
    snprintf(out->address, sizeof out->address, "%s", a->d.address);
    memcpy(out->secret, a->d.call_secret, sizeof out->secret);
    out->opts.tls = p->agent_tls;
    out->clock_offset_ms = a->clock.offset_ms;
  }
  pthread_mutex_unlock(&p->mu);
  out->opts.connect_timeout_ms = connect_timeout_ms;
  out->md[0] = (rpc_md_t){SECRET_AGENT_MD, out->secret};
  return a ? 0 : -1;
}

uint64_t agent_pool_last_seq(agent_pool_t *p, uint32_t rank) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
  uint64_t seq = a && a->link ? agent_link_last_seq(a->link->link) : 0;
  pthread_mutex_unlock(&p->mu);
  return seq;
}

bool agent_pool_on_link(agent_pool_t *p, uint32_t rank, uint64_t seq) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
  bool on = seq && a && a->link && seq >= a->link->first_seq &&
            seq <= agent_link_last_seq(a->link->link) && !agent_link_broken(a->link->link);
  pthread_mutex_unlock(&p->mu);
  return on;
}

uint64_t agent_pool_executed(agent_pool_t *p, uint32_t rank) {
  return watermark_executed(p->marks, rank);
}

size_t agent_pool_queued(agent_pool_t *p, uint32_t rank) {
  pthread_mutex_lock(&p->mu);
  agent_t *a = rank < p->cap && p->agents[rank].used ? &p->agents[rank] : NULL;
  size_t n = a && a->link ? agent_link_queued(a->link->link) : 0;
  pthread_mutex_unlock(&p->mu);
  return n;
}

agent_pool_totals_t agent_pool_totals(agent_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  agent_pool_totals_t t = {.batches = p->old_batches, .instructions = p->old_instructions};
  for (size_t i = 0; i < p->cap; i++) {
    agent_t *a = &p->agents[i];
    if (!a->used || !a->link) continue;
    agent_link_stats_t st;
    agent_link_stats(a->link->link, &st);
    if (!st.broken && st.last_seq > st.executed) t.pending += st.last_seq - st.executed;
    t.batches += st.batches_sent;
    t.instructions += st.instructions_sent;
  }
  pthread_mutex_unlock(&p->mu);
  return t;
}

watermark_t *agent_pool_watermark(agent_pool_t *p) { return p->marks; }

int agent_pool_healthy(agent_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  int n = p->healthy;
  pthread_mutex_unlock(&p->mu);
  return n;
}

bool *agent_pool_healthy_map(agent_pool_t *p, size_t *world) {
  pthread_mutex_lock(&p->mu);
  size_t n = p->cap;
  bool *map = calloc(n ? n : 1, sizeof *map);
  for (size_t i = 0; map && i < n; i++) map[i] = p->agents[i].used && p->agents[i].healthy;
  pthread_mutex_unlock(&p->mu);
  *world = map ? n : 0;
  return map;
}

bool *agent_pool_drained_map(agent_pool_t *p, int64_t since_ms, size_t world) {
  bool *map = calloc(world ? world : 1, sizeof *map);
  if (!map) return NULL;
  pthread_mutex_lock(&p->mu);
  for (size_t i = 0; i < world && i < p->cap; i++)
    map[i] = p->agents[i].drained && p->agents[i].drained_ms <= since_ms;
  pthread_mutex_unlock(&p->mu);
  return map;
}

int agent_pool_set_drained(agent_pool_t *p, uint32_t rank, bool drained, meshd_error_t *err) {
  pthread_mutex_lock(&p->mu);
  int rc = 0;
  /* A drained rank whose agent is away (maintenance) may be undrained still. */
  bool away_drained = rank < p->cap && p->agents[rank].drained && !drained;
  if ((rank >= p->cap || !p->agents[rank].used) && !away_drained) {
    int n = 0;
    for (size_t i = 0; i < p->cap; i++) n += p->agents[i].used;
    rc = error_set(err, ERR_UNKNOWN_REF,
                   "DrainAgent: rank %u has no agent (%d registered; meshctl agents lists them)",
                   rank, n);
  } else if (p->agents[rank].drained != drained) {
    agent_t *a = &p->agents[rank];
    a->drained = drained;
    a->drained_ms = drained ? rpc_now_ms() : 0;
    log_info("pool", "agent rank %u (%s, %s) %s", rank, a->used ? a->d.address : "no agent now",
             a->used ? a->d.agent_id : "-",
             drained ? "drained: sessions created from now on get no mesh on it"
                     : "undrained: back in placement");
  }
  pthread_mutex_unlock(&p->mu);
  return rc;
}

uint64_t agent_pool_min_capacity(agent_pool_t *p, const uint32_t *ranks, size_t n) {
  uint64_t min = 0;
  pthread_mutex_lock(&p->mu);
  for (size_t i = 0; i < n; i++) {
    if (ranks[i] >= p->cap || !p->agents[ranks[i]].used) continue;
    uint64_t c = p->agents[ranks[i]].d.memory_bytes;
    if (c && (!min || c < min)) min = c;
  }
  pthread_mutex_unlock(&p->mu);
  return min;
}

int64_t agent_pool_first_without(agent_pool_t *p, const uint32_t *ranks, size_t n, uint32_t body,
                                 char *version, size_t len) {
  int64_t found = -1;
  pthread_mutex_lock(&p->mu);
  for (size_t i = 0; i < n && found < 0; i++) {
    if (ranks[i] >= p->cap || !p->agents[ranks[i]].used) continue; /* gone: the mesh check says so */
    const agent_desc_t *d = &p->agents[ranks[i]].d;
    if (d->instructions >= body) continue;
    found = ranks[i];
    snprintf(version, len, "%s", d->version[0] ? d->version : "unknown");
  }
  pthread_mutex_unlock(&p->mu);
  return found;
}

uint32_t agent_pool_data_plane(agent_pool_t *p, const uint32_t *ranks, size_t n) {
  uint32_t least = UINT32_MAX;
  pthread_mutex_lock(&p->mu);
  for (size_t i = 0; i < n; i++) {
    uint32_t f = ranks[i] < p->cap && p->agents[ranks[i]].used ? p->agents[ranks[i]].d.data_plane : 0;
    if (f < least) least = f;
  }
  pthread_mutex_unlock(&p->mu);
  return n ? least : 0;
}

int agent_pool_size(agent_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  int n = 0;
  for (size_t i = 0; i < p->cap; i++) n += p->agents[i].used;
  pthread_mutex_unlock(&p->mu);
  return n;
}

agent_pool_census_t agent_pool_census(agent_pool_t *p) {
  agent_pool_census_t c = {0};
  pthread_mutex_lock(&p->mu);
  for (size_t i = 0; i < p->cap; i++) {
    const agent_t *a = &p->agents[i];
    if (!a->used) continue;
    c.total++;
    c.healthy += a->healthy;
    c.drained += a->drained;
  }
  pthread_mutex_unlock(&p->mu);
  return c;
}

int agent_pool_snapshot(agent_pool_t *p, Meshd__V1__AgentInfo ***out, size_t *n) {
  uint64_t next;
  return agent_pool_snapshot_page(p, 0, SIZE_MAX, out, n, &next) == 0 ? 0 : -1;
}

int agent_pool_snapshot_page(agent_pool_t *p, uint64_t after, size_t limit,
                             Meshd__V1__AgentInfo ***out, size_t *n, uint64_t *next) {
  *out = NULL;
  *n = 0;
  *next = 0;
  if (limit == 0) limit = 1;
  pthread_mutex_lock(&p->mu);
  /* A row's number is its rank + 1: "after" names the rank to start at. */
  size_t bound = p->cap > (size_t)p->max_agents ? p->cap : (size_t)p->max_agents;
  if (after > bound) {
    pthread_mutex_unlock(&p->mu);
    return -2;
  }
  size_t count = 0, end = p->cap;
  for (size_t i = (size_t)after; i < p->cap; i++) {
    if (!p->agents[i].used) continue;
    if (count == limit) { /* another row follows this page's last */
      end = i;
      break;
    }
    count++;
  }
  Meshd__V1__AgentInfo **infos = calloc(count ? count : 1, sizeof *infos);
  size_t k = 0;
  for (size_t i = (size_t)after; infos && i < end; i++) {
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
    info->drained = a->drained;
    info->version = strdup(a->d.version);
    info->commit = strdup(a->d.commit);
    info->build_type = strdup(a->d.build_type);
    info->cuda = a->d.cuda;
    infos[k++] = info;
    if (!info->address || !info->device || !info->agent_id || !info->version ||
        !info->commit || !info->build_type)
      break;
  }
  bool more = end < p->cap; /* under mu: a registration may grow the array after */
  pthread_mutex_unlock(&p->mu);
  if (!infos || k != count) {
    agent_pool_snapshot_free(infos, k);
    return -1;
  }
  *out = infos;
  *n = k;
  if (more && k) *next = (uint64_t)infos[k - 1]->rank + 1;
  return 0;
}

uint32_t agent_pool_epoch(const agent_pool_t *p) { return p->epoch; }

void agent_pool_snapshot_free(Meshd__V1__AgentInfo **infos, size_t n) {
  for (size_t i = 0; infos && i < n; i++) {
    free(infos[i]->address);
    free(infos[i]->device);
    free(infos[i]->agent_id);
    free(infos[i]->version);
    free(infos[i]->commit);
    free(infos[i]->build_type);
    free(infos[i]);
  }
  free(infos);
}

uint64_t agent_pool_losses(agent_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  uint64_t n = p->losses;
  pthread_mutex_unlock(&p->mu);
  return n;
}

int agent_pool_check_lost(agent_pool_t *p, const uint32_t *ranks, size_t n, uint64_t since,
                          const char *cmd, meshd_error_t *err) {
  pthread_mutex_lock(&p->mu);
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    if (ranks[i] >= p->cap || p->agents[ranks[i]].lost_no <= since) continue;
    const agent_t *a = &p->agents[ranks[i]];
    char when[32];
    time_t t = (time_t)(a->lost_unix_ms / 1000);
    struct tm tm;
    gmtime_r(&t, &tm);
    size_t k = strftime(when, sizeof when, "%H:%M:%S", &tm);
    snprintf(when + k, sizeof when - k, ".%03d UTC", (int)(a->lost_unix_ms % 1000));
    rc = error_set(err, ERR_AGENT_LOST,
                   "%s: the agent of rank %u was lost at %s, after this mesh was made; the mesh "
                   "can no longer run commands: create a new mesh (rank %u %s)", cmd, ranks[i],
                   when, ranks[i], a->used && a->healthy ? "has a replacement now"
                                                          : "will use its replacement");
  }
  pthread_mutex_unlock(&p->mu);
  return rc;
}
