#include "data_service.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth.h"
#include "commands.h"
#include "fault.h"
#include "grant.h"
#include "log.h"
#include "metrics.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "objects.h"
#include "runtime.h"
#include "session_service.h"

/* Upload and Fetch call the agents on the pool's data channels
 * (agent_pool_data): one per agent, with its TLS and call secret. */

struct data_service {
  agent_pool_t *pool;
  session_table_t *sessions;
  size_t chunk; /* bytes of data per message, well under the limit */
  int max_transfers; /* per session, Upload and Fetch calls together (1..DATA_TRANSFERS_MAX) */
  int max_relays;     /* over all sessions, Upload and Fetch calls (0: no bound) */
  _Atomic int relays; /* those calls in flight, on_start to on_end */
  /* Uploads and Fetches not yet freed: their relays' last steps run on the
   * rpc layer's client thread after their calls ended, and
   * data_service_destroy waits for them. */
  pthread_mutex_t mu;
  pthread_cond_t idle;
  int live;

  data_path_t path;  /* which of Upload/Fetch and PlanTransfer are served */
  int64_t grant_ms;  /* a direct transfer's grants live this long */
  int64_t grant_start_ms; /* and their calls start within this */
  /* Direct transfers planned and not finished (under mu), and the thread
   * that expires them. */
  struct transfer *pending;
  pthread_t sweeper;
  bool sweeping, stop;
  pthread_cond_t wake;
  pthread_cond_t settled; /* a busy transfer is not any more */
  /* Fetches planned while their session's slots were all taken
   * (FetchRequest.wait_for_slot), oldest first, under mu: proxied Fetches, and
   * direct fetches whose grant request is held (plan_fetch_grant). The sweeper
   * starts or answers each once a slot frees (queue_run); a slot given back
   * wakes it (kick). */
  struct fetch *queued, **queued_tail;
  _Atomic int nqueued;
  bool kick;
  /* Read grants of direct fetches that left the table without their Read's
   * receipt, until their expiry (open_grant_t), under mu. */
  struct open_grant *open_grants;
  uint64_t open_grant_ids; /* the last open grant's id (under mu) */
  fault_t *fault; /* --server-fault; NULL: none */
  auth_t *auth;   /* the tokens (FinishUpload's pin); NULL: none */
  /* meshd_transfer_bytes_total{direction, path}; NULL: not counted. */
  metrics_series_t *bytes[2][2];
};

enum { DIR_UPLOAD, DIR_FETCH };
enum { PATH_PROXY, PATH_DIRECT };

static void count_bytes(data_service_t *ds, int dir, int path, size_t n) {
  if (n) metrics_series_inc(ds->bytes[dir][path], (double)n);
}

void data_service_set_metrics(data_service_t *ds, metrics_registry_t *m) {
  metrics_define(m, "meshd_transfer_bytes_total", METRIC_COUNTER,
                 "Tensor bytes moved by Upload and Fetch, through the server (proxy) or "
                 "straight to the agents (direct).");
  static const char *const dirs[] = {"upload", "fetch"}, *const paths[] = {"proxy", "direct"};
  for (int d = 0; d < 2; d++)
    for (int p = 0; p < 2; p++)
      ds->bytes[d][p] = metrics_series(
          m, "meshd_transfer_bytes_total",
          (const char *[]){"direction", dirs[d], "path", paths[p], NULL});
}

static void live_add(data_service_t *ds) {
  pthread_mutex_lock(&ds->mu);
  ds->live++;
  pthread_mutex_unlock(&ds->mu);
}

static void live_done(data_service_t *ds) {
  pthread_mutex_lock(&ds->mu);
  if (--ds->live == 0) pthread_cond_broadcast(&ds->idle);
  pthread_mutex_unlock(&ds->mu);
}

/* The agents' TensorSpec of ref with meta: an Upload's Writes and a direct
 * transfer's grants. sp points into meta. */
static void tensor_spec_of(Meshd__Agent__V1__TensorSpec *sp, uint64_t ref,
                           const tensor_meta_t *meta) {
  *sp = (Meshd__Agent__V1__TensorSpec)MESHD__AGENT__V1__TENSOR_SPEC__INIT;
  sp->ref = ref;
  sp->n_shape = sp->n_strides = (size_t)meta->layout.ndim;
  sp->shape = (int64_t *)meta->layout.sizes;
  sp->strides = (int64_t *)meta->layout.strides;
  sp->dtype = (Meshd__V1__DType)meta->dtype;
}

static void destroy_objects(void *p) { objects_destroy(p); }

static objects_t *objects_of(session_t *s) {
  if (!s->objects) session_set_objects(s, objects_create(), destroy_objects);
  return s->objects;
}

/* Why an agent call of a transfer failed, for the client: what the agent said
 * when it answered with an error (its kind set), else that the connection to
 * it broke, which is how a dead or cut-off agent shows. */
static const char *agent_failure(const rpc_status_t *st, char *buf, size_t n) {
  if (st->kind[0] || st->code != GRPC_STATUS_UNAVAILABLE) return st->message;
  snprintf(buf, n, "the connection to its agent broke (%s): the agent died or cannot be "
           "reached", st->message[0] ? st->message : "no status");
  return buf;
}

/* The deadline of a relay's call to an agent: its client's (a second later,
 * so that the client sees its own), none when the client set none: the
 * client's call ends the relay (upload_end, fetch_end cancel it) and an agent
 * that dies breaks its connection. (A fixed 10 min ended a slow client's
 * Upload or Fetch then, DEADLINE_EXCEEDED with kind AGENT_LOST.) */
static int relay_call_ms(rpc_call_t *call) {
  int64_t left = rpc_call_deadline_left_ms(call);
  if (left < 0) return 0;
  return left > INT_MAX - 1000 ? INT_MAX : (int)left + 1000;
}

/* The kind of an agent's failed call: the one in its meshd-error-kind
 * trailer, else QUOTA for RESOURCE_EXHAUSTED and AGENT_LOST for the rest. */
static error_kind_t agent_kind(const rpc_status_t *st, grpc_status_code code) {
#define XX(name, value, c) \
  if (strcmp(st->kind, #name) == 0 && ERR_##name != ERR_NONE) return ERR_##name;
  ERROR_KIND_MAP(XX)
#undef XX
  return code == GRPC_STATUS_RESOURCE_EXHAUSTED ? ERR_QUOTA : ERR_AGENT_LOST;
}

static void finish_error(rpc_call_t *call, const meshd_error_t *e) {
  rpc_call_finish(call, error_kind_code(e->kind), error_kind_name(e->kind), "%s", e->msg);
}

/* Adds one to *n unless it holds `most` already (most <= 0: no bound); the
 * count before in *before. A compare-and-swap, not an add taken back when
 * full: a full count never shows one over its bound, so a begin racing the
 * sweeper's retries (queue_run, every tick) and an end is not refused for it. */
static bool count_take(_Atomic int *n, int most, int *before) {
  int cur = atomic_load(n);
  do {
    *before = cur;
    if (most > 0 && cur >= most) return false;
  } while (!atomic_compare_exchange_weak(n, &cur, cur + 1));
  return true;
}

/* A session's Upload and Fetch calls in flight, from on_start to on_end, are
 * at most --session-max-transfers: each holds server memory (a tensor for an
 * Upload, a few chunks for a Fetch) and agent resources. */
static int transfer_begin(data_service_t *ds, session_t *s, const char *method, meshd_error_t *e) {
  int before;
  if (count_take(&s->transfers, ds->max_transfers, &before)) return 0;
  return error_set(e, ERR_QUOTA,
                   "%s: the session has %d Upload and Fetch calls in flight already, the most "
                   "--session-max-transfers (%d) allows; wait for one to end (read each Fetch "
                   "to its end) before starting another", method, before, ds->max_transfers);
}

/* Wakes the sweeper now (queue_run), not at its next tick. */
static void kick(data_service_t *ds) {
  pthread_mutex_lock(&ds->mu);
  ds->kick = true;
  pthread_cond_broadcast(&ds->wake);
  pthread_mutex_unlock(&ds->mu);
}

/* The slot given back: a proxied Fetch waiting for one may start. */
static void transfer_end(data_service_t *ds, session_t *s) {
  atomic_fetch_sub(&s->transfers, 1);
  if (atomic_load(&ds->nqueued) > 0) kick(ds);
}

/* A fetch planned without a slot (wait_for_slot) keeps its Snapshot unread on
 * its agent until it gets one: with the fetches holding slots, a session's
 * unread snapshots stay within what an agent keeps (DATA_TRANSFERS_MAX; more
 * would fail the oldest there). Returns 0, or -1 with the slots' error in e
 * (it names --session-max-transfers: a client waits and tries again). */
static int wait_begin(data_service_t *ds, session_t *s, const char *method, meshd_error_t *e) {
  int most = ds->sweeping ? DATA_TRANSFERS_MAX - ds->max_transfers : 0; /* 0: none may wait */
  int before = atomic_load(&s->fetches_waiting);
  if (most > 0 && count_take(&s->fetches_waiting, most, &before)) return 0;
  return error_set(e, ERR_QUOTA,
                   "%s: the session has --session-max-transfers (%d) Upload and Fetch calls in "
                   "flight and %d planned fetches waiting for a slot, the most its agents keep "
                   "unread (%d in all); wait for one to end before starting another", method,
                   ds->max_transfers, before, DATA_TRANSFERS_MAX);
}

static void wait_end(session_t *s) { atomic_fetch_sub(&s->fetches_waiting, 1); }

/* A fetch's slot; or, with wait_for_slot and every slot taken, a place among
 * the session's fetches that wait for one (*waits): it is planned now all the
 * same, so that its value is fixed where its client's stream is, and only its
 * bytes wait. */
static int fetch_slot_begin(data_service_t *ds, session_t *s, const char *method,
                            const Meshd__V1__FetchRequest *rq, bool *waits, meshd_error_t *e) {
  *waits = false;
  if (transfer_begin(ds, s, method, e) == 0) return 0;
  if (!rq->wait_for_slot || wait_begin(ds, s, method, e)) return -1;
  *waits = true;
  return 0;
}

/* The server's Upload and Fetch calls in flight, over every session, are at
 * most --max-relayed-transfers: what they queue is the server's memory. */
static int relay_begin(data_service_t *ds, const char *method, meshd_error_t *e) {
  int before;
  if (count_take(&ds->relays, ds->max_relays, &before)) return 0;
  return error_set(e, ERR_QUOTA,
                   "%s: the server relays %d Upload and Fetch calls already, the most "
                   "--max-relayed-transfers (%d) allows; retry in a moment, or use the direct "
                   "data path", method, before, ds->max_relays);
}

static void relay_end(data_service_t *ds) { atomic_fetch_sub(&ds->relays, 1); }


/* ------------------------------------------------------------------ upload */

/* An Upload is relayed without a thread of its own, as a Fetch is. Once its
 * header is checked, an Agent/Write opens to every rank of the mesh (an
 * rpc_duplex: its events come on the rpc layer's client thread), and each
 * client chunk becomes a message on the queue of every rank it is for
 * (per_rank: the slice each rank gets; else every rank). A rank has one send
 * in flight; its end starts the next. Messages queued or in flight are at most
 * UPLOAD_QUEUED bytes: past that the call's reads pause (HTTP/2 flow control
 * then holds the client back) until the sends drained half. So the server
 * holds a few chunks, never the tensor, and receiving and forwarding overlap.
 * Once the client half-closed with every byte, each rank half-closes when its
 * queue is empty and the agent answers. A rank is defined only when its Write
 * got exactly its bytes; any failure cancels the other Writes and deletes the
 * ref on every rank: it stays undefined, and spent once Writes opened
 * (spend_locked). The last Write to end settles the Upload and answers the
 * client. */
#define UPLOAD_QUEUED (8u << 20)
/* What a queued message costs beyond its bytes (its entry, gRPC's buffer):
 * counted against UPLOAD_QUEUED, so that a client sending 1-byte chunks
 * cannot queue millions of them. */
#define QUEUED_MSG_COST 512u

typedef struct queued_msg {
  struct queued_msg *next;
  rpc_bytes_t *msg;
  size_t len; /* what it counts in u->queued: its bytes and QUEUED_MSG_COST */
} queued_msg_t;

/* One rank's Agent/Write. */
typedef struct rank_write {
  struct upload *u;
  uint32_t rank;
  agent_data_t *data;
  rpc_duplex_t *d;
  queued_msg_t *head, *tail;
  size_t in_flight; /* bytes of the send in flight */
  bool sending;
  bool closed; /* half-closed after every byte */
  bool ended;  /* the call is over: ok if the agent took exactly its bytes */
  bool ok;
} rank_write_t;

typedef struct upload {
  data_service_t *ds;
  session_t *session;
  rpc_call_t *call;
  bool have_header, failed; /* touched by the call's callbacks only */
  bool reserved;             /* its ref (session_reserve_ref; under the session's mu) */
  uint64_t ref, mesh, stream;
  tensor_meta_t meta;
  bool per_rank;
  uint32_t *ranks;
  size_t nranks;
  size_t each, total, got; /* bytes per rank, expected, received */
  _Atomic int owners;       /* the call (until on_end), and the relay until it settled */

  pthread_mutex_t mu; /* what follows: the call's callbacks and the Writes' events */
  rank_write_t *w;    /* nranks of them once the relay started; NULL before */
  size_t open;        /* Writes not ended */
  size_t queued;      /* bytes queued and in flight, every rank's */
  bool paused;        /* the call's reads are paused for a full queue */
  bool received;      /* the client half-closed with every byte sent */
  bool aborted;       /* a failure, or the call ended: the Writes are cancelled */
  bool answered;      /* the call has its error already: settling adds none */
  _Atomic bool given_back; /* its slot and relay (transfer_end, relay_end) */
  meshd_error_t err;  /* the first failure of a Write, ERR_NONE if none */
} upload_t;

static void queue_free(rank_write_t *w) {
  while (w->head) {
    queued_msg_t *q = w->head;
    w->head = q->next;
    rpc_bytes_free(q->msg);
    free(q);
  }
  w->tail = NULL;
}

/* The session's slot and the server's relay, given back once: before the
 * client's answer (it may start its next transfer on it), or at on_end. */
static void upload_give_back(upload_t *u) {
  if (atomic_exchange(&u->given_back, true)) return;
  transfer_end(u->ds, u->session);
  relay_end(u->ds);
}

static void upload_release(upload_t *u) {
  if (atomic_fetch_sub(&u->owners, 1) != 1) return;
  data_service_t *ds = u->ds;
  session_release(u->session);
  for (size_t i = 0; u->w && i < u->nranks; i++) queue_free(&u->w[i]);
  free(u->w);
  pthread_mutex_destroy(&u->mu);
  free(u->ranks);
  free(u);
  live_done(ds);
}

/* Cancels every Write still running (lock held); their ends settle it. */
static void upload_abort_locked(upload_t *u) {
  if (u->aborted) return;
  u->aborted = true;
  for (size_t i = 0; u->w && i < u->nranks; i++)
    if (!u->w[i].ended && u->w[i].d) rpc_duplex_cancel(u->w[i].d);
}

static void upload_abort(upload_t *u) {
  pthread_mutex_lock(&u->mu);
  upload_abort_locked(u);
  pthread_mutex_unlock(&u->mu);
}

/* An Upload that fails once its Writes opened spends its ref: a rank may have
 * defined it, the undo (DeleteRefs) runs in its stream's order, and a retry's
 * Write defines at once, so a retry under the same ref could be deleted by the
 * undo. Claimed when the client is told (or the call ends), before any retry
 * can come; e (may be NULL) says so. Holds s->mu. */
static void spend_locked(session_t *s, uint64_t ref, meshd_error_t *e) {
  if (atomic_load(&s->closed) || session_check_ref(s, ref, NULL) != 0 ||
      session_claim_ref(s, ref, NULL) != 0 || !e || e->kind == ERR_NONE)
    return;
  size_t len = strlen(e->msg);
  snprintf(e->msg + len, sizeof e->msg - len, " (ref %llu is spent: upload again under a later ref)",
           (unsigned long long)ref);
}

/* The Upload no longer holds its ref reserved (it settled, or it is spent).
 * Holds s->mu. */
static void unreserve_locked(upload_t *u) {
  if (!u->reserved) return;
  session_unreserve_ref(u->session, u->ref);
  u->reserved = false;
}

static void upload_spend(upload_t *u, meshd_error_t *e) {
  if (!u->w) return; /* no Write opened: nothing defined anywhere, the ref stays free */
  pthread_mutex_lock(&u->session->mu);
  unreserve_locked(u);
  spend_locked(u->session, u->ref, e);
  pthread_mutex_unlock(&u->session->mu);
}

static void upload_fail(upload_t *u, error_kind_t kind, const char *fmt, const char *arg) {
  meshd_error_t e;
  error_set(&e, kind, fmt, arg);
  upload_spend(u, &e);
  u->failed = true;
  pthread_mutex_lock(&u->mu);
  u->answered = true;
  upload_abort_locked(u);
  pthread_mutex_unlock(&u->mu);
  upload_give_back(u);
  finish_error(u->call, &e);
}

/* --data-path=direct: the bytes never pass through the server. */
static bool proxy_refused(data_service_t *ds, rpc_call_t *call, const char *method) {
  if (ds->path != DATA_PATH_DIRECT) return false;
  rpc_call_finish(call, GRPC_STATUS_FAILED_PRECONDITION, NULL,
                  "%s: the server's --data-path is direct: move the bytes with PlanTransfer "
                  "(the Python, C and Node clients do with their data path auto or direct)", method);
  return true;
}

static void upload_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  data_service_t *ds = arg;
  if (proxy_refused(ds, call, "Upload")) return;
  session_t *s = session_from_call(ds->sessions, call);
  if (!s) return;
  meshd_error_t e;
  if (transfer_begin(ds, s, "Upload", &e)) {
    session_release(s);
    finish_error(call, &e);
    return;
  }
  if (relay_begin(ds, "Upload", &e)) {
    transfer_end(ds, s);
    session_release(s);
    finish_error(call, &e);
    return;
  }
  upload_t *u = calloc(1, sizeof *u);
  if (!u) {
    relay_end(ds);
    transfer_end(ds, s);
    session_release(s);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "Upload: out of memory");
    return;
  }
  live_add(ds);
  u->ds = ds;
  u->session = s;
  u->call = call;
  pthread_mutex_init(&u->mu, NULL);
  atomic_init(&u->owners, 1);
  rpc_call_set_data(call, u);
}

