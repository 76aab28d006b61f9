/* The session table: who may call, with which lease, quota and refs.
 *
 * A session is created by CreateSession and found again by (id, token) on every
 * later call. It ends on CloseSession, when it sits idle past its ttl, or when
 * the table is destroyed; the table then calls on_closed once for it (outside
 * its locks), so the server can tell the agents to free its state.
 *
 * Lifetime: a session is refcounted. The table holds one reference while the
 * session is open; session_create, session_acquire, session_find and
 * session_ref hand the caller another, which it gives back with
 * session_release. The per-session objects (set with session_set_objects) are
 * destroyed, and the session freed, when the last reference goes, never inside
 * a table callback. A session pointer stays valid while its holder keeps its
 * reference, even after the session was closed: check s->closed (atomic)
 * before starting new work.
 *
 * Lease: a session expires when it has been idle for more than its ttl. Every
 * reference but the table's belongs to a call in flight (an RPC between
 * session_from_call and its end, a Submit stream for its whole life, a Sync or
 * Fetch waiting on agents), and a session with a call in flight is never idle:
 * s->calls counts those references, expiry skips a session while it is above
 * 0, and the lease restarts when the last of them is released.
 *
 * Thread safety: every function here is thread-safe. None of them takes s->mu,
 * which belongs to the command layer (the objects it hangs on the session). */
#ifndef MESHD_SESSION_H
#define MESHD_SESSION_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uthash.h>

#include "error_kind.h"

#define SESSION_ID_LEN 32    /* hex chars */
#define SESSION_TOKEN_LEN 64 /* hex chars */
#define SESSION_CLIENT_NAME_MAX 128
#define SESSION_TTL_MAX_S (7 * 86400)
#define SESSION_OWNER_MAX 63 /* a principal's name (auth.h) */
#define SESSION_COMM_KEY_LEN 32 /* bytes */

typedef struct session_table session_table_t;

/* What one session may hold or send; 0 means no bound. The table's limits are
 * copied into each session it creates; the command layer enforces them
 * (commands.c), each refusal QUOTA naming the limit and its flag. */
typedef struct session_limits {
  uint64_t max_refs;         /* live refs: tensors (views and borrowed handles too),
                                meshes, streams, borrows not dropped (--session-max-refs) */
  uint64_t max_meshes;       /* meshes made; a mesh lasts as long as its session
                                (--session-max-meshes) */
  uint64_t max_streams;      /* streams made; the same (--session-max-streams) */
  uint64_t max_command_refs; /* refs one command may list: a Drop's (--max-command-refs) */
} session_limits_t;

typedef enum {
  SESSION_END_CLOSED,   /* CloseSession or session_close */
  SESSION_END_EXPIRED,  /* idle past its ttl */
  SESSION_END_SHUTDOWN, /* the table was destroyed */
} session_end_t;

#define SESSION_UPLOADS_MAX 64

typedef struct session {
  /* Set at creation, then read-only. */
  char id[SESSION_ID_LEN + 1];
  char owner[SESSION_OWNER_MAX + 1]; /* the principal that created it */
  char client_name[SESSION_CLIENT_NAME_MAX + 1];
  uint64_t ttl_s;
  uint64_t quota_bytes; /* 0: unlimited */
  int64_t created_ms;   /* rpc_now_ms() clock */
  session_limits_t limits;
  /* Random; keys the session's data plane: emit.c derives each comm_id and its
   * group secret from it (docs/protocol.md, "Data plane handshake"). */
  uint8_t comm_key[SESSION_COMM_KEY_LEN];

  /* Counters the command handlers keep; read by ListSessions. */
  _Atomic uint64_t bytes_held; /* see session_charge / session_credit */
  _Atomic uint64_t live_tensors;
  _Atomic uint64_t queued_commands; /* accepted, not yet known to have run (flow.h) */
  _Atomic uint64_t commands;        /* accepted so far (command_service.c) */
  _Atomic int transfers;            /* Upload and Fetch calls in flight (data_service.c) */
  _Atomic int fetches_waiting;      /* planned fetches waiting for a transfer slot (ditto) */

  /* The command layer's lock for `objects` and whatever else it keeps per session. */
  pthread_mutex_t mu;
  void *objects;
  void (*destroy_objects)(void *objects);
  /* Refs of proxied Uploads in flight (session_reserve_ref), under mu: at most
   * one per transfer a session may have (--session-max-transfers, <= 64). */
  uint64_t uploading[SESSION_UPLOADS_MAX];
  size_t nuploading;

  /* Table-private below. */
  char token[SESSION_TOKEN_LEN + 1];
  _Atomic int64_t last_used_ms;
  _Atomic uint64_t last_ref; /* highest ref claimed, 0 before the first */
  _Atomic int refs;
  _Atomic int calls; /* references held by calls in flight: every one but the table's */
  _Atomic bool closed;
  uint64_t seq;      /* 1, 2, ... in creation order (ListSessions' page tokens) */
  struct owner_count *counted; /* its principal's count of open sessions, while in the table */
  UT_hash_handle hh; /* the table's by-id index */
} session_t;

