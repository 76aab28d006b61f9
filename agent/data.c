/* Agent/Read and Agent/Write: tensor bytes in and out of a session's ref
 * table, row-major, chunked under the message limit.
 *
 * Both serve only sessions open on the agent (executor.h: the server opens a
 * session with an instruction before it writes to it) and check what they
 * are given as the Execute stream's instructions are checked (validate.h).
 *
 * Read streams the snapshot its server took with a Snapshot instruction at
 * seq after_seq (snapshot.h): the tensor as that point of its stream left
 * it, whatever ran after. When it has not run through after_seq yet (a
 * client's direct Read can overtake its Snapshot), a helper thread (never a
 * completion-queue thread; a parked one of read_pool when there is one)
 * waits until the session ran through after_seq and sends the TensorSpec;
 * the chunks are then read out of the snapshot one at a time as the peer
 * takes them, from callbacks of the call (the helper thread has ended: an
 * unread Read holds no thread, and no copy of a tensor nobody writes). The
 * wait ends at once when the call is cancelled; a seq the agent never
 * received is refused (far beyond: at once; otherwise after READ_UNSEEN_MS),
 * and at most READ_WAITING_MAX Reads wait at a time, half of them at most of
 * one session (waiting_take). A failed ref ends the
 * call with the failure's kind in the meshd-error-kind trailer and the root's
 * message.
 *
 * Write checks the spec, allocates the tensor and copies each chunk into it
 * as it arrives (exactly the spec's bytes), then defines the ref when the
 * client half-closes; a Write that ends otherwise frees it. A spec for
 * a session not open yet (its opening instruction may still be on its way)
 * pauses the call's reads for up to WRITE_OPEN_WAIT_MS on a helper thread
 * (at most WRITE_WAITING_MAX of them, half at most of one session); then it
 * is refused and nothing is stored. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agent.h"
#include "fault.h"
#include "execute.h"
#include "grant.h"
#include "log.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "refs.h"
#include "runtime.h"
#include "snapshot.h"
#include "validate.h"
#include "workpool.h"

#define READ_WAIT_MS 600000
/* A seq this agent has not received yet: answered within this long... */
#define READ_UNSEEN_MS 5000
/* ...or at once when it is this many beyond the last one received. */
#define READ_AHEAD_MAX 65536
#define READ_WAITING_MAX 64
#define WRITE_OPEN_WAIT_MS 3000
#define WRITE_WAITING_MAX 16
/* The share of those places one session may hold: its server lets it have
 * 64 transfers in flight, and a burst of them must not refuse every other
 * session's waiting Reads (or Writes) until it drains. */
#define WAITING_SHARE(max) ((max) / 2)
/* How often a waiting helper looks whether its call was cancelled. */
#define POLL_MS 100
#define CHUNK_DEFAULT (1u << 20)
#define CHUNK_MAX (3u << 20)
/* Chunks queued on a Read for a peer that does not take them: the rest
 * waits, with no thread, until the peer's flow control lets them go. */
#define READ_QUEUED 2

typedef struct read_job {
  rpc_call_t *call; /* referenced */
  executor_t *ex;   /* referenced */
  char session[64];
  uint64_t ref, after_seq;
  uint32_t chunk;
  bool waiting; /* holds a place in read_places */
  snapshot_t *snap;  /* what is read, once taken */
  size_t bytes, off; /* off: the bytes queued on the call so far */
  grant_watch_t watch; /* a client's direct Read: ended at its grant's expiry */
  bool granted;        /* ...admitted by its grant, whose nonce its receipt signs */
  uint8_t nonce[GRANT_NONCE_LEN];
} read_job_t;

static void fill_spec(Meshd__Agent__V1__TensorSpec *sp, uint64_t ref, const tensor_meta_t *m,
                      int64_t *strides) {
  meshd__agent__v1__tensor_spec__init(sp);
  layout_t l = m->layout;
  layout_make_contiguous(&l);
  memcpy(strides, l.strides, sizeof(int64_t) * (size_t)l.ndim);
  sp->ref = ref;
  sp->n_shape = sp->n_strides = (size_t)l.ndim;
  sp->shape = (int64_t *)m->layout.sizes;
  sp->strides = strides;
  sp->dtype = (Meshd__V1__DType)m->dtype;
}

static _Atomic int read_threads;