/* Whether the session can hold `each` more bytes on each of nranks ranks:
 * its quota, and 2^64 bytes in all (a wrapped sum would slip under the
 * quota). 0, or -1 with QUOTA; `when` ends the quota's message. Holds s->mu. */
static int quota_check(session_t *s, objects_t *o, size_t each, size_t nranks, const char *what,
                       const char *when, meshd_error_t *e) {
  uint64_t add, total;
  if (__builtin_mul_overflow((uint64_t)each, (uint64_t)nranks, &add) ||
      __builtin_add_overflow(o->bytes, add, &total))
    return error_set(e, ERR_QUOTA, "%s: the tensor needs %zu bytes on each of %zu ranks, more "
                     "than the session can hold (2^64 bytes in all); use a smaller shape", what,
                     each, nranks);
  if (s->quota_bytes && total > s->quota_bytes)
    return error_set(e, ERR_QUOTA, "%s: the tensor needs %llu bytes across its mesh, but the "
                     "session holds %llu of its %llu-byte quota%s; drop tensors you no longer "
                     "need", what, (unsigned long long)add, (unsigned long long)o->bytes,
                     (unsigned long long)s->quota_bytes, when);
  return 0;
}

/* Every check of the header, under the session lock; nothing changes. */
static int upload_header(upload_t *u, const Meshd__V1__UploadHeader *h, meshd_error_t *e) {
  session_t *s = u->session;
  int rc = -1;
  pthread_mutex_lock(&s->mu);
  objects_t *o = objects_of(s);
  obj_t *m = NULL;
  if (atomic_load(&s->closed)) { /* its EndSession went: nothing may open it again */
    error_set(e, ERR_NO_SESSION, "Upload: session %.8s was closed; it takes no more data", s->id);
    goto out;
  }
  if (!o) {
    error_set(e, ERR_QUOTA, "Upload: out of memory on the server");
    goto out;
  }
  if (session_check_refs(s, &h->ref, 1, e)) {
    error_prefix(e, "Upload", ": ");
    goto out;
  }
  if (command_check_limits(s, o, OBJ_TENSOR, 1, "Upload", e)) goto out;
  if (!(m = objects_expect(o, h->mesh, OBJ_MESH, "Upload: mesh", e))) goto out;
  if (h->stream && !objects_expect(o, h->stream, OBJ_STREAM, "Upload: stream", e)) goto out;
  if (!dtype_valid((dtype_t)h->dtype)) {
    error_set(e, ERR_BAD_ARGUMENT, "Upload: unknown dtype %d; name one of float32, ..., bool",
              (int)h->dtype);
    goto out;
  }
  u->meta.dtype = (dtype_t)h->dtype;
  if (layout_contiguous(&u->meta.layout, h->shape, (int64_t)h->n_shape, dtype_size(u->meta.dtype),
                        "Upload: shape", e))
    goto out;
  u->nranks = mesh_len(m->mesh);
  u->ranks = malloc(sizeof *u->ranks * (u->nranks ? u->nranks : 1));
  if (!u->ranks) {
    error_set(e, ERR_QUOTA, "Upload: out of memory on the server");
    goto out;
  }
  mesh_ranks(m->mesh, u->ranks);
  u->each = (size_t)layout_numel(&u->meta.layout) * dtype_size(u->meta.dtype);
  u->total = h->per_rank ? u->each * u->nranks : u->each;
  if (h->total_bytes && h->total_bytes != u->total) {
    error_set(e, ERR_BAD_ARGUMENT,
              "Upload: total_bytes is %llu but shape and dtype%s need %zu bytes",
              (unsigned long long)h->total_bytes, h->per_rank ? " (per rank, times the mesh's ranks)" : "",
              u->total);
    goto out;
  }
  if (command_check_mesh_alive(u->ds->pool, m->mesh, "Upload", e) ||
      mesh_check_capacity(m->mesh, "Upload", u->each, e))
    goto out;
  if (quota_check(s, o, u->each, u->nranks, "Upload", "", e)) goto out;
  rc = 0;
out:
  pthread_mutex_unlock(&s->mu);
  if (rc) return rc;
  u->ref = h->ref;
  u->mesh = h->mesh;
  u->stream = h->stream;
  u->per_rank = h->per_rank;
  u->have_header = true;
  return 0;
}

/* Agents take data only for sessions open on them (docs/protocol.md): a
 * StatusRequest of the session opens it on each rank, ahead of the writes
 * (the agent waits briefly for it when the write overtakes it), and marks the
 * rank touched so that EndSession closes it there. Once per rank and Execute
 * link: the session stays open there until EndSession or the link's end (a
 * new link's agent has no sessions: opened again), and a Status for every
 * upload cost each of its agents an instruction, and its report, per upload. */
static int upload_open(upload_t *u) {
  Meshd__Agent__V1__StatusRequest sr = MESHD__AGENT__V1__STATUS_REQUEST__INIT;
  Meshd__Agent__V1__Instruction ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  session_t *s = u->session;
  ins.session_id = s->id;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS;
  ins.status = &sr;
  pthread_mutex_lock(&s->mu);
  /* Not once the session closed (between the header and here): its EndSession
   * went, and a Status would open it on the agents again. */
  bool closed = atomic_load(&s->closed);
  objects_t *o = closed ? NULL : objects_of(s);
  for (size_t i = 0; o && i < u->nranks; i++) {
    uint32_t r = u->ranks[i];
    uint64_t seq = 0;
    if (r < o->ntouched && agent_pool_on_link(u->ds->pool, r, o->opened_seq[r])) continue;
    if (agent_pool_send(u->ds->pool, r, &ins, &seq) == 0) {
      objects_sent(o, r, seq, 0);
      if (r < o->ntouched) o->opened_seq[r] = seq; /* (touched by objects_sent) */
    }
  }
  pthread_mutex_unlock(&s->mu);
  return closed ? -1 : 0;
}

/* A transfer failed: every rank lets go of the ref, whether its Write defined
 * it or not (an agent remembers a ref deleted before its Write finished, and
 * refuses that Write). Holds s->mu. */
static void refs_undo(data_service_t *ds, session_t *s, objects_t *o, uint64_t ref,
                      uint64_t stream, const uint32_t *ranks, size_t n) {
  Meshd__Agent__V1__DeleteRefs d = MESHD__AGENT__V1__DELETE_REFS__INIT;
  Meshd__Agent__V1__Instruction ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.session_id = s->id;
  ins.stream = stream;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS;
  ins.delete_refs = &d;
  d.refs = &ref;
  d.n_refs = 1;
  for (size_t i = 0; i < n; i++) {
    uint64_t seq = 0;
    if (agent_pool_send(ds->pool, ranks[i], &ins, &seq) == 0)
      objects_sent(o, ranks[i], seq, 0);
  }
}

static void upload_undo(upload_t *u, objects_t *o) {
  refs_undo(u->ds, u->session, o, u->ref, u->stream, u->ranks, u->nranks);
}

/* Every rank holds an uploaded tensor: the session defines it (the ref is
 * claimed here unless the caller claimed it before). Holds s->mu. */
static obj_t *upload_define(session_t *s, objects_t *o, uint64_t ref, const tensor_meta_t *meta,
                            uint64_t mesh, uint64_t stream, size_t nranks, const char *what,
                            meshd_error_t *e) {
  if (command_check_limits(s, o, OBJ_TENSOR, 1, what, e)) return NULL;
  /* The quota again: the header's check was before the bytes came, and the
   * session's other work (commands, transfers) may have taken it since. */
  if (quota_check(s, o, (size_t)layout_numel(&meta->layout) * dtype_size(meta->dtype), nranks,
                  what, " (taken since the upload began)", e))
    return NULL;
  o->current_seq = 0; /* an upload is not a numbered command */
  obj_t *t = objects_new_tensor(o, ref, meta, mesh, stream, nranks);
  if (t) {
    if (session_check_ref(s, ref, NULL) == 0) session_claim_ref(s, ref, NULL);
  } else {
    error_set(e, ERR_QUOTA, "%s: out of memory on the server", what);
  }
  s->bytes_held = o->bytes;
  s->live_tensors = o->live_tensors;
  return t;
}

/* Pauses and resumes happen under u->mu, in the order they were decided (the
 * call counts them: a resume that overtook its pause would leave the reads
 * paused for good). */
static void upload_resume_locked(upload_t *u) {
  u->paused = false;
  rpc_call_resume_reads(u->call);
}

/* Every Write ended (or none opened): the ranks that took their bytes define
 * the ref, or let it go if any failed, and the client gets its answer. */
static void upload_settle(upload_t *u) {
  pthread_mutex_lock(&u->mu);
  bool ok = u->received && !u->aborted;
  for (size_t i = 0; i < u->nranks; i++) ok = ok && u->w && u->w[i].ok;
  meshd_error_t e = u->err;
  bool answered = u->answered;
  if (u->paused) upload_resume_locked(u); /* a pause of ours must not hold the call open */
  pthread_mutex_unlock(&u->mu);
  if (!ok && e.kind == ERR_NONE && !answered)
    error_set(&e, ERR_AGENT_LOST, "Upload: the Writes to the agents of mesh %llu ended early",
              (unsigned long long)u->mesh);

  session_t *s = u->session;
  obj_t *t = NULL;
  pthread_mutex_lock(&s->mu);
  unreserve_locked(u);
  /* A session closed meanwhile: its EndSession freed what the ranks took, and
   * any instruction now (an undo) would open it on them again. */
  bool closed = atomic_load(&s->closed);
  objects_t *o = closed ? NULL : objects_of(s);
  for (size_t i = 0; o && i < u->nranks; i++) objects_touch(o, u->ranks[i]); /* EndSession frees it */
  if (closed) /* the cause, whatever the Writes said (the agents had ended it) */
    error_set(&e, ERR_NO_SESSION, "Upload: session %.8s was closed before the upload ended",
              s->id);
  /* Checked again: the session's other commands ran meanwhile. */
  else if (ok && !o)
    error_set(&e, ERR_QUOTA, "Upload: out of memory on the server");
  else if (ok && session_check_refs(s, &u->ref, 1, &e) == 0)
    t = upload_define(s, o, u->ref, &u->meta, u->mesh, u->stream, u->nranks, "Upload", &e);
  /* Once Writes opened, a rank may hold the ref (one whose Write was cut after
   * its last byte, too): every rank lets go, and the ref is spent (spend_locked;
   * already, when the client was told before). */
  if (!t && o && u->w) {
    upload_undo(u, o);
    spend_locked(s, u->ref, answered ? NULL : &e);
  }
  Meshd__V1__UploadReply reply = MESHD__V1__UPLOAD_REPLY__INIT;
  Meshd__V1__TensorMeta meta;
  int64_t dims[2 * LAYOUT_MAX_DIMS];
  if (t) {
    command_tensor_meta(&meta, t, dims);
    reply.tensor = &meta;
    upload_give_back(u);
    rpc_call_reply(u->call, &reply.base);
  }
  pthread_mutex_unlock(&s->mu);
  rpc_call_t *call = u->call;
  if (!t && !answered && e.kind != ERR_NONE) {
    upload_give_back(u);
    finish_error(call, &e);
  }
  for (size_t i = 0; u->w && i < u->nranks; i++) {
    rpc_duplex_destroy(u->w[i].d); /* from a Write's last event: the rpc layer allows it */
    agent_data_release(u->w[i].data);
    u->w[i].d = NULL;
    u->w[i].data = NULL;
  }
  upload_release(u);
  rpc_call_unref(call);
}

static void write_sent(rpc_duplex_t *d, bool ok, void *arg);

/* Starts rank w's next send, or its half-close once the client sent every
 * byte and the queue is empty (lock held). A send that cannot start ends the
 * Write: its status says why. */
static void write_kick_locked(upload_t *u, rank_write_t *w) {
  if (w->sending || w->ended || w->closed || u->aborted) return;
  queued_msg_t *q = w->head;
  if (!q && !u->received) return;
  if (q) {
    w->head = q->next;
    if (!w->head) w->tail = NULL;
  } else {
    w->closed = true;
  }
  w->sending = true;
  w->in_flight = q ? q->len : 0;
  if (rpc_duplex_send_raw(w->d, q ? q->msg : NULL, !q, write_sent) != 0) {
    w->sending = false;
    u->queued -= w->in_flight;
    rpc_duplex_cancel(w->d);
  }
  free(q);
}

/* msg (taken) joins rank w's queue and goes when the sends before it went. */
static int write_queue_locked(upload_t *u, rank_write_t *w, rpc_bytes_t *msg, size_t len) {
  queued_msg_t *q = msg ? malloc(sizeof *q) : NULL;
  if (!q) {
    rpc_bytes_free(msg);
    return -1;
  }
  q->next = NULL;
  q->msg = msg;
  q->len = len + QUEUED_MSG_COST;
  if (w->tail) w->tail->next = q;
  else w->head = q;
  w->tail = q;
  u->queued += q->len;
  write_kick_locked(u, w);
  return 0;
}

/* From the client thread: a send of rank w's went; the next starts, and the
 * call's reads resume once the queues drained to half. */
static void write_sent(rpc_duplex_t *d, bool ok, void *arg) {
  (void)d;
  rank_write_t *w = arg;
  upload_t *u = w->u;
  pthread_mutex_lock(&u->mu);
  w->sending = false;
  u->queued -= w->in_flight;
  w->in_flight = 0;
  if (ok) write_kick_locked(u, w);
  if (u->paused && u->queued <= UPLOAD_QUEUED / 2 && !u->aborted) upload_resume_locked(u);
  pthread_mutex_unlock(&u->mu);
}

/* From the client thread: the agent's WriteReply, then the Write's end. The
 * last Write to end settles the Upload. */
static void write_event(rpc_duplex_t *d, ProtobufCMessage *msg, void *arg) {
  rank_write_t *w = arg;
  upload_t *u = w->u;
  if (msg) {
    protobuf_c_message_free_unpacked(msg, NULL);
    return;
  }
  rpc_status_t st;
  grpc_status_code code = rpc_duplex_status(d, &st);
  pthread_mutex_lock(&u->mu);
  w->ended = true;
  w->ok = code == GRPC_STATUS_OK && w->closed;
  /* The Writes cancelled for another's failure do not hide it. */
  char why[sizeof st.message + 100];
  /* The agent's own kind when it answered with one (as a Fetch relays it);
   * else its code says: a broken connection is the agent's loss. */
  error_kind_t kind = code == GRPC_STATUS_OK ? ERR_REMOTE_FAILURE : agent_kind(&st, code);
  if (!w->ok && u->err.kind == ERR_NONE && !(u->aborted && code == GRPC_STATUS_CANCELLED))
    error_set(&u->err, kind,
              "Upload: the Write to rank %u failed: %s", w->rank,
              code == GRPC_STATUS_OK ? "its agent ended it before every byte came"
                                     : agent_failure(&st, why, sizeof why));
  if (!w->ok) upload_abort_locked(u);
  bool last = --u->open == 0;
  pthread_mutex_unlock(&u->mu);
  if (last) upload_settle(u);
}

/* Opens rank w's Write and queues its spec (lock held). */
static int write_open_locked(upload_t *u, rank_write_t *w, meshd_error_t *e) {
  agent_target_t t;
  if (!(w->data = agent_pool_data(u->ds->pool, w->rank, &t)))
    return error_set(e, ERR_AGENT_LOST, "Upload: rank %u has no agent", w->rank);
  w->d = rpc_duplex_open(agent_data_channel(w->data), "/meshd.agent.v1.Agent/Write", t.md, 1,
                         relay_call_ms(u->call), &meshd__agent__v1__write_reply__descriptor,
                         write_event, w);
  if (!w->d)
    return error_set(e, ERR_AGENT_LOST, "Upload: cannot call the agent of rank %u", w->rank);
  u->open++;
  Meshd__Agent__V1__TensorSpec sp;
  tensor_spec_of(&sp, u->ref, &u->meta);
  Meshd__Agent__V1__DataChunk c = MESHD__AGENT__V1__DATA_CHUNK__INIT;
  c.session_id = u->session->id;
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_SPEC;
  c.spec = &sp;
  if (write_queue_locked(u, w, rpc_bytes_pack(&c.base), 0))
    return error_set(e, ERR_QUOTA, "Upload: out of memory on the server");
  return 0;
}