/* Called once per session that ends, outside table locks, with a reference the
 * table holds for the duration of the call (take your own with session_ref to
 * keep it longer). Runs on whichever thread ended the session (the expiry
 * thread, an RPC thread in session_close or session_acquire, the destroying
 * thread), so it must not block: queue the agents' cleanup and return. Must not
 * call session_table_destroy. */
typedef void (*session_closed_fn)(session_t *s, session_end_t why, void *arg);

/* default_ttl_s >= 1 (used when CreateSession asks for 0); default_quota_bytes 0
 * means unlimited. on_closed may be NULL. Starts the expiry thread, which closes
 * idle sessions every ~500 ms. Returns NULL if memory or the thread fail. */
session_table_t *session_table_create(uint64_t default_ttl_s, uint64_t default_quota_bytes,
                                      session_closed_fn on_closed, void *arg);
/* Stops the expiry thread, closes every open session (on_closed with
 * SESSION_END_SHUTDOWN) and frees the table. Sessions still referenced by
 * others live on until released. */
void session_table_destroy(session_table_t *t);
uint64_t session_table_default_ttl(const session_table_t *t);
/* The default quota, which is also the most a CreateSession may ask for (0:
 * unlimited); session_service.c refuses a request above it. */
uint64_t session_table_default_quota(const session_table_t *t);
/* The limits every session created from now on gets (default: none). Call
 * before serving. */
void session_table_set_limits(session_table_t *t, const session_limits_t *limits);
/* While false, CreateSession is refused (the server is draining). Default true. */
void session_table_set_accepting(session_table_t *t, bool accepting);
bool session_table_accepting(const session_table_t *t);

/* Open sessions one principal may hold at once (0: no bound). Default 0. */
void session_table_set_owner_limit(session_table_t *t, uint64_t max_per_owner);
/* Open sessions the whole server may hold at once, every principal together
 * (--max-sessions; 0: no bound). Default 0. */
void session_table_set_max_sessions(session_table_t *t, uint64_t max_sessions);
/* A random number drawn when the table was made: ListSessions' page tokens
 * carry it, so that one from before a restart is refused, not misread. */
uint32_t session_table_epoch(const session_table_t *t);

/* A new open session of principal `owner` with a random id and token. ttl_s 0
 * or quota_bytes 0 take the table's defaults. The caller validates its
 * arguments (session_service.c does); client_name is truncated to
 * SESSION_CLIENT_NAME_MAX. Returns 0 with *out acquired (release it), or -1
 * with err: QUOTA when the owner or the server holds the most sessions allowed,
 * UNAVAILABLE out of memory. */
int session_create(session_table_t *t, const char *owner, const char *client_name, uint64_t ttl_s,
                   uint64_t quota_bytes, session_t **out, meshd_error_t *err);

/* The open session with this id if token matches (compared in constant time),
 * acquired, its lease renewed. Otherwise NULL and err kind NO_SESSION:
 * unknown/closed/expired id, wrong token, or missing id/token. A session found
 * idle past its ttl is expired here rather than returned. */
session_t *session_acquire(session_table_t *t, const char *id, const char *token,
                           meshd_error_t *err);
/* session_acquire for the principal owner (NULL: any): a session of another
 * principal is NULL with err kind PERMISSION_DENIED, neither acquired, renewed
 * nor expired (the stranger's call leaves it as it was). */
session_t *session_acquire_as(session_table_t *t, const char *id, const char *token,
                              const char *owner, meshd_error_t *err);
/* Server-internal lookup (agent reports name sessions by id): the open session
 * with this id, acquired, without a token and without renewing its lease; NULL
 * if there is none. */
session_t *session_find(session_table_t *t, const char *id);
/* Lets go of what session_find took, without renewing the lease (an agent's
 * report or loss is not the session's use: session_release would keep an
 * abandoned session from expiring while any agent restarts). */
void session_unfind(session_t *s);
/* Another reference to a session the caller already holds (a call that goes on
 * after its handler returned: a pending Sync, a Fetch's thread). */
void session_ref(session_t *s);
/* Drops a reference taken by session_create, _acquire, _find or _ref; renews
 * the lease (the end of a call is activity). */
void session_release(session_t *s);
/* A reference that keeps the session's memory, not its lease: for state that
 * outlives a call and must not keep an abandoned session open (a planned
 * direct transfer, whose client keeps the session alive with KeepAlive while
 * it moves the bytes). session_hold takes one; session_detach turns the
 * caller's call reference into one (renewing the lease, as the call's end);
 * session_unhold drops one. */
