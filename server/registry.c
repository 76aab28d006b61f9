#include "registry.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "agent_link.h"
#include "fault.h"
#include "grant.h"
#include "log.h"
#include "runtime.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "meshd/v1/agent_registry.pb-c.h"

/* One registration call. Owned by the call (freed in on_end); the dial-back
 * job and the open list hold call references, not conn pointers past on_end. */
typedef struct conn {
  struct conn *next;
  rpc_call_t *call;
  int rank;              /* -1 until admitted */
  char agent_id[64];
  char address[256];
  uint64_t registration; /* its agent_desc_t.registration once admitted */
  /* Under the registry's mu. dialed: the dial-back answered and the agent was
   * marked healthy, so from now on an unhealthy agent has lost its link.
   * ending: the registry asked the call to end (once). admitting: a dialer
   * admits it once the agent gone from its rank is removed (take_over). */
  bool dialed, ending, admitting;
  /* Under the registry's mu: a message came (REGISTRY_FIRST_MESSAGE_MS), and
   * when the call opened (CLOCK_MONOTONIC, ms). */
  bool heard;
  int64_t opened_ms;
  /* Its agent's removal, off the rpc loop (remove_agent): the conn goes with it. */
  struct registry *reg;
  const char *gone_why;
  int slow_ms; /* --server-fault remove:slow=MS: the removal waits that long first */
} conn_t;

/* A dialer's job: dial an admitted agent back, or first admit it (take_over:
 * its rank, or its agent id, is still held by an agent known gone). */
typedef struct job {
  struct job *next;
  rpc_call_t *call;      /* referenced */
  bool admit;            /* take_over first */
  int requested;         /* the RegisterRequest's rank, for admit */
  uint32_t rank;         /* once admitted */
  agent_desc_t d;        /* id, address, call secret, registration */
} job_t;

struct registry {
  agent_pool_t *pool;
  registry_opts_t o;
  char server_id[64];
  pthread_mutex_t mu;
  pthread_cond_t jobs_cv;  /* a job or stopping */
  pthread_cond_t stop_cv;  /* stopping (the sweeper's timed wait); CLOCK_MONOTONIC */
  conn_t *conns;
  job_t *jobs, *jobs_tail;
  bool stopping;
  pthread_t dialers[REGISTRY_DIALERS], sweeper;
  int ndialers;
  bool sweeper_started;
  int removals;             /* removal threads running (remove_agent) */
  conn_t *deferred;         /* removals waiting for the sweeper (remove_agent) */
  uint64_t removed;         /* removals done (remove_now), for take_over's wait */
  pthread_cond_t removed_cv; /* a removal done, or stopping (take_over's wait) */
  int takeovers;            /* registrations in take_over now */
  uint64_t registrations;   /* the last agent_desc_t.registration given */
  log_limit_t refusals;
  log_limit_t dial_failures; /* dial-backs that failed (the same bound, apart) */
};

/* A refusal after the guard: an open registry admits anyone to the call, so
 * these lines are bounded like the guard's (the same limit). */
static void reject(registry_t *r, rpc_call_t *call, grpc_status_code code, const char *msg) {
  int held = 0;
  if (log_allow(&r->refusals, 10, 10000, &held)) {
    char *peer = rpc_call_peer(call);
    if (held)
      log_warn("registry", "registration from %s refused: %s (and %d more refused in the last "
               "10 s, not logged)", peer ? peer : "?", msg, held);
    else
      log_warn("registry", "registration from %s refused: %s", peer ? peer : "?", msg);
    free(peer);
  }
  rpc_call_finish(call, code, NULL, "%s", msg);
}

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static bool is_hex(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f') ||
          (s[i] >= 'A' && s[i] <= 'F')))
      return false;
  return s[n] == '\0';
}

/* Who may register: runs before the call's first message is read. */
static grpc_status_code guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *msg,
                              size_t msglen) {
  registry_t *r = arg;
  const char *why = NULL;
  if (r->o.require_cluster_cert && !rpc_call_peer_verified(call))
    why = "no verified cluster certificate (this port wants mTLS: the agent's --cluster-ca, "
          "--cluster-cert and --cluster-key)";
  else if (r->o.require_cluster_cert && !rpc_call_peer_named(call, r->o.agent_tls.server_name))
    why = "the certificate, signed by the cluster CA, does not name the cluster (--cluster-name)";
  if (!why && r->o.join_tokens) {
    char tok[SECRET_TOKEN_MAX + 2]; /* a longer value stays longer once truncated */
    const char *v = rpc_call_metadata(call, SECRET_JOIN_MD, tok, sizeof tok);
    if (!v || !*v) why = "no join token (metadata " SECRET_JOIN_MD "; the agent's --join-token-file)";
    else if (!secret_file_check(r->o.join_tokens, v, strlen(v))) why = "wrong join token";
    memset(tok, 0, sizeof tok);
  }
  if (!why) {
    snprintf(id->name, sizeof id->name, "agent");
    /* Open registry: anyone. Until its first message the call counts against
     * --max-unauthenticated-requests like any stranger's request. */
    id->unauthenticated = !r->o.join_tokens && !r->o.require_cluster_cert;
    return GRPC_STATUS_OK;
  }
  int held = 0;
  if (log_allow(&r->refusals, 10, 10000, &held)) {
    char *peer = rpc_call_peer(call);
    if (held)
      log_warn("registry", "registration from %s refused: %s (and %d more refused in the last "
               "10 s, not logged)", peer ? peer : "?", why, held);
    else
      log_warn("registry", "registration from %s refused: %s", peer ? peer : "?", why);
    free(peer);
  }
  snprintf(msg, msglen, "registration refused: %s", why);
  return GRPC_STATUS_UNAUTHENTICATED;
}

