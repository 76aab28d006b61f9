#include "command_service.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agent_link.h"
#include "emit.h"
#include "flow.h"
#include "log.h"
#include "metrics.h"
#include "session_service.h"
#include "workpool.h"

/* A Sync waiting for agents (watermark.h): answered on its call when every
 * rank it touched ran everything issued before it, or failed with AGENT_LOST. */
typedef struct pending_sync {
  rpc_call_t *call; /* referenced */
  session_t *session; /* referenced: its unreported failures go into the answer */
  bool submit;      /* answer as a SubmitReply (stream stays open) or end the call */
  uint64_t seq;     /* the client's command seq */
  double t0;        /* when the server read it (monotonic s; with sync_hist) */
  metrics_series_t *sync_hist; /* NULL: not measured */
  struct submit_state *stream; /* Submit: counts pending answers */
  watermark_target_t *targets; /* until wait_sync */
  size_t n;
  /* Submit: in the stream's list of registered waits (under its mu), so that
   * the stream's end can withdraw them. */
  struct pending_sync *prev, *next;
  uint64_t wait_id;
} pending_sync_t;

typedef struct submit_state {
  command_service_t *cs;
  session_t *session;
  pthread_mutex_t mu;
  int pending;       /* Syncs not answered yet */
  int refs;          /* the stream's, and one per pending Sync (which may outlive it) */
  pending_sync_t *waits; /* pending Syncs registered on the watermark */
  bool half_closed;
  uint64_t flow_wait; /* its flow wait, while one is registered (reads paused until it fires) */
  struct flow_hold *flow_hold; /* what that wait holds */
  uint64_t last_seq;  /* the highest Command.seq read so far (reads are one at a time) */
  uint64_t msg_bytes; /* instruction bytes the Command.batch being run queued so far */
  /* Under mu: the rest of a Command.batch, waiting for room (batch_run). */
  struct batch_rest *rest;
  /* Answers to commands sent one per message, held until the reading thread
   * has nothing more to read (or HELD_FLUSH_* says): one SubmitReply for what
   * arrived back to back, as the agents get one batch. Under held_mu, which
   * also keeps every send on the stream in order with them. */
  pthread_mutex_t held_mu;
  struct reply_batch *held;
} submit_state_t;

#define CMD_KINDS 32 /* above the highest Command kind_case */

struct command_service {
  frontend_t fe;
  session_table_t *sessions;
  flow_t *flow;
  metrics_registry_t *metrics; /* NULL: not counted */
  metrics_series_t *sync_hist; /* meshd_sync_duration_seconds */
  /* Each kind's meshd_commands_total{status="ok"} and duration series, found
   * on its first command (a series appears once used): the labels are not
   * rendered and looked up again per command. Index: kind_case. */
  _Atomic(metrics_series_t *) ok_total[CMD_KINDS], duration[CMD_KINDS];
  workpool_t *jobs; /* runs the rest of a batch once there is room (batch_run) */
};

/* Sync waits for agents' work: buckets up to a minute. */
static const double sync_buckets[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                      0.25,   0.5,   1,      2.5,   5,    10,    30,    60};

static double queued_commands_gauge(void *arg) {
  flow_stats_t st;
  flow_stats(arg, NULL, &st);
  return (double)st.queued_commands;
}

static double queued_bytes_gauge(void *arg) {
  flow_stats_t st;
  flow_stats(arg, NULL, &st);
  return (double)st.queued_bytes;
}

static double flow_waiting_gauge(void *arg) {
  flow_stats_t st;
  flow_stats(arg, NULL, &st);
  return (double)st.waits;
}

static double flow_waits_counter(void *arg) {
  flow_stats_t st;
  flow_stats(arg, NULL, &st);
  return (double)st.waits_total;
}

