/* Keeps the agent registered: one long-lived AgentRegistry/RegisterAgent call,
 * re-opened with backoff whenever it ends, until registration_stop. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"
#include "build_info.h"
#include "log.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "meshd/v1/agent_registry.pb-c.h"
#include "rpc.h"
#include "secret.h"

#define REGISTER_METHOD "/meshd.v1.AgentRegistry/RegisterAgent"

#define BACKOFF_FIRST_MS 100
#define BACKOFF_MAX_MS 2000
/* A registration that held this long was healthy: the next failure starts the
 * backoff from the beginning again. */
#define STABLE_MS 5000
/* While the same failure repeats, log it at warn only this often (attempts);
 * at the 2 s ceiling that is about every 30 s. */
#define REPEAT_LOG_EVERY 15

struct registration {
  const agent_info_t *info;
  health_t *health;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t wake;   /* signalled by registration_stop; uses CLOCK_MONOTONIC */
  bool stopping;         /* guarded by mu */
  rpc_stream_t *stream;  /* the call in progress, for registration_stop to cancel; mu */
  uint64_t rng;          /* jitter; used by the thread only */
  /* Readiness (meshd.agent.v1.Agent) is SERVING once both came for the attempt
   * whose secret this is: the server's RegisterAccepted and its dial-back
   * (Agent/Hello, registration_reached). The server counts the agent only after
   * the dial-back, and one that cannot reach us (a wrong --advertise, a
   * NetworkPolicy) admits us for a moment each try. mu; health_set under mu. */
  char secret[SECRET_HEX_LEN + 1];
  bool accepted, reached;
};

/* The process's registration, for the Hello handler; current_mu before reg->mu. */
static pthread_mutex_t current_mu = PTHREAD_MUTEX_INITIALIZER;
static registration_t *current;

/* One attempt's outcome, for the log line and the backoff. */
typedef struct attempt {
  bool accepted;
  int64_t accepted_at_ms;
  rpc_status_t st;
} attempt_t;

static uint64_t next_random(uint64_t *state) {
  /* splitmix64: plenty for jitter, and no shared state with rand(). */
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* base ±20% */
static int jittered(registration_t *reg, int base_ms) {
  double u = (double)(next_random(&reg->rng) >> 11) / (double)(1ull << 53);
  return (int)(base_ms * (0.8 + 0.4 * u));
}

static bool is_stopping(registration_t *reg) {
  pthread_mutex_lock(&reg->mu);
  bool stopping = reg->stopping;
  pthread_mutex_unlock(&reg->mu);
  return stopping;
}

/* Sleeps ms unless registration_stop wakes it. Returns false if stopping. */
static bool sleep_unless_stopped(registration_t *reg, int ms) {
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += ms / 1000;
  until.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&reg->mu);
  while (!reg->stopping) {
    if (pthread_cond_timedwait(&reg->wake, &reg->mu, &until) == ETIMEDOUT)
      break;
  }
  bool stopping = reg->stopping;
  pthread_mutex_unlock(&reg->mu);
  return !stopping;
}

static void set_serving(registration_t *reg, bool serving) {
  health_set(reg->health, AGENT_HEALTH_SERVICE, serving ? HEALTH_SERVING : HEALTH_NOT_SERVING);
}

void registration_reached(rpc_call_t *hello) {
  char got[SECRET_HEX_LEN + 2];
  const char *v = rpc_call_metadata(hello, SECRET_AGENT_MD, got, sizeof got);
  pthread_mutex_lock(&current_mu);
  registration_t *reg = current;
  if (reg && v) {
    pthread_mutex_lock(&reg->mu);
    /* This attempt's server (a Hello of an attempt that ended since counts not). */
    if (reg->secret[0] && secret_equal(v, strlen(v), reg->secret, strlen(reg->secret))) {
      reg->reached = true;
      if (reg->accepted)
        set_serving(reg, true);
    }
    pthread_mutex_unlock(&reg->mu);
  }
  pthread_mutex_unlock(&current_mu);
  memset(got, 0, sizeof got);
}

static void on_server_message(registration_t *reg, const Meshd__V1__ServerToAgent *m,
                              attempt_t *at) {
  switch (m->msg_case) {
  case MESHD__V1__SERVER_TO_AGENT__MSG_ACCEPTED:
    log_set_rank(m->accepted->rank);
    log_info("agent", "registered as rank %u with server %s (server id %s)",
             m->accepted->rank, reg->info->server, m->accepted->server_id);
    if (!at->accepted) {
      at->accepted = true;
      at->accepted_at_ms = rpc_now_ms();
    }
    pthread_mutex_lock(&reg->mu);
    reg->accepted = true;
    if (reg->reached)
      set_serving(reg, true);
    pthread_mutex_unlock(&reg->mu);
    break;
  default:
    /* A newer server may send more kinds; they are not ours to fail on. */
    log_debug("agent", "ignoring server message kind %d", (int)m->msg_case);
    break;
  }
}