/* An agent's self-description for ListAgents and GetInfo: truncated to fit,
 * anything but printable ASCII replaced by '?'. */
static void printable(char *dst, size_t len, const char *src) {
  size_t i = 0;
  for (; src && src[i] && i + 1 < len; i++)
    dst[i] = src[i] >= ' ' && src[i] <= '~' ? src[i] : '?';
  dst[i] = '\0';
}

/* Printable ASCII only: these names reach logs, ListAgents and operators'
 * terminals (an escape sequence would too). */
static bool all_printable(const char *s) {
  for (; *s; s++)
    if (*s < ' ' || *s > '~') return false;
  return true;
}

/* HOST:PORT as the server dials it back (and hands its host to the other
 * agents for the data plane): a name or IPv4 address of [A-Za-z0-9._-], or an
 * IPv6 one in brackets (a zone too), and a decimal port 1..65535. gRPC reads "x:..." as a
 * URI when x is one of its resolvers' schemes, so those names are refused as
 * hosts: a stranger's "unix:5" would have the server dial a local socket. */
static bool host_port(const char *a) {
  const char *colon = strrchr(a, ':');
  if (!colon || !colon[1] || strlen(colon + 1) > 5 ||
      strspn(colon + 1, "0123456789") != strlen(colon + 1))
    return false;
  long port = atol(colon + 1);
  if (port < 1 || port > 65535) return false;
  size_t n = (size_t)(colon - a);
  if (n == 0) return false;
  if (a[0] == '[') {
    if (n < 3 || a[n - 1] != ']') return false;
    for (size_t i = 1; i + 1 < n; i++) /* and a zone: [fe80::1%eth0] */
      if (!((a[i] >= 'a' && a[i] <= 'z') || (a[i] >= 'A' && a[i] <= 'Z') ||
            (a[i] >= '0' && a[i] <= '9') || a[i] == ':' || a[i] == '.' || a[i] == '%'))
        return false;
    return true;
  }
  for (size_t i = 0; i < n; i++)
    if (!((a[i] >= 'a' && a[i] <= 'z') || (a[i] >= 'A' && a[i] <= 'Z') ||
          (a[i] >= '0' && a[i] <= '9') || a[i] == '.' || a[i] == '-' || a[i] == '_'))
      return false;
  static const char *const schemes[] = {"dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock",
                                        "xds", "google-c2p", "google-c2p-experimental", "c2p"};
  for (size_t i = 0; i < sizeof schemes / sizeof *schemes; i++)
    if (strlen(schemes[i]) == n && !strncasecmp(a, schemes[i], n)) return false;
  return true;
}

/* The registration call behind `call`, if it is still open. Under r->mu. */
static conn_t *conn_of_locked(registry_t *r, rpc_call_t *call) {
  conn_t *c = r->conns;
  while (c && c->call != call) c = c->next;
  return c;
}

/* Adds the agent to the pool and its call's conn, under r->mu (so a call
 * that ended meanwhile never gets a slot: its on_end would not remove it).
 * Returns the rank, or -1 with err (the call ended: nothing added). A call
 * being admitted (take_over) stays so when this fails: it is registered
 * already for on_message (a second RegisterRequest on it is refused; one
 * admitted meanwhile took a second rank, which its call's end left behind). */
static int add_to_pool(registry_t *r, rpc_call_t *call, const agent_desc_t *d, int requested,
                       char *err, size_t errlen) {
  pthread_mutex_lock(&r->mu);
  conn_t *c = conn_of_locked(r, call);
  int rank = -1;
  if (!c) snprintf(err, errlen, "the registration call ended");
  else rank = agent_pool_add(r->pool, d, requested, err, errlen);
  if (rank >= 0) {
    c->rank = rank;
    c->registration = d->registration;
    snprintf(c->agent_id, sizeof c->agent_id, "%s", d->agent_id);
    snprintf(c->address, sizeof c->address, "%s", d->address);
    c->admitting = false;
  }
  pthread_mutex_unlock(&r->mu);
  return rank;
}

