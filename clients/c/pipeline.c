/* A session's pipeline on one Submit stream (pipeline.h). */
#include "pipeline.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "meshd/v1/tensor_service.pb-c.h"

#define SUBMIT "/meshd.v1.TensorService/Submit"
#define KEEP_REJECTIONS 64 /* kept in full; later ones are only counted */
#define KEEP_UNSENT 8      /* seq ranges of commands taken out unsent, named */

typedef struct rejection {
  uint64_t seq;
  int kind, code;
  char msg[384];
} rejection_t;

/* A command in the queued batch: where its bytes end in buf (they start where
 * the one before it ends) and when it must be out of the client's queue. */
typedef struct queued {
  uint64_t seq, sent; /* sent: what it, a Literal, sends the agents */
  int64_t deadline_ns;
  size_t end;
  int timeout_ms; /* its call's, for the message */
} queued_t;

/* Commands taken out of the queue unsent, seqs first..last, at a deadline of
 * ms milliseconds (their own, or a flush's). */
typedef struct unsent {
  uint64_t first, last;
  int ms;
} unsent_t;

struct pipeline {
  rpc_stream_t *st;
  pthread_t reader, flusher;
  bool reader_started, flusher_started;

  pthread_mutex_t mu;
  pthread_cond_t fl_cv;  /* flusher: something queued, new limits, stop */
  pthread_cond_t ans_cv; /* waiters: answers came, or the stream ended */
  pthread_cond_t wr_cv;  /* writers: the write side is free */
  /* under mu */
  /* The stream's write side is one thread's at a time (writer_take). A batch
   * whose writer's time passed while the server was not reading stays in
   * flight, and the next writer waits for it before anything else goes out:
   * no caller waits past its own deadline for another's write. */
  bool writing, in_flight;
  uint64_t sent_through; /* the last seq handed to gRPC (in flight included) */
  size_t max_batch;
  int64_t max_delay_ns;
  uint8_t *buf; /* the queued commands, packed as Command.batch's body */
  size_t len, cap, nq;
  uint64_t sent;           /* what the batch's Literals send the agents */
  int64_t first_at_ns;     /* when the batch's first command was queued */
  uint64_t queued_through; /* the last queued seq */
  uint64_t answered_through;
  queued_t *marks; /* the queued batch's commands (nq of them), in seq order */
  size_t marks_cap;
  int64_t earliest_ns; /* the earliest of their deadlines (while nq) */
  bool waiting, stop, ended, write_failed;
  rpc_status_t status; /* how the stream ended, once ended */
  rejection_t *rej;
  size_t nrej, rej_cap, rej_dropped;
  unsent_t unsent[KEEP_UNSENT]; /* taken out unsent, not yet handed over */
  size_t nunsent, unsent_count;
  meshd_pipeline_stats_t stats;
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static struct timespec at_ns(int64_t ns) {
  return (struct timespec){.tv_sec = ns / 1000000000LL, .tv_nsec = ns % 1000000000LL};
}

/* "ERROR_KIND_WRONG_MESH" -> "WRONG_MESH"; "" for none. */
static const char *kind_name(int kind) {
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&meshd__v1__error_kind__descriptor, kind);
  if (!v || kind == 0) return "";
  return strncmp(v->name, "ERROR_KIND_", 11) == 0 ? v->name + 11 : v->name;
}

static size_t varint_put(uint8_t *p, uint64_t v) {
  size_t n = 0;
  for (; v > 0x7f; v >>= 7) p[n++] = (uint8_t)(v | 0x80);
  p[n++] = (uint8_t)v;
  return n;
}

/* 0 when the bytes run out or the varint is too long. */
static size_t varint_get(const uint8_t *p, size_t len, uint64_t *v) {
  *v = 0;
  for (size_t i = 0; i < len && i < 10; i++) {
    *v |= (uint64_t)(p[i] & 0x7f) << (7 * i);
    if (!(p[i] & 0x80)) return i + 1;
  }
  return 0;
}

/* ------------------------------------------------------------------ sending */

