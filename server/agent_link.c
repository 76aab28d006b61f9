#include "agent_link.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grant.h"
#include "log.h"
#include "runtime.h"
#include "secret.h"
#include "rpc.h"

/* Room before a packed instruction for its seq field: tag byte + 10-byte varint. */
#define SEQ_ROOM 11

/* One queued instruction, packed without its seq; the seq is written into the
 * room in front of it when the link takes it. Protobuf decoders accept fields
 * in any order, so "seq first" is a valid Instruction encoding. */
struct agent_link_msg {
  struct agent_link_msg *next;
  size_t off; /* where the encoding starts in bytes[] */
  size_t len; /* encoding length from off */
  uint8_t bytes[];
};

/* InstructionBatch as the writer sends it: `repeated Instruction instructions = 1`
 * and `repeated bytes instructions = 1` have the same wire format (field 1,
 * length-delimited), so already-packed instructions are concatenated by
 * protobuf-c without unpacking them again. Only ever packed, never unpacked. */
typedef struct raw_batch {
  ProtobufCMessage base;
  size_t n_instructions;
  ProtobufCBinaryData *instructions;
} raw_batch_t;

static const ProtobufCFieldDescriptor raw_batch_fields[1] = {{
    .name = "instructions",
    .id = 1,
    .label = PROTOBUF_C_LABEL_REPEATED,
    .type = PROTOBUF_C_TYPE_BYTES,
    .quantifier_offset = offsetof(raw_batch_t, n_instructions),
    .offset = offsetof(raw_batch_t, instructions),
}};
static const unsigned raw_batch_by_name[1] = {0};
static const ProtobufCIntRange raw_batch_ranges[2] = {{1, 0}, {0, 1}};
static const ProtobufCMessageDescriptor raw_batch_descriptor = {
    .magic = PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC,
    .name = "meshd.agent.v1.InstructionBatch",
    .short_name = "InstructionBatch",
    .c_name = "RawInstructionBatch",
    .package_name = "meshd.agent.v1",
    .sizeof_message = sizeof(raw_batch_t),
    .n_fields = 1,
    .fields = raw_batch_fields,
    .fields_sorted_by_name = raw_batch_by_name,
    .n_field_ranges = 1,
    .field_ranges = raw_batch_ranges,
};

struct agent_link {
  rpc_duplex_t *call;
  uint32_t rank;
  char agent_id[64];
  agent_link_callbacks_t cb;
  pthread_t writer;
  bool writer_started;
  char why[600]; /* why the link ended: a refused report (link_read), else the status */

  pthread_mutex_t mu;
  pthread_cond_t cv;
  agent_link_msg_t *head, *tail;
  size_t queued, queued_bytes;
  uint64_t next_seq;
  uint64_t executed;
  uint64_t batches_sent, instructions_sent, reports;
  bool broken; /* the call is over: sends fail */
  bool read_ended; /* link_read got the end: the writer ends the link */
  bool stop;   /* agent_link_close runs: no more callbacks */
  bool writer_idle; /* the writer waits for work: a push wakes it */
  bool deferred;    /* what is queued may wait for company (agent_link_defer_begin) */
  int corks;   /* threads holding the writer back (agent_link_cork) */
  _Atomic int refs; /* the owner's, and one per cork holding it */
};

static void link_unref(agent_link_t *l) {
  if (atomic_fetch_sub(&l->refs, 1) != 1) return;
  pthread_cond_destroy(&l->cv);
  pthread_mutex_destroy(&l->mu);
  free(l);
}

/* ------------------------------------------------------------------ cork */

/* The links one thread queued to while corked: each holds a cork and a
 * reference until agent_link_uncork. Past CORK_LINKS links, the others are
 * not held back (they are written as before). */
#define CORK_LINKS 64
/* A corked link's writer holds queued instructions back until the corks go,
 * HOLD_FLUSH are queued, or hold_ms passed: a corked thread that blocks
 * delays a link but never stalls it. */
#define HOLD_FLUSH 256
static atomic_int hold_ms = 20; /* agent_link_set_hold_ms */
static atomic_int lone_ms = 1;  /* agent_link_set_lone_ms */

void agent_link_set_hold_ms(int ms) { atomic_store(&hold_ms, ms < 0 ? 0 : ms); }
void agent_link_set_lone_ms(int ms) { atomic_store(&lone_ms, ms < 0 ? 0 : ms); }

static atomic_bool server_stopping; /* agent_links_server_stopping */
void agent_links_server_stopping(void) { atomic_store(&server_stopping, true); }
bool agent_links_stopping(void) { return atomic_load(&server_stopping); }