/* The header passed: its ref is reserved until the Upload settles, so that
 * another Upload of it, or a command naming it, is refused meanwhile instead
 * of being undone by this one's failure on the agents. */
static int upload_reserve(upload_t *u, meshd_error_t *e) {
  pthread_mutex_lock(&u->session->mu);
  int rc = session_reserve_ref(u->session, u->ref, e);
  if (rc == 0) u->reserved = true;
  pthread_mutex_unlock(&u->session->mu);
  if (rc) error_prefix(e, "Upload", ": ");
  return rc;
}

/* The header passed: every rank's Write opens, and the relay owns a share of
 * u and the call until it settled. A failure here settles it too. */
static int upload_begin(upload_t *u, meshd_error_t *e) {
  rank_write_t *w = calloc(u->nranks ? u->nranks : 1, sizeof *w);
  if (!w) return error_set(e, ERR_QUOTA, "Upload: out of memory on the server");
  if (upload_open(u)) { /* closed since its header was checked: no Writes for it */
    free(w);
    return error_set(e, ERR_NO_SESSION, "Upload: session %.8s was closed", u->session->id);
  }
  rpc_call_ref(u->call);
  atomic_fetch_add(&u->owners, 1);
  pthread_mutex_lock(&u->mu);
  u->w = w;
  for (size_t i = 0; i < u->nranks; i++) {
    w[i].u = u;
    w[i].rank = u->ranks[i];
  }
  meshd_error_t oe = {0};
  for (size_t i = 0; i < u->nranks && oe.kind == ERR_NONE; i++) write_open_locked(u, &w[i], &oe);
  if (oe.kind != ERR_NONE) {
    if (u->err.kind == ERR_NONE) u->err = oe;
    upload_abort_locked(u);
  }
  bool none = u->open == 0;
  pthread_mutex_unlock(&u->mu);
  if (none) upload_settle(u);
  return 0;
}

/* Bytes at stream offset pos to the ranks they are for, as DataChunk{data}
 * messages of at most ds->chunk bytes (lock held). */
static int upload_split_locked(upload_t *u, size_t pos, const uint8_t *data, size_t len) {
  Meshd__Agent__V1__DataChunk c = MESHD__AGENT__V1__DATA_CHUNK__INIT;
  c.session_id = u->session->id;
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_DATA;
  for (size_t off = 0; off < len;) {
    size_t i = u->per_rank ? (pos + off) / u->each : 0;
    size_t room = u->per_rank ? u->each - (pos + off) % u->each : len - off;
    size_t n = len - off < room ? len - off : room;
    if (n > u->ds->chunk) n = u->ds->chunk;
    c.data.data = (uint8_t *)data + off;
    c.data.len = n;
    rpc_bytes_t *m = rpc_bytes_pack(&c.base); /* one copy, every rank's reference */
    size_t last = u->per_rank ? i : u->nranks - 1;
    for (size_t k = i; k < last; k++)
      if (!m || write_queue_locked(u, &u->w[k], rpc_bytes_share(m), n)) {
        rpc_bytes_free(m);
        return -1;
      }
    if (write_queue_locked(u, &u->w[last], m, n)) return -1;
    off += n;
  }
  return 0;
}

/* After a chunk was queued: past UPLOAD_QUEUED the call's reads pause. */
static void upload_maybe_pause(upload_t *u) {
  pthread_mutex_lock(&u->mu);
  if (!u->paused && u->queued >= UPLOAD_QUEUED && !u->aborted) {
    u->paused = true;
    rpc_call_pause_reads(u->call); /* under u->mu: a resume cannot overtake it */
  }
  pthread_mutex_unlock(&u->mu);
}

static void upload_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  upload_t *u = rpc_call_data(call);
  if (!u || u->failed) return;
  meshd_error_t e;
  if (!msg) { /* the client half-closed */
    if (!u->have_header) return upload_fail(u, ERR_BAD_ARGUMENT, "Upload: %s", "no header: the first message must be an UploadHeader");
    if (u->got != u->total) {
      char why[160];
      snprintf(why, sizeof why, "got %zu bytes of data but the header needs %zu", u->got, u->total);
      return upload_fail(u, ERR_BAD_ARGUMENT, "Upload: %s", why);
    }
    u->failed = true; /* no more messages are expected */
    pthread_mutex_lock(&u->mu);
    u->received = true;
    for (size_t i = 0; i < u->nranks; i++) write_kick_locked(u, &u->w[i]);
    pthread_mutex_unlock(&u->mu);
    return;
  }
  const Meshd__V1__UploadChunk *c = (const void *)msg;
  if (c->part_case == MESHD__V1__UPLOAD_CHUNK__PART_HEADER) {
    if (u->have_header) return upload_fail(u, ERR_BAD_ARGUMENT, "Upload: %s", "a second header");
    if (upload_header(u, c->header, &e) || upload_reserve(u, &e) || upload_begin(u, &e)) {
      pthread_mutex_lock(&u->session->mu); /* (a failed begin settled it already) */
      unreserve_locked(u);
      pthread_mutex_unlock(&u->session->mu);
      u->have_header = false;
      u->failed = true;
      upload_give_back(u);
      finish_error(call, &e);
    }
    return;
  }
  if (!u->have_header)
    return upload_fail(u, ERR_BAD_ARGUMENT, "Upload: %s", "data before the header: send the UploadHeader first");
  if (c->data.len > u->total - u->got) {
    char why[160];
    snprintf(why, sizeof why, "more data than the %zu bytes the header describes", u->total);
    return upload_fail(u, ERR_BAD_ARGUMENT, "Upload: %s", why);
  }
  size_t pos = u->got;
  u->got += c->data.len;
  count_bytes(u->ds, DIR_UPLOAD, PATH_PROXY, c->data.len);
  pthread_mutex_lock(&u->mu);
  int rc = u->aborted ? 0 : upload_split_locked(u, pos, c->data.data, c->data.len);
  pthread_mutex_unlock(&u->mu);
  if (rc) return upload_fail(u, ERR_QUOTA, "Upload: %s", "out of memory on the server");
  upload_maybe_pause(u);
}

/* A data chunk sent on as it came (no unpacking, no copy): UploadChunk{data}
 * alone, no larger than the agents' chunks, for every rank (each a reference
 * to the same bytes) or within one rank's slice. Anything else goes the
 * unpacked way. */
static bool upload_raw(rpc_call_t *call, rpc_bytes_t *msg, void *arg) {
  upload_t *u = rpc_call_data(call);
  size_t len;
  if (!u || u->failed || !u->have_header ||
      !rpc_bytes_is_field(msg, MESHD__V1__UPLOAD_CHUNK__PART_DATA, &len) || len == 0 ||
      len > u->ds->chunk || len > u->total - u->got ||
      (u->per_rank && u->got % u->each + len > u->each))
    return false;
  size_t first = u->per_rank ? u->got / u->each : 0;
  u->got += len;
  count_bytes(u->ds, DIR_UPLOAD, PATH_PROXY, len);
  int rc = 0;
  pthread_mutex_lock(&u->mu);
  if (u->aborted) { /* the Writes are ending: the call is too */
    rpc_bytes_free(msg);
  } else if (u->per_rank) {
    rc = write_queue_locked(u, &u->w[first], msg, len);
  } else {
    for (size_t i = 1; i < u->nranks && rc == 0; i++)
      rc = write_queue_locked(u, &u->w[i], rpc_bytes_share(msg), len);
    if (rc == 0) rc = write_queue_locked(u, &u->w[0], msg, len);
    else rpc_bytes_free(msg);
  }
  pthread_mutex_unlock(&u->mu);
  if (rc) upload_fail(u, ERR_QUOTA, "Upload: %s", "out of memory on the server");
  else upload_maybe_pause(u);
  return true;
}

static void upload_end(rpc_call_t *call, bool cancelled, void *arg) {
  upload_t *u = rpc_call_data(call);
  if (!u) return;
  upload_abort(u); /* a client gone mid-upload: the Writes end and settling undoes */
  upload_spend(u, NULL); /* (a defined tensor's ref is claimed already: no-op) */
  upload_give_back(u);
  upload_release(u);
}

/* ------------------------------------------------------------------ fetch */

/* A Fetch relays the agent's Read and holds no thread: the watermark wait, the
 * agent's chunks (an rpc_pull, on the rpc layer's client thread) and the
 * client's reads (rpc_call_when_drained) each hand on to the next step. A
 * client that stops reading stops the relay: at most FETCH_QUEUED chunks wait
 * in the server's outbox, plus what the agent call's stream window lets
 * through, and the agent's own sends back up behind them. */
#define FETCH_QUEUED 2

typedef struct fetch {
  data_service_t *ds;
  rpc_call_t *call;            /* referenced until the fetch is freed */
  session_t *sess;             /* referenced; one of its transfers until on_end */
  char session[SESSION_ID_LEN + 1];
  uint32_t rank;
  uint64_t ref, after_seq;
  watermark_target_t *targets; /* every rank of the tensor's mesh, at its last seq */
  size_t ntargets;
  Meshd__V1__TensorMeta meta;
  int64_t dims[2 * LAYOUT_MAX_DIMS];
  bool sent_meta;              /* touched by the relay's steps only, one at a time */
  uint64_t stream;             /* the tensor's: where the Snapshot (after_seq) went */
  _Atomic bool read_all;       /* the agent's Read took the Snapshot (a proxied Read that
                                * ended OK, a direct one's receipt), or it was dropped */
  bool direct;                 /* a direct transfer's FinishFetch: no relay, just the wait */
  bool rank_read;              /* its Read's receipt vouches for rank `rank`: targets' last,
                                * not waited for (fetch_rank_read) */
  _Atomic bool slot_freed;     /* it holds no --session-max-transfers slot (any more) */
  _Atomic bool waiting;        /* planned without a slot, one of sess->fetches_waiting */
  _Atomic bool gone;           /* on_end ran (read without f->mu: queue_run) */
  struct fetch *queued_next;   /* ds->queued's */
  struct transfer *granting;   /* while queued, a direct fetch's: its transfer, whose grant
                                * request is held (plan_fetch_grant), under ds->mu */
  bool queued_slot;            /* queue_run took a slot for it (else it goes) */
  size_t bytes;                /* the shard's */

  pthread_mutex_t mu;
  int refs;          /* the call's (until on_end) and the relay's (until it stops) */
  bool ended;        /* on_end ran: the relay stops at its next step */
  uint64_t wait_id;  /* the watermark wait in flight, 0 if none */
  agent_data_t *data; /* the agent's data channel, while the relay reads from it */
  rpc_pull_t *pull;
  bool sess_held;    /* sess is a hold (session_hold: a planned fetch), not a call's */
} fetch_t;

/* A fetch planned without a slot has one now, or goes: it waits no more. */
static void fetch_stop_waiting(fetch_t *f) {
  if (atomic_exchange(&f->waiting, false)) wait_end(f->sess);
}

static void fetch_free(fetch_t *f) {
  if (f->sess) fetch_stop_waiting(f);
  if (f->sess && f->sess_held) session_unhold(f->sess); /* a plan's (plan_fetch) */
  else if (f->sess) session_release(f->sess);
  if (f->call) rpc_call_unref(f->call);
  free(f->targets);
  free(f);
}

/* The Fetch ended without its Read taking the Snapshot (cancelled, failed):
 * the agent lets it go now rather than at the session's end. */
static void fetch_drop_snapshot(fetch_t *f) {
  session_t *s = f->sess;
  int ms = 0; /* --server-fault drop:slow=MS: tests of what may happen before it is sent */
  if (fault_hit(f->ds->fault, "drop", -1, &ms) == FAULT_SLOW) {
    log_warn("data", "DropSnapshot of tensor %llu held %d ms (injected fault)",
             (unsigned long long)f->ref, ms);
    nanosleep(&(struct timespec){ms / 1000, (long)(ms % 1000) * 1000000L}, NULL);
  }
  Meshd__Agent__V1__DropSnapshot d = MESHD__AGENT__V1__DROP_SNAPSHOT__INIT;
  Meshd__Agent__V1__Instruction ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  d.seq = f->after_seq;
  ins.session_id = s->id;
  ins.stream = f->stream;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DROP_SNAPSHOT;
  ins.drop_snapshot = &d;
  pthread_mutex_lock(&s->mu);
  /* Not once the session closed: its EndSession frees everything, and an
   * instruction after it would open the session on the agent again. */
  uint64_t seq = 0;
  if (!atomic_load(&s->closed) && s->objects &&
      agent_pool_send(f->ds->pool, f->rank, &ins, &seq) == 0)
    objects_sent(s->objects, f->rank, seq, 0);
  pthread_mutex_unlock(&s->mu);
}

/* The slot, and a Fetch's relay, given back once: before the client's answer
 * (it may start its next transfer on it), or at on_end. */
static void fetch_give_back(fetch_t *f) {
  if (atomic_exchange(&f->slot_freed, true)) return;
  transfer_end(f->ds, f->sess);
  if (!f->direct) relay_end(f->ds);
}

/* A fetch that ends without its Read taking the snapshot (abandoned,
 * cancelled, failed, expired): the snapshot's drop is sent, once, before its
 * slot goes back. A slot given back first let the session's next plan send
 * its Snapshot ahead of the drop on the agent's link, and the agent, which
 * keeps a session's 64 latest unread snapshots (the slots and waiting
 * fetches together), let the oldest go for it, another fetch's. */
static void fetch_abandon(fetch_t *f) {
  if (f->after_seq && !atomic_exchange(&f->read_all, true)) fetch_drop_snapshot(f);
  fetch_give_back(f);
}

static void fetch_unref(fetch_t *f) {
  pthread_mutex_lock(&f->mu);
  int left = --f->refs;
  pthread_mutex_unlock(&f->mu);
  if (left) return;
  data_service_t *ds = f->ds;
  if (f->after_seq && !atomic_load(&f->read_all)) fetch_drop_snapshot(f);
  pthread_mutex_destroy(&f->mu);
  fetch_free(f);
  live_done(ds);
}

/* The relay is over (answered, or the call ended): the agent call goes. */
static void relay_stop(fetch_t *f) {
  pthread_mutex_lock(&f->mu);
  rpc_pull_t *p = f->pull;
  agent_data_t *data = f->data;
  f->pull = NULL;
  f->data = NULL;
  pthread_mutex_unlock(&f->mu);
  rpc_pull_destroy(p);
  agent_data_release(data);
  fetch_unref(f);
}

static void relay_fail(fetch_t *f, grpc_status_code code, const char *kind, const char *msg) {
  fetch_abandon(f);
  rpc_call_finish(f->call, code, kind, "%s", msg);
  relay_stop(f);
}

static void fetch_chunk(rpc_pull_t *p, rpc_bytes_t *m, void *arg);

/* The client read enough (or left): ask the agent for the next chunk. */
static void fetch_drained(rpc_call_t *call, void *arg) {
  fetch_t *f = arg;
  pthread_mutex_lock(&f->mu);
  rpc_pull_t *p = f->pull;
  pthread_mutex_unlock(&f->mu);
  if (rpc_call_ended(call)) rpc_pull_cancel(p);
  rpc_pull_next(p);
}

