/* Client half of the rpc layer: blocking calls over the gRPC C core, pulls and
 * duplexes.
 *
 * Every blocking call gets its own pluck completion queue, so calls on one
 * channel are independent and a stream's reader, writer and finisher can wait
 * on their own tags from different threads (at most
 * GRPC_MAX_COMPLETION_QUEUE_PLUCKERS). Pulls and duplexes share one completion
 * queue served by one thread (the client thread), started with the first such
 * call and stopped by rpc_shutdown. */
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc.h"
#include "rpc_tls.h"
#include "rpc_wire.h"

typedef struct method_handle {
  struct method_handle *next;
  char *method;
  void *handle;
} method_handle_t;

struct rpc_channel {
  grpc_channel *ch;
  pthread_mutex_t mu;
  method_handle_t *methods;
};

rpc_channel_t *rpc_channel_create(const char *target, const rpc_channel_opts_t *opts) {
  rpc_channel_opts_t o = opts ? *opts : (rpc_channel_opts_t){0};
  rpc_channel_t *ch = calloc(1, sizeof *ch);
  if (!ch) return NULL;
  int max_msg = o.max_message_bytes > 0 ? o.max_message_bytes : RPC_DEFAULT_MAX_MESSAGE;
  wire_args_t a = {0};
  wire_args_int(&a, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max_msg);
  wire_args_int(&a, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max_msg);
  /* Reconnect fast: agents come back within 2 s of a server restart. */
  wire_args_int(&a, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  wire_args_int(&a, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                o.connect_timeout_ms > 0 ? o.connect_timeout_ms : 100);
  wire_args_int(&a, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  if (o.keepalive_ms > 0) {
    wire_args_int(&a, GRPC_ARG_KEEPALIVE_TIME_MS, o.keepalive_ms);
    wire_args_int(&a, GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                  o.keepalive_timeout_ms > 0 ? o.keepalive_timeout_ms : 2000);
    wire_args_int(&a, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    wire_args_int(&a, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  if (o.own_connection) wire_args_int(&a, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (o.stream_window_bytes > 0) {
    wire_args_int(&a, GRPC_ARG_HTTP2_BDP_PROBE, 0);
    wire_args_int(&a, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, o.stream_window_bytes);
  }
  if (o.tls.on && o.tls.server_name)
    wire_args_str(&a, GRPC_SSL_TARGET_NAME_OVERRIDE_ARG, o.tls.server_name);
  grpc_channel_credentials *creds = rpc_tls_channel_creds(&o.tls);
  if (!creds) {
    free(ch);
    return NULL;
  }
  ch->ch = grpc_channel_create(target, creds, wire_args_done(&a));
  grpc_channel_credentials_release(creds);
  pthread_mutex_init(&ch->mu, NULL);
  return ch;
}

void rpc_channel_destroy(rpc_channel_t *ch) {
  if (!ch) return;
  for (method_handle_t *m = ch->methods, *next; m; m = next) {
    next = m->next;
    free(m->method);
    free(m);
  }
  grpc_channel_destroy(ch->ch);
  pthread_mutex_destroy(&ch->mu);
  free(ch);
}

/* Registered-call handles are cached per channel: registering parses the
 * method once instead of on every call. */
static void *method_handle(rpc_channel_t *ch, const char *method) {
  pthread_mutex_lock(&ch->mu);
  method_handle_t *m = ch->methods;
  while (m && strcmp(m->method, method) != 0) m = m->next;
  if (!m && (m = calloc(1, sizeof *m))) {
    m->method = strdup(method);
    m->handle = grpc_channel_register_call(ch->ch, method, NULL, NULL);
    m->next = ch->methods;
    ch->methods = m;
  }
  pthread_mutex_unlock(&ch->mu);
  return m ? m->handle : NULL;
}

/* Waits until the channel's state is READY (want_ready) or anything but
 * READY (!want_ready); with fail_fast, gives up at TRANSIENT_FAILURE (a
 * connection attempt failed) and sets *failed. */
static bool wait_state_ex(rpc_channel_t *ch, bool want_ready, int timeout_ms, bool fail_fast,
                          bool *failed) {
  gpr_timespec deadline = wire_deadline(timeout_ms);
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  bool ready = false;
  int tag;
  for (;;) {
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(ch->ch, want_ready);
    if ((s == GRPC_CHANNEL_READY) == want_ready) {
      ready = true;
      break;
    }
    if (s == GRPC_CHANNEL_SHUTDOWN) break;
    if (fail_fast && want_ready && s == GRPC_CHANNEL_TRANSIENT_FAILURE) {
      *failed = true;
      break;
    }
    grpc_channel_watch_connectivity_state(ch->ch, s, deadline, cq, &tag);
    grpc_event ev = grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (!ev.success) break; /* the deadline passed */
  }
  grpc_completion_queue_shutdown(cq);
  grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  grpc_completion_queue_destroy(cq);
  return ready;
}

static bool wait_state(rpc_channel_t *ch, bool want_ready, int timeout_ms) {
  bool failed = false;
  return wait_state_ex(ch, want_ready, timeout_ms, false, &failed);
}

bool rpc_channel_wait_ready(rpc_channel_t *ch, int timeout_ms) { return wait_state(ch, true, timeout_ms); }

rpc_connect_t rpc_channel_connect(rpc_channel_t *ch, int timeout_ms) {
  bool failed = false;
  if (wait_state_ex(ch, true, timeout_ms, true, &failed)) return RPC_CONNECT_READY;
  return failed ? RPC_CONNECT_FAILED : RPC_CONNECT_TIMEOUT;
}
bool rpc_channel_wait_idle(rpc_channel_t *ch, int timeout_ms) { return wait_state(ch, false, timeout_ms); }

static int hex_digit(char c) {
  return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                        : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* A "-bin" key's value: its hex decoded into bytes (rpc_md_t). */
static grpc_slice md_value(const rpc_md_t *m) {
  size_t klen = strlen(m->key), vlen = strlen(m->value);
  if (klen < 4 || strcmp(m->key + klen - 4, "-bin") != 0 || vlen % 2)
    return grpc_slice_from_copied_string(m->value);
  grpc_slice out = grpc_slice_malloc(vlen / 2);
  uint8_t *p = GRPC_SLICE_START_PTR(out);
  for (size_t i = 0; i < vlen / 2; i++) {
    int hi = hex_digit(m->value[2 * i]), lo = hex_digit(m->value[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      grpc_slice_unref(out);
      return grpc_slice_from_copied_string(m->value);
    }
    p[i] = (uint8_t)(hi << 4 | lo);
  }
  return out;
}

static grpc_metadata *make_md(const rpc_md_t *md, size_t nmd) {
  if (nmd == 0) return NULL;
  grpc_metadata *out = calloc(nmd, sizeof *out);
  for (size_t i = 0; out && i < nmd; i++) {
    out[i].key = grpc_slice_from_static_string(md[i].key);
    out[i].value = md_value(&md[i]);
  }
  return out;
}

static void free_md(grpc_metadata *md, size_t nmd) {
  for (size_t i = 0; md && i < nmd; i++) grpc_slice_unref(md[i].value);
  free(md);
}

/* Fills st from a finished call's status, details and trailing metadata. */
static void fill_status(rpc_status_t *st, grpc_status_code code, grpc_slice details,
                        const grpc_metadata_array *trailers) {
  if (!st) return;
  st->code = code;
  size_t n = GRPC_SLICE_LENGTH(details);
  if (n >= sizeof st->message) n = sizeof st->message - 1;
  memcpy(st->message, GRPC_SLICE_START_PTR(details), n);
  st->message[n] = '\0';
  st->kind[0] = '\0';
  for (size_t i = 0; trailers && i < trailers->count; i++) {
    if (grpc_slice_str_cmp(trailers->metadata[i].key, RPC_KIND_KEY) != 0) continue;
    size_t k = GRPC_SLICE_LENGTH(trailers->metadata[i].value);
    if (k >= sizeof st->kind) k = sizeof st->kind - 1;
    memcpy(st->kind, GRPC_SLICE_START_PTR(trailers->metadata[i].value), k);
    st->kind[k] = '\0';
  }
}

static void destroy_cq(grpc_completion_queue *cq) {
  grpc_completion_queue_shutdown(cq);
  grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  grpc_completion_queue_destroy(cq);
}

#define UNARY_LOOK_MS 100 /* rpc_unary_until: how often it asks whether to go on */

/* rpc_unary_until's call, sending `out` (taken: destroyed here). */
static grpc_status_code unary_call(rpc_channel_t *ch, const char *method, grpc_byte_buffer *out,
                                   const ProtobufCMessageDescriptor *resp_desc,
                                   ProtobufCMessage **resp, const rpc_md_t *md, size_t nmd,
                                   int timeout_ms, bool (*stop)(void *arg), void *stop_arg,
                                   rpc_status_t *st) {
  *resp = NULL;
  void *handle = method_handle(ch, method);
  if (!handle) {
    if (out) grpc_byte_buffer_destroy(out);
    fill_status(st, GRPC_STATUS_INTERNAL, grpc_slice_from_static_string("out of memory"), NULL);
    return GRPC_STATUS_INTERNAL;
  }
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  grpc_call *call = grpc_channel_create_registered_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                                        handle, wire_deadline(timeout_ms), NULL);
  grpc_metadata *send_md = make_md(md, nmd);
  grpc_byte_buffer *in = NULL;
  grpc_metadata_array init_md, trailers;
  grpc_metadata_array_init(&init_md);
  grpc_metadata_array_init(&trailers);
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();

  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].data.send_initial_metadata.count = nmd;
  ops[0].data.send_initial_metadata.metadata = send_md;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = out;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &in;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trailers;
  ops[5].data.recv_status_on_client.status = &code;
  ops[5].data.recv_status_on_client.status_details = &details;
  int tag;
  grpc_call_error e = grpc_call_start_batch(call, ops, 6, &tag, NULL);
  if (e == GRPC_CALL_OK) {
    for (bool cancelled = false;;) {
      gpr_timespec until = stop ? wire_deadline(UNARY_LOOK_MS) : gpr_inf_future(GPR_CLOCK_REALTIME);
      if (grpc_completion_queue_pluck(cq, &tag, until, NULL).type == GRPC_OP_COMPLETE) break;
      if (stop && !cancelled && stop(stop_arg)) { /* the status says CANCELLED */
        grpc_call_cancel(call, NULL);
        cancelled = true;
      }
    }
  } else {
    code = GRPC_STATUS_INTERNAL;
    grpc_slice_unref(details);
    details = grpc_slice_from_copied_string(grpc_call_error_to_string(e));
  }
  if (code == GRPC_STATUS_OK) {
    *resp = wire_unpack(in, resp_desc, NULL, 0);
    if (!*resp) {
      code = GRPC_STATUS_INTERNAL;
      grpc_slice_unref(details);
      char msg[256];
      snprintf(msg, sizeof msg, "the reply of %s is not a valid %s", method, resp_desc->name);
      details = grpc_slice_from_copied_string(msg);
    }
  }
  fill_status(st, code, details, &trailers);
  grpc_slice_unref(details);
  if (in) grpc_byte_buffer_destroy(in);
  grpc_byte_buffer_destroy(out);
  grpc_metadata_array_destroy(&init_md);
  grpc_metadata_array_destroy(&trailers);
  free_md(send_md, nmd);
  grpc_call_unref(call);
  destroy_cq(cq);
  return code;
}

grpc_status_code rpc_unary_until(rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                                 const ProtobufCMessageDescriptor *resp_desc,
                                 ProtobufCMessage **resp, const rpc_md_t *md, size_t nmd,
                                 int timeout_ms, bool (*stop)(void *arg), void *stop_arg,
                                 rpc_status_t *st) {
  return unary_call(ch, method, wire_pack(req), resp_desc, resp, md, nmd, timeout_ms, stop,
                    stop_arg, st);
}

grpc_status_code rpc_unary_raw(rpc_channel_t *ch, const char *method, rpc_bytes_t *req,
                               const ProtobufCMessageDescriptor *resp_desc,
                               ProtobufCMessage **resp, const rpc_md_t *md, size_t nmd,
                               int timeout_ms, bool (*stop)(void *arg), void *stop_arg,
                               rpc_status_t *st) {
  return unary_call(ch, method, grpc_byte_buffer_copy(req) /* references, not bytes */,
                    resp_desc, resp, md, nmd, timeout_ms, stop, stop_arg, st);
}

grpc_status_code rpc_unary(rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                           const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                           const rpc_md_t *md, size_t nmd, int timeout_ms, rpc_status_t *st) {
  return rpc_unary_until(ch, method, req, resp_desc, resp, md, nmd, timeout_ms, NULL, NULL, st);
}

/* ------------------------------------------------------------------ streams */

/* What every client call keeps beside its grpc_call: the metadata it sent,
 * the status it will receive, its last message and a lock. First in
 * rpc_stream and async_call; call_core_init and call_core_free are its only
 * setup and clean-up. */
typedef struct call_core {
  grpc_call *call;
  grpc_metadata *send_md;
  size_t nmd;
  grpc_metadata_array init_md, trailers;
  grpc_byte_buffer *recv_buf;
  grpc_status_code code;
  grpc_slice details;
  pthread_mutex_t mu;
} call_core_t;

static void call_core_init(call_core_t *c, rpc_channel_t *ch, void *handle,
                           grpc_completion_queue *cq, gpr_timespec deadline, const rpc_md_t *md,
                           size_t nmd) {
  c->call = grpc_channel_create_registered_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, handle,
                                                deadline, NULL);
  c->send_md = make_md(md, nmd);
  c->nmd = nmd;
  grpc_metadata_array_init(&c->init_md);
  grpc_metadata_array_init(&c->trailers);
  c->details = grpc_empty_slice();
  c->code = GRPC_STATUS_UNKNOWN;
  pthread_mutex_init(&c->mu, NULL);
}

static void call_core_free(call_core_t *c) {
  if (c->recv_buf) grpc_byte_buffer_destroy(c->recv_buf);
  grpc_call_unref(c->call);
  grpc_slice_unref(c->details);
  grpc_metadata_array_destroy(&c->init_md);
  grpc_metadata_array_destroy(&c->trailers);
  free_md(c->send_md, c->nmd);
  pthread_mutex_destroy(&c->mu);
}

struct rpc_stream {
  call_core_t core;
  grpc_completion_queue *cq;
  bool read_pending;    /* a RECV_MESSAGE batch is started and not yet plucked */
  bool got_init_md;
  bool status_done;
  bool write_closed;
  bool write_pending; /* a SEND_MESSAGE batch is started and not yet plucked */
  grpc_byte_buffer *write_buf; /* its message, destroyed when plucked */
  int t_read, t_write, t_status, t_start;
};

/* The absolute time timeout_ms from now (< 0: no bound, 0: now). */
static gpr_timespec write_until(int timeout_ms) {
  return timeout_ms < 0    ? gpr_inf_future(GPR_CLOCK_REALTIME)
         : timeout_ms == 0 ? gpr_now(GPR_CLOCK_MONOTONIC)
                           : wire_deadline(timeout_ms);
}

/* Collects the pending write by `until`: 0 it went out (or none was
 * pending), -1 the call is over, -2 still pending. */
static int stream_write_collect(rpc_stream_t *s, gpr_timespec until) {
  if (!s->write_pending) return 0;
  grpc_event ev = grpc_completion_queue_pluck(s->cq, &s->t_write, until, NULL);
  if (ev.type == GRPC_QUEUE_TIMEOUT) return -2;
  s->write_pending = false;
  grpc_byte_buffer_destroy(s->write_buf);
  s->write_buf = NULL;
  return ev.success ? 0 : -1;
}

/* Starts one batch on the write tag (after the pending write went out) and
 * waits for it by `until`; buf is taken. */
static int stream_write_ops(rpc_stream_t *s, grpc_op *ops, size_t n, grpc_byte_buffer *buf,
                            gpr_timespec until) {
  int rc = stream_write_collect(s, gpr_inf_future(GPR_CLOCK_REALTIME));
  if (rc != 0 || grpc_call_start_batch(s->core.call, ops, n, &s->t_write, NULL) != GRPC_CALL_OK) {
    grpc_byte_buffer_destroy(buf);
    return -1;
  }
  s->write_pending = true;
  s->write_buf = buf;
  return stream_write_collect(s, until);
}

rpc_stream_t *rpc_stream_open(rpc_channel_t *ch, const char *method, const rpc_md_t *md,
                              size_t nmd, int timeout_ms) {
  void *handle = method_handle(ch, method);
  if (!handle) return NULL;
  rpc_stream_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->cq = grpc_completion_queue_create_for_pluck(NULL);
  call_core_init(&s->core, ch, handle, s->cq, wire_deadline(timeout_ms), md, nmd);

  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_INITIAL_METADATA;
  op.data.send_initial_metadata.count = nmd;
  op.data.send_initial_metadata.metadata = s->core.send_md;
  if (grpc_call_start_batch(s->core.call, &op, 1, &s->t_start, NULL) == GRPC_CALL_OK)
    grpc_completion_queue_pluck(s->cq, &s->t_start, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  op.data.recv_status_on_client.trailing_metadata = &s->core.trailers;
  op.data.recv_status_on_client.status = &s->core.code;
  op.data.recv_status_on_client.status_details = &s->core.details;
  grpc_call_start_batch(s->core.call, &op, 1, &s->t_status, NULL);
  return s;
}

int rpc_stream_write(rpc_stream_t *s, const ProtobufCMessage *msg, bool last) {
  grpc_byte_buffer *buf = wire_pack(msg);
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n].op = GRPC_OP_SEND_MESSAGE;
  ops[n++].data.send_message.send_message = buf;
  if (last) ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  int rc = stream_write_ops(s, ops, n, buf, write_until(-1));
  if (last) s->write_closed = true;
  return rc;
}

int rpc_stream_write_raw(rpc_stream_t *s, rpc_bytes_t *msg) {
  return rpc_stream_write_raw_within(s, msg, -1);
}

int rpc_stream_write_raw_within(rpc_stream_t *s, rpc_bytes_t *msg, int timeout_ms) {
  gpr_timespec until = write_until(timeout_ms); /* one bound for both waits */
  int rc = stream_write_collect(s, until); /* the one before, first */
  if (rc != 0) return rc;
  grpc_byte_buffer *buf = grpc_byte_buffer_copy(msg); /* references, not bytes */
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_MESSAGE;
  op.data.send_message.send_message = buf;
  return stream_write_ops(s, &op, 1, buf, until);
}

int rpc_stream_write_wait(rpc_stream_t *s, int timeout_ms) {
  return stream_write_collect(s, write_until(timeout_ms));
}

int rpc_stream_close_send(rpc_stream_t *s) {
  if (s->write_closed) return 0;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  s->write_closed = true;
  return stream_write_ops(s, &op, 1, NULL, write_until(-1));
}

/* The read of rpc_stream_read: 1 with *buf, 0 at the end, -2 on timeout. */
static int stream_read_buf(rpc_stream_t *s, grpc_byte_buffer **buf, int timeout_ms) {
  *buf = NULL;
  if (!s->read_pending) {
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!s->got_init_md) {
      ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
      ops[n++].data.recv_initial_metadata.recv_initial_metadata = &s->core.init_md;
      s->got_init_md = true;
    }
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n++].data.recv_message.recv_message = &s->core.recv_buf;
    if (grpc_call_start_batch(s->core.call, ops, n, &s->t_read, NULL) != GRPC_CALL_OK) return 0;
    s->read_pending = true;
  }
  grpc_event ev = grpc_completion_queue_pluck(s->cq, &s->t_read, wire_deadline(timeout_ms), NULL);
  if (ev.type == GRPC_QUEUE_TIMEOUT) return -2;
  s->read_pending = false;
  *buf = s->core.recv_buf;
  s->core.recv_buf = NULL;
  return *buf ? 1 : 0; /* 0: end of stream, or the call failed: rpc_stream_finish says which */
}

int rpc_stream_read_raw(rpc_stream_t *s, rpc_bytes_t **out, int timeout_ms) {
  return stream_read_buf(s, out, timeout_ms);
}

int rpc_stream_read(rpc_stream_t *s, const ProtobufCMessageDescriptor *desc,
                    ProtobufCMessage **out, int timeout_ms) {
  *out = NULL;
  grpc_byte_buffer *buf;
  int r = stream_read_buf(s, &buf, timeout_ms);
  if (r != 1) return r;
  *out = wire_unpack(buf, desc, NULL, 0);
  grpc_byte_buffer_destroy(buf);
  return *out ? 1 : -1;
}

void rpc_stream_cancel(rpc_stream_t *s) { grpc_call_cancel(s->core.call, NULL); }

grpc_status_code rpc_stream_finish(rpc_stream_t *s, rpc_status_t *st) {
  pthread_mutex_lock(&s->core.mu);
  if (!s->status_done) {
    grpc_completion_queue_pluck(s->cq, &s->t_status, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    s->status_done = true;
  }
  fill_status(st, s->core.code, s->core.details, &s->core.trailers);
  grpc_status_code code = s->core.code;
  pthread_mutex_unlock(&s->core.mu);
  return code;
}

void rpc_stream_destroy(rpc_stream_t *s) {
  if (!s) return;
  if (!s->status_done) {
    grpc_call_cancel(s->core.call, NULL);
    rpc_stream_finish(s, NULL);
  }
  if (s->read_pending) {
    grpc_completion_queue_pluck(s->cq, &s->t_read, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  }
  stream_write_collect(s, write_until(-1)); /* the call is over: a pending write ends now */
  call_core_free(&s->core); /* the call goes before its queue */
  destroy_cq(s->cq);
  free(s);
}

/* ================================================================== client thread */

/* A tag on the client thread's completion queue: the function that takes its
 * event, which of the owner's batches it is, and the owner. */
typedef struct async_tag {
  void (*fn)(struct async_tag *t, bool ok); /* first: an rpc_loop_tag_t on the loop */
  int kind;
  void *owner;
  struct async_tag *qnext; /* forwarded by the loop, waiting for the client thread */
  bool qok;
} async_tag_t;

/* What pulls and duplexes share: the call, its metadata and status, and the
 * references that keep it alive while batches are in flight. First in both
 * structs, so the call's memory is theirs. */
typedef struct async_call {
  call_core_t core;
  int refs;         /* the owner's, and one per batch in flight */
  bool owned;       /* not given back (destroyed) yet */
  bool at_end;      /* no read is armed any more: fn(NULL) once the status is in */
  bool status_done;
  bool ended;       /* fn(NULL) delivered, or never to be */
  bool bad_message; /* ended INTERNAL: a message did not unpack */
} async_call_t;

/* Drops one reference (lock held); after the last, free_rest(ac) frees what
 * the containing struct adds, then the whole goes. */
static void async_unref_locked(async_call_t *ac, void (*free_rest)(async_call_t *ac)) {
  int left = --ac->refs;
  pthread_mutex_unlock(&ac->core.mu);
  if (left) return;
  free_rest(ac);
  call_core_free(&ac->core);
  free(ac);
}

/* The owner's end: no callback from here on; a call still running is
 * cancelled, and the memory goes with the last batch. */
static void async_give_back(async_call_t *ac, void (*free_rest)(async_call_t *ac)) {
  pthread_mutex_lock(&ac->core.mu);
  ac->owned = false;
  if (!ac->status_done) grpc_call_cancel(ac->core.call, NULL);
  async_unref_locked(ac, free_rest);
}

static bool async_batch_locked(async_call_t *ac, grpc_op *ops, size_t n, void *tag) {
  if (grpc_call_start_batch(ac->core.call, ops, n, tag, NULL) != GRPC_CALL_OK) return false;
  ac->refs++;
  return true;
}

static bool async_status_batch_locked(async_call_t *ac, void *tag) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  op.data.recv_status_on_client.trailing_metadata = &ac->core.trailers;
  op.data.recv_status_on_client.status = &ac->core.code;
  op.data.recv_status_on_client.status_details = &ac->core.details;
  return async_batch_locked(ac, &op, 1, tag);
}

/* How the call ended (lock held): a message that did not unpack as desc is
 * INTERNAL, saying so. */
static grpc_status_code async_status_locked(async_call_t *ac,
                                            const ProtobufCMessageDescriptor *desc,
                                            rpc_status_t *st) {
  grpc_status_code code = ac->bad_message ? GRPC_STATUS_INTERNAL : ac->core.code;
  if (st) {
    fill_status(st, code, ac->core.details, &ac->core.trailers);
    if (ac->bad_message)
      snprintf(st->message, sizeof st->message, "a message from the peer is not a valid %s",
               desc ? desc->name : "message");
  }
  return code;
}

/* The thread and queue that serve every pull's and duplex's events. On the
 * process loop (rpc_loop_start) the queue is the loop's: its threads poll,
 * and hand the client's events to this thread through `head` (this thread
 * then never polls, so it never takes a turn at polling from them). */
static struct {
  pthread_mutex_t mu;
  grpc_completion_queue *cq;
  pthread_t thread;
  bool running;
  bool on_loop;
  pthread_cond_t cv;          /* on_loop: an event, or stop */
  async_tag_t *head, *tail;   /* on_loop: forwarded events, oldest first */
  bool stop;
} client = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, false, false, PTHREAD_COND_INITIALIZER,
            NULL, NULL, false};

static void *client_thread(void *arg) {
  grpc_completion_queue *cq = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type == GRPC_OP_COMPLETE) {
      async_tag_t *t = ev.tag;
      t->fn(t, ev.success != 0);
    }
  }
  return NULL;
}

static void *client_thread_on_loop(void *arg) {
  (void)arg;
  pthread_mutex_lock(&client.mu);
  for (;;) {
    while (!client.head && !client.stop) pthread_cond_wait(&client.cv, &client.mu);
    async_tag_t *t = client.head;
    if (!t) break; /* stop, and nothing left */
    client.head = t->qnext;
    if (!client.head) client.tail = NULL;
    pthread_mutex_unlock(&client.mu);
    t->fn(t, t->qok);
    pthread_mutex_lock(&client.mu);
  }
  pthread_mutex_unlock(&client.mu);
  return NULL;
}

void rpc_client_forward(void *tag, bool ok) {
  async_tag_t *t = tag;
  t->qnext = NULL;
  t->qok = ok;
  pthread_mutex_lock(&client.mu);
  bool wake = !client.head;
  if (client.tail) client.tail->qnext = t;
  else client.head = t;
  client.tail = t;
  if (wake) pthread_cond_signal(&client.cv);
  pthread_mutex_unlock(&client.mu);
}

static grpc_completion_queue *client_cq(void) {
  pthread_mutex_lock(&client.mu);
  if (!client.running) {
    grpc_completion_queue *loop_cq = rpc_loop_cq(NULL);
    client.on_loop = loop_cq != NULL;
    client.stop = false;
    client.cq = loop_cq ? loop_cq : grpc_completion_queue_create_for_next(NULL);
    if (pthread_create(&client.thread, NULL, loop_cq ? client_thread_on_loop : client_thread,
                       client.cq) == 0) {
      pthread_setname_np(client.thread, "rpc-client"); /* for top -H and perf */
      client.running = true;
    } else {
      if (!loop_cq) {
        grpc_completion_queue_shutdown(client.cq);
        grpc_completion_queue_destroy(client.cq);
      }
      client.cq = NULL;
    }
  }
  grpc_completion_queue *cq = client.cq;
  pthread_mutex_unlock(&client.mu);
  return cq;
}

void rpc_client_stop_thread(void) {
  pthread_mutex_lock(&client.mu);
  bool running = client.running;
  client.running = false;
  bool on_loop = client.on_loop;
  if (on_loop) { /* the loop stopped first: what it forwarded is all there is */
    client.stop = true;
    pthread_cond_signal(&client.cv);
  }
  pthread_mutex_unlock(&client.mu);
  if (!running) return;
  /* Calls still running would hold this up: their owners cancelled them. */
  if (!on_loop) grpc_completion_queue_shutdown(client.cq);
  pthread_join(client.thread, NULL);
  if (!on_loop) grpc_completion_queue_destroy(client.cq);
  client.cq = NULL;
}

/* A call on the client thread's queue: method's registered call, in a zeroed
 * struct of `size` bytes that begins with its async_call_t. NULL on a bad
 * method or out of memory. */
static async_call_t *async_new(rpc_channel_t *ch, const char *method, size_t size,
                               gpr_timespec deadline, const rpc_md_t *md, size_t nmd) {
  void *handle = method_handle(ch, method);
  grpc_completion_queue *cq = handle ? client_cq() : NULL;
  async_call_t *ac = cq ? calloc(1, size) : NULL;
  if (!ac) return NULL;
  call_core_init(&ac->core, ch, handle, cq, deadline, md, nmd);
  ac->refs = 1;
  ac->owned = true;
  return ac;
}

/* ================================================================== pulls */

typedef enum { PULL_START, PULL_READ, PULL_STATUS } pull_tag_kind_t;

struct rpc_pull {
  async_call_t ac; /* first: freed as one */
  const ProtobufCMessageDescriptor *desc;
  rpc_pull_fn fn;
  rpc_pull_raw_fn raw_fn; /* instead of fn: messages handed on packed */
  void *arg;
  grpc_byte_buffer *req;
  async_tag_t t_start, t_read, t_status;
  bool asked; /* the owner waits for fn */
};


static void pull_free(async_call_t *ac) {
  rpc_pull_t *p = (rpc_pull_t *)ac;
  if (p->req) grpc_byte_buffer_destroy(p->req);
}

/* Hands fn the end of the stream once both the empty read and the status are
 * in. Lock held; returns with it released. The caller holds a reference
 * across it (fn may destroy the pull). */
static void pull_deliver_end_unlock(rpc_pull_t *p) {
  bool deliver = p->ac.at_end && p->ac.status_done && p->asked && !p->ac.ended && p->ac.owned;
  if (deliver) {
    p->asked = false;
    p->ac.ended = true;
  }
  pthread_mutex_unlock(&p->ac.core.mu);
  if (deliver && p->raw_fn) p->raw_fn(p, NULL, p->arg);
  else if (deliver) p->fn(p, NULL, p->arg);
}

/* The batch's reference keeps p alive while fn runs. */
static void pull_event(async_tag_t *t, bool ok) {
  rpc_pull_t *p = t->owner;
  pthread_mutex_lock(&p->ac.core.mu);
  switch (t->kind) {
    case PULL_START:
      break; /* a failure shows in the status */
    case PULL_STATUS:
      p->ac.status_done = true;
      pull_deliver_end_unlock(p);
      pthread_mutex_lock(&p->ac.core.mu);
      break;
    case PULL_READ: {
      grpc_byte_buffer *buf = p->ac.core.recv_buf;
      p->ac.core.recv_buf = NULL;
      if (p->raw_fn && buf && ok && p->ac.owned) {
        p->asked = false;
        pthread_mutex_unlock(&p->ac.core.mu);
        p->raw_fn(p, buf, p->arg);
        pthread_mutex_lock(&p->ac.core.mu);
        break;
      }
      ProtobufCMessage *msg = NULL;
      if (buf && ok && p->ac.owned) {
        msg = wire_unpack(buf, p->desc, NULL, 0);
        if (!msg) {
          p->ac.bad_message = true;
          grpc_call_cancel_with_status(p->ac.core.call, GRPC_STATUS_INTERNAL,
                                       "a message does not unpack", NULL);
        }
      }
      if (buf) grpc_byte_buffer_destroy(buf);
      if (!msg) {
        p->ac.at_end = true;
        pull_deliver_end_unlock(p);
        pthread_mutex_lock(&p->ac.core.mu);
        break;
      }
      p->asked = false;
      pthread_mutex_unlock(&p->ac.core.mu);
      p->fn(p, msg, p->arg);
      pthread_mutex_lock(&p->ac.core.mu);
      break;
    }
  }
  async_unref_locked(&p->ac, pull_free); /* the batch's */
}

rpc_pull_t *rpc_pull_open(rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *desc, const rpc_md_t *md, size_t nmd,
                          int timeout_ms, rpc_pull_fn fn, void *arg) {
  rpc_pull_t *p =
      (rpc_pull_t *)async_new(ch, method, sizeof *p, wire_deadline(timeout_ms), md, nmd);
  if (!p) return NULL;
  p->desc = desc;
  p->fn = fn;
  p->arg = arg;
  p->req = wire_pack(req);
  p->t_start = (async_tag_t){.fn = pull_event, .kind = PULL_START, .owner = p};
  p->t_read = (async_tag_t){.fn = pull_event, .kind = PULL_READ, .owner = p};
  p->t_status = (async_tag_t){.fn = pull_event, .kind = PULL_STATUS, .owner = p};

  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].data.send_initial_metadata.count = nmd;
  ops[0].data.send_initial_metadata.metadata = p->ac.core.send_md;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = p->req;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &p->ac.core.init_md;
  pthread_mutex_lock(&p->ac.core.mu);
  bool started = async_batch_locked(&p->ac, ops, 4, &p->t_start);
  started = async_status_batch_locked(&p->ac, &p->t_status) && started;
  pthread_mutex_unlock(&p->ac.core.mu);
  if (!started) {
    rpc_pull_destroy(p);
    return NULL;
  }
  return p;
}

