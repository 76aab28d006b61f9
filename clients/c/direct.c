/* The direct data path of the C client (direct.h). */
#include "direct.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "meshd/agent/v1/agent.pb-c.h"
#include "workpool.h"

#define TS "/meshd.v1.TensorService/"
#define AGENT "/meshd.agent.v1.Agent/"
#define GRANT_MD "meshd-transfer-grant-bin"
/* Writes of 2 MiB (half the agents' default 4 MiB message limit), reads of
 * 1 MiB: what the Python client measured best on loopback. */
#define WRITE_CHUNK (2u << 20)
#define READ_CHUNK (1u << 20)
/* How long an upload waits, once its calls ended, for gRPC to let go of the
 * messages that reference the caller's bytes before it closes the agents'
 * connections (a peer that stopped reading holds them). */
#define HOLD_WAIT_MS 2000
/* Agent connections are pinged this often while calls run: an agent that
 * stops answering (SIGSTOPped, its host gone) ends a send that its flow
 * control holds, which neither the call's deadline nor a cancel ends in gRPC
 * 1.51 (test_c_client: a_direct_upload_to_an_agent_that_stops_reading...). */
#define DIRECT_PING_MS 2000
#define DIRECT_PING_TIMEOUT_MS 5000
/* How long FinishFetch of an abandoned fetch may take. */
#define ABANDON_MS 300

/* A channel to one agent, for the session: over TLS when the plan said the
 * agents speak it (ca: the PEM that verifies them, "" plaintext). */
typedef struct {
  char *address;
  char *ca;
  char *name;
  rpc_channel_t *ch;
} chan_t;

struct direct {
  meshd_data_path_t mode;
  bool refused;        /* the server refused PlanTransfer for its --data-path */
  bool offered;        /* a plan was answered: the server offers PlanTransfer */
  bool agents_plain;   /* a plan said the agents speak plaintext (for a TLS session) */
  int64_t off_until;   /* auto: not tried before this (rpc_now_ms), an agent did not connect */
  chan_t *chans;
  size_t nchans;
  meshd_transfer_stats_t stats;
};

