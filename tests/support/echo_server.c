#include "echo_server.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A unary call waiting for its delayed answer. The request is copied because
 * the layer's request is only valid during on_start. Holds one call ref. */
typedef struct delayed {
  struct delayed *next;
  int64_t due_ms;
  rpc_call_t *call;
  char *text;
  uint8_t *payload;
  size_t payload_len;
  int fail_code;
  char *fail_kind;
  char metadata[256];
  bool abort; /* a ServerStream's: rpc_call_abort with fail_code */
} delayed_t;

/* Per-call state of the streaming methods (callbacks of one call never run
 * concurrently, so it needs no lock). */
typedef struct {
  int count;
  char *text;
  size_t len, cap;
} stream_state_t;

struct echo_server {
  rpc_server_t *srv;
  int port;
  atomic_int started, ended, cancelled, delayed_answered;

  pthread_t timer;
  bool timer_running;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool stopping;
  delayed_t *queue; /* sorted by due_ms */
};

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static char *dup_or_empty(const char *s) { return strdup(s ? s : ""); }

static void answer_unary(rpc_call_t *call, const char *text, const uint8_t *payload,
                         size_t payload_len, int fail_code, const char *fail_kind,
                         const char *metadata) {
  if (fail_code != 0) {
    rpc_call_finish(call, (grpc_status_code)fail_code,
                    fail_kind && fail_kind[0] ? fail_kind : NULL, "echo failure: %s", text);
    return;
  }
  EchoReply rep = ECHO_REPLY__INIT;
  rep.text = (char *)text;
  rep.payload.data = (uint8_t *)payload;
  rep.payload.len = payload_len;
  rep.metadata = (char *)metadata;
  rpc_call_reply(call, &rep.base);
}

static void delayed_free(delayed_t *d) {
  free(d->text);
  free(d->payload);
  free(d->fail_kind);
  free(d);
}

static void *timer_main(void *p) {
  echo_server_t *es = p;
  pthread_mutex_lock(&es->mu);
  for (;;) {
    if (es->stopping) break;
    delayed_t *d = es->queue;
    if (!d) {
      pthread_cond_wait(&es->cv, &es->mu);
      continue;
    }
    int64_t now = mono_ms();
    if (d->due_ms > now) {
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      int64_t wait = d->due_ms - now;
      ts.tv_sec += wait / 1000;
      ts.tv_nsec += (wait % 1000) * 1000000;
      if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
      }
      pthread_cond_timedwait(&es->cv, &es->mu, &ts);
      continue;
    }
    es->queue = d->next;
    pthread_mutex_unlock(&es->mu);
    /* The call may have ended meanwhile (deadline, cancel): answering it must
     * then be a harmless no-op, which the tests rely on the layer for. */
    if (d->abort)
      rpc_call_abort(d->call, (grpc_status_code)d->fail_code,
                     d->fail_kind[0] ? d->fail_kind : NULL, "echo abort: %s", d->text);
    else
      answer_unary(d->call, d->text, d->payload, d->payload_len, d->fail_code, d->fail_kind,
                   d->metadata);
    rpc_call_unref(d->call);
    delayed_free(d);
    atomic_fetch_add(&es->delayed_answered, 1);
    pthread_mutex_lock(&es->mu);
  }
  delayed_t *rest = es->queue;
  es->queue = NULL;
  pthread_mutex_unlock(&es->mu);
  while (rest) {
    delayed_t *next = rest->next;
    rpc_call_unref(rest->call);
    delayed_free(rest);
    rest = next;
  }
  return NULL;
}

static void schedule(echo_server_t *es, delayed_t *d) {
  pthread_mutex_lock(&es->mu);
  delayed_t **pp = &es->queue;
  while (*pp && (*pp)->due_ms <= d->due_ms) pp = &(*pp)->next;
  d->next = *pp;
  *pp = d;
  pthread_cond_signal(&es->cv);
  pthread_mutex_unlock(&es->mu);
}

/* ------------------------------------------------------------- handlers */

/* What req asks to be answered (abort: aborted) delay_ms from now, from the
 * timer thread; the call is held meanwhile. */