rpc_pull_t *rpc_pull_open_raw(rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                              const rpc_md_t *md, size_t nmd, int timeout_ms, rpc_pull_raw_fn fn,
                              void *arg) {
  /* No callback runs before the first rpc_pull_next: raw_fn can be set
   * once the call started. */
  rpc_pull_t *p = rpc_pull_open(ch, method, req, NULL, md, nmd, timeout_ms, NULL, arg);
  if (!p) return NULL;
  pthread_mutex_lock(&p->ac.core.mu);
  p->raw_fn = fn;
  pthread_mutex_unlock(&p->ac.core.mu);
  return p;
}

void rpc_pull_next(rpc_pull_t *p) {
  pthread_mutex_lock(&p->ac.core.mu);
  if (p->asked || p->ac.ended || !p->ac.owned) {
    pthread_mutex_unlock(&p->ac.core.mu);
    return;
  }
  p->asked = true;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &p->ac.core.recv_buf;
  if (!async_batch_locked(&p->ac, &op, 1, &p->t_read)) {
    p->ac.at_end = true;
    grpc_call_cancel(p->ac.core.call, NULL);
  }
  pthread_mutex_unlock(&p->ac.core.mu);
}

void rpc_pull_cancel(rpc_pull_t *p) { grpc_call_cancel(p->ac.core.call, NULL); }

