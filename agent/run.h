/* What each instruction does on the agent (run.c). The executor's worker of
 * the instruction's (session, stream) calls run_instruction; run reads and
 * writes the session's state (session_state.h) and calls the backend, and
 * hands the failures it finds back to the worker, which reports them. It
 * never calls back into the executor.
 *
 * Failures follow Monarch: a failing op marks its results and the inputs it
 * mutates failed with the root error (reported once); an instruction that
 * reads a failed ref is skipped and its results carry DEPENDENT_FAILURE
 * naming the root (reported too, marked as such, so that a reader on another
 * rank learns the value failed somewhere); collectives and sends still run
 * (failed inputs count as zeros) so that no peer waits forever. */
#ifndef MESHD_AGENT_RUN_H
#define MESHD_AGENT_RUN_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "fault.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "session_state.h"

/* Counts for the agent's metrics, updated by every worker. */
typedef struct agent_stats {
  _Atomic uint64_t instructions;     /* instructions run */
  _Atomic uint64_t collective_bytes; /* bytes put into collectives over several agents and sends */
} agent_stats_t;

/* What instructions run with (executor_create copies it; what it points to
 * must outlive the executor). Each piece may be NULL: instructions that need a
 * missing one fail with REMOTE_FAILURE saying so. The data plane is the
 * backend's (backend_t.net). */
typedef struct run_env {
  backend_t *backend;
  const char *data_address; /* this agent's data plane "host:port" (finds it in a Group) */
  _Atomic int64_t *rank;    /* world rank from Hello; -1 until known */
  agent_stats_t *stats;
  fault_t *fault;           /* fault injection (fault.h); NULL: none */
} run_env_t;

/* A failure to report: a root failure, or a dependent one (kind
 * DEPENDENT_FAILURE). */
typedef struct run_failure {
  error_kind_t kind;
  uint64_t seq, ref;
  char msg[600];
} run_failure_t;

/* At most one root failure, or one dependent failure per result and mutated
 * input, per instruction. */
#define RUN_MAX_FAILURES (2 * OP_MAX_RESULTS + 1)

typedef struct run_failures {
  run_failure_t v[RUN_MAX_FAILURES];
  size_t n;
} run_failures_t;

/* Runs ins (of session s, on its stream's worker; bs is that stream's backend
 * stream) to completion on the host side: its device work is queued on bs.
 * What failed is appended to *out (which the caller zeroed). */
void run_instruction(const run_env_t *env, session_state_t *s, backend_stream_t *bs,
                     const Meshd__Agent__V1__Instruction *ins, run_failures_t *out);
/* ins is queued (validated) and will run once the instructions before it on
 * its stream did: a collective's group is announced to the data plane
 * (dataplane_expect), so that members that reach the call before this agent
 * does are held proven, not crowded out by the cap on unproven connections. */
void run_expect(const run_env_t *env, const Meshd__Agent__V1__Instruction *ins);
/* ins failed validation (validate.h) with *why, or could not be queued:
 * instead of running, it fails the refs it would define
 * (validate_result_refs) and, for a Call, the tensors it would write in place
 * (its `mutates`: add_'s self) with why as their root failure, which is
 * appended to *out. tell_peers: the failure is this
 * agent's own (no device stream), not the instruction's, which every member
 * finds alike: the peers of a collective or send are told (dp_refuse)
 * rather than left waiting for it. */
void run_refused(const run_env_t *env, session_state_t *s, const Meshd__Agent__V1__Instruction *ins,
                 const meshd_error_t *why, bool tell_peers, run_failures_t *out);

#endif