void direct_err_set(direct_err_t *e, meshd_err_t err, grpc_status_code code, const char *kind,
                    const char *fmt, ...) {
  e->err = err;
  e->code = code;
  snprintf(e->kind, sizeof e->kind, "%s", kind ? kind : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
}

void direct_err_status(direct_err_t *e, const rpc_status_t *st, const char *prefix) {
  bool late = st->code == GRPC_STATUS_DEADLINE_EXCEEDED;
  direct_err_set(e, late ? MESHD_E_DEADLINE : MESHD_E_RPC, st->code,
                 late ? "DEADLINE_EXCEEDED" : st->kind, "%s%s", prefix, st->message);
}

/* An agent's refusal of a Read or Write first presented past its grant's
 * start-by time (agent/transfer_grant.c), and what the client says of it. */
#define LATE_REFUSAL "did not start by its start-by time"
#define LATE_MSG                                                                          \
  "the transfer's grant expired before it started (the client was paused after its plan, an " \
  "agent's clock was stepped, or, with an older server or agent, the clocks differ by more " \
  "than --transfer-grant-start-ms); call again"

/* Whether e is the agent's refusal of a call that started past its grant's
 * start-by time, as the agent said it (not yet late_say's). */
static bool late_refusal(const direct_err_t *e) {
  return e->err != MESHD_E_OK && e->code == GRPC_STATUS_PERMISSION_DENIED &&
         strncmp(e->msg, LATE_MSG, strlen(LATE_MSG)) != 0 && strstr(e->msg, LATE_REFUSAL);
}

/* A late refusal (late_refusal) says what happened and what to do, not an
 * authentication problem: LATE_MSG, then the agent's words. */
static void late_say(direct_err_t *e) {
  if (!late_refusal(e))
    return;
  char was[sizeof e->msg];
  memcpy(was, e->msg, sizeof was);
  size_t at = (size_t)snprintf(e->msg, sizeof e->msg, "%s (", LATE_MSG);
  size_t room = sizeof e->msg - at - 2; /* the agent's words, cut to fit, then ")" */
  memcpy(e->msg + at, was, strnlen(was, room));
  at += strnlen(was, room);
  memcpy(e->msg + at, ")", 2);
}

bool direct_late_grant(const direct_err_t *e) {
  return e->err != MESHD_E_OK && e->code == GRPC_STATUS_PERMISSION_DENIED &&
         strncmp(e->msg, LATE_MSG, strlen(LATE_MSG)) == 0;
}

/* Tests only (tests/unit/test_c_client.c), never set in use:
 * MESHD_TEST_DIRECT_DELAY_MS=<ms> sleeps <ms> after each PlanTransfer answer,
 * a client paused between its plan and its transfer; "<ms>,once" only after a
 * transfer's first plans, not after a re-plan for a late grant (again). */
static void test_pause(bool again) {
  const char *v = getenv("MESHD_TEST_DIRECT_DELAY_MS");
  if (!v || !*v)
    return;
  char *rest = NULL;
  long ms = strtol(v, &rest, 10);
  if (ms <= 0 || ms > 60000 || (again && rest && strcmp(rest, ",once") == 0))
    return;
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

size_t direct_dtype_bytes(int dtype) {
  switch (dtype) {
  case MESHD__V1__DTYPE__DTYPE_FLOAT64:
  case MESHD__V1__DTYPE__DTYPE_INT64:
    return 8;
  case MESHD__V1__DTYPE__DTYPE_FLOAT32:
  case MESHD__V1__DTYPE__DTYPE_INT32:
    return 4;
  case MESHD__V1__DTYPE__DTYPE_FLOAT16:
  case MESHD__V1__DTYPE__DTYPE_BFLOAT16:
  case MESHD__V1__DTYPE__DTYPE_INT16:
    return 2;
  case MESHD__V1__DTYPE__DTYPE_INT8:
  case MESHD__V1__DTYPE__DTYPE_UINT8:
  case MESHD__V1__DTYPE__DTYPE_BOOL:
    return 1;
  default:
    return 0;
  }
}

direct_t *direct_create(void) { return calloc(1, sizeof(direct_t)); }

void direct_free(direct_t *d) {
  if (!d)
    return;
  for (size_t i = 0; i < d->nchans; i++) {
    rpc_channel_destroy(d->chans[i].ch);
    free(d->chans[i].address);
    free(d->chans[i].ca);
    free(d->chans[i].name);
  }
  free(d->chans);
  free(d);
}

void direct_set_mode(direct_t *d, meshd_data_path_t mode) {
  d->mode = mode;
  d->off_until = 0; /* a test forcing a mode wants it tried now */
}

void direct_stats(const direct_t *d, meshd_transfer_stats_t *out) { *out = d->stats; }

void direct_count_proxy(direct_t *d, bool upload) {
  if (upload)
    d->stats.proxy_uploads++;
  else
    d->stats.proxy_fetches++;
}

static void fallback(direct_t *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void fallback(direct_t *d, const char *fmt, ...) {
  d->stats.fallbacks++;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(d->stats.last_fallback, sizeof d->stats.last_fallback, fmt, ap);
  va_end(ap);
}

/* ------------------------------------------------------------------ threads */

/* Shards run on a process-wide workpool: a thread start cost ~0.5 ms here,
 * 2 ms of a 4-shard upload that moves 64 MiB in 25. A forked child starts a
 * pool of its own (the parent's threads are not in it). */
static workpool_t *shard_pool;
static pthread_once_t shard_pool_once = PTHREAD_ONCE_INIT;

static void shard_pool_forget(void) {
  shard_pool = NULL; /* the parent's; its threads did not follow the fork */
  shard_pool_once = (pthread_once_t)PTHREAD_ONCE_INIT;
}

static void shard_pool_init(void) {
  static bool at_fork;
  shard_pool = workpool_create("meshd-shard", 16, 10000);
  if (!at_fork)
    at_fork = pthread_atfork(NULL, NULL, shard_pool_forget) == 0;
}

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t done;
  size_t left;
} join_t;

typedef struct {
  void (*fn)(void *arg, size_t i);
  void *arg;
  size_t i;
  join_t *join;
} job_t;

static void job_run(void *p) {
  job_t *j = p;
  j->fn(j->arg, j->i);
  join_t *w = j->join;
  pthread_mutex_lock(&w->mu);
  if (--w->left == 0)
    pthread_cond_signal(&w->done);
  pthread_mutex_unlock(&w->mu);
}

/* The calling thread runs the last job itself: it would only wait meanwhile,
 * and each pool thread's wake-up is one more hand-over (context switches
 * were most of a 1 MiB transfer's CPU here: tests/bench/bench_data). */
int direct_parallel(size_t n, void (*fn)(void *arg, size_t i), void *arg) {
  if (n == 0)
    return 0;
  if (n > 1)
    pthread_once(&shard_pool_once, shard_pool_init);
  job_t *jobs = n > 1 ? calloc(n - 1, sizeof *jobs) : NULL;
  join_t w = {.left = 0};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.done, NULL);
  size_t started = 0;
  for (; jobs && shard_pool && started < n - 1; started++) {
    jobs[started] = (job_t){fn, arg, started, &w};
    pthread_mutex_lock(&w.mu);
    w.left++;
    pthread_mutex_unlock(&w.mu);
    if (workpool_run(shard_pool, job_run, &jobs[started]) != 0) {
      pthread_mutex_lock(&w.mu);
      w.left--;
      pthread_mutex_unlock(&w.mu);
      break;
    }
  }
  /* Not when another could not start: fn runs for none of the rest. */
  if (started == n - 1)
    fn(arg, started++);
  pthread_mutex_lock(&w.mu);
  while (w.left > 0)
    pthread_cond_wait(&w.done, &w.mu);
  pthread_mutex_unlock(&w.mu);
  pthread_cond_destroy(&w.done);
  pthread_mutex_destroy(&w.mu);
  free(jobs);
  return started == n ? 0 : -1;
}

/* ------------------------------------------------------------------ pulls */

/* The pull thread only queues what arrives; the calling thread runs on_msg
 * and on_end (the sinks, a user's progress callback) in order per call. At
 * most PULL_QUEUED messages of a call wait in the queue before its next read
 * is asked for. */
#define PULL_QUEUED 2

typedef struct pulled {
  struct pulled *next;
  size_t i;
  rpc_bytes_t *m; /* NULL: the call ended */
} pulled_t;

typedef struct pull_one {
  struct pull_group *g;
  size_t i;
  int queued;     /* under g->mu */
  bool held;      /* a read waits for the queue to shrink (under g->mu) */
  pulled_t end;   /* the call's end, queued without an allocation */
} pull_one_t;

typedef struct pull_group {
  pthread_mutex_t mu;
  pthread_cond_t ready;
  pulled_t *head, *tail;
  /* The calling thread's: the calls started so far (n, room for cap: the
   * caller's, then those pull_add started), how many have not ended. */
  pull_one_t *ones;
  rpc_pull_t **pulls;
  bool *cancelled;
  size_t n, cap, left;
  int timeout_ms;
  void (*on_end)(void *arg, size_t i, grpc_status_code code, const rpc_status_t *st);
  void *arg;
} pull_group_t;

static void pull_push(pull_group_t *g, pulled_t *q) {
  if (g->tail)
    g->tail->next = q;
  else
    g->head = q;
  g->tail = q;
  pthread_cond_signal(&g->ready);
}

/* On the pull thread: queues m (NULL: the end), asks for the next message
 * while the call's queue is short. */
static void pull_got(rpc_pull_t *p, rpc_bytes_t *m, void *arg) {
  pull_one_t *o = arg;
  pull_group_t *g = o->g;
  pulled_t *q = m ? malloc(sizeof *q) : &o->end;
  if (!q) { /* no memory to queue it: the call ends CANCELLED (its end queues) */
    rpc_bytes_free(m);
    rpc_pull_cancel(p);
    rpc_pull_next(p);
    return;
  }
  *q = (pulled_t){NULL, o->i, m};
  pthread_mutex_lock(&g->mu);
  bool next = m && ++o->queued < PULL_QUEUED;
  if (m && !next)
    o->held = true;
  pull_push(g, q);
  pthread_mutex_unlock(&g->mu);
  if (next)
    rpc_pull_next(p);
}

/* Starts call c as the group's next (on the calling thread); one that cannot
 * start ends at once (on_end, UNAVAILABLE), or, `taken_back`, is not counted
 * (SIZE_MAX). Its index, or SIZE_MAX when the group has no room for it
 * (nothing started). */
static size_t pull_start(pull_group_t *g, const direct_call_t *c, bool taken_back) {
  if (g->n >= g->cap)
    return SIZE_MAX;
  size_t i = g->n++;
  g->ones[i] = (pull_one_t){.g = g, .i = i};
  g->pulls[i] = rpc_pull_open_raw(c->ch, c->method, c->req, c->md, c->nmd, g->timeout_ms,
                                  pull_got, &g->ones[i]);
  if (g->pulls[i]) {
    g->left++;
    rpc_pull_next(g->pulls[i]);
    return i;
  }
  if (taken_back) {
    g->n--;
    return SIZE_MAX;
  }
  rpc_status_t st;
  memset(&st, 0, sizeof st);
  st.code = GRPC_STATUS_UNAVAILABLE;
  snprintf(st.message, sizeof st.message, "cannot start the call (no channel)");
  g->on_end(g->arg, i, GRPC_STATUS_UNAVAILABLE, &st);
  return i;
}

/* The group whose messages this thread hands on now (pull_all), for pull_add. */
static _Thread_local pull_group_t *pulling;

/* From inside on_msg or on_end of pull_all: starts call c in the same group
 * (its messages and end go to the same on_msg and on_end, under the index
 * returned; pull_all returns once it ended too). c's request is packed at once;
 * its metadata must outlive the call. SIZE_MAX: nothing started (no room: the
 * caller's `extra` is used up, or none was asked for; or it could not start). */
static size_t pull_add(const direct_call_t *c) {
  return pulling ? pull_start(pulling, c, true) : SIZE_MAX;
}

/* direct_pull_all with room for `extra` calls that on_msg or on_end start
 * (pull_add) while it runs. */
static void pull_all(size_t n, size_t extra, const direct_call_t *calls, int timeout_ms,
                     int (*on_msg)(void *arg, size_t i, rpc_bytes_t *msg),
                     void (*on_end)(void *arg, size_t i, grpc_status_code code,
                                    const rpc_status_t *st),
                     void *arg) {
  pull_group_t g = {.head = NULL, .timeout_ms = timeout_ms, .on_end = on_end, .arg = arg};
  pthread_mutex_init(&g.mu, NULL);
  pthread_cond_init(&g.ready, NULL);
  size_t cap = n + extra;
  g.ones = calloc(cap ? cap : 1, sizeof *g.ones);
  g.pulls = calloc(cap ? cap : 1, sizeof *g.pulls);
  g.cancelled = calloc(cap ? cap : 1, sizeof *g.cancelled);
  if (g.ones && g.pulls && g.cancelled)
    g.cap = cap;
  for (size_t i = 0; i < n; i++) {
    if (pull_start(&g, &calls[i], false) != SIZE_MAX)
      continue;
    rpc_status_t st; /* no room: out of memory */
    memset(&st, 0, sizeof st);
    st.code = GRPC_STATUS_UNAVAILABLE;
    snprintf(st.message, sizeof st.message, "cannot start the call (out of memory)");
    on_end(arg, i, GRPC_STATUS_UNAVAILABLE, &st);
  }
  pull_group_t *outer = pulling;
  pulling = &g;
  pthread_mutex_lock(&g.mu);
  while (g.left > 0) {
    while (!g.head)
      pthread_cond_wait(&g.ready, &g.mu);
    pulled_t *q = g.head;
    g.head = q->next;
    if (!g.head)
      g.tail = NULL;
    pull_one_t *o = &g.ones[q->i];
    bool resume = false;
    if (q->m) {
      o->queued--;
      resume = o->held;
      o->held = false;
    }
    pthread_mutex_unlock(&g.mu);
    rpc_pull_t *p = g.pulls[q->i];
    if (q->m) {
      if (!g.cancelled[q->i] && on_msg(arg, q->i, q->m) != 0) {
        g.cancelled[q->i] = true;
        rpc_pull_cancel(p); /* the reads that follow end the call */
      }
      rpc_bytes_free(q->m);
      if (resume)
        rpc_pull_next(p);
    } else {
      rpc_status_t st;
      memset(&st, 0, sizeof st);
      grpc_status_code code = rpc_pull_status(p, &st);
      on_end(arg, q->i, code, &st);
      g.left--;
    }
    if (q != &o->end)
      free(q);
    pthread_mutex_lock(&g.mu);
  }
  pthread_mutex_unlock(&g.mu);
  pulling = outer;
  for (size_t i = 0; i < g.n; i++)
    rpc_pull_destroy(g.pulls[i]);
  free(g.cancelled);
  free(g.pulls);
  free(g.ones);
  pthread_cond_destroy(&g.ready);
  pthread_mutex_destroy(&g.mu);
}

void direct_pull_all(size_t n, const direct_call_t *calls, int timeout_ms,
                     int (*on_msg)(void *arg, size_t i, rpc_bytes_t *msg),
                     void (*on_end)(void *arg, size_t i, grpc_status_code code,
                                    const rpc_status_t *st),
                     void *arg) {
  pull_all(n, 0, calls, timeout_ms, on_msg, on_end, arg);
}

/* ------------------------------------------------------------------ agents */

/* Milliseconds left before `end` (rpc_now_ms), at least 1. */
static int left_ms(int64_t end) {
  int64_t n = end - rpc_now_ms();
  return n < 1 ? 1 : n > INT32_MAX ? INT32_MAX : (int)n;
}

/* The plan's AgentTls: the CA's PEM ("" plaintext) and the name to verify. */
static const char *plan_ca(const Meshd__V1__PlanTransferReply *p) {
  return p->agent_tls && p->agent_tls->ca_pem ? p->agent_tls->ca_pem : "";
}

static const char *plan_name(const Meshd__V1__PlanTransferReply *p) {
  return p->agent_tls && p->agent_tls->server_name ? p->agent_tls->server_name : "";
}

/* A ready channel to the agent at address (kept for the session), or NULL
 * when it does not connect within wait_ms or its first attempt fails. ca
 * non-empty: TLS verified with it, under name when that is not empty (the
 * server's certificate only: grants stand in for a client certificate). */
static rpc_channel_t *agent_channel(direct_t *d, const char *address, const char *ca,
                                    const char *name, int wait_ms) {
  for (size_t i = 0; i < d->nchans; i++)
    if (strcmp(d->chans[i].address, address) == 0 && strcmp(d->chans[i].ca, ca) == 0 &&
        strcmp(d->chans[i].name, name) == 0)
      return d->chans[i].ch;
  chan_t *grown = realloc(d->chans, (d->nchans + 1) * sizeof *grown);
  if (!grown)
    return NULL;
  d->chans = grown;
  /* A connection of its own per agent: shards in parallel do not share one. */
  rpc_channel_t *ch = rpc_channel_create(address, &(rpc_channel_opts_t){
      .max_message_bytes = 8 << 20, .own_connection = true,
      .connect_timeout_ms = DIRECT_CONNECT_MS,
      .keepalive_ms = DIRECT_PING_MS, .keepalive_timeout_ms = DIRECT_PING_TIMEOUT_MS,
      .tls = {.on = *ca != '\0', .ca_pem = ca, .server_name = *name ? name : NULL}});
  chan_t c = {strdup(address), strdup(ca), strdup(name), ch};
  if (!ch || !c.address || !c.ca || !c.name ||
      rpc_channel_connect(ch, wait_ms) != RPC_CONNECT_READY) {
    if (ch)
      rpc_channel_destroy(ch);
    free(c.address);
    free(c.ca);
    free(c.name);
    return NULL;
  }
  d->chans[d->nchans++] = c;
  return ch;
}

/* Closes ch (a cached agent channel), which lets go of what its connection
 * still held; the next transfer to that agent connects again. */
static void drop_channel(direct_t *d, rpc_channel_t *ch) {
  for (size_t i = 0; ch && i < d->nchans; i++)
    if (d->chans[i].ch == ch) {
      rpc_channel_destroy(ch);
      free(d->chans[i].address);
      free(d->chans[i].ca);
      free(d->chans[i].name);
      d->chans[i] = d->chans[--d->nchans];
      return;
    }
}

/* Whether the next transfer should try the direct path. */
static bool wanted(direct_t *d, const direct_session_t *s) {
  if (d->mode == MESHD_DATA_PATH_PROXY)
    return false;
  if (d->mode == MESHD_DATA_PATH_DIRECT)
    return true;
  if (s->tls && d->agents_plain) {
    fallback(d, "the session is over TLS and the agents are reached in plaintext");
    return false;
  }
  if (d->refused) {
    fallback(d, "the server does not offer PlanTransfer (its --data-path is proxy)");
    return false;
  }
  if (d->off_until && rpc_now_ms() < d->off_until) {
    fallback(d, "an agent did not connect within %d ms less than %d s ago", DIRECT_CONNECT_MS,
             DIRECT_RETRY_MS / 1000);
    return false;
  }
  return true;
}

/* PlanTransfer: its reply, or NULL with *rc DIRECT_PROXY (auto, the server does
 * not offer it) or DIRECT_FAILED (e). d NULL: no fallback (a plan made beside
 * others, after the first showed that the server offers it). again: a re-plan
 * after a late grant (test_pause). */
static Meshd__V1__PlanTransferReply *plan(direct_t *d, const direct_session_t *s,
                                          const Meshd__V1__PlanTransferRequest *rq, int timeout_ms,
                                          direct_rc_t *rc, direct_err_t *e, bool again) {
  ProtobufCMessage *rep = NULL;
  rpc_status_t st;
  memset(&st, 0, sizeof st);
  st.code = rpc_unary(s->ch, TS "PlanTransfer", &rq->base,
                      &meshd__v1__plan_transfer_reply__descriptor, &rep, s->md, s->nmd,
                      timeout_ms, &st);
  if (st.code == GRPC_STATUS_OK && rep) {
    if (d)
      d->offered = true;
    test_pause(again);
    return (Meshd__V1__PlanTransferReply *)rep;
  }
  if (rep)
    protobuf_c_message_free_unpacked(rep, NULL);
  st.kind[sizeof st.kind - 1] = '\0';
  st.message[sizeof st.message - 1] = '\0';
  bool not_offered = st.code == GRPC_STATUS_UNIMPLEMENTED ||
                     (st.code == GRPC_STATUS_FAILED_PRECONDITION && strstr(st.message, "--data-path"));
  if (d && d->mode == MESHD_DATA_PATH_AUTO && not_offered) {
    d->refused = true;
    fallback(d, "the server refused PlanTransfer: %s", st.message);
    *rc = DIRECT_PROXY;
    return NULL;
  }
  if (st.code == GRPC_STATUS_OK) {
    st.code = GRPC_STATUS_INTERNAL;
    snprintf(st.message, sizeof st.message, "OK status without a reply");
  }
  direct_err_status(e, &st, "");
  *rc = DIRECT_FAILED;
  return NULL;
}

/* Channels for every shard (DIRECT_DONE), or DIRECT_PROXY / DIRECT_FAILED when
 * one does not connect (`what` says "upload" or "fetch") by `end`. A session
 * over TLS keeps its bytes encrypted: when the plan says the agents speak
 * plaintext, auto takes the proxy (and remembers it) and direct fails. */
static direct_rc_t shard_channels(direct_t *d, const direct_session_t *s,
                                  const Meshd__V1__PlanTransferReply *p, rpc_channel_t **out,
                                  const char *what, int64_t end, direct_err_t *e) {
  if (s->tls && !*plan_ca(p)) {
    if (d->mode == MESHD_DATA_PATH_DIRECT) { /* never the tensor's bytes unencrypted */
      direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                     "direct %s: the session is over TLS and the plan's agents speak "
                     "plaintext: the tensor's bytes would travel unencrypted; use the auto "
                     "data path (which takes the proxy then) or the proxy", what);
      return DIRECT_FAILED;
    }
    d->agents_plain = true;
    fallback(d, "the session is over TLS and the agents are reached in plaintext");
    return DIRECT_PROXY;
  }
  for (size_t i = 0; i < p->n_shards; i++) {
    if (direct_host_port(p->shards[i]->address))
      continue;
    if (d->mode == MESHD_DATA_PATH_DIRECT) {
      direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                     "direct %s: the plan names '%.200s' as the agent of rank %u, not host:port; "
                     "refusing to dial it; use the auto or proxy data path",
                     what, p->shards[i]->address, p->shards[i]->rank);
      return DIRECT_FAILED;
    }
    fallback(d, "direct %s: the plan names '%.200s' as the agent of rank %u, not host:port", what,
             p->shards[i]->address, p->shards[i]->rank);
    return DIRECT_PROXY;
  }
  for (size_t i = 0; i < p->n_shards; i++) {
    int wait = left_ms(end);
    bool cut = wait < DIRECT_CONNECT_MS; /* the caller's deadline, not the agent's fault */
    out[i] = agent_channel(d, p->shards[i]->address, plan_ca(p), plan_name(p),
                           cut ? wait : DIRECT_CONNECT_MS);
    if (out[i])
      continue;
    /* The deadline only if it passed: an attempt that failed at once (refused, a
     * failed handshake) with time left is the agent's failure (auto falls back). */
    if (cut && left_ms(end) <= 10) {
      direct_err_set(e, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                     "direct %s: no connection to rank %u's agent at %s before the deadline",
                     what, p->shards[i]->rank, p->shards[i]->address);
      return DIRECT_FAILED;
    }
    if (d->mode == MESHD_DATA_PATH_DIRECT) {
      direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                     "direct %s: rank %u's agent at %s does not answer within %d ms; use the "
                     "auto or proxy data path from outside the cluster",
                     what, p->shards[i]->rank, p->shards[i]->address, DIRECT_CONNECT_MS);
      return DIRECT_FAILED;
    }
    d->off_until = rpc_now_ms() + DIRECT_RETRY_MS;
    fallback(d, "direct %s: rank %u's agent at %s does not answer within %d ms", what,
             p->shards[i]->rank, p->shards[i]->address, DIRECT_CONNECT_MS);
    return DIRECT_PROXY;
  }
  return DIRECT_DONE;
}