/* Logs the admission and answers RegisterAccepted. */
static void accept_agent(registry_t *r, rpc_call_t *call, const agent_desc_t *d, int rank) {
  char *peer = rpc_call_peer(call);
  log_event(LOG_LEVEL_INFO, "registry", &(log_fields_t){LOG_RANK(rank)},
            "agent %s at %s (%s, pid %u, from %s) registered as rank %d", d->agent_id,
            d->address, d->device, d->pid, peer ? peer : "?", rank);
  free(peer);
  Meshd__V1__RegisterAccepted acc = MESHD__V1__REGISTER_ACCEPTED__INIT;
  acc.rank = (uint32_t)rank;
  acc.server_id = r->server_id;
  Meshd__V1__ServerToAgent out = MESHD__V1__SERVER_TO_AGENT__INIT;
  out.msg_case = MESHD__V1__SERVER_TO_AGENT__MSG_ACCEPTED;
  out.accepted = &acc;
  rpc_call_send(call, &out.base);
}

/* Hands call's agent to the dialers: to dial back (admitted at rank) or,
 * with admit, to admit first (take_over). */
static void queue_job(registry_t *r, rpc_call_t *call, const agent_desc_t *d, int rank,
                      bool admit, int requested) {
  job_t *j = calloc(1, sizeof *j);
  if (!j) {
    reject(r, call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  j->call = call;
  j->admit = admit;
  j->requested = requested;
  j->rank = (uint32_t)rank;
  j->d = *d;
  rpc_call_ref(call);
  pthread_mutex_lock(&r->mu);
  if (r->jobs_tail) r->jobs_tail->next = j;
  else r->jobs = j;
  r->jobs_tail = j;
  pthread_cond_signal(&r->jobs_cv);
  pthread_mutex_unlock(&r->mu);
}

/* Ends the registration of c, whose agent lost its Execute link (so that it
 * registers again). Under r->mu. */
static void end_lost_locked(registry_t *r, conn_t *c) {
  c->ending = true;
  /* A server that stops ends its local agents' links itself: not a loss. */
  log_event(agent_links_stopping() ? LOG_LEVEL_INFO : LOG_LEVEL_WARN, "registry",
            &(log_fields_t){LOG_RANK(c->rank)},
            "agent rank %d (%s, %s) lost its Execute link (no keepalive answer "
            "within %.1f s, or the link broke): ending its registration so that it registers "
            "again", c->rank, c->address, c->agent_id, r->o.agent_timeout_ms / 1000.0);
  rpc_call_finish(c->call, GRPC_STATUS_UNAVAILABLE, NULL,
                  "the server lost its link to this agent (no keepalive answer within %.1f s, "
                  "or the Execute stream broke); register again",
                  r->o.agent_timeout_ms / 1000.0);
}

typedef enum { HOLDER_NONE, HOLDER_LIVE, HOLDER_GONE } holder_t;

/* Whether the agent in the way of registering d (agent_pool_holder) is gone:
 * its registration call ended (its removal runs, or has yet to), or it was
 * dialed back and has lost its link since (its call is ended here, as the
 * sweeper would at its next turn). A live agent's rank or id is never taken:
 * only the registry ends a registration, and it ends only these. */
static holder_t holder(registry_t *r, const agent_desc_t *d, int requested) {
  agent_pool_holder_t h;
  /* The pool is read under r->mu, as sweep() does: a conn seen dialed here was
   * healthy before this look, so unhealthy now means its link broke. */
  pthread_mutex_lock(&r->mu);
  holder_t v = HOLDER_NONE;
  if (agent_pool_holder(r->pool, d, requested, &h)) {
    conn_t *c = r->conns;
    while (c && !(c->rank == (int)h.rank && c->registration == h.registration)) c = c->next;
    if (h.leaving || !c || c->ending) v = HOLDER_GONE;
    else if (c->dialed && !h.healthy) {
      end_lost_locked(r, c);
      v = HOLDER_GONE;
    } else v = HOLDER_LIVE;
  }
  pthread_mutex_unlock(&r->mu);
  return v;
}

static void admit(registry_t *r, conn_t *c, const Meshd__V1__RegisterRequest *req) {
  if (!req->agent_id || !*req->agent_id || strlen(req->agent_id) >= sizeof c->agent_id)
    { reject(r, c->call, GRPC_STATUS_INVALID_ARGUMENT, "RegisterRequest.agent_id must be 1..63 characters"); return; }
  if (!req->address || !*req->address || strlen(req->address) >= sizeof c->address)
    { reject(r, c->call, GRPC_STATUS_INVALID_ARGUMENT,
                  "RegisterRequest.address must be the agent's host:port (1..255 characters)"); return; }
  if (!req->device || !*req->device || strlen(req->device) >= 32)
    { reject(r, c->call, GRPC_STATUS_INVALID_ARGUMENT,
                  "RegisterRequest.device must name the device, e.g. \"cpu\" or \"cuda:0\""); return; }
  if (!req->call_secret || strlen(req->call_secret) != SECRET_HEX_LEN ||
      !is_hex(req->call_secret, SECRET_HEX_LEN))
    { reject(r, c->call, GRPC_STATUS_INVALID_ARGUMENT,
             "RegisterRequest.call_secret must be 64 hex characters (an agent older than this "
             "server sends none: upgrade it)"); return; }
  if (!all_printable(req->agent_id) || !all_printable(req->address) ||
      !all_printable(req->device))
    { reject(r, c->call, GRPC_STATUS_INVALID_ARGUMENT,
             "RegisterRequest: agent_id, address and device must be printable ASCII"); return; }
  if (!host_port(req->address))
    { reject(r, c->call, GRPC_STATUS_INVALID_ARGUMENT,
             "RegisterRequest.address must be the agent's host:port (a host name or IPv4 "
             "address, or an IPv6 one in brackets, and a port 1..65535; no URI scheme), the "
             "address the server dials back (the agent's --advertise)"); return; }
  if (req->data_port > 65535) { /* 0: no data plane (the proto's "none yet") */
    char msg[160];
    snprintf(msg, sizeof msg, "RegisterRequest.data_port %u is not a port (1..65535, or 0 for "
             "no data plane)", req->data_port);
    { reject(r, c->call, GRPC_STATUS_INVALID_ARGUMENT, msg); return; }
  }
  if (req->requested_rank < -1 || req->requested_rank >= r->o.max_agents) {
    char msg[160];
    snprintf(msg, sizeof msg, "RegisterRequest.requested_rank %d is out of range [-1, %d] "
             "(the server's --max-agents is %d)", req->requested_rank, r->o.max_agents - 1,
             r->o.max_agents);
    { reject(r, c->call, GRPC_STATUS_INVALID_ARGUMENT, msg); return; }
  }
  if (req->requested_rank < 0 && agent_pool_size(r->pool) >= r->o.max_agents) {
    char msg[160];
    snprintf(msg, sizeof msg, "the pool is full: %d agents registered (the server's --max-agents)",
             r->o.max_agents);
    { reject(r, c->call, GRPC_STATUS_RESOURCE_EXHAUSTED, msg); return; }
  }
  agent_desc_t d = {0};
  snprintf(d.agent_id, sizeof d.agent_id, "%s", req->agent_id);
  snprintf(d.address, sizeof d.address, "%s", req->address);
  snprintf(d.device, sizeof d.device, "%s", req->device);
  d.memory_bytes = req->memory_bytes;
  d.data_port = req->data_port;
  d.pid = req->pid;
  printable(d.version, sizeof d.version, req->version);
  printable(d.commit, sizeof d.commit, req->commit);
  printable(d.build_type, sizeof d.build_type, req->build_type);
  d.cuda = req->cuda;
  d.instructions = req->instructions;
  d.data_plane = req->data_plane;
  memcpy(d.call_secret, req->call_secret, SECRET_HEX_LEN + 1);
  pthread_mutex_lock(&r->mu);
  d.registration = ++r->registrations;
  pthread_mutex_unlock(&r->mu);
  char err[256];
  int rank = add_to_pool(r, c->call, &d, req->requested_rank, err, sizeof err);
  if (rank >= 0) {
    accept_agent(r, c->call, &d, rank);
    queue_job(r, c->call, &d, rank, false, -1);
  } else if (holder(r, &d, req->requested_rank) != HOLDER_LIVE) {
    /* Its rank (or its id) is held by an agent already gone whose removal
     * has not run yet (an agent restarted at once, one that registers again
     * after its link broke), or was until just now: a dialer admits it once
     * the removal is done, rather than refusing it until then. Off the loop:
     * that waits. */
    pthread_mutex_lock(&r->mu);
    c->admitting = true;
    pthread_mutex_unlock(&r->mu);
    queue_job(r, c->call, &d, -1, true, req->requested_rank);
  } else {
    reject(r, c->call, GRPC_STATUS_FAILED_PRECONDITION, err);
  }
  memset(&d, 0, sizeof d);
}

static void on_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  registry_t *r = arg;
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory");
    return;
  }
  c->call = call;
  c->rank = -1;
  c->opened_ms = mono_ms();
  rpc_call_ref(call);
  pthread_mutex_lock(&r->mu);
  c->next = r->conns;
  r->conns = c;
  bool stopping = r->stopping;
  pthread_mutex_unlock(&r->mu);
  rpc_call_set_data(call, c);
  if (stopping) rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, NULL, "server shutting down");
}

