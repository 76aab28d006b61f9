/* Server half of the rpc layer: a method table served from one shared
 * completion queue by a pool of threads (GRPC_NOTES §2, §7).
 *
 * Each accepted call is an rpc_call_t with one embedded tag per batch kind.
 * At most one RECV_MESSAGE and one SEND_MESSAGE batch are in flight per call;
 * outgoing messages wait in an outbox. `refs` counts batches in flight, the
 * "alive" reference (from NEW until on_end has run) and handler references;
 * the call is freed when it reaches zero. */
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "rpc.h"
#include "rpc_tls.h"
#include "rpc_wire.h"
#include "runtime.h"

#define OUTBOX_HIGH 64 /* stop re-arming reads above this many queued messages */
#define OUTBOX_LOW 16  /* resume below this */

typedef enum { TAG_NEW, TAG_READ, TAG_WRITE, TAG_STATUS, TAG_CLOSE } tag_kind_t;

typedef struct tag {
  rpc_loop_fn fn; /* first, as in every tag on the process loop's queue (rpc_wire.h) */
  tag_kind_t kind;
  rpc_call_t *call;
} tag_t;

typedef struct outmsg {
  struct outmsg *next;
  grpc_byte_buffer *buf;
} outmsg_t;

typedef struct method_slot {
  const rpc_method_t *m;
  void *arg;    /* given with the row to rpc_server_add_methods */
  void *handle; /* from grpc_server_register_method */
  rpc_guard_fn guard; /* NULL: open to every caller */
  void *guard_arg;
} method_slot_t;

struct rpc_call {
  rpc_server_t *srv;
  int max_msg; /* srv's, kept: a relay may answer a closed call after srv is gone */
  method_slot_t *slot; /* NULL: a call to a method not in the table */
  grpc_call *call;
  grpc_call_details details; /* unknown methods only */
  grpc_metadata_array md;
  gpr_timespec deadline;
  grpc_byte_buffer *recv_buf;
  int close_cancelled; /* RECV_CLOSE_ON_SERVER out-param; read only after the CLOSE event */
  tag_t t_new, t_read, t_write, t_status, t_close;

  pthread_mutex_t mu;
  /* Held while a callback that can overlap another runs (a drain callback,
   * started by a write's completion, against the read chain's on_start /
   * on_raw / on_refused / on_message), never with mu held. */
  pthread_mutex_t cb_mu;
  _Atomic int refs; /* changed under mu, but for rpc_server_end_calls's (under srv->mu) */
  int in_callback;
  wire_arena_t *msg_arena; /* the message on_message is given lives here */
  bool keep_msg;           /* on_message took it (rpc_call_keep_message) */
  bool accepted;       /* counted in srv->active */
  bool started;        /* on_start ran: only then does on_end run */
  bool sent_initial_md;
  bool reading, read_paused, writing;
  int read_pauses; /* rpc_call_pause_reads minus rpc_call_resume_reads */
  int send_holds;  /* rpc_call_hold_sends minus rpc_call_release_sends */
  bool status_queued, status_started;
  bool closed;          /* CLOSE event seen */
  bool end_done;        /* on_end ran (or is running) */
  bool cancelled;
  outmsg_t *out_head, *out_tail;
  size_t out_len;
  grpc_status_code status_code;
  grpc_slice status_details;
  grpc_metadata trailer;
  bool has_trailer;
  void *data;
  bool has_identity;
  rpc_identity_t identity; /* what the guard admitted the call as */
  /* A unary or server-streaming call whose request is being read: on_start
   * waits for it. */
  bool first_read;
  /* A streaming request of a caller not authenticated, in srv's open list
   * until its first message (or half-close) comes. */
  bool stream_open;
  /* Under srv->mu: one of srv's open requests (a caller not authenticated,
   * its request incomplete), and its place in that list, oldest first. */
  bool in_open;
  int64_t open_ms; /* rpc_now_ms when it entered the open list */
  /* srv's live list (under srv->mu): accepted and not ended. */
  struct rpc_call *live_prev, *live_next;
  struct rpc_call *open_prev, *open_next;
  /* rpc_call_when_drained: cb runs once out_len <= drain_below, or at the end. */
  void (*drain_cb)(rpc_call_t *call, void *arg);
  void *drain_arg;
  size_t drain_below;
};

struct rpc_server {
  int max_msg; /* GRPC_ARG_MAX_SEND_MESSAGE_LENGTH: rpc_call_reply refuses larger */
  grpc_server *server;
  grpc_completion_queue *cq; /* its own, or the process loop's (in_loop) */
  bool in_loop;              /* served by the process loop (rpc_loop_start): no threads */
  grpc_completion_queue *shutdown_cq;
  pthread_t *threads;
  int nthreads;  /* its own, or the loop's (in_loop): the calls it asks for scale with them */
  int nworkers;  /* threads it started (none on the loop) */
  int port;
  char listen[256];
  bool started, stopping, shut_down;
  grpc_server_credentials *creds;
  pthread_rwlock_t cq_lock; /* batches (read) vs the cq's shutdown (write) */
  bool cq_closed;           /* under cq_lock */
  rpc_tls_server_t *tls; /* the certificate fetcher's state (TLS only) */
  void (*before_wait)(void);
  method_slot_t *slots;
  size_t nslots, cap;
  int posts_per_method;
  pthread_mutex_t mu;
  int active;
  /* Batches and requests started and not yet dispatched: a server on the
   * process loop is freed only once none is left on the loop's queue. */
  int tags_out;
  pthread_cond_t tags_cv;
  int shutdown_tag;
  /* Requests of callers that nothing authenticated, not complete yet (under
   * mu): gRPC holds up to a message each; past max_open the oldest goes. */
  int max_open, nopen;
  rpc_call_t *open_head, *open_tail;
  rpc_call_t *live_head; /* accepted calls not ended yet (under mu) */
  /* How many rpc_server_end_calls_of ran, and the last one's question and
   * status (under mu): a call whose guard ran while one looked for calls to
   * end had no identity yet to be seen by it, and is asked again
   * (guard_ask_again). */
  _Atomic uint64_t revocations;
  bool (*revoked)(const rpc_identity_t *id, void *arg);
  void *revoked_arg;
  grpc_status_code revoked_code;
  char revoked_msg[300];
};

static void post_request(rpc_server_t *srv, method_slot_t *slot);

/* The last revocation's question about an identity its guard admitted while
 * that revocation ran: OK, or its status with why ("principal 'NAME': msg",
 * as rpc_server_end_calls_of writes it). */
static grpc_status_code guard_ask_again(rpc_server_t *srv, const rpc_identity_t *id, char *why,
                                        size_t len) {
  pthread_mutex_lock(&srv->mu);
  bool (*revoked)(const rpc_identity_t *, void *) = srv->revoked;
  void *arg = srv->revoked_arg;
  grpc_status_code code = srv->revoked_code;
  char msg[sizeof srv->revoked_msg];
  memcpy(msg, srv->revoked_msg, sizeof msg);
  pthread_mutex_unlock(&srv->mu);
  if (!revoked || !revoked(id, arg)) return GRPC_STATUS_OK;
  if (snprintf(why, len, "principal '%s': %s", id->name, msg) >= (int)len)
    why[len - 1] = '\0'; /* cut: the start says which and why */
  return code;
}

static void start_reading_locked(rpc_call_t *c);
static void pump_locked(rpc_call_t *c);

/* ------------------------------------------------------------------ refs */

static void call_free(rpc_call_t *c) {
  grpc_metadata_array_destroy(&c->md);
  if (!c->slot) grpc_call_details_destroy(&c->details);
  if (c->recv_buf) grpc_byte_buffer_destroy(c->recv_buf);
  for (outmsg_t *o = c->out_head, *next; o; o = next) {
    next = o->next;
    grpc_byte_buffer_destroy(o->buf);
    free(o);
  }
  grpc_slice_unref(c->status_details);
  if (c->has_trailer) grpc_slice_unref(c->trailer.value);
  if (c->call) grpc_call_unref(c->call);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->cb_mu);
  free(c);
}