bool direct_host_port(const char *a) {
  const char *colon = a ? strrchr(a, ':') : NULL;
  if (!colon || colon == a) return false;
  size_t digits = strspn(colon + 1, "0123456789");
  if (digits < 1 || digits > 5 || colon[1 + digits] != '\0') return false;
  if (a[0] == '[') { /* [v6]:port, an optional %zone inside */
    if (colon[-1] != ']' || colon - a <= 2) return false;
    size_t in = (size_t)(colon - a - 2), addr = strspn(a + 1, "0123456789abcdefABCDEF:.");
    if (addr == 0) return false;
    if (addr == in) return true;
    static const char zone[] =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-";
    return a[1 + addr] == '%' && addr + 1 < in && strspn(a + 2 + addr, zone) == in - addr - 1;
  }
  size_t n = (size_t)(colon - a);
  if (strspn(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_") != n)
    return false;
  /* A host named as one of gRPC's target schemes reads as that scheme
   * ("unix:123" is the socket file 123). */
  static const char *const schemes[] = {"unix", "unix-abstract", "ipv4", "ipv6", "dns",
                                        "vsock", "xds", "google-c2p"};
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++)
    if (strlen(schemes[i]) == n && strncasecmp(a, schemes[i], n) == 0) return false;
  return true;
}

/* The grant as rpc_md_t wants a -bin value: hex. Caller frees. */
static char *grant_hex(const ProtobufCBinaryData *g) {
  static const char hex[] = "0123456789abcdef";
  char *out = malloc(2 * g->len + 1);
  if (!out)
    return NULL;
  for (size_t i = 0; i < g->len; i++) {
    out[2 * i] = hex[g->data[i] >> 4];
    out[2 * i + 1] = hex[g->data[i] & 15];
  }
  out[2 * g->len] = '\0';
  return out;
}

/* An agent's refusal of a Read or Write because its table of the grants it
 * took (--max-transfer-nonces, each kept until its start-by time) is full
 * (agent/transfer_grant.c): RESOURCE_EXHAUSTED before any byte moved, told
 * from its other QUOTA refusals ("Reads already wait for seqs", out of memory
 * or threads, a tensor past its capacity) by its words; and what the client
 * says of it. */
#define NONCES_FULL_REFUSAL "grants are in use on this agent already"
#define NONCES_FULL_SAY "has too many direct transfers in flight"

/* A shard call's failure, naming the rank and its agent. */
static void shard_error(direct_err_t *e, const char *what, const Meshd__V1__ShardGrant *sh,
                        const rpc_status_t *st) {
  char prefix[320];
  snprintf(prefix, sizeof prefix, "direct %s, rank %u (agent %s): ", what, sh->rank, sh->address);
  if (st->code == GRPC_STATUS_RESOURCE_EXHAUSTED && strstr(st->message, NONCES_FULL_REFUSAL)) {
    direct_err_set(e, MESHD_E_RPC, st->code, st->kind,
                   "%sthe agent " NONCES_FULL_SAY " (its --max-transfer-nonces table is full: "
                   "%.300s); retry later, or use the proxy data path (auto takes it then)",
                   prefix, st->message);
    return;
  }
  direct_err_status(e, st, prefix);
}

/* Whether e is a Read or Write refused for its agent's full grant table
 * (shard_error's words): nothing moved, and the proxy would take it. */
static bool nonces_full(const direct_err_t *e) {
  return e->err == MESHD_E_RPC && e->code == GRPC_STATUS_RESOURCE_EXHAUSTED &&
         strstr(e->msg, NONCES_FULL_SAY) != NULL;
}

/* ------------------------------------------------------------------ upload */

typedef struct {
  const Meshd__V1__PlanTransferReply *p;
  rpc_channel_t **chans;
  const uint8_t *data;
  size_t each;     /* bytes per shard */
  bool per_rank;   /* shard i gets the i-th slice, else all of data */
  int timeout_ms;
  Meshd__V1__WriteReceipt *receipts;
  uint8_t (*macs)[64];
  bool *ok;
  direct_err_t *errs;
  rpc_hold_t *hold; /* the messages that reference data */
  /* The shards' streams while they run (under mu): the first shard to fail
   * cancels the others, so that the upload ends on its error, not at the
   * deadline of a shard still writing; `first` is its index (SIZE_MAX: none). */
  pthread_mutex_t mu;
  rpc_stream_t **streams;
  size_t first;
} upload_t;

/* Shard i's stream runs (s) or ended (NULL, failed: it did not finish with a
 * receipt). The first failure cancels every other shard still running. */
static void upload_track(upload_t *u, size_t i, rpc_stream_t *s, bool failed) {
  pthread_mutex_lock(&u->mu);
  u->streams[i] = NULL;
  if (s && u->first != SIZE_MAX)
    rpc_stream_cancel(s); /* another shard failed already: this one is not needed */
  else if (s)
    u->streams[i] = s;
  if (failed && u->first == SIZE_MAX) {
    u->first = i;
    for (size_t j = 0; j < u->p->n_shards; j++)
      if (u->streams[j])
        rpc_stream_cancel(u->streams[j]);
  }
  pthread_mutex_unlock(&u->mu);
}

/* Shard i's WriteReply r: its receipt, kept for FinishUpload. false (the
 * shard's error set) when it is not one a server could check. */
static bool take_receipt(upload_t *u, size_t i, const Meshd__Agent__V1__WriteReply *r) {
  const Meshd__V1__ShardGrant *sh = u->p->shards[i];
  size_t len = r->receipt.len;
  if (len > sizeof u->macs[i]) { /* not one the server could check: not passed on cut */
    direct_err_set(&u->errs[i], MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "direct upload, rank %u: the agent's receipt is %zu bytes, more than the "
                   "%zu a receipt has",
                   sh->rank, len, sizeof u->macs[i]);
    u->ok[i] = false;
    return false;
  }
  memcpy(u->macs[i], r->receipt.data, len);
  meshd__v1__write_receipt__init(&u->receipts[i]);
  u->receipts[i].rank = sh->rank;
  u->receipts[i].bytes = r->bytes;
  u->receipts[i].receipt.data = u->macs[i];
  u->receipts[i].receipt.len = len;
  u->ok[i] = true;
  return true;
}

/* How shard i's Write ended (st: its status, unless OK), once it ended. */
static void write_ended(upload_t *u, size_t i, const rpc_status_t *st) {
  const Meshd__V1__ShardGrant *sh = u->p->shards[i];
  if (st && st->code != GRPC_STATUS_OK) {
    u->ok[i] = false;
    if (u->errs[i].err == MESHD_E_OK)
      shard_error(&u->errs[i], "upload", sh, st);
  } else if (!u->ok[i] && u->errs[i].err == MESHD_E_OK) {
    direct_err_set(&u->errs[i], MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "direct upload, rank %u (agent %s): the agent sent no WriteReply", sh->rank,
                   sh->address);
  }
}

typedef struct {
  upload_t *u;
  size_t i;
} shard_ref_t;

/* rpc_unary_raw's stop: another shard failed, this one is not needed. */
static bool other_failed(void *arg) {
  const shard_ref_t *r = arg;
  pthread_mutex_lock(&r->u->mu);
  bool stop = r->u->first != SIZE_MAX && r->u->first != r->i;
  pthread_mutex_unlock(&r->u->mu);
  return stop;
}

/* A shard of one message (WRITE_CHUNK at most): the Write as one batch, its
 * data, half-close and answer together, as a unary call is on the wire; a
 * stream's open, write, close, read and status were each waited for in turn
 * (the open alone, before the first byte went: 0.2-0.3 ms median of a 1 MiB
 * upload's ~2 on this loaded 2-core machine). Another shard's failure ends it
 * within rpc_unary_raw's look at stop (100 ms), where a stream's was
 * cancelled at once. */
static void write_one(upload_t *u, size_t i, const uint8_t *part, rpc_md_t *md) {
  rpc_bytes_t *m =
      rpc_bytes_field_ref(MESHD__AGENT__V1__DATA_CHUNK__PART_DATA, part, u->each, u->hold);
  if (!m) {
    direct_err_set(&u->errs[i], MESHD_E_NOMEM, 0, NULL, "direct upload: out of memory");
    upload_track(u, i, NULL, true);
    return;
  }
  rpc_status_t st;
  memset(&st, 0, sizeof st);
  ProtobufCMessage *rep = NULL;
  shard_ref_t me = {u, i};
  grpc_status_code code = rpc_unary_raw(u->chans[i], AGENT "Write", m,
                                        &meshd__agent__v1__write_reply__descriptor, &rep, md, 1,
                                        u->timeout_ms, other_failed, &me, &st);
  rpc_bytes_free(m); /* gRPC's own references go through u->hold */
  st.code = code;
  st.kind[sizeof st.kind - 1] = '\0';
  st.message[sizeof st.message - 1] = '\0';
  if (code == GRPC_STATUS_OK && rep)
    take_receipt(u, i, (const Meshd__Agent__V1__WriteReply *)rep);
  if (rep)
    protobuf_c_message_free_unpacked(rep, NULL);
  write_ended(u, i, &st);
  upload_track(u, i, NULL, !u->ok[i]);
}

static void write_shard(void *arg, size_t i) {
  upload_t *u = arg;
  const Meshd__V1__ShardGrant *sh = u->p->shards[i];
  const uint8_t *part = u->data + (u->per_rank ? i * u->each : 0);
  rpc_status_t st;
  memset(&st, 0, sizeof st);
  char *g = grant_hex(&sh->grant);
  if (!g) {
    direct_err_set(&u->errs[i], MESHD_E_NOMEM, 0, NULL, "direct upload: out of memory");
    return;
  }
  rpc_md_t md = {GRANT_MD, g};
  if (u->each > 0 && u->each <= WRITE_CHUNK) {
    write_one(u, i, part, &md);
    free(g);
    return;
  }
  rpc_stream_t *s = rpc_stream_open(u->chans[i], AGENT "Write", &md, 1, u->timeout_ms);
  if (s)
    upload_track(u, i, s, false);
  int rc = s ? 0 : -1;
  for (size_t off = 0; rc == 0 && off < u->each; off += WRITE_CHUNK) {
    size_t n = u->each - off < WRITE_CHUNK ? u->each - off : WRITE_CHUNK;
    /* No copy: the message references the caller's bytes (u->hold counts it
     * until gRPC lets go; direct_upload waits for that before it returns). */
    rpc_bytes_t *m =
        rpc_bytes_field_ref(MESHD__AGENT__V1__DATA_CHUNK__PART_DATA, part + off, n, u->hold);
    if (!m) {
      direct_err_set(&u->errs[i], MESHD_E_NOMEM, 0, NULL, "direct upload: out of memory");
      rpc_stream_cancel(s);
      break;
    }
    rc = rpc_stream_write_raw(s, m);
    rpc_bytes_free(m);
  }
  if (s && rc == 0)
    rpc_stream_close_send(s);
  ProtobufCMessage *m = NULL;
  while (s && rpc_stream_read(s, &meshd__agent__v1__write_reply__descriptor, &m, u->timeout_ms) == 1) {
    bool kept = take_receipt(u, i, (const Meshd__Agent__V1__WriteReply *)m);
    protobuf_c_message_free_unpacked(m, NULL);
    m = NULL;
    if (!kept)
      break;
  }
  if (!s) {
    direct_err_set(&u->errs[i], MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "direct upload, rank %u: cannot open Agent/Write", sh->rank);
  } else if (rpc_stream_finish(s, &st) != GRPC_STATUS_OK) {
    st.kind[sizeof st.kind - 1] = '\0';
    st.message[sizeof st.message - 1] = '\0';
    write_ended(u, i, &st);
  } else {
    write_ended(u, i, NULL);
  }
  upload_track(u, i, NULL, !u->ok[i]);
  rpc_stream_destroy(s);
  free(g);
}

/* FinishUpload with n receipts, within timeout_ms. Returns 0 or -1 with st;
 * *defined (may be NULL): the answer carries the tensor. */
static int finish_call(const direct_session_t *s, uint64_t id, Meshd__V1__WriteReceipt **r,
                       size_t n, int timeout_ms, rpc_status_t *st, bool *defined) {
  Meshd__V1__FinishUploadRequest fin = MESHD__V1__FINISH_UPLOAD_REQUEST__INIT;
  fin.transfer_id = id;
  fin.receipts = r;
  fin.n_receipts = n;
  ProtobufCMessage *rep = NULL;
  memset(st, 0, sizeof *st);
  grpc_status_code code = rpc_unary(s->ch, TS "FinishUpload", &fin.base,
                                    &meshd__v1__finish_upload_reply__descriptor, &rep, s->md,
                                    s->nmd, timeout_ms, st);
  if (defined)
    *defined = code == GRPC_STATUS_OK && rep &&
               ((const Meshd__V1__FinishUploadReply *)rep)->tensor;
  if (rep)
    protobuf_c_message_free_unpacked(rep, NULL);
  st->kind[sizeof st->kind - 1] = '\0';
  st->message[sizeof st->message - 1] = '\0';
  return code == GRPC_STATUS_OK ? 0 : -1;
}

/* What is left of the upload's deadline `end`, but at least UNDO_MIN_MS: a
 * cleanup call that frees the session's slot now, even past the deadline. */
#define UNDO_MIN_MS 1000
int direct_cleanup_ms(int64_t end) {
  int left = left_ms(end);
  return left < UNDO_MIN_MS ? UNDO_MIN_MS : left;
}

/* FinishUpload without receipts: the server undoes the upload at once. Returns
 * whether it answered with the tensor instead: an earlier FinishUpload whose
 * answer was lost had defined it. */
static bool abandon_upload(const direct_session_t *s, uint64_t id, int64_t end) {
  rpc_status_t st;
  bool defined = false;
  finish_call(s, id, NULL, 0, direct_cleanup_ms(end), &st, &defined);
  return defined;
}

/* FinishUpload with every shard's receipt, by the upload's deadline `end`.
 * Returns 0, or -1 with st. No answer (the deadline passed, the connection
 * dropped) does not mean it failed: the server may have defined the tensor
 * and its answer been lost. So it is asked once more (the server answers a
 * finished upload's FinishUpload again, and finishes one it had not), lest the
 * caller be told of a failure while the tensor stands. Still no answer: the
 * transfer is abandoned (the calls may not have reached the server, which
 * would keep the slot) and st is the first failure; *defined: the abandon's
 * answer says the tensor stands all the same, for the caller to drop. */
static int finish_upload(const direct_session_t *s, uint64_t id, Meshd__V1__WriteReceipt **r,
                         size_t n, int64_t end, rpc_status_t *st, bool *defined) {
  if (finish_call(s, id, r, n, left_ms(end), st, NULL) == 0)
    return 0;
  if (st->code != GRPC_STATUS_DEADLINE_EXCEEDED && st->code != GRPC_STATUS_UNAVAILABLE)
    return -1;
  rpc_status_t again;
  if (finish_call(s, id, r, n, direct_cleanup_ms(end), &again, NULL) == 0)
    return 0;
  if (again.code != GRPC_STATUS_DEADLINE_EXCEEDED && again.code != GRPC_STATUS_UNAVAILABLE) {
    *st = again; /* failed, or undone: why */
    return -1;
  }
  *defined = abandon_upload(s, id, end);
  return -1;
}

/* Appends the ranks of v, n of them, to b as "a, b, c". */
static void ranks_text(char *b, size_t len, const uint32_t *v, size_t n, bool shards,
                       const Meshd__V1__PlanTransferReply *p) {
  size_t at = 0;
  b[0] = '\0';
  for (size_t i = 0; i < n && at < len; i++) {
    int k = snprintf(b + at, len - at, "%s%u", i ? ", " : "", shards ? p->shards[i]->rank : v[i]);
    if (k < 0)
      break;
    at += (size_t)k;
  }
}

#define DIRECT_MAX_SHARDS 65536

static int by_rank(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x > y) - (x < y);
}

