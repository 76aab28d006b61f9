/* Private to agent/dataplane/: what its files share. Nothing outside this
 * folder includes it.
 *
 *   conn.c         connections: dialing, the listener that files accepted
 *                  ones, the two connection tables, start and stop
 *   transfer.c     the transfer engine: frames on non-blocking sockets, all of
 *                  a call's transfers progressing together, aborts; a call's
 *                  plan (its connections and messages)
 *   collectives.c  ring and direct exchanges; allreduce .. alltoall
 *   p2p.c          send and recv
 *   refuse.c       a member that will not take part in a call (dp_refuse)
 *   reduce_ops.c   the typed element-wise reductions (reduce_ops.h)
 *   wire.c         handshake and frame headers as pure functions (wire.h)
 *   shm.c          same-host messages: sealed memfds, checked and mapped
 *
 * Wire format, connection rules and failure rules: conn.c's and transfer.c's
 * opening comments. Functions shared between the files are prefixed dp__. */
#ifndef MESHD_AGENT_DATAPLANE_DP_INTERNAL_H
#define MESHD_AGENT_DATAPLANE_DP_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "dataplane.h"
#include "reduce_ops.h"
#include "wire.h"

#define DP_CHUNK ((size_t)1 << 20)       /* bytes per frame */
#define DP_DIRECT_MAX ((size_t)64 << 10) /* ring above this many bytes per member */
/* Accepted connections not proven yet (reading their hello, or holding one
 * for a call that has not started here): at most DP_UNPROVEN_MAX, or a
 * quarter of the process's fd limit where that is less (the agent raises it
 * to the hard limit; the rest of the agent needs descriptors too), but at
 * least DP_UNPROVEN_MIN (dataplane_max_unproven). More than the listen
 * backlog (512) holds, so that whatever waits there ahead of a member is
 * taken in one pass. Beyond the cap one is closed for each newcomer (below);
 * a member's dialer redials, so strangers cannot crowd members out for long.
 * (Hellos proven for a known group aside: dataplane_expect.) */
#define DP_UNPROVEN_MAX 1024
#define DP_UNPROVEN_MIN 64
#define DP_HELLO_MS 5000 /* to send a complete hello (or timeout_ms, if shorter) */
/* With the cap full, a newcomer takes the place of the oldest socket that has
 * sent nothing once it is DP_SILENT_GRACE_MS old (a member's dialer writes
 * its whole hello as soon as our challenge reaches it), else of the oldest
 * unproven one once it is DP_EVICT_GRACE_MS old (mid-hello, or parked); until
 * then accepting pauses (new connections wait in the listen backlog). The
 * graces let the hellos of a burst of members be read (those of a known group
 * leave the cap) before any of it is closed, so a burst is not cut by its own
 * arrival; the short one keeps sockets that never speak from holding members
 * back: a flood of them passes at DP_UNPROVEN_MAX per DP_SILENT_GRACE_MS. */
#define DP_SILENT_GRACE_MS 100
#define DP_EVICT_GRACE_MS 500
/* Connections accepted in a row before the hellos already here are read. */
#define DP_ACCEPT_BURST 64
/* A peer's "host:port" and its NUL: what an instruction may name (agent/validate.h
 * VALIDATE_ADDRESS_MAX, 255; Kubernetes service names run past 90). Shorter,
 * a long address was cut: no link matched it again, and no loss was seen. */
#define DP_ADDR_MAX 256
#define DP_DEAD_MAX 32 /* peers declared lost that calls in progress still check */
#define DP_FAILED_MAX 64 /* failed calls whose late hellos are still answered (failed_call_t) */
/* A broadcast of this many bytes or more goes to a same-host member as one
 * shared-memory frame (shm.c) instead of its bytes. */
#define DP_SHM_MIN ((size_t)1 << 20)

/* ------------------------------------------------------------------ helpers */

static inline int64_t dp__now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline size_t dp__min(size_t a, size_t b) { return a < b ? a : b; }

typedef struct call call_t; /* one public call (transfer.c, below) */

/* ------------------------------------------------------- conn.c: connections */

/* A connection, owned by its table (while linked) and by each call using it:
 * refs counts both; the last put closes the socket. refs, linked and next
 * are guarded by dataplane.mu; the rest belongs to the call using it. */