void command_service_set_metrics(command_service_t *cs, metrics_registry_t *m) {
  cs->metrics = m;
  metrics_define(m, "meshd_commands_total", METRIC_COUNTER, "Commands handled, by kind and status (ok or the error kind).");
  metrics_define_histogram(m, "meshd_command_duration_seconds", "Time from reading a command to accepting or refusing it, by kind.",
                           metrics_duration_buckets, metrics_duration_nbuckets);
  metrics_define(m, "meshd_queued_commands", METRIC_GAUGE,
                 "Commands accepted and not yet known to have run on the agents, all sessions "
                 "(counted at flow control checkpoints).");
  metrics_set_fn(m, "meshd_queued_commands", NULL, queued_commands_gauge, cs->flow);
  metrics_define(m, "meshd_queued_instruction_bytes", METRIC_GAUGE,
                 "Packed instruction bytes of those commands, over all their ranks.");
  metrics_set_fn(m, "meshd_queued_instruction_bytes", NULL, queued_bytes_gauge, cs->flow);
  metrics_define(m, "meshd_flow_waiting", METRIC_GAUGE,
                 "Calls waiting for room now: Submit streams not reading, Execute answers held.");
  metrics_set_fn(m, "meshd_flow_waiting", NULL, flow_waiting_gauge, cs->flow);
  metrics_define(m, "meshd_flow_waits_total", METRIC_COUNTER,
                 "Times a call had to wait for room (a session or the server over its bound).");
  metrics_set_fn(m, "meshd_flow_waits_total", NULL, flow_waits_counter, cs->flow);
  metrics_define_histogram(m, "meshd_sync_duration_seconds",
                           "Time from reading a Sync to answering it.", sync_buckets,
                           sizeof sync_buckets / sizeof sync_buckets[0]);
  cs->sync_hist = metrics_series(m, "meshd_sync_duration_seconds", NULL);
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void destroy_objects(void *p) { objects_destroy(p); }

/* The session's objects and flow window, made on first use. Under s->mu. */
static objects_t *session_objects(command_service_t *cs, session_t *s) {
  if (!s->objects) session_set_objects(s, objects_create(), destroy_objects);
  objects_t *o = s->objects;
  /* Without a window (out of memory) the session runs unbounded. */
  if (o && !o->flow) o->flow = flow_window_open(cs->flow, &s->queued_commands);
  return o;
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

/* A batch's answers (Command.batch), packed as SubmitReply.results as they
 * come and sent together: at the batch's end, or sooner past
 * REPLY_BATCH_FLUSH bytes (several messages then, still in order). */
#define REPLY_BATCH_FLUSH (1u << 20)

typedef struct reply_batch {
  rpc_call_t *call;
  uint8_t *buf;
  size_t len, cap;
  size_t n;        /* answers in buf */
  bool lone_as_result; /* held answers: one alone goes as SubmitReply.result */
  pthread_mutex_t *mu; /* held answers: the stream's held_mu, taken by batch_add */
  double since;        /* held answers: when the first of buf was added (now_seconds) */
} reply_batch_t;

/* Held answers go out at the latest once this many wait, or the first waited
 * this long: a reader that always finds another message ready (a client
 * that never pauses) still hears back. */
#define HELD_FLUSH_ANSWERS 256
#define HELD_FLUSH_SECONDS 0.001

static void batch_flush(reply_batch_t *b) {
  if (!b->len) return;
  /* The one answer of a lone command, as it would go unheld: field 1, not 2. */
  if (b->n == 1 && b->lone_as_result) b->buf[0] = (1 << 3) | 2;
  rpc_bytes_t *m = rpc_bytes_copy(b->buf, b->len);
  /* (a call already over ignores the finish: held answers may outlive it) */
  if (!m || rpc_call_send_raw(b->call, m) != 0)
    rpc_call_finish(b->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA",
                    "Submit: out of memory on the server for a batch's answers");
  b->len = 0;
  b->n = 0;
}

static void batch_add_locked(reply_batch_t *b, const Meshd__V1__CommandResult *res) {
  size_t n = protobuf_c_message_get_packed_size(&res->base);
  if (b->len + n + 11 > b->cap) {
    size_t cap = b->cap * 2 > b->len + n + 11 ? b->cap * 2 : b->len + n + 11 + 4096;
    uint8_t *p = realloc(b->buf, cap);
    if (!p) {
      rpc_call_finish(b->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA",
                      "Submit: out of memory on the server for a batch's answers");
      return;
    }
    b->buf = p;
    b->cap = cap;
  }
  b->buf[b->len++] = (2 << 3) | 2; /* SubmitReply.results, length-delimited */
  for (size_t v = n;; v >>= 7) {
    b->buf[b->len++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    if (v <= 0x7f) break;
  }
  b->len += protobuf_c_message_pack(&res->base, b->buf + b->len);
  b->n++;
  if (b->len >= REPLY_BATCH_FLUSH) batch_flush(b);
}

static void batch_add(reply_batch_t *b, const Meshd__V1__CommandResult *res) {
  if (!b->mu) return batch_add_locked(b, res);
  pthread_mutex_lock(b->mu);
  if (!b->n) b->since = now_seconds();
  batch_add_locked(b, res);
  if (b->n >= HELD_FLUSH_ANSWERS || (b->n && now_seconds() - b->since >= HELD_FLUSH_SECONDS))
    batch_flush(b);
  pthread_mutex_unlock(b->mu);
}

/* An answer on the Execute call, or the Submit stream, or into its batch. */
static void answer(rpc_call_t *call, bool submit, reply_batch_t *batch,
                   const Meshd__V1__CommandResult *res) {
  if (batch) batch_add(batch, res);
  else send_result(call, submit, res);
}

static void answer_error(rpc_call_t *call, bool submit, reply_batch_t *batch, uint64_t seq,
                         const meshd_error_t *e) {
  if (!batch) return send_error(call, submit, seq, e);
  cmd_out_t out;
  cmd_out_init(&out, seq);
  cmd_out_error(&out, e);
  batch_add(batch, &out.res);
  cmd_out_free(&out);
}

static void submit_unref(submit_state_t *st) {
  pthread_mutex_lock(&st->mu);
  bool last = --st->refs == 0;
  pthread_mutex_unlock(&st->mu);
  if (!last) return;
  if (st->held) free(st->held->buf);
  free(st->held);
  pthread_mutex_destroy(&st->held_mu);
  pthread_mutex_destroy(&st->mu);
  free(st);
}

/* ------------------------------------------------------------------ held answers */

/* The streams whose answers this thread holds, each with a reference on the
 * stream and on its call, let go by command_service_before_wait. */
#define HELD_STREAMS 64
static _Thread_local struct {
  size_t n;
  submit_state_t *st[HELD_STREAMS];
  rpc_call_t *call[HELD_STREAMS];
} held_here;

/* Sends what the stream holds. */
static void held_flush(submit_state_t *st) {
  pthread_mutex_lock(&st->held_mu);
  if (st->held) batch_flush(st->held);
  pthread_mutex_unlock(&st->held_mu);
}

/* The stream's held answers for the command being read, or NULL where
 * nothing would let them go (not a completion-queue thread of the server,
 * or too many streams held here): the command is then answered at once,
 * after what the stream held. */
static reply_batch_t *hold_answers(submit_state_t *st, rpc_call_t *call) {
  if (!st->held) return NULL;
  for (size_t i = 0; i < held_here.n; i++)
    if (held_here.st[i] == st) return st->held;
  if (held_here.n == HELD_STREAMS || !rpc_server_hold_until_idle()) {
    held_flush(st);
    return NULL;
  }
  pthread_mutex_lock(&st->mu);
  st->refs++;
  pthread_mutex_unlock(&st->mu);
  rpc_call_ref(call);
  held_here.st[held_here.n] = st;
  held_here.call[held_here.n++] = call;
  return st->held;
}

void command_service_before_wait(void) {
  for (size_t i = 0; i < held_here.n; i++) {
    held_flush(held_here.st[i]);
    submit_unref(held_here.st[i]);
    rpc_call_unref(held_here.call[i]);
  }
  held_here.n = 0;
}

/* An answer on a Submit stream from outside its reading (a Sync that waited):
 * after what the stream holds, and before anything held later. */
static void stream_answer(submit_state_t *st, rpc_call_t *call, uint64_t seq,
                          const Meshd__V1__CommandResult *res, const meshd_error_t *e) {
  pthread_mutex_lock(&st->held_mu);
  if (st->held) batch_flush(st->held);
  if (e) send_error(call, true, seq, e);
  else send_result(call, true, res);
  pthread_mutex_unlock(&st->held_mu);
}

/* A pending Sync of the stream was answered; drops the Sync's reference (the
 * stream may have ended meanwhile: a client that gave up on its Sync). */
static void submit_answered(submit_state_t *st, rpc_call_t *call) {
  pthread_mutex_lock(&st->mu);
  st->pending--;
  bool finish = st->half_closed && st->pending == 0;
  pthread_mutex_unlock(&st->mu);
  if (finish) {
    held_flush(st);
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "end of stream");
  }
  submit_unref(st);
}

/* What an Execute call leaves waiting: withdrawn when the call ends first (its
 * client gave up: deadline, cancel), so that nothing holds the call, its
 * session or the flow window for a client that is gone. */
typedef struct exec_state {
  pthread_mutex_t mu;
  struct pending_sync *sync; /* valid only while sync_wait is registered */
  uint64_t sync_wait;        /* watermark wait id of its Sync */
  uint64_t flow_wait;        /* flow wait id of its held answer */
  struct flow_hold *flow_hold; /* what that wait holds */
} exec_state_t;

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

/* A Submit stream's Sync about to wait: in the stream's list from now until
 * it is answered or withdrawn. */
static void list_sync(pending_sync_t *p) {
  submit_state_t *st = p->stream;
  pthread_mutex_lock(&st->mu);
  p->prev = NULL;
  p->next = st->waits;
  if (st->waits) st->waits->prev = p;
  st->waits = p;
  pthread_mutex_unlock(&st->mu);
}

static void unlink_sync_locked(submit_state_t *st, pending_sync_t *p) {
  if (p->prev) p->prev->next = p->next;
  else st->waits = p->next;
  if (p->next) p->next->prev = p->prev;
  p->prev = p->next = NULL;
}

/* Takes p out of its stream's list of waits, if it is in it. */
static void unlist_sync(pending_sync_t *p) {
  submit_state_t *st = p->stream;
  if (!st) return;
  pthread_mutex_lock(&st->mu);
  for (pending_sync_t *q = st->waits; q; q = q->next)
    if (q == p) {
      unlink_sync_locked(st, p);
      break;
    }
  pthread_mutex_unlock(&st->mu);
}

static void complete_sync(pending_sync_t *p, const meshd_error_t *e) {
  unlist_sync(p);
  /* Before the answer: a client that scrapes after its reply sees it. */
  if (p->sync_hist) metrics_series_observe(p->sync_hist, now_seconds() - p->t0);
  if (e) {
    if (p->stream) stream_answer(p->stream, p->call, p->seq, NULL, e);
    else send_error(p->call, p->submit, p->seq, e);
  } else {
    cmd_out_t out;
    cmd_out_init(&out, p->seq);
    take_failures(p->session, &out);
    if (p->stream) stream_answer(p->stream, p->call, p->seq, &out.res, NULL);
    else send_result(p->call, p->submit, &out.res);
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
    /* Room for an agent's whole message (meshd_error_t.msg) and the rank: a cut
     * here drops the end, where a load's HTTP status and the rank are. */
    char msg[sizeof ((meshd_error_t *)0)->msg + 32];
    if (strstr(text, "(rank ")) snprintf(msg, sizeof msg, "%s", text);
    else snprintf(msg, sizeof msg, "%.*s (rank %u)", (int)(sizeof msg - 24), text, rank);
    pthread_mutex_lock(&s->mu);
    objects_t *o = s->objects;
    if (o) {
      /* What this report fails says where it came from (a fetch planned before
       * the failing instruction ignores it: fetch_caught_up). */
      o->report_rank = rank;
      o->report_seq = err->seq;
      o->report_command = err->command_seq;
      /* One command failing on several ranks is one root failure: only the
       * report that fails the tensor is kept for Sync, under the client seq of
       * the failing command (Error.command_seq). */
      obj_t *t = err->ref ? objects_get(o, err->ref) : NULL;
      bool tensor = t && t->kind == OBJ_TENSOR;
      /* Dropped or released: its tombstone keeps where the failure came from,
       * for a fetch planned before the drop (fetch_caught_up). */
      if (!t && err->ref) {
        objects_dropped_failure_origin(o, err->ref, kind, rank, err->seq, err->command_seq, msg);
        /* Released while a view of its storage stays live: the view holds the
         * same bytes, and fails as it would have with the report before the
         * Release (objects_fail_tensor fails every alias). */
        obj_t *alias = objects_dropped_live_alias(o, err->ref);
        if (alias && alias->state == TENSOR_LIVE) {
          uint64_t aseq = kind != ERR_DEPENDENT_FAILURE && err->command_seq
                              ? err->command_seq
                              : alias->tensor.born_seq;
          objects_fail_tensor(o, alias, aseq, kind, aseq, msg);
        }
      }
      if (tensor && t->state == TENSOR_FAILED && t->tensor.fail)
        objects_failure_origin(t->tensor.fail, rank, err->seq, err->command_seq); /* failed already */
      if (kind == ERR_DEPENDENT_FAILURE) {
        /* Not a root: the tensor fails everywhere, Sync reports only its root.
         * An agent names the root tensor ("depends on tensor N, ...") but
         * knows only its own seqs: failed here, the root gives its command seq
         * and message, as for a dependent the server fails itself. */
        unsigned long long rr = 0;
        obj_t *root = sscanf(text, "depends on tensor %llu,", &rr) == 1 ? objects_get(o, rr) : NULL;
        if (tensor && t->state == TENSOR_LIVE) {
          if (root && root != t && root->kind == OBJ_TENSOR && root->state == TENSOR_FAILED)
            command_inherit_failure(o, t, root, t->tensor.born_seq);
          else
            objects_fail_tensor(o, t, t->tensor.born_seq, kind, t->tensor.born_seq, msg);
        }
      } else if (tensor && t->state == TENSOR_LIVE) {
        /* The failing command (an in-place one is not the tensor's maker);
         * an older agent does not say: the command that made the tensor. */
        uint64_t seq = err->command_seq ? err->command_seq : t->tensor.born_seq;
        objects_fail_tensor(o, t, seq, kind, seq, msg);
        objects_note_failure(o, kind, msg, seq);
      } else if (!tensor) {
        /* A dropped or released tensor's failure is still told, once. */
        bool gone = err->ref && objects_dropped(o, err->ref);
        if (!gone || objects_dropped_failure_first(o, err->ref))
          objects_note_failure(o, kind, msg, err->command_seq ? err->command_seq : err->seq);
      }
      o->report_seq = o->report_command = 0;
    }
    pthread_mutex_unlock(&s->mu);
    log_event(LOG_LEVEL_DEBUG, "command", &(log_fields_t){.session = s->id, LOG_RANK(rank)},
              "session %.8s: rank %u reports %s: %s", s->id, rank,
              error_kind_name(kind), msg);
    session_unfind(s);
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
    /* Not once it closed: its EndSession went, and nothing may follow it. */
    objects_t *o = atomic_load(&s->closed) ? NULL : s->objects;
    /* Work on the rank: an instruction it had not run, or a tensor with a
     * shard there. A session that only once used the rank is not told. */
    bool work = o && l->rank < o->ntouched && o->touched[l->rank] &&
                (!watermark_reached(agent_pool_watermark(cs->fe.pool), l->rank, s->id,
                                    objects_last_seq(o, l->rank)) ||
                 objects_holds_on(o, l->rank));
    if (work) {
      /* Reported by the next Sync (or the one waiting now); the survivors stop
       * waiting for the lost rank in this session's work. */
      char msg[400];
      /* Only a Sync's check may have been left there (its tensors dropped). */
      bool held = objects_holds_on(o, l->rank);
      snprintf(msg, sizeof msg,
               "the agent of rank %u %s%s, and meshes that include rank %u refuse new commands; "
               "create a new mesh to use its replacement",
               l->rank, reason,
               held ? ": this session's tensors on it are gone"
                    : " before it ran this session's last work there (the session held no "
                      "tensors on it)",
               l->rank);
      objects_note_failure(o, ERR_AGENT_LOST, msg, 0);
      /* Told: a Sync no longer waits for what was lost there (emit_status
       * waits for it only while the loss is not noted yet). */
      o->last_seq[l->rank] = 0;
      o->losses++; /* new ToMesh channels: none shared with work the lost agent may still run */
      emit_peer_lost(&cs->fe, s, o, l->rank, l->data_address, reason);
      told++;
    } else if (o && l->rank < o->ntouched) {
      /* All of it ran there: nothing to wait for. Left, a Sync would wait for
       * this seq, which the watermark counts lost while another session's
       * work held the agent back: AGENT_LOST on every Sync until a new agent
       * took the rank. */
      o->last_seq[l->rank] = 0;
    }
    pthread_mutex_unlock(&s->mu);
    session_unfind(s);
  }
  free(rows);
  log_event(LOG_LEVEL_WARN, "command", &(log_fields_t){LOG_RANK(l->rank)},
            "rank %u (agent %s) %s: %zu session(s) with work on it told", l->rank,
            l->agent_id, reason, told);
}

static void sync_fired(watermark_result_t result, uint32_t lost_rank, void *arg) {
  pending_sync_t *p = arg;
  meshd_error_t e;
  if (result == WATERMARK_REACHED && !atomic_load(&p->session->closed)) {
    complete_sync(p, NULL);
    return;
  }
  if (result == WATERMARK_REACHED) {
    /* Closed while it waited: EndSession ended what the agents still had of
     * the session, and they pass its seqs without running them. */
    error_set(&e, ERR_NO_SESSION,
              "Sync: session %.8s was closed while this Sync waited; the work before it may "
              "not have run", p->session->id);
    complete_sync(p, &e);
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
                                  submit_state_t *stream, double t0) {
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
    if (stream) stream_answer(stream, call, seq, NULL, &e);
    else send_error(call, submit, seq, &e);
    if (stream) submit_answered(stream, call);
    return NULL;
  }
  *p = (pending_sync_t){.call = call, .session = s, .submit = submit, .seq = seq, .stream = stream,
                        .t0 = t0, .sync_hist = cs->sync_hist};
  rpc_call_ref(call);
  session_ref(s);
  p->n = emit_status(&cs->fe, s, o, ranks, seqs, cap);
  for (size_t i = 0; i < p->n; i++) targets[i] = (watermark_target_t){ranks[i], seqs[i]};
  p->targets = targets;
  free(ranks);
  free(seqs);
  return p;
}

/* What a stream's Sync held, given back once its wait was withdrawn
 * (watermark_cancel) and it left the stream's list: it is never answered. */
static void sync_withdrawn(submit_state_t *st, pending_sync_t *p) {
  pthread_mutex_lock(&st->mu);
  st->pending--;
  pthread_mutex_unlock(&st->mu);
  submit_unref(st); /* the Sync's */
  rpc_call_unref(p->call);
  session_release(p->session);
  free(p);
}

static void wait_sync(command_service_t *cs, pending_sync_t *p) {
  watermark_target_t *targets = p->targets;
  p->targets = NULL;
  uint32_t lost = 0;
  /* Only this session's work counts: another's stalled instruction on the
   * same agents never holds this Sync. */
  rpc_call_t *call = p->call;
  bool submit = p->submit;
  uint64_t id = 0;
  if (p->stream) list_sync(p);
  watermark_result_t r = watermark_wait_session(agent_pool_watermark(cs->fe.pool), p->session->id,
                                                targets, p->n, sync_fired, p, &id, &lost);
  free(targets); /* copied by watermark_wait; p may be gone already */
  if (r != WATERMARK_PENDING) {
    sync_fired(r, lost, p);
    return;
  }
  /* Called from the call's handler, so its on_end has not run yet; the wait
   * may have fired already and p be gone (then it left the stream's list). */
  if (submit) {
    submit_state_t *st = rpc_call_data(call);
    if (!st) return;
    pthread_mutex_lock(&st->mu);
    bool listed = false;
    for (pending_sync_t *q = st->waits; q; q = q->next)
      if (q == p) {
        p->wait_id = id;
        listed = true;
      }
    /* A batch's rest runs on a job, not in a callback of the call: the
     * stream's on_end may have run meanwhile and passed over this wait, which
     * had no id yet. Withdrawn here then, as on_end would have (behind a hung
     * instruction it would hold the session for good). */
    bool withdraw = listed && rpc_call_ended(call) &&
                    watermark_cancel(agent_pool_watermark(cs->fe.pool), id);
    if (withdraw) unlink_sync_locked(st, p);
    pthread_mutex_unlock(&st->mu);
    if (withdraw) sync_withdrawn(st, p);
    return;
  }
  exec_state_t *x = rpc_call_data(call);
  if (x) {
    pthread_mutex_lock(&x->mu);
    x->sync = p; /* touched by on_end only if it withdraws the wait first */
    x->sync_wait = id;
    pthread_mutex_unlock(&x->mu);
  }
}

/* ------------------------------------------------------------------ flow control */

/* A checkpoint taken under s->mu (flow.h): the session's latest seq on every
 * rank it touched, waited for after the lock is released. */
typedef struct checkpoint {
  flow_checkpoint_t *cp;
  watermark_target_t *targets;
  size_t n;
} checkpoint_t;

static void take_checkpoint(objects_t *o, checkpoint_t *ck) {
  if (!o->flow) return; /* its window could not be opened: the session runs unbounded */
  ck->cp = flow_checkpoint(o->flow);
  if (!ck->cp) return;
  ck->targets = malloc(sizeof *ck->targets * (o->ntouched ? o->ntouched : 1));
  ck->n = 0;
  for (size_t r = 0; ck->targets && r < o->ntouched; r++)
    if (o->touched[r] && o->last_seq[r])
      ck->targets[ck->n++] = (watermark_target_t){(uint32_t)r, o->last_seq[r]};
}

static void checkpoint_fired(watermark_result_t result, uint32_t lost_rank, void *arg) {
  (void)result; /* reached, lost or cancelled: either way that work waits no more */
  (void)lost_rank;
  flow_checkpoint_done(arg);
}

/* Registers the wait (after s->mu: the watermark may answer at once). */
static void wait_checkpoint(command_service_t *cs, session_t *s, checkpoint_t *ck) {
  if (!ck->cp) return;
  watermark_result_t r = WATERMARK_REACHED;
  /* Out of memory for the targets: release now rather than wait for nothing. */
  while (ck->targets && ck->n) {
    uint32_t lost = 0;
    r = watermark_wait_session(agent_pool_watermark(cs->fe.pool), s->id, ck->targets, ck->n,
                               checkpoint_fired, ck->cp, NULL, &lost);
    if (r != WATERMARK_LOST) break;
    /* A rank lost with this session's work: that work never runs, the rest
     * still counts. Without it the session's later checkpoints would all be
     * LOST at once and bound nothing. */
    size_t k = 0;
    for (size_t i = 0; i < ck->n; i++)
      if (ck->targets[i].rank != lost) ck->targets[k++] = ck->targets[i];
    if (k == ck->n) break;
    ck->n = k;
    r = WATERMARK_REACHED;
  }
  free(ck->targets);
  if (r != WATERMARK_PENDING) flow_checkpoint_done(ck->cp);
}

/* What a flow wait holds: the call (its reads paused, or its answer held),
 * and a reference that keeps the caller's lease from running out meanwhile:
 * an Execute's session (its handler has returned), or a Submit stream's
 * state (whose stream holds the session). Freed by the wait's callback, or
 * by the call's on_end when it withdraws the wait first. */
typedef struct flow_hold {
  rpc_call_t *call;
  session_t *session;     /* an Execute's */
  submit_state_t *stream; /* a Submit stream's */
} flow_hold_t;

static void flow_hold_free(flow_hold_t *h) {
  rpc_call_unref(h->call);
  if (h->session) session_release(h->session);
  if (h->stream) submit_unref(h->stream);
  free(h);
}

static bool batch_rest_start(struct batch_rest *r);

static void flow_room(void *arg) {
  flow_hold_t *h = arg;
  if (h->stream) {
    pthread_mutex_lock(&h->stream->mu);
    h->stream->flow_wait = 0; /* the next command over the bound waits anew */
    h->stream->flow_hold = NULL;
    struct batch_rest *rest = h->stream->rest;
    h->stream->rest = NULL;
    pthread_mutex_unlock(&h->stream->mu);
    /* The rest of a batch first: its job resumes the reads once it ran. */
    if (!rest || !batch_rest_start(rest)) rpc_call_resume_reads(h->call);
  } else {
    rpc_call_release_sends(h->call);
  }
  flow_hold_free(h);
}

/* The session is over its bound (or the server over its own): a Submit stream
 * reads no more commands, an Execute's answer waits, until checkpoints make
 * room. Under s->mu (the window stays open while it is held). A stream
 * already waiting waits once: its reads stay paused until that wait fires,
 * however many commands of its batch went over. */
static void hold_call(session_t *s, objects_t *o, rpc_call_t *call, submit_state_t *stream) {
  exec_state_t *x = stream ? NULL : rpc_call_data(call);
  pthread_mutex_t *mu = stream ? &stream->mu : x ? &x->mu : NULL;
  flow_hold_t *h = malloc(sizeof *h);
  if (!h) return; /* out of memory: not held (the bound is a bound on memory) */
  if (mu) pthread_mutex_lock(mu);
  if (stream && stream->flow_wait) {
    pthread_mutex_unlock(mu);
    free(h);
    return;
  }
  *h = (flow_hold_t){.call = call, .session = stream ? NULL : s, .stream = stream};
  rpc_call_ref(call);
  if (stream) {
    rpc_call_pause_reads(call);
    stream->refs++;
  } else {
    rpc_call_hold_sends(call);
    session_ref(s);
  }
  /* Registered under mu, so that the callback, which takes it, finds the id. */
  uint64_t id = flow_wait(o->flow, flow_room, h);
  if (id && stream) {
    stream->flow_wait = id;
    stream->flow_hold = h;
  } else if (id && x) {
    x->flow_wait = id;
    x->flow_hold = h;
  }
  if (mu) pthread_mutex_unlock(mu);
  if (!id) flow_room(h); /* room already */
}

/* ------------------------------------------------------------------ one command */

/* meshd_commands_total and meshd_command_duration_seconds for one command,
 * run or refused (those refused before run_one too: a seq not above the
 * last, a nested batch, a batch's rest that found no thread). */
static void count_command(command_service_t *cs, const Meshd__V1__Command *cmd, int rc,
                          const meshd_error_t *e, double t0) {
  if (!cs->metrics) return;
  const char *kind = command_name(cmd);
  unsigned k = (unsigned)cmd->kind_case; /* (a kind past the table: looked up each time) */
  metrics_series_t *total = rc || k >= CMD_KINDS ? NULL : atomic_load(&cs->ok_total[k]);
  if (!rc && k < CMD_KINDS && !total) {
    total = metrics_series(cs->metrics, "meshd_commands_total",
                           (const char *[]){"kind", kind, "status", "ok", NULL});
    atomic_store(&cs->ok_total[k], total);
  }
  if (total) metrics_series_inc(total, 1);
  else
    metrics_inc(cs->metrics, "meshd_commands_total",
                (const char *[]){"kind", kind, "status", rc ? error_kind_name(e->kind) : "ok", NULL}, 1);
  metrics_series_t *dur = k < CMD_KINDS ? atomic_load(&cs->duration[k]) : NULL;
  if (!dur && k < CMD_KINDS) {
    dur = metrics_series(cs->metrics, "meshd_command_duration_seconds",
                         (const char *[]){"kind", kind, NULL});
    atomic_store(&cs->duration[k], dur);
  }
  if (dur) metrics_series_observe(dur, now_seconds() - t0);
  else
    metrics_observe(cs->metrics, "meshd_command_duration_seconds",
                    (const char *[]){"kind", kind, NULL}, now_seconds() - t0);
  /* A refused Sync is answered now; an accepted one when its wait fires. */
  if (rc && cmd->kind_case == MESHD__V1__COMMAND__KIND_SYNC)
    metrics_series_observe(cs->sync_hist, now_seconds() - t0);
}

static void run_one(command_service_t *cs, session_t *s, rpc_call_t *call, bool submit,
                    const Meshd__V1__Command *cmd, submit_state_t *stream, reply_batch_t *batch) {
  cmd_out_t out;
  meshd_error_t e;
  checkpoint_t ck = {0};
  double t0 = cs->metrics ? now_seconds() : 0;
  cmd_out_init(&out, cmd->seq);
  pthread_mutex_lock(&s->mu);
  objects_t *o = NULL;
  int rc;
  if (atomic_load(&s->closed))
    /* A Submit stream outlives CloseSession: what it sends later is refused. */
    rc = error_set(&e, ERR_NO_SESSION, "%s: session %.8s was closed; it runs no more commands",
                   command_name(cmd), s->id);
  else if (!(o = session_objects(cs, s)))
    rc = error_set(&e, ERR_QUOTA, "%s: out of memory on the server", command_name(cmd));
  else {
    uint64_t sent0 = o->sent_bytes;
    rc = command_run(&cs->fe, s, o, cmd, &out, &e);
    if (rc == 0) atomic_fetch_add(&s->commands, 1);
    /* Queued work is what went to the agents (a Sync's StatusRequests go below):
     * a command that sent them nothing (Describe, CreateMesh, SliceMesh) has
     * nothing for them to run, and must not wait for the session's slow work. */
    bool queues = o->sent_bytes != sent0 || cmd->kind_case == MESHD__V1__COMMAND__KIND_SYNC;
    unsigned fl = rc == 0 && o->flow && queues ? flow_accept(o->flow, o->sent_bytes - sent0) : 0;
    if (stream) stream->msg_bytes += o->sent_bytes - sent0; /* (its reads are one at a time) */
    /* A Sync checkpoints too: after it nothing of the session counts as queued. */
    if ((fl & FLOW_CHECKPOINT) || (rc == 0 && cmd->kind_case == MESHD__V1__COMMAND__KIND_SYNC))
      take_checkpoint(o, &ck);
    /* An Execute's Sync is not held: its answer waits for the session's own
     * work anyway, and held it would wait for other sessions' (the server's
     * bound); the client's next command waits for room instead. */
    if ((fl & FLOW_OVER) && (stream || cmd->kind_case != MESHD__V1__COMMAND__KIND_SYNC))
      hold_call(s, o, call, stream);
  }
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
      stream->refs++; /* the Sync's, dropped by submit_answered */
      pthread_mutex_unlock(&stream->mu);
    }
    pending = start_sync(cs, s, o, call, submit, cmd->seq, stream, t0);
  }
  pthread_mutex_unlock(&s->mu);
  wait_checkpoint(cs, s, &ck);
  /* Counted before the answer: a client that scrapes after its reply sees it
   * (a Sync's too: wait_sync, below, may answer it at once). */
  count_command(cs, cmd, rc, &e, t0);
  if (pending) wait_sync(cs, pending);
  if (rc) {
    log_event(LOG_LEVEL_DEBUG, "command", &(log_fields_t){.session = s->id, .seq = cmd->seq},
              "session %.8s: %s seq %llu rejected: %s: %s", s->id, command_name(cmd),
              (unsigned long long)cmd->seq, error_kind_name(e.kind), e.msg);
    answer_error(call, submit, batch, cmd->seq, &e);
  } else if (!sync) {
    answer(call, submit, batch, &out.res);
  }
  cmd_out_free(&out);
}