/* The helpers of waiting Reads park between Reads: a thread start cost
 * ~0.5 ms here, as much as a 1 MiB Read, and 1 in 5 to 20 back-to-back
 * direct 1 MiB fetches on a loaded 2-core machine overtook its Snapshot and
 * paid it. A burst's helpers beyond READ_PARKED end after their Read. */
#define READ_PARKED 8
#define READ_PARK_MS 10000
static _Atomic(workpool_t *) read_pool;
static pthread_once_t read_pool_once = PTHREAD_ONCE_INIT;

static void read_pool_init(void) {
  atomic_store(&read_pool, workpool_create("read-wait", READ_PARKED, READ_PARK_MS));
}

void data_read_helpers(unsigned long *started, int *parked) {
  workpool_stats_t st = {0};
  pthread_once(&read_pool_once, read_pool_init);
  workpool_t *pool = atomic_load(&read_pool);
  if (pool) st = workpool_stats(pool);
  *started = st.started;
  *parked = st.parked;
}

void data_stop(void) {
  pthread_once(&read_pool_once, read_pool_init); /* none made after this one is gone */
  workpool_destroy(atomic_exchange(&read_pool, NULL));
}

/* The places to wait on this agent, counted over all sessions and per
 * session. A lock, not atomics: the session's count and the total change
 * together. Taken once per call that waits (a Read whose seq is ready, a
 * Write whose session is open, takes none); the scan is short, and a
 * session holds an entry only while it holds a place (so max entries suffice). */
typedef struct waiting_places {
  pthread_mutex_t mu;
  int max, total;
  struct {
    char session[64];
    int n; /* 0: a free entry */
  } held[READ_WAITING_MAX];
} waiting_places_t;

typedef enum { PLACE_TAKEN, PLACES_FULL, SHARE_FULL } place_t;

static waiting_places_t read_places = {PTHREAD_MUTEX_INITIALIZER, READ_WAITING_MAX, 0, {{"", 0}}};
static waiting_places_t write_places = {PTHREAD_MUTEX_INITIALIZER, WRITE_WAITING_MAX, 0, {{"", 0}}};

/* The entry of session, or a free one (-1 when neither). Under p->mu. */
static int places_entry(waiting_places_t *p, const char *session) {
  int free_at = -1;
  for (int i = 0; i < p->max; i++) {
    if (p->held[i].n && strcmp(p->held[i].session, session) == 0) return i;
    if (!p->held[i].n && free_at < 0) free_at = i;
  }
  return free_at;
}

/* A place for one of session's calls to wait, or which bound refused it. */
static place_t waiting_take(waiting_places_t *p, const char *session) {
  place_t r = PLACES_FULL;
  pthread_mutex_lock(&p->mu);
  int i = p->total < p->max ? places_entry(p, session) : -1;
  if (i >= 0 && p->held[i].n >= WAITING_SHARE(p->max)) {
    r = SHARE_FULL;
  } else if (i >= 0) {
    if (!p->held[i].n) snprintf(p->held[i].session, sizeof p->held[i].session, "%s", session);
    p->held[i].n++;
    p->total++;
    r = PLACE_TAKEN;
  }
  pthread_mutex_unlock(&p->mu);
  return r;
}

/* Gives back a place waiting_take gave session: on every way a waiting call
 * ends (its wait over, cancelled, failed, or no thread to wait on). */
static void waiting_leave(waiting_places_t *p, const char *session) {
  pthread_mutex_lock(&p->mu);
  int i = places_entry(p, session);
  if (i >= 0 && p->held[i].n) {
    p->held[i].n--;
    p->total--;
  }
  pthread_mutex_unlock(&p->mu);
}

/* The refusal's words for the bound hit: "<n> Reads already wait for seqs",
 * which the clients match to retry it, in both. */
static void read_places_refused(place_t r, const char *session, char *why, size_t len) {
  if (r == SHARE_FULL)
    snprintf(why, len, "%d Reads already wait for seqs of session %s on this agent, the most one "
             "session may hold of its %d waiting places", WAITING_SHARE(READ_WAITING_MAX), session,
             READ_WAITING_MAX);
  else
    snprintf(why, len, "%d Reads already wait for seqs on this agent", READ_WAITING_MAX);
}

static const char *grant_kind(int code) {
  return code == GRPC_STATUS_PERMISSION_DENIED     ? "PERMISSION_DENIED"
         : code == GRPC_STATUS_RESOURCE_EXHAUSTED ? "QUOTA"
                                                   : "UNAVAILABLE";
}

