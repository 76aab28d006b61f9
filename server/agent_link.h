/* The instruction channel to one agent: one /meshd.agent.v1.Agent/Execute
 * bidi call on the agent's dial-back channel (DESIGN §4).
 *
 * agent_link_send never waits for the network: it packs the instruction,
 * gives it the link's next seq and queues it. A writer thread drains the
 * queue into InstructionBatch messages (everything queued, up to
 * AGENT_LINK_BATCH_MAX instructions or AGENT_LINK_BATCH_BYTES per batch).
 * AgentReport messages are handed to on_report on the rpc layer's client
 * thread (rpc_duplex: no thread per link waits in gRPC), so on_report must
 * not block.
 *
 * When the call ends on its own (agent died, agent refused the stream) the
 * link is broken: queued instructions are dropped, later sends fail, and
 * on_lost runs once. agent_link_close does not call on_lost.
 *
 * Owned by whoever opened it (the agent pool); every function is thread-safe
 * except agent_link_stop and agent_link_close: one thread, after which only
 * queries (after stop) or nothing (after close) may follow. */
#ifndef MESHD_AGENT_LINK_H
#define MESHD_AGENT_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "meshd/agent/v1/agent.pb-c.h"
#include "rpc.h"

#define AGENT_LINK_METHOD "/meshd.agent.v1.Agent/Execute"
#define AGENT_LINK_BATCH_MAX 1000 /* instructions per InstructionBatch */
/* Packed bytes per batch; a larger instruction goes alone. */
#define AGENT_LINK_BATCH_BYTES (1024 * 1024)
/* Largest packed instruction: a batch of one stays under the 4 MiB message limit. */
#define AGENT_LINK_MAX_INSTRUCTION (3 * 1024 * 1024)

typedef struct agent_link agent_link_t;

/* One AgentReport, checked against what was sent. Everything is valid during
 * the call only. */
typedef struct agent_link_report {
  uint64_t executed;  /* every seq <= it has run (never goes down between calls) */
  /* Per-session progress (0 from an agent without it: use `executed` for
   * every session): a session listed in `sessions` has run each of its seqs
   * <= its executed_through; any other has run each of its seqs <= received. */
  uint64_t received;
  const Meshd__Agent__V1__SessionProgress *const *sessions;
  size_t n_sessions;
  const Meshd__V1__Error *const *errors; /* root failures */
  size_t n_errors;
  uint64_t allocated_bytes;
  /* The agent's clock when it sent the report (0: an older agent), and ours
   * when it came (both Unix ms): a sample of its clock's offset. */
  int64_t agent_unix_ms, recv_unix_ms;
} agent_link_report_t;

/* On the rpc layer's client thread, one report at a time: must not block. */
typedef void (*agent_link_report_fn)(uint32_t rank, const agent_link_report_t *r, void *arg);
/* The link broke; called once, from the link's writer thread (may block). */
typedef void (*agent_link_lost_fn)(uint32_t rank, void *arg);

typedef struct agent_link_callbacks {
  agent_link_report_fn on_report; /* may be NULL */
  agent_link_lost_fn on_lost;     /* may be NULL */
  void *arg;
} agent_link_callbacks_t;

typedef struct agent_link_stats {
  uint64_t last_seq;        /* highest seq given out (first_seq - 1: none yet) */
  uint64_t executed;        /* highest seq the agent reported executed */
  size_t queued;            /* instructions waiting for the writer */
  size_t queued_bytes;
  uint64_t batches_sent;
  uint64_t instructions_sent;
  uint64_t reports;
  bool broken;
} agent_link_stats_t;

/* Opens the Execute call on ch (which must outlive the link) and starts the
 * threads. Seqs start at first_seq (>= 1) and go up by one per send.
 * call_secret (NULL: none) travels as SECRET_AGENT_MD metadata: the agent's
 * proof that the call comes from the server it registered with.
 * cb is copied. Returns NULL if the call or the threads cannot start. */
agent_link_t *agent_link_open(rpc_channel_t *ch, uint32_t rank, const char *agent_id,
                              uint64_t first_seq, const char *call_secret,
                              const agent_link_callbacks_t *cb);

/* Queues a copy of ins (its seq field is ignored; the caller keeps ins) and
 * returns the seq it got, or 0 if the link is broken or closing, or the
 * instruction packs to more than AGENT_LINK_MAX_INSTRUCTION bytes. */