static void on_execute(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  command_service_t *cs = arg;
  session_t *s = session_from_call(cs->sessions, call);
  if (!s) return;
  exec_state_t *x = calloc(1, sizeof *x); /* NULL: nothing is withdrawn early */
  if (x) {
    pthread_mutex_init(&x->mu, NULL);
    rpc_call_set_data(call, x);
  }
  const Meshd__V1__Command *cmd = (const Meshd__V1__Command *)req;
  if (cmd->n_batch) {
    meshd_error_t e;
    error_set(&e, ERR_BAD_ARGUMENT, "Execute: a batch of %zu commands goes on the Submit "
              "stream; Execute runs one command", cmd->n_batch);
    send_error(call, false, cmd->seq, &e);
  } else {
    /* Nobody waits for its instructions yet: they may wait in the links for
     * the caller's next ones (a Sync or Fetch sends them at once). */
    agent_link_defer_begin();
    run_one(cs, s, call, false, cmd, NULL, NULL);
    agent_link_defer_end();
  }
  session_release(s);
}

static void on_execute_end(rpc_call_t *call, bool cancelled, void *arg) {
  command_service_t *cs = arg;
  exec_state_t *x = rpc_call_data(call);
  if (!x) return;
  pthread_mutex_lock(&x->mu);
  uint64_t sync_wait = x->sync_wait, flow_wait = x->flow_wait;
  flow_hold_t *hold = x->flow_hold;
  pending_sync_t *p = x->sync;
  pthread_mutex_unlock(&x->mu);
  /* A Sync still waiting for a client that gave up: withdrawn, so it holds
   * neither the call nor the session (whose lease then runs again). */
  if (sync_wait && watermark_cancel(agent_pool_watermark(cs->fe.pool), sync_wait)) {
    rpc_call_unref(p->call);
    session_release(p->session);
    free(p);
  }
  if (flow_wait && flow_cancel(cs->flow, flow_wait)) flow_hold_free(hold);
  pthread_mutex_destroy(&x->mu);
  free(x);
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
  pthread_mutex_init(&st->held_mu, NULL);
  /* NULL (out of memory): every answer goes at once */
  if ((st->held = calloc(1, sizeof *st->held)))
    *st->held = (reply_batch_t){.call = call, .lone_as_result = true, .mu = &st->held_mu};
  st->refs = 1; /* the stream's, dropped in on_submit_end */
  rpc_call_set_data(call, st);
}