int data_read_threads(void) { return atomic_load(&read_threads); }

/* Waits until the session ran through after_seq: 0, or -1 having answered
 * (or the call ended: nobody to answer). */
static int read_wait(read_job_t *j) {
  rpc_call_t *call = j->call;
  int64_t start = rpc_now_ms();
  for (;;) {
    if (executor_wait_session(j->ex, j->session, j->after_seq, POLL_MS) == 0) return 0;
    if (rpc_call_ended(call)) return -1;
    int64_t waited = rpc_now_ms() - start;
    uint64_t received = executor_received(j->ex);
    if (executor_closing(j->ex) || waited >= READ_WAIT_MS) {
      rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                      "Read: the agent did not execute through seq %llu (it is shutting down or "
                      "its server is gone)", (unsigned long long)j->after_seq);
      return -1;
    }
    if (received < j->after_seq && waited >= READ_UNSEEN_MS) {
      rpc_call_finish(call, GRPC_STATUS_FAILED_PRECONDITION, "UNAVAILABLE",
                      "Read: after_seq %llu was never sent to this agent (it received seqs "
                      "through %llu, %d ms ago still)", (unsigned long long)j->after_seq,
                      (unsigned long long)received, READ_UNSEEN_MS);
      return -1;
    }
  }
}

static void read_job_free(read_job_t *j) {
  transfer_grant_unwatch(&j->watch);
  rpc_call_unref(j->call); /* before the executor's: see write_open_main */
  snapshot_release(j->snap);
  executor_unref(j->ex);
  free(j);
}

static void read_drained(rpc_call_t *call, void *arg);

/* Queues the next chunks, READ_QUEUED at most: when the peer has not taken
 * them yet, goes on in read_drained (a callback of the call, once it has),
 * so a Read nobody reads holds no thread. Owns j: frees it at the end. */
static void read_pump(read_job_t *j) {
  rpc_call_t *call = j->call;
  while (j->off < j->bytes) {
    if (rpc_call_ended(call)) {
      read_job_free(j);
      return;
    }
    if (rpc_call_pending(call) >= READ_QUEUED &&
        rpc_call_when_drained(call, READ_QUEUED - 1, read_drained, j))
      return;
    size_t n = j->bytes - j->off < j->chunk ? j->bytes - j->off : j->chunk;
    meshd_error_t e = {0};
    /* A DataChunk{data} packed by hand around the bytes read straight into
     * it: one copy out of the tensor, none to pack (and the server forwards
     * it to its client as is). */
    uint8_t *dst = NULL;
    rpc_bytes_t *msg = rpc_bytes_field(MESHD__AGENT__V1__DATA_CHUNK__PART_DATA, n, &dst);
    if (!msg || snapshot_read(j->snap, j->off, n, dst, &e)) {
      rpc_bytes_free(msg);
      if (!msg) error_set(&e, ERR_QUOTA, "agent out of host memory");
      rpc_call_finish(call, error_kind_code(e.kind), error_kind_name(e.kind), "Read: %s", e.msg);
      read_job_free(j);
      return;
    }
    if (rpc_call_send_raw(call, msg) != 0) {
      read_job_free(j);
      return;
    }
    j->off += n;
  }
  rpc_call_finish(call, GRPC_STATUS_OK, NULL, "read");
  read_job_free(j);
}

static void read_drained(rpc_call_t *call, void *arg) {
  (void)call;
  read_pump(arg);
}

/* A direct Read's proof that it took its snapshot (DataChunk.read_receipt):
 * its client hands it to FinishFetch, and the server sends no DropSnapshot
 * for a snapshot that the Read lets go of itself. 0, or -1 (not registered
 * now: no receipt, and the server drops it as before). */
static int read_receipt(const read_job_t *j, uint8_t out[GRANT_MAC_LEN]) {
  char secret[SECRET_HEX_LEN + 1];
  int rc = agent_auth_secret(secret) ||
           grant_read_receipt(secret, j->nonce, sizeof j->nonce, j->ref,
                              (uint32_t)atomic_load(&agent_rank), j->after_seq, out);
  memset(secret, 0, sizeof secret);
  return rc ? -1 : 0;
}

/* On the Read's helper thread: waits for the seq, reads the shard out, sends
 * the spec, then hands the chunks to read_pump. Owns j. */
