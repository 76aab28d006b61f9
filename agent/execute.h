/* meshd.agent.v1.Agent/Execute on the agent: the server's instruction stream.
 *
 * One bidi call per server. Each InstructionBatch is checked instruction by
 * instruction: session_id must be set, a body must be set, and seqs must go up
 * by exactly one within the call (the first one sets the base: a server
 * continues a rank's numbering when it replaces an agent). A gap or repeat
 * ends the call with INVALID_ARGUMENT naming the seq, after acknowledging the
 * instructions before it. Instructions run on the call's executor (executor.h); AgentReports
 * carry its watermark (executed_through: every seq up to it has RUN), the
 * root failures and the bytes allocated, whenever they change and at least
 * once after each batch (acks are batched, GRPC_NOTES §7). A refused call
 * ends once what it took before the bad instruction has run and been reported.
 *
 * Everything belongs to the call: when it ends (its server is gone) every
 * session it ran is ended and its memory freed.
 *
 * One call at a time: a second Execute call (a restarted or different server)
 * replaces the first, which ends with ABORTED. The handlers never block. */
#ifndef MESHD_EXECUTE_H
#define MESHD_EXECUTE_H

#include <stddef.h>

#include "executor.h"
#include "rpc.h"

/* The row's handlers; `arg` is the agent_info_t (agent.h) like the other rows. */
void execute_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg);
void execute_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg);
void execute_end(rpc_call_t *call, bool cancelled, void *arg);

/* Ends the current Execute call, if any, with ABORTED "`why`", as a broken link
 * would (the server loses its link, ends the registration, and the agent
 * registers again). Any thread. Returns true if there was a call to end. */
bool execute_cut(const char *why);
/* Sessions open on the current Execute call (0 without one). For tests and logs. */
size_t execute_sessions(void);
/* The current call's executor, referenced (executor_unref it); NULL without one. */
executor_t *execute_executor(void);

#endif