static void delay(echo_server_t *es, rpc_call_t *call, const EchoRequest *req, const char *md,
                  bool abort) {
  delayed_t *d = calloc(1, sizeof *d);
  if (!d) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "echo: out of memory");
    return;
  }
  d->due_ms = mono_ms() + req->delay_ms;
  d->call = call;
  d->text = dup_or_empty(req->text);
  if (req->payload.len && !abort) {
    d->payload = malloc(req->payload.len);
    if (d->payload) memcpy(d->payload, req->payload.data, req->payload.len);
  }
  d->payload_len = d->payload ? req->payload.len : 0;
  d->fail_code = req->fail_code;
  d->fail_kind = dup_or_empty(req->fail_kind);
  snprintf(d->metadata, sizeof d->metadata, "%s", md);
  d->abort = abort;
  rpc_call_ref(call);
  schedule(es, d);
}

static void unary_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  echo_server_t *es = arg;
  const EchoRequest *req = (const EchoRequest *)msg;
  atomic_fetch_add(&es->started, 1);
  char md[256];
  const rpc_identity_t *id = rpc_call_identity(call);
  uint8_t bin[64];
  long nbin = rpc_call_metadata_bin(call, "x-echo-bin", bin, sizeof bin);
  if (nbin >= 0) { /* binary metadata: echoed as "bin:<length>:<hex>" */
    int n = snprintf(md, sizeof md, "bin:%ld:", nbin);
    for (long i = 0; i < nbin && i < (long)sizeof bin && n + 3 < (int)sizeof md; i++)
      n += snprintf(md + n, sizeof md - (size_t)n, "%02x", bin[i]);
  } else if (!rpc_call_metadata(call, "x-echo", md, sizeof md)) {
    snprintf(md, sizeof md, "%s%s", id ? "identity:" : "", id ? id->name : "");
  }
  if (req->delay_ms <= 0) {
    answer_unary(call, req->text, req->payload.data, req->payload.len, req->fail_code,
                 req->fail_kind, md);
    return;
  }
  delay(es, call, req, md, false);
}

static void stream_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  echo_server_t *es = arg;
  atomic_fetch_add(&es->started, 1);
  rpc_call_set_data(call, calloc(1, sizeof(stream_state_t)));
}

static void client_stream_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  stream_state_t *st = rpc_call_data(call);
  if (!st) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "echo: out of memory");
    return;
  }
  if (!msg) {
    EchoReply rep = ECHO_REPLY__INIT;
    rep.text = st->text ? st->text : "";
    rep.index = st->count;
    rpc_call_reply(call, &rep.base);
    return;
  }
  const EchoRequest *req = (const EchoRequest *)msg;
  size_t add = req->text ? strlen(req->text) : 0;
  if (st->len + add + 1 > st->cap) {
    size_t cap = st->cap ? st->cap : 64;
    while (cap < st->len + add + 1) cap *= 2;
    char *grown = realloc(st->text, cap);
    if (!grown) {
      rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "echo: out of memory");
      return;
    }
    st->text = grown;
    st->cap = cap;
  }
  memcpy(st->text + st->len, req->text ? req->text : "", add);
  st->len += add;
  st->text[st->len] = '\0';
  st->count++;
}

static void server_stream_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  echo_server_t *es = arg;
  const EchoRequest *req = (const EchoRequest *)msg;
  atomic_fetch_add(&es->started, 1);
  EchoReply rep = ECHO_REPLY__INIT;
  rep.text = req->text;
  rep.payload = req->payload;
  for (int i = 0; i < req->reply_count; i++) {
    rep.index = i;
    if (rpc_call_send(call, &rep.base) != 0) return; /* ended: on_end follows */
  }
  if (req->delay_ms > 0 && req->fail_code != 0) {
    delay(es, call, req, "", true);
    return;
  }
  if (req->fail_code != 0)
    rpc_call_finish(call, (grpc_status_code)req->fail_code,
                    req->fail_kind && req->fail_kind[0] ? req->fail_kind : NULL,
                    "echo failure: %s", req->text);
  else
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "%s", "");
}

static void bidi_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  stream_state_t *st = rpc_call_data(call);
  if (!msg) {
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "%s", "");
    return;
  }
  const EchoRequest *req = (const EchoRequest *)msg;
  if (req->fail_code != 0) {
    rpc_call_finish(call, (grpc_status_code)req->fail_code,
                    req->fail_kind && req->fail_kind[0] ? req->fail_kind : NULL,
                    "echo failure: %s", req->text);
    return;
  }
  EchoReply rep = ECHO_REPLY__INIT;
  rep.text = req->text;
  rep.payload = req->payload;
  rep.index = st ? ++st->count : 0;
  rpc_call_send(call, &rep.base);
}