void direct_plan_mismatch(const Meshd__V1__PlanTransferReply *p, bool per_rank, size_t bytes,
                          size_t slice, const uint32_t *mesh_ranks, size_t n_mesh_ranks, char *why,
                          size_t len) {
  size_t n = p->n_shards;
  char got[256], want[256];
  why[0] = '\0';
  if (n == 0) {
    snprintf(why, len, "names no shard");
    return;
  }
  if (n > DIRECT_MAX_SHARDS) { /* (a mesh has at most --max-agents ranks) */
    snprintf(why, len, "names %zu shards, more than any mesh's %d ranks", n, DIRECT_MAX_SHARDS);
    return;
  }
  ranks_text(got, sizeof got, NULL, n, true, p);
  uint32_t *sorted = malloc(n * sizeof *sorted);
  if (!sorted) {
    snprintf(why, len, "could not be checked (out of memory)");
    return;
  }
  for (size_t i = 0; i < n; i++) sorted[i] = p->shards[i]->rank;
  qsort(sorted, n, sizeof *sorted, by_rank);
  bool twice = false;
  for (size_t i = 1; i < n && !twice; i++) twice = sorted[i] == sorted[i - 1];
  free(sorted);
  if (twice) {
    snprintf(why, len, "names a rank twice (ranks %s)", got);
    return;
  }
  if (mesh_ranks && n_mesh_ranks) {
    bool same = n == n_mesh_ranks;
    for (size_t i = 0; same && i < n; i++)
      same = p->shards[i]->rank == mesh_ranks[i];
    if (!same) {
      ranks_text(want, sizeof want, mesh_ranks, n_mesh_ranks, false, NULL);
      snprintf(why, len, "names ranks %s where the mesh has ranks %s", got, want);
      return;
    }
  }
  if (per_rank && ((bytes / n) * n != bytes || (slice && bytes / n != slice)))
    snprintf(why, len, "has %zu shards for %zu bytes of per-rank rows (%zu a rank)", n, bytes,
             slice);
}

