/* The pool of registered agents, indexed by world rank.
 *
 * Owned by main; every function is thread-safe. Agents enter on registration
 * (registry.c), turn healthy once the server's dial-back reached them, and leave
 * when their registration call ends. */
#ifndef MESHD_AGENT_POOL_H
#define MESHD_AGENT_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "agent_link.h"
#include "error_kind.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "rpc.h"
#include "secret.h"
#include "watermark.h"

typedef struct agent_pool agent_pool_t;

/* Called whenever the count of healthy agents changes, one call at a time and
 * with the count as it is then (so the last call has the last word), without
 * the pool's lock held: it may read the pool, not change an agent's health. */
typedef void (*agent_pool_changed_fn)(int healthy, void *arg);

typedef struct agent_desc {
  char agent_id[64];
  char address[256];
  char device[32];
  uint64_t memory_bytes;
  uint32_t data_port;
  uint32_t pid;
  /* The agent's build as it reported it (RegisterRequest; "" from older agents). */
  char version[32];
  char commit[48];
  char build_type[24];
  bool cuda;
  /* The newest Instruction body it runs (RegisterRequest.instructions; 0: older). */
  uint32_t instructions;
  /* The newest data plane feature it has (RegisterRequest.data_plane; 0: older). */
  uint32_t data_plane;
  /* What every call to the agent carries (SECRET_AGENT_MD; RegisterRequest.call_secret).
   * Never shown (ListAgents) nor logged. */
  char call_secret[SECRET_HEX_LEN + 1];
  /* The registry's number for this registration (0: none). An agent that
   * registers again (same agent_id, often the same rank) is a registration of
   * its own: the calls below that name a number act on that registration only,
   * never on a later one of the same agent (an old dial-back's channel, an old
   * call's removal). 0 in those calls: whichever registration of agent_id. */
  uint64_t registration;
} agent_desc_t;

/* Ranks 0 .. max - 1 (--max-agents): the pool's array is sized by rank. */
#define AGENT_POOL_DEFAULT_MAX 1024

/* An agent lost: its Execute link broke (the agent died, hung past the
 * keepalive timeout, or left). */
typedef struct agent_lost {
  uint32_t rank;
  char agent_id[64];
  char data_address[300]; /* its data plane "host:port" ("" if none) */
  int64_t unix_ms;        /* when the server learned it */
  uint64_t loss;          /* its number: agent_pool_losses() counts it */
} agent_lost_t;
typedef void (*agent_pool_lost_fn)(const agent_lost_t *lost, void *arg);

/* What the pool tells its owner. Every member may be NULL. Callbacks run
 * without pool locks held; the link ones on an agent link's reader thread (or,
 * for on_lost, the thread that removed the agent). */
typedef struct agent_pool_callbacks {
  agent_pool_changed_fn changed;
  /* Every AgentReport, before the watermark moves: errors recorded here are
   * in place when a wait on that watermark fires. */
  agent_link_report_fn on_report;
  /* An agent's link is gone (the agent died or left, or its Execute call
   * broke): seqs it had not executed never will. Once per link, before the
   * waits on those seqs fail. */
  agent_pool_lost_fn on_lost;
  void *arg;
} agent_pool_callbacks_t;

/* cb is copied (NULL: no callbacks). */
agent_pool_t *agent_pool_create(const agent_pool_callbacks_t *cb);
/* Closes every link, fails pending waits with WATERMARK_CANCELLED, frees. */
void agent_pool_destroy(agent_pool_t *pool);

/* The most agents the pool holds: ranks 0 .. max - 1 (default
 * AGENT_POOL_DEFAULT_MAX). Before the first agent_pool_add. */
void agent_pool_set_max_agents(agent_pool_t *pool, int max);
int agent_pool_max_agents(agent_pool_t *pool);
/* TLS of every channel the server opens to an agent (cluster mTLS; .on false:
 * plaintext). Copied; the strings must outlive the pool. Before any agent. */