/* Milliseconds left until deadline_ns (0: no bound, -1), rounded up: a wait
 * of them ends at the deadline, not just before it. */
static int ms_left(int64_t deadline_ns) {
  if (!deadline_ns) return -1;
  int64_t left = (deadline_ns - now_ns() + 999999) / 1000000;
  return left < 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

/* ------------------------------------------------------------ taking out */

/* Notes seq as taken out unsent at a deadline of ms: it joins the last range
 * when it follows it; past KEEP_UNSENT ranges the last one grows. Under mu. */
static void unsent_note(pipeline_t *p, uint64_t seq, int ms) {
  unsent_t *last = p->nunsent ? &p->unsent[p->nunsent - 1] : NULL;
  if (last && ((last->last + 1 == seq && last->ms == ms) || p->nunsent == KEEP_UNSENT))
    last->last = seq;
  else
    p->unsent[p->nunsent++] = (unsent_t){seq, seq, ms};
  p->unsent_count++;
}

/* Takes the queued commands whose deadline is by_ns or earlier out of the
 * batch, never sent (they did not run: their caller is told at the next
 * flush); flush_ms > 0: at that flush's deadline, else each at its own.
 * Returns how many. Under mu: the batch is cut under it too, so a command is
 * either here or handed to the stream. */
static size_t take_out(pipeline_t *p, int64_t by_ns, int flush_ms) {
  size_t kept = 0, len = 0, start = 0;
  uint64_t sent = 0;
  int64_t earliest = INT64_MAX;
  for (size_t i = 0; i < p->nq; i++) {
    queued_t m = p->marks[i];
    size_t n = m.end - start;
    start = m.end;
    if (m.deadline_ns <= by_ns) {
      unsent_note(p, m.seq, flush_ms > 0 ? flush_ms : m.timeout_ms);
      continue;
    }
    if (len != m.end - n) memmove(p->buf + len, p->buf + m.end - n, n);
    len += n;
    m.end = len;
    sent += m.sent;
    if (m.deadline_ns < earliest) earliest = m.deadline_ns;
    p->marks[kept++] = m;
  }
  size_t gone = p->nq - kept;
  if (!gone) return 0;
  p->nq = kept;
  p->earliest_ns = earliest;
  p->len = len;
  p->sent = sent;
  p->stats.commands_queued -= gone; /* they were not queued after all */
  p->queued_through = kept ? p->marks[kept - 1].seq : p->sent_through; /* left to answer */
  pthread_cond_broadcast(&p->ans_cv); /* a flush may have nothing left to wait for */
  return gone;
}

/* The earliest deadline of a queued command (INT64_MAX: none); kept as
 * commands join, so that a queue's every command does not scan the batch.
 * Under mu. */
static int64_t next_deadline(const pipeline_t *p) { return p->nq ? p->earliest_ns : INT64_MAX; }

/* Takes the write side by deadline_ns (0: no bound). Under mu; false when the
 * time passed first. */
static bool writer_take(pipeline_t *p, int64_t deadline_ns) {
  while (p->writing) {
    if (!deadline_ns) {
      pthread_cond_wait(&p->wr_cv, &p->mu);
      continue;
    }
    struct timespec at = at_ns(deadline_ns);
    if (pthread_cond_timedwait(&p->wr_cv, &p->mu, &at) == ETIMEDOUT && p->writing) return false;
  }
  p->writing = true;
  return true;
}

static void writer_give(pipeline_t *p) {
  p->writing = false;
  pthread_cond_broadcast(&p->wr_cv);
}

/* A write failed: the call is over (the reader gets its status) or we ran out
 * of memory. Nothing more goes out, and waiters give up. Under mu. */
static void write_failed(pipeline_t *p) {
  p->write_failed = true;
  pthread_cond_broadcast(&p->ans_cv);
}

/* Waits by deadline_ns for a batch left in flight. Under mu, writing. */
static int collect_in_flight(pipeline_t *p, int64_t deadline_ns) {
  if (!p->in_flight) return 0;
  pthread_mutex_unlock(&p->mu);
  int rc = rpc_stream_write_wait(p->st, ms_left(deadline_ns));
  pthread_mutex_lock(&p->mu);
  if (rc != -2) p->in_flight = false;
  if (rc == -1) write_failed(p);
  return rc;
}

/* Sends the queued batch, if any, by deadline_ns (0: no bound); only_due:
 * only if its delay has passed (the flusher, which may have waited for the
 * write side while the batch was cut). 0: sent, or nothing to send; -2: the
 * time passed first (the batch is in flight, or still queued when an earlier
 * one was); -1: the stream refused it. */
static int send_queued(pipeline_t *p, bool only_due, int64_t deadline_ns) {
  pthread_mutex_lock(&p->mu);
  if (!writer_take(p, deadline_ns)) {
    pthread_mutex_unlock(&p->mu);
    return -2;
  }
  int rc = collect_in_flight(p, deadline_ns);
  if (rc != 0 || !p->nq || p->ended || p->write_failed ||
      (only_due && now_ns() < p->first_at_ns + p->max_delay_ns)) {
    writer_give(p);
    pthread_mutex_unlock(&p->mu);
    return rc;
  }
  rpc_bytes_t *m = rpc_bytes_copy(p->buf, p->len);
  size_t n = p->nq;
  p->len = p->nq = 0;
  p->sent = 0;
  p->sent_through = p->queued_through;
  /* Counted before the write: the server may answer before it returns, and
   * a caller that saw the answer must see the message counted. */
  p->stats.commands_sent += n;
  p->stats.messages_sent++;
  p->stats.delay_flushes += only_due;
  pthread_mutex_unlock(&p->mu);
  rc = m ? rpc_stream_write_raw_within(p->st, m, ms_left(deadline_ns)) : -1;
  rpc_bytes_free(m); /* gRPC holds its own reference while in flight */
  pthread_mutex_lock(&p->mu);
  if (rc == -2) p->in_flight = true;
  if (rc == -1) {
    p->stats.commands_sent -= n;
    p->stats.messages_sent--;
    p->stats.delay_flushes -= only_due;
    if (!m) rpc_stream_cancel(p->st);
    write_failed(p);
  }
  writer_give(p);
  pthread_mutex_unlock(&p->mu);
  return rc;
}

/* The pipeline's timer too: a command still queued at its deadline (the
 * server is not reading: flow control) is taken out there, whether a call
 * waits for the answers or none does; its every wait ends by the earliest
 * deadline queued, so it is never stuck in a write past one. */
static void *flusher_main(void *arg) {
  pipeline_t *p = arg;
  prctl(PR_SET_NAME, "meshd-pipe-fl");
  pthread_mutex_lock(&p->mu);
  while (!p->stop) {
    if (!p->ended && !p->write_failed) take_out(p, now_ns(), 0);
    if (!p->nq || p->ended || p->write_failed) {
      pthread_cond_wait(&p->fl_cv, &p->mu);
      continue;
    }
    int64_t due = p->first_at_ns + p->max_delay_ns, next = next_deadline(p);
    if (now_ns() < due) {
      struct timespec at = at_ns(due < next ? due : next);
      pthread_cond_timedwait(&p->fl_cv, &p->mu, &at);
      continue;
    }
    pthread_mutex_unlock(&p->mu);
    send_queued(p, true, next); /* a close cancels the stream before joining */
    pthread_mutex_lock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* ------------------------------------------------------------------ reading */

/* A rejected command's answer (its bytes), unpacked: the rare path. */
static void note_rejection(pipeline_t *p, const uint8_t *b, size_t n) {
  Meshd__V1__CommandResult *r =
      (Meshd__V1__CommandResult *)protobuf_c_message_unpack(&meshd__v1__command_result__descriptor,
                                                             NULL, n, b);
  rejection_t x = {0};
  if (r) {
    if (!r->error || r->error->kind == 0) { /* an empty Error is no rejection */
      protobuf_c_message_free_unpacked(&r->base, NULL);
      return;
    }
    x.seq = r->seq;
    x.kind = r->error->kind;
    x.code = r->error->code ? r->error->code : GRPC_STATUS_UNKNOWN;
    snprintf(x.msg, sizeof x.msg, "%s", r->error->message ? r->error->message : "");
    protobuf_c_message_free_unpacked(&r->base, NULL);
  } else {
    x.code = GRPC_STATUS_INTERNAL;
    snprintf(x.msg, sizeof x.msg, "the server sent an answer that is not a CommandResult");
  }
  pthread_mutex_lock(&p->mu);
  p->stats.rejected++;
  if (p->nrej == p->rej_cap && p->rej_cap < KEEP_REJECTIONS) {
    size_t cap = p->rej_cap ? p->rej_cap * 2 : 4;
    rejection_t *q = realloc(p->rej, cap * sizeof *q);
    if (q) {
      p->rej = q;
      p->rej_cap = cap;
    }
  }
  if (p->nrej < p->rej_cap)
    p->rej[p->nrej++] = x;
  else
    p->rej_dropped++;
  pthread_mutex_unlock(&p->mu);
}

/* One CommandResult's bytes: its seq, and whether it carries an error. */
static int scan_result(const uint8_t *b, size_t n, uint64_t *seq, bool *error) {
  *seq = 0;
  *error = false;
  for (size_t i = 0; i < n;) {
    uint64_t tag, v;
    size_t k = varint_get(b + i, n - i, &tag);
    if (!k) return -1;
    i += k;
    switch (tag & 7) {
    case 0:
      if (!(k = varint_get(b + i, n - i, &v))) return -1;
      if (tag >> 3 == 1) *seq = v;
      i += k;
      break;
    case 1:
      i += 8;
      break;
    case 5:
      i += 4;
      break;
    case 2:
      if (!(k = varint_get(b + i, n - i, &v)) || v > n - i - k) return -1;
      if (tag >> 3 == 2) *error = true;
      i += k + v;
      break;
    default:
      return -1;
    }
    if (i > n) return -1;
  }
  return 0;
}

/* A SubmitReply's bytes: result (1) or results (2), each a CommandResult. */
static int scan_reply(pipeline_t *p, const uint8_t *b, size_t n) {
  uint64_t through = 0, count = 0;
  for (size_t i = 0; i < n;) {
    uint64_t tag, len;
    size_t k = varint_get(b + i, n - i, &tag);
    if (!k || (tag & 7) != 2) return -1;
    i += k;
    if (!(k = varint_get(b + i, n - i, &len)) || len > n - i - k) return -1;
    i += k;
    if (tag >> 3 == 1 || tag >> 3 == 2) {
      uint64_t seq;
      bool error;
      if (scan_result(b + i, len, &seq, &error) != 0) return -1;
      if (error) note_rejection(p, b + i, len);
      if (seq) {
        through = seq;
        count++;
      }
    }
    i += len;
  }
  pthread_mutex_lock(&p->mu);
  p->stats.replies++;
  p->stats.commands_answered += count;
  if (through > p->answered_through) p->answered_through = through;
  if (p->waiting) pthread_cond_broadcast(&p->ans_cv);
  pthread_mutex_unlock(&p->mu);
  return 0;
}

static void *reader_main(void *arg) {
  pipeline_t *p = arg;
  prctl(PR_SET_NAME, "meshd-pipe-rd");
  uint8_t *buf = NULL;
  size_t cap = 0;
  const char *why = NULL;
  for (;;) {
    rpc_bytes_t *m = NULL;
    if (rpc_stream_read_raw(p->st, &m, 0) != 1) break;
    long n = rpc_bytes_read(m, &buf, &cap);
    rpc_bytes_free(m);
    if (n < 0 || scan_reply(p, buf, (size_t)n) != 0) {
      why = n < 0 ? "out of memory reading an answer" : "the server sent a malformed SubmitReply";
      rpc_stream_cancel(p->st);
      break;
    }
  }
  free(buf);
  rpc_status_t st;
  memset(&st, 0, sizeof st);
  rpc_stream_finish(p->st, &st);
  st.kind[sizeof st.kind - 1] = '\0';
  st.message[sizeof st.message - 1] = '\0';
  if (why) {
    st.code = GRPC_STATUS_INTERNAL;
    snprintf(st.message, sizeof st.message, "%s", why);
  }
  pthread_mutex_lock(&p->mu);
  p->status = st;
  p->ended = true;
  pthread_cond_broadcast(&p->ans_cv);
  pthread_cond_signal(&p->fl_cv);
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* ------------------------------------------------------------------ the face */

/* The stream is over: why, for a caller. Under mu. */
static void ended_error(pipeline_t *p, direct_err_t *e) {
  uint64_t lost = p->queued_through > p->answered_through ? 1 : 0;
  const char *tail = lost ? "; commands queued after the last answer may not have run" : "";
  if (!p->ended)
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_UNAVAILABLE, NULL,
                   "pipeline: the Submit stream refused a write (the call is over)%s", tail);
  else if (p->status.code == GRPC_STATUS_OK)
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_UNAVAILABLE, NULL,
                   "pipeline: the server ended the Submit stream%s", tail);
  else
    direct_err_status(e, &p->status, "pipeline: the Submit stream failed: ");
}

pipeline_t *pipeline_open(rpc_channel_t *ch, const rpc_md_t *md, size_t nmd, size_t max_batch,
                          int max_delay_us, direct_err_t *e) {
  pipeline_t *p = calloc(1, sizeof *p);
  if (!p) {
    direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "pipeline: out of memory");
    return NULL;
  }
  pthread_mutex_init(&p->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&p->fl_cv, &ca);
  pthread_cond_init(&p->ans_cv, &ca);
  pthread_cond_init(&p->wr_cv, &ca);
  pthread_condattr_destroy(&ca);
  pipeline_set(p, max_batch, max_delay_us);
  p->cap = 16384;
  p->buf = malloc(p->cap);
  p->st = p->buf ? rpc_stream_open(ch, SUBMIT, md, nmd, 0) : NULL;
  if (!p->st) {
    direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "pipeline: cannot open the Submit stream");
    goto fail;
  }
  p->reader_started = pthread_create(&p->reader, NULL, reader_main, p) == 0;
  p->flusher_started = p->reader_started && pthread_create(&p->flusher, NULL, flusher_main, p) == 0;
  if (!p->flusher_started) {
    direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "pipeline: cannot start its threads");
    goto fail;
  }
  return p;