static void read_run(read_job_t *j) {
  rpc_call_t *call = j->call;
  int rc = read_wait(j);
  if (j->waiting) waiting_leave(&read_places, j->session);
  if (rc) {
    read_job_free(j);
    return;
  }
  ref_failure_t why = {0};
  rc = executor_take_snapshot(j->ex, j->session, j->after_seq, j->ref, &j->snap, &why);
  if (rc < 0) {
    rpc_call_finish(call, GRPC_STATUS_NOT_FOUND, "UNKNOWN_REF", "Read: %s", why.msg);
    read_job_free(j);
    return;
  }
  if (rc > 0) {
    rpc_call_finish(call, error_kind_code(why.kind), error_kind_name(why.kind), "%s", why.msg);
    read_job_free(j);
    return;
  }
  /* Whole elements per chunk. */
  size_t es = dtype_size(snapshot_meta(j->snap)->dtype);
  j->chunk = j->chunk < es ? (uint32_t)es : j->chunk - j->chunk % (uint32_t)es;
  j->bytes = snapshot_bytes(j->snap);
  Meshd__Agent__V1__DataChunk c = MESHD__AGENT__V1__DATA_CHUNK__INIT;
  Meshd__Agent__V1__TensorSpec sp;
  int64_t strides[LAYOUT_MAX_DIMS];
  fill_spec(&sp, j->ref, snapshot_meta(j->snap), strides);
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_SPEC;
  c.spec = &sp;
  c.session_id = j->session;
  uint8_t receipt[GRANT_MAC_LEN];
  if (j->granted && read_receipt(j, receipt) == 0) {
    c.read_receipt.data = receipt;
    c.read_receipt.len = sizeof receipt;
  }
  rpc_call_send(call, &c.base);
  read_pump(j);
}

static void read_job(void *arg) {
  read_run(arg);
  atomic_fetch_sub(&read_threads, 1);
}

static void *read_main(void *arg) {
  read_job(arg);
  return NULL;
}

/* j's wait on a helper: a parked one, else a new thread. 0, or -1 (none). */
static int read_helper_start(read_job_t *j) {
  pthread_once(&read_pool_once, read_pool_init);
  workpool_t *pool = atomic_load(&read_pool);
  if (pool) return workpool_run(pool, read_job, j);
  return runtime_spawn_detached("read", read_main, j); /* no memory for the pool (or data_stop ran) */
}

