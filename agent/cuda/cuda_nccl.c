/* The cuda backend's communicators (cuda_nccl.h).
 *
 * Bootstrap. NCCL needs a unique id made by one member and known to all. The
 * agents already share a TCP data plane (b->net), so member 0 makes the id and
 * dp_sends it to every other member on comm_id itself, in the data plane call
 * that needs the communicator (its number: a member that missed a round
 * skips that round's id as an older call's): no server round trip, the data
 * plane's own timeout bounds the wait for an absent member 0, and the
 * session's end (dataplane_drop_comm of comm_id) ends a wait for it.
 *
 * Communicators. A group's is keyed by (session, comm_id, its members and their
 * addresses: a replaced agent has a new address, hence a new communicator). A
 * point-to-point one is directional, keyed by (session, comm_id, peer, peer's
 * address, send or receive); the sender is NCCL rank 0 and makes the id. One
 * per direction because a pair of agents may send to each other at once on the
 * same comm_id from different stream threads, and two threads must never drive
 * one NCCL communicator. It also means a slot needs no world rank of its own.
 *
 * Ordering. Every communicator has its own CUDA stream: it waits for the
 * caller's stream (an event), runs the NCCL work, and the call waits for it
 * with a deadline (cudaEventQuery + ncclCommGetAsyncError). Private streams
 * keep two communicators' kernels from queueing behind each other on one
 * stream, which deadlocks when two agents queue them in opposite orders.
 *
 * Failure. Past comm_timeout_ms, or on any NCCL error, the communicator is
 * aborted (ncclCommAbort stops its kernels) and dropped from the cache; the
 * next call on that key makes a new one. comms->mu guards the cache only and
 * is never held while NCCL or the data plane waits. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nccl.h>

#include "cuda_internal.h"
#include "cuda_nccl.h"
#include "dataplane/reduce_ops.h"
#include "log.h"

#define BOOT_MAGIC 0x4d44424f4f540001ull
#define POLL_MIN_NS 20000L
#define POLL_MAX_NS 1000000L

/* ------------------------------------------------------------------ the plan */

static int nccl_type_of(dtype_t d) {
  switch (d) {
  case DTYPE_FLOAT32: return ncclFloat32;
  case DTYPE_FLOAT64: return ncclFloat64;
  case DTYPE_FLOAT16: return ncclFloat16;
  case DTYPE_BFLOAT16: return ncclBfloat16;
  case DTYPE_INT8: return ncclInt8;
  case DTYPE_UINT8: return ncclUint8;
  case DTYPE_INT32: return ncclInt32;
  case DTYPE_INT64: return ncclInt64;
  default: return -1; /* int16, bool: no NCCL type */
  }
}

cuda_nccl_plan_t cuda_nccl_plan(dtype_t dtype, reduction_t op) {
  cuda_nccl_plan_t p = {CUDA_PLAN_INVALID, -1, -1};
  if (!reduction_combines(op) || !reduction_dtype_ok(op, dtype)) return p;
  int t = nccl_type_of(dtype), o = -1;
  switch (op) {
  case RED_SUM: o = ncclSum; break;
  case RED_PRODUCT: o = ncclProd; break;
  case RED_AVG: o = ncclAvg; break; /* floating only (reduction.h) */
  /* NCCL's float min/max keep or drop a NaN depending on operand order; the
   * cpu data plane (and torch.min) propagate it: floats take the fallback. */
  case RED_MIN: o = dtype_is_floating(dtype) ? -1 : ncclMin; break;
  case RED_MAX: o = dtype_is_floating(dtype) ? -1 : ncclMax; break;
  default: break; /* bitwise: NCCL has none */
  }
  if (t < 0 || o < 0) {
    p.kind = CUDA_PLAN_GATHER;
    return p;
  }
  p.kind = CUDA_PLAN_NATIVE;
  p.nccl_dtype = t;
  p.nccl_op = o;
  return p;
}

/* Why cuda_nccl_plan refused: the data plane's check, so that both backends
 * refuse alike (reduction.h's rules). */
static int plan_error(const char *what, dtype_t dtype, reduction_t op, meshd_error_t *e) {
  if (dp_reduce_check(op, dtype, e) == 0)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: reduction '%s' has no NCCL plan on %s", what,
                     reduction_name(op), dtype_name(dtype));
  error_prefix(e, what, ": ");
  return -1;
}

/* ------------------------------------------------------------------ helpers */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void nap(long *ns) {
  struct timespec ts = {0, *ns};
  nanosleep(&ts, NULL);
  *ns = *ns * 2 > POLL_MAX_NS ? POLL_MAX_NS : *ns * 2;
}

static int timeout_ms_of(const cuda_state_t *st) {
  return st->comm_timeout_ms > 0 ? st->comm_timeout_ms : 30000;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

static int no_net(const char *what, meshd_error_t *e) {
  return error_set(e, ERR_REMOTE_FAILURE,
                   "%s: this agent has no data plane (it failed to start): collectives and sends "
                   "between agents are unavailable",
                   what);
}

static int check_group(const char *what, const dp_group_t *g, meshd_error_t *e) {
  if (!g || g->n == 0 || g->me >= g->n || !g->ranks || !g->addrs)
    return error_set(e, ERR_BAD_ARGUMENT, "%s: needs a group with this agent in it", what);
  for (size_t i = 0; i < g->n; i++)
    if (!g->addrs[i])
      return error_set(e, ERR_BAD_ARGUMENT, "%s: group member %zu has no address", what, i);
  if (g->n > 1 && !g->secret) /* the NCCL id travels over the data plane, which needs it */
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s on comm %llu: the group has no secret (its instruction lacks one), so "
                     "its members cannot prove they belong to it",
                     what, (unsigned long long)g->comm_id);
  return 0;
}

/* ---------------------------------------------------------- the cache */

typedef enum { COMM_GROUP, COMM_SEND, COMM_RECV } comm_kind_t;

typedef struct comm {
  struct comm *next;
  int refs;    /* under comms->mu: the cache's (while linked) and each user's */
  bool linked; /* in comms->list */
  comm_kind_t kind;
  uint64_t session, comm_id;
  uint64_t call; /* of the call that made it: its bootstrap's frames carry it */
  size_t n, me;
  uint32_t *ranks; /* n; for point to point: [the peer] */
  char **addrs;    /* n, owned */
  uint64_t key;    /* key_of: what the members check when the id arrives */
  uint8_t secret[DP_SECRET_LEN]; /* the group's: the bootstrap's data plane proves it */
  uint8_t *pairs; /* n * DP_SECRET_LEN, owned, or NULL: its pair secrets, proved instead */
  int device;
  pthread_mutex_t busy; /* one operation at a time on this communicator */
  ncclComm_t nc;        /* NULL once aborted */
  _Atomic bool lost;    /* a member was declared lost: its user aborts it */
  char lost_why[160];   /* written before lost is set */
  cudaStream_t stream;
  cudaEvent_t ready, done;
} comm_t;