fail:
  pipeline_close(p, 1, NULL, NULL);
  return NULL;
}

void pipeline_set(pipeline_t *p, size_t max_batch, int max_delay_us) {
  pthread_mutex_lock(&p->mu);
  p->max_batch = max_batch;
  p->max_delay_ns = (int64_t)max_delay_us * 1000;
  pthread_cond_signal(&p->fl_cv);
  pthread_mutex_unlock(&p->mu);
}

/* The queued batch must go out before a command of `sent` Literal bytes joins:
 * it is full, or would carry too many bytes to the agents. Under mu. */
static bool batch_full(const pipeline_t *p, uint64_t sent) {
  return p->nq && (p->nq >= p->max_batch || p->len >= PIPELINE_MAX_BYTES ||
                   (sent && p->sent + sent > PIPELINE_MAX_SENT));
}

/* Room in buf for a command of n bytes, and for its mark. Under mu. */
static bool queue_room(pipeline_t *p, size_t n) {
  size_t need = p->len + n + 12; /* tag (2) + length (<= 10) + the command */
  if (need > p->cap) {
    size_t cap = p->cap * 2 > need ? p->cap * 2 : need;
    uint8_t *b = realloc(p->buf, cap);
    if (!b) return false;
    p->buf = b;
    p->cap = cap;
  }
  if (p->nq == p->marks_cap) {
    size_t cap = p->marks_cap ? p->marks_cap * 2 : 64;
    queued_t *q = realloc(p->marks, cap * sizeof *q);
    if (!q) return false;
    p->marks = q;
    p->marks_cap = cap;
  }
  return true;
}

