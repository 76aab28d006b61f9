/* Agent/Read and Agent/Write: tensor bytes in and out of a session's ref
 * table, row-major, chunked under the message limit.
 *
 * Read waits (on a helper thread, never a completion-queue thread) until the
 * executor ran through after_seq, then streams a TensorSpec and the bytes. A
 * failed ref ends the call with the failure's kind in the meshd-error-kind
 * trailer and the root's message. Write buffers the chunks of one tensor and
 * defines the ref when the client half-closes. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"
#include "execute.h"
#include "log.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "refs.h"

#define READ_WAIT_MS 600000
#define CHUNK_DEFAULT (1u << 20)
#define CHUNK_MAX (3u << 20)
/* Chunks queued on a Read for a peer that does not take them: the thread
 * sleeps until the peer's flow control lets them go. */
#define READ_QUEUED 2

typedef struct read_job {
  rpc_call_t *call; /* referenced */
  executor_t *ex;   /* referenced */
  char session[64];
  uint64_t ref, after_seq;
  uint32_t chunk;
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

typedef struct drain_wait {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool fired;
} drain_wait_t;

static void drained(rpc_call_t *call, void *arg) {
  drain_wait_t *w = arg;
  pthread_mutex_lock(&w->mu);
  w->fired = true;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Sleeps until at most `below` messages are queued on call, or it ended. */
static void wait_drained(rpc_call_t *call, size_t below) {
  drain_wait_t w = {.fired = false};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  if (rpc_call_when_drained(call, below, drained, &w)) {
    pthread_mutex_lock(&w.mu);
    while (!w.fired) pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
  }
  pthread_cond_destroy(&w.cv);
  pthread_mutex_destroy(&w.mu);
}

static void read_run(read_job_t *j) {
  rpc_call_t *call = j->call;
  if (executor_wait_session(j->ex, j->session, j->after_seq, READ_WAIT_MS) != 0) {
    rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                    "Read: the agent did not execute through seq %llu (it is shutting down or "
                    "its server is gone)", (unsigned long long)j->after_seq);
    return;
  }
  agent_tensor_t t;
  ref_failure_t why = {0};
  int rc = executor_lookup(j->ex, j->session, j->ref, &t, &why);
  if (rc < 0) {
    rpc_call_finish(call, GRPC_STATUS_NOT_FOUND, "UNKNOWN_REF", "Read: %s", why.msg);
    return;
  }
  if (rc > 0) {
    rpc_call_finish(call, error_kind_code(why.kind), error_kind_name(why.kind), "%s", why.msg);
    return;
  }
  backend_t *b = executor_backend(j->ex);
  size_t bytes = tensor_nbytes(&t.meta);
  uint8_t *buf = malloc(bytes ? bytes : 1);
  meshd_error_t e = {0};
  if (!buf || b->ops->to_host(b, &t, buf, &e)) {
    storage_release(t.storage);
    free(buf);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "Read: %s",
                    buf ? e.msg : "agent out of host memory");
    return;
  }
  Meshd__Agent__V1__DataChunk c = MESHD__AGENT__V1__DATA_CHUNK__INIT;
  Meshd__Agent__V1__TensorSpec sp;
  int64_t strides[LAYOUT_MAX_DIMS];
  fill_spec(&sp, j->ref, &t.meta, strides);
  storage_release(t.storage);
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_SPEC;
  c.spec = &sp;
  c.session_id = j->session;
  rpc_call_send(call, &c.base);
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_DATA;
  for (size_t off = 0; off < bytes && !rpc_call_ended(call);) {
    wait_drained(call, READ_QUEUED - 1);
    size_t n = bytes - off < j->chunk ? bytes - off : j->chunk;
    c.data.data = buf + off;
    c.data.len = n;
    if (rpc_call_send(call, &c.base) != 0) break;
    off += n;
  }
  free(buf);
  rpc_call_finish(call, GRPC_STATUS_OK, NULL, "read");
}

static void *read_main(void *arg) {
  read_job_t *j = arg;
  read_run(j);
  executor_unref(j->ex);
  rpc_call_unref(j->call);
  free(j);
  return NULL;
}

void data_read_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  const Meshd__Agent__V1__ReadRequest *req = (const void *)msg;
  executor_t *ex = execute_executor();
  if (!ex || !executor_backend(ex)) {
    if (ex) executor_unref(ex);
    rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE",
                    "Read: no server drives this agent (no Execute call)");
    return;
  }
  read_job_t *j = calloc(1, sizeof *j);
  if (!j) {
    executor_unref(ex);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "agent out of memory");
    return;
  }
  j->call = call;
  j->ex = ex;
  snprintf(j->session, sizeof j->session, "%s", req->session_id);
  j->ref = req->ref;
  j->after_seq = req->after_seq;
  j->chunk = req->max_chunk_bytes ? req->max_chunk_bytes : CHUNK_DEFAULT;
  if (j->chunk > CHUNK_MAX) j->chunk = CHUNK_MAX;
  rpc_call_ref(call);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  int rc = pthread_create(&t, &attr, read_main, j);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "agent out of threads");
    executor_unref(ex);
    rpc_call_unref(call);
    free(j);
  }
}

