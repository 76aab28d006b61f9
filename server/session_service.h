/* The session RPCs of meshd.v1.TensorService (CreateSession, CloseSession,
 * KeepAlive, ListSessions) and the helper every other TensorService handler
 * uses to find the caller's session. */
#ifndef MESHD_SESSION_SERVICE_H
#define MESHD_SESSION_SERVICE_H

#include <stddef.h>

#include "fault.h"
#include "rpc.h"
#include "session.h"

/* Request metadata that names the caller's session (docs/protocol.md). */
#define SESSION_MD_ID "meshd-session"
#define SESSION_MD_TOKEN "meshd-token"

/* The four rows (static storage), *n their count. Register them with the
 * session_table_t * as arg; the table must outlive the server. */
const rpc_method_t *session_service_methods(size_t *n);

/* --server-fault session:slow=MS: CreateSession's answer is held MS ms once
 * its session is in the table (a lost answer, for tests). NULL: none. */
void session_service_set_fault(fault_t *f);

/* The session named by the call's metadata, acquired (session_release it when
 * the call no longer needs it). On failure it FINISHES the call with
 * UNAUTHENTICATED and kind NO_SESSION, a message that names the method and
 * what to do, and returns NULL: the handler then just returns. */
session_t *session_from_call(session_table_t *t, rpc_call_t *call);

#endif