void agent_pool_set_agent_tls(agent_pool_t *pool, const rpc_tls_t *tls);
/* How a client of the direct data path dials the agents (AgentTls): without
 * agent TLS, *ca_pem and *server_name NULL; with it, a copy of the CA's PEM
 * (the caller frees it; read from the CA file, again once the file changed)
 * and the name the agents' certificates carry (the pool's string). Returns 0,
 * or -1 with err when the CA file was never readable. Thread-safe. */
int agent_pool_client_tls(agent_pool_t *pool, char **ca_pem, const char **server_name, char *err,
                          size_t errlen);

/* How long a rank stays kept, after its agent left, from agents that ask for
 * any rank, when that agent had asked for it by number (--rank). */
#define AGENT_POOL_RESERVE_MS 10000

/* Admits an agent: rank `requested` if >= 0 and free, else the lowest free rank
 * (one whose last agent asked for it by number and left less than
 * AGENT_POOL_RESERVE_MS ago only when no other is free).
 * Returns the rank, or -1 with a message in err when the requested rank is held
 * by another live agent, the id is already registered, or the rank would be
 * max_agents or more (the message names --max-agents). */
int agent_pool_add(agent_pool_t *pool, const agent_desc_t *d, int requested, char *err,
                   size_t errlen);
/* Who stands in the way of agent_pool_add(d, requested): the agent already
 * registered as d->agent_id, else the agent holding the requested rank (or
 * the one still being released from it: leaving, agent_id ""). */
typedef struct agent_pool_holder {
  uint32_t rank;
  char agent_id[64];
  uint64_t registration;
  bool leaving;
  bool healthy;
} agent_pool_holder_t;
/* True, with *out, when such an agent holds d->agent_id or the requested rank. */
bool agent_pool_holder(agent_pool_t *pool, const agent_desc_t *d, int requested,
                       agent_pool_holder_t *out);
/* Removes rank's agent if it is still `agent_id` (and registration, if not 0):
 * a newer agent, or a newer registration of the same one, may hold the rank. */
void agent_pool_remove(agent_pool_t *pool, uint32_t rank, const char *agent_id,
                       uint64_t registration, const char *why);
/* Marks the agent healthy (dial-back answered, agent reports healthy) or not. */
void agent_pool_set_healthy(agent_pool_t *pool, uint32_t rank, const char *agent_id,
                            uint64_t registration, bool healthy);
/* The agent's allocated bytes (AgentStatus), for that registration of it (if
 * not 0): a status still coming on an earlier registration's call must not
 * set the new one's figure. */
void agent_pool_set_allocated(agent_pool_t *pool, uint32_t rank, const char *agent_id,
                              uint64_t registration, uint64_t bytes);
/* A message the agent stamped agent_ms by its clock (HelloReply.unix_ms,
 * AgentReport.unix_ms), received at recv_ms by the server's
 * (grant_now_unix_ms): a sample of its clock's offset from the server's
 * (grant.h, Clocks), which its transfer grants' times are written with.
 * agent_ms 0 (an older agent) is none: its offset stays 0. Returns the
 * estimate now. */
int64_t agent_pool_clock_sample(agent_pool_t *pool, uint32_t rank, const char *agent_id,
                                uint64_t registration, int64_t agent_ms, int64_t recv_ms);
/* Keeps the dial-back channel (the pool owns and destroys it from now on) and
 * opens the agent's Execute link on it. A healthy agent always has a link; an
 * agent whose link breaks turns unhealthy. */
void agent_pool_set_channel(agent_pool_t *pool, uint32_t rank, const char *agent_id,
                            uint64_t registration, rpc_channel_t *ch);

/* Queues an instruction for rank (see agent_link_send: the caller keeps ins,
 * its seq field is ignored). Never waits for the agent. Returns 0 and the seq
 * in *seq_out (may be NULL), or -1 if rank has no live link. Seqs are per
 * rank, strictly increasing, and not reused when the agent at a rank is
 * replaced: a later agent continues the numbering. */
int agent_pool_send(agent_pool_t *pool, uint32_t rank, const Meshd__Agent__V1__Instruction *ins,
                    uint64_t *seq_out);
/* rank's data plane "host:port" (the host of its advertised address and its
 * data_port) into buf; "" when the rank has no agent or no data plane.
 * Returns buf. */
