/* server/agent_link.c and the pool around it, against in-process fake agents:
 * an rpc_server with an Execute handler that acks each batch, never acks,
 * dies after some instructions, lies about its watermark, or stops reading. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_link.h"
#include "agent_pool.h"
#include "grant.h"
#include "rpc.h"
#include "watermark.h"

/* A channel to a live peer in this process: seconds to connect, since a loaded
 * machine (CI runs the sanitized suites on 2 cores) can take longer than the
 * 100 ms default to answer the first SETTINGS frame. */
static const rpc_channel_opts_t live_peer = {.connect_timeout_ms = 5000};


/* ---------------------------------------------------------------- leftovers */

/* What a test made and has not freed yet. A failed assertion leaves the test
 * there, with fakes that still hold their calls open: rpc_shutdown (teardown)
 * waits for every call to end, so it waited out Criterion's 60 s timeout, and
 * the failure read as a timeout. Teardown frees what is left instead, the
 * servers first (their calls end, so no close waits on a peer). Owned by the
 * test's thread; a test that frees all it made leaves nothing here. */
typedef enum { LEFT_SERVER, LEFT_FAKE, LEFT_STREAM, LEFT_POOL, LEFT_LINK, LEFT_CHANNEL } left_kind_t;

typedef struct {
  left_kind_t kind;
  void *obj;
} left_t;

static left_t left[32];
static size_t nleft;

static void *keep(left_kind_t kind, void *obj) {
  cr_assert_lt(nleft, sizeof left / sizeof left[0], "too many objects for teardown's list");
  if (obj) left[nleft++] = (left_t){kind, obj};
  return obj;
}

static void forget(const void *obj) {
  for (size_t i = 0; obj && i < nleft; i++)
    if (left[i].obj == obj) {
      left[i] = left[--nleft];
      return;
    }
}

/* ---------------------------------------------------------------- fake agent */

typedef enum { FAKE_ACK, FAKE_SILENT, FAKE_DIE_AFTER, FAKE_LIE, FAKE_STUCK } fake_mode_t;

#define MAX_SEQS 20000

typedef struct fake {
  rpc_server_t *srv;
  char target[64];
  fake_mode_t mode;
  uint64_t die_after; /* FAKE_DIE_AFTER: instructions taken before the call ends */
  int64_t clock_ahead_ms; /* its reports carry a clock this far ahead of ours (0: none) */
  bool report_at_start;   /* it reports (nothing executed) as each call starts, once released */

  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool release; /* FAKE_STUCK handlers return; report_at_start reports */
  int calls;
  uint64_t batches, instructions, reports;
  uint64_t last_seq;
  bool disorder; /* a seq that was not last + 1 (within a call) */
  size_t max_batch;
  size_t max_batch_bytes;
  uint64_t first_seq_of_call; /* of the latest call */
  uint64_t streams[MAX_SEQS]; /* Instruction.stream by seq - first_seq_of_call */
  char session[64];           /* of the latest instruction */
  int body_case;
} fake_t;

/* One AgentReport: executed through `through`, 4096 bytes allocated, stamped
 * with its clock if it has one. */
static void fake_report(fake_t *f, rpc_call_t *call, uint64_t through) {
  Meshd__Agent__V1__AgentReport rep = MESHD__AGENT__V1__AGENT_REPORT__INIT;
  rep.executed_through = through;
  rep.allocated_bytes = 4096;
  if (f->clock_ahead_ms) rep.unix_ms = grant_now_unix_ms() + f->clock_ahead_ms;
  rpc_call_send(call, &rep.base);
}

static void fake_start_call(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  fake_t *f = arg;
  pthread_mutex_lock(&f->mu);
  f->calls++;
  f->last_seq = 0;
  f->first_seq_of_call = 0;
  bool report = f->report_at_start;
  while (report && !f->release) pthread_cond_wait(&f->cv, &f->mu); /* fake_kill releases */
  if (report) f->reports++;
  pthread_mutex_unlock(&f->mu);
  if (report) fake_report(f, call, 0);
}

static void fake_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  fake_t *f = arg;
  if (!msg) {
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "bye");
    return;
  }
  const Meshd__Agent__V1__InstructionBatch *b = (const void *)msg;
  if (f->mode == FAKE_STUCK) { /* blocks a CQ thread on purpose: gRPC stops reading */
    pthread_mutex_lock(&f->mu);
    while (!f->release) pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
    return;
  }
  pthread_mutex_lock(&f->mu);
  f->batches++;
  if (b->n_instructions > f->max_batch) f->max_batch = b->n_instructions;
  size_t bytes = protobuf_c_message_get_packed_size(msg);
  if (bytes > f->max_batch_bytes) f->max_batch_bytes = bytes;
  bool die = false;
  for (size_t i = 0; i < b->n_instructions && !die; i++) {
    const Meshd__Agent__V1__Instruction *ins = b->instructions[i];
    if (f->first_seq_of_call == 0) f->first_seq_of_call = ins->seq;
    else if (ins->seq != f->last_seq + 1) f->disorder = true;
    f->last_seq = ins->seq;
    f->instructions++;
    uint64_t k = ins->seq - f->first_seq_of_call;
    if (k < MAX_SEQS) f->streams[k] = ins->stream;
    snprintf(f->session, sizeof f->session, "%s", ins->session_id);
    f->body_case = ins->body_case;
    die = f->mode == FAKE_DIE_AFTER && f->instructions >= f->die_after;
  }
  uint64_t through = f->last_seq;
  bool ack = f->mode == FAKE_ACK || f->mode == FAKE_DIE_AFTER || f->mode == FAKE_LIE;
  if (ack) f->reports++;
  pthread_mutex_unlock(&f->mu);
  if (ack) fake_report(f, call, f->mode == FAKE_LIE ? through + 5 : through);
  if (die) rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, NULL, "agent died");
}

static const rpc_method_t fake_row = {
    .path = AGENT_LINK_METHOD,
    .kind = RPC_BIDI,
    .request = &meshd__agent__v1__instruction_batch__descriptor,
    .on_start = fake_start_call,
    .on_message = fake_message,
};

static fake_t *fake_start(fake_mode_t mode) {
  fake_t *f = calloc(1, sizeof *f);
  cr_assert_not_null(f);
  f->mode = mode;
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 2};
  char err[256];
  f->srv = rpc_server_create(&o, err, sizeof err);
  cr_assert_not_null(f->srv, "%s", err);
  cr_assert_eq(rpc_server_add_methods(f->srv, &fake_row, 1, f), 0);
  int port = rpc_server_start(f->srv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  snprintf(f->target, sizeof f->target, "127.0.0.1:%d", port);
  return keep(LEFT_FAKE, f);
}

/* Ends the fake's server (as if the agent process died): open calls are cancelled. */
static void fake_kill(fake_t *f) {
  if (!f->srv) return;
  pthread_mutex_lock(&f->mu);
  f->release = true;
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  rpc_server_destroy(f->srv);
  f->srv = NULL;
}

static void fake_free(fake_t *f) {
  if (!f) return;
  forget(f);
  fake_kill(f);
  pthread_cond_destroy(&f->cv);
  pthread_mutex_destroy(&f->mu);
  free(f);
}