void session_hold(session_t *s);
void session_detach(session_t *s);
void session_unhold(session_t *s);
/* Turns a hold back into a call reference (a call that goes on with it):
 * drop it with session_release. */
void session_attach(session_t *s);
/* Renews the lease: long-lived calls (Submit streams) call it per message. */
void session_touch(session_t *s);
/* Closes s: out of the table at once, on_closed(SESSION_END_CLOSED) before it
 * returns. Returns true if this call closed it, false if it was already closed.
 * The caller keeps its own reference. */
bool session_close(session_table_t *t, session_t *s);
/* Closes every session idle for more than its ttl at now_ms (rpc_now_ms()
 * clock) with no call in flight. Returns how many it closed. The table's
 * thread calls it; tests may too. */
int session_expire(session_table_t *t, int64_t now_ms);
size_t session_count(session_table_t *t);

/* A snapshot row for ListSessions. */
typedef struct session_info {
  char id[SESSION_ID_LEN + 1];
  char owner[SESSION_OWNER_MAX + 1];
  char client_name[SESSION_CLIENT_NAME_MAX + 1];
  uint64_t bytes_held;
  uint64_t live_tensors;
  uint64_t queued_commands;
  uint64_t commands; /* accepted so far */
  uint64_t age_ms;   /* since it was created */
  uint64_t idle_ms; /* 0 while a call is in flight */
  uint64_t ttl_s;
  uint64_t seq; /* creation order (session_t.seq) */
} session_info_t;

/* Open sessions, oldest first, as a malloc'd array of *n rows (free() it; NULL
 * when there are none). Returns 0, or -1 out of memory. */
int session_list(session_table_t *t, session_info_t **out, size_t *n);
/* One page of session_list: at most limit (>= 1) rows of owner's sessions
 * (NULL: everyone's) created after the session numbered `after` (0: from the
 * first), oldest first. *next is the seq of the last row when more rows
 * follow, 0 on the last page. Returns 0; -1 out of memory; -2 when `after` is
 * no seq this table ever gave (a forged page token). */
int session_list_page(session_table_t *t, const char *owner, uint64_t after, size_t limit,
                      session_info_t **out, size_t *n, uint64_t *next);
/* Slots allocated for the seq index of owner's open sessions (NULL: of every
 * session; 0 when owner holds none): for tests, which check that the index
 * gives its memory back as sessions leave. */
size_t session_table_index_capacity(session_table_t *t, const char *owner);

/* Claims ref for a new object of s. Refs are >= 1 and strictly increase within
 * a session; a claimed ref stays claimed even if the command then fails.
 * Returns 0, or -1 with REF_REUSED. */
int session_claim_ref(session_t *s, uint64_t ref, meshd_error_t *err);
/* The same test without claiming; a ref reserved by an Upload in flight is
 * taken too. Under s->mu. */
int session_check_ref(session_t *s, uint64_t ref, meshd_error_t *err);
/* An Upload in flight reserves its ref (it passed session_check_ref): until
 * it settles, no command and no other Upload or plan may take it, and the
 * high-water mark of claimed refs stays where it is (the session's other
 * commands may still use lower refs). Under s->mu. 0, or -1 with err
 * (REF_REUSED: taken or reserved; QUOTA: SESSION_UPLOADS_MAX reserved). */
int session_reserve_ref(session_t *s, uint64_t ref, meshd_error_t *err);
/* Lets a reserved ref go (a no-op for one not reserved). Under s->mu. */
void session_unreserve_ref(session_t *s, uint64_t ref);
/* Checks a command's new refs together: each passes session_check_ref and they
 * strictly increase among themselves. Claims nothing; after the command is
 * accepted, claim the last one. Hold s->mu across check and claim when commands
 * of one session may run concurrently. */
int session_check_refs(session_t *s, const uint64_t *refs, size_t n, meshd_error_t *err);

/* Adds bytes to s->bytes_held unless that passes the quota: -1 with QUOTA
 * ("<what> needs 4.0 MiB but session ... holds 7.0 MiB of its 8.0 MiB quota; drop
 * tensors or create the session with a larger quota_bytes"). `what` names the
 * command and result, e.g. "Factory zeros ref 12". */
int session_charge(session_t *s, uint64_t bytes, const char *what, meshd_error_t *err);
/* Gives bytes back (saturates at 0). */
void session_credit(session_t *s, uint64_t bytes);

/* Hangs the command layer's per-session object tables on s; destroy(objects) runs when
 * the last reference is released (never from a table callback). Call under
 * s->mu; replaces (without destroying) any previous objects. */
void session_set_objects(session_t *s, void *objects, void (*destroy)(void *objects));

const char *session_end_name(session_end_t why);

#endif