void rpc_call_ref(rpc_call_t *c) {
  pthread_mutex_lock(&c->mu);
  c->refs++;
  pthread_mutex_unlock(&c->mu);
}

void rpc_call_unref(rpc_call_t *c) {
  pthread_mutex_lock(&c->mu);
  int left = --c->refs;
  pthread_mutex_unlock(&c->mu);
  if (left == 0) call_free(c);
}

static rpc_call_t *call_new(rpc_server_t *srv, method_slot_t *slot) {
  rpc_call_t *c = calloc(1, sizeof *c);
  if (!c) abort(); /* a server that cannot allocate 300 bytes cannot do anything useful */
  c->srv = srv;
  c->max_msg = srv->max_msg;
  c->slot = slot;
  pthread_mutex_init(&c->mu, NULL);
  pthread_mutex_init(&c->cb_mu, NULL);
  grpc_metadata_array_init(&c->md);
  if (!slot) grpc_call_details_init(&c->details);
  c->status_details = grpc_empty_slice();
  c->t_new = (tag_t){rpc_server_event, TAG_NEW, c};
  c->t_read = (tag_t){rpc_server_event, TAG_READ, c};
  c->t_write = (tag_t){rpc_server_event, TAG_WRITE, c};
  c->t_status = (tag_t){rpc_server_event, TAG_STATUS, c};
  c->t_close = (tag_t){rpc_server_event, TAG_CLOSE, c};
  c->refs = 1; /* the NEW batch */
  return c;
}

/* ------------------------------------------------------------------ batches */

static void tags_started(rpc_server_t *srv) {
  pthread_mutex_lock(&srv->mu);
  srv->tags_out++;
  pthread_mutex_unlock(&srv->mu);
}

/* A tag of srv was dispatched: srv is not touched after this. */
static void tags_done(rpc_server_t *srv) {
  pthread_mutex_lock(&srv->mu);
  if (--srv->tags_out == 0) pthread_cond_broadcast(&srv->tags_cv);
  pthread_mutex_unlock(&srv->mu);
}

static bool start_batch_locked(rpc_call_t *c, grpc_op *ops, size_t n, tag_t *tag) {
  /* Once the server's queue is shutting down no batch may start on it (gRPC
   * asserts in grpc_cq_begin_op): a handler released late by shutdown (a read
   * re-armed after its on_message returned) must find it closed instead. */
  pthread_rwlock_rdlock(&c->srv->cq_lock);
  grpc_call_error e = GRPC_CALL_ERROR_COMPLETION_QUEUE_SHUTDOWN;
  if (!c->srv->cq_closed) {
    tags_started(c->srv); /* before: another thread may dispatch it at once */
    e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    if (e != GRPC_CALL_OK) tags_done(c->srv);
  }
  pthread_rwlock_unlock(&c->srv->cq_lock);
  if (e == GRPC_CALL_ERROR_COMPLETION_QUEUE_SHUTDOWN) return false;
  if (e != GRPC_CALL_OK) {
    log_error("rpc", "%s: start_batch failed: %s", rpc_call_method(c), grpc_call_error_to_string(e));
    return false;
  }
  c->refs++;
  return true;
}

static size_t add_initial_md(rpc_call_t *c, grpc_op *op) {
  if (c->sent_initial_md) return 0;
  memset(op, 0, sizeof *op);
  op->op = GRPC_OP_SEND_INITIAL_METADATA;
  c->sent_initial_md = true;
  return 1;
}

/* Sends what can be sent: the next queued message, then the status. When the
 * status is queued and one message is left, both go in one batch (unary). */
static void pump_locked(rpc_call_t *c) {
  if (c->writing || c->status_started || c->closed || c->send_holds > 0) return;
  grpc_op ops[4];
  size_t n = 0;
  if (c->out_head) {
    n += add_initial_md(c, &ops[n]);
    memset(&ops[n], 0, sizeof ops[n]);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = c->out_head->buf;
    n++;
    bool with_status = c->status_queued && c->out_head->next == NULL;
    if (!with_status) {
      c->writing = start_batch_locked(c, ops, n, &c->t_write);
      return;
    }
  } else if (!c->status_queued) {
    return;
  }
  n += add_initial_md(c, &ops[n]);
  memset(&ops[n], 0, sizeof ops[n]);
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = c->status_code;
  ops[n].data.send_status_from_server.status_details = &c->status_details;
  ops[n].data.send_status_from_server.trailing_metadata_count = c->has_trailer ? 1 : 0;
  ops[n].data.send_status_from_server.trailing_metadata = c->has_trailer ? &c->trailer : NULL;
  n++;
  c->status_started = start_batch_locked(c, ops, n, &c->t_status);
}

static void start_reading_locked(rpc_call_t *c) {
  if (c->reading || c->closed || c->status_queued) return;
  if (c->out_len > OUTBOX_HIGH || c->read_pauses > 0) {
    c->read_paused = true;
    return;
  }
  c->read_paused = false;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &c->recv_buf;
  c->reading = start_batch_locked(c, &op, 1, &c->t_read);
}

/* ------------------------------------------------------------------ call API */

static int queue_locked(rpc_call_t *c, grpc_byte_buffer *buf) {
  if (c->closed || c->status_queued) {
    grpc_byte_buffer_destroy(buf);
    return -1;
  }
  outmsg_t *o = malloc(sizeof *o);
  if (!o) {
    grpc_byte_buffer_destroy(buf);
    return -1;
  }
  o->next = NULL;
  o->buf = buf;
  if (c->out_tail) c->out_tail->next = o;
  else c->out_head = o;
  c->out_tail = o;
  c->out_len++;
  return 0;
}

int rpc_call_send_raw(rpc_call_t *c, rpc_bytes_t *msg) {
  if (!msg) return -1;
  pthread_mutex_lock(&c->mu);
  int rc = queue_locked(c, msg);
  if (rc == 0) pump_locked(c);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int rpc_call_send(rpc_call_t *c, const ProtobufCMessage *msg) {
  grpc_byte_buffer *buf = wire_pack(msg); /* packed outside the lock */
  pthread_mutex_lock(&c->mu);
  int rc = queue_locked(c, buf);
  if (rc == 0) pump_locked(c);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static void finish_locked(rpc_call_t *c, grpc_status_code code, const char *kind, const char *msg) {
  if (c->status_queued || c->closed) return;
  c->status_queued = true;
  c->status_code = code;
  grpc_slice_unref(c->status_details);
  c->status_details = grpc_slice_from_copied_string(msg ? msg : "");
  if (kind && *kind) {
    c->trailer.key = grpc_slice_from_static_string(RPC_KIND_KEY);
    c->trailer.value = grpc_slice_from_copied_string(kind);
    c->has_trailer = true;
  }
  pump_locked(c);
}

void rpc_call_finish(rpc_call_t *c, grpc_status_code code, const char *kind, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&c->mu);
  finish_locked(c, code, kind, msg);
  pthread_mutex_unlock(&c->mu);
}

void rpc_call_abort(rpc_call_t *c, grpc_status_code code, const char *kind, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&c->mu);
  if (c->status_queued || c->closed) {
    pthread_mutex_unlock(&c->mu);
    return;
  }
  /* What gRPC has not been handed yet goes; a message in flight stays ours
   * until on_write. */
  outmsg_t *keep = c->writing ? c->out_head : NULL;
  for (outmsg_t *p = keep ? keep->next : c->out_head, *next; p; p = next) {
    next = p->next;
    grpc_byte_buffer_destroy(p->buf);
    free(p);
  }
  if (keep) keep->next = NULL;
  c->out_head = c->out_tail = keep;
  c->out_len = keep ? 1 : 0;
  if (!c->writing && c->send_holds == 0) {
    finish_locked(c, code, kind, msg); /* nothing ahead of it: it goes now */
  } else {
    /* A message the peer does not take (flow control) would hold the
     * status back: the stream is reset instead, the status in it. */
    c->status_queued = c->status_started = true; /* no status batch after the reset */
    grpc_call_cancel_with_status(c->call, code, msg, NULL);
  }
  pthread_mutex_unlock(&c->mu);
}