static uint64_t fake_get(fake_t *f, uint64_t *field) {
  pthread_mutex_lock(&f->mu);
  uint64_t v = *field;
  pthread_mutex_unlock(&f->mu);
  return v;
}

/* ---------------------------------------------------------------- observer */

typedef struct observer {
  pthread_mutex_t mu;
  atomic_int lost;
  atomic_int reports;
  uint32_t lost_rank;
  uint64_t last_exec[4];
  bool regress;
  uint64_t allocated;
} observer_t;

static observer_t obs;

static void on_report(uint32_t rank, const agent_link_report_t *r, void *arg) {
  observer_t *o = arg;
  uint64_t exec = r->executed, allocated = r->allocated_bytes;
  pthread_mutex_lock(&o->mu);
  if (rank < 4) {
    if (exec < o->last_exec[rank]) o->regress = true;
    o->last_exec[rank] = exec;
  }
  o->allocated = allocated;
  pthread_mutex_unlock(&o->mu);
  atomic_fetch_add(&o->reports, 1);
}

static void on_lost(uint32_t rank, void *arg) {
  observer_t *o = arg;
  o->lost_rank = rank;
  atomic_fetch_add(&o->lost, 1);
}

static const agent_link_callbacks_t cbs = {on_report, on_lost, &obs};

static void on_pool_lost(const agent_lost_t *l, void *arg) { on_lost(l->rank, arg); }

static void setup(void) {
  rpc_init();
  memset(&obs, 0, sizeof obs);
  pthread_mutex_init(&obs.mu, NULL);
}

/* The test's channels, links, pools and servers, kept for teardown (leftovers). */
static rpc_channel_t *channel_create(const char *target, const rpc_channel_opts_t *o) {
  return keep(LEFT_CHANNEL, rpc_channel_create(target, o));
}

static void channel_destroy(rpc_channel_t *ch) {
  forget(ch);
  rpc_channel_destroy(ch);
}

static agent_link_t *link_open(rpc_channel_t *ch, uint32_t rank, const char *agent_id,
                               uint64_t first_seq) {
  return keep(LEFT_LINK, agent_link_open(ch, rank, agent_id, first_seq, NULL, &cbs));
}

static void link_close(agent_link_t *l) {
  forget(l);
  agent_link_close(l);
}

static agent_pool_t *pool_create(const agent_pool_callbacks_t *cb) {
  agent_pool_t *p = agent_pool_create(cb);
  cr_assert_not_null(p);
  return keep(LEFT_POOL, p);
}

static void pool_destroy(agent_pool_t *p) {
  forget(p);
  agent_pool_destroy(p);
}

static void server_destroy(rpc_server_t *srv) {
  forget(srv);
  rpc_server_destroy(srv);
}

static void stream_destroy(rpc_stream_t *st) {
  forget(st);
  rpc_stream_destroy(st);
}

static void release_blocked_report(void);

/* Frees what a failed test left (leftovers), in an order in which nothing
 * waits: the servers go first, which ends their calls (a fake's blocked
 * handlers let go), then the client side, which has nothing left to wait for. */
static void free_leftovers(void) {
  release_blocked_report(); /* the client thread, if a test held it */
  left_t was[sizeof left / sizeof left[0]];
  size_t n = nleft;
  memcpy(was, left, n * sizeof *was);
  nleft = 0;
  static const left_kind_t order[] = {LEFT_SERVER, LEFT_FAKE, LEFT_STREAM, LEFT_POOL,
                                      LEFT_LINK,   LEFT_CHANNEL, LEFT_FAKE};
  const size_t steps = sizeof order / sizeof order[0];
  for (size_t k = 0; k < steps; k++) {
    for (size_t i = 0; i < n; i++) {
      void *o = was[i].obj;
      if (was[i].kind != order[k]) continue;
      switch (order[k]) {
      case LEFT_SERVER: rpc_server_destroy(o); break;
      case LEFT_FAKE: k == steps - 1 ? fake_free(o) : fake_kill(o); break; /* killed, then freed */
      case LEFT_STREAM: rpc_stream_destroy(o); break;
      case LEFT_POOL: agent_pool_destroy(o); break;
      case LEFT_LINK: agent_link_close(o); break;
      case LEFT_CHANNEL: rpc_channel_destroy(o); break;
      }
    }
  }
}

static void teardown(void) {
  if (nleft) {
    cr_log_warn("teardown: the test left %zu objects (it failed?); freeing them", nleft);
    free_leftovers();
  }
  rpc_shutdown();
}

TestSuite(agent_link, .init = setup, .fini = teardown, .timeout = 60);

/* Polls until pred(arg) or timeout; returns pred's last answer. */
static bool eventually(bool (*pred)(void *), void *arg, int timeout_ms) {
  int64_t end = rpc_now_ms() + timeout_ms;
  while (!pred(arg)) {
    if (rpc_now_ms() > end) return false;
    usleep(1000);
  }
  return true;
}

typedef struct { agent_link_t *l; uint64_t want; } exec_want_t;
static bool executed_reaches(void *arg) {
  exec_want_t *w = arg;
  return agent_link_executed(w->l) >= w->want;
}
static bool link_broken(void *arg) { return agent_link_broken(arg); }

/* The link's stats once its writer counted everything the agent ran: the
 * agent's report can overtake the writer thread's count of the batch it
 * answers (it counts after its write returns). For links whose seqs start
 * at 1. */
static void settled_stats(agent_link_t *l, agent_link_stats_t *st) {
  int64_t end = rpc_now_ms() + 5000;
  for (agent_link_stats(l, st); st->instructions_sent < st->executed && rpc_now_ms() < end;
       agent_link_stats(l, st))
    usleep(1000);
}
static bool lost_seen(void *arg) { return atomic_load(&obs.lost) > 0; }

static Meshd__Agent__V1__StatusRequest status_body = MESHD__AGENT__V1__STATUS_REQUEST__INIT;

static void make_ins(Meshd__Agent__V1__Instruction *ins, const char *session, uint64_t stream) {
  meshd__agent__v1__instruction__init(ins);
  ins->session_id = (char *)session;
  ins->stream = stream;
  ins->body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS;
  ins->status = &status_body;
}

/* A link to a fake agent, and a tiny instruction to send on it. */
typedef struct rig {
  fake_t *f;
  rpc_channel_t *ch;
  agent_link_t *l;
  Meshd__Agent__V1__Instruction ins;
} rig_t;

static void rig_open(rig_t *r, fake_mode_t mode) {
  r->f = fake_start(mode);
  r->ch = channel_create(r->f->target, &live_peer);
  r->l = link_open(r->ch, 0, "agent-a", 1);
  cr_assert_not_null(r->l);
  make_ins(&r->ins, "sess", 3);
}

/* Closes the link unless closed already (r->l NULL), then the rest. */
static void rig_close(rig_t *r) {
  link_close(r->l);
  channel_destroy(r->ch);
  fake_free(r->f);
}

/* ---------------------------------------------------------------- ordering */