struct cuda_comms {
  pthread_mutex_t mu;
  comm_t *list;
  comm_t *setup; /* being made (comm_get), through next: cuda_peer_lost flags them too */
};

cuda_comms_t *cuda_comms_create(void) {
  cuda_comms_t *c = calloc(1, sizeof *c);
  if (c) pthread_mutex_init(&c->mu, NULL);
  return c;
}

static bool same_key(const comm_t *c, comm_kind_t kind, uint64_t session, const dp_group_t *g) {
  if (c->kind != kind || c->session != session || c->comm_id != g->comm_id || c->n != g->n ||
      c->me != g->me)
    return false;
  for (size_t i = 0; i < g->n; i++)
    if (c->ranks[i] != g->ranks[i] || strcmp(c->addrs[i], g->addrs[i]) != 0) return false;
  return g->secret && memcmp(c->secret, g->secret, DP_SECRET_LEN) == 0;
}

/* What every member can compute alike, checked when the id arrives: not the
 * session key (agent-local), nor a point-to-point peer or direction (the two
 * ends see each other); comm_id already names the session. */
static uint64_t key_of(comm_kind_t kind, const dp_group_t *g) {
  uint64_t h = fnv(1469598103934665603ull, &g->comm_id, sizeof g->comm_id);
  uint64_t tag = kind == COMM_GROUP ? 1 : 2;
  h = fnv(h, &tag, sizeof tag);
  if (kind != COMM_GROUP) return h;
  h = fnv(h, &g->n, sizeof g->n);
  for (size_t i = 0; i < g->n; i++) {
    h = fnv(h, &g->ranks[i], sizeof g->ranks[i]);
    h = fnv(h, g->addrs[i], strlen(g->addrs[i]) + 1);
  }
  return h;
}

static void comm_free_mem(comm_t *c) {
  if (!c) return;
  for (size_t i = 0; c->addrs && i < c->n; i++) free(c->addrs[i]);
  free(c->addrs);
  free(c->ranks);
  free(c->pairs);
  pthread_mutex_destroy(&c->busy);
  free(c);
}

/* Ends c's NCCL side: destroyed when its finalize completed, else aborted. */
static void comm_end_nccl(comm_t *c, bool finalized) {
  if (c->device >= 0) cudaSetDevice(c->device);
  if (finalized) ncclCommDestroy(c->nc);
  else ncclCommAbort(c->nc);
  c->nc = NULL;
}

/* Aborts the NCCL side, if any is left, and frees the CUDA objects. */
static void comm_teardown(comm_t *c) {
  if (c->device >= 0) cudaSetDevice(c->device);
  if (c->nc) ncclCommAbort(c->nc);
  c->nc = NULL;
  if (c->done) cudaEventDestroy(c->done);
  if (c->ready) cudaEventDestroy(c->ready);
  if (c->stream) cudaStreamDestroy(c->stream);
  c->done = c->ready = NULL;
  c->stream = NULL;
}

/* Drops one reference; the last one tears the communicator down. */
static void comm_put(cuda_comms_t *cs, comm_t *c) {
  pthread_mutex_lock(&cs->mu);
  bool last = --c->refs == 0;
  pthread_mutex_unlock(&cs->mu);
  if (!last) return;
  comm_teardown(c);
  comm_free_mem(c);
}

/* Polls c's finalize; once it has settled, ends c's NCCL side. Whether it is
 * still in progress. */
static bool finalize_pending(comm_t *c) {
  if (c->device >= 0) cudaSetDevice(c->device);
  ncclResult_t a = ncclSuccess, r = ncclCommGetAsyncError(c->nc, &a);
  if (r == ncclSuccess) r = a;
  if (r == ncclInProgress) return true;
  comm_end_nccl(c, r == ncclSuccess);
  return false;
}

/* Finalizes the communicators of `list` (through next) together. A finalize
 * completes only once the communicator is globally quiescent (nccl.h), i.e.
 * once its peers finalize theirs, and a peer may hold the same communicators
 * in another order (two streams made them at once): waiting for one at a
 * time, each agent would wait for a peer that waits for it on another one,
 * until the deadline. So every finalize starts first, then all are polled;
 * those unfinished at the deadline (or that err) are aborted. */
static void comms_finalize(comm_t *list, int64_t deadline) {
  size_t pending = 0;
  for (comm_t *c = list; c; c = c->next) {
    if (!c->nc) continue;
    if (c->device >= 0) cudaSetDevice(c->device);
    ncclResult_t r = ncclCommFinalize(c->nc);
    if (r == ncclInProgress) pending++;
    else comm_end_nccl(c, r == ncclSuccess);
  }
  long ns = POLL_MIN_NS;
  while (pending > 0 && now_ns() < deadline) {
    nap(&ns);
    pending = 0;
    for (comm_t *c = list; c; c = c->next)
      if (c->nc && finalize_pending(c)) pending++;
  }
  for (comm_t *c = list; c; c = c->next)
    if (c->nc) comm_end_nccl(c, false); /* a peer never finalized its own */
}

static void comm_unlink(cuda_comms_t *cs, comm_t *c) {
  pthread_mutex_lock(&cs->mu);
  bool was = c->linked;
  if (was) {
    for (comm_t **p = &cs->list; *p; p = &(*p)->next)
      if (*p == c) {
        *p = c->next;
        break;
      }
    c->linked = false;
    c->refs--; /* the cache's; the caller still holds its own */
  }
  pthread_mutex_unlock(&cs->mu);
}

void cuda_comms_destroy(cuda_comms_t *cs) {
  if (!cs) return;
  comm_t *c = cs->list;
  while (c) {
    comm_t *next = c->next;
    comm_teardown(c);
    comm_free_mem(c);
    c = next;
  }
  pthread_mutex_destroy(&cs->mu);
  free(cs);
}