int pipeline_queue(pipeline_t *p, const ProtobufCMessage *cmd, uint64_t seq, uint64_t sent,
                   int timeout_ms, direct_err_t *e) {
  size_t n = protobuf_c_message_get_packed_size(cmd);
  if (n > PIPELINE_MAX_BYTES) return 1; /* alone, in its own call */
  int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000LL;
  pthread_mutex_lock(&p->mu);
  while (batch_full(p, sent) && !p->ended && !p->write_failed) {
    /* Room comes when the batch goes out, or when those in it reach their
     * deadlines (queued before this one, they mostly do first). */
    int64_t next = next_deadline(p), until = next < deadline ? next : deadline;
    pthread_mutex_unlock(&p->mu);
    int rc = send_queued(p, false, until);
    pthread_mutex_lock(&p->mu);
    if (!p->ended && !p->write_failed) take_out(p, now_ns(), 0);
    if (rc == -2 && now_ns() >= deadline && batch_full(p, sent)) {
      /* the server stopped reading: the queue stays bounded */
      direct_err_set(e, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                     "pipeline: the server took no batch within %d ms (it is not reading the "
                     "Submit stream); command seq %llu was not queued, the %zu before it "
                     "stay queued (each is taken out, never sent, at its deadline)",
                     timeout_ms, (unsigned long long)seq, p->nq);
      pthread_mutex_unlock(&p->mu);
      return -1;
    }
  }
  if (p->ended || p->write_failed) {
    ended_error(p, e);
    pthread_mutex_unlock(&p->mu);
    return -1;
  }
  if (!queue_room(p, n)) {
    pthread_mutex_unlock(&p->mu);
    direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "pipeline: out of memory queueing a command");
    return -1;
  }
  p->len += varint_put(p->buf + p->len, (30 << 3) | 2); /* Command.batch */
  p->len += varint_put(p->buf + p->len, n);
  p->len += protobuf_c_message_pack(cmd, p->buf + p->len);
  p->marks[p->nq] = (queued_t){seq, sent, deadline, p->len, timeout_ms};
  if (!p->nq || deadline < p->earliest_ns) p->earliest_ns = deadline;
  if (p->nq++ == 0) {
    p->first_at_ns = now_ns();
    pthread_cond_signal(&p->fl_cv);
  }
  p->queued_through = seq;
  p->sent += sent;
  p->stats.commands_queued++;
  bool full = batch_full(p, 0);
  int64_t next = next_deadline(p); /* past it the batch is not full: no use waiting */
  pthread_mutex_unlock(&p->mu);
  if (full) send_queued(p, false, next); /* queued either way: it goes out later */
  return 0;
}