Test(agent_link, seqs_in_order_and_all_acked) {
  fake_t *f = fake_start(FAKE_ACK);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 0, "agent-a", 1);
  cr_assert_not_null(l);
  cr_assert_eq(agent_link_executed(l), 0);
  cr_assert_eq(agent_link_last_seq(l), 0);

  const uint64_t n = 3000;
  Meshd__Agent__V1__Instruction ins;
  for (uint64_t i = 1; i <= n; i++) {
    make_ins(&ins, "sess-1", 1000 + i);
    ins.seq = 77; /* ignored: the link numbers */
    uint64_t seq = agent_link_send(l, &ins);
    cr_assert_eq(seq, i, "send %llu got seq %llu", (unsigned long long)i, (unsigned long long)seq);
    cr_assert_eq(ins.seq, 77, "the caller's instruction is not touched");
  }
  exec_want_t w = {l, n};
  cr_assert(eventually(executed_reaches, &w, 10000), "executed %llu of %llu",
            (unsigned long long)agent_link_executed(l), (unsigned long long)n);
  cr_assert_eq(fake_get(f, &f->instructions), n);
  cr_assert_not(f->disorder, "the agent saw seqs out of order");
  cr_assert_eq(f->first_seq_of_call, 1);
  for (uint64_t k = 0; k < n; k++)
    cr_assert_eq(f->streams[k], 1000 + k + 1, "seq %llu carries another instruction",
                 (unsigned long long)k + 1);
  cr_assert_str_eq(f->session, "sess-1");
  cr_assert_eq(f->body_case, MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS);

  agent_link_stats_t st;
  settled_stats(l, &st);
  cr_assert_eq(st.last_seq, n);
  cr_assert_eq(st.instructions_sent, n);
  cr_assert_eq(st.queued, 0);
  cr_assert_not(st.broken);
  cr_assert_not(obs.regress, "on_report watermarks go up only");
  cr_assert_eq(obs.last_exec[0], n);
  cr_assert_eq(obs.allocated, 4096);
  cr_assert_eq(atomic_load(&obs.lost), 0);
  link_close(l);
  cr_assert_eq(atomic_load(&obs.lost), 0, "close does not report a loss");
  channel_destroy(ch);
  fake_free(f);
}

Test(agent_link, first_seq_sets_the_base) {
  fake_t *f = fake_start(FAKE_ACK);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 2, "agent-b", 41);
  cr_assert_eq(agent_link_executed(l), 40);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  cr_assert_eq(agent_link_send(l, &ins), 41);
  cr_assert_eq(agent_link_send(l, &ins), 42);
  exec_want_t w = {l, 42};
  cr_assert(eventually(executed_reaches, &w, 5000));
  cr_assert_eq(f->first_seq_of_call, 41);
  link_close(l);
  channel_destroy(ch);
  fake_free(f);
}

/* ---------------------------------------------------------------- batching */

Test(agent_link, many_sends_fewer_batches) {
  fake_t *f = fake_start(FAKE_ACK);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 0, "agent-a", 1);
  const uint64_t n = 10000;
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "sess", 3);
  for (uint64_t i = 1; i <= n; i++) cr_assert_eq(agent_link_send(l, &ins), i);
  exec_want_t w = {l, n};
  cr_assert(eventually(executed_reaches, &w, 10000));
  agent_link_stats_t st;
  settled_stats(l, &st);
  cr_log_info("%llu instructions in %llu batches, largest %zu", (unsigned long long)n,
              (unsigned long long)st.batches_sent, f->max_batch);
  cr_assert_lt(st.batches_sent, n / 4, "%llu batches for %llu instructions",
               (unsigned long long)st.batches_sent, (unsigned long long)n);
  cr_assert_geq(st.batches_sent, n / AGENT_LINK_BATCH_MAX);
  cr_assert_leq(f->max_batch, AGENT_LINK_BATCH_MAX);
  /* One report per batch, never one per instruction. */
  cr_assert_eq(fake_get(f, &f->batches), st.batches_sent);
  cr_assert_eq(fake_get(f, &f->reports), st.batches_sent);
  cr_assert_eq(st.reports, st.batches_sent);
  link_close(l);
  channel_destroy(ch);
  fake_free(f);
}

/* A corked thread's instructions go as one batch, even with a pause between
 * them that an uncorked writer would have used to send the first alone. */
Test(agent_link, corked_sends_go_as_one_batch) {
  /* A minute's hold: only the uncork lets the batch go, however long this
   * thread is off the CPU between its pushes (a loaded CI machine). */
  agent_link_set_hold_ms(60000);
  fake_t *f = fake_start(FAKE_ACK);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 0, "agent-a", 1);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "sess", 3);
  /* Uncorked first: the lone instruction goes at once. */
  cr_assert_eq(agent_link_send(l, &ins), 1);
  exec_want_t w = {l, 1};
  cr_assert(eventually(executed_reaches, &w, 5000));
  agent_link_cork();
  agent_link_cork(); /* nested: only the outer uncork lets go */
  cr_assert_eq(agent_link_send(l, &ins), 2);
  usleep(300); /* well past a writer's wake-up */
  for (uint64_t i = 3; i <= 100; i++) cr_assert_eq(agent_link_send(l, &ins), i);
  agent_link_uncork();
  agent_link_uncork();
  w.want = 100;
  cr_assert(eventually(executed_reaches, &w, 5000));
  agent_link_stats_t st;
  settled_stats(l, &st);
  cr_assert_eq(st.batches_sent, 2, "99 corked instructions took %llu batches (plus the first)",
               (unsigned long long)st.batches_sent - 1);
  cr_assert_eq(f->max_batch, 99);
  link_close(l);
  channel_destroy(ch);
  fake_free(f);
  agent_link_set_hold_ms(20);
}

/* A thread that stays corked (it blocked) delays a link, never stalls it. */
Test(agent_link, a_cork_never_held_back_stalls_nothing) {
  rig_t r;
  rig_open(&r, FAKE_ACK);
  agent_link_cork();
  cr_assert_eq(agent_link_send(r.l, &r.ins), 1);
  exec_want_t w = {r.l, 1};
  cr_assert(eventually(executed_reaches, &w, 2000), "a corked instruction never went");
  agent_link_uncork();
  /* And a link closed while a cork holds it is released safely. */
  agent_link_cork();
  cr_assert_eq(agent_link_send(r.l, &r.ins), 2);
  link_close(r.l);
  r.l = NULL;
  agent_link_uncork();
  rig_close(&r);
}

/* ---------------------------------------------------------------- deferring */

/* What a deferring thread pushes waits in the link, however slowly it comes,
 * until something needs it: agent_link_flush, or any other push. The hold is a
 * minute here and a lone instruction waits too (--link-lone-ms 0), so that
 * only those can have sent it. */