#define SUBMIT_BATCH_MAX 4096

/* The instruction bytes one Submit message's commands may queue: 4x the
 * session's flow bound on bytes (or the server's, without one); 0: none. */
static uint64_t batch_bytes_cap(command_service_t *cs) {
  flow_limits_t l = flow_limits(cs->flow);
  uint64_t bound = l.session_bytes ? l.session_bytes : l.total_bytes;
  return bound > UINT64_MAX / 4 ? 0 : 4 * bound;
}

static void submit_command(submit_state_t *st, rpc_call_t *call, const Meshd__V1__Command *cmd,
                           reply_batch_t *batch);
static void submit_batch(submit_state_t *st, rpc_call_t *call, const Meshd__V1__Command *cmd);

static void on_submit_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  submit_state_t *st = rpc_call_data(call);
  if (!st) return;
  if (!msg) { /* half-close: end once every Sync is answered */
    pthread_mutex_lock(&st->mu);
    st->half_closed = true;
    bool finish = st->pending == 0;
    pthread_mutex_unlock(&st->mu);
    held_flush(st);
    if (finish) rpc_call_finish(call, GRPC_STATUS_OK, NULL, "end of stream");
    return;
  }
  session_touch(st->session);
  const Meshd__V1__Command *cmd = (const Meshd__V1__Command *)msg;
  if (cmd->n_batch) {
    held_flush(st);
    submit_batch(st, call, cmd);
    return;
  }
  /* Commands one per message: what arrives back to back goes to the agents
   * as one batch, and its answers to the client as one SubmitReply, once this
   * thread has nothing more to read. */
  agent_link_cork_until_idle();
  command_batch_begin(); /* a message of one command: its own budget */
  submit_command(st, call, cmd, hold_answers(st, call));
  command_batch_end();
}