static void on_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  registry_t *r = arg;
  conn_t *c = rpc_call_data(call);
  if (!c) return;
  pthread_mutex_lock(&r->mu);
  c->heard = true;
  /* A dialer may admit it (take_over): its rank is written under mu. */
  bool registered = c->rank >= 0 || c->admitting;
  pthread_mutex_unlock(&r->mu);
  if (!msg) { /* the agent said goodbye */
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "goodbye");
    return;
  }
  const Meshd__V1__AgentToServer *m = (const void *)msg;
  switch (m->msg_case) {
    case MESHD__V1__AGENT_TO_SERVER__MSG_HELLO:
      if (registered) {
        reject(r, call, GRPC_STATUS_INVALID_ARGUMENT, "RegisterRequest sent twice on one call");
        return;
      }
      admit(r, c, m->hello);
      return;
    case MESHD__V1__AGENT_TO_SERVER__MSG_STATUS:
      if (!registered) {
        reject(r, call, GRPC_STATUS_INVALID_ARGUMENT, "AgentStatus before RegisterRequest");
        return;
      }
      pthread_mutex_lock(&r->mu);
      int rank = c->rank;
      uint64_t registration = c->registration;
      pthread_mutex_unlock(&r->mu);
      if (rank >= 0) /* else still being admitted: its next status counts */
        agent_pool_set_allocated(r->pool, (uint32_t)rank, c->agent_id, registration,
                                 m->status->allocated_bytes);
      return;
    default:
      reject(r, call, GRPC_STATUS_INVALID_ARGUMENT,
             "the first message must be AgentToServer.hello (RegisterRequest)");
  }
}