static _Thread_local struct {
  int depth;
  int defer;       /* agent_link_defer_begin's depth */
  bool until_idle; /* one of depth is agent_link_cork_until_idle's */
  size_t n;
  agent_link_t *links[CORK_LINKS];
} cork;

void agent_link_cork(void) { cork.depth++; }

void agent_link_defer_begin(void) { cork.defer++; }

void agent_link_defer_end(void) {
  if (cork.defer > 0) cork.defer--;
}

void agent_link_flush(agent_link_t *l) {
  pthread_mutex_lock(&l->mu);
  if (l->deferred) {
    l->deferred = false;
    if (l->head) pthread_cond_signal(&l->cv);
  }
  pthread_mutex_unlock(&l->mu);
}

void agent_link_cork_until_idle(void) {
  if (cork.until_idle || !rpc_server_hold_until_idle()) return;
  cork.until_idle = true;
  cork.depth++;
}

void agent_link_uncork_idle(void) {
  if (!cork.until_idle) return;
  cork.until_idle = false;
  agent_link_uncork();
}

void agent_link_uncork(void) {
  if (cork.depth == 0 || --cork.depth > 0) return;
  for (size_t i = 0; i < cork.n; i++) {
    agent_link_t *l = cork.links[i];
    pthread_mutex_lock(&l->mu);
    if (--l->corks == 0 && l->head) pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    link_unref(l);
  }
  cork.n = 0;
}

/* Holds mu: a corked thread pushing to l holds a cork on it; a deferring
 * one lets what is queued wait, and any other push sends it all. */
static void cork_push_locked(agent_link_t *l) {
  l->deferred = cork.defer > 0;
  if (cork.depth == 0) return;
  for (size_t i = 0; i < cork.n; i++)
    if (cork.links[i] == l) return;
  if (cork.n == CORK_LINKS) return;
  cork.links[cork.n++] = l;
  atomic_fetch_add(&l->refs, 1);
  l->corks++;
}

/* Holds mu. Whether the writer keeps what is queued a little longer. */
static bool holding_locked(const agent_link_t *l) {
  return atomic_load(&hold_ms) > 0 && !l->stop && !l->broken && !l->read_ended &&
         l->queued < HOLD_FLUSH &&
         (l->corks > 0 || l->deferred);
}

/* Holds mu. The writer's wait for company: a corked link until the corks go,
 * a deferring one until a push ends the deferral; either at most hold_ms. A
 * deferred instruction alone in the queue that no push joined within lone_ms
 * goes then: a lone unary command goes at once, while a caller whose commands
 * come faster than that sends them as one batch per hold (the writer wakes
 * twice per batch). */
static void hold_locked(agent_link_t *l) {
  int hold = atomic_load(&hold_ms), lone = atomic_load(&lone_ms);
  uint64_t seq = l->next_seq;
  struct timespec dl;
  int rc = 0;
  if (lone > 0 && lone < hold) {
    runtime_deadline(&dl, CLOCK_REALTIME, lone);
    while (holding_locked(l) && rc == 0) rc = pthread_cond_timedwait(&l->cv, &l->mu, &dl);
    if (rc == 0 || (l->corks == 0 && l->next_seq == seq && l->queued == 1)) return;
    rc = 0;
  }
  runtime_deadline(&dl, CLOCK_REALTIME, hold);
  while (holding_locked(l) && rc == 0) rc = pthread_cond_timedwait(&l->cv, &l->mu, &dl);
}

/* ------------------------------------------------------------------ queue */

agent_link_msg_t *agent_link_pack(const Meshd__Agent__V1__Instruction *ins) {
  Meshd__Agent__V1__Instruction copy = *ins;
  copy.seq = 0; /* proto3: a zero scalar is not encoded; the link writes it */
  size_t n = protobuf_c_message_get_packed_size(&copy.base);
  if (n > AGENT_LINK_MAX_INSTRUCTION) {
    log_error("link", "an instruction packs to %zu bytes, over the %d-byte limit; not sent", n,
              AGENT_LINK_MAX_INSTRUCTION);
    return NULL;
  }
  agent_link_msg_t *m = malloc(sizeof *m + SEQ_ROOM + n);
  if (!m) return NULL;
  m->next = NULL;
  protobuf_c_message_pack(&copy.base, m->bytes + SEQ_ROOM);
  m->off = SEQ_ROOM;
  m->len = n;
  return m;
}

void agent_link_msg_free(agent_link_msg_t *m) { free(m); }