void cuda_session_end(backend_t *b, uint64_t session) {
  cuda_state_t *st = cuda_state(b);
  cuda_comms_t *cs = st->comms;
  if (st->emulated || !cs) return;
  comm_t *mine = NULL; /* those whose last reference was the cache's */
  pthread_mutex_lock(&cs->mu);
  for (comm_t **p = &cs->list; *p;) {
    comm_t *c = *p;
    if (c->session != session) {
      p = &c->next;
      continue;
    }
    *p = c->next;
    c->linked = false;
    if (--c->refs > 0) continue; /* in use: its user's comm_put aborts it */
    c->next = mine;
    mine = c;
  }
  pthread_mutex_unlock(&cs->mu);
  /* One deadline for the whole session: a dead peer costs one timeout, not one
   * per communicator. */
  comms_finalize(mine, now_ns() + (int64_t)timeout_ms_of(st) * 1000000);
  while (mine) {
    comm_t *next = mine->next;
    comm_teardown(mine);
    comm_free_mem(mine);
    mine = next;
  }
}

void cuda_peer_lost(backend_t *b, uint64_t session, uint32_t rank) {
  cuda_state_t *st = cuda_state(b);
  cuda_comms_t *cs = st->comms;
  if (st->emulated || !cs) return;
  /* Only flagged here: the thread using the communicator aborts it (an abort
   * from under a user would free what it polls), and nobody picks it again. */
  pthread_mutex_lock(&cs->mu);
  for (comm_t *c = cs->setup; c; c = c->next) { /* their maker polls the flag */
    bool member = false;
    for (size_t i = 0; i < c->n; i++) member |= c->ranks[i] == rank;
    if (c->session == session && member && !atomic_load(&c->lost)) {
      snprintf(c->lost_why, sizeof c->lost_why, "rank %u was declared lost", rank);
      atomic_store(&c->lost, true);
    }
  }
  for (comm_t **p = &cs->list; *p;) {
    comm_t *c = *p;
    bool member = false;
    for (size_t i = 0; i < c->n; i++) member |= c->ranks[i] == rank;
    if (c->session == session && member) {
      snprintf(c->lost_why, sizeof c->lost_why, "rank %u was declared lost", rank);
      atomic_store(&c->lost, true);
      *p = c->next;
      c->linked = false;
      c->refs--; /* the cache's */
      if (c->refs == 0) { /* nobody uses it: tear it down now */
        pthread_mutex_unlock(&cs->mu);
        comm_teardown(c);
        comm_free_mem(c);
        pthread_mutex_lock(&cs->mu);
        p = &cs->list;
      }
    } else {
      p = &c->next;
    }
  }
  pthread_mutex_unlock(&cs->mu);
}

/* ------------------------------------------------------------- messages */

typedef struct {
  char text[160];
} who_t;

/* "allreduce over ranks [0,1]" / "send to rank 3" */
static void describe(who_t *w, const char *what, comm_kind_t kind, const dp_group_t *g) {
  size_t at = 0, cap = sizeof w->text;
  if (kind == COMM_SEND || kind == COMM_RECV) {
    snprintf(w->text, cap, "%s %s rank %u", what, kind == COMM_SEND ? "to" : "from", g->ranks[0]);
    return;
  }
  at += (size_t)snprintf(w->text, cap, "%s over ranks [", what);
  for (size_t i = 0; i < g->n && at < cap; i++) {
    if (at + 16 >= cap) {
      at += (size_t)snprintf(w->text + at, cap - at, "...");
      break;
    }
    at += (size_t)snprintf(w->text + at, cap - at, i ? ",%u" : "%u", g->ranks[i]);
  }
  if (at < cap) snprintf(w->text + at, cap - at, "]");
}

static void seconds(char *buf, size_t len, int ms) {
  if (ms % 1000 == 0) snprintf(buf, len, "%d s", ms / 1000);
  else snprintf(buf, len, "%.1f s", ms / 1000.0);
}

/* "<who>: NCCL failed <doing>: <error string>: <last error><tail>" */
static int nccl_error(const who_t *w, ncclComm_t nc, ncclResult_t r, const char *doing,
                      const char *tail, meshd_error_t *e) {
  const char *last = ncclGetLastError(nc);
  bool has_last = last && *last;
  return error_set(e, ERR_REMOTE_FAILURE, "%s: NCCL failed%s%s: %s%s%s%s", w->text,
                   doing ? " " : "", doing ? doing : "", ncclGetErrorString(r),
                   has_last ? ": " : "", has_last ? last : "", tail ? tail : "");
}

/* --------------------------------------------------- making a communicator */

typedef struct {
  uint64_t magic, comm_id, key;
  ncclUniqueId id;
} boot_msg_t;

/* The secret c's bootstrap link with member i proves: their pair's, or the group's. */
static const uint8_t *boot_secret(const comm_t *c, size_t i) {
  return c->pairs ? c->pairs + i * DP_SECRET_LEN : c->secret;
}

/* Member 0 makes the id and hands it out; the others take it from member 0. */
static int bootstrap(backend_t *b, comm_t *c, const who_t *w, ncclUniqueId *id, meshd_error_t *e) {
  boot_msg_t m;
  memset(&m, 0, sizeof m);
  uint64_t chan = c->comm_id;
  meshd_error_t de = {0};
  if (c->me == 0) {
    ncclResult_t r = ncclGetUniqueId(&m.id);
    if (r != ncclSuccess) return nccl_error(w, NULL, r, "making a unique id", NULL, e);
    m.magic = BOOT_MAGIC;
    m.comm_id = c->comm_id;
    m.key = c->key;
    if (c->kind == COMM_SEND) {
      if (dp_send(b->net, chan, c->call, c->secret, c->ranks[0], c->addrs[0], &m, sizeof m, &de))
        return error_set(e, ERR_REMOTE_FAILURE, "%s: sending the NCCL id failed: %s", w->text,
                         de.msg);
    } else {
      /* Every member gets the id, even past one that failed (a member that
       * refused the call answers with its abort): the others then learn of
       * the failure while they set up (init_comm watches), not at the timeout
       * of a handout that never came. */
      int rc = 0;
      for (size_t i = 1; i < c->n; i++)
        if (dp_send(b->net, chan, c->call, boot_secret(c, i), c->ranks[i], c->addrs[i], &m,
                    sizeof m, &de) &&
            rc == 0)
          rc = error_set(e, ERR_REMOTE_FAILURE, "%s: sending the NCCL id to rank %u failed: %s",
                         w->text, c->ranks[i], de.msg);
      if (rc) return rc;
    }
  } else {
    if (dp_recv(b->net, chan, c->call, boot_secret(c, 0), c->ranks[0], c->addrs[0], &m, sizeof m,
                &de))
      return error_set(e, ERR_REMOTE_FAILURE,
                       "%s: receiving the NCCL id from rank %u failed: %s", w->text, c->ranks[0],
                       de.msg);
    if (m.magic != BOOT_MAGIC || m.comm_id != c->comm_id || m.key != c->key)
      return error_set(e, ERR_REMOTE_FAILURE,
                       "%s: rank %u sent an NCCL id for another communicator (the members "
                       "disagree on the group or its addresses)",
                       w->text, c->ranks[0]);
  }
  *id = m.id;
  return 0;
}