void data_read_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  const Meshd__Agent__V1__ReadRequest *req = (const void *)msg;
  char why[256];
  if (validate_session_id(req->session_id, why, sizeof why)) {
    rpc_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", "Read: %s", why);
    return;
  }
  int64_t grant_expiry = 0;
  uint8_t nonce[GRANT_NONCE_LEN];
  if (transfer_grant_call(call)) { /* a client's direct Read: its grant names this call */
    Meshd__Agent__V1__TransferGrant *g = NULL;
    char msg[300];
    int code = transfer_grant_admit(call, GRANT_READ,
                                    req->session_id, req->ref, req->after_seq, &g, msg, sizeof msg);
    if (code) {
      rpc_call_finish(call, (grpc_status_code)code, grant_kind(code), "Read: %s", msg);
      return;
    }
    grant_expiry = g->expiry_unix_ms;
    memcpy(nonce, g->nonce.data, GRANT_NONCE_LEN);
    protobuf_c_message_free_unpacked(&g->base, NULL);
  }
  executor_t *ex = execute_executor();
  if (!ex || !executor_backend(ex)) {
    if (ex) executor_unref(ex);
    if (grant_expiry) transfer_grant_give_back(nonce, req->session_id, grant_expiry); /* nothing read: the grant may come again */
    rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                    "Read: no server drives this agent (no Execute call)");
    return;
  }
  /* Decided here, so that a Read that cannot be answered takes no thread. */
  uint64_t received = executor_received(ex);
  bool ready = executor_wait_session(ex, req->session_id, req->after_seq, 0) == 0;
  grpc_status_code code = GRPC_STATUS_OK;
  const char *kind = NULL;
  if (req->after_seq > received && req->after_seq - received > READ_AHEAD_MAX) {
    code = GRPC_STATUS_FAILED_PRECONDITION;
    kind = "UNAVAILABLE";
    snprintf(why, sizeof why, "after_seq %llu is far beyond the seqs this agent received "
             "(through %llu)", (unsigned long long)req->after_seq, (unsigned long long)received);
  } else if (req->after_seq <= received && !executor_session_open(ex, req->session_id)) {
    code = GRPC_STATUS_NOT_FOUND;
    kind = "UNKNOWN_REF";
    snprintf(why, sizeof why, "session %s is not open on this agent", req->session_id);
  } else if (!ready) {
    place_t r = waiting_take(&read_places, req->session_id);
    if (r != PLACE_TAKEN) {
      code = GRPC_STATUS_RESOURCE_EXHAUSTED;
      kind = "QUOTA";
      read_places_refused(r, req->session_id, why, sizeof why);
    }
  }
  if (code != GRPC_STATUS_OK) {
    executor_unref(ex);
    if (grant_expiry) transfer_grant_give_back(nonce, req->session_id, grant_expiry); /* refused for a cause not the grant's */
    rpc_call_finish(call, code, kind, "Read: %s", why);
    return;
  }
  read_job_t *j = calloc(1, sizeof *j);
  if (!j) {
    if (!ready) waiting_leave(&read_places, req->session_id);
    executor_unref(ex);
    if (grant_expiry) transfer_grant_give_back(nonce, req->session_id, grant_expiry);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "agent out of memory");
    return;
  }
  j->call = call;
  j->ex = ex;
  j->waiting = !ready;
  snprintf(j->session, sizeof j->session, "%s", req->session_id);
  j->ref = req->ref;
  j->after_seq = req->after_seq;
  j->chunk = req->max_chunk_bytes ? req->max_chunk_bytes : CHUNK_DEFAULT;
  if (j->chunk > CHUNK_MAX) j->chunk = CHUNK_MAX;
  /* Within this agent's --max-message-bytes (a DataChunk's framing is a few
   * bytes): gRPC would end the call with a bare RESOURCE_EXHAUSTED. */
  int max_msg = rpc_call_max_message(call);
  if (max_msg > 64 && j->chunk > (uint32_t)max_msg - 64) j->chunk = (uint32_t)max_msg - 64;
  rpc_call_ref(call);
  if (grant_expiry) {
    j->granted = true;
    memcpy(j->nonce, nonce, sizeof j->nonce);
    transfer_grant_watch(&j->watch, call, "Read", nonce, grant_expiry);
  }
  if (ready) { /* nothing to wait for: no thread (a start cost ~0.5 ms, a 1 MiB Read's time) */
    read_run(j);
    return;
  }
  atomic_fetch_add(&read_threads, 1);
  int rc = read_helper_start(j);
  if (rc != 0) {
    atomic_fetch_sub(&read_threads, 1);
    if (j->waiting) waiting_leave(&read_places, j->session);
    if (grant_expiry) transfer_grant_give_back(nonce, req->session_id, grant_expiry);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "agent out of threads");
    read_job_free(j); /* unwatches its grant first: the watch thread must not find it freed */
  }
}

/* ------------------------------------------------------------------ write */

/* One Write call's state. Owned by the call (freed after on_end) and, while
 * it waits for its session to open, by that helper thread too. */
typedef struct write_state {
  _Atomic int owners;
  rpc_call_t *call;
  executor_t *ex; /* referenced once the spec arrived */
  char session[64];
  uint64_t ref;
  tensor_meta_t meta;
  agent_tensor_t t; /* the tensor being filled, chunk by chunk, in place */
  size_t bytes, got;
  bool have_spec, done;
  /* Admitted by a transfer grant (a client's direct Write): the spec came
   * from it, and the reply carries a receipt over its nonce. */
  bool granted;
  uint8_t nonce[GRANT_NONCE_LEN];
  int64_t expiry_ms;
  grant_watch_t watch; /* ended at the grant's expiry; unwatched at on_end */
} write_state_t;

static void write_release(write_state_t *w) {
  if (atomic_fetch_sub(&w->owners, 1) != 1) return;
  storage_release(w->t.storage); /* before the executor: its backend frees it */
  if (w->ex) executor_unref(w->ex);
  free(w);
}

static void write_fail(rpc_call_t *call, write_state_t *w, grpc_status_code code, const char *kind,
                       const char *msg);
static int write_spec(rpc_call_t *call, write_state_t *w, const Meshd__Agent__V1__DataChunk *c);