grpc_status_code rpc_pull_status(rpc_pull_t *p, rpc_status_t *st) {
  pthread_mutex_lock(&p->ac.core.mu);
  grpc_status_code code = async_status_locked(&p->ac, p->desc, st);
  pthread_mutex_unlock(&p->ac.core.mu);
  return code;
}

void rpc_pull_destroy(rpc_pull_t *p) {
  if (p) async_give_back(&p->ac, pull_free);
}

/* ================================================================== duplexes */

typedef enum { DUPLEX_START, DUPLEX_READ, DUPLEX_WRITE, DUPLEX_STATUS } duplex_tag_kind_t;

struct rpc_duplex {
  async_call_t ac; /* first: freed as one */
  const ProtobufCMessageDescriptor *desc;
  rpc_duplex_fn fn;
  void *arg;
  grpc_byte_buffer *send_buf;
  async_tag_t t_start, t_read, t_write, t_status;
  pthread_cond_t cv; /* with ac.core.mu: a write's end, the call's end */
  bool writing;      /* a write is in flight; write_ok is its outcome */
  bool write_ok;
  rpc_duplex_sent_fn sent; /* the write in flight is rpc_duplex_send_raw's: its end goes here */
  bool end_returned; /* fn(NULL) returned (or was never to run): finish may return */
};