/* Non-blocking init, polled up to the deadline; aborted on failure. 0 when
 * made; 1 when NCCL reported an error; -1 past the deadline. */
static int init_comm(cuda_state_t *st, comm_t *c, const who_t *w, ncclUniqueId id, int nranks,
                     int rank, int64_t deadline, dataplane_t *net, dp_watch_t *watch,
                     meshd_error_t *e) {
  char why[600]; /* a peer's refusal: its rank and reason */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  int ms = timeout_ms_of(st);
  ncclComm_t nc = NULL;
  ncclResult_t r = ncclCommInitRankConfig(&nc, nranks, id, rank, &cfg);
  long ns = POLL_MIN_NS;
  while (r == ncclInProgress && nc) {
    if (now_ns() >= deadline) {
      char s[32];
      seconds(s, sizeof s, ms);
      ncclCommAbort(nc);
      error_set(e, ERR_REMOTE_FAILURE,
                "%s: setting up the NCCL communicator took longer than %s (a peer did not "
                "join); it was aborted",
                w->text, s);
      return -1;
    }
    if (dp_watch_fired(net, watch, why, sizeof why)) {
      ncclCommAbort(nc);
      return error_set(e, ERR_REMOTE_FAILURE,
                       "%s: %s; setting up the NCCL communicator was aborted", w->text, why);
    }
    if (atomic_load(&c->lost)) { /* cuda_peer_lost: the member will never join */
      ncclCommAbort(nc);
      return error_set(e, ERR_AGENT_LOST, "%s: %s; setting up the NCCL communicator was aborted",
                       w->text, c->lost_why);
    }
    nap(&ns);
    ncclResult_t a = ncclSuccess;
    r = ncclCommGetAsyncError(nc, &a);
    if (r == ncclSuccess) r = a;
  }
  if (r != ncclSuccess) {
    nccl_error(w, nc, r, "setting up the communicator", NULL, e);
    if (nc) ncclCommAbort(nc);
    return 1;
  }
  c->nc = nc;
  return 0;
}

static comm_t *comm_new(comm_kind_t kind, uint64_t session, const dp_group_t *g, int device) {
  comm_t *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  pthread_mutex_init(&c->busy, NULL);
  c->kind = kind;
  c->session = session;
  c->comm_id = g->comm_id;
  c->call = g->call;
  c->n = g->n;
  c->me = g->me;
  c->device = device;
  if (g->secret) memcpy(c->secret, g->secret, DP_SECRET_LEN);
  if (g->pair_secrets && !(c->pairs = malloc(g->n * DP_SECRET_LEN))) goto fail;
  if (c->pairs) memcpy(c->pairs, g->pair_secrets, g->n * DP_SECRET_LEN);
  c->ranks = malloc(g->n * sizeof *c->ranks);
  c->addrs = calloc(g->n, sizeof *c->addrs);
  if (!c->ranks || !c->addrs) goto fail;
  for (size_t i = 0; i < g->n; i++) {
    c->ranks[i] = g->ranks[i];
    if (!(c->addrs[i] = strdup(g->addrs[i]))) goto fail;
  }
  c->key = key_of(kind, g);
  return c;
fail:
  comm_free_mem(c);
  return NULL;
}

/* Takes c off cs->setup when it is there. Holds cs->mu. */
static void setup_remove_locked(cuda_comms_t *cs, comm_t *c) {
  for (comm_t **p = &cs->setup; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      c->next = NULL;
      return;
    }
}

/* The cached communicator for the key, made (bootstrap + init) when missing.
 * Returns it with a reference for the caller, or NULL with e. */
/* The cached communicator of (kind, session, g), with a reference for the
 * caller (comm_put); NULL when none. */
static comm_t *comm_find(cuda_comms_t *cs, comm_kind_t kind, uint64_t session, const dp_group_t *g) {
  comm_t *found = NULL;
  pthread_mutex_lock(&cs->mu);
  for (comm_t *c = cs->list; c && !found; c = c->next)
    if (same_key(c, kind, session, g)) found = c;
  if (found) found->refs++;
  pthread_mutex_unlock(&cs->mu);
  return found;
}

static comm_t *comm_get(backend_t *b, comm_kind_t kind, uint64_t session, const dp_group_t *g,
                        const who_t *w, dp_watch_t *watch, meshd_error_t *e) {
  cuda_state_t *st = cuda_state(b);
  cuda_comms_t *cs = st->comms;
  if (!cs) {
    error_set(e, ERR_REMOTE_FAILURE, "%s: the backend has no communicator cache", w->text);
    return NULL;
  }
  comm_t *cached = comm_find(cs, kind, session, g);
  if (cached) return cached;

  if (!b->net) {
    no_net(w->text, e);
    return NULL;
  }
  comm_t *c = comm_new(kind, session, g, st->device);
  if (!c) {
    error_set(e, ERR_QUOTA, "%s: out of host memory", w->text);
    return NULL;
  }
  /* Point to point: the sender is NCCL rank 0, the receiver rank 1. */
  int nranks = kind == COMM_GROUP ? (int)g->n : 2;
  int rank = kind == COMM_GROUP ? (int)g->me : kind == COMM_SEND ? 0 : 1;
  ncclUniqueId id;
  int64_t deadline = now_ns() + (int64_t)timeout_ms_of(st) * 1000000;
  pthread_mutex_lock(&cs->mu);
  c->next = cs->setup;
  cs->setup = c;
  pthread_mutex_unlock(&cs->mu);
  if (cuda_check(st, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
                 "creating a communicator stream", e) ||
      cuda_check(st, cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming),
                 "creating a communicator event", e) ||
      cuda_check(st, cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming),
                 "creating a communicator event", e))
    goto fail;
  /* One id per call: an id of a round a member missed (it failed before
   * calling) is an older call's, which the data plane skips, so the id it
   * gets is this round's, and a failed init fails the call. */
  if (bootstrap(b, c, w, &id, e) ||
      init_comm(st, c, w, id, nranks, rank, deadline, b->net, watch, e))
    goto fail;
  pthread_mutex_lock(&cs->mu);
  setup_remove_locked(cs, c);
  bool lost = atomic_load(&c->lost); /* declared lost as init completed */
  if (!lost) {
    c->refs = 2; /* the cache's and the caller's */
    c->linked = true;
    c->next = cs->list;
    cs->list = c;
  }
  pthread_mutex_unlock(&cs->mu);
  if (!lost) return c;
  error_set(e, ERR_AGENT_LOST, "%s: %s; setting up the NCCL communicator was aborted", w->text,
            c->lost_why);
