/* meshd.v1.AgentRegistry: agents register on a long-lived bidi call.
 *
 * First message: RegisterRequest. The server admits the agent to the pool,
 * answers RegisterAccepted{rank}, and dials the agent back (Agent/Hello with
 * its id) from the registry's own thread; the agent counts as healthy once
 * that answered. The call's end removes the agent from the pool. */
#ifndef MESHD_REGISTRY_H
#define MESHD_REGISTRY_H

#include <stddef.h>

#include "agent_pool.h"
#include "rpc.h"

typedef struct registry registry_t;

/* pool must outlive the registry. Returns NULL if the dial-back thread cannot start. */
registry_t *registry_create(agent_pool_t *pool, const char *server_id, int dial_timeout_ms);
/* The method table (one row, static storage), *n its count. Register it with
 * the registry_t * as arg; the registry must outlive the server. */
const rpc_method_t *registry_methods(size_t *n);
/* Registration calls open now. */
int registry_open_calls(registry_t *r);
/* Ends every registration call with UNAVAILABLE "server shutting down". */
void registry_close_all(registry_t *r);
/* After the rpc server is shut down: stops the dial-back thread, frees. */
void registry_destroy(registry_t *r);

#endif