direct_rc_t direct_upload(direct_t *d, const direct_session_t *s, const Meshd__V1__UploadHeader *h,
                          const uint8_t *data, size_t bytes, bool *ref_spent, bool *defined,
                          direct_err_t *e) {
  *ref_spent = *defined = false;
  if (!wanted(d, s))
    return DIRECT_PROXY;
  Meshd__V1__PlanTransferRequest rq = MESHD__V1__PLAN_TRANSFER_REQUEST__INIT;
  rq.what_case = MESHD__V1__PLAN_TRANSFER_REQUEST__WHAT_UPLOAD;
  rq.upload = (Meshd__V1__UploadHeader *)h;
  direct_rc_t rc = DIRECT_FAILED;
  int64_t end = rpc_now_ms() + s->timeout_ms; /* one deadline for the plan, writes and finish */
  Meshd__V1__PlanTransferReply *p = plan(d, s, &rq, s->timeout_ms, &rc, e, s->replan);
  if (!p) {
    /* No answer is no refusal: the server claims the ref once it can answer the
     * plan, and an answer lost on the way (a deadline, a dropped connection)
     * leaves it claimed; kept, it would be REF_REUSED to every later command. */
    if (rc == DIRECT_FAILED && (e->err == MESHD_E_DEADLINE || !e->kind[0]))
      *ref_spent = true;
    return rc;
  }
  *ref_spent = true;
  size_t n = p->n_shards;
  upload_t u = {.p = p, .data = data, .per_rank = h->per_rank};
  u.each = h->per_rank && n ? bytes / n : bytes;
  u.chans = calloc(n ? n : 1, sizeof *u.chans);
  u.receipts = calloc(n ? n : 1, sizeof *u.receipts);
  u.macs = calloc(n ? n : 1, sizeof *u.macs);
  u.ok = calloc(n ? n : 1, sizeof *u.ok);
  u.errs = calloc(n ? n : 1, sizeof *u.errs);
  u.streams = calloc(n ? n : 1, sizeof *u.streams);
  u.first = SIZE_MAX;
  pthread_mutex_init(&u.mu, NULL);
  Meshd__V1__WriteReceipt **done = calloc(n ? n : 1, sizeof *done);
  u.hold = rpc_hold_create();
  rpc_status_t st;
  if (!u.chans || !u.receipts || !u.macs || !u.ok || !u.errs || !u.streams || !done || !u.hold) {
    direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "direct upload: out of memory");
    abandon_upload(s, p->transfer_id, end);
    rc = DIRECT_FAILED;
    goto out;
  }
  char why[640];
  size_t slice = h->per_rank ? direct_dtype_bytes(h->dtype) : 0; /* a rank's bytes, 0: unknown */
  for (size_t i = 0; i < h->n_shape && slice; i++)
    slice = h->shape[i] > 0 && slice <= SIZE_MAX / (size_t)h->shape[i]
                ? slice * (size_t)h->shape[i]
                : 0;
  direct_plan_mismatch(p, h->per_rank, bytes, slice, s->mesh_ranks, s->n_mesh_ranks, why, sizeof why);
  if (why[0]) { /* before any dial: no byte goes to a rank not its own */
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "direct upload: the plan %s; no byte was sent", why);
    abandon_upload(s, p->transfer_id, end);
    rc = DIRECT_FAILED;
    goto out;
  }
  rc = shard_channels(d, s, p, u.chans, "upload", end, e);
  if (rc != DIRECT_DONE) {
    abandon_upload(s, p->transfer_id, end); /* undone at once; the slot is free */
    goto out;
  }
  u.timeout_ms = left_ms(end);
  if (direct_parallel(n, write_shard, &u) != 0) {
    direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "direct upload: cannot start a thread per shard");
    rc = DIRECT_FAILED;
  }
  size_t nd = 0;
  for (size_t i = 0; i < n; i++) {
    if (u.ok[i])
      done[nd++] = &u.receipts[i];
    else if (rc == DIRECT_DONE) {
      *e = u.errs[u.first < n ? u.first : i]; /* the cause, not a shard it stopped */
      rc = DIRECT_FAILED;
    }
  }
  if (rc != DIRECT_DONE) {
    abandon_upload(s, p->transfer_id, end); /* so that the server undoes the rest now */
    late_say(e); /* the caller plans once more (direct_late_grant) */
    if (d->mode == MESHD_DATA_PATH_AUTO && nonces_full(e)) { /* this upload only */
      fallback(d, "%s", e->msg);
      rc = DIRECT_PROXY;
    }
  } else if (finish_upload(s, p->transfer_id, done, nd, end, &st, defined) != 0) {
    direct_err_status(e, &st, "");
    rc = DIRECT_FAILED;
  }
  if (rc == DIRECT_DONE)
    d->stats.direct_uploads++;
out:
  /* Not before gRPC let go of every message that references data: the caller
   * may free it once we return. A connection whose peer stopped reading holds
   * them until it closes: close it. */
  if (u.hold && !rpc_hold_wait(u.hold, HOLD_WAIT_MS)) {
    for (size_t i = 0; u.chans && i < n; i++)
      drop_channel(d, u.chans[i]);
    rpc_hold_wait(u.hold, -1);
  }
  rpc_hold_release(u.hold);
  free(u.chans);
  free(u.receipts);
  free(u.macs);
  free(u.ok);
  free(u.errs);
  free(u.streams);
  pthread_mutex_destroy(&u.mu);
  free(done);
  protobuf_c_message_free_unpacked(&p->base, NULL);
  return rc;
}

/* ------------------------------------------------------------------ fetch */

/* A Read's proof that it took its snapshot (DataChunk.read_receipt): handed
 * to FinishFetch, the server sends its agent no DropSnapshot. */
typedef struct {
  uint8_t mac[32];
  bool have;
} direct_receipt_t;

typedef struct {
  const direct_session_t *s;
  Meshd__V1__PlanTransferReply **plans;
  rpc_channel_t **chans;
  const direct_sink_t *sinks;
  const Meshd__V1__FetchRequest *const *reqs;
  uint64_t *want; /* bytes each part must get */
  uint64_t *got;  /* bytes each part got so far (the pull thread's) */
  direct_receipt_t *receipts; /* each part's Read receipt, for its FinishFetch */
  int64_t end;    /* the deadline, rpc_now_ms */
  int timeout_ms; /* what was left of it when the reads started */
  direct_err_t *errs;
  /* FinishFetch sent as soon as the Read's receipt came (finish_early):
   * early[i] for part i, its outcome in early_st[i]; early_of[k]: the part of
   * the k-th one (the reads' pull n + k). NULL: none sent so. */
  size_t n;
  bool *early, *early_answered;
  rpc_status_t *early_st;
  size_t *early_of, nearly;
  Meshd__V1__FinishFetchRequest *early_rq;
} fetch_t;

/* Whether shard i may take len more bytes after got; false having set its
 * error. */
