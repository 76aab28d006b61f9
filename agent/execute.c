#include "execute.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

#include "agent.h"
#include "grant.h"
#include "log.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "validate.h"

typedef struct session {
  char *id;
  uint64_t instructions;
  UT_hash_handle hh;
} session_t;

/* One Execute call's state. Owned by the call: made in execute_start, freed in
 * execute_end. Its callbacks never run concurrently; `mu` guards what other
 * calls and execute_sessions() read. */
typedef struct exec_call {
  rpc_call_t *call;
  char *peer;
  uint64_t last_seq; /* 0: nothing taken yet */
  session_t *sessions;
  uint64_t batches, instructions;
  bool failed;
  bool clock; /* its reports carry our clock (agent_info_t.clock) */
  executor_t *ex;
  /* A refused stream ends once everything before the bad seq ran (mu). */
  bool finishing, finished;
  uint64_t finish_after;
  char why[300];
} exec_call_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static exec_call_t *current; /* holds a reference on current->call */

static void free_sessions(exec_call_t *x) {
  session_t *s, *tmp;
  HASH_ITER(hh, x->sessions, s, tmp) {
    HASH_DEL(x->sessions, s);
    free(s->id);
    free(s);
  }
}

/* The executor's reporter thread: one AgentReport, then the end of a refused call. */
static void report(const executor_report_t *r, void *arg) {
  exec_call_t *x = arg;
  pthread_mutex_lock(&mu);
  bool finished = x->finished;
  pthread_mutex_unlock(&mu);
  if (finished) return;
  Meshd__Agent__V1__AgentReport rep = MESHD__AGENT__V1__AGENT_REPORT__INIT;
  rep.executed_through = r->executed_through;
  rep.received_through = r->received_through;
  rep.sessions = r->sessions;
  rep.n_sessions = r->n_sessions;
  rep.errors = r->errors;
  rep.n_errors = r->n_errors;
  rep.allocated_bytes = r->allocated_bytes;
  if (x->clock) rep.unix_ms = grant_now_unix_ms(); /* the server's estimate of our clock */
  rpc_call_send(x->call, &rep.base);
  pthread_mutex_lock(&mu);
  bool finish = x->finishing && !x->finished && r->executed_through >= x->finish_after;
  if (finish) x->finished = true;
  pthread_mutex_unlock(&mu);
  if (finish) rpc_call_finish(x->call, GRPC_STATUS_INVALID_ARGUMENT, NULL, "%s", x->why);
}

void execute_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  const agent_info_t *self = arg;
  exec_call_t *x = calloc(1, sizeof *x);
  if (x && !(x->ex = executor_create(&self->env, report, x))) {
    free(x);
    x = NULL;
  }
  if (!x) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "agent out of memory");
    return;
  }
  x->call = call;
  x->clock = self->clock;
  x->peer = rpc_call_peer(call);
  rpc_call_set_data(call, x);
  rpc_call_ref(call);
  pthread_mutex_lock(&mu);
  rpc_call_t *old = current ? current->call : NULL; /* its reference passes to us */
  if (old)
    log_warn("execute", "agent %s: Execute call from %s replaces the one from %s", self->id,
             x->peer ? x->peer : "?", current->peer ? current->peer : "?");
  else
    log_info("execute", "agent %s: Execute call from %s open", self->id, x->peer ? x->peer : "?");
  current = x;
  pthread_mutex_unlock(&mu);
  if (old) {
    rpc_call_finish(old, GRPC_STATUS_ABORTED, NULL,
                    "replaced by a newer Execute call to agent %s: one server drives an agent",
                    self->id);
    rpc_call_unref(old);
  }
}

/* The largest seq taken: past it, counters of "done through seq + 1" would
 * wrap. */
#define EXECUTE_SEQ_MAX ((uint64_t)INT64_MAX)

/* Checks one instruction against the call; fills why and returns false if the
 * stream is broken. Holds mu. */
static bool check_locked(const exec_call_t *x, const Meshd__Agent__V1__Instruction *ins, char *why,
                         size_t len) {
  if (ins->seq == 0) {
    snprintf(why, len, "instruction seq 0: seqs start at 1");
    return false;
  }
  if (ins->seq > EXECUTE_SEQ_MAX) { /* the progress counters count one past a seq */
    snprintf(why, len,
             "instruction seq %" PRIu64 " is past 2^63 (no server numbers that far: its "
             "instruction stream is corrupt)",
             ins->seq);
    return false;
  }
  if (x->last_seq != 0 && ins->seq != x->last_seq + 1) {
    snprintf(why, len,
             "instruction seq %" PRIu64 " after seq %" PRIu64 ": expected %" PRIu64
             " (a %s; the server's instruction stream is out of order)",
             ins->seq, x->last_seq, x->last_seq + 1, ins->seq <= x->last_seq ? "repeat" : "gap");
    return false;
  }
  return validate_envelope(ins, why, len) == 0;
}

/* Records what later execution needs: which sessions are open; and acts on
 * a RevokeGrants at once. */
