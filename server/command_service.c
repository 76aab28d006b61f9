#include "command_service.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "emit.h"
#include "log.h"
#include "metrics.h"
#include "session_service.h"

/* A Sync waiting for agents (watermark.h): answered on its call when every
 * rank it touched ran everything issued before it, or failed with AGENT_LOST. */
typedef struct pending_sync {
  rpc_call_t *call; /* referenced */
  session_t *session; /* referenced: its unreported failures go into the answer */
  bool submit;      /* answer as a SubmitReply (stream stays open) or end the call */
  uint64_t seq;     /* the client's command seq */
  struct submit_state *stream; /* Submit: counts pending answers */
  watermark_target_t *targets; /* until wait_sync */
  size_t n;
} pending_sync_t;

typedef struct submit_state {
  command_service_t *cs;
  session_t *session;
  pthread_mutex_t mu;
  int pending;       /* Syncs not answered yet */
  bool half_closed;
} submit_state_t;

struct command_service {
  frontend_t fe;
  session_table_t *sessions;
  metrics_registry_t *metrics; /* NULL: not counted */
};

void command_service_set_metrics(command_service_t *cs, metrics_registry_t *m) {
  cs->metrics = m;
  metrics_define(m, "meshd_commands_total", METRIC_COUNTER, "Commands run, by kind and status (ok or the error kind).");
  metrics_define_histogram(m, "meshd_command_duration_seconds", "Time to run and answer a command, by kind.",
                           metrics_duration_buckets, metrics_duration_nbuckets);
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void destroy_objects(void *p) { objects_destroy(p); }

static objects_t *session_objects(session_t *s) {
  if (!s->objects) session_set_objects(s, objects_create(), destroy_objects);
  return s->objects;
}

/* ------------------------------------------------------------------ answers */

static void send_result(rpc_call_t *call, bool submit, const Meshd__V1__CommandResult *res) {
  if (!submit) {
    rpc_call_reply(call, &res->base);
    return;
  }
  Meshd__V1__SubmitReply reply = MESHD__V1__SUBMIT_REPLY__INIT;
  reply.result = (Meshd__V1__CommandResult *)res;
  rpc_call_send(call, &reply.base);
}

static void send_error(rpc_call_t *call, bool submit, uint64_t seq, const meshd_error_t *e) {
  if (!submit) {
    rpc_call_finish(call, error_kind_code(e->kind), error_kind_name(e->kind), "%s", e->msg);
    return;
  }
  cmd_out_t out;
  cmd_out_init(&out, seq);
  cmd_out_error(&out, e);
  send_result(call, true, &out.res);
  cmd_out_free(&out);
}

static void submit_answered(submit_state_t *st, rpc_call_t *call) {
  pthread_mutex_lock(&st->mu);
  st->pending--;
  bool finish = st->half_closed && st->pending == 0;
  pthread_mutex_unlock(&st->mu);
  if (finish) rpc_call_finish(call, GRPC_STATUS_OK, NULL, "end of stream");
}

/* The session's run-time failures not yet reported, moved into out.errors. */
static void take_failures(session_t *s, cmd_out_t *out) {
  pthread_mutex_lock(&s->mu);
  objects_t *o = s->objects;
  size_t n = o ? o->nunreported : 0;
  Meshd__V1__Error *errs = n ? calloc(n, sizeof *errs) : NULL;
  Meshd__V1__Error **ptrs = n ? calloc(n, sizeof *ptrs) : NULL;
  char *msgs = n ? calloc(n, sizeof o->unreported[0].msg) : NULL;
  if (errs && ptrs && msgs) {
    for (size_t i = 0; i < n; i++) {
      meshd__v1__error__init(&errs[i]);
      errs[i].kind = (Meshd__V1__ErrorKind)o->unreported[i].kind;
      errs[i].code = (int32_t)error_kind_code(o->unreported[i].kind);
      errs[i].seq = o->unreported_seq[i];
      errs[i].message = msgs + i * sizeof o->unreported[0].msg;
      memcpy(errs[i].message, o->unreported[i].msg, sizeof o->unreported[0].msg);
      ptrs[i] = &errs[i];
    }
    o->nunreported = 0;
    out->res.errors = ptrs;
    out->res.n_errors = n;
  }
  pthread_mutex_unlock(&s->mu);
  /* cmd_out frees these with the result */
  if (n && errs && ptrs && msgs) {
    out->allocs[out->nallocs++] = errs;
    out->allocs[out->nallocs++] = ptrs;
    out->allocs[out->nallocs++] = msgs;
  } else {
    free(errs);
    free(ptrs);
    free(msgs);
  }
}

static void complete_sync(pending_sync_t *p, const meshd_error_t *e) {
  if (e) {
    send_error(p->call, p->submit, p->seq, e);
  } else {
    cmd_out_t out;
    cmd_out_init(&out, p->seq);
    take_failures(p->session, &out);
    send_result(p->call, p->submit, &out.res);
    cmd_out_free(&out);
  }
  if (p->stream) submit_answered(p->stream, p->call);
  rpc_call_unref(p->call);
  session_release(p->session);
  free(p);
}

void command_service_on_report(command_service_t *cs, uint32_t rank,
                               const Meshd__V1__Error *const *errors, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const Meshd__V1__Error *err = errors[i];
    session_t *s = session_find(cs->sessions, err->session_id);
    if (!s) continue; /* the session ended meanwhile */
    error_kind_t kind = err->kind ? (error_kind_t)err->kind : ERR_REMOTE_FAILURE;
    /* Kernel messages name their rank; others get it here. */
    const char *text = err->message ? err->message : "";
    char msg[520];
    if (strstr(text, "(rank ")) snprintf(msg, sizeof msg, "%s", text);
    else snprintf(msg, sizeof msg, "%s (rank %u)", text, rank);
    pthread_mutex_lock(&s->mu);
    objects_t *o = s->objects;
    if (o) {
      /* One command failing on several ranks is one root failure: only the
       * report that fails the tensor is kept for Sync, under the client seq of
       * the command that made the tensor (agents know only their link seqs). */
      obj_t *t = err->ref ? objects_get(o, err->ref) : NULL;
      bool tensor = t && t->kind == OBJ_TENSOR;
      if (kind == ERR_DEPENDENT_FAILURE) {
        /* Not a root: the tensor fails everywhere, Sync reports only its root. */
        if (tensor && t->tensor.state == TENSOR_LIVE)
          objects_fail_tensor(o, t, t->tensor.born_seq, kind, t->tensor.born_seq, msg);
      } else if (tensor && t->tensor.state == TENSOR_LIVE) {
        uint64_t seq = t->tensor.born_seq;
        objects_fail_tensor(o, t, seq, kind, seq, msg);
        objects_note_failure(o, kind, msg, seq);
      } else if (!tensor) {
        objects_note_failure(o, kind, msg, err->seq);
      }
    }
    pthread_mutex_unlock(&s->mu);
    log_debug("command", "session %.8s: rank %u reports %s: %s", s->id, rank,
              error_kind_name(kind), msg);
    session_release(s);
  }
}