fail:
  pthread_mutex_lock(&cs->mu);
  setup_remove_locked(cs, c);
  pthread_mutex_unlock(&cs->mu);
  comm_teardown(c);
  comm_free_mem(c);
  return NULL;
}

/* ---------------------------------------------------- running an operation */

/* A NCCL call's result on a non-blocking communicator: ncclInProgress means
 * "still being enqueued"; poll until it settles. */
static ncclResult_t settle(comm_t *c, ncclResult_t r, int64_t deadline, bool *late) {
  ncclComm_t nc = c->nc;
  long ns = POLL_MIN_NS;
  while (r == ncclInProgress) {
    if (now_ns() >= deadline || atomic_load(&c->lost)) {
      *late = true;
      return r;
    }
    nap(&ns);
    ncclResult_t a = ncclSuccess;
    r = ncclCommGetAsyncError(nc, &a);
    if (r == ncclSuccess) r = a;
  }
  return r;
}

/* The communicator failed: abort it (stopping its kernels) and drop it. */
static int comm_fail(cuda_state_t *st, comm_t *c, const who_t *w, ncclResult_t r, bool late,
                     meshd_error_t *e) {
  if (atomic_load(&c->lost)) {
    error_set(e, ERR_AGENT_LOST, "%s: %s; the communicator was aborted", w->text, c->lost_why);
  } else if (late) {
    char s[32];
    seconds(s, sizeof s, timeout_ms_of(st));
    error_set(e, ERR_REMOTE_FAILURE,
              "%s: a peer did not take part within %s; the communicator was aborted", w->text, s);
  } else if (r != ncclSuccess) {
    nccl_error(w, c->nc, r, NULL, "; the communicator was aborted", e);
  }
  ncclCommAbort(c->nc);
  c->nc = NULL;
  comm_unlink(st->comms, c);
  return -1;
}

/* A peer refused the call (dp_refuse: it failed before it joined): the
 * same, with its reason. */
static int comm_refused(cuda_state_t *st, comm_t *c, const who_t *w, const char *why,
                        meshd_error_t *e) {
  error_set(e, ERR_REMOTE_FAILURE, "%s: %s; the communicator was aborted", w->text, why);
  ncclCommAbort(c->nc);
  c->nc = NULL;
  comm_unlink(st->comms, c);
  return -1;
}

typedef enum {
  OP_ALLREDUCE,
  OP_REDUCE_SCATTER,
  OP_ALLGATHER,
  OP_ALLTOALL,
  OP_REDUCE, /* rooted */
  OP_GATHER, /* rooted */
  OP_BROADCAST,
  OP_SEND,
  OP_RECV
} op_kind_t;

typedef struct {
  op_kind_t kind;
  const char *what;
  const void *in;  /* device pointers (staged if the caller gave host memory) */
  void *out;
  size_t count;    /* elements per member slice (p2p: bytes) */
  size_t esz;
  size_t n;        /* members */
  dtype_t dtype;
  reduction_t op;
  cuda_nccl_plan_t plan;
  void *gather;    /* n * count elements of scratch, for CUDA_PLAN_GATHER (rooted: the root's) */
  size_t root;     /* rooted ops and broadcast: the member that receives (sends) */
} job_t;

/* Every member's `bytes` of in to the root, which receives member i's at
 * out + i * bytes (its own through a send to itself, as alltoall does). */
static ncclResult_t send_to_root(const job_t *j, comm_t *c, const void *in, char *out,
                                 size_t bytes) {
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) r = ncclSend(in, bytes, ncclUint8, (int)j->root, c->nc, c->stream);
  for (size_t i = 0; c->me == j->root && i < j->n && r == ncclSuccess; i++)
    r = ncclRecv(out + i * bytes, bytes, ncclUint8, (int)i, c->nc, c->stream);
  ncclResult_t end = ncclGroupEnd(); /* always close the group */
  return r == ncclSuccess ? end : r;
}

/* Enqueues the job's NCCL work on c->stream. */
static ncclResult_t enqueue(const job_t *j, comm_t *c, int64_t deadline, bool *late) {
  size_t bytes = j->count * j->esz;
  const char *in = j->in;
  char *out = j->out;
  ncclResult_t r = ncclSuccess;
  switch (j->kind) {
  case OP_ALLREDUCE:
    if (j->plan.kind == CUDA_PLAN_NATIVE)
      r = ncclAllReduce(in, out, j->count, (ncclDataType_t)j->plan.nccl_dtype,
                        (ncclRedOp_t)j->plan.nccl_op, c->nc, c->stream);
    else
      r = ncclAllGather(in, j->gather, bytes, ncclUint8, c->nc, c->stream);
    break;
  case OP_REDUCE_SCATTER:
    if (j->plan.kind == CUDA_PLAN_NATIVE) {
      r = ncclReduceScatter(in, out, j->count, (ncclDataType_t)j->plan.nccl_dtype,
                            (ncclRedOp_t)j->plan.nccl_op, c->nc, c->stream);
      break;
    }
    out = j->gather; /* every member's slice `me`, then reduced locally */
    /* fallthrough */
  case OP_ALLTOALL:
    r = ncclGroupStart();
    for (size_t i = 0; i < j->n && r == ncclSuccess; i++) {
      r = ncclSend(in + i * bytes, bytes, ncclUint8, (int)i, c->nc, c->stream);
      if (r == ncclSuccess) r = ncclRecv(out + i * bytes, bytes, ncclUint8, (int)i, c->nc, c->stream);
    }
    {
      ncclResult_t end = ncclGroupEnd(); /* always close the group */
      if (r == ncclSuccess) r = end;
    }
    break;
  case OP_ALLGATHER:
    r = ncclAllGather(in, out, bytes, ncclUint8, c->nc, c->stream);
    break;
  /* Rooted: a member that receives nothing has out NULL (or, broadcasting,
   * in NULL); NCCL ignores that side there, so it gets the other pointer. */
  case OP_REDUCE:
    if (j->plan.kind == CUDA_PLAN_NATIVE)
      r = ncclReduce(in, out ? out : (void *)in, j->count, (ncclDataType_t)j->plan.nccl_dtype,
                     (ncclRedOp_t)j->plan.nccl_op, (int)j->root, c->nc, c->stream);
    else
      r = send_to_root(j, c, in, j->gather, bytes);
    break;
  case OP_GATHER:
    r = send_to_root(j, c, in, out, bytes);
    break;
  case OP_BROADCAST:
    r = ncclBroadcast(in ? in : out, out ? out : (void *)in, bytes, ncclUint8, (int)j->root, c->nc,
                      c->stream);
    break;
  case OP_SEND:
    r = ncclSend(in, bytes, ncclUint8, 1, c->nc, c->stream);
    break;
  case OP_RECV:
    r = ncclRecv(out, bytes, ncclUint8, 0, c->nc, c->stream);
    break;
  }
  return settle(c, r, deadline, late);
}