/* The rejections waiting to be handed over, in e: the first (lowest seq;
 * asynchronous reports, seq 0, after) and the seqs of a few later ones.
 * Returns its seq. Under mu. */
static uint64_t rejections_report(const pipeline_t *p, direct_err_t *e) {
  size_t first = 0;
  for (size_t i = 0; i < p->nrej; i++)
    if (p->rej[i].seq && (!p->rej[first].seq || p->rej[i].seq < p->rej[first].seq)) first = i;
  size_t more = p->nrej + p->rej_dropped - 1;
  char tail[256] = "";
  if (p->nrej && more) { /* name a few of the later ones */
    size_t k = (size_t)snprintf(tail, sizeof tail, " (and %zu more rejected after it:", more);
    size_t shown = 0;
    for (size_t i = 0; i < p->nrej && shown < 6; i++)
      if (i != first) {
        k += (size_t)snprintf(tail + k, sizeof tail - k, " seq %llu",
                              (unsigned long long)p->rej[i].seq);
        shown++;
      }
    snprintf(tail + k, sizeof tail - k, "%s)", more > shown ? " ..." : "");
  }
  const rejection_t *r = &p->rej[first];
  if (!p->nrej) {
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_UNKNOWN, NULL,
                   "%zu pipelined commands were rejected (too many to keep their errors)",
                   p->rej_dropped);
    return 0;
  }
  direct_err_set(e, MESHD_E_RPC, (grpc_status_code)r->code, kind_name(r->kind),
                 "pipelined command seq %llu was rejected: %s%s", (unsigned long long)r->seq,
                 r->msg, tail);
  return r->seq;
}