uint64_t agent_link_send(agent_link_t *l, const Meshd__Agent__V1__Instruction *ins);

/* The same in two steps, so a caller can pack outside its own lock and only
 * take a seq under it. agent_link_pack returns NULL when the instruction is
 * too large (or out of memory); agent_link_push takes ownership of the packed
 * instruction in every case. */
typedef struct agent_link_msg agent_link_msg_t;
agent_link_msg_t *agent_link_pack(const Meshd__Agent__V1__Instruction *ins);
uint64_t agent_link_push(agent_link_t *l, agent_link_msg_t *m);
void agent_link_msg_free(agent_link_msg_t *m);
/* Packed bytes of an instruction not yet pushed (what it costs queued). */
size_t agent_link_msg_len(const agent_link_msg_t *m);
/* A copy of a packed instruction not yet pushed (one memcpy: sending the same
 * instruction to many ranks packs it once). NULL when out of memory. */
agent_link_msg_t *agent_link_msg_clone(const agent_link_msg_t *m);

/* Corking, for a thread about to queue many instructions in a row (the
 * commands of one Submit batch): between agent_link_cork and
 * agent_link_uncork (on the same thread; they nest) the links it pushes to
 * hold their writers back, so that its instructions go out as one
 * InstructionBatch instead of as many as the writer manages to take. A
 * writer goes anyway at 256 queued instructions or after the hold (3 ms,
 * agent_link_set_hold_ms), so a corked thread that blocks delays a link but
 * never stalls it. */
void agent_link_cork(void);
void agent_link_uncork(void);
/* A cork that lasts until agent_link_uncork_idle, which the server's
 * completion-queue threads call before they wait for the next event
 * (rpc_server_opts_t.before_wait): a Submit stream of one command per message
 * thus sends the agents what arrived back to back as one batch. Taken once
 * per thread however often it is called. */
void agent_link_cork_until_idle(void);
void agent_link_uncork_idle(void);

/* Deferring, for instructions nobody waits for yet (a unary Execute's): what
 * a thread pushes between agent_link_defer_begin and agent_link_defer_end
 * (they nest) may wait in its link for company, up to 256 queued or the hold,
 * so that a client's calls one at a time reach an agent as a few batches
 * instead of one wake-up each. Any other push to the link, and
 * agent_link_flush, send what waits at once. The server flushes a rank's
 * link whenever something starts waiting for that rank's progress (a Sync,
 * a Fetch, a full flow window: watermark_set_kick), so deferral delays only
 * work that nothing waits for. */
void agent_link_defer_begin(void);
void agent_link_defer_end(void);
void agent_link_flush(agent_link_t *l);

/* How long a corked or deferring link holds back at most (20 ms unless set;
 * 0: links never hold back). Process-wide: meshd's --link-hold-ms. */
void agent_link_set_hold_ms(int ms);
/* A deferred hold that no other push joined within this long ends then (1 ms
 * unless set; 0: deferred holds last until flushed, joined or the hold's end).
 * Process-wide: meshd's --link-lone-ms. */
void agent_link_set_lone_ms(int ms);
/* The server is stopping (after its drain): links lost from now on are logged
 * at info, not warn (its local agents stop with it). */
void agent_links_server_stopping(void);
bool agent_links_stopping(void); /* whether it was called */

/* Highest seq the agent reported executed (first_seq - 1 until the first report). */
uint64_t agent_link_executed(agent_link_t *l);
/* Highest seq given out. Frozen once the link is broken. */
uint64_t agent_link_last_seq(agent_link_t *l);
/* Instructions queued and not yet written to gRPC. */
size_t agent_link_queued(agent_link_t *l);
bool agent_link_broken(agent_link_t *l);
void agent_link_stats(agent_link_t *l, agent_link_stats_t *out);
uint32_t agent_link_rank(const agent_link_t *l);

/* Cancels the call and joins the writer (a running callback finishes first;
 * so never call it while holding a lock the callbacks take). Prompt: it does
 * not wait for the agent. Afterwards no callback runs, sends fail, and the
 * queries above return final values. Idempotent. */
void agent_link_stop(agent_link_t *l);
/* agent_link_stop, then frees. NULL: no-op. */
void agent_link_close(agent_link_t *l);

#endif