static void fetch_chunk(rpc_pull_t *p, rpc_bytes_t *m, void *arg) {
  fetch_t *f = arg;
  if (!m) { /* the agent's stream is over */
    rpc_status_t st = {0};
    grpc_status_code code = rpc_pull_status(p, &st);
    if (code == GRPC_STATUS_OK) {
      atomic_store(&f->read_all, true);
      fetch_give_back(f);
      rpc_call_finish(f->call, GRPC_STATUS_OK, NULL, "fetched");
    } else {
      fetch_abandon(f);
      char why[sizeof st.message + 100];
      rpc_call_finish(f->call, code, st.kind[0] ? st.kind : "AGENT_LOST",
                      "Fetch of tensor %llu from rank %u: %s", (unsigned long long)f->ref, f->rank,
                      agent_failure(&st, why, sizeof why));
    }
    relay_stop(f);
    return;
  }
  int rc = 0;
  if (!f->sent_meta) {
    Meshd__V1__FetchChunk out = MESHD__V1__FETCH_CHUNK__INIT;
    out.part_case = MESHD__V1__FETCH_CHUNK__PART_META;
    out.meta = &f->meta;
    rc = rpc_call_send(f->call, &out.base);
    f->sent_meta = true;
  }
  size_t len;
  if (rc == 0 && rpc_bytes_is_field(m, MESHD__AGENT__V1__DATA_CHUNK__PART_DATA, &len)) {
    /* DataChunk{data} is FetchChunk{data} byte for byte: forwarded as is. */
    rc = rpc_call_send_raw(f->call, m);
    if (rc == 0) count_bytes(f->ds, DIR_FETCH, PATH_PROXY, len);
    m = NULL;
  } else if (rc == 0) { /* the spec (the meta went first), or a chunk with more fields */
    Meshd__Agent__V1__DataChunk *c =
        (void *)rpc_bytes_unpack(m, &meshd__agent__v1__data_chunk__descriptor);
    if (!c) {
      rpc_call_finish(f->call, GRPC_STATUS_INTERNAL, "REMOTE_FAILURE",
                      "Fetch of tensor %llu from rank %u: the agent sent a message that is not "
                      "a DataChunk", (unsigned long long)f->ref, f->rank);
      rc = -1;
    } else if (c->part_case == MESHD__AGENT__V1__DATA_CHUNK__PART_DATA) {
      Meshd__V1__FetchChunk out = MESHD__V1__FETCH_CHUNK__INIT;
      out.part_case = MESHD__V1__FETCH_CHUNK__PART_DATA;
      out.data = c->data;
      rc = rpc_call_send(f->call, &out.base);
      if (rc == 0) count_bytes(f->ds, DIR_FETCH, PATH_PROXY, c->data.len);
    }
    if (c) protobuf_c_message_free_unpacked(&c->base, NULL);
  }
  rpc_bytes_free(m);
  if (rc != 0) rpc_pull_cancel(p); /* the client is gone: the next read ends the relay */
  if (rc != 0 || !rpc_call_when_drained(f->call, FETCH_QUEUED - 1, fetch_drained, f))
    rpc_pull_next(p);
}

/* Every rank caught up: read the shard from its agent. */
static void fetch_read(fetch_t *f) {
  agent_target_t t;
  agent_data_t *data = agent_pool_data(f->ds->pool, f->rank, &t);
  if (!data) {
    char msg[160];
    snprintf(msg, sizeof msg, "Fetch: rank %u has no agent (it was lost); its tensors are gone",
             f->rank);
    return relay_fail(f, GRPC_STATUS_UNAVAILABLE, "AGENT_LOST", msg);
  }
  Meshd__Agent__V1__ReadRequest rq = MESHD__AGENT__V1__READ_REQUEST__INIT;
  rq.session_id = f->session;
  rq.ref = f->ref;
  rq.max_chunk_bytes = (uint32_t)f->ds->chunk;
  rq.after_seq = f->after_seq;
  pthread_mutex_lock(&f->mu);
  bool ended = f->ended;
  if (!ended) {
    f->data = data;
    f->pull = rpc_pull_open_raw(agent_data_channel(data), "/meshd.agent.v1.Agent/Read", &rq.base,
                                t.md, 1, relay_call_ms(f->call), fetch_chunk, f);
    if (f->pull) rpc_pull_next(f->pull);
  }
  bool started = f->pull != NULL;
  pthread_mutex_unlock(&f->mu);
  if (ended) agent_data_release(data);
  if (ended) return relay_stop(f);
  if (!started)
    relay_fail(f, GRPC_STATUS_UNAVAILABLE, "AGENT_LOST", "Fetch: cannot call the agent");
}

/* Whether the failure of the fetched tensor t came from what was sent before
 * the fetch's plan (the plan refused a tensor failed then): an agent's report
 * of an instruction at or before the seq waited for on its rank. One the
 * server decided at a later command's check, or an agent's of a later
 * instruction (an in-place command after the fetch), leaves the value the
 * Snapshot holds, which the Fetch promises. Unknown (no memory to say,
 * reports of several ranks, a rank not waited for): failed, as before. */
static bool failed_before_plan(const fetch_t *f, const tensor_failure_t *why) {
  if (!why || why->ranks) return true;
  if (!why->rank_seq) return false;
  for (size_t i = 0; i < f->ntargets; i++)
    if (f->targets[i].rank == why->rank) return why->rank_seq <= f->targets[i].seq;
  return true;
}

/* The watermark wait ended with r. Returns false to wait again (another rank
 * of the mesh was lost: its failures can no longer reach us, but the shard
 * asked for is on a survivor; wait for the others), true once handed on. */
static bool fetch_caught_up(fetch_t *f, watermark_result_t r, uint32_t lost) {
  if (r == WATERMARK_LOST && lost != f->rank) {
    size_t k = 0;
    for (size_t i = 0; i < f->ntargets; i++)
      if (f->targets[i].rank != lost) f->targets[k++] = f->targets[i];
    if (k != f->ntargets) {
      f->ntargets = k;
      return false;
    }
  }
  char msg[sizeof ((meshd_error_t *)0)->msg + 200];
  if (r == WATERMARK_LOST) {
    /* The pool's wording names the rank and when it was lost. */
    meshd_error_t when = {0};
    agent_pool_check_lost(f->ds->pool, &lost, 1, 0, "Fetch", &when);
    snprintf(msg, sizeof msg,
             "Fetch of tensor %llu: the agent of rank %u was lost before it computed it%s%s%s",
             (unsigned long long)f->ref, lost, when.msg[0] ? " (" : "",
             when.msg[0] ? when.msg : "", when.msg[0] ? ")" : "");
    relay_fail(f, GRPC_STATUS_UNAVAILABLE, "AGENT_LOST", msg);
    return true;
  }
  if (r != WATERMARK_REACHED) {
    relay_fail(f, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE", "Fetch: the server is stopping");
    return true;
  }
  meshd_error_t e = {0};
  pthread_mutex_lock(&f->sess->mu);
  objects_t *o = f->sess->objects;
  obj_t *t = o ? objects_get(o, f->ref) : NULL;
  /* Dropped since the plan: its tombstone says whether and where it failed;
   * failed without a record (no memory to keep it): failed, as above. */
  const tombstone_t *g = o && !t ? objects_dropped(o, f->ref) : NULL;
  if (t && t->kind == OBJ_TENSOR && t->state == TENSOR_FAILED &&
      failed_before_plan(f, t->tensor.fail))
    error_set(&e, obj_fail_kind(t), "Fetch: tensor %llu failed: %s", (unsigned long long)f->ref,
              obj_fail_msg(t));
  else if (g && (g->fail ? failed_before_plan(f, g->fail) : g->failure_noted))
    error_set(&e, g->fail ? g->fail->kind : ERR_REMOTE_FAILURE,
              "Fetch: tensor %llu failed (it was dropped since, at command seq %llu): %s",
              (unsigned long long)f->ref, (unsigned long long)g->seq,
              g->fail ? g->fail->msg : "(no memory to keep the message)");
  pthread_mutex_unlock(&f->sess->mu);
  if (e.kind != ERR_NONE) {
    fetch_abandon(f);
    finish_error(f->call, &e);
    relay_stop(f);
    return true;
  }
  if (f->direct) { /* the client read the shard itself: the value is good on every rank */
    Meshd__V1__FinishFetchReply ok = MESHD__V1__FINISH_FETCH_REPLY__INIT;
    /* Without the Read's receipt (read_all false: a client that abandons the
     * plan before its Read ends it with FinishFetch too) the snapshot may
     * still be pinned on the agent: dropped before the answer, so that the
     * client's next command runs after the drop there. */
    /* The slot before the answer: the client may start its next transfer on it. */
    fetch_abandon(f);
    count_bytes(f->ds, DIR_FETCH, PATH_DIRECT, f->bytes);
    rpc_call_reply(f->call, &ok.base);
    relay_stop(f);
    return true;
  }
  fetch_read(f);
  return true;
}

static void fetch_waited(watermark_result_t r, uint32_t lost, void *arg);

/* Waits until every rank of the tensor's mesh ran what was issued before the
 * Fetch; a failure on any of them is then known to the server (reports land
 * before the watermark moves), so a value that failed on any rank fails the
 * Fetch from every rank. */
static void fetch_wait(fetch_t *f) {
  watermark_t *w = agent_pool_watermark(f->ds->pool);
  for (;;) {
    uint32_t lost = 0;
    /* Under f->mu: on_end sees the wait's id, and the callback (on another
     * thread) waits until it is stored. */
    pthread_mutex_lock(&f->mu);
    bool ended = f->ended;
    watermark_result_t r = WATERMARK_PENDING;
    size_t n = f->ntargets - (f->rank_read && f->ntargets ? 1 : 0);
    if (!ended)
      r = watermark_wait_session(w, f->session, f->targets, n, fetch_waited, f, &f->wait_id,
                                 &lost);
    pthread_mutex_unlock(&f->mu);
    if (ended) return relay_stop(f);
    if (r == WATERMARK_PENDING || fetch_caught_up(f, r, lost)) return;
  }
}

static void fetch_waited(watermark_result_t r, uint32_t lost, void *arg) {
  fetch_t *f = arg;
  pthread_mutex_lock(&f->mu);
  f->wait_id = 0;
  pthread_mutex_unlock(&f->mu);
  if (!fetch_caught_up(f, r, lost)) fetch_wait(f);
}

/* Picks the rank and checks the tensor; fills f. Holds s->mu. */
static int fetch_plan(data_service_t *ds, session_t *s, const Meshd__V1__FetchRequest *rq,
                      fetch_t *f, meshd_error_t *e) {
  if (atomic_load(&s->closed)) /* its EndSession went: a Snapshot would open it again */
    return error_set(e, ERR_NO_SESSION, "Fetch: session %.8s was closed", s->id);
  objects_t *o = objects_of(s);
  if (!o) return error_set(e, ERR_QUOTA, "Fetch: out of memory on the server");
  const tombstone_t *g = objects_dropped(o, rq->ref);
  if (g)
    return error_set(e, ERR_DROPPED, "Fetch: tensor %llu was dropped at command seq %llu",
                     (unsigned long long)rq->ref, (unsigned long long)g->seq);
  obj_t *t = objects_expect(o, rq->ref, OBJ_TENSOR, "Fetch: ref", e);
  if (!t) return -1;
  if (t->state == TENSOR_FAILED)
    return error_set(e, obj_fail_kind(t), "Fetch: tensor %llu failed: %s",
                     (unsigned long long)t->ref, obj_fail_msg(t));
  /* As any use (checks.c): its borrower may be writing it on another stream,
   * which the Snapshot on this one would not wait for. */
  if (!(t->tensor.storage->access & ACCESS_R))
    return error_set(e, ERR_BORROWED,
                     "Fetch: tensor %llu is mutably borrowed (borrow %llu); fetch the borrow's "
                     "tensor, or drop the borrow first", (unsigned long long)t->ref,
                     (unsigned long long)t->tensor.storage->mutable_borrow);
  const mesh_t *mesh = objects_get(o, t->tensor.mesh)->mesh;
  int64_t coords[NDSLICE_MAX_DIMS];
  bool given[NDSLICE_MAX_DIMS] = {0};
  for (size_t i = 0; i < rq->n_coords; i++) {
    int d = mesh_find_dim(mesh, rq->coords[i]->dim);
    char dims[200];
    if (d < 0 || given[d])
      return error_set(e, ERR_BAD_DIM, "Fetch: the tensor's mesh %s %s dim '%s'",
                       mesh_format(mesh, dims, sizeof dims), d < 0 ? "has no" : "was given twice the",
                       rq->coords[i]->dim);
    int64_t c = rq->coords[i]->index, n = mesh->slice.sizes[d];
    if (c < -n || c >= n)
      return error_set(e, ERR_BAD_ARGUMENT, "Fetch: coordinate %lld is out of range for dim '%s' "
                       "of size %lld", (long long)c, mesh->names[d], (long long)n);
    coords[d] = c < 0 ? c + n : c;
    given[d] = true;
  }
  char missing[200] = "";
  size_t len = 0;
  for (int d = 0; d < mesh->ndim; d++)
    if (!given[d] && len < sizeof missing)
      len += (size_t)snprintf(missing + len, sizeof missing - len, "%s'%s'", len ? ", " : "", mesh->names[d]);
  if (len)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Fetch: give a coordinate for every dim of the tensor's mesh; missing %s",
                     missing);
  f->rank = (uint32_t)ndslice_rank_of(&mesh->slice, coords, NULL);
  f->ref = t->ref;
  meshd_error_t lost;
  if (agent_pool_check_lost(ds->pool, &f->rank, 1, mesh->losses_seen, "Fetch", &lost))
    return error_set(e, ERR_AGENT_LOST, "Fetch of tensor %llu: its shard is gone (%s)",
                     (unsigned long long)t->ref, lost.msg);
  /* The value fetched is the tensor as the commands before the Fetch leave
   * it: a Snapshot at this point of its stream's order (agent.proto), which
   * later commands do not change. The agent answers the Read once the
   * session (not every session) ran through it. */
  Meshd__Agent__V1__Snapshot snap = MESHD__AGENT__V1__SNAPSHOT__INIT;
  Meshd__Agent__V1__Instruction ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  snap.ref = t->ref;
  ins.session_id = s->id;
  ins.stream = t->tensor.stream;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT;
  ins.snapshot = &snap;
  f->stream = t->tensor.stream;
  /* Allocated first: a Snapshot sent and then given up would stay on the agent. */
  size_t n = mesh_len(mesh);
  uint32_t *ranks = malloc(sizeof *ranks * (n ? n : 1));
  f->targets = malloc(sizeof *f->targets * (n ? n : 1));
  if (!ranks || !f->targets) {
    free(ranks);
    return error_set(e, ERR_QUOTA, "Fetch: out of memory on the server");
  }
  if (agent_pool_send(ds->pool, f->rank, &ins, &f->after_seq)) {
    free(ranks);
    return error_set(e, ERR_AGENT_LOST, "Fetch of tensor %llu: rank %u has no agent (it was "
                     "lost); its shard is gone", (unsigned long long)t->ref, f->rank);
  }
  objects_sent(o, f->rank, f->after_seq, 0);
  mesh_ranks(mesh, ranks);
  size_t k = 0;
  meshd_error_t ignored;
  for (size_t i = 0; i < n; i++) {
    /* A rank lost since the mesh was made will never catch up: its failures
     * are out of reach, the survivors' are waited for. */
    if (agent_pool_check_lost(ds->pool, &ranks[i], 1, mesh->losses_seen, "Fetch", &ignored))
      continue;
    f->targets[k++] = (watermark_target_t){ranks[i], objects_last_seq(o, ranks[i])};
  }
  f->ntargets = k;
  free(ranks);
  f->sess = s;
  session_ref(s);
  snprintf(f->session, sizeof f->session, "%s", s->id);
  command_tensor_meta(&f->meta, t, f->dims);
  f->bytes = (size_t)obj_nbytes(t);
  return 0;
}

/* Puts f at the end of ds->queued (under ds->mu). */
static void queue_append_locked(data_service_t *ds, fetch_t *f) {
  *ds->queued_tail = f;
  ds->queued_tail = &f->queued_next;
  atomic_fetch_add(&ds->nqueued, 1);
}

/* Takes the fetch at *pp out of ds->queued (under ds->mu): *pp is then the
 * one after it. */
static fetch_t *queue_take_locked(data_service_t *ds, fetch_t **pp) {
  fetch_t *f = *pp;
  *pp = f->queued_next;
  if (ds->queued_tail == &f->queued_next) ds->queued_tail = pp;
  f->queued_next = NULL;
  atomic_fetch_sub(&ds->nqueued, 1);
  return f;
}

/* A proxied Fetch planned without a slot waits in ds->queued, holding the
 * relay's reference, until queue_run starts it. */
static void fetch_queue(data_service_t *ds, fetch_t *f) {
  pthread_mutex_lock(&ds->mu);
  queue_append_locked(ds, f);
  pthread_mutex_unlock(&ds->mu);
  kick(ds); /* a slot may have freed while it was planned */
}

static void fetch_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  data_service_t *ds = arg;
  const Meshd__V1__FetchRequest *rq = (const void *)req;
  if (proxy_refused(ds, call, "Fetch")) return;
  if (rq->transfer_id) {
    rpc_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                    "Fetch: transfer_id names a planned fetch's grant, for PlanTransfer; a "
                    "Fetch names its tensor by ref and coords");
    return;
  }
  session_t *s = session_from_call(ds->sessions, call);
  if (!s) return;
  meshd_error_t e;
  bool waits; /* planned now, relayed once a slot frees (queue_run) */
  if (fetch_slot_begin(ds, s, "Fetch", rq, &waits, &e)) {
    session_release(s);
    finish_error(call, &e);
    return;
  }
  if (!waits && relay_begin(ds, "Fetch", &e)) {
    transfer_end(ds, s);
    session_release(s);
    finish_error(call, &e);
    return;
  }
  fetch_t *f = calloc(1, sizeof *f);
  int rc = f ? 0 : error_set(&e, ERR_QUOTA, "Fetch: out of memory on the server");
  if (!rc) {
    pthread_mutex_lock(&s->mu);
    rc = fetch_plan(ds, s, rq, f, &e);
    pthread_mutex_unlock(&s->mu);
  }
  if (rc) {
    if (waits) {
      wait_end(s);
    } else {
      relay_end(ds);
      transfer_end(ds, s);
    }
    session_release(s);
    if (f) fetch_free(f);
    finish_error(call, &e);
    return;
  }
  atomic_store(&f->slot_freed, waits);
  atomic_store(&f->waiting, waits);
  session_release(s); /* f->sess holds its own */
  live_add(ds);
  f->ds = ds;
  f->call = call;
  rpc_call_ref(call);
  pthread_mutex_init(&f->mu, NULL);
  f->refs = 2;
  rpc_call_set_data(call, f);
  /* The meta at once: the Fetch is planned (its value fixed by the Snapshot),
   * so a client that waits for this first message before it sends its next
   * command knows that command cannot change what the Fetch returns. */
  Meshd__V1__FetchChunk first = MESHD__V1__FETCH_CHUNK__INIT;
  first.part_case = MESHD__V1__FETCH_CHUNK__PART_META;
  first.meta = &f->meta;
  rpc_call_send(call, &first.base);
  f->sent_meta = true;
  if (waits) fetch_queue(ds, f);
  else fetch_wait(f);
}