static void duplex_free(async_call_t *ac) { pthread_cond_destroy(&((rpc_duplex_t *)ac)->cv); }

static void duplex_arm_read_locked(rpc_duplex_t *d) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &d->ac.core.recv_buf;
  if (!async_batch_locked(&d->ac, &op, 1, &d->t_read)) {
    d->ac.at_end = true;
    grpc_call_cancel(d->ac.core.call, NULL);
  }
}

/* fn(NULL) once no read is armed and the status is in. Lock held; returns
 * with it held. The caller holds a reference across it. rpc_duplex_finish
 * waits for fn(NULL) to return, not only to start: its caller may free what
 * fn uses next. */
static void duplex_end_locked(rpc_duplex_t *d) {
  if (!d->ac.at_end || !d->ac.status_done || d->ac.ended) return;
  d->ac.ended = true; /* once */
  bool deliver = d->ac.owned;
  pthread_mutex_unlock(&d->ac.core.mu);
  if (deliver) d->fn(d, NULL, d->arg);
  pthread_mutex_lock(&d->ac.core.mu);
  d->end_returned = true;
  pthread_cond_broadcast(&d->cv); /* rpc_duplex_finish */
}

/* The batch's reference keeps d alive while fn runs. */
static void duplex_event(async_tag_t *t, bool ok) {
  rpc_duplex_t *d = t->owner;
  pthread_mutex_lock(&d->ac.core.mu);
  switch (t->kind) {
    case DUPLEX_START:
      break; /* a failure shows in the status */
    case DUPLEX_WRITE: {
      if (d->send_buf) grpc_byte_buffer_destroy(d->send_buf);
      d->send_buf = NULL;
      d->writing = false;
      d->write_ok = ok;
      rpc_duplex_sent_fn sent = d->sent;
      d->sent = NULL;
      pthread_cond_broadcast(&d->cv);
      if (sent && d->ac.owned) {
        pthread_mutex_unlock(&d->ac.core.mu);
        sent(d, ok, d->arg);
        pthread_mutex_lock(&d->ac.core.mu);
      }
      break;
    }
    case DUPLEX_STATUS:
      d->ac.status_done = true;
      duplex_end_locked(d);
      break;
    case DUPLEX_READ: {
      grpc_byte_buffer *buf = d->ac.core.recv_buf;
      d->ac.core.recv_buf = NULL;
      ProtobufCMessage *msg = NULL;
      if (buf && ok && d->ac.owned) {
        msg = wire_unpack(buf, d->desc, NULL, 0);
        if (!msg) {
          d->ac.bad_message = true;
          grpc_call_cancel_with_status(d->ac.core.call, GRPC_STATUS_INTERNAL,
                                       "a message does not unpack", NULL);
        }
      }
      if (buf) grpc_byte_buffer_destroy(buf);
      if (!msg) {
        d->ac.at_end = true;
        duplex_end_locked(d);
        break;
      }
      pthread_mutex_unlock(&d->ac.core.mu);
      d->fn(d, msg, d->arg);
      pthread_mutex_lock(&d->ac.core.mu);
      if (d->ac.owned) duplex_arm_read_locked(d);
      else d->ac.at_end = true;
      duplex_end_locked(d);
      break;
    }
  }
  async_unref_locked(&d->ac, duplex_free); /* the batch's */
}