Test(agent_link, deferred_sends_wait_until_flushed_or_joined) {
  agent_link_set_hold_ms(60000);
  agent_link_set_lone_ms(0);
  rig_t r;
  rig_open(&r, FAKE_ACK);
  agent_link_t *l = r.l;
  Meshd__Agent__V1__Instruction ins = r.ins;
  agent_link_defer_begin();
  for (uint64_t i = 1; i <= 10; i++) {
    cr_assert_eq(agent_link_send(l, &ins), i);
    usleep(200); /* an undeferred writer sends each alone */
  }
  agent_link_defer_end();
  usleep(50 * 1000);
  cr_assert_eq(agent_link_executed(l), 0, "deferred instructions went unasked");
  cr_assert_eq(agent_link_queued(l), 10);
  agent_link_flush(l);
  exec_want_t w = {l, 10};
  cr_assert(eventually(executed_reaches, &w, 5000), "a flush did not send the deferred ones");
  /* Deferred ones go with the next undeferred push. */
  agent_link_defer_begin();
  for (int i = 0; i < 5; i++) agent_link_send(l, &ins);
  agent_link_defer_end();
  usleep(20 * 1000);
  cr_assert_eq(agent_link_executed(l), 10);
  cr_assert_eq(agent_link_send(l, &ins), 16);
  w.want = 16;
  cr_assert(eventually(executed_reaches, &w, 5000), "an eager push left deferred ones behind");
  agent_link_stats_t st;
  settled_stats(l, &st);
  cr_assert_eq(st.batches_sent, 2, "16 instructions in %llu batches",
               (unsigned long long)st.batches_sent);
  rig_close(&r);
  agent_link_set_hold_ms(20);
  agent_link_set_lone_ms(1);
}

/* A deferred instruction that nothing joins goes after the lone wait (1 ms),
 * not after the hold (a minute here); instructions that come together keep
 * waiting for the hold or a flush. */
Test(agent_link, a_lone_deferred_instruction_goes_without_waiting_out_the_hold) {
  agent_link_set_hold_ms(60000);
  rig_t r;
  rig_open(&r, FAKE_ACK);
  agent_link_t *l = r.l;
  agent_link_defer_begin();
  cr_assert_eq(agent_link_send(l, &r.ins), 1);
  agent_link_defer_end();
  exec_want_t w = {l, 1};
  cr_assert(eventually(executed_reaches, &w, 5000), "a lone deferred instruction waited");
  /* Several at once are not lone: they wait (the writer may take the first
   * alone if it looked before the second came). */
  agent_link_defer_begin();
  for (int i = 0; i < 20; i++) agent_link_send(l, &r.ins);
  agent_link_defer_end();
  usleep(50 * 1000);
  cr_assert_leq(agent_link_executed(l), 2, "deferred instructions that came together went "
                "before the hold (%llu executed)", (unsigned long long)agent_link_executed(l));
  agent_link_flush(l);
  w.want = 21;
  cr_assert(eventually(executed_reaches, &w, 5000));
  rig_close(&r);
  agent_link_set_hold_ms(20);
}

/* Without a hold (--link-hold-ms 0) nothing waits: each deferred push goes. */
Test(agent_link, no_hold_defers_nothing) {
  agent_link_set_hold_ms(0);
  rig_t r;
  rig_open(&r, FAKE_ACK);
  agent_link_defer_begin();
  agent_link_cork();
  cr_assert_eq(agent_link_send(r.l, &r.ins), 1);
  exec_want_t w = {r.l, 1};
  cr_assert(eventually(executed_reaches, &w, 5000), "a deferred, corked push waited");
  agent_link_uncork();
  agent_link_defer_end();
  rig_close(&r);
  agent_link_set_hold_ms(20);
}

/* ---------------------------------------------------------------- cork until idle */

/* A front server whose handler sends one instruction per message to a link,
 * corked until its completion-queue thread is idle (as a Submit stream of one
 * command per message does). */
typedef struct front {
  agent_link_t *link;
  atomic_int messages;
} front_t;

static void front_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  front_t *fr = arg;
  if (!msg) {
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "bye");
    return;
  }
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "sess", 3);
  agent_link_cork_until_idle();
  agent_link_send(fr->link, &ins);
  usleep(100); /* time enough for an uncorked writer to send it alone */
  atomic_fetch_add(&fr->messages, 1);
}

static void front_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  (void)call, (void)req, (void)arg;
}

static const rpc_method_t front_row = {
    .path = "/test.Front/Stream",
    .kind = RPC_BIDI,
    .request = &meshd__agent__v1__instruction_batch__descriptor,
    .on_start = front_start,
    .on_message = front_message,
};

static bool front_done(void *arg) { return atomic_load(&((front_t *)arg)->messages) == 50; }

Test(agent_link, messages_back_to_back_go_as_few_batches) {
  agent_link_set_hold_ms(60000); /* only idleness lets a batch go */
  fake_t *f = fake_start(FAKE_ACK);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  /* Static: the front's threads use it, and may still after a failed assertion left
   * this frame (until teardown ends them). */
  static front_t fr;
  fr = (front_t){.link = link_open(ch, 0, "agent-a", 1)};
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 1,
                         .before_wait = agent_link_uncork_idle};
  char err[256], target[64];
  rpc_server_t *srv = keep(LEFT_SERVER, rpc_server_create(&o, err, sizeof err));
  cr_assert_not_null(srv, "%s", err);
  cr_assert_eq(rpc_server_add_methods(srv, &front_row, 1, &fr), 0);
  int port = rpc_server_start(srv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  snprintf(target, sizeof target, "127.0.0.1:%d", port);
  rpc_channel_t *fch = channel_create(target, &live_peer);
  rpc_stream_t *st = keep(LEFT_STREAM, rpc_stream_open(fch, front_row.path, NULL, 0, 0));
  cr_assert_not_null(st);
  Meshd__Agent__V1__InstructionBatch empty = MESHD__AGENT__V1__INSTRUCTION_BATCH__INIT;
  for (int i = 0; i < 50; i++) {
    if (rpc_stream_write(st, &empty.base, false) == 0) continue;
    rpc_status_t why = {0};
    rpc_stream_finish(st, &why);
    cr_assert_fail("write %d: the front ended the call: %s", i, why.message);
  }
  cr_assert(eventually(front_done, &fr, 10000), "the front took %d of 50 messages",
            atomic_load(&fr.messages));
  exec_want_t w = {fr.link, 50};
  cr_assert(eventually(executed_reaches, &w, 5000), "the agent got %llu of 50",
            (unsigned long long)agent_link_executed(fr.link));
  agent_link_stats_t ls;
  settled_stats(fr.link, &ls);
  cr_log_info("50 messages, %llu batches", (unsigned long long)ls.batches_sent);
  cr_assert_leq(ls.batches_sent, 25, "50 messages back to back took %llu batches",
                (unsigned long long)ls.batches_sent);
  rpc_stream_cancel(st);
  stream_destroy(st);
  channel_destroy(fch);
  server_destroy(srv); /* its thread lets its cork go as it ends */
  link_close(fr.link);
  channel_destroy(ch);
  fake_free(f);
  agent_link_set_hold_ms(20);
}

