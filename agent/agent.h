/* meshd-agent internals: who this agent is, the Agent service table, and the
 * thread that keeps the agent registered with the server. */
#ifndef MESHD_AGENT_H
#define MESHD_AGENT_H

#include <stddef.h>
#include <stdint.h>

#include "executor.h"
#include "grant.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "health.h"
#include "log.h"
#include "rpc.h"
#include "secret.h"

/* The health service name that is SERVING while the agent is registered. */
#define AGENT_HEALTH_SERVICE "meshd.agent.v1.Agent"

/* What this agent process is. Filled by main before any thread starts, then
 * read-only for the life of the process (so readers need no lock). */
typedef struct agent_info {
  char id[33];            /* 128 random bits in hex, made at start */
  const char *server;     /* --server: where to register */
  int server_timeout_ms;  /* --server-timeout: the registration's keepalive ack timeout */
  char address[256];      /* what the server dials back (--advertise or derived) */
  const char *device;     /* "cpu" */
  uint64_t memory_bytes;  /* capacity reported to the server */
  int32_t requested_rank; /* -1: any free rank */
  uint32_t data_port;     /* the data plane's port (0: none) */
  uint32_t instructions;  /* the newest Instruction body it says it runs (Hello) */
  uint32_t data_plane;    /* the newest data plane feature it has (Hello; 1: pair secrets) */
  bool clock;             /* Hello's reply carries its clock (HelloReply.unix_ms) */
  char data_address[256]; /* its "host:port" as peers reach it */
  run_env_t env;          /* backend, rank, stats: what instructions run with (run.h) */
  /* How to register (docs/operations.md "Cluster security"): .on = mTLS to the
   * server's cluster port (ca verifies the server under server_name, cert/key
   * are this agent's cluster certificate); join_token (NULL: none) is sent as
   * SECRET_JOIN_MD, its first token read again at each attempt. */
  rpc_tls_t cluster_tls;
  secret_file_t *join_token;
} agent_info_t;

/* This agent's world rank as the server's Hello named it; -1 before. */
extern _Atomic int64_t agent_rank;

/* ---- agent_service.c --------------------------------------------------- */

/* The meshd.agent.v1.Agent method table. Only implemented methods are listed;
 * the rpc layer answers the others with UNIMPLEMENTED. Returns the rows (static
 * storage) and their count in *n. Register them with the agent_info_t * as arg
 * (it must outlive the server), guarded by agent_auth_guard. */
const rpc_method_t *agent_service_methods(size_t *n);

/* ---- call_secret.c: who may call the Agent service ------------------------ */

/* A fresh call secret for a registration attempt (SECRET_HEX_LEN hex + NUL into
 * out): from now on only calls that carry it (metadata SECRET_AGENT_MD) are
 * admitted. -1 (and nobody admitted) if the CSPRNG fails. */
int agent_auth_renew(char *out);
/* Nobody is admitted (between registrations). */
void agent_auth_clear(void);
/* The current secret into out (SECRET_HEX_LEN + 1 bytes): 0, or -1 when not
 * registered now (out is then ""). */
int agent_auth_secret(char *out);
/* rpc_guard_fn for the Agent service (Hello, Execute, Read, Write): admits a
 * call carrying the current secret (constant-time compare) as "server"; a Read
 * or Write without it but with a transfer grant (GRANT_MD) whose signature
 * checks out as "grant", for its handler to check the rest
 * (transfer_grant_admit; a bad signature is refused here, before the request
 * is read); anything else gets UNAUTHENTICATED, logged (rate-limited) with
 * its peer. */
grpc_status_code agent_auth_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *msg,
                                  size_t msglen);
/* With cluster mTLS the Agent port takes TLS clients without a certificate
 * (the direct data path's Read and Write under a grant): guard_arg is the
 * agent_info_t, and when its cluster_tls is on agent_auth_guard admits the
 * call secret only from a peer whose cluster certificate the handshake
 * verified, and agent_peer_guard (for Health on that port) admits only such a
 * peer; both UNAUTHENTICATED otherwise. guard_arg NULL: no certificate check. */