rpc_duplex_t *rpc_duplex_open(rpc_channel_t *ch, const char *method, const rpc_md_t *md,
                              size_t nmd, int timeout_ms, const ProtobufCMessageDescriptor *desc,
                              rpc_duplex_fn fn, void *arg) {
  rpc_duplex_t *d =
      (rpc_duplex_t *)async_new(ch, method, sizeof *d, wire_deadline(timeout_ms), md, nmd);
  if (!d) return NULL;
  d->desc = desc;
  d->fn = fn;
  d->arg = arg;
  d->t_start = (async_tag_t){.fn = duplex_event, .kind = DUPLEX_START, .owner = d};
  d->t_read = (async_tag_t){.fn = duplex_event, .kind = DUPLEX_READ, .owner = d};
  d->t_write = (async_tag_t){.fn = duplex_event, .kind = DUPLEX_WRITE, .owner = d};
  d->t_status = (async_tag_t){.fn = duplex_event, .kind = DUPLEX_STATUS, .owner = d};
  pthread_cond_init(&d->cv, NULL);

  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].data.send_initial_metadata.count = nmd;
  ops[0].data.send_initial_metadata.metadata = d->ac.core.send_md;
  ops[1].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[1].data.recv_initial_metadata.recv_initial_metadata = &d->ac.core.init_md;
  pthread_mutex_lock(&d->ac.core.mu);
  bool started = async_batch_locked(&d->ac, ops, 2, &d->t_start);
  started = async_status_batch_locked(&d->ac, &d->t_status) && started;
  if (started) duplex_arm_read_locked(d);
  else d->ac.at_end = true;
  pthread_mutex_unlock(&d->ac.core.mu);
  if (!started) {
    /* Nothing may reach fn from here: the owner learns of it by the NULL. */
    rpc_duplex_destroy(d);
    return NULL;
  }
  return d;
}