static void take_locked(exec_call_t *x, const Meshd__Agent__V1__Instruction *ins) {
  x->last_seq = ins->seq;
  x->instructions++;
  if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_REVOKE_GRANTS) {
    /* Now, not in its turn: a Read or Write must not get in while what was
     * queued before it runs. It opens no session (the executor passes it). */
    transfer_grants_revoke(ins);
    return;
  }
  session_t *s = NULL;
  HASH_FIND_STR(x->sessions, ins->session_id, s);
  if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION) {
    if (s) {
      HASH_DEL(x->sessions, s);
      free(s->id);
      free(s);
    }
    return;
  }
  if (!s) {
    s = calloc(1, sizeof *s);
    char *id = strdup(ins->session_id);
    if (!s || !id) { /* the ack still goes out: execution will report the failure */
      free(s);
      free(id);
      return;
    }
    s->id = id;
    HASH_ADD_KEYPTR(hh, x->sessions, s->id, strlen(s->id), s);
  }
  s->instructions++;
}

void execute_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  const agent_info_t *self = arg;
  exec_call_t *x = rpc_call_data(call);
  if (!x || x->failed) return;
  if (!msg) { /* the server is done with this agent */
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "done");
    return;
  }
  const Meshd__Agent__V1__InstructionBatch *b = (const void *)msg;
  char why[300] = "";
  size_t taken = 0;
  pthread_mutex_lock(&mu);
  x->batches++;
  for (; taken < b->n_instructions; taken++) {
    if (!check_locked(x, b->instructions[taken], why, sizeof why)) break;
    take_locked(x, b->instructions[taken]);
  }
  uint64_t last = x->last_seq;
  pthread_mutex_unlock(&mu);
  /* Queued, not run here: the handler never blocks. The instructions stay in
   * the message, which the last of them frees when done (no copy each). */
  rpc_kept_t *kept = taken ? rpc_call_keep_message(call) : NULL;
  executor_batch_t *held = kept ? executor_batch_new(kept) : NULL;
  executor_submit_begin(x->ex);
  for (size_t i = 0; i < taken; i++) {
    if (held) executor_submit_in(x->ex, b->instructions[i], held);
    else executor_submit(x->ex, b->instructions[i]); /* copies */
  }
  executor_submit_end(x->ex);
  if (held) executor_batch_release(held);
  else rpc_kept_free(kept);

  if (!why[0]) {
    executor_kick(x->ex); /* every batch is answered */
    return;
  }
  /* The good prefix is reported as executed before the call ends, so the
   * server knows exactly what ran: the reporter ends the call, after a
   * report that covers `last` (even when it ran already: its report, and the
   * failures it carries, may not have gone out yet). */
  x->failed = true;
  log_warn("execute", "agent %s: ending the Execute call from %s: %s", self->id,
           x->peer ? x->peer : "?", why);
  pthread_mutex_lock(&mu);
  x->finishing = true;
  x->finish_after = last;
  snprintf(x->why, sizeof x->why, "%s", why);
  pthread_mutex_unlock(&mu);
  executor_kick(x->ex);
}

void execute_end(rpc_call_t *call, bool cancelled, void *arg) {
  const agent_info_t *self = arg;
  exec_call_t *x = rpc_call_data(call);
  if (!x) return;
  pthread_mutex_lock(&mu);
  bool was_current = current == x;
  if (was_current) current = NULL;
  unsigned open = HASH_COUNT(x->sessions);
  pthread_mutex_unlock(&mu);
  log_info("execute", "agent %s: Execute call from %s ended%s: %" PRIu64 " batch(es), %" PRIu64
           " instruction(s) through seq %" PRIu64 ", %u session(s) dropped", self->id,
           x->peer ? x->peer : "?", cancelled ? " (cancelled)" : "", x->batches, x->instructions,
           x->last_seq, open);
  if (was_current) rpc_call_unref(call);
  executor_close(x->ex); /* no report after this; sessions end, memory is freed */
  free_sessions(x);
  free(x->peer);
  free(x);
}

size_t execute_sessions(void) {
  pthread_mutex_lock(&mu);
  size_t n = current ? HASH_COUNT(current->sessions) : 0;
  pthread_mutex_unlock(&mu);
  return n;
}

executor_t *execute_executor(void) {
  pthread_mutex_lock(&mu);
  executor_t *ex = current ? current->ex : NULL;
  if (ex) executor_ref(ex);
  pthread_mutex_unlock(&mu);
  return ex;
}

bool execute_cut(const char *why) {
  pthread_mutex_lock(&mu);
  rpc_call_t *call = current ? current->call : NULL;
  if (call) rpc_call_ref(call);
  pthread_mutex_unlock(&mu);
  if (!call) return false;
  log_warn("execute", "ending the Execute call: %s", why);
  rpc_call_finish(call, GRPC_STATUS_ABORTED, NULL, "%s", why);
  rpc_call_unref(call);
  return true;
}