size_t agent_link_msg_len(const agent_link_msg_t *m) { return m->len; }

agent_link_msg_t *agent_link_msg_clone(const agent_link_msg_t *m) {
  if (!m) return NULL;
  size_t size = sizeof *m + SEQ_ROOM + m->len;
  agent_link_msg_t *c = malloc(size);
  if (c) {
    memcpy(c, m, size);
    c->next = NULL;
  }
  return c;
}

static void set_seq(agent_link_msg_t *m, uint64_t seq) {
  uint8_t v[SEQ_ROOM];
  size_t k = 0;
  v[k++] = 0x08; /* field 1, varint */
  do {
    uint8_t b = seq & 0x7f;
    seq >>= 7;
    v[k++] = seq ? (uint8_t)(b | 0x80) : b;
  } while (seq);
  m->off = SEQ_ROOM - k;
  m->len += k;
  memcpy(m->bytes + m->off, v, k);
}

static void free_list(agent_link_msg_t *m) {
  while (m) {
    agent_link_msg_t *next = m->next;
    free(m);
    m = next;
  }
}

uint64_t agent_link_push(agent_link_t *l, agent_link_msg_t *m) {
  if (!m) return 0;
  pthread_mutex_lock(&l->mu);
  if (l->broken || l->stop) {
    pthread_mutex_unlock(&l->mu);
    free(m);
    return 0;
  }
  uint64_t seq = l->next_seq++;
  set_seq(m, seq);
  if (l->tail) l->tail->next = m;
  else l->head = m;
  l->tail = m;
  l->queued++;
  l->queued_bytes += m->len;
  bool was_deferred = l->deferred;
  cork_push_locked(l);
  /* A writer that is busy or holding finds this later; it is woken only from
   * idle, when the queue makes a full batch, or when this push ends a
   * deferral it holds for. */
  if (l->writer_idle || l->queued == HOLD_FLUSH ||
      (was_deferred && !l->deferred && l->corks == 0))
    pthread_cond_signal(&l->cv);
  pthread_mutex_unlock(&l->mu);
  return seq;
}

uint64_t agent_link_send(agent_link_t *l, const Meshd__Agent__V1__Instruction *ins) {
  return agent_link_push(l, agent_link_pack(ins));
}

/* ------------------------------------------------------------------ threads */

/* "link-w3": what `top -H` and the tests see. */
static void name_thread(const char *what, uint32_t rank) {
  char name[16];
  snprintf(name, sizeof name, "link-%s%u", what, rank);
  pthread_setname_np(pthread_self(), name);
}

static void link_ended(agent_link_t *l);

/* The link's thread: sends what is queued, and ends the link when the call
 * is over (link_read runs on the rpc layer's client thread and must not
 * block; what the end calls may). */
static void *writer_main(void *arg) {
  agent_link_t *l = arg;
  name_thread("w", l->rank);
  ProtobufCBinaryData *items = malloc(AGENT_LINK_BATCH_MAX * sizeof *items);
  pthread_mutex_lock(&l->mu);
  while (items) {
    l->writer_idle = true;
    while (!l->head && !l->stop && !l->broken && !l->read_ended) pthread_cond_wait(&l->cv, &l->mu);
    l->writer_idle = false;
    if (holding_locked(l)) hold_locked(l);
    if (l->stop || l->broken || l->read_ended) break;
    /* Take what is queued now: under load batches grow by themselves, and an
     * idle link sends a lone instruction at once. */
    agent_link_msg_t *first = l->head, *last = NULL;
    size_t n = 0, bytes = 0;
    for (agent_link_msg_t *m = first; m && n < AGENT_LINK_BATCH_MAX; m = m->next) {
      if (n > 0 && bytes + m->len > AGENT_LINK_BATCH_BYTES) break;
      items[n].data = m->bytes + m->off;
      items[n].len = m->len;
      n++;
      bytes += m->len;
      last = m;
    }
    l->head = last->next;
    if (!l->head) l->tail = NULL;
    l->deferred = false;
    last->next = NULL;
    l->queued -= n;
    l->queued_bytes -= bytes;
    /* Counted as they go (not once the write completed: its completion can
     * come after the agent ran them and a Sync was answered, and a scrape
     * after that Sync must see them). */
    l->batches_sent++;
    l->instructions_sent += n;
    pthread_mutex_unlock(&l->mu);

    raw_batch_t batch = {PROTOBUF_C_MESSAGE_INIT(&raw_batch_descriptor), n, items};
    int rc = rpc_duplex_write(l->call, &batch.base);
    free_list(first);

    pthread_mutex_lock(&l->mu);
    if (rc != 0) break; /* the call is over; its status says why */
  }
  pthread_mutex_unlock(&l->mu);
  if (!items) {
    log_error("link", "rank %u: out of memory starting the writer", l->rank);
    rpc_duplex_cancel(l->call);
  }
  free(items);
  link_ended(l);
  return NULL;
}