int64_t rpc_call_deadline_left_ms(const rpc_call_t *c) {
  gpr_timespec d = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
  if (gpr_time_cmp(d, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0) return -1;
  int64_t left = gpr_time_to_millis(gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC)));
  return left > 0 ? left : 0;
}

void rpc_call_reply(rpc_call_t *c, const ProtobufCMessage *msg) {
  pthread_mutex_lock(&c->mu);
  bool closed = c->closed; /* nothing to answer; its server may be gone (a late relay) */
  pthread_mutex_unlock(&c->mu);
  if (closed) return;
  size_t n = protobuf_c_message_get_packed_size(msg);
  if (n > (size_t)c->max_msg) { /* gRPC would fail the call with a bare RESOURCE_EXHAUSTED */
    char text[256];
    snprintf(text, sizeof text, "%s: the reply is %zu bytes, over this process's %d-byte "
             "message limit (--max-message-bytes)", c->slot ? c->slot->m->path : "reply", n,
             c->max_msg);
    pthread_mutex_lock(&c->mu);
    finish_locked(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", text);
    pthread_mutex_unlock(&c->mu);
    return;
  }
  grpc_byte_buffer *buf = wire_pack(msg);
  pthread_mutex_lock(&c->mu);
  if (queue_locked(c, buf) == 0) finish_locked(c, GRPC_STATUS_OK, NULL, "");
  pthread_mutex_unlock(&c->mu);
}

int rpc_call_max_message(const rpc_call_t *c) { return c->max_msg; }

size_t rpc_call_pending(rpc_call_t *c) {
  pthread_mutex_lock(&c->mu);
  size_t n = c->out_len;
  pthread_mutex_unlock(&c->mu);
  return n;
}

/* read_paused is set only by start_reading_locked, which runs when no read is
 * in flight and no on_message is pending, so re-arming here never makes two
 * callbacks of the call run at once. */
void rpc_call_pause_reads(rpc_call_t *c) {
  pthread_mutex_lock(&c->mu);
  c->read_pauses++;
  pthread_mutex_unlock(&c->mu);
}

void rpc_call_resume_reads(rpc_call_t *c) {
  pthread_mutex_lock(&c->mu);
  if (c->read_pauses > 0 && --c->read_pauses == 0 && c->read_paused) start_reading_locked(c);
  pthread_mutex_unlock(&c->mu);
}

void rpc_call_hold_sends(rpc_call_t *c) {
  pthread_mutex_lock(&c->mu);
  c->send_holds++;
  pthread_mutex_unlock(&c->mu);
}

void rpc_call_release_sends(rpc_call_t *c) {
  pthread_mutex_lock(&c->mu);
  if (c->send_holds > 0 && --c->send_holds == 0) pump_locked(c);
  pthread_mutex_unlock(&c->mu);
}

bool rpc_call_when_drained(rpc_call_t *c, size_t below, void (*cb)(rpc_call_t *, void *),
                           void *arg) {
  pthread_mutex_lock(&c->mu);
  bool wait = !c->closed && c->out_len > below;
  c->drain_cb = wait ? cb : NULL;
  c->drain_arg = arg;
  c->drain_below = below;
  pthread_mutex_unlock(&c->mu);
  return wait;
}

bool rpc_call_ended(rpc_call_t *c) {
  pthread_mutex_lock(&c->mu);
  bool ended = c->closed;
  pthread_mutex_unlock(&c->mu);
  return ended;
}

const char *rpc_call_metadata(rpc_call_t *c, const char *key, char *buf, size_t len) {
  for (size_t i = 0; i < c->md.count; i++) {
    if (grpc_slice_str_cmp(c->md.metadata[i].key, key) != 0) continue;
    const grpc_slice v = c->md.metadata[i].value;
    size_t n = GRPC_SLICE_LENGTH(v);
    if (len == 0) return NULL;
    if (n >= len) n = len - 1;
    memcpy(buf, GRPC_SLICE_START_PTR(v), n);
    buf[n] = '\0';
    return buf;
  }
  return NULL;
}

long rpc_call_metadata_bin(rpc_call_t *c, const char *key, void *buf, size_t len) {
  for (size_t i = 0; i < c->md.count; i++) {
    if (grpc_slice_str_cmp(c->md.metadata[i].key, key) != 0) continue;
    const grpc_slice v = c->md.metadata[i].value;
    size_t n = GRPC_SLICE_LENGTH(v);
    memcpy(buf, GRPC_SLICE_START_PTR(v), n < len ? n : len);
    return (long)n;
  }
  return -1;
}

char *rpc_call_peer(rpc_call_t *c) {
  char *p = grpc_call_get_peer(c->call);
  char *copy = strdup(p ? p : "");
  gpr_free(p);
  return copy;
}

const char *rpc_call_method(const rpc_call_t *c) {
  return c->slot ? c->slot->m->path : "(unknown method)";
}

const rpc_identity_t *rpc_call_identity(const rpc_call_t *c) {
  return c->has_identity ? &c->identity : NULL;
}

bool rpc_call_peer_verified(rpc_call_t *c) {
  grpc_auth_context *ctx = grpc_call_auth_context(c->call);
  if (!ctx) return false;
  /* gRPC sets the peer identity only from a certificate it verified. */
  bool verified = grpc_auth_context_peer_is_authenticated(ctx) != 0;
  grpc_auth_context_release(ctx);
  return verified;
}

bool rpc_call_peer_named(rpc_call_t *c, const char *name) {
  if (!name || !*name) return rpc_call_peer_verified(c);
  grpc_auth_context *ctx = grpc_call_auth_context(c->call);
  if (!ctx) return false;
  bool ok = false;
  if (grpc_auth_context_peer_is_authenticated(ctx)) {
    /* The DNS names; the common name only when there is none (RFC 6125 6.4.4):
     * a user's CN=meshd-cluster beside DNS:alice does not make a peer. */
    static const char *const props[] = {GRPC_PEER_DNS_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME};
    size_t n = strlen(name);
    bool dns = false;
    for (size_t k = 0; k < 2 && !ok && !(k == 1 && dns); k++) {
      grpc_auth_property_iterator it = grpc_auth_context_find_properties_by_name(ctx, props[k]);
      const grpc_auth_property *p;
      while (!ok && (p = grpc_auth_property_iterator_next(&it))) {
        dns = true;
        ok = p->value_length == n && memcmp(p->value, name, n) == 0;
      }
    }
  }
  grpc_auth_context_release(ctx);
  return ok;
}

void rpc_call_set_data(rpc_call_t *c, void *data) { c->data = data; }
void *rpc_call_data(const rpc_call_t *c) { return c->data; }

rpc_kept_t *rpc_call_keep_message(rpc_call_t *c) {
  c->keep_msg = c->msg_arena != NULL;
  return (rpc_kept_t *)c->msg_arena;
}

void rpc_kept_free(rpc_kept_t *k) { wire_arena_free((wire_arena_t *)k); }

/* ------------------------------------------------------------------ events */

/* Runs the drain wait's callback once its condition holds, as a callback of the
 * call (in_callback holds on_end back). Called with the lock held; returns with
 * it held. */
static void drained_locked(rpc_call_t *c) {
  /* Another callback of the call is running (on_start, on_message, a drain
   * callback, on another thread): it runs this when it returns
   * (maybe_end_locked), so that callbacks of one call never overlap. */
  if (!c->drain_cb || c->in_callback > 0 || (!c->closed && c->out_len > c->drain_below)) return;
  void (*cb)(rpc_call_t *, void *) = c->drain_cb;
  void *arg = c->drain_arg;
  c->drain_cb = NULL;
  c->in_callback++;
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_lock(&c->cb_mu);
  cb(c, arg);
  pthread_mutex_unlock(&c->cb_mu);
  pthread_mutex_lock(&c->mu);
  c->in_callback--;
}

/* Runs on_end once every other callback of the call has returned. Called with
 * the lock held; returns with it held. */
static void maybe_end_locked(rpc_call_t *c) {
  drained_locked(c); /* a drain wait held back while another callback ran */
  if (!c->closed || c->end_done || c->in_callback > 0) return;
  c->end_done = true;
  const rpc_method_t *m = c->slot->m;
  bool cancelled = c->cancelled;
  pthread_mutex_unlock(&c->mu);
  if (m->on_end && c->started) m->on_end(c, cancelled, c->slot->arg);
  pthread_mutex_lock(&c->mu);
  c->refs--; /* the alive reference */
  pthread_mutex_lock(&c->srv->mu);
  c->srv->active--;
  if (c->live_prev) c->live_prev->live_next = c->live_next;
  else c->srv->live_head = c->live_next;
  if (c->live_next) c->live_next->live_prev = c->live_prev;
  c->live_prev = c->live_next = NULL;
  pthread_mutex_unlock(&c->srv->mu);
}

static void answer_unknown(rpc_call_t *c) {
  char method[256];
  size_t n = GRPC_SLICE_LENGTH(c->details.method);
  if (n >= sizeof method) n = sizeof method - 1;
  memcpy(method, GRPC_SLICE_START_PTR(c->details.method), n);
  method[n] = '\0';
  log_debug("rpc", "unknown method %s", method);
  char msg[320];
  snprintf(msg, sizeof msg, "unknown method %s: this server does not implement it", method);
  pthread_mutex_lock(&c->mu);
  c->status_details = grpc_slice_from_copied_string(msg);
  grpc_op ops[3];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[1].data.send_status_from_server.status = GRPC_STATUS_UNIMPLEMENTED;
  ops[1].data.send_status_from_server.status_details = &c->status_details;
  ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[2].data.recv_close_on_server.cancelled = &c->close_cancelled;
  start_batch_locked(c, ops, 3, &c->t_status);
  pthread_mutex_unlock(&c->mu);
}

/* The open-request list (see rpc_server_t): under srv->mu. A call is in it
 * only while its first read is in flight or its CLOSE is still to come, and
 * leaves it (open_remove) before either batch lets go of the call. */
static void open_remove_locked(rpc_server_t *srv, rpc_call_t *c) {
  if (!c->in_open) return;
  if (c->open_prev) c->open_prev->open_next = c->open_next;
  else srv->open_head = c->open_next;
  if (c->open_next) c->open_next->open_prev = c->open_prev;
  else srv->open_tail = c->open_prev;
  c->open_prev = c->open_next = NULL;
  c->in_open = false;
  srv->nopen--;
}

static void open_remove(rpc_call_t *c) {
  pthread_mutex_lock(&c->srv->mu);
  open_remove_locked(c->srv, c);
  pthread_mutex_unlock(&c->srv->mu);
}

/* Adds c, and cancels the oldest open requests past srv->max_open: a stranger
 * can make the server hold at most max_open incomplete requests, while a
 * probe's, whose request comes with its headers, is done long before it is
 * the oldest. A stream's first message gets RPC_STREAM_OPEN_GRACE_MS before
 * it can be the one cancelled: a burst of honest streams (agents registering
 * at once) on a busy server is read late, not refused; a stranger's silent
 * ones go at the next open past the grace. */
#define RPC_STREAM_OPEN_GRACE_MS 1000
enum { EVICT_MAX = 256 };

static void open_add(rpc_call_t *c) {
  rpc_server_t *srv = c->srv;
  grpc_call *evict[EVICT_MAX];
  int n = 0;
  int64_t now = rpc_now_ms();
  pthread_mutex_lock(&srv->mu);
  c->in_open = true;
  c->open_ms = now;
  c->open_prev = srv->open_tail;
  c->open_next = NULL;
  if (srv->open_tail) srv->open_tail->open_next = c;
  else srv->open_head = c;
  srv->open_tail = c;
  srv->nopen++;
  /* Oldest first, past the streams still in their grace. */
  for (rpc_call_t *old = srv->open_head, *next; old && srv->nopen > srv->max_open &&
                                               n < EVICT_MAX; old = next) {
    next = old->open_next;
    if (old->stream_open && now - old->open_ms < RPC_STREAM_OPEN_GRACE_MS) continue;
    open_remove_locked(srv, old);
    evict[n] = old->call; /* old lives while it is listed: its batch holds it */
    grpc_call_ref(evict[n++]);
  }
  int max_open = srv->max_open;
  pthread_mutex_unlock(&srv->mu);
  for (int i = 0; i < n; i++) {
    char msg[200];
    snprintf(msg, sizeof msg, "more than %d requests of unauthenticated callers are incomplete "
             "(--max-unauthenticated-requests): the oldest is cancelled", max_open);
    grpc_call_cancel_with_status(evict[i], GRPC_STATUS_RESOURCE_EXHAUSTED, msg, NULL);
    grpc_call_unref(evict[i]);
  }
}

/* Decodes a unary or server-streaming call's request (buf, taken) and starts
 * the handler; for streaming requests (buf NULL) starts it and the reads.
 * Called with the lock held; returns with it held. */
static void begin_locked(rpc_call_t *c, grpc_byte_buffer *buf) {
  const rpc_method_t *m = c->slot->m;
  ProtobufCMessage *req = NULL;
  bool single_request = m->kind == RPC_UNARY || m->kind == RPC_SERVER_STREAMING;
  if (single_request) {
    if (!buf) {
      finish_locked(c, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", "request missing");
      maybe_end_locked(c);
      return;
    }
    char why[256];
    req = wire_unpack(buf, m->request, why, sizeof why);
    grpc_byte_buffer_destroy(buf);
    if (!req) {
      char msg[600];
      if (why[0]) snprintf(msg, sizeof msg, "request to %s: %s", m->path, why);
      else snprintf(msg, sizeof msg, "request to %s is not a valid %s message", m->path, m->request->name);
      finish_locked(c, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", msg);
      maybe_end_locked(c);
      return;
    }
  }
  c->in_callback++;
  c->started = true;
  pthread_mutex_unlock(&c->mu);

  pthread_mutex_lock(&c->cb_mu);
  if (m->on_start) m->on_start(c, req, c->slot->arg);
  pthread_mutex_unlock(&c->cb_mu);
  if (!m->on_start) rpc_call_finish(c, GRPC_STATUS_UNIMPLEMENTED, NULL, "%s has no handler", m->path);
  if (req) protobuf_c_message_free_unpacked(req, NULL);

  pthread_mutex_lock(&c->mu);
  c->in_callback--;
  if (!single_request) start_reading_locked(c);
  maybe_end_locked(c);
}

static void on_new(rpc_call_t *c, bool ok) {
  rpc_server_t *srv = c->srv;
  if (!ok) return; /* shutting down: the call never existed */
  pthread_mutex_lock(&srv->mu);
  bool repost = !srv->stopping;
  pthread_mutex_unlock(&srv->mu);
  if (repost) post_request(srv, c->slot);
  if (!c->slot) {
    answer_unknown(c);
    return;
  }

  const rpc_method_t *m = c->slot->m;
  pthread_mutex_lock(&srv->mu);
  srv->active++;
  c->live_prev = NULL;
  c->live_next = srv->live_head;
  if (srv->live_head) srv->live_head->live_prev = c;
  srv->live_head = c;
  pthread_mutex_unlock(&srv->mu);

  pthread_mutex_lock(&c->mu);
  c->accepted = true;
  c->refs++; /* alive until on_end has run */
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->close_cancelled;
  if (!start_batch_locked(c, &op, 1, &c->t_close)) {
    /* The queue is shutting down (a NEW drained after it): no CLOSE would
     * ever come to end the call, so nothing of it starts (its handler's state
     * would never be freed); it ends here, cancelled. */
    c->closed = c->cancelled = true;
    maybe_end_locked(c); /* not started: no on_end; drops the alive reference */
    pthread_mutex_unlock(&c->mu);
    grpc_call_cancel(c->call, NULL);
    return;
  }

  if (c->slot->guard) {
    /* Authentication first: a refused caller's request is not even decoded.
     * The guard counts as a callback: a CLOSE that comes meanwhile (the
     * client gave up) leaves the end to this thread, so the call is never
     * ended before on_start and then started (its on_end would never run). */
    char why[300] = "";
    rpc_identity_t id = {{0}, false, false, false, {0}};
    uint64_t revocations = atomic_load(&srv->revocations);
    c->in_callback++;
    pthread_mutex_unlock(&c->mu);
    grpc_status_code code = c->slot->guard(c, c->slot->guard_arg, &id, why, sizeof why);
    pthread_mutex_lock(&c->mu);
    c->in_callback--;
    /* Read in the same hold of c->mu that stores the identity below: a
     * revocation that counted itself after this read finds the identity. */
    for (uint64_t now; code == GRPC_STATUS_OK && id.has_credential &&
                       (now = atomic_load(&srv->revocations)) != revocations;) {
      revocations = now;
      c->in_callback++;
      pthread_mutex_unlock(&c->mu);
      code = guard_ask_again(srv, &id, why, sizeof why);
      pthread_mutex_lock(&c->mu);
      c->in_callback--;
    }
    if (code != GRPC_STATUS_OK) {
      finish_locked(c, code, code == GRPC_STATUS_PERMISSION_DENIED ? "PERMISSION_DENIED"
                                                                   : "UNAUTHENTICATED", why);
      maybe_end_locked(c);
      pthread_mutex_unlock(&c->mu);
      return;
    }
    c->identity = id;
    c->has_identity = true;
    if (c->closed) {
      /* Its CLOSE came during the guard and left the end to this thread: no
       * read or handler starts on a call already over (a unary call's failed
       * read would end nothing), it ends here. */
      maybe_end_locked(c);
      pthread_mutex_unlock(&c->mu);
      return;
    }
  }

  if (m->kind == RPC_UNARY || m->kind == RPC_SERVER_STREAMING) {
    /* The request is read only now, once the guard admitted the caller:
     * gRPC holds what the stream window lets through until a read asks for
     * the message, then the whole message. A caller nothing authenticated
     * counts against the server's bound while its request is incomplete. */
    if (!c->slot->guard || c->identity.unauthenticated) open_add(c);
    c->first_read = true;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_buf;
    c->reading = start_batch_locked(c, &op, 1, &c->t_read);
    /* Not started (the queue is shutting down): the CLOSE batch ends it. */
    pthread_mutex_unlock(&c->mu);
    return;
  }
  /* A stream of a caller nothing authenticated counts too until its first
   * message: a stranger's silent streams are bounded like its requests. */
  if (!c->slot->guard || c->identity.unauthenticated) {
    c->stream_open = true;
    open_add(c);
  }
  begin_locked(c, NULL);
  pthread_mutex_unlock(&c->mu);
}

static void on_read(rpc_call_t *c, bool ok) {
  const rpc_method_t *m = c->slot->m;
  pthread_mutex_lock(&c->mu);
  c->reading = false;
  grpc_byte_buffer *buf = c->recv_buf;
  c->recv_buf = NULL;
  bool first = c->first_read;
  c->first_read = false;
  if (first) open_remove(c);
  if (c->stream_open) {
    open_remove(c); /* first: open_add reads stream_open of listed calls */
    c->stream_open = false;
  }
  if (c->closed || c->status_queued) {
    if (buf) grpc_byte_buffer_destroy(buf);
    return;
  }
  if (first) {
    if (!ok || (!buf && grpc_call_failed_before_recv_message(c->call))) {
      if (buf) grpc_byte_buffer_destroy(buf);
      return; /* cancelled or broken: the CLOSE event will say so */
    }
    begin_locked(c, buf); /* buf NULL: the client half-closed without one */
    return;
  }
  ProtobufCMessage *msg = NULL;
  bool deliver = false;
  if (ok && buf && m->on_raw) {
    c->in_callback++;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&c->cb_mu);
    bool taken = m->on_raw(c, buf, c->slot->arg);
    pthread_mutex_unlock(&c->cb_mu);
    pthread_mutex_lock(&c->mu);
    c->in_callback--;
    if (taken) {
      if (!c->closed && !c->status_queued) start_reading_locked(c);
      maybe_end_locked(c);
      return;
    }
  }
  if (ok && buf) {
    char why[256];
    msg = wire_unpack_arena(buf, m->request, why, sizeof why, &c->msg_arena);
    grpc_byte_buffer_destroy(buf);
    if (!msg) {
      char text[600];
      if (why[0]) snprintf(text, sizeof text, "a message on %s: %s", m->path, why);
      else snprintf(text, sizeof text, "a message on %s is not a valid %s", m->path, m->request->name);
      if (m->on_refused) {
        c->in_callback++;
        pthread_mutex_unlock(&c->mu);
        pthread_mutex_lock(&c->cb_mu);
        m->on_refused(c, c->slot->arg);
        pthread_mutex_unlock(&c->cb_mu);
        pthread_mutex_lock(&c->mu);
        c->in_callback--;
      }
      finish_locked(c, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", text);
      maybe_end_locked(c);
      return;
    }
    deliver = true;
  } else if (ok && !grpc_call_failed_before_recv_message(c->call)) {
    deliver = true; /* half-close: on_message(NULL) */
  } else {
    if (buf) grpc_byte_buffer_destroy(buf);
    return; /* cancelled or broken: the CLOSE event will say so */
  }
  if (deliver && m->on_message) {
    c->in_callback++;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&c->cb_mu);
    m->on_message(c, msg, c->slot->arg);
    pthread_mutex_unlock(&c->cb_mu);
    pthread_mutex_lock(&c->mu);
    c->in_callback--;
  }
  if (msg) {
    if (!c->keep_msg) wire_arena_free(c->msg_arena);
    c->msg_arena = NULL;
    c->keep_msg = false;
    start_reading_locked(c);
  }
  maybe_end_locked(c);
}

static void on_write(rpc_call_t *c, bool ok) {
  pthread_mutex_lock(&c->mu);
  c->writing = false;
  outmsg_t *o = c->out_head;
  if (o) {
    c->out_head = o->next;
    if (!c->out_head) c->out_tail = NULL;
    c->out_len--;
    grpc_byte_buffer_destroy(o->buf);
    free(o);
  }
  if (!ok) {
    /* The stream is broken; nothing more will be sent. */
    for (outmsg_t *p = c->out_head, *next; p; p = next) {
      next = p->next;
      grpc_byte_buffer_destroy(p->buf);
      free(p);
    }
    c->out_head = c->out_tail = NULL;
    c->out_len = 0;
    return;
  }
  pump_locked(c);
  if (c->read_paused && c->out_len <= OUTBOX_LOW) start_reading_locked(c);
  drained_locked(c);
  maybe_end_locked(c);
}

static void on_status(rpc_call_t *c, bool ok) {
  pthread_mutex_lock(&c->mu);
  /* Messages sent together with the status are gone now. */
  for (outmsg_t *p = c->out_head, *next; p; p = next) {
    next = p->next;
    grpc_byte_buffer_destroy(p->buf);
    free(p);
  }
  c->out_head = c->out_tail = NULL;
  c->out_len = 0;
  (void)ok;
}

static void on_close(rpc_call_t *c, bool ok) {
  pthread_mutex_lock(&c->mu);
  open_remove(c); /* a request whose read never started */
  c->closed = true;
  c->cancelled = c->close_cancelled != 0 || !ok;
  drained_locked(c);
  maybe_end_locked(c);
}

static void dispatch_call(tag_t *t, bool ok) {
  rpc_call_t *c = t->call;
  switch (t->kind) {
    case TAG_NEW:
      on_new(c, ok);
      rpc_call_unref(c);
      return;
    case TAG_READ: on_read(c, ok); break;
    case TAG_WRITE: on_write(c, ok); break;
    case TAG_STATUS:
      if (!c->slot) {
        rpc_call_unref(c); /* the unknown-method batch */
        return;
      }
      on_status(c, ok);
      break;
    case TAG_CLOSE: on_close(c, ok); break;
  }
  /* Each handler above returns with the lock held: drop the batch's ref. */
  int left = --c->refs;
  pthread_mutex_unlock(&c->mu);
  if (left == 0) call_free(c);
}

static void dispatch(tag_t *t, bool ok) {
  rpc_server_t *srv = t->call->srv; /* the call may be freed by the dispatch */
  dispatch_call(t, ok);
  tags_done(srv);
}

void rpc_server_event(void *tag, bool ok) { dispatch(tag, ok); }

static _Thread_local bool worker_with_hook, worker_holds;
static _Thread_local int64_t worker_holds_since; /* rpc_now_ms when it began holding */

/* A thread that never finds itself idle (other calls' events keep coming)
 * still lets go of what it holds after this long. */
#define HOLD_MAX_MS 1

bool rpc_server_hold_until_idle(void) {
  if (worker_with_hook && !worker_holds) {
    worker_holds = true;
    worker_holds_since = rpc_now_ms();
  }
  return worker_with_hook;
}

/* Waits on cq and dispatches its events until it shuts down: a server's own
 * threads, or the process loop's. The loop's queue carries the client's
 * events too, which go to the client thread (rpc_client_forward). */
static void serve_queue(grpc_completion_queue *cq, void (*before_wait)(void)) {
  worker_with_hook = before_wait != NULL;
  for (;;) {
    grpc_event ev = {.type = GRPC_QUEUE_TIMEOUT};
    if (worker_holds) { /* a ready event first; the hook before a real wait */
      ev = grpc_completion_queue_next(cq, gpr_inf_past(GPR_CLOCK_REALTIME), NULL);
      if (ev.type == GRPC_QUEUE_TIMEOUT) {
        worker_holds = false;
        before_wait();
      }
    }
    if (ev.type == GRPC_QUEUE_TIMEOUT)
      ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    rpc_loop_tag_t *t = ev.tag;
    if (t->fn == rpc_server_event) dispatch(ev.tag, ev.success != 0);
    else rpc_client_forward(ev.tag, ev.success != 0);
    if (worker_holds && rpc_now_ms() - worker_holds_since > HOLD_MAX_MS) {
      worker_holds = false;
      before_wait();
    }
  }
  if (worker_holds) { /* what it held goes before the thread ends */
    worker_holds = false;
    before_wait();
  }
}

static void *worker(void *arg) {
  rpc_server_t *srv = arg;
  serve_queue(srv->cq, srv->before_wait);
  return NULL;
}

/* ------------------------------------------------------------------ loop */

/* The process loop (rpc_loop_start): one queue, polled by its threads only,
 * that every server made after it and every pull and duplex use. */
static struct {
  pthread_mutex_t mu;
  grpc_completion_queue *cq;
  pthread_t *threads;
  int nthreads;
  void (*before_wait)(void);
} loop = {PTHREAD_MUTEX_INITIALIZER, NULL, NULL, 0, NULL};

static _Thread_local bool on_loop_thread;

bool rpc_on_loop_thread(void) { return on_loop_thread; }

static void *loop_main(void *arg) {
  (void)arg;
  on_loop_thread = true;
  serve_queue(loop.cq, loop.before_wait);
  return NULL;
}

int rpc_loop_start(int threads, void (*before_wait)(void)) {
  pthread_mutex_lock(&loop.mu);
  int rc = 0;
  if (!loop.cq) {
    int n = threads > 0 ? threads : 1;
    loop.before_wait = before_wait;
    loop.cq = grpc_completion_queue_create_for_next(NULL);
    loop.threads = calloc((size_t)n, sizeof *loop.threads);
    for (loop.nthreads = 0; loop.threads && loop.nthreads < n; loop.nthreads++) {
      if (pthread_create(&loop.threads[loop.nthreads], NULL, loop_main, NULL) != 0) break;
      pthread_setname_np(loop.threads[loop.nthreads], "rpc-loop");
    }
    rc = loop.nthreads > 0 ? 0 : -1;
    if (rc) {
      grpc_completion_queue_shutdown(loop.cq);
      grpc_completion_queue_destroy(loop.cq);
      loop.cq = NULL;
      free(loop.threads);
      loop.threads = NULL;
    }
  }
  pthread_mutex_unlock(&loop.mu);
  return rc;
}

grpc_completion_queue *rpc_loop_cq(int *threads) {
  pthread_mutex_lock(&loop.mu);
  grpc_completion_queue *cq = loop.cq;
  if (threads) *threads = loop.nthreads;
  pthread_mutex_unlock(&loop.mu);
  return cq;
}

void rpc_loop_stop(void) {
  pthread_mutex_lock(&loop.mu);
  grpc_completion_queue *cq = loop.cq;
  pthread_mutex_unlock(&loop.mu);
  if (!cq) return;
  /* Every server is gone and every pull and duplex ended: nothing starts
   * on the queue any more. */
  grpc_completion_queue_shutdown(cq);
  for (int i = 0; i < loop.nthreads; i++) pthread_join(loop.threads[i], NULL);
  grpc_completion_queue_destroy(cq);
  pthread_mutex_lock(&loop.mu);
  loop.cq = NULL;
  free(loop.threads);
  loop.threads = NULL;
  loop.nthreads = 0;
  pthread_mutex_unlock(&loop.mu);
}

static void post_request(rpc_server_t *srv, method_slot_t *slot) {
  rpc_call_t *c = call_new(srv, slot);
  grpc_call_error e;
  tags_started(srv); /* before: another thread may dispatch it at once */
  if (slot) {
    /* Without the payload: gRPC hands the call over at its headers, so the
     * guard runs before any of the request is read (on_new). */
    e = grpc_server_request_registered_call(srv->server, slot->handle, &c->call, &c->deadline,
                                            &c->md, NULL, srv->cq, srv->cq, &c->t_new);
  } else {
    e = grpc_server_request_call(srv->server, &c->call, &c->details, &c->md, srv->cq, srv->cq,
                                 &c->t_new);
  }
  if (e != GRPC_CALL_OK) {
    tags_done(srv);
    log_error("rpc", "cannot accept calls for %s: %s", slot ? slot->m->path : "unknown methods",
              grpc_call_error_to_string(e));
    call_free(c);
  }
}

/* ------------------------------------------------------------------ server */

rpc_server_t *rpc_server_create(const rpc_server_opts_t *opts, char *err, size_t errlen) {
  rpc_server_t *srv = calloc(1, sizeof *srv);
  if (!srv) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  srv->creds = rpc_tls_server_creds(&opts->tls, &srv->tls, err, errlen);
  if (!srv->creds) {
    free(srv);
    return NULL;
  }
  snprintf(srv->listen, sizeof srv->listen, "%s", opts->listen ? opts->listen : "127.0.0.1:0");
  int loop_threads = 0;
  grpc_completion_queue *loop_cq = rpc_loop_cq(&loop_threads);
  srv->in_loop = loop_cq != NULL;
  srv->nthreads = srv->in_loop ? loop_threads : opts->threads > 0 ? opts->threads : 2;
  srv->before_wait = opts->before_wait;
  srv->posts_per_method = srv->nthreads * 2 < 4 ? 4 : srv->nthreads * 2;
  srv->max_open = opts->max_unauthenticated_requests > 0 ? opts->max_unauthenticated_requests
                                                         : RPC_DEFAULT_MAX_UNAUTHENTICATED;
  /* A burst of probes (Check and Watch) queues up to posts_per_method NEW
   * events per method ahead of their reads' completions: a bound below that
   * would evict probes whose requests are already here. */
  if (srv->max_open < 2 * srv->posts_per_method + srv->nthreads)
    srv->max_open = 2 * srv->posts_per_method + srv->nthreads;
  int max_msg = opts->max_message_bytes > 0 ? opts->max_message_bytes : RPC_DEFAULT_MAX_MESSAGE;
  srv->max_msg = max_msg;
  wire_args_t a = {0};
  wire_args_int(&a, GRPC_ARG_ALLOW_REUSEPORT, 0); /* a second server on a port must fail */
  wire_args_int(&a, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max_msg);
  wire_args_int(&a, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max_msg);
  /* See rpc_server_opts_t: ping only connections with calls in flight, rarely,
   * with a generous ack timeout; a quiet call (a Sync waiting on agents) is
   * pinged for as long as it lasts (no cap on pings without data). */
  wire_args_int(&a, GRPC_ARG_KEEPALIVE_TIME_MS, opts->keepalive_ms > 0 ? opts->keepalive_ms : 30000);
  wire_args_int(&a, GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                opts->keepalive_timeout_ms > 0 ? opts->keepalive_timeout_ms : 20000);
  wire_args_int(&a, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  wire_args_int(&a, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  wire_args_int(&a, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, RPC_SERVER_MIN_PING_MS);
  wire_args_int(&a, GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  /* Idle connections go (a stranger's open socket holds memory), and one
   * connection cannot open calls without end. */
  wire_args_int(&a, GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                opts->max_connection_idle_ms > 0 ? opts->max_connection_idle_ms : 600000);
  /* ... and so do connections that never finish their handshake (gRPC: 120 s). */
  wire_args_int(&a, GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                opts->handshake_timeout_ms > 0 ? opts->handshake_timeout_ms
                                               : RPC_DEFAULT_HANDSHAKE_TIMEOUT_MS);
  wire_args_int(&a, GRPC_ARG_MAX_CONCURRENT_STREAMS,
                opts->max_concurrent_streams > 0 ? opts->max_concurrent_streams : 1024);
  if (opts->stream_window_bytes > 0) {
    /* A fixed window: what a client may send that no read asked for yet. */
    wire_args_int(&a, GRPC_ARG_HTTP2_BDP_PROBE, 0);
    wire_args_int(&a, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, opts->stream_window_bytes);
  }
  grpc_resource_quota *quota = NULL;
  if (opts->memory_bytes > 0) {
    quota = grpc_resource_quota_create("meshd-rpc-server");
    grpc_resource_quota_resize(quota, (size_t)opts->memory_bytes);
    wire_args_ptr(&a, GRPC_ARG_RESOURCE_QUOTA, quota, grpc_resource_quota_arg_vtable());
  }
  srv->server = grpc_server_create(wire_args_done(&a), NULL);
  if (quota) grpc_resource_quota_unref(quota); /* the server's args hold their own ref */
  srv->cq = srv->in_loop ? loop_cq : grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(srv->server, srv->cq, NULL);
  pthread_mutex_init(&srv->mu, NULL);
  pthread_cond_init(&srv->tags_cv, NULL);
  pthread_rwlock_init(&srv->cq_lock, NULL);
  return srv;
}

int rpc_server_add_methods(rpc_server_t *srv, const rpc_method_t *methods, size_t n, void *arg) {
  return rpc_server_add_methods_guarded(srv, methods, n, arg, NULL, NULL);
}

int rpc_server_add_methods_guarded(rpc_server_t *srv, const rpc_method_t *methods, size_t n,
                                   void *arg, rpc_guard_fn guard, void *guard_arg) {
  if (srv->started) return -1;
  for (size_t i = 0; i < n; i++) {
    for (size_t j = 0; j < srv->nslots; j++)
      if (strcmp(srv->slots[j].m->path, methods[i].path) == 0) return -1;
    if (srv->nslots == srv->cap) {
      size_t cap = srv->cap ? srv->cap * 2 : 16;
      method_slot_t *s = realloc(srv->slots, cap * sizeof *s);
      if (!s) return -1;
      srv->slots = s;
      srv->cap = cap;
    }
    void *h = grpc_server_register_method(srv->server, methods[i].path, NULL,
                                          GRPC_SRM_PAYLOAD_NONE, 0);
    if (!h) return -1;
    srv->slots[srv->nslots++] = (method_slot_t){&methods[i], arg, h, guard, guard_arg};
  }
  return 0;
}

int rpc_server_start(rpc_server_t *srv, char *err, size_t errlen) {
  if (srv->started) return srv->port;
  if (runtime_check_port(srv->listen, err, errlen) != 0) return -1;
  srv->port = grpc_server_add_http2_port(srv->server, srv->listen, srv->creds);
  if (srv->port <= 0) {
    snprintf(err, errlen, "cannot listen on %s (address in use, or not a valid address)",
             srv->listen);
    return -1;
  }
  grpc_server_start(srv->server);
  srv->started = true;
  srv->shutdown_cq = grpc_completion_queue_create_for_pluck(NULL);
  for (size_t i = 0; i < srv->nslots; i++)
    for (int k = 0; k < srv->posts_per_method; k++) post_request(srv, &srv->slots[i]);
  for (int k = 0; k < srv->posts_per_method; k++) post_request(srv, NULL);
  srv->nworkers = srv->in_loop ? 0 : srv->nthreads;
  srv->threads = calloc((size_t)(srv->nworkers ? srv->nworkers : 1), sizeof *srv->threads);
  /* Named here, not by the thread itself: the name is there once start returns
   * (for top -H and perf; a test counted the threads before they ran). */
  for (int i = 0; i < srv->nworkers; i++)
    if (pthread_create(&srv->threads[i], NULL, worker, srv) == 0)
      pthread_setname_np(srv->threads[i], "rpc-server");
  return srv->port;
}

int rpc_server_port(const rpc_server_t *srv) { return srv->port; }

size_t rpc_server_paths(const rpc_server_t *srv, const char **paths, size_t cap) {
  for (size_t i = 0; i < srv->nslots && i < cap; i++) paths[i] = srv->slots[i].m->path;
  return srv->nslots;
}

int rpc_server_active_calls(rpc_server_t *srv) {
  pthread_mutex_lock(&srv->mu);
  int n = srv->active;
  pthread_mutex_unlock(&srv->mu);
  return n;
}

void rpc_server_stop_accepting(rpc_server_t *srv) {
  pthread_mutex_lock(&srv->mu);
  bool first = srv->started && !srv->stopping;
  srv->stopping = true;
  pthread_mutex_unlock(&srv->mu);
  if (first) grpc_server_shutdown_and_notify(srv->server, srv->shutdown_cq, &srv->shutdown_tag);
}

/* On the process loop: the queue goes on without this server, which may be
 * freed only once the loop dispatched the last of its events (the requests
 * the shutdown failed, the batches of cancelled calls). Not on a loop thread. */
static void wait_tags(rpc_server_t *srv) {
  pthread_mutex_lock(&srv->mu);
  for (int waited = 0; srv->tags_out > 0; waited++) {
    struct timespec dl;
    runtime_deadline(&dl, CLOCK_REALTIME, 1000);
    if (pthread_cond_timedwait(&srv->tags_cv, &srv->mu, &dl) == ETIMEDOUT && waited == 5)
      log_warn("rpc", "%s: %d event(s) of its calls not dispatched after 5 s: still waiting",
               srv->listen, srv->tags_out);
  }
  pthread_mutex_unlock(&srv->mu);
}

/* Every listed call but except_path's, each with a reference (the caller
 * drops it), as a malloc'd array of *k; NULL when none or out of memory. A
 * listed call has a reference besides its alive one until it leaves the list
 * (maybe_end_locked's caller's): one more keeps it past the lock (atomic, as
 * c->mu comes before srv->mu). */
static rpc_call_t **live_calls(rpc_server_t *srv, const char *except_path, int *k) {
  pthread_mutex_lock(&srv->mu);
  int n = 0;
  for (rpc_call_t *c = srv->live_head; c; c = c->live_next) n++;
  rpc_call_t **calls = n ? malloc(sizeof *calls * (size_t)n) : NULL;
  *k = 0;
  for (rpc_call_t *c = srv->live_head; calls && c; c = c->live_next) {
    if (except_path && strcmp(c->slot->m->path, except_path) == 0) continue;
    c->refs++;
    calls[(*k)++] = c;
  }
  pthread_mutex_unlock(&srv->mu);
  return calls;
}

int rpc_server_end_calls(rpc_server_t *srv, const char *except_path, grpc_status_code code,
                         const char *kind, const char *msg) {
  int k;
  rpc_call_t **calls = live_calls(srv, except_path, &k);
  for (int i = 0; i < k; i++) {
    rpc_call_abort(calls[i], code, kind, "%s", msg);
    rpc_call_unref(calls[i]);
  }
  free(calls);
  return k;
}

typedef struct held_answer {
  rpc_call_t *call;
  rpc_bytes_t *msg;
  int ms;
} held_answer_t;

static void *answer_main(void *arg) {
  held_answer_t *h = arg;
  struct timespec d = {h->ms / 1000, (long)(h->ms % 1000) * 1000000L};
  nanosleep(&d, NULL);
  if (rpc_call_send_raw(h->call, h->msg) == 0) rpc_call_finish(h->call, GRPC_STATUS_OK, NULL, "%s", "");
  rpc_call_unref(h->call);
  free(h);
  return NULL;
}

int rpc_call_reply_after(rpc_call_t *call, const ProtobufCMessage *msg, int ms) {
  held_answer_t *h = malloc(sizeof *h);
  if (!h || !(h->msg = rpc_bytes_pack(msg))) {
    free(h);
    return -1;
  }
  h->call = call;
  h->ms = ms;
  rpc_call_ref(call);
  if (runtime_spawn_detached("held-answer", answer_main, h) == 0) return 0;
  rpc_call_unref(call);
  rpc_bytes_free(h->msg);
  free(h);
  return -1;
}

int rpc_server_end_calls_of(rpc_server_t *srv,
                            bool (*revoked)(const rpc_identity_t *id, void *arg), void *arg,
                            grpc_status_code code, const char *kind, const char *msg) {
  pthread_mutex_lock(&srv->mu);
  srv->revoked = revoked;
  srv->revoked_arg = arg;
  srv->revoked_code = code;
  snprintf(srv->revoked_msg, sizeof srv->revoked_msg, "%s", msg);
  pthread_mutex_unlock(&srv->mu);
  atomic_fetch_add(&srv->revocations, 1); /* before the calls are looked at */
  int k;
  rpc_call_t **calls = live_calls(srv, NULL, &k);
  int ended = 0;
  for (int i = 0; i < k; i++) {
    rpc_call_t *c = calls[i];
    pthread_mutex_lock(&c->mu);
    bool has = c->has_identity && c->identity.has_credential;
    rpc_identity_t id = c->identity;
    pthread_mutex_unlock(&c->mu);
    if (has && revoked(&id, arg)) {
      rpc_call_abort(c, code, kind, "principal '%s': %s", id.name, msg);
      ended++;
    }
    rpc_call_unref(c);
  }
  free(calls);
  return ended;
}

void rpc_server_shutdown(rpc_server_t *srv, double grace_seconds) {
  if (!srv->started || srv->shut_down) return;
  rpc_server_stop_accepting(srv);
  int grace_ms = grace_seconds > 0 ? (int)(grace_seconds * 1000) : 1;
  int64_t end = rpc_now_ms() + grace_ms;
  grpc_event ev;
  for (;;) {
    int64_t left = end - rpc_now_ms();
    ev = grpc_completion_queue_pluck(srv->shutdown_cq, &srv->shutdown_tag,
                                     wire_deadline(left < 50 ? (left > 0 ? (int)left : 1) : 50), NULL);
    if (ev.type != GRPC_QUEUE_TIMEOUT || left <= 50) break;
    /* No call left: only idle client connections keep the shutdown open
     * (gRPC waits for their peers to close them after its GOAWAY, seconds):
     * cancelling all calls disconnects them now. */
    if (rpc_server_active_calls(srv) == 0) break;
  }
  if (ev.type == GRPC_QUEUE_TIMEOUT) {
    int active = rpc_server_active_calls(srv);
    if (active > 0)
      log_info("rpc", "%d call(s) still running after %.1f s: cancelling them", active,
               grace_seconds);
    grpc_server_cancel_all_calls(srv->server);
    /* Wait for the cancelled calls to finish: their handlers still answer on
     * the worker queue, which must not shut down under a batch they start (a
     * gRPC assertion). Bounded, for a handler stuck outside gRPC. */
    grpc_completion_queue_pluck(srv->shutdown_cq, &srv->shutdown_tag, wire_deadline(5000), NULL);
  }
  grpc_completion_queue_shutdown(srv->shutdown_cq);
  grpc_completion_queue_pluck(srv->shutdown_cq, NULL, wire_deadline(0), NULL);
  grpc_completion_queue_destroy(srv->shutdown_cq);
  srv->shutdown_cq = NULL;
  pthread_rwlock_wrlock(&srv->cq_lock);
  srv->cq_closed = true;
  if (!srv->in_loop) grpc_completion_queue_shutdown(srv->cq);
  pthread_rwlock_unlock(&srv->cq_lock);
  for (int i = 0; i < srv->nworkers; i++) pthread_join(srv->threads[i], NULL);
  if (srv->in_loop) wait_tags(srv);
  srv->shut_down = true;
}

void rpc_server_destroy(rpc_server_t *srv) {
  if (!srv) return;
  if (srv->started) rpc_server_shutdown(srv, 0);
  grpc_server_destroy(srv->server);
  if (!srv->in_loop && !srv->started) {
    pthread_rwlock_wrlock(&srv->cq_lock);
    srv->cq_closed = true;
    grpc_completion_queue_shutdown(srv->cq);
    pthread_rwlock_unlock(&srv->cq_lock);
  }
  /* Drain whatever is left (nothing when the workers ran to the shutdown).
   * The loop's queue is the loop's: wait_tags saw this server's last event. */
  for (; !srv->in_loop;) {
    grpc_event ev = grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type == GRPC_OP_COMPLETE) dispatch(ev.tag, false);
  }
  if (!srv->in_loop) grpc_completion_queue_destroy(srv->cq);
  grpc_server_credentials_release(srv->creds);
  rpc_tls_server_free(srv->tls);
  pthread_mutex_destroy(&srv->mu);
  pthread_cond_destroy(&srv->tags_cv);
  pthread_rwlock_destroy(&srv->cq_lock);
  free(srv->threads);
  free(srv->slots);
  free(srv);
}
