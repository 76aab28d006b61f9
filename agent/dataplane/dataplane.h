/* The agents' TCP transport: the data plane between agents, used by the whole
 * agent — collectives (reduce) and point-to-point sends (to_mesh) of the cpu
 * backend and of cuda:emulated, and the NCCL bootstrap of real cuda devices.
 * Every agent listens on a data port it reports at registration
 * (RegisterRequest.data_port); the server puts each peer's "host:port" into the
 * instructions (Group.addresses, SendTensor.peer_address), so the data plane
 * needs no directory of its own. main.c starts it; the backends reach it
 * through backend_t.net.
 *
 * Buffers are host memory, contiguous, `count` elements of `dtype`. Every call
 * is blocking, must be entered by every member of the group with the same
 * comm_id, call number and arguments, and fails on every rank within `timeout_ms` if a peer
 * disappears (REMOTE_FAILURE / AGENT_LOST naming the peer) — never hangs.
 * Thread-safe: different comm_ids may run concurrently (one per stream).
 *
 * Only members: every group carries a secret from the server (Group.secret,
 * SendTensor.secret). A connection is admitted only once its hello proves that
 * secret over a fresh nonce of the acceptor (wire.h), and the acceptor proves
 * it back before the dialer sends a byte; anything else is closed before a
 * byte of payload is read, and counted (dataplane_rejected). Strangers cannot
 * make a member's call fail or wait: unproven connections have a deadline and
 * a cap, beyond which one is closed for each newcomer, a silent one first (a
 * member's dialer simply redials).
 *
 * Inside (agent/dataplane/): conn.c connections and listener, transfer.c the
 * transfer engine, collectives.c, p2p.c, reduce_ops.c (dp_internal.h), wire.c
 * the wire format as pure functions (wire.h). */
#ifndef MESHD_AGENT_DATAPLANE_DATAPLANE_H
#define MESHD_AGENT_DATAPLANE_DATAPLANE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "error_kind.h"
#include "reduction.h"

/* Reductions are the catalogue's (reduction.h); the data plane runs those
 * that combine elements (every one but stack), with reduce_ops.h's
 * semantics. */

typedef struct dataplane dataplane_t;

/* Bytes of a group's secret: HMAC-SHA256(session key, comm_id) on the server. */
#define DP_SECRET_LEN 32

/* A group: `n` members in group order; ranks[i] is at addrs[i] ("host:port");
 * `me` is this agent's index in it. */
typedef struct dp_group {
  uint64_t comm_id;
  /* Which call of the comm this is, the same on every member and growing
   * from call to call (the server's Group.call, times the steps of an
   * instruction): every frame carries it (wire.h), so a member that starts a
   * call after its peers gave up on it fails at once (DP_ABORT_BEHIND) and
   * catches up with them, instead of pairing with their next call. */
  uint64_t call;
  uint64_t session; /* key of the owning session (backend session_end); the data plane ignores it */
  const uint32_t *ranks;
  const char *const *addrs;
  size_t n;
  size_t me;
  /* The call fails when a member is declared lost after dataplane_generation()
   * returned *since (dataplane_peer_lost); NULL: after the call began. An
   * instruction that checks its peers first passes the generation it read
   * before that check, so no loss falls between the two. */
  const uint64_t *since;
  /* DP_SECRET_LEN bytes every member holds (the instruction's Group.secret):
   * connections of the call must prove it. Required when n > 1. */
  const uint8_t *secret;
  /* The call's comm timeout (see above) in ms; 0: the data plane's
   * (dataplane_start). For a caller whose comms differ in it (a test's
   * chaos of late members, and its calls that must not fail on a loaded
   * machine's stall). */
  int timeout_ms;
  /* n * DP_SECRET_LEN bytes, or NULL: entry i is the secret of this member's
   * links with member i (Group.pair_secrets), which they prove instead of
   * `secret`, so that no member can pass for another (entry me unused). */
  const uint8_t *pair_secrets;
  /* Broadcast: buf is the caller's own private mapping (page-aligned, every
   * page of it the caller's alone), whose pages a same-host broadcast may
   * replace with copy-on-write ones of the source's memfd instead of copying
   * into them. false: buf is only written. */
  bool mappable;
} dp_group_t;

/* Why the listener closed a connection before admitting it. */
#define DP_REJECT_MAP(XX)                                                                   \
  XX(BAD_PROOF, "bad_proof")               /* a member's comm and rank, a wrong mac */     \
  XX(UNKNOWN_GROUP, "unknown_group")       /* no call here had that comm and member */    \
  XX(HELLO_TIMEOUT, "hello_timeout")       /* no complete hello within the deadline */    \
  XX(TOO_MANY_PENDING, "too_many_pending") /* the oldest of too many unproven ones */     \
  XX(MALFORMED, "malformed")               /* not a hello of this version, or not to us */