/* Starts a queued Fetch that got a slot (slot: taken for it), or ends one
 * whose call ended or whose session closed meanwhile (its snapshot is
 * dropped). */
static void queued_start(fetch_t *f, bool slot) {
  meshd_error_t e = {0};
  if (slot && relay_begin(f->ds, "Fetch", &e)) {
    transfer_end(f->ds, f->sess);
    slot = false;
  } else if (!slot) {
    error_set(&e, ERR_NO_SESSION, "Fetch: session %.8s was closed", f->session);
  }
  /* Under f->mu, against fetch_end: either it sees the slot and gives it
   * back, or the slot is given back here. */
  pthread_mutex_lock(&f->mu);
  bool ended = f->ended;
  if (slot && !ended) atomic_store(&f->slot_freed, false);
  pthread_mutex_unlock(&f->mu);
  if (slot && !ended) {
    fetch_stop_waiting(f);
    return fetch_wait(f);
  }
  /* Its snapshot's drop before its place (and the slot) go back: see
   * fetch_abandon. */
  if (f->after_seq && !atomic_exchange(&f->read_all, true)) fetch_drop_snapshot(f);
  fetch_stop_waiting(f);
  if (slot) {
    transfer_end(f->ds, f->sess);
    relay_end(f->ds);
  }
  if (!ended) finish_error(f->call, &e);
  relay_stop(f);
}

static void fetch_end(rpc_call_t *call, bool cancelled, void *arg) {
  data_service_t *ds = arg;
  fetch_t *f = rpc_call_data(call);
  if (!f) return;
  (void)ds; /* the relay goes back with the slot (fetch_give_back): FinishFetch took none */
  pthread_mutex_lock(&f->mu);
  f->ended = true;
  uint64_t wait = f->wait_id;
  if (f->pull) rpc_pull_cancel(f->pull); /* the relay's next step ends it */
  pthread_mutex_unlock(&f->mu);
  atomic_store(&f->gone, true);
  if (atomic_load(&f->waiting)) kick(ds); /* queued: it leaves the queue now */
  fetch_abandon(f); /* unless answered: cut short, its snapshot is not read now */
  /* Parked on the watermark: withdrawn, the relay will take no more steps. */
  if (wait && watermark_cancel(agent_pool_watermark(ds->pool), wait)) fetch_unref(f);
  fetch_unref(f);
}


/* ------------------------------------------------------------------ direct */

/* The direct data path (docs/protocol.md, Direct data path): PlanTransfer
 * runs an Upload's or a Fetch's checks and planning, then hands the client a
 * grant per shard (grant.h), signed with that agent's call secret; the client
 * moves the bytes with Agent/Write or Agent/Read itself. An upload's ref is
 * claimed at once and defined by FinishUpload, once every agent's receipt
 * checks out; a fetch's FinishFetch waits, like a Fetch, for every rank of the
 * mesh, so a value that failed on another rank fails it too. A transfer
 * counts as one of its session's --session-max-transfers until it finishes
 * or its grants expire; an upload that expired or failed is undone on every
 * rank (DeleteRefs), and its ref stays undefined. */

/* After a grant's expiry, how long the server waits before it undoes the
 * transfer: agents refuse to finish a Write past the expiry by their own
 * clock, which the grant is written in (grant.h, Clocks) but for the offset
 * estimate's error, and an agent stepped back may still be behind for a few
 * seconds (an older agent: by however far its clock lags). */
#define TRANSFER_UNDO_SLACK_MS 2000
#define SWEEP_MS 200

typedef struct transfer {
  struct transfer *next;
  uint64_t id;
  session_t *sess;   /* referenced (a fetch's is its fetch_t's) */
  int64_t expiry_ms; /* the grants', Unix ms */
  bool failed;       /* FinishUpload refused it: kept only to undo it again at expiry */
  /* FinishUpload defined it: kept until expiry only to answer a FinishUpload
   * repeated because its answer was lost (finish_again) */
  bool finished;
  /* A FinishUpload is checking it (under ds->mu): it stays in the table, and
   * another FinishUpload of it waits for the outcome instead of finding
   * nothing; the sweeper leaves it. */
  bool busy;
  /* Its grants were revoked on its agents (RevokeGrants): once is enough. */
  bool revoked;
  /* Who planned it: a reload that revokes that token undoes it (and its
   * grants), whoever holds the session now. */
  rpc_identity_t planner;
  /* the grants' nonces, one per rank (a fetch: one, its rank's) */
  uint8_t (*nonces)[GRANT_NONCE_LEN];
  /* upload */
  uint64_t ref, stream, mesh;
  tensor_meta_t meta;
  uint32_t *ranks;
  size_t nranks, each;
  uint64_t losses; /* the pool's agent losses when it was planned */
  /* fetch */
  fetch_t *fetch;
  /* A grant request held until a slot frees (plan_fetch_grant), referenced,
   * with a call reference to the session (a call in flight holds its lease);
   * its fetch is in ds->queued meanwhile. grant_cancelled: its call ended while
   * the sweeper answered it (busy), which then undoes the fetch (held_settle). */
  rpc_call_t *grant_call;
  bool grant_cancelled;
} transfer_t;

/* A direct fetch's Read grant once FinishFetch took the fetch out of the
 * table, kept unless the Read's receipt came with it (its Read took the
 * snapshot: the grant is spent). Without it (an abandoned plan, an older
 * client, a FinishFetch cut short) the grant stays good on its agent until
 * the snapshot's drop runs there, in its stream's order, behind whatever the
 * session queued after the plan; so it is kept until its expiry (the
 * sweeper), for a tokens reload that revokes its planner's token to revoke it
 * too (data_service_revoke): the reload ends that token's calls first, a
 * FinishFetch waiting for the mesh's ranks with them. */
typedef struct open_grant {
  struct open_grant *next;
  uint64_t id; /* its own (ds->open_grant_ids): who put it there takes it out by id,
                * not by pointer (the sweeper or a reload may have freed it, and
                * the memory may hold another's record by then) */
  session_t *sess; /* held (session_hold) */
  uint32_t rank;
  int64_t expiry_ms;
  rpc_identity_t planner;
  uint8_t nonce[1][GRANT_NONCE_LEN];
} open_grant_t;

/* Takes f, queued, out of ds->queued (under ds->mu). */
static void queue_unlink_locked(data_service_t *ds, fetch_t *f) {
  for (fetch_t **pp = &ds->queued; *pp; pp = &(*pp)->queued_next) {
    if (*pp != f) continue;
    queue_take_locked(ds, pp)->granting = NULL;
    return;
  }
}

/* Takes the transfer at *pp out of the table (under ds->mu). A grant request
 * held for it leaves the queue with it and stays in t->grant_call, for the
 * caller to end (grant_end): every way out of the table answers it. */
static transfer_t *pending_unlink_locked(data_service_t *ds, transfer_t **pp) {
  transfer_t *t = *pp;
  *pp = t->next;
  t->next = NULL;
  if (t->grant_call) queue_unlink_locked(ds, t->fetch);
  return t;
}

/* Ends t's held grant request, if any: with e, or (e NULL) without an answer,
 * its call being over (plan_end). */
static void grant_end(transfer_t *t, const meshd_error_t *e) {
  rpc_call_t *call = t->grant_call;
  if (!call) return;
  t->grant_call = NULL;
  if (e) finish_error(call, e);
  rpc_call_unref(call);
  session_release(t->fetch->sess); /* the held call's */
}

/* Frees t; undo: an upload's ref is deleted on its ranks (unless the session
 * closed: its EndSession freed everything), a fetch's snapshot dropped. */
static void transfer_free(data_service_t *ds, transfer_t *t, bool undo) {
  if (t->fetch) {
    if (t->grant_call) { /* (each path out of the table says why first; the server's end) */
      meshd_error_t e;
      error_set(&e, ERR_UNAVAILABLE, "PlanTransfer: fetch %llu was undone while its grant "
                "request waited for a slot", (unsigned long long)t->id);
      grant_end(t, &e);
    }
    fetch_abandon(t->fetch); /* a direct fetch's slot (it took no relay), after its drop */
    fetch_unref(t->fetch);
    free(t->nonces);
    free(t);
    return;
  }
  session_t *s = t->sess;
  if (undo && !t->finished) {
    pthread_mutex_lock(&s->mu);
    if (!atomic_load(&s->closed) && s->objects)
      refs_undo(ds, s, s->objects, t->ref, t->stream, t->ranks, t->nranks);
    pthread_mutex_unlock(&s->mu);
  }
  if (!t->failed && !t->finished) transfer_end(ds, s);
  session_unhold(s);
  free(t->ranks);
  free(t->nonces);
  free(t);
  live_done(ds);
}

static void transfer_put(data_service_t *ds, transfer_t *t) {
  pthread_mutex_lock(&ds->mu);
  t->next = ds->pending;
  ds->pending = t;
  pthread_mutex_unlock(&ds->mu);
}

/* The plan call's identity, for data_service_revoke. */
static void transfer_note_planner(transfer_t *t, rpc_call_t *call) {
  const rpc_identity_t *id = rpc_call_identity(call);
  if (id) t->planner = *id;
}

/* Where the session's pending transfer `id` of that kind is in the table
 * (*result NULL: none; a failed upload is none). Under ds->mu. */
static transfer_t **pending_find_locked(data_service_t *ds, uint64_t id, session_t *s,
                                        bool upload) {
  transfer_t **pp = &ds->pending, *t;
  while ((t = *pp) && !(t->id == id && !t->failed &&
                        (t->fetch ? t->fetch->sess : t->sess) == s && upload == !t->fetch))
    pp = &t->next;
  return pp;
}

/* g (allocated, or NULL) becomes the open grant of t, a fetch with a grant,
 * in the same step that takes t out of the table: a reload never finds it in
 * neither. Its id, or 0 when it did not. Under ds->mu. */
static uint64_t open_grant_put_locked(data_service_t *ds, transfer_t *t, open_grant_t *g) {
  if (!g || !t->nonces) return 0;
  g->id = ++ds->open_grant_ids;
  g->sess = t->fetch->sess;
  session_hold(g->sess);
  g->rank = t->fetch->rank;
  g->expiry_ms = t->expiry_ms;
  g->planner = t->planner;
  memcpy(g->nonce[0], t->nonces[0], GRANT_NONCE_LEN);
  g->next = ds->open_grants;
  ds->open_grants = g;
  return g->id;
}

/* Takes g out of ds->open_grants if it is still there (under ds->mu): whoever
 * does owns it. */
static bool open_grant_unlink_locked(data_service_t *ds, open_grant_t *g) {
  for (open_grant_t **pp = &ds->open_grants; *pp; pp = &(*pp)->next) {
    if (*pp != g) continue;
    *pp = g->next;
    g->next = NULL;
    return true;
  }
  return false;
}

/* The open grant `id` taken out of ds->open_grants, NULL if it is gone
 * already (revoked, or expired). Under ds->mu. */
static open_grant_t *open_grant_take_locked(data_service_t *ds, uint64_t id) {
  open_grant_t *g = ds->open_grants;
  while (g && g->id != id) g = g->next;
  return g && open_grant_unlink_locked(ds, g) ? g : NULL;
}

static void open_grant_free(open_grant_t *g) {
  session_unhold(g->sess);
  free(g);
}

/* A session's open grants on record at most: past them, the oldest is revoked
 * on its agent at once (open_grant_over_cap_locked), as a reload would, so
 * that a client planning and finishing fetches it never reads cannot grow the
 * record (walked under ds->mu at every sweep) for the grants' whole life. Its
 * FinishFetch said that fetch was over: its client runs no Read on it. */
#define OPEN_GRANTS_MAX DATA_TRANSFERS_MAX

/* Session s's oldest open grant when it has more than OPEN_GRANTS_MAX, out of
 * ds->open_grants (newest first) for the caller to revoke; NULL if none.
 * Under ds->mu. */
static open_grant_t *open_grant_over_cap_locked(data_service_t *ds, const session_t *s) {
  size_t n = 0;
  open_grant_t **oldest = NULL;
  for (open_grant_t **pp = &ds->open_grants; *pp; pp = &(*pp)->next)
    if ((*pp)->sess == s) {
      n++;
      oldest = pp;
    }
  if (n <= OPEN_GRANTS_MAX) return NULL;
  open_grant_t *g = *oldest;
  *oldest = g->next;
  g->next = NULL;
  return g;
}

/* The session's pending transfer `id`: an upload stays in the table, marked
 * busy, until transfer_settle (a FinishUpload asked again meanwhile waits for
 * the first's outcome); a fetch is taken out of it, its grant kept in og
 * (may be NULL; *og_id: its id, 0 when it was not: open_grant_put_locked). */
static transfer_t *transfer_take(data_service_t *ds, uint64_t id, session_t *s, bool upload,
                                 open_grant_t *og, uint64_t *og_id) {
  pthread_mutex_lock(&ds->mu);
  transfer_t **pp, *t;
  for (;;) {
    pp = pending_find_locked(ds, id, s, upload);
    t = *pp;
    if (!t || !t->busy) break;
    pthread_cond_wait(&ds->settled, &ds->mu);
  }
  uint64_t kept = 0;
  if (t && upload) t->busy = true;
  else if (t) kept = open_grant_put_locked(ds, pending_unlink_locked(ds, pp), og);
  pthread_mutex_unlock(&ds->mu);
  if (og_id) *og_id = kept;
  return t;
}

/* A FinishUpload decided about t (finished, or failed): visible to the next. */
static void transfer_settle(data_service_t *ds, transfer_t *t, bool finished, bool failed) {
  pthread_mutex_lock(&ds->mu);
  t->finished = t->finished || finished;
  t->failed = failed;
  t->busy = false;
  pthread_cond_broadcast(&ds->settled);
  pthread_mutex_unlock(&ds->mu);
}

static void grant_start(data_service_t *ds, transfer_t *t);

/* The sweeper's: the queued fetches that can take a slot now start (a proxied
 * Fetch) or get their grant (a direct fetch's held grant request), oldest
 * first; proxied ones whose call ended or whose session closed go (a direct
 * one's ends are its transfer's: pending_unlink_locked). */
static void queue_run(data_service_t *ds) {
  fetch_t *go = NULL, **tail = &go, *f, **pp;
  meshd_error_t full;
  pthread_mutex_lock(&ds->mu);
  for (pp = &ds->queued; (f = *pp);) {
    if (f->direct) { /* a closed session's: the table's pass ends it (sweeper_main) */
      if (atomic_load(&f->sess->closed) || transfer_begin(ds, f->sess, "PlanTransfer", &full)) {
        pp = &f->queued_next;
        continue;
      }
      f->granting->busy = true; /* answered outside the lock, still in the table */
    } else {
      bool gone = atomic_load(&f->gone) || atomic_load(&f->sess->closed);
      if (!gone && transfer_begin(ds, f->sess, "Fetch", &full)) {
        pp = &f->queued_next;
        continue;
      }
      f->queued_slot = !gone;
    }
    *tail = queue_take_locked(ds, pp);
    tail = &f->queued_next;
  }
  pthread_mutex_unlock(&ds->mu);
  while ((f = go)) {
    go = f->queued_next;
    f->queued_next = NULL;
    if (f->direct) {
      transfer_t *t = f->granting; /* (busy: nobody else touches it) */
      f->granting = NULL;
      grant_start(ds, t);
    } else {
      queued_start(f, f->queued_slot);
    }
  }
}

/* Ends the grant request held for t, which the sweeper took out of the table:
 * its session closed, or its fetch waited past the plan's expiry. */
static void grant_expired(data_service_t *ds, transfer_t *t) {
  fetch_t *f = t->fetch;
  meshd_error_t e;
  if (atomic_load(&f->sess->closed))
    error_set(&e, ERR_NO_SESSION, "PlanTransfer: session %.8s was closed while fetch %llu (of "
              "tensor %llu) waited for a transfer slot", f->session, (unsigned long long)t->id,
              (unsigned long long)f->ref);
  else
    error_set(&e, ERR_UNKNOWN_REF, "PlanTransfer: fetch %llu (of tensor %llu) waited for a "
              "transfer slot past its plan's expiry (--transfer-grant-ms %lld); its snapshot is "
              "dropped: fetch the tensor again", (unsigned long long)t->id,
              (unsigned long long)f->ref, (long long)ds->grant_ms);
  grant_end(t, &e);
}