/* The session's notes of agent losses (command_service_on_agent_lost), taken
 * out: a Sync that fails with AGENT_LOST reports them; the message of the
 * first goes into msg. */
static void take_loss_notes(session_t *s, char *msg, size_t len) {
  pthread_mutex_lock(&s->mu);
  objects_t *o = s->objects;
  size_t k = 0;
  for (size_t i = 0; o && i < o->nunreported; i++) {
    if (o->unreported[i].kind == ERR_AGENT_LOST) {
      if (msg[0] == '\0') snprintf(msg, len, "%s", o->unreported[i].msg);
      continue;
    }
    o->unreported[k] = o->unreported[i];
    o->unreported_seq[k++] = o->unreported_seq[i];
  }
  if (o) o->nunreported = k;
  pthread_mutex_unlock(&s->mu);
}

void command_service_on_agent_lost(command_service_t *cs, const agent_lost_t *l) {
  char when[48];
  time_t t = (time_t)(l->unix_ms / 1000);
  struct tm tm;
  gmtime_r(&t, &tm);
  size_t k = strftime(when, sizeof when, "%H:%M:%S", &tm);
  snprintf(when + k, sizeof when - k, ".%03d UTC", (int)(l->unix_ms % 1000));
  char reason[200];
  snprintf(reason, sizeof reason, "was lost at %s", when);
  session_info_t *rows = NULL;
  size_t n = 0;
  if (session_list(cs->sessions, &rows, &n) != 0) {
    log_error("command", "out of memory telling sessions that rank %u was lost", l->rank);
    return;
  }
  size_t told = 0;
  for (size_t i = 0; i < n; i++) {
    session_t *s = session_find(cs->sessions, rows[i].id);
    if (!s) continue;
    pthread_mutex_lock(&s->mu);
    objects_t *o = s->objects;
    if (o && l->rank < o->ntouched && o->touched[l->rank]) {
      /* Reported by the next Sync (or the one waiting now); the survivors stop
       * waiting for the lost rank in this session's work. */
      char msg[400];
      snprintf(msg, sizeof msg,
               "the agent of rank %u %s: this session's tensors on it are gone, and meshes that "
               "include rank %u refuse new commands; create a new mesh to use its replacement",
               l->rank, reason, l->rank);
      objects_note_failure(o, ERR_AGENT_LOST, msg, 0);
      o->losses++; /* new ToMesh channels: none shared with work the lost agent may still run */
      emit_peer_lost(&cs->fe, s, o, l->rank, l->data_address, reason);
      told++;
    }
    pthread_mutex_unlock(&s->mu);
    session_release(s);
  }
  free(rows);
  log_warn("command", "rank %u (agent %s) %s: %zu session(s) with work on it told", l->rank,
           l->agent_id, reason, told);
}

