/* meshd.agent.v1.Agent/Execute on the agent: the server's instruction stream.
 *
 * One bidi call per server. Each InstructionBatch is checked instruction by
 * instruction: session_id must be set, a body must be set, and seqs must go up
 * by exactly one within the call (the first one sets the base: a server
 * continues a rank's numbering when it replaces an agent). A gap or repeat
 * ends the call with INVALID_ARGUMENT naming the seq, after acknowledging the
 * instructions before it. Each batch is answered by one AgentReport whose
 * executed_through is the last seq taken (acks are batched, GRPC_NOTES §7).
 *
 * For now instructions are recorded, not computed: the state kept is the set
 * of sessions seen on the call (EndSession drops one). That state belongs to
 * the call: when the call ends (its server is gone) it is freed.
 *
 * One call at a time: a second Execute call (a restarted or different server)
 * replaces the first, which ends with ABORTED. The handlers never block. */
#ifndef MESHD_EXECUTE_H
#define MESHD_EXECUTE_H

#include <stddef.h>

#include "rpc.h"

/* The row's handlers; `arg` is the agent_info_t (agent.h) like the other rows. */
void execute_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg);
void execute_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg);
void execute_end(rpc_call_t *call, bool cancelled, void *arg);

/* Sessions open on the current Execute call (0 without one). For tests and logs. */
size_t execute_sessions(void);

#endif