/* Starts the one send in flight (lock held): msg, which the duplex then owns,
 * and/or the half-close. Its end wakes rpc_duplex_write, or goes to sent. */
static bool duplex_send_locked(rpc_duplex_t *d, grpc_byte_buffer *msg, bool close,
                               rpc_duplex_sent_fn sent) {
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (msg) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = msg;
  }
  if (close) ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  if (!n || d->writing || d->ac.status_done) return false;
  d->send_buf = msg;
  d->writing = true;
  d->sent = sent;
  if (async_batch_locked(&d->ac, ops, n, &d->t_write)) return true;
  d->writing = false;
  d->sent = NULL;
  d->send_buf = NULL;
  return false;
}

int rpc_duplex_write(rpc_duplex_t *d, const ProtobufCMessage *msg) {
  grpc_byte_buffer *buf = wire_pack(msg);
  pthread_mutex_lock(&d->ac.core.mu);
  int rc = -1;
  if (duplex_send_locked(d, buf, false, NULL)) {
    buf = NULL; /* the write's end frees it */
    while (d->writing) pthread_cond_wait(&d->cv, &d->ac.core.mu);
    rc = d->write_ok ? 0 : -1;
  }
  pthread_mutex_unlock(&d->ac.core.mu);
  if (buf) grpc_byte_buffer_destroy(buf);
  return rc;
}