/* One command of the stream, alone or in a batch. */
static void submit_command(submit_state_t *st, rpc_call_t *call, const Meshd__V1__Command *cmd,
                           reply_batch_t *batch) {
  if (cmd->seq != 0 && cmd->seq <= st->last_seq) {
    /* Answers are matched by seq: one that goes down or repeats is a client
     * bug that would hand it the wrong answer. Refused, nothing run. */
    meshd_error_t e;
    error_set(&e, ERR_BAD_ARGUMENT,
              "%s: Command.seq %llu is not above seq %llu, sent before it on this Submit "
              "stream: answers are matched by seq, so a stream's seqs must strictly increase "
              "(0 means unmatched)",
              command_name(cmd), (unsigned long long)cmd->seq, (unsigned long long)st->last_seq);
    count_command(st->cs, cmd, -1, &e, now_seconds());
    answer_error(call, true, batch, cmd->seq, &e);
    return;
  }
  if (cmd->seq) st->last_seq = cmd->seq;
  /* A Sync is answered on its own (stream_answer), at once or from another
   * thread: the answers of a Command.batch's earlier commands go first. (The
   * stream's held answers are flushed by stream_answer.) */
  if (cmd->kind_case == MESHD__V1__COMMAND__KIND_SYNC && batch && !batch->mu) batch_flush(batch);
  run_one(st->cs, st->session, call, true, cmd, st, batch);
}