Test(agent_link, batches_stay_under_the_byte_limit) {
  fake_t *f = fake_start(FAKE_ACK);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 0, "agent-a", 1);
  /* 100 KiB session ids: ten fit in a batch. */
  size_t big = 100 * 1024;
  char *sid = malloc(big + 1);
  memset(sid, 'x', big);
  sid[big] = '\0';
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, sid, 0);
  for (int i = 1; i <= 60; i++) cr_assert_eq(agent_link_send(l, &ins), (uint64_t)i);
  exec_want_t w = {l, 60};
  cr_assert(eventually(executed_reaches, &w, 10000));
  cr_assert_leq(f->max_batch_bytes, AGENT_LINK_BATCH_BYTES + big + 64, "batch of %zu bytes",
                f->max_batch_bytes);
  cr_assert_geq(fake_get(f, &f->batches), 6);

  /* One instruction over the limit is refused and does not use a seq. */
  char *huge = malloc(AGENT_LINK_MAX_INSTRUCTION + 2);
  memset(huge, 'y', AGENT_LINK_MAX_INSTRUCTION + 1);
  huge[AGENT_LINK_MAX_INSTRUCTION + 1] = '\0';
  make_ins(&ins, huge, 0);
  cr_assert_eq(agent_link_send(l, &ins), 0);
  make_ins(&ins, "small", 0);
  cr_assert_eq(agent_link_send(l, &ins), 61);
  link_close(l);
  free(huge);
  free(sid);
  channel_destroy(ch);
  fake_free(f);
}

/* ---------------------------------------------------------------- failure */

Test(agent_link, agent_dies_mid_stream) {
  fake_t *f = fake_start(FAKE_DIE_AFTER);
  f->die_after = 10;
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 3, "agent-d", 1);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  for (int i = 1; i <= 10; i++) cr_assert_eq(agent_link_send(l, &ins), (uint64_t)i);
  cr_assert(eventually(link_broken, l, 5000), "the link did not notice the agent's end");
  cr_assert(eventually(lost_seen, NULL, 1000));
  /* More sends are refused; queued work is dropped. */
  cr_assert_eq(agent_link_send(l, &ins), 0);
  cr_assert_eq(agent_link_queued(l), 0);
  cr_assert_eq(agent_link_executed(l), 10);
  cr_assert_eq(agent_link_last_seq(l), 10);
  usleep(100 * 1000);
  cr_assert_eq(atomic_load(&obs.lost), 1, "on_lost runs once");
  cr_assert_eq(obs.lost_rank, 3);
  link_close(l);
  cr_assert_eq(atomic_load(&obs.lost), 1);
  channel_destroy(ch);
  fake_free(f);
}

Test(agent_link, agent_process_gone) {
  fake_t *f = fake_start(FAKE_SILENT);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 1, "agent-e", 1);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  for (int i = 0; i < 100; i++) agent_link_send(l, &ins);
  usleep(50 * 1000);
  fake_kill(f);
  cr_assert(eventually(lost_seen, NULL, 5000));
  cr_assert(agent_link_broken(l));
  cr_assert_eq(agent_link_executed(l), 0);
  usleep(100 * 1000);
  cr_assert_eq(atomic_load(&obs.lost), 1);
  link_close(l);
  channel_destroy(ch);
  fake_free(f);
}

Test(agent_link, agent_claims_unsent_seqs) {
  fake_t *f = fake_start(FAKE_LIE);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 0, "agent-f", 1);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  agent_link_send(l, &ins);
  cr_assert(eventually(lost_seen, NULL, 5000));
  cr_assert_eq(agent_link_executed(l), 0, "a lie does not move the watermark");
  link_close(l);
  channel_destroy(ch);
  fake_free(f);
}

Test(agent_link, no_agent_listening) {
  fake_t *f = fake_start(FAKE_ACK);
  char target[64];
  snprintf(target, sizeof target, "%s", f->target);
  fake_free(f); /* nothing listens on that port any more */
  rpc_channel_t *ch = channel_create(target, NULL);
  agent_link_t *l = link_open(ch, 0, "agent-g", 1);
  cr_assert_not_null(l);
  cr_assert(eventually(lost_seen, NULL, 5000));
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  cr_assert_eq(agent_link_send(l, &ins), 0);
  link_close(l);
  channel_destroy(ch);
}

/* ---------------------------------------------------------------- close */

static void assert_prompt_close(fake_mode_t mode, size_t n, size_t bytes_each) {
  fake_t *f = fake_start(mode);
  rpc_channel_t *ch = channel_create(f->target, &live_peer);
  agent_link_t *l = link_open(ch, 0, "agent-h", 1);
  char *sid = malloc(bytes_each + 1);
  memset(sid, 's', bytes_each);
  sid[bytes_each] = '\0';
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, sid, 0);
  for (size_t i = 0; i < n; i++) cr_assert_neq(agent_link_send(l, &ins), 0);
  usleep(200 * 1000); /* let the writer fill the flow-control window */
  agent_link_stats_t st;
  agent_link_stats(l, &st);
  cr_log_info("before close: %zu queued, %llu batches sent", st.queued,
              (unsigned long long)st.batches_sent);
  int64_t t0 = rpc_now_ms();
  link_close(l);
  int64_t took = rpc_now_ms() - t0;
  cr_assert_lt(took, 1000, "close took %lld ms", (long long)took);
  cr_assert_eq(atomic_load(&obs.lost), 0);
  free(sid);
  channel_destroy(ch);
  fake_free(f);
}

Test(agent_link, close_is_prompt_with_a_silent_agent) {
  assert_prompt_close(FAKE_SILENT, 5000, 16);
}

Test(agent_link, close_is_prompt_with_a_writer_blocked_on_flow_control) {
  /* 40 MiB towards an agent that stopped reading: the writer is stuck in a write. */
  assert_prompt_close(FAKE_STUCK, 400, 100 * 1024);
}

/* ---------------------------------------------------------------- pool */

typedef struct fire {
  atomic_int calls;
  watermark_result_t result;
  uint32_t lost_rank;
} fire_t;

static void on_fire(watermark_result_t result, uint32_t lost_rank, void *arg) {
  fire_t *f = arg;
  f->result = result;
  f->lost_rank = lost_rank;
  atomic_fetch_add(&f->calls, 1);
}

static bool fired(void *arg) { return atomic_load(&((fire_t *)arg)->calls) > 0; }

static atomic_int healthy_now;
static void pool_changed(int healthy, void *arg) { atomic_store(&healthy_now, healthy); }

static agent_pool_t *make_pool(void) {
  agent_pool_callbacks_t cb = {pool_changed, on_report, on_pool_lost, &obs};
  return pool_create(&cb);
}

/* Adds registration `registration` (0: none) of agent id at rank, at fake f's address. */
static void add_registration(agent_pool_t *p, int rank, const char *id, uint64_t registration,
                             fake_t *f) {
  agent_desc_t d = {.registration = registration};
  snprintf(d.agent_id, sizeof d.agent_id, "%s", id);
  snprintf(d.address, sizeof d.address, "%s", f->target);
  snprintf(d.device, sizeof d.device, "cpu");
  char err[256];
  cr_assert_eq(agent_pool_add(p, &d, rank, err, sizeof err), rank, "%s", err);
}

/* Admits an agent at rank and connects it to fake f as the registry would. */
static void admit(agent_pool_t *p, int rank, const char *id, fake_t *f) {
  add_registration(p, rank, id, 0, f);
  agent_pool_set_channel(p, (uint32_t)rank, id, 0, rpc_channel_create(f->target, &live_peer));
  agent_pool_set_healthy(p, (uint32_t)rank, id, 0, true);
}