const char *agent_pool_data_address(agent_pool_t *pool, uint32_t rank, char *buf, size_t len);
/* rank's agent address (what the server dials) into buf, for calls on a
 * channel of the caller's own. Returns 0, or -1 if the rank has no agent. */
int agent_pool_address(agent_pool_t *pool, uint32_t rank, char *buf, size_t len);

/* Everything a call to rank's agent on a channel of the caller's own needs:
 *
 *   agent_target_t t;
 *   if (agent_pool_target(pool, rank, 5000, &t)) -> the rank has no agent
 *   rpc_channel_t *ch = rpc_channel_create(t.address, &t.opts);
 *   rpc_stream_t *st = rpc_stream_open(ch, "/meshd.agent.v1.Agent/Read", t.md, 1, ms);
 *
 * md points into the struct itself: use it where it was filled, do not copy it. */
typedef struct agent_target {
  char address[256];
  rpc_channel_opts_t opts; /* the pool's agent TLS, connect_timeout_ms as asked */
  char secret[SECRET_HEX_LEN + 1];
  rpc_md_t md[1];          /* {SECRET_AGENT_MD, secret} */
  int64_t clock_offset_ms; /* its clock's offset (agent_pool_clock_sample): for its grants */
} agent_target_t;
/* The channel data calls (Agent/Read, Agent/Write) to rank's agent go on:
 * one per agent, made at the first transfer and kept while the agent is
 * registered, so that a transfer does not pay for a connection (a 1 MiB
 * Upload spent more on its new connection than on its bytes). Fills *t as
 * agent_pool_target does (the secret for each call's metadata). NULL if the
 * rank has no agent. The caller holds a reference: agent_data_release it. */
#define AGENT_DATA_CONNECT_MS 5000       /* a CPU-starved agent is not a lost one */
#define AGENT_DATA_WINDOW (1 << 20)     /* each Read's stream window */
typedef struct agent_data agent_data_t;
agent_data_t *agent_pool_data(agent_pool_t *pool, uint32_t rank, agent_target_t *t);
rpc_channel_t *agent_data_channel(const agent_data_t *d);
void agent_data_release(agent_data_t *d); /* NULL: nothing */
/* Returns 0, or -1 if the rank has no agent. */
int agent_pool_target(agent_pool_t *pool, uint32_t rank, int connect_timeout_ms,
                      agent_target_t *out);
/* Highest seq given out to rank (0: none). */
uint64_t agent_pool_last_seq(agent_pool_t *pool, uint32_t rank);
/* Whether instruction `seq` (0: none) went to rank on its current Execute link,
 * and that link is not broken. The agent keeps a session that an instruction
 * opened for as long as that link's call lasts (unless EndSession ends it): a
 * new link is a new call with no sessions, and its seqs start above every
 * earlier link's. */
bool agent_pool_on_link(agent_pool_t *pool, uint32_t rank, uint64_t seq);
/* The same for an instruction packed with agent_link_pack, which it consumes
 * (send one instruction to many ranks: pack once, agent_link_msg_clone each). */
int agent_pool_send_msg(agent_pool_t *pool, uint32_t rank, agent_link_msg_t *m,
                        uint64_t *seq_out);
/* Highest seq rank has executed (0: none). Monotone, survives agent loss. */
uint64_t agent_pool_executed(agent_pool_t *pool, uint32_t rank);
/* Instructions queued for rank and not yet written (0 without a link). */
size_t agent_pool_queued(agent_pool_t *pool, uint32_t rank);
/* Over all agents, for the metrics. */
typedef struct agent_pool_totals {
  /* Instructions given a seq on the live links and not yet reported executed
   * (an agent reports the highest seq through which it ran everything, so
   * one waiting stream holds back its agent's count). */
  uint64_t pending;
  /* InstructionBatch messages, and the instructions in them, written since
   * the pool began, over every link it had. */
  uint64_t batches, instructions;
} agent_pool_totals_t;
agent_pool_totals_t agent_pool_totals(agent_pool_t *pool);
/* Sends what rank's link holds back (agent_link_defer_begin) now: someone
 * waits for, or asks about, that rank's progress. Waits on the pool's
 * watermark do this by themselves. */