/* The rest of a Command.batch that made its stream wait for room: run by a
 * job once the wait fires, as the next message would have been read. */
typedef struct batch_rest {
  submit_state_t *st; /* referenced */
  rpc_call_t *call;   /* referenced */
  session_t *session; /* referenced (the stream's goes at its call's end) */
  rpc_kept_t *kept;   /* the message its commands live in */
  const Meshd__V1__Command *cmd;
  size_t next; /* the first command not run */
} batch_rest_t;

static void batch_rest_free(batch_rest_t *r) {
  rpc_kept_free(r->kept);
  rpc_call_unref(r->call);
  session_release(r->session);
  submit_unref(r->st);
  free(r);
}

/* Makes the stream wait for room if its session (or the server) is over its
 * flow bound: as run_one does for a command that filled the window. */
static void stream_wait_room(submit_state_t *st, rpc_call_t *call) {
  session_t *s = st->session;
  pthread_mutex_lock(&s->mu);
  objects_t *o = s->objects;
  if (o && o->flow && !atomic_load(&s->closed)) hold_call(s, o, call, st);
  pthread_mutex_unlock(&s->mu);
}

/* Runs the batch's commands from i on, each as if it came alone. Flow control
 * holds a stream between its messages, and a batch is read whole (a session
 * may run over its bounds by one batch) up to 4x the session's byte bound of
 * instructions (a Reduce's grow with its group's ranks squared). Past that
 * the part run so far goes to the agents and its answers to the client, and
 * the rest waits for room as a next message would: in st->rest, until
 * flow_room hands it to a job (batch_rest_start), which takes it the same
 * way. Returns true when the rest waits: it then owns *kept, the message
 * (kept from on_message if *kept was NULL). */