/* Waits for c->done, watching for NCCL errors. The deadline runs from when
 * this side's earlier work on the caller's stream (c->ready) is done: only
 * the peers' absence may count against it. */
static int wait_done(cuda_state_t *st, comm_t *c, const who_t *w, dataplane_t *net,
                     dp_watch_t *watch, meshd_error_t *e) {
  long ns = POLL_MIN_NS;
  int64_t deadline = INT64_MAX;
  char why[600]; /* a peer's abort: its rank and reason */
  for (;;) {
    if (deadline == INT64_MAX && cudaEventQuery(c->ready) == cudaSuccess)
      deadline = now_ns() + (int64_t)timeout_ms_of(st) * 1000000;
    cudaError_t q = cudaEventQuery(c->done);
    if (q == cudaSuccess) return 0;
    if (q != cudaErrorNotReady) {
      cuda_check(st, q, w->text, e);
      ncclCommAbort(c->nc);
      c->nc = NULL;
      comm_unlink(st->comms, c);
      return -1;
    }
    ncclResult_t a = ncclSuccess, r = ncclCommGetAsyncError(c->nc, &a);
    if (r == ncclSuccess) r = a;
    if (r != ncclSuccess && r != ncclInProgress) return comm_fail(st, c, w, r, false, e);
    if (now_ns() >= deadline || atomic_load(&c->lost)) return comm_fail(st, c, w, ncclSuccess, true, e);
    if (dp_watch_fired(net, watch, why, sizeof why)) return comm_refused(st, c, w, why, e);
    nap(&ns);
  }
}

/* Whether the communicator's stream has drained, given a second after an
 * abort (which tells NCCL's kernels to stop). */
static bool quiesced(comm_t *c) {
  long ns = POLL_MIN_NS;
  int64_t until = now_ns() + 1000000000;
  for (;;) {
    cudaError_t q = cudaStreamQuery(c->stream);
    if (q != cudaErrorNotReady) {
      if (q != cudaSuccess) cudaGetLastError();
      return q == cudaSuccess;
    }
    if (now_ns() >= until) return false;
    nap(&ns);
  }
}

static bool is_host(const void *p) {
  struct cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError(); /* not sticky: clear it */
    return true;
  }
  return a.type == cudaMemoryTypeUnregistered || a.type == cudaMemoryTypeHost;
}

/* The real-device path of every slot. in_bytes / out_bytes are the sizes of
 * the caller's buffers (in == out for allreduce). */
static int run_real(backend_t *b, backend_stream_t *s, comm_kind_t ck, uint64_t session,
                    const dp_group_t *g, job_t *j, size_t in_bytes, size_t out_bytes,
                    meshd_error_t *e) {
  cuda_state_t *st = cuda_state(b);
  backend_stream_t *bs = cuda_stream_of(b, s);
  who_t w;
  describe(&w, j->what, ck, g);
  if (cuda_check(st, cudaSetDevice(st->device), w.text, e)) return -1;
  /* A peer that refuses the call (it failed before joining) says so on the
   * data plane, which the waits below watch meanwhile (and which admits its
   * notice then, so that it does not wait for us either). */
  dp_watch_t *watch = dp_watch_begin(b->net, g);
  comm_t *c = comm_get(b, ck, session, g, &w, watch, e);
  if (!c) {
    dp_watch_end(b->net, watch);
    return -1;
  }
  pthread_mutex_lock(&c->busy);
  int rc = -1;
  const void *user_in = j->in;
  void *user_out = j->out, *din = NULL, *dout = NULL;
  bool inplace = j->kind == OP_ALLREDUCE || j->kind == OP_REDUCE;
  bool gathers = j->plan.kind == CUDA_PLAN_GATHER && (j->kind != OP_REDUCE || g->me == j->root);
  size_t gather_bytes = gathers ? j->n * j->count * j->esz : 0;
  bool late = false, enqueued = false, completed = false;
  ncclResult_t r;
  if (!c->nc) { /* aborted by a concurrent failure before we got the lock */
    error_set(e, ERR_REMOTE_FAILURE, "%s: the communicator was aborted", w.text);
    goto out;
  }
  /* Host buffers (run.c stages tensors through host memory) travel through
   * device scratch. */
  if (in_bytes && user_in && is_host(user_in)) {
    if (!(din = cuda_scratch_alloc(b, bs, in_bytes))) goto oom;
    if (cuda_check(st, cudaMemcpyAsync(din, user_in, in_bytes, cudaMemcpyHostToDevice, bs->s),
                   w.text, e))
      goto out;
    j->in = din;
  }
  if (out_bytes && user_out && is_host(user_out)) {
    if (inplace && din) dout = din;
    else if (!(dout = cuda_scratch_alloc(b, bs, out_bytes))) goto oom;
    j->out = dout;
  }
  if (gather_bytes && !(j->gather = cuda_scratch_alloc(b, bs, gather_bytes))) goto oom;

  if (cuda_check(st, cudaEventRecord(c->ready, bs->s), w.text, e) ||
      cuda_check(st, cudaStreamWaitEvent(c->stream, c->ready, 0), w.text, e))
    goto out;
  enqueued = true;
  r = enqueue(j, c, now_ns() + (int64_t)timeout_ms_of(st) * 1000000, &late);
  if (r != ncclSuccess || late) {
    comm_fail(st, c, &w, r, late, e);
    goto out;
  }
  if (cuda_check(st, cudaEventRecord(c->done, c->stream), w.text, e)) goto out;
  if (wait_done(st, c, &w, b->net, watch, e)) goto out;
  completed = true;
  if (j->gather) {
    size_t slices = j->n;
    if (cuda_reduce_slices(b, bs, j->gather, j->out, slices, j->count, j->dtype, j->op, e)) {
      error_prefix(e, w.text, ": ");
      goto out;
    }
  }
  if (dout) {
    if (cuda_check(st, cudaMemcpyAsync(user_out, dout, out_bytes, cudaMemcpyDeviceToHost, bs->s),
                   w.text, e) ||
        cuda_check(st, cudaStreamSynchronize(bs->s), w.text, e))
      goto out;
  }
  rc = 0;
  goto out;
oom:
  error_set(e, ERR_QUOTA, "%s: out of device memory for staging buffers", w.text);
out:
  if (rc && !completed && c->nc) {
    /* The peers will give up on this round and drop their communicators:
     * drop ours too, so that the next call rebuilds it with them. */
    ncclCommAbort(c->nc);
    c->nc = NULL;
    comm_unlink(st->comms, c);
  }
  if (enqueued && !completed && !quiesced(c)) {
    /* An aborted kernel may still touch the scratch: keep it rather than
     * let the pool hand it out again. The caller's buffers are the caller's
     * to free: order its stream (which every free waits for) after the
     * communicator's, and take the device as lost, since work that an abort
     * does not stop leaves nothing on it to trust. */
    log_warn("cuda", "%s: the aborted NCCL work has not stopped; keeping %zu bytes of scratch",
             w.text, gather_bytes + (dout && dout != din ? out_bytes : 0) + (din ? in_bytes : 0));
    j->gather = din = dout = NULL;
    if (cudaEventRecord(c->done, c->stream) == cudaSuccess)
      (void)cudaStreamWaitEvent(bs->s, c->done, 0);
    char why[sizeof w.text + 64];
    snprintf(why, sizeof why, "%s: the aborted NCCL work did not stop within 1 s", w.text);
    cuda_mark_lost(st, why);
  }
  dp_watch_end(b->net, watch);
  pthread_mutex_unlock(&c->busy);
  if (j->gather) cuda_scratch_free(b, bs, j->gather, gather_bytes);
  if (dout && dout != din) cuda_scratch_free(b, bs, dout, out_bytes);
  if (din) cuda_scratch_free(b, bs, din, in_bytes);
  j->gather = NULL;
  comm_put(st->comms, c);
  return rc;
}