void data_write_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  write_state_t *w = calloc(1, sizeof *w);
  if (!w) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "agent out of memory");
    return;
  }
  atomic_init(&w->owners, 1);
  w->call = call;
  rpc_call_set_data(call, w);
  if (!transfer_grant_call(call)) return;
  Meshd__Agent__V1__TransferGrant *g = NULL;
  char msg[300];
  int code = transfer_grant_admit(call, GRANT_WRITE, NULL,
                                  0, 0, &g, msg, sizeof msg);
  if (code) return write_fail(call, w, (grpc_status_code)code, grant_kind(code), msg);
  w->granted = true;
  int ms = 0;
  const agent_info_t *info = arg;
  switch (fault_hit(info ? info->env.fault : NULL, "write", atomic_load(&agent_rank), &ms)) {
    case FAULT_FAIL:
      protobuf_c_message_free_unpacked(&g->base, NULL);
      snprintf(msg, sizeof msg, "injected fault (MESHD_FAULT) on rank %lld; nothing was stored",
               (long long)atomic_load(&agent_rank));
      return write_fail(call, w, GRPC_STATUS_UNAVAILABLE, "REMOTE_FAILURE", msg);
    case FAULT_SLOW: {
      struct timespec d = {ms / 1000, (long)(ms % 1000) * 1000000L};
      nanosleep(&d, NULL);
      break;
    }
    default:
      break;
  }
  memcpy(w->nonce, g->nonce.data, GRANT_NONCE_LEN);
  w->expiry_ms = g->expiry_unix_ms;
  snprintf(w->session, sizeof w->session, "%s", g->session_id); /* for a give-back */
  transfer_grant_watch(&w->watch, call, "Write", w->nonce, w->expiry_ms);
  Meshd__Agent__V1__DataChunk c = MESHD__AGENT__V1__DATA_CHUNK__INIT;
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_SPEC;
  c.spec = g->spec;
  c.session_id = g->session_id;
  /* Refused before a byte came (QUOTA, the session not open...): not the
   * grant's fault, which the client may present again. */
  if (write_spec(call, w, &c) < 0) transfer_grant_give_back(w->nonce, w->session, w->expiry_ms);
  protobuf_c_message_free_unpacked(&g->base, NULL);
}

static void write_fail(rpc_call_t *call, write_state_t *w, grpc_status_code code, const char *kind,
                       const char *msg) {
  w->done = true;
  rpc_call_finish(call, code, kind, "Write: %s", msg);
}

/* bound: the waiting places that were full (PLACE_TAKEN: it waited its time). */
static void write_not_open(write_state_t *w, place_t bound) {
  char why[400], full[200] = "";
  if (bound == SHARE_FULL)
    snprintf(full, sizeof full, " (%d Writes already wait for session %s to open, the most one "
             "session may hold of this agent's %d waiting places)",
             WAITING_SHARE(WRITE_WAITING_MAX), w->session, WRITE_WAITING_MAX);
  else if (bound == PLACES_FULL)
    snprintf(full, sizeof full, " (%d Writes already wait for sessions to open on this agent)",
             WRITE_WAITING_MAX);
  snprintf(why, sizeof why, "session %s is not open on this agent (the server opens a session "
           "with an instruction before it writes to it)%s; nothing was stored", w->session, full);
  /* Its kind too (as a Read's unseen seq): the server relays it, not AGENT_LOST. */
  write_fail(w->call, w, GRPC_STATUS_FAILED_PRECONDITION, "UNAVAILABLE", why);
}

/* The spec checked, its session open: the tensor its bytes go into (no
 * host copy: each chunk lands in the tensor's memory as it arrives). */