static bool batch_run(submit_state_t *st, rpc_call_t *call, const Meshd__V1__Command *cmd,
                      size_t i, rpc_kept_t **kept) {
  uint64_t cap = batch_bytes_cap(st->cs);
  for (;;) {
    meshd_error_t e = {0};
    reply_batch_t b = {.call = call};
    st->msg_bytes = 0;
    agent_link_cork(); /* the part's instructions go to each agent as one batch */
    command_batch_begin();
    for (; i < cmd->n_batch && !(cap && st->msg_bytes >= cap); i++) {
      const Meshd__V1__Command *c = cmd->batch[i];
      if (c->n_batch) {
        error_set(&e, ERR_BAD_ARGUMENT, "Submit: command seq %llu of a batch is a batch itself; "
                  "batches do not nest", (unsigned long long)c->seq);
        count_command(st->cs, c, -1, &e, now_seconds());
        answer_error(call, true, &b, c->seq, &e);
        continue;
      }
      submit_command(st, call, c, &b);
    }
    command_batch_end();
    agent_link_uncork(); /* before the rest can run on another thread */
    batch_flush(&b);
    free(b.buf);
    if (i == cmd->n_batch) return false;
    stream_wait_room(st, call);
    batch_rest_t *r = malloc(sizeof *r);
    if (r && !*kept && !(*kept = rpc_call_keep_message(call))) {
      free(r);
      r = NULL;
    }
    if (!r) continue; /* out of memory, or no message to keep: the rest runs now */
    *r = (batch_rest_t){.st = st, .call = call, .session = st->session, .kept = *kept,
                        .cmd = cmd, .next = i};
    rpc_call_ref(call);
    session_ref(st->session);
    pthread_mutex_lock(&st->mu);
    bool waits = st->flow_wait != 0; /* 0: room already (or no window) */
    if (waits) {
      st->rest = r;
      st->refs++;
    }
    pthread_mutex_unlock(&st->mu);
    if (waits) return true;
    rpc_call_unref(call);
    session_release(st->session);
    free(r);
  }
}