/* Whether t's time is up at `now`: a fetch's at its expiry, an upload's
 * TRANSFER_UNDO_SLACK_MS later; or, with --server-fault expire:fail, a held
 * grant request's fetch at once (tests of that ending: with a short
 * --transfer-grant-ms a slow client's request could come after the expiry
 * instead of being held before it). Under ds->mu. */
static bool transfer_expired_locked(data_service_t *ds, const transfer_t *t, int64_t now) {
  int ms = 0;
  return t->expiry_ms + (t->fetch ? 0 : TRANSFER_UNDO_SLACK_MS) <= now ||
         (t->grant_call && fault_hit(ds->fault, "expire", -1, &ms) == FAULT_FAIL);
}

/* The open grants past their expiry, or of a closed session (its agents
 * ended it), out of ds->open_grants for the caller to free. Under ds->mu. */
static open_grant_t *open_grants_expired_locked(data_service_t *ds, int64_t now) {
  open_grant_t *out = NULL;
  for (open_grant_t **pp = &ds->open_grants, *g; (g = *pp);) {
    if (g->expiry_ms > now && !atomic_load(&g->sess->closed)) {
      pp = &g->next;
      continue;
    }
    *pp = g->next;
    g->next = out;
    out = g;
  }
  return out;
}

static void *sweeper_main(void *arg) {
  data_service_t *ds = arg;
  pthread_mutex_lock(&ds->mu);
  while (!ds->stop) {
    ds->kick = false;
    int64_t now = grant_now_unix_ms();
    transfer_t *expired = NULL, **pp = &ds->pending, *t;
    while ((t = *pp)) {
      /* A closed session's transfers go now: nothing of it can be finished or
       * read any more, and each holds the session (its object table). */
      session_t *ts = t->fetch ? t->fetch->sess : t->sess;
      if (!t->busy && ((ts && atomic_load(&ts->closed)) || transfer_expired_locked(ds, t, now))) {
        pending_unlink_locked(ds, pp);
        t->next = expired;
        expired = t;
      } else {
        pp = &t->next;
      }
    }
    open_grant_t *spent = open_grants_expired_locked(ds, now);
    pthread_mutex_unlock(&ds->mu);
    for (open_grant_t *g; (g = spent);) {
      spent = g->next;
      open_grant_free(g);
    }
    while ((t = expired)) {
      expired = t->next;
      session_t *ts = t->fetch ? t->fetch->sess : t->sess;
      if (!t->failed && !t->finished && !(ts && atomic_load(&ts->closed)))
        log_info("data", "direct %s of tensor %llu expired unfinished; %s",
                 t->fetch ? "fetch" : "upload",
                 (unsigned long long)(t->fetch ? t->fetch->ref : t->ref),
                 t->fetch ? "its snapshot is dropped" : "the ref stays undefined");
      if (t->grant_call) grant_expired(ds, t);
      transfer_free(ds, t, true);
    }
    queue_run(ds);
    pthread_mutex_lock(&ds->mu);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += SWEEP_MS * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec++;
      until.tv_nsec -= 1000000000L;
    }
    if (!ds->stop && !ds->kick) pthread_cond_timedwait(&ds->wake, &ds->mu, &until);
  }
  pthread_mutex_unlock(&ds->mu);
  return NULL;
}

/* One shard of the reply: rank's address and its grant (g signed with the
 * rank's call secret). g->nonce must be filled, and its times in the server's
 * clock: the rank's grant has them in its agent's (grant.h, Clocks), the
 * server's transfer keeps its own. */
static int shard_grant(data_service_t *ds, uint32_t rank, Meshd__Agent__V1__TransferGrant *g,
                       Meshd__V1__ShardGrant *out, meshd_error_t *e) {
  agent_target_t t;
  /* A copy of the pool's entry under its lock, no connection (the timeout
   * would be a channel's, and none is made): the sweeper answers held grant
   * requests with this, and never waits on an agent. */
  if (agent_pool_target(ds->pool, rank, 0, &t))
    return error_set(e, ERR_AGENT_LOST, "PlanTransfer: rank %u has no agent", rank);
  Meshd__Agent__V1__TransferGrant ag = *g;
  ag.rank = rank;
  ag.expiry_unix_ms = grant_agent_time(g->expiry_unix_ms, t.clock_offset_ms);
  ag.start_by_unix_ms = grant_agent_time(g->start_by_unix_ms, t.clock_offset_ms);
  out->rank = rank;
  out->address = strdup(t.address);
  int rc = out->address ? grant_issue(t.secret, &ag, &out->grant.data, &out->grant.len) : -1;
  memset(t.secret, 0, sizeof t.secret);
  if (rc) return error_set(e, ERR_QUOTA, "PlanTransfer: out of memory on the server");
  return 0;
}

/* How the client dials the shards' addresses (reply->agent_tls): with cluster
 * TLS the CA's PEM (*ca, for the caller to free after the reply) and the
 * agents' certificate name; nothing in plaintext. */
static int plan_tls(data_service_t *ds, Meshd__V1__PlanTransferReply *reply,
                    Meshd__V1__AgentTls *tls, char **ca, meshd_error_t *e) {
  const char *name = NULL;
  char err[300];
  if (agent_pool_client_tls(ds->pool, ca, &name, err, sizeof err) != 0)
    return error_set(e, ERR_UNAVAILABLE, "PlanTransfer: the agents' TLS CA for clients: %s", err);
  if (*ca) {
    tls->ca_pem = *ca;
    tls->server_name = (char *)name;
    reply->agent_tls = tls;
  }
  return 0;
}

static void shards_free(Meshd__V1__ShardGrant *sh, size_t n) {
  for (size_t i = 0; sh && i < n; i++) {
    free(sh[i].address);
    free(sh[i].grant.data);
  }
  free(sh);
}

/* What a PlanTransfer call keeps for its end (plan_end): its transfer's id,
 * and whether it is a grant request that was held (plan_fetch_grant). */
typedef struct {
  uint64_t id;
  bool held;
} plan_kept_t;

/* A plan's answer, once its transfer is in the table. The call keeps the
 * transfer's id: a call that ends cancelled (plan_end) never told its client
 * the id, and the plan is undone then rather than at its grants' expiry. A
 * held grant request (kept: false) kept it when it was held (plan_fetch_grant):
 * set only in its on_start, never beside its plan_end. */
static void plan_answer(data_service_t *ds, rpc_call_t *call, uint64_t id, bool keep,
                        const Meshd__V1__PlanTransferReply *reply) {
  if (keep) {
    plan_kept_t *kept = malloc(sizeof *kept); /* none: undone at expiry, as before */
    if (kept) *kept = (plan_kept_t){id, false};
    rpc_call_set_data(call, kept);
  }
  int ms = 0;
  switch (fault_hit(ds->fault, "plan", -1, &ms)) {
    case FAULT_FAIL:
      rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                      "PlanTransfer: injected fault (--server-fault): the answer is lost");
      return;
    case FAULT_HANG:
    case FAULT_SLOW:
      log_warn("data", "PlanTransfer: answer held %d ms (injected fault)", ms);
      if (rpc_call_reply_after(call, &reply->base, ms) == 0) return;
      break;
    default:
      break;
  }
  rpc_call_reply(call, &reply->base);
}

/* Ids and nonces from the kernel (grant_random): RAND_bytes cost 10-40 us a
 * call here, two per plan, a fifth of a 1 MiB upload's plan on the server. */
static uint64_t transfer_new_id(void) {
  uint64_t id = 0;
  while (id == 0)
    if (grant_random(&id, sizeof id)) return 0;
  return id;
}

/* An upload's plan: Upload's header checks, the ref claimed, the session
 * opened on every rank, a Write grant per rank. */
static int plan_upload(data_service_t *ds, session_t *s, rpc_call_t *call,
                       const Meshd__V1__UploadHeader *h, meshd_error_t *e) {
  if (transfer_begin(ds, s, "PlanTransfer", e)) return -1;
  upload_t *u = calloc(1, sizeof *u);
  transfer_t *t = calloc(1, sizeof *t);
  if (!u || !t) {
    free(u);
    free(t);
    transfer_end(ds, s);
    return error_set(e, ERR_QUOTA, "PlanTransfer: out of memory on the server");
  }
  u->ds = ds;
  u->session = s;
  int rc = upload_header(u, h, e);
  if (rc == 0) { /* checked now, claimed once the plan can be answered (below) */
    pthread_mutex_lock(&s->mu);
    rc = session_check_ref(s, u->ref, e);
    pthread_mutex_unlock(&s->mu);
  }
  if (rc) {
    free(u->ranks);
    free(u);
    free(t);
    transfer_end(ds, s);
    if (strncmp(e->msg, "Upload", 6) != 0) error_prefix(e, "PlanTransfer", ": ");
    return -1;
  }
  if (upload_open(u)) { /* closed since its header was checked: no grant for it */
    free(u->ranks);
    free(u);
    free(t);
    transfer_end(ds, s);
    return error_set(e, ERR_NO_SESSION, "PlanTransfer: session %.8s was closed", s->id);
  }
  live_add(ds);
  session_hold(s); /* the session, not its lease: the client keeps that alive */
  t->sess = s;
  t->ref = u->ref;
  t->stream = u->stream;
  t->mesh = u->mesh;
  t->meta = u->meta;
  t->ranks = u->ranks;
  t->nranks = u->nranks;
  t->each = u->each;
  t->expiry_ms = grant_now_unix_ms() + ds->grant_ms;
  t->losses = agent_pool_losses(ds->pool);
  transfer_note_planner(t, call);
  free(u);
  pthread_mutex_lock(&s->mu);
  for (size_t i = 0; s->objects && i < t->nranks; i++) objects_touch(s->objects, t->ranks[i]);
  pthread_mutex_unlock(&s->mu);

  Meshd__V1__ShardGrant *sh = calloc(t->nranks ? t->nranks : 1, sizeof *sh);
  Meshd__V1__ShardGrant **shp = calloc(t->nranks ? t->nranks : 1, sizeof *shp);
  t->nonces = calloc(t->nranks ? t->nranks : 1, sizeof *t->nonces);
  t->id = transfer_new_id();
  rc = sh && shp && t->nonces && t->id &&
               grant_random(t->nonces, GRANT_NONCE_LEN * t->nranks) == 0
           ? 0
           : error_set(e, ERR_QUOTA, "PlanTransfer: out of memory on the server");
  Meshd__Agent__V1__TensorSpec sp;
  tensor_spec_of(&sp, t->ref, &t->meta);
  Meshd__Agent__V1__TransferGrant g = MESHD__AGENT__V1__TRANSFER_GRANT__INIT;
  g.session_id = s->id;
  g.ref = t->ref;
  g.direction = GRANT_WRITE;
  g.expiry_unix_ms = t->expiry_ms;
  g.start_by_unix_ms = grant_start_by(t->expiry_ms, ds->grant_ms, ds->grant_start_ms);
  g.spec = &sp;
  for (size_t i = 0; rc == 0 && i < t->nranks; i++) {
    meshd__v1__shard_grant__init(&sh[i]);
    sh[i].address = NULL; /* (init's is protobuf-c's static "": shards_free frees it) */
    shp[i] = &sh[i];
    g.nonce.data = t->nonces[i];
    g.nonce.len = GRANT_NONCE_LEN;
    rc = shard_grant(ds, t->ranks[i], &g, &sh[i], e);
  }
  Meshd__V1__PlanTransferReply reply = MESHD__V1__PLAN_TRANSFER_REPLY__INIT;
  Meshd__V1__AgentTls tls = MESHD__V1__AGENT_TLS__INIT;
  char *ca = NULL;
  if (rc == 0) rc = plan_tls(ds, &reply, &tls, &ca, e);
  /* Claimed only now: a plan that failed before leaves the ref free, as its
   * client expects. No command takes it after; FinishUpload defines it. */
  if (rc == 0) {
    pthread_mutex_lock(&s->mu);
    rc = session_check_ref(s, t->ref, e) ? -1 : session_claim_ref(s, t->ref, e);
    pthread_mutex_unlock(&s->mu);
    if (rc) error_prefix(e, "PlanTransfer", ": ");
  }
  if (rc) {
    shards_free(sh, t->nranks);
    free(shp);
    free(ca);
    transfer_free(ds, t, false); /* no grant left the server: nothing to undo */
    return -1;
  }
  reply.transfer_id = t->id;
  reply.shards = shp;
  reply.n_shards = t->nranks;
  reply.expiry_unix_ms = t->expiry_ms;
  size_t n = t->nranks;
  uint64_t id = t->id;
  transfer_put(ds, t);
  plan_answer(ds, call, id, true, &reply);
  shards_free(sh, n);
  free(shp);
  free(ca);
  return 0;
}

/* A held grant request answered (held: t is in the table, busy, since
 * queue_run took a slot for it): t is not busy any more, its grant_call given
 * back to the caller; out of the table unless keep, and so whatever happens
 * when its call ended meanwhile (grant_cancelled: plan_end left it to us).
 * Returns whether it did. */
static bool held_settle(data_service_t *ds, transfer_t *t, bool keep) {
  pthread_mutex_lock(&ds->mu);
  bool cancelled = t->grant_cancelled;
  t->busy = t->grant_cancelled = false;
  t->grant_call = NULL;
  if (!keep || cancelled) {
    transfer_t **pp = &ds->pending;
    while (*pp && *pp != t) pp = &(*pp)->next;
    if (*pp) pending_unlink_locked(ds, pp);
  }
  pthread_cond_broadcast(&ds->settled);
  pthread_mutex_unlock(&ds->mu);
  return cancelled;
}

/* A planned fetch's answer: with its Read grant for the rank (a new expiry),
 * or, planned without a slot (f->waiting), slot_pending without a grant.
 * t is not in the table, or (held) in it and busy (held_settle); on failure
 * it is freed (its snapshot dropped). */
static int fetch_answer(data_service_t *ds, rpc_call_t *call, transfer_t *t, bool held,
                        meshd_error_t *e) {
  fetch_t *f = t->fetch;
  bool pending = atomic_load(&f->waiting);
  t->expiry_ms = grant_now_unix_ms() + ds->grant_ms;
  /* The token this answer goes to (a reload's check; held: the table's, which
   * data_service_revoke reads under ds->mu). */
  if (held) pthread_mutex_lock(&ds->mu);
  transfer_note_planner(t, call);
  if (held) pthread_mutex_unlock(&ds->mu);
  uint8_t *nonce = NULL; /* kept in t: a reload revokes its grant (grants_revoke) */
  if (!pending && !t->nonces) t->nonces = calloc(1, sizeof *t->nonces);
  if (!pending && t->nonces) nonce = t->nonces[0];
  Meshd__V1__ShardGrant sh = MESHD__V1__SHARD_GRANT__INIT, *shp = &sh;
  sh.address = NULL; /* (INIT's is protobuf-c's static "": freed below) */
  Meshd__Agent__V1__TransferGrant g = MESHD__AGENT__V1__TRANSFER_GRANT__INIT;
  g.session_id = f->session;
  g.ref = f->ref;
  g.direction = GRANT_READ;
  g.expiry_unix_ms = t->expiry_ms;
  g.start_by_unix_ms = grant_start_by(t->expiry_ms, ds->grant_ms, ds->grant_start_ms);
  g.after_seq = f->after_seq;
  g.nonce.data = nonce;
  g.nonce.len = GRANT_NONCE_LEN;
  sh.after_seq = f->after_seq;
  int rc = pending ? 0
           : nonce && grant_random(nonce, GRANT_NONCE_LEN) == 0
               ? shard_grant(ds, f->rank, &g, &sh, e)
               : error_set(e, ERR_QUOTA, "PlanTransfer: out of randomness on the server");
  Meshd__V1__PlanTransferReply reply = MESHD__V1__PLAN_TRANSFER_REPLY__INIT;
  Meshd__V1__AgentTls tls = MESHD__V1__AGENT_TLS__INIT;
  char *ca = NULL;
  if (rc == 0 && !pending) rc = plan_tls(ds, &reply, &tls, &ca, e);
  if (rc) {
    free(sh.address);
    free(sh.grant.data);
    if (held) held_settle(ds, t, false);
    transfer_free(ds, t, true);
    return -1;
  }
  reply.transfer_id = t->id;
  reply.shards = pending ? NULL : &shp;
  reply.n_shards = pending ? 0 : 1;
  reply.slot_pending = pending;
  reply.meta = &f->meta;
  reply.expiry_unix_ms = t->expiry_ms;
  /* Put first: FinishFetch names the id this reply carries. The reply points
   * into f, which an expiry (the sweeper) may free once t is put: held. */
  pthread_mutex_lock(&f->mu);
  f->refs++;
  pthread_mutex_unlock(&f->mu);
  uint64_t id = t->id;
  bool lost = false; /* a held request's call ended meanwhile: nobody gets the grant */
  if (held) lost = held_settle(ds, t, true);
  else transfer_put(ds, t);
  if (lost) transfer_free(ds, t, true); /* its slot and snapshot given back */
  else plan_answer(ds, call, id, !held, &reply);
  fetch_unref(f);
  free(sh.address);
  free(sh.grant.data);
  free(ca);
  return 0;
}