/* Takes c's agent out of the pool and frees c; wakes the registrations that
 * wait for that (take_over). */
static void remove_now(conn_t *c) {
  registry_t *r = c->reg;
  if (c->slow_ms > 0) { /* --server-fault remove:slow=MS */
    struct timespec ts = {c->slow_ms / 1000, (long)(c->slow_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  agent_pool_remove(r->pool, (uint32_t)c->rank, c->agent_id, c->registration, c->gone_why);
  free(c);
  pthread_mutex_lock(&r->mu);
  r->removed++;
  pthread_cond_broadcast(&r->removed_cv);
  pthread_mutex_unlock(&r->mu);
}

static void *remover(void *arg) {
  conn_t *c = arg;
  registry_t *r = c->reg;
  remove_now(c);
  pthread_mutex_lock(&r->mu);
  if (--r->removals == 0) pthread_cond_broadcast(&r->removed_cv);
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

/* Takes the agent out of the pool, then frees c (taken out of r->conns). Its
 * link's writer is joined there, and the writer may wait for its call's end,
 * which only the rpc loop delivers: on a loop thread the removal runs on a
 * thread of its own (rpc.h), or, with no thread to be had, at the sweeper's
 * next turn; never on the loop. */
static void remove_agent(registry_t *r, conn_t *c, const char *why) {
  c->reg = r;
  c->gone_why = why;
  int ms = 0;
  fault_action_t fault = fault_hit(r->o.fault, "remove", -1, &ms);
  c->slow_ms = fault == FAULT_SLOW ? ms : 0;
  if (!rpc_on_loop_thread()) {
    remove_now(c);
    return;
  }
  pthread_mutex_lock(&r->mu);
  /* remove:fail: as if no thread could be had (tests of the sweeper's turn) */
  if (fault != FAULT_FAIL && runtime_spawn_detached("reg-remover", remover, c) == 0) {
    r->removals++;
  } else {
    c->next = r->deferred;
    r->deferred = c;
    log_error("registry", "rank %d: no thread to remove its agent now: the sweeper removes it",
              c->rank);
  }
  pthread_mutex_unlock(&r->mu);
}

/* The removals no thread could be started for, oldest last. */
static void remove_deferred(registry_t *r) {
  pthread_mutex_lock(&r->mu);
  conn_t *c = r->deferred;
  r->deferred = NULL;
  pthread_mutex_unlock(&r->mu);
  for (conn_t *next; c; c = next) {
    next = c->next;
    remove_now(c);
  }
}

static void on_end(rpc_call_t *call, bool cancelled, void *arg) {
  registry_t *r = arg;
  conn_t *c = rpc_call_data(call);
  if (!c) return;
  pthread_mutex_lock(&r->mu);
  for (conn_t **p = &r->conns; *p; p = &(*p)->next) {
    if (*p == c) {
      *p = c->next;
      break;
    }
  }
  pthread_mutex_unlock(&r->mu);
  if (c->rank >= 0)
    remove_agent(r, c, cancelled ? "registration call broken (agent gone)" : "registration ended");
  else
    free(c);
  rpc_call_unref(call);
}

/* Keeps the agent's clock offset for its grants (grant.h, Clocks); an offset
 * of a second or more is worth a line: its operator may want NTP looked at,
 * though direct transfers no longer depend on it. */
static void note_clock(registry_t *r, const job_t *j, int64_t agent_ms, int64_t recv_ms) {
  int64_t offset_ms = agent_pool_clock_sample(r->pool, j->rank, j->d.agent_id,
                                              j->d.registration, agent_ms, recv_ms);
  if (offset_ms >= 1000 || offset_ms <= -1000)
    log_info("registry", "agent rank %u (%s): its clock is %.1f s %s the server's; its transfer "
             "grants are written in its clock", j->rank, j->d.address,
             (double)(offset_ms < 0 ? -offset_ms : offset_ms) / 1000.0,
             offset_ms < 0 ? "behind" : "ahead of");
}

/* Dials an admitted agent back; marks it healthy if the right process answers. */
static void dial(registry_t *r, job_t *j) {
  if (rpc_call_ended(j->call)) return;
  /* Its own connection: the keepalive verdict is about this agent alone. */
  rpc_channel_opts_t opts = {.keepalive_ms = REGISTRY_PING_MS,
                             .keepalive_timeout_ms = r->o.agent_timeout_ms,
                             .own_connection = true,
                             /* TLS handshakes on a busy machine outlast the 100 ms default. */
                             .connect_timeout_ms = r->o.connect_timeout_ms > 0 ? r->o.connect_timeout_ms
                                                   : r->o.agent_tls.on       ? 2000
                                                                             : 0,
                             .tls = r->o.agent_tls};
  rpc_channel_t *ch = rpc_channel_create(j->d.address, &opts);
  Meshd__Agent__V1__HelloRequest req = MESHD__AGENT__V1__HELLO_REQUEST__INIT;
  req.agent_id = j->d.agent_id;
  req.rank = j->rank;
  req.server_id = r->server_id;
  ProtobufCMessage *resp = NULL;
  rpc_status_t st = {0};
  rpc_md_t md = {SECRET_AGENT_MD, j->d.call_secret};
  grpc_status_code code =
      ch ? rpc_unary(ch, "/meshd.agent.v1.Agent/Hello", &req.base,
                     &meshd__agent__v1__hello_reply__descriptor, &resp, &md, 1,
                     r->o.dial_timeout_ms, &st)
         : GRPC_STATUS_INTERNAL;
  if (!ch) snprintf(st.message, sizeof st.message, "cannot make a channel (cluster TLS files?)");
  else if (code == GRPC_STATUS_UNAUTHENTICATED)
    snprintf(st.message, sizeof st.message, "%s answered UNAUTHENTICATED: it is not the agent "
             "that registered (another agent's address?)", j->d.address);
  int64_t recv_ms = grant_now_unix_ms(); /* at once: the offset's error is what passes here */
  if (code == GRPC_STATUS_OK) {
    const Meshd__Agent__V1__HelloReply *rep = (const void *)resp;
    if (strcmp(rep->agent_id, j->d.agent_id) == 0) {
      /* Before the agent counts: its first grant is in its clock already. */
      note_clock(r, j, rep->unix_ms, recv_ms);
      /* This registration's slot only: its call may have ended since the
       * check above, and the agent registered again at the same rank with the
       * same id; that registration has a dial-back of its own, and this
       * channel, installed there, would replace its link (a loss). */
      agent_pool_set_channel(r->pool, j->rank, j->d.agent_id, j->d.registration, ch);
      agent_pool_set_healthy(r->pool, j->rank, j->d.agent_id, j->d.registration, true);
      protobuf_c_message_free_unpacked(resp, NULL);
      pthread_mutex_lock(&r->mu);
      conn_t *c = conn_of_locked(r, j->call);
      if (c) c->dialed = true;
      pthread_mutex_unlock(&r->mu);
      return;
    }
    snprintf(st.message, sizeof st.message, "%s answered as agent %s", j->d.address,
             rep->agent_id);
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  int held = 0; /* an open registry dials whatever address anyone registers: bounded */
  if (log_allow(&r->dial_failures, 10, 10000, &held)) {
    if (held)
      log_warn("registry", "cannot dial agent rank %u back at %s: %s (and %d more failed in the "
               "last 10 s, not logged)", j->rank, j->d.address, st.message, held);
    else
      log_warn("registry", "cannot dial agent rank %u back at %s: %s", j->rank, j->d.address,
               st.message);
  }
  rpc_call_finish(j->call, GRPC_STATUS_FAILED_PRECONDITION, NULL,
                  "the server could not reach the agent at %s (%s); check --advertise", j->d.address,
                  st.message);
  rpc_channel_destroy(ch);
}

/* Ends the registration of every dialed-back agent the pool no longer counts
 * healthy: its Execute link broke (keepalive timeout, the agent refused or
 * ended the stream). The agent registers again when it can. A conn not dialed
 * back yet is never ended here. */
static void sweep(registry_t *r) {
  size_t world = 0;
  /* The map is taken under r->mu, which a dialer holds when it sets `dialed`
   * (after marking the agent healthy): a conn seen dialed here was healthy
   * before this snapshot. Lock order: r->mu, then the pool's. */
  pthread_mutex_lock(&r->mu);
  bool *healthy = agent_pool_healthy_map(r->pool, &world);
  if (!healthy) {
    pthread_mutex_unlock(&r->mu);
    return;
  }
  int64_t now = mono_ms();
  for (conn_t *c = r->conns; c; c = c->next) {
    if (!c->heard && !c->ending && now - c->opened_ms >= REGISTRY_FIRST_MESSAGE_MS) {
      c->ending = true;
      rpc_call_finish(c->call, GRPC_STATUS_DEADLINE_EXCEEDED, NULL,
                      "no RegisterRequest within %.1f s of the call's start: an agent sends it "
                      "at once", REGISTRY_FIRST_MESSAGE_MS / 1000.0);
      continue;
    }
    if (!c->dialed || c->ending || ((size_t)c->rank < world && healthy[c->rank])) continue;
    end_lost_locked(r, c);
  }
  pthread_mutex_unlock(&r->mu);
  free(healthy);
}

/* Admits j's agent once the agent gone from its way (holder(): its rank, or
 * its id) is removed: it waits for removals, up to REGISTRY_TAKEOVER_MS, and
 * refuses as the pool does if that holder turns out live or is not removed
 * by then. Returns true when admitted (j->rank set). On a dialer. */
static bool take_over(registry_t *r, job_t *j) {
  int64_t end = mono_ms() + REGISTRY_TAKEOVER_MS;
  char err[256];
  holder_t last = HOLDER_GONE;
  for (;;) {
    pthread_mutex_lock(&r->mu);
    uint64_t seen = r->removed;
    pthread_mutex_unlock(&r->mu);
    int rank = add_to_pool(r, j->call, &j->d, j->requested, err, sizeof err);
    if (rank >= 0) {
      j->rank = (uint32_t)rank;
      accept_agent(r, j->call, &j->d, rank);
      return true;
    }
    if (rpc_call_ended(j->call)) return false;
    int64_t now = mono_ms();
    holder_t h = holder(r, &j->d, j->requested);
    /* None in the way twice: refused for another reason (the pool is full). */
    if (now >= end || h == HOLDER_LIVE || (h == HOLDER_NONE && last == HOLDER_NONE)) {
      reject(r, j->call, GRPC_STATUS_FAILED_PRECONDITION, err);
      return false;
    }
    last = h;
    if (h == HOLDER_NONE) continue; /* it was removed just now: again at once */
    /* The next removal, or a recheck: a deferred one runs at the sweeper's turn. */
    struct timespec until;
    runtime_deadline(&until, CLOCK_MONOTONIC,
                     end - now < r->o.sweep_ms ? (int)(end - now) : r->o.sweep_ms);
    pthread_mutex_lock(&r->mu);
    while (r->removed == seen && !r->stopping &&
           pthread_cond_timedwait(&r->removed_cv, &r->mu, &until) != ETIMEDOUT) {
    }
    bool stopping = r->stopping;
    pthread_mutex_unlock(&r->mu);
    if (stopping) { /* close_all ended the call already; this is for a stop without it */
      rpc_call_finish(j->call, GRPC_STATUS_UNAVAILABLE, NULL, "server shutting down");
      return false;
    }
  }
}

/* take_over, counted in r->takeovers while it runs. */
static bool take_over_counted(registry_t *r, job_t *j) {
  pthread_mutex_lock(&r->mu);
  r->takeovers++;
  pthread_mutex_unlock(&r->mu);
  bool admitted = take_over(r, j);
  pthread_mutex_lock(&r->mu);
  r->takeovers--;
  pthread_mutex_unlock(&r->mu);
  return admitted;
}

/* A dialer: dial-back jobs as they come, one at a time. */
static void *dialer(void *arg) {
  registry_t *r = arg;
  pthread_mutex_lock(&r->mu);
  for (;;) {
    while (!r->jobs && !r->stopping) pthread_cond_wait(&r->jobs_cv, &r->mu);
    if (r->stopping) break;
    job_t *j = r->jobs;
    r->jobs = j->next;
    if (!r->jobs) r->jobs_tail = NULL;
    pthread_mutex_unlock(&r->mu);
    if (!j->admit || take_over_counted(r, j)) dial(r, j);
    rpc_call_unref(j->call);
    memset(j, 0, sizeof *j);
    free(j);
    pthread_mutex_lock(&r->mu);
  }
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

/* The sweeper: sweep() every sweep_ms (REGISTRY_SWEEP_MS). */
static void *sweeper(void *arg) {
  registry_t *r = arg;
  for (;;) {
    struct timespec next;
    runtime_deadline(&next, CLOCK_MONOTONIC, r->o.sweep_ms);
    pthread_mutex_lock(&r->mu);
    while (!r->stopping && pthread_cond_timedwait(&r->stop_cv, &r->mu, &next) != ETIMEDOUT) {
    }
    bool stop = r->stopping;
    pthread_mutex_unlock(&r->mu);
    if (stop) return NULL;
    remove_deferred(r);
    sweep(r);
  }
}

static void stop_threads(registry_t *r) {
  pthread_mutex_lock(&r->mu);
  r->stopping = true;
  pthread_cond_broadcast(&r->jobs_cv);
  pthread_cond_broadcast(&r->stop_cv);
  pthread_cond_broadcast(&r->removed_cv); /* take_over's wait */
  pthread_mutex_unlock(&r->mu);
  for (int i = 0; i < r->ndialers; i++) pthread_join(r->dialers[i], NULL);
  r->ndialers = 0;
  if (r->sweeper_started) pthread_join(r->sweeper, NULL);
  r->sweeper_started = false;
}

registry_t *registry_create(agent_pool_t *pool, const registry_opts_t *o) {
  registry_t *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->pool = pool;
  r->o = *o;
  snprintf(r->server_id, sizeof r->server_id, "%s", o->server_id ? o->server_id : "");
  r->o.server_id = r->server_id;
  if (r->o.agent_timeout_ms <= 0) r->o.agent_timeout_ms = 1;
  if (r->o.dial_timeout_ms <= 0) r->o.dial_timeout_ms = 3000;
  if (r->o.max_agents <= 0) r->o.max_agents = agent_pool_max_agents(pool);
  if (r->o.sweep_ms <= 0) r->o.sweep_ms = REGISTRY_SWEEP_MS;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->jobs_cv, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&r->removed_cv, &ca);
  pthread_cond_init(&r->stop_cv, &ca);
  pthread_condattr_destroy(&ca);
  bool ok = true;
  for (int i = 0; ok && i < REGISTRY_DIALERS; i++) {
    ok = pthread_create(&r->dialers[i], NULL, dialer, r) == 0;
    if (ok) r->ndialers++;
  }
  if (ok) ok = r->sweeper_started = pthread_create(&r->sweeper, NULL, sweeper, r) == 0;
  if (!ok) {
    log_error("registry", "cannot start its threads");
    stop_threads(r);
    pthread_cond_destroy(&r->jobs_cv);
    pthread_cond_destroy(&r->stop_cv);
    pthread_cond_destroy(&r->removed_cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
    return NULL;
  }
  return r;
}

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.v1.AgentRegistry/RegisterAgent",
        .kind = RPC_BIDI,
        .request = &meshd__v1__agent_to_server__descriptor,
        .on_start = on_start,
        .on_message = on_message,
        .on_end = on_end,
    },
};

int registry_add_methods(registry_t *r, rpc_server_t *srv) {
  return rpc_server_add_methods_guarded(srv, methods, sizeof methods / sizeof methods[0], r, guard,
                                        r);
}

bool registry_open(const registry_t *r) {
  return !r->o.join_tokens && !r->o.require_cluster_cert;
}

int registry_open_calls(registry_t *r) {
  pthread_mutex_lock(&r->mu);
  int n = 0;
  for (conn_t *c = r->conns; c; c = c->next) n++;
  pthread_mutex_unlock(&r->mu);
  return n;
}

void registry_close_all(registry_t *r) {
  pthread_mutex_lock(&r->mu);
  r->stopping = true;
  for (conn_t *c = r->conns; c; c = c->next)
    rpc_call_finish(c->call, GRPC_STATUS_UNAVAILABLE, NULL, "server shutting down");
  pthread_cond_broadcast(&r->jobs_cv);
  pthread_cond_broadcast(&r->stop_cv);
  /* take_over's wait: it gave up only at its next look (the sweeper's period). */
  pthread_cond_broadcast(&r->removed_cv);
  pthread_mutex_unlock(&r->mu);
}

int registry_takeovers_waiting(registry_t *r) {
  pthread_mutex_lock(&r->mu);
  int n = r->takeovers;
  pthread_mutex_unlock(&r->mu);
  return n;
}

void registry_destroy(registry_t *r) {
  if (!r) return;
  stop_threads(r);
  pthread_mutex_lock(&r->mu);
  while (r->removals > 0) pthread_cond_wait(&r->removed_cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
  remove_deferred(r);
  for (job_t *j = r->jobs, *next; j; j = next) {
    next = j->next;
    rpc_call_unref(j->call);
    memset(j, 0, sizeof *j);
    free(j);
  }
  pthread_cond_destroy(&r->jobs_cv);
  pthread_cond_destroy(&r->stop_cv);
  pthread_cond_destroy(&r->removed_cv);
  pthread_mutex_destroy(&r->mu);
  free(r);
}
