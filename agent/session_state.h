/* The state one session keeps on an agent, shared by the workers of its
 * streams: its ref table, how far each stream has queued work, the refs
 * defined on one stream and read on another, and its live borrows. This is
 * the bottom of the agent's staircase: executor → run → session_state.
 *
 *   session_state_t *s = session_state_new(id, backend);       // executor
 *   stream_progress_t *p = session_state_add_stream(s, stream);    // executor, routing
 *   session_state_note_order(s, ins);                          // executor, routing
 *   session_state_stream_ready(s, p, bs); ... session_state_queued(s, p, seq);   // worker
 *   session_state_get(s, stream, seq, bs, ref, &t, &why);      // run.c
 *
 * Ordering between streams. Instructions run on one worker per (session,
 * stream). A ref defined on stream A (a borrow handle, a to_mesh result) and
 * read on stream B is recorded when the executor routes the defining
 * instruction (note_order, in seq order, so before any reader is routed);
 * B's reader then waits until A's worker has *queued* that seq on its backend
 * stream, and on backends with events makes B's backend stream wait for A's
 * on the device. Dropping a borrow orders the origin stream after the
 * borrower's last use the same way.
 *
 * Locks. session_state_t.mu guards the streams, defs and borrows (and the
 * `closing` flag); its condition variable `progress` is broadcast whenever a
 * stream queues a seq. refs has its own lock (refs.h). The executor may call
 * in while holding its own lock (executor.mu before session_state.mu, never
 * the reverse); nothing here calls out of this module but refs and the
 * backend.
 *
 * Lifetime. Made by the executor when a session's first instruction arrives;
 * its tensors and snapshots go when it ends (session_state_drop_data), but
 * for what a step still running holds; freed by the executor once the last of
 * its workers exited (session_state_free: what is left, its backend streams,
 * the backend's session_end). */
#ifndef MESHD_AGENT_SESSION_STATE_H
#define MESHD_AGENT_SESSION_STATE_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "refs.h"
#include "snapshot.h"

typedef struct stream_progress stream_progress_t;
typedef struct pending_def pending_def_t;
typedef struct borrow_record borrow_record_t;
typedef struct kept_snapshot kept_snapshot_t;
typedef struct coming_snapshot coming_snapshot_t;

/* Snapshots (Snapshot instructions) a session keeps unread; past it the
 * oldest goes (its Read then says so). The server reads each at once, and a
 * session has at most --session-max-transfers Fetches in flight, which is at
 * most this (server/data_service.h, DATA_TRANSFERS_MAX). */
#define SESSION_SNAPSHOTS_MAX 64

/* A peer the server declared lost for this session (PeerLost). */
#define SESSION_LOST_MAX 8
typedef struct lost_peer {
  uint32_t rank;
  uint64_t seq; /* the PeerLost: only instructions sent before it need the lost agent */
  char why[200];
} lost_peer_t;

typedef struct session_state {
  char *id;         /* the server's session id */
  uint64_t key;     /* a hash of id: dp_group_t.session, the backend's session_end */
  backend_t *backend; /* may be NULL (an agent without a compute backend) */
  refs_t refs;
  pthread_mutex_t mu;
  pthread_cond_t progress;    /* a stream queued a seq; closing */
  stream_progress_t *streams; /* mu */
  pending_def_t *defs;        /* mu */
  borrow_record_t *borrows;   /* mu */
  bool closing;               /* mu: cross-stream waits return at once */
  lost_peer_t lost[SESSION_LOST_MAX]; /* mu: peers declared lost, oldest first */
  size_t nlost;                       /* mu */
  uint64_t *comms;                    /* mu: data-plane channels its work used */
  size_t ncomms, capcomms;            /* mu */
  kept_snapshot_t *snapshots;         /* mu: not read yet, oldest first */
  kept_snapshot_t *snapshots_tail;    /* mu */
  size_t nsnapshots;                  /* mu */
  /* mu: Snapshots routed (note_order) that have not kept anything yet, by
   * seq, each marked when its DropSnapshot came first: one per Snapshot
   * queued, so bounded by the session's queued work; freed with the
   * session (a Snapshot an ended session never runs). */
  coming_snapshot_t *coming;
} session_state_t;

/* A new session state; NULL when out of memory. */
session_state_t *session_state_new(const char *id, backend_t *backend);
/* Frees s and everything it holds; no worker may use it any more. */
void session_state_free(session_state_t *s);

/* Stream `stream` of the session, made when its first instruction is routed
 * (the same record on later calls); NULL when out of memory. */
stream_progress_t *session_state_add_stream(session_state_t *s, uint64_t stream);
/* The stream's worker could not be started: forget the stream (before any
 * other call with p). */
void session_state_remove_stream(session_state_t *s, stream_progress_t *p);
/* The stream's worker made its backend stream (NULL on backends without
 * streams); s destroys it in session_state_free. */
void session_state_stream_ready(session_state_t *s, stream_progress_t *p, backend_stream_t *bs);
/* The stream's worker has queued the work of seq on its backend stream. */
void session_state_queued(session_state_t *s, stream_progress_t *p, uint64_t seq);
/* The session ended (or the executor is closing): cross-stream waits stop
 * waiting, and the data-plane channels its work used are dropped (a peer still
 * in one of its collectives fails at once instead of at the comm timeout, and
 * no socket outlives the session). */