static void batch_resume(void *arg) {
  batch_rest_t *r = arg;
  /* A client gone meanwhile: nothing to run for it. */
  if (!rpc_call_ended(r->call) && batch_run(r->st, r->call, r->cmd, r->next, &r->kept))
    r->kept = NULL; /* the rest of the rest waits again */
  rpc_call_resume_reads(r->call); /* the pause of the wait that ran it */
  batch_rest_free(r);
}

/* From flow_room, on whichever thread made room (maybe under the session's
 * lock): the rest runs on a job. false: it could not (its commands are
 * refused), the caller resumes the reads. */
static bool batch_rest_start(batch_rest_t *r) {
  if (workpool_run(r->st->cs->jobs, batch_resume, r) == 0) return true;
  meshd_error_t e;
  reply_batch_t b = {.call = r->call};
  for (size_t i = r->next; i < r->cmd->n_batch; i++) {
    const Meshd__V1__Command *c = r->cmd->batch[i];
    error_set(&e, ERR_QUOTA, "%s: the server could not start a thread to run the rest of its "
              "Submit message; send it again", command_name(c));
    count_command(r->st->cs, c, -1, &e, now_seconds());
    answer_error(r->call, true, &b, c->seq, &e);
    if (c->seq) r->st->last_seq = c->seq > r->st->last_seq ? c->seq : r->st->last_seq;
  }
  batch_flush(&b);
  free(b.buf);
  batch_rest_free(r);
  return false;
}

/* Command.batch: each command as if it came alone, the answers in one reply. */
static void submit_batch(submit_state_t *st, rpc_call_t *call, const Meshd__V1__Command *cmd) {
  meshd_error_t e = {0};
  if (cmd->kind_case != MESHD__V1__COMMAND__KIND__NOT_SET || cmd->seq)
    error_set(&e, ERR_BAD_ARGUMENT, "Submit: a batch Command carries only `batch` (its "
              "commands have the seqs and kinds), not seq %llu or a %s",
              (unsigned long long)cmd->seq, command_name(cmd));
  else if (cmd->n_batch > SUBMIT_BATCH_MAX)
    error_set(&e, ERR_BAD_ARGUMENT, "Submit: a batch of %zu commands; at most %d go in one",
              cmd->n_batch, SUBMIT_BATCH_MAX);
  if (e.kind != ERR_NONE) {
    send_error(call, true, cmd->seq, &e);
    return;
  }
  rpc_kept_t *kept = NULL;
  if (!batch_run(st, call, cmd, 0, &kept) && kept) rpc_kept_free(kept);
}

static void on_submit_end(rpc_call_t *call, bool cancelled, void *arg) {
  submit_state_t *st = rpc_call_data(call);
  if (!st) return;
  /* Paused when it ended: the wait goes, and with it what it held. */
  pthread_mutex_lock(&st->mu);
  uint64_t flow_id = st->flow_wait;
  struct flow_hold *hold = st->flow_hold;
  batch_rest_t *rest = st->rest; /* the rest of a batch: nobody to run it for */
  st->rest = NULL;
  pthread_mutex_unlock(&st->mu);
  if (flow_id && flow_cancel(st->cs->flow, flow_id)) flow_hold_free(hold);
  if (rest) batch_rest_free(rest);
  /* Syncs still waiting for a client that is gone: withdrawn (a firing one
   * finishes on its own), so they hold neither the call nor the session. */
  watermark_t *w = agent_pool_watermark(st->cs->fe.pool);
  pending_sync_t *gone = NULL;
  pthread_mutex_lock(&st->mu);
  for (pending_sync_t *p = st->waits, *next; p; p = next) {
    next = p->next;
    if (!p->wait_id || !watermark_cancel(w, p->wait_id)) continue;
    unlink_sync_locked(st, p);
    p->next = gone;
    gone = p;
  }
  pthread_mutex_unlock(&st->mu);
  while (gone) {
    pending_sync_t *p = gone;
    gone = p->next;
    sync_withdrawn(st, p);
  }
  session_release(st->session);
  submit_unref(st); /* pending Syncs keep it until they are answered */
}

/* ------------------------------------------------------------------ lifecycle */

void command_service_session_closed(command_service_t *cs, session_t *s) {
  pthread_mutex_lock(&s->mu);
  objects_t *o = s->objects;
  if (o) {
    /* Its queue empties and its paused calls go on (to be refused NO_SESSION). */
    flow_window_close(o->flow);
    o->flow = NULL;
    emit_end_session(&cs->fe, s, o);
  }
  pthread_mutex_unlock(&s->mu);
}

command_service_t *command_service_create(agent_pool_t *pool, session_table_t *sessions,
                                          const flow_limits_t *limits) {
  command_service_t *cs = calloc(1, sizeof *cs);
  if (!cs) return NULL;
  cs->fe.pool = pool;
  cs->sessions = sessions;
  cs->flow = flow_create(limits ? limits : &(flow_limits_t){0});
  cs->jobs = workpool_create("submit-rest", 2, 10000);
  if (!cs->flow || !cs->jobs) {
    flow_destroy(cs->flow);
    workpool_destroy(cs->jobs);
    free(cs);
    return NULL;
  }
  cs->fe.max_command_bytes = batch_bytes_cap(cs);
  return cs;
}

void command_service_set_urls(command_service_t *cs, const url_policy_t *urls) { cs->fe.urls = urls; }

flow_t *command_service_flow(command_service_t *cs) { return cs->flow; }

/* A message that is no Command ends the stream (the rpc layer's
 * INVALID_ARGUMENT): the answers to the commands before it go first. */
static void on_submit_refused(rpc_call_t *call, void *arg) {
  (void)arg;
  submit_state_t *st = rpc_call_data(call);
  if (st) held_flush(st);
}

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.v1.TensorService/Execute",
        .kind = RPC_UNARY,
        .request = &meshd__v1__command__descriptor,
        .on_start = on_execute,
        .on_end = on_execute_end,
    },
    {
        .path = "/meshd.v1.TensorService/Submit",
        .kind = RPC_BIDI,
        .request = &meshd__v1__command__descriptor,
        .on_start = on_submit_start,
        .on_message = on_submit_message,
        .on_end = on_submit_end,
        .on_refused = on_submit_refused,
    },
};

const rpc_method_t *command_service_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
}

void command_service_destroy(command_service_t *cs) {
  if (!cs) return;
  workpool_destroy(cs->jobs); /* a batch's rest still running ends first */
  flow_destroy(cs->flow);
  free(cs);
}