static void any_end(rpc_call_t *call, bool cancelled, void *arg) {
  echo_server_t *es = arg;
  stream_state_t *st = rpc_call_data(call);
  if (st) {
    free(st->text);
    free(st);
    rpc_call_set_data(call, NULL);
  }
  if (cancelled) atomic_fetch_add(&es->cancelled, 1);
  atomic_fetch_add(&es->ended, 1);
}

/* ------------------------------------------------------------- lifecycle */

static const rpc_method_t methods[] = {
    {
        .path = ECHO_UNARY,
        .kind = RPC_UNARY,
        .request = &echo_request__descriptor,
        .on_start = unary_start,
        .on_end = any_end,
    },
    {
        .path = ECHO_CLIENT_STREAM,
        .kind = RPC_CLIENT_STREAMING,
        .request = &echo_request__descriptor,
        .on_start = stream_start,
        .on_message = client_stream_message,
        .on_end = any_end,
    },
    {
        .path = ECHO_SERVER_STREAM,
        .kind = RPC_SERVER_STREAMING,
        .request = &echo_request__descriptor,
        .on_start = server_stream_start,
        .on_end = any_end,
    },
    {
        .path = ECHO_BIDI,
        .kind = RPC_BIDI,
        .request = &echo_request__descriptor,
        .on_start = stream_start,
        .on_message = bidi_message,
        .on_end = any_end,
    },
};

echo_server_t *echo_server_start(const rpc_server_opts_t *opts, char *err, size_t errlen) {
  return echo_server_start_guarded(opts, NULL, NULL, err, errlen);
}

echo_server_t *echo_server_start_guarded(const rpc_server_opts_t *opts, rpc_guard_fn guard,
                                         void *guard_arg, char *err, size_t errlen) {
  echo_server_t *es = calloc(1, sizeof *es);
  if (!es) {
    snprintf(err, errlen, "echo server: out of memory");
    return NULL;
  }
  pthread_mutex_init(&es->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&es->cv, &ca);
  pthread_condattr_destroy(&ca);

  es->srv = rpc_server_create(opts, err, errlen);
  if (!es->srv) goto fail;
  if (rpc_server_add_methods_guarded(es->srv, methods, sizeof methods / sizeof methods[0], es,
                                     guard, guard_arg) != 0) {
    snprintf(err, errlen, "echo server: methods already registered");
    goto fail;
  }
  if (pthread_create(&es->timer, NULL, timer_main, es) != 0) {
    snprintf(err, errlen, "echo server: cannot start the timer thread");
    goto fail;
  }
  es->timer_running = true;
  es->port = rpc_server_start(es->srv, err, errlen);
  if (es->port <= 0) goto fail;
  return es;

fail:
  echo_server_stop(es, 0);
  return NULL;
}

int echo_server_port(echo_server_t *es) { return es->port; }
rpc_server_t *echo_server_rpc(echo_server_t *es) { return es->srv; }
int echo_server_calls_started(echo_server_t *es) { return atomic_load(&es->started); }
int echo_server_calls_ended(echo_server_t *es) { return atomic_load(&es->ended); }
int echo_server_calls_cancelled(echo_server_t *es) { return atomic_load(&es->cancelled); }
int echo_server_delayed_answered(echo_server_t *es) { return atomic_load(&es->delayed_answered); }

void echo_server_stop(echo_server_t *es, double grace_seconds) {
  if (!es) return;
  /* The timer thread keeps answering during the grace period; after shutdown
   * every call has ended and what is still queued only needs its ref dropped. */
  if (es->srv) rpc_server_shutdown(es->srv, grace_seconds);
  if (es->timer_running) {
    pthread_mutex_lock(&es->mu);
    es->stopping = true;
    pthread_cond_signal(&es->cv);
    pthread_mutex_unlock(&es->mu);
    pthread_join(es->timer, NULL);
  }
  if (es->srv) rpc_server_destroy(es->srv);
  pthread_cond_destroy(&es->cv);
  pthread_mutex_destroy(&es->mu);
  free(es);
}