/* Checks a report against what was sent; returns false (with why) if the agent
 * claims seqs it was never given. Lower watermarks than known are ignored. */
static bool take_report(agent_link_t *l, const Meshd__Agent__V1__AgentReport *rep, uint64_t *exec,
                        bool *stop, char *why, size_t whylen) {
  pthread_mutex_lock(&l->mu);
  bool ok = rep->executed_through < l->next_seq && rep->received_through < l->next_seq &&
            (!rep->received_through || rep->received_through >= rep->executed_through);
  for (size_t i = 0; ok && i < rep->n_sessions; i++) {
    const Meshd__Agent__V1__SessionProgress *sp = rep->sessions[i];
    ok = sp->session_id && sp->executed_through <= rep->received_through;
    if (!ok)
      snprintf(why, whylen, "the agent reported session progress past what it received (seq %llu "
               "> %llu)", (unsigned long long)sp->executed_through,
               (unsigned long long)rep->received_through);
  }
  if (!ok && !why[0])
    snprintf(why, whylen, "the agent reported executed through seq %llu (received %llu), but only "
             "%llu were sent", (unsigned long long)rep->executed_through,
             (unsigned long long)rep->received_through, (unsigned long long)l->next_seq - 1);
  /* A report taken once the link stops goes to no callback: it must not count
   * either, or the seqs it names would be neither reached (the watermark never
   * heard of them) nor lost (link_gone marks only those after l->executed). */
  if (ok && !l->stop) {
    if (rep->executed_through > l->executed) l->executed = rep->executed_through;
    l->reports++;
  }
  *exec = l->executed;
  *stop = l->stop;
  pthread_mutex_unlock(&l->mu);
  return ok;
}

/* Each AgentReport, on the rpc layer's client thread; NULL at the end. */
static void link_read(rpc_duplex_t *d, ProtobufCMessage *msg, void *arg) {
  agent_link_t *l = arg;
  if (!msg) {
    pthread_mutex_lock(&l->mu);
    l->read_ended = true;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return;
  }
  if (l->why[0]) { /* refused one already: the call is being cancelled */
    protobuf_c_message_free_unpacked(msg, NULL);
    return;
  }
  const Meshd__Agent__V1__AgentReport *rep = (const void *)msg;
  uint64_t exec;
  bool stop;
  if (!take_report(l, rep, &exec, &stop, l->why, sizeof l->why)) {
    rpc_duplex_cancel(d);
  } else if (!stop && l->cb.on_report) {
    agent_link_report_t r = {
        .executed = exec,
        .received = rep->received_through,
        .sessions = (const Meshd__Agent__V1__SessionProgress *const *)rep->sessions,
        .n_sessions = rep->n_sessions,
        .errors = (const Meshd__V1__Error *const *)rep->errors,
        .n_errors = rep->n_errors,
        .allocated_bytes = rep->allocated_bytes,
        .agent_unix_ms = rep->unix_ms,
        .recv_unix_ms = rep->unix_ms > 0 ? grant_now_unix_ms() : 0,
    };
    l->cb.on_report(l->rank, &r, l->cb.arg);
  }
  protobuf_c_message_free_unpacked(msg, NULL);
}

/* The writer's last act: once the call is over, the link is broken, and
 * unless it is stopping, what was queued is dropped and the owner hears of
 * the loss. */
static void link_ended(agent_link_t *l) {
  rpc_status_t st;
  rpc_duplex_cancel(l->call); /* the writer may have stopped first */
  rpc_duplex_finish(l->call, &st);
  pthread_mutex_lock(&l->mu);
  l->broken = true;
  bool lost = !l->stop;
  agent_link_msg_t *dropped = NULL;
  size_t ndropped = 0;
  if (lost) { /* on close the queue is freed with the link */
    dropped = l->head;
    ndropped = l->queued;
    l->head = l->tail = NULL;
    l->queued = l->queued_bytes = 0;
  }
  uint64_t exec = l->executed, last = l->next_seq - 1;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  free_list(dropped);
  if (!lost) return;

  if (!l->why[0]) /* no report refused: the call's status says why */
    snprintf(l->why, sizeof l->why, "%s: %s", meshd_grpc_code_name(st.code),
             st.message[0] ? st.message : "(no message)");
  /* Stopping, the server itself ends its local agents: that is no news. */
  log_event(atomic_load(&server_stopping) ? LOG_LEVEL_INFO : LOG_LEVEL_WARN, "link",
            &(log_fields_t){LOG_RANK(l->rank)},
            "rank %u (agent %s): Execute link lost: %s; executed through seq %llu of %llu, "
            "%zu queued instruction(s) dropped", l->rank, l->agent_id, l->why,
            (unsigned long long)exec, (unsigned long long)last, ndropped);
  if (l->cb.on_lost) l->cb.on_lost(l->rank, l->cb.arg);
}