grpc_status_code agent_peer_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *msg,
                                  size_t msglen);
/* Logs a refused call at warn with its method, peer and why, at most 10 lines
 * in 10 s per `limit` (then how many were not logged); `what` names them in
 * that line ("calls", "grants"). */
void agent_log_refused(log_limit_t *limit, rpc_call_t *call, const char *why, const char *what);

/* ---- transfer_grant.c: Read and Write by a client with a grant ------------ */

/* Whether the call was admitted by a grant rather than the call secret. */
bool transfer_grant_call(rpc_call_t *call);
/* Checks the call's grant (GRANT_MD) for a call of `direction`
 * (GRANT_READ/WRITE): signature with
 * the current call secret, expiry, direction, this agent's rank, and for a
 * Read the request's session, ref and after_seq (session NULL for a Write);
 * then takes its nonce (each is accepted once; remembered until the grant's
 * start-by time, at most --max-transfer-nonces at a time and
 * --max-transfer-nonces-per-session of one session's; a grant first
 * presented after its start-by time is refused as expired). 0 with *out (free with
 * protobuf_c_message_free_unpacked); else a gRPC code (PERMISSION_DENIED, or
 * RESOURCE_EXHAUSTED for a full nonce table or session share, its message
 * naming the flag) and msg naming the check. */
#define TRANSFER_NONCES 65536
/* The table's size (--max-transfer-nonces; TRANSFER_NONCES unless set: 0). */
void transfer_grant_set_max_nonces(size_t n);
/* One session's share of it (--max-transfer-nonces-per-session): n, at most
 * the whole table; 0 (unset): a quarter of the table, whatever its size. */
void transfer_grant_set_max_nonces_per_session(size_t n);
/* What became of the grants presented (meshd_transfer_grants_total{result}). */
enum {
  GRANT_ACCEPTED, GRANT_MALFORMED, GRANT_BAD_SIGNATURE, GRANT_EXPIRED, GRANT_WRONG_CALL,
  GRANT_REUSED, GRANT_TABLE_FULL, GRANT_SESSION_FULL, GRANT_UNREGISTERED, GRANT_REVOKED,
  GRANT_RESULT_COUNT
};
const char *transfer_grant_result_name(int result);
uint64_t transfer_grant_results(int result);
int transfer_grant_admit(rpc_call_t *call, int direction, const char *session, uint64_t ref,
                         uint64_t after_seq, Meshd__Agent__V1__TransferGrant **out, char *msg,
                         size_t msglen);
/* Frees a nonce transfer_grant_admit took: its call (of session, the
 * grant's) was refused for a cause not about the grant (QUOTA, a session not
 * open) before anything moved, and the client may present the grant again
 * until expiry_ms (the grant's expiry), past its start-by time too. Kept
 * even when the table is full meanwhile (within a bound). */
void transfer_grant_give_back(const uint8_t *nonce, const char *session, int64_t expiry_ms);
/* The nonce table itself, on the caller's clock (now, unix ms; tests give
 * theirs): take a nonce of session's, to be forgotten at forget_ms (its
 * grant's start-by time), -> NONCE_*; give one back, kept until expiry_ms;
 * forget them all. */
enum { NONCE_TAKEN, NONCE_TAKEN_BEFORE, NONCE_LATE, NONCE_TABLE_FULL, NONCE_SESSION_FULL,
       NONCE_REVOKED };
int transfer_nonce_take(const uint8_t *nonce, const char *session, int64_t forget_ms, int64_t now);
void transfer_nonce_give_back(const uint8_t *nonce, const char *session, int64_t expiry_ms,
                              int64_t now);
void transfer_nonces_clear(void);
/* Marks a nonce revoked until forget_ms (taken or not, given back or not; kept
 * past --max-transfer-nonces): taking it is NONCE_REVOKED from then on. */
void transfer_nonce_revoke(const uint8_t *nonce, const char *session, int64_t forget_ms,
                           int64_t now);
/* RevokeGrants (the Execute link, as it arrives): each nonce revoked for
 * keep_ms (at most REVOKE_KEEP_MAX_MS), and the Read or Write a nonce admitted
 * ended PERMISSION_DENIED if it still runs. */
