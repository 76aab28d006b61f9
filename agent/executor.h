/* The agent's executor: runs the instructions of one Execute call.
 *
 * Instructions arrive in seq order (executor_submit, from the Execute
 * handler; it never blocks). Each goes to the queue of its (session, stream);
 * one worker thread per (session, stream) runs its queue in order, different
 * streams concurrently. Borrows and cross-stream results are ordered with
 * per-stream progress counters ("events": a stream waits until another one
 * ran through a given seq).
 *
 * The executor owns the queues, the worker threads, the watermark and the
 * reports; what an instruction does is run.c's (run.h), and the state a
 * session keeps between instructions is session_state.h's. Calls go one way:
 * executor → run → session_state.
 *
 * The watermark is what has been EXECUTED: every seq <= executed_through is
 * done on every stream. A reporter thread hands the watermark, the root
 * failures not yet reported and the bytes allocated to the report callback
 * whenever one of them changes, or after executor_kick.
 *
 * Owned by the Execute call that made it; Read/Write calls take references
 * (executor_ref / executor_unref). */
#ifndef MESHD_AGENT_EXECUTOR_H
#define MESHD_AGENT_EXECUTOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "refs.h"
#include "rpc.h"
#include "run.h"

typedef struct executor executor_t;

/* One report: what AgentReport carries. Everything is valid during the call. */
typedef struct executor_report {
  uint64_t executed_through; /* every seq <= it has run, in every session */
  uint64_t received_through; /* the last seq taken */
  /* Sessions with work not yet run: each has run every one of its seqs <= its
   * executed_through; a session not listed has run all of its seqs. */
  Meshd__Agent__V1__SessionProgress **sessions;
  size_t n_sessions;
  Meshd__V1__Error **errors; /* root failures not reported before */
  size_t n_errors;
  uint64_t allocated_bytes;
} executor_report_t;

/* Runs on the reporter thread. */
typedef void (*executor_report_fn)(const executor_report_t *r, void *arg);

/* env (run.h) is copied; what it points to must outlive the executor. NULL
 * when out of memory or threads. */
executor_t *executor_create(const run_env_t *env, executor_report_fn report, void *arg);
/* Stops reporting (the callback never runs after it returns), then drops the
 * owner's reference: workers drop what is queued (sessions are ended, their
 * memory freed at once but for what a running step holds until it returns)
 * and the last reference frees the executor. Never blocks on
 * workers; call once. */
void executor_close(executor_t *x);
void executor_ref(executor_t *x);
void executor_unref(executor_t *x);
/* Waits until every executor of the process has been freed (its workers
 * done, their storages released): 0, or -1 when some remain after
 * timeout_ms. The agent calls it before closing its backend. */
int executor_wait_all_freed(int timeout_ms);

/* Queues a copy of ins (already checked by the caller: seq = previous + 1,
 * session and body set). PeerLost is not queued but handled here, before
 * anything queued runs: the session's instructions that need the lost rank
 * then fail with AGENT_LOST without running, and the data plane's and the
 * backend's waits on that peer end at once. A DropSnapshot is done here too,
 * and so is what cannot be queued (a refusal with no data plane call, a
 * DeleteRefs with no worker to be had), outside the executor's lock but
 * before it returns: one caller at a time, in seq order (the one Execute
 * call's handler, whose callbacks never run at once), so that the next
 * instruction is routed only after it. Returns 0, or -1 out of memory (the
 * instruction is then counted as done with a root failure reported; one with
 * a data plane call once a thread of its own told its peers, as run_refused
 * does). */
int executor_submit(executor_t *x, const Meshd__Agent__V1__Instruction *ins);
/* The same without the copy: ins stays where it is, inside the message b
 * holds, which the last of its queued instructions frees when done. */
typedef struct executor_batch executor_batch_t;
/* Holds a message the Execute handler kept (rpc_call_keep_message), with one
 * reference, the caller's. NULL out of memory (kept is then not taken). */
