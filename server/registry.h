/* meshd.v1.AgentRegistry: agents register on a long-lived bidi call.
 *
 * First message: RegisterRequest. The server admits the agent to the pool,
 * answers RegisterAccepted{rank}, and dials the agent back (Agent/Hello with
 * its id) from the registry's own thread; the agent counts as healthy once
 * that answered. The call's end removes the agent from the pool.
 *
 * Liveness: the dial-back channel, which the pool keeps for the agent's
 * Execute link, pings the agent every second and gives up after
 * agent_timeout_ms without an ack (a hung or SIGSTOPped agent, a silent
 * network); the link then breaks and the pool marks the agent unhealthy. The
 * registry's thread notices (it checks the pool every REGISTRY_SWEEP_MS) and
 * ends that agent's registration call with UNAVAILABLE, which removes it from
 * the pool; the agent, once it runs again, registers anew. The same holds for
 * a link that breaks for any other reason: an agent without a link is of no
 * use, and registering again gives it a fresh one. */
#ifndef MESHD_REGISTRY_H
#define MESHD_REGISTRY_H

#include <stddef.h>

#include "agent_pool.h"
#include "rpc.h"

typedef struct registry registry_t;

#define REGISTRY_SWEEP_MS 250
#define REGISTRY_PING_MS 1000 /* keepalive period of the dial-back channels */

/* pool must outlive the registry. dial_timeout_ms bounds the Hello of the
 * dial-back; agent_timeout_ms (>= 1) is the keepalive ack timeout of the
 * dial-back channel (--agent-timeout). Returns NULL if the registry's thread
 * cannot start. */
registry_t *registry_create(agent_pool_t *pool, const char *server_id, int dial_timeout_ms,
                            int agent_timeout_ms);
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