/* ------------------------------------------------------------------ write */

typedef struct write_state {
  executor_t *ex;
  char session[64];
  uint64_t ref;
  tensor_meta_t meta;
  uint8_t *buf;
  size_t bytes, got;
  bool have_spec, done;
} write_state_t;

void data_write_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  write_state_t *w = calloc(1, sizeof *w);
  if (!w) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "agent out of memory");
    return;
  }
  rpc_call_set_data(call, w);
}

static void write_fail(rpc_call_t *call, write_state_t *w, grpc_status_code code, const char *kind,
                       const char *msg) {
  w->done = true;
  rpc_call_finish(call, code, kind, "Write: %s", msg);
}

static int write_spec(write_state_t *w, const Meshd__Agent__V1__DataChunk *c, char *why, size_t n) {
  const Meshd__Agent__V1__TensorSpec *sp = c->spec;
  meshd_error_t e;
  if (!c->session_id || !*c->session_id) return snprintf(why, n, "the spec names no session"), -1;
  if (!dtype_valid((dtype_t)sp->dtype)) return snprintf(why, n, "unknown dtype %d", (int)sp->dtype), -1;
  if (layout_contiguous(&w->meta.layout, sp->shape, (int64_t)sp->n_shape,
                        dtype_size((dtype_t)sp->dtype), "shape", &e))
    return snprintf(why, n, "%s", e.msg), -1;
  w->meta.dtype = (dtype_t)sp->dtype;
  w->ref = sp->ref;
  snprintf(w->session, sizeof w->session, "%s", c->session_id);
  w->bytes = tensor_nbytes(&w->meta);
  if (!(w->buf = malloc(w->bytes ? w->bytes : 1))) return snprintf(why, n, "agent out of memory"), -1;
  if (!(w->ex = execute_executor()) || !executor_backend(w->ex))
    return snprintf(why, n, "no server drives this agent (no Execute call)"), -1;
  w->have_spec = true;
  return 0;
}

static void write_finish(rpc_call_t *call, write_state_t *w) {
  char why[700];
  if (!w->have_spec) return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                                       "no spec: the first chunk must be a TensorSpec");
  if (w->got != w->bytes) {
    snprintf(why, sizeof why, "got %zu bytes for tensor %llu, which needs %zu", w->got,
             (unsigned long long)w->ref, w->bytes);
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", why);
  }
  backend_t *b = executor_backend(w->ex);
  agent_tensor_t t;
  meshd_error_t e = {0};
  if (tensor_alloc(b, NULL, &w->meta, &t, "Write", &e))
    return write_fail(call, w, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", e.msg);
  int rc = b->ops->from_host(b, &t, w->buf, &e);
  if (!rc) rc = executor_define(w->ex, w->session, w->ref, &t);
  storage_release(t.storage);
  if (rc) return write_fail(call, w, GRPC_STATUS_INTERNAL, "REMOTE_FAILURE", e.msg);
  w->done = true;
  Meshd__Agent__V1__WriteReply r = MESHD__AGENT__V1__WRITE_REPLY__INIT;
  r.bytes = w->got;
  rpc_call_reply(call, &r.base);
}

void data_write_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  write_state_t *w = rpc_call_data(call);
  if (!w || w->done) return;
  if (!msg) return write_finish(call, w);
  const Meshd__Agent__V1__DataChunk *c = (const void *)msg;
  char why[700];
  if (c->part_case == MESHD__AGENT__V1__DATA_CHUNK__PART_SPEC) {
    if (w->have_spec)
      return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", "a second spec");
    if (write_spec(w, c, why, sizeof why))
      return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", why);
    return;
  }
  if (!w->have_spec)
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                      "data before the spec: the first chunk must be a TensorSpec");
  if (c->data.len > w->bytes - w->got) {
    snprintf(why, sizeof why, "more than the %zu bytes tensor %llu holds", w->bytes,
             (unsigned long long)w->ref);
    return write_fail(call, w, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT", why);
  }
  memcpy(w->buf + w->got, c->data.data, c->data.len);
  w->got += c->data.len;
}

void data_write_end(rpc_call_t *call, bool cancelled, void *arg) {
  write_state_t *w = rpc_call_data(call);
  if (!w) return;
  if (w->ex) executor_unref(w->ex);
  free(w->buf);
  free(w);
}