/* The grant of a fetch a plan answered slot_pending, once the session has a
 * slot for it: at once when one is free and no other fetch waits for one;
 * else the request is held (no answer yet) in ds->queued, behind the fetches
 * that wait already, and answered by the sweeper (queue_run, grant_start) as
 * a slot frees. Its call's end (cancelled, its deadline passed) undoes the
 * fetch (plan_end); the fetch's end (FinishFetch, expiry, the session's close,
 * a revoked token) ends the request with why. */
static int plan_fetch_grant(data_service_t *ds, session_t *s, rpc_call_t *call, uint64_t id,
                            meshd_error_t *e) {
  plan_kept_t *kept = malloc(sizeof *kept); /* a held call's, for plan_end */
  if (!kept) return error_set(e, ERR_QUOTA, "PlanTransfer: out of memory on the server");
  *kept = (plan_kept_t){id, true};
  meshd_error_t full;
  pthread_mutex_lock(&ds->mu);
  transfer_t **pp = pending_find_locked(ds, id, s, false), *t = *pp;
  fetch_t *f = t ? t->fetch : NULL;
  int rc = 0;
  if (!t)
    rc = error_set(e, ERR_UNKNOWN_REF, "PlanTransfer: this session has no pending fetch %llu (it "
                   "finished, or its grant expired)", (unsigned long long)id);
  else if (t->grant_call) /* (busy too: the sweeper answers it) */
    rc = error_set(e, ERR_BAD_ARGUMENT, "PlanTransfer: a grant request for fetch %llu waits for "
                   "a slot already; wait for its answer", (unsigned long long)id);
  else if (!atomic_load(&f->waiting))
    rc = error_set(e, ERR_BAD_ARGUMENT, "PlanTransfer: fetch %llu has its grant already (it was "
                   "planned with a slot)", (unsigned long long)id);
  /* Oldest first: a slot that freed for a queued fetch is not taken past it. */
  bool now = rc == 0 && atomic_load(&ds->nqueued) == 0 &&
             transfer_begin(ds, s, "PlanTransfer", &full) == 0;
  if (now) {
    pending_unlink_locked(ds, pp);
  } else if (rc == 0) {
    t->grant_call = call;
    rpc_call_ref(call);
    session_ref(s); /* a call in flight: it holds the session's lease */
    f->granting = t;
    queue_append_locked(ds, f);
    rpc_call_set_data(call, kept); /* in on_start: never beside plan_end */
    kept = NULL;
  }
  pthread_mutex_unlock(&ds->mu);
  free(kept);
  if (rc) return -1;
  if (!now) {
    kick(ds); /* a slot may have freed while it was queued */
    return 0;
  }
  atomic_store(&f->slot_freed, false);
  fetch_stop_waiting(f);
  return fetch_answer(ds, call, t, false, e);
}

/* A held grant request's slot, taken by queue_run (t busy in the table): its
 * grant, or the error that kept it from one. */
static void grant_start(data_service_t *ds, transfer_t *t) {
  fetch_t *f = t->fetch;
  rpc_call_t *call = t->grant_call;
  session_t *s = f->sess; /* the held call's reference keeps it past f */
  meshd_error_t e = {0};
  atomic_store(&f->slot_freed, false);
  fetch_stop_waiting(f);
  if (fetch_answer(ds, call, t, true, &e)) finish_error(call, &e);
  rpc_call_unref(call);
  session_release(s);
}

/* A fetch's plan: Fetch's checks and its Snapshot, a Read grant for the rank
 * (or slot_pending: FetchRequest.wait_for_slot). */
static int plan_fetch(data_service_t *ds, session_t *s, rpc_call_t *call,
                      const Meshd__V1__FetchRequest *rq, meshd_error_t *e) {
  if (rq->transfer_id) return plan_fetch_grant(ds, s, call, rq->transfer_id, e);
  bool waits;
  if (fetch_slot_begin(ds, s, "PlanTransfer", rq, &waits, e)) return -1;
  fetch_t *f = calloc(1, sizeof *f);
  transfer_t *t = calloc(1, sizeof *t);
  int rc = f && t ? 0 : error_set(e, ERR_QUOTA, "PlanTransfer: out of memory on the server");
  if (!rc) {
    pthread_mutex_lock(&s->mu);
    rc = fetch_plan(ds, s, rq, f, e);
    pthread_mutex_unlock(&s->mu);
  }
  if (rc) {
    if (waits) wait_end(s);
    else transfer_end(ds, s);
    if (f) fetch_free(f);
    free(t);
    return -1;
  }
  live_add(ds);
  f->ds = ds;
  f->direct = true;
  atomic_store(&f->slot_freed, waits);
  atomic_store(&f->waiting, waits);
  session_detach(s); /* f->sess's: the plan keeps the session, not its lease */
  f->sess_held = true;
  pthread_mutex_init(&f->mu, NULL);
  f->refs = 1; /* the transfer's, then FinishFetch's wait's */
  t->fetch = f;
  t->id = transfer_new_id();
  if (!t->id) {
    transfer_free(ds, t, true);
    return error_set(e, ERR_QUOTA, "PlanTransfer: out of randomness on the server");
  }
  return fetch_answer(ds, call, t, false, e);
}

static void plan_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  data_service_t *ds = arg;
  const Meshd__V1__PlanTransferRequest *rq = (const void *)req;
  if (ds->path == DATA_PATH_PROXY) {
    rpc_call_finish(call, GRPC_STATUS_FAILED_PRECONDITION, NULL,
                    "PlanTransfer: the server's --data-path is proxy: use Upload and Fetch");
    return;
  }
  session_t *s = session_from_call(ds->sessions, call);
  if (!s) return;
  meshd_error_t e = {0};
  int rc;
  if (rq->what_case == MESHD__V1__PLAN_TRANSFER_REQUEST__WHAT_UPLOAD)
    rc = plan_upload(ds, s, call, rq->upload, &e);
  else if (rq->what_case == MESHD__V1__PLAN_TRANSFER_REQUEST__WHAT_FETCH)
    rc = plan_fetch(ds, s, call, rq->fetch, &e);
  else
    rc = error_set(&e, ERR_BAD_ARGUMENT, "PlanTransfer: name an upload (an UploadHeader) or a "
                   "fetch (a FetchRequest)");
  session_release(s);
  if (rc) finish_error(call, &e);
}

/* Undoes a planned transfer nobody will finish, taken by the caller: a fetch
 * (out of the table) is freed with its snapshot; an upload (left in the table,
 * busy) is deleted on its ranks, gives its slot back and is settled failed, to
 * be undone again at its expiry (a Write still running could define it until
 * then) and FinishUpload refused. */
static void transfer_undo(data_service_t *ds, transfer_t *t) {
  if (t->fetch) {
    transfer_free(ds, t, true);
    return;
  }
  session_t *s = t->sess;
  pthread_mutex_lock(&s->mu);
  if (!atomic_load(&s->closed) && s->objects)
    refs_undo(ds, s, s->objects, t->ref, t->stream, t->ranks, t->nranks);
  pthread_mutex_unlock(&s->mu);
  transfer_end(ds, s);
  transfer_settle(ds, t, false, true);
}

/* A plan's call is over. Cancelled (the client's deadline passed, it gave up,
 * its connection dropped before the status went out), its client never
 * learned the transfer's id and nobody will finish it: its session slot and
 * a fetch's snapshot are given back now, not at the grants' expiry (eight
 * lost answers would block the session's transfers for --transfer-grant-ms).
 * An upload is undone on its ranks now and, like a refused FinishUpload, once
 * more at expiry (a client that kept the grant may still Write); its ref
 * stays claimed and undefined, as a client that lost the answer expects. A
 * grant request that ended while it was held, however it ended (cancelled,
 * or by the rpc layer: a drain, a revoked token), undoes its fetch too. */
static void plan_end(rpc_call_t *call, bool cancelled, void *arg) {
  data_service_t *ds = arg;
  plan_kept_t *kept = rpc_call_data(call);
  rpc_call_set_data(call, NULL);
  if (!kept) return;
  uint64_t id = kept->id;
  bool was_held = kept->held;
  free(kept);
  if (!cancelled && !was_held) return;
  pthread_mutex_lock(&ds->mu);
  transfer_t **pp = &ds->pending, *t;
  while ((t = *pp) && t->id != id) pp = &t->next;
  /* A grant request held for it (this call: it ended waiting) goes with it;
   * one the sweeper is answering (busy) is undone there (held_settle). */
  bool held = t && t->grant_call == call;
  if (!held && !cancelled) t = NULL; /* answered (the sweeper's grant_start, or an error) */
  if (held && t->busy) t->grant_cancelled = true;
  /* Busy, finished or failed: a FinishUpload came (the client had the
   * answer after all) and decides. */
  if (t && (t->busy || t->finished || t->failed)) t = NULL;
  if (t && t->fetch) pending_unlink_locked(ds, pp);
  else if (t) t->busy = true;
  pthread_mutex_unlock(&ds->mu);
  if (!t) return;
  if (held) {
    grant_end(t, NULL);
    log_info("data", "PlanTransfer: the grant request of a direct fetch of tensor %llu ended "
             "(%s) while it waited for a slot; the fetch is undone",
             (unsigned long long)t->fetch->ref,
             cancelled ? "cancelled, or its deadline passed" : "ended by the server");
  } else {
    log_info("data", "PlanTransfer of tensor %llu: its call was cancelled before the answer "
             "reached the client; the direct %s is undone",
             (unsigned long long)(t->fetch ? t->fetch->ref : t->ref), t->fetch ? "fetch" : "upload");
  }
  transfer_undo(ds, t);
}

/* Every receipt checked: the tensor is defined. Any receipt missing, short
 * or forged: the ref is deleted where it was written and stays undefined. */
/* A FinishUpload of an upload that finished: its answer was lost (the
 * client's deadline passed, the connection dropped), and the client asks
 * again rather than leave its tensor defined behind its back. The same answer
 * while the tensor stands as the upload defined it; NOT_FOUND once dropped.
 * t goes back to the table until its expiry. */
static void finish_again(data_service_t *ds, rpc_call_t *call, transfer_t *t) {
  session_t *s = t->sess;
  Meshd__V1__FinishUploadReply reply = MESHD__V1__FINISH_UPLOAD_REPLY__INIT;
  Meshd__V1__TensorMeta meta;
  int64_t dims[2 * LAYOUT_MAX_DIMS];
  pthread_mutex_lock(&s->mu);
  objects_t *o = atomic_load(&s->closed) ? NULL : s->objects;
  obj_t *obj = o ? objects_get(o, t->ref) : NULL;
  if (obj && obj->kind == OBJ_TENSOR) {
    command_tensor_meta(&meta, obj, dims);
    reply.tensor = &meta;
  }
  uint64_t ref = t->ref;
  pthread_mutex_unlock(&s->mu);
  transfer_settle(ds, t, true, false);
  if (reply.tensor) rpc_call_reply(call, &reply.base); /* meta and dims are copies */
  if (!reply.tensor)
    rpc_call_finish(call, GRPC_STATUS_NOT_FOUND, "UNKNOWN_REF",
                    "FinishUpload: upload of tensor %llu finished, and the tensor was dropped since",
                    (unsigned long long)ref);
}

/* --server-fault finish:slow=MS: a FinishUpload whose receipts checked out
 * waits before it defines its tensor (tests of a tokens reload meanwhile). */
static void finish_fault(data_service_t *ds, const meshd_error_t *e) {
  int ms = 0;
  if (e->kind != ERR_NONE || fault_hit(ds->fault, "finish", -1, &ms) != FAULT_SLOW) return;
  log_warn("data", "FinishUpload: held %d ms before it defines its tensor (injected fault)", ms);
  struct timespec d = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&d, NULL);
}

static void finish_upload_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  data_service_t *ds = arg;
  const Meshd__V1__FinishUploadRequest *rq = (const void *)req;
  session_t *s = session_from_call(ds->sessions, call);
  if (!s) return;
  transfer_t *t = transfer_take(ds, rq->transfer_id, s, true, NULL, NULL);
  session_release(s);
  if (!t) {
    rpc_call_finish(call, GRPC_STATUS_NOT_FOUND, "UNKNOWN_REF",
                    "FinishUpload: this session has no pending upload %llu (it failed, or its "
                    "grants expired and it was undone)", (unsigned long long)rq->transfer_id);
    return;
  }
  if (t->finished) {
    finish_again(ds, call, t);
    return;
  }
  meshd_error_t e = {0};
  /* An agent replaced since the plan holds nothing of it, and would not
   * verify the receipt its predecessor signed: that is the agent's loss, not
   * a bad receipt. */
  agent_pool_check_lost(ds->pool, t->ranks, t->nranks, t->losses, "FinishUpload", &e);
  for (size_t i = 0; i < t->nranks && e.kind == ERR_NONE; i++) {
    const Meshd__V1__WriteReceipt *r = NULL;
    for (size_t k = 0; k < rq->n_receipts && !r; k++)
      if (rq->receipts[k]->rank == t->ranks[i]) r = rq->receipts[k];
    agent_target_t tg;
    if (!r)
      error_set(&e, ERR_BAD_ARGUMENT, "FinishUpload: no receipt for rank %u", t->ranks[i]);
    else if (r->bytes != t->each)
      error_set(&e, ERR_BAD_ARGUMENT, "FinishUpload: rank %u's receipt is for %llu bytes, the "
                "tensor has %zu", t->ranks[i], (unsigned long long)r->bytes, t->each);
    else if (agent_pool_target(ds->pool, t->ranks[i], 0, &tg))
      error_set(&e, ERR_AGENT_LOST, "FinishUpload: rank %u has no agent (it was lost)",
                t->ranks[i]);
    else if (!grant_receipt_ok(tg.secret, t->nonces[i], GRANT_NONCE_LEN, t->ref, t->ranks[i],
                               r->bytes, r->receipt.data, r->receipt.len))
      error_set(&e, ERR_BAD_ARGUMENT, "FinishUpload: rank %u's receipt does not verify (not "
                "its agent's answer to this transfer's Write)", t->ranks[i]);
    memset(tg.secret, 0, sizeof tg.secret);
  }
  finish_fault(ds, &e);
  Meshd__V1__FinishUploadReply reply = MESHD__V1__FINISH_UPLOAD_REPLY__INIT;
  Meshd__V1__TensorMeta meta;
  int64_t dims[2 * LAYOUT_MAX_DIMS];
  obj_t *obj = NULL;
  /* Its tensor is defined before a reload that revokes this call's token or
   * the plan's, or not at all: the reload waits for the pin, and one that
   * came first is seen here (it ends this call anyway; the answer would be
   * lost and the tensor defined behind a revoked principal's back). */
  const rpc_identity_t *who[2] = {rpc_call_identity(call), &t->planner};
  bool pinned = e.kind == ERR_NONE && ds->auth;
  if (pinned && !(pinned = auth_pin(ds->auth, who, 2)))
    error_set(&e, ERR_UNAUTHENTICATED, "FinishUpload: the bearer token that planned this upload, "
              "or this call's, was revoked at a reload of --auth-tokens (SIGHUP)");
  pthread_mutex_lock(&s->mu);
  objects_t *o = objects_of(s);
  if (e.kind == ERR_NONE && atomic_load(&s->closed))
    error_set(&e, ERR_NO_SESSION, "FinishUpload: session %.8s was closed", s->id);
  if (e.kind == ERR_NONE && !o)
    error_set(&e, ERR_QUOTA, "FinishUpload: out of memory on the server");
  if (e.kind == ERR_NONE && o) {
    obj = upload_define(s, o, t->ref, &t->meta, t->mesh, t->stream, t->nranks, "FinishUpload", &e);
    if (obj) {
      command_tensor_meta(&meta, obj, dims);
      reply.tensor = &meta;
    }
  }
  pthread_mutex_unlock(&s->mu);
  if (pinned) auth_unpin(ds->auth);
  if (obj) {
    /* The slot first: a client that starts its next transfer on the answer
     * must find it free (--session-max-transfers). The transfer stays, as
     * finished, until its expiry: a client whose answer is lost asks again
     * (finish_again). Back in the table before the answer: a client that
     * asks again as soon as it got it (it lost it on its side) must find it
     * (it found nothing now and then under ASan). t is not ours once put. */
    count_bytes(ds, DIR_UPLOAD, PATH_DIRECT, t->each * t->nranks);
    transfer_end(ds, s);
    transfer_settle(ds, t, true, false);
    rpc_call_reply(call, &reply.base);
    return;
  }
  char msg[sizeof e.msg + 100];
  snprintf(msg, sizeof msg, "%s; tensor %llu stays undefined", e.msg, (unsigned long long)t->ref);
  /* Undone now, and again once the grants expired (a Write still running
   * may define it on its agent until then). The slot is free before the
   * answer, as on success: a client that falls back to the proxy on it (an
   * abandoned plan) must find the slot free (--session-max-transfers 1 found
   * it taken now and then). */
  pthread_mutex_lock(&s->mu);
  if (!atomic_load(&s->closed) && o)
    refs_undo(ds, s, o, t->ref, t->stream, t->ranks, t->nranks);
  pthread_mutex_unlock(&s->mu);
  transfer_end(ds, s);
  transfer_settle(ds, t, false, true);
  rpc_call_finish(call, error_kind_code(e.kind), error_kind_name(e.kind), "%s", msg);
}