typedef enum {
#define XX(name, str) DP_REJECT_##name,
  DP_REJECT_MAP(XX)
#undef XX
  DP_REJECT_COUNT
} dp_reject_t;
/* "bad_proof", ... (the metric's reason label); "?" out of range. */
const char *dp_reject_name(dp_reject_t reason);
/* Unproven connections whose dialer closed them (before its hello's first
 * byte, or while it waited for our ack): no rejection -- a member that gave
 * up dialing, or a probe (0 for NULL). */
uint64_t dataplane_withdrawn(const dataplane_t *dp);
/* Connections closed so far for `reason` (0 for NULL or out of range). */
uint64_t dataplane_rejected(const dataplane_t *dp, dp_reject_t reason);

/* Why a call (a collective or a send) failed after it began; each failed
 * call counts once on every member where it failed (dataplane_aborts). */
#define DP_ABORT_MAP(XX)                                                                   \
  XX(AGENT_LOST, "agent_lost")     /* a member was declared lost (dataplane_peer_lost) */  \
  XX(TIMEOUT, "timeout")           /* a peer did not connect or move a byte in time */     \
  XX(PEER_ABORTED, "peer_aborted") /* a peer failed first and sent its abort notice */     \
  XX(BEHIND, "behind")             /* a peer was at a later call: this member fell behind */ \
  XX(REFUSED, "refused")           /* this member failed before it joined (dp_refuse) */     \
  XX(ERROR, "error")               /* anything else: a closed connection, shutdown, OOM */
typedef enum {
#define XX(name, str) DP_ABORT_##name,
  DP_ABORT_MAP(XX)
#undef XX
  DP_ABORT_COUNT
} dp_abort_t;
/* "agent_lost", ... (the metric's reason label); "?" out of range. */
const char *dp_abort_name(dp_abort_t reason);
/* Calls failed so far for `reason` (0 for NULL or out of range). */
uint64_t dataplane_aborts(const dataplane_t *dp, dp_abort_t reason);

/* Messages received as shared memory from same-host peers, and of them
 * those mapped rather than copied (0 for NULL). */
uint64_t dataplane_shm_received(const dataplane_t *dp, uint64_t *mapped);

/* Listens on host:0 (e.g. "127.0.0.1", "0.0.0.0"), and on the abstract unix
 * socket "@meshd-dp:PORT" for peers on this host. NULL with err on failure. */
dataplane_t *dataplane_start(const char *host, uint32_t my_rank, int timeout_ms,
                             meshd_error_t *err);
int dataplane_port(const dataplane_t *dp);
/* The world rank the server gave this agent (its Hello), for an agent started
 * without --rank: hellos to peers and admissions name it. */
void dataplane_set_rank(dataplane_t *dp, uint32_t rank);
/* Whether this agent dials peers on its own host (a loopback address or one
 * of its interfaces') on their unix socket, which passes large broadcasts as
 * shared memory; on by default. Off: TCP to every peer. Set before the first
 * call. */
void dataplane_same_host(dataplane_t *dp, bool on);
/* Fails every call in progress at once (UNAVAILABLE "the data plane is
 * stopping"; peers waiting on this agent fail too: its connections close),
 * waits until each has returned, and stops listening. Calls made afterwards
 * fail the same way at once. The data plane stays allocated, so a worker
 * that still holds it may call in safely; repeating it is a no-op. */
void dataplane_shutdown(dataplane_t *dp);
/* The server declared the agent at addr ("host:port", world rank `rank`)
 * lost: every call in progress whose group includes that address fails at
 * once with AGENT_LOST ("<what> on comm N: rank R at ADDR was lost: why"),
 * here and wherever it waits (dialing, waiting for a connection, moving
 * bytes); connections to it are closed. Calls that start afterwards are not
 * affected (a replacement may take the address again), unless their group's
 * `since` is older. */
void dataplane_peer_lost(dataplane_t *dp, const char *addr, uint32_t rank, const char *why);
/* Closes this agent's connections of channel comm_id, both directions (the
 * session that used it ended); a call using one fails, even one still
 * waiting to connect, and a later one dials afresh. */
void dataplane_drop_comm(dataplane_t *dp, uint64_t comm_id);
/* The session that used channel comm_id ended here: dataplane_drop_comm, and
 * until dataplane_forget_comm every call that starts on it fails at once as
 * well (a worker already running an instruction of the session may join its
 * call after the drop: its peers have left, and it waited out timeout_ms). */