/* One registration call, from opening it to its status. */
static void attempt_once(registration_t *reg, attempt_t *at) {
  const agent_info_t *info = reg->info;
  memset(at, 0, sizeof *at);

  /* A fresh channel with its own connection per attempt: gRPC's reconnect
   * backoff (up to minutes) would otherwise outlive a restarted server and make
   * our own 2 s ceiling meaningless. A server that exits closes the connection
   * (noticed at once); keepalive catches a silent one (host gone, network cut)
   * within --server-timeout. That must outlast a stalled server (a paused VM, a
   * throttled container): an ack timeout of 1 s lost every agent to a 3 s pause
   * although the server's --agent-timeout allowed 60. */
  rpc_channel_opts_t copts = {
      .keepalive_ms = 1000,
      .keepalive_timeout_ms = info->server_timeout_ms > 0 ? info->server_timeout_ms : 20000,
      .own_connection = true,
      /* A handshake on a busy machine takes longer than the 100 ms default
       * (TLS all the more): 64 agents starting at once on 2 cores saw 12-41 first
       * attempts time out "before receiving SETTINGS frame". A server that is
       * down refuses at once: reconnecting after its restart is not slower. */
      .connect_timeout_ms = info->cluster_tls.on ? 2000 : 1000,
      .tls = info->cluster_tls,
  };
  /* The secret the server will show on every call to us, fresh per attempt:
   * whoever held the last one (a server we left) can no longer call. */
  char secret[SECRET_HEX_LEN + 1];
  if (agent_auth_renew(secret) != 0) {
    at->st.code = GRPC_STATUS_INTERNAL;
    snprintf(at->st.message, sizeof at->st.message, "no randomness for a call secret");
    return;
  }
  char token[SECRET_TOKEN_MAX + 1];
  rpc_md_t md[1];
  size_t nmd = 0;
  if (info->join_token && secret_file_first(info->join_token, token, sizeof token) == 0)
    md[nmd++] = (rpc_md_t){SECRET_JOIN_MD, token};
  rpc_channel_t *ch = rpc_channel_create(info->server, &copts);
  rpc_stream_t *s = ch ? rpc_stream_open(ch, REGISTER_METHOD, md, nmd, 0) : NULL;
  memset(token, 0, sizeof token);
  if (!s) {
    at->st.code = ch ? GRPC_STATUS_INTERNAL : GRPC_STATUS_INVALID_ARGUMENT;
    snprintf(at->st.message, sizeof at->st.message, ch ? "cannot open %s"
             : "cannot make a channel to the server (are the --cluster-* files readable?)",
             REGISTER_METHOD);
    rpc_channel_destroy(ch);
    agent_auth_clear();
    return;
  }

  pthread_mutex_lock(&reg->mu);
  reg->stream = s;
  memcpy(reg->secret, secret, sizeof reg->secret);
  reg->accepted = reg->reached = false;
  if (reg->stopping)
    rpc_stream_cancel(s);
  pthread_mutex_unlock(&reg->mu);

  Meshd__V1__RegisterRequest hello = MESHD__V1__REGISTER_REQUEST__INIT;
  hello.agent_id = (char *)info->id;
  hello.address = (char *)info->address;
  hello.device = (char *)info->device;
  hello.memory_bytes = info->memory_bytes;
  hello.requested_rank = info->requested_rank;
  hello.data_port = info->data_port;
  const build_info_t *build = build_info();
  hello.version = (char *)build->version;
  hello.commit = (char *)build->commit;
  hello.build_type = (char *)build->build_type;
  hello.cuda = build->cuda;
  hello.instructions = info->instructions;
  hello.data_plane = info->data_plane;
  hello.pid = (uint32_t)getpid();
  hello.call_secret = secret;
  Meshd__V1__AgentToServer first = MESHD__V1__AGENT_TO_SERVER__INIT;
  first.msg_case = MESHD__V1__AGENT_TO_SERVER__MSG_HELLO;
  first.hello = &hello;

  /* A write fails when the server ended the call already (a refused join
   * token): the read below then returns 0 at once, and the status says why. */
  rpc_stream_write(s, &first.base, false);
  for (;;) {
    ProtobufCMessage *msg = NULL;
    int rc = rpc_stream_read(s, &meshd__v1__server_to_agent__descriptor, &msg, 0);
    if (rc == 1) {
      on_server_message(reg, (const Meshd__V1__ServerToAgent *)msg, at);
      protobuf_c_message_free_unpacked(msg, NULL);
      continue;
    }
    if (rc == -1) {
      log_error("agent", "server %s sent a message that is not a ServerToAgent; "
                "dropping the registration", info->server);
      rpc_stream_cancel(s);
    }
    break; /* 0: the server ended the call; -1: cancelled above */
  }
  rpc_stream_finish(s, &at->st);

  pthread_mutex_lock(&reg->mu);
  reg->stream = NULL;
  memset(reg->secret, 0, sizeof reg->secret);
  reg->accepted = reg->reached = false;
  set_serving(reg, false);
  pthread_mutex_unlock(&reg->mu);
  rpc_stream_destroy(s);
  rpc_channel_destroy(ch);
  agent_auth_clear();
  memset(secret, 0, sizeof secret);
}