/* Whether `receipt` is the Read receipt of f's agent for this transfer's grant
 * (DataChunk.read_receipt): that Read took the snapshot and lets go of it
 * itself. One that does not verify (forged, or signed by an agent replaced
 * since, whose snapshot went with it) is as none: the DropSnapshot follows,
 * which is always safe. */
static bool read_took_snapshot(data_service_t *ds, const fetch_t *f,
                               uint8_t (*nonces)[GRANT_NONCE_LEN],
                               const ProtobufCBinaryData *receipt) {
  agent_target_t tg;
  if (!nonces || !receipt->len || agent_pool_target(ds->pool, f->rank, 0, &tg)) return false;
  bool ok = grant_read_receipt_ok(tg.secret, nonces[0], GRANT_NONCE_LEN, f->ref, f->rank,
                                  f->after_seq, receipt->data, receipt->len);
  memset(tg.secret, 0, sizeof tg.secret);
  return ok;
}

/* A verified read receipt proves what the wait for the fetched rank would:
 * that its agent ran the session through after_seq (the Read waited for it
 * there) with the value good there (a failed value fails the Read, which then
 * sends no receipt). Its target moves last and is not waited for: the agent's
 * report of it can come well after the Read (70 ms once in ~300 back-to-back
 * fetches on a loaded machine), and a mesh of one rank is answered at once.
 * The other ranks are still waited for; the target stays for
 * failed_before_plan. A lost rank's removal (fetch_caught_up) keeps the order. */
static void fetch_rank_read(fetch_t *f) {
  for (size_t i = 0; i < f->ntargets; i++) {
    if (f->targets[i].rank != f->rank) continue;
    if (f->targets[i].seq > f->after_seq) return; /* sent after the Snapshot: not vouched for */
    watermark_target_t t = f->targets[i];
    f->targets[i] = f->targets[f->ntargets - 1];
    f->targets[f->ntargets - 1] = t;
    f->rank_read = true;
    return;
  }
}

static void open_grant_revoke(data_service_t *ds, open_grant_t *g);

/* The client read its shard: answered once every rank of the mesh ran what
 * came before the plan, with the tensor's failure if it failed anywhere. */
static void finish_fetch_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  data_service_t *ds = arg;
  const Meshd__V1__FinishFetchRequest *rq = (const void *)req;
  session_t *s = session_from_call(ds->sessions, call);
  if (!s) return;
  open_grant_t *og = calloc(1, sizeof *og); /* none: its grant is not revoked at a reload */
  uint64_t og_id; /* on record from here: og is the sweeper's and a reload's too */
  transfer_t *t = transfer_take(ds, rq->transfer_id, s, false, og, &og_id);
  session_release(s);
  if (!og_id) free(og);
  og = NULL;
  if (!t) {
    rpc_call_finish(call, GRPC_STATUS_NOT_FOUND, "UNKNOWN_REF",
                    "FinishFetch: this session has no pending fetch %llu (it finished, or its "
                    "grant expired)", (unsigned long long)rq->transfer_id);
    return;
  }
  fetch_t *f = t->fetch;
  if (t->grant_call) {
    meshd_error_t e;
    error_set(&e, ERR_UNKNOWN_REF, "PlanTransfer: fetch %llu was finished (FinishFetch) while "
              "this grant request waited for a slot", (unsigned long long)t->id);
    grant_end(t, &e);
  }
  if (read_took_snapshot(ds, f, t->nonces, &rq->read_receipt)) {
    atomic_store(&f->read_all, true); /* the Read lets go of it: no DropSnapshot */
    fetch_rank_read(f);
    /* Its grant is spent: nothing to revoke (unless a reload took it already). */
    pthread_mutex_lock(&ds->mu);
    open_grant_t *mine = og_id ? open_grant_take_locked(ds, og_id) : NULL;
    pthread_mutex_unlock(&ds->mu);
    if (mine) open_grant_free(mine);
  } else if (og_id) { /* on record: the session's oldest goes past OPEN_GRANTS_MAX */
    pthread_mutex_lock(&ds->mu);
    open_grant_t *oldest = open_grant_over_cap_locked(ds, f->sess);
    pthread_mutex_unlock(&ds->mu);
    if (oldest) {
      log_debug("data", "session %.8s: more than %d direct fetches finished unread hold a "
                "grant: the oldest one's is revoked on rank %u now", f->sess->id,
                OPEN_GRANTS_MAX, oldest->rank);
      open_grant_revoke(ds, oldest);
    }
  }
  free(t->nonces);
  free(t);
  session_attach(f->sess); /* a call in flight again: its wait holds the lease */
  f->sess_held = false;
  pthread_mutex_lock(&f->mu);
  f->refs++; /* the call's, until on_end (fetch_end) */
  pthread_mutex_unlock(&f->mu);
  f->call = call;
  rpc_call_ref(call);
  rpc_call_set_data(call, f);
  fetch_wait(f);
}

/* Tells the agents of `ranks` that these grants of session s (nonces[i]
 * rank i's, good until expiry_ms) are revoked (RevokeGrants), before any undo
 * follows on the same links: a grant not yet presented is refused, a Read or
 * Write it admitted is ended. An agent too old for it (registered
 * instructions < 25) is not told: its grant stays good until its start-by
 * time, as before, and what it writes is undone with the transfer. */
static void revoke_on_agents(data_service_t *ds, session_t *s, const uint32_t *ranks, size_t n,
                             uint8_t (*nonces)[GRANT_NONCE_LEN], int64_t expiry_ms) {
  int64_t keep = expiry_ms - grant_now_unix_ms() + TRANSFER_UNDO_SLACK_MS;
  Meshd__Agent__V1__RevokeGrants r = MESHD__AGENT__V1__REVOKE_GRANTS__INIT;
  Meshd__Agent__V1__Instruction ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ProtobufCBinaryData nonce = {GRANT_NONCE_LEN, NULL};
  r.nonces = &nonce;
  r.n_nonces = 1;
  r.keep_ms = keep > 1000 ? keep : 1000;
  ins.session_id = s->id;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_REVOKE_GRANTS;
  ins.revoke_grants = &r;
  pthread_mutex_lock(&s->mu);
  /* A closed session's agents ended it: they serve no Read or Write of it. */
  bool open = !atomic_load(&s->closed) && s->objects;
  for (size_t i = 0; open && nonces && i < n; i++) {
    uint32_t rank = ranks[i];
    char version[32] = "";
    if (agent_pool_first_without(ds->pool, &rank, 1, MESHD__AGENT__V1__INSTRUCTION__BODY_REVOKE_GRANTS,
                                 version, sizeof version) >= 0) {
      log_warn("data", "rank %u's agent (%s) is too old to be told of a revoked transfer grant: "
               "it admits one Read/Write until the grant's start-by time", rank, version);
      continue;
    }
    nonce.data = nonces[i];
    uint64_t seq = 0;
    if (agent_pool_send(ds->pool, rank, &ins, &seq) == 0) objects_sent(s->objects, rank, seq, 0);
  }
  pthread_mutex_unlock(&s->mu);
}

static void grants_revoke(data_service_t *ds, transfer_t *t) {
  if (t->fetch) revoke_on_agents(ds, t->fetch->sess, &t->fetch->rank, 1, t->nonces, t->expiry_ms);
  else revoke_on_agents(ds, t->sess, t->ranks, t->nranks, t->nonces, t->expiry_ms);
}

/* One transfer whose planner's token is revoked and that still has
 * something to revoke, taken for data_service_revoke (under ds->mu): a fetch
 * out of the table, an upload marked busy in it (the sweeper leaves it); NULL
 * with *wait when one is busy (a FinishUpload decides first: its pin sees the
 * reload), NULL when none is left. */
static transfer_t *revoke_next_locked(data_service_t *ds, bool (*revoked)(const rpc_identity_t *,
                                                                          void *),
                                      void *arg, bool *wait) {
  *wait = false;
  for (transfer_t **pp = &ds->pending, *t; (t = *pp); pp = &t->next) {
    session_t *ts = t->fetch ? t->fetch->sess : t->sess;
    if (!ts || t->finished || t->revoked || !revoked(&t->planner, arg)) continue;
    if (t->busy) {
      *wait = true;
      continue;
    }
    t->revoked = true;
    if (t->fetch) pending_unlink_locked(ds, pp);
    else t->busy = true; /* stays in the table, to be undone (again) at expiry */
    return t;
  }
  return NULL;
}

/* g, out of ds->open_grants: revoked on its agent, and let go. */
static void open_grant_revoke(data_service_t *ds, open_grant_t *g) {
  revoke_on_agents(ds, g->sess, &g->rank, 1, g->nonce, g->expiry_ms);
  open_grant_free(g);
}

/* The open grants (open_grant_t) whose planner's token is revoked: revoked on
 * their agents, and let go. */
static void open_grants_revoke(data_service_t *ds,
                               bool (*revoked)(const rpc_identity_t *id, void *arg), void *arg) {
  for (;;) {
    pthread_mutex_lock(&ds->mu);
    open_grant_t *g = ds->open_grants;
    while (g && !revoked(&g->planner, arg)) g = g->next;
    if (g) open_grant_unlink_locked(ds, g);
    pthread_mutex_unlock(&ds->mu);
    if (!g) return;
    log_info("data", "the Read grant of a direct fetch in session %.8s, left without its Read's "
             "receipt, is revoked: the token of principal '%s' that planned it was revoked at a "
             "tokens reload", g->sess->id, g->planner.name);
    open_grant_revoke(ds, g);
  }
}

int data_service_revoke(data_service_t *ds, bool (*revoked)(const rpc_identity_t *id, void *arg),
                        void *arg) {
  int n = 0;
  pthread_mutex_lock(&ds->mu);
  for (;;) {
    bool wait;
    transfer_t *t = revoke_next_locked(ds, revoked, arg, &wait);
    if (!t && !wait) break;
    if (!t) { /* a FinishUpload's checks are quick: bounded only by them */
      pthread_cond_wait(&ds->settled, &ds->mu);
      continue;
    }
    bool undo = t->fetch || !t->failed;
    pthread_mutex_unlock(&ds->mu);
    session_t *s = t->fetch ? t->fetch->sess : t->sess;
    log_info("data", "direct %s of tensor %llu in session %.8s %s: the token of principal '%s' "
             "that planned it was revoked at a tokens reload", t->fetch ? "fetch" : "upload",
             (unsigned long long)(t->fetch ? t->fetch->ref : t->ref), s->id,
             undo ? "undone, its grants revoked" : "failed before: its grants revoked",
             t->planner.name);
    grants_revoke(ds, t);
    if (t->grant_call) {
      meshd_error_t e;
      error_set(&e, ERR_UNAUTHENTICATED, "PlanTransfer: fetch %llu was undone while its grant "
                "request waited for a slot: the bearer token that planned it was revoked at a "
                "reload of --auth-tokens (SIGHUP)", (unsigned long long)t->id);
      grant_end(t, &e);
    }
    if (undo) {
      transfer_undo(ds, t);
      n++;
    } else {
      transfer_settle(ds, t, false, true); /* failed, as it was */
    }
    pthread_mutex_lock(&ds->mu);
  }
  pthread_mutex_unlock(&ds->mu);
  open_grants_revoke(ds, revoked, arg);
  return n;
}

/* ------------------------------------------------------------------ table */

data_service_t *data_service_create(agent_pool_t *pool, session_table_t *sessions,
                                    size_t max_message_bytes, int max_transfers) {
  data_service_t *ds = calloc(1, sizeof *ds);
  if (!ds) return NULL;
  ds->pool = pool;
  ds->sessions = sessions;
  ds->max_transfers = max_transfers > 0 && max_transfers < DATA_TRANSFERS_MAX
                          ? max_transfers : DATA_TRANSFERS_MAX;
  pthread_mutex_init(&ds->mu, NULL);
  pthread_cond_init(&ds->idle, NULL);
  ds->queued_tail = &ds->queued;
  size_t limit = max_message_bytes ? max_message_bytes : 4u << 20;
  ds->chunk = limit > 2048 ? limit / 2 : 1024; /* room for the envelope */
  if (ds->chunk > (1u << 20)) ds->chunk = 1u << 20;
  ds->path = DATA_PATH_AUTO;
  ds->grant_ms = 600000;
  ds->grant_start_ms = 60000;
  pthread_cond_init(&ds->wake, NULL);
  pthread_cond_init(&ds->settled, NULL);
  ds->sweeping = pthread_create(&ds->sweeper, NULL, sweeper_main, ds) == 0;
  return ds;
}

void data_service_set_fault(data_service_t *ds, fault_t *f) { ds->fault = f; }

void data_service_set_auth(data_service_t *ds, auth_t *auth) { ds->auth = auth; }

void data_service_set_max_relays(data_service_t *ds, int max_relays) {
  ds->max_relays = max_relays > 0 ? max_relays : 0;
}

void data_service_set_grant_start(data_service_t *ds, int64_t start_ms) {
  if (start_ms > 0) ds->grant_start_ms = start_ms;
}

void data_service_set_path(data_service_t *ds, data_path_t path, int64_t grant_ms) {
  ds->path = path;
  if (grant_ms > 0) ds->grant_ms = grant_ms;
}

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.v1.TensorService/Upload",
        .kind = RPC_CLIENT_STREAMING,
        .request = &meshd__v1__upload_chunk__descriptor,
        .on_start = upload_start,
        .on_message = upload_message,
        .on_end = upload_end,
        .on_raw = upload_raw,
    },
    {
        .path = "/meshd.v1.TensorService/Fetch",
        .kind = RPC_SERVER_STREAMING,
        .request = &meshd__v1__fetch_request__descriptor,
        .on_start = fetch_start,
        .on_end = fetch_end,
    },
    {
        .path = "/meshd.v1.TensorService/PlanTransfer",
        .kind = RPC_UNARY,
        .request = &meshd__v1__plan_transfer_request__descriptor,
        .on_start = plan_start,
        .on_end = plan_end,
    },
    {
        .path = "/meshd.v1.TensorService/FinishUpload",
        .kind = RPC_UNARY,
        .request = &meshd__v1__finish_upload_request__descriptor,
        .on_start = finish_upload_start,
    },
    {
        .path = "/meshd.v1.TensorService/FinishFetch",
        .kind = RPC_UNARY,
        .request = &meshd__v1__finish_fetch_request__descriptor,
        .on_start = finish_fetch_start,
        .on_end = fetch_end,
    },
};

const rpc_method_t *data_service_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
}

void data_service_destroy(data_service_t *ds) {
  if (!ds) return;
  pthread_mutex_lock(&ds->mu);
  ds->stop = true;
  pthread_cond_broadcast(&ds->wake);
  transfer_t *t = ds->pending;
  ds->pending = NULL;
  pthread_mutex_unlock(&ds->mu);
  if (ds->sweeping) pthread_join(ds->sweeper, NULL);
  /* Queued Fetches: their calls ended with the server's; the relays' go. (A
   * direct fetch's held grant request goes with its transfer, below.) */
  for (fetch_t *f = ds->queued, *next; f; f = next) {
    next = f->queued_next;
    if (f->direct) continue;
    atomic_store(&f->read_all, true); /* nothing is sent to agents any more */
    fetch_stop_waiting(f);
    relay_stop(f);
  }
  ds->queued = NULL; /* (no slot given back below wakes the stopped sweeper) */
  ds->queued_tail = &ds->queued;
  atomic_store(&ds->nqueued, 0);
  for (open_grant_t *g = ds->open_grants, *next; g; g = next) {
    next = g->next;
    open_grant_free(g);
  }
  ds->open_grants = NULL;
  while (t) { /* the server is gone: nothing is sent to agents any more */
    transfer_t *next = t->next;
    if (t->fetch) atomic_store(&t->fetch->read_all, true);
    transfer_free(ds, t, false);
    t = next;
  }
  /* Every call ended (the server shut down first): their relays stop at
   * their next step. Bounded, for an agent that does not answer a cancel. */
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 5;
  pthread_mutex_lock(&ds->mu);
  int rc = 0;
  while (ds->live > 0 && rc == 0) rc = pthread_cond_timedwait(&ds->idle, &ds->mu, &until);
  int left = ds->live;
  pthread_mutex_unlock(&ds->mu);
  if (left > 0) {
    log_warn("data", "%d Upload/Fetch call(s) still finishing at shutdown", left);
    return; /* leaked rather than freed under them */
  }
  pthread_cond_destroy(&ds->idle);
  pthread_cond_destroy(&ds->wake);
  pthread_cond_destroy(&ds->settled);
  pthread_mutex_destroy(&ds->mu);
  free(ds);
}
