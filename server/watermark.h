/* Waiting for agents to execute instructions ("Sync").
 *
 * A wait names targets (rank, seq) and fires once every rank has executed
 * through its seq, or fails as soon as one of those seqs can no longer run
 * because the link that carried it is gone. A wait may name its session:
 * it then fires as soon as that session's own instructions up to each seq
 * ran, whatever other sessions' instructions still wait on the agent (the
 * agents report progress per session), so one session's stalled collective
 * never holds another's Sync. The agent pool owns one watermark
 * and feeds it from the agent links' reader threads; server code only waits.
 *
 * Seqs are per rank and never reused while the server runs, even when the
 * agent at a rank is replaced (agent_pool.c continues the numbering), so a
 * (rank, seq) names one instruction on one link. For each rank the watermark
 * keeps the highest executed seq and the ranges of seqs lost with their link.
 *
 * Thread-safe. Callbacks run without the watermark's lock, on whichever thread
 * moved the watermark (an agent link's reader thread, or the thread that
 * removed an agent); they may call watermark_* again. */
#ifndef MESHD_WATERMARK_H
#define MESHD_WATERMARK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct watermark watermark_t;

typedef enum {
  WATERMARK_PENDING,   /* registered: the callback will say how it ended */
  WATERMARK_REACHED,   /* every target rank executed through its seq */
  WATERMARK_LOST,      /* a target seq was on a link that broke first: AGENT_LOST */
  WATERMARK_CANCELLED, /* the watermark was destroyed (server stopping), or out of memory */
} watermark_result_t;

typedef struct watermark_target {
  uint32_t rank;
  uint64_t seq; /* as returned by agent_pool_send for that rank; 0 is always reached */
} watermark_target_t;

/* result is REACHED, LOST (lost_rank names the rank whose link broke) or CANCELLED. */
typedef void (*watermark_fn)(watermark_result_t result, uint32_t lost_rank, void *arg);

watermark_t *watermark_create(void);
/* Fails every pending wait with WATERMARK_CANCELLED (from this thread), then frees. */
void watermark_destroy(watermark_t *w);

/* Waits until every target is executed.
 * Returns REACHED or LOST (with *lost_rank) when that is known now: the callback
 * is NOT called then. Returns PENDING when registered: *id names the wait, and
 * cb runs exactly once later (possibly on another thread before this returns)
 * unless watermark_cancel(*id) returns true. Returns CANCELLED if out of memory.
 * The targets are copied; n == 0 is REACHED. id and lost_rank may be NULL. */
watermark_result_t watermark_wait(watermark_t *w, const watermark_target_t *targets, size_t n,
                                  watermark_fn cb, void *arg, uint64_t *id, uint32_t *lost_rank);
/* The same for the instructions of one session (its id; NULL: every session,
 * as watermark_wait): each target is reached once the rank reports that the
 * session ran its seqs through it. */
watermark_result_t watermark_wait_session(watermark_t *w, const char *session,
                                          const watermark_target_t *targets, size_t n,
                                          watermark_fn cb, void *arg, uint64_t *id,
                                          uint32_t *lost_rank);
/* Called, without the watermark's lock, for each target rank of a wait that
 * is left pending (some of them may have been reached): the agent pool sends
 * what that rank's link still holds back (agent_link_flush), since someone
 * now waits for it. Set once, before the first wait; NULL: none. */
typedef void (*watermark_kick_fn)(uint32_t rank, void *arg);
void watermark_set_kick(watermark_t *w, watermark_kick_fn fn, void *arg);

/* Withdraws a pending wait. true: removed, its callback will not run. false: it
 * already ran or is running (e.g. the Sync call ended as the agents caught up). */
bool watermark_cancel(watermark_t *w, uint64_t id);

/* ---- fed by the agent pool --------------------------------------------- */

/* rank executed every seq <= executed (lower values than known are ignored). */
void watermark_advance(watermark_t *w, uint32_t rank, uint64_t executed);
/* One session's progress on a rank, as an AgentReport lists it. */
typedef struct watermark_session {
  const char *session;
  uint64_t through;
} watermark_session_t;
/* A report with per-session progress: every seq <= executed ran; each session
 * in sessions[] ran its seqs <= its `through`; every other session ran its
 * seqs <= received. received 0: no per-session progress (watermark_advance).
 * Replaces what the previous report said of the sessions. */
void watermark_progress(watermark_t *w, uint32_t rank, uint64_t executed, uint64_t received,
                        const watermark_session_t *sessions, size_t n);
/* rank's link is gone: seqs executed+1 .. last_seq will never run. Pending
 * targets in that range fail their waits; later waits for them fail at once. */
void watermark_lost(watermark_t *w, uint32_t rank, uint64_t executed, uint64_t last_seq);
/* Whether rank reported that `session` ran its seqs through seq (NULL: every
 * session); false for a seq on a link that broke first. */
bool watermark_reached(watermark_t *w, uint32_t rank, const char *session, uint64_t seq);
/* Highest seq rank is known to have executed (0: none). */
uint64_t watermark_executed(watermark_t *w, uint32_t rank);
/* Waits registered and not yet fired. */
size_t watermark_pending(watermark_t *w);
/* Ranges of lost seqs recorded for rank (adjacent losses share one). */
size_t watermark_lost_ranges(watermark_t *w, uint32_t rank);

#endif