static void log_failure(registration_t *reg, const attempt_t *at, int delay_ms,
                        unsigned attempts, bool repeated) {
  const char *server = reg->info->server;
  const char *code = meshd_grpc_code_name(at->st.code);
  const char *msg = at->st.message[0] ? at->st.message : "(no message)";

  if (at->accepted) {
    log_warn("agent", "registration with server %s ended after %.1f s: %s: %s; "
             "re-registering in %d ms", server,
             (double)(rpc_now_ms() - at->accepted_at_ms) / 1000.0, code, msg, delay_ms);
    return;
  }
  /* UNAVAILABLE / DEADLINE_EXCEEDED: nobody answered. Anything else is the
   * server saying no (e.g. FAILED_PRECONDITION "rank 3 is taken"). */
  bool unreachable = at->st.code == GRPC_STATUS_UNAVAILABLE ||
                     at->st.code == GRPC_STATUS_DEADLINE_EXCEEDED;
  char with_hint[sizeof at->st.message + 200];
  if (at->st.code == GRPC_STATUS_UNAVAILABLE && reg->info->cluster_tls.on &&
      (strstr(msg, "andshake") || strstr(msg, "SSL") || strstr(msg, "ssl"))) {
    snprintf(with_hint, sizeof with_hint, "%s (do the server and this agent have certificates "
             "from the same --cluster-ca, and does the server's name --cluster-name?)", msg);
    msg = with_hint;
  }
  log_level_t level = unreachable ? LOG_LEVEL_WARN : LOG_LEVEL_ERROR;
  if (repeated && attempts % REPEAT_LOG_EVERY != 0)
    level = LOG_LEVEL_DEBUG;
  log_write(level, "agent", __FILE__, __LINE__, "%s server %s: %s: %s; retrying in %d ms (%u %s)",
            unreachable ? "cannot register with" : "registration rejected by", server, code,
            msg, delay_ms, attempts, attempts == 1 ? "attempt" : "attempts");
}

static void *run(void *arg) {
  registration_t *reg = arg;
  int backoff_ms = BACKOFF_FIRST_MS;
  unsigned failures = 0; /* consecutive attempts that were never accepted */
  grpc_status_code last_code = GRPC_STATUS_OK;

  while (!is_stopping(reg)) {
    attempt_t at;
    attempt_once(reg, &at);
    if (is_stopping(reg))
      break;

    if (at.accepted) {
      failures = 0;
      if (rpc_now_ms() - at.accepted_at_ms > STABLE_MS)
        backoff_ms = BACKOFF_FIRST_MS;
    }
    /* By code only: gRPC's messages vary between identical failures (the A
     * then the AAAA lookup of a name that does not resolve). */
    bool repeated = !at.accepted && failures > 0 && last_code == at.st.code;
    if (!at.accepted) {
      failures++;
      last_code = at.st.code;
    }

    int delay_ms = jittered(reg, backoff_ms);
    log_failure(reg, &at, delay_ms, failures, repeated);
    if (!sleep_unless_stopped(reg, delay_ms))
      break;
    backoff_ms = backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff_ms * 2;
  }
  return NULL;
}

registration_t *registration_start(const agent_info_t *info, health_t *health) {
  registration_t *reg = calloc(1, sizeof *reg);
  if (!reg) {
    log_error("agent", "registration: out of memory");
    return NULL;
  }
  reg->info = info;
  reg->health = health;
  for (const char *p = info->id; *p; p++)
    reg->rng = reg->rng * 131 + (unsigned char)*p;

  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&reg->wake, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&reg->mu, NULL);

  set_serving(reg, false);
  pthread_mutex_lock(&current_mu);
  current = reg;
  pthread_mutex_unlock(&current_mu);
  int err = pthread_create(&reg->thread, NULL, run, reg);
  if (err != 0) {
    log_error("agent", "registration: cannot start a thread: %s", strerror(err));
    pthread_mutex_lock(&current_mu);
    current = NULL;
    pthread_mutex_unlock(&current_mu);
    pthread_cond_destroy(&reg->wake);
    pthread_mutex_destroy(&reg->mu);
    free(reg);
    return NULL;
  }
  return reg;
}

void registration_stop(registration_t *reg) {
  if (!reg)
    return;
  pthread_mutex_lock(&current_mu);
  if (current == reg)
    current = NULL;
  pthread_mutex_unlock(&current_mu);
  pthread_mutex_lock(&reg->mu);
  reg->stopping = true;
  if (reg->stream)
    rpc_stream_cancel(reg->stream);
  pthread_cond_signal(&reg->wake);
  pthread_mutex_unlock(&reg->mu);

  pthread_join(reg->thread, NULL);
  pthread_cond_destroy(&reg->wake);
  pthread_mutex_destroy(&reg->mu);
  free(reg);
}