void rpc_duplex_cancel(rpc_duplex_t *d) { grpc_call_cancel(d->ac.core.call, NULL); }

int rpc_duplex_send_raw(rpc_duplex_t *d, rpc_bytes_t *msg, bool close, rpc_duplex_sent_fn sent) {
  pthread_mutex_lock(&d->ac.core.mu);
  bool started = duplex_send_locked(d, msg, close, sent);
  pthread_mutex_unlock(&d->ac.core.mu);
  if (!started && msg) grpc_byte_buffer_destroy(msg);
  return started ? 0 : -1;
}

grpc_status_code rpc_duplex_status(rpc_duplex_t *d, rpc_status_t *st) {
  pthread_mutex_lock(&d->ac.core.mu);
  grpc_status_code code = async_status_locked(&d->ac, d->desc, st);
  pthread_mutex_unlock(&d->ac.core.mu);
  return code;
}

grpc_status_code rpc_duplex_finish(rpc_duplex_t *d, rpc_status_t *st) {
  pthread_mutex_lock(&d->ac.core.mu);
  while (!d->end_returned) pthread_cond_wait(&d->cv, &d->ac.core.mu);
  grpc_status_code code = async_status_locked(&d->ac, d->desc, st);
  pthread_mutex_unlock(&d->ac.core.mu);
  return code;
}

void rpc_duplex_destroy(rpc_duplex_t *d) {
  if (d) async_give_back(&d->ac, duplex_free);
}
