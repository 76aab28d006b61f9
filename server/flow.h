/* Flow control: how much accepted work waits for the agents, per session and
 * in total, and who must wait for room.
 *
 *   flow_t *f = flow_create(&(flow_limits_t){.session_commands = 4096, ...});
 *   flow_window_t *w = flow_window_open(f, &s->queued_commands);  // per session
 *   // per accepted command, under the session's lock:
 *   unsigned fl = flow_accept(w, bytes);
 *   if (fl & FLOW_CHECKPOINT) cp = flow_checkpoint(w);  // due: wait for it ...
 *   watermark_wait_session(..., the session's last seqs ..., cp_fired, cp, ...);
 *   // ... and from the wait's callback, whatever its result:
 *   flow_checkpoint_done(cp);
 *   // the command found the window full: its caller waits for room
 *   if (fl & FLOW_OVER) id = flow_wait(w, resume, call);  // 0: room already
 *
 * A command is queued from the moment the server accepts it (its instructions
 * are on the agents' links) until the agents report that the session ran it.
 * Single commands are not tracked: a checkpoint marks everything accepted so
 * far and, when the wait on it fires, everything before the mark leaves the
 * queue. Checkpoints complete out of order harmlessly (a later mark covers an
 * earlier one), and a LOST or CANCELLED wait completes its checkpoint too: that
 * work will never run, so nothing waits for it. The session's count is thus
 * an upper bound, exact right after a checkpoint fires.
 *
 * Bounds (each 0 = none): a window is over when its queue holds
 * session_commands commands or session_bytes instruction bytes; every window
 * is over while the total over all windows holds total_commands or
 * total_bytes. The total counts a session's commands once a checkpoint covers
 * them: a session's tail that no checkpoint covers yet (fewer than
 * every_commands) never holds other sessions back.
 *
 * Checkpoints are due every every_commands commands or every_bytes bytes, and
 * whenever the window is over (so that every queued command is covered by a
 * checkpoint that will fire, and a wait for room always ends).
 *
 * Lifetime: the flow outlives its windows' owners; a window is freed once it
 * is closed and its last checkpoint is done (checkpoints keep it). Closing a
 * window (the session ended) empties its queue and fires its waits.
 *
 * Thread-safe, one lock. Callbacks run without it, on the thread that made
 * room (the one calling flow_checkpoint_done, flow_window_close or
 * flow_destroy) or, for flow_wait, never on the caller's. */
#ifndef MESHD_FLOW_H
#define MESHD_FLOW_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct flow flow_t;
typedef struct flow_window flow_window_t;
typedef struct flow_checkpoint flow_checkpoint_t;

typedef struct flow_limits {
  uint64_t session_commands; /* 0: no bound */
  uint64_t session_bytes;
  uint64_t total_commands;
  uint64_t total_bytes;
  /* Checkpoint interval; 0: a quarter of the session bound, at most 256
   * commands / 1 MiB. */
  uint64_t every_commands;
  uint64_t every_bytes;
} flow_limits_t;

/* Runs once when the wait ends: there is room, or the window closed, or the
 * flow is destroyed. */
typedef void (*flow_fn)(void *arg);

/* NULL on OOM. The limits are copied. */
flow_t *flow_create(const flow_limits_t *limits);
/* Fires every pending wait, then frees. Windows still open become unusable:
 * destroy the flow only after its users stopped (server shutdown). */
void flow_destroy(flow_t *f);
/* The limits in force (after defaults). */
flow_limits_t flow_limits(const flow_t *f);

/* A window for one session. `gauge`, when not NULL, is kept equal to the
 * window's queued commands (e.g. session_t.queued_commands, read by
 * ListSessions); it must outlive the window's close. NULL on OOM. */
flow_window_t *flow_window_open(flow_t *f, _Atomic uint64_t *gauge);
/* The session ended: its queue is emptied (the total goes down), its waits
 * fire, and the window is freed once its checkpoints are done. The owner
 * must not use w afterwards. NULL: no-op. */
void flow_window_close(flow_window_t *w);

#define FLOW_CHECKPOINT 1u /* a checkpoint is due: take one with flow_checkpoint */
#define FLOW_OVER 2u       /* over a bound after this command: its caller waits (flow_wait) */
/* Counts one accepted command whose instructions took `bytes`. Returns
 * FLOW_CHECKPOINT and FLOW_OVER bits (0: go on). */
unsigned flow_accept(flow_window_t *w, uint64_t bytes);
/* Marks everything accepted so far. NULL when nothing is new since the last
 * mark (or OOM: the caller then simply does not wait). The caller waits for
 * the session's latest instructions and then calls flow_checkpoint_done
 * exactly once. */
flow_checkpoint_t *flow_checkpoint(flow_window_t *w);
/* The wait on cp ended (REACHED, LOST or CANCELLED): everything up to its
 * mark leaves the queue; waits that now have room fire. Frees cp. */
void flow_checkpoint_done(flow_checkpoint_t *cp);

/* Whether w is over its bounds or the total over its own; *server_wide (may
 * be NULL) says whether it is the total only (other sessions' work). */
bool flow_over(flow_window_t *w, bool *server_wide);
/* If w is over: registers cb(arg) to run once it is not (or the window
 * closes, or the flow is destroyed) and returns the wait's id (> 0).
 * Otherwise returns 0 and never calls cb. */
uint64_t flow_wait(flow_window_t *w, flow_fn cb, void *arg);
/* Withdraws a wait. true: removed, cb will not run. false: it ran or is
 * running (or id is 0). */
bool flow_cancel(flow_t *f, uint64_t id);

typedef struct flow_stats {
  uint64_t queued_commands, queued_bytes; /* the session's (window stats) or the total's */
  uint64_t pending_checkpoints;
  uint64_t waits;     /* pending flow_wait calls */
  uint64_t waits_total; /* flow_wait calls that had to wait, ever */
} flow_stats_t;
/* Totals over the flow (w NULL) or one window's figures. */
void flow_stats(flow_t *f, flow_window_t *w, flow_stats_t *out);

#endif