typedef struct conn {
  struct conn *next;
  int fd;
  int refs;
  bool linked;
  uint64_t comm_id;
  uint32_t peer;
  uint64_t seq; /* frames sent (dialed conn) or received (accepted conn) */
  int64_t used_ms; /* a dialed conn: when a call last took it (mu) */
  /* An accepted conn: the latest call known on it, the one its dialer dialed
   * for (the hello's) or a later frame's; by the call holding it, or under mu. */
  uint64_t last_call;
  /* An accepted conn, where a call that fell behind stopped reading: the
   * header bytes it read of the next frame (all of a later call's header, or
   * part of one), with the memfd that came with them (+ 1; 0: none); or the
   * bytes of a frame it was reading still to skip. The next call goes on
   * from there (transfer.c). */
  size_t held_len;
  uint8_t held_hdr[DP_HDR_LEN];
  int held_rfd;
  size_t skip_left;
  bool local;   /* a unix socket to an agent on this host: it can pass memfds */
  uint8_t secret[DP_SECRET_LEN]; /* the group secret its handshake proved */
  char addr[DP_ADDR_MAX];
} conn_t;

/* A peer the server declared lost (dataplane_peer_lost): gen is the
 * generation its latest declaration made (0: an unused entry). */
typedef struct dead_peer {
  uint64_t gen;
  uint32_t rank;
  char addr[DP_ADDR_MAX];
  char why[200];
} dead_peer_t;

/* A call that failed here (dp__plan_finish) or was refused (dp_refuse): for
 * timeout_ms, while no call of its comm runs here, a hello of that call (or
 * an older one) from a member of its group is acked, then answered with an
 * abort carrying `why` (conn.c's listener), so that a member that dials for
 * it after we left it learns why at once instead of waiting out its
 * timeout. */
typedef struct failed_call {
  uint64_t comm_id;
  uint8_t *member_secrets; /* the group's pair secrets (owned), or NULL */
  /* Hellos of calls call..last are answered, with an abort of `last` (which
   * fails a peer at any of them, transfer.c) */
  uint64_t call, last;
  uint32_t *ranks; /* the group's members (owned) */
  size_t n;
  uint8_t secret[DP_SECRET_LEN];
  int64_t until_ms;
  char why[DP_ABORT_MAX + 1];
} failed_call_t;

/* A group whose call is coming (dataplane_expect): hellos of its members
 * that come before the call are proven against it and held outside
 * DP_UNPROVEN_MAX. Owns its arrays. */
typedef struct known_group {
  uint64_t comm_id;
  uint32_t *ranks;
  size_t n;
  uint8_t secret[DP_SECRET_LEN];
  uint8_t *member_secrets; /* n * DP_SECRET_LEN, or NULL */
} known_group_t;

struct dataplane {
  _Atomic uint32_t rank; /* the world rank: --rank, else the server's Hello's */
  int timeout_ms;
  int port;
  int lfd;
  int ufd;        /* the same-host listener (abstract unix socket), or -1 */
  bool same_host; /* dial same-host peers on their unix socket (dataplane_same_host) */
  int wake[2];
  pthread_t listener;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* an accepted connection was filed; a call left; stopping */
  conn_t *ins;       /* accepted: we receive from (comm_id, peer) */
  conn_t *outs;      /* dialed: we send to (comm_id, peer) */
  size_t max_outs;   /* idle dialed ones kept (dataplane_max_links) */
  bool stopping;
  int active; /* calls in progress */
  /* Ring scratch buffers kept between calls: a fresh 100 MB malloc per call
   * would page-fault (and zero) every page again. One per concurrent call. */
  struct scratch *spare;
  int nspare;
  /* Peers declared lost, the last DP_DEAD_MAX addresses (mu), one entry
   * each; gen counts the declarations (atomic: calls compare it with the one
   * they started at, lock-free). */
  dead_peer_t dead[DP_DEAD_MAX];
  _Atomic uint64_t gen;
  /* The groups of the calls in progress, against which the listener checks
   * hellos (mu): regs[i] registered as reg_ids[i]. */
  dp_wire_group_t *regs;
  uint64_t *reg_ids;
  call_t **reg_calls; /* the calls themselves (dataplane_drop_comm fails them) */
  size_t nregs, capregs;
  uint64_t next_reg;
  int parked; /* hellos the listener holds for a call not registered yet (mu) */
  /* Of those, the ones proven for a known group (outside DP_UNPROVEN_MAX),
   * and the groups (oldest first; mu). At most one per member of each. */
  size_t held;
  known_group_t known[DP_KNOWN_MAX];
  size_t nknown;
  /* The listener's epoll set: the wake pipe, the listening sockets and the
   * sockets not admitted yet (listener thread only, conn.c); the cap on the
   * unproven ones among them (dataplane_max_unproven). */
  int ep;
  _Atomic size_t unproven_max;
  _Atomic int silent_grace_ms; /* DP_SILENT_GRACE_MS (dataplane_silent_grace) */
  /* Out of descriptors with a connection waiting, the listener backs off;
   * each descriptor of ours closed meanwhile (conn.c's close_ours) wakes it
   * to accept again at once: counted in fds_closed, and a wake-up if
   * accept_waits. */
  _Atomic uint64_t fds_closed;
  _Atomic bool accept_waits;
  _Atomic int accept_backoff_ms; /* DP_ACCEPT_BACKOFF_MS (dataplane_accept_backoff) */
  /* Comms whose session ended here (dataplane_end_comm): a call registered
   * on one is dropped at once (mu). */
  uint64_t *ended;
  size_t nended, capended;
  failed_call_t failed[DP_FAILED_MAX]; /* oldest first (mu) */
  size_t nfailed;
  _Atomic uint64_t rejected[DP_REJECT_COUNT];
  _Atomic uint64_t withdrawn; /* unproven connections their dialer closed (no rejection) */
  _Atomic uint64_t aborts[DP_ABORT_COUNT];
  _Atomic uint64_t shm_in, shm_mapped; /* dataplane_shm_received */
  /* The listener's warn lines about refused connections: at most a few per
   * window, then one saying how many it left out (listener thread only). */
  int64_t log_window_ms;
  int log_lines;
  uint64_t log_skipped;
};