/* The commands taken out of the queue unsent (take_out) since the last
 * flush, in e: never sent, so their caller is told they did not run and may
 * call again safely; those handed to the stream may still run. Returns the
 * first one's seq. Under mu. */
static uint64_t unsent_report(const pipeline_t *p, direct_err_t *e) {
  uint64_t first = p->unsent[0].first, last = p->unsent[0].last;
  char ranges[384] = "";
  size_t k = 0;
  for (size_t i = 0; i < p->nunsent; i++) {
    const unsent_t *u = &p->unsent[i];
    first = u->first < first ? u->first : first;
    last = u->last > last ? u->last : last;
    if (p->nunsent > 1 && k < sizeof ranges)
      k += (size_t)snprintf(ranges + k, sizeof ranges - k, "%s%llu to %llu", i ? ", " : " (seq ",
                            (unsigned long long)u->first, (unsigned long long)u->last);
  }
  if (k && k < sizeof ranges) snprintf(ranges + k, sizeof ranges - k, ")");
  char sent[160] = "";
  if (p->sent_through > p->answered_through)
    snprintf(sent, sizeof sent, "; commands up to seq %llu were sent and may still run "
             "(answered through seq %llu)", (unsigned long long)p->sent_through,
             (unsigned long long)p->answered_through);
  direct_err_set(e, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                 "pipeline: %zu command(s) queued from seq %llu to %llu%s were not sent within "
                 "%d ms: they waited in the client's queue (the server is not reading the "
                 "Submit stream: flow control); they were taken out of the queue and never "
                 "sent, so they did not run (calling again is safe)%s",
                 p->unsent_count, (unsigned long long)first, (unsigned long long)last, ranges,
                 p->unsent[0].ms, sent);
  return first;
}