#define REVOKE_KEEP_MAX_MS (24LL * 3600 * 1000)
void transfer_grants_revoke(const Meshd__Agent__V1__Instruction *ins);
/* For agent_auth_guard, before the request is read: 0 when the call's grant
 * carries this agent's server's signature and its nonce is not taken; 1 when
 * that cannot be told (not registered now: transfer_grant_admit refuses it)
 * or its nonce is taken (used or in use: a stranger's call until its handler
 * refuses it); else a refusal as transfer_grant_admit's (PERMISSION_DENIED,
 * counted: malformed, bad signature, expired) with msg. */
int transfer_grant_signed(rpc_call_t *call, char *msg, size_t msglen);

/* A call a grant admitted, watched until it ends: at its grant's expiry
 * (unix ms, this agent's clock) it is finished PERMISSION_DENIED ("transfer
 * grant expired before the Write finished ...; nothing was stored"), so a
 * client that stalls holds nothing past the time its server undoes the
 * transfer. Lives in the handler's state. */
typedef struct grant_watch {
  struct grant_watch *prev, *next;
  rpc_call_t *call;
  const char *what; /* "Read" or "Write" */
  uint8_t nonce[GRANT_NONCE_LEN]; /* its grant's: a revocation ends it too */
  int64_t expiry_ms;
  bool listed;
} grant_watch_t;
/* Watches the call (admitted by nonce's grant) until transfer_grant_unwatch, which the handler calls
 * before it lets go of the call (on_end, or its last reference). */
void transfer_grant_watch(grant_watch_t *w, rpc_call_t *call, const char *what,
                          const uint8_t *nonce, int64_t expiry_ms);
/* Idempotent; w may be one never watched (zeroed). */
void transfer_grant_unwatch(grant_watch_t *w);
/* Calls ended at their grant's expiry so far. */
uint64_t transfer_grant_watch_ended(void);
/* Ends the watching thread (the agent's exit, once no Read or Write runs): a
 * thread left waiting made every agent's exit wait out its bound for threads
 * (runtime_await_alone). Calls watched after it are only listed. */
void transfer_grant_watch_stop(void);

/* ---- data.c: Agent/Read and Agent/Write -------------------------------- */

void data_read_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg);
void data_write_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg);
void data_write_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg);
void data_write_end(rpc_call_t *call, bool cancelled, void *arg);
bool data_write_raw(rpc_call_t *call, rpc_bytes_t *msg, void *arg);
/* Reads waiting on a helper thread now (each until it is answered or
 * cancelled; a cancelled one lets go within 100 ms). For tests. */
int data_read_threads(void);
/* The helper threads of waiting Reads: started ever, and parked now, waiting
 * for the next one (tests). */
void data_read_helpers(unsigned long *started, int *parked);
/* At the agent's exit, once no Read can run any more (the server is
 * destroyed and every executor freed: a Read holds its executor until its
 * helper's job ends): the parked helpers end, and a job's last steps
 * (finished by then) are waited for, so that no thread of this file outlives
 * the agent's shutdown. */
void data_stop(void);

/* ---- registration.c ---------------------------------------------------- */

typedef struct registration registration_t;

/* Starts the thread that registers with info->server and re-registers, with
 * backoff, whenever the call ends. While registered and reached by the
 * server's dial-back, `health` has AGENT_HEALTH_SERVICE SERVING, otherwise
 * NOT_SERVING. `info` and `health` must
 * outlive registration_stop. Returns NULL (and logs) if the thread cannot start. */
registration_t *registration_start(const agent_info_t *info, health_t *health);
/* Cancels the registration call, wakes a backoff sleep, joins the thread and
 * frees everything. Prompt: it does not wait for the server. NULL is a no-op. */
void registration_stop(registration_t *reg);
/* The server's dial-back (Agent/Hello) reached this agent: with the call
 * secret of the attempt in progress, and once RegisterAccepted came, the
 * agent's readiness turns SERVING (the server counts it from then on). */
void registration_reached(rpc_call_t *hello);

#endif