/* Every public call brackets its work: enter fails (UNAVAILABLE) once the
 * data plane is stopping; stop waits for every entered call to leave. */
int dp__call_enter(dataplane_t *dp, const char *what, meshd_error_t *err);
void dp__call_leave(dataplane_t *dp);
bool dp__stopping(dataplane_t *dp);

/* While a call runs, hellos of its group's members are admitted: cl's
 * comm_id, members and secret (which must outlive the registration). *id
 * for dp__unregister. 0, or -1 with err (QUOTA). */
int dp__register(dataplane_t *dp, call_t *cl, uint64_t *id, meshd_error_t *err);
void dp__unregister(dataplane_t *dp, uint64_t id); /* 0: a no-op */

/* A scratch buffer of at least `bytes` (kept between calls); NULL when out of
 * memory. put(NULL) is a no-op. */
uint8_t *dp__scratch_get(dataplane_t *dp, size_t bytes);
void dp__scratch_put(dataplane_t *dp, uint8_t *data);

/* The connection on which we send to `peer` on comm_id: the cached one if it
 * is alive, still goes to `addr` and proved cl's secret, else a fresh one
 * dialed before deadline, whose handshake proves the secret both ways (a peer
 * that closes it unproven is dialed again: it may have been crowded out).
 * Returned with a reference (dp__conn_put). NULL with err (REMOTE_FAILURE
 * naming the peer) when it cannot be reached or does not prove the secret. */
conn_t *dp__get_out(dataplane_t *dp, const call_t *cl, uint32_t peer, const char *addr,
                    int64_t deadline, meshd_error_t *err);
/* Waits until `peer` has dialed us on comm_id and proved cl's secret,
 * returning that connection with a reference. While waiting it watches the call's send connections `watch`:
 * when a peer writes on one (an abort or EOF), it returns NULL with *fired
 * set to its index and err untouched. NULL with err past the deadline. */
conn_t *dp__get_in(dataplane_t *dp, const call_t *cl, uint32_t peer, const char *addr,
                   int64_t deadline, const conn_t *const *watch, size_t nwatch, size_t *fired,
                   meshd_error_t *err);
/* 0, or -1 with err when a member of cl's group was declared lost after cl
 * started (AGENT_LOST naming the member), or cl's comm was dropped here
 * meanwhile (dataplane_drop_comm: REMOTE_FAILURE). Lock-free when neither. */
int dp__check_lost(dataplane_t *dp, const call_t *cl, meshd_error_t *err);
void dp__conn_put(dataplane_t *dp, conn_t *c);
/* Whether a call besides the caller (and the table) holds dialed link c. */
bool dp__conn_busy(dataplane_t *dp, const conn_t *c);
/* Whether an accepted link of cl's comm that no call holds, proving cl's
 * secret for its peer, starts with an abort of cl's call or a later one:
 * then why gets "rank R aborted: <text>" (the frame is left where it is). */