/* Hands over what the caller was not told yet: the rejections and the
 * commands taken out unsent, the lowest seq first (a rejection's seq 0, an
 * asynchronous report, last), the other named after it; then forgets them.
 * 0 when there was nothing. Under mu. */
static int reports_hand_over(pipeline_t *p, direct_err_t *e, uint64_t *seq) {
  bool rejected = p->nrej || p->rej_dropped, unsent = p->nunsent > 0;
  if (!rejected && !unsent) return 0;
  direct_err_t r = {0}, u = {0};
  uint64_t rs = rejected ? rejections_report(p, &r) : 0;
  uint64_t us = unsent ? unsent_report(p, &u) : 0;
  bool unsent_first = unsent && (!rejected || !rs || us < rs);
  *e = unsent_first ? u : r;
  *seq = unsent_first ? us : rs;
  if (rejected && unsent) {
    size_t k = strlen(e->msg);
    snprintf(e->msg + k, sizeof e->msg - k, "; also: %s", unsent_first ? r.msg : u.msg);
  }
  p->nrej = p->rej_dropped = 0;
  p->nunsent = p->unsent_count = 0;
  return -1;
}

int pipeline_flush(pipeline_t *p, int timeout_ms, direct_err_t *e, uint64_t *seq) {
  *seq = 0;
  int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000LL;
  send_queued(p, false, deadline);
  int ret = 0;
  pthread_mutex_lock(&p->mu);
  while (p->answered_through < p->queued_through && !p->ended && !p->write_failed) {
    p->waiting = true;
    struct timespec at = at_ns(deadline);
    if (pthread_cond_timedwait(&p->ans_cv, &p->mu, &at) == ETIMEDOUT) break;
  }
  p->waiting = false;
  /* The caller gives up on what is still queued: taken out, never sent (a
   * rejection to report as well changes nothing of that). */
  if (p->answered_through < p->queued_through && !p->ended && !p->write_failed && p->nq)
    take_out(p, INT64_MAX, timeout_ms);
  if (reports_hand_over(p, e, seq) != 0) {
    ret = -1;
  } else if (p->answered_through < p->queued_through) {
    if (p->ended || p->write_failed)
      ended_error(p, e);
    else if (p->in_flight) /* handed to the stream: sent */
      direct_err_set(e, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                     "pipeline: commands up to seq %llu not answered within %d ms: their batch "
                     "is still being written (the server is not reading the Submit stream: "
                     "flow control; answered through seq %llu); they were sent and may still "
                     "run",
                     (unsigned long long)p->queued_through, timeout_ms,
                     (unsigned long long)p->answered_through);
    else
      direct_err_set(e, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                     "pipeline: commands up to seq %llu not answered within %d ms (answered "
                     "through seq %llu); they may still run",
                     (unsigned long long)p->queued_through, timeout_ms,
                     (unsigned long long)p->answered_through);
    ret = -1;
  } else if (p->ended && p->status.code != GRPC_STATUS_OK) {
    ended_error(p, e); /* everything answered, yet nothing more will be */
    ret = -1;
  }
  pthread_mutex_unlock(&p->mu);
  return ret;
}