void dataplane_end_comm(dataplane_t *dp, uint64_t comm_id);
/* No call of comm_id's session can start any more (its workers are gone). */
void dataplane_forget_comm(dataplane_t *dp, uint64_t comm_id);
/* This agent will run a call of g's group (an instruction of it is queued
 * here, behind others): from now on a hello of a member of g (comm_id,
 * ranks, secret and pair_secrets are copied; addrs, me and call are not
 * used) that comes before the call starts is proven at once and held
 * outside the cap on unproven connections (dataplane_max_unproven, which
 * strangers can fill), up to one per member of each group known this way; so that
 * more members than that cap dialing a late member wait for it instead of
 * being closed and redialing. Known until its comm ends or is forgotten
 * (dataplane_end_comm, dataplane_forget_comm), or past the last
 * DP_KNOWN_MAX groups. 0; -1 (out of memory, no secret, one member) when
 * nothing changes: the hellos are held as before. */
#define DP_KNOWN_MAX 64
int dataplane_expect(dataplane_t *dp, const dp_group_t *g);
/* Hellos the listener holds now for calls that have not started here (0 for
 * NULL); *proven (if not NULL): how many of them proved a group of
 * dataplane_expect's. */
size_t dataplane_parked(dataplane_t *dp, size_t *proven);
/* Closes this agent's link of channel comm_id to (outgoing) or from the agent
 * of world rank `peer`: a point-to-point transfer on a shared channel failed
 * here between its calls, and its peer should fail now rather than wait out
 * the timeout. The channel's other links, and calls on them, go on. */
void dataplane_drop_link(dataplane_t *dp, uint64_t comm_id, uint32_t peer, bool outgoing);

/* Connections are kept between calls, one per (comm, peer, direction). Of
 * those this agent dialed it keeps at most `n` idle ones (default
 * DP_LINKS_DEFAULT), closing the least recently used beyond that with a
 * goodbye the peer understands (wire.h), so a session that makes many
 * comms (meshes sliced in a loop) cannot exhaust file descriptors; a call
 * on a closed one dials again. Set before the first call. */
#define DP_LINKS_DEFAULT 256
void dataplane_max_links(dataplane_t *dp, size_t n);
/* The cap on accepted connections not proven yet (strangers' among them),
 * past which one is closed for each newcomer (dp_internal.h): by default
 * 1024, or a quarter of the process's fd limit at dataplane_start where that
 * is less, but at least 64 (meshd-agent --data-max-unproven). For a test
 * that crowds a listener with fewer sockets, or a process short of
 * descriptors. Out of descriptors with a connection waiting, the listener
 * closes the unproven socket this cap would close first (past its grace). */
void dataplane_max_unproven(dataplane_t *dp, size_t n);
/* How long past the cap a socket that has sent nothing is kept before a
 * newcomer takes its place (default 100 ms, dp_internal.h); one part-way
 * through its hello is kept 500 ms, or as long where this is longer. For a
 * test whose burst of members overflows a lowered cap on a loaded machine,
 * where their dialers may take longer than that to answer the challenge. */
void dataplane_silent_grace(dataplane_t *dp, int ms);
/* Out of descriptors with a connection waiting and no unproven socket it may
 * close yet, the listener pauses accepting until a descriptor of the data
 * plane's closes (a link, a socket it held: then at once), or `ms` pass
 * (default 100 ms: another part of the process may free one). For a test
 * that tells the two apart. */
void dataplane_accept_backoff(dataplane_t *dp, int ms);
/* Whether the listener pauses so now, waiting for a descriptor (tests). */
bool dataplane_accept_paused(dataplane_t *dp);
/* Connections this agent holds now, dialed and accepted (0 for NULL). */
size_t dataplane_links(dataplane_t *dp);
/* Bytes of ring scratch kept between calls (at most 4 segments of 16 MiB or
 * less; a bigger one is freed when its call ends). */
size_t dataplane_scratch_bytes(dataplane_t *dp);

/* How many peers were declared lost so far (see dp_group_t.since). */
uint64_t dataplane_generation(dataplane_t *dp);

/* dataplane_shutdown, then frees dp: only once nothing can call in any more
 * (the agent: after every executor is freed). NULL is a no-op. */
void dataplane_stop(dataplane_t *dp);

/* In place: buf becomes the reduction of every member's buf. */
int dp_allreduce(dataplane_t *dp, const dp_group_t *g, void *buf, size_t count, dtype_t dtype,
                 reduction_t op, meshd_error_t *err);
/* in: n * count elements; out: count elements, this member's reduced slice. */
int dp_reduce_scatter(dataplane_t *dp, const dp_group_t *g, const void *in, void *out,
                      size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err);