bool dp__abort_pending(dataplane_t *dp, const call_t *cl, char *why, size_t len);
/* Whether the agent at addr is among the last DP_DEAD_MAX declared lost. */
bool dp__declared_lost(dataplane_t *dp, const char *addr);
/* Whether the peer of accepted link c has dialed another one on its comm
 * since: c will carry nothing more. */
bool dp__superseded(dataplane_t *dp, const conn_t *c);
/* Takes c out of its table (if still there) and shuts its socket down, so
 * that a call still using it fails and the next call dials afresh. */
void dp__conn_discard(dataplane_t *dp, conn_t *c);
/* Discards every connection of comm_id, in both directions. */
void dp__drop_comm(dataplane_t *dp, uint64_t comm_id);
/* After call `call` of comm_id failed here: writes an abort frame carrying
 * `why` on each accepted link of the comm (from `peer` only, unless it is
 * DP_ANY_PEER; proving `secret` only, unless it is NULL) no call took that
 * serves this call or an older one (its next frame's call, else the one its dialer dialed it
 * for or the latest frame's), so that a peer whose link no call here has
 * taken yet learns the root cause too. The links stay open: a peer that
 * moved on to a later call on one reads the abort as an older call's and
 * goes on (transfer.c). */
#define DP_ANY_PEER UINT32_MAX
void dp__abort_untaken(dataplane_t *dp, uint64_t comm_id, uint64_t call, uint32_t peer,
                       const uint8_t *secret, const char *why);
/* Records calls g->call..last of g's comm as failed here, answered with `why`
 * (failed_call_t; not call 0, which cannot tell one call from the next),
 * dropping expired records (and the oldest beyond DP_FAILED_MAX), and has the
 * listener look again at the hellos it holds. Best effort: without memory
 * nothing is recorded. */
void dp__failed_call_add(dataplane_t *dp, const dp_group_t *g, uint64_t last, const char *why);

/* ------------------------------------------------ transfer.c: the engine */

/* One message on a connection. Send: buf[0, len) leaves in frames, frame k only
 * once *gate >= its end (gate NULL: all ready). Receive: frames land in buf; with
 * `into`, each completed frame is then reduced into `into` at the same offset.
 *
 * Shared memory (shm.c), on a local connection only: a send whose *shm holds
 * a sealed memfd of the message's bytes sends that instead (once the whole
 * message is past its gate; while *shm is empty and nothing is past the gate,
 * it waits, for a receive may yet bring one). A receive takes either; a memfd
 * it gets is kept in *shm (shm NULL: closed) after landing in buf: mapped over
 * it copy-on-write when `map` (buf is the caller's own page-aligned private
 * mapping, dp_group_t.mappable), else copied. */
typedef struct msg {
  uint8_t *buf;
  size_t len;
  uint8_t *into;
  const size_t *gate;
  int *shm;
  bool map;
  size_t done; /* bytes sent, or received (and reduced) */
  size_t frames;
} msg_t;

/* A sequence of messages on one connection in one direction. */
typedef struct xfer {
  conn_t *c;
  bool send;
  msg_t *msgs;
  size_t nmsgs, cur;
  bool in_frame, blocked;
  uint8_t hdr[DP_HDR_LEN];
  size_t hdr_done, flen, fdone;
  bool skip;                    /* the frame in progress is of an older call: read and dropped */
  bool stale, mine;             /* frames of an older call, of this call, came on c */
  bool superseded;              /* c closed with nothing of this call, and its peer dialed anew */
  bool shm;                     /* the frame in progress is a shared-memory one */
  uint8_t pay[DP_SHM_PAYLOAD];  /* its payload */
  int rfd;                      /* a descriptor received with it, + 1 (0: none) */
  bool stray_fd;                /* a descriptor came that no frame asked for */
} xfer_t;

/* One public call: what received chunks are reduced with, and the root cause
 * of its failure, which abort frames pass on to the peers. */