/* rank's allocated bytes as the pool lists them (ListAgents). */
static uint64_t pool_allocated(agent_pool_t *p, uint32_t rank) {
  Meshd__V1__AgentInfo **infos = NULL;
  size_t n = 0;
  cr_assert_eq(agent_pool_snapshot(p, &infos, &n), 0);
  uint64_t bytes = UINT64_MAX;
  for (size_t i = 0; i < n; i++)
    if (infos[i]->rank == rank) bytes = infos[i]->allocated_bytes;
  agent_pool_snapshot_free(infos, n);
  cr_assert_neq(bytes, UINT64_MAX, "no agent at rank %u", rank);
  return bytes;
}

typedef struct { agent_pool_t *p; uint32_t rank; uint64_t want; } pool_want_t;
static bool pool_reaches(void *arg) {
  pool_want_t *w = arg;
  return agent_pool_executed(w->p, w->rank) >= w->want;
}

Test(agent_link, pool_send_and_wait) {
  fake_t *a = fake_start(FAKE_ACK), *b = fake_start(FAKE_ACK);
  agent_pool_t *p = make_pool();
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  uint64_t seq = 123;
  cr_assert_eq(agent_pool_send(p, 0, &ins, &seq), -1, "no agent at rank 0 yet");
  cr_assert_eq(seq, 0);
  admit(p, 0, "agent-0", a);
  admit(p, 1, "agent-1", b);
  cr_assert_eq(atomic_load(&healthy_now), 2);

  uint64_t last0 = 0, last1 = 0;
  for (int i = 0; i < 500; i++) {
    cr_assert_eq(agent_pool_send(p, 0, &ins, &last0), 0);
    cr_assert_eq(agent_pool_send(p, 1, &ins, &last1), 0);
  }
  cr_assert_eq(agent_pool_send(p, 1, &ins, NULL), 0);
  last1++;
  cr_assert_eq(last0, 500);
  cr_assert_eq(last1, 501);

  fire_t fw = {0};
  watermark_target_t t[] = {{0, last0}, {1, last1}};
  watermark_result_t r = watermark_wait(agent_pool_watermark(p), t, 2, on_fire, &fw, NULL, NULL);
  if (r == WATERMARK_PENDING) {
    cr_assert(eventually(fired, &fw, 10000));
    r = fw.result;
  }
  cr_assert_eq(r, WATERMARK_REACHED);
  cr_assert_geq(agent_pool_executed(p, 0), last0);
  cr_assert_geq(agent_pool_executed(p, 1), last1);
  cr_assert_eq(agent_pool_queued(p, 0), 0);
  /* Already through: answered at once, no callback. */
  fire_t again = {0};
  cr_assert_eq(watermark_wait(agent_pool_watermark(p), t, 2, on_fire, &again, NULL, NULL),
               WATERMARK_REACHED);
  cr_assert_eq(atomic_load(&again.calls), 0);
  pool_destroy(p);
  cr_assert_eq(atomic_load(&obs.lost), 0, "destroy is not a loss");
  fake_free(a);
  fake_free(b);
}

/* An agent's reports carry its clock (AgentReport.unix_ms): the offset its
 * transfer grants are written with (agent_pool_target) follows it, early by
 * at most the report's way here, never late; an agent whose reports carry
 * none (an older one) keeps 0, the server's times. */
Test(agent_link, reports_stamped_with_the_agents_clock_set_its_grants_offset) {
  fake_t *a = fake_start(FAKE_ACK), *b = fake_start(FAKE_ACK);
  a->clock_ahead_ms = 90000;
  agent_pool_t *p = make_pool();
  admit(p, 0, "agent-0", a);
  admit(p, 1, "agent-1", b);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  for (uint32_t rank = 0; rank < 2; rank++) {
    uint64_t seq = 0;
    cr_assert_eq(agent_pool_send(p, rank, &ins, &seq), 0);
    pool_want_t w = {p, rank, seq};
    cr_assert(eventually(pool_reaches, &w, 10000), "rank %u never reported", rank);
  }
  agent_target_t t;
  cr_assert_eq(agent_pool_target(p, 0, 1000, &t), 0);
  cr_assert(t.clock_offset_ms <= 90000 && t.clock_offset_ms > 80000, "offset %lld",
            (long long)t.clock_offset_ms);
  cr_assert_eq(agent_pool_target(p, 1, 1000, &t), 0);
  cr_assert_eq(t.clock_offset_ms, 0);
  pool_destroy(p);
  fake_free(a);
  fake_free(b);
}

/* agent_pool_set_channel opens an agent's Execute link outside the pool's
 * lock (it may take a round trip); the agent can leave and register again
 * (same id, same rank) before the pool takes the lock again and finds the
 * link stale. A test runs then: after_open(rank, after_open_arg), once, on
 * the thread that opened the link, with the link open. agent_link_open is
 * wrapped for this suite (-Wl,--wrap, tests/unit/CMakeLists.txt); unarmed,
 * the wrapper only opens the link. */
agent_link_t *__real_agent_link_open(rpc_channel_t *ch, uint32_t rank, const char *agent_id,
                                     uint64_t first_seq, const char *call_secret,
                                     const agent_link_callbacks_t *cb);
agent_link_t *__wrap_agent_link_open(rpc_channel_t *ch, uint32_t rank, const char *agent_id,
                                     uint64_t first_seq, const char *call_secret,
                                     const agent_link_callbacks_t *cb);
static void (*after_open)(uint32_t rank, void *arg);
static void *after_open_arg;

agent_link_t *__wrap_agent_link_open(rpc_channel_t *ch, uint32_t rank, const char *agent_id,
                                     uint64_t first_seq, const char *call_secret,
                                     const agent_link_callbacks_t *cb) {
  agent_link_t *l = __real_agent_link_open(ch, rank, agent_id, first_seq, call_secret, cb);
  void (*fn)(uint32_t, void *) = after_open;
  after_open = NULL;
  if (fn && l) fn(rank, after_open_arg);
  return l;
}

static bool reported(void *arg) { return atomic_load(&((observer_t *)arg)->reports) > 0; }

typedef struct {
  agent_pool_t *p;
  fake_t *old, *now;
} reregister_t;

/* Registration 1 of agent-0 leaves and registration 2 takes rank 0, with
 * 1000 bytes allocated; then registration 1's agent, its link open by now,
 * reports (the pool's on_report runs after the pool took the report's figures). */
static void reregister_then_report(uint32_t rank, void *arg) {
  reregister_t *rr = arg;
  agent_pool_remove(rr->p, rank, "agent-0", 1, "registration ended");
  add_registration(rr->p, (int)rank, "agent-0", 2, rr->now);
  agent_pool_set_allocated(rr->p, rank, "agent-0", 2, 1000);
  pthread_mutex_lock(&rr->old->mu);
  rr->old->release = true;
  pthread_cond_broadcast(&rr->old->cv);
  pthread_mutex_unlock(&rr->old->mu);
  cr_assert(eventually(reported, &obs, 10000), "registration 1's link never reported");
}

/* A late report of an earlier registration's link (4096 bytes allocated, a
 * clock 90 s ahead) sets neither the new registration's allocated bytes
 * (ListAgents) nor the clock offset its grants are written with. */