static void sync_fired(watermark_result_t result, uint32_t lost_rank, void *arg) {
  pending_sync_t *p = arg;
  meshd_error_t e;
  if (result == WATERMARK_REACHED) {
    complete_sync(p, NULL);
    return;
  }
  if (result == WATERMARK_LOST) {
    char note[sizeof e.msg] = "";
    take_loss_notes(p->session, note, sizeof note);
    if (note[0])
      error_set(&e, ERR_AGENT_LOST, "Sync: %s", note);
    else
      error_set(&e, ERR_AGENT_LOST,
                "Sync: the agent of rank %u was lost before it ran this session's work; tensors "
                "it held are gone", lost_rank);
  } else
    error_set(&e, ERR_UNAVAILABLE, "Sync: the server is shutting down");
  complete_sync(p, &e);
}

/* Starts a Sync for session s (under s->mu): a StatusRequest to every rank it
 * touched. Returns the pending Sync with its targets, to be waited on with
 * wait_sync after s->mu is released (its answer takes s->mu), or NULL if it
 * was answered already (out of memory). */
static pending_sync_t *start_sync(command_service_t *cs, session_t *s, objects_t *o,
                                  rpc_call_t *call, bool submit, uint64_t seq,
                                  submit_state_t *stream) {
  pending_sync_t *p = calloc(1, sizeof *p);
  size_t cap = o->ntouched ? o->ntouched : 1;
  uint32_t *ranks = malloc(sizeof *ranks * cap);
  uint64_t *seqs = malloc(sizeof *seqs * cap);
  watermark_target_t *targets = malloc(sizeof *targets * cap);
  if (!p || !ranks || !seqs || !targets) {
    free(p);
    free(ranks);
    free(seqs);
    free(targets);
    meshd_error_t e;
    error_set(&e, ERR_QUOTA, "Sync: out of memory on the server");
    send_error(call, submit, seq, &e);
    if (stream) submit_answered(stream, call);
    return NULL;
  }
  *p = (pending_sync_t){.call = call, .session = s, .submit = submit, .seq = seq, .stream = stream};
  rpc_call_ref(call);
  session_ref(s);
  p->n = emit_status(&cs->fe, s, o, ranks, seqs, cap);
  for (size_t i = 0; i < p->n; i++) targets[i] = (watermark_target_t){ranks[i], seqs[i]};
  p->targets = targets;
  free(ranks);
  free(seqs);
  return p;
}

static void wait_sync(command_service_t *cs, pending_sync_t *p) {
  watermark_target_t *targets = p->targets;
  p->targets = NULL;
  uint32_t lost = 0;
  /* Only this session's work counts: another's stalled instruction on the
   * same agents never holds this Sync. */
  watermark_result_t r = watermark_wait_session(agent_pool_watermark(cs->fe.pool), p->session->id,
                                                targets, p->n, sync_fired, p, NULL, &lost);
  free(targets); /* copied by watermark_wait; p may be gone already */
  if (r != WATERMARK_PENDING) sync_fired(r, lost, p);
}

/* ------------------------------------------------------------------ one command */