static bool shard_fits(fetch_t *f, size_t i, uint64_t got, size_t len) {
  if (got + len <= f->want[i]) return true;
  const Meshd__V1__ShardGrant *sh = f->plans[i]->shards[0];
  direct_err_set(&f->errs[i], MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                 "direct fetch, rank %u (agent %s): more bytes than the TensorMeta's %llu",
                 sh->rank, sh->address, (unsigned long long)f->want[i]);
  return false;
}

/* One piece of a data chunk, as rpc_bytes_field_visit hands it, to the sink. */
typedef struct {
  const direct_sink_t *k;
  direct_err_t *e;
} sink_piece_t;

static int sink_piece(const uint8_t *p, size_t n, void *arg) {
  sink_piece_t *sp = arg;
  return sp->k->data(sp->k->arg, p, n, sp->e);
}

int direct_sink_field(const direct_sink_t *k, rpc_bytes_t *msg, direct_err_t *e) {
  return rpc_bytes_field_visit(msg, sink_piece, &(sink_piece_t){k, e});
}

static void finish_fetch_request(Meshd__V1__FinishFetchRequest *fin, uint64_t id,
                                 const direct_receipt_t *r);

/* A Read of at most this many bytes has its FinishFetch sent with its receipt
 * (finish_early): the rest of it is a few ms on the wire here, about the time
 * a revocation's RevokeGrants takes to reach its agent, which a larger Read
 * would still run into (the server revokes the grants of transfers not
 * finished yet). */
#define EARLY_FINISH_MAX (4u << 20)

/* Part i's Read sent its receipt (in its first message): it took its
 * snapshot, with the value good on its rank, and lets go of the snapshot
 * itself however it ends, so its FinishFetch need not wait for the Read's end;
 * it goes now, on the reads' pull thread beside the rest of the Read (that
 * FinishFetch's round trip came after the Read: ~0.25 ms of a 1 MiB fetch's
 * ~1.8). Its outcome counts as the one sent at the end did (a failure on
 * another rank fails the fetch; a Read that fails after its receipt still
 * fails it, its own error first). */
static void finish_early(fetch_t *f, size_t i) {
  if (!f->early || f->early[i] || i >= f->n || f->want[i] > EARLY_FINISH_MAX)
    return;
  finish_fetch_request(&f->early_rq[i], f->plans[i]->transfer_id, &f->receipts[i]);
  direct_call_t c = {f->s->ch, TS "FinishFetch", &f->early_rq[i].base, f->s->md, f->s->nmd};
  f->early_of[f->nearly++] = i; /* (recorded first: its answer is handed on by this thread) */
  f->early[i] = true;
  if (pull_add(&c) == SIZE_MAX) { /* no room, or it could not start: sent at the end */
    f->early[i] = false;
    f->nearly--;
  }
}

/* A message of an early FinishFetch (pull n + k): its answer, unpacked to be sure. */
static int early_msg(fetch_t *f, size_t k, rpc_bytes_t *raw) {
  size_t i = f->early_of[k];
  ProtobufCMessage *rep = rpc_bytes_unpack(raw, &meshd__v1__finish_fetch_reply__descriptor);
  if (!rep || f->early_answered[i]) { /* not one FinishFetchReply: no unary answer */
    if (rep)
      protobuf_c_message_free_unpacked(rep, NULL);
    return -1;
  }
  protobuf_c_message_free_unpacked(rep, NULL);
  f->early_answered[i] = true;
  return 0;
}

static void early_end(fetch_t *f, size_t k, grpc_status_code code, const rpc_status_t *st) {
  size_t i = f->early_of[k];
  rpc_status_t *out = &f->early_st[i];
  *out = *st;
  out->code = code;
  out->kind[sizeof out->kind - 1] = '\0';
  out->message[sizeof out->message - 1] = '\0';
  if (code == GRPC_STATUS_OK && !f->early_answered[i]) {
    out->code = GRPC_STATUS_INTERNAL;
    out->kind[0] = '\0';
    snprintf(out->message, sizeof out->message, "OK status without a valid %s",
             meshd__v1__finish_fetch_reply__descriptor.name);
  }
}

/* A message of shard i's Agent/Read: a data chunk's bytes go to the sink from
 * where they lie in the message, the one copy; anything else (the spec) is
 * unpacked. Non-zero stops the shard. */
static int shard_msg(void *arg, size_t i, rpc_bytes_t *raw) {
  fetch_t *f = arg;
  if (f->early && i >= f->n)
    return early_msg(f, i - f->n, raw);
  const Meshd__V1__ShardGrant *sh = f->plans[i]->shards[0];
  const direct_sink_t *k = &f->sinks[i];
  direct_err_t *e = &f->errs[i];
  size_t len = 0;
  int rc = 0;
  if (rpc_bytes_is_field(raw, MESHD__AGENT__V1__DATA_CHUNK__PART_DATA, &len)) {
    rc = shard_fits(f, i, f->got[i], len) ? 0 : -1;
    if (rc == 0 && len) rc = direct_sink_field(k, raw, e);
    f->got[i] += len;
    return rc;
  }
  Meshd__Agent__V1__DataChunk *c =
      (void *)rpc_bytes_unpack(raw, &meshd__agent__v1__data_chunk__descriptor);
  if (!c) {
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "direct fetch, rank %u (agent %s): a message that is not a DataChunk",
                   sh->rank, sh->address);
    return -1;
  }
  if (c->part_case == MESHD__AGENT__V1__DATA_CHUNK__PART_DATA && c->data.len) {
    rc = shard_fits(f, i, f->got[i], c->data.len) ? 0 : -1;
    if (rc == 0) rc = k->data(k->arg, c->data.data, c->data.len, e);
    f->got[i] += c->data.len;
  }
  direct_receipt_t *r = f->receipts ? &f->receipts[i] : NULL;
  if (r && c->read_receipt.len == sizeof r->mac) {
    memcpy(r->mac, c->read_receipt.data, sizeof r->mac);
    r->have = true;
    finish_early(f, i);
  }
  protobuf_c_message_free_unpacked(&c->base, NULL);
  return rc;
}

/* How shard i's Agent/Read ended; the first error of the shard stands. */
static void shard_end(void *arg, size_t i, grpc_status_code code, const rpc_status_t *st) {
  fetch_t *f = arg;
  if (f->early && i >= f->n) {
    early_end(f, i - f->n, code, st);
    return;
  }
  const Meshd__V1__ShardGrant *sh = f->plans[i]->shards[0];
  direct_err_t *e = &f->errs[i];
  if (e->err != MESHD_E_OK)
    return;
  if (code == GRPC_STATUS_DEADLINE_EXCEEDED)
    direct_err_set(e, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                   "direct fetch, rank %u (agent %s): no answer within %d ms", sh->rank,
                   sh->address, f->timeout_ms);
  else if (code != GRPC_STATUS_OK)
    shard_error(e, "fetch", sh, st);
  else if (f->got[i] != f->want[i])
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "direct fetch, rank %u (agent %s): got %llu bytes where the TensorMeta needs "
                   "%llu", sh->rank, sh->address, (unsigned long long)f->got[i],
                   (unsigned long long)f->want[i]);
}

/* Whether shard i's Read was refused only because its agent already has its
 * most Reads waiting for their seqs (QUOTA, agent/data.c READ_WAITING_MAX):
 * nothing was read and the grant stays good, so it is tried again. */
static bool reads_full(const fetch_t *f, size_t i) {
  const direct_err_t *e = &f->errs[i];
  return e->err != MESHD_E_OK && e->code == GRPC_STATUS_RESOURCE_EXHAUSTED && f->got[i] == 0 &&
         strstr(e->msg, "Reads already wait for seqs") != NULL;
}

/* The shards read again: their index among the fetch's. */
typedef struct {
  fetch_t *f;
  const size_t *idx;
} again_t;

static int again_msg(void *arg, size_t i, rpc_bytes_t *raw) {
  const again_t *a = arg;
  return shard_msg(a->f, a->idx[i], raw);
}

static void again_end(void *arg, size_t i, grpc_status_code code, const rpc_status_t *st) {
  const again_t *a = arg;
  shard_end(a->f, a->idx[i], code, st);
}

/* The Reads of calls refused because their agent has its most Reads waiting,
 * again until they are not or the deadline: waiting 5 ms, doubling to 200 ms
 * (as the Python client's _reads_full); the waiting Reads end as their seqs
 * run. Past the deadline that refusal stays the shard's error. */
static void read_again(fetch_t *f, size_t n, const direct_call_t *calls) {
  direct_call_t *sub = calloc(n, sizeof *sub);
  size_t *idx = calloc(n, sizeof *idx);
  if (!sub || !idx) {
    free(sub);
    free(idx);
    return;
  }
  for (int wait = 5;; wait = wait >= 100 ? 200 : 2 * wait) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
      if (reads_full(f, i))
        idx[m++] = i;
    if (!m || f->end - rpc_now_ms() <= wait)
      break;
    struct timespec ts = {0, (long)wait * 1000000L};
    nanosleep(&ts, NULL);
    for (size_t k = 0; k < m; k++) {
      memset(&f->errs[idx[k]], 0, sizeof f->errs[idx[k]]);
      sub[k] = calls[idx[k]];
    }
    direct_pull_all(m, sub, left_ms(f->end), again_msg, again_end, &(again_t){f, idx});
  }
  free(sub);
  free(idx);
}

/* Part i's Agent/Read under its plan's grant: *call, with its request, metadata
 * and grant (hex, malloc'd: the caller frees it) in the caller's storage.
 * false out of memory. */
static bool read_call(const fetch_t *f, size_t i, Meshd__Agent__V1__ReadRequest *rq,
                      rpc_md_t *md, char **grant, direct_call_t *call) {
  const Meshd__V1__ShardGrant *sh = f->plans[i]->shards[0];
  if (!(*grant = grant_hex(&sh->grant)))
    return false;
  *md = (rpc_md_t){GRANT_MD, *grant};
  meshd__agent__v1__read_request__init(rq);
  rq->session_id = (char *)f->s->id;
  rq->ref = f->reqs[i]->ref;
  rq->max_chunk_bytes = READ_CHUNK;
  rq->after_seq = sh->after_seq;
  *call = (direct_call_t){f->chans[i], AGENT "Read", &rq->base, md, 1};
  return true;
}