bool pipeline_rejections(pipeline_t *p) {
  pthread_mutex_lock(&p->mu);
  bool any = p->nrej || p->rej_dropped || p->nunsent;
  pthread_mutex_unlock(&p->mu);
  return any;
}

bool pipeline_over(pipeline_t *p) {
  pthread_mutex_lock(&p->mu);
  bool over = p->ended || p->write_failed;
  pthread_mutex_unlock(&p->mu);
  return over;
}

void pipeline_stats(pipeline_t *p, meshd_pipeline_stats_t *out) {
  pthread_mutex_lock(&p->mu);
  *out = p->stats;
  pthread_mutex_unlock(&p->mu);
}

int pipeline_close(pipeline_t *p, int timeout_ms, direct_err_t *e, uint64_t *seq) {
  int ret = 0;
  if (!p) return 0;
  if (p->st && p->reader_started) {
    direct_err_t dropped;
    uint64_t dropped_seq;
    /* One deadline for the flush and the half-close: a frozen server holds
     * the caller timeout_ms, not twice that. */
    int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000LL;
    ret = pipeline_flush(p, timeout_ms, e ? e : &dropped, seq ? seq : &dropped_seq);
    /* The half-close goes after what is in flight; a server that still does
     * not read gets none, and the cancel below ends the call. */
    pthread_mutex_lock(&p->mu);
    if (writer_take(p, deadline)) {
      if (collect_in_flight(p, deadline) == 0 && !p->write_failed) {
        pthread_mutex_unlock(&p->mu);
        rpc_stream_close_send(p->st);
        pthread_mutex_lock(&p->mu);
      }
      writer_give(p);
    }
    /* The server ends the stream once it read the half-close. */
    while (!p->ended) {
      struct timespec at = at_ns(deadline);
      if (pthread_cond_timedwait(&p->ans_cv, &p->mu, &at) == ETIMEDOUT) break;
    }
    pthread_mutex_unlock(&p->mu);
    rpc_stream_cancel(p->st); /* a no-op once ended */
  } else if (p->st) {
    rpc_stream_cancel(p->st);
  }
  pthread_mutex_lock(&p->mu);
  p->stop = true;
  pthread_cond_signal(&p->fl_cv);
  pthread_mutex_unlock(&p->mu);
  if (p->flusher_started) pthread_join(p->flusher, NULL);
  if (p->reader_started) pthread_join(p->reader, NULL);
  if (p->st) rpc_stream_destroy(p->st);
  pthread_cond_destroy(&p->fl_cv);
  pthread_cond_destroy(&p->ans_cv);
  pthread_cond_destroy(&p->wr_cv);
  pthread_mutex_destroy(&p->mu);
  free(p->buf);
  free(p->marks);
  free(p->rej);
  free(p);
  return ret;
}