/* ------------------------------------------------------------------ slots */

static bool emulated(backend_t *b) { return cuda_state(b)->emulated; }

/* A one-member group: the local identity of each collective, in s's order. */
static int local_copy(backend_t *b, backend_stream_t *s, void *out, const void *in, size_t bytes,
                      meshd_error_t *e) {
  if (!bytes || out == in) return 0;
  return cuda_memcpy(b, cuda_stream_of(b, s), out, in, bytes, e);
}

int cuda_allreduce(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf, size_t count,
                   dtype_t dtype, reduction_t op, meshd_error_t *err) {
  const char *what = "allreduce";
  if (emulated(b)) return b->net ? dp_allreduce(b->net, g, buf, count, dtype, op, err) : no_net(what, err);
  cuda_nccl_plan_t plan = cuda_nccl_plan(dtype, op);
  if (plan.kind == CUDA_PLAN_INVALID) return plan_error(what, dtype, op, err);
  if (check_group(what, g, err)) return -1;
  if (count == 0 || g->n == 1) return 0; /* avg over one member is the identity */
  size_t esz = dtype_size(dtype);
  job_t j = {OP_ALLREDUCE, what, buf, buf, count, esz, g->n, dtype, op, plan, NULL, 0};
  return run_real(b, s, COMM_GROUP, g->session, g, &j, count * esz, count * esz, err);
}

int cuda_reduce_scatter(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                        void *out, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err) {
  const char *what = "reduce_scatter";
  if (emulated(b))
    return b->net ? dp_reduce_scatter(b->net, g, in, out, count, dtype, op, err) : no_net(what, err);
  cuda_nccl_plan_t plan = cuda_nccl_plan(dtype, op);
  if (plan.kind == CUDA_PLAN_INVALID) return plan_error(what, dtype, op, err);
  if (check_group(what, g, err)) return -1;
  size_t esz = dtype_size(dtype);
  if (count == 0) return 0;
  if (g->n == 1) return local_copy(b, s, out, in, count * esz, err);
  job_t j = {OP_REDUCE_SCATTER, what, in, out, count, esz, g->n, dtype, op, plan, NULL, 0};
  return run_real(b, s, COMM_GROUP, g->session, g, &j, g->n * count * esz, count * esz, err);
}

int cuda_allgather(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in, void *out,
                   size_t count, dtype_t dtype, meshd_error_t *err) {
  const char *what = "allgather";
  if (emulated(b)) return b->net ? dp_allgather(b->net, g, in, out, count, dtype, err) : no_net(what, err);
  if (!dtype_valid(dtype)) return plan_error(what, dtype, RED_SUM, err);
  if (check_group(what, g, err)) return -1;
  size_t esz = dtype_size(dtype);
  if (count == 0) return 0;
  if (g->n == 1) return local_copy(b, s, out, in, count * esz, err);
  cuda_nccl_plan_t bytes_only = {CUDA_PLAN_NATIVE, ncclUint8, -1};
  job_t j = {OP_ALLGATHER, what, in, out, count, esz, g->n, dtype, RED_SUM, bytes_only, NULL, 0};
  return run_real(b, s, COMM_GROUP, g->session, g, &j, count * esz, g->n * count * esz, err);
}

int cuda_alltoall(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in, void *out,
                  size_t count, dtype_t dtype, meshd_error_t *err) {
  const char *what = "alltoall";
  if (emulated(b)) return b->net ? dp_alltoall(b->net, g, in, out, count, dtype, err) : no_net(what, err);
  if (!dtype_valid(dtype)) return plan_error(what, dtype, RED_SUM, err);
  if (check_group(what, g, err)) return -1;
  size_t esz = dtype_size(dtype);
  if (count == 0) return 0;
  if (g->n == 1) return local_copy(b, s, out, in, count * esz, err);
  cuda_nccl_plan_t bytes_only = {CUDA_PLAN_NATIVE, ncclUint8, -1};
  job_t j = {OP_ALLTOALL, what, in, out, count, esz, g->n, dtype, RED_SUM, bytes_only, NULL, 0};
  return run_real(b, s, COMM_GROUP, g->session, g, &j, g->n * count * esz, g->n * count * esz, err);
}

static int bad_root(const char *what, size_t root, const dp_group_t *g, meshd_error_t *e) {
  return error_set(e, ERR_BAD_ARGUMENT, "%s: root %zu is not a member of a group of %zu", what, root,
                   g->n);
}