void agent_pool_flush(agent_pool_t *pool, uint32_t rank);
/* The watermark fed by every link: wait on it for Sync (watermark.h). Lives
 * as long as the pool. */
watermark_t *agent_pool_watermark(agent_pool_t *pool);
int agent_pool_healthy(agent_pool_t *pool);
/* map[rank] = rank has a healthy agent, for ranks 0..*world-1 (malloc'd; free it).
 * NULL (and *world 0) out of memory. */
bool *agent_pool_healthy_map(agent_pool_t *pool, size_t *world);
/* The first of ranks whose agent runs no Instruction body as new as `body`
 * (its version, as it reported it, into version), or -1 if every one does. */
int64_t agent_pool_first_without(agent_pool_t *pool, const uint32_t *ranks, size_t n,
                                 uint32_t body, char *version, size_t len);
/* The newest data plane feature every one of ranks has (the least of their
 * RegisterRequest.data_plane; 0 when one is gone). */
uint32_t agent_pool_data_plane(agent_pool_t *pool, const uint32_t *ranks, size_t n);
int agent_pool_size(agent_pool_t *pool);
/* How many agents are registered, and of them healthy and drained (GetInfo's
 * counts), all read at one moment. */
typedef struct agent_pool_census {
  uint32_t total, healthy, drained;
} agent_pool_census_t;
agent_pool_census_t agent_pool_census(agent_pool_t *pool);
/* Agents lost so far (agent_lost_t.loss of the latest). A mesh made when this
 * was L is broken if one of its ranks was lost later. */
uint64_t agent_pool_losses(agent_pool_t *pool);
/* 0, or -1 with err (AGENT_LOST, naming the command, the rank and when) when
 * one of ranks[0..n) was lost after the pool counted `since` losses. */
int agent_pool_check_lost(agent_pool_t *pool, const uint32_t *ranks, size_t n, uint64_t since,
                          const char *cmd, meshd_error_t *err);
/* Drains rank (takes it out of placement) or undrains it. The state belongs
 * to the rank, survives its agent leaving and registering again, and lives in
 * memory only. Returns 0 (also when it was so already), or -1 with err
 * (UNKNOWN_REF, naming the rank) when no agent holds the rank (undraining a
 * drained rank whose agent is away is allowed). */
int agent_pool_set_drained(agent_pool_t *pool, uint32_t rank, bool drained, meshd_error_t *err);
/* map[rank] = rank was drained at or before since_ms (rpc_now_ms clock): what
 * a session created at since_ms must not be placed on. world entries,
 * malloc'd (free it); NULL out of memory. */
bool *agent_pool_drained_map(agent_pool_t *pool, int64_t since_ms, size_t world);
/* The smallest capacity (memory_bytes at registration) among the agents of
 * ranks[0..n) that are registered now; 0 when none is. */
uint64_t agent_pool_min_capacity(agent_pool_t *pool, const uint32_t *ranks, size_t n);
/* A snapshot for ListAgents: *out is an array of *n AgentInfo pointers, all
 * malloc'd; free with agent_pool_snapshot_free. Returns 0 or -1 (out of memory). */
int agent_pool_snapshot(agent_pool_t *pool, Meshd__V1__AgentInfo ***out, size_t *n);
void agent_pool_snapshot_free(Meshd__V1__AgentInfo **infos, size_t n);
/* One page of agent_pool_snapshot for ListAgents (page_token.h): at most limit
 * (>= 1) agents, rank order, from rank `after` on (a row's number is its rank
 * + 1, so after is the number of the last row a page showed; 0: from the
 * first). *next is the number of this page's last row when more agents follow,
 * 0 on the last page. Returns 0; -1 out of memory; -2 when `after` is past any
 * rank this pool may hold (a forged page token). */
int agent_pool_snapshot_page(agent_pool_t *pool, uint64_t after, size_t limit,
                             Meshd__V1__AgentInfo ***out, size_t *n, uint64_t *next);
/* A random number drawn when the pool was made: ListAgents' page tokens carry it. */
uint32_t agent_pool_epoch(const agent_pool_t *pool);

#endif