static void run_one(command_service_t *cs, session_t *s, rpc_call_t *call, bool submit,
                    const Meshd__V1__Command *cmd, submit_state_t *stream) {
  cmd_out_t out;
  meshd_error_t e;
  double t0 = cs->metrics ? now_seconds() : 0;
  cmd_out_init(&out, cmd->seq);
  pthread_mutex_lock(&s->mu);
  objects_t *o = session_objects(s);
  int rc = o ? command_run(&cs->fe, s, o, cmd, &out, &e)
             : error_set(&e, ERR_QUOTA, "%s: out of memory on the server", command_name(cmd));
  bool sync = rc == 0 && cmd->kind_case == MESHD__V1__COMMAND__KIND_SYNC;
  if (o) {
    s->bytes_held = o->bytes;
    s->live_tensors = o->live_tensors;
  }
  pending_sync_t *pending = NULL;
  if (sync) {
    if (stream) {
      pthread_mutex_lock(&stream->mu);
      stream->pending++;
      pthread_mutex_unlock(&stream->mu);
    }
    pending = start_sync(cs, s, o, call, submit, cmd->seq, stream);
  }
  pthread_mutex_unlock(&s->mu);
  if (pending) wait_sync(cs, pending);
  /* Counted before the answer: a client that scrapes after its reply sees it. */
  if (cs->metrics) {
    const char *kind = command_name(cmd);
    metrics_inc(cs->metrics, "meshd_commands_total",
                (const char *[]){"kind", kind, "status", rc ? error_kind_name(e.kind) : "ok", NULL}, 1);
    metrics_observe(cs->metrics, "meshd_command_duration_seconds", (const char *[]){"kind", kind, NULL},
                    now_seconds() - t0);
  }
  if (rc) {
    log_debug("command", "session %.8s: %s seq %llu rejected: %s: %s", s->id, command_name(cmd),
              (unsigned long long)cmd->seq, error_kind_name(e.kind), e.msg);
    send_error(call, submit, cmd->seq, &e);
  } else if (!sync) {
    send_result(call, submit, &out.res);
  }
  cmd_out_free(&out);
}

static void on_execute(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  command_service_t *cs = arg;
  session_t *s = session_from_call(cs->sessions, call);
  if (!s) return;
  run_one(cs, s, call, false, (const Meshd__V1__Command *)req, NULL);
  session_release(s);
}

static void on_submit_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  command_service_t *cs = arg;
  session_t *s = session_from_call(cs->sessions, call);
  if (!s) return;
  submit_state_t *st = calloc(1, sizeof *st);
  if (!st) {
    session_release(s);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "out of memory on the server");
    return;
  }
  st->cs = cs;
  st->session = s;
  pthread_mutex_init(&st->mu, NULL);
  rpc_call_set_data(call, st);
}

static void on_submit_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  submit_state_t *st = rpc_call_data(call);
  if (!st) return;
  if (!msg) { /* half-close: end once every Sync is answered */
    pthread_mutex_lock(&st->mu);
    st->half_closed = true;
    bool finish = st->pending == 0;
    pthread_mutex_unlock(&st->mu);
    if (finish) rpc_call_finish(call, GRPC_STATUS_OK, NULL, "end of stream");
    return;
  }
  session_touch(st->session);
  run_one(st->cs, st->session, call, true, (const Meshd__V1__Command *)msg, st);
}

static void on_submit_end(rpc_call_t *call, bool cancelled, void *arg) {
  submit_state_t *st = rpc_call_data(call);
  if (!st) return;
  session_release(st->session);
  pthread_mutex_destroy(&st->mu);
  free(st);
}

/* ------------------------------------------------------------------ lifecycle */

void command_service_session_closed(command_service_t *cs, session_t *s) {
  pthread_mutex_lock(&s->mu);
  if (s->objects) emit_end_session(&cs->fe, s, s->objects);
  pthread_mutex_unlock(&s->mu);
}

command_service_t *command_service_create(agent_pool_t *pool, session_table_t *sessions) {
  command_service_t *cs = calloc(1, sizeof *cs);
  if (!cs) return NULL;
  cs->fe.pool = pool;
  cs->sessions = sessions;
  return cs;
}

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.v1.TensorService/Execute",
        .kind = RPC_UNARY,
        .request = &meshd__v1__command__descriptor,
        .on_start = on_execute,
    },
    {
        .path = "/meshd.v1.TensorService/Submit",
        .kind = RPC_BIDI,
        .request = &meshd__v1__command__descriptor,
        .on_start = on_submit_start,
        .on_message = on_submit_message,
        .on_end = on_submit_end,
    },
};

const rpc_method_t *command_service_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
}

void command_service_destroy(command_service_t *cs) { free(cs); }