static int write_ready(write_state_t *w) {
  meshd_error_t e = {0};
  if (tensor_alloc(executor_backend(w->ex), NULL, &w->meta, &w->t, "Write", &e)) {
    write_fail(w->call, w, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", e.msg);
    return -1;
  }
  w->have_spec = true;
  return 0;
}

/* Bytes [got, got + n) of the row-major tensor, as a uint8 view of its
 * storage: from_host copies them wherever the memory is. */
static int write_bytes(write_state_t *w, const uint8_t *data, size_t n, meshd_error_t *e) {
  agent_tensor_t v = {.storage = w->t.storage};
  v.meta.dtype = DTYPE_UINT8;
  v.meta.layout.ndim = 1;
  v.meta.layout.sizes[0] = (int64_t)n;
  layout_make_contiguous(&v.meta.layout);
  v.meta.layout.offset = (int64_t)w->got;
  backend_t *b = executor_backend(w->ex);
  return n ? b->ops->from_host(b, NULL, &v, data, e) : 0;
}

/* The helper thread of a Write whose session is not open yet; the call's
 * reads are paused meanwhile, so no callback but on_end runs. */
static void *write_open_main(void *arg) {
  write_state_t *w = arg;
  rpc_call_t *call = w->call;
  bool open = false;
  int64_t start = rpc_now_ms();
  while (!rpc_call_ended(call) && !executor_closing(w->ex) &&
         rpc_now_ms() - start < WRITE_OPEN_WAIT_MS)
    if ((open = executor_wait_open(w->ex, w->session, POLL_MS))) break;
  waiting_leave(&write_places, w->session);
  if (!rpc_call_ended(call)) {
    int rc = open ? write_ready(w) : (write_not_open(w, PLACE_TAKEN), -1);
    if (rc == 0) rpc_call_resume_reads(call);
    else if (w->granted) transfer_grant_give_back(w->nonce, w->session, w->expiry_ms); /* no byte came: not the grant's fault */
  }
  /* The call first: the executor's last reference may let main go on to
   * shut gRPC down (executor_wait_all_freed), and the call's free uses it. */
  rpc_call_unref(call);
  write_release(w);
  return NULL;
}

/* Checks the spec: 0 to take the data, 1 waiting for the session to open,
 * -1 having failed the call. */
static int write_spec(rpc_call_t *call, write_state_t *w, const Meshd__Agent__V1__DataChunk *c) {
  const Meshd__Agent__V1__TensorSpec *sp = c->spec;
  char why[700];
  meshd_error_t e;
  if (validate_session_id(c->session_id, why, sizeof why))
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", why), -1;
  snprintf(w->session, sizeof w->session, "%s", c->session_id);
  if (validate_spec_meta(sp, "Write.spec", &w->meta, &e)) /* BAD_ARGUMENT, or QUOTA past a limit */
    return write_fail(call, w, error_kind_code(e.kind), error_kind_name(e.kind), e.msg), -1;
  if (sp->storage_offset || !layout_is_contiguous(&w->meta.layout)) {
    snprintf(why, sizeof why, "Write.spec: a write fills a row-major tensor (offset 0, row-major "
             "strides), got offset %lld", (long long)sp->storage_offset);
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", why), -1;
  }
  if (sp->ref == 0)
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                      "Write.spec: ref 0 is no tensor (refs are 1 and up)"), -1;
  layout_make_contiguous(&w->meta.layout);
  w->ref = sp->ref;
  w->bytes = tensor_nbytes(&w->meta);
  if (!(w->ex = execute_executor()) || !executor_backend(w->ex))
    return write_fail(call, w, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                      "no server drives this agent (no Execute call)"), -1;
  backend_t *b = executor_backend(w->ex);
  if (b->capacity && w->bytes > b->capacity) {
    snprintf(why, sizeof why, "tensor %llu needs %zu bytes, more than this agent's capacity of "
             "%llu", (unsigned long long)w->ref, w->bytes, (unsigned long long)b->capacity);
    return write_fail(call, w, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", why), -1;
  }
  if (executor_session_open(w->ex, w->session)) return write_ready(w);
  /* Its opening instruction may still be on the Execute stream: wait a
   * little, without reading the data meanwhile. */
  place_t place = waiting_take(&write_places, w->session);
  if (place != PLACE_TAKEN) {
    write_not_open(w, place);
    return -1;
  }
  rpc_call_pause_reads(call);
  rpc_call_ref(call);
  atomic_fetch_add(&w->owners, 1);
  int rc = runtime_spawn_detached("write-open", write_open_main, w);
  if (rc == 0) return 1;
  waiting_leave(&write_places, w->session);
  atomic_fetch_sub(&w->owners, 1); /* the call still holds one */
  rpc_call_unref(call);
  rpc_call_resume_reads(call);
  return write_fail(call, w, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "agent out of threads"), -1;
}

static void write_finish(rpc_call_t *call, write_state_t *w) {
  char why[700];
  if (!w->have_spec) return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                                       "no spec: the first chunk must be a TensorSpec");
  if (w->got != w->bytes) {
    snprintf(why, sizeof why, "got %zu bytes for tensor %llu, which needs %zu; nothing was stored",
             w->got, (unsigned long long)w->ref, w->bytes);
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", why);
  }
  uint8_t receipt[GRANT_MAC_LEN];
  if (w->granted) { /* the server undoes an expired transfer: nothing defined past it */
    char secret[SECRET_HEX_LEN + 1];
    int64_t now = grant_now_unix_ms();
    if (now >= w->expiry_ms)
      return write_fail(call, w, GRPC_STATUS_PERMISSION_DENIED, "PERMISSION_DENIED",
                        "transfer grant expired before the Write finished; nothing was stored");
    int rc = agent_auth_secret(secret) ||
             grant_receipt(secret, w->nonce, sizeof w->nonce, w->ref,
                           (uint32_t)atomic_load(&agent_rank), w->got, receipt);
    memset(secret, 0, sizeof secret);
    if (rc)
      return write_fail(call, w, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                        "cannot sign the receipt (not registered with a server now)");
  }
  int rc = executor_define(w->ex, w->session, w->ref, &w->t);
  if (rc == 2) { /* its undo ran first: defining it now would hold it for good */
    char why[200];
    snprintf(why, sizeof why, "tensor %llu was deleted on this agent before the write finished "
             "(the server undid the transfer); nothing was stored", (unsigned long long)w->ref);
    return write_fail(call, w, GRPC_STATUS_FAILED_PRECONDITION, "DROPPED", why);
  }
  if (rc > 0) { /* it ended meanwhile */
    char why[200];
    snprintf(why, sizeof why, "session %s ended on this agent during the write; nothing was "
             "stored", w->session);
    return write_fail(call, w, error_kind_code(ERR_NO_SESSION), "NO_SESSION", why);
  }
  if (rc)
    return write_fail(call, w, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA",
                      "agent out of memory defining the written tensor; nothing was stored");
  w->done = true;
  Meshd__Agent__V1__WriteReply r = MESHD__AGENT__V1__WRITE_REPLY__INIT;
  r.bytes = w->got;
  if (w->granted) {
    r.receipt.data = receipt;
    r.receipt.len = sizeof receipt;
  }
  rpc_call_reply(call, &r.base);
}