executor_batch_t *executor_batch_new(rpc_kept_t *kept);
void executor_batch_release(executor_batch_t *b);
int executor_submit_in(executor_t *x, const Meshd__Agent__V1__Instruction *ins,
                       executor_batch_t *b);
/* Between these two, the streams that instructions were queued on are woken
 * once, at executor_submit_end, instead of at each instruction: a worker that
 * keeps up with the queue would otherwise sleep and wake once per instruction
 * of a batch. The Execute handler brackets each batch's submits. */
void executor_submit_begin(executor_t *x);
void executor_submit_end(executor_t *x);
/* The reporter sends a report soon even if nothing changed. */
void executor_kick(executor_t *x);
uint64_t executor_executed(executor_t *x);
/* Sessions with state on this executor. */
size_t executor_sessions(executor_t *x);
/* Sessions with state on every executor of the process (the agent's
 * meshd_agent_sessions gauge). */
size_t executor_open_sessions(void);
/* Waits until executed_through >= seq. 0, or -1 on timeout / close. */
int executor_wait(executor_t *x, uint64_t seq, int timeout_ms);
/* Waits until `session` ran every one of its seqs <= seq (other sessions'
 * work does not count). 0, or -1 on timeout / close. */
int executor_wait_session(executor_t *x, const char *session, uint64_t seq, int timeout_ms);


/* Data in and out (Agent/Read, Agent/Write). */
/* 0 with *out retained; 1 failed (why); -1 unknown session or ref (why->msg). */
int executor_lookup(executor_t *x, const char *session, uint64_t ref, agent_tensor_t *out,
                    ref_failure_t *why);
/* What the session's Snapshot instruction `seq` of ref kept, for its Read
 * (session_state_take_snapshot): 0 with *snap (release it), 1 failed (why),
 * -1 none (why->msg; also for a session not open here). */
int executor_take_snapshot(executor_t *x, const char *session, uint64_t seq, uint64_t ref,
                           snapshot_t **snap, ref_failure_t *why);
/* Defines ref in session as t (retained by the table), for a Write: 0; 1 when
 * the session is not open here; 2 when ref was deleted here before (the server
 * undid the transfer: refs_put_write); -1 out of memory. Nothing is stored
 * but on 0. */
int executor_define(executor_t *x, const char *session, uint64_t ref, const agent_tensor_t *t);
backend_t *executor_backend(executor_t *x);
/* A session is open on the executor from the first instruction of it that
 * arrives (any but EndSession and PeerLost: the server opens a session on an
 * agent with a StatusRequest before it writes to it) until its EndSession.
 * Only open sessions take Agent/Write data. */
bool executor_session_open(executor_t *x, const char *session);
/* Waits up to timeout_ms for session to be open: true when it is. */
bool executor_wait_open(executor_t *x, const char *session, int timeout_ms);
/* Its Execute call ended (executor_close): waits on it return at once. */
bool executor_closing(executor_t *x);
/* The last seq taken (0: none yet). */
uint64_t executor_received(executor_t *x);

/* Tests. The worker threads x starts at most (n < 0: 4096, the default):
 * past them a new stream's instruction cannot be queued (one with a data
 * plane call then goes to a refuser thread). */
void executor_set_max_workers_for_test(executor_t *x, int n);
/* hold(arg, seq) runs on each refuser thread x starts from now on, before
 * it refuses instruction seq: a test holds the refusal there (NULL: none). */
void executor_set_refuser_hold_for_test(executor_t *x, void (*hold)(void *arg, uint64_t seq),
                                        void *arg);
/* Waits up to timeout_ms until the worker of (session, stream) waits with
 * nothing it may run now (its queue empty, or held behind a refuser of its
 * stream): 0, or -1. */
int executor_wait_stream_idle_for_test(executor_t *x, const char *session, uint64_t stream,
                                       int timeout_ms);

#endif