/* ------------------------------------------------------------------ life */

agent_link_t *agent_link_open(rpc_channel_t *ch, uint32_t rank, const char *agent_id,
                              uint64_t first_seq, const char *call_secret,
                              const agent_link_callbacks_t *cb) {
  agent_link_t *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  l->rank = rank;
  snprintf(l->agent_id, sizeof l->agent_id, "%s", agent_id ? agent_id : "");
  if (cb) l->cb = *cb;
  l->next_seq = first_seq ? first_seq : 1;
  l->executed = l->next_seq - 1;
  atomic_init(&l->refs, 1);
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv, NULL);
  /* No deadline: the call lives as long as the agent. */
  rpc_md_t md = {SECRET_AGENT_MD, call_secret};
  l->call = rpc_duplex_open(ch, AGENT_LINK_METHOD, &md, call_secret ? 1 : 0, -1,
                            &meshd__agent__v1__agent_report__descriptor, link_read, l);
  if (!l->call) goto fail;
  l->writer_started = pthread_create(&l->writer, NULL, writer_main, l) == 0;
  if (!l->writer_started) goto fail;
  log_event(LOG_LEVEL_INFO, "link", &(log_fields_t){LOG_RANK(rank)},
            "rank %u (agent %s): Execute link open, seqs from %llu", rank, l->agent_id,
            (unsigned long long)l->next_seq);
  return l;
fail:
  log_error("link", "rank %u (agent %s): cannot open the Execute link", rank, l->agent_id);
  agent_link_close(l);
  return NULL;
}

void agent_link_stop(agent_link_t *l) {
  pthread_mutex_lock(&l->mu);
  l->stop = true;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  /* Cancelling wakes a writer blocked on flow control, and ends the reads. */
  if (l->call) rpc_duplex_cancel(l->call);
  if (l->writer_started) pthread_join(l->writer, NULL);
  /* Without a writer (it never started), link_read may still be running. */
  else if (l->call) rpc_duplex_finish(l->call, NULL);
  l->writer_started = false;
}

void agent_link_close(agent_link_t *l) {
  if (!l) return;
  agent_link_stop(l);
  rpc_duplex_destroy(l->call);
  pthread_mutex_lock(&l->mu); /* a corked thread may still look (agent_link_uncork) */
  agent_link_msg_t *left = l->head;
  l->head = l->tail = NULL;
  pthread_mutex_unlock(&l->mu);
  free_list(left);
  link_unref(l);
}

/* ------------------------------------------------------------------ queries */

uint64_t agent_link_executed(agent_link_t *l) {
  pthread_mutex_lock(&l->mu);
  uint64_t v = l->executed;
  pthread_mutex_unlock(&l->mu);
  return v;
}

uint64_t agent_link_last_seq(agent_link_t *l) {
  pthread_mutex_lock(&l->mu);
  uint64_t v = l->next_seq - 1;
  pthread_mutex_unlock(&l->mu);
  return v;
}

size_t agent_link_queued(agent_link_t *l) {
  pthread_mutex_lock(&l->mu);
  size_t v = l->queued;
  pthread_mutex_unlock(&l->mu);
  return v;
}

bool agent_link_broken(agent_link_t *l) {
  pthread_mutex_lock(&l->mu);
  bool v = l->broken;
  pthread_mutex_unlock(&l->mu);
  return v;
}

void agent_link_stats(agent_link_t *l, agent_link_stats_t *out) {
  pthread_mutex_lock(&l->mu);
  *out = (agent_link_stats_t){
      .last_seq = l->next_seq - 1,
      .executed = l->executed,
      .queued = l->queued,
      .queued_bytes = l->queued_bytes,
      .batches_sent = l->batches_sent,
      .instructions_sent = l->instructions_sent,
      .reports = l->reports,
      .broken = l->broken,
  };
  pthread_mutex_unlock(&l->mu);
}

uint32_t agent_link_rank(const agent_link_t *l) { return l->rank; }
