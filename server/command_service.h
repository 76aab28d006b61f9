/* TensorService/Execute (one command, unary) and TensorService/Submit (a bidi
 * stream of commands answered by seq, pipelined without waiting).
 *
 * Rejections: Execute ends with the kind's gRPC status, the message in the
 * details and the kind in the `meshd-error-kind` trailer; Submit answers with a
 * CommandResult carrying an Error and keeps the stream open. Sync is answered
 * once every agent the session touched has run everything issued before it.
 *
 * Flow control (flow.h): when a session holds too much accepted work the
 * agents have not run yet (or all sessions together do), the command that
 * passed the bound is accepted and answered, then a Submit stream reads no
 * further command, and an Execute's answer is held, until checkpoints show
 * that the agents caught up. A session's close, an agent's loss and the
 * server's shutdown all end such waits. Nothing blocks a completion-queue
 * thread. A command on a session closed while its Submit stream stays open
 * is refused with NO_SESSION. */
#ifndef MESHD_COMMAND_SERVICE_H
#define MESHD_COMMAND_SERVICE_H

#include "commands.h"
#include "flow.h"
#include "rpc.h"
#include "session.h"

typedef struct command_service command_service_t;

/* limits: the flow control bounds (flow.h; NULL: none). NULL on OOM. */
command_service_t *command_service_create(agent_pool_t *pool, session_table_t *sessions,
                                          const flow_limits_t *limits);
/* What Load commands may fetch (--url-allow and the --url-* flags): urls must
 * outlive the service. Without it, Load is refused. */
void command_service_set_urls(command_service_t *cs, const url_policy_t *urls);
/* The service's flow control (owned by it), for stats. */
flow_t *command_service_flow(command_service_t *cs);
/* The rows (Execute, Submit; static storage), *n their count. Register them
 * with the command_service_t * as arg; the service must outlive the server. */
const rpc_method_t *command_service_methods(size_t *n);
/* Session end: tells the agents the session touched to free it. For the
 * session table's on_closed callback. */
void command_service_session_closed(command_service_t *cs, session_t *s);
/* Root failures an agent reported (AgentReport.errors, each naming its
 * session): the tensor becomes failed on the server, and the next Sync of the
 * session returns the failure. For the pool's on_report callback. */
void command_service_on_report(command_service_t *cs, uint32_t rank,
                               const Meshd__V1__Error *const *errors, size_t n);
/* An agent was lost (the pool's on_lost): every session with work on it gets
 * an AGENT_LOST failure for its next Sync (or the one pending, which the
 * watermark fails), and PeerLost goes to the session's other ranks so that
 * its work there that needs the lost rank fails at once. */
void command_service_on_agent_lost(command_service_t *cs, const agent_lost_t *lost);
/* Frees the service. Pending Syncs are failed by the pool's watermark when the
 * pool is destroyed. */
/* Counts commands into `m` (meshd_commands_total{kind,status},
 * meshd_command_duration_seconds{kind}) and shows flow control
 * (meshd_queued_commands, meshd_queued_instruction_bytes, meshd_flow_waiting,
 * meshd_flow_waits_total); defines those families. Call before serving. */
typedef struct metrics_registry metrics_registry_t;
void command_service_set_metrics(command_service_t *cs, metrics_registry_t *m);
/* Sends the answers this thread held back (Submit streams' commands sent one
 * per message, answered together): the server's before_wait hook, with
 * agent_link_uncork_idle. */
void command_service_before_wait(void);
void command_service_destroy(command_service_t *cs);

#endif