Test(agent_link, stale_registrations_link_report_leaves_the_new_ones_figures) {
  fake_t *old = fake_start(FAKE_ACK), *now = fake_start(FAKE_ACK);
  old->clock_ahead_ms = 90000;
  old->report_at_start = true;
  agent_pool_t *p = make_pool();
  add_registration(p, 0, "agent-0", 1, old);
  reregister_t rr = {p, old, now};
  after_open_arg = &rr;
  after_open = reregister_then_report;
  agent_pool_set_channel(p, 0, "agent-0", 1, rpc_channel_create(old->target, &live_peer));
  cr_assert_null(after_open, "registration 1's link was never opened");
  cr_assert_eq(pool_allocated(p, 0), 1000, "registration 2's allocated bytes were overwritten "
               "by registration 1's link");
  agent_target_t t;
  cr_assert_eq(agent_pool_target(p, 0, 1000, &t), 0);
  cr_assert_eq(t.clock_offset_ms, 0, "registration 1's clock set registration 2's offset: %lld",
               (long long)t.clock_offset_ms);
  /* Registration 1's link, dropped unused, carried nothing: no loss on the rank
   * that registration 2 holds now (its meshes would read it as lost). */
  cr_assert_eq(atomic_load(&obs.lost), 0, "a loss was reported on registration 2's rank");
  pool_destroy(p);
  fake_free(old);
  fake_free(now);
}

/* An AgentStatus still coming on an earlier registration's call (registry.c)
 * names that registration: it sets only that one's allocated bytes. */
Test(agent_link, allocated_bytes_set_only_for_the_registration_named) {
  fake_t *f = fake_start(FAKE_ACK);
  agent_pool_t *p = make_pool();
  add_registration(p, 0, "agent-0", 1, f);
  agent_pool_set_allocated(p, 0, "agent-0", 1, 100);
  cr_assert_eq(pool_allocated(p, 0), 100);
  agent_pool_remove(p, 0, "agent-0", 1, "registration ended");
  add_registration(p, 0, "agent-0", 2, f);
  agent_pool_set_allocated(p, 0, "agent-0", 1, 200);
  cr_assert_eq(pool_allocated(p, 0), 0, "registration 1's status set registration 2's bytes");
  agent_pool_set_allocated(p, 0, "agent-0", 2, 300);
  cr_assert_eq(pool_allocated(p, 0), 300);
  pool_destroy(p);
  fake_free(f);
}

/* A wait on a rank's progress sends what its link defers (watermark_set_kick):
 * with a minute's hold and no lone wait, nothing else would. */
Test(agent_link, pool_wait_sends_deferred_work) {
  agent_link_set_hold_ms(60000);
  agent_link_set_lone_ms(0);
  fake_t *a = fake_start(FAKE_ACK), *b = fake_start(FAKE_ACK);
  agent_pool_t *p = make_pool();
  admit(p, 0, "agent-0", a);
  admit(p, 1, "agent-1", b);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  uint64_t last0 = 0, last1 = 0;
  agent_link_defer_begin();
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(agent_pool_send(p, 0, &ins, &last0), 0);
    cr_assert_eq(agent_pool_send(p, 1, &ins, &last1), 0);
  }
  agent_link_defer_end();
  usleep(20 * 1000);
  cr_assert_eq(agent_pool_queued(p, 0), 3);
  cr_assert_eq(agent_pool_queued(p, 1), 3);
  /* A wait on rank 0 sends rank 0's, and only those. */
  fire_t fw = {0};
  watermark_target_t t = {0, last0};
  cr_assert_eq(watermark_wait(agent_pool_watermark(p), &t, 1, on_fire, &fw, NULL, NULL),
               WATERMARK_PENDING);
  cr_assert(eventually(fired, &fw, 5000), "a wait left rank 0's deferred work in its link");
  cr_assert_eq(fw.result, WATERMARK_REACHED);
  cr_assert_eq(agent_pool_queued(p, 1), 3);
  fire_t f1 = {0};
  t = (watermark_target_t){1, last1};
  cr_assert_eq(watermark_wait(agent_pool_watermark(p), &t, 1, on_fire, &f1, NULL, NULL),
               WATERMARK_PENDING);
  cr_assert(eventually(fired, &f1, 5000));
  pool_destroy(p);
  fake_free(a);
  fake_free(b);
  agent_link_set_hold_ms(20);
  agent_link_set_lone_ms(1);
}

Test(agent_link, pool_lost_agent_fails_waits) {
  fake_t *a = fake_start(FAKE_DIE_AFTER);
  a->die_after = 20;
  fake_t *b = fake_start(FAKE_SILENT);
  agent_pool_t *p = make_pool();
  admit(p, 0, "agent-0", a);
  admit(p, 1, "agent-1", b);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);

  /* Waits on rank 0's seqs 10 and 30 (with silent rank 1): rank 0 dies at 20.
   * The loss may come before or after a wait registers: either way it ends
   * the same. */
  fire_t early = {0}, mixed = {0};
  uint64_t seq;
  /* Corked: all 40 are queued before rank 0 runs any (it could die at 20 while
   * the loop still sends, on a loaded machine: CI run 144). */
  agent_link_cork();
  for (int i = 0; i < 40; i++) cr_assert_eq(agent_pool_send(p, 0, &ins, &seq), 0);
  cr_assert_eq(agent_pool_send(p, 1, &ins, &seq), 0);
  agent_link_uncork();
  watermark_target_t t_early[] = {{0, 10}};
  watermark_result_t r =
      watermark_wait(agent_pool_watermark(p), t_early, 1, on_fire, &early, NULL, NULL);
  watermark_target_t t_mixed[] = {{1, 1}, {0, 30}};
  uint32_t lost_now = 99;
  watermark_result_t m =
      watermark_wait(agent_pool_watermark(p), t_mixed, 2, on_fire, &mixed, NULL, &lost_now);
  if (m == WATERMARK_PENDING) {
    cr_assert(eventually(fired, &mixed, 5000));
    m = mixed.result;
    lost_now = mixed.lost_rank;
  }
  cr_assert_eq(m, WATERMARK_LOST);
  cr_assert_eq(lost_now, 0);
  if (r == WATERMARK_PENDING) {
    cr_assert(eventually(fired, &early, 1000));
    r = early.result;
  }
  cr_assert_eq(r, WATERMARK_REACHED, "seqs executed before the loss still count");
  cr_assert_eq(atomic_load(&obs.lost), 1);
  cr_assert_eq(obs.lost_rank, 0);

  /* The rank is now unusable and unhealthy; waits on its lost seqs fail at once. */
  cr_assert_eq(agent_pool_send(p, 0, &ins, &seq), -1);
  cr_assert_eq(atomic_load(&healthy_now), 1);
  uint32_t lost_rank = 99;
  watermark_target_t t_late[] = {{0, 25}};
  cr_assert_eq(watermark_wait(agent_pool_watermark(p), t_late, 1, on_fire, &early, NULL,
                              &lost_rank), WATERMARK_LOST);
  cr_assert_eq(lost_rank, 0);
  cr_assert_eq(agent_pool_executed(p, 0), 20);

  /* The agent leaves (its registration ends): no second on_lost. */
  agent_pool_remove(p, 0, "agent-0", 0, "test");
  cr_assert_eq(atomic_load(&obs.lost), 1);
  pool_destroy(p);
  fake_free(a);
  fake_free(b);
}