void session_state_close(session_state_t *s);
/* After session_state_close: lets go of the session's tensors and kept
 * snapshots now, rather than when its last worker exits (a step still
 * running, slow and not interruptible, held all of the session's memory
 * until it returned). What a running step uses it holds references to
 * (refs_get), and is freed when the step lets go; what it defines after this
 * goes at session_state_free. Not under the executor's lock: it frees. */
void session_state_drop_data(session_state_t *s);
/* session_state_close ran: what the session still runs is for nobody. */
bool session_state_closing(session_state_t *s);
/* The session's work used data-plane channel comm_id (collectives, sends). */
void session_state_note_comm(session_state_t *s, uint64_t comm_id);

/* The server declared `rank` lost for this session by PeerLost seq `seq`
 * (why: "was lost at ..."): session_state_check_peers then fails the
 * instructions sent before it whose group includes the rank (those sent
 * after it name the rank's replacement: the server refuses commands on meshes
 * that still include the lost agent), and waits in session_state_wait_lost
 * end. Wakes every waiter of the session. */
void session_state_peer_lost(session_state_t *s, uint32_t rank, uint64_t seq, const char *why);
/* 0, or -1 with err (AGENT_LOST, "<what>: the agent of rank R was lost ...")
 * when instruction `seq` needs one of ranks[0..n) and was sent before that
 * rank was declared lost for this session. */
int session_state_check_peers(session_state_t *s, const uint32_t *ranks, size_t n, uint64_t seq,
                              const char *what, meshd_error_t *err);
/* Waits until a peer is declared lost for the session, the session closes, or
 * timeout_ms passes (fault injection's "hang"). true when it ended early. */
bool session_state_wait_lost(session_state_t *s, int timeout_ms);

/* Records what ordering `ins` needs besides its own stream's order (borrow
 * records, refs defined on one stream for another), and a Snapshot as coming
 * (session_state_drop_snapshot). Called by the executor for every
 * instruction of the session it queues, in seq order, as it routes it. */
void session_state_note_order(session_state_t *s, const Meshd__Agent__V1__Instruction *ins);

/* Orders the waiter's stream (id `waiter`, running instruction `waiter_seq`,
 * backend stream `wbs`) after seq of `stream`: blocks until that stream's
 * worker queued seq, then, on backends with events, makes wbs wait on the
 * device for what was queued. No-op when `stream` is the waiter or is not a
 * stream of the session, and when seq is not before waiter_seq: an
 * instruction never waits for one sent after it (a server never asks that;
 * a corrupt instruction stream that did would deadlock two streams). */
void session_state_wait_stream(session_state_t *s, uint64_t stream, uint64_t seq, uint64_t waiter,
                               uint64_t waiter_seq, backend_stream_t *wbs);
/* refs_get for instruction `seq` on `stream` (backend stream bs), ordered
 * after the stream that defines ref when that is another one. Returns as
 * refs_get. */
int session_state_get(session_state_t *s, uint64_t stream, uint64_t seq, backend_stream_t *bs,
                      uint64_t ref, agent_tensor_t *out, ref_failure_t *why);
/* ref is gone (deleted, or a borrow handle past its last use): readers no
 * longer order after its defining stream. */
void session_state_forget_def(session_state_t *s, uint64_t ref);
/* A delete of ref by instruction (stream, seq) may be done now, with no wait:
 * ref's definition is on that stream, or queued already on the other stream
 * that defines it (or comes after seq), as session_state_delete would wait
 * for. Otherwise the definition is still to come there, and would outlive
 * the delete. */
bool session_state_def_queued(session_state_t *s, uint64_t stream, uint64_t seq, uint64_t ref);
/* Deletes ref for the instruction (stream, seq): after its definition when that
 * is on another stream, as a read waits (a definition still to come there would
 * otherwise hold the tensor until the session ends); then forgets it. */
void session_state_delete(session_state_t *s, uint64_t stream, uint64_t seq, backend_stream_t *bs,
                          uint64_t ref);
/* Borrow `borrow` is dropped by instruction `seq` on the origin stream
 * (`stream`, backend stream bs): forgets its record and orders the origin
 * after the borrower's last use. Unknown borrows are a no-op. */
void session_state_end_borrow(session_state_t *s, uint64_t borrow, uint64_t stream, uint64_t seq,
                              backend_stream_t *bs);

/* Snapshot instruction `seq` of `ref` took snap (owned by the session now)
 * or, when snap is NULL, found the ref failed (rc 1, *why) or missing (rc
 * -1): kept for the Read of (seq, ref). */
void session_state_keep_snapshot(session_state_t *s, uint64_t seq, uint64_t ref, snapshot_t *snap,
                                 int rc, const ref_failure_t *why);
/* The Read of (seq, ref) takes what its Snapshot kept: 0 with *snap (the
 * caller releases it); 1, the ref had failed (*why); -1, nothing kept
 * (why->msg says why). */
int session_state_take_snapshot(session_state_t *s, uint64_t seq, uint64_t ref, snapshot_t **snap,
                                ref_failure_t *why);
/* Lets go of what Snapshot `seq` kept, unless its Read took it already; a
 * Snapshot still to run (queued, or running: routed by note_order, nothing
 * kept yet) keeps nothing when it runs. Done as the DropSnapshot arrives, not
 * in its stream's order: a drop queued behind a long instruction let the
 * session hold one snapshot too many meanwhile, and the oldest unread one,
 * another Fetch's, went for it. Frees; not under the executor's lock. */
void session_state_drop_snapshot(session_state_t *s, uint64_t seq);

#endif