/* Every shard's Agent/Read at once, each under its grant. */
static void read_shards(fetch_t *f, size_t n) {
  direct_call_t *calls = calloc(n, sizeof *calls);
  Meshd__Agent__V1__ReadRequest *rqs = calloc(n, sizeof *rqs);
  rpc_md_t *md = calloc(n, sizeof *md);
  char **grants = calloc(n, sizeof *grants);
  bool ok = calls && rqs && md && grants;
  for (size_t i = 0; ok && i < n; i++)
    ok = read_call(f, i, &rqs[i], &md[i], &grants[i], &calls[i]);
  f->timeout_ms = left_ms(f->end);
  if (ok) {
    pull_all(n, f->early ? n : 0, calls, f->timeout_ms, shard_msg, shard_end, f);
    read_again(f, n, calls);
  } else
    for (size_t i = 0; i < n; i++)
      direct_err_set(&f->errs[i], MESHD_E_NOMEM, 0, NULL, "direct fetch: out of memory");
  for (size_t i = 0; grants && i < n; i++)
    free(grants[i]);
  free(grants);
  free(md);
  free(rqs);
  free(calls);
}

/* The FinishFetch request of transfer id, with the Read's receipt r if it has one. */
static void finish_fetch_request(Meshd__V1__FinishFetchRequest *fin, uint64_t id,
                                 const direct_receipt_t *r) {
  meshd__v1__finish_fetch_request__init(fin);
  fin->transfer_id = id;
  if (r && r->have) {
    fin->read_receipt.data = (uint8_t *)r->mac;
    fin->read_receipt.len = sizeof r->mac;
  }
}

/* FinishFetch (r: the Read's receipt, or NULL): 0, or -1 with st (the tensor
 * failed on some rank, ...). */
static int finish_fetch(const direct_session_t *s, uint64_t id, const direct_receipt_t *r,
                        int timeout_ms, rpc_status_t *st) {
  Meshd__V1__FinishFetchRequest fin;
  finish_fetch_request(&fin, id, r);
  ProtobufCMessage *rep = NULL;
  memset(st, 0, sizeof *st);
  grpc_status_code code = rpc_unary(s->ch, TS "FinishFetch", &fin.base,
                                    &meshd__v1__finish_fetch_reply__descriptor, &rep, s->md,
                                    s->nmd, timeout_ms, st);
  if (rep)
    protobuf_c_message_free_unpacked(rep, NULL);
  st->kind[sizeof st->kind - 1] = '\0';
  st->message[sizeof st->message - 1] = '\0';
  return code == GRPC_STATUS_OK ? 0 : -1;
}

bool direct_meta_bytes(const Meshd__V1__TensorMeta *m, uint64_t *out) {
  uint64_t n = direct_dtype_bytes(m->dtype);
  for (size_t i = 0; i < m->n_shape; i++) {
    uint64_t d = m->shape[i] > 0 ? (uint64_t)m->shape[i] : 0;
    if (d && n > UINT64_MAX / d)
      return false;
    n *= d;
  }
  *out = n;
  return true;
}

/* *rq, the PlanTransferRequest of a FetchRequest (it points to fr). */
static const Meshd__V1__PlanTransferRequest *fetch_plan_request(Meshd__V1__PlanTransferRequest *rq,
                                                              const Meshd__V1__FetchRequest *fr) {
  meshd__v1__plan_transfer_request__init(rq);
  rq->what_case = MESHD__V1__PLAN_TRANSFER_REQUEST__WHAT_FETCH;
  rq->fetch = (Meshd__V1__FetchRequest *)fr;
  return rq;
}

/* Unary calls read as pulls (on the wire a unary answer is a stream of one
 * message): all at once on the library's pull thread (direct_pull_all), no
 * thread each. */
typedef struct {
  const ProtobufCMessageDescriptor *desc;
  ProtobufCMessage **reps; /* each call's answer, unpacked; NULL: none */
  rpc_status_t *sts;
} unary_all_t;

static int unary_msg(void *arg, size_t i, rpc_bytes_t *m) {
  unary_all_t *u = arg;
  if (u->reps[i]) /* a second message: no unary answer */
    return -1;
  u->reps[i] = rpc_bytes_unpack(m, u->desc);
  return u->reps[i] ? 0 : -1;
}

static void unary_end(void *arg, size_t i, grpc_status_code code, const rpc_status_t *st) {
  unary_all_t *u = arg;
  u->sts[i] = *st;
  u->sts[i].code = code;
  u->sts[i].kind[sizeof u->sts[i].kind - 1] = '\0';
  u->sts[i].message[sizeof u->sts[i].message - 1] = '\0';
  if (code == GRPC_STATUS_OK && !u->reps[i]) {
    u->sts[i].code = GRPC_STATUS_INTERNAL;
    u->sts[i].kind[0] = '\0';
    snprintf(u->sts[i].message, sizeof u->sts[i].message, "OK status without a valid %s",
             u->desc->name);
  }
  if (u->sts[i].code != GRPC_STATUS_OK && u->reps[i]) {
    protobuf_c_message_free_unpacked(u->reps[i], NULL);
    u->reps[i] = NULL;
  }
}

/* The plans of the fetch's parts reqs[0..n), at once, by `end`: plans[i], or
 * NULL with errs[i]. No direct_t: auto's fallback was settled by this fetch's
 * or an earlier plan; a refusal now is this fetch's error. -1 out of memory. */
static int plans_at_once(const direct_session_t *s, const Meshd__V1__FetchRequest *const *reqs,
                         size_t n, int64_t end, Meshd__V1__PlanTransferReply **plans,
                         direct_err_t *errs) {
  if (n == 1) { /* on this thread: no hand-over from the pull thread */
    Meshd__V1__PlanTransferRequest rq;
    direct_rc_t rc;
    plans[0] = plan(NULL, s, fetch_plan_request(&rq, reqs[0]), left_ms(end), &rc, &errs[0], false);
    return 0;
  }
  Meshd__V1__PlanTransferRequest *rqs = calloc(n, sizeof *rqs);
  direct_call_t *calls = calloc(n, sizeof *calls);
  rpc_status_t *sts = calloc(n, sizeof *sts);
  int rc = rqs && calls && sts ? 0 : -1;
  for (size_t i = 0; rc == 0 && i < n; i++)
    calls[i] = (direct_call_t){s->ch, TS "PlanTransfer", &fetch_plan_request(&rqs[i], reqs[i])->base,
                               s->md, s->nmd};
  if (rc == 0) {
    direct_pull_all(n, calls, left_ms(end), unary_msg, unary_end,
                    &(unary_all_t){&meshd__v1__plan_transfer_reply__descriptor,
                                   (ProtobufCMessage **)plans, sts});
    bool answered = false;
    for (size_t i = 0; i < n; i++) {
      answered = answered || plans[i];
      if (!plans[i])
        direct_err_status(&errs[i], &sts[i], "");
    }
    if (answered)
      test_pause(false); /* as plan() after its answer */
  }
  free(sts);
  free(calls);
  free(rqs);
  return rc;
}

/* The FinishFetch of every part planned (plans[i] not NULL), at once, each
 * within timeout_ms: failed[i] with sts[i] when one failed. -1 out of memory
 * (none was sent). */
static int finishes_at_once(const direct_session_t *s, Meshd__V1__PlanTransferReply **plans,
                            const direct_receipt_t *receipts, size_t n, int timeout_ms,
                            rpc_status_t *sts, bool *failed) {
  Meshd__V1__FinishFetchRequest *rqs = calloc(n, sizeof *rqs);
  direct_call_t *calls = calloc(n, sizeof *calls);
  rpc_status_t *got = calloc(n, sizeof *got);
  ProtobufCMessage **reps = calloc(n, sizeof *reps);
  size_t *idx = calloc(n, sizeof *idx);
  if (!rqs || !calls || !got || !reps || !idx) {
    free(rqs);
    free(calls);
    free(got);
    free(reps);
    free(idx);
    return -1;
  }
  size_t m = 0;
  for (size_t i = 0; i < n; i++) {
    if (!plans[i])
      continue;
    const direct_receipt_t *r = receipts ? &receipts[i] : NULL;
    if (n == 1) { /* on this thread: no hand-over from the pull thread */
      failed[i] = finish_fetch(s, plans[i]->transfer_id, r, timeout_ms, &sts[i]) != 0;
      break;
    }
    finish_fetch_request(&rqs[m], plans[i]->transfer_id, r);
    calls[m] = (direct_call_t){s->ch, TS "FinishFetch", &rqs[m].base, s->md, s->nmd};
    idx[m++] = i;
  }
  if (m)
    direct_pull_all(m, calls, timeout_ms, unary_msg, unary_end,
                    &(unary_all_t){&meshd__v1__finish_fetch_reply__descriptor, reps, got});
  for (size_t k = 0; k < m; k++) {
    failed[idx[k]] = got[k].code != GRPC_STATUS_OK;
    sts[idx[k]] = got[k];
    if (reps[k])
      protobuf_c_message_free_unpacked(reps[k], NULL);
  }
  free(rqs);
  free(calls);
  free(got);
  free(reps);
  free(idx);
  return 0;
}

/* The parts whose Read the agent refused only because it started past its
 * grant's start-by time (this process was paused between plan and Read:
 * nothing was read) are planned once more, their old plans given back, and
 * read again by the deadline: only while no command was sent on the session
 * since the first plan (seq: its next seq then), since a new plan snapshots
 * the tensor where its stream is now. A late refusal that stays says so
 * (late_say). */