Test(agent_link, pool_replaced_agent_continues_seqs) {
  fake_t *a = fake_start(FAKE_SILENT), *b = fake_start(FAKE_ACK);
  agent_pool_t *p = make_pool();
  admit(p, 0, "agent-old", a);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  uint64_t seq = 0;
  for (int i = 0; i < 7; i++) agent_pool_send(p, 0, &ins, &seq);
  cr_assert_eq(seq, 7);
  fire_t f = {0};
  watermark_target_t t[] = {{0, 7}};
  cr_assert_eq(watermark_wait(agent_pool_watermark(p), t, 1, on_fire, &f, NULL, NULL),
               WATERMARK_PENDING);

  /* The old agent leaves with its link healthy but nothing executed. */
  agent_pool_remove(p, 0, "agent-old", 0, "registration ended");
  cr_assert_eq(atomic_load(&obs.lost), 1, "leaving counts as a loss");
  cr_assert(eventually(fired, &f, 1000));
  cr_assert_eq(f.result, WATERMARK_LOST);
  cr_assert_eq(agent_pool_send(p, 0, &ins, &seq), -1);

  /* A new agent at rank 0 continues the numbering. */
  admit(p, 0, "agent-new", b);
  cr_assert_eq(agent_pool_send(p, 0, &ins, &seq), 0);
  cr_assert_eq(seq, 8);
  pool_want_t w = {p, 0, 8};
  cr_assert(eventually(pool_reaches, &w, 5000));
  cr_assert_eq(b->first_seq_of_call, 8);
  fire_t g = {0};
  cr_assert_eq(watermark_wait(agent_pool_watermark(p), t, 1, on_fire, &g, NULL, NULL),
               WATERMARK_LOST, "seq 7 was on the old agent and stays lost");
  pool_destroy(p);
  fake_free(a);
  fake_free(b);
}

Test(agent_link, pool_destroy_cancels_waits) {
  fake_t *a = fake_start(FAKE_SILENT);
  agent_pool_t *p = make_pool();
  admit(p, 0, "agent-0", a);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);
  uint64_t seq;
  agent_pool_send(p, 0, &ins, &seq);
  fire_t f = {0};
  watermark_target_t t[] = {{0, seq}};
  cr_assert_eq(watermark_wait(agent_pool_watermark(p), t, 1, on_fire, &f, NULL, NULL),
               WATERMARK_PENDING);
  int64_t t0 = rpc_now_ms();
  pool_destroy(p);
  cr_assert_lt(rpc_now_ms() - t0, 1000);
  cr_assert_eq(atomic_load(&f.calls), 1);
  cr_assert_eq(f.result, WATERMARK_CANCELLED);
  fake_free(a);
}

/* ------------------------------------------------- a report as the agent leaves */

/* The pool's on_report, which can hold the rpc layer's client thread (which
 * carries every link's reports) inside rank blk.rank's report. */
static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t rank;
  bool armed, blocked, release;
} blk = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, false, false, false};

static void release_blocked_report(void) {
  pthread_mutex_lock(&blk.mu);
  blk.armed = false;
  blk.release = true;
  pthread_cond_broadcast(&blk.cv);
  pthread_mutex_unlock(&blk.mu);
}

static void on_report_blocking(uint32_t rank, const agent_link_report_t *r, void *arg) {
  (void)r;
  (void)arg;
  pthread_mutex_lock(&blk.mu);
  if (blk.armed && rank == blk.rank) {
    blk.armed = false;
    blk.blocked = true;
    pthread_cond_broadcast(&blk.cv);
    while (!blk.release) pthread_cond_wait(&blk.cv, &blk.mu);
  }
  pthread_mutex_unlock(&blk.mu);
}

static void *remove_rank0(void *p) {
  agent_pool_remove(p, 0, "agent-0", 0, "registration ended");
  return NULL;
}

/* Rank 0's agent ran seq S and its report is on its way when its registration
 * ends (agent_pool_remove stops the link): the report is taken after the stop.
 * A wait on S must still end (REACHED: it ran; or LOST), whether or not a new
 * agent ever comes to rank 0. The client thread is held in rank 1's report so
 * that rank 0's report arrives while the link stops, every time. */
Test(agent_link, pool_report_taken_as_the_agent_leaves_still_ends_waits) {
  fake_t *a = fake_start(FAKE_ACK), *b = fake_start(FAKE_ACK);
  agent_pool_callbacks_t cb = {pool_changed, on_report_blocking, on_pool_lost, &obs};
  agent_pool_t *p = pool_create(&cb);
  admit(p, 0, "agent-0", a);
  admit(p, 1, "agent-1", b);
  Meshd__Agent__V1__Instruction ins;
  make_ins(&ins, "s", 0);

  /* Rank 1's report holds the client thread. */
  pthread_mutex_lock(&blk.mu);
  blk.rank = 1;
  blk.armed = true;
  blk.blocked = blk.release = false;
  pthread_mutex_unlock(&blk.mu);
  uint64_t seq1 = 0, seq0 = 0;
  cr_assert_eq(agent_pool_send(p, 1, &ins, &seq1), 0);
  pthread_mutex_lock(&blk.mu);
  while (!blk.blocked) pthread_cond_wait(&blk.cv, &blk.mu);
  pthread_mutex_unlock(&blk.mu);

  /* Rank 0 runs seq0 and reports it; the report waits behind rank 1's. */
  cr_assert_eq(agent_pool_send(p, 0, &ins, &seq0), 0);
  fire_t f = {0};
  watermark_target_t t = {0, seq0};
  cr_assert_eq(watermark_wait(agent_pool_watermark(p), &t, 1, on_fire, &f, NULL, NULL),
               WATERMARK_PENDING);
  int64_t end = rpc_now_ms() + 5000;
  while (fake_get(a, &a->reports) < 1 && rpc_now_ms() < end) usleep(1000);
  cr_assert_geq(fake_get(a, &a->reports), 1, "the fake agent never ran seq %llu",
                (unsigned long long)seq0);
  usleep(200 * 1000); /* its report reaches this process */

  /* The agent leaves: the pool stops its link, then waits for its reader. */
  pthread_t remover;
  cr_assert_eq(pthread_create(&remover, NULL, remove_rank0, p), 0);
  usleep(200 * 1000);
  pthread_mutex_lock(&blk.mu);
  blk.release = true;
  pthread_cond_broadcast(&blk.cv);
  pthread_mutex_unlock(&blk.mu);
  pthread_join(remover, NULL);

  cr_assert(eventually(fired, &f, 5000),
            "a wait on seq %llu of a rank whose agent left never ended (the pool's watermark "
            "executed %llu, lost ranges %zu)",
            (unsigned long long)seq0, (unsigned long long)agent_pool_executed(p, 0),
            watermark_lost_ranges(agent_pool_watermark(p), 0));
  cr_assert(f.result == WATERMARK_REACHED || f.result == WATERMARK_LOST);
  pool_destroy(p);
  fake_free(a);
  fake_free(b);
}
