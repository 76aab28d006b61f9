#include "registry.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
  /* Under the registry's mu. dialed: the dial-back answered and the agent was
   * marked healthy, so from now on an unhealthy agent has lost its link.
   * ending: the registry asked the call to end (once). */
  bool dialed, ending;
} conn_t;

typedef struct job {
  struct job *next;
  rpc_call_t *call;      /* referenced */
  uint32_t rank;
  char agent_id[64];
  char address[256];
} job_t;

struct registry {
  agent_pool_t *pool;
  char server_id[64];
  int dial_timeout_ms, agent_timeout_ms;
  pthread_mutex_t mu;
  pthread_cond_t cv;     /* CLOCK_MONOTONIC */
  conn_t *conns;
  job_t *jobs, *jobs_tail;
  bool stopping;
  pthread_t dialer;
};

static void reject(rpc_call_t *call, grpc_status_code code, const char *msg) {
  log_warn("registry", "registration refused: %s", msg);
  rpc_call_finish(call, code, NULL, "%s", msg);
}

static void admit(registry_t *r, conn_t *c, const Meshd__V1__RegisterRequest *req) {
  if (!req->agent_id || !*req->agent_id || strlen(req->agent_id) >= sizeof c->agent_id)
    { reject(c->call, GRPC_STATUS_INVALID_ARGUMENT, "RegisterRequest.agent_id must be 1..63 characters"); return; }
  if (!req->address || !*req->address || strlen(req->address) >= sizeof c->address)
    { reject(c->call, GRPC_STATUS_INVALID_ARGUMENT,
                  "RegisterRequest.address must be the agent's host:port (1..255 characters)"); return; }
  if (!req->device || !*req->device || strlen(req->device) >= 32)
    { reject(c->call, GRPC_STATUS_INVALID_ARGUMENT,
                  "RegisterRequest.device must name the device, e.g. \"cpu\" or \"cuda:0\""); return; }
  if (req->requested_rank < -1 || req->requested_rank > 1 << 20) {
    char msg[128];
    snprintf(msg, sizeof msg, "RegisterRequest.requested_rank %d is out of range [-1, %d]",
             req->requested_rank, 1 << 20);
    { reject(c->call, GRPC_STATUS_INVALID_ARGUMENT, msg); return; }
  }
  agent_desc_t d = {0};
  snprintf(d.agent_id, sizeof d.agent_id, "%s", req->agent_id);
  snprintf(d.address, sizeof d.address, "%s", req->address);
  snprintf(d.device, sizeof d.device, "%s", req->device);
  d.memory_bytes = req->memory_bytes;
  d.data_port = req->data_port;
  d.pid = req->pid;
  char err[256];
  int rank = agent_pool_add(r->pool, &d, req->requested_rank, err, sizeof err);
  if (rank < 0) { reject(c->call, GRPC_STATUS_FAILED_PRECONDITION, err); return; }
  c->rank = rank;
  snprintf(c->agent_id, sizeof c->agent_id, "%s", d.agent_id);
  snprintf(c->address, sizeof c->address, "%s", d.address);
  log_info("registry", "agent %s at %s (%s, pid %u) registered as rank %d", d.agent_id, d.address,
           d.device, d.pid, rank);

  Meshd__V1__RegisterAccepted acc = MESHD__V1__REGISTER_ACCEPTED__INIT;
  acc.rank = (uint32_t)rank;
  acc.server_id = r->server_id;
  Meshd__V1__ServerToAgent out = MESHD__V1__SERVER_TO_AGENT__INIT;
  out.msg_case = MESHD__V1__SERVER_TO_AGENT__MSG_ACCEPTED;
  out.accepted = &acc;
  rpc_call_send(c->call, &out.base);

  job_t *j = calloc(1, sizeof *j);
  if (!j) { reject(c->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory"); return; }
  j->call = c->call;
  j->rank = (uint32_t)rank;
  memcpy(j->agent_id, c->agent_id, sizeof j->agent_id);
  memcpy(j->address, c->address, sizeof j->address);
  rpc_call_ref(c->call);
  pthread_mutex_lock(&r->mu);
  if (r->jobs_tail) r->jobs_tail->next = j;
  else r->jobs = j;
  r->jobs_tail = j;
  pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
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
  if (!msg) { /* the agent said goodbye */
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "goodbye");
    return;
  }
  const Meshd__V1__AgentToServer *m = (const void *)msg;
  switch (m->msg_case) {
    case MESHD__V1__AGENT_TO_SERVER__MSG_HELLO:
      if (c->rank >= 0) {
        reject(call, GRPC_STATUS_INVALID_ARGUMENT, "RegisterRequest sent twice on one call");
        return;
      }
      admit(r, c, m->hello);
      return;
    case MESHD__V1__AGENT_TO_SERVER__MSG_STATUS:
      if (c->rank < 0) {
        reject(call, GRPC_STATUS_INVALID_ARGUMENT, "AgentStatus before RegisterRequest");
        return;
      }
      agent_pool_set_allocated(r->pool, (uint32_t)c->rank, c->agent_id, m->status->allocated_bytes);
      return;
    default:
      reject(call, GRPC_STATUS_INVALID_ARGUMENT,
             "the first message must be AgentToServer.hello (RegisterRequest)");
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
    agent_pool_remove(r->pool, (uint32_t)c->rank, c->agent_id,
                      cancelled ? "registration call broken (agent gone)" : "registration ended");
  free(c);
  rpc_call_unref(call);
}

/* The registration call behind `call`, if it is still open. Under r->mu. */
static conn_t *conn_of_locked(registry_t *r, rpc_call_t *call) {
  conn_t *c = r->conns;
  while (c && c->call != call) c = c->next;
  return c;
}

/* Dials an admitted agent back; marks it healthy if the right process answers. */
static void dial(registry_t *r, job_t *j) {
  if (rpc_call_ended(j->call)) return;
  /* Its own connection: the keepalive verdict is about this agent alone. */
  rpc_channel_opts_t opts = {.keepalive_ms = REGISTRY_PING_MS,
                             .keepalive_timeout_ms = r->agent_timeout_ms,
                             .own_connection = true};
  rpc_channel_t *ch = rpc_channel_create(j->address, &opts);
  Meshd__Agent__V1__HelloRequest req = MESHD__AGENT__V1__HELLO_REQUEST__INIT;
  req.agent_id = j->agent_id;
  req.rank = j->rank;
  req.server_id = r->server_id;
  ProtobufCMessage *resp = NULL;
  rpc_status_t st;
  grpc_status_code code =
      rpc_unary(ch, "/meshd.agent.v1.Agent/Hello", &req.base,
                &meshd__agent__v1__hello_reply__descriptor, &resp, NULL, 0, r->dial_timeout_ms, &st);
  if (code == GRPC_STATUS_OK) {
    const Meshd__Agent__V1__HelloReply *rep = (const void *)resp;
    if (strcmp(rep->agent_id, j->agent_id) == 0) {
      agent_pool_set_channel(r->pool, j->rank, j->agent_id, ch);
      agent_pool_set_healthy(r->pool, j->rank, j->agent_id, true);
      protobuf_c_message_free_unpacked(resp, NULL);
      pthread_mutex_lock(&r->mu);
      conn_t *c = conn_of_locked(r, j->call);
      if (c) c->dialed = true;
      pthread_mutex_unlock(&r->mu);
      return;
    }
    snprintf(st.message, sizeof st.message, "%s answered as agent %s", j->address, rep->agent_id);
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  log_warn("registry", "cannot dial agent rank %u back at %s: %s", j->rank, j->address, st.message);
  rpc_call_finish(j->call, GRPC_STATUS_FAILED_PRECONDITION, NULL,
                  "the server could not reach the agent at %s (%s); check --advertise", j->address,
                  st.message);
  rpc_channel_destroy(ch);
}

/* Ends the registration of every dialed-back agent the pool no longer counts
 * healthy: its Execute link broke (keepalive timeout, the agent refused or
 * ended the stream). The agent registers again when it can. Only this thread
 * sets `dialed`, so a conn it has not dialed yet is never ended here. */
static void sweep(registry_t *r) {
  size_t world = 0;
  bool *healthy = agent_pool_healthy_map(r->pool, &world);
  if (!healthy) return;
  pthread_mutex_lock(&r->mu);
  for (conn_t *c = r->conns; c; c = c->next) {
    if (!c->dialed || c->ending || ((size_t)c->rank < world && healthy[c->rank])) continue;
    c->ending = true;
    log_warn("registry", "agent rank %d (%s, %s) lost its Execute link (no keepalive answer "
             "within %.1f s, or the link broke): ending its registration so that it registers "
             "again", c->rank, c->address, c->agent_id, r->agent_timeout_ms / 1000.0);
    rpc_call_finish(c->call, GRPC_STATUS_UNAVAILABLE, NULL,
                    "the server lost its link to this agent (no keepalive answer within %.1f s, "
                    "or the Execute stream broke); register again",
                    r->agent_timeout_ms / 1000.0);
  }
  pthread_mutex_unlock(&r->mu);
  free(healthy);
}

/* The registry's thread: dial-back jobs as they come, a sweep every REGISTRY_SWEEP_MS. */
static void *dialer(void *arg) {
  registry_t *r = arg;
  struct timespec next_sweep;
  runtime_deadline(&next_sweep, CLOCK_MONOTONIC, REGISTRY_SWEEP_MS);
  pthread_mutex_lock(&r->mu);
  for (;;) {
    while (!r->jobs && !r->stopping &&
           pthread_cond_timedwait(&r->cv, &r->mu, &next_sweep) != ETIMEDOUT) {
    }
    if (r->stopping) break;
    job_t *j = r->jobs;
    if (j) {
      r->jobs = j->next;
      if (!r->jobs) r->jobs_tail = NULL;
    }
    pthread_mutex_unlock(&r->mu);
    if (j) {
      dial(r, j);
      rpc_call_unref(j->call);
      free(j);
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec > next_sweep.tv_sec ||
        (now.tv_sec == next_sweep.tv_sec && now.tv_nsec >= next_sweep.tv_nsec)) {
      sweep(r);
      runtime_deadline(&next_sweep, CLOCK_MONOTONIC, REGISTRY_SWEEP_MS);
    }
    pthread_mutex_lock(&r->mu);
  }
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

registry_t *registry_create(agent_pool_t *pool, const char *server_id, int dial_timeout_ms,
                            int agent_timeout_ms) {
  registry_t *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->pool = pool;
  snprintf(r->server_id, sizeof r->server_id, "%s", server_id);
  r->dial_timeout_ms = dial_timeout_ms;
  r->agent_timeout_ms = agent_timeout_ms > 0 ? agent_timeout_ms : 1;
  pthread_mutex_init(&r->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&r->cv, &ca);
  pthread_condattr_destroy(&ca);
  if (pthread_create(&r->dialer, NULL, dialer, r) != 0) {
    pthread_cond_destroy(&r->cv);
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

const rpc_method_t *registry_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
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
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

void registry_destroy(registry_t *r) {
  if (!r) return;
  pthread_mutex_lock(&r->mu);
  r->stopping = true;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
  pthread_join(r->dialer, NULL);
  for (job_t *j = r->jobs, *next; j; j = next) {
    next = j->next;
    rpc_call_unref(j->call);
    free(j);
  }
  pthread_cond_destroy(&r->cv);
  pthread_mutex_destroy(&r->mu);
  free(r);
}
