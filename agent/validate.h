/* What an agent checks in every instruction before it queues or runs it, and
 * in every Agent/Write spec: the server's rules, applied again by the agent,
 * so that a corrupt or hostile instruction fails with a clear error instead of
 * planting a tensor no kernel can handle.
 *
 *   char why[300];
 *   if (validate_envelope(ins, why, sizeof why)) end_the_stream(why); // execute.c
 *   meshd_error_t e;
 *   if (validate_instruction(ins, &self, &e)) fail_it(&e);            // executor.c
 *
 * The checks are static: they read the instruction and what the agent is
 * (its rank, its data address), never its session's state. Shapes, dtypes,
 * ops and factories are checked by core/tensor's own rules (layout_check_shape,
 * ops_bind, ops_infer, reduction_parse): no second copy of them lives here.
 * What depends on the session's tensors (an input is live, a result is not,
 * a spec matches the tensor it names) is run.c's, as the instruction runs.
 * Messages name the field and the value at fault ("ReduceOp.input.shape:
 * shape [2147483648, ...] with 4-byte elements exceeds 2^62 bytes"). */
#ifndef MESHD_AGENT_VALIDATE_H
#define MESHD_AGENT_VALIDATE_H

#include <stddef.h>
#include <stdint.h>

#include "error_kind.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "ops.h"
#include "reduction.h"

/* Session ids are the server's 32 hex characters; an agent takes up to 63. */
#define VALIDATE_SESSION_ID_MAX 63
/* World ranks an agent accepts in a group, a send or a PeerLost. */
#define VALIDATE_RANK_MAX ((uint32_t)1 << 20)
/* Members of one collective group (the data plane's limit; the server's
 * checks take the same bound). */
#define VALIDATE_GROUP_MAX REDUCE_GROUP_MAX
/* A data plane "host:port". */
#define VALIDATE_ADDRESS_MAX 255
/* Nonces one RevokeGrants names at most (the server sends one per grant). */
#define VALIDATE_REVOKE_MAX 1024
/* Positional and keyword arguments of one OpCall, tensors in one argument list. */
#define VALIDATE_ARGS_MAX 16
#define VALIDATE_LIST_MAX 64

/* What the checks know of the agent: its world rank (-1 before Hello) and its
 * data plane address (NULL or "" when it has none); a group must hold it once. */
typedef struct validate_self {
  int64_t rank;
  const char *data_address;
} validate_self_t;

/* A session id as an instruction, a Read or a Write carries it: 1 to
 * VALIDATE_SESSION_ID_MAX printable ASCII characters. 0, or -1 with why
 * ("session_id has 70 characters, more than 63"). */
int validate_session_id(const char *id, char *why, size_t len);

/* The checks that break the Execute stream (execute.c ends the call): a
 * session id that is empty, longer than VALIDATE_SESSION_ID_MAX or not
 * printable ASCII, or no body. Seqs are execute.c's. 0, or -1 with why. */
int validate_envelope(const Meshd__Agent__V1__Instruction *ins, char *why, size_t len);

/* Every static rule of one instruction whose envelope passed. 0, or -1 with
 * *e (kind BAD_ARGUMENT; the message starts with the instruction's kind and
 * seq). Kind QUOTA when only this agent's tensor limits refuse it (it passes
 * within the hard bounds): its peers, whose limits may differ, may run it. */
int validate_instruction(const Meshd__Agent__V1__Instruction *ins, const validate_self_t *self,
                         meshd_error_t *e);

/* One TensorSpec (`field` names it in messages; NULL spec: "is missing"):
 * a known dtype, a shape core/tensor accepts (layout_check_shape), strides
 * absent or one per dim and >= 0, offset >= 0, and every element it views at
 * byte offsets below 2^62. 0, or -1 with *e. */
int validate_spec(const Meshd__Agent__V1__TensorSpec *sp, const char *field, meshd_error_t *e);
/* validate_spec, and the spec is a meta: *m gets its dtype and layout. */
int validate_spec_meta(const Meshd__Agent__V1__TensorSpec *sp, const char *field,
                       tensor_meta_t *m, meshd_error_t *e);

/* The refs an instruction defines (results; an in-place reduce's input),
 * which fail when it is refused. Up to cap of them into refs; returns how many. */
size_t validate_result_refs(const Meshd__Agent__V1__Instruction *ins, uint64_t *refs, size_t cap);

/* "Factory", "OpCall add", "ReduceOp", ...: an instruction's name in messages. */
const char *validate_kind_name(const Meshd__Agent__V1__Instruction *ins);

#endif