int cuda_reduce_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                     void *buf, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err) {
  if (emulated(b))
    return b->net ? dp_reduce_root(b->net, g, root, buf, count, dtype, op, err)
                  : no_net("reduce", err);
  cuda_nccl_plan_t plan = cuda_nccl_plan(dtype, op);
  if (plan.kind == CUDA_PLAN_INVALID) return plan_error("reduce", dtype, op, err);
  if (check_group("reduce", g, err)) return -1;
  if (root >= g->n) return bad_root("reduce", root, g, err);
  if (count == 0 || g->n == 1) return 0;
  char what[40];
  snprintf(what, sizeof what, "reduce to rank %u", g->ranks[root]);
  bool at_root = g->me == root; /* the others' buf only sends */
  size_t esz = dtype_size(dtype);
  job_t j = {OP_REDUCE, what, buf, at_root ? buf : NULL, count, esz, g->n, dtype, op, plan, NULL,
             root};
  return run_real(b, s, COMM_GROUP, g->session, g, &j, count * esz, at_root ? count * esz : 0, err);
}

int cuda_gather_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                     const void *in, void *out, size_t count, dtype_t dtype, meshd_error_t *err) {
  if (emulated(b))
    return b->net ? dp_gather_root(b->net, g, root, in, out, count, dtype, err)
                  : no_net("gather", err);
  if (!dtype_valid(dtype)) return plan_error("gather", dtype, RED_SUM, err);
  if (check_group("gather", g, err)) return -1;
  if (root >= g->n) return bad_root("gather", root, g, err);
  size_t esz = dtype_size(dtype);
  if (count == 0) return 0;
  if (g->n == 1) return local_copy(b, s, out, in, count * esz, err);
  char what[40];
  snprintf(what, sizeof what, "gather to rank %u", g->ranks[root]);
  bool at_root = g->me == root;
  cuda_nccl_plan_t bytes_only = {CUDA_PLAN_NATIVE, ncclUint8, -1};
  job_t j = {OP_GATHER, what, in, at_root ? out : NULL, count, esz, g->n, dtype, RED_SUM,
             bytes_only, NULL, root};
  return run_real(b, s, COMM_GROUP, g->session, g, &j, count * esz,
                  at_root ? g->n * count * esz : 0, err);
}

int cuda_broadcast(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf, size_t bytes,
                   meshd_error_t *err) {
  const char *what = "broadcast";
  if (emulated(b)) return b->net ? dp_broadcast(b->net, g, buf, bytes, err) : no_net(what, err);
  if (check_group(what, g, err)) return -1;
  if (bytes == 0 || g->n == 1) return 0;
  if (!buf) return error_set(err, ERR_BAD_ARGUMENT, "%s: no buffer for %zu bytes", what, bytes);
  bool source = g->me == 0; /* sends from its buf; the others receive into theirs */
  cuda_nccl_plan_t bytes_only = {CUDA_PLAN_NATIVE, ncclUint8, -1};
  job_t j = {OP_BROADCAST, what, source ? buf : NULL, source ? NULL : buf, bytes, 1, g->n,
             DTYPE_UINT8, RED_SUM, bytes_only, NULL, 0};
  return run_real(b, s, COMM_GROUP, g->session, g, &j, source ? bytes : 0, source ? 0 : bytes, err);
}

void cuda_refuse(backend_t *b, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
                 const char *why) {
  cuda_state_t *st = cuda_state(b);
  if (!st->emulated && st->comms) {
    /* The peers drop their communicator when they give up on the call:
     * ours goes too, so that the next call rebuilds it with them. A send's
     * is keyed as p2p() keys it: the sender is member 0. */
    comm_kind_t kind = what == DP_REFUSE_GROUP ? COMM_GROUP
                       : what == DP_REFUSE_SEND ? COMM_SEND
                                                : COMM_RECV;
    dp_group_t key = *g;
    if (kind != COMM_GROUP) key.me = kind == COMM_SEND ? 0 : 1;
    cuda_comms_t *cs = st->comms;
    comm_t *found = comm_find(cs, kind, g->session, &key);
    if (found) {
      comm_unlink(cs, found);
      comm_put(cs, found);
    }
  }
  /* Its peers wait for it in NCCL (watching the data plane: wait_done), or
   * on the data plane itself (emulated, and the NCCL bootstrap). A recv's
   * sender in NCCL dials nobody: it is dialed, as a send's receiver is. */
  dp_refuse_t how = !st->emulated && what == DP_REFUSE_RECV ? DP_REFUSE_SEND : what;
  if (b->net) dp_refuse(b->net, g, how, calls, why, NULL);
}

static int p2p(backend_t *b, backend_stream_t *s, bool send, uint64_t session, uint64_t comm_id,
               uint64_t call, const uint8_t *secret, uint32_t peer, const char *addr, void *buf, size_t bytes,
               meshd_error_t *err) {
  const char *what = send ? "send" : "recv";
  if (!addr || (!buf && bytes > 0) || !secret)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "%s on comm %llu: needs a peer address, a buffer and the channel's secret "
                     "(missing: %s)",
                     what, (unsigned long long)comm_id,
                     !addr ? "address" : !secret ? "secret" : "buffer");
  if (bytes == 0) return 0; /* both ends know the size: nothing to match */
  /* The pair as a one-member group: the peer. */
  const char *addrs[1] = {addr};
  dp_group_t g = {.comm_id = comm_id, .call = call, .session = session, .ranks = &peer, .addrs = addrs,
                  .n = 1, .me = send ? 0 : 1, .secret = secret};
  /* me is only part of the key here; the communicator has two members. */
  job_t j = {send ? OP_SEND : OP_RECV, what, send ? buf : NULL, send ? NULL : buf, bytes, 1, 2,
             DTYPE_UINT8, RED_SUM, {CUDA_PLAN_NATIVE, ncclUint8, -1}, NULL, 0};
  return run_real(b, s, send ? COMM_SEND : COMM_RECV, session, &g, &j, send ? bytes : 0,
                  send ? 0 : bytes, err);
}

int cuda_send(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
              uint64_t call, const uint8_t *secret, uint32_t to_rank, const char *addr, const void *buf,
              size_t bytes, meshd_error_t *err) {
  if (emulated(b))
    return b->net ? dp_send(b->net, comm_id, call, secret, to_rank, addr, buf, bytes, err)
                  : no_net("send", err);
  return p2p(b, s, true, session, comm_id, call, secret, to_rank, addr, (void *)buf, bytes, err);
}

int cuda_recv(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
              uint64_t call, const uint8_t *secret, uint32_t from_rank, const char *addr, void *buf, size_t bytes,
              meshd_error_t *err) {
  if (emulated(b))
    return b->net ? dp_recv(b->net, comm_id, call, secret, from_rank, addr, buf, bytes, err)
                  : no_net("recv", err);
  return p2p(b, s, false, session, comm_id, call, secret, from_rank, addr, buf, bytes, err);
}