struct call {
  dataplane_t *dp;
  const char *what;
  const dp_group_t *g; /* its members (a send or recv: the one peer) */
  uint64_t gen;        /* dp->gen when it started: later losses of a member fail it */
  uint64_t comm_id;
  uint64_t call;         /* dp_group_t.call: every frame carries it */
  /* The last call a peer's abort that ended it named (dp_refuse's cover an
   * instruction's calls): its own aborts and failure record cover as many. */
  uint64_t upto;
  _Atomic bool dropped;  /* dataplane_drop_comm closed its comm while it ran */
  bool refusal;          /* a dp_refuse: registered for drops only, not to take hellos */
  const uint8_t *secret; /* the group's, DP_SECRET_LEN bytes */
  dtype_t dtype;
  reduction_t op;
  char root[sizeof((meshd_error_t *)0)->msg];
  /* Set where the call fails for a reason the error kind does not tell
   * (DP_ABORT_TIMEOUT, DP_ABORT_PEER_ABORTED); else from the kind. */
  int abort_reason; /* dp_abort_t + 1; 0: not set */
};

/* The comm timeout of a call of group g (NULL: none): the group's own, else
 * the data plane's. */
static inline int dp__timeout(const dataplane_t *dp, const dp_group_t *g) {
  return g && g->timeout_ms > 0 ? g->timeout_ms : dp->timeout_ms;
}

/* The secret cl's link with world rank `peer` proves: the pair's, where the
 * group has them (dp_group_t.pair_secrets), else the group's. */
static inline const uint8_t *dp__link_secret(const call_t *cl, uint32_t peer) {
  const dp_group_t *g = cl->g;
  if (g && g->pair_secrets)
    for (size_t i = 0; i < g->n; i++)
      if (g->ranks[i] == peer) return g->pair_secrets + i * DP_SECRET_LEN;
  return cl->secret;
}

/* The last call a failure of cl covers: its own, or a later one a peer's
 * abort named. */
static inline uint64_t dp__upto(const call_t *cl) { return cl->upto > cl->call ? cl->upto : cl->call; }

/* A call's transfers and the messages they carry (owned by the plan). */
typedef struct plan {
  call_t cl;
  xfer_t *xs;
  size_t nx;
  msg_t *msgs;
  uint64_t reg; /* its group's registration (dp__register) */
  int shm;      /* the memfd its messages share (msg_t.shm), or -1 */
  bool link_only; /* a send or recv: a failure discards its own link, not the comm's */
} plan_t;

/* The call's comm_id and secret are g's; g must outlive the plan. nx
 * transfers and nmsgs messages, zeroed; g registered, so that its members'
 * hellos are admitted from now on. 0, or -1 with err (BAD_ARGUMENT without a
 * secret, QUOTA); either way dp__plan_finish must follow. */
int dp__plan_init(plan_t *p, dataplane_t *dp, const char *what, const dp_group_t *g, dtype_t dtype,
                  reduction_t op, size_t nx, size_t nmsgs, meshd_error_t *err);
/* Connects xs[k]: sending to, or receiving from, g's member `peer`. */
int dp__plan_connect(plan_t *p, const dp_group_t *g, size_t k, size_t peer, bool send,
                     int64_t deadline, meshd_error_t *err);
/* Runs every transfer to completion, or fails after timeout_ms without
 * progress (naming the peer at fault, or passing on a peer's abort). */
int dp__plan_run(plan_t *p, meshd_error_t *err);
/* Unregisters the group, releases the plan's connections and memory. On
 * failure (rc != 0) it first counts the abort (a call that began), then: a
 * call that fell behind (DP_ABORT_BEHIND) leaves its links for the next call
 * (transfer.c); any other sends its abort notice on its links and closes
 * them, and a collective (not link_only) also on the links of this call it
 * had not taken (dp__abort_untaken). Returns rc. */
int dp__plan_finish(plan_t *p, int rc, const meshd_error_t *err);

/* ------------------------------------------------ shm.c: same-host messages */

/* A sealed memfd (no write, grow or shrink: a receiver may map it) holding a
 * copy of buf[0, len); -1 with errno when the kernel has none. */
int dp__shm_create(const void *buf, size_t len);
/* Lands the memfd `fd` a peer passed for a message of len bytes in buf:
 * mapped over it copy-on-write when `map` and buf is page-aligned, else
 * copied. 1 when mapped, 0 when copied, -1 with `why` when fd is not a
 * sealed memfd of exactly len bytes (nothing written to buf then). */
int dp__shm_land(int fd, uint8_t *buf, size_t len, bool map, char *why, size_t whylen);

#endif