void data_write_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  write_state_t *w = rpc_call_data(call);
  if (!w || w->done) return;
  if (!msg) return write_finish(call, w);
  const Meshd__Agent__V1__DataChunk *c = (const void *)msg;
  char why[700];
  if (c->part_case == MESHD__AGENT__V1__DATA_CHUNK__PART_SPEC) {
    if (w->granted)
      return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", "a Write under a "
                        "transfer grant takes its spec from the grant: send data chunks only");
    if (w->have_spec || w->ex)
      return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", "a second spec");
    write_spec(call, w, c);
    return;
  }
  if (!w->have_spec)
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                      "data before the spec: the first chunk must be a TensorSpec");
  if (c->data.len > w->bytes - w->got) {
    snprintf(why, sizeof why, "got at least %zu bytes for tensor %llu, which needs %zu; nothing "
             "was stored", w->got + c->data.len, (unsigned long long)w->ref, w->bytes);
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", why);
  }
  meshd_error_t e = {0};
  if (write_bytes(w, c->data.data, c->data.len, &e))
    return write_fail(call, w, error_kind_code(e.kind), error_kind_name(e.kind), e.msg);
  w->got += c->data.len;
}

typedef struct write_piece {
  write_state_t *w;
  meshd_error_t e;
} write_piece_t;

static int write_piece(const uint8_t *p, size_t n, void *arg) {
  write_piece_t *wp = arg;
  if (write_bytes(wp->w, p, n, &wp->e)) return -1;
  wp->w->got += n;
  return 0;
}

/* A DataChunk{data} alone (what the server sends on from its client) goes
 * into the tensor straight from the message's bytes: no unpacking copies.
 * Anything else (the spec, a chunk too long) is unpacked as usual. */
bool data_write_raw(rpc_call_t *call, rpc_bytes_t *msg, void *arg) {
  write_state_t *w = rpc_call_data(call);
  size_t len;
  if (!w || w->done || !w->have_spec ||
      !rpc_bytes_is_field(msg, MESHD__AGENT__V1__DATA_CHUNK__PART_DATA, &len) ||
      len > w->bytes - w->got)
    return false;
  write_piece_t wp = {.w = w};
  if (rpc_bytes_field_visit(msg, write_piece, &wp))
    write_fail(call, w, error_kind_code(wp.e.kind), error_kind_name(wp.e.kind), wp.e.msg);
  rpc_bytes_free(msg);
  return true;
}

void data_write_end(rpc_call_t *call, bool cancelled, void *arg) {
  write_state_t *w = rpc_call_data(call);
  if (!w) return;
  transfer_grant_unwatch(&w->watch); /* the call may be freed once this returns */
  write_release(w);
}
