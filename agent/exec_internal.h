/* Internals shared by executor.c (queues, threads, watermark) and run.c (what
 * each instruction does). Not a public header. */
#ifndef MESHD_AGENT_EXEC_INTERNAL_H
#define MESHD_AGENT_EXEC_INTERNAL_H

#include <pthread.h>
#include <uthash.h>

#include "executor.h"

typedef Meshd__Agent__V1__Instruction instr_t;

typedef struct item {
  instr_t *ins; /* unpacked copy, owned */
  struct item *next;
} item_t;

typedef struct xsession xsession_t;

/* One (session, stream) queue and its worker. Fields guarded by executor.mu. */
typedef struct xstream {
  uint64_t id;
  xsession_t *sess;
  item_t *head, *tail;
  uint64_t queued_seq; /* last seq whose work is queued on the device (ordering) */
  uint64_t done_seq;   /* last seq this stream completed (the watermark) */
  backend_stream_t *bs; /* the backend's stream (cuda); NULL for cpu. Made by the
                         * worker before its first instruction, destroyed with
                         * the session. */
  bool stop;         /* the session ended: exit once the queue is empty */
  pthread_cond_t wake;
  UT_hash_handle hh;
} xstream_t;

/* A ref defined on one stream and first read on another (borrow handles,
 * to_mesh results on another stream): readers wait for (stream, seq). */
typedef struct pending_def {
  uint64_t ref, stream, seq;
  UT_hash_handle hh;
} pending_def_t;

typedef struct xborrow {
  uint64_t id, from_stream, to_stream, last_use_seq;
  UT_hash_handle hh;
} xborrow_t;

struct xsession {
  char *id;
  uint64_t key;          /* hash of id: dp_group_t.session, backend session_end */
  refs_t refs;
  xstream_t *streams;    /* executor.mu */
  pending_def_t *defs;   /* executor.mu */
  xborrow_t *borrows;    /* executor.mu */
  int live_workers;      /* executor.mu */
  uint64_t end_seq;      /* EndSession's seq; 0 while open */
  UT_hash_handle hh;
};

/* executor.c, for run.c */
/* Orders the caller's stream (waiter, its backend stream `wbs`) after seq of
 * `stream`: blocks until that stream's worker queued seq, then, on backends
 * with events, makes wbs wait on the device for what was queued (no-op when
 * that stream is absent or is the waiter). */
void exec_wait_stream(executor_t *x, xsession_t *s, uint64_t stream, uint64_t seq,
                      uint64_t waiter, backend_stream_t *wbs);
/* Reads ref for a worker on `stream` (backend stream bs): orders it after
 * the defining stream first if another stream defines it. */
int exec_get(executor_t *x, xsession_t *s, uint64_t stream, backend_stream_t *bs, uint64_t ref,
             agent_tensor_t *out, ref_failure_t *why);
void exec_forget_def(executor_t *x, xsession_t *s, uint64_t ref);
/* Takes the borrow record (NULL if unknown); the caller frees it. */
xborrow_t *exec_take_borrow(executor_t *x, xsession_t *s, uint64_t id);
/* Queues a root failure for the next report. */
void exec_report_error(executor_t *x, const char *session, error_kind_t kind, const char *msg,
                       uint64_t seq, uint64_t ref);
const executor_env_t *exec_env(executor_t *x);

/* run.c: runs ins on its stream's worker; bs is that stream's backend stream. */
void run_instruction(executor_t *x, xsession_t *s, backend_stream_t *bs, const instr_t *ins);

#endif