/* in: count elements; out: n * count, member i's in at slice i. */
int dp_allgather(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                 dtype_t dtype, meshd_error_t *err);
/* in/out: n * count; out slice i = member i's in slice `me`. */
int dp_alltoall(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                dtype_t dtype, meshd_error_t *err);
/* Rooted (reduce onto a sub-mesh): member `root` (an index of g) ends with
 * buf reduced over the members; the others' buf is scratch afterwards. */
int dp_reduce_root(dataplane_t *dp, const dp_group_t *g, size_t root, void *buf, size_t count,
                   dtype_t dtype, reduction_t op, meshd_error_t *err);
/* in: count elements; on the root, out (n * count) gets member i's in at
 * slice i; the others' out is not touched (may be NULL). */
int dp_gather_root(dataplane_t *dp, const dp_group_t *g, size_t root, const void *in, void *out,
                   size_t count, dtype_t dtype, meshd_error_t *err);
/* Member 0's buf (bytes long) to every member, down the chain of g's order:
 * each forwards what it has received while it receives. */
int dp_broadcast(dataplane_t *dp, const dp_group_t *g, void *buf, size_t bytes, meshd_error_t *err);
/* Point to point on channel comm_id, call `call` (as dp_group_t.call; both
 * ends pass the same): bytes to/from the agent at addr (rank); secret:
 * DP_SECRET_LEN bytes both ends hold (SendTensor.secret). */
int dp_send(dataplane_t *dp, uint64_t comm_id, uint64_t call, const uint8_t *secret,
            uint32_t to_rank, const char *addr, const void *buf, size_t bytes, meshd_error_t *err);
int dp_recv(dataplane_t *dp, uint64_t comm_id, uint64_t call, const uint8_t *secret,
            uint32_t from_rank, const char *addr, void *buf, size_t bytes, meshd_error_t *err);
/* dp_send (send) or dp_recv with a comm timeout of its own, as
 * dp_group_t.timeout_ms (0: the data plane's). */
int dp_p2p(dataplane_t *dp, bool send, int timeout_ms, uint64_t comm_id, uint64_t call,
           const uint8_t *secret, uint32_t rank, const char *addr, void *buf, size_t bytes,
           meshd_error_t *err);

/* What a member refuses (dp_refuse): a collective or broadcast of group g,
 * or its side of a point-to-point transfer (g: the one-member group of the
 * peer, as dp_send and dp_recv make; g->me is ignored). */
typedef enum { DP_REFUSE_GROUP, DP_REFUSE_SEND, DP_REFUSE_RECV } dp_refuse_t;
/* This member will not take part in the `calls` calls of g's comm from
 * g->call on (an instruction's steps: a collective and its failure flag),
 * which it was sent: it failed before it could (no memory for its buffers,
 * no device stream). Its peers fail at whichever of those calls they are,
 * at once, with `why` (PEER_ABORTED, the message naming this rank), instead
 * of waiting out timeout_ms for it:
 *   - each peer that waits for a connection from us gets one carrying an
 *     abort frame (a group: every member is dialed; a recv: nobody);
 *   - links of the comm no call holds here get one (dp__abort_untaken);
 *   - for timeout_ms, hellos of those calls are answered with an ack and an
 *     abort, so a peer that dials us later learns it as well (as every
 *     failed call's hellos are: conn.c).
 * Blocks until every peer to dial took its notice (a peer still busy before
 * the call: until it gets there, as the call would have), or until
 * timeout_ms; counts DP_ABORT_REFUSED once. 0, or -1 with err naming a peer
 * that could not be told (it then fails at its timeout, as before). */
int dp_refuse(dataplane_t *dp, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
              const char *why, meshd_error_t *err);

/* A member that waits on a call outside the data plane (an NCCL collective
 * or send of a cuda:N agent) watches for a peer's refusal of it: while
 * watched, members' connections for g's comm are admitted (proving g's
 * secrets, as a call's are), so that a refusing peer's notice (dp_refuse)
 * lands here. g must outlive the watch; NULL when out of memory. */
typedef struct dp_watch dp_watch_t;
dp_watch_t *dp_watch_begin(dataplane_t *dp, const dp_group_t *g);
/* Whether a peer's abort of call g->call or a later one has come: then why
 * gets "rank R aborted: <its reason>". Does not block; cheap enough to poll
 * every millisecond. NULL: false. */
bool dp_watch_fired(dataplane_t *dp, dp_watch_t *w, char *why, size_t len);
void dp_watch_end(dataplane_t *dp, dp_watch_t *w); /* NULL: a no-op */

#endif