static void replan_late(direct_t *d, fetch_t *f, size_t n, uint64_t seq) {
  const direct_session_t *s = f->s;
  size_t *idx = calloc(n, sizeof *idx);
  direct_call_t *calls = calloc(n, sizeof *calls);
  Meshd__Agent__V1__ReadRequest *rqs = calloc(n, sizeof *rqs);
  rpc_md_t *md = calloc(n, sizeof *md);
  char **grants = calloc(n, sizeof *grants);
  size_t m = 0;
  bool same = !s->next_seq || *s->next_seq == seq;
  for (size_t i = 0; idx && calls && rqs && md && grants && same && i < n; i++) {
    if (!late_refusal(&f->errs[i]) || f->got[i] != 0 || f->end - rpc_now_ms() <= 0)
      continue;
    rpc_status_t st;
    finish_fetch(s, f->plans[i]->transfer_id, NULL, ABANDON_MS, &st); /* its slot, now */
    protobuf_c_message_free_unpacked(&f->plans[i]->base, NULL);
    Meshd__V1__PlanTransferRequest rq;
    direct_rc_t rc = DIRECT_FAILED;
    direct_err_t e = {0};
    f->plans[i] = plan(NULL, s, fetch_plan_request(&rq, f->reqs[i]), left_ms(f->end), &rc, &e,
                       true);
    const Meshd__V1__PlanTransferReply *p = f->plans[i];
    uint64_t want = 0;
    if (!p) {
      f->errs[i] = e;
      continue;
    }
    if (p->n_shards != 1 || !p->meta || !direct_meta_bytes(p->meta, &want) ||
        want != f->want[i]) { /* (its sink began with the first plan's meta) */
      direct_err_set(&f->errs[i], MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                     "direct fetch: planned again after a late grant, the plan names another "
                     "tensor (%zu shards, %llu bytes where the first plan had %llu)",
                     p->n_shards, (unsigned long long)want, (unsigned long long)f->want[i]);
      continue;
    }
    if (shard_channels(d, s, p, &f->chans[i], "fetch", f->end, &e) != DIRECT_DONE) {
      if (e.err == MESHD_E_OK) /* (auto's fallback: too late for the proxy, its sink began) */
        direct_err_set(&e, MESHD_E_RPC, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                       "direct fetch, planned again after a late grant: %s",
                       d->stats.last_fallback);
      f->errs[i] = e;
      continue;
    }
    if (!read_call(f, i, &rqs[m], &md[m], &grants[m], &calls[m]))
      continue; /* (the late refusal stays its error) */
    memset(&f->errs[i], 0, sizeof f->errs[i]);
    idx[m++] = i;
  }
  if (m)
    direct_pull_all(m, calls, left_ms(f->end), again_msg, again_end, &(again_t){f, idx});
  for (size_t i = 0; i < n; i++)
    late_say(&f->errs[i]);
  for (size_t k = 0; grants && k < m; k++)
    free(grants[k]);
  free(grants);
  free(md);
  free(rqs);
  free(calls);
  free(idx);
}

/* Whether every part of the fetch that failed was refused only for its
 * agent's full grant table, nothing of it read (*first: the first such part):
 * the proxy fetches them all again, the sinks beginning anew. */
static bool fetch_nonces_full(const fetch_t *f, size_t n, size_t *first) {
  *first = SIZE_MAX;
  for (size_t i = 0; i < n; i++) {
    if (f->errs[i].err == MESHD_E_OK)
      continue;
    if (!nonces_full(&f->errs[i]) || f->got[i] != 0)
      return false;
    if (*first == SIZE_MAX)
      *first = i;
  }
  return *first != SIZE_MAX;
}

direct_rc_t direct_fetch(direct_t *d, const direct_session_t *s,
                         const Meshd__V1__FetchRequest *const *reqs, const direct_sink_t *sinks,
                         size_t n, int64_t end, direct_err_t *e) {
  if (!wanted(d, s))
    return DIRECT_PROXY;
  fetch_t f = {.s = s, .sinks = sinks, .reqs = reqs, .end = end, .n = n};
  f.plans = calloc(n, sizeof *f.plans);
  f.chans = calloc(n, sizeof *f.chans);
  f.want = calloc(n, sizeof *f.want);
  f.got = calloc(n, sizeof *f.got);
  f.errs = calloc(n, sizeof *f.errs);
  f.receipts = calloc(n, sizeof *f.receipts); /* none: every snapshot is dropped, as before */
  f.early = calloc(n, sizeof *f.early);
  f.early_answered = calloc(n, sizeof *f.early_answered);
  f.early_st = calloc(n, sizeof *f.early_st);
  f.early_of = calloc(n, sizeof *f.early_of);
  f.early_rq = calloc(n, sizeof *f.early_rq);
  if (!f.receipts || !f.early || !f.early_answered || !f.early_st || !f.early_of || !f.early_rq) {
    free(f.early); /* none: each FinishFetch goes at the end, as before */
    f.early = NULL;
  }
  direct_rc_t rc = DIRECT_DONE;
  if (!f.plans || !f.chans || !f.want || !f.got || !f.errs) {
    direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "direct fetch: out of memory");
    rc = DIRECT_FAILED;
    goto out;
  }
  /* Auto's first plan of the session goes alone: it learns there whether the
   * server offers PlanTransfer at all (a lone part is planned here too). Then
   * the rest at once, and once auto knows (or with the direct path, where a
   * refusal is the fetch's error either way) every plan at once: each is
   * ordered at the server after every command sent before this fetch and
   * before any sent after it (the caller waits for all), so the values they
   * read are the same as when planned one after another, and n plans cost
   * about one round trip, not two. */
  uint64_t seq = s->next_seq ? *s->next_seq : 0; /* (see replan_late) */
  size_t first = 0;
  if (n == 1 || (d->mode == MESHD_DATA_PATH_AUTO && !d->offered)) {
    Meshd__V1__PlanTransferRequest rq0;
    f.plans[0] = plan(d, s, fetch_plan_request(&rq0, reqs[0]), left_ms(end), &rc, e, false);
    if (!f.plans[0])
      goto out;
    first = 1;
  }
  if (n > first) {
    if (plans_at_once(s, reqs + first, n - first, end, f.plans + first, f.errs + first) != 0) {
      direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "direct fetch: out of memory");
      rc = DIRECT_FAILED;
      goto out;
    }
    for (size_t i = first; i < n && rc == DIRECT_DONE; i++)
      if (!f.plans[i]) {
        *e = f.errs[i]; /* plans_at_once's */
        rc = DIRECT_FAILED;
      }
    memset(f.errs, 0, n * sizeof *f.errs);
    if (rc != DIRECT_DONE)
      goto out;
  }
  for (size_t i = 0; i < n; i++) {
    const Meshd__V1__PlanTransferReply *p = f.plans[i];
    if (p->n_shards != 1 || !p->meta) {
      direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                     "direct fetch: the plan names %zu shards%s (expected 1 and a TensorMeta)",
                     p->n_shards, p->meta ? "" : " and no TensorMeta");
      rc = DIRECT_FAILED;
      goto out;
    }
  }
  for (size_t i = 0; i < n; i++) {
    rc = shard_channels(d, s, f.plans[i], &f.chans[i], "fetch", end, e);
    if (rc != DIRECT_DONE)
      goto out;
  }
  for (size_t i = 0; i < n; i++) {
    const Meshd__V1__TensorMeta *m = f.plans[i]->meta;
    if (!direct_meta_bytes(m, &f.want[i])) {
      direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                     "direct fetch: the plan's shape holds more than 2^64 bytes");
      rc = DIRECT_FAILED;
      goto out;
    }
    if (f.want[i] == 0 && m->n_shape > 0 && direct_dtype_bytes(m->dtype) == 0) {
      direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                     "direct fetch: unsupported dtype %d", m->dtype);
      rc = DIRECT_FAILED;
      goto out;
    }
    if (sinks[i].begin(sinks[i].arg, m, e) != 0) {
      rc = DIRECT_FAILED;
      goto out;
    }
  }
  read_shards(&f, n);
  replan_late(d, &f, n, seq);
  size_t full = 0;
  if (d->mode == MESHD_DATA_PATH_AUTO && fetch_nonces_full(&f, n, &full)) {
    fallback(d, "%s", f.errs[full].msg); /* this fetch only; its plans are finished below */
    rc = DIRECT_PROXY;
    goto out;
  }
  for (size_t i = 0; i < n && rc == DIRECT_DONE; i++)
    if (f.errs[i].err != MESHD_E_OK) {
      *e = f.errs[i];
      rc = DIRECT_FAILED;
    }
out:
  /* Every planned fetch is finished, whatever happened: its snapshot and the
   * session's transfer slot go. One abandoned need not wait for the ranks: the
   * server takes the transfer when the call arrives. All at once, as planned. */
  if (f.plans) {
    rpc_status_t *sts = calloc(n, sizeof *sts);
    bool *failed = calloc(n, sizeof *failed);
    /* The parts not finished early (finish_early): their outcome is the early one's. */
    Meshd__V1__PlanTransferReply **rest = calloc(n, sizeof *rest);
    for (size_t i = 0; rest && i < n; i++)
      rest[i] = f.early && f.early[i] ? NULL : f.plans[i];
    int wait = rc == DIRECT_DONE ? left_ms(end) : ABANDON_MS;
    if (sts && failed && rest && finishes_at_once(s, rest, f.receipts, n, wait, sts, failed) == 0) {
      for (size_t i = 0; f.early && i < n; i++)
        if (f.early[i]) {
          sts[i] = f.early_st[i];
          failed[i] = sts[i].code != GRPC_STATUS_OK;
        }
      for (size_t i = 0; i < n && rc == DIRECT_DONE; i++)
        if (failed[i]) {
          direct_err_status(e, &sts[i], "");
          rc = DIRECT_FAILED;
        }
    } else {
      for (size_t i = 0; i < n; i++) /* no memory for more: one after another */
        if (f.early && f.early[i]) {
          if (f.early_st[i].code != GRPC_STATUS_OK && rc == DIRECT_DONE) {
            direct_err_status(e, &f.early_st[i], "");
            rc = DIRECT_FAILED;
          }
        } else if (f.plans[i]) {
          rpc_status_t st;
          int wait = rc == DIRECT_DONE ? left_ms(end) : ABANDON_MS;
          const direct_receipt_t *r = f.receipts ? &f.receipts[i] : NULL;
          if (finish_fetch(s, f.plans[i]->transfer_id, r, wait, &st) != 0 && rc == DIRECT_DONE) {
            direct_err_status(e, &st, "");
            rc = DIRECT_FAILED;
          }
        }
    }
    free(rest);
    free(sts);
    free(failed);
    for (size_t i = 0; i < n; i++)
      if (f.plans[i])
        protobuf_c_message_free_unpacked(&f.plans[i]->base, NULL);
  }
  if (rc == DIRECT_DONE)
    d->stats.direct_fetches += n;
  free(f.plans);
  free(f.chans);
  free(f.want);
  free(f.got);
  free(f.errs);
  free(f.receipts);
  free(f.early);
  free(f.early_answered);
  free(f.early_st);
  free(f.early_of);
  free(f.early_rq);
  return rc;
}
